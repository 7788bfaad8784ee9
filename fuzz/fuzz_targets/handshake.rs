//! HELLO (with its §12.1 auth block) / HELLO reply / JOIN / LIST payload and COPY descriptor decoding (PROTOCOL.md §7, §12, §13): no panics on arbitrary bytes,
//! and anything accepted must encode and decode back to the same value.

#![no_main]

use blkwire_wire::{CopyDescriptor, ExportEntry, Hello, HelloReply, Join};
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
    if let Ok(j) = Join::decode(data) {
        assert_eq!(&j.encode()[..], data, "Join did not round-trip");
    }
    if let Ok(h) = Hello::decode(data) {
        // The transcript is the payload with the proof zeroed: same length, same prefix.
        let t = h
            .transcript_bytes()
            .expect("a decoded Hello has a transcript");
        assert_eq!(t.len(), data.len());
        assert_eq!(t[..t.len() - 32], data[..data.len() - 32]);
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
    if let Ok(d) = CopyDescriptor::decode(data, u16::MAX) {
        // PROTOCOL.md §13: a decoded COPY descriptor is exactly its input again.
        assert!(!d.ranges.is_empty() && d.ranges.iter().all(|r| r.len > 0));
        assert_eq!(d.encode().expect("a decoded descriptor re-encodes"), data);
    }
});
