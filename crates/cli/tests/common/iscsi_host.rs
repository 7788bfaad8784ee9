//! A small iSCSI initiator for tests (RFC 7143), built on `blkwire_wire::iscsi`: login with
//! chosen digests, READ(16)/WRITE(16) with immediate data and R2T-driven Data-Out, NOP-Out,
//! and raw PDUs for hostile-input tests. Blocking, one command at a time.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use blkwire_wire::iscsi::{self, flag, op, Bhs, Digests, Progress, RESERVED_TAG};

/// Our MaxRecvDataSegmentLength.
pub const RECV_MAX: u32 = 65536;

/// A logged-in connection.
pub struct Conn {
    pub s: TcpStream,
    pub d: Digests,
    pub cmdsn: u32,
    pub expstatsn: u32,
    pub itt: u32,
    /// The target's MaxRecvDataSegmentLength.
    pub send_max: u32,
    pub max_burst: u32,
    pub first_burst: u32,
}

/// A PDU as received: its header and data.
pub struct Rx {
    pub bhs: [u8; 48],
    pub data: Vec<u8>,
}

impl Rx {
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }
    pub fn word(&self, at: usize) -> u32 {
        u32::from_be_bytes(self.bhs[at..at + 4].try_into().unwrap())
    }
}

/// Reads one PDU (None: the connection closed or timed out).
pub fn read_pdu(s: &mut TcpStream, d: &Digests) -> Option<Rx> {
    let mut buf = vec![0u8; 48];
    s.read_exact(&mut buf).ok()?;
    loop {
        match iscsi::pdu_len(&buf, d, 16 << 20).ok()? {
            Progress::Complete(n) => {
                let p = iscsi::decode(&buf[..n], d).expect("the target's PDU decodes");
                return Some(Rx {
                    bhs: *p.bhs,
                    data: p.data.to_vec(),
                });
            }
            Progress::Need(n) => {
                let have = buf.len();
                buf.resize(n, 0);
                s.read_exact(&mut buf[have..]).ok()?;
            }
        }
    }
}

fn text(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        iscsi::push_pair(&mut out, k, v);
    }
    out
}

