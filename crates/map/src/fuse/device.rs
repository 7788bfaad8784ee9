//! The fuse device (`FuseDevice`): a one-file FUSE filesystem served by this daemon, its file
//! bound to a loop device with direct I/O.
//!
//! Setup: connect, mount the FUSE filesystem, answer INIT, start one worker per queue, bind the
//! file to a loop device, report readiness. Setup is undone step by step on any error (`Undo`), so
//! a failed `map` leaves no mount, loop device or record behind. A mapping ends when the loop
//! device releases the file (`unmap`, `losetup -d`, or our own detach on SIGTERM): the daemon then
//! unmounts, waits for its workers to flush and log out, removes its record and exits.
//!
//! `unmap` ends a mapping whether or not its daemon is alive, and never waits without bound.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use blkwire_wire::Features;

use super::abi::{self, Attr, Negotiated, Request, FILE_ID, ROOT_ID};
use super::channel::{self, Channel};
use super::loopdev::{Detach, LoopDev};
use super::uring::{self, Ring, Switch, SWITCH};
use super::worker::{Event, Shared, Worker};
use crate::device::{
    answer_limit, BlockDevice, Connected, FuseIo, Mode, Needs, Spec, FUSE_IO_READ, FUSE_IO_URING,
};
use crate::log;
use crate::state::{self, Record, RecordsLock};
use crate::sys::{self, Proc, Waker};

/// How long the kernel may take to queue INIT after mount(2) (it does so during the call).
const INIT_WAIT_MS: i32 = 10_000;
/// Attempts at binding a free loop device that another program takes first.
const BIND_ATTEMPTS: u32 = 16;
/// How long the workers may take to register their FUSE ring entries (the kernel answers each
/// REGISTER during its submission).
const REGISTER_WAIT: Duration = Duration::from_secs(10);

/// A mapping served through FUSE and a loop device.
pub(crate) struct FuseDevice(Mapping);

impl BlockDevice for FuseDevice {
    const KIND: &'static str = "fuse";
    type Prepared = ();

    fn preflight() -> Result<(), String> {
        preflight()
    }

    fn names(device: &str) -> bool {
        LoopDev::parse(device).is_some()
    }

    fn prepare(_spec: &Spec) -> Result<(), String> {
        let run_dir = state::run_dir();
        state::ensure_dirs().map_err(|e| format!("{}: {e}", run_dir.display()))?;
        collect_orphan_mounts();
        Ok(())
    }

    fn setup(spec: &Spec, _: (), conn: Connected) -> Result<FuseDevice, String> {
        Mapping::setup(spec, conn).map(FuseDevice)
    }

    fn path(&self) -> String {
        self.0.dev.path()
    }

    fn serve(self) -> Result<(), String> {
        self.0.serve()
    }

    fn stop_now(self) -> Result<(), String> {
        // As a second signal: the detach (deferred while the device is held) and the lazy
        // unmount. While something still holds the loop device it keeps the FUSE file open and
        // is served on until the workers' wait (`answer_limit` + 5 s) ends and the process exits,
        // closing /dev/fuse: its I/O fails from then on.
        log!("info", "detaching {}", self.0.dev.path());
        self.0.teardown(0);
        Ok(())
    }

