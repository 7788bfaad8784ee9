//! The NBD frontend (issue 3) against real, unmodified NBD clients: libnbd's nbdinfo and
//! nbdcopy, qemu-img and qemu-io, and fio's nbd engine; plus a raw NBD speaker
//! (`common::nbd_raw`) for the handshake and transmission details and for hostile input. Every tool call is bounded
//! by coreutils' `timeout`, so a hung target fails a test instead of hanging CI.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use blkwire_wire::nbd::{self, cflag, chunk, cmd, info, opt, rep, tflag};
use common::nbd_raw::{be16, be32, be64, info_data, list_probe, meta_data, read_probe, Raw, Reply};
use common::{random_bytes, sparse_file, Target, TempDir};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Seconds any external tool may run before `timeout` kills it.
const TOOL_LIMIT: &str = "180";

// ---------------------------------------------------------------------------------------------
// Target and tools

/// A target with a native and an NBD listener; `nbd` is `nbd://127.0.0.1:PORT`.
struct NbdTarget {
    t: Target,
    nbd: String,
}

impl NbdTarget {
    fn start(exports: &[&str]) -> NbdTarget {
        Self::start_with(exports, &[])
    }

    fn start_with(exports: &[&str], extra: &[&str]) -> NbdTarget {
        let mut args = vec!["--listen", "nbd://127.0.0.1:0"];
        args.extend_from_slice(extra);
        let (t, urls) = Target::start_listeners(exports, &args);
        let nbd = urls
            .iter()
            .find(|u| u.starts_with("nbd://"))
            .unwrap_or_else(|| panic!("no nbd:// listener in {urls:?}"))
            .clone();
        NbdTarget { t, nbd }
    }

    /// `nbd://127.0.0.1:PORT/EXPORT`, the URI form every libnbd and qemu tool takes.
    fn uri(&self, export: &str) -> String {
        format!("{}/{export}", self.nbd)
    }

    /// `127.0.0.1:PORT`, for raw sockets.
    fn addr(&self) -> String {
        self.nbd.trim_start_matches("nbd://").to_string()
    }

    /// The target process is alive and a fresh nbdinfo gets the export's size.
    fn assert_serves(&mut self, export: &str, size: u64) {
        assert!(
            self.t.child.try_wait().expect("try_wait").is_none(),
            "the target process exited"
        );
        let out = tool("nbdinfo", &["--size", &self.uri(export)]);
        assert_eq!(out.trim(), size.to_string(), "nbdinfo --size {export}");
    }
}

