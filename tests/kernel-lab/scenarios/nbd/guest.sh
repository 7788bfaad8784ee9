#!/bin/sh
# Scenario nbd, guest side: the kernel's NBD client against blkwire's NBD frontend on the host.
# Attach /dev/nbd0, mkfs.ext4, mount, write files, sync, umount, fsck, re-read them from the server
# (caches dropped), disconnect. The checksums go to the log (LAB-SHA256 lines) for the host to
# check against what blkwire stored.
#
# From the kernel command line (set by host.sh): lab.nbd_port, lab.tcp_port, lab.export,
# lab.nbd_conns (NBD connections, -C), lab.nbd_bs (block size, -b).
. /lab/lib.sh

host=10.0.2.2
: "${LAB_NBD_PORT:?lab.nbd_port= missing on the kernel command line}"
: "${LAB_TCP_PORT:?lab.tcp_port= missing on the kernel command line}"
export_name=${LAB_EXPORT:-disk0}
conns=${LAB_NBD_CONNS:-1}
bs=${LAB_NBD_BS:-4096}
mnt=/mnt

# The blkwire binary itself runs in the guest (later scenarios map with it): ask the target's
# native listener what it exports.
run blkwire info "tcp://$host:$LAB_TCP_PORT/$export_name"

run modprobe nbd nbds_max=4
run modprobe crc32c_generic
run modprobe ext4

run nbd-client "$host" "$LAB_NBD_PORT" /dev/nbd0 -N "$export_name" -b "$bs" -C "$conns"
size=$(blockdev --getsize64 /dev/nbd0)
info "/dev/nbd0: $size bytes, logical block $(blockdev --getss /dev/nbd0), $conns connection(s)"
[ "$size" -gt 0 ] || fail "/dev/nbd0 has size $size after nbd-client"

# mkfs discards the whole device first: TRIM goes to the server too.
run mkfs.ext4 -q -F -L blkwire-lab /dev/nbd0
run mount -t ext4 /dev/nbd0 "$mnt"

step "write files"
echo "hello from the kernel NBD client, $(uname -r)" >"$mnt/hello.txt"
mkdir -p "$mnt/data/small"
dd if=/dev/urandom of="$mnt/data/random-8M.bin" bs=1M count=8 2>/dev/null
dd if=/dev/urandom of="$mnt/data/random-1M.bin" bs=64k count=16 2>/dev/null
i=0
while [ $i -lt 32 ]; do
    # small files of assorted sizes (1 byte to 12 KiB)
    head -c $((i * 397 + 1)) /dev/urandom >"$mnt/data/small/f$i"
    i=$((i + 1))
done
# a file with a hole, written at the end of a sparse range
dd if=/dev/urandom of="$mnt/data/sparse.bin" bs=4k count=1 seek=4096 2>/dev/null
run sync

step "checksums"
(cd "$mnt" && find . -type f | sort | xargs sha256sum) >/tmp/sums
[ -s /tmp/sums ] || fail "no files were written"
while read -r sum path; do
    emit SHA256 "$sum ${path#.}"
done </tmp/sums
info "$(wc -l </tmp/sums) files, $(du -sk "$mnt" | cut -f1) KiB used"

run umount "$mnt"
run e2fsck -fn /dev/nbd0

# Read everything back from the server, not from this machine's caches.
run blockdev --flushbufs /dev/nbd0
echo 3 >/proc/sys/vm/drop_caches
run mount -t ext4 -o ro /dev/nbd0 "$mnt"
step "verify checksums after re-reading from the server"
(cd "$mnt" && sha256sum -c /tmp/sums >/tmp/check 2>&1) || {
    grep -v ': OK$' /tmp/check | head -n 10
    fail "checksums differ after re-reading from the server"
}
run umount "$mnt"

run nbd-client -d /dev/nbd0
step "wait for /dev/nbd0 to disconnect"
i=0
while [ "$(cat /sys/block/nbd0/size)" != 0 ]; do
    i=$((i + 1))
    [ $i -le 50 ] || fail "/dev/nbd0 still has a size after nbd-client -d"
    sleep 0.1
done
info "nbd0 disconnected"
