//! The `rbd:` backend (issue 18) against a real single-node Ceph cluster that
//! `scripts/ceph-cluster.sh` brings up under a temporary directory (one monitor, one OSD,
//! pool `rbd` of size 1, loopback only). The tests share one cluster, started by the first
//! test that needs it and stopped when the test process exits; the test that kills a cluster
//! starts its own, stopped by a drop guard. Missing Ceph packages or a blkwire built without
//! librbd fail the tests with the reason, never skip them. Every external tool call is bounded
//! by coreutils' `timeout`, so a hung target fails a test instead of hanging CI.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use blkwire_client::{connect, ConnectOptions, Session, Url};
use blkwire_wire::Status;
use common::{random_bytes, Target, TempDir, BIN};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Seconds any external tool may run before `timeout` kills it.
const TOOL_LIMIT: &str = "180";

// ---------------------------------------------------------------------------------------------
// The cluster

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// A cluster under its own directory; stopped (daemons killed, directory removed) on drop.
struct Cluster {
    dir: PathBuf,
    conf: String,
}

impl Cluster {
    /// Starts one, or fails the test with the script's reason (e.g. missing packages).
    fn start(tag: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!("blkwire-ceph-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new("timeout")
            .args(["-k", "5", "150"])
            .arg(script())
            .arg("start")
            .arg(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/ceph-cluster.sh");
        assert!(
            out.status.success(),
            "the test cluster did not start ({}): {}\n(the rbd tests need ceph-mon, ceph-osd, \
             ceph-common and librbd-dev: scripts/deps.sh installs them)",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let conf = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(Path::new(&conf).is_file(), "start printed {conf:?}");
        Cluster { dir, conf }
    }

    /// `rbd:rbd/IMAGE?conf=...` with extra `&key=value` options.
    fn spec(&self, image: &str, extra: &str) -> String {
        format!("rbd:rbd/{image}?conf={}{extra}", self.conf)
    }

    /// Runs a Ceph CLI tool against this cluster; returns its output whatever the status.
    fn tool(&self, prog: &str, args: &[&str]) -> Output {
        Command::new("timeout")
            .args(["-k", "5", TOOL_LIMIT, prog, "-c", &self.conf])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
    }

    /// A Ceph CLI call that must succeed; its stdout.
    fn ok(&self, prog: &str, args: &[&str]) -> Vec<u8> {
        let out = self.tool(prog, args);
        assert!(out.status.success(), "{}", describe(prog, args, &out));
        out.stdout
    }

    /// A new image of `size` bytes with a name no other test uses.
    fn image(&self, tag: &str, size: u64) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("{tag}-{}", N.fetch_add(1, Ordering::Relaxed));
        self.ok(
            "rbd",
            &[
                "create",
                "--size",
                &format!("{}M", size / MIB),
                &format!("rbd/{name}"),
            ],
        );
        name
    }

    /// The image's bytes as `rbd export` reads them (librbd directly, not through blkwire).
    fn export(&self, image: &str) -> Vec<u8> {
        self.ok(
            "rbd",
            &["export", "--no-progress", &format!("rbd/{image}"), "-"],
        )
    }

    /// The daemons' pids, from their pid files.
    fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for e in std::fs::read_dir(self.dir.join("run"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if e.path().extension().is_some_and(|x| x == "pid") {
                if let Ok(p) = std::fs::read_to_string(e.path()) {
                    pids.extend(p.trim().parse::<i32>().ok());
                }
            }
        }
        pids
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        stop_cluster(&self.dir);
    }
}

fn stop_cluster(dir: &Path) {
    let _ = Command::new("timeout")
        .args(["-k", "5", "60"])
        .arg(script())
        .arg("stop")
        .arg(dir)
        .stdin(Stdio::null())
        .status();
}

/// The cluster every test but the one that kills its cluster uses.
fn shared() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    extern "C" fn stop_shared() {
        if let Some(d) = DIR.get() {
            stop_cluster(d);
        }
    }
    SHARED.get_or_init(|| {
        let c = Cluster::start("shared");
        let _ = DIR.set(c.dir.clone());
        // Statics are never dropped: stop the daemons when the test process exits, which it
        // does through exit() whether tests passed or failed.
        // SAFETY: registers a function that only reads a set-once static and runs a command.
        unsafe { libc::atexit(stop_shared) };
        c
    })
}

// ---------------------------------------------------------------------------------------------
// Tools

fn describe(prog: &str, args: &[&str], out: &Output) -> String {
    format!(
        "{prog} {}: {}{}\n--- stdout\n{}--- stderr\n{}",
        args.join(" "),
        out.status,
        if out.status.code() == Some(124) {
            " (killed by timeout: the tool hung)"
        } else {
            ""
        },
        String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(4096)]),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn tool(prog: &str, args: &[&str]) -> String {
    let out = Command::new("timeout")
        .args(["-k", "5", TOOL_LIMIT, prog])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog} (scripts/deps.sh installs it): {e}"));
    assert!(out.status.success(), "{}", describe(prog, args, &out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn session(url: &str, queues: u16) -> Session {
    let opts = ConnectOptions {
        queues,
        depth: 16,
        max_io: 1 << 20,
        ..Default::default()
    };
    connect(&Url::parse(url).unwrap(), &opts).expect("connect")
}

/// A target serving `exports` on a native and an NBD listener; `nbd` is `nbd://HOST:PORT`.
fn target(exports: &[&str]) -> (Target, String) {
    let (t, urls) = Target::start_listeners(exports, &["--listen", "nbd://127.0.0.1:0"]);
    let nbd = urls
        .iter()
        .find(|u| u.starts_with("nbd://"))
        .expect("nbd listener")
        .clone();
    (t, nbd)
}

// ---------------------------------------------------------------------------------------------
// Data round trips

/// Random data at sizes from 512 B to 3.5 MiB (split above max I/O) on three queues, read back
/// on the queue that wrote it and across queues; zeroing; then `blkwire cp` out, compared with
/// what `rbd export` reads.
#[test]
fn native_round_trips_and_cp() {
    let c = shared();
    let img = c.image("native", 64 * MIB);
    let (t, _) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let url = t.url("r");
    let mut s = session(&url, 3);
    assert_eq!(s.info.size, 64 * MIB, "the image's size is the export's");
    common::round_trip_every_queue(&mut s);
    let data = random_bytes(8192, 999);
    s.queues[0].write_at(&data, 0, true).unwrap(); // FUA: emulated as write then flush
    let mut back = vec![0u8; 8192];
    s.queues[2].read_at(&mut back, 0).unwrap();
    assert!(back == data, "cross-queue visibility");

    // WRITE_ZEROES (both kinds) and TRIM are librbd's own.
    let q = &mut s.queues[1];
    q.write_at(&random_bytes(MIB as usize, 5), 32 * MIB, false)
        .unwrap();
    q.write_zeroes(32 * MIB + 4096, 65536, false).unwrap();
    q.write_zeroes(32 * MIB + 200_000, 4096, true).unwrap();
    q.flush().unwrap();
    let mut back = vec![1u8; MIB as usize];
    q.read_at(&mut back, 32 * MIB).unwrap();
    let want = random_bytes(MIB as usize, 5);
    assert_eq!(back[..4096], want[..4096]);
    assert!(back[4096..4096 + 65536].iter().all(|b| *b == 0), "zeroed");
    assert!(
        back[200_000..204_096].iter().all(|b| *b == 0),
        "zeroed (no hole)"
    );
    assert_eq!(back[204_096..], want[204_096..]);
    drop(s);

    // cp out, then compare with what librbd itself reads.
    let d = TempDir::new("rbd-cp");
    let file = d.path("out.img");
    let (ok, _, err) = common::cli(&["cp", "--no-progress", &url, file.to_str().unwrap()]);
    assert!(ok, "cp out: {err}");
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(bytes.len() as u64, 64 * MIB);
    assert!(bytes == c.export(&img), "cp's copy equals rbd export's");
}

/// Writers on four sessions at once, each on a region of its own, all verified afterwards
/// through `rbd export` (librbd itself, not blkwire).
#[test]
fn concurrent_writers_land_where_they_wrote() {
    let c = shared();
    let img = c.image("writers", 32 * MIB);
    let (t, _) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let url = t.url("r");
    let threads: Vec<_> = (0..4u64)
        .map(|w| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut s = session(&url, 2);
                for i in 0..16u64 {
                    let q = &mut s.queues[(i % 2) as usize];
                    let off = w * 8 * MIB + i * 512 * 1024;
                    q.write_at(&random_bytes(512 * 1024, w * 1000 + i), off, false)
                        .unwrap();
                }
                s.queues[0].flush().unwrap();
            })
        })
        .collect();
    for th in threads {
        th.join().expect("writer");
    }
    let bytes = c.export(&img);
    for w in 0..4u64 {
        for i in 0..16u64 {
            let off = (w * 8 * MIB + i * 512 * 1024) as usize;
            assert!(
                bytes[off..off + 512 * 1024] == random_bytes(512 * 1024, w * 1000 + i)[..],
                "writer {w} piece {i}"
            );
        }
    }
}

