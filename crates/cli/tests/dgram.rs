//! Datagram transports (PROTOCOL.md §9): UDP on loopback, and raw Ethernet and UDP between two
//! network namespaces joined by a veth pair, with loss and duplication injected by nftables
//! `netdev` rules. The namespace tests need root (CI runs as root); they clean up on drop.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blkwire_client::{connect, ConnectOptions, Url};
use blkwire_wire::{fragment_count, ExportEntry, Header, Opcode, Tag};
use common::netlab::{NetLab, Served};
use common::{random_bytes, TempDir, BIN};

/// Files of 512 B .. 4 MiB copied to the export and back over `url`; every byte must match.
fn copy_round_trips(lab: &NetLab, url: &str, export_size: usize) {
    let d = TempDir::new("dgram-cp");
    for (i, size) in [
        512usize,
        4096 + 512,
        65536 + 1024,
        (1 << 20) + 4096,
        4 << 20,
    ]
    .into_iter()
    .enumerate()
    {
        let src = d.path(&format!("src{i}"));
        let data = random_bytes(size, 40 + i as u64);
        std::fs::write(&src, &data).unwrap();
        let (ok, _, err) = lab.cli(&[
            "cp",
            "--no-progress",
            "--timeout",
            "20",
            src.to_str().unwrap(),
            url,
        ]);
        assert!(ok, "upload {size} bytes over {url}: {err}");
        let back = d.path(&format!("back{i}"));
        let (ok, _, err) = lab.cli(&[
            "cp",
            "--no-progress",
            "--timeout",
            "20",
            url,
            back.to_str().unwrap(),
        ]);
        assert!(ok, "download over {url}: {err}");
        let got = std::fs::read(&back).unwrap();
        assert_eq!(got.len(), export_size);
        assert!(
            got[..size] == data[..],
            "{size} bytes over {url}: data differs"
        );
    }
}

fn bench_json(lab: &NetLab, url: &str, rw: &str, bs: &str) -> serde_json::Value {
    let (ok, out, err) = lab.cli(&[
        "bench",
        url,
        "--rw",
        rw,
        "--bs",
        bs,
        "--iodepth",
        "16",
        "--runtime",
        "1",
        "--timeout",
        "20",
        "--json",
    ]);
    assert!(ok, "bench over {url}: {err}");
    serde_json::from_str(&out).unwrap()
}

fn sum(v: &serde_json::Value, key: &str) -> u64 {
    v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q[key].as_u64().unwrap())
        .sum()
}

fn target_stats(lab: &NetLab, tcp: &str) -> serde_json::Value {
    let (ok, out, err) = lab.cli(&["stats", tcp, "--json"]);
    assert!(ok, "stats: {err}");
    serde_json::from_str(&out).unwrap()
}

