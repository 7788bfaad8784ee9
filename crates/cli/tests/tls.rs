//! TLS (issue 12 item 4): NBD STARTTLS against real clients (libnbd's nbdinfo and nbdcopy over
//! `nbds://` with TLS-PSK, qemu-img with `tls-creds-psk`), native `tcp://` over TLS with PSK
//! (client library) and X.509 (`blkwire cp --tls-ca`, a certificate made here with the openssl
//! CLI), and what `--tls require` does to plain clients. Every external tool runs under
//! coreutils' `timeout`; a missing tool fails the test and names the package.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use blkwire_client::{Cmd, ConnectOptions, Url};
use blkwire_wire::nbd::{opt, rep};
use common::nbd_raw::{info_data, Raw};
use common::{assert_one_line_error, cli, random_bytes, Target, TempDir};

/// Seconds any external tool may run before `timeout` kills it.
const TOOL_LIMIT: &str = "120";

fn run(prog: &str, args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["-k", "5", TOOL_LIMIT, prog])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
}

fn describe(prog: &str, args: &[&str], out: &Output) -> String {
    format!(
        "{prog} {}: {}\n--- stdout\n{}--- stderr\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a tool that must succeed; returns its stdout.
fn tool(prog: &str, args: &[&str]) -> String {
    let out = run(prog, args);
    assert!(out.status.success(), "{}", describe(prog, args, &out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Writes a key file (nbdkit's `user:hexkey` format, mode 0600) for `host` with a fresh key.
fn key_file(path: &Path, host: &str) -> blkwire_auth::Key {
    let key = blkwire_auth::Key::generate();
    std::fs::write(path, format!("{host}:{}\n", key.to_hex())).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    key
}

/// A target with a native and an NBD listener and these TLS arguments.
struct TlsTarget {
    /// Kept for its lifetime: dropping it stops the target.
    _t: Target,
    nbd_addr: String,
}

impl TlsTarget {
    fn start(exports: &[&str], tls: &[&str]) -> TlsTarget {
        let mut extra = vec!["--listen", "nbd://127.0.0.1:0"];
        extra.extend_from_slice(tls);
        let (t, urls) = Target::start_listeners(exports, &extra);
        let nbd = urls
            .iter()
            .find(|u| u.starts_with("nbd://"))
            .expect("an nbd:// listener")
            .trim_start_matches("nbd://")
            .to_string();
        TlsTarget {
            _t: t,
            nbd_addr: nbd,
        }
    }

    /// libnbd's URI for TLS-PSK as `alice` with the key file `psk`.
    fn nbds(&self, export: &str, user: &str, psk: &Path) -> String {
        format!(
            "nbds://{user}@{}/{export}?tls-psk-file={}",
            self.nbd_addr,
            psk.display()
        )
    }

    fn nbd(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbd_addr)
    }
}

fn psk_target(dir: &TempDir, mode: &str) -> (TlsTarget, PathBuf) {
    let keys = dir.path("keys.psk");
    key_file(&keys, "alice");
    let t = TlsTarget::start(
        &["d=mem:16M"],
        &["--keys", keys.to_str().unwrap(), "--tls", mode],
    );
    (t, keys)
}

// ---------------------------------------------------------------------------------------------
// NBD

/// With keys, only a host proven with TLS-PSK may open an export, so under `--tls on` a plain
/// client asking for one (INFO, GO) is told TLS is required (proto.md's answer with selective
/// TLS; qemu and libnbd report it as such), for any name, existing or not. Meta-context options
/// may not get that answer (proto.md): they get no context. On a target without keys an unknown
/// name is unknown.
#[test]
fn plain_nbd_clients_of_a_target_with_keys_are_told_tls_is_required() {
    use blkwire_wire::nbd::BASE_ALLOCATION;
    use common::nbd_raw::meta_data;
    let dir = TempDir::new("tls-nbd-reqd");
    let (t, _) = psk_target(&dir, "on");
    let mut r = Raw::open(&t.nbd_addr);
    r.option(opt::STRUCTURED_REPLY, &[]);
    assert_eq!(r.opt_reply().1, rep::ACK);
    for name in ["d", "nope"] {
        for o in [opt::INFO, opt::GO] {
            r.option(o, &info_data(name, &[]));
            let (echo, typ, _) = r.opt_reply();
            assert_eq!(
                (echo, typ),
                (o, rep::ERR_TLS_REQD),
                "option {o}, export {name}"
            );
        }
        r.option(opt::SET_META_CONTEXT, &meta_data(name, &[BASE_ALLOCATION]));
        assert_eq!(
            r.opt_reply().1,
            rep::ACK,
            "SET_META_CONTEXT {name}: no context"
        );
    }
    let open = TlsTarget::start(&["d=mem:16M"], &[]);
    let mut r = Raw::open(&open.nbd_addr);
    r.option(opt::INFO, &info_data("nope", &[]));
    assert_eq!(r.opt_reply().1, rep::ERR_UNKNOWN);
}

#[test]
fn nbdcopy_round_trips_data_over_nbd_starttls_with_psk() {
    common::need_tool("nbdcopy", "libnbd-bin");
    common::need_tool("nbdinfo", "libnbd-bin");
    let dir = TempDir::new("tls-nbdcopy");
    let (t, keys) = psk_target(&dir, "require");
    let uri = t.nbds("d", "alice", &keys);
    let info = tool("nbdinfo", &[&uri]);
    assert!(
        info.contains("with TLS"),
        "nbdinfo did not negotiate TLS: {info}"
    );
    let src = random_bytes(8 << 20, 12);
    std::fs::write(dir.path("src"), &src).unwrap();
    tool("nbdcopy", &[dir.path("src").to_str().unwrap(), &uri]);
    let back = dir.path("back");
    tool("nbdcopy", &[&uri, back.to_str().unwrap()]);
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), 16 << 20);
    assert!(
        got[..src.len()] == src[..],
        "data read back over TLS differs"
    );
    assert!(got[src.len()..].iter().all(|b| *b == 0));
}

#[test]
fn qemu_img_round_trips_data_over_nbd_tls_psk() {
    common::need_tool("qemu-img", "qemu-utils");
    let dir = TempDir::new("tls-qemu");
    let (t, keys) = psk_target(&dir, "require");
    // qemu reads its PSKs from DIR/keys.psk, in the same format.
    let creds = dir.path("creds");
    std::fs::create_dir(&creds).unwrap();
    std::fs::copy(&keys, creds.join("keys.psk")).unwrap();
    let object = format!(
        "tls-creds-psk,id=t,endpoint=client,dir={},username=alice",
        creds.display()
    );
    let (host, port) = t.nbd_addr.rsplit_once(':').unwrap();
    let image = format!("driver=nbd,host={host},port={port},export=d,tls-creds=t");
    let src = random_bytes(16 << 20, 77);
    std::fs::write(dir.path("src"), &src).unwrap();
    tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "--object",
            &object,
            "--target-image-opts",
            dir.path("src").to_str().unwrap(),
            &image,
        ],
    );
    tool(
        "qemu-img",
        &[
            "convert",
            "--object",
            &object,
            "--image-opts",
            &image,
            "-O",
            "raw",
            dir.path("back").to_str().unwrap(),
        ],
    );
    assert!(
        std::fs::read(dir.path("back")).unwrap() == src,
        "qemu-img read back other bytes"
    );
}

#[test]
fn tls_require_refuses_plain_nbd_clients_and_on_serves_both() {
    common::need_tool("nbdinfo", "libnbd-bin");
    let dir = TempDir::new("tls-require");
    let (cert, key) = self_signed(&dir);
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());
    // libnbd wants the CA as DIR/ca-cert.pem.
    let cas = dir.path("cas");
    std::fs::create_dir(&cas).unwrap();
    std::fs::copy(&cert, cas.join("ca-cert.pem")).unwrap();
    let x509 =
        |t: &TlsTarget| format!("nbds://{}/d?tls-certificates={}", t.nbd_addr, cas.display());
    let size = (16u64 << 20).to_string();

    // No keys, so nothing but TLS stands between a plain client and the export.
    let t = TlsTarget::start(
        &["d=mem:16M"],
        &["--tls", "require", "--tls-cert", cert_s, "--tls-key", key_s],
    );
    let plain = run("nbdinfo", &["--size", &t.nbd("d")]);
    assert!(
        !plain.status.success(),
        "a plain client was served by a --tls require target: {}",
        describe("nbdinfo", &[], &plain)
    );
    assert_eq!(tool("nbdinfo", &["--size", &x509(&t)]).trim(), size);
    // The FORCEDTLS rules, byte by byte: every option but STARTTLS is refused with
    // NBD_REP_ERR_TLS_REQD, and the refusal does not end the handshake.
    let mut raw = Raw::open(&t.nbd_addr);
    for o in [
        opt::LIST,
        opt::INFO,
        opt::GO,
        opt::STRUCTURED_REPLY,
        opt::EXTENDED_HEADERS,
    ] {
        raw.option(o, &[]);
        let (echo, typ, _) = raw.opt_reply();
        assert_eq!((echo, typ), (o, rep::ERR_TLS_REQD), "option {o}");
    }
    raw.option(opt::STARTTLS, b"x");
    assert_eq!(raw.opt_reply().1, rep::ERR_INVALID, "STARTTLS with data");
    raw.option(opt::STARTTLS, &[]);
    assert_eq!(raw.opt_reply().1, rep::ACK, "STARTTLS");
    drop(raw);
    // EXPORT_NAME has no error reply: the target hangs up.
    let mut raw = Raw::open(&t.nbd_addr);
    raw.option(opt::EXPORT_NAME, b"d");
    raw.assert_closed("EXPORT_NAME before STARTTLS", &[]);

    // --tls on serves both.
    let t = TlsTarget::start(
        &["d=mem:16M"],
        &["--tls", "on", "--tls-cert", cert_s, "--tls-key", key_s],
    );
    assert_eq!(
        tool("nbdinfo", &["--size", &t.nbd("d")]).trim(),
        size,
        "--tls on serves plain clients"
    );
    let info = tool("nbdinfo", &[&x509(&t)]);
    assert!(info.contains("with TLS"), "--tls on serves TLS: {info}");
}

