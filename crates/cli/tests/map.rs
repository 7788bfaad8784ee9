//! Exports as local block devices (`map`, `unmap`, `ls`; fuse frontend), end to end: real
//! targets, loop devices, FUSE mounts, mkfs, mount, fsck and fio. They need root (CI runs them
//! as root) and skip, saying so, without it; the newer ones fail instead, saying why.
//!
//! Each test keeps its mapping records in its own BLKWIRE_RUN_DIR, so parallel tests never see
//! each other's mappings, and cleans up with Drop guards (unmount, unmap, detach, kill) also when
//! an assertion fails half-way.
//!
//! FUSE I/O paths: tests map with `--fuse-io read` unless they say otherwise, so they do not
//! depend on the kernel's system-wide FUSE-over-io_uring switch; the tests of the io_uring path
//! set that switch through `SwitchOn`/`SwitchOff`, which serialise its changes and put back the
//! value they found, also when a test fails.

mod common;

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use common::netlab::{NetLab, Served};
use common::{random_bytes, sha256, Target, TempDir, BIN};
use serde_json::Value;

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Fails the test, saying why, when not root: it never passes without having run.
macro_rules! require_root {
    () => {
        assert!(
            is_root(),
            "this test maps block devices (loop devices, FUSE mounts, ublk) and needs root; \
             run it as root (CI does)"
        );
    };
}

/// `unmap` by a user who is not root says so in one line, whatever kind of device it names;
/// it used to speak of mounting FUSE (a loop device) or fail on the record's permissions (ublk).
#[test]
fn unmap_without_root_says_it_needs_root() {
    for device in ["/dev/loop3", "/dev/ublkb0"] {
        let out = common::as_nobody(BIN)
            .args(["unmap", device])
            .output()
            .expect("run setpriv");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{device}: {err}");
        assert_eq!(err.lines().count(), 1, "{device}: {err}");
        assert!(
            err.contains(&format!("unmapping {device} needs root")),
            "{err}"
        );
    }
}

const URING_SWITCH: &str = "/sys/module/fuse/parameters/enable_uring";

/// Shared by the tests that need the switch on, exclusive for those that turn it off.
static SWITCH_LOCK: RwLock<()> = RwLock::new(());
/// Holders of `SwitchOn`, and the value the first one found.
static SWITCH_ON_USERS: Mutex<(usize, String)> = Mutex::new((0, String::new()));

fn read_switch() -> String {
    std::fs::read_to_string(URING_SWITCH)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Fails the test, saying why, when this kernel has no FUSE over io_uring (a test of it must
/// not pass without having run).
fn require_uring() {
    assert!(
        Path::new(URING_SWITCH).exists(),
        "this test needs FUSE over io_uring: a kernel of 6.14 or later with CONFIG_FUSE_IO_URING \
         ({URING_SWITCH} is missing)"
    );
}

/// FUSE over io_uring switched on while held; the last holder restores the previous value.
struct SwitchOn {
    _shared: RwLockReadGuard<'static, ()>,
}

impl SwitchOn {
    /// Fails the test when this kernel has no FUSE over io_uring.
    fn new() -> SwitchOn {
        require_uring();
        let shared = SWITCH_LOCK.read().unwrap_or_else(|e| e.into_inner());
        let mut u = SWITCH_ON_USERS.lock().unwrap_or_else(|e| e.into_inner());
        if u.0 == 0 {
            u.1 = read_switch();
            std::fs::write(URING_SWITCH, "Y").expect("turn on FUSE over io_uring");
        }
        u.0 += 1;
        SwitchOn { _shared: shared }
    }
}

impl Drop for SwitchOn {
    fn drop(&mut self) {
        let mut u = SWITCH_ON_USERS.lock().unwrap_or_else(|e| e.into_inner());
        u.0 -= 1;
        if u.0 == 0 {
            let _ = std::fs::write(URING_SWITCH, &u.1);
        }
    }
}

/// The switch off, with no other switch user running; the previous value is put back on drop.
struct SwitchOff {
    _excl: RwLockWriteGuard<'static, ()>,
    was: String,
}

impl SwitchOff {
    fn new() -> SwitchOff {
        require_uring();
        let excl = SWITCH_LOCK.write().unwrap_or_else(|e| e.into_inner());
        let was = read_switch();
        std::fs::write(URING_SWITCH, "N").expect("turn off FUSE over io_uring");
        SwitchOff { _excl: excl, was }
    }
}

impl Drop for SwitchOff {
    fn drop(&mut self) {
        let _ = std::fs::write(URING_SWITCH, &self.was);
    }
}

/// The log of a FUSE mapping's daemon that ended: read, and holding the line each queue
/// logs at its end, so a check that something is absent from it cannot pass on a log that was
/// never written.
fn daemon_log(log: &Path) -> String {
    let text = std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("the daemon's log {}: {e}", log.display()));
    assert!(
        text.contains(" request(s) through io_uring, "),
        "the daemon's log {} has no queue's last line: {text}",
        log.display()
    );
    text
}

/// Requests the daemon logged as served through its FUSE ring (one line per queue at exit).
fn ring_requests(log: &Path) -> u64 {
    daemon_log(log)
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once(": served ")?;
            rest.strip_suffix(" through /dev/fuse read")?
                .split_once(" request(s) through io_uring")?
                .0
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A test of `$f(tag, extra map arguments)` on the read path, and its twin over FUSE over
/// io_uring (with the switch on).
macro_rules! on_both_paths {
    ($read:ident, $uring:ident, $f:ident, $tag:literal) => {
        #[test]
        fn $read() {
            require_root!();
            $f($tag, &[]);
        }

        #[test]
        fn $uring() {
            require_root!();
            let _on = SwitchOn::new();
            $f(concat!($tag, "-uring"), &["--fuse-io", "uring"]);
        }
    };
}

on_both_paths!(
    fio_randwrite_then_verify_crc32c,
    fio_randwrite_then_verify_crc32c_over_fuse_io_uring,
    fio_verify,
    "fio"
);
on_both_paths!(
    target_killed_during_io_fails_with_eio_after_the_timeout,
    target_killed_during_io_over_fuse_io_uring_fails_with_eio_after_the_timeout,
    eio_after_the_timeout,
    "eio"
);
on_both_paths!(
    target_restarted_within_the_timeout_resumes_io,
    target_restarted_within_the_timeout_resumes_io_over_fuse_io_uring,
    resumes_after_restart,
    "restart"
);

/// A private run directory (records and FUSE mounts) for one test.
struct Run(TempDir);

impl Run {
    fn new(tag: &str) -> Run {
        Run(TempDir::new(&format!("map-{tag}")))
    }

    fn dir(&self) -> &Path {
        &self.0 .0
    }

    /// Runs the CLI with this run directory; returns (success, stdout, stderr).
    fn cli(&self, args: &[&str]) -> (bool, String, String) {
        self.cli_in(None, args)
    }

    /// `cli` in network namespace `netns` (only the network: mounts and devices stay ours, so
    /// a daemon started there mounts its FUSE file where the rest of the test sees it).
    fn cli_in(&self, netns: Option<&str>, args: &[&str]) -> (bool, String, String) {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let out = cmd
            .args(args)
            .env("BLKWIRE_RUN_DIR", self.dir())
            .stdin(Stdio::null())
            .output()
            .expect("run blkwire");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ls(&self) -> Value {
        let (ok, out, err) = self.cli(&["ls", "--json"]);
        assert!(ok, "ls --json: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("ls --json: {e}: {out}"))
    }

    /// Maps `url` (with `--fuse-io read` unless `extra` chooses the path) and checks that `ls`
    /// reports the path it was asked for.
    fn map(&self, url: &str, extra: &[&str]) -> Mapped<'_> {
        self.map_in(None, url, extra)
    }

    /// `map` with the daemon in network namespace `netns` (see `cli_in`).
    fn map_in(&self, netns: Option<&str>, url: &str, extra: &[&str]) -> Mapped<'_> {
        let mut args = vec!["map", url];
        args.extend_from_slice(extra);
        if !extra.contains(&"--fuse-io") {
            args.extend_from_slice(&["--fuse-io", "read"]);
        }
        let (ok, out, err) = self.cli_in(netns, &args);
        assert!(ok, "map {url} {extra:?}: {err}");
        // The mapping exists from here: its guard unmaps it whatever check fails below.
        let mut m = Mapped {
            run: self,
            dev: out.trim().to_string(),
            file: String::new(),
        };
        assert!(
            m.dev.starts_with("/dev/loop") && !m.dev.contains('\n'),
            "map prints the device: {out:?}"
        );
        let rec = m.record();
        m.file = rec["file"].as_str().expect("file in ls --json").to_string();
        let want_io = match args.iter().position(|a| *a == "--fuse-io") {
            Some(i) if args[i + 1] == "read" => Some("read"),
            Some(i) if args[i + 1] == "uring" => Some("uring"),
            _ => None, // auto: the caller checks
        };
        if let Some(io) = want_io {
            assert_eq!(rec["fuse_io"], io, "ls --json: {rec}");
        }
        m
    }

    /// Asserts nothing of ours is left: no record, no mount directory, no FUSE mount and no
    /// loop device bound to a file under the run directory.
    fn assert_clean(&self) {
        assert_eq!(self.ls(), serde_json::json!({}), "records left");
        let mnt = self.dir().join("mnt");
        let left: Vec<_> = std::fs::read_dir(&mnt)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "mount directories left: {left:?}");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let prefix = self.dir().display().to_string();
        assert!(
            !mounts.lines().any(|l| l.contains(&prefix)),
            "a mount under {prefix} is left"
        );
        assert!(
            loops_backed_under(self.dir()).is_empty(),
            "loop devices left: {:?}",
            loops_backed_under(self.dir())
        );
    }
}

/// Loop devices whose backing file is under `dir`.
fn loops_backed_under(dir: &Path) -> Vec<String> {
    let prefix = dir.display().to_string();
    std::fs::read_dir("/sys/block")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let b = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
                    b.starts_with(&prefix).then_some(name)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A mapped device, unmapped on drop. If unmap fails (a test died with the device in use),
/// whatever holds it is unmounted and the daemon killed, then unmap runs again.
struct Mapped<'a> {
    run: &'a Run,
    dev: String,
    /// The FUSE file the device is bound to (the device itself may be reused by a parallel
    /// test as soon as it is free, so "detached" means "no longer bound to this").
    file: String,
}

impl Mapped<'_> {
    fn name(&self) -> &str {
        self.dev.trim_start_matches("/dev/")
    }

    fn sys(&self, rel: &str) -> String {
        std::fs::read_to_string(format!("/sys/block/{}/{rel}", self.name()))
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    }

    fn record(&self) -> Value {
        self.run.ls()[&self.dev].clone()
    }

    fn pid(&self) -> i32 {
        self.record()["pid"].as_i64().expect("pid in ls --json") as i32
    }

    fn unmap(&self) {
        let (ok, out, err) = self.run.cli(&["unmap", &self.dev]);
        assert!(ok, "unmap {}: {err}", self.dev);
        assert!(out.is_empty(), "unmap prints nothing: {out}");
        assert!(self.run.ls().get(&self.dev).is_none(), "record removed");
        assert!(!self.bound(), "loop detached");
    }

    fn bound(&self) -> bool {
        !self.file.is_empty() && self.sys("loop/backing_file") == self.file
    }
}

