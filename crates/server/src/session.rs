//! Sessions: HELLO grants, JOIN checks, and the per-session summary. Only the control path
//! (connect, join, disconnect) takes this lock; the data path never touches it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

use blkwire_auth::proof::{self, Direction, SessionSecret};
use blkwire_auth::seal::{Opener, Sealer};
use blkwire_auth::{Acl, Key, PeerAddr};
use blkwire_backend::{Export, ExportSpec, ResizeError};
use blkwire_wire::{
    datagram::SEAL_LEN, CopyDescriptor, CopyLimits, ExportEntry, Features, Hello, HelloReply, Join,
    QueueRef, Status, AUTH_LEN, HEADER_CRC, QUERY_LIST, QUERY_STATS, SESSION_HEADER_CRC,
};

use crate::access::{Access, Checked, Claim, PeerId, Proven};
use crate::budget::{Account, Budget};
use crate::log::Level;
use crate::stats::QueueStats;

pub use blkwire_wire::MAX_FRAGMENTS;

/// Limits the target grants at most, whatever a client asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Queues (connections) per session.
    pub max_queues: u16,
    /// Requests in flight per queue.
    pub max_depth: u16,
    /// Bytes per READ or WRITE.
    pub max_io: u32,
    /// A datagram queue with no frame for this long is forgotten (PROTOCOL.md §9.1). Only tests
    /// shorten it: initiators keep a session alive with a KEEPALIVE every 5 s.
    pub datagram_idle: std::time::Duration,
    /// A connection must finish its whole handshake (HELLO/JOIN, NBD option haggling) in this
    /// time, however it trickles its bytes.
    pub handshake_timeout: std::time::Duration,
    /// Handshakes in progress at once (one thread each); further connections are closed at
    /// once until one finishes.
    pub max_handshakes: usize,
    /// Sessions served at once (every transport, NBD connections included); more are refused
    /// with NO_MEMORY until one ends.
    pub max_sessions: usize,
    /// Bytes all connection and session buffers may hold together (`--max-memory`): a
    /// session may take half of it, a connection a quarter; a session or queue whose minimum
    /// does not fit is refused with NO_MEMORY (`budget.rs`).
    pub max_memory: usize,
    /// Sessions from one address (IP, or MAC on raw Ethernet), so that one peer flooding
    /// HELLOs cannot take every session; more get NO_MEMORY.
    pub max_sessions_per_host: usize,
    /// Stream connections open at once (handshakes included); more are closed when accepted.
    pub max_connections: usize,
    /// ... from one peer address.
    pub max_connections_per_host: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_queues: 64,
            max_depth: 1024,
            max_io: 1 << 20,
            datagram_idle: crate::dgram::IDLE_EXPIRY,
            handshake_timeout: std::time::Duration::from_secs(10),
            max_handshakes: 256,
            max_sessions: 1024,
            max_memory: 1 << 30,
            max_sessions_per_host: 128,
            max_connections: 4096,
            max_connections_per_host: 256,
        }
    }
}

struct Session {
    export: Arc<Export>,
    /// Who it is, as the export's rules see it: the host id it proved (None: unauthenticated)
    /// and its address. Checked again when the rules or the keys change.
    proven: Option<String>,
    addr: PeerAddr,
    /// Other addresses its queues joined from (at most one per queue): the rules must still
    /// admit each when they change, or a queue joined from an address they now keep out
    /// would go on reading and writing.
    joined_from: Vec<PeerAddr>,
    /// With `addr`, the link it is on (`PeerId::scope`): a keyless take-over must come from
    /// the same address on the same link.
    scope: u32,
    /// The key that host had when the session began: a session whose key is replaced or
    /// removed (`keys_load`) is closed.
    key: Option<Key>,
    /// Closed by the control plane (export removed, rules changed, `session_close`): its
    /// queues are being closed and no queue may join it any more.
    revoked: bool,
    /// See `Admitted::placement`.
    placement: u32,
    /// Method-1 sessions: the key root (JOIN proofs, frame keys) and whether frames are
    /// encrypted as well as authenticated.
    secret: Option<Arc<SessionSecret>>,
    encrypt: bool,
    /// Its data frames' CRCs cover their header only (UDP, asked for and granted: §9.7).
    header_crc: bool,
    /// Payload per fragment (datagram sessions; max I/O on TCP).
    frame_payload: u32,
    /// Created over a datagram link (else a stream): its queues join over the same kind, see
    /// `Registry::join`.
    datagram: bool,
    host: String,
    peer: String,
    /// The export's size as the handshake told the client: every queue of the session checks
    /// against it for the session's life, whatever `export_resize` does meanwhile.
    size: u64,
    depth: u16,
    max_io: u32,
    /// What one COPY may do (PROTOCOL.md §13), as granted at HELLO.
    copy: CopyLimits,
    cookie: u64,
    /// Where each of its queues is in its life.
    queues: Vec<QueueState>,
    live: u16,
    stats: QueueStats,
    /// The session's share of the memory budget, which its queues charge.
    mem: Arc<Budget>,
    /// What each of its queues reserves of it when admitted.
    queue_floor: usize,
}

/// Where a queue of a session is in its life. Only forward: an index is never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QueueState {
    /// Not connected yet: a JOIN may take it.
    Free,
    Live,
    /// A new session replaces it (PROTOCOL.md §2.6): its reactor was told to close it, and
    /// its requests still running finish first.
    Closing,
    /// Closed, and nothing of it runs any more (or replaced before it was ever joined).
    Gone,
}

impl Session {
    /// Admits queue `queue` of this session (`id`) once its joiner was checked: it must be
    /// within the session's queues and not connected yet, and its minimum must fit the
    /// session's share of the memory budget (connections get `share` at most). `depth` is what
    /// the queue asked for, within what the session was granted.
    fn admit_queue(
        &mut self,
        id: u32,
        queue: u16,
        depth: u16,
        seal: Option<QueueSeal>,
        share: usize,
    ) -> Result<Admitted, Status> {
        let slot = self.queues.get_mut(queue as usize).ok_or(Status::Invalid)?;
        match *slot {
            QueueState::Free => {}
            // Connected: a second connection for it is refused, but the index is its own.
            QueueState::Live => return Err(Status::Busy),
            // Ended (logged out, replaced, never joined before a replacement): an index is
            // never reused, so no later JOIN can take it; BUSY would say to try again.
            QueueState::Closing | QueueState::Gone => return Err(Status::Access),
        }
        let mem = Account::reserve(&self.mem, self.queue_floor, share).ok_or(Status::NoMemory)?;
        *slot = QueueState::Live;
        self.live += 1;
        Ok(Admitted {
            export: self.export.clone(),
            session: id,
            placement: self.placement,
            queue,
            size: self.size,
            depth: depth.min(self.depth),
            max_io: self.max_io,
            copy: self.copy,
            seal,
            mem,
            header_crc: self.header_crc,
        })
    }
}

