//! iSCSI PDUs (RFC 7143): the 48-byte Basic Header Segment, additional header segments, the
//! data segment with its padding, the CRC32C header and data digests (§11.1–11.2, §13.1), the
//! opcodes a target receives and sends (§11.3–11.17), and the `key=value` text of Login and
//! Text PDUs (§6.1). No I/O and no allocation on the decode path, like the rest of the crate:
//! a receiver asks [`pdu_len`] about the front of its buffer (it looks at the BHS only and
//! checks the data segment against the caller's bound), then [`decode`] checks the digests and
//! hands out the header, AHS and data as slices of the buffer.
//!
//! Integers are big-endian. Digests are CRC32C, sent least significant byte first (RFC 7143
//! §13.1 and Appendix B: the CRC's bytes in the order the polynomial arithmetic produces them,
//! which is little-endian for the reflected CRC32C).

use std::fmt;

use crate::crc::{crc32c, crc32c_append};

/// blkwire's target names are this prefix and an export's name (RFC 7143 §4.2.7.2 iqn format,
/// the same date and reversed domain as the NVMe NQN prefix).
pub const BLKWIRE_IQN_PREFIX: &str = "iqn.2026-11.io.blkwire:";
/// The IANA-registered iscsi-target port.
pub const DEFAULT_PORT: u16 = 3260;
/// Bytes of the Basic Header Segment.
pub const BHS_LEN: usize = 48;
/// Bytes of a header or data digest.
pub const DIGEST_LEN: usize = 4;
/// The reserved tag value (ITT of a NOP-In ping, TTT "none", §11.18–11.19).
pub const RESERVED_TAG: u32 = 0xffff_ffff;
/// Longest key name (§6.1: "a maximum of 63 bytes").
pub const MAX_KEY_LEN: usize = 63;
/// Longest value accepted in text: §6.1 bounds most values to 255 bytes, but CHAP challenges
/// and responses (§12.1.3) are binary values whose hex text is longer (up to 1024 bytes of
/// binary, §6.1's large binary values); 8192 bytes cover them.
pub const MAX_VALUE_LEN: usize = 8192;
/// Most `key=value` pairs one text may hold.
pub const MAX_PAIRS: usize = 256;

/// Opcodes (§11.2.1.2): initiator ones are 0x00–0x1f, target ones 0x20–0x3f.
pub mod op {
    /// NOP-Out (§11.18).
    pub const NOP_OUT: u8 = 0x00;
    /// SCSI Command (§11.3).
    pub const SCSI_CMD: u8 = 0x01;
    /// SCSI Task Management Function Request (§11.5).
    pub const TMF_REQ: u8 = 0x02;
    /// Login Request (§11.12).
    pub const LOGIN_REQ: u8 = 0x03;
    /// Text Request (§11.10).
    pub const TEXT_REQ: u8 = 0x04;
    /// SCSI Data-Out (§11.7).
    pub const DATA_OUT: u8 = 0x05;
    /// Logout Request (§11.14).
    pub const LOGOUT_REQ: u8 = 0x06;
    /// SNACK Request (§11.16).
    pub const SNACK: u8 = 0x10;
    /// NOP-In (§11.19).
    pub const NOP_IN: u8 = 0x20;
    /// SCSI Response (§11.4).
    pub const SCSI_RSP: u8 = 0x21;
    /// SCSI Task Management Function Response (§11.6).
    pub const TMF_RSP: u8 = 0x22;
    /// Login Response (§11.13).
    pub const LOGIN_RSP: u8 = 0x23;
    /// Text Response (§11.11).
    pub const TEXT_RSP: u8 = 0x24;
    /// SCSI Data-In (§11.7).
    pub const DATA_IN: u8 = 0x25;
    /// Logout Response (§11.15).
    pub const LOGOUT_RSP: u8 = 0x26;
    /// Ready To Transfer (§11.8).
    pub const R2T: u8 = 0x31;
    /// Asynchronous Message (§11.9).
    pub const ASYNC: u8 = 0x32;
    /// Reject (§11.17).
    pub const REJECT: u8 = 0x3f;
}

