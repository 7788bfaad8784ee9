//! `blkwire cp SRC DST`: either side a local file/block device or an export URL. Several workers,
//! each with its own queue (or file handle), copy chunks of the largest I/O size in parallel.
//! Between two exports of one target the target copies itself (server-side COPY, PROTOCOL.md
//! §13) and no data crosses the network, unless `--no-offload`.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkwire_client::{ConnectOptions, CopyRange, Queue, Url};
use blkwire_wire::Features;

#[derive(clap::Args)]
pub struct Args {
    /// Source: a local path or an export URL (tcp://HOST[:PORT]/EXPORT, udp://..., eth://...,
    /// nvme-tcp://HOST[:PORT]/NQN)
    src: String,
    /// Destination: a local path or an export URL (tcp://, udp://, eth://, nvme-tcp://). An existing file
    /// or disk is overwritten in place (a file then ends where the source does); a new file
    /// appears under its name only once the copy is complete
    dst: String,
    /// Parallel workers (one queue each)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    jobs: u16,
    /// Never show a progress bar
    #[arg(long)]
    no_progress: bool,
    /// Seconds an I/O may go unanswered before the copy fails
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    timeout: u64,
    /// Between two exports of one target, move every byte through this host instead of letting
    /// the target copy (for comparison; by default the target copies, and nothing crosses the
    /// network)
    #[arg(long)]
    no_offload: bool,
    #[command(flatten)]
    id: crate::identity::Identity,
}

/// Bytes one worker asks the target to copy at a time: large enough that a COPY's round trip
/// is nothing beside it, small enough for a smooth progress bar.
const OFFLOAD_CHUNK: u64 = 64 << 20;

/// One side of the copy, as seen by one worker.
enum End {
    Local(Arc<File>),
    Remote(Queue),
}

struct Side {
    size: u64,
    /// Unwritten ranges already read as zero: zero chunks can be skipped.
    zeroed: bool,
    /// Zeroing a range is cheap (no data sent).
    cheap_zero: bool,
    chunk: u64,
    /// The unit it takes writes in (an export's block; 1 for a local file).
    block: u64,
    ends: Vec<End>,
    label: String,
    /// A new local file is written under a name of its own and takes the given name only
    /// once complete and synced (`Staged::commit`).
    staged: Option<Staged>,
    /// A local file (not a device): its length becomes the source's once the copy is done.
    fit: bool,
}

/// A new file copied into: `tmp` beside `path`, renamed to it once the copy is complete and
/// durable, removed if it never is (dropped uncommitted), so a copy that fails half-way
/// leaves no file that looks whole under the name asked for.
struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    done: bool,
}

/// The temporary file a copy is writing (`Staged::tmp`), for the signal thread to remove
/// (`watch_signals`). Locked across the rename that makes it the destination, so the thread
/// never removes what has become the file asked for.
static STAGED: Mutex<Option<PathBuf>> = Mutex::new(None);

fn staged_now() -> std::sync::MutexGuard<'static, Option<PathBuf>> {
    STAGED.lock().unwrap_or_else(|p| p.into_inner())
}

impl Staged {
    /// Creates `tmp`, to become `path`, and tells the signal handler at once: both under its
    /// lock, so a signal finds either no file made or one it removes (Ctrl-C just after it was
    /// made left it behind, as large as the source).
    fn create(tmp: PathBuf, path: PathBuf) -> std::io::Result<(File, Staged)> {
        let mut staged = staged_now();
        let f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        *staged = Some(tmp.clone());
        Ok((
            f,
            Staged {
                tmp,
                path,
                done: false,
            },
        ))
    }

