//! blkwire native protocol v1: the bytes on the wire and nothing else.
//!
//! This crate does no I/O and never allocates on the decode path, so it can be fuzzed in isolation
//! (`fuzz/fuzz_targets/frame.rs`). Section references (`§N`) point into `docs/PROTOCOL.md`.

mod frame;
mod handshake;
pub mod nbd;

pub use frame::{Flags, FrameError, Header, Opcode, Status, Tag, HEADER_LEN, MAGIC, VERSION};
pub use handshake::{
    ExportEntry, Features, Hello, HelloReply, PayloadError, PayloadReader, PayloadWriter, MAX_STR,
};

/// Largest payload blkwire ever puts in one frame (and so the largest I/O a target grants):
/// 32 MiB, well above the 1 MiB default, small enough that a hostile length cannot make a
/// receiver allocate without bound.
pub const MAX_PAYLOAD_LIMIT: u32 = 32 << 20;
