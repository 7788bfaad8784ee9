#!/usr/bin/env bash
# Three NBD servers, one NBD client: in one run and with the same parameters, fio's nbd engine
# (libnbd) drives
#   (a) blkwire serve's NBD frontend (nbd://, mem:1G export),
#   (b) nbdkit's memory plugin (1G),
#   (c) qemu-nbd serving a raw 1G file on tmpfs (/dev/shm),
# all on 127.0.0.1, plus, as a reference, (d) nbdkit's null plugin: nbdkit with no storage work
# at all (reads return zeros, writes are dropped), i.e. what the client plus nbdkit's own request
# plumbing cost. If nbdkit memory is as fast as nbdkit null, nbdkit's storage is not its limit.
# The client is the same program with the same options for every server, so the differences are
# the servers'.
#
# Workloads (one job each): 4k randread and randwrite at QD1 and QD32, 1M sequential read at QD8.
# Every export is filled with data first (1M sequential writes), so reads copy real pages rather
# than holes (the null server has nothing to fill). Within each workload the servers run back to
# back, in an order that rotates from one workload to the next, so slow drift of the machine hits
# all of them alike.
#
# Environment:
#   RUNTIME        seconds per measurement (default 8)
#   RAMP           seconds of warm-up per measurement, not counted (default 1)
#   BLKWIRE        path of the blkwire binary (default target/release/blkwire; built if missing)
#   READY_TIMEOUT  seconds to wait for a server to come up (default 10)
#   SHM            tmpfs directory for qemu-nbd's image (default /dev/shm)
#
# Output: a markdown table, then the ratios the issue asks about. Latency is fio's total latency
# (lat_ns = submit to completion, --lat_percentiles=1). Server CPU is the server process'
# user+system time over the run divided by wall time (100% = one core); client CPU likewise for
# fio (from /usr/bin/time when present).
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-8}"
# fio jobs (one NBD connection each); one job saturates the client before the servers differ.
JOBS="${JOBS:-1}"
RAMP="${RAMP:-1}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
SHM="${SHM:-/dev/shm}"
SIZE=1G
EXPORT=scratch
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "nbd-compare: $*" >&2; exit 1; }

for t in nbdkit qemu-nbd nbdinfo fio python3; do
    command -v "$t" >/dev/null || die "$t not found in PATH (scripts/deps.sh installs it)"
done
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer (got '$RUNTIME')"
[[ "$RAMP" =~ ^[0-9]+$ ]] || die "RAMP must be a non-negative integer (got '$RAMP')"
[[ -d "$SHM" && -w "$SHM" ]] || die "$SHM is not a writable directory"
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*nbd' || die "this fio has no nbd engine"

if [[ ! -x "$BLKWIRE" ]]; then
    echo "nbd-compare: $BLKWIRE missing, building it" >&2
    cargo build --release -p blkwire >&2
fi
[[ -x "$BLKWIRE" ]] || die "$BLKWIRE still missing after the build"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/nbd-compare.XXXXXX")"
IMGDIR="$(mktemp -d "$SHM/nbd-compare.XXXXXX")"
declare -A PID=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    # Only the servers this script started, by their pids.
    for pid in "${PID[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PID[@]}"; do
        # bounded wait, then SIGKILL
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.err; do
            [[ -s "$f" ]] && { echo "--- $(basename "$f") (tail) ---" >&2; tail -n 20 "$f" >&2; }
        done
    fi
    rm -rf "$WORK" "$IMGDIR"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh


# wait_nbd NAME URI: until an NBD client gets the export's size (the server is serving).
wait_nbd() {
    local name="$1" uri="$2" deadline
    deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
    while (( $(now_ms) < deadline )); do
        kill -0 "${PID[$name]}" 2>/dev/null || return 1
        if nbdinfo --size "$uri" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.05
    done
    return 1
}

# start_on_port NAME CMD...: starts a server whose command line ends with a port chosen here
# ("@PORT@" in CMD is replaced); retries on a lost race for the port. Sets URI[NAME].
declare -A URI=()
start_on_port() {
    local name="$1"; shift
    local attempt port args a
    for attempt in 1 2 3 4 5; do
        port="$(free_port)"
        args=()
        for a in "$@"; do args+=("${a//@PORT@/$port}"); done
        "${args[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err" &
        PID[$name]=$!
        if wait_nbd "$name" "nbd://127.0.0.1:$port/$EXPORT"; then
            URI[$name]="nbd://127.0.0.1:$port/$EXPORT"
            return 0
        fi
        kill "${PID[$name]}" 2>/dev/null || true
        wait "${PID[$name]}" 2>/dev/null || true
        unset "PID[$name]"
        echo "nbd-compare: $name did not come up on port $port (attempt $attempt), retrying" >&2
    done
    die "could not start $name: $(tail -n 5 "$WORK/$name.err" 2>/dev/null)"
}

