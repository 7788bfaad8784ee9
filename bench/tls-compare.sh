#!/usr/bin/env bash
# TLS against plain on the same target in the same run (issue 12 item 4): one `blkwire serve
# --tls on` with a tcp:// and an nbd:// listener and a 1G RAM export serves, in turn,
#   native-plain  blkwire bench tcp://...
#   native-tls    blkwire bench --tls-ca CERT tcp://...   (TLS 1.3, X.509)
#   nbd-plain     fio --ioengine=nbd nbd://...
#   nbd-tls       fio --ioengine=nbd nbds://...           (STARTTLS, TLS 1.3, X.509)
# 4k random reads at QD32 by default (RW, BS, QD below), one connection each. fio's nbd engine
# refuses TLS-PSK files (local file access), so the TLS runs use X.509: the record layer
# (AES-GCM) costs the same with a PSK; only the handshake differs. libnbd finds the CA in
# $HOME/.pki/libnbd/ca-cert.pem, so fio runs with HOME pointing into the scratch directory.
#
# ROUNDS rounds, the order of the four cases rotating from round to round, so slow drift of the
# machine hits all of them alike; the summary is the median of the rounds.
#
# Environment: RUNTIME seconds per measurement (default 5), RAMP fio warm-up seconds (default 1),
# ROUNDS (default 3), RW, BS and QD (the workload: default randread, 4k, 32), BLKWIRE (default
# target/release/blkwire; built if missing), POLL_US: when set, both blkwire ends spin that
# long before sleeping (`--poll-us`; 0 = never spin, so CPU time is work, not waiting).
#
# Output: one line per measurement, then the medians. Server CPU is the target's user+system
# time over the run, client CPU the benchmark program's (from /usr/bin/time), both in percent of
# one core and in microseconds per I/O.
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-5}"
RAMP="${RAMP:-1}"
ROUNDS="${ROUNDS:-3}"
RW="${RW:-randread}"
BS="${BS:-4k}"
QD="${QD:-32}"
READY_TIMEOUT="${READY_TIMEOUT:-10}"
SIZE=1G
EXPORT=scratch
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"
POLL=()
[[ -n "${POLL_US:-}" ]] && POLL=(--poll-us "$POLL_US")

die() { echo "tls-compare: $*" >&2; exit 1; }

for t in fio openssl python3 nbdinfo; do
    command -v "$t" >/dev/null || die "$t not found in PATH (scripts/deps.sh installs it)"
done
[[ "$RUNTIME" =~ ^[0-9]+$ && "$RUNTIME" -gt 0 ]] || die "RUNTIME must be a positive integer"
[[ "$ROUNDS" =~ ^[0-9]+$ && "$ROUNDS" -gt 0 ]] || die "ROUNDS must be a positive integer"
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*nbd' || die "this fio has no nbd engine"
if [[ ! -x "$BLKWIRE" ]]; then
    cargo build --release -p blkwire >&2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tls-compare.XXXXXX")"
