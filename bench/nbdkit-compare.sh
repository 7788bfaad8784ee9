#!/usr/bin/env bash
# Side-by-side comparison, in one run and with the same parameters, of
#   (a) blkwire serve (mem:1G export) driven by `blkwire bench`, and
#   (b) nbdkit's memory plugin (1G) driven by fio's nbd engine (libnbd),
# both on 127.0.0.1, both fresh (never pre-filled) memory exports.
#
# Workloads: 4k randread at QD1 and QD32, 4k randwrite at QD32, one job each.
# The runs alternate between the two systems so slow drift of the machine hits both alike.
#
# Environment:
#   RUNTIME   seconds per measurement (default 8)
#   BLKWIRE   path of the blkwire binary (default target/release/blkwire; built if missing)
#   READY_TIMEOUT  seconds to wait for a server to come up (default 10)
#
# Output: a markdown table plus the blkwire/nbdkit IOPS ratio at QD32 and both QD1 mean
# latencies. Latency is submit-to-completion for both: blkwire bench's histogram, and fio's
# total latency (lat_ns = slat + clat, with --lat_percentiles=1). Server CPU is the server
# process' user+system time over the run divided by wall time (100% = one core); client CPU
# likewise for the client process (from /usr/bin/time when present).
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-8}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
BS=4k
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "nbdkit-compare: $*" >&2; exit 1; }

for t in nbdkit fio python3; do
    command -v "$t" >/dev/null || die "$t not found in PATH"
done
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer (got '$RUNTIME')"

if [[ ! -x "$BLKWIRE" ]]; then
    echo "nbdkit-compare: $BLKWIRE missing, building it" >&2
    cargo build --release -p blkwire >&2
fi
[[ -x "$BLKWIRE" ]] || die "$BLKWIRE still missing after the build"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/nbdkit-compare.XXXXXX")"
BW_PID=""
NK_PID=""

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in $BW_PID $NK_PID; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in $BW_PID $NK_PID; do
        # bounded wait, then SIGKILL
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.err; do
            [[ -s "$f" ]] && { echo "--- $(basename "$f") (tail) ---" >&2; tail -n 20 "$f" >&2; }
        done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh

# ---------------------------------------------------------------------------- blkwire server
"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --export scratch=mem:1G \
    >"$WORK/blkwire.out" 2>"$WORK/blkwire.err" &
BW_PID=$!
BW_URL=""
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(now_ms) < deadline )); do
    if line="$(grep -m1 '^listening tcp://' "$WORK/blkwire.out" 2>/dev/null)"; then
        BW_URL="${line#listening }"
        break
    fi
    kill -0 "$BW_PID" 2>/dev/null || die "blkwire serve exited before listening"
    sleep 0.05
done
[[ -n "$BW_URL" ]] || die "blkwire serve did not print 'listening' within ${READY_TIMEOUT}s"
BW_TARGET="$BW_URL/scratch"

# ---------------------------------------------------------------------------- nbdkit server
NK_PORT=""
for attempt in 1 2 3 4 5; do
    port="$(free_port)"
    rm -f "$WORK/nbdkit.pid"
    # -f: stay in the foreground (our child, so the trap can kill it); the pidfile is written
    # once nbdkit is listening, which is the readiness signal.
    nbdkit -f -P "$WORK/nbdkit.pid" -i 127.0.0.1 -p "$port" memory 1G \
        >"$WORK/nbdkit.out" 2>"$WORK/nbdkit.err" &
    NK_PID=$!
    deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
    while (( $(now_ms) < deadline )); do
        [[ -s "$WORK/nbdkit.pid" ]] && break
        kill -0 "$NK_PID" 2>/dev/null || break
        sleep 0.05
    done
    if [[ -s "$WORK/nbdkit.pid" ]] && kill -0 "$NK_PID" 2>/dev/null; then
        NK_PORT="$port"
        break
    fi
    # port taken between free_port and bind, or slow start: clean up and retry
    kill "$NK_PID" 2>/dev/null || true
    wait "$NK_PID" 2>/dev/null || true
    NK_PID=""
    echo "nbdkit-compare: nbdkit did not start on port $port (attempt $attempt), retrying" >&2
done
[[ -n "$NK_PORT" ]] || die "could not start nbdkit"
NK_URI="nbd://127.0.0.1:$NK_PORT"

# ---------------------------------------------------------------------------- runners
# Each runner writes one line "iops mean_us p99_us srv_cpu_pct cli_cpu_pct" to stdout.

