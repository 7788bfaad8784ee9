//! What an NVMe controller says about itself and its namespace (NVM Express Base Specification
//! 2.0, Identify §5.17, properties §3.1, status codes §4.2.3; NVMe over Fabrics 1.1 for the
//! fabrics commands and the discovery log), built from an export's facts. Plain data and byte
//! layouts: the admin queue (`admin.rs`) and the I/O queues (`frontend/nvme.rs`) both use it.

use std::sync::Arc;

use blkwire_backend::Export;
use blkwire_wire::{CopyLimits, Status};

/// The well-known NQN of a discovery controller.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Subsystem NQNs are this prefix and the export's name.
pub use blkwire_wire::nvme_tcp::BLKWIRE_NQN_PREFIX as NQN_PREFIX;
/// Namespace ids a subsystem may use (1..=this; NN and MNAN of a controller are at most this).
pub const MAX_NSID: u32 = 1024;
/// Namespaces one subsystem may have (a request's target index is a byte).
pub const MAX_NAMESPACES: usize = 32;
/// Serial numbers are 20 ASCII bytes, model numbers 40 (Identify Controller SN, MN).
pub const SERIAL_LEN: usize = 20;
/// See [`SERIAL_LEN`].
pub const MODEL_LEN: usize = 40;
/// The model number controllers report unless their subsystem says otherwise.
pub const DEFAULT_MODEL: &str = "blkwire";

/// NQNs are at most 223 bytes (Base spec §4.5); the fields that carry them are 256.
pub const NQN_FIELD: usize = 256;

/// Admin command opcodes.
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
    /// Copy.
    pub const COPY: u8 = 0x19;
}

/// The fabrics command opcode; its type is in byte 4 (FCTYPE).
pub const FABRICS: u8 = 0x7f;

/// Fabrics command types.
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Disconnect (of an I/O queue).
    pub const DISCONNECT: u8 = 0x08;
}

/// Status field values (the CQE's status word without its phase bit): SCT in bits 10:8, SC in
/// 7:0, DNR bit 14, as Linux's `NVME_SC_*`.
pub mod sc {
    /// Successful completion.
    pub const SUCCESS: u16 = 0x000;
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: u16 = 0x001;
    /// Invalid Field in Command.
    pub const INVALID_FIELD: u16 = 0x002;
    /// Data Transfer Error.
    pub const DATA_XFER_ERROR: u16 = 0x004;
    /// Internal Error.
    pub const INTERNAL: u16 = 0x006;
    /// Invalid Namespace or Format.
    pub const INVALID_NS: u16 = 0x00b;
    /// Command Sequence Error.
    pub const CMD_SEQ_ERROR: u16 = 0x00c;
    /// Data SGL Length Invalid.
    pub const SGL_INVALID_DATA: u16 = 0x00f;
    /// SGL Descriptor Type Invalid.
    pub const SGL_INVALID_TYPE: u16 = 0x011;
    /// Command Interrupted (the host retries).
    pub const INTERRUPTED: u16 = 0x021;
    /// LBA Out of Range.
    pub const LBA_RANGE: u16 = 0x080;
    /// Capacity Exceeded.
    pub const CAP_EXCEEDED: u16 = 0x081;
    /// Namespace Not Ready.
    pub const NS_NOT_READY: u16 = 0x082;
    /// Invalid Log Page (command specific).
    pub const INVALID_LOG_PAGE: u16 = 0x109;
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: u16 = 0x10d;
    /// Connect: Incompatible Format.
    pub const CONNECT_FORMAT: u16 = 0x180;
    /// Connect: Controller Busy.
    pub const CONNECT_CTRL_BUSY: u16 = 0x181;
    /// Connect: Invalid Parameters.
    pub const CONNECT_INVALID_PARAM: u16 = 0x182;
    /// Connect: Invalid Host.
    pub const CONNECT_INVALID_HOST: u16 = 0x184;
    /// Attempted Write to Read Only Range.
    pub const READ_ONLY: u16 = 0x182;
    /// Authentication Required.
    pub const AUTH_REQUIRED: u16 = 0x191;
    /// Write Fault (media error).
    pub const WRITE_FAULT: u16 = 0x280;
    /// Unrecovered Read Error.
    pub const READ_ERROR: u16 = 0x281;
    /// Do Not Retry.
    pub const DNR: u16 = 0x4000;
}

