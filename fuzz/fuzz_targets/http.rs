//! The metrics endpoint's request parsing (`blkwire_server::http`) on arbitrary bytes, as a
//! scraper or anyone else on the network may send them. No panic on any input; `head_end`
//! points just past the first empty line (CRLF CRLF or LF LF) and never past the input; a head
//! and everything that follows it get the same answer as the head alone (only the request line
//! counts); the metrics are given only to a GET of /metrics.

#![no_main]

use blkwire_server::http::{head_end, reply_to, Reply, MAX_HEAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let data = &data[..data.len().min(2 * MAX_HEAD)];
    if let Some(end) = head_end(data) {
        assert!(end >= 2 && end <= data.len());
        let head = &data[..end];
        assert!(head.ends_with(b"\n\n") || head.ends_with(b"\n\r\n"));
        assert_eq!(head_end(&data[..end - 1]), None, "not the first empty line");
        assert_eq!(reply_to(head), reply_to(data));
    }
    if reply_to(data) == Reply::Metrics {
        let line = data
            .iter()
            .position(|&b| b != b'\r' && b != b'\n')
            .map_or(&data[..0], |start| &data[start..]);
        assert!(line.starts_with(b"GET /metrics"), "{line:?}");
    }
    let (code, reason) = reply_to(data).status();
    assert!((200..600).contains(&code) && !reason.is_empty());
});