run_blkwire() { # rw qd
    local rw="$1" qd="$2" out="$WORK/blkwire-$1-$2.json" cpu
    cpu="$(run_timed "$out" "$BW_PID" "$BLKWIRE" bench "$BW_TARGET" --rw "$rw" --bs "$BS" \
        --iodepth "$qd" --jobs 1 --runtime "$RUNTIME" --json)" \
        || die "blkwire bench $rw QD$qd failed: $(tail -n 5 "$out.err" 2>/dev/null)"
    python3 - "$out" <<'EOF' | tr '\n' ' '
import json, sys
d = json.load(open(sys.argv[1]))
if d.get("errors"):
    sys.exit(f"blkwire bench reported {d['errors']} errors")
lat = d["latency_us"]
print(f'{d["iops"]:.0f} {lat["mean"]:.1f} {lat["p99"]:.1f}')
EOF
    echo "$cpu"
}

run_fio() { # rw qd
    local rw="$1" qd="$2" out="$WORK/fio-$1-$2.json" cpu dir
    dir=read; [[ "$rw" == *write* ]] && dir=write
    # --output keeps the JSON clean (the nbd engine prints "connected" on stdout).
    # --norandommap: like blkwire bench, pick offsets independently (no coverage map).
    cpu="$(run_timed "$out.stdout" "$NK_PID" fio --name=x --ioengine=nbd --uri="$NK_URI" \
        --rw="$rw" --bs="$BS" --iodepth="$qd" --numjobs=1 --time_based --runtime="$RUNTIME" \
        --norandommap --lat_percentiles=1 --output-format=json --output="$out")" \
        || die "fio $rw QD$qd failed: $(tail -n 5 "$out.stdout.err" 2>/dev/null)"
    python3 - "$out" "$dir" <<'EOF' | tr '\n' ' '
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
job = d["jobs"][0]
if job.get("error"):
    sys.exit(f"fio job error {job['error']}")
r = job[sys.argv[2]]
lat = r["lat_ns"]
print(f'{r["iops"]:.0f} {lat["mean"]/1000:.1f} {lat["percentile"]["99.000000"]/1000:.1f}')
EOF
    echo "$cpu"
}

# ---------------------------------------------------------------------------- measure
echo "# blkwire vs nbdkit memory: bs=$BS, 1 job, ${RUNTIME}s per run, 127.0.0.1, $(nproc) CPUs"
echo "# blkwire: $("$BLKWIRE" --version 2>/dev/null || echo "$BLKWIRE") serve mem:1G, client blkwire bench ($BW_TARGET)"
echo "# nbdkit:  $(nbdkit --version) memory 1G, client $(fio --version) ioengine=nbd ($NK_URI)"
echo

declare -A R
CASES=("randread 1" "randread 32" "randwrite 32")
for c in "${CASES[@]}"; do
    set -- $c
    echo "running $1 QD$2 ..." >&2
    R[blkwire,$1,$2]="$(run_blkwire "$1" "$2")"
    R[nbdkit,$1,$2]="$(run_fio "$1" "$2")"
done

chart_begin nbdkit-compare "blkwire (blkwire bench) vs nbdkit memory (fio nbd): $BS, 1 job, ${RUNTIME}s per run, 127.0.0.1" \
    iops mean_us p99_us
echo "| system | rw | QD | IOPS | mean latency us | p99 us | server CPU % | client CPU % |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for c in "${CASES[@]}"; do
    set -- $c
    for sys in blkwire nbdkit; do
        read -r iops mean p99 scpu ccpu <<<"${R[$sys,$1,$2]}"
        echo "| $sys | $1 | $2 | $iops | $mean | $p99 | $scpu | $ccpu |"
        chart_row "$1 QD$2" "$sys" "$iops" "$mean" "$p99"
    done
done
echo

python3 - "${R[blkwire,randread,32]}" "${R[nbdkit,randread,32]}" \
    "${R[blkwire,randwrite,32]}" "${R[nbdkit,randwrite,32]}" \
    "${R[blkwire,randread,1]}" "${R[nbdkit,randread,1]}" <<'EOF'
import sys
v = [s.split() for s in sys.argv[1:]]
print(f"randread  QD32 IOPS ratio blkwire/nbdkit: {float(v[0][0]) / float(v[1][0]):.2f}x")
print(f"randwrite QD32 IOPS ratio blkwire/nbdkit: {float(v[2][0]) / float(v[3][0]):.2f}x")
print(f"randread  QD1 mean latency: blkwire {v[4][1]} us, nbdkit {v[5][1]} us")
EOF
chart_end
