//! iSCSI (RFC 7143): the PDU codec (`blkwire_wire::iscsi`), login/text key=value parsing, and
//! the full feature phase frontend (`blkwire_server::frontend::iscsi`) walked over arbitrary
//! bytes the way the reactor walks a receive buffer. The first byte picks the digests and the
//! data segment bound. No panic on any input; `pdu_len` asks for more than is buffered and at
//! most one bounded PDU; a decoded PDU's data lies inside it; key=value pairs are bounded; a
//! request the frontend decodes lies inside the buffer with its payload before its trailer, and
//! every answer to it encodes. Writes are held in slots as the reactor holds them (or refused,
//! when the input says so or no slot is free): solicited and unsolicited data (InitialR2T=No)
//! must come for a held write, in order and inside it.

#![no_main]

use std::sync::Arc;

use blkwire_backend::{Export, ExportSpec};
use blkwire_server::frontend::iscsi::{lun_info, Iscsi, IscsiSetup, Peer, SetupLun, LIST_ROOM};
use blkwire_server::frontend::{Decoded, Kind, ReadFraming, StreamFrontend};
use blkwire_server::iscsi::Negotiated;
use blkwire_server::reservations::Lu;
use blkwire_server::Reservation;
use blkwire_wire::iscsi::{
    self, Digests, Progress, BHS_LEN, MAX_KEY_LEN, MAX_PAIRS, MAX_VALUE_LEN,
};
use blkwire_wire::{CopyLimits, Status};
use libfuzzer_sys::fuzz_target;

const MAX_IO: u32 = 1 << 20;

fn codec(data: &[u8], d: &Digests, max: u32) {
    let mut at = 0;
    while at < data.len() {
        let rx = &data[at..];
        match iscsi::pdu_len(rx, d, max) {
            Err(_) => return,
            Ok(Progress::Need(n)) => {
                assert!(n > rx.len());
                assert!(n <= BHS_LEN + 255 * 4 + 4 + max as usize + 3 + 4);
                return;
            }
            Ok(Progress::Complete(n)) => {
                assert!(n >= BHS_LEN && n <= rx.len());
                if let Ok(p) = iscsi::decode(&rx[..n], d) {
                    assert!(p.data.len() <= max as usize && p.data.len() + p.trailer <= n);
                    let c = iscsi::scsi_command(&p);
                    assert!(c.ext_cdb.len() <= p.ahs.len());
                    let _ = iscsi::login_request(&p);
                    text(p.data);
                }
                at += n;
            }
        }
    }
}

fn text(data: &[u8]) {
    let mut n = 0;
    // As login does: the first malformed pair ends the text.
    for pair in iscsi::pairs(data) {
        n += 1;
        let Ok((k, v)) = pair else {
            break;
        };
        assert!(n <= MAX_PAIRS, "more than {MAX_PAIRS} pairs taken");
        assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN && v.len() <= MAX_VALUE_LEN);
        let _ = iscsi::number(v);
        if let Some(b) = iscsi::binary(v) {
            assert!(b.len() <= v.len());
        }
    }
}

