use super::*;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-a0c9a2ab1b2c";
const SUBSYS: &str = "nqn.2024-01.io.blkwire:test";
/// The example secret of the NVMe specification (quoted in the kernel commit "nvme-auth: allow
/// mixing of secret and hash lengths" and in nvme-cli's documentation).
const SPEC_EXAMPLE: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";
/// Its key, from `python3 -c "import base64; print(base64.b64decode('ia6z...aQ2n')[:32].hex())"`;
/// zlib.crc32 of it, little-endian, is fa690da7 = the last 4 decoded bytes.
const SPEC_KEY: &str = "89aeb31a874eaf84841b46736b0dfdf2ba58d30aa2a545a3e235a3521e07594c";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn secret(byte: u8) -> Secret {
    Secret::from_bytes(&[byte; 32]).unwrap()
}

/// Runs a whole exchange; returns the controller's verdict and the host's.
fn exchange(ctrl: &mut ControllerAuth, host: &mut HostAuth) -> Result<(), Failure> {
    ctrl.on_send(&host.negotiate())?;
    let challenge = ctrl.on_receive(4096).unwrap();
    let reply = host.on_challenge(&challenge)?;
    let verdict = ctrl.on_send(&reply);
    let s1 = ctrl.on_receive(4096).unwrap();
    match host.on_success1(&s1) {
        Ok(Some(s2)) => ctrl.on_send(&s2)?,
        Ok(None) => {}
        Err(e) => {
            // What the kernel host does on a wrong controller response.
            if verdict.is_ok() {
                let _ = ctrl.on_send(&host.failure2(e.reason));
            }
            return Err(e);
        }
    }
    verdict
}

#[test]
fn the_spec_example_secret_parses_and_formats_back() {
    let s = Secret::parse(SPEC_EXAMPLE).unwrap();
    assert_eq!(s.bytes(), hex(SPEC_KEY).as_slice());
    assert_eq!(s.transformation(), None);
    assert_eq!(s.to_dhhc().unwrap(), SPEC_EXAMPLE);
    // Without the trailing ':' (the kernel accepts it too).
    assert_eq!(
        Secret::parse(SPEC_EXAMPLE.trim_end_matches(':')).unwrap(),
        s
    );
    for (xx, h) in [
        ("01", HashId::Sha256),
        ("02", HashId::Sha384),
        ("03", HashId::Sha512),
    ] {
        let t = SPEC_EXAMPLE.replace(":00:", &format!(":{xx}:"));
        let p = Secret::parse(&t).unwrap();
        assert_eq!(p.transformation(), Some(h));
        assert_eq!(p.to_dhhc().unwrap(), t);
    }
}

#[test]
fn a_flipped_character_fails_the_crc() {
    // 'G' -> 'H' at the 5th key character: still base64, other bytes.
    let bad = SPEC_EXAMPLE.replacen("ia6zG", "ia6zH", 1);
    let e = Secret::parse(&bad).unwrap_err();
    assert!(e.contains("CRC-32 does not match"), "{e}");
    // The last character (inside the CRC).
    let bad = SPEC_EXAMPLE.replace("aQ2n:", "aQ2m:");
    assert!(Secret::parse(&bad).unwrap_err().contains("CRC"));
}

#[test]
fn malformed_secrets_say_what_is_wrong() {
    let cases = [
        ("DHHC-2:00:abcd:", "starts with DHHC-1:"),
        ("DHHC-1:00", "no ':' after XX"),
        (
            "DHHC-1:04:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:",
            "'04'",
        ),
        (
            "DHHC-1:1:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:",
            "'1'",
        ),
        (
            "DHHC-1:00:ia6z!odOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:",
            "not base64",
        ),
        (
            "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2:",
            "not base64",
        ),
        ("DHHC-1:00:AAAAAAAA:", "decodes to 6 bytes"),
        ("DHHC-1:00::", "not base64"),
        // XX: left out: the key is where XX should be.
        (
            "DHHC-1:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:",
            "is XX: missing?",
        ),
    ];
    for (text, want) in cases {
        let e = Secret::parse(text).unwrap_err();
        assert!(e.contains(want), "{text}: {e}");
        assert!(!e.contains('\n'));
        assert!(!e.contains("ia6z"), "errors never quote the key: {e}");
    }
    // Not even a few characters of it: no run of 4 of the key's characters is in the error.
    let key = "ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n";
    let e = Secret::parse(&format!("DHHC-1:{key}:")).unwrap_err();
    for i in 0..=key.len() - 4 {
        assert!(
            !e.contains(&key[i..i + 4]),
            "quotes '{}': {e}",
            &key[i..i + 4]
        );
    }
}

