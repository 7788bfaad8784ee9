//! A ublk device as the daemon drives it (`UblkDevice`): create it (or take over a quiesced
//! one), start a thread per queue, serve until stopped, then delete it.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use blkwire_wire::Features;

use super::abi::*;
use super::control::{probe, Ctrl};
use super::queue::{QEvent, QueueWorker};
use crate::device::{self, answer_limit, BlockDevice, Connected, FuseIo, Mode, Needs, Spec};
use crate::log;
use crate::state::{self, Liveness, Record, RecordBook};
use crate::sys::{self, Proc};

fn wait_for_path(p: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while !Path::new(p).exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

fn preflight() -> Result<(), String> {
    if !sys::is_root() {
        return Err("mapping needs root: it creates a ublk device".into());
    }
    if !Path::new(UBLK_CONTROL).exists() {
        return Err(format!(
            "the ublk frontend needs {UBLK_CONTROL}, which this machine lacks (Linux >= 6.5 with ublk_drv loaded: modprobe ublk_drv)"
        ));
    }
    Ok(())
}
struct Undo<'a> {
    ctrl: &'a mut Ctrl,
    dev_id: Option<u32>,
    started: bool,
    /// Queue threads hold the char device: delete without waiting for it.
    threads: bool,
    record: Option<String>,
    restore: Option<Record>,
    /// The record as this daemon keeps it, once saved: undoing goes through it, so that a
    /// queue's reconnection ending meanwhile cannot write it again.
    book: Option<Arc<RecordBook>>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        // The device first (a new one: a recovery's stays, its record restored): its record
        // goes only once it is gone, so that one this daemon could not delete stays listed
        // (dead, once this process has exited) for `unmap` to finish.
        let mut gone = true;
        if let Some(id) = self.dev_id {
            if self.started {
                let _ = self.ctrl.stop(id);
            }
            // With queue threads of ours holding the char device, only without waiting.
            gone = if self.threads {
                self.ctrl.delete_async(id).is_ok()
            } else {
                self.ctrl.remove(id).is_ok()
            };
        }
        match (self.restore.take(), &self.book) {
            (Some(old), Some(book)) => book.close_restoring(old),
            (Some(old), None) => {
                let _ = old.save();
            }
            (None, book) if !gone => {
                let device = device_path(self.dev_id.expect("only a new device is deleted"));
                if book.is_some() {
                    log!(
                        "error",
                        "{device} could not be deleted: its record stays, for `blkwire unmap \
                         {device}` to finish"
                    );
                } else {
                    // No record of this daemon's was written for it.
                    let id = self.dev_id.expect("only a new device is deleted");
                    log!(
                        "error",
                        "{device} could not be deleted, and this daemon wrote no record of it: \
                         remove it with the ublk tools (`ublk del -n {id}`)"
                    );
                }
            }
            (None, Some(book)) if self.record.is_some() => book.close(),
            // Before this daemon's record was written (`RecordBook::create` refuses another
            // live daemon's, or its lock timed out): only a record of ours goes, as in fuse.
            (None, _) => {
                if let Some(d) = &self.record {
                    Record::remove_if_owned(d, std::process::id() as i32);
                }
            }
        }
    }
}

/// A ublk device with its queue threads running.
pub(crate) struct UblkDevice(Running);

impl BlockDevice for UblkDevice {
    const KIND: &'static str = "ublk";
    type Prepared = Prepared;
    const RECOVERS_GROWN: bool = true;

    fn preflight() -> Result<(), String> {
        preflight()
    }

    fn names(device: &str) -> bool {
        parse_device(device).is_some()
    }

    fn check(spec: &Spec) -> Result<(), String> {
        if spec.fuse_io == FuseIo::Uring {
            return Err(
                "--fuse-io uring applies to the fuse frontend; this mapping would use ublk (add --frontend fuse)"
                    .into(),
            );
        }
        Ok(())
    }

    fn prepare(spec: &Spec) -> Result<Prepared, String> {
        state::ensure_dirs().map_err(|e| format!("{}: {e}", state::run_dir().display()))?;
        let mut ctrl = Ctrl::open()?;
        probe(&mut ctrl)?;
        let recovering = match &spec.mode {
            Mode::New { .. } => None,
            Mode::Recover(old) => Some(begin_recovery(&mut ctrl, old, spec)?),
        };
        Ok(Prepared { ctrl, recovering })
    }

    fn setup(spec: &Spec, prepared: Prepared, conn: Connected) -> Result<UblkDevice, String> {
        setup(spec, prepared, conn).map(UblkDevice)
    }

    fn path(&self) -> String {
        device_path(self.0.dev_id)
    }

    fn serve(self) -> Result<(), String> {
        serve(self.0, false);
        Ok(())
    }

    fn stop_now(self) -> Result<(), String> {
        serve(self.0, true);
        Ok(())
    }

    fn recoverable(device: &str) -> Result<(Record, String, bool), String> {
        let not_ours = |path: &str| {
            format!("{path} is not a blkwire device (`blkwire ls` lists the mapped devices)")
        };
        let path = device_path(parse_device(device).ok_or_else(|| not_ours(device))?);
        let rec = Record::load(&path)?.ok_or_else(|| not_ours(&path))?;
        if rec.frontend != Self::KIND {
            return Err(format!("{path} is not a blkwire ublk device"));
        }
        if rec.liveness() == state::Liveness::Running {
            return Err(format!(
                "{path} is still served by pid {}: nothing to recover",
                rec.pid
            ));
        }
        let readonly = rec.readonly;
        Ok((rec, path, readonly))
    }

    fn unmap(device: &str) -> Result<(), String> {
        let id = parse_device(device).ok_or_else(|| {
            format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)")
        })?;
        unmap(device, id)
    }

    fn liveness(rec: &Record) -> Liveness {
        liveness(rec)
    }
}