/// Flag bits of byte 1.
pub mod flag {
    /// F: final PDU of a sequence (every opcode that has it).
    pub const FINAL: u8 = 0x80;
    /// SCSI Command R: data from the initiator (a write).
    pub const READ: u8 = 0x40;
    /// SCSI Command W.
    pub const WRITE: u8 = 0x20;
    /// Login/Text C: the text continues in the next PDU.
    pub const CONTINUE: u8 = 0x40;
    /// Login T: transit to the next stage.
    pub const TRANSIT: u8 = 0x80;
    /// Data-In / SCSI Response o: residual overflow (Data-In bit 2, Response bit 2).
    pub const OVERFLOW: u8 = 0x04;
    /// u: residual underflow.
    pub const UNDERFLOW: u8 = 0x02;
    /// Data-In S: status is in this PDU.
    pub const STATUS: u8 = 0x01;
    /// Data-In A: acknowledge (ERL > 0 only).
    pub const ACK: u8 = 0x40;
}

/// Byte 0 bit 6: the PDU is for immediate delivery (§11.2.1.1).
pub const IMMEDIATE: u8 = 0x40;

/// Reasons a Reject carries (§11.17.1).
pub mod reject {
    /// Data (payload) digest error.
    pub const DATA_DIGEST: u8 = 0x02;
    /// Protocol error (a PDU the state does not allow).
    pub const PROTOCOL_ERROR: u8 = 0x04;
    /// Command not supported.
    pub const NOT_SUPPORTED: u8 = 0x05;
    /// Immediate command rejected: too many immediate commands.
    pub const IMMEDIATE: u8 = 0x06;
    /// Invalid PDU field.
    pub const INVALID_FIELD: u8 = 0x09;
    /// Waiting for Logout.
    pub const WAITING_FOR_LOGOUT: u8 = 0x0b;
}

/// How the PDUs of a connection are framed: which digests were negotiated (§13.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    /// CRC32C after the header (BHS + AHS).
    pub header: bool,
    /// CRC32C after a non-empty data segment (its padding included).
    pub data: bool,
}

/// Why a PDU cannot be taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PduError {
    /// The data segment is longer than the receiver declared (MaxRecvDataSegmentLength).
    DataTooLong {
        /// DataSegmentLength received.
        len: u32,
        /// The most allowed.
        max: u32,
    },
    /// The header digest does not match.
    HeaderDigest,
    /// The data digest does not match.
    DataDigest,
    /// An opcode the other side sends, or none at all.
    BadOpcode(u8),
}

impl fmt::Display for PduError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PduError::DataTooLong { len, max } => {
                write!(
                    f,
                    "data segment of {len} bytes, more than the {max} allowed"
                )
            }
            PduError::HeaderDigest => f.write_str("header digest mismatch"),
            PduError::DataDigest => f.write_str("data digest mismatch"),
            PduError::BadOpcode(o) => write!(f, "opcode {o:#04x} is not an initiator opcode"),
        }
    }
}

impl std::error::Error for PduError {}

/// How far the buffer holds the first PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// At least this many bytes from the front are needed.
    Need(usize),
    /// The PDU takes this many bytes.
    Complete(usize),
}

