//! Test harness: runs the real `blkwire serve` on loopback and waits for its readiness line.

#![allow(dead_code)]

pub mod frozen;
pub mod iscsi_host;
pub mod native_raw;
pub mod nbd_raw;
pub mod netlab;
pub mod nvme_host;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_blkwire");

/// Fails the test (never skips it), naming the package, when the program `prog` is not on
/// PATH.
pub fn need_tool(prog: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()));
    assert!(
        found,
        "{prog} is not installed: this test needs it (apt-get install {package}; scripts/deps.sh does)"
    );
}

/// Spawns a prepared `blkwire serve` command and waits (up to 20 s) for `want` `listening URL`
/// lines on its stdout; returns the child and the URLs in the order printed. Panics, with the
/// child killed, when they do not come.
pub fn spawn_serve(cmd: &mut Command, want: usize) -> (Child, Vec<String>) {
    let (child, urls, _) = spawn_serve_lines(cmd, want, Also::Nothing, Stdio::inherit());
    (child, urls)
}

/// Like [`spawn_serve`], with the target's log (its stderr) piped, for the test to read from
/// the child, instead of passed through.
pub fn spawn_serve_logged(cmd: &mut Command, want: usize) -> (Child, Vec<String>) {
    let (child, urls, _) = spawn_serve_lines(cmd, want, Also::Nothing, Stdio::piped());
    (child, urls)
}

/// What a `serve` command logs while it starts: run until its `want` `listening` lines, then
/// killed; its URLs and its log (stderr).
pub fn start_log(cmd: &mut Command, want: usize) -> (Vec<String>, String) {
    use std::io::Read;
    let (mut child, urls) = spawn_serve_logged(cmd, want);
    child.kill().unwrap();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    child.wait().unwrap();
    (urls, log)
}

/// Like [`spawn_serve`] for a `serve --rpc-socket PATH` command: also waits for its `control
/// PATH` line (printed once the control socket takes calls).
pub fn spawn_serve_with_control(cmd: &mut Command, want: usize) -> (Child, Vec<String>) {
    let (child, urls, _) = spawn_serve_lines(cmd, want, Also::Control, Stdio::inherit());
    (child, urls)
}

/// `blkwire serve --rpc-socket DIR/ctl.sock ARGS` (quiet but for warnings) once its control
/// socket takes calls, with every `listening` URL (one per `--listen`); killed on drop.
pub struct Controlled {
    child: Child,
    /// The control socket's path.
    pub sock: String,
    pub urls: Vec<String>,
}

impl Controlled {
    pub fn start(dir: &TempDir, args: &[&str]) -> Controlled {
        let sock = dir.path("ctl.sock").to_str().unwrap().to_string();
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--rpc-socket", &sock, "--log-level", "warn"]);
        cmd.args(args);
        let want = args.iter().filter(|a| **a == "--listen").count();
        let (child, urls) = spawn_serve_with_control(&mut cmd, want);
        Controlled { child, sock, urls }
    }

    /// `blkwire rpc METHOD PARAMS` on its control socket, which must succeed: the JSON printed.
    pub fn rpc(&self, method: &str, params: &str) -> serde_json::Value {
        let (ok, out, err) = cli(&["rpc", method, params, "--socket", &self.sock]);
        assert!(ok, "rpc {method}: {err}");
        serde_json::from_str(&out).expect("rpc prints JSON")
    }

    /// `blkwire rpc METHOD PARAMS`, which must fail with one line containing `needle`.
    pub fn refused(&self, method: &str, params: &str, needle: &str) {
        assert_one_line_error(&["rpc", method, params, "--socket", &self.sock], needle);
    }
}

impl Drop for Controlled {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Like [`spawn_serve`] for a `serve --metrics` command: also waits for its `metrics URL` line
/// and returns that URL.
pub fn spawn_serve_with_metrics(cmd: &mut Command, want: usize) -> (Child, Vec<String>, String) {
    let (child, urls, metrics) = spawn_serve_lines(cmd, want, Also::Metrics, Stdio::inherit());
    (child, urls, metrics.expect("waited for"))
}

/// What a serve command prints after its `listening` lines that the caller waits for too.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Also {
    Nothing,
    /// `metrics URL` (returned).
    Metrics,
    /// `control PATH`.
    Control,
}

fn spawn_serve_lines(
    cmd: &mut Command,
    want: usize,
    also: Also,
    log: Stdio,
) -> (Child, Vec<String>, Option<String>) {
    let metrics = also == Also::Metrics;
    let mut control = also != Also::Control;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn blkwire serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // A target that opens a remote backend (rbd:) before its control socket may take longer.
    let wait = if also == Also::Control { 30 } else { 20 };
    let deadline = std::time::Instant::now() + Duration::from_secs(wait);
    let mut urls = Vec::new();
    let mut metrics_url = None;
    while urls.len() < want || (metrics && metrics_url.is_none()) || !control {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(u) = line.strip_prefix("listening ") {
                    urls.push(u.to_string());
                } else if let Some(u) = line.strip_prefix("metrics ") {
                    metrics_url = Some(u.to_string());
                } else if line.starts_with("control ") {
                    control = true;
                }
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "target reported {urls:?}, metrics {metrics_url:?} and control {control}, \
                     expected {want} listening addresses{}",
                    match also {
                        Also::Metrics => " and a metrics URL",
                        Also::Control => " and a control line",
                        Also::Nothing => "",
                    }
                );
            }
        }
    }
    (child, urls, metrics_url)
}

pub struct Target {
    pub child: Child,
    /// `tcp://127.0.0.1:PORT`
    pub base: String,
}

