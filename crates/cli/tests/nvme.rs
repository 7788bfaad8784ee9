//! The NVMe/TCP frontend (issue 16) against the test kit's NVMe/TCP host
//! (`common::nvme_host`): discovery, controller bring-up as the Linux host does it, I/O with
//! in-capsule data and with R2T, digests, Flush, Write Zeroes, deallocation, Copy, and what a
//! broken or hostile host gets (digest errors, oversize PDUs, data beyond its R2T, unknown
//! opcodes, foreign controllers, a missed keep-alive). Data written over NVMe/TCP is read back
//! through the native protocol (`blkwire cp`).

mod common;

use std::time::{Duration, Instant};

use blkwire_wire::nvme_tcp::{self, flags, CapsuleCmd, Pdu};
use common::nvme_host::{
    self, controller, io_queue, nqn, sqe, Failure, Opts, Queue, DISCOVERY_NQN,
};
use common::{cli, random_bytes, Target, TempDir};

const BS: u32 = 512;

/// A target with a native and an NVMe/TCP listener; `addr` is the NVMe/TCP `127.0.0.1:PORT`.
struct NvmeTarget {
    t: Target,
    addr: String,
}

impl NvmeTarget {
    fn start(exports: &[&str]) -> NvmeTarget {
        Self::start_with(exports, &[])
    }

    fn start_with(exports: &[&str], extra: &[&str]) -> NvmeTarget {
        let mut args = vec!["--listen", "nvme-tcp://127.0.0.1:0"];
        args.extend_from_slice(extra);
        let (t, urls) = Target::start_listeners(exports, &args);
        let addr = urls
            .iter()
            .find_map(|u| u.strip_prefix("nvme-tcp://"))
            .unwrap_or_else(|| panic!("no nvme-tcp:// listener in {urls:?}"))
            .to_string();
        NvmeTarget { t, addr }
    }

    /// The export's bytes, read through the native protocol.
    fn contents(&self, export: &str, dir: &TempDir) -> Vec<u8> {
        let out = dir.path(&format!("{export}.img"));
        let (ok, _, err) = cli(&["cp", &self.t.url(export), out.to_str().unwrap()]);
        assert!(ok, "blkwire cp: {err}");
        std::fs::read(out).unwrap()
    }
}

/// Writes sent for R2Ts beyond what the connection's share of the memory budget holds at
/// once (1 MiB each, 64 deep, a 64 MiB budget) all complete: those waiting for memory to be
/// solicited do not stop the connection from reading the data of those solicited, which is
/// what gives the memory back (it stopped reading: every write waited until the host gave up).
#[test]
fn writes_beyond_the_memory_share_complete_as_solicited_data_frees_memory() {
    let t = NvmeTarget::start_with(&["m=mem:256M"], &["--max-memory", "64M"]);
    let (ok, out, err) = cli(&[
        "bench",
        &format!("nvme-tcp://{}/m", t.addr),
        "--rw",
        "write",
        "--bs",
        "1M",
        "--iodepth",
        "64",
        "--runtime",
        "2",
        "--timeout",
        "20",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["errors"], 0, "{out}");
    assert!(
        v["ops"].as_u64().unwrap() > 64,
        "more than one round of writes: {out}"
    );
}

/// `blkwire cp` between two namespaces of one NVMe/TCP controller copies through this host
/// (an NVMe/TCP session has no blkwire COPY): it said to add --no-offload before.
#[test]
fn cp_between_nvme_tcp_namespaces_of_one_target_copies_through_this_host() {
    let dir = TempDir::new("nvme-cp");
    let t = NvmeTarget::start(&["a=mem:4M", "b=mem:4M"]);
    let data = random_bytes(4 << 20, 31);
    let src = dir.path("src.img");
    std::fs::write(&src, &data).unwrap();
    let (ok, _, err) = cli(&["cp", src.to_str().unwrap(), &t.t.url("a")]);
    assert!(ok, "{err}");
    let (a, b) = (
        format!("nvme-tcp://{}/a", t.addr),
        format!("nvme-tcp://{}/b", t.addr),
    );
    let (ok, out, err) = cli(&["cp", "--no-progress", &a, &b]);
    assert!(ok, "{out}{err}");
    assert!(err.contains("copying through this host"), "{err}");
    assert!(!out.contains("inside the target"), "{out}");
    assert!(t.contents("b", &dir) == data, "b is not a's copy");
}

#[test]
fn discovery_lists_every_subsystem_at_the_listener() {
    let t = NvmeTarget::start(&["disk0=mem:16M", "disk1=mem:8M"]);
    let mut d = controller(&t.addr, DISCOVERY_NQN, &Opts::default());
    let id = d.identify(1, 0);
    assert_eq!(id.data.len(), 4096);
    assert_eq!(id.data[111], 2, "CNTRLTYPE: discovery controller");
    // The header first (as nvme-cli reads it), then the whole log.
    let head = d.get_log(0x70, 1024, 0);
    assert_eq!(head.code(), 0);
    let n = u64::from_le_bytes(head.data[8..16].try_into().unwrap()) as usize;
    assert_eq!(n, 3, "the discovery subsystem and two NVM subsystems");
    let log = d.get_log(0x70, 1024 * (1 + n as u32), 0);
    assert_eq!(log.data[..8], head.data[..8], "same generation");
    let port = t.addr.rsplit_once(':').unwrap().1;
    let mut nqns = Vec::new();
    for i in 1..=n {
        let e = &log.data[1024 * i..1024 * (i + 1)];
        assert_eq!(e[0], 3, "TRTYPE TCP");
        assert_eq!(e[1], 1, "ADRFAM IPv4");
        let svc: String = e[32..64]
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as char)
            .collect();
        assert_eq!(svc, port);
        let addr: String = e[512..768]
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as char)
            .collect();
        assert_eq!(addr, "127.0.0.1");
        nqns.push(
            e[256..512]
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as char)
                .collect::<String>(),
        );
    }
    nqns.sort();
    assert_eq!(
        nqns,
        [DISCOVERY_NQN.to_string(), nqn("disk0"), nqn("disk1")]
    );
    // A discovery controller has no namespaces and no I/O queues.
    assert_ne!(d.identify(0, 1).code(), 0);
    let (_, done) = Queue::connect(&t.addr, DISCOVERY_NQN, 1, d.cntlid, &Opts::default()).unwrap();
    assert_ne!(done.code(), 0, "an I/O queue on a discovery controller");
}

#[test]
fn a_controller_comes_up_as_the_linux_host_checks_it() {
    let t = NvmeTarget::start(&["disk0=mem:16M"]);
    let mut a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let cap = a.property_get(0x00, true);
    let cap = cap.cqe.dw0 as u64 | (cap.cqe.dw1 as u64) << 32;
    assert!(cap & 0xffff >= 127, "MQES {}", cap & 0xffff);
    assert_ne!(cap & 1 << 37, 0, "CAP.CSS: NVM command set");
    assert_eq!(a.property_get(0x08, false).cqe.dw0, 0x10300, "VS 1.3");
    let id = a.identify(1, 0).data;
    assert_eq!(
        u16::from_le_bytes([id[78], id[79]]),
        a.cntlid,
        "cntlid as Connect said"
    );
    assert_ne!(u16::from_le_bytes([id[320], id[321]]), 0, "KAS");
    assert!(
        u32::from_le_bytes(id[1792..1796].try_into().unwrap()) >= 4,
        "IOCCSZ"
    );
    assert!(
        u32::from_le_bytes(id[1796..1800].try_into().unwrap()) >= 1,
        "IORCSZ"
    );
    assert_eq!(u16::from_le_bytes([id[1800], id[1801]]), 0, "ICDOFF");
    assert_ne!(u16::from_le_bytes([id[514], id[515]]), 0, "MAXCMD");
    assert_ne!(id[536] & 1, 0, "SGLS");
    // A host may connect to the subsystem through several listeners (multipath): Linux
    // refuses a second controller of a subsystem whose CMIC does not allow several.
    assert_eq!(id[76] & 0b11, 0b11, "CMIC: several ports and controllers");
    let sn = String::from_utf8_lossy(&id[4..24]).trim().to_string();
    assert!(!sn.is_empty());
    // One active namespace, with size, NGUID and a descriptor list.
    let list = a.identify(2, 0).data;
    assert_eq!(u32::from_le_bytes(list[0..4].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(list[4..8].try_into().unwrap()), 0);
    let ns = a.identify(0, 1).data;
    assert_eq!(
        u64::from_le_bytes(ns[0..8].try_into().unwrap()),
        (16 << 20) / BS as u64
    );
    assert_eq!(1u32 << ns[130], BS, "LBA format 0");
    assert_ne!(ns[104..120], [0; 16], "NGUID");
    assert_eq!(ns[30] & 1, 1, "NMIC: shared by the subsystem's controllers");
    let desc = a.identify(3, 1).data;
    assert_eq!((desc[0], desc[1]), (2, 16), "NGUID descriptor first");
    assert_eq!(desc[4..20], ns[104..120]);
    // The NVM command set's controller structure limits DSM to one range.
    let mut c = sqe(0x06, 0);
    c.cdw10 = 6;
    let nvm = a.command_in(c, &[], 4096).unwrap();
    assert_eq!((nvm.code(), nvm.data[3]), (0, 1), "DMRL 1");
    // Number of queues is granted, keep-alive and async events accepted.
    let q = a.set_features(0x07, 3 | 3 << 16);
    assert_eq!((q.code(), q.cqe.dw0), (0, 3 | 3 << 16));
    for bad in [0xffff | 3 << 16, 3 | 0xffff << 16] {
        let q = a.set_features(0x07, bad);
        assert_eq!(q.code(), 0x002, "65535 queues is Invalid Field: {bad:#x}");
    }
    let mut ka = sqe(0x18, 0);
    ka.cid = 0;
    assert_eq!(a.command_in(ka, &[], 0).unwrap().code(), 0);
    // Unknown admin opcodes and log pages get the right status, not a closed connection.
    assert_eq!(a.command_in(sqe(0xc1, 0), &[], 0).unwrap().code(), 0x001);
    assert_eq!(a.get_log(0x77, 512, 0).code(), 0x109);
    assert_eq!(a.get_log(0x02, 512, 0).code(), 0, "SMART log");
    assert_eq!(
        a.get_log(0x02, 1 << 20, 0).code(),
        0x002,
        "a 1 MiB log read is refused"
    );
    // Shutdown completes.
    a.property_set(0x14, 0x460001 | 1 << 14);
    assert_eq!(
        (a.property_get(0x1c, false).cqe.dw0 >> 2) & 3,
        2,
        "SHST complete"
    );
}

#[test]
fn data_round_trips_in_capsule_and_through_r2t_with_and_without_digests() {
    let t = NvmeTarget::start(&["disk0=mem:16M"]);
    let dir = TempDir::new("nvme-rw");
    let mut expect = vec![0u8; 16 << 20];
    for (i, (hd, dd)) in [(false, false), (true, true), (true, false), (false, true)]
        .into_iter()
        .enumerate()
    {
        let o = Opts {
            hdgst: hd,
            ddgst: dd,
            ..Opts::default()
        };
        let mut a = controller(&t.addr, &nqn("disk0"), &o);
        a.set_features(0x07, 1 | 1 << 16);
        let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &o);
        // With I/O queues connected, the allocation no longer changes.
        let nq = a.set_features(0x07, 0);
        assert_eq!(
            (nq.code(), nq.cqe.dw0),
            (0, 1 | 1 << 16),
            "still two queues"
        );
        if i == 0 {
            // Connected under no Set Features at all: the most there is, kept too.
            let mut b = controller(&t.addr, &nqn("disk0"), &o);
            let _q = io_queue(&t.addr, &nqn("disk0"), &b, 1, &o);
            let nq = b.set_features(0x07, 0);
            let most = u32::from(blkwire_server::nvme::MAX_IO_QUEUES) - 1;
            assert_eq!((nq.code(), nq.cqe.dw0), (0, most | most << 16));
        }
        // 4 KiB in the capsule, 256 KiB (several H2CData) through an R2T, 1 MiB read back.
        let small = random_bytes(4096, i as u64);
        let big = random_bytes(256 << 10, 100 + i as u64);
        let base = i as u64 * 4096;
        assert_eq!(q.write_in(base, &small, BS).unwrap().code(), 0);
        // More in the capsule than IOCCSZ allows (8 KiB) is Data SGL Length Invalid, whatever
        // the command (a Dataset Management range list here).
        let over = q.write_in(base + 8, &big[..12 << 10], BS).unwrap();
        assert_eq!(over.code(), 0x00f, "12 KiB in a WRITE's capsule");
        let mut dsm = sqe(0x09, 0);
        dsm.nsid = 1;
        dsm.cdw11 = 1 << 2; // AD
        let over = q.command_in(dsm, &big[..12 << 10], 0).unwrap();
        assert_eq!(over.code(), 0x00f, "12 KiB in a DSM's capsule");
        assert_eq!(q.write_r2t(base + 8, &big, BS, true).unwrap().code(), 0);
        let off = (base * BS as u64) as usize;
        expect[off..off + 4096].copy_from_slice(&small);
        expect[off + 4096..off + 4096 + big.len()].copy_from_slice(&big);
        let r = q.read(base, 2048, BS).unwrap();
        assert_eq!(r.code(), 0);
        assert!(
            r.data == expect[off..off + (1 << 20)],
            "read back over NVMe/TCP"
        );
    }
    assert!(
        t.contents("disk0", &dir) == expect,
        "read back over the native protocol"
    );
}