/// `--tls require` covers tcp:// and nbd:// only: an nvme-tcp:// or iscsi:// listener beside it
/// carries its exports in clear, a udp:// one unless its hosts ask for encryption, and the
/// target says so when it opens one (not for the others).
#[test]
fn tls_require_warns_of_listeners_it_does_not_cover() {
    let dir = TempDir::new("tls-require-clear");
    let (cert, key) = self_signed(&dir);
    let mut cmd = Command::new(common::BIN);
    cmd.args(["serve", "--rpc-socket", "none", "--export", "d=mem:1M"]);
    cmd.args(["--tls", "require", "--tls-cert", cert.to_str().unwrap()]);
    cmd.args(["--tls-key", key.to_str().unwrap()]);
    for l in ["tcp", "nbd", "nvme-tcp", "iscsi", "udp"] {
        cmd.args(["--listen", &format!("{l}://127.0.0.1:0")]);
    }
    let (urls, log) = common::start_log(&mut cmd, 5);
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("carries its exports in clear"))
        .collect();
    assert_eq!(warned.len(), 3, "{log}");
    for u in &urls {
        let clear =
            u.starts_with("nvme-tcp://") || u.starts_with("iscsi://") || u.starts_with("udp://");
        assert_eq!(
            warned.iter().any(|l| l.contains(u.as_str())),
            clear,
            "{u}: {log}"
        );
    }
}

