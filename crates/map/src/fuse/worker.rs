//! One worker thread per queue. Each owns a /dev/fuse descriptor (requests are shared between
//! all descriptors of the connection; replies go back on the descriptor a request came from)
//! and a blkwire `Queue`, so nothing on the I/O path is shared between threads. With FUSE over
//! io_uring a worker also owns a `Ring` (uring.rs) with the entries of its share of the
//! kernel's ring queues; requests then arrive as ring completions and are answered by commits.
//! Both transports share everything below the `Transport` trait: parsing, the pending table,
//! the blkwire queue, timeouts and reconnection.
//!
//! Data path: READ/WRITE/FSYNC/FLUSH/FALLOCATE become blkwire commands (one per request, as the
//! FUSE request size is negotiated not to exceed the session's max I/O); everything else is
//! answered on the spot from constant attributes. A READ or WRITE that covers part of a logical
//! block (FUSE cuts requests by pages, not bytes) gets whole-block commands for its partial
//! blocks besides (partial.rs). A worker keeps reading the kernel's requests while earlier ones
//! are in flight (up to the queue depth), so the loop device's queue depth reaches the target. It never blocks on the target: it sleeps in one place that watches both
//! the kernel (/dev/fuse, or its ring) and the queue's socket (`Queue::fd`), until the queue's
//! next timer (`Queue::deadline`: datagram retransmission and keepalive, TCP timeout), and
//! makes progress with the non-blocking `Queue::poll`.
//!
//! Failures: when the connection breaks, requests stay in the worker's table (writes keep their
//! data) and are sent again once a reconnection succeeds. Every request gets an answer within
//! `--timeout` of its arrival: EIO if the target has not answered by then, except a change of the
//! export (WRITE, discard, zeroing) the target may still be running then. Its EIO waits for the
//! give-up fence (PROTOCOL.md §2.6): the connection is given up at once, and the answer goes out
//! when a reconnection naming its queue is welcomed (the target's word that nothing sent on it
//! runs any more), or unfenced one more timeout later. Else a rewrite of those blocks, through
//! any queue, could be overtaken by the old write. Once an outage is older than the timeout, a
//! new request gets one fresh connection attempt and fails as soon as that attempt does, rather
//! than waiting out the timeout again.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_client::{
    BlockOp, BlockRequest, Cmd, Completion, ConnectOptions, IoFlags, Queue, QueueRef, Url,
};
use blkwire_spin::{readable, AdaptiveSpin};
use blkwire_wire::Status;

use super::abi::{self, Attr, ParseError, Request, FILE_ID, ROOT_ID};
use super::channel::Channel;
use super::partial::{self, BlockLocks, Edge, Step};
use super::uring::Ring;
use crate::device::{final_flush, held_writes_wait, unfenced_line, Needs};
use crate::log;
use crate::sys::Waker;

/// Offset of WRITE data in a request: fuse_in_header + fuse_write_in.
const WRITE_DATA_AT: usize = abi::IN_HEADER_LEN + 40;
/// How often request deadlines are checked while requests are pending, and how long a
/// disconnected worker sleeps between looks at its reconnection attempt.
const TICK: Duration = Duration::from_millis(50);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(5);
/// How long a command the target refused for want of memory waits before it is sent again
/// (NO_MEMORY, NVMe's Command Interrupted: the target ran nothing and says to retry), as
/// ublk's queues do.
const RETRY_AFTER: Duration = Duration::from_millis(10);

/// What the daemon's main thread hears about.
pub(crate) enum Event {
    /// SIGTERM/SIGINT/SIGHUP.
    Signal(i32),
    /// The last open handle of the file was released: the loop device let go of it.
    FileReleased,
    /// A worker stopped: the FUSE connection ended, or `error`.
    WorkerExited { id: usize, error: Option<String> },
    /// A FUSE-over-io_uring worker registered its ring entries, or the kernel refused them.
    Registered { id: usize, error: Option<String> },
}

/// How a worker talks to the kernel: read()/writev() on its /dev/fuse descriptor (`Channel`),
/// or FUSE over io_uring (`Ring`). Everything else about serving requests is shared.
pub(crate) trait Transport: Sized {
    /// Answers request `unique` (see `Channel::reply`).
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) -> std::io::Result<()>;
    /// The /dev/fuse descriptor for the requests read() delivers.
    fn channel(&self) -> &Channel;
    /// The worker's loop until the FUSE connection ends.
    fn serve(w: &mut Worker<Self>) -> Result<(), String>;
}

impl Transport for Channel {
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) -> std::io::Result<()> {
        Channel::reply(self, unique, errno, parts)
    }
    fn channel(&self) -> &Channel {
        self
    }
    fn serve(w: &mut Worker<Self>) -> Result<(), String> {
        w.serve_read()
    }
}

impl Transport for Ring {
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) -> std::io::Result<()> {
        self.answer(unique, errno, parts)
    }
    fn channel(&self) -> &Channel {
        Ring::channel(self)
    }
    fn serve(w: &mut Worker<Self>) -> Result<(), String> {
        w.serve_ring()
    }
}

/// Read-only facts and the few counters all workers share.
pub(crate) struct Shared {
    pub url: Url,
    /// For reconnecting one queue: the session's options with `queues: 1`.
    pub reconnect: ConnectOptions,
    pub size: u64,
    pub readonly: bool,
    /// The export offers WRITE_ZEROES, which every zeroing FALLOCATE becomes.
    pub write_zeroes: bool,
    /// The most one WRITE_ZEROES covers (`ExportInfo::max_range`).
    pub zero_step: u32,
    /// Name of the file in the mount.
    pub name: Vec<u8>,
    pub root: Attr,
    pub file: Attr,
    pub block_size: u32,
    pub timeout: Duration,
    /// Largest READ/WRITE the kernel sends (negotiated at INIT).
    pub max_io: u32,
    /// What a session must grant to serve the file (checked on each reconnection).
    pub needs: Needs,
    pub events: mpsc::Sender<Event>,
    /// Open handles of the file; see `Event::FileReleased`.
    pub opens: AtomicU64,
    /// Set once the loop device holds the file, so the release of a handle opened earlier
    /// during setup does not count as the end of the mapping.
    pub armed: AtomicBool,
    pub next_fh: AtomicU64,
    /// Successful reconnections by any worker (see `Outage::seen`).
    pub reconnects: AtomicU64,
    /// Blocks under read-modify-write (partial.rs).
    pub locks: Arc<BlockLocks>,
}

impl Shared {
    /// The export's logical block, which is the loop device's.
    fn logical_block(&self) -> u32 {
        self.needs.logical_block.max(512)
    }
}

/// The range a FUSE request covers, as a block operation. Its length is 64-bit because one
/// FALLOCATE may span more than a blkwire command carries: WRITE_ZEROES goes out as commands of
/// at most `step` bytes (the session's `ExportInfo::max_range`); the others are one command each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct IoOp {
    op: BlockOp,
    offset: u64,
    len: u64,
    flags: IoFlags,
    /// The most one command of it covers (WRITE_ZEROES: `Shared::zero_step`).
    step: u64,
}

impl IoOp {
    fn new(op: BlockOp, offset: u64, len: u64) -> IoOp {
        IoOp {
            op,
            offset,
            len,
            flags: IoFlags::empty(),
            step: u64::from(blkwire_client::MAX_RANGE),
        }
    }

    /// A WRITE_ZEROES of `len` bytes at `offset`, in commands of `step` bytes at most.
    fn zeroes(offset: u64, len: u64, step: u32) -> IoOp {
        IoOp {
            step: u64::from(step.max(1)),
            ..IoOp::new(BlockOp::WriteZeroes, offset, len)
        }
    }

    fn chunks(&self) -> u32 {
        match self.op {
            BlockOp::WriteZeroes => self.len.div_ceil(self.step).max(1) as u32,
            _ => 1,
        }
    }

    /// Command `i` of the request; a WRITE's data is `data` (from its first byte on).
    fn cmd<'a>(&self, i: u32, data: &'a [u8]) -> Cmd<'a> {
        let at = i as u64 * self.step;
        let req = BlockRequest {
            op: self.op,
            offset: self.offset + at,
            len: (self.len - at).min(self.step) as u32,
            flags: self.flags,
        };
        let data = match self.op {
            BlockOp::Write => &data[..req.len as usize],
            _ => &[],
        };
        Cmd::from_request(&req, data)
    }
}

/// A FUSE request being served.
struct Pending {
    unique: u64,
    arrived: Instant,
    /// Its whole blocks (all of it unless `edges`).
    op: IoOp,
    /// Bytes the request covers: what a WRITE's answer says, a split READ's reply.
    total: u32,
    /// Where `op` starts in the request's bytes (after a partial first block).
    mid_from: usize,
    /// Its partial first and last blocks (partial.rs), the lower first.
    edges: Vec<Edge>,
    /// Answer EIO if not done by then (unless it is held for the fence, see `held`).
    deadline: Instant,
    /// When its latest command was sent; a connection that leaves a command unanswered for the
    /// whole timeout is considered dead.
    sent_at: Instant,
    chunks: u32,
    sent: u32,
    /// Chunks of `op` the target refused for want of memory, to send again (`retry_at`).
    redo: Vec<u32>,
    /// A command of it was refused for want of memory: nothing of it is sent before then.
    retry_at: Option<Instant>,
    outstanding: u32,
    err: i32,
    /// Already answered (EIO at its deadline) but commands are still in flight; its unsent
    /// chunks are never sent, and it leaves the table when the last one in flight is back.
    replied: bool,
    /// A change of the export with commands in flight on a connection given up since, whose
    /// queue has not been fenced yet (PROTOCOL.md §2.6): the target may still run them. Set
    /// only when that queue has an identity to be fenced by.
    unfenced: bool,
    /// The request as read (WRITE only: its data must survive a reconnection); for a READ with
    /// `edges`, where its parts are gathered.
    buf: Vec<u8>,
}

