//! The map daemon's life: connect, mount the FUSE filesystem, answer INIT, start one worker per
//! queue, bind the file to a loop device, report readiness, then wait for the end of the mapping
//! and clean up after it.
//!
//! Setup is undone step by step on any error (`Undo`), so a failed `map` leaves no mount, loop
//! device or record behind. A mapping ends when the loop device releases the file (`unmap`,
//! `losetup -d`, or our own detach on SIGTERM): the daemon then unmounts, waits for its workers
//! to flush and log out, removes its record and exits.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use blkwire_client::{ConnectOptions, ExportInfo, Url};
use blkwire_wire::Features;

use crate::fuse::{self, Attr, Channel, Negotiated, Request, FILE_ID, ROOT_ID};
use crate::fuse_uring::{self, Ring, Switch, SWITCH};
use crate::loopdev::{Detach, LoopDev};
use crate::state::{self, Record};
use crate::sys;
use crate::worker::{Event, Shared, Waker, Worker};
use crate::{log, Frontend, FuseIo, FRONTEND_FUSE, FRONTEND_UBLK, FUSE_IO_READ, FUSE_IO_URING};

/// How long the kernel may take to queue INIT after mount(2) (it does so during the call).
const INIT_WAIT_MS: i32 = 10_000;
/// Attempts at binding a free loop device that another program takes first.
const BIND_ATTEMPTS: u32 = 16;
/// How long the workers may take to register their FUSE ring entries (the kernel answers each
/// REGISTER during its submission).
const REGISTER_WAIT: Duration = Duration::from_secs(10);

/// Everything `blkwire map` was asked for.
#[derive(Clone, Debug)]
pub struct MapOptions {
    pub url: String,
    pub readonly: bool,
    /// Queues (worker threads); 0: one per CPU, at most 8.
    pub queues: u16,
    pub queue_depth: u16,
    pub max_io: u32,
    pub hdd: bool,
    pub dev_num: Option<u32>,
    pub foreground: bool,
    pub logfile: Option<PathBuf>,
    /// How long I/O waits for an unreachable target before failing with EIO.
    pub timeout: Duration,
    pub frontend: Frontend,
    /// fuse frontend: FUSE over io_uring or read/writev on /dev/fuse.
    pub fuse_io: FuseIo,
}

pub(crate) enum Mode {
    New {
        dev_num: Option<u32>,
    },
    /// Re-serve the read-only device of this record, whose daemon died.
    Recover(Box<Record>),
}

pub(crate) struct Spec {
    pub url: Url,
    pub readonly: bool,
    pub queues: u16,
    pub depth: u16,
    pub max_io: u32,
    pub hdd: bool,
    pub timeout: Duration,
    pub logfile: Option<String>,
    pub mode: Mode,
    /// FRONTEND_FUSE or FRONTEND_UBLK
    pub frontend: &'static str,
    pub fuse_io: FuseIo,
}

pub(crate) fn preflight() -> Result<(), String> {
    if !sys::is_root() {
        return Err(
            "mapping needs root: it mounts a FUSE filesystem and configures a loop device".into(),
        );
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse is missing: load the fuse module (modprobe fuse)".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("/dev/loop-control is missing: load the loop module (modprobe loop)".into());
    }
    Ok(())
}

/// Maps an export. Without `foreground`, forks a daemon and returns once the device is usable,
/// after calling `on_ready` with its path; with it, calls `on_ready` and serves until the
/// mapping ends.
pub fn map(o: &MapOptions, on_ready: &mut dyn FnMut(&str)) -> Result<(), String> {
    let url = Url::parse(&o.url).map_err(|e| e.to_string())?;
    if url.export.is_empty() {
        return Err(format!(
            "'{}' names no export: use tcp://HOST:PORT/EXPORT (`blkwire info tcp://HOST:PORT` lists them)",
            o.url
        ));
    }
    let frontend = crate::choose_frontend(o.frontend)?;
    if frontend == FRONTEND_UBLK && o.fuse_io == FuseIo::Uring {
        return Err(
            "--fuse-io uring applies to the fuse frontend; this mapping would use ublk (add --frontend fuse)"
                .into(),
        );
    }
    if frontend == FRONTEND_UBLK {
        crate::ublk::preflight()?;
    } else {
        preflight()?;
    }
    let queues = if o.queues == 0 {
        // One per CPU, as blk-mq does. Measured on 2 CPUs (docs/BENCHMARKS.md): 1M writes run
        // ~35% faster with two queues than with one (one connection is one target reactor);
        // 4k IOPS and QD1 latency showed no consistent difference.
        std::thread::available_parallelism()
            .map(|n| n.get().clamp(1, 8) as u16)
            .unwrap_or(1)
    } else {
        o.queues
    };
    let spec = Spec {
        url,
        readonly: o.readonly,
        queues,
        depth: o.queue_depth.max(1),
        max_io: o.max_io,
        hdd: o.hdd,
        timeout: o.timeout,
        logfile: o.logfile.as_ref().map(|p| p.display().to_string()),
        mode: Mode::New { dev_num: o.dev_num },
        frontend,
        fuse_io: o.fuse_io,
    };
    launch(spec, o.foreground, on_ready)
}