#[test]
fn generated_and_raw_secrets_round_trip_their_representation() {
    for len in [32, 48, 64] {
        let raw: Vec<u8> = (0..len as u8).collect();
        let s = Secret::from_bytes(&raw).unwrap();
        let text = s.to_dhhc().unwrap();
        assert!(
            text.starts_with("DHHC-1:00:") && text.ends_with(':'),
            "{text}"
        );
        assert_eq!(Secret::parse(&text).unwrap(), s);
    }
    let g = Secret::generate();
    assert_eq!(g.bytes().len(), 32);
    assert_eq!(Secret::parse(&g.to_dhhc().unwrap()).unwrap(), g);
    assert_ne!(Secret::generate(), g);
}

#[test]
fn only_kernel_lengths_have_a_representation() {
    for len in [0, 16, 31, 33, 65] {
        assert!(Secret::from_bytes(&vec![1; len]).is_err(), "{len}");
    }
    let k = crate::Key::new(&[1; 16]).unwrap();
    let e = Secret::from_key(&k).to_dhhc().unwrap_err();
    assert!(e.contains("16-byte key"), "{e}");
    let k = crate::Key::new(&[1; 48]).unwrap();
    assert!(Secret::from_key(&k).to_dhhc().is_ok());
}

#[test]
fn secrets_never_print_their_bytes() {
    let s = Secret::from_bytes(&[0xab; 32]).unwrap();
    let shown = format!("{s:?}");
    assert!(!shown.contains("ab") && !shown.contains("171"), "{shown}");
}

#[test]
fn base64_is_strict() {
    assert_eq!(base64_encode(b"f"), "Zg==");
    assert_eq!(base64_encode(b"fo"), "Zm8=");
    assert_eq!(base64_encode(b"foo"), "Zm9v");
    assert_eq!(base64_decode("Zg==").unwrap(), b"f");
    assert_eq!(base64_decode("Zm8=").unwrap(), b"fo");
    assert_eq!(base64_decode("Zm9vYmFy").unwrap(), b"foobar");
    for bad in ["Zg=", "Zh==", "Z===", "Zg=a", "=Zg=", "Zm9v\n", ""] {
        assert_eq!(base64_decode(bad), None, "{bad}");
    }
    // zlib.crc32(b"123456789") == 0xcbf43926, the CRC-32 check value.
    assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
}

/// The key transformation and both responses against an independent computation with
/// Python's hmac/hashlib (python3 on the build machine):
///
/// ```text
/// key = base64.b64decode('ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n')[:32]
/// kt  = hmac.new(key, HOST + b"NVMe-over-Fabrics", sha256).digest()        # DHHC-1:01
/// r1  = hmac.new(kt, bytes(range(32)) + pack("<I", 0x01020304) + pack("<H", 0x0506)
///                + b"\0" + b"HostHost" + HOST + b"\0" + SUBSYS, sha256).digest()
/// r2  = hmac.new(key, b"\xaa" * 32 + pack("<I", 7) + pack("<H", 0x0506)
///                + b"\0" + b"Controller" + SUBSYS + b"\0" + HOST, sha256).digest()  # DHHC-1:00
/// ca  = hmac.new(sha384(bytes(range(256))).digest(), b"\x11" * 48, sha384).digest()
/// ```
#[test]
fn responses_match_an_independent_computation() {
    let s = Secret::parse(&SPEC_EXAMPLE.replace(":00:", ":01:")).unwrap();
    let kt = s.transformed(HOST);
    assert_eq!(
        kt,
        hex("0cca931162872d3f8746bf08feaf42813348f692eba516aa697b386827ede7a9")
    );
    let c1: Vec<u8> = (0..32).collect();
    let r1 = host_response(HashId::Sha256, &kt, &c1, 0x0102_0304, 0x0506, HOST, SUBSYS);
    assert_eq!(
        r1,
        hex("704114cc54429cb1d0a6b9ebe72c19a13fc9cec0c443eebb584fc19071522dd7")
    );
    let plain = Secret::parse(SPEC_EXAMPLE).unwrap();
    assert_eq!(plain.transformed(SUBSYS), hex(SPEC_KEY));
    let r2 = controller_response(
        HashId::Sha256,
        &plain.transformed(SUBSYS),
        &[0xaa; 32],
        7,
        0x0506,
        HOST,
        SUBSYS,
    );
    assert_eq!(
        r2,
        hex("616f348095b608355e8bd0621309481c25193829ae1c73f58985767420e3f481")
    );
    let shared: Vec<u8> = (0..=255).collect();
    assert_eq!(
        augmented_challenge(HashId::Sha384, &shared, &[0x11; 48]),
        hex(concat!(
            "dced43bd1848e1bc4035a5ace5e15dba319a0fe88ec99b647f52f3ee1d8d15af",
            "75d7ce96f9a0049e19036f03a950089b"
        ))
    );
}

