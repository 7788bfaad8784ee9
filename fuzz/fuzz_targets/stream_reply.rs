//! An initiator's TCP queue (crates/client/src/stream.rs, nvme.rs) fed what a hostile target
//! sends: a queue on a loopback TCP connection (`blkwire_client::fuzzing::tcp_queue`) to a
//! socket this harness holds, with six requests in flight, and the input as the byte stream
//! that comes back, native reply frames or NVMe/TCP PDUs as they are.
//!
//! The first two bytes set up the queue; the rest is the stream:
//!   byte 0  bit 0:     NVMe/TCP instead of blkwire frames
//!           bits 1-2:  max I/O: 16 KiB, 64 KiB, 256 KiB, 1 MiB
//!           bits 3-4:  depth: 6, 8, 64, 1023
//!           bit 5, 6:  NVMe/TCP header digests, data digests
//!           bit 7:     each request is submitted once more when it completes (its slot's next
//!                      generation: replies to the first stay late replies)
//!   byte 1  bits 0-2:  the stream written at once, or in pieces of 1, 3, 24, 48, 100, 1000 or
//!                      4096 bytes, the queue polled after each has arrived
//!           bit 3:     once the stream has ended, wait with `complete(1)` rather than `poll`
//!           bits 4-5:  NVMe/TCP HPDA (and CPDA): 0, 1, 3, 31
//!           bit 6:     NVMe/TCP blocks of 4 KiB rather than 512 bytes
//!           bit 7:     NVMe/TCP MAXH2CDATA 1 MiB rather than 4 KiB
//!
//! Requests (users 1-6; a second submission is user + 100), on a fresh queue: slots 0-5 at
//! generation 1 (native tag `slot | 1 << 16`, NVMe/TCP CID `slot | 1 << 10`):
//!   native:    READ 512 B at 0, READ 12 KiB at 4 KiB, WRITE 12 KiB at 8 KiB, FLUSH,
//!              COPY of 64 KiB to 1 MiB, TRIM of 64 KiB at 2 MiB
//!   NVMe/TCP:  READ 4 KiB at 0, READ 12 KiB at 16 KiB, WRITE 4 KiB at 32 KiB (in its
//!              capsule), WRITE 16 KiB at 64 KiB (sent when R2Ts ask), FLUSH, TRIM 8 KiB
//!
//! Once the stream has been written the harness ends it (FIN) and drives the queue until it
//! fails (`Error::Closed` at the latest): everything the queue could take, it has taken.
//!
//! No panic on any input, every error an `Err`; each completion is for a request in flight
//! and comes once; it carries its request's length (a COPY: any), an OK READ exactly the
//! bytes it asked for, and those are bytes the stream carried for it (a native reply's
//! payload, later than the last READ's; NVMe/TCP C2HData of one CID, in order: never stale
//! bytes of the receive buffer), nothing else any data; `in_flight` is what was submitted
//! less what completed, after errors too (a request the queue fails on stays in flight); the
//! receive buffer stays within its cap; and the queue sends no more than its requests and each
//! write's data once (`Ledger::most_sent`: R2Ts cannot make it send more).

#![no_main]

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::OnceLock;
use std::time::Duration;

use blkwire_client::fuzzing::{rx_buffer, tcp_queue, wait_readable, NvmeTcp};
use blkwire_client::{Cmd, Completion, CopyRange, Queue, Result};
use blkwire_wire::nvme_tcp::{self, Direction, Params, Pdu, PduType, Progress};
use blkwire_wire::{CopyDescriptor, Header, Opcode, Status, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

/// Every wait of the queue (it never needs it: the harness never leaves it waiting).
const TIMEOUT: Duration = Duration::from_secs(30);
/// How long the queue's socket may take to show what was written to it (loopback: at once).
const ARRIVAL: Duration = Duration::from_secs(10);
/// NVMe/TCP: the largest write sent in its capsule; larger ones wait for R2Ts.
const INCAPSULE: u32 = 8192;

static DATA: [u8; 16 << 10] = [0x5a; 16 << 10];

/// The loopback listener the queues connect to, one per process.
fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("listener"))
}

/// A COPY's descriptor: 64 KiB of the session's own export.
fn descriptor() -> &'static [u8] {
    static D: OnceLock<Vec<u8>> = OnceLock::new();
    D.get_or_init(|| {
        CopyDescriptor {
            source: String::new(),
            ranges: vec![CopyRange {
                offset: 0,
                len: 64 << 10,
            }],
        }
        .encode()
        .expect("descriptor")
    })
}

