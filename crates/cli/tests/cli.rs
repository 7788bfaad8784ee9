//! The command line as a user runs it: cp round trips, info, bench, bad input, shutdown.

mod common;

use std::io::{Read, Write};
use std::process::Command;

use common::{assert_one_line_error, cli, random_bytes, sha256, sparse_file, Target, TempDir, BIN};

#[test]
fn cp_round_trip_preserves_every_byte() {
    let d = TempDir::new("cp");
    let src = d.path("src.img");
    // Data, then a run of zeros (skipped on the fresh mem export), then data, odd total size.
    let mut data = random_bytes(3 << 20, 1);
    data.extend(vec![0u8; 2 << 20]);
    data.extend(random_bytes((1 << 20) + 4096 + 512, 2));
    std::fs::write(&src, &data).unwrap();
    let t = Target::start(&["m=mem:16M"]);
    let (ok, out, err) = cli(&["cp", src.to_str().unwrap(), &t.url("m")]);
    assert!(ok, "upload: {err}");
    assert!(
        out.contains("copied") && out.contains(&format!("{} bytes", data.len())),
        "{out}"
    );
    let back = d.path("back.img");
    let (ok, _, err) = cli(&["cp", &t.url("m"), back.to_str().unwrap()]);
    assert!(ok, "download: {err}");
    // The download is the whole export; its first bytes are the source.
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), 16 << 20);
    let prefix = d.path("prefix.img");
    std::fs::write(&prefix, &got[..data.len()]).unwrap();
    assert_eq!(sha256(&prefix), sha256(&src));
    assert!(got[data.len()..].iter().all(|b| *b == 0));
}

/// A copy into an existing file rewrites it in place, never cut first: copied onto the very
/// file an export serves, it reads the export's bytes (the file was cut to zeros first, every
/// chunk then skipped as zero, and success reported); a longer file ends at the source's
/// length, its mode kept. A new file is written beside its name and takes it once complete;
/// no stray file is left; what is no file (a character device) is refused.
#[test]
fn cp_into_a_file_replaces_it_only_when_complete() {
    let d = TempDir::new("cp-staged");
    let img = d.path("x.img");
    let data = random_bytes(1 << 20, 9);
    std::fs::write(&img, &data).unwrap();
    let t = Target::start(&[&format!("x=file:{}", img.display())]);
    let (ok, _, err) = cli(&["cp", &t.url("x"), img.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        std::fs::read(&img).unwrap() == data,
        "the export's bytes were lost"
    );
    use std::os::unix::fs::PermissionsExt;
    let long = d.path("long.img");
    std::fs::write(&long, vec![5u8; 2 << 20]).unwrap();
    std::fs::set_permissions(&long, std::fs::Permissions::from_mode(0o600)).unwrap();
    let new = d.path("new.img");
    for dst in [&long, &new] {
        let (ok, _, err) = cli(&["cp", &t.url("x"), dst.to_str().unwrap()]);
        assert!(ok, "{err}");
        assert!(std::fs::read(dst).unwrap() == data, "{}", dst.display());
    }
    let mode = std::fs::metadata(&long).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the file's mode was not kept");
    let mut names: Vec<_> = std::fs::read_dir(d.path(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["long.img", "new.img", "x.img"], "left behind");
    assert_one_line_error(&["cp", &t.url("x"), "/dev/null"], "not a regular file");
    // Nor is what has no size to copy, or would wait for a writer when opened, a source.
    let fifo = d.path("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path of ours.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for src in ["/dev/zero", fifo.to_str().unwrap()] {
        assert_one_line_error(
            &["cp", src, &t.url("x")],
            "not a regular file or block device",
        );
    }
}

/// A command whose output cannot be written (stdout on a full device) fails in one line with
/// exit status 1: it panicked (status 101, a panic message).
#[test]
fn output_that_cannot_be_written_is_a_one_line_error() {
    let d = TempDir::new("full-stdout");
    let key = d.path("k");
    let out = std::process::Command::new(common::BIN)
        .args(["key", "gen", key.to_str().unwrap(), "--host-id", "h"])
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot write the output"), "{err}");
}

/// `key gen` takes the host id from BLKWIRE_HOST_ID as every other command does.
#[test]
fn key_gen_takes_the_host_id_from_the_environment() {
    let d = TempDir::new("key-env");
    let key = d.path("k");
    let out = std::process::Command::new(common::BIN)
        .args(["key", "gen", key.to_str().unwrap()])
        .env("BLKWIRE_HOST_ID", "envhost")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&key).unwrap();
    assert!(text.starts_with("envhost:"), "{text}");
}

/// Ctrl-C (or SIGTERM) during a copy into a new file removes the hidden file it was writing,
/// which is as large as the source, and says so in one line; the exit status says the signal.
#[test]
fn an_interrupted_cp_into_a_new_file_leaves_nothing_behind() {
    use std::io::Read;
    let d = TempDir::new("cp-interrupted");
    // Large enough that the copy is still running when the signal comes (never-written pages
    // of a mem: export are read as zeros, and skipped in the new file).
    let t = Target::start(&["big=mem:64G"]);
    let new = d.path("new.img");
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let mut child = std::process::Command::new(common::BIN)
            .args(["cp", "--no-progress", "--jobs", "1", &t.url("big")])
            .arg(&new)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let listed = || std::fs::read_dir(d.path("")).unwrap().count();
        // The hidden file appears once the source is open: the copy has begun.
        assert!(
            common::wait_until(std::time::Duration::from_secs(20), || listed() > 0),
            "the copy never created its file"
        );
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        // Died of the signal, as without the handler (a shell loop around it stops too).
        assert_eq!(status.signal(), Some(sig), "{status:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("interrupted") && err.contains("was not created"),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(d.path(""))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            left.is_empty(),
            "left behind: {left:?} ({:?})",
            status.signal()
        );
    }
}

