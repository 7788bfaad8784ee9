//! The metrics endpoint: every counter of a [`Snapshot`] in the Prometheus text exposition
//! format (version 0.0.4), served over HTTP by one thread of its own (docs/METRICS.md lists the
//! metrics). The thread serves every connection at once from one poll loop, each with a
//! deadline and a bounded request head: a client that trickles, floods, says nothing or reads
//! its reply slowly holds one place among [`MAX_CLIENTS`] (and [`MAX_CLIENTS_PER_PEER`] of its
//! host's: an address, or an IPv6 /64) until its deadline, never the thread, and a newcomer
//! takes the place of the oldest that has not sent its request yet, or else of the oldest
//! being answered (a scraper takes its reply at once; one that sits on it is the one to go).
//! Scrapes that come while a render is still being sent share it. A counter never goes back from one scrape to the next ([`Monotonic`]), even
//! when a reactor was left out of one.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::{self, Reply, MAX_HEAD, METRICS_PATH};
use crate::log::{Level, Throttle};
use crate::reactor::Msg;
use crate::snapshot::Snapshot;
use crate::stats::{Histogram, QueueStats, BUCKETS, OPS};
use crate::{Error, Shared, Target};

/// A request's head must arrive within this time of its connection being accepted.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// The reply must be taken by the client within this time.
const REPLY_DEADLINE: Duration = Duration::from_secs(10);
/// What is read and thrown away after the reply (see `Stage::Drain`).
const DRAIN_LIMIT: usize = 64 << 10;
/// Connections served at once. A newcomer past it takes the place of the oldest connection
/// still sending its request (which is closed unanswered), or else of the one answered
/// longest: clients that say nothing, or ask and never read, cannot keep a scraper out.
const MAX_CLIENTS: usize = 64;
/// Connections one address may hold at once, a newcomer past it taking the place of that
/// address's oldest still sending its request: one client cannot crowd out the others.
const MAX_CLIENTS_PER_PEER: usize = 16;
/// A render still being sent to a client serves the scrapes that come within this long of it:
/// slow readers then hold at most about one render per second of the reply deadline, not one
/// each (a render is large with many exports, and each takes a round of messages to every
/// reactor). A scrape after every earlier reply went out gets a fresh one.
const RENDER_SHARED: Duration = Duration::from_secs(1);

/// `Content-Type` of the metrics (the text exposition format).
const METRICS_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

impl Target {
    /// Serves the target's counters in the Prometheus text format over HTTP at `addr`
    /// (`ADDR:PORT`; port 0 picks a free port): the `metrics_listen` call. Returns the URL to
    /// scrape.
    pub fn serve_metrics(&self, addr: &str) -> Result<String, Error> {
        self.shared.serve_metrics(addr)
    }

    /// The URL the metrics endpoint serves, if one was opened.
    pub fn metrics_url(&self) -> Option<String> {
        let bound = self
            .shared
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        bound.as_ref().map(|a| format!("http://{a}/metrics"))
    }
}

impl Shared {
    /// Opens the metrics endpoint: `GET /metrics` on a thread of its own, which ends when the
    /// target is stopped ([`crate::StopHandle::stop`]). One per target. Returns the URL to
    /// scrape.
    pub(crate) fn serve_metrics(self: &Arc<Self>, addr: &str) -> Result<String, Error> {
        let mut bound = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = bound.as_ref() {
            return Err(Error::Listen(format!(
                "metrics are served already, on {b} (one endpoint per target)"
            )));
        }
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map(|a| a.collect())
            .ok()
            .filter(|a: &Vec<SocketAddr>| !a.is_empty())
            .ok_or_else(|| {
                Error::Config(format!(
                    "bad metrics address '{addr}': expected ADDR:PORT, e.g. 127.0.0.1:9100 or \
                     [::1]:9100"
                ))
            })?;
        let listener = TcpListener::bind(&addrs[..])
            .map_err(|e| Error::Listen(format!("cannot serve metrics on {addr}: {e}")))?;
        let system = |e: std::io::Error| Error::System(format!("metrics endpoint: {e}"));
        // Non-blocking, so a connection that went away between poll and accept cannot hang
        // the thread in accept (and so miss the stop).
        listener.set_nonblocking(true).map_err(system)?;
        let local = listener.local_addr().map_err(system)?;
        let mut endpoint = Endpoint {
            listener,
            shared: self.clone(),
            reported: Monotonic::default(),
            rendered: None,
            clients: Vec::new(),
            accept_after: None,
        };
        std::thread::Builder::new()
            .name("blkwire-metrics".into())
            .spawn(move || endpoint.run())
            .map_err(|e| Error::System(format!("cannot start the metrics thread: {e}")))?;
        *bound = Some(local.to_string());
        Ok(format!("http://{local}/metrics"))
    }
}

struct Endpoint {
    listener: TcpListener,
    /// The target's registry, reactors and stop eventfd (readable once it stops: nobody reads
    /// it). Held until the thread ends, so the reactors' wake descriptors stay open while a
    /// scrape may write to them.
    shared: Arc<Shared>,
    /// What the last scrapes reported, so that counters never go back.
    reported: Monotonic,
    /// The last render of the metrics and when it was made ([`RENDER_SHARED`]).
    rendered: Option<(Instant, Arc<[u8]>)>,
    /// The connections being served, oldest first.
    clients: Vec<Client>,
    /// Accepting failed (out of descriptors or memory): the listener is left alone until then.
    accept_after: Option<Instant>,
}

