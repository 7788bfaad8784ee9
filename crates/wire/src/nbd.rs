//! NBD wire format (the NetworkBlockDevice project's doc/proto.md): the fixed newstyle
//! handshake and the transmission phase with simple and structured replies. Like the native
//! codec, no I/O and no allocation beyond what a caller-chosen bound allows; every decoder here
//! has a fuzz target (`fuzz/fuzz_targets/nbd.rs`). All integers are big-endian.

use std::fmt;

/// First 8 bytes the server sends ("NBDMAGIC").
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
/// Newstyle magic the server sends after `NBDMAGIC`, and the magic of every option request ("IHAVEOPT").
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission-phase request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.

/// The fixed newstyle handshake (both directions).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
/// No 124 bytes of zeroes after NBD_OPT_EXPORT_NAME's reply (both directions).
pub const FLAG_NO_ZEROES: u16 = 2;

/// Options (client -> server).
pub mod opt {
    /// NBD_OPT_EXPORT_NAME: select an export, old style (no error reply possible).
    pub const EXPORT_NAME: u32 = 1;
    /// NBD_OPT_ABORT: end the handshake.
    pub const ABORT: u32 = 2;
    /// NBD_OPT_LIST: list the exports.
    pub const LIST: u32 = 3;
    /// NBD_OPT_STARTTLS: upgrade to TLS (offered with `serve --tls on|require`).
    pub const STARTTLS: u32 = 5;
    /// NBD_OPT_INFO: describe an export without selecting it.
    pub const INFO: u32 = 6;
    /// NBD_OPT_GO: describe an export and enter the transmission phase.
    pub const GO: u32 = 7;
    /// NBD_OPT_STRUCTURED_REPLY: ask for structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// NBD_OPT_LIST_META_CONTEXT: which metadata contexts match a query.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// NBD_OPT_SET_META_CONTEXT: select metadata contexts for block status.
    pub const SET_META_CONTEXT: u32 = 10;
    /// NBD_OPT_EXTENDED_HEADERS: 64-bit request and reply headers (refused by blkwire).
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    /// NBD_REP_ACK: the option succeeded; ends a sequence of replies.
    pub const ACK: u32 = 1;
    /// NBD_REP_SERVER: one export of an NBD_OPT_LIST answer.
    pub const SERVER: u32 = 2;
    /// NBD_REP_INFO: one NBD_INFO_* item of an INFO or GO answer.
    pub const INFO: u32 = 3;
    /// NBD_REP_META_CONTEXT: one metadata context and its id.
    pub const META_CONTEXT: u32 = 4;
    /// NBD_REP_ERR_UNSUP: option not known to the server.
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    /// NBD_REP_ERR_POLICY: option refused by policy.
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    /// NBD_REP_ERR_INVALID: option malformed or not allowed now.
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    /// NBD_REP_ERR_TLS_REQD: the server serves nothing before STARTTLS (FORCEDTLS).
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    /// NBD_REP_ERR_UNKNOWN: no such export.
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    /// NBD_REP_ERR_SHUTDOWN: the server is shutting down.
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
    /// NBD_REP_ERR_TOO_BIG: the option's data is longer than the server accepts.
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// NBD_INFO_* types.
pub mod info {
    /// NBD_INFO_EXPORT: size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// NBD_INFO_NAME: the export's canonical name.
    pub const NAME: u16 = 1;
    /// NBD_INFO_DESCRIPTION: a description for humans.
    pub const DESCRIPTION: u16 = 2;
    /// NBD_INFO_BLOCK_SIZE: minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    /// NBD_FLAG_HAS_FLAGS: always set; the other flags are meaningful.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// NBD_FLAG_READ_ONLY: the export refuses writes.
    pub const READ_ONLY: u16 = 1 << 1;
    /// NBD_FLAG_SEND_FLUSH: NBD_CMD_FLUSH is accepted.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// NBD_FLAG_SEND_FUA: the FUA command flag is accepted.
    pub const SEND_FUA: u16 = 1 << 3;
    /// NBD_FLAG_ROTATIONAL: the export behaves like a rotating disk.
    pub const ROTATIONAL: u16 = 1 << 4;
    /// NBD_FLAG_SEND_TRIM: NBD_CMD_TRIM is accepted.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// NBD_FLAG_SEND_WRITE_ZEROES: NBD_CMD_WRITE_ZEROES is accepted.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// NBD_FLAG_SEND_DF: the DF (don't fragment) command flag is accepted.
    pub const SEND_DF: u16 = 1 << 7;
    /// NBD_FLAG_CAN_MULTI_CONN: several connections see each other's writes and flushes.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// NBD_FLAG_SEND_CACHE: NBD_CMD_CACHE is accepted.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// NBD_FLAG_SEND_FAST_ZERO: the FAST_ZERO command flag is accepted.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Command types.
pub mod cmd {
    /// NBD_CMD_READ.
    pub const READ: u16 = 0;
    /// NBD_CMD_WRITE.
    pub const WRITE: u16 = 1;
    /// NBD_CMD_DISC: disconnect after the commands in flight.
    pub const DISC: u16 = 2;
    /// NBD_CMD_FLUSH.
    pub const FLUSH: u16 = 3;
    /// NBD_CMD_TRIM.
    pub const TRIM: u16 = 4;
    /// NBD_CMD_CACHE: prefetch a range.
    pub const CACHE: u16 = 5;
    /// NBD_CMD_WRITE_ZEROES.
    pub const WRITE_ZEROES: u16 = 6;
    /// NBD_CMD_BLOCK_STATUS: allocation status of a range.
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflag {
    /// NBD_CMD_FLAG_FUA: the write is durable before the reply.
    pub const FUA: u16 = 1 << 0;
    /// NBD_CMD_FLAG_NO_HOLE: WRITE_ZEROES allocates rather than punching a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// NBD_CMD_FLAG_DF: a READ's data in one chunk, not fragmented.
    pub const DF: u16 = 1 << 2;
    /// NBD_CMD_FLAG_REQ_ONE: BLOCK_STATUS answers with one extent.
    pub const REQ_ONE: u16 = 1 << 3;
    /// NBD_CMD_FLAG_FAST_ZERO: WRITE_ZEROES fails rather than being slow.
    pub const FAST_ZERO: u16 = 1 << 4;
    /// Every command flag this crate knows; others are refused.
    pub const KNOWN: u16 = FUA | NO_HOLE | DF | REQ_ONE | FAST_ZERO;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// NBD_REPLY_FLAG_DONE: the last chunk of a reply.
    pub const FLAG_DONE: u16 = 1;
    /// NBD_REPLY_TYPE_NONE: no data; ends a reply.
    pub const NONE: u16 = 0;
    /// NBD_REPLY_TYPE_OFFSET_DATA: read data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// NBD_REPLY_TYPE_OFFSET_HOLE: a range that reads as zeros.
    pub const OFFSET_HOLE: u16 = 2;
    /// NBD_REPLY_TYPE_BLOCK_STATUS: extents of one metadata context.
    pub const BLOCK_STATUS: u16 = 5;
    /// NBD_REPLY_TYPE_ERROR: an error with a message.
    pub const ERROR: u16 = (1 << 15) + 1;
}

// base:allocation status bits.

/// NBD_STATE_HOLE: the extent is not allocated.
pub const STATE_HOLE: u32 = 1;
/// NBD_STATE_ZERO: the extent reads as zeros.
pub const STATE_ZERO: u32 = 2;
/// The one metadata context blkwire serves.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Id under which `BASE_ALLOCATION` is served.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// NBD error values (they equal Linux errno numbers).
pub mod err {
    /// Operation not permitted (read-only export).
    pub const EPERM: u32 = 1;
    /// Input/output error; also every error NBD does not define.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid request.
    pub const EINVAL: u32 = 22;
    /// No space left (or beyond the end of the export).
    pub const ENOSPC: u32 = 28;
    /// A READ with DF too large for one chunk.
    pub const EOVERFLOW: u32 = 75;
    /// Operation not supported.
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Maps an errno to the closest error NBD defines (others become EIO, as the spec asks).
pub fn errno_to_nbd(errno: i32) -> u32 {
    match errno as u32 {
        e @ (err::EPERM
        | err::EIO
        | err::ENOMEM
        | err::EINVAL
        | err::ENOSPC
        | err::EOVERFLOW
        | err::ENOTSUP
        | err::ESHUTDOWN) => e,
        0 => 0,
        _ => err::EIO,
    }
}

/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Bytes of an option request header (magic, option, data length).
pub const OPTION_HEADER_LEN: usize = 16;

/// Why NBD input was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdError {
    /// Fewer bytes than the fixed header.
    Short,
    /// A magic number other than the one the message must start with.
    BadMagic(u64),
    /// A WRITE announcing more data than the receiver accepts.
    PayloadTooLarge {
        /// The length announced.
        len: u32,
        /// The receiver's limit.
        max: u32,
    },
    /// Option data ends inside a field.
    Truncated,
    /// A string longer than `MAX_NAME`.
    StringTooLong(usize),
    /// A string that is not UTF-8.
    NotUtf8,
    /// Bytes left over after the option data.
    TrailingBytes,
}

impl fmt::Display for NbdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdError::Short => write!(f, "message shorter than its header"),
            NbdError::BadMagic(m) => write!(f, "bad NBD magic {m:#x}"),
            NbdError::PayloadTooLarge { len, max } => {
                write!(f, "payload of {len} bytes exceeds {max}")
            }
            NbdError::Truncated => write!(f, "option data truncated"),
            NbdError::StringTooLong(n) => write!(f, "string of {n} bytes is too long"),
            NbdError::NotUtf8 => write!(f, "string is not UTF-8"),
            NbdError::TrailingBytes => write!(f, "unexpected bytes after the option data"),
        }
    }
}

