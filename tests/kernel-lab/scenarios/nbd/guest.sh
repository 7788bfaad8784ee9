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

write_test_files "$mnt" "hello from the kernel NBD client, $(uname -r)"

run umount "$mnt"
run e2fsck -fn /dev/nbd0

# Read everything back from the server, not from this machine's caches.
verify_after_reread /dev/nbd0 "$mnt"

run nbd-client -d /dev/nbd0
step "wait for /dev/nbd0 to disconnect"
i=0
while [ "$(cat /sys/block/nbd0/size)" != 0 ]; do
    i=$((i + 1))
    [ $i -le 50 ] || fail "/dev/nbd0 still has a size after nbd-client -d"
    sleep 0.1
done
info "nbd0 disconnected"