/// Which of the connections (stage and peer address, oldest first) to close for a newcomer,
/// among those of host `ip` if given: the oldest still sending its head, else the oldest.
fn to_close(clients: impl Iterator<Item = (Stage, IpAddr)>, ip: Option<IpAddr>) -> Option<usize> {
    let mut oldest = None;
    let theirs = clients
        .enumerate()
        .filter(|(_, (_, peer))| ip.is_none_or(|ip| crate::access::host_prefix(*peer) == ip));
    for (i, (stage, _)) in theirs {
        if stage == Stage::Head {
            return Some(i);
        }
        oldest.get_or_insert(i);
    }
    oldest
}

/// Where a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Reading its request head.
    Head,
    /// Sending the reply.
    Reply,
    /// The reply is sent: reading what the client sent after its head, so that closing with
    /// unread bytes does not reset the connection (and lose the reply with it).
    Drain,
}

/// One connection of the endpoint.
struct Client {
    s: TcpStream,
    peer: SocketAddr,
    accepted: Instant,
    stage: Stage,
    /// When the stage ends: the head's deadline, the reply's, or the drain's.
    deadline: Instant,
    /// The head read so far ([`MAX_HEAD`] at most).
    head: Vec<u8>,
    /// The reply's status line and headers, then its body (shared with every client of the
    /// same render); `sent` bytes of both went out.
    reply_head: Vec<u8>,
    body: Arc<[u8]>,
    sent: usize,
    /// Bytes drained so far ([`DRAIN_LIMIT`] at most).
    drained: usize,
}

