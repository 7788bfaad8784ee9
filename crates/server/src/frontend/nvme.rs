//! NVMe/TCP I/O queues (NVMe/TCP transport 1.0a §3.3–3.6; NVM command set 1.0): one TCP
//! connection per I/O queue, after ICReq/ICResp and Fabrics Connect on the handshake thread
//! (`crate::nvme`). Commands carry a CID, not a slot, so the reactor assigns slots; a WRITE
//! whose data is not in the capsule waits in its slot while an R2T (TTAG = the slot) asks for
//! it; READ data goes out as one C2HData followed by a CapsuleResp (or with SUCCESS set and no
//! CapsuleResp when the host disabled SQ flow control). How the protocol maps onto the trait is
//! in docs/ARCHITECTURE.md, "NVMe/TCP".

use blkwire_backend::CopyRange;
use blkwire_backend::{BlockOp, IoFlags};
use blkwire_wire::nvme_tcp::{
    self, pdu_len, C2HData, CapsuleCmd, Params, Pdu, PduError, PduType, Progress, Sgl, R2T,
};
use blkwire_wire::{CopyDescriptor, CopyLimits, Status};

use super::{Decoded, Kind, ReadFraming, Req, StreamFrontend};
use crate::nvme::spec::{self, fctype, io, sc, status_of};
use crate::nvme::Completion;

/// One I/O queue's protocol state, as ICReq and Connect negotiated it.
pub struct NvmeIo {
    /// How host PDUs are decoded (our CPDA is 0) and how large they may be.
    rx: Params,
    /// How our PDUs are encoded (the host's HPDA, the same digests).
    tx: Params,
    qid: u16,
    /// Entries in the submission queue (SQSIZE + 1): SQHD wraps here.
    entries: u16,
    sq_head: u16,
    /// The host disabled SQ flow control (Connect CATTR bit 2): READ data may carry SUCCESS.
    sqfc_off: bool,
    max_io: u32,
    /// The most data one H2CData PDU may carry (MAXH2CDATA).
    maxh2cdata: u32,
    /// The controller's namespaces, in the order of the connection's targets (`Req::target`).
    namespaces: Vec<NsIo>,
    /// NSID - 1 -> index in `namespaces` + 1 (0: no such namespace): one bounded array index
    /// per command, no map (NSIDs are at most `spec::MAX_NSID`).
    by_nsid: Vec<u8>,
    /// The CID each slot's R2T was sent for, so an H2CData naming a TTAG must also name the
    /// right command (the reactor checks the data's order and bounds).
    r2t_cid: Vec<u16>,
    /// Where each slot's R2T ends (R2TO + R2TL): the H2CData that reaches it, and only that
    /// one, carries LAST_PDU.
    r2t_end: Vec<u32>,
    /// Scratch for headers built outside `tx` (no allocation per I/O).
    scratch: Vec<u8>,
    /// The deallocation in progress that is more than one trim (`Dealloc`), if any.
    dealloc: Option<Dealloc>,
    /// Its ranges, as (offset, bytes) still to trim: kept between commands (at most 256
    /// entries), so a compound deallocation allocates nothing once the queue ran one.
    dealloc_ranges: Vec<(u64, u64)>,
}

/// The most one trim of a deallocation covers: DMRSL's 1 GiB.
const DEALLOC_PART: u64 = 1 << 30;

/// Cookie bit of a trim that is a part of a compound deallocation (`Dealloc`).
const PART: u128 = 1 << 24;
/// Cookie bit of a part after the first: it comes from no submission queue entry, so taking it
/// does not move the SQ head.
const LATER_PART: u128 = 1 << 25;

/// A Dataset Management deallocation of several ranges, or of a range larger than
/// `DEALLOC_PART`: Identify says DMRL 1 and DMRSL 1 GiB, which older Linux hosts (and
/// other hosts) do not read, sending up to 256 ranges of up to 2^32 blocks each. It runs as
/// trims of at most `DEALLOC_PART` bytes, one at a time (`NvmeIo::dealloc_ranges`), each
/// handed to the reactor as a request of no message (as iSCSI's compound commands are); the
/// command's CapsuleResp goes out after the last, or after the first that fails (the parts
/// after it are not run: deallocation is advisory, so what ran stays done).
struct Dealloc {
    cid: u16,
    target: u8,
    /// The first part was taken: the command is consumed (its SQ entry freed).
    started: bool,
    /// A part is with the reactor.
    running: bool,
}