/// The CQE status word for a status field value (phase bit clear).
pub fn cqe_status(status: u16) -> u16 {
    status << 1
}

/// The NVMe status a blkwire status becomes. Errors a retry cannot fix carry DNR; running out
/// of memory is transient, so the host retries it.
pub fn status_of(st: Status, read: bool, write: bool) -> u16 {
    match st {
        Status::Ok => sc::SUCCESS,
        Status::ReadOnly => sc::READ_ONLY | sc::DNR,
        Status::OutOfRange => sc::LBA_RANGE | sc::DNR,
        // Linux reads Capacity Exceeded as ENOSPC (BLK_STS_NOSPC).
        Status::NoSpace => sc::CAP_EXCEEDED | sc::DNR,
        Status::Invalid => sc::INVALID_FIELD | sc::DNR,
        Status::Unsupported => sc::INVALID_OPCODE | sc::DNR,
        Status::NoMemory | Status::Busy => sc::INTERRUPTED,
        Status::Io if read => sc::READ_ERROR,
        Status::Io if write => sc::WRITE_FAULT,
        Status::Shutdown => sc::NS_NOT_READY,
        // The namespace was removed while the queue lives (its target is fenced).
        Status::NoExport => sc::INVALID_NS | sc::DNR,
        _ => sc::INTERNAL,
    }
}

/// Properties (Base spec §3.1.3).
pub mod prop {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version.
    pub const VS: u32 = 0x08;
    /// Controller Configuration.
    pub const CC: u32 = 0x14;
    /// Controller Status.
    pub const CSTS: u32 = 0x1c;
}

/// The NVMe version the controllers report: 1.3 (a byte-wide CNS, namespace descriptors) plus
/// the 2.0 features the host asks for by CNS (the NVM command set controller structure).
pub const VERSION: u32 = 0x0001_0300;
/// Identify data is always 4096 bytes.
pub const IDENTIFY_LEN: usize = 4096;
/// Keep Alive granularity (KAS) in 100 ms units: keep-alive timeouts are rounded to 100 ms.
pub const KAS: u16 = 1;
/// Asynchronous event requests a host may leave outstanding (AERL is 0's based).
pub const AERL: u8 = 3;
/// In-capsule data an I/O queue takes (IOCCSZ covers the 64-byte command and this): writes up
/// to 8 KiB need no R2T round trip, and DSM and Copy range lists always fit.
pub const IO_INCAPSULE: u32 = 8192;
/// ... and the admin queue (the host's admin capsules hold up to 8 KiB: Connect's 1024 bytes,
/// authentication messages).
pub const ADMIN_INCAPSULE: u32 = 8192;
/// Source ranges one Copy may name (MSRC is this minus one).
pub const COPY_RANGES: u16 = 128;

/// What one namespace (an export) looks like to hosts.
#[derive(Clone)]
pub struct Namespace {
    /// The export.
    pub export: Arc<Export>,
    /// Its size when the controller was created, in bytes.
    pub size: u64,
    /// log2 of the LBA size (the export's logical block size).
    pub lba_shift: u32,
    /// NGUID and UUID: unique per subsystem NQN and export (hosts drop namespaces whose ids
    /// repeat).
    pub nguid: [u8; 16],
    /// The UUID (a version 4 / variant 1 layout over the same hash).
    pub uuid: [u8; 16],
}

impl Namespace {
    /// The namespace an export becomes in its own subsystem `nqn` (the default one per export:
    /// its ids hash the NQN alone, as they always have).
    pub fn of(export: &Arc<Export>, nqn: &str) -> Namespace {
        Self::with_id(export, nqn.as_bytes())
    }

    /// The namespace an export becomes in a configured subsystem `nqn`: its ids hash the NQN
    /// and the export's name, so they are unique per namespace and stable across restarts
    /// (whatever its NSID).
    pub fn in_subsystem(export: &Arc<Export>, nqn: &str) -> Namespace {
        let key = format!("{nqn}\0{}", export.name);
        Self::with_id(export, key.as_bytes())
    }

