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

mod conn;
mod ring;
mod stream;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_backend::{Export, Submitter};
use io_uring::{cqueue, opcode, types};

use crate::executor::Executor;
use crate::frontend::StreamFrontend;
use crate::log::Level;
use crate::session::Registry;
use crate::stats::{ClosedTotals, QueueStats};
pub use conn::stream_floor;
use conn::{receive, transmit, Conn, Slot, Target};
use ring::{
    poll_in, port_io_ud, ud, ud_split, Pusher, Ring, KIND_CANCEL, KIND_IO, KIND_NOTIFY,
    KIND_POLL_IN, KIND_POLL_OUT, KIND_PORT_IN, KIND_PORT_IO, KIND_PORT_NOTIFY, KIND_WAKE,
};
use stream::{broadcast_acked, complete, finish_result};

/// A queue connection that finished its handshake, handed to a reactor by message.
pub struct NewQueue {
    pub sock: OwnedFd,
    pub export: Arc<Export>,
    pub session: u32,
    pub queue: u16,
    /// The export's size the session was given (`Admitted::size`).
    pub size: u64,
    pub depth: u16,
    pub max_io: u32,
    pub peer: String,
    /// The protocol the connection speaks from now on, with its negotiated state.
    pub frontend: Box<dyn StreamFrontend>,
    /// The TLS session the handshake negotiated, if any: all bytes go through it.
    pub tls: Option<Box<crate::tls::TlsStream>>,
    /// Its account with the memory budget (holding its minimum since admission).
    pub mem: crate::budget::Account,
    /// Its place under `--max-connections`.
    pub counted: Option<crate::ConnCount>,
    /// The other exports the connection serves (targets 1.., in order), each admitted into its
    /// own session as queue `queue` (an NVMe/TCP I/O queue of a subsystem with several
    /// namespaces). Empty for native and NBD connections.
    pub more: Vec<crate::session::Admitted>,
}

pub enum Msg {
    Queue(NewQueue),
    /// A datagram socket this reactor serves from now on, for the listener with this id.
    Port(crate::dgram::PortSetup, u32),
    /// The listener with this id was removed: close its datagram sockets and their queues.
    ClosePort(u32),
    /// Close every queue of these sessions (the control plane revoked them): their requests
    /// in flight finish on the backend, but no reply is sent and the sockets shut at once.
    Close(Arc<[u32]>),
    /// Close this one queue: a new session of the initiator that held it replaces it
    /// (PROTOCOL.md §2.6). Its requests in flight finish on the backend, unanswered; the
    /// registry learns when the last has (`Registry::leave`).
    CloseQueue {
        session: u32,
        queue: u16,
    },
    /// Report every live queue's counters on the sender (the reactor owns them; no sharing).
    Stats(std::sync::mpsc::Sender<ReactorReport>),
    /// An export's persistent reservations changed (`crate::reservations`): every connection
    /// installs the update, then the reactor acknowledges to `ack`.
    Reservations {
        update: Arc<crate::reservations::Update>,
        ack: Option<crate::reservations::Ack>,
    },
    /// A reactor installed the update a connection of this one waits for.
    ReservationsAck(crate::reservations::Ack),
    /// Export `name` was removed: its closed queues' totals go to the removed sum now, so one
    /// added again under the name counts from zero (the inbox is in order: before any queue
    /// of the new one).
    ExportRemoved(Arc<str>),
    Shutdown,
}

/// A reactor's answer to [`Msg::Stats`]: its counters, all taken at the same moment.
pub struct ReactorReport {
    pub queues: Vec<QueueReport>,
    pub ports: Vec<crate::dgram::PortReport>,
    /// Its queues that closed (stream and datagram), per export.
    pub closed: ClosedTotals,
}

/// An export's identity while anything holds it (its allocation's address): a queue holds its
/// export, so no export added later can have it while the queue's report is read.
pub fn export_id(e: &Arc<blkwire_backend::Export>) -> usize {
    Arc::as_ptr(e) as usize
}

