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

use blkwire_wire::iscsi::{op, Digests, RESERVED_TAG};
use common::iscsi_host::{iscsi_listener, login, login_as, prout, Conn};
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

/// The NAA designator of the LU `c` addresses (the first designator of VPD 83h).
fn naa(c: &mut Conn) -> u64 {
    let (status, data, _) = c.scsi(&[0x12, 0x01, 0x83, 0, 255, 0], 255);
    assert_eq!(status, 0, "INQUIRY VPD 83h");
    assert_eq!(
        (data[1], data[4] & 0x0f, data[5] & 0x0f, data[7]),
        (0x83, 1, 3, 8)
    );
    u64::from_be_bytes(data[8..16].try_into().unwrap())
}

/// An identification descriptor target descriptor (E4h) naming the LU of NAA `naa`, of
/// `block_size`-byte blocks.
fn copy_target(naa: u64, block_size: u32) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[0] = 0xE4;
    d[4..8].copy_from_slice(&[0x01, 0x03, 0x00, 0x08]);
    d[8..16].copy_from_slice(&naa.to_be_bytes());
    d[28..32].copy_from_slice(&block_size.to_be_bytes());
    d
}

/// A LID1 parameter list of `targets` and one block-to-block segment from target 0 to target 1.
fn copy_list(targets: [[u8; 32]; 2], blocks: u16, dc: bool, src_lba: u64, dst_lba: u64) -> Vec<u8> {
    let mut v = vec![0u8; 16];
    v[1] = 0x18; // LIST ID USAGE 11b: no list identifier
    v[2..4].copy_from_slice(&64u16.to_be_bytes());
    v[8..12].copy_from_slice(&28u32.to_be_bytes());
    v.extend_from_slice(&targets[0]);
    v.extend_from_slice(&targets[1]);
    let mut seg = [0u8; 28];
    seg[0] = 0x02;
    seg[1] = if dc { 0x02 } else { 0 };
    seg[2..4].copy_from_slice(&0x18u16.to_be_bytes());
    seg[6..8].copy_from_slice(&1u16.to_be_bytes());
    seg[10..12].copy_from_slice(&blocks.to_be_bytes());
    seg[12..20].copy_from_slice(&src_lba.to_be_bytes());
    seg[20..28].copy_from_slice(&dst_lba.to_be_bytes());
    v.extend_from_slice(&seg);
    v
}

/// EXTENDED COPY (LID1) of `list` to the LU `c` addresses, its list sent as the R2Ts ask: the
/// SCSI status and (CHECK CONDITION) the sense key, ASC and ASCQ.
fn extended_copy(c: &mut Conn, list: &[u8]) -> (u8, Option<(u8, u8, u8)>) {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x83;
    cdb[10..14].copy_from_slice(&(list.len() as u32).to_be_bytes());
    let (itt, pdu) = c.command(&cdb, list.len() as u32, true, &[]);
    c.send(&pdu).unwrap();
    if !c.initial_r2t {
        c.data_out(
            itt,
            RESERVED_TAG,
            0,
            list.len().min(c.first_burst as usize),
            list,
        );
    }
    loop {
        let r = c.recv().expect("an answer to EXTENDED COPY");
        assert_eq!(r.word(16), itt);
        match r.opcode() {
            op::R2T => {
                let (ttt, at, len) = (r.word(20), r.word(40) as usize, r.word(44) as usize);
                c.data_out(itt, ttt, at, at + len, list);
            }
            op::SCSI_RSP => {
                // Sense data comes with CHECK CONDITION only (not RESERVATION CONFLICT).
                let sense = (r.bhs[3] == 2).then(|| (r.data[4] & 0x0f, r.data[14], r.data[15]));
                return (r.bhs[3], sense);
            }
            other => panic!("unexpected opcode {other:#x} during EXTENDED COPY"),
        }
    }
}