impl Endpoint {
    fn run(&mut self) {
        let mut failed = Throttle::new();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            let now = Instant::now();
            let accepting = self.accept_after.is_none_or(|t| t <= now);
            fds.clear();
            let fd = |fd, events| libc::pollfd {
                fd,
                events,
                revents: 0,
            };
            fds.push(fd(self.shared.stop.as_raw_fd(), libc::POLLIN));
            fds.push(fd(
                if accepting {
                    self.listener.as_raw_fd()
                } else {
                    -1
                },
                libc::POLLIN,
            ));
            for c in &self.clients {
                let events = match c.stage {
                    Stage::Reply => libc::POLLOUT,
                    Stage::Head | Stage::Drain => libc::POLLIN,
                };
                fds.push(fd(c.s.as_raw_fd(), events));
            }
            let wake = self
                .clients
                .iter()
                .map(|c| c.deadline)
                .chain(self.accept_after.filter(|_| !accepting))
                .min();
            // Rounded up: a deadline less than a millisecond away must not become a busy loop.
            let ms = wake.map_or(-1, |t| {
                let d = t.saturating_duration_since(now);
                d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            });
            // SAFETY: poll over our own pollfd array.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                crate::log!(Level::Error, "metrics endpoint: poll: {e}; stopped serving");
                return;
            }
            if fds[0].revents != 0 {
                return;
            }
            let now = Instant::now();
            // Clients first (their indices are the pollfds'), then newcomers.
            let mut i = 0;
            let mut k = 2;
            while i < self.clients.len() {
                let ready = fds[k].revents != 0;
                k += 1;
                if (ready || self.clients[i].deadline <= now) && !self.step(i, now) {
                    self.clients.remove(i);
                    continue;
                }
                i += 1;
            }
            if accepting && fds[1].revents != 0 {
                self.accept(now, &mut failed);
            }
        }
    }

    /// Takes the connections waiting (a bounded number per turn, so clients are served too).
    fn accept(&mut self, now: Instant, failed: &mut Throttle) {
        self.accept_after = None;
        for _ in 0..MAX_CLIENTS {
            let (s, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    if let Some(n) = failed.hit() {
                        crate::log!(
                            Level::Warn,
                            "metrics endpoint: accept failed {n} time(s): {e}"
                        );
                    }
                    // Out of descriptors or memory, the listener stays readable: rest instead
                    // of spinning on it (the clients are served meanwhile).
                    self.accept_after = Some(now + crate::ACCEPT_PAUSE);
                    return;
                }
            };
            if s.set_nonblocking(true).is_err() {
                continue;
            }
            let ip = crate::access::host_prefix(peer.ip());
            let same = |c: &Client| crate::access::host_prefix(c.peer.ip()) == ip;
            let theirs = self.clients.iter().filter(|c| same(c)).count();
            let room = if theirs >= MAX_CLIENTS_PER_PEER {
                self.make_room(Some(ip))
            } else if self.clients.len() >= MAX_CLIENTS {
                self.make_room(None)
            } else {
                true
            };
            if !room {
                continue;
            }
            self.clients.push(Client {
                s,
                peer,
                accepted: now,
                stage: Stage::Head,
                deadline: now + REQUEST_DEADLINE,
                head: Vec::new(),
                reply_head: Vec::new(),
                body: Arc::from(&[][..]),
                sent: 0,
                drained: 0,
            });
        }
    }

    /// Closes the oldest connection (of host `ip`, if given) still sending its head, for a
    /// newcomer, or else the one answered longest: a scraper takes its reply in moments, so
    /// clients that asked and then sit on their replies (a zero window) until the deadline
    /// must not keep it out. False if there is no connection to close.
    fn make_room(&mut self, ip: Option<IpAddr>) -> bool {
        let clients = self.clients.iter().map(|c| (c.stage, c.peer.ip()));
        match to_close(clients, ip) {
            Some(i) => {
                let c = self.clients.remove(i);
                crate::log!(
                    Level::Debug,
                    "metrics endpoint: {}: closed for a newer connection",
                    c.peer
                );
                true
            }
            None => false,
        }
    }

    /// Moves client `i` on as far as its socket allows; false when it is done (to close).
    fn step(&mut self, i: usize, now: Instant) -> bool {
        match self.clients[i].stage {
            Stage::Head => self.read_head(i, now),
            Stage::Reply => self.send(i, now),
            Stage::Drain => drain(&mut self.clients[i], now),
        }
    }

    fn read_head(&mut self, i: usize, now: Instant) -> bool {
        let c = &mut self.clients[i];
        let mut buf = [0u8; 4096];
        let reply = loop {
            let want = (MAX_HEAD - c.head.len()).min(buf.len());
            match c.s.read(&mut buf[..want]) {
                Ok(0) => return false,
                Ok(n) => {
                    c.head.extend_from_slice(&buf[..n]);
                    if let Some(end) = http::head_end(&c.head) {
                        break http::reply_to(&c.head[..end]);
                    }
                    if c.head.len() == MAX_HEAD {
                        break Reply::HeadTooLarge;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if c.deadline <= now {
                        break Reply::RequestTimeout;
                    }
                    return true;
                }
                Err(_) => return false,
            }
        };
        self.answer(i, reply, now);
        self.send(i, now)
    }

    /// Builds client `i`'s reply; it goes out from the next `send`.
    fn answer(&mut self, i: usize, reply: Reply, now: Instant) {
        let (code, reason) = reply.status();
        let (body, content_type) = match reply {
            Reply::Metrics => (self.metrics(), METRICS_TYPE),
            _ => {
                crate::log!(
                    Level::Debug,
                    "metrics endpoint: {}: {code} {reason}",
                    self.clients[i].peer
                );
                let text = format!(
                    "{code} {reason}: the metrics are at GET {}\n",
                    String::from_utf8_lossy(METRICS_PATH)
                );
                (Arc::from(text.into_bytes()), "text/plain; charset=utf-8")
            }
        };
        let allow = if reply == Reply::MethodNotAllowed {
            "Allow: GET\r\n"
        } else {
            ""
        };
        let c = &mut self.clients[i];
        c.reply_head = format!(
            "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
             {allow}Connection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        c.body = body;
        c.head = Vec::new();
        c.stage = Stage::Reply;
        c.deadline = now + REPLY_DEADLINE;
    }

    /// The metrics now: the last render while a client still receives it and it is recent
    /// ([`RENDER_SHARED`]), else a fresh one.
    fn metrics(&mut self) -> Arc<[u8]> {
        if let Some((at, body)) = &self.rendered {
            if Arc::strong_count(body) > 1 && at.elapsed() < RENDER_SHARED {
                return body.clone();
            }
        }
        let snap = self.snapshot();
        let text = render(&snap);
        let body: Arc<[u8]> = Arc::from(self.reported.apply(&text, !snap.complete).into_bytes());
        self.rendered = Some((Instant::now(), body.clone()));
        body
    }

    /// Sends what client `i`'s socket takes of its reply; then it drains.
    fn send(&mut self, i: usize, now: Instant) -> bool {
        let c = &mut self.clients[i];
        let total = c.reply_head.len() + c.body.len();
        while c.sent < total {
            let (h, b) = (c.reply_head.len(), &c.body[..]);
            let parts = if c.sent < h {
                [IoSlice::new(&c.reply_head[c.sent..]), IoSlice::new(b)]
            } else {
                [IoSlice::new(&b[c.sent - h..]), IoSlice::new(&[])]
            };
            match c.s.write_vectored(&parts) {
                Ok(0) => return false,
                Ok(n) => c.sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return c.deadline > now,
                Err(_) => return false,
            }
        }
        let _ = c.s.shutdown(Shutdown::Write);
        c.body = Arc::from(&[][..]);
        c.reply_head = Vec::new();
        c.stage = Stage::Drain;
        // What the client sent after its head is read until the request's own deadline.
        c.deadline = c.accepted + REQUEST_DEADLINE;
        drain(c, now)
    }

    fn snapshot(&self) -> Snapshot {
        let workers: Vec<(Sender<Msg>, RawFd)> = self
            .shared
            .workers
            .iter()
            .map(|w| (w.tx.clone(), w.wake.as_raw_fd()))
            .collect();
        Snapshot::gather(&self.shared.registry, &workers)
    }
}

/// Reads and discards what the client sends until it closes, [`DRAIN_LIMIT`] bytes, or its
/// deadline; false once done.
fn drain(c: &mut Client, now: Instant) -> bool {
    let mut scratch = [0u8; 4096];
    while c.drained < DRAIN_LIMIT {
        match c.s.read(&mut scratch) {
            Ok(0) => return false,
            Ok(n) => c.drained += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return c.deadline > now,
            Err(_) => return false,
        }
    }
    false
}

/// The value each counter series (counters, and histograms' buckets, sums and counts) was last
/// reported at. A snapshot may leave out a reactor that did not answer in time, and with it
/// part of an export's totals: reporting those lower totals would make the counter go back,
/// which Prometheus takes for a reset (rate() jumps). In such a snapshot a series found lower
/// than last reported is reported at its last value instead; gauges go as they are. A
/// complete snapshot goes as it is: a series lower then is a real reset (an export removed and
/// added again under its name counts from zero), which Prometheus handles as one. Taking the larger of two
/// consistent histograms bucket by bucket keeps one consistent (cumulative buckets, `+Inf`
/// equal to `_count`). Series absent from a scrape are forgotten (a closed queue's), so this
/// holds no more than the last scrape's series.
#[derive(Default)]
struct Monotonic(HashMap<String, (f64, String)>);

impl Monotonic {
    /// `text` (as [`render`] writes it) with every counter series at least what it was last
    /// reported at, when `partial` (a reactor left out); as it is otherwise.
    fn apply(&mut self, text: &str, partial: bool) -> String {
        let mut out = String::with_capacity(text.len());
        let mut now = HashMap::with_capacity(self.0.len());
        let mut counting = false;
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                counting = rest.ends_with(" counter") || rest.ends_with(" histogram");
            }
            let sample = (counting && !l.starts_with('#'))
                .then(|| l.rsplit_once(' '))
                .flatten()
                .and_then(|(series, v)| Some((series, v, v.parse::<f64>().ok()?)));
            let Some((series, v, value)) = sample else {
                out.push_str(l);
                out.push('\n');
                continue;
            };
            let kept = match self.0.remove(series) {
                Some(last) if partial && last.0 > value => last,
                _ => (value, v.to_string()),
            };
            let _ = writeln!(out, "{series} {}", kept.1);
            now.insert(series.to_string(), kept);
        }
        self.0 = now;
        out
    }
}