#[test]
fn without_sq_flow_control_reads_end_with_success_in_their_data() {
    let t = NvmeTarget::start(&["disk0=mem:4M"]);
    let o = Opts {
        sqfc_off: true,
        ..Opts::default()
    };
    let a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &o);
    let data = random_bytes(8192, 9);
    q.write_in(0, &data, BS).unwrap();
    let mut c = sqe(0x02, 77);
    c.nsid = 1;
    c.cdw12 = 15;
    c.dptr = nvme_tcp::Sgl::TransportDataBlock {
        subtype: 0xa,
        length: 8192,
    }
    .to_bytes();
    q.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: c, data: &[] }));
    match q.recv().unwrap() {
        nvme_host::Received::Data {
            success,
            last,
            data: d,
            ..
        } => {
            assert!(success && last, "one C2HData with SUCCESS");
            assert_eq!(d, data);
        }
        other => panic!("expected C2HData, got {other:?}"),
    }
    // No CapsuleResp follows: the next PDU answers the next command (`wait` checks its CID).
    assert_eq!(q.write_in(16, &data, BS).unwrap().code(), 0);
}

#[test]
fn flush_write_zeroes_deallocate_and_copy_change_what_they_should() {
    let dir = TempDir::new("nvme-ops");
    let img = dir.path("disk.img");
    common::sparse_file(&img, 8 << 20);
    let spec = format!("disk0=file:{}", img.display());
    let t = NvmeTarget::start(&[&spec]);
    let mut a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let id = a.identify(1, 0).data;
    assert_eq!(id[525] & 1, 1, "a file has a volatile write cache to flush");
    let oncs = u16::from_le_bytes([id[520], id[521]]);
    assert_eq!(oncs & 0x10c, 0x10c, "DSM, Write Zeroes and Copy in ONCS");
    let ns = a.identify(0, 1).data;
    assert!(ns[80] >= 1, "MSRC allows several ranges");
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &Opts::default());
    let data = random_bytes(64 << 10, 5);
    assert_eq!(q.write_r2t(0, &data, BS, false).unwrap().code(), 0);
    assert_eq!(q.flush().code(), 0);
    // Copy two ranges (blocks 0..8 and 64..72) to block 1000; overlapping copies are refused.
    assert_eq!(q.copy(1000, &[(0, 8), (64, 8)]).code(), 0);
    assert_ne!(
        q.copy(4, &[(0, 8)]).code(),
        0,
        "source and destination overlap"
    );
    // Zero blocks 16..32 (kept allocated) and deallocate 32..48: one range per DSM is what
    // DMRL says, but hosts that ignore it send several, and they are taken.
    assert_eq!(q.write_zeroes(16, 16, false).code(), 0);
    assert_eq!(q.deallocate(&[(32, 4)]).code(), 0);
    assert_eq!(q.deallocate(&[(36, 4), (40, 8)]).code(), 0);
    let got = t.contents("disk0", &dir);
    let mut want = vec![0u8; 8 << 20];
    want[..data.len()].copy_from_slice(&data);
    want[16 * 512..32 * 512].fill(0);
    let dst = 1000 * 512;
    want[dst..dst + 4096].copy_from_slice(&data[..4096]);
    want[dst + 4096..dst + 8192].copy_from_slice(&data[64 * 512..72 * 512]);
    // Deallocated blocks read as old data or zeros; the rest is exact.
    assert!(got[..16 * 512] == want[..16 * 512]);
    assert!(got[16 * 512..32 * 512].iter().all(|&b| b == 0));
    assert!(got[48 * 512..] == want[48 * 512..]);
}

#[test]
fn the_volatile_write_cache_cannot_be_turned_off() {
    let dir = TempDir::new("nvme-vwc");
    let img = dir.path("disk.img");
    common::sparse_file(&img, 1 << 20);
    let spec = format!("disk0=file:{}", img.display());
    let t = NvmeTarget::start(&[&spec]);
    let mut a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    assert_eq!(a.identify(1, 0).data[525] & 1, 1, "VWC present");
    // WCE=0 would have every write reach the medium before it completes, which the I/O queues
    // do not do: refused, not acknowledged and ignored.
    let off = a.set_features(0x06, 0);
    assert_eq!(off.code(), 0x002, "Invalid Field in Command");
    assert_ne!(off.status() & 0x4000, 0, "DNR");
    assert_eq!(a.set_features(0x06, 1).code(), 0, "WCE=1 is what it is");
    let mut get = sqe(0x0a, 0);
    get.cdw10 = 0x06;
    let got = a.command_in(get, &[], 0).unwrap();
    assert_eq!((got.code(), got.cqe.dw0 & 1), (0, 1), "WCE still 1");
}

#[test]
fn commands_that_cannot_run_get_their_nvme_status() {
    let t = NvmeTarget::start(&["disk0=mem:1M", "ro=mem:1M,ro"]);
    let a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &Opts::default());
    let blocks = (1 << 20) / BS as u64;
    assert_eq!(
        q.read(blocks - 1, 2, BS).unwrap().code(),
        0x080,
        "LBA out of range"
    );
    let mut c = sqe(0x02, 0);
    c.nsid = 2;
    assert_eq!(
        q.command_in(c, &[], 512).unwrap().code(),
        0x00b,
        "no namespace 2"
    );
    assert_eq!(
        q.command_in(sqe(0x7e, 0), &[], 0).unwrap().code(),
        0x001,
        "unknown opcode"
    );
    // Still serving after all of that.
    assert_eq!(q.read(0, 1, BS).unwrap().code(), 0);
    // A read-only namespace refuses writes, says so in Identify, and offers no Copy.
    let mut r = controller(&t.addr, &nqn("ro"), &Opts::default());
    assert_eq!(r.identify(0, 1).data[99] & 1, 1);
    let mut rq = io_queue(&t.addr, &nqn("ro"), &r, 1, &Opts::default());
    assert_eq!(rq.write_in(0, &[1; 512], BS).unwrap().code(), 0x182);
    assert_eq!(
        rq.write_r2t(0, &[1; 4096], BS, false).unwrap().code(),
        0x182
    );
}

#[test]
fn connects_that_do_not_belong_are_refused() {
    let t = NvmeTarget::start(&["disk0=mem:1M"]);
    let a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let other = Opts {
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:someone-else".into(),
        ..Opts::default()
    };
    // Another host naming this controller, a controller that does not exist, an unknown
    // subsystem, a queue id past the grant.
    let tries = [
        (nqn("disk0"), 1, a.cntlid, other.clone()),
        (nqn("disk0"), 1, a.cntlid.wrapping_add(100), Opts::default()),
        (nqn("nope"), 0, 0xffff, Opts::default()),
        (nqn("disk0"), 60, a.cntlid, Opts::default()),
    ];
    for (sub, qid, cntlid, o) in tries {
        let (_, done) = Queue::connect(&t.addr, &sub, qid, cntlid, &o).unwrap();
        assert_ne!(
            done.code(),
            0,
            "Connect {sub} qid {qid} cntlid {cntlid} admitted"
        );
    }
    // The same I/O queue twice.
    let _q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &Opts::default());
    let (_, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &Opts::default()).unwrap();
    assert_ne!(done.code(), 0, "queue 1 twice");
}

/// What the target does with a PDU that breaks the protocol: a C2HTermReq, then it closes.
fn assert_terminated(q: &mut Queue, what: &str) {
    match q.recv() {
        Err(Failure::Terminated(_)) | Err(Failure::Closed(_)) => {}
        other => panic!("{what}: expected termination, got {other:?}"),
    }
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "{what}: still open"
    );
}