/// Padding after a data segment of `len` bytes (§11.2.3: to a multiple of 4).
pub fn pad(len: usize) -> usize {
    (4 - len % 4) % 4
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The layout of a PDU whose BHS is at the front of `buf`: (header bytes incl. AHS, data
/// segment length).
fn layout(bhs: &[u8]) -> (usize, usize) {
    let ahs = bhs[4] as usize * 4;
    let dlen = (bhs[5] as usize) << 16 | (bhs[6] as usize) << 8 | bhs[7] as usize;
    (BHS_LEN + ahs, dlen)
}

/// How long the PDU at the front of `buf` is, from its BHS alone. A data segment longer than
/// `max_data` is an error (the receiver's MaxRecvDataSegmentLength, §13.12), so a peer never
/// makes the receiver hold more.
pub fn pdu_len(buf: &[u8], d: &Digests, max_data: u32) -> Result<Progress, PduError> {
    if buf.len() < BHS_LEN {
        return Ok(Progress::Need(BHS_LEN));
    }
    let (hlen, dlen) = layout(buf);
    if dlen as u64 > max_data as u64 {
        return Err(PduError::DataTooLong {
            len: dlen as u32,
            max: max_data,
        });
    }
    let mut total = hlen + if d.header { DIGEST_LEN } else { 0 };
    if dlen > 0 {
        total += dlen + pad(dlen) + if d.data { DIGEST_LEN } else { 0 };
    }
    Ok(if buf.len() >= total {
        Progress::Complete(total)
    } else {
        Progress::Need(total)
    })
}

/// A decoded PDU: slices of the receive buffer.
#[derive(Clone, Copy, Debug)]
pub struct Pdu<'a> {
    /// The Basic Header Segment.
    pub bhs: &'a [u8; BHS_LEN],
    /// Additional header segments (extended CDB, §11.3.5), possibly empty.
    pub ahs: &'a [u8],
    /// The data segment without its padding.
    pub data: &'a [u8],
    /// Bytes after the data (padding and data digest).
    pub trailer: usize,
}

/// Decodes the whole PDU `buf` (as long as [`pdu_len`] said), checking its digests.
pub fn decode<'a>(buf: &'a [u8], d: &Digests) -> Result<Pdu<'a>, PduError> {
    let (hlen, dlen) = layout(buf);
    let bhs: &[u8; BHS_LEN] = buf[..BHS_LEN].try_into().expect("checked by pdu_len");
    let mut at = hlen;
    if d.header {
        let want = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        if crc32c(&buf[..hlen]) != want {
            return Err(PduError::HeaderDigest);
        }
        at += DIGEST_LEN;
    }
    let data = &buf[at..at + dlen];
    let mut trailer = 0;
    if dlen > 0 {
        let padded = dlen + pad(dlen);
        trailer = pad(dlen);
        if d.data {
            let got = crc32c(&buf[at..at + padded]);
            let want = u32::from_le_bytes(buf[at + padded..at + padded + 4].try_into().expect("4"));
            if got != want {
                return Err(PduError::DataDigest);
            }
            trailer += DIGEST_LEN;
        }
    }
    Ok(Pdu {
        bhs,
        ahs: &buf[BHS_LEN..hlen],
        data,
        trailer,
    })
}

/// The data digest of a data segment (its zero padding included, §13.1).
pub fn data_digest(data: &[u8]) -> u32 {
    crc32c_append(crc32c(data), &[0u8; 3][..pad(data.len())])
}

impl Pdu<'_> {
    /// Opcode (byte 0, without the I bit).
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }
    /// The I (immediate) bit.
    pub fn immediate(&self) -> bool {
        self.bhs[0] & IMMEDIATE != 0
    }
    /// Byte 1 (F and opcode-specific flags).
    pub fn flags(&self) -> u8 {
        self.bhs[1]
    }
    /// The LUN field (bytes 8–15).
    pub fn lun(&self) -> u64 {
        u64::from_be_bytes(self.bhs[8..16].try_into().expect("8 bytes"))
    }
    /// Initiator Task Tag (bytes 16–19).
    pub fn itt(&self) -> u32 {
        be32(self.bhs, 16)
    }
    /// Bytes 20–23: EDTL (SCSI Command), TTT (Data-Out, NOP-Out, Text), RTT (TMF).
    pub fn word20(&self) -> u32 {
        be32(self.bhs, 20)
    }
    /// Bytes 24–27: CmdSN (initiator PDUs; Data-Out: reserved).
    pub fn cmdsn(&self) -> u32 {
        be32(self.bhs, 24)
    }
    /// Bytes 28–31: ExpStatSN.
    pub fn expstatsn(&self) -> u32 {
        be32(self.bhs, 28)
    }
    /// A big-endian word at `at` (32–44: opcode specific).
    pub fn word(&self, at: usize) -> u32 {
        be32(self.bhs, at)
    }
}