/// `map --recover DEV`: re-serves a mapping whose daemon died, when the loop device allows it.
pub fn recover(
    device: &str,
    foreground: bool,
    logfile: Option<PathBuf>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
    let not_ours =
        || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
    if let Some(id) = crate::ublk::parse_device(device) {
        return recover_ublk(id, foreground, logfile, on_ready);
    }
    preflight()?;
    let dev = LoopDev::parse(device).ok_or_else(not_ours)?;
    let rec = Record::load(&dev.path())?.ok_or_else(not_ours)?;
    let path = dev.path();
    if rec.frontend != FRONTEND_FUSE {
        return Err(format!(
            "{path} uses the {} frontend, which this build cannot recover",
            rec.frontend
        ));
    }
    if rec.liveness() == state::Liveness::Running {
        return Err(format!(
            "{path} is still served by pid {}: nothing to recover",
            rec.pid
        ));
    }
    if dev.backing_file().as_deref() != Some(rec.file.as_str()) {
        return Err(format!(
            "{path} is no longer bound to its blkwire file: run `blkwire unmap {path}`, then map {} again",
            rec.url
        ));
    }
    if !rec.readonly {
        return Err(format!(
            "recovering a read-write mapping needs the ublk frontend (a loop device can swap the file only under a read-only device): unmount {path}, run `blkwire unmap {path}`, then map {} again",
            rec.url
        ));
    }
    let spec = recovery_spec(rec, &path, logfile, true, FRONTEND_FUSE)?;
    launch(spec, foreground, on_ready)
}

/// What a recovering daemon runs: the mapping as its record describes it.
fn recovery_spec(
    rec: Record,
    path: &str,
    logfile: Option<PathBuf>,
    readonly: bool,
    frontend: &'static str,
) -> Result<Spec, String> {
    // A mapping that ran on the read path keeps it; one that ran over io_uring takes it again
    // if the system-wide switch is still on (auto), and recovery never turns the switch on.
    let fuse_io = match rec.fuse_io.as_deref() {
        Some(FUSE_IO_READ) => FuseIo::Read,
        _ => FuseIo::Auto,
    };
    Ok(Spec {
        url: Url::parse(&rec.url).map_err(|e| format!("record of {path}: {e}"))?,
        readonly,
        queues: rec.queues,
        depth: rec.queue_depth,
        max_io: rec.max_io,
        hdd: rec.hdd,
        timeout: Duration::from_secs(rec.timeout_secs),
        logfile: logfile
            .map(|p| p.display().to_string())
            .or_else(|| rec.logfile.clone()),
        mode: Mode::Recover(Box::new(rec)),
        frontend,
        fuse_io,
    })
}

/// `map --recover /dev/ublkbN`: a new daemon takes over the quiesced ublk device.
fn recover_ublk(
    id: u32,
    foreground: bool,
    logfile: Option<PathBuf>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
    crate::ublk::preflight()?;
    let path = crate::ublk::device_path(id);
    let rec = Record::load(&path)?.ok_or_else(|| {
        format!("{path} is not a blkwire device (`blkwire ls` lists the mapped devices)")
    })?;
    if rec.frontend != FRONTEND_UBLK {
        return Err(format!("{path} is not a blkwire ublk device"));
    }
    if rec.liveness() == state::Liveness::Running {
        return Err(format!(
            "{path} is still served by pid {}: nothing to recover",
            rec.pid
        ));
    }
    let readonly = rec.readonly;
    let spec = recovery_spec(rec, &path, logfile, readonly, FRONTEND_UBLK)?;
    launch(spec, foreground, on_ready)
}

