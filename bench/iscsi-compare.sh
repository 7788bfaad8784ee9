#!/usr/bin/env bash
# blkwire's iSCSI frontend against tgt (issue 17), same host, same client: libiscsi's `iscsi-perf`
# (Debian libiscsi-bin; a userspace initiator, one connection, reads only) drives
#   (a) `blkwire serve --listen iscsi://127.0.0.1:PORT`, export d = a file on tmpfs (LUN 0 of
#       iqn.2026-11.io.blkwire:d), and
#   (b) tgtd (Debian tgt) on 127.0.0.1, the same target name, LUN 1 with the rdwr backing store on
#       another file of the same size and content on the same tmpfs (LUN 0 of a tgt target is its
#       controller), with tgt's default 16 I/O threads,
# in turn, on the same workloads: 4k random read at QD32 and 1 MiB sequential read at QD8
# (SEQ_QD).
# ROUNDS rounds, the two targets alternating first per round; the summary is the median. Server
# CPU is the target process' user+system time over the run divided by wall time (100% = one core),
# and per I/O in microseconds; client CPU is iscsi-perf's, from /usr/bin/time.
#
# Environment: RUNTIME seconds per measurement (default 6), ROUNDS (default 3), SIZE of each
# export in MiB (default 1024), SEQ_QD (the 1 MiB reads' queue depth, default 8), BLKWIRE (default target/release/blkwire; built if missing),
# READY_TIMEOUT (default 10).
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-6}"
ROUNDS="${ROUNDS:-3}"
SIZE="${SIZE:-1024}"
SEQ_QD="${SEQ_QD:-8}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
IQN=iqn.2026-11.io.blkwire:d
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "iscsi-compare: $*" >&2; exit 1; }
for t in tgtd tgtadm iscsi-perf python3; do
    command -v "$t" >/dev/null || die "$t not found (scripts/deps.sh installs tgt, libiscsi-bin and python3)"
done
for v in RUNTIME ROUNDS SIZE SEQ_QD; do
    [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -gt 0 ]] || die "$v must be a positive integer (got '${!v}')"
done
[[ -x "$BLKWIRE" ]] || cargo build --release -p blkwire >&2
[[ -d /dev/shm && -w /dev/shm ]] || die "/dev/shm (tmpfs) is not writable: the exports live there"

# The exports on tmpfs; the rest (logs, results) beside them.
WORK="$(mktemp -d /dev/shm/iscsi-compare.XXXXXX)"
BW_PID="" TGT_PID="" TGT_CTL=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$BW_PID" ]]; then
        kill "$BW_PID" 2>/dev/null || true
        wait "$BW_PID" 2>/dev/null || true
    fi
    if [[ -n "$TGT_PID" ]]; then
        # tgtd ignores SIGTERM: it ends on a system delete once its target is gone.
        tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op delete --force --tid 1 >/dev/null 2>&1 || true
        tgtadm -C "$TGT_CTL" --mode system --op delete >/dev/null 2>&1 || true
        for _ in $(seq 50); do kill -0 "$TGT_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$TGT_PID" 2>/dev/null || true
        wait "$TGT_PID" 2>/dev/null || true
    fi
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/serve.err "$WORK"/tgtd.log; do
            [[ -s "$f" ]] && tail -n 20 "$f" | sed "s|^|${f##*/}: |" >&2
        done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh


echo "filling two ${SIZE} MiB files on tmpfs ..." >&2
head -c "$((SIZE << 20))" /dev/urandom >"$WORK/blkwire.img"
cp "$WORK/blkwire.img" "$WORK/tgt.img"

# ---- blkwire --------------------------------------------------------------------------------------
"$BLKWIRE" serve --listen iscsi://127.0.0.1:0 --export "d=file:$WORK/blkwire.img" \
    --rpc-socket none --log-level warn >"$WORK/serve.out" 2>"$WORK/serve.err" &
BW_PID=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
until grep -q '^listening iscsi://' "$WORK/serve.out" 2>/dev/null; do
    kill -0 "$BW_PID" 2>/dev/null || die "blkwire serve exited before listening (an iSCSI frontend?): $(tail -n1 "$WORK/serve.err")"
    (( $(now_ms) < deadline )) || die "blkwire serve did not listen within ${READY_TIMEOUT}s"
    sleep 0.05
done
BW_PORTAL="$(sed -n 's|^listening iscsi://\([^/ ]*\).*|\1|p' "$WORK/serve.out" | head -n1)"
BW_URL="iscsi://$BW_PORTAL/$IQN/0"

# ---- tgt ------------------------------------------------------------------------------------------
TGT_PORT="$(free_port)"
# tgtd's management socket is /var/run/tgtd/socket.N with N <= 32767: derived from the port.
TGT_CTL=$(( TGT_PORT % 32000 + 700 ))
tgtd -f -C "$TGT_CTL" --iscsi "portal=127.0.0.1:$TGT_PORT" >"$WORK/tgtd.log" 2>&1 &
TGT_PID=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
until tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op show >/dev/null 2>&1; do
    kill -0 "$TGT_PID" 2>/dev/null || die "tgtd exited before it was ready"
    (( $(now_ms) < deadline )) || die "tgtd did not answer within ${READY_TIMEOUT}s"
    sleep 0.05
done
tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op new --tid 1 --targetname "$IQN"
tgtadm -C "$TGT_CTL" --lld iscsi --mode logicalunit --op new --tid 1 --lun 1 --bstype rdwr \
    --backing-store "$WORK/tgt.img"
tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op bind --tid 1 --initiator-address ALL
TGT_URL="iscsi://127.0.0.1:$TGT_PORT/$IQN/1"

