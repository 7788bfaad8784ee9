//! Datagram ports (UDP; raw Ethernet uses the same code with link-layer addresses): one socket per
//! reactor, frames demultiplexed to queues by `(session, queue)`, fragment reassembly, and the
//! exactly-once rules of PROTOCOL.md §6 and §9: per slot, a request generation runs at most once,
//! a duplicate of a finished request gets its cached reply, a stale one is dropped, and a new
//! generation waits while the previous one still runs.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::RawFd;

use blkwire_backend::{AlignedBuf, BlockOp, BlockRequest, Submitter, COPY_CHUNK};
use blkwire_net::rx_ring::RxRing;
use blkwire_net::udp_offload::{self, Cmsg, IoVecs, SendBatch};
use blkwire_wire::datagram::{self, Packer};
use blkwire_wire::{
    bitmap, datagram::Frame, datagram::SEAL_LEN, fragment_count, CopyDescriptor, CopyLimits,
    ExportEntry, Flags, Header, Hello, Opcode, Status, Tag, HEADER_LEN, QUERY_STATS,
};

use crate::access::PeerId;
use crate::budget::Account;
use crate::bufpool::Buffers;
use crate::executor::{Copied, Executor, Outcome, Started};
use crate::frontend::native::flush_args_valid;
use crate::log::Level;
use crate::session::{HelloAnswer, JoinRefused, QueueSeal, Registry};
use crate::stats::ClosedTotals;

mod in_place;

/// Frames received or sent per syscall.
const BATCH: usize = 32;
/// READs of this many bytes or more are sent from where their data lies (`finish_read`). A
/// smaller one is copied into the batch: that costs no more than a piece of its own (eth://
/// 4k random reads at QD32 took 9.9-11.5 us of CPU per I/O lent against 9.3-10.3 copied), and
/// its buffer goes back to the pool at once, which keeps the pool's working set small.
const LEND_READ_MIN: u32 = 64 << 10;
/// HELLO replies kept for retransmitted HELLOs, per port (the oldest go first past this many, or
/// past `MAX_CACHED_HELLO_BYTES`): one HELLO (peer and the attempt's
/// `nonce_c`) is answered from here at most `access::HELLO_ANSWERS` times, its repeats past that
/// dropped. A cached answer lives as long as a challenge is good (`IDLE_EXPIRY` >= the
/// challenge's 60 s); one pushed out by `MAX_CACHED_HELLOS` others is the registry's to answer
/// (`Access::claim_attempt`: the same welcome a few times more, else a refusal), never afresh.
const MAX_CACHED_HELLOS: usize = 4096;
/// ... and at most this many bytes of them: a query's answer (LIST) may fill a datagram, and
/// 4096 of those were 128 MiB a port outside the memory budget.
const MAX_CACHED_HELLO_BYTES: usize = 2 << 20;
/// A HELLO attempt's `nonce_c` (§12.1).
type Attempt = [u8; blkwire_wire::AUTH_LEN];
/// The HELLO answers a port sent, for retransmitted HELLOs: when, what, and how many times.
/// Bounded in entries and bytes (`MAX_CACHED_HELLOS`, `MAX_CACHED_HELLO_BYTES`): a peer that
/// opens and closes sessions, or asks for lists, in a loop must not grow it (it only spares a
/// retransmitted HELLO a second session); the oldest answers go first.
#[derive(Default)]
struct HelloAnswers {
    map: HashMap<(Peer, Attempt), (Instant, Vec<u8>, u8)>,
    /// The keys in the order they were kept (the times only grow): the oldest is found without
    /// a scan of the map (a full cache made every answer kept cost 4096 comparisons). An entry
    /// whose key was dropped meanwhile (expired) is skipped, and pruned by `expire`.
    order: VecDeque<(Instant, (Peer, Attempt))>,
    bytes: usize,
}

impl HelloAnswers {
    /// The answer kept for `attempt` of `peer` and how many times it was sent (the count for
    /// the caller to raise; the answer itself stays as kept, `bytes` counts it).
    fn get_mut(&mut self, peer: Peer, attempt: Attempt) -> Option<(&[u8], &mut u8)> {
        self.map
            .get_mut(&(peer, attempt))
            .map(|(_, answer, sent)| (answer.as_slice(), sent))
    }

    /// Keeps `answer`, sent once at `now`, making room for it first.
    fn insert(&mut self, peer: Peer, attempt: Attempt, now: Instant, answer: &[u8]) {
        while self.map.len() >= MAX_CACHED_HELLOS
            || self.bytes + answer.len() > MAX_CACHED_HELLO_BYTES
        {
            let Some((t, key)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&key).is_some_and(|(kept, ..)| *kept == t) {
                let (_, gone, _) = self.map.remove(&key).expect("present");
                self.bytes -= gone.len();
            }
        }
        self.bytes += answer.len();
        let key = (peer, attempt);
        if let Some((_, old, _)) = self.map.insert(key, (now, answer.to_vec(), 1)) {
            self.bytes -= old.len();
        }
        self.order.push_back((now, key));
    }

    /// Forgets answers older than a challenge's life.
    fn expire(&mut self, now: Instant) {
        self.map
            .retain(|_, (t, ..)| now.duration_since(*t) < IDLE_EXPIRY);
        let map = &self.map;
        self.order
            .retain(|(t, key)| map.get(key).is_some_and(|(kept, ..)| kept == t));
        self.bytes = self.map.values().map(|(_, a, _)| a.len()).sum();
    }
}

/// A queue with no frame for this long is forgotten, a session with its last queue (PROTOCOL.md
/// §9.1); the default of `Limits::datagram_idle`.
pub const IDLE_EXPIRY: Duration = Duration::from_secs(60);
/// What a datagram queue reserves of the memory budget besides its slot table: its bookkeeping.
/// Its data buffers come from the port's pool and are charged to the port.
const QUEUE_BOOKKEEPING: usize = 64 << 10;

/// What a datagram queue of `depth` slots reserves of the memory budget: its slot table (each
/// slot with its HAVE and READ bitmaps, 32 bytes at most each, and their allocations) beside
/// `QUEUE_BOOKKEEPING`, 360 KiB at depth 1024. Every queue reserved 64 KiB whatever its depth,
/// less than a table of 1024 slots alone.
pub fn queue_floor(depth: u16) -> usize {
    QUEUE_BOOKKEEPING + depth as usize * (std::mem::size_of::<TSlot>() + 2 * 64)
}

/// Where a frame came from / goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    Ip(SocketAddr),
    Mac([u8; 6]),
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(a) => write!(f, "{a}"),
            Peer::Mac(m) => write!(
                f,
                "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            ),
        }
    }
}

/// How a port's socket addresses peers.
#[derive(Clone, Copy, Debug)]
pub enum PortKind {
    Udp,
    /// AF_PACKET/SOCK_DGRAM on an interface with this EtherType (network byte order in sockaddr).
    Eth {
        ifindex: i32,
        ethertype: u16,
    },
}

/// A socket handed to a reactor.
pub struct PortSetup {
    pub fd: OwnedFd,
    pub kind: PortKind,
    /// Largest frame payload this port's link carries.
    pub link_payload: u32,
    /// The socket's receive buffer, for credits.
    pub rcvbuf: u32,
    /// Raw Ethernet: a socket that only sends (`blkwire_net::packet_send_socket`); `None` sends
    /// on `fd`.
    pub send_fd: Option<OwnedFd>,
    /// Raw Ethernet: `fd`'s receive ring (`blkwire_net::packet_socket_with_ring`); `None` reads
    /// with `recvmmsg`.
    pub ring: Option<RxRing>,
    /// UDP: the claim on the port that keeps a second target off it, held while the port is
    /// served (`ports::claim_udp_port`).
    pub claim: Option<OwnedFd>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SlotState {
    Empty,
    /// WRITE fragments arriving.
    Assembling,
    /// A WRITE being assembled whose buffer went to another host's request (`make_room`):
    /// its fragments are gone, its generation is not. A fragment of it begins it again, an
    /// older generation is stale (never run twice, §6).
    Reclaimed,
    /// Backend I/O in flight, since then.
    Running(Started),
    /// Answered; the reply can be rebuilt from `hdr` and `status`.
    Done,
}

struct TSlot {
    state: SlotState,
    hdr: Header,
    status: Status,
    buf: Option<AlignedBuf>,
    /// A WRITE whose fragments go straight into the export's memory as they arrive
    /// (`Executor::write_mapped`: RAM): where its first byte goes. `buf` is not used for it.
    into: Option<*mut u8>,
    have: Vec<u8>,
    got: u32,
    frags: u32,
    /// READ retransmissions: the fragments the initiator already holds.
    client_has: Vec<u8>,
}

impl TSlot {
    fn is_running(&self) -> bool {
        matches!(self.state, SlotState::Running(_))
    }
}

struct DQ {
    incarnation: u32,
    session: u32,
    queue: u16,
    peer: Peer,
    exec: Executor,
    max_io: u32,
    fp: u32,
    slots: Vec<TSlot>,
    last_seen: Instant,
    /// Its part of its session's memory budget.
    _mem: Account,
    /// A sealed session's frame keys for this queue (PROTOCOL.md §12.4).
    seal: Option<QueueSeal>,
    /// Its READ data frames' CRCs cover their header only, and so may its WRITE data's (§9.7).
    header_crc: bool,
    /// Closed by the control plane while backend I/O ran: removed once it completes.
    closing: bool,
    /// What one COPY of the session may do (PROTOCOL.md §13).
    copy: CopyLimits,
    /// Frames of this queue taken in (not those dropped for the initiator to send again) and
    /// frames sent to it: a KEEPALIVE's answer reports both, so a tail-loss probe can tell
    /// a slow answer from a lost frame (PROTOCOL.md §9.2).
    taken_in: u64,
    sent: u64,
    /// Bytes of data buffers its slots hold (WRITEs being assembled, requests running): the
    /// measure of its host's part of the port's share when another host's request finds the share
    /// full (`make_room`).
    buffered: usize,
    /// COPYs of it running, each holding a 1 MiB bounce buffer of the port's share that no
    /// other host's request can reclaim (at most `HOST_COPIES` per host).
    copying: usize,
}

impl Peer {
    /// The host: its address without the port (a client's queues each have one).
    fn host(self) -> Peer {
        match self {
            // The port goes, not an IPv6 scope: one fe80:: address on two links is two hosts.
            Peer::Ip(SocketAddr::V6(a)) => Peer::Ip(SocketAddr::V6(std::net::SocketAddrV6::new(
                *a.ip(),
                0,
                0,
                a.scope_id(),
            ))),
            Peer::Ip(a) => Peer::Ip(SocketAddr::new(a.ip(), 0)),
            mac => mac,
        }
    }

    fn id(&self) -> PeerId {
        match *self {
            Peer::Ip(a) => PeerId::ip(a),
            Peer::Mac(m) => PeerId::mac(m),
        }
    }
}

/// The READ or WRITE of header `h` if `execute` would run it (its flags, then admission): one
/// it refuses needs no buffer, and no byte of one lands in place.
fn admitted(exec: &Executor, h: &Header) -> Option<BlockRequest> {
    let block = h.block_request().filter(|_| flush_args_valid(h))?;
    exec.admit(&block).ok()?;
    Some(block)
}

/// What a request frame means for the slot it names (PROTOCOL.md §6, §9.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Another fragment of the WRITE being assembled.
    Fragment,
    /// A retransmitted READ that already ran: run it again (reads are idempotent) and send
    /// only the fragments the initiator lacks.
    Reread,
    /// A duplicate of a finished request: resend its cached reply, never execute it twice.
    ResendReply,
    /// A duplicate of a running request, a stale generation that can never land after a newer
    /// one, or a new generation while the previous one still runs (the initiator retransmits).
    Drop,
    /// A new request on the slot.
    New,
}

/// The generation rules: `held` is the slot's current request, `h` the frame that arrived.
fn classify(state: SlotState, held: &Header, h: &Header) -> Verdict {
    if state == SlotState::Empty {
        return Verdict::New;
    }
    let same = h.tag.generation() == held.tag.generation() && h.opcode == held.opcode;
    match state {
        SlotState::Assembling if same => Verdict::Fragment,
        SlotState::Done if same && h.opcode == Opcode::Read => Verdict::Reread,
        SlotState::Done if same => Verdict::ResendReply,
        SlotState::Running(_) => Verdict::Drop,
        // The WRITE whose buffer was reclaimed, begun again (`make_room`).
        SlotState::Reclaimed if same => Verdict::New,
        // The generation the slot holds, with another command: a duplicate (§6 keys on the
        // generation alone; an initiator moves it on for every request), never run.
        // A later generation, but not one far ahead (`newer_within`); the same one, an older
        // one (stale), or one far ahead is dropped.
        _ if newer_within(h.tag.generation(), held.tag.generation()) => Verdict::New,
        _ => Verdict::Drop,
    }
}

/// Whether generation `gen` is one of the `NEW_WINDOW` after `held`: a new request on the
/// slot. Not the same one, nor an older one (serial arithmetic), nor one far ahead: a copy
/// delayed while the slot went on half the generation space looks newer by serial
/// arithmetic, and an initiator moves on one generation per request.
fn newer_within(gen: u16, held: u16) -> bool {
    (1..=NEW_WINDOW).contains(&gen.wrapping_sub(held))
}

/// COPYs one host may run at once on a port, over all its queues: what it can hold of the
/// port's share in bounce buffers (1 MiB each) that nothing reclaims.
const HOST_COPIES: usize = 8;

/// Batches of `BATCH` datagrams one `DgramPort::receive` reads from its socket at most.
const RECEIVE_ROUNDS: usize = 8;

/// How far ahead of a slot's generation a new request may be (PROTOCOL.md §6): an initiator
/// moves on one per request on the slot, more only for requests given up unseen.
const NEW_WINDOW: u16 = 1024;

/// The part of a READ's `HAVE` payload that can mean something: one bit per fragment of a
/// message of `length` bytes (§9.3), at most 32 bytes. The rest is never kept, so a peer cannot
/// make a slot hold a frame's worth of bitmap.
fn have_bitmap(payload: &[u8], length: u32, frame_payload: u32) -> &[u8] {
    let n = bitmap::bytes_for(fragment_count(length, frame_payload));
    &payload[..payload.len().min(n)]
}

/// Port-level counters: frames that never reached a queue, and how fragments were received.
#[derive(Default, Clone, Copy, Debug, serde::Serialize)]
pub struct PortStats {
    /// Malformed frames, and frames without a valid CRC32C.
    pub bad_frames: u64,
    /// I/O for a session this port does not know (expired or forged); answered with ACCESS.
    pub unknown_session: u64,
    /// Frames for a queue from another address than the one that joined it; dropped (answered
    /// ACCESS as for an unknown session, §9.1).
    pub wrong_peer: u64,
    /// Requests dropped because the memory budget had no room for their data (the
    /// initiator retransmits them).
    pub no_memory: u64,
    /// COPYs dropped because their host already ran `HOST_COPIES` on the port (the
    /// initiator retransmits them).
    pub copies_held_back: u64,
    /// Frames of a sealed session that were not sealed, did not verify or were replayed
    /// (PROTOCOL.md §12.4); dropped, never acted on.
    pub bad_seal: u64,
    /// WRITE fragments the kernel received straight where they belong (UDP, `in_place`).
    pub fragments_in_place: u64,
    /// WRITEs being assembled whose buffer went to another host's request because the
    /// port's share was full and their host held the most (`make_room`); begun again by
    /// their next fragment.
    pub writes_reclaimed: u64,
}

impl PortStats {
    pub fn add(&mut self, o: &PortStats) {
        self.bad_frames += o.bad_frames;
        self.unknown_session += o.unknown_session;
        self.wrong_peer += o.wrong_peer;
        self.no_memory += o.no_memory;
        self.copies_held_back += o.copies_held_back;
        self.bad_seal += o.bad_seal;
        self.fragments_in_place += o.fragments_in_place;
        self.writes_reclaimed += o.writes_reclaimed;
    }
}

/// One datagram socket's counters, for STATS.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PortReport {
    pub thread: usize,
    pub transport: &'static str,
    #[serde(flatten)]
    pub stats: PortStats,
}