/// A counter every queue and export has, read from its [`QueueStats`].
struct Counter {
    /// After `blkwire_queue_` or `blkwire_export_`.
    name: &'static str,
    help: &'static str,
    value: fn(&QueueStats) -> u64,
}

const COUNTERS: [Counter; 9] = [
    Counter {
        name: "frames_in_total",
        help: "Messages received: requests, solicited write data, and on datagrams every fragment",
        value: |s| s.frames_in,
    },
    Counter {
        name: "frames_out_total",
        help: "Replies sent (one per request, however many fragments it took)",
        value: |s| s.frames_out,
    },
    Counter {
        name: "read_bytes_total",
        help: "Bytes of READs that succeeded",
        value: |s| s.bytes_read,
    },
    Counter {
        name: "written_bytes_total",
        help: "Bytes of WRITEs started",
        value: |s| s.bytes_written,
    },
    Counter {
        name: "copies_total",
        help: "COPY requests started (server-side copies, PROTOCOL.md section 13)",
        value: |s| s.copies,
    },
    Counter {
        name: "copied_bytes_total",
        help: "Bytes COPY requests copied inside the target (none of them crossed the network)",
        value: |s| s.bytes_copied,
    },
    Counter {
        name: "errors_total",
        help: "Replies with a status other than OK",
        value: |s| s.errors,
    },
    Counter {
        name: "protocol_errors_total",
        help: "Frames that broke the protocol (a stream queue closes after one)",
        value: |s| s.protocol_errors,
    },
    Counter {
        name: "dropped_duplicates_total",
        help: "Datagram requests that were late, duplicates or stale: dropped, or answered \
               from the reply of the request they repeat; on streams, iSCSI commands dropped \
               for their CmdSN (0 on other streams)",
        value: |s| s.dropped_duplicates,
    },
];

/// A datagram port counter, read from its `PortStats`.
struct PortCounter {
    name: &'static str,
    help: &'static str,
    value: fn(&crate::dgram::PortStats) -> u64,
}

const PORT_COUNTERS: [PortCounter; 8] = [
    PortCounter {
        name: "blkwire_port_bad_frames_total",
        help: "Datagram frames that were malformed or failed their CRC.",
        value: |p| p.bad_frames,
    },
    PortCounter {
        name: "blkwire_port_unknown_session_frames_total",
        help: "Datagram I/O frames for a session the port does not know (answered ACCESS).",
        value: |p| p.unknown_session,
    },
    PortCounter {
        name: "blkwire_port_wrong_peer_frames_total",
        help: "Datagram frames for a queue from another address than the one that joined it.",
        value: |p| p.wrong_peer,
    },
    PortCounter {
        name: "blkwire_port_no_memory_drops_total",
        help: "Datagram requests dropped because the memory budget had no room for their data.",
        value: |p| p.no_memory,
    },
    PortCounter {
        name: "blkwire_port_copies_held_back_total",
        help: "Datagram COPYs dropped because their host already ran 8 at once on the port.",
        value: |p| p.copies_held_back,
    },
    PortCounter {
        name: "blkwire_port_bad_seal_frames_total",
        help: "Frames of sealed sessions that were not sealed, did not verify or were replayed.",
        value: |p| p.bad_seal,
    },
    PortCounter {
        name: "blkwire_port_fragments_in_place_total",
        help:
            "UDP WRITE fragments received straight where they belong, with no copy of the target's.",
        value: |p| p.fragments_in_place,
    },
    PortCounter {
        name: "blkwire_port_writes_reclaimed_total",
        help: "Datagram WRITEs being assembled whose buffer went to another host's request \
               (the port's share was full and their host held the most); begun again by their \
               next fragment.",
        value: |p| p.writes_reclaimed,
    },
];

const REQUESTS_HELP: &str = "Requests started, by operation";
const DURATION_HELP: &str = "Time from a request's start on the backend to its result, by \
                             operation (not the time it waited to be read or its reply to be sent)";