#[test]
fn broken_pdus_end_the_connection_and_nothing_else() {
    let t = NvmeTarget::start(&["disk0=mem:1M"]);
    let dg = Opts {
        hdgst: true,
        ddgst: true,
        ..Opts::default()
    };
    let a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    // A header digest that does not match.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &dg);
    let mut out = Vec::new();
    let mut c = sqe(0x02, 5);
    c.nsid = 1;
    Pdu::CapsuleCmd(CapsuleCmd { sqe: c, data: &[] }).encode(&q.tx, &mut out);
    out[nvme_tcp::CMD_HLEN] ^= 1;
    q.send_raw(&out);
    assert_terminated(&mut q, "header digest");
    // A data digest that does not match.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 2, &dg);
    let mut w = sqe(0x01, 6);
    w.nsid = 1;
    w.dptr = nvme_tcp::Sgl::DataBlock {
        subtype: 1,
        address: 0,
        length: 512,
    }
    .to_bytes();
    let mut out = Vec::new();
    Pdu::CapsuleCmd(CapsuleCmd {
        sqe: w,
        data: &[9; 512],
    })
    .encode(&q.tx, &mut out);
    let last = out.len() - 1;
    out[last] ^= 1;
    q.send_raw(&out);
    assert_terminated(&mut q, "data digest");
    // A capsule longer than the in-capsule size the target offers.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 3, &Opts::default());
    let mut h = [0u8; 8];
    h[0] = 4; // CapsuleCmd
    h[2] = nvme_tcp::CMD_HLEN as u8;
    h[3] = nvme_tcp::CMD_HLEN as u8;
    h[4..8].copy_from_slice(&(64u32 << 20).to_le_bytes());
    q.send_raw(&h);
    assert_terminated(&mut q, "64 MiB capsule");
    // The admin queue (and a connection still in its handshake) takes 8 KiB capsules at most:
    // a host cannot make its thread hold more.
    let mut adm = controller(&t.addr, &nqn("disk0"), &Opts::default());
    h[4..8].copy_from_slice(&(64u32 << 10).to_le_bytes());
    adm.send_raw(&h);
    assert_terminated(&mut adm, "64 KiB admin capsule");
    // H2CData past what the R2T asked for, and for a tag that asked for nothing.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 4, &Opts::default());
    let mut w = sqe(0x01, 9);
    w.nsid = 1;
    w.cdw12 = 7;
    w.dptr = nvme_tcp::Sgl::TransportDataBlock {
        subtype: 0xa,
        length: 4096,
    }
    .to_bytes();
    q.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: w, data: &[] }));
    let r2t = match q.recv().unwrap() {
        nvme_host::Received::R2T(r) => r,
        other => panic!("expected R2T, got {other:?}"),
    };
    assert_eq!((r2t.r2to, r2t.r2tl), (0, 4096));
    let too_much = vec![1u8; 8192];
    q.send(&Pdu::H2CData(nvme_tcp::H2CData {
        cccid: 9,
        ttag: r2t.ttag,
        datao: 0,
        last: true,
        data: &too_much,
    }));
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "data beyond the R2T"
    );
    // More in one H2CData than MAXH2CDATA (1 MiB here), though the receive bound has room
    // for it: Data Transfer Limit Exceeded.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 11, &Opts::default());
    q.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: w, data: &[] }));
    let r2t = match q.recv().unwrap() {
        nvme_host::Received::R2T(r) => r,
        other => panic!("expected R2T, got {other:?}"),
    };
    let over = vec![1u8; (1 << 20) + 4];
    q.send(&Pdu::H2CData(nvme_tcp::H2CData {
        cccid: 9,
        ttag: r2t.ttag,
        datao: 0,
        last: true,
        data: &over,
    }));
    match q.recv() {
        Err(Failure::Terminated(fes)) => assert_eq!(fes, 0x05, "Data Transfer Limit Exceeded"),
        other => panic!("an H2CData over MAXH2CDATA: expected termination, got {other:?}"),
    }
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 5, &Opts::default());
    q.send(&Pdu::H2CData(nvme_tcp::H2CData {
        cccid: 1,
        ttag: 3,
        datao: 0,
        last: true,
        data: &[0; 512],
    }));
    assert_terminated(&mut q, "data for no R2T");
    // LAST_PDU on a PDU that leaves the R2T's data owed, and missing on the one that ends it:
    // the write would wait for data the host says it will not send, or never be told done.
    // (The control: LAST_PDU on the second half only is a write served.)
    for (qid, halves) in [
        (8u16, [true, true]),
        (9, [false, false]),
        (10, [false, true]),
    ] {
        let mut q = io_queue(&t.addr, &nqn("disk0"), &a, qid, &Opts::default());
        q.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: w, data: &[] }));
        let r2t = match q.recv().unwrap() {
            nvme_host::Received::R2T(r) => r,
            other => panic!("expected R2T, got {other:?}"),
        };
        for (i, last) in halves.into_iter().enumerate() {
            q.send(&Pdu::H2CData(nvme_tcp::H2CData {
                cccid: 9,
                ttag: r2t.ttag,
                datao: i as u32 * 2048,
                last,
                data: &[1; 2048],
            }));
        }
        if halves == [false, true] {
            match q.recv() {
                Ok(nvme_host::Received::Resp(c)) => assert_eq!((c.cid, c.status), (9, 0)),
                other => panic!("two halves, the second last: {other:?}"),
            }
            continue;
        }
        assert_terminated(
            &mut q,
            &format!("LAST_PDU {halves:?} on two halves of an R2T"),
        );
    }
    // A PDU type only a controller sends.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 6, &Opts::default());
    let mut out = Vec::new();
    Pdu::R2T(nvme_tcp::R2T {
        cccid: 1,
        ttag: 0,
        r2to: 0,
        r2tl: 512,
    })
    .encode(&q.tx, &mut out);
    q.send_raw(&out);
    assert!(q.closed_within(Duration::from_secs(10)), "R2T from a host");
    let _ = flags::LAST_PDU;
    // The target still serves new queues of the same controller.
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 7, &Opts::default());
    assert_eq!(q.read(0, 1, BS).unwrap().code(), 0);
}

#[test]
fn a_controller_without_keep_alive_ends_with_its_io_queues() {
    let t = NvmeTarget::start(&["disk0=mem:1M"]);
    // KATO well above the keep-alives' 300 ms pace: a loaded machine that stalls this thread
    // for most of a second must not end the controller while it is kept alive.
    let o = Opts {
        kato_ms: 3000,
        ..Opts::default()
    };
    let mut a = controller(&t.addr, &nqn("disk0"), &o);
    let mut q = io_queue(&t.addr, &nqn("disk0"), &a, 1, &Opts::default());
    // Keep-alives hold it up past two KATOs.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(6500) {
        let mut ka = sqe(0x18, 0);
        ka.cid = 0;
        assert_eq!(a.command_in(ka, &[], 0).unwrap().code(), 0);
        assert_eq!(q.read(0, 1, BS).unwrap().code(), 0);
        std::thread::sleep(Duration::from_millis(300));
    }
    // Then silence on the admin queue: both connections close within KATO and some slack.
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "admin queue still open"
    );
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "I/O queue outlived its controller"
    );
    // And the controller is gone: its id no longer admits an I/O queue.
    let (_, done) = Queue::connect(&t.addr, &nqn("disk0"), 2, a.cntlid, &Opts::default()).unwrap();
    assert_ne!(done.code(), 0);
}

#[test]
fn one_address_cannot_take_every_controller() {
    let t = NvmeTarget::start(&["disk0=mem:1M"]);
    // Discovery Connects need no key and ask for the longest KATO, then fall silent: from one
    // address, only MAX_CONTROLLERS_PER_HOST (32) of MAX_CONTROLLERS (128) are admitted.
    let o = Opts {
        kato_ms: u32::MAX,
        ..Opts::default()
    };
    let one = std::net::Ipv4Addr::new(127, 0, 0, 1);
    let mut held = Vec::new();
    for _ in 0..128 {
        let (q, done) = Queue::connect_from(one, &t.addr, DISCOVERY_NQN, 0, 0xffff, &o).unwrap();
        if done.code() == 0 {
            held.push(q);
        } else {
            assert_eq!(done.code(), 0x181, "Connect Controller Busy");
        }
    }
    assert_eq!(held.len(), 32, "controllers one address holds");
    // Another address still gets a controller, for I/O and for discovery.
    let two = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let (_c, done) =
        Queue::connect_from(two, &t.addr, &nqn("disk0"), 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0, "a second host's Connect");
    let (_d, done) =
        Queue::connect_from(two, &t.addr, DISCOVERY_NQN, 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0, "a second host's discovery Connect");
    // One of the first address's controllers going makes room for it again.
    drop(held.pop());
    let start = Instant::now();
    loop {
        let (_q, done) = Queue::connect_from(one, &t.addr, DISCOVERY_NQN, 0, 0xffff, &o).unwrap();
        if done.code() == 0 {
            break;
        }
        // The target forgets the controller once its thread sees the close: retried, not slept.
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no room came free"
        );
    }
}

#[test]
fn blkwires_own_client_speaks_nvme_tcp() {
    use blkwire_client::{connect, ConnectOptions, Url};
    let t = NvmeTarget::start(&["disk0=mem:8M"]);
    let url = Url::parse(&format!("nvme-tcp://{}/disk0", t.addr)).unwrap();
    let opts = ConnectOptions {
        queues: 2,
        depth: 8,
        ..Default::default()
    };
    let mut s = connect(&url, &opts).expect("connect over nvme-tcp://");
    assert_eq!(s.info.size, 8 << 20);
    assert_eq!(s.info.queues, 2);
    let q = &mut s.queues[1];
    // In the capsule, and through an R2T (1 MiB: one H2CData of MAXH2CDATA).
    let small = random_bytes(4096, 1);
    let big = random_bytes(1 << 20, 2);
    q.write_at(&small, 0, false).unwrap();
    q.write_at(&big, 1 << 20, true).unwrap();
    let mut back = vec![0u8; 1 << 20];
    q.read_at(&mut back, 1 << 20).unwrap();
    assert!(back == big);
    let mut back = vec![0u8; 4096];
    q.read_at(&mut back, 0).unwrap();
    assert_eq!(back, small);
    // A full queue of writes that each wait for an R2T (every slot held by one).
    use blkwire_client::Cmd;
    let q = &mut s.queues[0];
    let depth = q.depth();
    assert_eq!(depth, 8);
    let chunk = random_bytes(64 << 10, 3);
    for i in 0..depth as u64 {
        let cmd = Cmd::Write {
            offset: (2 << 20) + (i << 16),
            data: &chunk,
            fua: false,
        };
        q.submit(cmd, i).unwrap();
    }
    let mut done = 0;
    while done < depth {
        done += q
            .complete(1, |c| assert_eq!(c.status, blkwire_wire::Status::Ok))
            .unwrap();
    }
    let dir = TempDir::new("nvme-client");
    let all = t.contents("disk0", &dir);
    assert!(all[..4096] == small[..] && all[1 << 20..2 << 20] == big[..]);
    for i in 0..depth {
        let at = (2 << 20) + (i << 16);
        assert!(all[at..at + (64 << 10)] == chunk[..], "pipelined write {i}");
    }
}

