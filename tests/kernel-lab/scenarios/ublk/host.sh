# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario ublk, host side: blkwire serves a 256 MiB sparse file over its native protocol; inside
# the guest `blkwire map --frontend ublk` makes it /dev/ublkb0, which the guest formats and fills
# (guest.sh). Afterwards the host reads the disk back and checks the filesystem and every file the
# guest reported. See scenarios/nbd/host.sh for the contract of these variables and functions.

SCENARIO_DESC="blkwire map --frontend ublk in the guest (mkfs.ext4, files, fsck, unmap; host checks the data)"
HOST_PACKAGES="e2fsprogs"
GUEST_MODULES="ublk_drv ext4 crc32c_generic"
GUEST_BINARIES="mkfs.ext4 e2fsck"

EXPORT=disk0
DISK_SIZE=256M

scenario_setup() {
    truncate -s "$DISK_SIZE" "$WORK/disk.img"
    start_blkwire --listen tcp://127.0.0.1:0 --export "$EXPORT=file:$WORK/disk.img"
    TCP_PORT=$(listen_port tcp)
    GUEST_ARGS="lab.tcp_port=$TCP_PORT lab.export=$EXPORT"
}

scenario_verify() {
    verify_guest_disk
}
