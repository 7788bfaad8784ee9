#!/usr/bin/env bash
# blkwire's NVMe/TCP frontend against the Linux kernel's own NVMe/TCP target (nvmet), in the kernel
# lab: one qemu guest (TCG, 2 vCPUs, Debian's 6.12 kernel) runs both targets on its loopback, each
# on a file on the same tmpfs, attaches both with its own nvme-tcp host and runs the same fio
# workloads on both (tests/kernel-lab/scenarios/nvme-tcp-bench/guest.sh):
#   4k randread and randwrite at QD1 and QD32, 1M sequential read and write and 1M random mixed
#   30% read at QD$BIGQD (default 8) (one job each, libaio, direct=1; the targets alternate order per
#   workload), then 4k randread at QD128 x 16 jobs on blkwire's NVMe/TCP namespace, on nvmet's,
#   and on `blkwire map --frontend ublk` of the same blkwire export over tcp:// and over eth:// (a
#   veth pair inside the guest).
# Under TCG absolute numbers mean little (the guest's CPUs are emulated, and the host is shared):
# compare the ratios blkwire/nvmet, measured side by side in one boot.
#
#   bench/nvme-tcp-lab.sh
#
# Environment:
#   RUNTIME   seconds per measurement (default 5)      RAMP  warm-up seconds, not counted (default 1)
#   SIZE      MiB per image (default 192)              HQD, HJOBS  the many-jobs run (128, 16)
#   BIGQD     queue depth of the 1M workloads and of the fill (default 8)
#   ETH=0     skip the eth:// run
#   BLKWIRE_NVME=0  a blkwire without the NVMe/TCP frontend: nvmet and the ublk runs only
#   BLKWIRE   the blkwire binary (default target/release/blkwire; built if missing)
#   REPORT_ONLY=1  no run: the table of the last run's guest log again
# The guest log stays in tests/kernel-lab/.cache/logs/nvme-tcp-bench/serial.log.
set -euo pipefail
shopt -s inherit_errexit

RUNTIME="${RUNTIME:-5}"
RAMP="${RAMP:-1}"
SIZE="${SIZE:-192}"
HQD="${HQD:-128}"
HJOBS="${HJOBS:-16}"
BIGQD="${BIGQD:-8}"
ETH="${ETH:-1}"
BLKWIRE_NVME="${BLKWIRE_NVME:-1}"
cd "$(dirname "$0")/.."
BLKWIRE="${BLKWIRE:-target/release/blkwire}"

die() { echo "nvme-tcp-lab: $*" >&2; exit 1; }

for v in RUNTIME SIZE HQD HJOBS BIGQD; do
    [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -gt 0 ]] || die "$v must be a positive integer (got '${!v}')"
done
[[ "$RAMP" =~ ^[0-9]+$ ]] || die "RAMP must be a non-negative integer (got '$RAMP')"
command -v python3 >/dev/null || die "python3 not found"
if [[ ! -x "$BLKWIRE" ]]; then
    echo "nvme-tcp-lab: $BLKWIRE missing, building it" >&2
    cargo build --release --locked -p blkwire >&2
fi
[[ -x "$BLKWIRE" ]] || die "$BLKWIRE still missing after the build"
if [[ "$BLKWIRE_NVME" = 1 ]] && ! "$BLKWIRE" serve --help | grep -q 'nvme-tcp://'; then
    die "$BLKWIRE has no NVMe/TCP frontend (serve --help names no nvme-tcp://); BLKWIRE_NVME=0 runs nvmet and ublk only"
fi

# Every run gets its own time in the guest; give the watchdog and qemu room for all of them.
runs=$((7 * (BLKWIRE_NVME + 1) + 2 + BLKWIRE_NVME + ETH))
guest_timeout=$((runs * (RUNTIME + RAMP + 15) + 240))
log=tests/kernel-lab/.cache/logs/nvme-tcp-bench/serial.log
cmd=(env LAB_BENCH_RUNTIME="$RUNTIME" LAB_BENCH_RAMP="$RAMP" LAB_BENCH_SIZE="$SIZE" LAB_BENCH_HQD="$HQD"
    LAB_BENCH_HJOBS="$HJOBS" LAB_BENCH_BIGQD="$BIGQD" LAB_BENCH_ETH="$ETH" LAB_BENCH_BLKWIRE_NVME="$BLKWIRE_NVME"
    LAB_GUEST_TIMEOUT="$guest_timeout" LAB_BOOT_TIMEOUT=$((guest_timeout + 120)) BLKWIRE="$BLKWIRE"
    tests/kernel-lab/run.sh nvme-tcp-bench)
if [[ "${REPORT_ONLY:-0}" = 1 ]]; then
    [[ -f "$log" ]] || die "no guest log $log to report on"
