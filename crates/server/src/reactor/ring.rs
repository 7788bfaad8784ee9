//! The reactor's io_uring: what each completion's user data means, and pushing entries.

use blkwire_backend::Submitter;
use io_uring::{opcode, squeue, types, IoUring};

use crate::log::Level;

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

/// A multishot poll on a backend's completion notifier.
pub(super) fn notifier_poll(fd: i32, user_data: u64) -> squeue::Entry {
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

/// Pushes to the ring, submitting first when the submission queue is full.
pub(super) struct Pusher<'a>(pub(super) &'a mut IoUring);

impl Submitter for Pusher<'_> {
    fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: every entry's buffers are owned by a slot or the reactor and stay alive until
            // its completion is reaped (slots are never freed while busy).
            if unsafe { self.0.submission().push(&e) }.is_ok() {
                return;
            }
            if let Err(err) = self.0.submit() {
                crate::log!(Level::Error, "io_uring submit failed: {err}");
                std::thread::yield_now();
            }
        }
    }
}
