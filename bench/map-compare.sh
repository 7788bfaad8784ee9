#!/usr/bin/env bash
# Side-by-side comparison, in one run and with the same parameters, of three ways to turn a RAM
# export on 127.0.0.1 into a local block device, all FUSE file + loop device with direct I/O:
#   (a) `blkwire map --fuse-io uring` (fuse frontend, FUSE over io_uring) on `blkwire serve`,
#   (b) `blkwire map --fuse-io read` (fuse frontend, read/write on /dev/fuse), same server,
#       another export of the same size, and
#   (c) nbdfuse + `losetup --direct-io=on` on nbdkit's memory plugin (SIZE).
# All devices are measured with fio (ioengine=io_uring, direct=1, one job).
#
# Workloads, after a 1M sequential write fill of every device (so reads hit written memory on
# every server; the fill is measured too): 4k randread at QD1 and QD32, 1M sequential read at
# QD8. The runs alternate between the systems so slow drift of the machine hits all alike.
#
# FUSE over io_uring needs the kernel's system-wide switch (/sys/module/fuse/parameters/
# enable_uring); `map --fuse-io uring` turns it on when it is off, and this script puts back the
# value it found when it exits.
#
# Needs root (mount, loop devices), fio, nbdkit, nbdfuse (libnbd-bin), losetup, python3.
#
# Environment:
#   RUNTIME        seconds per measurement (default 10)
#   SIZE           export size (default 1G)
#   BLKWIRE        path of the blkwire binary (default target/release/blkwire; built if missing)
#   READY_TIMEOUT  seconds to wait for a server to come up (default 10)
#
# Output: a markdown table, the IOPS ratios at QD32 (blkwire/nbdfuse: the issue's target is
# >= 2x; io_uring/read) and the QD1 latencies. "server CPU %" is the target process (blkwire serve / nbdkit), "frontend CPU %" the
# FUSE daemon (blkwire map / nbdfuse), "fio CPU %" fio's own usr+sys; 100 % is one core. Kernel
# time in the loop driver's workers is in none of them.
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-10}"
SIZE="${SIZE:-1G}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "map-compare: $*" >&2; exit 1; }
. bench/lib.sh

need_root "FUSE mounts and loop devices"
need_tools fio nbdkit nbdfuse losetup python3
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer (got '$RUNTIME')"

if [[ ! -x "$BLKWIRE" ]]; then
    echo "map-compare: $BLKWIRE missing, building it" >&2
    cargo build --release -p blkwire >&2
