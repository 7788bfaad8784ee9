#!/usr/bin/env bash
# blkwire in front of Ceph RBD against librbd itself, on one cluster in one run
# (scripts/ceph-cluster.sh: one monitor, one bluestore OSD on a sparse file, pool size 1,
# 127.0.0.1). One image, three ways to drive it with the same parameters:
#   (a) fio-rbd:       fio's rbd engine straight to librbd: the ceiling, no blkwire at all;
#   (b) blkwire-native: `blkwire bench` over blkwire's native protocol to `serve` with an
#                      rbd:rbd/IMAGE export;
#   (c) blkwire-nbd:   fio's nbd engine to the same `serve` through its NBD frontend.
# The target of issue 18: blkwire native >= 90% of the direct librbd IOPS.
#
# Workloads (one job each): 4k randread and randwrite at QD32, 1M sequential read and write at
# QD8. The image is filled with data first (1M sequential writes through librbd), so reads
# fetch real objects. Within each workload the three run back to back in an order that rotates
# from one workload to the next, so slow drift of the machine hits all alike.
#
# Environment:
#   RUNTIME   seconds per measurement (default 8)
#   ROUNDS    rounds of every measurement; the table shows the median (default 3)
#   RAMP      seconds of warm-up per fio measurement, not counted (default 1)
#   SIZE      image size (default 1G)
#   BLKWIRE   path of the blkwire binary (default target/release/blkwire; built if missing)
#   POLL_US   serve's and bench's --poll-us (default 0: on a small machine the OSD needs every
#             cycle that a spinning target or client would take from it; 50 is their default)
#
# Output: a markdown table (IOPS, MiB/s, mean and p99 latency; blkwire's server CPU and the
# client's, in % of one core: librbd's own work is in the server for blkwire and in the client
# for fio-rbd; the OSD's CPU, and how much of the whole machine stayed idle), the ratios against
# fio-rbd, and a chart (bench/lib.sh).
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-8}"
ROUNDS="${ROUNDS:-3}"
RAMP="${RAMP:-1}"
SIZE="${SIZE:-1G}"
POLL_US="${POLL_US:-0}"
IMAGE=bench
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "rbd-compare: $*" >&2; exit 1; }

for t in fio rbd ceph-mon ceph-osd python3; do
    command -v "$t" >/dev/null || die "$t not found in PATH (scripts/deps.sh installs it)"
done
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer (got '$RUNTIME')"
[[ "$ROUNDS" =~ ^[0-9]+$ && "$ROUNDS" -gt 0 ]] || die "ROUNDS must be a positive integer (got '$ROUNDS')"
[[ "$RAMP" =~ ^[0-9]+$ ]] || die "RAMP must be a non-negative integer (got '$RAMP')"
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*rbd' || die "this fio has no rbd engine"
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*nbd' || die "this fio has no nbd engine"
if [[ ! -x "$BLKWIRE" ]]; then
    echo "rbd-compare: $BLKWIRE missing, building it" >&2
    cargo build --release -p blkwire >&2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rbd-compare.XXXXXX")"
CLUSTER="$WORK/ceph"
SRV=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$SRV" ]]; then
        kill "$SRV" 2>/dev/null || true
        wait "$SRV" 2>/dev/null || true
    fi
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.err; do
            [[ -s "$f" ]] && { echo "--- $(basename "$f") (tail) ---" >&2; tail -n 20 "$f" >&2; }
        done
    fi
    scripts/ceph-cluster.sh stop "$CLUSTER" || true
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh

echo "starting the cluster ..." >&2
CONF="$(scripts/ceph-cluster.sh start "$CLUSTER")" || die "the cluster did not start"
export CEPH_CONF="$CONF"
OSD="$(cat "$CLUSTER"/run/osd.*.pid 2>/dev/null | head -n1)" || true
[[ -n "$OSD" ]] || die "no OSD pid file under $CLUSTER/run"
rbd create --size "$SIZE" "rbd/$IMAGE"
echo "filling rbd/$IMAGE ($SIZE) through librbd ..." >&2
fio --name=fill --ioengine=rbd --clientname=admin --pool=rbd --rbdname="$IMAGE" --rw=write \
    --bs=1M --iodepth=8 --size="$SIZE" --output-format=terse --output="$WORK/fill.out" \
    >"$WORK/fill.stdout" 2>"$WORK/fill.err" || die "filling the image failed"

