//! NBD's transmission phase (after the fixed-newstyle negotiation in `crate::nbd`): requests
//! carry cookies, so the server assigns slots; replies are simple or, once negotiated,
//! structured (with holes and `base:allocation` block status).

use blkwire_backend::{BlockOp, IoFlags};
use blkwire_wire::nbd::{self, cflag, chunk, cmd};
use blkwire_wire::Status;

use super::{Decoded, Kind, ReadFraming, Req, StreamFrontend};

/// An NBD connection's transmission state, as negotiated.
pub struct Nbd {
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The `base:allocation` metadata context was selected.
    pub allocation: bool,
    /// Largest request payload accepted.
    pub max_io: u32,
    /// NBD_FLAG_SEND_FAST_ZERO was advertised (or the export is read-only: EPERM then, as for
    /// any change): without it a FAST_ZERO flag is EINVAL (the spec), with it a zeroing that
    /// cannot be fast is ENOTSUP.
    pub fast_zero: bool,
}

/// The command flags a request of type `typ` may carry (proto.md, "Command flags"): FUA on
/// any (clients are known to set it on commands that write nothing, and the server MUST accept
/// it there), each other flag only on the command it is defined for.
fn applicable_flags(typ: u16) -> u16 {
    cflag::FUA
        | match typ {
            cmd::READ => cflag::DF,
            cmd::WRITE_ZEROES => cflag::NO_HOLE | cflag::FAST_ZERO,
            cmd::BLOCK_STATUS => cflag::REQ_ONE,
            _ => 0,
        }
}

impl StreamFrontend for Nbd {
    fn decode(&mut self, rx: &[u8], _tx: &mut Vec<u8>) -> Decoded {
        if rx.len() < nbd::REQUEST_LEN {
            return Decoded::Need(nbd::REQUEST_LEN);
        }
        let r = match nbd::Request::decode(rx, self.max_io) {
            Ok(r) => r,
            Err(e) => return Decoded::Violation(e.to_string()),
        };
        let payload_len = r.payload_len();
        let len = nbd::REQUEST_LEN + payload_len;
        if rx.len() < len {
            return Decoded::Need(len);
        }
        let (mut offset, mut length) = (r.offset, r.length);
        let kind = match r.typ {
            // DISC has no reply (proto.md): whatever flags it carries, an EINVAL reply to it
            // would be one the client never reads, and the connection would stay open.
            cmd::DISC => Kind::Logout,
            // Unknown flags, a flag the command does not take, or DF without structured
            // replies: EINVAL (proto.md, "Error values": the server SHOULD).
            _ if r.flags & !applicable_flags(r.typ) != 0
                || (r.flags & cflag::DF != 0 && !self.structured) =>
            {
                Kind::Invalid
            }
            // Longer than any reply we may send (the executor would refuse it too): EINVAL.
            cmd::READ if r.length > self.max_io => Kind::Invalid,
            cmd::READ => Kind::Block(BlockOp::Read),
            cmd::WRITE => Kind::Block(BlockOp::Write),
            cmd::FLUSH => {
                // NBD's FLUSH covers the whole export; its offset and length are ignored.
                (offset, length) = (0, 0);
                Kind::Block(BlockOp::Flush)
            }
            cmd::TRIM => Kind::Block(BlockOp::Trim),
            cmd::CACHE => Kind::Cache,
            cmd::WRITE_ZEROES if r.flags & cflag::FAST_ZERO != 0 && !self.fast_zero => {
                Kind::Invalid
            }
            cmd::WRITE_ZEROES => Kind::Block(BlockOp::WriteZeroes),
            // Without `base:allocation` selected there is nothing to answer with: EINVAL at
            // once, not after the backend walked the range (up to 4 GiB of it).
            cmd::BLOCK_STATUS if r.length == 0 || !self.allocation => Kind::Invalid,
            cmd::BLOCK_STATUS => Kind::BlockStatus,
            _ => Kind::Invalid,
        };
        let flags = IoFlags::empty()
            .with(IoFlags::FUA, r.flags & cflag::FUA != 0)
            .with(IoFlags::NO_HOLE, r.flags & cflag::NO_HOLE != 0)
            .with(IoFlags::FAST_ZERO, r.flags & cflag::FAST_ZERO != 0)
            .with(IoFlags::REQ_ONE, r.flags & cflag::REQ_ONE != 0);
        Decoded::Request {
            req: Req {
                kind,
                offset,
                length,
                flags,
                slot: None,
                cookie: r.cookie as u128,
                target: 0,
            },
            len,
            payload_len,
            trailer: 0,
        }
    }