/// A key file (mode 600) with DH-HMAC-CHAP secrets: each line `HOSTNQN:SECRET[ CTRL-SECRET]`.
fn key_file(dir: &TempDir, lines: &[String]) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.path("hosts.keys");
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn with_keys_hosts_prove_themselves_with_dh_hmac_chap() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::authenticate;
    let dir = TempDir::new("nvme-auth");
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";
    let bob = "nqn.2014-08.org.nvmexpress:uuid:b0b00000-0000-4000-8000-000000000002";
    let stranger = "nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-000000000003";
    let (ka, kb, kc) = (Secret::generate(), Secret::generate(), Secret::generate());
    let keys = key_file(
        &dir,
        &[
            format!("{alice}:{}", ka.to_dhhc().unwrap()),
            format!("{bob}:{} {}", kb.to_dhhc().unwrap(), kc.to_dhhc().unwrap()),
        ],
    );
    let t = NvmeTarget::start_with(
        &["disk0=mem:1M", &format!("only-bob=mem:1M,allow={bob}")],
        &["--keys", &keys],
    );
    let opts = |nqn: &str| Opts {
        hostnqn: nqn.into(),
        ..Opts::default()
    };
    // Alice: Connect says authentication is required; nothing else runs before it.
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &opts(alice)).unwrap();
    assert_eq!(done.code(), 0);
    assert_ne!(done.cqe.dw0 & 1 << 17, 0, "ATR in Connect's dword 0");
    assert_eq!(
        a.property_get(0x00, true).code(),
        0x191,
        "Authentication Required"
    );
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 1);
    assert!(authenticate(&mut a, &mut host), "alice's key");
    a.enable();
    assert_eq!(a.identify(1, 0).code(), 0);
    // Her I/O queue authenticates on its own too, then serves.
    let (mut q, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &opts(alice)).unwrap();
    assert_ne!(done.cqe.dw0 & 1 << 17, 0);
    assert_eq!(
        q.read(0, 1, BS).unwrap().code(),
        0x191,
        "no I/O before authentication"
    );
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 2);
    assert!(authenticate(&mut q, &mut host));
    assert_eq!(q.write_in(0, &[7; 512], BS).unwrap().code(), 0);
    // She may not open an export whose rules name only bob.
    let (_, done) = Queue::connect(&t.addr, &nqn("only-bob"), 0, 0xffff, &opts(alice)).unwrap();
    assert_eq!(done.code(), 0x184, "Connect Invalid Host");
    // Bob, bidirectional: he checks the controller's proof as well.
    let (mut b, _) = Queue::connect(&t.addr, &nqn("only-bob"), 0, 0xffff, &opts(bob)).unwrap();
    let mut host = HostAuth::new(bob, &nqn("only-bob"), &kb, Some(&kc), 1);
    assert!(authenticate(&mut b, &mut host), "bob both ways");
    b.enable();
    // A controller that proves a wrong key fails the host's check.
    let (mut b2, _) = Queue::connect(&t.addr, &nqn("only-bob"), 0, 0xffff, &opts(bob)).unwrap();
    let mut host = HostAuth::new(bob, &nqn("only-bob"), &kb, Some(&ka), 1);
    assert!(
        !authenticate(&mut b2, &mut host),
        "wrong controller key accepted"
    );
    // A wrong host key gets Failure1, and the controller is torn down.
    let (mut w, _) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &opts(alice)).unwrap();
    let mut host = HostAuth::new(alice, &nqn("disk0"), &kb, None, 1);
    assert!(!authenticate(&mut w, &mut host), "wrong key accepted");
    assert!(
        w.closed_within(Duration::from_secs(10)),
        "still open after a failed exchange"
    );
    // A host without a key never gets a controller.
    let (_, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &opts(stranger)).unwrap();
    assert_eq!(done.code(), 0x184, "Connect Invalid Host");
    // Nor does an I/O queue that names alice's controller with the wrong key.
    let (mut q2, _) = Queue::connect(&t.addr, &nqn("disk0"), 2, a.cntlid, &opts(alice)).unwrap();
    let mut host = HostAuth::new(alice, &nqn("disk0"), &kb, None, 3);
    assert!(!authenticate(&mut q2, &mut host));
    assert!(q2.closed_within(Duration::from_secs(10)));
    // The data alice wrote is there.
    assert_eq!(q.read(0, 1, BS).unwrap().data, vec![7; 512]);
}

