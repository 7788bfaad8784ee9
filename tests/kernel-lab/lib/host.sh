# shellcheck disable=SC2034  # globals for run.sh and the scenarios
# shellcheck shell=bash
# Host-side helpers for scenarios (sourced by run.sh; scenarios/*/host.sh call them).
#
#   start_blkwire ARGS...   blkwire serve ARGS in the background; waits (bounded) until it prints one
#                           "listening URL" line per --listen. Sets BLKWIRE_PID and BLKWIRE_URLS.
#                           Its stderr goes to $LOGDIR/$BLKWIRE_LOG (default blkwire.log).
#   listen_port SCHEME      the port of the first listener with that scheme (tcp, nbd, nvme-tcp, iscsi)
#   stop_blkwire            SIGTERM, bounded wait; fails unless blkwire exits 0
#   guest_values KEY        the values of the guest's "LAB-KEY: VALUE" lines, one per line
#   boot_guest              boots the lab VM for $SCENARIO with $GUEST_ARGS (and $QEMU_NET if the
#                           scenario set it); sets GUEST_RESULT (PASS or FAIL reason) and GUEST_SECONDS
#   in_netns CMD...         CMD, inside the network namespace $NETNS if the scenario set one
#
# A scenario that sets NETNS (a network namespace it created, e.g. with a tap device for qemu) gets
# blkwire serve and qemu started inside it; its own host-side commands that need the namespace's
# network (e.g. `blkwire cp tcp://127.0.0.1:PORT/...`) go through in_netns.

BLKWIRE_PID=""
BLKWIRE_URLS=()
QEMU_PID=""
NETNS=""
BLKWIRE_LOG=blkwire.log

# The command prefix that enters $NETNS (none without one). `ip netns exec` execs the command in
# place, so a pid taken from `$!` is the command's own.
netns_prefix() {
    NETNS_PREFIX=()
    if [ -n "$NETNS" ]; then NETNS_PREFIX=(ip netns exec "$NETNS"); fi
}

in_netns() {
    local NETNS_PREFIX
    netns_prefix
    "${NETNS_PREFIX[@]}" "$@"
}

start_blkwire() {
    local want=0 a out=$WORK/${BLKWIRE_LOG%.log}.stdout
    for a in "$@"; do [ "$a" = --listen ] && want=$((want + 1)); done
    : >"$out"
    local NETNS_PREFIX
    netns_prefix
    "${NETNS_PREFIX[@]}" "$BLKWIRE" serve "$@" >"$out" 2>"$LOGDIR/$BLKWIRE_LOG" 9>&- &
    BLKWIRE_PID=$!
    local deadline=$((SECONDS + 20))
    while [ "$(grep -c '^listening ' "$out" || true)" -lt "$want" ]; do
        kill -0 "$BLKWIRE_PID" 2>/dev/null || {
            wait "$BLKWIRE_PID" || true
            BLKWIRE_PID=""
            sed 's/^/    blkwire| /' "$LOGDIR/$BLKWIRE_LOG" >&2
            die "blkwire serve exited before it was ready"
        }
        [ $SECONDS -lt $deadline ] || die "blkwire serve printed no 'listening' line within 20 s"
        sleep 0.05
    done
    mapfile -t BLKWIRE_URLS < <(sed -n 's/^listening //p' "$out")
    log "blkwire serve (pid $BLKWIRE_PID${NETNS:+, netns $NETNS}): ${BLKWIRE_URLS[*]}"
}

listen_port() { # SCHEME [N]: the port of blkwire's Nth (default first) SCHEME:// listener
    local u n=${2:-1}
    for u in "${BLKWIRE_URLS[@]}"; do
        case $u in "$1"://*)
            n=$((n - 1))
            [ $n = 0 ] && echo "${u##*:}" && return 0
            ;;
        esac
    done
    die "blkwire has no $1:// listener number ${2:-1}"
}