/// Whether the ublk device `di` (GET_DEV_INFO) is the one `rec` was written for, and not another
/// that got its number after ours was deleted (by another ublk server, or a blkwire mapping whose
/// record went): recovering or unmapping it would take over or delete someone else's device; the
/// error says why it is another, and the caller what it then does. The kernel reports the pid
/// that started (or last recovered) the device; kernels with the pid-namespace fix ("ublk: fix
/// ublksrv pid handling for pid namespaces", 2026) report -1 once that process is gone, which is
/// always so here, and then only the shape can be compared: queues, depth, the I/O buffer size
/// (the driver only rounds it down to a page, which ours already is, so the record keeps exactly
/// the kernel's) and the recovery flags every blkwire device is made with. Not the size, which
/// GET_DEV_INFO does not report (records written before a recovery kept the device's size
/// hold the export's, which may have grown).
fn is_recorded(di: &DevInfo, rec: &Record) -> Result<(), String> {
    if di.ublksrv_pid != rec.pid && di.ublksrv_pid != -1 {
        let by = match di.ublksrv_pid {
            0 => "has not been started".to_string(),
            pid => format!("was started by pid {pid}"),
        };
        return Err(format!(
            "{} {by}, not by the recorded blkwire pid {}: it is another device under that number",
            rec.device, rec.pid
        ));
    }
    let shape =
        |queues, depth, io| format!("{queues} queue(s) of depth {depth}, I/O up to {io} bytes");
    if (di.nr_hw_queues, di.queue_depth, di.max_io_buf_bytes)
        != (rec.queues, rec.queue_depth, rec.max_io)
    {
        return Err(format!(
            "{} has {}, its record {}: it is another device under that number",
            rec.device,
            shape(di.nr_hw_queues, di.queue_depth, di.max_io_buf_bytes),
            shape(rec.queues, rec.queue_depth, rec.max_io)
        ));
    }
    const RECOVERY: u64 = UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE;
    if di.flags & RECOVERY != RECOVERY {
        return Err(format!(
            "{} was not made with USER_RECOVERY and USER_RECOVERY_REISSUE (flags {:#x}), as every blkwire device is: it is another device under that number",
            rec.device, di.flags
        ));
    }
    Ok(())
}

/// The largest I/O the device may take: the session's max I/O capped at `MAX_IO_BUF`, in whole
/// pages (the driver's tag buffers are). Rounded down: a page more than the session grants
/// would let the kernel send requests that no command of the session can carry. A session that
/// grants less than a page cannot serve a ublk device.
fn io_buf_bytes(session_max_io: u32, page: u32) -> Result<u32, String> {
    let max_io = session_max_io.min(MAX_IO_BUF) / page * page;
    if max_io == 0 {
        return Err(format!(
            "the target grants I/O of at most {session_max_io} bytes, less than a page ({page}): a ublk device cannot take I/O that small"
        ));
    }
    Ok(max_io)
}

/// How many queues serve a new device, from ADD_DEV's answer: the driver caps the queues asked
/// for at its CPU count (nr_cpu_ids), and a queue beyond what it made has no descriptor array
/// to map (mmap fails with EINVAL).
fn device_queues(asked: usize, made: u16) -> Result<usize, String> {
    match made as usize {
        0 => Err("the kernel's ublk driver made a device with no queue".into()),
        n if n > asked => Err(format!(
            "the kernel's ublk driver made {n} queues where {asked} were asked for"
        )),
        n => Ok(n),
    }
}

/// What `prepare` hands to `setup`.
pub(crate) struct Prepared {
    ctrl: Ctrl,
    /// `map --recover`: the device being taken over, as GET_DEV_INFO described it once the
    /// kernel had quiesced it, the dead daemon fenced ([`begin_recovery`]).
    recovering: Option<(u32, DevInfo)>,
}

/// How long `map --recover` waits at least for the kernel to notice that the old daemon died
/// (`quiesce_wait`).
const QUIESCE_WAIT: Duration = Duration::from_secs(30);

/// How long `map --recover` waits for the kernel to quiesce `device`: a queue whose every tag
/// the dead daemon held (requests waiting in an outage keep theirs) has no command io_uring
/// could cancel, so quiescing waits for the block layer's request timeout (the queue's
/// `io_timeout`, 30 s unless an administrator raised it): at least that and 5 s more.
fn quiesce_wait(device: &str) -> Duration {
    let name = device.rsplit('/').next().unwrap_or(device);
    let io_timeout = std::fs::read_to_string(format!("/sys/block/{name}/queue/io_timeout"))
        .ok()
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(Duration::from_millis);
    wait_beyond(io_timeout)
}

/// `quiesce_wait` for a device whose request timeout is `io_timeout` (None: unreadable).
fn wait_beyond(io_timeout: Option<Duration>) -> Duration {
    io_timeout.map_or(QUIESCE_WAIT, |t| {
        (t + Duration::from_secs(5)).max(QUIESCE_WAIT)
    })
}