impl Drop for Mapped<'_> {
    fn drop(&mut self) {
        if self.run.ls().get(&self.dev).is_none() && !self.bound() {
            return; // unmapped by the test
        }
        if self.run.cli(&["unmap", &self.dev]).0 {
            return;
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for l in mounts.lines() {
            let mut f = l.split(' ');
            if let (Some(src), Some(dir)) = (f.next(), f.next()) {
                if src == self.dev {
                    let _ = Command::new("umount").args(["-l", dir]).status();
                }
            }
        }
        if let Some(pid) = self.run.ls()[&self.dev]["pid"].as_i64() {
            // SAFETY: kill(2); the record's pid is the daemon this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            wait_exit(pid as i32, Duration::from_secs(10));
        }
        if !self.run.cli(&["unmap", &self.dev]).0 {
            // Still held somewhere: detach when released, and do not leave the FUSE mount.
            let _ = Command::new("losetup").args(["-d", &self.dev]).status();
            if let Some(dir) = Path::new(&self.file).parent() {
                let _ = Command::new("umount").arg("-l").arg(dir).status();
            }
        }
    }
}

/// Runs `script` (sh, arguments `args`) in a private mount namespace of its own. Filesystems
/// mounted there exist nowhere else: no other process that unshares its namespace meanwhile can
/// copy the mount and keep the device busy after our umount, and if the script fails the
/// mounts vanish with the namespace.
fn in_private_mount_ns(script: &str, args: &[&str]) -> String {
    let mut a = vec![
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-euc",
        script,
        "sh",
    ];
    a.extend_from_slice(args);
    run_ok("unshare", &a)
}

fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits for process `pid` to exit (its pidfd turns readable); false on timeout.
fn wait_exit(pid: i32, timeout: Duration) -> bool {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return true; // already gone
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) > 0 }
}

/// A 4096-aligned buffer for O_DIRECT I/O on the device.
fn aligned(data: &[u8]) -> (Vec<u8>, usize) {
    let mut v = vec![0u8; data.len() + 4096];
    let off = v.as_ptr().align_offset(4096);
    v[off..off + data.len()].copy_from_slice(data);
    (v, off)
}

fn dev_write(dev: &str, data: &[u8], offset: u64) -> std::io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)?;
    let (buf, off) = aligned(data);
    f.write_all_at(&buf[off..off + data.len()], offset)
}

fn dev_read(dev: &str, len: usize, offset: u64) -> std::io::Result<Vec<u8>> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)?;
    let (mut buf, off) = aligned(&vec![0u8; len]);
    f.read_exact_at(&mut buf[off..off + len], offset)?;
    Ok(buf[off..off + len].to_vec())
}

/// A target listening on exactly `listen` (to restart one on the same port).
fn serve_on(listen: &str, exports: &[&str]) -> Target {
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--listen", listen, "--log-level", "warn"])
        .args(["--rpc-socket", "none"]);
    for e in exports {
        cmd.args(["--export", e]);
    }
    let (child, urls) = common::spawn_serve(&mut cmd, 1);
    let base = urls[0].clone();
    Target { child, base }
}

/// Sum of one counter over the target's live queues and its closed ones.
fn target_counter(t: &Target, name: &str) -> u64 {
    let (ok, out, err) = common::cli(&["stats", &t.base, "--json"]);
    assert!(ok, "stats: {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let live: u64 = v["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["queues"].as_array().into_iter().flatten())
        .map(|q| q[name].as_u64().unwrap_or(0))
        .sum();
    live + v["closed"][name].as_u64().unwrap_or(0)
}

/// mkfs, copy files in, unmap, map again, fsck and compare. `first` and `second` are the extra
/// `map` arguments of the two mappings; both must use FUSE I/O path `io`, which their daemons'
/// logs confirm by the requests they served through io_uring (none on the read path).
fn filesystem_round_trip(tag: &str, first: &[&str], second: &[&str], io: &str) {
    let run = Run::new(tag);
    let t = Target::start(&["disk=mem:256M"]);
    let src = TempDir::new(&format!("map-{tag}-src"));
    std::fs::create_dir_all(src.path("dir")).unwrap();
    let files = [
        ("a.bin", random_bytes(1 << 20, 11)),
        ("dir/b.bin", random_bytes((7 << 20) + 4095, 12)),
        ("dir/c.txt", b"small file\n".to_vec()),
    ];
    let mut want = String::new();
    for (name, data) in &files {
        std::fs::write(src.path(name), data).unwrap();
        want += &format!("{}  {name}\n", sha256(&src.path(name)));
    }
    let mnt = run.dir().join("fs");
    std::fs::create_dir_all(&mnt).unwrap();
    let mnt = mnt.to_str().unwrap();
    let logs = [run.dir().join("map1.log"), run.dir().join("map2.log")];
    let with_log = |extra: &[&str], log: &Path| -> Vec<String> {
        let mut a: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        a.extend(["--logfile".to_string(), log.display().to_string()]);
        a
    };
    let check_path = |m: &Mapped<'_>, log: &Path| {
        assert_eq!(m.record()["fuse_io"], io, "{}", m.record());
        m.unmap();
        let ring = ring_requests(log);
        let text = daemon_log(log);
        if io == "uring" {
            assert!(ring > 0, "no request went through io_uring: {text}");
        } else {
            assert_eq!(ring, 0, "{text}");
        }
    };
    {
        let a = with_log(first, &logs[0]);
        let m = run.map(
            &t.url("disk"),
            &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        );
        assert_eq!(m.sys("loop/dio"), "1", "loop device does direct I/O");
        assert_eq!(m.sys("ro"), "0");
        run_ok("mkfs.ext4", &["-q", "-F", &m.dev]);
        in_private_mount_ns(
            r#"mount "$1" "$2"; cp -r "$3"/. "$2"/; sync; umount "$2""#,
            &[&m.dev, mnt, src.0.to_str().unwrap()],
        );
        check_path(&m, &logs[0]);
        run.assert_clean();
    }
    let a = with_log(second, &logs[1]);
    let m = run.map(
        &t.url("disk"),
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    );
    // -f: check even though clean; -n: change nothing. Exit 0 means no errors at all.
    run_ok("fsck.ext4", &["-f", "-n", &m.dev]);
    let got = in_private_mount_ns(
        r#"mount -o ro "$1" "$2"; cd "$2"; sha256sum a.bin dir/b.bin dir/c.txt; cd /; umount "$2""#,
        &[&m.dev, mnt],
    );
    assert_eq!(got, want, "files changed across unmap and map");
    check_path(&m, &logs[1]);
    run.assert_clean();
}

#[test]
fn filesystem_survives_unmap_and_map_again_and_fscks_clean() {
    require_root!();
    filesystem_round_trip("fs", &[], &[], "read");
}

/// The same over FUSE over io_uring: asked for explicitly, then chosen by `auto` (the switch
/// is on).
#[test]
fn filesystem_over_fuse_io_uring_survives_unmap_and_map_again() {
    require_root!();
    let _on = SwitchOn::new();
    filesystem_round_trip(
        "fs-uring",
        &["--fuse-io", "uring"],
        &["--fuse-io", "auto"],
        "uring",
    );
}

/// fio writes random blocks of mixed sizes and checks every one's crc32c when reading back.
fn fio_verify(tag: &str, extra: &[&str]) {
    let run = Run::new(tag);
    let t = Target::start(&["disk=mem:128M"]);
    fio_verify_on(&run, None, &t.url("disk"), extra);
}

/// `fio_verify` on a mapping of `url` (an export of at least 128 MiB) whose daemon runs in
/// network namespace `netns`.
fn fio_verify_on(run: &Run, netns: Option<&str>, url: &str, extra: &[&str]) {
    let log = run.dir().join("map.log");
    let mut args = vec!["--queues", "2", "--logfile", log.to_str().unwrap()];
    args.extend_from_slice(extra);
    let m = run.map_in(netns, url, &args);
    // Two jobs on disjoint halves, mixed block sizes, each writing then reading back and
    // checking every block's crc32c (fio exits non-zero on any mismatch).
    let out = run_ok(
        "fio",
        &[
            "--name=verify",
            &format!("--filename={}", m.dev),
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bsrange=4k-256k",
            "--size=48M",
            "--numjobs=2",
            "--offset_increment=64M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No local-verify-*.state files left in the working directory.
            "--verify_state_save=0",
            "--output-format=json",
        ],
    );
    let v: Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    for job in v["jobs"].as_array().unwrap() {
        assert_eq!(job["error"], 0, "{job}");
        assert!(job["write"]["io_bytes"].as_u64().unwrap() >= 48 << 20);
        // The verify pass read back what was written.
        assert!(
            job["read"]["io_bytes"].as_u64().unwrap() >= 48 << 20,
            "{job}"
        );
    }
    m.unmap();
    if extra.contains(&"uring") {
        assert!(ring_requests(&log) > 0, "no request went through io_uring");
    }
    let text = daemon_log(&log);
    assert!(
        !text.contains("lost"),
        "the daemon lost its connection: {text}"
    );
    run.assert_clean();
}