/// NBD clients: nbdcopy in and out keeps the bytes; nbdinfo's map shows holes where the image
/// has no data (the allocation map from `rbd_diff_iterate2`); qemu-io zeroes and discards.
#[test]
fn nbd_round_trip_and_allocation_map() {
    let c = shared();
    let img = c.image("nbd", 64 * MIB);
    let (_t, nbd) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let uri = format!("{nbd}/r");
    let info: Value = serde_json::from_str(&tool("nbdinfo", &["--json", &uri])).unwrap();
    let e = &info["exports"][0];
    assert_eq!(e["export-size"], 64 * MIB, "{info}");
    for cap in ["can_flush", "can_fua", "can_trim", "can_zero"] {
        assert_eq!(e[cap], true, "{cap}: {info}");
    }

    let d = TempDir::new("rbd-nbd");
    let (src, back) = (d.path("src.img"), d.path("back.img"));
    // 8 MiB of data at 16 MiB, the rest holes.
    let mut bytes = vec![0u8; 64 * MIB as usize];
    bytes[16 * MIB as usize..24 * MIB as usize].copy_from_slice(&random_bytes(8 * MIB as usize, 3));
    std::fs::write(&src, &bytes).unwrap();
    tool("nbdcopy", &[src.to_str().unwrap(), &uri]);
    tool("nbdcopy", &[&uri, back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == bytes, "nbdcopy round trip");
    assert!(c.export(&img) == bytes, "rbd export sees what NBD wrote");

    // base:allocation: data where written, holes elsewhere. nbdcopy skips zeros, so only the
    // data range should be allocated.
    let map: Value = serde_json::from_str(&tool("nbdinfo", &["--map", "--json", &uri])).unwrap();
    let at = |off: u64| {
        map.as_array()
            .unwrap()
            .iter()
            .find(|e| {
                let o = e["offset"].as_u64().unwrap();
                o <= off && off < o + e["length"].as_u64().unwrap()
            })
            .map(|e| e["type"].as_u64().unwrap())
            .unwrap_or_else(|| panic!("{off} not in the map {map}"))
    };
    assert_eq!(at(20 * MIB) & 1, 0, "data is not a hole: {map}");
    assert_eq!(at(40 * MIB) & 1, 1, "never written: a hole: {map}");

    // Zeroing and discard through qemu-io.
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri,
            "-c",
            "write -z 16M 1M",
            "-c",
            "discard 17M 1M",
            "-c",
            "flush",
        ],
    );
    let now = c.export(&img);
    // Zeroed reads as zeros; a discarded range may read as anything (librbd skips partial-object
    // discards by default, and TRIM promises nothing), so only its neighbours are checked.
    assert!(
        now[16 * MIB as usize..17 * MIB as usize]
            .iter()
            .all(|b| *b == 0),
        "zeroed"
    );
    assert_eq!(
        now[18 * MIB as usize..24 * MIB as usize],
        bytes[18 * MIB as usize..24 * MIB as usize]
    );
}

