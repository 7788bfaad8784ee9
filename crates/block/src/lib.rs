//! The one vocabulary of block operations in blkwire.
//!
//! Every protocol (the native frames, NBD, ublk descriptors, FUSE requests) is converted to these
//! types at its edge, and everything in between (the server's executor, the backends, the
//! generic emulation layer) speaks only them. A request here names an operation, its flags and
//! its range, never a buffer: buffers belong to whoever runs the request.

#![deny(missing_docs)]

mod caps;

pub use caps::{Capabilities, Limits, Support};

/// What a request asks of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockOp {
    /// Return `len` bytes at `offset`.
    Read,
    /// Store `len` bytes at `offset`.
    Write,
    /// Make every write answered before it durable (PROTOCOL.md §10).
    Flush,
    /// The range's contents are no longer needed (advisory; reads return old data or zeros).
    Trim,
    /// The range reads as zeros afterwards.
    WriteZeroes,
}

impl BlockOp {
    /// Operations that change the export's contents, refused on read-only exports.
    pub fn modifies(self) -> bool {
        matches!(self, BlockOp::Write | BlockOp::Trim | BlockOp::WriteZeroes)
    }

    /// Operations that move data (and so need a buffer of `len` bytes and respect max I/O).
    pub fn moves_data(self) -> bool {
        matches!(self, BlockOp::Read | BlockOp::Write)
    }
}

/// Modifiers of a request, whatever protocol carried them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoFlags(u8);

impl IoFlags {
    /// WRITE: durable before it is answered (forced unit access).
    pub const FUA: IoFlags = IoFlags(1 << 0);
    /// WRITE_ZEROES: the range stays allocated (no hole may be punched).
    pub const NO_HOLE: IoFlags = IoFlags(1 << 1);
    /// WRITE_ZEROES: fail at once instead of zeroing slowly (NBD's FAST_ZERO).
    pub const FAST_ZERO: IoFlags = IoFlags(1 << 2);
    /// Allocation queries: one extent is enough (NBD's REQ_ONE).
    pub const REQ_ONE: IoFlags = IoFlags(1 << 3);

    /// No flag set.
    pub const fn empty() -> IoFlags {
        IoFlags(0)
    }

    /// True when every flag of `other` is set.
    pub fn has(self, other: IoFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the flags of `other` set or cleared.
    #[must_use]
    pub fn with(self, other: IoFlags, on: bool) -> IoFlags {
        if on {
            IoFlags(self.0 | other.0)
        } else {
            IoFlags(self.0 & !other.0)
        }
    }
}

impl std::ops::BitOr for IoFlags {
    type Output = IoFlags;
    fn bitor(self, rhs: IoFlags) -> IoFlags {
        IoFlags(self.0 | rhs.0)
    }
}

/// One block operation on a range of an export: what a frontend decodes and an executor runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRequest {
    /// The operation.
    pub op: BlockOp,
    /// First byte of the range.
    pub offset: u64,
    /// Bytes in the range. A FLUSH with offset and length 0 covers the whole export.
    pub len: u32,
    /// Modifiers.
    pub flags: IoFlags,
}

impl BlockRequest {
    /// A request without flags.
    pub fn new(op: BlockOp, offset: u64, len: u32) -> BlockRequest {
        BlockRequest {
            op,
            offset,
            len,
            flags: IoFlags::empty(),
        }
    }

    /// The same request with `flags` added.
    #[must_use]
    pub fn flagged(self, flags: IoFlags) -> BlockRequest {
        BlockRequest {
            flags: self.flags | flags,
            ..self
        }
    }
}

/// One source range of a COPY: `len` bytes from `offset` of the same export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRange {
    /// First byte of the source.
    pub offset: u64,
    /// Bytes to copy.
    pub len: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_combine_and_clear() {
        let f = IoFlags::FUA | IoFlags::NO_HOLE;
        assert!(f.has(IoFlags::FUA) && f.has(IoFlags::NO_HOLE) && !f.has(IoFlags::FAST_ZERO));
        assert!(f.has(IoFlags::FUA | IoFlags::NO_HOLE));
        assert!(!f.has(IoFlags::FUA | IoFlags::REQ_ONE));
        let g = f.with(IoFlags::FUA, false);
        assert!(!g.has(IoFlags::FUA) && g.has(IoFlags::NO_HOLE));
        assert_eq!(g.with(IoFlags::FUA, true), f);
    }

    #[test]
    fn which_ops_modify_and_move_data() {
        use BlockOp::*;
        let all = [Read, Write, Flush, Trim, WriteZeroes];
        let modifies: Vec<_> = all.iter().filter(|o| o.modifies()).collect();
        assert_eq!(modifies, [&Write, &Trim, &WriteZeroes]);
        let moves: Vec<_> = all.iter().filter(|o| o.moves_data()).collect();
        assert_eq!(moves, [&Read, &Write]);
    }
}
