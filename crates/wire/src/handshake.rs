//! HELLO / LIST payloads (PROTOCOL.md §7). Bounded by construction: every string is at most
//! 255 bytes and every count is checked against the bytes actually present.

use std::fmt;

/// Longest string field (§7: `u8` length prefix).
pub const MAX_STR: usize = 255;

/// Export feature bits carried in the HELLO reply and LIST entries (§7).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features(pub u64);

impl Features {
    /// Writes are refused.
    pub const READ_ONLY: u64 = 1 << 0;
    /// FLUSH is meaningful.
    pub const FLUSH: u64 = 1 << 1;
    /// FUA is meaningful.
    pub const FUA: u64 = 1 << 2;
    /// TRIM is accepted.
    pub const TRIM: u64 = 1 << 3;
    /// WRITE_ZEROES is accepted.
    pub const WRITE_ZEROES: u64 = 1 << 4;
    /// COPY is supported.
    pub const COPY: u64 = 1 << 5;
    /// The export behaves like a rotating disk.
    pub const ROTATIONAL: u64 = 1 << 6;
    /// Every byte of the export reads as zero right now.
    pub const INIT_ZERO: u64 = 1 << 7;

    const NAMES: [(u64, &'static str); 8] = [
        (Self::READ_ONLY, "read-only"),
        (Self::FLUSH, "flush"),
        (Self::FUA, "fua"),
        (Self::TRIM, "trim"),
        (Self::WRITE_ZEROES, "write-zeroes"),
        (Self::COPY, "copy"),
        (Self::ROTATIONAL, "rotational"),
        (Self::INIT_ZERO, "init-zero"),
    ];

    /// Is `bit` set?
    pub fn has(self, bit: u64) -> bool {
        self.0 & bit != 0
    }

    /// Human names of the set bits, in bit order.
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES
            .iter()
            .filter(|(b, _)| self.has(*b))
            .map(|(_, n)| *n)
            .collect()
    }
}

/// Why a handshake payload could not be parsed or built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PayloadError {
    /// The payload ends inside a field.
    Truncated,
    /// A string longer than `MAX_STR`.
    StringTooLong(usize),
    /// A string that is not UTF-8.
    NotUtf8,
    /// Bytes left over after the last field.
    TrailingBytes(usize),
    /// A field out of its allowed range.
    Invalid(&'static str),
}

impl fmt::Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PayloadError::Truncated => write!(f, "handshake payload truncated"),
            PayloadError::StringTooLong(n) => {
                write!(f, "string of {n} bytes exceeds the {MAX_STR}-byte limit")
            }
            PayloadError::NotUtf8 => write!(f, "string is not UTF-8"),
            PayloadError::TrailingBytes(n) => write!(f, "{n} unexpected bytes after the payload"),
            PayloadError::Invalid(why) => write!(f, "invalid handshake field: {why}"),
        }
    }
}

impl std::error::Error for PayloadError {}

/// Cursor over a received payload; every read is bounds-checked.
pub struct PayloadReader<'a> {
    buf: &'a [u8],
}

impl<'a> PayloadReader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        PayloadReader { buf }
    }
    /// Takes the next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], PayloadError> {
        if self.buf.len() < n {
            return Err(PayloadError::Truncated);
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    /// Reads a little-endian u16.
    pub fn u16(&mut self) -> Result<u16, PayloadError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    /// Reads a little-endian u32.
    pub fn u32(&mut self) -> Result<u32, PayloadError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    /// Reads a little-endian u64.
    pub fn u64(&mut self) -> Result<u64, PayloadError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    /// Reads a `u8`-length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<String, PayloadError> {
        let n = self.take(1)?[0] as usize;
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| PayloadError::NotUtf8)
    }
    /// Reads `u16`-length-prefixed bytes.
    pub fn bytes16(&mut self) -> Result<&'a [u8], PayloadError> {
        let n = self.u16()? as usize;
        self.take(n)
    }
    /// Checks that nothing is left over.
    pub fn finish(self) -> Result<(), PayloadError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(PayloadError::TrailingBytes(n)),
        }
    }
}