/// One NBD BLOCK_STATUS query over almost 4 GiB of a sparse image, through a raw NBD client:
/// the answer is a prefix of at most 64 MiB (`rbd_diff_iterate2` would otherwise ask the OSDs
/// about every object of the range, a thousand of them, on the export's one helper thread),
/// which starts with the data there is, and a query from where it ended goes on.
#[test]
fn an_allocation_query_over_a_long_sparse_range_answers_a_prefix() {
    use blkwire_wire::nbd::{self, chunk, cmd};
    use common::nbd_raw::{be32, Raw, Reply};
    let c = shared();
    let img = c.image("sparse", 8 << 30);
    let (t, nbd_url) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let mut s = session(&t.url("r"), 1);
    s.queues[0]
        .write_at(&random_bytes(4096, 81), 0, false)
        .unwrap();
    s.queues[0].flush().unwrap();
    let addr = nbd_url.trim_start_matches("nbd://");
    let (mut r, size, _) = Raw::go(addr, "r", true, true);
    assert_eq!(size, 8 << 30);
    // (length, hole) of each descriptor the answer to BLOCK_STATUS at `offset` has.
    let mut query = |cookie: u64, offset: u64| -> Vec<(u64, bool)> {
        r.request(cmd::BLOCK_STATUS, 0, cookie, offset, 0xffff_f000);
        let reply = r.reply();
        let Reply::Structured(chunks) = reply else {
            panic!("BLOCK_STATUS needs a structured reply: {reply:?}")
        };
        let c = chunks
            .iter()
            .find(|c| c.typ == chunk::BLOCK_STATUS)
            .unwrap_or_else(|| panic!("no BLOCK_STATUS chunk: {chunks:?}"));
        assert_eq!(be32(&c.payload), nbd::BASE_ALLOCATION_ID);
        c.payload[4..]
            .chunks(8)
            .map(|d| (be32(d) as u64, be32(&d[4..]) & 1 == 1))
            .collect()
    };
    let map = query(1, 0);
    let covered: u64 = map.iter().map(|e| e.0).sum();
    assert!(
        covered > 0 && covered <= 64 * MIB,
        "a prefix of at most 64 MiB, got {covered} bytes: {map:?}"
    );
    assert_eq!(map[0], (4096, false), "the data written: {map:?}");
    assert!(map[1..].iter().all(|e| e.1), "holes after it: {map:?}");
    let next = query(2, covered);
    assert!(
        !next.is_empty() && next.iter().all(|e| e.1),
        "on from there: holes: {next:?}"
    );
}

