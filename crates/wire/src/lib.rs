#![deny(missing_docs)]
//! blkwire native protocol v1: the bytes on the wire and nothing else.
//!
//! This crate does no I/O and never allocates on the decode path, so it can be fuzzed in isolation
//! (`fuzz/fuzz_targets/frame.rs`). Section references (`§N`) point into `docs/PROTOCOL.md`.

mod block;
mod copy;
pub mod crc;
pub mod datagram;
mod frame;
mod handshake;
pub mod iscsi;
pub mod nbd;
pub mod nvme_tcp;
pub mod scsi;

pub use copy::CopyDescriptor;
pub use frame::{Flags, FrameError, Header, Opcode, Status, Tag, HEADER_LEN, MAGIC, VERSION};
pub use handshake::{
    AuthBlock, AuthMethod, CopyLimits, ExportEntry, Features, Hello, HelloReply, Join,
    PayloadError, PayloadReader, PayloadWriter, QueueRef, AUTH_LEN, HEADER_CRC, MAX_STR,
    QUERY_LIST, QUERY_STATS, REPLACES, SESSION_HEADER_CRC,
};

/// Largest payload blkwire ever puts in one frame (and so the largest I/O a target grants):
/// 32 MiB, well above the 1 MiB default, small enough that a hostile length cannot make a
/// receiver allocate without bound.
pub const MAX_PAYLOAD_LIMIT: u32 = 32 << 20;

/// Most fragments one datagram message may have (PROTOCOL.md §9.3): the target grants no
/// `max_io` that needs more, and the initiator refuses a grant that would.
pub const MAX_FRAGMENTS: u32 = 256;

/// Number of fragments a message of `len` bytes needs at `frame_payload` bytes each (PROTOCOL.md
/// §9.3); at least 1 (a message without data is one frame).
pub fn fragment_count(len: u32, frame_payload: u32) -> u32 {
    len.div_ceil(frame_payload.max(1)).max(1)
}

/// Bitmap of fragments (bit `i` of byte `i / 8`, LSB first), as carried with flag `HAVE`.
pub mod bitmap {
    /// Bytes a bitmap of `count` fragments takes.
    pub fn bytes_for(count: u32) -> usize {
        count.div_ceil(8) as usize
    }
    /// Is fragment `i` present? (Bits beyond the map are absent.)
    pub fn get(map: &[u8], i: u32) -> bool {
        map.get((i / 8) as usize)
            .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }
    /// Marks fragment `i` present (ignored beyond the map).
    pub fn set(map: &mut [u8], i: u32) {
        if let Some(b) = map.get_mut((i / 8) as usize) {
            *b |= 1 << (i % 8);
        }
    }
}