    fn commit(mut self) -> Result<(), String> {
        {
            let mut staged = staged_now();
            std::fs::rename(&self.tmp, &self.path)
                .map_err(|e| format!("{}: {e}", self.path.display()))?;
            *staged = None;
        }
        self.done = true;
        // The new name is durable with its directory.
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            let mut staged = staged_now();
            let _ = std::fs::remove_file(&self.tmp);
            *staged = None;
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP end the copy at once, as they would by default (the process
/// dies of the signal, so a shell loop around it stops too), with a line saying what is left:
/// a new file being written (a hidden temporary as large as the source, `Staged`) is removed
/// first, so a copy stopped with Ctrl-C leaves nothing behind. Called before any thread
/// starts, so that every thread has the signals blocked and only this one takes them (cp
/// starts no other program, which would inherit the blocked signals).
fn watch_signals(dst: String) {
    // SAFETY: building a signal set and blocking it for this thread (and the threads it
    // starts), before any other thread exists.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: waiting for the signals blocked above.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            return;
        }
        // Held until exit: a commit cannot rename the file meanwhile.
        let mut staged = staged_now();
        let left = match staged.take() {
            Some(tmp) => {
                let _ = std::fs::remove_file(&tmp);
                "was not created"
            }
            None => "may hold part of the copy",
        };
        eprintln!("blkwire: error: interrupted: {dst} {left}");
        // SAFETY: restoring the default action and raising the signal on this thread, which
        // then has it unblocked: the process ends as if it had never been caught.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            let mut one: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut one);
            libc::sigaddset(&mut one, sig);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
            libc::raise(sig);
        }
        std::process::exit(128 + sig);
    });
}

fn open_side(
    spec: &str,
    jobs: u16,
    dest_size: Option<u64>,
    timeout: u64,
    id: &crate::identity::Identity,
) -> Result<Side, String> {
    if Url::is_url(spec) {
        let s = crate::open(spec, &options(jobs, timeout, id)?)?;
        if dest_size.is_some() && s.info.features.has(Features::READ_ONLY) {
            return Err(format!("{spec}: export is read-only"));
        }
        let f = s.info.features;
        return Ok(Side {
            size: s.info.size,
            zeroed: f.has(Features::INIT_ZERO),
            cheap_zero: f.has(Features::WRITE_ZEROES),
            chunk: s.info.max_io as u64,
            block: u64::from(s.info.logical_block.max(1)),
            label: spec.to_string(),
            ends: s.queues.into_iter().map(End::Remote).collect(),
            staged: None,
            fit: false,
        });
    }
    let mut staged = None;
    let (file, size, zeroed, fit) = match dest_size {
        None => {
            // Looked at before it is opened: opening a FIFO would wait for a writer, and a
            // pipe or a character device has no size to copy (/dev/zero would copy nothing).
            let meta = std::fs::metadata(spec).map_err(|e| format!("{spec}: {e}"))?;
            if meta.is_dir() {
                return Err(format!("{spec}: is a directory"));
            }
            if !meta.is_file() && !meta.file_type().is_block_device() {
                return Err(format!(
                    "{spec}: not a regular file or block device: copy from a file or a disk"
                ));
            }
            let mut f = File::open(spec).map_err(|e| format!("{spec}: {e}"))?;
            let size = f
                .seek(SeekFrom::End(0))
                .map_err(|e| format!("{spec}: {e}"))?;
            (f, size, false, false)
        }
        Some(want) => {
            let existing = std::fs::metadata(spec).ok();
            if existing.as_ref().is_some_and(|m| m.is_dir()) {
                return Err(format!("{spec}: is a directory"));
            }
            let is_dev = existing
                .as_ref()
                .is_some_and(|m| m.file_type().is_block_device());
            // Anything else (a character device, a FIFO) is no file to copy an export into.
            if existing.as_ref().is_some_and(|m| !is_dev && !m.is_file()) {
                return Err(format!(
                    "{spec}: not a regular file or block device: copy into a file or a disk"
                ));
            }
            if existing.is_none() && std::fs::symlink_metadata(spec).is_ok() {
                return Err(format!(
                    "{spec}: a symbolic link to nothing: give the path of the file it should name"
                ));
            }
            if existing.is_some() {
                // A disk, or an existing file, is rewritten in place, through the name given
                // (a symbolic link, a file's mode, owner and other names kept), and not cut
                // first: a copy that fails half-way, or one from the export that serves this
                // very file, would then have lost what it held. Its old bytes mean chunks of
                // zeros are written too; a file's length becomes the source's once the copy is
                // done (`fit`).
                let mut f = OpenOptions::new()
                    .write(true)
                    .open(spec)
                    .map_err(|e| format!("{spec}: {e}"))?;
                let size = if is_dev {
                    f.seek(SeekFrom::End(0))
                        .map_err(|e| format!("{spec}: {e}"))?
                } else {
                    want
                };
                (f, size, false, !is_dev)
            } else {
                // A new file: a sparse one beside the name given (chunks of zeros need not be
                // written at all), which takes the name once complete.
                let path = PathBuf::from(spec);
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
                let name = name.ok_or_else(|| format!("{spec}: names no file"))?;
                let tmp = path.with_file_name(format!(".{name}.blkwire-cp.{}", std::process::id()));
                let shown = tmp.display().to_string();
                let (f, s) = Staged::create(tmp, path)
                    .map_err(|e| format!("{spec}: {e} (creating {shown})"))?;
                f.set_len(want).map_err(|e| format!("{spec}: {e}"))?;
                staged = Some(s);
                (f, want, true, true)
            }
        }
    };
    let file = Arc::new(file);
    Ok(Side {
        size,
        zeroed,
        cheap_zero: false,
        chunk: 1 << 20,
        block: 1,
        label: spec.to_string(),
        ends: (0..jobs).map(|_| End::Local(file.clone())).collect(),
        fit,
        staged,
    })
}