    fn with_id(export: &Arc<Export>, key: &[u8]) -> Namespace {
        // The LBA is also the unit the executor admits I/O in (`Export::io_block`): a 512-byte
        // LBA on an export that takes pages would let the host send I/O that always fails.
        let lba_shift = export
            .io_block()
            .max(512)
            .next_power_of_two()
            .trailing_zeros();
        let d = ring::digest::digest(&ring::digest::SHA256, key);
        let mut nguid = [0u8; 16];
        nguid.copy_from_slice(&d.as_ref()[..16]);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&d.as_ref()[16..32]);
        uuid[6] = (uuid[6] & 0x0f) | 0x40;
        uuid[8] = (uuid[8] & 0x3f) | 0x80;
        Namespace {
            export: export.clone(),
            size: export.size(),
            lba_shift,
            nguid,
            uuid,
        }
    }

    /// Blocks in the namespace.
    pub fn blocks(&self) -> u64 {
        self.size >> self.lba_shift
    }
}

/// A controller's facts, fixed when its admin queue connects.
#[derive(Clone)]
pub struct Facts {
    /// Controller id.
    pub cntlid: u16,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Serial number (at most [`SERIAL_LEN`] ASCII bytes).
    pub serial: String,
    /// Model number (at most [`MODEL_LEN`] ASCII bytes).
    pub model: String,
    /// The namespaces, NSID ascending (none: the discovery controller).
    pub namespaces: Vec<NsFacts>,
    /// Largest data transfer, bytes (a power of two, at least 4 KiB).
    pub max_io: u32,
    /// Entries per I/O submission queue at most (MQES + 1).
    pub max_depth: u16,
}

/// One namespace of a controller.
#[derive(Clone)]
pub struct NsFacts {
    /// Its id.
    pub nsid: u32,
    /// The export behind it.
    pub ns: Namespace,
    /// What one Copy within it may do (none: Copy is refused on it).
    pub copy: CopyLimits,
    /// The blkwire session the controller holds on its export: once that session is closed
    /// (the namespace or export removed), the namespace is inactive on this controller.
    pub session: u32,
}