/// A target whose key file names alice, with a 1 s handshake deadline, and an admin queue
/// connected under alice's NQN without her key (anyone may claim it: an NQN is no secret), with
/// KATO 0 (no keep-alive timer); the options it connected with. `dir` holds the key file.
fn alice_unauthenticated(dir: &TempDir) -> (NvmeTarget, Queue, Opts) {
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";
    let key = blkwire_auth::dhchap::Secret::generate();
    let keys = key_file(dir, &[format!("{alice}:{}", key.to_dhhc().unwrap())]);
    let t = NvmeTarget::start_with(
        &["disk0=mem:1M"],
        &["--keys", &keys, "--handshake-timeout", "1"],
    );
    let o = Opts {
        hostnqn: alice.into(),
        ..Opts::default()
    };
    let (a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    (t, a, o)
}

#[test]
fn a_controller_that_never_authenticates_ends_at_the_handshake_deadline() {
    let dir = TempDir::new("nvme-auth-deadline");
    let (t, mut a, o) = alice_unauthenticated(&dir);
    assert_eq!(
        a.property_get(0x00, true).code(),
        0x191,
        "not authenticated"
    );
    // It never runs DH-HMAC-CHAP: its controller (and its session) ends, not lives for ever.
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "an unauthenticated controller outlived the deadline"
    );
    // And its controller id is forgotten.
    let (_, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_ne!(done.code(), 0);
}

/// Sends an 8 KiB capsule (an AUTH_Send, the largest an admin queue takes) a byte at a time, a
/// byte each time the connection has stayed open for `pace`, for 25 bytes at most: whether it
/// closed meanwhile.
fn trickle_closes(q: &mut Queue, pace: Duration) -> bool {
    let mut c = nvme_host::fabrics(0x05);
    c.cid = 1;
    c.dptr = nvme_tcp::Sgl::DataBlock {
        subtype: 1,
        address: 0,
        length: 8192,
    }
    .to_bytes();
    let mut out = Vec::new();
    Pdu::CapsuleCmd(CapsuleCmd {
        sqe: c,
        data: &[0; 8192],
    })
    .encode(&q.tx, &mut out);
    // 25 bytes, 7.5 s at most: under the 10 s a PDU may take in any case, so only the 1 s
    // limits (authentication, KATO) can close the connection within them.
    for b in out.chunks(1).take(25) {
        if q.closed_within(pace) {
            return true;
        }
        q.send_raw(b);
    }
    false
}

#[test]
fn a_trickled_pdu_cannot_outlive_the_authentication_deadline_or_kato() {
    // The limits were checked between PDUs only, and a PDU had 10 s per read call: one byte
    // every 9 s held a controller (a thread, one of 128) some 20 hours per 8 KiB capsule.
    // Here a byte every 300 ms (the capsule would take 40 minutes), for 7.5 s at most: past
    // the 1 s limits, short of the 10 s any PDU may take (which alone must not pass).
    let pace = Duration::from_millis(300);
    let dir = TempDir::new("nvme-trickle");
    // Alice's NQN is no secret: anyone gets a controller with it, to authenticate within 1 s.
    let (_t, mut a, _) = alice_unauthenticated(&dir);
    assert!(
        trickle_closes(&mut a, pace),
        "a trickled PDU outlived the authentication deadline"
    );
    // Nor does it outlive KATO (1 s) on a controller that needs no key: discovery.
    let t = NvmeTarget::start(&["disk0=mem:1M"]);
    let o = Opts {
        kato_ms: 1000,
        ..Opts::default()
    };
    let (mut d, done) = Queue::connect(&t.addr, DISCOVERY_NQN, 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    assert!(trickle_closes(&mut d, pace), "a trickled PDU outlived KATO");
}

// ---- Subsystems of several namespaces (serve --subsystem, nvme_subsystem_* calls) ----

const SUB: &str = "nqn.2026-11.com.example:two";

/// The non-zero NSIDs of an Active Namespace ID list.
fn active(list: &[u8]) -> Vec<u32> {
    list.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .take_while(|&n| n != 0)
        .collect()
}

/// Identify Namespace's NSZE, in bytes (LBA format 0).
fn ns_bytes(id: &[u8]) -> u64 {
    u64::from_le_bytes(id[0..8].try_into().unwrap()) << id[130]
}

/// The subsystem NQNs of a discovery log.
fn discovered(d: &mut Queue) -> Vec<String> {
    let head = d.get_log(0x70, 1024, 0);
    let n = u64::from_le_bytes(head.data[8..16].try_into().unwrap()) as u32;
    let log = d.get_log(0x70, 1024 * (1 + n), 0).data;
    (1..=n as usize)
        .map(|i| {
            log[1024 * i + 256..1024 * i + 512]
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as char)
                .collect()
        })
        .collect()
}

#[test]
fn a_subsystem_of_two_namespaces_serves_each_from_its_own_export() {
    let dir = TempDir::new("nvme-two-ns");
    let sub = format!("{SUB}=a,b;serial=SN-TWO;model=Two Disks");
    let t = NvmeTarget::start_with(&["a=mem:16M", "b=mem:8M"], &["--subsystem", &sub]);
    let mut d = controller(&t.addr, DISCOVERY_NQN, &Opts::default());
    let mut listed = discovered(&mut d);
    listed.sort();
    assert_eq!(
        listed,
        [
            DISCOVERY_NQN.to_string(),
            SUB.to_string(),
            nqn("a"),
            nqn("b")
        ],
        "every export's own subsystem stays"
    );

    let mut a = controller(&t.addr, SUB, &Opts::default());
    let id = a.identify(1, 0).data;
    assert_eq!(&id[4..24], b"SN-TWO              ", "serial");
    assert_eq!(&id[24..33], b"Two Disks", "model");
    assert_eq!(
        u32::from_le_bytes(id[516..520].try_into().unwrap()),
        2,
        "NN"
    );
    assert_eq!(
        u32::from_le_bytes(id[540..544].try_into().unwrap()),
        2,
        "MNAN"
    );
    assert_eq!(active(&a.identify(2, 0).data), [1, 2]);
    assert_eq!(active(&a.identify(2, 1).data), [2], "ids above 1");
    assert_eq!(ns_bytes(&a.identify(0, 1).data), 16 << 20);
    assert_eq!(ns_bytes(&a.identify(0, 2).data), 8 << 20);
    assert!(
        a.identify(0, 3).data.iter().all(|&b| b == 0),
        "an inactive NSID identifies as zeros"
    );
    let (d1, d2) = (a.identify(3, 1).data, a.identify(3, 2).data);
    assert_eq!((d1[0], d1[20]), (2, 3), "NGUID, then UUID");
    assert_ne!(d1[4..20], d2[4..20], "NGUIDs differ");
    assert_ne!(d1[24..40], d2[24..40], "UUIDs differ");
    // Stable: a second controller sees the same ids.
    let mut again = controller(&t.addr, SUB, &Opts::default());
    assert_eq!(again.identify(3, 2).data[..40], d2[..40]);

    // One I/O queue carries commands for both namespaces, each landing in its export.
    let mut q = io_queue(&t.addr, SUB, &a, 1, &Opts::default());
    let (da, db) = (random_bytes(8192, 21), random_bytes(64 << 10, 22));
    q.nsid = 1;
    assert_eq!(q.write_in(8, &da, BS).unwrap().code(), 0);
    q.nsid = 2;
    assert_eq!(q.write_r2t(16, &db, BS, false).unwrap().code(), 0);
    assert_eq!(q.read(16, 128, BS).unwrap().data, db);
    assert_eq!(q.flush().code(), 0);
    // Copy within namespace 2.
    assert_eq!(q.copy(1000, &[(16, 8)]).code(), 0);
    assert_eq!(
        q.read((8 << 20) / BS as u64 - 1, 2, BS).unwrap().code(),
        0x080,
        "namespace 2 ends at 8 MiB"
    );
    q.nsid = 1;
    assert_eq!(q.read(8, 16, BS).unwrap().data, da);
    assert_eq!(
        q.read((8 << 20) / BS as u64, 1, BS).unwrap().code(),
        0,
        "namespace 1 goes on past 8 MiB"
    );
    q.nsid = 3;
    assert_eq!(q.read(0, 1, BS).unwrap().code(), 0x00b, "no namespace 3");
    q.nsid = u32::MAX;
    let mut f = sqe(0x00, 0);
    f.nsid = u32::MAX;
    assert_eq!(
        q.command_in(f, &[], 0).unwrap().code(),
        0x00b,
        "no broadcast flush with two namespaces"
    );

    let (got_a, got_b) = (t.contents("a", &dir), t.contents("b", &dir));
    assert_eq!(got_a[8 * 512..8 * 512 + da.len()], da[..]);
    assert!(
        got_a[24 * 512..(16 + 128) * 512].iter().all(|&x| x == 0),
        "namespace 2's data is not in export a"
    );
    assert_eq!(got_b[16 * 512..16 * 512 + db.len()], db[..]);
    assert_eq!(got_b[1000 * 512..1008 * 512], db[..4096], "copied");
    assert!(got_b[8 * 512..16 * 512].iter().all(|&x| x == 0));
}

#[test]
fn hosts_a_subsystem_does_not_admit_are_refused() {
    let other = "nqn.2014-08.org.nvmexpress:uuid:0c1a7e57-0000-4000-8000-00000000beef";
    let listed = format!("{SUB}=a;allow={other}");
    let far = "nqn.2026-11.com.example:far";
    let fenced = format!("{far}=a,far");
    let t = NvmeTarget::start_with(
        &["a=mem:1M", "far=mem:1M,allow=10.0.0.0/8"],
        &["--subsystem", &listed, "--subsystem", &fenced],
    );
    let (_, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0x184, "a host NQN not on the list");
    // A namespace whose export's rules refuse the host refuses the whole subsystem.
    let (_, done) = Queue::connect(&t.addr, far, 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0x184, "export 'far' does not admit 127.0.0.1");
    let (_, done) = Queue::connect(
        &t.addr,
        "nqn.2026-11.com.example:none",
        0,
        0xffff,
        &Opts::default(),
    )
    .unwrap();
    assert_eq!(done.code(), 0x182, "an unknown subsystem");
    let mut d = controller(&t.addr, DISCOVERY_NQN, &Opts::default());
    assert!(
        !discovered(&mut d)
            .iter()
            .any(|n| n.starts_with("nqn.2026-11.com.example")),
        "the discovery log shows neither"
    );
    let o = Opts {
        hostnqn: other.into(),
        ..Opts::default()
    };
    let mut d = controller(&t.addr, DISCOVERY_NQN, &o);
    assert!(discovered(&mut d).contains(&SUB.to_string()));
    let mut a = controller(&t.addr, SUB, &o);
    assert_eq!(active(&a.identify(2, 0).data), [1]);
}

#[test]
fn bad_subsystem_flags_are_one_line_errors() {
    let run = |sub: &str, needle: &str| {
        common::assert_one_line_error(
            &[
                "serve",
                "--rpc-socket",
                "none",
                "--listen",
                "nvme-tcp://127.0.0.1:0",
                "--export",
                "a=mem:1M",
                "--subsystem",
                sub,
            ],
            needle,
        )
    };
    run("no-equals", "no '=' after the NQN");
    run("sub=a", "bad subsystem NQN");
    run("nqn.2026-11.x:y=a@0", "bad NSID");
    run("nqn.2026-11.x:y=a;colour=red", "unknown option");
    run(
        "nqn.2026-11.x:y=a;serial=123456789012345678901",
        "bad serial",
    );
    run("nqn.2026-11.x:y=a;allow=alice", "bad host NQN");
    run("nqn.2026-11.x:y=nosuch", "no export 'nosuch'");
    run("nqn.2026-11.x:y=a,a", "already");
}

/// `serve` over nvme-tcp:// with a control socket (`common::Controlled`), killed on drop.
struct Controlled {
    t: common::Controlled,
    addr: String,
}

impl Controlled {
    fn start(dir: &TempDir, exports: &[&str]) -> Controlled {
        Self::start_with(dir, exports, &[])
    }

    fn start_with(dir: &TempDir, exports: &[&str], extra: &[&str]) -> Controlled {
        let mut args = vec!["--listen", "nvme-tcp://127.0.0.1:0"];
        for e in exports {
            args.extend(["--export", e]);
        }
        args.extend(extra);
        let t = common::Controlled::start(dir, &args);
        let addr = t.urls[0].strip_prefix("nvme-tcp://").unwrap().to_string();
        Controlled { t, addr }
    }

    fn rpc(&self, method: &str, params: serde_json::Value) -> serde_json::Value {
        self.t.rpc(method, &params.to_string())
    }

    fn refused(&self, method: &str, params: serde_json::Value, needle: &str) {
        self.t.refused(method, &params.to_string(), needle)
    }
}

/// A controller whose host sends a command more often than the admin queue's idle poll (Keep
/// Alive every 100 ms here) still ends when its session is closed (`session_close`): revocations
/// are looked for on a busy queue too. Before, only a quiet socket was checked, and such a host
/// kept its controller, its session and a place against the session limits for good.
#[test]
fn a_busy_controller_ends_when_its_session_is_closed() {
    use serde_json::json;
    let dir = TempDir::new("nvme-busy-close");
    let t = Controlled::start(&dir, &["disk0=mem:1M"]);
    let mut a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let list = t.rpc("session_list", json!({}));
    let session = list[0]["session"]
        .as_u64()
        .expect("the controller's session");
    t.rpc("session_close", json!({ "session": session }));
    let closed = Instant::now();
    let mut answered = 0;
    loop {
        let mut ka = sqe(0x18, 0);
        ka.cid = answered as u16;
        if a.command_in(ka, &[], 0).is_err() {
            break;
        }
        answered += 1;
        assert!(
            closed.elapsed() < Duration::from_secs(10),
            "a controller kept busy outlived its closed session ({answered} Keep Alives answered)"
        );
        // The host's pace: a command every 100 ms, never a quiet 500 ms.
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        common::wait_until(Duration::from_secs(10), || t
            .rpc("session_list", json!({}))
            .as_array()
            .is_some_and(|l| l.is_empty())),
        "its session is still listed"
    );
}

/// A command whose PDU was still arriving when the controller's session was closed (trickled
/// over more than the 500 ms between looks for revocations) is not served: the controller ends
/// as the PDU completes, without answering it.
#[test]
fn a_command_trickled_across_a_session_close_is_not_served() {
    use serde_json::json;
    let dir = TempDir::new("nvme-trickle-close");
    let t = Controlled::start(&dir, &["disk0=mem:1M"]);
    let mut a = controller(&t.addr, &nqn("disk0"), &Opts::default());
    let mut ka = sqe(0x18, 0);
    ka.cid = 7;
    let mut out = Vec::new();
    Pdu::CapsuleCmd(CapsuleCmd { sqe: ka, data: &[] }).encode(&a.tx, &mut out);
    let (head, last) = out.split_at(out.len() - 1);
    a.send_raw(head);
    let list = t.rpc("session_list", json!({}));
    let session = list[0]["session"]
        .as_u64()
        .expect("the controller's session");
    t.rpc("session_close", json!({ "session": session }));
    // The host's pace: the rest of the PDU past the next look for revocations.
    std::thread::sleep(Duration::from_millis(700));
    a.send_raw(last);
    match a.recv() {
        Err(Failure::Closed(_)) => {}
        other => panic!("the Keep Alive was answered after its session closed: {other:?}"),
    }
}

/// A discovery controller holds no session to revoke, so a `keys_load` that replaces its host's
/// key ends it directly, busy or not: the host proved a key the target no longer has for it.
/// The same key loaded again changes nothing.
#[test]
fn a_discovery_controller_ends_when_its_hosts_key_is_replaced() {
    use blkwire_auth::dhchap::HostAuth;
    use serde_json::json;
    let dir = TempDir::new("nvme-disc-rekey");
    let (t, keys, (old, new), o) = alice_keyed(&dir);
    let (mut d, done) = Queue::connect(&t.addr, DISCOVERY_NQN, 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, DISCOVERY_NQN, &old, None, 1);
    assert!(nvme_host::authenticate(&mut d, &mut host), "alice's key");
    d.enable();
    let mut cid = 0u16;
    let mut keep_alive = |d: &mut Queue| {
        cid += 1;
        let mut ka = sqe(0x18, 0);
        ka.cid = cid;
        d.command_in(ka, &[], 0).is_ok()
    };
    t.rpc("keys_load", json!({ "path": keys }));
    for _ in 0..10 {
        assert!(keep_alive(&mut d), "ended by a reload of the same key");
        std::thread::sleep(Duration::from_millis(100));
    }
    let rotated = key_file(&dir, &[format!("{ALICE}:{}", new.to_dhhc().unwrap())]);
    t.rpc("keys_load", json!({ "path": rotated }));
    let replaced = Instant::now();
    while keep_alive(&mut d) {
        assert!(
            replaced.elapsed() < Duration::from_secs(10),
            "a discovery controller outlived its host's key"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// An Asynchronous Event Request, held by the target: its answer is read later.
fn post_aer(q: &mut Queue, cid: u16) {
    let mut c = sqe(0x0c, cid);
    c.dptr = nvme_tcp::Sgl::TransportDataBlock {
        subtype: 0xa,
        length: 0,
    }
    .to_bytes();
    q.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: c, data: &[] }));
}

#[test]
fn subsystems_change_at_run_time_through_the_control_socket() {
    use serde_json::json;
    let dir = TempDir::new("nvme-rpc-sub");
    let t = Controlled::start(&dir, &["a=mem:8M", "b=mem:4M", "c=mem:2M"]);
    let r = t.rpc(
        "nvme_subsystem_create",
        json!({"nqn": SUB, "serial": "RT1", "model": "Run Time"}),
    );
    assert_eq!(
        (r["serial"].as_str(), r["allow_any_host"].as_bool()),
        (Some("RT1"), Some(false))
    );
    assert_eq!(
        t.rpc("nvme_subsystem_add_ns", json!({"nqn": SUB, "export": "a"}))["nsid"],
        1
    );
    let r = t.rpc(
        "nvme_subsystem_add_ns",
        json!({"nqn": SUB, "export": "b", "nsid": 5}),
    );
    assert_eq!(r["nsid"], 5);
    // Bad input: one line each, nothing changed.
    t.refused(
        "nvme_subsystem_create",
        json!({"nqn": SUB}),
        "exists already",
    );
    t.refused(
        "nvme_subsystem_create",
        json!({"nqn": "sub"}),
        "bad subsystem NQN",
    );
    t.refused(
        "nvme_subsystem_create",
        json!({"nqn": "nqn.2026-11.io.blkwire:a"}),
        "is taken",
    );
    // The other way round: an export may not be added under a name whose own subsystem NQN a
    // configured subsystem has (it would be hidden, and a saved config would not load).
    t.rpc(
        "nvme_subsystem_create",
        json!({"nqn": "nqn.2026-11.io.blkwire:later"}),
    );
    t.refused(
        "export_add",
        json!({"name": "later", "spec": "mem:1M"}),
        "export name 'later' is taken",
    );
    t.rpc(
        "nvme_subsystem_delete",
        json!({"nqn": "nqn.2026-11.io.blkwire:later"}),
    );
    t.refused(
        "nvme_subsystem_create",
        json!({"nqn": "nqn.2026-11.x:y", "model": ""}),
        "bad model",
    );
    t.refused(
        "nvme_subsystem_create",
        json!({"nqn": SUB, "colour": 1}),
        "unknown field",
    );
    t.refused(
        "nvme_subsystem_add_ns",
        json!({"nqn": SUB, "export": "zz"}),
        "no export 'zz'",
    );
    t.refused(
        "nvme_subsystem_add_ns",
        json!({"nqn": SUB, "export": "c", "nsid": 5}),
        "in use",
    );
    t.refused(
        "nvme_subsystem_add_ns",
        json!({"nqn": SUB, "export": "c", "nsid": 0}),
        "bad NSID",
    );
    t.refused(
        "nvme_subsystem_add_ns",
        json!({"nqn": SUB, "export": "a"}),
        "already",
    );
    t.refused(
        "nvme_subsystem_remove_ns",
        json!({"nqn": SUB, "nsid": 9}),
        "no namespace 9",
    );
    t.refused(
        "nvme_subsystem_delete",
        json!({"nqn": "nqn.2026-11.x:none"}),
        "no subsystem",
    );
    t.refused(
        "nvme_subsystem_add_host",
        json!({"nqn": SUB, "host": "bob"}),
        "bad host NQN",
    );

    // Not admitted until the host is on the list.
    let (_, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0x184);
    t.rpc(
        "nvme_subsystem_add_host",
        json!({"nqn": SUB, "host": nvme_host::HOSTNQN}),
    );
    let mut a = controller(&t.addr, SUB, &Opts::default());
    assert_eq!(active(&a.identify(2, 0).data), [1, 5]);
    // All namespaces' common data (no namespace management) and an active list after the
    // last possible NSID: Invalid Namespace or Format, not zeros.
    assert_eq!(a.identify(0, u32::MAX).code(), 0x0b);
    assert_eq!(a.identify(2, u32::MAX - 1).code(), 0x0b);
    assert_eq!(&a.identify(1, 0).data[4..8], b"RT1 ");
    let mut q = io_queue(&t.addr, SUB, &a, 1, &Opts::default());
    let (d1, d5) = (random_bytes(4096, 31), random_bytes(4096, 32));
    q.nsid = 5;
    assert_eq!(q.write_in(0, &d5, BS).unwrap().code(), 0);
    q.nsid = 1;
    assert_eq!(q.write_in(0, &d1, BS).unwrap().code(), 0);

    let list = t.rpc("nvme_subsystem_list", json!({}));
    let s = list
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == SUB)
        .expect("listed");
    assert_eq!(s["configured"], true);
    assert_eq!(s["namespaces"][1]["export"], "b");
    assert_eq!(s["namespaces"][1]["nsid"], 5);
    assert_eq!(s["controllers"].as_array().unwrap().len(), 1);
    let saved = t.rpc("save_config", json!({})).to_string();
    assert!(saved.contains("nvme_subsystem_add_ns") && saved.contains("\"nsid\":5"));

    // Removing namespace 5: the host hears of it (AEN, then the Changed Namespace List), its
    // commands fail with Invalid Namespace, namespace 1 goes on on the same queue.
    assert_eq!(a.set_features(0x0b, 1 << 8).code(), 0);
    post_aer(&mut a, 0x77);
    let r = t.rpc("nvme_subsystem_remove_ns", json!({"nqn": SUB, "nsid": 5}));
    assert_eq!(
        (r["export"].as_str(), r["closed_sessions"].as_u64()),
        (Some("b"), Some(1))
    );
    match a.recv().expect("the AEN") {
        nvme_host::Received::Resp(c) => {
            assert_eq!(c.cid, 0x77);
            assert_eq!(
                c.dw0, 0x04_00_02,
                "notice, namespace attribute changed, log 04h"
            );
        }
        other => panic!("expected the AER's completion, got {other:?}"),
    }
    // A read that fails (an offset not of whole dwords) leaves it for the next.
    assert_eq!(a.get_log(0x04, 4096, 2).code(), 0x02, "Invalid Field");
    assert_eq!(active(&a.get_log(0x04, 4096, 0).data), [5]);
    assert_eq!(
        active(&a.get_log(0x04, 4096, 0).data),
        [] as [u32; 0],
        "read clears it"
    );
    assert_eq!(active(&a.identify(2, 0).data), [1]);
    assert!(a.identify(0, 5).data.iter().all(|&b| b == 0));
    q.nsid = 5;
    assert_eq!(
        q.read(0, 8, BS).unwrap().code(),
        0x00b,
        "namespace 5 is gone"
    );
    assert_eq!(q.write_in(0, &d1, BS).unwrap().code(), 0x00b);
    q.nsid = 1;
    assert_eq!(q.read(0, 8, BS).unwrap().data, d1, "namespace 1 goes on");
    let mut q2 = io_queue(&t.addr, SUB, &a, 2, &Opts::default());
    assert_eq!(
        q2.read(0, 8, BS).unwrap().data,
        d1,
        "a new queue joins namespace 1"
    );
    q2.nsid = 5;
    assert_eq!(q2.read(0, 8, BS).unwrap().code(), 0x00b);

    // A namespace added now is seen by controllers that connect from now on.
    assert_eq!(
        t.rpc("nvme_subsystem_add_ns", json!({"nqn": SUB, "export": "c"}))["nsid"],
        2
    );
    let mut a2 = controller(&t.addr, SUB, &Opts::default());
    assert_eq!(active(&a2.identify(2, 0).data), [1, 2]);
    assert_eq!(ns_bytes(&a2.identify(0, 2).data), 2 << 20);

    // Deleting the subsystem ends its controllers and their I/O queues.
    let r = t.rpc("nvme_subsystem_delete", json!({"nqn": SUB}));
    assert!(r["closed_sessions"].as_u64().unwrap() >= 3, "{r}");
    assert!(q.closed_within(Duration::from_secs(10)), "I/O queue closed");
    assert!(a.closed_within(Duration::from_secs(10)), "controller ended");
    assert!(
        a2.closed_within(Duration::from_secs(10)),
        "controller ended"
    );
    let (_, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &Opts::default()).unwrap();
    assert_eq!(done.code(), 0x182, "no such subsystem any more");
}

