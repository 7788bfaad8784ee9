//! NVMe in-band authentication: DH-HMAC-CHAP (NVMe Base Spec 2.0 §8.13, TP 8006), as the
//! Linux kernel implements it, so the kernel's nvme-tcp host can authenticate to blkwire's
//! NVMe/TCP frontend.
//!
//! - [`Secret`]: the `DHHC-1:XX:BASE64:` secret representation (§8.13.5.8) and the key
//!   transformation (`nvme_auth_transform_key`, drivers/nvme/common/auth.c).
//! - [`Message`]: the AUTH_Send / AUTH_Receive payloads, byte for byte as the
//!   `nvmf_auth_dhchap_*` structures of include/linux/nvme.h (all little-endian).
//! - [`ControllerAuth`]: the controller's side of one queue's exchange, following
//!   drivers/nvme/target/fabrics-cmd-auth.c (`nvmet_execute_auth_send`/`_receive`).
//! - [`HostAuth`]: the host's side (drivers/nvme/host/auth.c), for tests and test clients.
//!
//! The exchange on every queue whose Connect completion set [`CONNECT_AUTHREQ_ATR`]:
//!
//! ```text
//! host                                   controller
//! AUTH_Send    Negotiate (T_ID, hash ids, DH group ids)
//! AUTH_Receive                           Challenge (hash, group, S1, C1, DH value g^y)
//! AUTH_Send    Reply (R1, C2?, S2, DH value g^x)
//! AUTH_Receive                           Success1 (R2 if C2 was sent) | Failure1
//! AUTH_Send    Success2 (only if the host sent C2) | Failure2
//! ```
//!
//! R1 = HMAC(Kh', Ca1 || S1 || T_ID || 0 || "HostHost" || NQNh || 0 || NQNc) and
//! R2 = HMAC(Kc', Ca2 || S2 || T_ID || 0 || "Controller" || NQNc || 0 || NQNh), where K' is a
//! secret after its transformation and Ca = HMAC(H(g^xy), C) when a DH group is used, C itself
//! with the null group (§8.13.5.2-§8.13.5.5). Cryptography is ring's (HMAC, SHA-2) and
//! OpenSSL's (finite-field Diffie-Hellman); only the encodings are written here.

use std::cmp::Ordering;
use std::fmt;

use openssl::bn::BigNum;
use openssl::derive::Deriver;
use openssl::dh::Dh;
use openssl::pkey::{PKey, Params, Private};
use ring::{digest, hmac};

mod ffdhe;

/// Security Protocol (SECP) of AUTH_Send / AUTH_Receive for DH-HMAC-CHAP
/// (`NVME_AUTH_DHCHAP_PROTOCOL_IDENTIFIER`).
pub const SECP: u8 = 0xe9;
/// SP Specific 0 and 1 (SPSP0, SPSP1) the kernel host sends and nvmet requires.
pub const SPSP: u8 = 0x01;
/// Fabrics command type of AUTH_Send (host to controller data).
pub const FCTYPE_AUTH_SEND: u8 = 0x05;
/// Fabrics command type of AUTH_Receive (controller to host data).
pub const FCTYPE_AUTH_RECEIVE: u8 = 0x06;
/// Connect completion dword 0 bit "Authentication Required" (`NVME_CONNECT_AUTHREQ_ATR`): the
/// kernel host (`nvmf_connect_admin_queue`, `nvmf_connect_io_queue`) starts DH-HMAC-CHAP on
/// that queue when it is set. Dword 0 also carries the controller id in bits 15:0.
pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
/// Connect completion dword 0 bit "Authentication and Secure Channel Required"
/// (`NVME_CONNECT_AUTHREQ_ASCR`); never set here (no TLS concatenation).
pub const CONNECT_AUTHREQ_ASCR: u32 = 1 << 18;
/// Status (kernel encoding: SCT << 8 | SC, DNR = 0x4000) for any command other than Connect,
/// AUTH_Send and AUTH_Receive on a queue not yet authenticated: Authentication Required with
/// Do Not Retry (`NVME_SC_AUTH_REQUIRED | NVME_STATUS_DNR`, nvmet_parse_admin_cmd and
/// nvmet_parse_io_cmd).
pub const SC_AUTH_REQUIRED_DNR: u16 = 0x4191;
/// Status for a Connect from a host NQN the target has no secret for: Connect Invalid Host with
/// Do Not Retry (`NVME_SC_CONNECT_INVALID_HOST | NVME_STATUS_DNR`, what nvmet answers a host
/// that is not allowed). Such a host never reaches [`ControllerAuth`].
pub const SC_CONNECT_INVALID_HOST_DNR: u16 = 0x4184;
/// Status for an AUTH_Send / AUTH_Receive whose SECP, SPSP0, SPSP1 or length is wrong: Invalid
/// Field in Command with Do Not Retry (`NVME_SC_INVALID_FIELD | NVME_STATUS_DNR`).
pub const SC_INVALID_FIELD_DNR: u16 = 0x4002;

/// `auth_type` of messages common to all protocols (Negotiate, Failure1, Failure2).
pub const AUTH_TYPE_COMMON: u8 = 0x00;
/// `auth_type` of DH-HMAC-CHAP messages (Challenge, Reply, Success1, Success2).
pub const AUTH_TYPE_DHCHAP: u8 = 0x01;
/// `auth_id` of AUTH_Negotiate.
pub const MSG_NEGOTIATE: u8 = 0x00;
/// `auth_id` of DH-HMAC-CHAP_Challenge.
pub const MSG_CHALLENGE: u8 = 0x01;
/// `auth_id` of DH-HMAC-CHAP_Reply.
pub const MSG_REPLY: u8 = 0x02;
/// `auth_id` of DH-HMAC-CHAP_Success1.
pub const MSG_SUCCESS1: u8 = 0x03;
/// `auth_id` of DH-HMAC-CHAP_Success2.
pub const MSG_SUCCESS2: u8 = 0x04;
/// `auth_id` of AUTH_Failure2 (host to controller).
pub const MSG_FAILURE2: u8 = 0xf0;
/// `auth_id` of AUTH_Failure1 (controller to host).
pub const MSG_FAILURE1: u8 = 0xf1;
/// Authentication protocol id of DH-HMAC-CHAP in a Negotiate descriptor.
pub const AUTH_ID_DHCHAP: u8 = 0x01;
/// `sc_c` value "no secure channel concatenation" (`NVME_AUTH_SECP_NOSC`).
pub const SC_C_NONE: u8 = 0x00;
/// Failure reason code "authentication failure" (`NVME_AUTH_DHCHAP_FAILURE_REASON_FAILED`),
/// the only one defined; the explanation ([`Reason`]) says why.
pub const RESCODE_FAILED: u8 = 0x01;

/// Bytes of a Negotiate header before its protocol descriptors.
pub const NEGOTIATE_HEADER: usize = 8;
/// Bytes of one protocol descriptor (authid, rsvd, halen, dhlen, then 60 bytes of idlist).
pub const DESCRIPTOR_LEN: usize = 64;
/// Bytes of the fixed part of Challenge, Reply, Success1 and Success2.
pub const FIXED_LEN: usize = 16;
/// Bytes of a Failure1 / Failure2 message.
pub const FAILURE_LEN: usize = 8;
/// Most hash ids one descriptor lists (`NVME_AUTH_DHCHAP_MAX_HASH_IDS`); DH group ids start at
/// this offset of `idlist`.
pub const MAX_HASH_IDS: usize = 30;
/// Most DH group ids one descriptor lists (`NVME_AUTH_DHCHAP_MAX_DH_IDS`).
pub const MAX_DH_IDS: usize = 30;

/// Hash functions of DH-HMAC-CHAP (`NVME_AUTH_HASH_*`), which also name a secret's
/// transformation in `DHHC-1:XX:`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashId {
    /// HMAC-SHA-256 (id 1).
    Sha256 = 1,
    /// HMAC-SHA-384 (id 2).
    Sha384 = 2,
    /// HMAC-SHA-512 (id 3).
    Sha512 = 3,
}

impl HashId {
    /// The hash function with NVMe id `id`, if it is one.
    pub fn from_id(id: u8) -> Option<HashId> {
        match id {
            1 => Some(HashId::Sha256),
            2 => Some(HashId::Sha384),
            3 => Some(HashId::Sha512),
            _ => None,
        }
    }

    /// Its NVMe id.
    pub fn id(self) -> u8 {
        self as u8
    }