"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --listen nbd://127.0.0.1:0 --rpc-socket none \
    --poll-us "$POLL_US" --log-level warn --export "r=rbd:rbd/$IMAGE?conf=$CONF" >"$WORK/serve.out" 2>"$WORK/serve.err" &
SRV=$!
# serve prints one 'listening URL' line per listener once it accepts connections.
for _ in $(seq 400); do
    [[ $(grep -c '^listening ' "$WORK/serve.out" 2>/dev/null) -ge 2 ]] && break
    kill -0 "$SRV" 2>/dev/null || die "blkwire serve exited: $(cat "$WORK/serve.err")"
    sleep 0.05
done
NATIVE="$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$WORK/serve.out")/r"
NBD="$(sed -n 's/^listening \(nbd:.*\)/\1/p' "$WORK/serve.out")/r"
[[ "$NATIVE" == tcp://* && "$NBD" == nbd://* ]] || die "serve printed no listeners: $(cat "$WORK/serve.out")"

# fio_parse OUT DIR: "iops mib_s mean_us p99_us" from fio's JSON.
fio_parse() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
job = d["jobs"][0]
if job.get("error"):
    sys.exit(f"fio job error {job['error']}")
r = job[sys.argv[2]]
lat = r["lat_ns"]
print(f'{r["iops"]:.0f} {r["bw_bytes"]/2**20:.0f} {lat["mean"]/1000:.1f} {lat["percentile"]["99.000000"]/1000:.1f}')
EOF
}

# run SYSTEM RW BS QD: one line "iops mib_s mean_us p99_us srv_cpu_pct cli_cpu_pct osd_cpu_pct
# idle_pct" (the client's CPU includes librbd's for fio-rbd, which has no server; idle is the
# whole machine's, in percent of all its CPUs: near 0, every hop's CPU is taken from the OSD).
run() {
    local o0 i0 t0 line o1 i1 t1
    o0="$(cpu_ticks "$OSD")"; i0="$(idle_ticks)"; t0="$(now_ms)"
    line="$(run_one "$@")"
    o1="$(cpu_ticks "$OSD")"; i1="$(idle_ticks)"; t1="$(now_ms)"
    echo "$line $(python3 -c "
wall = ($t1 - $t0) / 1000
print(f'{($o1 - $o0) / $CLK_TCK / wall * 100:.0f} {($i1 - $i0) / $CLK_TCK / wall / $(nproc) * 100:.0f}')")"
}

run_one() {
    local sys="$1" rw="$2" bs="$3" qd="$4" out dir cpu
    out="$WORK/$sys-$rw-$bs-$qd"
    dir=read; [[ "$rw" == *write* ]] && dir=write
    local common=(--rw="$rw" --bs="$bs" --iodepth="$qd" --time_based --runtime="$RUNTIME"
        --ramp_time="$RAMP" --norandommap --lat_percentiles=1 --output-format=json --output="$out.json")
    case "$sys" in
    fio-rbd)
        cpu="$(run_timed "$out.stdout" "$SRV" fio --name=x --ioengine=rbd --clientname=admin --pool=rbd \
            --rbdname="$IMAGE" "${common[@]}")" || die "fio rbd $rw failed: $(tail -n 5 "$out.stdout.err")"
        echo "$(fio_parse "$out.json" "$dir") n/a ${cpu##* }"
        ;;
    blkwire-nbd)
        cpu="$(run_timed "$out.stdout" "$SRV" fio --name=x --ioengine=nbd --uri="$NBD" "${common[@]}")" \
            || die "fio nbd $rw failed: $(tail -n 5 "$out.stdout.err")"
        echo "$(fio_parse "$out.json" "$dir") $cpu"
        ;;
    blkwire-native)
        cpu="$(run_timed "$out.json" "$SRV" "$BLKWIRE" bench "$NATIVE" --rw "$rw" --bs "$bs" \
            --iodepth "$qd" --runtime "$RUNTIME" --poll-us "$POLL_US" --json)" || die "blkwire bench $rw failed: $(tail -n 5 "$out.json.err")"
        python3 - "$out.json" "$cpu" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
if d["errors"]:
    sys.exit(f"blkwire bench: {d['errors']} errors")