/// A mapping whose every queue is a TLS-PSK connection (`map --tls --key`) to a target that
/// serves nothing in plain (`--tls require`): data written through the device reads back.
#[test]
fn fio_verify_over_tls_psk() {
    require_root!();
    let run = Run::new("tls");
    let keys = run.dir().join("keys.psk");
    let keys = keys.to_str().unwrap();
    let (ok, _, err) = common::cli(&["key", "gen", keys, "--host-id", "alice"]);
    assert!(ok, "key gen: {err}");
    let t = Target::start_with(&["disk=mem:128M"], &["--keys", keys, "--tls", "require"]);
    fio_verify_on(
        &run,
        None,
        &t.url("disk"),
        &["--tls", "--key", keys, "--host-id", "alice"],
    );
}

/// A target on loopback listening on udp:// too (besides the tcp:// one its stats are asked
/// on); returns it and the udp:// base URL.
fn udp_target(exports: &[&str], extra: &[&str]) -> (Target, String) {
    let mut a = vec!["--listen", "udp://127.0.0.1:0"];
    a.extend_from_slice(extra);
    let (t, urls) = Target::start_listeners(exports, &a);
    let udp = urls
        .into_iter()
        .find(|u| u.starts_with("udp://"))
        .expect("udp listener");
    (t, udp)
}

fn fio_verify_udp(tag: &str, extra: &[&str]) {
    let run = Run::new(tag);
    let (_t, udp) = udp_target(&["disk=mem:128M"], &[]);
    fio_verify_on(&run, None, &format!("{udp}/disk"), extra);
}

on_both_paths!(
    fio_verify_over_udp,
    fio_verify_over_udp_and_fuse_io_uring,
    fio_verify_udp,
    "fio-udp"
);

/// Raw Ethernet: the target in one namespace, the map daemon in the other (the device and its
/// FUSE mount stay in ours), joined by a veth pair that is removed whatever happens.
#[test]
fn fio_verify_over_eth_between_namespaces() {
    require_root!();
    let lab = NetLab::new(1, 1500);
    let _t = Served::start(Some(&lab.t), &["eth://vt"], &["disk=mem:128M"]);
    let url = format!("eth://vi/{}/disk", lab.mac());
    fio_verify_on(&Run::new("fio-eth"), Some(&lab.i), &url, &[]);
}

/// Ids of the target's live sessions.
fn sessions(t: &Target) -> Vec<u64> {
    let (ok, out, err) = common::cli(&["stats", &t.base, "--json"]);
    assert!(ok, "stats: {err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| s["session"].as_u64().expect("session id"))
        .collect()
}

/// A datagram session is forgotten by a target that hears nothing from it (shortened here from
/// 60 s): an idle udp:// mapping keeps it with keepalives, and its next I/O needs no reconnect.
fn idle_udp_mapping_keeps_its_session(tag: &str, extra: &[&str]) {
    const EXPIRY: u64 = 8;
    let run = Run::new(tag);
    let (t, udp) = udp_target(
        &["disk=mem:16M"],
        &["--datagram-idle-timeout", &EXPIRY.to_string()],
    );
    let log = run.dir().join("map.log");
    let mut args = vec!["--logfile", log.to_str().unwrap()];
    args.extend_from_slice(extra);
    let m = run.map(&format!("{udp}/disk"), &args);
    let data = random_bytes(1 << 20, 51);
    dev_write(&m.dev, &data, 0).unwrap();
    let before = sessions(&t);
    assert_eq!(before.len(), 1, "{before:?}");
    // Waiting is the point: twice the expiry, so the mapping is idle for longer than the
    // expiry even after whatever the kernel reads when the device is closed (udev probes).
    std::thread::sleep(Duration::from_secs(2 * EXPIRY + 2));
    assert_eq!(sessions(&t), before, "the target forgot the idle session");
    assert!(dev_read(&m.dev, data.len(), 0).unwrap() == data);
    let more = random_bytes(1 << 20, 52);
    dev_write(&m.dev, &more, 4 << 20).unwrap();
    assert!(dev_read(&m.dev, more.len(), 4 << 20).unwrap() == more);
    assert_eq!(sessions(&t), before, "a new session was opened");
    m.unmap();
    let text = daemon_log(&log);
    assert!(
        !text.contains("lost") && !text.contains("reconnect"),
        "the idle mapping reconnected: {text}"
    );
    run.assert_clean();
}

on_both_paths!(
    idle_udp_mapping_stays_usable_past_the_targets_expiry,
    idle_udp_mapping_over_fuse_io_uring_stays_usable_past_the_targets_expiry,
    idle_udp_mapping_keeps_its_session,
    "idle-udp"
);

#[test]
fn two_exports_mapped_at_once_keep_their_own_data() {
    require_root!();
    let run = Run::new("two");
    let t = Target::start(&["a=mem:64M", "b=mem:64M"]);
    let ma = run.map(&t.url("a"), &[]);
    let mb = run.map(&t.url("b"), &[]);
    assert_ne!(ma.dev, mb.dev);
    let (da, db) = (random_bytes(3 << 20, 21), random_bytes(3 << 20, 22));
    dev_write(&ma.dev, &da, 1 << 20).unwrap();
    dev_write(&mb.dev, &db, 1 << 20).unwrap();
    assert!(dev_read(&ma.dev, da.len(), 1 << 20).unwrap() == da);
    assert!(dev_read(&mb.dev, db.len(), 1 << 20).unwrap() == db);
    // Through the target itself: each export holds its own device's data.
    let d = TempDir::new("map-two-cp");
    for (name, data) in [("a", &da), ("b", &db)] {
        let f = d.path(name);
        let (ok, _, err) = common::cli(&["cp", &t.url(name), f.to_str().unwrap()]);
        assert!(ok, "{err}");
        let got = std::fs::read(&f).unwrap();
        assert!(
            &got[1 << 20..(1 << 20) + data.len()] == data.as_slice(),
            "export {name}"
        );
    }
    let ls = run.ls();
    assert_eq!(ls.as_object().unwrap().len(), 2);
    assert_eq!(ls[&ma.dev]["export"], "a");
    assert_eq!(ls[&mb.dev]["export"], "b");
    ma.unmap();
    mb.unmap();
    run.assert_clean();
}

#[test]
fn ls_describes_each_mapping() {
    require_root!();
    let run = Run::new("ls");
    let t = Target::start(&["disk=mem:32M"]);
    assert_eq!(run.ls(), serde_json::json!({}));
    let m = run.map(&t.url("disk"), &[]);
    let ls = run.ls();
    let keys: Vec<_> = ls.as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys, vec![m.dev.clone()]);
    let r = &ls[&m.dev];
    assert_eq!(r["url"], t.url("disk"));
    assert_eq!(r["export"], "disk");
    assert_eq!(r["frontend"], "fuse");
    assert_eq!(r["state"], "running");
    assert_eq!(r["readonly"], false);
    assert_eq!(r["size"], 32 << 20);
    assert_eq!(r["fuse_io"], "read");
    // The pid is the live daemon, a blkwire process.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", m.pid())).unwrap();
    assert!(String::from_utf8_lossy(&cmdline).contains("blkwire"));
    let (ok, text, err) = run.cli(&["ls"]);
    assert!(ok, "{err}");
    assert!(text.starts_with(&format!("{}\n", m.dev)), "{text}");
    for want in [
        "url:       tcp://",
        "export:    disk",
        "frontend:  fuse",
        "state:     running",
        "fuse io:   read",
    ] {
        assert!(text.contains(want), "'{want}' not in: {text}");
    }
    m.unmap();
    run.assert_clean();
}

#[test]
fn readonly_mapping_refuses_writes() {
    require_root!();
    let run = Run::new("ro");
    let t = Target::start(&["disk=mem:16M", "golden=mem:16M,ro"]);
    // Known data, put there through the target.
    let d = TempDir::new("map-ro-src");
    let data = random_bytes(1 << 20, 31);
    std::fs::write(d.path("src"), &data).unwrap();
    let (ok, _, err) = common::cli(&["cp", d.path("src").to_str().unwrap(), &t.url("disk")]);
    assert!(ok, "{err}");

    let m = run.map(&t.url("disk"), &["--readonly"]);
    assert_eq!(m.sys("ro"), "1", "read-only block device");
    assert_eq!(m.record()["readonly"], true);
    assert!(dev_read(&m.dev, data.len(), 0).unwrap() == data);
    let e = dev_write(&m.dev, &random_bytes(4096, 1), 0).expect_err("write must fail");
    assert!(
        matches!(
            e.raw_os_error(),
            Some(libc::EROFS | libc::EACCES | libc::EPERM)
        ),
        "{e}"
    );
    assert!(
        dev_read(&m.dev, data.len(), 0).unwrap() == data,
        "data unchanged"
    );
    // A read-only export maps read-only without being asked.
    let g = run.map(&t.url("golden"), &[]);
    assert_eq!(g.sys("ro"), "1");
    assert!(dev_write(&g.dev, &random_bytes(4096, 2), 0).is_err());
    m.unmap();
    g.unmap();
    run.assert_clean();
}