/// Between two exports of one target, a size off either side's blocks is refused before the
/// target copies anything: it checks each 64 MiB COPY by itself, and the last one was refused
/// after the others had overwritten the destination.
#[test]
fn cp_inside_a_target_refuses_sizes_off_the_blocks_before_copying() {
    let d = TempDir::new("cp-offload-block");
    let (src, dst) = (d.path("src.img"), d.path("dst.img"));
    common::sparse_file(&src, (128 << 20) + 512);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&src)
        .unwrap()
        .write_all(b"abc")
        .unwrap();
    common::sparse_file(&dst, 129 << 20);
    let t = Target::start(&[
        &format!("s=file:{}", src.display()),
        &format!("d=file:{}?direct=1", dst.display()),
    ]);
    let (ok, _, err) = cli(&["cp", &t.url("s"), &t.url("d")]);
    assert!(!ok, "copied a size the destination cannot take");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("nothing was copied"), "{err}");
    let mut head = [0u8; 3];
    std::fs::File::open(&dst)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert_eq!(head, [0; 3], "the destination was written");
}

/// A source whose size is not a whole number of the destination export's blocks (4096 for a
/// direct=1 file) is refused before anything is written, in one line that says what to do;
/// `bench --bs` below the export's block likewise. The copy used to overwrite the export
/// chunk by chunk and fail at the tail with "invalid request".
#[test]
fn cp_and_bench_refuse_sizes_the_export_cannot_take_before_any_io() {
    let d = TempDir::new("cp-block");
    let img = d.path("d.img");
    std::fs::write(&img, vec![7u8; 1 << 20]).unwrap();
    let src = d.path("src.img");
    std::fs::write(&src, random_bytes((64 << 10) + 512, 5)).unwrap();
    let t = Target::start(&[&format!("d=file:{}?direct=1", img.display())]);
    let (ok, _, err) = cli(&["cp", src.to_str().unwrap(), &t.url("d")]);
    assert!(!ok, "copied a size the export cannot take");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("not a multiple of")
            && err.contains("4096")
            && err.contains("nothing was copied"),
        "{err}"
    );
    assert!(
        std::fs::read(&img).unwrap().iter().all(|b| *b == 7),
        "the export was written"
    );
    let (ok, _, err) = cli(&["bench", &t.url("d"), "--bs", "512", "--runtime", "0.1"]);
    assert!(!ok, "bench ran 512-byte I/O on a 4096-byte export");
    assert!(err.contains("block (4096)"), "{err}");
}

