#!/usr/bin/env bash
# What authentication costs on the datagram transports (PROTOCOL.md §12): 4k randread QD32 over
# one veth pair between two network namespaces this script creates (and removes, also on
# failure), against a target without keys (plain CRC32C frames) and the same target with keys
# (every frame sealed with AES-256-GCM: authenticated, and with --encrypt also encrypted).
# Rounds alternate the two targets so host noise hits every row alike.
# Environment: RUNTIME (seconds per run, default 5), ROUNDS (default 3), MTU (default 9000),
# JOBS (default 1), QD (default 32), TRANSPORTS (datagram transports to measure, default
# "eth udp"; tcp:// always runs, plain and with its authenticated handshake).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
RUNTIME="${RUNTIME:-5}"
ROUNDS="${ROUNDS:-3}"
MTU="${MTU:-9000}"
JOBS="${JOBS:-1}"
QD="${QD:-32}"
TRANSPORTS="${TRANSPORTS:-eth udp}"
BIN="${BLKWIRE:-target/release/blkwire}"
[[ -x "$BIN" ]] || cargo build --release -p blkwire >&2
need_root "network namespaces"
need_tools ip python3

T="bwauth$$t"
I="bwauth$$i"
WORK="$(mktemp -d)"
SERVE_PID=""
stop_target() {
    [[ -n "$SERVE_PID" ]] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
    SERVE_PID=""
}
cleanup() {
    stop_target
    veth_pair_remove "$T" "$I"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

MAC="$(veth_pair "$T" "$I" 8 "$MTU")"
"$BIN" key gen "$WORK/bench.key" --host-id bench >/dev/null

start_target() { # start_target [serve args...]
    ip netns exec "$T" "$BIN" serve --listen tcp://10.99.8.1:7700 --listen udp://10.99.8.1:7701 \
        --listen eth://vt --export m=mem:1G --log-level error "$@" >"$WORK/serve.out" 2>"$WORK/serve.err" &
    SERVE_PID=$!
    for _ in $(seq 1 200); do
        [[ "$(grep -c '^listening' "$WORK/serve.out" 2>/dev/null)" == 3 ]] && return
        kill -0 "$SERVE_PID" 2>/dev/null || { cat "$WORK/serve.err" >&2; exit 1; }
        sleep 0.05
    done
    echo "target did not start" >&2; exit 1
}

declare -A URL=([eth]="eth://vi/$MAC/m" [udp]="udp://10.99.8.1:7701/m" [tcp]="tcp://10.99.8.1:7700/m")
# CPU per I/O counts initiator and target together (user + system): the figure that host noise
# does not move.
run() { # run TRANSPORT MODE [bench args...]
    local t="$1" mode="$2"; shift 2
    python3 - "$t" "$mode" "$SERVE_PID" ip netns exec "$I" "$BIN" bench "${URL[$t]}" --rw randread --bs 4k \
        --iodepth "$QD" --jobs "$JOBS" --runtime "$RUNTIME" --timeout 30 --json "$@" <<'PY'
import json, os, subprocess, sys
t, mode, target = sys.argv[1:4]
def target_cpu():
    f = open(f"/proc/{target}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0 = target_cpu()
p = subprocess.Popen(sys.argv[4:], stdout=subprocess.PIPE)
raw = p.stdout.read()
_, status, ru = os.wait4(p.pid, 0)
if status != 0:
    sys.exit(f"bench over {t} ({mode}) failed")
cpu = ru.ru_utime + ru.ru_stime + target_cpu() - c0
d = json.loads(raw)
rx = sum(x["retransmits"] for x in d["queues"])
bad = sum(x.get("bad_seals", 0) for x in d["queues"])
us = 1e6 * cpu / max(d["ops"], 1)
print(f"| {t} | {mode} | {d['iops']:.0f} | {d['latency_us']['mean']} | {d['latency_us']['p99']} | {us:.2f} | {rx} | {bad} |")
with open(os.environ["CHART_TSV"], "a") as f:
    f.write(f"{t}\t{mode}\t{d['iops']:.0f}\t{d['latency_us']['mean']}\t{d['latency_us']['p99']}\n")
PY
}

echo "# blkwire authentication cost: 4k randread QD$QD, MTU $MTU, $JOBS job(s), ${RUNTIME}s per run, $ROUNDS rounds, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "# $("$BIN" --version), $(nproc) CPUs shared by initiator and target"
echo
chart_begin auth-compare "blkwire authentication cost: 4k randread QD$QD, MTU $MTU, $JOBS job(s), ${RUNTIME}s per run" \
    iops mean_us p99_us
chart_meta peers plain
echo "| transport | frames | IOPS | mean latency us | p99 us | CPU us per I/O | retransmits | bad seals |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
KEY=(--host-id bench --key "$WORK/bench.key")
for r in $(seq 1 "$ROUNDS"); do
    start_target
    for t in $TRANSPORTS tcp; do run "$t" plain; done
    stop_target
    start_target --keys "$WORK/bench.key"
    for t in $TRANSPORTS; do run "$t" sealed "${KEY[@]}"; done
    for t in $TRANSPORTS; do run "$t" encrypted "${KEY[@]}" --encrypt; done
    run tcp authenticated "${KEY[@]}"
    stop_target
done
chart_end
