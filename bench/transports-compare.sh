#!/usr/bin/env bash
# blkwire over raw Ethernet, UDP and TCP, side by side in one run, over the same veth pair between
# two network namespaces this script creates (and removes, also on failure):
#   4k randread QD1 and QD32, sequential read of 256k at QD16 (4 MiB in flight: datagram sessions
#   grant at most 256 fragments per I/O, 356 KiB at MTU 1500), 1M sequential reads at QD4 on jumbo
#   links (MTU >= 4200, where 1M fits 256 frames), then 4k randread QD32 with 1 % and 5 % loss
#   injected by nftables netdev rules on both ends (the TCP row shows what TCP's own recovery does).
# Environment: RUNTIME (seconds per run, default 5), MTU (default 9000), JOBS (default 1),
# FILL (1: write the whole export with 1M sequential writes over tcp:// first, so reads return
# data rather than holes, as in nbd-compare; default 0, the export stays empty as in the runs
# recorded before 2026-11-26, except for an ONLY workload that writes, which always fills first:
# the first writes to a fresh mem: export also allocate its pages, and on an empty export that
# cost fell on whichever transport ran first), BYPASS_QDISC (1: eth:// with ?qdisc=bypass on both ends),
# TRANSPORTS (default "eth udp tcp"), ONLY (one workload, e.g. "read 1M 4 1M-seqread" or
# "randread 4k 32 4k-randread": that row alone, no loss runs; for A/B runs of two builds),
# BENCH_ARGS (more options for every `blkwire bench` run, e.g. "--poll-us 200"), UDP_CRC (full,
# the default, or header: udp:// with ?crc=header, data frames' CRCs over their header only,
# PROTOCOL.md §9.7).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
RUNTIME="${RUNTIME:-5}"
MTU="${MTU:-9000}"
JOBS="${JOBS:-1}"
FILL="${FILL:-0}"
BYPASS_QDISC="${BYPASS_QDISC:-0}"
TRANSPORTS="${TRANSPORTS:-eth udp tcp}"
ONLY="${ONLY:-}"
UDP_CRC="${UDP_CRC:-full}"
case "$UDP_CRC" in full) UDP_Q="" ;; header) UDP_Q="?crc=header" ;; *) die "UDP_CRC: '$UDP_CRC' is not full or header" ;; esac
for t in $TRANSPORTS; do
    [[ "$t" == eth || "$t" == udp || "$t" == tcp ]] || die "TRANSPORTS: '$t' is not one of eth, udp, tcp"
done
if [[ -n "$ONLY" ]]; then
    read -r rw bs _ <<<"$ONLY"
    [[ "$rw" != *write* && "$rw" != randrw ]] || FILL=1
    [[ "$bs" != 1M ]] || (( MTU >= 4200 )) || die "ONLY: 1M I/O needs MTU >= 4200 (a datagram I/O is at most 256 frames)"
fi
ETH_OPT=""
[[ "$BYPASS_QDISC" == 1 ]] && ETH_OPT="?qdisc=bypass"
BIN="${BLKWIRE:-target/release/blkwire}"
[[ -x "$BIN" ]] || cargo build --release -p blkwire >&2
need_root "network namespaces"
need_tools ip nft python3

