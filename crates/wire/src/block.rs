//! The native protocol's view of the block vocabulary (`blkwire-block`): which opcode (§3) and
//! which flags (§4) carry which block operation. Both ends convert here and nowhere else.

use blkwire_block::{BlockOp, BlockRequest, IoFlags};

use crate::{Flags, Header, Opcode};

impl Header {
    /// The block request a request header carries; `None` for control commands.
    pub fn block_request(&self) -> Option<BlockRequest> {
        Some(BlockRequest {
            op: self.opcode.block_op()?,
            offset: self.offset,
            len: self.length,
            flags: self.flags.io_flags(),
        })
    }
}

impl Opcode {
    /// The block operation this opcode asks for; `None` for control commands and COPY.
    pub fn block_op(self) -> Option<BlockOp> {
        Some(match self {
            Opcode::Read => BlockOp::Read,
            Opcode::Write => BlockOp::Write,
            Opcode::Flush => BlockOp::Flush,
            Opcode::Trim => BlockOp::Trim,
            Opcode::WriteZeroes => BlockOp::WriteZeroes,
            _ => return None,
        })
    }

    /// The opcode that carries a block operation.
    pub fn for_block(op: BlockOp) -> Opcode {
        match op {
            BlockOp::Read => Opcode::Read,
            BlockOp::Write => Opcode::Write,
            BlockOp::Flush => Opcode::Flush,
            BlockOp::Trim => Opcode::Trim,
            BlockOp::WriteZeroes => Opcode::WriteZeroes,
        }
    }
}

impl Flags {
    /// The request modifiers these flags carry (FUA, NO_HOLE).
    pub fn io_flags(self) -> IoFlags {
        IoFlags::empty()
            .with(IoFlags::FUA, self.has(Flags::FUA))
            .with(IoFlags::NO_HOLE, self.has(Flags::NO_HOLE))
    }

    /// The flag bits for request modifiers; those the native protocol has no bit for
    /// (FAST_ZERO, REQ_ONE: NBD's) are left out.
    pub fn for_io(f: IoFlags) -> u16 {
        let mut bits = 0;
        if f.has(IoFlags::FUA) {
            bits |= Flags::FUA;
        }
        if f.has(IoFlags::NO_HOLE) {
            bits |= Flags::NO_HOLE;
        }
        bits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_op_has_an_opcode_and_back() {
        use BlockOp::*;
        for op in [Read, Write, Flush, Trim, WriteZeroes] {
            assert_eq!(Opcode::for_block(op).block_op(), Some(op));
        }
        for op in [
            Opcode::Copy,
            Opcode::Hello,
            Opcode::Keepalive,
            Opcode::Logout,
        ] {
            assert_eq!(op.block_op(), None, "{op:?}");
        }
    }

    #[test]
    fn flags_round_trip_and_nbd_only_ones_stay_off_the_wire() {
        for f in [
            IoFlags::empty(),
            IoFlags::FUA,
            IoFlags::NO_HOLE,
            IoFlags::FUA | IoFlags::NO_HOLE,
        ] {
            assert_eq!(Flags(Flags::for_io(f)).io_flags(), f);
        }
        assert_eq!(Flags::for_io(IoFlags::FAST_ZERO | IoFlags::REQ_ONE), 0);
        assert_eq!(
            Flags(Flags::CRC | Flags::REPLY).io_flags(),
            IoFlags::empty()
        );
    }
}
