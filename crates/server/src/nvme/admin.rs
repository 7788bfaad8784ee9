//! An NVMe/TCP admin queue (and a discovery controller's only queue), served by the thread that
//! ran its handshake, with blocking I/O: properties (CAP, VS, CC, CSTS), Identify, Get/Set
//! Features, Get Log Page (the discovery log; error, SMART and firmware pages), Keep Alive,
//! Abort and held Asynchronous Event Requests, and DH-HMAC-CHAP. Admin commands are rare and
//! small; the data path never waits for this thread.
//!
//! Keep-alive (Base spec §3.9): a controller that hears nothing for KATO ends, and its session
//! (every I/O queue) with it. KATO 0 turns the timer off; TCP keepalive still notices a host
//! that vanished. A controller without I/O queues ends when idle whatever its KATO, and with
//! DH-HMAC-CHAP required, one that has not authenticated within the handshake timeout ends.
//! Those limits hold within a PDU too: each PDU, and each command's data and answer, has one
//! deadline that never passes them, however the host trickles its bytes.
//! Such a controller has no session until its host has proved its key: the sessions of its
//! namespaces are admitted then (`super::admit_authenticated`).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_auth::dhchap::{self, ControllerAuth};
use blkwire_auth::Key;
use blkwire_wire::nvme_tcp::{self, CapsuleCmd, Pdu, Sgl};

use super::spec::{self, admin, fctype, prop, sc, DiscoveryEntry, Facts};
use super::{command_data, read_pdu, terminate, Completion, Link};
use crate::access::PeerId;
use crate::log::Level;
use crate::session::{Admitted, Registry};
use crate::Bounded;

/// How often a waiting admin thread looks at the clock and at its session.
const TICK: Duration = Duration::from_millis(500);
/// The longest log page read in one Get Log Page (a discovery log of 255 entries; longer ones
/// are read in pieces with an offset, as hosts do).
const MAX_LOG: u64 = 256 << 10;
/// A controller without I/O queues (every discovery controller) ends after this long without a
/// command, whatever KATO its host asked for (0, no timer, included): such a controller holds a
/// thread and one of [`super::MAX_CONTROLLERS`] and serves nothing, so a host that connects and
/// falls silent must not keep it for the days a large KATO allows, or for ever. Linux nvmet
/// gives discovery controllers the same 120 s. A controller with I/O queues keeps its KATO (0
/// too: blkwire's own client runs without a timer, and TCP keepalive notices a vanished host).
const IDLE_KATO_MS: u32 = 120_000;
/// A PDU that has begun must be whole within this, and a command (its data fetched with an R2T,
/// its answer sent) done within this of its arrival: each is one deadline, however the host
/// trickles its bytes, and never past the moment the controller must end.
const PDU_TIMEOUT: Duration = Duration::from_secs(10);

/// How an admin queue starts.
pub struct AdminSetup {
    /// Digests and alignment.
    pub link: Link,
    /// Connect's SQSIZE + 1.
    pub entries: u16,
    /// Connect's KATO (ms; 0: none).
    pub kato_ms: u32,
    /// The controller.
    pub facts: Arc<Facts>,
    /// The host's NQN.
    pub hostnqn: String,
    /// DH-HMAC-CHAP must succeed before anything else.
    pub auth_required: bool,
    /// Our address as the host reached it (discovery log entries for wildcard listeners).
    pub local: SocketAddr,
    /// The host's address (which subsystems the discovery log shows it, and its sessions'
    /// owner once it authenticates).
    pub peer: PeerId,
}

/// An admin queue's state.
pub struct AdminQueue {
    s: AdminSetup,
    /// The session of each namespace, in `facts.namespaces` order (none: a discovery
    /// controller, or one whose host has not authenticated yet).
    admitted: Vec<Admitted>,
    /// DH-HMAC-CHAP is required and has not succeeded yet: when it does, the namespaces'
    /// sessions are admitted (a controller of a subsystem holds none before) and the
    /// controller's entry says so.
    admission_pending: bool,
    /// NSIDs of namespaces removed since the host last read the Changed Namespace List.
    changed: Vec<u32>,
    /// Namespaces already found removed (their sessions revoked), in `admitted` order.
    gone: Vec<bool>,
    sq_head: u16,
    cc: u32,
    io_queues: Option<u16>,
    async_config: u32,
    held_events: Vec<u16>,
    /// A namespace notice was sent and the host has not read the log yet.
    notice_sent: bool,
    authenticated: bool,
    auth: Option<QueueAuth>,
    /// Why the host, having proved its key, was not admitted: the AUTH_Receive that would
    /// have read Success1 reads AUTH_Failure1, and then the controller ends.
    refused: Option<String>,
    /// Bytes of data the host's SGL describes for the command being answered.
    room: u32,
}

/// What the thread must do when the queue ends.
pub struct Ended {
    /// The sessions to close (its I/O queues) and leave: one per namespace.
    pub sessions: Vec<(u32, u16)>,
}

impl AdminQueue {
    /// An admin queue Connect accepted (and answered).
    pub fn new(s: AdminSetup, admitted: Vec<Admitted>) -> AdminQueue {
        let authenticated = !s.auth_required;
        AdminQueue {
            admission_pending: s.auth_required,
            s,
            gone: vec![false; admitted.len()],
            admitted,
            changed: Vec::new(),
            sq_head: 1,
            cc: 0,
            io_queues: None,
            async_config: 0,
            held_events: Vec::new(),
            notice_sent: false,
            authenticated,
            auth: None,
            refused: None,
            room: 0,
        }
    }

