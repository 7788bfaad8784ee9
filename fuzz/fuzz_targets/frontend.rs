//! The server's stream frontends (crates/server/src/frontend): native frames, NBD's
//! transmission phase and NVMe/TCP I/O queues (one namespace, and several: NSIDs 1, 2 and 7 with
//! different LBA sizes, one read-only), each with several negotiated states, walked over arbitrary bytes the way
//! the reactor walks a receive buffer. No panic on any input; `Need(n)` always asks for more than
//! is buffered (else the reactor would wait forever with a whole message in hand) and never more
//! than one maximum message; a decoded message lies inside the buffer with its payload at its
//! end (before its trailer); a message the frontend answers itself lies inside the buffer too; every reply to a
//! decoded request can be encoded; a request names one of the connection's targets; and a COPY's
//! descriptor decodes only within the limits of its target.

#![no_main]

use blkwire_server::frontend::native::Native;
use blkwire_server::frontend::nbd::Nbd;
use blkwire_server::frontend::nvme::{IoQueueSetup, NsIo, NvmeIo};
use blkwire_server::frontend::{Decoded, Kind, ReadFraming, StreamFrontend};
use blkwire_wire::nvme_tcp::{Direction, Params};
use blkwire_wire::{CopyLimits, Status, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const MAX_IO: u32 = 1 << 20;

/// `targets`: how many exports the connection serves (a request must name one of them).
fn walk(fe: &mut dyn StreamFrontend, data: &[u8], targets: usize) {
    let mut at = 0usize;
    let mut tx = Vec::new();
    loop {
        let rx = &data[at..];
        tx.clear();
        match fe.decode(rx, &mut tx) {
            Decoded::Need(n) => {
                assert!(n > rx.len(), "Need({n}) with {} bytes buffered", rx.len());
                assert!(
                    n <= HEADER_LEN + MAX_IO as usize,
                    "Need({n}) beyond one message"
                );
                return;
            }
            Decoded::Violation(_) => return,
            Decoded::Release { len, .. } => {
                assert!(len > 0 && len <= rx.len());
                at += len;
            }
            Decoded::Answered { len } | Decoded::Dropped { len } => {
                assert!(len > 0 && len <= rx.len());
                at += len;
            }
            Decoded::Data {
                len,
                payload_len,
                trailer,
                ..
            } => {
                assert!(len > 0 && len <= rx.len() && payload_len + trailer <= len);
                at += len;
            }
            Decoded::Request {
                req,
                len,
                payload_len,
                trailer,
            } => {
                assert!(len > 0 && len <= rx.len() && payload_len + trailer <= len);
                assert!(payload_len <= MAX_IO as usize);
                assert!(
                    (req.target as usize) < targets,
                    "target {} of {targets}",
                    req.target
                );
                if req.is_write() && payload_len < req.length as usize {
                    // As the reactor does for a write that came without its data (slot 0).
                    fe.solicit(
                        &req,
                        0,
                        payload_len as u32,
                        req.length - payload_len as u32,
                        &mut tx,
                    );
                }
                for status in [Status::Ok, Status::Io, Status::OutOfRange, Status::NoSpace] {
                    fe.reply(&req, status, &mut tx);
                }
                if req.is_read() {
                    let data = vec![0u8; req.length as usize];
                    match fe.read_framing(&req) {
                        ReadFraming::Contiguous { prefix, suffix } => {
                            let (mut p, mut q) = (vec![0u8; prefix], vec![0u8; suffix]);
                            fe.finish_read_reply(&req, &mut p, &data, &mut q);
                        }
                        // None of these frontends frames its READ replies in pieces
                        // (iSCSI does: fuzz_targets/iscsi.rs checks that path).
                        ReadFraming::Chunked { .. } => fe.encode_read(&req, &data, &mut tx),
                    }
                }
                fe.block_status_reply(&req, &[(req.length, true)], &mut tx);
                if req.kind == Kind::Copy {
                    let payload = &rx[len - trailer - payload_len..len - trailer];
                    if let Some(d) = fe.copy_descriptor(&req, payload) {
                        assert!(!d.ranges.is_empty() && d.ranges.len() <= 128);
                        assert!(d.ranges.iter().all(|r| r.len > 0 && r.len <= 1 << 30));
                    }
                }
                at += len;
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // Without COPY, and with it: a COPY's descriptor is decoded from the message's payload.
    let copy = CopyLimits {
        max_bytes: u32::MAX,
        max_range: 1 << 30,
        max_ranges: 128,
    };
    for (depth, copy) in [(1u16, CopyLimits::default()), (128, copy)] {
        walk(&mut Native::new(depth, MAX_IO, copy), data, 1);
    }
    for (structured, allocation) in [(false, false), (true, false), (true, true)] {
        let mut nbd = Nbd {
            structured,
            allocation,
            max_io: MAX_IO,
            fast_zero: structured,
        };
        walk(&mut nbd, data, 1);
    }
    let ns = |nsid, lba_shift, read_only, copy| NsIo {
        nsid,
        lba_shift,
        read_only,
        copy,
    };
    let one = vec![ns(1, 9, false, copy)];
    let three = vec![
        ns(1, 9, false, copy),
        ns(2, 12, true, CopyLimits::default()),
        ns(7, 9, false, copy),
    ];
    for (digests, sqfc_off, pda, namespaces) in [
        (false, false, 0, &one),
        (true, true, 7, &one),
        (false, false, 0, &three),
        (true, false, 3, &three),
    ] {
        let p = |direction| Params {
            direction,
            hdgst: digests,
            ddgst: digests,
            pda: if direction == Direction::HostToController {
                0
            } else {
                pda
            },
            max_plen: 4096 + 128,
        };
        let mut nvme = NvmeIo::new(IoQueueSetup {
            rx: p(Direction::HostToController),
            tx: p(Direction::ControllerToHost),
            qid: 1,
            entries: 32,
            sq_head: 1,
            sqfc_off,
            max_io: MAX_IO,
            maxh2cdata: MAX_IO,
            namespaces: namespaces.clone(),
        });
        walk(&mut nvme, data, namespaces.len());
    }
});
