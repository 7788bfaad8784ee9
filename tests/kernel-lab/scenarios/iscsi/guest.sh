#!/bin/sh
# Scenario iscsi, guest side: the kernel's iSCSI initiator (iscsi_tcp, open-iscsi's iscsistart to
# log in, iscsid + iscsiadm to log out) against an iSCSI target on the host: blkwire's iSCSI
# frontend, or tgt (tgtd) in the reference run.
#   1. `iscsistart` logs in to iqn.2026-11.io.blkwire:disk0 (no authentication); the session's
#      disk (/dev/sda) appears with the size the host gave; mkfs.ext4, mount, write files, sync,
#      umount, `e2fsck -fn`, re-read with caches dropped; logout (the disk and the session go);
#   2. log in again with header and data digests (CRC32C, checked in sysfs): `e2fsck -fn` and
#      every file re-read; logout;
#   3. CHAP to a second target, iqn.2026-11.io.blkwire:secure, that requires it: the right secret
#      logs in (one-way, then mutual with the target's secret) and reads the export's first MiB
#      with the sha256 the host computed; refused, with no session or disk left: no credentials,
#      a wrong secret, the right secret with a wrong target secret (mutual).
# The file checksums go to the log (LAB-SHA256 lines) for the host to check what the target stored.
#
# From the kernel command line (set by host.sh): lab.iscsi_port, lab.auth_port (the CHAP target's
# port: the same or another listener), lab.export, lab.disk_bytes, lab.initiator (this guest's
# IQN), lab.chap_user, lab.chap_secret, lab.chap_wrong, lab.mutual_user, lab.mutual_secret,
# lab.mutual_wrong, lab.secure_sha, lab.secure_mib, lab.iscsi_ref (informational: "tgt" when the
# target is tgt, not blkwire).
. /lab/lib.sh

host=10.0.2.2
iqn_prefix=iqn.2026-11.io.blkwire
export_name=${LAB_EXPORT:-disk0}
target=$iqn_prefix:$export_name
secure=$iqn_prefix:secure
: "${LAB_ISCSI_PORT:?lab.iscsi_port= missing}" "${LAB_AUTH_PORT:?lab.auth_port= missing}"
: "${LAB_DISK_BYTES:?lab.disk_bytes= missing}" "${LAB_INITIATOR:?lab.initiator= missing}"
: "${LAB_CHAP_USER:?lab.chap_user= missing}" "${LAB_CHAP_SECRET:?lab.chap_secret= missing}"
: "${LAB_CHAP_WRONG:?lab.chap_wrong= missing}" "${LAB_MUTUAL_USER:?lab.mutual_user= missing}"
: "${LAB_MUTUAL_SECRET:?lab.mutual_secret= missing}" "${LAB_MUTUAL_WRONG:?lab.mutual_wrong= missing}"
: "${LAB_SECURE_SHA:?lab.secure_sha= missing}" "${LAB_SECURE_MIB:?lab.secure_mib= missing}"
initiator=$LAB_INITIATOR
mnt=/mnt

run modprobe iscsi_tcp
run modprobe sd_mod
run modprobe crc32c_generic
run modprobe ext4
[ -d /sys/class/iscsi_transport/tcp ] || fail "no iscsi_transport tcp after modprobe iscsi_tcp"
if [ "${LAB_ISCSI_REF:-}" = tgt ]; then
    info "REFERENCE RUN: the target is tgt (tgtd on the host), not blkwire"
fi

# open-iscsi's configuration: the initiator name iscsid reads, and bounded timeouts (a refused
# login is not retried for minutes: one retry, 15 s per attempt).
mkdir -p /etc/iscsi /var/lib/iscsi /run/lock/iscsi
# iscsid serves only root, whom it looks up by uid (getpwuid): the initramfs has no /etc/passwd.
[ -f /etc/passwd ] || echo 'root:x:0:0:root:/root:/bin/sh' >/etc/passwd
echo "InitiatorName=$initiator" >/etc/iscsi/initiatorname.iscsi
cat >/etc/iscsi/iscsid.conf <<EOF
node.startup = manual
node.session.initial_login_retry_max = 1
node.conn[0].timeo.login_timeout = 15
node.conn[0].timeo.logout_timeout = 15
node.session.timeo.replacement_timeout = 15
EOF
info "initiator $initiator"

