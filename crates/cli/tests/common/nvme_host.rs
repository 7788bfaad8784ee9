//! A small NVMe/TCP host for tests: ICReq, Connect, admin and I/O commands, with in-capsule
//! data or R2T/H2CData, and raw PDUs for hostile input. Built on `blkwire_wire::nvme_tcp`; it
//! checks what the target sends as strictly as the codec decodes (digests, padding, lengths).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use blkwire_wire::nvme_tcp::{
    self, pdu_len, CapsuleCmd, Cqe, Direction, H2CData, IcReq, Params, Pdu, Progress, Sgl, Sqe,
};

pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0c1a7e57-0000-4000-8000-000000000001";
pub const HOSTID: [u8; 16] = [7; 16];

/// The subsystem NQN of an export.
pub fn nqn(export: &str) -> String {
    format!("nqn.2026-11.io.blkwire:{export}")
}

/// How a connection starts.
#[derive(Clone)]
pub struct Opts {
    pub hdgst: bool,
    pub ddgst: bool,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    /// Connect SQSIZE (0's based).
    pub sqsize: u16,
    pub kato_ms: u32,
    /// CATTR bit 2: no SQ flow control.
    pub sqfc_off: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            hdgst: false,
            ddgst: false,
            hostnqn: HOSTNQN.into(),
            hostid: HOSTID,
            sqsize: 31,
            kato_ms: 0,
            sqfc_off: false,
        }
    }
}

/// One queue's connection.
pub struct Queue {
    pub s: TcpStream,
    /// What we send.
    pub tx: Params,
    /// What we receive.
    pub rx: Params,
    pub qid: u16,
    pub cntlid: u16,
    /// MAXH2CDATA from ICResp.
    pub maxh2cdata: u32,
    /// The namespace I/O commands address (1 unless a test says otherwise).
    pub nsid: u32,
    next_cid: u16,
}

/// A command's answer: the completion and any data the target sent with it.
#[derive(Debug)]
pub struct Done {
    pub cqe: Cqe,
    pub data: Vec<u8>,
}

impl Done {
    /// The status field without the phase bit (Linux's NVME_SC_* form, DNR included).
    pub fn status(&self) -> u16 {
        self.cqe.status >> 1
    }
    /// SCT and SC only.
    pub fn code(&self) -> u16 {
        (self.cqe.status >> 1) & 0x7ff
    }
}

/// What the target sent instead of an answer.
#[derive(Debug)]
pub enum Failure {
    /// A C2HTermReq (FES), then the connection closed.
    Terminated(u16),
    /// The connection closed (or timed out).
    Closed(String),
    /// Something the codec refused.
    Bad(String),
}

pub fn sqe(opcode: u8, cid: u16) -> Sqe {
    Sqe {
        opcode,
        flags: 0x40, // PSDT: SGLs
        cid,
        nsid: 0,
        cdw2: 0,
        cdw3: 0,
        mptr: 0,
        dptr: [0; 16],
        cdw10: 0,
        cdw11: 0,
        cdw12: 0,
        cdw13: 0,
        cdw14: 0,
        cdw15: 0,
    }
}

/// A fabrics command of type `fct`.
pub fn fabrics(fct: u8) -> Sqe {
    let mut q = sqe(0x7f, 0);
    q.nsid = fct as u32;
    q
}

impl Queue {
    /// ICReq/ICResp, then Connect. Returns the queue and the Connect completion (check it: a
    /// refused Connect still returns `Ok`).
    pub fn connect(
        addr: &str,
        subnqn: &str,
        qid: u16,
        cntlid: u16,
        o: &Opts,
    ) -> Result<(Queue, Done), Failure> {
        let s = TcpStream::connect(addr).map_err(|e| Failure::Closed(e.to_string()))?;
        Self::connect_on(s, subnqn, qid, cntlid, o)
    }