#[test]
fn blkwire_subsystem_commands_change_and_list_subsystems() {
    let dir = TempDir::new("nvme-cli-sub");
    let t = Controlled::start(&dir, &["a=mem:1M", "b=mem:1M"]);
    let run = |args: &[&str]| {
        let mut a = vec!["subsystem"];
        a.extend_from_slice(args);
        a.extend(["--socket", &t.t.sock]);
        let (ok, out, err) = cli(&a);
        assert!(ok, "{args:?}: {err}");
        out
    };
    let sub = "nqn.2026-11.com.example:cli";
    let host = nvme_host::HOSTNQN;
    assert_eq!(
        run(&["add", sub, "--serial", "CLI1", "--model", "Cli Model"]),
        format!("created subsystem {sub} (serial CLI1, model Cli Model)\n")
    );
    assert_eq!(
        run(&["add-ns", sub, "b", "--nsid", "4"]),
        format!("export b is namespace 4 of {sub}\n")
    );
    assert_eq!(
        run(&["add-ns", sub, "a"]),
        format!("export a is namespace 1 of {sub}\n")
    );
    assert_eq!(
        run(&["add-host", sub, host]),
        format!("host {host} may connect to {sub}\n")
    );
    let ls = run(&["ls"]);
    let line = ls.lines().find(|l| l.starts_with(sub)).expect("listed");
    assert!(line.contains("1=a,4=b") && line.contains(host), "{line}");
    assert!(
        ls.contains("nqn.2026-11.io.blkwire:a"),
        "every export's own too: {ls}"
    );
    let mut c = controller(&t.addr, sub, &Opts::default());
    assert_eq!(active(&c.identify(2, 0).data), [1, 4]);
    assert_eq!(
        run(&["rm-ns", sub, "4"]),
        format!("removed namespace 4 (export b) of {sub} (closed 1 session)\n")
    );
    common::assert_one_line_error(
        &["subsystem", "add-ns", sub, "nosuch", "--socket", &t.t.sock],
        "no export 'nosuch'",
    );
    assert_eq!(
        run(&["rm-host", sub, host]),
        format!("host {host} may no longer connect to {sub} (closed 1 session)\n")
    );
    assert!(
        c.closed_within(Duration::from_secs(10)),
        "its controller ended"
    );
    assert_eq!(run(&["rm", sub]), format!("deleted subsystem {sub}\n"));
    assert!(!run(&["ls"]).contains(sub));
}

/// With a key store, a subsystem's host list names host NQNs that DH-HMAC-CHAP proves: a keyed
/// host not on the list is refused, one on it must authenticate on every queue, and a wrong key
/// gets no controller; each namespace's export rules apply to the proven NQN too.
#[test]
fn with_keys_a_subsystem_admits_the_proven_hosts_on_its_list() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::authenticate;
    let dir = TempDir::new("nvme-auth-sub");
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";
    let bob = "nqn.2014-08.org.nvmexpress:uuid:b0b00000-0000-4000-8000-000000000002";
    let (ka, kb) = (Secret::generate(), Secret::generate());
    let keys = key_file(
        &dir,
        &[
            format!("{alice}:{}", ka.to_dhhc().unwrap()),
            format!("{bob}:{}", kb.to_dhhc().unwrap()),
        ],
    );
    let only_alice = format!("{SUB}=a,b;allow={alice}");
    let bobs = "nqn.2026-11.com.example:bobs";
    let t = NvmeTarget::start_with(
        &["a=mem:1M", "b=mem:2M", &format!("c=mem:1M,allow={bob}")],
        &[
            "--keys",
            &keys,
            "--subsystem",
            &only_alice,
            "--subsystem",
            &format!("{bobs}=a,c"),
        ],
    );
    let opts = |nqn: &str| Opts {
        hostnqn: nqn.into(),
        ..Opts::default()
    };
    let (_, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &opts(bob)).unwrap();
    assert_eq!(done.code(), 0x184, "bob has a key but is not on the list");
    // Export c admits only bob: alice may not have a subsystem with it in it.
    let (_, done) = Queue::connect(&t.addr, bobs, 0, 0xffff, &opts(alice)).unwrap();
    assert_eq!(done.code(), 0x184, "export c's rules refuse alice");
    let (mut w, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &opts(alice)).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(alice, SUB, &kb, None, 1);
    assert!(!authenticate(&mut w, &mut host), "a wrong key accepted");
    assert!(w.closed_within(Duration::from_secs(10)));
    let (mut a, done) = Queue::connect(&t.addr, SUB, 0, 0xffff, &opts(alice)).unwrap();
    assert_ne!(done.cqe.dw0 & 1 << 17, 0, "ATR");
    let mut host = HostAuth::new(alice, SUB, &ka, None, 1);
    assert!(authenticate(&mut a, &mut host), "alice's key");
    a.enable();
    assert_eq!(active(&a.identify(2, 0).data), [1, 2]);
    let (mut q, _) = Queue::connect(&t.addr, SUB, 1, a.cntlid, &opts(alice)).unwrap();
    let mut host = HostAuth::new(alice, SUB, &ka, None, 2);
    assert!(authenticate(&mut q, &mut host));
    q.nsid = 2;
    assert_eq!(q.write_in(0, &[9; 512], BS).unwrap().code(), 0);
    assert_eq!(q.read(0, 1, BS).unwrap().data, vec![9; 512]);
    // Bob on his own subsystem, whose exports admit him.
    let (mut b, _) = Queue::connect(&t.addr, bobs, 0, 0xffff, &opts(bob)).unwrap();
    let mut host = HostAuth::new(bob, bobs, &kb, None, 1);
    assert!(authenticate(&mut b, &mut host), "bob's key");
    b.enable();
    assert_eq!(active(&b.identify(2, 0).data), [1, 2]);
}

