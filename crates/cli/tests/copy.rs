//! Server-side COPY (PROTOCOL.md §13) against a real target: data copied within and between
//! exports on every transport and backend kind, the refusals that leave the destination
//! untouched, a failure in the middle that says how much was copied, copies under concurrent
//! I/O, `blkwire cp` and `blkwire copy` as a user runs them, reflinks on XFS, and over a veth link
//! between two namespaces the bytes that do (not) cross the network.

mod common;

use std::process::Command;

use blkwire_client::{connect, Cmd, ConnectOptions, CopyRange, Error, Queue, Session, Url};
use blkwire_wire::{CopyDescriptor, Status};
use common::netlab::{run, sh, NetLab, Served};
use common::{assert_one_line_error, cli, random_bytes, sha256, sparse_file, Target, TempDir};

const MIB: u64 = 1 << 20;

fn session(url: &str, queues: u16) -> Session {
    let opts = ConnectOptions {
        queues,
        depth: 8,
        max_io: 1 << 20,
        ..Default::default()
    };
    connect(&Url::parse(url).unwrap(), &opts).expect("connect")
}

fn range(offset: u64, len: u64) -> CopyRange {
    CopyRange {
        offset,
        len: len as u32,
    }
}

fn read(q: &mut Queue, offset: u64, len: u64) -> Vec<u8> {
    let mut b = vec![0u8; len as usize];
    q.read_at(&mut b, offset).unwrap();
    b
}

/// One COPY command as given, without the library's checks and splitting: its status and the
/// length its reply carries (the bytes copied).
fn raw_copy(
    q: &mut Queue,
    source: &str,
    ranges: &[CopyRange],
    dst: u64,
    len: u32,
) -> (Status, u32) {
    let d = CopyDescriptor {
        source: source.into(),
        ranges: ranges.to_vec(),
    }
    .encode()
    .unwrap();
    q.submit(
        Cmd::Copy {
            dst,
            len,
            descriptor: &d,
        },
        7,
    )
    .unwrap();
    let mut got = None;
    q.complete(1, |c| got = Some((c.status, c.length))).unwrap();
    got.expect("one completion")
}

/// Within one export and between two (either way), with several ranges per copy, and ranges
/// longer than one backend operation (1 MiB) and one COPY command (64 MiB).
fn round_trips(a: &str, b: &str) {
    let mut s = session(a, 1);
    let mut t = session(b, 1);
    let q = &mut s.queues[0];
    assert!(q.copy_limits().enabled(), "{a}: COPY granted");
    let data = random_bytes((3 * MIB) as usize, 1);
    q.write_at(&data, 0, false).unwrap();
    // Within: two ranges, out of order, land back to back.
    q.copy("", &[range(2 * MIB, MIB), range(4096, 8192)], 8 * MIB)
        .unwrap();
    let mut want = data[(2 * MIB) as usize..(3 * MIB) as usize].to_vec();
    want.extend_from_slice(&data[4096..4096 + 8192]);
    assert!(read(q, 8 * MIB, want.len() as u64) == want, "{a}: within");
    // Across: a's first 3 MiB to b at 1 MiB + 512 (unaligned), and back from b to a.
    let b_name = b.rsplit('/').next().unwrap();
    let a_name = a.rsplit('/').next().unwrap();
    let tq = &mut t.queues[0];
    tq.copy(a_name, &[range(0, 3 * MIB)], MIB + 512).unwrap();
    assert!(read(tq, MIB + 512, 3 * MIB) == data, "{a} -> {b}");
    q.copy(b_name, &[range(MIB + 512, 3 * MIB)], 16 * MIB)
        .unwrap();
    assert!(read(q, 16 * MIB, 3 * MIB) == data, "{b} -> {a}");
    // Longer than one COPY command: the library splits it, the data is whole.
    let big = 80 * MIB;
    let pattern = random_bytes(MIB as usize, 2);
    for i in 0..big / MIB {
        q.write_at(&pattern, 32 * MIB + i * MIB, false).unwrap();
    }
    tq.copy(a_name, &[range(32 * MIB, big)], 0).unwrap();
    for i in (0..big / MIB).step_by(13) {
        assert!(read(tq, i * MIB, MIB) == pattern, "{a} -> {b}: MiB {i}");
    }
}

