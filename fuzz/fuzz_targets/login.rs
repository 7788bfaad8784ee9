//! Connection setup before a host has proved anything: the iSCSI login (stages, operational
//! keys, CHAP, a discovery session's SendTargets) and NVMe/TCP's ICReq and Connect (its data
//! in the capsule or solicited with R2T), over a byte stream as the handshake thread runs them
//! over a socket (`blkwire_server::fuzzing::login`); an admin queue Connect creates then serves
//! the rest of the stream (admin and fabrics commands, DH-HMAC-CHAP). The first byte picks the
//! protocol and a target with or without keys; the rest is what the host sends before it
//! closes.
//!
//! No panic on any input, and the target's answers stay bounded: at most the login PDUs it
//! reads, each answered with at most a login or text response (the discovery answer is bounded
//! at 1 MiB), or NVMe/TCP's ICResp, an R2T and a CapsuleResp; then for each admin command
//! (a capsule of at least 72 bytes) at most one C2HData of a log page (256 KiB at most) and
//! its CapsuleResp.

#![no_main]

use blkwire_server::fuzzing::login;
use libfuzzer_sys::fuzz_target;

/// The most an admin command makes the controller send: the longest log page it reads in one
/// Get Log Page (256 KiB), its C2HData header and digest, and a CapsuleResp.
const PER_ADMIN_COMMAND: usize = (256 << 10) + 4096;

fuzz_target!(|data: &[u8]| {
    let run = login(data);
    let commands = data.len() / 72 + 1;
    assert!(
        run.answered <= (4 << 20) + commands * PER_ADMIN_COMMAND,
        "{run:?}"
    );
});
