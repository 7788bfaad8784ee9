//! The 48-byte frame header (PROTOCOL.md §1, §3-§6).

use std::fmt;

/// `magic` field value (§1).
pub const MAGIC: u16 = 0xB10C;
/// Protocol version this crate speaks (§1).
pub const VERSION: u8 = 1;
/// Size of the fixed header in bytes (§1).
pub const HEADER_LEN: usize = 48;

/// Command codes (§3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Read `length` bytes at `offset`.
    Read = 0x01,
    /// Write the payload at `offset`.
    Write = 0x02,
    /// Make completed writes durable (§10).
    Flush = 0x03,
    /// Discard a range (advisory).
    Trim = 0x04,
    /// Make a range read back as zeros.
    WriteZeroes = 0x05,
    /// Reserved: multi-range copy (v1 targets answer `UNSUPPORTED`).
    Copy = 0x06,
    /// Open a session (§2, §7).
    Hello = 0x10,
    /// Attach another queue to a session.
    Join = 0x11,
    /// List the exports (§7, §9.5).
    List = 0x12,
    /// Prove the peer alive; keeps an idle datagram session (§9.1).
    Keepalive = 0x13,
    /// End a queue after its earlier requests.
    Logout = 0x14,
    /// Live counters as JSON (§11).
    Stats = 0x15,
}

impl Opcode {
    /// The opcode with wire value `v`; `None` for codes this version does not know.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            0x01 => Opcode::Read,
            0x02 => Opcode::Write,
            0x03 => Opcode::Flush,
            0x04 => Opcode::Trim,
            0x05 => Opcode::WriteZeroes,
            0x06 => Opcode::Copy,
            0x10 => Opcode::Hello,
            0x11 => Opcode::Join,
            0x12 => Opcode::List,
            0x13 => Opcode::Keepalive,
            0x14 => Opcode::Logout,
            0x15 => Opcode::Stats,
            _ => return None,
        })
    }

    /// Commands that change the export's contents and so are refused on read-only exports.
    pub fn modifies_data(self) -> bool {
        matches!(
            self,
            Opcode::Write | Opcode::Trim | Opcode::WriteZeroes | Opcode::Copy
        )
    }

    /// Commands whose `offset`/`length` address the export and must be range-checked.
    pub fn is_io(self) -> bool {
        matches!(
            self,
            Opcode::Read | Opcode::Write | Opcode::Flush | Opcode::Trim | Opcode::WriteZeroes
        )
    }
}

/// Frame flag bits (§4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags(pub u16);

impl Flags {
    /// The frame is a reply.
    pub const REPLY: u16 = 1 << 0;
    /// WRITE: durable before the reply (§10).
    pub const FUA: u16 = 1 << 1;
    /// `crc` is valid and must be checked.
    pub const CRC: u16 = 1 << 2;
    /// WRITE_ZEROES: allocate, do not punch a hole.
    pub const NO_HOLE: u16 = 1 << 3;
    /// Datagrams (§9.3): the payload is the bitmap of fragments the sender holds.
    pub const HAVE: u16 = 1 << 4;
    /// Datagrams of an authenticated session (§12.4): a seal follows the payload.
    pub const SEALED: u16 = 1 << 5;
    /// With `CRC`: the CRC covers the header only, the payload is covered by UDP's checksum
    /// (§9.7: WRITE and READ data of a UDP session that asked for it).
    pub const HEAD_CRC: u16 = 1 << 6;
    /// Every defined bit; a frame with any other is rejected.
    pub const KNOWN: u16 = Self::REPLY
        | Self::FUA
        | Self::CRC
        | Self::NO_HOLE
        | Self::HAVE
        | Self::SEALED
        | Self::HEAD_CRC;

    /// Is `bit` set?
    pub fn has(self, bit: u16) -> bool {
        self.0 & bit != 0
    }
}