    /// The DH-HMAC-CHAP exchange failed and the host was told.
    fn auth_failed(&self) -> bool {
        self.auth.as_ref().is_some_and(|a| a.failed())
    }

    /// The controller id.
    pub fn cntlid(&self) -> u16 {
        self.s.facts.cntlid
    }

    /// Serves the queue until the host leaves, breaks the protocol, misses its keep-alive, or
    /// the session is closed by the control plane; then forgets the controller.
    pub(crate) fn serve(mut self, mut sock: Bounded, registry: &Registry, peer: &str) -> Ended {
        if self.s.kato_ms == 0 && self.s.facts.is_discovery() {
            // A discovery controller never has I/O queues, so the idle limit is its KATO: Get
            // Features says so.
            self.s.kato_ms = IDLE_KATO_MS;
        }
        let mut kato = kato_of(self.s.kato_ms);
        let started = Instant::now();
        // A host that must authenticate has as long as any handshake has (--handshake-timeout):
        // until then it holds a controller (a thread, no session) without having proved who it
        // is, and commands that get Authentication Required still count as life.
        let auth_deadline = registry.limits().handshake_timeout;
        let mut alive = Instant::now();
        // When the controller must end and why, as things stand: the authentication deadline
        // (while unauthenticated), KATO and the idle limit (from the last command).
        let end = |q: &AdminQueue, alive: Instant, kato: Option<Duration>| {
            let auth = (!q.authenticated).then_some((started, auth_deadline));
            expiry(alive, (kato, q.s.kato_ms), q.has_io_queues(registry), auth)
        };
        let mut buf = Vec::with_capacity(1024);
        let mut revocations_checked = Instant::now();
        let why = loop {
            // Checked on every turn, not only when the socket is quiet: a host that sends a
            // command now and then must not postpone the authentication deadline.
            let limit = end(&self, alive, kato);
            if let Some((_, why)) = limit.as_ref().filter(|(at, _)| Instant::now() >= *at) {
                break why.clone();
            }
            let readable = wait_readable(&sock.s, TICK);
            // Checked between PDUs only, these limits would wait for the end of a PDU the host
            // trickles a byte at a time, each within any timeout per read: hours for 8 KiB.
            // So what comes next (a PDU, or a held AER's completion) must be done by them too.
            sock.deadline = within(Instant::now() + PDU_TIMEOUT, &limit);
            // Revocations (`session close`, keys or rules changed, the export or namespace
            // removed) are looked for when the socket is quiet and at least every TICK when it
            // is not: a host sending a command more often than that must not keep a controller
            // whose sessions are gone, nor, its key removed or replaced, one it authenticated
            // with the old key (a discovery controller holds no session to revoke).
            let due = matches!(readable, Ok(false)) || revocations_checked.elapsed() >= TICK;
            if due {
                revocations_checked = Instant::now();
                if let Some(why) = self.revoked(&mut sock, registry) {
                    break why;
                }
            }
            match readable {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => break e.to_string(),
            }
            let n = match read_pdu(&mut sock, &mut buf, &self.s.link.rx) {
                Ok(Ok(n)) => n,
                Ok(Err(e)) => {
                    terminate(&mut sock, &e, &buf, &self.s.link.tx);
                    break e.to_string();
                }
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    break "the host disconnected".into()
                }
                Err(e) if timed_out(&e) => {
                    break match limit.filter(|(at, _)| Instant::now() >= *at) {
                        Some((_, why)) => why,
                        None => format!("a PDU not whole within {} s", PDU_TIMEOUT.as_secs()),
                    };
                }
                Err(e) => break e.to_string(),
            };
            let cmd = match nvme_tcp::decode(&buf[..n], &self.s.link.rx) {
                Ok(Pdu::CapsuleCmd(c)) => c,
                Ok(Pdu::H2CTermReq(t)) => {
                    break format!("the host ended the queue (FES {:#x})", t.fes);
                }
                Ok(other) => break format!("unexpected {:?} on the admin queue", other.typ()),
                Err(e) => {
                    terminate(&mut sock, &e, &buf[..n], &self.s.link.tx);
                    break e.to_string();
                }
            };
            // A PDU trickled in over seconds (up to PDU_TIMEOUT): the revocations are looked
            // for again before its command runs, not after it was served.
            if revocations_checked.elapsed() >= TICK {
                revocations_checked = Instant::now();
                if let Some(why) = self.revoked(&mut sock, registry) {
                    break why;
                }
            }
            // Every command counts as life; the host also sends Keep Alive every KATO/2.
            alive = Instant::now();
            // The command's data and answer, by the limits as they stand now it has come.
            sock.deadline = within(alive + PDU_TIMEOUT, &end(&self, alive, kato));
            let outcome = self.command(&mut sock, &cmd, registry);
            if let Some(why) = self.refused.as_ref().filter(|_| self.auth_failed()) {
                // The AUTH_Receive that would have read Success1 read Failure1.
                break format!("not admitted after DH-HMAC-CHAP: {why}");
            }
            if self.auth_failed() {
                registry.access.refuse(
                    &peer,
                    &format!(
                        "NVMe host '{}' failed DH-HMAC-CHAP",
                        self.s.hostnqn.escape_debug()
                    ),
                );
                break "DH-HMAC-CHAP failed".into();
            }
            // The host has just proved its key (its Reply checked out): now its namespaces'
            // sessions are admitted, before the next command (the AUTH_Receive that reads
            // Success1) is read. Refused, that AUTH_Receive reads AUTH_Failure1 instead, and
            // the controller ends once it has (or at the authentication deadline); until then
            // every other command gets Authentication Required.
            if let Some(key) = self
                .auth
                .as_ref()
                .filter(|a| self.admission_pending && a.host_proved())
                .map(|a| a.key.clone())
            {
                self.admission_pending = false;
                let who = (self.s.hostnqn.as_str(), &self.s.peer, peer);
                let admitted = if self.s.facts.is_discovery() {
                    // No namespaces, no sessions: only the entry changes.
                    registry
                        .nvme
                        .authenticated(self.cntlid(), self.s.facts.clone(), false)
                        .then(|| (self.s.facts.clone(), Vec::new()))
                        .ok_or_else(|| "its controller was forgotten".to_string())
                } else {
                    super::admit_authenticated(registry, &self.s.facts, who, &key)
                };
                match admitted {
                    Ok((facts, admitted)) => {
                        self.s.facts = facts;
                        self.gone = vec![false; admitted.len()];
                        self.admitted = admitted;
                    }
                    Err(why) => {
                        if let Some(a) = self.auth.as_mut() {
                            a.refuse();
                        }
                        self.authenticated = false;
                        self.refused = Some(why);
                    }
                }
            }
            match outcome {
                Some(Outcome::Continue) => {}
                Some(Outcome::Kato(ms)) => {
                    self.s.kato_ms = ms;
                    kato = kato_of(ms);
                }
                None => break "the connection failed".into(),
            }
        };
        crate::log!(
            Level::Info,
            "{peer}: NVMe controller {} ended: {why}",
            self.cntlid()
        );
        registry.nvme.remove(self.cntlid());
        Ended {
            sessions: self.admitted.iter().map(|a| (a.session, a.queue)).collect(),
        }
    }

    /// Why this controller must end now, if it must: its host's key removed or replaced, its
    /// place given to a new controller before it authenticated, its sessions closed.
    fn revoked(&mut self, sock: &mut Bounded, registry: &Registry) -> Option<String> {
        if self.key_replaced(registry) {
            return Some("its host's key was removed or replaced".into());
        }
        if !self.authenticated && !registry.nvme.contains(self.cntlid()) {
            return Some("it had not authenticated, and its place went to a new controller".into());
        }
        if !self.admitted.is_empty() {
            match self.namespaces_gone(sock, registry) {
                Some(true) => return Some("its sessions were closed".into()),
                Some(false) => {}
                None => return Some("the connection failed".into()),
            }
        }
        None
    }

    /// The host authenticated with a key the key store no longer has for it (`keys_load`).
    fn key_replaced(&self, registry: &Registry) -> bool {
        let proven = self.auth.as_ref().filter(|_| self.authenticated);
        proven.is_some_and(|a| registry.access.key_of(&self.s.hostnqn).as_ref() != Some(&a.key))
    }

    /// True while some namespace's session has a queue besides this admin queue (queue 0).
    fn has_io_queues(&self, registry: &Registry) -> bool {
        self.admitted
            .iter()
            .any(|a| registry.live_queues(a.session) > 1)
    }

    /// Runs one command and sends its answer (held AERs get none). None: the socket failed.
    fn command(
        &mut self,
        sock: &mut Bounded,
        c: &CapsuleCmd<'_>,
        registry: &Registry,
    ) -> Option<Outcome> {
        self.sq_head = (self.sq_head + 1) % self.s.entries.max(1);
        let q = c.sqe;
        // What the host's buffer for this command's data holds: no answer sends more.
        self.room = room(&q);
        let fabrics = q.opcode == spec::FABRICS;
        let fct = q.nsid as u8;
        let auth_cmd = fabrics && matches!(fct, fctype::AUTH_SEND | fctype::AUTH_RECEIVE);
        if !self.authenticated && !auth_cmd {
            return self.finish(sock, q.cid, sc::AUTH_REQUIRED | sc::DNR, 0, None);
        }
        if fabrics {
            return match fct {
                fctype::PROPERTY_GET => {
                    let (st, v) = self.property_get(q.cdw10 as u8, q.cdw11);
                    self.send(sock, q.cid, st, v, None)
                }
                fctype::PROPERTY_SET => {
                    let v = q.cdw12 as u64 | (q.cdw13 as u64) << 32;
                    let st = self.property_set(q.cdw10 as u8, q.cdw11, v);
                    self.finish(sock, q.cid, st, 0, None)
                }
                fctype::AUTH_SEND => {
                    let data = match command_data(sock, &self.s.link, c, 8192)? {
                        Ok(d) => d,
                        Err(st) => return self.finish(sock, q.cid, st, 0, None),
                    };
                    let st = self.auth_send(registry, &q, &data);
                    self.finish(sock, q.cid, st, 0, None)
                }
                fctype::AUTH_RECEIVE => {
                    let (st, data) = self.auth_receive(&q);
                    self.finish(sock, q.cid, st, 0, data)
                }
                fctype::CONNECT => self.finish(sock, q.cid, sc::CMD_SEQ_ERROR | sc::DNR, 0, None),
                _ => self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None),
            };
        }
        let facts = self.s.facts.clone();
        let discovery = facts.is_discovery();
        // A namespace whose session was closed (removed from the subsystem, or its export
        // removed) is inactive: Identify shows zeros for it and lists it no more.
        let live = |n: &&spec::NsFacts| !registry.is_revoked(n.session);
        match q.opcode {
            admin::IDENTIFY => {
                let cns = q.cdw10 as u8;
                let csi = (q.cdw11 >> 24) as u8;
                // NSID FFFFFFFFh asks for what all namespaces share (namespace management,
                // not offered), and an active list from FFFFFFFEh on has nothing to start
                // after: Invalid Namespace or Format (Base spec, Identify; as nvmet answers).
                let bad_nsid = match cns {
                    0x00 => q.nsid == u32::MAX,
                    0x02 => q.nsid >= u32::MAX - 1,
                    _ => false,
                };
                if bad_nsid && !discovery {
                    return self.finish(sock, q.cid, sc::INVALID_NS | sc::DNR, 0, None);
                }
                let data = match cns {
                    0x01 => Some(facts.identify_controller()),
                    _ if discovery => None,
                    0x00 => Some(Facts::identify_namespace(
                        facts.namespace(q.nsid).filter(live),
                    )),
                    0x02 => Some(Facts::active_namespaces(
                        q.nsid,
                        facts.namespaces.iter().filter(live).map(|n| n.nsid),
                    )),
                    0x03 => {
                        let Some(n) = facts.namespace(q.nsid).filter(live) else {
                            return self.finish(sock, q.cid, sc::INVALID_NS | sc::DNR, 0, None);
                        };
                        Some(Facts::namespace_descriptors(n))
                    }
                    0x06 if csi == 0 => facts.identify_nvm_controller(),
                    _ => None,
                };
                match data {
                    Some(d) => self.finish(sock, q.cid, sc::SUCCESS, 0, Some(d)),
                    None => self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None),
                }
            }
            admin::GET_LOG_PAGE => {
                let lid = q.cdw10 as u8;
                let numd = ((q.cdw10 >> 16) | (q.cdw11 & 0xffff) << 16) as u64 + 1;
                let offset = q.cdw12 as u64 | (q.cdw13 as u64) << 32;
                let known = match lid {
                    0x70 => discovery,
                    0x01..=0x04 => !discovery,
                    _ => false,
                };
                if !known {
                    return self.finish(sock, q.cid, sc::INVALID_LOG_PAGE | sc::DNR, 0, None);
                }
                if !offset.is_multiple_of(4) {
                    return self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None);
                }
                // Past the end reads as zeros. A host asking for more than MAX_LOG gets an
                // error rather than a buffer that large on this thread (outside the budget).
                let len = numd * 4;
                if len > MAX_LOG {
                    return self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None);
                }
                let len = len as usize;
                // The discovery log is built as far as asked (it may list thousands).
                let out = if lid == 0x70 {
                    self.discovery_log(registry, offset, len)
                } else {
                    let page = match lid {
                        0x01 => vec![0u8; 64],
                        0x02 => smart_log(),
                        0x03 => firmware_log(),
                        // Changed Namespace List (Base spec §5.16.1.5): read, it is cleared
                        // (below, once the command is known to succeed).
                        _ => self.changed_list(),
                    };
                    let mut out = vec![0u8; len];
                    let start = offset.min(page.len() as u64) as usize;
                    let n = (page.len() - start).min(len);
                    out[..n].copy_from_slice(&page[start..start + n]);
                    out
                };
                // Read (RAE clear): cleared only when the host gets it. A read that fails
                // (here, or for its buffer: `send`) would leave a host that reads again an
                // empty list, and no notice would tell it of the namespaces gone.
                if lid == 0x04 && q.cdw10 & 1 << 15 == 0 && len <= self.room as usize {
                    self.changed.clear();
                    self.notice_sent = false;
                }
                self.finish(sock, q.cid, sc::SUCCESS, 0, Some(out))
            }
            admin::SET_FEATURES => {
                let fid = q.cdw10 as u8;
                if q.cdw10 & 1 << 31 != 0 {
                    return self.finish(sock, q.cid, sc::FEATURE_NOT_SAVEABLE | sc::DNR, 0, None);
                }
                match fid {
                    // 65535 (0's based: 65536) is Invalid Field (NVMe Base 2.0, Number of
                    // Queues). Once I/O queues exist the allocation stays what it was (it
                    // "shall not change"): lowered, queues above it would run on uncounted.
                    0x07 if !discovery && (q.cdw11 as u16 == 0xffff || q.cdw11 >> 16 == 0xffff) => {
                        self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None)
                    }
                    0x07 if !discovery => {
                        // (Queues connected under no Set Features have the most there is.)
                        let n = match self.io_queues {
                            _ if self.has_io_queues(registry) => {
                                self.io_queues.unwrap_or(super::MAX_IO_QUEUES)
                            }
                            _ => {
                                let asked = (q.cdw11 as u16).min((q.cdw11 >> 16) as u16) as u32 + 1;
                                let n = asked.min(super::MAX_IO_QUEUES as u32) as u16;
                                self.io_queues = Some(n);
                                registry.nvme.set_io_queues(self.cntlid(), n);
                                n
                            }
                        };
                        let v = (n as u32 - 1) | (n as u32 - 1) << 16;
                        self.finish(sock, q.cid, sc::SUCCESS, v, None)
                    }
                    0x0f => {
                        let ms = q.cdw11;
                        self.finish(sock, q.cid, sc::SUCCESS, 0, None)?;
                        Some(Outcome::Kato(ms))
                    }
                    0x0b => {
                        self.async_config = q.cdw11;
                        self.finish(sock, q.cid, sc::SUCCESS, 0, None)
                    }
                    // Volatile Write Cache: it stays on. Turning it off would oblige every write
                    // of every I/O queue to reach the medium before it completes, and the I/O
                    // queues (on the reactors) never hear from this thread; so WCE=0 is refused
                    // rather than acknowledged and ignored, and the host knows to use FUA or
                    // Flush itself.
                    0x06 if !discovery && facts.write_cache() => {
                        let st = if q.cdw11 & 1 != 0 {
                            sc::SUCCESS
                        } else {
                            sc::INVALID_FIELD | sc::DNR
                        };
                        self.finish(sock, q.cid, st, 0, None)
                    }
                    _ => self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None),
                }
            }
            admin::GET_FEATURES => {
                let fid = q.cdw10 as u8;
                let v = match fid {
                    0x07 if !discovery => {
                        let n = self.io_queues.unwrap_or(super::MAX_IO_QUEUES) as u32 - 1;
                        Some(n | n << 16)
                    }
                    0x0f => Some(self.s.kato_ms),
                    0x0b => Some(self.async_config),
                    0x06 if !discovery => Some(facts.write_cache() as u32),
                    // Arbitration, power management, error recovery, interrupt coalescing:
                    // nothing configured.
                    0x01 | 0x02 | 0x05 | 0x08 if !discovery => Some(0),
                    _ => None,
                };
                match v {
                    Some(v) => self.finish(sock, q.cid, sc::SUCCESS, v, None),
                    None => self.finish(sock, q.cid, sc::INVALID_FIELD | sc::DNR, 0, None),
                }
            }
            admin::KEEP_ALIVE => self.finish(sock, q.cid, sc::SUCCESS, 0, None),
            // Nothing is ever aborted: dword 0 bit 0 says so.
            admin::ABORT => self.finish(sock, q.cid, sc::SUCCESS, 1, None),
            admin::ASYNC_EVENT => {
                if self.held_events.len() > spec::AERL as usize {
                    // Asynchronous Event Request Limit Exceeded.
                    return self.finish(sock, q.cid, 0x105 | sc::DNR, 0, None);
                }
                // Held until an event (a namespace removed); dropped when the queue ends.
                self.held_events.push(q.cid);
                if !self.changed.is_empty() {
                    self.notice_namespaces(sock)?;
                }
                Some(Outcome::Continue)
            }
            _ => self.finish(sock, q.cid, sc::INVALID_OPCODE | sc::DNR, 0, None),
        }
    }

    /// Looks for namespaces whose sessions were closed since the last look; a host that asked
    /// for namespace attribute notices (Set Features 0Bh bit 8) gets one through a held
    /// Asynchronous Event Request, and rescans. Some(true): every namespace is gone (the
    /// controller ends); None: the connection failed.
    fn namespaces_gone(&mut self, sock: &mut Bounded, registry: &Registry) -> Option<bool> {
        for (i, a) in self.admitted.iter().enumerate() {
            if !self.gone[i] && registry.is_revoked(a.session) {
                self.gone[i] = true;
                let nsid = self.s.facts.namespaces[i].nsid;
                if !self.changed.contains(&nsid) {
                    self.changed.push(nsid);
                }
            }
        }
        if self.gone.iter().all(|g| *g) {
            return Some(true);
        }
        if !self.changed.is_empty() {
            self.notice_namespaces(sock)?;
        }
        Some(false)
    }

    /// Completes a held Asynchronous Event Request with a Namespace Attribute Changed notice
    /// (type 2h, information 00h, log page 04h: Base spec §5.2), if the host enabled such
    /// notices and one is held. Raised once until the host reads the log.
    fn notice_namespaces(&mut self, sock: &mut Bounded) -> Option<()> {
        if self.async_config & 1 << 8 == 0 || self.notice_sent {
            return Some(());
        }
        let Some(cid) = self.held_events.pop() else {
            return Some(());
        };
        self.notice_sent = true;
        let dw0 = 0x2 | 0x04 << 16;
        self.finish(sock, cid, sc::SUCCESS, dw0, None).map(|_| ())
    }

    /// The Changed Namespace List log page: the NSIDs removed since it was last read.
    fn changed_list(&self) -> Vec<u8> {
        let mut b = vec![0u8; spec::IDENTIFY_LEN];
        for (i, id) in self.changed.iter().take(1024).enumerate() {
            b[i * 4..i * 4 + 4].copy_from_slice(&id.to_le_bytes());
        }
        b
    }

    fn property_get(&self, attrib: u8, offset: u32) -> (u16, u64) {
        let eight = attrib & 7 == 1;
        let v = match (offset, eight) {
            (prop::CAP, true) => self.s.facts.cap(),
            (prop::VS, false) => spec::VERSION as u64,
            (prop::CC, false) => self.cc as u64,
            (prop::CSTS, false) => {
                let rdy = self.cc & 1;
                // Shutdown processing completes at once (SHST 10b).
                let shst = if (self.cc >> 14) & 3 != 0 { 2 << 2 } else { 0 };
                (rdy | shst) as u64
            }
            _ => return (sc::INVALID_FIELD | sc::DNR, 0),
        };
        (sc::SUCCESS, v)
    }

    fn property_set(&mut self, attrib: u8, offset: u32, v: u64) -> u16 {
        if offset != prop::CC || attrib & 7 != 0 {
            return sc::INVALID_FIELD | sc::DNR;
        }
        self.cc = v as u32;
        sc::SUCCESS
    }

    /// The discovery log: every subsystem this host may open, at every listener, and the
    /// discovery subsystem itself. Its generation counter is a hash of its entries, so a host
    /// that reads it in pieces sees the same number unless the log changed between them.
    fn discovery_log(&self, registry: &Registry, offset: u64, len: usize) -> Vec<u8> {
        let listeners = registry.nvme.listeners(self.s.local.ip());
        let host = self.s.auth_required.then_some(self.s.hostnqn.as_str());
        let exports = registry.open_to(host, &self.s.peer.addr);
        // Configured subsystems this host would be admitted to: on their host list, with
        // namespaces, every one an export it may open.
        let subsystems: Vec<String> = registry
            .nvme
            .subsystems()
            .into_iter()
            .filter(|s| {
                s.admits(&self.s.hostnqn)
                    && !s.namespaces.is_empty()
                    && s.namespaces
                        .iter()
                        .all(|(_, e)| exports.iter().any(|x| &x.name == e))
            })
            .map(|s| s.nqn)
            .collect();
        let mut entries = Vec::new();
        for &(port_id, addr) in &listeners {
            entries.push(DiscoveryEntry {
                subnqn: spec::DISCOVERY_NQN.into(),
                discovery: true,
                addr,
                port_id,
            });
            let own = exports
                .iter()
                .map(|e| format!("{}{}", spec::NQN_PREFIX, e.name));
            for subnqn in own.chain(subsystems.iter().cloned()) {
                entries.push(DiscoveryEntry {
                    subnqn,
                    discovery: false,
                    addr,
                    port_id,
                });
            }
        }
        spec::discovery_log(&entries, offset, len)
    }

    fn auth_send(&mut self, registry: &Registry, q: &nvme_tcp::Sqe, data: &[u8]) -> u16 {
        if self.auth.is_none() {
            match QueueAuth::new(registry, &self.s.hostnqn, &self.s.facts.subnqn) {
                Some(a) => self.auth = Some(a),
                None => return sc::AUTH_REQUIRED | sc::DNR,
            }
        }
        let auth = self.auth.as_mut().expect("just set");
        let st = auth.send(q, data);
        self.authenticated = auth.keeps(self.authenticated);
        st
    }

    fn auth_receive(&mut self, q: &nvme_tcp::Sqe) -> (u16, Option<Vec<u8>>) {
        let Some(auth) = self.auth.as_mut() else {
            return (sc::CMD_SEQ_ERROR | sc::DNR, None);
        };
        let r = auth.receive(q);
        self.authenticated = auth.keeps(self.authenticated);
        r
    }

    fn finish(
        &mut self,
        sock: &mut Bounded,
        cid: u16,
        status: u16,
        dw0: u32,
        data: Option<Vec<u8>>,
    ) -> Option<Outcome> {
        self.send(sock, cid, status, dw0 as u64, data)
    }

    /// Sends a completion, after the command's data (one C2HData) if it has any.
    fn send(
        &mut self,
        sock: &mut Bounded,
        cid: u16,
        status: u16,
        result: u64,
        data: Option<Vec<u8>>,
    ) -> Option<Outcome> {
        // Data longer than the host's SGL describes would land past its buffer: the command
        // fails as nvmet fails it (Data SGL Length Invalid), with no data.
        let too_long = data.as_ref().is_some_and(|d| d.len() > self.room as usize);
        let (status, data) = if too_long && status == sc::SUCCESS {
            (sc::SGL_INVALID_DATA | sc::DNR, None)
        } else {
            (status, data)
        };
        let c = Completion {
            cid,
            qid: 0,
            sq_head: self.sq_head,
            status,
            result,
        };
        c.send(sock, &self.s.link.tx, data.as_deref())?;
        Some(Outcome::Continue)
    }
}

