//! The client of a target's control socket (docs/MANAGEMENT.md): JSON-RPC 2.0 over the Unix
//! stream socket `blkwire serve --rpc-socket` opens, one request and one response per line; and
//! `blkwire rpc`, which sends any call.

use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

/// Where `serve` opens its control socket unless told otherwise (`--rpc-socket`).
pub const DEFAULT_SOCKET: &str = "/run/blkwire/blkwire.sock";

/// The longest response read, so a confused peer cannot make the CLI buffer without end; far
/// above any real answer (a `stats` page or the `save_config` of thousands of exports).
const MAX_RESPONSE: u64 = 64 << 20;

/// How long a call may take: generous, since `load_config` or `export_add` may open, create or
/// allocate many backends before it answers.
const TIMEOUT: Duration = Duration::from_secs(120);

/// `--socket`, shared by every command that talks to the control socket.
#[derive(clap::Args)]
pub struct Socket {
    /// The target's control socket (`serve --rpc-socket`); only root or the user running
    /// `blkwire serve` may use it
    #[arg(
        long = "socket",
        value_name = "PATH",
        env = "BLKWIRE_RPC_SOCKET",
        default_value = DEFAULT_SOCKET
    )]
    pub path: PathBuf,
}

impl Socket {
    /// [`call`] on this socket.
    pub fn call(&self, method: &str, params: Option<Value>) -> Result<Value, String> {
        call(&self.path, method, params)
    }
}

/// Sends one call and returns its result; a JSON-RPC error comes back as the target's message,
/// and every other failure as one line that says what to do.
pub fn call(socket: &Path, method: &str, params: Option<Value>) -> Result<Value, String> {
    let stream = UnixStream::connect(socket).map_err(|e| connect_error(socket, &e))?;
    // Whoever listens there gets the call (a config, key file paths) and is believed: only a
    // target run by root or by this user, as the target takes calls only from those.
    if let Err(uid) = blkwire_server::control_peer_permitted(&stream) {
        let who = match uid {
            u32::MAX => "a process whose credentials cannot be read".to_string(),
            uid => format!("a process of uid {uid}, neither root nor this user"),
        };
        return Err(format!(
            "{} is served by {who}: nothing was sent (a target run by another user is managed \
             as that user, e.g. `sudo -u USER blkwire ...`)",
            socket.display()
        ));
    }
    let mut request = json!({"jsonrpc": "2.0", "id": 1, "method": method});
    if let Some(p) = params {
        request["params"] = p;
    }
    let mut line = request.to_string();
    line.push('\n');
    let closed = || {
        format!(
            "{} closed the connection without answering: only root or the user running \
             `blkwire serve` may use it (else see serve's log)",
            socket.display()
        )
    };
    let timed_out = || {
        format!(
            "no answer on {} within {} s: is `blkwire serve` stuck? (a call still waiting for \
             its turn will not run; one already running may still finish: look before retrying)",
            socket.display(),
            TIMEOUT.as_secs()
        )
    };
    stream
        .set_write_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_read_timeout(Some(TIMEOUT)))
        .map_err(|e| format!("{}: {e}", socket.display()))?;
    match send_all(&stream, line.as_bytes()) {
        Ok(()) => {}
        // Closed before the request was all sent: the target may have answered first (it
        // answers a caller it refuses at once, without reading), so the answer is read still.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ) => {}
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(timed_out())
        }
        Err(e) => return Err(format!("cannot send to {}: {e}", socket.display())),
    }
    let mut response = Vec::new();
    BufReader::new(&stream)
        .take(MAX_RESPONSE + 1)
        .read_until(b'\n', &mut response)
        .map_err(|e| match e.kind() {
            io::ErrorKind::ConnectionReset => closed(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timed_out(),
            _ => format!("cannot read from {}: {e}", socket.display()),
        })?;
    if response.is_empty() {
        return Err(closed());
    }
    if response.last() != Some(&b'\n') {
        return Err(if response.len() as u64 > MAX_RESPONSE {
            format!(
                "the answer on {} is longer than {} MiB: not a blkwire control socket?",
                socket.display(),
                MAX_RESPONSE >> 20
            )
        } else {
            format!(
                "{} closed the connection in the middle of its answer (see serve's log)",
                socket.display()
            )
        });
    }
    let malformed = |why: String| {
        format!(
            "malformed answer on {} ({why}): not a blkwire control socket?",
            socket.display()
        )
    };
    let mut v: Value =
        serde_json::from_slice(&response).map_err(|e| malformed(format!("not JSON: {e}")))?;
    if let Some(err) = v.get("error") {
        return Err(match err["message"].as_str() {
            // The contract says one line; a server that breaks it still gets a one-line error.
            Some(m) if !m.trim().is_empty() => m.split_whitespace().collect::<Vec<_>>().join(" "),
            _ => malformed(format!("an error without a message: {err}")),
        });
    }
    match v.get_mut("result") {
        Some(result) => Ok(result.take()),
        None => Err(malformed("neither a result nor an error".into())),
    }
}