    fn server_assigns_slots(&self) -> bool {
        true
    }

    fn read_framing(&self, _req: &Req) -> ReadFraming {
        let prefix = if self.structured {
            nbd::CHUNK_HEADER_LEN + 8
        } else {
            nbd::SIMPLE_REPLY_LEN
        };
        ReadFraming::Contiguous { prefix, suffix: 0 }
    }

    fn finish_read_reply(&mut self, req: &Req, out: &mut [u8], _data: &[u8], _suffix: &mut [u8]) {
        let cookie = req.cookie as u64;
        if self.structured {
            let (h, off) = out.split_at_mut(nbd::CHUNK_HEADER_LEN);
            nbd::chunk_header(
                h,
                chunk::FLAG_DONE,
                chunk::OFFSET_DATA,
                cookie,
                8 + req.length,
            );
            off[..8].copy_from_slice(&req.offset.to_be_bytes());
        } else {
            out[0..4].copy_from_slice(&nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
            out[4..8].copy_from_slice(&0u32.to_be_bytes());
            out[8..16].copy_from_slice(&cookie.to_be_bytes());
        }
    }

    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        if req.kind == Kind::Logout {
            return false;
        }
        let cookie = req.cookie as u64;
        let error = nbd_error(req, status);
        if self.structured && error != 0 {
            nbd::error_chunk(tx, cookie, error, &status.to_string());
        } else if self.structured && req.is_read() {
            // A READ must never get a simple reply once structured replies are on; a successful
            // read with data always goes through finish_read_reply.
            let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
            nbd::chunk_header(&mut h, chunk::FLAG_DONE, chunk::NONE, cookie, 0);
            tx.extend_from_slice(&h);
        } else {
            nbd::simple_reply(tx, error, cookie);
        }
        true
    }

    fn replies_with_holes(&self) -> bool {
        self.structured
    }

    fn hole_reply(&self, req: &Req, tx: &mut Vec<u8>) {
        let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
        let cookie = req.cookie as u64;
        nbd::chunk_header(&mut h, chunk::FLAG_DONE, chunk::OFFSET_HOLE, cookie, 12);
        tx.extend_from_slice(&h);
        tx.extend_from_slice(&req.offset.to_be_bytes());
        tx.extend_from_slice(&req.length.to_be_bytes());
    }

    fn block_status_len(&self, _req: &Req, extents: usize) -> usize {
        if !self.allocation {
            return 0;
        }
        // What block_status_reply writes: a chunk header, the context id, 8 bytes per extent.
        nbd::CHUNK_HEADER_LEN + 4 + 8 * extents
    }

    fn block_status_reply(&mut self, req: &Req, extents: &[(u32, bool)], tx: &mut Vec<u8>) -> bool {
        if !self.allocation {
            return false;
        }
        let len = 4 + 8 * extents.len() as u32;
        let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
        let cookie = req.cookie as u64;
        nbd::chunk_header(&mut h, chunk::FLAG_DONE, chunk::BLOCK_STATUS, cookie, len);
        tx.extend_from_slice(&h);
        tx.extend_from_slice(&nbd::BASE_ALLOCATION_ID.to_be_bytes());
        for &(l, hole) in extents {
            tx.extend_from_slice(&l.to_be_bytes());
            let flags = if hole {
                nbd::STATE_HOLE | nbd::STATE_ZERO
            } else {
                0
            };
            tx.extend_from_slice(&flags.to_be_bytes());
        }
        true
    }
}