fn command(prog: &str, args: &[&str]) -> Command {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", TOOL_LIMIT, prog])
        .args(args)
        .stdin(Stdio::null());
    c
}

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
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a tool; returns its output whatever the exit status.
fn run(prog: &str, args: &[&str]) -> Output {
    command(prog, args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {prog} (scripts/deps.sh installs it): {e}"))
}

/// Runs a tool that must succeed; returns its stdout.
fn tool(prog: &str, args: &[&str]) -> String {
    let out = run(prog, args);
    assert!(out.status.success(), "{}", describe(prog, args, &out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts a tool without waiting (for concurrent clients).
fn spawn(prog: &str, args: &[&str]) -> Child {
    command(prog, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"))
}

fn sha256(path: &Path) -> String {
    let out = tool("sha256sum", &[path.to_str().expect("utf-8 path")]);
    out.split_whitespace()
        .next()
        .expect("sha256sum output")
        .to_string()
}

/// qemu-io with `-f raw` and one `-c` per command; asserts success and that no pattern check
/// failed (qemu-io also exits non-zero then, but say which one).
fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut args = vec!["-f", "raw", uri];
    for c in cmds {
        args.extend(["-c", c]);
    }
    let out = run("qemu-io", &args);
    let text = describe("qemu-io", &args, &out);
    assert!(
        out.status.success() && !text.contains("Pattern verification failed"),
        "{text}"
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `nbdinfo --map --json`: (offset, length, type) with type bit 0 = hole, bit 1 = zero.
fn block_map(uri: &str) -> Vec<(u64, u64, u64)> {
    let text = tool("nbdinfo", &["--map", "--json", uri]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let map: Vec<(u64, u64, u64)> = v
        .as_array()
        .expect("map is a JSON array")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().expect("offset"),
                e["length"].as_u64().expect("length"),
                e["type"].as_u64().expect("type"),
            )
        })
        .collect();
    // The extents tile the export from 0 without gaps.
    let mut at = 0;
    for &(o, l, _) in &map {
        assert_eq!(o, at, "extents are contiguous: {map:?}");
        assert!(l > 0, "no empty extent: {map:?}");
        at += l;
    }
    map
}

fn type_at(map: &[(u64, u64, u64)], offset: u64) -> u64 {
    map.iter()
        .find(|&&(o, l, _)| o <= offset && offset < o + l)
        .unwrap_or_else(|| panic!("offset {offset} not in map {map:?}"))
        .2
}

const DATA: u64 = 0;
const HOLE_ZERO: u64 = 3;

fn fio_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("fio output");
    let at = text
        .find('{')
        .unwrap_or_else(|| panic!("no JSON in {text}"));
    serde_json::from_str(&text[at..]).unwrap_or_else(|e| panic!("{e}: {text}"))
}

// ---------------------------------------------------------------------------------------------
// Real clients

#[test]
fn nbdinfo_lists_exports_with_their_capabilities() {
    let d = TempDir::new("nbd-info");
    let img = d.path("f.img");
    sparse_file(&img, 32 * MIB);
    // A budget that holds 32 MiB requests twice per connection: the maximum told is 32 MiB
    // whatever the machine's memory (the default budget is a quarter of it).
    let t = NbdTarget::start_with(
        &[
            "disk0=mem:64M",
            &format!("f=file:{}", img.display()),
            "ro=mem:16M,ro",
        ],
        &["--max-memory", "1G"],
    );
    let text = tool("nbdinfo", &["--list", "--json", &t.nbd]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(v["protocol"], "newstyle-fixed");
    assert_eq!(v["TLS"], false);
    assert_eq!(v["structured"], true, "structured replies negotiated");
    let exports = v["exports"].as_array().expect("exports");
    let names: Vec<&str> = exports
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["disk0", "f", "ro"], "every export listed, in order");
    let get = |name: &str| exports.iter().find(|e| e["export-name"] == name).unwrap();
    // (size, flush/fua, read-only)
    for (name, size, durable, ro) in [
        ("disk0", 64 * MIB, false, false),
        ("f", 32 * MIB, true, false),
        ("ro", 16 * MIB, false, true),
    ] {
        let e = get(name);
        let flag = |k: &str| {
            e[k].as_bool()
                .unwrap_or_else(|| panic!("{name}: no boolean {k} in {e}"))
        };
        assert_eq!(e["export-size"], size, "{name} size");
        assert_eq!(flag("can_flush"), durable, "{name} can_flush");
        assert_eq!(flag("can_fua"), durable, "{name} can_fua");
        assert_eq!(flag("is_read_only"), ro, "{name} is_read_only");
        assert_eq!(flag("can_trim"), !ro, "{name} can_trim");
        assert_eq!(flag("can_zero"), !ro, "{name} can_zero");
        assert_eq!(flag("can_fast_zero"), !ro, "{name} can_fast_zero");
        assert!(flag("can_multi_conn"), "{name} can_multi_conn");
        assert!(flag("can_cache"), "{name} can_cache");
        assert!(flag("can_df"), "{name} can_df");
        assert!(!flag("is_rotational"), "{name} is_rotational");
        assert_eq!(e["block_size_minimum"], 1, "{name}: byte-granular I/O");
        assert_eq!(e["block_size_preferred"], 4096, "{name}");
        assert_eq!(e["block_size_maximum"], 32 * MIB, "{name}");
        assert_eq!(
            e["contexts"],
            serde_json::json!(["base:allocation"]),
            "{name} meta contexts"
        );
        // The size, never the backend's path (PROTOCOL.md §12: nothing about the host).
        let d = e["description"].as_str().unwrap();
        assert!(
            d.ends_with(" bytes") && !d.contains('/') && !d.contains(':'),
            "{name} description: {d}"
        );
    }
    // One export by name, and the default export ("" = the first one).
    assert_eq!(
        tool("nbdinfo", &["--size", &t.uri("f")]).trim(),
        (32 * MIB).to_string()
    );
    assert_eq!(
        tool("nbdinfo", &["--size", &t.nbd]).trim(),
        (64 * MIB).to_string()
    );
    // --can / --is exit 0 for true, 2 for false.
    let can = |what: &str, export: &str| run("nbdinfo", &[what, &t.uri(export)]).status.code();
    assert_eq!(can("--can=flush", "f"), Some(0));
    assert_eq!(can("--can=flush", "disk0"), Some(2));
    assert_eq!(can("--is=read-only", "ro"), Some(0));
    assert_eq!(can("--can=write", "ro"), Some(2));
    // An unknown export is an error, not a hang or a crash.
    let out = run("nbdinfo", &["--size", &t.uri("nope")]);
    assert!(!out.status.success(), "{}", describe("nbdinfo", &[], &out));
}

#[test]
fn nbdinfo_block_size_follows_o_direct_alignment() {
    let d = TempDir::new("nbd-direct");
    let img = d.path("d.img");
    sparse_file(&img, 16 * MIB);
    let t = NbdTarget::start(&[&format!("d=file:{}?direct=1", img.display())]);
    let v: Value = serde_json::from_str(&tool("nbdinfo", &["--json", &t.uri("d")])).unwrap();
    let e = &v["exports"][0];
    let min = e["block_size_minimum"].as_u64().unwrap();
    assert!(
        min >= 512 && min.is_power_of_two(),
        "O_DIRECT export needs aligned I/O: minimum {min}"
    );
    // qemu honours the minimum with read-modify-write: unaligned I/O from the user still works.
    qemu_io(
        &t.uri("d"),
        &[
            "write -P 0x42 512 512",
            "read -P 0x42 512 512",
            "read -P 0 0 512",
            "read -P 0 1024 3072",
        ],
    );
}

#[test]
fn nbdcopy_round_trip_keeps_sha256() {
    let d = TempDir::new("nbd-copy");
    let img = d.path("f.img");
    let size = 24 * MIB;
    sparse_file(&img, size);
    let src = d.path("src");
    std::fs::write(&src, random_bytes(size as usize, 31)).unwrap();
    let t = NbdTarget::start(&[&format!("f=file:{}", img.display()), "m=mem:24M"]);
    for export in ["f", "m"] {
        let back = d.path(&format!("back-{export}"));
        tool("nbdcopy", &[src.to_str().unwrap(), &t.uri(export)]);
        tool("nbdcopy", &[&t.uri(export), back.to_str().unwrap()]);
        assert_eq!(std::fs::metadata(&back).unwrap().len(), size);
        assert_eq!(sha256(&back), sha256(&src), "{export}: data changed");
    }
    // The file export wrote the file itself.
    assert_eq!(sha256(&img), sha256(&src), "backing file content");
    // Same export, both protocols: in through blkwire's own, out through NBD, and back.
    let src2 = d.path("src2");
    std::fs::write(&src2, random_bytes(size as usize, 32)).unwrap();
    let (ok, _, err) = common::cli(&["cp", src2.to_str().unwrap(), &t.t.url("m")]);
    assert!(ok, "blkwire cp in: {err}");
    let back = d.path("back-native");
    tool("nbdcopy", &[&t.uri("m"), back.to_str().unwrap()]);
    assert_eq!(sha256(&back), sha256(&src2), "native write, NBD read");
    tool("nbdcopy", &[src.to_str().unwrap(), &t.uri("m")]);
    let (ok, _, err) = common::cli(&["cp", &t.t.url("m"), back.to_str().unwrap()]);
    assert!(ok, "blkwire cp out: {err}");
    assert_eq!(sha256(&back), sha256(&src), "NBD write, native read");
}

#[test]
fn qemu_img_convert_then_compare() {
    let d = TempDir::new("nbd-qemu-img");
    let img = d.path("f.img");
    let size = 16 * MIB as usize;
    sparse_file(&img, size as u64);
    // Data with zero runs between, so qemu-img also sends zero writes (or skips them).
    let mut data = random_bytes(size, 7);
    data[MIB as usize..5 * MIB as usize].fill(0);
    data[9 * MIB as usize..9 * MIB as usize + 4096].fill(0);
    let src = d.path("src.raw");
    std::fs::write(&src, &data).unwrap();
    let t = NbdTarget::start(&[&format!("f=file:{}", img.display()), "m=mem:16M"]);
    for export in ["f", "m"] {
        let uri = t.uri(export);
        let info: Value = serde_json::from_str(&tool(
            "qemu-img",
            &["info", "--output=json", "-f", "raw", &uri],
        ))
        .unwrap();
        assert_eq!(info["virtual-size"], size as u64, "{export} size via qemu");
        // Non-zero everywhere first, so zero runs that convert failed to write would show.
        qemu_io(&uri, &["write -P 0xff 0 16M"]);
        tool(
            "qemu-img",
            &[
                "convert",
                "-n",
                "-f",
                "raw",
                "-O",
                "raw",
                src.to_str().unwrap(),
                &uri,
            ],
        );
        tool(
            "qemu-img",
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "raw",
                src.to_str().unwrap(),
                &uri,
            ],
        );
        // compare can fail: one changed byte is found.
        let mut other = data.clone();
        other[12 * MIB as usize + 77] ^= 1;
        let other_path = d.path("other.raw");
        std::fs::write(&other_path, &other).unwrap();
        let out = run(
            "qemu-img",
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "raw",
                other_path.to_str().unwrap(),
                &uri,
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "{}",
            describe("qemu-img compare (differing)", &[], &out)
        );
        // And back out through qemu.
        let back = d.path(&format!("back-{export}.raw"));
        tool(
            "qemu-img",
            &[
                "convert",
                "-f",
                "raw",
                "-O",
                "raw",
                &uri,
                back.to_str().unwrap(),
            ],
        );
        assert!(
            std::fs::read(&back).unwrap() == data,
            "{export}: download differs"
        );
    }
    assert!(std::fs::read(&img).unwrap() == data, "backing file content");
}

#[test]
fn qemu_io_patterns_discard_and_write_zeroes() {
    let d = TempDir::new("nbd-qemu-io");
    let img = d.path("f.img");
    sparse_file(&img, 16 * MIB);
    let mut t = NbdTarget::start(&[
        &format!("f=file:{}", img.display()),
        "m=mem:16M",
        "ro=mem:8M,ro",
    ]);
    for export in ["f", "m"] {
        let uri = t.uri(export);
        qemu_io(
            &uri,
            &[
                "write -P 0xa5 0 2M",
                "read -P 0xa5 0 2M",
                // FUA write (qemu-io -f), unaligned sizes and offsets.
                "write -f -P 0x3c 2M 64k",
                "write -P 0x17 3000 5000",
                "read -P 0x17 3000 5000",
                "read -P 0xa5 0 3000",
                "read -P 0xa5 8000 1M",
                "discard 1M 256k",
                // write -z: WRITE_ZEROES with NO_HOLE; -u lets the target punch a hole.
                "write -z 1M 512k",
                "write -z -u 1536k 256k",
                "read -P 0 1M 768k",
                "read -P 0xa5 1792k 256k",
                "read -P 0x3c 2M 64k",
                "flush",
            ],
        );
        // A new connection sees the same.
        qemu_io(
            &uri,
            &[
                "read -P 0x17 3000 5000",
                "read -P 0 1M 768k",
                "read -P 0x3c 2M 64k",
            ],
        );
    }
    // Read-only: qemu refuses to open it for writing (it sees READ_ONLY), and a write on a
    // read-only open fails; reads work.
    let uri = t.uri("ro");
    let out = run("qemu-io", &["-f", "raw", &uri, "-c", "write -P 1 0 4k"]);
    let text = describe("qemu-io", &["ro: write"], &out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("read-only") || text.contains("Permission denied"),
        "{text}"
    );
    let out = run(
        "qemu-io",
        &["-r", "-f", "raw", &uri, "-c", "write -P 1 0 4k"],
    );
    assert!(
        !out.status.success(),
        "{}",
        describe("qemu-io -r", &["write"], &out)
    );
    let out = run(
        "qemu-io",
        &["-r", "-f", "raw", &uri, "-c", "read -P 0 0 64k"],
    );
    assert!(
        out.status.success(),
        "{}",
        describe("qemu-io -r", &["read"], &out)
    );
    // The target itself refuses writes with EPERM (a client that ignores READ_ONLY).
    let (mut r, _, flags) = Raw::go(&t.addr(), "ro", false, false);
    assert_ne!(flags & tflag::READ_ONLY, 0);
    r.write(1, 0, &[7u8; 4096]);
    assert_eq!(r.reply().error(), nbd::err::EPERM, "WRITE on ro");
    r.request(cmd::TRIM, 0, 2, 0, 4096);
    assert_eq!(r.reply().error(), nbd::err::EPERM, "TRIM on ro");
    r.request(cmd::WRITE_ZEROES, 0, 3, 0, 4096);
    assert_eq!(r.reply().error(), nbd::err::EPERM, "WRITE_ZEROES on ro");
    r.request(cmd::READ, 0, 4, 0, 4096);
    let (e, c, data) = r.read_simple(4096);
    assert_eq!((e, c), (0, 4));
    assert!(data.iter().all(|b| *b == 0), "ro export unchanged");
    t.assert_serves("ro", 8 * MIB);
}

/// fio's nbd engine (libnbd, several requests in flight) writes random blocks with a CRC32C
/// header each, then reads everything back and checks it. `t` is RAM completed by a helper
/// thread: NBD's server-assigned slots over the asynchronous completion path.
#[test]
fn fio_verify_crc32c_on_mem_and_file() {
    let d = TempDir::new("nbd-fio");
    let img = d.path("f.img");
    sparse_file(&img, 32 * MIB);
    let t = NbdTarget::start(&[
        &format!("f=file:{}", img.display()),
        "m=mem:32M",
        "t=memthread:32M",
    ]);
    let cases: [(&str, &[&str]); 3] = [
        // Two jobs (two connections), each on its own 12 MiB, 4k blocks.
        (
            "m",
            &[
                "--bs=4k",
                "--numjobs=2",
                "--size=12M",
                "--offset_increment=16M",
            ],
        ),
        // One job, mixed block sizes.
        ("f", &["--bsrange=4k-128k", "--numjobs=1", "--size=24M"]),
        ("t", &["--bsrange=4k-128k", "--numjobs=1", "--size=24M"]),
    ];
    for (export, extra) in cases {
        let json = d.path(&format!("fio-{export}.json"));
        let uri = format!("--uri={}", t.uri(export));
        let output = format!("--output={}", json.display());
        let mut args = vec![
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--iodepth=16",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--do_verify=1",
            "--verify_fatal=1",
            "--group_reporting=0",
            "--output-format=json",
            &output,
        ];
        args.extend_from_slice(extra);
        tool("fio", &args);
        let v = fio_json(&json);
        let jobs = v["jobs"].as_array().expect("fio jobs");
        assert_eq!(jobs.len(), if export == "m" { 2 } else { 1 });
        for j in jobs {
            assert_eq!(j["error"], 0, "{export}: fio job error: {j}");
            let written = j["write"]["io_bytes"].as_u64().unwrap();
            let verified = j["read"]["io_bytes"].as_u64().unwrap();
            assert!(written > 0, "{export}: nothing written");
            assert_eq!(verified, written, "{export}: every written byte read back");
            assert_eq!(j["write"]["short_ios"].as_u64().unwrap_or(0), 0);
        }
    }
}

/// Structured replies and NBD_CMD_BLOCK_STATUS seen by libnbd: holes where nothing was written.
#[test]
fn nbdinfo_map_shows_holes_where_nothing_was_written() {
    let d = TempDir::new("nbd-map");
    let img = d.path("sparse.img");
    sparse_file(&img, 64 * MIB);
    // `t` answers allocation queries on its helper thread (the asynchronous query path).
    let t = NbdTarget::start(&[
        &format!("f=file:{}", img.display()),
        "m=mem:64M",
        "t=memthread:64M",
    ]);
    for export in ["m", "f", "t"] {
        let uri = t.uri(export);
        let map = block_map(&uri);
        assert_eq!(
            map,
            [(0, 64 * MIB, HOLE_ZERO)],
            "{export}: a fresh export is one hole"
        );
        qemu_io(&uri, &["write -P 0x11 8M 1M", "write -P 0x22 40M 64k"]);
        let map = block_map(&uri);
        for at in [8 * MIB, 9 * MIB - 1, 40 * MIB, 40 * MIB + 65535] {
            assert_eq!(
                type_at(&map, at),
                DATA,
                "{export}: written at {at}: {map:?}"
            );
        }
        // Far (more than a huge page) from anything written.
        for at in [0, 4 * MIB, 20 * MIB, 30 * MIB, 50 * MIB, 64 * MIB - 1] {
            assert_eq!(
                type_at(&map, at),
                HOLE_ZERO,
                "{export}: never written at {at}: {map:?}"
            );
        }
        // Trimming gives the pages back: a hole again.
        // (No read here: reads of holes are block_status_reports_holes_after_they_were_read.)
        qemu_io(&uri, &["discard 8M 1M"]);
        let map = block_map(&uri);
        assert_eq!(
            type_at(&map, 8 * MIB + 4096),
            HOLE_ZERO,
            "{export}: discarded: {map:?}"
        );
    }
}

/// Reading never-written blocks must not turn them into data in the allocation map (issue 3:
/// "holes and zero ranges of mem: exports"; README: "pages exist only where written").
#[test]
fn block_status_reports_holes_after_they_were_read() {
    let d = TempDir::new("nbd-map-read");
    let img = d.path("sparse.img");
    sparse_file(&img, 32 * MIB);
    let t = NbdTarget::start(&[&format!("f=file:{}", img.display()), "m=mem:32M"]);
    for export in ["f", "m"] {
        let uri = t.uri(export);
        qemu_io(&uri, &["write -P 0x11 4M 64k", "read -P 0 16M 1M"]);
        let map = block_map(&uri);
        assert_eq!(type_at(&map, 4 * MIB), DATA, "{export}: {map:?}");
        assert_eq!(
            type_at(&map, 16 * MIB),
            HOLE_ZERO,
            "{export}: a never-written range that was only read is reported as data: {map:?}"
        );
    }
}

/// Several connections write their own regions; one FLUSH; everything is visible to new
/// connections and, for a file, in the file.
#[test]
fn multi_conn_writes_then_flush_on_one_connection() {
    let d = TempDir::new("nbd-multi");
    let img = d.path("f.img");
    let size = 32 * MIB;
    sparse_file(&img, size);
    let t = NbdTarget::start(&[&format!("f=file:{}", img.display()), "m=mem:32M"]);
    let quarter = size / 4;
    for export in ["f", "m"] {
        let uri = t.uri(export);
        // (1) Four qemu-io processes at once, one quarter each, then a flush from a fifth.
        let children: Vec<(String, Child)> = (0..4u64)
            .map(|i| {
                let c = format!("write -P {:#x} {} {}", 0x40 + i, i * quarter, quarter);
                let child = spawn("qemu-io", &["-f", "raw", &uri, "-c", &c]);
                (c, child)
            })
            .collect();
        for (c, child) in children {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "{}", describe("qemu-io", &[&c], &out));
        }
        qemu_io(&uri, &["flush"]);
        let checks: Vec<String> = (0..4u64)
            .map(|i| format!("read -P {:#x} {} {}", 0x40 + i, i * quarter, quarter))
            .collect();
        let checks: Vec<&str> = checks.iter().map(String::as_str).collect();
        qemu_io(&uri, &checks);

        // (2) Raw: four connections open at once, each pipelines 16 x 64 KiB writes into its
        // quarter; FLUSH on connection 0 while the others stay open; a write from connection 1
        // is read back on connection 3.
        let (mut conns, flags): (Vec<Raw>, Vec<u16>) = (0..4)
            .map(|_| {
                let (r, s, flags) = Raw::go(&t.addr(), export, false, false);
                assert_eq!(s, size);
                assert_ne!(flags & tflag::CAN_MULTI_CONN, 0, "CAN_MULTI_CONN");
                (r, flags)
            })
            .unzip();
        // What (1) left, overwritten below by the raw writes.
        let mut expect: Vec<u8> = (0..size).map(|o| 0x40 + (o / quarter) as u8).collect();
        for (i, r) in conns.iter_mut().enumerate() {
            for k in 0..16u64 {
                let off = i as u64 * quarter + k * 3 * 65536;
                let data = random_bytes(65536, (i as u64) << 8 | k);
                expect[off as usize..off as usize + 65536].copy_from_slice(&data);
                r.write(k, off, &data);
            }
        }
        for (i, r) in conns.iter_mut().enumerate() {
            let mut seen: Vec<u64> = (0..16)
                .map(|_| r.reply())
                .map(|rep| {
                    assert_eq!(rep.error(), 0, "connection {i}: write failed");
                    rep.cookie()
                })
                .collect();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..16).collect::<Vec<_>>(),
                "connection {i}: one reply per write"
            );
        }
        // FLUSH where the export advertises it (file; RAM has nothing to make durable).
        let can_flush = flags[0] & tflag::SEND_FLUSH != 0;
        assert_eq!(can_flush, export == "f", "{export}: SEND_FLUSH");
        if can_flush {
            conns[0].request(cmd::FLUSH, 0, 99, 0, 0);
            let flushed = conns[0].reply();
            assert_eq!((flushed.error(), flushed.cookie()), (0, 99), "FLUSH");
        }
        let off = quarter + 5 * 3 * 65536;
        conns[3].request(cmd::READ, 0, 7, off, 65536);
        let (e, c, data) = conns[3].read_simple(65536);
        assert_eq!((e, c), (0, 7));
        assert!(
            data == random_bytes(65536, 1 << 8 | 5),
            "connection 3 sees connection 1's write"
        );
        // A brand-new client sees everything.
        let back = d.path(&format!("back-{export}"));
        tool("nbdcopy", &[&uri, back.to_str().unwrap()]);
        assert!(
            std::fs::read(&back).unwrap() == expect,
            "{export}: data from all connections"
        );
        if export == "f" {
            assert!(std::fs::read(&img).unwrap() == expect, "in the file");
        }
        for (i, mut r) in conns.into_iter().enumerate() {
            r.request(cmd::DISC, 0, 1000 + i as u64, 0, 0);
            r.assert_closed("after NBD_CMD_DISC", &[]);
        }

        // (3) nbdcopy with four connections (and a final flush where the export has one).
        let src = d.path("src");
        std::fs::write(&src, random_bytes(size as usize, 5)).unwrap();
        let mut args = vec!["--connections=4", "--requests=16"];
        if export == "f" {
            args.push("--flush");
        }
        args.extend([src.to_str().unwrap(), uri.as_str()]);
        tool("nbdcopy", &args);
        tool(
            "nbdcopy",
            &["--connections=1", &uri, back.to_str().unwrap()],
        );
        assert_eq!(
            sha256(&back),
            sha256(&src),
            "{export}: nbdcopy --connections=4"
        );
        if export == "f" {
            assert_eq!(sha256(&img), sha256(&src), "in the file");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw protocol: handshake and transmission details

/// NBD_OPT_SET_META_CONTEXT replaces what was selected also when it fails (proto.md): after a
/// SET naming an unknown export, base:allocation is no longer selected, and BLOCK_STATUS in
/// transmission is EINVAL.
#[test]
fn a_failed_set_meta_context_leaves_no_context_selected() {
    let t = NbdTarget::start(&["m=mem:16M"]);
    let mut r = Raw::open(&t.addr());
    r.option(opt::STRUCTURED_REPLY, &[]);
    assert_eq!(r.opt_reply().1, rep::ACK);
    r.option(
        opt::SET_META_CONTEXT,
        &meta_data("m", &[nbd::BASE_ALLOCATION]),
    );
    let (_, typ, d) = r.opt_reply();
    assert_eq!(typ, rep::META_CONTEXT);
    assert_eq!(be32(&d), nbd::BASE_ALLOCATION_ID);
    assert_eq!(r.opt_reply().1, rep::ACK);
    r.option(
        opt::SET_META_CONTEXT,
        &meta_data("nope", &[nbd::BASE_ALLOCATION]),
    );
    assert_eq!(r.opt_reply().1, rep::ERR_UNKNOWN);
    r.go_on("m");
    r.request(cmd::BLOCK_STATUS, 0, 1, 0, 4096);
    assert_eq!(
        r.reply().error(),
        nbd::err::EINVAL,
        "no context is selected"
    );
}

/// A context selected for one export is not the next export's: GO of another name enters
/// transmission with none (proto.md: a context id is valid for the export it was negotiated
/// for), and that export's BLOCK_STATUS is refused. The export it was selected for keeps it,
/// whichever name found it ("" is the default export, the first).
#[test]
fn a_meta_context_belongs_to_the_export_it_was_set_for() {
    let t = NbdTarget::start(&["m=mem:16M", "n=mem:16M"]);
    for (set, go, error) in [("m", "n", nbd::err::EINVAL), ("m", "m", 0), ("", "m", 0)] {
        let mut r = Raw::open(&t.addr());
        r.option(opt::STRUCTURED_REPLY, &[]);
        assert_eq!(r.opt_reply().1, rep::ACK);
        r.option(
            opt::SET_META_CONTEXT,
            &meta_data(set, &[nbd::BASE_ALLOCATION]),
        );
        assert_eq!(r.opt_reply().1, rep::META_CONTEXT);
        assert_eq!(r.opt_reply().1, rep::ACK);
        r.go_on(go);
        r.request(cmd::BLOCK_STATUS, 0, 1, 0, 4096);
        let c = r.chunk();
        let got = if c.typ == chunk::BLOCK_STATUS {
            0
        } else {
            be32(&c.payload)
        };
        assert_eq!(got, error, "BLOCK_STATUS after SET {set:?}, GO {go}: {c:?}");
    }
}

/// NBD_CMD_DISC has no reply, whatever flags it carries: the connection closes with nothing
/// sent (an unexpected flag made it an invalid command, answered EINVAL, the connection open).
#[test]
fn disc_with_flags_still_disconnects_without_a_reply() {
    use std::io::Read;
    let t = NbdTarget::start(&["m=mem:16M"]);
    let (mut r, _, _) = Raw::go(&t.addr(), "m", false, false);
    r.request(cmd::DISC, cflag::NO_HOLE, 1, 0, 0);
    let mut rest = Vec::new();
    r.0.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    r.0.read_to_end(&mut rest)
        .expect("the target closes the connection");
    assert!(rest.is_empty(), "DISC was answered: {rest:?}");
}

#[test]
fn option_haggling() {
    // A budget whose connection share (256 MiB) holds 32 MiB requests twice: the maximum
    // payload told is the protocol's 32 MiB (smaller shares are told less, hostile.rs).
    let t = NbdTarget::start_with(&["m=mem:16M", "ro=mem:8M,ro"], &["--max-memory", "1G"]);
    let mut r = Raw::open(&t.addr());
    // LIST: one SERVER reply per export, then ACK.
    r.option(opt::LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (o, typ, d) = r.opt_reply();
        assert_eq!(o, opt::LIST);
        match typ {
            rep::SERVER => {
                let n = be32(&d) as usize;
                names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
            }
            rep::ACK => break,
            t => panic!("LIST: reply {t:#x}"),
        }
    }
    assert_eq!(names, ["m", "ro"]);
    // Unknown options, TLS and extended headers are refused with an error; the session goes on.
    for o in [0x4242, opt::STARTTLS, opt::EXTENDED_HEADERS] {
        r.option(o, &[]);
        let (ro, typ, _) = r.opt_reply();
        assert_eq!(ro, o);
        assert!(
            typ == rep::ERR_UNSUP || (o == opt::STARTTLS && typ == rep::ERR_POLICY),
            "option {o}: reply {typ:#x}"
        );
    }
    // INFO on an unknown export: ERR_UNKNOWN.
    r.option(opt::INFO, &info_data("nope", &[]));
    assert_eq!(r.opt_reply().1, rep::ERR_UNKNOWN);
    // INFO with NAME, DESCRIPTION and BLOCK_SIZE.
    r.option(
        opt::INFO,
        &info_data("ro", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE]),
    );
    let mut got = HashMap::new();
    loop {
        let (o, typ, d) = r.opt_reply();
        assert_eq!(o, opt::INFO);
        if typ == rep::ACK {
            break;
        }
        assert_eq!(typ, rep::INFO, "{:?}", String::from_utf8_lossy(&d));
        got.insert(be16(&d), d[2..].to_vec());
    }
    let export = &got[&info::EXPORT];
    assert_eq!(be64(export), 8 * MIB);
    let flags = be16(&export[8..]);
    assert_ne!(flags & tflag::HAS_FLAGS, 0);
    assert_ne!(flags & tflag::READ_ONLY, 0);
    assert_eq!(flags & (tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES), 0);
    assert_eq!(got[&info::NAME], b"ro");
    assert!(String::from_utf8_lossy(&got[&info::DESCRIPTION]).ends_with(" bytes"));
    let bs = &got[&info::BLOCK_SIZE];
    assert_eq!(
        (be32(bs), be32(&bs[4..]), be32(&bs[8..])),
        (1, 4096, 32 << 20)
    );
    // Meta contexts: SET before STRUCTURED_REPLY is refused; LIST finds base:allocation.
    r.option(
        opt::SET_META_CONTEXT,
        &meta_data("m", &[nbd::BASE_ALLOCATION]),
    );
    assert_eq!(r.opt_reply().1, rep::ERR_INVALID);
    r.option(opt::LIST_META_CONTEXT, &meta_data("m", &["base:"]));
    let (_, typ, d) = r.opt_reply();
    assert_eq!(typ, rep::META_CONTEXT);
    assert_eq!(be32(&d), 0, "LIST answers with context id 0");
    assert_eq!(&d[4..], nbd::BASE_ALLOCATION.as_bytes());
    assert_eq!(r.opt_reply().1, rep::ACK);
    // An unknown context is not selected (just ACK).
    r.option(opt::STRUCTURED_REPLY, &[]);
    assert_eq!(r.opt_reply().1, rep::ACK);
    r.option(
        opt::SET_META_CONTEXT,
        &meta_data("m", &["qemu:dirty-bitmap:x"]),
    );
    assert_eq!(r.opt_reply().1, rep::ACK);
    // ABORT: acknowledged, then closed.
    r.option(opt::ABORT, &[]);
    let (o, typ, _) = r.opt_reply();
    assert_eq!((o, typ), (opt::ABORT, rep::ACK));
    r.assert_closed("after NBD_OPT_ABORT", &list_probe());
    // GO on an unknown export is an error and the client may try again.
    let mut r = Raw::open(&t.addr());
    r.option(opt::GO, &info_data("nope", &[]));
    assert_eq!(r.opt_reply().1, rep::ERR_UNKNOWN);
    r.option(opt::GO, &info_data("m", &[]));
    loop {
        let (_, typ, _) = r.opt_reply();
        if typ == rep::ACK {
            break;
        }
        assert_eq!(typ, rep::INFO);
    }
    r.request(cmd::READ, 0, 1, 0, 4096);
    assert_eq!(r.read_simple(4096).0, 0);
}

/// A GO the session limits refuse is answered with an error (not a closed connection after its
/// INFO replies), and the negotiation goes on.
#[test]
fn a_go_past_the_session_limit_gets_an_error_reply() {
    let t = NbdTarget::start_with(&["m=mem:1M"], &["--max-sessions", "1"]);
    let (_first, _, _) = Raw::go(&t.addr(), "m", false, false);
    let mut r = Raw::open(&t.addr());
    r.option(opt::GO, &info_data("m", &[]));
    let typ = loop {
        match r.opt_reply() {
            (o, rep::INFO, _) => assert_eq!(o, opt::GO),
            (o, typ, _) => {
                assert_eq!(o, opt::GO);
                break typ;
            }
        }
    };
    assert_eq!(typ, rep::ERR_POLICY, "GO past --max-sessions");
    // Still negotiating: ABORT is acknowledged.
    r.option(opt::ABORT, &[]);
    assert_eq!(r.opt_reply(), (opt::ABORT, rep::ACK, Vec::new()));
}

#[test]
fn export_name_enters_transmission_with_and_without_zeroes() {
    let t = NbdTarget::start(&["m=mem:16M"]);
    for no_zeroes in [true, false] {
        let mut r = Raw::greet(&t.addr());
        let flags = if no_zeroes {
            nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES
        } else {
            nbd::FLAG_FIXED_NEWSTYLE
        };
        r.send(&(flags as u32).to_be_bytes());
        r.option(opt::EXPORT_NAME, b"m");
        let d = r.read_n(if no_zeroes { 10 } else { 134 });
        assert_eq!(be64(&d), 16 * MIB);
        assert_ne!(be16(&d[8..]) & tflag::HAS_FLAGS, 0);
        assert!(d[10..].iter().all(|b| *b == 0), "124 zero bytes");
        r.write(1, 4096, &[0x5au8; 4096]);
        assert_eq!(r.reply().error(), 0);
        r.request(cmd::READ, 0, 2, 4096, 4096);
        let (e, c, data) = r.read_simple(4096);
        assert_eq!((e, c), (0, 2));
        assert!(data.iter().all(|b| *b == 0x5a));
    }
    // EXPORT_NAME cannot fail with an error reply: an unknown name closes the connection.
    let mut r = Raw::open(&t.addr());
    r.option(opt::EXPORT_NAME, b"nope");
    r.assert_closed("EXPORT_NAME of an unknown export", &read_probe());
}

#[test]
fn transmission_commands_and_errors() {
    let t = NbdTarget::start(&["m=mem:16M"]);
    let end = 16 * MIB;
    // Structured replies with base:allocation.
    let (mut r, size, flags) = Raw::go(&t.addr(), "m", true, true);
    assert_eq!(size, end);
    for f in [
        tflag::HAS_FLAGS,
        tflag::SEND_TRIM,
        tflag::SEND_WRITE_ZEROES,
        tflag::SEND_DF,
        tflag::CAN_MULTI_CONN,
        tflag::SEND_CACHE,
        tflag::SEND_FAST_ZERO,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} in {flags:#x}");
    }
    assert_eq!(flags & tflag::READ_ONLY, 0);
    let data = random_bytes(8192, 3);
    r.write(1, 4096, &data);
    let w = r.reply();
    assert_eq!((w.error(), w.cookie()), (0, 1));
    // READ: one OFFSET_DATA chunk (or several) flagged DONE at the end.
    r.request(cmd::READ, 0, 2, 4096, 8192);
    let (chunks, back) = r.read_structured(4096, 8192);
    assert!(back == data, "read back");
    assert!(chunks.iter().all(|c| c.cookie == 2));
    // DF: exactly one content chunk.
    r.request(cmd::READ, cflag::DF, 3, 0, 65536);
    let (chunks, back) = r.read_structured(0, 65536);
    let content = chunks
        .iter()
        .filter(|c| c.typ == chunk::OFFSET_DATA || c.typ == chunk::OFFSET_HOLE)
        .count();
    assert_eq!(content, 1, "DF: one content chunk: {chunks:?}");
    assert!(back[4096..12288] == data[..] && back[..4096].iter().all(|b| *b == 0));
    // READ past the end: an error chunk, EINVAL, and the connection goes on.
    r.request(cmd::READ, 0, 4, end - 4096, 8192);
    let c = r.chunk();
    assert!(c.is_error(), "{c:?}");
    assert_ne!(c.flags & chunk::FLAG_DONE, 0);
    assert_eq!((c.error(), c.cookie), (nbd::err::EINVAL, 4));
    // WRITE past the end: ENOSPC (or EINVAL), payload consumed.
    r.write(5, end - 4096, &[1u8; 8192]);
    let e = r.reply().error();
    assert!(e == nbd::err::ENOSPC || e == nbd::err::EINVAL, "error {e}");
    // Unknown command: EINVAL, connection goes on.
    r.request(42, 0, 6, 0, 4096);
    assert_eq!(r.reply().error(), nbd::err::EINVAL, "unknown command");
    // Zero-length write: not a disconnect.
    r.write(7, 0, &[]);
    let _ = r.reply();
    // FLUSH, CACHE, TRIM, WRITE_ZEROES (plain, NO_HOLE, FAST_ZERO).
    for (cookie, typ, flags, off, len) in [
        (8, cmd::FLUSH, 0, 0, 0),
        (9, cmd::CACHE, 0, 0, MIB as u32),
        (10, cmd::TRIM, 0, 4096, 4096),
        (11, cmd::WRITE_ZEROES, 0, 8192, 1024),
        (12, cmd::WRITE_ZEROES, cflag::NO_HOLE, 9216, 1024),
        (13, cmd::WRITE_ZEROES, cflag::FAST_ZERO, MIB, 4 * MIB as u32),
    ] {
        r.request(typ, flags, cookie, off, len);
        let rep = r.reply();
        assert_eq!(
            (rep.error(), rep.cookie()),
            (0, cookie),
            "command {typ} flags {flags}"
        );
    }
    r.request(cmd::READ, 0, 14, 4096, 8192);
    let (_, back) = r.read_structured(4096, 8192);
    assert!(back[..6144].iter().all(|b| *b == 0), "trimmed and zeroed");
    assert!(back[6144..] == data[6144..], "untouched tail");
    // BLOCK_STATUS with REQ_ONE: exactly one descriptor, no longer than asked.
    r.request(cmd::BLOCK_STATUS, cflag::REQ_ONE, 15, 12288, 65536);
    let reply = r.reply();
    let Reply::Structured(chunks) = reply else {
        panic!("BLOCK_STATUS needs a structured reply: {reply:?}")
    };
    assert_eq!(chunks.len(), 1);
    let c = &chunks[0];
    assert_eq!(c.typ, chunk::BLOCK_STATUS);
    assert_eq!(be32(&c.payload), nbd::BASE_ALLOCATION_ID);
    assert_eq!(c.payload.len(), 4 + 8, "REQ_ONE: one descriptor");
    let len = be32(&c.payload[4..]);
    assert!(len > 0 && len <= 65536, "descriptor length {len}");
    // Past the end: EINVAL.
    r.request(cmd::BLOCK_STATUS, 0, 16, end, 4096);
    assert_eq!(r.reply().error(), nbd::err::EINVAL);
    // DISC: no reply, the target closes.
    r.request(cmd::DISC, 0, 17, 0, 0);
    r.assert_closed("after NBD_CMD_DISC", &[]);

    // Simple replies: a failed READ carries no data; BLOCK_STATUS without a context is EINVAL.
    let (mut r, _, flags) = Raw::go(&t.addr(), "m", false, false);
    assert_eq!(
        flags & tflag::SEND_DF,
        0,
        "no DF without structured replies"
    );
    r.request(cmd::READ, 0, 1, end, 512);
    assert_eq!(r.read_simple(512).0, nbd::err::EINVAL);
    r.request(cmd::BLOCK_STATUS, 0, 2, 0, 4096);
    assert_eq!(r.reply().error(), nbd::err::EINVAL);
    r.request(cmd::READ, 0, 3, 4096, 8192);
    let (e, c, back) = r.read_simple(8192);
    assert_eq!((e, c), (0, 3));
    assert!(back[..6144].iter().all(|b| *b == 0) && back[6144..] == data[6144..]);
}

/// Issue 3: "STRUCTURED_REPLY with OFFSET_DATA / OFFSET_HOLE chunks": a read of a range that was
/// never written is answered with a hole chunk, not 64 KiB of zeros on the wire.
#[test]
fn structured_read_of_a_hole_uses_offset_hole() {
    let t = NbdTarget::start(&["m=mem:16M"]);
    let (mut r, _, _) = Raw::go(&t.addr(), "m", true, false);
    r.request(cmd::READ, 0, 1, 8 * MIB, 65536);
    let (chunks, data) = r.read_structured(8 * MIB, 65536);
    assert!(data.iter().all(|b| *b == 0));
    assert!(
        chunks.iter().any(|c| c.typ == chunk::OFFSET_HOLE),
        "no NBD_REPLY_TYPE_OFFSET_HOLE chunk for an unwritten range: {:?}",
        chunks
            .iter()
            .map(|c| (c.typ, c.payload.len()))
            .collect::<Vec<_>>()
    );
}

/// Many requests in flight on one connection against an async backend (file): every cookie
/// gets exactly one reply, data is right whatever the reply order.
#[test]
fn pipelined_requests_on_one_connection() {
    let d = TempDir::new("nbd-pipe");
    let img = d.path("f.img");
    sparse_file(&img, 64 * MIB);
    let t = NbdTarget::start(&[&format!("f=file:{}", img.display())]);
    let (mut r, _, _) = Raw::go(&t.addr(), "f", true, false);
    let n = 200u64; // more than the target's per-connection depth
    let len = 65536usize;
    for k in 0..n {
        r.write(k, k * len as u64, &random_bytes(len, 1000 + k));
    }
    let mut seen = vec![false; n as usize];
    for _ in 0..n {
        let rep = r.reply();
        assert_eq!(rep.error(), 0);
        let c = rep.cookie() as usize;
        assert!(!seen[c], "second reply for cookie {c}");
        seen[c] = true;
    }
    for k in 0..n {
        r.request(cmd::READ, 0, k, k * len as u64, len as u32);
    }
    // Structured READ replies are self-describing: collect chunks per cookie.
    let mut got: HashMap<u64, Vec<u8>> = HashMap::new();
    while got.len() < n as usize {
        let c = r.chunk();
        assert_eq!(c.typ, chunk::OFFSET_DATA, "{c:?}");
        assert_eq!(c.flags & chunk::FLAG_DONE, chunk::FLAG_DONE);
        assert_eq!(be64(&c.payload), c.cookie * len as u64, "offset echoed");
        assert!(got.insert(c.cookie, c.payload[8..].to_vec()).is_none());
    }
    for k in 0..n {
        assert!(got[&k] == random_bytes(len, 1000 + k), "read {k}");
    }
}

// ---------------------------------------------------------------------------------------------
// Hostile input: the right error or a closed connection; never a crash, never a hang of others

#[test]
fn bad_client_flags_close_the_connection() {
    let mut t = NbdTarget::start(&["m=mem:16M"]);
    // Without FIXED_NEWSTYLE (blkwire serves fixed newstyle only).
    let mut r = Raw::greet(&t.addr());
    r.send(&0u32.to_be_bytes());
    r.assert_closed("client flags 0", &list_probe());
    // Garbage instead of flags and options: an NBD request before any negotiation.
    let mut r = Raw::greet(&t.addr());
    r.send(&read_probe());
    r.assert_closed("a request instead of client flags", &list_probe());
    t.assert_serves("m", 16 * MIB);
}

/// doc/proto.md, "Client flags": "Clients MUST NOT set any other flags; the server MUST drop the
/// TCP connection if the client sets an unknown flag".
#[test]
fn unknown_client_flags_close_the_connection() {
    let mut t = NbdTarget::start(&["m=mem:16M"]);
    let mut r = Raw::greet(&t.addr());
    let flags = (nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES) as u32 | 1 << 7;
    r.send(&flags.to_be_bytes());
    r.assert_closed("client flags with unknown bit 7 (0x83)", &list_probe());
    t.assert_serves("m", 16 * MIB);
}

#[test]
fn bad_option_header_closes_the_connection() {
    let mut t = NbdTarget::start(&["m=mem:16M"]);
    let mut bad = list_probe();
    bad[0] ^= 0xff;
    let mut r = Raw::open(&t.addr());
    r.send(&bad);
    r.assert_closed("option header with a bad magic", &list_probe());
    // An I/O request before negotiation (after the client flags).
    let mut r = Raw::open(&t.addr());
    r.send(&read_probe());
    r.assert_closed("a request during option haggling", &list_probe());
    t.assert_serves("m", 16 * MIB);
}

#[test]
fn oversize_option_gets_err_too_big_and_the_session_goes_on() {
    let mut t = NbdTarget::start(&["m=mem:16M"]);
    let mut r = Raw::open(&t.addr());
    // Far beyond any sane option (export names are at most 4 KiB); sent in full.
    r.option(opt::GO, &vec![0x61u8; 1 << 20]);
    let (o, typ, _) = r.opt_reply();
    assert_eq!((o, typ), (opt::GO, rep::ERR_TOO_BIG));
    // Still negotiating: a normal GO and I/O work.
    r.option(opt::GO, &info_data("m", &[]));
    loop {
        let (_, typ, _) = r.opt_reply();
        if typ == rep::ACK {
            break;
        }
        assert_eq!(typ, rep::INFO);
    }
    r.write(1, 0, &[3u8; 4096]);
    assert_eq!(r.reply().error(), 0);
    // EXPORT_NAME has no error reply: an oversize one closes the connection (proto.md); ABORT
    // is acknowledged whatever its data, then closed.
    let mut r = Raw::open(&t.addr());
    r.option(opt::EXPORT_NAME, &vec![0x61u8; 1 << 20]);
    r.assert_closed("after an oversize EXPORT_NAME", &list_probe());
    let mut r = Raw::open(&t.addr());
    r.option(opt::ABORT, &vec![0u8; 1 << 20]);
    assert_eq!(r.opt_reply().1, rep::ACK, "an oversize ABORT");
    r.assert_closed("after an oversize ABORT", &list_probe());
    t.assert_serves("m", 16 * MIB);
}

#[test]
fn bad_requests_after_go_close_only_that_connection() {
    let mut t = NbdTarget::start(&["m=mem:16M"]);
    // A bystander connection, open throughout.
    let (mut other, _, _) = Raw::go(&t.addr(), "m", false, false);
    other.write(1, 0, &[0x77u8; 4096]);
    assert_eq!(other.reply().error(), 0);

    // Bad request magic (after one good request).
    let (mut r, _, _) = Raw::go(&t.addr(), "m", false, false);
    r.request(cmd::READ, 0, 1, 0, 512);
    assert_eq!(r.read_simple(512).0, 0);
    let mut bad = read_probe();
    bad[..4].copy_from_slice(&nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
    r.send(&bad);
    r.assert_closed("request with a bad magic", &read_probe());

    // A WRITE claiming more than 64 MiB (what a client that did not ask for the block size
    // constraints may send): closed without waiting for it.
    let (mut r, _, _) = Raw::go(&t.addr(), "m", false, false);
    r.request(cmd::WRITE, 0, 1, 0, (64 << 20) + 512);
    r.assert_closed("WRITE of 64 MiB + 512", &read_probe());
    // A client that asked for them agreed to the advertised maximum (32 MiB at most).
    let mut r = go_asking_block_size(&t.addr(), "m");
    r.request(cmd::WRITE, 0, 1, 0, (32 << 20) + 512);
    r.assert_closed(
        "WRITE of 32 MiB + 512 after NBD_INFO_BLOCK_SIZE",
        &read_probe(),
    );

    // Same on a structured connection.
    let (mut r, _, _) = Raw::go(&t.addr(), "m", true, true);
    r.request(cmd::WRITE, 0, 1, 0, u32::MAX);
    r.assert_closed("WRITE of 4 GiB", &read_probe());

    // The bystander is unaffected.
    other.request(cmd::READ, 0, 2, 0, 4096);
    let (e, c, data) = other.read_simple(4096);
    assert_eq!((e, c), (0, 2));
    assert!(data.iter().all(|b| *b == 0x77));
    t.assert_serves("m", 16 * MIB);
}

#[test]
fn disconnect_mid_request_leaves_the_target_serving() {
    let d = TempDir::new("nbd-cut");
    let img = d.path("f.img");
    sparse_file(&img, 16 * MIB);
    let mut t = NbdTarget::start(&["m=mem:16M", &format!("f=file:{}", img.display())]);
    let (mut other, _, _) = Raw::go(&t.addr(), "f", false, false);
    for export in ["m", "f"] {
        // Half a WRITE payload, then gone.
        let (mut r, _, _) = Raw::go(&t.addr(), export, false, false);
        let mut b = nbd::Request {
            flags: 0,
            typ: cmd::WRITE,
            cookie: 1,
            offset: 0,
            length: 1 << 20,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(&vec![9u8; 512 << 10]);
        r.send(&b);
        drop(r);
        // Half a request header.
        let (mut r, _, _) = Raw::go(&t.addr(), export, true, false);
        r.send(&read_probe()[..10]);
        drop(r);
        // Requests in flight (pipelined reads and writes), then gone without reading replies.
        let (mut r, _, _) = Raw::go(&t.addr(), export, false, false);
        for k in 0..64 {
            r.write(k, k * 65536, &[k as u8; 65536]);
            r.request(cmd::READ, 0, 1000 + k, k * 65536, 65536);
        }
        drop(r);
        // Half an option header during the handshake.
        let mut r = Raw::open(&t.addr());
        r.send(&list_probe()[..7]);
        drop(r);
        // Gone right after the greeting.
        drop(Raw::greet(&t.addr()));
    }
    // Past the 4 MiB the pipelined writes above cover: requests a connection sent before it
    // went away may still be running (what a target received before an orderly close is
    // executed), so a write of theirs to the same place could land after this one.
    const AT: u64 = 8 * MIB;
    other.write(1, AT, &[0x66u8; 4096]);
    assert_eq!(other.reply().error(), 0);
    other.request(cmd::READ, 0, 2, AT, 4096);
    let (e, _, data) = other.read_simple(4096);
    assert_eq!(e, 0);
    assert!(data.iter().all(|b| *b == 0x66));
    t.assert_serves("m", 16 * MIB);
    t.assert_serves("f", 16 * MIB);
}

/// SIGTERM with NBD requests in flight: what the target received is answered, then it closes the
/// connection and exits 0; every acknowledged write is in the file.
#[test]
fn sigterm_answers_received_nbd_requests_then_exits_0() {
    let d = TempDir::new("nbd-term");
    let img = d.path("f.img");
    sparse_file(&img, 16 * MIB);
    let mut t = NbdTarget::start(&[&format!("f=file:{}", img.display())]);
    let (mut r, _, _) = Raw::go(&t.addr(), "f", false, false);
    let n = 128u64;
    for k in 0..n {
        r.write(k, k * 65536, &[k as u8 + 1; 65536]);
    }
    // One reply proves the target is reading this connection's requests.
    let first = r.reply();
    assert_eq!(first.error(), 0);
    let mut acked = vec![first.cookie()];
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(t.t.pid(), libc::SIGTERM) }, 0);
    while let Some(rep) = r.try_reply() {
        let e = rep.error();
        assert!(
            e == 0 || e == nbd::err::ESHUTDOWN,
            "error {e} during shutdown"
        );
        assert!(rep.cookie() < n && !acked.contains(&rep.cookie()));
        if e == 0 {
            acked.push(rep.cookie());
        }
    }
    let status = t.t.child.wait().unwrap();
    assert!(status.success(), "exit status after SIGTERM: {status:?}");
    let file = std::fs::read(&img).unwrap();
    for &k in &acked {
        let at = (k * 65536) as usize;
        assert!(
            file[at..at + 65536].iter().all(|b| *b == k as u8 + 1),
            "acknowledged write {k} lost"
        );
    }
}

/// WRITE headers announcing 32 MiB that never send a byte of it: the target commits memory for
/// what arrives, not for what a header promises (20 of them took 663 MB before).
#[test]
fn write_headers_without_their_data_commit_no_memory() {
    // One reactor: it takes every connection's bytes in the order they came, so once the
    // probe below is answered, every header before it has been seen.
    let (t, urls) = Target::start_listeners(
        &["m=mem:64M"],
        &["--listen", "nbd://127.0.0.1:0", "--threads", "1"],
    );
    let nbd = urls
        .iter()
        .find(|u| u.starts_with("nbd://"))
        .unwrap()
        .clone();
    let t = NbdTarget { t, nbd };
    let before = common::rss_kib(t.t.pid() as u32);
    let mut conns: Vec<Raw> = (0..20)
        .map(|_| Raw::go(&t.addr(), "m", false, false).0)
        .collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.request(cmd::WRITE, 0, i as u64, 0, 32 << 20);
        c.send(&[0x5a; 4096]); // a little of the data, so the target is mid-frame
    }
    let (mut probe, _, _) = Raw::go(&t.addr(), "m", false, false);
    probe.request(cmd::FLUSH, 0, 99, 0, 0);
    assert_eq!(probe.reply().error(), 0);
    let after = common::rss_kib(t.t.pid() as u32);
    assert!(
        after < before + 64 * 1024,
        "target RSS grew from {before} KiB to {after} KiB for 20 announced 32 MiB writes"
    );
    drop(conns);
}

