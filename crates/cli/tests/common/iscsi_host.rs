//! A small iSCSI initiator for tests (RFC 7143), built on `blkwire_wire::iscsi`: login with
//! chosen digests (and other keys), READ(16)/WRITE(16) with immediate data, unsolicited
//! Data-Out (InitialR2T=No) and R2T-driven Data-Out, NOP-Out, and raw PDUs for hostile-input
//! tests. Blocking, one command at a time (or a batch of writes, `write_many`).

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
    /// The LUN the next commands address (SAM-5 encoding on the wire).
    pub lun: u64,
    /// The session's InitialR2T (No: writes send unsolicited Data-Out up to the first burst).
    pub initial_r2t: bool,
    /// The session's ImmediateData.
    pub immediate_data: bool,
    /// Most immediate data a command carries (tests lower it to make writes send some of
    /// their first burst as immediate data and the rest as unsolicited Data-Out).
    pub max_immediate: usize,
}

/// The initiator name [`login`] uses.
pub const INITIATOR: &str = "iqn.2026-11.io.blkwire:test-initiator";

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
    login_with(addr, target, digests, &[])
}

/// As [`login`], offering `keys` instead of the defaults for the same keys (InitialR2T=No,
/// ImmediateData=No, FirstBurstLength=...); panics unless the login succeeds.
pub fn login_with(addr: &str, target: &str, digests: Digests, keys_: &[(&str, &str)]) -> Conn {
    try_login_with(addr, target, INITIATOR, digests, keys_)
        .unwrap_or_else(|st| panic!("login to {target}: status {st:#06x}"))
}

/// [`login`] as the initiator named `initiator` (another I_T nexus than the default's).
pub fn login_as(addr: &str, target: &str, digests: Digests, initiator: &str) -> Conn {
    try_login(addr, target, initiator, digests)
        .unwrap_or_else(|st| panic!("login to {target} as {initiator}: status {st:#06x}"))
}

/// Logs in as `initiator`; `Err` is the Login Response's status (class << 8 | detail).
pub fn try_login(addr: &str, target: &str, initiator: &str, digests: Digests) -> Result<Conn, u16> {
    try_login_with(addr, target, initiator, digests, &[])
}

/// As [`try_login`], offering `keys` instead of the defaults for the same keys.
pub fn try_login_with(
    addr: &str,
    target: &str,
    initiator: &str,
    digests: Digests,
    keys_: &[(&str, &str)],
) -> Result<Conn, u16> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = Bhs::new(op::LOGIN_REQ | iscsi::IMMEDIATE, flag::TRANSIT | 1 << 2 | 3);
    b.0[8..14].copy_from_slice(&[0x80, 0, 0, 1, 0, 0]);
    b.itt(1);
    let onoff = |on| if on { "CRC32C" } else { "None" };
    let recv_max = RECV_MAX.to_string();
    let mut offer = vec![
        ("InitiatorName", initiator),
        ("SessionType", "Normal"),
        ("TargetName", target),
        ("HeaderDigest", onoff(digests.header)),
        ("DataDigest", onoff(digests.data)),
        ("MaxRecvDataSegmentLength", &recv_max),
        ("MaxBurstLength", "262144"),
        ("FirstBurstLength", "65536"),
        ("InitialR2T", "Yes"),
        ("ImmediateData", "Yes"),
        ("MaxOutstandingR2T", "1"),
        ("ErrorRecoveryLevel", "0"),
    ];
    for (k, v) in keys_ {
        match offer.iter_mut().find(|(o, _)| o == k) {
            Some(o) => o.1 = v,
            None => offer.push((k, v)),
        }
    }
    // Not a key: the session's ISID, 12 hex digits (the default is 800001000000).
    if let Some(i) = offer.iter().position(|(k, _)| *k == "ISID") {
        let hex = offer.remove(i).1;
        for (at, byte) in b.0[8..14].iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * at..2 * at + 2], 16).expect("an ISID in hex");
        }
    }
    if offer.contains(&("SessionType", "Discovery")) {
        offer.retain(|(k, _)| *k != "TargetName");
    }
    let t = text(&offer);
    let mut out = Vec::new();
    b.encode(&t, &Digests::default(), &mut out);
    s.write_all(&out).unwrap();
    let r = read_pdu(&mut s, &Digests::default()).expect("a login response");
    assert_eq!(r.opcode(), op::LOGIN_RSP);
    let status = u16::from_be_bytes([r.bhs[36], r.bhs[37]]);
    if status != 0 {
        return Err(status);
    }
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
        lun: 0,
        initial_r2t: true,
        immediate_data: true,
        max_immediate: usize::MAX,
    };
    for (k, v) in keys(&r.data) {
        let n = v.parse::<u32>().ok();
        match (k.as_str(), n) {
            ("MaxRecvDataSegmentLength", Some(n)) => c.send_max = n,
            ("MaxBurstLength", Some(n)) => c.max_burst = n,
            ("FirstBurstLength", Some(n)) => c.first_burst = n,
            ("InitialR2T", _) => c.initial_r2t = v == "Yes",
            ("ImmediateData", _) => c.immediate_data = v == "Yes",
            ("HeaderDigest", _) => assert_eq!(v, onoff(digests.header)),
            ("DataDigest", _) => assert_eq!(v, onoff(digests.data)),
            _ => {}
        }
    }
    Ok(c)
}