/// The snapshot in the text exposition format.
pub fn render(snap: &Snapshot) -> String {
    let mut out = Text::default();
    out.family("blkwire_sessions", "gauge", "Sessions open.");
    out.sample("blkwire_sessions", "", snap.sessions.len());
    out.family(
        "blkwire_session_info",
        "gauge",
        "One series per open session, always 1: its export, the host id its HELLO gave, its \
         peer's address.",
    );
    for s in &snap.sessions {
        let labels = labels(&[
            ("session", &s.session),
            ("export", &s.export),
            ("host", &s.host),
            ("peer", &s.peer),
        ]);
        out.sample("blkwire_session_info", &labels, 1);
    }
    out.gauge(
        "blkwire_memory_limit_bytes",
        "The memory budget for connection and session buffers (serve --max-memory).",
        snap.memory_limit,
    );
    out.gauge(
        "blkwire_memory_used_bytes",
        "What connection and session buffers hold of the memory budget.",
        snap.memory_used,
    );
    out.counter(
        "blkwire_auth_challenges_total",
        "HELLOs and JOINs answered with a challenge.",
        snap.challenges,
    );
    out.counter(
        "blkwire_auth_refused_total",
        "Connections and handshakes refused by authentication or access rules.",
        snap.refused,
    );
    render_ports(&mut out, snap);
    render_exports(&mut out, snap);
    render_queues(&mut out, snap);
    out.0
}

/// Datagram ports' counters, per thread and transport (a thread's sockets of one transport
/// are summed: they are told apart by nothing a label could name).
fn render_ports(out: &mut Text, snap: &Snapshot) {
    let mut ports: Vec<(usize, &str, crate::dgram::PortStats)> = Vec::new();
    for p in &snap.ports {
        match ports
            .iter_mut()
            .find(|(t, tr, _)| *t == p.thread && *tr == p.transport)
        {
            Some((_, _, sum)) => sum.add(&p.stats),
            None => ports.push((p.thread, p.transport, p.stats)),
        }
    }
    for c in &PORT_COUNTERS {
        out.family(c.name, "counter", c.help);
        for (thread, transport, stats) in &ports {
            let labels = labels(&[("thread", thread), ("transport", transport)]);
            out.sample(c.name, &labels, (c.value)(stats));
        }
    }
}

/// Per export: the queues that closed and the live ones, so the counters never go back when a
/// session ends. Every export served has them, from zero; an export removed has none (its
/// series go, as a closed queue's do), so export churn does not grow the scrape.
fn render_exports(out: &mut Text, snap: &Snapshot) {
    let mut exports: Vec<(&str, QueueStats)> = snap
        .exports
        .iter()
        .map(|(e, _)| (e.as_str(), QueueStats::default()))
        .collect();
    // (Closed queues are counted only while their export is served: `ClosedTotals::add`.)
    let closed = snap.closed.iter().map(|(e, s)| (e.as_str(), s));
    // A live queue of an export removed meanwhile (draining) counts in no export, not in one
    // added since by its name, whose series start from zero.
    let live = snap
        .queues
        .iter()
        .filter(|q| snap.exports.iter().any(|(_, id)| *id == q.export_id))
        .map(|q| (q.export.as_str(), &q.stats));
    for (export, stats) in closed.chain(live) {
        if let Some((_, total)) = exports.iter_mut().find(|(e, _)| *e == export) {
            total.add(stats);
        }
    }
    let series: Vec<(String, &QueueStats)> = exports
        .iter()
        .map(|(e, s)| (labels(&[("export", e)]), s))
        .collect();
    let whose = " (every queue of the export, closed ones included)";
    render_stats(out, "blkwire_export_", whose, &series, true);
}

/// Live queues given series of their own at most: each has up to ~150 lines, and a target with
/// many sessions would otherwise build a reply of hundreds of MiB.
/// The per-export series count every queue.
const MAX_QUEUE_SERIES: usize = 1024;

/// Per live queue: the first [`MAX_QUEUE_SERIES`] by session and queue (the same ones from one
/// scrape to the next), and how many were left out.
fn render_queues(out: &mut Text, snap: &Snapshot) {
    let mut queues: Vec<_> = snap.queues.iter().collect();
    queues.sort_by_key(|q| (q.session, q.queue, q.thread));
    let omitted = queues.len().saturating_sub(MAX_QUEUE_SERIES);
    queues.truncate(MAX_QUEUE_SERIES);
    out.gauge(
        "blkwire_queues_without_series",
        "Live queues left out of the per-queue series (past the first 1024 by session and \
         queue); the per-export series count them.",
        omitted,
    );
    let series: Vec<(String, &QueueStats)> = queues
        .iter()
        .map(|q| {
            let labels = labels(&[
                ("export", &q.export),
                ("session", &q.session),
                ("queue", &q.queue),
                ("thread", &q.thread),
            ]);
            (labels, &q.stats)
        })
        .collect();
    render_stats(out, "blkwire_queue_", "", &series, false);
    let name = "blkwire_queue_in_flight";
    out.family(
        name,
        "gauge",
        "Requests of the queue running on the backend now.",
    );
    for (q, (labels, _)) in queues.iter().zip(&series) {
        out.sample(name, labels, q.in_flight);
    }
}