enum Outcome {
    Continue,
    Kato(u32),
}

fn kato_of(ms: u32) -> Option<Duration> {
    // Rounded up to the granularity KAS advertises (100 ms).
    (ms > 0).then(|| Duration::from_millis((ms as u64).div_ceil(100) * 100))
}

/// When a controller whose host was last heard at `alive` must end, and why, if it must: past
/// its KATO (`kato`: the timer and the value asked for), past [`IDLE_KATO_MS`] while it has no
/// I/O queue (`io` false), whatever its KATO, and past `auth` (when it started, and how long it
/// has) while its host has not authenticated. The earliest of those.
fn expiry(
    alive: Instant,
    (kato, kato_ms): (Option<Duration>, u32),
    io: bool,
    auth: Option<(Instant, Duration)>,
) -> Option<(Instant, String)> {
    let auth = auth.map(|(started, d)| {
        let why = format!("no DH-HMAC-CHAP within {} s", d.as_secs_f32());
        (started + d, why)
    });
    let kato = kato.map(|k| (alive + k, format!("no keep-alive within {kato_ms} ms")));
    let idle = (!io).then(|| {
        let why = format!("no command within {IDLE_KATO_MS} ms and no I/O queue");
        (alive + Duration::from_millis(IDLE_KATO_MS as u64), why)
    });
    [auth, kato, idle]
        .into_iter()
        .flatten()
        .min_by_key(|(at, _)| *at)
}

