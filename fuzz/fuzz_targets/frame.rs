//! Header decoding (PROTOCOL.md §1) against arbitrary bytes: `Header::decode` must never panic,
//! every accepted header must survive encode → decode unchanged, and `check_crc` must accept any
//! payload slice without panicking. The same bytes taken as a datagram (§9.6) must walk without
//! panicking, yield only in-bounds frames of one queue, CRC-valid or sealed (§12.4: the seal
//! follows the payload), and stop at the first bad one. Cut after its header, the same bytes taken
//! as a frame received in two pieces (`frame_in_two`) must be taken only exactly as `frames` takes
//! an unsealed frame with the same bytes in one piece.

#![no_main]

use blkwire_wire::{datagram, Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const MAXES: [u32; 4] = [0, 4096, 1 << 20, u32::MAX];

fuzz_target!(|data: &[u8]| {
    let mut walked = 0usize;
    let mut first = None;
    let mut failed = false;
    for f in datagram::frames(data, 1 << 16) {
        assert!(!failed, "a frame was yielded after an error");
        match f {
            Ok(f) => {
                let (h, payload) = (f.header, f.payload);
                assert_eq!(payload.len(), h.payload_len as usize);
                let seal = if f.sealed() { datagram::SEAL_LEN } else { 0 };
                if !f.sealed() {
                    assert_eq!(h.check_crc(f.raw, payload), Ok(()));
                }
                assert_eq!(f.raw.len(), HEADER_LEN + payload.len() + seal);
                assert_eq!(
                    *first.get_or_insert((h.session, h.queue)),
                    (h.session, h.queue)
                );
                walked += f.raw.len();
                assert!(walked <= data.len(), "walked past the datagram");
            }
            Err(_) => failed = true,
        }
    }
    if data.len() >= HEADER_LEN {
        let (header, payload) = data.split_at(HEADER_LEN);
        let two = datagram::frame_in_two(header, payload, 1 << 16);
        let one = datagram::frames(data, 1 << 16).next();
        if let Ok(f) = two {
            assert!(
                matches!(one, Some(Ok(w)) if w.header == f.header && w.payload == payload),
                "taken in two pieces but not in one"
            );
        }
        // And the converse: an unsealed frame that is the whole datagram is taken in two.
        if let Some(Ok(w)) = one {
            if !w.sealed() && w.raw.len() == data.len() {
                assert!(two.is_ok(), "taken in one piece but not in two");
            }
        }
    }
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
        let _ = h.check_crc(data, &rest[..take]);
        // A header sealed over that payload must then verify.
        let mut sealed = h;
        sealed.seal_crc(&rest[..take]);
        assert_eq!(
            sealed.check_crc(&sealed.to_bytes(), &rest[..take]),
            Ok(()),
            "sealed CRC did not verify"
        );
    }
});
