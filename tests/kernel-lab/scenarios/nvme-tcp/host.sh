# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario nvme-tcp, host side: the kernel's NVMe/TCP host (nvme-tcp + nvme-cli in the guest)
# against blkwire's NVMe/TCP frontend. Two targets on the host:
#   - blkwire serve --listen nvme-tcp:// --listen tcp:// with export disk0 (a 256 MiB sparse file),
#     no authentication: discovery, plain and digest connections, Copy, the filesystem (guest.sh);
#   - a second blkwire serve --listen nvme-tcp:// --keys FILE with export secure (16 MiB of random
#     data), allow=host A: DH-HMAC-CHAP. Its secrets come from the host's `nvme gen-dhchap-key`
#     (it fails inside the guest): host A has a host and a controller secret (bidirectional), host
#     B a host secret (listed, but not allowed on secure), host C a secret and no line, and one
#     more secret belongs to nobody (a wrong secret). Two processes because with --keys every host
#     must authenticate, and the first part checks the unauthenticated path.
# The first target also serves a subsystem of two namespaces (--subsystem, NQN
# nqn.2026-11.io.blkwire.lab:multi): exports m1 (8 MiB) and m2 (4 MiB) of random data as NSIDs 1
# and 2, with its own serial and model; the guest checks both namespaces' sizes and data and
# copies m1's first MiB to m2 at 2 MiB, which the host finds in m2's file afterwards.
# Afterwards the host reads disk0 back over the native protocol and checks the filesystem and every
# file the guest reported; both targets must exit 0 on SIGTERM. See scenarios/nbd/host.sh for the
# contract of these variables and functions.
#
# LAB_NVME_AUTH=0: no second target and no DH-HMAC-CHAP steps, for a blkwire without them; the run
# says so at the start and at the end (the default set runs them).
# LAB_NVME_REF=nvmet: a reference run of the same guest steps against the kernel's own target
# (nvmet, configured inside the guest like blkwire), no blkwire target at all; it checks the lab,
# not blkwire, and says so.

SCENARIO_DESC="kernel NVMe/TCP host -> blkwire NVMe/TCP frontend (discover, connect, id-ctrl/id-ns, Copy, mkfs.ext4, files, fsck, digests, a subsystem of two namespaces, DH-HMAC-CHAP; host checks the data)"
HOST_PACKAGES="nvme-cli e2fsprogs"
GUEST_MODULES="nvme-tcp nvme-fabrics crc32c_generic ext4 nvmet nvmet-tcp"
# (util-linux's blkdiscard: busybox's has no -z, Write Zeroes)
GUEST_BINARIES="nvme mkfs.ext4 e2fsck blkdiscard"

EXPORT=disk0
MULTI_NQN=nqn.2026-11.io.blkwire.lab:multi
DISK_SIZE=256M
SECURE_MIB=1
AUTH_PID=""
MULTI_SHA1="" MULTI_SHA2=""

scenario_setup() {
    local a b c x
    # Host NQNs of the uuid form; the guest uses the uuid as the host ID.
    a=nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)
    b=nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)
    c=nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)
    gen() { nvme gen-dhchap-key --nqn "$1" 2>&1 | grep -x 'DHHC-1:00:[A-Za-z0-9+/=]*:' || die "nvme gen-dhchap-key failed"; }
    # (one assignment each: errexit sees only the last substitution of a command)
    KEYA=$(gen "$a")
    CTRLA=$(gen "$a")
    KEYB=$(gen "$b")
    KEYC=$(gen "$c")
    KEYX=$(gen "$a")
    GUEST_ARGS="lab.export=$EXPORT lab.hosta=$a lab.keya=$KEYA lab.ctrla=$CTRLA lab.keyx=$KEYX"
    GUEST_ARGS+=" lab.hostb=$b lab.keyb=$KEYB lab.hostc=$c lab.keyc=$KEYC"
    log "DH-HMAC-CHAP: host A $a (host + controller secret), host B $b (not allowed on secure), host C $c (no line)"

    case ${LAB_NVME_AUTH:-1} in
    1) ;;
    0)
        log "WITHOUT DH-HMAC-CHAP (LAB_NVME_AUTH=0): no authenticating target, its steps are skipped"
        GUEST_ARGS+=" lab.auth=0"
        ;;
    *) die "LAB_NVME_AUTH='$LAB_NVME_AUTH': 0 or 1" ;;
    esac
    if [ "${LAB_NVME_REF:-}" = nvmet ]; then
        log "REFERENCE RUN: the guest's steps against the kernel's own nvmet inside the guest; blkwire is not tested"
        GUEST_ARGS+=" lab.nvme_ref=nvmet"
        return 0
    fi
    [ -z "${LAB_NVME_REF:-}" ] || die "LAB_NVME_REF='$LAB_NVME_REF': only 'nvmet' is known"

    # The target that requires DH-HMAC-CHAP: its own process and log (blkwire-auth.log).
    local keys=$WORK/keys
    AUTH_PORT=0 SECURE_SHA=none
    if [ "${LAB_NVME_AUTH:-1}" = 1 ]; then
        (umask 077 && printf '%s:%s %s\n%s:%s\n' "$a" "$KEYA" "$CTRLA" "$b" "$KEYB" >"$keys")
        head -c 16M /dev/urandom >"$WORK/secure.img"
        SECURE_SHA=$(head -c "${SECURE_MIB}M" "$WORK/secure.img" | sha256sum | cut -d' ' -f1)
        BLKWIRE_LOG=blkwire-auth.log start_blkwire --listen nvme-tcp://127.0.0.1:0 --rpc-socket none \
            --keys "$keys" --export "secure=file:$WORK/secure.img,allow=$a"
        AUTH_PID=$BLKWIRE_PID
        AUTH_PORT=$(listen_port nvme-tcp)
        BLKWIRE_PID=""
    fi

    truncate -s "$DISK_SIZE" "$WORK/disk.img"
    head -c 8M /dev/urandom >"$WORK/m1.img"
    head -c 4M /dev/urandom >"$WORK/m2.img"
    cp "$WORK/m2.img" "$WORK/m2.orig"
    MULTI_SHA1=$(sha256sum <"$WORK/m1.img" | cut -d' ' -f1)
    MULTI_SHA2=$(sha256sum <"$WORK/m2.img" | cut -d' ' -f1)
    # Two NVMe/TCP listeners: two paths to each subsystem (step 3b connects through both).
    start_blkwire --listen tcp://127.0.0.1:0 --listen nvme-tcp://127.0.0.1:0 \
        --listen nvme-tcp://127.0.0.1:0 \
        --export "$EXPORT=file:$WORK/disk.img" \
        --export "m1=file:$WORK/m1.img" --export "m2=file:$WORK/m2.img" \
        --subsystem "$MULTI_NQN=m1,m2;serial=LAB-MULTI;model=blkwire lab two namespaces"
    TCP_PORT=$(listen_port tcp)
    NVME_PORT=$(listen_port nvme-tcp)
    NVME_PORT2=$(listen_port nvme-tcp 2)
    # The guest reaches the host's 127.0.0.1 at 10.0.2.2 through qemu's user network.
    GUEST_ARGS+=" lab.multi_nqn=$MULTI_NQN lab.multi_sha1=$MULTI_SHA1 lab.multi_sha2=$MULTI_SHA2"
    GUEST_ARGS+=" lab.nvme_port=$NVME_PORT lab.nvme_port2=$NVME_PORT2 lab.auth_port=$AUTH_PORT lab.secure_sha=$SECURE_SHA lab.secure_mib=$SECURE_MIB"
}