#[test]
fn killed_daemon_shows_dead_and_unmap_cleans_up() {
    require_root!();
    let run = Run::new("kill");
    let t = Target::start(&["disk=mem:16M"]);
    let m = run.map(&t.url("disk"), &[]);
    let pid = m.pid();
    // SAFETY: kill(2) on the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    assert!(
        wait_exit(pid, Duration::from_secs(10)),
        "daemon did not die"
    );
    let r = m.record();
    assert_eq!(r["state"], "dead", "{r}");
    assert_eq!(r["pid"], pid);
    let (_, text, _) = run.cli(&["ls"]);
    assert!(text.contains("state:     dead"), "{text}");
    // The device fails at once instead of hanging.
    assert!(dev_read(&m.dev, 4096, 0).is_err());
    m.unmap();
    run.assert_clean();
}

#[test]
fn readonly_mapping_recovers_after_its_daemon_is_killed() {
    require_root!();
    // With FUSE over io_uring available, a recovery that ignored the record would switch the
    // mapping (made on the read path below) to io_uring.
    let _on = SwitchOn::new();
    let run = Run::new("recover");
    let t = Target::start(&["disk=mem:16M"]);
    let data = random_bytes(256 << 10, 41);
    {
        let w = run.map(&t.url("disk"), &[]);
        dev_write(&w.dev, &data, 0).unwrap();
        w.unmap();
    }
    let m = run.map(&t.url("disk"), &["--readonly"]);
    let old = m.pid();
    // SAFETY: kill(2) on the daemon this test started.
    unsafe { libc::kill(old, libc::SIGKILL) };
    assert!(wait_exit(old, Duration::from_secs(10)));
    assert!(dev_read(&m.dev, 4096, 0).is_err(), "no daemon, no data");
    let (ok, out, err) = run.cli(&["map", "--recover", &m.dev]);
    assert!(ok, "recover: {err}");
    assert_eq!(out.trim(), m.dev);
    let r = m.record();
    assert_eq!(r["state"], "running");
    assert_ne!(r["pid"], old);
    assert_eq!(r["fuse_io"], "read", "recovered on the path it ran on");
    assert!(
        dev_read(&m.dev, data.len(), 0).unwrap() == data,
        "same device, served again"
    );
    // Nothing to recover while a daemon serves it.
    let (ok, _, err) = run.cli(&["map", "--recover", &m.dev]);
    assert!(!ok && err.contains("still served"), "{err}");
    m.unmap();

    // Read-write mappings cannot be recovered with a loop device: a clear one-line error.
    let w = run.map(&t.url("disk"), &[]);
    let pid = w.pid();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert!(wait_exit(pid, Duration::from_secs(10)));
    let (ok, _, err) = run.cli(&["map", "--recover", &w.dev]);
    assert!(!ok);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("blkwire: error:") && err.contains("ublk"),
        "{err}"
    );
    w.unmap();
    run.assert_clean();
}

fn eio_after_the_timeout(tag: &str, extra: &[&str]) {
    let run = Run::new(tag);
    let mut t = Target::start(&["disk=mem:64M"]);
    let mut args = vec!["--timeout", "3"];
    args.extend_from_slice(extra);
    let m = run.map(&t.url("disk"), &args);
    let dev = m.dev.clone();
    let (tx, rx) = mpsc::channel();
    // A writer that reports its first completed write (I/O is flowing), then its first error.
    let writer = std::thread::spawn(move || {
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&dev)
            .unwrap();
        let (buf, off) = aligned(&random_bytes(64 << 10, 51));
        let mut started = false;
        for i in 0u64.. {
            let r = f.write_all_at(&buf[off..off + (64 << 10)], (i % 1000) * (64 << 10));
            match r {
                Ok(()) if !started => {
                    started = true;
                    let _ = tx.send(None);
                }
                Ok(()) => {}
                Err(e) => {
                    let _ = tx.send(Some((e, Instant::now())));
                    return;
                }
            }
        }
    });
    assert!(
        matches!(rx.recv_timeout(Duration::from_secs(30)), Ok(None)),
        "I/O never flowed"
    );
    let killed = Instant::now();
    t.child.kill().unwrap();
    let (e, when) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("I/O hung after the target died")
        .expect("an error");
    let waited = when.duration_since(killed);
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // The 3 s timeout, or twice that for a write in flight when the target died: it is held
    // for the give-up fence, which never comes from a dead target.
    assert!(
        waited >= Duration::from_millis(2500) && waited < Duration::from_secs(20),
        "failed after {waited:?}, expected 3 to 6 s"
    );
    writer.join().unwrap();
    // Unmapping a device whose target is gone completes.
    let started = Instant::now();
    m.unmap();
    assert!(started.elapsed() < Duration::from_secs(20));
    run.assert_clean();
}

fn resumes_after_restart(tag: &str, extra: &[&str]) {
    let run = Run::new(tag);
    let d = TempDir::new(&format!("map-{tag}-img"));
    let img = d.path("disk.img");
    common::sparse_file(&img, 32 << 20);
    let spec = format!("disk=file:{}", img.display());
    let t = Target::start(&[&spec]);
    let port = t.base.rsplit(':').next().unwrap().to_string();
    let mut args = vec!["--timeout", "30"];
    args.extend_from_slice(extra);
    let m = run.map(&t.url("disk"), &args);
    let data = random_bytes(1 << 20, 61);
    dev_write(&m.dev, &data, 0).unwrap();
    drop(t); // kills the target
    let t = serve_on(&format!("tcp://127.0.0.1:{port}"), &[&spec]);
    // The first I/O finds its connection dead, reconnects and is served.
    assert!(dev_read(&m.dev, data.len(), 0).unwrap() == data);
    let more = random_bytes(1 << 20, 62);
    dev_write(&m.dev, &more, 4 << 20).unwrap();
    assert!(dev_read(&m.dev, more.len(), 4 << 20).unwrap() == more);
    m.unmap();
    drop(t);
    // Written through to the file behind the export.
    let f = std::fs::read(&img).unwrap();
    assert!(f[..data.len()] == data[..] && f[4 << 20..(4 << 20) + more.len()] == more[..]);
    run.assert_clean();
}

/// The give-up fence (PROTOCOL.md §2.6): a write the target is still running at its timeout
/// (stuck on a frozen filesystem) is not answered then. Answered EIO, a rewrite of its blocks
/// through another queue could be overtaken by it. The mapping gives the connection up, and the
/// write is answered once a reconnection naming its queue is welcomed, that is, once the write
/// has landed. If no fence comes within one more timeout, it is answered EIO unfenced, and the
/// log says so.
#[test]
fn a_write_the_target_still_runs_is_answered_only_once_fenced() {
    write_answered_only_once_fenced(false);
}

/// The same over udp://, where the client library gives a request up itself (resent until
/// its give-up time): it must not fail the write first, unfenced. (It gave up at the
/// mapping's --timeout, a few microseconds after the daemon's deadline, and the daemon
/// answered EIO at once.)
#[test]
fn a_write_the_target_still_runs_over_udp_is_answered_only_once_fenced() {
    write_answered_only_once_fenced(true);
}

fn write_answered_only_once_fenced(udp: bool) {
    assert!(
        is_root(),
        "this test maps a block device and freezes a filesystem; run it as root"
    );
    let fs = common::frozen::LoopExt4::new();
    let file = fs.mnt().join("disk");
    common::sparse_file(&file, 16 << 20);
    let export = format!("disk=file:{}", file.display());
    // (The target lives until the end.)
    let (_t, url) = if udp {
        let (t, base) = udp_target(&[&export], &[]);
        (t, format!("{base}/disk"))
    } else {
        let t = Target::start(&[&export]);
        let url = t.url("disk");
        (t, url)
    };
    let run = Run::new(if udp { "fence-udp" } else { "fence" });
    let log = run.dir().join("map.log");
    let timeout = Duration::from_secs(4);
    let m = run.map(
        &url,
        &["--timeout", "4", "--logfile", log.to_str().unwrap()],
    );
    dev_write(&m.dev, &random_bytes(4096, 70), 0).unwrap();
    // A write in a thread of its own, reporting its result and when it came.
    let write_in_thread = |data: Vec<u8>, offset: u64| {
        let (tx, rx) = mpsc::channel();
        let dev = m.dev.clone();
        std::thread::spawn(move || {
            let r = dev_write(&dev, &data, offset);
            let _ = tx.send((r, Instant::now()));
        });
        rx
    };
    let first = random_bytes(4096, 71);
    let frozen = fs.freeze();
    let rx = write_in_thread(first.clone(), 0);
    // Past its timeout (the daemon gives the connection up then, and says so): still
    // unanswered, the target still runs it. Thawed then, it lands and the fence comes well
    // before the second timeout ends.
    // "queue N: connection to URL lost (why); reconnecting": both daemons say it so.
    let gave_up = || std::fs::read_to_string(&log).is_ok_and(|t| t.contains(" lost ("));
    assert!(
        common::wait_until(Duration::from_secs(30), gave_up),
        "the daemon never gave the connection up"
    );
    assert!(
        matches!(rx.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "a write the target still ran was answered at its timeout"
    );
    let thawed = Instant::now();
    drop(frozen);
    let (r, when) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the held write was never answered after its write landed");
    let e = r.expect_err("a write past its timeout fails");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(when >= thawed);
    // Unfenced, it would be answered one more timeout after the connection was given up.
    assert!(
        when.duration_since(thawed) < timeout * 3 / 4,
        "answered {:?} after the thaw: unfenced, not once the write landed",
        when.duration_since(thawed)
    );
    // It had landed before its answer: what is read is it, and a rewrite is not overtaken.
    assert!(dev_read(&m.dev, 4096, 0).unwrap() == first);
    let second = random_bytes(4096, 72);
    dev_write(&m.dev, &second, 0).unwrap();
    assert!(dev_read(&m.dev, 4096, 0).unwrap() == second);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("reconnected"), "{text}");
    assert!(!text.contains("unfenced"), "{text}");
    // No fence within one more timeout: EIO unfenced, said in the log.
    let frozen = fs.freeze();
    let started = Instant::now();
    let rx = write_in_thread(random_bytes(4096, 73), 8192);
    let (r, when) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a write held for a fence that never came was never answered");
    let e = r.expect_err("a write past its timeout fails");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let waited = when.duration_since(started);
    assert!(
        waited >= timeout * 2 - Duration::from_millis(200),
        "answered unfenced after {waited:?}, before twice the timeout"
    );
    // The worker logs it right after the answer.
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            std::fs::read_to_string(&log).is_ok_and(|t| t.contains("answered EIO unfenced"))
        }),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    drop(frozen);
    m.unmap();
    run.assert_clean();
}