pub struct DgramPort {
    fd: OwnedFd,
    /// The listener it serves (`listener_remove` retires its ports).
    listener: u32,
    /// Its listener was removed: it receives nothing more and goes once nothing runs.
    retiring: bool,
    /// The last `receive` stopped at its limit with frames still in the socket: the reactor
    /// calls it again without waiting for a poll (which fires only for new frames).
    more_waiting: bool,
    send_fd: Option<OwnedFd>,
    kind: PortKind,
    link_payload: u32,
    rcvbuf: u32,
    queues: Vec<Option<DQ>>,
    free: Vec<usize>,
    index: HashMap<(u32, u16), usize>,
    /// HELLO replies by (peer, the attempt's `nonce_c`), so a retransmitted HELLO gets the same
    /// session. Keyed by what the address challenge binds (§12.1), not by the HELLO's `nonce`
    /// field, which nothing authenticates in a keyless HELLO: a replay with a new `nonce` each
    /// time would otherwise miss the cache, pass the challenge, and open a session every time.
    hellos: HelloAnswers,
    next_incarnation: u32,
    rx: Vec<Vec<u8>>,
    /// Replies packed into datagrams (PROTOCOL.md §9.6), sent with one sendmmsg.
    tx: Packer<Peer>,
    /// READ buffers whose data `tx` points at: back to the pool once it is sent.
    lent: Vec<AlignedBuf>,
    /// The I/O vectors of one sendmmsg, kept for their capacity.
    iov: IoVecs,
    registry: Arc<Registry>,
    pub stats: PortStats,
    last_sweep: Instant,
    /// `Limits::datagram_idle`.
    idle_expiry: Duration,
    /// Queues that sent a frame in the last two seconds (recounted every second): the receive
    /// buffer is shared among these, not among idle queues waiting to expire.
    active: u32,
    /// Read once per receive batch: idle expiry needs seconds, not a clock read per frame.
    now: Instant,
    /// UDP: runs of equal datagrams leave in one segmented send (PROTOCOL.md §9.6); datagram by
    /// datagram to an address the kernel refused one for, and to all once enough were. By IP
    /// address, not port: the path MTU is the address's, and a client's queues each have a port.
    gso: udp_offload::Segmenting<std::net::IpAddr>,
    /// UDP: the kernel hands over runs that arrived together as one buffer.
    gro: bool,
    /// Raw Ethernet: frames are read in place from a receive ring shared with the kernel.
    ring: Option<RxRing>,
    /// Held, never read: see `PortSetup::claim`.
    _claim: Option<OwnedFd>,
    /// Spare data buffers: a slot holds one only while its request is assembled or runs.
    bufs: Buffers,
    /// The port's part of the memory budget: its receive and send buffers, its pool, and the
    /// bounce buffers of the COPYs running on its queues.
    mem: Account,
    /// COPYs running on this port's queues (each may hold [`COPY_CHUNK`] bytes).
    copying: usize,
    /// The receive and send buffers' size (the part of `mem` that never changes).
    fixed: usize,
    /// Where an encrypted frame's payload is decrypted (one frame at a time).
    scratch: Vec<u8>,
    /// The datagram being handled already drew an ACCESS for an unknown session.
    refused_in_datagram: bool,
    /// The last datagram handled was a fragment of a WRITE of several: the next receive peeks
    /// first, to take the rest, or the next such WRITE, in place (`in_place`). UDP with GRO.
    expect_fragments: bool,
    /// The fragment being handled was received where it belongs (queue, slot, fragment):
    /// `fragment` has nothing to copy.
    in_place: Option<(usize, u16, u32)>,
    /// Completion notifiers of queues whose backend completes on its own threads, to be watched
    /// (`Some`) or no longer (`None`) by the reactor: (queue, incarnation, descriptor).
    notifier_changes: Vec<(usize, u32, Option<RawFd>)>,
    /// Counters of the queues that closed here.
    closed: ClosedTotals,
}

/// Encodes io_uring user data for a datagram queue's backend I/O; supplied by the reactor.
pub type UserData<'a> = &'a dyn Fn(u32, usize, u16) -> u64;

fn mac_of(sll: &libc::sockaddr_ll) -> [u8; 6] {
    let mut m = [0u8; 6];
    m.copy_from_slice(&sll.sll_addr[..6]);
    m
}

/// True for a source MAC a reply may go to: one station. A group address (broadcast or
/// multicast: the I/G bit) or all zeros is never a sender's own, only a forgery, and answering
/// it would flood the reply (READ data included) to every host on the segment, for a sender
/// that need not even receive it (a challenge sent to broadcast reaches the forger too).
fn is_station(m: [u8; 6]) -> bool {
    m[0] & 1 == 0 && m != [0; 6]
}

impl DgramPort {
    /// The incarnation its next queue gets.
    pub fn next_incarnation(&self) -> u32 {
        self.next_incarnation
    }

    /// Starts its queues' incarnations at `next` (a port taking the index of one gone: see
    /// `Reactor`'s `Msg::Port`).
    pub fn continue_incarnations(&mut self, next: u32) {
        self.next_incarnation = next & 0xf_ffff;
    }

    pub fn new(p: PortSetup, listener: u32, registry: Arc<Registry>) -> DgramPort {
        let frame = HEADER_LEN + p.link_payload as usize;
        let idle_expiry = registry.limits().datagram_idle;
        let udp = matches!(p.kind, PortKind::Udp);
        let gro = udp && udp_offload::enable_gro(p.fd.as_raw_fd());
        let rx_len = if gro {
            udp_offload::GRO_BUFFER
        } else {
            frame.max(4096)
        };
        let ring = p.ring;
        let fixed = if ring.is_some() { 0 } else { BATCH * rx_len } + BATCH * frame;
        let mem = Account::forced(registry.budget(), fixed, registry.connection_share());
        DgramPort {
            _claim: p.claim,
            bufs: Buffers::default(),
            mem,
            copying: 0,
            fixed,
            scratch: vec![0u8; frame],
            refused_in_datagram: false,
            expect_fragments: false,
            in_place: None,
            fd: p.fd,
            listener,
            retiring: false,
            more_waiting: false,
            send_fd: p.send_fd,
            kind: p.kind,
            link_payload: p.link_payload,
            rcvbuf: p.rcvbuf,
            queues: Vec::new(),
            free: Vec::new(),
            index: HashMap::new(),
            hellos: HelloAnswers::default(),
            next_incarnation: 1,
            // A ring port reads in place: no receive buffers.
            rx: (0..if ring.is_some() { 0 } else { BATCH })
                .map(|_| vec![0u8; rx_len])
                .collect(),
            tx: Packer::with_capacity(BATCH, BATCH * frame),
            lent: Vec::new(),
            iov: IoVecs::default(),
            registry,
            stats: PortStats::default(),
            last_sweep: Instant::now(),
            idle_expiry,
            now: Instant::now(),
            active: 1,
            gso: udp_offload::Segmenting::new(udp),
            gro,
            ring,
            notifier_changes: Vec::new(),
            closed: ClosedTotals::default(),
        }
    }

    /// Whether frames wait to be read without a poll saying so: in the receive ring (a
    /// spinning reactor checks this directly, which is faster than waiting for the socket's
    /// poll completion), or left in the socket by a `receive` that stopped at its limit. Never
    /// for a retiring port, which reads nothing more (or the reactor would spin on its ring).
    pub fn frames_waiting(&self) -> bool {
        !self.retiring && (self.more_waiting || self.ring.as_ref().is_some_and(RxRing::ready))
    }

    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Per-queue window (PROTOCOL.md §9.4) for frames of the link's largest size.
    fn credit(&self) -> u16 {
        self.credit_for(self.link_payload)
    }

    /// Per-queue window (PROTOCOL.md §9.4): the receive buffer shared by the active queues,
    /// counted in frames of the queue's negotiated size (a UDP port cannot know the path MTU,
    /// so counting at its 32 KiB limit would starve queues of MTU-sized frames).
    fn credit_for(&self, frame_payload: u32) -> u16 {
        let frames = blkwire_net::frames_in_buffer(self.rcvbuf, HEADER_LEN as u32 + frame_payload);
        let active = self.active.max(1);
        // Never more than two messages' worth in flight per queue: bursts beyond that only
        // overflow the receiver's backlog.
        (frames / active).clamp(1, 2 * crate::session::MAX_FRAGMENTS) as u16
    }

    fn queue_credit(&self, qi: usize) -> u16 {
        match self.queues.get(qi).and_then(Option::as_ref) {
            Some(q) => self.credit_for(q.fp),
            None => self.credit(),
        }
    }