#[test]
fn round_trips_for_every_hash_and_group_one_and_two_way() {
    for hash in [HashId::Sha256, HashId::Sha384, HashId::Sha512] {
        for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
            for bidi in [false, true] {
                let (hk, ck) = (secret(1), secret(2));
                let ck = bidi.then_some(&ck);
                let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &hk, ck);
                ctrl.set_preferences(&[hash], &[group]);
                let mut host = HostAuth::new(HOST, SUBSYS, &hk, ck, 7);
                exchange(&mut ctrl, &mut host)
                    .unwrap_or_else(|e| panic!("{hash:?} {group:?} bidi {bidi}: {e}"));
                assert_eq!(ctrl.state(), State::Succeeded);
                assert!(ctrl.authenticated() && host.succeeded());
                assert_eq!(ctrl.negotiated(), (hash, group));
            }
        }
    }
}

#[test]
fn defaults_pick_sha256_and_ffdhe2048_from_the_kernels_offer() {
    let k = Secret::parse(&SPEC_EXAMPLE.replace(":00:", ":03:")).unwrap();
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
    let mut host = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 0);
    exchange(&mut ctrl, &mut host).unwrap();
    assert_eq!(ctrl.negotiated(), (HashId::Sha256, DhGroup::Ffdhe2048));
    // A host offering only SHA-512 and null gets those.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 1);
    host.set_offer(&[9, 3], &[7, 0]);
    exchange(&mut ctrl, &mut host).unwrap();
    assert_eq!(ctrl.negotiated(), (HashId::Sha512, DhGroup::Null));
}

#[test]
fn the_larger_groups_work_too() {
    for group in [DhGroup::Ffdhe3072, DhGroup::Ffdhe4096, DhGroup::Ffdhe8192] {
        let k = secret(3);
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
        ctrl.set_preferences(&[], &[group]);
        let mut host = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 2);
        exchange(&mut ctrl, &mut host).unwrap();
        assert_eq!(ctrl.negotiated().1, group);
    }
}

#[test]
fn a_wrong_host_key_gets_failure1_authentication_failed() {
    for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &secret(1), None);
        ctrl.set_preferences(&[], &[group]);
        let mut host = HostAuth::new(HOST, SUBSYS, &secret(9), None, 3);
        ctrl.on_send(&host.negotiate()).unwrap();
        let reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
        assert_eq!(ctrl.on_send(&reply), Err(Failure::new(Reason::Failed)));
        assert_eq!(ctrl.state(), State::Failure1);
        assert!(!ctrl.authenticated());
        let f1 = ctrl.on_receive(4096).unwrap();
        assert_eq!(f1, [0x00, 0xf1, 0, 0, 3, 0, RESCODE_FAILED, 1]);
        assert_eq!(ctrl.state(), State::Failed);
        assert_eq!(host.on_success1(&f1), Err(Failure::new(Reason::Failed)));
        assert!(!host.succeeded());
    }
}

