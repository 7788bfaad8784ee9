#!/usr/bin/env bash
# What large sequential reads (or writes) cost the server, per GiB moved: CPU time rather than
# MiB/s, so a run on a busy machine still compares (MiB/s is shown too, and is what the noise
# moves). In one run, for each blkwire binary given and for nbdkit's memory plugin as the peer:
#   serve one export over NBD (`--poll-us 0`: a spinning reactor would bill its waits), fill it
#   with 1 MiB writes, then fio --ioengine=nbd reads (or writes) it sequentially, 1 MiB at QD8,
#   LOOPS times over; the server's CPU (utime+stime from /proc) and fio's (usr+sys) per GiB.
#
#   bench/seq-cost.sh [BLKWIRE...]     # default: target/release/blkwire
#
# Environment: RW (read or write, default read), EXPORT (blkwire's export spec, default
# mem:1G; e.g. file:/dev/shm/x.img for a backend that fills buffers), SIZE (default 1G, the
# export and the file), LOOPS (default 4), ROUNDS (default 3; systems alternate within each
# round), QD (default 8), BS (default 1M).
set -euo pipefail
shopt -s inherit_errexit

RW="${RW:-read}"
EXPORT="${EXPORT:-mem:1G}"
SIZE="${SIZE:-1G}"
LOOPS="${LOOPS:-4}"
ROUNDS="${ROUNDS:-3}"
QD="${QD:-8}"
BS="${BS:-1M}"
cd "$(dirname "$0")/.."
die() { echo "seq-cost: $*" >&2; exit 1; }
# shellcheck source=bench/lib.sh
. bench/lib.sh

for t in fio nbdkit python3; do
    command -v "$t" >/dev/null || die "$t not found in PATH (scripts/deps.sh installs it)"
done
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*nbd' || die "this fio has no nbd engine"
[[ "$RW" == read || "$RW" == write ]] || die "RW must be read or write (got '$RW')"
[[ "$LOOPS" =~ ^[1-9][0-9]*$ ]] || die "LOOPS must be a positive integer (got '$LOOPS')"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer (got '$ROUNDS')"
BINS=("$@")
[[ ${#BINS[@]} -gt 0 ]] || BINS=(target/release/blkwire)
for b in "${BINS[@]}"; do
    [[ -x "$b" ]] || die "$b is not an executable blkwire (build with cargo build --release)"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/seq-cost.XXXXXX")"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# Servers: every blkwire binary, then nbdkit.
declare -a NAME URL PID
for i in "${!BINS[@]}"; do
    "${BINS[$i]}" serve --poll-us 0 --rpc-socket none --listen nbd://127.0.0.1:0 \
        --export "s=$EXPORT" >"$WORK/srv-$i.out" 2>&1 &
    PIDS+=($!)
    PID[i]=$!
    for _ in $(seq 100); do grep -q '^listening nbd://' "$WORK/srv-$i.out" && break; sleep 0.05; done
    grep -q '^listening nbd://' "$WORK/srv-$i.out" || die "${BINS[$i]} serve did not start: $(tail -n 2 "$WORK/srv-$i.out")"
    URL[i]="$(grep -o '^listening nbd://[0-9.:]*' "$WORK/srv-$i.out" | head -n1 | cut -d' ' -f2)/s"
    NAME[i]="blkwire#$i"
done
port="$(free_port)"
nbdkit -f -i 127.0.0.1 -p "$port" memory "$SIZE" &
PIDS+=($!)
n=${#BINS[@]}
PID[n]=$!
URL[n]="nbd://127.0.0.1:$port/"
NAME[n]="nbdkit"
for _ in $(seq 100); do nbdinfo --size "${URL[$n]}" >/dev/null 2>&1 && break; sleep 0.05; done

echo "# large sequential ${RW}s: fio --ioengine=nbd --rw=$RW --bs=$BS --iodepth=$QD, $LOOPS x $SIZE per measurement, $ROUNDS rounds, $(nproc) CPUs"
for i in "${!BINS[@]}"; do echo "# ${NAME[$i]}: ${BINS[$i]} ($("${BINS[$i]}" --version | head -n1)) serve --poll-us 0, export $EXPORT"; done
echo "# nbdkit: $(nbdkit --version | head -n1) memory $SIZE"
for i in "${!URL[@]}"; do
    fio --name=fill --ioengine=nbd --uri="${URL[$i]}" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
        --output="$WORK/fill-$i" >/dev/null 2>&1 || die "filling ${NAME[$i]} failed"
done

printf '%-10s %5s %8s %22s %22s\n' system round MiB/s "server CPU ms/GiB" "client CPU ms/GiB"
for ((r = 1; r <= ROUNDS; r++)); do
    order=("${!URL[@]}")
    (( r % 2 == 0 )) && mapfile -t order < <(printf '%s\n' "${order[@]}" | tac)
    for i in "${order[@]}"; do
        t0=$(cpu_ticks "${PID[$i]}")
        fio --name=r --ioengine=nbd --uri="${URL[$i]}" --rw="$RW" --bs="$BS" --iodepth="$QD" \
            --size="$SIZE" --loops="$LOOPS" --output-format=json --output="$WORK/r-$i-$r.json" \
            >/dev/null 2>&1 || die "fio against ${NAME[$i]} failed"
        t1=$(cpu_ticks "${PID[$i]}")
        python3 - "$WORK/r-$i-$r.json" "$(( t1 - t0 ))" "$CLK_TCK" "${NAME[$i]}" "$r" "$RW" <<'EOF'
import json, sys
path, ticks, hz, name, rnd, rw = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
j = json.load(open(path))["jobs"][0]
gib = j[rw]["io_bytes"] / (1 << 30)
client_s = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
print(f"{name:<10} {rnd:>5} {j[rw]['bw'] / 1024:8.0f} {ticks / hz * 1000 / gib:22.0f} {client_s * 1000 / gib:22.0f}")
EOF
    done
done