    /// Reads the waiting frames (a ring's lap, or `RECEIVE_ROUNDS` batches from the socket:
    /// `frames_waiting` says when more wait) and handles them; replies are batched and sent at
    /// the end.
    pub fn receive(&mut self, sq: &mut dyn Submitter, ud: UserData) {
        if self.retiring {
            return;
        }
        self.now = Instant::now();
        if let Some(mut ring) = self.ring.take() {
            ring.take_lap(|data, from| {
                let peer = Peer::Mac(mac_of(from));
                if self.sent_by_station(peer) {
                    self.on_datagram(data, peer, sq, ud);
                }
            });
            self.ring = Some(ring);
            self.flush();
            return;
        }
        // Runs taken in place in this call: after a batch's worth, the rest is read the usual
        // way, at most `RECEIVE_ROUNDS` batches: a peer that keeps the socket full (a flood
        // of junk, of frames drawing ACCESS) must not keep the reactor from its other
        // connections and completions. What is left is read at the reactor's next turn
        // (`frames_waiting`).
        let mut in_place = 0;
        self.more_waiting = false;
        let mut rounds = 0;
        loop {
            if self.gro && self.expect_fragments && in_place < BATCH {
                match self.receive_in_place(sq, ud) {
                    in_place::Peeked::Taken => {
                        in_place += 1;
                        continue;
                    }
                    in_place::Peeked::Empty => break,
                    in_place::Peeked::Other => {}
                }
            }
            // SAFETY: all-zero iovecs, message headers and addresses (null pointers, zero
            // lengths) are valid values; every one used is filled in below.
            let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut names: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
            let mut cmsgs = [Cmsg::default(); BATCH];
            for i in 0..BATCH {
                iov[i] = libc::iovec {
                    iov_base: self.rx[i].as_mut_ptr().cast(),
                    iov_len: self.rx[i].len(),
                };
                msgs[i].msg_hdr.msg_iov = &mut iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                msgs[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
                msgs[i].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
                if self.gro {
                    cmsgs[i].attach_for_receive(&mut msgs[i].msg_hdr);
                }
            }
            // SAFETY: buffers and names are ours and outlive the call.
            let r = unsafe {
                libc::recvmmsg(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r <= 0 {
                break;
            }
            let n = r as usize;
            for i in 0..n {
                let Some(peer) = self.peer_of(&names[i]).filter(|&p| self.sent_by_station(p))
                else {
                    continue;
                };
                let len = msgs[i].msg_len as usize;
                let segment = cmsgs[i].received_segment(&msgs[i].msg_hdr);
                let buf = std::mem::take(&mut self.rx[i]);
                for d in udp_offload::segments(&buf[..len.min(buf.len())], segment) {
                    self.on_datagram(d, peer, sq, ud);
                }
                self.rx[i] = buf;
            }
            if n < BATCH {
                break;
            }
            rounds += 1;
            if rounds == RECEIVE_ROUNDS {
                self.more_waiting = true;
                break;
            }
        }
        self.flush();
    }

    /// False, counted as a bad frame, for a frame whose source is no one station's
    /// ([`is_station`]): dropped before it is read, on the ring and the recvmmsg paths alike.
    fn sent_by_station(&mut self, peer: Peer) -> bool {
        match peer {
            Peer::Mac(m) if !is_station(m) => {
                self.stats.bad_frames += 1;
                false
            }
            _ => true,
        }
    }

    fn peer_of(&self, ss: &libc::sockaddr_storage) -> Option<Peer> {
        match ss.ss_family as i32 {
            libc::AF_INET => {
                // SAFETY: the kernel wrote a sockaddr_in for AF_INET.
                let a: &libc::sockaddr_in =
                    unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(Peer::Ip(SocketAddr::from((ip, u16::from_be(a.sin_port)))))
            }
            libc::AF_INET6 => {
                // SAFETY: the kernel wrote a sockaddr_in6 for AF_INET6.
                let a: &libc::sockaddr_in6 =
                    unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                // The scope (interface) is part of a link-local address: without it replies
                // would leave by whichever interface the kernel picks, and two peers with the
                // same fe80:: address on different links would be one.
                Some(Peer::Ip(SocketAddr::V6(std::net::SocketAddrV6::new(
                    ip,
                    u16::from_be(a.sin6_port),
                    0,
                    a.sin6_scope_id,
                ))))
            }
            libc::AF_PACKET => {
                // SAFETY: the kernel wrote a sockaddr_ll for AF_PACKET.
                let a: &libc::sockaddr_ll =
                    unsafe { &*(ss as *const _ as *const libc::sockaddr_ll) };
                // Only this link's frames: not ours looping back, not another station's, not
                // another interface's or VLAN's (`for_this_link`).
                let PortKind::Eth { ifindex, .. } = self.kind else {
                    return None;
                };
                if !blkwire_net::for_this_link(a, ifindex) {
                    return None;
                }
                Some(Peer::Mac(mac_of(a)))
            }
            _ => None,
        }
    }

    /// Queues one frame (with its CRC) for `peer`, alone in its datagram: answers outside a
    /// queue (handshakes, discovery, unknown sessions).
    fn send_frame(&mut self, mut h: Header, payload: &[u8], peer: Peer) {
        h.payload_len = payload.len() as u32;
        h.seal_crc(payload);
        self.tx.push(&h, payload, peer, 0);
        if self.tx.len() == BATCH {
            self.flush();
        }
    }

    /// ACCESS to `req`, once per datagram: packed frames from a forged address draw one small
    /// answer, not one each.
    fn refuse_once(&mut self, req: &Header, peer: Peer) {
        if !std::mem::replace(&mut self.refused_in_datagram, true) {
            self.reply(req, Status::Access, peer);
        }
    }

    fn reply(&mut self, req: &Header, status: Status, peer: Peer) {
        let mut r = req.reply(status, 0);
        r.credit = self.credit();
        self.send_frame(r, &[], peer);
    }

    /// Queues a frame for queue `qi`'s initiator, packed with the queue's other frames up to
    /// its datagram size, and sealed if the session is (PROTOCOL.md §12.4).
    fn send_queue(&mut self, qi: usize, h: Header, payload: &[u8]) {
        let q = self.queues[qi].as_mut().expect("present");
        q.sent += (h.opcode != Opcode::Join) as u64;
        // Replies to JOIN, KEEPALIVE and LOGOUT travel alone (PROTOCOL.md §9.6): an initiator
        // may read them with its handshake's receive, which takes one frame per datagram.
        let alone = matches!(h.opcode, Opcode::Join | Opcode::Keepalive | Opcode::Logout);
        // The datagram size packing may fill (0: never pack this one), with `seal` bytes a frame.
        let limit = |seal| {
            if alone {
                0
            } else {
                HEADER_LEN + q.fp as usize + seal
            }
        };
        match &mut q.seal {
            Some(k) => self
                .tx
                .push_sealed(&h, payload, q.peer, limit(SEAL_LEN), |f| {
                    k.sealer.seal(f, HEADER_LEN)
                }),
            None => self.tx.push_crc(&h, payload, q.peer, limit(0)),
        }
        if self.tx.len() == BATCH {
            self.flush();
        }
    }

    /// `send_queue` for a READ reply's data, which the datagram points at instead of copying
    /// when the session is not sealed (`Packer::push_lent`; a seal is computed over a copy).
    ///
    /// # Safety
    ///
    /// `data` must stay readable for `len` bytes until the next `flush`.
    unsafe fn send_queue_lent(&mut self, qi: usize, h: Header, data: *const u8, len: usize) {
        let q = self.queues[qi].as_mut().expect("present");
        if q.seal.is_some() {
            // SAFETY: readable for `len` bytes (the caller's promise); copied right away.
            return self.send_queue(qi, h, unsafe { std::slice::from_raw_parts(data, len) });
        }
        q.sent += 1;
        let limit = HEADER_LEN + q.fp as usize;
        // SAFETY: as promised by the caller; `flush` sends before anything frees the data.
        unsafe { self.tx.push_lent(&h, data, len, q.peer, limit) };
        if self.tx.len() == BATCH {
            self.flush();
        }
    }

    /// A header-only answer to a frame of queue `qi`.
    fn reply_queue(&mut self, qi: usize, req: &Header, status: Status) {
        if !matches!(
            req.opcode,
            Opcode::Join | Opcode::Keepalive | Opcode::Logout
        ) {
            // A request refused without running is still a reply, and an error (as counted
            // by `finish_read` for those that ran).
            let stats = &mut self.queues[qi].as_mut().expect("present").exec.stats;
            stats.frames_out += 1;
            stats.errors += (status != Status::Ok) as u64;
        }
        let mut r = req.reply(status, 0);
        r.credit = self.queue_credit(qi);
        self.send_queue(qi, r, &[]);
    }

    /// Sends the batched datagrams; on UDP, each run of equal ones to a peer in one segmented
    /// send (PROTOCOL.md §9.6).
    pub fn flush(&mut self) {
        let fd = self.send_fd.as_ref().unwrap_or(&self.fd).as_raw_fd();
        let mut iov = std::mem::take(&mut self.iov);
        let mut done = 0;
        while done < self.tx.len() {
            let mut batch = SendBatch::<BATCH>::new(&mut iov);
            let gso = &self.gso;
            let limits = |d: &Peer| match d {
                Peer::Ip(a) => gso.limits(&a.ip()),
                Peer::Mac(_) => udp_offload::run_limits(false),
            };
            for run in self.tx.runs(done, limits).take(BATCH) {
                // SAFETY: the packer's own bytes stay as they are until it is cleared below;
                // the bytes it was lent are READ data in `self.lent` or in an export's mapping,
                // both kept until then (`finish_read`, `remove`).
                unsafe {
                    batch.push(self.tx.pieces(&run), run.segment, run.count, |ss| {
                        self.fill_name(ss, run.dest)
                    })
                };
            }
            match batch.send(fd) {
                Ok(sent) => done += sent.datagrams,
                Err(f) if f.segmented && udp_offload::refused(&f.error) => {
                    // This route or kernel cannot segment (a datagram over the peer's path MTU,
                    // no checksum offload): datagram by datagram to that address from now on.
                    // The failed message is always the batch's first (sendmmsg stops before one
                    // it cannot send and reports the error only when it is the first).
                    if let Peer::Ip(a) = self.tx.dest(done) {
                        self.gso.refused_by(a.ip());
                    }
                }
                // A datagram the kernel refuses (buffer full, peer gone) is lost like any network
                // loss: the initiator's timer recovers it. EFAULT would be a piece pointing at
                // memory no longer there: a bug, said out loud rather than taken for loss.
                Err(f) => {
                    if f.error.raw_os_error() == Some(libc::EFAULT) {
                        crate::log!(Level::Warn, "datagram send refused a piece: {}", f.error);
                    }
                    done += f.datagrams
                }
            }
        }
        self.tx.clear();
        self.iov = iov;
        for buf in self.lent.drain(..) {
            self.bufs.give_back(buf);
        }
    }

    fn fill_name(&self, ss: &mut libc::sockaddr_storage, peer: Peer) -> u32 {
        match (peer, self.kind) {
            (Peer::Ip(SocketAddr::V4(a)), _) => {
                // SAFETY: sockaddr_storage is large enough for sockaddr_in.
                let s: &mut libc::sockaddr_in =
                    unsafe { &mut *(ss as *mut _ as *mut libc::sockaddr_in) };
                s.sin_family = libc::AF_INET as u16;
                s.sin_port = a.port().to_be();
                s.sin_addr.s_addr = u32::from(*a.ip()).to_be();
                std::mem::size_of::<libc::sockaddr_in>() as u32
            }
            (Peer::Ip(SocketAddr::V6(a)), _) => {
                // SAFETY: as above, for sockaddr_in6.
                let s: &mut libc::sockaddr_in6 =
                    unsafe { &mut *(ss as *mut _ as *mut libc::sockaddr_in6) };
                s.sin6_family = libc::AF_INET6 as u16;
                s.sin6_port = a.port().to_be();
                s.sin6_addr.s6_addr = a.ip().octets();
                s.sin6_scope_id = a.scope_id();
                std::mem::size_of::<libc::sockaddr_in6>() as u32
            }
            (Peer::Mac(m), PortKind::Eth { ifindex, ethertype }) => {
                // SAFETY: as above, for sockaddr_ll.
                let s: &mut libc::sockaddr_ll =
                    unsafe { &mut *(ss as *mut _ as *mut libc::sockaddr_ll) };
                s.sll_family = libc::AF_PACKET as u16;
                s.sll_protocol = ethertype.to_be();
                s.sll_ifindex = ifindex;
                s.sll_halen = 6;
                s.sll_addr[..6].copy_from_slice(&m);
                std::mem::size_of::<libc::sockaddr_ll>() as u32
            }
            (Peer::Mac(_), PortKind::Udp) => 0,
        }
    }

    /// One datagram that did not come through the socket (the fuzz targets, `crate::fuzzing`),
    /// handled as [`DgramPort::receive`] handles each, its answers sent.
    pub(crate) fn receive_datagram(
        &mut self,
        b: &[u8],
        peer: Peer,
        sq: &mut dyn Submitter,
        ud: UserData,
    ) {
        self.now = Instant::now();
        self.on_datagram(b, peer, sq, ud);
        self.flush();
    }

    /// One received datagram: every frame packed in it (PROTOCOL.md §9.6), each with a valid
    /// CRC or a seal.
    fn on_datagram(&mut self, b: &[u8], peer: Peer, sq: &mut dyn Submitter, ud: UserData) {
        self.refused_in_datagram = false;
        self.expect_fragments = false;
        for f in datagram::frames(b, self.link_payload.max(4096)) {
            match f {
                // A frame that fails validation ends the walk (§9.6): a reply is no request,
                // and session-0 frames travel alone (packed, each would draw its own answer to
                // an address that answered no challenge, more than the datagram: §12.5).
                Ok(f)
                    if f.header.is_reply() || (f.header.session == 0 && f.raw.len() != b.len()) =>
                {
                    self.stats.bad_frames += 1;
                    break;
                }
                Ok(f) => {
                    if !self.on_frame(f, b.len(), peer, sq, ud) {
                        break;
                    }
                }
                Err(_) => self.stats.bad_frames += 1,
            }
        }
    }

    /// Acts on one frame of a datagram; false when it failed validation (counted bad), which
    /// ends the datagram's walk (§9.6).
    fn on_frame(
        &mut self,
        f: Frame<'_>,
        datagram_len: usize,
        peer: Peer,
        sq: &mut dyn Submitter,
        ud: UserData,
    ) -> bool {
        let h = f.header;
        if h.session == 0 {
            if f.sealed() || h.flags.has(Flags::HEAD_CRC) {
                self.stats.bad_frames += 1;
                return false;
            }
            self.control(&h, f.payload, datagram_len, peer);
            return true;
        }
        let found = self.index.get(&(h.session, h.queue)).copied();
        // Only WRITE data may leave its payload to UDP's checksum, and only in a queue of a
        // session that asked for it (§9.7): anything else with a header-only CRC (a JOIN, a
        // frame for no queue) is as bad as a frame with a wrong CRC.
        if h.flags.has(Flags::HEAD_CRC) {
            // Granted to the queue's own source only: a stranger's frame is as bad whether the
            // queue exists or not, so its answer says nothing of which sessions do.
            let granted = found
                .and_then(|qi| self.queues[qi].as_ref())
                .is_some_and(|q| q.header_crc && q.peer == peer);
            if !(granted && h.opcode == Opcode::Write && !f.payload.is_empty()) {
                self.stats.bad_frames += 1;
                return false;
            }
        }
        let Some(qi) = found else {
            if h.opcode == Opcode::Join {
                self.join(&h, f, peer);
                return true;
            }
            self.stats.unknown_session += 1;
            // Tell the initiator at once instead of letting it time out.
            self.refuse_once(&h, peer);
            return true;
        };
        let q = self.queues[qi].as_mut().expect("indexed queue exists");
        if q.peer != peer {
            self.stats.wrong_peer += 1;
            // Answered as for an unknown session (§9.1): dropped in silence, it told a scanning
            // source which session ids exist, and a keyless session's id and source are all
            // that stand between it and a forged frame (§12.4).
            self.refuse_once(&h, peer);
            return true;
        }
        // A sealed session's frames are acted on only once their seal opens (§12.4).
        let mut scratch = std::mem::take(&mut self.scratch);
        let payload = match (&mut q.seal, f.sealed()) {
            (None, false) => Ok(f.payload),
            (Some(k), true) => k
                .opener
                .open(f.raw, HEADER_LEN, &mut scratch)
                .map_err(|_| ()),
            _ => Err(()),
        };
        let valid = match payload {
            Ok(payload) => {
                self.on_queue_frame(qi, &h, payload, sq, ud);
                true
            }
            Err(()) => {
                self.stats.bad_seal += 1;
                false
            }
        };
        self.scratch = scratch;
        valid
    }

    fn on_queue_frame(
        &mut self,
        qi: usize,
        h: &Header,
        payload: &[u8],
        sq: &mut dyn Submitter,
        ud: UserData,
    ) {
        let credit = self.queue_credit(qi);
        let q = self.queues[qi].as_mut().expect("indexed queue exists");
        q.last_seen = self.now;
        q.exec.stats.frames_in += 1;
        // A JOIN (and its answer) belongs to the handshake, which the initiator does not count
        // as the queue's frames (PROTOCOL.md §9.2).
        q.taken_in += (h.opcode != Opcode::Join) as u64;
        match h.opcode {
            Opcode::Join => self.reply_queue(qi, h, Status::Ok),
            Opcode::Keepalive => {
                let mut counts = [0u8; 16];
                counts[..8].copy_from_slice(&q.taken_in.to_le_bytes());
                counts[8..].copy_from_slice(&q.sent.to_le_bytes());
                let mut r = h.reply(Status::Ok, 0);
                r.credit = credit;
                self.send_queue(qi, r, &counts);
            }
            Opcode::Logout => {
                self.reply_queue(qi, h, Status::Ok);
                self.close_queue(qi);
            }
            Opcode::Hello | Opcode::List | Opcode::Stats => {
                self.reply_queue(qi, h, Status::Invalid)
            }
            // A refused COPY copied nothing: its reply's length says so (§13).
            Opcode::Copy if !q.copy.enabled() => {
                let h = Header { length: 0, ..*h };
                self.reply_queue(qi, &h, Status::Unsupported)
            }
            _ => self.io_frame(qi, h, payload, credit, sq, ud),
        }
    }

    /// Frames without a session: HELLO and LIST (discovery). Until a peer has answered a
    /// challenge, nothing sent to it is larger than what it sent (PROTOCOL.md §12.5).
    fn control(&mut self, h: &Header, payload: &[u8], datagram_len: usize, peer: Peer) {
        let id = peer.id();
        match h.opcode {
            Opcode::List if self.registry.access.has_keys() => {
                self.registry
                    .access
                    .refuse(&peer, "LIST without authentication");
                self.reply(h, Status::Access, peer)
            }
            Opcode::List => {
                let mut list = self.registry.list(None, &id.addr);
                let total = list.len();
                // No bigger than the request (an initiator pads it to what it can take).
                let room =
                    (self.link_payload as usize).min(datagram_len.saturating_sub(HEADER_LEN));
                // The first entries that fit, counted once: not encoded again per entry dropped.
                let mut used = ExportEntry::LIST_HEADER_LEN;
                let fit = list
                    .iter()
                    .take_while(|e| {
                        used += e.encoded_len();
                        used <= room
                    })
                    .count();
                list.truncate(fit);
                let mut p = ExportEntry::encode_list(&list).unwrap_or_default();
                if p.len() > room {
                    p.clear();
                }
                let mut r = h.reply(Status::Ok, 0);
                r.length = total as u32;
                self.send_frame(r, &p, peer);
            }
            Opcode::Hello => {
                let Ok(hello) = Hello::decode(payload) else {
                    return self.reply(h, Status::Invalid, peer);
                };
                if hello.client_features & QUERY_STATS != 0 {
                    // STATS gathers from every reactor, this one included: not from here.
                    return self.reply(h, Status::Unsupported, peer);
                }
                let now = Instant::now();
                if let Some((cached, sent)) = self.hellos.get_mut(peer, hello.auth.nonce_c) {
                    // Answered a few times at most: the final HELLO of an exchange someone on
                    // the path saw can be replayed from the victim's address, and a query's
                    // answer is far larger than the HELLO (§12.5).
                    if *sent >= crate::access::HELLO_ANSWERS {
                        return;
                    }
                    *sent += 1;
                    let cached = cached.to_vec();
                    let mut r = h.reply(Status::Ok, 0);
                    r.credit = self.credit();
                    return self.send_frame(r, &cached, peer);
                }
                let no_stats = Vec::new;
                // A HELLO replacing a queue (§2.6) never waits here (the reactor must not
                // block): BUSY until the queue is gone, and the initiator asks again.
                match self.registry.hello(
                    &hello,
                    &id,
                    (Some(self.link_payload), matches!(self.kind, PortKind::Udp)),
                    None,
                    &no_stats,
                ) {
                    HelloAnswer::Challenge(nonce) => {
                        let r = h.reply(Status::Challenge, 0);
                        self.send_frame(r, &nonce, peer);
                    }
                    HelloAnswer::Welcome(p, adm) => {
                        // Not a welcome the registry sent again (no session made now): its
                        // repeats are the registry's to count, and it pushes nothing out.
                        let remember = adm.is_some() || hello.is_query();
                        let mut r = h.reply(Status::Ok, 0);
                        r.credit = self.credit();
                        if let Some(adm) = adm {
                            let fp = self
                                .registry
                                .frame_payload(adm.session)
                                .unwrap_or(self.link_payload);
                            r.credit = self.credit_for(fp);
                            if !self.add_queue(*adm, fp, peer) {
                                // Refused, not welcomed into a queue that does not exist.
                                return self.reply(h, Status::Io, peer);
                            }
                        }
                        if remember {
                            self.hellos.insert(peer, hello.auth.nonce_c, now, &p);
                        }
                        self.send_frame(r, &p, peer);
                    }
                    HelloAnswer::Refused(st) => self.reply(h, st, peer),
                }
            }
            _ => self.reply(h, Status::Invalid, peer),
        }
    }

    fn join(&mut self, h: &Header, f: Frame<'_>, peer: Peer) {
        let raw = f.sealed().then_some(f.raw);
        let id = peer.id();
        match self
            .registry
            .join(h.session, h.queue, f.payload, &id, true, raw)
        {
            Ok(adm) => {
                let fp = self
                    .registry
                    .frame_payload(h.session)
                    .unwrap_or(self.link_payload);
                let sealed = adm.seal.is_some();
                if !self.add_queue(adm, fp, peer) {
                    return self.reply(h, Status::Io, peer);
                }
                match self.index.get(&(h.session, h.queue)) {
                    Some(&qi) if sealed => self.reply_queue(qi, h, Status::Ok),
                    _ => self.reply(h, Status::Ok, peer),
                }
            }
            // Unsealed, from no queue's sealer: a sealer's sequence numbers must never be
            // spent on a queue that may not come to exist (PROTOCOL.md §12.4).
            Err(JoinRefused::Challenge(nonce)) => {
                let r = h.reply(Status::Challenge, 0);
                self.send_frame(r, &nonce, peer);
            }
            // A repeat of a JOIN that came late, after its queue ended: not an intruder. ACCESS
            // once per datagram, as to any frame for a session this port does not serve: a
            // JOIN to a live queue from another address draws one (`refuse_once`), and so
            // many packed JOINs drawing one each told which queues are live (§9.1).
            Err(JoinRefused::Ended) => self.refuse_once(h, peer),
            Err(JoinRefused::Status(Status::Access)) => {
                self.registry
                    .access
                    .refuse(&peer, &format!("JOIN to session {} not proven", h.session));
                self.refuse_once(h, peer)
            }
            Err(JoinRefused::Status(st)) => self.reply(h, st, peer),
        }
    }

    /// Serves the queue the registry admitted. False when its export's queue could not be
    /// opened (logged, and the registry told the queue left): the HELLO or JOIN is answered
    /// IO, so the initiator learns it failed rather than meeting a missing queue at its first
    /// request.
    fn add_queue(&mut self, adm: crate::session::Admitted, fp: u32, peer: Peer) -> bool {
        let Some(exec) = Executor::for_queue(
            &self.registry,
            &adm.export,
            (adm.session, adm.queue),
            adm.max_io,
            adm.size,
        ) else {
            return false;
        };
        let idx = self.free.pop().unwrap_or_else(|| {
            self.queues.push(None);
            self.queues.len() - 1
        });
        let incarnation = self.next_incarnation;
        self.next_incarnation = (self.next_incarnation + 1) & 0xf_ffff;
        let empty = Header::request(Opcode::Keepalive, Tag::default(), 0, 0);
        self.queues[idx] = Some(DQ {
            incarnation,
            session: adm.session,
            queue: adm.queue,
            peer,
            max_io: adm.max_io,
            fp,
            slots: (0..adm.depth)
                .map(|_| TSlot {
                    state: SlotState::Empty,
                    hdr: empty,
                    status: Status::Ok,
                    into: None,
                    buf: None,
                    have: Vec::new(),
                    got: 0,
                    frags: 1,
                    client_has: Vec::new(),
                })
                .collect(),
            last_seen: Instant::now(),
            exec,
            _mem: adm.mem,
            seal: adm.seal,
            header_crc: adm.header_crc,
            closing: false,
            copy: adm.copy,
            taken_in: 0,
            sent: 0,
            buffered: 0,
            copying: 0,
        });
        if let Some(fd) = self.queues[idx].as_ref().and_then(|q| q.exec.notifier()) {
            self.notifier_changes.push((idx, incarnation, Some(fd)));
        }
        self.index.insert((adm.session, adm.queue), idx);
        true
    }

    /// Ends a queue: from now on its frames are answered as for an unknown session, and it
    /// goes as soon as no backend I/O of its own runs (at once, or when the last completes).
    fn close_queue(&mut self, qi: usize) {
        if let Some(q) = self.queues[qi].as_mut() {
            q.closing = true;
            self.index.remove(&(q.session, q.queue));
            self.remove(qi);
        }
    }

    fn remove(&mut self, qi: usize) {
        if self.tx.lends() {
            // Replies waiting to be sent may point at the queue's export (`finish_read`).
            self.flush();
        }
        if let Some(mut q) = self.queues[qi].take() {
            if q.slots.iter().any(|s| s.is_running()) {
                // Backend I/O still owns slot buffers: keep the queue until it completes.
                self.queues[qi] = Some(q);
                return;
            }
            // A WRITE still assembling (or refused) holds its buffer in the slot: back to the
            // pool, which counts it, or the port would charge it to the budget for ever.
            for s in &mut q.slots {
                if let Some(b) = s.buf.take() {
                    self.bufs.give_back(b);
                }
            }
            self.index.remove(&(q.session, q.queue));
            self.closed
                .add_queue(&self.registry, q.exec.export(), &q.exec.stats);
            self.registry.leave(q.session, q.queue, &q.exec.stats);
            if q.exec.notifier().is_some() {
                self.notifier_changes.push((qi, q.incarnation, None));
            }
            self.free.push(qi);
        }
    }

    /// Forgets queues idle for longer than `idle_expiry` and stale HELLO replies.
    pub fn sweep(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.hellos.expire(now);
        // Spare copy sources of exports removed since, for queues that make no request.
        for q in self.queues.iter_mut().flatten() {
            q.exec.drop_gone_sources();
        }
        // Spare buffers go back to the budget when no queue has been busy for a while, and
        // what the pool freed is given back too.
        if self.active == 0 {
            self.bufs.clear();
        }
        self.mem.settle(self.held());
        let expiry = self.idle_expiry;
        self.active = self
            .queues
            .iter()
            .flatten()
            .filter(|q| now.duration_since(q.last_seen) < Duration::from_secs(2))
            .count() as u32;
        for qi in 0..self.queues.len() {
            if self.queues[qi].as_ref().is_some_and(|q| q.closing) {
                self.remove(qi);
                continue;
            }
            let idle = self.queues[qi]
                .as_ref()
                .is_some_and(|q| now.duration_since(q.last_seen) > expiry);
            if idle {
                let q = self.queues[qi].as_ref().expect("checked");
                crate::log!(
                    Level::Info,
                    "session {} queue {}: idle for {}s, forgotten",
                    q.session,
                    q.queue,
                    expiry.as_secs()
                );
                // Forgotten now (its frames answered as an unknown session's), gone once no
                // backend I/O of its own runs: a hung one kept it, unmarked, and logged this
                // line at every sweep.
                self.close_queue(qi);
            }
        }
    }

    /// I/O frames: the generation rules of PROTOCOL.md §6 and §9.2, then reassembly and execution.
    fn io_frame(
        &mut self,
        qi: usize,
        h: &Header,
        payload: &[u8],
        credit: u16,
        sq: &mut dyn Submitter,
        ud: UserData,
    ) {
        let q = self.queues[qi].as_mut().expect("present");
        let slot = h.tag.slot();
        if slot as usize >= q.slots.len() {
            return self.reply_queue(qi, h, Status::Invalid);
        }
        let verdict = classify(q.slots[slot as usize].state, &q.slots[slot as usize].hdr, h);
        if self.in_place.is_some() && verdict != Verdict::Fragment {
            // Received in place as a fragment of a WRITE being assembled, which it is not
            // (`in_place` checked it is): its payload is not its bytes.
            self.in_place = None;
            q.exec.stats.protocol_errors += 1;
            return;
        }
        // A request that needs a data buffer (or, a new COPY, a bounce buffer while it runs:
        // PROTOCOL.md §13) the memory budget cannot cover now is dropped before it changes the
        // slot, like a lost frame: the initiator retransmits it. A repeated READ runs with the
        // length it was taken with, whatever the repeat's header says.
        let length = match verdict {
            Verdict::Reread => q.slots[slot as usize].hdr.length,
            _ => h.length,
        };
        let len = length as usize;
        let fresh = matches!(verdict, Verdict::Reread | Verdict::New);
        // A new or repeated READ or WRITE as `execute` will take it, if it will: checked again
        // for a repeat (the export may have grown or shrunk since it last ran, and a failed one
        // gave its buffer back).
        let block = match (h.opcode, verdict) {
            (_, Verdict::Reread) => admitted(&q.exec, &q.slots[slot as usize].hdr),
            (Opcode::Read | Opcode::Write, Verdict::New) => admitted(&q.exec, h),
            _ => None,
        };
        // Only a request that will run may make room (`make_room` reclaims other hosts'
        // WRITEs): one refused as it is taken (outside the export, a WRITE whose fragment count
        // does not match its length, a COPY whose descriptor does not decode) needs nothing,
        // nor does a READ repeated that admission refuses now.
        let runs = match (h.opcode, verdict) {
            (_, Verdict::Reread) | (Opcode::Read, Verdict::New) => block.is_some(),
            (Opcode::Write, Verdict::New) => {
                block.is_some() && h.frag_count as u32 == fragment_count(h.length, q.fp)
            }
            (Opcode::Copy, Verdict::New) => {
                h.frag_count == 1 && CopyDescriptor::decode_within(payload, &q.copy).is_ok()
            }
            _ => true,
        };
        // RAM takes a new WRITE's fragments where they belong as they arrive: no buffer, one
        // copy fewer. Only one that runs: its pages are backed with memory first
        // (`Backend::mapped_for_write`), which one refused after all must not take.
        let into = match (h.opcode, verdict, &block) {
            (Opcode::Write, Verdict::New, Some(b)) if runs => q.exec.write_mapped(b),
            _ => None,
        };
        // A WRITE given up while it was assembled holds a buffer this new generation supersedes:
        // back to the pool before the new request's need is weighed (`make_room` takes no
        // buffer of the asking host's, so a host's own abandoned WRITEs filling the share had
        // every new request on their slots dropped, again and again). Should the new one be
        // dropped all the same, the old is as one reclaimed (never run, its generation kept).
        if verdict == Verdict::New {
            let s = &mut q.slots[slot as usize];
            if s.state == SlotState::Assembling {
                if let Some(old) = s.buf.take() {
                    q.buffered -= old.len();
                    self.bufs.give_back(old);
                    s.state = SlotState::Reclaimed;
                }
            }
        }
        // What the request needs of the port's share; None: it is dropped, to be sent again
        // (`held_back`: a COPY over its host's limit).
        let mut held_back = false;
        let needs = match h.opcode {
            Opcode::Read | Opcode::Write
                if fresh
                    && runs
                    && into.is_none()
                    && length <= q.max_io
                    && !self.bufs.has_spare(len) =>
            {
                Some(len)
            }
            Opcode::Copy if verdict == Verdict::New && runs => {
                // A host's COPYs each hold a bounce buffer of the port's share that no other
                // host's request can reclaim (`make_room` takes half-sent WRITEs' only): at
                // most `HOST_COPIES` of them run on a port, over all its queues and sessions.
                // The next is dropped like a lost frame and retransmitted.
                let host = q.peer.host();
                let running: usize = self
                    .queues
                    .iter()
                    .flatten()
                    .filter(|o| o.peer.host() == host)
                    .map(|o| o.copying)
                    .sum();
                held_back = running >= HOST_COPIES;
                (!held_back).then_some(COPY_CHUNK as usize)
            }
            _ => Some(0),
        };
        if needs.is_none_or(|n| n > 0 && !self.make_room(qi, n)) {
            if held_back {
                self.stats.copies_held_back += 1;
            } else {
                self.stats.no_memory += 1;
            }
            // Not taken in: the initiator must send it again, and a probe must say so.
            self.queues[qi].as_mut().expect("present").taken_in -= 1;
            return;
        }
        let q = self.queues[qi].as_mut().expect("present");
        let s = &mut q.slots[slot as usize];
        match verdict {
            Verdict::Fragment => return self.fragment(qi, h, payload, sq, ud),
            Verdict::Reread => {
                // Reads may run again; send only what the initiator lacks.
                s.client_has.clear();
                if h.flags.has(Flags::HAVE) {
                    s.client_has.extend_from_slice(have_bitmap(
                        payload,
                        length.min(q.max_io),
                        q.fp,
                    ));
                }
                return self.execute(qi, slot, sq, ud);
            }
            Verdict::ResendReply => {
                // Never twice: resend the cached answer.
                q.exec.stats.dropped_duplicates += 1;
                let (hdr, status) = (s.hdr, s.status);
                let mut r = hdr.reply(status, 0);
                r.credit = credit;
                return self.send_queue(qi, r, &[]);
            }
            Verdict::Drop => {
                // A new generation while the previous one runs is dropped for the initiator to
                // send again: not taken in (a duplicate or a stale generation is).
                let held = s.hdr.tag.generation();
                let resend = matches!(s.state, SlotState::Running(_))
                    && newer_within(h.tag.generation(), held);
                // Only a duplicate or a stale one counts as dropped: the new generation is
                // not late, it came early and will come again.
                q.exec.stats.dropped_duplicates += (!resend) as u64;
                q.taken_in -= resend as u64;
                return;
            }
            Verdict::New => {}
        }
        // A new request on this slot; the same WRITE again if it was reclaimed (`make_room`).
        let reclaimed = (s.state == SlotState::Reclaimed).then_some(s.hdr.tag);
        // A WRITE given up while it was assembled left its buffer here. It goes back now, not
        // when the new request needs one: a request refused as it is taken, or a READ sent from
        // the export's memory, would otherwise leave it held in a slot no longer assembling,
        // where `make_room` cannot reclaim it (the pool keeps it as a spare for the next).
        if let Some(old) = s.buf.take() {
            q.buffered -= old.len();
            self.bufs.give_back(old);
        }
        s.hdr = *h;
        s.hdr.flags =
            Flags(h.flags.0 & !(Flags::HAVE | Flags::CRC | Flags::SEALED | Flags::HEAD_CRC));
        s.status = Status::Ok;
        s.client_has.clear();
        s.got = 0;
        s.frags = 1;
        // A write given up while it was assembled may have left where its bytes went.
        s.into = None;
        if h.opcode == Opcode::Write {
            let frags = fragment_count(h.length, q.fp);
            if h.length == 0 || h.length > q.max_io || h.frag_count as u32 != frags {
                s.state = SlotState::Done;
                s.status = Status::Invalid;
                return self.reply_queue(qi, h, Status::Invalid);
            }
            if block.is_none() {
                // Refused by admission (outside the export, read-only, misaligned): answered
                // now, before any of its data is held. A buffer for fragments that can never
                // land would be memory no budget check saw (`needs` is 0 for it): a slot each,
                // a peer could hold `max_io` per slot for one datagram per slot. Its other
                // fragments get this answer again, as a finished request's do (§9.2).
                return self.execute(qi, slot, sq, ud);
            }
            s.into = into;
            if into.is_none() {
                // Covered by the check above.
                let buf = self.bufs.take(h.length as usize, q.exec.buffer_alignment());
                q.buffered += buf.len();
                s.buf = Some(buf);
            }
            s.frags = frags;
            s.have.clear();
            s.have.resize(bitmap::bytes_for(frags), 0);
            // Begun again after its buffer was reclaimed: the initiator believes the target
            // holds the fragments it sent, so it is told at once what is held (§9.3).
            let again = reclaimed == Some(h.tag);
            s.state = SlotState::Assembling;
            self.fragment(qi, h, payload, sq, ud);
            let q = self.queues[qi].as_ref().expect("present");
            if again && q.slots[slot as usize].state == SlotState::Assembling {
                self.tell_held(qi, slot);
            }
            return;
        }
        if h.opcode == Opcode::Copy {
            return self.start_copy(qi, slot, payload, sq, ud);
        }
        if h.flags.has(Flags::HAVE) {
            s.client_has
                .extend_from_slice(have_bitmap(payload, h.length.min(q.max_io), q.fp));
        }
        self.execute(qi, slot, sq, ud);
    }

    /// Answers the WRITE being assembled on `slot` with the fragments held (flag `HAVE`,
    /// PROTOCOL.md §9.3): the initiator sends the rest.
    fn tell_held(&mut self, qi: usize, slot: u16) {
        let credit = self.queue_credit(qi);
        let s = &self.queues[qi].as_ref().expect("present").slots[slot as usize];
        let mut r = s.hdr.reply(Status::Ok, 0);
        r.flags.0 |= Flags::HAVE;
        r.credit = credit;
        let have = s.have.clone();
        self.send_queue(qi, r, &have);
    }

    /// Covers `needs` more bytes for a request of queue `asking`, making room when the port's
    /// share is full: spare buffers are freed first, then WRITEs being assembled in a buffer
    /// are reclaimed from the host (address, whatever its ports, sessions and queues) holding
    /// the most buffer bytes, as long as it holds more than the asker's host would once
    /// covered. A peer that sends the first fragments of WRITEs and never the rest (kept alive
    /// by KEEPALIVEs), over as many queues and sessions as it likes, would otherwise hold the
    /// port's whole share, and every other host's requests would be dropped; with this it keeps
    /// no more than any other host that asks. A reclaimed WRITE is begun again by its next
    /// fragment (§9.3). False when nothing can be reclaimed: the request is dropped for the
    /// initiator to send again.
    fn make_room(&mut self, asking: usize, needs: usize) -> bool {
        loop {
            if self.mem.try_cover(self.held() + needs) {
                return true;
            }
            if self.bufs.spare() > 0 {
                self.bufs.clear();
                continue;
            }
            let Some(asker) = self.queues[asking].as_ref().map(|q| q.peer.host()) else {
                return false;
            };
            let mut per_host: HashMap<Peer, usize> = HashMap::new();
            for q in self.queues.iter().flatten() {
                *per_host.entry(q.peer.host()).or_default() += q.buffered;
            }
            let mine = per_host.get(&asker).copied().unwrap_or(0);
            let mut hosts: Vec<(Peer, usize)> = per_host
                .into_iter()
                .filter(|&(h, held)| h != asker && held > mine + needs)
                .collect();
            hosts.sort_by_key(|&(_, held)| std::cmp::Reverse(held));
            // The first of those hosts with a WRITE being assembled in a buffer (another's
            // buffers may all serve requests that run), from its queue holding the most.
            let found = hosts.iter().find_map(|&(host, _)| {
                (0..self.queues.len())
                    .filter_map(|i| Some((i, self.queues[i].as_ref()?)))
                    .filter(|(_, q)| q.peer.host() == host)
                    .filter_map(|(i, q)| {
                        let slot = q
                            .slots
                            .iter()
                            .position(|s| s.state == SlotState::Assembling && s.buf.is_some())?;
                        Some((q.buffered, i, slot))
                    })
                    .max()
            });
            let Some((_, vi, slot)) = found else {
                return false;
            };
            let v = self.queues[vi].as_mut().expect("present");
            let s = &mut v.slots[slot];
            let buf = s.buf.take().expect("found with a buffer");
            s.state = SlotState::Reclaimed;
            v.buffered -= buf.len();
            self.bufs.free(buf);
            self.stats.writes_reclaimed += 1;
        }
    }

    /// Bytes the port holds: its fixed buffers, its pool, and the bounce buffers of its COPYs.
    fn held(&self) -> usize {
        self.fixed + self.bufs.allocated() + self.copying * COPY_CHUNK as usize
    }

    /// A new COPY (PROTOCOL.md §13): its descriptor is the payload of its one frame. Checked,
    /// then run in its slot; a duplicate is answered from the slot like any finished request,
    /// never copied twice.
    fn start_copy(
        &mut self,
        qi: usize,
        slot: u16,
        payload: &[u8],
        sq: &mut dyn Submitter,
        ud: UserData,
    ) {
        let q = self.queues[qi].as_mut().expect("present");
        let h = q.slots[slot as usize].hdr;
        let desc = match CopyDescriptor::decode_within(payload, &q.copy) {
            Ok(d) if h.frag_count == 1 => d,
            _ => {
                let refused = Copied {
                    status: Status::Invalid,
                    bytes: 0,
                };
                return self.finish_copy(qi, slot, refused);
            }
        };
        // Its memory was covered before the slot took it (`io_frame`).
        let tag = ud(q.incarnation, qi, slot);
        match q
            .exec
            .start_copy(&desc, None, h.offset, h.length, h.flags.io_flags(), tag, sq)
        {
            Some(done) => self.finish_copy(qi, slot, done),
            None => {
                q.slots[slot as usize].state = SlotState::Running(Started::now());
                q.copying += 1;
                self.copying += 1;
            }
        }
    }

    /// Answers a COPY; its reply (and any resent copy of it) says how many bytes it copied.
    fn finish_copy(&mut self, qi: usize, slot: u16, done: Copied) {
        let q = self.queues[qi].as_mut().expect("present");
        q.slots[slot as usize].hdr.length = done.bytes;
        self.finish(qi, slot, done.status);
    }

    /// The result `res` of the request running in `slot`, started with `tag`: its answer.
    fn answer(&mut self, qi: usize, slot: u16, tag: u64, res: i32, started: Started) {
        let q = self.queues[qi].as_mut().expect("present");
        let h = q.slots[slot as usize].hdr;
        match h.block_request() {
            Some(block) => {
                let st = q.exec.status(&block, tag, res, started);
                self.finish(qi, slot, st);
            }
            None if h.opcode == Opcode::Copy => {
                let done = q.exec.copy_status(tag, res, h.length);
                q.copying -= 1;
                self.copying -= 1;
                self.finish_copy(qi, slot, done);
            }
            None => self.finish(qi, slot, Status::Invalid),
        }
    }

    /// A WRITE fragment: store it; when all are in, execute.
    fn fragment(
        &mut self,
        qi: usize,
        h: &Header,
        payload: &[u8],
        sq: &mut dyn Submitter,
        ud: UserData,
    ) {
        let q = self.queues[qi].as_mut().expect("present");
        let fp = q.fp;
        let slot = h.tag.slot();
        let s = &mut q.slots[slot as usize];
        let i = h.frag_index as u32;
        let expect = (s.hdr.length - (i * fp).min(s.hdr.length)).min(fp);
        if h.frag_count as u32 != s.frags
            || h.frag_offset != i * fp
            || h.payload_len != expect
            || h.length != s.hdr.length
        {
            q.exec.stats.protocol_errors += 1;
            return;
        }
        if bitmap::get(&s.have, i) {
            // A repeat of something we hold: say what we hold, the initiator sends the rest.
            q.exec.stats.dropped_duplicates += 1;
            return self.tell_held(qi, slot);
        }
        // Received where it belongs already (`in_place`): nothing to copy. Its payload is not
        // its bytes, so one that turns out to be another fragment is dropped, never copied.
        let placed = match self.in_place.take() {
            None => false,
            Some(p) if p == (qi, slot, i) => true,
            Some(_) => {
                q.exec.stats.protocol_errors += 1;
                return;
            }
        };
        match s.into {
            Some(into) => {
                // Checked here, not only by the decoder that cut the payload: this copy has no
                // bounds of its own.
                if payload.len() != expect as usize {
                    q.exec.stats.protocol_errors += 1;
                    return;
                }
                if !placed {
                    // SAFETY: `frag_offset + expect <= length` (`expect` is what is left of
                    // the WRITE from `frag_offset`, at most `fp`), and `into` holds `length`
                    // bytes of the export's memory, which lives as long as the queue's
                    // executor.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            payload.as_ptr(),
                            into.add(h.frag_offset as usize),
                            payload.len(),
                        )
                    };
                }
                q.exec
                    .wrote_mapped(s.hdr.offset + h.frag_offset as u64, payload.len() as u64);
            }
            None if placed => {}
            None => {
                let buf = s.buf.as_mut().expect("assembling slot has a buffer");
                buf.as_mut_slice()[h.frag_offset as usize..h.frag_offset as usize + payload.len()]
                    .copy_from_slice(payload)
            }
        }
        // Counted once taken: a placed fragment of the wrong length was dropped above.
        self.stats.fragments_in_place += placed as u64;
        bitmap::set(&mut s.have, i);
        s.got += 1;
        // More of this WRITE, or the next of a stream of large ones, is likely next.
        self.expect_fragments = s.hdr.length >= in_place::IN_PLACE_MIN && q.seal.is_none();
        if s.got == s.frags {
            self.execute(qi, slot, sq, ud);
        }
    }

    /// Runs a complete request against the export.
    fn execute(&mut self, qi: usize, slot: u16, sq: &mut dyn Submitter, ud: UserData) {
        let q = self.queues[qi].as_mut().expect("present");
        let h = q.slots[slot as usize].hdr;
        let block = match h.block_request() {
            Some(b) if flush_args_valid(&h) => b,
            _ => return self.finish(qi, slot, Status::Invalid),
        };
        let into = q.slots[slot as usize].into.take();
        if let Err(st) = q.exec.admit(&block) {
            return self.finish(qi, slot, st);
        }
        if into.is_some() && block.op == BlockOp::Write {
            // Every fragment is where it belongs already.
            q.exec.mapped_write_done(&block, Started::now());
            return self.finish(qi, slot, Status::Ok);
        }
        // RAM whose pages were all written is sent from where it lies: the fragments point into the
        // export's mapping, which the queue keeps until the flush (`remove` flushes first).
        if block.op == BlockOp::Read && q.exec.completes_inline() {
            if let Some(data) = q.exec.read_mapped(&block) {
                return self.finish_read(qi, slot, Status::Ok, Some(data));
            }
        }
        let align = q.exec.buffer_alignment();
        let s = &mut q.slots[slot as usize];
        let buf = match block.op {
            BlockOp::Read => {
                if s.buf.as_ref().is_none_or(|b| b.len() < block.len as usize) {
                    if let Some(old) = s.buf.take() {
                        q.buffered -= old.len();
                        self.bufs.give_back(old);
                    }
                    // Covered by the check before the request was taken.
                    let buf = self.bufs.take(block.len as usize, align);
                    q.buffered += buf.len();
                    s.buf = Some(buf);
                }
                s.buf.as_mut().expect("set").as_mut_ptr()
            }
            BlockOp::Write => s.buf.as_mut().expect("assembled").as_mut_ptr(),
            _ => std::ptr::null_mut(),
        };
        // SAFETY: the slot's buffer holds the request's bytes and is neither freed nor touched
        // until the result is delivered: a Running slot takes no new request, and a queue with
        // Running slots is never removed.
        match unsafe { q.exec.start(&block, buf, ud(q.incarnation, qi, slot), sq) } {
            Outcome::Done(st) => self.finish(qi, slot, st),
            Outcome::Pending(started) => q.slots[slot as usize].state = SlotState::Running(started),
        }
    }

    /// The queue of a Running slot, with when its request started.
    fn running(&mut self, qi: usize, incarnation: u32, slot: u16) -> Option<(&mut DQ, Started)> {
        let q = self.queues.get_mut(qi).and_then(Option::as_mut)?;
        let s = q.slots.get(slot as usize)?;
        let SlotState::Running(started) = s.state else {
            return None;
        };
        if q.incarnation != incarnation {
            return None;
        }
        Some((q, started))
    }

    /// io_uring completion for a queue's backend I/O (`tag` is its user data).
    pub fn complete(
        &mut self,
        qi: usize,
        incarnation: u32,
        slot: u16,
        tag: u64,
        res: i32,
        sq: &mut dyn Submitter,
    ) {
        let Some((q, started)) = self.running(qi, incarnation, slot) else {
            return;
        };
        if let Some(r) = q.exec.complete(tag, res, sq) {
            self.answer(qi, slot, tag, r, started);
        }
        self.remove_if_closed(qi);
    }

    /// A closed queue goes (and leaves the registry, where a HELLO replacing it may wait,
    /// PROTOCOL.md §2.6) as soon as its last backend I/O completed, not at the next sweep.
    fn remove_if_closed(&mut self, qi: usize) {
        if self.queues[qi].as_ref().is_some_and(|q| q.closing) {
            self.remove(qi);
        }
    }

    /// A queue's backend completed operations on its own threads: collect and answer them.
    pub fn reap(&mut self, qi: usize, incarnation: u32, sq: &mut dyn Submitter) {
        let Some(q) = self.queues.get_mut(qi).and_then(Option::as_mut) else {
            return;
        };
        if q.incarnation != incarnation {
            return;
        }
        let mut done = Vec::new();
        q.exec.reap(sq, &mut |tag, res| done.push((tag, res)));
        for (tag, res) in done {
            // The user data of a queue's I/O ends with its slot.
            let slot = tag as u16;
            if let Some((_, started)) = self.running(qi, incarnation, slot) {
                self.answer(qi, slot, tag, res, started);
            }
        }
        self.remove_if_closed(qi);
    }

    /// The completion notifier of a live queue, to watch again.
    pub fn notifier(&self, qi: usize, incarnation: u32) -> Option<RawFd> {
        let q = self.queues.get(qi).and_then(Option::as_ref)?;
        (q.incarnation == incarnation)
            .then(|| q.exec.notifier())
            .flatten()
    }

    /// Notifiers the reactor should start (`Some`) or stop (`None`) watching since last asked.
    pub fn take_notifier_changes(&mut self) -> std::vec::Drain<'_, (usize, u32, Option<RawFd>)> {
        self.notifier_changes.drain(..)
    }