/// A host whose Reply proved its key may still be refused by the transport (its sessions
/// cannot be admitted): Success1 is never sent, the AUTH_Receive reads Failure1 (reason
/// "authentication failed") instead, which the host takes as the end of the exchange, and the
/// controller's side is over for good. Bidirectional too: the refusal comes before the
/// controller proves itself. Before the host's proof nothing says it proved anything.
#[test]
fn a_proved_host_refused_by_the_transport_reads_failure1() {
    for ctrl_key in [None, Some(secret(2))] {
        let hk = secret(1);
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &hk, ctrl_key.as_ref());
        let mut host = HostAuth::new(HOST, SUBSYS, &hk, ctrl_key.as_ref(), 7);
        assert!(!ctrl.host_proved());
        ctrl.on_send(&host.negotiate()).unwrap();
        let reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
        assert!(!ctrl.host_proved(), "before the Reply");
        ctrl.on_send(&reply).unwrap();
        assert!(ctrl.host_proved());
        ctrl.refuse(Reason::Failed);
        assert_eq!(ctrl.state(), State::Failure1);
        assert!(!ctrl.host_proved() && !ctrl.authenticated());
        let f1 = ctrl.on_receive(4096).unwrap();
        assert_eq!(f1, [0x00, 0xf1, 0, 0, 7, 0, RESCODE_FAILED, 1]);
        assert_eq!(ctrl.state(), State::Failed);
        assert_eq!(host.on_success1(&f1), Err(Failure::new(Reason::Failed)));
        assert!(!host.succeeded());
    }
    // A wrong key never counts as proved, whatever the transport does.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &secret(1), None);
    let mut host = HostAuth::new(HOST, SUBSYS, &secret(9), None, 8);
    ctrl.on_send(&host.negotiate()).unwrap();
    let reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    assert!(ctrl.on_send(&reply).is_err());
    assert!(!ctrl.host_proved());
    // Refused after Success1 was read (nothing left to carry Failure1): over at once.
    let hk = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &hk, Some(&secret(2)));
    let mut host = HostAuth::new(HOST, SUBSYS, &hk, Some(&secret(2)), 9);
    ctrl.on_send(&host.negotiate()).unwrap();
    let reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    ctrl.on_send(&reply).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(ctrl.state(), State::Success2);
    ctrl.refuse(Reason::Failed);
    assert_eq!(ctrl.state(), State::Failed);
}

#[test]
fn the_same_key_under_another_host_nqn_fails() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let mut host = HostAuth::new("nqn.2014-08.org.nvmexpress:uuid:other", SUBSYS, &k, None, 0);
    assert_eq!(
        exchange(&mut ctrl, &mut host),
        Err(Failure::new(Reason::Failed))
    );
    assert!(!ctrl.authenticated());
}

#[test]
fn a_wrong_controller_key_is_caught_by_the_host() {
    for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
        let hk = secret(1);
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &hk, Some(&secret(2)));
        ctrl.set_preferences(&[], &[group]);
        let mut host = HostAuth::new(HOST, SUBSYS, &hk, Some(&secret(8)), 4);
        assert_eq!(
            exchange(&mut ctrl, &mut host),
            Err(Failure::new(Reason::Failed))
        );
        assert!(!host.succeeded());
        // The host's Failure2 ends it on the controller too.
        assert_eq!(ctrl.state(), State::Failed);
        assert!(!ctrl.authenticated());
    }
}

#[test]
fn a_challenge_c2_without_a_controller_key_fails() {
    let hk = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &hk, None);
    let mut host = HostAuth::new(HOST, SUBSYS, &hk, Some(&secret(2)), 5);
    assert_eq!(
        exchange(&mut ctrl, &mut host),
        Err(Failure::new(Reason::Failed))
    );
    assert!(!ctrl.authenticated());
}

#[test]
fn a_success1_without_r2_is_refused_when_r2_was_asked_for() {
    let k = secret(1);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 6);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
    ctrl.set_preferences(&[], &[DhGroup::Null]);
    ctrl.on_send(&host.negotiate()).unwrap();
    host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    let forged = Message::Success1(Success1 {
        t_id: 6,
        hl: 32,
        response: None,
    })
    .encode();
    assert_eq!(host.on_success1(&forged), Err(Failure::new(Reason::Failed)));
}

#[test]
fn a_wrong_transaction_id_is_an_incorrect_payload() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 10);
    ctrl.on_send(&host.negotiate()).unwrap();
    let mut reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    reply[4] ^= 1;
    assert_eq!(
        ctrl.on_send(&reply),
        Err(Failure::new(Reason::IncorrectPayload))
    );
    let f1 = ctrl.on_receive(4096).unwrap();
    assert_eq!(f1[7], 6);
    assert!(!ctrl.authenticated());

    // The host refuses a challenge of another transaction.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 10);
    ctrl.on_send(&host.negotiate()).unwrap();
    let mut ch = ctrl.on_receive(4096).unwrap();
    ch[5] ^= 0x80;
    assert_eq!(
        host.on_challenge(&ch),
        Err(Failure::new(Reason::IncorrectMessage))
    );
}