stop_blkwire() {
    [ -n "$BLKWIRE_PID" ] || return 0
    local pid=$BLKWIRE_PID rc=0 deadline=$((SECONDS + 15))
    kill -TERM "$pid"
    while kill -0 "$pid" 2>/dev/null; do
        [ $SECONDS -lt $deadline ] || {
            kill -KILL "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            BLKWIRE_PID=""
            die "blkwire serve did not exit within 15 s of SIGTERM"
        }
        sleep 0.05
    done
    wait "$pid" || rc=$?
    BLKWIRE_PID=""
    [ $rc -eq 0 ] || {
        tail -n 20 "$LOGDIR/$BLKWIRE_LOG" | sed 's/^/    blkwire| /' >&2
        die "blkwire serve exited with status $rc after SIGTERM (expected 0)"
    }
    log "blkwire serve stopped by SIGTERM, exit status 0"
}

guest_values() {
    # Not anchored: a kernel message or firmware output can share the line.
    tr -d '\r' <"$SERIAL_LOG" | sed -n "s/^.*LAB-$1: //p"
}

boot_guest() {
    local append="console=ttyS0 panic=-1 loglevel=4 lab.scenario=$SCENARIO lab.timeout=$GUEST_TIMEOUT $GUEST_ARGS"
    [ "${LAB_SHELL:-0}" = 1 ] && append+=" lab.shell=1"
    # qemu's user network by default (the guest reaches the host's loopback at 10.0.2.2); a scenario
    # may set the array QEMU_NET instead (e.g. a tap device in a network namespace, with lab.net=none).
    # shellcheck disable=SC2054  # commas belong to qemu's option syntax
    local net=(-netdev user,id=n0 -device virtio-net-pci,netdev=n0,romfile=)
    if declare -p QEMU_NET >/dev/null 2>&1; then net=("${QEMU_NET[@]}"); fi
    net+=(-device virtio-rng-pci)
    local NETNS_PREFIX
    netns_prefix
    local qemu=("${NETNS_PREFIX[@]}" qemu-system-x86_64 -accel tcg -smp 2 -m 1024 -nographic -no-reboot
        -kernel "$VMLINUZ" -initrd "$INITRD" -append "$append" "${net[@]}")
    echo "${qemu[*]}" >"$LOGDIR/qemu.cmdline"
    log "booting $KVER under qemu (TCG)${NETNS:+ in netns $NETNS}, serial log: ${SERIAL_LOG#"$REPO"/}"
    local t0=$SECONDS rc=0
    if [ "${LAB_SHELL:-0}" = 1 ]; then
        # By hand: the console on this terminal (Ctrl-a x quits qemu), no time limit.
        "${qemu[@]}" 2>&1 | tee "$SERIAL_LOG" || rc=$?
    else
        local attempt
        for attempt in 1 2; do
            rc=0
            timeout --kill-after=10 "$BOOT_TIMEOUT" "${qemu[@]}" </dev/null >"$SERIAL_LOG" 2>&1 9>&- &
            QEMU_PID=$!
            wait "$QEMU_PID" || rc=$?
            QEMU_PID=""
            # The guest kernel occasionally panics under TCG while booting, before /init runs
            # (seen once in ~40 boots: int3 in sched_clock_cpu during an initcall). No scenario
            # code ran, so one more boot is an honest retry; a panic after LAB-BOOT is a failure.
            if [ $attempt -eq 1 ] && ! grep -q 'LAB-BOOT:' "$SERIAL_LOG" && grep -q 'Kernel panic' "$SERIAL_LOG"; then
                mv "$SERIAL_LOG" "$SERIAL_LOG.boot-panic"
                log "the guest kernel panicked before /init (log kept in ${SERIAL_LOG#"$REPO"/}.boot-panic); booting once more"
                continue
            fi
            break
        done
    fi
    GUEST_SECONDS=$((SECONDS - t0))
    GUEST_RESULT=$(guest_values RESULT | tail -n1)
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        GUEST_RESULT="FAIL hard timeout: qemu still running after ${BOOT_TIMEOUT}s${GUEST_RESULT:+ (last result: $GUEST_RESULT)}"
    elif [ -z "$GUEST_RESULT" ]; then
        GUEST_RESULT="FAIL the guest printed no LAB-RESULT line (qemu exit status $rc)"
    fi
}

