//! Sessions: HELLO grants, JOIN checks, and the per-session summary. Only the control path
//! (connect, join, disconnect) takes this lock; the data path never touches it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use blkwire_backend::Export;
use blkwire_wire::{ExportEntry, Features, Hello, HelloReply, Status};

use crate::log::Level;
use crate::stats::QueueStats;

/// Most fragments one datagram message may have (PROTOCOL.md §9.3).
pub const MAX_FRAGMENTS: u32 = 256;

/// Limits the target grants at most, whatever a client asks for.
#[derive(Clone, Copy, Debug)]
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
        }
    }
}

struct Session {
    export: Arc<Export>,
    /// Payload per fragment (datagram sessions; max I/O on TCP).
    frame_payload: u32,
    host: String,
    peer: String,
    depth: u16,
    max_io: u32,
    cookie: u64,
    joined: Vec<bool>,
    live: u16,
    stats: QueueStats,
}

/// What a queue connection gets once admitted.
pub struct Admitted {
    pub export: Arc<Export>,
    pub session: u32,
    pub queue: u16,
    pub depth: u16,
    pub max_io: u32,
}

pub struct Registry {
    exports: Vec<Arc<Export>>,
    limits: Limits,
    inner: Mutex<Inner>,
}

struct Inner {
    sessions: HashMap<u32, Session>,
    /// Counters of every queue that has closed since start.
    closed: QueueStats,
    next_id: u32,
    shut: bool,
}