    /// As [`Queue::connect`], from source address `from` (another loopback address plays
    /// another host).
    pub fn connect_from(
        from: std::net::Ipv4Addr,
        addr: &str,
        subnqn: &str,
        qid: u16,
        cntlid: u16,
        o: &Opts,
    ) -> Result<(Queue, Done), Failure> {
        let target: std::net::SocketAddrV4 = addr.parse().expect("an IPv4 address");
        let s =
            super::tcp_connect_from(from, target).map_err(|e| Failure::Closed(e.to_string()))?;
        Self::connect_on(s, subnqn, qid, cntlid, o)
    }

    fn connect_on(
        s: TcpStream,
        subnqn: &str,
        qid: u16,
        cntlid: u16,
        o: &Opts,
    ) -> Result<(Queue, Done), Failure> {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.set_nodelay(true).unwrap();
        let mut q = Queue {
            s,
            tx: Params::initial(Direction::HostToController, u32::MAX),
            rx: Params::initial(Direction::ControllerToHost, 16 << 20),
            qid,
            cntlid,
            maxh2cdata: 0,
            nsid: 1,
            next_cid: 1,
        };
        let ic = IcReq {
            pfv: 0,
            hpda: 0,
            hdgst: o.hdgst,
            ddgst: o.ddgst,
            maxr2t: 0,
        };
        q.send(&Pdu::IcReq(ic));
        let (buf, n) = q.read_pdu()?;
        match nvme_tcp::decode(&buf[..n], &q.rx) {
            Ok(Pdu::IcResp(r)) => {
                assert_eq!((r.hdgst, r.ddgst), (o.hdgst, o.ddgst), "digests as asked");
                q.maxh2cdata = r.maxh2cdata;
                for p in [&mut q.tx, &mut q.rx] {
                    p.hdgst = r.hdgst;
                    p.ddgst = r.ddgst;
                }
                q.tx.pda = r.cpda;
            }
            other => return Err(Failure::Bad(format!("expected ICResp, got {other:?}"))),
        }
        let mut c = fabrics(0x01);
        c.cdw10 = (qid as u32) << 16;
        c.cdw11 = o.sqsize as u32 | if o.sqfc_off { 1 << 18 } else { 0 };
        c.cdw12 = o.kato_ms;
        let mut data = vec![0u8; 1024];
        data[0..16].copy_from_slice(&o.hostid);
        data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        data[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
        data[512..512 + o.hostnqn.len()].copy_from_slice(o.hostnqn.as_bytes());
        let done = q.command_in(c, &data, 0)?;
        if done.code() == 0 {
            q.cntlid = done.cqe.dw0 as u16;
        }
        Ok((q, done))
    }

    pub fn send(&mut self, p: &Pdu<'_>) {
        let mut out = Vec::new();
        p.encode(&self.tx, &mut out);
        self.s.write_all(&out).expect("send");
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
    }

    fn read_pdu(&mut self) -> Result<(Vec<u8>, usize), Failure> {
        let mut buf = vec![0u8; nvme_tcp::CH_LEN];
        let mut have = 0;
        loop {
            let want = buf.len();
            self.s
                .read_exact(&mut buf[have..want])
                .map_err(|e| Failure::Closed(e.to_string()))?;
            have = want;
            match pdu_len(&buf, &self.rx) {
                Ok(Progress::Complete(n)) => return Ok((buf, n)),
                Ok(Progress::Need(n)) => buf.resize(n, 0),
                Err(e) => return Err(Failure::Bad(e.to_string())),
            }
        }
    }

    /// The next PDU the target sends, decoded (owned copies of what tests look at).
    pub fn recv(&mut self) -> Result<Received, Failure> {
        let (buf, n) = self.read_pdu()?;
        match nvme_tcp::decode(&buf[..n], &self.rx) {
            Ok(Pdu::CapsuleResp(c)) => Ok(Received::Resp(c)),
            Ok(Pdu::C2HData(d)) => Ok(Received::Data {
                cccid: d.cccid,
                datao: d.datao,
                last: d.last,
                success: d.success,
                data: d.data.to_vec(),
            }),
            Ok(Pdu::R2T(r)) => Ok(Received::R2T(r)),
            Ok(Pdu::C2HTermReq(t)) => Err(Failure::Terminated(t.fes)),
            Ok(other) => Err(Failure::Bad(format!("unexpected {:?}", other.typ()))),
            Err(e) => Err(Failure::Bad(e.to_string())),
        }
    }

    fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        self.next_cid
    }