# The guest's log, for a failed run: from the scenario's start (or the whole boot if it never got
# there), capped.
show_guest_log() {
    local clean=$WORK/serial.txt
    # Without CRs and the firmware's terminal escapes (one of them resets the terminal).
    tr -d '\r' <"$SERIAL_LOG" | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1b.//g' >"$clean"
    if grep -q 'LAB-START:' "$clean"; then
        echo "--- guest serial log from the scenario's start (${SERIAL_LOG#"$REPO"/}) ---" >&2
        sed -n '/LAB-START:/,$p' "$clean" | tail -n 120 | sed 's/^/    guest| /' >&2
    else
        echo "--- guest serial log, last 60 lines (${SERIAL_LOG#"$REPO"/}) ---" >&2
        tail -n 60 "$clean" | sed 's/^/    guest| /' >&2
    fi
    local f
    for f in "$LOGDIR"/blkwire*.log; do
        [ -s "$f" ] || continue
        echo "--- blkwire serve log, last 20 lines (${f#"$REPO"/}) ---" >&2
        tail -n 20 "$f" | sed 's/^/    blkwire| /' >&2
    done
}

# verify_guest_disk: copy the export out through blkwire (it must equal the backing file), stop
# blkwire, and check that the copy is a clean ext4 holding every file the guest reported
# (LAB-SHA256 lines) with that checksum (check_guest_files). The copy stays in $WORK/out.img for
# further checks.
verify_guest_disk() {
    local sums=$WORK/guest.sha256
    guest_values SHA256 >"$sums"
    [ -s "$sums" ] || die "the guest reported no file checksums"
    local out=$WORK/out.img
    # (in_netns: scenario eth's target listens on its network namespace's loopback)
    in_netns "$BLKWIRE" cp --no-progress "tcp://127.0.0.1:$TCP_PORT/$EXPORT" "$out" ||
        die "blkwire cp tcp://127.0.0.1:$TCP_PORT/$EXPORT failed"
    cmp -s "$out" "$WORK/disk.img" || die "blkwire cp returned data different from the export's file"
    log "blkwire cp: $(stat -c %s "$out") bytes read back, identical to the backing file"
    stop_blkwire
    check_guest_files "$out"
}

# check_guest_files IMG: IMG (a copy of the guest's disk) is a clean ext4 holding every file the
# guest reported (LAB-SHA256 lines) with that checksum.
check_guest_files() {
    local out=$1 sums=$WORK/guest.sha256
    guest_values SHA256 >"$sums"
    [ -s "$sums" ] || die "the guest reported no file checksums"
    e2fsck -fn "$out" >"$WORK/fsck.log" 2>&1 || {
        sed 's/^/    e2fsck| /' "$WORK/fsck.log" >&2
        die "e2fsck -fn on the copied disk found problems"
    }
    log "e2fsck -fn: clean ($(tail -n1 "$WORK/fsck.log"))"
    local sum path got n=0 bad=0
    while read -r sum path; do
        got=$(debugfs -R "cat $path" "$out" 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [ "$got" != "$sum" ]; then
            echo "    $path: guest wrote $sum, the disk holds $got" >&2
            bad=$((bad + 1))
        fi
        n=$((n + 1))
    done <"$sums"
    [ $bad -eq 0 ] || die "$bad of $n files differ between what the guest wrote and what the target stored"
    log "debugfs: all $n files on ${out##*/} have the sha256 the guest reported"
}
