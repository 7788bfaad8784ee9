//! iSCSI full feature phase (RFC 7143 §4.2, §11): one connection of a one-connection session
//! (MaxConnections=1, ErrorRecoveryLevel=0) after the Login Phase on the handshake thread
//! (`crate::iscsi`). Each LUN of the target is one of the connection's targets (`Req::target`,
//! its own session and executor): the LUN field of a SCSI Command selects it (SAM-5 peripheral
//! or flat space addressing), and a LUN the connection does not have, or one removed since
//! ([`StreamFrontend::fenced`]), is answered as an absent logical unit (INQUIRY peripheral
//! qualifier 011b, LOGICAL UNIT NOT SUPPORTED). REPORT LUNS lists the connection's LUNs; after
//! one was removed the others report REPORTED LUNS DATA HAS CHANGED once (SPC-4 unit
//! attention, cleared by REPORT LUNS).
//!
//! - SCSI Command: the CDB is decoded by `blkwire_wire::scsi`. READ/WRITE become reactor
//!   requests (the ITT and residual in the cookie); WRITE data comes as immediate data, then
//!   under InitialR2T=No as unsolicited Data-Out (TTT 0xffffffff) up to min(FirstBurstLength,
//!   EDTL) (§13.10; the write is marked `data_follows` so the reactor gives it its buffer when
//!   it takes it), and the rest is asked for with R2Ts (TTT = the slot) of at most
//!   MaxBurstLength each, one outstanding at a time (MaxOutstandingR2T=1), the first once the
//!   unsolicited data is in; Data-Out PDUs become [`Decoded::Data`]. Unsolicited data of a
//!   command answered without a slot is checked and dropped (`drains`); Data-Out answering
//!   an R2T of a task that task management gave up is dropped to the end of its sequence
//!   (`given_up`).
//!   READ data goes out as one Data-In PDU with the status in it when it fits the initiator's
//!   MaxRecvDataSegmentLength, otherwise as a Data-In sequence. Everything the target answers
//!   itself (INQUIRY, READ CAPACITY, MODE SENSE, REPORT LUNS, refusals) is answered in
//!   `decode` (Data-In with status, or a SCSI Response with sense data).
//! - UNMAP, WRITE SAME, EXTENDED COPY, VERIFY and COMPARE AND WRITE: the parameter list
//!   (immediate and unsolicited data, or collected here with R2Ts on a TTT above the slots)
//!   turns into parts (Trim, WriteZeroes, Write, Copy, Read) that the frontend hands to the
//!   reactor one after another (`queued`), answering the command when the last is done.
//! - PERSISTENT RESERVE IN/OUT act on the export's shared state (`crate::reservations`); an
//!   OUT that changes what the conflict checks see becomes a [`Kind::Broadcast`] request,
//!   answered once every reactor installed the change. Every command is first checked against
//!   what this nexus may do (`Pr::access`): RESERVATION CONFLICT when the reservation refuses it.
//! - CmdSN: non-immediate commands, NOP-Outs, task management and Text must carry ExpCmdSN,
//!   within the largest MaxCmdSN sent (an initiator keeps the largest it was given); others
//!   are dropped silently (§4.2.2.1). A Logout is taken whatever its CmdSN (the connection
//!   ends). MaxCmdSN = ExpCmdSN + free task places − 1 (a command collecting its parameter list
//!   or between its parts holds one: its next part needs a slot), so the initiator does not have
//!   more commands in flight than the connection has slots, but for immediate commands: they
//!   take a place without a CmdSN and shrink a window the initiator already has (a command that
//!   then finds no slot waits, untaken, for one).
//! - NOP-Out is answered with NOP-In, Logout with Logout Response, Text with an empty Text
//!   Response. Task management (`tmf`) gives up the tasks of its scope that wait: writes for
//!   their data (which an initiator that aborts them never sends), and any command parked in
//!   the reactor for memory ([`StreamFrontend::parked`]): never run nor answered. A compound
//!   command runs no more parts and answers no one; while a part of it still runs, the
//!   commands that would make parts of their own wait for that part's answer (`Hold`), the
//!   others are decoded. What of its scope runs at a backend cannot be stopped: it is
//!   answered first, and the function's response waits for it (`fence`; RFC 7143 §4.2.3.3)
//!   and goes out right behind its answer, so no response of an affected task ever follows
//!   the function's. Meanwhile the rest is decoded (NOP-Outs answered, Data-Out and commands
//!   taken); only another function or a Logout waits behind it. ABORT TASK answers "task does
//!   not exist" only for a task already answered.
//! - A PDU that breaks the protocol is answered with Reject (its header as data) where the
//!   stream is still in step, and the connection is closed where it is not (header digest,
//!   data digest of Data-Out, oversized data segment).

use std::borrow::Cow;
use std::collections::VecDeque;

use blkwire_backend::CopyRange;
use blkwire_backend::{BlockOp, Export, IoFlags};
use blkwire_wire::iscsi::{
    self, flag, op, pdu_len, reject, Bhs, Digests, Progress, BHS_LEN, DIGEST_LEN, RESERVED_TAG,
};
use blkwire_wire::scsi::pr::{self, Access, Nexus};
use blkwire_wire::scsi::{self, xcopy, Command, LunInfo, Sense};
use blkwire_wire::{CopyDescriptor, CopyLimits, Status};

use super::{Decoded, Kind, Piece, ReadFraming, Req, StreamFrontend};
use crate::budget::Reservation;
use crate::iscsi::Negotiated;
use crate::reservations::{Lu as PrLu, Update};

/// The smallest Data-In data segment sent from the read's buffer rather than copied
/// (`StreamFrontend::encode_read_framing`).
const MIN_PIECE: usize = 16 << 10;

/// The most a SCSI Response PDU takes: its header and header digest, sense data (its length,
/// then fixed or descriptor format, under 64 bytes as blkwire writes it), padding and data
/// digest, with room to spare.
const RESPONSE_MAX: usize = 256;

/// The most data a Text Response in the full feature phase carries before the initiator's
/// MaxRecvDataSegmentLength cuts it: a `key=NotUnderstood` pair for each key of the request,
/// of which `iscsi::pairs` reads at most `MAX_PAIRS`, each at most `MAX_KEY_LEN` long (about
/// 20 KB).
const TEXT_ANSWER_MAX: usize = iscsi::MAX_PAIRS * (iscsi::MAX_KEY_LEN + "=NotUnderstood\0".len());

/// SCSI status GOOD.
const GOOD: u8 = 0x00;
/// SCSI status CHECK CONDITION.
const CHECK_CONDITION: u8 = 0x02;
/// SCSI status BUSY (SAM-5): the initiator issues the command again later.
const BUSY: u8 = 0x08;
/// SCSI status RESERVATION CONFLICT (SAM-5).
const RESERVATION_CONFLICT: u8 = 0x18;
/// RELATIVE TARGET PORT IDENTIFIER of the one target port (the portal group, tag 1).
const TARGET_PORT: u16 = 1;
/// Most bytes of a parameter list collected in the frontend (UNMAP, WRITE SAME's block).
const MAX_PARAMS: u32 = 1 << 20;
/// What a connection sets aside in the memory budget at login for the parameter list it
/// collects ([`IscsiSetup::list_room`]): one list at a time, held in a buffer of exactly its
/// length, or what its command keeps of it while it runs (`compare`, `pattern`: the list
/// itself, or made from it within the one decode that drops it). The list waits for its data
/// as long as the initiator likes, so its room is reserved rather than taken from the
/// connection's buffers: it never waits for memory, nor does anything decoded behind it wait
/// for the list's.
pub const LIST_ROOM: usize = MAX_PARAMS as usize;
/// TTT of the R2T that collects a parameter list (above every slot index).
const PARAM_TTT: u32 = 0x8000_0000;

/// What a connection is set up with after login.
pub struct IscsiSetup {
    /// The negotiated operational parameters.
    pub neg: Negotiated,
    /// The StatSN of the next response.
    pub statsn: u32,
    /// The CmdSN expected next.
    pub expcmdsn: u32,
    /// Commands in flight at most (the connection's slots).
    pub depth: u16,
    /// The largest MaxCmdSN the login responses gave, if any: the window starts at least
    /// there (an initiator keeps the largest it was given), even were it past what `depth`
    /// allows now.
    pub granted: Option<u32>,
    /// The LUNs, in the order of the connection's targets.
    pub luns: Vec<SetupLun>,
    /// The target's name.
    pub target: String,
    /// The initiator's name.
    pub initiator: String,
    /// The initiator's session id.
    pub isid: [u8; 6],
    /// Largest transfer.
    pub max_io: u32,
    /// The exports this initiator may open (EXTENDED COPY sources).
    pub peers: Vec<Peer>,
    /// [`LIST_ROOM`] bytes of the target's memory budget, held for the connection's life.
    pub list_room: Reservation,
}

/// An export this initiator may open, as an EXTENDED COPY source.
pub struct Peer {
    /// Its name, by which a COPY part names its source.
    pub name: String,
    /// It as a LUN (its NAA is how a parameter list names it).
    pub info: LunInfo,
    /// Its persistent reservations: they bind what EXTENDED COPY reads of it as they bind a
    /// READ of it from the same nexus.
    pub reservations: std::sync::Arc<PrLu>,
    /// The export those reservations are of: a copy reads from it, never from another export
    /// added under its name since (whose reservations were not checked).
    pub export: std::sync::Weak<Export>,
}

/// The persistent reservations of one LU the connection reaches (`crate::reservations`).
struct Pr {
    lu: std::sync::Arc<PrLu>,
    /// This session's I_T nexus (initiator port name with the ISID, SPC-4 7.6.4.6).
    nexus: Nexus,
    /// The version of the snapshot `access` was worked out from.
    version: u64,
    /// What this nexus may do: every command is checked against it before it runs.
    access: Access,
    /// The update of the PERSISTENT RESERVE OUT the reactor takes next (`take_broadcast`).
    outgoing: Option<std::sync::Arc<Update>>,
}

impl Pr {
    /// Installs `u` if it is this LU's and newer than what the connection has.
    fn install(&mut self, u: &Update) {
        if u.lu != self.lu.id() || u.version <= self.version {
            return;
        }
        self.version = u.version;
        self.access = u
            .snapshot
            .as_ref()
            .map_or(Access::Full, |s| s.access(&self.nexus));
    }
}

/// One LUN of a connection.
pub struct SetupLun {
    /// Its number.
    pub lun: u64,
    /// The export behind it.
    pub export: std::sync::Arc<Export>,
    /// The export's size its session was admitted with (`Admitted::size`): the LU's size.
    pub size: u64,
    /// What one copy into it may do (its session's grant).
    pub copy: CopyLimits,
    /// The persistent reservations of that export (`crate::reservations`).
    pub reservations: std::sync::Arc<PrLu>,
}

/// A LUN as the frontend serves it.
struct Lu {
    info: LunInfo,
    shift: u32,
    flush: bool,
    copy: CopyLimits,
    /// Removed while the connection lives: answered as an absent logical unit.
    gone: bool,
    /// REPORTED LUNS DATA HAS CHANGED is to be reported (once) to the next command.
    attention: bool,
}

/// How a reply is built, kept in the cookie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Reply {
    Plain = 0,
    Read = 1,
    Write = 2,
    Flush = 3,
    Logout = 4,
    LbaStatus = 5,
    /// One part of a command answered after its last part (UNMAP, WRITE SAME).
    Part = 6,
}

/// The cookie: ITT (bits 0–31), residual count (32–63), residual kind (64–65: 1 underflow,
/// 2 overflow), reply kind (66–71), unsolicited Data-Out follows (72), bytes of READ data to
/// send or GET LBA STATUS allocation length (96–127).
fn cookie(itt: u32, residual: Residual, reply: Reply, extra: u32) -> u128 {
    let (kind, count) = match residual {
        Residual::None => (0u128, 0u32),
        Residual::Under(n) => (1, n),
        Residual::Over(n) => (2, n),
    };
    itt as u128 | (count as u128) << 32 | kind << 64 | (reply as u128) << 66 | (extra as u128) << 96
}

/// Bit 72 of the cookie: the WRITE's unsolicited Data-Out follows (InitialR2T=No).
const FOLLOWS: u128 = 1 << 72;

fn follows_of(req: &Req) -> bool {
    req.cookie & FOLLOWS != 0
}

fn itt_of(req: &Req) -> u32 {
    req.cookie as u32
}

fn residual_of(req: &Req) -> Residual {
    let n = (req.cookie >> 32) as u32;
    match (req.cookie >> 64) & 3 {
        1 => Residual::Under(n),
        2 => Residual::Over(n),
        _ => Residual::None,
    }
}

fn reply_of(req: &Req) -> Reply {
    match (req.cookie >> 66) & 0x3f {
        1 => Reply::Read,
        2 => Reply::Write,
        3 => Reply::Flush,
        4 => Reply::Logout,
        5 => Reply::LbaStatus,
        6 => Reply::Part,
        _ => Reply::Plain,
    }
}

fn extra_of(req: &Req) -> u32 {
    (req.cookie >> 96) as u32
}

/// A residual (§11.4.5): what the initiator expected minus what the command moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Residual {
    None,
    Under(u32),
    Over(u32),
}

impl Residual {
    fn of(edtl: u32, moved: u32) -> Residual {
        use std::cmp::Ordering::*;
        match edtl.cmp(&moved) {
            Equal => Residual::None,
            Greater => Residual::Under(edtl - moved),
            Less => Residual::Over(moved - edtl),
        }
    }
    fn flags(self) -> u8 {
        match self {
            Residual::None => 0,
            Residual::Under(_) => flag::UNDERFLOW,
            Residual::Over(_) => flag::OVERFLOW,
        }
    }
    fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Under(n) | Residual::Over(n) => n,
        }
    }
}

/// Where one Data-Out sequence of a task stands (§4.2.5.2): the burst one R2T asked for, or the
/// unsolicited data that follows a command under InitialR2T=No (TTT 0xffffffff), which is as
/// if an R2T had asked for min(FirstBurstLength, EDTL) minus the immediate data (§13.10).
#[derive(Clone, Copy, Debug, Default)]
struct Seq {
    /// The TTT its Data-Out PDUs carry (RESERVED_TAG: unsolicited).
    ttt: u32,
    /// The offset the next Data-Out starts at (DataPDUInOrder=Yes, §13.18).
    next: u32,
    /// The DataSN the next Data-Out carries (§11.7.5: each sequence counts from 0).
    datasn: u32,
    /// Where the sequence ends.
    end: u32,
}

impl Seq {
    fn unsolicited(next: u32, end: u32) -> Seq {
        Seq {
            ttt: RESERVED_TAG,
            next,
            datasn: 0,
            end,
        }
    }

    /// Takes a Data-Out of `n` bytes at `offset` (F set: `fin`) into the sequence: true when it
    /// ends it. Anything out of step is an error (ERL 0 cannot ask for it again, §7.8).
    fn take(&mut self, datasn: u32, offset: u32, n: usize, fin: bool) -> Result<bool, String> {
        let end = offset as u64 + n as u64;
        if offset != self.next || end > self.end as u64 {
            return Err(format!(
                "iSCSI: Data-Out at {offset}+{n} where the sequence wants {} up to {}",
                self.next, self.end
            ));
        }
        if datasn != self.datasn {
            return Err(format!(
                "iSCSI: Data-Out DataSN {datasn} where {} was due",
                self.datasn
            ));
        }
        if fin && end != self.end as u64 {
            return Err("iSCSI: Data-Out sequence ended before its burst".into());
        }
        self.next = end as u32;
        // Empty Data-Out PDUs can repeat an offset without end: the count wraps (serial).
        self.datasn = self.datasn.wrapping_add(1);
        // The burst's last byte ends it, F or not (§11.7.1 has F set there): a task whose
        // data is all in must not look as if it still waited for some (task management
        // would report it aborted while it runs).
        Ok(fin || end == self.end as u64)
    }
}

/// A WRITE waiting in its slot for its data (unsolicited, then solicited), or a request
/// waiting in the reactor for memory (`parked`): a write before the memory to ask for its
/// data, anything else (a READ, GET LBA STATUS, a part of a compound command) before it runs.
#[derive(Clone, Copy, Debug, Default)]
struct Task {
    itt: u32,
    /// The connection target (LUN) it is for.
    target: u8,
    /// The R2TSN of the next R2T.
    r2tsn: u32,
    /// The sequence in progress: the unsolicited data, or the outstanding R2T's burst.
    seq: Seq,
    /// End of the data the write needs.
    end: u32,
    active: bool,
    /// Waiting in the reactor for memory before its first R2T (or, with all its data, before
    /// it runs; or, not a write, before it runs): no Data-Out is due, but task management
    /// finds and aborts it.
    parked: bool,
    /// Aborted by task management: Data-Out already on its way is dropped.
    aborted: bool,
}

/// A command whose parameter list is being collected by the frontend.
struct Params {
    itt: u32,
    /// The connection target (LUN) it is for.
    target: usize,
    cdb: [u8; 16],
    edtl: u32,
    /// The bytes collected: the list's length, at most EDTL.
    want: u32,
    /// The list's length as its CDB gives it: more than EDTL is an overflow (the residual).
    listed: u32,
    data: Vec<u8>,
    r2tsn: u32,
    seq: Seq,
}

/// A command split into parts (UNMAP ranges, WRITE SAME): answered when the last part is.
#[derive(Clone, Debug)]
struct Compound {
    itt: u32,
    /// The connection target (LUN) its parts are for.
    target: u8,
    residual: Residual,
    parts_left: u32,
    /// The first error, turned into sense when answering.
    failed: Option<(Status, bool)>,
    /// EXTENDED COPY: the plan (list id and usage) and the bytes copied so far.
    copy: Option<(xcopy::Plan, u64)>,
}

/// What `decode` holds back while a part is with the reactor (`Iscsi::part_running`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Nothing.
    Off,
    /// The read of a COMPARE AND WRITE: no later command of this connection is decoded until
    /// the compare is done and its write handed out (Data-Out and NOP-Out, which start no
    /// task, are, and Logout, which ends the command or waits for it).
    Compare,
    /// The running part of a compound command task management gave up: its answer is still to
    /// come (`part_done`) and answers no one. Until it has, a command that would hand out parts
    /// of its own (`makes_parts`) is not decoded, or it would take that answer for its own first
    /// part's; every other command is.
    GivenUp,
}

/// The most one part of UNMAP or WRITE SAME that writes zeroes (a Trim, a WriteZeroes) covers:
/// a request's length is a u32, and this is a whole number of blocks of any size.
const ZERO_PART: u32 = 1 << 30;

/// Whether `a` comes after `b` in serial number arithmetic (RFC 1982 over 32 bits, as iSCSI
/// compares CmdSN and MaxCmdSN, RFC 7143 §4.2.2.1).
pub(crate) fn serial_after(a: u32, b: u32) -> bool {
    a != b && a.wrapping_sub(b) < 1 << 31
}

/// Parts of a compound command not handed out yet: `len` bytes from `offset`, in requests of at
/// most `per` bytes made one at a time as the one before is answered. A WRITE SAME of 4 GiB
/// with a pattern is one run of 4,096 parts, never 4,096 queued requests (about 450 KiB a
/// connection would keep, outside the memory budget).
struct Run {
    kind: Kind,
    offset: u64,
    len: u64,
    per: u32,
    flags: IoFlags,
    /// A COPY part's descriptor (a run of one part).
    desc: Option<CopyDescriptor>,
}

impl Run {
    /// `len` bytes from `offset` in parts of at most `per` bytes (`offset`, `len` and `per`
    /// whole blocks); none for no bytes.
    fn of(kind: Kind, offset: u64, len: u64, per: u32, flags: IoFlags) -> Option<Run> {
        (len > 0).then_some(Run {
            kind,
            offset,
            len,
            per: per.max(1),
            flags,
            desc: None,
        })
    }

    /// One part of `len` bytes (none for no bytes).
    fn one(kind: Kind, offset: u64, len: u32, flags: IoFlags) -> Option<Run> {
        Run::of(kind, offset, len.into(), len, flags)
    }

    fn parts(&self) -> u64 {
        self.len.div_ceil(u64::from(self.per))
    }

    /// Its next part, of compound command `c`, and the rest.
    fn take(&mut self, c: &Compound) -> (Req, Option<CopyDescriptor>) {
        let length = self.len.min(u64::from(self.per)) as u32;
        let req = Req {
            kind: self.kind,
            offset: self.offset,
            length,
            flags: self.flags,
            slot: None,
            target: c.target,
            cookie: cookie(c.itt, Residual::None, Reply::Part, 0),
        };
        self.offset += u64::from(length);
        self.len -= u64::from(length);
        (req, self.desc.take())
    }
}

/// Whether `cdb` is of a command that is split into parts (`Iscsi::run_params`), at once or
/// from the parameter list it collects: UNMAP, WRITE SAME, EXTENDED COPY, VERIFY with BYTCHK,
/// COMPARE AND WRITE. Told by the operation code (and VERIFY's BYTCHK field) alone: one the
/// SCSI layer then refuses, or that has nothing to do, counts too (it only waits). PERSISTENT
/// RESERVE OUT collects a parameter list too, but makes no parts.
fn makes_parts(cdb: &[u8]) -> bool {
    match cdb.first() {
        Some(
            &(scsi::op::UNMAP
            | scsi::op::WRITE_SAME_10
            | scsi::op::WRITE_SAME_16
            | scsi::op::EXTENDED_COPY
            | scsi::op::COMPARE_AND_WRITE),
        ) => true,
        Some(&(scsi::op::VERIFY_10 | scsi::op::VERIFY_12 | scsi::op::VERIFY_16)) => {
            cdb.get(1).is_some_and(|b| (b >> 1) & 3 != 0)
        }
        _ => false,
    }
}

/// The tasks a task management function acts on: one (by ITT), one LU's (by connection
/// target), or every one.
#[derive(Clone, Copy, Debug)]
struct Scope {
    only: Option<u32>,
    on: Option<u8>,
}

impl Scope {
    /// Whether the task `itt` of connection target `target` is one of them.
    fn hits(&self, itt: u32, target: u8) -> bool {
        self.only.is_none_or(|i| i == itt) && self.on.is_none_or(|t| t == target)
    }
}

/// A task management function answered once the tasks it affects that were running when it
/// came are answered (`Iscsi::fence`).
#[derive(Clone, Debug)]
struct Fence {
    /// Its ITT.
    itt: u32,
    /// The response it gets.
    response: u8,
    /// The tasks (ITT, connection target) it waits for: those of its scope with the reactor
    /// when it came, each taken off as it is answered (`Iscsi::settle`). Commands decoded
    /// after the function are not among them.
    waiting: Vec<(u32, u8)>,
}

/// One connection's full feature phase state.
pub struct Iscsi {
    neg: Negotiated,
    d: Digests,
    statsn: u32,
    expcmdsn: u32,
    /// The largest MaxCmdSN ever sent (serial arithmetic): the window commands are checked
    /// against. An initiator keeps the largest it was given (RFC 7143 §4.2.2.1), so a command
    /// sent under an earlier, larger window than the last is still in it.
    granted: u32,
    depth: u16,
    /// Commands handed to the reactor and not answered yet, as (ITT, connection target): a
    /// part of a compound command under its command's ITT. Those waiting for data or memory
    /// are in `tasks` too; the others run (at a backend, or across the reactors).
    inflight: Vec<(u32, u8)>,
    /// The LUNs, indexed by connection target.
    luns: Vec<Lu>,
    /// The target (index into `luns`) of the command being decoded.
    cur: usize,
    tasks: Vec<Task>,
    params: Option<Params>,
    compound: Option<Compound>,
    /// What is left of the compound command in progress, as runs of the requests the frontend
    /// makes up (parts of UNMAP, WRITE SAME, EXTENDED COPY, the read of a compare), each made
    /// and handed to the reactor after the one before was answered.
    queued: VecDeque<Run>,
    /// The last request `decode` returned, until the reactor takes it (`taken`): returned
    /// again when the reactor decodes the same message again.
    pending: Option<(Req, usize, usize, usize)>,
    /// A part is with the reactor.
    part_running: bool,
    /// The descriptor of the COPY part handed out, for `copy_descriptor`.
    copy_desc: Option<CopyDescriptor>,
    /// The data a compare part's read must match (VERIFY with BYTCHK, COMPARE AND WRITE),
    /// and the offset of the first difference once read.
    compare: Option<(Vec<u8>, Option<u64>)>,
    /// What the part with the reactor holds back (`Hold`): every later command (the read of a
    /// COMPARE AND WRITE), or those that make parts (the part of a given-up compound command).
    hold: Hold,
    /// The unsolicited data announced by the command `decode` handed out last (its ITT and
    /// sequence), until `solicit` places it in the write's slot or `reply` answers the write.
    announced: Option<(u32, Seq)>,
    /// Unsolicited sequences nobody takes (the command was answered, or its write has all the
    /// data it moves): checked and dropped until they end. At most `depth`.
    drains: Vec<(u32, Seq)>,
    /// Solicited sequences, as (ITT, TTT), of tasks task management gave up while their R2T
    /// was out (a write's, a parameter list's): their Data-Out, which the initiator may still
    /// send (§11.5.1), is dropped until its F bit, also once the slot (the TTT) serves another
    /// write. At most `depth`; those of an ITT are forgotten when a command reuses it.
    given_up: Vec<(u32, u32)>,
    /// The exports this initiator may open: EXTENDED COPY finds its source here.
    peers: Vec<Peer>,
    xlimits: xcopy::Limits,
    /// Results of EXTENDED COPY for RECEIVE COPY RESULTS.
    history: xcopy::History,
    /// The block a WRITE SAME in progress writes (`fill`).
    pattern: Option<Vec<u8>>,
    /// Further slots of aborted writes the reactor is to free with the one `Decoded::Release`
    /// named (`next_release`).
    releases: Vec<u16>,
    /// A task management function whose response waits for the tasks it affects that were
    /// running when it came: sent right behind the last one's answer (`lift`). Meanwhile
    /// everything else is decoded, but another task management function or a Logout waits
    /// behind it.
    fence: Option<Fence>,
    scratch: Vec<u8>,
    /// Persistent reservations, per target (LU) as `luns`: each its export's, shared by every
    /// nexus to it (`crate::reservations`).
    pr: Vec<Pr>,
    /// The budget's room for `params`, `compare` and `pattern` ([`LIST_ROOM`]).
    _list_room: Reservation,
}