/// What an I/O queue is set up with.
pub struct IoQueueSetup {
    /// Digests, alignment: from ICReq/ICResp.
    pub rx: Params,
    /// ... for what we send.
    pub tx: Params,
    /// Queue id (≥ 1).
    pub qid: u16,
    /// Connect's SQSIZE + 1.
    pub entries: u16,
    /// SQ head after the commands the handshake thread took (Connect, authentication).
    pub sq_head: u16,
    /// Connect's CATTR asked for no SQ flow control.
    pub sqfc_off: bool,
    /// Largest data transfer.
    pub max_io: u32,
    /// MAXH2CDATA the ICResp gave: the most data one H2CData PDU may carry.
    pub maxh2cdata: u32,
    /// The controller's namespaces, in the order of the connection's targets.
    pub namespaces: Vec<NsIo>,
}

/// One namespace as an I/O queue checks its commands.
#[derive(Clone, Copy, Debug)]
pub struct NsIo {
    /// Its NSID (1..=`spec::MAX_NSID`).
    pub nsid: u32,
    /// log2 of its LBA size.
    pub lba_shift: u32,
    /// Write protected.
    pub read_only: bool,
    /// What one Copy within it may do.
    pub copy: CopyLimits,
}

/// The cookie: the command's CID (the opcode beside it, for logs).
fn cookie(cid: u16, opcode: u8) -> u128 {
    cid as u128 | (opcode as u128) << 16
}

fn cid_of(req: &Req) -> u16 {
    req.cookie as u16
}

