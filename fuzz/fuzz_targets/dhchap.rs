//! NVMe DH-HMAC-CHAP (crates/auth/src/dhchap.rs): `Message::decode` takes any bytes without
//! panicking, never yields more bytes than it was given, and a message that decodes encodes to
//! at most as many bytes that decode to the same message. The same bytes, cut into AUTH_Send
//! payloads and AUTH_Receive allocation lengths, drive a controller: it never panics, never
//! answers with more than the allocation length, and never lets the host in, since the fuzzer
//! cannot know the host's secret.

#![no_main]

use blkwire_auth::dhchap::{ControllerAuth, DhGroup, HashId, Message, Secret};
use libfuzzer_sys::fuzz_target;

fn payload_bytes(m: &Message) -> usize {
    match m {
        Message::Negotiate(n) => n
            .protocols
            .iter()
            .map(|p| p.hash_ids.len() + p.dh_group_ids.len())
            .sum(),
        Message::Challenge(c) => c.challenge.len() + c.dh_value.len(),
        Message::Reply(r) => r.response.len() + r.challenge.len() + r.dh_value.len(),
        Message::Success1(s) => s.response.as_ref().map_or(0, Vec::len),
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        assert!(payload_bytes(&m) <= data.len());
        let again = m.encode();
        assert!(again.len() <= data.len(), "{m:?}");
        assert_eq!(Message::decode(&again).as_ref(), Ok(&m));
    }

    let Some((&first, mut rest)) = data.split_first() else {
        return;
    };
    let host = Secret::from_bytes(&[0x5a; 32]).unwrap();
    let ctrl_key = Secret::from_bytes(&[0xa5; 48]).unwrap();
    let mut ctrl = ControllerAuth::new(
        "nqn.2014-08.org.nvmexpress:uuid:fuzz",
        "nqn.2024-01.io.blkwire:fuzz",
        &host,
        (first & 1 != 0).then_some(&ctrl_key),
    );
    // A real DH group costs milliseconds a challenge; most runs use the null group.
    let group = if first & 2 != 0 {
        DhGroup::Ffdhe2048
    } else {
        DhGroup::Null
    };
    ctrl.set_preferences(&[HashId::Sha256, HashId::Sha512], &[group]);
    // Each step: a tag byte (even: AUTH_Send, odd: AUTH_Receive) and a 2-byte length, then
    // that many payload bytes (AUTH_Send) or the length as `al` (AUTH_Receive).
    while rest.len() >= 3 {
        let (tag, len) = (rest[0], usize::from(u16::from_le_bytes([rest[1], rest[2]])));
        rest = &rest[3..];
        if tag & 1 == 0 {
            let n = len.min(rest.len());
            let _ = ctrl.on_send(&rest[..n]);
            rest = &rest[n..];
        } else if let Ok(out) = ctrl.on_receive(len as u32) {
            assert!(out.len() <= len);
            assert!(Message::decode(&out).is_ok());
        }
        assert!(!ctrl.authenticated(), "a host without the secret got in");
    }
});