/// EXTENDED COPY between LUs of different block sizes (a `mem:` LU of 512-byte blocks, an
/// O_DIRECT `file:` LU of 4096-byte blocks): a segment's NUMBER OF BLOCKS counts the source's
/// blocks with DC clear and the destination's with DC set, and exactly those bytes are copied,
/// in both directions, with nothing beyond them touched; a count that is not a whole number of
/// blocks of the other LU is refused (INVALID FIELD IN PARAMETER LIST) and writes nothing.
#[test]
fn extended_copy_between_block_sizes_copies_the_bytes_asked() {
    const KIB: usize = 1024;
    let dir = TempDir::new("iscsi-copy-bs");
    let big = dir.path("big.img");
    let fill = vec![0xEEu8; 64 * KIB];
    std::fs::write(&big, &fill).unwrap();
    let (_t, urls) = Target::start_listeners(
        &[
            "small=mem:64K",
            &format!("big=file:{}?direct=1", big.display()),
        ],
        &["--listen", "iscsi://127.0.0.1:0"],
    );
    let iscsi = iscsi_listener(&urls);
    let target = |export: &str| format!("iqn.2026-11.io.blkwire:{export}");
    let mut small = login(iscsi, &target("small"), Digests::default());
    let mut big_c = login(iscsi, &target("big"), Digests::default());
    let data = random_bytes(64 * KIB, 29);
    assert_eq!(small.write(0, &data), 0, "WRITE to the 512-byte LU");
    let small_t = copy_target(naa(&mut small), 512);
    let big_t = copy_target(naa(&mut big_c), 4096);

    // 512 -> 4096, into the 4096-byte LU: 8 source blocks (DC=0) or 1 destination block
    // (DC=1) are 4 KiB.
    let mut want = fill.clone();
    for (blocks, dc, src_lba, dst_lba) in [(8, false, 8, 1), (1, true, 24, 3)] {
        let list = copy_list([small_t, big_t], blocks, dc, src_lba, dst_lba);
        assert_eq!(extended_copy(&mut big_c, &list), (0, None), "DC={dc}");
        let (from, to) = (src_lba as usize * 512, dst_lba as usize * 4096);
        want[to..to + 4 * KIB].copy_from_slice(&data[from..from + 4 * KIB]);
        assert!(
            std::fs::read(&big).unwrap() == want,
            "DC={dc}, {blocks} block(s): the 4096-byte LU holds other than the 4 KiB asked"
        );
    }
    // 7 source blocks are not a whole destination block: refused, nothing written.
    let list = copy_list([small_t, big_t], 7, false, 0, 5);
    assert_eq!(extended_copy(&mut big_c, &list), (2, Some((5, 0x26, 0))));
    assert!(std::fs::read(&big).unwrap() == want, "a refused copy wrote");

    // 4096 -> 512, into the 512-byte LU: 1 source block (DC=0) or 8 destination blocks (DC=1).
    let mut want_small = data.clone();
    for (blocks, dc, src_lba, dst_lba) in [(1, false, 1, 40), (8, true, 3, 100)] {
        let list = copy_list([big_t, small_t], blocks, dc, src_lba, dst_lba);
        assert_eq!(extended_copy(&mut small, &list), (0, None), "DC={dc}");
        let (from, to) = (src_lba as usize * 4096, dst_lba as usize * 512);
        want_small[to..to + 4 * KIB].copy_from_slice(&want[from..from + 4 * KIB]);
        let (got, status) = small.read(0, 128);
        assert_eq!(status, 0);
        assert!(
            got == want_small,
            "DC={dc}, {blocks} block(s): the 512-byte LU holds other than the 4 KiB asked"
        );
    }
    let list = copy_list([big_t, small_t], 7, true, 0, 0);
    assert_eq!(extended_copy(&mut small, &list), (2, Some((5, 0x26, 0))));
    assert!(small.read(0, 128).0 == want_small, "a refused copy wrote");
}