SRV=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$SRV" ]]; then
        kill "$SRV" 2>/dev/null || true
        wait "$SRV" 2>/dev/null || true
    fi
    if [[ $rc -ne 0 ]]; then
        for f in "$WORK"/*.err; do
            [[ -s "$f" ]] && { echo "--- $(basename "$f") (tail) ---" >&2; tail -n 20 "$f" >&2; }
        done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

. bench/lib.sh

# A self-signed certificate for 127.0.0.1; libnbd takes it as its CA from $HOME/.pki/libnbd.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=blkwire bench" -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" \
    -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>"$WORK/openssl.err" || die "openssl req failed"
mkdir -p "$WORK/home/.pki/libnbd"
cp "$WORK/cert.pem" "$WORK/home/.pki/libnbd/ca-cert.pem"

"$BLKWIRE" serve --listen tcp://127.0.0.1:0 --listen nbd://127.0.0.1:0 \
    --export "$EXPORT=mem:$SIZE" "${POLL[@]}" --tls on --tls-cert "$WORK/cert.pem" --tls-key "$WORK/key.pem" \
    --log-level warn >"$WORK/serve.out" 2>"$WORK/serve.err" &
SRV=$!
deadline=$(( $(now_ms) + READY_TIMEOUT * 1000 ))
while (( $(grep -c '^listening ' "$WORK/serve.out" 2>/dev/null || true) < 2 )); do
    kill -0 "$SRV" 2>/dev/null || die "blkwire serve exited before listening"
    (( $(now_ms) < deadline )) || die "blkwire serve did not listen within ${READY_TIMEOUT}s"
    sleep 0.05
done
TCP="$(sed -n 's/^listening \(tcp:.*\)/\1/p' "$WORK/serve.out")/$EXPORT"
NBD="$(sed -n 's/^listening nbd:\/\/\(.*\)/\1/p' "$WORK/serve.out")"
NBD_PLAIN="nbd://$NBD/$EXPORT"
NBD_TLS="nbds://$NBD/$EXPORT"
HOME="$WORK/home" nbdinfo --size "$NBD_TLS" >/dev/null 2>"$WORK/nbdinfo.err" \
    || die "nbdinfo over TLS failed: $(cat "$WORK/nbdinfo.err")"

echo "filling the export with data ..." >&2
fio --name=fill --ioengine=nbd --uri="$NBD_PLAIN" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
    --output-format=terse --output="$WORK/fill.out" >"$WORK/fill.stdout" 2>"$WORK/fill.err" \
    || die "filling the export failed"

# run CASE: one line "iops p99_us srv_pct cli_pct".
run() {
    local c="$1" out="$WORK/$1.json" cpu
    case "$c" in
    native-plain | native-tls)
        local tls=()
        [[ "$c" == native-tls ]] && tls=(--tls-ca "$WORK/cert.pem")
        cpu="$(run_timed "$out" "$SRV" "$BLKWIRE" bench "${tls[@]}" "${POLL[@]}" --rw "$RW" --bs "$BS" \
            --iodepth "$QD" --runtime "$RUNTIME" --json "$TCP")" || die "bench $c failed: $(cat "$out.err")"
        python3 - "$out" <<'EOF' | tr '\n' ' '
import json, sys
d = json.load(open(sys.argv[1]))
print(f'{d["iops"]:.0f} {d["latency_us"]["p99"]:.0f}')
EOF
        ;;
    nbd-plain | nbd-tls)
        local uri="$NBD_PLAIN"
        [[ "$c" == nbd-tls ]] && uri="$NBD_TLS"
        cpu="$(run_timed "$out.stdout" "$SRV" env HOME="$WORK/home" fio --name=x --ioengine=nbd \
            --uri="$uri" --rw="$RW" --bs="$BS" --iodepth="$QD" --time_based --runtime="$RUNTIME" \
            --ramp_time="$RAMP" --norandommap --lat_percentiles=1 --output-format=json \
            --output="$out")" || die "fio $c failed: $(tail -n 5 "$out.stdout.err")"
        python3 - "$out" <<'EOF' | tr '\n' ' '
import json, sys
t = open(sys.argv[1]).read()
r = json.loads(t[t.index("{"):])["jobs"][0]["read"]
print(f'{r["iops"]:.0f} {r["lat_ns"]["percentile"]["99.000000"]/1000:.0f}')
EOF
        ;;
    esac
    echo "$cpu"
}

CASES=(native-plain native-tls nbd-plain nbd-tls)
N=${#CASES[@]}
echo "# TLS vs plain: $BS $RW QD$QD, 1 connection, ${RUNTIME}s per run, ${ROUNDS} rounds, 127.0.0.1, $(nproc) CPUs, $(openssl version)"
echo "# target: $("$BLKWIRE" --version) serve --tls on (X.509, P-256) ${POLL[*]}, mem:$SIZE; native client: blkwire bench; NBD client: fio $(fio --version | sed 's/^fio-//') nbd engine (libnbd $(nbdinfo --version 2>/dev/null | sed -n 's/^libnbd //p'))"
printf '%-6s %-13s %9s %8s %8s %8s %10s %10s\n' round case IOPS p99_us srv_cpu% cli_cpu% srv_us/io cli_us/io
chart_begin tls-compare "TLS vs plain: $BS $RW QD$QD, 1 connection, ${RUNTIME}s per run, 127.0.0.1" iops p99_us
chart_meta peers plain
declare -A R
for (( r = 0; r < ROUNDS; r++ )); do
    for (( k = 0; k < N; k++ )); do
        c="${CASES[$(( (k + r) % N ))]}"
        echo "round $r: $c ..." >&2
        # shellcheck disable=SC2046
        set -- $(run "$c")
        R[$c,$r]="$*"
        printf '%-6s %-13s %9s %8s %8s %8s %10s %10s\n' "$r" "$c" "$1" "$2" "$3" "$4" \
            "$(python3 -c "print(f'{$3/100*1e6/$1:.2f}')")" \
            "$(python3 -c "print(f'{$4/100*1e6/$1:.2f}' if '$4' != 'n/a' else 'n/a')")"
        if [[ "$c" == native-* ]]; then g="tcp:// (blkwire bench)"; else g="nbd:// (fio nbd engine)"; fi
        chart_row "$g" "${c#*-}" "$1" "$2"
    done
done

echo
echo "# medians over $ROUNDS rounds"
printf '%-13s %9s %8s %10s %10s %8s\n' case IOPS p99_us srv_us/io cli_us/io vs_plain
for c in "${CASES[@]}"; do
    rows=""
    for (( r = 0; r < ROUNDS; r++ )); do rows+="${R[$c,$r]};"; done
    plain="${c%-*}-plain"
    prow=""
    for (( r = 0; r < ROUNDS; r++ )); do prow+="${R[$plain,$r]};"; done
    python3 - "$c" "$rows" "$prow" <<'EOF'
import statistics, sys
c, rows, prow = sys.argv[1], sys.argv[2], sys.argv[3]
def parse(s):
    return [[float(x) if x != "n/a" else float("nan") for x in r.split()] for r in s.split(";") if r]
v, p = parse(rows), parse(prow)
med = lambda xs: statistics.median(xs)
iops = med([r[0] for r in v])
p99 = med([r[1] for r in v])
srv = med([r[2] / 100 * 1e6 / r[0] for r in v])
cli = med([r[3] / 100 * 1e6 / r[0] for r in v])
ratio = iops / med([r[0] for r in p])
print(f"{c:<13} {iops:9.0f} {p99:8.0f} {srv:10.2f} {cli:10.2f} {ratio*100:7.0f}%")
EOF
done
chart_end
