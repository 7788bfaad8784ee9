//! Header decoding (PROTOCOL.md §1) against arbitrary bytes: `Header::decode` must never panic,
//! every accepted header must survive encode → decode unchanged, and `check_crc` must accept any
//! payload slice without panicking.

#![no_main]

use blkwire_wire::{Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const MAXES: [u32; 4] = [0, 4096, 1 << 20, u32::MAX];

fuzz_target!(|data: &[u8]| {
    for max in MAXES {
        let Ok(h) = Header::decode(data, max) else {
            continue;
        };
        assert!(
            h.payload_len <= max,
            "accepted payload_len {} > max {max}",
            h.payload_len
        );
        let bytes = h.to_bytes();
        assert_eq!(
            Header::decode(&bytes, max),
            Ok(h),
            "re-encoded header did not round-trip"
        );
        // The payload that follows the header, as a receiver would have it: at most payload_len
        // bytes, and no more than were actually received.
        let rest = &data[HEADER_LEN..];
        let take = rest.len().min(h.payload_len as usize);
        let _ = h.check_crc(&rest[..take]);
        // A header sealed over that payload must then verify.
        let mut sealed = h;
        sealed.seal_crc(&rest[..take]);
        assert_eq!(
            sealed.check_crc(&rest[..take]),
            Ok(()),
            "sealed CRC did not verify"
        );
    }
});