/// `by`, or the moment the controller must end (`limit`) if that comes first.
fn within(by: Instant, limit: &Option<(Instant, String)>) -> Instant {
    limit.as_ref().map_or(by, |(at, _)| by.min(*at))
}

/// A read that gave up at its deadline: at the next call ([`Bounded`]), or in the call, when the
/// socket's timeout (set to the time left) ran out.
fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

/// Waits until `sock` has something to read (or was closed): false on timeout.
fn wait_readable(sock: &std::net::TcpStream, timeout: Duration) -> std::io::Result<bool> {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    match n {
        0 => Ok(false),
        n if n > 0 => Ok(true),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

/// The SMART / Health log (LID 02h): nothing to warn about; 100% spare above its 10% threshold.
fn smart_log() -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[1..3].copy_from_slice(&293u16.to_le_bytes()); // composite temperature, kelvin
    b[3] = 100; // available spare
    b[4] = 10; // threshold
    b
}

/// The Firmware Slot log (LID 03h): slot 1 active, holding this version.
fn firmware_log() -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = 1;
    let v = env!("CARGO_PKG_VERSION").as_bytes();
    let n = v.len().min(8);
    b[8..8 + n].copy_from_slice(&v[..n]);
    b[8 + n..16].fill(b' ');
    b
}