#[test]
fn cp_over_existing_data_writes_zero_blocks_too() {
    // A non-fresh export must get its zero blocks overwritten (skipping is only safe when fresh).
    let d = TempDir::new("cp-zero");
    let img = d.path("export.img");
    std::fs::write(&img, vec![0xAAu8; 4 << 20]).unwrap();
    let src = d.path("zeros.img");
    sparse_file(&src, 4 << 20);
    let t = Target::start(&[&format!("f=file:{}", img.display())]);
    let (ok, _, err) = cli(&["cp", src.to_str().unwrap(), &t.url("f")]);
    assert!(ok, "{err}");
    assert_eq!(sha256(&img), sha256(&src));
}

#[test]
fn info_shows_geometry_and_lists_exports() {
    let t = Target::start(&["disk0=mem:1G", "ro0=null:1M,ro"]);
    let (ok, out, err) = cli(&["info", &t.url("disk0"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["size"], 1u64 << 30);
    assert_eq!(v["logical_block_size"], 512);
    assert!(v["features"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f == "trim"));
    let (ok, out, _) = cli(&["info", &t.base, "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let names: Vec<_> = v["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].clone())
        .collect();
    assert_eq!(names, vec!["disk0", "ro0"]);
    let (ok, out, _) = cli(&["info", &t.url("ro0")]);
    assert!(ok && out.contains("read-only"), "{out}");
}

/// `info` reads the grant from a session of one connection: a target whose memory holds the
/// minimum of fewer queues than it grants still answers (connecting every queue granted, info
/// failed with "join queue 9: target out of resources"), and shows what it grants.
#[test]
fn info_answers_from_a_target_with_little_memory() {
    let t = Target::start_with(&["m=mem:64M"], &["--max-memory", "64M"]);
    let (ok, out, err) = cli(&["info", &t.url("m"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["max_queues"], 64, "{out}");
}

#[test]
fn bench_json_reports_iops_and_latency() {
    let t = Target::start(&["m=mem:64M"]);
    for rw in ["randread", "randrw", "write"] {
        let (ok, out, err) = cli(&[
            "bench",
            &t.url("m"),
            "--rw",
            rw,
            "--bs",
            "4k",
            "--iodepth",
            "8",
            "--jobs",
            "2",
            "--runtime",
            "0.5",
            "--json",
        ]);
        assert!(ok, "{rw}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(v["iops"].as_f64().unwrap() > 0.0, "{out}");
        assert!(v["bandwidth_bytes"].as_f64().unwrap() > 0.0);
        let lat = &v["latency_us"];
        for k in ["mean", "p50", "p99", "p999"] {
            assert!(lat[k].as_f64().unwrap() > 0.0, "{k}: {out}");
        }
        assert!(lat["p50"].as_f64() <= lat["p999"].as_f64());
        assert_eq!(v["errors"], 0);
        assert_eq!(v["queues"].as_array().unwrap().len(), 2);
    }
}

#[test]
fn bad_input_gets_one_line_errors() {
    let d = TempDir::new("bad");
    let small = d.path("big.img");
    std::fs::write(&small, vec![1u8; 2 << 20]).unwrap();
    let t = Target::start(&["m=mem:1M", "r=mem:1M,ro"]);
    let big = small.to_str().unwrap();
    assert_one_line_error(&["info", &t.url("nope")], "no such export");
    assert_one_line_error(&["info", "tcp://127.0.0.1:1/x"], "cannot connect");
    assert_one_line_error(&["info", "http://x/y"], "bad URL");
    // clap's own errors keep what they list: the missing argument, the possible values.
    assert_one_line_error(&["info"], "<URL>");
    // Nothing answers on this UDP port: info gives up after its --timeout (1 s here, 10 s by
    // default) with one line.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let quiet = format!("udp://{}/x", silent.local_addr().unwrap());
    assert_one_line_error(&["info", &quiet, "--timeout", "1"], "no answer over UDP");
    assert_one_line_error(&["info", &quiet, "--timeout", "0"], "--timeout 0");
    assert_one_line_error(
        &["bench", &t.url("m"), "--rw", "sideways"],
        "possible values: read, write",
    );
    assert_one_line_error(
        &["bench", &t.url("m"), "--size", "2M", "--runtime", "1"],
        "larger than the export",
    );
    assert_one_line_error(
        &["serve", "--threads", "100000", "--export", "x=mem:1M"],
        "--threads 100000",
    );
    // Flags that would be ignored or bent are refused: a read mix without a mixed workload,
    // a discovery wait outside what is taken.
    assert_one_line_error(
        &["bench", "tcp://127.0.0.1:9/x", "--rwmixread", "70"],
        "goes with --rw randrw",
    );
    assert_one_line_error(&["discover", "--wait-ms", "5"], "--wait-ms");
    // Out-of-range values name the flag given, not the option behind it (`max_sessions`,
    // `handshake_timeout_s`).
    for (flag, said) in [
        ("--max-sessions", "--max-sessions must be"),
        ("--handshake-timeout", "--handshake-timeout must be"),
    ] {
        assert_one_line_error(&["serve", flag, "99999999", "--export", "x=mem:1M"], said);
    }
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M,rw",
        ],
        "known options are 'ro' and 'allow=",
    );
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            // More than any x86_64 address space, even with 5-level page tables.
            "x=mem:200000T",
        ],
        "use a smaller size",
    );
    assert_one_line_error(&["bench", "tcp://127.0.0.1:1/x", "--bs", "4q"], "bad size");
    assert_one_line_error(&["cp", "/nonexistent/file", &t.url("m")], "No such file");
    assert_one_line_error(&["cp", big, &t.url("m")], "smaller than");
    assert_one_line_error(&["cp", big, &t.url("r")], "read-only");
    assert_one_line_error(&["cp", big, "/tmp/x"], "neither side is a URL");
    assert_one_line_error(
        &["bench", &t.url("r"), "--rw", "randwrite", "--runtime", "1"],
        "read-only",
    );
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1Q",
        ],
        "bad size",
    );
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=file:/nonexistent/d.img",
        ],
        "no such file",
    );
    assert_one_line_error(
        &["serve", "--listen", "bogus", "--export", "x=mem:1M"],
        "bad listen address",
    );
    // NVMe's MDTS cannot say 4 KiB (0 means no limit): hosts would send what must be refused.
    assert_one_line_error(
        &[
            "serve",
            "--max-io",
            "4K",
            "--listen",
            "nvme-tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M",
        ],
        "NVMe/TCP needs --max-io of at least 8K",
    );
}