/// The serial number a subsystem reports unless configured: stable, from its NQN.
pub fn default_serial(nqn: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, nqn.as_bytes());
    d.as_ref()[..10]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn put_str(b: &mut [u8], at: usize, len: usize, s: &str) {
    let field = &mut b[at..at + len];
    field.fill(b' ');
    let n = s.len().min(len);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put_nqn(b: &mut [u8], at: usize, s: &str) {
    let n = s.len().min(NQN_FIELD - 1);
    b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// ONCS bits.
const ONCS_DSM: u16 = 1 << 2;
const ONCS_WRITE_ZEROES: u16 = 1 << 3;
const ONCS_COPY: u16 = 1 << 8;

impl Facts {
    /// MDTS: the largest transfer as a power of two of 4 KiB pages.
    pub fn mdts(&self) -> u8 {
        (self.max_io / 4096).max(1).trailing_zeros() as u8
    }

    /// A discovery controller (it has no namespaces; a controller of a subsystem has none
    /// either until its host authenticates).
    pub fn is_discovery(&self) -> bool {
        self.subnqn == DISCOVERY_NQN
    }

    /// Namespace `nsid`, if the controller has it.
    pub fn namespace(&self, nsid: u32) -> Option<&NsFacts> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }

    /// Controller-wide fields (ONCS) say what the controller supports: what one namespace can
    /// do at least. Each namespace refuses what it cannot do itself, and a read-only one says
    /// so (NSATTR write protected): said only when every namespace could, one read-only
    /// namespace took discard and Write Zeroes from the others in the host.
    fn any_writable(&self) -> bool {
        self.namespaces.iter().any(|n| !n.ns.export.read_only)
    }

    fn any_copies(&self) -> bool {
        self.namespaces
            .iter()
            .any(|n| !n.ns.export.read_only && n.copy.max_ranges > 0)
    }

    /// A volatile write cache: FLUSH means something (the medium is durable) on one of the
    /// namespaces at least (a Flush of the others succeeds at once).
    pub fn write_cache(&self) -> bool {
        self.namespaces
            .iter()
            .any(|n| n.ns.export.capabilities().flush.available())
    }

    /// NN: the highest NSID of the controller.
    fn nn(&self) -> u32 {
        self.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0)
    }

    /// Identify Controller (CNS 01h).
    pub fn identify_controller(&self) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        put_str(&mut b, 4, SERIAL_LEN, &self.serial);
        put_str(&mut b, 24, MODEL_LEN, &self.model);
        put_str(&mut b, 64, 8, env!("CARGO_PKG_VERSION"));
        b[72] = 6; // RAB
        b[77] = self.mdts();
        put16(&mut b, 78, self.cntlid);
        put32(&mut b, 80, VERSION);
        // CNTRLTYPE: 1 I/O controller, 2 discovery controller.
        b[111] = if self.is_discovery() { 2 } else { 1 };
        b[258] = 3; // ACL: four Aborts (0's based), all answered "not aborted".
        b[259] = AERL;
        b[260] = 1 << 1 | 1; // FRMW: one slot, read-only.
        b[261] = 0; // LPA
        b[262] = 0; // ELPE: one error log entry.
        put16(&mut b, 320, KAS);
        b[512] = 0x66; // SQES: 64-byte entries.
        b[513] = 0x44; // CQES: 16-byte entries.
        put16(&mut b, 514, self.max_depth);
        if !self.is_discovery() {
            // CMIC: the subsystem may have several ports and several controllers (one per
            // connect), so a host reaching it through two listeners gets two controllers of
            // one subsystem, which Linux merges into one multipath device (the namespaces
            // keep their NGUIDs). Without bit 1, Linux refuses the second controller.
            b[76] = 0b11;
            put32(&mut b, 516, self.nn()); // NN
            let mut oncs = 0;
            if self.any_writable() {
                oncs |= ONCS_DSM | ONCS_WRITE_ZEROES;
            }
            if self.any_copies() {
                oncs |= ONCS_COPY;
            }
            put16(&mut b, 520, oncs);
            // VWC; with several namespaces bits 2:1 = 10b: a Flush to NSID FFFFFFFFh is not
            // supported (the host flushes each namespace).
            let broadcast = if self.namespaces.len() > 1 { 0b100 } else { 0 };
            b[525] = self.write_cache() as u8 | broadcast;
            if self.any_copies() {
                put16(&mut b, 534, 1); // OCFS: source range format 0.
            }
            // MNAN.
            put32(&mut b, 540, self.nn());
            // OAES: Namespace Attribute Notices (a removed namespace is announced through an
            // Asynchronous Event Request and the Changed Namespace List log page).
            put32(&mut b, 92, 1 << 8);
        }
        // SGLS: SGLs without alignment, and the offset-based in-capsule data block.
        put32(&mut b, 536, 1 | 1 << 20);
        put_nqn(&mut b, 768, &self.subnqn);
        // IOCCSZ (16-byte units, the command included), IORCSZ, ICDOFF 0, FCATT 0 (dynamic
        // controllers), MSDBD 1.
        put32(&mut b, 1792, (64 + IO_INCAPSULE) / 16);
        put32(&mut b, 1796, 1);
        b[1803] = 1;
        // Power state 0: the only one.
        put16(&mut b, 2048, 0x9c4);
        b
    }

    /// Identify Namespace (CNS 00h) of `nsid`; all zero for an inactive id, as the spec asks.
    pub fn identify_namespace(ns: Option<&NsFacts>) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        let Some(NsFacts { ns, copy, .. }) = ns else {
            return b;
        };
        let blocks = ns.blocks();
        put64(&mut b, 0, blocks);
        put64(&mut b, 8, blocks);
        put64(&mut b, 16, blocks);
        // NSFEAT: thin provisioning (deallocate frees space where the backend can).
        b[24] = 1;
        b[25] = 0; // NLBAF: one format.
        b[26] = 0; // FLBAS
        b[30] = 1; // NMIC: may be attached to several controllers (CMIC).
        if copy.max_ranges > 0 {
            let max_range = (copy.max_range as u64 >> ns.lba_shift).min(u16::MAX as u64);
            let max_total = (copy.max_bytes as u64 >> ns.lba_shift).min(u32::MAX as u64);
            put16(&mut b, 74, max_range as u16); // MSSRL
            put32(&mut b, 76, max_total as u32); // MCL
            b[80] = (copy.max_ranges.min(COPY_RANGES) - 1) as u8; // MSRC (0's based)
        }
        b[99] = ns.export.read_only as u8; // NSATTR: write protected.
        b[104..120].copy_from_slice(&ns.nguid);
        // LBA format 0: no metadata, the export's block size.
        put32(&mut b, 128, ns.lba_shift << 16);
        b
    }

    /// Active Namespace ID list (CNS 02h): the ids of `live` above `after`, ascending.
    pub fn active_namespaces(after: u32, live: impl Iterator<Item = u32>) -> Vec<u8> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        let mut ids: Vec<u32> = live.filter(|&n| n > after).collect();
        ids.sort_unstable();
        for (i, id) in ids.iter().take(IDENTIFY_LEN / 4).enumerate() {
            put32(&mut b, i * 4, *id);
        }
        b
    }

    /// Namespace Identification Descriptor list (CNS 03h): NGUID, UUID and the command set.
    pub fn namespace_descriptors(ns: &NsFacts) -> Vec<u8> {
        let ns = &ns.ns;
        let mut b = vec![0u8; IDENTIFY_LEN];
        b[0] = 2; // NIDT NGUID
        b[1] = 16;
        b[4..20].copy_from_slice(&ns.nguid);
        b[20] = 3; // NIDT UUID
        b[21] = 16;
        b[24..40].copy_from_slice(&ns.uuid);
        b[40] = 4; // NIDT CSI
        b[41] = 1;
        b[44] = 0; // NVM command set
        b
    }

    /// The NVM command set's Identify Controller structure (CNS 06h, CSI 0): one DSM range
    /// per command (DMRL), of at most 1 GiB (DMRSL), so each deallocation is one backend trim.
    pub fn identify_nvm_controller(&self) -> Option<Vec<u8>> {
        // In blocks of the largest LBA size: at most 1 GiB in every namespace.
        let shift = self.namespaces.iter().map(|n| n.ns.lba_shift).max()?;
        let mut b = vec![0u8; IDENTIFY_LEN];
        b[3] = 1; // DMRL
        put32(&mut b, 4, ((1u64 << 30) >> shift) as u32); // DMRSL
        put64(&mut b, 8, (1u64 << 30) >> shift); // DMSL
        Some(b)
    }

    /// CAP: MQES, contiguous queues required, 7.5 s timeout, the NVM command set, 4 KiB pages.
    pub fn cap(&self) -> u64 {
        let mqes = self.max_depth.saturating_sub(1) as u64;
        mqes | 1 << 16 | 15 << 24 | 1 << 37
    }
}

