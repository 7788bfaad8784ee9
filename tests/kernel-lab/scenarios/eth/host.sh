# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario eth, host side: raw Ethernet into the guest. A network namespace of its own holds a tap
# device; blkwire serves a 256 MiB sparse file on it (eth://bwtap0, and tcp:// on the namespace's
# loopback for the host-side checks) and qemu, started in the same namespace, plugs the guest's
# virtio-net card into the tap. The guest discovers the target on eth0 and maps the export over
# eth:// with ublk (guest.sh); afterwards the host checks the disk as scenario ublk does.

. "$LAB_DIR/scenarios/ublk/host.sh"

SCENARIO_DESC="raw Ethernet: tap in a netns, blkwire discover + map --frontend ublk eth://eth0/MAC/disk0 in the guest (mkfs.ext4, files, fsck, unmap; host checks the data)"
HOST_PACKAGES="e2fsprogs iproute2"

TAP=bwtap0
GUEST_MAC=52:54:00:12:34:56
NETNS_CREATED=""

scenario_setup() {
    # Unique per run; scenario_cleanup removes it (and the tap with it) on every exit.
    local ns
    ns="blkwire-lab-eth-$BASHPID-$RANDOM"
    ip netns add "$ns" || die "ip netns add $ns failed (needs root and CAP_SYS_ADMIN)"
    NETNS_CREATED=$ns
    NETNS=$ns
    in_netns ip link set lo up || die "ip link set lo up in netns $NETNS failed"
    in_netns ip tuntap add dev "$TAP" mode tap || die "ip tuntap add dev $TAP mode tap in netns $NETNS failed"
    in_netns ip link set dev "$TAP" mtu 1500 up || die "ip link set $TAP up in netns $NETNS failed"
    log "netns $NETNS: tap $TAP ($(in_netns cat "/sys/class/net/$TAP/address"), mtu 1500, no address)"

    truncate -s "$DISK_SIZE" "$WORK/disk.img"
    start_blkwire --listen "eth://$TAP" --listen tcp://127.0.0.1:0 --export "$EXPORT=file:$WORK/disk.img"
    TCP_PORT=$(listen_port tcp)
    local u mac=""
    for u in "${BLKWIRE_URLS[@]}"; do
        case $u in "eth://$TAP/"*) mac=${u#"eth://$TAP/"} ;; esac
    done
    [[ $mac =~ ^[0-9a-f]{2}(:[0-9a-f]{2}){5}$ ]] || die "no 'listening eth://$TAP/MAC' line from blkwire serve (got: ${BLKWIRE_URLS[*]})"
    TARGET_MAC=$mac

    # The guest's eth0 on the tap, instead of qemu's user network; eth0 comes up without an address.
    # shellcheck disable=SC2054  # commas belong to qemu's option syntax
    QEMU_NET=(-netdev "tap,id=n0,ifname=$TAP,script=no,downscript=no"
        -device "virtio-net-pci,netdev=n0,romfile=,mac=$GUEST_MAC")
    GUEST_ARGS="lab.net=link lab.target_mac=$TARGET_MAC lab.export=$EXPORT lab.guest_mac=$GUEST_MAC"
}

scenario_verify() {
    verify_guest_disk
}

scenario_cleanup() {
    [ -n "$NETNS_CREATED" ] || return 0
    # run.sh stopped blkwire and qemu already; nothing uses the tap any more.
    ip netns exec "$NETNS_CREATED" ip link del "$TAP" 2>/dev/null
    ip netns del "$NETNS_CREATED" || echo "kernel-lab: [$SCENARIO] warning: ip netns del $NETNS_CREATED failed" >&2
    NETNS_CREATED=""
}