/// A private run directory for `map` (its records and FUSE mounts).
struct MapRun(TempDir);

impl MapRun {
    fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(BIN)
            .args(args)
            .env("BLKWIRE_RUN_DIR", &self.0 .0)
            .stdin(Stdio::null())
            .output()
            .expect("run blkwire");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// Unmaps a device when dropped (also when the test fails midway).
struct Unmap<'a>(&'a MapRun, String);

impl Drop for Unmap<'_> {
    fn drop(&mut self) {
        let _ = self.0.cli(&["unmap", &self.1]);
    }
}

/// The export mapped as a block device (FUSE file + loop device): bytes written to the
/// device land in the image.
#[test]
fn map_fuse_round_trip() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "map needs root (loop devices, FUSE mounts)");
    let c = shared();
    let img = c.image("map", 32 * MIB);
    let (t, _) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let run = MapRun(TempDir::new("rbd-map"));
    let (ok, out, err) = run.cli(&[
        "map",
        &t.url("r"),
        "--frontend",
        "fuse",
        "--fuse-io",
        "read",
    ]);
    assert!(ok, "map: {err}");
    let dev = out.trim().to_string();
    assert!(
        dev.starts_with("/dev/loop"),
        "map prints the device: {out:?}"
    );
    let guard = Unmap(&run, dev.clone());
    let d = TempDir::new("rbd-map-data");
    let src = d.path("src");
    let data = random_bytes(4 * MIB as usize, 77);
    std::fs::write(&src, &data).unwrap();
    tool(
        "dd",
        &[
            &format!("if={}", src.display()),
            &format!("of={dev}"),
            "bs=1M",
            "seek=2",
            "oflag=direct",
            "conv=fsync",
            "status=none",
        ],
    );
    let back = d.path("back");
    tool(
        "dd",
        &[
            &format!("if={dev}"),
            &format!("of={}", back.display()),
            "bs=1M",
            "skip=2",
            "count=4",
            "iflag=direct",
            "status=none",
        ],
    );
    assert!(
        std::fs::read(&back).unwrap() == data,
        "read back through the device"
    );
    let (ok, _, err) = run.cli(&["unmap", &dev]);
    assert!(ok, "unmap: {err}");
    drop(guard);
    assert!(
        c.export(&img)[2 * MIB as usize..6 * MIB as usize] == data[..],
        "in the image"
    );
}

