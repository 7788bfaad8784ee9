//! NVMe/TCP PDUs (NVM Express TCP Transport Specification 1.0a, §3.6): the 8-byte common
//! header, the nine PDU types, the 64-byte submission and 16-byte completion queue entries they
//! carry, and the CRC32C header and data digests. Groundwork for an NVMe/TCP frontend (issue 16;
//! how it maps onto `StreamFrontend` is in docs/ARCHITECTURE.md).
//!
//! Like the rest of the crate: no I/O, and nothing a peer sends turns into an allocation. A
//! receiver first asks [`pdu_len`] about the front of its buffer; that looks at the common header
//! only and answers [`Progress::Need`] or [`Progress::Complete`] once every length in it has been
//! checked against the PDU type, the negotiated digests and alignment, and the caller's bound
//! ([`Params::max_plen`]). [`decode`] then checks the digests and the PDU-specific header and
//! hands out the data as a slice of the buffer. Every integer is little-endian.
//!
//! Decoding is strict: reserved bits and bytes must be zero, padding must be zero and as short as
//! the alignment allows, and a digest is present exactly when it was negotiated and the PDU type
//! carries one. So a PDU that decodes encodes again to the same bytes (the fuzz target
//! `fuzz/fuzz_targets/nvme_tcp.rs` checks that), and a receiver never has to guess where data
//! starts.

use std::fmt;

use crate::crc::crc32c;

/// blkwire's subsystem NQNs are this prefix and an export's name (the target's NVMe/TCP
/// frontend names its subsystems so; its initiator turns an export name into the NQN).
pub const BLKWIRE_NQN_PREFIX: &str = "nqn.2026-11.io.blkwire:";
/// Bytes of the common header every PDU starts with.
pub const CH_LEN: usize = 8;
/// Bytes of a header or data digest (CRC32C, little-endian).
pub const DIGEST_LEN: usize = 4;
/// HLEN and PLEN of ICReq and ICResp: both are exactly 128 bytes, never with digests.
pub const IC_LEN: usize = 128;
/// HLEN of H2CTermReq and C2HTermReq.
pub const TERM_HLEN: usize = 24;
/// Most bytes of the offending PDU header a TermReq carries after its own header.
pub const TERM_MAX_DATA: usize = 128;
/// Largest PLEN of a TermReq (its header and `TERM_MAX_DATA`).
pub const TERM_MAX_PLEN: usize = TERM_HLEN + TERM_MAX_DATA;
/// HLEN of CapsuleCmd: the common header and one submission queue entry.
pub const CMD_HLEN: usize = CH_LEN + SQE_LEN;
/// HLEN of CapsuleResp: the common header and one completion queue entry.
pub const RSP_HLEN: usize = CH_LEN + CQE_LEN;
/// HLEN of H2CData and C2HData.
pub const DATA_HLEN: usize = 24;
/// HLEN of R2T.
pub const R2T_HLEN: usize = 24;
/// Bytes of an NVMe submission queue entry (a command).
pub const SQE_LEN: usize = 64;
/// Bytes of an NVMe completion queue entry.
pub const CQE_LEN: usize = 16;
/// The only PDU format version there is (PFV 1.0).
pub const PFV_1_0: u16 = 0;
/// Largest HPDA/CPDA: alignment is (PDA + 1) dwords, so at most 128 bytes.
pub const MAX_PDA: u8 = 31;

/// Common header flags (byte 1). Which ones a PDU type may carry is fixed by the type.
pub mod flags {
    /// HDGSTF: a header digest follows the PDU header.
    pub const HDGSTF: u8 = 1 << 0;
    /// DDGSTF: a data digest follows the PDU data.
    pub const DDGSTF: u8 = 1 << 1;
    /// LAST_PDU: the last data PDU of a transfer (H2CData, C2HData).
    pub const LAST_PDU: u8 = 1 << 2;
    /// SUCCESS: the command completed with success and no CapsuleResp follows (C2HData,
    /// only with LAST_PDU).
    pub const SUCCESS: u8 = 1 << 3;
}

/// Fatal error status values of a TermReq (FES).
pub mod fes {
    /// A header field is invalid; FEI is the byte offset of the field in the PDU.
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    /// A PDU arrived where the protocol does not allow it.
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    /// A header digest did not match.
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    /// Data outside what the command transfers (or what an R2T asked for).
    pub const DATA_TRANSFER_OUT_OF_RANGE: u16 = 0x04;
    /// More data in one H2CData than MAXH2CDATA, or more R2Ts than MAXR2T.
    pub const DATA_TRANSFER_LIMIT_EXCEEDED: u16 = 0x05;
    /// A parameter (ICReq/ICResp field) the receiver does not support.
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// Who sends a PDU. A receiver accepts only the PDU types of the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host to controller: what a target receives.
    HostToController,
    /// Controller to host: what an initiator receives.
    ControllerToHost,
}

/// PDU types (common header byte 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    /// Initialize Connection Request (host).
    IcReq = 0x00,
    /// Initialize Connection Response (controller).
    IcResp = 0x01,
    /// Host to Controller Terminate Connection Request.
    H2CTermReq = 0x02,
    /// Controller to Host Terminate Connection Request.
    C2HTermReq = 0x03,
    /// Command capsule: an SQE and possibly in-capsule data (host).
    CapsuleCmd = 0x04,
    /// Response capsule: a CQE (controller).
    CapsuleResp = 0x05,
    /// Host to Controller Data: write data the controller asked for with an R2T.
    H2CData = 0x06,
    /// Controller to Host Data: read data.
    C2HData = 0x07,
    /// Ready to Transfer: the controller asks for write data (controller).
    R2T = 0x09,
}

/// Where a PDU type's data is, if it has any.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DataRule {
    /// No data: PDO 0, PLEN = HLEN (+ header digest).
    None,
    /// In-capsule data when PDO is not 0 (CapsuleCmd).
    Optional,
    /// At least one byte of data (H2CData, C2HData).
    Required,
    /// TermReq: up to 128 bytes after the header, never digests, PDO 0.
    Term,
}

impl PduType {
    /// The type for a type byte, if it names one.
    pub fn from_u8(b: u8) -> Option<PduType> {
        Some(match b {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// The HLEN the specification fixes for this type (a PDU with any other is refused).
    pub fn hlen(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_LEN,
            PduType::H2CTermReq | PduType::C2HTermReq => TERM_HLEN,
            PduType::CapsuleCmd => CMD_HLEN,
            PduType::CapsuleResp => RSP_HLEN,
            PduType::H2CData | PduType::C2HData => DATA_HLEN,
            PduType::R2T => R2T_HLEN,
        }
    }

    /// Which side sends this type.
    pub fn direction(self) -> Direction {
        match self {
            PduType::IcReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData => {
                Direction::HostToController
            }
            _ => Direction::ControllerToHost,
        }
    }

    /// Whether this type carries a header digest once one is negotiated. The connection setup
    /// PDUs never do (they come before the negotiation), and neither do the TermReqs (a peer
    /// that is giving up may no longer agree on what was negotiated).
    pub fn takes_header_digest(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }

    /// The common header flags this type may carry.
    fn allowed_flags(self) -> u8 {
        use flags::*;
        match self {
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq => 0,
            PduType::CapsuleCmd => HDGSTF | DDGSTF,
            PduType::CapsuleResp | PduType::R2T => HDGSTF,
            PduType::H2CData => HDGSTF | DDGSTF | LAST_PDU,
            PduType::C2HData => HDGSTF | DDGSTF | LAST_PDU | SUCCESS,
        }
    }

    fn data_rule(self) -> DataRule {
        match self {
            PduType::IcReq | PduType::IcResp | PduType::CapsuleResp | PduType::R2T => {
                DataRule::None
            }
            PduType::H2CTermReq | PduType::C2HTermReq => DataRule::Term,
            PduType::CapsuleCmd => DataRule::Optional,
            PduType::H2CData | PduType::C2HData => DataRule::Required,
        }
    }
}

/// What one direction of a connection negotiated, and how much a receiver accepts. The receiver
/// decodes with the same values its peer encodes with: after ICReq/ICResp, a target decodes
/// host PDUs with its own CPDA and encodes its PDUs with the host's HPDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// The direction of the PDUs these parameters are for.
    pub direction: Direction,
    /// Header digests negotiated (ICReq and ICResp both ask for HDGST_ENABLE).
    pub hdgst: bool,
    /// Data digests negotiated (both ask for DDGST_ENABLE).
    pub ddgst: bool,
    /// The receiver's PDU data alignment, 0's based in dwords (CPDA for what a controller
    /// receives, HPDA for what a host receives): PDU data starts at a multiple of
    /// `(pda + 1) * 4` bytes. Values above `MAX_PDA` count as `MAX_PDA`.
    pub pda: u8,
    /// Largest PLEN the receiver accepts. Anything longer is refused from its common header, so
    /// a peer cannot make a receiver wait for (or allocate) more. At least `IC_LEN`, or the
    /// connection cannot start; see [`Params::max_plen_for_data`].
    pub max_plen: u32,
}

impl Params {
    /// The parameters before ICReq/ICResp: no digests, dword alignment.
    pub fn initial(direction: Direction, max_plen: u32) -> Params {
        Params {
            direction,
            hdgst: false,
            ddgst: false,
            pda: 0,
            max_plen,
        }
    }

    /// Bytes PDU data is aligned to from the start of the PDU.
    pub fn alignment(&self) -> usize {
        (self.pda.min(MAX_PDA) as usize + 1) * 4
    }