/// --tls on a target with no tcp:// or nbd:// listener protects nothing: said at start.
#[test]
fn tls_without_a_listener_it_covers_is_warned_of() {
    let dir = TempDir::new("tls-no-stream");
    let key = dir.path("k");
    let (ok, _, err) = cli(&["key", "gen", key.to_str().unwrap()]);
    assert!(ok, "{err}");
    let start = |listen: &str| {
        let mut cmd = Command::new(common::BIN);
        cmd.args(["serve", "--rpc-socket", "none", "--export", "d=mem:1M"]);
        cmd.args([
            "--tls",
            "on",
            "--keys",
            key.to_str().unwrap(),
            "--listen",
            listen,
        ]);
        common::start_log(&mut cmd, 1).1
    };
    let log = start("udp://127.0.0.1:0");
    assert!(log.contains("nothing it serves now is encrypted"), "{log}");
    let log = start("tcp://127.0.0.1:0");
    assert!(!log.contains("nothing it serves now is encrypted"), "{log}");
}

#[test]
fn starttls_is_refused_without_tls_and_wrong_psks_get_nothing() {
    common::need_tool("nbdinfo", "libnbd-bin");
    // --tls off (the default): STARTTLS is not offered.
    let t = TlsTarget::start(&["d=mem:1M"], &[]);
    let mut raw = Raw::open(&t.nbd_addr);
    raw.option(opt::STARTTLS, &[]);
    let (_, typ, _) = raw.opt_reply();
    assert_eq!(typ, rep::ERR_UNSUP);
    drop(raw);

    let dir = TempDir::new("tls-wrong");
    let (t, _) = psk_target(&dir, "require");
    let wrong = dir.path("wrong.psk");
    key_file(&wrong, "alice");
    let out = run("nbdinfo", &["--size", &t.nbds("d", "alice", &wrong)]);
    assert!(
        !out.status.success(),
        "a wrong PSK was accepted: {}",
        describe("nbdinfo", &[], &out)
    );
    let unknown = dir.path("mallory.psk");
    key_file(&unknown, "mallory");
    let out = run("nbdinfo", &["--size", &t.nbds("d", "mallory", &unknown)]);
    assert!(
        !out.status.success(),
        "an unknown PSK identity was accepted"
    );
}