/// Reply status (§5). Each maps to one errno so initiators can surface it unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// Write-class command on a read-only export.
    ReadOnly = 1,
    /// The backend failed (also every unknown status).
    Io = 2,
    /// Malformed request.
    Invalid = 3,
    /// `offset + length` beyond the export.
    OutOfRange = 4,
    /// The export cannot do this opcode.
    Unsupported = 5,
    /// HELLO names an unknown export.
    NoExport = 6,
    /// Protocol version not spoken.
    Version = 7,
    /// JOIN for a queue that is already connected; HELLO replacing a queue whose requests
    /// still run (§2.6).
    Busy = 8,
    /// Not allowed, bad cookie, or an unknown session (§9.1).
    Access = 9,
    /// The target is stopping.
    Shutdown = 10,
    /// The target is out of resources.
    NoMemory = 11,
    /// Not an error: the answer to a first HELLO, carrying the target's nonce (§12.1).
    Challenge = 12,
    /// A change inside the export found no space in the backend (its filesystem full, a quota,
    /// its largest file size).
    NoSpace = 13,
}

impl Status {
    /// Decodes a status; unknown codes become `Io` as §5 requires.
    pub fn from_u16(v: u16) -> Status {
        match v {
            0 => Status::Ok,
            1 => Status::ReadOnly,
            2 => Status::Io,
            3 => Status::Invalid,
            4 => Status::OutOfRange,
            5 => Status::Unsupported,
            6 => Status::NoExport,
            7 => Status::Version,
            8 => Status::Busy,
            9 => Status::Access,
            10 => Status::Shutdown,
            11 => Status::NoMemory,
            12 => Status::Challenge,
            13 => Status::NoSpace,
            _ => Status::Io,
        }
    }

    /// The errno an initiator reports for this status (0 for OK).
    pub fn errno(self) -> i32 {
        match self {
            Status::Ok => 0,
            Status::ReadOnly => libc_errno::EPERM,
            Status::Io => libc_errno::EIO,
            Status::Invalid => libc_errno::EINVAL,
            Status::OutOfRange => libc_errno::ENOSPC,
            Status::Unsupported => libc_errno::EOPNOTSUPP,
            Status::NoExport => libc_errno::ENOENT,
            Status::Version => libc_errno::EPROTONOSUPPORT,
            Status::Busy => libc_errno::EBUSY,
            Status::Access => libc_errno::EACCES,
            Status::Shutdown => libc_errno::ESHUTDOWN,
            Status::NoMemory => libc_errno::ENOMEM,
            // Only ever an answer to HELLO; anywhere else the peer broke the protocol.
            Status::Challenge => libc_errno::EPROTO,
            Status::NoSpace => libc_errno::ENOSPC,
        }
    }

    /// The status a backend error number is reported as.
    pub fn from_errno(errno: i32) -> Status {
        match errno {
            0 => Status::Ok,
            libc_errno::EPERM | libc_errno::EROFS => Status::ReadOnly,
            libc_errno::EINVAL => Status::Invalid,
            // Out of space in the backend's filesystem, its quota or its largest file: ENOSPC to
            // the initiator (an initiator's "stop on ENOSPC" policy then applies), and never
            // taken for a request beyond the export (OUT_OF_RANGE).
            libc_errno::ENOSPC | libc_errno::EDQUOT | libc_errno::EFBIG => Status::NoSpace,
            libc_errno::EOPNOTSUPP => Status::Unsupported,
            // A backend's ENOMEM (the kernel short of memory for shmem, a cgroup's charge) is
            // an I/O error: NO_MEMORY is the target's own word that it ran nothing and that
            // the initiator retries, which initiators do until their deadline.
            _ => Status::Io,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Status::Ok => "ok",
            Status::ReadOnly => "export is read-only",
            Status::Io => "I/O error on the target",
            Status::Invalid => "invalid request",
            Status::OutOfRange => "request beyond the end of the export",
            Status::NoSpace => "no space left on the target for the change",
            Status::Unsupported => "operation not supported by the export",
            Status::NoExport => "no such export",
            Status::Version => "protocol version not supported",
            Status::Busy => {
                "busy (the queue is connected, or the one replaced still has requests running)"
            }
            Status::Access => "access denied",
            Status::Shutdown => "target is shutting down",
            Status::NoMemory => "target out of resources (memory, or its session limit)",
            Status::Challenge => "challenge",
        };
        f.write_str(s)
    }
}