    /// The PLEN bound for PDUs carrying up to `max_data` bytes of data each (a target: the
    /// larger of its in-capsule data size and MAXH2CDATA), with these digests and alignment;
    /// never below what ICReq/ICResp and TermReq need.
    pub fn max_plen_for_data(&self, max_data: u32) -> u32 {
        let dd = if self.ddgst { DIGEST_LEN } else { 0 };
        let longest =
            data_offset(CMD_HLEN, self.hdgst, self.pda) as u64 + max_data as u64 + dd as u64;
        longest.max(TERM_MAX_PLEN as u64).min(u32::MAX as u64) as u32
    }
}

/// Where the data of a PDU whose header is `hlen` bytes starts: after the header, its digest if
/// `hdgst`, and the least padding that reaches a multiple of the alignment `pda` asks for.
pub fn data_offset(hlen: usize, hdgst: bool, pda: u8) -> usize {
    let align = (pda.min(MAX_PDA) as usize + 1) * 4;
    let end = hlen + if hdgst { DIGEST_LEN } else { 0 };
    end.div_ceil(align) * align
}

/// CRC32C of a PDU header (common header and PDU-specific header), as carried in HDGST.
pub fn header_digest(header: &[u8]) -> u32 {
    crc32c(header)
}

/// CRC32C of PDU data (without padding), as carried in DDGST.
pub fn data_digest(data: &[u8]) -> u32 {
    crc32c(data)
}

/// The common header, as on the wire and unchecked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    /// PDU type byte ([`PduType`]).
    pub typ: u8,
    /// Flags ([`flags`]).
    pub flags: u8,
    /// HLEN: bytes of the PDU header, common header included, digest excluded.
    pub hlen: u8,
    /// PDO: offset of the PDU data from the start of the PDU (0 without data).
    pub pdo: u8,
    /// PLEN: bytes of the whole PDU (header, digests, padding, data).
    pub plen: u32,
}

impl CommonHeader {
    /// Reads the first `CH_LEN` bytes, checking nothing.
    pub fn parse(b: &[u8; CH_LEN]) -> CommonHeader {
        CommonHeader {
            typ: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        }
    }

    /// The header as sent.
    pub fn to_bytes(&self) -> [u8; CH_LEN] {
        let p = self.plen.to_le_bytes();
        [
            self.typ, self.flags, self.hlen, self.pdo, p[0], p[1], p[2], p[3],
        ]
    }
}

/// Why a PDU was refused. [`PduError::term_status`] gives what a C2HTermReq/H2CTermReq says
/// about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PduError {
    /// A type byte that names no PDU type.
    UnknownType(u8),
    /// A PDU type the other side sends (a controller sending CapsuleCmd, say).
    WrongDirection(PduType),
    /// HLEN other than the one the type fixes.
    BadHlen {
        /// The PDU type.
        typ: PduType,
        /// HLEN received.
        hlen: u8,
        /// HLEN the type has.
        expected: u8,
    },
    /// Flags the type does not define, reserved flag bits, or SUCCESS without LAST_PDU.
    BadFlags {
        /// The PDU type.
        typ: PduType,
        /// The flags byte.
        flags: u8,
    },
    /// HDGSTF set without a negotiated header digest, or clear with one.
    HeaderDigestFlag {
        /// The PDU type.
        typ: PduType,
        /// Whether the flag should have been set.
        expected: bool,
    },
    /// DDGSTF set without a negotiated data digest or on a PDU without data, or clear on a
    /// PDU with data when data digests were negotiated.
    DataDigestFlag {
        /// The PDU type.
        typ: PduType,
        /// Whether the flag should have been set.
        expected: bool,
    },
    /// PDO other than the one the header, its digest and the alignment give (0 without data).
    BadPdo {
        /// The PDU type.
        typ: PduType,
        /// PDO received.
        pdo: u8,
        /// PDO expected.
        expected: u8,
    },
    /// PLEN that does not fit the type's header, PDO and digests (or a data PDU without data,
    /// or a TermReq outside 24..=152 bytes).
    BadPlen {
        /// The PDU type.
        typ: PduType,
        /// PLEN received.
        plen: u32,
    },
    /// PLEN above the receiver's bound.
    TooLong {
        /// The PDU type.
        typ: PduType,
        /// PLEN received.
        plen: u32,
        /// The bound ([`Params::max_plen`]).
        max: u32,
    },
    /// [`decode`] was given fewer bytes than the PDU's PLEN.
    Short,
    /// The header digest does not match the header.
    HeaderDigest {
        /// CRC32C of the header as received.
        computed: u32,
        /// The digest that came with it.
        received: u32,
    },
    /// The data digest does not match the data.
    DataDigest {
        /// CRC32C of the data as received.
        computed: u32,
        /// The digest that came with it.
        received: u32,
    },
    /// A reserved byte, reserved bits, or a padding byte that is not zero.
    Reserved {
        /// The PDU type.
        typ: PduType,
        /// Byte offset in the PDU.
        offset: usize,
    },
    /// A field outside the values the specification allows (HPDA/CPDA above 31, a MAXH2CDATA
    /// that is 0 or no multiple of 4).
    InvalidField {
        /// The PDU type.
        typ: PduType,
        /// Byte offset of the field in the PDU.
        offset: usize,
    },
    /// DATAL other than the data the PDU carries.
    BadDataLength {
        /// The PDU type.
        typ: PduType,
        /// DATAL received.
        datal: u32,
        /// Bytes of data between PDO and PLEN (less the data digest).
        expected: u32,
    },
}

impl PduError {
    /// The FES and FEI of the TermReq a receiver sends before closing over this error, or
    /// `None` when the specification has no fatal error status for it (a data digest error,
    /// which NVMe/TCP reports against the command; a short buffer, which is the caller's).
    pub fn term_status(&self) -> Option<(u16, u32)> {
        use PduError::*;
        let field = |offset: usize| Some((fes::INVALID_HEADER_FIELD, offset as u32));
        match self {
            // A type the receiver never takes is a bad type field (as SPDK reports it); a
            // sequence error is a valid type at the wrong time, which only the frontend knows.
            UnknownType(_) | WrongDirection(_) => field(0),
            BadHlen { .. } => field(2),
            BadFlags { .. } | HeaderDigestFlag { .. } | DataDigestFlag { .. } => field(1),
            BadPdo { .. } => field(3),
            BadPlen { .. } => field(4),
            TooLong {
                typ: PduType::H2CData,
                ..
            } => Some((fes::DATA_TRANSFER_LIMIT_EXCEEDED, 0)),
            TooLong { .. } => field(4),
            HeaderDigest { .. } => Some((fes::HEADER_DIGEST_ERROR, 0)),
            Reserved { offset, .. } | InvalidField { offset, .. } => field(*offset),
            BadDataLength { .. } => field(16),
            Short | DataDigest { .. } => None,
        }
    }
}

impl fmt::Display for PduError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use PduError::*;
        match self {
            UnknownType(t) => write!(f, "unknown NVMe/TCP PDU type {t:#04x}"),
            WrongDirection(t) => write!(f, "{t:?} PDU sent by the wrong side"),
            BadHlen {
                typ,
                hlen,
                expected,
            } => {
                write!(f, "{typ:?} PDU with HLEN {hlen} (must be {expected})")
            }
            BadFlags { typ, flags } => write!(f, "{typ:?} PDU with invalid flags {flags:#04x}"),
            HeaderDigestFlag { typ, expected } => write!(
                f,
                "{typ:?} PDU {} a header digest",
                if *expected {
                    "without"
                } else {
                    "with an unnegotiated"
                }
            ),
            DataDigestFlag { typ, expected } => write!(
                f,
                "{typ:?} PDU {} a data digest",
                if *expected {
                    "without"
                } else {
                    "with an unexpected"
                }
            ),
            BadPdo { typ, pdo, expected } => {
                write!(f, "{typ:?} PDU with PDO {pdo} (must be {expected})")
            }
            BadPlen { typ, plen } => write!(f, "{typ:?} PDU with inconsistent PLEN {plen}"),
            TooLong { typ, plen, max } => {
                write!(f, "{typ:?} PDU of {plen} bytes exceeds the limit of {max}")
            }
            Short => write!(f, "PDU shorter than its PLEN"),
            HeaderDigest { computed, received } => write!(
                f,
                "header digest {received:#010x} does not match {computed:#010x}"
            ),
            DataDigest { computed, received } => write!(
                f,
                "data digest {received:#010x} does not match {computed:#010x}"
            ),
            Reserved { typ, offset } => {
                write!(f, "{typ:?} PDU with a nonzero reserved byte at {offset}")
            }
            InvalidField { typ, offset } => {
                write!(f, "{typ:?} PDU with an invalid field at byte {offset}")
            }
            BadDataLength {
                typ,
                datal,
                expected,
            } => write!(
                f,
                "{typ:?} PDU with DATAL {datal} but {expected} bytes of data"
            ),
        }
    }
}

impl std::error::Error for PduError {}

/// What the front of a receive buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The first PDU is not all there: this many bytes from the front are needed (always more
    /// than the buffer holds, never more than [`Params::max_plen`] or `CH_LEN`).
    Need(usize),
    /// The first PDU is complete and takes this many bytes.
    Complete(usize),
}

/// How long the PDU at the front of `buf` is, from its common header alone, once every length
/// and flag in that header has been checked (see the module documentation); the PDU-specific
/// header, padding and digests are [`decode`]'s.
pub fn pdu_len(buf: &[u8], p: &Params) -> Result<Progress, PduError> {
    let Some(ch) = buf.first_chunk::<CH_LEN>() else {
        return Ok(Progress::Need(CH_LEN));
    };
    let (_, len) = check_common(&CommonHeader::parse(ch), p)?;
    Ok(if buf.len() < len {
        Progress::Need(len)
    } else {
        Progress::Complete(len)
    })
}