// ---------------------------------------------------------------------------------------------
// Native tcp://

/// Writes a pattern through a session with these options and reads it back on every queue.
fn round_trip(url: &str, opts: &ConnectOptions) -> Result<(), blkwire_client::Error> {
    let u = Url::parse(url).unwrap();
    let mut s = blkwire_client::connect(&u, opts)?;
    assert_eq!(s.queues.len(), opts.queues as usize, "every queue joined");
    for (i, q) in s.queues.iter_mut().enumerate() {
        let data = random_bytes(256 << 10, i as u64 + 1);
        let at = i as u64 * (1 << 20);
        q.submit(
            Cmd::Write {
                offset: at,
                data: &data,
                fua: false,
            },
            1,
        )?;
        let mut st = None;
        q.complete(1, |c| st = Some(c.status))?;
        assert_eq!(st, Some(blkwire_wire::Status::Ok));
        let mut back = Vec::new();
        q.submit(
            Cmd::Read {
                offset: at,
                len: data.len() as u32,
            },
            2,
        )?;
        q.complete(1, |c| back = c.data.to_vec())?;
        assert!(back == data, "queue {i}: data read back differs");
    }
    Ok(())
}

/// 8 MiB written, then read back with 8 reads of 1 MiB in flight at once: more reply data than
/// the socket buffers hold, so the target's sealed replies wait for POLLOUT and the client
/// decrypts while it still sends.
fn bulk_round_trip(url: &str, opts: &ConnectOptions) {
    let u = Url::parse(url).unwrap();
    let mut s = blkwire_client::connect(&u, opts).expect("session");
    let q = &mut s.queues[0];
    let data = random_bytes(8 << 20, 99);
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        let w = Cmd::Write {
            offset: (i as u64) << 20,
            data: chunk,
            fua: false,
        };
        q.submit(w, i as u64).unwrap();
    }
    q.complete(8, |c| assert_eq!(c.status, blkwire_wire::Status::Ok))
        .unwrap();
    for i in 0..8u64 {
        let r = Cmd::Read {
            offset: i << 20,
            len: 1 << 20,
        };
        q.submit(r, i).unwrap();
    }
    let mut back = vec![0u8; data.len()];
    let mut done = 0;
    while done < 8 {
        done += q
            .complete(1, |c| {
                let at = (c.user as usize) << 20;
                back[at..at + c.data.len()].copy_from_slice(c.data);
            })
            .unwrap();
    }
    assert!(back == data, "bulk data read back over TLS differs");
}

#[test]
fn native_tcp_over_tls_psk_round_trips_on_every_queue_and_wrong_keys_fail() {
    let dir = TempDir::new("tls-native-psk");
    let keys = dir.path("keys.psk");
    let key = key_file(&keys, "alice");
    let t = Target::start_with(
        &["d=mem:16M"],
        &["--keys", keys.to_str().unwrap(), "--tls", "require"],
    );
    let url = t.url("d");
    let opts = ConnectOptions {
        queues: 3,
        depth: 8,
        host_id: "alice".into(),
        key: Some(key),
        tls: true,
        ..Default::default()
    };
    round_trip(&url, &opts).expect("TLS-PSK session");
    bulk_round_trip(&url, &opts);
    // The command line: --tls with --key uses the key as the PSK.
    let (ok, out, err) = cli(&[
        "info",
        "--tls",
        "--key",
        keys.to_str().unwrap(),
        "--host-id",
        "alice",
        "--json",
        &url,
    ]);
    assert!(ok && out.contains("\"size\""), "info over TLS-PSK: {err}");

    let wrong_file = dir.path("wrong.psk");
    key_file(&wrong_file, "alice");
    assert_one_line_error(
        &[
            "info",
            "--tls",
            "--key",
            wrong_file.to_str().unwrap(),
            "--host-id",
            "alice",
            &url,
        ],
        "did not take the TLS-PSK key of host 'alice'",
    );
    let wrong = ConnectOptions {
        key: Some(blkwire_auth::Key::generate()),
        ..opts.clone()
    };
    let e = round_trip(&url, &wrong).expect_err("a wrong key must not get in");
    assert!(matches!(e, blkwire_client::Error::Tls(_)), "wrong key: {e}");
    let plain = ConnectOptions {
        tls: false,
        ..opts.clone()
    };
    let e = round_trip(&url, &plain).expect_err("plain against --tls require");
    assert!(e.to_string().contains("requires TLS"), "{e}");
}