/// Builder for a payload.
#[derive(Default)]
pub struct PayloadWriter {
    /// The payload built so far.
    pub buf: Vec<u8>,
}

impl PayloadWriter {
    /// Appends a little-endian u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a little-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a little-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Appends a `u8`-length-prefixed string (at most `MAX_STR` bytes).
    pub fn str(&mut self, s: &str) -> Result<&mut Self, PayloadError> {
        if s.len() > MAX_STR {
            return Err(PayloadError::StringTooLong(s.len()));
        }
        self.buf.push(s.len() as u8);
        self.buf.extend_from_slice(s.as_bytes());
        Ok(self)
    }
    /// Appends `u16`-length-prefixed bytes.
    pub fn bytes16(&mut self, b: &[u8]) -> Result<&mut Self, PayloadError> {
        let n = u16::try_from(b.len()).map_err(|_| PayloadError::Invalid("auth too long"))?;
        self.u16(n);
        self.buf.extend_from_slice(b);
        Ok(self)
    }
}

/// HELLO request (§7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Queues wanted (at least 1).
    pub queues: u16,
    /// Slots per queue wanted (at least 1).
    pub depth: u16,
    /// Largest I/O wanted, in bytes (at least 512).
    pub max_io: u32,
    /// Reserved, 0.
    pub client_features: u64,
    /// Datagrams: the largest frame payload the initiator's link carries (0 on TCP).
    pub frame_payload: u32,
    /// Random per HELLO attempt, so a retransmitted HELLO maps to the same session.
    pub nonce: u64,
    /// Initiator identity (hostname), logged.
    pub host_id: String,
    /// Export name.
    pub export: String,
    /// Challenge, nonces and proof (§12.1).
    pub auth: AuthBlock,
    /// The queue of an earlier session this session takes over (§2.6): the target ends it,
    /// and answers only once none of its requests still runs. Sent after `auth` with the
    /// `REPLACES` bit set.
    pub replaces: Option<QueueRef>,
}

/// A queue of a session, as the initiator that holds it names it (§2.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRef {
    /// The session's id (from its HELLO reply).
    pub session: u32,
    /// The queue's index within it.
    pub queue: u16,
    /// The session's cookie: proves the initiator held that session.
    pub cookie: u64,
}

impl QueueRef {
    /// Bytes on the wire: u32 session, u16 queue, u16 reserved (0), u64 cookie.
    pub const LEN: usize = 16;
}

/// Bytes of a nonce or a proof (§12).
pub const AUTH_LEN: usize = 32;

/// HELLO `client_features` bit: with an empty export name, ask for the LIST payload (§12.3).
pub const QUERY_LIST: u64 = 1 << 0;
/// HELLO `client_features` bit: with an empty export name, ask for the STATS document (§12.3).
pub const QUERY_STATS: u64 = 1 << 1;
/// HELLO `client_features` bit, UDP only: let the CRC of WRITE and READ data frames cover their
/// header alone, UDP's checksum covering the payload (§9.7). Granted in the reply's
/// `session_flags`.
pub const HEADER_CRC: u64 = 1 << 2;
/// HELLO `client_features` bit: the payload ends with the [`QueueRef`] this session replaces
/// (§2.6). Set by [`Hello::encode`] whenever `replaces` is given.
pub const REPLACES: u64 = 1 << 3;

/// HELLO reply `session_flags` bit: `HEADER_CRC` granted (§9.7).
pub const SESSION_HEADER_CRC: u16 = 1 << 0;

/// How an initiator authenticates (§12.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMethod {
    /// No key: the exchange proves only the initiator's address.
    None = 0,
    /// A pre-shared key, HMAC-SHA-256 proofs both ways.
    Psk = 1,
}