impl NvmeIo {
    /// A queue as set up by Connect.
    pub fn new(s: IoQueueSetup) -> NvmeIo {
        NvmeIo {
            rx: s.rx,
            tx: s.tx,
            qid: s.qid,
            entries: s.entries.max(1),
            sq_head: s.sq_head % s.entries.max(1),
            sqfc_off: s.sqfc_off,
            max_io: s.max_io,
            maxh2cdata: s.maxh2cdata,
            by_nsid: {
                let top = s.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0);
                let mut v = vec![0u8; top.min(spec::MAX_NSID) as usize];
                for (i, n) in s.namespaces.iter().enumerate().take(u8::MAX as usize) {
                    if let Some(e) = (n.nsid as usize).checked_sub(1).and_then(|k| v.get_mut(k)) {
                        *e = i as u8 + 1;
                    }
                }
                v
            },
            namespaces: s.namespaces,
            r2t_cid: vec![0; s.entries.max(1) as usize],
            r2t_end: vec![0; s.entries.max(1) as usize],
            scratch: Vec::with_capacity(128),
            dealloc: None,
            dealloc_ranges: Vec::new(),
        }
    }

    /// Appends a C2HTermReq for `e` (when the error has a FES) with the offending header: the
    /// host learns why before the connection closes (TCP transport §3.6.2.4).
    fn terminate(&mut self, e: &PduError, rx: &[u8], tx: &mut Vec<u8>) -> Decoded {
        self.end_dealloc();
        crate::nvme::terminate(tx, e, rx, &self.tx);
        Decoded::Violation(format!("NVMe/TCP: {e}"))
    }

    /// A command answered here, without the backend (refusals with their exact status, DSM
    /// hints): its CapsuleResp goes straight into `tx`. The reactor always consumes an answered
    /// command, so it moves the SQ head here (a request moves it in `taken`).
    fn answer(&mut self, cid: u16, status: u16, len: usize, tx: &mut Vec<u8>) -> Decoded {
        self.advance_head();
        self.response(cid, status, tx);
        Decoded::Answered { len }
    }

    /// The index of the namespace `nsid` names among the queue's targets. A Flush to every
    /// namespace (NSID FFFFFFFFh) is taken only where there is one (Identify Controller VWC
    /// says broadcast flush is not supported otherwise).
    fn target_of(&self, nsid: u32, op: u8) -> Option<usize> {
        if nsid == u32::MAX && op == io::FLUSH && self.namespaces.len() == 1 {
            return Some(0);
        }
        let i = *self.by_nsid.get((nsid as usize).checked_sub(1)?)?;
        (i as usize).checked_sub(1)
    }

    /// The byte range of `slba` and `nlb` blocks (0's based) of namespace `t`, if it fits a
    /// request.
    fn range(&self, t: usize, slba: u64, blocks: u64) -> Option<(u64, u32)> {
        let (offset, len) = self.span(t, slba, blocks)?;
        Some((offset, u32::try_from(len).ok()?))
    }

    /// The byte range of `slba` and `blocks` blocks of namespace `t`, of any length, if it
    /// does not overflow.
    fn span(&self, t: usize, slba: u64, blocks: u64) -> Option<(u64, u64)> {
        let shift = self.namespaces[t].lba_shift;
        let offset = slba.checked_mul(1 << shift)?;
        let len = blocks.checked_mul(1 << shift)?;
        offset.checked_add(len)?;
        Some((offset, len))
    }

    fn command(
        &mut self,
        c: &CapsuleCmd<'_>,
        len: usize,
        trailer: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let q = &c.sqe;
        // The SQ head moves when the command is consumed, not here: a request the reactor
        // cannot take yet stays in rx and is decoded again (`taken`, `answer`).
        let (cid, op) = (q.cid, q.opcode);
        if op == spec::FABRICS {
            // Only Disconnect means something on an established I/O queue.
            let fct = q.nsid as u8;
            if fct == fctype::DISCONNECT {
                return self.request(Kind::Logout, 0, 0, IoFlags::empty(), cid, op, len, 0, 0);
            }
            return self.answer(cid, sc::CMD_SEQ_ERROR | sc::DNR, len, tx);
        }
        if q.flags & 0x3 != 0 {
            // Fused operations (compare and write) are not offered.
            return self.answer(cid, sc::INVALID_FIELD | sc::DNR, len, tx);
        }
        if !matches!(
            op,
            io::READ | io::WRITE | io::FLUSH | io::WRITE_ZEROES | io::DSM | io::COPY
        ) {
            return self.answer(cid, sc::INVALID_OPCODE | sc::DNR, len, tx);
        }
        let Some(t) = self.target_of(q.nsid, op) else {
            return self.answer(cid, sc::INVALID_NS | sc::DNR, len, tx);
        };
        let mut d = self.ns_command(c, t, len, trailer, tx);
        if let Decoded::Request { req, .. } = &mut d {
            req.target = t as u8;
        }
        d
    }

    /// An I/O command for namespace `t` (its NSID checked).
    fn ns_command(
        &mut self,
        c: &CapsuleCmd<'_>,
        t: usize,
        len: usize,
        trailer: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let q = &c.sqe;
        let (cid, op) = (q.cid, q.opcode);
        let slba = q.cdw10 as u64 | (q.cdw11 as u64) << 32;
        let nlb = (q.cdw12 & 0xffff) as u64 + 1;
        let fua = IoFlags::empty().with(IoFlags::FUA, q.cdw12 & 1 << 30 != 0);
        let data_len = c.data.len();
        if data_len > spec::IO_INCAPSULE as usize {
            // More in the capsule than IOCCSZ (Identify) says an I/O queue takes, whatever the
            // command: Data SGL Length Invalid.
            return self.answer(cid, sc::SGL_INVALID_DATA | sc::DNR, len, tx);
        }
        match op {
            io::READ | io::WRITE => {
                let Some((offset, length)) = self.range(t, slba, nlb) else {
                    return self.answer(cid, sc::LBA_RANGE | sc::DNR, len, tx);
                };
                if length > self.max_io {
                    return self.answer(cid, sc::INVALID_FIELD | sc::DNR, len, tx);
                }
                let sgl = q.sgl();
                let carried = match (op, sgl) {
                    // Read data comes back, write data is asked for: both by the transport.
                    (_, Sgl::TransportDataBlock { length: l, .. }) if data_len == 0 => {
                        if l < length {
                            return self.answer(cid, sc::SGL_INVALID_DATA | sc::DNR, len, tx);
                        }
                        0
                    }
                    (
                        io::WRITE,
                        Sgl::DataBlock {
                            subtype: nvme_tcp::sgl::SUBTYPE_OFFSET,
                            address: 0,
                            length: l,
                        },
                    ) if l as usize == data_len && data_len == length as usize => data_len,
                    (_, Sgl::DataBlock { .. } | Sgl::TransportDataBlock { .. }) => {
                        return self.answer(cid, sc::SGL_INVALID_DATA | sc::DNR, len, tx);
                    }
                    _ => return self.answer(cid, sc::SGL_INVALID_TYPE | sc::DNR, len, tx),
                };
                let block = if op == io::READ {
                    BlockOp::Read
                } else {
                    BlockOp::Write
                };
                self.request(
                    Kind::Block(block),
                    offset,
                    length,
                    fua,
                    cid,
                    op,
                    len,
                    carried,
                    trailer,
                )
            }
            io::FLUSH => self.request(
                Kind::Block(BlockOp::Flush),
                0,
                0,
                IoFlags::empty(),
                cid,
                op,
                len,
                0,
                0,
            ),
            io::WRITE_ZEROES => {
                let Some((offset, length)) = self.range(t, slba, nlb) else {
                    return self.answer(cid, sc::LBA_RANGE | sc::DNR, len, tx);
                };
                // DEAC (bit 25) allows deallocating: without it the blocks stay allocated.
                let flags = fua.with(IoFlags::NO_HOLE, q.cdw12 & 1 << 25 == 0);
                self.request(
                    Kind::Block(BlockOp::WriteZeroes),
                    offset,
                    length,
                    flags,
                    cid,
                    op,
                    len,
                    0,
                    0,
                )
            }
            io::DSM => self.dsm(c, t, len, tx),
            io::COPY => self.copy_command(c, t, len, trailer, tx),
            _ => unreachable!("filtered above"),
        }
    }

    /// Dataset Management: deallocate (AD); hints without AD are answered at once. One range
    /// of at most `DEALLOC_PART` (what DMRL and DMRSL in the NVM command set's Identify
    /// Controller data allow) is one trim; anything more is a compound deallocation
    /// (`Dealloc`).
    fn dsm(&mut self, c: &CapsuleCmd<'_>, t: usize, len: usize, tx: &mut Vec<u8>) -> Decoded {
        let q = &c.sqe;
        let (cid, op) = (q.cid, q.opcode);
        let ranges = (q.cdw10 & 0xff) as usize + 1;
        if c.data.len() < ranges * 16 {
            // The range list must come in the capsule (it always fits: IOCCSZ). Linux sends
            // its whole range page (4 KiB), whatever NR says: only NR + 1 ranges count.
            return self.answer(cid, sc::SGL_INVALID_DATA | sc::DNR, len, tx);
        }
        if q.cdw11 & 1 << 2 == 0 {
            return self.answer(cid, sc::SUCCESS, len, tx);
        }
        if self.dealloc.as_ref().is_some_and(|d| d.started) {
            // One compound deallocation at a time: this one waits, untaken, for the one in
            // progress, whose running part's answer services the connection again. What is
            // asked for is there already.
            return Decoded::Need(len);
        }
        self.dealloc_ranges.clear();
        for r in c.data[..ranges * 16].chunks_exact(16) {
            let blocks = u32::from_le_bytes(r[4..8].try_into().expect("4 bytes")) as u64;
            let slba = u64::from_le_bytes(r[8..16].try_into().expect("8 bytes"));
            let Some((offset, bytes)) = self.span(t, slba, blocks) else {
                self.dealloc_ranges.clear();
                return self.answer(cid, sc::LBA_RANGE | sc::DNR, len, tx);
            };
            if bytes > 0 {
                self.dealloc_ranges.push((offset, bytes));
            }
        }
        match self.dealloc_ranges[..] {
            [] => self.answer(cid, sc::SUCCESS, len, tx),
            [(offset, bytes)] if bytes <= DEALLOC_PART => {
                self.end_dealloc();
                self.request(
                    Kind::Block(BlockOp::Trim),
                    offset,
                    bytes as u32,
                    IoFlags::empty(),
                    cid,
                    op,
                    len,
                    0,
                    0,
                )
            }
            _ => {
                // Last first, so parts come off the end.
                self.dealloc_ranges.reverse();
                self.dealloc = Some(Dealloc {
                    cid,
                    target: t as u8,
                    started: false,
                    running: false,
                });
                self.next_part(len)
            }
        }
    }

    /// The next trim of the compound deallocation, as a request of `len` bytes of message
    /// (the command's for the first part, none for the others): handed out again until the
    /// reactor takes it (`taken` moves past it).
    fn next_part(&self, len: usize) -> Decoded {
        let d = self.dealloc.as_ref().expect("a compound deallocation");
        let &(offset, bytes) = self.dealloc_ranges.last().expect("a part left");
        let mut decoded = self.request(
            Kind::Block(BlockOp::Trim),
            offset,
            bytes.min(DEALLOC_PART) as u32,
            IoFlags::empty(),
            d.cid,
            io::DSM,
            len,
            0,
            0,
        );
        if let Decoded::Request { req, .. } = &mut decoded {
            req.cookie |= PART | if d.started { LATER_PART } else { 0 };
            req.target = d.target;
        }
        decoded
    }

    /// Forgets the compound deallocation: it is answered, it was set up by a decode the reactor
    /// did not take (a single trim now takes its place), or the connection ends on a protocol
    /// error (ours, or the host's H2CTermReq), after which it makes no more parts and its
    /// CapsuleResp never follows the termination (the part running is answered to no one).
    fn end_dealloc(&mut self) {
        self.dealloc = None;
        self.dealloc_ranges.clear();
    }

    /// The part `req` of the compound deallocation was answered with `status`: the command's
    /// CapsuleResp goes out after its last part, or this one if it failed. Returns whether it
    /// went out.
    fn part_done(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        let Some(d) = self.dealloc.as_mut() else {
            return false;
        };
        d.running = false;
        let cid = d.cid;
        if status == Status::Ok && !self.dealloc_ranges.is_empty() {
            return false;
        }
        self.end_dealloc();
        let st = match status {
            Status::Ok => sc::SUCCESS,
            st => status_of(st, false, req.kind == Kind::Block(BlockOp::Trim)),
        };
        self.response(cid, st, tx);
        true
    }

    /// Copy (NVM command set §3.2.2), source range format 0, into the namespace itself: the
    /// range list is the payload the reactor hands to `copy_descriptor`.
    fn copy_command(
        &mut self,
        c: &CapsuleCmd<'_>,
        t: usize,
        len: usize,
        trailer: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let q = &c.sqe;
        let (cid, op) = (q.cid, q.opcode);
        let ns = self.namespaces[t];
        if ns.copy.max_ranges == 0 || ns.read_only {
            return self.answer(cid, sc::INVALID_OPCODE | sc::DNR, len, tx);
        }
        let ranges = (q.cdw12 & 0xff) as usize + 1;
        let format = (q.cdw12 >> 8) & 0xf;
        if format != 0 {
            return self.answer(cid, sc::INVALID_FIELD | sc::DNR, len, tx);
        }
        if c.data.len() < ranges * 32 {
            return self.answer(cid, sc::SGL_INVALID_DATA | sc::DNR, len, tx);
        }
        let list = ranges * 32;
        let sdlba = q.cdw10 as u64 | (q.cdw11 as u64) << 32;
        let mut total = 0u64;
        for r in c.data[..list].chunks_exact(32) {
            total += u16::from_le_bytes([r[16], r[17]]) as u64 + 1;
        }
        let Some((offset, length)) = self.range(t, sdlba, total) else {
            return self.answer(cid, sc::LBA_RANGE | sc::DNR, len, tx);
        };
        let fua = IoFlags::empty().with(IoFlags::FUA, q.cdw12 & 1 << 30 != 0);
        // The payload the reactor hands to `copy_descriptor` is the range list; whatever the
        // host sent after it (and the digest) is the trailer.
        self.request(
            Kind::Copy,
            offset,
            length,
            fua,
            cid,
            op,
            len,
            list,
            trailer + c.data.len() - list,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        kind: Kind,
        offset: u64,
        length: u32,
        flags: IoFlags,
        cid: u16,
        opcode: u8,
        len: usize,
        payload_len: usize,
        trailer: usize,
    ) -> Decoded {
        Decoded::Request {
            req: Req {
                kind,
                offset,
                length,
                flags,
                slot: None,
                cookie: cookie(cid, opcode),
                // Set by `command` once the namespace is known.
                target: 0,
            },
            len,
            payload_len,
            trailer,
        }
    }

    /// One more submission queue entry consumed.
    fn advance_head(&mut self) {
        self.sq_head = (self.sq_head + 1) % self.entries;
    }

    fn response(&self, cid: u16, status: u16, tx: &mut Vec<u8>) {
        let c = Completion {
            cid,
            qid: self.qid,
            sq_head: self.sq_head,
            status,
            result: 0,
        };
        c.encode(&self.tx, None, tx);
    }

    fn resp_len(&self) -> usize {
        nvme_tcp::prefix_len(PduType::CapsuleResp, 0, &self.tx)
    }

    /// The trailer a PDU with data carries under `p` (its data digest).
    fn digest_len(p: &Params, data_len: usize) -> usize {
        if p.ddgst && data_len > 0 {
            nvme_tcp::DIGEST_LEN
        } else {
            0
        }
    }
}

