//! Connection setup before a host has proved anything: the iSCSI login (stages, operational
//! keys, CHAP, a discovery session's SendTargets) and NVMe/TCP's ICReq and Connect (its data
//! in the capsule or solicited with R2T), over a byte stream as the handshake thread runs them
//! over a socket (`blkwire_server::fuzzing::login`). The first byte picks the protocol and a
//! target with or without keys; the rest is what the host sends before it closes.
//!
//! No panic on any input, and the target's answers stay bounded: at most the login PDUs it
//! reads, each answered with at most a login or text response (the discovery answer is bounded
//! at 1 MiB), or NVMe/TCP's ICResp, an R2T and a CapsuleResp.

#![no_main]

use blkwire_server::fuzzing::login;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let run = login(data);
    assert!(run.answered <= 4 << 20, "{run:?}");
});
