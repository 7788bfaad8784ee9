//! iSCSI targets of several LUNs (issue 17): `serve --iscsi-target`, the `iscsi_target_*` calls
//! and `blkwire iscsi-target`. A target's LUNs are served each from its own export (sizes and
//! data apart, with libiscsi's tools and the test kit's initiator), its initiator list refuses
//! the others, each export's own rules mask LUNs, and LUNs added and removed at run time
//! behave as SPC-4 says on live sessions. Needs libiscsi-bin (scripts/deps.sh); without it the
//! tests that use it fail saying so.

mod common;

use std::process::Command;
use std::time::Duration;

use blkwire_wire::iscsi::Digests;
use common::iscsi_host::{login, login_with, try_login, Conn, INITIATOR};
use common::{cli, random_bytes, wait_until, TempDir};

const DB: &str = "iqn.2026-11.com.example:db";
const PREFIX: &str = "iqn.2026-11.io.blkwire:";

/// Fails (never skips) when a libiscsi tool is missing.
fn need(tool: &str) {
    common::need_tool(tool, "libiscsi-bin");
}

/// Runs a libiscsi tool (bounded in time): success and its output.
fn tool(name: &str, args: &[&str]) -> (bool, String) {
    need(name);
    let out = Command::new("timeout")
        .arg("20")
        .arg(name)
        .args(args)
        .output()
        .expect("run a libiscsi tool");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A target with an `iscsi://` listener and a control socket; killed on drop.
struct Served {
    child: std::process::Child,
    sock: String,
    addr: String,
    _dir: TempDir,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Served {
    fn start(exports: &[&str], extra: &[&str]) -> Served {
        let dir = TempDir::new("iscsi-lun");
        let sock = dir.path("ctl.sock").to_str().unwrap().to_string();
        let mut cmd = Command::new(common::BIN);
        cmd.args(["serve", "--rpc-socket", &sock, "--log-level", "warn"]);
        cmd.args(["--listen", "iscsi://127.0.0.1:0"]);
        for e in exports {
            cmd.args(["--export", e]);
        }
        cmd.args(extra);
        let (child, urls) = common::spawn_serve_with_control(&mut cmd, 1);
        let addr = urls[0].strip_prefix("iscsi://").unwrap().to_string();
        Served {
            child,
            sock,
            addr,
            _dir: dir,
        }
    }

    /// `blkwire ARGS --socket SOCK`: its stdout; panics unless it succeeds.
    fn cli(&self, args: &[&str]) -> String {
        let mut all = args.to_vec();
        all.extend(["--socket", &self.sock]);
        let (ok, out, err) = cli(&all);
        assert!(ok, "blkwire {args:?}: {err}");
        out
    }

    fn rpc(&self, method: &str, params: &str) -> serde_json::Value {
        serde_json::from_str(&self.cli(&["rpc", method, params])).expect("rpc prints JSON")
    }

    /// The configured target `iqn` as `iscsi_target_list` shows it.
    fn listed(&self, iqn: &str) -> serde_json::Value {
        let list = self.rpc("iscsi_target_list", "{}");
        list.as_array()
            .and_then(|l| l.iter().find(|t| t["iqn"] == iqn))
            .cloned()
            .unwrap_or_else(|| panic!("{iqn} not in {list}"))
    }
}

const TUR: [u8; 6] = [0; 6];
const REPORT_LUNS: [u8; 12] = [0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];

/// REPORT LUNS: the LUNs listed (peripheral or flat space addressing).
fn report_luns(c: &mut Conn) -> Vec<u64> {
    let (st, d, _) = c.scsi(&REPORT_LUNS, 256);
    assert_eq!(st, 0, "REPORT LUNS status");
    let n = u32::from_be_bytes(d[0..4].try_into().unwrap()) as usize / 8;
    (0..n)
        .map(|i| blkwire_wire::scsi::lun_from_wire(d[8 + 8 * i..16 + 8 * i].try_into().unwrap()))
        .collect()
}

/// READ CAPACITY(16) of the connection's current LUN: its size in bytes.
fn capacity(c: &mut Conn) -> u64 {
    let cdb = [0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0];
    let (st, d, _) = c.scsi(&cdb, 32);
    assert_eq!(st, 0, "READ CAPACITY(16) of LUN {}", c.lun);
    let last = u64::from_be_bytes(d[0..8].try_into().unwrap());
    let bs = u32::from_be_bytes(d[8..12].try_into().unwrap()) as u64;
    (last + 1) * bs
}

/// (status, sense key, ASC, ASCQ) of TEST UNIT READY on the current LUN.
fn tur(c: &mut Conn) -> (u8, u8, u8, u8) {
    let (st, _, s) = c.scsi(&TUR, 0);
    match s.len() >= 14 {
        true => (st, s[2] & 0xf, s[12], s[13]),
        false => (st, 0, 0, 0),
    }
}

/// Two LUNs of different sizes: libiscsi sees both with their sizes, data written to one is
/// not in the other, and the exports' own targets still serve the same data.
#[test]
fn a_target_of_two_luns_serves_each_from_its_own_export() {
    let t = Served::start(
        &["a=mem:16M", "b=mem:8M"],
        &["--iscsi-target", &format!("{DB}=a,b@5")],
    );
    let (ok, out) = tool("iscsi-ls", &["-s", &format!("iscsi://{}", t.addr)]);
    assert!(ok, "{out}");
    let listed = format!("Target:{DB} Portal:{},1", t.addr);
    let at = out
        .find(&listed)
        .unwrap_or_else(|| panic!("no '{listed}' in:\n{out}"));
    let luns: Vec<&str> = out[at..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("Lun:"))
        .collect();
    assert_eq!(luns.len(), 2, "{out}");
    assert!(
        luns[0].starts_with("Lun:0 ") && luns[1].starts_with("Lun:5 "),
        "{out}"
    );
    for (lun, size) in [(0, 16 << 20), (5, 8 << 20)] {
        let (ok, out) = tool(
            "iscsi-readcapacity16",
            &[&format!("iscsi://{}/{DB}/{lun}", t.addr)],
        );
        assert!(
            ok && out.contains(&format!("Total size:{size}")),
            "LUN {lun}: {out}"
        );
    }
    let (ok, out) = tool("iscsi-inq", &[&format!("iscsi://{}/{DB}/5", t.addr)]);
    assert!(ok && out.contains("BLKWIRE"), "INQUIRY of LUN 5: {out}");

    let mut c = login(&t.addr, DB, Digests::default());
    assert_eq!(report_luns(&mut c), vec![0, 5]);
    assert_eq!(capacity(&mut c), 16 << 20);
    c.lun = 5;
    assert_eq!(capacity(&mut c), 8 << 20);
    let (da, db) = (random_bytes(256 << 10, 1), random_bytes(256 << 10, 2));
    c.lun = 0;
    assert_eq!(c.write(100, &da), 0);
    c.lun = 5;
    assert_eq!(c.write(100, &db), 0);
    assert!(
        c.read(100, 512).0 == db,
        "LUN 5 reads what was written to it"
    );
    c.lun = 0;
    assert!(
        c.read(100, 512).0 == da,
        "LUN 0 reads what was written to it"
    );
    // Past LUN 5's end (8 MiB = 16384 blocks) but inside LUN 0's: refused on 5 only.
    c.lun = 5;
    assert_ne!(c.read(16384, 1).1, 0, "a read past LUN 5's end");
    c.lun = 0;
    assert_eq!(c.read(16384, 1).1, 0);
    // A LUN the target does not have: LOGICAL UNIT NOT SUPPORTED.
    c.lun = 1;
    assert_eq!(tur(&mut c), (2, 0x5, 0x25, 0));

    let mut own = login(&t.addr, &format!("{PREFIX}b"), Digests::default());
    assert_eq!(report_luns(&mut own), vec![0]);
    assert!(
        own.read(100, 512).0 == db,
        "export b's own target is the same data"
    );
}

/// With allow= only the initiators listed log in (and SendTargets lists the target only to
/// them); a LUN whose export's rules refuse the initiator is masked.
#[test]
fn the_initiator_list_refuses_others_and_export_rules_mask_luns() {
    let good = "iqn.2026-11.io.test:good";
    let bad = "iqn.2026-11.io.test:bad";
    let t = Served::start(
        &["a=mem:1M", "far=mem:1M,allow=10.0.0.0/8"],
        &["--iscsi-target", &format!("{DB}=a,far@3;allow={good}")],
    );
    let mut c = try_login(&t.addr, DB, good, Digests::default()).expect("a listed initiator");
    assert_eq!(
        report_luns(&mut c),
        vec![0],
        "LUN 3's export admits 10.0.0.0/8 only"
    );
    c.lun = 3;
    assert_eq!(tur(&mut c), (2, 0x5, 0x25, 0), "a masked LUN is absent");
    let refused = try_login(&t.addr, DB, bad, Digests::default()).err();
    assert_eq!(refused, Some(0x0202), "not on the list: not allowed");
    // The exports' own targets keep their own rules.
    assert!(try_login(&t.addr, &format!("{PREFIX}a"), bad, Digests::default()).is_ok());

    let portal = format!("iscsi://{}", t.addr);
    let (ok, out) = tool("iscsi-ls", &["-i", good, &portal]);
    assert!(ok && out.contains(&format!("Target:{DB} ")), "{out}");
    let (ok, out) = tool("iscsi-ls", &["-i", bad, &portal]);
    assert!(ok && out.contains(&format!("Target:{PREFIX}a ")), "{out}");
    assert!(
        !out.contains(DB),
        "SendTargets lists {DB} to an initiator it refuses:\n{out}"
    );
}

/// With a key store the initiator list matches the name CHAP proved: each initiator proves its
/// own secret, and only the listed one sees and opens the target.
#[test]
fn with_keys_the_initiator_list_matches_the_chap_proven_name() {
    let good = "iqn.2026-11.io.test:good";
    let bad = "iqn.2026-11.io.test:bad";
    let dir = TempDir::new("iscsi-lun-chap");
    let keys = dir.path("keys");
    std::fs::write(
        &keys,
        format!("{good}:CHAP:good-secret-12345\n{bad}:CHAP:bad-secret-123456\n"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let t = Served::start(
        &["a=mem:1M", "b=mem:2M"],
        &[
            "--keys",
            keys.to_str().unwrap(),
            "--iscsi-target",
            &format!("{DB}=a,b;allow={good}"),
        ],
    );
    let url =
        |who: &str, secret: &str, path: &str| format!("iscsi://{who}%{secret}@{}{path}", t.addr);
    let (ok, out) = tool(
        "iscsi-ls",
        &["-i", good, "-s", &url(good, "good-secret-12345", "")],
    );
    assert!(ok, "{out}");
    let at = out
        .find(&format!("Target:{DB} "))
        .unwrap_or_else(|| panic!("{DB} not listed to {good}:\n{out}"));
    assert!(out[at..].contains("Lun:1 "), "{out}");
    let (ok, out) = tool(
        "iscsi-ls",
        &["-i", bad, "-s", &url(bad, "bad-secret-123456", "")],
    );
    assert!(ok && out.contains(&format!("Target:{PREFIX}a ")), "{out}");
    assert!(!out.contains(DB), "{DB} listed to {bad}:\n{out}");
    let (ok, out) = tool(
        "iscsi-readcapacity16",
        &[
            "-i",
            bad,
            &url(bad, "bad-secret-123456", &format!("/{DB}/1")),
        ],
    );
    assert!(!ok, "{bad} opened {DB}: {out}");
    let (ok, out) = tool(
        "iscsi-readcapacity16",
        &[
            "-i",
            good,
            &url(good, "good-secret-12345", &format!("/{DB}/1")),
        ],
    );
    assert!(ok && out.contains("Total size:2097152"), "{out}");
}

/// LUNs and initiators changed over the control socket: a new LUN is seen at the next
/// login, a removed one is fenced on the live session (LOGICAL UNIT NOT SUPPORTED, and the
/// LUN left reports REPORTED LUNS DATA HAS CHANGED once), the list and save_config show the
/// target, and an initiator taken off the list loses its session.
#[test]
fn luns_and_initiators_change_at_run_time() {
    let t = Served::start(&["a=mem:4M", "b=mem:2M"], &[]);
    let out = t.cli(&["iscsi-target", "create", DB, "--allow", INITIATOR]);
    assert!(out.contains(DB), "{out}");
    let out = t.cli(&["iscsi-target", "add-lun", DB, "a"]);
    assert!(out.contains("LUN 0"), "{out}");
    let mut first = login(&t.addr, DB, Digests::default());
    assert_eq!(report_luns(&mut first), vec![0]);

    let out = t.cli(&["iscsi-target", "add-lun", DB, "b", "--lun", "2"]);
    assert!(out.contains("LUN 2"), "{out}");
    assert_eq!(
        report_luns(&mut first),
        vec![0],
        "a session keeps the LUNs it logged in with"
    );
    // A second session of this initiator: another ISID (the same one would reinstate, and so
    // end, the first).
    let isid = [("ISID", "800001000002")];
    let mut c = login_with(&t.addr, DB, Digests::default(), &isid);
    assert_eq!(report_luns(&mut c), vec![0, 2]);
    c.lun = 2;
    let data = random_bytes(4096, 3);
    assert_eq!(c.write(0, &data), 0);

    let listed = t.listed(DB);
    assert_eq!(listed["luns"][1]["lun"], 2);
    assert_eq!(listed["luns"][1]["export"], "b");
    assert_eq!(listed["luns"][1]["size"], 2 << 20);
    assert_eq!(listed["initiators"][0], INITIATOR);
    assert_eq!(listed["any_initiator"], false);
    assert_eq!(listed["portals"][0], t.addr.as_str());
    assert_eq!(listed["sessions"].as_array().map(Vec::len), Some(2));
    let table = t.cli(&["iscsi-target", "list"]);
    assert!(
        table.contains("0=a,2=b") && table.contains(INITIATOR),
        "{table}"
    );
    let saved = t.rpc("save_config", "{}");
    let ours: Vec<serde_json::Value> = saved
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["params"]["iqn"] == DB)
        .cloned()
        .collect();
    let calls: Vec<String> = ours
        .iter()
        .map(|c| format!("{} {}", c["method"].as_str().unwrap(), c["params"]))
        .collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert!(calls[0].starts_with("iscsi_target_create") && calls[0].contains(INITIATOR));
    assert!(calls[2].starts_with("iscsi_target_add_lun") && calls[2].contains("\"lun\":2"));

    let out = t.cli(&["iscsi-target", "remove-lun", DB, "2"]);
    assert!(
        out.contains("export b") && out.contains("closed 1 session"),
        "{out}"
    );
    // The reactor fences the LUN when it takes the close: nothing to await but the answer.
    assert!(
        wait_until(Duration::from_secs(10), || tur(&mut c).2 == 0x25),
        "LUN 2 still served after its removal"
    );
    c.lun = 0;
    assert_eq!(
        tur(&mut c),
        (2, 0x6, 0x3f, 0x0e),
        "REPORTED LUNS DATA HAS CHANGED"
    );
    assert_eq!(tur(&mut c), (0, 0, 0, 0), "reported once");
    assert_eq!(report_luns(&mut c), vec![0]);
    assert_eq!(c.write(0, &data), 0, "LUN 0 goes on");
    let mut own = login(&t.addr, &format!("{PREFIX}b"), Digests::default());
    assert!(
        own.read(0, 8).0 == data,
        "the data written through LUN 2 is export b's"
    );

    common::assert_one_line_error(
        &["iscsi-target", "add-lun", DB, "nosuch", "--socket", &t.sock],
        "no export 'nosuch'",
    );
    common::assert_one_line_error(
        &["iscsi-target", "remove-lun", DB, "9", "--socket", &t.sock],
        "has no LUN 9",
    );
    common::assert_one_line_error(
        &[
            "iscsi-target",
            "create",
            "iqn.2026-11.io.blkwire:a",
            "--socket",
            &t.sock,
        ],
        "taken",
    );

    let out = t.cli(&["iscsi-target", "remove-initiator", DB, INITIATOR]);
    assert!(out.contains("may no longer"), "{out}");
    assert!(
        first.closed(),
        "the session of an initiator taken off the list ends"
    );
    assert_eq!(
        try_login(&t.addr, DB, INITIATOR, Digests::default()).err(),
        Some(0x0202)
    );
    let out = t.cli(&["iscsi-target", "delete", DB]);
    assert!(out.contains("deleted"), "{out}");
    assert_eq!(
        try_login(&t.addr, DB, INITIATOR, Digests::default()).err(),
        Some(0x0203),
        "a deleted target is not found"
    );
    // The calls save_config wrote build the target again as it was then.
    let config = serde_json::json!({ "config": ours }).to_string();
    t.rpc("load_config", &config);
    let mut again = login(&t.addr, DB, Digests::default());
    assert_eq!(report_luns(&mut again), vec![0, 2]);
    again.lun = 2;
    assert!(again.read(0, 8).0 == data);
}

#[test]
fn bad_iscsi_target_flags_are_one_line_errors() {
    let run = |spec: &str, needle: &str| {
        common::assert_one_line_error(
            &[
                "serve",
                "--rpc-socket",
                "none",
                "--listen",
                "iscsi://127.0.0.1:0",
                "--export",
                "a=mem:1M",
                "--iscsi-target",
                spec,
            ],
            needle,
        )
    };
    run("iqn.2026-11.com.example:t", "--iscsi-target");
    run("iqn.2026-11.com.example:t=a@x", "bad LUN 'x'");
    run("nqn.2026-11.com.example:t=a", "bad target IQN");
    run(
        "iqn.2026-11.com.example:t=a;allow=bob",
        "bad initiator IQN 'bob'",
    );
    run("iqn.2026-11.com.example:t=nosuch", "no export 'nosuch'");
}
