//! blkwire's own frames over a stream (docs/PROTOCOL.md §1-§6): the client picks the slot in
//! each tag, every frame carries its CRC32C, and replies echo the request's header.

use blkwire_backend::BlockOp;
use blkwire_wire::{CopyDescriptor, CopyLimits, Header, Opcode, Status, Tag, HEADER_LEN};

use super::{Decoded, Kind, ReadFraming, Req, StreamFrontend};

/// A native queue's protocol state.
pub struct Native {
    depth: u16,
    max_io: u32,
    copy: CopyLimits,
}

impl Native {
    /// A queue granted `depth` slots, I/O of at most `max_io` bytes and COPYs within `copy`
    /// (PROTOCOL.md §13; all zero: the session has no COPY, which is answered `UNSUPPORTED`).
    pub fn new(depth: u16, max_io: u32, copy: CopyLimits) -> Native {
        Native {
            depth,
            max_io,
            copy,
        }
    }

    /// The header a reply to `req` starts with (PROTOCOL.md §3: same opcode, tag, queue,
    /// session, offset and length; the queue's credit, §2.3).
    fn reply_header(&self, req: &Req, status: Status, payload_len: u32) -> Header {
        let c = req.cookie;
        let opcode = Opcode::from_u8((c >> 32) as u8).unwrap_or(Opcode::Read);
        let mut h = Header::request(opcode, Tag(c as u32), req.offset, req.length);
        h.queue = (c >> 40) as u16;
        h.session = (c >> 56) as u32;
        let mut r = h.reply(status, payload_len);
        r.credit = self.depth;
        r
    }
}

/// Keeps what a reply must echo: tag, opcode, queue and session.
fn cookie(h: &Header) -> u128 {
    h.tag.0 as u128 | (h.opcode as u128) << 32 | (h.queue as u128) << 40 | (h.session as u128) << 56
}

impl StreamFrontend for Native {
    fn decode(&mut self, rx: &[u8], tx: &mut Vec<u8>) -> Decoded {
        if rx.len() < HEADER_LEN {
            return Decoded::Need(HEADER_LEN);
        }
        let h = match Header::decode(rx, self.max_io) {
            Ok(h) => h,
            Err(e) => return Decoded::Violation(e.to_string()),
        };
        if h.is_reply() {
            return Decoded::Violation("received a reply frame".into());
        }
        let len = HEADER_LEN + h.payload_len as usize;
        if rx.len() < len {
            return Decoded::Need(len);
        }
        if let Err(e) = h.check_stream_crc(rx, &rx[HEADER_LEN..len]) {
            return Decoded::Violation(e.to_string());
        }
        let Some(op) = h.opcode.block_op() else {
            if h.opcode == Opcode::Keepalive {
                // A liveness probe: answered here, it never reaches the executor.
                let r = Req {
                    kind: Kind::Invalid,
                    offset: h.offset,
                    length: h.length,
                    flags: h.flags.io_flags(),
                    slot: None,
                    cookie: cookie(&h),
                    target: 0,
                };
                self.reply(&r, Status::Ok, tx);
                return Decoded::Answered { len };
            }
            let kind = match h.opcode {
                Opcode::Logout => Kind::Logout,
                // A refused COPY copied nothing: its reply's length says so (§13).
                Opcode::Copy if !self.copy.enabled() => {
                    return request(&Header { length: 0, ..h }, Kind::Unsupported, len)
                }
                // The descriptor is the payload, never fragmented (§13); the dispatcher decodes
                // it where it lies in the receive buffer.
                Opcode::Copy if h.tag.slot() < self.depth && h.payload_len > 0 => Kind::Copy,
                Opcode::Copy => return request(&Header { length: 0, ..h }, Kind::Invalid, len),
                _ => Kind::Invalid, // HELLO, JOIN, LIST, STATS belong to the handshake
            };
            return request(&h, kind, len);
        };
        let expected_payload = if op == BlockOp::Write { h.length } else { 0 };
        let kind = if h.tag.slot() >= self.depth
            || h.payload_len != expected_payload
            || !flush_args_valid(&h)
        {
            Kind::Invalid
        } else {
            Kind::Block(op)
        };
        request(&h, kind, len)
    }

