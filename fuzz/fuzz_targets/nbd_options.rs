//! NBD's option haggling before transmission (fixed newstyle: client flags, then LIST, INFO,
//! GO, EXPORT_NAME, STRUCTURED_REPLY, META_CONTEXT, STARTTLS, ABORT and unknown options), over
//! a byte stream as the handshake thread runs it over a socket
//! (`blkwire_server::fuzzing::nbd_options`). The first byte picks a target with or without
//! keys and its TLS mode; the rest is what the client sends before it closes.
//!
//! No panic on any input, and the target's answers stay bounded: at most 1024 options are
//! read, each answered with a few replies (LIST names the one export) that echo at most the
//! name it asked for.

#![no_main]

use blkwire_server::fuzzing::nbd_options;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let run = nbd_options(data);
    assert!(run.answered <= 18 + data.len() + 1024 * 256, "{run:?}");
});