# The iSCSI session (sessionN in sysfs) logged in to TARGET, if any.
session_of() {
    for _s in /sys/class/iscsi_session/session*; do
        [ -f "$_s/targetname" ] && [ "$(cat "$_s/targetname")" = "$1" ] && echo "${_s##*/}" && return 0
    done
    return 1
}

# iscsi_login TARGET PORT ARGS...: iscsistart's login (ARGS: CHAP and -P options); its output is
# in /tmp/login.log. Returns iscsistart's status, bounded: a login that hangs is a failure.
iscsi_login() {
    _t=$1 _p=$2
    shift 2
    step "iscsistart -i $initiator -t $_t -g 1 -a $host -p $_p $*"
    timeout 60 iscsistart -i "$initiator" -t "$_t" -g 1 -a $host -p "$_p" "$@" >/tmp/login.log 2>&1
}

# login_failed WHAT: iscsistart's output and the kernel's iSCSI lines, then fail.
login_failed() {
    sed 's/^/iscsistart| /' /tmp/login.log | tail -n 30
    fail "$1 failed: $(grep -v '^iscsistart: Logging into' /tmp/login.log | tail -n 2 | tr '\n' '|') $(iscsi_dmesg 3)"
}

# iscsi_disk TARGET: the disk (/dev/sdX) of the session logged in to TARGET; waits (bounded, 20 s)
# for the SCSI scan. The target's only disk LUN (tgt adds a controller LUN 0 with no block device).
iscsi_disk() {
    _i=0
    while :; do
        if _sess=$(session_of "$1"); then
            for _b in /sys/class/iscsi_session/"$_sess"/device/target*/*/block/*; do
                [ -e "$_b" ] && [ -b "/dev/${_b##*/}" ] && echo "/dev/${_b##*/}" && return 0
            done
        fi
        _i=$((_i + 1))
        [ $_i -le 200 ] || fail "no disk of $1 appeared within 20 s: $(iscsi_dmesg 4)"
        sleep 0.1
    done
}

iscsi_dmesg() {
    dmesg | grep -iE 'iscsi|scsi|sd[a-z]' | tail -n "${1:-8}" | sed 's/^\[ *[0-9.]*\] //' | tr '\n' '|'
}

# iscsi_logout TARGET: log out of TARGET's session through iscsid (iscsistart has no logout; iscsid
# takes the session over from sysfs), then check that the session and its disk are gone. iscsid
# stops again: iscsistart and iscsid cannot both run (they listen on the same management socket).
iscsi_logout() {
    _sess=$(session_of "$1") || fail "no session of $1 to log out of"
    _disk=$(iscsi_disk "$1")
    step "iscsiadm -m session -r ${_sess#session} --logout ($1, $_disk)"
    # (its own session: iscsid ends by signalling its whole process group, this script included;
    # setsid execs it in place here, so $! is iscsid's pid)
    setsid iscsid -f >/tmp/iscsid.log 2>&1 &
    _iscsid=$!
    _i=0
    until iscsiadm -m session >/dev/null 2>&1; do
        _i=$((_i + 1))
        [ $_i -le 100 ] || fail "iscsid did not answer within 10 s: $(tail -n 3 /tmp/iscsid.log | tr '\n' '|')"
        sleep 0.1
    done
    # iscsid takes a session over by logging in again on a new connection: a logout during that
    # relogin is refused ("trying to reconnect: try again later"). Retried, bounded.
    _i=0
    until iscsiadm -m session -r "${_sess#session}" --logout >/tmp/logout.log 2>&1; do
        info "logout refused: $(grep -v '^Logging out' /tmp/logout.log | tail -n1)"
        _i=$((_i + 1))
        [ $_i -le 40 ] || {
            cat /tmp/logout.log /tmp/iscsid.log
            fail "iscsiadm --logout of $1 failed for 20 s: $(grep -v '^Logging out' /tmp/logout.log | tail -n1)"
        }
        sleep 0.5
    done
    kill "$_iscsid"
    wait "$_iscsid" 2>/dev/null || true
    _i=0
    while session_of "$1" >/dev/null || [ -e "/sys/block/${_disk#/dev/}" ]; do
        _i=$((_i + 1))
        [ $_i -le 100 ] || fail "$1's session or $_disk still exists 10 s after logout"
        sleep 0.1
    done
    info "logged out of $1 ($_disk is gone)"
}