/// A TCP connection to `to` from source address `from` (another loopback address plays another
/// host): the socket is bound before it connects, which `std` cannot do. A failing `socket` or
/// `bind` is the test machine's fault and panics; a refused `connect` is the caller's to judge.
pub fn tcp_connect_from(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddrV4,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let (local, remote) = (sin(from, 0), sin(*to.ip(), to.port()));
    let len = std::mem::size_of::<libc::sockaddr_in>() as u32;
    // SAFETY: a new socket, owned by the TcpStream at once, bound and connected with
    // addresses that live across the calls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let s = std::net::TcpStream::from_raw_fd(fd);
        let r = libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len);
        assert_eq!(r, 0, "bind {from}: {}", std::io::Error::last_os_error());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// `blkwire serve` on 127.0.0.1 (port 0), quiet but for warnings, serving `exports`.
/// `serve` on a free loopback port with its control socket at `control`, or none: never the
/// default /run/blkwire/blkwire.sock, which tests running side by side would each try to take
/// (and probe each other's), and which a target of the machine's own may hold.
fn serve_command(exports: &[&str], control: Option<&std::path::Path>) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "serve",
        "--listen",
        "tcp://127.0.0.1:0",
        "--log-level",
        "warn",
        "--rpc-socket",
    ]);
    cmd.arg(control.map_or("none".as_ref(), |p| p.as_os_str()));
    for e in exports {
        cmd.args(["--export", e]);
    }
    cmd
}

impl Target {
    /// Starts a target with these `--export` specs on a free port and waits until it listens.
    pub fn start(exports: &[&str]) -> Target {
        Self::start_with(exports, &[])
    }

    /// Starts a target with extra `serve` arguments; `base` is its first (tcp://) listener.
    pub fn start_with(exports: &[&str], extra: &[&str]) -> Target {
        Self::start_listeners(exports, extra).0
    }

    /// Like [`Target::start_with`], but waits for the `listening` line of every listener (the
    /// implicit `tcp://` one plus one per `--listen` in `extra`) and returns them all, in the
    /// order the target printed them.
    pub fn start_listeners(exports: &[&str], extra: &[&str]) -> (Target, Vec<String>) {
        let want = 1 + extra.iter().filter(|a| **a == "--listen").count();
        let mut cmd = serve_command(exports, None);
        cmd.args(extra);
        let (child, urls) = spawn_serve(&mut cmd, want);
        let base = urls[0].clone();
        (Target { child, base }, urls)
    }

    /// A target on 127.0.0.1 serving `exports` with its control socket at `socket`, once the
    /// socket takes calls.
    pub fn start_with_control(exports: &[&str], socket: &std::path::Path) -> Target {
        let mut cmd = serve_command(exports, Some(socket));
        let (child, urls) = spawn_serve_with_control(&mut cmd, 1);
        Target {
            child,
            base: urls[0].clone(),
        }
    }

    pub fn url(&self, export: &str) -> String {
        format!("{}/{export}", self.base)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process killed and reaped on drop (also when a test fails).
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory removed on drop (also when a test fails).
/// A command that runs `program` as user and group 65534 (nobody), with no supplementary
/// groups, through setpriv: for tests of what other users may do. Needs root (CI is).
pub fn as_nobody(program: &str) -> std::process::Command {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (to run a program as another user); CI runs as root"
    );
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("setpriv is missing: apt-get install util-linux (scripts/deps.sh does)");
    let mut cmd = std::process::Command::new(setpriv);
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", program]);
    cmd
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "blkwire-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("mkdir");
        TempDir(p)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// Writes and reads back, on every queue of `s`, requests from one 512-byte block to 3.5 MiB
/// (several max-I/O pieces), each at its own offset; panics naming the queue and size whose
/// data came back different.
pub fn round_trip_every_queue(s: &mut blkwire_client::Session) {
    let sizes = [
        512usize,
        4096,
        65536 + 512,
        256 << 10,
        (3 << 20) + (512 << 10),
    ];
    let mut offset = 0u64;
    for (qi, q) in s.queues.iter_mut().enumerate() {
        for (i, &len) in sizes.iter().enumerate() {
            let data = random_bytes(len, (qi * 100 + i) as u64);
            q.write_at(&data, offset, false).unwrap();
            let mut back = vec![0u8; len];
            q.read_at(&mut back, offset).unwrap();
            assert!(back == data, "queue {qi} size {len}: data differs");
            offset += len as u64 + 512;
        }
    }
}

pub fn sparse_file(path: &std::path::Path, size: u64) {
    std::fs::File::create(path)
        .and_then(|f| f.set_len(size))
        .expect("create file");
}

/// The SHA-256 of a file, as `sha256sum` prints it.
pub fn sha256(path: &std::path::Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum (coreutils)");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Runs the CLI; returns (exit success, stdout, stderr).
pub fn cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run blkwire");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a CLI call failed with exactly one line on stderr that mentions `needle`.
pub fn assert_one_line_error(args: &[&str], needle: &str) {
    let (ok, _, err) = cli(args);
    assert!(!ok, "{args:?} should fail");
    let lines: Vec<_> = err.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{args:?}: expected one error line, got: {err}"
    );
    assert!(lines[0].starts_with("blkwire: error:"), "{args:?}: {err}");
    assert!(
        lines[0].contains(needle),
        "{args:?}: '{needle}' not in: {err}"
    );
}

/// A UDP port on 127.0.0.1 that nothing holds (the kernel picked it, then it was let go).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Checks `cond` every 20 ms until it holds (true) or `within` has passed (false): for states
/// that come about on the target's own timers (idle trims, expiry), with no event to wait on.
pub fn wait_until(within: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Resident memory of a process, in KiB (VmRSS).
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// The most resident memory process `pid` has had, in KiB (`VmHWM`).
#[allow(dead_code)]
pub fn peak_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}
