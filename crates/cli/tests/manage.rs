//! The management plane end to end (issue 14, docs/MANAGEMENT.md): a real `blkwire serve` with
//! a control socket, driven by the CLI (`blkwire rpc`, `export`, `listener`, `session`,
//! `save-config`), with real initiators (`bench`, `cp`, `info`) connected while it changes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use blkwire_client::{connect, ConnectOptions, Url};
use blkwire_wire::nbd::{cmd, err};
use blkwire_wire::{Header, HelloReply, Opcode, Status, Tag};
use common::native_raw::{hello, join_request, read_frame};
use common::nbd_raw::Raw;
use common::{cli, random_bytes, sparse_file, TempDir, BIN};
use serde_json::{json, Value};

/// A target with a control socket in its own directory.
struct Managed {
    child: Child,
    sock: String,
    /// The `listening` URLs it printed at start.
    urls: Vec<String>,
}

impl Managed {
    /// Starts `serve --rpc-socket DIR/ctl.sock ARGS` and waits for its `control` line (printed
    /// after every `listening` line).
    fn start(dir: &TempDir, args: &[&str]) -> Managed {
        let sock = dir.path("ctl.sock").to_str().unwrap().to_string();
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--rpc-socket", &sock, "--log-level", "warn"])
            .args(args);
        // Every `listening` line comes before the `control` one.
        let (child, urls) = common::spawn_serve_with_control(&mut cmd, 0);
        Managed { child, sock, urls }
    }

    /// `blkwire ARGS --socket SOCK`: (success, stdout, stderr).
    fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let mut a = args.to_vec();
        a.extend(["--socket", &self.sock]);
        cli(&a)
    }

    /// `blkwire ARGS --socket SOCK`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.cli(args);
        assert!(ok, "{args:?} failed: {err}");
        out
    }

    /// `blkwire rpc METHOD PARAMS`, which must succeed; its result.
    fn rpc(&self, method: &str, params: Value) -> Value {
        let p = params.to_string();
        serde_json::from_str(&self.ok(&["rpc", method, &p])).expect("rpc prints JSON")
    }

    /// `blkwire rpc METHOD PARAMS`, which must fail with one line containing `needle`.
    fn rpc_refused(&self, method: &str, params: Value, needle: &str) {
        let p = params.to_string();
        let (ok, out, err) = self.cli(&["rpc", method, &p]);
        assert!(!ok, "{method} {p} should fail, printed {out}");
        let lines: Vec<_> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{method} {p}: one error line, got: {err}");
        assert!(lines[0].starts_with("blkwire: error:"), "{err}");
        assert!(
            err.contains(needle),
            "{method} {p}: '{needle}' not in: {err}"
        );
    }

    /// Stops the target as an operator would (SIGTERM) and waits for it to exit.
    fn stop(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "serve exited with {status}");
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `bench` run in the background; `finish` waits for its JSON summary.
struct Bench(Child);