/// The `auth` field of HELLO (§12.1): exactly 98 bytes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthBlock {
    /// How the initiator authenticates.
    pub method: AuthMethod,
    /// Datagram frames are to be encrypted, not only authenticated (§12.4).
    pub encrypt: bool,
    /// The initiator sends this HELLO over a datagram link (UDP, Ethernet); clear on a stream.
    /// Inside the transcript, so a HELLO cannot be relayed to the other kind of link, where
    /// the target would seal (or not seal) otherwise than the initiator expects (§12.1).
    pub datagram: bool,
    /// The initiator's nonce.
    pub nonce_c: [u8; AUTH_LEN],
    /// The target's challenge nonce; zeros in the first HELLO.
    pub nonce_s: [u8; AUTH_LEN],
    /// The initiator's proof (method `Psk`, second HELLO); else zeros.
    pub proof_c: [u8; AUTH_LEN],
}

impl AuthBlock {
    /// Bytes on the wire.
    pub const LEN: usize = 2 + 3 * AUTH_LEN;
    const ENCRYPT: u8 = 1;
    const DATAGRAM: u8 = 2;

    /// A first-HELLO block: fresh nonce, no challenge answered yet; `datagram` when it is sent
    /// over a datagram link.
    pub fn first(
        method: AuthMethod,
        encrypt: bool,
        datagram: bool,
        nonce_c: [u8; AUTH_LEN],
    ) -> AuthBlock {
        AuthBlock {
            method,
            encrypt,
            datagram,
            nonce_c,
            nonce_s: [0; AUTH_LEN],
            proof_c: [0; AUTH_LEN],
        }
    }

    fn encode(&self, w: &mut PayloadWriter) {
        w.u16(Self::LEN as u16);
        w.buf.push(self.method as u8);
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        w.buf
            .push(flag(self.encrypt, Self::ENCRYPT) | flag(self.datagram, Self::DATAGRAM));
        w.buf.extend_from_slice(&self.nonce_c);
        w.buf.extend_from_slice(&self.nonce_s);
        w.buf.extend_from_slice(&self.proof_c);
    }

    fn decode(b: &[u8]) -> Result<AuthBlock, PayloadError> {
        if b.len() != Self::LEN {
            return Err(PayloadError::Invalid(
                "the auth block must be 98 bytes (initiator too old for this target?)",
            ));
        }
        let method = match b[0] {
            0 => AuthMethod::None,
            1 => AuthMethod::Psk,
            _ => return Err(PayloadError::Invalid("unknown authentication method")),
        };
        if b[1] & !(Self::ENCRYPT | Self::DATAGRAM) != 0 {
            return Err(PayloadError::Invalid("unknown auth flags"));
        }
        let arr = |i: usize| -> [u8; AUTH_LEN] {
            b[2 + i * AUTH_LEN..2 + (i + 1) * AUTH_LEN]
                .try_into()
                .expect("length checked")
        };
        Ok(AuthBlock {
            method,
            encrypt: b[1] & Self::ENCRYPT != 0,
            datagram: b[1] & Self::DATAGRAM != 0,
            nonce_c: arr(0),
            nonce_s: arr(1),
            proof_c: arr(2),
        })
    }
}

impl Hello {
    /// The payload's wire form.
    pub fn encode(&self) -> Result<Vec<u8>, PayloadError> {
        let mut w = PayloadWriter::default();
        let features = match self.replaces {
            Some(_) => self.client_features | REPLACES,
            None => self.client_features & !REPLACES,
        };
        w.u16(self.queues)
            .u16(self.depth)
            .u32(self.max_io)
            .u64(features);
        w.u32(self.frame_payload).u64(self.nonce);
        w.str(&self.host_id)?.str(&self.export)?;
        self.auth.encode(&mut w);
        if let Some(r) = self.replaces {
            w.u32(r.session).u16(r.queue).u16(0).u64(r.cookie);
        }
        Ok(w.buf)
    }

    /// What the transcript hash `T` covers (§12.2): the payload with `proof_c` zeroed.
    pub fn transcript_bytes(&self) -> Result<Vec<u8>, PayloadError> {
        let mut h = self.clone();
        h.auth.proof_c = [0; AUTH_LEN];
        h.encode()
    }

    /// A query (§12.3) rather than a session: empty export name.
    pub fn is_query(&self) -> bool {
        self.export.is_empty()
    }

