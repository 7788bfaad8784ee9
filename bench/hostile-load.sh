#!/usr/bin/env bash
# Hostile load against one target with a memory budget (issue 13): while every kind of hostile
# peer of crates/cli/examples/hostile_load.rs runs (clients that never read, slow readers, NBD
# WRITEs announcing 32 MiB without all their payload, NBD READs of 32 MiB never read, UDP READ
# floods, a UDP HELLO flood, 2000 trickling connections), a legitimate client copies a file to
# the target and back with `blkwire cp` and compares sha256 sums, over and over. The target runs
# with few descriptors (ulimit -n) so the floods also run it out of them.
#
# Prints the target's RSS before the load, its peak during it (sampled every 100 ms) and after
# (once the hostile peers are gone and idle connections have given back their buffers), what
# each hostile group achieved, and whether every copy verified and a new session is served
# afterwards. A copy refused during the floods (no handshake place, NO_MEMORY) is retried at
# once and counted. Exits non-zero if a copy read back different data, no copy finished during
# the load, the peak passed the budget, or the target is not serving afterwards.
#
# Environment:
#   BUDGET    --max-memory of the target (default 256M)
#   SECONDS_  how long the hostile load runs (default 30)
#   NOFILE    the target's descriptor limit (default 512)
#   COPY_MIB  size of the file copied back and forth (default 64)
set -euo pipefail
shopt -s inherit_errexit

BUDGET="${BUDGET:-256M}"
DURATION="${SECONDS_:-30}"
NOFILE="${NOFILE:-512}"
COPY_MIB="${COPY_MIB:-64}"
cd "$(dirname "$0")/.."

die() { echo "hostile-load: $*" >&2; exit 1; }
for t in sha256sum python3; do command -v "$t" >/dev/null || die "$t not found in PATH"; done
[[ "$DURATION" =~ ^[1-9][0-9]*$ ]] || die "SECONDS_ must be a positive integer"
. bench/lib.sh

cargo build --release --locked -p blkwire --bin blkwire --example hostile_load >&2
BIN=target/release/blkwire
HOSTILE=target/release/examples/hostile_load

WORK="$(mktemp -d "${TMPDIR:-/tmp}/hostile-load.XXXXXX")"
SRV_PID=""
SAMPLER_PID=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [[ -n "$SAMPLER_PID" ]] && kill "$SAMPLER_PID" 2>/dev/null
    if [[ -n "$SRV_PID" ]]; then
        kill "$SRV_PID" 2>/dev/null || true
        wait "$SRV_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }
budget_kib() {
    python3 -c "
import sys
s = sys.argv[1].upper()
m = {'K': 1, 'M': 1 << 10, 'G': 1 << 20}
print(int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s) >> 10)" "$1"
}

truncate -s 1G "$WORK/disk.img"
UDP_PORT="$(python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
(
    ulimit -n "$NOFILE"
    exec "$BIN" serve --listen tcp://127.0.0.1:0 --listen nbd://127.0.0.1:0 \
        --listen "udp://127.0.0.1:$UDP_PORT" --export "f=file:$WORK/disk.img" \
        --max-memory "$BUDGET" --log-level warn
) >"$WORK/srv.out" 2>"$WORK/srv.err" &
SRV_PID=$!
deadline=$(( $(now_ms) + 10000 ))
while (( $(grep -c '^listening ' "$WORK/srv.out" 2>/dev/null || true) < 3 )); do
    kill -0 "$SRV_PID" 2>/dev/null || die "serve exited: $(tail -n 3 "$WORK/srv.err")"
    (( $(now_ms) < deadline )) || die "serve did not report its listeners in 10 s"
    sleep 0.05
done
TCP="$(sed -n 's|^listening tcp://||p' "$WORK/srv.out")"
NBD="$(sed -n 's|^listening nbd://||p' "$WORK/srv.out")"

head -c "$(( COPY_MIB << 20 ))" /dev/urandom >"$WORK/src"
WANT="$(sha256sum <"$WORK/src" | cut -d' ' -f1)"
# One copy before the load, so the target's buffers are what a working target has.
"$BIN" cp --no-progress "$WORK/src" "tcp://$TCP/f" >/dev/null
BEFORE="$(rss_kib "$SRV_PID")"

