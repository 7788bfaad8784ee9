#!/bin/sh
# Scenario nvme-tcp, guest side: the kernel's NVMe/TCP host (nvme-tcp, nvme-cli 2.3) against
# blkwire's NVMe/TCP frontend on the host.
#   1. discovery: `nvme discover` lists nqn.2026-11.io.blkwire:disk0 and the two-namespace
#      subsystem lab.multi_nqn (four NVM subsystems, disk0, m1, m2 and that one, at each of the
#      two listeners: eight entries);
#   2. `nvme connect` without digests; `nvme list`, `id-ctrl` (subnqn), `id-ns` (size = the
#      device's); NVMe Copy of two source ranges, checked with dd before and after; mkfs.ext4,
#      mount, write files, sync, umount, `e2fsck -fn`, re-read with caches dropped; disconnect;
#   3. `nvme connect -g -G` (header and data digests): fsck and every file read back; disconnect;
#   3b. the subsystem of two namespaces: one controller, /dev/nvmeXnY for NSIDs 1 and 2 with the
#      sizes (8 and 4 MiB) and sha256s the host gave, id-ctrl's serial, model and NN; a second
#      path (connect through the second listener): a second controller of the same subsystem,
#      the same two namespace devices (multipath); m1's first MiB written to namespace 2 at 2 MiB
#      (the host finds it in m2's file); disconnect (both paths);
#   4. DH-HMAC-CHAP against a second target that requires it (export "secure", allow=host A):
#      host A's secret connects (unidirectional, then bidirectional with the controller secret) and
#      reads the export's data (sha256 from the host); refused, with no namespace left: host A
#      without a secret, with a wrong secret, with a wrong controller secret, an unlisted host, a
#      listed host the export does not allow.
# The file checksums go to the log (LAB-SHA256 lines) for the host to check what blkwire stored.
#
# From the kernel command line (set by host.sh): lab.nvme_port, lab.nvme_port2 (a second
# listener of the same target: every subsystem is listed there too), lab.auth_port, lab.export,
# lab.hosta, lab.keya, lab.ctrla (host A, its secret, the controller's secret), lab.keyx (a
# secret nobody has), lab.hostb, lab.keyb (listed, not allowed), lab.hostc, lab.keyc (unlisted),
# lab.secure_sha, lab.secure_mib (sha256 of the first MiB of the secure export), lab.multi_nqn,
# lab.multi_sha1, lab.multi_sha2 (the two-namespace subsystem and its exports' sha256s); lab.auth=0
# skips part 4 (said in the log).
# lab.nvme_ref=nvmet: a reference run against the kernel's own target (nvmet) inside the guest,
# configured like blkwire (same NQNs, hosts and secrets), to tell the lab's faults from the
# frontend's; nvmet has no Copy, so there the Copy must be refused.
. /lab/lib.sh

nqn_prefix=nqn.2026-11.io.blkwire
export_name=${LAB_EXPORT:-disk0}
nqn=$nqn_prefix:$export_name
secure_nqn=$nqn_prefix:secure
: "${LAB_HOSTA:?lab.hosta= missing}" "${LAB_KEYA:?lab.keya= missing}" "${LAB_CTRLA:?lab.ctrla= missing}"
: "${LAB_KEYX:?lab.keyx= missing}" "${LAB_HOSTB:?lab.hostb= missing}" "${LAB_KEYB:?lab.keyb= missing}"
: "${LAB_HOSTC:?lab.hostc= missing}" "${LAB_KEYC:?lab.keyc= missing}"
mnt=/mnt

run modprobe nvme-tcp
run modprobe crc32c_generic
run modprobe ext4
[ -e /dev/nvme-fabrics ] || fail "/dev/nvme-fabrics is missing after modprobe nvme-tcp"
nvme_host_ids
info "host NQN $(cat /etc/nvme/hostnqn)"

