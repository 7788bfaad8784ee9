//! Process plumbing: signal masks, waiting for another process to exit (pidfd), killing it
//! without pid-reuse races, the root check; an eventfd to wake a sleeping thread, and where a
//! block device is mounted or whether anything holds it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::state;

/// The kernel's page size (4 KiB on x86, 16 or 64 KiB on some arm64 kernels): what it counts
/// FUSE's max_pages and ublk's buffers in.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no side effects.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

/// Blocks SIGINT/SIGTERM/SIGHUP in the calling thread (and every thread it starts later), so
/// they are only ever taken by the thread that `sigwait`s on the returned set.
pub fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: building and applying a signal mask for this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits for one of the signals in `set` (blocked by `block_stop_signals`) and returns it.
fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: sigwait on a set blocked in every thread.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

/// Starts the thread that turns each signal of `set` into the event `wrap(signal)` on `tx`,
/// until the receiver is gone.
pub fn spawn_signal_thread<E: Send + 'static>(
    set: libc::sigset_t,
    tx: std::sync::mpsc::Sender<E>,
    wrap: fn(i32) -> E,
) -> Result<(), String> {
    std::thread::Builder::new()
        .name("blkwire-signals".into())
        .spawn(move || loop {
            if tx.send(wrap(wait_signal(&set))).is_err() {
                break;
            }
        })
        .map(|_| ())
        .map_err(|e| format!("starting the signal thread: {e}"))
}

/// Marks the calling thread, and the threads it starts later, as an I/O flusher
/// (PR_SET_IO_FLUSHER): their memory allocations never wait on I/O reclaim, which could need
/// the very device this daemon serves, as for any userspace block driver.
pub fn set_io_flusher() -> io::Result<()> {
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The effective user is root.
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A process we may wait for and signal, pinned by a pidfd so a reused pid is never hit.
pub struct Proc {
    fd: OwnedFd,
}

impl Proc {
    /// Opens `pid` if it is the process that started at `start_time` and has not exited.
    pub fn open(pid: i32, start_time: u64) -> Option<Proc> {
        // SAFETY: pidfd_open(pid, 0) returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let p = Proc { fd };
        // Checked after opening: from now on the pidfd refers to this very process.
        state::process_alive(pid, start_time).then_some(p)
    }

    /// Waits up to `timeout` for the process to exit; true when it has.
    pub fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut p = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: poll on one pollfd of ours; a pidfd turns readable when the process exits.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n > 0 {
                return true;
            }
            if n == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return n > 0;
            }
        }
    }

    /// Sends `sig` to this very process (never to a later owner of its pid).
    pub fn kill(&self, sig: i32) -> io::Result<()> {
        // SAFETY: pidfd_send_signal(fd, sig, NULL, 0).
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// An eventfd the reconnection thread signals, so the worker (polling /dev/fuse) wakes as soon
/// as the attempt ends instead of at its next tick.
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub(crate) fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker { fd })
    }

    pub(crate) fn wake(fd: RawFd) {
        let one = 1u64;
        // SAFETY: an 8-byte write to an eventfd.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub(crate) fn clear(&self) {
        Waker::clear_fd(self.fd.as_raw_fd());
    }

    /// Consumes the signal of a waker's eventfd, given by descriptor (the FUSE ring holds it so).
    pub(crate) fn clear_fd(fd: RawFd) {
        let mut v = 0u64;
        // SAFETY: an 8-byte read from a non-blocking eventfd.
        unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    }
}

/// Where the block device `name` (as under /sys/block, e.g. `loop3`, `ublkb0`) is mounted in our
/// mount namespace, from /proc/self/mountinfo.
pub fn mount_points(name: &str) -> Vec<String> {
    let Ok(dev) = std::fs::read_to_string(format!("/sys/block/{name}/dev")) else {
        return Vec::new();
    };
    let dev = dev.trim();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let majmin = f.nth(2)?;
            let at = f.nth(1)?;
            (majmin == dev).then(|| at.to_string())
        })
        .collect()
}

/// Whether the block device at `path` is held: the block layer refuses an exclusive open
/// (O_EXCL, EBUSY) while the device is mounted in any mount namespace, a partition of it is
/// mounted or held, or device-mapper (LVM), md or swap sits on it, none of which
/// /proc/self/mountinfo shows. A device that cannot be opened otherwise (gone: ENOENT, ENXIO)
/// is not held.
pub fn held_exclusively(path: &str) -> bool {
    let Ok(c) = CString::new(path) else {
        return false;
    };
    // SAFETY: open of a NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_EXCL | libc::O_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: a fresh descriptor we own; closing it ends our own exclusive claim at once.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        return false;
    }
    io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY)
}

/// How long a hold on a block device may last before `unmap` (or a ublk daemon, on a signal)
/// calls it in use: the kernel drops a filesystem's claim shortly after umount returns (or
/// after the last process of a mount namespace exits), not always before.
pub const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// Waits up to `grace` for the block device at `path` to be held by nobody (`held_exclusively`);
/// true when it is not held. The kernel drops a filesystem's claim shortly after umount returns
/// (or after the last process of a mount namespace exits), not always before.
pub fn released_within(path: &str, grace: Duration) -> bool {
    let deadline = Instant::now() + grace;
    while held_exclusively(path) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