else
    echo "nvme-tcp-lab: ${cmd[*]}" >&2
    "${cmd[@]}" >&2 || die "the kernel-lab run failed (see above; guest log $log)"
fi

python3 - "$log" "$("$BLKWIRE" --version 2>/dev/null || echo blkwire)" <<'EOF'
import re, sys
log, version = sys.argv[1:]
res, facts, kernel, fio = {}, [], "?", "?"
params = {}
for line in open(log, errors="replace").read().replace("\r", "").splitlines():
    m = re.search(r"LAB-INFO: bench: (.*)", line)
    if m:
        params = dict(kv.split("=", 1) for kv in m[1].split())
    m = re.search(r"LAB-FIO: (\S+) (\S+) (3;.*)", line)
    if m:
        res[(m[1], m[2])] = m[3].strip().split(";")
        fio = m[3].split(";")[1]
        continue
    m = re.search(r"LAB-BOOT: kernel ([^ ,]+)", line)
    if m:
        kernel = m[1]
    m = re.search(r"LAB-INFO: (.*)", line)
    if m:
        facts.append(m[1])

runtime, ramp, size, hqd, hjobs = (params.get(k, "?") for k in ("runtime", "ramp", "size", "hqd", "hjobs"))

def stats(f):
    """IOPS, MiB/s, mean total latency (us, submission to completion), p99 completion latency
    (us; fio's percentiles are of clat) of both directions together."""
    iops = bw = lat_sum = 0.0
    p99 = 0.0
    for base in (5, 46):  # terse v3: read fields 6.., write fields 47.. (1-based)
        n = float(f[base + 2])
        iops += n
        bw += float(f[base + 1]) / 1024
        lat_sum += n * float(f[base + 34])
        for p in f[base + 12:base + 32]:
            if p.startswith("99.000000%="):
                p99 = max(p99, float(p.split("=")[1]))
    return iops, bw, (lat_sum / iops if iops else 0.0), p99

def ratio(a, b):
    return f"{a / b:.2f}" if b else "n/a"

print(f"# NVMe/TCP in the kernel lab: blkwire's frontend vs the kernel's nvmet, both in one qemu guest (TCG, 2 vCPUs), kernel {kernel}")
print(f"# {version} serve --listen nvme-tcp://127.0.0.1:4430 file:/bench/blkwire.img; nvmet-tcp 127.0.0.1:4420 file backend (buffered_io=1) /bench/nvmet.img; both {size} MiB on one tmpfs")
print(f"# host: the guest's nvme-tcp (nvme connect, no digests); {fio}, libaio, direct=1, {runtime} s per run (+{ramp} s ramp), filled with 1M writes first (QD{params.get('bigqd', '?')})")
for f in facts:
    print(f"#   {f}")
print()
print("| workload | blkwire IOPS | MiB/s | mean lat us | p99 clat us | nvmet IOPS | MiB/s | mean lat us | p99 clat us | IOPS blkwire/nvmet |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
works = [w for (t, w) in res if t == "nvmet" and not w.endswith(f"x{hjobs}")]
for w in works:
    k = stats(res[("nvmet", w)])
    b = stats(res[("blkwire", w)]) if ("blkwire", w) in res else None
    bcols = f"{b[0]:.0f} | {b[1]:.1f} | {b[2]:.0f} | {b[3]:.0f}" if b else "- | - | - | -"
    print(f"| {w} | {bcols} | {k[0]:.0f} | {k[1]:.1f} | {k[2]:.0f} | {k[3]:.0f} | {ratio(b[0], k[0]) if b else 'n/a'} |")
hw = f"randread-4k-qd{hqd}x{hjobs}"
print()
print(f"4k randread, QD{hqd} x {hjobs} jobs:")
print()
print("| path | IOPS | MiB/s | mean lat ms | p99 clat ms | IOPS vs nvmet |")
print("|---|---:|---:|---:|---:|---:|")
names = {
    "blkwire": "blkwire NVMe/TCP frontend (kernel nvme-tcp host)",
    "nvmet": "kernel nvmet-tcp (kernel nvme-tcp host)",
    "blkwire-ublk-tcp": "blkwire map --frontend ublk, tcp://",
    "blkwire-ublk-eth": "blkwire map --frontend ublk, eth:// (veth)",
}
base = stats(res[("nvmet", hw)])[0] if ("nvmet", hw) in res else 0
for t in names:
    if (t, hw) in res:
        s = stats(res[(t, hw)])
        print(f"| {names[t]} | {s[0]:.0f} | {s[1]:.1f} | {s[2] / 1000:.1f} | {s[3] / 1000:.1f} | {ratio(s[0], base)} |")
EOF