fn transports_over_veth(n: u8, mtu: u32) {
    let lab = NetLab::new(n, mtu);
    let ip = format!("10.99.{n}.1");
    let listen = [
        format!("tcp://{ip}:7700"),
        format!("udp://{ip}:7701"),
        "eth://vt".to_string(),
    ];
    let listen: Vec<&str> = listen.iter().map(String::as_str).collect();
    let t = Served::start(Some(&lab.t), &listen, &["m=mem:8M"]);
    let mac = lab.mac();
    assert_eq!(t.url("eth://"), format!("eth://vt/{mac}"));
    let urls = [format!("eth://vi/{mac}/m"), format!("udp://{ip}:7701/m")];
    for url in &urls {
        copy_round_trips(&lab, url, 8 << 20);
        // Frames share datagrams (PROTOCOL.md §9.6): requests always (48-byte headers), 4 KiB
        // read replies when two fit the link (jumbo frames).
        let v = bench_json(&lab, url, "randread", "4k");
        assert!(
            sum(&v, "datagrams_out") < sum(&v, "frames_out"),
            "requests at QD16 over {url} were not packed: {v}"
        );
        if mtu >= 9000 {
            assert!(
                sum(&v, "datagrams_in") < sum(&v, "frames_in"),
                "4k replies over {url} at MTU {mtu} were not packed: {v}"
            );
        }
        // UDP runs of equal datagrams leave segmented and arrive coalesced (§9.6): read
        // replies answered together by the target, the fragments of a 16 KiB write; over veth
        // a run stays one packet end to end.
        if url.starts_with("udp") {
            assert!(
                sum(&v, "coalesced_in") > 0,
                "no coalesced receive of read replies over {url}: {v}"
            );
            let w = bench_json(&lab, url, "randwrite", "16k");
            assert!(
                sum(&w, "segmented_out") > 0,
                "no segmented send of write fragments over {url}: {w}"
            );
        }
    }
    // Loss: every byte still right, and the counters show the recovery.
    lab.impair(5, 0);
    for url in &urls {
        copy_round_trips(&lab, url, 8 << 20);
        let v = bench_json(&lab, url, "randwrite", "16k");
        assert!(
            sum(&v, "retransmits") > 0,
            "5% loss over {url} but no retransmits: {v}"
        );
        assert_eq!(v["errors"], 0);
    }
    // Duplication: nothing executed twice, duplicates dropped and counted.
    lab.impair(0, 5);
    let before = target_stats(&lab, &t.url("tcp://"))["closed"]["dropped_duplicates"]
        .as_u64()
        .unwrap();
    for url in &urls {
        copy_round_trips(&lab, url, 8 << 20);
        let v = bench_json(&lab, url, "randrw", "4k");
        assert_eq!(v["errors"], 0);
        let client_dups = sum(&v, "late_replies") + sum(&v, "duplicates");
        assert!(
            client_dups > 0,
            "5% duplication over {url} but the initiator saw no duplicate: {v}"
        );
    }
    let after = target_stats(&lab, &t.url("tcp://"))["closed"]["dropped_duplicates"]
        .as_u64()
        .unwrap();
    assert!(
        after > before,
        "the target dropped no duplicate request ({before} -> {after})"
    );
}

