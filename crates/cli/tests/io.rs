//! Data-path tests against a real target on loopback, through the client library.

mod common;

use std::time::{Duration, Instant};

use blkwire_client::{connect, Cmd, ConnectOptions, Error, Session, Url};
use blkwire_wire::{Features, Status};
use common::frozen::{Frozen, LoopExt4};
use common::{random_bytes, sparse_file, Target, TempDir};

fn session(url: &str, queues: u16, max_io: u32) -> Session {
    let opts = ConnectOptions {
        queues,
        depth: 16,
        max_io,
        ..Default::default()
    };
    connect(&Url::parse(url).unwrap(), &opts).expect("connect")
}

/// Random data at many sizes (512 B .. 3.5 MiB, above max I/O so it is split) and offsets,
/// written and read back on every queue.
fn round_trips(url: &str, queues: u16) {
    let mut s = session(url, queues, 256 << 10);
    assert_eq!(
        s.queues.len(),
        queues as usize,
        "target grants the queues asked for"
    );
    common::round_trip_every_queue(&mut s);
    // Data written on one queue is visible on every other (PROTOCOL.md §10).
    let data = random_bytes(8192, 999);
    s.queues[0].write_at(&data, 0, true).unwrap();
    let last = s.queues.len() - 1;
    let mut back = vec![0u8; 8192];
    s.queues[last].read_at(&mut back, 0).unwrap();
    assert!(back == data, "cross-queue visibility");
}

#[test]
fn mem_round_trip_one_to_four_queues() {
    let t = Target::start(&["m=mem:64M"]);
    for q in [1, 2, 4] {
        round_trips(&t.url("m"), q);
    }
}

/// `memthread:` completes every request on a helper thread: the reactor learns of results
/// through the backend's notifier (the asynchronous completion path of the backend contract).
#[test]
fn memthread_round_trip_through_the_asynchronous_completion_path() {
    let t = Target::start(&["m=memthread:64M"]);
    for q in [1, 3] {
        round_trips(&t.url("m"), q);
    }
    let mut s = session(&t.url("m"), 1, 1 << 20);
    let q = &mut s.queues[0];
    q.write_at(&[7u8; 8192], 1 << 20, true).unwrap();
    q.write_zeroes(1 << 20, 4096, false).unwrap();
    q.flush().unwrap();
    let mut back = vec![1u8; 8192];
    q.read_at(&mut back, 1 << 20).unwrap();
    assert!(back[..4096].iter().all(|b| *b == 0) && back[4096..].iter().all(|b| *b == 7));
}

#[test]
fn file_round_trip_and_persistence() {
    let d = TempDir::new("file-rt");
    let img = d.path("disk.img");
    sparse_file(&img, 64 << 20);
    {
        let t = Target::start(&[&format!("f=file:{}", img.display())]);
        round_trips(&t.url("f"), 3);
        let mut s = session(&t.url("f"), 1, 1 << 20);
        s.queues[0].flush().unwrap();
    }
    // Whatever the target wrote is in the file itself.
    let bytes = std::fs::read(&img).unwrap();
    assert_eq!(&bytes[..8192], &random_bytes(8192, 999)[..]);
}

/// TRIM reads back as zeros on mem, WRITE_ZEROES as zeros everywhere, FLUSH succeeds.
fn zero_semantics(url: &str, trim_zeroes: bool) {
    let mut s = session(url, 1, 1 << 20);
    let q = &mut s.queues[0];
    let data = random_bytes(1 << 20, 7);
    q.write_at(&data, 0, false).unwrap();
    q.flush().unwrap();
    q.write_zeroes(4096 + 100, 65536, false).unwrap();
    q.write_zeroes(200_000, 4096, true).unwrap();
    q.trim(512 << 10, 128 << 10).unwrap();
    let mut back = vec![0u8; 1 << 20];
    q.read_at(&mut back, 0).unwrap();
    let zeroed = |r: std::ops::Range<usize>| back[r].iter().all(|b| *b == 0);
    assert!(zeroed(4196..4196 + 65536), "write-zeroes range reads zero");
    assert!(
        zeroed(200_000..204_096),
        "write-zeroes NO_HOLE range reads zero"
    );
    assert_eq!(
        &back[..4196],
        &data[..4196],
        "bytes before the zeroed range kept"
    );
    assert_eq!(
        &back[4196 + 65536..200_000],
        &data[4196 + 65536..200_000],
        "bytes after kept"
    );
    if trim_zeroes {
        assert!(zeroed((512 << 10)..(640 << 10)), "trimmed range reads zero");
    }
    assert_eq!(
        &back[640 << 10..],
        &data[640 << 10..],
        "bytes after the trim kept"
    );
    q.flush().unwrap();
}