/// The smallest connection share of the memory budget that grants COPY: a COPY's bounce
/// buffer ([`blkwire_backend::COPY_CHUNK`]) and room for the connection's own buffers beside it.
const COPY_MIN_SHARE: usize = 4 * blkwire_backend::COPY_CHUNK as usize;

/// What a queue connection gets once admitted.
pub struct Admitted {
    pub export: Arc<Export>,
    pub session: u32,
    /// Which reactor takes this session's queue 0 (queue `q` goes to the next `q`-th): sessions
    /// are dealt out in turn, so placement does not depend on (random) session ids.
    pub placement: u32,
    pub queue: u16,
    /// The export's size the session was given (`Session::size`): the queue's bound.
    pub size: u64,
    pub depth: u16,
    pub max_io: u32,
    /// What one COPY of the session may do (PROTOCOL.md §13; none for NBD).
    pub copy: CopyLimits,
    /// The queue's account with the memory budget, holding its minimum.
    pub mem: Account,
    /// Datagram queues of a method-1 session: this queue's frame keys (PROTOCOL.md §12.4).
    pub seal: Option<QueueSeal>,
    /// UDP sessions that asked for it: data frames' CRCs cover their header only (§9.7).
    pub header_crc: bool,
}

/// A sealed datagram queue's keys, target side: it opens requests and seals replies.
pub struct QueueSeal {
    pub opener: Opener,
    pub sealer: Sealer,
}

impl QueueSeal {
    fn target_side(secret: &SessionSecret, session: u32, queue: u16, encrypt: bool) -> QueueSeal {
        QueueSeal {
            opener: Opener::new(
                &secret.frame_key(session, queue, Direction::ToTarget),
                encrypt,
            ),
            sealer: Sealer::new(
                &secret.frame_key(session, queue, Direction::ToInitiator),
                encrypt,
            ),
        }
    }
}

/// Why a JOIN was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum JoinRefused {
    /// Answer with status CHALLENGE and this nonce (datagrams, PROTOCOL.md §12.1).
    Challenge([u8; AUTH_LEN]),
    /// Answer with this status.
    Status(Status),
    /// The queue index ended (closed, logged out, replaced): answered ACCESS, as an index is
    /// never reused, but the joiner proved itself: no authentication failure to count.
    Ended,
}

impl From<Status> for JoinRefused {
    fn from(s: Status) -> Self {
        JoinRefused::Status(s)
    }
}

/// How a HELLO is answered.
pub enum HelloAnswer {
    /// Status CHALLENGE with the target's nonce (PROTOCOL.md §12.1).
    Challenge([u8; AUTH_LEN]),
    /// Status OK with this payload; `Some` admitted queue 0 of a new session, `None` for a query.
    Welcome(Vec<u8>, Option<Box<Admitted>>),
    /// A refusal with this status.
    Refused(Status),
}

/// An export being served: what it was made from (for `export_list` and `save_config`), its
/// open backend, and who may open it.
pub struct Served {
    pub spec: ExportSpec,
    pub export: Arc<Export>,
    pub acl: Acl,
}

/// Who a new session belongs to.
pub struct Owner<'a> {
    /// The host id it proved (None: unauthenticated).
    pub proven: Option<&'a str>,
    /// The host id shown in logs and listings (the one it named, or "nbd client").
    pub shown: &'a str,
    /// Its address (and for a link-local one, its link) as the rules and a keyless take-over
    /// see it.
    pub id: &'a PeerId,
    /// Its address and port, for logs and listings.
    pub peer: &'a str,
}

pub struct Registry {
    pub access: Access,
    /// NVMe/TCP controllers and listeners (`crate::nvme`).
    pub nvme: crate::nvme::Controllers,
    /// iSCSI listeners and logged-in sessions (`crate::iscsi`).
    pub iscsi: crate::iscsi::Portals,
    /// Persistent reservations, per export (`crate::reservations`).
    pub reservations: crate::reservations::Table,
    limits: Limits,
    inner: Mutex<Inner>,
    /// Signalled whenever a queue leaves, for HELLOs waiting on a queue they replace.
    left: Condvar,
    /// Tells the reactors to close one queue (set once they run; see `take_over`).
    closer: OnceLock<QueueCloser>,
    budget: Arc<Budget>,
}

/// How the registry has a queue closed on whichever reactor serves it.
pub type QueueCloser = Box<dyn Fn(u32, u16) + Send + Sync>;

struct Inner {
    /// The exports, in the order they were added (the first is NBD's default). Under the same
    /// lock as the sessions, so that no session is created on an export being removed.
    exports: Vec<Served>,
    sessions: HashMap<u32, Session>,
    /// Sessions per peer address (`host_of`).
    per_host: HashMap<String, usize>,
    shut: bool,
    /// The next session's `placement`.
    next_placement: u32,
}

impl Registry {
    pub fn new(access: Access, limits: Limits) -> Registry {
        Registry {
            access,
            nvme: crate::nvme::Controllers::default(),
            iscsi: crate::iscsi::Portals::default(),
            reservations: crate::reservations::Table::default(),
            limits,
            left: Condvar::new(),
            closer: OnceLock::new(),
            budget: Budget::new(limits.max_memory),
            inner: Mutex::new(Inner {
                exports: Vec::new(),
                sessions: HashMap::new(),
                per_host: HashMap::new(),
                shut: false,
                next_placement: 0,
            }),
        }
    }

    /// The export named `name`, if this host may open it (`host`: proven host id).
    pub fn permitted(
        &self,
        name: &str,
        host: Option<&str>,
        addr: &PeerAddr,
    ) -> Option<Arc<Export>> {
        self.open_to(host, addr)
            .into_iter()
            .find(|e| e.name == name)
    }

    /// The exports a host proven as `host` (None: unauthenticated) at `addr` may open, in order.
    pub fn open_to(&self, host: Option<&str>, addr: &PeerAddr) -> Vec<Arc<Export>> {
        self.lock()
            .exports
            .iter()
            .filter(|s| self.access.permits(&s.acl, host, addr))
            .map(|s| s.export.clone())
            .collect()
    }