/// The key=value pairs of a response.
pub fn keys(data: &[u8]) -> Vec<(String, String)> {
    iscsi::pairs(data)
        .map(|p| {
            let (k, v) = p.expect("well-formed text");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Logs in to `target` at `addr` without authentication, asking for `digests` (CRC32C or
/// None for each); panics unless the login succeeds.
pub fn login(addr: &str, target: &str, digests: Digests) -> Conn {
    login_as(
        addr,
        target,
        digests,
        "iqn.2026-11.io.blkwire:test-initiator",
    )
}

/// [`login`] as the initiator named `initiator` (another I_T nexus than the default's).
pub fn login_as(addr: &str, target: &str, digests: Digests, initiator: &str) -> Conn {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = Bhs::new(op::LOGIN_REQ | iscsi::IMMEDIATE, flag::TRANSIT | 1 << 2 | 3);
    b.0[8..14].copy_from_slice(&[0x80, 0, 0, 1, 0, 0]);
    b.itt(1);
    let onoff = |on| if on { "CRC32C" } else { "None" };
    let t = text(&[
        ("InitiatorName", initiator),
        ("SessionType", "Normal"),
        ("TargetName", target),
        ("HeaderDigest", onoff(digests.header)),
        ("DataDigest", onoff(digests.data)),
        ("MaxRecvDataSegmentLength", &RECV_MAX.to_string()),
        ("MaxBurstLength", "262144"),
        ("FirstBurstLength", "65536"),
        ("InitialR2T", "Yes"),
        ("ImmediateData", "Yes"),
        ("MaxOutstandingR2T", "1"),
        ("ErrorRecoveryLevel", "0"),
    ]);
    let mut out = Vec::new();
    b.encode(&t, &Digests::default(), &mut out);
    s.write_all(&out).unwrap();
    let r = read_pdu(&mut s, &Digests::default()).expect("a login response");
    assert_eq!(r.opcode(), op::LOGIN_RSP);
    assert_eq!((r.bhs[36], r.bhs[37]), (0, 0), "login status");
    assert_eq!(r.bhs[1] & 0x83, 0x83, "moved to the full feature phase");
    let mut c = Conn {
        s,
        d: digests,
        cmdsn: 0,
        expstatsn: r.word(24).wrapping_add(1),
        itt: 2,
        send_max: 8192,
        max_burst: 262144,
        first_burst: 65536,
    };
    for (k, v) in keys(&r.data) {
        let n = v.parse::<u32>().ok();
        match (k.as_str(), n) {
            ("MaxRecvDataSegmentLength", Some(n)) => c.send_max = n,
            ("MaxBurstLength", Some(n)) => c.max_burst = n,
            ("FirstBurstLength", Some(n)) => c.first_burst = n,
            ("HeaderDigest", _) => assert_eq!(v, onoff(digests.header)),
            ("DataDigest", _) => assert_eq!(v, onoff(digests.data)),
            _ => {}
        }
    }
    c
}

impl Conn {
    /// Sends raw bytes.
    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.s.write_all(bytes)
    }

    /// A SCSI Command PDU (not sent): the next ITT and CmdSN.
    pub fn command(
        &mut self,
        cdb: &[u8],
        edtl: u32,
        write: bool,
        immediate: &[u8],
    ) -> (u32, Vec<u8>) {
        let itt = self.itt;
        self.itt += 1;
        let mut f = flag::FINAL | 1;
        f |= if write { flag::WRITE } else { flag::READ };
        let mut b = Bhs::new(op::SCSI_CMD, f);
        b.itt(itt)
            .set32(20, edtl)
            .set32(24, self.cmdsn)
            .set32(28, self.expstatsn);
        b.0[32..32 + cdb.len()].copy_from_slice(cdb);
        self.cmdsn = self.cmdsn.wrapping_add(1);
        let mut out = Vec::new();
        b.encode(immediate, &self.d, &mut out);
        (itt, out)
    }

    /// Reads the next PDU, tracking StatSN.
    pub fn recv(&mut self) -> Option<Rx> {
        let r = read_pdu(&mut self.s, &self.d)?;
        if matches!(
            r.opcode(),
            op::SCSI_RSP | op::NOP_IN | op::TMF_RSP | op::LOGOUT_RSP | op::REJECT
        ) || (r.opcode() == op::DATA_IN && r.bhs[1] & flag::STATUS != 0)
        {
            self.expstatsn = r.word(24).wrapping_add(1);
        }
        Some(r)
    }

    /// WRITE(16) of `data` at `lba` (512-byte blocks): immediate data up to FirstBurstLength,
    /// then Data-Out as the R2Ts ask. Returns the SCSI status.
    pub fn write(&mut self, lba: u64, data: &[u8]) -> u8 {
        let blocks = (data.len() / 512) as u32;
        let mut cdb = [0u8; 16];
        cdb[0] = 0x8a;
        cdb[2..10].copy_from_slice(&lba.to_be_bytes());
        cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
        let imm = data
            .len()
            .min(self.first_burst as usize)
            .min(self.send_max as usize);
        let (itt, pdu) = self.command(&cdb, data.len() as u32, true, &data[..imm]);
        self.send(&pdu).unwrap();
        loop {
            let r = self.recv().expect("a response to WRITE");
            match r.opcode() {
                op::R2T => {
                    let (ttt, offset, len) = (r.word(20), r.word(40), r.word(44));
                    let mut at = offset as usize;
                    let end = (offset + len) as usize;
                    let mut datasn = 0;
                    while at < end {
                        let n = (end - at).min(self.send_max as usize);
                        let mut b =
                            Bhs::new(op::DATA_OUT, if at + n == end { flag::FINAL } else { 0 });
                        b.itt(itt)
                            .set32(20, ttt)
                            .set32(28, self.expstatsn)
                            .set32(36, datasn)
                            .set32(40, at as u32);
                        let mut out = Vec::new();
                        b.encode(&data[at..at + n], &self.d, &mut out);
                        self.send(&out).unwrap();
                        at += n;
                        datasn += 1;
                    }
                }
                op::SCSI_RSP => return r.bhs[3],
                other => panic!("unexpected opcode {other:#x} during WRITE"),
            }
        }
    }

    /// READ(16) of `blocks` 512-byte blocks at `lba`: the data and the SCSI status.
    pub fn read(&mut self, lba: u64, blocks: u32) -> (Vec<u8>, u8) {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x88;
        cdb[2..10].copy_from_slice(&lba.to_be_bytes());
        cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
        let (_, pdu) = self.command(&cdb, blocks * 512, false, &[]);
        self.send(&pdu).unwrap();
        let mut data = vec![0u8; blocks as usize * 512];
        loop {
            let r = self.recv().expect("a response to READ");
            match r.opcode() {
                op::DATA_IN => {
                    let at = r.word(40) as usize;
                    data[at..at + r.data.len()].copy_from_slice(&r.data);
                    if r.bhs[1] & flag::STATUS != 0 {
                        return (data, r.bhs[3]);
                    }
                }
                op::SCSI_RSP => return (data, r.bhs[3]),
                other => panic!("unexpected opcode {other:#x} during READ"),
            }
        }
    }

    /// A NOP-Out ping with `data`; the NOP-In's data.
    pub fn ping(&mut self, data: &[u8]) -> Option<Vec<u8>> {
        let itt = self.itt;
        self.itt += 1;
        let mut b = Bhs::new(op::NOP_OUT | iscsi::IMMEDIATE, flag::FINAL);
        b.itt(itt)
            .set32(20, RESERVED_TAG)
            .set32(24, self.cmdsn)
            .set32(28, self.expstatsn);
        let mut out = Vec::new();
        b.encode(data, &self.d, &mut out);
        self.send(&out).ok()?;
        let r = self.recv()?;
        assert_eq!((r.opcode(), r.word(16)), (op::NOP_IN, itt));
        Some(r.data)
    }

    /// True once the target has closed the connection (reads EOF within the timeout).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}