/// An ICMP error for the target's port (a firewall rejecting it for a while: host
/// prohibited, which Linux reports on the connected socket as EHOSTUNREACH) loses frames as the
/// network may: the requests are sent again once the path is back, and none fails. It ended
/// the queue at once with "No route to host".
#[test]
fn icmp_errors_from_the_path_are_loss_not_the_end() {
    let n = 24;
    let lab = NetLab::new(n, 1500);
    let tcp = format!("tcp://10.99.{n}.1:7700");
    let udp = format!("udp://10.99.{n}.1:7701");
    let _t = Served::start(Some(&lab.t), &[&tcp, &udp], &["d=mem:16M"]);
    let mut bench = Command::new("ip")
        .args(["netns", "exec", &lab.i, BIN, "bench", &format!("{udp}/d")])
        .args([
            "--runtime",
            "8",
            "--iodepth",
            "4",
            "--timeout",
            "30",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sessions = || {
        target_stats(&lab, &tcp)["sessions"]
            .as_array()
            .map_or(0, Vec::len)
    };
    assert!(
        common::wait_until(Duration::from_secs(20), || sessions() > 0),
        "the bench never opened its session"
    );
    let nft = |rule: &str| {
        common::netlab::sh(&["ip", "netns", "exec", &lab.t, "nft", rule]);
    };
    nft("add table inet fw");
    nft("add chain inet fw in { type filter hook input priority 0 ; }");
    nft("add rule inet fw in udp dport 7701 counter reject with icmp type host-prohibited");
    let rejected = || {
        let (_, out, _) = common::netlab::run(Command::new("ip").args([
            "netns", "exec", &lab.t, "nft", "list", "table", "inet", "fw",
        ]));
        out.split("packets ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|p| p.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Rejected until requests have been refused by ICMP a few times (or the bench ended).
    let hit = common::wait_until(Duration::from_secs(20), || {
        rejected() >= 5 || bench.try_wait().unwrap().is_some()
    });
    nft("delete table inet fw");
    assert!(hit, "the firewall rejected nothing");
    let out = bench.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the bench failed: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["errors"], 0, "{v}");
    assert!(sum(&v, "retransmits") > 0, "nothing was sent again: {v}");
}

#[test]
fn eth_and_udp_over_veth_mtu_1500() {
    transports_over_veth(1, 1500);
}

#[test]
fn eth_and_udp_over_veth_mtu_9000() {
    transports_over_veth(2, 9000);
}

/// `?qdisc=bypass` on both ends hands raw Ethernet frames straight to the driver: a qdisc that
/// drops everything queued on it (pfifo of length 0) no longer sees them, while an initiator
/// without it is cut off by the same qdisc (so the qdisc does apply, and the bypass is what
/// passes it).
#[test]
fn eth_with_qdisc_bypass_skips_the_egress_qdisc() {
    common::need_tool("tc", "iproute2");
    let lab = NetLab::new(22, 1500);
    for (ns, dev) in [(&lab.t, "vt"), (&lab.i, "vi")] {
        let tc = |args: &[&str]| {
            let mut cmd = vec!["ip", "netns", "exec", ns, "tc"];
            cmd.extend_from_slice(args);
            common::netlab::sh(&cmd);
        };
        tc(&["qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0"]);
    }
    let _t = Served::start(Some(&lab.t), &["eth://vt?qdisc=bypass"], &["m=mem:8M"]);
    let url = format!("eth://vi/{}/m", lab.mac());
    // A generous timeout where it must work (a loaded machine), a short one where it must not.
    let bench = |url: &str, timeout: &str| {
        lab.cli(&[
            "bench",
            url,
            "--runtime",
            "1",
            "--timeout",
            timeout,
            "--iodepth",
            "4",
            "--json",
        ])
    };
    let (ok, out, err) = bench(&format!("{url}?qdisc=bypass"), "20");
    assert!(ok, "with the bypass on both ends: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["ops"].as_u64().unwrap() > 0, "{out}");
    let (ok, _, err) = bench(&url, "2");
    assert!(!ok, "the qdisc drops what passes through it");
    assert!(err.contains("no answer"), "{err}");
}

/// A raw Ethernet listener is saved as it was asked for (its EtherType and qdisc option
/// kept: the bound `eth://IFACE/MAC` parses as no listen address) and a target started from
/// the saved config serves it again; the same interface and EtherType cannot be listened on
/// twice (a second packet socket would hear every frame and refuse the first's sessions).
#[test]
fn an_eth_listener_is_saved_as_asked_and_never_added_twice() {
    let lab = NetLab::new(23, 1500);
    let dir = TempDir::new("eth-config");
    let asked = "eth://vt?ethertype=0x88b6&qdisc=bypass";
    let serve = |args: &[&str]| {
        let sock = dir.path("ctl.sock").to_str().unwrap().to_string();
        let _ = std::fs::remove_file(&sock);
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &lab.t, BIN, "serve", "--log-level", "warn"]);
        cmd.args(["--rpc-socket", &sock]).args(args);
        let (child, urls) = common::spawn_serve_with_control(&mut cmd, 1);
        (Served { child, urls }, sock)
    };
    let rpc = |sock: &str, method: &str, params: &str| {
        common::cli(&["rpc", method, params, "--socket", sock])
    };
    let (t, sock) = serve(&["--listen", asked, "--export", "m=mem:8M"]);
    assert!(t.urls[0].starts_with("eth://vt/"), "{:?}", t.urls);
    for again in [asked, "eth://vt?ethertype=0x88b6"] {
        let (ok, _, err) = rpc(&sock, "listener_add", &format!(r#"{{"url":"{again}"}}"#));
        assert!(!ok && err.contains("already listening"), "{again}: {err}");
    }
    let saved = dir.path("saved.json").to_str().unwrap().to_string();
    let (ok, _, err) = rpc(&sock, "save_config", &format!(r#"{{"path":"{saved}"}}"#));
    assert!(ok, "{err}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let listeners: Vec<_> = config
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["method"] == "listener_add")
        .map(|c| c["params"]["url"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listeners, vec![asked.to_string()]);
    drop(t);
    let (again, sock) = serve(&["--config", &saved]);
    assert_eq!(again.urls[0], format!("eth://vt/{}", lab.mac()));
    let (ok, out, err) = rpc(&sock, "listener_list", "{}");
    assert!(ok && out.matches("eth://").count() == 1, "{out}{err}");
}

#[test]
fn discovery_finds_the_target_and_its_exports() {
    let lab = NetLab::new(3, 1500);
    let t = Served::start(
        Some(&lab.t),
        &["udp://10.99.3.1:7701", "eth://vt"],
        &["a=mem:1M", "b=null:2M,ro"],
    );
    let mac = lab.mac();
    let (ok, out, err) = lab.cli(&["discover", "--interface", "vi", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let targets = v["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 1, "{out}");
    assert_eq!(targets[0]["target"], format!("eth://vi/{mac}"));
    let names: Vec<_> = targets[0]["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(targets[0]["exports"][1]["size"], 2 << 20);
    let (ok, out, _) = lab.cli(&["discover", &t.url("udp://")]);
    assert!(
        ok && out.contains("udp://10.99.3.1:7701/a") && out.contains("udp://10.99.3.1:7701/b"),
        "{out}"
    );
}

#[test]
fn a_killed_target_fails_io_within_the_give_up_time() {
    let lab = NetLab::new(4, 1500);
    let mut t = Served::start(
        Some(&lab.t),
        &["tcp://10.99.4.1:7700", "eth://vt"],
        &["m=mem:8M"],
    );
    let mac = lab.mac();
    let url = format!("eth://vi/{mac}/m");
    let mut bench = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.i,
            BIN,
            "bench",
            &url,
            "--runtime",
            "60",
            "--timeout",
            "2",
            "--iodepth",
            "4",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the target is serving the bench (its counters move), then kill it.
    let tcp = t.url("tcp://");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = target_stats(&lab, &tcp);
        let busy = v["sessions"].as_array().unwrap().iter().any(|s| {
            s["queues"]
                .as_array()
                .unwrap()
                .iter()
                .any(|q| q["frames_in"].as_u64().unwrap_or(0) > 100)
        });
        if busy {
            break;
        }
        assert!(Instant::now() < deadline, "bench never reached the target");
    }
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let killed = Instant::now();
    let status = bench.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(bench.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "bench must fail when its target dies");
    assert!(err.contains("I/O error"), "{err}");
    assert!(
        killed.elapsed() < Duration::from_secs(20),
        "gave up after {:?}, give-up time was 2 s",
        killed.elapsed()
    );
}

/// Stale and duplicated WRITEs replayed by hand (PROTOCOL.md §6): never executed twice, never
/// landing after a newer write to the same slot.
#[test]
fn stale_and_duplicate_writes_are_never_applied() {
    let t = Served::start(
        None,
        &["udp://127.0.0.1:0", "tcp://127.0.0.1:0"],
        &["m=mem:1M"],
    );
    let url = Url::parse(&format!("{}/m", t.url("udp://"))).unwrap();
    let opts = ConnectOptions {
        queues: 2,
        depth: 1,
        max_io: 64 << 10,
        ..Default::default()
    };
    let mut s = connect(&url, &opts).unwrap();
    let fp = 32 << 10; // loopback: the largest fragment payload
    let session = s.queues[0].session_id().unwrap();
    // Frames of a WRITE of `data` at 0 with generation `gen` on queue 0 slot 0, as the client
    // library sends them (depth 1: the n-th request on the queue has generation n).
    let frames = |data: &[u8], gen: u16| -> Vec<Vec<u8>> {
        let n = fragment_count(data.len() as u32, fp);
        (0..n)
            .map(|i| {
                let mut h = Header::request(Opcode::Write, Tag::new(0, gen), 0, data.len() as u32);
                h.session = session;
                h.frag_index = i as u16;
                h.frag_count = n as u16;
                h.frag_offset = i * fp;
                let chunk =
                    &data[(i * fp) as usize..((i + 1) * fp).min(data.len() as u32) as usize];
                h.payload_len = chunk.len() as u32;
                h.seal_crc(chunk);
                let mut b = h.to_bytes().to_vec();
                b.extend_from_slice(chunk);
                b
            })
            .collect()
    };
    let (a, b, c) = (
        random_bytes(40_000, 1),
        random_bytes(40_000, 2),
        random_bytes(40_000, 3),
    );
    s.queues[0].write_at(&a, 0, false).unwrap(); // generation 1
    s.queues[0].write_at(&b, 0, false).unwrap(); // generation 2
                                                 // A delayed copy of the first write arrives now: it is stale and must be dropped.
    for f in frames(&a, 1) {
        s.queues[0].send_raw_frame(&f).unwrap();
    }
    s.queues[0].keepalive().unwrap(); // generation 3: the target has seen the replay by now
    let mut back = vec![0u8; 40_000];
    s.queues[1].read_at(&mut back, 0).unwrap();
    assert!(back == b, "a stale WRITE landed over a newer one");
    // Another queue writes C; then a duplicate of B (generation 2) arrives on queue 0 again:
    // B completed before, so it must not run a second time. Queue 0 slot 0 now holds
    // generation 3 (the keepalive), so the replayed generation 2 is stale as well; and a
    // duplicate of the newest request is answered from the cache.
    s.queues[1].write_at(&c, 0, false).unwrap();
    for f in frames(&b, 2) {
        s.queues[0].send_raw_frame(&f).unwrap();
    }
    let mut h = Header::request(Opcode::Keepalive, Tag::new(0, 3), 0, 0);
    h.session = session;
    h.seal_crc(&[]);
    s.queues[0].send_raw_frame(&h.to_bytes()).unwrap(); // duplicate of the newest request
    s.queues[0].keepalive().unwrap();
    // A frame corrupted in flight (payload bit flipped after the CRC was computed): dropped and
    // counted, never executed.
    let mut bad = frames(&a, 4).remove(0);
    let last = bad.len() - 1;
    bad[last] ^= 1;
    s.queues[0].send_raw_frame(&bad).unwrap();
    s.queues[0].keepalive().unwrap();
    s.queues[1].read_at(&mut back, 0).unwrap();
    assert!(back == c, "a duplicated or corrupt WRITE was executed");
    let (ok, out, err) = common::cli(&["stats", &t.url("tcp://"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let q0 = &v["sessions"][0]["queues"][0];
    assert!(
        q0["dropped_duplicates"].as_u64().unwrap() >= 3,
        "target counters: {q0}"
    );
    assert_eq!(
        q0["writes"], 2,
        "queue 0 executed exactly the two writes it was asked for: {q0}"
    );
    let bad: u64 = v["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["bad_frames"].as_u64().unwrap())
        .sum();
    assert_eq!(bad, 1, "the corrupt frame is counted once: {}", v["ports"]);
}

/// UDP on loopback: sizes from 512 B to above max I/O, several queues, every byte right; on RAM
/// and on RAM completed by a helper thread (the asynchronous completion path). Large READs
/// leave pointing at the export's memory (`mem:`) or at the slot's buffer (`memthread:`), with
/// CRCs computed when queued: a buffer freed or reused before the send would arrive as frames
/// failing their CRC, so none may.
#[test]
fn udp_loopback_round_trips() {
    for export in ["m=mem:32M", "m=memthread:32M"] {
        udp_round_trips(export, "");
    }
    // Data frames' CRCs over their header only (PROTOCOL.md §9.7): the same data comes back.
    udp_round_trips("m=mem:32M", "?crc=header");
}

fn udp_round_trips(export: &str, query: &str) {
    let t = Served::start(None, &["udp://127.0.0.1:0"], &[export]);
    let url = Url::parse(&format!("{}/m{query}", t.url("udp://"))).unwrap();
    let mut s = connect(
        &url,
        &ConnectOptions {
            queues: 3,
            depth: 8,
            max_io: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.queues.len(), 3);
    assert_eq!(s.info.header_crc, !query.is_empty(), "{export}{query}");
    let mut off = 0u64;
    for (i, size) in [512usize, 4096, 33_000, 1 << 20, (4 << 20) + 512]
        .into_iter()
        .enumerate()
    {
        let data = random_bytes(size, 90 + i as u64);
        let q = i % 3;
        s.queues[q].write_at(&data, off, i % 2 == 0).unwrap();
        let mut back = vec![0u8; size];
        s.queues[(q + 1) % 3].read_at(&mut back, off).unwrap();
        assert!(back == data, "{export}: {size} bytes");
        off += size as u64;
    }
    s.queues[0].trim(0, 4096).unwrap();
    s.queues[0].flush().unwrap();
    let mut z = vec![1u8; 4096];
    s.queues[2].read_at(&mut z, 0).unwrap();
    assert!(z.iter().all(|b| *b == 0));
    for (i, q) in s.queues.iter().enumerate() {
        assert_eq!(q.stats().crc_errors, 0, "{export}: queue {i}");
    }
}

/// A restarted target does not know the old session: the initiator is told at once
/// (`SessionLost`, so it can reconnect) instead of waiting for its give-up time.
#[test]
fn a_restarted_target_reports_the_session_lost() {
    let port = common::free_udp_port();
    let listen = format!("udp://127.0.0.1:{port}");
    let mut t = Served::start(None, &[&listen], &["m=mem:1M"]);
    let url = Url::parse(&format!("{listen}/m")).unwrap();
    let opts = ConnectOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let mut s = connect(&url, &opts).unwrap();
    s.queues[0].write_at(&[1u8; 4096], 0, false).unwrap();
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let _t2 = Served::start(None, &[&listen], &["m=mem:1M"]);
    let start = Instant::now();
    let e = s.queues[0].write_at(&[2u8; 4096], 0, false).unwrap_err();
    assert!(matches!(e, blkwire_client::Error::SessionLost), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    // A new session works.
    let mut s2 = connect(&url, &opts).unwrap();
    s2.queues[0].write_at(&[3u8; 4096], 0, false).unwrap();
}

/// 256 one-frame READs of 1 MiB on 256 slots: a slot holds a data buffer only while its
/// request runs, so the target does not keep 256 MiB for 12 KiB of requests (+260 MB before).
#[test]
fn datagram_reads_do_not_pin_a_buffer_per_slot() {
    let t = Served::start(
        None,
        &["udp://127.0.0.1:0", "tcp://127.0.0.1:0"],
        &["m=mem:64M"],
    );
    let url = Url::parse(&format!("{}/m", t.url("udp://"))).unwrap();
    let opts = ConnectOptions {
        queues: 1,
        depth: 256,
        max_io: 1 << 20,
        ..Default::default()
    };
    let mut s = connect(&url, &opts).unwrap();
    assert_eq!((s.info.depth, s.info.max_io), (256, 1 << 20), "granted");
    // Data everywhere, so every read copies 1 MiB into its buffer.
    s.queues[0]
        .write_at(&random_bytes(1 << 20, 5), 0, false)
        .unwrap();
    let session = s.queues[0].session_id().unwrap();
    let before = common::rss_kib(t.child.id());
    for slot in 0..256u16 {
        let mut h = Header::request(Opcode::Read, Tag::new(slot, 7), 0, 1 << 20);
        h.session = session;
        h.seal_crc(&[]);
        s.queues[0].send_raw_frame(&h.to_bytes()).unwrap();
    }
    // The target has run them all once its counters say so (replies go unread).
    let mut reads = 0;
    common::wait_until(Duration::from_secs(30), || {
        let (ok, out, err) = common::cli(&["stats", &t.url("tcp://"), "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        reads = v["sessions"][0]["queues"][0]["reads"].as_u64().unwrap_or(0);
        reads >= 256
    });
    assert!(reads >= 256, "the target ran {reads} of the 256 reads");
    let after = common::rss_kib(t.child.id());
    assert!(
        after < before + 64 * 1024,
        "target RSS grew from {before} KiB to {after} KiB for 256 datagram reads of 1 MiB"
    );
}

/// A LIST over UDP is answered with no more than the request's size (PROTOCOL.md §12.5): with
/// more exports than fit, the reply holds as many of the first ones as fit, whole, in order.
#[test]
fn a_udp_list_holds_the_first_exports_that_fit() {
    let names: Vec<String> = (0..200)
        .map(|i| format!("export-{i:03}-{}", "x".repeat(50)))
        .collect();
    let specs: Vec<String> = names.iter().map(|n| format!("{n}=mem:1M")).collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let t = Served::start(None, &["udp://127.0.0.1:0"], &specs);
    let url = Url::parse(&format!("{}/", t.url("udp://"))).unwrap();
    let got = blkwire_client::list(&url, &ConnectOptions::default()).unwrap();
    assert!(
        !got.is_empty() && got.len() < names.len(),
        "{} of {} exports in one datagram",
        got.len(),
        names.len()
    );
    // The client pads its LIST to 4 KiB on loopback (its LIST_ROOM): after the u16 count,
    // entries of 78 bytes each (a 61-byte name, size and features): 52 fit.
    let entry = got[0].encoded_len();
    assert_eq!(entry, 78);
    let fit = (4096 - ExportEntry::LIST_HEADER_LEN) / entry;
    assert_eq!(got.len(), fit, "as many as fit");
    let listed: Vec<&str> = got.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(listed, names[..got.len()]);
    assert!(got.iter().all(|e| e.size == 1 << 20));
}