impl StreamFrontend for NvmeIo {
    fn decode(&mut self, rx: &[u8], tx: &mut Vec<u8>) -> Decoded {
        // The compound deallocation in progress hands out its next part first, once the one
        // before is answered.
        if self
            .dealloc
            .as_ref()
            .is_some_and(|d| d.started && !d.running)
        {
            return self.next_part(0);
        }
        let len = match pdu_len(rx, &self.rx) {
            Ok(Progress::Need(n)) => return Decoded::Need(n),
            Ok(Progress::Complete(n)) => n,
            Err(e) => return self.terminate(&e, rx, tx),
        };
        let pdu = match nvme_tcp::decode(&rx[..len], &self.rx) {
            Ok(p) => p,
            Err(e) => return self.terminate(&e, &rx[..len], tx),
        };
        match pdu {
            Pdu::CapsuleCmd(c) => {
                let trailer = Self::digest_len(&self.rx, c.data.len());
                self.command(&c, len, trailer, tx)
            }
            Pdu::H2CData(d) => {
                let slot = d.ttag;
                if self.r2t_cid.get(slot as usize) != Some(&d.cccid) {
                    let e = PduError::InvalidField {
                        typ: PduType::H2CData,
                        offset: 8,
                    };
                    return self.terminate(&e, &rx[..len], tx);
                }
                // LAST_PDU on the PDU that ends the R2T's data, on no other (TCP transport
                // §3.6.2.8): a "last" one that leaves data owed would hold its write (and
                // buffer) waiting for data the host says it will not send.
                // At most MAXH2CDATA in one PDU (TCP transport §3.6.2.8): more is a Data
                // Transfer Limit Exceeded, not taken because the receive bound has room (it
                // is measured for a capsule, whose data starts 48 bytes further in).
                if d.data.len() > self.maxh2cdata as usize {
                    let e = PduError::TooLong {
                        typ: PduType::H2CData,
                        plen: len as u32,
                        max: self.maxh2cdata,
                    };
                    return self.terminate(&e, &rx[..len], tx);
                }
                let end = d.datao as u64 + d.data.len() as u64;
                let r2t_end = self.r2t_end.get(slot as usize).copied().unwrap_or(0);
                if d.last != (end == r2t_end as u64) {
                    let e = PduError::InvalidField {
                        typ: PduType::H2CData,
                        offset: 1,
                    };
                    return self.terminate(&e, &rx[..len], tx);
                }
                Decoded::Data {
                    slot,
                    offset: d.datao,
                    len,
                    payload_len: d.data.len(),
                    trailer: Self::digest_len(&self.rx, d.data.len()),
                }
            }
            Pdu::H2CTermReq(t) => {
                self.end_dealloc();
                Decoded::Violation(format!(
                    "the host ended the connection (H2CTermReq FES {:#x}, FEI {:#x})",
                    t.fes, t.fei
                ))
            }
            other => {
                let e = PduError::InvalidField {
                    typ: other.typ(),
                    offset: 0,
                };
                self.terminate(&e, &rx[..len], tx)
            }
        }
    }