    /// The export `name` as the source of a COPY by `session` (PROTOCOL.md §13): served, and
    /// one the session's host may open, with the same rules as a HELLO for it, from every
    /// address the session's queues came from (a COPY on a queue joined from another address
    /// is that address's request). None for a closed or revoked session.
    pub fn copy_source(&self, session: u32, name: &str) -> Option<Arc<Export>> {
        let inner = self.lock();
        let s = inner.sessions.get(&session).filter(|s| !s.revoked)?;
        let served = inner.exports.iter().find(|e| e.export.name == name)?;
        std::iter::once(&s.addr)
            .chain(&s.joined_from)
            .all(|a| self.access.permits(&served.acl, s.proven.as_deref(), a))
            .then(|| served.export.clone())
    }

    /// Whether an export of this name is served (to anyone).
    pub fn has_export(&self, name: &str) -> bool {
        self.lock().exports.iter().any(|s| s.export.name == name)
    }

    /// Whether `export` itself is served (not another of its name added since).
    pub fn serves(&self, export: &Arc<Export>) -> bool {
        self.lock()
            .exports
            .iter()
            .any(|s| Arc::ptr_eq(&s.export, export))
    }

    /// The names of the exports served.
    pub fn export_names(&self) -> std::collections::HashSet<String> {
        self.lock()
            .exports
            .iter()
            .map(|s| s.export.name.clone())
            .collect()
    }