/// One live queue's counters, as a reactor reports them.
#[derive(Clone, Debug, serde::Serialize)]
pub struct QueueReport {
    #[serde(skip)]
    pub session: u32,
    #[serde(skip)]
    pub export: String,
    /// Which export by that name ([`export_id`]): one removed and added again while queues
    /// of the old one drain is another.
    #[serde(skip)]
    pub export_id: usize,
    pub queue: u16,
    pub thread: usize,
    pub in_flight: u32,
    #[serde(flatten)]
    pub stats: QueueStats,
}

pub struct Reactor {
    id: usize,
    ring: Ring,
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
    /// Connections that used up their turn (their read budget, or `service_conn`'s rounds):
    /// ready again only after the next reap, so completions, messages, datagram ports and
    /// every other connection go first.
    used_turn: Vec<usize>,
    /// Reused for every batch of completions (no allocation per loop).
    cqes: Vec<cqueue::Entry>,
    /// Datagram sockets (UDP, raw Ethernet) owned by this reactor.
    /// A removed listener's port is `None` once its last request finished (indexes stay: the
    /// ring's user data names ports by index).
    ports: Vec<Option<crate::dgram::DgramPort>>,
    /// Per port index, the incarnation a new port there starts at (`place_ports`).
    port_incarnations: Vec<u32>,
    /// Datagram sockets waiting for a port index (`place_ports`), with their listener.
    pending_ports: VecDeque<(crate::dgram::PortSetup, u32)>,
    /// Scratch for results reaped from thread-completing backends (no allocation per batch).
    reaped: Vec<(u64, i32)>,
    /// Connections waiting for memory the budget could not give; retried every few
    /// milliseconds (memory may come back on another thread, which does not tell this one).
    starved: Vec<usize>,
    /// When idle connections last gave back what their buffers grew to.
    last_trim: Instant,
    /// The target budget's use at the last look: less now means buffers were freed.
    budget_used: usize,
    last_release: Instant,
    /// A connection closed since the last release (`trim_idle`).
    release_pending: bool,
    /// Some connection holds more than its minimum: wake up at least once a second to see
    /// whether it went idle (otherwise the reactor may sleep until something happens).
    trim_pending: bool,
    /// Counters of the stream connections that closed here, and of the queues of the ports
    /// that were retired (live ports keep their closed queues').
    closed: ClosedTotals,
    /// The port counters of retired ports, by transport: reported with the live ports', so a
    /// counter summed over a thread's ports never goes back when one of them is removed.
    retired_ports: Vec<crate::dgram::PortReport>,
}

/// How often starved connections retry.
const STARVED_RETRY: Duration = Duration::from_millis(5);
/// Datagram sockets a reactor serves at once: a completion names its port in the 4 bits above
/// the queue's 20 of its connection field (`ring::port_io_ud`). The control plane refuses a
/// datagram listener past this many (`Shared::add_listener`).
pub const MAX_PORTS: usize = 16;
/// A connection that received nothing for this long gives back its grown buffers.
const IDLE_TRIM: Duration = Duration::from_secs(1);
/// How often freed memory may be handed back to the system (`budget::release_freed_memory`).
const RELEASE_EVERY: Duration = Duration::from_millis(100);

