//! For tests of the ends that use this crate (the target's datagram port, the initiator's
//! datagram queue): sending what a peer's kernel would.

use std::net::UdpSocket;
use std::os::fd::AsRawFd;

use crate::udp_offload::{IoVecs, SendBatch};

/// Sends `frames` (equal lengths but for a shorter last) from `from`, connected to the
/// receiver, as one segmented send: the run a peer's segmentation makes of them. Panics if
/// the send fails or sends fewer datagrams (a test's setup gone wrong).
pub fn send_run(from: &UdpSocket, frames: &[Vec<u8>]) {
    let run: Vec<u8> = frames.concat();
    let mut iov = IoVecs::default();
    let mut batch = SendBatch::<1>::new(&mut iov);
    // SAFETY: `run` outlives the send; 0: to the connected peer.
    unsafe {
        batch.push(
            [(run.as_ptr(), run.len())],
            frames[0].len(),
            frames.len(),
            |_| 0,
        )
    };
    let sent = batch.send(from.as_raw_fd()).ok().expect("the run is sent");
    assert_eq!(sent.datagrams, frames.len());
}