/// A self-signed certificate for 127.0.0.1, made with the openssl CLI.
fn self_signed(dir: &TempDir) -> (PathBuf, PathBuf) {
    common::need_tool("openssl", "openssl");
    let (cert, key) = (dir.path("cert.pem"), dir.path("key.pem"));
    tool(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=blkwire test",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ],
    );
    (cert, key)
}

#[test]
fn native_tcp_over_tls_x509_copies_data_and_plain_clients_get_one_clear_line() {
    let dir = TempDir::new("tls-native-x509");
    let (cert, key) = self_signed(&dir);
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let t = Target::start_with(
        &["d=mem:8M"],
        &["--tls", "require", "--tls-cert", cert_s, "--tls-key", key_s],
    );
    let url = t.url("d");
    let src = random_bytes(3 << 20, 5);
    let (src_p, back_p) = (dir.path("src"), dir.path("back"));
    std::fs::write(&src_p, &src).unwrap();
    let (ok, _, err) = cli(&[
        "cp",
        "--no-progress",
        "--tls-ca",
        cert_s,
        src_p.to_str().unwrap(),
        &url,
    ]);
    assert!(ok, "cp to the export over TLS: {err}");
    let (ok, _, err) = cli(&[
        "cp",
        "--no-progress",
        "--tls-ca",
        cert_s,
        &url,
        back_p.to_str().unwrap(),
    ]);
    assert!(ok, "cp from the export over TLS: {err}");
    let back = std::fs::read(&back_p).unwrap();
    assert!(
        back[..src.len()] == src[..],
        "data copied back over TLS differs"
    );

    let (ok, out, err) = cli(&["info", "--tls-ca", cert_s, "--json", &url]);
    assert!(ok && out.contains("\"size\""), "info over TLS: {err}");
    // Plain clients are refused with the reason; TLS without trusting the certificate fails
    // on it; a TLS client to a target without TLS is told so.
    assert_one_line_error(&["info", &url], "requires TLS");
    assert_one_line_error(&["info", &t.base], "requires TLS");
    assert_one_line_error(&["info", "--tls", &url], "not trusted");
    let plain = Target::start(&["d=mem:1M"]);
    assert_one_line_error(
        &["info", "--tls-ca", cert_s, &plain.url("d")],
        "TLS handshake",
    );
    // The target counted the refusals (STATS over TLS: it serves nothing in plain).
    let (ok, out, err) = cli(&["stats", "--tls-ca", cert_s, "--json", &t.base]);
    assert!(ok, "stats over TLS: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        v["auth"]["refused"].as_u64().unwrap() >= 3,
        "plain and untrusting clients counted as refused: {}",
        v["auth"]
    );
}

/// A client with a key takes only a target that proves itself with that key: a TLS server
/// that answers with a certificate instead (here openssl s_server, with a certificate the
/// client trusts) is refused at the handshake, before the HELLO (which something posing as
/// the target could relay to the real one).
#[test]
fn a_client_with_a_key_refuses_a_target_that_shows_a_certificate_instead() {
    let dir = TempDir::new("tls-psk-or-cert");
    let (cert, key) = self_signed(&dir);
    let mut server = Command::new("openssl")
        .args([
            "s_server",
            "-accept",
            "127.0.0.1:0",
            "-tls1_3",
            "-naccept",
            "1",
        ])
        .args([
            "-cert",
            cert.to_str().unwrap(),
            "-key",
            key.to_str().unwrap(),
        ])
        // Kept open: s_server ends when its input does.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run openssl s_server");
    let mut out = std::io::BufReader::new(server.stdout.take().unwrap());
    let port = loop {
        let mut line = String::new();
        let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(n > 0, "openssl s_server ended before it listened");
        if let Some(addr) = line.trim().strip_prefix("ACCEPT ") {
            break addr.rsplit_once(':').unwrap().1.to_string();
        }
    };
    let opts = ConnectOptions {
        host_id: "alice".into(),
        key: Some(blkwire_auth::Key::generate()),
        tls: true,
        tls_ca: Some(cert.clone()),
        ..Default::default()
    };
    let e = round_trip(&format!("tcp://127.0.0.1:{port}/d"), &opts)
        .expect_err("a certificate in place of the key");
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        e.to_string()
            .contains("answered with a certificate, not the TLS-PSK key"),
        "{e}"
    );
}