/// Unmapping a udp:// mapping whose target is gone: the last flush waits the mapping's
/// --timeout, not the client library's give-up (three times it, so that the daemon owns
/// request deadlines), which ran past what stopping a mapping waits for its workers.
#[test]
fn the_last_flush_of_a_mapping_whose_target_is_gone_waits_its_timeout() {
    assert!(is_root(), "this test maps a block device; run it as root");
    let run = Run::new("last-flush");
    let (t, udp) = udp_target(&["disk=mem:16M"], &[]);
    let log = run.dir().join("map.log");
    let m = run.map(
        &format!("{udp}/disk"),
        &["--timeout", "2", "--logfile", log.to_str().unwrap()],
    );
    dev_write(&m.dev, &random_bytes(4096, 80), 0).unwrap();
    drop(t); // kills the target
    m.unmap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("final flush: no answer within 2s"), "{text}");
    assert!(!text.contains("did not stop in time"), "{text}");
    run.assert_clean();
}

/// `blkwire ARGS --socket SOCK` against a target's control socket, which must succeed; stdout.
fn control_ok(sock: &str, args: &[&str]) -> String {
    let mut a = args.to_vec();
    a.extend(["--socket", sock]);
    let (ok, out, err) = common::cli(&a);
    assert!(ok, "{a:?}: {err}");
    out
}

/// A grown export (`export resize`) still takes the mapping's reconnections: the device keeps
/// the size it was mapped with and its I/O goes on (docs/MANAGEMENT.md, "Resizing an export").
#[test]
fn mapping_reconnects_after_its_export_grew() {
    require_root!();
    let run = Run::new("grown");
    let d = TempDir::new("map-grown-img");
    let img = d.path("disk.img");
    common::sparse_file(&img, 32 << 20);
    let sock = d.path("ctl.sock").to_str().unwrap().to_string();
    let t = Target::start_with_control(
        &[&format!("disk=file:{}", img.display())],
        std::path::Path::new(&sock),
    );
    let log = run.dir().join("map.log");
    // A short timeout: without the fix the reconnection is refused and the read below fails
    // with EIO once it passes.
    let m = run.map(
        &t.url("disk"),
        &["--timeout", "5", "--logfile", log.to_str().unwrap()],
    );
    let data = random_bytes(1 << 20, 63);
    dev_write(&m.dev, &data, 0).unwrap();
    control_ok(&sock, &["export", "resize", "disk", "64M"]);
    // Every session of the mapping is closed: its next I/O must reconnect, to the grown export.
    let list: Value =
        serde_json::from_str(&control_ok(&sock, &["session", "ls", "--json"])).unwrap();
    let ids: Vec<String> = list
        .as_array()
        .expect("session ls --json is a list")
        .iter()
        .map(|s| s["session"].to_string())
        .collect();
    assert!(!ids.is_empty(), "{list}");
    for id in &ids {
        control_ok(&sock, &["session", "close", id]);
    }
    assert!(dev_read(&m.dev, data.len(), 0).unwrap() == data);
    let more = random_bytes(1 << 20, 64);
    dev_write(&m.dev, &more, 4 << 20).unwrap();
    assert!(dev_read(&m.dev, more.len(), 4 << 20).unwrap() == more);
    assert_eq!(
        m.sys("size"),
        ((32u64 << 20) / 512).to_string(),
        "the device keeps its mapped size"
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("reconnected"), "{text}");
    m.unmap();
    drop(t);
    let f = std::fs::read(&img).unwrap();
    assert!(f[..data.len()] == data[..] && f[4 << 20..(4 << 20) + more.len()] == more[..]);
    run.assert_clean();
}

#[test]
fn discard_zeroout_and_flush_reach_the_target() {
    require_root!();
    let run = Run::new("trim");
    let t = Target::start(&["disk=mem:32M"]);
    let m = run.map(&t.url("disk"), &[]);
    let data = random_bytes(4 << 20, 71);
    dev_write(&m.dev, &data, 0).unwrap();
    let zeroes_before = target_counter(&t, "write_zeroes");
    // Discard 1 MiB at 1 MiB, zero-out 512 KiB at 3 MiB: both must read back as zeros.
    run_ok("blkdiscard", &["-o", "1048576", "-l", "1048576", &m.dev]);
    run_ok(
        "blkdiscard",
        &["-z", "-o", "3145728", "-l", "524288", &m.dev],
    );
    let back = dev_read(&m.dev, data.len(), 0).unwrap();
    assert!(
        back[1 << 20..2 << 20].iter().all(|b| *b == 0),
        "discarded range"
    );
    assert!(
        back[3 << 20..(3 << 20) + (512 << 10)]
            .iter()
            .all(|b| *b == 0),
        "zeroed range"
    );
    assert!(back[..1 << 20] == data[..1 << 20], "data before the ranges");
    assert!(
        back[2 << 20..3 << 20] == data[2 << 20..3 << 20],
        "data between the ranges"
    );
    assert!(
        back[(3 << 20) + (512 << 10)..] == data[(3 << 20) + (512 << 10)..],
        "data after the ranges"
    );
    assert!(
        target_counter(&t, "write_zeroes") > zeroes_before,
        "sent as WRITE_ZEROES"
    );
    // fsync on the device becomes a blkwire FLUSH.
    let flushes_before = target_counter(&t, "flushes");
    let f = OpenOptions::new().write(true).open(&m.dev).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(
        target_counter(&t, "flushes") > flushes_before,
        "fsync sent a FLUSH"
    );
    m.unmap();
    run.assert_clean();
}

#[test]
fn bad_input_is_one_line_and_leaves_nothing_behind() {
    require_root!();
    let run = Run::new("bad");
    let t = Target::start(&["disk=mem:16M"]);
    let one_line = |args: &[&str], needle: &str| {
        let (ok, out, err) = run.cli(args);
        assert!(!ok, "{args:?} should fail");
        assert!(out.is_empty(), "{args:?} printed {out}");
        let lines: Vec<_> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(lines[0].starts_with("blkwire: error:"), "{err}");
        assert!(lines[0].contains(needle), "'{needle}' not in: {err}");
    };
    one_line(&["map", &t.url("nope")], "nope");
    // A port nothing listens on: take one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    one_line(
        &["map", &format!("tcp://127.0.0.1:{port}/disk")],
        "cannot connect",
    );
    one_line(&["map", &t.base], "names no export");
    one_line(&["map", &t.url("disk"), "--max-io-size", "1k"], "--max-io");
    if !Path::new("/dev/ublk-control").exists() {
        one_line(
            &["map", &t.url("disk"), "--frontend", "ublk"],
            "/dev/ublk-control",
        );
    }
    run.assert_clean();

    // unmap of something that is not a blkwire device says so and touches nothing.
    one_line(&["unmap", "/dev/null"], "not a blkwire device");
    let d = TempDir::new("map-bad-loop");
    common::sparse_file(&d.path("plain.img"), 1 << 20);
    let plain = run_ok(
        "losetup",
        &["-f", "--show", d.path("plain.img").to_str().unwrap()],
    )
    .trim()
    .to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _guard = Detach(plain.clone());
    one_line(&["unmap", &plain], "not a blkwire device");
    let name = plain.trim_start_matches("/dev/");
    assert!(
        Path::new(&format!("/sys/block/{name}/loop/backing_file")).exists(),
        "a foreign loop device stays bound"
    );
    one_line(&["map", "--recover", &plain], "not a blkwire device");
    // The identity comes from the mapping's record: one given here would be ignored.
    one_line(
        &["map", "--recover", &plain, "--host-id", "other", "--tls"],
        "drop --host-id, --tls",
    );
    // ... but not from the environment, which holds them for every command.
    let out = Command::new(BIN)
        .args(["map", "--recover", &plain])
        .env("BLKWIRE_RUN_DIR", run.dir())
        .env("BLKWIRE_HOST_ID", "other")
        .env("BLKWIRE_KEY_FILE", "/nonexistent/keys")
        .output()
        .expect("run blkwire");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not a blkwire device"),
        "{err}"
    );
}

