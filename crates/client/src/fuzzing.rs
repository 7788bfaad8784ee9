//! In-process entry points for the fuzz targets under `fuzz/`; not an API (hidden from the
//! docs, no stability). An initiator's datagram queue takes replies from its target's address
//! (UDP) or MAC (raw Ethernet), which anyone on the path can forge; `fuzz/fuzz_targets/
//! dgram_reply.rs` sends such replies to a queue with requests in flight.

use std::net::SocketAddr;
use std::time::Duration;

use blkwire_wire::CopyLimits;

use crate::dgram::{udp_link, DgramQueue, Grant};
use crate::{Queue, Result};

/// A datagram queue of session `session` talking to `target` (a UDP socket on loopback the
/// caller holds): `depth` slots, I/O up to `max_io` bytes in frames of `frame_payload`, data
/// frames' CRCs over their header only if `header_crc` (PROTOCOL.md §9.7). It gives a request
/// up after `give_up` and never spins.
pub fn udp_queue(
    target: SocketAddr,
    session: u32,
    depth: u16,
    max_io: u32,
    frame_payload: u32,
    header_crc: bool,
    give_up: Duration,
) -> Result<Queue> {
    let grant = Grant {
        session,
        index: 0,
        depth,
        max_io,
        frame_payload,
        credit: 64,
        header_crc,
    };
    let q = DgramQueue::new(udp_link(target)?, grant, None, give_up, Duration::ZERO);
    Ok(Queue::dgram(q, CopyLimits::default()))
}