/// A command's token for the queue: the request's slot (below 2^24: the table is as large as
/// the queue's depth and the ring entries), 0 for `op` or 1 + the edge, and which chunk of
/// `op` it is.
fn tag(idx: usize, part: usize, chunk: u32) -> u64 {
    idx as u64 | (part as u64) << 24 | u64::from(chunk) << 32
}

/// The slot, part and chunk of a command's token.
fn untag(user: u64) -> (usize, usize, u32) {
    (
        (user & 0xff_ffff) as usize,
        (user >> 24 & 0xff) as usize,
        (user >> 32) as u32,
    )
}

impl Pending {
    /// Request `unique`, `op` (a WRITE's request buffer `buf`), answered EIO if not done by
    /// `deadline`. A READ or WRITE that covers part of a `block`-byte block is split
    /// (partial.rs).
    fn new(
        unique: u64,
        op: IoOp,
        buf: Option<Vec<u8>>,
        block: u32,
        now: Instant,
        deadline: Instant,
    ) -> Pending {
        // What a WRITE's answer says (a READ or WRITE is at most max_io).
        let total = op.len as u32;
        let rw = matches!(op.op, BlockOp::Read | BlockOp::Write);
        let (op, chunks, mid_from, edges, buf) =
            if rw && !(op.offset | op.len).is_multiple_of(block as u64) {
                let s = partial::split(op.offset, op.len, block as u64, op.op == BlockOp::Write);
                let mid = IoOp::new(op.op, s.mid_offset, s.mid_len);
                let chunks = if s.mid_len == 0 { 0 } else { mid.chunks() };
                // A READ gathers its parts in a buffer of its own.
                let buf = buf.unwrap_or_else(|| vec![0; total as usize]);
                (mid, chunks, s.mid_from, s.edges, buf)
            } else {
                (op, op.chunks(), 0, Vec::new(), buf.unwrap_or_default())
            };
        Pending {
            unique,
            arrived: now,
            op,
            total,
            mid_from,
            edges,
            deadline,
            sent_at: now,
            chunks,
            sent: 0,
            redo: Vec::new(),
            retry_at: None,
            outstanding: 0,
            err: 0,
            replied: false,
            unfenced: false,
            buf,
        }
    }

    /// Whether its EIO must wait for the give-up fence at `now`: it changes the export, and
    /// commands of it may still run at the target (in flight on a connection that can be fenced,
    /// `fenceable`, or `unfenced`), and one timeout past its deadline has not gone by yet.
    fn held(&self, fenceable: bool, now: Instant, timeout: Duration) -> bool {
        self.op.op.modifies()
            && (self.unfenced || (fenceable && self.outstanding > 0))
            && now < self.deadline + timeout
    }

    /// The next command to send (0 and a chunk: `op`'s, 1 + i: edge i), or None if nothing
    /// can go now (or before `retry_at`). A WRITE's edges take their blocks' locks in order,
    /// the lower block first, so no two requests can each hold a lock the other waits for.
    fn next_part(&mut self, locks: &BlockLocks, now: Instant) -> Option<(usize, u32)> {
        if self.retry_at.is_some_and(|t| t > now) {
            return None;
        }
        self.retry_at = None;
        for (i, e) in self.edges.iter_mut().enumerate() {
            match e.step {
                Step::Lock if locks.try_take(e.at) => {
                    e.locked = true;
                    e.step = Step::Read;
                    return Some((i + 1, 0));
                }
                Step::Lock => break,
                Step::Read | Step::Write => return Some((i + 1, 0)),
                _ => {}
            }
        }
        if let Some(&chunk) = self.redo.last() {
            return Some((0, chunk));
        }
        (self.sent < self.chunks).then_some((0, self.sent))
    }

    fn cmd(&self, part: usize, chunk: u32, block: u32) -> Cmd<'_> {
        let Some(e) = part.checked_sub(1).map(|i| &self.edges[i]) else {
            let data = match self.op.op {
                BlockOp::Write => &self.buf[WRITE_DATA_AT + self.mid_from..],
                _ => &[],
            };
            return self.op.cmd(chunk, data);
        };
        match e.step {
            Step::Write => Cmd::Write {
                offset: e.at,
                data: &e.block,
                fua: false,
            },
            _ => Cmd::Read {
                offset: e.at,
                len: block,
            },
        }
    }

    fn mark_sent(&mut self, part: usize, chunk: u32) {
        match part.checked_sub(1).map(|i| &mut self.edges[i]) {
            None if self.redo.last() == Some(&chunk) => {
                self.redo.pop();
            }
            None => self.sent += 1,
            Some(e) if e.step == Step::Read => e.step = Step::Reading,
            Some(e) => e.step = Step::Writing,
        }
    }

    /// Lets go of the locks its edges hold (it leaves the table).
    fn release_locks(&self, locks: &BlockLocks) {
        for e in self.edges.iter().filter(|e| e.locked) {
            locks.release(e.at);
        }
    }

    fn waits_for_lock(&self) -> bool {
        self.edges.iter().any(|e| e.step == Step::Lock)
    }

    /// The target refused command `part` (`chunk`) for want of memory: it ran nothing, and
    /// the command goes again after `RETRY_AFTER` (an edge keeps its block's lock). Answered
    /// EIO at the request's deadline if it is still refused then.
    fn refused(&mut self, part: usize, chunk: u32, now: Instant) {
        match part.checked_sub(1).and_then(|i| self.edges.get_mut(i)) {
            None => self.redo.push(chunk),
            Some(e) => e.step = e.step.again(),
        }
        self.retry_at = Some(now + RETRY_AFTER);
    }

    /// Nothing in flight and nothing more to send. A request answered at its deadline or failed
    /// sends no further commands (`pump` skips it), so once its last command is back it is
    /// done, however many it never sent.
    fn finished(&self) -> bool {
        self.outstanding == 0
            && (self.replied
                || self.err != 0
                || (self.sent >= self.chunks
                    && self.redo.is_empty()
                    && self.edges.iter().all(|e| e.step == Step::Done)))
    }
}

/// The worker's in-flight requests and its pool of request buffers.
struct Table {
    slots: Vec<Option<Pending>>,
    free: Vec<usize>,
    live: usize,
    /// Requests with commands left to send, oldest first.
    unsent: VecDeque<usize>,
    /// Requests with an edge waiting for its block's lock (`pump` tries them again).
    waiting: Vec<usize>,
    /// Requests with a command refused for want of memory (`Pending::retry_at`): `pump`
    /// sends it again when its time comes.
    retrying: Vec<usize>,
    /// The export's logical block.
    block: u32,
    locks: Arc<BlockLocks>,
    bufs: Vec<Vec<u8>>,
    buf_len: usize,
    /// A reply found the FUSE connection gone.
    fuse_gone: bool,
    /// Requests failed with EIO for want of an answer, since the last log line about it.
    failed: u64,
    /// Of those, changes answered without the fence (`Pending::held` ran out): the target may
    /// still run them.
    unfenced_failed: u64,
    last_fail_log: Option<Instant>,
}

impl Table {
    fn new(cap: usize, buf_len: usize, block: u32, locks: Arc<BlockLocks>) -> Table {
        Table {
            slots: (0..cap).map(|_| None).collect(),
            free: (0..cap).rev().collect(),
            live: 0,
            unsent: VecDeque::with_capacity(cap),
            waiting: Vec::new(),
            retrying: Vec::new(),
            block,
            locks,
            bufs: Vec::new(),
            buf_len,
            fuse_gone: false,
            failed: 0,
            unfenced_failed: 0,
            last_fail_log: None,
        }
    }

    /// Request buffers are allocated on first use and reused: a fresh large allocation is
    /// mapped lazily, so a 4 KiB request only ever touches the first pages of its 1 MiB buffer.
    fn take_buf(&mut self) -> Vec<u8> {
        self.bufs.pop().unwrap_or_else(|| vec![0u8; self.buf_len])
    }

    fn put_buf(&mut self, b: Vec<u8>) {
        if b.len() == self.buf_len && self.bufs.len() <= self.slots.len() {
            self.bufs.push(b);
        }
    }

    fn insert(&mut self, p: Pending) -> Option<usize> {
        let idx = self.free.pop()?;
        self.slots[idx] = Some(p);
        self.live += 1;
        self.unsent.push_back(idx);
        Some(idx)
    }

    fn remove(&mut self, idx: usize) {
        if let Some(p) = self.slots[idx].take() {
            self.live -= 1;
            self.free.push(idx);
            p.release_locks(&self.locks);
            self.put_buf(p.buf);
        }
    }

