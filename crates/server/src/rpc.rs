//! The control socket: JSON-RPC 2.0 over a Unix stream socket, one request per line and one
//! answer per line (docs/MANAGEMENT.md). Only root and the user running the target may use it:
//! the socket file is 0600 and every connection's peer credentials are checked.
//!
//! Its own thread, plus one per permitted client (a few at most): nothing here touches the data
//! path, which only ever sees the messages the calls send to reactors.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::control::{self, RpcError};
use crate::log::Level;
use crate::{eventfd, eventfd_write, Bounded, Error, Shared};

/// Largest request line (a `load_config` carrying its calls: thousands of exports; a larger
/// config is loaded by path). With `MAX_REPLY`, what one client can make the target hold.
pub const MAX_REQUEST: usize = 1 << 20;
/// Largest reply line: a larger one is not built, and the call is answered with an error that
/// says so (a `stats` page of fewer sessions fits).
pub const MAX_REPLY: usize = 16 << 20;
/// How much of an over-long request line is read past `MAX_REQUEST` (and dropped) to find its
/// end, so the connection can go on; a client that sends more without a newline is let go.
const MAX_SKIP: usize = 64 << 20;
/// Clients connected at once; more are answered with an error and closed.
const MAX_CLIENTS: usize = 16;
/// A client that sends nothing for this long is disconnected.
const IDLE: Duration = Duration::from_secs(300);
/// How long a reply may wait for its client to read it: one that never reads (a script that
/// forgot to) would otherwise hold its thread, and one of the `MAX_CLIENTS` places, for ever.
const REPLY_WAIT: Duration = Duration::from_secs(30);

/// An open control socket; dropping it stops its thread and removes the socket file.
pub(crate) struct ControlSocket {
    path: PathBuf,
    /// The socket file's inode: removed on drop only if it is still ours.
    ino: u64,
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    /// `PATH.lock`, locked while the socket is served (`lock_path`); released last.
    _lock: std::fs::File,
}

/// Locks `PATH.lock` beside the socket for as long as the socket is served: one target at a
/// time checks `path` for a stale socket, removes it and binds its own, so two targets
/// starting at once cannot each remove what the other bound (the first then served a socket
/// nobody could reach, and removed the second's on stopping). The lock file stays: removing
/// it would let a third target lock a new file beside the held one.
fn lock_path(path: &Path) -> Result<std::fs::File, Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock = PathBuf::from(name);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&lock)
        .map_err(|e| {
            // SAFETY: geteuid cannot fail.
            let uid = unsafe { libc::geteuid() };
            let theirs = std::fs::symlink_metadata(&lock).is_ok_and(|m| m.uid() != uid);
            let hint = match e.kind() {
                std::io::ErrorKind::PermissionDenied if theirs => {
                    " (another user's lock file: remove it if no target of theirs serves that \
                     path, or give --rpc-socket another path)"
                }
                std::io::ErrorKind::PermissionDenied => {
                    " (a directory this user cannot write: give --rpc-socket PATH in one it \
                     can, or --rpc-socket none)"
                }
                _ => "",
            };
            Error::Listen(format!(
                "cannot open {} to take the control socket {}: {e}{hint}",
                lock.display(),
                path.display()
            ))
        })?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::Listen(
            if e.kind() == std::io::ErrorKind::WouldBlock {
                format!(
                    "another target serves the control socket {} (it holds {}): give this one \
                 --rpc-socket PATH (or --rpc-socket none)",
                    path.display(),
                    lock.display()
                )
            } else {
                format!("cannot lock {}: {e}", lock.display())
            },
        ));
    }
    Ok(f)
}