// ---------------------------------------------------------------------------------------------
// Durability, resize, errors

/// Written, flushed, then the target killed with SIGKILL: the image holds the data.
#[test]
fn flushed_writes_survive_kill_9_of_the_target() {
    let c = shared();
    let img = c.image("flush", 16 * MIB);
    let mut t = Target::start(&[&format!("r={}", c.spec(&img, ""))]);
    let data = random_bytes(4 * MIB as usize, 42);
    {
        let mut s = session(&t.url("r"), 1);
        s.queues[0].write_at(&data, 3 * MIB, false).unwrap();
        s.queues[0].flush().unwrap();
        t.child.kill().unwrap(); // SIGKILL, with the session still open
        let _ = t.child.wait();
    }
    let bytes = c.export(&img);
    assert!(
        bytes[3 * MIB as usize..7 * MIB as usize] == data[..],
        "flushed data is in the image"
    );
}

/// The clients that watch an image (`rbd status`): an open image has one, its opener's.
fn watchers(c: &Cluster, img: &str) -> Vec<Value> {
    let status: Value = serde_json::from_slice(&c.ok(
        "rbd",
        &["status", "--format", "json", &format!("rbd/{img}")],
    ))
    .unwrap();
    status["watchers"]
        .as_array()
        .unwrap_or_else(|| panic!("rbd status: {status}"))
        .clone()
}

/// With librbd's cache in writeback (the config's `rbd cache policy`, dirty data kept for a
/// minute), writes are acknowledged from the cache. A target that stops gracefully (SIGTERM)
/// flushes and closes its images before it exits: the unflushed writes are in the image and
/// nobody watches it any more (a target that just exits leaves its watch for the cluster to
/// time out, ~30 s, and the writes in its cache). `export remove` does the same for its image
/// before it answers.
#[test]
fn a_graceful_stop_flushes_and_closes_the_image() {
    let c = shared();
    let d = TempDir::new("rbd-stop");
    let conf = d.path("writeback.conf");
    let mut text = std::fs::read_to_string(&c.conf).unwrap();
    text.push_str("[client]\nrbd cache policy = writeback\nrbd cache max dirty age = 60\n");
    std::fs::write(&conf, text).unwrap();
    let spec = |img: &str| format!("rbd:rbd/{img}?conf={}", conf.display());
    let (kept, removed) = (c.image("stop", 16 * MIB), c.image("remove", 16 * MIB));
    let sock = d.path("ctl.sock");
    let mut t = Target::start_with_control(
        &[
            &format!("k={}", spec(&kept)),
            &format!("r={}", spec(&removed)),
        ],
        &sock,
    );
    let data = random_bytes(4 * MIB as usize, 71);
    for name in ["k", "r"] {
        let mut s = session(&t.url(name), 1);
        s.queues[0].write_at(&data, 2 * MIB, false).unwrap(); // no flush
    }
    assert_eq!(watchers(c, &kept).len(), 1, "the target watches its image");

    // Once the sessions are gone (their queues close on the target's threads), the removal
    // drops the export's last reference. The watch lasts ~30 s after its client goes without
    // closing, so 10 s tell a close from a timeout.
    let sock = sock.to_str().unwrap();
    let rpc = |args: &[&str]| {
        let (ok, out, err) = common::cli(args);
        assert!(ok, "{args:?}: {out} {err}");
        out
    };
    assert!(
        common::wait_until(Duration::from_secs(10), || {
            rpc(&["rpc", "session_list", "{}", "--socket", sock]).trim() == "[]"
        }),
        "the sessions did not end"
    );
    rpc(&["export", "rm", "r", "--socket", sock]);
    assert!(
        common::wait_until(Duration::from_secs(10), || watchers(c, &removed).is_empty()),
        "still watched 10 s after its removal: {:?}",
        watchers(c, &removed)
    );
    assert!(
        c.export(&removed)[2 * MIB as usize..6 * MIB as usize] == data[..],
        "flushed on removal"
    );

    // SAFETY: kill(2) on the target this test started.
    unsafe { libc::kill(t.pid(), libc::SIGTERM) };
    let mut status = None;
    assert!(
        common::wait_until(Duration::from_secs(60), || {
            status = t.child.try_wait().unwrap();
            status.is_some()
        }),
        "the target did not stop within 60 s of SIGTERM"
    );
    assert!(status.unwrap().success(), "serve exits 0: {status:?}");
    assert_eq!(
        watchers(c, &kept),
        Vec::<Value>::new(),
        "closed before the target exited"
    );
    assert!(
        c.export(&kept)[2 * MIB as usize..6 * MIB as usize] == data[..],
        "the writes acknowledged from librbd's cache are in the image"
    );
}