/// Both sides exports of the same target (same transport, same address), so the target can
/// copy by itself.
fn same_target(src: &str, dst: &str) -> Option<(Url, Url)> {
    let (s, d) = (Url::parse(src).ok()?, Url::parse(dst).ok()?);
    let same = s.transport == d.transport && s.authority() == d.authority();
    same.then_some((s, d))
}

pub fn run(a: Args) -> Result<(), String> {
    if !Url::is_url(&a.src) && !Url::is_url(&a.dst) {
        return Err("neither side is a URL: use cp(1) for local copies".into());
    }
    if a.src == "-" || a.dst == "-" {
        return Err(
            "'-': cp copies between files, block devices and exports, not standard input or \
             output (a copy needs a size to go by): give a file name"
                .into(),
        );
    }
    watch_signals(a.dst.clone());
    if let Some((s, d)) = same_target(&a.src, &a.dst) {
        // Through this host too: reading it and writing it back would undo newer writes of
        // whoever else uses it meanwhile.
        if s.export == d.export {
            return Err(format!(
                "{} and {} are the same export: nothing to copy",
                a.src, a.dst
            ));
        }
        if !a.no_offload && offload(&a, &s.export)? {
            return Ok(());
        }
    }
    let src = open_side(&a.src, a.jobs, None, a.timeout, &a.id)?;
    let dst = open_side(&a.dst, a.jobs, Some(src.size), a.timeout, &a.id)?;
    if dst.size < src.size {
        return Err(format!(
            "{} ({} bytes) is smaller than {} ({} bytes): nothing was copied",
            dst.label, dst.size, src.label, src.size
        ));
    }
    if !src.size.is_multiple_of(dst.block) {
        // Found before anything is written: the last chunk would be refused after the rest
        // had overwritten the export.
        return Err(format!(
            "{} is {} bytes, not a multiple of {}'s block ({} bytes): nothing was copied (pad \
             the source to a multiple of {} bytes)",
            src.label, src.size, dst.label, dst.block, dst.block
        ));
    }
    let size = src.size;
    // Chunks start on both sides' blocks (powers of two: the larger holds the smaller).
    let block = src.block.max(dst.block);
    let chunk = (src.chunk.min(dst.chunk) / block * block).max(block);
    let start = Instant::now();
    let (skip_zero, cheap_zero) = (dst.zeroed, dst.cheap_zero);
    let pairs: Vec<(End, End, Vec<u8>)> = src
        .ends
        .into_iter()
        .zip(dst.ends)
        .map(|(s, d)| (s, d, vec![0u8; chunk as usize]))
        .collect();
    let labels = (&src.label, &dst.label);
    let pairs = run_workers(pairs, size, chunk, !a.no_progress, |(s, d, buf), off, n| {
        copy_chunk(
            s,
            d,
            &mut buf[..n as usize],
            off,
            skip_zero,
            cheap_zero,
            labels,
        )
    })?;
    let mut dests: Vec<End> = pairs.into_iter().map(|(_, d, _)| d).collect();
    // Durability: one FLUSH covers every write already answered on any queue (PROTOCOL.md §10).
    match dests.first_mut() {
        Some(End::Remote(q)) => q.flush().map_err(|e| format!("{}: {e}", a.dst))?,
        Some(End::Local(f)) => {
            if dst.fit {
                f.set_len(size).map_err(|e| format!("{}: {e}", a.dst))?;
            }
            f.sync_all().map_err(|e| format!("{}: {e}", a.dst))?
        }
        None => {}
    }
    if let Some(s) = dst.staged {
        s.commit()?;
    }
    for d in dests {
        if let End::Remote(q) = d {
            let _ = q.logout();
        }
    }
    report(size, start, "");
    Ok(())
}