/// --tls-ca is the one CA a target's certificate may chain to, not one more beside the
/// system's: a certificate the system's store trusts (here through SSL_CERT_FILE, which
/// OpenSSL reads for it) is refused when --tls-ca names another CA.
#[test]
fn tls_ca_is_the_only_ca_trusted() {
    let dir = TempDir::new("tls-ca-only");
    let (cert, key) = self_signed(&dir);
    let other = TempDir::new("tls-ca-other");
    let (other_cert, _) = self_signed(&other);
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let t = Target::start_with(
        &["d=mem:1M"],
        &["--tls", "require", "--tls-cert", cert_s, "--tls-key", key_s],
    );
    let info = |ca: &Path| {
        Command::new(common::BIN)
            .args(["info", "--tls-ca", ca.to_str().unwrap(), &t.url("d")])
            .env("SSL_CERT_FILE", cert_s)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let trusted = info(&cert);
    assert!(
        trusted.status.success(),
        "{}",
        String::from_utf8_lossy(&trusted.stderr)
    );
    let refused = info(&other_cert);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "trusted through the system's store"
    );
    assert!(err.contains("not trusted"), "{err}");
}

/// --tls-ca may name a CA that is not a root (an intermediate), or the target's own
/// certificate when a CA signed it: what the file holds is trusted, self-signed or not.
#[test]
fn tls_ca_may_pin_a_certificate_that_is_not_a_root() {
    let dir = TempDir::new("tls-ca-pin");
    let (ca, ca_key) = self_signed(&dir);
    let p = |n: &str| dir.path(n).to_str().unwrap().to_string();
    tool(
        "openssl",
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            "/CN=blkwire leaf",
            "-keyout",
            &p("leaf.key"),
            "-out",
            &p("leaf.csr"),
        ],
    );
    std::fs::write(dir.path("ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    tool(
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            &p("leaf.csr"),
            "-CA",
            ca.to_str().unwrap(),
            "-CAkey",
            ca_key.to_str().unwrap(),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &p("ext"),
            "-out",
            &p("leaf.pem"),
        ],
    );
    let t = Target::start_with(
        &["d=mem:1M"],
        &[
            "--tls",
            "require",
            "--tls-cert",
            &p("leaf.pem"),
            "--tls-key",
            &p("leaf.key"),
        ],
    );
    let (ok, _, err) = cli(&["info", "--tls-ca", &p("leaf.pem"), &t.url("d")]);
    assert!(ok, "the pinned leaf: {err}");
    let (ok, _, err) = cli(&["info", "--tls-ca", ca.to_str().unwrap(), &t.url("d")]);
    assert!(ok, "its CA: {err}");
}

#[test]
fn tls_flags_are_checked_with_one_line_errors() {
    let dir = TempDir::new("tls-config");
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec![
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "d=mem:1M",
        ];
        v.extend_from_slice(extra);
        v
    }
    assert_one_line_error(&with(&["--tls", "on"]), "needs credentials");
    assert_one_line_error(&with(&["--tls", "maybe"]), "off, on or require");
    let junk = dir.path("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let junk = junk.to_str().unwrap();
    assert_one_line_error(
        &with(&["--tls", "on", "--tls-cert", junk, "--tls-key", junk]),
        "--tls-cert",
    );
    let (cert, _) = self_signed(&dir);
    assert_one_line_error(
        &with(&[
            "--tls",
            "on",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            junk,
        ]),
        "--tls-key",
    );
    assert_one_line_error(
        &with(&["--tls", "on", "--tls-cert", cert.to_str().unwrap()]),
        "--tls-key",
    );
}

// ---------------------------------------------------------------------------------------------
// Bounds

fn tls_option(s: &mut impl Write, option: u32, data: &[u8]) {
    let mut b = blkwire_wire::nbd::IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
}

/// (reply type, data) of one option reply.
fn tls_opt_reply(s: &mut impl Read) -> (u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    assert!(len < 1 << 20);
    let mut d = vec![0u8; len];
    s.read_exact(&mut d).unwrap();
    (u32::from_be_bytes(h[12..16].try_into().unwrap()), d)
}