/// One entry of the discovery log page (NVMe-oF 1.1 §5.3): a subsystem at a TCP port.
pub struct DiscoveryEntry {
    /// The subsystem's NQN.
    pub subnqn: String,
    /// A discovery subsystem (the one answering) rather than an NVM subsystem.
    pub discovery: bool,
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Port id (one per listener).
    pub port_id: u16,
}

/// One entry of the discovery log page: 1024 bytes.
fn discovery_entry(e: &DiscoveryEntry, b: &mut [u8; 1024]) {
    b.fill(0);
    b[0] = 3; // TRTYPE TCP
    b[1] = if e.addr.is_ipv4() { 1 } else { 2 }; // ADRFAM
    b[2] = if e.discovery { 3 } else { 2 }; // SUBTYPE
    b[3] = 0b10 | 1 << 2; // TREQ: no secure channel required, SQ flow control may be disabled
    put16(b, 4, e.port_id);
    put16(b, 6, 0xffff); // CNTLID: dynamic
    put16(b, 8, 32); // ASQSZ
    let port = e.addr.port().to_string();
    b[32..32 + port.len()].copy_from_slice(port.as_bytes());
    put_nqn(b, 256, &e.subnqn);
    let ip = e.addr.ip().to_string();
    b[512..512 + ip.len()].copy_from_slice(ip.as_bytes());
    // TSAS for TCP: SECTYPE 0, no security.
}

