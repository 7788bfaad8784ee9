//! One ublk queue's thread: its own io_uring and blkwire `Queue`. It maps the queue's I/O
//! descriptor array (read-only) from /dev/ublkcN, sends FETCH_REQ for every tag with that tag's
//! buffer, and answers each request with COMMIT_AND_FETCH_REQ.
//!
//! The thread never blocks on the target: when the connection breaks, its requests wait in
//! their slots while one reconnection at a time runs in a thread of its own (`Outage`), whose end
//! wakes the ring through an eventfd; meanwhile answers that did arrive are committed and every
//! request still fails with EIO at its own deadline, except a change of the export the target may
//! still be running then: that one waits for the give-up fence (`Slot::holds_for_fence`).

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use blkwire_client::{
    BlockOp, BlockRequest, Cmd, Completion, ConnectOptions, Queue, QueueRef, Url,
};
use blkwire_spin::{readable, AdaptiveSpin};
use blkwire_wire::Status;
use io_uring::{opcode, squeue, types, IoUring};

use super::abi::*;
use crate::device::{held_writes_wait, unfenced_line, Needs};
use crate::log;
use crate::sockpoll::SockPoll;
use crate::state::RecordBook;
use crate::sys::Waker;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How long a request the target refused for want of memory waits before it is sent again
/// (NO_MEMORY, NVMe's Command Interrupted: the target ran nothing and says to retry).
const RETRY_AFTER: Duration = Duration::from_millis(10);
/// At most one log line per this long about requests failed with EIO, however many fail.
const LOG_EVERY: Duration = Duration::from_secs(5);
/// user_data of the poll on the reconnection eventfd: tags are below `UBLK_MAX_QUEUE_DEPTH`,
/// and `SockPoll`'s have bit 62 set and bit 63 clear.
const WAKE: u64 = u64::MAX;

pub(crate) enum QEvent {
    /// Every tag of the queue is fetched (or setting up failed).
    Fetched(usize, Result<(), String>),
    Exited(usize, Option<String>),
    Signal(i32),
}

struct Slot {
    op: Option<BlockRequest>,
    /// Sent to the target and not answered yet.
    sent: bool,
    /// When the request was taken from the ring.
    arrived: Instant,
    /// When the request must be answered (`--timeout` after it arrived), with EIO if the target
    /// has not answered it by then (a change held for the fence: see `due_at`).
    deadline: Instant,
    /// A change of the export sent on a connection given up since, whose queue has not been
    /// fenced yet (PROTOCOL.md §2.6): the target may still run it. Set only when that queue
    /// has an identity to be fenced by; cleared when a reconnection naming it is welcomed.
    unfenced: bool,
    /// Refused for want of memory at the target (which ran nothing): sent again then, or
    /// answered EIO at its deadline.
    retry_at: Option<Instant>,
}

/// What a target's answer to a tag's request means for the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// Committed with this result: bytes, 0, or a negative errno.
    Commit(i32),
    /// Sent again after `RETRY_AFTER` (`Slot::retry_at`).
    Retry,
}

impl Slot {
    /// When the request is next due at `expire`: its deadline, or, for a change the target may
    /// still run unfenced, one `timeout` after it (then it is answered EIO unfenced).
    fn due_at(&self, timeout: Duration) -> Instant {
        if self.unfenced {
            self.deadline + timeout
        } else {
            self.deadline
        }
    }

    /// Whether, due, it waits for the give-up fence rather than fail: a change of the export
    /// in flight on a connection with an identity (`fenceable`). The connection is then given
    /// up, which makes it `unfenced`, and it is answered once a reconnection naming the queue is
    /// welcomed (the target's word that it will not land later) or at its `due_at`. Failed
    /// now, a rewrite of its blocks through any queue could be overtaken by it.
    fn holds_for_fence(&self, fenceable: bool) -> bool {
        fenceable && self.sent && !self.unfenced && self.op.is_some_and(|op| op.op.modifies())
    }
}

/// Tags whose request is due at `now` (`Slot::due_at`).
fn expired(slots: &[Slot], now: Instant, timeout: Duration) -> impl Iterator<Item = usize> + '_ {
    slots
        .iter()
        .enumerate()
        .filter(move |(_, s)| s.op.is_some() && now >= s.due_at(timeout))
        .map(|(tag, _)| tag)
}

/// Requests that arrived by `t` and wait (nothing is in flight while disconnected), but for
/// changes the target may still run: those wait for the fence (`Slot::due_at`).
fn arrived_by(slots: &[Slot], t: Instant) -> impl Iterator<Item = usize> + '_ {
    slots
        .iter()
        .enumerate()
        .filter(move |(_, s)| s.op.is_some() && s.arrived <= t && !s.unfenced)
        .map(|(tag, _)| tag)
}

/// Of the requests refused for want of memory (`waiting`), those due to be sent again at
/// `now` (before their deadline: after it they are `expire`'s); `waiting` keeps the others
/// still waiting, and forgets those answered or sent again since (no `retry_at`).
fn retries_due(slots: &[Slot], waiting: &mut Vec<usize>, now: Instant) -> Vec<usize> {
    let mut due = Vec::new();
    waiting.retain(|&tag| {
        let s = &slots[tag];
        match s.retry_at.filter(|_| s.op.is_some()) {
            None => false,
            Some(at) if at <= now && at < s.deadline => {
                due.push(tag);
                false
            }
            Some(_) => true,
        }
    });
    due
}

/// When the first of the requests refused for want of memory (`waiting`) is due to be sent
/// again, before its deadline; None while the link is down (`linked` false): the thread
/// must not wake for a retry it cannot send (a past one would make it spin).
fn next_retry(slots: &[Slot], waiting: &[usize], linked: bool) -> Option<Instant> {
    if !linked {
        return None;
    }
    waiting
        .iter()
        .map(|&tag| &slots[tag])
        .filter_map(|s| s.retry_at.filter(|&t| t < s.deadline))
        .min()
}