/// What the host's buffer for a command's data holds (its SGL's length; 0 for none): no
/// answer to the command may send more.
fn room(q: &nvme_tcp::Sqe) -> u32 {
    match q.sgl() {
        Sgl::TransportDataBlock { length, .. } | Sgl::DataBlock { length, .. } => length,
        _ => 0,
    }
}

/// One queue's DH-HMAC-CHAP exchange, controller side (`blkwire_auth::dhchap`): AUTH_Send
/// payloads in, AUTH_Receive payloads out (padded to the host's allocation length, as nvmet
/// sends them), every other command refused until it succeeds.
pub struct QueueAuth {
    inner: ControllerAuth,
    /// The host's key in the key store the exchange's secrets came from: the one its proof is
    /// checked with, which its sessions record.
    key: Key,
}

impl QueueAuth {
    /// The exchange for `hostnqn` on `subnqn`, with the secrets the key store has for that
    /// host (None: it has none, so it may not connect).
    pub fn new(registry: &Registry, hostnqn: &str, subnqn: &str) -> Option<QueueAuth> {
        let keys = registry.access.keys()?;
        let host = keys.host_secret(hostnqn)?;
        let ctrl = keys.ctrl_secret(hostnqn);
        Some(QueueAuth {
            inner: ControllerAuth::new(hostnqn, subnqn, host, ctrl),
            key: keys.get(hostnqn)?.clone(),
        })
    }