/// OPT_GO that asks for NBD_INFO_BLOCK_SIZE (so the client agrees to the advertised maximum).
fn go_asking_block_size(addr: &str, export: &str) -> Raw {
    let mut r = Raw::open(addr);
    r.option(opt::GO, &info_data(export, &[info::BLOCK_SIZE]));
    loop {
        match r.opt_reply().1 {
            rep::ACK => return r,
            rep::INFO => {}
            t => panic!("GO: reply {t:#x}"),
        }
    }
}

/// A client that did not ask for the block size constraints never agreed to the advertised
/// 32 MiB maximum: like nbdkit, requests up to 64 MiB are served (some clients send them).
#[test]
fn requests_up_to_64_mib_without_block_size_negotiation() {
    let t = NbdTarget::start(&["m=mem:128M"]);
    let data = random_bytes(48 << 20, 64);
    for structured in [false, true] {
        let (mut r, _, _) = Raw::go(&t.addr(), "m", structured, false);
        r.write(1, 4096, &data);
        assert_eq!(r.reply().error(), 0, "WRITE of 48 MiB");
        r.request(cmd::READ, 0, 2, 4096, data.len() as u32);
        let back = if structured {
            r.read_structured(4096, data.len()).1
        } else {
            let (e, c, back) = r.read_simple(data.len());
            assert_eq!((e, c), (0, 2));
            back
        };
        assert!(back == data, "READ of 48 MiB returned what was written");
    }
}

