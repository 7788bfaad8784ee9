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