    /// Sends a command whose data (if any) goes in the capsule, and waits for its answer;
    /// `expect_in` bytes of data may come back.
    pub fn command_in(&mut self, mut q: Sqe, data: &[u8], expect_in: u32) -> Result<Done, Failure> {
        if q.cid == 0 {
            q.cid = self.cid();
        }
        q.dptr = if data.is_empty() {
            Sgl::TransportDataBlock {
                subtype: 0xa,
                length: expect_in,
            }
            .to_bytes()
        } else {
            Sgl::DataBlock {
                subtype: 1,
                address: 0,
                length: data.len() as u32,
            }
            .to_bytes()
        };
        self.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: q, data }));
        self.wait(q.cid, None)
    }

    /// Sends a command whose `data` the target must ask for (R2T), and waits for its answer.
    pub fn command_r2t(&mut self, mut q: Sqe, data: &[u8]) -> Result<Done, Failure> {
        if q.cid == 0 {
            q.cid = self.cid();
        }
        q.dptr = Sgl::TransportDataBlock {
            subtype: 0xa,
            length: data.len() as u32,
        }
        .to_bytes();
        self.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: q, data: &[] }));
        self.wait(q.cid, Some(data))
    }

    /// Waits for `cid`'s completion, answering R2Ts from `out` and collecting C2HData.
    fn wait(&mut self, cid: u16, out: Option<&[u8]>) -> Result<Done, Failure> {
        let mut data = Vec::new();
        loop {
            match self.recv()? {
                Received::Resp(c) => {
                    assert_eq!(c.cid, cid, "completion for another command");
                    return Ok(Done { cqe: c, data });
                }
                Received::Data {
                    cccid,
                    datao,
                    last,
                    success,
                    data: d,
                } => {
                    assert_eq!(cccid, cid);
                    assert_eq!(datao as usize, data.len(), "C2HData in order");
                    data.extend_from_slice(&d);
                    if success {
                        assert!(last, "SUCCESS only on the last C2HData");
                        return Ok(Done {
                            cqe: Cqe {
                                dw0: 0,
                                dw1: 0,
                                sq_head: 0,
                                sq_id: self.qid,
                                cid,
                                status: 0,
                            },
                            data,
                        });
                    }
                }
                Received::R2T(r) => {
                    let out = out.expect("an R2T for a command without data");
                    assert_eq!(r.cccid, cid);
                    let end = (r.r2to + r.r2tl) as usize;
                    let mut at = r.r2to as usize;
                    while at < end {
                        let n = (end - at).min(self.maxh2cdata as usize);
                        let d = H2CData {
                            cccid: cid,
                            ttag: r.ttag,
                            datao: at as u32,
                            last: at + n == end,
                            data: &out[at..at + n],
                        };
                        self.send(&Pdu::H2CData(d));
                        at += n;
                    }
                }
            }
        }
    }

    /// Property Get (8 bytes for CAP).
    pub fn property_get(&mut self, offset: u32, eight: bool) -> Done {
        let mut c = fabrics(0x04);
        c.cdw10 = eight as u32;
        c.cdw11 = offset;
        self.command_in(c, &[], 0).expect("property get")
    }

    pub fn property_set(&mut self, offset: u32, value: u32) -> Done {
        let mut c = fabrics(0x00);
        c.cdw11 = offset;
        c.cdw12 = value;
        self.command_in(c, &[], 0).expect("property set")
    }

    pub fn identify(&mut self, cns: u8, nsid: u32) -> Done {
        let mut c = sqe(0x06, 0);
        c.cdw10 = cns as u32;
        c.nsid = nsid;
        self.command_in(c, &[], 4096).expect("identify")
    }

    pub fn get_log(&mut self, lid: u8, len: u32, offset: u64) -> Done {
        let mut c = sqe(0x02, 0);
        let numd = len / 4 - 1;
        c.cdw10 = lid as u32 | (numd & 0xffff) << 16;
        c.cdw11 = numd >> 16;
        c.cdw12 = offset as u32;
        c.cdw13 = (offset >> 32) as u32;
        self.command_in(c, &[], len).expect("get log page")
    }

    pub fn set_features(&mut self, fid: u8, cdw11: u32) -> Done {
        let mut c = sqe(0x09, 0);
        c.cdw10 = fid as u32;
        c.cdw11 = cdw11;
        self.command_in(c, &[], 0).expect("set features")
    }

    /// The usual bring-up of an admin queue: CC.EN, then wait for CSTS.RDY.
    pub fn enable(&mut self) {
        assert_eq!(self.property_set(0x14, 0x460001).code(), 0);
        let csts = self.property_get(0x1c, false);
        assert_eq!(csts.cqe.dw0 & 1, 1, "CSTS.RDY after CC.EN");
    }

    fn rw(&mut self, opcode: u8, slba: u64, blocks: u32, fua: bool) -> Sqe {
        let mut c = sqe(opcode, 0);
        c.nsid = self.nsid;
        c.cdw10 = slba as u32;
        c.cdw11 = (slba >> 32) as u32;
        c.cdw12 = (blocks - 1) | if fua { 1 << 30 } else { 0 };
        c
    }

    pub fn read(&mut self, slba: u64, blocks: u32, bs: u32) -> Result<Done, Failure> {
        let c = self.rw(0x02, slba, blocks, false);
        self.command_in(c, &[], blocks * bs)
    }

    /// A write with its data in the capsule.
    pub fn write_in(&mut self, slba: u64, data: &[u8], bs: u32) -> Result<Done, Failure> {
        let c = self.rw(0x01, slba, data.len() as u32 / bs, false);
        self.command_in(c, data, 0)
    }

    /// A write whose data the target asks for.
    pub fn write_r2t(
        &mut self,
        slba: u64,
        data: &[u8],
        bs: u32,
        fua: bool,
    ) -> Result<Done, Failure> {
        let c = self.rw(0x01, slba, data.len() as u32 / bs, fua);
        self.command_r2t(c, data)
    }

    pub fn flush(&mut self) -> Done {
        let mut c = sqe(0x00, 0);
        c.nsid = self.nsid;
        self.command_in(c, &[], 0).expect("flush")
    }

    pub fn write_zeroes(&mut self, slba: u64, blocks: u32, deac: bool) -> Done {
        let mut c = self.rw(0x08, slba, blocks, false);
        if deac {
            c.cdw12 |= 1 << 25;
        }
        self.command_in(c, &[], 0).expect("write zeroes")
    }

    /// Dataset Management, deallocate, of these (slba, blocks) ranges, in a 4 KiB buffer as
    /// Linux sends it.
    pub fn deallocate(&mut self, ranges: &[(u64, u32)]) -> Done {
        let mut c = sqe(0x09, 0);
        c.nsid = self.nsid;
        c.cdw10 = ranges.len() as u32 - 1;
        c.cdw11 = 1 << 2;
        let mut d = Vec::new();
        for &(slba, n) in ranges {
            d.extend_from_slice(&0u32.to_le_bytes());
            d.extend_from_slice(&n.to_le_bytes());
            d.extend_from_slice(&slba.to_le_bytes());
        }
        d.resize(4096, 0);
        self.command_in(c, &d, 0).expect("dsm")
    }

    /// Copy (source range format 0) of (slba, blocks) ranges to `sdlba`.
    pub fn copy(&mut self, sdlba: u64, ranges: &[(u64, u16)]) -> Done {
        let mut c = sqe(0x19, 0);
        c.nsid = self.nsid;
        c.cdw10 = sdlba as u32;
        c.cdw11 = (sdlba >> 32) as u32;
        c.cdw12 = ranges.len() as u32 - 1;
        let mut d = Vec::new();
        for &(slba, n) in ranges {
            let mut e = [0u8; 32];
            e[8..16].copy_from_slice(&slba.to_le_bytes());
            e[16..18].copy_from_slice(&(n - 1).to_le_bytes());
            d.extend_from_slice(&e);
        }
        self.command_in(c, &d, 0).expect("copy")
    }

    /// True once the target closed the connection (reads EOF or an error within `wait`).
    pub fn closed_within(&mut self, wait: Duration) -> bool {
        self.s.set_read_timeout(Some(wait)).unwrap();
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
                Err(_) => return true,
            }
        }
    }
}