/// How every side of a copy connects: `queues` queues (one per worker), 4 deep.
fn options(
    queues: u16,
    timeout: u64,
    id: &crate::identity::Identity,
) -> Result<ConnectOptions, String> {
    let mut opts = ConnectOptions {
        queues,
        depth: 4,
        max_io: 1 << 20,
        timeout: Duration::from_secs(timeout),
        ..Default::default()
    };
    id.apply(&mut opts)?;
    Ok(opts)
}

/// Connects to `spec` with `queues` queues, for a server-side copy.
fn connect(spec: &str, queues: u16, a: &Args) -> Result<blkwire_client::Session, String> {
    crate::open(spec, &options(queues, a.timeout, &a.id)?)
}

/// `cp` between two exports of one target: each worker asks the target to copy a chunk at a
/// time on its own queue of the destination's session (PROTOCOL.md §13). False, with nothing
/// copied, when the target does not copy for this session (an NVMe/TCP one, or COPY limits
/// too small): the caller copies through this host.
fn offload(a: &Args, src_export: &str) -> Result<bool, String> {
    // The source's size, and proof this host may open it (the target checks again per COPY).
    let src = connect(&a.src, 1, a)?;
    let (size, src_block) = (src.info.size, src.info.logical_block);
    for q in src.queues {
        let _ = q.logout();
    }
    let dst = connect(&a.dst, a.jobs, a)?;
    if dst.info.features.has(Features::READ_ONLY) {
        return Err(format!("{}: export is read-only", a.dst));
    }
    // The target checks each COPY by itself: a last chunk off either side's blocks would be
    // refused after the others had overwritten the destination.
    let block = u64::from(src_block.max(dst.info.logical_block).max(1));
    if !size.is_multiple_of(block) {
        return Err(format!(
            "{} is {size} bytes, not a multiple of the blocks of both exports ({block} bytes): \
             nothing was copied",
            a.src
        ));
    }
    if dst.info.size < size {
        return Err(format!(
            "{} ({} bytes) is smaller than {} ({} bytes): nothing was copied",
            a.dst, dst.info.size, a.src, size
        ));
    }
    if !dst.info.copy.enabled() {
        eprintln!(
            "blkwire: note: the target does not copy for {} (no COPY, or limits too small to \
             use): copying through this host",
            a.dst
        );
        for q in dst.queues {
            let _ = q.logout();
        }
        return Ok(false);
    }
    let start = Instant::now();
    let source = src_export.to_string();
    let mut queues = run_workers(
        dst.queues,
        size,
        OFFLOAD_CHUNK,
        !a.no_progress,
        |q, off, len| {
            let range = CopyRange {
                offset: off,
                len: len as u32,
            };
            q.copy(&source, &[range], off).map_err(|e| {
                let hint = match e {
                    blkwire_client::Error::Copy {
                        status: blkwire_wire::Status::Unsupported,
                        ..
                    } => " (the target cannot copy from this source: use --no-offload)",
                    _ => "",
                };
                format!("{}: copy at {off}: {e}{hint}", a.dst)
            })
        },
    )?;
    if let Some(q) = queues.first_mut() {
        q.flush().map_err(|e| format!("{}: {e}", a.dst))?;
    }
    for q in queues {
        let _ = q.logout();
    }
    report(size, start, ", inside the target");
    Ok(true)
}

