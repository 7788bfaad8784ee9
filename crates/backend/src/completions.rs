//! How a backend's own threads hand results back to a queue thread: a channel of
//! `(tag, result)` (the result an `i32` unless the backend posts more, as `rbd:` does) plus an
//! eventfd the queue thread watches in its ring (the backend contract's notifier,
//! [`crate::QueueIo::notifier`]). No lock on the data path. The eventfd is written only when
//! the queue thread may be asleep: by the first result after it last reaped, not by every one
//! (a burst of completions costs one wake-up and one write, not one each).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

/// The queue's end: what [`crate::QueueIo::notifier`] and [`crate::QueueIo::reap`] serve.
pub(crate) struct Completions<R = i32> {
    rx: Receiver<(u64, R)>,
    poster: Poster<R>,
}

/// A backend thread's end; clone one per job.
pub(crate) struct Poster<R = i32> {
    tx: Sender<(u64, R)>,
    wake: Arc<OwnedFd>,
    /// Set by the post that wrote the eventfd, cleared by the reaper before it drains: while
    /// it is set, a wake-up is already on its way and later posts need not write.
    woken: Arc<AtomicBool>,
}

// Not derived: that would ask `R: Clone`, and a sender clones whatever it carries.
impl<R> Clone for Poster<R> {
    fn clone(&self) -> Self {
        Poster {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
            woken: self.woken.clone(),
        }
    }
}

impl<R> Completions<R> {
    /// A new channel with its eventfd.
    pub(crate) fn new() -> io::Result<Completions<R>> {
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
            poster: Poster {
                tx,
                wake,
                woken: Arc::new(AtomicBool::new(false)),
            },
        })
    }

    /// A handle for the threads that post results.
    pub(crate) fn poster(&self) -> Poster<R> {
        self.poster.clone()
    }

    /// The descriptor that becomes readable when results wait.
    pub(crate) fn notifier(&self) -> RawFd {
        self.poster.wake.as_raw_fd()
    }

    /// Hands over every result waiting.
    pub(crate) fn reap(&mut self, done: &mut dyn FnMut(u64, R)) {
        let mut count: u64 = 0;
        // SAFETY: an 8-byte read from our non-blocking eventfd (EAGAIN when nothing is new).
        unsafe {
            libc::read(
                self.poster.wake.as_raw_fd(),
                (&mut count as *mut u64).cast(),
                8,
            )
        };
        // Cleared after the eventfd is read and before the drain: a post that finds the flag
        // set sent its result before this point, so the drain below takes it; a post that finds
        // it clear writes the eventfd again. (Cleared before the read, a post between the clear
        // and the read had its write consumed here, and a later post that found the flag set
        // was left with no wake-up: the many-threads test caught that.)
        self.poster.woken.store(false, Ordering::SeqCst);
        while let Ok((tag, res)) = self.rx.try_recv() {
            done(tag, res);
        }
    }
}

impl<R> Poster<R> {
    /// Posts one result and wakes the queue thread. False once the queue is gone.
    pub(crate) fn post(&self, tag: u64, res: R) -> bool {
        if self.tx.send((tag, res)).is_err() {
            return false;
        }
        if self.woken.swap(true, Ordering::SeqCst) {
            return true;
        }
        let one: u64 = 1;
        // SAFETY: an 8-byte write to the eventfd, kept open by our Arc.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eventfd's counter (0 when it has not been written since the last read).
    fn pending_wakes(c: &Completions) -> u64 {
        let mut p = libc::pollfd {
            fd: c.notifier(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        if unsafe { libc::poll(&mut p, 1, 0) } == 0 {
            return 0;
        }
        let mut count: u64 = 0;
        // SAFETY: an 8-byte read from our non-blocking eventfd.
        unsafe { libc::read(c.notifier(), (&mut count as *mut u64).cast(), 8) };
        count
    }

    #[test]
    fn a_burst_wakes_once_and_the_next_result_after_a_reap_wakes_again() {
        let mut c = Completions::new().unwrap();
        let p = c.poster();
        assert!(p.post(1, 10) && p.post(2, 20) && p.post(3, 30));
        assert_eq!(pending_wakes(&c), 1, "one write for the burst");
        let mut got = Vec::new();
        c.reap(&mut |t, r| got.push((t, r)));
        assert_eq!(got, [(1, 10), (2, 20), (3, 30)]);
        // After the reap, the next result must wake the queue thread again.
        assert!(p.post(4, 40));
        assert_eq!(pending_wakes(&c), 1);
        got.clear();
        c.reap(&mut |t, r| got.push((t, r)));
        assert_eq!(got, [(4, 40)]);
    }

    #[test]
    fn results_from_many_threads_all_arrive_and_none_is_left_without_a_wake() {
        let mut c = Completions::new().unwrap();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let p = c.poster();
                std::thread::spawn(move || {
                    for i in 0..50_000u64 {
                        p.post(t * 100_000 + i, 0);
                    }
                })
            })
            .collect();
        let mut n = 0;
        while n < 200_000 {
            // Wait for a wake-up, as the reactor does, then reap: a result posted without
            // one would leave this loop waiting forever (the test's timeout catches it).
            let mut p = libc::pollfd {
                fd: c.notifier(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the call.
            let r = unsafe { libc::poll(&mut p, 1, 10_000) };
            assert_eq!(r, 1, "{n} results arrived, then no wake-up for 10 s");
            c.reap(&mut |_, _| n += 1);
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(n, 200_000);
    }
}