/// Writes all of `buf` with MSG_NOSIGNAL: commands that print reset SIGPIPE to its default (see
/// main), and a target that closes the connection must be an error, not a silent death.
fn send_all(stream: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: the pointer and length describe `buf`, which outlives the call; the
        // descriptor is the stream's, open for as long as `stream` is borrowed.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Why the control socket could not be reached, and what to do about it.
fn connect_error(socket: &Path, e: &io::Error) -> String {
    let path = socket.display();
    match e.raw_os_error() {
        Some(libc::ENOENT) => format!(
            "no control socket at {path}: is `blkwire serve` running? (its --rpc-socket; or pass \
             --socket PATH)"
        ),
        Some(libc::EACCES | libc::EPERM) => format!(
            "permission denied on {path}: the control socket is for root or the user running \
             serve"
        ),
        Some(libc::ECONNREFUSED) => format!("nothing is serving {path} (a stale socket?)"),
        _ => format!("cannot connect to the control socket {path}: {e}"),
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// The method, e.g. export_list (`blkwire rpc rpc_get_methods` lists them)
    #[arg(value_name = "METHOD")]
    method: String,
    /// The call's parameters: a JSON object, e.g. '{"name":"disk0","spec":"mem:1G"}'
    #[arg(value_name = "JSON-PARAMS")]
    params: Option<String>,
    #[command(flatten)]
    socket: Socket,
}

pub fn run(a: Args) -> Result<(), String> {
    let params = a.params.as_deref().map(parse_params).transpose()?;
    let result = a.socket.call(&a.method, params)?;
    // What a peer sent (a host id) may be in it: escaped for the terminal.
    println!("{}", crate::table::pretty_json_for_terminal(&result));
    Ok(())
}

/// JSON-PARAMS as the call's `params`, checked before connecting: the target takes one JSON
/// object (docs/MANAGEMENT.md), and a typo is best reported with where it is.
fn parse_params(s: &str) -> Result<Value, String> {
    let v: Value = serde_json::from_str(s).map_err(|e| format!("JSON-PARAMS is not JSON: {e}"))?;
    if v.is_object() {
        Ok(v)
    } else {
        Err(format!(
            "JSON-PARAMS must be a JSON object such as '{{\"name\":\"disk0\"}}', not {v}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixListener;
    use std::thread::JoinHandle;

    use super::*;

    /// A directory for one test's socket, removed when the test ends.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            let d = std::env::temp_dir().join(format!("blkwire-rpc-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
        fn socket(&self) -> PathBuf {
            self.0.join("ctl.sock")
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A fake target on `dir`'s socket: takes one connection, reads the request line, writes
    /// `reply` and closes; the thread returns the request it read.
    fn fake_target(dir: &Dir, reply: Vec<u8>) -> JoinHandle<String> {
        let listener = UnixListener::bind(dir.socket()).unwrap();
        std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut request = String::new();
            BufReader::new(&conn).read_line(&mut request).unwrap();
            // The client may stop reading an oversize reply; that ends this write early.
            let _ = (&conn).write_all(&reply);
            request
        })
    }

    #[test]
    fn a_result_comes_back_and_the_request_is_one_json_rpc_line() {
        let d = Dir::new("result");
        let target = fake_target(
            &d,
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"url\":\"tcp://127.0.0.1:40123\"}}\n"
                .to_vec(),
        );
        let r = call(
            &d.socket(),
            "listener_add",
            Some(json!({"url": "tcp://127.0.0.1:0"})),
        );
        assert_eq!(r, Ok(json!({"url": "tcp://127.0.0.1:40123"})));
        let request = target.join().unwrap();
        assert!(request.ends_with('\n'), "{request:?}");
        assert_eq!(request.matches('\n').count(), 1, "{request:?}");
        let v: Value = serde_json::from_str(&request).unwrap();
        assert_eq!(
            v,
            json!({"jsonrpc": "2.0", "id": 1, "method": "listener_add",
                   "params": {"url": "tcp://127.0.0.1:0"}})
        );
    }

    #[test]
    fn a_call_without_params_sends_none() {
        let d = Dir::new("noparams");
        let target = fake_target(
            &d,
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":[]}\n".to_vec(),
        );
        assert_eq!(call(&d.socket(), "export_list", None), Ok(json!([])));
        let v: Value = serde_json::from_str(&target.join().unwrap()).unwrap();
        assert_eq!(v.get("params"), None, "{v}");
    }

    #[test]
    fn an_error_is_the_targets_message_on_one_line() {
        let d = Dir::new("error");
        let _target = fake_target(
            &d,
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32000,\"message\":\"export disk0 has 2 sessions: --force closes them\"}}\n".to_vec(),
        );
        let r = call(&d.socket(), "export_remove", Some(json!({"name": "disk0"})));
        assert_eq!(
            r,
            Err("export disk0 has 2 sessions: --force closes them".into())
        );
        let d = Dir::new("error2");
        let _target = fake_target(
            &d,
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32602,\"message\":\"bad spec\\n  mem:1Q\"}}\n".to_vec(),
        );
        assert_eq!(
            call(&d.socket(), "export_add", None),
            Err("bad spec mem:1Q".into())
        );
    }

    #[test]
    fn a_malformed_answer_is_an_error_naming_the_socket() {
        for (tag, reply) in [
            ("notjson", &b"HTTP/1.1 400 Bad Request\n"[..]),
            ("neither", &b"{\"jsonrpc\":\"2.0\",\"id\":1}\n"[..]),
            (
                "nomessage",
                &b"{\"jsonrpc\":\"2.0\",\"id\":1,\"error\":{\"code\":-32000}}\n"[..],
            ),
        ] {
            let d = Dir::new(tag);
            let _target = fake_target(&d, reply.to_vec());
            let e = call(&d.socket(), "export_list", None).unwrap_err();
            assert!(e.starts_with("malformed answer on "), "{tag}: {e}");
            assert!(e.contains(&*d.socket().to_string_lossy()), "{tag}: {e}");
        }
    }

    #[test]
    fn a_target_that_closes_without_answering_is_an_error() {
        let d = Dir::new("closed");
        let _target = fake_target(&d, Vec::new());
        let e = call(&d.socket(), "export_list", None).unwrap_err();
        assert!(e.contains("closed the connection without answering"), "{e}");
        assert!(e.contains("root or the user running"), "{e}");
        // Closed half way through a line.
        let d = Dir::new("halfway");
        let _target = fake_target(&d, b"{\"jsonrpc\":\"2.0\",\"id\":1,\"res".to_vec());
        let e = call(&d.socket(), "export_list", None).unwrap_err();
        assert!(e.contains("in the middle of its answer"), "{e}");
        // Closed before even reading the request, as a target refusing the peer may do.
        let d = Dir::new("refused");
        let listener = UnixListener::bind(d.socket()).unwrap();
        let target = std::thread::spawn(move || drop(listener.accept().unwrap()));
        let e = call(&d.socket(), "export_list", None).unwrap_err();
        target.join().unwrap();
        assert!(e.contains("closed the connection without answering"), "{e}");
    }

    /// A target that answers without reading the request (as it answers a caller it refuses)
    /// and closes: the client's send fails, and the answer is read all the same. The request
    /// is larger than the socket's buffer, so the send cannot complete before the close.
    #[test]
    fn an_answer_sent_before_the_request_was_read_is_read() {
        let d = Dir::new("early");
        let listener = UnixListener::bind(d.socket()).unwrap();
        let target = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            (&conn)
                .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32001,\"message\":\"permission denied\"}}\n")
                .unwrap();
            conn.shutdown(std::net::Shutdown::Both).unwrap();
        });
        let big = json!({"config": "x".repeat(4 << 20)});
        let r = call(&d.socket(), "load_config", Some(big));
        target.join().unwrap();
        assert_eq!(r, Err("permission denied".into()));
    }

    #[test]
    fn an_oversize_answer_is_refused() {
        let d = Dir::new("oversize");
        // One byte past the cap and no newline: the client must stop, not keep buffering.
        let _target = fake_target(&d, vec![b' '; MAX_RESPONSE as usize + 1]);
        let e = call(&d.socket(), "stats", None).unwrap_err();
        assert!(e.contains("longer than 64 MiB"), "{e}");
    }

    #[test]
    fn a_missing_socket_names_the_path_and_serve() {
        let d = Dir::new("missing");
        let e = call(&d.socket(), "export_list", None).unwrap_err();
        assert!(e.contains(&*d.socket().to_string_lossy()), "{e}");
        assert!(e.contains("`blkwire serve`"), "{e}");
        assert!(e.contains("--socket"), "{e}");
    }

    #[test]
    fn a_socket_nobody_serves_is_called_stale() {
        let d = Dir::new("stale");
        // The file stays when the listener goes, as it does when serve is killed.
        drop(UnixListener::bind(d.socket()).unwrap());
        let e = call(&d.socket(), "export_list", None).unwrap_err();
        assert_eq!(
            e,
            format!(
                "nothing is serving {} (a stale socket?)",
                d.socket().display()
            )
        );
    }

    #[test]
    fn permission_errors_say_who_may_connect() {
        // Tests often run as root, whom a mode-0600 socket does not stop: the mapping is
        // checked on the error itself.
        for errno in [libc::EACCES, libc::EPERM] {
            let e = connect_error(
                Path::new("/run/x.sock"),
                &io::Error::from_raw_os_error(errno),
            );
            assert_eq!(
                e,
                "permission denied on /run/x.sock: the control socket is for root or the \
                 user running serve"
            );
        }
    }

    #[test]
    fn params_must_be_json_objects() {
        assert_eq!(parse_params(r#"{"name":"a"}"#), Ok(json!({"name": "a"})));
        // The target refuses anything else (an array too): said before connecting.
        let e = parse_params("[1]").unwrap_err();
        assert!(e.contains("must be a JSON object"), "{e}");
        let e = parse_params(r#"{"name":}"#).unwrap_err();
        assert!(e.contains("line 1 column 9"), "{e}");
        let e = parse_params("5").unwrap_err();
        assert!(e.contains("not 5"), "{e}");
    }
}
