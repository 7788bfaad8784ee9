#!/usr/bin/env bash
# bench/chart.sh TSV [PNG]: draws a bench script's table as a PNG (default: TSV with .png) with
# gnuplot: grouped bars of the first measure per group (workload, queue depth) and system, and a
# second panel beside it: mean latency with a whisker up to p99 where the table has both, else
# the table's second measure. Series named blkwire* are drawn solid in blues, the others (the
# peers) hatched in other colours; a "#peers" line names the peers where no series is blkwire*.
#
# The TSV (one a bench script writes beside its table, or docs/charts/make.sh from a recorded
# table):
#   #title<TAB>what was measured, on what            (comment lines, any order, all optional)
#   #run<TAB>which run: date, command
#   #peers<TAB>nbdcopy dd                             (space-separated series names)
#   group<TAB>system<TAB>iops<TAB>mean_us<TAB>p99_us  (header: group, series, then measures)
#   randread 4k QD1<TAB>blkwire<TAB>58986<TAB>16.8<TAB>32.3
# Measures known by name (and so labelled with their unit): iops, mean_us, p99_us,
# cpu_us_per_io, server_cpu_us_per_io, mib_s, seconds, rss_mib; any other name is its own
# label. Several rows for the same group and system (rounds) are drawn as their median, and the
# chart says so. An empty cell or "n/a" is no bar. A measure whose largest value is more than 30
# times its smallest is drawn on a log scale.
#
# Environment: CHART_SIZE (gnuplot size, default 800,450).
set -euo pipefail