    /// A request finished: remember its status and answer (READ: the data, in fragments).
    fn finish(&mut self, qi: usize, slot: u16, status: Status) {
        self.finish_read(qi, slot, status, None)
    }

    /// As `finish`, a successful READ's data taken from `mapped` (`Executor::read_mapped`)
    /// when given, else from the slot's buffer.
    fn finish_read(&mut self, qi: usize, slot: u16, status: Status, mapped: Option<*const u8>) {
        let credit = self.queue_credit(qi);
        let q = self.queues[qi].as_mut().expect("present");
        let fp = q.fp;
        let s = &mut q.slots[slot as usize];
        s.state = SlotState::Done;
        s.status = status;
        let h = s.hdr;
        if status != Status::Ok {
            q.exec.stats.errors += 1;
        }
        if h.opcode != Opcode::Read || status != Status::Ok {
            q.exec.stats.frames_out += 1;
            // A finished write keeps only its status (for duplicates), not its data.
            if let Some(buf) = s.buf.take() {
                q.buffered -= buf.len();
                self.bufs.give_back(buf);
            }
            let mut r = h.reply(status, 0);
            r.credit = credit;
            return self.send_queue(qi, r, &[]);
        }
        let frags = fragment_count(h.length, fp);
        // A large READ's fragments point at the data where it lies, kept until the next flush:
        // the export's mapping lives as long as the queue, which `remove` does not drop before
        // a flush, and the slot's buffer waits in `lent`. Smaller ones, and a sealed session's
        // (sealing copies them), are copied into the batch and their buffer goes back to the
        // pool at once (a retransmitted READ runs again: the data need not stay).
        let lend = h.length >= LEND_READ_MIN && q.seal.is_none();
        let header_crc = q.header_crc;
        let buf = mapped.is_none().then(|| s.buf.take().expect("read buffer"));
        q.buffered -= buf.as_ref().map_or(0, AlignedBuf::len);
        let data = mapped.unwrap_or_else(|| buf.as_ref().expect("taken").as_slice().as_ptr());
        let has = std::mem::take(&mut s.client_has);
        // A reply is counted when something of it goes: a repeated READ whose HAVE holds every
        // fragment is answered with nothing.
        let all_held = (0..frags).all(|i| bitmap::get(&has, i));
        q.exec.stats.frames_out += (!all_held) as u64;
        for i in 0..frags {
            if bitmap::get(&has, i) {
                continue;
            }
            let start = i * fp;
            let end = (start + fp).min(h.length);
            let mut r = h.reply(Status::Ok, 0);
            r.credit = credit;
            r.frag_index = i as u16;
            r.frag_count = frags as u16;
            r.frag_offset = start;
            if header_crc {
                r.flags.0 |= Flags::HEAD_CRC;
            }
            let (at, len) = (start as usize, (end - start) as usize);
            if lend {
                // SAFETY: `h.length` bytes at `data` stay readable until the next flush (above).
                unsafe { self.send_queue_lent(qi, r, data.add(at), len) };
            } else {
                // SAFETY: `h.length` bytes at `data`, in `buf` (held by this call) or in the
                // export's mapping (kept by the queue); copied right away.
                self.send_queue(qi, r, unsafe {
                    std::slice::from_raw_parts(data.add(at), len)
                });
            }
        }
        if let Some(buf) = buf {
            if lend {
                self.lent.push(buf);
            } else {
                self.bufs.give_back(buf);
            }
        }
        let q = self.queues[qi].as_mut().expect("present");
        let s = &mut q.slots[slot as usize];
        s.client_has = has;
    }

