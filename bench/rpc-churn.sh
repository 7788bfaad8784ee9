#!/usr/bin/env bash
# Does the management plane disturb running I/O? (issue 14) One `blkwire serve` with a 1G RAM
# export and a control socket serves `blkwire bench` (4k random reads, QD32, tcp:// on
# loopback) in turn:
#   quiet   nothing else happens
#   churn   a loop of control calls runs beside it, as fast as the socket answers: export add,
#           listener add, export ls, session ls, stats, export allow, save-config, listener rm,
#           export rm (nine calls per round)
# ROUNDS rounds, alternating which case goes first; the summary is the median of the rounds.
#
# Environment: RUNTIME seconds per measurement (default 5), ROUNDS (default 3), BLKWIRE
# (default target/release/blkwire; built if missing).
#
# Output: one line per measurement (IOPS, mean/p99/max latency, control calls made), then the
# medians.
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-5}"
ROUNDS="${ROUNDS:-3}"
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "rpc-churn: $*" >&2; exit 1; }
. bench/lib.sh

command -v python3 >/dev/null || die "python3 not found (apt-get install python3)"
[[ -x "$BLKWIRE" ]] || cargo build --release --locked -p blkwire >/dev/null 2>&1 \
    || die "cannot build $BLKWIRE"

DIR="$(mktemp -d /tmp/blkwire-rpc-churn.XXXXXX)"
SRV=""
cleanup() {
    [[ -n "$SRV" ]] && kill "$SRV" 2>/dev/null && wait "$SRV" 2>/dev/null
    rm -rf "$DIR"
}
trap cleanup EXIT

SOCK="$DIR/ctl.sock"
"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --export scratch=mem:1G --rpc-socket "$SOCK" \
    --log-level warn >"$DIR/serve.out" 2>"$DIR/serve.err" &
SRV=$!
for _ in $(seq 200); do
    grep -q '^control ' "$DIR/serve.out" 2>/dev/null && break
    kill -0 "$SRV" 2>/dev/null || die "serve exited: $(cat "$DIR/serve.err")"
    sleep 0.05 # polling serve's stdout for its readiness line
done
grep -q '^control ' "$DIR/serve.out" || die "serve did not start"
URL="$(sed -n 's/^listening //p' "$DIR/serve.out" | head -1)/scratch"

# churn STOPFILE: control calls until STOPFILE exists; prints how many it made.
churn() {
    local n=0 i=0 l
    while [[ ! -e "$1" ]]; do
        i=$((i + 1))
        "$BLKWIRE" export add "x$i" mem:1M --socket "$SOCK" >/dev/null
        l="$("$BLKWIRE" listener add tcp://127.0.0.1:0 --socket "$SOCK" | awk '{print $NF}')"
        "$BLKWIRE" export ls --socket "$SOCK" >/dev/null
        "$BLKWIRE" session ls --socket "$SOCK" >/dev/null 2>&1
        "$BLKWIRE" rpc stats --socket "$SOCK" >/dev/null
        "$BLKWIRE" export allow "x$i" 127.0.0.1/32 --socket "$SOCK" >/dev/null
        "$BLKWIRE" save-config --socket "$SOCK" >/dev/null
        "$BLKWIRE" listener rm "$l" --socket "$SOCK" >/dev/null
        "$BLKWIRE" export rm "x$i" --socket "$SOCK" >/dev/null
        n=$((n + 9))
    done
    echo "$n"
}

# measure CASE ROUND: one bench run, with or without churn; appends a JSON line to results.
measure() {
    local case=$1 round=$2 calls=0 stop="$DIR/stop.$1.$2" cpid=""
    if [[ $case == churn ]]; then
        churn "$stop" >"$DIR/calls" &
        cpid=$!
    fi
    "$BLKWIRE" bench "$URL" --rw randread --bs 4k --iodepth 32 --runtime "$RUNTIME" --json \
        >"$DIR/bench.json" || die "bench failed ($case)"
    if [[ -n "$cpid" ]]; then
        touch "$stop"
        wait "$cpid" || die "control calls failed"
        calls="$(cat "$DIR/calls")"
    fi
    python3 - "$case" "$round" "$calls" "$DIR/bench.json" <<'EOF' | tee -a "$DIR/results"
import json, sys
case, rnd, calls, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
b = json.load(open(path))
l = b["latency_us"]
assert b["errors"] == 0, f"{case}: {b['errors']} I/O errors"
print(json.dumps({"case": case, "round": rnd, "iops": b["iops"], "mean": l["mean"],
                  "p99": l["p99"], "max": l["max"], "calls": calls}))
EOF
}

echo "# blkwire bench 4k randread QD32 tcp:// loopback, ${RUNTIME}s x ${ROUNDS} rounds; $(nproc) CPUs"
chart_begin rpc-churn "blkwire bench 4k randread QD32, tcp:// loopback: quiet vs beside control calls, ${RUNTIME}s per run" \
    iops mean_us p99_us
chart_meta peers quiet
for r in $(seq "$ROUNDS"); do
    if ((r % 2)); then order=(quiet churn); else order=(churn quiet); fi
    for c in "${order[@]}"; do measure "$c" "$r" >/dev/null; done
done
python3 - "$DIR/results" <<'EOF'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
with open(os.environ["CHART_TSV"], "a") as f:
    for r in rows:
        f.write(f"4k randread QD32\t{r['case']}\t{r['iops']:.0f}\t{r['mean']:.1f}\t{r['p99']:.1f}\n")
print(f"{'case':<6} {'round':>5} {'IOPS':>9} {'mean us':>8} {'p99 us':>8} {'max us':>9} {'calls':>6}")
for r in rows:
    print(f"{r['case']:<6} {r['round']:>5} {r['iops']:>9.0f} {r['mean']:>8.1f} {r['p99']:>8.1f} {r['max']:>9.1f} {r['calls']:>6}")
print("median:")
med = {}
for case in ("quiet", "churn"):
    rs = [r for r in rows if r["case"] == case]
    m = {k: statistics.median(r[k] for r in rs) for k in ("iops", "mean", "p99", "max", "calls")}
    med[case] = m
    print(f"{case:<6} {'':>5} {m['iops']:>9.0f} {m['mean']:>8.1f} {m['p99']:>8.1f} {m['max']:>9.1f} {m['calls']:>6.0f}")
print(f"churn/quiet IOPS: {med['churn']['iops'] / med['quiet']['iops']:.2f}")
EOF
chart_end