    fn solicit(&mut self, req: &Req, slot: u16, offset: u32, len: u32, tx: &mut Vec<u8>) {
        if let Some(c) = self.r2t_cid.get_mut(slot as usize) {
            *c = cid_of(req);
        }
        if let Some(e) = self.r2t_end.get_mut(slot as usize) {
            *e = offset + len;
        }
        let r = R2T {
            cccid: cid_of(req),
            ttag: slot,
            r2to: offset,
            r2tl: len,
        };
        Pdu::R2T(r).encode(&self.tx, tx);
    }

    /// The reactor consumed the command: its submission queue entry is free. A part of a
    /// compound deallocation is under way: the next is handed out once it is answered.
    fn taken(&mut self, req: &Req) {
        if req.cookie & LATER_PART == 0 {
            self.advance_head();
        }
        if req.cookie & PART != 0 {
            if let Some(d) = self.dealloc.as_mut() {
                d.started = true;
                d.running = true;
            }
            if let Some(r) = self.dealloc_ranges.last_mut() {
                let n = r.1.min(DEALLOC_PART);
                r.0 += n;
                r.1 -= n;
                if r.1 == 0 {
                    self.dealloc_ranges.pop();
                }
            }
        }
    }

    fn server_assigns_slots(&self) -> bool {
        true
    }