    fn reply(&mut self, ch: &mut impl Transport, unique: u64, errno: i32, parts: &[&[u8]]) {
        if let Err(e) = ch.reply(unique, errno, parts) {
            if e.raw_os_error() == Some(libc::ENODEV) {
                self.fuse_gone = true;
            } else {
                log!("error", "replying to the kernel: {e}");
            }
        }
    }

    /// A blkwire command finished: answer the FUSE request once all its commands have.
    fn on_completion(&mut self, ch: &mut impl Transport, c: Completion<'_>) {
        let (idx, part, chunk) = untag(c.user);
        let block = self.block as usize;
        let Some(Some(p)) = self.slots.get_mut(idx) else {
            return;
        };
        p.outstanding = p.outstanding.saturating_sub(1);
        let mut more = false;
        if c.status == Status::NoMemory && !p.replied && p.err == 0 {
            // The target's word that it ran nothing and that the initiator retries: failed,
            // a filesystem would take a transient refusal for a broken disk.
            p.refused(part, chunk, Instant::now());
            if !self.retrying.contains(&idx) {
                self.retrying.push(idx);
            }
            return;
        }
        if c.status != Status::Ok {
            if p.err == 0 {
                p.err = c.status.errno();
                p.sent = p.chunks; // send no further chunks of a failed range
            }
        } else if part == 0 {
            if p.op.op == BlockOp::Read && !p.edges.is_empty() {
                let n = (p.op.len as usize).min(c.data.len());
                p.buf[p.mid_from..p.mid_from + n].copy_from_slice(&c.data[..n]);
            }
        } else if let Some(e) = p.edges.get_mut(part - 1) {
            let read = p.op.op == BlockOp::Read;
            match e.step {
                Step::Reading if c.data.len() < block => {
                    p.err = if p.err == 0 { libc::EIO } else { p.err };
                }
                Step::Reading if read => {
                    p.buf[e.from..e.from + e.len].copy_from_slice(&c.data[e.into..e.into + e.len]);
                    e.step = Step::Done;
                }
                Step::Reading => {
                    // Read-modify-write: the block as it is, with this request's bytes in.
                    e.block.clear();
                    e.block.extend_from_slice(&c.data[..block]);
                    let src = WRITE_DATA_AT + e.from;
                    e.block[e.into..e.into + e.len].copy_from_slice(&p.buf[src..src + e.len]);
                    e.step = Step::Write;
                    more = true;
                }
                Step::Writing => {
                    e.step = Step::Done;
                    if std::mem::take(&mut e.locked) {
                        self.locks.release(e.at);
                    }
                }
                _ => {}
            }
        }
        if more && !p.replied && p.err == 0 {
            self.unsent.push_back(idx);
        }
        if !p.finished() {
            return;
        }
        if !p.replied {
            let (unique, err, op, total) = (p.unique, p.err, p.op, p.total);
            // A split READ replies with what it gathered, the others with their one command's.
            let gathered =
                (op.op == BlockOp::Read && !p.edges.is_empty()).then(|| std::mem::take(&mut p.buf));
            if err != 0 {
                self.reply(ch, unique, err, &[]);
            } else {
                match (op.op, &gathered) {
                    (BlockOp::Read, Some(b)) => self.reply(ch, unique, 0, &[&b[..total as usize]]),
                    (BlockOp::Read, None) => self.reply(ch, unique, 0, &[c.data]),
                    (BlockOp::Write, _) => self.reply(ch, unique, 0, &[&abi::write_out(total)]),
                    _ => self.reply(ch, unique, 0, &[]),
                }
            }
        }
        self.remove(idx);
    }
}

impl Drop for Table {
    /// A worker that stops (the FUSE connection ended, or an error) leaves no block locked:
    /// the other workers' partial-block writes to it would otherwise wait for the lock until
    /// their deadline, and fail, for the rest of the mapping.
    fn drop(&mut self) {
        for p in self.slots.iter().flatten() {
            p.release_locks(&self.locks);
        }
    }
}

enum Link {
    Up(Queue),
    Down(Outage),
}

struct Outage {
    since: Instant,
    next_try: Instant,
    backoff: Duration,
    attempt: Option<Attempt>,
    attempts: u32,
    /// `Shared::reconnects` when the last attempt started: a change means another worker got
    /// through, so this one tries again at once instead of waiting out its backoff.
    seen: u64,
    /// The queue that went down: each attempt names it, so the target finishes its requests
    /// before the new session may send them again (PROTOCOL.md §2.6).
    replaces: Option<QueueRef>,
}

impl Outage {
    fn new(seen: u64, replaces: Option<QueueRef>) -> Outage {
        let now = Instant::now();
        Outage {
            since: now,
            next_try: now,
            backoff: FIRST_BACKOFF,
            attempt: None,
            attempts: 0,
            seen,
            replaces,
        }
    }
}

/// A reconnection running in its own thread.
struct Attempt {
    rx: mpsc::Receiver<Result<Queue, String>>,
    started: Instant,
}

enum Got {
    Request,
    Empty,
    Gone,
}

pub(crate) struct Worker<C> {
    id: usize,
    ch: C,
    sh: Arc<Shared>,
    link: Link,
    /// Changes with every new `Queue` (see `SockPoll`).
    link_id: u64,
    /// Before sleeping with answers outstanding, the worker spins as `Queue::complete` does
    /// (the session's `ConnectOptions::poll`, 50 µs by default; adaptive, see blkwire_spin).
    spin: AdaptiveSpin,
    t: Table,
    cap: usize,
    next_tick: Instant,
    waker: Arc<Waker>,
    /// Requests taken from ring entries and from read(), for the exit log line (which tells
    /// whether FUSE over io_uring really carried the traffic).
    via_ring: u64,
    via_read: u64,
    /// READs and WRITEs that covered part of a logical block (partial.rs), for the exit log.
    partial: u64,
}

impl<C: Transport> Worker<C> {
    /// `entries`: ring entries the transport can hand over at once besides what read() brings
    /// (0 for the read path); the table must hold all of them.
    pub(crate) fn new(
        id: usize,
        ch: C,
        sh: Arc<Shared>,
        q: Queue,
        entries: usize,
        waker: Arc<Waker>,
    ) -> Worker<C> {
        let cap = q.depth().max(1) + entries;
        let spin = AdaptiveSpin::new(sh.reconnect.poll);
        sh.locks.watch(Arc::clone(&waker));
        let buf_len = (sh.max_io as usize + abi::REQUEST_OVERHEAD).max(abi::MIN_READ_BUFFER);
        let t = Table::new(cap, buf_len, sh.logical_block(), Arc::clone(&sh.locks));
        Worker {
            id,
            ch,
            sh,
            link: Link::Up(q),
            link_id: 0,
            spin,
            t,
            cap,
            next_tick: Instant::now(),
            waker,
            via_ring: 0,
            via_read: 0,
            partial: 0,
        }
    }

    /// Serves until the FUSE connection ends, then flushes and logs out.
    pub(crate) fn run(mut self) {
        let error = C::serve(&mut self).err();
        if let Some(e) = &error {
            log!("error", "queue {}: {e}", self.id);
            // The mapping may go on with the other workers: what this one took from the
            // kernel is answered, not left waiting for ever. What is at the target first gets
            // its own answer (a write told EIO while it may still land could overwrite the
            // rewrite the filesystem makes through another worker); the rest EIO, a change
            // still out counted as unfenced.
            self.settle_in_flight();
            self.fail_waiting(|_| true);
            if self.t.unfenced_failed > 0 {
                let n = std::mem::take(&mut self.t.unfenced_failed);
                log!(
                    "warn",
                    "{}",
                    unfenced_line(self.id, n, &self.sh.url, self.sh.timeout)
                );
            }
        }
        log!(
            "info",
            "queue {}: served {} request(s) through io_uring, {} through /dev/fuse read",
            self.id,
            self.via_ring,
            self.via_read
        );
        if self.partial > 0 {
            log!(
                "info",
                "queue {}: {} request(s) covered part of a {}-byte block (served by whole-block I/O)",
                self.id,
                self.partial,
                self.t.block
            );
        }
        if let Link::Up(q) = std::mem::replace(&mut self.link, Link::Down(Outage::new(0, None))) {
            final_flush(q, self.sh.readonly, self.id, self.sh.timeout);
        }
        let _ = self
            .sh
            .events
            .send(Event::WorkerExited { id: self.id, error });
    }

    /// Deadlines, sending, and whatever the target has answered, without waiting. Returns how
    /// many answers came.
    fn turn(&mut self) -> usize {
        self.maintain();
        let mut total = 0;
        loop {
            self.pump();
            let Worker { link, t, ch, .. } = self;
            let Link::Up(q) = link else {
                return total;
            };
            match q.poll(|c| t.on_completion(ch, c)) {
                // Answers free queue slots: send what waited for one before sleeping.
                Ok(n) if n > 0 && !self.t.unsent.is_empty() => total += n,
                Ok(n) => return total + n,
                Err(e) => {
                    self.link_down(&e.to_string());
                    return total;
                }
            }
        }
    }

    /// Requests of ours are at the target.
    fn in_flight(&self) -> bool {
        matches!(&self.link, Link::Up(q) if q.in_flight() > 0)
    }

    /// The queue's socket and its number, for the ring's poll (None while disconnected).
    fn sock(&self) -> Option<(u64, RawFd)> {
        match &self.link {
            Link::Up(q) => Some((self.link_id, q.fd())),
            Link::Down(_) => None,
        }
    }

