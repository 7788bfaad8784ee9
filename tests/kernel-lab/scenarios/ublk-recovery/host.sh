# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario ublk-recovery, host side: as scenario ublk (blkwire serves a 256 MiB sparse file), but
# the guest kills the map daemon with SIGKILL under a mounted filesystem, in the middle of writes,
# and `blkwire map --recover /dev/ublkb0` takes the device over (guest.sh). The host then checks
# the filesystem and every file the guest reported, as scenario ublk does.

. "$LAB_DIR/scenarios/ublk/host.sh"

SCENARIO_DESC="ublk USER_RECOVERY: kill -9 the map daemon under a mounted ext4, map --recover, files and fsck intact"

scenario_verify() {
    verify_guest_disk
}
