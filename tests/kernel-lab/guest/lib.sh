# Helpers for guest scenario scripts (busybox sh, run with -e by /init). Source with: . /lab/lib.sh
#
#   step TEXT       announce the next step (shown in the log; named in the result if the scenario fails)
#   info TEXT       a fact worth keeping in the log (LAB-INFO lines are echoed by the host on success)
#   fail TEXT       end the scenario: LAB-RESULT: FAIL TEXT
#   run CMD...      step "CMD..." then run it; a non-zero exit fails the scenario, naming the command
#   emit KEY VALUE  a machine-readable line "LAB-KEY: VALUE" for the host-side checks
#   bw ARGS...      step "blkwire ARGS..." then run it; on failure show its output and the map
#                   daemon's log ($maplog, /tmp/map.log) before failing
#   serve LOG ARGS... start `blkwire serve ARGS...` in the background (output in LOG) and wait
#                   until it listens; its pid is in $served

step() {
    echo "$*" >/tmp/lab-step
    echo "LAB-STEP: [$(cut -d' ' -f1 /proc/uptime)s] $*"
}
info() { echo "LAB-INFO: $*"; }
emit() {
    k=$1
    shift
    echo "LAB-$k: $*"
}
fail() {
    echo "$*" >/tmp/lab-fail
    echo "LAB-FAIL: $*"
    exit 1
}
run() {
    step "$*"
    "$@" || fail "'$*' exited with status $?"
}

maplog=/tmp/map.log
bw() {
    step "blkwire $*"
    blkwire "$@" >/tmp/bw.out 2>&1 || {
        cat /tmp/bw.out
        [ -f $maplog ] && sed 's/^/map.log| /' $maplog
        fail "'blkwire $*' failed: $(tail -n1 /tmp/bw.out)"
    }
    cat /tmp/bw.out
}

serve() {
    log=$1
    shift
    step "blkwire serve $*"
    blkwire serve "$@" >"$log" 2>&1 &
    served=$!
    i=0
    until grep -q listening "$log"; do
        i=$((i + 1))
        [ $i -le 100 ] || fail "blkwire serve $* in the guest did not start: $(cat "$log")"
        sleep 0.1
    done
}

# wait_until FAILURE CMD...: runs CMD every 0.1 s until it succeeds, 10 s at most; fails the
# scenario with FAILURE if it never does.
wait_until() {
    _failure=$1
    shift
    _i=0
    until "$@"; do
        _i=$((_i + 1))
        [ $_i -le 100 ] || fail "$_failure"
        sleep 0.1
    done
}

# wait_for_file FILE WHAT: waits (10 s at most) until FILE exists, the mark a background process
# leaves once it has done WHAT; fails the scenario saying WHAT did not happen.
wait_for_file() {
    wait_until "$2 did not happen" [ -e "$1" ]
}

# write_test_files MNT GREETING: files of assorted sizes (8 MiB down to 1 byte, and one with a
# hole) under MNT, /hello.txt holding GREETING; their sha256 go to /tmp/sums and, as LAB-SHA256
# lines, to the host, which checks them on the disk it copies out.
write_test_files() {
    m=$1
    step "write files"
    echo "$2" >"$m/hello.txt"
    mkdir -p "$m/data/small"
    dd if=/dev/urandom of="$m/data/random-8M.bin" bs=1M count=8 2>/dev/null
    dd if=/dev/urandom of="$m/data/random-1M.bin" bs=64k count=16 2>/dev/null
    i=0
    while [ $i -lt 32 ]; do
        # small files of assorted sizes (1 byte to 12 KiB)
        head -c $((i * 397 + 1)) /dev/urandom >"$m/data/small/f$i"
        i=$((i + 1))
    done
    # a file with a hole, written at the end of a sparse range
    dd if=/dev/urandom of="$m/data/sparse.bin" bs=4k count=1 seek=4096 2>/dev/null
    run sync

    step "checksums"
    (cd "$m" && find . -type f | sort | xargs sha256sum) >/tmp/sums
    [ -s /tmp/sums ] || fail "no files were written"
    while read -r sum path; do
        emit SHA256 "$sum ${path#.}"
    done </tmp/sums
    info "$(wc -l </tmp/sums) files, $(du -sk "$m" | cut -f1) KiB used"
}

# verify_after_reread DEV MNT: drop this machine's caches, mount DEV read-only and check every
# file against /tmp/sums, so the data really comes back from the target.
verify_after_reread() {
    run blockdev --flushbufs "$1"
    echo 3 >/proc/sys/vm/drop_caches
    run mount -t ext4 -o ro "$1" "$2"
    step "verify checksums after re-reading from the target"
    (cd "$2" && sha256sum -c /tmp/sums >/tmp/check 2>&1) || {
        grep -v ': OK$' /tmp/check | head -n 10
        fail "checksums differ after re-reading from the target"
    }
    run umount "$2"
}

