//! The map daemon: resolves what `map`, `map --recover` and `unmap` ask for, picks the kind of
//! device that serves it, and drives that device through `BlockDevice` (setup, readiness,
//! serving, teardown), daemonised or in the foreground.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Duration;

use blkwire_client::Url;

use crate::device::{self, BlockDevice, FuseIo, Mode, Spec, FUSE_IO_READ};
use crate::fuse::FuseDevice;
use crate::log;
use crate::state::{Liveness, Record};
use crate::ublk::{UblkDevice, UBLK_CONTROL};

/// Runs `$body` with `$D` the `BlockDevice` that serves `$kind`: the one place that maps a kind
/// to its implementation.
macro_rules! with_device {
    ($kind:expr, $D:ident => $body:expr) => {
        match $kind {
            DeviceKind::Ublk => {
                type $D = UblkDevice;
                $body
            }
            // `Auto` never gets here: `choose_kind` resolves it.
            DeviceKind::Fuse | DeviceKind::Auto => {
                type $D = FuseDevice;
                $body
            }
        }
    };
}

/// `--frontend`: which kind of block device serves a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// ublk when the kernel offers /dev/ublk-control, else fuse.
    Auto,
    /// The kernel's userspace block driver (ublk_drv).
    Ublk,
    /// A one-file FUSE filesystem bound to a loop device.
    Fuse,
}

/// The ublk device is built in: `auto` picks it when the kernel offers /dev/ublk-control.
const UBLK_BUILT: bool = true;

/// Resolves `--frontend` to the kind of device that will serve the mapping (never `Auto`), or
/// says why it cannot.
pub fn choose_kind(k: DeviceKind) -> Result<DeviceKind, String> {
    let has_ublk = std::path::Path::new(UBLK_CONTROL).exists();
    match k {
        DeviceKind::Fuse => Ok(DeviceKind::Fuse),
        DeviceKind::Auto if has_ublk && UBLK_BUILT => Ok(DeviceKind::Ublk),
        DeviceKind::Auto => Ok(DeviceKind::Fuse),
        DeviceKind::Ublk if !has_ublk => Err(format!(
            "the ublk frontend needs {UBLK_CONTROL}, which this machine lacks (Linux >= 6.5 with ublk_drv loaded: modprobe ublk_drv); use --frontend fuse"
        )),
        DeviceKind::Ublk if !UBLK_BUILT => Err(
            "the ublk frontend is not in this build yet; use --frontend fuse".into(),
        ),
        DeviceKind::Ublk => Ok(DeviceKind::Ublk),
    }
}

/// The kind of device `device` names; what names neither is left to fuse to refuse.
fn kind_of(device: &str) -> DeviceKind {
    if UblkDevice::names(device) {
        DeviceKind::Ublk
    } else {
        DeviceKind::Fuse
    }
}

/// Everything `blkwire map` was asked for.
#[derive(Clone, Debug)]
pub struct MapOptions {
    /// The export: tcp://HOST:PORT/EXPORT (or another transport's URL).
    pub url: String,
    /// Map read-only even if the export is writable.
    pub readonly: bool,
    /// Queues (worker threads); 0: one per CPU, at most 8.
    pub queues: u16,
    /// Requests in flight per queue (the target may grant fewer).
    pub queue_depth: u16,
    /// Largest I/O in bytes (the target and the kernel may cap it).
    pub max_io: u32,
    /// Mark the device rotational.
    pub hdd: bool,
    /// Use this device number (/dev/loopN, /dev/ublkbN) instead of a free one.
    pub dev_num: Option<u32>,
    /// Serve in this process instead of a daemon.
    pub foreground: bool,
    /// Where the daemon logs (else nowhere; stderr in the foreground).
    pub logfile: Option<PathBuf>,
    /// How long I/O waits for an unreachable target before failing with EIO.
    pub timeout: Duration,
    /// `--frontend`: which kind of device serves the mapping.
    pub kind: DeviceKind,
    /// fuse frontend: FUSE over io_uring or read/writev on /dev/fuse.
    pub fuse_io: FuseIo,
    /// Host id, key file and encryption of the session (PROTOCOL.md §12).
    pub credentials: blkwire_client::Credentials,
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
    let kind = choose_kind(o.kind)?;
    with_device!(kind, D => map_as::<D>(o, url, on_ready))
}

fn map_as<D: BlockDevice>(
    o: &MapOptions,
    url: Url,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
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
        fuse_io: o.fuse_io,
        credentials: o.credentials.clone(),
    };
    D::check(&spec)?;
    D::preflight()?;
    launch::<D>(spec, o.foreground, on_ready)
}

/// `map --recover DEV`: re-serves a mapping whose daemon died, when its device allows it.
pub fn recover(
    device: &str,
    foreground: bool,
    logfile: Option<PathBuf>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
    with_device!(kind_of(device), D => recover_as::<D>(device, foreground, logfile, on_ready))
}

fn recover_as<D: BlockDevice>(
    device: &str,
    foreground: bool,
    logfile: Option<PathBuf>,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
    D::preflight()?;
    let (rec, path, readonly) = D::recoverable(device)?;
    let spec = recovery_spec(rec, &path, logfile, readonly)?;
    launch::<D>(spec, foreground, on_ready)
}