/// The line a finished copy prints: what, how long, how fast.
fn report(size: u64, start: Instant, how: &str) {
    let secs = start.elapsed().as_secs_f64();
    // The copy is done: a closed or full stdout must not turn it into a failure.
    let _ = writeln!(
        std::io::stdout(),
        "copied {} ({size} bytes) in {secs:.2}s, {:.1} MiB/s{how}",
        blkwire_backend::format_size(size),
        size as f64 / secs.max(1e-9) / 1048576.0
    );
}

/// Runs one worker thread per `ends` entry (a queue, a file handle, a pair of them), each
/// taking the next `chunk` of `0..size` until none is left and calling `work(end, offset,
/// length)` on it, with a progress bar on a terminal unless `progress` is false. The first
/// error stops every worker and is returned; otherwise the ends come back, in order.
fn run_workers<E: Send>(
    ends: Vec<E>,
    size: u64,
    chunk: u64,
    progress: bool,
    work: impl Fn(&mut E, u64, u64) -> Result<(), String> + Sync,
) -> Result<Vec<E>, String> {
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<String>> = Mutex::default();
    let bar = if progress && std::io::stderr().is_terminal() {
        progress_bar(size)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let ends = std::thread::scope(|scope| {
        let workers: Vec<_> = ends
            .into_iter()
            .map(|mut end| {
                let (next, done, stop, first_err, work) = (&next, &done, &stop, &first_err, &work);
                scope.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let off = next.fetch_add(chunk, Ordering::Relaxed);
                        if off >= size {
                            break;
                        }
                        let n = chunk.min(size - off);
                        if let Err(e) = work(&mut end, off, n) {
                            first_err
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(e);
                            stop.store(true, Ordering::Relaxed);
                            break;
                        }
                        done.fetch_add(n, Ordering::Relaxed);
                    }
                    end
                })
            })
            .collect();
        while workers.iter().any(|w| !w.is_finished()) {
            bar.set_position(done.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
        workers
            .into_iter()
            .map(|w| w.join().map_err(|_| "a copy worker panicked".to_string()))
            .collect::<Result<Vec<E>, String>>()
    });
    bar.finish_and_clear();
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => ends,
    }
}

/// Copies one chunk; an error names the side (`labels`: source, destination) and the offset.
fn copy_chunk(
    s: &mut End,
    d: &mut End,
    buf: &mut [u8],
    off: u64,
    skip_zero: bool,
    cheap_zero: bool,
    (from, to): (&String, &String),
) -> Result<(), String> {
    let read = match s {
        End::Local(f) => f.read_exact_at(buf, off).map_err(|e| e.to_string()),
        End::Remote(q) => q.read_at(buf, off).map_err(|e| e.to_string()),
    };
    read.map_err(|e| format!("{from}: read at {off}: {e}"))?;
    let zero = buf.iter().all(|b| *b == 0);
    if zero && skip_zero {
        return Ok(());
    }
    let wrote = match d {
        End::Local(f) => f.write_all_at(buf, off).map_err(|e| e.to_string()),
        End::Remote(q) if zero && cheap_zero => q
            .write_zeroes(off, buf.len() as u64, false)
            .map_err(|e| e.to_string()),
        End::Remote(q) => q.write_at(buf, off, false).map_err(|e| e.to_string()),
    };
    wrote.map_err(|e| format!("{to}: write at {off}: {e}"))
}

/// The progress bar on stderr: indicatif fits it to the terminal's width (the hand-written one
/// wrapped, and repeated itself, on narrow terminals) and adds the time left.
fn progress_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "[{wide_bar}] {percent:>3}% {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
    ) {
        bar.set_style(style.progress_chars("#>-"));
    }
    bar
}
