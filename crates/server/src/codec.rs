//! The frontends' wire formats seen from the data path: each protocol decodes its requests into
//! the neutral [`Req`] and encodes replies from it. The reactor, the slots and the backends are
//! the same for every frontend (native blkwire, NBD).

use blkwire_wire::nbd::{self, cflag, chunk, cmd};
use blkwire_wire::{Flags, Header, Opcode, Status, HEADER_LEN};

/// Which protocol a queue speaks once its handshake is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    /// blkwire's own frames (docs/PROTOCOL.md).
    Native,
    /// NBD transmission phase; `structured` if structured replies were negotiated, `allocation`
    /// if the `base:allocation` metadata context was selected.
    Nbd { structured: bool, allocation: bool },
}

/// What a request asks for, whatever protocol carried it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
    BlockStatus,
    Keepalive,
    /// End the queue after answering what came before (native LOGOUT: replied; NBD DISC: not).
    Logout,
    /// Well-formed but not something this export or protocol can do.
    Unsupported,
    /// Well-formed frame that is not valid here (e.g. HELLO on an open queue).
    Invalid,
}

/// A decoded request. Plain data: copied into a slot while its backend I/O is in flight.
#[derive(Clone, Copy, Debug)]
pub struct Req {
    pub kind: Kind,
    pub offset: u64,
    pub length: u32,
    pub fua: bool,
    pub no_hole: bool,
    pub fast_zero: bool,
    pub req_one: bool,
    /// Bytes of payload after the header (WRITE data).
    pub payload_len: u32,
    /// The native header (echoed in replies) or, for NBD, the cookie.
    pub id: Id,
}

#[derive(Clone, Copy, Debug)]
pub enum Id {
    Native(Header),
    Nbd(u64),
}

/// Result of looking at the front of a receive buffer.
pub enum Parsed {
    /// Not enough bytes yet for a header.
    Need,
    /// A request; `header_len` bytes of header, then `req.payload_len` bytes of payload.
    Request { req: Req, header_len: usize },
    /// The stream is not valid: close the queue.
    Violation(String),
}

impl Proto {
    pub fn parse(self, buf: &[u8], max_io: u32) -> Parsed {
        match self {
            Proto::Native => parse_native(buf, max_io),
            Proto::Nbd { .. } => parse_nbd(self, buf, max_io),
        }
    }

    /// Bytes a successful READ reply puts before its data.
    pub fn read_prefix_len(self) -> usize {
        match self {
            Proto::Native => HEADER_LEN,
            Proto::Nbd {
                structured: false, ..
            } => nbd::SIMPLE_REPLY_LEN,
            Proto::Nbd {
                structured: true, ..
            } => nbd::CHUNK_HEADER_LEN + 8,
        }
    }