    /// AUTH_Send with its payload: completes with success whatever the message said (a
    /// failure is reported by the next AUTH_Receive), unless the command's fields are wrong.
    pub fn send(&mut self, q: &nvme_tcp::Sqe, data: &[u8]) -> u16 {
        if !auth_fields_ok(q, q.cdw11) || data.len() != q.cdw11 as usize {
            return sc::INVALID_FIELD | sc::DNR;
        }
        let _ = self.inner.on_send(data);
        sc::SUCCESS
    }

    /// AUTH_Receive: the next message, zero-padded to the allocation length.
    pub fn receive(&mut self, q: &nvme_tcp::Sqe) -> (u16, Option<Vec<u8>>) {
        let al = q.cdw11;
        if !auth_fields_ok(q, al) || al as usize > MAX_AUTH_LEN {
            return (sc::INVALID_FIELD | sc::DNR, None);
        }
        // The answer is `al` bytes: more than the host's buffer holds would land past it.
        // Refused before the message is taken, so the next AUTH_Receive still reads it.
        if al > room(q) {
            return (sc::SGL_INVALID_DATA | sc::DNR, None);
        }
        match self.inner.on_receive(al) {
            Ok(mut m) => {
                m.resize(al as usize, 0);
                (sc::SUCCESS, Some(m))
            }
            Err(_) => (sc::INVALID_FIELD | sc::DNR, None),
        }
    }

