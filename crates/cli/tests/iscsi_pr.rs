//! Persistent reservations over iSCSI (issue 17; SPC-4 PERSISTENT RESERVE IN/OUT): two
//! sessions of two initiators on one export through the test kit's initiator
//! (`common::iscsi_host`), on one reactor and across two. libiscsi's PR tests run in
//! `iscsi.rs`'s conformance suite.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use blkwire_wire::iscsi::{flag, op, Digests};
use common::iscsi_host::{login_as, prout, Conn};
use common::Target;

const PREFIX: &str = "iqn.2026-11.io.blkwire:";
/// SCSI status GOOD.
const GOOD: u8 = 0x00;
/// SCSI status RESERVATION CONFLICT.
const CONFLICT: u8 = 0x18;

/// PERSISTENT RESERVE OUT service actions and types (SPC-4).
const REGISTER: u8 = 0x00;
const RESERVE: u8 = 0x01;
const RELEASE: u8 = 0x02;
const CLEAR: u8 = 0x03;
const WRITE_EXCLUSIVE: u8 = 0x1;
const EXCLUSIVE_ACCESS: u8 = 0x3;

/// A target with an `iscsi://` listener on `threads` reactors and a metrics endpoint.
struct PrTarget {
    _t: Target,
    addr: String,
    metrics: String,
}

impl PrTarget {
    fn start(threads: usize) -> PrTarget {
        let mut cmd = Command::new(common::BIN);
        let threads = threads.to_string();
        cmd.args([
            "serve",
            "--rpc-socket",
            "none",
            "--log-level",
            "warn",
            "--listen",
            "iscsi://127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
            "--threads",
            &threads,
            "--export",
            "lun=mem:16M",
        ]);
        let (child, urls, metrics) = common::spawn_serve_with_metrics(&mut cmd, 1);
        let t = Target {
            child,
            base: urls[0].clone(),
        };
        let addr = urls[0]
            .strip_prefix("iscsi://")
            .unwrap_or_else(|| panic!("not an iscsi:// listener: {urls:?}"))
            .to_string();
        PrTarget {
            _t: t,
            addr,
            metrics,
        }
    }

    fn login(&self, initiator: &str) -> Conn {
        login_as(
            &self.addr,
            &format!("{PREFIX}lun"),
            Digests::default(),
            initiator,
        )
    }

    /// The reactor (`thread` label) of every open queue of the export.
    fn threads(&self) -> Vec<String> {
        let rest = self
            .metrics
            .strip_prefix("http://")
            .expect("an http:// metrics URL");
        let (host, path) = rest.split_once('/').expect("a path");
        let mut s = TcpStream::connect(host).expect("connect to the metrics endpoint");
        write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text.lines()
            .filter(|l| l.starts_with("blkwire_queue_in_flight{export=\"lun\""))
            .filter_map(|l| {
                let at = l.find("thread=\"")? + 8;
                Some(l[at..].split('"').next()?.to_string())
            })
            .collect()
    }
}

/// PERSISTENT RESERVE IN READ RESERVATION: the holder's key and the type, if reserved.
fn read_reservation(c: &mut Conn) -> Option<(u64, u8)> {
    let cdb = [0x5e, 0x01, 0, 0, 0, 0, 0, 0, 24, 0];
    let (_, pdu) = c.command(&cdb, 24, false, &[]);
    c.send(&pdu).unwrap();
    let r = c.recv().expect("a response to PERSISTENT RESERVE IN");
    assert_eq!(
        r.opcode(),
        op::DATA_IN,
        "READ RESERVATION answers with data"
    );
    assert_ne!(r.bhs[1] & flag::STATUS, 0, "and its status");
    assert_eq!(r.bhs[3], GOOD);
    let d = &r.data;
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap());
    (len >= 16).then(|| {
        (
            u64::from_be_bytes(d[8..16].try_into().unwrap()),
            d[21] & 0x0f,
        )
    })
}

fn block(fill: u8) -> Vec<u8> {
    vec![fill; 512]
}

