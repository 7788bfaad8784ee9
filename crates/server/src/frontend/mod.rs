//! Stream frontends: how one protocol's bytes become requests and replies become bytes.
//!
//! The reactor owns the socket, the buffers, the slots and the executor (`executor.rs`);
//! a frontend owns the protocol and its per-connection state. The reactor never asks which
//! protocol a connection speaks: it calls [`StreamFrontend`] methods. Native blkwire frames
//! ([`native`]), NBD's transmission phase ([`nbd`]), NVMe/TCP I/O queues ([`nvme`]) and iSCSI's
//! full feature phase ([`iscsi`]) are the implementations; how NVMe/TCP and iSCSI map onto the
//! same trait is written down in docs/ARCHITECTURE.md.

pub mod iscsi;
pub mod native;
pub mod nbd;
pub mod nvme;

use blkwire_backend::{BlockOp, BlockRequest, IoFlags};
use blkwire_wire::Status;

/// What a request asks for, whatever protocol carried it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An operation on the export's blocks, run by the executor.
    Block(BlockOp),
    /// A server-side copy into the export (native COPY, PROTOCOL.md §13): its descriptor is
    /// the message's payload.
    Copy,
    /// A prefetch hint (NBD CACHE): range-checked and answered.
    Cache,
    /// An allocation query (NBD BLOCK_STATUS on `base:allocation`).
    BlockStatus,
    /// End the queue after answering what came before (native LOGOUT is answered, NBD DISC not).
    Logout,
    /// Well-formed but not something this export or protocol can do.
    Unsupported,
    /// Well-formed but not valid here (a handshake frame on an open queue, bad arguments).
    Invalid,
    /// A change of state shared with the other reactors (a persistent reservation,
    /// `crate::reservations`), already made: the reactor hands every other reactor the update
    /// ([`StreamFrontend::take_broadcast`]) and answers the request (as a success) once all
    /// have installed it.
    Broadcast,
}

/// A decoded request. Plain data: kept in a slot while its backend I/O runs.
#[derive(Clone, Copy, Debug)]
pub struct Req {
    /// What it asks.
    pub kind: Kind,
    /// First byte addressed.
    pub offset: u64,
    /// Bytes addressed.
    pub length: u32,
    /// Modifiers.
    pub flags: IoFlags,
    /// The slot the client chose (native tags), or `None` where the server picks one.
    pub slot: Option<u16>,
    /// Whatever the frontend needs to build the reply (native: opcode and tag; NBD: cookie).
    pub cookie: u128,
    /// Which of the connection's targets (exports) it addresses, as an index into the list the
    /// connection was admitted with: always 0 where a connection serves one export (native,
    /// NBD); an NVMe/TCP I/O queue maps each command's NSID to its namespace's index (and an
    /// iSCSI session its LUN). A target removed while the connection lives is fenced: its
    /// requests are answered [`Status::NoExport`] and never reach an executor.
    pub target: u8,
}

impl Req {
    /// The block operation, for requests the executor runs.
    pub fn block(&self) -> Option<BlockRequest> {
        match self.kind {
            Kind::Block(op) => Some(BlockRequest {
                op,
                offset: self.offset,
                len: self.length,
                flags: self.flags,
            }),
            _ => None,
        }
    }

    /// The request as its refusal answers it: a refused COPY copied nothing, so its reply's
    /// length is 0 (PROTOCOL.md §13); every other request is echoed as it came.
    pub fn refused(&self) -> Req {
        match self.kind {
            Kind::Copy => Req { length: 0, ..*self },
            _ => *self,
        }
    }

    /// A state change of target `target` that every reactor must see before it is answered
    /// ([`Kind::Broadcast`]); `cookie` builds the answer.
    pub fn broadcast(target: u8, cookie: u128) -> Req {
        Req {
            kind: Kind::Broadcast,
            offset: 0,
            length: 0,
            flags: IoFlags::empty(),
            slot: None,
            cookie,
            target,
        }
    }

    /// A READ (the one request whose successful reply carries data).
    pub fn is_read(&self) -> bool {
        self.kind == Kind::Block(BlockOp::Read)
    }

    /// A WRITE (the one request that brings data).
    pub fn is_write(&self) -> bool {
        self.kind == Kind::Block(BlockOp::Write)
    }
}

/// A stretch of a READ's data that a reply carries, left out of the transmit buffer
/// ([`StreamFrontend::encode_read_framing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Where in the transmit buffer it goes: after `tx[..at]`.
    pub at: usize,
    /// Its start in the data.
    pub from: usize,
    /// Its length.
    pub len: usize,
}