#[test]
fn options_reach_the_device() {
    require_root!();
    let run = Run::new("opts");
    let t = Target::start(&["disk=mem:16M"]);
    // A loop index nobody uses (the device is created on demand).
    let n = (200..10_000)
        .find(|n| !Path::new(&format!("/sys/block/loop{n}")).exists())
        .unwrap();
    let log = run.dir().join("map.log");
    let m = run.map(
        &t.url("disk"),
        &[
            "--dev-num",
            &n.to_string(),
            "--hdd",
            "--max-io-size",
            "64k",
            "--queue-depth",
            "8",
            "--queues",
            "1",
            "--logfile",
            log.to_str().unwrap(),
        ],
    );
    assert_eq!(m.dev, format!("/dev/loop{n}"));
    assert_eq!(m.sys("queue/rotational"), "1", "--hdd");
    assert_eq!(m.sys("queue/max_sectors_kb"), "64", "requests fit --max-io");
    let r = m.record();
    assert_eq!(
        (r["queues"].as_u64(), r["queue_depth"].as_u64()),
        (Some(1), Some(8))
    );
    // Large requests still work: the loop device splits them at 64 KiB.
    let data = random_bytes(1 << 20, 81);
    dev_write(&m.dev, &data, 0).unwrap();
    assert!(dev_read(&m.dev, data.len(), 0).unwrap() == data);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!("/dev/loop{n} serves {}", t.url("disk"))),
        "{text}"
    );
    // The device is taken: a second mapping on it fails and leaves the first alone.
    let (ok, _, err) = run.cli(&["map", &t.url("disk"), "--dev-num", &n.to_string()]);
    assert!(!ok && err.contains("in use"), "{err}");
    assert_eq!(m.record()["state"], "running");
    m.unmap();
    assert!(std::fs::read_to_string(&log).unwrap().contains("unmapped"));
    run.assert_clean();
}

/// A foreground mapping that fails to set up says so on the terminal in one line, also
/// with --logfile (whose log has the line too): the log file had taken stderr over before
/// the error was printed, and the terminal saw nothing. Without --logfile the line is not
/// printed twice (the daemon's log line and `map`'s).
#[test]
fn a_foreground_mapping_that_fails_says_why_on_the_terminal() {
    require_root!();
    let run = Run::new("fg-fail");
    let log = run.dir().join("map.log");
    let unreachable = "tcp://127.0.0.1:1/disk";
    for logfile in [true, false] {
        let mut args = vec!["map", unreachable, "--foreground"];
        let log_arg = log.to_str().unwrap();
        if logfile {
            args.extend(["--logfile", log_arg]);
        }
        let (ok, _, err) = run.cli(&args);
        assert!(!ok, "mapped an unreachable target");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "logfile {logfile}: {err:?}");
        assert!(
            lines[0].starts_with("blkwire: error: cannot connect"),
            "{err:?}"
        );
    }
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("cannot connect"), "{logged:?}");
    run.assert_clean();
}

#[test]
fn foreground_mapping_serves_until_sigterm() {
    require_root!();
    let run = Run::new("fg");
    let t = Target::start(&["disk=mem:16M"]);
    let mut child = Command::new(BIN)
        .args(["map", &t.url("disk"), "--foreground", "--fuse-io", "read"])
        .env("BLKWIRE_RUN_DIR", run.dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let mut child = Reap(child);
    // The device line is the readiness signal.
    let dev = line.trim().to_string();
    assert!(dev.starts_with("/dev/loop"), "{line:?}");
    let m = Mapped {
        run: &run,
        dev: dev.clone(),
        file: run.ls()[&dev]["file"].as_str().unwrap().to_string(),
    };
    assert_eq!(
        m.pid(),
        child.0.id() as i32,
        "the foreground process serves it"
    );
    let data = random_bytes(64 << 10, 91);
    dev_write(&dev, &data, 0).unwrap();
    assert!(dev_read(&dev, data.len(), 0).unwrap() == data);
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let status = child.0.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
    assert!(!m.bound(), "detached");
    assert!(run.ls().get(&dev).is_none(), "record removed");
    run.assert_clean();
}

#[test]
fn fuse_io_auto_reads_while_the_switch_is_off_and_uring_turns_it_on() {
    require_root!();
    let _off = SwitchOff::new();
    let run = Run::new("switch");
    let t = Target::start(&["disk=mem:16M"]);
    let log = run.dir().join("auto.log");
    let m = run.map(
        &t.url("disk"),
        &["--fuse-io", "auto", "--logfile", log.to_str().unwrap()],
    );
    assert_eq!(m.record()["fuse_io"], "read");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("FUSE I/O: read/write on /dev/fuse (io_uring is off"),
        "auto says why: {text}"
    );
    assert_eq!(read_switch(), "N", "auto leaves the switch alone");
    m.unmap();

    let log = run.dir().join("uring.log");
    let m = run.map(
        &t.url("disk"),
        &["--fuse-io", "uring", "--logfile", log.to_str().unwrap()],
    );
    assert_eq!(read_switch(), "Y", "--fuse-io uring turned the switch on");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("turned on FUSE over io_uring"), "{text}");
    let data = random_bytes(256 << 10, 101);
    dev_write(&m.dev, &data, 4096).unwrap();
    assert!(dev_read(&m.dev, data.len(), 4096).unwrap() == data);
    m.unmap();
    assert!(ring_requests(&log) > 0, "no request went through io_uring");
    run.assert_clean();
}

/// `--fuse-io uring` where the switch is off and cannot be turned on: a read-only stand-in
/// for the switch in a private mount namespace (the real one is not touched) makes the
/// write fail as it would without privilege.
#[test]
fn fuse_io_uring_that_cannot_be_turned_on_fails_in_one_line() {
    require_root!();
    require_uring();
    let run = Run::new("noswitch");
    let t = Target::start(&["disk=mem:16M"]);
    let fake = run.dir().join("enable_uring");
    std::fs::write(&fake, "N\n").unwrap();
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-ec",
            r#"mount --bind "$1" "$2"; mount -o remount,bind,ro "$2"; exec "$3" map "$4" --fuse-io uring"#,
            "sh",
            fake.to_str().unwrap(),
            URING_SWITCH,
            BIN,
            &t.url("disk"),
        ])
        .env("BLKWIRE_RUN_DIR", run.dir())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "map succeeded: {err}");
    assert!(out.stdout.is_empty(), "{:?}", out.stdout);
    let lines: Vec<_> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("blkwire: error: --fuse-io uring")
            && lines[0].contains(&format!("echo Y > {URING_SWITCH}")),
        "{err}"
    );
    run.assert_clean();
}

/// Anonymous memory starting on a 2 MiB boundary, asked to be a transparent huge page
/// (madvise), unmapped on drop. Physically contiguous memory makes few large bio segments, so a
/// 1 MiB O_DIRECT request reaches FUSE whole, however many pages it spans (scattered pages
/// would get the request cut by the loop device's segment limit first).
struct HugeBuf {
    map: *mut libc::c_void,
    map_len: usize,
    start: *mut u8,
    len: usize,
}

impl HugeBuf {
    fn new(len: usize) -> HugeBuf {
        const HUGE: usize = 2 << 20;
        let map_len = len.next_multiple_of(HUGE) + HUGE;
        // SAFETY: a fresh private anonymous mapping; checked below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            map != libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        let start = (map as usize).next_multiple_of(HUGE) as *mut u8;
        let len = len.next_multiple_of(HUGE);
        // SAFETY: advice on part of our mapping (failure only costs the huge page); then
        // writing faults the pages in, huge if granted.
        unsafe {
            libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
            std::ptr::write_bytes(start, 0, len);
        }
        HugeBuf {
            map,
            map_len,
            start,
            len,
        }
    }

    /// `len` bytes `at` bytes into the buffer.
    fn iovec(&self, at: usize, len: usize) -> libc::iovec {
        assert!(at + len <= self.len);
        libc::iovec {
            // SAFETY: within our mapping.
            iov_base: unsafe { self.start.add(at) }.cast(),
            iov_len: len,
        }
    }

    /// The kernel backs the buffer with huge pages (from /proc/self/smaps).
    fn is_huge(&self) -> bool {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let at = self.start as usize;
        let mut inside = false;
        for l in smaps.lines() {
            if let Some((range, _)) = l.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = a <= at && at < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = l.strip_prefix("AnonHugePages:") {
                    return kb
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .unwrap_or(0)
                        > 0;
                }
            }
        }
        false
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// pwritev of `data` from `iov` at `offset` of `f` (O_DIRECT), then the data read back with an
/// aligned buffer and with preadv into `iov` again; panics saying which case (`what`) failed.
fn round_trip_iovecs(
    f: &std::fs::File,
    dev: &str,
    what: &str,
    iov: &[libc::iovec],
    offset: u64,
    data: &[u8],
) {
    let fill = |src: Option<&[u8]>| {
        let mut at = 0;
        for v in iov {
            // SAFETY: each iovec is memory of the caller's, not otherwise borrowed now.
            let s = unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len) };
            match src {
                Some(d) => s.copy_from_slice(&d[at..at + v.iov_len]),
                None => s.fill(0),
            }
            at += v.iov_len;
        }
    };
    let gather = || {
        iov.iter()
            // SAFETY: as above.
            .flat_map(|v| unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) })
            .copied()
            .collect::<Vec<u8>>()
    };
    fill(Some(data));
    // SAFETY: pwritev/preadv over iovecs of live memory.
    let n = unsafe { libc::pwritev(f.as_raw_fd(), iov.as_ptr(), iov.len() as i32, offset as i64) };
    assert!(
        n == data.len() as isize,
        "{what}: O_DIRECT pwritev of {} bytes returned {n}: {}",
        data.len(),
        std::io::Error::last_os_error()
    );
    assert!(
        dev_read(dev, data.len(), offset).unwrap() == data,
        "{what}: the write did not read back (aligned read)"
    );
    fill(None);
    // SAFETY: as above.
    let n = unsafe { libc::preadv(f.as_raw_fd(), iov.as_ptr(), iov.len() as i32, offset as i64) };
    assert!(
        n == data.len() as isize,
        "{what}: O_DIRECT preadv of {} bytes returned {n}: {}",
        data.len(),
        std::io::Error::last_os_error()
    );
    assert!(gather() == data, "{what}: data read by preadv differs");
}