/// A SCSI Command's fields (§11.3).
#[derive(Clone, Copy, Debug)]
pub struct ScsiCommand<'a> {
    /// F: no unsolicited Data-Out follows.
    pub final_: bool,
    /// R / W.
    pub read: bool,
    /// W.
    pub write: bool,
    /// ATTR (bits 0–2 of byte 1): 0 untagged, 1 simple, 2 ordered, 3 head of queue, 4 ACA.
    pub attr: u8,
    /// LUN.
    pub lun: u64,
    /// ITT.
    pub itt: u32,
    /// Expected Data Transfer Length.
    pub edtl: u32,
    /// CmdSN.
    pub cmdsn: u32,
    /// The CDB: the BHS's 16 bytes, then the extended CDB AHS (type 1) if any.
    pub cdb: [u8; 16],
    /// The extended CDB bytes beyond 16 (from the AHS), possibly empty.
    pub ext_cdb: &'a [u8],
    /// Immediate data.
    pub data: &'a [u8],
}

/// Reads a SCSI Command PDU. An AHS other than one extended CDB (type 1, §11.3.5) or a
/// bidirectional expected length AHS (type 2) is ignored apart from its bounds.
pub fn scsi_command<'a>(p: &Pdu<'a>) -> ScsiCommand<'a> {
    let f = p.flags();
    let mut ext_cdb: &[u8] = &[];
    let mut ahs = p.ahs;
    while ahs.len() >= 4 {
        // AHSLength counts the bytes after AHSType (the specific byte included); each AHS is
        // padded to 4 bytes (§11.2.2). An extended CDB's specific byte is reserved (§11.3.5).
        let len = u16::from_be_bytes([ahs[0], ahs[1]]) as usize;
        let end = 3 + len;
        if end > ahs.len() {
            break;
        }
        if ahs[2] == 1 && len > 1 {
            ext_cdb = &ahs[4..end];
        }
        let skip = end + pad(end);
        if skip >= ahs.len() {
            break;
        }
        ahs = &ahs[skip..];
    }
    ScsiCommand {
        final_: f & flag::FINAL != 0,
        read: f & flag::READ != 0,
        write: f & flag::WRITE != 0,
        attr: f & 7,
        lun: p.lun(),
        itt: p.itt(),
        edtl: p.word20(),
        cmdsn: p.cmdsn(),
        cdb: p.bhs[32..48].try_into().expect("16 bytes"),
        ext_cdb,
        data: p.data,
    }
}

/// A Login Request's fields (§11.12).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoginRequest {
    /// T: the initiator wants to move to `nsg`.
    pub transit: bool,
    /// C: the text continues in the next PDU.
    pub cont: bool,
    /// Current stage: 0 security, 1 operational, 3 full feature.
    pub csg: u8,
    /// Next stage.
    pub nsg: u8,
    /// Version-max and version-min (0 is the only version).
    pub version: (u8, u8),
    /// ISID (6 bytes).
    pub isid: [u8; 6],
    /// TSIH: 0 for a new session.
    pub tsih: u16,
    /// ITT.
    pub itt: u32,
    /// CID.
    pub cid: u16,
    /// CmdSN.
    pub cmdsn: u32,
    /// ExpStatSN.
    pub expstatsn: u32,
}

/// Reads a Login Request.
pub fn login_request(p: &Pdu<'_>) -> LoginRequest {
    let b = p.bhs;
    LoginRequest {
        transit: b[1] & flag::TRANSIT != 0,
        cont: b[1] & flag::CONTINUE != 0,
        csg: (b[1] >> 2) & 3,
        nsg: b[1] & 3,
        version: (b[2], b[3]),
        isid: b[8..14].try_into().expect("6 bytes"),
        tsih: u16::from_be_bytes([b[14], b[15]]),
        itt: p.itt(),
        cid: u16::from_be_bytes([b[20], b[21]]),
        cmdsn: p.cmdsn(),
        expstatsn: p.expstatsn(),
    }
}

