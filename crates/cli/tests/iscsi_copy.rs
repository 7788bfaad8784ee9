//! `qemu-img convert -C` between two LUNs of one blkwire target over `iscsi://` (issue 17):
//! qemu's libiscsi driver offloads the copy as one EXTENDED COPY (LID1: two identification
//! descriptors naming the LUNs by their VPD 0x83 designators, block-to-block segments) per
//! chunk, sent to the destination LUN, so the data never crosses the network. The copy must be
//! exact, and the bytes on the wire (counted by a relay between qemu-img and the target, both
//! directions, every connection) and the target's own READ/WRITE counters (`blkwire stats`)
//! must stay far below the data size, while its COPY counter shows the whole size copied inside.
//! (qemu-img falls back to reading and writing the data itself, silently, when the target refuses
//! EXTENDED COPY: the copy is then still correct, and only the byte counts tell.)
//!
//! Needs qemu-img with qemu-block-extra's iscsi driver (scripts/deps.sh installs them); without
//! it the test fails and says so.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{cli, random_bytes, sha256, sparse_file, Target, TempDir};

const MIB: u64 = 1 << 20;
/// Data copied: large enough that moving it through the initiator would dwarf the commands.
const SIZE: u64 = 32 * MIB;
/// The most the copy may put on the wire, both directions together: logins, inquiries, the
/// EXTENDED COPY commands and their status (under 8 KiB when written), far below the data
/// (moving it would cost 2 x SIZE).
const WIRE_LIMIT: u64 = SIZE / 256;

/// A TCP relay on 127.0.0.1 to `upstream` that counts every byte it forwards, both directions,
/// on every connection. Its threads end with their connections (the listener's with the test).
fn counting_relay(upstream: SocketAddr) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
    let addr = listener.local_addr().unwrap();
    let total = Arc::new(AtomicU64::new(0));
    let counted = total.clone();
    std::thread::spawn(move || {
        for down in listener.incoming() {
            let Ok(down) = down else { return };
            let Ok(up) = TcpStream::connect(upstream) else {
                return;
            };
            let _ = down.set_nodelay(true);
            let _ = up.set_nodelay(true);
            let pairs = [
                (down.try_clone().unwrap(), up.try_clone().unwrap()),
                (up, down),
            ];
            for (mut from, mut to) in pairs {
                let counted = counted.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                counted.fetch_add(n as u64, Ordering::Relaxed);
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    (addr, total)
}

/// A counter summed over the target's live queues and the closed ones.
fn counter(stats: &serde_json::Value, name: &str) -> u64 {
    let closed = stats["closed"][name].as_u64().unwrap_or(0);
    let live: u64 = stats["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["queues"].as_array().into_iter().flatten())
        .map(|q| q[name].as_u64().unwrap_or(0))
        .sum();
    closed + live
}

fn require_qemu_iscsi() {
    let out = Command::new("qemu-img").arg("--help").output().unwrap_or_else(|e| {
        panic!("qemu-img not found ({e}): this test needs qemu-utils and qemu-block-extra (scripts/deps.sh installs them)")
    });
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.lines()
            .any(|l| l.starts_with("Supported formats:") && l.split_whitespace().any(|f| f == "iscsi")),
        "qemu-img has no iscsi driver: this test needs qemu-block-extra (scripts/deps.sh installs it)"
    );
}

#[test]
fn qemu_img_convert_offloads_the_copy_between_two_luns() {
    require_qemu_iscsi();
    let dir = TempDir::new("iscsi-copy");
    let src = dir.path("src.img");
    let dst = dir.path("dst.img");
    std::fs::write(&src, random_bytes(SIZE as usize, 17)).unwrap();
    sparse_file(&dst, SIZE);
    let (t, urls) = Target::start_listeners(
        &[
            &format!("src=file:{}", src.display()),
            &format!("dst=file:{}", dst.display()),
        ],
        &["--listen", "iscsi://127.0.0.1:0"],
    );
    let iscsi = urls
        .iter()
        .find_map(|u| u.strip_prefix("iscsi://"))
        .unwrap_or_else(|| panic!("no iscsi:// listener among {urls:?}"));
    let (relay, wire) = counting_relay(iscsi.parse().expect("iscsi listener address"));
    let lun = |export: &str| format!("iscsi://{relay}/iqn.2026-11.io.blkwire:{export}/0");

    let out = Command::new("qemu-img")
        .args(["convert", "-C", "-n", "-f", "raw", "-O", "raw"])
        .arg(lun("src"))
        .arg(lun("dst"))
        .output()
        .expect("run qemu-img");
    assert!(
        out.status.success(),
        "qemu-img convert -C {} {} failed ({}): {}{}",
        lun("src"),
        lun("dst"),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        sha256(&dst),
        sha256(&src),
        "the destination LUN's file differs from the source after the copy"
    );

    let on_wire = wire.load(Ordering::Relaxed);
    assert!(
        on_wire > 0,
        "the relay counted no bytes: qemu-img did not go through it"
    );
    assert!(
        on_wire < WIRE_LIMIT,
        "{on_wire} bytes crossed the wire to copy {SIZE} bytes (limit {WIRE_LIMIT}): the data went through the initiator"
    );

    let (ok, text, err) = cli(&["stats", &t.base, "--json"]);
    assert!(ok, "blkwire stats failed: {err}");
    let stats: serde_json::Value = serde_json::from_str(&text).expect("stats JSON");
    let moved = counter(&stats, "bytes_read") + counter(&stats, "bytes_written");
    assert!(
        moved < WIRE_LIMIT,
        "the target counted {moved} bytes of READ/WRITE data for a {SIZE}-byte copy: {text}"
    );
    let copied = counter(&stats, "bytes_copied");
    assert_eq!(
        copied, SIZE,
        "the target's COPY counter says {copied} bytes were copied inside it, not {SIZE}: {text}"
    );
    eprintln!(
        "qemu-img convert -C: {SIZE} bytes copied inside the target; {on_wire} bytes on the wire, {moved} bytes of READ/WRITE data"
    );
}