    fn recoverable(device: &str) -> Result<(Record, String, bool), String> {
        let not_ours =
            || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
        let dev = LoopDev::parse(device).ok_or_else(not_ours)?;
        let rec = Record::load(&dev.path())?.ok_or_else(not_ours)?;
        let path = dev.path();
        if rec.frontend != Self::KIND {
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
        Ok((rec, path, true))
    }

    fn unmap(device: &str) -> Result<(), String> {
        unmap(device)
    }
}

fn preflight() -> Result<(), String> {
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

/// What setup created, undone in reverse order unless setup completes.
#[derive(Default)]
struct Undo {
    dir: Option<PathBuf>,
    mounted: bool,
    /// New record to remove, or (recovery) the previous record to put back.
    record: Option<LoopDev>,
    restore: Option<Record>,
    bound: Option<LoopDev>,
    /// A loop device created for this mapping (`--dev-num` of one that did not exist).
    created: Option<LoopDev>,
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
        self.created = None;
        self.switch_on = false;
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(d) = self.bound {
            let _ = d.detach();
        }
        if let Some(d) = self.created {
            if let Err(e) = d.remove() {
                log!("warn", "removing {} again: {e}", d.path());
            }
        }
        if let Some(r) = &self.restore {
            let _ = r.save();
        } else if let Some(d) = self.record {
            Record::remove_if_owned(&d.path(), std::process::id() as i32);
        }
        if let Some(dir) = &self.dir {
            if self.mounted {
                let _ = channel::unmount_lazy(dir);
            }
            let _ = std::fs::remove_dir(dir);
        }
        if self.switch_on {
            // Connections that negotiated io_uring keep it; only new ones see the switch.
            let _ = uring::set_switch(false);
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
    fn setup(spec: &Spec, conn: Connected) -> Result<Mapping, String> {
        let Connected {
            session,
            info,
            reconnect,
            readonly,
        } = conn;
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
            let _ = channel::unmount_lazy(&mountpoint);
            let _ = std::fs::remove_dir(&mountpoint);
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&mountpoint)
            .map_err(|e| format!("{}: {e}", mountpoint.display()))?;
        undo.dir = Some(mountpoint.clone());

        let want_uring = plan_fuse_io(spec.fuse_io, &mut undo)?;
        let master = Channel::open().map_err(|e| format!("/dev/fuse: {e}"))?;
        let pages = channel::max_pages_limit();
        let page = crate::sys::page_size() as u32;
        let io_cap = info.max_io.min(pages.saturating_mul(page)).max(4096);
        channel::mount(&master, &mountpoint, &spec.url.to_string(), io_cap)
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
            write_zeroes: info.features.has(Features::WRITE_ZEROES),
            zero_step: info.max_range,
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
            needs: Needs {
                size: info.size,
                logical_block: info.logical_block,
                max_io,
                // A request waits for a free slot of the queue (`Worker::pump`): any depth
                // serves.
                depth: 1,
                writable: !readonly,
                // The loop device passes every flush on (as FSYNC, sent as FLUSH whatever
                // the export offers): no state of the kernel's depends on it.
                volatile_cache: true,
            },
            events: tx.clone(),
            opens: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            reconnects: AtomicU64::new(0),
            locks: Arc::default(),
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
        let ring_queues = if neg.uring { uring::ring_queues()? } else { 0 };
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
        sys::spawn_signal_thread(sigs, tx, Event::Signal)?;

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
            frontend: FuseDevice::KIND.into(),
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
            credentials: (&spec.credentials).into(),
            queue_refs: None,
            volatile_cache: None,
        };
        let block = info.logical_block.max(512);
        let dev = match &spec.mode {
            Mode::New { dev_num } => bind(
                &file,
                *dev_num,
                block,
                readonly,
                record,
                &state::devices_dir(),
                &mut undo,
            )?,
            Mode::Recover(old) => rebind(&file, old, record, &mut undo)?,
        };
        tune(
            dev,
            spec.hdd || info.features.has(Features::ROTATIONAL),
            max_io,
        );
        // Armed before our handle closes: if the loop device let the file go meanwhile (a
        // `losetup -d` from outside), this close is the last and its RELEASE ends the mapping.
        shared.armed.store(true, Ordering::SeqCst);
        drop(file); // the loop device holds the file now; this close only sends FLUSH
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
        let _ = channel::unmount_lazy(&self.mountpoint);
        // With the filesystem unmounted and its file released, the kernel ends the connection;
        // the workers see ENODEV, flush, log out and report.
        let deadline = Instant::now() + answer_limit(self.timeout) + Duration::from_secs(5);
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
    let sw = uring::switch();
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
            uring::set_switch(true).map_err(|e| {
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
    let page = crate::sys::page_size();
    let mut buf = vec![0u8; (pages as usize * page + abi::REQUEST_OVERHEAD).max(1 << 20)];
    let n = ch
        .receive(&mut buf)
        .map_err(|e| format!("reading FUSE INIT: {e}"))?;
    let (h, req) = abi::parse(&buf[..n]).map_err(|_| "malformed FUSE INIT".to_string())?;
    let Request::Init(init) = req else {
        return Err(format!("expected FUSE INIT, got opcode {}", h.opcode));
    };
    let neg = match abi::negotiate(&init, session_io, pages, background, uring, page as u32) {
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

/// Binds `file` to a free loop device (or /dev/loop`dev_num`), recording it in `records` (the
/// devices directory). The record is written first: a daemon killed between the two leaves a
/// record that `ls` shows dead and `unmap` clears, never a bound device nobody knows about.
///
/// LOOP_CTL_GET_FREE names the same free device to every map that asks before one binds it, so
/// choosing, recording and binding happen under the records' lock: another map of this run
/// directory finds the device bound, not half-taken. A live daemon's record on a device that is
/// not bound is one letting its device go: that device is skipped.
fn bind(
    file: &File,
    dev_num: Option<u32>,
    block: u32,
    readonly: bool,
    mut record: Record,
    records: &Path,
    undo: &mut Undo,
) -> Result<LoopDev, String> {
    let lock = RecordsLock::acquire_in(records.to_path_buf())
        .map_err(|e| format!("locking the records in {}: {e}", records.display()))?;
    let mut skip = Vec::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let dev = match dev_num {
            Some(n) => {
                let (d, created) =
                    LoopDev::ensure(n).map_err(|e| format!("creating /dev/loop{n}: {e}"))?;
                if created {
                    undo.created = Some(d);
                }
                d
            }
            None => LoopDev::get_free_except(&skip)
                .map_err(|e| format!("finding a free loop device: {e}"))?,
        };
        let path = dev.path();
        let busy = || format!("{path} is in use");
        let another = dev_num.is_none() && attempt < BIND_ATTEMPTS;
        if dev.backing_file().is_some() {
            if !another {
                return Err(busy());
            }
            continue;
        }
        // A record that does not parse (damaged, edited by hand) names no mapping we could
        // check: this device is left to whoever reads it (`blkwire ls` shows the error), and
        // the next free one is tried, instead of every map failing on the same device.
        let old = match lock.load(&path) {
            Ok(old) => old,
            Err(e) if another => {
                log!("warn", "{e}; trying another loop device");
                skip.push(dev.index);
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some(old) = old {
            if old.liveness() == state::Liveness::Running {
                if !another {
                    return Err(format!(
                        "{path} is still recorded for blkwire pid {}",
                        old.pid
                    ));
                }
                skip.push(dev.index);
                continue;
            }
            // A dead mapping whose device was freed meanwhile: finish its cleanup (its mount
            // directory only if no process has its pid now, this one included).
            if mount_is_orphaned(Path::new(&old.mountpoint)) {
                let _ = channel::unmount_lazy(Path::new(&old.mountpoint));
                let _ = std::fs::remove_dir(&old.mountpoint);
            }
        }
        record.device = path.clone();
        lock.save(&record)
            .map_err(|e| format!("writing the record of {path}: {e}"))?;
        undo.record = Some(dev);
        match dev.configure(file, block, readonly, &record.url) {
            Ok(()) => {
                undo.bound = Some(dev);
                return Ok(dev);
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                // Bound first by someone outside our lock (losetup, a map of another run
                // directory): only our own record goes.
                lock.remove_if_owned(&path, record.pid);
                undo.record = None;
                if !another {
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
    // Under the records' lock: an unmap removing the dead daemon's record checks and removes
    // it in one step, before this or after it, never across it.
    RecordsLock::acquire()
        .and_then(|records| records.save(&record))
        .map_err(|e| format!("writing the record of {}: {e}", old.device))?;
    undo.restore = Some(old.clone());
    dev.change_fd(file)
        .map_err(|e| format!("swapping the file under {}: {e}", old.device))?;
    // The dead daemon's filesystem lost its last user just now.
    let _ = channel::unmount_lazy(Path::new(&old.mountpoint));
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

/// Extra time a live daemon gets beyond the longest wait of its I/O (`answer_limit`) to flush
/// and exit.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// LOOP_CLR_FD waits for the device's I/O in flight, which a live daemon answers within
/// `answer_limit` of its timeout. One that does not (stopped, stuck) is killed: its FUSE connection dies with it, the
/// I/O fails at once and the detach completes.
fn detach_bounded(dev: LoopDev, daemon: Option<&(Proc, u64)>) -> Result<Detach, String> {
    let path = dev.path();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(dev.detach());
    });
    let limit = daemon.map_or(EXIT_GRACE, |(_, t)| {
        answer_limit(Duration::from_secs(*t)) + EXIT_GRACE
    });
    let r = match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => {
            if let Some((p, _)) = daemon {
                let _ = p.kill(libc::SIGKILL);
            }
            rx.recv_timeout(EXIT_GRACE)
                .map_err(|_| format!("detaching {path} is stuck in the kernel"))?
        }
    };
    r.map_err(|e| format!("detaching {path}: {e}"))
}

/// Refuses to detach a device in use: detaching would only be deferred to its last close,
/// leaving the mapping half-removed for an unknown time.
fn check_not_in_use(dev: &LoopDev) -> Result<(), String> {
    let path = dev.path();
    if let Some(at) = dev.mount_points().first() {
        return Err(format!(
            "{path} is mounted on {at}: unmount it first, then unmap it"
        ));
    }
    if !crate::sys::released_within(&path, crate::sys::RELEASE_GRACE) {
        return Err(format!(
            "{path} is held open exclusively (device-mapper, swap, another mount namespace?): release it first, then unmap it"
        ));
    }
    Ok(())
}

/// `unmap` of a loop device: with a live daemon, detaching the loop device makes the kernel
/// release the FUSE file; the daemon sees that, unmounts, flushes, removes its record and exits,
/// and we wait for that exit (bounded by its I/O timeout). With a dead daemon the FUSE connection
/// is already aborted, so the detach cannot block on it, and we do the rest of the cleanup
/// ourselves.
fn unmap(device: &str) -> Result<(), String> {
    FuseDevice::preflight()?;
    let not_ours =
        || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
    let dev = LoopDev::parse(device).ok_or_else(not_ours)?;
    let path = dev.path();
    let rec = Record::load(&path)?;
    let backing = dev.backing_file();
    let mounts = state::mounts_dir();
    // Bound to a blkwire file: the recorded one, or (no record: a daemon killed before writing
    // it) any file under our mount directory.
    let bound_to_us = match (&rec, &backing) {
        (Some(r), Some(b)) => *b == r.file,
        (None, Some(b)) => Path::new(b).starts_with(&mounts),
        _ => false,
    };
    if rec.is_none() && !bound_to_us {
        return Err(not_ours());
    }
    let daemon = rec
        .as_ref()
        .and_then(|r| Proc::open(r.pid, r.start_time).map(|p| (p, r.timeout_secs)));
    if bound_to_us {
        check_not_in_use(&dev)?;
        match detach_bounded(dev, daemon.as_ref())? {
            Detach::Done | Detach::NotBound => {}
            Detach::Deferred => {
                let then = if daemon.is_some() {
                    "and its daemon then cleans up"
                } else {
                    "then run unmap again"
                };
                return Err(format!(
                    "{path} is open in another process: it is detached when that process closes it; {then}"
                ));
            }
        }
    }
    if let Some((p, timeout_secs)) = &daemon {
        if !p.wait_exit(answer_limit(Duration::from_secs(*timeout_secs)) + EXIT_GRACE) {
            // Stuck: its cleanup is ours now.
            let _ = p.kill(libc::SIGKILL);
            p.wait_exit(EXIT_GRACE);
        }
    }
    let mountpoint = match (&rec, &backing) {
        (Some(r), _) => Some(r.mountpoint.clone()),
        (None, Some(b)) => Path::new(b).parent().map(|p| p.display().to_string()),
        _ => None,
    };
    // The recorded daemon's own mount, even while it is still dying (killed in D state): not
    // another process's that was given its pid since.
    let ours = |m: &String| {
        rec.as_ref().is_some_and(|r| {
            Path::new(m) == Path::new(&r.mountpoint) && state::process_alive(r.pid, r.start_time)
        })
    };
    if let Some(m) = mountpoint.filter(|m| ours(m) || mount_is_orphaned(Path::new(m))) {
        let m = Path::new(&m);
        channel::unmount_lazy(m).map_err(|e| format!("unmounting {}: {e}", m.display()))?;
        let _ = std::fs::remove_dir(m);
    }
    // The device has been free since the detach: a map may have bound it and recorded itself
    // meanwhile. Only the record this unmap ended goes.
    if let Some(r) = &rec {
        Record::remove_if_owned(&path, r.pid);
    }
    collect_orphan_mounts();
    Ok(())
}

/// Whether the mount directory `m` (named by its daemon's pid, `state::mount_dir_for`) is no
/// running process's: a daemon that died left it, and no process has its pid since. A newer
/// daemon given the same pid names its mount directory the same: unmounting that would cut a
/// live mapping (its loop device's file would read as gone, and a later unmap skip its checks).
fn mount_is_orphaned(m: &Path) -> bool {
    state::mount_dir_pid(m).is_none_or(|pid| !state::pid_running(pid))
}

/// Removes mount directories that no record refers to and whose daemon is gone: what a daemon
/// killed between mounting and writing its record leaves behind.
fn collect_orphan_mounts() {
    let Ok(dir) = std::fs::read_dir(state::mounts_dir()) else {
        return;
    };
    let used: Vec<String> = state::list()
        .into_iter()
        .filter_map(|r| r.ok())
        .map(|r| r.mountpoint)
        .collect();
    for e in dir.filter_map(|e| e.ok()) {
        let path = e.path();
        // Only a daemon's own: named by its pid.
        let Some(pid) = state::mount_dir_pid(&path) else {
            continue;
        };
        if used.iter().any(|m| Path::new(m) == path) {
            continue;
        }
        if state::pid_running(pid) {
            continue; // a daemon still setting up
        }
        let _ = channel::unmount_lazy(&path);
        let _ = std::fs::remove_dir(&path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    /// A directory of one test, with a devices directory for its records; on drop (also after a
    /// failed assertion) every loop device bound to a file in it is detached and it is removed.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let d = std::env::temp_dir()
                .join(format!("blkwire-fuse-device-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(d.join("devices")).unwrap();
            Scratch(d)
        }

        fn records(&self) -> PathBuf {
            self.0.join("devices")
        }

        /// A 1 MiB file of the test, open for reading and writing.
        fn file(&self, name: &str) -> (File, String) {
            let p = self.0.join(name);
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&p)
                .unwrap();
            f.set_len(1 << 20).unwrap();
            (f, p.display().to_string())
        }

        fn load(&self, dev: &LoopDev) -> Option<Record> {
            RecordsLock::acquire_in(self.records())
                .unwrap()
                .load(&dev.path())
                .unwrap()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let prefix = self.0.display().to_string();
            for e in std::fs::read_dir("/sys/block")
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(dev) = LoopDev::parse(&name) {
                    if dev.backing_file().is_some_and(|b| b.starts_with(&prefix)) {
                        let _ = dev.detach();
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn needs_root() {
        assert!(
            sys::is_root(),
            "this test binds loop devices and needs root; run it as root"
        );
    }

    /// Held by each test that binds loop devices: the free device one asks for must not be
    /// taken by another meanwhile (their records are in different directories, so the records'
    /// lock does not keep them apart).
    fn binding_loop_devices() -> std::sync::MutexGuard<'static, ()> {
        static BINDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        BINDING.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A record of this process (so a live daemon's) for `url`.
    fn record(url: &str) -> Record {
        Record {
            url: url.into(),
            frontend: FuseDevice::KIND.into(),
            pid: std::process::id() as i32,
            start_time: state::self_start_time(),
            ..Record::sample(1)
        }
    }

    /// Saves `rec` in the records directory `records`, as a daemon would have.
    fn plant(records: &Path, rec: &Record) {
        RecordsLock::acquire_in(records.to_path_buf())
            .unwrap()
            .save(rec)
            .unwrap();
    }

    /// `bind` as setup calls it, its undo disarmed (the test's `Scratch` detaches).
    fn bind_new(file: &File, url: &str, records: &Path) -> Result<LoopDev, String> {
        let mut undo = Undo::default();
        let r = bind(file, None, 512, false, record(url), records, &mut undo);
        undo.disarm();
        r
    }

    /// A loop device `--dev-num` created for a map that then fails (here: a damaged record
    /// for it) is removed again; one that existed before is left.
    #[test]
    fn a_loop_device_created_for_a_failed_map_is_removed() {
        needs_root();
        let _binding = binding_loop_devices();
        let scratch = Scratch::new("created");
        let records = scratch.records();
        std::fs::create_dir_all(&records).unwrap();
        let (f, _) = scratch.file("new");
        let absent = (900..100_000)
            .find(|n| !Path::new(&format!("/sys/block/loop{n}")).exists())
            .unwrap();
        let existing = LoopDev::get_free().unwrap().index;
        for (n, existed) in [(absent, false), (existing, true)] {
            std::fs::write(records.join(format!("loop{n}.json")), "{\"device\": ").unwrap();
            let mut undo = Undo::default();
            let r = bind(
                &f,
                Some(n),
                512,
                false,
                record("tcp://h/x"),
                &records,
                &mut undo,
            );
            assert!(r.is_err(), "loop{n}: the damaged record refuses it");
            drop(undo);
            let sys = format!("/sys/block/loop{n}");
            assert_eq!(Path::new(&sys).exists(), existed, "{sys}");
        }
    }

    /// Maps started at once are all offered the same free device: each must still end up on a
    /// device of its own, with its own record there, none failing and none losing its record
    /// to another that lost the race.
    #[test]
    fn concurrent_maps_bind_distinct_devices_and_keep_their_records() {
        needs_root();
        let _binding = binding_loop_devices();
        const MAPS: usize = 4;
        const ROUNDS: usize = 3;
        let scratch = Scratch::new("concurrent");
        let records = scratch.records();
        let mut taken = Vec::new();
        for round in 0..ROUNDS {
            let barrier = Barrier::new(MAPS);
            let files: Vec<_> = (0..MAPS)
                .map(|i| scratch.file(&format!("r{round}-m{i}")))
                .collect();
            let bound: Vec<Result<LoopDev, String>> = std::thread::scope(|s| {
                let handles: Vec<_> = files
                    .iter()
                    .enumerate()
                    .map(|(i, (f, _))| {
                        let (barrier, records) = (&barrier, &records);
                        s.spawn(move || {
                            barrier.wait();
                            bind_new(f, &format!("tcp://127.0.0.1:1/r{round}-m{i}"), records)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (i, (b, (_, path))) in bound.into_iter().zip(&files).enumerate() {
                let dev = b.unwrap_or_else(|e| panic!("round {round}, map {i}: {e}"));
                assert!(!taken.contains(&dev), "{} bound twice", dev.path());
                taken.push(dev);
                assert_eq!(dev.backing_file().as_deref(), Some(path.as_str()));
                let rec = scratch.load(&dev).unwrap_or_else(|| {
                    panic!("round {round}, map {i}: {} has no record", dev.path())
                });
                assert_eq!(rec.url, format!("tcp://127.0.0.1:1/r{round}-m{i}"));
                assert_eq!(rec.device, dev.path());
            }
        }
    }

    /// The free device a live daemon still has a record for (it is letting it go) is passed
    /// over for another free one, and that record stays.
    #[test]
    fn a_free_device_with_a_live_record_is_passed_over() {
        needs_root();
        let _binding = binding_loop_devices();
        let scratch = Scratch::new("skip");
        let records = scratch.records();
        let free = LoopDev::get_free().unwrap();
        let mut planted = record("tcp://127.0.0.1:1/leaving");
        planted.device = free.path();
        plant(&records, &planted);
        let (f, _) = scratch.file("new");
        let dev = bind_new(&f, "tcp://127.0.0.1:1/new", &records).unwrap();
        assert_ne!(dev, free);
        assert_eq!(scratch.load(&free), Some(planted));
        assert_eq!(scratch.load(&dev).unwrap().url, "tcp://127.0.0.1:1/new");
    }

    /// A damaged record on the free device (it does not parse) does not stop maps: that
    /// device is passed over, its record left as it is for `blkwire ls` to show.
    #[test]
    fn a_free_device_with_a_damaged_record_is_passed_over() {
        needs_root();
        let _binding = binding_loop_devices();
        let scratch = Scratch::new("damaged");
        let records = scratch.records();
        let free = LoopDev::get_free().unwrap();
        let damaged = records.join(format!("{}.json", free.path().trim_start_matches("/dev/")));
        std::fs::create_dir_all(&records).unwrap();
        std::fs::write(&damaged, "{\"device\": ").unwrap();
        let (f, _) = scratch.file("new");
        let dev = bind_new(&f, "tcp://127.0.0.1:1/new", &records).unwrap();
        assert_ne!(dev, free);
        assert_eq!(std::fs::read_to_string(&damaged).unwrap(), "{\"device\": ");
        assert_eq!(scratch.load(&dev).unwrap().url, "tcp://127.0.0.1:1/new");
    }
    /// A mount directory is cleaned up only when no process has the pid that names it: a
    /// newer daemon given a dead one's pid has a mount directory of that name.
    #[test]
    fn a_mount_directory_of_a_live_pid_is_not_orphaned() {
        let ours = state::mount_dir_for(std::process::id());
        assert!(!mount_is_orphaned(&ours), "this process's");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(
            mount_is_orphaned(&state::mount_dir_for(pid)),
            "a reaped child's"
        );
    }

    /// The record of a dead mapping on the free device is cleaned up, but not its mount
    /// directory when a live process has the pid that names it now (a reused pid: a live
    /// daemon's mount, or this one's).
    #[test]
    fn a_dead_record_keeps_the_mount_directory_of_a_reused_pid() {
        needs_root();
        let _binding = binding_loop_devices();
        let scratch = Scratch::new("reused");
        let records = scratch.records();
        let free = LoopDev::get_free().unwrap();
        let live_dir = scratch.0.join(std::process::id().to_string());
        std::fs::create_dir_all(&live_dir).unwrap();
        let mut planted = record("tcp://127.0.0.1:1/dead");
        planted.device = free.path();
        // This pid, another process: a dead daemon whose pid this process was given.
        planted.start_time += 1;
        planted.mountpoint = live_dir.display().to_string();
        plant(&records, &planted);
        let (f, _) = scratch.file("new");
        let dev = bind_new(&f, "tcp://127.0.0.1:1/new", &records).unwrap();
        assert_eq!(dev, free, "the dead record's device is taken");
        assert!(
            live_dir.is_dir(),
            "the live pid's mount directory was removed"
        );
    }
}