    /// Live queues' counters, for STATS.
    pub fn reports(&self, thread: usize) -> Vec<crate::reactor::QueueReport> {
        self.queues
            .iter()
            .flatten()
            .map(|q| crate::reactor::QueueReport {
                session: q.session,
                export: q.exec.export().name.clone(),
                export_id: crate::reactor::export_id(q.exec.export()),
                queue: q.queue,
                thread,
                in_flight: q.slots.iter().filter(|s| s.is_running()).count() as u32,
                stats: q.exec.stats,
            })
            .collect()
    }

    /// The listener this port serves.
    pub fn listener(&self) -> u32 {
        self.listener
    }

    /// Its listener was removed: stop receiving and close every queue (those with backend I/O
    /// running go when it completes, see `sweep`).
    pub fn retire(&mut self) {
        self.retiring = true;
        self.close_queues(|_, _| true);
    }

    pub fn retiring(&self) -> bool {
        self.retiring
    }

    /// Retiring, nothing left running and no notifier change left for the reactor: the port
    /// (its socket, its claim on the address) can be dropped.
    pub fn retired(&self) -> bool {
        self.retiring && self.queues.iter().all(Option::is_none) && self.notifier_changes.is_empty()
    }

    /// Closes the queues `hit` names by session and queue index: frames for them are from now
    /// on answered as for an unknown session, so the initiator's I/O fails.
    pub fn close_queues(&mut self, hit: impl Fn(u32, u16) -> bool) {
        for qi in 0..self.queues.len() {
            let Some(q) = self.queues[qi].as_mut() else {
                continue;
            };
            if hit(q.session, q.queue) {
                self.close_queue(qi);
            }
        }
    }

    /// Counters of the queues that closed on this port, per export.
    pub fn closed(&self) -> &ClosedTotals {
        &self.closed
    }

    /// Folds the closed totals of export `name` (removed).
    pub fn forget_closed(&mut self, name: &str) {
        self.closed.forget(name);
    }

    /// Closes every queue (shutdown).
    pub fn close_all(&mut self) {
        for qi in 0..self.queues.len() {
            self.remove(qi);
        }
    }

    pub fn report(&self, thread: usize) -> PortReport {
        let transport = match self.kind {
            PortKind::Udp => "udp",
            PortKind::Eth { .. } => "eth",
        };
        PortReport {
            thread,
            transport,
            stats: self.stats,
        }
    }