    /// Parses and range-checks a HELLO payload.
    pub fn decode(buf: &[u8]) -> Result<Hello, PayloadError> {
        let mut r = PayloadReader::new(buf);
        let mut h = Hello {
            queues: r.u16()?,
            depth: r.u16()?,
            max_io: r.u32()?,
            client_features: r.u64()?,
            frame_payload: r.u32()?,
            nonce: r.u64()?,
            host_id: r.str()?,
            export: r.str()?,
            auth: AuthBlock::decode(r.bytes16()?)?,
            replaces: None,
        };
        if h.client_features & REPLACES != 0 {
            // Carried by `replaces` from here on (`encode` sets it again).
            h.client_features &= !REPLACES;
            let (session, queue) = (r.u32()?, r.u16()?);
            if r.u16()? != 0 {
                return Err(PayloadError::Invalid(
                    "reserved bytes of REPLACES must be 0",
                ));
            }
            h.replaces = Some(QueueRef {
                session,
                queue,
                cookie: r.u64()?,
            });
        }
        r.finish()?;
        // §7: 1 to 255 bytes of printable ASCII without spaces. Anything else (an escape
        // sequence, say) would reach logs and operators' terminals as the host's name.
        if h.host_id.is_empty() || !h.host_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(PayloadError::Invalid(
                "the host id must be printable ASCII without spaces",
            ));
        }
        if h.replaces.is_some_and(|q| q.session == 0) {
            return Err(PayloadError::Invalid("REPLACES names session 0"));
        }
        if h.replaces.is_some() && h.is_query() {
            return Err(PayloadError::Invalid("a query replaces no session"));
        }
        if h.queues == 0 || h.depth == 0 {
            return Err(PayloadError::Invalid(
                "queue count and depth must be at least 1",
            ));
        }
        if h.max_io < 512 {
            return Err(PayloadError::Invalid("max I/O must be at least 512 bytes"));
        }
        Ok(h)
    }
}

/// HELLO reply (§7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloReply {
    /// Export size in bytes.
    pub size: u64,
    /// Logical block size: a power of two, at least 512.
    pub logical_block: u32,
    /// Physical block size: a power of two, at least `logical_block`.
    pub physical_block: u32,
    /// What the export does (§7).
    pub features: Features,
    /// Queues granted.
    pub queues: u16,
    /// Slots per queue granted.
    pub depth: u16,
    /// Largest I/O granted, in bytes.
    pub max_io: u32,
    /// Session id.
    pub session: u32,
    /// Proves a JOIN belongs to this session.
    pub cookie: u64,
    /// Payload bytes per fragment on datagrams; equal to `max_io` on TCP.
    pub frame_payload: u32,
    /// What one COPY of this session may do (§13); all zero: no COPY.
    pub copy: CopyLimits,
    /// What the session may do on the wire (`SESSION_HEADER_CRC`).
    pub session_flags: u16,
    /// The target's proof (§12.2); zeros when the session is not authenticated.
    pub target_proof: [u8; AUTH_LEN],
}

/// The COPY limits of a session (§13), granted in the HELLO reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyLimits {
    /// Most bytes one COPY moves in all; 0: the session has no COPY.
    pub max_bytes: u32,
    /// Most bytes of one source range.
    pub max_range: u32,
    /// Most source ranges in one COPY.
    pub max_ranges: u16,
}

impl CopyLimits {
    /// True when the session may send COPY at all.
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0 && self.max_range > 0 && self.max_ranges > 0
    }
}

impl HelloReply {
    /// Bytes of the encoded reply.
    pub const LEN: usize = 64 + AUTH_LEN;

    /// What `target_proof` covers: the encoded reply without it.
    pub fn proven_bytes(&self) -> Vec<u8> {
        let mut b = self.encode();
        b.truncate(Self::LEN - AUTH_LEN);
        b
    }