/// A TLS client that sends READs and never reads the replies: the target stops reading it once
/// its (sealed) replies reach the connection's high-water mark, and stays small.
#[test]
fn a_tls_client_that_never_reads_cannot_grow_the_target() {
    use openssl::ssl::{ErrorCode, SslConnector, SslMethod, SslVerifyMode};
    let dir = TempDir::new("tls-never-reads");
    let (cert, key) = self_signed(&dir);
    let t = TlsTarget::start(
        &["m=mem:64M"],
        &[
            "--tls",
            "require",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let mut raw = Raw::open(&t.nbd_addr);
    raw.option(opt::STARTTLS, &[]);
    assert_eq!(raw.opt_reply().1, rep::ACK);
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    let mut s = b
        .build()
        .connect("localhost", raw.0)
        .expect("TLS handshake");
    // Asking for the block size keeps the connection at the maximum payload, 32 MiB at most (without,
    // it may take 64 MiB requests, like nbdkit, and holds twice as much by design).
    tls_option(
        &mut s,
        opt::GO,
        &info_data("m", &[blkwire_wire::nbd::info::BLOCK_SIZE]),
    );
    while tls_opt_reply(&mut s).0 != rep::ACK {}
    let before = common::rss_kib(t._t.pid() as u32);
    s.get_ref().set_nonblocking(true).unwrap();
    let (mut sent, mut blocked) = (0u64, false);
    for i in 0..(1u64 << 20) {
        let r = blkwire_wire::nbd::Request {
            flags: 0,
            typ: blkwire_wire::nbd::cmd::READ,
            cookie: i,
            offset: 0,
            length: 65536,
        };
        match s.ssl_write(&r.encode()) {
            Ok(_) => sent += 1,
            Err(e) if e.code() == ErrorCode::WANT_WRITE => {
                // The socket is full: the target has stopped reading this client.
                blocked = true;
                break;
            }
            Err(e) => panic!("TLS write failed after {sent} requests: {e}"),
        }
    }
    let after = common::rss_kib(t._t.pid() as u32);
    assert!(
        blocked,
        "target kept reading {sent} requests whose replies nobody reads"
    );
    // What an NBD connection may hold by design: replies up to its high-water mark, twice the
    // maximum payload (32 MiB at most) (a plain connection grows as much, ~68 MiB here); TLS adds its
    // gathered records (at most 256 KiB) and a record inside OpenSSL. Unbounded, the flood would
    // be gigabytes of replies.
    assert!(
        after < before + 80 * 1024,
        "target RSS grew from {before} KiB to {after} KiB after {sent} unread 64 KiB reads"
    );
    // The target still serves others.
    let (ok, out, err) = cli(&["info", "--tls-ca", cert.to_str().unwrap(), &t._t.url("m")]);
    assert!(ok && out.contains("64M"), "{err}");
}

/// A client that starts a TLS handshake and stops is cut off at the handshake deadline: the
/// TLS handshake runs under the same deadline as the rest of the admission.
#[test]
fn a_stalled_tls_handshake_is_cut_off_at_its_deadline() {
    let dir = TempDir::new("tls-stall");
    let (cert, key) = self_signed(&dir);
    let t = Target::start_with(
        &["m=mem:1M"],
        &[
            "--tls",
            "on",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--handshake-timeout",
            "1",
        ],
    );
    let addr = t.base.trim_start_matches("tcp://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    // The first bytes of a TLS record header (handshake, TLS 1.0 record version), then nothing.
    s.write_all(&[0x16, 0x03, 0x01]).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let started = std::time::Instant::now();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Ok(n) => panic!(
            "the target answered a third of a record header: {:02x?}",
            &b[..n]
        ),
        Err(e) => panic!("the target kept a stalled TLS handshake open: {e}"),
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "cut off only after {:?}",
        started.elapsed()
    );
}

/// An export's allow list applies to the host an NBD client proved with TLS-PSK: bob, known to
/// the target, neither sees nor opens alice's export; alice does both.
#[test]
fn nbd_tls_psk_hosts_are_held_to_export_allow_lists() {
    common::need_tool("nbdinfo", "libnbd-bin");
    let dir = TempDir::new("tls-nbd-acl");
    let (alice, bob) = (dir.path("alice.psk"), dir.path("bob.psk"));
    key_file(&alice, "alice");
    key_file(&bob, "bob");
    let keys = dir.path("keys.psk");
    let both = format!(
        "{}{}",
        std::fs::read_to_string(&alice).unwrap(),
        std::fs::read_to_string(&bob).unwrap()
    );
    std::fs::write(&keys, both).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let t = TlsTarget::start(
        &["a=mem:1M,allow=alice", "shared=mem:2M"],
        &["--keys", keys.to_str().unwrap(), "--tls", "require"],
    );
    let size = tool("nbdinfo", &["--size", &t.nbds("a", "alice", &alice)]);
    assert_eq!(size.trim(), "1048576");
    let out = run("nbdinfo", &["--size", &t.nbds("a", "bob", &bob)]);
    assert!(
        !out.status.success(),
        "bob opened alice's export: {}",
        describe("nbdinfo", &[], &out)
    );
    let list = tool("nbdinfo", &["--list", "--json", &t.nbds("", "bob", &bob)]);
    assert!(
        list.contains("\"shared\"") && !list.contains("\"a\""),
        "bob's list: {list}"
    );
}

/// A `keys_load` that replaces a client's key between its TLS-PSK handshake and its
/// NBD_OPT_GO: the session would rest on a key the store no longer holds, so GO is refused
/// and no session is left (the key the PSK callback found is the one the session records).
#[test]
fn a_psk_replaced_before_go_opens_no_session() {
    let dir = TempDir::new("tls-psk-rotate");
    let keys = dir.path("keys.psk");
    let old = key_file(&keys, "alice");
    let t = common::Controlled::start(
        &dir,
        &[
            "--listen",
            "nbd://127.0.0.1:0",
            "--export",
            "d=mem:1M",
            "--keys",
            keys.to_str().unwrap(),
            "--tls",
            "require",
        ],
    );
    let urls = &t.urls;
    let rpc = |method: &str, params: &str| t.rpc(method, params);
    let addr = urls[0].strip_prefix("nbd://").unwrap();
    let mut s = alice_after_starttls(addr, old.bytes());
    // Alice's key is replaced now: she has no session yet, so nothing is closed ...
    key_file(&keys, "alice");
    let r = rpc(
        "keys_load",
        &format!("{{\"path\": \"{}\"}}", keys.display()),
    );
    assert_eq!(r["closed_sessions"], 0);
    // ... and GO, over the session her old key opened, gets no session.
    tls_option(&mut s, opt::GO, &info_data("d", &[]));
    let last = loop {
        let (typ, data) = tls_opt_reply(&mut s);
        if typ != rep::INFO {
            break (typ, String::from_utf8_lossy(&data).into_owned());
        }
    };
    assert_eq!(last.0, rep::ERR_POLICY, "GO answered {last:?}");
    assert_eq!(rpc("session_list", "{}"), serde_json::json!([]));
}

/// An NBD client at `addr` that sent STARTTLS and made its TLS 1.3 handshake as `alice` with the
/// PSK `key`: ready for options over TLS.
fn alice_after_starttls(addr: &str, key: &[u8]) -> openssl::ssl::SslStream<std::net::TcpStream> {
    use openssl::ssl::{SslConnector, SslMethod, SslVersion};
    let mut raw = Raw::open(addr);
    raw.option(opt::STARTTLS, &[]);
    assert_eq!(raw.opt_reply().1, rep::ACK);
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
    let k = key.to_vec();
    b.set_psk_client_callback(move |_ssl, _hint, identity, psk| {
        identity[..5].copy_from_slice(b"alice");
        identity[5] = 0;
        psk[..k.len()].copy_from_slice(&k);
        Ok(k.len())
    });
    b.build()
        .configure()
        .unwrap()
        .connect("localhost", raw.0)
        .expect("TLS-PSK handshake with alice's key")
}

/// NBD_CMD_DISC over TLS ends the TLS session cleanly (proto.md: the server MUST close down the
/// TLS session): the client reads close_notify, an orderly end of stream, not a connection that
/// just stops (OpenSSL 3 reports that as an unexpected EOF; GnuTLS as a premature termination).
#[test]
fn nbd_disc_over_tls_ends_with_close_notify() {
    use openssl::ssl::ShutdownState;
    let dir = TempDir::new("tls-nbd-disc");
    let (t, keys) = psk_target(&dir, "require");
    let line = std::fs::read_to_string(&keys).unwrap();
    let hex = line.trim().split_once(':').unwrap().1.to_string();
    let key: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let mut s = alice_after_starttls(&t.nbd_addr, &key);
    tls_option(&mut s, opt::GO, &info_data("d", &[]));
    while tls_opt_reply(&mut s).0 != rep::ACK {}
    let disc = blkwire_wire::nbd::Request {
        flags: 0,
        typ: blkwire_wire::nbd::cmd::DISC,
        cookie: 1,
        offset: 0,
        length: 0,
    };
    s.write_all(&disc.encode()).unwrap();
    let mut b = [0u8; 16];
    assert_eq!(
        s.read(&mut b).ok(),
        Some(0),
        "after DISC: the end of the stream"
    );
    // The crate reads a bare EOF as 0 too: the shutdown state tells them apart.
    assert!(
        s.get_shutdown().contains(ShutdownState::RECEIVED),
        "after DISC the TLS session ended without close_notify"
    );
}