    pub fn has_running(&self) -> bool {
        self.queues
            .iter()
            .flatten()
            .any(|q| q.slots.iter().any(|s| s.is_running()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::DatagramPort;
    use blkwire_wire::{AuthBlock, AuthMethod, Hello, HelloReply};
    use std::net::UdpSocket;

    /// The port's HELLO answers stay within their bounds whatever is asked: answers that fill a
    /// datagram (a LIST) push the oldest out by bytes, small ones by count.
    #[test]
    fn hello_answers_stay_within_their_bytes_and_count() {
        let mut c = HelloAnswers::default();
        let t0 = Instant::now();
        let peer = |i: u32| Peer::Ip(std::net::SocketAddr::from(([10, 0, 0, 1], i as u16)));
        let big = vec![7u8; 32 << 10];
        for i in 0..1000u32 {
            c.insert(
                peer(i),
                [i as u8; blkwire_wire::AUTH_LEN],
                t0 + Duration::from_millis(i as u64),
                &big,
            );
            assert!(c.bytes <= MAX_CACHED_HELLO_BYTES, "{} bytes", c.bytes);
        }
        assert_eq!(c.map.len(), MAX_CACHED_HELLO_BYTES / big.len());
        assert!(
            c.get_mut(peer(999), [999u32 as u8; blkwire_wire::AUTH_LEN])
                .is_some(),
            "the newest stays"
        );
        assert!(
            c.get_mut(peer(0), [0; blkwire_wire::AUTH_LEN]).is_none(),
            "the oldest went"
        );
        for i in 0..(MAX_CACHED_HELLOS as u32 + 10) {
            let at = t0 + Duration::from_secs(1) + Duration::from_micros(i as u64);
            c.insert(
                peer(i),
                [(i >> 8) as u8; blkwire_wire::AUTH_LEN],
                at,
                &[1; 100],
            );
        }
        assert_eq!(c.map.len(), MAX_CACHED_HELLOS);
        assert_eq!(c.bytes, MAX_CACHED_HELLOS * 100);
        assert_eq!(
            c.order.len(),
            MAX_CACHED_HELLOS,
            "the order holds no key twice"
        );
        c.expire(t0 + Duration::from_secs(1) + IDLE_EXPIRY + Duration::from_secs(1));
        assert_eq!((c.map.len(), c.bytes, c.order.len()), (0, 0, 0));
    }

    /// A queue reserves its slot table: a deeper queue reserves more, and a table of 1024
    /// slots more than the 64 KiB every queue reserved before, whatever its depth.
    #[test]
    fn a_queue_reserves_its_slot_table() {
        let slot = std::mem::size_of::<TSlot>();
        assert!(queue_floor(1) >= QUEUE_BOOKKEEPING + slot);
        assert!(queue_floor(1024) >= QUEUE_BOOKKEEPING + 1024 * slot);
        assert!(
            queue_floor(1024) > 3 * QUEUE_BOOKKEEPING,
            "{}",
            queue_floor(1024)
        );
    }

    const LINK: u32 = 8192;

    /// A frame with its CRC, as an initiator sends it.
    fn frame(mut h: Header, payload: &[u8]) -> Vec<u8> {
        h.payload_len = payload.len() as u32;
        h.seal_crc(payload);
        let mut v = h.to_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    /// Every frame the port sent `peer` (waiting for the first when `wait`), with its payload.
    fn answers(peer: &UdpSocket, wait: bool) -> Vec<(Header, Vec<u8>)> {
        let mut buf = vec![0u8; 65536];
        let mut out = Vec::new();
        peer.set_nonblocking(!wait).unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        while let Ok(n) = peer.recv(&mut buf) {
            peer.set_nonblocking(true).unwrap();
            for f in datagram::frames(&buf[..n], LINK) {
                let f = f.expect("a valid frame");
                out.push((f.header, f.payload.to_vec()));
            }
        }
        out
    }

    /// A frame that fails validation ends the walk of its datagram (§9.6): a reply among
    /// requests, or a header-only CRC the session was not granted, and what follows it, is
    /// dropped and counted bad.
    #[test]
    fn a_frame_failing_validation_ends_the_walk() {
        let (mut dp, peer, session) = session_on("a=mem:1M");
        let mut reply = request(session, Opcode::Read, 1, 1, 0, 512);
        reply.flags.0 |= Flags::REPLY;
        let mut head_crc = request(session, Opcode::Read, 1, 1, 0, 512);
        head_crc.flags.0 |= Flags::HEAD_CRC;
        for bad_frame in [reply, head_crc] {
            let mut packed = frame(bad_frame, &[]);
            packed.extend(frame(request(session, Opcode::Read, 2, 1, 0, 512), &[]));
            let bad = dp.port.stats.bad_frames;
            dp.receive(&packed, peer.local_addr().unwrap());
            assert_eq!(dp.port.stats.bad_frames, bad + 1);
            assert!(
                answers(&peer, false).is_empty(),
                "the READ after it did not run"
            );
        }
    }

    /// Replies to KEEPALIVE (and JOIN and LOGOUT) travel alone (PROTOCOL.md §9.6), even when
    /// the requests came packed with READs whose replies are packed together.
    #[test]
    fn keepalive_replies_travel_alone() {
        let (mut dp, peer, session) = session_on("a=mem:1M");
        let mut packed = Vec::new();
        for (op, slot) in [(Opcode::Read, 1), (Opcode::Read, 2), (Opcode::Keepalive, 0)] {
            let len = if op == Opcode::Read { 512 } else { 0 };
            packed.extend(frame(request(session, op, slot, 1, 0, len), &[]));
        }
        dp.receive(&packed, peer.local_addr().unwrap());
        let mut buf = vec![0u8; 65536];
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut datagrams = Vec::new();
        while datagrams.iter().map(Vec::len).sum::<usize>() < 3 {
            let n = peer.recv(&mut buf).unwrap();
            let ops: Vec<Opcode> = datagram::frames(&buf[..n], LINK)
                .map(|f| f.expect("a valid frame").header.opcode)
                .collect();
            datagrams.push(ops);
        }
        let keepalive = datagrams
            .iter()
            .find(|d| d.contains(&Opcode::Keepalive))
            .expect("the KEEPALIVE answered");
        assert_eq!(keepalive, &[Opcode::Keepalive], "alone: {datagrams:?}");
        assert!(
            datagrams.iter().any(|d| d.len() == 2),
            "the READ replies still packed: {datagrams:?}"
        );
    }

    /// A link-local IPv6 peer is its address on its link: the scope (interface index) the
    /// kernel reports is kept, so replies leave by that link and two peers with the same
    /// fe80:: address on different links stay two.
    #[test]
    fn an_ipv6_peer_keeps_its_scope() {
        let (dp, _peer, _) = session();
        let name = |scope: u32| {
            // SAFETY: all-zero is a valid sockaddr_storage and sockaddr_in6.
            let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and as aligned.
            let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            a.sin6_family = libc::AF_INET6 as u16;
            a.sin6_port = 4000u16.to_be();
            a.sin6_addr.s6_addr = "fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets();
            a.sin6_scope_id = scope;
            ss
        };
        let (on2, on3) = (dp.port.peer_of(&name(2)), dp.port.peer_of(&name(3)));
        assert_eq!(on2, Some(Peer::Ip("[fe80::1%2]:4000".parse().unwrap())));
        assert_ne!(on2, on3, "the same address on two links is two peers");
        // And two hosts, whose buffers `make_room` counts apart; one host's ports are one.
        let (on2, on3) = (on2.unwrap(), on3.unwrap());
        assert_ne!(on2.host(), on3.host());
        let other_port = Peer::Ip("[fe80::1%2]:4001".parse().unwrap());
        assert_eq!(on2.host(), other_port.host());
    }

    /// A frame from a group (broadcast, multicast) or all-zero source MAC is dropped unread and
    /// counted: no answer to it would reach one station, and one to broadcast floods the
    /// segment. Both receive paths (packet ring, recvmmsg) drop through `sent_by_station`.
    #[test]
    fn a_group_or_zero_source_mac_is_no_peer() {
        let (mut dp, _peer, _) = session();
        // A raw Ethernet port bound to interface 7 (only its addresses are read here).
        dp.port.kind = PortKind::Eth {
            ifindex: 7,
            ethertype: 0x88b5,
        };
        let on = |mac: [u8; 6], ifindex: i32| {
            // SAFETY: all-zero is a valid sockaddr_storage and sockaddr_ll.
            let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            // SAFETY: sockaddr_storage is larger than sockaddr_ll and as aligned.
            let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_ll) };
            a.sll_family = libc::AF_PACKET as u16;
            a.sll_halen = 6;
            a.sll_ifindex = ifindex;
            a.sll_addr[..6].copy_from_slice(&mac);
            ss
        };
        let name = |mac: [u8; 6]| on(mac, 7);
        let station = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee];
        assert_eq!(
            dp.port.peer_of(&on(station, 8)),
            None,
            "another interface's (a VLAN's) frame"
        );
        let peer = dp.port.peer_of(&name(station)).unwrap();
        assert_eq!(peer, Peer::Mac(station));
        assert!(dp.port.sent_by_station(peer));
        let forged = [
            [0xff; 6],
            [0x01, 0x00, 0x5e, 0x00, 0x00, 0x01],
            [0x33, 0x33, 0x00, 0x00, 0x00, 0x01],
            [0; 6],
        ];
        for m in forged {
            let peer = dp.port.peer_of(&name(m)).unwrap();
            assert!(!dp.port.sent_by_station(peer), "{m:02x?}");
        }
        assert_eq!(
            dp.port.stats.bad_frames,
            forged.len() as u64,
            "each counted"
        );
        assert!(dp
            .port
            .sent_by_station(Peer::Ip("127.0.0.1:9".parse().unwrap())));
    }

    /// A port serving export `a` (`a=mem:1M` unless given), and a session of one 8-slot queue
    /// on it from a new peer.
    fn session() -> (DatagramPort, UdpSocket, u32) {
        session_on("a=mem:1M")
    }

    fn session_on(export: &str) -> (DatagramPort, UdpSocket, u32) {
        let (port, peer, reply) = session_of(export, 1, 0);
        (port, peer, reply.session)
    }

    /// As `session_on`, with `queues` queues and `client_features` asked for: the whole HELLO
    /// reply.
    fn session_of(
        export: &str,
        queues: u16,
        client_features: u64,
    ) -> (DatagramPort, UdpSocket, HelloReply) {
        let mut port = DatagramPort::new(&[export], LINK).unwrap();
        let (peer, reply) = open_session(&mut port, "127.0.0.1", queues, client_features);
        (port, peer, reply)
    }

    /// A session on export `a` of `port` from a new peer at `ip`: its socket and the HELLO
    /// reply.
    fn open_session(
        port: &mut DatagramPort,
        ip: &str,
        queues: u16,
        client_features: u64,
    ) -> (UdpSocket, HelloReply) {
        hello_rounds(port, ip, queues, client_features)
            .unwrap_or_else(|st| panic!("HELLO refused: {st:?}"))
    }

    /// `open_session`, or the status its HELLO was refused with.
    fn hello_rounds(
        port: &mut DatagramPort,
        ip: &str,
        queues: u16,
        client_features: u64,
    ) -> Result<(UdpSocket, HelloReply), Status> {
        let peer = UdpSocket::bind((ip, 0)).unwrap();
        let mut hello = Hello {
            queues,
            depth: 8,
            max_io: 64 << 10,
            client_features,
            frame_payload: LINK,
            nonce: 1,
            host_id: "test".into(),
            export: "a".into(),
            auth: AuthBlock::first(AuthMethod::None, false, true, [7; 32]),
            replaces: None,
        };
        for round in 1..=3 {
            let h = Header::request(Opcode::Hello, Tag::new(0, round), 0, 0);
            port.receive(
                &frame(h, &hello.encode().unwrap()),
                peer.local_addr().unwrap(),
            );
            for (r, p) in answers(&peer, true) {
                match r.status {
                    Status::Challenge => hello.auth.nonce_s = p.as_slice().try_into().unwrap(),
                    Status::Ok => return Ok((peer, HelloReply::decode(&p).unwrap())),
                    other => return Err(other),
                }
            }
        }
        panic!("no session");
    }

    /// A HELLO whose queue cannot be opened (here the backend refuses, as a process out of
    /// descriptors does) is refused IO, with no session left behind; it used to be welcomed
    /// into a queue that did not exist, whose first request met ACCESS.
    #[test]
    fn a_hello_whose_queue_cannot_be_opened_is_refused() {
        let recorder = blkwire_backend::testing::Recorder::new(Default::default(), false);
        recorder
            .fail_open
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let registry = Arc::new(crate::session::Registry::new(
            crate::access::Access::new(Default::default()),
            crate::session::Limits::default(),
        ));
        registry.add_built_export(blkwire_backend::Export::new("a", recorder.clone(), false));
        let mut port = DatagramPort::serving(registry.clone(), LINK).unwrap();
        assert_eq!(
            hello_rounds(&mut port, "127.0.0.1", 1, 0).err(),
            Some(Status::Io)
        );
        assert!(port.port.index.is_empty(), "no queue");
        assert!(registry.sessions().is_empty(), "no session left behind");
        // Once queues open again, the same host is welcomed.
        recorder
            .fail_open
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let (_peer, reply) = open_session(&mut port, "127.0.0.1", 1, 0);
        assert_ne!(reply.session, 0);
        assert_eq!(port.port.index.len(), 1);
    }

    fn request(session: u32, op: Opcode, slot: u16, gen: u16, offset: u64, len: u32) -> Header {
        let mut h = Header::request(op, Tag::new(slot, gen), offset, len);
        h.session = session;
        h
    }

    /// A queue that goes (LOGOUT, or idle expiry) while WRITEs were half assembled gives
    /// their buffers back: the port's charge returns to its fixed buffers, not for ever a
    /// little higher per dropped queue.
    #[test]
    fn a_queue_that_goes_mid_write_gives_its_buffers_back() {
        // Not RAM: a WRITE to RAM takes no buffer (the next test).
        let (mut dp, peer, session) = session_on("a=null:1M");
        let from = peer.local_addr().unwrap();
        let fixed = dp.port.held();
        for slot in 0..8 {
            let mut h = request(session, Opcode::Write, slot, 1, 0, 2 * LINK);
            h.frag_count = 2;
            dp.receive(&frame(h, &vec![1u8; LINK as usize]), from);
        }
        assert!(
            dp.port.held() >= fixed + 16 * LINK as usize,
            "eight buffers taken"
        );
        answers(&peer, false);
        dp.receive(
            &frame(request(session, Opcode::Logout, 0, 2, 0, 0), &[]),
            from,
        );
        assert!(dp.port.index.is_empty(), "the queue is gone");
        // Spares are kept while the port is busy; an idle port frees them.
        dp.port.active = 0;
        dp.port.last_sweep = Instant::now() - Duration::from_secs(2);
        dp.port.sweep();
        assert_eq!(dp.port.held(), fixed);
    }

    /// A host's own WRITEs given up half-sent fill the port's share: a new request on one of
    /// their slots (a newer generation) runs, the abandoned WRITE's buffer given back first,
    /// where it was dropped for want of memory again and again (`make_room` takes nothing of
    /// the asking host's).
    #[test]
    fn a_new_request_supersedes_its_slots_abandoned_write() {
        const WRITE: u32 = 2 * LINK;
        let (mut dp, peer, a) = session_on("a=null:1M");
        let from = peer.local_addr().unwrap();
        let fixed = dp.port.held();
        let budget = crate::budget::Budget::new(usize::MAX);
        dp.port.mem = Account::forced(&budget, fixed, fixed + 4 * WRITE as usize);
        for slot in 0..4 {
            let mut h = request(a, Opcode::Write, slot, 1, 0, WRITE);
            h.frag_count = 2;
            dp.receive(&frame(h, &[1; LINK as usize]), from);
        }
        assert_eq!(
            dp.port.held(),
            fixed + 4 * WRITE as usize,
            "the share is full"
        );
        // Slot 0 again, generation 2: a WRITE of two fragments, both sent.
        let mut h = request(a, Opcode::Write, 0, 2, 0, WRITE);
        h.frag_count = 2;
        dp.receive(&frame(h, &[2; LINK as usize]), from);
        (h.frag_index, h.frag_offset) = (1, LINK);
        dp.receive(&frame(h, &[3; LINK as usize]), from);
        let got = answers(&peer, true);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.status, Status::Ok);
        assert_eq!(got[0].0.tag, h.tag);
        assert_eq!(dp.port.stats.no_memory, 0);
    }

