#!/usr/bin/env bash
# The kernel's per-frame cost for raw Ethernet over one veth pair: AF_PACKET (what eth:// uses:
# sendmmsg, a TPACKET_V2 receive ring; "packet-txring" sends through a TPACKET_V2 transmit ring
# instead) against AF_XDP in copy mode (an XDP program on each veth end redirecting blkwire's
# EtherType to an XSK socket; native "drv" XDP, and "skb" generic XDP).
# No blkwire in the loop: bench/frame-cost.c, built here with cc, keeps QD request frames of 64
# bytes in flight and the other side answers each with one frame of SIZE bytes; both busy-poll,
# one on each end of the pair, in two network namespaces this script makes (and removes, also on
# failure). Prints replies per second and the whole machine's busy CPU per reply (/proc/stat,
# from once the client's first window is out to its end). Since both ends spin, the CPU column
# is two CPUs over the rate: it ranks the modes, it is not what a frame costs without spinning.
# Environment: RUNTIME (seconds per run, default 3), ROUNDS (default 3), MTU (default 9000),
# SIZES (reply frame sizes up to 9000, default "1024 4200 8300": 8300 is two 4 KiB READ
# replies, as eth:// packs them), QD (default 32), MODES (default
# "packet packet-txring xdp-drv xdp-skb").
# AF_XDP frames larger than a 4 KiB UMEM chunk less its headroom are several chunks
# (multi-buffer AF_XDP, XDP_USE_SG, Linux 6.6); the XDP program declares it takes them, which
# native XDP on veth requires past an MTU of about 3.5 KiB.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "$(basename "$0"): $*" >&2; exit 1; }
. bench/lib.sh
RUNTIME="${RUNTIME:-3}"
ROUNDS="${ROUNDS:-3}"
MTU="${MTU:-9000}"
SIZES="${SIZES:-1024 4200 8300}"
QD="${QD:-32}"
MODES="${MODES:-packet packet-txring xdp-drv xdp-skb}"
need_root "network namespaces, XDP"
need_tools ip cc

T="bwfc$$t"
I="bwfc$$i"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true
    veth_pair_remove "$T" "$I"
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
cc -O2 -Wall -o "$WORK/frame-cost" bench/frame-cost.c
TMAC="$(veth_pair "$T" "$I" 8 "$MTU")"
IMAC="$(ip netns exec "$I" cat /sys/class/net/vi/address)"

echo "# raw Ethernet frame cost over one veth pair (MTU $MTU), QD $QD, ${RUNTIME}s per run, $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "# $(nproc) CPUs; both ends busy-poll; CPU us per reply = the whole machine's busy time / replies"
echo
chart_begin frame-cost "raw Ethernet frames over one veth pair (MTU $MTU): AF_PACKET (sendmmsg, TX ring) vs AF_XDP, QD $QD, ${RUNTIME}s runs" \
    iops cpu_us_per_io
chart_meta peers "packet-txring xdp-drv xdp-skb"
echo "| mode | reply bytes | round | replies/s | CPU us per reply |"
echo "|---|---:|---:|---:|---:|"
for round in $(seq 1 "$ROUNDS"); do
    for size in $SIZES; do
        for mode in $MODES; do
            af="${mode%%-*}"
            xmode="${mode#*-}"
            [[ "$mode" == packet ]] && xmode=""
            ip netns exec "$T" "$WORK/frame-cost" server "$af" vt "$IMAC" "$size" "$QD" 1000 $xmode \
                >"$WORK/server.out" 2>"$WORK/server.err" &
            SERVER_PID=$!
            # Ready once its socket is bound and (for XDP) its program attached: a client started
            # earlier would lose its first window and stall.
            for _ in $(seq 1 250); do
                grep -q '^ready' "$WORK/server.out" && break
                kill -0 "$SERVER_PID" 2>/dev/null || break
                sleep 0.02
            done
            if ! grep -q '^ready' "$WORK/server.out"; then
                echo "| $mode | $size | $round | failed: server not ready: $(tr '\n' ' ' <"$WORK/server.err") | |"
                kill "$SERVER_PID" 2>/dev/null || true
                wait "$SERVER_PID" 2>/dev/null || true
                SERVER_PID=""
                continue
            fi
            if out="$(ip netns exec "$I" timeout $((RUNTIME + 10)) "$WORK/frame-cost" client "$af" vi "$TMAC" "$size" "$QD" "$RUNTIME" $xmode 2>"$WORK/client.err")"; then
                read -r _ replies _ secs _ busy <<<"$(grep '^replies' <<<"$out")"
                row="$(awk -v r="$replies" -v s="$secs" -v b="$busy" -v hz="$(getconf CLK_TCK)" \
                    'BEGIN { printf "%.0f %.2f", r / s, (r ? b / hz * 1e6 / r : 0) }')"
                read -r rate cpu <<<"$row"
                echo "| $mode | $size | $round | $rate | $cpu |"
                chart_row "$size B" "$mode" "$rate" "$cpu"
            else
                echo "| $mode | $size | $round | failed: $(tr '\n' ' ' <"$WORK/client.err") | |"
            fi
            kill "$SERVER_PID" 2>/dev/null || true
            wait "$SERVER_PID" 2>/dev/null || true
            SERVER_PID=""
        done
    done
done
chart_end
