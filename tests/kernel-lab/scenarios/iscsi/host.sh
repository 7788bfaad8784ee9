# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario iscsi, host side: the kernel's iSCSI initiator (iscsi_tcp; open-iscsi's iscsistart,
# iscsid and iscsiadm in the guest) against blkwire's iSCSI frontend. Two exports, each an iSCSI
# target iqn.2026-11.io.blkwire:EXPORT with LUN 0:
#   - disk0 (a 256 MiB sparse file), no authentication: the filesystem, digests (guest.sh);
#   - secure (16 MiB of random data), CHAP required: one-way and mutual CHAP with the initiator's
#     secret from the key store; no credentials, a wrong secret and a wrong target secret are
#     refused. Its own `blkwire serve` (with --keys every initiator must authenticate).
# Afterwards the host reads disk0 back through another frontend (blkwire cp over tcp://) and checks
# the filesystem and every file the guest reported; both targets must exit 0 on SIGTERM. See
# scenarios/nbd/host.sh for the contract of these variables and functions.
#
# LAB_ISCSI_REF=tgt: a reference run of the same guest steps against tgt (tgtd on the host's
# loopback, the same target names, LUN 1 on rdwr backing files, the same CHAP accounts), no blkwire
# at all; it checks the lab, not blkwire, and says so. The host then checks disk0's backing file.

SCENARIO_DESC="kernel iSCSI initiator -> blkwire iSCSI frontend (iscsistart login, mkfs.ext4, files, fsck, digests, logout, CHAP one-way and mutual; host checks the data)"
HOST_PACKAGES="open-iscsi e2fsprogs"
GUEST_MODULES="iscsi_tcp sd_mod crc32c_generic ext4"
GUEST_BINARIES="iscsistart iscsid iscsiadm mkfs.ext4 e2fsck"

EXPORT=disk0
DISK_SIZE=256M
SECURE_MIB=1
IQN_PREFIX=iqn.2026-11.io.blkwire
AUTH_PID="" TGTD_PID="" TGTD_CTL=""

# A random secret of 2N hex digits (it travels on the kernel command line).
lab_secret() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }

# A free TCP port on 127.0.0.1 (for tgtd, which cannot listen on port 0 and tell).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

tgtadm_() { tgtadm -C "$TGTD_CTL" --lld iscsi "$@" || die "tgtadm $* failed"; }

# tgtd on 127.0.0.1:PORT with both targets, as blkwire would serve them. LUN 0 of a tgt target is
# its controller; the disk is LUN 1 (the guest finds the session's disk, whatever its LUN).
start_tgtd() {
    command -v tgtd >/dev/null || die "tgtd not found: LAB_ISCSI_REF=tgt needs Debian's tgt (scripts/deps.sh installs it)"
    local port
    port=$(free_port)
    # The management socket /var/run/tgtd/socket.N (N at most 32767): from the port, which is
    # unique while it listens.
    TGTD_CTL=$((port % 32000 + 700))
    tgtd -f ${LAB_TGTD_DEBUG:+-d 1} -C "$TGTD_CTL" --iscsi "portal=127.0.0.1:$port" >"$LOGDIR/tgtd.log" 2>&1 9>&- &
    TGTD_PID=$!
    local deadline=$((SECONDS + 20))
    until tgtadm -C "$TGTD_CTL" --lld iscsi --mode target --op show >/dev/null 2>&1; do
        kill -0 "$TGTD_PID" 2>/dev/null || {
            sed 's/^/    tgtd| /' "$LOGDIR/tgtd.log" >&2
            TGTD_PID=""
            die "tgtd exited before it was ready"
        }
        [ $SECONDS -lt $deadline ] || die "tgtd did not answer tgtadm within 20 s"
        sleep 0.1
    done
    tgtadm_ --mode target --op new --tid 1 --targetname "$IQN_PREFIX:$EXPORT"
    tgtadm_ --mode logicalunit --op new --tid 1 --lun 1 --bstype rdwr --backing-store "$WORK/disk.img"
    tgtadm_ --mode target --op bind --tid 1 --initiator-address ALL
    # tgt offers no digests unless told (blkwire accepts CRC32C when the initiator asks for it).
    tgtadm_ --mode target --op update --tid 1 --name HeaderDigest --value CRC32C,None
    tgtadm_ --mode target --op update --tid 1 --name DataDigest --value CRC32C,None
    tgtadm_ --mode target --op new --tid 2 --targetname "$IQN_PREFIX:secure"
    tgtadm_ --mode logicalunit --op new --tid 2 --lun 1 --bstype rdwr --backing-store "$WORK/secure.img"
    tgtadm_ --mode target --op bind --tid 2 --initiator-address ALL
    tgtadm_ --mode account --op new --user "$CHAP_USER" --password "$CHAP_SECRET"
    tgtadm_ --mode account --op bind --tid 2 --user "$CHAP_USER"
    tgtadm_ --mode account --op new --user "$MUTUAL_USER" --password "$MUTUAL_SECRET"
    tgtadm_ --mode account --op bind --tid 2 --user "$MUTUAL_USER" --outgoing
    ISCSI_PORT=$port AUTH_PORT=$port
    log "tgtd (pid $TGTD_PID, tgt $(tgtd -V 2>&1 | head -n1)) on 127.0.0.1:$port: $IQN_PREFIX:$EXPORT, $IQN_PREFIX:secure (CHAP)"
}