    /// A host that sends the first fragment of WRITEs and never the rest, over two sessions,
    /// holds their buffers only while no other host needs room: another host's request finding
    /// the port's share full reclaims one, until both hosts hold as much. The reclaimed WRITE,
    /// sent again, is begun again and told at once what is held; a newer generation on its
    /// slot is a new WRITE (no HAVE); an older one is stale.
    #[test]
    fn half_sent_writes_give_their_buffers_to_other_hosts() {
        const WRITE: u32 = 2 * LINK;
        // Not RAM: a WRITE to RAM takes no buffer.
        let (mut dp, hoarder, a) = session_on("a=null:1M");
        let (second, c) = open_session(&mut dp, "127.0.0.1", 1, 0);
        // Another host: 127.0.0.2 is loopback too.
        let (other, b) = open_session(&mut dp, "127.0.0.2", 1, 0);
        let (b, c) = (b.session, c.session);
        let from_a = hoarder.local_addr().unwrap();
        let from_b = other.local_addr().unwrap();
        let from_c = second.local_addr().unwrap();
        // A share of eight WRITEs' buffers beside the port's fixed ones.
        let fixed = dp.port.held();
        let budget = crate::budget::Budget::new(usize::MAX);
        dp.port.mem = Account::forced(&budget, fixed, fixed + 8 * WRITE as usize);
        let first = |session, slot, gen| {
            let mut h = request(session, Opcode::Write, slot, gen, 0, WRITE);
            h.frag_count = 2;
            frame(h, &[slot as u8 + 1; LINK as usize])
        };
        let second = |session, slot, gen| {
            let mut h = request(session, Opcode::Write, slot, gen, 0, WRITE);
            (h.frag_count, h.frag_index, h.frag_offset) = (2, 1, LINK);
            frame(h, &[0xee; LINK as usize])
        };
        let ok = |peer: &UdpSocket| {
            let got = answers(peer, true);
            assert_eq!(got.len(), 1, "{got:?}");
            assert_eq!(
                (got[0].0.status, got[0].0.flags.has(Flags::HAVE)),
                (Status::Ok, false)
            );
        };
        let state =
            |dp: &DatagramPort, slot: usize| dp.port.queues[0].as_ref().unwrap().slots[slot].state;
        for slot in 0..5 {
            dp.receive(&first(a, slot, 2), from_a);
        }
        for slot in 0..3 {
            dp.receive(&first(c, slot, 2), from_c);
        }
        assert_eq!(
            dp.port.held(),
            fixed + 8 * WRITE as usize,
            "the share is full"
        );

        // The other host's WRITEs find room (the first runs): the hoarder's queue holding the
        // most gives up its WRITEs being assembled.
        dp.receive(&first(b, 0, 1), from_b);
        dp.receive(&second(b, 0, 1), from_b);
        ok(&other);
        dp.receive(&first(b, 1, 1), from_b);
        dp.receive(&first(b, 2, 1), from_b);
        assert_eq!(dp.port.stats.writes_reclaimed, 2);
        assert_eq!(dp.port.stats.no_memory, 0);
        assert_eq!(
            (state(&dp, 0), state(&dp, 1)),
            (SlotState::Reclaimed, SlotState::Reclaimed)
        );
        dp.receive(&second(b, 1, 1), from_b);
        ok(&other);
        dp.receive(&second(b, 2, 1), from_b);
        ok(&other);

        // An older generation on a reclaimed slot is stale; the WRITE itself, sent again, is
        // begun again and told what is held; a newer generation is a new WRITE.
        assert!(answers(&hoarder, false).is_empty());
        dp.receive(&first(a, 0, 1), from_a);
        assert!(
            answers(&hoarder, false).is_empty(),
            "a stale generation is dropped"
        );
        dp.receive(&first(a, 0, 2), from_a);
        let got = answers(&hoarder, true);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].0.flags.has(Flags::HAVE), "told what is held");
        assert_eq!(got[0].1, [1u8], "fragment 0 only");
        dp.receive(&second(a, 0, 2), from_a);
        ok(&hoarder);
        dp.receive(&first(a, 1, 3), from_a);
        assert!(
            answers(&hoarder, false).is_empty(),
            "no HAVE for a new WRITE"
        );
        dp.receive(&second(a, 1, 3), from_a);
        ok(&hoarder);

        // Both hoarder's sessions hold 6 of the 8 now: the other host takes from them until the
        // two hosts hold as much; asking for more then, nothing is taken and its request is
        // dropped for its initiator to resend.
        dp.receive(&first(a, 0, 3), from_a);
        dp.receive(&first(a, 1, 4), from_a);
        let before = (dp.port.stats.writes_reclaimed, dp.port.stats.no_memory);
        for slot in 3..7 {
            dp.receive(&first(b, slot, 1), from_b);
        }
        let held = |dp: &DatagramPort, qi: usize| dp.port.queues[qi].as_ref().unwrap().buffered;
        assert_eq!(
            held(&dp, 0) + held(&dp, 1),
            4 * WRITE as usize,
            "the hoarder's host"
        );
        assert_eq!(held(&dp, 2), 4 * WRITE as usize, "the other host");
        dp.receive(&first(b, 7, 1), from_b);
        assert_eq!(
            (
                dp.port.stats.writes_reclaimed - before.0,
                dp.port.stats.no_memory - before.1
            ),
            (4, 1)
        );
    }

    /// Only a request that will run makes room: one refused as it is taken (a READ past the
    /// export's end, a WRITE whose fragment count does not match its length) reclaims no other
    /// host's WRITE being assembled; a valid READ does. Such requests used to reset another
    /// host's large WRITEs over and over without ever needing the memory.
    #[test]
    fn requests_refused_as_they_are_taken_reclaim_nothing() {
        const WRITE: u32 = 2 * LINK;
        let (mut dp, hoarder, a) = session_on("a=null:1M");
        let (other, b) = open_session(&mut dp, "127.0.0.2", 1, 0);
        let (from_a, from_b) = (hoarder.local_addr().unwrap(), other.local_addr().unwrap());
        let fixed = dp.port.held();
        let budget = crate::budget::Budget::new(usize::MAX);
        dp.port.mem = Account::forced(&budget, fixed, fixed + 2 * WRITE as usize);
        for slot in 0..2 {
            let mut h = request(a, Opcode::Write, slot, 1, 0, WRITE);
            h.frag_count = 2;
            dp.receive(&frame(h, &[1u8; LINK as usize]), from_a);
        }
        let past_the_end = request(b.session, Opcode::Read, 0, 1, 1 << 20, WRITE);
        dp.receive(&frame(past_the_end, &[]), from_b);
        let mut miscounted = request(b.session, Opcode::Write, 1, 1, 0, WRITE);
        miscounted.frag_count = 3;
        dp.receive(&frame(miscounted, &[2u8; LINK as usize]), from_b);
        let refused = answers(&other, true);
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(refused.iter().all(|(r, _)| r.status != Status::Ok));
        assert_eq!(
            dp.port.stats.writes_reclaimed, 0,
            "refused: nothing reclaimed"
        );
        // The refused READ again (a retransmission: same generation) is refused again.
        dp.receive(&frame(past_the_end, &[]), from_b);
        let again = answers(&other, true);
        assert!(
            again.len() == 1 && again[0].0.status != Status::Ok,
            "{again:?}"
        );
        assert_eq!(
            dp.port.stats.writes_reclaimed, 0,
            "a repeat reclaims nothing"
        );
        let read = request(b.session, Opcode::Read, 2, 1, 0, WRITE);
        dp.receive(&frame(read, &[]), from_b);
        assert_eq!(
            dp.port.stats.writes_reclaimed, 1,
            "a READ that runs makes room"
        );
    }

    /// A WRITE given up half-way (its first fragment held in a buffer) gives that buffer back
    /// when the next request takes its slot, whatever that request is. A request refused as it
    /// is taken (a WRITE of no bytes), or a READ of RAM sent from the export's memory, used to
    /// leave it held in a slot no longer assembling, where `make_room` cannot reclaim it: a
    /// peer could pin the port's whole share that way.
    #[test]
    fn a_slot_taken_by_a_new_request_gives_back_a_given_up_writes_buffer() {
        for (export, next) in [("a=null:1M", Opcode::Write), ("a=mem:1M", Opcode::Read)] {
            let (mut dp, peer, session) = session_on(export);
            let from = peer.local_addr().unwrap();
            // RAM's pages are read from where they lie only once written.
            let mut whole = request(session, Opcode::Write, 0, 1, 0, LINK);
            whole.frag_count = 1;
            dp.receive(&frame(whole, &[5u8; LINK as usize]), from);
            answers(&peer, true);
            // FUA: a WRITE to RAM is assembled in a buffer, not in place.
            let mut half = request(session, Opcode::Write, 3, 1, 0, 2 * LINK);
            half.frag_count = 2;
            half.flags.0 |= Flags::FUA;
            dp.receive(&frame(half, &[1u8; LINK as usize]), from);
            let buffered = |dp: &DatagramPort| dp.port.queues[0].as_ref().unwrap().buffered;
            assert!(
                buffered(&dp) >= 2 * LINK as usize,
                "{export}: a buffer taken"
            );
            let len = if next == Opcode::Write { 0 } else { LINK };
            dp.receive(&frame(request(session, next, 3, 2, 0, len), &[]), from);
            let got = answers(&peer, true);
            assert_eq!(got.len(), 1, "{export}: {got:?}");
            assert_eq!(
                buffered(&dp),
                0,
                "{export}: the given-up WRITE's buffer went back"
            );
        }
    }

    /// The data of one READ of `len` bytes at `offset` on `slot`, reassembled from its reply.
    fn read_back(
        dp: &mut DatagramPort,
        peer: &UdpSocket,
        session: u32,
        slot: u16,
        gen: u16,
        (offset, len): (u64, u32),
    ) -> Vec<u8> {
        answers(peer, false);
        let h = request(session, Opcode::Read, slot, gen, offset, len);
        dp.receive(&frame(h, &[]), peer.local_addr().unwrap());
        let mut data = vec![0u8; len as usize];
        let mut got = 0;
        while got < len as usize {
            let replies = answers(peer, true);
            assert!(!replies.is_empty(), "the READ was answered");
            for (r, p) in replies {
                assert_eq!(
                    (r.status, r.tag.slot()),
                    (Status::Ok, slot),
                    "READ answered"
                );
                data[r.frag_offset as usize..][..p.len()].copy_from_slice(&p);
                got += p.len();
            }
        }
        data
    }

    /// A WRITE to RAM is assembled where it belongs, fragment by fragment, with no buffer
    /// taken; one with FUA is assembled in a buffer first (so is any WRITE to an export that
    /// cannot show its memory: `a_queue_that_goes_mid_write_gives_its_buffers_back`). Either
    /// way the bytes read back are the ones written, and a slot whose WRITE was given up
    /// half-way serves its next request as that request.
    #[test]
    fn writes_to_ram_are_assembled_in_place() {
        for (export, fua, in_place) in [("a=mem:1M", false, true), ("a=mem:1M", true, false)] {
            let (mut dp, peer, session) = session_on(export);
            let from = peer.local_addr().unwrap();
            let fixed = dp.port.held();
            let data: Vec<u8> = (0..3 * LINK).map(|i| (i % 251) as u8).collect();
            let mut h = request(session, Opcode::Write, 2, 1, 8192, 3 * LINK);
            h.frag_count = 3;
            if fua {
                h.flags.0 |= Flags::FUA;
            }
            for (i, piece) in data.chunks(LINK as usize).enumerate() {
                h.frag_index = i as u16;
                h.frag_offset = i as u32 * LINK;
                dp.receive(&frame(h, piece), from);
                if i == 0 {
                    let took = dp.port.held() > fixed;
                    assert_eq!(took, !in_place, "{export} fua {fua}: buffer taken");
                }
            }
            let answer = answers(&peer, true);
            assert_eq!(answer.len(), 1, "{export}: one answer");
            assert_eq!(answer[0].0.status, Status::Ok, "{export}: WRITE answered");
            let read = read_back(&mut dp, &peer, session, 3, 1, (8192, 3 * LINK));
            assert!(
                read == data,
                "{export} fua {fua}: the bytes written read back"
            );
            let q = dp.port.queues[0].as_ref().unwrap();
            assert_eq!(q.exec.stats.writes, 1, "{export}: one WRITE counted");

            // Given up after its first fragment (the initiator moved the slot on): the next
            // request on the slot is a READ, answered as one.
            let mut h = request(session, Opcode::Write, 4, 1, 0, 2 * LINK);
            h.frag_count = 2;
            dp.receive(&frame(h, &vec![7u8; LINK as usize]), from);
            let read = read_back(&mut dp, &peer, session, 4, 2, (8192, LINK));
            assert!(
                read == data[..LINK as usize],
                "{export}: a READ, not the old WRITE"
            );
        }
    }

    /// The reactor's ring for `DgramPort::receive` on a port serving RAM: nothing is pushed.
    struct NoRing;

    impl Submitter for NoRing {
        fn push(&mut self, _: io_uring::squeue::Entry) {
            panic!("RAM completes inline");
        }
    }

    /// One `receive` reads at most `RECEIVE_ROUNDS` batches from its socket: a peer keeping it
    /// full cannot hold the reactor. What is left is read at the next call, without a poll
    /// (`frames_waiting`); a retiring port reads nothing and says nothing waits.
    #[test]
    fn a_receive_reads_a_bounded_number_of_datagrams() {
        let mut dp = DatagramPort::new(&["a=mem:1M"], LINK).unwrap();
        let fd = dp.port.fd.as_raw_fd();
        let room: libc::c_int = 4 << 20;
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            // SAFETY: an int option on our socket.
            let r = unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&room as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
        }
        let to = UdpSocket::from(
            std::os::fd::AsFd::as_fd(&dp.port.fd)
                .try_clone_to_owned()
                .unwrap(),
        )
        .local_addr()
        .unwrap();
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let most = RECEIVE_ROUNDS * BATCH;
        let sent = most + 24;
        for i in 0..sent {
            peer.send_to(&[i as u8; 16], to).unwrap();
        }
        dp.port.receive(&mut NoRing, &|_, _, _| 0);
        assert_eq!(dp.port.stats.bad_frames, most as u64, "one call's worth");
        assert!(dp.port.frames_waiting(), "the rest is waiting");
        dp.port.receive(&mut NoRing, &|_, _, _| 0);
        assert_eq!(dp.port.stats.bad_frames, sent as u64, "the rest");
        assert!(!dp.port.frames_waiting());
        dp.port.more_waiting = true;
        dp.port.retire();
        assert!(!dp.port.frames_waiting(), "retiring: nothing to read");
    }

    /// Sends `frames` (equal lengths but for a shorter last) from `peer` to the port as one
    /// segmented send, as an initiator sends a run of fragments, then lets the port read its
    /// socket as the reactor would.
    fn send_run(dp: &mut DatagramPort, peer: &UdpSocket, frames: &[Vec<u8>]) {
        let to = std::os::fd::AsFd::as_fd(&dp.port.fd)
            .try_clone_to_owned()
            .unwrap();
        peer.connect(UdpSocket::from(to).local_addr().unwrap())
            .unwrap();
        blkwire_net::testing::send_run(peer, frames);
        dp.port.receive(&mut NoRing, &|_, _, _| 0);
        dp.port.flush();
    }

    /// Fragment `i` of a WRITE of `data` at `offset` on `slot`.
    fn write_fragment(
        session: u32,
        slot: u16,
        offset: u64,
        data: &[u8],
        i: usize,
        fua: bool,
    ) -> Vec<u8> {
        let mut h = request(session, Opcode::Write, slot, 1, offset, data.len() as u32);
        h.frag_count = data.len().div_ceil(LINK as usize) as u16;
        h.frag_index = i as u16;
        h.frag_offset = i as u32 * LINK;
        if fua {
            h.flags.0 |= Flags::FUA;
        }
        frame(h, data.chunks(LINK as usize).nth(i).unwrap())
    }

    /// A run of a WRITE's fragments, read while the port expects them (the datagram before
    /// was a fragment of a WRITE of several), goes where it belongs: straight into the export
    /// (RAM) or into the slot's buffer (a WRITE with FUA), each fragment checked as any. The
    /// run that begins the WRITE has its first datagram handled from the peek.
    #[test]
    fn a_run_of_write_fragments_is_received_where_it_belongs() {
        for fua in [false, true] {
            let (mut dp, peer, session) = session_on("a=mem:1M");
            let from = peer.local_addr().unwrap();
            // A WRITE of five fragments the usual way: large enough that the next run is
            // expected to be more of the same.
            let first = vec![5u8; 5 * LINK as usize];
            for i in 0..5 {
                dp.receive(&write_fragment(session, 1, 0, &first, i, fua), from);
            }
            assert_eq!(answers(&peer, true)[0].0.status, Status::Ok);
            let data: Vec<u8> = (0..5 * LINK + 1000).map(|i| (i % 253) as u8).collect();
            let run: Vec<Vec<u8>> = (0..6)
                .map(|i| write_fragment(session, 2, 65536, &data, i, fua))
                .collect();
            send_run(&mut dp, &peer, &run);
            assert_eq!(
                dp.port.stats.fragments_in_place, 5,
                "fua {fua}: all but the first"
            );
            let answer = answers(&peer, true);
            assert_eq!(answer.len(), 1, "fua {fua}: one answer");
            assert_eq!(answer[0].0.status, Status::Ok, "fua {fua}: WRITE answered");
            let read = read_back(&mut dp, &peer, session, 3, 1, (65536, data.len() as u32));
            assert!(read == data, "fua {fua}: the bytes written read back");
        }
    }

    /// In a run placed as a WRITE's fragments, a damaged datagram and one that belongs to
    /// another request are put back together and handled as any datagram: the damaged one is
    /// dropped, the other lands where it belongs, and the WRITE completes with its own bytes
    /// once its missing fragments come. A run from another address than the queue's places
    /// nothing.
    #[test]
    fn a_run_with_foreign_or_damaged_datagrams_lands_only_what_belongs() {
        let (mut dp, peer, session) = session_on("a=mem:1M");
        let from = peer.local_addr().unwrap();
        let data: Vec<u8> = (0..5 * LINK + 1000).map(|i| (i % 251) as u8).collect();
        let other: Vec<u8> = (0..2 * LINK).map(|i| (i % 13) as u8 + 100).collect();
        let frag = |i| write_fragment(session, 3, 0, &data, i, false);
        dp.receive(&frag(0), from);
        let mut damaged = frag(2);
        damaged[HEADER_LEN + 100] ^= 1;
        let foreign = write_fragment(session, 4, 131072, &other, 0, false);
        // Placed as fragments 1 to 5; the fourth is another WRITE's first fragment.
        send_run(
            &mut dp,
            &peer,
            &[frag(1), damaged, frag(3), foreign, frag(5)],
        );
        assert_eq!(dp.port.stats.fragments_in_place, 3, "fragments 1, 3 and 5");
        assert_eq!(dp.port.stats.bad_frames, 1, "the damaged one");
        assert!(
            answers(&peer, false).is_empty(),
            "neither WRITE is complete"
        );
        dp.receive(&frag(2), from);
        dp.receive(&frag(4), from);
        dp.receive(&write_fragment(session, 4, 131072, &other, 1, false), from);
        let done = answers(&peer, true);
        assert_eq!(done.len(), 2, "both WRITEs answered: {done:?}");
        assert!(done.iter().all(|(h, _)| h.status == Status::Ok));
        let read = read_back(&mut dp, &peer, session, 5, 1, (0, data.len() as u32));
        assert!(read == data, "the WRITE reads back whole");
        let read = read_back(&mut dp, &peer, session, 6, 1, (131072, other.len() as u32));
        assert!(
            read == other,
            "so does the other, whose first fragment was in the run"
        );

        // From another address: the queue's fragments, but nothing is placed or taken.
        let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
        let frag = |i| write_fragment(session, 7, 0, &data, i, false);
        dp.receive(&frag(0), from);
        send_run(&mut dp, &stranger, &[frag(1), frag(2)]);
        assert_eq!(dp.port.stats.fragments_in_place, 3, "nothing more placed");
        assert_eq!(
            dp.port.stats.wrong_peer, 2,
            "the stranger's datagrams dropped"
        );
        // ... and answered as for an unknown session, so a stranger learns nothing of which
        // sessions exist: ACCESS, one per datagram, header only.
        let told = answers(&stranger, true);
        assert_eq!(told.len(), 2, "{told:?}");
        assert!(told
            .iter()
            .all(|(h, p)| h.status == Status::Access && h.session == session && p.is_empty()));
    }

    /// A run whose datagrams are not all placed: one handled the usual way completes the WRITE
    /// (FUA: its buffer goes back to the pool) while another, placed where the completing one
    /// belonged, was another WRITE's. Every placed datagram is checked before any of the run is
    /// handled, so the other WRITE's fragment is taken whole, and both WRITEs read back as
    /// written; small WRITEs leave the port reading the usual way.
    #[test]
    fn a_run_that_completes_its_write_midway_loses_nothing_after_it() {
        let (mut dp, peer, session) = session_on("a=mem:1M");
        let from = peer.local_addr().unwrap();
        let data: Vec<u8> = (0..4 * LINK).map(|i| (i % 241) as u8).collect();
        let other: Vec<u8> = (0..4 * LINK).map(|i| (i % 7) as u8 + 50).collect();
        let frag = |i| write_fragment(session, 1, 0, &data, i, true);
        let other_frag = |i| write_fragment(session, 5, 65536, &other, i, true);
        dp.receive(&frag(0), from);
        dp.receive(&frag(2), from);
        // Placed as fragments 1, 2 (held: not placed) and 3: fragment 3 comes second, and the
        // third is the other WRITE's first fragment.
        send_run(&mut dp, &peer, &[frag(1), frag(3), other_frag(0)]);
        assert_eq!(dp.port.stats.fragments_in_place, 1, "fragment 1 only");
        let done = answers(&peer, true);
        assert_eq!(done.len(), 1, "the first WRITE answered: {done:?}");
        assert_eq!((done[0].0.status, done[0].0.tag.slot()), (Status::Ok, 1));
        for i in 1..4 {
            dp.receive(&other_frag(i), from);
        }
        assert_eq!(
            answers(&peer, true)[0].0.status,
            Status::Ok,
            "the other WRITE too"
        );
        let read = read_back(&mut dp, &peer, session, 2, 1, (0, data.len() as u32));
        assert!(read == data, "the first WRITE reads back whole");
        let read = read_back(&mut dp, &peer, session, 3, 1, (65536, other.len() as u32));
        assert!(read == other, "so does the other");

        // A WRITE below IN_PLACE_MIN: the next receive does not peek.
        let small = vec![1u8; 2 * LINK as usize];
        dp.receive(&write_fragment(session, 4, 0, &small, 0, false), from);
        assert!(!dp.port.expect_fragments, "no peeks for small WRITEs");
    }

    /// A WRITE to RAM the executor would refuse (a read-only export, a range past the end)
    /// never lands, in place or not: it is answered with the refusal once its fragments are
    /// in, and the export reads back as it was.
    #[test]
    fn refused_writes_to_ram_land_nowhere() {
        for (export, offset, status) in [
            ("a=mem:1M,ro", 0, Status::ReadOnly),
            ("a=mem:1M", (1 << 20) - 4096, Status::OutOfRange),
        ] {
            let (mut dp, peer, session) = session_on(export);
            let from = peer.local_addr().unwrap();
            let mut h = request(session, Opcode::Write, 1, 1, offset, 2 * LINK);
            h.frag_count = 2;
            for i in 0..2 {
                h.frag_index = i;
                h.frag_offset = i as u32 * LINK;
                dp.receive(&frame(h, &vec![9u8; LINK as usize]), from);
                // Refused at its first fragment, holding no buffer for the rest; the second
                // gets the same answer again.
                let answer = answers(&peer, true);
                assert_eq!(answer.len(), 1, "{export}: one answer to fragment {i}");
                assert_eq!(answer[0].0.status, status, "{export}: refused");
                let q = dp.port.queues[0].as_ref().unwrap();
                assert!(
                    q.slots[1].buf.is_none() && q.buffered == 0,
                    "{export}: no buffer"
                );
            }
            let read = read_back(&mut dp, &peer, session, 2, 1, (offset, 4096));
            assert!(read.iter().all(|b| *b == 0), "{export}: nothing landed");
        }
    }

    /// A READ's HAVE bitmap keeps one bit per fragment of the message, not whatever payload the
    /// frame carried.
    #[test]
    fn a_have_bitmap_keeps_only_bits_for_real_fragments() {
        let (mut dp, peer, session) = session();
        let from = peer.local_addr().unwrap();
        for (gen, len) in [(1u16, 0u32), (2, 4096), (3, 64 << 10), (4, 1 << 30)] {
            let keep = 1;
            let mut h = request(session, Opcode::Read, 1, gen, 0, len);
            h.flags.0 |= Flags::HAVE;
            dp.receive(&frame(h, &[0xff; 4096]), from);
            let q = dp.port.queues[0].as_ref().unwrap();
            // Each READ is new on the slot: what it kept is its own.
            assert_eq!(
                q.slots[1].hdr.tag.generation(),
                gen,
                "length {len} was taken"
            );
            assert!(
                q.slots[1].client_has.capacity() <= 64 && q.slots[1].client_has.len() <= keep,
                "length {len}: kept {} bytes",
                q.slots[1].client_has.len()
            );
        }
        answers(&peer, false);
    }

    /// A repeated READ sends only the fragments its HAVE lacks, and counts a reply sent only
    /// when one of them goes: one whose HAVE holds them all is answered with nothing.
    #[test]
    fn a_repeated_read_counts_a_reply_only_when_it_sends_one() {
        let (mut dp, peer, session) = session_on("a=mem:1M");
        let from = peer.local_addr().unwrap();
        let len = 3 * LINK;
        let read = request(session, Opcode::Read, 1, 1, 0, len);
        dp.receive(&frame(read, &[]), from);
        assert_eq!(answers(&peer, true).len(), 3, "three fragments");
        let frames_out =
            |dp: &DatagramPort| dp.port.queues[0].as_ref().unwrap().exec.stats.frames_out;
        assert_eq!(frames_out(&dp), 1);
        let mut again = read;
        again.flags.0 |= Flags::HAVE;
        dp.receive(&frame(again, &[0b111]), from);
        assert!(answers(&peer, false).is_empty(), "every fragment held");
        assert_eq!(frames_out(&dp), 1, "nothing sent, nothing counted");
        dp.receive(&frame(again, &[0b101]), from);
        let got = answers(&peer, true);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.frag_index, 1, "the one lacking");
        assert_eq!(frames_out(&dp), 2);
    }

    /// A HELLO repeated with its nonce gets the cached answer, a few times only: the final
    /// HELLO of an exchange replayed from its sender's address (by someone who saw it) stops
    /// drawing answers, and no second session is opened, also when each replay changes the
    /// HELLO's unauthenticated `nonce` field.
    #[test]
    fn a_replayed_hello_is_answered_a_bounded_number_of_times() {
        let mut dp = DatagramPort::new(&["a=mem:1M"], LINK).unwrap();
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let from = peer.local_addr().unwrap();
        let mut hello = Hello {
            queues: 1,
            depth: 8,
            max_io: 64 << 10,
            client_features: 0,
            frame_payload: LINK,
            nonce: 9,
            host_id: "test".into(),
            export: "a".into(),
            auth: AuthBlock::first(AuthMethod::None, false, true, [7; 32]),
            replaces: None,
        };
        let h = Header::request(Opcode::Hello, Tag::new(0, 1), 0, 0);
        dp.receive(&frame(h, &hello.encode().unwrap()), from);
        let got = answers(&peer, true);
        assert_eq!(got[0].0.status, Status::Challenge);
        hello.auth.nonce_s = got[0].1.as_slice().try_into().unwrap();
        let mut welcomed = 0;
        for i in 0..3 * crate::access::HELLO_ANSWERS {
            hello.nonce = 9 + u64::from(i % 2) * u64::from(i);
            dp.receive(&frame(h, &hello.encode().unwrap()), from);
            welcomed += answers(&peer, false)
                .iter()
                .filter(|(r, _)| r.status == Status::Ok)
                .count();
        }
        assert_eq!(welcomed, crate::access::HELLO_ANSWERS as usize);
        assert_eq!(dp.port.index.len(), 1, "one session, one queue");
        // Replayed to another port of the target (a second UDP listener), whose cache never
        // saw it: the registry sends the same welcome a few times more, then refuses, and no
        // session is opened there.
        let mut other = dp.sibling().unwrap();
        let mut statuses = Vec::new();
        for _ in 0..2 * crate::access::HELLO_ANSWERS {
            other.receive(&frame(h, &hello.encode().unwrap()), from);
            statuses.extend(answers(&peer, true).iter().map(|(r, _)| r.status));
        }
        let ok = statuses.iter().filter(|s| **s == Status::Ok).count();
        assert_eq!(ok, crate::access::HELLO_ANSWERS as usize, "{statuses:?}");
        assert_eq!(statuses.last(), Some(&Status::Access));
        assert!(other.port.index.is_empty(), "no session on the other port");
    }

    /// A JOIN must come from an address the export's rules admit, as the HELLO did: in a
    /// keyless session the cookie travels in clear, and must not let in whoever saw it.
    #[test]
    fn a_join_from_an_address_the_rules_keep_out_is_refused() {
        let (mut dp, _peer, reply) = session_of("a=mem:1M,allow=127.0.0.1/32", 2, 0);
        assert_eq!(reply.queues, 2);
        let mut join = request(reply.session, Opcode::Join, 0, 0, 0, 0);
        join.queue = 1;
        let payload = blkwire_wire::Join {
            cookie: reply.cookie,
            proof: [0; blkwire_wire::AUTH_LEN],
            nonce_s: [0; blkwire_wire::AUTH_LEN],
        }
        .encode();
        // 127.0.0.2 is loopback too, but not in the export's rules.
        let outsider = UdpSocket::bind("127.0.0.2:0").unwrap();
        dp.receive(&frame(join, &payload), outsider.local_addr().unwrap());
        let got = answers(&outsider, true);
        assert_eq!(got[0].0.status, Status::Access, "{got:?}");
        // From an admitted address the same JOIN goes on to its address challenge.
        let insider = UdpSocket::bind("127.0.0.1:0").unwrap();
        dp.receive(&frame(join, &payload), insider.local_addr().unwrap());
        assert_eq!(answers(&insider, true)[0].0.status, Status::Challenge);
    }

    /// §9.7: a UDP session that asked for header-only CRCs gets them granted, its WRITE data
    /// may carry them, and its READ data does; a session that did not ask has such frames
    /// dropped as bad, as a frame with a wrong CRC is.
    #[test]
    fn header_only_crcs_only_where_the_session_asked_for_them() {
        let data: Vec<u8> = (0..2 * LINK).map(|i| (i % 251) as u8).collect();
        let write = |session: u32, frag: u32| {
            let mut h = request(session, Opcode::Write, 1, 1, 0, 2 * LINK);
            h.frag_count = 2;
            h.frag_index = frag as u16;
            h.frag_offset = frag * LINK;
            h.flags.0 |= Flags::HEAD_CRC;
            let part = &data[(frag * LINK) as usize..((frag + 1) * LINK) as usize];
            frame(h, part)
        };
        for asked in [false, true] {
            let features = if asked { blkwire_wire::HEADER_CRC } else { 0 };
            let (mut dp, peer, reply) = session_of("a=mem:1M", 1, features);
            assert_eq!(reply.session_flags != 0, asked, "granted as asked");
            let from = peer.local_addr().unwrap();
            let session = reply.session;
            dp.receive(&write(session, 0), from);
            dp.receive(&write(session, 1), from);
            let got = answers(&peer, asked);
            if !asked {
                assert!(got.is_empty(), "{got:?}");
                assert_eq!(dp.port.stats.bad_frames, 2);
                continue;
            }
            assert_eq!(got.len(), 1, "{got:?}");
            assert_eq!(got[0].0.status, Status::Ok);
            dp.receive(
                &frame(request(session, Opcode::Read, 2, 1, 0, 2 * LINK), &[]),
                from,
            );
            let got = answers(&peer, true);
            let back: Vec<u8> = got.iter().flat_map(|(_, p)| p.clone()).collect();
            assert_eq!(back, data, "the WRITE landed and the READ brings it back");
            assert!(got.iter().all(|(h, _)| h.flags.has(Flags::HEAD_CRC)));
            // A READ request has no data: a header-only CRC on it is refused.
            let mut r = request(session, Opcode::Read, 3, 1, 0, 512);
            r.flags.0 |= Flags::HEAD_CRC;
            dp.receive(&frame(r, &[]), from);
            assert!(answers(&peer, false).is_empty());
            assert_eq!(dp.port.stats.bad_frames, 1);
        }
    }

    /// Fragments with a header-only CRC received in place count only in a session that asked
    /// for them (§9.7): elsewhere they are dropped as bad frames, their fragments still to
    /// come, and the WRITE completes with the bytes of the fragments that count.
    #[test]
    fn header_only_crcs_in_place_only_where_the_session_asked_for_them() {
        let data: Vec<u8> = (0..5 * LINK).map(|i| (i % 233) as u8).collect();
        for asked in [false, true] {
            let features = if asked { blkwire_wire::HEADER_CRC } else { 0 };
            let (mut dp, peer, reply) = session_of("a=mem:1M", 1, features);
            let (from, session) = (peer.local_addr().unwrap(), reply.session);
            let frag = |i: usize, head_only: bool| {
                let f = write_fragment(session, 1, 0, &data, i, false);
                let mut h = Header::decode(&f, LINK).unwrap();
                if head_only {
                    h.flags.0 |= Flags::HEAD_CRC;
                }
                frame(h, &f[HEADER_LEN..])
            };
            dp.receive(&frag(0, false), from);
            send_run(
                &mut dp,
                &peer,
                &(1..5).map(|i| frag(i, true)).collect::<Vec<_>>(),
            );
            let placed = if asked { 4 } else { 0 };
            assert_eq!(dp.port.stats.fragments_in_place, placed, "asked {asked}");
            assert_eq!(dp.port.stats.bad_frames, 4 - placed, "asked {asked}");
            if !asked {
                assert!(answers(&peer, false).is_empty(), "not complete");
                for i in 1..5 {
                    dp.receive(&frag(i, false), from);
                }
            }
            assert_eq!(
                answers(&peer, true)[0].0.status,
                Status::Ok,
                "asked {asked}"
            );
            let read = read_back(&mut dp, &peer, session, 2, 1, (0, data.len() as u32));
            assert!(read == data, "asked {asked}: the bytes written read back");
        }
    }

    /// A request refused before it runs is a reply and an error in the queue's counters.
    #[test]
    fn refused_requests_are_counted() {
        let (mut dp, peer, session) = session();
        let from = peer.local_addr().unwrap();
        dp.receive(
            &frame(request(session, Opcode::Read, 9, 1, 0, 512), &[]),
            from,
        );
        assert_eq!(answers(&peer, true)[0].0.status, Status::Invalid);
        let stats = dp.port.queues[0].as_ref().unwrap().exec.stats;
        assert_eq!((stats.frames_out, stats.errors), (1, 1));
    }

    /// Frames that need no session travel alone: packed, they are dropped unanswered.
    /// Frames for an unknown session draw one ACCESS per datagram however many are packed.
    #[test]
    fn packed_control_and_unknown_session_frames_draw_at_most_one_answer() {
        let mut dp = DatagramPort::new(&["a=mem:1M"], LINK).unwrap();
        let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let from = peer.local_addr().unwrap();
        let list = frame(request(0, Opcode::List, 0, 0, 0, 0), &[0; 512]);
        dp.receive(&list, from);
        assert_eq!(answers(&peer, true).len(), 1, "a LIST alone is answered");
        let packed: Vec<u8> = (0..8).flat_map(|_| list.clone()).collect();
        dp.receive(&packed, from);
        assert!(answers(&peer, false).is_empty(), "packed LISTs are not");
        let unknown: Vec<u8> = (0..8)
            .flat_map(|i| frame(request(77, Opcode::Read, i, 1, 0, 512), &[]))
            .collect();
        dp.receive(&unknown, from);
        let got = answers(&peer, true);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.status, Status::Access);
        // JOINs too, as a JOIN to a live queue from another address is answered (once per
        // datagram): how many answers came must not tell which (session, queue) is live.
        let joins: Vec<u8> = (0..2)
            .flat_map(|_| {
                let mut h = request(77, Opcode::Join, 0, 0, 0, 0);
                h.queue = 1;
                frame(h, &[0; 72])
            })
            .collect();
        dp.receive(&joins, from);
        let got = answers(&peer, true);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.status, Status::Access);
    }

    /// A session on a `file:` export (named after `tmp`) with a READ running in the backend:
    /// its io_uring entry, which this harness never completes.
    fn a_read_running(tmp: &str) -> (DatagramPort, UdpSocket, u32) {
        let path = std::env::temp_dir().join(format!("{tmp}-{}", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let (mut dp, peer, session) = session_on(&format!("a=file:{}", path.display()));
        std::fs::remove_file(&path).unwrap();
        dp.receive(
            &frame(request(session, Opcode::Read, 1, 1, 0, 512), &[]),
            peer.local_addr().unwrap(),
        );
        assert_eq!(dp.entries_pushed(), 1, "the READ runs in the backend");
        (dp, peer, session)
    }

    /// LOGOUT ends the queue at once, even with backend I/O still running (a `file:` READ
    /// whose io_uring entry this harness never completes): later frames of the session are
    /// answered as for an unknown session, and the queue goes when its I/O is done.
    #[test]
    fn a_logout_ends_the_queue_even_with_io_running() {
        let (mut dp, peer, session) = a_read_running("blkwire-logout");
        let from = peer.local_addr().unwrap();
        dp.receive(
            &frame(request(session, Opcode::Logout, 0, 1, 0, 0), &[]),
            from,
        );
        assert_eq!(answers(&peer, true)[0].0.status, Status::Ok);
        dp.receive(
            &frame(request(session, Opcode::Read, 2, 1, 0, 512), &[]),
            from,
        );
        let got = answers(&peer, true);
        assert_eq!(got[0].0.status, Status::Access, "{got:?}");
        assert_eq!(dp.entries_pushed(), 1, "nothing more ran");
        assert!(dp.port.queues[0].as_ref().is_some_and(|q| q.closing));
    }

    /// A queue idle past the expiry with backend I/O still running is forgotten at once (its
    /// frames answered as an unknown session's) and goes when the I/O is done; it is not
    /// found idle (and logged) again at every sweep.
    #[test]
    fn an_idle_queue_with_io_running_is_forgotten_once() {
        let (mut dp, peer, session) = a_read_running("blkwire-idle");
        let from = peer.local_addr().unwrap();
        dp.port.idle_expiry = Duration::ZERO;
        dp.port.last_sweep = Instant::now() - Duration::from_secs(2);
        dp.port.sweep();
        let q = dp.port.queues[0]
            .as_ref()
            .expect("kept while its READ runs");
        assert!(
            q.closing,
            "forgotten: not found idle again at the next sweep"
        );
        dp.receive(
            &frame(request(session, Opcode::Read, 2, 1, 0, 512), &[]),
            from,
        );
        let got = answers(&peer, true);
        assert_eq!(got[0].0.status, Status::Access, "{got:?}");
        assert_eq!(dp.entries_pushed(), 1, "nothing more ran");
    }

    /// A host runs at most `HOST_COPIES` COPYs at once on a port: the next is dropped like a
    /// lost frame (and retransmitted), so a host cannot hold the port's share in bounce
    /// buffers, one per slot, that no other host's request reclaims.
    #[test]
    fn a_host_runs_a_bounded_number_of_copies() {
        use blkwire_backend::CopyRange;
        // memthread: the COPY runs on the export's thread, so the first is still running.
        let (mut dp, peer, session) = session_on("a=memthread:4M");
        let from = peer.local_addr().unwrap();
        let desc = CopyDescriptor {
            source: String::new(),
            ranges: vec![CopyRange {
                offset: 0,
                len: 4096,
            }],
        }
        .encode()
        .unwrap();
        let copy = |slot| {
            frame(
                request(session, Opcode::Copy, slot, 1, 1 << 20, 4096),
                &desc,
            )
        };
        for slot in 0..HOST_COPIES as u16 / 2 {
            dp.receive(&copy(slot), from);
        }
        // The rest through another session of the same host (its own queue, slots and port).
        let (other, o) = open_session(&mut dp, "127.0.0.1", 1, 0);
        let from_other = other.local_addr().unwrap();
        let copy_other = |slot| {
            frame(
                request(o.session, Opcode::Copy, slot, 1, 2 << 20, 4096),
                &desc,
            )
        };
        for slot in 0..HOST_COPIES as u16 / 2 {
            dp.receive(&copy_other(slot), from_other);
        }
        assert_eq!(dp.port.copying, HOST_COPIES, "those run at once");
        dp.receive(&copy_other(HOST_COPIES as u16 / 2), from_other);
        assert_eq!(dp.port.copying, HOST_COPIES, "the next does not");
        assert_eq!(
            (dp.port.stats.copies_held_back, dp.port.stats.no_memory),
            (1, 0),
            "dropped, to be sent again"
        );
        assert!(answers(&peer, false).is_empty(), "nothing answered yet");
    }

    fn hdr(op: Opcode, gen: u16) -> Header {
        Header::request(op, Tag::new(3, gen), 0, 4096)
    }

    #[test]
    fn generation_rules() {
        use Opcode::{Read, Write};
        use SlotState::{Assembling, Done, Empty, Reclaimed};
        use Verdict::*;
        let running = SlotState::Running(Started::now());
        #[rustfmt::skip]
        let table = [
            // (slot state, held op/gen, arriving op/gen) -> verdict
            (Empty, (Read, 5), (Read, 5), New),
            (Assembling, (Write, 5), (Write, 5), Fragment),
            (Assembling, (Write, 5), (Read, 5), Drop),        // same generation, other command
            (Done, (Write, 5), (Read, 5), Drop),              // likewise: a duplicate (§6)
            (Reclaimed, (Write, 5), (Write, 5), New),         // begun again
            (Reclaimed, (Write, 5), (Read, 5), Drop),
            (Assembling, (Write, 5), (Write, 6), New),        // the write was given up
            (Assembling, (Write, 5), (Write, 4), Drop),       // stale
            (running, (Write, 5), (Write, 5), Drop),          // duplicate of what runs
            (running, (Write, 5), (Read, 6), Drop),           // next one waits for the slot
            (Done, (Read, 5), (Read, 5), Reread),
            (Done, (Write, 5), (Write, 5), ResendReply),      // never executed twice
            (Done, (Write, 5), (Write, 4), Drop),             // late duplicate of an older one
            (Done, (Write, 5), (Write, 6), New),
            (Done, (Write, 0xffff), (Write, 0), New),         // wrap-around is newer
            (Done, (Write, 0), (Write, 0xffff), Drop),        // and the old side of it stale
            (Done, (Write, 5), (Write, 0x8006), Drop),        // 0x7fff behind: still older
            (Done, (Write, 5), (Write, 0x8005), Drop),        // half the space ahead: too far
            (Done, (Write, 5), (Write, 1029), New),           // 1024 ahead: given up unseen
            (Done, (Write, 5), (Write, 1030), Drop),          // further: a delayed old copy
            (Done, (Write, 0xfff0), (Write, 0x3f0), New),     // the window across the wrap
        ];
        for (state, (hop, hgen), (op, gen), want) in table {
            assert_eq!(
                classify(state, &hdr(hop, hgen), &hdr(op, gen)),
                want,
                "{state:?} holding {hop:?}#{hgen}, got {op:?}#{gen}"
            );
        }
    }
}
