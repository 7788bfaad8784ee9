//! The management commands (`rpc`, `export`, `listener`, `session`, `save-config`,
//! `load-config`) as a user runs them, where no target is needed: what they check before
//! connecting, what they say when no control socket answers, and their --help. The commands
//! against a running target are tested in manage.rs; the client's handling of answers
//! (results, errors, malformed, oversize, closed) against a fake server in crates/cli/src/rpc.rs.

mod common;

use std::process::Command;

use common::{assert_one_line_error, cli, TempDir, BIN};

/// Runs `blkwire` with `BLKWIRE_RPC_SOCKET` set to `socket` (or removed); returns (exit
/// success, stdout, stderr).
fn cli_with_env_socket(args: &[&str], socket: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    match socket {
        Some(s) => cmd.env("BLKWIRE_RPC_SOCKET", s),
        None => cmd.env_remove("BLKWIRE_RPC_SOCKET"),
    };
    let out = cmd.output().expect("run blkwire");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_json_params_are_refused_before_connecting() {
    let d = TempDir::new("rpc-params");
    let socket = d.path("nobody.sock");
    let socket = socket.to_str().unwrap();
    assert_one_line_error(
        &["rpc", "export_add", r#"{"name":}"#, "--socket", socket],
        "JSON-PARAMS is not JSON: expected value at line 1 column 9",
    );
    assert_one_line_error(
        &["rpc", "export_add", "7", "--socket", socket],
        "JSON-PARAMS must be a JSON object",
    );
    // The socket does not exist: had the command connected, it would have said so instead.
    let (_, _, err) = cli(&["rpc", "export_add", "{", "--socket", socket]);
    assert!(!err.contains("no control socket"), "{err}");
}

#[test]
fn a_missing_socket_is_one_line_that_names_it_and_serve() {
    let d = TempDir::new("rpc-missing");
    let socket = d.path("nobody.sock");
    let socket = socket.to_str().unwrap();
    let expected = format!("no control socket at {socket}: is `blkwire serve` running?");
    for args in [
        &["rpc", "export_list"][..],
        &["rpc", "export_add", r#"{"name":"d","spec":"mem:1M"}"#],
        &["export", "add", "d", "mem:1M"],
        &["export", "rm", "d", "--force"],
        &["export", "ls"],
        &["export", "allow", "d", "--none"],
        &["listener", "add", "tcp://127.0.0.1:0"],
        &["listener", "rm", "tcp://127.0.0.1:7700"],
        &["listener", "ls", "--json"],
        &["session", "ls"],
        &["session", "close", "7"],
        &["save-config"],
    ] {
        let mut args = args.to_vec();
        args.extend(["--socket", socket]);
        assert_one_line_error(&args, &expected);
    }
}

#[test]
fn the_socket_comes_from_the_environment_unless_given() {
    let d = TempDir::new("rpc-env");
    let from_env = d.path("env.sock");
    let from_env = from_env.to_str().unwrap();
    let (ok, _, err) = cli_with_env_socket(&["export", "ls"], Some(from_env));
    assert!(!ok);
    assert!(
        err.contains(&format!("no control socket at {from_env}:")),
        "{err}"
    );
    let given = d.path("given.sock");
    let given = given.to_str().unwrap();
    let (ok, _, err) = cli_with_env_socket(&["export", "ls", "--socket", given], Some(from_env));
    assert!(!ok);
    assert!(
        err.contains(&format!("no control socket at {given}:")),
        "{err}"
    );
}

#[test]
fn a_socket_nobody_serves_is_called_stale() {
    let d = TempDir::new("rpc-stale");
    let socket = d.path("stale.sock");
    // The file stays when its listener goes, as when serve is killed.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert_one_line_error(
        &["session", "ls", "--socket", socket.to_str().unwrap()],
        "(a stale socket?)",
    );
}

/// A thread writing `text` into the FIFO `fifo` for a reader to come.
struct FifoWriter {
    fifo: std::path::PathBuf,
    thread: std::thread::JoinHandle<()>,
    wrote: std::sync::mpsc::Receiver<()>,
}

fn fifo_writer(fifo: &std::path::Path, text: String) -> FifoWriter {
    let (tx, wrote) = std::sync::mpsc::channel();
    let path = fifo.to_path_buf();
    let thread = std::thread::spawn(move || {
        if std::fs::write(path, text).is_ok() {
            let _ = tx.send(());
        }
    });
    FifoWriter {
        fifo: fifo.to_path_buf(),
        thread,
        wrote,
    }
}

impl FifoWriter {
    /// Once the reader ran: fails if it never read all of it, and never hangs (a writer still
    /// waiting for a reader is let go).
    fn finish(self) {
        let wrote = self
            .wrote
            .recv_timeout(std::time::Duration::from_secs(10))
            .is_ok();
        if !wrote {
            use std::os::unix::fs::OpenOptionsExt;
            let _reader = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&self.fifo);
            drop(_reader);
        }
        self.thread.join().unwrap();
        assert!(wrote, "the CLI did not read all of {}", self.fifo.display());
    }
}

#[test]
fn load_config_checks_its_file_before_connecting() {
    let d = TempDir::new("rpc-load");
    let socket = d.path("nobody.sock");
    let socket = socket.to_str().unwrap();
    let bad = d.path("bad.json");
    std::fs::write(&bad, "[\n  {\"method\": \"export_add\",}\n]\n").unwrap();
    let bad = bad.to_str().unwrap();
    assert_one_line_error(
        &["load-config", bad, "--socket", socket],
        &format!("{bad} is not JSON: trailing comma at line 2 column 27"),
    );
    let object = d.path("object.json");
    std::fs::write(&object, r#"{"method": "export_list"}"#).unwrap();
    let object = object.to_str().unwrap();
    assert_one_line_error(
        &["load-config", object, "--socket", socket],
        &format!("{object} is not a config: one is a JSON array"),
    );
    let missing = d.path("missing.json");
    let missing = missing.to_str().unwrap();
    assert_one_line_error(
        &["load-config", missing, "--socket", socket],
        &format!("cannot read {missing}"),
    );
    // At most 20 MiB is read, of a file or of a device such as /dev/zero, which never ends
    // (the CLI grew until memory ran out).
    let huge = d.path("huge.json");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(blkwire_server::MAX_CONFIG_FILE + 1)
        .unwrap();
    for file in ["/dev/zero", huge.to_str().unwrap()] {
        assert_one_line_error(
            &["load-config", file, "--socket", socket],
            &format!("cannot read {file}: larger than 20 MiB"),
        );
    }
    // A pipe (`load-config <(...)`) is read like a file; a config written indented (by hand,
    // or as `save-config` once wrote) is measured as it is sent (compact), so one over 1 MiB
    // as written still goes inline.
    let fifo = d.path("fifo.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let calls = |n: usize| vec![serde_json::json!({"method": "export_list", "params": {}}); n];
    let indented = serde_json::to_string_pretty(&calls(25_000)).unwrap();
    assert!(indented.len() > 1 << 20);
    // One over a request line (1 MiB) however written goes to the target by its path, which
    // a pipe has not.
    let big = serde_json::to_string(&calls(40_000)).unwrap();
    assert!(big.len() > 1 << 20);
    for (text, said) in [
        ("[]".to_string(), "no control socket at"),
        (indented, "no control socket at"),
        (big, "must be a regular file (not a pipe)"),
    ] {
        let wrote = fifo_writer(&fifo, text);
        assert_one_line_error(
            &["load-config", fifo.to_str().unwrap(), "--socket", socket],
            said,
        );
        wrote.finish();
    }
    // A good file gets as far as the socket.
    let good = d.path("good.json");
    std::fs::write(&good, "[]").unwrap();
    assert_one_line_error(
        &["load-config", good.to_str().unwrap(), "--socket", socket],
        "no control socket at",
    );
}

#[test]
fn export_allow_takes_rules_or_none() {
    assert_one_line_error(
        &["export", "allow", "disk0", "--socket", "/nonexistent.sock"],
        "export allow needs the RULES that replace disk0's (e.g. db1+10.0.0.0/8) or --none",
    );
    assert_one_line_error(
        &["export", "allow", "disk0", "db1", "--none"],
        "cannot be used with",
    );
    // Empty RULES (`export allow disk0 "$RULES"` with RULES unset) are not --none: refused
    // before connecting, as the control method refuses them.
    assert_one_line_error(
        &[
            "export",
            "allow",
            "disk0",
            "",
            "--socket",
            "/nonexistent.sock",
        ],
        "export allow got empty RULES for disk0 (an unset variable?): give the rules (e.g. \
         db1+10.0.0.0/8), or --none to remove them",
    );
}

#[test]
fn every_management_command_says_in_its_help_which_socket_and_who_may_use_it() {
    for cmd in [
        &["rpc"][..],
        &["export", "add"],
        &["export", "rm"],
        &["export", "ls"],
        &["export", "allow"],
        &["listener", "add"],
        &["listener", "rm"],
        &["listener", "ls"],
        &["session", "ls"],
        &["session", "close"],
        &["save-config"],
        &["load-config"],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let (ok, help, _) = cli_with_env_socket(&args, None);
        assert!(ok, "{args:?}");
        for needle in [
            "--socket <PATH>",
            "[default: /run/blkwire/blkwire.sock]",
            "BLKWIRE_RPC_SOCKET",
            "only root or the user running `blkwire serve`",
        ] {
            assert!(
                help.contains(needle),
                "{args:?}: '{needle}' not in:\n{help}"
            );
        }
    }
    for group in ["export", "listener", "session"] {
        let (ok, help, _) = cli_with_env_socket(&[group, "--help"], None);
        assert!(ok, "{group}");
        assert!(
            help.contains("/run/blkwire/blkwire.sock")
                && help.contains("only root or the user running serve"),
            "{group}:\n{help}"
        );
    }
    // save-config FILE writes on the client's side; the help says how to write on the target's.
    let (_, help, _) = cli(&["save-config", "--help"]);
    assert!(
        help.contains(r#"blkwire rpc save_config '{"path":"#),
        "{help}"
    );
}
