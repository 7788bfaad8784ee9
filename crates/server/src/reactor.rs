//! One reactor per worker thread: its own io_uring, its own connections (queues), no locks.
//!
//! ```text
//!   socket --recv--> rx buffer --StreamFrontend::decode--> dispatch --Executor::start---+
//!                                                           |  inline (mem, null):      |
//!                                                           |  copy straight into tx    | io_uring (file)
//!                                                           |                           | or notifier
//!   socket <--send-- tx buffer <--- StreamFrontend::reply --+<------- completion --------+  (memthread)
//! ```
//!
//! The reactor names no protocol: a connection's [`StreamFrontend`] decodes and encodes, its
//! [`Executor`] validates and runs.
//!
//! Readiness comes from a multishot `POLL_ADD` per socket; data moves with plain non-blocking
//! `recv`/`send` so one syscall carries every frame that is waiting (batching is where the IOPS
//! come from). Backend I/O of async backends is submitted to the same ring, so a single
//! `io_uring_enter` both submits and waits for everything this thread owns.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_backend::{AlignedBuf, Export, Extent, Submitter};
use blkwire_wire::{Status, HEADER_LEN};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::executor::{Executor, Outcome};
use crate::frontend::{Decoded, Kind, Req, StreamFrontend};
use crate::log::Level;
use crate::session::Registry;
use crate::stats::QueueStats;

/// A queue connection that finished its handshake, handed to a reactor by message.
pub struct NewQueue {
    pub sock: OwnedFd,
    pub export: Arc<Export>,
    pub session: u32,
    pub queue: u16,
    pub depth: u16,
    pub max_io: u32,
    pub peer: String,
    /// The protocol the connection speaks from now on, with its negotiated state.
    pub frontend: Box<dyn StreamFrontend>,
}

pub enum Msg {
    Queue(NewQueue),
    /// A datagram socket this reactor serves from now on.
    Port(crate::dgram::PortSetup),
    /// Report every live queue's counters on the sender (the reactor owns them; no sharing).
    Stats(std::sync::mpsc::Sender<(Vec<QueueReport>, Vec<crate::dgram::PortReport>)>),
    Shutdown,
}

/// One live queue's counters, as a reactor reports them.
#[derive(Clone, Debug, serde::Serialize)]
pub struct QueueReport {
    #[serde(skip)]
    pub session: u32,
    pub queue: u16,
    pub thread: usize,
    pub in_flight: u32,
    #[serde(flatten)]
    pub stats: QueueStats,
}

// user_data layout: kind (4 bits) | incarnation (20 bits) | connection index (24 bits) | slot (16 bits)
const KIND_IO: u64 = 1;
const KIND_POLL_IN: u64 = 2;
const KIND_POLL_OUT: u64 = 3;
const KIND_WAKE: u64 = 4;
const KIND_CANCEL: u64 = 5;
const KIND_PORT_IN: u64 = 6;
const KIND_PORT_IO: u64 = 7;
/// A backend that completes on its own threads has results for a connection.
const KIND_NOTIFY: u64 = 8;
/// ... or for a datagram queue (connection field as for KIND_PORT_IO).
const KIND_PORT_NOTIFY: u64 = 9;

fn ud(kind: u64, incarnation: u32, conn: usize, slot: u16) -> u64 {
    kind << 60
        | ((incarnation as u64) & 0xf_ffff) << 40
        | ((conn as u64) & 0xff_ffff) << 16
        | slot as u64
}

/// User data of a datagram queue's backend I/O on port `port`: the connection field carries the
/// port (high 4 bits) and the queue (low 20 bits).
fn port_io_ud(port: usize) -> impl Fn(u32, usize, u16) -> u64 {
    move |inc, q, slot| ud(KIND_PORT_IO, inc, port << 20 | (q & 0xf_ffff), slot)
}

/// A multishot poll on a backend's completion notifier.
fn notifier_poll(fd: i32, user_data: u64) -> squeue::Entry {
    opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
        .multi(true)
        .build()
        .user_data(user_data)
}

fn ud_split(u: u64) -> (u64, u32, usize, u16) {
    (
        u >> 60,
        ((u >> 40) & 0xf_ffff) as u32,
        ((u >> 16) & 0xff_ffff) as usize,
        u as u16,
    )
}

/// Pushes to the ring, submitting first when the submission queue is full.
struct Pusher<'a>(&'a mut IoUring);