    /// The first export's name (NBD's default export), if any.
    pub fn first_export(&self) -> Option<String> {
        self.lock().exports.first().map(|s| s.export.name.clone())
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The target's memory budget.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// The most one connection (or datagram port) may hold of the budget.
    pub fn connection_share(&self) -> usize {
        self.limits.max_memory / 4
    }

    /// What a queue must be able to hold to serve one request at a time: a stream connection's
    /// initial buffers and one data buffer; a datagram queue's slot table of `depth` slots (its
    /// data buffers come from the port's pool, charged to the port).
    fn queue_floor(max_io: u32, depth: u16, datagram: bool) -> usize {
        if datagram {
            crate::dgram::queue_floor(depth)
        } else {
            crate::reactor::stream_floor(max_io)
        }
    }

    /// The exports served now, in order.
    pub fn exports(&self) -> Vec<Arc<Export>> {
        self.lock()
            .exports
            .iter()
            .map(|s| s.export.clone())
            .collect()
    }

    /// Feature bits an export advertises (PROTOCOL.md §7): what it does natively or by emulation.
    pub fn features(e: &Export) -> Features {
        crate::advertise::Advertised::of(e).native()
    }

    /// The exports this host may open (PROTOCOL.md §12.3: others are not even named).
    pub fn list(&self, host: Option<&str>, addr: &PeerAddr) -> Vec<ExportEntry> {
        self.open_to(host, addr)
            .into_iter()
            .map(|e| ExportEntry {
                name: e.name.clone(),
                size: e.size(),
                features: Self::features(&e),
            })
            .collect()
    }

    /// Stops admitting sessions (shutdown).
    pub fn close(&self) {
        self.lock().shut = true;
    }

    /// The target is stopping (`close`): no session is opened, and no control call runs.
    pub fn is_closed(&self) -> bool {
        self.lock().shut
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the map inconsistent, so carry on.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers a HELLO (PROTOCOL.md §2, §12): a challenge until the peer has shown it receives
    /// at its address, then the key proof, the export's allow list, and a new session (or a
    /// query's answer). `link` is the target's own largest frame payload on a datagram link
    /// (`None` on TCP) and whether the link is UDP (whose checksum covers a payload, so a
    /// session may ask for `HEADER_CRC`, §9.7). `stats` builds the STATS document for an
    /// admin's query. A HELLO that replaces a queue (§2.6) waits for it until `wait_until`
    /// (None: not at all), then is refused with BUSY if the queue still has requests running.
    pub fn hello(
        &self,
        h: &Hello,
        peer: &PeerId,
        link: (Option<u32>, bool),
        wait_until: Option<Instant>,
        stats: &dyn Fn() -> Vec<u8>,
    ) -> HelloAnswer {
        let proven = match self.access.check(h, peer, link.0.is_some()) {
            Checked::Challenge(n) => return HelloAnswer::Challenge(n),
            Checked::Refused(why) => {
                self.access.refuse(peer, &why);
                return HelloAnswer::Refused(Status::Access);
            }
            Checked::Passed(p) => p,
        };
        // One answer per attempt, whichever listener it reaches (§12.1): the final HELLO of
        // an exchange someone saw, sent again from the victim's address to another port or
        // over TCP, opens no second session. A repeat over datagrams gets the same welcome a
        // few times while its session lasts (the answer may have been lost), then nothing but
        // refusals.
        let nonce_c = &h.auth.nonce_c;
        let seq = match self.access.claim_attempt(peer, nonce_c) {
            Claim::New(seq) => seq,
            Claim::Answered(Some((welcome, session))) if !self.is_revoked(session) => {
                return HelloAnswer::Welcome(welcome, None)
            }
            Claim::Answered(_) => {
                let who = h.host_id.escape_debug();
                self.access.refuse(
                    peer,
                    &format!("host '{who}' sent a HELLO that was answered already (replayed?)"),
                );
                return HelloAnswer::Refused(Status::Access);
            }
        };
        let answer = self.answer_hello(h, peer, proven, link, wait_until, stats);
        match &answer {
            HelloAnswer::Welcome(reply, Some(adm)) if link.0.is_some() => self
                .access
                .attempt_welcomed((peer, nonce_c), seq, reply, adm.session),
            HelloAnswer::Welcome(..) => {}
            _ => self.access.release_attempt(peer, nonce_c, seq),
        }
        answer
    }

    /// [`Registry::hello`] once the HELLO passed its challenge and proof (`proven`).
    fn answer_hello(
        &self,
        h: &Hello,
        peer: &PeerId,
        proven: Option<Proven>,
        (link_payload, udp): (Option<u32>, bool),
        wait_until: Option<Instant>,
        stats: &dyn Fn() -> Vec<u8>,
    ) -> HelloAnswer {
        let host = proven.as_ref().map(|p| p.host.as_str());
        // The target's proof over what it answers (zeros when the host proved no key).
        let prove = |payload: &[u8]| match &proven {
            Some(p) => proof::target_proof(&p.key, &p.transcript, payload),
            None => [0; AUTH_LEN],
        };
        if h.is_query() {
            let mut answer = if h.client_features & QUERY_STATS != 0 {
                if !self.access.is_admin(host) {
                    let who = h.host_id.escape_debug();
                    self.access.refuse(
                        peer,
                        &format!(
                            "host '{who}' asked for STATS but is not an admin (serve --admin)"
                        ),
                    );
                    return HelloAnswer::Refused(Status::Access);
                }
                stats()
            } else if h.client_features & QUERY_LIST != 0 {
                ExportEntry::encode_list(&self.list(host, &peer.addr)).unwrap_or_default()
            } else {
                return HelloAnswer::Refused(Status::NoExport);
            };
            let p = prove(&answer);
            answer.extend_from_slice(&p);
            if link_payload.is_some_and(|l| answer.len() > l as usize) {
                // Too long for one datagram (very many exports): NO_MEMORY (§11).
                return HelloAnswer::Refused(Status::NoMemory);
            }
            return HelloAnswer::Welcome(answer, None);
        }
        let Some(export) = self.permitted(&h.export, host, &peer.addr) else {
            let (name, who) = (h.export.escape_debug(), h.host_id.escape_debug());
            if self.has_export(&h.export) {
                self.access
                    .refuse(peer, &format!("host '{who}' may not open export '{name}'"));
                return HelloAnswer::Refused(Status::Access);
            }
            crate::log!(
                Level::Info,
                "{peer}: host '{who}' asked for unknown export '{name}'"
            );
            return HelloAnswer::Refused(Status::NoExport);
        };
        if let Some(r) = &h.replaces {
            if !self.take_over(r, h, peer, host, wait_until) {
                return HelloAnswer::Refused(Status::Busy);
            }
        }
        // The block the export takes I/O in (`Export::io_block`): a client told less would send
        // I/O that is refused (and split large I/O where it is refused too).
        let logical = export.io_block();
        let physical = export.backend().block_sizes().1.max(logical);
        let queues = h.queues.min(self.limits.max_queues);
        let depth = h.depth.min(self.limits.max_depth);
        let mut max_io = (h.max_io.min(self.limits.max_io) / logical * logical).max(logical);
        let sealed = proven.is_some() && link_payload.is_some();
        let frame_payload = match link_payload {
            // TCP: nothing is fragmented.
            None => max_io,
            // Datagrams: what both ends' links carry, in 8-byte units. Not capped at max_io:
            // it is also the datagram size both ends pack frames into (PROTOCOL.md §9.6). A
            // sealed frame carries 24 more bytes in the same datagram (§12.4).
            Some(link) => {
                let seal = if sealed { SEAL_LEN as u32 } else { 0 };
                (h.frame_payload.min(link).saturating_sub(seal) / 8 * 8).max(512)
            }
        };
        if link_payload.is_some() {
            // A message of more than MAX_FRAGMENTS frames is a burst that overflows a receiver's
            // backlog (1000 packets by default on Linux) before it can drain: split I/O earlier.
            max_io = max_io.min(frame_payload * MAX_FRAGMENTS) / logical * logical;
        }
        // The key root, shared by the session's queues (JOIN proofs, frame keys).
        let secret = proven.as_ref().map(|p| {
            Arc::new(SessionSecret::derive(
                &p.key,
                &h.auth.nonce_c,
                &h.auth.nonce_s,
                &p.transcript,
            ))
        });
        let encrypt = sealed && h.auth.encrypt;
        let floor = Self::queue_floor(max_io, depth, link_payload.is_some());
        let peer_s = peer.to_string();
        let owner = Owner {
            proven: host,
            shown: &h.host_id,
            id: peer,
            peer: &peer_s,
        };
        let copy = self.copy_limits(&export, frame_payload);
        // A sealed frame carries no CRC at all (its seal covers it): nothing to grant there.
        let header_crc = udp && !sealed && h.client_features & HEADER_CRC != 0;
        // Read once: the size the reply gives is the size the session's queues check against,
        // in whole blocks of the block announced (`Export::served_size`).
        let size = export.served_size();
        let (id, cookie, mem, placement) = match self.create(
            &export,
            &owner,
            (size, queues, depth, max_io, frame_payload, copy),
            (secret.clone(), proven.as_ref().map(|p| p.key.clone())),
            (encrypt, header_crc, link_payload.is_some()),
            floor,
        ) {
            Ok(x) => x,
            Err(st) => return HelloAnswer::Refused(st),
        };
        let mut reply = HelloReply {
            size,
            logical_block: logical,
            physical_block: physical,
            features: Self::features(&export),
            queues,
            depth,
            max_io,
            session: id,
            cookie,
            frame_payload,
            copy,
            session_flags: if header_crc { SESSION_HEADER_CRC } else { 0 },
            target_proof: [0; AUTH_LEN],
        };
        reply.target_proof = prove(&reply.proven_bytes());
        let seal = match (&secret, sealed) {
            (Some(s), true) => Some(QueueSeal::target_side(s, id, 0, encrypt)),
            _ => None,
        };
        HelloAnswer::Welcome(
            reply.encode(),
            Some(Box::new(Admitted {
                export,
                session: id,
                placement,
                queue: 0,
                size,
                depth,
                max_io,
                copy,
                seal,
                mem,
                header_crc,
            })),
        )
    }

    /// Has the reactors close the queue `r` names, if it is one this initiator held: its
    /// cookie matches, and the session's host is the one this HELLO proves (with keys) or, in
    /// a keyless session, the one it names from the same address (a keyless session's cookie
    /// travels in clear: someone who saw it must not close the queue from elsewhere). The
    /// export is not compared: one removed and added again under the name may still be running
    /// the old session's writes. True once nothing of that queue runs any more (or there is no
    /// such queue here: the target restarted, the session ended, the cookie is not that
    /// session's); false while its requests still run, after waiting for them until
    /// `wait_until`. The new session is created only after true, so a write the initiator
    /// sends again on it cannot be overtaken by the replaced queue's copy of the same write
    /// (PROTOCOL.md §2.6).
    fn take_over(
        &self,
        r: &QueueRef,
        h: &Hello,
        peer: &PeerId,
        proven: Option<&str>,
        wait_until: Option<Instant>,
    ) -> bool {
        let held = |s: &Session| {
            s.cookie == r.cookie
                && s.host == h.host_id
                && s.proven.as_deref() == proven
                && (proven.is_some() || (s.addr, s.scope) == (peer.addr, peer.scope))
        };
        let mut inner = self.lock();
        let Some(s) = inner.sessions.get_mut(&r.session).filter(|s| held(s)) else {
            return true;
        };
        let Some(q) = s.queues.get_mut(r.queue as usize) else {
            return true;
        };
        if self.close_for_successor(q, r.session, r.queue) {
            crate::log!(
                Level::Info,
                "session {} queue {}: replaced by a new session of host '{}'; closing it",
                r.session,
                r.queue,
                h.host_id.escape_debug()
            );
        }
        self.wait_for_leaves(inner, wait_until, |inner| {
            let state = inner
                .sessions
                .get(&r.session)
                .filter(|s| held(s))
                .and_then(|s| s.queues.get(r.queue as usize));
            matches!(state, None | Some(QueueState::Gone))
        })
    }

    /// Waits, until `deadline` (None: not at all), for queues to leave until `done`; whether
    /// it is.
    fn wait_for_leaves(
        &self,
        mut inner: std::sync::MutexGuard<'_, Inner>,
        deadline: Option<Instant>,
        done: impl Fn(&Inner) -> bool,
    ) -> bool {
        loop {
            if done(&inner) {
                return true;
            }
            let Some(left) = deadline.and_then(|t| t.checked_duration_since(Instant::now())) else {
                return false;
            };
            inner = self
                .left
                .wait_timeout(inner, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether queue `queue` of `session` is still wanted: the session is not revoked and the
    /// queue not being replaced. A reactor handed a queue checks it before serving it, since a
    /// close sent while the queue was on its way (between its admission and its `Msg::Queue`)
    /// found nothing to close.
    pub fn still_wanted(&self, session: u32, queue: u16) -> bool {
        self.lock()
            .sessions
            .get(&session)
            .is_some_and(|s| !s.revoked && s.queues.get(queue as usize) == Some(&QueueState::Live))
    }

    /// Queue `queue` of `session`, in `state`, makes way for a new session: one never joined
    /// never will be now, one live or closing is (again) told to close on whichever reactor
    /// serves it. Told again on every call that finds it still closing: closing twice is
    /// harmless, and a reactor that had not been handed the queue yet when first told
    /// (`Reactor::add` checks too) will not hold it up for ever. True if it was live.
    fn close_for_successor(&self, state: &mut QueueState, session: u32, queue: u16) -> bool {
        let was = *state;
        match was {
            QueueState::Free => *state = QueueState::Gone,
            QueueState::Live | QueueState::Closing => {
                *state = QueueState::Closing;
                if let Some(close) = self.closer.get() {
                    close(session, queue);
                }
            }
            QueueState::Gone => {}
        }
        was == QueueState::Live
    }

    /// Ends sessions `ids` for a login that takes their place (an iSCSI login reinstating its
    /// session, RFC 7143 §6.3.5): they are revoked, their queues closed on whichever reactor
    /// serves them, and the call waits until `deadline` for them to be gone, so that nothing
    /// they still run lands after the new session's I/O. False if one is there at the deadline.
    pub fn end_for_successor(&self, ids: &[u32], deadline: Instant) -> bool {
        let mut inner = self.lock();
        for id in ids {
            let Some(s) = inner.sessions.get_mut(id) else {
                continue;
            };
            s.revoked = true;
            for (q, state) in s.queues.iter_mut().enumerate() {
                self.close_for_successor(state, *id, q as u16);
            }
        }
        self.wait_for_leaves(inner, Some(deadline), |inner| {
            ids.iter().all(|id| !inner.sessions.contains_key(id))
        })
    }

    /// How the reactors are told to close one queue (`Msg::CloseQueue`); set once at start.
    pub fn set_queue_closer(&self, close: QueueCloser) {
        let _ = self.closer.set(close);
    }

    /// What one COPY of a session may do (PROTOCOL.md §13): the export's limits, as many
    /// ranges as one frame's payload holds whatever the source's name (a descriptor is never
    /// fragmented); nothing on a read-only export (the destination is always the session's),
    /// nor where a connection's share of the memory budget could not hold a COPY's bounce
    /// buffer beside its own buffers (a COPY granted would wait for memory forever).
    pub fn copy_limits(&self, export: &Export, frame_payload: u32) -> CopyLimits {
        if export.read_only || self.connection_share() < COPY_MIN_SHARE {
            return CopyLimits::default();
        }
        let limits = export.capabilities().limits;
        let max_bytes = limits.max_copy_bytes.min(u32::MAX as u64) as u32;
        CopyLimits {
            max_bytes,
            max_range: max_bytes,
            max_ranges: limits
                .max_copy_ranges
                .min(CopyDescriptor::ranges_fitting(frame_payload)),
        }
    }

    /// Registers a session whose first queue is connected; returns its id and cookie. `key` is
    /// the key its host proved (not the store's now: keys loaded since must revoke it); a key
    /// the store no longer holds for that host is refused (ACCESS).
    fn create(
        &self,
        export: &Arc<Export>,
        owner: &Owner,
        (size, queues, depth, max_io, frame_payload, copy): (u64, u16, u16, u32, u32, CopyLimits),
        (secret, key): (Option<Arc<SessionSecret>>, Option<Key>),
        (encrypt, header_crc, datagram): (bool, bool, bool),
        queue_floor: usize,
    ) -> Result<(u32, u64, Account, u32), Status> {
        let cookie = blkwire_auth::random_u64();
        let (host, peer) = (owner.shown, owner.peer);
        let mut inner = self.lock();
        if inner.shut {
            return Err(Status::Shutdown);
        }
        // The key its host proved must still be the host's. Checked under this lock, which
        // `keys_load`'s revocation takes after it swapped the store: if the store was swapped
        // before this check, the session is refused here (the revocation found nothing to
        // close); if after, the revocation finds the session and closes it.
        if let Some(h) = owner.proven.filter(|&h| self.access.key_of(h) != key) {
            drop(inner);
            self.access.refuse(
                &peer,
                &format!(
                    "host '{}': the key it proved was replaced or removed meanwhile (keys_load)",
                    h.escape_debug()
                ),
            );
            return Err(Status::Access);
        }
        // Removed (or replaced) while this session was being negotiated.
        let Some(served) = inner
            .exports
            .iter()
            .find(|s| Arc::ptr_eq(&s.export, export))
        else {
            return Err(Status::NoExport);
        };
        // The export's rules, and whether keys are required, as the handshake checked them
        // (`permitted`) may have changed since: `export_set_allow` and `keys_load` change them
        // and then revoke the sessions they no longer admit under this lock, so a session not
        // registered yet is checked here again, with the same rule, or it would escape both.
        if !self
            .access
            .permits(&served.acl, owner.proven, &owner.id.addr)
        {
            drop(inner);
            self.access.refuse(
                &peer,
                &format!(
                    "host '{}' may no longer open export '{}': its allow rules or the keys \
                     changed during the handshake",
                    host.escape_debug(),
                    export.name.escape_debug()
                ),
            );
            return Err(Status::Access);
        }
        if inner.sessions.len() >= self.limits.max_sessions {
            return Err(Status::NoMemory);
        }
        let from = host_of(peer);
        if inner.per_host.get(from).copied().unwrap_or(0) >= self.limits.max_sessions_per_host {
            return Err(Status::NoMemory);
        }
        let mem = Budget::child(&self.budget, self.limits.max_memory / 2);
        let account =
            Account::reserve(&mem, queue_floor, self.connection_share()).ok_or(Status::NoMemory)?;
        // Random, so a session id seen (or guessed) says nothing about the others (PROTOCOL.md
        // §12): the data path still never trusts an id alone.
        let id = loop {
            let id = blkwire_auth::random_u64() as u32;
            if id != 0 && !inner.sessions.contains_key(&id) {
                break id;
            }
        };
        let mut states = vec![QueueState::Free; queues as usize];
        states[0] = QueueState::Live;
        *inner.per_host.entry(from.to_string()).or_insert(0) += 1;
        let placement = inner.next_placement;
        inner.next_placement = placement.wrapping_add(1);
        inner.sessions.insert(
            id,
            Session {
                export: export.clone(),
                proven: owner.proven.map(str::to_string),
                addr: owner.id.addr,
                joined_from: Vec::new(),
                scope: owner.id.scope,
                key,
                revoked: false,
                placement,
                secret,
                encrypt,
                header_crc,
                frame_payload,
                datagram,
                host: host.to_string(),
                peer: peer.to_string(),
                size,
                depth,
                max_io,
                copy,
                cookie,
                queues: states,
                live: 1,
                stats: QueueStats::default(),
                mem,
                queue_floor,
            },
        );
        crate::log!(
            Level::Info,
            "session {id}: host '{}' from {peer} opened export '{}' ({queues} queue{} x {depth} deep, max I/O {})",
            host.escape_debug(),
            export.name,
            if queues == 1 { "" } else { "s" },
            blkwire_backend::format_size(max_io as u64)
        );
        Ok((id, cookie, account, placement))
    }

    /// A one-connection session for frontends without queue joining (NBD: every connection
    /// stands alone), given the export's `size` its handshake sent; `key` as for
    /// [`Registry::admit_first`].
    pub fn admit_single(
        &self,
        export: &Arc<Export>,
        (owner, key): (&Owner, Option<Key>),
        size: u64,
        depth: u16,
        max_io: u32,
    ) -> Result<Admitted, Status> {
        self.admit_first(
            export,
            (owner, key),
            (size, 1, depth, max_io),
            CopyLimits::default(),
        )
    }

    /// A session of `queues` queues whose first connection (queue 0) is admitted now and whose
    /// other queues join through [`Registry::join_verified`] once the frontend has checked who
    /// they are (NVMe/TCP: the admin queue creates it, I/O queue `qid` joins as queue `qid`).
    /// `key` is the key the frontend checked the owner's proof with (None: it proved none).
    pub fn admit_first(
        &self,
        export: &Arc<Export>,
        (owner, key): (&Owner, Option<Key>),
        (size, queues, depth, max_io): (u64, u16, u16, u32),
        copy: CopyLimits,
    ) -> Result<Admitted, Status> {
        let floor = Self::queue_floor(max_io, depth, false);
        let (session, _, mem, placement) = self.create(
            export,
            owner,
            (size, queues, depth, max_io, max_io, copy),
            (None, key),
            (false, false, false),
            floor,
        )?;
        Ok(Admitted {
            export: export.clone(),
            session,
            placement,
            queue: 0,
            size,
            depth,
            max_io,
            copy,
            seal: None,
            mem,
            header_crc: false,
        })
    }

    /// Admits queue `queue` of a session whose frontend proved the connection belongs to it
    /// (NVMe/TCP: the controller's host NQN, host id and address, and its DH-HMAC-CHAP when
    /// keys are configured), with `depth` requests in flight at most.
    pub fn join_verified(&self, session: u32, queue: u16, depth: u16) -> Result<Admitted, Status> {
        let mut inner = self.lock();
        if inner.shut {
            return Err(Status::Shutdown);
        }
        let s = inner
            .sessions
            .get_mut(&session)
            .filter(|s| !s.revoked)
            .ok_or(Status::Access)?;
        s.admit_queue(session, queue, depth, None, self.connection_share())
    }

    /// The fragment payload a session negotiated.
    pub fn frame_payload(&self, session: u32) -> Option<u32> {
        self.lock().sessions.get(&session).map(|s| s.frame_payload)
    }

    /// Admits a JOIN (PROTOCOL.md §2.3, §12.1, §12.2) from `peer`, whom the export's rules
    /// must admit as they admitted the HELLO (a keyless session's cookie travels in clear: it
    /// must not let in an address the rules keep out). On datagrams (`datagram`) the joiner
    /// must also have answered a challenge at its address (else `Err(Challenge)` with the
    /// nonce to send), and a sealed session's queue gets its frame keys; `raw`, when given, is
    /// the JOIN frame itself, which must open under the new queue's key first. A JOIN over
    /// the other kind of link than the session's HELLO is refused.
    pub fn join(
        &self,
        session: u32,
        queue: u16,
        payload: &[u8],
        peer: &PeerId,
        datagram: bool,
        raw: Option<&[u8]>,
    ) -> Result<Admitted, JoinRefused> {
        let mut inner = self.lock();
        if inner.shut {
            return Err(Status::Shutdown.into());
        }
        let permitted = inner.sessions.get(&session).is_some_and(|s| {
            // The host the session proved (none in a keyless session), as at HELLO.
            let host = s.secret.as_ref().map(|_| s.host.as_str());
            inner
                .exports
                .iter()
                .find(|e| Arc::ptr_eq(&e.export, &s.export))
                .is_some_and(|e| self.access.permits(&e.acl, host, &peer.addr))
        });
        if !permitted {
            return Err(Status::Access.into());
        }
        let datagram = datagram.then_some(peer);
        let s = inner
            .sessions
            .get_mut(&session)
            .filter(|s| !s.revoked)
            .ok_or(Status::Access)?;
        // Queues join over the kind of link that created the session. A JOIN proof is bound to
        // the session, not to a link, and in a datagram session that only authenticates frames
        // it travels in clear: replayed over TCP, where nothing is sealed, it would join an
        // unsealed queue into a sealed session. A datagram session's queues stay on its kind of
        // port too (UDP: an IP address; raw Ethernet: a MAC): its frame payload was negotiated
        // for that link, and a header-only CRC (§9.7) only for UDP.
        let same_port_kind = std::mem::discriminant(&s.addr) == std::mem::discriminant(&peer.addr);
        if s.datagram != datagram.is_some() || !same_port_kind {
            return Err(Status::Access.into());
        }
        let mut seal = match (&s.secret, datagram) {
            (Some(sec), Some(_)) => Some(QueueSeal::target_side(sec, session, queue, s.encrypt)),
            _ => None,
        };
        // A sealed session's JOIN must open under the new queue's key before it is read.
        let mut scratch = [0u8; Join::LEN];
        let payload = match (seal.as_mut(), raw) {
            (None, _) => payload,
            (Some(qs), Some(f)) => {
                let p = qs
                    .opener
                    .open(f, blkwire_wire::HEADER_LEN, &mut scratch)
                    .map_err(|_| Status::Access)?;
                // The initiator sealed its earlier JOINs of this queue (challenged, or sent
                // again) under the same key with lower numbers, each opened by an attempt's
                // opener of its own: replayed later, one must not open on the queue's (§12.4:
                // never a number seen).
                qs.opener.refuse_older();
                p
            }
            (Some(_), None) => return Err(Status::Access.into()),
        };
        // ACCESS, as for a session that does not exist: INVALID would tell a prober this one does.
        let j = Join::decode(payload).map_err(|_| Status::Access)?;
        if s.cookie != j.cookie {
            return Err(Status::Access.into());
        }
        let expected = match &s.secret {
            Some(sec) => sec.join_proof(session, queue, j.cookie),
            None => [0; AUTH_LEN],
        };
        if !proof::same(&expected, &j.proof) {
            return Err(Status::Access.into());
        }
        // A datagram queue answers at the address it joined from: that address must have
        // shown it receives there, or a session holder could aim its replies at anyone.
        if let Some(peer) = datagram {
            if let Some(nonce) = self.access.address(
                peer,
                blkwire_auth::cookie::Purpose::Join,
                &j.attempt(session, queue),
                &j.nonce_s,
            ) {
                return Err(JoinRefused::Challenge(nonce));
            }
        }
        let depth = s.depth;
        match s.admit_queue(session, queue, depth, seal, self.connection_share()) {
            Ok(a) => {
                if peer.addr != s.addr && !s.joined_from.contains(&peer.addr) {
                    s.joined_from.push(peer.addr);
                }
                Ok(a)
            }
            Err(Status::Access) => Err(JoinRefused::Ended),
            Err(st) => Err(st.into()),
        }
    }

    /// A queue closed; the session ends with its last queue.
    pub fn leave(&self, session: u32, queue: u16, stats: &QueueStats) {
        let mut inner = self.lock();
        // A HELLO may be waiting for this queue to be gone (`take_over`).
        self.left.notify_all();
        let Some(s) = inner.sessions.get_mut(&session) else {
            return;
        };
        if let Some(q) = s.queues.get_mut(queue as usize) {
            *q = QueueState::Gone;
        }
        s.stats.add(stats);
        s.live = s.live.saturating_sub(1);
        if s.live == 0 {
            let s = inner.sessions.remove(&session).expect("present");
            let from = host_of(&s.peer);
            if let Some(n) = inner.per_host.get_mut(from) {
                *n -= 1;
                if *n == 0 {
                    inner.per_host.remove(from);
                }
            }
            let st = s.stats;
            crate::log!(
                Level::Info,
                "session {session}: host '{}' from {} closed export '{}': {} reads, {} writes, {} read, {} written, {} errors, {} protocol errors",
                s.host.escape_debug(),
                s.peer,
                s.export.name,
                st.reads,
                st.writes,
                blkwire_backend::format_size(st.bytes_read),
                blkwire_backend::format_size(st.bytes_written),
                st.errors,
                st.protocol_errors
            );
            // It may hold the last reference to an export removed meanwhile: let it go after
            // the lock (see `remove_export`).
            drop(inner);
            drop(s);
        }
    }

    /// Serves a new export (`export_add`). `Err` is a one-line reason.
    pub fn add_export(&self, spec: ExportSpec) -> Result<(), String> {
        let acl = self.allow_rules(&spec.name, spec.allow.as_deref())?;
        if self.has_export(&spec.name) {
            return Err(format!("export '{}' exists already", spec.name));
        }
        // Opened outside the lock: opening a file or device may take a while, and handshakes
        // must not wait for it.
        let export = Arc::new(Export::open(&spec).map_err(|e| e.to_string())?);
        let mut inner = self.lock();
        if inner.exports.iter().any(|s| s.export.name == spec.name) {
            return Err(format!("export '{}' exists already", spec.name));
        }
        inner.exports.push(Served { spec, export, acl });
        Ok(())
    }

    /// Serves `export`, built by a test around a backend of its own (`blkwire_backend::testing`),
    /// as a `null:` export of its size would be announced.
    #[cfg(test)]
    pub(crate) fn add_built_export(&self, export: Export) {
        let spec = ExportSpec::parse(&format!("{}=null:{}", export.name, export.size()))
            .expect("a valid spec");
        let export = Arc::new(export);
        self.lock().exports.push(Served {
            spec,
            export,
            acl: Acl::default(),
        });
    }

    /// An export's `allow=` rules, parsed; host ids only on a target with keys (nothing else
    /// proves them).
    fn allow_rules(&self, export: &str, allow: Option<&str>) -> Result<Acl, String> {
        let Some(rules) = allow else {
            return Ok(Acl::default());
        };
        let acl = Acl::parse(rules).map_err(|e| format!("export '{export}': {e}"))?;
        if let (Some(host), false) = (acl.hosts().next(), self.access.has_keys()) {
            return Err(format!(
                "export '{export}': allow={host} names a host id, but a host id is only proven \
                 with a key: load keys first (serve --keys FILE, or the keys_load method)"
            ));
        }
        Ok(acl)
    }

    /// Stops serving an export (`export_remove`): refused while sessions use it unless
    /// `force`, which revokes them. Returns the sessions to close.
    pub fn remove_export(&self, name: &str, force: bool) -> Result<Vec<u32>, String> {
        let mut inner = self.lock();
        let at = inner
            .exports
            .iter()
            .position(|s| s.export.name == name)
            .ok_or_else(|| no_such_export(name))?;
        let export = inner.exports[at].export.clone();
        let users: Vec<u32> = inner
            .sessions
            .iter()
            .filter(|(_, s)| Arc::ptr_eq(&s.export, &export) && !s.revoked)
            .map(|(id, _)| *id)
            .collect();
        if !users.is_empty() && !force {
            return Err(format!(
                "export '{name}' is in use by {} session{}: close them first, or force the \
                 removal (their I/O in flight fails)",
                users.len(),
                if users.len() == 1 { "" } else { "s" }
            ));
        }
        let removed = inner.exports.remove(at);
        for id in &users {
            if let Some(s) = inner.sessions.get_mut(id) {
                s.revoked = true;
            }
        }
        // With no session on it, this is the export's last reference, and dropping a backend
        // may wait on the network (`rbd:` flushes and closes its image, for up to two Ceph
        // timeouts): after the lock, which every handshake takes.
        drop(inner);
        drop((removed, export));
        Ok(users)
    }

    /// Grows an export to `size` bytes (`export_resize`, see `Export::resize`) and records the
    /// size in its spec for `save_config`; returns the size it had. Sessions keep the size they
    /// were given (their queues check against it); new sessions get the new one.
    pub fn resize_export(&self, name: &str, size: u64) -> Result<u64, ResizeError> {
        let export = self
            .lock()
            .exports
            .iter()
            .find(|s| s.export.name == name)
            .map(|s| s.export.clone())
            .ok_or_else(|| ResizeError::Refused(no_such_export(name)))?;
        // Outside the lock: growing a file may take a moment, and handshakes must not wait.
        let old = export.resize(size)?;
        let mut inner = self.lock();
        if let Some(s) = inner
            .exports
            .iter_mut()
            .find(|s| Arc::ptr_eq(&s.export, &export))
        {
            // The size now, not `size`: of two resizes at once, the one that gets here last
            // records the larger (every resize is followed by its own update).
            s.spec = s.spec.resized(export.size());
        }
        Ok(old)
    }

    /// Replaces an export's allow rules (`export_set_allow`; None admits everyone the target
    /// admits). Returns the sessions of hosts the new rules no longer admit, to close.
    pub fn set_allow(&self, name: &str, allow: Option<String>) -> Result<Vec<u32>, String> {
        // An unknown export is the first thing wrong, before what its rules would say.
        if !self.has_export(name) {
            return Err(no_such_export(name));
        }
        let acl = self.allow_rules(name, allow.as_deref())?;
        let mut inner = self.lock();
        let served = inner
            .exports
            .iter_mut()
            .find(|s| s.export.name == name)
            .ok_or_else(|| no_such_export(name))?;
        served.spec.allow = allow;
        served.acl = acl;
        drop(inner);
        Ok(self.revoke_unpermitted())
    }

    /// Revokes the sessions whose host the rules or keys no longer admit (after
    /// `export_set_allow` or `keys_load`); returns them, to close.
    pub fn revoke_unpermitted(&self) -> Vec<u32> {
        let mut inner = self.lock();
        let Inner {
            exports, sessions, ..
        } = &mut *inner;
        let mut out = Vec::new();
        for (id, s) in sessions.iter_mut() {
            if s.revoked {
                continue;
            }
            let acl = exports
                .iter()
                .find(|e| Arc::ptr_eq(&e.export, &s.export))
                .map(|e| &e.acl);
            let still = acl.is_some_and(|acl| {
                std::iter::once(&s.addr)
                    .chain(&s.joined_from)
                    .all(|a| self.access.permits(acl, s.proven.as_deref(), a))
                    && s.proven.as_deref().is_none_or(|h| {
                        self.access.key_of(h).map(|k| k.to_hex()) == s.key.as_ref().map(Key::to_hex)
                    })
            });
            if !still {
                s.revoked = true;
                out.push(*id);
            }
        }
        if !out.is_empty() {
            crate::log!(
                Level::Info,
                "closing {} session(s) the rules or keys no longer admit",
                out.len()
            );
        }
        out
    }

    /// An export's allow rules as given (`RULE+RULE`), if it has any.
    pub fn allow_of(&self, name: &str) -> Option<String> {
        let inner = self.lock();
        inner
            .exports
            .iter()
            .find(|s| s.export.name == name)
            .and_then(|s| s.spec.allow.clone())
    }

    /// True while the session exists (being closed included).
    pub fn holds(&self, id: u32) -> bool {
        self.lock().sessions.contains_key(&id)
    }

    /// True when the session is gone or being closed by the control plane.
    pub fn is_revoked(&self, id: u32) -> bool {
        self.lock().sessions.get(&id).is_none_or(|s| s.revoked)
    }

    /// How many queues of a session are connected now (0: no such session).
    pub fn live_queues(&self, id: u32) -> u16 {
        self.lock().sessions.get(&id).map_or(0, |s| s.live)
    }

    /// Revokes one session (`session_close`); false if there is no such session.
    pub fn revoke(&self, id: u32) -> bool {
        match self.lock().sessions.get_mut(&id) {
            Some(s) => {
                s.revoked = true;
                true
            }
            None => false,
        }
    }

    /// What `export_list` says: each export's spec, backend, size and how many sessions use it.
    pub fn describe_exports(&self) -> Vec<serde_json::Value> {
        let inner = self.lock();
        inner
            .exports
            .iter()
            .map(|s| {
                let sessions = inner
                    .sessions
                    .values()
                    .filter(|x| Arc::ptr_eq(&x.export, &s.export) && !x.revoked)
                    .count();
                serde_json::json!({
                    "name": s.spec.name,
                    "spec": s.spec.options(),
                    "backend": s.export.backend().describe(),
                    "size": s.export.size(),
                    "read_only": s.spec.read_only,
                    "allow": s.spec.allow,
                    "sessions": sessions,
                })
            })
            .collect()
    }

    /// The exports' specs in order (`save_config`).
    pub fn export_specs(&self) -> Vec<ExportSpec> {
        self.lock().exports.iter().map(|s| s.spec.clone()).collect()
    }

    /// What `session_list` says of each live session.
    pub fn describe_sessions(&self) -> Vec<serde_json::Value> {
        self.sessions()
            .iter()
            .map(|s| serde_json::to_value(s).unwrap_or_default())
            .collect()
    }

    /// Every live session, by id.
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let inner = self.lock();
        let mut v: Vec<_> = inner
            .sessions
            .iter()
            .map(|(&session, s)| SessionInfo {
                session,
                export: s.export.name.clone(),
                host: s.host.clone(),
                peer: s.peer.clone(),
                queues: s.live,
                closing: s.revoked,
            })
            .collect();
        v.sort_by_key(|s| s.session);
        v
    }
}

/// A live session as STATS, `session_list` and the metrics name it: its export, the host id
/// its HELLO gave (the peer's own words unless it proved a key) and the peer's address.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SessionInfo {
    pub session: u32,
    pub export: String,
    pub host: String,
    pub peer: String,
    /// Queues connected now (STATS lists them in this field's place).
    pub queues: u16,
    /// Revoked by the control plane: its queues are closing.
    pub closing: bool,
}

fn no_such_export(name: &str) -> String {
    format!("no export named '{name}' (`blkwire export ls` or export_list shows them)")
}

/// The address part of a peer ("192.0.2.1:7700" -> "192.0.2.1", "[::1]:7700" -> "[::1]"; a
/// MAC address has no port and is taken whole).
fn host_of(peer: &str) -> &str {
    match peer.parse::<std::net::SocketAddr>() {
        Ok(_) => peer.rsplit_once(':').map_or(peer, |(h, _)| h),
        Err(_) => peer,
    }
}

#[cfg(test)]
mod tests;