#[test]
fn copies_round_trip_within_and_between_exports_over_tcp_and_udp() {
    let dir = TempDir::new("copy-rt");
    let f = dir.path("f.img");
    sparse_file(&f, 128 * MIB);
    let fspec = format!("f=file:{}", f.display());
    let (t, urls) = Target::start_listeners(
        &["m=mem:128M", &fspec, "n=mem:128M", "mt=memthread:128M"],
        &["--listen", "udp://127.0.0.1:0"],
    );
    let (tcp, udp) = (&urls[0], &urls[1]);
    // mem <-> file (native copy within each; reads and writes across), then mem <-> mem, and
    // mem <-> memthread, whose reads complete on its own threads (a copy from it waits on a
    // poll of its notifier).
    for base in [tcp, udp] {
        round_trips(&format!("{base}/m"), &format!("{base}/f"));
        round_trips(&format!("{base}/f"), &format!("{base}/n"));
        round_trips(&format!("{base}/n"), &format!("{base}/mt"));
    }
    // STATS counts the copies and their bytes.
    let (ok, out, err) = cli(&["stats", &t.base, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let copied = v["closed"]["bytes_copied"].as_u64().unwrap();
    // Per round trip: 1 MiB + 8 KiB within, 3 MiB twice across, 80 MiB across; 6 round trips.
    assert_eq!(copied, 6 * (MIB + 8192 + 6 * MIB + 80 * MIB), "{out}");
    // COPY commands per round trip: within, across, back, and the 80 MiB split in two.
    assert_eq!(v["closed"]["copies"].as_u64().unwrap(), 6 * 5, "{out}");
    assert_eq!(v["closed"]["errors"].as_u64().unwrap(), 0, "{out}");
}

#[test]
fn refused_copies_write_nothing_and_say_why() {
    let t = Target::start(&[
        "a=mem:16M",
        "b=mem:8M",
        "ro=mem:8M,ro",
        "hidden=mem:8M,allow=10.0.0.0/8",
    ]);
    let mut s = session(&t.url("a"), 1);
    let q = &mut s.queues[0];
    let data = random_bytes((2 * MIB) as usize, 3);
    q.write_at(&data, 0, false).unwrap();
    let before = read(q, 0, 16 * MIB);
    let cases: [(&str, Vec<CopyRange>, u64, u32, Status); 9] = [
        // Overlapping source and destination within one export: refused (§13).
        (
            "",
            vec![range(0, MIB)],
            MIB / 2,
            MIB as u32,
            Status::Invalid,
        ),
        // A source range past the end, a destination past the end.
        (
            "",
            vec![range(16 * MIB - 4096, 8192)],
            0,
            8192,
            Status::OutOfRange,
        ),
        (
            "",
            vec![range(0, 8192)],
            16 * MIB - 4096,
            8192,
            Status::OutOfRange,
        ),
        (
            "",
            vec![range(u64::MAX - 10, 4096)],
            0,
            4096,
            Status::OutOfRange,
        ),
        // The request's length is not the sum of the ranges.
        ("", vec![range(0, 4096)], 8 * MIB, 8192, Status::Invalid),
        // Sources the host may not see: missing, and not allowed to it (as unknown).
        (
            "nope",
            vec![range(0, 4096)],
            8 * MIB,
            4096,
            Status::NoExport,
        ),
        (
            "hidden",
            vec![range(0, 4096)],
            8 * MIB,
            4096,
            Status::NoExport,
        ),
        // Another export: a range past its end (b is 8 MiB).
        (
            "b",
            vec![range(8 * MIB, 4096)],
            8 * MIB,
            4096,
            Status::OutOfRange,
        ),
        // An empty descriptor.
        ("", vec![], 8 * MIB, 0, Status::Invalid),
    ];
    for (i, (src, ranges, dst, len, want)) in cases.iter().enumerate() {
        let (st, copied) = raw_copy(q, src, ranges, *dst, *len);
        assert_eq!((st, copied), (*want, 0), "case {i}");
    }
    assert!(
        read(q, 0, 16 * MIB) == before,
        "a refused copy wrote something"
    );
    // The library refuses a copy within the export whose whole destination meets a source,
    // even where each of the commands it would split into does not (the target checks each
    // command on its own): 128 MiB from 0 to 64 MiB.
    let mut big = session(&t.url("a"), 1);
    assert!(matches!(
        big.queues[0].copy("", &[range(0, 8 * MIB)], 4 * MIB),
        Err(Error::Usage(m)) if m.contains("overlaps")
    ));
    // More ranges than granted: refused before anything is read.
    let many: Vec<CopyRange> = (0..q.copy_limits().max_ranges as u64 + 1)
        .map(|i| range(i * 512, 512))
        .collect();
    let total = many.len() as u32 * 512;
    assert_eq!(raw_copy(q, "", &many, 8 * MIB, total), (Status::Invalid, 0));
    // A read-only export grants no COPY, and one sent anyway is refused.
    let mut r = session(&t.url("ro"), 1);
    let rq = &mut r.queues[0];
    assert!(
        !rq.copy_limits().enabled(),
        "read-only exports grant no COPY"
    );
    let (st, _) = raw_copy(rq, "a", &[range(0, 4096)], 0, 4096);
    assert_eq!(st, Status::Unsupported);
    assert!(matches!(
        rq.copy("a", &[range(0, 4096)], 0),
        Err(Error::Usage(_))
    ));
    // The queue still serves after all of that.
    assert!(read(q, 0, 2 * MIB) == data);
}

/// An O_DIRECT export takes a COPY's offsets and lengths aligned as it takes READ's and
/// WRITE's (4096 here): misaligned ones, into it, within it or out of it, are refused `INVALID`
/// with nothing copied, before anything is written, and aligned ones copy. (Unchecked, an
/// aligned range and then one off by less than a sector failed with EINVAL after the first was
/// copied, within the export and out of it; off by 512, the kernel took them on this disk.)
#[test]
fn misaligned_copies_with_an_o_direct_export_are_refused_before_writing() {
    let dir = TempDir::new("copy-direct");
    let f = dir.path("d.img");
    let data = random_bytes((8 * MIB) as usize, 11);
    std::fs::write(&f, &data).unwrap();
    let t = Target::start(&[&format!("d=file:{}?direct=1", f.display()), "m=mem:8M"]);
    let mut s = session(&t.url("d"), 1);
    let mut m = session(&t.url("m"), 1);
    let mq = &mut m.queues[0];
    mq.write_at(&data[..2 * MIB as usize], 0, false).unwrap();
    let q = &mut s.queues[0];
    let cases: [(&str, Vec<CopyRange>, u64); 5] = [
        // Within: an aligned range, then one at a misaligned source offset.
        ("", vec![range(0, 4096), range(8192 + 100, 4096)], 4 * MIB),
        ("", vec![range(0, 4096), range(8192 + 512, 4096)], 4 * MIB),
        // Within: an aligned range, then a misaligned length.
        ("", vec![range(0, 4096), range(8192, 4096 + 512)], 4 * MIB),
        // From the mem: export: a misaligned destination, or length.
        ("m", vec![range(0, 8192)], 4 * MIB + 512),
        ("m", vec![range(0, 4096), range(8192, 512)], 4 * MIB),
    ];
    for (i, (src, ranges, dst)) in cases.iter().enumerate() {
        let len = ranges.iter().map(|r| r.len).sum();
        let (st, copied) = raw_copy(q, src, ranges, *dst, len);
        assert_eq!((st, copied), (Status::Invalid, 0), "case {i}");
        assert!(
            std::fs::read(&f).unwrap() == data,
            "case {i}: a refused copy wrote something"
        );
    }
    // Out of it into the mem: export: an aligned range, then a misaligned source offset.
    for off in [100, 512] {
        let ranges = [range(0, 4096), range(off, 4096)];
        let (st, copied) = raw_copy(mq, "d", &ranges, 4 * MIB, 8192);
        assert_eq!((st, copied), (Status::Invalid, 0), "from {off}");
        assert!(
            read(mq, 4 * MIB, 8192) == vec![0u8; 8192],
            "from {off}: wrote"
        );
    }
    // Aligned: copied, into it and out of it.
    assert_eq!(
        raw_copy(q, "m", &[range(4096, 8192)], 4 * MIB, 8192),
        (Status::Ok, 8192)
    );
    assert_eq!(
        raw_copy(mq, "d", &[range(8192, 4096)], 4 * MIB, 4096),
        (Status::Ok, 4096)
    );
    let mut want = data.clone();
    want[4 * MIB as usize..][..8192].copy_from_slice(&data[4096..4096 + 8192]);
    assert!(std::fs::read(&f).unwrap() == want);
    assert!(read(mq, 4 * MIB, 4096) == data[8192..8192 + 4096]);
}

#[test]
fn a_copy_that_fails_half_way_says_how_much_it_copied() {
    let dir = TempDir::new("copy-fail");
    let f = dir.path("f.img");
    std::fs::write(&f, random_bytes((16 * MIB) as usize, 4)).unwrap();
    let t = Target::start(&[&format!("f=file:{}", f.display())]);
    let mut s = session(&t.url("f"), 1);
    let q = &mut s.queues[0];
    // The file shrinks under the target: reads past 12 MiB find its end.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(12 * MIB)
        .unwrap();
    let src = read(q, 8 * MIB, 4 * MIB);
    match q.copy("", &[range(8 * MIB, 8 * MIB)], 0) {
        Err(Error::Copy { status, copied }) => {
            assert_eq!(status, Status::Io);
            // Chunks of 1 MiB: the four before the end are copied, then the copy stops.
            assert_eq!(copied, 4 * MIB);
        }
        other => panic!("expected a copy error, got {other:?}"),
    }
    assert!(
        read(q, 0, 4 * MIB) == src,
        "the prefix it reports holds the data"
    );
}

#[test]
fn copies_run_beside_reads_and_writes_on_other_queues() {
    let t = Target::start(&["a=mem:64M", "b=mem:64M"]);
    let mut s = session(&t.url("b"), 2);
    let mut queues = std::mem::take(&mut s.queues);
    let mut io = queues.pop().unwrap();
    let mut cq = queues.pop().unwrap();
    let mut src = session(&t.url("a"), 1);
    let data = random_bytes((32 * MIB) as usize, 5);
    src.queues[0].write_at(&data, 0, false).unwrap();
    let copier = std::thread::spawn(move || {
        for _ in 0..4 {
            cq.copy("a", &[range(0, 32 * MIB)], 0).unwrap();
            cq.copy("", &[range(0, 16 * MIB)], 32 * MIB).unwrap();
        }
        cq
    });
    // Meanwhile the other queue writes and reads the last 16 MiB, which no copy touches.
    for i in 0..200u64 {
        let block = random_bytes(65536, 100 + i);
        let off = 48 * MIB + (i % 256) * 65536;
        io.write_at(&block, off, false).unwrap();
        assert!(read(&mut io, off, 65536) == block, "I/O {i}");
    }
    let mut cq = copier.join().unwrap();
    assert!(read(&mut cq, 0, 32 * MIB) == data);
    assert!(read(&mut cq, 32 * MIB, 16 * MIB) == data[..(16 * MIB) as usize]);
}

/// Threads of a process whose name starts with `prefix`.
fn threads(pid: u32, prefix: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|c| c.starts_with(prefix))
        })
        .count()
}