/// Linux errno values, spelled out so this crate stays free of libc.
mod libc_errno {
    pub const EPERM: i32 = 1;
    pub const ENOENT: i32 = 2;
    pub const EIO: i32 = 5;
    pub const ENOMEM: i32 = 12;
    pub const EACCES: i32 = 13;
    pub const EBUSY: i32 = 16;
    pub const EINVAL: i32 = 22;
    pub const EFBIG: i32 = 27;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const EPROTO: i32 = 71;
    pub const EPROTONOSUPPORT: i32 = 93;
    pub const EDQUOT: i32 = 122;
    pub const EOPNOTSUPP: i32 = 95;
    pub const ESHUTDOWN: i32 = 108;
}

/// A request tag: slot index and generation (§6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Tag(pub u32);

impl Tag {
    /// `slot | generation << 16` (§6).
    pub fn new(slot: u16, generation: u16) -> Tag {
        Tag(slot as u32 | (generation as u32) << 16)
    }
    /// Slot index: bits 0-15.
    pub fn slot(self) -> u16 {
        self.0 as u16
    }
    /// Generation of the slot's current use: bits 16-31.
    pub fn generation(self) -> u16 {
        (self.0 >> 16) as u16
    }
    /// RFC 1982 serial-number comparison on 16 bits: is `self`'s generation older than `other`?
    pub fn generation_older_than(self, other: u16) -> bool {
        let a = self.generation();
        a != other && other.wrapping_sub(a) < 0x8000
    }
}

/// Why a header was rejected (§1 validation rules). One variant per class of malformed input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Fewer than `HEADER_LEN` bytes.
    Short,
    /// `magic` is not `MAGIC`.
    BadMagic(u16),
    /// A protocol version other than `VERSION`.
    BadVersion(u8),
    /// An opcode this version does not define.
    UnknownOpcode(u8),
    /// Flag bits outside `Flags::KNOWN`.
    UnknownFlags(u16),
    /// `frag_count` 0 or `frag_index >= frag_count`.
    BadFragment {
        /// The frame's `frag_index`.
        index: u16,
        /// The frame's `frag_count`.
        count: u16,
    },
    /// `payload_len` above what the receiver accepts.
    PayloadTooLarge {
        /// The frame's `payload_len`.
        len: u32,
        /// The receiver's limit.
        max: u32,
    },
    /// Payload does not fit inside the message (`frag_offset + payload_len > length`).
    PayloadOutsideMessage,
    /// A request carried a non-zero status.
    StatusInRequest(u16),
    /// A header-only CRC (`HEAD_CRC`) where none may be: on a stream (§9.7).
    HeaderOnlyCrc,
    /// The CRC32C of header and payload is not the one the header carries.
    BadCrc {
        /// CRC the header carries.
        expected: u32,
        /// CRC of what arrived.
        actual: u32,
    },
    /// Datagrams (§9.6): fewer payload bytes than `payload_len` left in the datagram.
    Truncated,
    /// Datagrams (§9): a frame without the mandatory CRC.
    MissingCrc,
    /// Datagrams (§9.6): a frame for another session or queue than the datagram's first.
    MixedQueues,
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Short => write!(f, "frame shorter than the {HEADER_LEN}-byte header"),
            FrameError::BadMagic(m) => write!(f, "bad magic {m:#06x} (not a blkwire peer?)"),
            FrameError::BadVersion(v) => write!(f, "protocol version {v} not supported"),
            FrameError::UnknownOpcode(o) => write!(f, "unknown opcode {o:#04x}"),
            FrameError::UnknownFlags(x) => write!(f, "unknown flag bits {x:#06x}"),
            FrameError::BadFragment { index, count } => {
                write!(f, "bad fragment {index} of {count}")
            }
            FrameError::PayloadTooLarge { len, max } => {
                write!(f, "payload of {len} bytes exceeds the limit of {max}")
            }
            FrameError::PayloadOutsideMessage => write!(f, "payload lies outside the message"),
            FrameError::StatusInRequest(s) => write!(f, "request carries status {s}"),
            FrameError::HeaderOnlyCrc => {
                write!(
                    f,
                    "header-only CRC (HEAD_CRC) on a stream: it is for UDP only"
                )
            }
            FrameError::BadCrc { expected, actual } => {
                write!(
                    f,
                    "CRC32C mismatch: header says {expected:#010x}, data has {actual:#010x}"
                )
            }
            FrameError::Truncated => write!(f, "payload cut short by the end of the datagram"),
            FrameError::MissingCrc => write!(f, "datagram frame without a CRC32C"),
            FrameError::MixedQueues => {
                write!(f, "frame for another session or queue inside one datagram")
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// A decoded frame header (§1). Plain data; `encode`/`decode` are the only ways in and out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What is asked (§3).
    pub opcode: Opcode,
    /// §4.
    pub flags: Flags,
    /// 0 in requests; the outcome in replies (§5).
    pub status: Status,
    /// Queue index inside the session.
    pub queue: u16,
    /// Index of this fragment (§9.3).
    pub frag_index: u16,
    /// Fragments of the message; 1 when unfragmented.
    pub frag_count: u16,
    /// Replies: frames the target grants this queue (§8, §9.4).
    pub credit: u16,
    /// Slot and generation (§6).
    pub tag: Tag,
    /// Bytes of the I/O.
    pub length: u32,
    /// Byte offset of the I/O in the export.
    pub offset: u64,
    /// Bytes of payload following this header in this frame.
    pub payload_len: u32,
    /// Offset of this frame's payload inside the message's data.
    pub frag_offset: u32,
    /// CRC32C of header and payload when flag `CRC` is set, else 0.
    pub crc: u32,
    /// Session id; 0 before HELLO and on TCP queues.
    pub session: u32,
}