/// The logical block size the kernel gives `device` (/dev/ublkbN), if it can be read.
fn logical_block(device: &str) -> Option<u32> {
    let name = device.rsplit('/').next().unwrap_or(device);
    std::fs::read_to_string(format!("/sys/block/{name}/queue/logical_block_size"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether the kernel takes `device` (/dev/ublkbN) for a disk with a volatile write cache
/// (its queue's `write_cache`, set from UBLK_ATTR_VOLATILE_CACHE when it was made, which an
/// administrator may have changed since): for records of older versions, which do not say.
/// Unknown (unreadable) counts as no cache: a recovery then refuses an export that caches
/// writes rather than risk what the kernel would never flush.
fn write_back(device: &str) -> bool {
    let name = device.rsplit('/').next().unwrap_or(device);
    std::fs::read_to_string(format!("/sys/block/{name}/queue/write_cache"))
        .is_ok_and(|mode| mode.trim() == "write back")
}

/// `map --recover`, before the new daemon connects its session: checks that the device is the
/// one `old` records, waits until the kernel says its old server is gone, then fences the dead
/// daemon's queues on the target (PROTOCOL.md §2.6). In that order: a `map --recover` that
/// misjudged a live daemon as dead (liveness comes from /proc, pid and start time, which
/// another pid namespace does not see) is refused before it closes that daemon's sessions, and
/// a damaged record is refused before a session is made for each queue it claims.
///
/// The kernel's word is GET_DEV_INFO's state QUIESCED, which the driver sets once the server's
/// queue rings were torn down (the process died or is dying) and the device's I/O is held: the
/// same state START_USER_RECOVERY requires, without its side effects. START_USER_RECOVERY
/// itself comes after the fence and the new session, in `setup`: on Linux 6.12 a second
/// START_USER_RECOVERY fails (EINVAL: no queue ready) until a new server has fetched all the
/// tags of a queue, so a fence that failed (target unreachable, a write still stuck there) after
/// it would leave a device no later `map --recover` can take. Failing here leaves the device as
/// it was.
fn begin_recovery(ctrl: &mut Ctrl, old: &Record, spec: &Spec) -> Result<(u32, DevInfo), String> {
    let id = parse_device(&old.device)
        .ok_or_else(|| format!("bad device '{}' in the record", old.device))?;
    let mut di = ctrl
        .dev_info(id)
        .map_err(|e| format!("{}: GET_DEV_INFO: {e}", old.device))?;
    is_recorded(&di, old).map_err(|e| format!("{e}; cannot recover"))?;
    let fence = device::fence_plan(old, di.nr_hw_queues)?;
    // The kernel quiesces the device a few seconds after the old daemon died, or once its
    // requests time out (`quiesce_wait`).
    let wait = quiesce_wait(&old.device);
    let deadline = Instant::now() + wait;
    while di.state != UBLK_S_DEV_QUIESCED {
        if Instant::now() >= deadline {
            return Err(format!(
                "{}: the kernel has not quiesced the device after {}s, its request timeout and 5 s more (state {}): its server still runs (in another pid namespace?) or the device is not recoverable; nothing fenced, cannot recover",
                old.device,
                wait.as_secs(),
                di.state
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
        di = ctrl
            .dev_info(id)
            .map_err(|e| format!("{}: GET_DEV_INFO: {e}", old.device))?;
        is_recorded(&di, old).map_err(|e| format!("{e}; cannot recover"))?;
    }
    device::fence_dead_daemon(
        &old.device,
        fence,
        &spec.url,
        &device::connect_options(spec)?,
    )?;
    Ok((id, di))
}

struct Running {
    ctrl: Ctrl,
    dev_id: u32,
    events: mpsc::Receiver<QEvent>,
    queues: usize,
    timeout: Duration,
    /// The device's record, which the queues' reconnections update.
    book: Arc<RecordBook>,
}

fn setup(spec: &Spec, prepared: Prepared, conn: Connected) -> Result<Running, String> {
    let Prepared {
        mut ctrl,
        recovering,
    } = prepared;
    let Connected {
        mut session,
        info,
        reconnect,
        readonly,
    } = conn;
    let rotational = spec.hdd || info.features.has(Features::ROTATIONAL);
    let sigs = sys::block_stop_signals();
    if let Err(e) = sys::set_io_flusher() {
        log!("warn", "PR_SET_IO_FLUSHER: {e}");
    }
    let asked = session.queues.len();
    let depth = (info.depth as usize).clamp(1, UBLK_MAX_QUEUE_DEPTH);
    let max_io = io_buf_bytes(info.max_io, page_size() as u32)?;

    let mut ctrl2 = Ctrl::open()?; // the one Undo holds; `ctrl` stays for the main loop
    let mut undo = Undo {
        ctrl: &mut ctrl2,
        dev_id: None,
        started: false,
        threads: false,
        record: None,
        restore: None,
        book: None,
    };
    let pid = std::process::id() as i32;
    // What the kernel is told about the device's write cache (UBLK_ATTR_VOLATILE_CACHE): this
    // session's FLUSH for a new device; a recovered one keeps what it was made with (a recovery
    // sets no parameters), as its record says.
    let volatile_cache = match &spec.mode {
        Mode::Recover(old) => old
            .volatile_cache
            .unwrap_or_else(|| write_back(&old.device)),
        _ => info.features.has(Features::FLUSH),
    };
    let (dev_id, nq, depth, max_io) = match &spec.mode {
        Mode::New { dev_num } => {
            let mut di = DevInfo {
                nr_hw_queues: asked as u16,
                queue_depth: depth as u16,
                max_io_buf_bytes: max_io,
                dev_id: dev_num.unwrap_or(u32::MAX),
                flags: UBLK_F_USER_RECOVERY
                    | UBLK_F_USER_RECOVERY_REISSUE
                    | UBLK_F_CMD_IOCTL_ENCODE
                    | UBLK_F_URING_CMD_COMP_IN_TASK,
                ..Default::default()
            };
            undo.ctrl.add(&mut di).map_err(|e| match dev_num {
                Some(n) if e.raw_os_error() == Some(libc::EEXIST) => {
                    format!("{} already exists", device_path(*n))
                }
                _ => format!("creating a ublk device (ADD_DEV): {e}"),
            })?;
            undo.dev_id = Some(di.dev_id);
            if di.flags & UBLK_F_USER_RECOVERY == 0 {
                return Err("the kernel's ublk driver dropped USER_RECOVERY from the device flags; use --frontend fuse".into());
            }
            let nq = device_queues(asked, di.nr_hw_queues)?;
            if nq < asked {
                log!(
                    "info",
                    "the kernel's ublk driver takes at most {nq} queue(s) (one per CPU): using {nq} of the {asked} the target granted"
                );
            }
            let max_io = di.max_io_buf_bytes.min(max_io);
            let mut p = params_for(&info, readonly, rotational, max_io);
            undo.ctrl.set_params(di.dev_id, &mut p).map_err(|e| {
                format!(
                    "setting the parameters of ublk device {} (SET_PARAMS): {e}",
                    di.dev_id
                )
            })?;
            (di.dev_id, nq, di.queue_depth as usize, max_io)
        }
        Mode::Recover(old) => {
            // Checked against the record, quiesced and fenced in `prepare`.
            let (id, di) =
                recovering.ok_or_else(|| format!("{}: recovery was not prepared", old.device))?;
            if di.nr_hw_queues as usize != asked {
                return Err(format!(
                    "{} has {} queue(s) but the target granted {asked}: cannot recover",
                    old.device, di.nr_hw_queues
                ));
            }
            if di.max_io_buf_bytes > max_io {
                return Err(format!(
                    "{} takes I/O of up to {} bytes but the target now grants {max_io}: cannot recover",
                    old.device, di.max_io_buf_bytes
                ));
            }
            if (di.queue_depth as usize) > depth {
                return Err(format!(
                    "{} has queue depth {} but the target now grants {depth}: cannot recover",
                    old.device, di.queue_depth
                ));
            }
            // A recovery sets no parameters: the device keeps the logical block it was made
            // with, and an export of larger blocks would refuse its I/O (EINVAL); smaller
            // ones take it.
            let export_block = info.logical_block.clamp(512, 4096);
            if let Some(lbs) = logical_block(&old.device).filter(|&b| b < export_block) {
                return Err(format!(
                    "{} has logical blocks of {lbs} bytes but the export's are now \
                     {export_block}: cannot recover",
                    old.device
                ));
            }
            if !readonly && !volatile_cache && info.features.has(Features::FLUSH) {
                return Err(format!(
                    "{} was set up without a write cache and the export now has one (it offers \
                     FLUSH): the kernel would never flush what it writes; cannot recover",
                    old.device
                ));
            }
            // EBUSY until the dead daemon's char device is closed (it may still be exiting).
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match ctrl.start_recovery(id) {
                    Ok(()) => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(200))
                    }
                    Err(e) => {
                        return Err(format!(
                            "{}: START_USER_RECOVERY: {e} (state {})",
                            old.device, di.state
                        ))
                    }
                }
            }
            undo.restore = Some((**old).clone());
            (id, asked, di.queue_depth as usize, di.max_io_buf_bytes)
        }
    };
    let device = device_path(dev_id);
    // A recovered device keeps the size it was made with (a recovery sets no parameters),
    // whatever the export has grown to: the record, the reconnections' check and the log say
    // that size.
    let size = match &spec.mode {
        Mode::Recover(old) => old.size,
        _ => info.size,
    };
    let record = Record {
        device: device.clone(),
        url: spec.url.to_string(),
        export: spec.url.export.clone(),
        frontend: UblkDevice::KIND.into(),
        pid,
        start_time: state::self_start_time(),
        mountpoint: String::new(),
        file: String::new(),
        size,
        readonly,
        queues: nq as u16,
        queue_depth: depth as u16,
        max_io,
        timeout_secs: spec.timeout.as_secs(),
        hdd: spec.hdd,
        logfile: spec.logfile.clone(),
        fuse_io: None,
        credentials: (&spec.credentials).into(),
        // The queues the device will use (the rest are logged out below), recorded before any
        // is used: a recovery fences them.
        queue_refs: Some(
            session.queues[..nq]
                .iter()
                .map(|q| q.identity().map(Into::into))
                .collect(),
        ),
        volatile_cache: Some(volatile_cache),
    };
    if let Mode::New { .. } = spec.mode {
        check_earlier_record(&device, Record::load(&device))?;
        undo.record = Some(device.clone());
    }
    let book = Arc::new(
        RecordBook::create(record).map_err(|e| format!("writing the record of {device}: {e}"))?,
    );
    undo.book = Some(Arc::clone(&book));

    let cdev_path = format!("/dev/ublkc{dev_id}");
    if !wait_for_path(&cdev_path, Duration::from_secs(5)) {
        return Err(format!("{cdev_path} did not appear"));
    }
    let cdev = Arc::new(
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&cdev_path)
            .map_err(|e| format!("{cdev_path}: {e}"))?,
    );
    let needs = Needs {
        size,
        logical_block: info.logical_block,
        max_io,
        // Every tag may be in flight at once, one command each.
        depth: depth as u16,
        writable: !readonly,
        volatile_cache,
    };

    // Queues the device does not have end cleanly rather than by a dropped connection.
    for q in session.queues.drain(nq..) {
        let _ = q.logout();
    }
    let (tx, events) = mpsc::channel();
    // Every queue's worker (its mapping, ring and buffers) is made before any starts fetching:
    // one that cannot be made then fails the setup with no queue fetched. After
    // START_USER_RECOVERY, some queues fetched and others not is the state a 6.12 kernel
    // handles worst on the next attempt (it takes the unfetched ones' missing server).
    let mut workers = Vec::with_capacity(nq);
    for (i, q) in session.queues.into_iter().enumerate() {
        workers.push(QueueWorker::new(
            i as u16,
            Arc::clone(&cdev),
            depth,
            max_io as usize,
            q,
            spec.url.clone(),
            reconnect.clone(),
            readonly,
            spec.timeout,
            needs,
            Arc::clone(&book),
        )?);
    }
    for (i, w) in workers.into_iter().enumerate() {
        let tx = tx.clone();
        undo.threads = true;
        std::thread::Builder::new()
            .name(format!("blkwire-ublk-q{i}"))
            .spawn(move || w.run(tx))
            .map_err(|e| format!("starting a queue thread: {e}"))?;
    }
    drop(cdev);
    let mut fetched = 0;
    while fetched < nq {
        match events.recv_timeout(Duration::from_secs(10)) {
            Ok(QEvent::Fetched(_, Ok(()))) => fetched += 1,
            Ok(QEvent::Fetched(i, Err(e))) => return Err(format!("ublk queue {i}: {e}")),
            Ok(QEvent::Exited(i, e)) => {
                return Err(format!(
                    "ublk queue {i} stopped during setup: {}",
                    e.unwrap_or_default()
                ))
            }
            Ok(QEvent::Signal(_)) => {}
            Err(_) => return Err("the ublk queues did not start in time".into()),
        }
    }
    match &spec.mode {
        Mode::New { .. } => {
            undo.ctrl
                .start(dev_id)
                .map_err(|e| format!("starting {device} (START_DEV): {e}"))?;
            undo.started = true;
        }
        Mode::Recover(_) => {
            ctrl.end_recovery(dev_id)
                .map_err(|e| format!("{device}: END_USER_RECOVERY: {e}"))?;
            // The kernel names this process the device's server from here on: a failure after
            // it keeps this daemon's record (which names it too, for `map --recover` and
            // `unmap` to find), not the dead one's, which would then name another process.
            undo.restore = None;
        }
    }
    if !wait_for_path(&device, Duration::from_secs(5)) {
        return Err(format!("{device} did not appear"));
    }
    sys::spawn_signal_thread(sigs, tx, QEvent::Signal)?;
    undo.dev_id = None;
    undo.record = None;
    undo.restore = None;
    undo.book = None;
    drop(undo);
    log!(
        "info",
        "{device} serves {} ({} bytes{}): {nq} queue(s) x depth {depth}, I/O up to {} KiB, I/O timeout {}s",
        spec.url,
        size,
        if readonly { ", read-only" } else { "" },
        max_io / 1024,
        spec.timeout.as_secs()
    );
    Ok(Running {
        ctrl,
        dev_id,
        events,
        queues: nq,
        timeout: spec.timeout,
        book,
    })
}

/// Serves until the mapping ends, then deletes the device; with `stop_now`, stops it at once
/// (STOP_DEV, whatever holds it) and only waits for the queues to end.
fn serve(mut r: Running, stop_now: bool) {
    let device = device_path(r.dev_id);
    let mut exited = 0;
    let mut stopping = false;
    let stop = |r: &mut Running, why: &str| {
        log!("info", "{why}: stopping {device}");
        if let Err(e) = r.ctrl.stop(r.dev_id) {
            log!("error", "stopping {device}: {e}");
        }
    };
    if stop_now {
        stopping = true;
        stop(&mut r, "nobody was told of it");
    }
    // When the last stop signal was refused, while that refusal stands.
    let mut refused: Option<Instant> = None;
    while exited < r.queues {
        let ev = if stopping {
            match r
                .events
                .recv_timeout(answer_limit(r.timeout) + Duration::from_secs(5))
            {
                Ok(ev) => ev,
                Err(_) => {
                    log!("warn", "the ublk queues did not stop in time");
                    break;
                }
            }
        } else if let Some(at) = refused {
            // Only this thread probes, never a queue's: the I/O goes on meanwhile.
            match r.events.recv_timeout(PROBE_EVERY) {
                Ok(ev) => ev,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    match after_refusal(at.elapsed(), || sys::held_exclusively(&device)) {
                        AfterRefusal::Wait => {}
                        AfterRefusal::Stop => {
                            stopping = true;
                            stop(&mut r, "released after a stop signal");
                        }
                        AfterRefusal::Expire => {
                            refused = None;
                            log!(
                                "info",
                                "{device} is still in use {}s after a stop signal: serving on (the next signal is refused again while it is in use)",
                                REFUSAL_EXPIRY.as_secs()
                            );
                        }
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match r.events.recv() {
                Ok(ev) => ev,
                Err(_) => break,
            }
        };
        match ev {
            QEvent::Signal(sig) => {
                let in_use = || !sys::released_within(&device, sys::RELEASE_GRACE);
                match on_signal(stopping, refused.map(|at| at.elapsed()), in_use) {
                    OnSignal::Ignore => {}
                    OnSignal::Refuse => {
                        refused = Some(Instant::now());
                        log!(
                            "warn",
                            "signal {sig}: {device} is in use (mounted, or {HOLDERS}): still serving it; it stops once released within {}s, or signal again to stop it anyway",
                            REFUSAL_EXPIRY.as_secs()
                        );
                    }
                    OnSignal::Stop => {
                        stopping = true;
                        stop(&mut r, &format!("signal {sig}"));
                    }
                }
            }
            QEvent::Exited(i, e) => {
                exited += 1;
                if let Some(e) = e {
                    log!("error", "ublk queue {i} stopped: {e}");
                }
                if !stopping {
                    // The device was stopped from outside, or a queue failed: stop it all.
                    stopping = true;
                    let _ = r.ctrl.stop(r.dev_id);
                }
            }
            QEvent::Fetched(..) => {}
        }
    }
    let deleted = if exited == r.queues {
        r.ctrl.remove(r.dev_id)
    } else {
        // Stuck queue threads still hold the char device: the kernel deletes the device once
        // this process is gone.
        r.ctrl.delete_async(r.dev_id)
    };
    match deleted {
        // A reconnection still running (its queue thread is gone) cannot bring the record back.
        Ok(()) => r.book.close(),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => r.book.close(),
        Err(e) => {
            // The record stays (dead once this process exits), so `ls` still shows the
            // device and `unmap` can finish.
            log!(
                "error",
                "deleting {device}: {e}; its record stays, for `blkwire unmap {device}` to finish"
            );
            return;
        }
    }
    log!("info", "{device} unmapped");
}

/// What the daemon does with a stop signal (SIGTERM, SIGINT, SIGHUP).
#[derive(Debug, PartialEq, Eq)]
enum OnSignal {
    /// STOP_DEV: the device goes, and any I/O to it fails.
    Stop,
    /// Log and keep serving: the device is in use.
    Refuse,
    /// Already stopping.
    Ignore,
}

/// Decides a stop signal, `refused` the time since the last refusal if any: a device in use
/// (`in_use`, asked only when it decides) is not torn down under its users at the first signal,
/// as `unmap` would not either; a signal within `REFUSAL_EXPIRY` of a refusal stops it whatever
/// holds it, for a user who means it; a later one is a first signal again. The refused signal
/// is not forgotten meanwhile: the device stops once released (`after_refusal`), as at shutdown,
/// where a setsid daemon gets SIGTERM and, about 90 s later, SIGKILL (which leaves the device
/// quiesced for `map --recover`, and a final umount or sync of it blocked), but no second
/// signal: unmounting it must be what lets the daemon stop.
fn on_signal(stopping: bool, refused: Option<Duration>, in_use: impl FnOnce() -> bool) -> OnSignal {
    let refused = refused.is_some_and(|d| d < REFUSAL_EXPIRY);
    if stopping {
        OnSignal::Ignore
    } else if !refused && in_use() {
        OnSignal::Refuse
    } else {
        OnSignal::Stop
    }
}

/// How long a refused stop signal stands: the device stops if released within it, and another
/// signal within it stops the device whatever holds it.
const REFUSAL_EXPIRY: Duration = Duration::from_secs(60);

/// How often the daemon asks, after a refusal, whether the device was released.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// What a probe after a refused stop signal leads to.
#[derive(Debug, PartialEq, Eq)]
enum AfterRefusal {
    /// The device was released: the refused signal takes effect.
    Stop,
    /// Still held, and the signal was refused `REFUSAL_EXPIRY` ago: forget it.
    Expire,
    /// Still held: probe again.
    Wait,
}

/// Decides a probe `since` a refused stop signal; `held` asks whether the device is still held.
fn after_refusal(since: Duration, held: impl FnOnce() -> bool) -> AfterRefusal {
    if !held() {
        AfterRefusal::Stop
    } else if since >= REFUSAL_EXPIRY {
        AfterRefusal::Expire
    } else {
        AfterRefusal::Wait
    }
}

/// What `unmap` does with the device its record names, once the recorded daemon is gone.
#[derive(Debug, PartialEq, Eq)]
enum UnmapAction {
    /// The device is the recorded one: STOP_DEV and DEL_DEV, then the record goes.
    Delete,
    /// Nothing of the mapping is left in the kernel: only the record goes.
    Forget,
    /// The number is another device's: leave that device alone, remove the record (it describes
    /// a device that no longer exists) and fail with this.
    Refuse(String),
    /// GET_DEV_INFO failed otherwise, so nothing is known about the device: change nothing and
    /// fail with this.
    Fail(String),
}

/// Decides `unmap` from whether the recorded daemon was alive when unmap began (it has been
/// stopped since) and what GET_DEV_INFO says now. A daemon that was alive owned the device and
/// deleted it on its way out unless it had to be killed, so another device under the number got
/// it afterwards and is no concern of this unmap; with a daemon that was already dead, the
/// record may have outlived its device by any time, and the user named a device that is not
/// blkwire's.
fn unmap_action(was_alive: bool, info: io::Result<DevInfo>, rec: &Record) -> UnmapAction {
    match info {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => UnmapAction::Forget,
        Err(e) => UnmapAction::Fail(format!(
            "{}: GET_DEV_INFO: {e}: cannot tell whether the device is still blkwire's; nothing was stopped or deleted",
            rec.device
        )),
        Ok(di) => match is_recorded(&di, rec) {
            Ok(()) => UnmapAction::Delete,
            Err(_) if was_alive => UnmapAction::Forget,
            // Never started, with the record's shape and flags: its daemon died between
            // recording it and starting it (killed while it waited for its queues, say), and
            // nothing else started it since. Left, it would hold its number for ever.
            Err(_)
                if di.ublksrv_pid == 0
                    && is_recorded(
                        &DevInfo {
                            ublksrv_pid: rec.pid,
                            ..di
                        },
                        rec,
                    )
                    .is_ok() =>
            {
                UnmapAction::Delete
            }
            Err(e) => UnmapAction::Refuse(format!(
                "{e}; left it alone and removed blkwire's stale record of {}",
                rec.device
            )),
        },
    }
}

/// `ls`: a dead daemon's record whose device is gone or is another one now is stale; dead when
/// that cannot be told (no access to /dev/ublk-control).
fn liveness(rec: &Record) -> Liveness {
    let l = rec.liveness();
    if l != Liveness::Dead {
        return l;
    }
    let (Some(id), Ok(mut ctrl)) = (parse_device(&rec.device), Ctrl::open()) else {
        return l;
    };
    dead_liveness(ctrl.dev_info(id), rec)
}

/// A dead daemon's mapping, from GET_DEV_INFO of its number: stale wherever `unmap` would find
/// no device of its own to delete.
fn dead_liveness(info: io::Result<DevInfo>, rec: &Record) -> Liveness {
    match unmap_action(false, info, rec) {
        UnmapAction::Forget | UnmapAction::Refuse(_) => Liveness::Stale,
        UnmapAction::Delete | UnmapAction::Fail(_) => Liveness::Dead,
    }
}

/// Refuses to end a device that is in use, as the fuse frontend does: STOP_DEV would tear it down
/// under its users (a filesystem on it or on a partition of it, in this mount namespace or
/// another, device-mapper or md on top), whose writes would then fail.
fn refuse_in_use(path: &str) -> Result<(), String> {
    if let Some(at) = sys::mount_points(path.trim_start_matches("/dev/")).first() {
        return Err(format!(
            "{path} is mounted on {at}: unmount it first, then unmap it"
        ));
    }
    if !sys::released_within(path, sys::RELEASE_GRACE) {
        return Err(format!(
            "{path} is in use ({HOLDERS}): release it first, then unmap it"
        ));
    }
    Ok(())
}

/// What holds a device that is not mounted in our mount namespace, for messages.
const HOLDERS: &str = "a partition of it mounted, a mount in another mount namespace, device-mapper, md or swap on it";

/// A record found for the number ADD_DEV just gave a new device belongs to a device deleted
/// since: it is replaced, unless its daemon still runs (then that daemon would take this
/// device for its own). One that does not parse (damaged, edited by hand) is replaced too,
/// logged: the kernel hands out the lowest free number, so refusing it would fail every map.
fn check_earlier_record(
    device: &str,
    loaded: Result<Option<Record>, String>,
) -> Result<(), String> {
    match loaded {
        Ok(Some(old)) if old.liveness() == state::Liveness::Running => Err(format!(
            "{device} is still recorded for blkwire pid {}",
            old.pid
        )),
        Ok(_) => Ok(()),
        Err(e) => {
            log!("warn", "{e}; {device} is new: its record is replaced");
            Ok(())
        }
    }
}

/// `unmap /dev/ublkbN`: a live daemon is asked to stop (SIGTERM) and waited for; a dead one's
/// device is stopped and deleted here, but only if GET_DEV_INFO says it is still the recorded
/// one (`unmap_action`): the number of a device deleted behind blkwire's back may be another
/// server's now. Between GET_DEV_INFO and STOP_DEV the device could still be deleted and its
/// number taken by someone else; the control interface names devices only by number, so no
/// check can close that window.
fn unmap(device: &str, id: u32) -> Result<(), String> {
    let path = device_path(id);
    let not_ours =
        || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
    let rec = Record::load(&path)?.ok_or_else(not_ours)?;
    if rec.frontend != UblkDevice::KIND {
        return Err(not_ours());
    }
    preflight()?;
    let mut ctrl = Ctrl::open()?;
    let action = match Proc::open(rec.pid, rec.start_time) {
        Some(p) => {
            refuse_in_use(&path)?;
            let _ = p.kill(libc::SIGTERM);
            let limit =
                answer_limit(Duration::from_secs(rec.timeout_secs)) + Duration::from_secs(10);
            if !p.wait_exit(limit) {
                // A daemon that found the device in use refused the signal and serves on,
                // probing it each second; killing it would end the device under its users all
                // the same. Probed over a grace period, not once: the daemon's own probe holds
                // the device for a moment, and two at once would each see the other as a user.
                if !sys::released_within(&path, sys::RELEASE_GRACE) {
                    return Err(format!(
                        "{path} came into use while unmap asked pid {} to stop, which serves it on: release it, then unmap it again",
                        rec.pid
                    ));
                }
                let _ = p.kill(libc::SIGKILL);
                p.wait_exit(Duration::from_secs(10));
            }
            unmap_action(true, ctrl.dev_info(id), &rec)
        }
        None => {
            // Identified first: a device in use that is not ours is no reason to release it.
            let action = unmap_action(false, ctrl.dev_info(id), &rec);
            if action == UnmapAction::Delete {
                refuse_in_use(&path)?;
            }
            action
        }
    };
    match action {
        UnmapAction::Delete => {
            // ENODEV: deleted meanwhile (by its daemon, dying after the check).
            match ctrl.stop(id) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Err(e) => return Err(format!("stopping {path}: {e}")),
            }
            match ctrl.remove(id) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
                Err(e) => return Err(format!("deleting {path}: {e}")),
            }
        }
        UnmapAction::Forget => {}
        UnmapAction::Refuse(e) => {
            Record::remove_if_owned(&path, rec.pid);
            return Err(e);
        }
        UnmapAction::Fail(e) => return Err(e),
    }
    // Unless a `map --recover` or a new mapping of the number wrote its own meanwhile.
    Record::remove_if_owned(&path, rec.pid);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `map --recover` waits past the device's request timeout, which may hold the quiesce.
    #[test]
    fn recovery_waits_past_the_request_timeout() {
        assert_eq!(wait_beyond(None), QUIESCE_WAIT);
        assert_eq!(
            wait_beyond(Some(Duration::from_secs(30))),
            Duration::from_secs(35)
        );
        assert_eq!(wait_beyond(Some(Duration::from_secs(1))), QUIESCE_WAIT);
        assert_eq!(
            wait_beyond(Some(Duration::from_secs(120))),
            Duration::from_secs(125)
        );
    }

    #[test]
    fn the_io_buffer_never_exceeds_what_the_session_grants() {
        assert_eq!(io_buf_bytes(1 << 20, 4096), Ok(1 << 20));
        // Rounded down to whole pages, never up past the session's max I/O.
        assert_eq!(io_buf_bytes((1 << 20) - 512, 4096), Ok((1 << 20) - 4096));
        assert_eq!(io_buf_bytes(6000, 4096), Ok(4096));
        assert_eq!(io_buf_bytes(32 << 10, 16384), Ok(32 << 10));
        assert_eq!(io_buf_bytes(8 << 20, 4096), Ok(MAX_IO_BUF));
        // Less than a page: refused in one line, not a page the target would refuse.
        let e = io_buf_bytes(2048, 4096).unwrap_err();
        assert!(e.contains("2048") && e.contains("less than a page"), "{e}");
        assert!(io_buf_bytes(4096, 16384).is_err());
    }

    #[test]
    fn a_new_device_has_the_queues_the_kernel_made() {
        // --queues 8 on a 2-CPU machine: ADD_DEV made 2.
        assert_eq!(device_queues(8, 2), Ok(2));
        assert_eq!(device_queues(4, 4), Ok(4));
        assert!(device_queues(4, 0).is_err());
        assert!(device_queues(2, 3).is_err());
    }

    fn record() -> Record {
        Record::sample(2)
    }

    /// The device `record()` describes as GET_DEV_INFO reports it, started by `pid`: flags as
    /// the kernel answers ADD_DEV for blkwire's (it adds CMD_IOCTL_ENCODE and COMP_IN_TASK).
    fn info(pid: i32) -> DevInfo {
        DevInfo {
            nr_hw_queues: 2,
            queue_depth: 64,
            max_io_buf_bytes: 1 << 20,
            dev_id: 3,
            ublksrv_pid: pid,
            state: UBLK_S_DEV_QUIESCED,
            flags: UBLK_F_USER_RECOVERY
                | UBLK_F_USER_RECOVERY_REISSUE
                | UBLK_F_CMD_IOCTL_ENCODE
                | UBLK_F_URING_CMD_COMP_IN_TASK,
            ..Default::default()
        }
    }

    /// Devices that are not the recorded one, each with what makes it another.
    fn others() -> Vec<(&'static str, DevInfo)> {
        vec![
            ("another pid", info(4243)),
            (
                "never started, another depth",
                DevInfo {
                    queue_depth: 128,
                    ..info(0)
                },
            ),
            (
                "another depth",
                DevInfo {
                    queue_depth: 128,
                    ..info(-1)
                },
            ),
            (
                "fewer queues",
                DevInfo {
                    nr_hw_queues: 1,
                    ..info(4242)
                },
            ),
            (
                "another I/O size",
                DevInfo {
                    max_io_buf_bytes: 512 << 10,
                    ..info(-1)
                },
            ),
            (
                "no recovery",
                DevInfo {
                    flags: UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_URING_CMD_COMP_IN_TASK,
                    ..info(-1)
                },
            ),
            (
                "recovery without reissue",
                DevInfo {
                    flags: UBLK_F_USER_RECOVERY | UBLK_F_CMD_IOCTL_ENCODE,
                    ..info(-1)
                },
            ),
        ]
    }

    /// A record left for the number a new device was given is replaced, damaged or not,
    /// unless its daemon still runs.
    #[test]
    fn a_new_devices_earlier_record_is_replaced_unless_its_daemon_runs() {
        let dev = "/dev/ublkb0";
        assert!(check_earlier_record(dev, Ok(None)).is_ok());
        assert!(
            check_earlier_record(dev, Ok(Some(record()))).is_ok(),
            "pid 4242 is gone"
        );
        let damaged = Err(format!("{dev}: unreadable mapping record"));
        assert!(
            check_earlier_record(dev, damaged).is_ok(),
            "a damaged one too"
        );
        let running = Record {
            pid: std::process::id() as i32,
            start_time: crate::state::self_start_time(),
            ..record()
        };
        let e = check_earlier_record(dev, Ok(Some(running))).unwrap_err();
        assert!(e.contains("still recorded for blkwire pid"), "{e}");
    }

    #[test]
    fn recover_takes_only_the_recorded_device() {
        let rec = record();
        assert_eq!(is_recorded(&info(4242), &rec), Ok(()));
        // A kernel that reports -1 for a server that is gone.
        assert_eq!(is_recorded(&info(-1), &rec), Ok(()));
        for (what, di) in others() {
            let e = is_recorded(&di, &rec).expect_err(what);
            assert!(
                e.starts_with("/dev/ublkb3 ") && e.contains("another device"),
                "{what}: {e}"
            );
        }
        let e = is_recorded(&info(0), &rec).unwrap_err();
        assert!(e.contains("has not been started"), "{e}");
        let e = is_recorded(&info(4243), &rec).unwrap_err();
        assert!(
            e.contains("started by pid 4243") && e.contains("pid 4242"),
            "{e}"
        );
    }

    fn gone() -> io::Result<DevInfo> {
        Err(io::Error::from_raw_os_error(libc::ENODEV))
    }

    #[test]
    fn unmap_deletes_only_the_recorded_device() {
        let rec = record();
        for alive in [false, true] {
            // A dead daemon's device, or one its daemon left when it had to be killed.
            assert_eq!(
                unmap_action(alive, Ok(info(4242)), &rec),
                UnmapAction::Delete
            );
            assert_eq!(unmap_action(alive, Ok(info(-1)), &rec), UnmapAction::Delete);
            // Deleted by an admin or another tool, or by the daemon on its way out.
            assert_eq!(unmap_action(alive, gone(), &rec), UnmapAction::Forget);
            // Nothing known: nothing done, and the record kept.
            let eperm = Err(io::Error::from_raw_os_error(libc::EPERM));
            match unmap_action(alive, eperm, &rec) {
                UnmapAction::Fail(e) => {
                    assert!(e.contains("GET_DEV_INFO") && e.contains("nothing"), "{e}")
                }
                a => panic!("GET_DEV_INFO failed, yet {a:?}"),
            }
        }
        // Never started: its dead daemon's, deleted; one a live daemon left went with it.
        assert_eq!(unmap_action(false, Ok(info(0)), &rec), UnmapAction::Delete);
        assert_eq!(unmap_action(true, Ok(info(0)), &rec), UnmapAction::Forget);
        for (what, di) in others() {
            // The daemon ran until unmap stopped it, and its device went with it: whatever has
            // the number since is none of this unmap's business.
            assert_eq!(
                unmap_action(true, Ok(di), &rec),
                UnmapAction::Forget,
                "{what}"
            );
            match unmap_action(false, Ok(di), &rec) {
                UnmapAction::Refuse(e) => assert!(
                    e.contains("another device")
                        && e.contains("left it alone")
                        && e.ends_with("stale record of /dev/ublkb3")
                        && !e.contains('\n'),
                    "{what}: {e}"
                ),
                a => panic!("{what}: {a:?}"),
            }
        }
    }

    #[test]
    fn a_stop_signal_does_not_end_a_device_in_use_until_it_comes_again() {
        let recent = Some(Duration::from_secs(5));
        assert_eq!(on_signal(false, None, || false), OnSignal::Stop);
        assert_eq!(on_signal(false, None, || true), OnSignal::Refuse);
        // The second signal ends it whatever holds it, without asking.
        let unasked = || -> bool { panic!("asked whether the device is in use") };
        assert_eq!(on_signal(false, recent, unasked), OnSignal::Stop);
        assert_eq!(on_signal(true, None, unasked), OnSignal::Ignore);
        assert_eq!(on_signal(true, recent, unasked), OnSignal::Ignore);
    }

    #[test]
    fn a_refusal_expires_so_a_much_later_signal_is_a_first_one() {
        let old = Some(REFUSAL_EXPIRY + Duration::from_secs(3600));
        assert_eq!(on_signal(false, old, || true), OnSignal::Refuse);
        assert_eq!(on_signal(false, old, || false), OnSignal::Stop);
        assert_eq!(
            on_signal(false, Some(REFUSAL_EXPIRY), || true),
            OnSignal::Refuse
        );
    }

    #[test]
    fn a_refused_signal_stops_the_device_once_released_until_it_expires() {
        let soon = Duration::from_secs(1);
        assert_eq!(after_refusal(soon, || true), AfterRefusal::Wait);
        assert_eq!(after_refusal(soon, || false), AfterRefusal::Stop);
        assert_eq!(after_refusal(REFUSAL_EXPIRY, || true), AfterRefusal::Expire);
        // Released as it expires: the signal still takes effect.
        assert_eq!(after_refusal(REFUSAL_EXPIRY, || false), AfterRefusal::Stop);
    }

    #[test]
    fn ls_calls_a_dead_mapping_stale_once_its_device_is_gone_or_another() {
        let rec = record();
        assert_eq!(dead_liveness(Ok(info(4242)), &rec), Liveness::Dead);
        assert_eq!(dead_liveness(Ok(info(-1)), &rec), Liveness::Dead);
        assert_eq!(dead_liveness(gone(), &rec), Liveness::Stale);
        for (what, di) in others() {
            assert_eq!(dead_liveness(Ok(di), &rec), Liveness::Stale, "{what}");
        }
        // Not known: still dead, which `map --recover` and `unmap` will look into.
        let eacces = Err(io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(dead_liveness(eacces, &rec), Liveness::Dead);
    }
}