fi
[[ -x "$BLKWIRE" ]] || die "$BLKWIRE still missing after the build"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/map-compare.XXXXXX")"
# Our mapping records and FUSE mount live here, apart from any other blkwire mappings.
export BLKWIRE_RUN_DIR="$WORK/run"
BW_PID=""
NK_PID=""
NF_PID=""
BW_DEV_U=""
BW_DEV_R=""
NF_DEV=""
NF_MNT="$WORK/nbdfuse"
URING_SWITCH=/sys/module/fuse/parameters/enable_uring
[[ -e "$URING_SWITCH" ]] || die "this kernel has no FUSE over io_uring ($URING_SWITCH missing)"
SWITCH_WAS="$(cat "$URING_SWITCH")"

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    # Devices first (their daemons must still answer while they let go), then mounts, then
    # servers.
    for dev in $BW_DEV_U $BW_DEV_R; do
        "$BLKWIRE" unmap "$dev" || echo "map-compare: unmap $dev failed" >&2
    done
    [[ -n "$NF_DEV" ]] && { losetup -d "$NF_DEV" || true; }
    if mountpoint -q "$NF_MNT" 2>/dev/null; then
        umount "$NF_MNT" || umount -l "$NF_MNT" || true
    fi
    for pid in $NF_PID $NK_PID $BW_PID; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in $NF_PID $NK_PID $BW_PID; do
        # bounded wait, then SIGKILL
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.err "$WORK"/*.log; do
            [[ -s "$f" ]] && { echo "--- $(basename "$f") (tail) ---" >&2; tail -n 20 "$f" >&2; }
        done
    fi
    rm -rf "$WORK"
    [[ "$(cat "$URING_SWITCH")" == "$SWITCH_WAS" ]] || echo "$SWITCH_WAS" >"$URING_SWITCH" || true
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------- blkwire
"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --export "uring=mem:$SIZE" --export "read=mem:$SIZE" \
    >"$WORK/blkwire.out" 2>"$WORK/blkwire.err" &
BW_PID=$!
BW_URL=""
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(now_ms) < deadline )); do
    if line="$(grep -m1 '^listening tcp://' "$WORK/blkwire.out" 2>/dev/null)"; then
        BW_URL="${line#listening }"
        break
    fi
    kill -0 "$BW_PID" 2>/dev/null || die "blkwire serve exited before listening"
    sleep 0.05
done
[[ -n "$BW_URL" ]] || die "blkwire serve did not print 'listening' within ${READY_TIMEOUT}s"
# `map` returns once the device is usable and prints it.
map_pid() { "$BLKWIRE" ls --json | python3 -c "import json,sys; print(json.load(sys.stdin)['$1']['pid'])"; }
BW_DEV_U="$("$BLKWIRE" map "$BW_URL/uring" --frontend fuse --fuse-io uring --logfile "$WORK/map-uring.log" 2>"$WORK/map-uring.err")" \
    || die "blkwire map --fuse-io uring failed: $(cat "$WORK/map-uring.err")"
BW_MAP_PID_U="$(map_pid "$BW_DEV_U")"
BW_DEV_R="$("$BLKWIRE" map "$BW_URL/read" --frontend fuse --fuse-io read --logfile "$WORK/map-read.log" 2>"$WORK/map-read.err")" \
    || die "blkwire map --fuse-io read failed: $(cat "$WORK/map-read.err")"
BW_MAP_PID_R="$(map_pid "$BW_DEV_R")"

# ---------------------------------------------------------------------------- nbdkit + nbdfuse
NK_PORT=""
for attempt in 1 2 3 4 5; do
    port="$(free_port)"
    rm -f "$WORK/nbdkit.pid"
    # -f: stay in the foreground (our child); the pidfile is written once nbdkit listens.
    nbdkit -f -P "$WORK/nbdkit.pid" -i 127.0.0.1 -p "$port" memory "$SIZE" \
        >"$WORK/nbdkit.out" 2>"$WORK/nbdkit.err" &
    NK_PID=$!
    deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
    while (( $(now_ms) < deadline )); do
        [[ -s "$WORK/nbdkit.pid" ]] && break
        kill -0 "$NK_PID" 2>/dev/null || break
        sleep 0.05
    done
    if [[ -s "$WORK/nbdkit.pid" ]] && kill -0 "$NK_PID" 2>/dev/null; then
        NK_PORT="$port"
        break
    fi
    kill "$NK_PID" 2>/dev/null || true
    wait "$NK_PID" 2>/dev/null || true
    NK_PID=""
    echo "map-compare: nbdkit did not start on port $port (attempt $attempt), retrying" >&2
done
[[ -n "$NK_PORT" ]] || die "could not start nbdkit"

mkdir -p "$NF_MNT"
# nbdfuse stays in the foreground; it writes its pidfile once it serves the file.
nbdfuse -P "$WORK/nbdfuse.pid" "$NF_MNT/nbd" "nbd://127.0.0.1:$NK_PORT" \
    >"$WORK/nbdfuse.out" 2>"$WORK/nbdfuse.err" &
NF_PID=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(now_ms) < deadline )); do
    [[ -s "$WORK/nbdfuse.pid" ]] && break
    kill -0 "$NF_PID" 2>/dev/null || die "nbdfuse exited before serving"
    sleep 0.05
done
[[ -s "$WORK/nbdfuse.pid" ]] || die "nbdfuse did not write its pidfile within ${READY_TIMEOUT}s"
NF_DEV="$(losetup --direct-io=on -f --show "$NF_MNT/nbd")" || die "losetup on the nbdfuse file failed"

for dev in "$BW_DEV_U" "$BW_DEV_R" "$NF_DEV"; do
    [[ "$(cat "/sys/block/${dev#/dev/}/loop/dio")" == 1 ]] || die "$dev does not do direct I/O"
done

# ---------------------------------------------------------------------------- runners
# run_fio NAME DEV SERVER_PID FRONTEND_PID RW BS QD [extra fio args...]: prints
# "iops mean_us p99_us MiB/s server_cpu% frontend_cpu% fio_cpu%".
run_fio() {
    local name="$1" dev="$2" srv="$3" fe="$4" rw="$5" bs="$6" qd="$7"; shift 7
    local out="$WORK/fio-$name-$rw-$bs-$qd.json" dir=read
    [[ "$rw" == *write* ]] && dir=write
    local s0 f0 t0 s1 f1 t1 wall
    s0="$(cpu_ticks "$srv")"; f0="$(cpu_ticks "$fe")"; t0="$(now_ms)"
    fio --name=x --filename="$dev" --ioengine=io_uring --direct=1 --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --numjobs=1 --lat_percentiles=1 --output-format=json --output="$out" \
        "$@" >"$out.stdout" 2>"$out.err" \
        || die "fio $name $rw bs=$bs QD$qd failed: $(tail -n 5 "$out.err")"
    t1="$(now_ms)"; s1="$(cpu_ticks "$srv")"; f1="$(cpu_ticks "$fe")"
    kill -0 "$srv" 2>/dev/null || die "$name server died during $rw QD$qd"
    kill -0 "$fe" 2>/dev/null || die "$name frontend died during $rw QD$qd"
    wall=$(( t1 - t0 ))
    python3 - "$out" "$dir" "$s0" "$s1" "$f0" "$f1" "$wall" "$CLK_TCK" <<'EOF'
import json, sys
out, d, s0, s1, f0, f1, wall, tck = sys.argv[1:]
text = open(out).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
if job.get("error"):
    sys.exit(f"fio job error {job['error']}")
r = job[d]
lat = r["lat_ns"]
pct = lambda a, b: (int(b) - int(a)) / int(tck) * 1000 / int(wall) * 100
fio_cpu = job["usr_cpu"] + job["sys_cpu"]
print(f'{r["iops"]:.0f} {lat["mean"]/1000:.1f} {lat["percentile"]["99.000000"]/1000:.1f} '
      f'{r["bw"]/1024:.0f} {pct(s0, s1):.0f} {pct(f0, f1):.0f} {fio_cpu:.0f}')
EOF
}

SYSTEMS=(blkwire-uring blkwire-read nbdfuse)
run_case() { # system rw bs qd [fio args...]
    local sys="$1"; shift
    case "$sys" in
        blkwire-uring) run_fio "$sys" "$BW_DEV_U" "$BW_PID" "$BW_MAP_PID_U" "$@" ;;
        blkwire-read) run_fio "$sys" "$BW_DEV_R" "$BW_PID" "$BW_MAP_PID_R" "$@" ;;
        nbdfuse) run_fio "$sys" "$NF_DEV" "$NK_PID" "$NF_PID" "$@" ;;
    esac
}

# ---------------------------------------------------------------------------- measure
echo "# mapped block device: blkwire map (fuse + loop; FUSE over io_uring and read/write) vs nbdfuse + loop; fio io_uring direct=1, 1 job, ${RUNTIME}s per run, $SIZE RAM exports on 127.0.0.1, $(nproc) CPUs, kernel $(uname -r)"
echo "# blkwire: $("$BLKWIRE" --version) serve mem:$SIZE x2; map --fuse-io uring $BW_DEV_U, --fuse-io read $BW_DEV_R; ls says: $("$BLKWIRE" ls --json | python3 -c 'import json,sys; print(", ".join(k + " " + v.get("fuse_io", "?") for k, v in json.load(sys.stdin).items()))')"
echo "# nbdfuse: $(nbdfuse --version | head -n1), $(nbdkit --version) memory $SIZE, losetup --direct-io=on $NF_DEV"
echo "# $(fio --version)"
echo

declare -A R
CASES=("write 1M 8 fill" "randread 4k 1" "randread 4k 32" "read 1M 8")
for c in "${CASES[@]}"; do
    set -- $c
    rw="$1" bs="$2" qd="$3" kind="${4:-}"
    for sys in "${SYSTEMS[@]}"; do
        echo "running $sys $rw bs=$bs QD$qd ..." >&2
        if [[ "$kind" == fill ]]; then
            # One full pass over the device: every later read hits written memory.
            R[$sys,$rw,$bs,$qd]="$(run_case "$sys" "$rw" "$bs" "$qd" --size="$SIZE")"
        else
            extra=(--time_based --runtime="$RUNTIME")
            [[ "$rw" == rand* ]] && extra+=(--norandommap)
            R[$sys,$rw,$bs,$qd]="$(run_case "$sys" "$rw" "$bs" "$qd" "${extra[@]}")"
        fi
    done
done

chart_begin map-compare "mapped block device (fuse + loop): blkwire map vs nbdfuse, fio io_uring direct, ${RUNTIME}s per run" \
    iops mean_us p99_us
echo "| system | rw | bs | QD | IOPS | MiB/s | mean latency us | p99 us | server CPU % | frontend CPU % | fio CPU % |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for c in "${CASES[@]}"; do
    set -- $c
    for sys in "${SYSTEMS[@]}"; do
        read -r iops mean p99 mibs scpu fcpu ccpu <<<"${R[$sys,$1,$2,$3]}"
        echo "| $sys | $1${4:+ ($4)} | $2 | $3 | $iops | $mibs | $mean | $p99 | $scpu | $fcpu | $ccpu |"
        chart_row "$2 $1${4:+ ($4)} QD$3" "$sys" "$iops" "$mean" "$p99"
    done
done
echo

python3 - "${R[blkwire-uring,randread,4k,32]}" "${R[blkwire-read,randread,4k,32]}" "${R[nbdfuse,randread,4k,32]}" \
    "${R[blkwire-uring,randread,4k,1]}" "${R[blkwire-read,randread,4k,1]}" "${R[nbdfuse,randread,4k,1]}" \
    "${R[blkwire-uring,read,1M,8]}" "${R[blkwire-read,read,1M,8]}" "${R[nbdfuse,read,1M,8]}" <<'EOF'
import sys
u, r, n, u1, r1, n1, um, rm, nm = [s.split() for s in sys.argv[1:]]
print(f"4k randread QD32 IOPS ratio blkwire/nbdfuse: io_uring {float(u[0]) / float(n[0]):.2f}x, read {float(r[0]) / float(n[0]):.2f}x (target >= 2x)")
print(f"4k randread QD32 IOPS ratio io_uring/read: {float(u[0]) / float(r[0]):.2f}x")
print(f"4k randread QD1 mean latency: io_uring {u1[1]} us, read {r1[1]} us, nbdfuse {n1[1]} us")
print(f"1M read QD8 bandwidth: io_uring {um[3]} MiB/s, read {rm[3]} MiB/s, nbdfuse {nm[3]} MiB/s")
EOF
chart_end