impl Header {
    /// A request header for one unfragmented message.
    pub fn request(opcode: Opcode, tag: Tag, offset: u64, length: u32) -> Header {
        Header {
            opcode,
            flags: Flags::default(),
            status: Status::Ok,
            queue: 0,
            frag_index: 0,
            frag_count: 1,
            credit: 0,
            tag,
            length,
            offset,
            payload_len: 0,
            frag_offset: 0,
            crc: 0,
            session: 0,
        }
    }

    /// The reply to `self`: same opcode, tag, queue, offset and length, with `REPLY` set (§3).
    pub fn reply(&self, status: Status, payload_len: u32) -> Header {
        Header {
            flags: Flags(Flags::REPLY),
            status,
            payload_len,
            frag_index: 0,
            frag_count: 1,
            frag_offset: 0,
            crc: 0,
            ..*self
        }
    }

    /// Does flag `REPLY` mark this as a reply?
    pub fn is_reply(&self) -> bool {
        self.flags.has(Flags::REPLY)
    }

    /// Writes the header's wire form into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        out[3] = self.opcode as u8;
        out[4..6].copy_from_slice(&self.flags.0.to_le_bytes());
        out[6..8].copy_from_slice(&(self.status as u16).to_le_bytes());
        out[8..10].copy_from_slice(&self.queue.to_le_bytes());
        out[10..12].copy_from_slice(&self.frag_index.to_le_bytes());
        out[12..14].copy_from_slice(&self.frag_count.to_le_bytes());
        out[14..16].copy_from_slice(&self.credit.to_le_bytes());
        out[16..20].copy_from_slice(&self.tag.0.to_le_bytes());
        out[20..24].copy_from_slice(&self.length.to_le_bytes());
        out[24..32].copy_from_slice(&self.offset.to_le_bytes());
        out[32..36].copy_from_slice(&self.payload_len.to_le_bytes());
        out[36..40].copy_from_slice(&self.frag_offset.to_le_bytes());
        out[40..44].copy_from_slice(&self.crc.to_le_bytes());
        out[44..48].copy_from_slice(&self.session.to_le_bytes());
    }

    /// The header's wire form.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.encode(&mut b);
        b
    }

    /// Decodes and validates a header (§1). `max_payload` is the receiver's own limit: no frame
    /// claiming more is accepted, so a hostile length never turns into an allocation.
    /// The CRC, if flagged, is checked separately with [`Header::check_crc`] once the payload is in.
    pub fn decode(buf: &[u8], max_payload: u32) -> Result<Header, FrameError> {
        let b: &[u8; HEADER_LEN] = buf
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(FrameError::Short)?;
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u16_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[2] != VERSION {
            return Err(FrameError::BadVersion(b[2]));
        }
        let opcode = Opcode::from_u8(b[3]).ok_or(FrameError::UnknownOpcode(b[3]))?;
        let flags = Flags(u16_at(4));
        if flags.0 & !Flags::KNOWN != 0 {
            return Err(FrameError::UnknownFlags(flags.0 & !Flags::KNOWN));
        }
        // A header-only CRC is a kind of CRC: meaningless without one.
        if flags.has(Flags::HEAD_CRC) && !flags.has(Flags::CRC) {
            return Err(FrameError::MissingCrc);
        }
        let raw_status = u16_at(6);
        if !flags.has(Flags::REPLY) && raw_status != 0 {
            return Err(FrameError::StatusInRequest(raw_status));
        }
        let frag_index = u16_at(10);
        let frag_count = u16_at(12);
        if frag_count == 0 || frag_index >= frag_count {
            return Err(FrameError::BadFragment {
                index: frag_index,
                count: frag_count,
            });
        }
        let length = u32_at(20);
        let payload_len = u32_at(32);
        if payload_len > max_payload {
            return Err(FrameError::PayloadTooLarge {
                len: payload_len,
                max: max_payload,
            });
        }
        let frag_offset = u32_at(36);
        // Fragment data must lie inside the message; a HAVE bitmap is not message data.
        let carries_data =
            matches!(opcode, Opcode::Read | Opcode::Write) && !flags.has(Flags::HAVE);
        if carries_data && frag_offset as u64 + payload_len as u64 > length as u64 {
            return Err(FrameError::PayloadOutsideMessage);
        }
        Ok(Header {
            opcode,
            flags,
            status: Status::from_u16(raw_status),
            queue: u16_at(8),
            frag_index,
            frag_count,
            credit: u16_at(14),
            tag: Tag(u32_at(16)),
            length,
            offset: u64::from_le_bytes(b[24..32].try_into().expect("8 bytes")),
            payload_len,
            frag_offset,
            crc: u32_at(40),
            session: u32_at(44),
        })
    }

    /// CRC32C of an encoded header (with its `crc` field taken as 0) followed by the payload (§1).
    pub fn compute_crc(header_bytes: &[u8; HEADER_LEN], payload: &[u8]) -> u32 {
        Self::crc_by(header_bytes, payload, 0)
    }

    /// `compute_crc`, fetching up to `next` bytes past the payload's end ahead of time
    /// (`crc::crc32c_append_streaming`).
    fn crc_by(header_bytes: &[u8; HEADER_LEN], payload: &[u8], next: usize) -> u32 {
        let mut h = *header_bytes;
        h[40..44].fill(0);
        crate::crc::crc32c_append_streaming(crate::crc::crc32c(&h), payload, next)
    }

    /// What this header's CRC covers of `payload`: all of it, or none with `HEAD_CRC` (§9.7).
    fn covered<'p>(&self, payload: &'p [u8]) -> &'p [u8] {
        if self.flags.has(Flags::HEAD_CRC) {
            &[]
        } else {
            payload
        }
    }

    /// Sets `crc` and the `CRC` flag for this header and payload (the header alone if the
    /// header already carries `HEAD_CRC`).
    pub fn seal_crc(&mut self, payload: &[u8]) {
        self.seal_crc_streaming(payload, 0)
    }

    /// `seal_crc` for a payload followed in memory by `next` bytes that are sealed next (the
    /// rest of a large READ or WRITE whose fragments are sent from where the data lies): the
    /// same CRC, computed with `crc::crc32c_append_streaming`, which asks for that memory ahead
    /// of time.
    pub fn seal_crc_streaming(&mut self, payload: &[u8], next: usize) {
        self.flags.0 |= Flags::CRC;
        self.crc = 0;
        self.crc = Self::crc_by(&self.to_bytes(), self.covered(payload), next);
    }

    /// Marks this header sealed (§12.4): flag `SEALED`, no CRC (the seal covers the frame).
    pub fn mark_sealed(&mut self) {
        self.flags.0 = (self.flags.0 | Flags::SEALED) & !(Flags::CRC | Flags::HEAD_CRC);
        self.crc = 0;
    }

    /// Checks a stream frame's CRC (TCP, where it is optional): as `check_crc`, and a
    /// header-only CRC is refused (§9.7: it is for UDP data frames only).
    pub fn check_stream_crc(&self, received: &[u8], payload: &[u8]) -> Result<(), FrameError> {
        if self.flags.has(Flags::HEAD_CRC) {
            return Err(FrameError::HeaderOnlyCrc);
        }
        self.check_crc(received, payload)
    }

    /// Checks the CRC if the `CRC` flag is set; frames without it pass. `received` starts with
    /// the header's bytes as they arrived, which the CRC covers: not this header encoded again,
    /// which says IO for a status it does not know (§5), where the sender put its own code.
    pub fn check_crc(&self, received: &[u8], payload: &[u8]) -> Result<(), FrameError> {
        if !self.flags.has(Flags::CRC) {
            return Ok(());
        }
        let header = received
            .first_chunk::<HEADER_LEN>()
            .ok_or(FrameError::Truncated)?;
        let actual = Self::compute_crc(header, self.covered(payload));
        if actual == self.crc {
            Ok(())
        } else {
            Err(FrameError::BadCrc {
                expected: self.crc,
                actual,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        let mut h = Header::request(Opcode::Write, Tag::new(7, 0xfffe), 1 << 40, 8192);
        h.flags = Flags(Flags::FUA);
        h.queue = 3;
        h.payload_len = 4096;
        h.frag_offset = 4096;
        h.frag_index = 1;
        h.frag_count = 2;
        h.session = 0xdead_beef;
        h
    }

    #[test]
    fn header_round_trips() {
        let h = sample();
        let b = h.to_bytes();
        assert_eq!(Header::decode(&b, 1 << 20).unwrap(), h);
        let r = h.reply(Status::OutOfRange, 0);
        assert_eq!(Header::decode(&r.to_bytes(), 0).unwrap(), r);
        assert!(r.is_reply());
        assert_eq!(r.tag, h.tag);
    }

    #[test]
    fn every_opcode_round_trips() {
        for v in 0..=255u8 {
            if let Some(op) = Opcode::from_u8(v) {
                assert_eq!(op as u8, v);
                let h = Header::request(op, Tag::new(1, 1), 0, 0);
                assert_eq!(Header::decode(&h.to_bytes(), 0).unwrap().opcode, op);
            }
        }
    }

    #[test]
    fn statuses_round_trip_and_map_to_errno() {
        for v in 0..=13u16 {
            let s = Status::from_u16(v);
            assert_eq!(s as u16, v);
            assert_eq!(s == Status::Ok, s.errno() == 0);
        }
        assert_eq!(Status::from_u16(999), Status::Io);
        assert_eq!(
            Status::from_errno(Status::ReadOnly.errno()),
            Status::ReadOnly
        );
        assert_eq!(Status::from_errno(5), Status::Io);
        assert_eq!(
            Status::from_errno(12),
            Status::Io,
            "a backend's ENOMEM is no retry"
        );
        // Out of space in any form (full, quota, largest file) is NO_SPACE, ENOSPC to the
        // initiator.
        for errno in [28, 122, 27] {
            assert_eq!(Status::from_errno(errno), Status::NoSpace, "errno {errno}");
        }
        assert_eq!(Status::NoSpace.errno(), 28);
    }

    fn corrupt(f: impl FnOnce(&mut [u8; HEADER_LEN])) -> Result<Header, FrameError> {
        let mut b = sample().to_bytes();
        f(&mut b);
        Header::decode(&b, 1 << 20)
    }

    #[test]
    fn malformed_headers_are_rejected_by_class() {
        assert_eq!(Header::decode(&[0u8; 47], 0), Err(FrameError::Short));
        assert_eq!(corrupt(|b| b[0] = 0), Err(FrameError::BadMagic(0xB100)));
        assert_eq!(corrupt(|b| b[2] = 2), Err(FrameError::BadVersion(2)));
        assert_eq!(
            corrupt(|b| b[3] = 0x7f),
            Err(FrameError::UnknownOpcode(0x7f))
        );
        assert_eq!(
            corrupt(|b| b[5] = 0x80),
            Err(FrameError::UnknownFlags(0x8000))
        );
        assert_eq!(corrupt(|b| b[6] = 1), Err(FrameError::StatusInRequest(1)));
        assert_eq!(
            corrupt(|b| b[12..14].copy_from_slice(&0u16.to_le_bytes())),
            Err(FrameError::BadFragment { index: 1, count: 0 })
        );
        assert_eq!(
            corrupt(|b| b[10..12].copy_from_slice(&2u16.to_le_bytes())),
            Err(FrameError::BadFragment { index: 2, count: 2 })
        );
        assert_eq!(
            corrupt(|b| b[32..36].copy_from_slice(&u32::MAX.to_le_bytes())),
            Err(FrameError::PayloadTooLarge {
                len: u32::MAX,
                max: 1 << 20
            })
        );
        assert_eq!(
            corrupt(|b| b[36..40].copy_from_slice(&8000u32.to_le_bytes())),
            Err(FrameError::PayloadOutsideMessage)
        );
    }

    #[test]
    fn crc_detects_corruption() {
        let payload = vec![0xa5u8; 4096];
        let mut h = sample();
        h.seal_crc(&payload);
        let wire = h.to_bytes();
        let d = Header::decode(&wire, 1 << 20).unwrap();
        assert_eq!(d.check_crc(&wire, &payload), Ok(()));
        let mut bad = payload.clone();
        bad[100] ^= 1;
        assert!(matches!(
            d.check_crc(&wire, &bad),
            Err(FrameError::BadCrc { .. })
        ));
        let mut flipped = h.to_bytes();
        flipped[24] ^= 1; // offset changed in flight
        let d2 = Header::decode(&flipped, 1 << 20).unwrap();
        assert!(d2.check_crc(&flipped, &payload).is_err());
    }

    /// A status this receiver does not know reads as IO (§5), but the CRC is over the code the
    /// sender put there: the frame still passes, and its status is an error.
    #[test]
    fn a_frame_with_an_unknown_status_passes_its_crc() {
        let payload = vec![0x3cu8; 512];
        let mut h = sample();
        h.flags.0 |= Flags::REPLY;
        let mut wire = h.to_bytes();
        wire[6..8].copy_from_slice(&999u16.to_le_bytes());
        let crc = Header::compute_crc(&wire, &payload);
        wire[4..6].copy_from_slice(&(h.flags.0 | Flags::CRC).to_le_bytes());
        let crc_flagged = Header::compute_crc(&wire, &payload);
        wire[40..44].copy_from_slice(&crc_flagged.to_le_bytes());
        let d = Header::decode(&wire, 1 << 20).unwrap();
        assert_eq!(d.status, Status::Io);
        assert_eq!(d.check_crc(&wire, &payload), Ok(()));
        assert_ne!(crc, crc_flagged, "the flags are covered too");
    }

    #[test]
    fn a_streaming_seal_is_the_same_crc() {
        let payload: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
        for head_only in [false, true] {
            let mut a = sample();
            if head_only {
                a.flags.0 |= Flags::HEAD_CRC;
            }
            let mut b = a;
            a.seal_crc(&payload);
            b.seal_crc_streaming(&payload, 1 << 20);
            assert_eq!(a.to_bytes(), b.to_bytes(), "header-only {head_only}");
            assert_eq!(b.check_crc(&b.to_bytes(), &payload), Ok(()));
        }
    }

    /// §9.7: with `HEAD_CRC` the CRC covers the header alone (the header, flag included, is
    /// still protected: clearing the flag or changing the offset is caught), and the flag means
    /// nothing without `CRC`.
    #[test]
    fn a_header_only_crc_covers_the_header_and_nothing_else() {
        let payload = vec![0xa5u8; 4096];
        let mut h = sample();
        h.flags.0 |= Flags::HEAD_CRC;
        h.seal_crc(&payload);
        let wire = h.to_bytes();
        let d = Header::decode(&wire, 1 << 20).unwrap();
        assert_eq!(d.check_crc(&wire, &payload), Ok(()));
        assert_eq!(
            d.check_crc(&wire, &[0x5a; 4096]),
            Ok(()),
            "the payload is not covered"
        );
        for (at, bit) in [(24, 1u8), (4, Flags::HEAD_CRC as u8)] {
            let mut b = h.to_bytes();
            b[at] ^= bit;
            let d2 = Header::decode(&b, 1 << 20).unwrap();
            assert!(
                d2.check_crc(&b, &payload).is_err(),
                "byte {at} changed, CRC held"
            );
        }
        assert_eq!(
            d.check_stream_crc(&wire, &payload),
            Err(FrameError::HeaderOnlyCrc)
        );
        let mut no_crc = h.to_bytes();
        no_crc[4] &= !(Flags::CRC as u8);
        assert_eq!(
            Header::decode(&no_crc, 1 << 20),
            Err(FrameError::MissingCrc)
        );
    }

    #[test]
    fn generations_compare_as_serial_numbers() {
        let t = Tag::new(0, 10);
        assert!(t.generation_older_than(11));
        assert!(!t.generation_older_than(10));
        assert!(!t.generation_older_than(9));
        assert!(Tag::new(0, 0xffff).generation_older_than(2)); // wrapped
        assert!(!Tag::new(0, 2).generation_older_than(0xffff));
    }

    /// §6: `tag = slot | (generation << 16)`, so a slot and a generation never bleed into each
    /// other, even at their extremes.
    #[test]
    fn tags_pack_slot_low_and_generation_high() {
        assert_eq!(Tag::new(0x1234, 0xabcd).0, 0xabcd_1234);
        for (slot, generation) in [(0, 0), (0xffff, 0), (0, 0xffff), (0xffff, 0xffff), (7, 1)] {
            let t = Tag::new(slot, generation);
            assert_eq!((t.slot(), t.generation()), (slot, generation));
        }
        // Reading a tag off the wire: the halves are taken as they are.
        assert_eq!(Tag(0x0001_fffe).slot(), 0xfffe);
        assert_eq!(Tag(0x0001_fffe).generation(), 1);
    }

    /// §6: a slot's generation is incremented (mod 2^16) on each reuse, and every earlier one
    /// within half the space is older: the step from 0xffff to 0 is a step forward.
    #[test]
    fn each_reuse_of_a_slot_is_newer_across_the_wrap() {
        let mut g: u16 = 0xfff0;
        for _ in 0..64 {
            let next = g.wrapping_add(1);
            assert!(Tag::new(3, g).generation_older_than(next), "{g:#x}");
            assert!(!Tag::new(3, next).generation_older_than(g), "{next:#x}");
            g = next;
        }
        assert!(Tag::new(0, 0xfff0).generation_older_than(0x002f));
    }

    /// RFC 1982 on 16 bits: "older" reaches back less than half the space (0x7fff generations);
    /// at exactly half the comparison is undefined and neither is older, so a request that far
    /// behind is never taken for a stale one by accident of direction.
    #[test]
    fn older_reaches_back_less_than_half_the_generation_space() {
        for base in [0u16, 0x1234, 0x8000, 0xffff] {
            let t = Tag::new(0, base);
            assert!(t.generation_older_than(base.wrapping_add(0x7fff)));
            assert!(!t.generation_older_than(base.wrapping_add(0x8000)));
            assert!(!Tag::new(0, base.wrapping_add(0x8000)).generation_older_than(base));
            assert!(!t.generation_older_than(base.wrapping_add(0x8001)));
            assert!(Tag::new(0, base.wrapping_add(0x8001)).generation_older_than(base));
        }
    }
}
