//! Authentication, access rules and datagram integrity (PROTOCOL.md §12), against a real
//! target: right keys work; wrong, missing and unknown keys and ACL denials fail with one line
//! naming the host and the target and leave nothing behind; the UDP session hijack is dropped;
//! a challenge never amplifies.

mod common;

use std::net::UdpSocket;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use blkwire_client::{connect, ConnectOptions, Url};
use blkwire_wire::{AuthBlock, AuthMethod, Header, Hello, Opcode, Status, Tag, HEADER_LEN};
use common::native_raw::join_request;
use common::netlab::{NetLab, Served};
use common::{cli, random_bytes, Target, TempDir};

/// Key files for alice and bob (known to the target) and mallory (not known), plus a file that
/// claims to be alice with a key of its own; and the target's key file (alice + bob).
struct Keys {
    dir: TempDir,
}

impl Keys {
    fn new(tag: &str) -> Keys {
        let dir = TempDir::new(tag);
        for (file, host) in [
            ("alice", "alice"),
            ("bob", "bob"),
            ("mallory", "mallory"),
            ("fake-alice", "alice"),
        ] {
            let (ok, _, err) = cli(&[
                "key",
                "gen",
                dir.path(file).to_str().unwrap(),
                "--host-id",
                host,
            ]);
            assert!(ok, "key gen: {err}");
        }
        let target = format!(
            "{}{}",
            std::fs::read_to_string(dir.path("alice")).unwrap(),
            std::fs::read_to_string(dir.path("bob")).unwrap()
        );
        std::fs::write(dir.path("target"), target).unwrap();
        std::fs::set_permissions(dir.path("target"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        Keys { dir }
    }

    fn file(&self, name: &str) -> String {
        self.dir.path(name).to_str().unwrap().to_string()
    }

    /// `--host-id HOST --key FILE`
    fn as_host(&self, host: &str, file: &str) -> [String; 4] {
        [
            "--host-id".into(),
            host.into(),
            "--key".into(),
            self.file(file),
        ]
    }
}

fn start(keys: &Keys) -> (Target, Vec<String>) {
    Target::start_listeners(
        &["d=mem:8M", "bobs=mem:1M,allow=bob"],
        &[
            "--listen",
            "udp://127.0.0.1:0",
            "--keys",
            &keys.file("target"),
            "--admin",
            "alice",
        ],
    )
}

fn run(args: &[&str], who: &[String]) -> (bool, String, String) {
    let mut v: Vec<&str> = args.to_vec();
    v.extend(who.iter().map(String::as_str));
    cli(&v)
}

fn stats(t: &Target, keys: &Keys) -> serde_json::Value {
    let (ok, out, err) = run(
        &["stats", &t.base, "--json"],
        &keys.as_host("alice", "alice"),
    );
    assert!(ok, "stats as admin: {err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn keys_admit_proven_hosts_and_refuse_every_other_over_tcp_and_udp() {
    let keys = Keys::new("auth-matrix");
    let (t, urls) = start(&keys);
    let data = random_bytes(3 << 20, 7);
    let src = keys.dir.path("src");
    std::fs::write(&src, &data).unwrap();
    let back = keys.dir.path("back");
    let alice = keys.as_host("alice", "alice");
    let mut refusals = 0;
    for base in &urls {
        let url = format!("{base}/d");
        let authority = base.split_once("://").unwrap().1;
        // Every refusal is one line that names the host and the target, and a failure exit.
        for (who, host, want) in [
            (keys.as_host("alice", "fake-alice"), "alice", "key is wrong"),
            (
                keys.as_host("mallory", "mallory"),
                "mallory",
                "key is wrong or unknown",
            ),
            (keys.as_host("alice", "alice"), "alice", "does not allow"), // ACL: bobs is bob's
        ] {
            let export = if want == "does not allow" {
                "bobs"
            } else {
                "d"
            };
            let (ok, out, err) = run(&["info", &format!("{base}/{export}")], &who);
            assert!(!ok, "{url}: {host} {want}: admitted: {out}");
            assert_eq!(err.trim().lines().count(), 1, "{url}: one line: {err}");
            assert!(
                err.contains(&format!("host '{host}'"))
                    && err.contains(authority)
                    && err.contains(want),
                "{url}: {host}: {err}"
            );
            refusals += 1;
        }
        // No key at all: told that one is needed.
        let (ok, _, err) = cli(&["info", &url, "--host-id", "alice"]);
        assert!(
            !ok && err.contains("requires a key"),
            "{url}: no key: {err}"
        );
        refusals += 1;
    }
    // Refused handshakes leave nothing behind.
    let v = stats(&t, &keys);
    assert_eq!(
        v["sessions"].as_array().unwrap().len(),
        0,
        "sessions left behind: {}",
        v["sessions"]
    );
    for base in &urls {
        let url = format!("{base}/d");
        // The right key: data round trips.
        let (ok, _, err) = run(
            &["cp", "--no-progress", src.to_str().unwrap(), &url],
            &alice,
        );
        assert!(ok, "{url}: upload as alice: {err}");
        let (ok, _, err) = run(
            &["cp", "--no-progress", &url, back.to_str().unwrap()],
            &alice,
        );
        assert!(ok, "{url}: download as alice: {err}");
        assert!(
            std::fs::read(&back).unwrap()[..data.len()] == data[..],
            "{url}: data differs"
        );
        // bob may open his export.
        let (ok, out, err) = run(
            &["info", &format!("{base}/bobs"), "--json"],
            &keys.as_host("bob", "bob"),
        );
        assert!(ok, "{url}: bob on bobs: {err}");
        assert!(out.contains("\"size\":1048576"), "{out}");
    }
    // LIST shows each host only what it may open; without a key, nothing at all.
    let (ok, out, err) = run(&["info", &t.base, "--json"], &alice);
    assert!(ok, "{err}");
    assert!(
        out.contains("\"d\"") && !out.contains("bobs"),
        "alice's list: {out}"
    );
    let (ok, out, _) = run(&["info", &t.base, "--json"], &keys.as_host("bob", "bob"));
    assert!(ok && out.contains("bobs"), "bob's list: {out}");
    let (ok, _, err) = cli(&["info", &t.base]);
    assert!(!ok, "an anonymous LIST was answered");
    assert!(err.contains("requires a key"), "{err}");
    refusals += 1;
    // STATS: only for --admin hosts; counters show the refusals; nothing was left open.
    let (ok, _, err) = run(&["stats", &t.base], &keys.as_host("bob", "bob"));
    assert!(!ok, "bob is no admin but read STATS");
    assert!(err.contains("host 'bob'"), "{err}");
    refusals += 1;
    let v = stats(&t, &keys);
    assert!(
        v["auth"]["refused"].as_u64().unwrap() >= refusals,
        "at least {refusals} refusals counted: {}",
        v["auth"]
    );
    assert!(
        v["auth"]["challenges"].as_u64().unwrap() > 0,
        "{}",
        v["auth"]
    );
}

/// `discover --key`: a target that lists its exports to the key says them; one that refuses the
/// key is named in one error line (exit status 1) and, in the JSON document, beside the others,
/// instead of ending the listing with nothing printed.
#[test]
fn discover_with_a_key_lists_what_it_can_and_names_what_refused() {
    let keys = Keys::new("auth-discover");
    let (_t, urls) = start(&keys);
    let udp = urls.iter().find(|u| u.starts_with("udp://")).unwrap();
    let (ok, out, err) = run(
        &["discover", udp, "--wait-ms", "2000"],
        &keys.as_host("alice", "alice"),
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("/d ") && !out.contains("requires a key"),
        "{out}"
    );
    let (ok, out, err) = run(
        &["discover", udp, "--wait-ms", "2000", "--json"],
        &keys.as_host("mallory", "mallory"),
    );
    assert!(!ok, "a refused key is a failure: {out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(udp.as_str()) && err.contains("did not list"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("the JSON document is printed");
    let target = &v["targets"][0];
    assert_eq!(target["requires_key"], true, "{v}");
    assert!(
        target["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{v}"
    );
}

/// An --admin host with no key in the key store is served (keys may be added later) but warned
/// of, most likely a typo; one with a key is not.
#[test]
fn an_admin_without_a_key_is_warned_of() {
    let keys = Keys::new("auth-admin-typo");
    let mut cmd = std::process::Command::new(common::BIN);
    cmd.args(["serve", "--rpc-socket", "none", "--export", "d=mem:1M"]);
    cmd.args([
        "--listen",
        "tcp://127.0.0.1:0",
        "--keys",
        &keys.file("target"),
    ]);
    cmd.args(["--admin", "alice", "--admin", "alcie"]);
    let (_, log) = common::start_log(&mut cmd, 1);
    let warned: Vec<&str> = log.lines().filter(|l| l.contains("has no key")).collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(warned[0].contains("admin 'alcie'"), "{log}");
}

#[test]
fn key_files_and_rules_are_checked_before_anything_starts() {
    let keys = Keys::new("auth-config");
    let alice = keys.file("alice");
    std::fs::set_permissions(&alice, std::fs::Permissions::from_mode(0o644)).unwrap();
    common::assert_one_line_error(
        &["info", "tcp://127.0.0.1:7/d", "--key", &alice],
        "chmod 600",
    );
    common::assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "d=mem:1M",
            "--keys",
            &alice,
        ],
        "chmod 600",
    );
    common::assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "d=mem:1M,allow=alice",
        ],
        "only proven with a key",
    );
    common::assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "d=mem:1M,allow=10.0.0.0/33",
        ],
        "prefix length",
    );
    common::assert_one_line_error(
        &[
            "info",
            "tcp://127.0.0.1:7/d",
            "--host-id",
            "carol",
            "--key",
            &keys.file("bob"),
        ],
        "has no key for host 'carol'",
    );
    common::assert_one_line_error(
        &["info", "udp://127.0.0.1:7/d", "--encrypt"],
        "--encrypt needs a key",
    );
    common::assert_one_line_error(&["key", "gen", &keys.file("bob")], "already exists");
}