# Peak RSS, sampled every 100 ms until killed.
(
    peak=0
    while kill -0 "$SRV_PID" 2>/dev/null; do
        r="$(rss_kib "$SRV_PID")"
        (( r > peak )) && { peak=$r; echo "$peak" >"$WORK/peak"; }
        sleep 0.1
    done
) &
SAMPLER_PID=$!

echo "hostile load for ${DURATION}s against a target with --max-memory $BUDGET, ulimit -n $NOFILE"
"$HOSTILE" "$TCP" "$NBD" "127.0.0.1:$UDP_PORT" f "$DURATION" >"$WORK/hostile.out" &
HOSTILE_PID=$!
copies=0; bad=0; failed=0
while kill -0 "$HOSTILE_PID" 2>/dev/null; do
    # One queue each way: each connection has to win a handshake place during the floods.
    if "$BIN" cp --jobs 1 --no-progress "$WORK/src" "tcp://$TCP/f" >/dev/null 2>>"$WORK/cp.err" &&
        "$BIN" cp --jobs 1 --no-progress "tcp://$TCP/f" "$WORK/back" >/dev/null 2>>"$WORK/cp.err"; then
        got="$(head -c "$(( COPY_MIB << 20 ))" "$WORK/back" | sha256sum | cut -d' ' -f1)"
        if [[ "$got" == "$WANT" ]]; then copies=$(( copies + 1 )); else bad=$(( bad + 1 )); fi
    else
        failed=$(( failed + 1 ))
    fi
done
wait "$HOSTILE_PID" || die "the hostile load failed"
kill -0 "$SRV_PID" 2>/dev/null || die "the target died: $(tail -n 5 "$WORK/srv.err")"
PEAK="$(cat "$WORK/peak" 2>/dev/null || echo "$BEFORE")"

# After: idle connections give back their buffers within a couple of seconds.
sleep 3
AFTER="$(rss_kib "$SRV_PID")"
served=no
"$BIN" cp --no-progress "tcp://$TCP/f" "$WORK/back" >/dev/null 2>>"$WORK/cp.err" &&
    [[ "$(head -c "$(( COPY_MIB << 20 ))" "$WORK/back" | sha256sum | cut -d' ' -f1)" == "$WANT" ]] &&
    served=yes
USED="$("$BIN" stats "tcp://$TCP" --json 2>/dev/null | python3 -c 'import json,sys; m = json.load(sys.stdin).get("memory", {}); print(m.get("used", "?"))' 2>/dev/null || echo "?")"

echo "hostile peers:"
cat "$WORK/hostile.out"
echo "legitimate copies of $COPY_MIB MiB there and back during the load: $copies verified, $bad differed, $failed refused (retried at once)"
[[ -s "$WORK/cp.err" ]] && { echo "  why refused:"; sed -E 's/127.0.0.1:[0-9]+/ADDR/' "$WORK/cp.err" | sort | uniq -c | sort -rn | head -4; }
echo "target warnings (first of each kind):"
sed -E 's/^[^ ]+ //; s/[0-9]+/N/g' "$WORK/srv.err" | sort | uniq -c | sort -rn | head -8
BUDGET_KIB="$(budget_kib "$BUDGET")"
printf 'target RSS: before %d MiB, peak %d MiB, after %d MiB (budget %d MiB; budget in use after: %s bytes)\n' \
    $(( BEFORE >> 10 )) $(( PEAK >> 10 )) $(( AFTER >> 10 )) $(( BUDGET_KIB >> 10 )) "$USED"
echo "new session served afterwards: $served"
chart_begin hostile-load "target RSS under ${DURATION}s of hostile load, legitimate copies of $COPY_MIB MiB alongside" rss_mib
for m in before:"$BEFORE" peak:"$PEAK" after:"$AFTER"; do
    chart_row "budget $BUDGET, ulimit -n $NOFILE" "${m%%:*}" "$(( ${m#*:} >> 10 ))"
done
chart_end
(( bad == 0 )) || die "a legitimate copy read back different data"
(( copies > 0 )) || die "no legitimate copy finished during the load"
(( PEAK < BEFORE + BUDGET_KIB )) || die "peak RSS passed the budget"
[[ "$served" == yes ]] || die "the target did not serve a new session afterwards"