#[test]
fn a_tampered_sequence_number_or_challenge_fails() {
    let k = secret(1);
    for at in [12, 16] {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
        ctrl.set_preferences(&[], &[DhGroup::Null]);
        let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 11);
        ctrl.on_send(&host.negotiate()).unwrap();
        let mut ch = ctrl.on_receive(4096).unwrap();
        ch[at] ^= 1; // S1, or the first byte of C1
        let reply = host.on_challenge(&ch).unwrap();
        assert_eq!(ctrl.on_send(&reply), Err(Failure::new(Reason::Failed)));
    }
}

#[test]
fn replayed_replies_never_pass() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.set_preferences(&[], &[DhGroup::Null]);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 12);
    ctrl.on_send(&host.negotiate()).unwrap();
    let old = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    ctrl.on_send(&old).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(ctrl.state(), State::Succeeded);
    // Again after success: out of place, final.
    assert_eq!(
        ctrl.on_send(&old),
        Err(Failure::new(Reason::IncorrectMessage))
    );
    assert_eq!(ctrl.state(), State::Failed);
    assert!(!ctrl.authenticated());

    // In a new exchange with the same transaction id: S1 and C1 differ.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.set_preferences(&[], &[DhGroup::Null]);
    ctrl.on_send(&host.negotiate()).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(ctrl.on_send(&old), Err(Failure::new(Reason::Failed)));
    assert!(!ctrl.authenticated());
}

#[test]
fn out_of_order_messages_are_incorrect_messages() {
    let k = secret(1);
    let host = HostAuth::new(HOST, SUBSYS, &k, None, 13);
    let success2 = Message::Success2 { t_id: 13 }.encode();
    let reply = Message::Reply(Reply {
        t_id: 13,
        cvalid: false,
        seqnum: 0,
        response: vec![0; 32],
        challenge: vec![0; 32],
        dh_value: vec![],
    })
    .encode();
    // Before Negotiate.
    for m in [&success2, &reply] {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
        assert_eq!(ctrl.on_send(m), Err(Failure::new(Reason::IncorrectMessage)));
        assert_eq!(ctrl.state(), State::Failed);
    }
    // A Reply before the Challenge was read; Success2 instead of the Reply.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.on_send(&host.negotiate()).unwrap();
    assert_eq!(
        ctrl.on_send(&reply),
        Err(Failure::new(Reason::IncorrectMessage))
    );
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.on_send(&host.negotiate()).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(
        ctrl.on_send(&success2),
        Err(Failure::new(Reason::IncorrectMessage))
    );
    assert!(!ctrl.authenticated());
    // A controller-to-host message sent to the controller.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.on_send(&host.negotiate()).unwrap();
    let ch = ctrl.on_receive(4096).unwrap();
    assert_eq!(
        ctrl.on_send(&ch),
        Err(Failure::new(Reason::IncorrectMessage))
    );
    // An AUTH_Receive out of place gets Failure1 "failed" and ends it.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let f1 = ctrl.on_receive(4096).unwrap();
    assert_eq!(f1[1], MSG_FAILURE1);
    assert_eq!(f1[7], 1);
    assert_eq!(ctrl.state(), State::Failed);
    // Nothing revives a failed exchange, not even a Negotiate.
    assert!(ctrl.on_send(&host.negotiate()).is_err());
    assert_eq!(ctrl.state(), State::Failed);
}

#[test]
fn unusable_offers_get_their_reasons() {
    let k = secret(1);
    let cases: [(&[u8], &[u8], Reason); 3] = [
        (&[9, 200], &[0, 1], Reason::HashUnusable),
        (&[1], &[9], Reason::DhGroupUnusable),
        (&[], &[0], Reason::HashUnusable),
    ];
    for (hashes, groups, reason) in cases {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
        let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 14);
        host.set_offer(hashes, groups);
        assert_eq!(ctrl.on_send(&host.negotiate()), Err(Failure::new(reason)));
        let f1 = ctrl.on_receive(4096).unwrap();
        assert_eq!((f1[1], f1[4], f1[7]), (MSG_FAILURE1, 14, reason.code()));
        assert_eq!(host.on_challenge(&f1), Err(Failure::new(reason)));
    }
    // Secure channel concatenation, two descriptors, another protocol id, short.
    let mut n = HostAuth::new(HOST, SUBSYS, &k, None, 0).negotiate();
    for (patch, reason) in [
        ((6, 1), Reason::ConcatMismatch),
        ((7, 2), Reason::IncorrectPayload),
        ((7, 0), Reason::HashUnusable),
        ((8, 2), Reason::IncorrectPayload),
        ((10, 31), Reason::IncorrectPayload),
    ] {
        let mut m = n.clone();
        m[patch.0] = patch.1;
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
        assert_eq!(ctrl.on_send(&m), Err(Failure::new(reason)), "{patch:?}");
    }
    n.truncate(71);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    assert_eq!(
        ctrl.on_send(&n),
        Err(Failure::new(Reason::IncorrectPayload))
    );
}

