//! The blkwire queue's socket watched by an io_uring, so a thread that sleeps in its ring (FUSE
//! over io_uring, ublk) wakes for the target's answers as it does for the kernel's requests.
//!
//! One POLL_ADD per queue, one-shot and added again before the thread sleeps once it has fired:
//! a poll checks readiness when it is added, so data left unread can never leave the thread
//! asleep, and a busy thread gets one completion per sleep rather than one per arriving packet.
//! A reconnection brings a new `Queue` with a new socket: the poll on the old one is removed (it
//! holds the old socket open while armed), and one is added for the new one. Queues are told apart by a number their owner changes with every new queue,
//! not by descriptor numbers, which the kernel reuses.

use std::os::fd::RawFd;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

/// Whether `io_uring_enter` failed for now only, the entries left queued for the next call:
/// interrupted, the wait timed out, the completion queue full (reap first), or the kernel
/// short of memory for requests (EAGAIN). A queue thread that ended on one of these would
/// fail every request it holds.
fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::ETIME | libc::EBUSY | libc::EAGAIN)
    )
}

/// Makes room in a full submission queue of `ring` by submitting it: interrupted, or the
/// kernel short of memory for requests (EAGAIN, for at most about a second), it tries again;
/// anything else (EBUSY: completions must be reaped first, which the caller cannot do here)
/// is an error.
pub(crate) fn submit_for_room<S, C>(ring: &mut IoUring<S, C>) -> std::io::Result<()>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    let mut tries = 0;
    loop {
        match ring.submit() {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && tries < 1000 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            r => return r.map(|_| ()),
        }
    }
}

/// Submits what is queued in `ring`; a transient failure (`transient`) is not an error.
pub(crate) fn submit<S, C>(ring: &mut IoUring<S, C>) -> Result<(), String>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    match ring.submit() {
        Err(e) if !transient(&e) => Err(format!("io_uring submit: {e}")),
        _ => Ok(()),
    }
}

/// Submits what is queued and sleeps in `ring` until a completion, or at most `limit`. A
/// transient failure (`transient`) is not an error; one that did not wait (EAGAIN) pauses a
/// millisecond, so a thread does not spin while the kernel is short of memory.
pub(crate) fn sleep<S, C>(ring: &mut IoUring<S, C>, limit: Option<Duration>) -> Result<(), String>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    let r = match limit {
        None => ring.submit_and_wait(1),
        Some(d) => {
            let ts = types::Timespec::from(d);
            let args = types::SubmitArgs::new().timespec(&ts);
            ring.submitter().submit_with_args(1, &args)
        }
    };
    match r {
        Err(e) if !transient(&e) => Err(format!("io_uring wait: {e}")),
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            let pause = Duration::from_millis(1);
            std::thread::sleep(limit.map_or(pause, |l| l.min(pause)));
            Ok(())
        }
        _ => Ok(()),
    }
}

/// user_data of our SQEs: bit 62 set, bit 63 clear, a serial number below. The rings' other
/// user_data are small indices and values near u64::MAX (bit 63 set).
const TAG: u64 = 1 << 62;
/// The POLL_REMOVE's own completion (serial 0: never a poll's).
const REMOVE: u64 = TAG;

#[derive(Default)]
pub(crate) struct SockPoll {
    /// Queue number and user_data of the armed poll.
    armed: Option<(u64, u64)>,
    serial: u64,
}

impl SockPoll {
    /// Is this completion one of ours?
    pub(crate) fn owns(user_data: u64) -> bool {
        user_data >> 62 == 1
    }

    /// Takes a completion of ours: a poll that fired (or failed) is added again by the next
    /// `update`. (A completion with the MORE flag would be a multishot poll's, still armed.)
    pub(crate) fn on_cqe(&mut self, user_data: u64, flags: u32) {
        if self.armed.is_some_and(|(_, ud)| ud == user_data) && !cqueue::more(flags) {
            self.armed = None;
        }
    }

    /// The SQEs that make the ring watch `want` (queue number, socket), or nothing when the
    /// worker has no queue: at most a POLL_REMOVE of the old poll and a POLL_ADD.
    pub(crate) fn update(&mut self, want: Option<(u64, RawFd)>) -> [Option<squeue::Entry>; 2] {
        let mut out = [None, None];
        if let Some((queue, ud)) = self.armed {
            if want.is_some_and(|(q, _)| q == queue) {
                return out;
            }
            out[0] = Some(opcode::PollRemove::new(ud).build().user_data(REMOVE));
            self.armed = None;
        }
        if let Some((queue, fd)) = want {
            self.serial = (self.serial + 1) % (TAG - 1);
            let ud = TAG | (self.serial + 1);
            out[1] = Some(
                opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                    .build()
                    .user_data(ud),
            );
            self.armed = Some((queue, ud));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel may refuse for now (EAGAIN: short of memory for requests; EBUSY: reap
    /// first; EINTR) leaves a queue thread running; anything else ends it.
    #[test]
    fn only_passing_ring_failures_are_taken_for_transient() {
        for e in [libc::EAGAIN, libc::EBUSY, libc::EINTR, libc::ETIME] {
            assert!(transient(&std::io::Error::from_raw_os_error(e)), "{e}");
        }
        for e in [libc::EBADF, libc::EFAULT, libc::EINVAL, libc::ENXIO] {
            assert!(!transient(&std::io::Error::from_raw_os_error(e)), "{e}");
        }
        // A ring's submit of nothing succeeds through the helper as it does by itself.
        let mut ring: IoUring = IoUring::new(4).expect("an io_uring");
        submit(&mut ring).unwrap();
        submit_for_room(&mut ring).unwrap();
        sleep(&mut ring, Some(Duration::from_millis(1))).unwrap();
    }

    #[test]
    fn a_new_queue_replaces_the_poll_on_the_old_socket() {
        let mut p = SockPoll::default();
        let [rm, add] = p.update(Some((1, 5)));
        assert!(rm.is_none());
        let ud = add.expect("armed").get_user_data();
        assert!(SockPoll::owns(ud) && !SockPoll::owns(u64::MAX) && !SockPoll::owns(7));
        // The same queue: nothing to do, even while its poll fires.
        p.on_cqe(ud, 1 << 1); // IORING_CQE_F_MORE
        assert!(matches!(p.update(Some((1, 5))), [None, None]));
        // The poll ended: armed again.
        p.on_cqe(ud, 0);
        let [rm, add] = p.update(Some((1, 5)));
        assert!(rm.is_none());
        let ud2 = add.expect("armed again").get_user_data();
        assert_ne!(ud, ud2);
        // A reconnection reused the descriptor number: still a new queue, a new poll.
        let [rm, add] = p.update(Some((2, 5)));
        assert!(rm.is_some() && add.is_some());
        // The removed poll's last completion changes nothing.
        p.on_cqe(ud2, 0);
        assert!(matches!(p.update(Some((2, 5))), [None, None]));
        // No queue: removed, nothing added.
        assert!(matches!(p.update(None), [Some(_), None]));
        assert!(matches!(p.update(None), [None, None]));
    }
}