impl ControlSocket {
    /// Binds `path` (creating its directory), taking over a stale socket left by a target that
    /// died, but never one a live target serves nor a file that is not a socket.
    pub(crate) fn open(path: &Path, shared: Arc<Shared>) -> Result<ControlSocket, Error> {
        let shown = path.display();
        if path.as_os_str().is_empty() || path.file_name().is_none() {
            return Err(Error::Listen(format!(
                "--rpc-socket '{shown}' names no file: give a path such as /run/blkwire.sock, \
                 or --rpc-socket none"
            )));
        }
        let not_a_socket = || {
            Error::Listen(format!(
                "{shown} exists and is not a socket: remove it or give --rpc-socket another path"
            ))
        };
        // Before the lock file is made beside it: a mistyped path to a data file leaves
        // nothing behind.
        if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_socket()) {
            return Err(not_a_socket());
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Listen(format!(
                    "cannot create {} for the control socket: {e} (run as root, or give \
                     --rpc-socket PATH in a directory you own, or --rpc-socket none)",
                    dir.display()
                ))
            })?;
        }
        let lock = lock_path(path)?;
        if let Ok(m) = std::fs::symlink_metadata(path) {
            if !m.file_type().is_socket() {
                return Err(not_a_socket());
            }
            match UnixStream::connect(path) {
                Ok(_) => {
                    return Err(Error::Listen(format!(
                        "another target serves the control socket {shown}: give this one \
                         --rpc-socket PATH (or --rpc-socket none)"
                    )))
                }
                // Nobody listens: left behind by a target that did not stop cleanly.
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                    let _ = std::fs::remove_file(path);
                }
                // Gone meanwhile: nothing to take over.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Someone else's socket (another user's, EACCES; a datagram socket,
                // EPROTOTYPE; ...): not known to be stale, so never removed.
                Err(e) => {
                    return Err(Error::Listen(format!(
                        "{shown} is a socket this target cannot tell is stale ({e}): give \
                         --rpc-socket another path, or remove it if nothing uses it"
                    )))
                }
            }
        }
        let listener = UnixListener::bind(path)
            .map_err(|e| Error::Listen(format!("cannot open the control socket {shown}: {e}")))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::Listen(format!("cannot restrict {shown} to its owner: {e}")))?;
        let ino = std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0);
        let stop = Arc::new(eventfd()?);
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("blkwire-rpc".into())
            .spawn(move || serve(listener, &stop2, shared))
            .map_err(|e| Error::System(format!("cannot start the control thread: {e}")))?;
        crate::log!(Level::Info, "control socket: {shown}");
        Ok(ControlSocket {
            path: path.to_path_buf(),
            ino,
            stop,
            thread: Some(thread),
            _lock: lock,
        })
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        eventfd_write(self.stop.as_raw_fd());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if std::fs::metadata(&self.path).is_ok_and(|m| m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Accepts clients until `stop` is written.
fn serve(listener: UnixListener, stop: &OwnedFd, shared: Arc<Shared>) {
    let clients = Arc::new(AtomicUsize::new(0));
    let mut refusals = crate::log::Throttle::new();
    let mut shortages = crate::log::Throttle::new();
    loop {
        let mut fds = [listener.as_raw_fd(), stop.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: poll over a local array of two pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            crate::log!(Level::Error, "control socket: poll failed; no more calls");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if crate::is_resource_shortage(&e) => {
                // Out of descriptors or memory, the connection stays in the backlog and the
                // socket readable: rest instead of spinning on it.
                if let Some(n) = shortages.hit() {
                    crate::log!(
                        Level::Warn,
                        "control socket: accept failed {n} time(s): {e}; waiting for \
                         descriptors or memory to free"
                    );
                }
                std::thread::sleep(crate::ACCEPT_PAUSE);
                continue;
            }
            Err(_) => continue,
        };
        // Refused on this thread, at once: a caller that may not use the socket takes no
        // thread and no place among MAX_CLIENTS, however slowly it writes (or never does).
        if let Err(uid) = permitted(&s) {
            if let Some(n) = refusals.hit() {
                let more = match n {
                    1 => String::new(),
                    n => format!(" ({} more since the last line)", n - 1),
                };
                crate::log!(
                    Level::Warn,
                    "control socket: refused a client running as uid {uid} (root and the \
                     target's user only){more}"
                );
            }
            refuse(s);
            continue;
        }
        let Some(place) = Place::take(&clients) else {
            answer_at_once(
                s,
                RpcError {
                    code: RpcError::REFUSED,
                    message: format!("{MAX_CLIENTS} clients connected: try again"),
                },
            );
            continue;
        };
        let shared = shared.clone();
        // The place is given back when the thread ends, also by a panic (or, if the thread
        // cannot start, when the closure holding it is dropped).
        let _ = std::thread::Builder::new()
            .name("blkwire-rpc-c".into())
            .spawn(move || {
                let _place = place;
                client(s, &shared);
            });
    }
}

/// One of the `MAX_CLIENTS` places, held by a client's thread and given back when dropped:
/// also when the thread panics, so that panics cannot use up the places and lock everyone out.
struct Place(Arc<AtomicUsize>);

impl Place {
    /// A place, unless all are taken.
    fn take(count: &Arc<AtomicUsize>) -> Option<Place> {
        if count.fetch_add(1, Ordering::Relaxed) >= MAX_CLIENTS {
            count.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Place(count.clone()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Root, or the user this process runs as; otherwise the peer's uid. The target asks it of
/// its callers, and the CLI of the target it called (`blkwire rpc` and the like send configs
/// and key file paths, and trust what comes back).
pub fn permitted(s: &UnixStream) -> Result<(), u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the length given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if r == 0 && (cred.uid == 0 || cred.uid == me) {
        Ok(())
    } else {
        Err(cred.uid)
    }
}

/// Answers a client that may not use the socket with a PERMISSION error, at once: its
/// request is not read (so the answer's id is null), nothing runs.
fn refuse(s: UnixStream) {
    answer_at_once(
        s,
        RpcError {
            code: RpcError::PERMISSION,
            message: "permission denied: the control socket is for root and the user running \
                      the target"
                .into(),
        },
    );
}

/// Answers a connection with one error line, without reading from it, and closes it. On the
/// accepting thread: the line goes into a new connection's empty buffer at once (and is given
/// up after a moment if not). A client still writing its request finds the connection closed
/// and can read the answer (the blkwire CLI does).
fn answer_at_once(s: UnixStream, e: RpcError) {
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = (&s).write_all(&line(&error_reply(Value::Null, e)));
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Answers one client's requests, one per line, until it hangs up.
pub(crate) fn client(s: UnixStream, shared: &Arc<Shared>) {
    let fd = s.as_raw_fd();
    serve_lines(s, IDLE, REPLY_WAIT, |req| {
        answer(req, shared, &|| hung_up(fd))
    });
}

/// True once the peer of `fd` (a connected Unix stream socket we hold open) closed its end
/// altogether: POLLHUP, which a caller that only shut down its sending side (and still waits
/// for its answer) does not cause.
fn hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: polls one descriptor the caller keeps open, with a pollfd on our stack; no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLHUP != 0
}

/// Writes all of `bytes` within `wait`, however slowly the client reads them.
fn write_within(out: &mut Bounded<UnixStream>, bytes: &[u8], wait: Duration) -> bool {
    out.deadline = Instant::now() + wait;
    out.write_all(bytes).is_ok()
}

/// Reads request lines from `s` (each whole within `idle` of when it was waited for) and
/// writes what `answer` makes of each (each reply taken within `reply_wait`), until the client
/// hangs up or misses a deadline. A line longer than `MAX_REQUEST` is answered with an error
/// (its rest read and dropped, not kept), and a reply longer than `MAX_REPLY` is replaced by
/// one; the connection goes on.
fn serve_lines(
    s: UnixStream,
    idle: Duration,
    reply_wait: Duration,
    answer: impl Fn(&[u8]) -> Option<Value>,
) {
    // Each request line must be whole, and each reply taken, by its deadline (`Bounded`).
    let Ok(out) = s.try_clone() else {
        return;
    };
    let mut out = Bounded {
        s: out,
        deadline: Instant::now(),
    };
    let mut input = BufReader::new(Bounded {
        s,
        deadline: Instant::now(),
    });
    let mut buf = Vec::new();
    loop {
        buf.clear();
        input.get_mut().deadline = Instant::now() + idle;
        // One byte more than allowed: a longer line is refused, not read to its end.
        match (&mut input)
            .take(MAX_REQUEST as u64 + 1)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        // The limit is the request's, its newline not counted.
        if buf.strip_suffix(b"\n").unwrap_or(&buf).len() > MAX_REQUEST {
            let e = RpcError {
                code: RpcError::INVALID_REQUEST,
                message: format!(
                    "request line longer than {} MiB, the most one may be (a large config: \
                     load_config with {{\"path\": FILE}})",
                    MAX_REQUEST >> 20
                ),
            };
            let reply = line(&error_reply(Value::Null, e));
            if !write_within(&mut out, &reply, reply_wait)
                || !skip_line(&mut input, buf.last() == Some(&b'\n'))
            {
                return;
            }
            continue;
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if let Some(reply) = answer(&buf) {
            let bytes = reply_line(&reply, MAX_REPLY);
            if !write_within(&mut out, &bytes, reply_wait) {
                return;
            }
        }
    }
}

/// One request line's answer (None for a notification, which has no id and gets none).
/// A call that expects an answer is not run if `caller_left` says, when its turn comes, that
/// nobody will read it (a notification, which gets no answer anyway, runs).
fn answer(request: &[u8], shared: &Arc<Shared>, caller_left: &dyn Fn() -> bool) -> Option<Value> {
    let (id, method, params) = match decode(request) {
        Ok(r) => r,
        Err((id, e)) => return Some(error_reply(id, e)),
    };
    let expects_answer = id.is_some();
    let result =
        control::dispatch_unless(shared, &method, params, &|| expects_answer && caller_left());
    let id = id?;
    Some(match result {
        Ok(r) => json!({ "jsonrpc": "2.0", "id": id, "result": r }),
        Err(e) => error_reply(id, e),
    })
}

/// A request: its id (None: a notification), method and parameters (Null if absent).
type Request = (Option<Value>, String, Value);

/// Decodes a JSON-RPC 2.0 request line; on error, the id to answer with and why.
pub fn decode(request: &[u8]) -> Result<Request, (Value, RpcError)> {
    let v: Value = serde_json::from_slice(request).map_err(|e| {
        (
            Value::Null,
            RpcError {
                code: RpcError::PARSE,
                message: format!("not JSON: {e}"),
            },
        )
    })?;
    let id = v.get("id").cloned();
    let invalid = |m: &str| {
        (
            id.clone().unwrap_or(Value::Null),
            RpcError {
                code: RpcError::INVALID_REQUEST,
                message: m.to_string(),
            },
        )
    };
    if v.get("jsonrpc") != Some(&json!("2.0")) {
        return Err(invalid(
            "not a JSON-RPC 2.0 request: expected {\"jsonrpc\": \"2.0\", \"id\": N, \"method\": \
             \"...\", \"params\": {...}}",
        ));
    }
    if id
        .as_ref()
        .is_some_and(|i| !(i.is_string() || i.is_number() || i.is_null()))
    {
        return Err(invalid("id must be a number, a string or null"));
    }
    let Some(method) = v.get("method").and_then(Value::as_str) else {
        return Err(invalid(
            "method must be a string (rpc_get_methods lists them)",
        ));
    };
    let params = v.get("params").cloned().unwrap_or(Value::Null);
    if !(params.is_object() || params.is_null()) {
        return Err((
            id.unwrap_or(Value::Null),
            RpcError {
                code: RpcError::INVALID_PARAMS,
                message: "params must be an object (named parameters)".into(),
            },
        ));
    }
    Ok((id, method.to_string(), params))
}

fn error_reply(id: Value, e: RpcError) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": e.code, "message": e.message } })
}

/// Reads and drops the rest of an over-long request line (`ended`: its newline was read
/// already): true once past its newline, false if the client hung up or sent `MAX_SKIP` bytes
/// without one.
fn skip_line(input: &mut impl BufRead, ended: bool) -> bool {
    if ended {
        return true;
    }
    let mut skipped = 0;
    while skipped < MAX_SKIP {
        let (n, found) = match input.fill_buf() {
            Ok([]) | Err(_) => return false,
            Ok(b) => match b.iter().position(|&c| c == b'\n') {
                Some(i) => (i + 1, true),
                None => (b.len(), false),
            },
        };
        input.consume(n);
        if found {
            return true;
        }
        skipped += n;
    }
    false
}

/// `reply` as a line of at most `max` bytes; a longer one is not built: the call is answered
/// with an error saying so instead (under the same id).
fn reply_line(reply: &Value, max: usize) -> Vec<u8> {
    /// Takes bytes up to its limit, then fails the serialization.
    struct Bounded(Vec<u8>, usize);
    impl Write for Bounded {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.0.len() + b.len() > self.1 {
                return Err(std::io::Error::other("reply over the limit"));
            }
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // The newline counts too.
    let mut b = Bounded(Vec::new(), max.saturating_sub(1));
    if serde_json::to_writer(&mut b, reply).is_ok() {
        b.0.push(b'\n');
        return b.0;
    }
    let e = RpcError {
        code: RpcError::REFUSED,
        message: format!(
            "the reply is longer than {} MiB, the most one may be: ask for less (stats: a \
             smaller limit)",
            max >> 20
        ),
    };
    line(&error_reply(
        reply.get("id").cloned().unwrap_or(Value::Null),
        e,
    ))
}

fn line(v: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that sends requests and never reads the replies is let go once a reply has
    /// waited `reply_wait`: it cannot hold its thread (one of `MAX_CLIENTS`) for ever.
    #[test]
    fn a_client_that_never_reads_is_let_go() {
        let (server, mut client) = UnixStream::pair().unwrap();
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let big = json!("x".repeat(64 << 10));
            serve_lines(server, IDLE, Duration::from_millis(200), |_| {
                Some(big.clone())
            });
            let _ = done.send(());
        });
        // Each line draws 64 KiB that nobody reads: the socket's buffer fills at once.
        let request = b"{}\n".repeat(256);
        let _ = client.set_write_timeout(Some(Duration::from_secs(10)));
        let _ = client.write_all(&request);
        ended
            .recv_timeout(Duration::from_secs(20))
            .expect("the server side ended");
    }

    /// A client that trickles its request, a byte now and then, is let go at the line's
    /// deadline, not kept while each byte comes within it; so is one that takes its reply a
    /// little at a time.
    #[test]
    fn a_client_that_trickles_is_let_go_at_the_deadline() {
        let (server, mut client) = UnixStream::pair().unwrap();
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            serve_lines(server, Duration::from_millis(500), REPLY_WAIT, |_| None);
            let _ = done.send(());
        });
        // A byte every 100 ms, never a newline: within any per-read timeout of 500 ms.
        let trickled = std::thread::spawn(move || {
            for _ in 0..100 {
                if client.write_all(b"x").is_err() {
                    return true;
                }
                if ended.recv_timeout(Duration::from_millis(100)).is_ok() {
                    return true;
                }
            }
            false
        });
        assert!(
            trickled.join().unwrap(),
            "still served after 100 trickled bytes (10 s)"
        );

        // A reply taken a few bytes at a time, each read within a per-write timeout.
        let (server, mut client) = UnixStream::pair().unwrap();
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let big = json!("x".repeat(1 << 20));
            serve_lines(server, IDLE, Duration::from_millis(500), |_| {
                Some(big.clone())
            });
            let _ = done.send(());
        });
        client.write_all(b"{}\n").unwrap();
        // 64 KiB every 200 ms: a socket buffer's worth at a time, within any per-write
        // timeout of 500 ms, 320 KiB/s: the 1 MiB reply would take 3 s.
        let mut sip = vec![0u8; 64 << 10];
        let mut cut = false;
        for _ in 0..100 {
            if ended.recv_timeout(Duration::from_millis(200)).is_ok() {
                cut = true;
                break;
            }
            let _ = client.read(&mut sip);
        }
        assert!(cut, "a slow reader still served after 10 s");
    }

    /// A client's thread gives its place back however it ends, a panic included: panics
    /// cannot use up the MAX_CLIENTS places and lock everyone out.
    #[test]
    fn a_place_is_given_back_also_by_a_thread_that_panics() {
        let count = Arc::new(AtomicUsize::new(0));
        for _ in 0..MAX_CLIENTS * 2 {
            let place = Place::take(&count).expect("a place is free");
            let t = std::thread::spawn(move || {
                let _place = place;
                panic!("a call panicked (as this test wants)");
            });
            assert!(t.join().is_err());
        }
        assert_eq!(count.load(Ordering::Relaxed), 0);
        let held: Vec<_> = (0..MAX_CLIENTS).map(|_| Place::take(&count)).collect();
        assert!(held.iter().all(Option::is_some));
        assert!(Place::take(&count).is_none(), "all places taken");
        drop(held);
        assert!(Place::take(&count).is_some());
    }

    /// Reads one reply line from `r`.
    fn reply(r: &mut impl BufRead) -> Value {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
    }

    /// A request line longer than MAX_REQUEST is answered with an error that says what limit it
    /// hit, its rest dropped as it comes (never held), and the connection goes on: the next
    /// request is answered. A reply longer than MAX_REPLY is not sent: its call gets an error
    /// under its id, and the connection goes on.
    #[test]
    fn over_long_requests_and_replies_get_an_error_and_the_connection_goes_on() {
        let (server, client) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            serve_lines(server, IDLE, REPLY_WAIT, |req| {
                let (id, method, _) = decode(req).map_err(|(_, e)| e.message).unwrap();
                let result = match method.as_str() {
                    "huge" => json!("x".repeat(MAX_REPLY)),
                    _ => json!(method),
                };
                Some(json!({ "jsonrpc": "2.0", "id": id, "result": result }))
            });
        });
        let _ = client.set_read_timeout(Some(Duration::from_secs(20)));
        let mut writer = client.try_clone().unwrap();
        let sent = std::thread::spawn(move || {
            // 20 MiB in one line, in pieces, then requests that fit.
            writer.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":""#)?;
            for _ in 0..20 {
                writer.write_all(&[b'a'; 1 << 20])?;
            }
            writer.write_all(b"\"}}\n")?;
            writer.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"small\"}\n")?;
            writer.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"huge\"}\n")?;
            writer.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"after\"}\n")
        });
        let mut r = BufReader::new(client);
        let e = reply(&mut r);
        assert_eq!(e["error"]["code"], RpcError::INVALID_REQUEST, "{e}");
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains("longer than 1 MiB"), "{m}");
        assert_eq!(reply(&mut r)["result"], "small", "the connection went on");
        let e = reply(&mut r);
        assert_eq!(
            (&e["id"], &e["error"]["code"]),
            (&json!(3), &json!(RpcError::REFUSED))
        );
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains("longer than 16 MiB"), "{m}");
        assert_eq!(reply(&mut r)["result"], "after");
        sent.join().unwrap().unwrap();
    }

    /// A reply of exactly MAX_REPLY bytes, newline included, goes out; one byte more does not.
    #[test]
    fn the_reply_limit_counts_the_whole_line() {
        let v = json!({"id": 1, "result": "x".repeat(100)});
        let n = line(&v).len();
        assert_eq!(reply_line(&v, n), line(&v));
        let e: Value = serde_json::from_slice(&reply_line(&v, n - 1)).unwrap();
        assert_eq!(
            (&e["id"], &e["error"]["code"]),
            (&json!(1), &json!(RpcError::REFUSED))
        );
    }

    #[test]
    fn requests_are_checked_before_anything_runs() {
        let ok = decode(br#"{"jsonrpc":"2.0","id":7,"method":"export_list"}"#).unwrap();
        assert_eq!(ok, (Some(json!(7)), "export_list".into(), Value::Null));
        let note = decode(br#"{"jsonrpc":"2.0","method":"x","params":{"a":1}}"#).unwrap();
        assert_eq!(note.0, None, "no id: a notification");
        let cases: &[(&[u8], i32)] = &[
            (b"{not json", RpcError::PARSE),
            (br#"{"id":1,"method":"x"}"#, RpcError::INVALID_REQUEST),
            (
                br#"{"jsonrpc":"1.0","id":1,"method":"x"}"#,
                RpcError::INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":5}"#,
                RpcError::INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","id":[1],"method":"x"}"#,
                RpcError::INVALID_REQUEST,
            ),
            (
                br#"{"jsonrpc":"2.0","id":1,"method":"x","params":[1]}"#,
                RpcError::INVALID_PARAMS,
            ),
            (b"[]", RpcError::INVALID_REQUEST),
        ];
        for (req, code) in cases {
            let (_, e) = decode(req).unwrap_err();
            assert_eq!(e.code, *code, "{}", String::from_utf8_lossy(req));
        }
        let (id, _) = decode(br#"{"jsonrpc":"2.0","id":"a","method":5}"#).unwrap_err();
        assert_eq!(
            id,
            json!("a"),
            "errors answer the request's id when it has one"
        );
    }
}