    /// Digest length in bytes: the `hl` of every message and the length of C and R.
    pub fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }

    /// The kernel's name of its HMAC (`hmac(sha256)`...).
    pub fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "hmac(sha256)",
            HashId::Sha384 => "hmac(sha384)",
            HashId::Sha512 => "hmac(sha512)",
        }
    }

    fn hmac_alg(self) -> hmac::Algorithm {
        match self {
            HashId::Sha256 => hmac::HMAC_SHA256,
            HashId::Sha384 => hmac::HMAC_SHA384,
            HashId::Sha512 => hmac::HMAC_SHA512,
        }
    }

    fn digest_alg(self) -> &'static digest::Algorithm {
        match self {
            HashId::Sha256 => &digest::SHA256,
            HashId::Sha384 => &digest::SHA384,
            HashId::Sha512 => &digest::SHA512,
        }
    }
}

/// Diffie-Hellman groups of DH-HMAC-CHAP (`NVME_AUTH_DHGROUP_*`, RFC 7919 groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DhGroup {
    /// No Diffie-Hellman exchange (id 0): plain CHAP on the challenges.
    Null = 0,
    /// ffdhe2048 (id 1).
    Ffdhe2048 = 1,
    /// ffdhe3072 (id 2).
    Ffdhe3072 = 2,
    /// ffdhe4096 (id 3).
    Ffdhe4096 = 3,
    /// ffdhe6144 (id 4).
    Ffdhe6144 = 4,
    /// ffdhe8192 (id 5).
    Ffdhe8192 = 5,
}

impl DhGroup {
    /// The group with NVMe id `id`, if it is one.
    pub fn from_id(id: u8) -> Option<DhGroup> {
        match id {
            0 => Some(DhGroup::Null),
            1 => Some(DhGroup::Ffdhe2048),
            2 => Some(DhGroup::Ffdhe3072),
            3 => Some(DhGroup::Ffdhe4096),
            4 => Some(DhGroup::Ffdhe6144),
            5 => Some(DhGroup::Ffdhe8192),
            _ => None,
        }
    }

    /// Its NVMe id.
    pub fn id(self) -> u8 {
        self as u8
    }

    /// The kernel's name of the group (`null`, `ffdhe2048`...).
    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Bytes of a DH value (`dhvlen`): the prime's size, as the kernel's `crypto_kpp_maxsize`;
    /// 0 for the null group.
    pub fn value_len(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    fn prime_hex(self) -> Option<&'static str> {
        match self {
            DhGroup::Null => None,
            DhGroup::Ffdhe2048 => Some(ffdhe::FFDHE2048),
            DhGroup::Ffdhe3072 => Some(ffdhe::FFDHE3072),
            DhGroup::Ffdhe4096 => Some(ffdhe::FFDHE4096),
            DhGroup::Ffdhe6144 => Some(ffdhe::FFDHE6144),
            DhGroup::Ffdhe8192 => Some(ffdhe::FFDHE8192),
        }
    }
}

/// Failure reason code explanations (`rescode_exp`, `NVME_AUTH_DHCHAP_FAILURE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Authentication failed: a wrong response, no key (`FAILURE_FAILED`, 1).
    Failed,
    /// Authentication protocol not usable (`FAILURE_NOT_USABLE`, 2).
    NotUsable,
    /// Secure channel concatenation mismatch (`FAILURE_CONCAT_MISMATCH`, 3).
    ConcatMismatch,
    /// No hash function both ends can use (`FAILURE_HASH_UNUSABLE`, 4).
    HashUnusable,
    /// No DH group both ends can use, or a DH value that is not one
    /// (`FAILURE_DHGROUP_UNUSABLE`, 5).
    DhGroupUnusable,
    /// A message's fields are inconsistent or it is too short (`FAILURE_INCORRECT_PAYLOAD`, 6).
    IncorrectPayload,
    /// A message that does not belong at this step (`FAILURE_INCORRECT_MESSAGE`, 7).
    IncorrectMessage,
    /// A value no version of the specification defines (only ever read from a peer).
    Other(u8),
}

impl Reason {
    /// The reason a `rescode_exp` byte stands for.
    pub fn from_code(code: u8) -> Reason {
        match code {
            1 => Reason::Failed,
            2 => Reason::NotUsable,
            3 => Reason::ConcatMismatch,
            4 => Reason::HashUnusable,
            5 => Reason::DhGroupUnusable,
            6 => Reason::IncorrectPayload,
            7 => Reason::IncorrectMessage,
            c => Reason::Other(c),
        }
    }

    /// Its `rescode_exp` byte.
    pub fn code(self) -> u8 {
        match self {
            Reason::Failed => 1,
            Reason::NotUsable => 2,
            Reason::ConcatMismatch => 3,
            Reason::HashUnusable => 4,
            Reason::DhGroupUnusable => 5,
            Reason::IncorrectPayload => 6,
            Reason::IncorrectMessage => 7,
            Reason::Other(c) => c,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Failed => write!(f, "authentication failed"),
            Reason::NotUsable => write!(f, "authentication protocol not usable"),
            Reason::ConcatMismatch => write!(f, "secure channel concatenation mismatch"),
            Reason::HashUnusable => write!(f, "hash function not usable"),
            Reason::DhGroupUnusable => write!(f, "DH group not usable"),
            Reason::IncorrectPayload => write!(f, "incorrect payload"),
            Reason::IncorrectMessage => write!(f, "incorrect protocol message"),
            Reason::Other(c) => write!(f, "failure explanation {c:#04x}"),
        }
    }
}

/// Why an exchange failed: the explanation sent in (or read from) a Failure1 / Failure2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The reason code explanation.
    pub reason: Reason,
}

impl Failure {
    fn new(reason: Reason) -> Failure {
        Failure { reason }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DH-HMAC-CHAP: {}", self.reason)
    }
}

impl std::error::Error for Failure {}

/// Bytes wiped when dropped (keys, transformed keys, DH shared secrets).
struct Wiped(Vec<u8>);

impl Drop for Wiped {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference into our own buffer.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Secrets

/// A DH-HMAC-CHAP secret: 32, 48 or 64 key bytes and the hash that transforms it before use
/// (NVMe Base Spec 2.0 §8.13.5.8; `nvme_auth_extract_key`). Its bytes are wiped when dropped
/// and never printed.
#[derive(Clone)]
pub struct Secret {
    key: Wiped,
    transform: Option<HashId>,
}

impl Clone for Wiped {
    fn clone(&self) -> Wiped {
        Wiped(self.0.clone())
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.transform == other.transform
            && self.key.0.len() == other.key.0.len()
            && openssl::memcmp::eq(&self.key.0, &other.key.0)
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Secret({} bytes, transformation {})",
            self.key.0.len(),
            self.transform.map_or("none", |h| h.name())
        )
    }
}

impl Secret {
    /// A secret from raw key bytes without transformation (`DHHC-1:00:`): 32, 48 or 64 of
    /// them, the lengths the kernel and `nvme connect --dhchap-secret` accept.
    pub fn from_bytes(key: &[u8]) -> Result<Secret, String> {
        if ![32, 48, 64].contains(&key.len()) {
            return Err(format!(
                "a DH-HMAC-CHAP secret is 32, 48 or 64 bytes, not {}",
                key.len()
            ));
        }
        Ok(Secret {
            key: Wiped(key.to_vec()),
            transform: None,
        })
    }

    /// A blkwire key (16 to 64 bytes) used as a DH-HMAC-CHAP secret without transformation,
    /// for a hex key file line. The controller side works with any length; a host can only
    /// be given one of 32, 48 or 64 bytes ([`Secret::to_dhhc`]).
    pub fn from_key(key: &crate::Key) -> Secret {
        Secret {
            key: Wiped(key.bytes().to_vec()),
            transform: None,
        }
    }

    /// A fresh random 32-byte secret without transformation (what `nvme gen-dhchap-key`
    /// makes by default).
    pub fn generate() -> Secret {
        let mut b = Wiped(vec![0u8; 32]);
        crate::random(&mut b.0);
        Secret {
            key: b,
            transform: None,
        }
    }

