#!/usr/bin/env bash
# What a change to the datagram path costs each end, measured apart: two blkwire builds, A and B,
# over one veth pair between two network namespaces this script creates (and removes, also on
# failure). The target's side: A's and B's `serve` run side by side (each a RAM export written
# first), and the same initiator (B's `bench`) reads or writes each in turns; the initiator's
# side: A's and B's `bench` take turns against the same target (B's). Each measurement gives the
# IOPS and the CPU per I/O of the side being compared (user + system, the kernel's network work
# in its context included), which is the figure to compare on a noisy machine.
#
# Environment: A, B (the two blkwire binaries, required), ROUNDS (default 4), RUNTIME (seconds per
# measurement, default 3), MTU (default 9000), WORKLOADS (default "read write": 1M sequential at
# QD4), URL_Q (query for the udp:// URLs, e.g. "?crc=header"; default none).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
[[ -x "${A:-}" && -x "${B:-}" ]] || die "A and B must be blkwire binaries (A=/tmp/blkwire-old B=target/release/blkwire)"
ROUNDS="${ROUNDS:-4}"
RUNTIME="${RUNTIME:-3}"
MTU="${MTU:-9000}"
WORKLOADS="${WORKLOADS:-read write}"
URL_Q="${URL_Q:-}"
(( MTU >= 4200 )) || die "MTU: 1M I/O needs MTU >= 4200 (a datagram I/O is at most 256 frames)"
need_root "network namespaces"
need_tools ip python3

T="bwsides$$t"
I="bwsides$$i"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done
    veth_pair_remove "$T" "$I"
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
veth_pair "$T" "$I" 9 "$MTU" >/dev/null

declare -A PID PORT=([A]=7701 [B]=7702)
for w in A B; do
    ip netns exec "$T" "${!w}" serve --listen "udp://10.99.9.1:${PORT[$w]}" --listen "tcp://10.99.9.1:$((PORT[$w] + 100))" \
        --export m=mem:1G --rpc-socket none --log-level warn >"$WORK/serve-$w.out" 2>&1 &
    PID[$w]=$!
    PIDS+=("$!")
done
for w in A B; do
    for _ in $(seq 1 200); do
        [[ "$(grep -c '^listening' "$WORK/serve-$w.out" 2>/dev/null)" == 2 ]] && break
        kill -0 "${PID[$w]}" 2>/dev/null || { cat "$WORK/serve-$w.out" >&2; exit 1; }
        sleep 0.05
    done
    [[ "$(grep -c '^listening' "$WORK/serve-$w.out")" == 2 ]] || die "target $w did not start"
    # Written first, so reads return data and writes find their pages allocated: enough
    # seconds of sequential writes to pass the export's end once.
    written="$(ip netns exec "$I" "$B" bench "tcp://10.99.9.1:$((PORT[$w] + 100))/m" --rw write --bs 1M \
        --iodepth 8 --runtime 6 --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["ops"] << 20)')" ||
        die "filling target $w failed"
    (( written >= 1 << 30 )) || die "filling target $w wrote only $written bytes of the 1 GiB export"
done

# measure SIDE BUILD RW: one run; prints IOPS and the CPU us per I/O of SIDE (target|initiator).
measure() {
    local side=$1 build=$2 rw=$3 client=$B port=${PORT[B]} target_pid
    if [[ "$side" == target ]]; then port=${PORT[$build]}; else client=${!build}; fi
    target_pid=${PID[B]}
    [[ "$side" == target ]] && target_pid=${PID[$build]}
    python3 - "$side" "$target_pid" ip netns exec "$I" "$client" bench "udp://10.99.9.1:$port/m$URL_Q" \
        --rw "$rw" --bs 1M --iodepth 4 --runtime "$RUNTIME" --json <<'PY'
import json, os, subprocess, sys
side, target = sys.argv[1], sys.argv[2]
def target_cpu():
    f = open(f"/proc/{target}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0 = target_cpu()
p = subprocess.Popen(sys.argv[3:], stdout=subprocess.PIPE)
raw = p.stdout.read()
_, status, ru = os.wait4(p.pid, 0)
if status != 0:
    sys.exit("bench failed")
d = json.loads(raw)
ops = max(d["ops"], 1)
cpu = target_cpu() - c0 if side == "target" else ru.ru_utime + ru.ru_stime
print(f"{d['iops']:.0f} {1e6 * cpu / ops:.1f}")
PY
}

echo "# datagram path, each end apart: udp:// over one veth pair (MTU $MTU), 1M at QD4, ${RUNTIME}s per run, $ROUNDS rounds, $(nproc) CPUs, $(date -u '+%F %H:%M') UTC"
echo "# A: $A ($("$A" --version)); B: $B ($("$B" --version))${URL_Q:+; URLs with $URL_Q}"
echo "# target side: B's initiator against A's and B's target in turns; initiator side: A's and B's initiator against B's target"
echo
echo "| rw | side | round | A IOPS | B IOPS | A CPU us/IO | B CPU us/IO |"
echo "|---|---|---:|---:|---:|---:|---:|"
for rw in $WORKLOADS; do
    for side in target initiator; do
        for r in $(seq "$ROUNDS"); do
            if (( r % 2 )); then order=(A B); else order=(B A); fi
            declare -A got=()
            for w in "${order[@]}"; do
                got[$w]="$(measure "$side" "$w" "$rw")" || die "measuring $rw on the $side side of $w failed"
            done
            read -r ia ca <<<"${got[A]}"
            read -r ib cb <<<"${got[B]}"
            echo "| $rw | $side | $r | $ia | $ib | $ca | $cb |"
        done
    done
done