/// The six requests of a mode.
fn requests(nvme: bool) -> [Cmd<'static>; 6] {
    if nvme {
        [
            Cmd::Read {
                offset: 0,
                len: 4096,
            },
            Cmd::Read {
                offset: 16 << 10,
                len: 12 << 10,
            },
            Cmd::Write {
                offset: 32 << 10,
                data: &DATA[..4096],
                fua: false,
            },
            Cmd::Write {
                offset: 64 << 10,
                data: &DATA,
                fua: true,
            },
            Cmd::Flush,
            Cmd::Trim {
                offset: 128 << 10,
                len: 8 << 10,
            },
        ]
    } else {
        [
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            Cmd::Read {
                offset: 4096,
                len: 12 << 10,
            },
            Cmd::Write {
                offset: 8192,
                data: &DATA[..12 << 10],
                fua: false,
            },
            Cmd::Flush,
            Cmd::Copy {
                dst: 1 << 20,
                len: 64 << 10,
                descriptor: descriptor(),
            },
            Cmd::Trim {
                offset: 2 << 20,
                len: 64 << 10,
            },
        ]
    }
}

/// Where read data lies in the stream, as a receiver walking it message by message (up to
/// the first it cannot decode) finds it: native, the payloads of OK READ replies in order;
/// NVMe/TCP, each CID's C2HData (offset and data) in order.
enum Reads {
    Native {
        payloads: Vec<Range<usize>>,
        /// Payloads before this one have been handed back, or passed over.
        next: usize,
    },
    Nvme(HashMap<u16, Vec<(u32, Range<usize>)>>),
}

impl Reads {
    fn walk(stream: &[u8], max_io: u32, nvme: Option<Params>) -> Reads {
        let mut at = 0;
        let Some(p) = nvme else {
            let mut payloads = Vec::new();
            while let Ok(h) = Header::decode(&stream[at..], max_io) {
                let end = at + HEADER_LEN + h.payload_len as usize;
                if end > stream.len() {
                    break;
                }
                if h.is_reply() && h.opcode == Opcode::Read && h.status == Status::Ok {
                    payloads.push(at + HEADER_LEN..end);
                }
                at = end;
            }
            return Reads::Native { payloads, next: 0 };
        };
        let mut data: HashMap<u16, Vec<(u32, Range<usize>)>> = HashMap::new();
        while let Ok(Progress::Complete(len)) = nvme_tcp::pdu_len(&stream[at..], &p) {
            let Ok(pdu) = nvme_tcp::decode(&stream[at..at + len], &p) else {
                break;
            };
            if let Pdu::C2HData(d) = pdu {
                let from = d.data.as_ptr() as usize - stream.as_ptr() as usize;
                let pieces = data.entry(d.cccid).or_default();
                pieces.push((d.datao, from..from + d.data.len()));
            }
            at += len;
        }
        Reads::Nvme(data)
    }

    /// Is `got`, an OK READ's data, what the stream holds for a read? Native: the payload
    /// of a later reply than the last READ's. NVMe/TCP: one CID's C2HData from offset 0 on,
    /// each starting where the one before ended.
    fn check(&mut self, stream: &[u8], got: &[u8]) -> bool {
        match self {
            Reads::Native { payloads, next } => {
                let Some(i) = payloads[*next..]
                    .iter()
                    .position(|r| &stream[r.clone()] == got)
                else {
                    return false;
                };
                *next += i + 1;
                true
            }
            Reads::Nvme(data) => data.values().any(|pieces| {
                (0..pieces.len()).any(|first| {
                    let mut have = 0;
                    for (datao, r) in &pieces[first..] {
                        let piece = &stream[r.clone()];
                        if *datao as usize != have
                            || have + piece.len() > got.len()
                            || got[have..have + piece.len()] != *piece
                        {
                            return false;
                        }
                        have += piece.len();
                        if have == got.len() {
                            return true;
                        }
                    }
                    false
                })
            }),
        }
    }
}

/// What was asked and what came back.
struct Ledger<'s> {
    cmds: [Cmd<'static>; 6],
    /// Users submitted, and those completed.
    submitted: HashSet<u64>,
    done: HashSet<u64>,
    /// Users that complete submit their request again (once).
    again: bool,
    /// Completed since the last `settle`, to submit again.
    fresh: Vec<u64>,
    /// The stream, and where its read data lies.
    stream: &'s [u8],
    reads: Reads,
    /// NVMe/TCP: how the queue encodes what it sends, and the R2Ts in the stream.
    nvme: Option<(Params, usize)>,
}