/// Checks a common header against the rules of its type and `p`: the PDU's type and PLEN.
fn check_common(h: &CommonHeader, p: &Params) -> Result<(PduType, usize), PduError> {
    let typ = PduType::from_u8(h.typ).ok_or(PduError::UnknownType(h.typ))?;
    if typ.direction() != p.direction {
        return Err(PduError::WrongDirection(typ));
    }
    let hlen = typ.hlen();
    if h.hlen as usize != hlen {
        return Err(PduError::BadHlen {
            typ,
            hlen: h.hlen,
            expected: hlen as u8,
        });
    }
    if h.flags & !typ.allowed_flags() != 0
        || (h.flags & flags::SUCCESS != 0 && h.flags & flags::LAST_PDU == 0)
    {
        return Err(PduError::BadFlags {
            typ,
            flags: h.flags,
        });
    }
    let hdgst = p.hdgst && typ.takes_header_digest();
    if (h.flags & flags::HDGSTF != 0) != hdgst {
        return Err(PduError::HeaderDigestFlag {
            typ,
            expected: hdgst,
        });
    }
    let end = hlen + if hdgst { DIGEST_LEN } else { 0 };
    // u64: PLEN is a peer's u32 and gets added to.
    let plen = h.plen as u64;
    let bad_plen = PduError::BadPlen { typ, plen: h.plen };
    let no_data = |h: &CommonHeader| {
        if h.pdo != 0 {
            return Err(PduError::BadPdo {
                typ,
                pdo: h.pdo,
                expected: 0,
            });
        }
        if h.flags & flags::DDGSTF != 0 {
            return Err(PduError::DataDigestFlag {
                typ,
                expected: false,
            });
        }
        if plen != end as u64 {
            return Err(bad_plen.clone());
        }
        Ok(())
    };
    match typ.data_rule() {
        DataRule::None => no_data(h)?,
        DataRule::Optional if h.pdo == 0 => no_data(h)?,
        DataRule::Term => {
            if h.pdo != 0 {
                return Err(PduError::BadPdo {
                    typ,
                    pdo: h.pdo,
                    expected: 0,
                });
            }
            if !(TERM_HLEN as u64..=TERM_MAX_PLEN as u64).contains(&plen) {
                return Err(bad_plen);
            }
        }
        DataRule::Optional | DataRule::Required => {
            if (h.flags & flags::DDGSTF != 0) != p.ddgst {
                return Err(PduError::DataDigestFlag {
                    typ,
                    expected: p.ddgst,
                });
            }
            let pdo = data_offset(hlen, hdgst, p.pda);
            if h.pdo as usize != pdo {
                return Err(PduError::BadPdo {
                    typ,
                    pdo: h.pdo,
                    expected: pdo as u8,
                });
            }
            let ddgst = if p.ddgst { DIGEST_LEN } else { 0 };
            // At least one byte of data: a PDU announcing data and carrying none is malformed.
            if plen <= (pdo + ddgst) as u64 {
                return Err(bad_plen);
            }
        }
    }
    if h.plen > p.max_plen {
        return Err(PduError::TooLong {
            typ,
            plen: h.plen,
            max: p.max_plen,
        });
    }
    Ok((typ, h.plen as usize))
}

fn le16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}
fn le32(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}
fn le64(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

/// `Err(Reserved)` at the first nonzero byte of `b[range]`.
fn zeros(typ: PduType, b: &[u8], range: std::ops::Range<usize>) -> Result<(), PduError> {
    match b[range.clone()].iter().position(|&x| x != 0) {
        Some(i) => Err(PduError::Reserved {
            typ,
            offset: range.start + i,
        }),
        None => Ok(()),
    }
}

/// The data pointer of a command: an SGL descriptor (NVMe over Fabrics always uses SGLs).
pub mod sgl {
    /// Descriptor type (byte 15, bits 7:4): SGL Data Block.
    pub const DATA_BLOCK: u8 = 0x0;
    /// Descriptor type: SGL Bit Bucket.
    pub const BIT_BUCKET: u8 = 0x1;
    /// Descriptor type: SGL Segment.
    pub const SEGMENT: u8 = 0x2;
    /// Descriptor type: SGL Last Segment.
    pub const LAST_SEGMENT: u8 = 0x3;
    /// Descriptor type: Keyed SGL Data Block (RDMA).
    pub const KEYED_DATA_BLOCK: u8 = 0x4;
    /// Descriptor type: Transport SGL Data Block (the transport moves the data).
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5;
    /// Subtype (byte 15, bits 3:0): the address is a memory address.
    pub const SUBTYPE_ADDRESS: u8 = 0x0;
    /// Subtype: the address is an offset (in-capsule data, from the start of the capsule's data).
    pub const SUBTYPE_OFFSET: u8 = 0x1;
    /// Subtype: transport specific (NVMe/TCP: data moved by R2T/H2CData or C2HData).
    pub const SUBTYPE_TRANSPORT: u8 = 0xA;
}

/// The parts of an SGL descriptor a target looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sgl {
    /// SGL Data Block: in NVMe/TCP, in-capsule data (subtype offset, `address` the offset into
    /// the capsule's data).
    DataBlock {
        /// Subtype (`sgl::SUBTYPE_*`).
        subtype: u8,
        /// Address or offset.
        address: u64,
        /// Bytes of data.
        length: u32,
    },
    /// Keyed SGL Data Block (RDMA; 24-bit length and a key).
    KeyedDataBlock {
        /// Subtype.
        subtype: u8,
        /// Remote address.
        address: u64,
        /// Bytes of data (24 bits).
        length: u32,
        /// Remote key.
        key: u32,
    },
    /// Transport SGL Data Block: in NVMe/TCP, data the controller asks for with R2T (a write)
    /// or sends in C2HData (a read).
    TransportDataBlock {
        /// Subtype (`sgl::SUBTYPE_TRANSPORT` for NVMe/TCP).
        subtype: u8,
        /// Bytes of data.
        length: u32,
    },
    /// A bit bucket, a segment descriptor or a reserved type: nothing NVMe/TCP sends in a
    /// command's data pointer.
    Other {
        /// Descriptor type.
        typ: u8,
        /// Subtype.
        subtype: u8,
    },
}

impl Sgl {
    /// Parses a 16-byte descriptor (bytes the type leaves reserved are not looked at).
    pub fn parse(raw: &[u8; 16]) -> Sgl {
        let (typ, subtype) = (raw[15] >> 4, raw[15] & 0xf);
        match typ {
            sgl::DATA_BLOCK => Sgl::DataBlock {
                subtype,
                address: le64(raw, 0),
                length: le32(raw, 8),
            },
            sgl::KEYED_DATA_BLOCK => Sgl::KeyedDataBlock {
                subtype,
                address: le64(raw, 0),
                length: u32::from_le_bytes([raw[8], raw[9], raw[10], 0]),
                key: le32(raw, 11),
            },
            sgl::TRANSPORT_DATA_BLOCK => Sgl::TransportDataBlock {
                subtype,
                length: le32(raw, 8),
            },
            _ => Sgl::Other { typ, subtype },
        }
    }

    /// The descriptor as sent, reserved bytes zero (a keyed length above 24 bits is cut).
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        let (typ, subtype) = match *self {
            Sgl::DataBlock {
                subtype,
                address,
                length,
            } => {
                b[0..8].copy_from_slice(&address.to_le_bytes());
                b[8..12].copy_from_slice(&length.to_le_bytes());
                (sgl::DATA_BLOCK, subtype)
            }
            Sgl::KeyedDataBlock {
                subtype,
                address,
                length,
                key,
            } => {
                b[0..8].copy_from_slice(&address.to_le_bytes());
                b[8..11].copy_from_slice(&length.to_le_bytes()[..3]);
                b[11..15].copy_from_slice(&key.to_le_bytes());
                (sgl::KEYED_DATA_BLOCK, subtype)
            }
            Sgl::TransportDataBlock { subtype, length } => {
                b[8..12].copy_from_slice(&length.to_le_bytes());
                (sgl::TRANSPORT_DATA_BLOCK, subtype)
            }
            Sgl::Other { typ, subtype } => (typ, subtype),
        };
        b[15] = (typ << 4) | (subtype & 0xf);
        b
    }

    /// Bytes the descriptor describes, for the data block types.
    pub fn length(&self) -> Option<u32> {
        match *self {
            Sgl::DataBlock { length, .. }
            | Sgl::KeyedDataBlock { length, .. }
            | Sgl::TransportDataBlock { length, .. } => Some(length),
            Sgl::Other { .. } => None,
        }
    }
}

/// A submission queue entry (NVMe command), every field kept so it encodes to the bytes it came
/// from. Fabrics commands (opcode 0x7F) put their FCTYPE in byte 4, the low byte of `nsid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sqe {
    /// Command opcode (CDW0 bits 7:0).
    pub opcode: u8,
    /// FUSE (bits 1:0) and PSDT (bits 7:6; 10b, SGLs, in NVMe over Fabrics).
    pub flags: u8,
    /// Command identifier, echoed in the completion.
    pub cid: u16,
    /// Namespace identifier.
    pub nsid: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// Data pointer: SGL descriptor 1, raw ([`Sqe::sgl`] parses it).
    pub dptr: [u8; 16],
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

impl Sqe {
    /// Reads a 64-byte entry.
    pub fn parse(b: &[u8; SQE_LEN]) -> Sqe {
        Sqe {
            opcode: b[0],
            flags: b[1],
            cid: le16(b, 2),
            nsid: le32(b, 4),
            cdw2: le32(b, 8),
            cdw3: le32(b, 12),
            mptr: le64(b, 16),
            dptr: b[24..40].try_into().expect("16 bytes"),
            cdw10: le32(b, 40),
            cdw11: le32(b, 44),
            cdw12: le32(b, 48),
            cdw13: le32(b, 52),
            cdw14: le32(b, 56),
            cdw15: le32(b, 60),
        }
    }