fn walk(fe: &mut Iscsi, data: &[u8], status: Status, refuse: bool) {
    let mut at = 0usize;
    let mut tx = Vec::new();
    // The writes waiting in slots for their data, and how much of it they have.
    let mut held: Vec<Option<(blkwire_server::frontend::Req, u32)>> = vec![None; 8];
    // Requests the frontend makes up (parts) take no bytes: bound the loop.
    for _ in 0..4096 {
        let rx = &data[at..];
        tx.clear();
        match fe.decode(rx, &mut tx) {
            // Also while a COMPARE AND WRITE's read runs (answered below: then the next decode
            // goes on): nothing more to feed.
            Decoded::Need(n) => {
                assert!(
                    n <= BHS_LEN + 255 * 4 + 4 + (256 << 10) + 3 + 4,
                    "Need({n})"
                );
                return;
            }
            Decoded::Violation(_) => return,
            // A TMF takes its PDU and gives up the writes it aborts: the first slot here, the
            // others from `next_release`, all at once (as the reactor takes them).
            Decoded::Release { len, slot } => {
                assert!(len > 0 && len <= rx.len());
                for s in std::iter::once(slot).chain(std::iter::from_fn(|| fe.next_release())) {
                    if let Some(h) = held.get_mut(s as usize) {
                        *h = None;
                    }
                }
                at += len;
            }
            // 0: the response of a TMF that waited for the tasks it found running (none do
            // here: every request is answered at once, but the frontend may say so).
            Decoded::Answered { len } | Decoded::Dropped { len } => {
                assert!(len <= rx.len());
                at += len;
            }
            Decoded::Data {
                slot,
                offset,
                len,
                payload_len,
                trailer,
            } => {
                assert!(len > 0 && len <= rx.len() && payload_len + trailer <= len);
                let Some(Some((req, got))) = held.get(slot as usize).copied() else {
                    panic!("data for slot {slot}, which holds no write");
                };
                let end = offset as u64 + payload_len as u64;
                assert!(
                    offset == got && end <= req.length as u64,
                    "data at {offset}+{payload_len} for a write of {} with {got}",
                    req.length
                );
                at += len;
                if end == req.length as u64 {
                    held[slot as usize] = None;
                    fe.reply(&req, status, &mut tx);
                } else {
                    held[slot as usize] = Some((req, end as u32));
                }
            }
            Decoded::Request {
                req,
                len,
                payload_len,
                trailer,
            } => {
                assert!(len <= rx.len() && payload_len + trailer <= len);
                assert!(payload_len <= req.length as usize || !req.is_write());
                fe.taken(&req);
                assert!(req.length <= 1 << 30);
                assert!(req.target < 2, "a request for a target the connection has");
                if req.is_write() && payload_len < req.length as usize {
                    at += len;
                    let free = held.iter().position(Option::is_none);
                    let follows = fe.data_follows(&req);
                    let mut buf = vec![0u8; req.length as usize];
                    match free {
                        // Refused before it has a slot (memory): its unsolicited data is
                        // dropped by the frontend.
                        _ if refuse && follows => {
                            fe.reply(&req, Status::NoMemory, &mut tx);
                        }
                        None => {
                            fe.reply(&req, Status::NoMemory, &mut tx);
                        }
                        Some(_) if !follows && fe.fill(&req, &mut buf) => {
                            fe.reply(&req, status, &mut tx);
                        }
                        Some(slot) => {
                            held[slot] = Some((req, payload_len as u32));
                            let rest = req.length - payload_len as u32;
                            fe.solicit(&req, slot as u16, payload_len as u32, rest, &mut tx);
                        }
                    }
                    continue;
                }
                if req.kind == Kind::Copy {
                    let _ = fe.copy_descriptor(&req, &[]);
                }
                if req.kind == Kind::Broadcast {
                    // A PERSISTENT RESERVE OUT the other reactors must see: installed again here,
                    // as the reactor's other connections would.
                    let update = fe.take_broadcast(&req).expect("a broadcast has its update");
                    fe.reservations_changed(&update);
                }
                if req.is_read() && status == Status::Ok {
                    let data = vec![0u8; req.length as usize];
                    match fe.read_framing(&req) {
                        ReadFraming::Contiguous { prefix, suffix } => {
                            let (mut p, mut q) = (vec![0u8; prefix], vec![0u8; suffix]);
                            fe.finish_read_reply(&req, &mut p, &data, &mut q);
                        }
                        ReadFraming::Chunked { framing } => {
                            // The budget sets `framing` aside for the reply besides its data:
                            // Data-In headers, digests, padding and the SCSI Response.
                            let before = tx.len();
                            fe.encode_read(&req, &data, &mut tx);
                            let added = tx.len() - before;
                            assert!(
                                added <= data.len() + framing,
                                "a chunked reply of {added} bytes for {} of data, framing {framing}",
                                data.len()
                            );
                        }
                    }
                } else if req.kind == Kind::BlockStatus && status == Status::Ok {
                    fe.block_status_reply(&req, &[(req.length, true)], &mut tx);
                } else {
                    fe.reply(&req, status, &mut tx);
                }
                at += len;
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let d = Digests {
        header: mode & 1 != 0,
        data: mode & 2 != 0,
    };
    let max = [512u32, 8192, 256 << 10, 1 << 24][(mode >> 2 & 3) as usize];
    codec(rest, &d, max);
    text(rest);

    let export = Arc::new(Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap());
    let copy = CopyLimits {
        max_bytes: 1 << 20,
        max_range: 1 << 20,
        max_ranges: 1,
    };
    let neg = Negotiated {
        digests: d,
        send_max: 8192,
        recv_max: 256 << 10,
        max_burst: 65536,
        first_burst: 65536,
        initial_r2t: mode & 64 == 0,
        immediate_data: mode & 16 == 0,
        max_r2t: 1,
    };
    let status = if mode & 32 == 0 {
        Status::Ok
    } else {
        Status::Io
    };
    // Two LUNs (0 and 3, of different block counts), the second removed mid-stream when the
    // mode says so: commands to LUNs it does not have (or no longer) are answered, never run.
    let other = Arc::new(Export::open(&ExportSpec::parse("n=mem:512K").unwrap()).unwrap());
    let mut fe = Iscsi::new(IscsiSetup {
        neg,
        statsn: 1,
        expcmdsn: 0,
        depth: 8,
        granted: None,
        luns: vec![
            SetupLun {
                lun: 0,
                export: export.clone(),
                size: export.size(),
                copy,
                reservations: Lu::detached(),
            },
            SetupLun {
                lun: 3,
                size: other.size(),
                export: other,
                copy,
                reservations: Lu::detached(),
            },
        ],
        target: "iqn.2026-11.io.blkwire:m".into(),
        initiator: "iqn.fuzz".into(),
        isid: [0; 6],
        max_io: MAX_IO,
        peers: vec![Peer {
            name: "m".into(),
            info: lun_info(&export, export.size(), MAX_IO, true),
            reservations: Lu::detached(),
            export: Arc::downgrade(&export),
        }],
        list_room: Reservation::detached(LIST_ROOM),
    });
    fe.attached();
    let refuse = mode & 128 != 0;
    // Every bit of the mode byte is taken: an odd length fences the second LUN halfway.
    let half = rest.len() / 2;
    if rest.len() % 2 == 1 {
        walk(&mut fe, &rest[..half], status, refuse);
        fe.fenced(1);
        walk(&mut fe, &rest[half..], status, refuse);
    } else {
        walk(&mut fe, rest, status, refuse);
    }
});