/// O_DIRECT on a block device needs buffers aligned only to its dma_alignment (512 bytes for a
/// loop device), not to its logical block, while FUSE cuts direct I/O after `max_pages` pages
/// (256) whatever the byte count. A 1 MiB request from a buffer 512 bytes into a page spans 257
/// pages and reaches the daemon as 1 MiB - 512 bytes, then 512; 128 iovecs of 8 KiB, each 512
/// bytes into a page, span 384 pages and are cut 3584 bytes into a block. An export with 4 KiB
/// logical blocks takes neither piece as it is; the daemon must serve them whole-block, and the
/// data must round-trip. Cases: a heap buffer (its scattered pages make the loop device split
/// the request first: always worked), one buffer and 128 iovecs in a huge page (which reach
/// FUSE whole; if the kernel grants no huge page they may not, and the test says so).
fn o_direct_512_bytes_into_a_page(tag: &str, extra: &[&str]) {
    assert!(
        is_root(),
        "this test maps a block device (loop device, FUSE mount) and needs root; run it as root"
    );
    const MIB: usize = 1 << 20;
    let run = Run::new(tag);
    let d = TempDir::new("map-misaligned-img");
    let img = d.path("disk.img");
    common::sparse_file(&img, 32 << 20);
    let t = Target::start(&[&format!("disk=file:{}?direct=1", img.display())]);
    let log = run.dir().join("map.log");
    let mut args = vec!["--logfile", log.to_str().unwrap()];
    args.extend_from_slice(extra);
    let m = run.map(&t.url("disk"), &args);
    assert_eq!(
        m.sys("queue/logical_block_size"),
        "4096",
        "a 4 KiB-block export"
    );
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&m.dev)
        .unwrap();
    let mut heap = vec![0u8; MIB + 8192];
    let h = heap.as_ptr().align_offset(4096) + 512;
    let heap_iov = [libc::iovec {
        iov_base: heap[h..].as_mut_ptr().cast(),
        iov_len: MIB,
    }];
    let huge = HugeBuf::new(2 * MIB);
    let one = [huge.iovec(512, MIB)];
    let many: Vec<libc::iovec> = (0..128)
        .map(|i| huge.iovec(i * 12288 + 512, 8192))
        .collect();
    let cases: [(&str, &[libc::iovec], u64); 3] = [
        ("heap buffer", &heap_iov, MIB as u64),
        ("huge page buffer", &one, 4 * MIB as u64),
        ("128 iovecs in a huge page", &many, 8 * MIB as u64),
    ];
    let mut written = Vec::new();
    for (i, (what, iov, offset)) in cases.into_iter().enumerate() {
        let data = random_bytes(MIB, 90 + i as u64);
        round_trip_iovecs(&f, &m.dev, what, iov, offset, &data);
        written.push((offset, data));
    }
    // Four writers at once, each over its own MiB, so that pieces of several requests are in
    // flight on every queue.
    let dev = m.dev.as_str();
    let finals: Vec<(u64, Vec<u8>)> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                s.spawn(move || {
                    let f = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .custom_flags(libc::O_DIRECT)
                        .open(dev)
                        .unwrap();
                    let huge = HugeBuf::new(2 * MIB);
                    let iov: Vec<libc::iovec> = (0..128)
                        .map(|i| huge.iovec(i * 12288 + 512, 8192))
                        .collect();
                    let offset = (16 + w) * MIB as u64;
                    let mut data = Vec::new();
                    for round in 0..8 {
                        data = random_bytes(MIB, 1000 + w * 100 + round);
                        round_trip_iovecs(&f, dev, "concurrent iovecs", &iov, offset, &data);
                    }
                    (offset, data)
                })
            })
            .collect();
        writers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    written.extend(finals);
    let huge_granted = huge.is_huge();
    drop(f);
    m.unmap();
    run.assert_clean();
    // On the export itself.
    let disk = std::fs::read(&img).unwrap();
    for (offset, data) in &written {
        let at = *offset as usize;
        assert!(&disk[at..at + MIB] == data.as_slice(), "export at {offset}");
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let partial: u64 = text
        .lines()
        .filter_map(|l| {
            l.split_once(": ")?
                .1
                .split_once(" request(s) covered part of a 4096-byte block")?
                .0
                .rsplit_once(' ')?
                .1
                .parse::<u64>()
                .ok()
        })
        .sum();
    eprintln!("requests the daemon got cut inside a 4 KiB block: {partial}");
    // Without a huge page the cases that reach FUSE whole may not have: the test would not
    // have tested what it is for.
    assert!(
        huge_granted,
        "this test needs a transparent huge page (/sys/kernel/mm/transparent_hugepage/enabled \
         'always' or 'madvise', and 2 MiB of memory the kernel can make contiguous)"
    );
    assert!(
        partial > 0,
        "no request reached the daemon cut inside a block: the test did not test it\n{text}"
    );
}

#[test]
fn o_direct_io_from_buffers_512_bytes_into_a_page_on_a_4k_block_export() {
    o_direct_512_bytes_into_a_page("misaligned", &[]);
}

#[test]
fn o_direct_io_from_buffers_512_bytes_into_a_page_on_a_4k_block_export_over_fuse_io_uring() {
    assert!(
        is_root(),
        "this test maps a block device and needs root; run it as root"
    );
    let _on = SwitchOn::new();
    o_direct_512_bytes_into_a_page("misaligned-uring", &["--fuse-io", "uring"]);
}

/// Field 22 of /proc/PID/stat (start time), as mapping records keep it.
fn start_time(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &s[s.rfind(')').unwrap() + 1..];
    rest.split_ascii_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap()
}

/// A fuse mapping record for `dev` served by `pid` (started at `start`).
fn fuse_record(dev: &str, url: &str, pid: u32, start: u64, mnt: &Path, file: &str) -> Value {
    serde_json::json!({
        "device": dev, "url": url, "export": "disk", "frontend": "fuse",
        "pid": pid, "start_time": start, "mountpoint": mnt.display().to_string(), "file": file,
        "size": 1 << 20, "readonly": false, "queues": 1, "queue_depth": 1, "max_io": 65536,
        "timeout_secs": 30, "hdd": false, "logfile": null
    })
}

/// A child process killed and reaped on drop.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `unmap` waits for the daemon once it has detached the device, which is free from then on: a
/// map that binds it meanwhile and records itself keeps its record. Unmap removes only the
/// record of the mapping it ended.
#[test]
fn unmap_leaves_the_record_of_a_map_that_took_the_freed_device() {
    assert!(
        is_root(),
        "this test binds a loop device and needs root; run it as root"
    );
    let run = Run::new("unmap-reuse");
    // A stand-in daemon that unmap waits for until the test ends it, with its "FUSE file" (a
    // plain file in its mount directory) bound to a loop device.
    let mut daemon = Reaped(
        Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = daemon.0.id();
    let mnt = run.dir().join("mnt").join(pid.to_string());
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::create_dir_all(run.dir().join("devices")).unwrap();
    let file = mnt.join("disk");
    common::sparse_file(&file, 1 << 20);
    let file = file.display().to_string();
    let dev = run_ok("losetup", &["-f", "--show", &file])
        .trim()
        .to_string();
    struct Detach(String, String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let name = self.0.trim_start_matches("/dev/");
            let b = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"));
            if b.is_ok_and(|b| b.trim() == self.1) {
                let _ = Command::new("losetup").args(["-d", &self.0]).status();
            }
        }
    }
    let _bound = Detach(dev.clone(), file.clone());
    let record = |v: &Value| {
        let name = dev.trim_start_matches("/dev/");
        let path = run.dir().join("devices").join(format!("{name}.json"));
        std::fs::write(path, v.to_string()).unwrap();
    };
    let old = "tcp://127.0.0.1:1/old";
    record(&fuse_record(&dev, old, pid, start_time(pid), &mnt, &file));
    assert_eq!(run.ls()[&dev]["state"], "running");

    let mut unmap = Reaped(
        Command::new(BIN)
            .args(["unmap", &dev])
            .env("BLKWIRE_RUN_DIR", run.dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let name = dev.trim_start_matches("/dev/").to_string();
    let bound = || {
        std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            .is_ok_and(|b| b.trim() == file)
    };
    assert!(
        common::wait_until(Duration::from_secs(30), || !bound()),
        "unmap did not detach {dev}"
    );
    // unmap now waits for the daemon. A new mapping takes the free device: the old daemon's
    // record is gone, the new one's is there.
    let me = std::process::id();
    let new = "tcp://127.0.0.1:1/new";
    let other_mnt = run.dir().join("mnt").join(me.to_string());
    record(&fuse_record(&dev, new, me, start_time(me), &other_mnt, "x"));
    let _ = daemon.0.kill();
    let _ = daemon.0.wait();
    let status = unmap.0.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut unmap.0.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "unmap: {err}");
    assert_eq!(
        run.ls()[&dev]["url"],
        new,
        "unmap removed the record of the mapping that took the device after it"
    );
}

/// A TCP relay on loopback to `upstream` that holds every connection it accepts, unanswered,
/// until `open` is called: a target that is slow to connect to. Each accept is announced on
/// `accepted`. Its threads end with their connections.
struct Gate {
    addr: std::net::SocketAddr,
    open: std::sync::Arc<(Mutex<bool>, std::sync::Condvar)>,
    accepted: mpsc::Receiver<()>,
}

impl Gate {
    fn new(upstream: &str) -> Gate {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        let upstream = upstream.to_string();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let open = std::sync::Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let (tx, accepted) = mpsc::channel();
        let gate = open.clone();
        std::thread::spawn(move || {
            for down in listener.incoming() {
                let Ok(down) = down else { return };
                let _ = tx.send(());
                let (gate, upstream) = (gate.clone(), upstream.clone());
                std::thread::spawn(move || {
                    let (m, cv) = &*gate;
                    let mut g = m.lock().unwrap();
                    while !*g {
                        g = cv.wait(g).unwrap();
                    }
                    drop(g);
                    let Ok(up) = TcpStream::connect(&upstream) else {
                        return;
                    };
                    let pairs = [
                        (down.try_clone().unwrap(), up.try_clone().unwrap()),
                        (up, down),
                    ];
                    for (mut from, mut to) in pairs {
                        std::thread::spawn(move || {
                            let mut buf = vec![0u8; 64 << 10];
                            while let Ok(n @ 1..) = from.read(&mut buf) {
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                            let _ = to.shutdown(Shutdown::Write);
                        });
                    }
                });
            }
        });
        Gate {
            addr,
            open,
            accepted,
        }
    }

    fn open(&self) {
        let (m, cv) = &*self.open;
        *m.lock().unwrap() = true;
        cv.notify_all();
    }
}

/// Processes whose environment holds `var` (exactly).
fn pids_with_env(var: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == var.as_bytes()))
        })
        .collect()
}