/// `export resize` grows the image itself, and new sessions see the new size.
#[test]
fn resize_grows_the_image_and_new_sessions_see_it() {
    let c = shared();
    let img = c.image("resize", 16 * MIB);
    let d = TempDir::new("rbd-resize");
    let sock = d.path("ctl.sock");
    let t = Target::start_with_control(&[&format!("r={}", c.spec(&img, ""))], &sock);
    let base = t.base.clone();
    let url = format!("{base}/r");
    let (ok, out, err) = common::cli(&[
        "export",
        "resize",
        "r",
        "48M",
        "--socket",
        sock.to_str().unwrap(),
    ]);
    assert!(ok, "export resize: {out} {err}");
    let info: Value =
        serde_json::from_slice(&c.ok("rbd", &["info", "--format", "json", &format!("rbd/{img}")]))
            .unwrap();
    assert_eq!(info["size"], 48 * MIB, "the image grew: {info}");
    let mut s = session(&url, 1);
    assert_eq!(s.info.size, 48 * MIB);
    let data = random_bytes(MIB as usize, 9);
    s.queues[0].write_at(&data, 47 * MIB, false).unwrap();
    let mut back = vec![0u8; MIB as usize];
    s.queues[0].read_at(&mut back, 47 * MIB).unwrap();
    assert!(back == data, "the new end takes I/O");
}

/// The image's size as `rbd info` says.
fn image_size(c: &Cluster, img: &str) -> u64 {
    let info: Value =
        serde_json::from_slice(&c.ok("rbd", &["info", "--format", "json", &format!("rbd/{img}")]))
            .unwrap();
    info["size"]
        .as_u64()
        .unwrap_or_else(|| panic!("rbd info: {info}"))
}

/// The image grown behind the target (`rbd resize` by another client) past the size the export
/// knows: `export resize` to a size between the two is refused with one line, and what another
/// client wrote past it is still there (a resize checked against the export's size only cut
/// it); a size past the image's grows it.
#[test]
fn resize_never_shrinks_an_image_grown_behind_the_target() {
    let c = shared();
    let img = c.image("grown", 16 * MIB);
    let d = TempDir::new("rbd-grown");
    let sock = d.path("ctl.sock");
    let t = Target::start_with_control(&[&format!("r={}", c.spec(&img, ""))], &sock);
    let sock = sock.to_str().unwrap();
    c.ok(
        "rbd",
        &[
            "resize",
            "--no-progress",
            "--size",
            "64M",
            &format!("rbd/{img}"),
        ],
    );
    // Another client's data at 40 MiB: qemu's own librbd driver, straight to the image.
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            &format!("rbd:rbd/{img}:conf={}", c.conf),
            "-c",
            "write -P 0x5a 40M 1M",
        ],
    );

    let (ok, out, err) = common::cli(&["export", "resize", "r", "32M", "--socket", sock]);
    assert!(!ok, "a resize below the image's size was done: {out}");
    let lines: Vec<_> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one error line: {err}");
    assert!(
        lines[0].contains("grown behind the export"),
        "says why: {err}"
    );
    assert_eq!(image_size(c, &img), 64 * MIB, "the image was not shrunk");
    assert!(
        c.export(&img)[40 * MIB as usize..41 * MIB as usize]
            .iter()
            .all(|b| *b == 0x5a),
        "the other client's data is intact"
    );
    assert_eq!(
        session(&t.url("r"), 1).info.size,
        16 * MIB,
        "the export kept its size"
    );

    let (ok, out, err) = common::cli(&["export", "resize", "r", "80M", "--socket", sock]);
    assert!(ok, "export resize past the image's size: {out} {err}");
    assert_eq!(image_size(c, &img), 80 * MIB);
    assert_eq!(session(&t.url("r"), 1).info.size, 80 * MIB);
}