stop_tgtd() {
    [ -n "$TGTD_PID" ] || return 0
    # tgtd ignores SIGTERM; it ends on a system delete once it has no targets (SIGKILL after 10 s).
    local tid
    for tid in 1 2; do
        tgtadm -C "$TGTD_CTL" --lld iscsi --mode target --op delete --force --tid $tid >/dev/null 2>&1 || true
    done
    tgtadm -C "$TGTD_CTL" --mode system --op delete >/dev/null 2>&1 || true
    for _ in $(seq 100); do kill -0 "$TGTD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$TGTD_PID" 2>/dev/null || true
    wait "$TGTD_PID" 2>/dev/null || true
    TGTD_PID=""
}

# blkwire: disk0 without authentication on one target (iscsi:// and tcp://, for the host's check),
# and secure on a second one with a key store, whose line gives the initiator's CHAP secret and
# the target's (mutual); allow= admits only this initiator (the name CHAP proved).
start_blkwire_targets() {
    local keys=$WORK/keys
    (umask 077 && printf '%s:CHAP:%s %s\n' "$INITIATOR" "$CHAP_SECRET" "$MUTUAL_SECRET" >"$keys")
    BLKWIRE_LOG=blkwire-auth.log start_blkwire --listen iscsi://127.0.0.1:0 --rpc-socket none \
        --keys "$keys" --export "secure=file:$WORK/secure.img,allow=$INITIATOR"
    AUTH_PID=$BLKWIRE_PID
    AUTH_PORT=$(listen_port iscsi)
    BLKWIRE_PID=""
    start_blkwire --listen tcp://127.0.0.1:0 --listen iscsi://127.0.0.1:0 \
        --export "$EXPORT=file:$WORK/disk.img"
    TCP_PORT=$(listen_port tcp)
    ISCSI_PORT=$(listen_port iscsi)
}

scenario_setup() {
    INITIATOR=iqn.2026-11.io.blkwire.lab:guest-$(lab_secret 4)
    # CHAP names: the initiator's IQN, the target's IQN for mutual CHAP.
    CHAP_USER=$INITIATOR MUTUAL_USER=$IQN_PREFIX:secure
    CHAP_SECRET=$(lab_secret 10)
    CHAP_WRONG=$(lab_secret 10)
    MUTUAL_SECRET=$(lab_secret 10)
    MUTUAL_WRONG=$(lab_secret 10)
    truncate -s "$DISK_SIZE" "$WORK/disk.img"
    head -c 16M /dev/urandom >"$WORK/secure.img"
    SECURE_SHA=$(head -c "${SECURE_MIB}M" "$WORK/secure.img" | sha256sum | cut -d' ' -f1)

    case ${LAB_ISCSI_REF:-} in
    tgt)
        log "REFERENCE RUN: the guest's steps against tgt (tgtd on the host); blkwire is not tested"
        start_tgtd
        GUEST_ARGS="lab.iscsi_ref=tgt"
        ;;
    "")
        start_blkwire_targets
        GUEST_ARGS=""
        ;;
    *) die "LAB_ISCSI_REF='$LAB_ISCSI_REF': only 'tgt' is known" ;;
    esac
    # The guest reaches the host's 127.0.0.1 at 10.0.2.2 through qemu's user network.
    GUEST_ARGS+=" lab.iscsi_port=$ISCSI_PORT lab.auth_port=$AUTH_PORT lab.export=$EXPORT"
    GUEST_ARGS+=" lab.disk_bytes=$(stat -c %s "$WORK/disk.img") lab.initiator=$INITIATOR"
    GUEST_ARGS+=" lab.chap_user=$CHAP_USER lab.chap_secret=$CHAP_SECRET lab.chap_wrong=$CHAP_WRONG"
    GUEST_ARGS+=" lab.mutual_user=$MUTUAL_USER lab.mutual_secret=$MUTUAL_SECRET lab.mutual_wrong=$MUTUAL_WRONG"
    GUEST_ARGS+=" lab.secure_sha=$SECURE_SHA lab.secure_mib=$SECURE_MIB"
    log "initiator $INITIATOR; CHAP: its secret, the target's secret (mutual)"
}

check_hello() {
    local hello want="hello from the kernel iSCSI initiator, $KVER"
    hello=$(debugfs -R 'cat /hello.txt' "$1" 2>/dev/null)
    [ "$hello" = "$want" ] || die "/hello.txt holds '$hello', expected '$want'"
    log "/hello.txt: $hello"
}

scenario_verify() {
    # The secure export was only read: its file is unchanged.
    [ "$(head -c "${SECURE_MIB}M" "$WORK/secure.img" | sha256sum | cut -d' ' -f1)" = "$SECURE_SHA" ] ||
        die "the secure export's file changed although the guest only read it"
    if [ "${LAB_ISCSI_REF:-}" = tgt ]; then
        stop_tgtd
        check_guest_files "$WORK/disk.img"
        check_hello "$WORK/disk.img"
        log "REFERENCE RUN against tgt passed: the lab's steps hold; blkwire was not tested"
        return 0
    fi
    verify_guest_disk
    check_hello "$WORK/out.img"
    # The authenticating target must stop cleanly too (stop_blkwire acts on BLKWIRE_PID/BLKWIRE_LOG).
    BLKWIRE_PID=$AUTH_PID BLKWIRE_LOG=blkwire-auth.log
    AUTH_PID=""
    stop_blkwire
}

scenario_cleanup() {
    stop_tgtd
    # run.sh stops the main target; the authenticating one is ours (still set only on failure).
    [ -n "$AUTH_PID" ] || return 0
    kill -TERM "$AUTH_PID" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$AUTH_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$AUTH_PID" 2>/dev/null
    wait "$AUTH_PID" 2>/dev/null
    AUTH_PID=""
}
