//! Stream frontends: how one protocol's bytes become requests and replies become bytes.
//!
//! The reactor owns the socket, the buffers, the slots and the executor (`executor.rs`);
//! a frontend owns the protocol and its per-connection state. The reactor never asks which
//! protocol a connection speaks: it calls [`StreamFrontend`] methods. Native blkwire frames
//! ([`native`]) and NBD's transmission phase ([`nbd`]) are the implementations; how NVMe/TCP
//! and iSCSI map onto the same trait is written down in docs/ARCHITECTURE.md.

pub mod native;
pub mod nbd;

use blkwire_backend::{BlockOp, BlockRequest, IoFlags};
use blkwire_wire::Status;

/// What a request asks for, whatever protocol carried it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An operation on the export's blocks, run by the executor.
    Block(BlockOp),
    /// A prefetch hint (NBD CACHE): range-checked and answered.
    Cache,
    /// An allocation query (NBD BLOCK_STATUS on `base:allocation`).
    BlockStatus,
    /// A liveness probe, answered at once.
    Keepalive,
    /// End the queue after answering what came before (native LOGOUT is answered, NBD DISC not).
    Logout,
    /// Well-formed but not something this export or protocol can do.
    Unsupported,
    /// Well-formed but not valid here (a handshake frame on an open queue, bad arguments).
    Invalid,
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

    /// A READ (the one request whose successful reply carries data).
    pub fn is_read(&self) -> bool {
        self.kind == Kind::Block(BlockOp::Read)
    }
}

/// What a frontend made of the front of a receive buffer.
pub enum Decoded {
    /// The next message is not all there yet: at least this many bytes (from the front) are
    /// needed, so the reactor can make room for them.
    Need(usize),
    /// A complete request: `len` bytes of message, of which the last `payload_len` are its data
    /// (WRITE).
    Request {
        /// The request.
        req: Req,
        /// Bytes of the whole message (header, payload).
        len: usize,
        /// Bytes of payload at the end of the message.
        payload_len: usize,
    },
    /// The stream is not valid: close the queue.
    Violation(String),
}

/// One protocol, with its per-connection state, as the reactor drives it.
pub trait StreamFrontend: Send {
    /// Decodes the first message in `rx` (which starts at a message boundary).
    fn decode(&mut self, rx: &[u8]) -> Decoded;

    /// True when the server assigns slots (requests carry cookies, not slots): the reactor then
    /// stops reading when every slot is busy.
    fn server_assigns_slots(&self) -> bool;

    /// Bytes a successful READ reply puts before its data.
    fn read_prefix_len(&self) -> usize;

    /// Fills the prefix of a successful READ reply (the data follows it).
    fn write_read_prefix(&self, req: &Req, out: &mut [u8]);

    /// Appends a reply without read data. Returns false when the protocol sends no reply for
    /// this request (NBD DISC).
    fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool;

    /// True when a READ of a hole may be answered without its zeros ([`StreamFrontend::hole_reply`]).
    fn replies_with_holes(&self) -> bool {
        false
    }

    /// Appends the reply to a READ of a range that is all hole, without the zeros.
    fn hole_reply(&self, _req: &Req, _tx: &mut Vec<u8>) {
        unreachable!("only called when replies_with_holes() is true")
    }

    /// Appends the reply to an allocation query, `extents` as (length, hole), or returns false
    /// when the connection did not negotiate allocation queries.
    fn block_status_reply(&self, _req: &Req, _extents: &[(u32, bool)], _tx: &mut Vec<u8>) -> bool {
        false
    }
}