/// When the next request is due, if any request waits.
fn next_deadline(slots: &[Slot], timeout: Duration) -> Option<Instant> {
    slots
        .iter()
        .filter(|s| s.op.is_some())
        .map(|s| s.due_at(timeout))
        .min()
}

/// A queue whose connection is down: when to start the next reconnection attempt (one at a
/// time, backoff 0.1 s doubling to 1 s) and which waiting requests a failed one fails. Pure: the
/// caller gives the time and runs the attempts, so this is tested without a ublk device.
///
/// Requests wait up to their own deadline. Once the outage is older than the timeout, though,
/// a new request does not wait out the timeout again: it gets one fresh attempt, started when it
/// arrives, and fails as soon as that attempt does (as the fuse frontend's workers do).
struct Outage {
    since: Instant,
    next_try: Instant,
    backoff: Duration,
    /// When the running attempt started.
    running: Option<Instant>,
    /// Failed attempts, for the log.
    attempts: u32,
}

impl Outage {
    fn new(now: Instant) -> Outage {
        Outage {
            since: now,
            next_try: now,
            backoff: FIRST_BACKOFF,
            running: None,
            attempts: 0,
        }
    }

    /// Whether an attempt starts at `now` (it is then running until `failed`, or the outage
    /// ends).
    fn start(&mut self, now: Instant) -> bool {
        if self.running.is_some() || now < self.next_try {
            return false;
        }
        self.running = Some(now);
        true
    }

    /// A request arrived and waits: with no attempt running, the next one starts at once
    /// rather than at the end of the backoff (its fresh chance in a long outage).
    fn request(&mut self, now: Instant) {
        if self.running.is_none() {
            self.next_try = self.next_try.min(now);
        }
    }

    /// The running attempt failed at `now`. Once the outage is older than `timeout`, returns
    /// when that attempt started: the requests that arrived by then have had their fresh
    /// attempt, and fail now.
    fn failed(&mut self, now: Instant, timeout: Duration) -> Option<Instant> {
        let started = self.running.take()?;
        self.attempts += 1;
        self.next_try = now + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        (now.duration_since(self.since) >= timeout).then_some(started)
    }

    /// When the thread must look again without being woken: the next attempt's start (the end
    /// of a running one wakes it).
    fn wake_at(&self) -> Option<Instant> {
        self.running.is_none().then_some(self.next_try)
    }
}

pub(crate) struct QueueWorker {
    id: u16,
    cdev: Arc<File>,
    depth: usize,
    buf_len: usize,
    /// The driver's descriptor array of this queue, mapped read-only from /dev/ublkcN.
    descs: Mmap,
    /// The tag buffers. Freed on drop only when no tag is armed (see `release_bufs`).
    bufs: ManuallyDrop<Mmap>,
    ring: IoUring,
    /// None while the connection is down (then `outage` is set).
    link: Option<Queue>,
    /// Changes with every new `Queue` (see `SockPoll`).
    link_id: u64,
    /// The queue that went down last: each reconnection names it, so the target finishes its
    /// requests before the new session may send them again (PROTOCOL.md §2.6).
    replaces: Option<QueueRef>,
    outage: Option<Outage>,
    /// The running reconnection attempt's answer.
    attempt: Option<mpsc::Receiver<Result<Queue, String>>>,
    /// Woken (and the ring with it, by a poll) when an attempt ends.
    waker: Arc<Waker>,
    /// The ring has a poll on `waker` armed.
    wake_armed: bool,
    /// Requests failed with EIO since the last log line about it, and when that was.
    failed: u64,
    /// Of those, changes answered without the fence (`Slot::due_at` ran out).
    unfenced_failed: u64,
    fail_logged: Option<Instant>,
    /// The ring also watches the queue's socket, so the thread sleeps in one place.
    sock: SockPoll,
    /// Completions taken from the ring (reused).
    cqes: Vec<(u64, i32, u32)>,
    /// Before sleeping with answers outstanding, the thread spins as `Queue::complete` does.
    spin: AdaptiveSpin,
    slots: Vec<Slot>,
    /// Completions of one `complete` call: tag and result to commit.
    done: Vec<(usize, i32)>,
    /// Tags whose request waits to be sent again (`Slot::retry_at`), each once.
    retrying: Vec<usize>,
    /// Completions of one `complete` call refused for want of memory (reused).
    refused: Vec<usize>,
    /// Tags with a command (FETCH_REQ or COMMIT_AND_FETCH_REQ) the kernel has not ended.
    alive_tags: usize,
    url: Url,
    reconnect: ConnectOptions,
    readonly: bool,
    timeout: Duration,
    /// What a session must grant to serve the device (checked on each reconnection).
    needs: Needs,
    /// The device's record: a reconnection names its new queue there before using it.
    book: Arc<RecordBook>,
}

// SAFETY: the raw pointers are mappings owned by the worker, used by one thread at a time.
unsafe impl Send for QueueWorker {}

/// A memory mapping of ours, unmapped on drop.
struct Mmap {
    ptr: *mut u8,
    len: usize,
}

impl Mmap {
    /// mmap(2) of `len` bytes; `what` names it in the error.
    fn new(
        len: usize,
        prot: i32,
        flags: i32,
        fd: i32,
        off: usize,
        what: &str,
    ) -> Result<Mmap, String> {
        // SAFETY: a new mapping at an address the kernel picks; nothing else is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                flags,
                fd,
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("{what}: {}", io::Error::last_os_error()));
        }
        Ok(Mmap { ptr: p.cast(), len })
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Frees the tag buffers unless `armed` tags still have a FETCH (or COMMIT_AND_FETCH) with the
/// kernel: each names its tag's buffer, and the driver copies a WRITE's data into it (in this
/// thread's task work) until the ring's asynchronous teardown cancels the command, so unmapped
/// memory that a later allocation reuses would be written. A queue only gets here with armed
/// tags when it failed, and the daemon then ends the mapping, so what is left mapped is bounded.
fn release_bufs(bufs: &mut ManuallyDrop<Mmap>, armed: usize) {
    if armed == 0 {
        // SAFETY: dropped once (the worker is being dropped), nothing uses it afterwards.
        unsafe { ManuallyDrop::drop(bufs) };
    }
}