    /// Parses `DHHC-1:XX:BASE64:` (the trailing `:` may be left out, as the kernel allows):
    /// XX is the transformation (00 none, 01 SHA-256, 02 SHA-384, 03 SHA-512) and BASE64 the
    /// key (32, 48 or 64 bytes) followed by the little-endian zlib CRC-32 of the key
    /// (`nvme_auth_parse_key`, `nvme_auth_extract_key`). Errors are one line saying what is
    /// wrong, never quoting the key.
    pub fn parse(text: &str) -> Result<Secret, String> {
        let rest = text.strip_prefix("DHHC-1:").ok_or(
            "a DH-HMAC-CHAP secret starts with DHHC-1: (as `nvme gen-dhchap-key` prints it)",
        )?;
        let (xx, b64) = rest
            .split_once(':')
            .ok_or("a DH-HMAC-CHAP secret is DHHC-1:XX:BASE64: (no ':' after XX)")?;
        let transform = match xx {
            "00" => None,
            "01" => Some(HashId::Sha256),
            "02" => Some(HashId::Sha384),
            "03" => Some(HashId::Sha512),
            // Quoted only when it is short enough to be a mistyped XX: with XX: left out,
            // this part is the key itself (`DHHC-1:BASE64:`).
            _ if xx.len() <= 2 => {
                return Err(format!(
                    "DH-HMAC-CHAP secret transformation '{}' is not 00 (none), 01 (SHA-256), \
                     02 (SHA-384) or 03 (SHA-512)",
                    xx.escape_debug()
                ))
            }
            _ => {
                return Err(
                    "a DH-HMAC-CHAP secret is DHHC-1:XX:BASE64: and what follows \
                            DHHC-1: is not a two-digit transformation XX (00, 01, 02 or 03): \
                            is XX: missing?"
                        .into(),
                )
            }
        };
        let b64 = b64.strip_suffix(':').unwrap_or(b64);
        let raw = Wiped(base64_decode(b64).ok_or(
            "the DH-HMAC-CHAP secret's key part is not base64 (A-Z a-z 0-9 + / with = padding)",
        )?);
        let key_len = match raw.0.len() {
            36 => 32,
            52 => 48,
            68 => 64,
            n => {
                return Err(format!(
                    "the DH-HMAC-CHAP secret decodes to {n} bytes: it must be a 32, 48 or 64 \
                     byte key and its 4-byte CRC (36, 52 or 68 bytes)"
                ))
            }
        };
        let (key, crc) = raw.0.split_at(key_len);
        if crc32(key).to_le_bytes() != crc {
            return Err(
                "the DH-HMAC-CHAP secret's CRC-32 does not match its key (a character \
                        is wrong or missing)"
                    .into(),
            );
        }
        Ok(Secret {
            key: Wiped(key.to_vec()),
            transform,
        })
    }

    /// The `DHHC-1:XX:BASE64:` representation (for `nvme connect --dhchap-secret`), or why
    /// there is none the kernel accepts (a key of other than 32, 48 or 64 bytes, from a hex
    /// key file line).
    pub fn to_dhhc(&self) -> Result<String, String> {
        if ![32, 48, 64].contains(&self.key.0.len()) {
            return Err(format!(
                "a {}-byte key has no DH-HMAC-CHAP representation (it takes 32, 48 or 64 \
                 bytes; `blkwire key gen` makes 32)",
                self.key.0.len()
            ));
        }
        let mut raw = Wiped(self.key.0.clone());
        let crc = crc32(&raw.0).to_le_bytes();
        raw.0.extend_from_slice(&crc);
        Ok(format!(
            "DHHC-1:{:02}:{}:",
            self.transform.map_or(0, HashId::id),
            base64_encode(&raw.0)
        ))
    }

    /// The key bytes (before transformation).
    pub fn bytes(&self) -> &[u8] {
        &self.key.0
    }

    /// The transformation hash (`XX` of the representation), None for `00`.
    pub fn transformation(&self) -> Option<HashId> {
        self.transform
    }

    /// The key after transformation for `nqn` (`nvme_auth_transform_key`): the key itself
    /// without transformation, else HMAC(key, NQN || "NVMe-over-Fabrics") with the
    /// transformation's hash. The host's secret is transformed with the host NQN, the
    /// controller's with the subsystem NQN.
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.0.clone(),
            Some(h) => mac(h, &self.key.0, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

/// zlib / IEEE 802.3 CRC-32 (reflected, polynomial 0xEDB88320, initial and final inversion),
/// the kernel's `~crc32(~0, key, len)`. A checksum, not cryptography: it only catches typos.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with `=` padding (RFC 4648 §4), as `nvme gen-dhchap-key` writes it.
fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Strict standard base64: length a multiple of 4, `=` only as the last one or two
/// characters, unused trailing bits zero (so every key has exactly one representation).
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let s = text.as_bytes();
    if s.is_empty() || !s.len().is_multiple_of(4) {
        return None;
    }
    let pad = s.iter().rev().take_while(|&&c| c == b'=').count();
    if pad > 2 {
        return None;
    }
    let data = s.len() - pad;
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (i, quad) in s.chunks(4).enumerate() {
        let last = i == s.len() / 4 - 1;
        let mut n = 0u32;
        for (j, &c) in quad.iter().enumerate() {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                // '=' only in the trailing padding.
                b'=' if i * 4 + j >= data => 0,
                _ => return None,
            };
            n = n << 6 | u32::from(v);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        let keep = if last { 3 - pad } else { 3 };
        if bytes[keep..].iter().any(|&b| b != 0) {
            return None;
        }
        out.extend_from_slice(&bytes[..keep]);
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Messages

/// Why bytes are not a DH-HMAC-CHAP message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the message's fields say it has.
    Truncated {
        /// Bytes the message needs.
        need: usize,
        /// Bytes there are.
        have: usize,
    },
    /// An `auth_type` / `auth_id` pair that names no message.
    Unknown {
        /// The `auth_type` byte.
        auth_type: u8,
        /// The `auth_id` byte.
        auth_id: u8,
    },
    /// A descriptor listing more ids than it has room for.
    TooManyIds,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated { need, have } => {
                write!(f, "DH-HMAC-CHAP message of {have} bytes needs {need}")
            }
            DecodeError::Unknown { auth_type, auth_id } => write!(
                f,
                "no DH-HMAC-CHAP message has auth_type {auth_type:#04x} auth_id {auth_id:#04x}"
            ),
            DecodeError::TooManyIds => write!(
                f,
                "a Negotiate descriptor lists more than 30 hash or DH group ids"
            ),
        }
    }
}

impl std::error::Error for DecodeError {}

/// One protocol descriptor of AUTH_Negotiate (`nvmf_auth_dhchap_protocol_descriptor`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// Authentication protocol id ([`AUTH_ID_DHCHAP`]).
    pub auth_id: u8,
    /// Hash function ids, at most [`MAX_HASH_IDS`] (`idlist[0..halen]`).
    pub hash_ids: Vec<u8>,
    /// DH group ids, at most [`MAX_DH_IDS`] (`idlist[30..30 + dhlen]`).
    pub dh_group_ids: Vec<u8>,
}

/// AUTH_Negotiate (`nvmf_auth_dhchap_negotiate_data`, §8.13.5.2 Figure "AUTH_Negotiate").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiate {
    /// Transaction id of this exchange.
    pub t_id: u16,
    /// Secure channel concatenation (`sc_c`); [`SC_C_NONE`] is all this module supports.
    pub sc_c: u8,
    /// Protocol descriptors (`napd` of them).
    pub protocols: Vec<Protocol>,
}

/// DH-HMAC-CHAP_Challenge (`nvmf_auth_dhchap_challenge_data`, §8.13.5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Transaction id.
    pub t_id: u16,
    /// Hash function id chosen by the controller.
    pub hash_id: u8,
    /// DH group id chosen by the controller.
    pub dh_group_id: u8,
    /// Sequence number S1.
    pub seqnum: u32,
    /// Challenge C1 (`hl` bytes).
    pub challenge: Vec<u8>,
    /// The controller's DH value g^y mod p (`dhvlen` bytes, big-endian), empty for null.
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Reply (`nvmf_auth_dhchap_reply_data`, §8.13.5.4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Transaction id.
    pub t_id: u16,
    /// Whether `challenge` holds a challenge C2 (`cvalid`).
    pub cvalid: bool,
    /// Sequence number S2 (0: no controller authentication).
    pub seqnum: u32,
    /// Response R1 (`hl` bytes).
    pub response: Vec<u8>,
    /// Challenge C2 (`hl` bytes; zeros when `cvalid` is clear, as the kernel sends it).
    pub challenge: Vec<u8>,
    /// The host's DH value g^x mod p (`dhvlen` bytes), empty for null.
    pub dh_value: Vec<u8>,
}

/// DH-HMAC-CHAP_Success1 (`nvmf_auth_dhchap_success1_data`, §8.13.5.5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Success1 {
    /// Transaction id.
    pub t_id: u16,
    /// Hash length `hl`.
    pub hl: u8,
    /// Response R2 when `rvalid` is set.
    pub response: Option<Vec<u8>>,
}

/// AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to controller)
/// (`nvmf_auth_dhchap_failure_data`, §8.13.5.7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureMsg {
    /// Transaction id.
    pub t_id: u16,
    /// Reason code ([`RESCODE_FAILED`]).
    pub rescode: u8,
    /// Reason code explanation.
    pub reason: Reason,
}