impl Ledger<'_> {
    fn cmd(&self, user: u64) -> Cmd<'static> {
        self.cmds[(user % 100 - 1) as usize]
    }

    /// Most bytes the queue may have sent for the requests submitted so far: each as framed
    /// (header, and a WRITE's data, a COPY's descriptor or an NVMe/TCP TRIM's 16-byte range),
    /// and on NVMe/TCP a WRITE over `INCAPSULE` (no data in its capsule) its data once, in at
    /// most one H2CData PDU per 4 KiB (the queue cuts them at MAXH2CDATA or 4 KiB, whichever
    /// is more), plus one per R2T in the stream (an R2T of a few bytes is answered with a PDU
    /// of its own). Not quite exact, never under; a write's data sent twice (16 KiB for the
    /// R2T one) is over.
    fn most_sent(&self) -> usize {
        let Some((p, r2ts)) = &self.nvme else {
            return self
                .submitted
                .iter()
                .map(|&u| match self.cmd(u) {
                    Cmd::Write { data, .. } => HEADER_LEN + data.len(),
                    Cmd::Copy { descriptor, .. } => HEADER_LEN + descriptor.len(),
                    _ => HEADER_LEN,
                })
                .sum();
        };
        let pdu = |typ, data: usize| {
            nvme_tcp::prefix_len(typ, data, p) + data + nvme_tcp::suffix_len(typ, data, p)
        };
        // An H2CData PDU's bytes besides its data.
        let h2c = pdu(PduType::H2CData, 1) - 1;
        let requests: usize = self
            .submitted
            .iter()
            .map(|&u| match self.cmd(u) {
                Cmd::Write { data, .. } if data.len() > INCAPSULE as usize => {
                    pdu(PduType::CapsuleCmd, 0) + data.len() + data.len().div_ceil(4096) * h2c
                }
                Cmd::Write { data, .. } => pdu(PduType::CapsuleCmd, data.len()),
                Cmd::Trim { .. } => pdu(PduType::CapsuleCmd, 16),
                _ => pdu(PduType::CapsuleCmd, 0),
            })
            .sum();
        requests + r2ts * h2c
    }

    fn submit(&mut self, q: &mut Queue, user: u64) {
        q.submit(self.cmd(user), user).expect("submit");
        self.submitted.insert(user);
    }

    fn take(&mut self, c: Completion<'_>) {
        let u = c.user;
        assert!(self.submitted.contains(&u), "a completion for user {u}");
        assert!(self.done.insert(u), "user {u} completed twice");
        self.fresh.push(u);
        match self.cmd(u) {
            Cmd::Read { len, .. } if c.status == Status::Ok => {
                assert_eq!(c.data.len(), len as usize, "OK READ {u}: wrong length");
                assert!(
                    self.reads.check(self.stream, c.data),
                    "OK READ {u}: data the target did not send for it"
                );
            }
            _ => assert!(
                c.data.is_empty(),
                "user {u} ({:?}) handed back data",
                c.status
            ),
        }
        let asked = match self.cmd(u) {
            Cmd::Read { len, .. } | Cmd::Trim { len, .. } => Some(len),
            Cmd::Write { data, .. } => Some(data.len() as u32),
            Cmd::Flush => Some(0),
            _ => None, // COPY: the bytes copied, the target's to say
        };
        if let Some(len) = asked {
            assert_eq!(c.length, len, "user {u}: not its request's length");
        }
    }

    /// After each call into the queue: its requests in flight are those of the ledger (a
    /// request it fails on stays in flight), its receive buffer is within its cap; if the call
    /// succeeded, requests that completed are submitted again if asked.
    fn settle(&mut self, q: &mut Queue, ok: bool) {
        assert_eq!(
            q.in_flight(),
            self.submitted.len() - self.done.len(),
            "in flight"
        );
        let (len, cap) = rx_buffer(q).expect("a TCP queue");
        assert!(len <= cap, "receive buffer of {len} bytes, cap {cap}");
        if !ok {
            return;
        }
        for u in std::mem::take(&mut self.fresh) {
            if self.again && u < 100 {
                self.submit(q, u + 100);
            }
        }
    }
}

/// R2Ts in the stream, up to the first PDU the queue cannot decode.
fn r2ts(stream: &[u8], p: &Params) -> usize {
    let (mut at, mut n) = (0, 0);
    while let Ok(Progress::Complete(len)) = nvme_tcp::pdu_len(&stream[at..], p) {
        match nvme_tcp::decode(&stream[at..at + len], p) {
            Ok(Pdu::R2T(_)) => n += 1,
            Ok(_) => {}
            Err(_) => break,
        }
        at += len;
    }
    n
}