/// What the LU of `e` is, as the SCSI layer answers for it (as LUN 0: a caller serving it at
/// another LUN sets `lun`), `size` bytes long. `copy`: EXTENDED COPY is granted.
///
/// For a session's LU, `size` is the size the session was admitted with (`Admitted::size`), which
/// its executor holds I/O to: read again from the export it may be larger after an
/// `export_resize`, and READ CAPACITY would offer blocks every access to which is refused.
pub fn lun_info(e: &Export, size: u64, max_io: u32, copy: bool) -> LunInfo {
    let caps = e.capabilities();
    // The block is also the unit the executor admits I/O in (`Export::io_block`).
    let block_size = e.io_block().clamp(512, 4096).next_power_of_two();
    let shift = block_size.trailing_zeros();
    let target = crate::iscsi::target_name(&e.name);
    let digest = ring::digest::digest(&ring::digest::SHA256, target.as_bytes());
    let id = u64::from_be_bytes(digest.as_ref()[..8].try_into().expect("8 bytes"));
    let serial: String = digest.as_ref()[8..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    LunInfo {
        lun: 0,
        block_size,
        blocks: size >> shift,
        read_only: e.read_only,
        write_cache: caps.flush.available(),
        fua: caps.fua.available(),
        unmap: !e.read_only,
        // Trimmed blocks may read back as they were (TRIM is advisory where emulated).
        zeroes_after_unmap: false,
        copy: copy && !e.read_only,
        rotational: caps.rotational,
        max_transfer_blocks: (max_io >> shift).max(1),
        // libiscsi's BlockLimits test holds MAXIMUM UNMAP LBA COUNT to 1 Mi blocks. Of 4 KiB
        // blocks that is 4 GiB, more than a request carries: `run_params` splits it.
        max_unmap_blocks: 1 << 20,
        max_unmap_descriptors: 256,
        max_write_same_blocks: (u32::MAX >> shift) as u64,
        // COMPARE AND WRITE's data (both halves) is collected in the frontend, as a parameter
        // list is, however it comes (immediate data, unsolicited or solicited Data-Out).
        max_compare_write_blocks: (MAX_PARAMS / (2 * block_size))
            .min(max_io >> shift)
            .clamp(1, 255) as u8,
        unmap_granularity: 1,
        // IEEE company id 0 (none registered); the id is the target name's hash, so every
        // connection (and an EXTENDED COPY naming it) sees the same one.
        naa: scsi::naa_registered(0, id),
        serial,
        ..LunInfo::default()
    }
}

impl Iscsi {
    /// The full feature phase of a connection that logged in.
    pub fn new(s: IscsiSetup) -> Iscsi {
        let luns: Vec<Lu> = s
            .luns
            .iter()
            .map(|l| {
                let mut info = lun_info(&l.export, l.size, s.max_io, l.copy.enabled());
                info.lun = l.lun;
                Lu {
                    shift: info.block_size.trailing_zeros(),
                    info,
                    flush: l.export.capabilities().flush.available(),
                    copy: l.copy,
                    gone: false,
                    attention: false,
                }
            })
            .collect();
        assert!(!luns.is_empty(), "a login admits one LUN at least");
        // One copy manager for the connection: segments as long as the smallest grant among
        // the LUs EXTENDED COPY may write into (a read-only LU, granted none, would turn it off
        // for all).
        let max_copy = luns
            .iter()
            .filter(|l| l.info.copy)
            .map(|l| l.copy.max_bytes)
            .min()
            .unwrap_or(0);
        let xlimits = xcopy::Limits {
            max_segment_length: max_copy.min(xcopy::Limits::default().max_segment_length),
            ..xcopy::Limits::default()
        };
        // The iSCSI initiator port name: SPC-4 7.6.4.6 (and RFC 7143 §4.2.7.1).
        let initiator = format!("{},i,{}", s.initiator, iscsi::hex(&s.isid));
        let pr = s
            .luns
            .iter()
            .map(|l| Pr {
                lu: l.reservations.clone(),
                nexus: Nexus {
                    initiator: initiator.clone(),
                    target_port: TARGET_PORT,
                },
                version: 0,
                access: Access::Full,
                outgoing: None,
            })
            .collect();
        let depth = s.depth.max(1);
        Iscsi {
            d: s.neg.digests,
            neg: s.neg,
            statsn: s.statsn,
            expcmdsn: s.expcmdsn,
            granted: match s.granted {
                Some(g) if serial_after(g, s.expcmdsn.wrapping_add(depth as u32 - 1)) => g,
                _ => s.expcmdsn.wrapping_add(depth as u32 - 1),
            },
            depth,
            inflight: Vec::with_capacity(depth as usize),
            luns,
            cur: 0,
            tasks: vec![Task::default(); depth as usize],
            params: None,
            compound: None,
            queued: VecDeque::new(),
            pending: None,
            part_running: false,
            copy_desc: None,
            compare: None,
            hold: Hold::Off,
            announced: None,
            drains: Vec::with_capacity(depth as usize),
            given_up: Vec::new(),
            peers: s.peers,
            xlimits,
            history: xcopy::History::default(),
            pattern: None,
            releases: Vec::new(),
            fence: None,
            scratch: Vec::with_capacity(BHS_LEN + 64),
            pr,
            _list_room: s.list_room,
        }
    }

    /// The LU of the command being decoded.
    fn lu(&self) -> &Lu {
        &self.luns[self.cur]
    }

    /// The connection target of LUN `lun`, unless the connection has no such LU (or it was
    /// removed).
    fn target_of(&self, lun: u64) -> Option<usize> {
        self.luns.iter().position(|l| l.info.lun == lun && !l.gone)
    }

    /// Commands with the reactor, not answered yet.
    fn outstanding(&self) -> u16 {
        self.inflight.len() as u16
    }

    /// The command `itt` of connection target `target` is answered (or given up): it is no
    /// longer with the reactor, nor waited for by a task management function. Matched on both:
    /// an initiator that uses one ITT on two LUs does not settle one LU's command with the
    /// other's answer.
    fn settle(&mut self, itt: u32, target: u8) {
        if let Some(i) = self.inflight.iter().position(|&e| e == (itt, target)) {
            self.inflight.swap_remove(i);
        }
        if let Some(f) = self.fence.as_mut() {
            if let Some(i) = f.waiting.iter().position(|&e| e == (itt, target)) {
                f.waiting.swap_remove(i);
            }
        }
    }

    /// Sends the response of the task management function waiting (`fence`) once the last
    /// task it waits for is answered: called right after an answer is written into `tx`, so
    /// it follows that answer (RFC 7143 §4.2.3.3). Returns whether it went out.
    fn lift(&mut self, tx: &mut Vec<u8>) -> bool {
        let Some(f) = self.fence.take_if(|f| f.waiting.is_empty()) else {
            return false;
        };
        self.tmf_response(f.itt, f.response, tx);
        true
    }

    /// MaxCmdSN now: the window is the free task places (§4.2.2.1).
    fn window(&mut self) -> u32 {
        // A command collecting its parameter list, or between the parts it runs, is not with
        // the reactor but will need a slot for its next part: it keeps its place, or the
        // initiator could fill every slot before that part comes (the reactor would have none
        // to run it in).
        let between = self.params.is_some() || (self.compound.is_some() && !self.part_running);
        let free = self
            .depth
            .saturating_sub(self.outstanding() + u16::from(between)) as u32;
        // A window of 0 is MaxCmdSN = ExpCmdSN − 1.
        let max = self.expcmdsn.wrapping_add(free).wrapping_sub(1);
        if serial_after(max, self.granted) {
            self.granted = max;
        }
        max
    }

    /// Takes the CmdSN of a non-immediate PDU: true if it is the one expected next and inside
    /// the window granted (ExpCmdSN advances); false if the PDU is to be dropped, silently, as
    /// RFC 7143 §4.2.2.1 says of one outside the window or a duplicate (one connection per
    /// session, so nothing is missing that could fill a gap).
    fn take_cmdsn(&mut self, cmdsn: u32) -> bool {
        if cmdsn != self.expcmdsn || serial_after(cmdsn, self.granted) {
            return false;
        }
        self.expcmdsn = self.expcmdsn.wrapping_add(1);
        true
    }

    /// Stamps StatSN (advancing it when `advance`), ExpCmdSN and MaxCmdSN.
    fn stamp(&mut self, b: &mut Bhs, advance: bool) {
        let max = self.window();
        b.sn(self.statsn, self.expcmdsn, max);
        if advance {
            self.statsn = self.statsn.wrapping_add(1);
        }
    }

    /// A SCSI Response (§11.4): `sense` as its data when CHECK CONDITION.
    fn response(
        &mut self,
        itt: u32,
        status: u8,
        sense: Option<&Sense>,
        res: Residual,
        tx: &mut Vec<u8>,
    ) {
        let mut b = Bhs::new(op::SCSI_RSP, flag::FINAL | res.flags());
        b.0[2] = 0; // Command Completed at Target
        b.0[3] = status;
        b.itt(itt);
        self.stamp(&mut b, true);
        b.set32(44, res.count());
        self.scratch.clear();
        if let Some(s) = sense {
            self.scratch.extend_from_slice(&[0, 0]);
            s.encode(&mut self.scratch);
            let n = (self.scratch.len() - 2) as u16;
            self.scratch[..2].copy_from_slice(&n.to_be_bytes());
        }
        let data = std::mem::take(&mut self.scratch);
        b.encode(&data, &self.d, tx);
        self.scratch = data;
    }

    fn check(&mut self, itt: u32, sense: &Sense, edtl: u32, tx: &mut Vec<u8>) {
        self.response(itt, CHECK_CONDITION, Some(sense), Residual::of(edtl, 0), tx);
    }

    /// Data-In PDUs for an answer the target built (at most `edtl` of it), the last one with
    /// GOOD status.
    fn answer(&mut self, itt: u32, data: &[u8], edtl: u32, tx: &mut Vec<u8>) {
        let res = Residual::of(edtl, data.len() as u32);
        let data = &data[..data.len().min(edtl as usize)];
        self.data_in(itt, data, res, tx, None);
    }

    /// What frames `send` bytes of Data-In (`data_in`): a PDU ends at each segment's length
    /// and at each burst's end, so each whole burst is as many PDUs as its segments, the last
    /// one those of what is left; each PDU its header, padding and digest. Then room for a
    /// SCSI Response, which a read without data, or the read half of a compare, answers with.
    fn data_in_framing(&self, send: usize) -> usize {
        let (max, burst) = self.data_in_limits();
        let pdus = send / burst * burst.div_ceil(max) + (send % burst).div_ceil(max);
        pdus * (Bhs::prefix_len(&self.d) + 3 + DIGEST_LEN) + RESPONSE_MAX
    }

    /// The longest data segment of a Data-In PDU, and of a sequence of them (a burst).
    fn data_in_limits(&self) -> (usize, usize) {
        (
            self.neg.send_max.max(512) as usize,
            self.neg.max_burst.max(512) as usize,
        )
    }

    /// The Data-In PDUs answering the READ `req` (at most what it asked for of `data`), as
    /// `data_in` writes them.
    fn read_data_in(
        &mut self,
        req: &Req,
        data: &[u8],
        tx: &mut Vec<u8>,
        pieces: Option<&mut Vec<Piece>>,
    ) {
        self.settle(itt_of(req), req.target);
        let send = (extra_of(req) as usize).min(data.len());
        self.data_in(itt_of(req), &data[..send], residual_of(req), tx, pieces);
        self.lift(tx);
    }

    /// Data-In PDUs for `data`, the last one with GOOD status and the residual `res`. With
    /// `pieces`, only their framing goes into `tx` and each PDU's data is listed there instead
    /// (`StreamFrontend::encode_read_framing`); digests are computed over `data` either way.
    fn data_in(
        &mut self,
        itt: u32,
        data: &[u8],
        res: Residual,
        tx: &mut Vec<u8>,
        mut pieces: Option<&mut Vec<Piece>>,
    ) {
        if data.is_empty() {
            return self.response(itt, GOOD, None, res, tx);
        }
        let (max, burst) = self.data_in_limits();
        let mut at = 0usize;
        let mut datasn = 0u32;
        while at < data.len() {
            // A PDU never crosses a MaxBurstLength boundary; F ends each sequence.
            let burst_end = (at / burst + 1) * burst;
            let end = (at + max).min(data.len()).min(burst_end);
            let last = end == data.len();
            let mut f = 0;
            if last || end == burst_end {
                f |= flag::FINAL;
            }
            if last {
                f |= flag::STATUS | res.flags();
            }
            let mut b = Bhs::new(op::DATA_IN, f);
            b.itt(itt).set32(20, RESERVED_TAG);
            self.stamp(&mut b, last);
            if !last {
                b.set32(24, 0);
            }
            b.set32(36, datasn).set32(40, at as u32);
            if last {
                b.0[3] = GOOD;
                b.set32(44, res.count());
            }
            match pieces.as_deref_mut() {
                Some(p) => {
                    b.encode_prefix(end - at, &self.d, tx);
                    p.push(Piece {
                        at: tx.len(),
                        from: at,
                        len: end - at,
                    });
                    iscsi::encode_suffix(&data[at..end], &self.d, tx);
                }
                None => b.encode(&data[at..end], &self.d, tx),
            }
            at = end;
            datasn += 1;
        }
    }

    /// Reject (§11.17) of the PDU whose header is `bhs`.
    fn reject(&mut self, reason: u8, bhs: &[u8], tx: &mut Vec<u8>) {
        let mut b = Bhs::new(op::REJECT, flag::FINAL);
        b.0[2] = reason;
        b.set32(16, RESERVED_TAG);
        self.stamp(&mut b, true);
        b.encode(&bhs[..BHS_LEN], &self.d, tx);
    }

    fn request(&mut self, req: Req, len: usize, payload_len: usize, trailer: usize) -> Decoded {
        self.inflight.push((itt_of(&req), req.target));
        self.pending = Some((req, len, payload_len, trailer));
        Decoded::Request {
            req,
            len,
            payload_len,
            trailer,
        }
    }

    /// The byte range of `blocks` blocks from `lba` (decode checked it is inside the LUN). In
    /// u64: a count the initiator chose, in 4 KiB blocks, reaches 4 GiB at 2^20 blocks (an
    /// UNMAP descriptor may be that long), which a u32 length shifted in place turned into 0.
    fn bytes(&self, lba: u64, blocks: u32) -> (u64, u64) {
        let shift = self.lu().shift;
        (lba << shift, u64::from(blocks) << shift)
    }

    /// The byte range of a transfer decode held to MAXIMUM TRANSFER LENGTH (at most `max_io`
    /// bytes, `lun_info`), as one request carries it; `None` past a u32, which that limit
    /// never lets through (refused, never cut short).
    fn transfer(&self, lba: u64, blocks: u32) -> Option<(u64, u32)> {
        let (offset, bytes) = self.bytes(lba, blocks);
        Some((offset, u32::try_from(bytes).ok()?))
    }

    /// A SCSI Command; unsolicited data it announced and nothing takes is dropped as it comes.
    fn command(&mut self, rx: &[u8], len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        // The initiator is done with a given-up or drained task whose ITT it uses again (it
        // sent that task's data, if any, before this command).
        let itt = p.itt();
        if !self.given_up.is_empty() {
            self.given_up.retain(|&(i, _)| i != itt);
        }
        if !self.drains.is_empty() {
            self.drains.retain(|&(i, _)| i != itt);
        }
        let d = self.scsi_command(rx, len, p, tx);
        if let Some((itt, seq)) = self.announced {
            let placed =
                matches!(&d, Decoded::Request { req, .. } if follows_of(req) && itt_of(req) == itt);
            if !placed {
                self.announced = None;
                self.drain(itt, seq);
            }
        }
        d
    }

    /// Drops the Data-Out of the solicited sequence `ttt` of `itt`, given up with its R2T out,
    /// until its F bit (`given_up`).
    fn give_up(&mut self, itt: u32, ttt: u32) {
        // A function gives up at most every write (depth) and one parameter list.
        if self.given_up.len() > self.depth as usize {
            // The oldest is forgotten (its data, should it come after all, ends the
            // connection as data no R2T asked for).
            self.given_up.remove(0);
        }
        self.given_up.push((itt, ttt));
    }

    /// Drops what comes of the unsolicited sequence `seq` of `itt` (checked, never kept).
    fn drain(&mut self, itt: u32, seq: Seq) {
        if seq.next >= seq.end {
            return;
        }
        if self.drains.len() >= self.depth as usize {
            // An initiator that never sends what it announced: the oldest is forgotten (its
            // data, should it come after all, ends the connection).
            self.drains.remove(0);
        }
        self.drains.push((itt, seq));
    }

    fn scsi_command(
        &mut self,
        rx: &[u8],
        len: usize,
        p: &iscsi::Pdu<'_>,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let c = iscsi::scsi_command(p);
        let itt = c.itt;
        if c.write && !c.final_ {
            // F=0: unsolicited Data-Out follows (§11.3.4.1), allowed under InitialR2T=No up to
            // min(FirstBurstLength, EDTL), the immediate data included (§13.10, §13.14).
            let end = self.neg.first_burst.min(c.edtl);
            if self.neg.initial_r2t || c.data.len() as u32 >= end {
                self.reject(reject::PROTOCOL_ERROR, rx, tx);
                return Decoded::Violation(if self.neg.initial_r2t {
                    "iSCSI: unsolicited Data-Out announced under InitialR2T=Yes".into()
                } else {
                    "iSCSI: unsolicited Data-Out announced past FirstBurstLength".into()
                });
            }
            // Announced before the command is checked: whatever becomes of it (dropped outside
            // the window, refused, answered), its data comes and is taken or dropped in step.
            let seq = Seq::unsolicited(c.data.len() as u32, end);
            if let Some((old, q)) = self.announced.replace((itt, seq)) {
                self.drain(old, q);
            }
        }
        if !p.immediate() && !self.take_cmdsn(c.cmdsn) {
            return Decoded::Dropped { len };
        }
        if !c.data.is_empty()
            && (!self.neg.immediate_data || !c.write || c.data.len() as u32 > self.neg.first_burst)
        {
            self.reject(reject::PROTOCOL_ERROR, rx, tx);
            return Decoded::Answered { len };
        }
        let lun = scsi::lun_from_wire(c.lun.to_be_bytes());
        let mut cdb = [0u8; 32];
        cdb[..16].copy_from_slice(&c.cdb);
        let ext = c.ext_cdb.len().min(16);
        cdb[16..16 + ext].copy_from_slice(&c.ext_cdb[..ext]);
        let cdb = &cdb[..16 + ext];
        // A LUN without a logical unit (not one of the connection's, or removed since): the
        // SCSI layer's answers for an absent LU (INQUIRY qualifier 011b, REPORT LUNS, else
        // LOGICAL UNIT NOT SUPPORTED), with the first LU's facts as the template.
        let decoded = match self.target_of(lun) {
            Some(t) => {
                self.cur = t;
                // A unit attention goes to the first command that is neither INQUIRY nor
                // REPORT LUNS (SAM-5 5.14, SPC-4 REPORT LUNS), and is then cleared.
                if self.luns[t].attention && !matches!(cdb[0], 0x12 | 0xa0) {
                    self.luns[t].attention = false;
                    let ua = Sense::reported_luns_changed();
                    if cdb[0] == 0x03 {
                        // REQUEST SENSE returns it as its data, with GOOD (SPC-4 REQUEST SENSE).
                        let mut d = Vec::new();
                        match cdb[1] & 1 {
                            0 => ua.encode(&mut d),
                            _ => ua.encode_descriptor(&mut d),
                        }
                        d.truncate(cdb[4] as usize);
                        self.answer(itt, &d, c.edtl, tx);
                    } else {
                        self.check(itt, &ua, c.edtl, tx);
                    }
                    return Decoded::Answered { len };
                }
                scsi::decode(cdb, &self.lu().info)
            }
            None => {
                self.cur = 0;
                scsi::decode_absent(cdb, &self.luns[0].info)
            }
        };
        let cmd = match decoded {
            Ok(cmd) => cmd,
            Err(sense) => {
                self.check(itt, &sense, c.edtl, tx);
                return Decoded::Answered { len };
            }
        };
        // Persistent reservations (SPC-4): a command this nexus may not run now ends with
        // RESERVATION CONFLICT before anything of it runs. Without a reservation (Access::Full)
        // this is one match.
        // An absent LU has no reservations: its commands are answered for what it is.
        if self.target_of(lun).is_some() && self.pr[self.cur].access.conflicts(&cmd) {
            let res = Residual::of(c.edtl, 0);
            self.response(itt, RESERVATION_CONFLICT, None, res, tx);
            return Decoded::Answered { len };
        }
        // Bytes of immediate data the reactor does not take, and the padding and digest.
        let tail = p.trailer;
        match cmd {
            Command::TestUnitReady
            | Command::StartStopUnit { .. }
            | Command::PreventAllowMediumRemoval { .. }
            | Command::PreFetch { .. }
            | Command::Verify { bytchk: false, .. } => {
                self.response(itt, GOOD, None, Residual::of(c.edtl, 0), tx);
                Decoded::Answered { len }
            }
            Command::DataIn(d) => {
                self.answer(itt, &d, c.edtl, tx);
                Decoded::Answered { len }
            }
            Command::ReportLuns { alloc_len } => {
                // SPC-4 REPORT LUNS: the list is what the initiator sees now, so the unit
                // attention that said it changed is cleared.
                let luns: Vec<u64> = self
                    .luns
                    .iter_mut()
                    .filter(|l| !l.gone)
                    .map(|l| {
                        l.attention = false;
                        l.info.lun
                    })
                    .collect();
                let d = scsi::report_luns(&luns, alloc_len);
                self.answer(itt, &d, c.edtl, tx);
                Decoded::Answered { len }
            }
            Command::Read { lba, blocks, fua } => {
                let Some((offset, bytes)) = self.transfer(lba, blocks) else {
                    self.check(itt, &Sense::invalid_field_in_cdb(), c.edtl, tx);
                    return Decoded::Answered { len };
                };
                if bytes == 0 {
                    self.response(itt, GOOD, None, Residual::of(c.edtl, 0), tx);
                    return Decoded::Answered { len };
                }
                let res = Residual::of(c.edtl, bytes);
                let send = bytes.min(c.edtl);
                let req = Req {
                    kind: Kind::Block(BlockOp::Read),
                    offset,
                    length: bytes,
                    flags: IoFlags::empty().with(IoFlags::FUA, fua),
                    slot: None,
                    target: self.cur as u8,
                    cookie: cookie(itt, res, Reply::Read, send),
                };
                self.request(req, len, 0, 0)
            }
            Command::Write { lba, blocks, fua } => self.write(
                c.edtl,
                itt,
                (lba, blocks, fua),
                c.data.len(),
                (len, tail),
                tx,
            ),
            Command::WriteAndVerify { lba, blocks } => {
                // The write is verified by being durable before GOOD.
                let fua = self.lu().info.fua;
                self.write(
                    c.edtl,
                    itt,
                    (lba, blocks, fua),
                    c.data.len(),
                    (len, tail),
                    tx,
                )
            }
            Command::SynchronizeCache { .. } => {
                if !self.lu().flush {
                    self.response(itt, GOOD, None, Residual::of(c.edtl, 0), tx);
                    return Decoded::Answered { len };
                }
                let req = Req {
                    kind: Kind::Block(BlockOp::Flush),
                    offset: 0,
                    length: 0,
                    flags: IoFlags::empty(),
                    slot: None,
                    target: self.cur as u8,
                    cookie: cookie(itt, Residual::of(c.edtl, 0), Reply::Flush, 0),
                };
                self.request(req, len, 0, 0)
            }
            Command::GetLbaStatus { lba, alloc_len } => {
                let (offset, _) = self.bytes(lba, 0);
                // Up to 1 GiB from the starting block (the rest is asked for again).
                let left = (self.lu().info.blocks - lba) << self.lu().shift;
                let length = left.min(1 << 30) as u32;
                let req = Req {
                    kind: Kind::BlockStatus,
                    offset,
                    length,
                    flags: IoFlags::empty(),
                    slot: None,
                    target: self.cur as u8,
                    // The residual field holds EDTL until the answer's length is known.
                    cookie: cookie(
                        itt,
                        Residual::Under(c.edtl),
                        Reply::LbaStatus,
                        alloc_len.min(c.edtl),
                    ),
                };
                self.request(req, len, 0, 0)
            }
            Command::Unmap { param_len } | Command::ExtendedCopy { param_len }
                if param_len == 0 =>
            {
                self.response(itt, GOOD, None, Residual::of(c.edtl, 0), tx);
                Decoded::Answered { len }
            }
            Command::Unmap { param_len } => {
                // Only what `parse_unmap` can take is read: a list that says it has more
                // descriptors is refused whether they came or not, so they are not asked for
                // (the residual says what was not moved).
                let most = scsi::max_unmap_list_len(&self.lu().info);
                let want = param_len.min(u32::try_from(most).unwrap_or(u32::MAX));
                self.collect(itt, &c.cdb, c.edtl, want, c.data, len, tx)
            }
            Command::WriteSame { blocks, ndob, .. } => {
                if ndob {
                    // No list to collect, but one compound command at a time all the same
                    // (`collect` answers a second BUSY): started beside another,
                    // its parts' answers would be counted against the other's.
                    return self.collect(itt, &c.cdb, c.edtl, 0, &[], len, tx);
                }
                let want = self.lu().info.block_size;
                let _ = blocks;
                self.collect(itt, &c.cdb, c.edtl, want, c.data, len, tx)
            }
            Command::ExtendedCopy { param_len } => {
                // No list longer than the copy manager takes (RECEIVE COPY RESULTS, OPERATING
                // PARAMETERS) is collected only to be refused by `xcopy::parse`.
                if param_len > self.xlimits.max_list_length() {
                    let s = Sense::parameter_list_length_error();
                    self.check(itt, &s, c.edtl, tx);
                    return Decoded::Answered { len };
                }
                self.collect(itt, &c.cdb, c.edtl, param_len, c.data, len, tx)
            }
            Command::PersistentReserveIn {
                service_action,
                alloc_len,
            } => {
                match self.pr[self.cur].lu.reserve_in(service_action, alloc_len) {
                    Ok(d) => self.answer(itt, &d, c.edtl, tx),
                    Err(s) => self.check(itt, &s, c.edtl, tx),
                }
                Decoded::Answered { len }
            }
            Command::PersistentReserveOut { param_len, .. } => {
                self.collect(itt, &c.cdb, c.edtl, param_len, c.data, len, tx)
            }
            Command::Verify {
                blocks,
                bytchk: true,
                ..
            } => {
                // Every block is compared: data for fewer (EDTL short of the verification
                // length) cannot be taken as a match, and is refused as COMPARE AND WRITE's is.
                let Some((_, want)) = self.transfer(0, blocks).filter(|&(_, w)| w <= c.edtl) else {
                    self.check(itt, &Sense::invalid_field_in_cdb(), c.edtl, tx);
                    return Decoded::Answered { len };
                };
                self.collect(itt, &c.cdb, c.edtl, want, c.data, len, tx)
            }
            Command::ReceiveCopyResults {
                service_action,
                list_id,
                alloc_len,
            } => {
                let answer = xcopy::receive_copy_results(
                    service_action,
                    list_id,
                    alloc_len,
                    &self.xlimits,
                    &self.history,
                );
                match answer {
                    Ok(d) => self.answer(itt, &d, c.edtl, tx),
                    Err(s) => self.check(itt, &s, c.edtl, tx),
                }
                Decoded::Answered { len }
            }
            Command::CompareAndWrite { blocks, .. } => {
                // At most 255 blocks (decode holds it to MAXIMUM COMPARE AND WRITE LENGTH): a
                // u32 holds twice that.
                let bytes = blocks << self.lu().shift;
                if bytes == 0 && c.edtl == 0 {
                    self.response(itt, GOOD, None, Residual::None, tx);
                    return Decoded::Answered { len };
                }
                // Both halves (the data to compare, then the data to write) are collected as
                // a parameter list is, from immediate data and Data-Out (MAXIMUM COMPARE AND
                // WRITE LENGTH keeps them within MAX_PARAMS); `run_params` compares, then
                // writes.
                if c.edtl != 2 * bytes {
                    self.check(itt, &Sense::invalid_field_in_cdb(), c.edtl, tx);
                    return Decoded::Answered { len };
                }
                self.collect(itt, &c.cdb, c.edtl, 2 * bytes, c.data, len, tx)
            }
        }
    }

    /// A WRITE: the data that came as immediate data, the rest solicited by the reactor.
    fn write(
        &mut self,
        edtl: u32,
        itt: u32,
        (lba, blocks, fua): (u64, u32, bool),
        immediate: usize,
        (len, tail): (usize, usize),
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let Some((offset, bytes)) = self.transfer(lba, blocks) else {
            self.check(itt, &Sense::invalid_field_in_cdb(), edtl, tx);
            return Decoded::Answered { len };
        };
        let res = Residual::of(edtl, bytes);
        if bytes == 0 {
            self.response(itt, GOOD, None, res, tx);
            return Decoded::Answered { len };
        }
        // The initiator sends at most EDTL bytes: a write longer than that moves EDTL's
        // whole blocks, and the overflow residual says how much of the CDB's length was not
        // moved (as LIO and tgt do; libiscsi's Write*Residuals expect it).
        let length = bytes.min(edtl) >> self.lu().shift << self.lu().shift;
        if length == 0 {
            self.response(itt, GOOD, None, res, tx);
            return Decoded::Answered { len };
        }
        let flags = IoFlags::empty().with(IoFlags::FUA, fua);
        let carried = immediate.min(length as usize);
        // Unsolicited data the write still needs goes into its buffer (`solicit` tells the
        // slot); data past what it moves (EDTL above the CDB's length) is dropped.
        let follows = carried < length as usize && self.announced.is_some_and(|(a, _)| a == itt);
        let req = Req {
            kind: Kind::Block(BlockOp::Write),
            offset,
            length,
            flags,
            slot: None,
            target: self.cur as u8,
            cookie: cookie(itt, res, Reply::Write, 0) | if follows { FOLLOWS } else { 0 },
        };
        self.request(req, len, carried, tail + immediate - carried)
    }

    /// Starts collecting a parameter list of `want` bytes (at most EDTL), from the immediate
    /// data, the unsolicited data that follows, and then R2Ts, or runs the command at once when
    /// it is all there.
    #[allow(clippy::too_many_arguments)]
    fn collect(
        &mut self,
        itt: u32,
        cdb: &[u8; 16],
        edtl: u32,
        want: u32,
        immediate: &[u8],
        len: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let listed = want;
        let want = want.min(edtl);
        if want > MAX_PARAMS {
            self.check(itt, &Sense::parameter_list_length_error(), edtl, tx);
            return Decoded::Answered { len };
        }
        if self.params.is_some() || self.compound.is_some() {
            // One command that takes a list or makes parts at a time. The next is answered
            // BUSY, which Linux requeues after a short delay without spending its five retries,
            // up to its command timeout (ABORTED COMMAND spent them at once: a discard cut into
            // several UNMAPs failed with EIO on an export whose trims take a while). Not held in
            // the stream: the Data-Out, NOP-Outs and task management behind it would go unread
            // while the running command's next part may wait for memory that Data-Out frees.
            self.response(itt, BUSY, None, Residual::of(edtl, 0), tx);
            return Decoded::Answered { len };
        }
        let have = immediate.len().min(want as usize);
        if have as u32 == want {
            let list = Cow::Borrowed(&immediate[..have]);
            return self.run_params(itt, cdb, (edtl, listed), list, len, tx);
        }
        let mut p = Params {
            itt,
            target: self.cur,
            cdb: *cdb,
            edtl,
            want,
            listed,
            // All of it at once: grown as its data comes, its capacity could pass `want`
            // (doubling), and so its room (LIST_ROOM).
            data: {
                let mut d = Vec::with_capacity(want as usize);
                d.extend_from_slice(&immediate[..have]);
                d
            },
            r2tsn: 0,
            seq: Seq::default(),
        };
        // The R2Ts wait until the unsolicited data is in.
        let announced = match self.announced {
            Some((a, seq)) if a == itt => {
                self.announced = None;
                p.seq = seq;
                true
            }
            _ => false,
        };
        self.params = Some(p);
        if !announced {
            self.param_r2t(tx);
        }
        Decoded::Answered { len }
    }

    /// Asks for the next burst of the parameter list being collected, once it is in
    /// `self.params`: the R2T's MaxCmdSN then counts its place (`window`).
    fn param_r2t(&mut self, tx: &mut Vec<u8>) {
        let max_burst = self.neg.max_burst;
        let Some(p) = self.params.as_mut() else {
            return;
        };
        let at = p.data.len() as u32;
        let n = (p.want - at).min(max_burst);
        p.seq = Seq {
            ttt: PARAM_TTT,
            next: at,
            datasn: 0,
            end: at + n,
        };
        let (itt, r2tsn, target) = (p.itt, p.r2tsn, p.target);
        p.r2tsn += 1;
        self.r2t((itt, target), PARAM_TTT, r2tsn, at, n, tx);
    }

    /// An R2T for task `itt` of connection target `target`, whose LUN it carries (§11.8).
    fn r2t(
        &mut self,
        (itt, target): (u32, usize),
        ttt: u32,
        r2tsn: u32,
        offset: u32,
        n: u32,
        tx: &mut Vec<u8>,
    ) {
        let lun = scsi::lun_to_wire(self.luns[target].info.lun);
        let mut b = Bhs::new(op::R2T, flag::FINAL);
        b.lun(u64::from_be_bytes(lun)).itt(itt).set32(20, ttt);
        self.stamp(&mut b, false);
        b.set32(36, r2tsn).set32(40, offset).set32(44, n);
        b.encode(&[], &self.d, tx);
    }

    /// The next part of the compound command in progress, if one is left to hand out (its
    /// runs go with it: `abort_compound` clears them).
    fn next_part(&mut self) -> Option<(Req, Option<CopyDescriptor>)> {
        let c = self.compound.as_ref()?;
        let run = self.queued.front_mut()?;
        let part = run.take(c);
        if run.len == 0 {
            self.queued.pop_front();
        }
        Some(part)
    }

    /// Runs a command whose parameter list is complete: the requests it becomes are queued.
    /// `listed` is the list's length as the CDB gives it; more than EDTL (what was collected)
    /// is reported as an overflow.
    fn run_params(
        &mut self,
        itt: u32,
        cdb: &[u8; 16],
        (edtl, listed): (u32, u32),
        list: Cow<'_, [u8]>,
        len: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let res = Residual::of(edtl, listed);
        let cmd = match scsi::decode(cdb, &self.lu().info) {
            Ok(c) => c,
            Err(s) => {
                self.check(itt, &s, edtl, tx);
                return Decoded::Answered { len };
            }
        };
        let mut parts: Vec<Run> = Vec::new();
        let mut plan = None;
        match cmd {
            Command::Unmap { .. } => match scsi::parse_unmap(&list, &self.lu().info) {
                Ok(ranges) => {
                    // A descriptor may cover more than a request carries (2^20 blocks of 4 KiB,
                    // MAXIMUM UNMAP LBA COUNT, are 4 GiB): trims of at most 1 GiB each.
                    for (lba, blocks) in ranges {
                        let (o, l) = self.bytes(lba, blocks);
                        let trim = Kind::Block(BlockOp::Trim);
                        parts.extend(Run::of(trim, o, l, ZERO_PART, IoFlags::empty()));
                    }
                }
                Err(s) => {
                    self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    return Decoded::Answered { len };
                }
            },
            Command::WriteSame {
                lba,
                blocks,
                unmap,
                ndob,
            } => {
                let bs = self.lu().info.block_size as usize;
                // Without NDOB the block to write comes as data: less than a block (none at
                // all included) is no block of zeroes.
                if !ndob && list.len() < bs {
                    let s = Sense::parameter_list_length_error();
                    self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    return Decoded::Answered { len };
                }
                let zero = ndob || list[..bs].iter().all(|b| *b == 0);
                if !zero {
                    // The block written over and over: WRITE parts whose buffers the frontend
                    // fills (`fill`), never sent by the initiator again.
                    self.pattern = Some(list[..bs].to_vec());
                }
                // Zeroes in parts of at most 1 GiB (a request's length is a u32); a pattern
                // in parts of at most 1 MiB (each is a buffer).
                let per = if zero { ZERO_PART } else { 1 << 20 };
                let (o, l) = self.bytes(lba, blocks);
                let (op, flags) = match zero {
                    true => {
                        let flags = IoFlags::empty().with(IoFlags::NO_HOLE, !unmap);
                        (BlockOp::WriteZeroes, flags)
                    }
                    false => (BlockOp::Write, IoFlags::empty()),
                };
                parts.extend(Run::of(Kind::Block(op), o, l, per, flags));
            }
            Command::Verify { lba, blocks, .. } => {
                if blocks == 0 {
                    // SBC-4: a VERIFICATION LENGTH of zero verifies nothing, and is no error
                    // (a read part of no bytes would be refused as invalid).
                    self.response(itt, GOOD, None, res, tx);
                    return Decoded::Answered { len };
                }
                let Some((o, l)) = self.transfer(lba, blocks) else {
                    let s = Sense::invalid_field_in_cdb();
                    self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    return Decoded::Answered { len };
                };
                // The list itself, not a copy: it is all of what the connection holds of it.
                self.compare = Some((list.into_owned(), None));
                parts.extend(Run::one(Kind::Block(BlockOp::Read), o, l, IoFlags::empty()));
            }
            Command::CompareAndWrite { lba, blocks, fua } => {
                // SBC-4 5.3: the read is compared with the first half; only when it matches is
                // the second half written (the write is a part the frontend fills, `fill`).
                // Nothing later of this connection is decoded until the compare is done
                // (`hold`).
                let range = self.transfer(lba, blocks);
                let Some((o, l)) = range.filter(|&(_, l)| list.len() == 2 * l as usize) else {
                    let s = Sense::invalid_field_in_cdb();
                    self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    return Decoded::Answered { len };
                };
                let half = l as usize;
                // Its halves, never both a copy and the whole at once past half of it.
                let mut first = list.into_owned();
                self.pattern = Some(first[half..].to_vec());
                first.truncate(half);
                first.shrink_to_fit();
                self.compare = Some((first, None));
                self.hold = Hold::Compare;
                parts.extend(Run::one(Kind::Block(BlockOp::Read), o, l, IoFlags::empty()));
                let flags = IoFlags::empty().with(IoFlags::FUA, fua);
                parts.extend(Run::one(Kind::Block(BlockOp::Write), o, l, flags));
            }
            Command::PersistentReserveOut {
                service_action,
                scope,
                kind,
                ..
            } => return self.reserve_out(itt, (service_action, scope, kind), &list, res, len, tx),
            Command::ExtendedCopy { .. } => match self.copy_parts(&list, &mut parts) {
                Ok(p) => plan = Some((p, 0)),
                Err(pr::Outcome::Sense(s)) => {
                    self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    return Decoded::Answered { len };
                }
                Err(pr::Outcome::ReservationConflict) => {
                    self.response(itt, RESERVATION_CONFLICT, None, res, tx);
                    return Decoded::Answered { len };
                }
            },
            _ => {
                self.response(
                    itt,
                    CHECK_CONDITION,
                    Some(&Sense::invalid_opcode()),
                    res,
                    tx,
                );
                return Decoded::Answered { len };
            }
        }
        if parts.is_empty() {
            // Only commands that always make parts set a compare, a pattern or the compare's
            // hold (those of no blocks are answered before they get here): none is left set for
            // a command with nothing to do, which would stall the connection.
            debug_assert!(self.hold != Hold::Compare);
            debug_assert!(self.compare.is_none() && self.pattern.is_none());
            if let Some((p, _)) = &plan {
                let done = xcopy::CopyStatus {
                    list_id: p.list_id,
                    status: 1,
                    segments: p.segments.len() as u16,
                    bytes: 0,
                };
                self.history.record(p, done);
            }
            self.response(itt, GOOD, None, res, tx);
            return Decoded::Answered { len };
        }
        self.compound = Some(Compound {
            itt,
            target: self.cur as u8,
            residual: res,
            parts_left: parts.iter().map(Run::parts).sum::<u64>() as u32,
            failed: None,
            copy: plan,
        });
        self.queued.extend(parts);
        // The first part goes with this PDU; the rest come from `queued`, one at a time.
        let (first, desc) = self.next_part().expect("one part at least");
        self.part_running = true;
        self.copy_desc = desc;
        self.request(first, len, 0, 0)
    }

    /// PERSISTENT RESERVE OUT with its parameter list: the export's state changes under its lock
    /// at once; when the change is one the conflict checks see, the command becomes a
    /// [`Kind::Broadcast`] request, answered once every reactor installed it.
    fn reserve_out(
        &mut self,
        itt: u32,
        (sa, scope, kind): (u8, u8, u8),
        list: &[u8],
        res: Residual,
        len: usize,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let pr = &mut self.pr[self.cur];
        match pr.lu.reserve_out(&pr.nexus, sa, scope, kind, list) {
            Ok(None) => {
                self.response(itt, GOOD, None, res, tx);
                Decoded::Answered { len }
            }
            Ok(Some(update)) => {
                // This connection's next command sees it already; the reactor's others and the
                // other reactors' before GOOD goes out.
                pr.install(&update);
                pr.outgoing = Some(update);
                let req = Req::broadcast(self.cur as u8, cookie(itt, res, Reply::Plain, 0));
                self.request(req, len, 0, 0)
            }
            Err(pr::Outcome::ReservationConflict) => {
                self.response(itt, RESERVATION_CONFLICT, None, res, tx);
                Decoded::Answered { len }
            }
            Err(pr::Outcome::Sense(s)) => {
                self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                Decoded::Answered { len }
            }
        }
    }

    /// An EXTENDED COPY parameter list as COPY parts: each segment into this LUN from a LUN
    /// this initiator may open, in pieces the session's copy grant allows. RESERVATION
    /// CONFLICT when a source's reservation refuses this nexus a READ of it.
    fn copy_parts(&self, list: &[u8], parts: &mut Vec<Run>) -> Result<xcopy::Plan, pr::Outcome> {
        let plan = xcopy::parse(list, &self.xlimits)?;
        // A source other than this LU comes with its reservations.
        let find = |naa: u64| -> Option<(&str, &LunInfo, Option<&PrLu>)> {
            if naa == self.lu().info.naa {
                return Some(("", &self.lu().info, None));
            }
            self.peers
                .iter()
                .find(|p| p.info.naa == naa)
                .map(|p| (p.name.as_str(), &p.info, Some(&*p.reservations)))
        };
        plan.check(&self.xlimits, |t| find(t.naa).map(|(_, l, _)| l))?;
        let piece = self
            .lu()
            .copy
            .max_bytes
            .min(self.lu().copy.max_range)
            .max(1 << 20);
        for seg in &plan.segments {
            let src = plan.targets[seg.src as usize];
            let dst = plan.targets[seg.dst as usize];
            if dst.naa != self.lu().info.naa {
                // The copy manager writes into its own LU only.
                return Err(xcopy::target_not_reachable().into());
            }
            let (name, lu, reservations) = find(src.naa).ok_or_else(xcopy::target_not_reachable)?;
            // The copy reads its source on this nexus's behalf: a reservation that refuses
            // this nexus a READ of that export (an Exclusive Access type it does not hold)
            // refuses the command, before any part of it runs. This LU, source or destination,
            // was checked when the command came, as every command is; other exports have no
            // snapshot on this connection, so their state is read under its lock.
            if let Some(r) = reservations {
                let read = Command::Read {
                    lba: seg.src_lba,
                    blocks: 0,
                    fua: false,
                };
                if r.access(&self.pr[self.cur].nexus).conflicts(&read) {
                    return Err(pr::Outcome::ReservationConflict);
                }
            }
            let src_shift = lu.block_size.trailing_zeros();
            let mut from = seg.src_lba << src_shift;
            let mut to = seg.dst_lba << self.lu().shift;
            // In blocks of the side the segment's DC bit names, not necessarily this LU's.
            let mut left = plan.bytes(seg);
            while left > 0 {
                let n = left.min(piece as u64) as u32;
                let desc = CopyDescriptor {
                    source: name.to_string(),
                    ranges: vec![CopyRange {
                        offset: from,
                        len: n,
                    }],
                };
                if let Some(mut part) = Run::one(Kind::Copy, to, n, IoFlags::empty()) {
                    part.desc = Some(desc);
                    parts.push(part);
                }
                from += n as u64;
                to += n as u64;
                left -= n as u64;
            }
        }
        Ok(plan)
    }

    /// Data-Out for a parameter list the frontend collects (solicited, or unsolicited).
    fn param_data(
        &mut self,
        rx: &[u8],
        len: usize,
        pdu: &iscsi::Pdu<'_>,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let (itt, ttt, offset, data) = (pdu.itt(), pdu.word20(), pdu.word(40), pdu.data);
        let fin = pdu.flags() & flag::FINAL != 0;
        let Some(mut p) = self.params.take() else {
            self.reject(reject::PROTOCOL_ERROR, rx, tx);
            return Decoded::Violation("iSCSI: Data-Out for no parameter list".into());
        };
        if p.itt != itt || p.seq.ttt != ttt {
            self.reject(reject::PROTOCOL_ERROR, rx, tx);
            return Decoded::Violation("iSCSI: Data-Out outside the R2T it answers".into());
        }
        let ended = match p.seq.take(pdu.word(36), offset, data.len(), fin) {
            Ok(ended) => ended,
            Err(e) => {
                self.reject(reject::PROTOCOL_ERROR, rx, tx);
                return Decoded::Violation(e);
            }
        };
        // Unsolicited data past the list (EDTL above it) is not kept.
        let keep = (p.want as usize)
            .saturating_sub(offset as usize)
            .min(data.len());
        p.data.extend_from_slice(&data[..keep]);
        if p.data.len() as u32 == p.want {
            if !ended {
                self.drain(itt, p.seq);
            }
            let list = std::mem::take(&mut p.data);
            // The command's LU, whatever commands came between; removed while its list came
            // in, it runs nothing (a PERSISTENT RESERVE OUT would change the export's state).
            self.cur = p.target;
            if self.luns[p.target].gone {
                let res = Residual::of(p.edtl, p.listed);
                let s = Sense::lun_not_supported();
                self.response(p.itt, CHECK_CONDITION, Some(&s), res, tx);
                return Decoded::Answered { len };
            }
            return self.run_params(p.itt, &p.cdb, (p.edtl, p.listed), Cow::Owned(list), len, tx);
        }
        self.params = Some(p);
        if ended {
            self.param_r2t(tx);
        }
        Decoded::Answered { len }
    }

    /// Data-Out: for a write waiting in its slot (TTT = the slot), a parameter list, or
    /// unsolicited (TTT 0xffffffff).
    fn data_out(&mut self, rx: &[u8], len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        let itt = p.itt();
        let ttt = p.word20();
        let offset = p.word(40);
        let fin = p.flags() & flag::FINAL != 0;
        if let Some(i) = self.given_up.iter().position(|&e| e == (itt, ttt)) {
            // Answers an R2T of a task given up (§11.5.1): dropped until the sequence ends.
            if fin {
                // `remove`, not `swap_remove`: `give_up` forgets the oldest, at the front.
                self.given_up.remove(i);
            }
            return Decoded::Answered { len };
        }
        if ttt == PARAM_TTT {
            return self.param_data(rx, len, p, tx);
        }
        if ttt == RESERVED_TAG {
            return self.unsolicited_data(rx, len, p, tx);
        }
        let slot = ttt as usize;
        if self
            .tasks
            .get(slot)
            .is_some_and(|t| t.aborted && t.itt == itt)
        {
            // Sent before the initiator aborted the task (§11.5.1): dropped.
            return Decoded::Answered { len };
        }
        let Some(t) = self
            .tasks
            .get_mut(slot)
            .filter(|t| t.active && !t.parked && t.itt == itt && t.seq.ttt == ttt)
        else {
            // Data for no R2T of ours (a dead task, a made-up TTT) cannot be placed, and the
            // stream cannot be trusted after it (ERL 0).
            self.reject(reject::PROTOCOL_ERROR, rx, tx);
            return Decoded::Violation(format!(
                "iSCSI: Data-Out for ITT {itt:#x} TTT {ttt:#x}, which no R2T asked for"
            ));
        };
        let ended = match t.seq.take(p.word(36), offset, p.data.len(), fin) {
            Ok(ended) => ended,
            Err(e) => {
                self.reject(reject::PROTOCOL_ERROR, rx, tx);
                return Decoded::Violation(e);
            }
        };
        if ended {
            self.next_burst(slot, tx);
        }
        Decoded::Data {
            slot: slot as u16,
            offset,
            len,
            payload_len: p.data.len(),
            trailer: p.trailer,
        }
    }

    /// After a sequence of the write in `slot` ended: the R2T for the next burst
    /// (MaxOutstandingR2T=1), or nothing more when the write has all it needs.
    fn next_burst(&mut self, slot: usize, tx: &mut Vec<u8>) {
        let max_burst = self.neg.max_burst;
        let t = &mut self.tasks[slot];
        let at = t.seq.next;
        if at >= t.end {
            t.active = false;
            return;
        }
        let n = (t.end - at).min(max_burst);
        t.seq = Seq {
            ttt: slot as u32,
            next: at,
            datasn: 0,
            end: at + n,
        };
        let (itt, r2tsn, target) = (t.itt, t.r2tsn, t.target as usize);
        t.r2tsn += 1;
        self.r2t((itt, target), slot as u32, r2tsn, at, n, tx);
    }

    /// Unsolicited Data-Out (InitialR2T=No): into the buffer of the write it follows, into a
    /// parameter list, or dropped in step where nothing takes it. Anything else (no unsolicited
    /// data announced for the ITT, past FirstBurstLength, out of order) ends the connection.
    fn unsolicited_data(
        &mut self,
        rx: &[u8],
        len: usize,
        p: &iscsi::Pdu<'_>,
        tx: &mut Vec<u8>,
    ) -> Decoded {
        let (itt, offset, n) = (p.itt(), p.word(40), p.data.len());
        let fin = p.flags() & flag::FINAL != 0;
        let slot = self
            .tasks
            .iter()
            .position(|t| t.active && !t.parked && t.itt == itt && t.seq.ttt == RESERVED_TAG);
        if let Some(slot) = slot {
            let t = &mut self.tasks[slot];
            let ended = match t.seq.take(p.word(36), offset, n, fin) {
                Ok(ended) => ended,
                Err(e) => {
                    self.reject(reject::PROTOCOL_ERROR, rx, tx);
                    return Decoded::Violation(e);
                }
            };
            // What lies past the write's length (EDTL above what the CDB moves) is dropped.
            let take = (t.end.saturating_sub(offset) as usize).min(n);
            if ended {
                self.next_burst(slot, tx);
            } else if t.seq.next >= t.end {
                // The write has its data and runs: the rest of the sequence is dropped.
                t.active = false;
                let seq = t.seq;
                self.drain(itt, seq);
            }
            if take == 0 {
                return Decoded::Answered { len };
            }
            return Decoded::Data {
                slot: slot as u16,
                offset,
                len,
                payload_len: take,
                trailer: p.trailer + (n - take),
            };
        }
        if let Some(i) = self.drains.iter().position(|(t, _)| *t == itt) {
            match self.drains[i].1.take(p.word(36), offset, n, fin) {
                Ok(true) => {
                    // In order: `drain` forgets the oldest first.
                    self.drains.remove(i);
                }
                Ok(false) => {}
                Err(e) => {
                    self.reject(reject::PROTOCOL_ERROR, rx, tx);
                    return Decoded::Violation(e);
                }
            }
            return Decoded::Answered { len };
        }
        if self
            .params
            .as_ref()
            .is_some_and(|q| q.itt == itt && q.seq.ttt == RESERVED_TAG)
        {
            return self.param_data(rx, len, p, tx);
        }
        self.reject(reject::PROTOCOL_ERROR, rx, tx);
        Decoded::Violation(format!(
            "iSCSI: unsolicited Data-Out for ITT {itt:#x}, which announced none"
        ))
    }

    /// Answers a part of a compound command; the command's response goes out after its last.
    /// Returns whether a response went out.
    fn part_done(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        self.part_running = false;
        self.hold = Hold::Off;
        let Some(mut c) = self.compound.take() else {
            return false;
        };
        if status != Status::Ok && c.failed.is_none() {
            let modifies =
                matches!(req.kind, Kind::Block(op) if op.modifies()) || req.kind == Kind::Copy;
            c.failed = Some((status, modifies));
        }
        if let Some((_, bytes)) = c.copy.as_mut() {
            if req.kind == Kind::Copy {
                *bytes += req.length as u64;
            }
        }
        c.parts_left -= 1;
        // A miscompare ends COMPARE AND WRITE before its write.
        let miscompared = self.compare.as_ref().is_some_and(|(_, d)| d.is_some());
        if c.parts_left > 0 && c.failed.is_none() && !miscompared {
            self.compound = Some(c);
            return false;
        }
        // A failed part ends the command: the parts after it are not run.
        self.queued.clear();
        self.pattern = None;
        if let Some((plan, bytes)) = &c.copy {
            let segments = plan.segments.len() as u16;
            let status = xcopy::CopyStatus {
                list_id: plan.list_id,
                status: if c.failed.is_none() { 1 } else { 2 },
                segments: if c.failed.is_none() { segments } else { 0 },
                bytes: *bytes,
            };
            self.history.record(plan, status);
        }
        let miscompare = self.compare.take().and_then(|(_, d)| d);
        match (c.failed, miscompare) {
            (None, None) => self.response(c.itt, GOOD, None, c.residual, tx),
            (None, Some(at)) => {
                let s = Sense::miscompare(at);
                self.response(c.itt, CHECK_CONDITION, Some(&s), c.residual, tx);
            }
            (Some((st, modifies)), _) => {
                let s = if c.copy.is_some() {
                    // SPC-4 6.3.3: a copy that failed in a segment is COPY ABORTED; one whose
                    // source is gone (removed, or added again as another LU) also says the
                    // copy target is not reachable, as an unknown one at the command does.
                    match st {
                        Status::NoExport => xcopy::target_not_reachable(),
                        _ => xcopy::copy_aborted(),
                    }
                } else {
                    sense_of(st, modifies)
                };
                self.response(c.itt, CHECK_CONDITION, Some(&s), c.residual, tx);
            }
        }
        true
    }

    fn nop(&mut self, len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        if !p.immediate() && !self.take_cmdsn(p.cmdsn()) {
            return Decoded::Dropped { len };
        }
        if p.itt() == RESERVED_TAG {
            // An answer to a ping of ours, or a one-way NOP: nothing to say.
            return Decoded::Answered { len };
        }
        let mut b = Bhs::new(op::NOP_IN, flag::FINAL);
        b.lun(p.lun()).itt(p.itt()).set32(20, RESERVED_TAG);
        self.stamp(&mut b, true);
        // The ping data comes back (§11.19), within what the initiator receives.
        let n = p.data.len().min(self.neg.send_max as usize);
        b.encode(&p.data[..n], &self.d, tx);
        Decoded::Answered { len }
    }

    fn tmf(&mut self, len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        if !p.immediate() && !self.take_cmdsn(p.cmdsn()) {
            return Decoded::Dropped { len };
        }
        let function = p.flags() & 0x7f;
        let lun = scsi::lun_from_wire(p.lun().to_be_bytes());
        // §11.6.1 responses: 0 function complete, 1 task does not exist, 2 LUN does not exist,
        // 4 task reassignment not supported, 5 function not supported, 6 function
        // authorization failed.
        let scope = match function {
            // ABORT TASK, ABORT TASK SET, CLEAR ACA, CLEAR TASK SET, LOGICAL UNIT RESET name a
            // LUN.
            1..=5 if self.target_of(lun).is_none() => Err(2),
            // ABORT TASK: the referenced task, on the LU it names (§11.5.1: the task's LUN;
            // one ITT may be waiting on two LUs, `one_itt_on_two_lus_...`).
            1 => Ok(Scope {
                only: Some(p.word20()),
                on: self.target_of(lun).map(|t| t as u8),
            }),
            // ABORT TASK SET, CLEAR TASK SET, LOGICAL UNIT RESET: that LU's task set
            // (SAM-5 7.2–7.6); the other LUs' tasks go on.
            2 | 4 | 5 => Ok(Scope {
                only: None,
                on: self.target_of(lun).map(|t| t as u8),
            }),
            // TARGET WARM RESET: every LU's (this nexus's tasks, as for the other functions).
            6 => Ok(Scope {
                only: None,
                on: None,
            }),
            // TARGET COLD RESET must end every connection of every session (§11.5.1): one
            // initiator would drop all the others'. Refused as §11.6.1 allows.
            7 => Err(6),
            // CLEAR ACA: ACA is not offered (NACA is refused).
            3 => Err(5),
            // TASK REASSIGN: ErrorRecoveryLevel 0.
            8 => Err(4),
            _ => Err(5),
        };
        let scope = match scope {
            Ok(scope) => scope,
            Err(response) => {
                self.tmf_response(p.itt(), response, tx);
                return Decoded::Answered { len };
            }
        };
        // The tasks that wait (writes for their data, requests parked in the reactor for
        // memory) are given up: never run nor answered; the reactor frees their slots.
        let mut released: Vec<u16> = Vec::new();
        for (i, t) in self.tasks.iter_mut().enumerate() {
            if t.active && scope.hits(t.itt, t.target) {
                t.active = false;
                t.parked = false;
                t.aborted = true;
                released.push(i as u16);
            }
        }
        for &slot in &released {
            let t = self.tasks[slot as usize];
            self.settle(t.itt, t.target);
            // Data of an aborted write may still be on its way (a parked request's sequence is
            // empty: none).
            self.abandon(t.itt, t.seq);
        }
        // A parameter list being collected is dropped; a compound command runs no more parts,
        // and is answered to no one (its part running at a backend is waited for below).
        let params = self
            .params
            .as_ref()
            .is_some_and(|q| scope.hits(q.itt, q.target as u8));
        if params {
            self.drop_params();
        }
        let compound = self.compound.as_ref().map(|c| (c.itt, c.target));
        let compound = compound.filter(|&(itt, t)| scope.hits(itt, t));
        if let Some((itt, target)) = compound {
            let part_released = released.iter().any(|&s| {
                let t = &self.tasks[s as usize];
                (t.itt, t.target) == (itt, target)
            });
            self.abort_compound(part_released);
        }
        // The tasks it affects that run (at a backend, or across the reactors) cannot be
        // stopped: they are answered first, and the response waits for them (§4.2.3.3, the
        // response fence: no response of an affected task follows the function's).
        let waiting: Vec<(u32, u8)> = self
            .inflight
            .iter()
            .copied()
            .filter(|&(itt, t)| scope.hits(itt, t))
            .collect();
        let running = !waiting.is_empty();
        let response = match function {
            // The referenced task found (waiting, running, or a compound command's) is
            // complete: "does not exist" only for one already answered (libiscsi's
            // AbortTaskSimpleAsync accepts either, as §11.5.1 does).
            1 if released.is_empty() && !params && compound.is_none() && !running => 1,
            _ => 0,
        };
        if running {
            self.fence = Some(Fence {
                itt: p.itt(),
                response,
                waiting,
            });
        } else {
            self.tmf_response(p.itt(), response, tx);
        }
        match released.pop() {
            Some(slot) => {
                self.releases = released;
                Decoded::Release { slot, len }
            }
            None => Decoded::Answered { len },
        }
    }

    /// The TASK MANAGEMENT FUNCTION RESPONSE (§11.6) to `itt`.
    fn tmf_response(&mut self, itt: u32, response: u8, tx: &mut Vec<u8>) {
        let mut b = Bhs::new(op::TMF_RSP, flag::FINAL);
        b.0[2] = response;
        b.itt(itt);
        self.stamp(&mut b, true);
        b.encode(&[], &self.d, tx);
    }

    /// Gives up the parameter list being collected (task management aborted its command). It
    /// was never with the reactor (`inflight`).
    fn drop_params(&mut self) {
        if let Some(p) = self.params.take() {
            self.abandon(p.itt, p.seq);
        }
    }

    /// The data a given-up task or parameter list may still be sent: unsolicited, dropped in
    /// step (`drain`); solicited with its R2T out, dropped to its F bit (`give_up`).
    fn abandon(&mut self, itt: u32, seq: Seq) {
        if seq.ttt == RESERVED_TAG {
            self.drain(itt, seq);
        } else if seq.next < seq.end {
            self.give_up(itt, seq.ttt);
        }
    }

    /// Gives up the compound command in progress (task management aborted it): no part after
    /// the one handed out runs, and nothing answers it. `part_released`: that part waited in
    /// the reactor and was given up too; otherwise it runs, and its answer (`part_done`)
    /// finds no command to answer.
    fn abort_compound(&mut self, part_released: bool) {
        self.compound = None;
        self.queued.clear();
        self.pattern = None;
        self.compare = None;
        if part_released {
            self.part_running = false;
            self.hold = Hold::Off;
        } else if self.part_running {
            // Its running part will still answer (unanswered, `part_done`): until then no
            // command that makes parts is decoded, or it would take that answer for its own
            // first part's; the others go on.
            self.hold = Hold::GivenUp;
        }
    }

    fn text(&mut self, len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        if !p.immediate() && !self.take_cmdsn(p.cmdsn()) {
            return Decoded::Dropped { len };
        }
        let mut out = Vec::new();
        for (k, _) in iscsi::pairs(p.data).flatten() {
            // Renegotiation in the full feature phase is not offered; SendTargets on a normal
            // session lists nothing (discovery sessions list the targets).
            if k != "SendTargets" {
                iscsi::push_pair(&mut out, k, "NotUnderstood");
            }
        }
        // Whole pairs only, as many as one PDU the initiator takes holds: the rest of the keys
        // go unanswered rather than a pair cut in two under F (no continuation is offered).
        out.truncate(crate::iscsi::text_part(&out, 0, self.neg.send_max as usize));
        let mut b = Bhs::new(op::TEXT_RSP, flag::FINAL);
        b.itt(p.itt()).set32(20, RESERVED_TAG);
        self.stamp(&mut b, true);
        b.encode(&out, &self.d, tx);
        Decoded::Answered { len }
    }

    fn logout(&mut self, len: usize, p: &iscsi::Pdu<'_>, tx: &mut Vec<u8>) -> Decoded {
        if !p.immediate() && p.cmdsn() == self.expcmdsn {
            self.expcmdsn = self.expcmdsn.wrapping_add(1);
        }
        if p.flags() & 0x7f == 2 {
            // Removing a connection for recovery (§11.14.1 reason 2) needs ErrorRecoveryLevel
            // 2; this target's is 0: "connection recovery is not supported" (§11.15.1,
            // response 2), and the connection goes on.
            let mut b = Bhs::new(op::LOGOUT_RSP, flag::FINAL);
            b.itt(p.itt());
            b.0[2] = 2;
            self.stamp(&mut b, true);
            b.encode(&[], &self.d, tx);
            return Decoded::Answered { len };
        }
        let req = Req {
            kind: Kind::Logout,
            offset: 0,
            length: 0,
            flags: IoFlags::empty(),
            slot: None,
            // A Logout addresses the connection, not a LU.
            target: 0,
            cookie: cookie(p.itt(), Residual::None, Reply::Logout, 0),
        };
        self.request(req, len, 0, 0)
    }
}

/// The sense data of a reactor status (the export's refusals and backend errors).
fn sense_of(status: Status, modifies: bool) -> Sense {
    match status {
        Status::OutOfRange => Sense::lba_out_of_range(),
        Status::NoSpace => Sense::space_allocation_failed(),
        Status::ReadOnly => Sense::write_protected(),
        Status::Unsupported => Sense::invalid_opcode(),
        Status::Invalid => Sense::invalid_field_in_cdb(),
        // The LU was removed while the command was on its way (its target is fenced).
        Status::NoExport => Sense::lun_not_supported(),
        // Commands that could not get memory or a backend slot: the initiator retries.
        Status::NoMemory | Status::Busy => Sense::aborted(),
        _ if modifies => Sense::write_error(),
        _ => Sense::medium_error(),
    }
}

impl StreamFrontend for Iscsi {
    fn decode(&mut self, rx: &[u8], tx: &mut Vec<u8>) -> Decoded {
        // The last task a function waited for was answered without a frontend call that writes
        // into tx (a READ's Data-In built by `finish_read_reply`): its response follows here,
        // before a request waiting for memory (`pending`) could hold it back.
        if self.lift(tx) {
            return Decoded::Answered { len: 0 };
        }
        if let Some((req, len, payload_len, trailer)) = self.pending {
            // Not taken yet: the same again, without counting it twice.
            return Decoded::Request {
                req,
                len,
                payload_len,
                trailer,
            };
        }
        if self.fence.is_some() {
            // A task management function waits for the tasks it affects that run. Everything
            // else goes on (NOP-Outs are answered: an initiator pings while it waits, and
            // drops the connection when a ping goes unanswered; Data-Out and other commands
            // flow), but another function or a Logout waits behind it, in stream order.
            if rx
                .first()
                .is_some_and(|b| matches!(b & 0x3f, op::TMF_REQ | op::LOGOUT_REQ))
            {
                return Decoded::Need(rx.len().min(BHS_LEN));
            }
        }
        if self.hold == Hold::Compare
            && self.part_running
            && !rx
                .first()
                .is_some_and(|b| matches!(b & 0x3f, op::DATA_OUT | op::NOP_OUT | op::LOGOUT_REQ))
        {
            // COMPARE AND WRITE's read is with the reactor: no command is decoded until it is
            // back (the reactor services the connection again when it is). What is asked for
            // is there already: the receive buffer does not grow for it. Data-Out and NOP-Out
            // start no task and go on: the read may be parked for memory that writes waiting
            // for their Data-Out hold, and would never run if that data were not read. A
            // Logout goes on too: it answers a parked read (the command ends) or waits for a
            // running one, and no more data comes once an initiator logs out.
            return Decoded::Need(rx.len().min(BHS_LEN));
        }
        if !self.part_running {
            if let Some((req, desc)) = self.next_part() {
                self.part_running = true;
                self.copy_desc = desc;
                return self.request(req, 0, 0, 0);
            }
        }
        let len = match pdu_len(rx, &self.d, self.neg.recv_max) {
            Ok(Progress::Need(n)) => return Decoded::Need(n),
            Ok(Progress::Complete(n)) => n,
            Err(e) => {
                // The stream cannot be followed past a PDU we will not take.
                self.reject(reject::PROTOCOL_ERROR, rx, tx);
                return Decoded::Violation(format!("iSCSI: {e}"));
            }
        };
        let p = match iscsi::decode(&rx[..len], &self.d) {
            Ok(p) => p,
            Err(iscsi::PduError::DataDigest) => {
                // ERL 0: no recovery within the connection (§7.8).
                self.reject(reject::DATA_DIGEST, rx, tx);
                return Decoded::Violation("iSCSI: data digest mismatch".into());
            }
            Err(e) => return Decoded::Violation(format!("iSCSI: {e}")),
        };
        match p.opcode() {
            op::SCSI_CMD if self.hold == Hold::GivenUp && makes_parts(&p.bhs[32..48]) => {
                // The running part of a given-up compound command is still to answer: a
                // command that makes parts waits for it, untouched (its CmdSN not taken), and
                // holds back what follows it in the stream. A part's answer comes through
                // `reply` or `encode_read`, either while the reactor dispatches (its loop then
                // decodes on) or on a completion, after which the reactor services the
                // connection again. What is asked for is there already.
                Decoded::Need(len)
            }
            op::SCSI_CMD => self.command(rx, len, &p, tx),
            op::DATA_OUT => self.data_out(rx, len, &p, tx),
            op::NOP_OUT => self.nop(len, &p, tx),
            op::TMF_REQ => self.tmf(len, &p, tx),
            op::TEXT_REQ => self.text(len, &p, tx),
            op::LOGOUT_REQ => self.logout(len, &p, tx),
            op::SNACK => {
                // ERL 0: no SNACK support (§11.16).
                self.reject(reject::NOT_SUPPORTED, rx, tx);
                Decoded::Answered { len }
            }
            op::LOGIN_REQ => {
                self.reject(reject::PROTOCOL_ERROR, rx, tx);
                Decoded::Answered { len }
            }
            other => {
                self.reject(reject::NOT_SUPPORTED, rx, tx);
                if other & 0x20 != 0 {
                    return Decoded::Violation(format!(
                        "iSCSI: target opcode {other:#04x} from the initiator"
                    ));
                }
                Decoded::Answered { len }
            }
        }
    }

    fn solicit(&mut self, req: &Req, slot: u16, offset: u32, len: u32, tx: &mut Vec<u8>) {
        let itt = itt_of(req);
        let Some(t) = self.tasks.get_mut(slot as usize) else {
            return;
        };
        *t = Task {
            itt,
            target: req.target,
            r2tsn: 0,
            seq: Seq::default(),
            end: offset + len,
            active: true,
            parked: false,
            aborted: false,
        };
        match self.announced {
            // Its unsolicited data comes first; the R2Ts for the rest when it is in.
            Some((a, seq)) if follows_of(req) && a == itt && seq.next == offset => {
                self.announced = None;
                t.seq = seq;
            }
            _ => {
                t.seq.next = offset;
                self.next_burst(slot as usize, tx);
            }
        }
    }

    fn data_follows(&self, req: &Req) -> bool {
        follows_of(req)
    }

    fn parked(&mut self, req: &Req, slot: u16) {
        if let Some(t) = self.tasks.get_mut(slot as usize) {
            *t = Task {
                itt: itt_of(req),
                target: req.target,
                active: true,
                parked: true,
                ..Task::default()
            };
        }
    }

    fn unparked(&mut self, slot: u16) {
        if let Some(t) = self.tasks.get_mut(slot as usize).filter(|t| t.parked) {
            t.active = false;
            t.parked = false;
        }
    }

    fn next_release(&mut self) -> Option<u16> {
        self.releases.pop()
    }

    fn taken(&mut self, _req: &Req) {
        self.pending = None;
    }

    fn fenced(&mut self, target: u8) {
        let Some(gone) = self.luns.get_mut(target as usize) else {
            return;
        };
        gone.gone = true;
        // SPC-4 (REPORTED LUNS DATA HAS CHANGED): the LUs left tell the initiator once, so
        // it scans again (Linux does on this unit attention).
        for l in self.luns.iter_mut().filter(|l| !l.gone) {
            l.attention = true;
        }
    }

    fn server_assigns_slots(&self) -> bool {
        true
    }

    fn fill(&mut self, req: &Req, data: &mut [u8]) -> bool {
        let Some(block) = self.pattern.as_deref() else {
            return false;
        };
        if reply_of(req) != Reply::Part || !req.is_write() {
            return false;
        }
        // Parts start on block boundaries.
        for chunk in data.chunks_mut(block.len()) {
            chunk.copy_from_slice(&block[..chunk.len()]);
        }
        true
    }

    fn copy_descriptor(&mut self, _req: &Req, _payload: &[u8]) -> Option<CopyDescriptor> {
        self.copy_desc.take()
    }

    fn copy_source(&self, desc: &CopyDescriptor) -> Option<std::sync::Weak<Export>> {
        // The peer `copy_parts` named and checked the reservations of. Its own LU's export
        // (named as the session's, run from the session's own) is not looked up by name. A
        // name no peer has (none today) matches no export: refused, never unchecked.
        let peer = self.peers.iter().find(|p| p.name == desc.source);
        Some(peer.map_or_else(std::sync::Weak::new, |p| p.export.clone()))
    }

    fn attached(&mut self) {
        for p in &mut self.pr {
            let now = p.lu.current();
            p.install(&now);
        }
    }

    fn reservations_changed(&mut self, update: &Update) {
        for p in &mut self.pr {
            p.install(update);
        }
    }

    fn take_broadcast(&mut self, req: &Req) -> Option<std::sync::Arc<Update>> {
        // The broadcast's own LU's: an update left behind elsewhere must never stand in for it.
        self.pr.get_mut(req.target as usize)?.outgoing.take()
    }

    /// Also true when a task management function's response is due (`lift` in `decode`),
    /// which needs no slot either: it must not wait for one to free.
    fn next_is_data(&self, rx: &[u8]) -> bool {
        rx.first().is_some_and(|b| b & 0x3f == op::DATA_OUT)
            || self.fence.as_ref().is_some_and(|f| f.waiting.is_empty())
    }

    /// NOP-Out, task management, Text and SNACK are answered by `decode` itself; a Logout
    /// becomes a request that runs in no slot (it answers the writes waiting for data, which
    /// hold the slots, and closes the connection). A request `decode` may return first (one
    /// waiting untaken, a compound command's next part) waits for a slot in the reactor as
    /// any does.
    fn needs_no_slot(&self, rx: &[u8]) -> bool {
        self.next_is_data(rx)
            || rx.first().is_some_and(|b| {
                matches!(
                    b & 0x3f,
                    op::NOP_OUT | op::TMF_REQ | op::TEXT_REQ | op::SNACK | op::LOGOUT_REQ
                )
            })
    }

    /// The answers larger than the reactor's slack are the NOP-In echoing a ping's data (up to
    /// our MaxRecvDataSegmentLength, 256 KiB), the Text Response (`TEXT_ANSWER_MAX`) and
    /// PERSISTENT RESERVE IN (READ FULL STATUS lists every registration, up to its 64 KiB
    /// allocation length). The other SCSI commands answered here write far less: the largest
    /// answer, REPORT SUPPORTED OPERATION CODES of all commands, is about 1 KiB.
    fn reply_bound(&self, rx: &[u8]) -> usize {
        let Some(bhs) = rx.get(..BHS_LEN) else {
            return 0;
        };
        let dlen = u32::from_be_bytes([0, bhs[5], bhs[6], bhs[7]]) as usize;
        if bhs[0] & 0x3f == op::SCSI_CMD && bhs[32] == scsi::op::PERSISTENT_RESERVE_IN {
            let edtl = u32::from_be_bytes([bhs[20], bhs[21], bhs[22], bhs[23]]) as usize;
            let alloc = u16::from_be_bytes([bhs[39], bhs[40]]) as usize;
            let data = alloc.min(edtl);
            return data + self.data_in_framing(data);
        }
        let data = match bhs[0] & 0x3f {
            op::NOP_OUT => dlen,
            op::TEXT_REQ => TEXT_ANSWER_MAX,
            _ => return 0,
        };
        // Header, header digest, data, padding, data digest.
        Bhs::prefix_len(&self.d) + data.min(self.neg.send_max as usize) + 3 + DIGEST_LEN
    }

    fn read_framing(&self, req: &Req) -> ReadFraming {
        let send = extra_of(req);
        if send == req.length && send <= self.neg.send_max && send <= self.neg.max_burst {
            ReadFraming::Contiguous {
                prefix: Bhs::prefix_len(&self.d),
                suffix: iscsi::suffix_len(send as usize, &self.d),
            }
        } else {
            ReadFraming::Chunked {
                framing: self.data_in_framing(send as usize),
            }
        }
    }

    fn block_status_extents(&self, req: &Req) -> usize {
        // A descriptor per extent (one may be cut short by the allocation length), at least
        // one.
        let room = (extra_of(req) as usize).saturating_sub(8);
        room.div_ceil(scsi::LBA_STATUS_DESCRIPTOR_LEN).max(1)
    }

    fn block_status_len(&self, req: &Req, extents: usize) -> usize {
        // What scsi::lba_status writes, a header and a descriptor per extent (none is split:
        // a query spans at most 1 GiB), cut to the allocation length; sent as Data-In.
        let send = (extra_of(req) as usize).min(8 + scsi::LBA_STATUS_DESCRIPTOR_LEN * extents);
        send + self.data_in_framing(send)
    }

    /// The suffix is padding to four bytes, then the data digest when DataDigest is CRC32C.
    fn read_suffix_digests(&self, _req: &Req) -> bool {
        self.d.data
    }

    fn finish_read_reply(&mut self, req: &Req, prefix: &mut [u8], data: &[u8], suffix: &mut [u8]) {
        // A function this READ was the last one waited for is answered by `decode` (this
        // answer goes out from its own buffer: nothing may be put into the transmit buffer
        // behind it here), which `next_is_data` lets run even when no slot is free.
        self.settle(itt_of(req), req.target);
        let res = residual_of(req);
        let mut b = Bhs::new(op::DATA_IN, flag::FINAL | flag::STATUS | res.flags());
        b.itt(itt_of(req)).set32(20, RESERVED_TAG);
        self.stamp(&mut b, true);
        b.0[3] = GOOD;
        b.set32(44, res.count());
        self.scratch.clear();
        b.encode_prefix(data.len(), &self.d, &mut self.scratch);
        prefix.copy_from_slice(&self.scratch);
        iscsi::fill_suffix(data, &self.d, suffix);
    }

    fn encode_read(&mut self, req: &Req, data: &[u8], tx: &mut Vec<u8>) {
        if reply_of(req) == Reply::Part {
            // The read of a compare: nothing goes to the initiator.
            if let Some((want, diff)) = self.compare.as_mut() {
                *diff = want
                    .iter()
                    .zip(data)
                    .position(|(a, b)| a != b)
                    .map(|i| i as u64);
            }
            self.settle(itt_of(req), req.target);
            self.part_done(req, Status::Ok, tx);
            self.lift(tx);
            return;
        }
        self.read_data_in(req, data, tx, None);
    }

    fn encode_read_framing(
        &mut self,
        req: &Req,
        data: &[u8],
        tx: &mut Vec<u8>,
        pieces: &mut Vec<Piece>,
    ) -> bool {
        // Small data segments make pieces that cost more to send one by one than to copy, and
        // a read answering less than it read (a residual) would hold its whole buffer for part
        // of it: both are copied.
        if reply_of(req) == Reply::Part
            || (self.neg.send_max as usize) < MIN_PIECE
            || extra_of(req) as usize != data.len()
        {
            return false;
        }
        self.read_data_in(req, data, tx, Some(pieces));
        true
    }

    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
        let itt = itt_of(req);
        self.settle(itt, req.target);
        if let Some((a, seq)) = self.announced.filter(|(a, _)| follows_of(req) && *a == itt) {
            // Refused before it had a slot: its unsolicited data is dropped as it comes.
            self.announced = None;
            self.drain(a, seq);
        }
        let answered = match reply_of(req) {
            Reply::Logout => {
                let mut b = Bhs::new(op::LOGOUT_RSP, flag::FINAL);
                b.itt(itt);
                self.stamp(&mut b, true);
                b.encode(&[], &self.d, tx);
                true
            }
            Reply::Part => self.part_done(req, status, tx),
            kind => {
                let res = residual_of(req);
                match status {
                    Status::Ok => self.response(itt, GOOD, None, res, tx),
                    // SYNCHRONIZE CACHE of a medium without a cache to flush.
                    Status::Unsupported if kind == Reply::Flush => {
                        self.response(itt, GOOD, None, res, tx)
                    }
                    st => {
                        let modifies = matches!(req.kind, Kind::Block(op) if op.modifies());
                        let s = sense_of(st, modifies);
                        self.response(itt, CHECK_CONDITION, Some(&s), res, tx);
                    }
                }
                true
            }
        };
        // A function waiting for this command is answered right behind it.
        self.lift(tx);
        answered
    }

    fn block_status_reply(&mut self, req: &Req, extents: &[(u32, bool)], tx: &mut Vec<u8>) -> bool {
        self.settle(itt_of(req), req.target);
        let shift = self.luns[req.target as usize].shift;
        let lba = req.offset >> shift;
        let d = scsi::lba_status(lba, &whole_blocks(extents, shift), extra_of(req));
        let res = Residual::of(residual_of(req).count(), d.len() as u32);
        self.data_in(itt_of(req), &d, res, tx, None);
        self.lift(tx);
        true
    }
}