/// Two initiators on one export: A registers and reserves Write Exclusive; B's WRITE gets
/// RESERVATION CONFLICT and changes nothing, its READ works; A still writes; after A's RELEASE
/// B writes again.
#[test]
fn write_exclusive_refuses_the_other_initiators_writes_until_released() {
    let t = PrTarget::start(1);
    let mut a = t.login("iqn.2026-11.io.test:pr-a");
    let mut b = t.login("iqn.2026-11.io.test:pr-b");
    assert_eq!(a.write(0, &block(0xA0)), GOOD);
    assert_eq!(read_reservation(&mut b), None);
    assert_eq!(prout(&mut a, REGISTER, 0, 0, 0xA1), GOOD);
    assert_eq!(prout(&mut a, RESERVE, WRITE_EXCLUSIVE, 0xA1, 0), GOOD);
    assert_eq!(read_reservation(&mut b), Some((0xA1, WRITE_EXCLUSIVE)));

    assert_eq!(b.write(0, &block(0xB0)), CONFLICT, "B may not write");
    let (data, st) = b.read(0, 1);
    assert_eq!(st, GOOD, "B may read under Write Exclusive");
    assert_eq!(data, block(0xA0), "B's refused WRITE changed nothing");
    assert_eq!(a.write(8, &block(0xA8)), GOOD, "the holder writes");
    // An unregistered B cannot release A's reservation (nor reserve over it).
    assert_eq!(prout(&mut b, RELEASE, WRITE_EXCLUSIVE, 0, 0), CONFLICT);
    assert_eq!(prout(&mut b, RESERVE, WRITE_EXCLUSIVE, 0, 0), CONFLICT);

    assert_eq!(prout(&mut a, RELEASE, WRITE_EXCLUSIVE, 0xA1, 0), GOOD);
    assert_eq!(read_reservation(&mut b), None);
    assert_eq!(b.write(0, &block(0xB0)), GOOD, "released: B writes again");
    assert_eq!(b.read(0, 1), (block(0xB0), GOOD));
}

/// The two sessions run on two reactors (the metrics' thread labels say so): a reservation made
/// through one binds the other from the moment its PERSISTENT RESERVE OUT is answered, every
/// time, and so does its end. Then a new session (joining a reactor while the reservation
/// holds) is bound from its first command, and A's registration survives its logout (SPC-4:
/// registrations persist across the loss of the I_T nexus; APTPL is not supported, so not
/// across a restart).
#[test]
fn a_reservation_made_on_one_reactor_binds_connections_on_another() {
    let t = PrTarget::start(2);
    let mut a = t.login("iqn.2026-11.io.test:pr-a");
    let mut b = t.login("iqn.2026-11.io.test:pr-b");
    // A session's queue joins its reactor just after the login answer: wait until both have.
    let mut threads = Vec::new();
    common::wait_until(std::time::Duration::from_secs(5), || {
        threads = t.threads();
        threads.len() == 2
    });
    threads.sort();
    assert_eq!(
        threads,
        ["0", "1"],
        "the two sessions should run on the two reactors"
    );
    assert_eq!(prout(&mut a, REGISTER, 0, 0, 0xA1), GOOD);
    for round in 0..20 {
        assert_eq!(prout(&mut a, RESERVE, EXCLUSIVE_ACCESS, 0xA1, 0), GOOD);
        assert_eq!(b.read(0, 1).1, CONFLICT, "round {round}: B reads");
        assert_eq!(
            b.write(0, &block(round)),
            CONFLICT,
            "round {round}: B writes"
        );
        assert_eq!(a.read(0, 1).1, GOOD, "round {round}: the holder reads");
        assert_eq!(prout(&mut a, RELEASE, EXCLUSIVE_ACCESS, 0xA1, 0), GOOD);
        assert_eq!(b.write(0, &block(round)), GOOD, "round {round}: released");
    }
    assert_eq!(prout(&mut a, RESERVE, EXCLUSIVE_ACCESS, 0xA1, 0), GOOD);
    let mut c = t.login("iqn.2026-11.io.test:pr-c");
    assert_eq!(
        c.read(0, 1).1,
        CONFLICT,
        "a session that joined later is bound"
    );
    drop(a);
    let mut a = t.login("iqn.2026-11.io.test:pr-a");
    // The test kit logs in with the same ISID every time: the same I_T nexus again, still
    // registered and still holding the reservation.
    assert_eq!(read_reservation(&mut c), Some((0xA1, EXCLUSIVE_ACCESS)));
    assert_eq!(a.read(0, 1).1, GOOD, "the same nexus holds it again");
    assert_eq!(prout(&mut a, CLEAR, 0, 0xA1, 0), GOOD);
    assert_eq!(c.read(0, 1).1, GOOD, "cleared");
    assert_eq!(b.read(0, 1).1, GOOD, "cleared");
}