/// The status a request failed with; panics on success or a failure of another kind.
fn failed_status<T: std::fmt::Debug>(r: blkwire_client::Result<T>, what: &str) -> Status {
    match r {
        Err(blkwire_client::Error::Status { status, .. }) => status,
        other => panic!("{what}: expected an error status, got {other:?}"),
    }
}

/// The image shrunk behind the target (`rbd resize --allow-shrink`) while a session has the old
/// size: librbd clips a READ or WRITE that crosses the new end (and refuses one past it), and
/// each must fail with an I/O error, not succeed with the rest of a (pooled, reused) buffer
/// sent as data or the rest of a write dropped; what is still inside the image is served.
#[test]
fn io_across_an_end_shrunk_behind_the_target_fails() {
    let c = shared();
    let img = c.image("shrunk", 16 * MIB);
    let (t, _) = target(&[&format!("r={}", c.spec(&img, ""))]);
    let mut s = session(&t.url("r"), 1);
    let q = &mut s.queues[0];
    let data = random_bytes(16 * MIB as usize, 61);
    q.write_at(&data, 0, false).unwrap();
    q.flush().unwrap();
    // The buffer pool now holds image bytes from everywhere: a leak shows as data.
    let mut back = vec![0u8; 16 * MIB as usize];
    q.read_at(&mut back, 0).unwrap();
    assert!(back == data);

    let end = 12 * MIB + 512 * 1024;
    c.ok(
        "rbd",
        &[
            "resize",
            "--allow-shrink",
            "--no-progress",
            "--size",
            &format!("{}K", end / 1024),
            &format!("rbd/{img}"),
        ],
    );
    // blkwire holds the image's exclusive lock (it wrote), so `rbd resize` had it run the
    // shrink itself and returned after: its librbd knows the new end already.
    let mut across = vec![0u8; MIB as usize];
    let st = failed_status(q.read_at(&mut across, 12 * MIB), "READ across the new end");
    assert_eq!(st, Status::Io, "READ across the new end");
    let st = failed_status(q.read_at(&mut across, 14 * MIB), "READ past the new end");
    assert_eq!(st, Status::Io, "READ past the new end (librbd: EINVAL)");
    let st = failed_status(
        q.write_at(&random_bytes(MIB as usize, 62), 12 * MIB, false),
        "WRITE across the new end",
    );
    assert_eq!(st, Status::Io, "WRITE across the new end");
    let st = failed_status(
        q.write_zeroes(12 * MIB, MIB, false),
        "WRITE_ZEROES across the new end",
    );
    assert_eq!(st, Status::Io, "WRITE_ZEROES across the new end");

    // Inside the new end, I/O goes on.
    let mut inside = vec![0u8; 512 * 1024];
    q.read_at(&mut inside, 11 * MIB).unwrap();
    assert!(inside[..] == data[11 * MIB as usize..11 * MIB as usize + 512 * 1024]);
    q.write_at(&random_bytes(4096, 63), 11 * MIB, false)
        .unwrap();
    q.flush().unwrap();
    drop(s);
    let image = c.export(&img);
    assert_eq!(image.len() as u64, end, "the image is the shrunk size");
    assert!(image[11 * MIB as usize..11 * MIB as usize + 4096] == random_bytes(4096, 63)[..]);
}