/// Reads (and counts) whatever the queue sent: no more than `most`.
fn drain(target: &mut TcpStream, sent: &mut usize, most: usize) {
    let mut buf = [0u8; 64 << 10];
    while let Ok(n @ 1..) = target.read(&mut buf) {
        *sent += n;
    }
    assert!(
        *sent <= most,
        "the queue sent {sent} bytes, at most {most} expected"
    );
}

fuzz_target!(|data: &[u8]| {
    let [c0, c1, ref stream @ ..] = *data else {
        return;
    };
    let nvme = c0 & 1 != 0;
    let max_io = [16 << 10, 64 << 10, 256 << 10, 1 << 20][usize::from(c0 >> 1 & 3)];
    let depth = [6, 8, 64, 1023][usize::from(c0 >> 3 & 3)];
    let piece = [usize::MAX, 1, 3, 24, 48, 100, 1000, 4096][usize::from(c1 & 7)];
    let wait_complete = c1 & 8 != 0;
    let pda = [0, 1, 3, 31][usize::from(c1 >> 4 & 3)];
    let params = nvme.then_some(Params {
        direction: Direction::ControllerToHost,
        hdgst: c0 & 0x20 != 0,
        ddgst: c0 & 0x40 != 0,
        pda,
        max_plen: max_io + 4096,
    });
    let framing = nvme.then_some(NvmeTcp {
        hdgst: c0 & 0x20 != 0,
        ddgst: c0 & 0x40 != 0,
        hpda: pda,
        cpda: pda,
        incapsule: INCAPSULE,
        lba_shift: if c1 & 0x40 != 0 { 12 } else { 9 },
        maxh2cdata: if c1 & 0x80 != 0 { 1 << 20 } else { 4096 },
    });

    let l = listener();
    let initiator = TcpStream::connect(l.local_addr().expect("bound")).expect("connect");
    let mut target = loop {
        let (s, peer) = l.accept().expect("accept");
        if Some(peer) == initiator.local_addr().ok() {
            break s;
        }
    };
    target.set_nonblocking(true).expect("non-blocking");
    let mut q = tcp_queue(initiator, depth, max_io, framing, TIMEOUT).expect("queue");
    let mut ledger = Ledger {
        cmds: requests(nvme),
        submitted: HashSet::new(),
        done: HashSet::new(),
        again: c0 & 0x80 != 0,
        fresh: Vec::new(),
        stream,
        reads: Reads::walk(stream, max_io, params),
        nvme: framing.zip(params).map(|(f, rx)| {
            let tx = Params {
                direction: Direction::HostToController,
                hdgst: f.hdgst,
                ddgst: f.ddgst,
                pda: f.cpda,
                max_plen: u32::MAX,
            };
            (tx, r2ts(stream, &rx))
        }),
    };
    for user in 1..=6 {
        ledger.submit(&mut q, user);
    }
    q.send().expect("send");
    let mut sent = 0;
    drain(&mut target, &mut sent, ledger.most_sent());

    // One call into the queue; Err ends the run (the queue is done for, as in a session).
    let step = |q: &mut Queue, ledger: &mut Ledger, ended: bool| -> Result<usize> {
        let r = if ended && wait_complete && q.in_flight() > 0 {
            q.complete(1, |c| ledger.take(c))
        } else {
            q.poll(|c| ledger.take(c))
        };
        ledger.settle(q, r.is_ok());
        r
    };

    // The stream, piece by piece: each is on the queue's socket before the queue is polled.
    let mut at = 0;
    while at < stream.len() {
        let end = stream.len().min(at.saturating_add(piece));
        match target.write(&stream[at..end]) {
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("writing to the queue: {e}"),
        }
        drain(&mut target, &mut sent, ledger.most_sent());
        wait_readable(&q, ARRIVAL);
        if step(&mut q, &mut ledger, false).is_err() {
            return;
        }
    }
    // Then its end: the queue takes what is left, then fails (Closed) at the end.
    target.shutdown(Shutdown::Write).expect("shutdown");
    for _ in 0..=stream.len() + 8 {
        drain(&mut target, &mut sent, ledger.most_sent());
        assert!(
            wait_readable(&q, ARRIVAL),
            "the queue's socket never showed the end of the stream"
        );
        if step(&mut q, &mut ledger, true).is_err() {
            drain(&mut target, &mut sent, ledger.most_sent());
            return;
        }
    }
    panic!("the queue takes nothing of a readable socket");
});