/// Initiator X reserves export B Exclusive Access; initiator Y, whose READ of B is a
/// RESERVATION CONFLICT, logs in to export A (reserved by nobody) and sends it an EXTENDED COPY
/// from B: RESERVATION CONFLICT too, and A keeps its data. Once X releases B the same copy runs.
#[test]
fn extended_copy_does_not_read_an_export_another_initiator_holds_exclusive() {
    use blkwire_wire::scsi::pr::{kind, sa_out};
    const CONFLICT: u8 = 0x18;
    let (_t, urls) = Target::start_listeners(
        &["a=mem:64K", "b=mem:64K"],
        &["--listen", "iscsi://127.0.0.1:0"],
    );
    let iscsi = iscsi_listener(&urls);
    let target = |export: &str| format!("iqn.2026-11.io.blkwire:{export}");
    let mut x = login_as(
        iscsi,
        &target("b"),
        Digests::default(),
        "iqn.2026-11.test:x",
    );
    let secret = random_bytes(4096, 31);
    assert_eq!(x.write(0, &secret), 0);
    assert_eq!(prout(&mut x, sa_out::REGISTER, 0, 0, 0xAA), 0);
    let ea = kind::EXCLUSIVE_ACCESS;
    assert_eq!(prout(&mut x, sa_out::RESERVE, ea, 0xAA, 0), 0);
    let mut y_b = login_as(
        iscsi,
        &target("b"),
        Digests::default(),
        "iqn.2026-11.test:y",
    );
    assert_eq!(y_b.read(0, 8).1, CONFLICT, "Y may not read B");
    let b_t = copy_target(naa(&mut y_b), 512);
    let mut y = login_as(
        iscsi,
        &target("a"),
        Digests::default(),
        "iqn.2026-11.test:y",
    );
    let before = y.read(0, 8).0;
    let list = copy_list([b_t, copy_target(naa(&mut y), 512)], 8, false, 0, 0);
    assert_eq!(extended_copy(&mut y, &list), (CONFLICT, None));
    assert!(y.read(0, 8).0 == before, "B's data reached A");
    assert_eq!(prout(&mut x, sa_out::RELEASE, ea, 0xAA, 0), 0);
    assert_eq!(extended_copy(&mut y, &list), (0, None));
    assert!(y.read(0, 8).0 == secret, "released, the copy runs");
}

/// An export removed and added again under its name is another LU, with reservations of its
/// own. An initiator that logged in before (its copy sources fixed then, each with the
/// reservations of the export it was) names the old one in its EXTENDED COPY: that one is gone,
/// so the copy fails and reads nothing, rather than reading the new one past a reservation it
/// never checked (it did, before).
#[test]
fn extended_copy_does_not_read_an_export_added_again_under_its_name() {
    use blkwire_wire::scsi::pr::{kind, sa_out};
    let dir = TempDir::new("xcopy-readded");
    let t = common::Controlled::start(
        &dir,
        &[
            "--export",
            "a=mem:64K",
            "--export",
            "b=mem:64K",
            "--listen",
            "iscsi://127.0.0.1:0",
        ],
    );
    let iscsi = iscsi_listener(&t.urls);
    let target = |export: &str| format!("iqn.2026-11.io.blkwire:{export}");
    let initiator = |who: &str| format!("iqn.2026-11.test:{who}");
    let mut y_b = login_as(iscsi, &target("b"), Digests::default(), &initiator("y"));
    let b_t = copy_target(naa(&mut y_b), 512);
    drop(y_b);
    let mut y = login_as(iscsi, &target("a"), Digests::default(), &initiator("y"));
    let list = copy_list([b_t, copy_target(naa(&mut y), 512)], 8, false, 0, 0);
    // B goes and comes back; X writes to the new B and reserves it, Exclusive Access.
    t.rpc("export_remove", r#"{"name": "b", "force": true}"#);
    t.rpc("export_add", r#"{"name": "b", "spec": "mem:64K"}"#);
    let mut x = login_as(iscsi, &target("b"), Digests::default(), &initiator("x"));
    let secret = random_bytes(4096, 37);
    assert_eq!(x.write(0, &secret), 0);
    assert_eq!(prout(&mut x, sa_out::REGISTER, 0, 0, 0xAA), 0);
    let ea = kind::EXCLUSIVE_ACCESS;
    assert_eq!(prout(&mut x, sa_out::RESERVE, ea, 0xAA, 0), 0);
    let before = y.read(0, 8).0;
    let (status, sense) = extended_copy(&mut y, &list);
    assert_eq!(status, 2, "CHECK CONDITION, not a copy that ran");
    assert_eq!(
        sense,
        Some((0x0a, 0x0d, 0x02)),
        "COPY ABORTED, COPY TARGET DEVICE NOT REACHABLE"
    );
    assert!(y.read(0, 8).0 == before, "the new B's data reached A");
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
    let iscsi = iscsi_listener(&urls);
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
