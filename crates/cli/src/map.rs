//! `blkwire map`, `unmap` and `ls`: exports as local block devices. The work is in
//! crates/map; this is argument parsing and output.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use blkwire_map::{DeviceKind, FuseIo, MapOptions};
use serde_json::json;

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum FrontendArg {
    Auto,
    Ublk,
    Fuse,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum FuseIoArg {
    Auto,
    Uring,
    Read,
}

#[derive(clap::Args)]
pub struct MapArgs {
    // Not `required_unless_present`: clap's message for that spans two lines; `run_map` says it
    // in one.
    /// The export to map: tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT or
    /// eth://IFACE/MAC/EXPORT
    #[arg(conflicts_with = "recover")]
    url: Option<String>,
    /// Serve DEV again after the daemon serving it died; the other settings come from its record
    /// (ublk: any mapping, with its filesystem mounted; fuse: read-only mappings only)
    #[arg(long, value_name = "DEV")]
    recover: Option<String>,
    /// Map read-only: the device refuses writes
    #[arg(long, conflicts_with = "recover")]
    readonly: bool,
    /// auto: ublk when /dev/ublk-control exists (modprobe ublk_drv), else fuse
    #[arg(long, value_enum, default_value = "auto", conflicts_with = "recover")]
    frontend: FrontendArg,
    /// fuse frontend: how requests travel between the kernel and the daemon. uring: FUSE over
    /// io_uring (Linux >= 6.14), turning on the kernel's system-wide switch
    /// /sys/module/fuse/parameters/enable_uring if it is off; read: read/write on /dev/fuse;
    /// auto: uring when that switch is already on, else read (`ls` shows which)
    #[arg(long, value_enum, default_value = "auto", conflicts_with = "recover")]
    fuse_io: FuseIoArg,
    /// Requests in flight per queue
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u16).range(1..=4096), conflicts_with = "recover")]
    queue_depth: u16,
    /// Queues, each one thread and one connection (default: one per CPU, at most 8; ublk takes at
    /// most one per CPU)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64), conflicts_with = "recover")]
    queues: Option<u16>,
    /// Largest I/O per request, 4K to 32M (ublk caps it at 1M; FUSE too unless fs.fuse.max_pages_limit is raised)
    #[arg(long = "max-io", alias = "max-io-size", value_name = "SIZE", default_value = "1M", value_parser = crate::size_arg, conflicts_with = "recover")]
    max_io_size: u64,
    /// Mark the device rotational (also set when the export says it is)
    #[arg(long, conflicts_with = "recover")]
    hdd: bool,
    /// Use /dev/ublkbN (ublk) or /dev/loopN (fuse) instead of the first free one (0 to 1048575)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..1 << 20), conflicts_with = "recover")]
    dev_num: Option<u32>,
    /// Serve in this process until unmapped or interrupted, instead of detaching once ready
    #[arg(long)]
    foreground: bool,
    /// Where the daemon logs (default: nowhere once detached; stderr with --foreground)
    #[arg(long, value_name = "FILE")]
    logfile: Option<PathBuf>,
    /// Seconds I/O waits for an unreachable target before failing with EIO; a write the
    /// target may still be running then waits up to as long again, until the target confirms it
    /// will not land later (not over nvme-tcp://)
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400), conflicts_with = "recover")]
    timeout: u64,
    #[command(flatten)]
    id: crate::identity::Identity,
}

#[derive(clap::Args)]
pub struct UnmapArgs {
    /// The mapped device, e.g. /dev/ublkb0 or /dev/loop3
    dev: String,
}

#[derive(clap::Args)]
pub struct LsArgs {
    /// Print one JSON object keyed by device
    #[arg(long)]
    json: bool,
}

fn print_device(dev: &str) {
    // Scripts wait for this line: flush at once, the daemon keeps running after it.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{dev}");
    let _ = out.flush();
}