    /// The host proved its key (and, bidirectionally, heard ours).
    pub fn succeeded(&self) -> bool {
        self.inner.authenticated()
    }

    /// Whether a controller that was authenticated (`was`) still is after this exchange's
    /// last step: it is once it succeeds; a re-authentication under way keeps what the last
    /// one gave; one that failed (Failure1 waiting to be read, or read) takes it away, so a
    /// host whose new Reply did not check out cannot go on with its admin commands by never
    /// reading Failure1.
    pub fn keeps(&self, was: bool) -> bool {
        use blkwire_auth::dhchap::State;
        match self.inner.state() {
            State::Failure1 | State::Failed => false,
            _ => was || self.succeeded(),
        }
    }

    /// The host has proved its key in this exchange (its Reply checked out), whether or not
    /// it has read Success1 yet (or, bidirectionally, accepted ours): from here on its sessions
    /// may be admitted, and must be before Success1 tells it it is in.
    pub fn host_proved(&self) -> bool {
        self.inner.host_proved()
    }

    /// The host proved its key but its sessions cannot be admitted (rules, limits, the key
    /// store changed): the AUTH_Receive that would read Success1 reads AUTH_Failure1
    /// ("authentication failed") instead, and the exchange is over ([`QueueAuth::failed`]
    /// once it was read).
    pub fn refuse(&mut self) {
        self.inner.refuse(dhchap::Reason::Failed);
    }

    /// The exchange is over and succeeded: Success1 was read (and Success2 received, when the
    /// host asked the controller to prove itself too).
    pub fn done(&self) -> bool {
        self.inner.state() == dhchap::State::Succeeded
    }