/// A PDU from the target.
#[derive(Debug)]
pub enum Received {
    Resp(Cqe),
    Data {
        cccid: u16,
        datao: u32,
        last: bool,
        success: bool,
        data: Vec<u8>,
    },
    R2T(nvme_tcp::R2T),
}

/// An admin queue of a new controller of `subnqn`, enabled.
pub fn controller(addr: &str, subnqn: &str, o: &Opts) -> Queue {
    let (mut q, done) = Queue::connect(addr, subnqn, 0, 0xffff, o).expect("admin connect");
    assert_eq!(
        done.code(),
        0,
        "admin Connect refused: {:#x}",
        done.status()
    );
    q.enable();
    q
}

/// I/O queue `qid` of the controller `admin` belongs to.
pub fn io_queue(addr: &str, subnqn: &str, admin: &Queue, qid: u16, o: &Opts) -> Queue {
    let (q, done) = Queue::connect(addr, subnqn, qid, admin.cntlid, o).expect("I/O connect");
    assert_eq!(done.code(), 0, "I/O Connect refused: {:#x}", done.status());
    q
}

/// AUTH_Send (fctype 0x05) of `msg`, in the capsule.
pub fn auth_send(q: &mut Queue, msg: &[u8]) -> Done {
    let mut c = fabrics(0x05);
    c.cdw10 = 0xe9 << 24 | 0x01 << 16 | 0x01 << 8;
    c.cdw11 = msg.len() as u32;
    q.command_in(c, msg, 0).expect("AUTH_Send")
}

