//! Process plumbing: signal masks, waiting for another process to exit (pidfd), killing it
//! without pid-reuse races, and the root check.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::state;

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

pub fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: sigwait on a set blocked in every thread.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
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
        let p = Proc {
            fd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        };
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