/// Builds target PDUs: a zeroed BHS with the opcode, to which fields are set, then encoded
/// with its data segment.
#[derive(Clone, Copy, Debug)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl Bhs {
    /// A BHS for `opcode` with byte 1 = `flags`.
    pub fn new(opcode: u8, flags: u8) -> Bhs {
        let mut b = [0u8; BHS_LEN];
        b[0] = opcode;
        b[1] = flags;
        Bhs(b)
    }
    /// Sets a big-endian word at `at`.
    pub fn set32(&mut self, at: usize, v: u32) -> &mut Bhs {
        self.0[at..at + 4].copy_from_slice(&v.to_be_bytes());
        self
    }
    /// Sets the LUN field.
    pub fn lun(&mut self, lun: u64) -> &mut Bhs {
        self.0[8..16].copy_from_slice(&lun.to_be_bytes());
        self
    }
    /// Sets the ITT.
    pub fn itt(&mut self, itt: u32) -> &mut Bhs {
        self.set32(16, itt)
    }
    /// Sets StatSN, ExpCmdSN, MaxCmdSN (bytes 24–35, the target PDUs' common triple).
    pub fn sn(&mut self, statsn: u32, expcmdsn: u32, maxcmdsn: u32) -> &mut Bhs {
        self.set32(24, statsn)
            .set32(28, expcmdsn)
            .set32(32, maxcmdsn)
    }
    /// Appends the PDU with `data` as its data segment.
    pub fn encode(&self, data: &[u8], d: &Digests, out: &mut Vec<u8>) {
        self.encode_prefix(data.len(), d, out);
        out.extend_from_slice(data);
        encode_suffix(data, d, out);
    }
    /// Appends the header of a PDU whose data segment is `data_len` bytes (the data, its
    /// padding and digest follow: [`encode_suffix`]).
    pub fn encode_prefix(&self, data_len: usize, d: &Digests, out: &mut Vec<u8>) {
        let mut b = self.0;
        b[4] = 0;
        let l = (data_len as u32).to_be_bytes();
        b[5..8].copy_from_slice(&l[1..4]);
        out.extend_from_slice(&b);
        if d.header {
            out.extend_from_slice(&crc32c(&b).to_le_bytes());
        }
    }
    /// Bytes [`Bhs::encode_prefix`] writes.
    pub fn prefix_len(d: &Digests) -> usize {
        BHS_LEN + if d.header { DIGEST_LEN } else { 0 }
    }
}

/// Appends the padding and data digest that follow `data`.
pub fn encode_suffix(data: &[u8], d: &Digests, out: &mut Vec<u8>) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(&[0u8; 3][..pad(data.len())]);
    if d.data {
        out.extend_from_slice(&data_digest(data).to_le_bytes());
    }
}

/// Bytes [`encode_suffix`] writes after `data_len` bytes of data.
pub fn suffix_len(data_len: usize, d: &Digests) -> usize {
    if data_len == 0 {
        0
    } else {
        pad(data_len) + if d.data { DIGEST_LEN } else { 0 }
    }
}

/// Fills a suffix of [`suffix_len`] bytes in place.
pub fn fill_suffix(data: &[u8], d: &Digests, suffix: &mut [u8]) {
    let p = pad(data.len());
    suffix[..p].fill(0);
    if d.data && !data.is_empty() {
        suffix[p..p + 4].copy_from_slice(&data_digest(data).to_le_bytes());
    }
}

/// Why login or text key=value data is malformed (§6.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextError {
    /// A pair without '='.
    NoEquals,
    /// A key name that is empty, longer than [`MAX_KEY_LEN`] or not of the allowed characters.
    BadKey,
    /// A value longer than [`MAX_VALUE_LEN`] or not UTF-8.
    BadValue,
    /// More than [`MAX_PAIRS`] pairs.
    TooMany,
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TextError::NoEquals => "a text pair without '='",
            TextError::BadKey => "a malformed key name",
            TextError::BadValue => "a malformed or too long value",
            TextError::TooMany => "too many key=value pairs",
        })
    }
}

impl std::error::Error for TextError {}