/// How the daemon reports readiness (or the error that prevented it).
pub(crate) enum Notify<'a> {
    /// Daemonised: one line to the waiting parent, "ok DEV" or "error MESSAGE".
    Pipe(Option<File>),
    /// Foreground: the caller prints the device; errors come back as `Err`.
    Call(&'a mut dyn FnMut(&str)),
}

impl Notify<'_> {
    pub(crate) fn ready(&mut self, dev: &str) {
        match self {
            Notify::Pipe(p) => {
                if let Some(mut f) = p.take() {
                    let _ = writeln!(f, "ok {dev}");
                }
            }
            Notify::Call(f) => f(dev),
        }
    }

    pub(crate) fn failed(&mut self, msg: &str) {
        if let Notify::Pipe(p) = self {
            if let Some(mut f) = p.take() {
                let _ = writeln!(f, "error {msg}");
            }
        }
    }
}

fn launch(spec: Spec, foreground: bool, on_ready: &mut dyn FnMut(&str)) -> Result<(), String> {
    if foreground {
        if let Some(l) = &spec.logfile {
            let f = open_log(l)?;
            // SAFETY: dup2 onto stderr, which the log lines go to.
            unsafe { libc::dup2(f.as_raw_fd(), 2) };
        }
        return run(&spec, &mut Notify::Call(on_ready));
    }
    // Opened before forking so a bad path is reported by `map` itself.
    let log = match &spec.logfile {
        Some(l) => open_log(l)?,
        None => File::options()
            .write(true)
            .open("/dev/null")
            .map_err(|e| format!("/dev/null: {e}"))?,
    };
    let null = File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fresh descriptors we own.
    let (mut rd, wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // SAFETY: `blkwire map` has started no thread (the daemon starts its own after this), so
    // the child is a complete copy of a single-threaded process and may do anything.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if child == 0 {
        drop(rd);
        // SAFETY: detach from the caller's session and terminal; point stdio at the log.
        unsafe {
            libc::setsid();
            libc::dup2(null.as_raw_fd(), 0);
            libc::dup2(log.as_raw_fd(), 1);
            libc::dup2(log.as_raw_fd(), 2);
        }
        drop((null, log));
        let _ = std::env::set_current_dir("/");
        let code = match run(&spec, &mut Notify::Pipe(Some(wr))) {
            Ok(()) => 0,
            Err(_) => 1,
        };
        std::process::exit(code);
    }
    drop((wr, null, log));
    let mut reply = String::new();
    let _ = rd.read_to_string(&mut reply);
    if let Some(dev) = reply.strip_prefix("ok ") {
        on_ready(dev.trim());
        return Ok(());
    }
    // The daemon failed and exits: reap it.
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(child, &mut status, 0) };
    match reply.strip_prefix("error ") {
        Some(msg) => Err(msg.trim().to_string()),
        None => Err(format!(
            "the map daemon (pid {child}) died before the device was ready{}",
            spec.logfile
                .as_ref()
                .map(|l| format!(" (see {l})"))
                .unwrap_or_else(|| " (run with --foreground or --logfile to see why)".into())
        )),
    }
}

fn open_log(path: &str) -> Result<File, String> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("--logfile {path}: {e}"))
}

fn run(spec: &Spec, notify: &mut Notify<'_>) -> Result<(), String> {
    if spec.frontend == FRONTEND_UBLK {
        return crate::ublk::run(spec, notify);
    }
    let m = match Mapping::setup(spec) {
        Ok(m) => m,
        Err(e) => {
            log!("error", "{e}");
            notify.failed(&e);
            return Err(e);
        }
    };
    notify.ready(&m.dev.path());
    m.serve()
}

/// What setup created, undone in reverse order unless setup completes.
#[derive(Default)]
struct Undo {
    dir: Option<PathBuf>,
    mounted: bool,
    /// New record to remove, or (recovery) the previous record to put back.
    record: Option<LoopDev>,
    restore: Option<Record>,
    bound: Option<LoopDev>,
    /// We turned the kernel's FUSE-over-io_uring switch on for this mapping.
    switch_on: bool,
}