/// With keys, a controller's sessions are admitted only once its host has proved its key: an
/// admin queue that connected but has not authenticated holds no session (none listed, none
/// counted against the limits), its I/O queues are refused, and DH-HMAC-CHAP creates them.
#[test]
fn with_keys_a_controller_has_no_session_until_its_host_authenticates() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::authenticate;
    use serde_json::json;
    let dir = TempDir::new("nvme-auth-no-session");
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";
    let ka = Secret::generate();
    let keys = key_file(&dir, &[format!("{alice}:{}", ka.to_dhhc().unwrap())]);
    let t = Controlled::start_with(&dir, &["disk0=mem:1M", "disk1=mem:1M"], &["--keys", &keys]);
    let o = Opts {
        hostnqn: alice.into(),
        ..Opts::default()
    };
    // Anyone may claim alice's NQN: Connect answers "authentication required" ...
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    assert_ne!(done.cqe.dw0 & 1 << 17, 0, "ATR");
    // ... and the controller exists, without a session.
    assert_eq!(t.rpc("session_list", json!({})), json!([]));
    let subs = t.rpc("nvme_subsystem_list", json!({}));
    let c = &subs[0]["controllers"][0];
    assert_eq!(
        (&c["cntlid"], &c["session"], &c["authenticated"]),
        (&json!(a.cntlid), &serde_json::Value::Null, &json!(false)),
        "{subs}"
    );
    // An I/O queue naming it is refused before any exchange, even with alice's key at hand.
    let (_, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0x182, "Connect Invalid Parameters");
    assert_eq!(t.rpc("session_list", json!({})), json!([]));
    // Once alice proves her key, the controller has its session, and I/O queues connect.
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 1);
    assert!(authenticate(&mut a, &mut host), "alice's key");
    let sessions = t.rpc("session_list", json!({}));
    assert_eq!(sessions.as_array().map(Vec::len), Some(1), "{sessions}");
    assert_eq!(sessions[0]["host"], alice, "{sessions}");
    let subs = t.rpc("nvme_subsystem_list", json!({}));
    assert_eq!(subs[0]["controllers"][0]["authenticated"], true, "{subs}");
    a.enable();
    assert_eq!(active(&a.identify(2, 0).data), [1]);
    let (mut q, _) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 2);
    assert!(authenticate(&mut q, &mut host));
    assert_eq!(q.write_in(0, &[5; 512], BS).unwrap().code(), 0);
    assert_eq!(q.read(0, 1, BS).unwrap().data, vec![5; 512]);
    // Admission looks at the rules as they are when the host has proved its key: rules changed
    // meanwhile (no session to close then) keep it out; the host reads AUTH_Failure1 where
    // Success1 would have been, and the controller ends.
    let (mut b, done) = Queue::connect(&t.addr, &nqn("disk1"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    t.rpc(
        "export_set_allow",
        json!({"name": "disk1", "allow": "nqn.2014-08.org.nvmexpress:uuid:someone-else"}),
    );
    let mut host = HostAuth::new(alice, &nqn("disk1"), &ka, None, 1);
    send_reply(&mut b, &mut host);
    read_failure1(&mut b, &mut host);
    assert!(
        b.closed_within(Duration::from_secs(10)),
        "a controller the rules no longer admit went on"
    );
    let sessions = t.rpc("session_list", json!({}));
    assert!(
        sessions
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["export"] == "disk0"),
        "{sessions}"
    );
}

/// An AUTH_Receive whose allocation length is more than the host's buffer (its SGL) holds
/// is refused (Data SGL Length Invalid) without data and without using up the message it
/// would have read: the next, within its buffer, reads the Challenge, and the exchange ends
/// authenticated. On the admin queue and on an I/O queue (which sent the message past the
/// buffer; on both, the Challenge was lost).
#[test]
fn auth_receive_past_the_hosts_buffer_loses_nothing_and_a_failed_reauthentication_revokes() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::{auth_receive, auth_receive_sized, auth_send};
    let dir = TempDir::new("nvme-auth-room");
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000002";
    let ka = Secret::generate();
    let keys = key_file(&dir, &[format!("{alice}:{}", ka.to_dhhc().unwrap())]);
    let t = Controlled::start_with(&dir, &["disk0=mem:1M"], &["--keys", &keys]);
    let o = Opts {
        hostnqn: alice.into(),
        ..Opts::default()
    };
    let exchange = |q: &mut Queue, seq: u16| {
        let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, seq);
        assert_eq!(auth_send(q, &host.negotiate()).code(), 0);
        let short = auth_receive_sized(q, 4096, 64);
        assert_eq!(short.code(), 0x0f, "Data SGL Length Invalid");
        assert!(short.data.is_empty(), "{} bytes sent", short.data.len());
        let challenge = auth_receive(q);
        assert_eq!(challenge.code(), 0);
        let reply = host.on_challenge(&challenge.data).expect("the Challenge");
        assert_eq!(auth_send(q, &reply).code(), 0);
        let s1 = auth_receive(q);
        assert_eq!(s1.code(), 0);
        assert!(host.on_success1(&s1.data).is_ok(), "authenticated");
    };
    let (mut a, _) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    exchange(&mut a, 1);
    a.enable();
    let (mut q, _) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    exchange(&mut q, 2);
    assert_eq!(q.write_in(0, &[5; 512], BS).unwrap().code(), 0);
    // A re-authentication whose Reply does not check out (another key) takes the admin
    // queue's access away at once, whether or not the host reads Failure1.
    assert_eq!(a.identify(1, 0).code(), 0);
    let mut other = HostAuth::new(alice, &nqn("disk0"), &Secret::generate(), None, 3);
    assert_eq!(auth_send(&mut a, &other.negotiate()).code(), 0);
    let challenge = auth_receive(&mut a);
    let reply = other.on_challenge(&challenge.data).expect("a Challenge");
    assert_eq!(auth_send(&mut a, &reply).code(), 0);
    assert_eq!(a.identify(1, 0).code(), 0x191, "Authentication Required");
}

/// The AUTH_Receive after the host's Reply reads AUTH_Failure1 ("authentication failed"), not
/// Success1: the host knows it is refused.
fn read_failure1(q: &mut Queue, host: &mut blkwire_auth::dhchap::HostAuth) {
    use blkwire_auth::dhchap::{Failure, Reason};
    let s1 = nvme_host::auth_receive(q);
    assert_eq!(s1.code(), 0, "AUTH_Receive answered");
    assert_eq!(
        &s1.data[..2],
        [0x00, 0xf1],
        "AUTH_Failure1: {:?}",
        &s1.data[..8]
    );
    assert_eq!(
        host.on_success1(&s1.data),
        Err(Failure {
            reason: Reason::Failed
        })
    );
}

/// A host refused after it proved its key, by what only admission checks (here the per-host
/// session limit its first controller reached; then an I/O queue its controller's sessions
/// already have), is told so in the exchange rather than by a closed connection: the
/// AUTH_Receive that would read Success1 reads AUTH_Failure1 ("authentication failed"),
/// one-way or both ways, and then the queue ends. Nothing of it stays admitted.
#[test]
fn a_host_refused_after_proving_its_key_reads_failure1() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::authenticate;
    use serde_json::json;
    let dir = TempDir::new("nvme-auth-refused");
    let alice = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";
    let (ka, kc) = (Secret::generate(), Secret::generate());
    let line = format!(
        "{alice}:{} {}",
        ka.to_dhhc().unwrap(),
        kc.to_dhhc().unwrap()
    );
    let keys = key_file(&dir, &[line]);
    let t = Controlled::start_with(
        &dir,
        &["disk0=mem:1M", "disk1=mem:1M"],
        &["--keys", &keys, "--max-sessions-per-host", "1"],
    );
    let o = Opts {
        hostnqn: alice.into(),
        ..Opts::default()
    };
    let (mut a, _) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 1);
    assert!(authenticate(&mut a, &mut host), "alice's key");
    let only_disk0 = |t: &Controlled| {
        let sessions = t.rpc("session_list", json!({}));
        let list = sessions.as_array().unwrap();
        assert!(
            list.len() == 1 && list[0]["export"] == "disk0",
            "{sessions}"
        );
    };
    only_disk0(&t);
    // Her second controller: Connect admits nothing yet, so it is answered; once she proves
    // her key its session would be her second.
    for ctrl_key in [None, Some(&kc)] {
        let (mut b, done) = Queue::connect(&t.addr, &nqn("disk1"), 0, 0xffff, &o).unwrap();
        assert_eq!(done.code(), 0);
        let mut host = HostAuth::new(alice, &nqn("disk1"), &ka, ctrl_key, 1);
        send_reply(&mut b, &mut host);
        read_failure1(&mut b, &mut host);
        assert!(
            b.closed_within(Duration::from_secs(10)),
            "a refused controller went on"
        );
        only_disk0(&t);
    }
    // Her I/O queue 1 joins; a second queue 1 cannot (the sessions have it) and is told so.
    a.enable();
    let (mut q, _) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, None, 2);
    assert!(authenticate(&mut q, &mut host));
    let (mut q2, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(alice, &nqn("disk0"), &ka, Some(&kc), 3);
    send_reply(&mut q2, &mut host);
    read_failure1(&mut q2, &mut host);
    assert!(
        q2.closed_within(Duration::from_secs(10)),
        "a refused I/O queue went on"
    );
    // The first queue 1 still serves.
    assert_eq!(q.write_in(0, &[7; 512], BS).unwrap().code(), 0);
    assert_eq!(q.read(0, 1, BS).unwrap().data, vec![7; 512]);
    only_disk0(&t);
}

/// DH-HMAC-CHAP up to the host's Reply (AUTH_Send of it answered); Success1 is not read.
fn send_reply(q: &mut Queue, host: &mut blkwire_auth::dhchap::HostAuth) {
    assert_eq!(nvme_host::auth_send(q, &host.negotiate()).code(), 0);
    let challenge = nvme_host::auth_receive(q);
    assert_eq!(challenge.code(), 0);
    let reply = host.on_challenge(&challenge.data).unwrap();
    assert_eq!(nvme_host::auth_send(q, &reply).code(), 0, "AUTH_Send reply");
}

/// A target exporting disk0 with keys, where ALICE has a DH-HMAC-CHAP key (`old`; `new` is for
/// a rotation): the target, its key file, the two keys, and ALICE's host options.
fn alice_keyed(
    dir: &TempDir,
) -> (
    Controlled,
    String,
    (blkwire_auth::dhchap::Secret, blkwire_auth::dhchap::Secret),
    Opts,
) {
    use blkwire_auth::dhchap::Secret;
    let (old, new) = (Secret::generate(), Secret::generate());
    let keys = key_file(dir, &[format!("{ALICE}:{}", old.to_dhhc().unwrap())]);
    let t = Controlled::start_with(dir, &["disk0=mem:1M"], &["--keys", &keys]);
    let o = Opts {
        hostnqn: ALICE.into(),
        ..Opts::default()
    };
    (t, keys, (old, new), o)
}

/// A `keys_load` that replaces a host's key while its DH-HMAC-CHAP is under way (the exchange
/// began with the old key, so the host's proof is checked with it): the controller's sessions
/// record the key the host proved, not the store's new one, so they do not outlive the key.
#[test]
fn a_key_replaced_during_dh_hmac_chap_leaves_no_session_with_the_old_key() {
    use blkwire_auth::dhchap::HostAuth;
    use serde_json::json;
    let dir = TempDir::new("nvme-auth-rotate");
    let (t, _keys, (old, new), o) = alice_keyed(&dir);
    let alice = ALICE;
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(alice, &nqn("disk0"), &old, None, 1);
    assert_eq!(nvme_host::auth_send(&mut a, &host.negotiate()).code(), 0);
    let challenge = nvme_host::auth_receive(&mut a);
    assert_eq!(challenge.code(), 0);
    // Alice's key is replaced now: she has no session yet, so nothing is closed ...
    let rotated = key_file(&dir, &[format!("{alice}:{}", new.to_dhhc().unwrap())]);
    let r = t.rpc("keys_load", json!({ "path": rotated }));
    assert_eq!(r["closed_sessions"], 0);
    // ... and she completes the exchange with the old one, as its secrets were.
    let reply = host.on_challenge(&challenge.data).unwrap();
    assert_eq!(nvme_host::auth_send(&mut a, &reply).code(), 0);
    // Success1 (the target may as well have ended the controller instead).
    let mut c = nvme_host::fabrics(0x06);
    c.cdw10 = 0xe9 << 24 | 0x01 << 16 | 0x01 << 8;
    c.cdw11 = 4096;
    let _ = a.command_in(c, &[], 4096);
    // Whatever session she got was proven with a key the store no longer has: the next check
    // of the keys (the same file again) closes it, if nothing did before.
    t.rpc("keys_load", json!({ "path": rotated }));
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "a controller proven with a replaced key went on"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sessions = t.rpc("session_list", json!({}));
        if sessions == json!([]) {
            break;
        }
        assert!(Instant::now() < deadline, "still open: {sessions}");
        std::thread::sleep(Duration::from_millis(20)); // polling a listing, not a sync point
    }
}