T="bwbench$$t"
I="bwbench$$i"
WORK="$(mktemp -d)"
SERVE_PID=""
cleanup() {
    [[ -n "$SERVE_PID" ]] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
    veth_pair_remove "$T" "$I"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

MAC="$(veth_pair "$T" "$I" 9 "$MTU")"

ip netns exec "$T" "$BIN" serve --listen tcp://10.99.9.1:7700 --listen udp://10.99.9.1:7701 --listen "eth://vt$ETH_OPT" \
    --export m=mem:1G --log-level warn >"$WORK/serve.out" 2>"$WORK/serve.err" &
SERVE_PID=$!
for _ in $(seq 1 200); do
    [[ "$(grep -c '^listening' "$WORK/serve.out" 2>/dev/null)" == 3 ]] && break
    kill -0 "$SERVE_PID" 2>/dev/null || { cat "$WORK/serve.err" >&2; exit 1; }
    sleep 0.05
done
[[ "$(grep -c '^listening' "$WORK/serve.out")" == 3 ]] || { echo "target did not start" >&2; exit 1; }

impair() { # impair LOSS_PERCENT (0 clears)
    for pair in "$T:vt" "$I:vi"; do
        ns="${pair%%:*}"; dev="${pair##*:}"
        ip netns exec "$ns" nft delete table netdev lossy 2>/dev/null || true
        [[ "$1" == 0 ]] && continue
        ip netns exec "$ns" nft add table netdev lossy
        ip netns exec "$ns" nft "add chain netdev lossy in { type filter hook ingress device $dev priority 0 ; }"
        for m in "ether type 0x88b5" "udp dport 7701" "udp sport 7701" "tcp dport 7700" "tcp sport 7700"; do
            ip netns exec "$ns" nft "add rule netdev lossy in $m numgen random mod 100 < $1 drop"
        done
    done
}

declare -A URL=([eth]="eth://vi/$MAC/m$ETH_OPT" [udp]="udp://10.99.9.1:7701/m$UDP_Q" [tcp]="tcp://10.99.9.1:7700/m")
# CPU per I/O (initiator and target together, user + system, which includes the kernel's network
# work done in their context) is the figure to compare when the host is noisy: stolen or idle
# time changes IOPS, not the CPU each I/O costs.
run() { # run TRANSPORT RW BS QD LABEL
    python3 - "$1" "$5" "$4" "$SERVE_PID" ip netns exec "$I" "$BIN" bench "${URL[$1]}" --rw "$2" --bs "$3" \
        --iodepth "$4" --jobs "$JOBS" --runtime "$RUNTIME" --timeout 30 --json ${BENCH_ARGS:-} <<'PY'
import json, os, subprocess, sys
t, label, qd, target = sys.argv[1:5]
def target_cpu():
    f = open(f"/proc/{target}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0 = target_cpu()
p = subprocess.Popen(sys.argv[5:], stdout=subprocess.PIPE)
raw = p.stdout.read()
_, status, ru = os.wait4(p.pid, 0)
if status != 0:
    sys.exit(f"bench over {t} failed")
target_s = target_cpu() - c0
cpu = ru.ru_utime + ru.ru_stime + target_s
d = json.loads(raw)
rx = sum(x["retransmits"] for x in d["queues"])
ops = max(d["ops"], 1)
print(f"| {t} | {label} | {qd} | {d['iops']:.0f} | {d['bandwidth_bytes']/1e6:.0f} | {d['latency_us']['mean']} | {d['latency_us']['p99']} | {1e6 * cpu / ops:.1f} | {1e6 * target_s / ops:.1f} | {rx} |")
with open(os.environ["CHART_TSV"], "a") as f:
    f.write(f"{label} QD{qd}\t{t}\t{d['iops']:.0f}\t{d['latency_us']['mean']}\t{d['latency_us']['p99']}\n")
PY
}

if [[ "$FILL" == 1 ]]; then
    # Sequential writes wrap around the export: enough seconds to pass its end once.
    written="$(ip netns exec "$I" "$BIN" bench "${URL[tcp]}" --rw write --bs 1M --iodepth 8 --runtime 6 --json |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["ops"] << 20)')" || die "filling the export failed"
    (( written >= 1 << 30 )) || die "the fill wrote only $written bytes of the 1 GiB export"
fi

echo "# blkwire transports over one veth pair: MTU $MTU, $JOBS job(s), ${RUNTIME}s per run, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "# $("$BIN" --version), $(nproc) CPUs shared by initiator and target, export mem:1G $([[ "$FILL" == 1 ]] && echo "written first" || echo "never written (reads of holes)")$([[ "$BYPASS_QDISC" == 1 ]] && echo ", eth:// with ?qdisc=bypass")$([[ -n "${BENCH_ARGS:-}" ]] && echo ", bench $BENCH_ARGS")$([[ -n "$UDP_Q" ]] && echo ", udp:// with $UDP_Q")"
echo
chart_begin transports-compare "blkwire transports over one veth pair: MTU $MTU, $JOBS job(s), ${RUNTIME}s per run" \
    iops mean_us p99_us
chart_meta peers tcp
echo "| transport | workload | QD | IOPS | MB/s | mean latency us | p99 us | CPU us per I/O | of it the target's | retransmits |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
WORKLOADS=("randread 4k 1 4k-randread" "randread 4k 32 4k-randread" "read 256k 16 256k-seqread")
# 1M I/O needs frames of at least 4 KiB (a datagram I/O is at most 256 frames): jumbo links only.
(( MTU >= 4200 )) && WORKLOADS+=("read 1M 4 1M-seqread")
LOSSES=(1 5)
[[ -n "$ONLY" ]] && { WORKLOADS=("$ONLY"); LOSSES=(); }
for w in "${WORKLOADS[@]}"; do
    set -- $w
    for t in $TRANSPORTS; do run "$t" "$1" "$2" "$3" "$4"; done
done
for loss in "${LOSSES[@]}"; do
    impair "$loss"
    for t in $TRANSPORTS; do run "$t" randread 4k 32 "4k-randread-loss-$loss%"; done
done
impair 0
chart_end