#[test]
fn flush_trim_write_zeroes_on_mem_and_file() {
    let d = TempDir::new("zero");
    let img = d.path("disk.img");
    sparse_file(&img, 4 << 20);
    let t = Target::start(&["m=mem:4M", &format!("f=file:{}", img.display())]);
    zero_semantics(&t.url("m"), true);
    // On a file with hole punching (any Linux filesystem used for tests) TRIM reads zero too.
    zero_semantics(&t.url("f"), true);
}

/// A TRIM or WRITE_ZEROES longer than one piece on `mem:` (which zeroes on the reactor's own
/// thread) runs in pieces with the thread given back between them, in a slot, and is answered
/// once, when all of it is done, as a READ on another queue then shows. Over the stream
/// reactor (TCP) and the datagram port (UDP).
#[test]
fn long_trims_and_zeroes_on_mem_run_in_pieces_and_are_answered_whole() {
    let (_t, urls) = Target::start_listeners(&["m=mem:64M"], &["--listen", "udp://127.0.0.1:0"]);
    let len = 3 * blkwire_backend::INLINE_PIECE + 4096;
    let data = random_bytes(len as usize + 8192, 21);
    for base in &urls {
        let mut s = session(&format!("{base}/m"), 2, 1 << 20);
        for what in ["zero", "zero no_hole", "trim"] {
            s.queues[0].write_at(&data, 0, false).unwrap();
            let q = &mut s.queues[0];
            match what {
                "trim" => q.trim(4096, len),
                _ => q.write_zeroes(4096, len, what.ends_with("no_hole")),
            }
            .unwrap();
            let mut back = vec![1u8; data.len()];
            s.queues[1].read_at(&mut back, 0).unwrap();
            assert!(back[..4096] == data[..4096], "{base} {what}");
            assert!(
                back[4096..4096 + len as usize].iter().all(|&b| b == 0),
                "{base} {what}: all of it zeroed"
            );
            assert!(back[4096 + len as usize..] == data[4096 + len as usize..]);
        }
    }
}

#[test]
fn features_reflect_backends() {
    let d = TempDir::new("feat");
    let img = d.path("disk.img");
    sparse_file(&img, 1 << 20);
    let t = Target::start(&[
        "m=mem:1M",
        "r=mem:1M,ro",
        &format!("f=file:{}", img.display()),
    ]);
    let m = session(&t.url("m"), 1, 4096).info.features;
    assert!(m.has(Features::TRIM) && m.has(Features::WRITE_ZEROES) && m.has(Features::INIT_ZERO));
    assert!(
        !m.has(Features::FLUSH) && !m.has(Features::READ_ONLY),
        "mem is volatile"
    );
    let r = session(&t.url("r"), 1, 4096).info.features;
    assert!(r.has(Features::READ_ONLY) && !r.has(Features::TRIM));
    let f = session(&t.url("f"), 1, 4096).info.features;
    assert!(f.has(Features::FLUSH) && f.has(Features::FUA) && f.has(Features::INIT_ZERO));
}