# ---------------------------------------------------------------------------- servers
# blkwire: binds port 0 itself and prints the address it got.
"$BLKWIRE" serve --listen nbd://127.0.0.1:0 --export "$EXPORT=mem:$SIZE" \
    >"$WORK/blkwire.out" 2>"$WORK/blkwire.err" &
PID[blkwire]=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(now_ms) < deadline )); do
    if line="$(grep -m1 '^listening nbd://' "$WORK/blkwire.out" 2>/dev/null)"; then
        URI[blkwire]="${line#listening }/$EXPORT"
        break
    fi
    kill -0 "${PID[blkwire]}" 2>/dev/null || die "blkwire serve exited before listening"
    sleep 0.05
done
[[ -n "${URI[blkwire]:-}" ]] || die "blkwire serve did not print 'listening nbd://' within ${READY_TIMEOUT}s"
wait_nbd blkwire "${URI[blkwire]}" || die "blkwire does not answer NBD at ${URI[blkwire]}"

# nbdkit: -f keeps it our child; any export name is accepted.
start_on_port nbdkit nbdkit -f -i 127.0.0.1 -p @PORT@ memory "$SIZE"

# qemu-nbd: sparse raw file on tmpfs; --persistent and --shared so it outlives each fio run.
truncate -s "$SIZE" "$IMGDIR/disk.img"
start_on_port qemu-nbd qemu-nbd -f raw --persistent --shared=8 -b 127.0.0.1 -p @PORT@ \
    -x "$EXPORT" "$IMGDIR/disk.img"

# Reference: nbdkit with no storage work (null discards writes and reads zeros, no memory touched).
start_on_port nbdkit-null nbdkit -f -i 127.0.0.1 -p @PORT@ null "$SIZE"

