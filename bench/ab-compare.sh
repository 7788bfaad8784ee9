#!/usr/bin/env bash
# Before/after comparison of two blkwire builds, A and B, in one sitting: both serve the same
# RAM export on 127.0.0.1 over tcp:// (native), nbd:// (fio's nbd engine) and udp://, and the
# same workloads run against each in turns (A B B A A B ...), so slow drift of the machine hits
# both alike. Use it to show that a change costs nothing (or what it costs).
#
# Environment:
#   A, B      the two blkwire binaries (required), e.g. A=/tmp/blkwire-before B=target/release/blkwire
#   ROUNDS    turns per workload and build (default 3); the table shows the median
#   RUNTIME   seconds per measurement (default 5)
#
# Output: a markdown table with, per workload, each build's median IOPS and CPU per I/O
# (server + client, user + system, in microseconds), and B/A.
set -euo pipefail
shopt -s inherit_errexit

ROUNDS="${ROUNDS:-3}"
RUNTIME="${RUNTIME:-5}"
READY_TIMEOUT=10
cd "$(dirname "$0")/.."

die() { echo "ab-compare: $*" >&2; exit 1; }
[[ -n "${A:-}" && -n "${B:-}" ]] || die "set A and B to the two blkwire binaries"
for bin in "$A" "$B"; do [[ -x "$bin" ]] || die "$bin is not an executable"; done
for t in fio python3; do command -v "$t" >/dev/null || die "$t not found in PATH"; done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
[[ "$RUNTIME" =~ ^[1-9][0-9]*$ ]] || die "RUNTIME must be a positive integer"

. bench/lib.sh

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ab-compare.XXXXXX")"
SRV_PID=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_server
    rm -rf "$WORK"
    exit "$rc"
}
stop_server() {
    [[ -n "$SRV_PID" ]] || return 0
    kill "$SRV_PID" 2>/dev/null || true
    wait "$SRV_PID" 2>/dev/null || true
    SRV_PID=""
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_server BIN: serves mem:1G on tcp, nbd and udp; sets SRV_PID, TCP, NBD, UDP.
start_server() {
    "$1" serve --listen tcp://127.0.0.1:0 --listen nbd://127.0.0.1:0 --listen udp://127.0.0.1:0 \
        --export scratch=mem:1G --log-level warn >"$WORK/srv.out" 2>"$WORK/srv.err" &
    SRV_PID=$!
    local deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
    while (( $(now_ms) < deadline )); do
        (( $(grep -c '^listening ' "$WORK/srv.out" 2>/dev/null || true) >= 3 )) && break
        kill -0 "$SRV_PID" 2>/dev/null || die "$1 serve exited: $(tail -n 3 "$WORK/srv.err")"
        sleep 0.05
    done
    TCP="$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$WORK/srv.out")"
    NBD="$(sed -n 's/^listening \(nbd:.*\)/\1/p' "$WORK/srv.out")"
    UDP="$(sed -n 's/^listening \(udp:.*\)/\1/p' "$WORK/srv.out")"
    [[ -n "$TCP" && -n "$NBD" && -n "$UDP" ]] || die "$1 serve did not listen on all three"
}

# measure BIN WORKLOAD: sets RESULT to "iops cpu_us_per_io". Runs in this shell (not in a
# command substitution), so the exit trap knows the server it started.
measure() {
    local bin="$1" w="$2" out="$WORK/run.json" c0 c1 iops
    start_server "$bin"
    local proto rw qd
    IFS=- read -r proto rw qd <<<"$w"
    qd="${qd#qd}"
    c0="$(cpu_ticks "$SRV_PID")"
    case "$proto" in
    tcp | udp)
        local url; [[ "$proto" == tcp ]] && url="$TCP" || url="$UDP"
        /usr/bin/time -f '%U %S' -o "$out.time" "$bin" bench "$url/scratch" --rw "$rw" --bs 4k \
            --iodepth "$qd" --jobs 1 --runtime "$RUNTIME" --json >"$out" 2>"$out.err" \
            || die "$bin bench $w failed: $(tail -n 3 "$out.err")"
        iops="$(python3 -c "import json;print(json.load(open('$out'))['iops'])")"
        ;;
    nbd)
        /usr/bin/time -f '%U %S' -o "$out.time" fio --name=ab --ioengine=nbd \
            --uri="$NBD/scratch" --rw="$rw" --bs=4k --iodepth="$qd" \
            --numjobs=1 --time_based --runtime="$RUNTIME" --output-format=json --output="$out" \
            >/dev/null 2>"$out.err" \
            || die "fio $w failed: $(tail -n 3 "$out.err")"
        iops="$(python3 -c "
import json; j=json.load(open('$out'))['jobs'][0]
print(j['read']['iops'] + j['write']['iops'])")"
        ;;
    *) die "unknown workload $w" ;;
    esac
    c1="$(cpu_ticks "$SRV_PID")"
    stop_server
    RESULT="$(python3 - "$iops" "$((c1 - c0))" "$CLK_TCK" "$out.time" "$RUNTIME" <<'PY'
import sys
iops, srv_ticks, tck, tfile, runtime = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
u, s = open(tfile).read().split()[-2:]
cpu_s = srv_ticks / tck + float(u) + float(s)
print(f"{iops:.0f} {cpu_s * 1e6 / max(iops * runtime, 1):.2f}")
PY
)"
}

command -v /usr/bin/time >/dev/null || die "/usr/bin/time not found (apt-get install time)"
# WORKLOADS (space-separated PROTO-RW-qdN) narrows the run, e.g. WORKLOADS=tcp-randread-qd32.
read -r -a WORKLOADS <<<"${WORKLOADS:-tcp-randread-qd1 tcp-randread-qd32 tcp-randwrite-qd32 nbd-randread-qd32 udp-randread-qd32}"
declare -A RES
echo "# A: $A ($("$A" --version)), B: $B ($("$B" --version))"
echo "# $ROUNDS rounds x ${RUNTIME}s per workload and build, alternating, $(nproc) CPUs, $(date -u +'%F %H:%M') UTC"
for w in "${WORKLOADS[@]}"; do
    for r in $(seq "$ROUNDS"); do
        if (( r % 2 )); then order=(A B); else order=(B A); fi
        for which in "${order[@]}"; do
            bin="${!which}"
            echo "running $w round $r on $which ..." >&2
            measure "$bin" "$w"
            RES["$w $which"]+="$RESULT;"
        done
    done
done
echo
chart_begin ab-compare "blkwire A/B, medians of $ROUNDS rounds x ${RUNTIME}s: A = $A, B = $B" iops cpu_us_per_io
chart_meta peers A
echo "| workload | A IOPS | B IOPS | B/A | A CPU us/IO | B CPU us/IO |"
echo "|---|---:|---:|---:|---:|---:|"
for w in "${WORKLOADS[@]}"; do
    python3 - "$w" "${RES["$w A"]}" "${RES["$w B"]}" <<'PY'
import os, statistics, sys
w, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
def parse(s): return [tuple(map(float, x.split())) for x in s.strip(';').split(';')]
a, b = parse(a), parse(b)
ai, bi = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
ac, bc = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
print(f"| {w} | {ai:.0f} | {bi:.0f} | {bi/ai:.2f} | {ac:.2f} | {bc:.2f} |")
with open(os.environ["CHART_TSV"], "a") as f:
    f.write(f"{w}\tA\t{ai:.0f}\t{ac:.2f}\n{w}\tB\t{bi:.0f}\t{bc:.2f}\n")
PY
done
chart_end