impl Submitter for Pusher<'_> {
    fn push(&mut self, e: squeue::Entry) {
        loop {
            // SAFETY: every entry's buffers are owned by a slot or the reactor and stay alive until
            // its completion is reaped (slots are never freed while busy).
            if unsafe { self.0.submission().push(&e) }.is_ok() {
                return;
            }
            if let Err(err) = self.0.submit() {
                crate::log!(Level::Error, "io_uring submit failed: {err}");
                std::thread::yield_now();
            }
        }
    }
}

#[derive(Default)]
struct Slot {
    busy: bool,
    req: Option<Req>,
    buf: Option<AlignedBuf>,
}

struct Conn {
    sock: OwnedFd,
    incarnation: u32,
    fe: Box<dyn StreamFrontend>,
    exec: Executor,
    inline: bool,
    session: u32,
    queue: u16,
    max_io: u32,
    peer: String,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    tx: Vec<u8>,
    tx_sent: usize,
    slots: Vec<Slot>,
    /// Slots free for server-assigned requests (frontends whose requests carry cookies).
    free_slots: Vec<u16>,
    inflight: u32,
    /// Scratch for allocation maps (NBD block status), reused.
    extents: Vec<Extent>,
    /// The socket may hold unread bytes (we stopped before EAGAIN).
    readable: bool,
    /// Waiting for POLLOUT after a short send.
    want_out: bool,
    /// No more requests are read; close once in-flight I/O is answered and sent.
    closing: bool,
    /// The socket is dead: drop the connection as soon as nothing is in flight.
    dead: bool,
    bytes_sent: u64,
}

impl Conn {
    fn fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }

    fn tx_backlog(&self) -> usize {
        self.tx.len() - self.tx_sent
    }

    /// Stop reading when this much reply data waits to be sent: a client that sends requests but
    /// never reads replies cannot make us buffer without bound.
    fn tx_high_water(&self) -> usize {
        (4 << 20).max(2 * self.max_io as usize + 2 * HEADER_LEN)
    }

    /// Appends a reply that carries no read data.
    fn reply(&mut self, req: &Req, status: Status) {
        if self.fe.reply(req, status, &mut self.tx) {
            self.count_reply(status);
        }
    }

    fn count_reply(&mut self, status: Status) {
        self.exec.stats.frames_out += 1;
        if status != Status::Ok {
            self.exec.stats.errors += 1;
        }
    }

    fn violation(&mut self, what: &dyn std::fmt::Display) {
        crate::log!(
            Level::Warn,
            "session {} queue {} from {}: protocol violation: {what}; closing the queue",
            self.session,
            self.queue,
            self.peer
        );
        self.exec.stats.protocol_errors += 1;
        self.closing = true;
        self.rx_start = self.rx_end;
    }

    /// Room for a whole frame of `total` bytes starting at rx_start, growing the buffer up to
    /// the largest frame the granted max I/O allows (NBD may send 32 MiB writes).
    fn make_room(&mut self, total: usize) {
        if self.rx.len() - self.rx_start >= total {
            return;
        }
        self.rx.copy_within(self.rx_start..self.rx_end, 0);
        self.rx_end -= self.rx_start;
        self.rx_start = 0;
        if self.rx.len() < total {
            self.rx.resize(total, 0);
        }
    }
}

pub struct Reactor {
    id: usize,
    ring: IoUring,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    next_incarnation: u32,
    inbox: Receiver<Msg>,
    wake_fd: OwnedFd,
    wake_buf: Box<u64>,
    registry: Arc<Registry>,
    spin: blkwire_spin::AdaptiveSpin,
    shutting_down: bool,
    shutdown_deadline: Option<Instant>,
    /// Connections that may have work without a new completion.
    ready: VecDeque<usize>,
    /// Reused for every batch of completions (no allocation per loop).
    cqes: Vec<cqueue::Entry>,
    /// Datagram sockets (UDP, raw Ethernet) owned by this reactor.
    ports: Vec<crate::dgram::DgramPort>,
    /// Scratch for results reaped from thread-completing backends (no allocation per batch).
    reaped: Vec<(u64, i32)>,
}