# refused WHAT ARGS...: a CHAP login that must fail, leaving no session behind.
refused() {
    _what=$1
    shift
    if iscsi_login "$secure" "$LAB_AUTH_PORT" "$@"; then
        fail "login to $secure with $_what succeeded; it must be refused"
    fi
    session_of "$secure" >/dev/null && fail "a session to $secure is left after the refused login with $_what"
    info "refused: $_what ($(grep -iE 'fail|error|auth' /tmp/login.log | tail -n1))"
}

no_sessions() {
    _left=$(cd /sys/class/iscsi_session 2>/dev/null && echo session*)
    [ "$_left" = "session*" ] || [ -z "$_left" ] || fail "iSCSI sessions exist where none should: $_left"
}

# ---- 1. login without authentication, a filesystem ------------------------------------------------
iscsi_login "$target" "$LAB_ISCSI_PORT" || login_failed "iscsistart to $target"
dev=$(iscsi_disk "$target")
size=$(blockdev --getsize64 "$dev")
sess=$(session_of "$target")
info "$dev: $size bytes, logical block $(blockdev --getss "$dev"), $sess, vendor '$(cat "/sys/block/${dev#/dev/}/device/vendor")' model '$(cat "/sys/block/${dev#/dev/}/device/model")'"
[ "$size" = "$LAB_DISK_BYTES" ] || fail "$dev has $size bytes; the export has $LAB_DISK_BYTES"

run mkfs.ext4 -q -F -L blkwire-lab "$dev"
run mount -t ext4 "$dev" "$mnt"
write_test_files "$mnt" "hello from the kernel iSCSI initiator, $(uname -r)"
run umount "$mnt"
run e2fsck -fn "$dev"
verify_after_reread "$dev" "$mnt"
iscsi_logout "$target"
no_sessions

# ---- 2. header and data digests -----------------------------------------------------------------
iscsi_login "$target" "$LAB_ISCSI_PORT" -P 'node.conn[0].iscsi.HeaderDigest=CRC32C' \
    -P 'node.conn[0].iscsi.DataDigest=CRC32C' ||
    login_failed "iscsistart with digests to $target"
dev=$(iscsi_disk "$target")
for c in /sys/class/iscsi_connection/connection*; do
    hdig=$(cat "$c/header_digest") ddig=$(cat "$c/data_digest")
done
# (sysfs shows a negotiated digest as 1, none as 0)
if [ "$hdig" != 1 ] || [ "$ddig" != 1 ]; then
    fail "digests in sysfs: header_digest $hdig, data_digest $ddig; expected 1 (CRC32C) for both"
fi
info "digests: CRC32C on headers and data"
run e2fsck -fn "$dev"
verify_after_reread "$dev" "$mnt"
iscsi_logout "$target"
no_sessions

# ---- 3. CHAP ------------------------------------------------------------------------------------
# The export's first MiB, read through the session, against the host's sha256.
read_secure() {
    _d=$(iscsi_disk "$secure")
    step "read ${LAB_SECURE_MIB} MiB of $_d"
    _got=$(dd if="$_d" bs=1M count="$LAB_SECURE_MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    [ "$_got" = "$LAB_SECURE_SHA" ] || fail "$secure over CHAP read back sha256 $_got; the host has $LAB_SECURE_SHA"
}
iscsi_login "$secure" "$LAB_AUTH_PORT" -u "$LAB_CHAP_USER" -w "$LAB_CHAP_SECRET" ||
    login_failed "CHAP login to $secure with the right secret"
read_secure
info "CHAP (one-way) as $LAB_CHAP_USER: logged in, data verified"
iscsi_logout "$secure"
iscsi_login "$secure" "$LAB_AUTH_PORT" -u "$LAB_CHAP_USER" -w "$LAB_CHAP_SECRET" \
    -U "$LAB_MUTUAL_USER" -W "$LAB_MUTUAL_SECRET" ||
    login_failed "mutual CHAP login to $secure"
read_secure
info "CHAP (mutual, target $LAB_MUTUAL_USER): logged in, data verified"
iscsi_logout "$secure"
no_sessions

refused "no credentials"
refused "a wrong secret" -u "$LAB_CHAP_USER" -w "$LAB_CHAP_WRONG"
refused "a wrong target secret (mutual)" -u "$LAB_CHAP_USER" -w "$LAB_CHAP_SECRET" \
    -U "$LAB_MUTUAL_USER" -W "$LAB_MUTUAL_WRONG"
no_sessions