#[test]
fn truncated_messages_are_refused_without_panic() {
    let k = secret(1);
    for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
        ctrl.set_preferences(&[], &[group]);
        let mut host = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 15);
        let neg = host.negotiate();
        ctrl.on_send(&neg).unwrap();
        let ch = ctrl.on_receive(4096).unwrap();
        let reply = host.on_challenge(&ch).unwrap();
        for msg in [&neg, &ch, &reply] {
            for n in 0..msg.len() {
                let _ = Message::decode(&msg[..n]);
            }
            assert!(Message::decode(msg).is_ok());
        }
        for n in [0, 1, 5, 6, 15, 16, 17, reply.len() - 1] {
            let mut c = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
            c.set_preferences(&[], &[group]);
            c.on_send(&neg).unwrap();
            let ch = c.on_receive(4096).unwrap();
            let mut h = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 15);
            let reply = h.on_challenge(&ch).unwrap();
            assert!(c.on_send(&reply[..n]).is_err(), "{n}");
            assert!(!c.authenticated());
            assert!(h.on_challenge(&ch[..ch.len() - 1]).is_err());
        }
    }
}

#[test]
fn invalid_dh_values_are_refused() {
    let k = secret(1);
    let p = hex(&ffdhe::FFDHE2048.to_lowercase());
    let mut p_minus_1 = p.clone();
    *p_minus_1.last_mut().unwrap() -= 1;
    let mut one = vec![0u8; 256];
    one[255] = 1;
    for bad in [
        vec![0u8; 256],
        one,
        p_minus_1,
        p,
        vec![0xff; 256],
        vec![2u8; 255],
    ] {
        let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
        ctrl.set_preferences(&[], &[DhGroup::Ffdhe2048]);
        let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 16);
        ctrl.on_send(&host.negotiate()).unwrap();
        let ch = ctrl.on_receive(4096).unwrap();
        let reply = host.on_challenge(&ch).unwrap();
        let Ok(Message::Reply(mut r)) = Message::decode(&reply) else {
            panic!("reply")
        };
        r.dh_value = bad.clone();
        assert_eq!(
            ctrl.on_send(&Message::Reply(r).encode()),
            Err(Failure::new(Reason::DhGroupUnusable))
        );
        // And the host refuses the same from the controller.
        let Ok(Message::Challenge(mut c)) = Message::decode(&ch) else {
            panic!("challenge")
        };
        c.dh_value = bad;
        let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 16);
        assert!(host.on_challenge(&Message::Challenge(c).encode()).is_err());
    }
    // A DH value with the null group; none with ffdhe2048.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.set_preferences(&[], &[DhGroup::Null]);
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 17);
    ctrl.on_send(&host.negotiate()).unwrap();
    let reply = host.on_challenge(&ctrl.on_receive(4096).unwrap()).unwrap();
    let Ok(Message::Reply(mut r)) = Message::decode(&reply) else {
        panic!("reply")
    };
    r.dh_value = vec![2; 256];
    assert_eq!(
        ctrl.on_send(&Message::Reply(r).encode()),
        Err(Failure::new(Reason::IncorrectPayload))
    );
}

