//! NBD decoders (crates/wire/src/nbd.rs): transmission requests, option headers, NBD_OPT_INFO/GO
//! and META_CONTEXT option data. No panic on any input; a decoded request re-encodes to the
//! bytes it came from and never announces more payload than the limit; a stream of requests is
//! walked the way the target's reactor walks it.

#![no_main]

use blkwire_wire::nbd::{self, InfoRequest, MetaRequest, Request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for max in [0u32, 4096, 32 << 20] {
        if let Ok(r) = Request::decode(data, max) {
            assert!(r.payload_len() as u64 <= max as u64 || r.typ != nbd::cmd::WRITE);
            assert_eq!(
                &r.encode()[..],
                &data[..nbd::REQUEST_LEN],
                "request did not round-trip"
            );
        }
    }
    // A byte stream of requests, as the reactor consumes it.
    let mut at = 0usize;
    while let Ok(r) = Request::decode(&data[at..], 1 << 20) {
        let total = nbd::REQUEST_LEN + r.payload_len();
        if data.len() - at < total {
            break;
        }
        at += total;
        assert!(at <= data.len());
    }
    let _ = nbd::decode_option_header(data);
    if let Ok(i) = InfoRequest::decode(data) {
        assert!(i.name.len() <= nbd::MAX_NAME);
        assert!(i.requests.len() * 2 <= data.len());
    }
    if let Ok(m) = MetaRequest::decode(data) {
        assert!(m.export.len() <= nbd::MAX_NAME);
        assert!(m.queries.len() * 4 <= data.len());
    }
});
