#!/usr/bin/env bash
# docs/charts/make.sh: redraws the charts docs/BENCHMARKS.md shows, from the tables recorded
# there. Each chart below names a line of BENCHMARKS.md (its anchor, which must occur once) and
# how to read the recorded output that follows it; the table is turned into NAME.tsv here, in
# the form the bench scripts write (bench/chart.sh), and drawn as NAME.png with bench/chart.sh.
# After recording a new run in BENCHMARKS.md, move the chart's anchor to it and run this again.
set -euo pipefail
cd "$(dirname "$0")/../.."

python3 - docs/BENCHMARKS.md docs/charts <<'PY'
import re, sys

doc, outdir = sys.argv[1], sys.argv[2]
lines = open(doc, encoding="utf-8").read().split("\n")

def after(anchor):
    # (the captions under the charts, which name the commands, are not anchors)
    hits = [i for i, l in enumerate(lines) if anchor in l and not l.startswith("*Chart of")]
    if len(hits) != 1:
        sys.exit(f"make.sh: anchor {anchor!r} occurs {len(hits)} times in {doc}")
    return hits[0] + 1

def md_table(anchor):
    """The first markdown table after the anchor: a list of dicts by header."""
    i = after(anchor)
    while not lines[i].startswith("|"):
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    header, body = rows[0], [r for r in rows[2:]]
    return [dict(zip(header, r)) for r in body]

def block(anchor):
    """The lines of the first ``` block after the anchor."""
    i = after(anchor)
    while not lines[i].startswith("```"):
        i += 1
    j = i + 1
    while not lines[j].startswith("```"):
        j += 1
    return lines[i + 1:j]

def num(cell):
    return re.sub(r"[*,%]|MiB", "", cell).strip()

def latency(rows, group, system):
    return [(group(r), system(r), r["IOPS"], r["mean latency us"], r["p99 us"]) for r in rows]

charts = []

def chart(name, title, run, measures, rows, peers=None):
    with open(f"{outdir}/{name}.tsv", "w", encoding="utf-8") as f:
        f.write(f"#title\t{title}\n#run\t{run}\n")
        if peers:
            f.write(f"#peers\t{peers}\n")
        f.write("\t".join(["group", "system"] + measures) + "\n")
        for r in rows:
            f.write("\t".join(str(c) for c in r) + "\n")
    charts.append(name)

# Native protocol vs nbdkit memory (issue 2): the current result.
chart("nbdkit-compare",
      "blkwire (blkwire bench) vs nbdkit memory (fio nbd): 4k, 1 job, 8s per run, 127.0.0.1",
      "run of 2026-11-22 02:02 UTC, RUNTIME=8 bench/nbdkit-compare.sh",
      ["iops", "mean_us", "p99_us"],
      latency(md_table("Current result, 2026-11-22 02:02 UTC"),
              lambda r: f"{r['rw']} QD{r['QD']}", lambda r: r["system"]))

# Mapped block device (issue 4): the current result.
chart("map-compare",
      "mapped block device (fuse + loop): blkwire map vs nbdfuse, fio io_uring direct, 10s per run",
      "run of 2026-11-22 05:38 UTC, RUNTIME=10 bench/map-compare.sh",
      ["iops", "mean_us", "p99_us"],
      latency(md_table("Current result, 2026-11-22 05:38 UTC"),
              lambda r: f"{r['bs']} {r['rw']} QD{r['QD']}", lambda r: r["system"]))

# NBD frontend (issue 3): the current results, one and two fio jobs.
for jobs, anchor in ((1, "`JOBS=1` (one fio job"), (2, "`JOBS=2` (two fio jobs")):
    chart(f"nbd-compare-jobs{jobs}",
          f"NBD servers, one client (fio nbd engine): {jobs} job(s), 5s per run, 127.0.0.1",
          f"run of 2026-11-22 03:40 UTC, RUNTIME=5 JOBS={jobs} bench/nbd-compare.sh",
          ["iops", "mean_us", "p99_us"],
          latency(md_table(anchor), lambda r: f"{r['bs']} {r['rw']} QD{r['QD']}",
                  lambda r: r["system"]))

# Architecture v2 (issue 11): the latest A/B, after the resource bounds of issue 13.
rows = []
for r in md_table("After the resource bounds of issue 13"):
    rows.append((r["workload"], "A", r["A IOPS"], r["A CPU us/IO"]))
    rows.append((r["workload"], "B", r["B IOPS"], r["B CPU us/IO"]))
chart("ab-compare-v2",
      "blkwire A/B, medians of 5 rounds x 4s: A = v1 (d06c742), B = v2 with issue 13's bounds (b46110b)",
      "run of 2026-11-23 05:55 UTC, ROUNDS=5 RUNTIME=4 bench/ab-compare.sh",
      ["iops", "cpu_us_per_io"], rows, peers="A")

# Transports (issues 5 and 19): the latest whole run, one job, export written first.
chart("transports-compare",
      "blkwire transports over one veth pair: MTU 9000, 1 job, 3s per run, export written first",
      "run of 2026-11-26 11:21 UTC, FILL=1 RUNTIME=3 bench/transports-compare.sh",
      ["iops", "mean_us", "p99_us"],
      latency(md_table("MTU 9000, 1 job(s), 3s per run, 2026-11-26 11:21 UTC"),
              lambda r: f"{r['workload']} QD{r['QD']}", lambda r: r["transport"]),
      peers="tcp")

