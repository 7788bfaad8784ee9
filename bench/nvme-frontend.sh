#!/usr/bin/env bash
# What the NVMe/TCP frontend costs against blkwire's own protocol (issue 16): one `blkwire
# serve` with a tcp:// and an nvme-tcp:// listener and one RAM export; the same client program,
# `blkwire bench`, drives it over tcp:// (native frames) and over nvme-tcp:// (its NVMe/TCP
# initiator: capsules, in-capsule writes up to 8 KiB, R2T for larger ones, C2HData), in turn,
# on the same workloads. Both ends are blkwire's, so what differs is the protocol's framing and
# the frontend's work.
#
# Workloads: 4k random read and write at QD1 and QD32, 1 MiB sequential read and write at QD8.
# ROUNDS rounds, the two transports alternating first per round; the summary is the median.
#
# Environment: RUNTIME seconds per measurement (default 4), ROUNDS (default 3), BLKWIRE
# (default target/release/blkwire; built if missing).
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-4}"
ROUNDS="${ROUNDS:-3}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "nvme-frontend: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 not found (scripts/deps.sh installs it)"
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer"
[[ "$ROUNDS" =~ ^[0-9]+$ && "$ROUNDS" -gt 0 ]] || die "ROUNDS must be a positive integer"
[[ -x "$BLKWIRE" ]] || cargo build --release -p blkwire >&2

WORK="$(mktemp -d "${TMPDIR:-/tmp}/nvme-frontend.XXXXXX")"
SRV=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$SRV" ]]; then
        kill "$SRV" 2>/dev/null || true
        wait "$SRV" 2>/dev/null || true
    fi
    [[ $rc -ne 0 && -s "$WORK/serve.err" ]] && tail -n 20 "$WORK/serve.err" >&2
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh

"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --listen nvme-tcp://127.0.0.1:0 --export d=mem:1G \
    --rpc-socket none --log-level warn >"$WORK/serve.out" 2>"$WORK/serve.err" &
SRV=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(grep -c '^listening ' "$WORK/serve.out" 2>/dev/null || true) < 2 )); do
    kill -0 "$SRV" 2>/dev/null || die "blkwire serve exited before listening"
    (( $(now_ms) < deadline )) || die "blkwire serve did not listen within ${READY_TIMEOUT}s"
    sleep 0.05
done
TCP="$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$WORK/serve.out")/d"
NVME="$(sed -n 's/^listening \(nvme-tcp:.*\)/\1/p' "$WORK/serve.out")/d"
echo "filling the export ..." >&2
"$BLKWIRE" bench "$TCP" --rw write --bs 1M --iodepth 8 --runtime 2 >/dev/null

WORKLOADS=("randread 4k 1" "randwrite 4k 1" "randread 4k 32" "randwrite 4k 32" "read 1M 8" "write 1M 8")
chart_begin nvme-frontend "blkwire bench over tcp:// and nvme-tcp://, one target, ${RUNTIME}s runs" \
    iops mean_us p99_us
chart_meta peers "tcp://"
printf '%-22s %-9s %10s %10s %10s\n' workload transport IOPS mean_us p99_us
for w in "${WORKLOADS[@]}"; do
    read -r rw bs qd <<<"$w"
    for ((r = 0; r < ROUNDS; r++)); do
        order=(tcp nvme)
        (( r % 2 == 1 )) && order=(nvme tcp)
        for t in "${order[@]}"; do
            url="$TCP"
            [[ "$t" == nvme ]] && url="$NVME"
            "$BLKWIRE" bench "$url" --rw "$rw" --bs "$bs" --iodepth "$qd" --runtime "$RUNTIME" \
                --json >"$WORK/$t-$r.json" 2>"$WORK/$t-$r.err" || die "bench $t $w failed: $(cat "$WORK/$t-$r.err")"
        done
    done
    for t in tcp nvme; do
        python3 - "$WORK" "$t" "$ROUNDS" <<'EOF' >"$WORK/line"
import json, statistics, sys
work, t, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = [json.load(open(f"{work}/{t}-{r}.json")) for r in range(rounds)]
med = lambda xs: statistics.median(xs)
print(f'{med([d["iops"] for d in runs]):.0f} {med([d["latency_us"]["mean"] for d in runs]):.1f} '
      f'{med([d["latency_us"]["p99"] for d in runs]):.0f}')
EOF
        read -r iops mean p99 <"$WORK/line"
        name="tcp://"
        [[ "$t" == nvme ]] && name="nvme-tcp://"
        printf '%-22s %-9s %10s %10s %10s\n' "$rw $bs QD$qd" "$name" "$iops" "$mean" "$p99"
        chart_row "$rw $bs QD$qd" "$name" "$iops" "$mean" "$p99"
    done
done
chart_end
