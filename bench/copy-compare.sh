#!/usr/bin/env bash
# Server-side copy (PROTOCOL.md §13) against copies through the initiator: one SIZE export of a
# target copied to another export of the same target, from an initiator in another network
# namespace over a veth pair (created here, removed also on failure), with the link at full speed
# and limited to RATE by a tbf qdisc on both ends (the seed's 1 GbE case). Side by side, same run:
#   offload     blkwire cp tcp://T/src tcp://T/dst       (the target copies: COPY)
#   no-offload  blkwire cp --no-offload ...               (every byte read to the host and back)
#   nbdcopy     nbdcopy nbd://T/src nbd://T/dst          (libnbd's copier, the stock NBD tool)
# Each row: median seconds and MiB/s over ROUNDS, and the bytes that crossed the link (both
# directions, from the initiator's veth counters) as a share of SIZE. Every copy is checked
# against the source with cmp. Both exports are files (page cache) so the disk does not decide.
# Environment: SIZE (default 1G), ROUNDS (default 3), RATE (default 1gbit), MTU (default 1500).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
SIZE="${SIZE:-1G}"
ROUNDS="${ROUNDS:-3}"
RATE="${RATE:-1gbit}"
MTU="${MTU:-1500}"
BIN="${BLKWIRE:-target/release/blkwire}"
[[ -x "$BIN" ]] || cargo build --release -p blkwire >&2
[[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, tc)"
for t in ip tc nbdcopy python3 cmp; do command -v "$t" >/dev/null || die "$t missing (scripts/deps.sh installs it)"; done

T="bwcopy$$t"
I="bwcopy$$i"
WORK="$(mktemp -d)"
SERVE_PID=""
cleanup() {
    [[ -n "$SERVE_PID" ]] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
    veth_pair_remove "$T" "$I"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

veth_pair "$T" "$I" 9 "$MTU" >/dev/null
BYTES="$(python3 -c "
s='$SIZE'.upper(); u={'K':1<<10,'M':1<<20,'G':1<<30}
print(int(s[:-1])*u[s[-1]] if s[-1] in u else int(s))")"
# The source: incompressible data, 64 MiB of it repeated; the destination: sparse.
head -c 64M /dev/urandom >"$WORK/chunk"
for _ in $(seq 1 $(( (BYTES + (64 << 20) - 1) / (64 << 20) ))); do cat "$WORK/chunk"; done \
    | head -c "$BYTES" >"$WORK/src.img"
rm "$WORK/chunk"
truncate -s "$BYTES" "$WORK/dst.img"

ip netns exec "$T" "$BIN" serve --listen tcp://10.99.9.1:7700 --listen nbd://10.99.9.1:10809 \
    --export "src=file:$WORK/src.img" --export "dst=file:$WORK/dst.img" --log-level error \
    >"$WORK/serve.out" 2>"$WORK/serve.err" &
SERVE_PID=$!
for _ in $(seq 1 200); do
    [[ "$(grep -c '^listening' "$WORK/serve.out" 2>/dev/null)" == 2 ]] && break
    kill -0 "$SERVE_PID" 2>/dev/null || { cat "$WORK/serve.err" >&2; exit 1; }
    sleep 0.05
done
[[ "$(grep -c '^listening' "$WORK/serve.out")" == 2 ]] || die "target did not start"

link_bytes() {
    ip netns exec "$I" cat /sys/class/net/vi/statistics/rx_bytes /sys/class/net/vi/statistics/tx_bytes \
        | python3 -c "import sys; print(sum(int(l) for l in sys.stdin))"
}
limit() { # limit RATE|off
    for pair in "$T vt" "$I vi"; do
        set -- $pair
        ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
        [[ "$RATE_NOW" == off ]] || ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE_NOW" burst 256kb latency 100ms
    done
}
copy() { # copy MODE: prints "seconds bytes-on-link"
    local mode="$1" b0 t0 t1 b1
    # A fresh, empty destination each time (the target keeps its descriptor: same file).
    truncate -s 0 "$WORK/dst.img"; truncate -s "$BYTES" "$WORK/dst.img"
    sync; echo 1 >/proc/sys/vm/drop_caches 2>/dev/null || true
    cat "$WORK/src.img" >/dev/null   # the source in the page cache for every mode alike
    b0="$(link_bytes)"; t0="$(now_ms)"
    case "$mode" in
        offload) ip netns exec "$I" "$BIN" cp --no-progress tcp://10.99.9.1:7700/src tcp://10.99.9.1:7700/dst >"$WORK/out" 2>&1 ;;
        no-offload) ip netns exec "$I" "$BIN" cp --no-progress --no-offload tcp://10.99.9.1:7700/src tcp://10.99.9.1:7700/dst >"$WORK/out" 2>&1 ;;
        nbdcopy) ip netns exec "$I" nbdcopy nbd://10.99.9.1:10809/src nbd://10.99.9.1:10809/dst >"$WORK/out" 2>&1 ;;
    esac || { cat "$WORK/out" >&2; die "$mode failed"; }
    t1="$(now_ms)"; b1="$(link_bytes)"
    cmp -s "$WORK/src.img" "$WORK/dst.img" || die "$mode: the destination differs from the source"
    echo "$(( t1 - t0 )) $(( b1 - b0 ))"
}

echo "# copy-compare: $SIZE from one export to another of the same target over tcp:// (nbd:// for nbdcopy), veth MTU $MTU, $ROUNDS rounds, median"
printf '%-10s %-12s %10s %10s %14s %10s\n' link mode seconds MiB/s link-bytes %-of-size
for RATE_NOW in off "$RATE"; do
    limit
    declare -A MS=() WIRE=()
    for _ in $(seq 1 "$ROUNDS"); do
        for mode in offload no-offload nbdcopy; do
            read -r ms wire < <(copy "$mode")
            MS[$mode]+="$ms "; WIRE[$mode]+="$wire "
        done
    done
    for mode in offload no-offload nbdcopy; do
        python3 - "$RATE_NOW" "$mode" "$BYTES" "${MS[$mode]}" "${WIRE[$mode]}" <<'EOF'
import statistics, sys
link, mode, size, ms, wire = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(), sys.argv[5].split()
s = statistics.median(int(x) for x in ms) / 1000
w = statistics.median(int(x) for x in wire)
print(f"{'full' if link == 'off' else link:<10} {mode:<12} {s:10.2f} {size / s / 2**20:10.1f} {w:14d} {100 * w / size:9.2f}%")
EOF
    done
    unset MS WIRE
done