# TLS (issue 12 item 4): the medians of the latest run (default spinning).
i = after("$ ROUNDS=3 RUNTIME=5 bench/tls-compare.sh")
while not lines[i].startswith("# medians"):
    i += 1
rows = []
for l in lines[i + 2:]:
    f = l.split()
    if not f or l.startswith("```"):
        break
    kind, frames = f[0].split("-")
    where = {"native": "tcp:// (blkwire bench)", "nbd": "nbd:// (fio nbd engine)"}[kind]
    rows.append((where, frames, f[1], f[2]))
chart("tls-compare",
      "TLS vs plain: 4k randread QD32, 1 connection, 5s per run, 127.0.0.1",
      "medians of 3 rounds as printed, 2026-11-23, ROUNDS=3 RUNTIME=5 bench/tls-compare.sh (default spinning)",
      ["iops", "p99_us"], rows, peers="plain")

# Authenticated datagrams (issue 12): every round of the recorded run; the chart draws medians.
chart("auth-compare",
      "blkwire authentication cost: 4k randread QD32, MTU 9000, 1 job, 5s per run",
      "run of 2026-11-23 08:00 UTC, ROUNDS=3 RUNTIME=5 bench/auth-compare.sh",
      ["iops", "mean_us", "p99_us"],
      latency(md_table("ROUNDS=3 RUNTIME=5 bench/auth-compare.sh"),
              lambda r: r["transport"], lambda r: r["frames"]),
      peers="plain")

# Hostile load (issue 13): the table of the two sittings.
WHICH = {"target RSS before the load": "before",
         "peak RSS during the load (sampled every 100 ms)": "peak",
         "RSS 3 s after the peers left": "after"}
rows = []
table = md_table("Two sittings: before rebasing")
for col in [c for c in table[0] if c]:
    for r in table:
        if r[""] in WHICH:
            budget, sitting = col.split(", ")
            when = {"before": "07:20, 0f5a9e5", "after": "07:30, 1017888"}[sitting]
            rows.append((f"budget {budget} ({when})", WHICH[r[""]], num(r[col])))
chart("hostile-load",
      "target RSS under 30 s of hostile load, legitimate 64 MiB copies alongside (budget = --max-memory; 64G: none in effect)",
      "2026-11-23, before (0f5a9e5) and after (1017888) the rebase on the authentication work, SECONDS_=30 bench/hostile-load.sh",
      ["rss_mib"], rows)

# Control calls under running I/O (issue 14): every round; the chart draws medians.
rows = []
for l in block("Question: do calls on the control socket disturb I/O in flight?"):
    f = l.split()
    if l.startswith("median:"):
        break
    if len(f) == 7 and f[0] in ("quiet", "churn"):
        rows.append(("4k randread QD32", f[0], f[2], f[3], f[4]))
chart("rpc-churn",
      "blkwire bench 4k randread QD32, tcp:// loopback: quiet vs beside control calls, 5s per run",
      "2026-11-23, ROUNDS=5 RUNTIME=5 bench/rpc-churn.sh",
      ["iops", "mean_us", "p99_us"], rows, peers="quiet")

# Server-side copy (issue 15): the latest run (68ddae6).
rows = []
for l in block("script after copies between exports read the source's descriptor"):
    f = l.split()
    if len(f) == 7 and f[0] in ("full", "host") or (f and f[0].endswith("bit")):
        where = {"full": "full link", "host": "on the host"}.get(f[0], f"{f[0]} link")
        rows.append((f"{where}, {f[1]}", f[2], f[4], num(f[6])))
chart("copy-compare",
      "copying 1G between two exports of one target: offloaded COPY vs through the initiator (veth MTU 1500; limited link 1gbit)",
      "second run, at 68ddae6 (2026-11-25), ROUNDS=3 bench/copy-compare.sh",
      ["mib_s", "link_pct"], rows, peers="nbdcopy dd")

# Ceph RBD (issue 18): the latest recorded run (aa12782).
chart("rbd-compare",
      "Ceph RBD: librbd directly (fio rbd) vs blkwire native and NBD, one job, 8s per run, 3 rounds (median), 127.0.0.1",
      "run at aa12782 (2026-11-27 00:12 UTC), bench/rbd-compare.sh",
      ["iops", "mean_us", "p99_us"],
      latency(md_table("at aa12782, 2026-11-27 00:12-00:19 UTC"),
              lambda r: f"{r['bs']} {r['rw']} QD{r['QD']}", lambda r: r["system"]),
      peers="fio-rbd")

# What the kernel charges per raw Ethernet frame on veth (issue 19 item 1): AF_PACKET vs AF_XDP.
chart("frame-cost",
      "raw Ethernet frames over veth (MTU 9000): AF_PACKET (sendmmsg, TX ring) vs AF_XDP, QD 32, 3s runs",
      "run of 2026-11-26 12:40 UTC, ROUNDS=3 RUNTIME=3 bench/frame-cost.sh",
      ["iops", "cpu_us_per_io"],
      [(f"{r['reply bytes']} B", r["mode"], r["replies/s"], r["CPU us per reply"])
       for r in md_table("$ ROUNDS=3 RUNTIME=3 bench/frame-cost.sh        # the defaults")],
      peers="packet-txring xdp-drv xdp-skb")

print(" ".join(charts))
PY
for tsv in docs/charts/*.tsv; do
    bench/chart.sh "$tsv" "${tsv%.tsv}.png"
    echo "$(du -k "${tsv%.tsv}.png" | cut -f1) KiB ${tsv%.tsv}.png"
done