impl std::error::Error for NbdError {}

fn be16(b: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([b[i], b[i + 1]])
}
fn be32(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}
fn be64(b: &[u8], i: usize) -> u64 {
    u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

/// A transmission-phase request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`cflag`).
    pub flags: u16,
    /// Command type (`cmd`).
    pub typ: u16,
    /// Opaque handle the reply echoes.
    pub cookie: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Bytes to read or write, or the range's length.
    pub length: u32,
}

impl Request {
    /// Decodes a request header. `max_write` bounds the payload a WRITE may announce, so a hostile
    /// length never becomes an allocation.
    pub fn decode(b: &[u8], max_write: u32) -> Result<Request, NbdError> {
        if b.len() < REQUEST_LEN {
            return Err(NbdError::Short);
        }
        let magic = be32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(NbdError::BadMagic(magic as u64));
        }
        let r = Request {
            flags: be16(b, 4),
            typ: be16(b, 6),
            cookie: be64(b, 8),
            offset: be64(b, 16),
            length: be32(b, 24),
        };
        if r.typ == cmd::WRITE && r.length > max_write {
            return Err(NbdError::PayloadTooLarge {
                len: r.length,
                max: max_write,
            });
        }
        Ok(r)
    }

    /// Bytes of payload that follow this header.
    pub fn payload_len(&self) -> usize {
        if self.typ == cmd::WRITE {
            self.length as usize
        } else {
            0
        }
    }

    /// The header as sent on the wire.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.typ.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Appends a simple reply header.