impl Drop for QueueWorker {
    fn drop(&mut self) {
        // The descriptor array is the driver's memory, which it writes through its own address:
        // our mapping of it goes with `descs` whatever the state.
        release_bufs(&mut self.bufs, self.alive_tags);
    }
}

impl QueueWorker {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: u16,
        cdev: Arc<File>,
        depth: usize,
        buf_len: usize,
        q: Queue,
        url: Url,
        reconnect: ConnectOptions,
        readonly: bool,
        timeout: Duration,
        needs: Needs,
        book: Arc<RecordBook>,
    ) -> Result<QueueWorker, String> {
        let off = id as usize * max_cmd_buf_size();
        // The driver's descriptor array of this queue, read-only.
        let descs = Mmap::new(
            queue_cmd_buf_size(depth),
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            cdev.as_raw_fd(),
            off,
            &format!("mapping the descriptors of ublk queue {id}"),
        )?;
        // The tag buffers. No FETCH names them yet: an error below may free them (drop).
        let bufs = Mmap::new(
            depth * buf_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
            "allocating I/O buffers",
        )?;
        let ring = IoUring::new((depth as u32 * 2).next_power_of_two().max(8))
            .map_err(|e| format!("creating the io_uring of ublk queue {id}: {e}"))?;
        let waker = Waker::new().map_err(|e| format!("eventfd for ublk queue {id}: {e}"))?;
        let now = Instant::now();
        Ok(QueueWorker {
            id,
            cdev,
            depth,
            buf_len,
            descs,
            bufs: ManuallyDrop::new(bufs),
            ring,
            link: Some(q),
            link_id: 0,
            replaces: None,
            outage: None,
            attempt: None,
            waker: Arc::new(waker),
            wake_armed: false,
            failed: 0,
            unfenced_failed: 0,
            fail_logged: None,
            sock: SockPoll::default(),
            cqes: Vec::with_capacity(depth * 2),
            spin: AdaptiveSpin::new(reconnect.poll),
            slots: (0..depth)
                .map(|_| Slot {
                    op: None,
                    sent: false,
                    arrived: now,
                    deadline: now,
                    unfenced: false,
                    retry_at: None,
                })
                .collect(),
            done: Vec::with_capacity(depth),
            retrying: Vec::with_capacity(depth),
            refused: Vec::with_capacity(depth),
            // Counted as `fetch_all` arms them: a worker dropped before (setup failed) frees
            // its buffers.
            alive_tags: 0,
            url,
            reconnect,
            readonly,
            timeout,
            needs,
            book,
        })
    }

    /// Where the buffer of `tag` starts (an address for the kernel; not dereferenced here).
    fn buf(&self, tag: usize) -> *mut u8 {
        self.bufs.ptr.wrapping_add(tag * self.buf_len)
    }

    fn push_cmd(&mut self, op: u32, tag: usize, result: i32) -> Result<(), String> {
        let c = IoCmd {
            q_id: self.id,
            tag: tag as u16,
            result,
            addr: self.buf(tag) as u64,
        };
        let mut raw = [0u8; 16];
        // SAFETY: IoCmd is repr(C) u16, u16, i32, u64: no padding.
        raw.copy_from_slice(unsafe { as_bytes(&c) });
        let sqe = opcode::UringCmd16::new(types::Fd(self.cdev.as_raw_fd()), op)
            .cmd(raw)
            .build()
            .user_data(tag as u64);
        // SAFETY: the command names the tag's buffer, which stays mapped while the kernel may
        // hold the command: past the worker's drop when the tag is still armed (`release_bufs`).
        unsafe { self.push(&sqe) }
    }

    /// Queues an SQE, submitting what is queued when the submission queue is full.
    ///
    /// # Safety
    ///
    /// Every buffer `sqe` refers to must stay valid until its completion.
    unsafe fn push(&mut self, sqe: &squeue::Entry) -> Result<(), String> {
        loop {
            // SAFETY: the caller keeps what the SQE refers to alive.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            crate::sockpoll::submit_for_room(&mut self.ring)
                .map_err(|e| format!("io_uring submit: {e}"))?;
        }
    }

    fn fetch_all(&mut self) -> Result<(), String> {
        for tag in 0..self.depth {
            self.push_cmd(UBLK_U_IO_FETCH_REQ, tag, 0)?;
            // Armed from the push on: an SQE may reach the kernel at any later submit.
            self.alive_tags += 1;
        }
        crate::sockpoll::submit(&mut self.ring).map_err(|e| format!("sending FETCH_REQ: {e}"))
    }

    fn commit(&mut self, tag: usize, result: i32) -> Result<(), String> {
        self.slots[tag].op = None;
        self.slots[tag].sent = false;
        self.slots[tag].unfenced = false;
        self.slots[tag].retry_at = None;
        self.push_cmd(UBLK_U_IO_COMMIT_AND_FETCH_REQ, tag, result)
    }

    fn desc(&self, tag: usize) -> IoDesc {
        // SAFETY: tag < depth; the kernel wrote the descriptor before completing the fetch.
        unsafe { std::ptr::read_volatile(self.descs.ptr.cast::<IoDesc>().add(tag)) }
    }

    /// A request arrived on `tag`; `now` is when the ring handed it over, so its timeout
    /// counts from there whatever the thread did before getting to it.
    fn start(&mut self, tag: usize, now: Instant) -> Result<(), String> {
        let d = self.desc(tag);
        match map_op(&d, self.readonly, self.buf_len) {
            Ok(op) => {
                let s = &mut self.slots[tag];
                s.op = Some(op);
                s.sent = false;
                s.arrived = now;
                s.deadline = now + self.timeout;
                self.send(tag, now)
            }
            Err(errno) => self.commit(tag, -errno),
        }
    }

    /// Sends the request of `tag`, or leaves it waiting for a reconnection.
    fn send(&mut self, tag: usize, now: Instant) -> Result<(), String> {
        let Some(op) = self.slots[tag].op else {
            return Ok(());
        };
        self.slots[tag].retry_at = None;
        let buf = self.buf(tag);
        let Some(q) = self.link.as_mut() else {
            if let Some(o) = &mut self.outage {
                o.request(now);
            }
            return Ok(());
        };
        let data: &[u8] = if op.op == BlockOp::Write {
            // SAFETY: the kernel copied the request's data into this tag's buffer, which holds
            // `buf_len >= op.len` bytes (map_op checked) and is not written until we commit.
            unsafe { std::slice::from_raw_parts(buf, op.len as usize) }
        } else {
            &[]
        };
        let cmd = Cmd::from_request(&op, data);
        match q.submit(cmd, tag as u64) {
            Ok(()) => {
                self.slots[tag].sent = true;
                Ok(())
            }
            Err(e) => {
                log!("error", "queue {}: cannot send a request: {e}", self.id);
                self.commit(tag, -libc::EIO)
            }
        }
    }

    /// What to do with a blkwire completion: the result to commit (read data goes into the
    /// tag's buffer), or, refused for want of memory, the request sent again (the target's
    /// word that it ran nothing and that the initiator retries: failed, a filesystem would
    /// take a transient refusal for a broken disk).
    ///
    /// # Safety
    ///
    /// `bufs` must point at `slots.len()` writable buffers of `buf_len` bytes each, which
    /// nothing else reads or writes during the call.
    unsafe fn result_of(
        slots: &[Slot],
        bufs: *mut u8,
        buf_len: usize,
        c: &Completion<'_>,
    ) -> Option<Answer> {
        let tag = c.user as usize;
        let op = slots.get(tag)?.op?;
        if c.status == Status::NoMemory {
            return Some(Answer::Retry);
        }
        if c.status != Status::Ok {
            // The target's errno: the driver turns ENOSPC into BLK_STS_NOSPC, EOPNOTSUPP into
            // BLK_STS_NOTSUPP, the rest into an I/O error.
            let errno = match c.status.errno() {
                0 => libc::EIO,
                e => e,
            };
            return Some(Answer::Commit(-errno));
        }
        Some(Answer::Commit(match op.op {
            BlockOp::Read => {
                let len = op.len as usize;
                let n = c.data.len().min(len);
                // SAFETY: tag < slots.len() (`get` above) and n <= len <= buf_len (map_op checked
                // it): inside this tag's buffer, which the caller lets us write.
                unsafe {
                    let buf = bufs.add(tag * buf_len);
                    std::ptr::copy_nonoverlapping(c.data.as_ptr(), buf, n);
                    std::ptr::write_bytes(buf.add(n), 0, len - n);
                }
                len as i32
            }
            BlockOp::Write => op.len as i32,
            _ => 0,
        }))
    }

    /// Starts a reconnection in a thread of its own, whose end wakes the ring (`waker`): the
    /// queue thread goes on committing answers and failing requests at their deadlines while a
    /// connect to an unreachable or silent host takes its time. The new queue is named in the
    /// device's record before the queue thread gets it (else it is dropped unused): should the
    /// daemon die, `map --recover` fences the queue that may have sent writes, never one whose
    /// writes the new session's welcome already proved finished.
    fn spawn_attempt(&self) -> io::Result<mpsc::Receiver<Result<Queue, String>>> {
        let (tx, rx) = mpsc::channel();
        let waker = Arc::clone(&self.waker);
        let url = self.url.clone();
        // Where a reconnection's options come from (the session's, with one queue), naming
        // the queue it takes over.
        let opts = ConnectOptions {
            replaces: self.replaces,
            ..self.reconnect.clone()
        };
        let needs = self.needs;
        let (book, id) = (Arc::clone(&self.book), self.id);
        std::thread::Builder::new()
            .name(format!("blkwire-ublk-reconnect-{}", self.id))
            .spawn(move || {
                let r = needs.reconnect(&url, &opts).and_then(|q| {
                    book.set_queue(id as usize, q.identity()).map_err(|e| {
                        format!(
                            "recording the new session in the device's record: {e}; not using it"
                        )
                    })?;
                    Ok(q)
                });
                let _ = tx.send(r);
                Waker::wake(waker.fd());
            })?;
        Ok(rx)
    }

    /// The connection broke: every request waits for the next one (or its deadline), sent
    /// again from the start. No waiting here: `reconnect` starts the attempts.
    fn link_down(&mut self, why: &str, now: Instant) {
        if let Some(q) = self.link.take() {
            self.replaces = q.identity();
        }
        let held = held_writes_wait(self.replaces.is_some(), self.timeout);
        log!(
            "warn",
            "queue {}: connection to {} lost ({why}); reconnecting, I/O waits up to {}s{held}",
            self.id,
            self.url,
            self.timeout.as_secs()
        );
        self.outage = Some(Outage::new(now));
        let fenceable = self.replaces.is_some();
        for s in &mut self.slots {
            // Its change may still run at the target until the queue is fenced.
            s.unfenced |= s.holds_for_fence(fenceable);
            s.sent = false;
            // The reconnection sends every waiting request, those refused for memory too:
            // no retry is due meanwhile (a past one would make the thread spin).
            s.retry_at = None;
        }
        self.retrying.clear();
    }

    /// While disconnected: takes the end of the running attempt (then sends every waiting
    /// request on the new connection, or fails those a failed attempt fails, see `Outage`) and
    /// starts the next attempt when it is due.
    fn reconnect(&mut self, now: Instant) -> Result<(), String> {
        let Some(o) = self.outage.as_mut() else {
            return Ok(());
        };
        let ended = match self.attempt.as_ref().map(|rx| rx.try_recv()) {
            None | Some(Err(mpsc::TryRecvError::Empty)) => None,
            Some(Ok(r)) => Some(r),
            Some(Err(mpsc::TryRecvError::Disconnected)) => {
                Some(Err("the attempt ended without an answer".into()))
            }
        };
        let mut fail_by = None;
        match ended {
            Some(Ok(q)) => {
                log!(
                    "info",
                    "queue {}: reconnected to {} after {:.1}s",
                    self.id,
                    self.url,
                    now.duration_since(o.since).as_secs_f64()
                );
                self.attempt = None;
                self.outage = None;
                self.link = Some(q);
                self.link_id += 1;
                // The welcome fenced the queue given up (PROTOCOL.md §2.6): nothing sent on it
                // runs any more, so changes held for that are due at their deadline again.
                for s in &mut self.slots {
                    s.unfenced = false;
                }
                for tag in 0..self.depth {
                    // One whose deadline has passed is `expire`'s to fail: sent, it would take
                    // the new connection down with it.
                    if self.slots[tag].deadline > now {
                        self.send(tag, now)?;
                    }
                }
                return Ok(());
            }
            Some(Err(e)) => {
                self.attempt = None;
                fail_by = o.failed(now, self.timeout);
                if o.attempts == 1 || o.attempts % 30 == 0 {
                    log!(
                        "warn",
                        "queue {}: reconnecting to {} (attempt {}): {e}",
                        self.id,
                        self.url,
                        o.attempts
                    );
                }
            }
            None => {}
        }
        if o.start(now) {
            match self.spawn_attempt() {
                Ok(rx) => self.attempt = Some(rx),
                Err(e) => {
                    log!("error", "queue {}: starting a reconnection: {e}", self.id);
                    if let Some(o) = self.outage.as_mut() {
                        fail_by = fail_by.max(o.failed(now, self.timeout));
                    }
                }
            }
        }
        if let Some(t) = fail_by {
            let mut tags = std::mem::take(&mut self.done);
            tags.extend(arrived_by(&self.slots, t).map(|tag| (tag, -libc::EIO)));
            for &(tag, res) in &tags {
                self.commit(tag, res)?;
            }
            self.note_failed(tags.len(), now);
            tags.clear();
            self.done = tags;
        }
        Ok(())
    }

    /// Counts requests failed with EIO for want of an answer, and logs them at most once per
    /// `LOG_EVERY` (a long outage may fail one request after another).
    fn note_failed(&mut self, n: usize, now: Instant) {
        self.failed += n as u64;
        if self.failed > 0
            && self
                .fail_logged
                .is_none_or(|l| now.duration_since(l) >= LOG_EVERY)
        {
            log!(
                "warn",
                "queue {}: {} request(s) failed with EIO: {} unreachable or silent for {}s",
                self.id,
                self.failed,
                self.url,
                self.timeout.as_secs()
            );
            if self.unfenced_failed > 0 {
                let n = std::mem::take(&mut self.unfenced_failed);
                let line = unfenced_line(self.id as usize, n, &self.url, self.timeout);
                log!("warn", "{line}");
            }
            self.failed = 0;
            self.fail_logged = Some(now);
        }
    }

    /// When failures counted since the last log line are due to be logged.
    fn fail_log_due(&self) -> Option<Instant> {
        let last = self.fail_logged?;
        (self.failed > 0).then_some(last + LOG_EVERY)
    }

    /// Answers EIO to every request that has waited its whole timeout (every request is
    /// answered within `--timeout`, a change held for the fence within twice that). The
    /// queue's own timer does not see one request the target leaves unanswered while it answers
    /// others, so this one does. A failed request's command may still be in flight, and its tag
    /// comes back with a new request once committed: a late answer would complete that one. So
    /// the connection is dropped, as the fuse frontend does, and the others are sent again on a
    /// new one. It is dropped too when a change is held for the fence: the reconnection that
    /// fences its queue, and so answers it, starts now.
    fn expire(&mut self, now: Instant) -> Result<(), String> {
        let fenceable = self.link.as_ref().is_some_and(|q| q.identity().is_some());
        let mut tags = std::mem::take(&mut self.done);
        let mut held = false;
        for tag in expired(&self.slots, now, self.timeout) {
            if self.slots[tag].holds_for_fence(fenceable) {
                held = true;
            } else {
                tags.push((tag, -libc::EIO));
            }
        }
        let in_flight = held || tags.iter().any(|&(tag, _)| self.slots[tag].sent);
        let unfenced = tags.iter().filter(|&&(tag, _)| self.slots[tag].unfenced);
        self.unfenced_failed += unfenced.count() as u64;
        for &(tag, res) in &tags {
            self.commit(tag, res)?;
        }
        self.note_failed(tags.len(), now);
        tags.clear();
        self.done = tags;
        if in_flight && self.link.is_some() {
            self.link_down(
                &format!("a request unanswered for {}s", self.timeout.as_secs()),
                now,
            );
        }
        Ok(())
    }

    /// One loop for both sides: the kernel's requests (ring completions of the tags) and the
    /// target's answers (the queue's socket, polled by the same ring, and `Queue::poll`), so
    /// requests the kernel hands over while others are in flight are sent at once, and the
    /// thread sleeps in one place until either side has something or the queue's next timer.
    fn serve(&mut self, ev: &mpsc::Sender<QEvent>) -> Result<(), String> {
        let r = self.fetch_all();
        let _ = ev.send(QEvent::Fetched(self.id as usize, r.clone()));
        r?;
        loop {
            // Requests from the kernel (their timeouts count from now), and poll events.
            let now = Instant::now();
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(ud, res, flags) in &cqes {
                if SockPoll::owns(ud) {
                    self.sock.on_cqe(ud, flags);
                    continue;
                }
                if ud == WAKE {
                    self.wake_armed = false;
                    self.waker.clear();
                    continue;
                }
                let tag = ud as usize;
                match res {
                    UBLK_IO_RES_OK => self.start(tag, now)?,
                    UBLK_IO_RES_ABORT => self.alive_tags -= 1,
                    e => {
                        log!(
                            "error",
                            "queue {}: tag {tag}: {}",
                            self.id,
                            io::Error::from_raw_os_error(-e)
                        );
                        self.alive_tags -= 1;
                    }
                }
            }
            cqes.clear();
            self.cqes = cqes;
            if self.alive_tags == 0 {
                return Ok(());
            }
            // While disconnected: a new connection takes the waiting requests before the queue
            // is polled (which sends them); a failed attempt may fail some; the next one starts.
            self.reconnect(now)?;
            // The target's answers, without waiting.
            let mut done = std::mem::take(&mut self.done);
            let mut refused = std::mem::take(&mut self.refused);
            let r = match self.link.as_mut() {
                Some(q) => {
                    let (slots, bufs, buf_len) = (&self.slots, self.bufs.ptr, self.buf_len);
                    q.poll(|c| {
                        // SAFETY: `bufs` is our mapping of one buffer per slot. The kernel may
                        // write into it during this call: it copies a new request's data into
                        // its tag's buffer in this thread's task work (URING_CMD_COMP_IN_TASK),
                        // which runs on return from any syscall, the socket reads of `poll`
                        // included. But it writes only the buffers of tags with a fetch armed,
                        // and `result_of` only those of tags holding a request we have not
                        // committed yet (`op`), so the two never touch the same buffer.
                        match unsafe { Self::result_of(slots, bufs, buf_len, &c) } {
                            Some(Answer::Commit(res)) => done.push((c.user as usize, res)),
                            Some(Answer::Retry) => refused.push(c.user as usize),
                            None => {}
                        }
                    })
                }
                None => Ok(0),
            };
            for &(tag, res) in &done {
                self.commit(tag, res)?;
            }
            done.clear();
            self.done = done;
            let now = Instant::now();
            for &tag in &refused {
                self.refused_for_memory(tag, now);
            }
            refused.clear();
            self.refused = refused;
            if let Err(e) = r {
                self.link_down(&e.to_string(), now);
            }
            self.retry(now)?;
            if next_deadline(&self.slots, self.timeout).is_some_and(|d| now >= d) {
                self.expire(now)?;
            }
            self.note_failed(0, now);
            let want = self.link.as_ref().map(|q| (self.link_id, q.fd()));
            for sqe in self.sock.update(want).into_iter().flatten() {
                // SAFETY: a poll and its removal refer to no buffer.
                unsafe { self.push(&sqe) }?;
            }
            if self.attempt.is_some() && !self.wake_armed {
                let p = opcode::PollAdd::new(types::Fd(self.waker.fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(WAKE);
                // SAFETY: a poll refers to no buffer.
                unsafe { self.push(&p) }?;
                self.wake_armed = true;
            }
            // Commits go out; with answers outstanding the thread spins briefly for one or for a
            // request (the poll(2) also lets the kernel run the ring's task work), then sleeps
            // until a request, an answer or a timer.
            // (Not when the link wants polling now: a TLS session may hold answers the socket
            // does not show, and spinning on the socket would only delay them.)
            // (The clock read after the deadline: one that is "now" is due.)
            if let Some(fd) = self
                .link
                .as_ref()
                .filter(|q| q.in_flight() > 0 && q.deadline().is_none_or(|d| d > Instant::now()))
                .map(|q| q.fd())
            {
                crate::sockpoll::submit(&mut self.ring)?;
                let ring = &mut self.ring;
                if self
                    .spin
                    .spin(|| readable([fd]) || !ring.completion().is_empty())
                {
                    continue;
                }
            }
            // Submits the commits, then sleeps until a request, an answer, the end of a
            // reconnection attempt, or the first of: the queue's timer, the next request's
            // deadline, the next attempt, the next log line about failed requests.
            let limit = [
                self.link.as_ref().and_then(|q| q.deadline()),
                next_deadline(&self.slots, self.timeout),
                self.next_retry(),
                self.outage.as_ref().and_then(|o| o.wake_at()),
                self.fail_log_due(),
            ]
            .into_iter()
            .flatten()
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()));
            crate::sockpoll::sleep(&mut self.ring, limit)?;
        }
    }

    /// The target refused `tag`'s request for want of memory: its command is over, and the
    /// request waits `RETRY_AFTER` to be sent again.
    fn refused_for_memory(&mut self, tag: usize, now: Instant) {
        let s = &mut self.slots[tag];
        if s.op.is_none() || !s.sent {
            return;
        }
        s.sent = false;
        s.retry_at = Some(now + RETRY_AFTER);
        if !self.retrying.contains(&tag) {
            self.retrying.push(tag);
        }
    }

    /// Sends again the requests refused for want of memory whose wait is over; forgets those
    /// sent or answered since (a reconnection sends every waiting request; one whose deadline
    /// comes first is `expire`'s to fail).
    fn retry(&mut self, now: Instant) -> Result<(), String> {
        if self.retrying.is_empty() || self.link.is_none() {
            return Ok(());
        }
        for tag in retries_due(&self.slots, &mut self.retrying, now) {
            self.send(tag, now)?;
        }
        Ok(())
    }

    /// When the first request refused for want of memory is due to be sent again (before
    /// its deadline: after it, `expire`'s). None while the link is down: the reconnection
    /// sends them.
    fn next_retry(&self) -> Option<Instant> {
        next_retry(&self.slots, &self.retrying, self.link.is_some())
    }

    pub(crate) fn run(mut self, ev: mpsc::Sender<QEvent>) {
        let error = self.serve(&ev).err();
        if let Some(q) = self.link.take() {
            crate::device::final_flush(q, self.readonly, self.id as usize, self.timeout);
        }
        let id = self.id as usize;
        drop(self); // unmaps and closes before the main thread deletes the device
        let _ = ev.send(QEvent::Exited(id, error));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `[p, p + len)` is mapped: mincore(2) fails with ENOMEM on unmapped memory.
    fn mapped(p: *mut u8, len: usize) -> bool {
        let mut pages = vec![0u8; len.div_ceil(4096)];
        // SAFETY: mincore only reads the page tables; `pages` has a byte per page.
        unsafe { libc::mincore(p.cast(), len, pages.as_mut_ptr()) == 0 }
    }

    #[test]
    fn a_request_expires_at_its_own_deadline_whatever_else_is_answered() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let slot = |op: bool, sent: bool, deadline: Instant| Slot {
            op: op.then(|| BlockRequest::new(BlockOp::Read, 0, 4096)),
            sent,
            arrived: t0,
            deadline,
            unfenced: false,
            retry_at: None,
        };
        let t = secs(5);
        // Tag 0 is free (its stale deadline means nothing), tag 1 was sent at t0 and never
        // answered, tag 2 arrived later, tag 3 waits unsent for a connection.
        let slots = vec![
            slot(false, false, t0),
            slot(true, true, t0 + secs(5)),
            slot(true, true, t0 + secs(8)),
            slot(true, false, t0 + secs(6)),
        ];
        assert_eq!(next_deadline(&slots, t), Some(t0 + secs(5)));
        assert_eq!(expired(&slots, t0 + secs(4), t).count(), 0);
        assert_eq!(expired(&slots, t0 + secs(5), t).collect::<Vec<_>>(), [1]);
        assert_eq!(expired(&slots, t0 + secs(7), t).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(
            expired(&slots, t0 + secs(9), t).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(next_deadline(&[slot(false, false, t0)], t), None);
        // Reads are never held for the fence.
        assert!(!slots[1].holds_for_fence(true));
    }

    #[test]
    fn a_write_the_target_may_still_run_waits_for_the_fence_up_to_one_more_timeout() {
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        let timeout = secs(5);
        let slot = |op: BlockOp, sent: bool| Slot {
            op: Some(BlockRequest::new(op, 0, 4096)),
            sent,
            arrived: t0,
            deadline: t0 + timeout,
            unfenced: false,
            retry_at: None,
        };
        // Due at its deadline: a change in flight on a connection with an identity is held
        // (the connection is given up); one not sent, a read, a flush, or one on a connection
        // that cannot be fenced (nvme-tcp://) fails.
        for op in [BlockOp::Write, BlockOp::Trim, BlockOp::WriteZeroes] {
            assert!(slot(op, true).holds_for_fence(true), "{op:?}");
            assert!(!slot(op, true).holds_for_fence(false), "{op:?}");
            assert!(!slot(op, false).holds_for_fence(true), "{op:?}");
        }
        assert!(!slot(BlockOp::Read, true).holds_for_fence(true));
        assert!(!slot(BlockOp::Flush, true).holds_for_fence(true));
        // Given up unfenced, it is due one timeout later, and a failed attempt in a long
        // outage does not fail it with the others.
        let mut slots = vec![slot(BlockOp::Write, false), slot(BlockOp::Read, false)];
        slots[0].unfenced = true;
        let mut resent = slot(BlockOp::Write, true);
        resent.unfenced = true;
        assert!(!resent.holds_for_fence(true), "held once, not again");
        assert_eq!(next_deadline(&slots, timeout), Some(t0 + timeout));
        assert_eq!(
            expired(&slots, t0 + timeout, timeout).collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(arrived_by(&slots, t0 + secs(7)).collect::<Vec<_>>(), [1]);
        slots[1].op = None;
        assert_eq!(next_deadline(&slots, timeout), Some(t0 + secs(10)));
        assert_eq!(expired(&slots, t0 + secs(9), timeout).count(), 0);
        assert_eq!(
            expired(&slots, t0 + secs(10), timeout).collect::<Vec<_>>(),
            [0]
        );
        // Fenced (a reconnection naming its queue was welcomed): due at its deadline again.
        slots[0].unfenced = false;
        assert_eq!(
            expired(&slots, t0 + timeout, timeout).collect::<Vec<_>>(),
            [0]
        );
    }

    #[test]
    fn one_reconnection_attempt_at_a_time_with_backoff() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let timeout = Duration::from_secs(5);
        let mut o = Outage::new(t0);
        assert_eq!(o.wake_at(), Some(t0));
        assert!(o.start(t0));
        // Running: no second attempt, whoever asks, and no timer (its end wakes the thread).
        assert!(!o.start(ms(1)));
        o.request(ms(2));
        assert!(!o.start(ms(2)));
        assert_eq!(o.wake_at(), None);
        // Failed early in the outage: nobody fails with it; the next waits out the backoff.
        assert_eq!(o.failed(ms(50), timeout), None);
        assert_eq!(o.wake_at(), Some(ms(150)));
        assert!(!o.start(ms(149)));
        assert!(o.start(ms(150)));
        // The backoff doubles up to a second.
        let mut at = 150;
        for backoff in [200, 400, 800, 1000, 1000] {
            assert_eq!(o.failed(ms(at), timeout), None);
            assert_eq!(o.wake_at(), Some(ms(at + backoff)));
            at += backoff;
            assert!(o.start(ms(at)));
        }
        assert_eq!(o.failed(ms(at), timeout), None); // 3.55 s into the outage
                                                     // A request arriving between attempts starts the next one at once.
        let now = at + 10;
        o.request(ms(now));
        assert_eq!(o.wake_at(), Some(ms(now)));
        assert!(o.start(ms(now)));
    }

    #[test]
    fn a_request_waits_out_a_short_outage_and_fails_with_its_attempt_in_a_long_one() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let timeout = Duration::from_secs(5);
        let slot = |arrived: Instant| Slot {
            op: Some(BlockRequest::new(BlockOp::Read, 0, 4096)),
            sent: false,
            arrived,
            deadline: arrived + timeout,
            unfenced: false,
            retry_at: None,
        };
        let mut o = Outage::new(t0);
        let mut slots = vec![slot(ms(500))];
        assert!(o.start(ms(1000)));
        // The outage is 2 s old: the request keeps waiting, up to its own deadline.
        assert_eq!(o.failed(ms(2000), timeout), None);
        assert_eq!(expired(&slots, ms(5499), timeout).count(), 0);
        assert_eq!(expired(&slots, ms(5500), timeout).collect::<Vec<_>>(), [0]);
        slots[0].op = None; // failed with EIO by `expire`
                            // Idle until a request arrives at 7 s: it gets a fresh attempt at once...
        slots.push(slot(ms(7000)));
        o.request(ms(7000));
        assert!(o.start(ms(7000)));
        // ...and one arriving while it runs waits for the next.
        slots.push(slot(ms(7100)));
        o.request(ms(7100));
        assert!(!o.start(ms(7100)));
        // The attempt fails in an outage older than the timeout: who arrived by its start fails.
        let by = o.failed(ms(7200), timeout).expect("a long outage");
        assert_eq!(arrived_by(&slots, by).collect::<Vec<_>>(), [1]);
        slots[1].op = None;
        assert!(!o.start(ms(7200)));
        assert!(o.start(ms(7400)));
        let by = o.failed(ms(7500), timeout).expect("a long outage");
        assert_eq!(arrived_by(&slots, by).collect::<Vec<_>>(), [2]);
    }

    /// A failed request is committed with the target's errno, not always EIO: the driver makes
    /// ENOSPC a BLK_STS_NOSPC (a filesystem sees "no space", not an I/O error).
    #[test]
    fn a_failed_request_commits_the_targets_errno() {
        let t0 = Instant::now();
        let slots = vec![Slot {
            op: Some(BlockRequest::new(BlockOp::Write, 0, 4096)),
            sent: true,
            arrived: t0,
            deadline: t0,
            unfenced: false,
            retry_at: None,
        }];
        let mut buf = vec![0u8; 4096];
        for (status, errno) in [
            (Status::NoSpace, libc::ENOSPC),
            (Status::Io, libc::EIO),
            (Status::ReadOnly, libc::EPERM),
        ] {
            let c = Completion {
                user: 0,
                length: 4096,
                status,
                data: &[],
            };
            // SAFETY: one slot, one 4096-byte buffer of ours.
            let r = unsafe { QueueWorker::result_of(&slots, buf.as_mut_ptr(), 4096, &c) };
            assert_eq!(r, Some(Answer::Commit(-errno)), "{status:?}");
        }
        // Refused for want of memory (the target ran nothing and says to retry): sent again,
        // never failed to the kernel as ENOMEM (a filesystem's I/O error).
        let c = Completion {
            user: 0,
            length: 4096,
            status: Status::NoMemory,
            data: &[],
        };
        // SAFETY: as above.
        let r = unsafe { QueueWorker::result_of(&slots, buf.as_mut_ptr(), 4096, &c) };
        assert_eq!(r, Some(Answer::Retry));
    }

    /// A request refused for want of memory is sent again once its wait is over, not before,
    /// and never past its deadline (then it is failed); one answered or sent again since is
    /// forgotten.
    #[test]
    fn refused_requests_are_due_again_after_their_wait_and_before_their_deadline() {
        let t0 = Instant::now();
        let slot = |retry_at: Option<Instant>, deadline: Instant| Slot {
            op: Some(BlockRequest::new(BlockOp::Write, 0, 4096)),
            sent: false,
            arrived: t0,
            deadline,
            unfenced: false,
            retry_at,
        };
        let later = t0 + Duration::from_secs(30);
        let mut slots = vec![
            slot(Some(t0 + RETRY_AFTER), later),
            slot(Some(t0 + RETRY_AFTER), t0 + RETRY_AFTER),
            slot(None, later),
            slot(Some(t0 + 2 * RETRY_AFTER), later),
        ];
        slots[2].op = None;
        let mut waiting = vec![0, 1, 2, 3];
        assert!(retries_due(&slots, &mut waiting, t0).is_empty(), "not yet");
        assert_eq!(waiting, [0, 1, 3], "tag 2 was answered");
        assert_eq!(retries_due(&slots, &mut waiting, t0 + RETRY_AFTER), [0]);
        assert_eq!(
            waiting,
            [1, 3],
            "tag 1's deadline came first: it waits to fail"
        );
        assert_eq!(retries_due(&slots, &mut waiting, later), [3]);
        assert_eq!(waiting, [1]);
        // The thread wakes for the first retry due before its deadline, and for none while
        // the link is down (tag 1's is past: woken for it, the thread would spin).
        let waiting = [0, 1, 3];
        assert_eq!(next_retry(&slots, &waiting, true), Some(t0 + RETRY_AFTER));
        assert_eq!(
            next_retry(&slots, &[1], true),
            None,
            "its deadline comes first"
        );
        assert_eq!(next_retry(&slots, &waiting, false), None, "link down");
    }

    #[test]
    fn tag_buffers_stay_mapped_while_a_tag_is_armed() {
        let len = 1 << 16;
        let mut bufs = ManuallyDrop::new(
            Mmap::new(
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
                "test buffers",
            )
            .unwrap(),
        );
        let p = bufs.ptr;
        assert!(mapped(p, len));
        release_bufs(&mut bufs, 1);
        // Still ours: the kernel may write a request's data there.
        assert!(mapped(p, len));
        // The test's own cleanup (with no armed tag, `release_bufs` would free it).
        release_bufs(&mut bufs, 0);
    }
}
