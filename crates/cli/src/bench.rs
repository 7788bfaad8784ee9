//! `blkwire bench`: fio-style load generator. Each job is one queue on its own thread, keeping
//! `iodepth` requests in flight; latency is measured from submit to completion.

use std::time::{Duration, Instant};

use blkwire_client::{Cmd, ConnectOptions, Queue, QueueStats};
use blkwire_wire::Status;
use serde_json::json;

use crate::hist::Histogram;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Rw {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

#[derive(clap::Args)]
pub struct Args {
    /// The export: tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT, eth://IFACE/MAC/EXPORT
    /// or nvme-tcp://HOST[:PORT]/NQN (any NVMe/TCP target)
    url: String,
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Percentage of reads for randrw [default: 50]
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100))]
    rwmixread: Option<u8>,
    /// Block size of each I/O
    #[arg(long, value_name = "SIZE", default_value = "4k", value_parser = crate::size_arg)]
    bs: u64,
    /// Requests in flight per job
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    iodepth: u16,
    /// Jobs: one queue and one thread each
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    jobs: u16,
    /// Seconds to run
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true)]
    runtime: f64,
    /// Region of the export to use (default: all of it)
    #[arg(long, value_name = "SIZE", value_parser = crate::size_arg)]
    size: Option<u64>,
    /// Microseconds to spin for a reply before sleeping
    #[arg(long, value_name = "US", default_value_t = 50)]
    poll_us: u64,
    /// Seconds an I/O may go unanswered before it fails with EIO
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    timeout: u64,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    id: crate::identity::Identity,
}

struct JobResult {
    hist: Histogram,
    bytes: u64,
    errors: u64,
    first_error: Option<Status>,
    stats: QueueStats,
}

/// xorshift64*: cheap, good enough to spread offsets; no allocation, no crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