    fn server_assigns_slots(&self) -> bool {
        false
    }

    fn read_framing(&self, _req: &Req) -> ReadFraming {
        ReadFraming::Contiguous {
            prefix: HEADER_LEN,
            suffix: 0,
        }
    }

    fn finish_read_reply(
        &mut self,
        req: &Req,
        prefix: &mut [u8],
        _data: &[u8],
        _suffix: &mut [u8],
    ) {
        let h = self.reply_header(req, Status::Ok, req.length);
        h.encode((&mut prefix[..HEADER_LEN]).try_into().expect("header size"));
    }

    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        tx.extend_from_slice(&self.reply_header(req, status, 0).to_bytes());
        true
    }

    /// Checked against the session's COPY limits (§13).
    fn copy_descriptor(&mut self, _req: &Req, payload: &[u8]) -> Option<CopyDescriptor> {
        CopyDescriptor::decode_within(payload, &self.copy).ok()
    }
}

/// FLUSH addresses the whole export with offset and length 0, or a range (§3): a length of 0
/// with another offset is malformed.
pub fn flush_args_valid(h: &Header) -> bool {
    !(h.opcode == Opcode::Flush && h.length == 0 && h.offset != 0)
}

fn request(h: &Header, kind: Kind, len: usize) -> Decoded {
    let flags = h.flags.io_flags();
    Decoded::Request {
        req: Req {
            kind,
            offset: h.offset,
            length: h.length,
            flags,
            slot: Some(h.tag.slot()),
            cookie: cookie(h),
            target: 0,
        },
        len,
        payload_len: h.payload_len as usize,
        trailer: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_backend::IoFlags;
    use blkwire_wire::Flags;

    fn frame(h: &Header, payload: &[u8]) -> Vec<u8> {
        let mut h = *h;
        h.payload_len = payload.len() as u32;
        h.seal_crc(payload);
        let mut v = h.to_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn decode(n: &mut Native, bytes: &[u8]) -> (Req, usize, usize) {
        match n.decode(bytes, &mut Vec::new()) {
            Decoded::Request {
                req,
                len,
                payload_len,
                ..
            } => (req, len, payload_len),
            Decoded::Need(k) => panic!("need {k}"),
            Decoded::Violation(v) => panic!("violation {v}"),
            _ => panic!("not a request"),
        }
    }

    #[test]
    fn a_write_is_decoded_once_its_payload_is_in() {
        let mut n = Native::new(32, 1 << 20, CopyLimits::default());
        let mut h = Header::request(Opcode::Write, Tag::new(5, 9), 4096, 8);
        h.flags = Flags(Flags::FUA);
        h.queue = 3;
        h.session = 77;
        let bytes = frame(&h, &[1; 8]);
        assert!(matches!(
            n.decode(&bytes[..10], &mut Vec::new()),
            Decoded::Need(HEADER_LEN)
        ));
        assert!(
            matches!(n.decode(&bytes[..HEADER_LEN], &mut Vec::new()), Decoded::Need(l) if l == HEADER_LEN + 8)
        );
        let (req, len, payload) = decode(&mut n, &bytes);
        assert_eq!((len, payload), (HEADER_LEN + 8, 8));
        assert_eq!(req.kind, Kind::Block(BlockOp::Write));
        assert_eq!((req.offset, req.length, req.slot), (4096, 8, Some(5)));
        assert!(req.flags.has(IoFlags::FUA) && !req.flags.has(IoFlags::NO_HOLE));
        // The reply echoes what identifies the request, with the queue's credit.
        let mut tx = Vec::new();
        assert!(n.reply(&req, Status::ReadOnly, &mut tx));
        let r = Header::decode(&tx, 0).unwrap();
        assert!(r.is_reply());
        assert_eq!(
            (r.opcode, r.tag, r.queue, r.session),
            (Opcode::Write, h.tag, 3, 77)
        );
        assert_eq!(
            (r.offset, r.length, r.status, r.credit),
            (4096, 8, Status::ReadOnly, 32)
        );
    }

    #[test]
    fn a_keepalive_is_answered_by_the_frontend_itself() {
        let mut n = Native::new(8, 1 << 20, CopyLimits::default());
        let mut h = Header::request(Opcode::Keepalive, Tag::new(65535, 1), 0, 0);
        h.queue = 2;
        let bytes = frame(&h, &[]);
        let mut tx = Vec::new();
        assert!(
            matches!(n.decode(&bytes, &mut tx), Decoded::Answered { len } if len == HEADER_LEN)
        );
        let r = Header::decode(&tx, 0).unwrap();
        assert!(r.is_reply());
        assert_eq!(
            (r.opcode, r.status, r.tag, r.queue),
            (Opcode::Keepalive, Status::Ok, h.tag, 2)
        );
    }

    #[test]
    fn a_read_reply_prefix_announces_its_data() {
        let mut n = Native::new(4, 1 << 20, CopyLimits::default());
        let h = Header::request(Opcode::Read, Tag::new(1, 2), 512, 4096);
        let (req, ..) = decode(&mut n, &frame(&h, &[]));
        assert!(req.is_read());
        let mut out = [0u8; HEADER_LEN];
        assert_eq!(
            n.read_framing(&req),
            ReadFraming::Contiguous {
                prefix: HEADER_LEN,
                suffix: 0
            }
        );
        n.finish_read_reply(&req, &mut out, &[0; 4096], &mut []);
        let r = Header::decode(&out, 4096).unwrap();
        assert_eq!((r.status, r.payload_len, r.tag), (Status::Ok, 4096, h.tag));
    }

    #[test]
    fn malformed_requests_are_invalid_not_fatal() {
        let mut n = Native::new(4, 1 << 20, CopyLimits::default());
        let cases = [
            (
                Header::request(Opcode::Read, Tag::new(4, 0), 0, 512),
                vec![],
                "slot beyond depth",
            ),
            (
                Header::request(Opcode::Read, Tag::new(0, 0), 0, 512),
                vec![0; 8],
                "read with payload",
            ),
            (
                Header::request(Opcode::Write, Tag::new(0, 0), 0, 16),
                vec![0; 8],
                "short payload",
            ),
            (
                Header::request(Opcode::Flush, Tag::new(0, 0), 8, 0),
                vec![],
                "flush 8/0",
            ),
            (
                Header::request(Opcode::Hello, Tag::new(0, 0), 0, 0),
                vec![],
                "handshake frame",
            ),
        ];
        for (h, payload, why) in cases {
            let (req, len, _) = decode(&mut n, &frame(&h, &payload));
            assert_eq!(req.kind, Kind::Invalid, "{why}");
            assert_eq!(
                len,
                HEADER_LEN + payload.len(),
                "{why}: the payload is skipped"
            );
        }
        let copy = Header::request(Opcode::Copy, Tag::new(0, 0), 0, 0);
        assert_eq!(decode(&mut n, &frame(&copy, &[])).0.kind, Kind::Unsupported);
        let flush = Header::request(Opcode::Flush, Tag::new(0, 0), 0, 0);
        assert_eq!(
            decode(&mut n, &frame(&flush, &[])).0.kind,
            Kind::Block(BlockOp::Flush)
        );
    }

    #[test]
    fn broken_streams_are_violations() {
        let mut n = Native::new(4, 4096, CopyLimits::default());
        let mut h = Header::request(Opcode::Write, Tag::new(0, 0), 0, 8);
        let mut bytes = frame(&h, &[1; 8]);
        bytes[HEADER_LEN] ^= 1;
        assert!(
            matches!(n.decode(&bytes, &mut Vec::new()), Decoded::Violation(_)),
            "bad CRC"
        );
        h.flags = Flags(Flags::REPLY);
        assert!(
            matches!(
                n.decode(&frame(&h, &[1; 8]), &mut Vec::new()),
                Decoded::Violation(_)
            ),
            "a reply"
        );
        let big = Header::request(Opcode::Write, Tag::new(0, 0), 0, 8192);
        let mut b = big.to_bytes();
        b[32..36].copy_from_slice(&8192u32.to_le_bytes());
        assert!(
            matches!(n.decode(&b, &mut Vec::new()), Decoded::Violation(_)),
            "payload over max I/O"
        );
        assert!(
            matches!(
                n.decode(&[0u8; HEADER_LEN], &mut Vec::new()),
                Decoded::Violation(_)
            ),
            "bad magic"
        );
    }
}