/// `serve` refuses what it cannot open with one line and a non-zero exit: a missing image, a
/// missing pool, a cluster nobody answers for, a config that is not there.
#[test]
fn serve_refuses_missing_image_pool_and_cluster_with_one_line() {
    let c = shared();
    let d = TempDir::new("rbd-errors");
    // A monitor address nobody listens on: a port the kernel just gave out and took back.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = d.path("dead.conf");
    std::fs::write(
        &dead,
        format!(
            "[global]\nfsid = {}\nmon host = v2:127.0.0.1:{port}\nkeyring = {}\nms bind msgr1 = false\n",
            "00000000-0000-0000-0000-000000000001",
            c.dir.join("keyring").display()
        ),
    )
    .unwrap();
    let cases = [
        (
            c.spec("no-such-image", ""),
            "image 'no-such-image' does not exist in pool 'rbd'",
        ),
        (
            format!("rbd:nopool/x?conf={}", c.conf),
            "pool 'nopool' does not exist",
        ),
        (
            format!("rbd:rbd/x?conf={}&timeout=3", dead.display()),
            "cannot connect to the Ceph cluster",
        ),
        (
            format!("rbd:rbd/x?conf={}", d.path("missing.conf").display()),
            "cannot read Ceph config",
        ),
        ("rbd:just-a-name".to_string(), "expected rbd:POOL/IMAGE"),
    ];
    for (spec, needle) in cases {
        let start = Instant::now();
        let out = Command::new("timeout")
            .args([
                "-k",
                "5",
                "60",
                BIN,
                "serve",
                "--listen",
                "tcp://127.0.0.1:0",
            ])
            .args(["--export", &format!("x={spec}")])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && out.status.code() != Some(124),
            "{spec}: {}",
            out.status
        );
        let lines: Vec<_> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{spec}: one error line, got: {err}");
        assert!(
            lines[0].contains(needle),
            "{spec}: '{needle}' not in: {err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{spec}: took {:?}",
            start.elapsed()
        );
    }
}

/// The cluster dies under load: the client gets I/O errors within its timeout, not a hang,
/// and the target stays up.
#[test]
fn cluster_death_under_load_gives_io_errors_not_hangs() {
    let c = Cluster::start("dies");
    let img = c.image("dies", 64 * MIB);
    let mut t = Target::start(&[&format!("r={}", c.spec(&img, "&timeout=5"))]);
    let mut bench = Command::new(BIN)
        .args([
            "bench",
            &t.url("r"),
            "--rw",
            "randrw",
            "--runtime",
            "120",
            "--iodepth",
            "16",
            "--timeout",
            "30",
            "--json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The load runs (the target has served part of it) before the cluster dies, so requests
    // are in flight in librbd when it does.
    let loaded = common::wait_until(Duration::from_secs(60), || {
        let (ok, out, _) = common::cli(&["stats", &t.base, "--json"]);
        let v: Value = match serde_json::from_str(&out) {
            Ok(v) if ok => v,
            _ => return false,
        };
        let done: u64 = v["sessions"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["queues"].as_array().into_iter().flatten())
            .map(|q| q["reads"].as_u64().unwrap_or(0) + q["writes"].as_u64().unwrap_or(0))
            .sum();
        done >= 256
    });
    assert!(loaded, "the bench's load never reached the target");
    assert!(
        bench.try_wait().unwrap().is_none(),
        "bench ended before the cluster died"
    );
    for pid in c.pids() {
        // SAFETY: kill(2) on a daemon of the cluster this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let killed = Instant::now();
    let (tx, rx) = mpsc::channel();
    let stderr = bench.stderr.take().unwrap();
    std::thread::spawn(move || {
        let lines: Vec<String> = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect();
        let _ = tx.send(lines);
    });
    let status = loop {
        if let Some(s) = bench.try_wait().unwrap() {
            break Some(s);
        }
        if killed.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let waited = killed.elapsed();
    if status.is_none() {
        let _ = bench.kill();
        let _ = bench.wait();
    }
    let err = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_default()
        .join("\n");
    let status =
        status.unwrap_or_else(|| panic!("bench still running 60 s after the cluster died: {err}"));
    assert!(
        !status.success(),
        "bench must report the errors ({status}): {err}"
    );
    assert!(
        waited < Duration::from_secs(45),
        "errors came after {waited:?}: {err}"
    );
    assert!(
        t.child.try_wait().unwrap().is_none(),
        "the target survives its cluster"
    );

    // A graceful stop still ends: the final flush and close of the image are given two Ceph
    // timeouts (here 5 s each; rbd_close alone would take about seven on a dead cluster),
    // then left behind with a warning.
    let stopping = Instant::now();
    // SAFETY: kill(2) on the target this test started.
    unsafe { libc::kill(t.pid(), libc::SIGTERM) };
    let mut status = None;
    let stopped = common::wait_until(Duration::from_secs(40), || {
        status = t.child.try_wait().unwrap();
        status.is_some()
    });
    assert!(
        stopped,
        "the target still runs {:?} after SIGTERM",
        stopping.elapsed()
    );
    assert!(status.unwrap().success(), "serve exits 0: {status:?}");
    drop(c);
}