pub fn simple_reply(out: &mut Vec<u8>, error: u32, cookie: u64) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// Writes a structured chunk header into `out` (exactly CHUNK_HEADER_LEN bytes).
pub fn chunk_header(out: &mut [u8], flags: u16, typ: u16, cookie: u64, len: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&typ.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
}

/// Appends a final error chunk carrying `error` and a short message for humans.
pub fn error_chunk(out: &mut Vec<u8>, cookie: u64, error: u32, msg: &str) {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    let mut h = [0u8; CHUNK_HEADER_LEN];
    chunk_header(
        &mut h,
        chunk::FLAG_DONE,
        chunk::ERROR,
        cookie,
        6 + msg.len() as u32,
    );
    out.extend_from_slice(&h);
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// An option request header: (option, data length).
pub fn decode_option_header(b: &[u8]) -> Result<(u32, u32), NbdError> {
    if b.len() < OPTION_HEADER_LEN {
        return Err(NbdError::Short);
    }
    let magic = be64(b, 0);
    if magic != IHAVEOPT {
        return Err(NbdError::BadMagic(magic));
    }
    Ok((be32(b, 8), be32(b, 12)))
}

/// Appends an option reply.
pub fn option_reply(out: &mut Vec<u8>, option: u32, typ: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Bounds-checked cursor over option data.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], NbdError> {
        if self.0.len() < n {
            return Err(NbdError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self) -> Result<u16, NbdError> {
        Ok(be16(self.take(2)?, 0))
    }
    fn u32(&mut self) -> Result<u32, NbdError> {
        Ok(be32(self.take(4)?, 0))
    }
    /// A u32-length-prefixed string of at most `max` bytes.
    fn string(&mut self, max: usize) -> Result<String, NbdError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(NbdError::StringTooLong(n));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| NbdError::NotUtf8)
    }
}

