#!/usr/bin/env bash
# Build the `debian` guest image into OUT (a fresh directory):
#   vmlinux        the Debian kernel as an uncompressed ELF (same as tiny, booted through PVH)
#   initramfs.cpio small newc cpio: busybox + virtio/ext4 modules; /init mounts /dev/vda and
#                  switch_roots into it
#   disk.qcow2     the root filesystem: ext4 made by mmdebstrap (bookworm minbase + python3, git,
#                  qemu-guest-agent, ca-certificates), with /sbin/ff-init, ff-clone and ff-reseed
#   image.json     what was built from what (build.ts adds the disk's digest and the sizes)
# Usage: FF_RECIPE_HASH=H build-debian.sh OUT KERNEL_VERSION DISK_MIB APT_SOURCES_FILE
# The mirror is the machine's own apt sources file (APT_SOURCES_FILE), so no package host name
# is written anywhere in the project. Needs root (mmdebstrap in root mode), mmdebstrap,
# busybox-static, e2fsprogs (>= 1.47 for mkfs.ext4 -d), qemu-utils, cpio, xz-utils.
# Reproducible as far as the mirror allows: given the same packages from the mirror, the
# same recipe hash gives the same bytes (SOURCE_DATE_EPOCH for mmdebstrap, which then drops
# its logs and machine-id, and for python's .pyc files; no copy of this host's resolv.conf;
# the root disk made by mkext4.sh, as tiny's data disk). The package set is whatever the
# mirror serves at build time, which the recipe hash does not cover: two hosts can build
# different disks under one hash, and a snapshot's restore refuses a base disk whose digest
# is not the one the snapshot was taken over (driver.ts).
set -euo pipefail
export LC_ALL=C SOURCE_DATE_EPOCH=1704067200
umask 022
out=$1
kver=$2
disk_mib=${3:-1024}
sources=$4
seed=${FF_RECIPE_HASH:?FF_RECIPE_HASH must be set (it seeds the root disk UUID)}
here=$(cd "$(dirname "$0")" && pwd)
[ -d "$out" ] || { echo "OUT must exist" >&2; exit 2; }
[ -s "$sources" ] || { echo "apt sources file $sources missing" >&2; exit 2; }

# --- kernel (as build-tiny.sh): the XZ stream inside the bzImage, decompressed.
vmlinuz=/boot/vmlinuz-$kver
off=$(LC_ALL=C grep -abo $'\xfd7zXZ\x00' "$vmlinuz" | head -n1 | cut -d: -f1)
[ -n "$off" ] || { echo "no XZ stream in $vmlinuz" >&2; exit 1; }
tail -c +"$((off + 1))" "$vmlinuz" | xz -dc 2>/dev/null > "$out/vmlinux" || true
head -c 4 "$out/vmlinux" | grep -q $'\x7fELF' || { echo "vmlinux extraction failed" >&2; exit 1; }

work=$(mktemp -d "$out/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- root filesystem
rootfs=$work/rootfs
mkdir "$rootfs"
mmdebstrap --quiet --mode=root --variant=minbase \
  --include=python3,git,qemu-guest-agent,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='rm -f "$1/etc/resolv.conf"' \
  bookworm "$rootfs" "$sources" >&2
base64 -d "$here/ff-clone.b64" > "$rootfs/sbin/ff-clone"
base64 -d "$here/ff-reseed.b64" > "$rootfs/sbin/ff-reseed"
chmod 0755 "$rootfs/sbin/ff-clone" "$rootfs/sbin/ff-reseed"
echo forkfleet > "$rootfs/etc/hostname"
cat > "$rootfs/sbin/ff-init" <<'INIT'
#!/bin/sh
# Forkfleet debian guest init (PID 1 after switch_root); never exits. No systemd: the guest
# runs only what a sandbox needs, and qemu-ga is the host's way in.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc 2>/dev/null
mount -t sysfs sysfs /sys 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts 2>/dev/null
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs tmpfs /tmp
hn=forkfleet
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    ff.hostname=*) hn=${arg#ff.hostname=} ;;
    ff.sandbox=*) mkdir -p /run/forkfleet; echo "${arg#ff.sandbox=}" > /run/forkfleet/sandbox-id ;;
  esac