    /// The entry as sent.
    pub fn to_bytes(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.cid.to_le_bytes());
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        b[8..12].copy_from_slice(&self.cdw2.to_le_bytes());
        b[12..16].copy_from_slice(&self.cdw3.to_le_bytes());
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..40].copy_from_slice(&self.dptr);
        let cdws = [
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        ];
        for (i, d) in cdws.iter().enumerate() {
            b[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        b
    }

    /// The data pointer, parsed.
    pub fn sgl(&self) -> Sgl {
        Sgl::parse(&self.dptr)
    }

    /// PSDT: 0 PRPs, 1 or 2 SGLs (NVMe over Fabrics requires 2, SGLs for data and metadata).
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific result, dword 0.
    pub dw0: u32,
    /// Command specific result, dword 1.
    pub dw1: u32,
    /// SQ head pointer (SQHD).
    pub sq_head: u16,
    /// SQ identifier.
    pub sq_id: u16,
    /// The command identifier of the command completed.
    pub cid: u16,
    /// Bit 0 the phase tag (unused over fabrics), bits 15:1 the status field: SC 8:1, SCT 11:9,
    /// CRD 13:12, More 14, DNR 15.
    pub status: u16,
}

impl Cqe {
    /// Reads a 16-byte entry.
    pub fn parse(b: &[u8; CQE_LEN]) -> Cqe {
        Cqe {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sq_head: le16(b, 8),
            sq_id: le16(b, 10),
            cid: le16(b, 12),
            status: le16(b, 14),
        }
    }

    /// The entry as sent.
    pub fn to_bytes(&self) -> [u8; CQE_LEN] {
        let mut b = [0u8; CQE_LEN];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        b[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status.to_le_bytes());
        b
    }

    /// The `status` word for status code type `sct`, status code `sc` and Do Not Retry, phase
    /// tag clear.
    pub fn status_word(sct: u8, sc: u8, dnr: bool) -> u16 {
        ((sc as u16) << 1) | (((sct & 7) as u16) << 9) | ((dnr as u16) << 15)
    }

    /// The phase tag.
    pub fn phase(&self) -> bool {
        self.status & 1 != 0
    }

    /// Status code.
    pub fn sc(&self) -> u8 {
        (self.status >> 1) as u8
    }

    /// Status code type.
    pub fn sct(&self) -> u8 {
        ((self.status >> 9) & 7) as u8
    }

    /// Do Not Retry.
    pub fn dnr(&self) -> bool {
        self.status & 0x8000 != 0
    }

    /// Success: status code type and code both 0.
    pub fn is_success(&self) -> bool {
        self.status & 0x0ffe == 0
    }
}

/// ICReq / ICResp digest byte: HDGST_ENABLE.
pub const HDGST_ENABLE: u8 = 1 << 0;
/// ICReq / ICResp digest byte: DDGST_ENABLE.
pub const DDGST_ENABLE: u8 = 1 << 1;

/// ICReq: the host's first PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version (`PFV_1_0`).
    pub pfv: u16,
    /// Host PDU data alignment, 0's based dwords (0..=31).
    pub hpda: u8,
    /// The host asks for header digests.
    pub hdgst: bool,
    /// The host asks for data digests.
    pub ddgst: bool,
    /// Most R2Ts outstanding per command, 0's based.
    pub maxr2t: u32,
}

/// ICResp: the controller's answer to ICReq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcResp {
    /// PDU format version (`PFV_1_0`).
    pub pfv: u16,
    /// Controller PDU data alignment, 0's based dwords (0..=31).
    pub cpda: u8,
    /// Header digests on.
    pub hdgst: bool,
    /// Data digests on.
    pub ddgst: bool,
    /// MAXH2CDATA: most data bytes in one H2CData (a nonzero multiple of 4).
    pub maxh2cdata: u32,
}

/// H2CTermReq or C2HTermReq: why the sender is closing the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// Fatal error status ([`fes`]).
    pub fes: u16,
    /// Fatal error information (for `INVALID_HEADER_FIELD`, the field's byte offset).
    pub fei: u32,
    /// The header of the PDU in error, up to `TERM_MAX_DATA` bytes.
    pub data: &'a [u8],
}

/// CapsuleCmd: a command and its in-capsule data (possibly none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapsuleCmd<'a> {
    /// The command.
    pub sqe: Sqe,
    /// In-capsule data.
    pub data: &'a [u8],
}

/// H2CData: write data solicited by an R2T.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2CData<'a> {
    /// CCCID: the command's identifier.
    pub cccid: u16,
    /// TTAG: the transfer tag of the R2T this answers.
    pub ttag: u16,
    /// DATAO: where the data goes in the command's data.
    pub datao: u32,
    /// LAST_PDU: the last H2CData for that R2T.
    pub last: bool,
    /// The data (DATAL is its length).
    pub data: &'a [u8],
}

/// C2HData: read data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct C2HData<'a> {
    /// CCCID: the command's identifier.
    pub cccid: u16,
    /// DATAO: where the data belongs in the command's data.
    pub datao: u32,
    /// LAST_PDU: the command's last C2HData.
    pub last: bool,
    /// SUCCESS: the command succeeded and no CapsuleResp follows (only with `last`).
    pub success: bool,
    /// The data (DATAL is its length).
    pub data: &'a [u8],
}

/// R2T: the controller asks for write data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct R2T {
    /// CCCID: the command's identifier.
    pub cccid: u16,
    /// TTAG: the tag the host puts in its H2CData.
    pub ttag: u16,
    /// R2TO: offset in the command's data.
    pub r2to: u32,
    /// R2TL: bytes asked for.
    pub r2tl: u32,
}