    /// The link wants polling now, whatever its socket shows (a TLS session may hold answers
    /// its socket no longer shows): no spinning on the socket first.
    fn poll_now(&self) -> bool {
        match &self.link {
            Link::Up(q) => q.deadline().is_some_and(|d| d <= Instant::now()),
            Link::Down(_) => false,
        }
    }

    /// How long the worker may sleep: until the queue's next timer, or a refused command's
    /// retry, and at most a tick while requests wait for an answer or a reconnection. None:
    /// until something happens.
    fn wait_limit(&self) -> Option<Duration> {
        let up = matches!(self.link, Link::Up(_));
        let retry = self
            .t
            .retrying
            .iter()
            .filter_map(|&i| self.t.slots[i].as_ref()?.retry_at)
            .min()
            .filter(|_| up)
            .map(|t| t.saturating_duration_since(Instant::now()));
        let tick = (self.t.live > 0 || !up).then_some(TICK);
        let queue = match &self.link {
            Link::Up(q) => q
                .deadline()
                .map(|d| d.saturating_duration_since(Instant::now())),
            Link::Down(_) => None,
        };
        [tick, retry, queue].into_iter().flatten().min()
    }

    fn read_one(&mut self) -> Result<Got, String> {
        let mut buf = self.t.take_buf();
        match self.ch.channel().receive(&mut buf) {
            Ok(n) => {
                self.via_read += 1;
                self.dispatch(buf, n);
                Ok(Got::Request)
            }
            Err(e) => {
                self.t.put_buf(buf);
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(Got::Empty),
                    // Interrupted before we read it: nothing to answer.
                    Some(libc::ENOENT) => Ok(Got::Request),
                    Some(libc::ENODEV) => Ok(Got::Gone),
                    _ => Err(format!("reading /dev/fuse: {e}")),
                }
            }
        }
    }

    /// Answers or queues one request. `buf[..n]` is the request.
    fn dispatch(&mut self, buf: Vec<u8>, n: usize) {
        let (h, req) = match abi::parse(&buf[..n]) {
            Ok(x) => x,
            Err(ParseError::Short) => {
                log!(
                    "error",
                    "short request from the kernel ({n} bytes), ignored"
                );
                self.t.put_buf(buf);
                return;
            }
            Err(ParseError::Body(h)) => {
                log!(
                    "error",
                    "malformed request opcode {} from the kernel",
                    h.opcode
                );
                self.t.reply(&mut self.ch, h.unique, libc::EIO, &[]);
                self.t.put_buf(buf);
                return;
            }
        };
        let sh = Arc::clone(&self.sh);
        let u = h.unique;
        let ch = &mut self.ch;
        let t = &mut self.t;
        match req {
            Request::Lookup { name } => {
                if h.nodeid == ROOT_ID && name == sh.name.as_slice() {
                    t.reply(ch, u, 0, &[&abi::entry_out(&sh.file)]);
                } else {
                    t.reply(ch, u, libc::ENOENT, &[]);
                }
            }
            Request::Getattr => match h.nodeid {
                ROOT_ID => t.reply(ch, u, 0, &[&abi::attr_out(&sh.root)]),
                FILE_ID => t.reply(ch, u, 0, &[&abi::attr_out(&sh.file)]),
                _ => t.reply(ch, u, libc::ENOENT, &[]),
            },
            Request::Setattr { valid, size } => {
                if h.nodeid == FILE_ID && valid & abi::FATTR_SIZE != 0 && size != sh.size {
                    // The file is the export: its size is the export's.
                    t.reply(ch, u, libc::EPERM, &[]);
                } else {
                    // Modes and times are not stored anywhere; report them unchanged.
                    let a = if h.nodeid == FILE_ID {
                        &sh.file
                    } else {
                        &sh.root
                    };
                    t.reply(ch, u, 0, &[&abi::attr_out(a)]);
                }
            }
            Request::Open { flags } => {
                if h.nodeid != FILE_ID {
                    t.reply(ch, u, libc::EISDIR, &[]);
                } else if sh.readonly && flags as i32 & libc::O_ACCMODE != libc::O_RDONLY {
                    t.reply(ch, u, libc::EROFS, &[]);
                } else {
                    let fh = sh.next_fh.fetch_add(1, Ordering::Relaxed);
                    sh.opens.fetch_add(1, Ordering::SeqCst);
                    // DIRECT_IO: no page cache in the FUSE layer either (the loop device already
                    // does direct I/O; this also covers anyone opening the file without it).
                    let flags = abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES;
                    t.reply(ch, u, 0, &[&abi::open_out(fh, flags)]);
                }
            }
            Request::Release => {
                t.reply(ch, u, 0, &[]);
                if h.nodeid == FILE_ID {
                    let left = sh.opens.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
                    if left == 0 && sh.armed.load(Ordering::SeqCst) {
                        let _ = sh.events.send(Event::FileReleased);
                    }
                }
            }
            Request::Opendir => {
                if h.nodeid == ROOT_ID {
                    t.reply(ch, u, 0, &[&abi::open_out(0, 0)]);
                } else {
                    t.reply(ch, u, libc::ENOTDIR, &[]);
                }
            }
            Request::Readdir { offset, size } => {
                let entries: [(u64, u32, &[u8]); 3] = [
                    (ROOT_ID, libc::DT_DIR as u32, b"."),
                    (ROOT_ID, libc::DT_DIR as u32, b".."),
                    (FILE_ID, libc::DT_REG as u32, &sh.name),
                ];
                let d = abi::dirents(&entries, offset, size);
                t.reply(ch, u, 0, &[&d]);
            }
            Request::Releasedir | Request::Destroy => t.reply(ch, u, 0, &[]),
            Request::Statfs => {
                let bs = sh.block_size.max(512);
                t.reply(ch, u, 0, &[&abi::statfs_out(sh.size / bs as u64, bs)]);
            }
            Request::Read { offset, size } => {
                if offset >= sh.size || size == 0 {
                    t.reply(ch, u, 0, &[]); // end of file
                } else {
                    let len = (size as u64).min(sh.size - offset) as u32;
                    self.start(u, IoOp::new(BlockOp::Read, offset, len as u64), None);
                }
            }
            Request::Write { offset, data } => {
                let len = data.len() as u32;
                if sh.readonly {
                    t.reply(ch, u, libc::EROFS, &[]);
                } else if offset.checked_add(len as u64).is_none_or(|e| e > sh.size) {
                    t.reply(ch, u, libc::ENOSPC, &[]);
                } else if len == 0 {
                    t.reply(ch, u, 0, &[&abi::write_out(0)]);
                } else {
                    self.start(u, IoOp::new(BlockOp::Write, offset, len as u64), Some(buf));
                    return;
                }
            }
            Request::Fsync | Request::Flush => {
                if sh.readonly {
                    t.reply(ch, u, 0, &[]); // nothing can be dirty
                } else {
                    self.start(u, IoOp::new(BlockOp::Flush, 0, 0), None);
                }
            }
            Request::Fallocate {
                offset,
                length,
                mode,
            } => match fallocate_op(&sh, offset, length, mode) {
                Ok(Some(op)) => self.start(u, op, None),
                Ok(None) => t.reply(ch, u, 0, &[]),
                Err(errno) => t.reply(ch, u, errno, &[]),
            },
            Request::Init(_) => t.reply(ch, u, libc::EPROTO, &[]),
            // Replying ENOSYS to INTERRUPT tells the kernel not to send more: requests are
            // bounded by the timeout anyway.
            Request::Interrupt | Request::Unsupported(_) => t.reply(ch, u, libc::ENOSYS, &[]),
            Request::Forget => {}
        }
        // `buf` was not kept (only WRITE keeps it, and returns above).
        self.t.put_buf(buf);
    }

    /// Queues an I/O request. During an outage longer than the timeout a new request does not
    /// wait out the timeout again: it gets one fresh connection attempt, started now, and fails
    /// as soon as that attempt does (see `maintain`). A READ or WRITE that covers part of a
    /// logical block is split (partial.rs).
    fn start(&mut self, unique: u64, op: IoOp, buf: Option<Vec<u8>>) {
        let now = Instant::now();
        if let Link::Down(o) = &mut self.link {
            if o.attempt.is_none() {
                o.next_try = now;
            }
        }
        let p = Pending::new(unique, op, buf, self.t.block, now, now + self.sh.timeout);
        if !p.edges.is_empty() {
            self.partial += 1;
        }
        if self.t.insert(p).is_none() {
            // Cannot happen: reading stops when the table is full. Answer rather than hang.
            self.t.reply(&mut self.ch, unique, libc::EIO, &[]);
        }
    }

    /// Sends what can be sent.
    fn pump(&mut self) {
        let Link::Up(q) = &mut self.link else {
            return;
        };
        let now = Instant::now();
        // Requests that waited for a block's lock try again: one was released, or time passed.
        let waited = std::mem::take(&mut self.t.waiting);
        self.t.unsent.extend(waited);
        // Refused commands whose wait is over go again.
        let Table {
            retrying,
            slots,
            unsent,
            ..
        } = &mut self.t;
        retrying.retain(|&idx| match slots[idx].as_mut() {
            Some(p) if p.retry_at.is_some_and(|t| t <= now) => {
                p.retry_at = None;
                unsent.push_back(idx);
                false
            }
            Some(p) => p.retry_at.is_some(),
            None => false,
        });
        while let Some(&idx) = self.t.unsent.front() {
            let Some(p) = self.t.slots[idx].as_mut() else {
                self.t.unsent.pop_front();
                continue;
            };
            let stopped = p.replied || p.err != 0;
            let next = (!stopped).then(|| p.next_part(&self.t.locks, now));
            let Some((part, chunk)) = next.flatten() else {
                self.t.unsent.pop_front();
                if !stopped && p.waits_for_lock() && !self.t.waiting.contains(&idx) {
                    self.t.waiting.push(idx);
                }
                continue;
            };
            if q.in_flight() >= q.depth() {
                break;
            }
            match q.submit(p.cmd(part, chunk, self.t.block), tag(idx, part, chunk)) {
                Ok(()) => {
                    p.mark_sent(part, chunk);
                    p.outstanding += 1;
                    p.sent_at = now;
                }
                Err(e) => {
                    // Only a malformed command fails here; answer it rather than retry it.
                    log!("error", "queue {}: cannot send a request: {e}", self.id);
                    p.err = libc::EIO;
                    p.sent = p.chunks;
                    if p.outstanding == 0 {
                        let unique = p.unique;
                        self.t.reply(&mut self.ch, unique, libc::EIO, &[]);
                        self.t.remove(idx);
                    }
                }
            }
        }
    }

    /// Deadlines, connection health and reconnection.
    fn maintain(&mut self) {
        let now = Instant::now();
        let reconnects = self.sh.reconnects.load(Ordering::Relaxed);
        if let Link::Down(o) = &mut self.link {
            if let Some(a) = &o.attempt {
                match a.rx.try_recv() {
                    Ok(Ok(q)) => {
                        log!(
                            "info",
                            "queue {}: reconnected to {} after {:.1}s",
                            self.id,
                            self.sh.url,
                            o.since.elapsed().as_secs_f64()
                        );
                        self.sh.reconnects.fetch_add(1, Ordering::Relaxed);
                        self.link = Link::Up(q);
                        self.link_id += 1;
                        // The welcome fenced the queue given up (PROTOCOL.md §2.6): nothing sent
                        // on it runs any more. Changes held for that whose time is up are
                        // answered now; the others go again on the new connection.
                        for p in self.t.slots.iter_mut().flatten() {
                            p.unfenced = false;
                        }
                        self.fail_waiting(|p| now >= p.deadline);
                        return self.maintain();
                    }
                    Ok(Err(e)) => {
                        let started = a.started;
                        o.attempt = None;
                        o.attempts += 1;
                        if o.attempts == 1 || o.attempts % 30 == 0 {
                            log!(
                                "warn",
                                "queue {}: reconnecting to {} (attempt {}): {e}",
                                self.id,
                                self.sh.url,
                                o.attempts
                            );
                        }
                        o.next_try = now + o.backoff;
                        o.backoff = (o.backoff * 2).min(MAX_BACKOFF);
                        if now.duration_since(o.since) >= self.sh.timeout {
                            // A long outage: whoever arrived before this attempt started has
                            // had its fresh chance (see `start`), unless held for the fence.
                            let timeout = self.sh.timeout;
                            self.fail_waiting(|p| {
                                p.arrived <= started && !p.held(false, now, timeout)
                            });
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => {}
                    Err(mpsc::TryRecvError::Disconnected) => o.attempt = None,
                }
            }
            if let Link::Down(o) = &mut self.link {
                if o.attempt.is_none() && (now >= o.next_try || o.seen != reconnects) {
                    o.seen = reconnects;
                    o.attempt = spawn_attempt(&self.sh, self.id, &self.waker, o.replaces);
                    if o.attempt.is_none() {
                        o.next_try = now + o.backoff;
                    }
                }
            }
        }
        if now < self.next_tick {
            return;
        }
        self.next_tick = now + TICK;
        let timeout = self.sh.timeout;
        let fenceable = matches!(&self.link, Link::Up(q) if q.identity().is_some());
        // A connection is given up when it leaves a command unanswered for the whole timeout,
        // and at once when a change is held for the fence: the reconnection that fences its
        // queue, and so answers the change, starts now.
        let stuck = self.t.slots.iter().flatten().any(|p| {
            p.outstanding > 0
                && (now.duration_since(p.sent_at) >= timeout
                    || (now >= p.deadline && !p.replied && p.held(fenceable, now, timeout)))
        });
        self.fail_waiting(|p| now >= p.deadline && !p.held(fenceable, now, timeout));
        // At most one line per LOG_EVERY about failed requests, however many fail.
        if self.t.failed > 0
            && self
                .t
                .last_fail_log
                .is_none_or(|l| now.duration_since(l) >= LOG_EVERY)
        {
            self.t.last_fail_log = Some(now);
            log!(
                "warn",
                "queue {}: {} request(s) failed with EIO: {} unreachable or silent for {}s",
                self.id,
                self.t.failed,
                self.sh.url,
                self.sh.timeout.as_secs()
            );
            if self.t.unfenced_failed > 0 {
                let n = std::mem::take(&mut self.t.unfenced_failed);
                log!(
                    "warn",
                    "{}",
                    unfenced_line(self.id, n, &self.sh.url, timeout)
                );
            }
            self.t.failed = 0;
        }
        if stuck && matches!(self.link, Link::Up(_)) {
            self.link_down(&format!("no reply for {}s", self.sh.timeout.as_secs()));
        }
    }

    /// Takes the target's answers to what is in flight, for up to the session's timeout, on a
    /// worker that stops serving, sending nothing new; what is still out then is marked
    /// unfenced before `fail_waiting` answers it.
    fn settle_in_flight(&mut self) {
        let until = Instant::now() + self.sh.timeout;
        while self.in_flight() && Instant::now() < until {
            // Answers only: no `turn`, whose `pump` would send what answers queue (a retry, an
            // edge's write) and whose `maintain` would give the link up as for a reconnection.
            let Worker { link, t, ch, .. } = self;
            let Link::Up(q) = link else {
                break;
            };
            if q.poll(|c| t.on_completion(ch, c)).is_err() {
                break;
            }
            let wake = q.deadline().map_or(until, |d| d.min(until));
            let ms = wake
                .saturating_duration_since(Instant::now())
                .as_micros()
                .div_ceil(1000)
                .min(1000) as i32;
            let mut p = libc::pollfd {
                fd: q.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on the queue's socket; an error only ends the wait early.
            unsafe { libc::poll(&mut p, 1, ms) };
        }
        // Nothing more is sent: what waits to go (or to go again) is answered by the caller.
        self.t.unsent.clear();
        self.t.waiting.clear();
        self.t.retrying.clear();
        if self.in_flight() {
            // Still out: may still run at the target, though answered EIO (logged as
            // unfenced); the link is left without the final flush, which would wait for them.
            let fenceable = matches!(&self.link, Link::Up(q) if q.identity().is_some());
            for p in self.t.slots.iter_mut().flatten() {
                p.unfenced |= fenceable && p.op.op.modifies() && p.outstanding > 0;
            }
            self.link = Link::Down(Outage::new(0, None));
        }
    }

    /// Answers EIO to every unanswered request `which` selects.
    fn fail_waiting(&mut self, which: impl Fn(&Pending) -> bool) {
        for idx in 0..self.t.slots.len() {
            let Some(p) = self.t.slots[idx].as_mut() else {
                continue;
            };
            if p.replied || !which(p) {
                continue;
            }
            p.replied = true;
            let (unique, idle) = (p.unique, p.outstanding == 0);
            self.t.failed += 1;
            self.t.unfenced_failed += p.unfenced as u64;
            self.t.reply(&mut self.ch, unique, libc::EIO, &[]);
            if idle {
                self.t.remove(idx);
            }
        }
    }

    /// Drops the connection; every unanswered request will be sent again on the next one.
    fn link_down(&mut self, why: &str) {
        let replaces = match &self.link {
            Link::Up(q) => q.identity(),
            Link::Down(o) => o.replaces,
        };
        if let Link::Up(_) = self.link {
            let held = held_writes_wait(replaces.is_some(), self.sh.timeout);
            log!(
                "warn",
                "queue {}: connection to {} lost ({why}); reconnecting, I/O waits up to {}s{held}",
                self.id,
                self.sh.url,
                self.sh.timeout.as_secs()
            );
        }
        self.link = Link::Down(Outage::new(
            self.sh.reconnects.load(Ordering::Relaxed),
            replaces,
        ));
        self.t.unsent.clear();
        self.t.waiting.clear();
        self.t.retrying.clear();
        let fenceable = replaces.is_some();
        for idx in 0..self.t.slots.len() {
            let Some(p) = self.t.slots[idx].as_mut() else {
                continue;
            };
            if p.replied {
                // Already answered; its commands died with the connection.
                self.t.remove(idx);
            } else {
                // Its changes in flight may still run at the target until the queue is fenced.
                p.unfenced |= fenceable && p.op.op.modifies() && p.outstanding > 0;
                p.sent = 0;
                p.redo.clear();
                p.retry_at = None;
                p.outstanding = 0;
                p.err = 0;
                // An edge keeps its lock and sends its command again.
                for e in &mut p.edges {
                    e.step = e.step.again();
                }
                self.t.unsent.push_back(idx);
            }
        }
    }
}

impl Worker<Channel> {
    fn serve_read(&mut self) -> Result<(), String> {
        loop {
            if self.t.fuse_gone {
                return Ok(());
            }
            let up = matches!(self.link, Link::Up(_));
            if self.t.live == 0 && up && self.wait_limit().is_none() {
                // Nothing in flight and no timer (TCP): sleep in read(), where the kernel wakes
                // exactly one of the waiting workers per request (poll() would wake them all).
                // A datagram queue always has a timer (its keepalive) and sleeps in poll().
                self.set_nonblocking(false)?;
                if let Got::Gone = self.read_one()? {
                    return Ok(());
                }
            }
            self.set_nonblocking(true)?;
            let mut got = 0;
            while self.t.live < self.cap && !self.t.fuse_gone {
                match self.read_one()? {
                    Got::Request => got += 1,
                    Got::Empty => break,
                    Got::Gone => return Ok(()),
                }
            }
            // Send what came, take what the target has answered; then sleep until either side
            // has something (new requests are read while answers are outstanding).
            if self.turn() == 0 && got == 0 && !self.spin_read() {
                self.wait(self.wait_limit())?;
            }
        }
    }

    /// With answers outstanding, spins briefly for an answer or a request; true if one came.
    fn spin_read(&mut self) -> bool {
        let Some((_, sock)) = self.sock().filter(|_| self.in_flight()) else {
            return false;
        };
        if self.poll_now() {
            return true;
        }
        let dev = if self.t.live < self.cap {
            self.ch.as_raw_fd()
        } else {
            -1
        };
        self.spin.spin(|| readable([sock, dev]))
    }

    /// Waits for a request (while the table has room), an answer from the target, the end of
    /// a reconnection attempt, or `limit`.
    fn wait(&self, limit: Option<Duration>) -> Result<(), String> {
        let fd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut p = [fd(self.waker.fd()), fd(-1), fd(-1)];
        if let Some((_, s)) = self.sock() {
            p[1].fd = s;
        }
        // A full table takes no request: /dev/fuse would only wake us again and again.
        if self.t.live < self.cap {
            p[2].fd = self.ch.as_raw_fd();
        }
        // Rounded up: a timer less than a millisecond away must not become a busy loop.
        let ms = limit.map_or(-1, |d| {
            d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        });
        // SAFETY: poll on three pollfds of ours (negative descriptors are ignored).
        let n = unsafe { libc::poll(p.as_mut_ptr(), 3, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(format!("polling /dev/fuse: {e}"));
            }
        }
        if p[0].revents != 0 {
            self.waker.clear();
        }
        Ok(())
    }

    fn set_nonblocking(&mut self, on: bool) -> Result<(), String> {
        self.ch
            .set_nonblocking(on)
            .map_err(|e| format!("/dev/fuse: {e}"))
    }
}

impl Worker<Ring> {
    /// FUSE over io_uring: requests arrive as completions of this worker's ring entries and
    /// are answered by committing the entry; the ring also reports /dev/fuse turning readable
    /// (FORGET, INTERRUPT), the queue's socket turning readable and the end of a reconnection
    /// attempt, and times out at the queue's next timer, so the thread sleeps in one place.
    fn serve_ring(&mut self) -> Result<(), String> {
        let r = self.ch.start();
        let _ = self.sh.events.send(Event::Registered {
            id: self.id,
            error: r.as_ref().err().cloned(),
        });
        r?;
        loop {
            self.ch.reap();
            let mut got = 0;
            loop {
                let mut buf = self.t.take_buf();
                match self.ch.next_request(&mut buf) {
                    None => {
                        self.t.put_buf(buf);
                        break;
                    }
                    Some(Ok(n)) => {
                        self.via_ring += 1;
                        self.dispatch(buf, n);
                    }
                    Some(Err(unique)) => {
                        log!(
                            "error",
                            "malformed request {unique} from the kernel's FUSE ring"
                        );
                        self.t.put_buf(buf);
                        self.t.reply(&mut self.ch, unique, libc::EIO, &[]);
                    }
                }
                got += 1;
            }
            if self.ch.take_readable() {
                while self.t.live < self.cap && !self.t.fuse_gone {
                    match self.read_one()? {
                        Got::Request => got += 1,
                        Got::Empty => break,
                        Got::Gone => self.t.fuse_gone = true,
                    }
                }
            }
            if self.t.fuse_gone || self.ch.dead() {
                return Ok(());
            }
            let answered = self.turn();
            let (room, sock) = (self.t.live < self.cap, self.sock());
            self.ch
                .rearm(room, sock)
                .map_err(|e| format!("io_uring: {e}"))?;
            if answered > 0 || got > 0 {
                // Commits of the answers that just came; then look for more before sleeping.
                self.ch.submit()?;
            } else if !self.spin_ring()? {
                self.ch.wait(self.wait_limit())?;
            }
        }
    }
}

impl Worker<Ring> {
    /// With answers outstanding, submits what is queued and spins briefly for an answer or a
    /// ring completion; true if one came.
    fn spin_ring(&mut self) -> Result<bool, String> {
        let Some((_, sock)) = self.sock().filter(|_| self.in_flight()) else {
            return Ok(false);
        };
        self.ch.submit()?;
        if self.poll_now() {
            return Ok(true);
        }
        let ch = &mut self.ch;
        // The poll(2) call also lets the kernel run the ring's pending task work.
        Ok(self.spin.spin(|| readable([sock]) || ch.has_completions()))
    }
}

/// What a FALLOCATE means for a fixed-size file that is a block device: None = nothing to do.
fn fallocate_op(sh: &Shared, offset: u64, length: u64, mode: u32) -> Result<Option<IoOp>, i32> {
    const KEEP_SIZE: u32 = libc::FALLOC_FL_KEEP_SIZE as u32;
    const PUNCH_HOLE: u32 = libc::FALLOC_FL_PUNCH_HOLE as u32;
    const ZERO_RANGE: u32 = libc::FALLOC_FL_ZERO_RANGE as u32;
    if sh.readonly {
        return Err(libc::EROFS);
    }
    if mode & !(KEEP_SIZE | PUNCH_HOLE | ZERO_RANGE) != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if mode & (PUNCH_HOLE | ZERO_RANGE) != 0 && !sh.write_zeroes {
        // The loop device offers discard and write-zeroes for any file that has fallocate.
        // Refused so, the block layer treats the request as unsupported, not failed: a discard
        // is reported done (it is advisory) and zeroing falls back to writing zeros, instead of
        // failing with EIO after a round trip to a target that lacks the command. Recent loop
        // drivers also stop offering the one refused; older ones keep sending it, each refused
        // here at no cost. (Turning discard off in sysfs instead would outlive the mapping: the
        // loop device keeps that limit for its next user.)
        return Err(libc::EOPNOTSUPP);
    }
    let end = offset.checked_add(length).ok_or(libc::EINVAL)?;
    if mode & KEEP_SIZE == 0 && end > sh.size {
        return Err(libc::EFBIG); // the file cannot grow
    }
    let end = end.min(sh.size);
    if offset >= end {
        return Ok(None);
    }
    let len = end - offset;
    if mode & PUNCH_HOLE != 0 {
        // The loop driver punches holes both for DISCARD and for WRITE_ZEROES that may unmap,
        // and a punched range must read back as zeros. TRIM does not promise that
        // (PROTOCOL.md §3), WRITE_ZEROES does, and may still deallocate (no NO_HOLE).
        Ok(Some(IoOp::zeroes(offset, len, sh.zero_step)))
    } else if mode & ZERO_RANGE != 0 {
        // Zeroing that must keep the range allocated (the loop driver's REQ_NOUNMAP).
        let mut op = IoOp::zeroes(offset, len, sh.zero_step);
        op.flags = IoFlags::NO_HOLE;
        Ok(Some(op))
    } else {
        Ok(None) // plain allocation: every byte of an export already exists
    }
}

/// Starts a reconnection in its own thread so the worker keeps answering (and timing out)
/// requests while a connect to an unreachable host takes its time.
fn spawn_attempt(
    sh: &Arc<Shared>,
    id: usize,
    waker: &Arc<Waker>,
    replaces: Option<QueueRef>,
) -> Option<Attempt> {
    let (tx, rx) = mpsc::channel();
    let waker = Arc::clone(waker);
    let url = sh.url.clone();
    let opts = ConnectOptions {
        replaces,
        ..sh.reconnect.clone()
    };
    let needs = sh.needs;
    std::thread::Builder::new()
        .name(format!("blkwire-reconnect-{id}"))
        .spawn(move || {
            let _ = tx.send(needs.reconnect(&url, &opts));
            Waker::wake(waker.fd());
        })
        .ok()?;
    Some(Attempt {
        rx,
        started: Instant::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(size: u64, readonly: bool) -> Shared {
        let a = Attr {
            ino: FILE_ID,
            size,
            mode: 0,
            nlink: 1,
            blksize: 4096,
            time: 0,
        };
        Shared {
            url: Url::parse("tcp://127.0.0.1:1/x").unwrap(),
            reconnect: ConnectOptions::default(),
            size,
            readonly,
            write_zeroes: true,
            zero_step: blkwire_client::MAX_RANGE,
            name: b"x".to_vec(),
            root: a,
            file: a,
            block_size: 4096,
            timeout: Duration::from_secs(1),
            max_io: 1 << 20,
            needs: Needs {
                size,
                logical_block: 512,
                max_io: 1 << 20,
                depth: 1,
                writable: !readonly,
                volatile_cache: true,
            },
            events: mpsc::channel().0,
            opens: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            reconnects: AtomicU64::new(0),
            locks: Arc::default(),
        }
    }

    #[test]
    fn fallocate_maps_punch_to_zeroes_that_may_unmap() {
        let sh = shared(1 << 30, false);
        let keep = libc::FALLOC_FL_KEEP_SIZE as u32;
        let punch = libc::FALLOC_FL_PUNCH_HOLE as u32 | keep;
        let zero = libc::FALLOC_FL_ZERO_RANGE as u32 | keep;
        assert_eq!(
            fallocate_op(&sh, 4096, 8192, punch),
            Ok(Some(IoOp::new(BlockOp::WriteZeroes, 4096, 8192)))
        );
        let mut nounmap = IoOp::new(BlockOp::WriteZeroes, 0, 4096);
        nounmap.flags = IoFlags::NO_HOLE;
        assert_eq!(fallocate_op(&sh, 0, 4096, zero), Ok(Some(nounmap)));
        // Clamped at the end of the file; nothing to do beyond it.
        assert_eq!(
            fallocate_op(&sh, (1 << 30) - 4096, 1 << 20, punch),
            Ok(Some(IoOp::new(
                BlockOp::WriteZeroes,
                (1 << 30) - 4096,
                4096
            )))
        );
        assert!(matches!(fallocate_op(&sh, 1 << 30, 4096, punch), Ok(None)));
        assert!(matches!(fallocate_op(&sh, 0, 4096, 0), Ok(None)));
        assert_eq!(fallocate_op(&sh, 0, 2 << 30, 0).err(), Some(libc::EFBIG));
        assert_eq!(
            fallocate_op(&sh, u64::MAX, 2, keep).err(),
            Some(libc::EINVAL)
        );
        assert_eq!(
            fallocate_op(&sh, 0, 1, libc::FALLOC_FL_COLLAPSE_RANGE as u32).err(),
            Some(libc::EOPNOTSUPP)
        );
        assert_eq!(
            fallocate_op(&shared(1 << 20, true), 0, 1, punch).err(),
            Some(libc::EROFS)
        );
    }

    /// An export without WRITE_ZEROES gets no zeroing FALLOCATE: it is refused at once with
    /// EOPNOTSUPP (unsupported to the block layer, and to recent loop drivers a cue to stop
    /// offering it), not sent to fail there.
    #[test]
    fn fallocate_zeroing_is_not_supported_without_write_zeroes() {
        let sh = Shared {
            write_zeroes: false,
            ..shared(1 << 30, false)
        };
        let keep = libc::FALLOC_FL_KEEP_SIZE as u32;
        for mode in [libc::FALLOC_FL_PUNCH_HOLE, libc::FALLOC_FL_ZERO_RANGE] {
            assert_eq!(
                fallocate_op(&sh, 4096, 8192, mode as u32 | keep),
                Err(libc::EOPNOTSUPP),
                "mode {mode:#x}"
            );
        }
        // Plain allocation needs no command: still nothing to do.
        assert_eq!(fallocate_op(&sh, 0, 4096, 0), Ok(None));
    }

    /// The give-up fence (PROTOCOL.md §2.6): past its deadline, a change with commands that
    /// may still run at the target waits for the fence, up to one more timeout; reads, flushes
    /// and changes with nothing out do not, nor do commands in flight on a connection that cannot
    /// be fenced (nvme-tcp://).
    #[test]
    fn a_change_the_target_may_still_run_is_held_for_the_fence_up_to_one_more_timeout() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(5);
        let pending = |op: BlockOp, outstanding: u32, unfenced: bool| {
            let mut p = Pending::new(1, IoOp::new(op, 0, 4096), None, 512, t0, t0 + timeout);
            (p.outstanding, p.unfenced) = (outstanding, unfenced);
            p
        };
        let at_deadline = t0 + timeout;
        let last = t0 + timeout * 2 - Duration::from_millis(1);
        for op in [BlockOp::Write, BlockOp::Trim, BlockOp::WriteZeroes] {
            assert!(
                pending(op, 1, false).held(true, at_deadline, timeout),
                "{op:?}"
            );
            assert!(
                !pending(op, 1, false).held(false, at_deadline, timeout),
                "{op:?}"
            );
            assert!(
                !pending(op, 0, false).held(true, at_deadline, timeout),
                "{op:?}"
            );
            // Given up with commands out: held while disconnected, until one more timeout.
            assert!(pending(op, 0, true).held(false, last, timeout), "{op:?}");
            assert!(!pending(op, 0, true).held(false, t0 + timeout * 2, timeout));
        }
        for op in [BlockOp::Read, BlockOp::Flush] {
            assert!(
                !pending(op, 1, false).held(true, at_deadline, timeout),
                "{op:?}"
            );
        }
    }

    /// A transport that only records replies (the table's tests need no kernel).
    #[derive(Default)]
    struct Replies(Vec<(u64, i32, Vec<u8>)>);

    impl Transport for Replies {
        fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) -> std::io::Result<()> {
            self.0.push((unique, errno, parts.concat()));
            Ok(())
        }
        fn channel(&self) -> &Channel {
            unreachable!("no /dev/fuse in the table's tests")
        }
        fn serve(_: &mut Worker<Self>) -> Result<(), String> {
            unreachable!("no worker in the table's tests")
        }
    }

    #[test]
    fn a_zero_range_failed_before_all_its_chunks_went_leaves_the_table() {
        let mut t = Table::new(4, 4096, 512, Arc::default());
        let now = Instant::now();
        // 3 GiB of zeroes: 3 chunks, one sent and still out when the request was answered EIO
        // at its deadline (`fail_waiting`), so the other two will never be sent.
        let op = IoOp::new(BlockOp::WriteZeroes, 0, 3 << 30);
        let mut p = Pending::new(7, op, None, 512, now, now);
        (p.sent, p.outstanding, p.replied) = (1, 1, true);
        let idx = t.insert(p).unwrap();
        assert_eq!(op.chunks(), 3);
        let mut ch = Replies::default();
        let done = |status| Completion {
            user: tag(idx, 0, 0),
            length: 0,
            status,
            data: &[],
        };
        t.on_completion(&mut ch, done(Status::Ok));
        assert_eq!(t.live, 0, "the slot leaked");
        assert_eq!(t.free.len(), 4);
        // It was answered already: no second reply.
        assert!(ch.0.is_empty());
    }

    fn done(idx: usize, part: usize, data: &[u8]) -> Completion<'_> {
        Completion {
            user: tag(idx, part, 0),
            length: data.len() as u32,
            status: Status::Ok,
            data,
        }
    }

    /// The command `p` sends next, marked sent: (part, offset, length, data written).
    fn send(p: &mut Pending, locks: &BlockLocks) -> Option<Sent> {
        send_at(p, locks, Instant::now()).map(|(c, _)| c)
    }

    /// A command as `send` returns it: (part, offset, length, data written).
    type Sent = (usize, u64, u32, Vec<u8>);

    /// As `send`, at `now`, with the command's chunk.
    fn send_at(p: &mut Pending, locks: &BlockLocks, now: Instant) -> Option<(Sent, u32)> {
        let (part, chunk) = p.next_part(locks, now)?;
        let c = match p.cmd(part, chunk, 4096) {
            Cmd::Read { offset, len } => (part, offset, len, Vec::new()),
            Cmd::Write { offset, data, .. } => (part, offset, data.len() as u32, data.to_vec()),
            Cmd::WriteZeroes { offset, len, .. } => (part, offset, len, Vec::new()),
            _ => panic!("not a read, write or zeroing"),
        };
        p.mark_sent(part, chunk);
        p.outstanding += 1;
        Some((c, chunk))
    }

    /// A command the target refused for want of memory (it ran nothing and says to retry) is
    /// sent again after a short wait, not answered with an error (ENOMEM would fail the loop
    /// device's bio, and a filesystem would take it for a broken disk): a chunk of a zeroing,
    /// and an edge's read of a partial write, each as it was.
    #[test]
    fn a_command_refused_for_want_of_memory_is_sent_again() {
        const B: usize = 4096;
        let locks = Arc::new(BlockLocks::default());
        let mut t = Table::new(4, 1 << 20, B as u32, Arc::clone(&locks));
        let now = Instant::now();
        let refused = |idx, part, chunk| Completion {
            user: tag(idx, part, chunk),
            length: 0,
            status: Status::NoMemory,
            data: &[],
        };
        let ok = |idx, part, chunk| Completion {
            user: tag(idx, part, chunk),
            length: 0,
            status: Status::Ok,
            data: &[],
        };
        // Zeroes in three chunks; the second is refused.
        let mut op = IoOp::zeroes(0, 3 << 20, 1 << 20);
        op.flags = IoFlags::empty();
        let mut p = Pending::new(3, op, None, B as u32, now, now + Duration::from_secs(9));
        let sent: Vec<_> = (0..3)
            .map(|_| send_at(&mut p, &locks, now).unwrap())
            .collect();
        assert_eq!(sent.iter().map(|s| s.1).collect::<Vec<_>>(), [0, 1, 2]);
        let idx = t.insert(p).unwrap();
        t.unsent.clear();
        let mut ch = Replies::default();
        t.on_completion(&mut ch, ok(idx, 0, 0));
        t.on_completion(&mut ch, refused(idx, 0, 1));
        t.on_completion(&mut ch, ok(idx, 0, 2));
        assert!(ch.0.is_empty(), "answered: {:?}", ch.0);
        assert_eq!(t.retrying, [idx]);
        let p = t.slots[idx].as_mut().unwrap();
        assert_eq!(send_at(p, &locks, now), None, "sent again at once");
        // The wait runs from the refusal.
        let later = Instant::now() + RETRY_AFTER;
        let again = send_at(p, &locks, later).unwrap();
        assert_eq!(again, ((0, 1 << 20, 1 << 20, Vec::new()), 1));
        assert_eq!(send_at(p, &locks, later), None, "and only it");
        t.on_completion(&mut ch, ok(idx, 0, 1));
        assert_eq!(ch.0, [(3, 0, Vec::new())]);
        assert_eq!(t.live, 0);

        // A write over part of block 1: its edge's read is refused, then read again.
        let data = common_bytes(512);
        let mut p = write_into_block_1(4, &data, now);
        assert_eq!(send(&mut p, &locks), Some((1, B as u64, B as u32, vec![])));
        let idx = t.insert(p).unwrap();
        t.unsent.clear();
        t.on_completion(&mut ch, refused(idx, 1, 0));
        let p = t.slots[idx].as_mut().unwrap();
        assert!(!locks.try_take(B as u64), "the edge keeps its lock");
        assert_eq!(send_at(p, &locks, now), None);
        let read = send_at(p, &locks, Instant::now() + RETRY_AFTER).unwrap().0;
        assert_eq!(read, (1, B as u64, B as u32, vec![]));
        let old = vec![0xaa; B];
        t.on_completion(&mut ch, done(idx, 1, &old));
        let p = t.slots[idx].as_mut().unwrap();
        let mut merged = old.clone();
        merged[..512].copy_from_slice(&data);
        assert_eq!(send(p, &locks), Some((1, B as u64, B as u32, merged)));
        t.on_completion(&mut ch, done(idx, 1, &[]));
        assert_eq!(ch.0[1], (4, 0, abi::write_out(512).to_vec()));
        assert!(locks.try_take(B as u64), "the lock was released");
    }

    #[test]
    fn a_write_over_part_of_a_block_merges_it_under_the_blocks_lock() {
        const B: usize = 4096;
        let locks = Arc::new(BlockLocks::default());
        let mut t = Table::new(4, 1 << 20, B as u32, Arc::clone(&locks));
        let now = Instant::now();
        // The last 512 bytes of block 1 and all of block 2, as FUSE cuts a request from a
        // buffer 512 bytes into a page.
        let data = common_bytes(512 + B);
        let mut buf = vec![0u8; WRITE_DATA_AT];
        buf.extend_from_slice(&data);
        let op = IoOp::new(BlockOp::Write, 2 * B as u64 - 512, data.len() as u64);
        let mut p = Pending::new(
            9,
            op,
            Some(buf),
            B as u32,
            now,
            now + Duration::from_secs(9),
        );
        // The edge first: it takes the lock and reads the block; then the whole block.
        assert_eq!(send(&mut p, &locks), Some((1, B as u64, B as u32, vec![])));
        assert!(!locks.try_take(B as u64), "the edge holds block 1");
        assert_eq!(
            send(&mut p, &locks),
            Some((0, 2 * B as u64, B as u32, data[512..].to_vec()))
        );
        assert_eq!(send(&mut p, &locks), None);
        // Another request over block 1 waits for the lock.
        let op2 = IoOp::new(BlockOp::Write, B as u64, 512);
        let mut other = Pending::new(
            10,
            op2,
            Some(vec![0u8; WRITE_DATA_AT + 512]),
            4096,
            now,
            now,
        );
        assert_eq!(other.next_part(&locks, now), None);
        assert!(other.waits_for_lock());
        let idx = t.insert(p).unwrap();
        t.unsent.clear();
        let mut ch = Replies::default();
        // The block as it was: the request's bytes go into its last 512.
        let old = vec![0xaa; B];
        t.on_completion(&mut ch, done(idx, 1, &old));
        assert_eq!(
            t.unsent.back(),
            Some(&idx),
            "the merged block is to be written"
        );
        let p = t.slots[idx].as_mut().unwrap();
        let mut merged = old.clone();
        merged[B - 512..].copy_from_slice(&data[..512]);
        assert_eq!(send(p, &locks), Some((1, B as u64, B as u32, merged)));
        t.on_completion(&mut ch, done(idx, 0, &[]));
        assert!(ch.0.is_empty(), "answered before its edge was written");
        t.on_completion(&mut ch, done(idx, 1, &[]));
        assert_eq!(ch.0, [(9, 0, abi::write_out(data.len() as u32).to_vec())]);
        assert_eq!(t.live, 0);
        assert_eq!(
            other.next_part(&locks, now),
            Some((1, 0)),
            "the lock was released"
        );
    }

    /// Request `unique`: a WRITE of `data` (less than a block) at the start of 4 KiB block 1,
    /// read at `now`, due 9 s later.
    fn write_into_block_1(unique: u64, data: &[u8], now: Instant) -> Pending {
        let mut buf = vec![0u8; WRITE_DATA_AT];
        buf.extend_from_slice(data);
        let op = IoOp::new(BlockOp::Write, 4096, data.len() as u64);
        Pending::new(
            unique,
            op,
            Some(buf),
            4096,
            now,
            now + Duration::from_secs(9),
        )
    }

    /// A worker that stops with a partial-block write in its table lets the block's lock go:
    /// the other workers' writes to that block do not wait for it for the rest of the mapping.
    #[test]
    fn a_stopped_worker_leaves_no_block_locked() {
        const B: usize = 4096;
        let locks = Arc::new(BlockLocks::default());
        let mut t = Table::new(4, 1 << 20, B as u32, Arc::clone(&locks));
        let mut p = write_into_block_1(4, &[0; 512], Instant::now());
        assert_eq!(send(&mut p, &locks), Some((1, B as u64, B as u32, vec![])));
        t.insert(p).unwrap();
        assert!(!locks.try_take(B as u64), "the edge holds block 1");
        drop(t);
        assert!(locks.try_take(B as u64), "the lock was released");
    }

    #[test]
    fn a_read_over_parts_of_blocks_gathers_them() {
        const B: usize = 4096;
        let locks = Arc::new(BlockLocks::default());
        let mut t = Table::new(4, 1 << 20, B as u32, Arc::clone(&locks));
        let now = Instant::now();
        // The last 512 bytes of block 0, block 1, the first 3584 bytes of block 2.
        let op = IoOp::new(BlockOp::Read, B as u64 - 512, 2 * B as u64);
        let mut p = Pending::new(5, op, None, B as u32, now, now + Duration::from_secs(9));
        assert_eq!(send(&mut p, &locks), Some((1, 0, B as u32, vec![])));
        assert_eq!(
            send(&mut p, &locks),
            Some((2, 2 * B as u64, B as u32, vec![]))
        );
        assert_eq!(send(&mut p, &locks), Some((0, B as u64, B as u32, vec![])));
        assert_eq!(send(&mut p, &locks), None);
        let idx = t.insert(p).unwrap();
        let disk = common_bytes(3 * B);
        let mut ch = Replies::default();
        t.on_completion(&mut ch, done(idx, 2, &disk[2 * B..]));
        t.on_completion(&mut ch, done(idx, 0, &disk[B..2 * B]));
        t.on_completion(&mut ch, done(idx, 1, &disk[..B]));
        assert_eq!(ch.0, [(5, 0, disk[B - 512..3 * B - 512].to_vec())]);
        assert!(locks.try_take(0), "a read takes no lock");
    }

    fn common_bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    /// Zeroing is split at the session's `max_range`: 1 GiB natively (a 32-bit length),
    /// 65536 blocks over NVMe/TCP (a 16-bit block count), each command within it and the
    /// pieces covering the range end to end.
    #[test]
    fn large_zero_ranges_split_at_the_sessions_range() {
        let punch = libc::FALLOC_FL_PUNCH_HOLE as u32 | libc::FALLOC_FL_KEEP_SIZE as u32;
        for (step, len, chunks) in [
            (blkwire_client::MAX_RANGE, (5 << 30) + 4096, 6),
            (65536 * 512, 1 << 30, 32),
        ] {
            let sh = Shared {
                zero_step: step,
                ..shared(8 << 30, false)
            };
            let op = fallocate_op(&sh, 512, len, punch).unwrap().unwrap();
            assert_eq!(op.chunks(), chunks, "step {step}");
            let mut total = 0u64;
            for i in 0..op.chunks() {
                match op.cmd(i, &[]) {
                    Cmd::WriteZeroes { offset, len, .. } => {
                        assert_eq!(offset, 512 + total);
                        assert!(len <= step);
                        total += len as u64;
                    }
                    _ => panic!("not a write-zeroes"),
                }
            }
            assert_eq!(total, len);
        }
    }
}