impl Reactor {
    pub fn new(
        id: usize,
        inbox: Receiver<Msg>,
        wake_fd: OwnedFd,
        registry: Arc<Registry>,
        poll: Duration,
    ) -> std::io::Result<Reactor> {
        let ring = Ring::new(1024)?;
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
            used_turn: Vec::new(),
            cqes: Vec::with_capacity(1024),
            ports: Vec::new(),
            port_incarnations: Vec::new(),
            pending_ports: VecDeque::new(),
            reaped: Vec::new(),
            starved: Vec::new(),
            last_trim: Instant::now(),
            budget_used: 0,
            last_release: Instant::now(),
            release_pending: false,
            trim_pending: false,
            closed: ClosedTotals::default(),
            retired_ports: Vec::new(),
        })
    }

    /// Runs until told to shut down and every connection has drained.
    pub fn run(mut self) {
        self.arm_wake();
        loop {
            self.drain_inbox();
            if self.shutting_down
                && self.conns.iter().all(Option::is_none)
                && self.ports.iter().flatten().all(|p| !p.has_running())
            {
                for p in self.ports.iter_mut().flatten() {
                    p.close_all();
                }
                // Updates that came after the last look are acknowledged, so no reactor still
                // serving waits for this one; none is sent to it from now on (`exiting`).
                self.registry.reservations.exiting(self.id);
                while let Ok(m) = self.inbox.try_recv() {
                    if let Msg::Reservations { ack: Some(ack), .. } = m {
                        self.registry.reservations.acknowledge(ack);
                    }
                }
                break;
            }
            self.place_ports();
            for p in self.ports.iter_mut().flatten() {
                p.sweep();
            }
            self.trim_idle();
            // Starved connections try again (memory may have come back in the meantime).
            for i in self.starved.drain(..) {
                if let Some(c) = self.conns.get_mut(i).and_then(Option::as_mut) {
                    c.waiting = false;
                    self.ready.push_back(i);
                }
            }
            while let Some(i) = self.ready.pop_front() {
                self.service(i);
            }
            // Served again after this turn's completions: `wait` does not sleep while they
            // are ready.
            self.ready.extend(self.used_turn.drain(..));
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

    /// Forgets the ports that retired (nothing of theirs runs, their notifiers unwatched),
    /// then serves the sockets waiting for a port index, each at the lowest free one:
    /// completions name a port in 4 bits (`port_io_ud`), and a removed listener's port keeps
    /// its index until its backend I/O is done, so a listener added just after one was removed
    /// may wait here for it (the control plane keeps at most [`MAX_PORTS`] listeners).
    fn place_ports(&mut self) {
        for (idx, p) in self.ports.iter_mut().enumerate() {
            if let Some(gone) = p.take_if(|p| p.retired()) {
                if self.port_incarnations.len() <= idx {
                    self.port_incarnations.resize(idx + 1, 1);
                }
                self.port_incarnations[idx] = gone.next_incarnation();
                // The socket can go; its closed queues' counters stay in the exports' totals.
                self.closed.merge(gone.closed());
                self.closed.fold(&self.registry.export_names());
                let r = gone.report(self.id);
                match self
                    .retired_ports
                    .iter_mut()
                    .find(|t| t.transport == r.transport)
                {
                    Some(t) => t.stats.add(&r.stats),
                    None => self.retired_ports.push(r),
                }
            }
        }
        while !self.pending_ports.is_empty() {
            let Some(idx) = (0..MAX_PORTS).find(|&i| self.ports.get(i).is_none_or(Option::is_none))
            else {
                return;
            };
            let (setup, listener) = self.pending_ports.pop_front().expect("not empty");
            let mut port = crate::dgram::DgramPort::new(setup, listener, self.registry.clone());
            // Its queues' incarnations go on from the last port at the index, so that no
            // completion of that port's could ever be taken for one of this port's.
            if let Some(&next) = self.port_incarnations.get(idx) {
                port.continue_incarnations(next);
            }
            let poll = poll_in(port.fd(), ud(KIND_PORT_IN, 0, idx, 0));
            Pusher(&mut self.ring).push(poll);
            if idx == self.ports.len() {
                self.ports.push(Some(port));
            } else {
                self.ports[idx] = Some(port);
            }
        }
    }

    fn drain_inbox(&mut self) {
        while let Ok(m) = self.inbox.try_recv() {
            match m {
                Msg::Queue(q) => self.add(q),
                Msg::Port(setup, listener) => {
                    self.pending_ports.push_back((setup, listener));
                    self.place_ports();
                }
                Msg::ClosePort(listener) => {
                    self.pending_ports.retain(|(_, l)| *l != listener);
                    for (idx, p) in self.ports.iter_mut().enumerate() {
                        let Some(p) = p.as_mut().filter(|p| p.listener() == listener) else {
                            continue;
                        };
                        p.retire();
                        let cancel = opcode::AsyncCancel::new(ud(KIND_PORT_IN, 0, idx, 0))
                            .build()
                            .user_data(ud(KIND_CANCEL, 0, 0, 0));
                        Pusher(&mut self.ring).push(cancel);
                    }
                }
                Msg::Close(sessions) => {
                    self.close_queues(|session, _| sessions.contains(&session));
                }
                Msg::ExportRemoved(name) => {
                    self.closed.forget(&name);
                    for p in self.ports.iter_mut().flatten() {
                        p.forget_closed(&name);
                    }
                }
                Msg::CloseQueue { session, queue } => {
                    self.close_queues(|s, q| (s, q) == (session, queue));
                }
                Msg::Stats(reply) => {
                    let mut queues: Vec<QueueReport> = self
                        .conns
                        .iter()
                        .flatten()
                        .flat_map(|c| {
                            c.targets.iter().enumerate().map(|(i, t)| QueueReport {
                                session: t.session,
                                export: t.exec.export().name.clone(),
                                export_id: export_id(t.exec.export()),
                                queue: t.queue,
                                thread: self.id,
                                // What is in flight is counted once, with the first target.
                                in_flight: if i == 0 { c.inflight } else { 0 },
                                stats: t.exec.stats,
                            })
                        })
                        .collect();
                    let mut closed = self.closed.clone();
                    for p in self.ports.iter().flatten() {
                        queues.extend(p.reports(self.id));
                        closed.merge(p.closed());
                    }
                    let ports = self
                        .ports
                        .iter()
                        .flatten()
                        .map(|p| p.report(self.id))
                        .chain(self.retired_ports.iter().cloned())
                        .collect();
                    let _ = reply.send(ReactorReport {
                        queues,
                        ports,
                        closed,
                    });
                }
                Msg::Reservations { update, ack } => {
                    for c in self.conns.iter_mut().flatten() {
                        c.fe.reservations_changed(&update);
                    }
                    if let Some(ack) = ack {
                        self.registry.reservations.acknowledge(ack);
                    }
                }
                Msg::ReservationsAck(ack) => {
                    let Some(c) = self.conns.get_mut(ack.conn).and_then(Option::as_mut) else {
                        continue;
                    };
                    if c.incarnation == ack.incarnation {
                        broadcast_acked(c, ack.seq, 1);
                        self.ready.push_back(ack.conn);
                    }
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

    /// Closes the queues `hit` names (by session and queue index), stream and datagram.
    fn close_queues(&mut self, hit: impl Fn(u32, u16) -> bool) {
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_mut() else {
                continue;
            };
            let mut any = false;
            for (i, t) in c.targets.iter_mut().enumerate() {
                if hit(t.session, t.queue) {
                    if !t.fenced {
                        c.fe.fenced(i as u8);
                    }
                    t.fenced = true;
                    any = true;
                }
            }
            // A connection keeps serving while one of its targets is left: only the closed
            // ones are fenced (their requests get NO_EXPORT).
            if !any || c.targets.iter().any(|t| !t.fenced) {
                continue;
            }
            // The peer learns at once (its I/O in flight fails); what the backend is still
            // doing for it completes, then the connection is dropped (and leaves the registry).
            // SAFETY: shutdown on a socket this connection owns.
            unsafe { libc::shutdown(c.fd(), libc::SHUT_RDWR) };
            c.dead = true;
            c.closing = true;
            self.ready.push_back(i);
        }
        for p in self.ports.iter_mut().flatten() {
            p.close_queues(&hit);
        }
    }

    fn add(&mut self, q: NewQueue) {
        // Closed (revoked, or replaced by a new session: PROTOCOL.md §2.6) while on its way
        // here: the close found nothing to close then, so it is not served now.
        let wanted = |s, i| self.registry.still_wanted(s, i);
        if !wanted(q.session, q.queue) || q.more.iter().any(|a| !wanted(a.session, a.queue)) {
            self.registry.leave(q.session, q.queue, &Default::default());
            for a in &q.more {
                self.registry.leave(a.session, a.queue, &Default::default());
            }
            return;
        }
        let Some(exec) = Executor::for_queue(
            &self.registry,
            &q.export,
            (q.session, q.queue),
            q.max_io,
            q.size,
        ) else {
            for a in &q.more {
                self.registry.leave(a.session, a.queue, &Default::default());
            }
            return;
        };
        let mut targets = vec![Target {
            inline: exec.completes_inline(),
            exec,
            session: q.session,
            queue: q.queue,
            fenced: false,
            _floor: None,
        }];
        let mut more = q.more.into_iter();
        while let Some(a) = more.next() {
            let Some(exec) = Executor::for_queue(
                &self.registry,
                &a.export,
                (a.session, a.queue),
                q.max_io,
                a.size,
            ) else {
                // All or nothing: the connection's other sessions are left too.
                for t in &targets {
                    self.registry.leave(t.session, t.queue, &Default::default());
                }
                for a in more {
                    self.registry.leave(a.session, a.queue, &Default::default());
                }
                return;
            };
            targets.push(Target {
                inline: exec.completes_inline(),
                exec,
                session: a.session,
                queue: a.queue,
                fenced: false,
                _floor: Some(a.mem),
            });
        }
        let idx = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        let incarnation = self.next_incarnation;
        self.next_incarnation = (self.next_incarnation + 1) & 0xf_ffff;
        // Sized for a 1 MiB frame plus batching room; grows (up to max I/O) only if a client sends
        // larger frames.
        let rx_cap = conn::rx_base(q.max_io);
        let mut conn = Conn {
            fe: q.frontend,
            free_slots: (0..q.depth).rev().collect(),
            deferred: std::collections::VecDeque::with_capacity(q.depth as usize),
            extents: Vec::new(),
            lists: 0,
            bufs: Default::default(),
            held: 0,
            held_in: 0,
            copying: false,
            targets,
            incarnation,
            session: q.session,
            queue: q.queue,
            max_io: q.max_io,
            peer: q.peer,
            rx: vec![0; rx_cap],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::with_capacity(conn::TX_KEEP),
            tx_sent: 0,
            tx_peak: 0,
            tx_data: Default::default(),
            tx_data_left: 0,
            pieces: Vec::new(),
            queued: 0,
            slots: (0..q.depth).map(|_| Slot::default()).collect(),
            inflight: 0,
            readable: true,
            want_out: false,
            closing: self.shutting_down,
            logout: None,
            dead: false,
            bytes_sent: 0,
            tls: q.tls,
            sock: q.sock,
            mem: q.mem,
            starved: false,
            waiting: false,
            request_waits: false,
            idle_mark: 0,
            _counted: q.counted,
            broadcasts: Vec::new(),
            next_broadcast: 0,
        };
        // From here on this reactor's inbox keeps it current (`crate::reservations`).
        conn.fe.attached();
        let poll = poll_in(conn.fd(), ud(KIND_POLL_IN, incarnation, idx, 0));
        Pusher(&mut self.ring).push(poll);
        // Each target's backend may complete on its own threads: its notifier's completions
        // carry the target's index where I/O completions carry a slot.
        for (t, target) in conn.targets.iter().enumerate() {
            if let Some(fd) = target.exec.notifier() {
                let notify = poll_in(fd, ud(KIND_NOTIFY, incarnation, idx, t as u16));
                Pusher(&mut self.ring).push(notify);
            }
        }
        self.conns[idx] = Some(conn);
        self.ready.push_back(idx);
    }

    /// Submits what is queued and waits for at least one completion, polling briefly first so a
    /// request arriving within `poll` is picked up without the cost of sleeping and waking.
    fn wait(&mut self) -> std::io::Result<()> {
        if !self.ready.is_empty() || self.ring.has_completions() {
            self.ring.submit()?;
            return Ok(());
        }
        self.ring.submit()?;
        let (ring, ports) = (&mut self.ring, &self.ports);
        if self.spin.spin(|| {
            ring.has_completions()
                || ports
                    .iter()
                    .flatten()
                    .any(crate::dgram::DgramPort::frames_waiting)
        }) {
            return Ok(());
        }
        let timeout = if !self.starved.is_empty() {
            Some(types::Timespec::new().nsec(STARVED_RETRY.as_nanos() as u32))
        } else if self.shutdown_deadline.is_some()
            || !self.ports.is_empty()
            || self.trim_pending
            || self.release_pending
        {
            // Wake up to enforce the shutdown deadline, expire idle datagram sessions, trim
            // idle connections and let go of removed exports' spare copy sources (an rbd:
            // image stays open behind one; `Conn::idle_work`) even if nothing completes.
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
            let Some(p) = p else { continue };
            for (qi, inc, fd) in p.take_notifier_changes() {
                let user_data = ud(KIND_PORT_NOTIFY, inc, port << 20 | (qi & 0xf_ffff), 0);
                let entry = match fd {
                    Some(fd) => poll_in(fd, user_data),
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
            let Some(p) = p else { continue };
            if p.frames_waiting() {
                p.receive(&mut Pusher(&mut self.ring), &port_io_ud(port_idx));
            }
        }
    }

    fn reap(&mut self) {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        self.ring.take_completions(&mut cqes);
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
                    if let Some(p) = self.ports.get_mut(port).and_then(Option::as_mut) {
                        let mut sq = Pusher(&mut self.ring);
                        p.reap(qi, inc, &mut sq);
                        if !cqueue::more(cqe.flags()) {
                            if let Some(fd) = p.notifier(qi, inc) {
                                sq.push(poll_in(fd, cqe.user_data()));
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
                        .and_then(Option::as_mut)
                    else {
                        continue;
                    };
                    if kind == KIND_PORT_IN && (p.retiring() || cqe.result() == -libc::ECANCELED) {
                        // The listener was removed: its poll is not armed again (nor is a
                        // cancelled poll of a port gone before this one took its index).
                        continue;
                    }
                    let mut sq = Pusher(&mut self.ring);
                    let user_data = port_io_ud(if kind == KIND_PORT_IN { idx } else { port });
                    if kind == KIND_PORT_IN {
                        if !cqueue::more(cqe.flags()) {
                            let poll = poll_in(p.fd(), ud(KIND_PORT_IN, 0, idx, 0));
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
                        let poll = poll_in(c.fd(), ud(KIND_POLL_IN, inc, idx, 0));
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
                    // `slot` is the target whose notifier fired.
                    let Some(t) = c.targets.get_mut(slot as usize) else {
                        continue;
                    };
                    t.exec
                        .reap(&mut sq, &mut |tag, res| reaped.push((tag, res)));
                    let fd = t.exec.notifier();
                    for &(tag, res) in &reaped {
                        finish_result(c, ud_split(tag).3, tag, res);
                    }
                    reaped.clear();
                    self.reaped = reaped;
                    if !cqueue::more(cqe.flags()) {
                        if let Some(fd) = fd {
                            sq.push(poll_in(fd, cqe.user_data()));
                        }
                    }
                }
                _ => {}
            }
            self.ready.push_back(idx);
        }
        self.cqes = cqes;
        for p in self.ports.iter_mut().flatten() {
            p.flush();
        }
    }

    /// Moves one connection forward (`service_conn`), then hands the other reactors the state
    /// changes its requests made (`send_broadcasts`).
    fn service(&mut self, idx: usize) {
        self.service_conn(idx);
        if self
            .conns
            .get(idx)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.broadcasts.iter().any(|b| b.update.is_some()))
        {
            self.send_broadcasts(idx);
        }
    }

    /// Installs the updates the connection `idx` made (persistent reservations) in this
    /// reactor's other connections, then sends them to the other reactors; each request is
    /// answered once they all acknowledged (at once when there are none).
    fn send_broadcasts(&mut self, idx: usize) {
        let Some(c) = self.conns.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        let incarnation = c.incarnation;
        let pending: Vec<_> = c
            .broadcasts
            .iter_mut()
            .filter_map(|b| Some((b.seq, b.update.take()?)))
            .collect();
        for (seq, update) in pending {
            for (j, other) in self.conns.iter_mut().enumerate() {
                if let Some(o) = other.as_mut().filter(|_| j != idx) {
                    o.fe.reservations_changed(&update);
                }
            }
            let ack = crate::reservations::Ack {
                reactor: self.id,
                conn: idx,
                incarnation,
                seq,
            };
            let sent = self.registry.reservations.broadcast(&update, ack);
            if let Some(c) = self.conns.get_mut(idx).and_then(Option::as_mut) {
                if let Some(b) = c.broadcasts.iter_mut().find(|b| b.seq == seq) {
                    b.left = sent;
                }
                broadcast_acked(c, seq, 0);
            }
        }
        self.ready.push_back(idx);
    }

    /// Moves one connection forward: read and dispatch requests, send replies, close if done.
    fn service_conn(&mut self, idx: usize) {
        let Some(c) = self.conns.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        let mut sq = Pusher(&mut self.ring);
        // Alternate reading and sending until neither moves: sending may lift the tx high-water
        // mark that stopped parsing. Bounded so one busy connection cannot starve the others.
        let mut rounds = 0;
        while !c.dead {
            let before = (c.frames_in(), c.bytes_sent);
            let more = receive(c, idx, &mut sq);
            if c.tx_backlog() > 0 && !c.want_out {
                transmit(c, idx, &mut sq);
            }
            if more {
                // Its read budget spent: the others' turn first.
                self.used_turn.push(idx);
                break;
            }
            if before == (c.frames_in(), c.bytes_sent) {
                break;
            }
            rounds += 1;
            if rounds == 16 {
                self.used_turn.push(idx);
                return;
            }
        }
        // Charged only when the buffers changed size (growth, or given back).
        c.settle_memory();
        self.trim_pending |= c.idle_work();
        // Closing (the peer shut its side) but for a request it sent before that waits for
        // memory in the receive buffer: retried as any starved connection, so it is answered
        // (and a DISC/LOGOUT behind it taken) before the connection goes.
        let request_waits = c.request_waits && !c.dead;
        if c.starved && !c.waiting && (!c.closing || request_waits) {
            c.waiting = true;
            self.starved.push(idx);
        }
        if c.inflight == 0 && !c.dead {
            if let Some(req) = c.logout.take() {
                c.reply(&req, blkwire_wire::Status::Ok);
                if !c.want_out {
                    transmit(c, idx, &mut sq);
                }
            }
        }
        let drained = c.tx_backlog() == 0 || c.dead;
        if c.closing && c.inflight == 0 && drained && !request_waits {
            let c = self.conns[idx].take().expect("present");
            self.close(idx, c);
        }
    }

    /// Connections that received nothing since the last look, a second ago, and have nothing
    /// in flight give back what their buffers grew to (to the budget and the allocator).
    fn trim_idle(&mut self) {
        let mut trimmed = false;
        if self.last_trim.elapsed() >= IDLE_TRIM {
            self.last_trim = Instant::now();
            self.trim_pending = false;
            trimmed = true;
            for c in self.conns.iter_mut().flatten() {
                for t in c.targets.iter_mut() {
                    t.exec.drop_gone_sources();
                }
                let frames = c.frames_in();
                if frames == c.idle_mark && c.inflight == 0 && c.tx_backlog() == 0 {
                    c.trim();
                }
                c.idle_mark = frames;
                self.trim_pending |= c.idle_work();
            }
        }
        // What connections, ports and sessions gave back to the budget is in the allocator's
        // free lists: hand it to the system right after an idle trim or a close, and under
        // churn at most ten times a second when the budget shrank (freed buffers would
        // otherwise pile up between idle ticks).
        if trimmed || self.release_pending || self.last_release.elapsed() >= RELEASE_EVERY {
            self.last_release = Instant::now();
            let used = self.registry.budget().used();
            if self.release_pending || used < self.budget_used {
                crate::budget::release_freed_memory();
            }
            self.release_pending = false;
            self.budget_used = used;
        }
    }

    fn close(&mut self, idx: usize, mut c: Conn) {
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
        for (t, target) in c.targets.iter().enumerate() {
            if target.exec.notifier().is_some() {
                let cancel =
                    opcode::AsyncCancel::new(ud(KIND_NOTIFY, c.incarnation, idx, t as u16))
                        .build()
                        .user_data(ud(KIND_CANCEL, 0, 0, 0));
                Pusher(&mut self.ring).push(cancel);
            }
        }
        let _ = self.ring.submit();
        for t in &c.targets {
            self.closed
                .add_queue(&self.registry, t.exec.export(), &t.exec.stats);
            self.registry.leave(t.session, t.queue, &t.exec.stats);
        }
        let s = &c.targets[0].exec.stats;
        crate::log!(
            Level::Debug,
            "session {} queue {} closed: {} frames in, {} out, {} errors",
            c.session,
            c.queue,
            s.frames_in,
            s.frames_out,
            s.errors
        );
        self.free.push(idx);
        let dead = c.dead;
        if let Some(t) = c.tls.as_mut().filter(|_| !dead) {
            // A clean end of a TLS connection says so (close_notify; NBD's DISC must close the
            // TLS session): best effort, never waited for, since the socket may be full.
            let _ = t.shutdown();
            let _ = t.get_mut().flush_out();
        }
        drop(c); // closes the socket
                 // What it held goes back to the system on the next turn (`trim_idle`).
        self.release_pending = true;
    }
}