/// How a successful READ reply is laid out around its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFraming {
    /// `prefix` bytes, the data, then `suffix` bytes (a data digest, padding, a trailing
    /// response PDU): the data lands in place between them, and the frontend fills both ends
    /// once it is there ([`StreamFrontend::finish_read_reply`]).
    Contiguous {
        /// Bytes before the data.
        prefix: usize,
        /// Bytes after the data.
        suffix: usize,
    },
    /// Headers between pieces of the data (an iSCSI Data-In sequence longer than the
    /// initiator's segment size): the frontend builds the whole reply from the data
    /// ([`StreamFrontend::encode_read`]).
    Chunked {
        /// At most this many bytes besides the data (headers, padding, digests, the status):
        /// what the memory budget sets aside for the reply on top of its data.
        framing: usize,
    },
}

impl ReadFraming {
    /// A chunked reply's framing bound; `None` for a contiguous reply.
    pub fn chunked(self) -> Option<usize> {
        match self {
            ReadFraming::Chunked { framing } => Some(framing),
            ReadFraming::Contiguous { .. } => None,
        }
    }
}

/// What a frontend made of the front of a receive buffer.
pub enum Decoded {
    /// The next message is not all there yet: at least this many bytes (from the front) are
    /// needed, so the reactor can make room for them.
    Need(usize),
    /// A complete request: `len` bytes of message, of which the last `payload_len` are its data.
    /// A WRITE whose `payload_len` is less than its length carries the first `payload_len`
    /// bytes of its data (in-capsule or immediate data; possibly none): the reactor holds it in
    /// a slot and asks for the rest with [`StreamFrontend::solicit`].
    Request {
        /// The request.
        req: Req,
        /// Bytes of the whole message (header, payload).
        len: usize,
        /// Bytes of payload at the end of the message (before its trailer).
        payload_len: usize,
        /// Bytes after the payload (an NVMe/TCP data digest): 0 for most protocols.
        trailer: usize,
    },
    /// A message the frontend handled itself, its answer (if any) already appended to `tx`:
    /// liveness probes, and the admin commands that need no backend (Identify, Get Log Page,
    /// INQUIRY, ...).
    Answered {
        /// Bytes of the whole message.
        len: usize,
    },
    /// Data the target solicited for the WRITE waiting in `slot` (NVMe/TCP H2CData, iSCSI
    /// Data-Out): the last `payload_len` bytes of the message belong at `offset` of its data.
    Data {
        /// The slot the write waits in (the tag [`StreamFrontend::solicit`] was given).
        slot: u16,
        /// Where in the write's data this part goes.
        offset: u32,
        /// Bytes of the whole message.
        len: usize,
        /// Bytes of data at the end of the message (before its trailer).
        payload_len: usize,
        /// Bytes after the data (a data digest).
        trailer: usize,
    },
    /// The WRITE waiting in `slot` for solicited data, or the request parked there waiting for
    /// memory ([`StreamFrontend::parked`]), is given up (iSCSI ABORT TASK, LOGICAL UNIT RESET):
    /// a write's data will not come, so its slot and buffer go back, and it never runs nor is
    /// answered. A slot that holds no such request any more (it left the wait) is left alone.
    Release {
        /// The slot the request waits in.
        slot: u16,
        /// Bytes of the whole message. Further slots the same message releases come from
        /// [`StreamFrontend::next_release`].
        len: usize,
    },
    /// A message dropped unanswered, as its protocol says of a late or duplicate one (an iSCSI
    /// PDU whose CmdSN is outside the window or already taken, RFC 7143 §4.2.2.1): counted
    /// with the late and duplicate requests the datagram transports drop.
    Dropped {
        /// Bytes of the whole message.
        len: usize,
    },
    /// The stream is not valid: close the queue.
    Violation(String),
}

/// One protocol, with its per-connection state, as the reactor drives it.
pub trait StreamFrontend: Send {
    /// Decodes the first message in `rx` (which starts at a message boundary). A message the
    /// frontend answers itself has its answer appended to `tx`.
    fn decode(&mut self, rx: &[u8], tx: &mut Vec<u8>) -> Decoded;

    /// Asks the initiator for `len` bytes of the data of `req`, a WRITE waiting in `slot`, from
    /// `offset` on (NVMe/TCP R2T, iSCSI R2T), by appending that request to `tx`. Called once per
    /// WRITE that arrived with less data than its length; the answers come as
    /// [`Decoded::Data`]. Frontends whose WRITEs always carry their data never get this call.
    fn solicit(&mut self, req: &Req, slot: u16, offset: u32, len: u32, tx: &mut Vec<u8>) {
        let _ = (req, slot, offset, len, tx);
        unreachable!("this frontend's writes always carry their data")
    }

    /// `req` waits in `slot` for memory (behind writes waiting for their data): a WRITE before
    /// its data is asked for with [`StreamFrontend::solicit`] (or, when it brought all of it,
    /// before it runs), any other request (a READ, an allocation query) before it runs. A
    /// frontend whose task management can abort it (iSCSI ABORT TASK) finds it here and gives
    /// it up with [`Decoded::Release`], after which it never runs nor is answered.
    fn parked(&mut self, req: &Req, slot: u16) {
        let _ = (req, slot);
    }