/// A DH-HMAC-CHAP message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// AUTH_Negotiate.
    Negotiate(Negotiate),
    /// DH-HMAC-CHAP_Challenge.
    Challenge(Challenge),
    /// DH-HMAC-CHAP_Reply.
    Reply(Reply),
    /// DH-HMAC-CHAP_Success1.
    Success1(Success1),
    /// DH-HMAC-CHAP_Success2 (`nvmf_auth_dhchap_success2_data`) with its transaction id.
    Success2 {
        /// Transaction id.
        t_id: u16,
    },
    /// AUTH_Failure1.
    Failure1(FailureMsg),
    /// AUTH_Failure2.
    Failure2(FailureMsg),
}

fn need(b: &[u8], n: usize) -> Result<(), DecodeError> {
    if b.len() < n {
        Err(DecodeError::Truncated {
            need: n,
            have: b.len(),
        })
    } else {
        Ok(())
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn header(out: &mut Vec<u8>, auth_type: u8, auth_id: u8, t_id: u16) {
    out.extend_from_slice(&[auth_type, auth_id, 0, 0]);
    out.extend_from_slice(&t_id.to_le_bytes());
}

impl Message {
    /// The transaction id every message carries (bytes 4-5).
    pub fn t_id(&self) -> u16 {
        match self {
            Message::Negotiate(m) => m.t_id,
            Message::Challenge(m) => m.t_id,
            Message::Reply(m) => m.t_id,
            Message::Success1(m) => m.t_id,
            Message::Success2 { t_id } => *t_id,
            Message::Failure1(m) | Message::Failure2(m) => m.t_id,
        }
    }

    /// Decodes a message. Bytes after it are ignored (nvmet reads a message from a
    /// transfer of any length that holds it, and the kernel host's AUTH_Receive buffer is
    /// 4096 bytes of which the message is a prefix). Never panics; allocates at most the
    /// input's length.
    pub fn decode(b: &[u8]) -> Result<Message, DecodeError> {
        need(b, 6)?;
        let (auth_type, auth_id, t_id) = (b[0], b[1], le16(b, 4));
        match (auth_type, auth_id) {
            (AUTH_TYPE_COMMON, MSG_NEGOTIATE) => {
                need(b, NEGOTIATE_HEADER)?;
                let napd = usize::from(b[7]);
                need(b, NEGOTIATE_HEADER + napd * DESCRIPTOR_LEN)?;
                let mut protocols = Vec::with_capacity(napd);
                for i in 0..napd {
                    let d = &b[NEGOTIATE_HEADER + i * DESCRIPTOR_LEN..][..DESCRIPTOR_LEN];
                    let (halen, dhlen) = (usize::from(d[2]), usize::from(d[3]));
                    if halen > MAX_HASH_IDS || dhlen > MAX_DH_IDS {
                        return Err(DecodeError::TooManyIds);
                    }
                    protocols.push(Protocol {
                        auth_id: d[0],
                        hash_ids: d[4..4 + halen].to_vec(),
                        dh_group_ids: d[4 + MAX_HASH_IDS..4 + MAX_HASH_IDS + dhlen].to_vec(),
                    });
                }
                Ok(Message::Negotiate(Negotiate {
                    t_id,
                    sc_c: b[6],
                    protocols,
                }))
            }
            (AUTH_TYPE_DHCHAP, MSG_CHALLENGE) => {
                need(b, FIXED_LEN)?;
                let hl = usize::from(b[6]);
                let dhvlen = usize::from(le16(b, 10));
                need(b, FIXED_LEN + hl + dhvlen)?;
                Ok(Message::Challenge(Challenge {
                    t_id,
                    hash_id: b[8],
                    dh_group_id: b[9],
                    seqnum: le32(b, 12),
                    challenge: b[FIXED_LEN..FIXED_LEN + hl].to_vec(),
                    dh_value: b[FIXED_LEN + hl..FIXED_LEN + hl + dhvlen].to_vec(),
                }))
            }
            (AUTH_TYPE_DHCHAP, MSG_REPLY) => {
                need(b, FIXED_LEN)?;
                let hl = usize::from(b[6]);
                let dhvlen = usize::from(le16(b, 10));
                need(b, FIXED_LEN + 2 * hl + dhvlen)?;
                let at = FIXED_LEN;
                Ok(Message::Reply(Reply {
                    t_id,
                    cvalid: b[8] != 0,
                    seqnum: le32(b, 12),
                    response: b[at..at + hl].to_vec(),
                    challenge: b[at + hl..at + 2 * hl].to_vec(),
                    dh_value: b[at + 2 * hl..at + 2 * hl + dhvlen].to_vec(),
                }))
            }
            (AUTH_TYPE_DHCHAP, MSG_SUCCESS1) => {
                need(b, FIXED_LEN)?;
                let hl = b[6];
                let response = if b[8] != 0 {
                    need(b, FIXED_LEN + usize::from(hl))?;
                    Some(b[FIXED_LEN..FIXED_LEN + usize::from(hl)].to_vec())
                } else {
                    None
                };
                Ok(Message::Success1(Success1 { t_id, hl, response }))
            }
            (AUTH_TYPE_DHCHAP, MSG_SUCCESS2) => {
                need(b, FIXED_LEN)?;
                Ok(Message::Success2 { t_id })
            }
            (AUTH_TYPE_COMMON, MSG_FAILURE1 | MSG_FAILURE2) => {
                need(b, FAILURE_LEN)?;
                let m = FailureMsg {
                    t_id,
                    rescode: b[6],
                    reason: Reason::from_code(b[7]),
                };
                Ok(if auth_id == MSG_FAILURE1 {
                    Message::Failure1(m)
                } else {
                    Message::Failure2(m)
                })
            }
            _ => Err(DecodeError::Unknown { auth_type, auth_id }),
        }
    }

    /// Encodes the message. Lengths that do not fit their fields (more than 255 challenge
    /// bytes, 65535 DH bytes, 30 ids or 255 descriptors) are cut to what fits, so the result
    /// always decodes; messages built by this module never need that.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Message::Negotiate(m) => {
                header(&mut out, AUTH_TYPE_COMMON, MSG_NEGOTIATE, m.t_id);
                let napd = m.protocols.len().min(255);
                out.extend_from_slice(&[m.sc_c, napd as u8]);
                for p in &m.protocols[..napd] {
                    let h = &p.hash_ids[..p.hash_ids.len().min(MAX_HASH_IDS)];
                    let d = &p.dh_group_ids[..p.dh_group_ids.len().min(MAX_DH_IDS)];
                    let mut desc = [0u8; DESCRIPTOR_LEN];
                    desc[0] = p.auth_id;
                    desc[2] = h.len() as u8;
                    desc[3] = d.len() as u8;
                    desc[4..4 + h.len()].copy_from_slice(h);
                    desc[4 + MAX_HASH_IDS..4 + MAX_HASH_IDS + d.len()].copy_from_slice(d);
                    out.extend_from_slice(&desc);
                }
            }
            Message::Challenge(m) => {
                header(&mut out, AUTH_TYPE_DHCHAP, MSG_CHALLENGE, m.t_id);
                let c = &m.challenge[..m.challenge.len().min(255)];
                let dh = &m.dh_value[..m.dh_value.len().min(65535)];
                out.extend_from_slice(&[c.len() as u8, 0, m.hash_id, m.dh_group_id]);
                out.extend_from_slice(&(dh.len() as u16).to_le_bytes());
                out.extend_from_slice(&m.seqnum.to_le_bytes());
                out.extend_from_slice(c);
                out.extend_from_slice(dh);
            }
            Message::Reply(m) => {
                header(&mut out, AUTH_TYPE_DHCHAP, MSG_REPLY, m.t_id);
                let hl = m.response.len().min(255);
                let dh = &m.dh_value[..m.dh_value.len().min(65535)];
                out.extend_from_slice(&[hl as u8, 0, u8::from(m.cvalid), 0]);
                out.extend_from_slice(&(dh.len() as u16).to_le_bytes());
                out.extend_from_slice(&m.seqnum.to_le_bytes());
                out.extend_from_slice(&m.response[..hl]);
                // C2 always takes hl bytes (zeros when absent), as the kernel host sends it.
                let c2 = &m.challenge[..m.challenge.len().min(hl)];
                out.extend_from_slice(c2);
                out.resize(out.len() + hl - c2.len(), 0);
                out.extend_from_slice(dh);
            }
            Message::Success1(m) => {
                header(&mut out, AUTH_TYPE_DHCHAP, MSG_SUCCESS1, m.t_id);
                let r = m.response.as_ref().map(|r| &r[..r.len().min(255)]);
                let hl = r.map_or(m.hl, |r| r.len() as u8);
                out.extend_from_slice(&[hl, 0, u8::from(r.is_some())]);
                out.resize(FIXED_LEN, 0);
                if let Some(r) = r {
                    out.extend_from_slice(r);
                }
            }
            Message::Success2 { t_id } => {
                header(&mut out, AUTH_TYPE_DHCHAP, MSG_SUCCESS2, *t_id);
                out.resize(FIXED_LEN, 0);
            }
            Message::Failure1(m) | Message::Failure2(m) => {
                let id = if matches!(self, Message::Failure1(_)) {
                    MSG_FAILURE1
                } else {
                    MSG_FAILURE2
                };
                header(&mut out, AUTH_TYPE_COMMON, id, m.t_id);
                out.extend_from_slice(&[m.rescode, m.reason.code()]);
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Cryptographic steps

fn mac(hash: HashId, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let k = hmac::Key::new(hash.hmac_alg(), key);
    let mut ctx = hmac::Context::with_key(&k);
    for p in parts {
        ctx.update(p);
    }
    ctx.sign().as_ref().to_vec()
}

/// The augmented challenge Ca = HMAC(H(g^xy mod p), C) (§8.13.5.4;
/// `nvme_auth_augmented_challenge`): the key is the hash of the shared secret, padded with
/// leading zeros to the prime's size as the kernel's kpp writes it.
pub fn augmented_challenge(hash: HashId, shared_secret: &[u8], challenge: &[u8]) -> Vec<u8> {
    let hashed = Wiped(
        digest::digest(hash.digest_alg(), shared_secret)
            .as_ref()
            .to_vec(),
    );
    mac(hash, &hashed.0, &[challenge])
}

/// The host's response R1 = HMAC(Kh', C || le32(S1) || le16(T_ID) || 0x00 || "HostHost" ||
/// NQNh || 0x00 || NQNc) (§8.13.5.4; `nvme_auth_dhchap_setup_host_response`,
/// `nvmet_auth_host_hash`). `transformed_key` is the host secret after
/// [`Secret::transformed`] with the host NQN; `challenge` is C1, or Ca1 with a DH group.
pub fn host_response(
    hash: HashId,
    transformed_key: &[u8],
    challenge: &[u8],
    seqnum: u32,
    t_id: u16,
    host_nqn: &str,
    subsys_nqn: &str,
) -> Vec<u8> {
    mac(
        hash,
        transformed_key,
        &[
            challenge,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[0],
            b"HostHost",
            host_nqn.as_bytes(),
            &[0],
            subsys_nqn.as_bytes(),
        ],
    )
}

/// The controller's response R2 = HMAC(Kc', C || le32(S2) || le16(T_ID) || 0x00 ||
/// "Controller" || NQNc || 0x00 || NQNh) (§8.13.5.5; `nvme_auth_dhchap_setup_ctrl_response`,
/// `nvmet_auth_ctrl_hash`). `transformed_key` is the controller secret transformed with the
/// subsystem NQN; `challenge` is C2, or Ca2 with a DH group.
pub fn controller_response(
    hash: HashId,
    transformed_key: &[u8],
    challenge: &[u8],
    seqnum: u32,
    t_id: u16,
    host_nqn: &str,
    subsys_nqn: &str,
) -> Vec<u8> {
    mac(
        hash,
        transformed_key,
        &[
            challenge,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[0],
            b"Controller",
            subsys_nqn.as_bytes(),
            &[0],
            host_nqn.as_bytes(),
        ],
    )
}

/// Constant-time equality of two responses (different lengths are simply unequal).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && openssl::memcmp::eq(a, b)
}

/// One end's ephemeral Diffie-Hellman key in an RFC 7919 group.
struct DhKey {
    group: DhGroup,
    key: PKey<Private>,
    public: Vec<u8>,
}

/// The group's domain parameters (p, g = 2). OpenSSL recognises the RFC 7919 primes and
/// attaches their q and private exponent length, as the kernel's `dh_safe_prime` does.
fn dh_params(group: DhGroup) -> Option<Dh<Params>> {
    let p = BigNum::from_hex_str(group.prime_hex()?).ok()?;
    Dh::from_pqg(p, None, BigNum::from_u32(2).ok()?).ok()
}

impl DhKey {
    /// A fresh key pair.
    fn generate(group: DhGroup) -> Option<DhKey> {
        let dh = dh_params(group)?.generate_key().ok()?;
        // g^x mod p, big-endian, padded to the prime's size (`crypto_kpp_maxsize`).
        let public = dh
            .public_key()
            .to_vec_padded(i32::try_from(group.value_len()).ok()?)
            .ok()?;
        let key = PKey::from_dh(dh).ok()?;
        Some(DhKey { group, key, public })
    }

    /// g^x mod p as it travels.
    fn public(&self) -> Option<Vec<u8>> {
        Some(self.public.clone())
    }

    /// (g^y)^x mod p padded with leading zeros to the prime's size (the kernel's kpp writes
    /// it so, through `mpi_write_to_sgl`), or None if `peer` is not a valid public value:
    /// exactly the prime's size, 1 < y < p - 1, and y^q = 1 (OpenSSL's peer validation, the
    /// checks of the kernel's `dh_is_pubkey_valid`).
    ///
    /// Not `Dh::compute_key`: it returns the prime's size whatever `DH_compute_key` wrote,
    /// so a secret with a leading zero byte would come out shifted, with a zero at its end.
    fn shared(&self, peer: &[u8]) -> Option<Wiped> {
        let len = self.group.value_len();
        if peer.len() != len {
            return None;
        }
        let y = BigNum::from_slice(peer).ok()?;
        let one = BigNum::from_u32(1).ok()?;
        let mut p_minus_1 = BigNum::from_hex_str(self.group.prime_hex()?).ok()?;
        p_minus_1.sub_word(1).ok()?;
        if y.ucmp(&one) != Ordering::Greater || y.ucmp(&p_minus_1) != Ordering::Less {
            return None;
        }
        let peer = PKey::from_dh(dh_params(self.group)?.set_public_key(y).ok()?).ok()?;
        let mut deriver = Deriver::new(&self.key).ok()?;
        deriver.set_peer_ex(&peer, true).ok()?;
        let raw = Wiped(deriver.derive_to_vec().ok()?);
        if raw.0.len() > len {
            return None;
        }
        let mut padded = Wiped(vec![0u8; len - raw.0.len()]);
        padded.0.extend_from_slice(&raw.0);
        Some(padded)
    }
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    crate::random(&mut b);
    b
}

/// A sequence number: random and never 0 (0 in a Reply means "no controller
/// authentication", and the kernel's `nvme_auth_get_seqnum` skips it).
fn seqnum() -> u32 {
    loop {
        let mut b = [0u8; 4];
        crate::random(&mut b);
        let s = u32::from_le_bytes(b);
        if s != 0 {
            return s;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AUTH_Send / AUTH_Receive command checks

/// Which field of an AUTH_Send / AUTH_Receive command is wrong (the Error Information
/// log's parameter location, `req->error_loc` in nvmet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandField {
    /// Security Protocol is not [`SECP`].
    Secp,
    /// SP Specific 0 is not [`SPSP`].
    Spsp0,
    /// SP Specific 1 is not [`SPSP`].
    Spsp1,
    /// Transfer length (AUTH_Send `tl`) or allocation length (AUTH_Receive `al`) is 0.
    Length,
}

/// Checks an AUTH_Send / AUTH_Receive command's SECP, SPSP0, SPSP1 and `tl` / `al` as
/// `nvmet_execute_auth_send` and `nvmet_execute_auth_receive` do, before anything reaches
/// [`ControllerAuth`]. On error, complete the command with [`SC_INVALID_FIELD_DNR`] and
/// leave the exchange as it is.
pub fn check_command(secp: u8, spsp0: u8, spsp1: u8, len: u32) -> Result<(), CommandField> {
    if secp != SECP {
        Err(CommandField::Secp)
    } else if spsp0 != SPSP {
        Err(CommandField::Spsp0)
    } else if spsp1 != SPSP {
        Err(CommandField::Spsp1)
    } else if len == 0 {
        Err(CommandField::Length)
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Controller

/// Where a controller's exchange stands: what it expects next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Waiting for an AUTH_Send with Negotiate.
    Negotiate,
    /// Waiting for the AUTH_Receive that reads the Challenge.
    Challenge,
    /// Waiting for an AUTH_Send with the Reply.
    Reply,
    /// Waiting for the AUTH_Receive that reads Success1.
    Success1,
    /// Waiting for an AUTH_Send with Success2 (bidirectional only).
    Success2,
    /// Waiting for the AUTH_Receive that reads Failure1; the exchange has failed.
    Failure1,
    /// The host is authenticated (and the controller, if the host asked). A new Negotiate
    /// starts a re-authentication.
    Succeeded,
    /// The exchange failed for good: the transport must tear the controller down, as
    /// nvmet's `nvmet_ctrl_fatal_error` does.
    Failed,
}

/// Why [`ControllerAuth::on_receive`] produced nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReceiveError {
    /// The allocation length cannot hold the message: complete the AUTH_Receive with an
    /// error status (nvmet: Internal Error for a Challenge) and keep the exchange as it is;
    /// the kernel host always offers 4096 bytes, enough for ffdhe8192.
    TooSmall {
        /// Bytes the message needs.
        need: usize,
    },
}

impl fmt::Display for ReceiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReceiveError::TooSmall { need } => write!(
                f,
                "AUTH_Receive allocation length too small for the DH-HMAC-CHAP message ({need} bytes)"
            ),
        }
    }
}

impl std::error::Error for ReceiveError {}

/// The controller's side of DH-HMAC-CHAP on one queue (admin or I/O; each authenticates on
/// its own), following nvmet (drivers/nvme/target/fabrics-cmd-auth.c).
///
/// Drive it with the payload of every AUTH_Send ([`ControllerAuth::on_send`]) and the
/// allocation length of every AUTH_Receive ([`ControllerAuth::on_receive`]) after
/// [`check_command`]; refuse every other command except Connect with
/// [`SC_AUTH_REQUIRED_DNR`] while [`ControllerAuth::authenticated`] is false; tear the
/// controller down when [`ControllerAuth::state`] is [`State::Failed`].
pub struct ControllerAuth {
    host_nqn: String,
    subsys_nqn: String,
    host_key: Wiped,
    ctrl_key: Option<Wiped>,
    hashes: Vec<HashId>,
    groups: Vec<DhGroup>,
    state: State,
    authenticated: bool,
    reason: Reason,
    t_id: u16,
    hash: HashId,
    group: DhGroup,
    dh: Option<DhKey>,
    s1: u32,
    c1: Vec<u8>,
    s2: u32,
    c2: Option<Vec<u8>>,
    shared: Option<Wiped>,
    /// Negotiates that restarted an exchange under way before any succeeded: each costs a
    /// new DH key pair (ffdhe8192 at the host's choice), so a host without the key could
    /// keep the target computing them; past [`MAX_RESTARTS`] the controller is torn down.
    restarts: u8,
}

/// Exchanges a host may restart (a Negotiate in the middle of one) before it authenticated:
/// a real host sends one Negotiate, and again only to re-authenticate after a success.
const MAX_RESTARTS: u8 = 2;

impl fmt::Debug for ControllerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerAuth")
            .field("host_nqn", &self.host_nqn)
            .field("subsys_nqn", &self.subsys_nqn)
            .field("state", &self.state)
            .field("authenticated", &self.authenticated)
            .field("hash", &self.hash)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl ControllerAuth {
    /// An exchange for `host_nqn` (the Connect data's HOSTNQN) on subsystem `subsys_nqn`:
    /// `host_secret` is the host's secret, `ctrl_secret` the controller's secret for
    /// bidirectional authentication (used only if the host sends a challenge C2, which the
    /// kernel host does when given `--dhchap-ctrl-secret`). Hash preference: SHA-256, then
    /// SHA-384, SHA-512 (as nvmet's default `hmac(sha256)` with its fallback to the host's
    /// first usable id); DH group preference: ffdhe2048, then null, then the larger groups.
    pub fn new(
        host_nqn: &str,
        subsys_nqn: &str,
        host_secret: &Secret,
        ctrl_secret: Option<&Secret>,
    ) -> ControllerAuth {
        ControllerAuth {
            host_nqn: host_nqn.to_string(),
            subsys_nqn: subsys_nqn.to_string(),
            host_key: Wiped(host_secret.transformed(host_nqn)),
            ctrl_key: ctrl_secret.map(|s| Wiped(s.transformed(subsys_nqn))),
            hashes: vec![HashId::Sha256, HashId::Sha384, HashId::Sha512],
            groups: vec![
                DhGroup::Ffdhe2048,
                DhGroup::Null,
                DhGroup::Ffdhe3072,
                DhGroup::Ffdhe4096,
                DhGroup::Ffdhe6144,
                DhGroup::Ffdhe8192,
            ],
            state: State::Negotiate,
            authenticated: false,
            restarts: 0,
            reason: Reason::Failed,
            t_id: 0,
            hash: HashId::Sha256,
            group: DhGroup::Null,
            dh: None,
            s1: 0,
            c1: Vec::new(),
            s2: 0,
            c2: None,
            shared: None,
        }
    }

    /// Replaces the preference orders (first is best) of hash functions and DH groups. A
    /// host listing none of `hashes` gets Failure1 "hash function not usable", none of
    /// `groups` "DH group not usable". Empty lists leave the current order.
    pub fn set_preferences(&mut self, hashes: &[HashId], groups: &[DhGroup]) {
        if !hashes.is_empty() {
            self.hashes = hashes.to_vec();
        }
        if !groups.is_empty() {
            self.groups = groups.to_vec();
        }
    }

    /// Where the exchange stands.
    pub fn state(&self) -> State {
        self.state
    }

    /// Whether commands other than Connect / AUTH_Send / AUTH_Receive may run on the queue
    /// (nvmet's `sq->authenticated`): set once the host's response is verified
    /// (unidirectional) or Success2 arrives (bidirectional), cleared by any failure. It
    /// stays set during a re-authentication until that fails.
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// Whether the host has proved its key in this exchange: its Reply's response R1 checked
    /// out (the controller's Success1 is to be read next, or was), and nothing failed since.
    /// In a bidirectional exchange this comes before [`ControllerAuth::authenticated`], which
    /// waits for the host to accept the controller's response too.
    pub fn host_proved(&self) -> bool {
        matches!(
            self.state,
            State::Success1 | State::Success2 | State::Succeeded
        )
    }

    /// The transport will not have a host that proved its key (its sessions cannot be admitted
    /// now): the next AUTH_Receive reads Failure1 with `reason` instead of Success1, after
    /// which the exchange has failed for good ([`State::Failed`]), as for a wrong response.
    /// Once Success1 was read there is no AUTH_Receive left to carry a Failure1: the exchange
    /// then fails at once (the transport tears the controller down).
    pub fn refuse(&mut self, reason: Reason) {
        let _ = match self.state {
            State::Success1 => self.fail1(reason),
            _ => self.fatal(reason),
        };
    }

    /// The hash function and DH group negotiated (meaningful from [`State::Challenge`] on).
    pub fn negotiated(&self) -> (HashId, DhGroup) {
        (self.hash, self.group)
    }

    /// The payload of an AUTH_Send (fctype 0x05) from the host. Complete the command with
    /// success whatever this returns (nvmet does: the verdict travels in the next AUTH_Receive
    /// or ends the controller). An `Err` names why the exchange failed: in [`State::Failure1`]
    /// the next AUTH_Receive carries it to the host; in [`State::Failed`] (a message out of
    /// place, or the host's Failure2) the transport must tear the controller down.
    pub fn on_send(&mut self, payload: &[u8]) -> Result<(), Failure> {
        let msg = Message::decode(payload);
        // nvmet_execute_auth_send: a Negotiate (re)starts the exchange from any step but a
        // final failure.
        if payload.len() >= 2 && payload[0] == AUTH_TYPE_COMMON && payload[1] == MSG_NEGOTIATE {
            if matches!(self.state, State::Failed | State::Failure1) {
                return self.fatal(Reason::IncorrectMessage);
            }
            if !self.authenticated && self.state != State::Negotiate {
                if self.restarts == MAX_RESTARTS {
                    return self.fatal(Reason::IncorrectMessage);
                }
                self.restarts = self.restarts.saturating_add(1);
            }
            self.reset_exchange();
            if payload.len() >= 6 {
                self.t_id = le16(payload, 4);
            }
            let result = match msg {
                // nvmet_auth_negotiate: tl < sizeof(negotiate) + one descriptor.
                _ if payload.len() < NEGOTIATE_HEADER + DESCRIPTOR_LEN => {
                    Err(Reason::IncorrectPayload)
                }
                Ok(Message::Negotiate(n)) => self.negotiate(&n),
                _ => Err(Reason::IncorrectPayload),
            };
            return match result {
                Ok(()) => {
                    self.state = State::Challenge;
                    Ok(())
                }
                Err(r) => self.fail1(r),
            };
        }
        let msg = match msg {
            Ok(m) => m,
            // An unknown message type or one too short to be one: nvmet's done_failure1
            // (INCORRECT_MESSAGE, final) for unknown types; a truncated known message is an
            // incorrect payload.
            Err(DecodeError::Truncated { .. }) if self.expects(payload) => {
                return self.fail1(Reason::IncorrectPayload)
            }
            Err(_) => return self.fatal(Reason::IncorrectMessage),
        };
        if let Message::Failure2(f) = &msg {
            // The host gives up (e.g. the controller's response was wrong).
            return self.fatal(f.reason);
        }
        let expected = matches!(
            (&msg, self.state),
            (Message::Reply(_), State::Reply) | (Message::Success2 { .. }, State::Success2)
        );
        if !expected {
            return self.fatal(Reason::IncorrectMessage);
        }
        if msg.t_id() != self.t_id {
            return self.fail1(Reason::IncorrectPayload);
        }
        match msg {
            Message::Reply(r) => match self.reply(&r, payload.len()) {
                Ok(()) => {
                    self.state = State::Success1;
                    Ok(())
                }
                Err(reason) => self.fail1(reason),
            },
            _ => {
                // Success2: the host accepted our response R2.
                self.state = State::Succeeded;
                self.authenticated = true;
                self.reset_secrets();
                Ok(())
            }
        }
    }

    /// Whether `payload` is the type of message this state expects (so a truncated one is
    /// an incorrect payload rather than an incorrect message).
    fn expects(&self, payload: &[u8]) -> bool {
        let id = match self.state {
            State::Reply => MSG_REPLY,
            State::Success2 => MSG_SUCCESS2,
            _ => return false,
        };
        payload.len() >= 2 && payload[0] == AUTH_TYPE_DHCHAP && payload[1] == id
    }

    /// The payload for an AUTH_Receive (fctype 0x06) with allocation length `al`: the
    /// Challenge, then Success1 or Failure1. Transfer exactly `al` bytes, these followed by
    /// zeros, as nvmet does (it fills a zeroed buffer of `al` bytes); the result itself is
    /// never longer than the message.
    pub fn on_receive(&mut self, al: u32) -> Result<Vec<u8>, ReceiveError> {
        let al = usize::try_from(al).unwrap_or(usize::MAX);
        match self.state {
            State::Challenge => {
                let need = FIXED_LEN + self.hash.digest_len() + self.group.value_len();
                if al < need {
                    return Err(ReceiveError::TooSmall { need });
                }
                let dh = match self.group {
                    DhGroup::Null => None,
                    g => match DhKey::generate(g) {
                        Some(k) => Some(k),
                        None => return Ok(self.failure1_now(Reason::DhGroupUnusable)),
                    },
                };
                let dh_value = match dh.as_ref().map(DhKey::public) {
                    None => Vec::new(),
                    Some(Some(v)) => v,
                    Some(None) => return Ok(self.failure1_now(Reason::DhGroupUnusable)),
                };
                self.dh = dh;
                self.s1 = seqnum();
                self.c1 = random_bytes(self.hash.digest_len());
                self.state = State::Reply;
                Ok(Message::Challenge(Challenge {
                    t_id: self.t_id,
                    hash_id: self.hash.id(),
                    dh_group_id: self.group.id(),
                    seqnum: self.s1,
                    challenge: self.c1.clone(),
                    dh_value,
                })
                .encode())
            }
            State::Success1 => {
                let need = FIXED_LEN
                    + if self.c2.is_some() {
                        self.hash.digest_len()
                    } else {
                        0
                    };
                if al < need {
                    return Err(ReceiveError::TooSmall { need });
                }
                let response = match (&self.c2, &self.ctrl_key) {
                    (None, _) => None,
                    (Some(c2), Some(key)) => {
                        let c = self.challenge_for(c2);
                        Some(controller_response(
                            self.hash,
                            &key.0,
                            &c,
                            self.s2,
                            self.t_id,
                            &self.host_nqn,
                            &self.subsys_nqn,
                        ))
                    }
                    // Checked when the Reply arrived; kept for completeness.
                    (Some(_), None) => return Ok(self.failure1_now(Reason::Failed)),
                };
                self.state = if response.is_some() {
                    State::Success2
                } else {
                    self.reset_secrets();
                    State::Succeeded
                };
                Ok(Message::Success1(Success1 {
                    t_id: self.t_id,
                    hl: self.hash.digest_len() as u8,
                    response,
                })
                .encode())
            }
            State::Failure1 => {
                if al < FAILURE_LEN {
                    return Err(ReceiveError::TooSmall { need: FAILURE_LEN });
                }
                Ok(self.failure1_now(self.reason))
            }
            // nvmet_execute_auth_receive's "unhandled step": Failure1 "failed", final.
            _ => {
                if al < FAILURE_LEN {
                    return Err(ReceiveError::TooSmall { need: FAILURE_LEN });
                }
                Ok(self.failure1_now(Reason::Failed))
            }
        }
    }

    fn failure1_now(&mut self, reason: Reason) -> Vec<u8> {
        self.state = State::Failed;
        self.authenticated = false;
        self.reset_secrets();
        Message::Failure1(FailureMsg {
            t_id: self.t_id,
            rescode: RESCODE_FAILED,
            reason,
        })
        .encode()
    }

    /// Fails the exchange with a Failure1 to come.
    fn fail1(&mut self, reason: Reason) -> Result<(), Failure> {
        self.state = State::Failure1;
        self.reason = reason;
        self.authenticated = false;
        self.reset_secrets();
        Err(Failure::new(reason))
    }

    /// Fails the exchange for good (no Failure1: the controller is torn down).
    fn fatal(&mut self, reason: Reason) -> Result<(), Failure> {
        self.state = State::Failed;
        self.reason = reason;
        self.authenticated = false;
        self.reset_secrets();
        Err(Failure::new(reason))
    }

    fn reset_exchange(&mut self) {
        self.reset_secrets();
        self.s1 = 0;
        self.s2 = 0;
        self.c1.clear();
        self.c2 = None;
    }

    fn reset_secrets(&mut self) {
        self.dh = None;
        self.shared = None;
    }

    /// nvmet_auth_negotiate, with this controller's preference orders.
    fn negotiate(&mut self, n: &Negotiate) -> Result<(), Reason> {
        if n.sc_c != SC_C_NONE {
            return Err(Reason::ConcatMismatch);
        }
        let [p] = n.protocols.as_slice() else {
            return Err(Reason::HashUnusable);
        };
        if p.auth_id != AUTH_ID_DHCHAP {
            return Err(Reason::IncorrectPayload);
        }
        self.hash = *self
            .hashes
            .iter()
            .find(|h| p.hash_ids.contains(&h.id()))
            .ok_or(Reason::HashUnusable)?;
        self.group = *self
            .groups
            .iter()
            .find(|g| p.dh_group_ids.contains(&g.id()))
            .ok_or(Reason::DhGroupUnusable)?;
        Ok(())
    }

    /// C itself with the null group, else the augmented challenge.
    fn challenge_for(&self, c: &[u8]) -> Vec<u8> {
        match &self.shared {
            Some(s) => augmented_challenge(self.hash, &s.0, c),
            None => c.to_vec(),
        }
    }

    /// nvmet_auth_reply.
    fn reply(&mut self, r: &Reply, tl: usize) -> Result<(), Reason> {
        let hl = self.hash.digest_len();
        if tl < FIXED_LEN {
            return Err(Reason::IncorrectPayload);
        }
        match (self.group, r.dh_value.is_empty()) {
            (DhGroup::Null, true) => {}
            // A DH value with the null group, or none with a real group.
            (DhGroup::Null, false) | (_, true) => return Err(Reason::IncorrectPayload),
            (_, false) => {
                let dh = self.dh.as_ref().ok_or(Reason::IncorrectPayload)?;
                self.shared = Some(dh.shared(&r.dh_value).ok_or(Reason::DhGroupUnusable)?);
            }
        }
        if r.response.len() != hl {
            // nvmet_auth_host_hash refuses a length other than the digest's.
            return Err(Reason::Failed);
        }
        let c = self.challenge_for(&self.c1);
        let expected = host_response(
            self.hash,
            &self.host_key.0,
            &c,
            self.s1,
            self.t_id,
            &self.host_nqn,
            &self.subsys_nqn,
        );
        if !same(&expected, &r.response) {
            return Err(Reason::Failed);
        }
        // S2 = 0 with a C2 asks for no controller authentication (a PSK-only challenge).
        if r.cvalid && r.seqnum != 0 {
            if self.ctrl_key.is_none() {
                // nvmet_auth_success1: "no ctrl key".
                return Err(Reason::Failed);
            }
            self.s2 = r.seqnum;
            self.c2 = Some(r.challenge.clone());
        } else {
            self.c2 = None;
            self.authenticated = true;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Host

/// The host's side of DH-HMAC-CHAP (drivers/nvme/host/auth.c, `nvme_queue_auth_work`), for
/// tests and test clients: [`HostAuth::negotiate`], then [`HostAuth::on_challenge`] (the
/// Reply to send), then [`HostAuth::on_success1`] (Success2 to send when bidirectional). On an
/// error the kernel host sends [`HostAuth::failure2`] unless the controller sent Failure1.
pub struct HostAuth {
    host_nqn: String,
    subsys_nqn: String,
    host_key: Wiped,
    ctrl_key: Option<Wiped>,
    t_id: u16,
    hashes: Vec<u8>,
    groups: Vec<u8>,
    hash: HashId,
    c2: Option<Vec<u8>>,
    s2: u32,
    shared: Option<Wiped>,
    succeeded: bool,
}

impl fmt::Debug for HostAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostAuth")
            .field("host_nqn", &self.host_nqn)
            .field("subsys_nqn", &self.subsys_nqn)
            .field("t_id", &self.t_id)
            .field("succeeded", &self.succeeded)
            .finish_non_exhaustive()
    }
}

impl HostAuth {
    /// An exchange with transaction id `t_id` (the kernel counts per controller). With
    /// `ctrl_secret` the host asks the controller to authenticate too. It offers what the
    /// kernel offers: SHA-256, SHA-384, SHA-512 and null, ffdhe2048 ... ffdhe8192.
    pub fn new(
        host_nqn: &str,
        subsys_nqn: &str,
        host_secret: &Secret,
        ctrl_secret: Option<&Secret>,
        t_id: u16,
    ) -> HostAuth {
        HostAuth {
            host_nqn: host_nqn.to_string(),
            subsys_nqn: subsys_nqn.to_string(),
            host_key: Wiped(host_secret.transformed(host_nqn)),
            ctrl_key: ctrl_secret.map(|s| Wiped(s.transformed(subsys_nqn))),
            t_id,
            hashes: vec![1, 2, 3],
            groups: vec![0, 1, 2, 3, 4, 5],
            hash: HashId::Sha256,
            c2: None,
            s2: 0,
            shared: None,
            succeeded: false,
        }
    }

    /// Replaces the ids offered in Negotiate (tests use it to force a hash or group, or to
    /// offer ids nobody knows).
    pub fn set_offer(&mut self, hash_ids: &[u8], dh_group_ids: &[u8]) {
        self.hashes = hash_ids.to_vec();
        self.groups = dh_group_ids.to_vec();
    }

    /// Whether the exchange completed (the controller's response checked, if asked for).
    pub fn succeeded(&self) -> bool {
        self.succeeded
    }

    /// AUTH_Negotiate (`nvme_auth_set_dhchap_negotiate_data`).
    pub fn negotiate(&self) -> Vec<u8> {
        Message::Negotiate(Negotiate {
            t_id: self.t_id,
            sc_c: SC_C_NONE,
            protocols: vec![Protocol {
                auth_id: AUTH_ID_DHCHAP,
                hash_ids: self.hashes.clone(),
                dh_group_ids: self.groups.clone(),
            }],
        })
        .encode()
    }

    /// Reads the controller's first AUTH_Receive data (Challenge or Failure1) and returns the
    /// Reply (`nvme_auth_process_dhchap_challenge`, `nvme_auth_set_dhchap_reply_data`).
    pub fn on_challenge(&mut self, data: &[u8]) -> Result<Vec<u8>, Failure> {
        let c = match self.receive(data)? {
            Message::Challenge(c) => c,
            _ => return Err(Failure::new(Reason::IncorrectMessage)),
        };
        let hash = HashId::from_id(c.hash_id).ok_or(Failure::new(Reason::HashUnusable))?;
        if !self.hashes.contains(&c.hash_id) {
            return Err(Failure::new(Reason::HashUnusable));
        }
        if c.challenge.len() != hash.digest_len() {
            return Err(Failure::new(Reason::HashUnusable));
        }
        let group = DhGroup::from_id(c.dh_group_id).ok_or(Failure::new(Reason::DhGroupUnusable))?;
        if !self.groups.contains(&c.dh_group_id) {
            return Err(Failure::new(Reason::DhGroupUnusable));
        }
        self.hash = hash;
        let mut dh_value = Vec::new();
        match group {
            DhGroup::Null if !c.dh_value.is_empty() => {
                return Err(Failure::new(Reason::IncorrectPayload))
            }
            DhGroup::Null => self.shared = None,
            _ if c.dh_value.is_empty() => return Err(Failure::new(Reason::DhGroupUnusable)),
            g => {
                let key = DhKey::generate(g).ok_or(Failure::new(Reason::DhGroupUnusable))?;
                dh_value = key.public().ok_or(Failure::new(Reason::DhGroupUnusable))?;
                self.shared = Some(
                    key.shared(&c.dh_value)
                        .ok_or(Failure::new(Reason::IncorrectPayload))?,
                );
            }
        }
        let ch = match &self.shared {
            Some(s) => augmented_challenge(hash, &s.0, &c.challenge),
            None => c.challenge.clone(),
        };
        let response = host_response(
            hash,
            &self.host_key.0,
            &ch,
            c.seqnum,
            self.t_id,
            &self.host_nqn,
            &self.subsys_nqn,
        );
        let (challenge, cvalid) = if self.ctrl_key.is_some() {
            self.s2 = seqnum();
            let c2 = random_bytes(hash.digest_len());
            self.c2 = Some(c2.clone());
            (c2, true)
        } else {
            self.s2 = 0;
            (vec![0; hash.digest_len()], false)
        };
        Ok(Message::Reply(Reply {
            t_id: self.t_id,
            cvalid,
            seqnum: self.s2,
            response,
            challenge,
            dh_value,
        })
        .encode())
    }

    /// Reads the controller's second AUTH_Receive data (Success1 or Failure1); returns the
    /// Success2 to send when the host asked for controller authentication
    /// (`nvme_auth_process_dhchap_success1`). Unlike the kernel host, a Success1 without R2
    /// when R2 was asked for is refused.
    pub fn on_success1(&mut self, data: &[u8]) -> Result<Option<Vec<u8>>, Failure> {
        let s = match self.receive(data)? {
            Message::Success1(s) => s,
            _ => return Err(Failure::new(Reason::IncorrectMessage)),
        };
        if usize::from(s.hl) != self.hash.digest_len() {
            return Err(Failure::new(Reason::HashUnusable));
        }
        let Some(c2) = &self.c2 else {
            self.succeeded = true;
            return Ok(None);
        };
        let (Some(r2), Some(key)) = (&s.response, &self.ctrl_key) else {
            return Err(Failure::new(Reason::Failed));
        };
        let ch = match &self.shared {
            Some(sh) => augmented_challenge(self.hash, &sh.0, c2),
            None => c2.clone(),
        };
        let expected = controller_response(
            self.hash,
            &key.0,
            &ch,
            self.s2,
            self.t_id,
            &self.host_nqn,
            &self.subsys_nqn,
        );
        if !same(&expected, r2) {
            return Err(Failure::new(Reason::Failed));
        }
        self.succeeded = true;
        self.shared = None;
        Ok(Some(Message::Success2 { t_id: self.t_id }.encode()))
    }

    /// AUTH_Failure2 with `reason` (`nvme_auth_set_dhchap_failure2_data`).
    pub fn failure2(&self, reason: Reason) -> Vec<u8> {
        Message::Failure2(FailureMsg {
            t_id: self.t_id,
            rescode: RESCODE_FAILED,
            reason,
        })
        .encode()
    }

    /// nvme_auth_receive_validate: Failure1 ends the exchange with its explanation; any other
    /// message must be a DH-HMAC-CHAP one with our transaction id.
    fn receive(&self, data: &[u8]) -> Result<Message, Failure> {
        let m = Message::decode(data).map_err(|e| match e {
            DecodeError::Truncated { .. } => Failure::new(Reason::IncorrectPayload),
            _ => Failure::new(Reason::IncorrectMessage),
        })?;
        if let Message::Failure1(f) = &m {
            return Err(Failure::new(f.reason));
        }
        if m.t_id() != self.t_id {
            return Err(Failure::new(Reason::IncorrectMessage));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests;