if [ "${LAB_NVME_REF:-}" = nvmet ]; then
    # The reference: nvmet on this guest's loopback, set up as host.sh sets up blkwire.
    addr=127.0.0.1 port=4420 auth_port=4421
    nvmet_start
    step "nvmet: $nqn and $secure_nqn on $addr:$port and :$auth_port"
    truncate -s 256M /tmp/disk.img
    dd if=/dev/urandom of=/tmp/secure.img bs=1M count=16 2>/dev/null
    secure_mib=1
    secure_sha=$(dd if=/tmp/secure.img bs=1M count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
    nvmet_port 1 $addr $port
    nvmet_port 2 $addr $auth_port
    nvmet_subsys "$nqn" /tmp/disk.img 1 1
    nvmet_subsys "$secure_nqn" /tmp/secure.img 2 0
    nvmet_host "$LAB_HOSTA" "$LAB_KEYA" "$LAB_CTRLA"
    nvmet_host "$LAB_HOSTB" "$LAB_KEYB"
    nvmet_allow "$secure_nqn" "$LAB_HOSTA"
    info "REFERENCE RUN: the kernel's nvmet, not blkwire"
else
    addr=10.0.2.2
    port=${LAB_NVME_PORT:?lab.nvme_port= missing on the kernel command line}
    port2=${LAB_NVME_PORT2:?lab.nvme_port2= missing on the kernel command line}
    auth_port=${LAB_AUTH_PORT:?lab.auth_port= missing on the kernel command line}
    secure_sha=${LAB_SECURE_SHA:?lab.secure_sha= missing}
    secure_mib=${LAB_SECURE_MIB:?lab.secure_mib= missing}
fi

# ---- 1. discovery ---------------------------------------------------------------------------------
step "nvme discover -t tcp -a $addr -s $port"
nvme discover -t tcp -a $addr -s "$port" >/tmp/disc 2>&1 || fail "nvme discover failed: $(cat /tmp/disc)"
grep -q "^subnqn: *$nqn\$" /tmp/disc || fail "the discovery log does not list $nqn: $(tr '\n' '|' </tmp/disc)"
subsystems=$(grep -c '^subtype: *nvme subsystem' /tmp/disc || true)
if [ "${LAB_NVME_REF:-}" = nvmet ]; then
    [ "$subsystems" = 1 ] || fail "the discovery log lists $subsystems NVM subsystems, expected 1 (one export)"
else
    [ "$subsystems" = 8 ] || fail "the discovery log lists $subsystems NVM subsystem entries, expected 8 (disk0, m1, m2, each its own, and ${LAB_MULTI_NQN:-}, at each of two listeners)"
    grep -q "^subnqn: *${LAB_MULTI_NQN:?lab.multi_nqn= missing}\$" /tmp/disc ||
        fail "the discovery log does not list $LAB_MULTI_NQN: $(tr '\n' '|' </tmp/disc)"
fi
info "discovery: $(grep -m1 'Discovery Log' /tmp/disc); $nqn at $(sed -n 's/^traddr: *//p' /tmp/disc | head -n1):$(sed -n 's/^trsvcid: *//p' /tmp/disc | head -n1)"

# ---- 2. connect without digests -------------------------------------------------------------------
run nvme connect -t tcp -a $addr -s "$port" -n "$nqn"
dev=$(nvme_ns "$nqn")
ctrl=$(nvme_ctrl "$nqn")
size=$(blockdev --getsize64 "$dev")
lbs=$(blockdev --getss "$dev")
info "$dev (controller $ctrl): $size bytes, logical block $lbs"
[ "$size" -gt 0 ] || fail "$dev has size $size"

step "nvme list"
nvme list >/tmp/list 2>&1 || fail "nvme list failed: $(tr '\n' ' ' </tmp/list)"
cat /tmp/list
grep -q "^$dev " /tmp/list || fail "nvme list does not show $dev: $(tr '\n' '|' </tmp/list)"

step "nvme id-ctrl $ctrl"
nvme id-ctrl "$ctrl" >/tmp/idctrl 2>&1 || fail "nvme id-ctrl $ctrl failed: $(tr '\n' ' ' </tmp/idctrl)"
cat /tmp/idctrl
got=$(sed -n 's/^subnqn *: *//p' /tmp/idctrl)
[ "$got" = "$nqn" ] || fail "id-ctrl subnqn is '$got', expected $nqn"
info "id-ctrl: mn '$(sed -n 's/^mn *: *//p' /tmp/idctrl | sed 's/ *$//')', fr '$(sed -n 's/^fr *: *//p' /tmp/idctrl | sed 's/ *$//')', cntlid $(sed -n 's/^cntlid *: *//p' /tmp/idctrl), oncs $(sed -n 's/^oncs *: *//p' /tmp/idctrl), vwc $(sed -n 's/^vwc *: *//p' /tmp/idctrl), sgls $(sed -n 's/^sgls *: *//p' /tmp/idctrl)"

step "nvme id-ns $dev"
nvme id-ns "$dev" >/tmp/idns 2>&1 || fail "nvme id-ns $dev failed: $(tr '\n' ' ' </tmp/idns)"
cat /tmp/idns
nsze=$(sed -n 's/^nsze *: *//p' /tmp/idns)
lbads=$(sed -n 's/^lbaf *[0-9]* *:.*lbads:\([0-9]*\).*(in use).*/\1/p' /tmp/idns)
if [ -z "$nsze" ] || [ -z "$lbads" ]; then
    fail "id-ns shows no nsze or no LBA format in use: $(tr '\n' '|' </tmp/idns)"
fi
[ $((nsze << lbads)) = "$size" ] || fail "id-ns: nsze $nsze x 2^$lbads = $((nsze << lbads)) bytes, the device has $size"
[ $((1 << lbads)) = "$lbs" ] || fail "id-ns: LBA size 2^$lbads, the block device says $lbs"
info "id-ns: nsze $nsze, lbads $lbads, nguid $(sed -n 's/^nguid *: *//p' /tmp/idns)"

# What the block layer made of the controller: DSM deallocate (discard), Write Zeroes, a volatile
# write cache (Flush) and FUA must all be there.
q=/sys/block/${dev#/dev/}/queue
info "discard_max_bytes $(cat "$q"/discard_max_bytes), write_zeroes_max_bytes $(cat "$q"/write_zeroes_max_bytes), max_sectors_kb $(cat "$q"/max_sectors_kb), write_cache '$(cat "$q"/write_cache)', fua $(cat "$q"/fua)"
[ "$(cat "$q"/discard_max_bytes)" -gt 0 ] || fail "$dev takes no discards (no DSM deallocate in ONCS?)"
[ "$(cat "$q"/write_zeroes_max_bytes)" -gt 0 ] || fail "$dev has no Write Zeroes (ONCS)"
[ "$(cat "$q"/write_cache)" = "write back" ] || fail "$dev has no volatile write cache (VWC): no Flush"
[ "$(cat "$q"/fua)" = 1 ] || fail "$dev does not take FUA writes"
# Write Zeroes: 1 MiB of random data at 8 MiB, then zeroed with util-linux's `blkdiscard -z`
# (BLKZEROOUT: Write Zeroes commands on a device with write_zeroes_max_bytes > 0). By its path:
# Debian's busybox sh prefers its own applets, and busybox's blkdiscard has no -z.
run dd if=/dev/urandom of="$dev" bs=64k count=16 seek=128 conv=fsync
run /usr/bin/blkdiscard -f -z -o $((8 << 20)) -l $((1 << 20)) "$dev"
run blockdev --flushbufs "$dev"
echo 3 >/proc/sys/vm/drop_caches
[ "$(dd if="$dev" bs=64k count=16 skip=128 2>/dev/null | sha256sum)" = "$(dd if=/dev/zero bs=64k count=16 2>/dev/null | sha256sum)" ] ||
    fail "1 MiB at 8 MiB is not zero after blkdiscard -z (Write Zeroes)"
info "Write Zeroes: 1 MiB of random data read back as zeros"
# DSM deallocate, as mkfs and fstrim send it (mkfs ignores a failed discard, so check it here).
# Linux sends the range list in a 4 KiB buffer whatever the number of ranges (NR) says.
step "blkdiscard -o 8M -l 1M $dev (DSM deallocate)"
blkdiscard -o $((8 << 20)) -l $((1 << 20)) "$dev" >/tmp/discard.out 2>&1 ||
    fail "blkdiscard (DSM deallocate) failed: $(tr '\n' ' ' </tmp/discard.out) | kernel: $(nvme_dmesg 2)"
info "DSM deallocate of 1 MiB: done"

# NVMe Copy (opcode 0x19): two source ranges (8 blocks at LBA 64, 4 at LBA 128; --blocks is
# zero-based) to LBA 256, whose 16 blocks are zero before: afterwards 8 + 4 copied blocks, then
# 4 still zero. Read with the block device's cache flushed: the copy bypasses it.
step "nvme copy: source ranges written, destination zeroed"
dd if=/dev/urandom of=/tmp/src1 bs="$lbs" count=8 2>/dev/null
dd if=/dev/urandom of=/tmp/src2 bs="$lbs" count=4 2>/dev/null
dd if=/dev/zero of=/tmp/zero bs="$lbs" count=4 2>/dev/null
run dd if=/tmp/src1 of="$dev" bs="$lbs" seek=64 conv=fsync
run dd if=/tmp/src2 of="$dev" bs="$lbs" seek=128 conv=fsync
run dd if=/dev/zero of="$dev" bs="$lbs" seek=256 count=16 conv=fsync
cat /tmp/src1 /tmp/src2 /tmp/zero >/tmp/want
step "nvme copy $dev --sdlba=256 --slbs=64,128 --blocks=7,3"
if nvme copy "$dev" --sdlba=256 --slbs=64,128 --blocks=7,3 >/tmp/copy.out 2>&1; then
    [ "${LAB_NVME_REF:-}" != nvmet ] || fail "nvmet accepted a Copy (it has none): $(cat /tmp/copy.out)"
    run blockdev --flushbufs "$dev"
    echo 3 >/proc/sys/vm/drop_caches
    run dd if="$dev" of=/tmp/got bs="$lbs" skip=256 count=16
    cmp /tmp/want /tmp/got >/tmp/cmp 2>&1 || fail "after nvme copy, LBAs 256-271 differ from the sources: $(cat /tmp/cmp)"
    info "nvme copy: 2 ranges (8 + 4 blocks) copied to LBA 256, read back identical, the 4 blocks after untouched"
elif [ "${LAB_NVME_REF:-}" = nvmet ]; then
    info "nvmet refused the Copy, as expected (nvmet has none): $(tr '\n' ' ' </tmp/copy.out)"
else
    fail "nvme copy failed: $(tr '\n' ' ' </tmp/copy.out) | kernel: $(nvme_dmesg 3)"
fi

# Many large writes at once on one I/O queue, as page-cache writeback sends them: 8 writers of
# 1 MiB (O_DIRECT, each beyond the 8 KiB in-capsule size, so each takes an R2T) on CPU 0, whose
# queue they share; the data must come back. A target that stops reading the connection while
# writes it solicited wait for their data (queued behind later commands) hangs here.
step "8 concurrent 1 MiB O_DIRECT writes on one I/O queue (taskset -c 0)"
dd if=/dev/urandom of=/tmp/par bs=1M count=8 2>/dev/null
pids=""
k=0
while [ $k -lt 8 ]; do
    taskset -c 0 dd if=/tmp/par of="$dev" bs=1M count=1 skip=$k seek=$((32 + k)) oflag=direct 2>/tmp/par$k &
    pids="$pids $!"
    k=$((k + 1))
done
i=0
for p in $pids; do
    while kill -0 "$p" 2>/dev/null; do
        i=$((i + 1))
        [ $i -le 600 ] || fail "8 concurrent 1 MiB writes on one queue: not done after 60 s (writes hang); kernel: $(nvme_dmesg 4)"
        sleep 0.1
    done
    wait "$p" || fail "8 concurrent 1 MiB writes on one queue: a dd failed: $(cat /tmp/par*) | kernel: $(nvme_dmesg 4)"
done
run dd if="$dev" of=/tmp/par.back bs=1M count=8 skip=32 iflag=direct
cmp /tmp/par /tmp/par.back >/tmp/cmp 2>&1 || fail "8 concurrent 1 MiB writes: read back different: $(cat /tmp/cmp)"
info "8 concurrent 1 MiB writes on one queue: done, read back identical"

# mkfs discards the whole device first (DSM deallocate reaches the target).
run mkfs.ext4 -q -F -L blkwire-lab "$dev"
run mount -t ext4 "$dev" "$mnt"
write_test_files "$mnt" "hello from the kernel NVMe/TCP host, $(uname -r)"
run umount "$mnt"
run e2fsck -fn "$dev"
verify_after_reread "$dev" "$mnt"

run nvme disconnect -n "$nqn"
nvme_gone "$dev"
nvme_none
info "disconnected: $dev is gone"

# ---- 3. header and data digests -------------------------------------------------------------------
run nvme connect -t tcp -a $addr -s "$port" -n "$nqn" -g -G
dev=$(nvme_ns "$nqn")
run e2fsck -fn "$dev"
verify_after_reread "$dev" "$mnt"
run nvme disconnect -n "$nqn"
nvme_gone "$dev"
info "with header and data digests (-g -G): fsck clean, every file read back identical"

# ---- 3b. a subsystem of two namespaces -------------------------------------------------------------
ns_dev() { # NQN NSID: the block device of namespace NSID of NQN's controller
    _i=0
    while :; do
        for _s in /sys/class/nvme-subsystem/nvme-subsys* /sys/class/nvme/nvme*; do
            [ -f "$_s/subsysnqn" ] || continue
            [ "$(cat "$_s/subsysnqn")" = "$1" ] || continue
            for _n in "$_s"/nvme*n*; do
                [ -f "$_n/nsid" ] && [ "$(cat "$_n/nsid")" = "$2" ] && [ -b "/dev/${_n##*/}" ] &&
                    echo "/dev/${_n##*/}" && return 0
            done
        done
        _i=$((_i + 1))
        [ $_i -le 100 ] || fail "no namespace $2 of $1 appeared within 10 s: $(nvme_dmesg 4)"
        sleep 0.1
    done
}
if [ "${LAB_NVME_REF:-}" = nvmet ]; then
    info "two-namespace subsystem SKIPPED in the reference run (blkwire's --subsystem only)"
else
    multi=$LAB_MULTI_NQN
    run nvme connect -t tcp -a $addr -s "$port" -n "$multi"
    n1=$(ns_dev "$multi" 1)
    n2=$(ns_dev "$multi" 2)
    mctrl=$(nvme_ctrl "$multi")
    ctrls=$(cd /sys/class/nvme && echo nvme*)
    [ "$ctrls" = "${mctrl#/dev/}" ] || fail "one controller expected for both namespaces, found: $ctrls"
    step "nvme id-ctrl $mctrl (two namespaces)"
    nvme id-ctrl "$mctrl" >/tmp/idctrl 2>&1 || fail "nvme id-ctrl $mctrl failed: $(tr '\n' ' ' </tmp/idctrl)"
    sn=$(sed -n 's/^sn *: *//p' /tmp/idctrl | sed 's/ *$//')
    mn=$(sed -n 's/^mn *: *//p' /tmp/idctrl | sed 's/ *$//')
    nn=$(sed -n 's/^nn *: *//p' /tmp/idctrl)
    [ "$sn" = LAB-MULTI ] || fail "id-ctrl sn is '$sn', expected LAB-MULTI"
    [ "$mn" = "blkwire lab two namespaces" ] || fail "id-ctrl mn is '$mn', expected 'blkwire lab two namespaces'"
    [ "$nn" = 2 ] || fail "id-ctrl nn is '$nn', expected 2"
    step "nvme list-ns $mctrl"
    nvme list-ns "$mctrl" >/tmp/listns 2>&1 || fail "nvme list-ns failed: $(tr '\n' ' ' </tmp/listns)"
    cat /tmp/listns
    [ "$(grep -c '^\[ *[0-9]*\]:0x' /tmp/listns)" = 2 ] || fail "list-ns does not show two namespaces: $(tr '\n' '|' </tmp/listns)"
    for pair in "$n1 8388608 ${LAB_MULTI_SHA1:?}" "$n2 4194304 ${LAB_MULTI_SHA2:?}"; do
        # shellcheck disable=SC2086 # split on purpose: device, size, sha256
        set -- $pair
        got=$(blockdev --getsize64 "$1")
        [ "$got" = "$2" ] || fail "$1: $got bytes, expected $2"
        got=$(sha256sum <"$1" | cut -d' ' -f1)
        [ "$got" = "$3" ] || fail "$1: sha256 $got, expected $3 (the export's data)"
        info "$1 (NSID $(cat "/sys/block/${1#/dev/}/nsid")): $2 bytes, sha256 as the host has it"
    done
    # A second path: the subsystem through the second listener. CMIC allows several
    # controllers, so Linux takes it (it refused it otherwise) and joins its namespaces to the
    # same devices by their NGUIDs.
    run nvme connect -t tcp -a $addr -s "$port2" -n "$multi"
    two_paths() { [ "$(grep -lx "$multi" /sys/class/nvme/nvme*/subsysnqn 2>/dev/null | wc -l)" = 2 ]; }
    wait_until "no second controller of $multi 10 s after connecting through port $port2" two_paths
    # Its namespaces scanned (asynchronously): each controller has a namespace entry per NSID,
    # a path of the shared device or a device of its own.
    scanned() {
        for _c in $(grep -lx "$multi" /sys/class/nvme/nvme*/subsysnqn); do
            _d=${_c%/subsysnqn}
            # shellcheck disable=SC2046 # one word per entry
            set -- $(cd "$_d" && ls -d nvme*n* 2>/dev/null)
            [ $# -ge 2 ] || return 1
        done
    }
    wait_until "the second controller of $multi has not scanned its namespaces 10 s after connecting" scanned
    # Still two block devices: a second path that made devices of its own would show four.
    # shellcheck disable=SC2046 # split on purpose: one word per device node
    set -- $(ls /dev | grep -E '^nvme[0-9]+n[0-9]+$')
    [ $# = 2 ] && [ "$(ns_dev "$multi" 1)" = "$n1" ] && [ "$(ns_dev "$multi" 2)" = "$n2" ] ||
        fail "the second path made namespace devices of its own: $*"
    [ "$(sha256sum <"$n2" | cut -d' ' -f1)" = "$LAB_MULTI_SHA2" ] || fail "$n2 reads otherwise over two paths"
    info "subsystem $multi through two listeners: two controllers, namespaces still $n1 and $n2"
    nguid1=$(nvme id-ns "$n1" | sed -n 's/^nguid *: *//p')
    nguid2=$(nvme id-ns "$n2" | sed -n 's/^nguid *: *//p')
    [ -n "$nguid1" ] || fail "id-ns $n1 shows no NGUID"
    [ "$nguid1" != "$nguid2" ] || fail "namespaces 1 and 2 have the same NGUID $nguid1"
    run dd if="$n1" of="$n2" bs=1M count=1 seek=2 oflag=direct
    run nvme disconnect -n "$multi"
    nvme_gone "$n1"
    nvme_gone "$n2"
    nvme_none
    info "subsystem $multi: namespaces 1 and 2 ($n1, $n2) with their sizes, data and NGUIDs, one controller and then two paths; 1 MiB written to namespace 2"
fi

# ---- 4. DH-HMAC-CHAP --------------------------------------------------------------------------------
if [ "${LAB_AUTH:-1}" = 0 ]; then
    info "DH-HMAC-CHAP SKIPPED (lab.auth=0, LAB_NVME_AUTH=0 on the host)"
    exit 0
fi
# Each host NQN comes with its own host ID (the uuid in the NQN): the kernel refuses one host ID
# under two NQNs.
auth() { # HOSTNQN ARGS...: nvme connect to the secure export as HOSTNQN
    a_host=$1
    shift
    set -- -t tcp -a $addr -s "$auth_port" -n "$secure_nqn" --hostnqn "$a_host" --hostid "${a_host##*:uuid:}" "$@"
    echo "$*" >/tmp/auth.args
    nvme connect "$@"
}

read_secure() { # WHAT
    sdev=$(nvme_ns "$secure_nqn")
    got=$(dd if="$sdev" bs=1M count="$secure_mib" 2>/dev/null | sha256sum | cut -d' ' -f1)
    [ "$got" = "$secure_sha" ] || fail "$1: the first $secure_mib MiB of $sdev have sha256 $got, expected $secure_sha"
    run nvme disconnect -n "$secure_nqn"
    nvme_gone "$sdev"
    info "$1: connected, $secure_mib MiB read with the expected sha256, disconnected"
}

# A refusal must be prompt: a target that drops the connection instead of answering (AUTH_Failure1,
# or a Connect error) leaves the host waiting for its timeout. nvmet itself sometimes tears the
# controller down before the host has read its Failure1 (the host then waits ~60 s): the reference
# run only reports the time.
refuse_max=20
refused() { # WHAT HOSTNQN ARGS...
    r_what=$1
    shift
    step "refused: $r_what"
    r_t0=$(cut -d. -f1 /proc/uptime)
    if auth "$@" >/tmp/auth.out 2>&1; then
        fail "$r_what: nvme connect $(cat /tmp/auth.args) succeeded: $(tr '\n' ' ' </tmp/auth.out)"
    fi
    r_s=$(($(cut -d. -f1 /proc/uptime) - r_t0))
    nvme_none
    info "$r_what: refused after ~$r_s s ($(tr '\n' ' ' </tmp/auth.out | cut -c1-100)); kernel: $(nvme_dmesg 2)"
    if [ "$r_s" -gt $refuse_max ] && [ "${LAB_NVME_REF:-}" != nvmet ]; then
        fail "$r_what: the refusal took $r_s s (more than $refuse_max): the host waited for a timeout instead of an answer; kernel: $(nvme_dmesg 6)"
    fi
}

step "host A, its secret (unidirectional)"
auth "$LAB_HOSTA" --dhchap-secret="$LAB_KEYA" >/tmp/auth.out 2>&1 ||
    fail "host A with its secret: nvme connect $(cat /tmp/auth.args) failed: $(tr '\n' ' ' </tmp/auth.out) | kernel: $(nvme_dmesg 3)"
read_secure "DH-HMAC-CHAP unidirectional"

step "host A, its secret and the controller's (bidirectional)"
auth "$LAB_HOSTA" --dhchap-secret="$LAB_KEYA" --dhchap-ctrl-secret="$LAB_CTRLA" >/tmp/auth.out 2>&1 ||
    fail "host A, bidirectional: nvme connect $(cat /tmp/auth.args) failed: $(tr '\n' ' ' </tmp/auth.out) | kernel: $(nvme_dmesg 3)"
read_secure "DH-HMAC-CHAP bidirectional"

refused "host A without a secret" "$LAB_HOSTA"
refused "host A with a wrong secret" "$LAB_HOSTA" --dhchap-secret="$LAB_KEYX"
refused "host A with a wrong controller secret (bidirectional)" "$LAB_HOSTA" \
    --dhchap-secret="$LAB_KEYA" --dhchap-ctrl-secret="$LAB_KEYX"
refused "an unlisted host" "$LAB_HOSTC" --dhchap-secret="$LAB_KEYC"
refused "a listed host the export does not allow" "$LAB_HOSTB" --dhchap-secret="$LAB_KEYB"