/// A decoded PDU; data lies in the buffer it was decoded from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// ICReq.
    IcReq(IcReq),
    /// ICResp.
    IcResp(IcResp),
    /// H2CTermReq.
    H2CTermReq(TermReq<'a>),
    /// C2HTermReq.
    C2HTermReq(TermReq<'a>),
    /// CapsuleCmd.
    CapsuleCmd(CapsuleCmd<'a>),
    /// CapsuleResp.
    CapsuleResp(Cqe),
    /// H2CData.
    H2CData(H2CData<'a>),
    /// C2HData.
    C2HData(C2HData<'a>),
    /// R2T.
    R2T(R2T),
}

/// Decodes the complete PDU at the front of `buf` (the rest of `buf` is left alone): the common
/// header as [`pdu_len`] checks it, then the header digest before anything else in the header
/// is read, the PDU-specific header, padding, and the data digest.
pub fn decode<'a>(buf: &'a [u8], p: &Params) -> Result<Pdu<'a>, PduError> {
    let len = match pdu_len(buf, p)? {
        Progress::Complete(len) => len,
        Progress::Need(_) => return Err(PduError::Short),
    };
    let b = &buf[..len];
    let ch = CommonHeader::parse(b.first_chunk().expect("checked by pdu_len"));
    let typ = PduType::from_u8(ch.typ).expect("checked by pdu_len");
    let hlen = typ.hlen();
    let mut at = hlen;
    if ch.flags & flags::HDGSTF != 0 {
        let computed = header_digest(&b[..hlen]);
        let received = le32(b, hlen);
        if computed != received {
            return Err(PduError::HeaderDigest { computed, received });
        }
        at += DIGEST_LEN;
    }
    let data = match typ.data_rule() {
        DataRule::Term => &b[hlen..],
        _ if ch.pdo == 0 => &[][..],
        _ => {
            let pdo = ch.pdo as usize;
            zeros(typ, b, at..pdo)?;
            let end = if ch.flags & flags::DDGSTF != 0 {
                let end = len - DIGEST_LEN;
                let computed = data_digest(&b[pdo..end]);
                let received = le32(b, end);
                if computed != received {
                    return Err(PduError::DataDigest { computed, received });
                }
                end
            } else {
                len
            };
            &b[pdo..end]
        }
    };
    let check_datal = |datal: u32| {
        if datal as usize != data.len() {
            return Err(PduError::BadDataLength {
                typ,
                datal,
                expected: data.len() as u32,
            });
        }
        Ok(())
    };
    Ok(match typ {
        PduType::IcReq | PduType::IcResp => {
            let pda = b[10];
            if pda > MAX_PDA {
                return Err(PduError::InvalidField { typ, offset: 10 });
            }
            let digest = b[11];
            if digest & !(HDGST_ENABLE | DDGST_ENABLE) != 0 {
                return Err(PduError::Reserved { typ, offset: 11 });
            }
            zeros(typ, b, 16..IC_LEN)?;
            let (pfv, hdgst, ddgst) = (
                le16(b, 8),
                digest & HDGST_ENABLE != 0,
                digest & DDGST_ENABLE != 0,
            );
            if typ == PduType::IcReq {
                Pdu::IcReq(IcReq {
                    pfv,
                    hpda: pda,
                    hdgst,
                    ddgst,
                    maxr2t: le32(b, 12),
                })
            } else {
                let maxh2cdata = le32(b, 12);
                if maxh2cdata == 0 || !maxh2cdata.is_multiple_of(4) {
                    return Err(PduError::InvalidField { typ, offset: 12 });
                }
                Pdu::IcResp(IcResp {
                    pfv,
                    cpda: pda,
                    hdgst,
                    ddgst,
                    maxh2cdata,
                })
            }
        }
        PduType::H2CTermReq | PduType::C2HTermReq => {
            zeros(typ, b, 14..TERM_HLEN)?;
            let t = TermReq {
                fes: le16(b, 8),
                fei: le32(b, 10),
                data,
            };
            if typ == PduType::H2CTermReq {
                Pdu::H2CTermReq(t)
            } else {
                Pdu::C2HTermReq(t)
            }
        }
        PduType::CapsuleCmd => Pdu::CapsuleCmd(CapsuleCmd {
            sqe: Sqe::parse(b[CH_LEN..CMD_HLEN].try_into().expect("64 bytes")),
            data,
        }),
        PduType::CapsuleResp => Pdu::CapsuleResp(Cqe::parse(
            b[CH_LEN..RSP_HLEN].try_into().expect("16 bytes"),
        )),
        PduType::H2CData => {
            zeros(typ, b, 20..DATA_HLEN)?;
            check_datal(le32(b, 16))?;
            Pdu::H2CData(H2CData {
                cccid: le16(b, 8),
                ttag: le16(b, 10),
                datao: le32(b, 12),
                last: ch.flags & flags::LAST_PDU != 0,
                data,
            })
        }
        PduType::C2HData => {
            zeros(typ, b, 10..12)?;
            zeros(typ, b, 20..DATA_HLEN)?;
            check_datal(le32(b, 16))?;
            Pdu::C2HData(C2HData {
                cccid: le16(b, 8),
                datao: le32(b, 12),
                last: ch.flags & flags::LAST_PDU != 0,
                success: ch.flags & flags::SUCCESS != 0,
                data,
            })
        }
        PduType::R2T => {
            zeros(typ, b, 20..R2T_HLEN)?;
            Pdu::R2T(R2T {
                cccid: le16(b, 8),
                ttag: le16(b, 10),
                r2to: le32(b, 12),
                r2tl: le32(b, 16),
            })
        }
    })
}

/// Bytes before the data of a PDU of type `typ` carrying `data_len` bytes under `p`: header,
/// header digest and padding (all of it for a PDU without data). A reply whose data is read in
/// place reserves this much in front of it ([`encode_prefix`]).
pub fn prefix_len(typ: PduType, data_len: usize, p: &Params) -> usize {
    let hdgst = p.hdgst && typ.takes_header_digest();
    match typ.data_rule() {
        DataRule::Term => TERM_HLEN,
        DataRule::None => data_offset(typ.hlen(), hdgst, 0),
        DataRule::Optional if data_len == 0 => data_offset(typ.hlen(), hdgst, 0),
        DataRule::Optional | DataRule::Required => data_offset(typ.hlen(), hdgst, p.pda),
    }
}

/// Bytes after the data: the data digest, when negotiated and the PDU has data that takes one.
pub fn suffix_len(typ: PduType, data_len: usize, p: &Params) -> usize {
    match typ.data_rule() {
        DataRule::Optional | DataRule::Required if data_len > 0 && p.ddgst => DIGEST_LEN,
        _ => 0,
    }
}

/// Appends the part of a PDU before its data: common header (flags HDGSTF and DDGSTF set from
/// `p`, PDO and PLEN computed), `psh` (the PDU-specific header, `typ.hlen() - 8` bytes), the
/// header digest and zero padding. `extra_flags` are LAST_PDU and SUCCESS, where the type has
/// them. The caller appends `data_len` bytes of data and then, when [`suffix_len`] says so,
/// the data digest ([`data_digest`], little-endian).
///
/// # Panics
///
/// When `psh` is not `typ.hlen() - 8` bytes, or the PDU would be longer than `u32::MAX` bytes
/// (both are the caller's mistakes, not a peer's).
pub fn encode_prefix(
    typ: PduType,
    extra_flags: u8,
    psh: &[u8],
    data_len: usize,
    p: &Params,
    out: &mut Vec<u8>,
) {
    let hlen = typ.hlen();
    assert_eq!(psh.len(), hlen - CH_LEN, "{typ:?} header length");
    let hdgst = p.hdgst && typ.takes_header_digest();
    let prefix = prefix_len(typ, data_len, p);
    let suffix = suffix_len(typ, data_len, p);
    let mut fl = extra_flags & typ.allowed_flags();
    if hdgst {
        fl |= flags::HDGSTF;
    }
    if suffix > 0 {
        fl |= flags::DDGSTF;
    }
    let has_data = data_len > 0 && typ.data_rule() != DataRule::Term;
    let pdo = if has_data { prefix as u8 } else { 0 };
    let plen = u32::try_from(prefix + data_len + suffix).expect("PDU longer than 4 GiB");
    let start = out.len();
    let ch = CommonHeader {
        typ: typ as u8,
        flags: fl,
        hlen: hlen as u8,
        pdo,
        plen,
    };
    out.extend_from_slice(&ch.to_bytes());
    out.extend_from_slice(psh);
    if hdgst {
        let d = header_digest(&out[start..start + hlen]);
        out.extend_from_slice(&d.to_le_bytes());
    }
    out.resize(start + prefix, 0);
}

/// Appends a whole PDU: [`encode_prefix`], the data, the data digest if any.
fn encode_with(
    typ: PduType,
    extra_flags: u8,
    psh: &[u8],
    data: &[u8],
    p: &Params,
    out: &mut Vec<u8>,
) {
    encode_prefix(typ, extra_flags, psh, data.len(), p, out);
    out.extend_from_slice(data);
    if suffix_len(typ, data.len(), p) > 0 {
        out.extend_from_slice(&data_digest(data).to_le_bytes());
    }
}

impl IcReq {
    fn psh(&self) -> [u8; IC_LEN - CH_LEN] {
        ic_psh(self.pfv, self.hpda, self.hdgst, self.ddgst, self.maxr2t)
    }
}

impl IcResp {
    fn psh(&self) -> [u8; IC_LEN - CH_LEN] {
        ic_psh(self.pfv, self.cpda, self.hdgst, self.ddgst, self.maxh2cdata)
    }
}

fn ic_psh(pfv: u16, pda: u8, hdgst: bool, ddgst: bool, last: u32) -> [u8; IC_LEN - CH_LEN] {
    let mut b = [0u8; IC_LEN - CH_LEN];
    b[0..2].copy_from_slice(&pfv.to_le_bytes());
    b[2] = pda;
    b[3] = if hdgst { HDGST_ENABLE } else { 0 } | if ddgst { DDGST_ENABLE } else { 0 };
    b[4..8].copy_from_slice(&last.to_le_bytes());
    b
}

/// The 16 bytes after the common header of a data or R2T PDU.
fn data_psh(cccid: u16, ttag: u16, offset: u32, length: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..2].copy_from_slice(&cccid.to_le_bytes());
    b[2..4].copy_from_slice(&ttag.to_le_bytes());
    b[4..8].copy_from_slice(&offset.to_le_bytes());
    b[8..12].copy_from_slice(&length.to_le_bytes());
    b
}

impl TermReq<'_> {
    fn psh(&self) -> [u8; TERM_HLEN - CH_LEN] {
        let mut b = [0u8; TERM_HLEN - CH_LEN];
        b[0..2].copy_from_slice(&self.fes.to_le_bytes());
        b[2..6].copy_from_slice(&self.fei.to_le_bytes());
        b
    }
}

impl H2CData<'_> {
    /// Appends the header part of an H2CData carrying `data_len` bytes (see [`encode_prefix`]).
    pub fn encode_prefix(&self, data_len: u32, p: &Params, out: &mut Vec<u8>) {
        let psh = data_psh(self.cccid, self.ttag, self.datao, data_len);
        let last = if self.last { flags::LAST_PDU } else { 0 };
        encode_prefix(PduType::H2CData, last, &psh, data_len as usize, p, out);
    }
}

impl C2HData<'_> {
    /// Appends the header part of a C2HData carrying `data_len` bytes (see [`encode_prefix`]):
    /// a read reply puts this in front of data read in place, and the data digest after it.
    pub fn encode_prefix(&self, data_len: u32, p: &Params, out: &mut Vec<u8>) {
        let psh = data_psh(self.cccid, 0, self.datao, data_len);
        let fl = if self.last { flags::LAST_PDU } else { 0 }
            | if self.success { flags::SUCCESS } else { 0 };
        encode_prefix(PduType::C2HData, fl, &psh, data_len as usize, p, out);
    }
}