/// Copies from a backend whose reads run on its own threads (`memthread:` opens a thread per
/// queue) reuse the source queue of the copy before: a stream of COPYs does not make the
/// target start a thread each.
#[test]
fn copies_from_one_source_reuse_its_queue() {
    let t = Target::start(&["mt=memthread:16M", "m=mem:16M"]);
    let mut s = session(&t.url("m"), 1);
    let q = &mut s.queues[0];
    let pid = t.child.id();
    for i in 0..50u64 {
        q.copy("mt", &[range(i * 4096, 4096)], i * 4096).unwrap();
    }
    // The source queue this session's copies use, kept idle; nothing else opened one.
    assert_eq!(threads(pid, "blkwire-memthre"), 1);
}

/// Peak resident memory of a process, in KiB (VmHWM).
fn peak_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A client that pipelines a queue's worth of COPYs between exports (each needing a 1 MiB
/// bounce buffer inside the target: the source, memthread:, offers no descriptor to copy from)
/// gets them run one at a time: the target's memory grows by the data copied, not by a buffer
/// per COPY sent.
#[test]
fn many_copies_sent_at_once_do_not_grow_the_target_by_a_buffer_each() {
    let t = Target::start(&["a=memthread:16M", "b=mem:16M"]);
    let mut a = session(&t.url("a"), 1);
    a.queues[0]
        .write_at(&random_bytes((16 * MIB) as usize, 10), 0, false)
        .unwrap();
    let opts = ConnectOptions {
        queues: 1,
        depth: 128,
        max_io: 1 << 20,
        ..Default::default()
    };
    let mut b = connect(&Url::parse(&t.url("b")).unwrap(), &opts).unwrap();
    let q = &mut b.queues[0];
    assert_eq!(q.depth(), 128);
    let before = peak_kib(t.child.id());
    let d = CopyDescriptor {
        source: "a".into(),
        ranges: vec![range(0, 16 * MIB)],
    }
    .encode()
    .unwrap();
    for i in 0..128 {
        let cmd = Cmd::Copy {
            dst: 0,
            len: (16 * MIB) as u32,
            descriptor: &d,
        };
        q.submit(cmd, i).unwrap();
    }
    let mut ok = 0;
    while ok < 128 {
        q.complete(1, |c| {
            assert_eq!((c.status, c.length), (Status::Ok, (16 * MIB) as u32));
            ok += 1;
        })
        .unwrap();
    }
    let grew = (peak_kib(t.child.id()) - before) * 1024;
    // b's 16 MiB of data, one bounce buffer and slack; a buffer per COPY would be 128 MiB more.
    assert!(
        grew < 48 * MIB,
        "the target grew by {} MiB for 128 COPYs in flight",
        grew / MIB
    );
}