/// Iterates over the `key=value` pairs of text data (§6.1: each pair ends with a NUL; a
/// trailing pair without its NUL is taken too, and empty pairs between NULs are skipped).
/// Keys are checked: 1 to 63 bytes of letters, digits, '.', '-', '+', '@', '_' (§6.1).
pub fn pairs(text: &[u8]) -> impl Iterator<Item = Result<(&str, &str), TextError>> {
    let mut n = 0usize;
    text.split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(move |p| {
            n += 1;
            if n > MAX_PAIRS {
                return Err(TextError::TooMany);
            }
            let eq = p
                .iter()
                .position(|b| *b == b'=')
                .ok_or(TextError::NoEquals)?;
            let (k, v) = (&p[..eq], &p[eq + 1..]);
            let key_ok = !k.is_empty()
                && k.len() <= MAX_KEY_LEN
                && k.iter()
                    .all(|b| b.is_ascii_alphanumeric() || b".-+@_".contains(b));
            if !key_ok {
                return Err(TextError::BadKey);
            }
            if v.len() > MAX_VALUE_LEN {
                return Err(TextError::BadValue);
            }
            let k = std::str::from_utf8(k).map_err(|_| TextError::BadKey)?;
            let v = std::str::from_utf8(v).map_err(|_| TextError::BadValue)?;
            Ok((k, v))
        })
}

/// Appends `key=value` and its NUL.
pub fn push_pair(out: &mut Vec<u8>, key: &str, value: &str) {
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value.as_bytes());
    out.push(0);
}

/// Parses a numerical value (§6.1: decimal or `0x` hex; base64 numbers are not taken).
pub fn number(v: &str) -> Option<u64> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        if h.is_empty() || h.len() > 16 {
            return None;
        }
        return u64::from_str_radix(h, 16).ok();
    }
    if v.is_empty() || v.len() > 20 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// Decodes a binary value (§6.1: `0x` hex or `0b` base64), as CHAP_C and CHAP_R are sent.
pub fn binary(v: &str) -> Option<Vec<u8>> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        // An odd count of digits has an implied leading zero.
        let odd = h.len() % 2;
        let mut out = Vec::with_capacity(h.len() / 2 + 1);
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let b = h.as_bytes();
        if b.is_empty() {
            return None;
        }
        if odd == 1 {
            out.push(digit(b[0])?);
        }
        for pair in b[odd..].chunks(2) {
            out.push(digit(pair[0])? << 4 | digit(pair[1])?);
        }
        return Some(out);
    }
    let b64 = v.strip_prefix("0b").or_else(|| v.strip_prefix("0B"))?;
    base64(b64)
}

fn base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let s = s.trim_end_matches('=').as_bytes();
    if s.is_empty() || s.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