#[test]
fn out_of_range_and_invalid_requests_get_the_right_status() {
    let t = Target::start(&["m=mem:1M"]);
    let mut s = session(&t.url("m"), 1, 1 << 20);
    let q = &mut s.queues[0];
    let status = |r: Result<(), Error>| match r {
        Err(Error::Status { status, .. }) => status,
        other => panic!("expected a status error, got {other:?}"),
    };
    let mut buf = vec![0u8; 4096];
    assert_eq!(
        status(q.read_at(&mut buf, (1 << 20) - 512)),
        Status::OutOfRange
    );
    assert_eq!(status(q.write_at(&buf, 1 << 20, false)), Status::OutOfRange);
    assert_eq!(status(q.trim(u64::MAX - 10, 100)), Status::OutOfRange);
    assert_eq!(
        status(q.write_zeroes(1 << 20, 1, false)),
        Status::OutOfRange
    );
    // The last bytes are reachable; the queue still works after errors.
    q.read_at(&mut buf, (1 << 20) - 4096).unwrap();
    q.keepalive().unwrap();
}

#[test]
fn read_only_export_refuses_writes() {
    let t = Target::start(&["r=mem:1M,ro"]);
    let mut s = session(&t.url("r"), 1, 1 << 20);
    let q = &mut s.queues[0];
    for r in [
        q.write_at(&[1u8; 512], 0, false),
        q.trim(0, 512),
        q.write_zeroes(0, 512, false),
    ] {
        assert!(
            matches!(
                r,
                Err(Error::Status {
                    status: Status::ReadOnly,
                    ..
                })
            ),
            "{r:?}"
        );
    }
    let mut buf = vec![1u8; 512];
    q.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
}

#[test]
fn unknown_export_is_refused_with_the_available_names() {
    let t = Target::start(&["disk0=mem:1M", "disk1=mem:1M"]);
    let e = connect(
        &Url::parse(&t.url("nope")).unwrap(),
        &ConnectOptions::default(),
    )
    .err()
    .expect("refused");
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            Error::Status {
                status: Status::NoExport,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("nope") && msg.contains("disk0, disk1"),
        "{msg}"
    );
}

#[test]
fn pipelined_completions_carry_their_own_data() {
    let t = Target::start(&["m=mem:16M"]);
    let mut s = session(&t.url("m"), 1, 1 << 20);
    let q = &mut s.queues[0];
    // Give each 4k block a distinct first byte, then read them all with 16 in flight.
    for b in 0..64u64 {
        q.write_at(&[b as u8 + 1; 4096], b * 4096, false).unwrap();
    }
    let mut seen = 0;
    let mut next = 0u64;
    while seen < 64 {
        while next < 64 && q.in_flight() < q.depth() {
            q.submit(
                Cmd::Read {
                    offset: next * 4096,
                    len: 4096,
                },
                next,
            )
            .unwrap();
            next += 1;
        }
        seen += q
            .complete(1, |c| {
                assert_eq!(c.status, Status::Ok);
                assert!(
                    c.data.iter().all(|x| *x as u64 == c.user + 1),
                    "block {}",
                    c.user
                );
            })
            .unwrap();
    }
    assert_eq!(q.stats().late_replies, 0);
}