    /// The request parked in `slot` ([`StreamFrontend::parked`]) stops waiting for memory: a
    /// write is solicited next ([`StreamFrontend::solicit`]) or runs, anything else runs (in
    /// whichever slot it then takes).
    fn unparked(&mut self, slot: u16) {
        let _ = slot;
    }

    /// A further slot the last [`Decoded::Release`] gives up (one task management function may
    /// abort several requests): the reactor takes them all before anything else runs, so a
    /// parked request aborted with others never gets to run.
    fn next_release(&mut self) -> Option<u16> {
        None
    }

    /// True when the WRITE `req` (the last [`Decoded::Request`] `decode` returned) is followed
    /// by data the initiator sends without being asked (iSCSI unsolicited Data-Out under
    /// InitialR2T=No), as [`Decoded::Data`] for the slot [`StreamFrontend::solicit`] names: the
    /// write gets its buffer (and that call) when it is taken, or is refused, and never waits
    /// for memory without one, since its data is already on its way.
    fn data_follows(&self, req: &Req) -> bool {
        let _ = req;
        false
    }

    /// The reactor took `req`, the last [`Decoded::Request`] `decode` returned: its message
    /// is consumed and the request is being handled. A request the reactor cannot take yet
    /// (memory, one COPY at a time) stays in the receive buffer and is decoded again, so a
    /// frontend whose decoding has effects (iSCSI's CmdSN, NVMe/TCP's SQ head, requests it
    /// makes up itself) keeps what it returned until this call and returns it again.
    fn taken(&mut self, req: &Req) {
        let _ = req;
    }

    /// Target `target` of the connection was fenced (its session closed: an NVMe namespace or
    /// an iSCSI LUN removed while the connection lives). The reactor answers its requests
    /// [`Status::NoExport`] from now on; a frontend that answers commands itself (iSCSI's
    /// INQUIRY, REPORT LUNS) stops presenting it.
    fn fenced(&mut self, target: u8) {
        let _ = target;
    }

    /// The most extents the reply to the allocation query `req` can list (iSCSI: what GET LBA
    /// STATUS's allocation length holds): the backend is asked for no more, and no more is
    /// reserved for its list. NBD's REQ_ONE (one) is the reactor's to apply.
    fn block_status_extents(&self, req: &Req) -> usize {
        let _ = req;
        blkwire_backend::MAX_EXTENTS
    }

    /// Fills the buffer of a WRITE that came without its data when the frontend holds that data
    /// itself (iSCSI WRITE SAME's block, repeated), instead of asking the initiator for it:
    /// true when `data` (the write's whole length) is filled and the write may run.
    fn fill(&mut self, req: &Req, data: &mut [u8]) -> bool {
        let _ = (req, data);
        false
    }

    /// True when the server assigns slots (requests carry cookies, not slots): the reactor then
    /// stops reading when every slot is busy.
    fn server_assigns_slots(&self) -> bool;

    /// True when the message at the front of `rx` (possibly incomplete) is solicited data
    /// ([`Decoded::Data`]), which needs no free slot: the reactor reads it even when every slot
    /// is busy, since the writes holding the slots wait for exactly that data. Also true when
    /// the next `decode` will answer something itself without taking a slot (iSCSI: a task
    /// management function's held response, once the commands it waited for are answered).
    fn next_is_data(&self, rx: &[u8]) -> bool {
        let _ = rx;
        false
    }

    /// True when the message at the front of `rx` (possibly incomplete) can be decoded while
    /// no slot is free: solicited data ([`StreamFrontend::next_is_data`]), and messages the
    /// frontend answers itself (iSCSI: NOP-Out, task management, Text), or that become
    /// requests running in no slot (an iSCSI Logout). Left unread, such a message would keep
    /// the data behind it, which frees the slots, from ever being read (or, a Logout, end
    /// the connection only at the initiator's timeout).
    fn needs_no_slot(&self, rx: &[u8]) -> bool {
        self.next_is_data(rx)
    }

    /// The most bytes `decode` may append to `tx` for the message at the front of `rx`
    /// (possibly incomplete), when that is more than the reactor's slack for small replies
    /// (4 KiB, which the default leaves it at): an answer the frontend writes itself, such as
    /// iSCSI's NOP-In echoing its ping data. The reactor makes that much room, within the
    /// memory budget, before decoding; otherwise the transmit buffer would grow behind the
    /// budget's back.
    fn reply_bound(&self, rx: &[u8]) -> usize {
        let _ = rx;
        0
    }

    /// How the successful reply to the READ `req` is laid out.
    fn read_framing(&self, req: &Req) -> ReadFraming;