/// Requests a client sent before DISC and its half-close (shutdown of its sending side) are
/// answered even when they must wait for memory other connections hold: the connection waits
/// for it as a live one would. It closed once nothing was in flight, the requests that waited
/// (and the DISC behind them) still in its receive buffer, unanswered. (More requests than the
/// connection has slots: the end of the stream is read while the first ones run, and the
/// last one waits for memory only after that.)
#[test]
fn requests_before_a_half_close_are_answered_when_memory_comes_back() {
    use std::io::{Read, Write};
    let (t, urls) = Target::start_listeners(
        &["m=memthread:64M", "h=mem:64M"],
        &["--max-memory", "64M", "--listen", "nbd://127.0.0.1:0"],
    );
    let addr = urls[1].trim_start_matches("nbd://");
    const LEN: u32 = 8 << 20;
    // Within one connection's share, beyond what its floor holds.
    const BIG: u32 = 4 << 20;
    let used = || -> u64 {
        let (ok, out, err) = common::cli(&["stats", &t.base, "--json"]);
        assert!(ok, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        v["memory"]["used"].as_u64().unwrap()
    };
    // Connections that ask for more than their shares and read no reply: they hold the budget.
    let mut hogs: Vec<Raw> = (0..6)
        .map(|_| {
            let (mut r, _, _) = Raw::go(addr, "h", false, false);
            for k in 0..4 {
                r.request(cmd::READ, 0, k, k * u64::from(LEN), LEN);
            }
            r
        })
        .collect();
    assert!(
        common::wait_until(std::time::Duration::from_secs(20), || used() >= 44 * MIB),
        "the budget never filled: {} bytes used",
        used()
    );
    // An NBD connection's slots (NBD_DEPTH, crates/server/src/nbd.rs).
    let small = 128u64;
    let request = |typ: u16, cookie: u64, offset: u64, len: u32| {
        let r = nbd::Request {
            flags: 0,
            typ,
            cookie,
            offset,
            length: len,
        };
        r.encode().to_vec()
    };
    let mut all = Vec::new();
    for k in 0..small {
        all.extend(request(cmd::READ, k, k * 4096, 4096));
    }
    all.extend(request(cmd::READ, small, 0, BIG));
    all.extend(request(cmd::DISC, small + 1, 0, 0));
    let (mut b, _, _) = Raw::go(addr, "m", false, false);
    b.0.write_all(&all).unwrap();
    b.0.shutdown(std::net::Shutdown::Write).unwrap();
    // Each hog reads its replies now (side by side: one waiting for memory another holds
    // must not wait for that one to be read first).
    let readers: Vec<_> = hogs
        .drain(..)
        .map(|mut r| {
            std::thread::spawn(move || {
                for _ in 0..4 {
                    assert_eq!(r.read_simple(LEN as usize).0, 0);
                }
            })
        })
        .collect();
    for h in readers {
        h.join().unwrap();
    }
    let mut answered = std::collections::HashSet::new();
    for _ in 0..small {
        let (e, c, _) = b.read_simple(4096);
        assert_eq!(e, 0);
        answered.insert(c);
    }
    assert_eq!(answered.len() as u64, small);
    let (e, c, _) = b.read_simple(BIG as usize);
    assert_eq!((e, c), (0, small), "the READ that waited for memory");
    let mut rest = Vec::new();
    b.0.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "nothing answers DISC: {} bytes",
        rest.len()
    );
}

/// A READ larger than one connection's share of the memory budget (a quarter of 64 MiB) could
/// never be served: it gets ENOMEM at once instead of waiting for memory forever, and the
/// connection goes on.
#[test]
fn a_read_larger_than_a_connections_memory_share_gets_enomem() {
    let (t, urls) = Target::start_listeners(
        &["m=mem:64M"],
        &["--max-memory", "64M", "--listen", "nbd://127.0.0.1:0"],
    );
    let addr = urls[1].trim_start_matches("nbd://");
    let (mut r, _, _) = Raw::go(addr, "m", false, false);
    r.request(cmd::READ, 0, 1, 0, 32 << 20);
    let (e, c, _) = r.read_simple(32 << 20);
    assert_eq!((e, c), (nbd::err::ENOMEM, 1));
    r.request(cmd::READ, 0, 2, 0, 1 << 20);
    let (e, c, _) = r.read_simple(1 << 20);
    assert_eq!((e, c), (0, 2), "the connection goes on");
    drop(t);
}