pub fn run_map(mut a: MapArgs) -> Result<(), String> {
    // Recorded for `map --recover`, which may run from another directory.
    if let Some(l) = &a.logfile {
        a.logfile = Some(std::path::absolute(l).map_err(|e| format!("--logfile: {e}"))?);
    }
    if let Some(dev) = &a.recover {
        // The daemon that died proved its identity with what its record holds; another here
        // would be ignored, so it is refused rather than silently dropped.
        let given = a.id.options_given();
        if !given.is_empty() {
            return Err(format!(
                "--recover serves the mapping with the host id, key, encryption and TLS \
                 settings of its record; drop {}",
                given.join(", ")
            ));
        }
        return blkwire_map::recover(dev, a.foreground, a.logfile, &mut print_device);
    }
    let kind = match a.frontend {
        FrontendArg::Auto => DeviceKind::Auto,
        FrontendArg::Ublk => DeviceKind::Ublk,
        FrontendArg::Fuse => DeviceKind::Fuse,
    };
    let chosen = blkwire_map::choose_kind(kind)?;
    if chosen == DeviceKind::Ublk && !matches!(a.fuse_io, FuseIoArg::Auto) {
        return Err(format!(
            "--fuse-io is for the fuse frontend, and this mapping is ublk{}; drop it, or add \
             --frontend fuse",
            if kind == DeviceKind::Auto {
                " (--frontend auto found /dev/ublk-control)"
            } else {
                ""
            }
        ));
    }
    let max_io = u32::try_from(a.max_io_size)
        .ok()
        .filter(|m| (4096..=blkwire_wire::MAX_PAYLOAD_LIMIT).contains(m))
        .ok_or_else(|| {
            format!(
                "--max-io must be between 4K and {}",
                blkwire_backend::format_size(blkwire_wire::MAX_PAYLOAD_LIMIT as u64)
            )
        })?;
    let url = a
        .url
        .ok_or("map needs the URL of an export, tcp://HOST:PORT/EXPORT (or --recover DEV)")?;
    let o = MapOptions {
        url,
        readonly: a.readonly,
        queues: a.queues.unwrap_or(0),
        queue_depth: a.queue_depth,
        max_io,
        hdd: a.hdd,
        dev_num: a.dev_num,
        foreground: a.foreground,
        logfile: a.logfile,
        timeout: Duration::from_secs(a.timeout),
        kind,
        fuse_io: match a.fuse_io {
            FuseIoArg::Auto => FuseIo::Auto,
            FuseIoArg::Uring => FuseIo::Uring,
            FuseIoArg::Read => FuseIo::Read,
        },
        credentials: a.id.credentials(),
    };
    blkwire_map::map(&o, &mut print_device)
}

pub fn run_unmap(a: UnmapArgs) -> Result<(), String> {
    blkwire_map::unmap(&a.dev)
}

pub fn run_ls(a: LsArgs) -> Result<(), String> {
    let mut first_error = None;
    let mut all = serde_json::Map::new();
    let mut text = String::new();
    for item in blkwire_map::list() {
        let (r, state) = match item {
            Ok(x) => x,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        let mut v = json!({
            "url": r.url, "export": r.export, "frontend": r.frontend, "pid": r.pid,
            "state": state.as_str(), "readonly": r.readonly, "size": r.size,
            "queues": r.queues, "queue_depth": r.queue_depth, "file": r.file,
        });
        if let Some(io) = &r.fuse_io {
            v["fuse_io"] = json!(io);
        }
        all.insert(r.device.clone(), v);
        text.push_str(&format!(
            "{}\n  url:       {}\n  export:    {}\n  frontend:  {}\n  pid:       {}\n  state:     {}\n  readonly:  {}\n  size:      {}\n",
            r.device,
            r.url,
            r.export,
            r.frontend,
            r.pid,
            state.as_str(),
            if r.readonly { "yes" } else { "no" },
            blkwire_backend::format_size(r.size)
        ));
        if let Some(io) = &r.fuse_io {
            text.push_str(&format!("  fuse io:   {io}\n"));
        }
    }
    if a.json {
        println!("{}", serde_json::Value::Object(all));
    } else if text.is_empty() && first_error.is_none() {
        // Said on stderr: stdout stays empty for scripts that count lines.
        eprintln!("no mapped devices (blkwire map URL makes one)");
    } else {
        print!("{text}");
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
