//! How a backend's own threads hand results back to a queue thread: a channel of
//! `(tag, result)` plus an eventfd the queue thread watches in its ring (the backend contract's
//! notifier, [`crate::QueueIo::notifier`]). No lock on the data path.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

/// The queue's end: what [`crate::QueueIo::notifier`] and [`crate::QueueIo::reap`] serve.
pub(crate) struct Completions {
    rx: Receiver<(u64, i32)>,
    poster: Poster,
}

/// A backend thread's end; clone one per job.
#[derive(Clone)]
pub(crate) struct Poster {
    tx: Sender<(u64, i32)>,
    wake: Arc<OwnedFd>,
}

impl Completions {
    /// A new channel with its eventfd.
    pub(crate) fn new() -> io::Result<Completions> {
        // SAFETY: creating a new descriptor.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let (tx, rx) = mpsc::channel();
        Ok(Completions {
            rx,
            poster: Poster { tx, wake },
        })
    }

    /// A handle for the threads that post results.
    pub(crate) fn poster(&self) -> Poster {
        self.poster.clone()
    }

    /// The descriptor that becomes readable when results wait.
    pub(crate) fn notifier(&self) -> RawFd {
        self.poster.wake.as_raw_fd()
    }

    /// Hands over every result waiting.
    pub(crate) fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        let mut count: u64 = 0;
        // SAFETY: an 8-byte read from our non-blocking eventfd (EAGAIN when nothing is new).
        unsafe {
            libc::read(
                self.poster.wake.as_raw_fd(),
                (&mut count as *mut u64).cast(),
                8,
            )
        };
        while let Ok((tag, res)) = self.rx.try_recv() {
            done(tag, res);
        }
    }
}

impl Poster {
    /// Posts one result and wakes the queue thread. False once the queue is gone.
    pub(crate) fn post(&self, tag: u64, res: i32) -> bool {
        if self.tx.send((tag, res)).is_err() {
            return false;
        }
        let one: u64 = 1;
        // SAFETY: an 8-byte write to the eventfd, kept open by our Arc.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        true
    }
}