    fn next_is_data(&self, rx: &[u8]) -> bool {
        rx.first() == Some(&(PduType::H2CData as u8))
    }

    fn read_framing(&self, req: &Req) -> ReadFraming {
        let len = req.length as usize;
        let prefix = nvme_tcp::prefix_len(PduType::C2HData, len, &self.tx);
        let digest = nvme_tcp::suffix_len(PduType::C2HData, len, &self.tx);
        let resp = if self.sqfc_off { 0 } else { self.resp_len() };
        ReadFraming::Contiguous {
            prefix,
            suffix: digest + resp,
        }
    }

    /// The suffix is the data digest when DDGST was negotiated, then the CapsuleResp (which
    /// does not depend on the data) unless SQ flow control is off.
    fn read_suffix_digests(&self, _req: &Req) -> bool {
        self.tx.ddgst
    }

    fn finish_read_reply(&mut self, req: &Req, prefix: &mut [u8], data: &[u8], suffix: &mut [u8]) {
        let d = C2HData {
            cccid: cid_of(req),
            datao: 0,
            last: true,
            success: self.sqfc_off,
            data: &[],
        };
        self.scratch.clear();
        d.encode_prefix(data.len() as u32, &self.tx, &mut self.scratch);
        prefix.copy_from_slice(&self.scratch);
        let digest = nvme_tcp::suffix_len(PduType::C2HData, data.len(), &self.tx);
        if digest > 0 {
            suffix[..digest].copy_from_slice(&nvme_tcp::data_digest(data).to_le_bytes());
        }
        if !self.sqfc_off {
            self.scratch.clear();
            let mut resp = std::mem::take(&mut self.scratch);
            self.response(cid_of(req), sc::SUCCESS, &mut resp);
            suffix[digest..].copy_from_slice(&resp);
            self.scratch = resp;
        }
    }

    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        if req.cookie & PART != 0 {
            return self.part_done(req, status, tx);
        }
        let st = match (req.kind, status) {
            (_, Status::Ok) => sc::SUCCESS,
            (kind, st) => status_of(
                st,
                kind == Kind::Block(BlockOp::Read),
                matches!(kind, Kind::Block(op) if op.modifies()) || kind == Kind::Copy,
            ),
        };
        self.response(cid_of(req), st, tx);
        true
    }

    fn copy_descriptor(&mut self, req: &Req, payload: &[u8]) -> Option<CopyDescriptor> {
        let t = req.target as usize;
        let copy = self.namespaces.get(t)?.copy;
        let n = payload.len() / 32;
        if n == 0 || n > copy.max_ranges as usize || n > spec::COPY_RANGES as usize {
            return None;
        }
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0u64;
        for r in payload.chunks_exact(32) {
            let slba = u64::from_le_bytes(r[8..16].try_into().expect("8 bytes"));
            let blocks = u16::from_le_bytes([r[16], r[17]]) as u64 + 1;
            let (offset, len) = self.range(t, slba, blocks)?;
            if len > copy.max_range {
                return None;
            }
            total += len as u64;
            ranges.push(CopyRange { offset, len });
        }
        if total > copy.max_bytes as u64 {
            return None;
        }
        Some(CopyDescriptor {
            source: String::new(),
            ranges,
        })
    }
}
