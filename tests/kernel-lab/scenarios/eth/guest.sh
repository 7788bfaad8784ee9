#!/bin/sh
# Scenario eth, guest side: raw Ethernet. eth0 (virtio-net on a tap device in the host's network
# namespace, no IP address) reaches blkwire serve's eth:// listener directly. `blkwire discover`
# must find the export on eth0, then `blkwire map --frontend ublk eth://eth0/MAC/EXPORT`, mkfs.ext4,
# mount, write files, sync, umount, fsck, re-read them with caches dropped, unmap. The checksums go
# to the log (LAB-SHA256 lines) for the host to check against what blkwire stored.
#
# From the kernel command line (set by host.sh): lab.net=link, lab.target_mac, lab.export,
# lab.guest_mac.
. /lab/lib.sh

: "${LAB_TARGET_MAC:?lab.target_mac= missing on the kernel command line}"
export_name=${LAB_EXPORT:-disk0}
url="eth://eth0/$LAB_TARGET_MAC/$export_name"
mnt=/mnt

step "eth0: up, no address"
[ "$(cat /sys/class/net/eth0/operstate)" = up ] || [ "$(cat /sys/class/net/eth0/carrier)" = 1 ] ||
    fail "eth0 is not up: operstate $(cat /sys/class/net/eth0/operstate)"
mac=$(cat /sys/class/net/eth0/address)
[ -z "${LAB_GUEST_MAC:-}" ] || [ "$mac" = "$LAB_GUEST_MAC" ] || fail "eth0 has MAC $mac, expected $LAB_GUEST_MAC"
ip -4 addr show dev eth0 | grep -q inet && fail "eth0 has an IPv4 address: $(ip -4 addr show dev eth0)"
info "eth0: $mac, mtu $(cat /sys/class/net/eth0/mtu), no IP address; target $LAB_TARGET_MAC"

run modprobe ublk_drv
run modprobe crc32c_generic
run modprobe ext4
[ -e /dev/ublk-control ] || fail "/dev/ublk-control is missing after modprobe ublk_drv"

# Discovery by broadcast on the link (TCG is slow: a generous wait).
bw discover --interface eth0 --wait-ms 2000
grep -qw "$export_name" /tmp/bw.out || fail "discover --interface eth0 does not list $export_name"
bw discover --interface eth0 --wait-ms 2000 --json
grep -q "\"url\": *\"$url\"" /tmp/bw.out || fail "discover --json does not list $url"
info "discover --interface eth0: $url"

bw map --frontend ublk --logfile $maplog "$url"
dev=$(tail -n1 /tmp/bw.out)
[ "$dev" = /dev/ublkb0 ] || fail "map printed '$dev', expected /dev/ublkb0"
info "$dev over $url: $(blockdev --getsize64 "$dev") bytes, logical block $(blockdev --getss "$dev"), $(ls /sys/block/ublkb0/mq | wc -l) queue(s)"
bw ls --json
grep -q '"frontend": *"ublk"' /tmp/bw.out || fail "ls --json does not show the ublk mapping"

run mkfs.ext4 -q -F -L blkwire-eth "$dev"
run mount -t ext4 "$dev" "$mnt"

write_test_files "$mnt" "hello over raw Ethernet, $(uname -r)"

run umount "$mnt"
run e2fsck -fn "$dev"

verify_after_reread "$dev" "$mnt"

bw unmap "$dev"
[ ! -e /sys/block/ublkb0 ] || fail "/sys/block/ublkb0 still exists after unmap"
bw ls --json
[ "$(tr -d ' \n' </tmp/bw.out)" = "{}" ] || fail "ls --json still lists a mapping after unmap"
info "unmapped"
