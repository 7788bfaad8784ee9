//! The reactor's io_uring: what each completion's user data means, and pushing entries.

use std::time::Duration;

use blkwire_backend::Submitter;
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::log::{Level, Throttle};

// user_data layout: kind (4 bits) | incarnation (20 bits) | connection index (24 bits) | slot (16 bits)
pub(super) const KIND_IO: u64 = 1;
pub(super) const KIND_POLL_IN: u64 = 2;
pub(super) const KIND_POLL_OUT: u64 = 3;
pub(super) const KIND_WAKE: u64 = 4;
pub(super) const KIND_CANCEL: u64 = 5;
pub(super) const KIND_PORT_IN: u64 = 6;
pub(super) const KIND_PORT_IO: u64 = 7;
/// A backend that completes on its own threads has results for a connection.
pub(super) const KIND_NOTIFY: u64 = 8;
/// ... or for a datagram queue (connection field as for KIND_PORT_IO).
pub(super) const KIND_PORT_NOTIFY: u64 = 9;

pub(super) fn ud(kind: u64, incarnation: u32, conn: usize, slot: u16) -> u64 {
    kind << 60
        | ((incarnation as u64) & 0xf_ffff) << 40
        | ((conn as u64) & 0xff_ffff) << 16
        | slot as u64
}

/// User data of a datagram queue's backend I/O on port `port`: the connection field carries the
/// port (high 4 bits) and the queue (low 20 bits).
pub(super) fn port_io_ud(port: usize) -> impl Fn(u32, usize, u16) -> u64 {
    move |inc, q, slot| ud(KIND_PORT_IO, inc, port << 20 | (q & 0xf_ffff), slot)
}

/// A multishot POLLIN poll: on a connection's or a datagram port's socket, or on a backend's
/// completion notifier.
pub(super) fn poll_in(fd: i32, user_data: u64) -> squeue::Entry {
    opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
        .multi(true)
        .build()
        .user_data(user_data)
}

pub(super) fn ud_split(u: u64) -> (u64, u32, usize, u16) {
    (
        u >> 60,
        ((u >> 40) & 0xf_ffff) as u32,
        ((u >> 16) & 0xff_ffff) as usize,
        u as u16,
    )
}

/// The reactor's io_uring, with the completions it had to take out of the completion queue
/// while pushing (see [`Pusher`]).
pub(super) struct Ring {
    ring: IoUring,
    /// Completions moved out of a full completion queue, handled with the next batch.
    stash: Vec<cqueue::Entry>,
    /// Submit failures are logged at most once a second.
    failures: Throttle,
}

impl Ring {
    pub(super) fn new(entries: u32) -> std::io::Result<Ring> {
        Ok(Ring {
            ring: IoUring::builder().build(entries)?,
            stash: Vec::new(),
            failures: Throttle::new(),
        })
    }

    /// Whether completions wait, in the queue or taken out of it.
    pub(super) fn has_completions(&mut self) -> bool {
        !self.stash.is_empty() || !self.ring.completion().is_empty()
    }

    /// Moves every waiting completion to `out`, the ones taken out earlier first.
    pub(super) fn take_completions(&mut self, out: &mut Vec<cqueue::Entry>) {
        out.append(&mut self.stash);
        out.extend(self.ring.completion());
    }
}

impl std::ops::Deref for Ring {
    type Target = IoUring;
    fn deref(&self) -> &IoUring {
        &self.ring
    }
}

impl std::ops::DerefMut for Ring {
    fn deref_mut(&mut self) -> &mut IoUring {
        &mut self.ring
    }
}

/// Longest pause between submit attempts that keep failing.
const MAX_BACKOFF: Duration = Duration::from_millis(100);

/// Pauses between failing submits: 50 us, doubling up to [`MAX_BACKOFF`].
#[derive(Default)]
struct Backoff(Duration);

impl Backoff {
    fn next(&mut self) -> Duration {
        self.0 = (self.0 * 2).clamp(Duration::from_micros(50), MAX_BACKOFF);
        self.0
    }
}

/// Pushes to the ring, submitting first when the submission queue is full.
pub(super) struct Pusher<'a>(pub(super) &'a mut Ring);

impl Submitter for Pusher<'_> {
    /// An entry is never dropped: its buffers' owner waits for its completion (a slot stays
    /// busy, a poll stays armed), so dropping one would leak them. When the submission queue
    /// is full and submitting fails: a full completion queue (EBUSY) is emptied into the stash
    /// and the submit retried at once; other failures (the kernel short of memory) are retried
    /// with a growing pause, logged once a second.
    fn push(&mut self, e: squeue::Entry) {
        let mut backoff = Backoff::default();
        loop {
            // SAFETY: every entry's buffers are owned by a slot or the reactor and stay alive until
            // its completion is reaped (slots are never freed while busy).
            if unsafe { self.0.ring.submission().push(&e) }.is_ok() {
                return;
            }
            let err = match self.0.ring.submit() {
                Ok(n) if n > 0 => continue,
                Ok(_) => std::io::Error::from_raw_os_error(libc::EAGAIN),
                Err(err) => err,
            };
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EBUSY) => {
                    let r = &mut *self.0;
                    let before = r.stash.len();
                    r.stash.extend(r.ring.completion());
                    if r.stash.len() > before {
                        continue;
                    }
                }
                _ => {}
            }
            let r = &mut *self.0;
            if let Some(n) = r.failures.hit() {
                crate::log!(
                    Level::Error,
                    "io_uring submit failed {n} time(s): {err}; retrying"
                );
            }
            std::thread::sleep(backoff.next());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More entries than the completion queue holds, pushed without reaping: pushing returns
    /// every time and no completion is lost. (This kernel keeps the overflowing completions
    /// and never fails the submit with EBUSY; older ones do, and the pusher then moves the
    /// queue's completions to the stash.)
    #[test]
    fn pushing_past_a_full_completion_queue_keeps_every_completion() {
        let mut ring = Ring::new(4).unwrap();
        let n = 200u64;
        for i in 0..n {
            Pusher(&mut ring).push(opcode::Nop::new().build().user_data(i));
        }
        let mut got = Vec::new();
        for _ in 0..1000 {
            ring.submit().unwrap();
            ring.take_completions(&mut got);
            if got.len() as u64 >= n {
                break;
            }
        }
        let mut tags: Vec<u64> = got.iter().map(cqueue::Entry::user_data).collect();
        tags.sort_unstable();
        assert_eq!(tags, (0..n).collect::<Vec<_>>());
    }

    /// A failing submit is retried after a pause that doubles up to a limit, not in a loop.
    #[test]
    fn failing_submits_back_off() {
        let mut b = Backoff::default();
        let pauses: Vec<Duration> = (0..14).map(|_| b.next()).collect();
        assert_eq!(pauses[0], Duration::from_micros(50));
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*pauses.last().unwrap(), MAX_BACKOFF);
    }
}