pub fn run(a: Args) -> Result<(), String> {
    if a.rwmixread.is_some() && !matches!(a.rw, Rw::Randrw) {
        return Err("--rwmixread mixes reads and writes: it goes with --rw randrw".into());
    }
    // A week at most: longer is a typo, and `Duration` cannot hold every finite f64. At
    // least a millisecond: less would end before the first I/O.
    if !(0.001..=604_800.0).contains(&a.runtime) {
        return Err(format!(
            "--runtime {}: give at least 0.001 and at most 604800 seconds (a week)",
            a.runtime
        ));
    }
    // What no export can take, said before connecting (the export's own block is checked
    // once the session tells it).
    if a.bs == 0 || !a.bs.is_multiple_of(512) {
        return Err(format!(
            "--bs {}: give a multiple of 512 bytes (4k, 64k, 1M)",
            a.bs
        ));
    }
    let mut opts = ConnectOptions {
        queues: a.jobs,
        depth: a.iodepth,
        // At least a page: a target grants no less than the export's block (4 KiB for direct
        // I/O), and --bs is checked against that block below, with a message that says so. No
        // more than --bs otherwise, as the recorded benchmarks ran.
        max_io: a.bs.clamp(4096, u32::MAX as u64) as u32,
        poll: Duration::from_micros(a.poll_us),
        timeout: Duration::from_secs(a.timeout),
        ..Default::default()
    };
    a.id.apply(&mut opts)?;
    let s = crate::open(&a.url, &opts)?;
    let info = s.info.clone();
    // The export's block: I/O in smaller units is refused by the target, each request an error.
    let block = u64::from(info.logical_block.max(512));
    if a.bs == 0 || a.bs > info.max_io as u64 || !a.bs.is_multiple_of(block) {
        return Err(format!(
            "--bs {} must be a multiple of the export's block ({block}) between {block} and the \
             target's max I/O ({})",
            a.bs, info.max_io
        ));
    }
    let writes = matches!(a.rw, Rw::Write | Rw::Randwrite)
        || (matches!(a.rw, Rw::Randrw) && a.rwmixread != Some(100));
    if writes && info.features.has(blkwire_wire::Features::READ_ONLY) {
        return Err(format!(
            "export '{}' is read-only: use --rw read or randread",
            info.name
        ));
    }
    let depth = s
        .queues
        .first()
        .ok_or_else(|| format!("{}: the target granted no queue", a.url))?
        .depth();
    // What runs is what was granted: the results say that, not what was asked.
    let (granted_jobs, iodepth) = (s.queues.len() as u16, depth.min(a.iodepth as usize) as u16);
    if granted_jobs < a.jobs || depth < a.iodepth as usize {
        eprintln!(
            "blkwire: note: target granted {} queue{} x {} deep (asked {} x {})",
            s.queues.len(),
            if s.queues.len() == 1 { "" } else { "s" },
            depth,
            a.jobs,
            a.iodepth
        );
    }
    if let Some(size) = a.size.filter(|s| *s > info.size) {
        return Err(format!(
            "--size {} is larger than the export ({}); leave it out to use the whole export",
            blkwire_backend::format_size(size),
            blkwire_backend::format_size(info.size)
        ));
    }
    let region = a.size.unwrap_or(info.size);
    let blocks = region / a.bs;
    if blocks == 0 {
        let what = match a.size {
            Some(_) => "--size",
            None => "the export",
        };
        return Err(format!(
            "{what} ({}) is smaller than --bs {}",
            blkwire_backend::format_size(region),
            blkwire_backend::format_size(a.bs)
        ));
    }
    let runtime = Duration::from_secs_f64(a.runtime);
    let start = Instant::now();
    let jobs: Vec<_> = s
        .queues
        .into_iter()
        .enumerate()
        .map(|(j, q)| {
            let (rw, bs, mix) = (a.rw, a.bs, a.rwmixread.unwrap_or(50));
            let njobs = u64::from(granted_jobs);
            std::thread::spawn(move || job(q, j as u64, njobs, rw, mix, bs, blocks, start, runtime))
        })
        .collect();
    let mut total = JobResult {
        hist: Histogram::default(),
        bytes: 0,
        errors: 0,
        first_error: None,
        stats: QueueStats::default(),
    };
    let mut per_queue = Vec::new();
    for h in jobs {
        let r = h.join().map_err(|_| "a bench job panicked".to_string())??;
        total.hist.merge(&r.hist);
        total.bytes += r.bytes;
        total.errors += r.errors;
        total.first_error = total.first_error.or(r.first_error);
        per_queue.push(r.stats);
    }
    let secs = start.elapsed().as_secs_f64();
    let ops = total.hist.count();
    let iops = ops as f64 / secs;
    let bw = total.bytes as f64 / secs;
    let us = |ns: f64| (ns / 100.0).round() / 10.0;
    if a.json {
        let queues: Vec<_> = per_queue
            .iter()
            .map(|q| {
                json!({
                    "frames_out": q.frames_out, "frames_in": q.frames_in, "late_replies": q.late_replies,
                    "errors": q.errors, "retransmits": q.retransmits, "crc_errors": q.crc_errors, "bad_seals": q.bad_seals,
                    "duplicates": q.duplicates, "timeouts": q.timeouts, "rto_us": q.rto_us, "window": q.window,
                    "datagrams_out": q.datagrams_out, "datagrams_in": q.datagrams_in, "probes": q.probes,
                    "segmented_out": q.segmented_out, "coalesced_in": q.coalesced_in,
                    "fragments_in_place": q.fragments_in_place,
                })
            })
            .collect();
        println!(
            "{}",
            json!({
                "url": a.url, "rw": format!("{:?}", a.rw).to_lowercase(), "bs": a.bs,
                "iodepth": iodepth, "jobs": granted_jobs, "runtime_s": secs,
                "ops": ops, "iops": iops.round(), "bandwidth_bytes": bw.round(), "errors": total.errors,
                "latency_us": {
                    "mean": us(total.hist.mean()),
                    "p50": us(total.hist.quantile(0.5) as f64),
                    "p99": us(total.hist.quantile(0.99) as f64),
                    "p999": us(total.hist.quantile(0.999) as f64),
                    "max": us(total.hist.max() as f64),
                },
                "queues": queues,
            })
        );
    } else {
        println!(
            "{} bs={} iodepth={} jobs={}: {:.0} IOPS, {:.1} MiB/s, {} ops in {:.1}s, {} errors",
            clap::ValueEnum::to_possible_value(&a.rw)
                .map_or_else(String::new, |v| v.get_name().to_string()),
            blkwire_backend::format_size(a.bs),
            iodepth,
            granted_jobs,
            iops,
            bw / 1048576.0,
            ops,
            secs,
            total.errors
        );
        println!(
            "latency (us): mean {:.1}  p50 {:.1}  p99 {:.1}  p99.9 {:.1}",
            us(total.hist.mean()),
            us(total.hist.quantile(0.5) as f64),
            us(total.hist.quantile(0.99) as f64),
            us(total.hist.quantile(0.999) as f64)
        );
    }
    match total.first_error {
        Some(st) => Err(format!("{} I/O errors, first: {st}", total.errors)),
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn job(
    mut q: Queue,
    j: u64,
    njobs: u64,
    rw: Rw,
    mix: u8,
    bs: u64,
    blocks: u64,
    start: Instant,
    runtime: Duration,
) -> Result<JobResult, String> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (j + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let data: Vec<u8> = (0..bs).map(|_| rng.next() as u8).collect();
    // Sequential jobs each walk their own slice of the region.
    let mut seq = blocks * j / njobs;
    let mut r = JobResult {
        hist: Histogram::default(),
        bytes: 0,
        errors: 0,
        first_error: None,
        stats: QueueStats::default(),
    };
    let depth = q.depth();
    let err = |e: blkwire_client::Error| e.to_string();
    loop {
        let now = start.elapsed();
        // Like fio, a job stops at its first I/O error (and reports it).
        let running = now < runtime && r.first_error.is_none();
        while running && q.in_flight() < depth {
            let (random, read) = match rw {
                Rw::Read => (false, true),
                Rw::Write => (false, false),
                Rw::Randread => (true, true),
                Rw::Randwrite => (true, false),
                Rw::Randrw => (true, rng.next() % 100 < mix as u64),
            };
            let block = if random {
                rng.next() % blocks
            } else {
                seq = (seq + 1) % blocks;
                seq
            };
            let offset = block * bs;
            let cmd = if read {
                Cmd::Read {
                    offset,
                    len: bs as u32,
                }
            } else {
                Cmd::Write {
                    offset,
                    data: &data,
                    fua: false,
                }
            };
            q.submit(cmd, start.elapsed().as_nanos() as u64)
                .map_err(err)?;
        }
        if q.in_flight() == 0 {
            break;
        }
        q.complete(1, |c| {
            let lat = (start.elapsed().as_nanos() as u64).saturating_sub(c.user);
            if c.status == blkwire_wire::Status::Ok {
                r.hist.record(lat);
                r.bytes += bs;
            } else {
                r.errors += 1;
                r.first_error.get_or_insert(c.status);
            }
        })
        .map_err(err)?;
    }
    r.stats = q.stats();
    let _ = q.logout();
    Ok(r)
}