/// Logs in to a discovery session at `addr`, declaring `recv_max` as our
/// MaxRecvDataSegmentLength.
pub fn discovery(addr: &str, recv_max: u32) -> Conn {
    let recv = recv_max.to_string();
    let keys = [
        ("SessionType", "Discovery"),
        ("MaxRecvDataSegmentLength", recv.as_str()),
    ];
    login_with(addr, "", Digests::default(), &keys)
}

impl Conn {
    /// SendTargets=All on a discovery session, following continued Text Responses (F=0 and a
    /// TTT, RFC 7143 §11.11) with empty Text Requests: the pairs, and how many Text Responses
    /// carried them. Panics when one carries more than `max` bytes.
    pub fn send_targets(&mut self, max: usize) -> (Vec<(String, String)>, usize) {
        let itt = self.itt;
        self.itt += 1;
        let mut text = Vec::new();
        let mut ttt = RESERVED_TAG;
        let mut request = b"SendTargets=All\0".to_vec();
        let mut parts = 0;
        loop {
            let mut b = Bhs::new(op::TEXT_REQ | iscsi::IMMEDIATE, flag::FINAL);
            b.itt(itt)
                .set32(20, ttt)
                .set32(24, self.cmdsn)
                .set32(28, self.expstatsn);
            let mut out = Vec::new();
            b.encode(&request, &self.d, &mut out);
            self.send(&out).unwrap();
            let r = self.recv().expect("a Text Response");
            assert_eq!((r.opcode(), r.word(16)), (op::TEXT_RSP, itt));
            assert!(
                r.data.len() <= max,
                "{} bytes in one Text Response",
                r.data.len()
            );
            text.extend_from_slice(&r.data);
            parts += 1;
            if r.bhs[1] & flag::FINAL != 0 {
                assert_eq!(r.word(20), RESERVED_TAG, "the last part's TTT");
                return (keys(&text), parts);
            }
            assert!(parts < 10_000, "an answer without end");
            ttt = r.word(20);
            assert_ne!(ttt, RESERVED_TAG, "a continued Text Response names its TTT");
            request.clear();
        }
    }

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
        self.command_more(cdb, edtl, write, immediate, false)
    }

    /// As [`Conn::command`]; `more`: unsolicited Data-Out follows (F=0).
    pub fn command_more(
        &mut self,
        cdb: &[u8],
        edtl: u32,
        write: bool,
        immediate: &[u8],
        more: bool,
    ) -> (u32, Vec<u8>) {
        let itt = self.itt;
        self.itt += 1;
        let mut f = if more { 1 } else { flag::FINAL | 1 };
        f |= if write { flag::WRITE } else { flag::READ };
        let mut b = Bhs::new(op::SCSI_CMD, f);
        b.itt(itt)
            .set32(20, edtl)
            .set32(24, self.cmdsn)
            .set32(28, self.expstatsn);
        b.0[8..16].copy_from_slice(&blkwire_wire::scsi::lun_to_wire(self.lun));
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

    /// The next PDU, which must come: its opcode, ITT and byte 3 (a SCSI Response's status).
    pub fn response(&mut self) -> (u8, u32, u8) {
        let r = self.recv().expect("a response");
        (r.opcode(), r.word(16), r.bhs[3])
    }

    /// WRITE(16) of `data` at `lba` (512-byte blocks): immediate data (where negotiated) and
    /// unsolicited Data-Out (InitialR2T=No) up to FirstBurstLength, then Data-Out as the R2Ts
    /// ask. Returns the SCSI status.
    pub fn write(&mut self, lba: u64, data: &[u8]) -> u8 {
        self.write_many(&[(lba, data)])[0]
    }

    /// The WRITE(16)s of `writes`, all sent (with their immediate and unsolicited data) before
    /// any answer is read, then their R2Ts answered as they come: the SCSI statuses, in order.
    pub fn write_many(&mut self, writes: &[(u64, &[u8])]) -> Vec<u8> {
        let mut itts = Vec::new();
        for &(lba, data) in writes {
            let blocks = (data.len() / 512) as u32;
            let mut cdb = [0u8; 16];
            cdb[0] = 0x8a;
            cdb[2..10].copy_from_slice(&lba.to_be_bytes());
            cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
            let first = data.len().min(self.first_burst as usize);
            let imm = if self.immediate_data {
                first.min(self.send_max as usize).min(self.max_immediate)
            } else {
                0
            };
            // What goes unsolicited after the command (§13.10): the rest of the first burst.
            let unsolicited = if self.initial_r2t { imm } else { first };
            let more = unsolicited > imm;
            let (itt, pdu) = self.command_more(&cdb, data.len() as u32, true, &data[..imm], more);
            self.send(&pdu).unwrap();
            self.data_out(itt, RESERVED_TAG, imm, unsolicited, data);
            itts.push(itt);
        }
        let mut status = vec![None; writes.len()];
        while status.iter().any(Option::is_none) {
            let r = self.recv().expect("a response to WRITE");
            let i = itts
                .iter()
                .position(|&t| t == r.word(16))
                .unwrap_or_else(|| panic!("an answer for ITT {:#x}", r.word(16)));
            match r.opcode() {
                op::R2T => {
                    let (ttt, offset, len) = (r.word(20), r.word(40), r.word(44));
                    let (at, end) = (offset as usize, (offset + len) as usize);
                    self.data_out(itts[i], ttt, at, end, writes[i].1);
                }
                op::SCSI_RSP => status[i] = Some(r.bhs[3]),
                other => panic!("unexpected opcode {other:#x} during WRITE"),
            }
        }
        status.into_iter().map(Option::unwrap).collect()
    }

    /// One Data-Out sequence: `data[at..end]` in PDUs of at most the target's
    /// MaxRecvDataSegmentLength, DataSN from 0, F on the last.
    pub fn data_out(&mut self, itt: u32, ttt: u32, mut at: usize, end: usize, data: &[u8]) {
        let mut datasn = 0;
        while at < end {
            let n = (end - at).min(self.send_max as usize);
            let mut b = Bhs::new(op::DATA_OUT, if at + n == end { flag::FINAL } else { 0 });
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

    /// A command without data out (TEST UNIT READY, INQUIRY, READ CAPACITY, REPORT LUNS):
    /// its status, the data it returned, and its sense data (CHECK CONDITION).
    pub fn scsi(&mut self, cdb: &[u8], edtl: u32) -> (u8, Vec<u8>, Vec<u8>) {
        let (_, pdu) = self.command(cdb, edtl, false, &[]);
        self.send(&pdu).unwrap();
        let mut data = Vec::new();
        loop {
            let r = self.recv().expect("a response");
            match r.opcode() {
                op::DATA_IN => {
                    data.extend_from_slice(&r.data);
                    if r.bhs[1] & flag::STATUS != 0 {
                        return (r.bhs[3], data, Vec::new());
                    }
                }
                // The data segment of a SCSI Response is SenseLength, then the sense data.
                op::SCSI_RSP => return (r.bhs[3], data, r.data.get(2..).unwrap_or(&[]).to_vec()),
                other => panic!("unexpected opcode {other:#x}"),
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

/// PERSISTENT RESERVE OUT with its 24-byte parameter list as immediate data: the status.
pub fn prout(c: &mut Conn, sa: u8, kind: u8, res_key: u64, sa_key: u64) -> u8 {
    let cdb = [0x5f, sa, kind, 0, 0, 0, 0, 0, 24, 0];
    let p = blkwire_wire::scsi::pr::out_parameters(res_key, sa_key);
    let (_, pdu) = c.command(&cdb, 24, true, &p);
    c.send(&pdu).unwrap();
    let r = c.recv().expect("a response to PERSISTENT RESERVE OUT");
    assert_eq!(r.opcode(), op::SCSI_RSP, "PERSISTENT RESERVE OUT");
    r.bhs[3]
}

/// The address of the `iscsi://` listener among a target's listen URLs.
pub fn iscsi_listener(urls: &[String]) -> &str {
    urls.iter()
        .find_map(|u| u.strip_prefix("iscsi://"))
        .unwrap_or_else(|| panic!("no iscsi:// listener among {urls:?}"))
}