/// The NBD error for a status. NBD wants EINVAL, not ENOSPC, for reads past the end.
fn nbd_error(req: &Req, status: Status) -> u32 {
    let writes = matches!(
        req.kind,
        Kind::Block(BlockOp::Write) | Kind::Block(BlockOp::WriteZeroes)
    );
    match status {
        Status::Ok => 0,
        Status::OutOfRange if !writes => nbd::err::EINVAL,
        s => nbd::errno_to_nbd(s.errno()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(typ: u16, flags: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&nbd::REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        b
    }

    fn nbd(structured: bool) -> Nbd {
        Nbd {
            structured,
            allocation: structured,
            max_io: 1 << 20,
            fast_zero: true,
        }
    }

    #[test]
    fn fast_zero_is_invalid_where_it_was_not_advertised() {
        let flags = cflag::FAST_ZERO;
        let (r, _) = req(
            &mut nbd(true),
            &request(cmd::WRITE_ZEROES, flags, 1, 0, 512),
        );
        assert_eq!(r.kind, Kind::Block(BlockOp::WriteZeroes));
        assert!(r.flags.has(IoFlags::FAST_ZERO));
        let mut slow = Nbd {
            fast_zero: false,
            ..nbd(true)
        };
        let (r, _) = req(&mut slow, &request(cmd::WRITE_ZEROES, flags, 1, 0, 512));
        assert_eq!(r.kind, Kind::Invalid);
        let (r, _) = req(&mut slow, &request(cmd::WRITE_ZEROES, 0, 1, 0, 512));
        assert_eq!(
            r.kind,
            Kind::Block(BlockOp::WriteZeroes),
            "plain zeroing goes"
        );
    }

    fn req(n: &mut Nbd, bytes: &[u8]) -> (Req, usize) {
        match n.decode(bytes, &mut Vec::new()) {
            Decoded::Request { req, len, .. } => (req, len),
            _ => panic!("not a request"),
        }
    }

    #[test]
    fn writes_wait_for_their_payload_and_flags_carry_over() {
        let mut n = nbd(true);
        let mut b = request(cmd::WRITE, cflag::FUA, 0xabc, 4096, 512);
        assert!(
            matches!(n.decode(&b, &mut Vec::new()), Decoded::Need(l) if l == nbd::REQUEST_LEN + 512)
        );
        b.extend_from_slice(&[7; 512]);
        let (r, len) = req(&mut n, &b);
        assert_eq!(len, nbd::REQUEST_LEN + 512);
        assert_eq!(r.kind, Kind::Block(BlockOp::Write));
        assert!(r.flags.has(IoFlags::FUA) && r.slot.is_none() && r.cookie == 0xabc);
    }

    #[test]
    fn flush_ignores_its_range_and_unknown_flags_are_invalid() {
        let mut n = nbd(false);
        let (r, _) = req(&mut n, &request(cmd::FLUSH, 0, 1, 999, 7));
        assert_eq!(
            (r.kind, r.offset, r.length),
            (Kind::Block(BlockOp::Flush), 0, 0)
        );
        let (r, _) = req(&mut n, &request(cmd::READ, 0x8000, 1, 0, 512));
        assert_eq!(r.kind, Kind::Invalid);
        let (r, _) = req(&mut n, &request(cmd::READ, cflag::DF, 1, 0, 512));
        assert_eq!(r.kind, Kind::Invalid, "DF needs structured replies");
        // Each flag only on the command it is defined for; FUA on any.
        let mut s = nbd(true);
        for (typ, flag, ok) in [
            (cmd::READ, cflag::DF, true),
            (cmd::WRITE, cflag::DF, false),
            (cmd::WRITE, cflag::FAST_ZERO, false),
            (cmd::WRITE, cflag::NO_HOLE, false),
            (cmd::TRIM, cflag::NO_HOLE, false),
            (cmd::READ, cflag::REQ_ONE, false),
            (cmd::BLOCK_STATUS, cflag::REQ_ONE, true),
            (cmd::BLOCK_STATUS, cflag::DF, false),
            (cmd::WRITE_ZEROES, cflag::NO_HOLE | cflag::FAST_ZERO, true),
            (cmd::WRITE_ZEROES, cflag::REQ_ONE, false),
            (cmd::FLUSH, cflag::FUA, true),
            (cmd::READ, cflag::FUA, true),
            (cmd::CACHE, cflag::NO_HOLE, false),
        ] {
            let len = if typ == cmd::WRITE { 512 } else { 0 };
            let mut frame = request(typ, flag, 1, 0, 512);
            frame.resize(frame.len() + len, 0);
            let (r, _) = req(&mut s, &frame);
            assert_eq!(r.kind != Kind::Invalid, ok, "command {typ} flags {flag:#x}");
        }
        let (r, _) = req(&mut n, &request(cmd::READ, 0, 1, 0, u32::MAX));
        assert_eq!(r.kind, Kind::Invalid, "a read longer than max I/O");
        let (r, _) = req(&mut n, &request(cmd::DISC, 0, 1, 0, 0));
        let mut tx = Vec::new();
        assert!(
            !n.reply(&r, Status::Ok, &mut tx) && tx.is_empty(),
            "DISC gets no reply"
        );
    }

    #[test]
    fn errors_map_to_nbd_errnos_and_structured_reads_never_get_simple_replies() {
        let mut simple = nbd(false);
        // The error of the simple reply to a request of `command` answered `status`.
        let mut errno = |command, len, status| {
            let (r, _) = req(&mut simple, &request(command, 0, 5, 0, len));
            let mut tx = Vec::new();
            simple.reply(&r, status, &mut tx);
            u32::from_be_bytes(tx[4..8].try_into().unwrap())
        };
        assert_eq!(errno(cmd::READ, 512, Status::OutOfRange), nbd::err::EINVAL);
        assert_eq!(
            errno(cmd::WRITE_ZEROES, 512, Status::OutOfRange),
            nbd::err::ENOSPC
        );
        // A backend out of space is ENOSPC whatever the command (a FLUSH of a full file).
        assert_eq!(errno(cmd::FLUSH, 0, Status::NoSpace), nbd::err::ENOSPC);

        let mut s = nbd(true);
        let (r, _) = req(&mut s, &request(cmd::READ, 0, 5, 0, 512));
        let mut tx = Vec::new();
        s.reply(&r, Status::Ok, &mut tx);
        assert_eq!(tx.len(), nbd::CHUNK_HEADER_LEN, "an empty structured chunk");
        assert_eq!(
            u32::from_be_bytes(tx[0..4].try_into().unwrap()),
            nbd::STRUCTURED_REPLY_MAGIC
        );
    }

    #[test]
    fn block_status_needs_the_allocation_context() {
        let mut off = Nbd {
            allocation: false,
            ..nbd(true)
        };
        let (r, _) = req(&mut off, &request(cmd::BLOCK_STATUS, 0, 5, 0, 512));
        assert_eq!(
            r.kind,
            Kind::Invalid,
            "refused before the backend walks the range"
        );
        let (r, _) = req(&mut nbd(true), &request(cmd::BLOCK_STATUS, 0, 5, 0, 512));
        assert_eq!(r.kind, Kind::BlockStatus);
        let mut tx = Vec::new();
        assert!(!off.block_status_reply(&r, &[(512, true)], &mut tx));
        let mut on = nbd(true);
        assert!(on.block_status_reply(&r, &[(256, true), (256, false)], &mut tx));
        assert_eq!(tx.len(), nbd::CHUNK_HEADER_LEN + 4 + 16);
        // What the memory budget sets aside for it (`covers_block_status`) is what it wrote.
        assert_eq!(on.block_status_len(&r, 2), tx.len());
        assert_eq!(off.block_status_len(&r, 2), 0, "refused: a status reply");
    }
}