impl Undo {
    /// Setup completed: forget everything. (Assigning a fresh `Undo` instead would drop, and
    /// so run, this one.)
    fn disarm(&mut self) {
        self.dir = None;
        self.mounted = false;
        self.record = None;
        self.restore = None;
        self.bound = None;
        self.switch_on = false;
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(d) = self.bound {
            let _ = d.detach();
        }
        if let Some(r) = &self.restore {
            let _ = r.save();
        } else if let Some(d) = self.record {
            Record::remove(&d.path());
        }
        if let Some(dir) = &self.dir {
            if self.mounted {
                let _ = fuse::unmount_lazy(dir);
            }
            let _ = std::fs::remove_dir(dir);
        }
        if self.switch_on {
            // Connections that negotiated io_uring keep it; only new ones see the switch.
            let _ = fuse_uring::set_switch(false);
        }
    }
}

struct Mapping {
    dev: LoopDev,
    file: String,
    mountpoint: PathBuf,
    events: mpsc::Receiver<Event>,
    workers: usize,
    timeout: Duration,
    /// Workers serving ring queues (FUSE over io_uring): nobody else serves those queues.
    ring_workers: Vec<usize>,
}

impl Mapping {
    fn setup(spec: &Spec) -> Result<Mapping, String> {
        let run_dir = state::run_dir();
        state::ensure_dirs().map_err(|e| format!("{}: {e}", run_dir.display()))?;
        state::collect_orphan_mounts();
        let Connected {
            session,
            info,
            reconnect,
            readonly,
        } = connect(spec)?;
        // From here on no signal interrupts setup half-way: they wait for the signal thread.
        let sigs = sys::block_stop_signals();
        if let Err(e) = sys::set_io_flusher() {
            log!(
                "warn",
                "PR_SET_IO_FLUSHER: {e} (writeback under memory pressure may stall)"
            );
        }
        let mut undo = Undo::default();

        let pid = std::process::id();
        let mountpoint = state::mount_dir_for(pid);
        if mountpoint.exists() {
            // Left by an earlier process that had our pid.
            let _ = fuse::unmount_lazy(&mountpoint);
            let _ = std::fs::remove_dir(&mountpoint);
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&mountpoint)
            .map_err(|e| format!("{}: {e}", mountpoint.display()))?;
        undo.dir = Some(mountpoint.clone());

        let want_uring = plan_fuse_io(spec.fuse_io, &mut undo)?;
        let master = Channel::open().map_err(|e| format!("/dev/fuse: {e}"))?;
        let pages = fuse::max_pages_limit();
        let io_cap = info.max_io.min(pages.saturating_mul(4096)).max(4096);
        fuse::mount(&master, &mountpoint, &spec.url.to_string(), io_cap)
            .map_err(|e| format!("mounting FUSE at {}: {e}", mountpoint.display()))?;
        undo.mounted = true;

        let queues = session.queues.len();
        let background = (queues * info.depth as usize).min(u16::MAX as usize) as u16;
        let neg = init(&master, info.max_io, pages, background, want_uring.is_ok())?;
        let max_io = neg.max_io;
        let fuse_io = match (&want_uring, neg.uring) {
            (_, true) => FUSE_IO_URING,
            (Ok(()), false) if spec.fuse_io == FuseIo::Uring => {
                return Err(format!(
                    "--fuse-io uring: the kernel did not offer FUSE over io_uring at INIT although {SWITCH} is on"
                ));
            }
            (Ok(()), false) => {
                log!(
                    "info",
                    "FUSE I/O: read/write on /dev/fuse (the kernel did not offer io_uring at INIT)"
                );
                FUSE_IO_READ
            }
            (Err(why), false) => {
                log!("info", "FUSE I/O: read/write on /dev/fuse ({why})");
                FUSE_IO_READ
            }
        };

        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let name = file_name(&spec.url.export);
        let (tx, events) = mpsc::channel();
        let shared = Arc::new(Shared {
            url: spec.url.clone(),
            reconnect,
            size: info.size,
            readonly,
            name: name.as_bytes().to_vec(),
            root: Attr {
                ino: ROOT_ID,
                size: 0,
                mode: libc::S_IFDIR | 0o755,
                nlink: 2,
                blksize: 4096,
                time: now,
            },
            file: Attr {
                ino: FILE_ID,
                size: info.size,
                mode: libc::S_IFREG | if readonly { 0o400 } else { 0o600 },
                nlink: 1,
                blksize: info.physical_block.clamp(512, 4096),
                time: now,
            },
            block_size: info.physical_block.clamp(512, 4096),
            timeout: spec.timeout,
            max_io,
            events: tx.clone(),
            opens: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            reconnects: AtomicU64::new(0),
        });

        // One descriptor per worker: clones of the one that mounted.
        let mut channels = Vec::with_capacity(queues);
        for _ in 1..queues {
            channels.push(
                master
                    .clone_channel()
                    .map_err(|e| format!("cloning /dev/fuse: {e}"))?,
            );
        }
        channels.insert(0, master);
        // FUSE over io_uring: the kernel's ring queues (one per possible CPU) are dealt out to
        // the workers round-robin, each worker one io_uring for all of its ring queues. A
        // worker left without a ring queue (more queues than CPUs) serves what read() brings.
        let ring_queues = if neg.uring {
            fuse_uring::ring_queues()?
        } else {
            0
        };
        let mut ring_workers = Vec::new();
        for (id, (q, ch)) in session.queues.into_iter().zip(channels).enumerate() {
            let waker = Arc::new(Waker::new().map_err(|e| format!("eventfd: {e}"))?);
            let qids: Vec<u16> = (id..ring_queues)
                .step_by(queues)
                .map(|q| q as u16)
                .collect();
            let sh = Arc::clone(&shared);
            let spawned = if qids.is_empty() {
                let w = Worker::new(id, ch, sh, q, 0, waker);
                spawn_worker(id, move || w.run())
            } else {
                // Entries for the queue depth, shared out over this worker's ring queues.
                let per_queue = q.depth().div_ceil(qids.len()).max(1);
                let ring = Ring::new(ch, waker.fd(), &qids, per_queue, neg.ring_payload())?;
                let entries = ring.entries();
                let w = Worker::new(id, ring, sh, q, entries, waker);
                ring_workers.push(id);
                spawn_worker(id, move || w.run())
            };
            spawned?;
        }
        if !ring_workers.is_empty() {
            await_registration(&events, ring_workers.len())?;
            log!(
                "info",
                "FUSE I/O: io_uring ({ring_queues} ring queue(s) on {} thread(s))",
                ring_workers.len()
            );
        }
        let sig_tx = tx;
        std::thread::Builder::new()
            .name("blkwire-signals".into())
            .spawn(move || loop {
                let sig = sys::wait_signal(&sigs);
                if sig_tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            })
            .map_err(|e| format!("starting the signal thread: {e}"))?;

        // Opened through our own filesystem (the workers answer LOOKUP and OPEN); the loop
        // device takes its own reference to this very open file.
        let file_path = mountpoint.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(!readonly)
            .custom_flags(libc::O_CLOEXEC)
            .open(&file_path)
            .map_err(|e| format!("opening {}: {e}", file_path.display()))?;
        let file_str = file_path.display().to_string();
        let record = Record {
            device: String::new(),
            url: spec.url.to_string(),
            export: spec.url.export.clone(),
            frontend: FRONTEND_FUSE.into(),
            pid: pid as i32,
            start_time: state::self_start_time(),
            mountpoint: mountpoint.display().to_string(),
            file: file_str.clone(),
            size: info.size,
            readonly,
            queues: queues as u16,
            queue_depth: info.depth,
            max_io,
            timeout_secs: spec.timeout.as_secs(),
            hdd: spec.hdd,
            logfile: spec.logfile.clone(),
            fuse_io: Some(fuse_io.into()),
        };
        let block = info.logical_block.max(512);
        let dev = match &spec.mode {
            Mode::New { dev_num } => bind(&file, *dev_num, block, readonly, record, &mut undo)?,
            Mode::Recover(old) => rebind(&file, old, record, &mut undo)?,
        };
        tune(
            dev,
            spec.hdd || info.features.has(Features::ROTATIONAL),
            max_io,
        );
        drop(file); // the loop device holds the file now; this close only sends FLUSH
        shared.armed.store(true, Ordering::SeqCst);
        undo.disarm();
        log!(
            "info",
            "{} serves {} ({} bytes{}): {queues} queue(s) x depth {}, I/O up to {} KiB, I/O timeout {}s",
            dev.path(),
            spec.url,
            info.size,
            if readonly { ", read-only" } else { "" },
            info.depth,
            max_io / 1024,
            spec.timeout.as_secs()
        );
        Ok(Mapping {
            dev,
            file: file_str,
            mountpoint,
            events,
            workers: queues,
            timeout: spec.timeout,
            ring_workers,
        })
    }

