//! ublk I/O descriptors as the kernel writes them into the shared descriptor area (crates/map):
//! `ublk::abi::map_op` on arbitrary descriptors must never panic, never hand out a READ or WRITE
//! longer than the queue's buffer, refuse every change to a read-only device, and keep the byte
//! offset equal to the sector number times 512.

#![no_main]

use blkwire_client::BlockOp;
use blkwire_map::ublk::abi::{map_op, IoDesc};
use libfuzzer_sys::fuzz_target;

const BUF: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; 25];
    let n = data.len().min(b.len());
    b[..n].copy_from_slice(&data[..n]);
    let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().unwrap());
    let d = IoDesc {
        op_flags: u32_at(0),
        nr_sectors: u32_at(4),
        start_sector: u64::from_ne_bytes(b[8..16].try_into().unwrap()),
        addr: u64::from_ne_bytes(b[16..24].try_into().unwrap()),
    };
    let readonly = b[24] & 1 == 1;
    let Ok(op) = map_op(&d, readonly, BUF) else {
        return;
    };
    match op.op {
        BlockOp::Flush => return,
        BlockOp::Read => assert!(op.len as usize <= BUF),
        BlockOp::Write => assert!(op.len as usize <= BUF && !readonly),
        BlockOp::Trim | BlockOp::WriteZeroes => assert!(!readonly),
    }
    assert_eq!(op.offset as u128, d.start_sector as u128 * 512);
});