/// An address rule alone (no keys): admitted from loopback, refused from anywhere else, here
/// shown by a rule that loopback does not match.
#[test]
fn address_rules_work_without_keys() {
    let t = Target::start(&[
        "open=mem:1M,allow=127.0.0.0/8",
        "shut=mem:1M,allow=10.0.0.0/8",
    ]);
    let (ok, _, err) = cli(&["info", &t.url("open")]);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&["info", &t.url("shut")]);
    assert!(!ok && err.contains("does not allow this host"), "{err}");
    let (ok, out, _) = cli(&["info", &t.base]);
    assert!(ok && out.contains("open") && !out.contains("shut"), "{out}");
}

/// The hijack of the issue, reproduced: a WRITE carrying the victim's session id, sent from the
/// victim's own address and port (what an attacker spoofing both produces), with a valid CRC.
/// Without keys the target has nothing to tell it from the victim's and executes it; with keys
/// the session is sealed and the forgery is dropped, counted, and the victim's data stays.
#[test]
fn a_forged_udp_write_into_a_sealed_session_is_dropped() {
    let keys = Keys::new("auth-hijack");
    for sealed in [false, true] {
        let extra: Vec<String> = if sealed {
            vec![
                "--keys".into(),
                keys.file("target"),
                "--admin".into(),
                "alice".into(),
            ]
        } else {
            vec![]
        };
        let mut args = vec!["--listen", "udp://127.0.0.1:0"];
        args.extend(extra.iter().map(String::as_str));
        let (t, urls) = Target::start_listeners(&["m=mem:1M"], &args);
        let url = Url::parse(&format!("{}/m", urls[1])).unwrap();
        let mut opts = ConnectOptions {
            queues: 1,
            depth: 2,
            max_io: 64 << 10,
            ..Default::default()
        };
        if sealed {
            blkwire_client::Credentials {
                host_id: Some("alice".into()),
                key_file: Some(keys.dir.path("alice")),
                encrypt: false,
                ..Default::default()
            }
            .apply(&mut opts)
            .unwrap();
        }
        let mut s = connect(&url, &opts).unwrap();
        let victim = vec![0x11u8; 4096];
        s.queues[0].write_at(&victim, 0, false).unwrap(); // generation 1
        let session = s.queues[0].session_id().unwrap();
        // The forgery: a WRITE on the queue's other slot (the initiator's requests, one at a
        // time, all take slot 0), which takes any generation as its first, as a target would
        // accept it.
        let evil = vec![0x66u8; 4096];
        let mut h = Header::request(Opcode::Write, Tag::new(1, 2), 0, 4096);
        h.session = session;
        h.payload_len = 4096;
        h.seal_crc(&evil);
        let mut f = h.to_bytes().to_vec();
        f.extend_from_slice(&evil);
        s.queues[0].send_raw_frame(&f).unwrap();
        // A second forgery that claims to be sealed, with a made-up seal.
        let mut h2 = Header::request(Opcode::Write, Tag::new(1, 3), 0, 4096);
        h2.session = session;
        h2.payload_len = 4096;
        h2.mark_sealed();
        let mut f2 = h2.to_bytes().to_vec();
        f2.extend_from_slice(&evil);
        f2.extend_from_slice(&[0xab; 24]);
        s.queues[0].send_raw_frame(&f2).unwrap();
        s.queues[0].keepalive().unwrap(); // the target has taken both by now
        let mut back = vec![0u8; 4096];
        s.queues[0].read_at(&mut back, 0).unwrap();
        if !sealed {
            assert_eq!(
                back, evil,
                "control: without keys the forgery is indistinguishable"
            );
            continue;
        }
        assert_eq!(back, victim, "a forged WRITE landed in a sealed session");
        let v = stats(&t, &keys);
        let bad: u64 = v["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["bad_seal"].as_u64().unwrap())
            .sum();
        assert_eq!(bad, 2, "both forgeries counted: {}", v["ports"]);
        assert_eq!(
            v["sessions"][0]["queues"][0]["writes"], 1,
            "{}",
            v["sessions"]
        );
    }
}

/// A forged first HELLO (any source address) gets a challenge smaller than itself and creates
/// no session; a second HELLO with a nonce the target never issued is challenged again.
#[test]
fn a_challenge_never_amplifies_and_creates_nothing() {
    let (t, urls) = Target::start_listeners(&["m=mem:1M"], &["--listen", "udp://127.0.0.1:0"]);
    let target = urls[1].trim_start_matches("udp://").to_string();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = Hello {
        queues: 2,
        depth: 1,
        max_io: 4096,
        client_features: 0,
        frame_payload: 1400,
        nonce: 9,
        host_id: "x".into(),
        export: "m".into(),
        auth: AuthBlock::first(AuthMethod::None, false, true, [3; 32]),
        replaces: None,
    };
    let send = |hello: &Hello| -> (usize, Header, Vec<u8>) {
        let (sent, r, p) = common::native_raw::send_hello_udp(&sock, &target, hello);
        let n = HEADER_LEN + p.len();
        assert!(n <= sent, "answer of {n} bytes to a {sent}-byte HELLO");
        (sent, r, p)
    };
    let (_, r, nonce) = send(&hello);
    assert_eq!((r.status, nonce.len()), (Status::Challenge, 32));
    hello.auth.nonce_s = [0x42; 32]; // not what the target issued
    let (_, r, _) = send(&hello);
    assert_eq!(r.status, Status::Challenge, "a made-up nonce was accepted");
    let (ok, out, _) = cli(&["stats", &t.base, "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["sessions"].as_array().unwrap().len(), 0, "{out}");
    // The challenge answered: now a session exists (and its reply is still no larger).
    hello.auth.nonce_s = nonce.try_into().unwrap();
    let (_, r, p) = send(&hello);
    assert_eq!(r.status, Status::Ok);
    let granted = blkwire_wire::HelloReply::decode(&p).unwrap();
    // The session's holder JOINs queue 1 "from" another address (a socket it will never answer
    // from, as a forged source would be): that queue does not exist until the address answers
    // its own challenge, so READs aimed at it are refused with a bare header.
    let other = UdpSocket::bind("127.0.0.1:0").unwrap();
    other
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let (mut h, j) = join_request(granted.session, 1, granted.cookie);
    h.seal_crc(&j);
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(&j);
    other.send_to(&f, &target).unwrap();
    let mut buf = [0u8; 2048];
    let n = other.recv(&mut buf).unwrap();
    let r = Header::decode(&buf, 4096).unwrap();
    assert_eq!(r.status, Status::Challenge, "an unproven JOIN was admitted");
    assert!(n <= f.len(), "{n}-byte answer to a {}-byte JOIN", f.len());
    let mut rd = Header::request(Opcode::Read, Tag::new(0, 1), 0, 4096);
    rd.session = granted.session;
    rd.queue = 1;
    rd.seal_crc(&[]);
    other.send_to(&rd.to_bytes(), &target).unwrap();
    let n = other.recv(&mut buf).unwrap();
    let r = Header::decode(&buf, 4096).unwrap();
    assert_eq!(
        (r.status, n),
        (Status::Access, HEADER_LEN),
        "READ on an unproven queue"
    );
    // A padless LIST (48 bytes) is answered with no more than 48 bytes.
    let mut l = Header::request(Opcode::List, Tag::new(0, 0), 0, 0);
    l.seal_crc(&[]);
    sock.send_to(&l.to_bytes(), &target).unwrap();
    let mut buf = [0u8; 2048];
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(n, HEADER_LEN, "an unpadded LIST got a {n}-byte answer");
}

/// One HELLO exchange on a raw link, TCP (`tcp`) or UDP (`udp`, to `to`): the challenge, then
/// the answering HELLO, proven with `key` when given (as the initiator that built it would).
/// Returns the final status.
fn raw_hello(
    tcp: Option<&mut std::net::TcpStream>,
    udp: Option<(&UdpSocket, &str)>,
    mut hello: Hello,
    key: Option<&blkwire_auth::Key>,
) -> Status {
    let mut tcp = tcp;
    let mut send = |hello: &Hello| -> (Header, Vec<u8>) {
        if let Some(s) = tcp.as_deref_mut() {
            return common::native_raw::send_hello(s, hello);
        }
        let (sock, to) = udp.expect("a link");
        let (_, r, p) = common::native_raw::send_hello_udp(sock, to, hello);
        (r, p)
    };
    let (r, nonce) = send(&hello);
    assert_eq!(r.status, Status::Challenge);
    hello.auth.nonce_s = nonce.try_into().unwrap();
    if let Some(key) = key {
        let t = blkwire_auth::proof::transcript(&hello.transcript_bytes().unwrap());
        hello.auth.proof_c = blkwire_auth::proof::initiator_proof(key, &t);
    }
    send(&hello).0.status
}

/// A HELLO says (in its auth flags, under its proof) whether it was sent over a datagram link:
/// an on-path relay that forwards a UDP initiator's HELLOs over its own TCP connection (and
/// the target's challenge back) would otherwise get, as that host, a TCP session the target
/// does not seal, while the initiator believes its session sealed. The target refuses a HELLO
/// flagged for the other kind of link, proven or not, and admits the same HELLO flagged right.
#[test]
fn a_hello_for_the_other_kind_of_link_is_refused() {
    let keys = Keys::new("auth-relay");
    let (_t, urls) = start(&keys);
    let key = blkwire_auth::KeyStore::load(&keys.dir.path("alice"))
        .unwrap()
        .get("alice")
        .unwrap()
        .clone();
    let (_k, open_urls) =
        Target::start_listeners(&["d=mem:1M"], &["--listen", "udp://127.0.0.1:0"]);
    let hello = |method, datagram| Hello {
        queues: 1,
        depth: 1,
        max_io: 4096,
        client_features: 0,
        frame_payload: if datagram { 1400 } else { 0 },
        nonce: 5,
        host_id: "alice".into(),
        export: "d".into(),
        auth: AuthBlock::first(method, false, datagram, [5; 32]),
        replaces: None,
    };
    for (urls, method, key) in [
        (&urls, AuthMethod::Psk, Some(&key)),
        (&open_urls, AuthMethod::None, None),
    ] {
        let tcp_at = urls[0].trim_start_matches("tcp://");
        let udp_at = urls[1].trim_start_matches("udp://");
        for (flag, want) in [(true, Status::Access), (false, Status::Ok)] {
            let mut s = std::net::TcpStream::connect(tcp_at).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let got = raw_hello(Some(&mut s), None, hello(method, flag), key);
            assert_eq!(got, want, "{method:?} over TCP, datagram flag {flag}");
        }
        for (flag, want) in [(false, Status::Access), (true, Status::Ok)] {
            let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let got = raw_hello(None, Some((&sock, udp_at)), hello(method, flag), key);
            assert_eq!(got, want, "{method:?} over UDP, datagram flag {flag}");
        }
    }
}

/// Raw Ethernet between two namespaces: with the right key data round trips, authenticated and
/// encrypted; a wrong key, an unknown host and an export's MAC rule are refused with one line.
#[test]
fn eth_sessions_authenticate_seal_and_obey_mac_rules() {
    let keys = Keys::new("auth-eth");
    let lab = NetLab::new(20, 1500);
    let ip = "10.99.20.1";
    let tcp = format!("tcp://{ip}:7700");
    let t = Served::start_with(
        Some(&lab.t),
        &[&tcp, "eth://vt"],
        &["d=mem:4M", "elsewhere=mem:1M,allow=02:00:00:00:00:99"],
        &["--keys", &keys.file("target"), "--admin", "alice"],
    );
    let mac = lab.mac();
    let url = format!("eth://vi/{mac}/d");
    let src = keys.dir.path("src");
    let data = random_bytes(2 << 20, 3);
    std::fs::write(&src, &data).unwrap();
    let back = keys.dir.path("back");
    let alice = keys.as_host("alice", "alice");
    for encrypt in [false, true] {
        let mut who: Vec<&str> = alice.iter().map(String::as_str).collect();
        if encrypt {
            who.push("--encrypt");
        }
        let mut up = vec!["cp", "--no-progress", src.to_str().unwrap(), &url];
        up.extend(&who);
        let (ok, _, err) = lab.cli(&up);
        assert!(ok, "upload over {url} (encrypt={encrypt}): {err}");
        let mut down = vec!["cp", "--no-progress", &url, back.to_str().unwrap()];
        down.extend(&who);
        let (ok, _, err) = lab.cli(&down);
        assert!(ok, "download over {url}: {err}");
        assert!(
            std::fs::read(&back).unwrap()[..data.len()] == data[..],
            "data differs"
        );
    }
    for (who, export, want) in [
        (keys.as_host("alice", "fake-alice"), "d", "key is wrong"),
        (
            keys.as_host("mallory", "mallory"),
            "d",
            "key is wrong or unknown",
        ),
        (
            keys.as_host("alice", "alice"),
            "elsewhere",
            "does not allow",
        ),
    ] {
        let u = format!("eth://vi/{mac}/{export}");
        let mut args = vec!["info", u.as_str(), "--timeout", "5"];
        args.extend(who.iter().map(String::as_str));
        let (ok, _, err) = lab.cli(&args);
        assert!(!ok, "{u}: admitted");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(want) && err.contains("vi/"), "{u}: {err}");
    }
    let u = format!("eth://vi/{mac}/d");
    let (ok, _, err) = lab.cli(&["info", &u, "--timeout", "5", "--host-id", "alice"]);
    assert!(
        !ok && err.contains("requires a key"),
        "no key over eth: {err}"
    );
    let mut args = vec!["stats", tcp.as_str(), "--json"];
    args.extend(alice.iter().map(String::as_str));
    let (ok, out, err) = lab.cli(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["auth"]["refused"].as_u64().unwrap() >= 4, "{}", v["auth"]);
    drop(t);
}

/// NBD without TLS proves no identity: on a target with keys a plain NBD client is an unknown
/// host, sees no export and opens none; an address rule admits it on a target without keys.
#[test]
fn plain_nbd_clients_are_unknown_hosts_on_a_target_with_keys() {
    let keys = Keys::new("auth-nbd");
    let (t, urls) = Target::start_listeners(
        &["d=mem:1M"],
        &[
            "--listen",
            "nbd://127.0.0.1:0",
            "--keys",
            &keys.file("target"),
        ],
    );
    let nbd = &urls[1];
    let nbdinfo = |args: &[&str]| {
        let out = std::process::Command::new("nbdinfo")
            .args(args)
            .output()
            .expect("nbdinfo (libnbd-bin) is needed: scripts/deps.sh installs it");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (_, listed) = nbdinfo(&["--list", "--json", nbd]);
    assert!(
        !listed.contains("\"d\""),
        "an unauthenticated NBD client saw the export: {listed}"
    );
    let (ok, _) = nbdinfo(&["--size", &format!("{nbd}/d")]);
    assert!(
        !ok,
        "an unauthenticated NBD client opened an export of a target with keys"
    );
    drop(t);
    let (_t, urls) = Target::start_listeners(
        &["d=mem:1M,allow=127.0.0.1"],
        &["--listen", "nbd://127.0.0.1:0"],
    );
    let (ok, size) = nbdinfo(&["--size", &format!("{}/d", urls[1])]);
    assert!(ok && size.trim() == "1048576", "address rule: {size}");
}

/// A host on the link (here: a process on the target's own interface, so even its MAC is the
/// target's) sends an initiator forged READ replies for its session and queue, plain frames
/// with a valid CRC (forgeries with a made-up seal: `a_sealed_queue_drops_forged_replies...`),
/// while the initiator reads: they are dropped as unsealed and counted (`bad_seals`), not taken
/// as late replies; no I/O fails.
#[test]
fn forged_ethernet_replies_to_an_initiator_are_dropped() {
    use std::process::{Command, Stdio};
    let keys = Keys::new("auth-eth-forge");
    let lab = NetLab::new(21, 1500);
    let tcp = "tcp://10.99.21.1:7700".to_string();
    let _t = Served::start_with(
        Some(&lab.t),
        &[&tcp, "eth://vt"],
        &["d=mem:4M"],
        &["--keys", &keys.file("target"), "--admin", "alice"],
    );
    let mac = lab.mac();
    let ns_mac = |ns: &str, dev: &str| {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "cat",
                &format!("/sys/class/net/{dev}/address"),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let initiator_mac = ns_mac(&lab.i, "vi");
    let url = format!("eth://vi/{mac}/d");
    let key = keys.file("alice");
    let bench = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.i,
            common::BIN,
            "bench",
            &url,
            "--rw",
            "randread",
        ])
        // Long enough that the forgeries land while it runs, after the session's readiness
        // poll and the sender's start on a loaded machine.
        .args(["--bs", "4k", "--iodepth", "8", "--runtime", "8", "--json"])
        .args(["--host-id", "alice", "--key", &key])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Readiness: the session shows up in the target's counters.
    let stats = |lab: &NetLab| {
        let (ok, out, err) =
            lab.cli(&["stats", &tcp, "--json", "--host-id", "alice", "--key", &key]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let session = loop {
        if let Some(id) = stats(&lab)["sessions"][0]["session"].as_u64() {
            break id as u32;
        }
        assert!(std::time::Instant::now() < deadline, "no session appeared");
        std::thread::sleep(Duration::from_millis(50));
    };
    // The forgeries, as Ethernet payloads (hex, one per line), for queue 0 of that session.
    let data = vec![0xeeu8; 1024];
    let mut lines = String::new();
    for slot in 0..8u16 {
        let mut h =
            Header::request(Opcode::Read, Tag::new(slot, 1), 0, 1024).reply(Status::Ok, 1024);
        h.session = session;
        h.seal_crc(&data);
        let mut f = h.to_bytes().to_vec();
        f.extend_from_slice(&data);
        lines.extend(f.iter().map(|b| format!("{b:02x}")));
        lines.push('\n');
    }
    let frames = keys.dir.path("forged.hex");
    std::fs::write(&frames, lines).unwrap();
    let sender = format!(
        r#"
import socket, time
frames = [bytes.fromhex(l) for l in open("{}").read().split()]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("vt", 0))
head = bytes.fromhex("{}") + bytes.fromhex("{}") + b"\x88\xb5"
end = time.time() + 1.5
while time.time() < end:
    for f in frames:
        s.send(head + f)
"#,
        frames.display(),
        initiator_mac.replace(':', ""),
        mac.replace(':', "")
    );
    let (ok, _, err) = common::netlab::run(
        Command::new("ip").args(["netns", "exec", &lab.t, "python3", "-c", &sender]),
    );
    assert!(ok, "forging sender: {err}");
    let out = bench.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bad: u64 = v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["bad_seals"].as_u64().unwrap())
        .sum();
    assert!(
        bad > 0,
        "the initiator saw no forgery (it must count them): {v}"
    );
    assert_eq!(v["errors"], 0, "{v}");
}