#[test]
fn cp_between_exports_of_one_target_copies_inside_it_and_no_offload_gives_the_same_bytes() {
    let dir = TempDir::new("copy-cp");
    let src = dir.path("src.bin");
    std::fs::write(&src, random_bytes((40 * MIB + 4096) as usize, 6)).unwrap();
    let t = Target::start(&[
        "a=mem:64M",
        "b=mem:64M",
        "c=mem:64M",
        "ro=mem:64M,ro",
        "mt=memthread:64M",
    ]);
    let (ok, _, err) = cli(&["cp", src.to_str().unwrap(), &t.url("a")]);
    assert!(ok, "{err}");
    let stats = || -> serde_json::Value {
        let (ok, out, err) = cli(&["stats", &t.base, "--json"]);
        assert!(ok, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let read_before = stats()["closed"]["bytes_read"].as_u64().unwrap();
    let (ok, out, err) = cli(&["cp", &t.url("a"), &t.url("b")]);
    assert!(ok && out.contains("inside the target"), "{out}{err}");
    let after = stats();
    // Nothing was read through the network for it: the target copied 64 MiB itself.
    assert_eq!(after["closed"]["bytes_read"].as_u64().unwrap(), read_before);
    assert_eq!(after["closed"]["bytes_copied"].as_u64().unwrap(), 64 * MIB);
    let (ok, out, err) = cli(&["cp", "--no-offload", &t.url("a"), &t.url("c")]);
    assert!(ok && !out.contains("inside the target"), "{out}{err}");
    assert_eq!(
        stats()["closed"]["bytes_copied"].as_u64().unwrap(),
        64 * MIB,
        "--no-offload copies through this host"
    );
    // To and from a backend whose I/O completes on its own threads, inside the target too.
    for (from, to) in [("c", "mt"), ("mt", "c")] {
        let (ok, out, err) = cli(&["cp", &t.url(from), &t.url(to)]);
        assert!(ok && out.contains("inside the target"), "{out}{err}");
    }
    let mut sums = Vec::new();
    for e in ["b", "c"] {
        let back = dir.path(&format!("{e}.bin"));
        let (ok, _, err) = cli(&["cp", &t.url(e), back.to_str().unwrap()]);
        assert!(ok, "{err}");
        // The exports are larger than the file: compare the file's part.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&back)
            .unwrap()
            .set_len(40 * MIB + 4096)
            .unwrap();
        sums.push(sha256(&back));
    }
    assert_eq!(sums, vec![sha256(&src), sha256(&src)]);
    // What a user can get wrong, one line each.
    assert_one_line_error(&["cp", &t.url("a"), &t.url("a")], "same export");
    assert_one_line_error(&["cp", &t.url("a"), &t.url("ro")], "read-only");
    assert_one_line_error(&["cp", &t.url("a"), &t.url("nope")], "nope");
}

#[test]
fn blkwire_copy_copies_ranges_and_refuses_bad_input_in_one_line() {
    let t = Target::start(&["a=mem:16M", "b=mem:16M", "ro=mem:1M,ro"]);
    let mut s = session(&t.url("a"), 1);
    let data = random_bytes((4 * MIB) as usize, 7);
    s.queues[0].write_at(&data, 0, false).unwrap();
    let (ok, out, err) = cli(&["copy", &t.url("a"), "--src", "1M:64K,0:4K", "--dst", "8M"]);
    assert!(ok && out.contains("inside the target"), "{out}{err}");
    // Made durable before it said so: its session flushed (closed by now, or closing: its
    // counters are in the closed totals or still its queue's; this test's own session
    // flushed nothing).
    let (ok, out, err) = cli(&["stats", "--json", &t.base]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let live: u64 = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["queues"].as_array().unwrap())
        .map(|q| q["flushes"].as_u64().unwrap())
        .sum();
    assert_eq!(v["closed"]["flushes"].as_u64().unwrap() + live, 1, "{v}");
    let mut want = data[MIB as usize..(MIB + 65536) as usize].to_vec();
    want.extend_from_slice(&data[..4096]);
    assert!(read(&mut s.queues[0], 8 * MIB, want.len() as u64) == want);
    let (ok, _, err) = cli(&[
        "copy",
        &t.url("b"),
        "--from",
        "a",
        "--src",
        "0:4M",
        "--dst",
        "0",
    ]);
    assert!(ok, "{err}");
    let mut b = session(&t.url("b"), 1);
    assert!(read(&mut b.queues[0], 0, 4 * MIB) == data);
    let a = t.url("a");
    for (args, needle) in [
        (
            vec!["--from", "a", "--src", "0:1M", "--dst", "512K"],
            "overlaps",
        ),
        (vec!["--src", "0:1M", "--dst", "512K"], "overlaps"),
        (vec!["--src", "0:1M", "--dst", "16M"], "beyond the end"),
        // Several COPYs' worth, the last past the end: refused before the first runs.
        (
            vec!["--src", "0:4M,0:4M,0:4M", "--dst", "8M"],
            "nothing was copied",
        ),
        (
            vec!["--src", "18446744073709547520:4K", "--dst", "0"],
            "beyond the end",
        ),
        (vec!["--src", "1M", "--dst", "0"], "OFFSET:LENGTH"),
        (
            vec!["--src", "0:0", "--dst", "8M"],
            "at least 1 byte and shorter than 4 GiB",
        ),
        (vec!["--src", "0:1M", "--dst", "x"], "--dst"),
        (
            vec!["--from", "nope", "--src", "0:1M", "--dst", "0"],
            "no such export",
        ),
        // Another export's end too (ro has 1 MiB): refused before any COPY is sent.
        (
            vec![
                "--from",
                "ro",
                "--src",
                "0:512K,0:512K,0:512K,1M:4K",
                "--dst",
                "0",
            ],
            "beyond the end of the export ro (1048576 bytes): nothing was copied",
        ),
    ] {
        let mut all = vec!["copy", a.as_str()];
        all.extend(args);
        assert_one_line_error(&all, needle);
    }
    assert!(
        read(&mut s.queues[0], 8 * MIB, want.len() as u64) == want,
        "a refused copy changed the export"
    );
    assert_one_line_error(
        &["copy", &t.url("ro"), "--src", "0:4K", "--dst", "8K"],
        "read-only",
    );
    // `info` shows what a session may copy: the HELLO reply's limits.
    for (e, ranges) in [("a", true), ("ro", false)] {
        let (ok, out, err) = cli(&["info", &t.url(e), "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["copy_max_ranges"].as_u64().unwrap() > 0, ranges, "{out}");
        assert_eq!(v["copy_max_bytes"].as_u64().unwrap() > 0, ranges, "{out}");
    }
}

/// A loop-mounted XFS with reflinks, unmounted and removed on drop.
struct Xfs {
    dir: TempDir,
}

impl Xfs {
    fn new() -> Xfs {
        let dir = TempDir::new("copy-xfs");
        let img = dir.path("xfs.img");
        sparse_file(&img, 512 * MIB);
        let mnt = dir.path("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let (ok, _, err) = run(Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img));
        assert!(
            ok,
            "mkfs.xfs failed (apt-get install xfsprogs; scripts/deps.sh does): {err}"
        );
        let (ok, _, err) = run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt));
        assert!(
            ok,
            "loop-mounting an XFS image needs root and loop devices: {err}"
        );
        Xfs { dir }
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path("mnt").join(name)
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = run(Command::new("umount").arg(self.dir.path("mnt")));
    }
}

/// Physical extents of a file as `filefrag -v` lists them: (logical block, physical block,
/// length, shared).
fn extents(path: &std::path::Path) -> Vec<(u64, u64, u64, bool)> {
    let out = Command::new("filefrag")
        .arg("-v")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "filefrag (e2fsprogs) is needed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 5
                || !f[0].ends_with(':')
                || f[0].trim_end_matches(':').parse::<u32>().is_err()
            {
                return None;
            }
            let first = |s: &str| {
                s.trim_end_matches(':')
                    .split("..")
                    .next()?
                    .trim()
                    .parse()
                    .ok()
            };
            Some((
                first(f[1])?,
                first(f[3])?,
                f[5].trim_end_matches(':').parse().ok()?,
                l.contains("shared"),
            ))
        })
        .collect()
}

#[test]
fn on_a_reflink_filesystem_file_exports_copy_by_sharing_extents_within_and_across() {
    let xfs = Xfs::new();
    let f = xfs.path("disk.img");
    std::fs::write(&f, random_bytes((16 * MIB) as usize, 8)).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let t = Target::start(&[&format!("d=file:{}", f.display())]);
    let mut s = session(&t.url("d"), 1);
    let q = &mut s.queues[0];
    q.copy("", &[range(0, 16 * MIB)], 32 * MIB).unwrap();
    q.flush().unwrap();
    assert!(read(q, 32 * MIB, 16 * MIB) == read(q, 0, 16 * MIB));
    // The copy's blocks are the source's blocks, shared: nothing was written twice.
    let ext = extents(&f);
    let block_of = |logical: u64| {
        ext.iter()
            .find(|e| e.0 <= logical && logical < e.0 + e.2)
            .unwrap_or_else(|| panic!("no extent at block {logical}: {ext:?}"))
    };
    let (src, dst) = (block_of(0), block_of(32 * MIB / 4096));
    assert!(src.3 && dst.3, "extents shared: {ext:?}");
    assert_eq!(src.1, dst.1, "the same physical blocks: {ext:?}");
    drop(s);
    drop(t);
    // Between two file exports on the filesystem: the other file shares the blocks too.
    let g = xfs.path("other.img");
    sparse_file(&g, 64 * MIB);
    let t = Target::start(&[
        &format!("d=file:{}", f.display()),
        &format!("g=file:{}", g.display()),
    ]);
    let mut s = session(&t.url("g"), 1);
    let q = &mut s.queues[0];
    q.copy("d", &[range(0, 16 * MIB)], 0).unwrap();
    q.flush().unwrap();
    let mut d = session(&t.url("d"), 1);
    assert!(read(q, 0, 16 * MIB) == read(&mut d.queues[0], 0, 16 * MIB));
    let other = extents(&g);
    assert!(
        other
            .first()
            .is_some_and(|e| e.0 == 0 && e.1 == src.1 && e.3),
        "the other file's first extent is the source's blocks: {other:?} vs {ext:?}"
    );
}

/// Bytes a namespace's veth end has received and sent.
fn link_bytes(ns: &str, dev: &str) -> u64 {
    ["rx_bytes", "tx_bytes"]
        .iter()
        .map(|c| {
            let (ok, out, _) = run(Command::new("ip").args([
                "netns",
                "exec",
                ns,
                "cat",
                &format!("/sys/class/net/{dev}/statistics/{c}"),
            ]));
            assert!(ok);
            out.trim().parse::<u64>().unwrap()
        })
        .sum()
}

#[test]
fn a_one_gib_server_side_copy_moves_less_than_one_percent_of_it_over_the_link() {
    let lab = NetLab::new(31, 1500);
    let dir = TempDir::new("copy-wire");
    let (src, dst) = (dir.path("src.img"), dir.path("dst.img"));
    // 1 GiB of data (a 1 MiB pattern, so it is quick to write), and an empty destination.
    {
        use std::io::Write;
        let mut w = std::io::BufWriter::new(std::fs::File::create(&src).unwrap());
        let pattern = random_bytes(MIB as usize, 9);
        for _ in 0..1024 {
            w.write_all(&pattern).unwrap();
        }
    }
    sparse_file(&dst, 1 << 30);
    let t = Served::start(
        Some(&lab.t),
        &["tcp://10.99.31.1:7700"],
        &[
            &format!("src=file:{}", src.display()),
            &format!("dst=file:{}", dst.display()),
        ],
    );
    let base = t.url("tcp://");
    let before = link_bytes(&lab.i, "vi");
    let (ok, out, err) = lab.cli(&["cp", &format!("{base}/src"), &format!("{base}/dst")]);
    assert!(ok && out.contains("inside the target"), "{out}{err}");
    let moved = link_bytes(&lab.i, "vi") - before;
    assert!(
        moved < (1 << 30) / 100,
        "{moved} bytes crossed the link for a 1 GiB server-side copy"
    );
    drop(t);
    sh(&["cmp", src.to_str().unwrap(), dst.to_str().unwrap()]);
}
