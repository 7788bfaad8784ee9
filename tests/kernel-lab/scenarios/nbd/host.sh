# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario nbd, host side: blkwire serves a 256 MiB sparse file over NBD (and its native protocol);
# the guest's kernel NBD client formats and fills it (guest.sh). Afterwards the host reads the disk
# back through blkwire and checks the filesystem and every file the guest reported.
#
# Sourced by run.sh in a subshell. Contract for every scenario:
#   SCENARIO_DESC    one line
#   HOST_PACKAGES    Debian packages the host needs (installed by run.sh when missing)
#   GUEST_MODULES    kernel modules the guest loads (dependencies are added automatically)
#   GUEST_BINARIES   host commands copied into the guest with their libraries (blkwire always is)
#   scenario_setup   start host services; set GUEST_ARGS (lab.KEY=VALUE for the kernel command line)
#   scenario_verify  after the guest passed: host-side checks (die on failure)
#   scenario_cleanup optional; run.sh already stops blkwire and qemu (before it) and removes $WORK
#                    (after it). It runs on every exit, also when scenario_setup failed half-way.

SCENARIO_DESC="kernel NBD client -> blkwire NBD frontend (mkfs.ext4, files, fsck; host checks the data)"
HOST_PACKAGES="nbd-client e2fsprogs"
GUEST_MODULES="nbd ext4 crc32c_generic"
GUEST_BINARIES="nbd-client mkfs.ext4 e2fsck"

EXPORT=disk0
DISK_SIZE=256M

scenario_setup() {
    truncate -s "$DISK_SIZE" "$WORK/disk.img"
    start_blkwire --listen tcp://127.0.0.1:0 --listen nbd://127.0.0.1:0 \
        --export "$EXPORT=file:$WORK/disk.img"
    TCP_PORT=$(listen_port tcp)
    NBD_PORT=$(listen_port nbd)
    # The guest reaches the host's 127.0.0.1 at 10.0.2.2 through qemu's user network.
    GUEST_ARGS="lab.nbd_port=$NBD_PORT lab.tcp_port=$TCP_PORT lab.export=$EXPORT lab.nbd_conns=${LAB_NBD_CONNS:-2}"
}

scenario_verify() {
    verify_guest_disk
    local out=$WORK/out.img
    local hello want="hello from the kernel NBD client, $KVER"
    hello=$(debugfs -R 'cat /hello.txt' "$out" 2>/dev/null)
    [ "$hello" = "$want" ] || die "/hello.txt holds '$hello', expected '$want'"
    log "/hello.txt: $hello"
}