/// Longest export name or metadata context string accepted (the spec's limit is 4096).
pub const MAX_NAME: usize = 4096;

/// NBD_OPT_INFO / NBD_OPT_GO data: the export name and the info types asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name (empty: the default export).
    pub name: String,
    /// NBD_INFO_* types asked for.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Decodes the option's data; every count is checked against the bytes present.
    pub fn decode(data: &[u8]) -> Result<InfoRequest, NbdError> {
        let mut c = Cursor(data);
        let name = c.string(MAX_NAME)?;
        let n = c.u16()? as usize;
        // Bounded by the data actually present (2 bytes each).
        let mut requests = Vec::with_capacity(n.min(c.0.len() / 2));
        for _ in 0..n {
            requests.push(c.u16()?);
        }
        if !c.0.is_empty() {
            return Err(NbdError::TrailingBytes);
        }
        Ok(InfoRequest { name, requests })
    }
}

/// NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest {
    /// Export name the contexts are for.
    pub export: String,
    /// Context queries (`namespace:` prefixes or full names).
    pub queries: Vec<String>,
}

impl MetaRequest {
    /// Decodes the option's data; every count is checked against the bytes present.
    pub fn decode(data: &[u8]) -> Result<MetaRequest, NbdError> {
        let mut c = Cursor(data);
        let export = c.string(MAX_NAME)?;
        let n = c.u32()? as usize;
        let mut queries = Vec::with_capacity(n.min(c.0.len() / 4));
        for _ in 0..n {
            queries.push(c.string(MAX_NAME)?);
        }
        if !c.0.is_empty() {
            return Err(NbdError::TrailingBytes);
        }
        Ok(MetaRequest { export, queries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip_and_limits() {
        let r = Request {
            flags: cflag::FUA,
            typ: cmd::WRITE,
            cookie: 7,
            offset: 1 << 33,
            length: 4096,
        };
        assert_eq!(Request::decode(&r.encode(), 1 << 20), Ok(r));
        assert_eq!(r.payload_len(), 4096);
        assert_eq!(
            Request::decode(&r.encode(), 1024),
            Err(NbdError::PayloadTooLarge {
                len: 4096,
                max: 1024
            })
        );
        let read = Request {
            typ: cmd::READ,
            length: u32::MAX,
            ..r
        };
        assert_eq!(
            Request::decode(&read.encode(), 1024).unwrap().payload_len(),
            0,
            "reads carry no payload"
        );
        let mut bad = r.encode();
        bad[0] = 0;
        assert!(matches!(
            Request::decode(&bad, 1 << 20),
            Err(NbdError::BadMagic(_))
        ));
        // Unknown command flags decode: the server answers EINVAL instead of hanging up.
        let odd = Request { flags: 1 << 9, ..r };
        assert_eq!(Request::decode(&odd.encode(), 1 << 20), Ok(odd));
        assert_eq!(Request::decode(&[0; 27], 0), Err(NbdError::Short));
    }

    #[test]
    fn info_and_meta_requests_parse_and_bound() {
        let mut d = Vec::new();
        d.extend_from_slice(&5u32.to_be_bytes());
        d.extend_from_slice(b"disk0");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&info::NAME.to_be_bytes());
        assert_eq!(
            InfoRequest::decode(&d).unwrap(),
            InfoRequest {
                name: "disk0".into(),
                requests: vec![3, 1]
            }
        );
        assert_eq!(
            InfoRequest::decode(&d[..d.len() - 1]),
            Err(NbdError::Truncated)
        );
        let mut huge = d.clone();
        huge[5 + 4..5 + 6].copy_from_slice(&0xffffu16.to_be_bytes());
        assert_eq!(InfoRequest::decode(&huge), Err(NbdError::Truncated));
        let mut m = Vec::new();
        m.extend_from_slice(&0u32.to_be_bytes());
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
        m.extend_from_slice(BASE_ALLOCATION.as_bytes());
        assert_eq!(
            MetaRequest::decode(&m).unwrap().queries,
            vec![BASE_ALLOCATION.to_string()]
        );
        let mut long = Vec::new();
        long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            MetaRequest::decode(&long),
            Err(NbdError::StringTooLong(u32::MAX as usize))
        );
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(errno_to_nbd(1), err::EPERM);
        assert_eq!(errno_to_nbd(95), err::ENOTSUP);
        assert_eq!(errno_to_nbd(13), err::EIO);
    }
}