impl Registry {
    pub fn new(exports: Vec<Arc<Export>>, limits: Limits) -> Registry {
        Registry {
            exports,
            limits,
            inner: Mutex::new(Inner {
                sessions: HashMap::new(),
                closed: QueueStats::default(),
                next_id: 1,
                shut: false,
            }),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn exports(&self) -> &[Arc<Export>] {
        &self.exports
    }

    /// Feature bits an export advertises (PROTOCOL.md §7): what it does natively or by emulation.
    pub fn features(e: &Export) -> Features {
        crate::advertise::Advertised::of(e).native()
    }

    pub fn list(&self) -> Vec<ExportEntry> {
        self.exports
            .iter()
            .map(|e| ExportEntry {
                name: e.name.clone(),
                size: e.size(),
                features: Self::features(e),
            })
            .collect()
    }

    /// Stops admitting sessions (shutdown).
    pub fn close(&self) {
        self.lock().shut = true;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the map inconsistent, so carry on.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a HELLO. `link_payload` is the target's own largest frame payload on a datagram
    /// link, `None` on TCP.
    pub fn hello(
        &self,
        h: &Hello,
        peer: &str,
        link_payload: Option<u32>,
    ) -> Result<(HelloReply, Admitted), Status> {
        let export = self
            .exports
            .iter()
            .find(|e| e.name == h.export)
            .cloned()
            .ok_or(Status::NoExport)?;
        if !h.auth.is_empty() {
            return Err(Status::Access);
        }
        let (logical, physical) = export.backend().block_sizes();
        let queues = h.queues.min(self.limits.max_queues);
        let depth = h.depth.min(self.limits.max_depth);
        let mut max_io = (h.max_io.min(self.limits.max_io) / logical * logical).max(logical);
        let frame_payload = match link_payload {
            // TCP: nothing is fragmented.
            None => max_io,
            // Datagrams: what both ends' links carry, in 8-byte units. Not capped at max_io:
            // it is also the datagram size both ends pack frames into (PROTOCOL.md §9.6).
            Some(link) => (h.frame_payload.min(link) / 8 * 8).max(512),
        };
        if link_payload.is_some() {
            // A message of more than MAX_FRAGMENTS frames is a burst that overflows a receiver's
            // backlog (1000 packets by default on Linux) before it can drain: split I/O earlier.
            max_io = max_io.min(frame_payload * MAX_FRAGMENTS) / logical * logical;
        }
        let (id, cookie) = self.create(
            &export,
            &h.host_id,
            peer,
            queues,
            depth,
            max_io,
            frame_payload,
        )?;
        let reply = HelloReply {
            size: export.size(),
            logical_block: logical,
            physical_block: physical,
            features: Self::features(&export),
            queues,
            depth,
            max_io,
            session: id,
            cookie,
            frame_payload,
        };
        Ok((
            reply,
            Admitted {
                export,
                session: id,
                queue: 0,
                depth,
                max_io,
            },
        ))
    }

    /// Registers a session whose first queue is connected; returns its id and cookie.
    #[allow(clippy::too_many_arguments)]
    fn create(
        &self,
        export: &Arc<Export>,
        host: &str,
        peer: &str,
        queues: u16,
        depth: u16,
        max_io: u32,
        frame_payload: u32,
    ) -> Result<(u32, u64), Status> {
        let cookie = random_u64();
        let mut inner = self.lock();
        if inner.shut {
            return Err(Status::Shutdown);
        }
        if inner.sessions.len() >= self.limits.max_sessions {
            return Err(Status::NoMemory);
        }
        let id = inner.next_id;
        inner.next_id = inner.next_id.wrapping_add(1).max(1);
        let mut joined = vec![false; queues as usize];
        joined[0] = true;
        inner.sessions.insert(
            id,
            Session {
                export: export.clone(),
                frame_payload,
                host: host.to_string(),
                peer: peer.to_string(),
                depth,
                max_io,
                cookie,
                joined,
                live: 1,
                stats: QueueStats::default(),
            },
        );
        crate::log!(
            Level::Info,
            "session {id}: host '{}' from {peer} opened export '{}' ({queues} queues x {depth} deep, max I/O {})",
            host.escape_debug(),
            export.name,
            blkwire_backend::format_size(max_io as u64)
        );
        Ok((id, cookie))
    }

    /// A one-connection session for frontends without queue joining (NBD: every connection
    /// stands alone).
    pub fn admit_single(
        &self,
        export: &Arc<Export>,
        host: &str,
        peer: &str,
        depth: u16,
        max_io: u32,
    ) -> Result<Admitted, Status> {
        let (session, _) = self.create(export, host, peer, 1, depth, max_io, max_io)?;
        Ok(Admitted {
            export: export.clone(),
            session,
            queue: 0,
            depth,
            max_io,
        })
    }

    /// The fragment payload a session negotiated.
    pub fn frame_payload(&self, session: u32) -> Option<u32> {
        self.lock().sessions.get(&session).map(|s| s.frame_payload)
    }

    pub fn join(&self, session: u32, queue: u16, cookie: u64) -> Result<Admitted, Status> {
        let mut inner = self.lock();
        if inner.shut {
            return Err(Status::Shutdown);
        }
        let s = inner.sessions.get_mut(&session).ok_or(Status::Access)?;
        if s.cookie != cookie {
            return Err(Status::Access);
        }
        let slot = s.joined.get_mut(queue as usize).ok_or(Status::Invalid)?;
        if *slot {
            return Err(Status::Busy);
        }
        *slot = true;
        s.live += 1;
        Ok(Admitted {
            export: s.export.clone(),
            session,
            queue,
            depth: s.depth,
            max_io: s.max_io,
        })
    }

    /// A queue closed; the session ends with its last queue.
    pub fn leave(&self, session: u32, _queue: u16, stats: &QueueStats) {
        let mut inner = self.lock();
        inner.closed.add(stats);
        let Some(s) = inner.sessions.get_mut(&session) else {
            return;
        };
        s.stats.add(stats);
        s.live = s.live.saturating_sub(1);
        if s.live == 0 {
            let s = inner.sessions.remove(&session).expect("present");
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
        }
    }

    /// One JSON object per live session (without its queues).
    pub fn describe_sessions(&self) -> Vec<serde_json::Value> {
        let inner = self.lock();
        let mut v: Vec<_> = inner
            .sessions
            .iter()
            .map(|(id, s)| {
                serde_json::json!({"session": id, "export": s.export.name, "host": s.host, "peer": s.peer})
            })
            .collect();
        v.sort_by_key(|s| s["session"].as_u64());
        v
    }

    pub fn closed_totals(&self) -> QueueStats {
        self.lock().closed
    }
}

pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    if n != 8 {
        // Fall back to time and address entropy; the cookie only has to be unguessable enough to
        // stop a confused client from joining the wrong session.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return t.as_nanos() as u64 ^ (&b as *const _ as u64).rotate_left(32);
    }
    u64::from_le_bytes(b)
}