    /// The payload's wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = PayloadWriter::default();
        w.u64(self.size)
            .u32(self.logical_block)
            .u32(self.physical_block)
            .u64(self.features.0);
        w.u16(self.queues)
            .u16(self.depth)
            .u32(self.max_io)
            .u32(self.session)
            .u64(self.cookie);
        w.u32(self.frame_payload);
        w.u32(self.copy.max_bytes)
            .u32(self.copy.max_range)
            .u16(self.copy.max_ranges)
            .u16(self.session_flags)
            .u32(0);
        w.buf.extend_from_slice(&self.target_proof);
        w.buf
    }

    /// Parses and range-checks a HELLO reply.
    pub fn decode(buf: &[u8]) -> Result<HelloReply, PayloadError> {
        let mut r = PayloadReader::new(buf);
        let mut h = HelloReply {
            size: r.u64()?,
            logical_block: r.u32()?,
            physical_block: r.u32()?,
            features: Features(r.u64()?),
            queues: r.u16()?,
            depth: r.u16()?,
            max_io: r.u32()?,
            session: r.u32()?,
            cookie: r.u64()?,
            frame_payload: r.u32()?,
            copy: CopyLimits {
                max_bytes: r.u32()?,
                max_range: r.u32()?,
                max_ranges: r.u16()?,
            },
            session_flags: r.u16()?,
            target_proof: [0; AUTH_LEN],
        };
        if h.session_flags & !SESSION_HEADER_CRC != 0 || r.u32()? != 0 {
            return Err(PayloadError::Invalid(
                "reserved HELLO reply bytes must be 0",
            ));
        }
        h.target_proof = r.take(AUTH_LEN)?.try_into().expect("32 bytes");
        r.finish()?;
        let pow2 = |v: u32| v >= 512 && v.is_power_of_two();
        if !pow2(h.logical_block) || !pow2(h.physical_block) || h.physical_block < h.logical_block {
            return Err(PayloadError::Invalid(
                "block sizes must be powers of two >= 512",
            ));
        }
        if h.queues == 0 || h.depth == 0 || h.max_io < h.logical_block {
            return Err(PayloadError::Invalid(
                "granted queues, depth or max I/O out of range",
            ));
        }
        // Datagram frames may be larger than max_io: frame_payload is also the size frames are
        // packed into (§9.6). Either way it is bounded like any payload.
        if h.frame_payload < 512 || h.frame_payload > crate::MAX_PAYLOAD_LIMIT {
            return Err(PayloadError::Invalid("frame payload out of range"));
        }
        Ok(h)
    }
}

/// JOIN payload (§2.3, §12.1, §12.2): the session's cookie, in an authenticated session the
/// proof that the joiner holds the session's keys, and on datagrams the answer to the target's
/// challenge for this queue's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Join {
    /// The cookie from the HELLO reply.
    pub cookie: u64,
    /// The JOIN proof; zeros in a session without a key.
    pub proof: [u8; AUTH_LEN],
    /// Datagrams: the target's challenge nonce for this queue; zeros in the first JOIN and on TCP.
    pub nonce_s: [u8; AUTH_LEN],
}

impl Join {
    /// Bytes on the wire.
    pub const LEN: usize = 8 + 2 * AUTH_LEN;

    /// The payload's wire form.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.cookie.to_le_bytes());
        b[8..8 + AUTH_LEN].copy_from_slice(&self.proof);
        b[8 + AUTH_LEN..].copy_from_slice(&self.nonce_s);
        b
    }

    /// Parses a JOIN payload.
    pub fn decode(b: &[u8]) -> Result<Join, PayloadError> {
        let b: &[u8; Self::LEN] = b
            .try_into()
            .map_err(|_| PayloadError::Invalid("a JOIN payload is 72 bytes"))?;
        Ok(Join {
            cookie: u64::from_le_bytes(b[..8].try_into().expect("8")),
            proof: b[8..8 + AUTH_LEN].try_into().expect("32"),
            nonce_s: b[8 + AUTH_LEN..].try_into().expect("32"),
        })
    }

    /// What the target's challenge for this JOIN is bound to, besides the address: the
    /// session, the queue and the cookie.
    pub fn attempt(&self, session: u32, queue: u16) -> [u8; AUTH_LEN] {
        let mut n = [0u8; AUTH_LEN];
        n[..4].copy_from_slice(&session.to_le_bytes());
        n[4..6].copy_from_slice(&queue.to_le_bytes());
        n[6..14].copy_from_slice(&self.cookie.to_le_bytes());
        n
    }
}