# Both LUNs' block size (iscsi-perf counts in blocks): "capacity is N blocks or B byte".
block_size() {
    local out
    out="$(timeout 10 iscsi-perf -t 1 -m 1 -b 1 "$1" 2>&1 </dev/null || true)"
    python3 -c '
import re, sys
m = re.search(r"capacity is (\d+) blocks or (\d+) byte", sys.argv[1])
if not m:
    sys.exit(1)
print(int(m.group(2)) // int(m.group(1)))' "$out" || die "iscsi-perf could not read $1's capacity: $(tr '\r' '\n' <<<"$out" | tail -n 2)"
}
declare -A URL PID BS
URL[blkwire]="$BW_URL" URL[tgt]="$TGT_URL"
PID[blkwire]="$BW_PID" PID[tgt]="$TGT_PID"
for s in blkwire tgt; do BS[$s]="$(block_size "${URL[$s]}")"; done

# run SYSTEM RANDOM(0|1) BYTES QD OUT: one iscsi-perf run; prints "IOPS srv_cpu% cli_cpu%".
run() {
    local sys=$1 random=$2 bytes=$3 qd=$4 out=$5 cpu
    local args=(-t "$RUNTIME" -m "$qd" -b "$(( bytes / BS[$sys] ))")
    (( random )) && args+=(-r)
    # Bounded: a target that stops answering fails the run instead of hanging it.
    cpu="$(run_timed "$out" "${PID[$sys]}" timeout -k 5 "$(( RUNTIME + 30 ))" iscsi-perf "${args[@]}" "${URL[$sys]}")" ||
        die "iscsi-perf ${args[*]} ${URL[$sys]} failed or did not finish within $(( RUNTIME + 30 ))s: $(tr '\r' '\n' <"$out" | grep . | tail -n 1) $(tail -n 2 "$out.err")"
    # The last progress line: "iops average N (M MB/s)".
    python3 - "$out" "$cpu" <<'EOF'
import re, sys
text = open(sys.argv[1], errors="replace").read().replace("\r", "\n")
m = re.findall(r"iops average (\d+)", text)
if not m:
    sys.exit("no 'iops average' line in iscsi-perf's output")
print(m[-1], sys.argv[2])
EOF
}

echo "# blkwire $("$BLKWIRE" --version 2>/dev/null | head -n1) iscsi://$BW_PORTAL (file on tmpfs, block ${BS[blkwire]})"
echo "# tgt $(tgtd -V 2>&1 | head -n1) 127.0.0.1:$TGT_PORT (rdwr on tmpfs, block ${BS[tgt]})"
echo "# client: iscsi-perf (libiscsi $(dpkg-query -W -f='${Version}' libiscsi-bin 2>/dev/null || echo '?')), ${RUNTIME}s per run, median of $ROUNDS rounds, $(nproc) CPUs"
echo

WORKLOADS=("randread 4k 32 1 4096" "read 1M $SEQ_QD 0 1048576")
chart_begin iscsi-compare "iSCSI targets, one client (iscsi-perf): blkwire vs tgt, ${RUNTIME}s runs, median of $ROUNDS, 127.0.0.1" \
    iops server_cpu_us_per_io mib_s
chart_meta peers tgt
printf '%-18s %-8s %10s %9s %12s %12s %15s\n' workload target IOPS MiB/s "server CPU%" "client CPU%" "server us/IO"
declare -A MED
for w in "${WORKLOADS[@]}"; do
    read -r rw bs qd random bytes <<<"$w"
    echo "running $rw $bs QD$qd ..." >&2
    for ((r = 0; r < ROUNDS; r++)); do
        order=(blkwire tgt)
        (( r % 2 == 1 )) && order=(tgt blkwire)
        for s in "${order[@]}"; do
            run "$s" "$random" "$bytes" "$qd" "$WORK/perf-$s-$r" >"$WORK/res-$s-$r"
        done
    done
    for s in blkwire tgt; do
        read -r iops mib scpu ccpu us < <(python3 - "$WORK" "$s" "$ROUNDS" "$bytes" <<'EOF'
import statistics, sys
work, s, rounds, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = [open(f"{work}/res-{s}-{r}").read().split() for r in range(rounds)]
med = lambda i: statistics.median(float(x[i]) if x[i] != "n/a" else 0.0 for x in rows)
iops = med(0)
# The target's CPU time per I/O: its share of a core over the run, per I/O per second.
us = statistics.median(float(x[1]) / 100 * 1e6 / float(x[0]) for x in rows if float(x[0]) > 0)
print(f"{iops:.0f} {iops * size / 2**20:.1f} {med(1):.0f} {med(2):.0f} {us:.1f}")
EOF
)
        MED[$s,$rw]=$iops
        printf '%-18s %-8s %10s %9s %12s %12s %15s\n' "$rw $bs QD$qd" "$s" "$iops" "$mib" "$scpu" "$ccpu" "$us"
        chart_row "$rw $bs QD$qd" "$s" "$iops" "$us" "$mib"
    done
done
echo
python3 - "${MED[blkwire,randread]}" "${MED[tgt,randread]}" "${MED[blkwire,read]}" "${MED[tgt,read]}" <<'EOF'
import sys
b4, t4, b1, t1 = (float(x) for x in sys.argv[1:])
print(f"4k randread QD32 IOPS ratio blkwire/tgt: {b4 / t4:.2f}x (target: >= 2x)")
print(f"1M read throughput ratio blkwire/tgt: {b1 / t1:.2f}x")
EOF
chart_end
