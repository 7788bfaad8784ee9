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

# Shared with ublk-recovery: the disk as blkwire holds it must be a clean ext4 with the files the
# guest reported (LAB-SHA256 lines).
ublk_verify_disk() {
    local sums=$WORK/guest.sha256
    guest_values SHA256 >"$sums"
    [ -s "$sums" ] || die "the guest reported no file checksums"
    local out=$WORK/out.img
    # (in_netns: scenario eth's target listens on its network namespace's loopback)
    in_netns "$BLKWIRE" cp --no-progress "tcp://127.0.0.1:$TCP_PORT/$EXPORT" "$out" ||
        die "blkwire cp tcp://127.0.0.1:$TCP_PORT/$EXPORT failed"
    cmp -s "$out" "$WORK/disk.img" || die "blkwire cp returned data different from the export's file"
    stop_blkwire
    e2fsck -fn "$out" >"$WORK/fsck.log" 2>&1 || {
        sed 's/^/    e2fsck| /' "$WORK/fsck.log" >&2
        die "e2fsck -fn on the copied disk found problems"
    }
    log "e2fsck -fn: clean ($(tail -n1 "$WORK/fsck.log"))"
    local sum path got n=0 bad=0
    while read -r sum path; do
        got=$(debugfs -R "cat $path" "$out" 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [ "$got" != "$sum" ]; then
            echo "    $path: guest wrote $sum, blkwire holds $got" >&2
            bad=$((bad + 1))
        fi
        n=$((n + 1))
    done <"$sums"
    [ $bad -eq 0 ] || die "$bad of $n files differ between what the guest wrote and what blkwire stored"
    log "debugfs: all $n files on the copied disk have the sha256 the guest reported"
}

scenario_verify() {
    ublk_verify_disk
}