l = d["latency_us"]
print(f'{d["iops"]:.0f} {d["bandwidth_bytes"]/2**20:.0f} {l["mean"]:.1f} {l["p99"]:.1f} {sys.argv[2]}')
EOF
        ;;
    esac
}

SYSTEMS=(fio-rbd blkwire-native blkwire-nbd)
N=${#SYSTEMS[@]}
CASES=("randread 4k 32" "randwrite 4k 32" "read 1M 8" "write 1M 8")
RESULTS="$WORK/results"
: >"$RESULTS"
i=0
for (( round = 1; round <= ROUNDS; round++ )); do
    for c in "${CASES[@]}"; do
        set -- $c
        for (( k = 0; k < N; k++ )); do
            sys="${SYSTEMS[$(( (k + i) % N ))]}"
            echo "round $round/$ROUNDS: $1 bs=$2 QD$3 on $sys ..." >&2
            row="$(run "$sys" "$1" "$2" "$3")" || die "$sys $1 bs=$2 QD$3 failed"
            echo "$sys $1 $2 $3 $row" >>"$RESULTS"
        done
        i=$(( i + 1 ))
    done
done

echo "# Ceph RBD: $(ceph-osd --version | cut -d' ' -f1-3), one mon + one bluestore OSD on a sparse file, pool size 1, 127.0.0.1, $(nproc) CPUs"
echo "# image rbd/$IMAGE $SIZE, filled first; ${RUNTIME}s per run (+${RAMP}s fio ramp), one job each, $ROUNDS rounds, median of each column"
echo "# fio-rbd:        fio $(fio --version | sed 's/^fio-//') --ioengine=rbd (librbd directly)"
echo "# blkwire-native: $BLKWIRE bench $NATIVE --poll-us $POLL_US (serve --poll-us $POLL_US --export r=rbd:rbd/$IMAGE?conf=...)"
echo "# blkwire-nbd:    fio --ioengine=nbd --uri=$NBD (the same serve)"
echo
chart_begin rbd-compare "Ceph RBD: librbd directly (fio rbd) vs blkwire native and NBD, one job, ${RUNTIME}s per run, 127.0.0.1" \
    iops mean_us p99_us
chart_meta peers fio-rbd
python3 - "$RESULTS" "$CHART_TSV" "${SYSTEMS[@]}" <<'EOF'
import statistics, sys
results, tsv, systems = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
cases = []
for line in open(results):
    f = line.split()
    key = (f[1], f[2], f[3])
    if key not in cases:
        cases.append(key)
    rows.setdefault((f[0],) + key, []).append(f[4:])
def med(sys_, case, col):
    vals = [float(r[col]) for r in rows[(sys_,) + case] if r[col] != "n/a"]
    return statistics.median(vals) if vals else None
def show(v, digits=0):
    return "n/a" if v is None else f"{v:.{digits}f}"
print("| rw | bs | QD | system | IOPS | MiB/s | mean latency us | p99 us | blkwire server CPU % | client CPU % | OSD CPU % | machine idle % |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
with open(tsv, "a") as out:
    for case in cases:
        for s in systems:
            m = [med(s, case, c) for c in range(8)]
            print(f"| {case[0]} | {case[1]} | {case[2]} | {s} | {show(m[0])} | {show(m[1])} | "
                  f"{show(m[2], 1)} | {show(m[3], 1)} | {show(m[4])} | {show(m[5])} | {show(m[6])} | {show(m[7])} |")
            out.write(f"{case[1]} {case[0]} QD{case[2]}\t{s}\t{show(m[0])}\t{show(m[2], 1)}\t{show(m[3], 1)}\n")
print()
worst = None
for case in cases:
    base = med("fio-rbd", case, 0)
    nat, nbd = med("blkwire-native", case, 0), med("blkwire-nbd", case, 0)
    print(f"{case[0]} {case[1]} QD{case[2]}: blkwire-native/fio-rbd {nat / base:.2f}x, "
          f"blkwire-nbd/fio-rbd {nbd / base:.2f}x")
    if case[1] == "4k":
        worst = nat / base if worst is None else min(worst, nat / base)
print(f"target blkwire native >= 0.90x librbd IOPS (4k QD32, worse of read and write): "
      f"{'met' if worst >= 0.9 else 'NOT met'} ({worst:.2f}x)")
EOF
chart_end
