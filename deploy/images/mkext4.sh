#!/usr/bin/env bash
# A reproducible ext4 file system image of a directory: the same tree (names, contents, modes,
# owners, mtimes up to SOURCE_DATE_EPOCH) and the same SEED give the same bytes on any host
# with the same e2fsprogs. A snapshot's disk layer is a qcow2 overlay of an image's base disk,
# restored on other hosts over their own build of it, so the bytes must not depend on the
# build (ADR 0004).
# Usage: SOURCE_DATE_EPOCH=N mkext4.sh IMG SIZE_MIB LABEL SRC_DIR SEED [root]
#   SEED  derives the file system UUID and the directory hash seed (build.ts: the recipe hash)
#   root  every inode owned by 0:0 (else the tree's owners, as mkfs.ext4 -d copies them)
# What would otherwise differ from one build to the next, and what pins it:
#   UUID, directory hash seed      -U, -E hash_seed= (from SEED)
#   mkfs/mount/check times, crtime E2FSPROGS_FAKE_TIME
#   file mtimes (copies made now)  clamped to SOURCE_DATE_EPOCH in SRC_DIR
#   ctime, atime                   copied from SRC_DIR by mkfs -d and not settable there:
#                                  written into each used inode with debugfs
#   root directory owner           -E root_owner=0:0
#   entry order                    mkfs -d sorts entries (alphasort): LC_ALL=C
#   features, block and inode size this script's own mke2fs.conf (not the host's /etc one)
set -euo pipefail
export LC_ALL=C
umask 022
img=$1
size_mib=$2
label=$3
src=$4
seed=$5
owner=${6:-}
epoch=${SOURCE_DATE_EPOCH:?SOURCE_DATE_EPOCH must be set}
[ -n "$seed" ] || { echo "mkext4.sh: empty SEED" >&2; exit 2; }

# A UUID (version 4 layout) from SEED and a purpose.
seeded_uuid() {
  local h
  h=$(printf '%s:%s' "$1" "$seed" | sha256sum | cut -c1-32)
  printf '%s-%s-4%s-8%s-%s' "${h:0:8}" "${h:8:4}" "${h:13:3}" "${h:17:3}" "${h:20:12}"
}
uuid=$(seeded_uuid fs-uuid)
hash_seed=$(seeded_uuid dir-hash-seed)

find "$src" -newermt "@$epoch" -exec touch -h -d "@$epoch" {} +

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Debian bookworm's /etc/mke2fs.conf (e2fsprogs 1.47.0), the parts an ext4 of these sizes uses.
cat > "$tmp/mke2fs.conf" <<'CONF'
[defaults]
	base_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
	default_mntopts = acl,user_xattr
	enable_periodic_fsck = 0
	blocksize = 4096
	inode_size = 256
	inode_ratio = 16384

[fs_types]
	ext4 = {
		features = has_journal,extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
	}
	small = {
		blocksize = 1024
		inode_ratio = 4096
	}
	floppy = {
		blocksize = 1024
		inode_ratio = 8192
	}
	big = {
		inode_ratio = 32768
	}
	huge = {
		inode_ratio = 65536
	}
CONF

rm -f "$img"
truncate -s "${size_mib}M" "$img"
MKE2FS_CONFIG=$tmp/mke2fs.conf E2FSPROGS_FAKE_TIME=$epoch \
  mkfs.ext4 -q -F -t ext4 -L "$label" -U "$uuid" -E "hash_seed=$hash_seed,root_owner=0:0" -d "$src" "$img"

# The used inodes (the root directory and every one from the first non-reserved inode on),
# from the inode bitmap as dumpe2fs prints it ("Free inodes: 12-2048, 2050"), and checked
# against the superblock's count, so a change in dumpe2fs's output fails the build instead of
# pinning nothing.
dumpe2fs "$img" 2>/dev/null | awk -v cmds="$tmp/debugfs.cmds" -v epoch="$epoch" -v owner="$owner" '
  /^Inode count:/ { total = $3 }
  /^Free inodes:/ && !seen_sb { free_sb = $3; seen_sb = 1 }
  /^First inode:/ { first = $3 }
  /^Inodes per group:/ { ipg = $4 }
  /^Group [0-9]+:/ { g = $2 + 0; groups++ }
  /^  Free inodes: / {
    lo = g * ipg + 1; hi = lo + ipg - 1
    for (i = lo; i <= hi; i++) used[i] = 1
    s = $0; sub(/^  Free inodes: */, "", s); n = split(s, parts, /, */)
    for (k = 1; k <= n; k++) {
      if (parts[k] == "") continue
      m = split(parts[k], r, "-"); a = r[1] + 0; b = (m > 1 ? r[2] : r[1]) + 0
      for (i = a; i <= b; i++) delete used[i]
    }
  }
  END {
    if (!total || !first || !ipg || groups == 0) { print "mkext4.sh: cannot read dumpe2fs output" > "/dev/stderr"; exit 1 }
    count = 0
    for (i = 1; i <= total; i++) if (i in used) count++
    if (count != total - free_sb) { printf "mkext4.sh: %d used inodes in the bitmaps, superblock says %d\n", count, total - free_sb > "/dev/stderr"; exit 1 }
    for (i = 1; i <= total; i++) {
      if (!(i in used) || (i != 2 && i < first)) continue
      printf "set_inode_field <%d> ctime @%s\nset_inode_field <%d> atime @%s\n", i, epoch, i, epoch > cmds
      if (owner == "root") printf "set_inode_field <%d> uid 0\nset_inode_field <%d> gid 0\n", i, i > cmds
    }
  }'
E2FSPROGS_FAKE_TIME=$epoch debugfs -w -f "$tmp/debugfs.cmds" "$img" > "$tmp/debugfs.log" 2>&1 || { tail -n 5 "$tmp/debugfs.log" >&2; exit 1; }
if grep -v -e '^debugfs[ :]' -e '^$' "$tmp/debugfs.log" >&2; then echo "mkext4.sh: debugfs reported errors" >&2; exit 1; fi
e2fsck -fn "$img" > "$tmp/fsck.log" 2>&1 || { cat "$tmp/fsck.log" >&2; exit 1; }