die() { echo "chart: $*" >&2; exit 1; }
[[ $# -ge 1 && $# -le 2 ]] || die "usage: bench/chart.sh TSV [PNG]"
TSV="$1"
PNG="${2:-${TSV%.tsv}.png}"
[[ -r "$TSV" ]] || die "$TSV: not readable"
for t in gnuplot python3; do
    command -v "$t" >/dev/null || die "$t not found (scripts/deps.sh installs it)"
done

python3 - "$TSV" "$PNG" "${CHART_SIZE:-800,450}" <<'PY' | gnuplot
import math, statistics, sys, textwrap

tsv, png, size = sys.argv[1:4]
meta, rows, header = {}, [], None
for line in open(tsv, encoding="utf-8"):
    line = line.rstrip("\n")
    if not line.strip():
        continue
    if line.startswith("#"):
        key, _, value = line[1:].partition("\t")
        meta[key.strip()] = value.strip()
        continue
    cells = line.split("\t")
    if header is None:
        header = cells
        continue
    rows.append(cells + [""] * (len(header) - len(cells)))
if header is None or len(header) < 3 or not rows:
    sys.exit(f"chart: {tsv}: no header 'group<TAB>system<TAB>measure...' or no rows")

LABELS = {
    "iops": "IOPS",
    "mean_us": "latency (µs)",
    "p99_us": "p99 latency (µs)",
    "cpu_us_per_io": "CPU per I/O (µs, both ends)",
    "server_cpu_us_per_io": "target CPU per I/O (µs)",
    "mib_s": "MiB/s",
    "seconds": "seconds",
    "rss_mib": "RSS (MiB)",
    "link_pct": "bytes on the link (% of size)",
}
measures = header[2:]
groups, series = [], []
values = {}  # (group, series, measure) -> [float]
for r in rows:
    g, s = r[0], r[1]
    if g not in groups:
        groups.append(g)
    if s not in series:
        series.append(s)
    for m, cell in zip(measures, r[2:]):
        cell = cell.strip()
        if cell and cell.lower() not in ("n/a", "nan", "-"):
            values.setdefault((g, s, m), []).append(float(cell))
repeated = max(len(v) for v in values.values())

def value(g, s, m):
    v = values.get((g, s, m))
    return statistics.median(v) if v else None

blkwire = [s for s in series if s.startswith("blkwire")]
if "peers" in meta:
    peers = set(meta["peers"].split())
elif blkwire:
    peers = set(series) - set(blkwire)
else:
    peers = set()
BLUES = ["#1f4e9c", "#4a90d9", "#8fbce6", "#0b2a5c"]
OTHERS = ["#d9730d", "#6b6b6b", "#2e8b57", "#b0302a", "#8a5fb0"]
style, nb, no = {}, 0, 0
for s in series:
    if s in peers:
        style[s] = f'lc rgb "{OTHERS[no % len(OTHERS)]}" fs pattern 4 border lc rgb "{OTHERS[no % len(OTHERS)]}"'
        no += 1
    else:
        style[s] = f'lc rgb "{BLUES[nb % len(BLUES)]}" fs solid 0.9 border lc rgb "black"'
        nb += 1

def q(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

def qwrap(text, width):
    return '"' + "\\n".join(q(line)[1:-1] for line in textwrap.wrap(text, width, break_on_hyphens=False)) + '"'

def fmt(v):
    return "NaN" if v is None else repr(v)

first = measures[0]
panels = [(first, None)]
if "mean_us" in measures:
    panels.append(("mean_us", "p99_us" if "p99_us" in measures else None))
elif "p99_us" in measures and first != "p99_us":
    panels.append(("p99_us", None))
elif len(measures) > 1:
    panels.append((measures[1], None))

def tic(g):
    # Long group names take two lines, split at the space nearest the middle.
    # (before a parenthesis when there is one).
    if len(g) > 10 and " " in g:
        cut = g.index(" (") if " (" in g else min(
            (i for i, c in enumerate(g) if c == " "), key=lambda i: abs(i - len(g) / 2))
        g = g[:cut] + "\n" + g[cut + 1:]
    # and a line still too long for its place after its last hyphen
    g = "\n".join(l[:l.rindex("-") + 1] + "\n" + l[l.rindex("-") + 1:] if len(l) > 17 and "-" in l[1:-1] else l
                  for l in g.split("\n"))
    # (explicit tic labels are formats: a % is written %%)
    return '"' + "\\n".join(q(part)[1:-1].replace("%", "%%") for part in g.split("\n")) + '"'

out = []
w = out.append
w(f"set terminal pngcairo size {size} noenhanced font 'DejaVu Sans,9' background rgb 'white'")
w(f"set output {q(png)}")
w("set datafile separator '\\t'")
w("set style data histograms")
w("set boxwidth 0.9 relative")
w("set grid ytics lc rgb '#dddddd'")
w("set border 3")
w("set ytics nomirror")
w(f"set xrange [-0.6:{len(groups) - 0.4}]")
for i, (m, whisker) in enumerate(panels):
    w(f"$D{i} << EOD")
    for g in groups:
        cells = [g.replace("\t", " ")]
        for s in series:
            cells.append(fmt(value(g, s, m)))
            if whisker:
                cells.append(fmt(value(g, s, whisker)))
        w("\t".join(cells))
    w("EOD")

title = meta.get("title", tsv)
sub = meta.get("run", "")
if repeated > 1:
    sub = (sub + "; " if sub else "") + f"bars: median of {repeated} rows per system"
# A long title takes two lines (about 92 characters each at this size).
long = len(title) > 92
top = (0.80 if sub else 0.84) - (0.05 if long else 0)
w("set multiplot")
w(f"set label 1 {qwrap(title, 92)} at screen 0.5, screen {0.965 - (0.02 if long else 0)} center font 'DejaVu Sans,11'")
if sub:
    w(f"set label 2 {q(sub)} at screen 0.5, screen {0.915 - (0.055 if long else 0)} center font 'DejaVu Sans,8' tc rgb '#444444'")
# One key for both panels, under the titles; the panels stacked, sharing the groups below.
w(f"set key at screen 0.5, screen {top + 0.06} center center horizontal maxrows 1 samplen 2 spacing 1 width 1 box lc rgb '#bbbbbb'")
bottom, gap = 0.12, 0.04
height = (top - bottom - gap * (len(panels) - 1)) / len(panels)
for i, (m, whisker) in enumerate(panels):
    vals = [v for g in groups for s in series for v in [value(g, s, m), value(g, s, whisker) if whisker else None] if v is not None and v > 0]
    ptop = top - i * (height + gap)
    w("set lmargin at screen 0.11")
    w("set rmargin at screen 0.98")
    w(f"set tmargin at screen {ptop:.3f}")
    w(f"set bmargin at screen {ptop - height:.3f}")
    if i == len(panels) - 1:
        w("set xtics nomirror scale 0 font 'DejaVu Sans,8' (" + ", ".join(f"{tic(g)} {k}" for k, g in enumerate(groups)) + ")")
    else:
        w("unset xtics")
    label = LABELS.get(m, m)
    if whisker:
        w("set style histogram errorbars gap 1 lw 1")
    else:
        w("set style histogram clustered gap 1")
    log = bool(vals) and max(vals) / min(vals) > 30
    if log:
        w("set logscale y")
        w(f"set yrange [{10 ** math.floor(math.log10(min(vals)))}:*]")
        label = label.replace(" (", " (log, ", 1) if " (" in label else label + " (log)"
    else:
        w("unset logscale y")
        w("set yrange [0:*]")
    # 12k, 500k, 1M; below 10000 the plain number (1500, 2.5), which a prefix would round.
    w("set format y " + ("'%.0s%c'" if log or (vals and max(vals) >= 10000) else "'%g'"))
    if whisker:
        label += "\\nbar mean, whisker p99"
    w(f"set ylabel {q(label)} font 'DejaVu Sans,8'".replace("\\\\n", "\\n"))
    parts = []
    for k, s in enumerate(series):
        if whisker:
            c = 2 + 2 * k
            using = f"(column({c})):(column({c})):(column({c + 1}))"
        else:
            using = f"(column({2 + k}))"
        t = f"title {q(s)}" if i == 0 else "notitle"
        parts.append(f"$D{i} using {using} {t} {style[s]}")
    w("plot " + ", \\\n     ".join(parts))
    if i == 0:
        w("unset key")
w("unset multiplot")
print("\n".join(out))
PY
[[ -s "$PNG" ]] || die "gnuplot wrote no $PNG"