// ---- What a host admitted after proving its key gives back ----
//
// With keys, a queue is admitted (an admin queue: its controller's session; an I/O queue: its
// place in that session) as soon as its host has proved its key, before Success1. From then on
// the host may still end the exchange (AUTH_Failure2, refusing the controller's proof), close
// the connection, or leave the exchange unfinished past the handshake deadline: each must give
// back what was admitted. Alice proves her key; with `--max-sessions-per-host 1` her next
// controller is admitted only if her last one's session was released, and `session_list`
// counts an I/O queue in its session's `queues`.

const ALICE: &str = "nqn.2014-08.org.nvmexpress:uuid:a11ce000-0000-4000-8000-000000000001";

/// A target with export disk0, alice's key and the controller's key for her (both ways may be
/// asked), one session per host, and `extra` flags; her key, the controller's, and her
/// connection options.
fn one_session_per_host(
    dir: &TempDir,
    extra: &[&str],
) -> (
    Controlled,
    blkwire_auth::dhchap::Secret,
    blkwire_auth::dhchap::Secret,
    Opts,
) {
    use blkwire_auth::dhchap::Secret;
    let (ka, kc) = (Secret::generate(), Secret::generate());
    let line = format!(
        "{ALICE}:{} {}",
        ka.to_dhhc().unwrap(),
        kc.to_dhhc().unwrap()
    );
    let keys = key_file(dir, &[line]);
    let mut args = vec!["--keys", keys.as_str(), "--max-sessions-per-host", "1"];
    args.extend_from_slice(extra);
    let t = Controlled::start_with(dir, &["disk0=mem:1M"], &args);
    let o = Opts {
        hostnqn: ALICE.into(),
        ..Opts::default()
    };
    (t, ka, kc, o)
}

/// A controller of disk0 whose host proved `key` (one-way), enabled: it holds a session.
fn authenticated_controller(t: &Controlled, key: &blkwire_auth::dhchap::Secret, o: &Opts) -> Queue {
    use blkwire_auth::dhchap::HostAuth;
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), key, None, 1);
    assert!(
        nvme_host::authenticate(&mut a, &mut host),
        "alice's controller refused (her one session not released?)"
    );
    a.enable();
    a
}

/// A two-way exchange up to the controller's proof: the host's Reply sent, and Success1
/// (carrying the controller's proof) read. The target admits the queue when it has checked the
/// Reply, before it takes the next command, so the Success1 read (not Failure1) says the queue
/// is admitted; the host has not answered the proof yet. Returns Success1.
fn prove_and_read_success1(q: &mut Queue, host: &mut blkwire_auth::dhchap::HostAuth) -> Vec<u8> {
    send_reply(q, host);
    let s1 = nvme_host::auth_receive(q);
    assert_eq!(s1.code(), 0, "AUTH_Receive answered");
    assert_eq!(&s1.data[..2], [0x01, 0x03], "Success1: {:?}", &s1.data[..8]);
    s1.data
}

/// The host checks the controller's proof in `success1` with another key than the target's,
/// refuses it, and says so with AUTH_Failure2, as the kernel host does.
fn refuse_controller_proof(
    q: &mut Queue,
    host: &mut blkwire_auth::dhchap::HostAuth,
    success1: &[u8],
) {
    let why = host
        .on_success1(success1)
        .expect_err("a proof made with the target's key checked out against another key");
    assert_eq!(
        nvme_host::auth_send(q, &host.failure2(why.reason)).code(),
        0,
        "AUTH_Send Failure2"
    );
}

/// `session_list` now.
fn session_list(t: &Controlled) -> Vec<serde_json::Value> {
    let v = t.rpc("session_list", serde_json::json!({}));
    v.as_array().expect("session_list is a list").clone()
}

/// The queues of the only session listed now (admin queue included).
fn only_session_queues(t: &Controlled) -> u64 {
    let list = session_list(t);
    assert_eq!(list.len(), 1, "one session: {list:?}");
    assert_eq!(list[0]["host"], ALICE, "{list:?}");
    list[0]["queues"].as_u64().expect("queues")
}

/// Polls `session_list` until `done` holds of it, failing after 10 s. What is awaited is the
/// target's bookkeeping after a queue ended, which the host cannot see (its connection may be
/// closed before its sessions are left): a listing polled with a deadline, not a sleep.
fn sessions_until(t: &Controlled, what: &str, done: impl Fn(&[serde_json::Value]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = session_list(t);
        if done(&list) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {list:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A controller whose host proved its key holds its session from then on; if the host then
/// refuses the controller's proof (AUTH_Failure2 on the admin queue), the controller ends at
/// once and its session is released: gone from the list, and, with one session per host, the
/// host's next controller is admitted. (The handshake deadline is 60 s: not what ends it.)
#[test]
fn a_controller_whose_host_sends_failure2_after_admission_releases_its_session() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    let dir = TempDir::new("nvme-auth-release-failure2");
    let (t, ka, _kc, o) = one_session_per_host(&dir, &["--handshake-timeout", "60"]);
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&Secret::generate()), 1);
    let s1 = prove_and_read_success1(&mut a, &mut host);
    assert_eq!(only_session_queues(&t), 1, "admitted: its session, queue 0");
    refuse_controller_proof(&mut a, &mut host, &s1);
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "a controller whose host sent Failure2 went on"
    );
    sessions_until(&t, "a session outlived its host's Failure2", |l| {
        l.is_empty()
    });
    let _a = authenticated_controller(&t, &ka, &o);
    assert_eq!(only_session_queues(&t), 1);
}

/// An I/O queue joins its controller's session once its host proved its key; if the host then
/// refuses the controller's proof (AUTH_Failure2 on that queue), the queue closes and leaves
/// the session (its queue count drops back), while the controller goes on and another I/O
/// queue joins and serves.
#[test]
fn an_io_queue_whose_host_sends_failure2_after_joining_leaves_its_session() {
    use blkwire_auth::dhchap::{HostAuth, Secret};
    use nvme_host::authenticate;
    let dir = TempDir::new("nvme-auth-release-io-failure2");
    let (t, ka, _kc, o) = one_session_per_host(&dir, &["--handshake-timeout", "60"]);
    let a = authenticated_controller(&t, &ka, &o);
    let (mut q, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&Secret::generate()), 2);
    let s1 = prove_and_read_success1(&mut q, &mut host);
    assert_eq!(only_session_queues(&t), 2, "queue 1 joined");
    refuse_controller_proof(&mut q, &mut host, &s1);
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "an I/O queue whose host sent Failure2 went on"
    );
    sessions_until(&t, "queue 1 stayed in the session after Failure2", |l| {
        l.len() == 1 && l[0]["queues"] == 1
    });
    let (mut q2, done) = Queue::connect(&t.addr, &nqn("disk0"), 2, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, None, 3);
    assert!(authenticate(&mut q2, &mut host));
    assert_eq!(q2.write_in(0, &[3; 512], BS).unwrap().code(), 0);
    assert_eq!(q2.read(0, 1, BS).unwrap().data, vec![3; 512]);
    assert_eq!(only_session_queues(&t), 2);
}

/// A connection that closes once admitted releases what it was admitted to: an admin queue
/// closed mid-exchange (its host proved its key, the controller's proof not yet answered), its
/// controller's session (the host's next controller is admitted, one session per host); an I/O
/// queue closed mid-exchange, or once serving on a reactor, its place in the session.
#[test]
fn a_queue_closed_after_admission_releases_it() {
    use blkwire_auth::dhchap::HostAuth;
    use nvme_host::authenticate;
    let dir = TempDir::new("nvme-auth-release-close");
    let (t, ka, kc, o) = one_session_per_host(&dir, &["--handshake-timeout", "60"]);
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&kc), 1);
    prove_and_read_success1(&mut a, &mut host);
    assert_eq!(only_session_queues(&t), 1, "admitted: its session, queue 0");
    drop(a);
    sessions_until(&t, "a closed admin queue's session stayed", |l| {
        l.is_empty()
    });
    let a = authenticated_controller(&t, &ka, &o);
    // Mid-exchange.
    let (mut q, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&kc), 2);
    prove_and_read_success1(&mut q, &mut host);
    assert_eq!(only_session_queues(&t), 2, "queue 1 joined");
    drop(q);
    sessions_until(&t, "a closed I/O queue (mid-exchange) stayed", |l| {
        l.len() == 1 && l[0]["queues"] == 1
    });
    // Serving.
    let (mut q, done) = Queue::connect(&t.addr, &nqn("disk0"), 2, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, None, 3);
    assert!(authenticate(&mut q, &mut host));
    assert_eq!(q.write_in(0, &[4; 512], BS).unwrap().code(), 0);
    assert_eq!(only_session_queues(&t), 2, "queue 2 joined");
    drop(q);
    sessions_until(&t, "a closed I/O queue (serving) stayed", |l| {
        l.len() == 1 && l[0]["queues"] == 1
    });
}

/// A host that proves its key and then never finishes the exchange (it leaves the controller's
/// proof unanswered) keeps nothing past the handshake deadline: an admin queue's controller
/// ends and its session is released (the host's next controller is admitted, one session per
/// host); an I/O queue closes and leaves its controller's session, which goes on.
#[test]
fn a_host_admitted_but_never_finishing_dh_hmac_chap_releases_at_the_deadline() {
    use blkwire_auth::dhchap::HostAuth;
    let dir = TempDir::new("nvme-auth-release-deadline");
    let (t, ka, kc, o) = one_session_per_host(&dir, &["--handshake-timeout", "3"]);
    let (mut a, done) = Queue::connect(&t.addr, &nqn("disk0"), 0, 0xffff, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&kc), 1);
    prove_and_read_success1(&mut a, &mut host);
    assert_eq!(only_session_queues(&t), 1, "admitted: its session, queue 0");
    // Nothing more from the host.
    assert!(
        a.closed_within(Duration::from_secs(10)),
        "an admitted controller outlived the handshake deadline"
    );
    sessions_until(&t, "a session outlived the handshake deadline", |l| {
        l.is_empty()
    });
    let mut a = authenticated_controller(&t, &ka, &o);
    let (mut q, done) = Queue::connect(&t.addr, &nqn("disk0"), 1, a.cntlid, &o).unwrap();
    assert_eq!(done.code(), 0);
    let mut host = HostAuth::new(ALICE, &nqn("disk0"), &ka, Some(&kc), 2);
    prove_and_read_success1(&mut q, &mut host);
    assert_eq!(only_session_queues(&t), 2, "queue 1 joined");
    assert!(
        q.closed_within(Duration::from_secs(10)),
        "an admitted I/O queue outlived the handshake deadline"
    );
    sessions_until(&t, "queue 1 stayed in the session past the deadline", |l| {
        l.len() == 1 && l[0]["queues"] == 1
    });
    assert_eq!(a.identify(1, 0).code(), 0, "the controller goes on");
}