/// Protection asked for on a transport that cannot give it is refused, never dropped silently;
/// paths, sizes and names are checked before anything is bound or created.
#[test]
fn options_that_cannot_apply_are_refused_in_one_line() {
    let d = TempDir::new("refused");
    let key = d.path("k");
    let (ok, _, err) = cli(&["key", "gen", key.to_str().unwrap(), "--host-id", "h1"]);
    assert!(ok, "key gen: {err}");
    let key = key.to_str().unwrap();
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let quiet = format!("udp://{}/x", silent.local_addr().unwrap());
    assert_one_line_error(&["info", &quiet, "--tls"], "--tls is for tcp:// only");
    assert_one_line_error(
        &["bench", &quiet, "--tls-ca", key, "--runtime", "1"],
        "--tls is for tcp:// only",
    );
    assert_one_line_error(&["discover", &quiet, "--tls"], "--tls is for tcp:// only");
    // Nothing answering is a failure a script can test for, with or without --json.
    let quiet_port = format!("udp://{}", silent.local_addr().unwrap());
    assert_one_line_error(
        &["discover", &quiet_port, "--wait-ms", "50"],
        "no target answered",
    );
    let (ok, out, err) = cli(&["discover", &quiet_port, "--wait-ms", "50", "--json"]);
    assert!(!ok && err.contains("no target answered"), "{err}");
    assert_eq!(out.trim(), r#"{"targets":[]}"#);
    // Over TCP, --encrypt would have been ignored: the traffic would have gone in clear.
    for url in ["tcp://127.0.0.1:9/x", "tcp://127.0.0.1:9/x?encrypt=1"] {
        let mut args = vec!["bench", url, "--key", key, "--host-id", "h1"];
        if !url.contains('?') {
            args.push("--encrypt");
        }
        assert_one_line_error(&args, "over tcp:// use --tls");
    }
    assert_one_line_error(
        &[
            "bench",
            "tcp://127.0.0.1:9/x",
            "--tls-ca",
            "/nonexistent/ca.pem",
        ],
        "--tls-ca /nonexistent/ca.pem: cannot read it",
    );
    assert_one_line_error(
        &["bench", "tcp://127.0.0.1:9/x", "--runtime", "1e20"],
        "at most 604800 seconds",
    );
    // Too short to run an I/O, or negative (which the argument parser took for a flag, and
    // then told to write `-- -1`, which failed too); port 9 is closed: these are said before
    // connecting.
    for short in ["1e-10", "-1"] {
        assert_one_line_error(
            &["bench", "tcp://127.0.0.1:9/x", "--runtime", short],
            "at least 0.001",
        );
        assert_one_line_error(
            &["info", "tcp://127.0.0.1:9/x", "--timeout", short],
            "at least 0.001",
        );
    }
    for bs in ["0", "100"] {
        assert_one_line_error(
            &["bench", "tcp://127.0.0.1:9/x", "--bs", bs],
            "multiple of 512",
        );
    }
    for cmd in ["bench", "cp", "copy"] {
        let mut args = vec![cmd, "tcp://127.0.0.1:9/x"];
        match cmd {
            "cp" => args.push("/dev/null"),
            "copy" => args.extend(["--src", "0:1M", "--dst", "2M"]),
            _ => {}
        }
        args.extend(["--timeout", "0"]);
        assert_one_line_error(&args, "0 is not in 1..=86400");
    }
    assert_one_line_error(&["bench", "--iodpeth", "3", "tcp://h/x"], "'--iodepth'");
    assert_one_line_error(
        &[
            "copy",
            "tcp://127.0.0.1:9/x",
            "--src",
            "0:4G",
            "--dst",
            "8G",
        ],
        "shorter than 4 GiB",
    );
    // `-` is not taken for a file of that name (it made one, 64 MiB of the export's bytes).
    for args in [
        ["cp", "tcp://127.0.0.1:9/x", "-"],
        ["cp", "-", "tcp://127.0.0.1:9/x"],
    ] {
        assert_one_line_error(&args, "not standard input or output");
    }
    assert!(!std::path::Path::new("-").exists());
    // A typo in --rpc-socket's directory creates nothing.
    let missing = d.path("no/such/dir");
    let sock = format!("{}/sock", missing.display());
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M",
            "--rpc-socket",
            &sock,
        ],
        "no directory",
    );
    assert!(
        !missing.exists() && !d.path("no").exists(),
        "{sock}: created"
    );
    // A data file given as the socket is refused and left alone, with nothing made beside it;
    // an empty path names nothing.
    let data = d.path("in.bin");
    std::fs::write(&data, b"data").unwrap();
    let served = |sock: &str| {
        [
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            "x=mem:1M",
            "--rpc-socket",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(std::iter::once(sock.to_string()))
        .collect::<Vec<String>>()
    };
    let args = served(data.to_str().unwrap());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_one_line_error(&args, "exists and is not a socket");
    assert_eq!(std::fs::read(&data).unwrap(), b"data");
    assert!(
        !d.path("in.bin.lock").exists(),
        "a lock file made beside it"
    );
    let args = served("");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_one_line_error(&args, "names no file");
    assert_one_line_error(
        &[
            "serve",
            "--export",
            "x=mem:1M",
            "--subsystem",
            "nqn.2026-11.x:y=nope",
        ],
        "--subsystem 'nqn.2026-11.x:y=nope': no export 'nope'",
    );
    assert_one_line_error(&["serve", "--rpc-socket", "none"], "no exports");
    // A limit of 0 is refused in the flag's words (it was taken as 1).
    assert_one_line_error(
        &[
            "serve",
            "--export",
            "x=mem:1M",
            "--rpc-socket",
            "none",
            "--max-sessions",
            "0",
        ],
        "--max-sessions must be a whole number from 1",
    );
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            "tcp://nosuchhost.invalid",
            "--export",
            "x=mem:1M",
            "--rpc-socket",
            "none",
        ],
        "cannot resolve nosuchhost.invalid:7700",
    );
    assert_one_line_error(
        &[
            "serve",
            "--tls",
            "require",
            "--tls-cert",
            "/nonexistent/c.pem",
            "--tls-key",
            "/nonexistent/k.pem",
            "--export",
            "x=mem:1M",
            "--rpc-socket",
            "none",
        ],
        "--tls-cert /nonexistent/c.pem: cannot read it",
    );
    let odd = d.path("odd.img");
    std::fs::write(&odd, vec![0u8; 1000]).unwrap();
    let spec = format!("x=file:{}", odd.display());
    let serve = |spec: &str| {
        vec![
            "serve".to_string(),
            "--listen".into(),
            "tcp://127.0.0.1:0".into(),
            "--rpc-socket".into(),
            "none".into(),
            "--export".into(),
            spec.to_string(),
        ]
    };
    let args = serve(&spec);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_one_line_error(&args, "truncate -s %512");
    let spec = format!("x=file:{}", d.path("").display());
    let args = serve(&spec);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_one_line_error(&args, "is a directory");
}