SYSTEMS=(blkwire nbdkit qemu-nbd nbdkit-null)
N=${#SYSTEMS[@]}

# ---------------------------------------------------------------------------- runners

# run_fio SYSTEM RW BS QD: one line "iops mib_s mean_us p99_us srv_cpu_pct cli_cpu_pct".
run_fio() {
    local sys="$1" rw="$2" bs="$3" qd="$4" out cpu dir
    out="$WORK/fio-$sys-$rw-$bs-$qd.json"
    dir=read; [[ "$rw" == *write* ]] && dir=write
    # --output keeps the JSON clean (the nbd engine prints on stdout).
    # --norandommap: offsets are drawn independently (no coverage map), as in nbdkit-compare.sh.
    cpu="$(run_timed "$out.stdout" "${PID[$sys]}" fio --name=x --ioengine=nbd --uri="${URI[$sys]}" \
        --rw="$rw" --bs="$bs" --iodepth="$qd" --numjobs="$JOBS" --group_reporting --time_based --runtime="$RUNTIME" \
        --ramp_time="$RAMP" --norandommap --lat_percentiles=1 --output-format=json --output="$out")" \
        || die "fio $sys $rw bs=$bs QD$qd failed: $(tail -n 5 "$out.stdout.err" 2>/dev/null)"
    python3 - "$out" "$dir" <<'EOF' | tr '\n' ' '
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
job = d["jobs"][0]
if job.get("error"):
    sys.exit(f"fio job error {job['error']}")
r = job[sys.argv[2]]
lat = r["lat_ns"]
print(f'{r["iops"]:.0f} {r["bw_bytes"]/2**20:.0f} {lat["mean"]/1000:.1f} {lat["percentile"]["99.000000"]/1000:.1f}')
EOF
    echo "$cpu"
}

# ---------------------------------------------------------------------------- fill
echo "filling the three 1G exports with data ..." >&2
for sys in blkwire nbdkit qemu-nbd; do
    fio --name=fill --ioengine=nbd --uri="${URI[$sys]}" --rw=write --bs=1M --iodepth=8 \
        --size="$SIZE" --output-format=terse --output="$WORK/fill-$sys.out" \
        >"$WORK/fill-$sys.stdout" 2>"$WORK/fill-$sys.err" || die "filling $sys failed"
done

# ---------------------------------------------------------------------------- measure
echo "# NBD servers, one client: fio $(fio --version | sed 's/^fio-//') --ioengine=nbd (libnbd $(nbdinfo --version 2>/dev/null | sed -n 's/^libnbd //p')), ${JOBS} job(s), ${RUNTIME}s per run (+${RAMP}s ramp), 127.0.0.1, $(nproc) CPUs"
echo "# blkwire:  $("$BLKWIRE" --version 2>/dev/null || echo "$BLKWIRE") serve --listen nbd:// mem:$SIZE (${URI[blkwire]})"
echo "# nbdkit:   $(nbdkit --version) memory $SIZE (${URI[nbdkit]})"
echo "# qemu-nbd: $(qemu-nbd --version | head -n1) -f raw $SHM file of $SIZE (${URI[qemu-nbd]})"
echo "# nbdkit-null: $(nbdkit --version) null $SIZE, no storage work: client + nbdkit plumbing only (${URI[nbdkit-null]})"
echo "# every export filled with data first (1M sequential writes)"
echo

declare -A R
CASES=("randread 4k 1" "randread 4k 32" "randwrite 4k 1" "randwrite 4k 32" "read 1M 8")
i=0
for c in "${CASES[@]}"; do
    set -- $c
    # rotate the order: blkwire first, then second, then third, ...
    for (( k = 0; k < N; k++ )); do
        sys="${SYSTEMS[$(( (k + i) % N ))]}"
        echo "running $1 bs=$2 QD$3 on $sys ..." >&2
        R[$sys,$1,$2,$3]="$(run_fio "$sys" "$1" "$2" "$3")"
    done
    i=$(( i + 1 ))
done

chart_begin nbd-compare "NBD servers, one client (fio nbd engine): ${JOBS} job(s), ${RUNTIME}s per run, 127.0.0.1" \
    iops mean_us p99_us
echo "| rw | bs | QD | system | IOPS | MiB/s | mean latency us | p99 us | server CPU % | client CPU % |"
echo "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"
for c in "${CASES[@]}"; do
    set -- $c
    for sys in "${SYSTEMS[@]}"; do
        read -r iops mib mean p99 scpu ccpu <<<"${R[$sys,$1,$2,$3]}"
        echo "| $1 | $2 | $3 | $sys | $iops | $mib | $mean | $p99 | $scpu | $ccpu |"
        chart_row "$2 $1 QD$3" "$sys" "$iops" "$mean" "$p99"
    done
done
echo

args=()
for c in "${CASES[@]}"; do
    set -- $c
    for sys in "${SYSTEMS[@]}"; do
        args+=("$sys,$1,$2,$3=${R[$sys,$1,$2,$3]}")
    done
done
python3 - "${args[@]}" <<'EOF'
import sys
R = {}
for a in sys.argv[1:]:
    k, v = a.split("=", 1)
    R[k] = [float(x) if x != "n/a" else None for x in v.split()]
def iops(s, c): return R[f"{s},{c}"][0]
def mib(s, c): return R[f"{s},{c}"][1]
def lat(s, c): return R[f"{s},{c}"][2]
for c, name in [("randread,4k,32", "randread  4k QD32"), ("randwrite,4k,32", "randwrite 4k QD32"),
                ("randread,4k,1", "randread  4k QD1 "), ("randwrite,4k,1", "randwrite 4k QD1 ")]:
    print(f"{name} IOPS blkwire/nbdkit {iops('blkwire', c) / iops('nbdkit', c):.2f}x, "
          f"blkwire/qemu-nbd {iops('blkwire', c) / iops('qemu-nbd', c):.2f}x, "
          f"blkwire/nbdkit-null {iops('blkwire', c) / iops('nbdkit-null', c):.2f}x, "
          f"nbdkit/nbdkit-null {iops('nbdkit', c) / iops('nbdkit-null', c):.2f}x")
c = "read,1M,8"
print(f"read      1M QD8  MiB/s blkwire/nbdkit {mib('blkwire', c) / mib('nbdkit', c):.2f}x, "
      f"blkwire/qemu-nbd {mib('blkwire', c) / mib('qemu-nbd', c):.2f}x, "
      f"blkwire/nbdkit-null {mib('blkwire', c) / mib('nbdkit-null', c):.2f}x, "
      f"nbdkit/nbdkit-null {mib('nbdkit', c) / mib('nbdkit-null', c):.2f}x")
for c, name in [("randread,4k,1", "randread "), ("randwrite,4k,1", "randwrite")]:
    print(f"{name} 4k QD1 mean latency us: blkwire {lat('blkwire', c)}, nbdkit {lat('nbdkit', c)}, "
          f"qemu-nbd {lat('qemu-nbd', c)}, nbdkit-null {lat('nbdkit-null', c)}")
ratio = iops("blkwire", "randread,4k,32") / iops("nbdkit", "randread,4k,32")
print(f"target randread 4k QD32 >= 1.5x nbdkit: {'met' if ratio >= 1.5 else 'NOT met'} ({ratio:.2f}x)")
ok = lat("blkwire", "randread,4k,1") < lat("nbdkit", "randread,4k,1")
print(f"target QD1 latency below nbdkit (randread): {'met' if ok else 'NOT met'}")
EOF
chart_end