#[test]
fn client_gets_a_clean_error_when_the_target_dies() {
    let mut t = Target::start(&["m=mem:64M"]);
    let mut s = session(&t.url("m"), 2, 1 << 20);
    let q = &mut s.queues[0];
    q.keepalive().unwrap();
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    let start = Instant::now();
    // The first calls may still be buffered by the kernel; within a few calls the loss shows.
    let mut err = None;
    for _ in 0..100 {
        let data = vec![5u8; 1 << 20];
        if let Err(e) = q.write_at(&data, 0, false) {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("writes to a dead target must fail");
    assert!(matches!(e, Error::Closed | Error::Io(_)), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "failure must not wait for the I/O timeout"
    );
}

#[test]
fn many_sessions_share_a_target() {
    let t = Target::start_with(&["m=mem:32M"], &["--threads", "2"]);
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let url = t.url("m");
            std::thread::spawn(move || {
                let mut s = session(&url, 2, 64 << 10);
                let data = random_bytes(300_000, i);
                let off = i * (1 << 20);
                s.queues[1].write_at(&data, off, false).unwrap();
                let mut back = vec![0u8; data.len()];
                s.queues[0].read_at(&mut back, off).unwrap();
                assert!(back == data, "session {i}");
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn direct_io_file_round_trip() {
    let d = TempDir::new("direct");
    let img = d.path("disk.img");
    sparse_file(&img, 16 << 20);
    let t = Target::start(&[&format!("f=file:{}?direct=1", img.display())]);
    let mut s = session(&t.url("f"), 2, 1 << 20);
    assert_eq!(
        s.info.logical_block, 4096,
        "O_DIRECT exports advertise 4K logical blocks"
    );
    let data = random_bytes(3 << 20, 5);
    s.queues[0].write_at(&data, 1 << 20, true).unwrap();
    let mut back = vec![0u8; data.len()];
    s.queues[1].read_at(&mut back, 1 << 20).unwrap();
    assert!(back == data);
    s.queues[0].write_zeroes(1 << 20, 4096, false).unwrap();
    s.queues[1].read_at(&mut back[..4096], 1 << 20).unwrap();
    assert!(back[..4096].iter().all(|b| *b == 0));
}

#[test]
fn sigterm_under_load_keeps_every_acknowledged_write() {
    let d = TempDir::new("shutdown");
    let img = d.path("disk.img");
    sparse_file(&img, 64 << 20);
    let mut t = Target::start(&[&format!("f=file:{}", img.display())]);
    let mut s = session(&t.url("f"), 1, 64 << 10);
    let q = &mut s.queues[0];
    let block = 64usize << 10;
    let nblocks = (64 << 20) / block as u64;
    let pattern = |i: u64| random_bytes(block, 1000 + i);
    let patterns: Vec<Vec<u8>> = (0..nblocks).map(pattern).collect();
    let mut acked = Vec::new();
    let mut next = 0u64;
    let mut signalled = false;
    let outcome = loop {
        while next < nblocks && q.in_flight() < q.depth() {
            let cmd = Cmd::Write {
                offset: next * block as u64,
                data: &patterns[next as usize],
                fua: false,
            };
            q.submit(cmd, next).unwrap();
            next += 1;
        }
        if q.in_flight() == 0 {
            break Ok(());
        }
        let r = q.complete(1, |c| {
            assert_eq!(c.status, Status::Ok);
            acked.push(c.user);
        });
        if let Err(e) = r {
            break Err(e);
        }
        if !signalled && acked.len() >= 64 {
            // SAFETY: signalling our own child.
            assert_eq!(unsafe { libc::kill(t.pid(), libc::SIGTERM) }, 0);
            signalled = true;
        }
    };
    assert!(
        signalled,
        "the copy finished before the signal; make the export larger"
    );
    let status = t.child.wait().unwrap();
    assert!(
        status.success(),
        "target exit after SIGTERM under load: {status:?}"
    );
    assert!(
        matches!(outcome, Ok(()) | Err(Error::Closed)),
        "client saw {outcome:?}"
    );
    let file = std::fs::read(&img).unwrap();
    for &i in &acked {
        let at = i as usize * block;
        assert!(
            file[at..at + block] == patterns[i as usize][..],
            "acknowledged block {i} lost"
        );
    }
}

/// Both native transports of one target serving `exports`: its `tcp://` and `udp://` URLs.
fn tcp_and_udp(exports: &[&str]) -> (common::netlab::Served, [String; 2]) {
    let t =
        common::netlab::Served::start(None, &["tcp://127.0.0.1:0", "udp://127.0.0.1:0"], exports);
    let urls = [t.url("tcp://"), t.url("udp://")];
    (t, urls)
}

fn one_queue(
    url: &str,
    replaces: Option<blkwire_client::QueueRef>,
    timeout: Duration,
) -> Result<Session, Error> {
    let opts = ConnectOptions {
        depth: 4,
        max_io: 64 << 10,
        timeout,
        replaces,
        ..Default::default()
    };
    connect(&Url::parse(url).unwrap(), &opts)
}

/// A reconnection names the queue it takes over (PROTOCOL.md §2.6): the target closes that
/// queue, so the old connection's I/O fails from then on, and the new session sees its data.
#[test]
fn a_session_replacing_a_queue_closes_it() {
    let (_t, urls) = tcp_and_udp(&["m=mem:1M"]);
    for base in urls {
        let url = format!("{base}/m");
        let mut old = one_queue(&url, None, Duration::from_secs(10)).unwrap();
        let data = random_bytes(4096, 7);
        old.queues[0].write_at(&data, 0, false).unwrap();
        let me = old.queues[0]
            .identity()
            .expect("a native queue knows its session");
        let mut new = one_queue(&url, Some(me), Duration::from_secs(10)).unwrap();
        assert_ne!(new.info.session, old.info.session);
        let mut back = vec![0u8; 4096];
        new.queues[0].read_at(&mut back, 0).unwrap();
        assert!(
            back == data,
            "{url}: the new session reads what the old one wrote"
        );
        let got = old.queues[0].write_at(&data, 4096, false);
        assert!(
            got.is_err(),
            "{url}: the replaced queue still serves: {got:?}"
        );
    }
}

/// The target's sessions, from its STATS document.
fn sessions(stats_url: &str) -> Vec<serde_json::Value> {
    let doc =
        blkwire_client::stats(&Url::parse(stats_url).unwrap(), &ConnectOptions::default()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
    v["sessions"].as_array().unwrap().clone()
}

/// Requests the target's backend is running for `session`.
fn running(stats_url: &str, session: u32) -> u64 {
    sessions(stats_url)
        .iter()
        .filter(|s| s["session"] == session)
        .flat_map(|s| s["queues"].as_array().unwrap().iter())
        .map(|q| q["in_flight"].as_u64().unwrap())
        .sum()
}

/// Whether the target lists `session`.
fn listed(stats_url: &str, session: u32) -> bool {
    sessions(stats_url).iter().any(|s| s["session"] == session)
}

/// A one-queue session on `url` whose 4 KiB write at 0 (returned) is stuck in the backend: `fs`
/// is frozen (until the returned guard drops) and the target counts the write as running.
fn stuck_write(url: &str, stats_url: &str, fs: &LoopExt4, seed: u64) -> (Session, Vec<u8>, Frozen) {
    let mut old = one_queue(url, None, Duration::from_secs(60)).unwrap();
    let session = old.queues[0].identity().unwrap().session;
    let data = random_bytes(4096, seed);
    let frozen = fs.freeze();
    let write = Cmd::Write {
        offset: 0,
        data: &data,
        fua: false,
    };
    old.queues[0].submit(write, 1).unwrap();
    old.queues[0].send().unwrap();
    assert!(
        common::wait_until(Duration::from_secs(30), || running(stats_url, session) == 1),
        "{url}: the write never reached the backend"
    );
    (old, data, frozen)
}

/// A filesystem that can be frozen (`fsfreeze`) holding a 1 MiB file, a target exporting the
/// file as `f` over tcp:// and udp:// (their base URLs), and the URL its STATS are asked at.
/// Dropped in that order's reverse, the target goes before the filesystem.
fn frozen_fs_target() -> (LoopExt4, common::netlab::Served, [String; 2], String) {
    let fs = LoopExt4::new();
    let file = fs.mnt().join("disk");
    sparse_file(&file, 1 << 20);
    let export = format!("f=file:{}", file.display());
    let (t, urls) = tcp_and_udp(&[&export]);
    let stats_url = t.url("tcp://");
    (fs, t, urls, stats_url)
}

/// `new` (a session begun after a fence) reads `first`, the fenced session's write, at 0, and
/// then its own write there, not overtaken by the old one; the block is zeroed again after.
fn sees_then_overwrites(new: &mut Session, url: &str, first: &[u8], seed: u64) {
    let mut back = vec![0u8; 4096];
    new.queues[0].read_at(&mut back, 0).unwrap();
    assert!(
        back == first,
        "{url}: the fenced session's write did not land before the new session began"
    );
    let second = random_bytes(4096, seed);
    new.queues[0].write_at(&second, 0, false).unwrap();
    new.queues[0].read_at(&mut back, 0).unwrap();
    assert!(back == second, "{url}");
    new.queues[0].write_at(&vec![0; 4096], 0, false).unwrap();
}

/// The fencing a reconnection relies on (PROTOCOL.md §2.6): while a write of the replaced
/// queue still runs on the target (here: stuck on a frozen filesystem), the new session is not
/// let in (BUSY), so nothing it sends can be overtaken by that write; once the write has
/// landed, it is.
#[test]
fn a_session_replacing_a_queue_waits_for_its_writes_to_land() {
    let (fs, _target, urls, stats_url) = frozen_fs_target();
    for base in urls {
        let url = format!("{base}/f");
        let (old, first, frozen) = stuck_write(&url, &stats_url, &fs, 1);
        let me = old.queues[0].identity().unwrap();
        let busy = one_queue(&url, Some(me), Duration::from_secs(3));
        assert!(
            matches!(
                busy,
                Err(Error::Status {
                    status: Status::Busy,
                    ..
                })
            ),
            "{url}: let in while the replaced queue's write still runs: {:?}",
            busy.map(|s| s.info.session)
        );
        drop(frozen);
        let mut new = one_queue(&url, Some(me), Duration::from_secs(30)).unwrap();
        sees_then_overwrites(&mut new, &url, &first, 2);
    }
}

/// `map --recover` after the map daemon was killed (PROTOCOL.md §2.6): the new daemon knows the
/// dead one's queues only from its record and fences them (`blkwire_map::fence_recorded`)
/// before it sends anything. While a write of the dead daemon still runs on the target (stuck
/// on a frozen filesystem), the fence is not granted; once the write has landed it is, the dead
/// session is gone at once (over UDP it would otherwise linger until its idle timeout), and the
/// new daemon's session sees the old write and is not overtaken by it.
#[test]
fn recovery_fences_a_dead_daemons_queues_until_their_writes_land() {
    let (fs, _target, urls, stats_url) = frozen_fs_target();
    for base in urls {
        let url = format!("{base}/f");
        let u = Url::parse(&url).unwrap();
        // The dead daemon's session, as its record names it; nothing logs it out.
        let (dead, first, frozen) = stuck_write(&url, &stats_url, &fs, 3);
        let recorded = blkwire_map::RecordedQueue::from(dead.queues[0].identity().unwrap());
        let mut opts = ConnectOptions {
            depth: 4,
            max_io: 64 << 10,
            timeout: Duration::from_secs(2),
            ..Default::default()
        };
        let t0 = Instant::now();
        let e = blkwire_map::fence_recorded(&u, &opts, &[recorded.into()])
            .expect_err("fenced while the dead daemon's write still runs");
        assert!(e.contains("still has requests running"), "{url}: {e}");
        // It asked again until about its timeout (less its last pause).
        assert!(
            t0.elapsed() >= Duration::from_millis(1500),
            "{url}: gave up after {:?}",
            t0.elapsed()
        );
        assert!(listed(&stats_url, recorded.session));
        drop(frozen);
        opts.timeout = Duration::from_secs(30);
        blkwire_map::fence_recorded(&u, &opts, &[recorded.into()]).unwrap();
        assert!(
            !listed(&stats_url, recorded.session),
            "{url}: the dead daemon's session outlived the fence"
        );
        // Fencing a queue the target does not know (any more, or since a restart) is granted.
        blkwire_map::fence_recorded(&u, &opts, &[recorded.into()]).unwrap();
        let mut new = one_queue(&url, None, Duration::from_secs(30)).unwrap();
        sees_then_overwrites(&mut new, &url, &first, 4);
    }
}