/// Bytes `offset..offset + len` of the discovery log page (LID 70h: a 1024-byte header, then
/// 1024 bytes per entry; past its end, zeros), encoding only the entries that part covers: a
/// host may read 4 bytes of a page of thousands of entries in a loop. Its generation counter
/// is a hash of every entry's fields (never 0), so it changes whenever what the page lists
/// does.
pub fn discovery_log(entries: &[DiscoveryEntry], offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut copy = |at: u64, bytes: &[u8]| {
        let end = at + bytes.len() as u64;
        // (A host's offset may be anything up to 2^64 - 4.)
        let (from, to) = (at.max(offset), end.min(offset.saturating_add(len as u64)));
        if from < to {
            let (src, dst) = ((from - at) as usize, (from - offset) as usize);
            out[dst..dst + (to - from) as usize]
                .copy_from_slice(&bytes[src..src + (to - from) as usize]);
        }
    };
    let fnv = |h: u64, bytes: &[u8]| {
        bytes
            .iter()
            .fold(h, |h, &c| (h ^ c as u64).wrapping_mul(0x100_0000_01b3))
    };
    let mut generation = 0xcbf2_9ce4_8422_2325u64;
    let mut b = [0u8; 1024];
    let end = offset.saturating_add(len as u64);
    for (i, e) in entries.iter().enumerate() {
        let addr = e.addr.to_string();
        generation = fnv(generation, e.subnqn.as_bytes());
        generation = fnv(generation, &[0, e.discovery as u8]);
        generation = fnv(generation, addr.as_bytes());
        generation = fnv(generation, &e.port_id.to_le_bytes());
        let at = 1024 * (i as u64 + 1);
        if at < end && at + 1024 > offset {
            discovery_entry(e, &mut b);
            copy(at, &b);
        }
    }
    let mut header = [0u8; 16];
    put64(&mut header, 0, generation | 1);
    put64(&mut header, 8, entries.len() as u64);
    copy(0, &header);
    out
}

