//! `nvme-tcp://HOST[:PORT]/NAME`: blkwire's client over NVMe/TCP (TCP transport 1.0a, NVMe over
//! Fabrics 1.1), so `bench`, `cp` and `info` work against any NVMe/TCP target (blkwire's own
//! frontend, Linux nvmet, SPDK) and a benchmark can set the NVMe/TCP frontend beside the native
//! protocol with the same client. NAME is a subsystem NQN, or a blkwire export name (then the
//! NQN is `nqn.2026-11.io.blkwire:NAME`).
//!
//! The session is a controller: an admin queue (Connect, CC.EN, Identify controller and
//! namespace 1, Set Features Number of Queues; no keep-alive timer, KATO 0) held open for as
//! long as any I/O queue lives, and one TCP connection per I/O queue. The I/O queues reuse the
//! stream queue's socket plumbing (`stream.rs`); only framing differs: a command's CID is its
//! slot and a generation, writes up to the in-capsule size go in the capsule and larger ones
//! are sent when the target's R2T asks, and a read's data is delivered from the receive buffer
//! once its CapsuleResp is there too.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_wire::nvme_tcp::{
    self, pdu_len, CapsuleCmd, Cqe, Direction, H2CData, IcReq, Params, Pdu, Progress, Sgl, Sqe,
    BLKWIRE_NQN_PREFIX as NQN_PREFIX,
};
use blkwire_wire::{CopyLimits, Features, Status};

use crate::deadline::Deadline;
use crate::queue::{Cmd, Queue};
use crate::tls::Link;
use crate::url::Url;
use crate::{ConnectOptions, Error, ExportInfo, Result, Session};

/// The host NQN blkwire presents (one per machine is what hosts do; this one is per host id).
fn host_nqn(opts: &ConnectOptions) -> String {
    format!("nqn.2014-08.org.nvmexpress:blkwire:{}", opts.host_id)
}

/// The subsystem a URL names.
pub fn subsystem(url: &Url) -> String {
    if url.export.starts_with("nqn.") {
        url.export.clone()
    } else {
        format!("{NQN_PREFIX}{}", url.export)
    }
}

/// CIDs: the slot in the low bits, a generation above, so a late completion for a slot's
/// previous command is recognised.
const SLOT_BITS: u32 = 10;

/// The most blocks one WRITE ZEROES names: its NLB is 16 bits, 0's based.
const MAX_ZEROES_BLOCKS: u64 = 1 << 16;
/// Most I/O queue entries this client uses (slots fit `SLOT_BITS`).
pub(crate) const MAX_DEPTH: u16 = 1 << SLOT_BITS;

/// One I/O queue's NVMe/TCP framing state.
pub(crate) struct Framing {
    pub tx: Params,
    pub rx: Params,
    /// Largest write sent in the capsule.
    pub incapsule: u32,
    pub lba_shift: u32,
    pub maxh2cdata: u32,
    /// Data of writes waiting for an R2T, per slot (capacity kept between writes).
    pub pending: Vec<Vec<u8>>,
    /// Per slot: bytes of its write already sent for R2Ts, or None when its command takes no
    /// R2T (not a write, or one sent in the capsule). An R2T is answered at once and in full,
    /// and we ask for one outstanding at a time (ICReq MAXR2T 0), so the next one must start
    /// where the last ended: a target cannot have the same data sent twice.
    pub r2t_sent: Vec<Option<u32>>,
    /// Read data that came apart from its CapsuleResp, per slot.
    pub gathered: Vec<Vec<u8>>,
    /// The admin queue: the controller lives while any I/O queue holds it.
    pub _admin: Arc<TcpStream>,
}

/// CID of `slot` at `generation`.
pub(crate) fn cid(slot: u16, generation: u16) -> u16 {
    slot | (generation & ((1 << (16 - SLOT_BITS)) - 1)) << SLOT_BITS
}

/// (slot, generation) of a CID.
pub(crate) fn slot_of(cid: u16) -> (u16, u16) {
    (
        cid & ((1 << SLOT_BITS) - 1),
        cid >> SLOT_BITS & ((1 << (16 - SLOT_BITS)) - 1),
    )
}

/// The blkwire status an NVMe status field (SCT, SC) becomes.
pub(crate) fn status(cqe: &Cqe) -> Status {
    match (cqe.status >> 1) & 0x7ff {
        0 => Status::Ok,
        0x080 => Status::OutOfRange,
        0x081 => Status::NoSpace,
        // Attempted Write to Read Only Range; Namespace is Write Protected.
        0x182 | 0x020 => Status::ReadOnly,
        0x001 => Status::Unsupported,
        0x002 | 0x00b | 0x00f | 0x011 => Status::Invalid,
        0x021 => Status::NoMemory,
        _ => Status::Io,
    }
}