/// One LIST entry (§7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportEntry {
    /// Export name.
    pub name: String,
    /// Export size in bytes.
    pub size: u64,
    /// What the export does (§7).
    pub features: Features,
}

impl ExportEntry {
    /// Bytes of a LIST payload before its entries: the u16 count.
    pub const LIST_HEADER_LEN: usize = 2;

    /// Bytes this entry takes in a LIST payload: its name (u8 length + bytes), size and
    /// features, as `encode_list` writes it.
    pub fn encoded_len(&self) -> usize {
        1 + self.name.len() + 8 + 8
    }

    /// A LIST reply payload (§7).
    pub fn encode_list(entries: &[ExportEntry]) -> Result<Vec<u8>, PayloadError> {
        let n =
            u16::try_from(entries.len()).map_err(|_| PayloadError::Invalid("too many exports"))?;
        let mut w = PayloadWriter::default();
        w.u16(n);
        for e in entries {
            w.str(&e.name)?.u64(e.size).u64(e.features.0);
        }
        Ok(w.buf)
    }

    /// Parses a LIST reply payload.
    pub fn decode_list(buf: &[u8]) -> Result<Vec<ExportEntry>, PayloadError> {
        let mut r = PayloadReader::new(buf);
        let n = r.u16()? as usize;
        // Each entry is at least 17 bytes, so the count cannot make us reserve more than the
        // payload could hold.
        let mut out = Vec::with_capacity(n.min(buf.len() / 17));
        for _ in 0..n {
            out.push(ExportEntry {
                name: r.str()?,
                size: r.u64()?,
                features: Features(r.u64()?),
            });
        }
        r.finish()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips() {
        let h = Hello {
            queues: 4,
            depth: 128,
            max_io: 1 << 20,
            client_features: 0,
            frame_payload: 0,
            nonce: 42,
            host_id: "host-a".into(),
            export: "disk0".into(),
            auth: AuthBlock {
                method: AuthMethod::Psk,
                encrypt: true,
                datagram: true,
                nonce_c: [1; 32],
                nonce_s: [2; 32],
                proof_c: [3; 32],
            },
            replaces: None,
        };
        assert_eq!(Hello::decode(&h.encode().unwrap()).unwrap(), h);
        // A host id is printable ASCII without spaces (§7): an escape sequence, a space or
        // nothing is refused.
        for bad in ["\x1b]0;x\x07", "a b", "", "caf\u{e9}"] {
            let odd = Hello {
                host_id: bad.into(),
                ..h.clone()
            };
            assert!(
                matches!(
                    Hello::decode(&odd.encode().unwrap()),
                    Err(PayloadError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
        // The queue it replaces travels after the auth block, and the transcript covers it.
        let mut re = h.clone();
        re.replaces = Some(QueueRef {
            session: 7,
            queue: 3,
            cookie: 0xfeed_f00d,
        });
        let enc = re.encode().unwrap();
        assert_eq!(enc.len(), h.encode().unwrap().len() + QueueRef::LEN);
        assert_eq!(Hello::decode(&enc).unwrap(), re);
        assert_ne!(
            re.transcript_bytes().unwrap(),
            h.transcript_bytes().unwrap()
        );
        let r = HelloReply {
            size: 4 << 30,
            logical_block: 512,
            physical_block: 4096,
            features: Features(Features::TRIM | Features::INIT_ZERO),
            queues: 2,
            depth: 64,
            max_io: 1 << 20,
            session: 9,
            cookie: 0x1234_5678_9abc_def0,
            frame_payload: 8704,
            copy: CopyLimits {
                max_bytes: 1 << 30,
                max_range: 1 << 28,
                max_ranges: 64,
            },
            session_flags: SESSION_HEADER_CRC,
            target_proof: [7; 32],
        };
        let enc = r.encode();
        assert_eq!(r.proven_bytes(), enc[..HelloReply::LEN - 32]);
        let mut t = h.clone();
        t.auth.proof_c = [0; 32];
        assert_eq!(h.transcript_bytes().unwrap(), t.encode().unwrap());
        let j = Join {
            cookie: 77,
            proof: [9; 32],
            nonce_s: [4; 32],
        };
        assert_eq!(Join::decode(&j.encode()).unwrap(), j);
        assert!(Join::decode(&[0; 8]).is_err());
        assert_eq!(enc.len(), HelloReply::LEN);
        assert_eq!(HelloReply::decode(&enc).unwrap(), r);
    }

    #[test]
    fn hello_rejects_bad_payloads() {
        let h = Hello {
            queues: 1,
            depth: 1,
            max_io: 4096,
            client_features: 0,
            frame_payload: 0,
            nonce: 42,
            host_id: "h".into(),
            export: "e".into(),
            auth: AuthBlock::first(AuthMethod::None, false, false, [0; 32]),
            replaces: None,
        };
        let enc = h.encode().unwrap();
        // REPLACES promised but its block missing, or with non-zero reserved bytes, or naming
        // session 0, or on a query.
        let mut bad = enc.clone();
        bad[8] |= REPLACES as u8;
        assert_eq!(Hello::decode(&bad), Err(PayloadError::Truncated));
        let with = |session: u32, reserved: u16, export: &str| {
            let mut x = h.clone();
            x.export = export.into();
            x.replaces = Some(QueueRef {
                session,
                queue: 0,
                cookie: 1,
            });
            let mut b = x.encode().unwrap();
            let n = b.len();
            b[n - 10..n - 8].copy_from_slice(&reserved.to_le_bytes());
            Hello::decode(&b)
        };
        assert!(with(5, 0, "e").is_ok());
        assert!(with(5, 1, "e").is_err());
        assert!(with(0, 0, "e").is_err());
        assert!(with(5, 0, "").is_err());
        for cut in 0..enc.len() {
            assert_eq!(
                Hello::decode(&enc[..cut]),
                Err(PayloadError::Truncated),
                "cut at {cut}"
            );
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert_eq!(Hello::decode(&extra), Err(PayloadError::TrailingBytes(1)));
        let mut zero_q = enc.clone();
        zero_q[0] = 0;
        assert!(matches!(
            Hello::decode(&zero_q),
            Err(PayloadError::Invalid(_))
        ));
        let mut short_auth = enc.clone();
        let at = enc.len() - AuthBlock::LEN - 2;
        short_auth[at] = 97;
        short_auth.pop();
        assert!(matches!(
            Hello::decode(&short_auth),
            Err(PayloadError::Invalid(_))
        ));
        let mut bad_method = enc.clone();
        bad_method[at + 2] = 9;
        assert!(matches!(
            Hello::decode(&bad_method),
            Err(PayloadError::Invalid(_))
        ));
        // The flags byte: bit 1 is DATAGRAM, bits from 2 up are unknown.
        let mut flags = enc.clone();
        flags[at + 3] = 2;
        assert!(Hello::decode(&flags).unwrap().auth.datagram);
        flags[at + 3] = 4;
        assert!(matches!(
            Hello::decode(&flags),
            Err(PayloadError::Invalid(_))
        ));
        let long = Hello {
            export: "x".repeat(256),
            ..h
        };
        assert_eq!(long.encode(), Err(PayloadError::StringTooLong(256)));
    }

    #[test]
    fn list_round_trips_and_bounds_count() {
        let l = vec![
            ExportEntry {
                name: "a".into(),
                size: 1,
                features: Features(1),
            },
            ExportEntry {
                name: "bb".into(),
                size: 2,
                features: Features(0),
            },
        ];
        let encoded = ExportEntry::encode_list(&l).unwrap();
        assert_eq!(ExportEntry::decode_list(&encoded).unwrap(), l);
        let lens: usize = l.iter().map(ExportEntry::encoded_len).sum();
        assert_eq!(encoded.len(), ExportEntry::LIST_HEADER_LEN + lens);
        // A count of 65535 with no entries behind it must fail without reserving for 65535.
        assert_eq!(
            ExportEntry::decode_list(&[0xff, 0xff]),
            Err(PayloadError::Truncated)
        );
    }

    #[test]
    fn feature_names() {
        assert_eq!(
            Features(Features::READ_ONLY | Features::TRIM).names(),
            vec!["read-only", "trim"]
        );
    }
}