#[test]
fn serve_stops_cleanly_on_sigterm() {
    let mut t = Target::start(&["m=mem:1M"]);
    let (ok, _, _) = cli(&["info", &t.url("m")]);
    assert!(ok);
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(t.pid(), libc::SIGTERM) }, 0);
    let status = t.child.wait().unwrap();
    assert!(status.success(), "exit status after SIGTERM: {status:?}");
}

#[test]
fn version_and_help_work() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("blkwire "));
    let out = Command::new(BIN)
        .args(["bench", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("--iodepth"));
}

#[test]
fn stats_shows_live_queue_counters() {
    let t = Target::start(&["m=mem:16M"]);
    let opts = blkwire_client::ConnectOptions {
        queues: 2,
        ..Default::default()
    };
    let mut s =
        blkwire_client::connect(&blkwire_client::Url::parse(&t.url("m")).unwrap(), &opts).unwrap();
    s.queues[1].write_at(&[1u8; 8192], 0, false).unwrap();
    let mut b = [0u8; 4096];
    for _ in 0..3 {
        s.queues[0].read_at(&mut b, 0).unwrap();
    }
    let (ok, out, err) = cli(&["stats", &t.base, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sess = &v["sessions"][0];
    assert_eq!(sess["export"], "m");
    let qs = sess["queues"].as_array().unwrap();
    assert_eq!(qs.len(), 2, "{out}");
    assert_eq!(
        (
            qs[0]["queue"].as_u64(),
            qs[0]["reads"].as_u64(),
            qs[0]["bytes_read"].as_u64()
        ),
        (Some(0), Some(3), Some(3 * 4096))
    );
    assert_eq!(
        (qs[1]["writes"].as_u64(), qs[1]["bytes_written"].as_u64()),
        (Some(1), Some(8192))
    );
    assert_eq!(qs[0]["protocol_errors"], 0);
    let (ok, out, _) = cli(&["stats", &t.base]);
    assert!(ok && out.lines().count() == 4, "{out}");
}

/// SO_REUSEPORT must not let a second target share a UDP port that one already serves (its
/// clients would alternate between the two): refused in one line, like TCP.
#[test]
fn a_second_target_on_a_served_udp_port_is_refused() {
    let port = common::free_udp_port();
    let listen = format!("udp://127.0.0.1:{port}");
    let (_first, urls) = Target::start_listeners(&["m=mem:1M"], &["--listen", &listen]);
    assert!(urls.contains(&listen), "{urls:?}");
    assert_one_line_error(
        &[
            "serve",
            "--listen",
            &listen,
            "--export",
            "m=mem:1M",
            "--log-level",
            "warn",
        ],
        "another blkwire target serves it",
    );
}

/// `blkwire stats URL | head -0`: the reader is gone before anything is printed. The command
/// ends quietly by SIGPIPE, as other tools do, instead of panicking.
#[test]
fn printing_into_a_closed_pipe_ends_quietly() {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::ExitStatusExt;
    let t = Target::start(&["m=mem:1M"]);
    let mut fds = [0i32; 2];
    // SAFETY: pipe into a two-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: closing the read end we just made: every write to the pipe now fails.
    unsafe { libc::close(fds[0]) };
    // SAFETY: the write end is ours; the child gets it as stdout, and it is closed here after.
    let stdout = unsafe { std::process::Stdio::from_raw_fd(fds[1]) };
    let out = Command::new(BIN)
        .args(["stats", &t.base])
        .stdout(stdout)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {err}",
        out.status
    );
}

/// Pointed at the wrong kind of listener, the command says what it found and what to use.
#[test]
fn the_wrong_listener_gets_a_message_that_says_so() {
    let (t, urls) = Target::start_listeners(&["m=mem:1M"], &["--listen", "nbd://127.0.0.1:0"]);
    let nbd = urls.iter().find(|u| u.starts_with("nbd://")).unwrap();
    let at_nbd = nbd.replacen("nbd://", "tcp://", 1);
    assert_one_line_error(&["info", &format!("{at_nbd}/m")], "this is an NBD listener");
    let udp = t.base.replacen("tcp://", "udp://", 1);
    assert_one_line_error(&["stats", &udp], "stats asks the target's tcp:// listener");
    // A target that never answers: given up at --timeout, the address said.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = silent.local_addr().unwrap();
    assert_one_line_error(
        &["stats", &format!("tcp://{at}"), "--timeout", "0.3"],
        &format!("stats from {at}: no reply from the target in 300ms"),
    );
    // Counters are the target's: an export named is a mistake, not silently dropped.
    assert_one_line_error(
        &["stats", &t.url("m")],
        &format!("not an export's: use {}", t.base),
    );
    assert_one_line_error(
        &["discover", &format!("{udp}/m")],
        "discovery lists every export of the target",
    );
}

/// Names a target sends reach the terminal without their control characters (escaped): a
/// hostile target cannot clear the screen or retitle the terminal through `info` or `stats`.
#[test]
fn names_from_a_target_are_shown_without_control_characters() {
    use blkwire_wire::{ExportEntry, Features, Status, AUTH_LEN};
    use common::native_raw::answering_target;

    // A LIST query's answer: the list of one export called `name`, then the target's proof
    // (zeros: no key).
    let listing = |name: &str| {
        let list = ExportEntry::encode_list(&[ExportEntry {
            name: name.into(),
            size: 1 << 20,
            features: Features(0),
        }])
        .unwrap();
        answering_target(move |h| {
            let mut p = list;
            p.extend_from_slice(&[0; AUTH_LEN]);
            (h.reply(Status::Ok, 0), p)
        })
    };
    let evil = "disk\u{1b}]0;owned\u{7}\u{1b}[2J";
    let (ok, out, err) = cli(&["info", &listing(evil)]);
    assert!(ok, "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
    assert!(out.contains("disk\\u{1b}]0;owned"), "{out}");
    // JSON lets C1 controls (a one-character CSI) and DEL stand in strings: escaped anyway.
    let (ok, out, err) = cli(&["info", "--json", &listing("disk\u{9b}2J\u{7f}")]);
    assert!(ok, "{err}");
    assert!(out.trim_end().chars().all(|c| !c.is_control()), "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["exports"][0]["name"], "disk\u{9b}2J\u{7f}");

    let doc = serde_json::json!({
        "sessions": [{"session": 1, "export": evil, "queues": [{"queue": 0, "thread": 0}]}],
        "closed": {},
    })
    .to_string()
    .into_bytes();
    let url = answering_target(move |h| {
        let mut p = doc;
        p.extend_from_slice(&[0; AUTH_LEN]);
        (h.reply(Status::Ok, 0), p)
    });
    let (ok, out, err) = cli(&["stats", &url]);
    assert!(ok, "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
}
