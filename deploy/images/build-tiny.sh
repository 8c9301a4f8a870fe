#!/usr/bin/env bash
# Build the `tiny` guest image into OUT (a fresh directory):
#   vmlinux        the Debian kernel as an uncompressed ELF (booted through its PVH entry)
#   initramfs.cpio uncompressed newc cpio: busybox, virtio (incl. virtio_net)/ext4 modules, qemu-ga + ldd closure, /init
#   disk.qcow2     a small ext4 data disk (qcow2) the guest mounts at /data
#   image.json     what was built from what (build.ts adds the disk's digest and the sizes)
# Usage: FF_RECIPE_HASH=H build-tiny.sh OUT KERNEL_VERSION DISK_MIB
# Only Debian packages already on the machine are used (linux-image-amd64, busybox-static,
# qemu-guest-agent, e2fsprogs, cpio, xz-utils, qemu-utils). Nothing is downloaded.
# Reproducible: the same recipe hash gives the same bytes on every host (a snapshot's disk
# layer, restored elsewhere, overlays that host's own build of disk.qcow2). Every time in
# the image is SOURCE_DATE_EPOCH, the initramfs is cpio --reproducible, and the data disk is
# made by mkext4.sh with FF_RECIPE_HASH as its seed.
set -euo pipefail
export LC_ALL=C SOURCE_DATE_EPOCH=1704067200
umask 022
out=$1
kver=$2
disk_mib=${3:-64}
seed=${FF_RECIPE_HASH:?FF_RECIPE_HASH must be set (it seeds the data disk UUID)}
here=$(cd "$(dirname "$0")" && pwd)
[ -d "$out" ] || { echo "OUT must exist" >&2; exit 2; }

# --- kernel: find the XZ stream inside the bzImage and decompress it (scripts/extract-vmlinux).
vmlinuz=/boot/vmlinuz-$kver
off=$(LC_ALL=C grep -abo $'\xfd7zXZ\x00' "$vmlinuz" | head -n1 | cut -d: -f1)
[ -n "$off" ] || { echo "no XZ stream in $vmlinuz" >&2; exit 1; }
tail -c +"$((off + 1))" "$vmlinuz" | xz -dc 2>/dev/null > "$out/vmlinux" || true
head -c 4 "$out/vmlinux" | grep -q $'\x7fELF' || { echo "vmlinux extraction failed" >&2; exit 1; }

# --- initramfs tree
root=$(mktemp -d)
disk_tree=$(mktemp -d)
trap 'rm -rf "$root" "$disk_tree"' EXIT
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,run,tmp,data,etc,root,lib/modules,var/run}
cp /bin/busybox "$root/bin/busybox"
# Busybox applet links, created at build time so /init needs no --install.
for applet in $(/bin/busybox --list-full); do
  [ -e "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done

# Modules in dependency order (modprobe --show-depends), de-duplicated. Each one asked for
# must be a module (insmod lines) or built into the kernel (`builtin`, modules.builtin): a
# modprobe that fails, or answers neither (this kernel's depmod not run yet: an upgrade under
# way), stops the build instead of caching an image whose guest cannot find its disk. Its
# output is taken by an assignment, which set -e checks (a `< <(...)` is not checked).
mods=()
for m in virtio_mmio virtio_console virtio_blk virtio-rng virtio_net ext4; do
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
: > "$root/lib/modules/load-order"
declare -A seen=()
for p in "${mods[@]}"; do
  [ -n "${seen[$p]:-}" ] && continue
  seen[$p]=1
  base=$(basename "$p")
  case "$p" in
    *.xz) xz -dc "$p" > "$root/lib/modules/${base%.xz}"; base=${base%.xz} ;;
    *.zst) zstd -qdc "$p" > "$root/lib/modules/${base%.zst}"; base=${base%.zst} ;;
    *) cp "$p" "$root/lib/modules/$base" ;;
  esac
  echo "$base" >> "$root/lib/modules/load-order"
done

# qemu-ga and its shared-library closure.
cp /usr/sbin/qemu-ga "$root/usr/sbin/qemu-ga"
for lib in $(ldd /usr/sbin/qemu-ga | grep -o '/[^ ]*'); do
  mkdir -p "$root/$(dirname "$lib")"
  cp -L "$lib" "$root/$lib"
done
# The dynamic loader must also be reachable through /lib64.
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || { mkdir -p "$root/lib64"; cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"; }

# ff-reseed: a 176-byte static x86-64 ELF that does open("/dev/urandom") + ioctl(RNDRESEEDCRNG)
# and exits with the ioctl's result (the shell hygiene of ADR 0005 for names ff-clone can't carry).
# Hand-assembled so the image needs no compiler:
#   mov eax,2; lea rdi,[rip+31]; xor esi,esi; xor edx,edx; syscall       ; open
#   mov edi,eax; mov eax,16; mov esi,0x5207; xor edx,edx; syscall         ; ioctl
#   mov edi,eax; mov eax,60; syscall                                      ; exit
base64 -d "$here/ff-reseed.b64" > "$root/sbin/ff-reseed"
chmod 0755 "$root/sbin/ff-reseed"
# ff-clone: all clone hygiene in one process (ADR 0009); assembled from ff-clone.S, stored as base64
# so the build needs no assembler.
base64 -d "$here/ff-clone.b64" > "$root/sbin/ff-clone"
chmod 0755 "$root/sbin/ff-clone"

cat > "$root/etc/passwd" <<'P'
root:x:0:0:root:/root:/bin/sh
P
echo 'root:x:0:' > "$root/etc/group"

cat > "$root/init" <<'INIT'
#!/bin/sh
# Forkfleet tiny guest init. PID 1; never exits.
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
while read -r m; do insmod "/lib/modules/$m" 2>/dev/null; done < /lib/modules/load-order
hn=forkfleet
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    ff.hostname=*) hn=${arg#ff.hostname=} ;;
    ff.sandbox=*) mkdir -p /run/forkfleet; echo "${arg#ff.sandbox=}" > /run/forkfleet/sandbox-id ;;
  esac
done
hostname "$hn"
ip link set lo up 2>/dev/null
# The NIC: QEMU user networking (slirp, restrict=on) inside the sandbox's own network
# namespace on the host, so nothing outside the VM answers (issue #9). Static address: slirp's
# defaults (guest 10.0.2.15, gateway 10.0.2.2), no DHCP round trip under TCG.
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
fi
[ -b /dev/vda ] && mount -t ext4 -o noatime /dev/vda /data
port=
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
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
chmod 0755 "$root/init"

find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$root" && find . -print0 | sort -z | cpio --null -o -H newc --quiet --reproducible -R 0:0) > "$out/initramfs.cpio"

# --- data disk: ext4 with a marker file, stored as qcow2 (the base every VM overlays).
echo "forkfleet tiny data disk" > "$disk_tree/README"
chmod 0755 "$disk_tree"
bash "$here/mkext4.sh" "$out/disk.raw" "$disk_mib" ffdata "$disk_tree" "$seed" root
qemu-img convert -f raw -O qcow2 "$out/disk.raw" "$out/disk.qcow2"
rm -f "$out/disk.raw"

cat > "$out/image.json" <<J
{"name":"tiny","kernelVersion":"$kver","kernel":"vmlinux","initrd":"initramfs.cpio","disk":"disk.qcow2","diskFormat":"qcow2","rootOnDisk":false,"readyMarker":"FORKFLEET_READY","agentPort":"org.qemu.guest_agent.0"}
J