impl Reactor {
    pub fn new(
        id: usize,
        inbox: Receiver<Msg>,
        wake_fd: OwnedFd,
        registry: Arc<Registry>,
        poll: Duration,
    ) -> std::io::Result<Reactor> {
        let ring = IoUring::builder().build(1024)?;
        Ok(Reactor {
            id,
            ring,
            conns: Vec::new(),
            free: Vec::new(),
            next_incarnation: 1,
            inbox,
            wake_fd,
            wake_buf: Box::new(0),
            registry,
            spin: blkwire_spin::AdaptiveSpin::new(poll),
            shutting_down: false,
            shutdown_deadline: None,
            ready: VecDeque::new(),
            cqes: Vec::with_capacity(1024),
            ports: Vec::new(),
            reaped: Vec::new(),
        })
    }

    /// Runs until told to shut down and every connection has drained.
    pub fn run(mut self) {
        self.arm_wake();
        loop {
            self.drain_inbox();
            if self.shutting_down
                && self.conns.iter().all(Option::is_none)
                && self.ports.iter().all(|p| !p.has_running())
            {
                for p in &mut self.ports {
                    p.close_all();
                }
                break;
            }
            for p in &mut self.ports {
                p.sweep();
            }
            while let Some(i) = self.ready.pop_front() {
                self.service(i);
            }
            if let Err(e) = self.wait() {
                crate::log!(Level::Error, "io_uring wait failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            self.reap();
            self.receive_ready_ports();
            self.watch_port_notifiers();
            if let Some(d) = self.shutdown_deadline {
                if Instant::now() > d {
                    for i in 0..self.conns.len() {
                        if let Some(c) = self.conns[i].as_mut() {
                            c.dead = true;
                            c.closing = true;
                        }
                        self.ready.push_back(i);
                    }
                    // Ops still in flight keep their connection alive until they complete.
                    self.shutdown_deadline = Some(Instant::now() + Duration::from_secs(3600));
                }
            }
        }
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(self.wake_fd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(ud(KIND_WAKE, 0, 0, 0));
        Pusher(&mut self.ring).push(e);
    }

    fn drain_inbox(&mut self) {
        while let Ok(m) = self.inbox.try_recv() {
            match m {
                Msg::Queue(q) => self.add(q),
                Msg::Port(setup) => {
                    let idx = self.ports.len();
                    let port = crate::dgram::DgramPort::new(setup, self.registry.clone());
                    let poll = opcode::PollAdd::new(types::Fd(port.fd()), libc::POLLIN as u32)
                        .multi(true)
                        .build()
                        .user_data(ud(KIND_PORT_IN, 0, idx, 0));
                    Pusher(&mut self.ring).push(poll);
                    self.ports.push(port);
                }
                Msg::Stats(reply) => {
                    let mut r: Vec<QueueReport> = self
                        .conns
                        .iter()
                        .flatten()
                        .map(|c| QueueReport {
                            session: c.session,
                            queue: c.queue,
                            thread: self.id,
                            in_flight: c.inflight,
                            stats: c.exec.stats,
                        })
                        .collect();
                    for p in &self.ports {
                        r.extend(p.reports(self.id));
                    }
                    let ports = self.ports.iter().map(|p| p.report(self.id)).collect();
                    let _ = reply.send((r, ports));
                }
                Msg::Shutdown => {
                    self.shutting_down = true;
                    self.shutdown_deadline = Some(Instant::now() + Duration::from_secs(10));
                    for i in 0..self.conns.len() {
                        if let Some(c) = self.conns[i].as_mut() {
                            // Requests already received are still answered (they are in rx).
                            c.closing = true;
                            self.ready.push_back(i);
                        }
                    }
                }
            }
        }
    }

    fn add(&mut self, q: NewQueue) {
        let exec = match Executor::open(q.export.clone(), q.max_io) {
            Ok(x) => x,
            Err(e) => {
                crate::log!(
                    Level::Error,
                    "export {}: cannot open queue: {e}",
                    q.export.name
                );
                self.registry
                    .leave(q.session, q.queue, &QueueStats::default());
                return;
            }
        };
        let idx = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        let incarnation = self.next_incarnation;
        self.next_incarnation = (self.next_incarnation + 1) & 0xf_ffff;
        // Sized for a 1 MiB frame plus batching room; grows (up to max I/O) only if a client sends
        // larger frames.
        let rx_cap = (q.max_io as usize).min(1 << 20) + HEADER_LEN + (256 << 10);
        let conn = Conn {
            fe: q.frontend,
            free_slots: (0..q.depth).rev().collect(),
            extents: Vec::new(),
            inline: exec.completes_inline(),
            exec,
            incarnation,
            session: q.session,
            queue: q.queue,
            max_io: q.max_io,
            peer: q.peer,
            rx: vec![0; rx_cap],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(1 << 20),
            tx_sent: 0,
            slots: (0..q.depth).map(|_| Slot::default()).collect(),
            inflight: 0,
            readable: true,
            want_out: false,
            closing: self.shutting_down,
            dead: false,
            bytes_sent: 0,
            sock: q.sock,
        };
        let poll = opcode::PollAdd::new(types::Fd(conn.fd()), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(ud(KIND_POLL_IN, incarnation, idx, 0));
        Pusher(&mut self.ring).push(poll);
        if let Some(fd) = conn.exec.notifier() {
            let notify = notifier_poll(fd, ud(KIND_NOTIFY, incarnation, idx, 0));
            Pusher(&mut self.ring).push(notify);
        }
        self.conns[idx] = Some(conn);
        self.ready.push_back(idx);
    }

    /// Submits what is queued and waits for at least one completion, polling briefly first so a
    /// request arriving within `poll` is picked up without the cost of sleeping and waking.
    fn wait(&mut self) -> std::io::Result<()> {
        if !self.ready.is_empty() {
            self.ring.submit()?;
            return Ok(());
        }
        self.ring.submit()?;
        let (ring, ports) = (&mut self.ring, &self.ports);
        if self.spin.spin(|| {
            !ring.completion().is_empty() || ports.iter().any(crate::dgram::DgramPort::ring_ready)
        }) {
            return Ok(());
        }
        let timeout = if self.shutdown_deadline.is_some() || !self.ports.is_empty() {
            // Wake up to enforce the shutdown deadline and expire idle datagram sessions even if
            // nothing completes.
            Some(types::Timespec::new().sec(1))
        } else {
            None
        };
        match timeout {
            Some(ts) => {
                let args = types::SubmitArgs::new().timespec(&ts);
                match self.ring.submitter().submit_with_args(1, &args) {
                    Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
                    r => r.map(|_| ()),
                }
            }
            None => match self.ring.submit_and_wait(1) {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(()),
                r => r.map(|_| ()),
            },
        }
    }

    /// Starts or stops watching the completion notifiers of datagram queues whose backend
    /// completes on its own threads, as the ports added or removed such queues.
    fn watch_port_notifiers(&mut self) {
        for (port, p) in self.ports.iter_mut().enumerate() {
            for (qi, inc, fd) in p.take_notifier_changes() {
                let user_data = ud(KIND_PORT_NOTIFY, inc, port << 20 | (qi & 0xf_ffff), 0);
                let entry = match fd {
                    Some(fd) => notifier_poll(fd, user_data),
                    None => opcode::AsyncCancel::new(user_data).build().user_data(ud(
                        KIND_CANCEL,
                        0,
                        0,
                        0,
                    )),
                };
                Pusher(&mut self.ring).push(entry);
            }
        }
    }

    /// Reads the ports whose receive ring the spin found a frame in, before their poll completion
    /// arrives (it still does, and finds the ring read).
    fn receive_ready_ports(&mut self) {
        for (port_idx, p) in self.ports.iter_mut().enumerate() {
            if p.ring_ready() {
                p.receive(&mut Pusher(&mut self.ring), &port_io_ud(port_idx));
            }
        }
    }

    fn reap(&mut self) {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        cqes.extend(self.ring.completion());
        for cqe in cqes.drain(..) {
            let (kind, inc, idx, slot) = ud_split(cqe.user_data());
            match kind {
                KIND_WAKE => {
                    self.drain_inbox();
                    self.arm_wake();
                    continue;
                }
                KIND_CANCEL => continue,
                KIND_PORT_NOTIFY => {
                    let (port, qi) = (idx >> 20, idx & 0xf_ffff);
                    if let Some(p) = self.ports.get_mut(port) {
                        let mut sq = Pusher(&mut self.ring);
                        p.reap(qi, inc, &mut sq);
                        if !cqueue::more(cqe.flags()) {
                            if let Some(fd) = p.notifier(qi, inc) {
                                sq.push(notifier_poll(fd, cqe.user_data()));
                            }
                        }
                    }
                    continue;
                }
                KIND_PORT_IN | KIND_PORT_IO => {
                    let (port, qi) = (idx >> 20, idx & 0xf_ffff);
                    let Some(p) = self
                        .ports
                        .get_mut(if kind == KIND_PORT_IN { idx } else { port })
                    else {
                        continue;
                    };
                    let mut sq = Pusher(&mut self.ring);
                    let user_data = port_io_ud(if kind == KIND_PORT_IN { idx } else { port });
                    if kind == KIND_PORT_IN {
                        if !cqueue::more(cqe.flags()) {
                            let poll = opcode::PollAdd::new(types::Fd(p.fd()), libc::POLLIN as u32)
                                .multi(true)
                                .build()
                                .user_data(ud(KIND_PORT_IN, 0, idx, 0));
                            sq.push(poll);
                        }
                        p.receive(&mut sq, &user_data);
                    } else {
                        // Answered after the whole batch of completions (below), so replies
                        // to one queue share datagrams (PROTOCOL.md §9.6).
                        p.complete(qi, inc, slot, cqe.user_data(), cqe.result(), &mut sq);
                    }
                    continue;
                }
                _ => {}
            }
            let Some(c) = self.conns.get_mut(idx).and_then(Option::as_mut) else {
                continue;
            };
            if c.incarnation != inc {
                continue; // a completion for a connection that has since been replaced
            }
            match kind {
                KIND_POLL_IN => {
                    c.readable = true;
                    if !cqueue::more(cqe.flags()) && !c.closing {
                        // The kernel ended the multishot poll (e.g. overflow): re-arm it.
                        let poll = opcode::PollAdd::new(types::Fd(c.fd()), libc::POLLIN as u32)
                            .multi(true)
                            .build()
                            .user_data(ud(KIND_POLL_IN, inc, idx, 0));
                        Pusher(&mut self.ring).push(poll);
                    }
                }
                KIND_POLL_OUT => c.want_out = false,
                KIND_IO => complete(
                    c,
                    slot,
                    cqe.user_data(),
                    cqe.result(),
                    &mut Pusher(&mut self.ring),
                ),
                KIND_NOTIFY => {
                    let mut sq = Pusher(&mut self.ring);
                    let mut reaped = std::mem::take(&mut self.reaped);
                    c.exec
                        .reap(&mut sq, &mut |tag, res| reaped.push((tag, res)));
                    for &(tag, res) in &reaped {
                        finish_result(c, ud_split(tag).3, res);
                    }
                    reaped.clear();
                    self.reaped = reaped;
                    if !cqueue::more(cqe.flags()) {
                        if let Some(fd) = c.exec.notifier() {
                            sq.push(notifier_poll(fd, cqe.user_data()));
                        }
                    }
                }
                _ => {}
            }
            self.ready.push_back(idx);
        }
        self.cqes = cqes;
        for p in &mut self.ports {
            p.flush();
        }
    }

    /// Moves one connection forward: read and dispatch requests, send replies, close if done.
    fn service(&mut self, idx: usize) {
        let Some(c) = self.conns.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        let mut sq = Pusher(&mut self.ring);
        // Alternate reading and sending until neither moves: sending may lift the tx high-water
        // mark that stopped parsing. Bounded so one busy connection cannot starve the others.
        let mut rounds = 0;
        while !c.dead {
            let before = (c.exec.stats.frames_in, c.bytes_sent);
            receive(c, idx, &mut sq);
            if c.tx_backlog() > 0 && !c.want_out {
                transmit(c, idx, &mut sq);
            }
            if before == (c.exec.stats.frames_in, c.bytes_sent) {
                break;
            }
            rounds += 1;
            if rounds == 16 {
                self.ready.push_back(idx);
                return;
            }
        }
        let drained = c.tx_backlog() == 0 || c.dead;
        if c.closing && c.inflight == 0 && drained {
            let c = self.conns[idx].take().expect("present");
            self.close(idx, c);
        }
    }

    fn close(&mut self, idx: usize, c: Conn) {
        // Cancel the multishot poll before the socket goes; its final completion is ignored by
        // incarnation.
        let cancel = opcode::AsyncCancel::new(ud(KIND_POLL_IN, c.incarnation, idx, 0))
            .build()
            .user_data(ud(KIND_CANCEL, 0, 0, 0));
        Pusher(&mut self.ring).push(cancel);
        if c.want_out {
            let cancel = opcode::AsyncCancel::new(ud(KIND_POLL_OUT, c.incarnation, idx, 0))
                .build()
                .user_data(ud(KIND_CANCEL, 0, 0, 0));
            Pusher(&mut self.ring).push(cancel);
        }
        if c.exec.notifier().is_some() {
            let cancel = opcode::AsyncCancel::new(ud(KIND_NOTIFY, c.incarnation, idx, 0))
                .build()
                .user_data(ud(KIND_CANCEL, 0, 0, 0));
            Pusher(&mut self.ring).push(cancel);
        }
        let _ = self.ring.submit();
        self.registry.leave(c.session, c.queue, &c.exec.stats);
        crate::log!(
            Level::Debug,
            "session {} queue {} closed: {} frames in, {} out, {} errors",
            c.session,
            c.queue,
            c.exec.stats.frames_in,
            c.exec.stats.frames_out,
            c.exec.stats.errors
        );
        self.free.push(idx);
        drop(c); // closes the socket
    }
}

/// Reads everything waiting on the socket and dispatches every complete frame.
fn receive(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    loop {
        // Dispatch what is buffered first: it may already hold many frames.
        parse_frames(c, idx, sq);
        if c.closing || !c.readable || c.tx_backlog() >= c.tx_high_water() {
            return;
        }
        if c.rx_end == c.rx.len() {
            if c.rx_start == 0 {
                return; // a whole frame is buffered but blocked (tx high water)
            }
            c.rx.copy_within(c.rx_start..c.rx_end, 0);
            c.rx_end -= c.rx_start;
            c.rx_start = 0;
        }
        // SAFETY: recv into the unused tail of our own buffer.
        let n = unsafe {
            libc::recv(
                c.fd(),
                c.rx[c.rx_end..].as_mut_ptr().cast(),
                c.rx.len() - c.rx_end,
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            c.rx_end += n as usize;
            continue;
        }
        let err = std::io::Error::last_os_error();
        match (n, err.raw_os_error()) {
            (0, _) => {
                // Orderly shutdown by the peer; whatever it sent before is still answered.
                parse_frames(c, idx, sq);
                c.closing = true;
                c.readable = false;
                crate::log!(
                    Level::Debug,
                    "session {} queue {}: peer closed",
                    c.session,
                    c.queue
                );
            }
            (_, Some(libc::EAGAIN)) => c.readable = false,
            (_, Some(libc::EINTR)) => continue,
            _ => {
                crate::log!(
                    Level::Info,
                    "session {} queue {}: receive failed: {err}",
                    c.session,
                    c.queue
                );
                c.closing = true;
                c.dead = true;
                c.readable = false;
            }
        }
        return;
    }
}

/// Dispatches every complete message in `rx[rx_start..rx_end]`.
fn parse_frames(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    loop {
        if c.dead || c.tx_backlog() >= c.tx_high_water() {
            return;
        }
        // Requests of frontends with cookies take a server-side slot if they go to a backend
        // that does not finish inline: stop when none is free; a completion frees one and
        // services this connection again.
        if !c.inline && c.fe.server_assigns_slots() && c.free_slots.is_empty() {
            return;
        }
        let (req, len, payload_len) = match c.fe.decode(&c.rx[c.rx_start..c.rx_end]) {
            Decoded::Need(total) => {
                c.make_room(total);
                break;
            }
            Decoded::Violation(e) => return c.violation(&e),
            Decoded::Request {
                req,
                len,
                payload_len,
            } => (req, len, payload_len),
        };
        let payload_at = c.rx_start + len - payload_len;
        c.rx_start += len;
        c.exec.stats.frames_in += 1;
        dispatch(c, idx, &req, payload_at, sq);
    }
    if c.rx_start == c.rx_end {
        c.rx_start = 0;
        c.rx_end = 0;
    }
}

fn dispatch(c: &mut Conn, idx: usize, req: &Req, payload_at: usize, sq: &mut Pusher<'_>) {
    let block = match req.kind {
        Kind::Block(_) => req.block().expect("a block request"),
        Kind::Keepalive => return c.reply(req, Status::Ok),
        Kind::Logout => {
            // Nothing after LOGOUT/DISC is executed (PROTOCOL.md §2.5); what is in flight is
            // still answered before the queue closes.
            c.reply(req, Status::Ok);
            c.closing = true;
            c.rx_start = c.rx_end;
            return;
        }
        Kind::Unsupported => return c.reply(req, Status::Unsupported),
        Kind::Invalid => return c.reply(req, Status::Invalid),
        Kind::Cache | Kind::BlockStatus => {
            if let Err(st) = c.exec.check_range(req.offset, req.length) {
                return c.reply(req, st);
            }
            if req.kind == Kind::BlockStatus {
                return block_status(c, req);
            }
            // Advisory: nothing to prefetch into for memory, and files have the page cache.
            return c.reply(req, Status::Ok);
        }
    };
    if let Some(s) = req.slot {
        match c.slots.get(s as usize) {
            None => return c.reply(req, Status::Invalid),
            Some(slot) if slot.busy => {
                return c.violation(&format_args!("slot {s} reused while in flight"))
            }
            Some(_) => {}
        }
    }
    if let Err(st) = c.exec.admit(&block) {
        return c.reply(req, st);
    }
    let len = block.len;

    if c.inline {
        // mem:/null: the request completes inside start(); READ lands straight in the reply
        // buffer and WRITE is taken straight from the receive buffer: one copy each way.
        if req.is_read() {
            if read_hole(c, req) {
                return;
            }
            let at = c.tx.len();
            let prefix = c.fe.read_prefix_len();
            // The prefix is zeroed, the data is not: the backend writes it straight into the
            // spare capacity and only then does the buffer grow over it.
            c.tx.resize(at + prefix, 0);
            c.tx.reserve(len as usize);
            // SAFETY: `reserve` made room for `len` bytes after the prefix.
            let buf = unsafe { c.tx.as_mut_ptr().add(at + prefix) };
            // SAFETY: the export completes inline, so the buffer is only used during the call.
            let status = match unsafe { c.exec.start(&block, buf, 0, sq) } {
                Outcome::Done(st) => st,
                Outcome::Pending => unreachable!("inline exports finish in start"),
            };
            if status == Status::Ok {
                // SAFETY: the backend initialised all `len` bytes (it reported success).
                unsafe { c.tx.set_len(at + prefix + len as usize) };
                c.fe.write_read_prefix(req, &mut c.tx[at..at + prefix]);
                c.count_reply(status);
            } else {
                c.tx.truncate(at);
                c.reply(req, status);
            }
            return;
        }
        // Only WRITE uses the buffer, and only reads it.
        let buf = c.rx[payload_at..].as_mut_ptr();
        // SAFETY: for a WRITE the receive buffer holds the whole payload (decode saw it), and
        // the export completes inline, so the buffer is only read during the call.
        let status = match unsafe { c.exec.start(&block, buf, 0, sq) } {
            Outcome::Done(st) => st,
            Outcome::Pending => unreachable!("inline exports finish in start"),
        };
        return c.reply(req, status);
    }

    // A backend that finishes later: the slot owns a buffer that lives until the completion.
    let slot = match req.slot {
        Some(s) => s,
        None => c
            .free_slots
            .pop()
            .expect("parse_frames checked for a free slot"),
    };
    let tag = ud(KIND_IO, c.incarnation, idx, slot);
    let align = c.exec.buffer_alignment();
    let s = &mut c.slots[slot as usize];
    let mut buf = std::ptr::null_mut();
    if block.op.moves_data() {
        if s.buf.as_ref().is_none_or(|b| b.len() < len as usize) {
            s.buf = Some(AlignedBuf::zeroed(len as usize, align));
        }
        let b = s.buf.as_mut().expect("just set");
        if req.is_read() {
            buf = b.as_mut_ptr();
        } else {
            b.as_mut_slice()[..len as usize]
                .copy_from_slice(&c.rx[payload_at..payload_at + len as usize]);
            buf = b.as_mut_ptr();
        }
    }
    // SAFETY: the slot's buffer holds `len` bytes and is neither freed nor touched until the
    // slot is released, which happens only once the result is delivered (a busy slot is never
    // reused, and a connection with slots in flight is never dropped).
    match unsafe { c.exec.start(&block, buf, tag, sq) } {
        Outcome::Done(status) => {
            release_slot(c, slot);
            c.reply(req, status);
        }
        Outcome::Pending => {
            let s = &mut c.slots[slot as usize];
            s.busy = true;
            s.req = Some(*req);
            c.inflight += 1;
        }
    }
}

/// A READ of a range that is all hole, for frontends that can say so without the zeros. Only
/// for large reads, where saving the data is worth an allocation query.
fn read_hole(c: &mut Conn, req: &Req) -> bool {
    if !c.fe.replies_with_holes() || req.length < (64 << 10) {
        return false;
    }
    let mut extents = std::mem::take(&mut c.extents);
    extents.clear();
    c.exec
        .export()
        .backend()
        .allocation(req.offset, req.length as u64, &mut extents);
    let hole = extents.len() == 1 && extents[0].hole && extents[0].len >= req.length as u64;
    c.extents = extents;
    if hole {
        c.fe.hole_reply(req, &mut c.tx);
        c.count_reply(Status::Ok);
    }
    hole
}

/// Returns a server-assigned slot to the free list (client-assigned slots are the client's).
fn release_slot(c: &mut Conn, slot: u16) {
    if c.fe.server_assigns_slots() {
        c.free_slots.push(slot);
    }
}

/// An allocation query: holes are unallocated ranges that read as zero.
fn block_status(c: &mut Conn, req: &Req) {
    let mut extents = std::mem::take(&mut c.extents);
    extents.clear();
    c.exec
        .export()
        .backend()
        .allocation(req.offset, req.length as u64, &mut extents);
    if req.flags.has(blkwire_backend::IoFlags::REQ_ONE) {
        extents.truncate(1);
    }
    // Lengths fit in u32: every extent lies inside the request, whose length is a u32.
    let list: Vec<(u32, bool)> = extents
        .iter()
        .map(|e| (e.len.min(u32::MAX as u64) as u32, e.hole))
        .collect();
    c.extents = extents;
    if c.fe.block_status_reply(req, &list, &mut c.tx) {
        c.count_reply(Status::Ok);
    } else {
        c.reply(req, Status::Invalid);
    }
}

/// A ring completion for a slot's request; more may be needed before it is finished.
fn complete(c: &mut Conn, slot: u16, tag: u64, res: i32, sq: &mut Pusher<'_>) {
    let Some(req) = c
        .slots
        .get(slot as usize)
        .filter(|s| s.busy)
        .and_then(|s| s.req)
    else {
        return;
    };
    let block = req.block().expect("slots hold block requests");
    if let Some(status) = c.exec.complete(&block, tag, res, sq) {
        finish(c, slot, status);
    }
}

/// A finished request's backend result (from a thread-completing backend).
fn finish_result(c: &mut Conn, slot: u16, res: i32) {
    let Some(req) = c
        .slots
        .get(slot as usize)
        .filter(|s| s.busy)
        .and_then(|s| s.req)
    else {
        return;
    };
    let status = c
        .exec
        .status(&req.block().expect("slots hold block requests"), res);
    finish(c, slot, status);
}

/// A request that ran on the backend finished: build its reply.
fn finish(c: &mut Conn, slot: u16, status: Status) {
    let s = &mut c.slots[slot as usize];
    s.busy = false;
    let req = s.req.take().expect("busy slot has a request");
    c.inflight -= 1;
    release_slot(c, slot);
    if status != Status::Ok {
        crate::log!(
            Level::Warn,
            "session {} queue {}: {:?} at {} len {} failed: {status}",
            c.session,
            c.queue,
            req.kind,
            req.offset,
            req.length,
        );
    }
    if req.is_read() && status == Status::Ok {
        let len = req.length as usize;
        let at = c.tx.len();
        let prefix = c.fe.read_prefix_len();
        c.tx.resize(at + prefix, 0);
        c.fe.write_read_prefix(&req, &mut c.tx[at..at + prefix]);
        let buf = c.slots[slot as usize].buf.as_ref().expect("read buffer");
        c.tx.extend_from_slice(&buf.as_slice()[..len]);
        c.count_reply(status);
    } else {
        c.reply(&req, status);
    }
}

/// Sends as much of the reply backlog as the socket takes; arms POLLOUT if it fills up.
fn transmit(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    while c.tx_sent < c.tx.len() {
        // SAFETY: send from our own buffer.
        let n = unsafe {
            libc::send(
                c.fd(),
                c.tx[c.tx_sent..].as_ptr().cast(),
                c.tx.len() - c.tx_sent,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            c.tx_sent += n as usize;
            c.bytes_sent += n as u64;
            continue;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => {
                c.want_out = true;
                let poll = opcode::PollAdd::new(types::Fd(c.fd()), libc::POLLOUT as u32)
                    .build()
                    .user_data(ud(KIND_POLL_OUT, c.incarnation, idx, 0));
                sq.push(poll);
                return;
            }
            _ => {
                crate::log!(
                    Level::Info,
                    "session {} queue {}: send failed: {err}",
                    c.session,
                    c.queue
                );
                c.dead = true;
                c.closing = true;
                return;
            }
        }
    }
    c.tx.clear();
    c.tx_sent = 0;
}