    /// Fills both ends of a [`ReadFraming::Contiguous`] READ reply, `data` being in place
    /// between them (digests are computed over it where it lies).
    fn finish_read_reply(&mut self, req: &Req, prefix: &mut [u8], data: &[u8], suffix: &mut [u8]);

    /// Whether what follows the data of a reply to `req` (the suffix of a
    /// [`ReadFraming::Contiguous`] reply, or of each piece of a chunked one) is computed from
    /// it (a data digest). Such a reply is never sent from an export's memory, which other
    /// connections may write meanwhile: a digest of the bytes as they are now over bytes the
    /// kernel reads later could fail at the initiator, and NVMe/TCP and iSCSI initiators end
    /// the connection on a digest error. Frontends whose suffix can hold one say when it does.
    fn read_suffix_digests(&self, req: &Req) -> bool {
        let _ = req;
        true
    }

    /// [`StreamFrontend::encode_read`] without copying the data: the reply's framing goes into
    /// `tx`, and each stretch of `data` it carries is listed in `pieces`, in wire order (`at`
    /// ascending), none empty, each inside `data`, with where in `tx` it goes. Pieces of less
    /// than 16 KiB cost more to send one by one than to copy: a frontend whose pieces would be
    /// smaller says false. Digests may be computed over `data` when it is the request's own
    /// buffer; when it is an export's memory, [`StreamFrontend::read_suffix_digests`] said no
    /// digest follows. False (nothing appended) when the frontend does not do it; then
    /// `encode_read` builds the reply.
    fn encode_read_framing(
        &mut self,
        req: &Req,
        data: &[u8],
        tx: &mut Vec<u8>,
        pieces: &mut Vec<Piece>,
    ) -> bool {
        let _ = (req, data, tx, pieces);
        false
    }

    /// Appends the whole reply to a [`ReadFraming::Chunked`] READ.
    fn encode_read(&mut self, req: &Req, data: &[u8], tx: &mut Vec<u8>) {
        let _ = (req, data, tx);
        unreachable!("this frontend's read replies are contiguous")
    }

    /// Appends a reply without read data. Returns false when the protocol sends no reply for
    /// this request (NBD DISC).
    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool;

    /// The descriptor of the [`Kind::Copy`] request `req`, from its payload, checked against
    /// what the connection granted for its target; `None` when it is malformed or over the
    /// limits (answered `INVALID`). Only frontends that decode COPYs get this call.
    fn copy_descriptor(
        &mut self,
        _req: &Req,
        _payload: &[u8],
    ) -> Option<blkwire_wire::CopyDescriptor> {
        None
    }

    /// The export the frontend checked the source of COPY `desc` as, if it did (iSCSI checks an
    /// EXTENDED COPY against its source's reservations): the copy runs only from that export,
    /// not from another of the same name added since (`Executor::start_copy`).
    fn copy_source(
        &self,
        _desc: &blkwire_wire::CopyDescriptor,
    ) -> Option<std::sync::Weak<blkwire_backend::Export>> {
        None
    }

    /// The connection is on its reactor: the frontend reads the shared state the reactor keeps
    /// it up to date with from now on ([`StreamFrontend::reservations_changed`]).
    fn attached(&mut self) {}

    /// An export's persistent reservations changed (on any reactor): the frontend installs
    /// `update` if it serves that export and it is newer than what it has.
    fn reservations_changed(&mut self, update: &crate::reservations::Update) {
        let _ = update;
    }

    /// The update of the [`Kind::Broadcast`] request `req` the reactor just took, for the
    /// other reactors.
    fn take_broadcast(&mut self, req: &Req) -> Option<std::sync::Arc<crate::reservations::Update>> {
        let _ = req;
        None
    }

    /// True when a READ of a hole may be answered without its zeros ([`StreamFrontend::hole_reply`]).
    fn replies_with_holes(&self) -> bool {
        false
    }

    /// Appends the reply to a READ of a range that is all hole, without the zeros.
    fn hole_reply(&self, _req: &Req, _tx: &mut Vec<u8>) {
        unreachable!("only called when replies_with_holes() is true")
    }

    /// The most bytes [`StreamFrontend::block_status_reply`] appends answering `req` with
    /// `extents` extents: the memory budget covers that much before the query is taken. 0 when
    /// the connection has no allocation queries (it is refused with a status reply).
    fn block_status_len(&self, _req: &Req, _extents: usize) -> usize {
        0
    }

    /// Appends the reply to an allocation query, `extents` as (length, hole), or returns false
    /// when the connection did not negotiate allocation queries.
    fn block_status_reply(
        &mut self,
        _req: &Req,
        _extents: &[(u32, bool)],
        _tx: &mut Vec<u8>,
    ) -> bool {
        false
    }
}