scenario_verify() {
    case ${LAB_NVME_AUTH:-1} in
    1) ;;
    0)
        log "WITHOUT DH-HMAC-CHAP (LAB_NVME_AUTH=0): no authenticating target, its steps are skipped"
        GUEST_ARGS+=" lab.auth=0"
        ;;
    *) die "LAB_NVME_AUTH='$LAB_NVME_AUTH': 0 or 1" ;;
    esac
    if [ "${LAB_NVME_REF:-}" = nvmet ]; then
        log "REFERENCE RUN against nvmet passed: the lab's steps hold; blkwire was not tested"
        return 0
    fi
    verify_guest_disk
    local hello want="hello from the kernel NVMe/TCP host, $KVER"
    hello=$(debugfs -R 'cat /hello.txt' "$WORK/out.img" 2>/dev/null)
    [ "$hello" = "$want" ] || die "/hello.txt holds '$hello', expected '$want'"
    log "/hello.txt: $hello"
    # The two-namespace subsystem: m1 unchanged (only read), m2 holds m1's first MiB at 2 MiB (written by the
    # guest to namespace 2 only), the rest of m2 as it was.
    [ "$(sha256sum <"$WORK/m1.img" | cut -d' ' -f1)" = "$MULTI_SHA1" ] ||
        die "m1's file changed although the guest only read namespace 1"
    cmp -s <(head -c 1M "$WORK/m1.img") <(tail -c +$((2 * 1048576 + 1)) "$WORK/m2.img" | head -c 1M) ||
        die "m2's file does not hold m1's first MiB at 2 MiB: the guest's write to namespace 2 did not land there"
    cmp -s <(head -c 2M "$WORK/m2.img") <(head -c 2M "$WORK/m2.orig") ||
        die "m2's file changed before the MiB the guest wrote"
    cmp -s <(tail -c +$((3 * 1048576 + 1)) "$WORK/m2.img") <(tail -c +$((3 * 1048576 + 1)) "$WORK/m2.orig") ||
        die "m2's file changed after the MiB the guest wrote"
    log "subsystem $MULTI_NQN: namespace 2's write landed in m2's file at 2 MiB, the rest of m2 unchanged"
    if [ "${LAB_NVME_AUTH:-1}" = 0 ]; then
        log "PASSED WITHOUT DH-HMAC-CHAP (LAB_NVME_AUTH=0): authentication was not tested"
        return 0
    fi
    # The secure export was only read: its file is unchanged.
    [ "$(head -c "${SECURE_MIB}M" "$WORK/secure.img" | sha256sum | cut -d' ' -f1)" = "$SECURE_SHA" ] ||
        die "the secure export's file changed although the guest only read it"
    # The authenticating target must stop cleanly too (stop_blkwire acts on BLKWIRE_PID/BLKWIRE_LOG).
    BLKWIRE_PID=$AUTH_PID BLKWIRE_LOG=blkwire-auth.log
    AUTH_PID=""
    stop_blkwire
}

scenario_cleanup() {
    # run.sh stops the main target; the authenticating one is ours (still set only on failure).
    [ -n "$AUTH_PID" ] || return 0
    kill -TERM "$AUTH_PID" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$AUTH_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$AUTH_PID" 2>/dev/null
    wait "$AUTH_PID" 2>/dev/null
    AUTH_PID=""
}