    /// The exchange failed and the host was told: the queue ends.
    pub fn failed(&self) -> bool {
        self.inner.state() == dhchap::State::Failed
    }
}

/// The fields of an AUTH_Send or AUTH_Receive (SECP, SPSP0, SPSP1 in CDW10) and its length,
/// as the kernel's host sets them (`dhchap::check_command`).
fn auth_fields_ok(q: &nvme_tcp::Sqe, len: u32) -> bool {
    let b = q.cdw10.to_le_bytes();
    dhchap::check_command(b[3], b[1], b[2], len).is_ok()
}

/// Largest AUTH_Send or AUTH_Receive payload taken (the kernel uses 4096 at most).
const MAX_AUTH_LEN: usize = 8192;

/// DH-HMAC-CHAP on an I/O queue, on the handshake thread, right after its Connect answered
/// "authentication required": AUTH_Send / AUTH_Receive until it succeeds or fails; anything
/// else meanwhile is refused with Authentication Required. `admit` is called once, as soon as
/// the host has proved its key (its Reply's AUTH_Send answered), before the AUTH_Receive that
/// reads Success1: false (the queue cannot join its sessions) makes that AUTH_Receive read
/// AUTH_Failure1 instead. Some(true) once the exchange is over and the queue admitted;
/// Some(false) when it failed or was refused (the host was told); None when the connection
/// broke (after `admit`, whatever it admitted is the caller's to release).
pub fn authenticate_queue<S: Read + Write>(
    s: &mut S,
    link: &Link,
    qid: u16,
    mut auth: QueueAuth,
    sq_head: &mut u16,
    entries: u16,
    admit: &mut dyn FnMut() -> bool,
) -> Option<bool> {
    let mut buf = Vec::new();
    let mut admitted = false;
    loop {
        let n = match read_pdu(s, &mut buf, &link.rx).ok()? {
            Ok(n) => n,
            Err(e) => {
                terminate(s, &e, &buf, &link.tx);
                return None;
            }
        };
        let c = match nvme_tcp::decode(&buf[..n], &link.rx) {
            Ok(Pdu::CapsuleCmd(c)) => c,
            Ok(_) => return None,
            Err(e) => {
                terminate(s, &e, &buf[..n], &link.tx);
                return None;
            }
        };
        *sq_head = (*sq_head + 1) % entries.max(1);
        let q = c.sqe;
        let fct = q.nsid as u8;
        let (status, data) = if q.opcode != spec::FABRICS {
            (sc::AUTH_REQUIRED | sc::DNR, None)
        } else if fct == fctype::AUTH_SEND {
            match command_data(s, link, &c, MAX_AUTH_LEN)? {
                Ok(d) => (auth.send(&q, &d), None),
                Err(st) => (st, None),
            }
        } else if fct == fctype::AUTH_RECEIVE {
            auth.receive(&q)
        } else {
            (sc::AUTH_REQUIRED | sc::DNR, None)
        };
        let done = Completion {
            cid: q.cid,
            qid,
            sq_head: *sq_head,
            status,
            result: 0,
        };
        done.send(s, &link.tx, data.as_deref())?;
        if !admitted && auth.host_proved() {
            admitted = true;
            if !admit() {
                auth.refuse();
            }
        }
        if auth.done() {
            return Some(true);
        }
        if auth.failed() {
            return Some(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_controller_without_io_queues_ends_when_idle_whatever_its_kato() {
        let t = Instant::now();
        let idle = t + Duration::from_millis(IDLE_KATO_MS as u64);
        let at = |kato, io| expiry(t, kato, io, None).map(|(at, _)| at);
        let never = (kato_of(u32::MAX), u32::MAX);
        // KATO 0 (no timer) and the largest KATO both end at the idle limit without I/O queues.
        assert_eq!(at((None, 0), false), Some(idle));
        assert_eq!(at(never, false), Some(idle));
        // With I/O queues, the host's KATO rules: none, or days.
        assert_eq!(at((None, 0), true), None);
        assert!(at(never, true).is_some_and(|at| at > idle));
        // A short KATO ends it first, with I/O queues or without.
        let short = (kato_of(1000), 1000);
        assert_eq!(at(short, false), Some(t + Duration::from_secs(1)));
        assert_eq!(at(short, true), Some(t + Duration::from_secs(1)));
    }

    #[test]
    fn the_authentication_deadline_counts_from_the_start_whatever_the_host_sends() {
        let started = Instant::now();
        let alive = started + Duration::from_secs(5);
        let auth = Some((started, Duration::from_secs(10)));
        let (at, why) = expiry(alive, (None, 0), true, auth).unwrap();
        assert_eq!(at, started + Duration::from_secs(10));
        assert!(why.contains("DH-HMAC-CHAP"), "{why}");
        // A KATO that runs out first ends it first.
        let (at, why) = expiry(alive, (kato_of(1000), 1000), true, auth).unwrap();
        assert_eq!(at, alive + Duration::from_secs(1));
        assert!(why.contains("keep-alive"), "{why}");
    }

    #[test]
    fn a_pdu_must_be_whole_by_the_time_the_controller_ends() {
        let now = Instant::now();
        let by = now + PDU_TIMEOUT;
        assert_eq!(within(by, &None), by);
        let soon = Some((now + Duration::from_secs(1), String::new()));
        assert_eq!(within(by, &soon), now + Duration::from_secs(1));
        let late = Some((by + Duration::from_secs(1), String::new()));
        assert_eq!(within(by, &late), by);
    }
}