/// The counters and histograms of [`QueueStats`] for each `(labels, stats)`, named `prefix`...,
/// their help ending with `whose`. `every_op`: a histogram for every operation, even one that never ran (else only for those
/// that did, so an idle queue adds 5 series, not 135).
fn render_stats(
    out: &mut Text,
    prefix: &str,
    whose: &str,
    series: &[(String, &QueueStats)],
    every_op: bool,
) {
    for c in &COUNTERS {
        let name = format!("{prefix}{}", c.name);
        out.family(&name, "counter", &format!("{}{whose}.", c.help));
        for (labels, stats) in series {
            out.sample(&name, labels, (c.value)(stats));
        }
    }
    let name = format!("{prefix}requests_total");
    out.family(&name, "counter", &format!("{REQUESTS_HELP}{whose}."));
    for (labels, stats) in series {
        for (op, op_name) in OPS {
            out.sample(&name, &with(labels, "op", &op_name), stats.started(op));
        }
    }
    let name = format!("{prefix}request_duration_seconds");
    out.family(&name, "histogram", &format!("{DURATION_HELP}{whose}."));
    for (labels, stats) in series {
        for (op, op_name) in OPS {
            let h = stats.latency.of(op);
            if every_op || h.count() > 0 {
                out.histogram(&name, &with(labels, "op", &op_name), h);
            }
        }
    }
}

/// The exposition text being written.
#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        // HELP text escapes backslashes and newlines; ours has neither, so it goes as it is.
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {value}");
        } else {
            let _ = writeln!(self.0, "{name}{{{labels}}} {value}");
        }
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, "gauge", help);
        self.sample(name, "", value);
    }

    fn counter(&mut self, name: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, "counter", help);
        self.sample(name, "", value);
    }

    /// A histogram's series: cumulative buckets up to `+Inf` (which equals `_count`), then
    /// `_sum` (seconds) and `_count`.
    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let bucket = format!("{name}_bucket");
        let mut below = 0;
        for i in 0..BUCKETS {
            below += h.bucket(i);
            let le = Histogram::bound_ns(i) as f64 / 1e9;
            self.sample(&bucket, &with(labels, "le", &le), below);
        }
        below += h.bucket(BUCKETS);
        self.sample(&bucket, &with(labels, "le", &"+Inf"), below);
        self.sample(&format!("{name}_sum"), labels, h.sum_ns() as f64 / 1e9);
        self.sample(&format!("{name}_count"), labels, below);
    }
}

/// `name="value",...` with every value escaped.
fn labels(pairs: &[(&str, &dyn std::fmt::Display)]) -> String {
    let mut out = String::new();
    for (name, value) in pairs {
        if !out.is_empty() {
            out.push(',');
        }
        push_label(&mut out, name, *value);
    }
    out
}

/// `labels` with one more label.
fn with(labels: &str, name: &str, value: &dyn std::fmt::Display) -> String {
    let mut out = labels.to_string();
    if !out.is_empty() {
        out.push(',');
    }
    push_label(&mut out, name, value);
    out
}