fn sqe(opcode: u8, cid: u16) -> Sqe {
    Sqe {
        opcode,
        flags: 0x40,
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

fn transport_sgl(len: u32) -> [u8; 16] {
    Sgl::TransportDataBlock {
        subtype: nvme_tcp::sgl::SUBTYPE_TRANSPORT,
        length: len,
    }
    .to_bytes()
}

fn incapsule_sgl(len: u32) -> [u8; 16] {
    Sgl::DataBlock {
        subtype: nvme_tcp::sgl::SUBTYPE_OFFSET,
        address: 0,
        length: len,
    }
    .to_bytes()
}

impl Framing {
    /// Appends the capsule for `cmd` in `slot` (CID `cid`) to `tx`; returns the bytes a read
    /// brings back.
    pub fn encode(&mut self, cmd: Cmd<'_>, slot: u16, cid: u16, tx: &mut Vec<u8>) -> Result<()> {
        let shift = self.lba_shift;
        let bs = 1u64 << shift;
        let blocks = |offset: u64, len: u64| -> Result<(u64, u64)> {
            if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) || len == 0 {
                return Err(Error::Usage(format!(
                    "NVMe/TCP addresses whole {bs}-byte blocks: offset {offset} length {len}"
                )));
            }
            Ok((offset >> shift, len >> shift))
        };
        let mut q = sqe(0, cid);
        q.nsid = 1;
        let mut data: &[u8] = &[];
        self.r2t_sent[slot as usize] = None;
        match cmd {
            Cmd::Read { offset, len } => {
                let (slba, n) = blocks(offset, len as u64)?;
                q.opcode = 0x02;
                q.cdw10 = slba as u32;
                q.cdw11 = (slba >> 32) as u32;
                q.cdw12 = (n - 1) as u32;
                q.dptr = transport_sgl(len);
            }
            Cmd::Write {
                offset,
                data: d,
                fua,
            } => {
                let (slba, n) = blocks(offset, d.len() as u64)?;
                q.opcode = 0x01;
                q.cdw10 = slba as u32;
                q.cdw11 = (slba >> 32) as u32;
                q.cdw12 = (n - 1) as u32 | if fua { 1 << 30 } else { 0 };
                if d.len() as u32 <= self.incapsule {
                    q.dptr = incapsule_sgl(d.len() as u32);
                    data = d;
                } else {
                    // Kept until the target's R2T asks for it.
                    q.dptr = transport_sgl(d.len() as u32);
                    let p = &mut self.pending[slot as usize];
                    p.clear();
                    p.extend_from_slice(d);
                    self.r2t_sent[slot as usize] = Some(0);
                }
            }
            Cmd::Flush => q.opcode = 0x00,
            Cmd::Trim { offset, len } => {
                let (slba, n) = blocks(offset, len as u64)?;
                q.opcode = 0x09;
                q.cdw11 = 1 << 2;
                let p = &mut self.pending[slot as usize];
                p.clear();
                p.extend_from_slice(&0u32.to_le_bytes());
                p.extend_from_slice(&(n as u32).to_le_bytes());
                p.extend_from_slice(&slba.to_le_bytes());
                q.dptr = incapsule_sgl(16);
                let range = std::mem::take(p);
                Pdu::CapsuleCmd(CapsuleCmd {
                    sqe: q,
                    data: &range,
                })
                .encode(&self.tx, tx);
                self.pending[slot as usize] = range;
                return Ok(());
            }
            Cmd::WriteZeroes {
                offset,
                len,
                no_hole,
            } => {
                let (slba, n) = blocks(offset, len as u64)?;
                if n > MAX_ZEROES_BLOCKS {
                    // Its high bits would spill out of NLB: fewer blocks zeroed, and success.
                    return Err(Error::Usage(format!(
                        "WRITE ZEROES of {n} blocks: one NVMe command zeroes {MAX_ZEROES_BLOCKS} \
                         at most (split at ExportInfo::max_range)"
                    )));
                }
                q.opcode = 0x08;
                q.cdw10 = slba as u32;
                q.cdw11 = (slba >> 32) as u32;
                q.cdw12 = (n - 1) as u32 | if no_hole { 0 } else { 1 << 25 };
            }
            Cmd::Copy { .. } | Cmd::Keepalive => {
                return Err(Error::Usage(
                    "COPY and KEEPALIVE are blkwire commands; nvme-tcp:// has neither".into(),
                ))
            }
        }
        Pdu::CapsuleCmd(CapsuleCmd { sqe: q, data }).encode(&self.tx, tx);
        Ok(())
    }

    /// Appends the H2CData PDUs an R2T asks for (data of the write in `slot`). Only a write
    /// sent with a transport SGL takes R2Ts, each starting where the previous one ended: so
    /// whatever a target sends, no more than the write's own bytes are queued for it.
    pub fn answer_r2t(&mut self, slot: u16, r: &nvme_tcp::R2T, tx: &mut Vec<u8>) -> Result<()> {
        let Some(sent) = self.r2t_sent[slot as usize] else {
            return Err(Error::Protocol(format!(
                "R2T for CID {:#x}, which is not a write waiting for one",
                r.cccid
            )));
        };
        let data = &self.pending[slot as usize];
        let end = r.r2to as u64 + r.r2tl as u64;
        if r.r2to != sent || end > data.len() as u64 || r.r2tl == 0 {
            return Err(Error::Protocol(format!(
                "R2T for bytes {}..{end} of a {}-byte write whose first {sent} bytes were sent",
                r.r2to,
                data.len()
            )));
        }
        let mut at = r.r2to as usize;
        let step = self.maxh2cdata as usize;
        while at < end as usize {
            let n = (end as usize - at).min(step);
            Pdu::H2CData(H2CData {
                cccid: r.cccid,
                ttag: r.ttag,
                datao: at as u32,
                last: at + n == end as usize,
                data: &data[at..at + n],
            })
            .encode(&self.tx, tx);
            at += n;
        }
        self.r2t_sent[slot as usize] = Some(end as u32);
        Ok(())
    }
}

/// A blocking connection during setup.
struct Setup {
    s: TcpStream,
    tx: Params,
    rx: Params,
    maxh2cdata: u32,
    cid: u16,
    /// When this connection's setup must be over: a controller that trickles its answers
    /// cannot hold a connect for longer than the timeout per connection.
    deadline: Deadline,
}

impl Setup {
    fn open(url: &Url, opts: &ConnectOptions, max_io: u32) -> Result<Setup> {
        let s = crate::dial(url, opts.timeout)?;
        // From when the connection is made: the dial has its own timeout.
        let deadline = Deadline::after(opts.timeout);
        let _ = s.set_nodelay(true);
        let mut c = Setup {
            deadline,
            s,
            tx: Params::initial(Direction::HostToController, u32::MAX),
            rx: Params::initial(
                Direction::ControllerToHost,
                max_io + 4096 + nvme_tcp::IC_LEN as u32,
            ),
            maxh2cdata: 0,
            cid: 0,
        };
        c.send(&Pdu::IcReq(IcReq {
            pfv: 0,
            hpda: 0,
            hdgst: false,
            ddgst: false,
            maxr2t: 0,
        }))?;
        let buf = c.recv()?;
        match nvme_tcp::decode(&buf, &c.rx) {
            // Below 4 KiB, as Linux's host also refuses (NVMe/TCP 3.6.2.3): the host's
            // H2CData PDUs would be larger than the controller takes.
            Ok(Pdu::IcResp(r)) if r.maxh2cdata < 4096 => Err(Error::Protocol(format!(
                "{}: the controller's MAXH2CDATA is {} bytes; NVMe/TCP requires at least 4096",
                url.authority(),
                r.maxh2cdata
            ))),
            Ok(Pdu::IcResp(r)) if !r.hdgst && !r.ddgst => {
                c.maxh2cdata = r.maxh2cdata;
                c.tx.pda = r.cpda;
                Ok(c)
            }
            Ok(other) => Err(Error::Protocol(format!(
                "{}: expected ICResp without digests, got {:?}",
                url.authority(),
                other.typ()
            ))),
            Err(e) => Err(Error::Protocol(format!("{}: {e}", url.authority()))),
        }
    }

    fn send(&mut self, p: &Pdu<'_>) -> Result<()> {
        let mut out = Vec::new();
        p.encode(&self.tx, &mut out);
        self.s.write_all(&out)?;
        Ok(())
    }

    fn recv(&mut self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; nvme_tcp::CH_LEN];
        let mut have = 0;
        loop {
            let want = buf.len();
            self.deadline
                .read_exact(&mut self.s, &mut buf[have..want])?;
            have = want;
            match pdu_len(&buf, &self.rx) {
                Ok(Progress::Complete(n)) => {
                    buf.truncate(n);
                    return Ok(buf);
                }
                Ok(Progress::Need(n)) => buf.resize(n, 0),
                Err(e) => return Err(Error::Protocol(e.to_string())),
            }
        }
    }

    /// Runs one command with optional in-capsule data; returns its completion and any data.
    fn command(&mut self, mut q: Sqe, data: &[u8], data_in: u32) -> Result<(Cqe, Vec<u8>)> {
        self.cid = self.cid.wrapping_add(1);
        q.cid = self.cid;
        q.dptr = if data.is_empty() {
            transport_sgl(data_in)
        } else {
            incapsule_sgl(data.len() as u32)
        };
        self.send(&Pdu::CapsuleCmd(CapsuleCmd { sqe: q, data }))?;
        let mut got = Vec::new();
        loop {
            let buf = self.recv()?;
            match nvme_tcp::decode(&buf, &self.rx) {
                Ok(Pdu::CapsuleResp(c)) if c.cid == q.cid => return Ok((c, got)),
                Ok(Pdu::C2HData(d)) if d.cccid == q.cid => {
                    // No more than was asked for: the target's PDUs must not grow it forever.
                    if got.len() + d.data.len() > data_in as usize {
                        return Err(Error::Protocol(format!(
                            "more than the {data_in} bytes asked for came back to a setup command"
                        )));
                    }
                    got.extend_from_slice(d.data);
                    if d.success {
                        return Ok((
                            Cqe {
                                dw0: 0,
                                dw1: 0,
                                sq_head: 0,
                                sq_id: 0,
                                cid: q.cid,
                                status: 0,
                            },
                            got,
                        ));
                    }
                }
                Ok(Pdu::C2HTermReq(t)) => {
                    return Err(Error::Protocol(format!(
                        "the target ended the connection (C2HTermReq FES {:#x})",
                        t.fes
                    )))
                }
                Ok(other) => {
                    return Err(Error::Protocol(format!(
                        "unexpected {:?} during setup",
                        other.typ()
                    )))
                }
                Err(e) => return Err(Error::Protocol(e.to_string())),
            }
        }
    }

    /// Fabrics Connect of queue `qid` (`cntlid` 0xFFFF for a new controller); returns the
    /// controller id.
    fn connect(
        &mut self,
        subnqn: &str,
        hostnqn: &str,
        qid: u16,
        cntlid: u16,
        sqsize: u16,
    ) -> Result<u16> {
        let mut q = sqe(0x7f, 0);
        q.nsid = 0x01;
        q.cdw10 = (qid as u32) << 16;
        q.cdw11 = sqsize as u32;
        let mut d = vec![0u8; 1024];
        let hostid = host_id_bytes(hostnqn);
        d[0..16].copy_from_slice(&hostid);
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        let (sn, hn) = (subnqn.as_bytes(), hostnqn.as_bytes());
        if sn.len() > 223 || hn.len() > 223 {
            return Err(Error::Usage("NQNs have at most 223 bytes".into()));
        }
        d[256..256 + sn.len()].copy_from_slice(sn);
        d[512..512 + hn.len()].copy_from_slice(hn);
        let (c, _) = self.command(q, &d, 0)?;
        if status(&c) != Status::Ok {
            return Err(Error::Protocol(format!(
                "NVMe Connect of queue {qid} to {subnqn} refused: status {:#x}{}",
                (c.status >> 1) & 0x7ff,
                if (c.status >> 1) & 0x7ff == 0x182 && c.dw0 & 0xffff == 256 {
                    " (no such subsystem)"
                } else {
                    ""
                }
            )));
        }
        if c.dw0 & (3 << 17) != 0 {
            return Err(Error::Usage(format!(
                "{subnqn} requires DH-HMAC-CHAP, which blkwire's NVMe/TCP client does not speak"
            )));
        }
        Ok(c.dw0 as u16)
    }

    /// Reads CSTS until the controller enabled is ready (NVMe base 3.5.1: it may take CAP.TO),
    /// or says it failed (CSTS.CFS).
    fn wait_ready(&mut self, subnqn: &str, within: Duration) -> Result<()> {
        let until = Instant::now() + within;
        let mut pause = Duration::from_millis(1);
        loop {
            let mut get = sqe(0x7f, 0);
            get.nsid = 0x04;
            get.cdw11 = 0x1c;
            let (c, _) = self.command(get, &[], 0)?;
            self.check("Property Get CSTS", &c)?;
            if c.dw0 & 2 != 0 {
                return Err(Error::Protocol(format!(
                    "{subnqn}: the controller reports a fatal status (CSTS.CFS) once enabled"
                )));
            }
            if c.dw0 & 1 != 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= until {
                return Err(Error::Protocol(format!(
                    "{subnqn}: the controller did not become ready within its CAP.TO of {} ms",
                    within.as_millis()
                )));
            }
            // A register poll, as the spec has hosts do: short at first, as controllers are
            // usually ready at once.
            std::thread::sleep(pause.min(until - now));
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    fn check(&self, what: &str, c: &Cqe) -> Result<()> {
        match status(c) {
            Status::Ok => Ok(()),
            _ => Err(Error::Protocol(format!(
                "{what} failed: NVMe status {:#x}",
                (c.status >> 1) & 0x7ff
            ))),
        }
    }
}

/// A host id derived from the host NQN (stable, so a target sees one host).
fn host_id_bytes(hostnqn: &str) -> [u8; 16] {
    let mut h = [0u8; 16];
    for (i, b) in hostnqn.bytes().enumerate() {
        h[i % 16] = h[i % 16].wrapping_mul(31).wrapping_add(b);
    }
    h
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Opens a controller of `url`'s subsystem and its I/O queues.
pub(crate) fn connect(url: &Url, opts: &ConnectOptions) -> Result<Session> {
    if opts.tls || opts.key.is_some() {
        return Err(Error::Usage(
            "nvme-tcp:// takes neither --tls nor --key (no NVMe/TCP TLS or DH-HMAC-CHAP in \
             blkwire's client)"
                .into(),
        ));
    }
    let subnqn = subsystem(url);
    let hostnqn = host_nqn(opts);
    let max_io = opts.max_io.clamp(4096, 1 << 20);
    let mut a = Setup::open(url, opts, max_io)?;
    let cntlid = a.connect(&subnqn, &hostnqn, 0, 0xffff, 31)?;
    let mut cap = sqe(0x7f, 0);
    cap.nsid = 0x04;
    cap.cdw10 = 1;
    let (c, _) = a.command(cap, &[], 0)?;
    a.check("Property Get CAP", &c)?;
    // CAP.MQES: entries per queue, 0's based; a queue holds one entry less than its size, so
    // MQES is also the most commands in flight. 0 (reserved) would leave room for none.
    let mqes = c.dw0 & 0xffff;
    if mqes == 0 {
        return Err(Error::Protocol(format!(
            "{subnqn}: the controller's CAP.MQES is 0, a queue with no room for a command"
        )));
    }
    // CAP.TO: how long, in 500 ms units, the controller may take to become ready.
    let ready_within = Duration::from_millis(500 * u64::from((c.dw0 >> 24).max(1)));
    // CC: I/O queue entry sizes 64/16 bytes, enable; then CSTS.RDY.
    let mut set = sqe(0x7f, 0);
    set.nsid = 0x00;
    set.cdw11 = 0x14;
    set.cdw12 = 0x46_0001;
    let (c, _) = a.command(set, &[], 0)?;
    a.check("Property Set CC", &c)?;
    a.wait_ready(&subnqn, ready_within)?;
    let mut id = sqe(0x06, 0);
    id.cdw10 = 1;
    let (c, ctrl) = a.command(id, &[], 4096)?;
    a.check("Identify controller", &c)?;
    if ctrl.len() < 4096 {
        return Err(Error::Protocol("short Identify controller data".into()));
    }
    let mdts = ctrl[77];
    let ioccsz = le32(&ctrl, 1792);
    let oncs = le16(&ctrl, 520);
    let vwc = ctrl[525] & 1 != 0;
    let maxcmd = le16(&ctrl, 514).max(1);
    let mut id = sqe(0x06, 0);
    id.nsid = 1;
    let (c, ns) = a.command(id, &[], 4096)?;
    a.check("Identify namespace 1", &c)?;
    if ns.len() < 4096 || le32(&ns, 0) == 0 && le32(&ns, 4) == 0 {
        return Err(Error::Protocol(format!("{subnqn} has no namespace 1")));
    }
    let flbas = (ns[26] & 0xf) as usize;
    let lba_shift = ns[128 + 4 * flbas + 2] as u32;
    if !(9..=16).contains(&lba_shift) {
        return Err(Error::Protocol(format!(
            "LBA size 2^{lba_shift} not supported"
        )));
    }
    let nsze = u64::from_le_bytes(ns[0..8].try_into().expect("8 bytes"));
    let size = nsze.checked_mul(1 << lba_shift).ok_or_else(|| {
        Error::Protocol(format!(
            "{subnqn}: namespace 1 of {nsze} blocks is beyond 2^64 bytes"
        ))
    })?;
    let read_only = ns[99] & 1 != 0;
    let mdts_bytes = if mdts == 0 {
        1 << 20
    } else {
        4096u64 << mdts.min(20)
    };
    let max_io = (max_io as u64).min(mdts_bytes) as u32;
    let queues = opts.queues.max(1);
    let mut nq = sqe(0x09, 0);
    nq.cdw10 = 0x07;
    nq.cdw11 = (queues as u32 - 1) | (queues as u32 - 1) << 16;
    let (c, _) = a.command(nq, &[], 0)?;
    a.check("Set Features (number of queues)", &c)?;
    // NSQA and NCQA, 0's based: at least one queue of each, at most what was asked.
    let granted = ((c.dw0 & 0xffff).min(c.dw0 >> 16) + 1).min(queues as u32) as u16;
    let depth = (opts.depth.clamp(1, MAX_DEPTH - 1) as u32)
        .min(mqes)
        .min(maxcmd as u32) as u16;
    let mut features = Features::FUA;
    if read_only {
        features |= Features::READ_ONLY;
    }
    if vwc {
        features |= Features::FLUSH;
    }
    if oncs & 1 << 2 != 0 {
        features |= Features::TRIM;
    }
    if oncs & 1 << 3 != 0 {
        features |= Features::WRITE_ZEROES;
    }
    let info = ExportInfo {
        name: url.export.clone(),
        size,
        logical_block: 1 << lba_shift,
        physical_block: 1 << lba_shift,
        features: Features(features),
        queues: granted,
        depth,
        max_io,
        session: cntlid as u32,
        copy: CopyLimits::default(),
        header_crc: false,
        // A WRITE ZEROES' NLB is 16 bits (NVM Command Set 3.2.8): 65536 blocks at most.
        max_range: (MAX_ZEROES_BLOCKS << lba_shift).min(u64::from(crate::MAX_RANGE)) as u32,
    };
    let admin = Arc::new(a.s);
    let mut out = Vec::with_capacity(granted as usize);
    for qid in 1..=crate::joined(opts, granted) {
        let mut s = Setup::open(url, opts, max_io)?;
        // SQSIZE is 0's based and a queue holds one entry less than its size: `depth`
        // commands in flight need `depth + 1` entries.
        s.connect(&subnqn, &hostnqn, qid, cntlid, depth)?;
        let framing = Framing {
            tx: s.tx,
            rx: Params {
                max_plen: max_io + 4096,
                ..s.rx
            },
            incapsule: ioccsz.saturating_mul(16).saturating_sub(64),
            lba_shift,
            maxh2cdata: s.maxh2cdata,
            pending: vec![Vec::new(); depth as usize],
            r2t_sent: vec![None; depth as usize],
            gathered: vec![Vec::new(); depth as usize],
            _admin: admin.clone(),
        };
        let q =
            crate::stream::StreamQueue::new_nvme(Link::Plain(s.s), qid - 1, &info, opts, framing)?;
        out.push(Queue::stream(q, CopyLimits::default(), info.max_range));
    }
    Ok(Session { info, queues: out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::nvme::{self as fake, resp, Controller};
    use std::io::Read;
    use std::sync::mpsc;
    use std::time::Duration;

    /// Options for a session with a stand-in controller: one queue, 4 deep, 64 KiB I/Os.
    fn options() -> ConnectOptions {
        ConnectOptions {
            queues: 1,
            depth: 4,
            max_io: 64 << 10,
            timeout: Duration::from_secs(10),
            ..Default::default()
        }
    }

    /// The length a command's transport SGL names (a write sent for R2Ts).
    fn sgl_len(q: &Sqe) -> u32 {
        q.sgl().length().expect("a data block")
    }

    /// A WRITE ZEROES names at most 65536 blocks (NLB is 16 bits): a longer range goes as
    /// several commands covering it end to end, never one whose count spills out of NLB (the
    /// target would zero less and answer success).
    #[test]
    fn write_zeroes_is_split_at_what_one_command_names() {
        let (tx, rx) = mpsc::channel();
        let c = Controller {
            blocks: 1 << 20,
            oncs: 1 << 3,
            ..Controller::default()
        };
        let target = fake::start(c, move |mut io| {
            while let Some(b) = io.recv() {
                let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                    panic!("not a command")
                };
                let q = c.sqe;
                let slba = q.cdw10 as u64 | (q.cdw11 as u64) << 32;
                let _ = tx.send((q.opcode, slba, (q.cdw12 & 0xffff) + 1, q.cdw12 >> 16));
                let _ = io.send(&[resp(q.cid, 0, 0)]);
            }
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        assert_eq!(s.info.max_range, 256 << 20, "65536 blocks of 4 KiB");
        s.queues[0].write_zeroes(4096, 1 << 30, false).unwrap();
        let mut next = 1;
        for _ in 0..4 {
            let (opcode, slba, nlb, high) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!((opcode, slba, high & !(1 << 9)), (0x08, next, 0));
            assert!(nlb <= 65536, "{nlb} blocks");
            next += nlb as u64;
        }
        assert_eq!(next, 1 + (1 << 18), "the whole GiB, in four commands");
        assert!(rx.try_recv().is_err(), "no more");
    }

    /// A batch whose later part is refused as it is sent (not whole blocks) fails only once
    /// the parts it sent have completed: none is left in flight for the next batch to take
    /// as its own, and the queue serves the next read whole.
    #[test]
    fn a_batch_refused_midway_leaves_nothing_in_flight() {
        let target = fake::start(Controller::default(), move |mut io| {
            while let Some(b) = io.recv() {
                let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                    panic!("not a command")
                };
                let q = c.sqe;
                let len = ((q.cdw12 & 0xffff) as usize + 1) * 4096;
                let data = vec![(q.cdw10 & 0xff) as u8; len];
                let _ = io.send(&[Pdu::C2HData(nvme_tcp::C2HData {
                    cccid: q.cid,
                    datao: 0,
                    last: true,
                    success: true,
                    data: &data,
                })]);
            }
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        let q = &mut s.queues[0];
        let mut buf = vec![0u8; (64 << 10) + 512];
        let r = q.read_at(&mut buf, 0);
        assert!(
            matches!(&r, Err(Error::Usage(m)) if m.contains("whole")),
            "{r:?}"
        );
        assert_eq!(q.in_flight(), 0, "the first part was waited for");
        let mut buf = vec![0u8; 128 << 10];
        q.read_at(&mut buf, 64 << 10).unwrap();
        assert!(buf[..64 << 10].iter().all(|&b| b == 16), "block 16's data");
        assert!(buf[64 << 10..].iter().all(|&b| b == 32), "block 32's data");
    }

    #[test]
    fn a_flood_of_r2ts_for_one_write_is_refused_not_answered_each_time() {
        let (tx, rx) = mpsc::channel();
        let target = fake::start(Controller::default(), move |mut io| {
            let b = io.recv().expect("the write");
            let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                panic!("not a command")
            };
            let (cid, len) = (c.sqe.cid, sgl_len(&c.sqe));
            // The whole write asked for, a thousand times over, before any of it came.
            let r2t = Pdu::R2T(nvme_tcp::R2T {
                cccid: cid,
                ttag: 1,
                r2to: 0,
                r2tl: len,
            });
            let _ = io.send(&vec![r2t; 1000]);
            let mut got = 0;
            while let Some(b) = io.recv() {
                if let Pdu::H2CData(d) = io.decode(&b) {
                    got += d.data.len();
                }
                if got == len as usize {
                    let _ = io.send(&[resp(cid, 0, 0)]);
                }
            }
            let _ = tx.send(got);
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        let r = s.queues[0].write_at(&[7u8; 64 << 10], 0, false);
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("R2T")),
            "{r:?}"
        );
        drop(s);
        let sent = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(sent <= 64 << 10, "{sent} bytes sent for a 64 KiB write");
    }

    /// A write's answer that comes while data is still going out (here an error for the
    /// first of two 512 KiB writes, sent as its data starts to come, while the rest fills the
    /// socket) is delivered then, not left in the receive buffer until something else arrives.
    #[test]
    fn an_answer_that_comes_while_data_goes_is_delivered() {
        let (go, wait) = mpsc::channel::<()>();
        let wait = std::sync::Mutex::new(wait);
        let target = fake::start(Controller::default(), move |mut io| {
            let mut writes = Vec::new();
            for _ in 0..2 {
                let b = io.recv().expect("a write");
                let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                    panic!("not a command")
                };
                writes.push((c.sqe.cid, sgl_len(&c.sqe)));
            }
            let r2ts: Vec<_> = writes
                .iter()
                .map(|&(cid, len)| {
                    Pdu::R2T(nvme_tcp::R2T {
                        cccid: cid,
                        ttag: 1,
                        r2to: 0,
                        r2tl: len,
                    })
                })
                .collect();
            let _ = io.send(&r2ts);
            // The first is refused as soon as its data starts to come, then all of it is taken
            // (one H2CData each: MAXH2CDATA is 1 MiB).
            let mut ch = [0u8; nvme_tcp::CH_LEN];
            let _ = io.s.read_exact(&mut ch);
            let _ = io.send(&[resp(writes[0].0, 0, 0x02)]);
            let rest: u32 = writes.iter().map(|w| w.1 + 24).sum::<u32>() - ch.len() as u32;
            let _ = std::io::copy(&mut (&io.s).take(rest as u64), &mut std::io::sink());
            // The others are answered once the test has seen the first.
            let _ = wait.lock().unwrap().recv();
            let rest: Vec<_> = writes[1..].iter().map(|w| resp(w.0, 0, 0)).collect();
            let _ = io.send(&rest);
            while io.recv().is_some() {}
        });
        let opts = ConnectOptions {
            max_io: 1 << 20,
            ..options()
        };
        let mut s = crate::connect(&target.url, &opts).unwrap();
        let q = &mut s.queues[0];
        // A small socket buffer: the data cannot all be in it when the answer comes.
        blkwire_net::setopt(q.fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 16 << 10);
        let data = vec![7u8; 512 << 10];
        for i in 0..2 {
            let w = Cmd::Write {
                offset: i << 19,
                data: &data,
                fua: false,
            };
            q.submit(w, i).unwrap();
        }
        let mut first = Vec::new();
        let r = q.complete(1, |c| first.push((c.user, c.status)));
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(first, [(0, Status::Invalid)]);
        go.send(()).unwrap();
        let mut rest = 0;
        while rest < 1 {
            rest += q.complete(1, |c| assert_eq!(c.status, Status::Ok)).unwrap();
        }
    }

    /// No I/O queue of no entries: a controller that says its queues hold no command is
    /// refused, not taken for one where every read and write "succeeds" without being sent.
    #[test]
    fn a_controller_whose_queues_hold_no_command_is_refused() {
        let c = Controller {
            mqes: 0,
            ..Controller::default()
        };
        let target = fake::start(c, |_| {});
        let r = crate::connect(&target.url, &options());
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("MQES")),
            "{:?}",
            r.map(|s| (s.info.queues, s.info.depth))
        );
    }

    /// Set Features answered with the most queues NVMe can name (0xFFFF, 0's based): as
    /// many as were asked, not 65536 wrapped to none.
    #[test]
    fn a_controller_granting_65536_queues_gives_those_asked_for() {
        let c = Controller {
            queues: u32::MAX,
            ..Controller::default()
        };
        let target = fake::start(c, |mut io| while io.recv().is_some() {});
        let s = crate::connect(&target.url, &options()).unwrap();
        assert_eq!((s.info.queues, s.queues.len()), (1, 1));
        assert_eq!(s.info.depth, 4);
    }

    /// A controller that takes a while to become ready once enabled (CSTS.RDY read 0 three
    /// times) is waited for; one that never does is given up after its CAP.TO, and one
    /// reporting a fatal status at once, each with a message that says so.
    #[test]
    fn the_controller_is_waited_for_until_ready_within_cap_to() {
        let slow = Controller {
            not_ready: 3,
            ..Controller::default()
        };
        let target = fake::start(slow, |mut io| while io.recv().is_some() {});
        let s = crate::connect(&target.url, &options()).unwrap();
        assert_eq!(s.queues.len(), 1);
        let never = Controller {
            not_ready: u32::MAX,
            ..Controller::default()
        };
        let target = fake::start(never, |mut io| while io.recv().is_some() {});
        let r = crate::connect(&target.url, &options());
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("did not become ready within its CAP.TO of 500 ms")),
            "{:?}",
            r.map(|s| s.info.size)
        );
        let fatal = Controller {
            fatal: true,
            ..Controller::default()
        };
        let target = fake::start(fatal, |mut io| while io.recv().is_some() {});
        let r = crate::connect(&target.url, &options());
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("CSTS.CFS")),
            "{:?}",
            r.map(|s| s.info.size)
        );
    }

    /// A MAXH2CDATA below 4 KiB is refused at setup (no H2CData the host sends would fit it),
    /// not raised to 4 KiB and sent anyway.
    #[test]
    fn a_maxh2cdata_below_4096_is_refused() {
        for maxh2cdata in [4, 4092] {
            let c = Controller {
                maxh2cdata,
                ..Controller::default()
            };
            let target = fake::start(c, |mut io| while io.recv().is_some() {});
            let r = crate::connect(&target.url, &options());
            assert!(
                matches!(&r, Err(Error::Protocol(m)) if m.contains(&format!("MAXH2CDATA is {maxh2cdata} bytes"))),
                "{maxh2cdata}: {:?}",
                r.map(|s| s.info.size)
            );
        }
    }

    /// Namespace is Write Protected (SC 0x20) is a read-only refusal, as a write to a
    /// read-only range is.
    #[test]
    fn write_protected_is_read_only() {
        for sc in [0x020u16, 0x182] {
            let c = Cqe {
                dw0: 0,
                dw1: 0,
                sq_head: 0,
                sq_id: 0,
                cid: 0,
                status: sc << 1,
            };
            assert_eq!(status(&c), Status::ReadOnly, "{sc:#x}");
        }
    }

    /// Setup commands take no more data than they asked for (here Identify controller's
    /// 4 KiB comes three times).
    #[test]
    fn setup_data_beyond_what_was_asked_is_refused() {
        let c = Controller {
            identify_pieces: 3,
            ..Controller::default()
        };
        let target = fake::start(c, |mut io| while io.recv().is_some() {});
        let r = crate::connect(&target.url, &options());
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("asked for")),
            "{:?}",
            r.map(|s| s.info.size)
        );
    }

    /// A controller that sends its setup answers a byte at a time, each well within the
    /// timeout, is given up at the timeout, not after the whole answer has trickled in.
    #[test]
    fn a_trickled_setup_ends_at_the_timeout() {
        let c = Controller {
            trickle: Some(Duration::from_millis(50)),
            ..Controller::default()
        };
        let target = fake::start(c, |mut io| while io.recv().is_some() {});
        let opts = ConnectOptions {
            timeout: Duration::from_millis(300),
            ..options()
        };
        let e = crate::testing::fails_in_time(|| crate::connect(&target.url, &opts));
        assert!(matches!(e, Error::Timeout(_)), "{e:?}");
    }

    /// What only a read takes, data (here ending with SUCCESS, which would complete the
    /// command), does not complete a write.
    #[test]
    fn read_data_for_a_write_is_refused() {
        let target = fake::start(Controller::default(), move |mut io| {
            let b = io.recv().expect("the write");
            let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                panic!("not a command")
            };
            let data = Pdu::C2HData(nvme_tcp::C2HData {
                cccid: c.sqe.cid,
                datao: 0,
                last: true,
                success: true,
                data: c.data,
            });
            let _ = io.send(&[data]);
            while io.recv().is_some() {}
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        let r = s.queues[0].write_at(&[7u8; 4096], 0, false);
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("not a read")),
            "{r:?}"
        );
    }

    /// A read whose data comes in pieces, the last with SUCCESS, is complete then (no
    /// CapsuleResp follows): it used to wait for one until its timeout. SUCCESS on a piece
    /// before the last fails the queue (the PDU's flags are invalid).
    #[test]
    fn a_read_in_pieces_ending_with_success_completes() {
        for success_early in [false, true] {
            let target = fake::start(Controller::default(), move |mut io| {
                let b = io.recv().expect("the read");
                let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                    panic!("not a command")
                };
                let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
                let piece = |i: u32, success: bool| {
                    Pdu::C2HData(nvme_tcp::C2HData {
                        cccid: c.sqe.cid,
                        datao: i * 1024,
                        last: i == 3,
                        success,
                        data: &data[i as usize * 1024..(i as usize + 1) * 1024],
                    })
                };
                let pieces = [
                    piece(0, success_early),
                    piece(1, false),
                    piece(2, false),
                    piece(3, true),
                ];
                let _ = io.send(&pieces);
                while io.recv().is_some() {}
            });
            let mut s = crate::connect(&target.url, &options()).unwrap();
            let mut back = vec![0u8; 4096];
            let r = s.queues[0].read_at(&mut back, 0);
            if success_early {
                assert!(
                    matches!(&r, Err(Error::Protocol(m)) if m.contains("invalid flags")),
                    "{r:?}"
                );
            } else {
                r.unwrap();
                assert!(back.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            }
        }
    }

    /// A read answered OK by a CapsuleResp without its data (found by the stream_reply fuzz
    /// target) fails the queue, and stays in flight: the queue lets go of no request without
    /// completing it, as on native replies.
    #[test]
    fn a_read_answered_without_its_data_fails_and_stays_in_flight() {
        let target = fake::start(Controller::default(), move |mut io| {
            let b = io.recv().expect("the read");
            let Pdu::CapsuleCmd(c) = io.decode(&b) else {
                panic!("not a command")
            };
            let _ = io.send(&[resp(c.sqe.cid, 0, 0)]);
            while io.recv().is_some() {}
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        let q = &mut s.queues[0];
        let read = Cmd::Read {
            offset: 0,
            len: 4096,
        };
        q.submit(read, 7).unwrap();
        let r = q.complete(1, |c| panic!("user {} completed", c.user));
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("got 0")),
            "{r:?}"
        );
        assert_eq!(q.in_flight(), 1);
    }

    /// An R2T for a write that went in the capsule (after a larger write on the same slot
    /// that did take R2Ts) is refused, not answered with the earlier write's data.
    #[test]
    fn an_r2t_for_a_write_in_the_capsule_is_refused() {
        let (tx, rx) = mpsc::channel();
        let target = fake::start(Controller::default(), move |mut io| {
            let mut h2c = Vec::new();
            while let Some(b) = io.recv() {
                match io.decode(&b) {
                    Pdu::CapsuleCmd(c) => {
                        let cid = c.sqe.cid;
                        if c.data.is_empty() {
                            let r2t = Pdu::R2T(nvme_tcp::R2T {
                                cccid: cid,
                                ttag: 1,
                                r2to: 0,
                                r2tl: sgl_len(&c.sqe),
                            });
                            let _ = io.send(&[r2t]);
                        } else {
                            // In the capsule: asked for again all the same.
                            let r2t = Pdu::R2T(nvme_tcp::R2T {
                                cccid: cid,
                                ttag: 2,
                                r2to: 0,
                                r2tl: c.data.len() as u32,
                            });
                            let _ = io.send(&[r2t]);
                        }
                    }
                    Pdu::H2CData(d) => {
                        h2c.push(d.data.to_vec());
                        if d.last {
                            let _ = io.send(&[resp(d.cccid, 0, 0)]);
                        }
                    }
                    _ => {}
                }
            }
            let _ = tx.send(h2c);
        });
        let mut s = crate::connect(&target.url, &options()).unwrap();
        let q = &mut s.queues[0];
        q.write_at(&[1u8; 64 << 10], 0, false).unwrap();
        let r = q.write_at(&[2u8; 4096], 0, false);
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("R2T")),
            "{r:?}"
        );
        drop(s);
        let h2c = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            h2c.iter().all(|d| d.iter().all(|&b| b == 1)),
            "only the first write's data was asked for and sent"
        );
    }

    #[test]
    fn cids_carry_slot_and_generation() {
        for (slot, generation) in [(0, 0), (1023, 63), (5, 1), (17, 40)] {
            assert_eq!(slot_of(cid(slot, generation)), (slot, generation));
        }
    }

    #[test]
    fn names_become_nqns() {
        let u = Url::parse("nvme-tcp://h/disk0").unwrap();
        assert_eq!(subsystem(&u), "nqn.2026-11.io.blkwire:disk0");
        let u = Url::parse("nvme-tcp://h:4421/nqn.2014-08.org.example:x").unwrap();
        assert_eq!(subsystem(&u), "nqn.2014-08.org.example:x");
        assert_eq!(u.port, 4421);
        assert_eq!(Url::parse("nvme-tcp://h/d").unwrap().port, 4420);
    }
}
