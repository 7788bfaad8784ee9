#!/usr/bin/env bash
# Server-side copy (PROTOCOL.md §13) against copies through the initiator: one SIZE export of a
# target copied to another export of the same target, from an initiator in another network
# namespace over a veth pair (created here, removed also on failure), with the link at full speed
# and limited to RATE by a tbf qdisc on both ends (the seed's 1 GbE case). Side by side, same run:
#   offload     blkwire cp tcp://T/src tcp://T/dst       (the target copies: COPY)
#   no-offload  blkwire cp --no-offload ...               (every byte read to the host and back)
#   nbdcopy     nbdcopy --flush nbd://T/src nbd://T/dst  (libnbd's copier, the stock NBD tool)
# Each row: median seconds and MiB/s over ROUNDS, and the bytes that crossed the link (both
# directions, from the initiator's veth counters) as a share of SIZE. Every copy is checked
# against the source with cmp. Both exports are files in IMAGES (default /dev/shm: memory, so
# neither the disk nor writeback decides, and every copier's final flush is free). The
# destination is either `fresh` (emptied before each copy: its memory is allocated as the copy
# writes it) or `reused` (overwritten with zeros before each copy: its pages exist, as on a
# block device or an image written before). Last rows: `dd` between the same two files on the
# target's host, the ceiling of any copy there.
# Environment: SIZE (default 1G), ROUNDS (default 3), RATE (default 1gbit), MTU (default 1500),
# IMAGES (default /dev/shm).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
SIZE="${SIZE:-1G}"
ROUNDS="${ROUNDS:-3}"
RATE="${RATE:-1gbit}"
MTU="${MTU:-1500}"
IMAGES="${IMAGES:-/dev/shm}"
BIN="${BLKWIRE:-target/release/blkwire}"
[[ -x "$BIN" ]] || cargo build --release -p blkwire >&2
need_root "network namespaces, tc"
need_tools ip tc nbdcopy python3 cmp dd

T="bwcopy$$t"
I="bwcopy$$i"
WORK="$(mktemp -d "$IMAGES/blkwire-copy-compare.XXXXXX")"
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
(( BYTES % (1 << 20) == 0 )) || die "SIZE must be a whole number of MiB"
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
limit() { # limit RATE|off: a tbf qdisc on both ends' egress, or none
    local ns dev
    for pair in "$T vt" "$I vi"; do
        read -r ns dev <<<"$pair"
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        [[ "$1" == off ]] || ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$1" burst 256kb latency 100ms
    done
}
empty_destination() { # empty_destination fresh|reused
    # The target keeps its descriptor: the same file, emptied or overwritten.
    if [[ "$1" == fresh ]]; then
        truncate -s 0 "$WORK/dst.img"; truncate -s "$BYTES" "$WORK/dst.img"
    else
        dd if=/dev/zero of="$WORK/dst.img" bs=1M count=$(( BYTES >> 20 )) conv=notrunc status=none
    fi
}
copy() { # copy MODE DEST: prints "milliseconds bytes-on-link"
    local mode="$1" b0 t0 t1 b1
    empty_destination "$2"
    b0="$(link_bytes)"; t0="$(now_ms)"
    case "$mode" in
        offload) ip netns exec "$I" "$BIN" cp --no-progress tcp://10.99.9.1:7700/src tcp://10.99.9.1:7700/dst >"$WORK/out" 2>&1 ;;
        no-offload) ip netns exec "$I" "$BIN" cp --no-progress --no-offload tcp://10.99.9.1:7700/src tcp://10.99.9.1:7700/dst >"$WORK/out" 2>&1 ;;
        nbdcopy) ip netns exec "$I" nbdcopy --flush nbd://10.99.9.1:10809/src nbd://10.99.9.1:10809/dst >"$WORK/out" 2>&1 ;;
    esac || { cat "$WORK/out" >&2; die "$mode failed"; }
    t1="$(now_ms)"; b1="$(link_bytes)"
    cmp -s "$WORK/src.img" "$WORK/dst.img" || die "$mode: the destination differs from the source"
    echo "$(( t1 - t0 )) $(( b1 - b0 ))"
}
row() { # row LINK DEST MODE "MS..." "WIRE..."
    python3 - "$BYTES" "$@" <<'PY'
import os, statistics, sys
size, link, dest, mode, ms, wire = int(sys.argv[1]), *sys.argv[2:5], sys.argv[5].split(), sys.argv[6].split()
s = statistics.median(int(x) for x in ms) / 1000
w = statistics.median(int(x) for x in wire)
print(f"{'full' if link == 'off' else link:<8} {dest:<7} {mode:<11} {s:9.2f} {size / s / 2**20:9.1f} {w:14d} {100 * w / size:9.2f}%")
with open(os.environ["CHART_TSV"], "a") as f:
    where = {"off": "full link", "host": "on the host"}.get(link, f"{link} link")
    f.write(f"{where}, {dest}\t{mode}\t{size / s / 2**20:.1f}\t{100 * w / size:.2f}\n")
PY
}

echo "# copy-compare: $SIZE from one export to another of the same target over tcp:// (nbd:// for nbdcopy), veth MTU $MTU, images in $IMAGES, $ROUNDS rounds, median"
chart_begin copy-compare "copying $SIZE between two exports of one target: offloaded COPY vs through the initiator (veth MTU $MTU; limited link $RATE)" \
    mib_s link_pct
chart_meta peers "nbdcopy dd"
printf '%-8s %-7s %-11s %9s %9s %14s %10s\n' link dest mode seconds MiB/s link-bytes %-of-size
for rate in off "$RATE"; do
    limit "$rate"
    for dest in fresh reused; do
        declare -A MS=() WIRE=()
        for _ in $(seq 1 "$ROUNDS"); do
            for mode in offload no-offload nbdcopy; do
                read -r ms wire < <(copy "$mode" "$dest")
                MS[$mode]+="$ms "; WIRE[$mode]+="$wire "
            done
        done
        for mode in offload no-offload nbdcopy; do
            row "$rate" "$dest" "$mode" "${MS[$mode]}" "${WIRE[$mode]}"
        done
        unset MS WIRE
    done
done
# The host's own ceiling: dd between the same two files.
for dest in fresh reused; do
    MSS=""
    for _ in $(seq 1 "$ROUNDS"); do
        empty_destination "$dest"
        t0="$(now_ms)"
        dd if="$WORK/src.img" of="$WORK/dst.img" bs=1M conv=notrunc,fsync status=none
        MSS+="$(( $(now_ms) - t0 )) "
    done
    row host "$dest" dd "$MSS" "0"
done
chart_end