/// Encodes bytes as a hex binary value (`0x...`).
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + bytes.len() * 2);
    s.push_str("0x");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pdu(opcode: u8, data: &[u8], d: &Digests) -> Vec<u8> {
        let mut out = Vec::new();
        let mut b = Bhs::new(opcode, flag::FINAL);
        b.itt(0x1234).set32(20, 512);
        b.encode(data, d, &mut out);
        out
    }

    #[test]
    fn lengths_padding_and_digests_round_trip() {
        for d in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
        ] {
            for n in [0usize, 1, 3, 4, 5, 513] {
                let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
                let buf = pdu(op::SCSI_CMD, &data, &d);
                assert_eq!(buf.len() % 4, 0);
                assert_eq!(
                    pdu_len(&buf[..10], &d, 1 << 20),
                    Ok(Progress::Need(BHS_LEN))
                );
                assert_eq!(
                    pdu_len(&buf, &d, 1 << 20),
                    Ok(Progress::Complete(buf.len()))
                );
                assert_eq!(
                    pdu_len(&buf[..buf.len() - 1], &d, 1 << 20),
                    Ok(Progress::Need(buf.len()))
                );
                let p = decode(&buf, &d).unwrap();
                assert_eq!(p.data, &data[..]);
                assert_eq!(
                    (p.opcode(), p.itt(), p.word20()),
                    (op::SCSI_CMD, 0x1234, 512)
                );
                assert_eq!(
                    BHS_LEN + if d.header { 4 } else { 0 } + n + p.trailer,
                    buf.len()
                );
            }
        }
    }

    #[test]
    fn a_bad_digest_or_an_oversized_segment_is_refused() {
        let d = Digests {
            header: true,
            data: true,
        };
        let mut buf = pdu(op::SCSI_CMD, b"hello", &d);
        assert!(matches!(
            pdu_len(&buf, &d, 4),
            Err(PduError::DataTooLong { len: 5, max: 4 })
        ));
        let last = buf.len() - 1;
        buf[last] ^= 1;
        assert_eq!(decode(&buf, &d).unwrap_err(), PduError::DataDigest);
        buf[20] ^= 1;
        assert_eq!(decode(&buf, &d).unwrap_err(), PduError::HeaderDigest);
    }

    /// RFC 7143 Appendix B.4: CRC32C of 32 bytes of zeros is 0x8a9136aa, sent as aa 36 91 8a.
    #[test]
    fn digest_byte_order_is_the_rfc_example() {
        let zeros = [0u8; 32];
        assert_eq!(crc32c(&zeros).to_le_bytes(), [0xaa, 0x36, 0x91, 0x8a]);
        assert_eq!(data_digest(&zeros), 0x8a9136aa);
    }

    #[test]
    fn text_pairs_are_bounded_and_checked() {
        let t = b"InitiatorName=iqn.x:y\0SessionType=Normal\0\0AuthMethod=CHAP,None";
        let v: Vec<_> = pairs(t).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            v,
            vec![
                ("InitiatorName", "iqn.x:y"),
                ("SessionType", "Normal"),
                ("AuthMethod", "CHAP,None")
            ]
        );
        assert_eq!(pairs(b"novalue\0").next(), Some(Err(TextError::NoEquals)));
        assert_eq!(pairs(b"=x\0").next(), Some(Err(TextError::BadKey)));
        let long = format!("K={}", "v".repeat(MAX_VALUE_LEN + 1));
        assert_eq!(
            pairs(long.as_bytes()).next(),
            Some(Err(TextError::BadValue))
        );
        let many = "a=b\0".repeat(MAX_PAIRS + 1);
        assert!(pairs(many.as_bytes()).any(|p| p == Err(TextError::TooMany)));
    }

    #[test]
    fn numbers_and_binary_values() {
        assert_eq!(number("262144"), Some(262144));
        assert_eq!(number("0x10"), Some(16));
        assert_eq!(number("-1"), None);
        assert_eq!(number(""), None);
        assert_eq!(binary("0x0a0B"), Some(vec![0x0a, 0x0b]));
        assert_eq!(binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(binary("0xzz"), None);
        assert_eq!(binary("12"), None);
        assert_eq!(hex(&[0, 255]), "0x00ff");
    }

    #[test]
    fn scsi_command_fields_and_extended_cdb() {
        let mut b = Bhs::new(op::SCSI_CMD, flag::FINAL | flag::WRITE | 1);
        b.lun(1 << 48).itt(7).set32(20, 4096).set32(24, 9);
        b.0[32] = 0x2a;
        // One extended-CDB AHS of 4 bytes beyond the BHS's 16 (AHSLength 5: reserved + 4).
        let mut buf = Vec::new();
        b.encode_prefix(0, &Digests::default(), &mut buf);
        buf[4] = 3;
        buf.extend_from_slice(&[0, 5, 1, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        let p = decode(&buf, &Digests::default()).unwrap();
        let c = scsi_command(&p);
        assert!(c.final_ && c.write && !c.read);
        assert_eq!(
            (c.attr, c.lun, c.itt, c.edtl, c.cmdsn),
            (1, 1 << 48, 7, 4096, 9)
        );
        assert_eq!(c.cdb[0], 0x2a);
        assert_eq!(c.ext_cdb, &[1, 2, 3, 4]);
    }
}