done
hostname "$hn"
port=
for i in $(seq 1 50); do
  for p in /sys/class/virtio-ports/*; do
    [ -f "$p/name" ] && [ "$(cat "$p/name")" = org.qemu.guest_agent.0 ] && port=/dev/${p##*/}
  done
  [ -n "$port" ] && [ -e "$port" ] && break
  sleep 0.1
done
if [ -n "$port" ]; then
  # The host's only way in: the OOM killer spares it (a program's runaway memory cannot take
  # it), and should it die anyway it is started again a second later.
  (echo -1000 > /proc/self/oom_score_adj; while true; do qemu-ga -m virtio-serial -p "$port" -t /run; sleep 1; done) </dev/null >/dev/null 2>&1 &
fi
echo "FORKFLEET_READY hostname=$hn agent=${port:-none}" > /dev/ttyS0
while true; do sleep 3600; done
INIT
chmod 0755 "$rootfs/sbin/ff-init"

# --- initramfs: busybox + modules, mounts the root disk and switch_roots.
ird=$work/initramfs
mkdir -p "$ird"/{bin,sbin,proc,sys,dev,newroot,lib/modules}
cp /bin/busybox "$ird/bin/busybox"
for a in sh mount umount insmod sleep switch_root cat echo mkdir; do ln -s busybox "$ird/bin/$a"; done
# Modules in dependency order, each one a module or built in (as build-tiny.sh: a modprobe
# that fails or answers neither stops the build).
mods=()
for m in virtio_mmio virtio_console virtio_blk virtio-rng ext4; do
  deps=$(modprobe -S "$kver" --show-depends "$m")
  found=0
  while read -r kind path _; do
    case $kind in
      insmod) mods+=("$path"); found=1 ;;
      builtin) found=1 ;;
    esac
  done <<<"$deps"
  [ "$found" = 1 ] || { echo "module $m: neither a module nor built in for kernel $kver (modprobe --show-depends)" >&2; exit 1; }
done
: > "$ird/lib/modules/load-order"
declare -A seen=()
for p in "${mods[@]}"; do
  [ -n "${seen[$p]:-}" ] && continue
  seen[$p]=1
  base=$(basename "$p")
  case "$p" in
    *.xz) xz -dc "$p" > "$ird/lib/modules/${base%.xz}"; base=${base%.xz} ;;
    *.zst) zstd -qdc "$p" > "$ird/lib/modules/${base%.zst}"; base=${base%.zst} ;;
    *) cp "$p" "$ird/lib/modules/$base" ;;
  esac
  echo "$base" >> "$ird/lib/modules/load-order"
done
cat > "$ird/init" <<'INIT'
#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do insmod "/lib/modules/$m" 2>/dev/null; done < /lib/modules/load-order
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
if ! mount -t ext4 -o rw,noatime /dev/vda /newroot; then
  echo "FORKFLEET_FAIL cannot mount /dev/vda" > /dev/ttyS0
  exec sh
fi
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/ff-init
INIT
chmod 0755 "$ird/init"
find "$ird" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$ird" && find . -print0 | sort -z | cpio --null -o -H newc --quiet --reproducible -R 0:0) > "$out/initramfs.cpio"

# --- root disk: ext4 straight from the tree (mkfs.ext4 -d), stored as qcow2.
bash "$here/mkext4.sh" "$work/disk.raw" "$disk_mib" ffroot "$rootfs" "$seed"
qemu-img convert -f raw -O qcow2 "$work/disk.raw" "$out/disk.qcow2"

cat > "$out/image.json" <<J
{"name":"debian","kernelVersion":"$kver","kernel":"vmlinux","initrd":"initramfs.cpio","disk":"disk.qcow2","diskFormat":"qcow2","rootOnDisk":true,"readyMarker":"FORKFLEET_READY","agentPort":"org.qemu.guest_agent.0"}
J