    /// Waits for the end of the mapping, then cleans up.
    fn serve(self) -> Result<(), String> {
        let mut exited = 0;
        let mut stopping = false;
        loop {
            match self.events.recv() {
                Ok(Event::FileReleased) => break,
                Ok(Event::Signal(sig)) => {
                    if stopping {
                        log!("warn", "signal {sig} again: stopping now");
                        break;
                    }
                    stopping = true;
                    log!("info", "signal {sig}: detaching {}", self.dev.path());
                    match self.dev.detach() {
                        Ok(Detach::Done) | Ok(Detach::NotBound) => break,
                        Ok(Detach::Deferred) => log!(
                            "warn",
                            "{} is in use: it is detached (and this daemon stops) when its last user closes it; signal again to stop now",
                            self.dev.path()
                        ),
                        Err(e) => log!("error", "detaching {}: {e}", self.dev.path()),
                    }
                }
                Ok(Event::Registered { .. }) => {}
                Ok(Event::WorkerExited { id, error }) => {
                    exited += 1;
                    if let Some(e) = error {
                        log!("error", "worker {id} stopped: {e}");
                        if self.ring_workers.contains(&id) {
                            // The kernel queues requests per CPU and would wait forever for
                            // this worker's ring queues: end the mapping (its I/O fails)
                            // rather than let it hang.
                            log!(
                                "error",
                                "a FUSE ring worker failed: ending the mapping of {}",
                                self.dev.path()
                            );
                            break;
                        }
                    }
                    if exited == self.workers {
                        log!("warn", "every worker stopped: the FUSE connection ended");
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        self.teardown(exited);
        Ok(())
    }

    fn teardown(self, mut exited: usize) {
        let ours = || self.dev.backing_file().as_deref() == Some(self.file.as_str());
        if ours() {
            // Forced stop or a dead connection: let the device go (deferred if in use).
            let _ = self.dev.detach();
        }
        let _ = fuse::unmount_lazy(&self.mountpoint);
        // With the filesystem unmounted and its file released, the kernel ends the connection;
        // the workers see ENODEV, flush, log out and report.
        let deadline = Instant::now() + self.timeout + Duration::from_secs(5);
        while exited < self.workers {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(Event::WorkerExited { .. }) => exited += 1,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        if exited < self.workers {
            log!(
                "warn",
                "{} worker(s) did not stop in time; exiting anyway",
                self.workers - exited
            );
        }
        let path = self.dev.path();
        if ours() {
            // Keep the record: `ls` shows the mapping dead once we are gone, and `unmap`
            // finishes the job after its user closes the device.
            log!(
                "warn",
                "{path} is still in use and stays bound until closed"
            );
        } else {
            Record::remove_if_owned(&path, std::process::id() as i32);
        }
        let _ = std::fs::remove_dir(&self.mountpoint);
        log!("info", "{path} unmapped");
    }
}

/// What every frontend's setup starts with.
pub(crate) struct Connected {
    pub session: blkwire_client::Session,
    pub info: ExportInfo,
    /// What one queue reconnects with: its own connection, the depth the target granted.
    pub reconnect: ConnectOptions,
    /// Asked for, or the export is read-only.
    pub readonly: bool,
}

/// Connects the session a mapping serves with, first (so an unknown export or an unreachable
/// target fails before anything exists), and checks that the export can be a block device.
pub(crate) fn connect(spec: &Spec) -> Result<Connected, String> {
    let opts = ConnectOptions {
        queues: spec.queues,
        depth: spec.depth,
        max_io: spec.max_io,
        timeout: spec.timeout,
        ..Default::default()
    };
    let session = blkwire_client::connect(&spec.url, &opts).map_err(|e| e.to_string())?;
    let info = session.info.clone();
    check_export(&info, spec)?;
    Ok(Connected {
        readonly: spec.readonly || info.features.has(Features::READ_ONLY),
        reconnect: ConnectOptions {
            queues: 1,
            depth: info.depth,
            ..opts
        },
        session,
        info,
    })
}

fn check_export(info: &ExportInfo, spec: &Spec) -> Result<(), String> {
    if info.size == 0 {
        return Err(format!("export '{}' is empty", info.name));
    }
    let lb = info.logical_block;
    if !lb.is_power_of_two() || !(512..=4096).contains(&lb) {
        return Err(format!(
            "export '{}' has {lb}-byte blocks; a loop device supports 512 to 4096",
            info.name
        ));
    }
    if info.max_io < 4096 {
        return Err(format!(
            "the target grants I/O of at most {} bytes; mapping needs 4096",
            info.max_io
        ));
    }
    if let Mode::Recover(r) = &spec.mode {
        if r.size != info.size {
            return Err(format!(
                "export '{}' changed size ({} -> {} bytes): cannot recover {}",
                info.name, r.size, info.size, r.device
            ));
        }
    }
    Ok(())
}

/// Name of the file in the mount: the export's, unless it cannot be a file name.
fn file_name(export: &str) -> String {
    match export {
        "" | "." | ".." => "export".into(),
        e => e.to_string(),
    }
}

fn spawn_worker(id: usize, f: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::Builder::new()
        .name(format!("blkwire-q{id}"))
        .spawn(f)
        .map(|_| ())
        .map_err(|e| format!("starting a worker thread: {e}"))
}

/// `--fuse-io`: Ok when INIT should offer FUSE over io_uring, else why not (for the log).
/// `uring` turns the kernel's switch on when it is off (we are root: mapping needs it), and
/// `undo` turns it off again if the mapping then fails.
fn plan_fuse_io(mode: FuseIo, undo: &mut Undo) -> Result<Result<(), String>, String> {
    let sw = fuse_uring::switch();
    Ok(match (mode, sw) {
        (FuseIo::Read, _) => Err("--fuse-io read".into()),
        (FuseIo::Auto | FuseIo::Uring, Switch::On) => Ok(()),
        (FuseIo::Auto, Switch::Off) => Err(format!(
            "io_uring is off: {SWITCH} is N; --fuse-io uring turns it on"
        )),
        (FuseIo::Auto, Switch::Missing) => {
            Err("this kernel has no FUSE over io_uring (Linux >= 6.14)".into())
        }
        (FuseIo::Uring, Switch::Missing) => {
            return Err(format!(
                "--fuse-io uring: this kernel has no FUSE over io_uring ({SWITCH} is missing: Linux >= 6.14 with CONFIG_FUSE_IO_URING); use --fuse-io read"
            ))
        }
        (FuseIo::Uring, Switch::Off) => {
            fuse_uring::set_switch(true).map_err(|e| {
                format!("--fuse-io uring: cannot turn on {SWITCH} ({e}); as root run: echo Y > {SWITCH}")
            })?;
            undo.switch_on = true;
            log!(
                "info",
                "turned on FUSE over io_uring system-wide ({SWITCH} = Y) for --fuse-io uring"
            );
            Ok(())
        }
    })
}

/// Waits until `n` ring workers registered their entries; the first refusal fails the mapping.
fn await_registration(events: &mpsc::Receiver<Event>, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + REGISTER_WAIT;
    let mut left = n;
    while left > 0 {
        match events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Registered { error: None, .. }) => left -= 1,
            Ok(Event::Registered { id, error: Some(e) }) => {
                log!("error", "queue {id}: {e}");
                return Err(format!("{e}; --fuse-io read avoids it"));
            }
            Ok(Event::WorkerExited { id, error }) => {
                return Err(format!(
                    "worker {id} stopped while registering its FUSE ring: {}",
                    error.unwrap_or_else(|| "the FUSE connection ended".into())
                ))
            }
            Ok(_) => {}
            Err(_) => {
                return Err(format!(
                    "the FUSE ring entries were not registered within {}s",
                    REGISTER_WAIT.as_secs()
                ))
            }
        }
    }
    Ok(())
}

/// Reads INIT from the fresh connection and answers it (offering FUSE over io_uring when
/// `uring` and the kernel offered it).
fn init(
    ch: &Channel,
    session_io: u32,
    pages: u32,
    background: u16,
    uring: bool,
) -> Result<Negotiated, String> {
    if !ch
        .wait_readable(INIT_WAIT_MS)
        .map_err(|e| format!("/dev/fuse: {e}"))?
    {
        return Err("the kernel sent no FUSE INIT after mounting".into());
    }
    let mut buf = vec![0u8; (pages as usize * 4096 + fuse::REQUEST_OVERHEAD).max(1 << 20)];
    let n = ch
        .receive(&mut buf)
        .map_err(|e| format!("reading FUSE INIT: {e}"))?;
    let (h, req) = fuse::parse(&buf[..n]).map_err(|_| "malformed FUSE INIT".to_string())?;
    let Request::Init(init) = req else {
        return Err(format!("expected FUSE INIT, got opcode {}", h.opcode));
    };
    let neg = match fuse::negotiate(&init, session_io, pages, background, uring) {
        Ok(n) => n,
        Err(e) => {
            let _ = ch.reply(h.unique, libc::EPROTO, &[]);
            return Err(e);
        }
    };
    ch.reply(h.unique, 0, &[&neg.reply])
        .map_err(|e| format!("answering FUSE INIT: {e}"))?;
    Ok(neg)
}

/// Binds `file` to a free loop device (or /dev/loop`dev_num`). The record is written first:
/// a daemon killed between the two leaves a record that `ls` shows dead and `unmap` clears,
/// never a bound device nobody knows about.
fn bind(
    file: &File,
    dev_num: Option<u32>,
    block: u32,
    readonly: bool,
    mut record: Record,
    undo: &mut Undo,
) -> Result<LoopDev, String> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let dev = match dev_num {
            Some(n) => LoopDev::ensure(n).map_err(|e| format!("creating /dev/loop{n}: {e}"))?,
            None => LoopDev::get_free().map_err(|e| format!("finding a free loop device: {e}"))?,
        };
        let path = dev.path();
        let busy = || format!("{path} is in use");
        if dev.backing_file().is_some() {
            if dev_num.is_some() || attempt >= BIND_ATTEMPTS {
                return Err(busy());
            }
            continue;
        }
        if let Some(old) = Record::load(&path)? {
            if old.liveness() == state::Liveness::Running {
                return Err(format!(
                    "{path} is still recorded for blkwire pid {}",
                    old.pid
                ));
            }
            // A dead mapping whose device was freed meanwhile: finish its cleanup.
            let _ = fuse::unmount_lazy(Path::new(&old.mountpoint));
            let _ = std::fs::remove_dir(&old.mountpoint);
        }
        record.device = path.clone();
        record
            .save()
            .map_err(|e| format!("writing the record of {path}: {e}"))?;
        undo.record = Some(dev);
        match dev.configure(file, block, readonly, &record.url) {
            Ok(()) => {
                undo.bound = Some(dev);
                return Ok(dev);
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                Record::remove(&path);
                undo.record = None;
                if dev_num.is_some() || attempt >= BIND_ATTEMPTS {
                    return Err(busy());
                }
            }
            Err(e) => return Err(format!("binding {path}: {e}")),
        }
    }
}

/// Recovery: swap the dead daemon's file under the device for ours.
fn rebind(
    file: &File,
    old: &Record,
    mut record: Record,
    undo: &mut Undo,
) -> Result<LoopDev, String> {
    let dev = LoopDev::parse(&old.device)
        .ok_or_else(|| format!("bad device '{}' in the record", old.device))?;
    record.device = old.device.clone();
    record
        .save()
        .map_err(|e| format!("writing the record of {}: {e}", old.device))?;
    undo.restore = Some(old.clone());
    dev.change_fd(file)
        .map_err(|e| format!("swapping the file under {}: {e}", old.device))?;
    // The dead daemon's filesystem lost its last user just now.
    let _ = fuse::unmount_lazy(Path::new(&old.mountpoint));
    let _ = std::fs::remove_dir(&old.mountpoint);
    Ok(dev)
}

/// Device attributes the loop driver does not take from LOOP_CONFIGURE. Best effort: a
/// failure costs performance hints, not correctness.
fn tune(dev: LoopDev, rotational: bool, max_io: u32) {
    if dev.rotational() != Some(rotational) {
        if let Err(e) = dev.set_rotational(rotational) {
            log!(
                "warn",
                "{}: setting rotational={rotational}: {e}",
                dev.path()
            );
        }
    }
    // Requests no larger than one FUSE request (the default 1280 KiB would split in two).
    if let Err(e) = dev.set_max_sectors_kb(max_io / 1024) {
        log!("warn", "{}: setting max_sectors_kb: {e}", dev.path());
    }
    if dev.direct_io() != Some(true) {
        log!(
            "warn",
            "{}: the kernel did not enable direct I/O on the FUSE file; data is cached twice",
            dev.path()
        );
    }
}