/// A C-string field of a Connect's data (NQNs): up to its first NUL, which must be there.
pub fn nqn_field(b: &[u8]) -> Option<&str> {
    let end = b.iter().position(|&c| c == 0)?;
    std::str::from_utf8(&b[..end])
        .ok()
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_backend::ExportSpec;

    /// Out of space inside the namespace is Capacity Exceeded (Linux: ENOSPC), not LBA Out of
    /// Range, which only a range past the namespace is.
    #[test]
    fn no_space_is_capacity_exceeded() {
        assert_eq!(
            status_of(Status::NoSpace, false, true),
            sc::CAP_EXCEEDED | sc::DNR
        );
        assert_eq!(
            status_of(Status::OutOfRange, false, true),
            sc::LBA_RANGE | sc::DNR
        );
    }

    const COPY: CopyLimits = CopyLimits {
        max_bytes: 64 << 20,
        max_range: 64 << 20,
        max_ranges: 4,
    };

    fn export(spec: &str) -> Arc<Export> {
        Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap())
    }

    fn facts(spec: &str) -> Facts {
        let e = export(spec);
        let nqn = format!("{NQN_PREFIX}{}", e.name);
        Facts {
            cntlid: 7,
            namespaces: vec![NsFacts {
                nsid: 1,
                ns: Namespace::of(&e, &nqn),
                copy: COPY,
                session: 1,
            }],
            serial: default_serial(&nqn),
            model: DEFAULT_MODEL.into(),
            subnqn: nqn,
            max_io: 1 << 20,
            max_depth: 128,
        }
    }

    #[test]
    fn the_lba_is_the_unit_the_export_takes_io_in() {
        let mem = export("m=mem:1M").backend().clone();
        let e = Arc::new(Export::new(
            "d",
            Arc::new(blkwire_backend::testing::Direct512(mem)),
            false,
        ));
        let ns = Namespace::of(&e, "nqn.2026-11.test:d");
        assert_eq!(1u64 << ns.lba_shift, e.alignment(), "LBA size");
        assert_eq!(ns.blocks(), (1 << 20) / 4096);
        let id = Facts::identify_namespace(Some(&NsFacts {
            nsid: 1,
            ns,
            copy: COPY,
            session: 1,
        }));
        assert_eq!(id[130], 12, "LBADS of LBA format 0");
        // Without an alignment, the logical block size is the LBA.
        assert_eq!(Namespace::of(&export("m=mem:1M"), "n").lba_shift, 9);
    }

    /// A subsystem of two namespaces (NSIDs 1 and 3) whose exports differ: the controller says
    /// what one can do at least, each namespace what it can do.
    #[test]
    fn a_subsystem_with_two_namespaces() {
        let nqn = "nqn.2026-11.test:two";
        let (a, b) = (export("a=mem:1M"), export("b=mem:2M,ro"));
        let f = Facts {
            cntlid: 3,
            namespaces: vec![
                NsFacts {
                    nsid: 1,
                    ns: Namespace::in_subsystem(&a, nqn),
                    copy: COPY,
                    session: 1,
                },
                NsFacts {
                    nsid: 3,
                    ns: Namespace::in_subsystem(&b, nqn),
                    copy: CopyLimits::default(),
                    session: 2,
                },
            ],
            serial: "SN-1".into(),
            model: "Model X".into(),
            subnqn: nqn.into(),
            max_io: 1 << 20,
            max_depth: 128,
        };
        let c = f.identify_controller();
        assert_eq!(&c[4..24], b"SN-1                ");
        assert_eq!(&c[24..31], b"Model X");
        assert_eq!(u32::from_le_bytes(c[516..520].try_into().unwrap()), 3, "NN");
        assert_eq!(
            u32::from_le_bytes(c[540..544].try_into().unwrap()),
            3,
            "MNAN"
        );
        // ONCS: what one namespace can do (a can all three); b says it is read-only itself.
        assert_eq!(u16::from_le_bytes([c[520], c[521]]), 0x10c, "ONCS");
        assert_eq!(c[525] & 0b110, 0b100, "no broadcast flush");
        let l = Facts::active_namespaces(0, f.namespaces.iter().map(|n| n.nsid));
        assert_eq!(&l[..12], &[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        let l = Facts::active_namespaces(1, f.namespaces.iter().map(|n| n.nsid));
        assert_eq!(&l[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
        let ia = Facts::identify_namespace(f.namespace(1));
        let ib = Facts::identify_namespace(f.namespace(3));
        assert_eq!(
            u64::from_le_bytes(ia[0..8].try_into().unwrap()) << (ia[130]),
            1 << 20
        );
        assert_eq!(
            u64::from_le_bytes(ib[0..8].try_into().unwrap()) << (ib[130]),
            2 << 20
        );
        assert_eq!((ia[99], ib[99]), (0, 1), "NSATTR");
        assert_eq!((ia[80], ib[80]), (3, 0), "only a copies");
        assert!(Facts::identify_namespace(f.namespace(2))
            .iter()
            .all(|&x| x == 0));
        let (da, db) = (
            Facts::namespace_descriptors(&f.namespaces[0]),
            Facts::namespace_descriptors(&f.namespaces[1]),
        );
        assert_ne!(da[4..20], db[4..20], "NGUIDs differ");
        assert_ne!(da[24..40], db[24..40], "UUIDs differ");
        assert_eq!(
            Namespace::in_subsystem(&a, nqn).nguid,
            f.namespaces[0].ns.nguid,
            "stable"
        );
    }

    #[test]
    fn identify_controller_passes_the_checks_linux_applies() {
        let f = facts("d=mem:16M");
        let b = f.identify_controller();
        assert_eq!(u16::from_le_bytes([b[78], b[79]]), 7, "cntlid");
        assert_ne!(u16::from_le_bytes([b[320], b[321]]), 0, "KAS");
        let ioccsz = u32::from_le_bytes(b[1792..1796].try_into().unwrap());
        assert!(ioccsz >= 4 && ioccsz * 16 - 64 >= 1024, "IOCCSZ {ioccsz}");
        assert_eq!(u32::from_le_bytes(b[1796..1800].try_into().unwrap()), 1);
        assert_eq!(u16::from_le_bytes([b[1800], b[1801]]), 0, "ICDOFF");
        assert_ne!(u16::from_le_bytes([b[514], b[515]]), 0, "MAXCMD");
        assert_eq!(b[536] & 1, 1, "SGLS");
        assert_eq!(b[77], 8, "1 MiB is 2^8 pages");
        assert_eq!(nqn_field(&b[768..1024]), Some("nqn.2026-11.io.blkwire:d"));
        let oncs = u16::from_le_bytes([b[520], b[521]]);
        assert_eq!(oncs & (ONCS_DSM | ONCS_WRITE_ZEROES | ONCS_COPY), 0x10c);
    }

    #[test]
    fn namespaces_of_two_subsystems_have_different_ids() {
        let (a, b) = (facts("a=mem:1M"), facts("b=mem:1M"));
        let (na, nb) = (&a.namespaces[0].ns, &b.namespaces[0].ns);
        assert_ne!(na.nguid, nb.nguid);
        assert_ne!(na.uuid, nb.uuid);
        assert_eq!(na.uuid[6] >> 4, 4, "version 4 layout");
    }

    #[test]
    fn identify_namespace_reports_size_and_block_size() {
        let f = facts("d=mem:16M");
        let b = Facts::identify_namespace(f.namespace(1));
        let shift = f.namespaces[0].ns.lba_shift;
        assert_eq!(
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            (16 << 20) >> shift
        );
        assert_eq!(b[130] as u32, shift);
        assert_eq!(b[80], 3, "MSRC is 0's based");
        assert!(Facts::identify_namespace(f.namespace(2))
            .iter()
            .all(|&x| x == 0));
    }

    #[test]
    fn read_only_exports_offer_no_write_commands_and_say_so() {
        let f = facts("d=mem:1M,ro");
        let b = f.identify_controller();
        assert_eq!(u16::from_le_bytes([b[520], b[521]]), 0);
        assert_eq!(Facts::identify_namespace(f.namespace(1))[99], 1);
    }

    #[test]
    fn discovery_log_lists_each_entry() {
        let e = [DiscoveryEntry {
            subnqn: "nqn.x:y".into(),
            discovery: false,
            addr: "127.0.0.1:4420".parse().unwrap(),
            port_id: 1,
        }];
        let b = discovery_log(&e, 0, 2048);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 1);
        assert_eq!(&b[1024 + 32..1024 + 36], b"4420");
        assert_eq!(nqn_field(&b[1024 + 256..1024 + 512]), Some("nqn.x:y"));
        assert_eq!(nqn_field(&b[1024 + 512..1024 + 768]), Some("127.0.0.1"));
    }

    /// A part of the page is that part of the whole page, whatever its offset and length (past
    /// the end: zeros); the generation follows the entries.
    #[test]
    fn a_part_of_the_discovery_log_is_that_part_of_the_page() {
        let e: Vec<DiscoveryEntry> = (0..5)
            .map(|i| DiscoveryEntry {
                subnqn: format!("nqn.x:{i}"),
                discovery: i == 0,
                addr: format!("10.0.0.{i}:4420").parse().unwrap(),
                port_id: i,
            })
            .collect();
        let whole = discovery_log(&e, 0, 1024 * 6 + 4096);
        assert!(
            whole[1024 * 6..].iter().all(|&b| b == 0),
            "past the end: zeros"
        );
        assert_eq!(u64::from_le_bytes(whole[8..16].try_into().unwrap()), 5);
        assert_eq!(
            discovery_log(&e, u64::MAX - 3, 8),
            [0; 8],
            "far past the end"
        );
        for (offset, len) in [
            (0, 4),
            (4, 12),
            (1020, 8),
            (3000, 2048),
            (6140, 100),
            (9000, 8),
        ] {
            assert_eq!(
                discovery_log(&e, offset, len),
                whole[offset as usize..offset as usize + len],
                "{offset}+{len}"
            );
        }
        let generation = |e: &[DiscoveryEntry]| discovery_log(e, 0, 8);
        assert_ne!(generation(&e), generation(&e[..4]), "an entry fewer");
        assert_ne!(generation(&e), [0; 8]);
    }
}
