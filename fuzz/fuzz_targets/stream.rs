//! A receiver walking a byte stream of back-to-back frames (header + payload), the way the target
//! does: decode a header at the cursor with a 1 MiB limit, stop on any error or on a frame that is
//! not fully present, else skip over header and payload. The cursor must only move forward and
//! never pass the end of the buffer.

#![no_main]

use blkwire_wire::{Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const MAX_PAYLOAD: u32 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut cursor = 0usize;
    loop {
        assert!(
            cursor <= data.len(),
            "cursor {cursor} past end {}",
            data.len()
        );
        let rest = &data[cursor..];
        let h = match Header::decode(rest, MAX_PAYLOAD) {
            Ok(h) => h,
            Err(_) => break,
        };
        assert!(h.payload_len <= MAX_PAYLOAD);
        let frame_len = HEADER_LEN + h.payload_len as usize;
        if rest.len() < frame_len {
            break;
        }
        let payload = &rest[HEADER_LEN..frame_len];
        let _ = h.check_crc(rest, payload);
        let next = cursor + frame_len;
        assert!(next > cursor, "cursor did not advance");
        assert!(next <= data.len(), "cursor {next} past end {}", data.len());
        cursor = next;
    }
});