/// What a recovering daemon runs: the mapping as its record describes it.
fn recovery_spec(
    rec: Record,
    path: &str,
    logfile: Option<PathBuf>,
    readonly: bool,
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
        credentials: (&rec.credentials).into(),
        mode: Mode::Recover(Box::new(rec)),
        fuse_io,
    })
}

/// `unmap DEV`: ends a mapping whether or not its daemon is alive, and never waits without bound
/// (but on kernels before 6.9, whose only ublk deletion waits for every process holding the
/// device open to let go: `Ctrl::remove`).
pub fn unmap(device: &str) -> Result<(), String> {
    // One word for every kind, before any looks at a record or a device: the kinds' own
    // checks speak of mapping (a FUSE mount, a loop device) or fail on a record's permissions.
    if !crate::sys::is_root() {
        return Err(format!("unmapping {device} needs root: run it as root"));
    }
    with_device!(kind_of(device), D => D::unmap(device))
}

/// What `ls` says about the mapping `rec` records (`BlockDevice::liveness`).
pub(crate) fn liveness(rec: &Record) -> Liveness {
    with_device!(kind_of(&rec.device), D => D::liveness(rec))
}

/// How the daemon reports readiness (or the error that prevented it).
enum Notify<'a> {
    /// Daemonised: one line to the waiting parent, "ok DEV" or "error MESSAGE".
    Pipe(Option<File>),
    /// Foreground: the caller prints the device; errors come back as `Err`.
    Call(&'a mut dyn FnMut(&str)),
}

impl Notify<'_> {
    /// Reports the ready device; false when nobody heard it: the waiting `map` is gone (killed,
    /// or interrupted by Ctrl-C, which never reaches a daemon in its own session).
    fn ready(&mut self, dev: &str) -> bool {
        match self {
            Notify::Pipe(p) => match p.take() {
                Some(mut f) => writeln!(f, "ok {dev}").is_ok(),
                None => true,
            },
            Notify::Call(f) => {
                f(dev);
                true
            }
        }
    }

    fn failed(&mut self, msg: &str) {
        if let Notify::Pipe(p) = self {
            if let Some(mut f) = p.take() {
                let _ = writeln!(f, "error {msg}");
            }
        }
    }
}

fn launch<D: BlockDevice>(
    spec: Spec,
    foreground: bool,
    on_ready: &mut dyn FnMut(&str),
) -> Result<(), String> {
    if foreground {
        let Some(l) = &spec.logfile else {
            return run::<D>(&spec, &mut Notify::Call(on_ready));
        };
        let f = open_log(l)?;
        // SAFETY: a copy of our own stderr (close-on-exec), kept to restore it.
        let terminal = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
        // SAFETY: dup2 of the log onto stderr, which the log lines go to.
        unsafe { libc::dup2(f.as_raw_fd(), 2) };
        let result = run::<D>(&spec, &mut Notify::Call(on_ready));
        if terminal >= 0 {
            // The error `map` prints reaches the terminal, not only the log (which has it too).
            // SAFETY: restoring stderr from the descriptor duplicated above, then closing it.
            unsafe {
                libc::dup2(terminal, 2);
                libc::close(terminal);
            }
        }
        return result;
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
        // A write to the pipe of a `map` that is gone must fail with EPIPE, which `run`
        // answers by undoing the mapping, not kill the daemon with its device half made.
        // SAFETY: setting a signal's disposition in the single thread of the fresh child.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let _ = std::env::set_current_dir("/");
        let code = match run::<D>(&spec, &mut Notify::Pipe(Some(wr))) {
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

fn run<D: BlockDevice>(spec: &Spec, notify: &mut Notify<'_>) -> Result<(), String> {
    let d = match setup::<D>(spec) {
        Ok(d) => d,
        Err(e) => {
            // In the foreground without a log file, the error `map` prints is the line.
            if matches!(notify, Notify::Pipe(_)) || spec.logfile.is_some() {
                log!("error", "{e}");
            }
            notify.failed(&e);
            return Err(e);
        }
    };
    let path = d.path();
    if !notify.ready(&path) {
        // Nobody was told the device exists, and whoever asked for it gave up: a mapping
        // nobody knows of must not stay. It stops at once, even if something grabbed it as it
        // appeared (udev, LVM, an automounter): a stop signal would be refused for a held
        // ublk device, and would only defer a held loop device's detach.
        let e = format!("the map command that started this daemon is gone: removing {path}");
        log!("error", "{e}");
        d.stop_now()?;
        return Err(e);
    }
    d.serve()
}

/// The device's preconditions, then the export's session (so an unknown export or an unreachable
/// target fails before anything exists), then the device. `map --recover` of a ublk device
/// fences the dead daemon's queues in `prepare`, so before this session exists.
fn setup<D: BlockDevice>(spec: &Spec) -> Result<D, String> {
    let prepared = D::prepare(spec)?;
    let conn = device::connect(spec, D::RECOVERS_GROWN)?;
    D::setup(spec, prepared, conn)
}