    /// Fills the prefix of a successful READ reply of `len` bytes.
    pub fn write_read_prefix(self, req: &Req, credit: u16, out: &mut [u8]) {
        match (self, req.id) {
            (Proto::Native, Id::Native(h)) => {
                let mut r = h.reply(Status::Ok, req.length);
                r.credit = credit;
                r.encode((&mut out[..HEADER_LEN]).try_into().expect("header size"));
            }
            (
                Proto::Nbd {
                    structured: false, ..
                },
                Id::Nbd(cookie),
            ) => {
                out[0..4].copy_from_slice(&nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
                out[4..8].copy_from_slice(&0u32.to_be_bytes());
                out[8..16].copy_from_slice(&cookie.to_be_bytes());
            }
            (
                Proto::Nbd {
                    structured: true, ..
                },
                Id::Nbd(cookie),
            ) => {
                let (h, off) = out.split_at_mut(nbd::CHUNK_HEADER_LEN);
                nbd::chunk_header(
                    h,
                    chunk::FLAG_DONE,
                    chunk::OFFSET_DATA,
                    cookie,
                    8 + req.length,
                );
                off[..8].copy_from_slice(&req.offset.to_be_bytes());
            }
            _ => unreachable!("request decoded by another protocol"),
        }
    }

    /// Appends a reply without read data (status only), or, for the native protocol, with a
    /// payload. Returns false when the protocol sends no reply for this request (NBD DISC).
    pub fn reply(self, req: &Req, status: Status, credit: u16, tx: &mut Vec<u8>) -> bool {
        match (self, req.id) {
            (Proto::Native, Id::Native(h)) => {
                let mut r = h.reply(status, 0);
                r.credit = credit;
                tx.extend_from_slice(&r.to_bytes());
                true
            }
            (Proto::Nbd { structured, .. }, Id::Nbd(cookie)) => {
                if req.kind == Kind::Logout {
                    return false;
                }
                let error = nbd_error(req, status);
                if structured && error != 0 {
                    nbd::error_chunk(tx, cookie, error, &status.to_string());
                } else if structured && req.kind == Kind::Read {
                    // A READ must never get a simple reply once structured replies are on; a
                    // successful read always goes through write_read_prefix.
                    let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
                    nbd::chunk_header(&mut h, chunk::FLAG_DONE, chunk::NONE, cookie, 0);
                    tx.extend_from_slice(&h);
                } else {
                    nbd::simple_reply(tx, error, cookie);
                }
                true
            }
            _ => unreachable!("request decoded by another protocol"),
        }
    }

    /// Appends an NBD OFFSET_HOLE chunk covering the whole READ.
    pub fn hole_reply(self, req: &Req, tx: &mut Vec<u8>) {
        let Id::Nbd(cookie) = req.id else {
            unreachable!("holes are NBD structured replies")
        };
        let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
        nbd::chunk_header(&mut h, chunk::FLAG_DONE, chunk::OFFSET_HOLE, cookie, 12);
        tx.extend_from_slice(&h);
        tx.extend_from_slice(&req.offset.to_be_bytes());
        tx.extend_from_slice(&req.length.to_be_bytes());
    }

    /// Appends an NBD block status reply (`base:allocation`) for `extents` of (length, hole).
    pub fn block_status_reply(self, req: &Req, extents: &[(u32, bool)], tx: &mut Vec<u8>) {
        let Id::Nbd(cookie) = req.id else {
            unreachable!("block status is NBD only")
        };
        let len = 4 + 8 * extents.len() as u32;
        let mut h = [0u8; nbd::CHUNK_HEADER_LEN];
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
    }
}

/// The NBD error for a status. NBD wants EINVAL, not ENOSPC, for reads past the end.
fn nbd_error(req: &Req, status: Status) -> u32 {
    match status {
        Status::Ok => 0,
        Status::OutOfRange if req.kind != Kind::Write && req.kind != Kind::WriteZeroes => {
            nbd::err::EINVAL
        }
        s => nbd::errno_to_nbd(s.errno()),
    }
}

fn parse_native(buf: &[u8], max_io: u32) -> Parsed {
    if buf.len() < HEADER_LEN {
        return Parsed::Need;
    }
    let h = match Header::decode(buf, max_io) {
        Ok(h) => h,
        Err(e) => return Parsed::Violation(e.to_string()),
    };
    if h.is_reply() {
        return Parsed::Violation("received a reply frame".into());
    }
    let kind = match h.opcode {
        Opcode::Read => Kind::Read,
        Opcode::Write => Kind::Write,
        Opcode::Flush => Kind::Flush,
        Opcode::Trim => Kind::Trim,
        Opcode::WriteZeroes => Kind::WriteZeroes,
        Opcode::Keepalive => Kind::Keepalive,
        Opcode::Logout => Kind::Logout,
        Opcode::Copy => Kind::Unsupported,
        Opcode::Hello | Opcode::Join | Opcode::List | Opcode::Stats => Kind::Invalid,
    };
    let req = Req {
        kind,
        offset: h.offset,
        length: h.length,
        fua: h.flags.has(Flags::FUA),
        no_hole: h.flags.has(Flags::NO_HOLE),
        fast_zero: false,
        req_one: false,
        payload_len: h.payload_len,
        id: Id::Native(h),
    };
    Parsed::Request {
        req,
        header_len: HEADER_LEN,
    }
}

fn parse_nbd(proto: Proto, buf: &[u8], max_io: u32) -> Parsed {
    if buf.len() < nbd::REQUEST_LEN {
        return Parsed::Need;
    }
    let r = match nbd::Request::decode(buf, max_io) {
        Ok(r) => r,
        Err(e) => return Parsed::Violation(e.to_string()),
    };
    let structured = matches!(
        proto,
        Proto::Nbd {
            structured: true,
            ..
        }
    );
    let kind = match r.typ {
        // Unknown flags, or DF without structured replies: EINVAL (the spec's SHOULD).
        _ if r.flags & !cflag::KNOWN != 0 || (r.flags & cflag::DF != 0 && !structured) => {
            Kind::Invalid
        }
        cmd::READ => Kind::Read,
        cmd::WRITE => Kind::Write,
        cmd::DISC => Kind::Logout,
        cmd::FLUSH => Kind::Flush,
        cmd::TRIM => Kind::Trim,
        cmd::CACHE => Kind::Cache,
        cmd::WRITE_ZEROES => Kind::WriteZeroes,
        cmd::BLOCK_STATUS => Kind::BlockStatus,
        _ => Kind::Invalid,
    };
    let req = Req {
        kind,
        offset: r.offset,
        length: r.length,
        fua: r.flags & cflag::FUA != 0,
        no_hole: r.flags & cflag::NO_HOLE != 0,
        fast_zero: r.flags & cflag::FAST_ZERO != 0,
        req_one: r.flags & cflag::REQ_ONE != 0,
        payload_len: r.payload_len() as u32,
        id: Id::Nbd(r.cookie),
    };
    Parsed::Request {
        req,
        header_len: nbd::REQUEST_LEN,
    }
}