# ---- NVMe over TCP (nvme-cli in the guest; scenarios nvme-tcp and nvme-tcp-bench) ----------------
#
#   nvme_host_ids       writes /etc/nvme/hostnqn and hostid (nvme-cli reads them when a command
#                       names no --hostnqn/--hostid): a fresh uuid NQN for this boot
#   nvme_ns NQN         prints the namespace block device (/dev/nvmeXnY: the multipath head, or the
#                       controller's own without CMIC) of the connected subsystem NQN; waits
#                       (bounded, 10 s) for it to appear; fails the scenario if it does not
#   nvme_ctrl NQN       prints the controller device (/dev/nvmeX) of a connected subsystem NQN
#   nvme_gone DEV       waits (bounded) until DEV's block device has disappeared, else fails
#   nvme_none           fails unless no NVMe namespace exists at all
#   nvme_dmesg [N]      the kernel's last N (default 8) nvme lines, for failure messages
#   nvmet_*             the kernel's own target (nvmet, configfs) inside the guest, see below

nvme_host_ids() {
    mkdir -p /etc/nvme
    _id=$(cat /proc/sys/kernel/random/uuid)
    echo "nqn.2014-08.org.nvmexpress:uuid:$_id" >/etc/nvme/hostnqn
    echo "$_id" >/etc/nvme/hostid
}

nvme_ns() {
    _i=0
    while :; do
        # A multipath head (the controller claims multi-controller support, CMIC) sits in the
        # subsystem's directory; without one the namespace hangs off its controller.
        for _s in /sys/class/nvme-subsystem/nvme-subsys* /sys/class/nvme/nvme*; do
            [ -f "$_s/subsysnqn" ] || continue
            [ "$(cat "$_s/subsysnqn")" = "$1" ] || continue
            for _n in "$_s"/nvme*n*; do
                [ -e "$_n" ] && [ -b "/dev/${_n##*/}" ] && echo "/dev/${_n##*/}" && return 0
            done
        done
        _i=$((_i + 1))
        [ $_i -le 100 ] || fail "no namespace of $1 appeared within 10 s: $(nvme_dmesg 4)"
        sleep 0.1
    done
}

nvme_ctrl() {
    for _c in /sys/class/nvme/nvme*; do
        [ -f "$_c/subsysnqn" ] && [ "$(cat "$_c/subsysnqn")" = "$1" ] && echo "/dev/${_c##*/}" && return 0
    done
    fail "no controller of $1"
}

nvme_gone() {
    wait_until "$1 still exists 10 s after nvme disconnect" [ ! -e "/sys/block/${1#/dev/}" ]
}

nvme_none() {
    _left=$(cd /sys/block && echo nvme*)
    [ "$_left" = "nvme*" ] || fail "NVMe namespaces exist where none should: $_left"
    _left=$(cd /sys/class/nvme 2>/dev/null && echo nvme*)
    [ "$_left" = "nvme*" ] || [ -z "$_left" ] || fail "NVMe controllers exist where none should: $_left"
}

nvme_dmesg() {
    dmesg | grep -i nvme | tail -n "${1:-8}" | sed 's/^\[ *[0-9.]*\] //' | tr '\n' '|'
}

# The kernel's NVMe/TCP target, configured through configfs (modules nvmet, nvmet-tcp):
#   nvmet_port ID ADDR SVCID            a TCP port on ADDR:SVCID
#   nvmet_subsys NQN FILE PORTID ANY    subsystem NQN with namespace 1 on FILE (nvmet's file backend,
#                                       buffered_io=1 since FILE is on tmpfs), unique UUID and NGUID,
#                                       reachable on port PORTID; ANY=1 admits any host, 0 only the
#                                       hosts nvmet_allow names
#   nvmet_host HOSTNQN KEY [CTRLKEY]    DH-HMAC-CHAP secrets for HOSTNQN (hmac(sha256), ffdhe2048)
#   nvmet_allow NQN HOSTNQN             admits HOSTNQN to subsystem NQN
nvmet=/sys/kernel/config/nvmet
nvmet_start() {
    run modprobe nvmet
    run modprobe nvmet-tcp
    grep -q ' /sys/kernel/config ' /proc/mounts || run mount -t configfs configfs /sys/kernel/config
    [ -d $nvmet ] || fail "$nvmet missing after modprobe nvmet"
}

nvmet_port() {
    mkdir $nvmet/ports/"$1"
    echo tcp >$nvmet/ports/"$1"/addr_trtype
    echo ipv4 >$nvmet/ports/"$1"/addr_adrfam
    echo "$2" >$nvmet/ports/"$1"/addr_traddr
    echo "$3" >$nvmet/ports/"$1"/addr_trsvcid
}

nvmet_subsys() {
    d=$nvmet/subsystems/$1
    mkdir "$d"
    echo "$4" >"$d/attr_allow_any_host"
    mkdir "$d/namespaces/1"
    echo "$2" >"$d/namespaces/1/device_path"
    echo 1 >"$d/namespaces/1/buffered_io"
    cat /proc/sys/kernel/random/uuid >"$d/namespaces/1/device_uuid"
    cat /proc/sys/kernel/random/uuid >"$d/namespaces/1/device_nguid"
    echo 1 >"$d/namespaces/1/enable"
    ln -s "$d" "$nvmet/ports/$3/subsystems/$1"
}

nvmet_host() {
    h=$nvmet/hosts/$1
    mkdir "$h"
    echo "hmac(sha256)" >"$h/dhchap_hash"
    echo ffdhe2048 >"$h/dhchap_dhgroup"
    echo "$2" >"$h/dhchap_key"
    [ -z "${3:-}" ] || echo "$3" >"$h/dhchap_ctrl_key"
}

nvmet_allow() {
    ln -s "$nvmet/hosts/$2" "$nvmet/subsystems/$1/allowed_hosts/$2"
}