/// `name="value"`, the value escaped as the exposition format wants: backslash, double quote
/// and newline (host ids and export names are anyone's words).
fn push_label(out: &mut String, name: &str, value: &dyn std::fmt::Display) {
    out.push_str(name);
    out.push_str("=\"");
    for c in value.to_string().chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use blkwire_backend::BlockOp;

    use super::*;
    use crate::dgram::{PortReport, PortStats};
    use crate::reactor::QueueReport;
    use crate::session::SessionInfo;
    use crate::stats::ClosedTotals;

    fn snapshot() -> Snapshot {
        let mut live = QueueStats {
            reads: 3,
            writes: 1,
            bytes_read: 3 * 4096,
            ..QueueStats::default()
        };
        for us in [1, 3, 3000] {
            live.latency
                .record(BlockOp::Read, Duration::from_micros(us));
        }
        live.latency
            .record(BlockOp::Write, Duration::from_secs(100));
        let mut closed = ClosedTotals::default();
        let gone = QueueStats {
            reads: 10,
            ..QueueStats::default()
        };
        let all = || HashSet::from(["disk".to_string(), "retired".to_string()]);
        closed.add("disk", &gone, all);
        closed.add("retired", &gone, all);
        Snapshot {
            sessions: vec![SessionInfo {
                session: 7,
                export: "disk".into(),
                host: "evil\"host\\\nx=\"1\"".into(),
                peer: "127.0.0.1:5000".into(),
                queues: 1,
                closing: false,
            }],
            queues: vec![QueueReport {
                session: 7,
                export: "disk".into(),
                export_id: 1,
                queue: 1,
                thread: 0,
                in_flight: 2,
                stats: live,
            }],
            ports: vec![
                PortReport {
                    thread: 0,
                    transport: "udp",
                    stats: PortStats {
                        bad_frames: 2,
                        ..PortStats::default()
                    },
                },
                PortReport {
                    thread: 0,
                    transport: "udp",
                    stats: PortStats {
                        bad_frames: 3,
                        ..PortStats::default()
                    },
                },
            ],
            closed,
            exports: vec![("disk".into(), 1), ("idle".into(), 2)],
            complete: true,
            challenges: 4,
            refused: 5,
            memory_limit: 1 << 30,
            memory_used: 12345,
        }
    }

    /// The value of the one sample written `series` (name and labels as rendered).
    fn value(text: &str, series: &str) -> f64 {
        let found: Vec<f64> = text
            .lines()
            .filter_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .collect();
        assert_eq!(found.len(), 1, "{series} in:\n{text}");
        found[0]
    }

    /// A newcomer takes the place of the oldest connection still sending its head, else of
    /// the one answered longest (clients that asked and sit on their replies must not keep a
    /// scraper out); per host, an IPv6 /64 is one host.
    #[test]
    fn a_newcomer_takes_the_place_of_a_quiet_client_or_else_of_the_oldest_answered() {
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "fd00::1".parse().unwrap();
        let b2: IpAddr = "fd00::2".parse().unwrap();
        // Oldest first, as the endpoint keeps them.
        let clients = [
            (Stage::Reply, a),
            (Stage::Drain, b),
            (Stage::Head, a),
            (Stage::Reply, b2),
        ];
        assert_eq!(
            to_close(clients.into_iter(), None),
            Some(2),
            "the quiet one"
        );
        let answered: Vec<_> = clients
            .iter()
            .filter(|c| c.0 != Stage::Head)
            .copied()
            .collect();
        assert_eq!(
            to_close(answered.into_iter(), None),
            Some(0),
            "no quiet one: the one answered longest"
        );
        assert_eq!(
            to_close(clients.into_iter(), Some(crate::access::host_prefix(b2))),
            Some(1),
            "fd00::1 and fd00::2 are one host"
        );
        assert_eq!(to_close(std::iter::empty(), None), None);
    }

    /// Per-queue series stop at MAX_QUEUE_SERIES queues, the same ones (lowest session and
    /// queue) whatever order the reactors reported them in, and the rest are counted; the
    /// reply stays bounded however many queues are open.
    #[test]
    fn per_queue_series_are_bounded() {
        let mut snap = snapshot();
        let one = snap.queues[0].clone();
        snap.queues = (0..MAX_QUEUE_SERIES as u32 + 10)
            .rev()
            .map(|session| QueueReport {
                session,
                ..one.clone()
            })
            .collect();
        let text = render(&snap);
        assert_eq!(value(&text, "blkwire_queues_without_series"), 10.0);
        let shown = |session: u32| {
            text.contains(&format!(
                "blkwire_queue_in_flight{{export=\"disk\",session=\"{session}\","
            ))
        };
        assert!(shown(0) && shown(MAX_QUEUE_SERIES as u32 - 1));
        assert!(!shown(MAX_QUEUE_SERIES as u32));
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("blkwire_queue_in_flight{"))
                .count(),
            MAX_QUEUE_SERIES
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let text = render(&snapshot());
        let want = r#"blkwire_session_info{session="7",export="disk",host="evil\"host\\\nx=\"1\"",peer="127.0.0.1:5000"} 1"#;
        assert!(text.lines().any(|l| l == want), "{want} not in:\n{text}");
        assert_eq!(
            text.lines().count(),
            text.split('\n').count() - 1,
            "no line broken by a value"
        );
        let mut s = String::new();
        push_label(&mut s, "x", &"a\\b\"c\nd\re");
        assert_eq!(s, "x=\"a\\\\b\\\"c\\nd\re\"");
    }

    #[test]
    fn histograms_are_cumulative_and_end_with_their_count() {
        let text = render(&snapshot());
        let labels = r#"export="disk",session="7",queue="1",thread="0",op="read""#;
        let bucket = |le: &str| {
            value(
                &text,
                &format!("blkwire_queue_request_duration_seconds_bucket{{{labels},le=\"{le}\"}}"),
            )
        };
        // 1 us, 3 us and 3 ms.
        assert_eq!(bucket("0.000001"), 1.0);
        assert_eq!(bucket("0.000002"), 1.0);
        assert_eq!(bucket("0.000004"), 2.0);
        assert_eq!(bucket("0.002048"), 2.0);
        assert_eq!(bucket("0.004096"), 3.0);
        assert_eq!(bucket("8.388608"), 3.0);
        assert_eq!(bucket("+Inf"), 3.0);
        let series = |suffix: &str| {
            value(
                &text,
                &format!("blkwire_queue_request_duration_seconds_{suffix}{{{labels}}}"),
            )
        };
        assert_eq!(series("count"), 3.0);
        assert!((series("sum") - 0.003004).abs() < 1e-12);
        // Every histogram: buckets never go down, +Inf equals _count.
        let mut last: Option<(String, f64)> = None;
        for l in text.lines().filter(|l| l.contains("_bucket{")) {
            let (series, v) = l.rsplit_once(' ').unwrap();
            let v: f64 = v.parse().unwrap();
            let key = series[..series.find(",le=").unwrap()].to_string();
            if let Some((k, prev)) = &last {
                if *k == key {
                    assert!(v >= *prev, "{l} after {prev}");
                }
            }
            if series.ends_with("le=\"+Inf\"}") {
                let count = format!("{}}}", key.replacen("_bucket{", "_count{", 1));
                assert_eq!(value(&text, &count), v, "{l}");
            }
            last = Some((key, v));
        }
        // The write took longer than every bound: only +Inf holds it.
        let write = r#"export="disk",session="7",queue="1",thread="0",op="write""#;
        let w = format!("blkwire_queue_request_duration_seconds_bucket{{{write},le=\"8.388608\"}}");
        assert_eq!(value(&text, &w), 0.0);
        let w = format!("blkwire_queue_request_duration_seconds_bucket{{{write},le=\"+Inf\"}}");
        assert_eq!(value(&text, &w), 1.0);
    }

    /// An export removed and added again by the same name while queues of the old one still
    /// drain: their counters are not the new export's (whose series start from zero).
    #[test]
    fn a_draining_queue_of_an_export_removed_counts_in_no_export_added_since() {
        let mut snap = snapshot();
        snap.queues[0].export_id = 99; // the "disk" removed; the one served now is 1
        let text = render(&snap);
        assert_eq!(
            value(
                &text,
                r#"blkwire_export_requests_total{export="disk",op="read"}"#
            ),
            10.0,
            "the closed queues only, not the old export's live one"
        );
    }

    #[test]
    fn export_totals_add_closed_queues_to_live_ones() {
        let text = render(&snapshot());
        let reads = |export: &str| {
            value(
                &text,
                &format!("blkwire_export_requests_total{{export=\"{export}\",op=\"read\"}}"),
            )
        };
        assert_eq!(reads("disk"), 13.0, "10 closed + 3 live");
        assert_eq!(
            reads("idle"),
            0.0,
            "an export served has series from the start"
        );
        assert!(
            !text.contains(r#"export="retired""#),
            "an export no longer served has no series"
        );
        let count = r#"blkwire_export_request_duration_seconds_count{export="idle",op="flush"}"#;
        assert_eq!(
            value(&text, count),
            0.0,
            "every op, even unused, per export"
        );
        let queue_flush = r#"blkwire_queue_request_duration_seconds_count{export="disk",session="7",queue="1",thread="0",op="flush"}"#;
        assert!(
            !text.contains(queue_flush),
            "a queue has histograms only for operations it ran"
        );
        let in_flight =
            r#"blkwire_queue_in_flight{export="disk",session="7",queue="1",thread="0"}"#;
        assert_eq!(value(&text, in_flight), 2.0);
        let ports = r#"blkwire_port_bad_frames_total{thread="0",transport="udp"}"#;
        assert_eq!(
            value(&text, ports),
            5.0,
            "a thread's sockets of a transport summed"
        );
        assert_eq!(value(&text, "blkwire_memory_used_bytes"), 12345.0);
        assert_eq!(value(&text, "blkwire_auth_refused_total"), 5.0);
        assert_eq!(value(&text, "blkwire_sessions"), 1.0);
    }

    /// A scrape that left a reactor out (its live queue, and the closed totals it holds) would
    /// report lower export totals: counters are reported at what they were last, gauges as
    /// they are; once the reactor answers again, the counters go on from its values; a series
    /// that went away is forgotten.
    #[test]
    fn counters_never_go_back_when_a_scrape_leaves_a_reactor_out() {
        let mut m = Monotonic::default();
        let full = snapshot();
        let first = m.apply(&render(&full), false);
        assert_eq!(first, render(&full), "the first scrape goes as it is");
        let reads = |text: &str| {
            value(
                text,
                r#"blkwire_export_requests_total{export="disk",op="read"}"#,
            )
        };
        let inf =
            r#"blkwire_export_request_duration_seconds_bucket{export="disk",op="read",le="+Inf"}"#;
        let count = r#"blkwire_export_request_duration_seconds_count{export="disk",op="read"}"#;
        assert_eq!((reads(&first), value(&first, inf)), (13.0, 3.0));
        let mut partial = snapshot();
        partial.queues.clear();
        partial.closed = ClosedTotals::default();
        partial.memory_used = 1;
        let raw = render(&partial);
        assert_eq!(reads(&raw), 0.0, "what the partial snapshot alone says");
        let second = m.apply(&raw, true);
        assert_eq!(reads(&second), 13.0, "not back to 0");
        assert_eq!((value(&second, inf), value(&second, count)), (3.0, 3.0));
        assert_eq!(value(&second, "blkwire_memory_used_bytes"), 1.0, "a gauge");
        assert!(
            !second.contains("blkwire_queue_requests_total{"),
            "its queue is absent"
        );
        // The reactor is back, with more done: its values again.
        let mut more = snapshot();
        more.queues[0].stats.reads = 7;
        let third = m.apply(&render(&more), false);
        assert_eq!(reads(&third), 17.0);
        assert_eq!(third, render(&more));
        // Only the last scrape's series are remembered.
        let fourth = m.apply(&render(&partial), true);
        assert_eq!(reads(&fourth), 17.0);
        assert!(
            m.0.keys().all(|k| !k.starts_with("blkwire_queue_")),
            "the queue's forgotten"
        );
        assert!(m.0.contains_key(count) && !m.0.contains_key("blkwire_memory_used_bytes"));
        // A complete scrape goes as it is: lower is a real reset (the export added again).
        let mut again = snapshot();
        again.queues.clear();
        again.closed = ClosedTotals::default();
        let fifth = m.apply(&render(&again), false);
        assert_eq!(reads(&fifth), 0.0, "counts from zero");
    }

    #[test]
    fn every_sample_follows_the_help_and_type_of_its_family() {
        let text = render(&snapshot());
        let mut typed: Vec<(String, String)> = Vec::new();
        let mut helped: Vec<String> = Vec::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# HELP ") {
                helped.push(rest.split(' ').next().unwrap().to_string());
            } else if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                typed.push((name.to_string(), kind.to_string()));
            } else {
                let name = l.split(['{', ' ']).next().unwrap();
                let (family, kind) = typed.last().expect("a TYPE first");
                let base = if kind == "histogram" {
                    ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .unwrap_or(name)
                } else {
                    name
                };
                assert_eq!(base, family, "{l}: not in the family last typed");
                assert_eq!(helped.last(), Some(family), "{l}: no HELP");
            }
        }
        let mut names: Vec<_> = typed.iter().map(|(n, _)| n).collect();
        let all = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all, "each family once");
    }
}