/// Extents of bytes (length, hole) from a block boundary as runs of whole blocks of
/// `1 << shift` bytes: a block any data touches is mapped, a block wholly in holes
/// deallocated (SBC-4 GET LBA STATUS: a descriptor says deallocated only of blocks that are),
/// neighbours of one status merged. A backend may see holes finer than the LU's blocks (a
/// filesystem of 1 KiB blocks under an export of 4 KiB ones); shifted one by one, such
/// extents moved every later descriptor and could call a block with data deallocated.
fn whole_blocks(extents: &[(u32, bool)], shift: u32) -> Vec<(u64, bool)> {
    let mut out: Vec<(u64, bool)> = Vec::new();
    let (mut at, mut done) = (0u64, 0u64);
    for &(n, hole) in extents {
        at += u64::from(n);
        let end = if hole {
            at >> shift
        } else {
            at.div_ceil(1 << shift)
        };
        if end <= done {
            continue;
        }
        match out.last_mut() {
            Some((len, h)) if *h == hole => *len += end - done,
            _ => out.push((end - done, hole)),
        }
        done = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use blkwire_backend::{Export, ExportSpec};

    use super::*;

    fn fe(max_burst: u32) -> Iscsi {
        fe_luns(max_burst, &[(0, "m=mem:1M")])
    }

    /// A backend out of space is a thin LU out of space (Linux: ENOSPC), not an LBA out of
    /// range, which only a request past the LU's end is.
    #[test]
    fn no_space_is_a_space_allocation_failure_not_an_lba_out_of_range() {
        assert_eq!(
            sense_of(Status::NoSpace, true),
            Sense::new(scsi::sense::key::DATA_PROTECT, 0x27, 0x07)
        );
        assert_eq!(
            sense_of(Status::OutOfRange, true),
            Sense::lba_out_of_range()
        );
    }

    /// The LU's block is the unit the export takes I/O in: an O_DIRECT export of a
    /// 512-byte-sector device gets 4 KiB blocks, or every 512-byte READ would be refused.
    #[test]
    fn the_block_is_the_unit_the_export_takes_io_in() {
        let plain = Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap();
        assert_eq!(lun_info(&plain, 1 << 20, 1 << 20, false).block_size, 512);
        let direct = Export::new(
            "d",
            Arc::new(blkwire_backend::testing::Direct512(plain.backend().clone())),
            false,
        );
        let info = lun_info(&direct, direct.size(), 1 << 20, false);
        assert_eq!(u64::from(info.block_size), direct.alignment());
        assert_eq!(info.blocks, (1 << 20) / 4096);
    }

    /// A connection with these (LUN, export spec) LUNs, as targets 0, 1, ... (their
    /// reservations each their own, detached from any registry).
    fn fe_luns(max_burst: u32, luns: &[(u64, &str)]) -> Iscsi {
        let luns = luns
            .iter()
            .map(|&(lun, spec)| {
                let export = Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
                SetupLun {
                    lun,
                    size: export.size(),
                    export,
                    copy: CopyLimits::default(),
                    reservations: PrLu::detached(),
                }
            })
            .collect();
        setup(max_burst, "iqn.test", luns)
    }

    /// A connection of `initiator` to one LU (LUN 0) whose reservations are `lu`.
    fn fe_on(max_burst: u32, initiator: &str, lu: Arc<PrLu>) -> Iscsi {
        let luns = vec![SetupLun {
            lun: 0,
            export: Arc::new(Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap()),
            size: 1 << 20,
            copy: CopyLimits::default(),
            reservations: lu,
        }];
        setup(max_burst, initiator, luns)
    }

    fn setup(max_burst: u32, initiator: &str, luns: Vec<SetupLun>) -> Iscsi {
        Iscsi::new(setup_of(max_burst, initiator, luns))
    }

    fn setup_of(max_burst: u32, initiator: &str, luns: Vec<SetupLun>) -> IscsiSetup {
        IscsiSetup {
            neg: Negotiated {
                max_burst,
                first_burst: 8192,
                send_max: 8192,
                recv_max: 256 << 10,
                ..Negotiated::default()
            },
            statsn: 100,
            expcmdsn: 0,
            depth: 4,
            granted: None,
            luns,
            target: "iqn.2026-11.io.blkwire:m".into(),
            initiator: initiator.into(),
            isid: [0; 6],
            max_io: 1 << 20,
            peers: Vec::new(),
            list_room: Reservation::detached(LIST_ROOM),
        }
    }

    fn cmd(itt: u32, cmdsn: u32, cdb: &[u8], edtl: u32, write: bool, data: &[u8]) -> Vec<u8> {
        let f = flag::FINAL | if write { flag::WRITE } else { flag::READ } | 1;
        let mut b = Bhs::new(op::SCSI_CMD, f);
        b.itt(itt).set32(20, edtl).set32(24, cmdsn);
        b.0[32..32 + cdb.len()].copy_from_slice(cdb);
        let mut out = Vec::new();
        b.encode(data, &Digests::default(), &mut out);
        out
    }

    fn be32(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
    }

    /// A command PDU addressed to LUN `lun` (SAM-5 encoding).
    fn cmd_lun(lun: u64, itt: u32, cmdsn: u32, cdb: &[u8], edtl: u32) -> Vec<u8> {
        let mut pdu = cmd(itt, cmdsn, cdb, edtl, false, &[]);
        pdu[8..16].copy_from_slice(&scsi::lun_to_wire(lun));
        pdu
    }

    /// (sense key, ASC, ASCQ) of the CHECK CONDITION response at the front of `tx`.
    fn sense(tx: &[u8]) -> (u8, u8, u8) {
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, CHECK_CONDITION));
        (
            tx[BHS_LEN + 2 + 2] & 0xf,
            tx[BHS_LEN + 2 + 12],
            tx[BHS_LEN + 2 + 13],
        )
    }

    const REPORT_LUNS: [u8; 12] = [0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0];
    const TUR: [u8; 6] = [0; 6];

    /// The LUNs REPORT LUNS lists (its Data-In at the front of `tx`).
    fn reported(tx: &[u8]) -> Vec<u64> {
        assert_eq!(tx[0], op::DATA_IN);
        let d = &tx[BHS_LEN..];
        let n = be32(d, 0) as usize / 8;
        (0..n)
            .map(|i| scsi::lun_from_wire(d[8 + 8 * i..16 + 8 * i].try_into().unwrap()))
            .collect()
    }

    #[test]
    fn the_lun_field_selects_the_target_and_unknown_luns_are_absent() {
        let mut f = fe_luns(65536, &[(0, "a=mem:1M"), (300, "b=mem:2M")]);
        let mut tx = Vec::new();
        // READ(10) of LUN 300 (flat space addressing) goes to target 1.
        let Decoded::Request { req, .. } = f.decode(&cmd_lun(300, 1, 0, &READ10_ONE, 512), &mut tx)
        else {
            panic!("a request");
        };
        assert_eq!((req.target, req.offset), (1, 4096));
        f.taken(&req);
        assert!(f.reply(&req, Status::Ok, &mut tx));
        tx.clear();
        // READ CAPACITY(10) answers each LU's own size.
        let rc10 = [0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        for (lun, cmdsn, last) in [(0u64, 1u32, 2047u32), (300, 2, 4095)] {
            f.decode(&cmd_lun(lun, 10, cmdsn, &rc10, 8), &mut tx);
            assert_eq!(
                (tx[0], be32(&tx, BHS_LEN)),
                (op::DATA_IN, last),
                "LUN {lun}"
            );
            tx.clear();
        }
        f.decode(&cmd_lun(7, 11, 3, &REPORT_LUNS, 256), &mut tx);
        assert_eq!(
            reported(&tx),
            vec![0, 300],
            "REPORT LUNS to any LUN lists them all"
        );
        tx.clear();
        // A LUN the target does not have: LOGICAL UNIT NOT SUPPORTED, and INQUIRY's
        // peripheral qualifier 011b / type 1Fh.
        f.decode(&cmd_lun(7, 12, 4, &READ10_ONE, 512), &mut tx);
        assert_eq!(sense(&tx), (0x5, 0x25, 0));
        tx.clear();
        let inquiry = [0x12, 0, 0, 0, 96, 0];
        f.decode(&cmd_lun(7, 13, 5, &inquiry, 96), &mut tx);
        assert_eq!((tx[0], tx[BHS_LEN]), (op::DATA_IN, 0x7f));
    }

    /// An LU is as large as its session was admitted with, whatever its export grew to before
    /// the connection was set up (`export_resize` during the login): READ CAPACITY reports the
    /// admitted size, and a READ past it is LOGICAL BLOCK ADDRESS OUT OF RANGE, refused where
    /// the session's executor would refuse it.
    #[test]
    fn an_lu_is_the_size_its_session_was_admitted_with() {
        let export = Arc::new(Export::open(&ExportSpec::parse("g=null:1M").unwrap()).unwrap());
        let admitted = export.size();
        assert_eq!(export.resize(2 << 20), Ok(1 << 20));
        let lun = SetupLun {
            lun: 0,
            export,
            size: admitted,
            copy: CopyLimits::default(),
            reservations: PrLu::detached(),
        };
        let mut f = setup(65536, "iqn.test", vec![lun]);
        let mut tx = Vec::new();
        let rc10 = [0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        f.decode(&cmd(1, 0, &rc10, 8, false, &[]), &mut tx);
        assert_eq!((tx[0], be32(&tx, BHS_LEN)), (op::DATA_IN, 2047));
        tx.clear();
        // READ(10) of block 2048, the first past the admitted end.
        let past = [0x28, 0, 0, 0, 0x08, 0x00, 0, 0, 1, 0];
        f.decode(&cmd(2, 1, &past, 512, false, &[]), &mut tx);
        assert_eq!(sense(&tx), (0x5, 0x21, 0x00));
    }

    #[test]
    fn a_removed_lun_is_absent_and_the_others_report_the_change_once() {
        let mut f = fe_luns(65536, &[(0, "a=mem:1M"), (1, "b=mem:1M")]);
        let mut tx = Vec::new();
        f.fenced(1);
        f.decode(&cmd_lun(1, 1, 0, &READ10_ONE, 512), &mut tx);
        assert_eq!(sense(&tx), (0x5, 0x25, 0), "the removed LUN");
        tx.clear();
        // INQUIRY passes a pending unit attention; the next other command gets it, once.
        let inquiry = [0x12, 0, 0, 0, 36, 0];
        f.decode(&cmd_lun(0, 2, 1, &inquiry, 36), &mut tx);
        assert_eq!((tx[0], tx[BHS_LEN]), (op::DATA_IN, 0));
        tx.clear();
        f.decode(&cmd_lun(0, 3, 2, &TUR, 0), &mut tx);
        assert_eq!(
            sense(&tx),
            (0x6, 0x3f, 0x0e),
            "REPORTED LUNS DATA HAS CHANGED"
        );
        tx.clear();
        f.decode(&cmd_lun(0, 4, 3, &TUR, 0), &mut tx);
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, GOOD));
        tx.clear();
        // Removed again: REQUEST SENSE takes the unit attention as its data, with GOOD.
        f.fenced(1);
        f.decode(&cmd_lun(0, 40, 4, &[0x03, 0, 0, 0, 18, 0], 18), &mut tx);
        assert_eq!((tx[0], tx[3]), (op::DATA_IN, GOOD));
        assert_eq!((tx[BHS_LEN + 2] & 0xf, tx[BHS_LEN + 12]), (0x6, 0x3f));
        tx.clear();
        f.decode(&cmd_lun(0, 5, 5, &REPORT_LUNS, 256), &mut tx);
        assert_eq!(reported(&tx), vec![0]);
        tx.clear();
        // A request already with the reactor when its LU went: LOGICAL UNIT NOT SUPPORTED.
        let Decoded::Request { req, .. } = f.decode(&cmd_lun(0, 6, 6, &READ10_ONE, 512), &mut tx)
        else {
            panic!("a request");
        };
        f.taken(&req);
        assert!(f.reply(&req, Status::NoExport, &mut tx));
        assert_eq!(sense(&tx), (0x5, 0x25, 0));
    }

    #[test]
    fn lun_reset_releases_the_writes_of_that_lun_only() {
        let mut f = fe_luns(65536, &[(0, "a=mem:1M"), (1, "b=mem:1M")]);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        for (lun, itt, slot) in [(0u64, 1u32, 0u16), (1, 2, 1)] {
            let mut pdu = cmd(itt, itt - 1, &write10, 4096, true, &[]);
            pdu[8..16].copy_from_slice(&scsi::lun_to_wire(lun));
            let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
                panic!("a write");
            };
            assert_eq!(req.target as u64, lun);
            f.taken(&req);
            tx.clear();
            f.solicit(&req, slot, 0, 4096, &mut tx);
            assert_eq!(tx[0], op::R2T);
            assert_eq!(
                tx[8..16],
                scsi::lun_to_wire(lun),
                "the R2T names the write's LUN"
            );
        }
        tx.clear();
        let tmf = |lun: u64, function: u8| {
            let mut b = Bhs::new(op::TMF_REQ | iscsi::IMMEDIATE, flag::FINAL | function);
            b.itt(9).set32(20, RESERVED_TAG).set32(24, 2);
            let mut out = Vec::new();
            b.encode(&[], &Digests::default(), &mut out);
            out[8..16].copy_from_slice(&scsi::lun_to_wire(lun));
            out
        };
        // LOGICAL UNIT RESET of LUN 1: its write (slot 1) is released, LUN 0's stays.
        assert!(matches!(
            f.decode(&tmf(1, 5), &mut tx),
            Decoded::Release { slot: 1, .. }
        ));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 0));
        assert_eq!(f.next_release(), None, "nothing else released");
        tx.clear();
        // A LUN it does not have: LUN does not exist.
        assert!(matches!(
            f.decode(&tmf(4, 5), &mut tx),
            Decoded::Answered { .. }
        ));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 2));
        // ABORT TASK of LUN 0's write (ITT 1) names LUN 0: under LUN 1 it is not that task.
        let abort = |lun: u64| {
            let mut pdu = tmf(lun, 1);
            pdu[20..24].copy_from_slice(&1u32.to_be_bytes());
            pdu
        };
        tx.clear();
        assert!(
            !matches!(f.decode(&abort(1), &mut tx), Decoded::Release { .. }),
            "LUN 1 has no task 1"
        );
        assert_eq!(f.next_release(), None);
        tx.clear();
        assert!(matches!(
            f.decode(&abort(0), &mut tx),
            Decoded::Release { slot: 0, .. }
        ));
    }

    const READ10_ONE: [u8; 10] = [0x28, 0, 0, 0, 0, 8, 0, 0, 1, 0];

    #[test]
    fn a_read_is_one_data_in_with_its_status_and_a_retried_decode_is_the_same() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let pdu = cmd(7, 0, &READ10_ONE, 512, false, &[]);
        let Decoded::Request { req, len, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        assert_eq!(
            (req.kind, req.offset, req.length, len),
            (Kind::Block(BlockOp::Read), 4096, 512, pdu.len())
        );
        // Not taken (the reactor waits for memory): the same again, counted once.
        let Decoded::Request { req: again, .. } = f.decode(&pdu, &mut tx) else {
            panic!("the same request");
        };
        assert_eq!(again.cookie, req.cookie);
        f.taken(&req);
        assert_eq!(f.outstanding(), 1);
        let ReadFraming::Contiguous { prefix, suffix } = f.read_framing(&req) else {
            panic!("one Data-In");
        };
        assert_eq!((prefix, suffix), (BHS_LEN, 0));
        let (mut p, mut q) = (vec![0u8; prefix], vec![0u8; suffix]);
        f.finish_read_reply(&req, &mut p, &[0u8; 512], &mut q);
        assert_eq!(p[0], op::DATA_IN);
        assert_eq!(p[1], flag::FINAL | flag::STATUS);
        assert_eq!((be32(&p, 16), be32(&p, 24)), (7, 100), "ITT, StatSN");
        assert_eq!(
            (be32(&p, 28), be32(&p, 32)),
            (1, 4),
            "ExpCmdSN, MaxCmdSN: all 4 places free"
        );
        assert!(tx.is_empty());
    }

    /// A SCSI command PDU reading up to `edtl` bytes (`cdb` of at most 16 bytes), task `itt`,
    /// CmdSN `cmdsn`, with digests `d`: as an initiator writes it.
    fn read_command(d: &Digests, cdb: &[u8], itt: u32, edtl: u32, cmdsn: u32) -> Vec<u8> {
        let mut b = Bhs::new(op::SCSI_CMD, flag::FINAL | flag::READ | 1);
        b.itt(itt).set32(20, edtl).set32(24, cmdsn);
        b.0[32..32 + cdb.len()].copy_from_slice(cdb);
        let mut pdu = Vec::new();
        b.encode(&[], d, &mut pdu);
        pdu
    }

    /// GET LBA STATUS (SERVICE ACTION IN(16)) with this allocation length.
    fn get_lba_status(alloc_len: u32) -> [u8; 16] {
        let mut cdb = [0u8; 16];
        cdb[0] = 0x9e;
        cdb[1] = 0x12;
        cdb[10..14].copy_from_slice(&alloc_len.to_be_bytes());
        cdb
    }

    /// A READ(10) of `blocks` 512-byte blocks at LBA 0 asking for `edtl` bytes, decoded and
    /// taken by `f`.
    fn taken_read(f: &mut Iscsi, blocks: u16, edtl: u32) -> Req {
        let mut cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        // The command as `cmd` writes it, with the connection's digests.
        let pdu = read_command(&f.d, &cdb, 9, edtl, 0);
        let mut tx = Vec::new();
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        req
    }

    /// What `read_framing` sets aside for a chunked reply besides its data covers what
    /// `encode_read` writes, down to 512-byte segments and bursts that split them, with and
    /// without digests, for whole reads and reads that answer less than they read: the memory
    /// budget foresees it (`covers_request`).
    #[test]
    fn chunked_read_framing_covers_the_reply() {
        let data = vec![0x5a_u8; 1 << 20];
        for (send_max, max_burst) in [
            (512, 512),
            (512, 64 << 10),
            (4096, 6000),
            (20_000, 50_000),
            (64 << 10, 256 << 10),
        ] {
            for (header, digest) in [(false, false), (true, true)] {
                for (len, edtl) in [
                    (1 << 20, 1 << 20),
                    (1 << 20, (1 << 20) - 512),
                    (4096, 1024),
                    (4096, 0),
                ] {
                    let case = format!(
                        "segments {send_max}, bursts {max_burst}, digests {header}, read {len}, edtl {edtl}"
                    );
                    let mut f = fe(max_burst);
                    f.neg.send_max = send_max;
                    f.d = Digests {
                        header,
                        data: digest,
                    };
                    let r = taken_read(&mut f, (len / 512) as u16, edtl);
                    let framing = match f.read_framing(&r) {
                        ReadFraming::Chunked { framing } => framing,
                        ReadFraming::Contiguous { prefix, suffix } => prefix + suffix,
                    };
                    let mut tx = Vec::new();
                    f.encode_read(&r, &data[..len], &mut tx);
                    assert!(
                        tx.len() <= edtl as usize + framing,
                        "{case}: {} bytes written, {} foreseen",
                        tx.len(),
                        edtl as usize + framing
                    );
                }
            }
        }
    }

    /// What `block_status_len` foresees for a GET LBA STATUS reply covers what
    /// `block_status_reply` writes, for small and large allocation lengths, with and without
    /// digests and with segments small enough to split the parameter data into many PDUs: the
    /// memory budget covers that much before the query is taken (`covers_block_status`).
    #[test]
    fn lba_status_reply_is_within_what_the_budget_foresees() {
        for (send_max, max_burst) in [(512, 512), (8192, 64 << 10), (64 << 10, 1 << 20)] {
            for (header, digest) in [(false, false), (true, true)] {
                for alloc_len in [24u32, 4096, 1 << 20, u32::MAX] {
                    for n in [1, 1000, blkwire_backend::MAX_EXTENTS] {
                        let case = format!(
                            "segments {send_max}, bursts {max_burst}, digests {header}, \
                             allocation length {alloc_len}, {n} extents"
                        );
                        let mut f = fe(max_burst);
                        f.neg.send_max = send_max;
                        f.d = Digests {
                            header,
                            data: digest,
                        };
                        let cdb = get_lba_status(alloc_len);
                        let pdu = read_command(&f.d, &cdb, 9, alloc_len, 0);
                        let mut tx = Vec::new();
                        let req = match f.decode(&pdu, &mut tx) {
                            Decoded::Request { req, .. } => req,
                            _ => panic!("{case}: {tx:x?}"),
                        };
                        assert_eq!(req.kind, Kind::BlockStatus, "{case}");
                        f.taken(&req);
                        let extents: Vec<(u32, bool)> = (0..n).map(|i| (512, i % 2 == 1)).collect();
                        let mut tx = Vec::new();
                        assert!(f.block_status_reply(&req, &extents, &mut tx));
                        let bound = f.block_status_len(&req, n);
                        assert!(
                            tx.len() <= bound,
                            "{case}: {} bytes written, {bound} foreseen",
                            tx.len()
                        );
                    }
                }
            }
        }
    }

    /// Holes finer than the LU's blocks: a block any data touches is mapped, only blocks
    /// wholly in holes are deallocated, and every descriptor starts where the bytes it
    /// describes do (6 KiB of data, 6 KiB of hole, 4 KiB of data on 4 KiB blocks: LBAs 0-1
    /// mapped, 2 deallocated, 3 mapped; shifted one by one they said LBA 1 deallocated).
    #[test]
    fn lba_status_of_holes_finer_than_a_block_covers_whole_blocks() {
        assert_eq!(
            whole_blocks(&[(6144, false), (6144, true), (4096, false)], 12),
            [(2, false), (1, true), (1, false)]
        );
        assert_eq!(
            whole_blocks(
                &[(1024, true), (1024, false), (2048, true), (8192, true)],
                12
            ),
            [(1, false), (2, true)]
        );
        assert_eq!(whole_blocks(&[(1024, true)], 12), []);
        let mut f = fe_4k("1M");
        let pdu = read_command(&f.d, &get_lba_status(4096), 9, 4096, 0);
        let mut tx = Vec::new();
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("{tx:x?}");
        };
        f.taken(&req);
        let mut tx = Vec::new();
        let extents = [(6144, false), (6144, true), (4096, false)];
        assert!(f.block_status_reply(&req, &extents, &mut tx));
        // Data-In: the 48-byte header, then the parameter data: 8 bytes, 16 per descriptor.
        let d = &tx[48..];
        assert_eq!(be32(d, 0), 4 + 3 * 16, "three descriptors");
        let descriptors: Vec<(u64, u32, u8)> = d[8..8 + 3 * 16]
            .chunks(16)
            .map(|c| {
                (
                    u64::from_be_bytes(c[..8].try_into().unwrap()),
                    be32(c, 8),
                    c[12],
                )
            })
            .collect();
        assert_eq!(descriptors, [(0, 2, 0), (2, 1, 1), (3, 1, 0)]);
    }

    /// GET LBA STATUS asks the backend for no more extents than its allocation length holds
    /// descriptors (one cut short counts), at least one: what it reserves for the query's
    /// list follows, and the answer still fills the allocation length when there are more.
    #[test]
    fn lba_status_asks_for_what_the_allocation_length_holds() {
        for (alloc_len, want) in [
            (8u32, 1usize),
            (24, 1),
            (30, 2),
            (8 + 16 * 3, 3),
            (4096, 256),
            (8192, 512),
        ] {
            let mut f = fe(65536);
            let pdu = read_command(&f.d, &get_lba_status(alloc_len), 9, alloc_len, 0);
            let mut tx = Vec::new();
            let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
                panic!("{alloc_len}: {tx:x?}");
            };
            f.taken(&req);
            let max = f.block_status_extents(&req);
            assert_eq!(max, want, "allocation length {alloc_len}");
            // Those extents fill the allocation length (the LUN holds 2048 blocks).
            let extents: Vec<(u32, bool)> = (0..max).map(|i| (512, i % 2 == 1)).collect();
            let mut tx = Vec::new();
            assert!(f.block_status_reply(&req, &extents, &mut tx));
            let sent = (alloc_len as usize).min(8 + 16 * max);
            assert_eq!(be32(&tx, 4) as usize & 0xff_ffff, sent, "{alloc_len}");
        }
    }

    /// Data-In PDUs written as framing plus pieces (`encode_read_framing`) are, once the
    /// pieces are spliced in, the bytes `encode_read` writes: with and without digests, with
    /// data segments that do and do not divide the bursts. Segments under 16 KiB and reads
    /// answering less than they read are left to `encode_read`.
    #[test]
    fn read_framing_with_pieces_is_encode_read_spliced() {
        let data: Vec<u8> = (0..200 << 10).map(|i| (i * 7 % 251) as u8).collect();
        let blocks = (data.len() / 512) as u16;
        for (send_max, max_burst) in [(16 << 10, 64 << 10), (20_000, 50_000), (64 << 10, 1 << 20)] {
            for (header, digest) in [(false, false), (true, true)] {
                let case = format!("segments {send_max}, bursts {max_burst}, digests {header}");
                let open = || {
                    let mut f = fe(max_burst);
                    f.neg.send_max = send_max;
                    f.d = Digests {
                        header,
                        data: digest,
                    };
                    f
                };
                let (mut a, mut b) = (open(), open());
                let (ra, rb) = (
                    taken_read(&mut a, blocks, data.len() as u32),
                    taken_read(&mut b, blocks, data.len() as u32),
                );
                assert!(
                    matches!(b.read_framing(&rb), ReadFraming::Chunked { .. }),
                    "{case}"
                );
                let mut want = Vec::new();
                a.encode_read(&ra, &data, &mut want);
                let (mut framing, mut pieces) = (Vec::new(), Vec::new());
                assert!(
                    b.encode_read_framing(&rb, &data, &mut framing, &mut pieces),
                    "{case}"
                );
                assert!(
                    pieces.iter().all(|p| p.len <= send_max as usize),
                    "{case}: a piece per data segment"
                );
                assert_eq!(
                    pieces.iter().map(|p| p.len).sum::<usize>(),
                    data.len(),
                    "{case}"
                );
                let mut got = Vec::new();
                let mut at = 0;
                for p in &pieces {
                    got.extend_from_slice(&framing[at..p.at]);
                    got.extend_from_slice(&data[p.from..p.from + p.len]);
                    at = p.at;
                }
                got.extend_from_slice(&framing[at..]);
                assert!(
                    got == want,
                    "{case}: spliced framing differs from the copied reply"
                );
                assert_eq!((a.outstanding(), b.outstanding()), (0, 0), "{case}");
            }
        }
        // Small segments, and a residual: nothing written, for `encode_read` to do.
        let mut f = fe(64 << 10);
        let r = taken_read(&mut f, blocks, data.len() as u32);
        let (mut framing, mut pieces) = (Vec::new(), Vec::new());
        assert!(!f.encode_read_framing(&r, &data, &mut framing, &mut pieces));
        let mut f = fe(64 << 10);
        f.neg.send_max = 64 << 10;
        let r = taken_read(&mut f, blocks, data.len() as u32 - 512);
        assert!(!f.encode_read_framing(&r, &data, &mut framing, &mut pieces));
        assert!(framing.is_empty() && pieces.is_empty());
        assert_eq!(f.outstanding(), 1, "still the copy's to answer");
    }

    /// A Text Response in the full feature phase carries whole `key=NotUnderstood` pairs
    /// only, as many as fit MaxRecvDataSegmentLength: never one cut in two under F.
    #[test]
    fn a_text_response_holds_whole_pairs_within_the_segment_length() {
        let mut f = fe(65536);
        f.neg.send_max = 512;
        let keys: Vec<u8> = (0..20)
            .flat_map(|i| format!("X-{i:0>40}=1\0").into_bytes())
            .collect();
        let mut text = Bhs::new(op::TEXT_REQ | iscsi::IMMEDIATE, flag::FINAL);
        text.itt(8).set32(20, RESERVED_TAG);
        let mut pdu = Vec::new();
        text.encode(&keys, &f.d, &mut pdu);
        let mut tx = Vec::new();
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        let rsp = iscsi::decode(&tx, &f.d).unwrap();
        assert_eq!(rsp.opcode(), op::TEXT_RSP);
        let data = rsp.data;
        assert!(
            !data.is_empty() && data.len() <= 512,
            "{} bytes",
            data.len()
        );
        assert_eq!(data.last(), Some(&0), "ends after a whole pair");
        for pair in iscsi::pairs(data) {
            let (k, v) = pair.unwrap();
            assert!(k.starts_with("X-") && v == "NotUnderstood", "{k}={v}");
        }
    }

    /// What decode writes for a message never exceeds what `reply_bound` declared for it, or
    /// the reactor's 4 KiB slack for small replies (`reactor::conn::REPLY_SLACK`), which is all
    /// it makes room for otherwise: a 256 KiB ping echoed whole, with digests; a Text Request
    /// of more and longer keys than are read (each answered `key=NotUnderstood`); the largest
    /// SCSI answer built here (REPORT SUPPORTED OPERATION CODES of all commands with their
    /// timeouts) and a REPORT LUNS.
    #[test]
    fn answers_fit_the_room_reply_bound_declares() {
        const SLACK: usize = 4096;
        let mut f = fe(65536);
        f.d = Digests {
            header: true,
            data: true,
        };
        f.neg.send_max = 1 << 20;
        let ping: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
        let mut nop = Bhs::new(op::NOP_OUT | iscsi::IMMEDIATE, flag::FINAL);
        nop.itt(7).set32(20, RESERVED_TAG);
        let mut nop_pdu = Vec::new();
        nop.encode(&ping, &f.d, &mut nop_pdu);
        let keys: Vec<u8> = (0..1000)
            .flat_map(|i| format!("{i:0>63}=1\0").into_bytes())
            .collect();
        let mut text = Bhs::new(op::TEXT_REQ | iscsi::IMMEDIATE, flag::FINAL);
        text.itt(8).set32(20, RESERVED_TAG);
        let mut text_pdu = Vec::new();
        text.encode(&keys, &f.d, &mut text_pdu);
        let mut rsoc = [0u8; 12];
        rsoc[0] = 0xa3;
        rsoc[1] = 0x0c;
        rsoc[2] = 0x80;
        rsoc[6..10].copy_from_slice(&65535u32.to_be_bytes());
        let mut luns = [0u8; 12];
        luns[0] = 0xa0;
        luns[6..10].copy_from_slice(&65535u32.to_be_bytes());
        let encode_cmd =
            |cdb: &[u8], itt: u32, cmdsn: u32| read_command(&f.d, cdb, itt, 65535, cmdsn);
        let pdus = [
            ("ping", nop_pdu),
            ("text", text_pdu),
            ("report supported operation codes", encode_cmd(&rsoc, 9, 0)),
            ("report luns", encode_cmd(&luns, 10, 1)),
        ];
        for (what, pdu) in pdus {
            let room = f.reply_bound(&pdu).max(SLACK);
            let mut tx = Vec::new();
            assert!(
                matches!(f.decode(&pdu, &mut tx), Decoded::Answered { len } if len == pdu.len()),
                "{what}"
            );
            assert!(
                tx.len() <= room,
                "{what}: {} bytes written, {room} declared",
                tx.len()
            );
            match what {
                "ping" => assert!(tx.windows(ping.len()).any(|w| w == ping), "echoed whole"),
                "text" => {
                    let answer = iscsi::decode(&tx, &f.d).unwrap().data;
                    assert_eq!(answer.len(), TEXT_ANSWER_MAX, "the most keys, the longest");
                }
                _ => assert!(tx.len() > BHS_LEN, "{what}: answered with data"),
            }
        }
    }

    #[test]
    fn commands_outside_the_window_are_dropped() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let tur = [0u8; 6];
        let pdu = cmd(1, 5, &tur, 0, false, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Dropped { len } if len == pdu.len()));
        assert!(tx.is_empty(), "no answer to CmdSN 5 when 0 is due");
        let pdu = cmd(2, 0, &tur, 0, false, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 2));
        // The same CmdSN again is a duplicate: dropped too.
        tx.clear();
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Dropped { .. }));
        assert!(tx.is_empty(), "no answer to a duplicate");
    }

    #[test]
    fn a_write_is_solicited_in_bursts_and_data_no_r2t_asked_for_ends_the_connection() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 16, 0];
        let pdu = cmd(9, 0, &write10, 8192, true, &[1u8; 1024]);
        let Decoded::Request {
            req, payload_len, ..
        } = f.decode(&pdu, &mut tx)
        else {
            panic!("a request");
        };
        f.taken(&req);
        assert_eq!((req.length, payload_len), (8192, 1024));
        // The reactor holds it in slot 3 and asks for the rest: one burst at a time.
        f.solicit(&req, 3, 1024, 7168, &mut tx);
        assert_eq!(
            (tx[0], be32(&tx, 20), be32(&tx, 40), be32(&tx, 44)),
            (op::R2T, 3, 1024, 4096)
        );
        tx.clear();
        let data_out = |datasn: u32, offset: u32, n: usize| {
            let mut b = Bhs::new(op::DATA_OUT, flag::FINAL);
            b.itt(9).set32(20, 3).set32(36, datasn).set32(40, offset);
            let mut out = Vec::new();
            b.encode(&vec![2u8; n], &Digests::default(), &mut out);
            out
        };
        let d = data_out(0, 1024, 4096);
        assert!(matches!(
            f.decode(&d, &mut tx),
            Decoded::Data {
                slot: 3,
                offset: 1024,
                ..
            }
        ));
        assert_eq!(
            (tx[0], be32(&tx, 36), be32(&tx, 40), be32(&tx, 44)),
            (op::R2T, 1, 5120, 3072),
            "the next burst"
        );
        tx.clear();
        // Beyond what the R2T asked for: Reject, then the connection ends.
        let d = data_out(0, 5120, 4096);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
        assert_eq!(tx[0], op::REJECT);
        tx.clear();
        let mut f = fe(4096);
        assert!(matches!(
            f.decode(&data_out(0, 0, 512), &mut tx),
            Decoded::Violation(_)
        ));
        assert_eq!(tx[0], op::REJECT);
    }

    /// A burst whose last Data-Out lacks F ends all the same: the write has its data and runs,
    /// so ABORT TASK of it waits for its answer (reported before, a task said aborted would
    /// still have run).
    #[test]
    fn a_burst_whose_last_data_out_lacks_f_ends_its_sequence() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 16, 0];
        let pdu = cmd(9, 0, &write10, 8192, true, &[1u8; 1024]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        f.solicit(&req, 3, 1024, 7168, &mut tx);
        tx.clear();
        let data_out = |datasn: u32, offset: u32, n: usize, fin: bool| {
            let flags = if fin { flag::FINAL } else { 0 };
            let mut b = Bhs::new(op::DATA_OUT, flags);
            b.itt(9).set32(20, 3).set32(36, datasn).set32(40, offset);
            let mut out = Vec::new();
            b.encode(&vec![2u8; n], &Digests::default(), &mut out);
            out
        };
        assert!(matches!(
            f.decode(&data_out(0, 1024, 4096, true), &mut tx),
            Decoded::Data { slot: 3, .. }
        ));
        assert_eq!((tx[0], be32(&tx, 40)), (op::R2T, 5120), "the last burst");
        tx.clear();
        assert!(matches!(
            f.decode(&data_out(0, 5120, 3072, false), &mut tx),
            Decoded::Data { slot: 3, .. }
        ));
        assert!(tx.is_empty(), "{tx:x?}");
        // All its data in, the write runs; ABORT TASK waits for its answer.
        let abort = tmf_pdu(10, 1, 9);
        assert!(
            matches!(f.decode(&abort, &mut tx), Decoded::Answered { len } if len == abort.len())
        );
        assert!(tx.is_empty(), "answered before the running write: {tx:x?}");
        assert!(f.reply(&req, Status::Ok, &mut tx));
        let at = tx.len() - BHS_LEN;
        assert_eq!(
            (tx[0], tx[at], be32(&tx, at + 16)),
            (op::SCSI_RSP, op::TMF_RSP, 10),
            "the write's response, then the function's"
        );
    }

    /// A TASK MANAGEMENT FUNCTION REQUEST (immediate) for LUN 0: `function` on `rtt`.
    fn tmf_pdu(itt: u32, function: u8, rtt: u32) -> Vec<u8> {
        let mut b = Bhs::new(op::TMF_REQ | iscsi::IMMEDIATE, flag::FINAL | function);
        b.itt(itt).set32(20, rtt).set32(24, 1);
        let mut out = Vec::new();
        b.encode(&[], &Digests::default(), &mut out);
        out
    }

    /// ABORT TASK (ITT 10, task 1) of the one task, parked in slot 2: Function Complete and
    /// the slot released, nothing left outstanding; the same function again finds nothing
    /// ("task does not exist").
    fn abort_parked_task_1_in_slot_2(f: &mut Iscsi, tx: &mut Vec<u8>) {
        let abort = tmf_pdu(10, 1, 1);
        assert!(
            matches!(f.decode(&abort, tx), Decoded::Release { slot: 2, len } if len == abort.len())
        );
        assert_eq!(
            (tx[0], tx[2], be32(tx, 16)),
            (op::TMF_RSP, 0, 10),
            "Function Complete"
        );
        assert_eq!((f.outstanding(), f.next_release()), (0, None));
        tx.clear();
        assert!(matches!(f.decode(&abort, tx), Decoded::Answered { .. }));
        assert_eq!(
            (tx[0], tx[2]),
            (op::TMF_RSP, 1),
            "gone: the task does not exist"
        );
        tx.clear();
    }

    /// A WRITE parked in the reactor for memory before its R2T (with its immediate data, or
    /// none) is a task ABORT TASK finds: Function Complete, its slot released so it never
    /// runs, nothing more outstanding; ABORT TASK SET releases every parked write at once
    /// (`next_release`); one that left the wait is solicited as any other.
    #[test]
    fn abort_task_finds_a_write_parked_before_its_r2t() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        let park = |f: &mut Iscsi, itt: u32, slot: u16, imm: &[u8], tx: &mut Vec<u8>| {
            let pdu = cmd(itt, itt - 1, &write10, 4096, true, imm);
            let Decoded::Request {
                req, payload_len, ..
            } = f.decode(&pdu, tx)
            else {
                panic!("a request");
            };
            assert_eq!(payload_len, imm.len());
            f.taken(&req);
            f.parked(&req, slot);
            req
        };
        park(&mut f, 1, 2, &[5u8; 1024], &mut tx);
        assert!(tx.is_empty(), "no R2T while parked");
        assert_eq!(f.outstanding(), 1);
        abort_parked_task_1_in_slot_2(&mut f, &mut tx);
        // ABORT TASK SET: every parked write of the LU, all released by the one function.
        park(&mut f, 2, 0, &[], &mut tx);
        park(&mut f, 3, 1, &[6u8; 512], &mut tx);
        let Decoded::Release { slot, .. } = f.decode(&tmf_pdu(11, 2, RESERVED_TAG), &mut tx) else {
            panic!("released");
        };
        let mut slots = vec![slot];
        slots.extend(f.next_release());
        slots.sort();
        assert_eq!(slots, [0, 1]);
        assert_eq!((tx[2], f.next_release(), f.outstanding()), (0, None, 0));
        tx.clear();
        // Parked, then asked for its data once memory is there: an R2T, and aborts as usual.
        let req = park(&mut f, 4, 3, &[], &mut tx);
        f.unparked(3);
        f.solicit(&req, 3, 0, 4096, &mut tx);
        assert_eq!((tx[0], be32(&tx, 16), be32(&tx, 20)), (op::R2T, 4, 3));
        tx.clear();
        assert!(matches!(
            f.decode(&tmf_pdu(12, 1, 4), &mut tx),
            Decoded::Release { slot: 3, .. }
        ));
        assert_eq!(tx[2], 0);
    }

    /// TARGET COLD RESET would end every session of the target: refused ("function
    /// authorization failed"), and the tasks it would have ended go on; TARGET WARM RESET ends
    /// them.
    #[test]
    fn target_cold_reset_is_refused_and_ends_nothing() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        let Decoded::Request { req, .. } = f.decode(&cmd(1, 0, &write10, 4096, true, &[]), &mut tx)
        else {
            panic!("a request");
        };
        f.taken(&req);
        f.parked(&req, 2);
        assert!(matches!(
            f.decode(&tmf_pdu(10, 7, RESERVED_TAG), &mut tx),
            Decoded::Answered { .. }
        ));
        assert_eq!((tx[0], tx[2], be32(&tx, 16)), (op::TMF_RSP, 6, 10));
        assert_eq!((f.outstanding(), f.next_release()), (1, None));
        tx.clear();
        assert!(matches!(
            f.decode(&tmf_pdu(11, 6, RESERVED_TAG), &mut tx),
            Decoded::Release { slot: 2, .. }
        ));
        assert_eq!((tx[0], tx[2], f.outstanding()), (op::TMF_RSP, 0, 0));
    }

    /// A COMPARE AND WRITE of one block (ITT 7, CmdSN `cmdsn`) given its data after the R2T
    /// for it: its read, taken by the reactor and parked there (slot 4) for memory.
    fn compare_and_write_parked(f: &mut Iscsi, cmdsn: u32, tx: &mut Vec<u8>) -> Req {
        let pdu = cmd(7, cmdsn, &caw(1), 1024, true, &[]);
        assert!(matches!(f.decode(&pdu, tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], be32(tx, 16)), (op::R2T, 7));
        let ttt = be32(tx, 20);
        tx.clear();
        let Decoded::Request { req: read, .. } =
            f.decode(&data_out(7, ttt, 0, 0, &[0u8; 1024], true), tx)
        else {
            panic!("the compare's read");
        };
        f.taken(&read);
        f.parked(&read, 4);
        read
    }

    /// A Logout Request (immediate, close the session).
    fn logout_pdu(itt: u32) -> Vec<u8> {
        logout_for(itt, 0)
    }

    /// A Logout Request (immediate) with reason code `reason`.
    fn logout_for(itt: u32, reason: u8) -> Vec<u8> {
        let mut b = Bhs::new(op::LOGOUT_REQ | iscsi::IMMEDIATE, flag::FINAL | reason);
        b.itt(itt);
        let mut out = Vec::new();
        b.encode(&[], &Digests::default(), &mut out);
        out
    }

    /// A NOP-Out ping (immediate) answered with a NOP-In.
    fn nop_pdu(itt: u32) -> Vec<u8> {
        let mut b = Bhs::new(op::NOP_OUT | iscsi::IMMEDIATE, flag::FINAL);
        b.itt(itt).set32(20, RESERVED_TAG);
        let mut out = Vec::new();
        b.encode(&[], &Digests::default(), &mut out);
        out
    }

    /// A READ(10) of one block from LUN `lun`, handed to the reactor and taken.
    fn read_on(f: &mut Iscsi, lun: u64, itt: u32, tx: &mut Vec<u8>) -> Req {
        let pdu = cmd_lun(lun, itt, itt - 1, &READ10_ONE, 512);
        let Decoded::Request { req, .. } = f.decode(&pdu, tx) else {
            panic!("a read");
        };
        f.taken(&req);
        req
    }

    /// A READ parked in the reactor for memory (behind writes waiting for their data) is a
    /// task ABORT TASK finds: Function Complete, and its slot released so it never runs nor is
    /// answered (told "does not exist", an initiator may reuse its ITT, and the READ's late
    /// answer would pass for another command's). One that left the wait and runs is answered
    /// first: the function's response waits for it (RFC 7143 §4.2.3.3) and follows its
    /// answer right away. Meanwhile a NOP-Out is answered (an initiator drops a connection
    /// whose pings go unanswered), but another function waits behind the first.
    #[test]
    fn abort_task_finds_a_read_parked_for_memory_and_waits_for_one_that_runs() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let req = read_on(&mut f, 0, 1, &mut tx);
        f.parked(&req, 2);
        assert_eq!(f.outstanding(), 1);
        abort_parked_task_1_in_slot_2(&mut f, &mut tx);
        // Parked, then run once memory came back: it runs when ABORT TASK comes.
        let req = read_on(&mut f, 0, 2, &mut tx);
        f.parked(&req, 0);
        f.unparked(0);
        let abort = tmf_pdu(11, 1, 2);
        assert!(
            matches!(f.decode(&abort, &mut tx), Decoded::Answered { len } if len == abort.len())
        );
        assert!(tx.is_empty(), "a response before the running READ's answer");
        let nop = nop_pdu(12);
        assert!(matches!(f.decode(&nop, &mut tx), Decoded::Answered { len } if len == nop.len()));
        assert_eq!(
            (tx[0], be32(&tx, 16)),
            (op::NOP_IN, 12),
            "a ping answered while the function waits"
        );
        tx.clear();
        // Another function waits behind the first, unread.
        let second = tmf_pdu(13, 1, 99);
        assert!(matches!(f.decode(&second, &mut tx), Decoded::Need(_)));
        assert!(
            tx.is_empty(),
            "a second function decoded past the waiting one"
        );
        f.encode_read(&req, &[7u8; 512], &mut tx);
        assert_eq!((tx[0], be32(&tx, 16)), (op::DATA_IN, 2));
        let at = tx.len() - BHS_LEN;
        assert_eq!(
            (tx[at], tx[at + 2], be32(&tx, at + 16)),
            (op::TMF_RSP, 0, 11),
            "Function Complete, right behind the READ's answer"
        );
        let at = tx.len();
        assert!(
            matches!(f.decode(&second, &mut tx), Decoded::Answered { len } if len == second.len())
        );
        assert_eq!((tx[at], tx[at + 2]), (op::TMF_RSP, 1));
        assert_eq!(f.outstanding(), 0);
        tx.clear();
        // A READ answered from its own buffer (`finish_read_reply`): the response follows it
        // from `decode`, which the reactor runs even with no slot free (`next_is_data`).
        let req = read_on(&mut f, 0, 3, &mut tx);
        let abort = tmf_pdu(14, 1, 3);
        assert!(matches!(
            f.decode(&abort, &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(tx.is_empty() && !f.next_is_data(&[]));
        let (mut p, mut q) = (vec![0u8; BHS_LEN], vec![0u8; 0]);
        f.finish_read_reply(&req, &mut p, &[0u8; 512], &mut q);
        assert!(tx.is_empty() && f.next_is_data(&[]));
        assert!(matches!(
            f.decode(&nop, &mut tx),
            Decoded::Answered { len: 0 }
        ));
        assert_eq!((tx[0], tx[2], be32(&tx, 16)), (op::TMF_RSP, 0, 14));
        assert!(!f.next_is_data(&[]));
    }

    /// LOGICAL UNIT RESET gives up what of its LU waits for memory (a READ, GET LBA STATUS)
    /// and waits for what of its LU runs, not for another LU's; with nothing of its LU
    /// running it is answered at once. CLEAR TASK SET and the target resets do the same for
    /// their scope.
    #[test]
    fn lun_reset_gives_up_parked_requests_and_waits_for_its_lus_running_ones_only() {
        let mut f = fe_luns(4096, &[(0, "m=mem:1M"), (1, "m=mem:1M")]);
        let mut tx = Vec::new();
        let parked = read_on(&mut f, 1, 1, &mut tx);
        f.parked(&parked, 0);
        // GET LBA STATUS (16) of LUN 1, parked too.
        let mut cdb = [0u8; 16];
        cdb[0] = 0x9e;
        cdb[1] = 0x12;
        cdb[13] = 64;
        let Decoded::Request { req: status, .. } = f.decode(&cmd_lun(1, 2, 1, &cdb, 64), &mut tx)
        else {
            panic!("an allocation query: {tx:?}");
        };
        assert_eq!(status.kind, Kind::BlockStatus);
        f.taken(&status);
        f.parked(&status, 1);
        let other = read_on(&mut f, 0, 3, &mut tx);
        let mine = read_on(&mut f, 1, 4, &mut tx);
        assert!(tx.is_empty());
        assert_eq!(f.outstanding(), 4);
        let tmf = |lun: u64, function: u8, itt: u32| {
            let mut pdu = tmf_pdu(itt, function, RESERVED_TAG);
            pdu[8..16].copy_from_slice(&scsi::lun_to_wire(lun));
            pdu
        };
        let Decoded::Release { slot, .. } = f.decode(&tmf(1, 5, 20), &mut tx) else {
            panic!("released");
        };
        let mut slots = vec![slot];
        slots.extend(f.next_release());
        slots.sort();
        assert_eq!((slots, f.next_release()), (vec![0, 1], None));
        assert!(tx.is_empty(), "answered while LUN 1's READ runs");
        assert_eq!(f.outstanding(), 2);
        // LUN 0's READ answered: LUN 1's still runs.
        f.encode_read(&other, &[1u8; 512], &mut tx);
        let at = tx.len();
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert_eq!(tx.len(), at);
        assert_eq!(tx[0], op::DATA_IN);
        // A command of LUN 1 that came after the function is not waited for.
        let later = read_on(&mut f, 1, 5, &mut tx);
        assert_eq!(tx.len(), at);
        f.reply(&mine, Status::Io, &mut tx);
        assert_eq!(tx[at], op::SCSI_RSP);
        let at = tx.len() - BHS_LEN;
        assert_eq!(
            (tx[at], tx[at + 2], be32(&tx, at + 16)),
            (op::TMF_RSP, 0, 20)
        );
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        f.encode_read(&later, &[1u8; 512], &mut tx);
        assert_eq!(f.outstanding(), 0);
        // Nothing of LUN 1 runs while LUN 0's READ does: answered at once, for each function
        // whose scope holds no running task.
        let other = read_on(&mut f, 0, 6, &mut tx);
        for (lun, function) in [(1u64, 5u8), (1, 4), (1, 2)] {
            tx.clear();
            assert!(matches!(
                f.decode(&tmf(lun, function, 21), &mut tx),
                Decoded::Answered { .. }
            ));
            assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 0), "function {function}");
        }
        // A target reset waits for it.
        tx.clear();
        assert!(matches!(
            f.decode(&tmf(0, 6, 22), &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert!(tx.is_empty());
        f.reply(&other, Status::Ok, &mut tx);
        assert_eq!(tx[0], op::SCSI_RSP);
        let at = tx.len() - BHS_LEN;
        assert_eq!((tx[at], be32(&tx, at + 16)), (op::TMF_RSP, 22));
    }

    /// Task management gives up a compound command whole: a part parked for memory is
    /// released (and the connection serves the next compound command), a part running is
    /// waited for and then answers no one, and no later part is handed out.
    #[test]
    fn task_management_gives_up_a_compound_command_which_answers_no_one() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        // VERIFY (BYTCHK 01b) of one block: its read, compared in the frontend, waits for
        // memory.
        let verify = [0x2f, 0x02, 0, 0, 0, 0, 0, 0, 1, 0];
        let Decoded::Request { req: read, .. } =
            f.decode(&cmd(1, 0, &verify, 512, true, &[0u8; 512]), &mut tx)
        else {
            panic!("the compare's read");
        };
        assert_eq!((read.kind, itt_of(&read)), (Kind::Block(BlockOp::Read), 1));
        f.taken(&read);
        f.parked(&read, 3);
        let abort = tmf_pdu(10, 1, 1);
        assert!(matches!(
            f.decode(&abort, &mut tx),
            Decoded::Release { slot: 3, .. }
        ));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 0));
        assert_eq!(f.outstanding(), 0);
        tx.clear();
        // UNMAP of three ranges: served (not refused as a second list at once); its first
        // trim runs when ABORT TASK SET comes.
        let mut list = vec![0u8, 54, 0, 48, 0, 0, 0, 0];
        for lba in [8u64, 64, 128] {
            list.extend_from_slice(&lba.to_be_bytes());
            list.extend_from_slice(&4u32.to_be_bytes());
            list.extend_from_slice(&[0; 4]);
        }
        let unmap = [0x42, 0, 0, 0, 0, 0, 0, 0, 56, 0];
        let Decoded::Request { req: trim, .. } =
            f.decode(&cmd(2, 1, &unmap, 56, true, &list), &mut tx)
        else {
            panic!("the first trim: {tx:?}");
        };
        assert_eq!(trim.kind, Kind::Block(BlockOp::Trim));
        f.taken(&trim);
        assert!(matches!(
            f.decode(&tmf_pdu(11, 2, RESERVED_TAG), &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(tx.is_empty(), "answered while the trim runs");
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        // The trim's answer answers no one; the function's response goes out then.
        assert!(!f.reply(&trim, Status::Ok, &mut tx));
        assert_eq!(
            (tx.len(), tx[0], tx[2], be32(&tx, 16)),
            (BHS_LEN, op::TMF_RSP, 0, 11)
        );
        // No second trim: the command is over.
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert_eq!(f.outstanding(), 0);
    }

    /// VERIFY with BYTCHK and a VERIFICATION LENGTH of zero verifies nothing: GOOD, with no
    /// read handed out.
    #[test]
    fn a_byte_compare_verify_of_no_blocks_is_good() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let verify = [0x2f, 0x02, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(
            f.decode(&cmd(1, 0, &verify, 0, true, &[]), &mut tx),
            Decoded::Answered { .. }
        ));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, GOOD), "{tx:?}");
        assert_eq!(f.outstanding(), 0);
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
    }

    /// PERSISTENT RESERVE IN may answer up to its allocation length (READ FULL STATUS lists
    /// every registration): the room the reactor makes before decoding covers that much, not
    /// the slack for small answers it made before.
    #[test]
    fn persistent_reserve_in_declares_the_room_its_answer_may_take() {
        let f = fe(8192);
        let mut full_status = [0u8; 10];
        full_status[0] = scsi::op::PERSISTENT_RESERVE_IN;
        full_status[1] = 3; // READ FULL STATUS
        full_status[7..9].copy_from_slice(&0xffffu16.to_be_bytes());
        let pdu = cmd(1, 0, &full_status, 0xffff, false, &[]);
        assert!(f.reply_bound(&pdu) >= 0xffff + BHS_LEN * (0xffff / 8192));
        let short = cmd(1, 0, &full_status, 100, false, &[]);
        assert!(f.reply_bound(&short) < 8192, "EDTL bounds it too");
        assert_eq!(f.reply_bound(&cmd(1, 0, &TUR, 0, false, &[])), 0);
    }

    /// A byte-compare VERIFY whose EDTL is short of its verification length (8 blocks, 0 or
    /// 512 bytes of data) is refused INVALID FIELD IN CDB, as COMPARE AND WRITE's is: it used
    /// to compare what came (nothing, or one block) and answer GOOD for blocks never compared.
    #[test]
    fn a_byte_compare_verify_with_less_data_than_blocks_is_refused() {
        for edtl in [0u32, 512] {
            let mut f = fe(65536);
            let mut tx = Vec::new();
            let verify = [0x2f, 0x02, 0, 0, 0, 0, 0, 0, 8, 0];
            let data = vec![0u8; edtl as usize];
            assert!(matches!(
                f.decode(&cmd(1, 0, &verify, edtl, true, &data), &mut tx),
                Decoded::Answered { .. }
            ));
            assert_eq!(sense(&tx), (0x5, 0x24, 0), "EDTL {edtl}");
            assert_eq!(f.outstanding(), 0, "nothing read");
        }
    }

    /// A parameter list longer than EDTL is collected as far as EDTL, and the answer says the
    /// command wanted more (the O bit and the residual, RFC 7143 §11.4.5.1).
    #[test]
    fn a_parameter_list_longer_than_edtl_is_an_overflow() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let (mut cdb, list) = unmap_of_two_ranges();
        cdb[8] = 56; // 16 bytes more than the 40 sent
        let pdu = cmd(4, 0, &cdb, 40, true, &list);
        let Decoded::Request { req: a, .. } = f.decode(&pdu, &mut tx) else {
            panic!("the first trim");
        };
        f.taken(&a);
        assert!(!f.reply(&a, Status::Ok, &mut tx));
        let Decoded::Request { req: b, .. } = f.decode(&[], &mut tx) else {
            panic!("the second trim");
        };
        f.taken(&b);
        assert!(f.reply(&b, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, GOOD));
        assert_eq!(
            (tx[1] & (flag::OVERFLOW | flag::UNDERFLOW), be32(&tx, 44)),
            (flag::OVERFLOW, 16)
        );
    }

    #[test]
    fn abort_task_releases_a_write_waiting_for_data_and_drops_its_late_data() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        let pdu = cmd(9, 0, &write10, 4096, true, &[]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        f.solicit(&req, 2, 0, 4096, &mut tx);
        tx.clear();
        let mut b = Bhs::new(op::TMF_REQ | iscsi::IMMEDIATE, flag::FINAL | 1);
        b.itt(10).set32(20, 9).set32(24, 1);
        let mut tmf = Vec::new();
        b.encode(&[], &Digests::default(), &mut tmf);
        assert!(
            matches!(f.decode(&tmf, &mut tx), Decoded::Release { slot: 2, len } if len == tmf.len())
        );
        assert_eq!(
            (tx[0], tx[2], be32(&tx, 16)),
            (op::TMF_RSP, 0, 10),
            "Function Complete"
        );
        assert_eq!(f.outstanding(), 0);
        tx.clear();
        // Data-Out the initiator sent before it aborted: dropped, the connection goes on.
        let mut b = Bhs::new(op::DATA_OUT, flag::FINAL);
        b.itt(9).set32(20, 2);
        let mut d = Vec::new();
        b.encode(&[0u8; 4096], &Digests::default(), &mut d);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { .. }) && tx.is_empty());
        // Aborting it again: the task does not exist.
        assert!(matches!(f.decode(&tmf, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 1));
    }

    /// Data-Out answering the R2T of a write given up by ABORT TASK, still coming once its
    /// slot serves another write, and Data-Out answering the R2T of a parameter list given
    /// up, are dropped until their F bit (§11.5.1: the initiator may keep sending): the
    /// connection goes on. Once the sequence ended, more is data no R2T asked for.
    #[test]
    fn data_out_for_r2ts_of_given_up_tasks_is_dropped_after_the_slot_is_reused() {
        let mut f = fe(4096);
        let mut tx = Vec::new();
        let write = |f: &mut Iscsi, itt: u32, cmdsn: u32, slot: u16, tx: &mut Vec<u8>| {
            let Decoded::Request { req, .. } =
                f.decode(&cmd(itt, cmdsn, &write10(16), 8192, true, &[]), tx)
            else {
                panic!("a write");
            };
            f.taken(&req);
            f.solicit(&req, slot, 0, 8192, tx);
            assert_eq!(
                (tx[0], be32(tx, 16), be32(tx, 20)),
                (op::R2T, itt, slot as u32)
            );
            tx.clear();
            req
        };
        write(&mut f, 9, 0, 2, &mut tx);
        let abort = tmf_pdu(10, 1, 9);
        assert!(matches!(
            f.decode(&abort, &mut tx),
            Decoded::Release { slot: 2, .. }
        ));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 0));
        tx.clear();
        // Slot 2 serves another write (the reactor freed it).
        let other = write(&mut f, 11, 1, 2, &mut tx);
        for fin in [false, true] {
            let d = data_out(9, 2, fin as u32, 2048 * fin as u32, &[1u8; 2048], fin);
            assert!(
                matches!(f.decode(&d, &mut tx), Decoded::Answered { len } if len == d.len()),
                "late data of the given-up write (F {fin})"
            );
            assert!(tx.is_empty());
        }
        let d = data_out(11, 2, 0, 0, &[2u8; 4096], true);
        assert!(matches!(
            f.decode(&d, &mut tx),
            Decoded::Data { slot: 2, .. }
        ));
        assert!(f.reply(&other, Status::Ok, &mut tx));
        tx.clear();
        let d = data_out(9, 2, 2, 4096, &[1u8; 512], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));

        // A parameter list solicited with its own TTT, then given up.
        let mut f = fe(65536);
        let mut tx = Vec::new();
        unmap_soliciting_its_list(&mut f, &mut tx);
        tx.clear();
        assert!(matches!(
            f.decode(&tmf_pdu(6, 1, 5), &mut tx),
            Decoded::Answered { .. }
        ));
        assert_eq!((tx[0], tx[2]), (op::TMF_RSP, 0));
        tx.clear();
        let d = data_out(5, PARAM_TTT, 0, 0, &[0u8; 24], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { len } if len == d.len()));
        assert!(tx.is_empty());
        // Its ITT used again: a command of its own.
        let tur = cmd(5, 1, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], be32(&tx, 16)), (op::SCSI_RSP, 5));
    }

    /// UNMAP (ITT 5, CmdSN 0) without its 24-byte list: answered with an R2T for it.
    fn unmap_soliciting_its_list(f: &mut Iscsi, tx: &mut Vec<u8>) {
        let unmap = [0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0];
        assert!(matches!(
            f.decode(&cmd(5, 0, &unmap, 24, true, &[]), tx),
            Decoded::Answered { .. }
        ));
        assert_eq!((tx[0], be32(tx, 20)), (op::R2T, PARAM_TTT));
    }

    /// Starts the UNMAP of `unmap_of_two_ranges` (ITT 4, CmdSN 0) and takes its first trim,
    /// which it returns: the command runs, its second part to come.
    fn unmap_running(f: &mut Iscsi, tx: &mut Vec<u8>) -> Req {
        let (cdb, list) = unmap_of_two_ranges();
        let Decoded::Request { req, .. } = f.decode(&cmd(4, 0, &cdb, 40, true, &list), tx) else {
            panic!("the first trim");
        };
        f.taken(&req);
        req
    }

    /// UNMAP of 4 blocks at LBA 8 and 4 at LBA 64: its CDB and its 40-byte parameter list.
    fn unmap_of_two_ranges() -> ([u8; 10], Vec<u8>) {
        let mut list = vec![0u8, 38, 0, 32, 0, 0, 0, 0];
        for lba in [8u64, 64] {
            list.extend_from_slice(&lba.to_be_bytes());
            list.extend_from_slice(&4u32.to_be_bytes());
            list.extend_from_slice(&[0; 4]);
        }
        ([0x42, 0, 0, 0, 0, 0, 0, 0, 40, 0], list)
    }

    #[test]
    fn unmap_becomes_trims_answered_after_the_last() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let (cdb, list) = unmap_of_two_ranges();
        let pdu = cmd(4, 0, &cdb, 40, true, &list);
        let Decoded::Request { req: a, len, .. } = f.decode(&pdu, &mut tx) else {
            panic!("the first trim");
        };
        assert_eq!(
            (a.kind, a.offset, a.length, len),
            (Kind::Block(BlockOp::Trim), 8 * 512, 2048, pdu.len())
        );
        f.taken(&a);
        // The second waits for the first's answer.
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert!(!f.reply(&a, Status::Ok, &mut tx) && tx.is_empty());
        let Decoded::Request { req: b, len: 0, .. } = f.decode(&[], &mut tx) else {
            panic!("the second trim, taking no bytes");
        };
        assert_eq!(b.offset, 64 * 512);
        f.taken(&b);
        assert!(f.reply(&b, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 4));
    }

    /// A connection to one LU of 4 KiB blocks (an O_DIRECT export of a 512-byte-sector device)
    /// of `size` bytes that reads as zeroes.
    fn fe_4k(size: &str) -> Iscsi {
        let plain = Export::open(&ExportSpec::parse(&format!("n=null:{size}")).unwrap()).unwrap();
        let direct = Export::new(
            "d",
            Arc::new(blkwire_backend::testing::Direct512(plain.backend().clone())),
            false,
        );
        let direct = Arc::new(direct);
        let lun = SetupLun {
            lun: 0,
            size: direct.size(),
            export: direct,
            copy: CopyLimits::default(),
            reservations: PrLu::detached(),
        };
        let f = setup(65536, "iqn.test", vec![lun]);
        assert_eq!(f.lu().info.block_size, 4096);
        f
    }

    /// Runs the compound command `pdu` to its answer, each part answered `Ok`: its parts as
    /// (kind, offset, length), and the answer.
    fn parts_of(f: &mut Iscsi, pdu: &[u8]) -> (Vec<(Kind, u64, u32)>, Vec<u8>) {
        let mut tx = Vec::new();
        let mut parts = Vec::new();
        let mut d = f.decode(pdu, &mut tx);
        while let Decoded::Request { req, .. } = d {
            parts.push((req.kind, req.offset, req.length));
            f.taken(&req);
            if f.reply(&req, Status::Ok, &mut tx) {
                break;
            }
            d = f.decode(&[], &mut tx);
        }
        (parts, tx)
    }

    /// An UNMAP descriptor of 2^20 blocks (MAXIMUM UNMAP LBA COUNT, so what Linux sends for
    /// each 4 GiB of a discard) on a LU of 4 KiB blocks covers 4 GiB: it is trimmed all of it,
    /// in trims a request carries, none of them empty (its length as a u32 came out 0, a
    /// trim of nothing answered GOOD).
    #[test]
    fn an_unmap_of_4_gib_trims_all_of_it() {
        let mut f = fe_4k("8G");
        assert_eq!(f.lu().info.max_unmap_blocks, 1 << 20);
        let mut list = vec![0u8, 22, 0, 16, 0, 0, 0, 0];
        list.extend_from_slice(&(1u64 << 20).to_be_bytes());
        list.extend_from_slice(&(1u32 << 20).to_be_bytes());
        list.extend_from_slice(&[0; 4]);
        let cdb = [0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0];
        let (parts, tx) = parts_of(&mut f, &cmd(4, 0, &cdb, 24, true, &list));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 4));
        let mut at = 4u64 << 30;
        for &(kind, offset, length) in &parts {
            assert_eq!((kind, offset), (Kind::Block(BlockOp::Trim), at));
            assert!(length > 0, "an empty trim: {parts:?}");
            at += u64::from(length);
        }
        assert_eq!(at, 8 << 30, "trimmed up to {at}: {parts:?}");
    }

    /// WRITE SAME(16) with NDOB collects no list, but while another compound command runs it
    /// is answered BUSY like any second one (the initiator sends it again later; it once
    /// started a compound of its own beside the UNMAP's, whose parts' answers were counted
    /// against each other, then was answered ABORTED COMMAND, which Linux retries at once, five
    /// times, and fails with EIO); the UNMAP goes on to its answer.
    #[test]
    fn a_write_same_without_data_is_busy_while_a_compound_command_runs() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let a = unmap_running(&mut f, &mut tx);
        let mut same = [0u8; 16];
        same[0] = 0x93;
        same[1] = 0x01;
        same[13] = 4;
        let d = f.decode(&cmd(5, 1, &same, 0, false, &[]), &mut tx);
        assert!(matches!(d, Decoded::Answered { .. }));
        assert_eq!((tx[0], be32(&tx, 16), tx[3]), (op::SCSI_RSP, 5, BUSY));
        tx.clear();
        assert!(!f.reply(&a, Status::Ok, &mut tx) && tx.is_empty());
        let Decoded::Request { req: b, len: 0, .. } = f.decode(&[], &mut tx) else {
            panic!("the UNMAP's second trim");
        };
        assert_eq!((b.kind, b.offset), (Kind::Block(BlockOp::Trim), 64 * 512));
        f.taken(&b);
        assert!(f.reply(&b, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 4));
    }

    /// A WRITE SAME(16) of a pattern over the most blocks it takes (2^20 - 1 of 4 KiB, nearly
    /// 4 GiB) is 4,096 WRITE parts of up to 1 MiB, made one at a time as the one before is
    /// answered: the connection never queues them all (about 450 KiB it kept for its life,
    /// outside the memory budget).
    #[test]
    fn a_write_same_of_4_gib_makes_its_parts_one_at_a_time() {
        let mut f = fe_4k("8G");
        let blocks = f.lu().info.max_write_same_blocks;
        assert_eq!(blocks, (1 << 20) - 1);
        let mut same = [0u8; 16];
        same[0] = 0x93;
        same[2..10].copy_from_slice(&(1u64 << 20).to_be_bytes());
        same[10..14].copy_from_slice(&(blocks as u32).to_be_bytes());
        let pattern = vec![7u8; 4096];
        let pdu = cmd(4, 0, &same, 4096, true, &pattern);
        let mut tx = Vec::new();
        let mut d = f.decode(&pdu, &mut tx);
        let (start, end) = (4u64 << 30, (4u64 << 30) + blocks * 4096);
        let mut at = start;
        let mut parts = 0;
        while let Decoded::Request { req, .. } = d {
            let want = (end - at).min(1 << 20) as u32;
            assert_eq!(
                (req.kind, req.offset, req.length),
                (Kind::Block(BlockOp::Write), at, want)
            );
            assert!(f.queued.len() <= 1, "{} runs queued", f.queued.len());
            at += u64::from(req.length);
            parts += 1;
            f.taken(&req);
            if f.reply(&req, Status::Ok, &mut tx) {
                break;
            }
            d = f.decode(&[], &mut tx);
        }
        assert_eq!((parts, at), (4096, end));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 4));
        assert!(f.queued.is_empty());
    }

    /// WRITE SAME without NDOB whose data is less than a block (none at all included) is a
    /// PARAMETER LIST LENGTH ERROR: it zeroed the range, an empty list reading as all zeroes.
    #[test]
    fn a_write_same_without_its_block_writes_nothing() {
        for data in [&[][..], &[0u8; 8][..]] {
            let mut f = fe(65536);
            let mut same = [0u8; 16];
            same[0] = 0x93;
            same[13] = 4;
            let mut tx = Vec::new();
            let pdu = cmd(4, 0, &same, data.len() as u32, true, data);
            let d = f.decode(&pdu, &mut tx);
            assert!(
                matches!(d, Decoded::Answered { .. }),
                "{} bytes of data: not answered at once",
                data.len()
            );
            assert_eq!((tx[0], be32(&tx, 16)), (op::SCSI_RSP, 4));
            assert_eq!(tx[3], CHECK_CONDITION);
            assert_eq!(sense(&tx).0, 0x5, "ILLEGAL REQUEST");
            assert!(f.queued.is_empty());
        }
    }

    /// COMPARE AND WRITE of no blocks (and no data) reads, compares and writes nothing and is
    /// no error (SBC-4 5.3): GOOD at once (`scsi_command`, before any list is collected), and
    /// the next command is decoded: no part of no bytes, nor a hold, is left behind.
    #[test]
    fn a_compare_and_write_of_no_blocks_is_good() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let d = f.decode(&cmd(3, 0, &caw(0), 0, true, &[]), &mut tx);
        assert!(matches!(d, Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 3));
        tx.clear();
        let tur = cmd(4, 1, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 4));
    }

    /// RFC 7143 §4.2.2.1: a command past the largest MaxCmdSN sent is outside the window and
    /// dropped silently, its CmdSN not taken, even as the one expected next (an initiator that
    /// ignores the window must not get more commands in than the connection has slots). Once a
    /// response has opened the window, the same command is taken.
    #[test]
    fn a_command_past_the_window_is_dropped_until_the_window_opens() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let mut running = Vec::new();
        for i in 0..4u32 {
            let Decoded::Request { req, .. } =
                f.decode(&cmd(i + 1, i, &READ10_ONE, 512, false, &[]), &mut tx)
            else {
                panic!("command {i}, inside the window");
            };
            f.taken(&req);
            running.push(req);
        }
        assert!(tx.is_empty());
        let fifth = cmd(5, 4, &READ10_ONE, 512, false, &[]);
        assert!(
            matches!(f.decode(&fifth, &mut tx), Decoded::Dropped { len } if len == fifth.len()),
            "CmdSN 4 past MaxCmdSN 3 was not dropped"
        );
        assert!(
            tx.is_empty(),
            "a command outside the window is not answered"
        );
        assert_eq!(f.expcmdsn, 4, "its CmdSN was taken");
        let ping = nop_pdu(12);
        let mut late = ping.clone();
        late[24..28].copy_from_slice(&4u32.to_be_bytes());
        late[0] &= !iscsi::IMMEDIATE; // it takes a CmdSN now, and 4 is outside the window too
        assert!(matches!(f.decode(&late, &mut tx), Decoded::Dropped { .. }));
        assert!(
            tx.is_empty(),
            "a non-immediate NOP-Out outside the window is not answered"
        );
        f.reply(&running[0], Status::Io, &mut tx);
        assert_eq!(
            (be32(&tx, 28), be32(&tx, 32)),
            (4, 4),
            "ExpCmdSN 4, MaxCmdSN 4: one place free"
        );
        tx.clear();
        assert!(
            matches!(f.decode(&fifth, &mut tx), Decoded::Request { .. }),
            "CmdSN 4 inside the window now"
        );
        assert_eq!(f.expcmdsn, 5);
    }

    /// The window is the largest MaxCmdSN ever sent, not the last: immediate commands take
    /// places without a CmdSN, so a later response says less than the initiator was given.
    #[test]
    fn the_window_is_the_largest_maxcmdsn_sent() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        for itt in [1, 2] {
            let mut pdu = cmd(itt, 0, &READ10_ONE, 512, false, &[]);
            pdu[0] |= iscsi::IMMEDIATE;
            let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
                panic!("immediate command {itt}");
            };
            f.taken(&req);
        }
        let tur = cmd(3, 0, &TUR, 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Answered { .. }));
        assert_eq!(
            (be32(&tx, 28), be32(&tx, 32)),
            (1, 2),
            "ExpCmdSN 1, MaxCmdSN 2: two places taken by the immediate commands"
        );
        tx.clear();
        for (itt, cmdsn) in [(4, 1), (5, 2), (6, 3)] {
            let pdu = cmd(itt, cmdsn, &READ10_ONE, 512, false, &[]);
            let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
                panic!("CmdSN {cmdsn} is within MaxCmdSN 3, given at login");
            };
            f.taken(&req);
        }
        let past = cmd(7, 4, &READ10_ONE, 512, false, &[]);
        assert!(matches!(f.decode(&past, &mut tx), Decoded::Dropped { .. }));
        assert_eq!(f.expcmdsn, 4, "CmdSN 4 is past every MaxCmdSN sent");
    }

    /// A window across the wrap of CmdSN, and one given at login larger than the depth allows.
    #[test]
    fn the_window_wraps_and_starts_at_what_the_login_gave() {
        for (granted, last_taken) in [(None, 1u32), (Some(2), 2)] {
            let export = Arc::new(Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap());
            let luns = vec![SetupLun {
                lun: 0,
                size: export.size(),
                export,
                copy: CopyLimits::default(),
                reservations: PrLu::detached(),
            }];
            let mut f = Iscsi::new(IscsiSetup {
                expcmdsn: u32::MAX - 1,
                granted,
                ..setup_of(65536, "iqn.test:wrap", luns)
            });
            let mut tx = Vec::new();
            let mut cmdsn = u32::MAX - 1;
            loop {
                let pdu = cmd(cmdsn.wrapping_add(10), cmdsn, &READ10_ONE, 512, false, &[]);
                match f.decode(&pdu, &mut tx) {
                    Decoded::Request { req, .. } => f.taken(&req),
                    Decoded::Dropped { .. } => break,
                    _ => panic!("CmdSN {cmdsn}: neither taken nor dropped"),
                }
                cmdsn = cmdsn.wrapping_add(1);
            }
            assert_eq!(
                cmdsn.wrapping_sub(1),
                last_taken,
                "login gave {granted:?}: the last CmdSN taken"
            );
            assert!(tx.is_empty());
        }
    }

    #[test]
    fn serial_arithmetic_wraps() {
        assert!(serial_after(1, 0));
        assert!(serial_after(0, u32::MAX), "0 follows 2^32 - 1");
        assert!(!serial_after(u32::MAX, 0));
        assert!(!serial_after(7, 7));
        assert!(!serial_after(5, 9));
    }

    /// A command collecting its parameter list keeps its task place in the window (MaxCmdSN):
    /// its parts will need a slot, which the initiator must not be able to fill first.
    #[test]
    fn a_parameter_list_being_collected_keeps_its_place_in_the_window() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        unmap_soliciting_its_list(&mut f, &mut tx);
        assert_eq!(
            (f.outstanding(), be32(&tx, 28), be32(&tx, 32)),
            (0, 1, 3),
            "ExpCmdSN 1, MaxCmdSN 3: three of the four places free, not four"
        );
    }

    /// A compound command given up while its part runs (ABORT TASK) answers no one, but that
    /// part's answer is still to come: until it has, no command that makes parts is decoded, or
    /// a new UNMAP would take it for its own first part's (answered GOOD with its trim still
    /// running).
    #[test]
    fn a_new_compound_command_waits_for_the_given_up_ones_running_part() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let a = unmap_running(&mut f, &mut tx);
        let abort = tmf_pdu(10, 1, 4);
        assert!(
            matches!(f.decode(&abort, &mut tx), Decoded::Answered { len } if len == abort.len())
        );
        assert!(tx.is_empty(), "the function waits for the running trim");
        let (cdb, list) = unmap_of_two_ranges();
        let again = cmd(5, 1, &cdb, 40, true, &list);
        assert!(
            matches!(f.decode(&again, &mut tx), Decoded::Need(_)),
            "a new UNMAP decoded while the given-up one's trim runs"
        );
        let nop = nop_pdu(12);
        assert!(matches!(f.decode(&nop, &mut tx), Decoded::Answered { .. }));
        assert_eq!(tx[0], op::NOP_IN, "pings still answered");
        tx.clear();
        // The trim's answer goes to no one; the function's response follows it.
        f.reply(&a, Status::Ok, &mut tx);
        assert_eq!((tx[0], tx[2], be32(&tx, 16)), (op::TMF_RSP, 0, 10));
        tx.clear();
        let Decoded::Request { req: b, .. } = f.decode(&again, &mut tx) else {
            panic!("the new UNMAP's first trim");
        };
        assert_eq!((itt_of(&b), b.offset), (5, 8 * 512));
    }

    /// The running part of a compound command given up by task management holds back only the
    /// commands that would make parts of their own (their CmdSN not taken until it answers):
    /// READ, WRITE, TEST UNIT READY and VERIFY without BYTCHK are decoded and handed out at
    /// once, and answered while it runs. Once it has answered (no one; the function's response
    /// follows it), the UNMAP that waited runs with its own parts and answers.
    #[test]
    fn a_given_up_compound_commands_running_part_holds_back_only_commands_that_make_parts() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let (cdb, list) = unmap_of_two_ranges();
        let Decoded::Request { req: orphan, .. } =
            f.decode(&cmd(4, 0, &cdb, 40, true, &list), &mut tx)
        else {
            panic!("the first trim");
        };
        f.taken(&orphan);
        assert!(matches!(
            f.decode(&tmf_pdu(10, 1, 4), &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(tx.is_empty(), "the function waits for the running trim");
        let pdu = cmd(20, 1, &READ10_ONE, 512, false, &[]);
        let Decoded::Request { req: read, len, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a READ held back by the given-up UNMAP's trim");
        };
        assert_eq!(
            (read.kind, itt_of(&read), len),
            (Kind::Block(BlockOp::Read), 20, pdu.len())
        );
        f.taken(&read);
        let pdu = cmd(21, 2, &write10(1), 512, true, &[7u8; 512]);
        let Decoded::Request {
            req: write,
            payload_len: 512,
            ..
        } = f.decode(&pdu, &mut tx)
        else {
            panic!("a WRITE held back by the given-up UNMAP's trim");
        };
        f.taken(&write);
        assert_eq!(f.outstanding(), 3, "the trim, the READ and the WRITE");
        for (itt, cmdsn, cdb) in [
            (22, 3, &[0u8; 6][..]),
            (23, 4, &[0x2f, 0, 0, 0, 0, 0, 0, 0, 1, 0]),
        ] {
            assert!(matches!(
                f.decode(&cmd(itt, cmdsn, cdb, 0, false, &[]), &mut tx),
                Decoded::Answered { .. }
            ));
            assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, itt));
            tx.clear();
        }
        // Those that make parts wait, untouched: UNMAP, WRITE SAME(16) NDOB, VERIFY with
        // BYTCHK, COMPARE AND WRITE, EXTENDED COPY.
        let mut same = [0u8; 16];
        same[0] = 0x93;
        same[1] = 0x01;
        same[13] = 4;
        let mut xcopy = [0u8; 16];
        xcopy[0] = 0x83;
        xcopy[13] = 64;
        let verify = [0x2f, 0x02, 0, 0, 0, 0, 0, 0, 1, 0];
        let unmap = cmd(5, 5, &cdb, 40, true, &list);
        for pdu in [
            unmap.clone(),
            cmd(6, 5, &same, 0, false, &[]),
            cmd(6, 5, &verify, 512, true, &[0u8; 512]),
            cmd(6, 5, &caw(1), 1024, true, &[0u8; 1024]),
            cmd(6, 5, &xcopy, 64, true, &[]),
        ] {
            assert!(
                matches!(f.decode(&pdu, &mut tx), Decoded::Need(n) if n <= pdu.len()),
                "{:#04x} decoded while the given-up UNMAP's trim runs",
                pdu[32]
            );
            assert_eq!((f.expcmdsn, tx.len()), (5, 0), "not taken");
        }
        let nop = nop_pdu(12);
        assert!(matches!(f.decode(&nop, &mut tx), Decoded::Answered { .. }));
        assert_eq!(tx[0], op::NOP_IN, "pings still answered");
        tx.clear();
        // The READ and the WRITE are answered while the trim runs; the function still waits.
        f.encode_read(&read, &[0u8; 512], &mut tx);
        assert!(f.reply(&write, Status::Ok, &mut tx));
        let at = tx.len() - BHS_LEN;
        assert_eq!((tx[0], be32(&tx, 16)), (op::DATA_IN, 20));
        assert_eq!(
            (tx[at], tx[at + 3], be32(&tx, at + 16)),
            (op::SCSI_RSP, GOOD, 21)
        );
        tx.clear();
        assert!(matches!(f.decode(&unmap, &mut tx), Decoded::Need(_)));
        // The trim's answer goes to no one; the function's response follows it.
        assert!(!f.reply(&orphan, Status::Ok, &mut tx));
        assert_eq!(
            (tx.len(), tx[0], tx[2], be32(&tx, 16)),
            (BHS_LEN, op::TMF_RSP, 0, 10)
        );
        tx.clear();
        // The UNMAP that waited runs both its trims, and is answered after its own last.
        let Decoded::Request { req: a, len, .. } = f.decode(&unmap, &mut tx) else {
            panic!("the waiting UNMAP's first trim");
        };
        assert_eq!((itt_of(&a), a.offset, len), (5, 8 * 512, unmap.len()));
        f.taken(&a);
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert!(!f.reply(&a, Status::Ok, &mut tx) && tx.is_empty());
        let Decoded::Request { req: b, .. } = f.decode(&[], &mut tx) else {
            panic!("the second trim");
        };
        assert_eq!((itt_of(&b), b.offset), (5, 64 * 512));
        f.taken(&b);
        assert!(f.reply(&b, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 5));
        assert_eq!(f.outstanding(), 0);
    }

    /// The EXTENDED COPY parameter list of one block-to-block segment within the LU of NAA
    /// `naa` (512-byte blocks): `blocks` from `src_lba` to `dst_lba`.
    fn xcopy_list(naa: u64, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
        xcopy_segment(&[naa], 0, blocks, src_lba, dst_lba)
    }

    /// The EXTENDED COPY parameter list of one block-to-block segment from the LU of target
    /// descriptor 0 to that of descriptor `dst`, one descriptor per NAA of `naas` (512-byte
    /// blocks each): `blocks` from `src_lba` to `dst_lba`.
    fn xcopy_segment(naas: &[u64], dst: u8, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        v[1] = 0x18; // no list identifier
        v[3] = 32 * naas.len() as u8;
        v[11] = 28;
        for naa in naas {
            let mut t = [0u8; 32];
            t[0] = 0xE4;
            t[4..8].copy_from_slice(&[0x01, 0x03, 0x00, 0x08]);
            t[8..16].copy_from_slice(&naa.to_be_bytes());
            t[30] = 0x02; // 512
            v.extend_from_slice(&t);
        }
        let mut s = [0u8; 28];
        s[0] = 0x02;
        s[3] = 0x18;
        s[7] = dst;
        s[10..12].copy_from_slice(&blocks.to_be_bytes());
        s[12..20].copy_from_slice(&src_lba.to_be_bytes());
        s[20..28].copy_from_slice(&dst_lba.to_be_bytes());
        v.extend_from_slice(&s);
        v
    }

    /// A parameter list is asked for only as far as its command uses it: an EXTENDED COPY list
    /// longer than the copy manager takes is refused before any of it is asked for (PARAMETER
    /// LIST LENGTH ERROR), and of an UNMAP list only the descriptors MAXIMUM UNMAP BLOCK
    /// DESCRIPTOR COUNT allows are.
    #[test]
    fn a_parameter_list_is_asked_for_only_as_far_as_its_command_uses_it() {
        let grant = CopyLimits {
            max_bytes: 16 << 20,
            max_range: 16 << 20,
            max_ranges: 8,
        };
        let lun = || SetupLun {
            lun: 0,
            export: Arc::new(Export::open(&ExportSpec::parse("w=mem:1M").unwrap()).unwrap()),
            size: 1 << 20,
            copy: grant,
            reservations: PrLu::detached(),
        };
        let mut f = setup(1 << 20, "iqn.test", vec![lun()]);
        let mut tx = Vec::new();
        let most = f.xlimits.max_list_length();
        let mut xcopy = [0u8; 16];
        xcopy[0] = 0x83;
        for (itt, n) in [(1, 1 << 20), (2, most + 1)] {
            xcopy[10..14].copy_from_slice(&n.to_be_bytes());
            f.decode(&cmd(itt, itt - 1, &xcopy, n, true, &[]), &mut tx);
            assert_eq!(sense(&tx), (0x5, 0x1a, 0), "a list of {n} bytes");
            tx.clear();
        }
        xcopy[10..14].copy_from_slice(&most.to_be_bytes());
        f.decode(&cmd(3, 2, &xcopy, most, true, &[]), &mut tx);
        assert_eq!(
            (tx[0], be32(&tx, 44)),
            (op::R2T, most),
            "the longest it takes"
        );
        let mut f = setup(1 << 20, "iqn.test", vec![lun()]);
        tx.clear();
        let unmap = [0x42, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0];
        f.decode(&cmd(4, 0, &unmap, 0xffff, true, &[]), &mut tx);
        assert_eq!((tx[0], be32(&tx, 44)), (op::R2T, 8 + 16 * 256 + 15));
        tx.clear();
        // What it asked for is the list: one descriptor, the rest padding.
        let (_, mut list) = unmap_of_two_ranges();
        list[3] = 16;
        list.resize(8 + 16 * 256 + 15, 0);
        let d = data_out(4, PARAM_TTT, 0, 0, &list, true);
        let Decoded::Request { req, .. } = f.decode(&d, &mut tx) else {
            panic!("the trim");
        };
        assert_eq!((req.offset, req.length), (8 * 512, 2048));
        f.taken(&req);
        assert!(f.reply(&req, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, GOOD));
        assert_eq!(be32(&tx, 44), 0xffff - (8 + 16 * 256 + 15), "the residual");
        // The most descriptors, then part of one more (which `parse_unmap` ignores): all of it
        // is asked for, and the list is good.
        let mut f = setup(1 << 20, "iqn.test", vec![lun()]);
        tx.clear();
        let mut list = vec![0u8; 8 + 16 * 256 + 8];
        let n = list.len() as u16;
        list[0..2].copy_from_slice(&(n - 2).to_be_bytes());
        list[2..4].copy_from_slice(&(n - 8).to_be_bytes());
        for i in 0..256usize {
            let d = &mut list[8 + 16 * i..8 + 16 * (i + 1)];
            d[..8].copy_from_slice(&(2 * i as u64).to_be_bytes());
            d[8..12].copy_from_slice(&1u32.to_be_bytes());
        }
        let mut unmap = [0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        unmap[7..9].copy_from_slice(&n.to_be_bytes());
        f.decode(&cmd(5, 0, &unmap, n.into(), true, &[]), &mut tx);
        assert_eq!((tx[0], be32(&tx, 44)), (op::R2T, n.into()), "all of it");
        tx.clear();
        let d = data_out(5, PARAM_TTT, 0, 0, &list, true);
        let Decoded::Request { req, .. } = f.decode(&d, &mut tx) else {
            panic!("refused: {tx:?}");
        };
        assert_eq!(
            (req.offset, req.length),
            (0, 512),
            "the first descriptor's trim"
        );
    }

    /// A parameter list is held in a buffer of exactly its length however its data comes, so
    /// within the room the connection reserved for it at login (LIST_ROOM): VERIFY with
    /// BYTCHK of 1999 blocks (not a power of two), its data in 8 KiB Data-Outs. Grown as the
    /// data came, its buffer passed the list's length by doubling (1 MiB here) before.
    #[test]
    fn a_parameter_list_stays_within_its_reserved_room() {
        let mut f = fe(1 << 20);
        let mut tx = Vec::new();
        let blocks = 1999u16;
        let want = blocks as usize * 512;
        let mut verify = [0x2f, 0x02, 0, 0, 0, 0, 0, 0, 0, 0];
        verify[7..9].copy_from_slice(&blocks.to_be_bytes());
        f.decode(&cmd(7, 0, &verify, want as u32, true, &[]), &mut tx);
        assert_eq!((tx[0], be32(&tx, 44)), (op::R2T, want as u32));
        let list = vec![0u8; want];
        let pieces: Vec<_> = list.chunks(8192).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let d = data_out(7, PARAM_TTT, i as u32, (i * 8192) as u32, piece, last);
            let decoded = f.decode(&d, &mut tx);
            if last {
                let Decoded::Request { req, .. } = decoded else {
                    panic!("the compare's read once the list is in");
                };
                assert_eq!(
                    (req.kind, req.length),
                    (Kind::Block(BlockOp::Read), want as u32)
                );
                break;
            }
            let held = f.params.as_ref().map(|p| p.data.capacity());
            assert_eq!(held, Some(want), "after {} of {want} bytes", (i + 1) * 8192);
        }
        assert!(f.params.is_none());
        let kept = f.compare.as_ref().map(|(c, _)| c.capacity());
        assert!(kept.is_some_and(|k| k <= LIST_ROOM), "{kept:?}");
    }

    /// The EXTENDED COPY parameter list of one block-to-block segment from the LU of NAA `src`
    /// into the LU of NAA `dst` (512-byte blocks each): `blocks` from LBA 0 to LBA 0.
    fn xcopy_between(src: u64, dst: u64, blocks: u16) -> Vec<u8> {
        xcopy_segment(&[src, dst], 1, blocks, 0, 0)
    }

    /// An EXTENDED COPY whose source is another export that an initiator holds under Exclusive
    /// Access is refused with RESERVATION CONFLICT to the others, as a READ of it would be,
    /// though the LU it was sent to is not reserved; once the reservation is released the same
    /// copy runs.
    #[test]
    fn extended_copy_from_an_export_another_initiator_reserved_is_a_reservation_conflict() {
        let export =
            |spec: &str| Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
        let (a, b) = (export("a=mem:1M"), export("b=mem:1M"));
        let table = crate::reservations::Table::default();
        let grant = CopyLimits {
            max_bytes: 16 << 20,
            max_range: 16 << 20,
            max_ranges: 8,
        };
        let lun = |e: &Arc<Export>| SetupLun {
            lun: 0,
            export: e.clone(),
            size: e.size(),
            copy: grant,
            reservations: table.lu(e),
        };
        // X logs in to B and reserves it, Exclusive Access.
        let mut x = setup(65536, "iqn.test:x", vec![lun(&b)]);
        let mut tx = Vec::new();
        let reg = cmd(1, 0, &prout(0, 0), 24, true, &pr::out_parameters(0, 0xAA));
        assert!(matches!(x.decode(&reg, &mut tx), Decoded::Answered { .. }));
        let ea = pr::kind::EXCLUSIVE_ACCESS;
        let res = cmd(2, 1, &prout(1, ea), 24, true, &pr::out_parameters(0xAA, 0));
        let Decoded::Request { req, .. } = x.decode(&res, &mut tx) else {
            panic!("a broadcast request");
        };
        assert_eq!(req.kind, Kind::Broadcast);
        // Y logs in to A, whose LUN 0 nobody reserved, with B among the exports it may open.
        let mut y = Iscsi::new(IscsiSetup {
            peers: vec![Peer {
                name: "b".into(),
                info: lun_info(&b, b.size(), 1 << 20, false),
                reservations: table.lu(&b),
                export: Arc::downgrade(&b),
            }],
            ..setup_of(65536, "iqn.test:y", vec![lun(&a)])
        });
        y.attached();
        let list = xcopy_between(y.peers[0].info.naa, y.luns[0].info.naa, 8);
        let mut xcopy = [0u8; 16];
        xcopy[0] = 0x83;
        xcopy[13] = list.len() as u8;
        tx.clear();
        let pdu = cmd(3, 0, &xcopy, list.len() as u32, true, &list);
        assert!(matches!(y.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        assert_eq!(
            (tx[0], tx[3], be32(&tx, 16)),
            (op::SCSI_RSP, RESERVATION_CONFLICT, 3),
            "B's data must not reach A"
        );
        assert!(y.queued.is_empty() && y.compound.is_none(), "nothing runs");
        // Released: the same copy runs, from B.
        let rel = cmd(4, 2, &prout(2, ea), 24, true, &pr::out_parameters(0xAA, 0));
        x.pending = None;
        assert!(matches!(x.decode(&rel, &mut tx), Decoded::Request { .. }));
        tx.clear();
        let pdu = cmd(5, 1, &xcopy, list.len() as u32, true, &list);
        let Decoded::Request { req, .. } = y.decode(&pdu, &mut tx) else {
            panic!("EXTENDED COPY refused: {tx:?}");
        };
        assert_eq!((req.kind, req.length), (Kind::Copy, 8 * 512));
        let desc = y.copy_descriptor(&req, &[]).expect("its descriptor");
        assert_eq!(desc.source, "b");
    }

    /// A read-only LUN beside a writable one, on one connection: the copy manager's MAXIMUM
    /// SEGMENT LENGTH is the writable LU's grant (the read-only one, granted none, takes no
    /// part), and an EXTENDED COPY into the writable LU runs.
    #[test]
    fn a_read_only_lun_leaves_extended_copy_to_the_others() {
        let grant = CopyLimits {
            max_bytes: 16 << 20,
            max_range: 16 << 20,
            max_ranges: 8,
        };
        let lun = |n: u64, spec: &str, copy: CopyLimits| SetupLun {
            lun: n,
            export: Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap()),
            size: 1 << 20,
            copy,
            reservations: PrLu::detached(),
        };
        let mut f = setup(
            65536,
            "iqn.test",
            vec![
                lun(0, "w=mem:1M", grant),
                lun(1, "r=mem:1M,ro", CopyLimits::default()),
            ],
        );
        let mut tx = Vec::new();
        // RECEIVE COPY RESULTS, OPERATING PARAMETERS: MAXIMUM SEGMENT LENGTH.
        let rcr = [0x84, 0x03, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0];
        assert!(matches!(
            f.decode(&cmd(1, 0, &rcr, 64, false, &[]), &mut tx),
            Decoded::Answered { .. }
        ));
        assert_eq!(tx[0], op::DATA_IN);
        assert_eq!(be32(&tx, BHS_LEN + 16), 16 << 20);
        tx.clear();
        let list = xcopy_list(f.luns[0].info.naa, 8, 0, 64);
        let mut xcopy = [0u8; 16];
        xcopy[0] = 0x83;
        xcopy[13] = list.len() as u8;
        let pdu = cmd(2, 1, &xcopy, list.len() as u32, true, &list);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!(
                "EXTENDED COPY refused: {:?}",
                (!tx.is_empty()).then(|| sense(&tx))
            );
        };
        assert_eq!(
            (req.kind, req.offset, req.length),
            (Kind::Copy, 64 * 512, 8 * 512)
        );
    }

    /// A COMPARE AND WRITE holds every command back while its read runs (a task management
    /// function too), but once its write runs and it is given up, only the commands that make
    /// parts wait for that write's answer, which answers no one. The next COMPARE AND WRITE then
    /// runs with its own read, and holds as usual.
    #[test]
    fn a_compare_and_write_given_up_while_its_write_runs_holds_back_only_commands_that_make_parts()
    {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let Decoded::Request { req: read, .. } =
            f.decode(&cmd(7, 0, &caw(1), 1024, true, &[0u8; 1024]), &mut tx)
        else {
            panic!("the compare's read");
        };
        compare_read(&mut f, &read, &[0u8; 512], &mut tx);
        let abort = tmf_pdu(10, 1, 7);
        let Decoded::Request { req: orphan, .. } = f.decode(&abort, &mut tx) else {
            panic!("the compare's write, before anything else");
        };
        assert_eq!(orphan.kind, Kind::Block(BlockOp::Write));
        f.taken(&orphan);
        assert!(matches!(
            f.decode(&abort, &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(tx.is_empty(), "the function waits for the running write");
        let tur = cmd(50, 1, &TUR, 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 50));
        tx.clear();
        let Decoded::Request { req: plain, .. } =
            f.decode(&cmd(51, 2, &READ10_ONE, 512, false, &[]), &mut tx)
        else {
            panic!("a READ held back by the given-up compare's write");
        };
        f.taken(&plain);
        let again = cmd(8, 3, &caw(1), 1024, true, &[0u8; 1024]);
        assert!(matches!(f.decode(&again, &mut tx), Decoded::Need(_)));
        // The write's answer answers no one: no response but the function's.
        assert!(!f.reply(&orphan, Status::Ok, &mut tx));
        assert_eq!((tx.len(), tx[0], be32(&tx, 16)), (BHS_LEN, op::TMF_RSP, 10));
        tx.clear();
        let Decoded::Request { req: own, .. } = f.decode(&again, &mut tx) else {
            panic!("the new compare's read");
        };
        assert_eq!(itt_of(&own), 8);
        compare_read(&mut f, &own, &[0u8; 512], &mut tx);
        let Decoded::Request { req: write, .. } = f.decode(&[], &mut tx) else {
            panic!("the new compare's write");
        };
        assert_eq!(
            (write.kind, itt_of(&write)),
            (Kind::Block(BlockOp::Write), 8)
        );
        f.taken(&write);
        assert!(f.reply(&write, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 8));
    }

    /// A frontend whose session negotiated InitialR2T=No (FirstBurstLength 8 KiB).
    fn fe_unsolicited(max_burst: u32) -> Iscsi {
        let mut f = fe(max_burst);
        f.neg.initial_r2t = false;
        f
    }

    /// A SCSI Command whose unsolicited Data-Out follows (F=0).
    fn cmd_more(itt: u32, cmdsn: u32, cdb: &[u8], edtl: u32, data: &[u8]) -> Vec<u8> {
        let mut pdu = cmd(itt, cmdsn, cdb, edtl, true, data);
        pdu[1] &= !flag::FINAL;
        pdu
    }

    fn data_out(itt: u32, ttt: u32, datasn: u32, offset: u32, data: &[u8], fin: bool) -> Vec<u8> {
        let mut b = Bhs::new(op::DATA_OUT, if fin { flag::FINAL } else { 0 });
        b.itt(itt)
            .set32(20, ttt)
            .set32(36, datasn)
            .set32(40, offset);
        let mut out = Vec::new();
        b.encode(data, &Digests::default(), &mut out);
        out
    }

    /// WRITE(10) of `blocks` 512-byte blocks at LBA 0.
    fn write10(blocks: u8) -> [u8; 10] {
        [0x2a, 0, 0, 0, 0, 0, 0, 0, blocks, 0]
    }

    #[test]
    fn unsolicited_data_goes_into_the_write_and_r2ts_ask_only_for_the_rest() {
        let mut f = fe_unsolicited(4096);
        let mut tx = Vec::new();
        // 16 KiB with 1 KiB of immediate data: unsolicited Data-Out up to the first burst
        // (8 KiB, the immediate data counted), R2Ts for the other 8 KiB.
        let pdu = cmd_more(9, 0, &write10(32), 16384, &[1u8; 1024]);
        let Decoded::Request {
            req, payload_len, ..
        } = f.decode(&pdu, &mut tx)
        else {
            panic!("a request");
        };
        assert_eq!((req.length, payload_len), (16384, 1024));
        assert!(
            f.data_follows(&req),
            "its buffer must be there for the data"
        );
        f.taken(&req);
        f.solicit(&req, 3, 1024, 15360, &mut tx);
        assert!(tx.is_empty(), "no R2T before the unsolicited data is in");
        let d = data_out(9, RESERVED_TAG, 0, 1024, &[2u8; 4096], false);
        assert!(matches!(
            f.decode(&d, &mut tx),
            Decoded::Data { slot: 3, offset: 1024, payload_len: 4096, len, .. } if len == d.len()
        ));
        assert!(tx.is_empty());
        let d = data_out(9, RESERVED_TAG, 1, 5120, &[2u8; 3072], true);
        assert!(matches!(
            f.decode(&d, &mut tx),
            Decoded::Data {
                slot: 3,
                offset: 5120,
                payload_len: 3072,
                ..
            }
        ));
        assert_eq!(
            (
                tx[0],
                be32(&tx, 20),
                be32(&tx, 36),
                be32(&tx, 40),
                be32(&tx, 44)
            ),
            (op::R2T, 3, 0, 8192, 4096),
            "the first R2T (R2TSN 0) asks for the first burst after the unsolicited data"
        );
        tx.clear();
        let d = data_out(9, 3, 0, 8192, &[3u8; 4096], true);
        assert!(matches!(
            f.decode(&d, &mut tx),
            Decoded::Data { offset: 8192, .. }
        ));
        assert_eq!((tx[0], be32(&tx, 36), be32(&tx, 40)), (op::R2T, 1, 12288));
    }

    /// A task aborted while its unsolicited data was still to come leaves that data to be
    /// dropped; a later command reusing its ITT (the initiator is done with it) has its own
    /// unsolicited data dropped in step, not checked against the aborted task's sequence.
    #[test]
    fn a_reused_itt_drains_its_own_unsolicited_data() {
        let mut f = fe_unsolicited(65536);
        let mut tx = Vec::new();
        let pdu = cmd_more(9, 0, &write10(16), 8192, &[1u8; 512]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        f.solicit(&req, 1, 512, 7680, &mut tx);
        let abort = tmf_pdu(77, 1, 9);
        assert!(!matches!(f.decode(&abort, &mut tx), Decoded::Violation(_)));
        tx.clear();
        // The initiator sends none of the rest and uses ITT 9 again: a write of no blocks
        // (answered at once) announcing 4 KiB of unsolicited data.
        let again = cmd_more(9, 1, &write10(0), 4096, &[]);
        let d = f.decode(&again, &mut tx);
        assert!(!matches!(d, Decoded::Violation(_)));
        tx.clear();
        let data = data_out(9, RESERVED_TAG, 0, 0, &[2u8; 4096], true);
        let d = f.decode(&data, &mut tx);
        assert!(
            matches!(d, Decoded::Answered { len } if len == data.len()),
            "{tx:x?}"
        );
        assert!(tx.is_empty(), "{tx:x?}");
    }

    #[test]
    fn unsolicited_data_without_immediate_data_and_past_the_write_length() {
        let mut f = fe_unsolicited(65536);
        let mut tx = Vec::new();
        // EDTL 8 KiB, the CDB moves 4 KiB: the initiator sends 8 KiB unsolicited; the write
        // takes its 4 KiB and the rest is dropped in step.
        let pdu = cmd_more(5, 0, &write10(8), 8192, &[]);
        let Decoded::Request {
            req, payload_len, ..
        } = f.decode(&pdu, &mut tx)
        else {
            panic!("a request");
        };
        assert_eq!((req.length, payload_len), (4096, 0));
        assert!(f.data_follows(&req));
        f.taken(&req);
        f.solicit(&req, 0, 0, 4096, &mut tx);
        let d = data_out(5, RESERVED_TAG, 0, 0, &[7u8; 6144], false);
        let Decoded::Data {
            slot: 0,
            offset: 0,
            len,
            payload_len: 4096,
            trailer,
        } = f.decode(&d, &mut tx)
        else {
            panic!("the write's part of it");
        };
        assert_eq!(
            (len, trailer),
            (d.len(), 2048),
            "the rest is skipped as trailer"
        );
        let d = data_out(5, RESERVED_TAG, 1, 6144, &[7u8; 2048], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { .. }));
        assert!(tx.is_empty(), "nothing to ask for: {tx:?}");
        // The sequence is over: more data for the ITT breaks the protocol.
        let d = data_out(5, RESERVED_TAG, 2, 8192, &[7u8; 512], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
    }

    #[test]
    fn unsolicited_data_past_the_first_burst_or_for_no_task_ends_the_connection() {
        let mut tx = Vec::new();
        // Past FirstBurstLength (8 KiB).
        let mut f = fe_unsolicited(65536);
        let pdu = cmd_more(9, 0, &write10(32), 16384, &[1u8; 1024]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        f.solicit(&req, 1, 1024, 15360, &mut tx);
        let d = data_out(9, RESERVED_TAG, 0, 1024, &[2u8; 8192], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
        assert_eq!(tx[0], op::REJECT);
        tx.clear();
        // A command announcing more unsolicited data than the first burst leaves room for.
        let mut f = fe_unsolicited(65536);
        let pdu = cmd_more(9, 0, &write10(32), 16384, &[1u8; 8192]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Violation(_)));
        tx.clear();
        // Unsolicited data for an ITT that announced none.
        let mut f = fe_unsolicited(65536);
        let d = data_out(44, RESERVED_TAG, 0, 0, &[2u8; 512], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
        assert_eq!(tx[0], op::REJECT);
        tx.clear();
        // DataSN out of step within the unsolicited sequence.
        let mut f = fe_unsolicited(65536);
        let pdu = cmd_more(9, 0, &write10(16), 8192, &[]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        f.solicit(&req, 1, 0, 8192, &mut tx);
        let d = data_out(9, RESERVED_TAG, 1, 0, &[2u8; 512], false);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
        tx.clear();
        // Under InitialR2T=Yes no unsolicited data may be announced.
        let mut f = fe(65536);
        let pdu = cmd_more(9, 0, &write10(16), 8192, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Violation(_)));
    }

    #[test]
    fn unsolicited_data_of_a_refused_or_answered_write_is_dropped_in_step() {
        let mut f = fe_unsolicited(65536);
        let mut tx = Vec::new();
        let pdu = cmd_more(9, 0, &write10(16), 8192, &[1u8; 512]);
        let Decoded::Request { req, .. } = f.decode(&pdu, &mut tx) else {
            panic!("a request");
        };
        f.taken(&req);
        // The reactor refuses it before it has a slot (out of memory, a fenced target).
        assert!(f.reply(&req, Status::NoMemory, &mut tx));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, CHECK_CONDITION));
        tx.clear();
        let d = data_out(9, RESERVED_TAG, 0, 512, &[2u8; 4096], false);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { len } if len == d.len()));
        let d = data_out(9, RESERVED_TAG, 1, 4608, &[2u8; 3584], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { .. }));
        assert!(tx.is_empty());
        // A command the frontend answers itself (zero blocks) announcing data: dropped too.
        let pdu = cmd_more(10, 1, &write10(0), 4096, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        assert_eq!(tx[0], op::SCSI_RSP);
        tx.clear();
        let d = data_out(10, RESERVED_TAG, 0, 0, &[2u8; 4096], true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { .. }));
        assert!(tx.is_empty());
        // But out of step still breaks the protocol.
        let pdu = cmd_more(11, 2, &write10(0), 4096, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        let d = data_out(11, RESERVED_TAG, 0, 512, &[2u8; 512], false);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Violation(_)));
    }

    /// COMPARE AND WRITE(16) of `blocks` 512-byte blocks at LBA 2.
    fn caw(blocks: u8) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0] = 0x89;
        c[9] = 2;
        c[13] = blocks;
        c
    }

    /// Runs the compare of a COMPARE AND WRITE whose read `decode` handed out, the read
    /// returning `current`.
    fn compare_read(f: &mut Iscsi, read: &Req, current: &[u8], tx: &mut Vec<u8>) {
        assert_eq!(
            (read.kind, read.offset, read.length),
            (Kind::Block(BlockOp::Read), 1024, 512)
        );
        f.taken(read);
        // Nothing is decoded while the compare runs.
        let tur = cmd(50, 1, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, tx), Decoded::Need(_)));
        assert!(matches!(f.read_framing(read), ReadFraming::Chunked { .. }));
        f.encode_read(read, current, tx);
    }

    #[test]
    fn compare_and_write_with_data_solicited_by_r2t() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let pdu = cmd(7, 0, &caw(1), 1024, true, &[]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        assert_eq!(
            (tx[0], be32(&tx, 16), be32(&tx, 40), be32(&tx, 44)),
            (op::R2T, 7, 0, 1024),
            "both halves asked for"
        );
        let ttt = be32(&tx, 20);
        tx.clear();
        let mut halves = vec![0u8; 512];
        halves.extend_from_slice(&[0xab; 512]);
        let d = data_out(7, ttt, 0, 0, &halves, true);
        let Decoded::Request { req: read, .. } = f.decode(&d, &mut tx) else {
            panic!("the compare's read");
        };
        compare_read(&mut f, &read, &[0u8; 512], &mut tx);
        assert!(tx.is_empty(), "matched: nothing answered yet");
        let Decoded::Request {
            req: write,
            payload_len: 0,
            ..
        } = f.decode(&[], &mut tx)
        else {
            panic!("the write");
        };
        assert_eq!(
            (write.kind, write.offset, write.length),
            (Kind::Block(BlockOp::Write), 1024, 512)
        );
        assert!(!f.data_follows(&write));
        f.taken(&write);
        let mut buf = vec![0u8; 512];
        assert!(f.fill(&write, &mut buf), "the frontend holds the data");
        assert_eq!(buf, vec![0xab; 512]);
        assert!(f.reply(&write, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 7));
    }

    /// While COMPARE AND WRITE's read is with the reactor no command is decoded, but Data-Out
    /// and NOP-Out are: the read may be parked for memory that writes waiting for their
    /// Data-Out hold, and the connection would wedge if that data were never read.
    #[test]
    fn compare_and_write_waiting_for_its_read_still_takes_data_out_and_pings() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let Decoded::Request { req: write, .. } =
            f.decode(&cmd(9, 0, &write10(8), 4096, true, &[]), &mut tx)
        else {
            panic!("a write");
        };
        f.taken(&write);
        f.solicit(&write, 3, 0, 4096, &mut tx);
        assert_eq!((tx[0], be32(&tx, 16)), (op::R2T, 9));
        let write_ttt = be32(&tx, 20);
        tx.clear();
        // Parked in the reactor: the memory it waits for is the write's, which its data frees.
        let read = compare_and_write_parked(&mut f, 1, &mut tx);
        let tur = cmd(50, 2, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Need(_)));
        let d = data_out(9, write_ttt, 0, 0, &[5u8; 4096], true);
        assert!(
            matches!(f.decode(&d, &mut tx), Decoded::Data { slot: 3, len, .. } if len == d.len()),
            "the write's data is read while the compare waits"
        );
        let nop = nop_pdu(60);
        assert!(matches!(f.decode(&nop, &mut tx), Decoded::Answered { len } if len == nop.len()));
        assert_eq!((tx[0], be32(&tx, 16)), (op::NOP_IN, 60));
        tx.clear();
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Need(_)));
        // The write done, the read runs: the command goes on.
        assert!(f.reply(&write, Status::Ok, &mut tx));
        f.unparked(4);
        f.encode_read(&read, &[0u8; 512], &mut tx);
        assert!(matches!(
            f.decode(&tur, &mut tx),
            Decoded::Request { req, .. } if req.kind == Kind::Block(BlockOp::Write)
        ));
    }

    /// A Logout removing a connection for recovery is answered "connection recovery is not
    /// supported" (ErrorRecoveryLevel 0) at once, the connection kept; closing it is a request
    /// the reactor answers once what runs is done.
    #[test]
    fn a_logout_for_recovery_is_refused_and_the_connection_kept() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let pdu = logout_for(61, 2);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { len } if len == pdu.len()));
        assert_eq!((tx[0], tx[2], be32(&tx, 16)), (op::LOGOUT_RSP, 2, 61));
        tx.clear();
        let Decoded::Request { req, .. } = f.decode(&logout_for(62, 1), &mut tx) else {
            panic!("closing the connection is a request");
        };
        assert_eq!(req.kind, Kind::Logout);
    }

    /// A Logout is read while COMPARE AND WRITE's read is with the reactor (the reactor
    /// answers a parked read NO_MEMORY, which ends the command, or waits for a running one):
    /// held back like a command, it waited for the initiator's logout timeout, since an
    /// initiator that logs out sends no more of the data that would let the read run.
    #[test]
    fn a_logout_is_read_while_compare_and_write_waits_for_its_read() {
        let mut f = fe(65536);
        let mut tx = Vec::new();
        let read = compare_and_write_parked(&mut f, 0, &mut tx);
        let tur = cmd(50, 1, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Need(_)));
        let Decoded::Request { req, .. } = f.decode(&logout_pdu(61), &mut tx) else {
            panic!("the Logout is read");
        };
        assert_eq!(req.kind, Kind::Logout);
        f.taken(&req);
        // The reactor answers the parked read, then the Logout.
        f.unparked(4);
        assert!(f.reply(&read.refused(), Status::NoMemory, &mut tx));
        assert_eq!((tx[0], be32(&tx, 16), tx[3]), (op::SCSI_RSP, 7, 2));
        tx.clear();
        assert!(f.reply(&req, Status::Ok, &mut tx));
        assert_eq!((tx[0], be32(&tx, 16)), (op::LOGOUT_RSP, 61));
    }

    /// One ITT used on two LUs at once (which a well-behaved initiator never does): the answer
    /// of one LU's command settles that command only, so a LOGICAL UNIT RESET of the other
    /// LU still waits for its own.
    #[test]
    fn one_itt_on_two_lus_settles_each_lus_command_apart() {
        let mut f = fe_luns(4096, &[(0, "m=mem:1M"), (1, "m=mem:1M")]);
        let mut tx = Vec::new();
        let mut read = |lun: u64, cmdsn: u32, tx: &mut Vec<u8>| {
            let Decoded::Request { req, .. } =
                f.decode(&cmd_lun(lun, 7, cmdsn, &READ10_ONE, 512), tx)
            else {
                panic!("a read");
            };
            f.taken(&req);
            req
        };
        let one = read(1, 0, &mut tx);
        let zero = read(0, 1, &mut tx);
        let mut reset = tmf_pdu(20, 5, RESERVED_TAG);
        reset[8..16].copy_from_slice(&scsi::lun_to_wire(1));
        assert!(matches!(
            f.decode(&reset, &mut tx),
            Decoded::Answered { .. }
        ));
        assert!(tx.is_empty());
        f.encode_read(&zero, &[0u8; 512], &mut tx);
        assert!(matches!(f.decode(&[], &mut tx), Decoded::Need(_)));
        assert_eq!(
            tx.len(),
            BHS_LEN + 512,
            "LUN 1's reset answered when LUN 0's command was"
        );
        assert_eq!(f.outstanding(), 1);
        f.reply(&one, Status::Ok, &mut tx);
        let at = tx.len() - BHS_LEN;
        assert_eq!((tx[at], be32(&tx, at + 16)), (op::TMF_RSP, 20));
        assert_eq!(f.outstanding(), 0);
    }

    #[test]
    fn compare_and_write_with_unsolicited_data_that_miscompares_writes_nothing() {
        let mut f = fe_unsolicited(65536);
        let mut tx = Vec::new();
        let pdu = cmd_more(7, 0, &caw(1), 1024, &[0u8; 256]);
        assert!(matches!(f.decode(&pdu, &mut tx), Decoded::Answered { .. }));
        assert!(tx.is_empty(), "no R2T: the rest comes unsolicited");
        let d = data_out(7, RESERVED_TAG, 0, 256, &[0x11; 768], true);
        let Decoded::Request { req: read, .. } = f.decode(&d, &mut tx) else {
            panic!("the compare's read");
        };
        let mut current = [0u8; 512];
        current[300] = 1;
        compare_read(&mut f, &read, &current, &mut tx);
        assert_eq!(
            (tx[0], tx[3], be32(&tx, 16)),
            (op::SCSI_RSP, CHECK_CONDITION, 7)
        );
        // Sense data (after its 2-byte length) with the sense key MISCOMPARE.
        let sense = &tx[BHS_LEN + 2..];
        assert_eq!(sense[2] & 0x0f, 0x0e, "MISCOMPARE");
        tx.clear();
        // The write was not handed out: the next PDU decodes as itself.
        let tur = cmd(8, 1, &[0u8; 6], 0, false, &[]);
        assert!(matches!(f.decode(&tur, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], be32(&tx, 16)), (op::SCSI_RSP, 8));
    }

    /// Each LU of a target has its export's reservations: a reservation made through LUN 3
    /// refuses the other initiator's writes there, and only there.
    #[test]
    fn reservations_are_per_lu() {
        let export =
            |spec: &str| Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
        let (x, y) = (export("x=mem:1M"), export("y=mem:1M"));
        // Two exports of one registry: two LUs of their own ids.
        let table = crate::reservations::Table::default();
        let (lx, ly) = (table.lu(&x), table.lu(&y));
        assert_ne!(lx.id(), ly.id());
        let two = |initiator: &str| {
            let lun = |n: u64, e: &Arc<Export>, r: &Arc<PrLu>| SetupLun {
                lun: n,
                export: e.clone(),
                size: e.size(),
                copy: CopyLimits::default(),
                reservations: r.clone(),
            };
            setup(65536, initiator, vec![lun(0, &x, &lx), lun(3, &y, &ly)])
        };
        let (mut a, mut b) = (two("iqn.test:a"), two("iqn.test:b"));
        let on = |lun: u64, mut pdu: Vec<u8>| {
            pdu[8..16].copy_from_slice(&scsi::lun_to_wire(lun));
            pdu
        };
        let mut tx = Vec::new();
        let reg = on(
            3,
            cmd(1, 0, &prout(0, 0), 24, true, &pr::out_parameters(0, 0xBB)),
        );
        assert!(matches!(a.decode(&reg, &mut tx), Decoded::Answered { .. }));
        let res = on(
            3,
            cmd(2, 1, &prout(1, 1), 24, true, &pr::out_parameters(0xBB, 0)),
        );
        let Decoded::Request { req, .. } = a.decode(&res, &mut tx) else {
            panic!("a broadcast request");
        };
        assert_eq!(
            (req.kind, req.target),
            (Kind::Broadcast, 1),
            "LUN 3 is target 1"
        );
        a.taken(&req);
        let update = a.take_broadcast(&req).expect("the update");
        b.reservations_changed(&update);
        tx.clear();
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0];
        let w = on(0, cmd(7, 0, &write10, 512, true, &[5u8; 512]));
        let Decoded::Request { req, .. } = b.decode(&w, &mut tx) else {
            panic!("LUN 0 is not reserved: {tx:?}");
        };
        assert_eq!(req.target, 0);
        b.taken(&req);
        b.inflight.clear();
        let w = on(3, cmd(8, 1, &write10, 512, true, &[5u8; 512]));
        assert!(matches!(b.decode(&w, &mut tx), Decoded::Answered { .. }));
        assert_eq!(
            (tx[0], tx[3], be32(&tx, 16)),
            (op::SCSI_RSP, RESERVATION_CONFLICT, 8)
        );
    }

    /// A PERSISTENT RESERVE OUT whose parameter list comes by Data-Out, its LUN removed before
    /// the list is in: answered LOGICAL UNIT NOT SUPPORTED, the export's state untouched (a
    /// change there would reach no other reactor).
    #[test]
    fn a_reserve_out_to_a_lun_removed_while_its_data_came_changes_nothing() {
        let export =
            |spec: &str| Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
        let table = crate::reservations::Table::default();
        let (x, y) = (export("x=mem:1M"), export("y=mem:1M"));
        let ly = table.lu(&y);
        let lun = |n: u64, e: &Arc<Export>| SetupLun {
            lun: n,
            export: e.clone(),
            size: e.size(),
            copy: CopyLimits::default(),
            reservations: table.lu(e),
        };
        let mut f = setup(65536, "iqn.test:a", vec![lun(0, &x), lun(3, &y)]);
        let mut tx = Vec::new();
        // REGISTER to LUN 3 with no immediate data: the list is asked for with an R2T.
        let mut reg = cmd(1, 0, &prout(0, 0), 24, true, &[]);
        reg[8..16].copy_from_slice(&scsi::lun_to_wire(3));
        assert!(matches!(f.decode(&reg, &mut tx), Decoded::Answered { .. }));
        assert_eq!(tx[0], op::R2T);
        let ttt = be32(&tx, 20);
        tx.clear();
        f.fenced(1);
        let d = data_out(1, ttt, 0, 0, &pr::out_parameters(0, 0xCC), true);
        assert!(matches!(f.decode(&d, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, CHECK_CONDITION));
        assert_eq!(sense(&tx), (0x05, 0x25, 0x00), "LOGICAL UNIT NOT SUPPORTED");
        assert!(f.pr[1].outgoing.is_none());
        let keys = ly.reserve_in(0, 64).unwrap();
        assert_eq!(&keys[4..8], &[0, 0, 0, 0], "no key registered: {keys:?}");
    }

    fn prout(sa: u8, kind: u8) -> [u8; 10] {
        [0x5f, sa, kind, 0, 0, 0, 0, 0, 24, 0]
    }

    /// REGISTER answers at once (nothing reserved, nothing for the data path); RESERVE becomes
    /// a broadcast request whose update the other connection installs: its WRITE then ends with
    /// RESERVATION CONFLICT before reaching the reactor, its READ still runs (Write Exclusive),
    /// and the reservation's holder writes. PR IN READ RESERVATION shows the holder's key.
    #[test]
    fn a_reservation_made_on_one_connection_is_enforced_on_another() {
        let lu = PrLu::detached();
        let mut a = fe_on(65536, "iqn.test:a", lu.clone());
        let mut b = fe_on(65536, "iqn.test:b", lu.clone());
        let mut tx = Vec::new();
        let reg = cmd(1, 0, &prout(0, 0), 24, true, &pr::out_parameters(0, 0xAA));
        assert!(matches!(a.decode(&reg, &mut tx), Decoded::Answered { .. }));
        assert_eq!((tx[0], tx[3]), (op::SCSI_RSP, GOOD));
        assert!(a.pr[0].outgoing.is_none(), "nothing for the other reactors");
        tx.clear();
        let res = cmd(2, 1, &prout(1, 1), 24, true, &pr::out_parameters(0xAA, 0));
        let Decoded::Request { req, .. } = a.decode(&res, &mut tx) else {
            panic!("a broadcast request");
        };
        assert_eq!(req.kind, Kind::Broadcast);
        assert!(tx.is_empty(), "GOOD waits for the other reactors");
        a.taken(&req);
        let update = a.take_broadcast(&req).expect("the update");
        assert!(a.reply(&req, Status::Ok, &mut tx));
        assert_eq!((tx[0], tx[3], be32(&tx, 16)), (op::SCSI_RSP, GOOD, 2));
        tx.clear();
        // Before b installs the update it may still write; after, not.
        let write10 = [0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0];
        let w = cmd(7, 0, &write10, 512, true, &[5u8; 512]);
        assert!(matches!(b.decode(&w, &mut tx), Decoded::Request { .. }));
        b.pending = None;
        b.inflight.clear();
        b.reservations_changed(&update);
        let w = cmd(8, 1, &write10, 512, true, &[5u8; 512]);
        assert!(matches!(b.decode(&w, &mut tx), Decoded::Answered { .. }));
        assert_eq!(
            (tx[0], tx[3], be32(&tx, 16)),
            (op::SCSI_RSP, RESERVATION_CONFLICT, 8)
        );
        tx.clear();
        let r = cmd(9, 2, &READ10_ONE, 512, false, &[]);
        assert!(matches!(b.decode(&r, &mut tx), Decoded::Request { .. }));
        let w = cmd(3, 2, &write10, 512, true, &[5u8; 512]);
        assert!(matches!(a.decode(&w, &mut tx), Decoded::Request { .. }));
        // An older update arriving late changes nothing.
        b.reservations_changed(&crate::reservations::Update {
            lu: lu.id(),
            version: 0,
            snapshot: None,
        });
        assert_eq!(b.pr[0].access, Access::NoWrites);
        let mut tx = Vec::new();
        let rr = [0x5e, 1, 0, 0, 0, 0, 0, 0, 24, 0];
        let q = cmd(4, 3, &rr, 24, false, &[]);
        a.pending = None;
        assert!(matches!(a.decode(&q, &mut tx), Decoded::Answered { .. }));
        assert_eq!(tx[0], op::DATA_IN);
        let data = &tx[BHS_LEN..BHS_LEN + 24];
        assert_eq!(&data[8..16], &0xAAu64.to_be_bytes(), "the holder's key");
        assert_eq!(data[21], 1, "Write Exclusive");
    }
}