/// AUTH_Receive (fctype 0x06) with allocation length 4096, as the kernel asks.
pub fn auth_receive(q: &mut Queue) -> Done {
    auth_receive_sized(q, 4096, 4096)
}

/// AUTH_Receive with allocation length `al` into a buffer of `room` bytes (its SGL).
pub fn auth_receive_sized(q: &mut Queue, al: u32, room: u32) -> Done {
    let mut c = fabrics(0x06);
    c.cdw10 = 0xe9 << 24 | 0x01 << 16 | 0x01 << 8;
    c.cdw11 = al;
    q.command_in(c, &[], room).expect("AUTH_Receive")
}

/// The kernel host's DH-HMAC-CHAP exchange on a queue whose Connect asked for it: true when
/// both sides are satisfied; false when the controller sent Failure1 (or the host refused the
/// controller's proof).
pub fn authenticate(q: &mut Queue, host: &mut blkwire_auth::dhchap::HostAuth) -> bool {
    assert_eq!(
        auth_send(q, &host.negotiate()).code(),
        0,
        "AUTH_Send negotiate"
    );
    let challenge = auth_receive(q);
    assert_eq!(challenge.code(), 0);
    let reply = match host.on_challenge(&challenge.data) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("the host refused the challenge: {e:?}");
            return false;
        }
    };
    assert_eq!(auth_send(q, &reply).code(), 0, "AUTH_Send reply");
    let s1 = auth_receive(q);
    if s1.code() != 0 {
        eprintln!("AUTH_Receive after the reply: status {:#x}", s1.status());
        return false;
    }
    match host.on_success1(&s1.data) {
        Ok(Some(success2)) => {
            assert_eq!(auth_send(q, &success2).code(), 0, "AUTH_Send success2");
            true
        }
        Ok(None) => true,
        Err(e) => {
            eprintln!("after the reply the controller said: {e:?}");
            false
        }
    }
}