impl Pdu<'_> {
    /// The PDU's type.
    pub fn typ(&self) -> PduType {
        match self {
            Pdu::IcReq(_) => PduType::IcReq,
            Pdu::IcResp(_) => PduType::IcResp,
            Pdu::H2CTermReq(_) => PduType::H2CTermReq,
            Pdu::C2HTermReq(_) => PduType::C2HTermReq,
            Pdu::CapsuleCmd(_) => PduType::CapsuleCmd,
            Pdu::CapsuleResp(_) => PduType::CapsuleResp,
            Pdu::H2CData(_) => PduType::H2CData,
            Pdu::C2HData(_) => PduType::C2HData,
            Pdu::R2T(_) => PduType::R2T,
        }
    }

    /// Appends the whole PDU as sent under `p` (digests, padding, PDO and PLEN from `p`). A
    /// TermReq's data is cut to `TERM_MAX_DATA` bytes; H2CData and C2HData need data (a
    /// receiver refuses them empty).
    pub fn encode(&self, p: &Params, out: &mut Vec<u8>) {
        let typ = self.typ();
        match self {
            Pdu::IcReq(r) => encode_with(typ, 0, &r.psh(), &[], p, out),
            Pdu::IcResp(r) => encode_with(typ, 0, &r.psh(), &[], p, out),
            Pdu::H2CTermReq(t) | Pdu::C2HTermReq(t) => {
                let data = &t.data[..t.data.len().min(TERM_MAX_DATA)];
                encode_with(typ, 0, &t.psh(), data, p, out)
            }
            Pdu::CapsuleCmd(c) => encode_with(typ, 0, &c.sqe.to_bytes(), c.data, p, out),
            Pdu::CapsuleResp(cqe) => encode_with(typ, 0, &cqe.to_bytes(), &[], p, out),
            Pdu::H2CData(d) => {
                let psh = data_psh(d.cccid, d.ttag, d.datao, d.data.len() as u32);
                let fl = if d.last { flags::LAST_PDU } else { 0 };
                encode_with(typ, fl, &psh, d.data, p, out)
            }
            Pdu::C2HData(d) => {
                let psh = data_psh(d.cccid, 0, d.datao, d.data.len() as u32);
                let fl = if d.last { flags::LAST_PDU } else { 0 }
                    | if d.success { flags::SUCCESS } else { 0 };
                encode_with(typ, fl, &psh, d.data, p, out)
            }
            Pdu::R2T(r) => {
                let psh = data_psh(r.cccid, r.ttag, r.r2to, r.r2tl);
                encode_with(typ, 0, &psh, &[], p, out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H2C: Direction = Direction::HostToController;
    const C2H: Direction = Direction::ControllerToHost;

    fn params(direction: Direction, hdgst: bool, ddgst: bool, pda: u8) -> Params {
        Params {
            direction,
            hdgst,
            ddgst,
            pda,
            max_plen: 1 << 20,
        }
    }

    /// Every combination of digests, with dword and 32-byte alignment.
    fn variants(direction: Direction) -> Vec<Params> {
        let mut v = Vec::new();
        for hdgst in [false, true] {
            for ddgst in [false, true] {
                for pda in [0, 7] {
                    v.push(params(direction, hdgst, ddgst, pda));
                }
            }
        }
        v
    }

    fn sqe() -> Sqe {
        Sqe {
            opcode: 0x01,
            flags: 0x40,
            cid: 0xbeef,
            nsid: 1,
            cdw2: 2,
            cdw3: 3,
            mptr: 0x1122_3344_5566_7788,
            dptr: Sgl::DataBlock {
                subtype: sgl::SUBTYPE_OFFSET,
                address: 0,
                length: 100,
            }
            .to_bytes(),
            cdw10: 10,
            cdw11: 11,
            cdw12: 12,
            cdw13: 13,
            cdw14: 14,
            cdw15: 15,
        }
    }

    fn cqe() -> Cqe {
        Cqe {
            dw0: 0xdead_beef,
            dw1: 7,
            sq_head: 3,
            sq_id: 1,
            cid: 0xbeef,
            status: Cqe::status_word(0, 0x02, true),
        }
    }

    /// One PDU of every type from each side; `data` for the ones that carry some.
    fn samples(data: &[u8]) -> Vec<Pdu<'_>> {
        vec![
            Pdu::IcReq(IcReq {
                pfv: PFV_1_0,
                hpda: 3,
                hdgst: true,
                ddgst: false,
                maxr2t: 15,
            }),
            Pdu::IcResp(IcResp {
                pfv: PFV_1_0,
                cpda: 0,
                hdgst: false,
                ddgst: true,
                maxh2cdata: 128 << 10,
            }),
            Pdu::H2CTermReq(TermReq {
                fes: fes::UNSUPPORTED_PARAMETER,
                fei: 0x0102_0304,
                data: &data[..data.len().min(TERM_MAX_DATA)],
            }),
            Pdu::C2HTermReq(TermReq {
                fes: fes::HEADER_DIGEST_ERROR,
                fei: 0,
                data: &[],
            }),
            Pdu::CapsuleCmd(CapsuleCmd { sqe: sqe(), data }),
            Pdu::CapsuleCmd(CapsuleCmd {
                sqe: sqe(),
                data: &[],
            }),
            Pdu::CapsuleResp(cqe()),
            Pdu::H2CData(H2CData {
                cccid: 0xbeef,
                ttag: 9,
                datao: 4096,
                last: true,
                data,
            }),
            Pdu::C2HData(C2HData {
                cccid: 0xbeef,
                datao: 0,
                last: true,
                success: true,
                data,
            }),
            Pdu::C2HData(C2HData {
                cccid: 1,
                datao: 8,
                last: false,
                success: false,
                data,
            }),
            Pdu::R2T(R2T {
                cccid: 0xbeef,
                ttag: 9,
                r2to: 4096,
                r2tl: 1 << 20,
            }),
        ]
    }

    fn encode(pdu: &Pdu<'_>, p: &Params) -> Vec<u8> {
        let mut out = Vec::new();
        pdu.encode(p, &mut out);
        out
    }

    fn params_for(pdu: &Pdu<'_>, hdgst: bool, ddgst: bool, pda: u8) -> Params {
        params(pdu.typ().direction(), hdgst, ddgst, pda)
    }

    #[test]
    fn every_type_round_trips_under_every_negotiation() {
        let data: Vec<u8> = (0..100u8).collect();
        for pdu in samples(&data) {
            for p in variants(pdu.typ().direction()) {
                let b = encode(&pdu, &p);
                assert_eq!(pdu_len(&b, &p), Ok(Progress::Complete(b.len())), "{pdu:?}");
                assert_eq!(decode(&b, &p), Ok(pdu), "{pdu:?} {p:?}");
                // Bytes of the next PDU behind it change nothing.
                let mut more = b.clone();
                more.extend_from_slice(&[0xaa; 9]);
                assert_eq!(pdu_len(&more, &p), Ok(Progress::Complete(b.len())));
                assert_eq!(decode(&more, &p), Ok(pdu));

                // The layout: HLEN, PLEN, PDO and digests where the specification puts them.
                let typ = pdu.typ();
                let ch = CommonHeader::parse(b.first_chunk().unwrap());
                assert_eq!((ch.typ, ch.hlen as usize), (typ as u8, typ.hlen()));
                assert_eq!(ch.plen as usize, b.len());
                let hd = p.hdgst && typ.takes_header_digest();
                assert_eq!(ch.flags & flags::HDGSTF != 0, hd);
                if hd {
                    let d = crc32c(&b[..typ.hlen()]).to_le_bytes();
                    assert_eq!(b[typ.hlen()..typ.hlen() + 4], d, "{typ:?} header digest");
                }
                let carried: &[u8] = match pdu {
                    Pdu::CapsuleCmd(c) => c.data,
                    Pdu::H2CData(d) => d.data,
                    Pdu::C2HData(d) => d.data,
                    _ => &[],
                };
                if carried.is_empty() {
                    assert_eq!(ch.flags & flags::DDGSTF, 0);
                    if !matches!(typ, PduType::H2CTermReq | PduType::C2HTermReq) {
                        assert_eq!(ch.pdo, 0);
                        assert_eq!(b.len(), typ.hlen() + if hd { 4 } else { 0 });
                    }
                } else {
                    let pdo = ch.pdo as usize;
                    assert_eq!(pdo % p.alignment(), 0);
                    assert_eq!(pdo, data_offset(typ.hlen(), hd, p.pda));
                    assert!(pdo >= typ.hlen() + if hd { 4 } else { 0 });
                    assert_eq!(&b[pdo..pdo + carried.len()], carried);
                    assert_eq!(ch.flags & flags::DDGSTF != 0, p.ddgst);
                    if p.ddgst {
                        assert_eq!(b[b.len() - 4..], crc32c(carried).to_le_bytes());
                    }
                }
            }
        }
    }

    #[test]
    fn byte_layout_matches_the_specification() {
        let p = params(C2H, false, false, 0);
        let r2t = Pdu::R2T(R2T {
            cccid: 0x1234,
            ttag: 5,
            r2to: 0x1000,
            r2tl: 0x2000,
        });
        assert_eq!(
            encode(&r2t, &p),
            [
                0x09, 0, 24, 0, 24, 0, 0, 0, 0x34, 0x12, 5, 0, 0, 0x10, 0, 0, 0, 0x20, 0, 0, 0, 0,
                0, 0
            ]
        );
        let ic = encode(
            &Pdu::IcResp(IcResp {
                pfv: 0,
                cpda: 1,
                hdgst: true,
                ddgst: true,
                maxh2cdata: 0x2_0000,
            }),
            &params(C2H, true, true, 0),
        );
        assert_eq!(ic.len(), 128, "never a digest on ICResp");
        assert_eq!(
            ic[..16],
            [1, 0, 128, 0, 128, 0, 0, 0, 0, 0, 1, 3, 0, 0, 2, 0]
        );
        let cmd = encode(
            &Pdu::CapsuleCmd(CapsuleCmd {
                sqe: sqe(),
                data: &[],
            }),
            &params(H2C, false, false, 0),
        );
        assert_eq!(
            cmd[..12],
            [4, 0, 72, 0, 72, 0, 0, 0, 0x01, 0x40, 0xef, 0xbe]
        );
        assert_eq!(cmd[12..16], 1u32.to_le_bytes(), "nsid");
        assert_eq!(cmd[32 + 15], 0x01, "SGL type 0 subtype 1: in-capsule data");
        assert_eq!(cmd[48..52], 10u32.to_le_bytes(), "cdw10");
        let term = encode(
            &Pdu::C2HTermReq(TermReq {
                fes: 1,
                fei: 0x0a0b_0c0d,
                data: &[7; 8],
            }),
            &params(C2H, true, true, 0),
        );
        assert_eq!(
            term[..16],
            [3, 0, 24, 0, 32, 0, 0, 0, 1, 0, 0x0d, 0x0c, 0x0b, 0x0a, 0, 0]
        );
        // The CRC32C check value, stored little-endian.
        assert_eq!(header_digest(b"123456789"), 0xe306_9283);
    }

    /// `b` with its common header changed by `f`.
    fn patched(b: &[u8], f: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let mut b = b.to_vec();
        f(&mut b);
        b
    }

    fn set_plen(b: &mut [u8], plen: u32) {
        b[4..8].copy_from_slice(&plen.to_le_bytes());
    }

    #[test]
    fn common_header_checks_refuse_before_waiting() {
        let data = [0x5au8; 100];
        let t = params(H2C, false, false, 0);
        let h = params(C2H, false, false, 0);
        let cmd = encode(&samples(&data)[4], &t);
        let resp = encode(&Pdu::CapsuleResp(cqe()), &h);
        let h2c = encode(&samples(&data)[7], &t);
        let icreq = encode(&samples(&data)[0], &t);
        let term = encode(&samples(&data)[2], &t);

        // Type and direction.
        assert_eq!(
            pdu_len(&patched(&cmd, |b| b[0] = 8), &t),
            Err(PduError::UnknownType(8))
        );
        assert_eq!(
            pdu_len(&patched(&cmd, |b| b[0] = 0xff), &t),
            Err(PduError::UnknownType(0xff))
        );
        assert_eq!(
            pdu_len(&resp, &t),
            Err(PduError::WrongDirection(PduType::CapsuleResp))
        );
        assert_eq!(
            pdu_len(&cmd, &h),
            Err(PduError::WrongDirection(PduType::CapsuleCmd))
        );
        assert_eq!(
            pdu_len(&cmd, &h).unwrap_err().term_status(),
            Some((fes::INVALID_HEADER_FIELD, 0))
        );

        // HLEN is fixed per type: one more dword is refused for every type.
        for pdu in samples(&data) {
            let p = params_for(&pdu, false, false, 0);
            let b = encode(&pdu, &p);
            let typ = pdu.typ();
            assert_eq!(
                pdu_len(&patched(&b, |b| b[2] += 4), &p),
                Err(PduError::BadHlen {
                    typ,
                    hlen: typ.hlen() as u8 + 4,
                    expected: typ.hlen() as u8
                })
            );
        }

        // Flags the type does not have, reserved bits, SUCCESS without LAST_PDU.
        let bad_flags = |b: &[u8], f: u8, p: &Params| {
            let typ = PduType::from_u8(b[0]).unwrap();
            assert_eq!(
                pdu_len(&patched(b, |b| b[1] |= f), p),
                Err(PduError::BadFlags {
                    typ,
                    flags: b[1] | f
                })
            );
        };
        bad_flags(&cmd, flags::LAST_PDU, &t);
        bad_flags(&cmd, 0x10, &t);
        bad_flags(&h2c, flags::SUCCESS, &t);
        bad_flags(&icreq, flags::HDGSTF, &params(H2C, true, true, 0));
        bad_flags(&term, flags::DDGSTF, &params(H2C, true, true, 0));
        let c2h = encode(&samples(&data)[9], &h);
        bad_flags(&c2h, flags::SUCCESS, &h);
        bad_flags(&c2h, 0x80, &h);

        // PDO: 0 without data, exactly after the header (and digest, and padding) with data.
        assert_eq!(
            pdu_len(&patched(&resp, |b| b[3] = 24), &h),
            Err(PduError::BadPdo {
                typ: PduType::CapsuleResp,
                pdo: 24,
                expected: 0
            })
        );
        assert_eq!(
            pdu_len(&patched(&h2c, |b| b[3] = 28), &t),
            Err(PduError::BadPdo {
                typ: PduType::H2CData,
                pdo: 28,
                expected: 24
            })
        );
        assert_eq!(
            pdu_len(&h2c, &params(H2C, false, false, 7)),
            Err(PduError::BadPdo {
                typ: PduType::H2CData,
                pdo: 24,
                expected: 32
            }),
            "data not where the receiver's alignment puts it"
        );
        assert_eq!(
            pdu_len(&patched(&cmd, |b| b[3] = 0), &t),
            Err(PduError::BadPlen {
                typ: PduType::CapsuleCmd,
                plen: cmd.len() as u32
            }),
            "a command without data is exactly its header"
        );
        assert!(matches!(
            pdu_len(&patched(&term, |b| b[3] = 24), &t),
            Err(PduError::BadPdo { pdo: 24, .. })
        ));

        // PLEN against HLEN, PDO and digests.
        let bad_plen = |b: &[u8], plen: u32, p: &Params| {
            let typ = PduType::from_u8(b[0]).unwrap();
            assert_eq!(
                pdu_len(&patched(b, |b| set_plen(b, plen)), p),
                Err(PduError::BadPlen { typ, plen }),
                "{typ:?} plen {plen}"
            );
        };
        bad_plen(&icreq, 129, &t);
        bad_plen(&icreq, 132, &params(H2C, true, true, 0));
        bad_plen(&resp, 28, &h);
        bad_plen(&resp, 20, &h);
        bad_plen(&h2c, 24, &t);
        bad_plen(&h2c, 0, &t);
        bad_plen(&term, TERM_MAX_PLEN as u32 + 1, &t);
        bad_plen(&term, 23, &t);
        let r2t = encode(&samples(&data)[10], &h);
        bad_plen(&r2t, 24 + 4, &h);
        let h2c_dd = encode(&samples(&data)[7], &params(H2C, false, true, 0));
        bad_plen(&h2c_dd, 28, &params(H2C, false, true, 0));
        // The longest TermReq is fine, and an empty one too.
        let long_term = patched(&term, |b| set_plen(b, TERM_MAX_PLEN as u32));
        assert_eq!(pdu_len(&long_term, &t), Ok(Progress::Need(TERM_MAX_PLEN)));
        assert_eq!(
            pdu_len(&patched(&term[..24], |b| set_plen(b, 24)), &t),
            Ok(Progress::Complete(24))
        );

        // The receiver's bound: refused from the common header, never waited for.
        let small = Params {
            max_plen: 4096,
            ..t
        };
        let big = vec![1u8; 5000];
        let b = encode(&samples(&big)[7], &t);
        assert_eq!(
            pdu_len(&b[..8], &small),
            Err(PduError::TooLong {
                typ: PduType::H2CData,
                plen: 5024,
                max: 4096
            })
        );
        let huge = patched(&h2c[..8], |b| set_plen(b, u32::MAX));
        assert!(matches!(
            pdu_len(&huge, &t),
            Err(PduError::TooLong { plen: u32::MAX, .. })
        ));
        assert_eq!(
            pdu_len(&huge, &t).unwrap_err().term_status(),
            Some((fes::DATA_TRANSFER_LIMIT_EXCEEDED, 0))
        );
        let huge_cmd = patched(&cmd[..8], |b| set_plen(b, u32::MAX));
        assert_eq!(
            pdu_len(&huge_cmd, &t).unwrap_err().term_status(),
            Some((fes::INVALID_HEADER_FIELD, 4))
        );
        assert_eq!(decode(&cmd[..cmd.len() - 1], &t), Err(PduError::Short));
    }

    #[test]
    fn digests_present_exactly_when_negotiated() {
        let data = [3u8; 64];
        let both = params(H2C, true, true, 0);
        let none = params(H2C, false, false, 0);
        let cmd = Pdu::CapsuleCmd(CapsuleCmd {
            sqe: sqe(),
            data: &data,
        });
        let with = encode(&cmd, &both);
        let without = encode(&cmd, &none);
        assert_eq!(with.len(), without.len() + 8);
        assert_eq!(
            pdu_len(&with, &none),
            Err(PduError::HeaderDigestFlag {
                typ: PduType::CapsuleCmd,
                expected: false
            })
        );
        assert_eq!(
            pdu_len(&without, &both),
            Err(PduError::HeaderDigestFlag {
                typ: PduType::CapsuleCmd,
                expected: true
            })
        );
        let hd_only = params(H2C, true, false, 0);
        assert_eq!(
            pdu_len(&with, &hd_only),
            Err(PduError::DataDigestFlag {
                typ: PduType::CapsuleCmd,
                expected: false
            })
        );
        assert_eq!(
            pdu_len(&encode(&cmd, &hd_only), &both),
            Err(PduError::DataDigestFlag {
                typ: PduType::CapsuleCmd,
                expected: true
            })
        );
        // No data, no data digest, even when negotiated.
        let bare = encode(
            &Pdu::CapsuleCmd(CapsuleCmd {
                sqe: sqe(),
                data: &[],
            }),
            &both,
        );
        assert_eq!(bare.len(), 76);
        assert_eq!(
            pdu_len(&patched(&bare, |b| b[1] |= flags::DDGSTF), &both),
            Err(PduError::DataDigestFlag {
                typ: PduType::CapsuleCmd,
                expected: false
            })
        );
        // ICReq never has one: decoded the same whatever was negotiated before it.
        let ic = samples(&data)[0];
        assert_eq!(decode(&encode(&ic, &both), &none), Ok(ic));
    }

    #[test]
    fn digests_are_checked() {
        let data: Vec<u8> = (0..=255u8).collect();
        for pda in [0, 7] {
            let p = params(H2C, true, true, pda);
            let pdu = samples(&data)[7];
            let b = encode(&pdu, &p);
            assert_eq!(decode(&b, &p), Ok(pdu));
            let hd = u32::from_le_bytes(b[24..28].try_into().unwrap());
            // A header byte, the header digest, a data byte, the data digest.
            let e = decode(&patched(&b, |b| b[10] ^= 1), &p).unwrap_err();
            assert!(
                matches!(e, PduError::HeaderDigest { received, computed } if received == hd && computed != hd)
            );
            assert_eq!(e.term_status(), Some((fes::HEADER_DIGEST_ERROR, 0)));
            assert!(matches!(
                decode(&patched(&b, |b| b[27] ^= 0x80), &p),
                Err(PduError::HeaderDigest { .. })
            ));
            // The header digest is checked before the rest of the header is trusted.
            assert!(matches!(
                decode(&patched(&b, |b| b[21] = 1), &p),
                Err(PduError::HeaderDigest { .. })
            ));
            let pdo = b[3] as usize;
            let e = decode(&patched(&b, |b| b[pdo + 17] ^= 4), &p).unwrap_err();
            assert!(matches!(e, PduError::DataDigest { .. }));
            assert_eq!(e.term_status(), None);
            let last = b.len() - 1;
            assert!(matches!(
                decode(&patched(&b, |b| b[last] ^= 1), &p),
                Err(PduError::DataDigest { .. })
            ));
        }
        // The data digest covers the data only: padding is checked as padding.
        let p = params(C2H, true, true, 7);
        let b = encode(&samples(&data)[8], &p);
        assert_eq!(b[3], 32);
        assert_eq!(
            decode(&patched(&b, |b| b[29] = 1), &p),
            Err(PduError::Reserved {
                typ: PduType::C2HData,
                offset: 29
            })
        );
    }

    #[test]
    fn pdu_specific_headers_are_checked() {
        let data = [9u8; 40];
        let t = params(H2C, false, false, 0);
        let h = params(C2H, false, false, 0);
        let s = samples(&data);
        let reserved = |b: &[u8], p: &Params, offset: usize| {
            let typ = PduType::from_u8(b[0]).unwrap();
            let e = decode(&patched(b, |b| b[offset] = 0x40), p).unwrap_err();
            assert_eq!(e, PduError::Reserved { typ, offset });
            assert_eq!(
                e.term_status(),
                Some((fes::INVALID_HEADER_FIELD, offset as u32))
            );
        };
        let icreq = encode(&s[0], &t);
        reserved(&icreq, &t, 16);
        reserved(&icreq, &t, 127);
        reserved(&icreq, &t, 11); // digest byte bit 6
        reserved(&encode(&s[1], &h), &h, 100);
        reserved(&encode(&s[2], &t), &t, 14);
        reserved(&encode(&s[3], &h), &h, 23);
        reserved(&encode(&s[7], &t), &t, 20);
        reserved(&encode(&s[8], &h), &h, 10);
        reserved(&encode(&s[8], &h), &h, 23);
        reserved(&encode(&s[10], &h), &h, 21);
        reserved(
            &encode(&s[7], &params(H2C, false, false, 7)),
            &params(H2C, false, false, 7),
            31,
        );
        assert_eq!(
            decode(&patched(&icreq, |b| b[10] = 32), &t),
            Err(PduError::InvalidField {
                typ: PduType::IcReq,
                offset: 10
            })
        );
        let icresp = encode(&s[1], &h);
        for bad in [0u32, 4097] {
            assert_eq!(
                decode(
                    &patched(&icresp, |b| b[12..16].copy_from_slice(&bad.to_le_bytes())),
                    &h
                ),
                Err(PduError::InvalidField {
                    typ: PduType::IcResp,
                    offset: 12
                })
            );
        }
        // DATAL must be the data the PDU carries.
        let h2c = encode(&s[7], &t);
        let e = decode(&patched(&h2c, |b| b[16] = 41), &t).unwrap_err();
        assert_eq!(
            e,
            PduError::BadDataLength {
                typ: PduType::H2CData,
                datal: 41,
                expected: 40
            }
        );
        assert_eq!(e.term_status(), Some((fes::INVALID_HEADER_FIELD, 16)));
        let c2h = encode(&s[8], &h);
        assert!(matches!(
            decode(&patched(&c2h, |b| b[16] = 0), &h),
            Err(PduError::BadDataLength { datal: 0, .. })
        ));
        // A TermReq's data is the offending header, cut to 128 bytes when encoded.
        let long = [1u8; 200];
        let term = Pdu::C2HTermReq(TermReq {
            fes: 1,
            fei: 2,
            data: &long,
        });
        let b = encode(&term, &h);
        assert_eq!(b.len(), TERM_MAX_PLEN);
        assert!(matches!(decode(&b, &h), Ok(Pdu::C2HTermReq(t)) if t.data.len() == 128));
    }

    #[test]
    fn split_buffer_asks_for_exactly_the_missing_bytes() {
        let data = vec![0x77u8; 4096];
        let p = params(H2C, true, true, 0);
        let first = encode(
            &Pdu::CapsuleCmd(CapsuleCmd {
                sqe: sqe(),
                data: &data,
            }),
            &p,
        );
        let second = encode(&samples(&data[..512])[7], &p);
        let len = first.len();
        assert_eq!(len, 72 + 4 + 4096 + 4);
        let mut stream = first.clone();
        stream.extend_from_slice(&second);
        for k in 0..len {
            let need = match pdu_len(&stream[..k], &p) {
                Ok(Progress::Need(n)) => n,
                other => panic!("{k} bytes: {other:?}"),
            };
            let want = if k < CH_LEN { CH_LEN } else { len };
            assert_eq!(need, want, "{k} bytes buffered");
            assert!(need > k);
        }
        assert_eq!(pdu_len(&stream[..len], &p), Ok(Progress::Complete(len)));
        assert_eq!(pdu_len(&stream, &p), Ok(Progress::Complete(len)));
        // The next PDU, cut in its common header and then in its data.
        let rest = &stream[len..];
        assert_eq!(pdu_len(&rest[..5], &p), Ok(Progress::Need(CH_LEN)));
        assert_eq!(pdu_len(&rest[..300], &p), Ok(Progress::Need(second.len())));
        assert_eq!(
            second.len() - 300,
            24 + 4 + 512 + 4 - 300,
            "the bytes missing"
        );
        assert!(matches!(
            decode(rest, &p),
            Ok(Pdu::H2CData(d)) if d.data.len() == 512 && d.ttag == 9
        ));
    }

    #[test]
    fn prefix_for_data_in_place() {
        // A read reply laid out around data read in place: prefix, data, digest.
        let p = params(C2H, true, true, 7);
        let data = [0x42u8; 1000];
        let hdr = C2HData {
            cccid: 4,
            datao: 0,
            last: true,
            success: false,
            data: &[],
        };
        let mut out = Vec::new();
        hdr.encode_prefix(data.len() as u32, &p, &mut out);
        assert_eq!(out.len(), prefix_len(PduType::C2HData, data.len(), &p));
        assert_eq!(out.len(), 32);
        out.extend_from_slice(&data);
        out.extend_from_slice(&data_digest(&data).to_le_bytes());
        assert_eq!(suffix_len(PduType::C2HData, data.len(), &p), 4);
        assert_eq!(
            decode(&out, &p),
            Ok(Pdu::C2HData(C2HData { data: &data, ..hdr }))
        );
        let h2c = H2CData {
            cccid: 4,
            ttag: 1,
            datao: 8,
            last: false,
            data: &[],
        };
        let t = params(H2C, false, false, 0);
        let mut out = Vec::new();
        h2c.encode_prefix(4, &t, &mut out);
        out.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(
            decode(&out, &t),
            Ok(Pdu::H2CData(H2CData {
                data: &[1, 2, 3, 4],
                ..h2c
            }))
        );
        // A bound that fits the largest data PDU with digests and padding.
        let max = p.max_plen_for_data(8192);
        assert_eq!(max as usize, 96 + 8192 + 4);
        assert_eq!(
            Params::initial(H2C, 0).max_plen_for_data(0) as usize,
            TERM_MAX_PLEN
        );
    }

    #[test]
    fn sqe_cqe_and_sgl() {
        let s = sqe();
        let b = s.to_bytes();
        assert_eq!(Sqe::parse(&b), s);
        assert_eq!(s.psdt(), 1);
        assert_eq!(
            s.sgl(),
            Sgl::DataBlock {
                subtype: sgl::SUBTYPE_OFFSET,
                address: 0,
                length: 100
            }
        );
        // Raw bytes survive, reserved ones included.
        let mut odd = b;
        odd[24 + 13] = 0xff;
        assert_eq!(Sqe::parse(&odd).to_bytes(), odd);

        let transport = Sgl::TransportDataBlock {
            subtype: sgl::SUBTYPE_TRANSPORT,
            length: 1 << 20,
        };
        let tb = transport.to_bytes();
        assert_eq!(tb[15], 0x5a);
        assert_eq!(tb[8..12], (1u32 << 20).to_le_bytes());
        assert_eq!(Sgl::parse(&tb), transport);
        assert_eq!(transport.length(), Some(1 << 20));
        let keyed = Sgl::KeyedDataBlock {
            subtype: 0,
            address: 0x1000,
            length: 0x00ab_cdef,
            key: 0x1234_5678,
        };
        let kb = keyed.to_bytes();
        assert_eq!(kb[8..15], [0xef, 0xcd, 0xab, 0x78, 0x56, 0x34, 0x12]);
        assert_eq!(kb[15], 0x40);
        assert_eq!(Sgl::parse(&kb), keyed);
        let seg = Sgl::Other {
            typ: sgl::LAST_SEGMENT,
            subtype: 0,
        };
        assert_eq!(Sgl::parse(&seg.to_bytes()), seg);
        assert_eq!(seg.length(), None);

        let c = cqe();
        let cb = c.to_bytes();
        assert_eq!(cb[12..16], [0xef, 0xbe, 0x04, 0x80]);
        assert_eq!(Cqe::parse(&cb), c);
        assert_eq!((c.sct(), c.sc(), c.dnr(), c.phase()), (0, 2, true, false));
        assert!(!c.is_success());
        let ok = Cqe { status: 1, ..c };
        assert!(ok.is_success() && ok.phase());
        let path = Cqe {
            status: Cqe::status_word(3, 0x71, false),
            ..c
        };
        assert_eq!((path.sct(), path.sc(), path.dnr()), (3, 0x71, false));
    }
}