/// Ctrl-C on `map` while the daemon it started still connects leaves no mapping behind: the
/// daemon (in a session of its own, so the terminal's SIGINT never reaches it) finds nobody to
/// tell about the device once it is ready, removes it and exits.
#[test]
fn map_interrupted_while_connecting_leaves_no_mapping() {
    interrupted_map("interrupted", None, None);
}

/// The same when something opened the device as it appeared (udev, an automounter): the daemon
/// does not wait for it to let go, as it would on a stop signal, but ends the mapping at once.
#[test]
fn map_interrupted_while_connecting_leaves_no_mapping_of_a_held_device() {
    // A device number no other test asks for, created and held open before the map binds it.
    let n = 700 + std::process::id() % 200;
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .unwrap();
    // SAFETY: LOOP_CTL_ADD with an integer argument (EEXIST: it exists already).
    unsafe { libc::ioctl(ctl.as_raw_fd(), 0x4C80, n as libc::c_long) };
    let held = std::fs::File::open(format!("/dev/loop{n}")).unwrap();
    interrupted_map("interrupted-held", Some(n), Some(held));
}

/// Interrupts `map` (on /dev/loop`dev_num` if given) while its daemon connects and checks that
/// the daemon ends the mapping and exits; `held` (that device, open) is closed once it has.
fn interrupted_map(name: &str, dev_num: Option<u32>, held: Option<std::fs::File>) {
    assert!(
        is_root(),
        "this test maps a block device and needs root; run it as root"
    );
    let run = Run::new(name);
    let t = Target::start(&["disk=mem:16M"]);
    let gate = Gate::new(t.base.trim_start_matches("tcp://"));
    let log = run.dir().join("daemon.log");
    let dev_args = dev_num
        .map(|n| vec!["--dev-num".to_string(), n.to_string()])
        .unwrap_or_default();
    let mut map = Reaped(
        Command::new(BIN)
            .args([
                "map",
                &format!("tcp://{}/disk", gate.addr),
                "--frontend",
                "fuse",
                "--fuse-io",
                "read",
                "--queues",
                "1",
                // A held device is served on until the workers' wait for their I/O (twice
                // this, plus 5 s) ends.
                "--timeout",
                "10",
                "--logfile",
                log.to_str().unwrap(),
            ])
            .args(&dev_args)
            .env("BLKWIRE_RUN_DIR", run.dir())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    gate.accepted
        .recv_timeout(Duration::from_secs(30))
        .expect("the daemon did not connect");
    // SAFETY: kill(2) on our child, as Ctrl-C would.
    unsafe { libc::kill(map.0.id() as i32, libc::SIGINT) };
    let status = map.0.wait().unwrap();
    assert!(!status.success(), "map interrupted: {status}");
    let env = format!("BLKWIRE_RUN_DIR={}", run.dir().display());
    let daemons = pids_with_env(&env);
    assert_eq!(daemons.len(), 1, "the daemon: {daemons:?}");
    let daemon = daemons[0];
    // Whatever happens below, no daemon or mapping of this test outlives it.
    struct Cleanup<'a>(&'a Run, i32);
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            // SAFETY: kill(2) on the daemon this test started (gone: ESRCH).
            unsafe { libc::kill(self.1, libc::SIGTERM) };
            if !wait_exit(self.1, Duration::from_secs(40)) {
                // SAFETY: as above.
                unsafe { libc::kill(self.1, libc::SIGKILL) };
                wait_exit(self.1, Duration::from_secs(10));
            }
            let (ok, out, _) = self.0.cli(&["ls", "--json"]);
            let recs: Value = if ok {
                serde_json::from_str(&out).unwrap_or_default()
            } else {
                Value::Null
            };
            for dev in recs.as_object().into_iter().flat_map(|o| o.keys()) {
                let _ = self.0.cli(&["unmap", dev]);
            }
        }
    }
    let _cleanup = Cleanup(&run, daemon);
    gate.open();
    assert!(
        wait_exit(daemon, Duration::from_secs(60)),
        "the daemon serves a mapping nobody asked for any more: {}\n{}",
        run.ls(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("unmapped"), "{text}");
    // A held device is detached when its holder closes it; its record goes with unmap.
    drop(held);
    if let Some(n) = dev_num {
        let _ = run.cli(&["unmap", &format!("/dev/loop{n}")]);
    }
    run.assert_clean();
}

/// A TCP relay on loopback to the native target `upstream` that hides the feature bits `hide`
/// from every HELLO reply it forwards (the target itself still serves them): an export as a
/// target without them would offer it.
fn hiding_relay(upstream: &str, hide: u64) -> std::net::SocketAddr {
    use blkwire_wire::{Flags, Header, HelloReply, Opcode, Status, HEADER_LEN};
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let upstream = upstream.to_string();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for down in listener.incoming() {
            let Ok(down) = down else { return };
            let Ok(up) = TcpStream::connect(&upstream) else {
                return;
            };
            let pairs = [
                (down.try_clone().unwrap(), up.try_clone().unwrap(), false),
                (up, down, true),
            ];
            for (mut from, mut to, replies) in pairs {
                std::thread::spawn(move || {
                    // Replies: frame by frame up to the accepted HELLO, rewritten; then as is.
                    let mut framing = replies;
                    while framing {
                        let mut hb = [0u8; HEADER_LEN];
                        if from.read_exact(&mut hb).is_err() {
                            let _ = to.shutdown(Shutdown::Write);
                            return;
                        }
                        let mut h = Header::decode(&hb, 64 << 20).unwrap();
                        let mut p = vec![0u8; h.payload_len as usize];
                        if from.read_exact(&mut p).is_err() {
                            let _ = to.shutdown(Shutdown::Write);
                            return;
                        }
                        if h.opcode == Opcode::Hello && h.status == Status::Ok {
                            let mut r = HelloReply::decode(&p).unwrap();
                            r.features.0 &= !hide;
                            p = r.encode();
                            assert_eq!(p.len(), h.payload_len as usize);
                            if h.flags.has(Flags::CRC) {
                                h.seal_crc(&p);
                            }
                            framing = false;
                        }
                        if to.write_all(&h.to_bytes()).is_err() || to.write_all(&p).is_err() {
                            return;
                        }
                    }
                    let mut buf = vec![0u8; 64 << 10];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    addr
}

/// An export without TRIM and WRITE_ZEROES gets neither from the device: the loop device
/// offers discard and write-zeroes for any file with fallocate, the workers refuse them as not
/// supported, zeroing falls back to writing zeros, and no WRITE_ZEROES reaches the target (nor
/// fails there, with a target that lacks it, as EIO). Whether the loop device then stops
/// offering discard depends on the kernel (recent loop drivers clear the limit on the first
/// EOPNOTSUPP, older ones keep offering it and get each discard refused): both are accepted.
#[test]
fn export_without_write_zeroes_gets_none_and_zeroing_still_works() {
    use blkwire_wire::Features;
    assert!(
        is_root(),
        "this test maps a block device and needs root; run it as root"
    );
    let run = Run::new("nozeroes");
    let t = Target::start(&["disk=mem:16M"]);
    let relay = hiding_relay(
        t.base.trim_start_matches("tcp://"),
        Features::TRIM | Features::WRITE_ZEROES,
    );
    let url = format!("tcp://{relay}/disk");
    let (ok, out, err) = common::cli(&["info", &url]);
    assert!(
        ok && !out.contains("write-zeroes") && !out.contains("trim"),
        "the relay hides them: {out}{err}"
    );
    let m = run.map(&url, &["--frontend", "fuse"]);
    let data = random_bytes(4 << 20, 73);
    dev_write(&m.dev, &data, 0).unwrap();
    let discard = || {
        Command::new("blkdiscard")
            .args(["-o", "1048576", "-l", "1048576", &m.dev])
            .output()
            .unwrap()
    };
    // The kernel reports a discard refused as unsupported as done (discard is advisory).
    let first = discard();
    assert!(
        first.status.success(),
        "first discard: {}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = discard();
    let said = String::from_utf8_lossy(&second.stderr);
    if m.sys("queue/discard_max_hw_bytes") == "0" {
        // A loop driver that stops offering discard after a refusal: refused at once.
        assert!(
            !second.status.success() && said.contains("not supported"),
            "second discard: {said}"
        );
    } else {
        // One that keeps offering it: refused by the workers again, reported as done.
        assert!(second.status.success(), "second discard: {said}");
    }
    run_ok(
        "blkdiscard",
        &["-z", "-o", "3145728", "-l", "524288", &m.dev],
    );
    let back = dev_read(&m.dev, data.len(), 0).unwrap();
    assert!(
        back[3 << 20..(3 << 20) + (512 << 10)]
            .iter()
            .all(|b| *b == 0),
        "zeroed range"
    );
    assert!(back[..3 << 20] == data[..3 << 20], "data before the range");
    assert!(
        back[(3 << 20) + (512 << 10)..] == data[(3 << 20) + (512 << 10)..],
        "data after the range"
    );
    assert_eq!(target_counter(&t, "write_zeroes"), 0, "sent WRITE_ZEROES");
    assert_eq!(target_counter(&t, "trims"), 0, "sent TRIM");
    m.unmap();
    run.assert_clean();
}