#[test]
fn messages_have_the_kernels_layout() {
    let host = HostAuth::new(HOST, SUBSYS, &secret(1), None, 0x1234);
    let n = host.negotiate();
    // nvme_auth_set_dhchap_negotiate_data: 8-byte header and one 64-byte descriptor.
    assert_eq!(n.len(), 72);
    assert_eq!(&n[..8], &[0, 0, 0, 0, 0x34, 0x12, 0, 1]);
    assert_eq!(&n[8..15], &[1, 0, 3, 6, 1, 2, 3]);
    // idlist starts at byte 12; DH group ids at idlist[30].
    assert_eq!(&n[15..42], &[0; 27]);
    assert_eq!(&n[42..48], &[0, 1, 2, 3, 4, 5]);
    assert_eq!(&n[48..], &[0; 24]);

    let c = Message::Challenge(Challenge {
        t_id: 0x1234,
        hash_id: 1,
        dh_group_id: 1,
        seqnum: 0xa1b2c3d4,
        challenge: vec![0xcc; 32],
        dh_value: vec![0xdd; 256],
    })
    .encode();
    assert_eq!(
        &c[..16],
        &[1, 1, 0, 0, 0x34, 0x12, 32, 0, 1, 1, 0, 1, 0xd4, 0xc3, 0xb2, 0xa1]
    );
    assert_eq!(c.len(), 16 + 32 + 256);

    let r = Message::Reply(Reply {
        t_id: 0x1234,
        cvalid: true,
        seqnum: 5,
        response: vec![0xee; 48],
        challenge: vec![0xff; 48],
        dh_value: vec![],
    })
    .encode();
    assert_eq!(
        &r[..16],
        &[1, 2, 0, 0, 0x34, 0x12, 48, 0, 1, 0, 0, 0, 5, 0, 0, 0]
    );
    assert_eq!(r.len(), 16 + 96);

    let s1 = Message::Success1(Success1 {
        t_id: 0x1234,
        hl: 32,
        response: Some(vec![0xab; 32]),
    })
    .encode();
    assert_eq!(
        &s1[..16],
        &[1, 3, 0, 0, 0x34, 0x12, 32, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(s1.len(), 48);
    assert_eq!(
        Message::Success2 { t_id: 0x1234 }.encode(),
        [1, 4, 0, 0, 0x34, 0x12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        host.failure2(Reason::Failed),
        [0, 0xf0, 0, 0, 0x34, 0x12, 1, 1]
    );

    // A message decodes from a zero-filled 4096-byte AUTH_Receive buffer (nvmet pads to al).
    let mut buf = vec![0u8; 4096];
    buf[..c.len()].copy_from_slice(&c);
    assert_eq!(Message::decode(&buf).unwrap().encode(), c);
}

#[test]
fn a_short_allocation_length_leaves_the_exchange_as_it_was() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, Some(&k));
    let mut host = HostAuth::new(HOST, SUBSYS, &k, Some(&k), 18);
    ctrl.on_send(&host.negotiate()).unwrap();
    let need = 16 + 32 + 256;
    assert_eq!(
        ctrl.on_receive(need as u32 - 1),
        Err(ReceiveError::TooSmall { need })
    );
    assert_eq!(ctrl.state(), State::Challenge);
    let ch = ctrl.on_receive(need as u32).unwrap();
    assert_eq!(ch.len(), need);
    let reply = host.on_challenge(&ch).unwrap();
    ctrl.on_send(&reply).unwrap();
    assert_eq!(
        ctrl.on_receive(47),
        Err(ReceiveError::TooSmall { need: 48 })
    );
    // A huge allocation length does not make a huge buffer.
    let s1 = ctrl.on_receive(u32::MAX).unwrap();
    assert_eq!(s1.len(), 48);
    ctrl.on_send(&host.on_success1(&s1).unwrap().unwrap())
        .unwrap();
    assert!(ctrl.authenticated());
}

#[test]
fn reauthentication_keeps_the_queue_usable_until_it_fails() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    exchange(&mut ctrl, &mut HostAuth::new(HOST, SUBSYS, &k, None, 20)).unwrap();
    let mut host = HostAuth::new(HOST, SUBSYS, &k, None, 21);
    ctrl.on_send(&host.negotiate()).unwrap();
    assert!(
        ctrl.authenticated(),
        "I/O in flight during re-authentication"
    );
    let ch = ctrl.on_receive(4096).unwrap();
    ctrl.on_send(&host.on_challenge(&ch).unwrap()).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(ctrl.state(), State::Succeeded);
    // A failing re-authentication revokes it.
    let mut bad = HostAuth::new(HOST, SUBSYS, &secret(2), None, 22);
    assert!(exchange(&mut ctrl, &mut bad).is_err());
    assert!(!ctrl.authenticated());
}

