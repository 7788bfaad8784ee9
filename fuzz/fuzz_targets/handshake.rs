//! HELLO / HELLO reply / LIST payload decoding (PROTOCOL.md §7): no panics on arbitrary bytes,
//! and anything accepted must encode and decode back to the same value.

#![no_main]

use blkwire_wire::{ExportEntry, Hello, HelloReply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Hello::decode(data) {
        let enc = h.encode().expect("a decoded Hello must re-encode");
        assert_eq!(Hello::decode(&enc), Ok(h), "Hello did not round-trip");
        // Decoding is strict (no trailing bytes), so the encoding is the input itself.
        assert_eq!(enc, data, "Hello encoding differs from the accepted input");
    }
    if let Ok(r) = HelloReply::decode(data) {
        let enc = r.encode();
        assert_eq!(enc.len(), HelloReply::LEN);
        assert_eq!(
            HelloReply::decode(&enc),
            Ok(r),
            "HelloReply did not round-trip"
        );
        assert_eq!(
            enc, data,
            "HelloReply encoding differs from the accepted input"
        );
    }
    if let Ok(list) = ExportEntry::decode_list(data) {
        let enc = ExportEntry::encode_list(&list).expect("a decoded list must re-encode");
        assert_eq!(
            ExportEntry::decode_list(&enc).as_ref(),
            Ok(&list),
            "export list did not round-trip"
        );
        assert_eq!(
            enc, data,
            "export list encoding differs from the accepted input"
        );
    }
});