impl Bench {
    fn start(url: &str, secs: &str, extra: &[&str]) -> Bench {
        let child = Command::new(BIN)
            .args(["bench", url, "--runtime", secs, "--json", "--timeout", "5"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bench");
        Bench(child)
    }

    /// (exit success, the JSON summary if any, stderr).
    fn finish(self) -> (bool, Option<Value>, String) {
        let out = self.0.wait_with_output().unwrap();
        let json = serde_json::from_slice(&out.stdout).ok();
        (
            out.status.success(),
            json,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// Waits until the target lists `n` sessions (the benches have connected).
fn wait_for_sessions(t: &Managed, n: usize) -> Vec<Value> {
    wait_for_session_count(t, |live| live >= n, &format!("at least {n}"))
}

/// Waits until the target lists no session (a client that disconnected is gone: a session
/// ends when its reactor sees the connection close, a moment after the client exits).
fn wait_for_no_sessions(t: &Managed) {
    wait_for_session_count(t, |live| live == 0, "no");
}

fn wait_for_session_count(t: &Managed, done: impl Fn(usize) -> bool, want: &str) -> Vec<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let list = t.rpc("session_list", json!({}));
        let live: Vec<Value> = list.as_array().unwrap().clone();
        if done(live.len()) {
            return live;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "expected {want} sessions, have {list}"
        );
        std::thread::sleep(Duration::from_millis(20)); // polling a listing, not a sync point
    }
}

#[test]
fn a_target_built_by_calls_alone_comes_back_the_same_from_its_saved_config() {
    let dir = TempDir::new("manage-roundtrip");
    let empty = dir.path("empty.json");
    std::fs::write(&empty, "[]").unwrap();
    // Nothing to serve and nowhere to listen: only the control socket.
    let t = Managed::start(&dir, &["--config", empty.to_str().unwrap()]);
    assert!(t.urls.is_empty(), "{:?}", t.urls);
    assert_eq!(t.ok(&["export", "ls", "--json"]).trim(), "[]");
    t.ok(&["export", "add", "disk0", "mem:16M"]);
    t.ok(&["export", "add", "ro0", "mem:8M,ro,allow=127.0.0.0/8"]);
    t.ok(&["export", "add", "scratch", "null:1G"]);
    t.ok(&["export", "rm", "scratch"]);
    let tcp = t.ok(&["listener", "add", "tcp://127.0.0.1:0"]);
    let tcp = tcp.split_whitespace().last().unwrap().to_string();
    assert!(tcp.starts_with("tcp://127.0.0.1:"), "{tcp}");
    t.ok(&["listener", "add", "nbd://127.0.0.1:0"]);
    let m = t.rpc("metrics_listen", json!({"addr": "127.0.0.1:0"}));
    let metrics = m["url"].as_str().unwrap().to_string();
    t.rpc_refused(
        "metrics_listen",
        json!({"addr": "127.0.0.1:0"}),
        "metrics are served already",
    );
    // The target built by calls serves.
    let (ok, out, err) = cli(&["info", &format!("{tcp}/disk0")]);
    assert!(ok && out.contains("16"), "{out}{err}");
    wait_for_no_sessions(&t);
    let exports = t.ok(&["export", "ls", "--json"]);
    let listeners = t.ok(&["listener", "ls", "--json"]);
    let saved = dir.path("saved.json");
    t.ok(&["save-config", saved.to_str().unwrap()]);
    // The RPC's own path writes on the target's side.
    let remote = dir.path("remote.json");
    t.rpc("save_config", json!({ "path": remote }));
    assert_eq!(
        std::fs::read_to_string(&remote)
            .map(|s| serde_json::from_str::<Value>(&s).unwrap())
            .unwrap(),
        serde_json::from_str::<Value>(&std::fs::read_to_string(&saved).unwrap()).unwrap()
    );
    for written in [&remote, &saved] {
        assert_eq!(
            std::fs::metadata(written).unwrap().permissions().mode() & 0o777,
            0o600,
            "{}: a config names key files and devices: owner only",
            written.display()
        );
    }
    t.stop();
    assert!(
        !dir.path("ctl.sock").exists(),
        "the control socket is removed on stop"
    );
    let back = Managed::start(&dir, &["--config", saved.to_str().unwrap()]);
    assert_eq!(back.ok(&["export", "ls", "--json"]), exports);
    assert_eq!(back.ok(&["listener", "ls", "--json"]), listeners);
    assert_eq!(back.urls.len(), 2, "{:?}", back.urls);
    let (ok, _, err) = cli(&["info", &format!("{tcp}/ro0")]);
    assert!(
        ok,
        "the restarted target serves at the saved address: {err}"
    );
    let out = Command::new("curl")
        .args(["-sf", &metrics])
        .output()
        .expect("curl is missing: apt-get install curl (scripts/deps.sh does)");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("blkwire_sessions"),
        "metrics at the saved address {metrics}"
    );
    // And saving again gives the same config.
    let again = dir.path("again.json");
    back.ok(&["save-config", again.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(&again).unwrap(),
        std::fs::read_to_string(&saved).unwrap()
    );
}

/// Relative paths name what the user meant wherever the target runs and wherever its saved
/// config is read again: `export add` with a relative `file:` path from a directory other
/// than the target's opens the file in the user's, and the config names it absolutely.
#[test]
fn relative_paths_are_the_callers_and_saved_absolute() {
    let dir = TempDir::new("relative-paths");
    let t = Managed::start(&dir, &[]);
    let work = dir.path("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("d.img"), vec![0u8; 1 << 20]).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.current_dir(&work)
        .args(["export", "add", "d", "file:d.img", "--socket", &t.sock]);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = t.rpc("save_config", json!({})).to_string();
    let want = format!("file:{}", work.join("d.img").display());
    assert!(config.contains(&want), "{config}");
}

#[test]
fn every_method_takes_good_parameters_and_refuses_bad_ones_in_one_line() {
    let dir = TempDir::new("manage-methods");
    let t = Managed::start(
        &dir,
        &["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:4M"],
    );
    let methods = t.rpc("rpc_get_methods", json!({}));
    let names: Vec<&str> = methods
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    for m in [
        "export_add",
        "export_remove",
        "export_list",
        "export_set_allow",
        "export_resize",
        "listener_add",
        "listener_remove",
        "listener_list",
        "session_list",
        "session_close",
        "stats",
        "save_config",
        "load_config",
        "keys_load",
        "admins_set",
        "host_list",
        "metrics_listen",
        "target_options",
        "rpc_get_methods",
    ] {
        assert!(names.contains(&m), "{m} missing from {names:?}");
    }
    // Good parameters.
    let e = t.rpc("export_add", json!({"name": "b", "spec": "mem:2M,ro"}));
    assert_eq!(
        (e["size"].as_u64(), e["read_only"].as_bool()),
        (Some(2 << 20), Some(true))
    );
    let e = t.rpc(
        "export_set_allow",
        json!({"name": "b", "allow": "10.0.0.0/8"}),
    );
    assert_eq!(e["allow"], "10.0.0.0/8");
    let e = t.rpc("export_set_allow", json!({"name": "b", "allow": null}));
    assert_eq!(e["allow"], Value::Null);
    let u = t.rpc("listener_add", json!({"url": "udp://127.0.0.1:0"}));
    let udp = u["url"].as_str().unwrap().to_string();
    let (ok, _, err) = cli(&["info", &format!("{udp}/b")]);
    assert!(ok, "the new udp listener serves: {err}");
    t.rpc("listener_remove", json!({"url": udp}));
    let (ok, _, _) = cli(&["info", &format!("{udp}/b"), "--timeout", "1"]);
    assert!(!ok, "a removed udp listener no longer answers");
    let s = t.rpc("stats", json!({"offset": 0, "limit": 10}));
    assert_eq!(
        (s["total"].as_u64(), s["next"].clone()),
        (Some(0), Value::Null)
    );
    assert_eq!(t.rpc("session_list", json!({})), json!([]));
    assert_eq!(t.rpc("host_list", json!({})), json!([]));
    t.rpc("target_options", json!({}));
    // Without parameters too: the options as they are (it failed: "takes an object").
    t.ok(&["rpc", "target_options"]);
    let r = t.rpc(
        "load_config",
        json!({"config": [{"method": "export_add", "params": {"name": "c", "spec": "null:1M"}}]}),
    );
    assert_eq!(r["applied"], 1);
    t.rpc("export_remove", json!({"name": "c"}));
    // Bad parameters: each refused with one line that says what is wrong, nothing changed.
    let before = t.rpc("export_list", json!({}));
    let bad: &[(&str, Value, &str)] = &[
        ("export_add", json!({"name": "x"}), "missing field `spec`"),
        // A method that takes none refuses a parameter (a filter the caller thought applied).
        (
            "session_list",
            json!({"export": "a"}),
            "session_list: unknown field `export`",
        ),
        ("rpc_get_methods", json!({"x": 1}), "unknown field `x`"),
        (
            "export_add",
            json!({"name": "x", "spec": "disk:1G"}),
            "unknown backend 'disk'",
        ),
        (
            "export_add",
            json!({"name": "a", "spec": "mem:1M"}),
            "export 'a' exists already",
        ),
        (
            "export_add",
            json!({"name": "x", "spec": "mem:1M", "sz": 1}),
            "unknown field `sz`",
        ),
        (
            "export_add",
            json!({"name": "x", "spec": "mem:1M,allow=alice"}),
            "host id is only proven with a key",
        ),
        (
            "export_add",
            json!({"name": "x", "spec": "mem:1M,fast"}),
            "bad export option 'fast'",
        ),
        (
            "export_remove",
            json!({"name": "nope"}),
            "no export named 'nope'",
        ),
        (
            "export_set_allow",
            json!({"name": "a", "allow": "999.1.1.1/8"}),
            "export 'a'",
        ),
        // Left out, it is not null (which removes the rules and opens the export).
        (
            "export_set_allow",
            json!({"name": "a"}),
            "missing field `allow`",
        ),
        (
            "export_set_allow",
            json!({"name": "a", "allow": ""}),
            "export 'a': allow is empty: give the rules (RULE[+RULE...]), or null to remove them",
        ),
        (
            "listener_add",
            json!({"url": "tcpx://127.0.0.1:0"}),
            "bad listen address",
        ),
        (
            "listener_add",
            json!({"url": t.urls[0]}),
            "already listening",
        ),
        (
            "listener_remove",
            json!({"url": "tcp://127.0.0.1:9"}),
            "no listener",
        ),
        (
            "session_close",
            json!({"session": 12345}),
            "no session 12345",
        ),
        ("session_close", json!({"session": "x"}), "invalid type"),
        ("stats", json!({"limit": 0}), "limit must be at least 1"),
        (
            "keys_load",
            json!({"path": "/nonexistent/keys"}),
            "/nonexistent/keys",
        ),
        (
            "admins_set",
            json!({"hosts": ["alice"]}),
            "only proven with a key",
        ),
        (
            "target_options",
            json!({"threads": 77}),
            "fixed when the target starts",
        ),
        (
            "target_options",
            json!({"thread": 1}),
            "unknown option 'thread'",
        ),
        ("load_config", json!({}), "give either path"),
        // Read without a bound, /dev/zero would grow the target until it is killed.
        (
            "load_config",
            json!({"path": "/dev/zero"}),
            "cannot read /dev/zero: not a regular file (a FIFO, a device or a directory): give \
             a file's path",
        ),
        (
            "keys_load",
            json!({"path": "/dev/zero"}),
            "key file /dev/zero: not a regular file",
        ),
        (
            "load_config",
            json!({"config": [{"method": "save_config"}]}),
            "cannot load or save",
        ),
        (
            "load_config",
            json!({"config": [{"method": "export_add", "params": {"name": "y", "spec": "mem:1M"}}, {"method": "nope"}]}),
            "call 2 (nope)",
        ),
        ("no_such_method", json!({}), "no method 'no_such_method'"),
    ];
    for (method, params, needle) in bad {
        t.rpc_refused(method, params.clone(), needle);
    }
    // The load_config that failed at its second call applied its first (and said so).
    let mut after = t.rpc("export_list", json!({}));
    let y = after.as_array_mut().unwrap().pop().unwrap();
    assert_eq!(y["name"], "y");
    assert_eq!(after, before, "refused calls changed nothing");
}

#[test]
fn changes_under_running_io_do_not_disturb_it() {
    let dir = TempDir::new("manage-live");
    let t = Managed::start(
        &dir,
        &["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:64M"],
    );
    let url = format!("{}/a", t.urls[0]);
    // Requests the target answered on the bench's session so far.
    let answered = || -> u64 {
        let v = t.rpc("stats", json!({}));
        v["sessions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["export"] == "a")
            .flat_map(|s| s["queues"].as_array().into_iter().flatten())
            .map(|q| q["reads"].as_u64().unwrap_or(0) + q["writes"].as_u64().unwrap_or(0))
            .sum()
    };
    let mut bench = Bench::start(&url, "10", &["--rw", "randrw", "--iodepth", "8"]);
    let session = wait_for_sessions(&t, 1)[0]["session"].clone();
    // Every kind of change, over and over, while the I/O runs; the I/O goes on through each
    // round of them (as long as the bench runs: a slow machine may see it end first).
    let mut rounds = 0;
    for i in 0..25 {
        let before = answered();
        let name = format!("x{i}");
        t.rpc("export_add", json!({"name": name, "spec": "mem:1M"}));
        let l = t.rpc("listener_add", json!({"url": "tcp://127.0.0.1:0"}));
        t.rpc("export_list", json!({}));
        t.rpc("session_list", json!({}));
        t.rpc("stats", json!({}));
        t.rpc(
            "export_set_allow",
            json!({"name": name, "allow": "127.0.0.1/32"}),
        );
        t.rpc("save_config", json!({}));
        t.rpc("listener_remove", json!({"url": l["url"]}));
        t.rpc("export_remove", json!({"name": name}));
        let mut running = || bench.0.try_wait().unwrap().is_none();
        let went_on = common::wait_until(Duration::from_secs(30), || {
            answered() > before || !running()
        });
        if !running() {
            break;
        }
        assert!(went_on, "round {i}: the I/O stopped under the calls");
        let sessions = t.rpc("session_list", json!({}));
        assert!(
            sessions
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["session"] == session),
            "round {i}: the bench's session was closed: {sessions}"
        );
        rounds += 1;
    }
    assert!(
        rounds >= 3,
        "only {rounds} round(s) of calls ran under the I/O"
    );
    let (ok, json, err) = bench.finish();
    assert!(ok, "bench failed: {err}");
    let json = json.expect("bench --json summary");
    assert_eq!(json["errors"], 0, "no I/O errors: {json}");
    // Only the export the calls did not touch is left.
    let list = t.rpc("export_list", json!({}));
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
}

#[test]
fn removing_an_export_in_use_is_refused_unless_forced_and_forced_fails_only_its_io() {
    let dir = TempDir::new("manage-force");
    let t = Managed::start(
        &dir,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--listen",
            "udp://127.0.0.1:0",
            "--export",
            "a=mem:32M",
            "--export",
            "b=mem:32M",
        ],
    );
    // Over udp: its queues live in the reactors' datagram ports, not in connections.
    let doomed = Bench::start(&format!("{}/a", t.urls[1]), "30", &["--rw", "randwrite"]);
    let other = Bench::start(&format!("{}/b", t.urls[0]), "3", &["--rw", "randrw"]);
    wait_for_sessions(&t, 2);
    let (ok, _, err) = t.cli(&["export", "rm", "a"]);
    assert!(!ok, "an export in use is not removed without --force");
    assert!(
        err.contains("in use by 1 session") && err.lines().count() == 1,
        "{err}"
    );
    let out = t.ok(&["export", "rm", "a", "--force"]);
    assert!(
        out.contains("removed export a") && out.contains("1 session"),
        "{out}"
    );
    let (ok, _, err) = doomed.finish();
    assert!(!ok, "the removed export's I/O fails");
    assert!(
        err.lines().count() == 1 && err.starts_with("blkwire: error:"),
        "{err}"
    );
    let (ok, json, err) = other.finish();
    assert!(ok, "the other export is unaffected: {err}");
    assert_eq!(json.unwrap()["errors"], 0);
    let list = t.rpc("export_list", json!({}));
    assert_eq!(list[0]["name"], "b");
    assert_eq!(list.as_array().unwrap().len(), 1);
    let (ok, _, err) = cli(&["info", &format!("{}/a", t.urls[0])]);
    assert!(!ok && err.contains("no such export"), "{err}");
    // The target goes on: the session list is empty again and b still serves.
    assert_eq!(wait_for_sessions(&t, 0).len(), 0);
    let (ok, _, err) = cli(&["info", &format!("{}/b", t.urls[0])]);
    assert!(ok, "{err}");
}

/// Key files for alice and bob, and the target's with both (as in auth.rs).
fn keys(dir: &TempDir) -> (String, String, String) {
    let file = |n: &str| dir.path(n).to_str().unwrap().to_string();
    for host in ["alice", "bob"] {
        let (ok, _, err) = cli(&["key", "gen", &file(host), "--host-id", host]);
        assert!(ok, "key gen: {err}");
    }
    let both = format!(
        "{}{}",
        std::fs::read_to_string(file("alice")).unwrap(),
        std::fs::read_to_string(file("bob")).unwrap()
    );
    std::fs::write(file("target"), both).unwrap();
    std::fs::set_permissions(file("target"), std::fs::Permissions::from_mode(0o600)).unwrap();
    (file("alice"), file("bob"), file("target"))
}

#[test]
fn changed_rules_and_keys_close_the_sessions_they_no_longer_admit_and_only_those() {
    let dir = TempDir::new("manage-acl");
    let (alice, bob, target) = keys(&dir);
    let t = Managed::start(
        &dir,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--keys",
            &target,
            "--export",
            "a=mem:32M,allow=alice+bob",
        ],
    );
    let url = format!("{}/a", t.urls[0]);
    let as_host = |h: &str, k: &str| {
        [
            "--host-id".to_string(),
            h.to_string(),
            "--key".into(),
            k.into(),
        ]
    };
    let hosts: Vec<String> = t
        .rpc("host_list", json!({}))
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["host"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(hosts, ["alice", "bob"]);
    // Rules: bob is taken off the export; alice's I/O goes on.
    let a1 = Bench::start(
        &url,
        "4",
        &as_host("alice", &alice).each_ref().map(String::as_str),
    );
    let b1 = Bench::start(
        &url,
        "30",
        &as_host("bob", &bob).each_ref().map(String::as_str),
    );
    wait_for_sessions(&t, 2);
    let r = t.rpc("export_set_allow", json!({"name": "a", "allow": "alice"}));
    assert_eq!(r["closed_sessions"], 1, "{r}");
    let (ok, _, err) = b1.finish();
    assert!(!ok, "bob's session is closed: {err}");
    let (ok, json, err) = a1.finish();
    assert!(ok, "alice is unaffected: {err}");
    assert_eq!(json.unwrap()["errors"], 0);
    let (ok, _, _) = cli(&[
        &["info", url.as_str()][..],
        &as_host("bob", &bob).each_ref().map(String::as_str),
    ]
    .concat());
    assert!(!ok, "bob may not open it any more");
    // Keys: bob's rules are back, then his key is taken out of the key file and reloaded.
    t.rpc("export_set_allow", json!({"name": "a", "allow": null}));
    let a2 = Bench::start(
        &url,
        "4",
        &as_host("alice", &alice).each_ref().map(String::as_str),
    );
    let b2 = Bench::start(
        &url,
        "30",
        &as_host("bob", &bob).each_ref().map(String::as_str),
    );
    wait_for_sessions(&t, 2);
    std::fs::write(&target, std::fs::read_to_string(&alice).unwrap()).unwrap();
    let r = t.rpc("keys_load", json!({"path": target}));
    assert_eq!(
        (r["hosts"].as_u64(), r["closed_sessions"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    let (ok, _, _) = b2.finish();
    assert!(!ok, "bob's key is gone: his session is closed");
    let (ok, json, err) = a2.finish();
    assert!(ok, "alice's key did not change: {err}");
    assert_eq!(json.unwrap()["errors"], 0);
    let (ok, _, err) = cli(&[
        &["info", url.as_str()][..],
        &as_host("bob", &bob).each_ref().map(String::as_str),
    ]
    .concat());
    assert!(!ok && err.contains("bob"), "bob is refused: {err}");
    // session_close closes one session, named by id.
    let a3 = Bench::start(
        &url,
        "30",
        &as_host("alice", &alice).each_ref().map(String::as_str),
    );
    let s = wait_for_sessions(&t, 1);
    let id = s[0]["session"].to_string();
    let out = t.ok(&["session", "close", &id]);
    assert!(out.contains(&id), "{out}");
    let (ok, _, _) = a3.finish();
    assert!(!ok, "the closed session's I/O fails");
}

/// A config larger than the control socket's request line (1 MiB) still loads: `load-config`
/// sends its path instead of its text (the socket is local). Over-long lines themselves are
/// refused with an error naming the limit (the control socket's own tests).
#[test]
fn a_config_larger_than_a_request_line_loads_by_its_path() {
    let dir = TempDir::new("manage-long");
    let t = Managed::start(
        &dir,
        &["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:1M"],
    );
    let config = dir.path("big.json");
    let calls: Vec<_> = (0..40_000)
        .map(|_| json!({"method": "export_list", "params": {}}))
        .collect();
    let text = Value::Array(calls).to_string();
    assert!(text.len() > 1 << 20, "{} bytes", text.len());
    std::fs::write(&config, text).unwrap();
    let (ok, out, err) = t.cli(&["load-config", config.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("applied 40000 calls"), "{out}");
    assert!(t.ok(&["export", "ls"]).contains('a'), "the target goes on");
    t.stop();
}

#[test]
fn only_root_and_the_targets_user_may_use_the_control_socket() {
    let dir = TempDir::new("manage-perm");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t = Managed::start(
        &dir,
        &["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:1M"],
    );
    assert_eq!(
        std::fs::metadata(&t.sock).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let as_nobody = || {
        let out = common::as_nobody(BIN)
            .args(["export", "ls", "--socket", &t.sock])
            .output()
            .expect("run setpriv");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = as_nobody();
    assert!(!ok, "the socket file (0600) keeps others out");
    assert!(err.contains("permission denied"), "{err}");
    // Even with the file opened up, the target checks who is calling.
    std::fs::set_permissions(&t.sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (ok, err) = as_nobody();
    assert!(!ok, "the peer's credentials are checked");
    assert!(
        err.contains("root and the user running the target") && err.lines().count() == 1,
        "{err}"
    );
    assert!(t.ok(&["export", "ls"]).contains('a'), "root still may");
}

/// The CLI calls only a target run by root or by its own user: a socket another user listens
/// on (a stale path, a `BLKWIRE_RPC_SOCKET` naming a world-writable directory) is refused before
/// anything is sent, as the target refuses callers that are neither.
#[test]
fn the_cli_refuses_a_socket_served_by_another_user() {
    let dir = TempDir::new("manage-impostor");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    // Another user's target (uid 65534) on the socket path: it would take root's calls.
    let sock = dir.path("ctl.sock").to_str().unwrap().to_string();
    let mut cmd = common::as_nobody(BIN);
    cmd.args(["serve", "--rpc-socket", &sock, "--log-level", "warn"])
        .args(["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:1M"]);
    let (child, urls) = common::spawn_serve_with_control(&mut cmd, 0);
    let t = Managed { child, sock, urls };
    let (ok, out, err) = t.cli(&["export", "ls"]);
    assert!(!ok, "called another user's target: {out}");
    assert!(
        err.contains("uid 65534, neither root nor this user") && err.lines().count() == 1,
        "{err}"
    );
}

/// A caller the socket refuses is answered at once, its request not even read, and holds no
/// place among the 16 clients: however many hold their connection open without writing (each
/// used to hold a place, and a thread, for up to 2 s a byte), root's calls go through.
#[test]
fn refused_callers_are_answered_at_once_and_take_no_place() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (to connect as another user); CI runs as root"
    );
    let dir = TempDir::new("manage-refused");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t = Managed::start(
        &dir,
        &["--listen", "tcp://127.0.0.1:0", "--export", "a=mem:1M"],
    );
    // Opened up, so that the target's own check is what refuses them.
    std::fs::set_permissions(&t.sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let sock = t.sock.clone();
    let refused: Vec<UnixStream> = std::thread::spawn(move || {
        // The raw system call changes this thread's user ids only (libc's setresuid would
        // change every thread's); the connections it makes carry them.
        // SAFETY: no memory is involved; the thread ends right after.
        let r = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
        assert_eq!(r, 0, "setresuid: {}", std::io::Error::last_os_error());
        (0..20)
            .map(|_| UnixStream::connect(&sock).expect("connect as nobody"))
            .collect()
    })
    .join()
    .unwrap();
    // They all hold their connections, sending nothing; root is not kept out.
    assert!(t.ok(&["export", "ls"]).contains('a'), "root is served");
    // Each was answered without having sent a byte.
    for c in &refused {
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut l = String::new();
        BufReader::new(c).read_line(&mut l).unwrap();
        let v: Value = serde_json::from_str(&l).unwrap();
        assert_eq!(
            (&v["id"], &v["error"]["code"]),
            (&Value::Null, &json!(-32001)),
            "{v}"
        );
    }
    t.stop();
}

#[test]
fn configs_that_cannot_be_served_fail_at_start_in_one_line_and_leave_nothing_behind() {
    let dir = TempDir::new("manage-badconfig");
    let sock = dir.path("ctl.sock");
    let run = |config: &str| {
        let f = dir.path("c.json");
        std::fs::write(&f, config).unwrap();
        let out = Command::new(BIN)
            .args(["serve", "--rpc-socket", sock.to_str().unwrap(), "--config"])
            .arg(&f)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{config} should not start");
        assert!(!sock.exists(), "no control socket left behind by {config}");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let last = err.lines().last().unwrap_or_default().to_string();
        assert!(last.starts_with("blkwire: error:"), "{err}");
        last
    };
    let e = run("{\"method\": \"export_list\"}");
    assert!(e.contains("not a blkwire config"), "{e}");
    let e = run(
        r#"[{"method":"export_add","params":{"name":"a","spec":"mem:1M"}},{"method":"export_add","params":{"name":"a","spec":"mem:1M"}}]"#,
    );
    assert!(
        e.contains("call 2 (export_add): export 'a' exists already"),
        "{e}"
    );
    let e = run(
        r#"[{"method":"export_add","params":{"name":"a","spec":"mem:1M"}},{"method":"target_options","params":{}}]"#,
    );
    assert!(e.contains("target_options must be the first call"), "{e}");
    let e = run(r#"[{"method":"target_options","params":{"max_io":1}}]"#);
    assert!(e.contains("max_io must be"), "{e}");
    // A device that never ends is refused once 20 MiB of it are read.
    let out = Command::new(BIN)
        .args(["serve", "--rpc-socket", sock.to_str().unwrap()])
        .args(["--config", "/dev/zero"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !sock.exists(), "{err}");
    assert!(
        err.trim_end().ends_with(
            "--config /dev/zero: cannot read it: larger than 20 MiB, the most read: is it the right file?"
        ),
        "{err}"
    );
}

/// A native READ of `len` bytes at `offset` on a raw queue connection (`queue` of `session`):
/// its status, and its data when OK.
fn raw_read(
    s: &mut TcpStream,
    (session, queue): (u32, u16),
    offset: u64,
    len: u32,
) -> (Status, Vec<u8>) {
    let mut h = Header::request(Opcode::Read, Tag::new(0, 1), offset, len);
    h.session = session;
    h.queue = queue;
    s.write_all(&h.to_bytes()).unwrap();
    let (r, p) = read_frame(s).expect("a reply to the READ");
    (r.status, p)
}

/// Issue 14's "resize where the backend allows": a file: export grows while a bench writes to
/// it and other sessions are open. Nothing open is disturbed and each keeps the size it was
/// given (even a queue that joins its session after the resize); new sessions, whatever their
/// protocol, see the new size; the file has it on disk; data written before reads back.
#[test]
fn a_file_export_grows_under_running_io_and_only_new_sessions_see_the_new_size() {
    const OLD: u64 = 32 << 20;
    const NEW: u64 = 64 << 20;
    const MIB: u64 = 1 << 20;
    let dir = TempDir::new("manage-resize");
    let img = dir.path("disk.img");
    sparse_file(&img, OLD);
    let spec = format!("d=file:{}", img.display());
    let t = Managed::start(
        &dir,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--listen",
            "nbd://127.0.0.1:0",
            "--export",
            &spec,
        ],
    );
    let url = format!("{}/d", t.urls[0]);
    let native_addr = t.urls[0].trim_start_matches("tcp://").to_string();
    let nbd_addr = t.urls[1].trim_start_matches("nbd://").to_string();
    // Before the resize: data at the old end, from a session that stays open ...
    let opts = ConnectOptions {
        queues: 1,
        depth: 4,
        max_io: 1 << 20,
        ..Default::default()
    };
    let mut early = connect(&Url::parse(&url).unwrap(), &opts).unwrap();
    assert_eq!(early.info.size, OLD);
    let a = random_bytes(MIB as usize, 1);
    early.queues[0].write_at(&a, OLD - MIB, false).unwrap();
    // ... a raw native session of 2 queues whose queue 1 joins only after the resize ...
    let mut q0 = TcpStream::connect(&native_addr).unwrap();
    q0.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (r, p) = hello(&mut q0, "d");
    assert_eq!(r.status, Status::Ok);
    let granted = HelloReply::decode(&p).unwrap();
    assert_eq!((granted.size, granted.queues), (OLD, 2));
    // ... an NBD session, and a bench on the first 16 MiB (clear of the data above).
    let (mut nbd_early, nbd_size, _) = Raw::go(&nbd_addr, "d", false, false);
    assert_eq!(nbd_size, OLD);
    let bench = Bench::start(
        &url,
        "4",
        &["--rw", "randrw", "--iodepth", "8", "--size", "16M"],
    );
    wait_for_sessions(&t, 4);

    let out = t.ok(&["export", "resize", "d", "64M"]);
    assert_eq!(out, "resized export d to 64M (was 32M)\n");
    assert_eq!(std::fs::metadata(&img).unwrap().len(), NEW, "the file grew");

    // New sessions see the new size: native HELLO, the LIST query, NBD GO.
    let (ok, out, err) = cli(&["info", &url, "--json"]);
    assert!(ok, "{err}");
    let info: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(info["size"], NEW, "{info}");
    let (ok, out, err) = cli(&["info", &t.urls[0], "--json"]);
    assert!(ok, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["exports"][0]["size"], NEW, "{list}");
    let (mut nbd_late, nbd_size, _) = Raw::go(&nbd_addr, "d", false, false);
    assert_eq!(nbd_size, NEW);
    nbd_late.request(cmd::READ, 0, 1, NEW - 4096, 4096);
    assert_eq!(
        nbd_late.read_simple(4096).0,
        0,
        "a new NBD session reaches the new end"
    );

    // Sessions opened before keep the old size, on every queue.
    let mut q1 = raw_join(&native_addr, &granted, 1).expect("queue 1 joins after the resize");
    for (q, s) in [(0u16, &mut q0), (1, &mut q1)] {
        let (st, data) = raw_read(s, (granted.session, q), OLD - 512, 512);
        assert_eq!(st, Status::Ok, "queue {q}");
        assert!(
            data == a[a.len() - 512..],
            "queue {q} reads what was written"
        );
        let (st, _) = raw_read(s, (granted.session, q), OLD, 512);
        assert_eq!(st, Status::OutOfRange, "queue {q} keeps its session's size");
    }
    nbd_early.request(cmd::READ, 0, 2, OLD, 512);
    assert_eq!(
        nbd_early.read_simple(512).0,
        err::EINVAL,
        "NBD keeps its size"
    );
    let mut back = vec![0u8; MIB as usize];
    early.queues[0].read_at(&mut back, OLD - MIB).unwrap();
    assert!(back == a, "the data written before the resize reads back");
    assert!(
        early.queues[0].write_at(&a[..4096], OLD, false).is_err(),
        "an open session's I/O past its size is refused"
    );
    // So is a COPY (PROTOCOL.md §13) landing or reading past it.
    let r = |offset, len| blkwire_client::CopyRange { offset, len };
    for (src, dst) in [(r(0, 4096), OLD), (r(OLD, 4096), 0)] {
        assert!(
            matches!(
                early.queues[0].copy("", &[src], dst),
                Err(blkwire_client::Error::Copy {
                    status: Status::OutOfRange,
                    copied: 0
                })
            ),
            "{src:?} to {dst}"
        );
    }

    // A new session writes across the old end; the file has it all.
    let mut late = connect(&Url::parse(&url).unwrap(), &opts).unwrap();
    assert_eq!(late.info.size, NEW);
    let b = random_bytes(MIB as usize, 2);
    late.queues[0].write_at(&b, OLD - MIB / 2, false).unwrap();
    late.queues[0].flush().unwrap();
    late.queues[0].read_at(&mut back, OLD - MIB).unwrap();
    assert!(back[..MIB as usize / 2] == a[..MIB as usize / 2]);
    assert!(back[MIB as usize / 2..] == b[..MIB as usize / 2]);
    let file = std::fs::File::open(&img).unwrap();
    let mut on_disk = vec![0u8; MIB as usize / 2];
    file.read_exact_at(&mut on_disk, OLD).unwrap();
    assert!(
        on_disk == b[MIB as usize / 2..],
        "past the old end, in the file"
    );

    let (ok, json, err) = bench.finish();
    assert!(ok, "bench failed: {err}");
    let json = json.expect("bench --json summary");
    assert_eq!(
        json["errors"], 0,
        "the running I/O went on undisturbed: {json}"
    );
    assert!(json["ops"].as_u64().unwrap() > 100, "{json}");
}

/// A raw native JOIN of `queue` to the session `granted` describes: its connection, once OK.
fn raw_join(addr: &str, granted: &HelloReply, queue: u16) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (h, j) = join_request(granted.session, queue, granted.cookie);
    s.write_all(&h.to_bytes()).unwrap();
    s.write_all(&j).unwrap();
    (read_frame(&mut s)?.0.status == Status::Ok).then_some(s)
}

#[test]
fn resizing_refuses_shrinks_ram_and_bad_sizes_in_one_line_and_changes_nothing() {
    let dir = TempDir::new("manage-resize-refused");
    let img = dir.path("f.img");
    sparse_file(&img, 8 << 20);
    let f = format!("f=file:{}", img.display());
    let t = Managed::start(
        &dir,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            &f,
            "--export",
            "m=mem:4M",
            "--export",
            "t=memthread:4M",
            "--export",
            "n=null:1M",
        ],
    );
    let before = t.rpc("export_list", json!({}));
    let bad: &[(Value, &str)] = &[
        (
            json!({"name": "f", "size": "4M"}),
            "cannot shrink export 'f' from 8M to 4M: exports only grow: a session may be using the end; remove and re-add the export to shrink",
        ),
        (
            json!({"name": "m", "size": "8M"}),
            "export 'm': mem: is mapped at its size when the export is added: remove and re-add it",
        ),
        (json!({"name": "t", "size": "8M"}), "memthread: is mapped at its size"),
        (json!({"name": "nope", "size": "8M"}), "no export named 'nope'"),
        (json!({"name": "f", "size": "2X"}), "bad size '2X'"),
        (
            json!({"name": "f", "size": (16 << 20) + 100}),
            "not a multiple of its 512-byte block",
        ),
        (json!({"name": "f", "size": -1}), "size -1 is not a whole number of bytes"),
        (json!({"name": "f", "size": 1.5}), "not a whole number of bytes"),
        (json!({"name": "f", "size": true}), "size must be a number of bytes or a size"),
        (json!({"name": "f"}), "missing field `size`"),
        (json!({"name": "f", "size": "16M", "force": true}), "unknown field `force`"),
        (json!({"name": "n", "size": "99999999999T"}), "too large"),
    ];
    for (params, needle) in bad {
        t.rpc_refused("export_resize", params.clone(), needle);
    }
    assert_eq!(
        t.rpc("export_list", json!({})),
        before,
        "refused calls changed nothing"
    );
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
    // The CLI: one line and a failed exit; --help says why exports only grow.
    for (args, needle) in [
        (["export", "resize", "m", "8M"], "remove and re-add it"),
        (["export", "resize", "f", "1M"], "exports only grow"),
    ] {
        let (ok, out, err) = t.cli(&args);
        assert!(!ok && out.is_empty(), "{args:?}: {out}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("blkwire: error:") && err.contains(needle),
            "{err}"
        );
    }
    let (ok, help, _) = cli(&["export", "resize", "--help"]);
    assert!(ok && help.contains("Exports only grow"), "{help}");
    // What it takes: bytes or a size string; the same size again is a no-op.
    let e = t.rpc("export_resize", json!({"name": "n", "size": 2u64 << 30}));
    assert_eq!(
        (&e["size"], &e["previous_size"], &e["spec"]),
        (&json!(2u64 << 30), &json!(1 << 20), &json!("null:2G")),
        "{e}"
    );
    assert_eq!(
        t.ok(&["export", "resize", "n", "2G"]),
        "resized export n to 2G (was 2G)\n"
    );
    let (ok, out, err) = cli(&["info", &format!("{}/n", t.urls[0]), "--json"]);
    assert!(ok, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["size"],
        2u64 << 30
    );
}

#[test]
fn a_resized_export_comes_back_at_its_new_size_from_the_saved_config() {
    let dir = TempDir::new("manage-resize-config");
    let img = dir.path("f.img");
    sparse_file(&img, 8 << 20);
    let empty = dir.path("empty.json");
    std::fs::write(&empty, "[]").unwrap();
    let t = Managed::start(&dir, &["--config", empty.to_str().unwrap()]);
    t.ok(&["export", "add", "f", &format!("file:{}", img.display())]);
    t.ok(&["export", "add", "n", "null:1M,ro"]);
    t.ok(&["export", "resize", "f", "24M"]);
    t.rpc("export_resize", json!({"name": "n", "size": 3u64 << 30}));
    let exports = t.ok(&["export", "ls", "--json"]);
    let list: Value = serde_json::from_str(&exports).unwrap();
    assert_eq!(
        (&list[0]["size"], &list[1]["size"], &list[1]["spec"]),
        (&json!(24 << 20), &json!(3u64 << 30), &json!("null:3G,ro")),
        "{list}"
    );
    let saved = dir.path("saved.json");
    t.ok(&["save-config", saved.to_str().unwrap()]);
    t.stop();
    let back = Managed::start(&dir, &["--config", saved.to_str().unwrap()]);
    assert_eq!(back.ok(&["export", "ls", "--json"]), exports);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 24 << 20);
}

#[test]
fn nvme_subsystems_and_controllers_are_listed_and_end_with_their_export() {
    use common::nvme_host::{controller, io_queue, nqn, Opts, DISCOVERY_NQN};
    let dir = TempDir::new("manage-nvme");
    let t = Managed::start(
        &dir,
        &[
            "--listen",
            "nvme-tcp://127.0.0.1:0",
            "--export",
            "d=mem:1M,allow=127.0.0.0/8",
        ],
    );
    let addr = t.urls[0].strip_prefix("nvme-tcp://").unwrap().to_string();
    let a = controller(&addr, &nqn("d"), &Opts::default());
    let mut q = io_queue(&addr, &nqn("d"), &a, 1, &Opts::default());
    let list = t.rpc("nvme_subsystem_list", json!({}));
    let s = &list[0];
    assert_eq!(s["nqn"], nqn("d"));
    assert_eq!(s["namespaces"][0]["export"], "d");
    assert_eq!(s["namespaces"][0]["size"], 1 << 20);
    assert_eq!(s["allow"], "127.0.0.0/8");
    assert_eq!(s["controllers"][0]["cntlid"], a.cntlid);
    assert_eq!(s["controllers"][0]["hostnqn"], common::nvme_host::HOSTNQN);
    // A listener added at run time appears in the discovery log.
    let added = t.rpc("listener_add", json!({"url": "nvme-tcp://127.0.0.1:0"}));
    let mut d = controller(&addr, DISCOVERY_NQN, &Opts::default());
    let head = d.get_log(0x70, 1024, 0);
    let n = u64::from_le_bytes(head.data[8..16].try_into().unwrap());
    assert_eq!(n, 4, "discovery and d, at two listeners (added {added})");
    // Removing the export ends its controller and I/O queue.
    t.rpc("export_remove", json!({"name": "d", "force": true}));
    let mut a = a;
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "I/O queue outlived its export"
    );
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "admin queue outlived its export"
    );
    let list = t.rpc("nvme_subsystem_list", json!({}));
    assert_eq!(list, json!([]));
    t.stop();
}

/// Adds a `udp://127.0.0.1:0` listener to `t`: the URL it is bound at.
fn add_udp_listener(t: &common::Controlled) -> String {
    let u = t.rpc("listener_add", r#"{"url": "udp://127.0.0.1:0"}"#);
    u["url"].as_str().unwrap().to_string()
}

/// Datagram listeners added and removed again and again keep serving I/O that goes through
/// the backend's io_uring (a file export): a reactor names a datagram socket in 4 bits of a
/// completion, and the 17th socket it was ever given got index 16, whose completions went to
/// socket 0 (dropped, or worse, taken for one of its requests): I/O hung until the timeout.
/// A removed socket's index is taken again, and past 16 at once a listener is refused.
#[test]
fn datagram_listeners_come_and_go_without_limit_and_at_most_16_at_once() {
    let d = TempDir::new("udp-churn");
    let img = d.path("f.img");
    sparse_file(&img, 1 << 20);
    let t = common::Controlled::start(
        &d,
        &[
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            &format!("f=file:{}", img.display()),
        ],
    );
    let opts = ConnectOptions {
        timeout: Duration::from_secs(5),
        ..Default::default()
    };
    let data = random_bytes(4096, 3);
    for round in 0..24 {
        let udp = add_udp_listener(&t);
        let url = Url::parse(&format!("{udp}/f")).unwrap();
        let mut s = connect(&url, &opts).unwrap_or_else(|e| panic!("round {round}: {e}"));
        s.queues[0]
            .write_at(&data, 0, false)
            .unwrap_or_else(|e| panic!("round {round}: write: {e}"));
        let mut back = vec![0u8; 4096];
        s.queues[0].read_at(&mut back, 0).unwrap();
        assert!(back == data, "round {round}: read back");
        drop(s);
        t.rpc("listener_remove", &format!(r#"{{"url": "{udp}"}}"#));
    }
    let mut urls: Vec<String> = (0..16).map(|_| add_udp_listener(&t)).collect();
    t.refused(
        "listener_add",
        r#"{"url": "udp://127.0.0.1:0"}"#,
        "already 16 datagram listeners",
    );
    // One removed and one added at once: the new socket waits for the old one's index (it was
    // dropped, the listener listed and served nowhere), then serves.
    for round in 0..4 {
        let gone = urls.remove(0);
        t.rpc("listener_remove", &format!(r#"{{"url": "{gone}"}}"#));
        let udp = add_udp_listener(&t);
        let url = Url::parse(&format!("{udp}/f")).unwrap();
        let mut s = connect(&url, &opts).unwrap_or_else(|e| panic!("swap {round}: {e}"));
        let mut back = vec![0u8; 4096];
        s.queues[0].read_at(&mut back, 0).unwrap();
        assert!(back == data, "swap {round}: read back");
        urls.push(udp);
    }
}

/// A datagram listener added while a removed one's socket still runs backend I/O (so it keeps
/// its port index) is served once that I/O is done: with 16 sockets on a thread, the new one
/// waited for no index and was dropped, the listener listed and served nowhere (one worker
/// thread: with several, the others' sockets hid it).
#[test]
fn a_datagram_listener_added_while_a_removed_one_still_runs_io_serves_once_it_is_done() {
    let fs = common::frozen::LoopExt4::new();
    let d = TempDir::new("udp-swap-busy");
    let img = fs.mnt().join("f.img");
    sparse_file(&img, 1 << 20);
    let t = common::Controlled::start(
        &d,
        &[
            "--threads",
            "1",
            "--listen",
            "tcp://127.0.0.1:0",
            "--export",
            &format!("f=file:{}", img.display()),
        ],
    );
    let mut urls: Vec<String> = (0..16).map(|_| add_udp_listener(&t)).collect();
    let opts = ConnectOptions {
        timeout: Duration::from_secs(20),
        ..Default::default()
    };
    // A write held at the backend on the first listener's socket.
    let busy = Url::parse(&format!("{}/f", urls[0])).unwrap();
    let mut s = connect(&busy, &opts).unwrap();
    let frozen = fs.freeze();
    let writer = std::thread::spawn(move || {
        let r = s.queues[0].write_at(&[5u8; 4096], 0, false);
        drop(s);
        r
    });
    let running = || {
        let v = t.rpc("stats", "{}");
        v["sessions"].as_array().into_iter().flatten().any(|s| {
            s["queues"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|q| q["in_flight"].as_u64() > Some(0))
        })
    };
    assert!(
        common::wait_until(Duration::from_secs(10), running),
        "the write never reached the backend"
    );
    t.rpc(
        "listener_remove",
        &format!(r#"{{"url": "{}"}}"#, urls.remove(0)),
    );
    let udp = add_udp_listener(&t);
    drop(frozen);
    let _ = writer.join().unwrap();
    let url = Url::parse(&format!("{udp}/f")).unwrap();
    let mut s = connect(&url, &opts).expect("the new listener serves once the old socket is done");
    s.queues[0].write_at(&[6u8; 4096], 4096, false).unwrap();
    let mut back = vec![0u8; 4096];
    s.queues[0].read_at(&mut back, 4096).unwrap();
    assert!(back.iter().all(|b| *b == 6));
}