#[test]
fn the_host_gives_up_with_failure2_and_the_controller_stops() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let host = HostAuth::new(HOST, SUBSYS, &k, None, 23);
    ctrl.on_send(&host.negotiate()).unwrap();
    ctrl.on_receive(4096).unwrap();
    assert_eq!(
        ctrl.on_send(&host.failure2(Reason::DhGroupUnusable)),
        Err(Failure::new(Reason::DhGroupUnusable))
    );
    assert_eq!(ctrl.state(), State::Failed);
}

#[test]
fn commands_are_checked_as_nvmet_checks_them() {
    assert_eq!(check_command(0xe9, 1, 1, 72), Ok(()));
    assert_eq!(check_command(0xea, 1, 1, 72), Err(CommandField::Secp));
    assert_eq!(check_command(0xe9, 0, 1, 72), Err(CommandField::Spsp0));
    assert_eq!(check_command(0xe9, 1, 2, 72), Err(CommandField::Spsp1));
    assert_eq!(check_command(0xe9, 1, 1, 0), Err(CommandField::Length));
    assert_eq!(CONNECT_AUTHREQ_ATR, 0x0002_0000);
}

#[test]
fn the_primes_have_the_rfc_7919_shape() {
    for g in [
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ] {
        let h = g.prime_hex().unwrap();
        assert_eq!(h.len(), g.value_len() * 2, "{g:?}");
        // p = 2^b - 2^(b-64) + {[2^(b-130) e] + X} * 2^64 - 1: 64 one bits at each end and
        // the bits of e after them (e = 2.71828... = 0x2.B7E151628AED2A6A...).
        assert!(
            h.starts_with("FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1"),
            "{g:?}"
        );
        assert!(h.ends_with("FFFFFFFFFFFFFFFF"), "{g:?}");
        assert!(DhKey::generate(g).is_some());
    }
}

#[test]
fn shared_secrets_keep_their_leading_zeros() {
    // About 1 in 256 shared secrets starts with a zero byte; the kernel's kpp writes it
    // padded to the prime's size, and so must we, or such exchanges would fail.
    let mut padded = 0;
    for _ in 0..3000 {
        let a = DhKey::generate(DhGroup::Ffdhe2048).unwrap();
        let b = DhKey::generate(DhGroup::Ffdhe2048).unwrap();
        let ab = a.shared(&b.public().unwrap()).unwrap();
        let ba = b.shared(&a.public().unwrap()).unwrap();
        assert_eq!(ab.0.len(), 256);
        assert_eq!(ab.0, ba.0);
        // Against OpenSSL's plain modular exponentiation: y_b^x_a mod p, padded.
        let x_a = a.key.dh().unwrap();
        let p = BigNum::from_hex_str(ffdhe::FFDHE2048).unwrap();
        let y_b = BigNum::from_slice(&b.public().unwrap()).unwrap();
        let mut z = BigNum::new().unwrap();
        let mut ctx = openssl::bn::BigNumContext::new().unwrap();
        z.mod_exp(&y_b, x_a.private_key(), &p, &mut ctx).unwrap();
        assert_eq!(ab.0, z.to_vec_padded(256).unwrap());
        if ab.0[0] == 0 {
            padded += 1;
            break;
        }
    }
    assert!(
        padded > 0,
        "no shared secret with a leading zero in 3000 tries"
    );
}

/// A host that has not authenticated may restart its exchange (a Negotiate in the middle of
/// one) a couple of times, not without end: each restart costs the controller a DH key pair
/// of the host's choosing (ffdhe8192 included), so a host without the key could keep it
/// computing them. A restarted exchange still succeeds; past the limit the controller stops.
#[test]
fn restarts_before_authenticating_are_bounded() {
    let k = secret(1);
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    let host = HostAuth::new(HOST, SUBSYS, &k, None, 30);
    for _ in 0..=MAX_RESTARTS {
        ctrl.on_send(&host.negotiate()).unwrap();
        ctrl.on_receive(4096).unwrap();
    }
    assert!(
        ctrl.on_send(&host.negotiate()).is_err(),
        "one restart too many"
    );
    assert_eq!(ctrl.state(), State::Failed);
    // Within the limit, the exchange that follows a restart completes.
    let mut ctrl = ControllerAuth::new(HOST, SUBSYS, &k, None);
    ctrl.on_send(&HostAuth::new(HOST, SUBSYS, &k, None, 31).negotiate())
        .unwrap();
    exchange(&mut ctrl, &mut HostAuth::new(HOST, SUBSYS, &k, None, 32)).unwrap();
    assert!(ctrl.authenticated());
}
