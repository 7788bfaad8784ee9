//! One look at every counter of the target, for STATS (JSON, PROTOCOL.md §11) and the metrics
//! endpoint (Prometheus text): the reactors are asked by message for their queues (they own
//! them, so nothing on the data path is shared or locked), the registry for its sessions, the
//! budget and the access policy for theirs.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Sender};
use std::time::Duration;

use crate::dgram::PortReport;
use crate::reactor::{Msg, QueueReport};
use crate::session::{Registry, SessionInfo};
use crate::stats::{ClosedTotals, QueueStats};

/// How long the reactors have, together, to answer; one busy for longer is left out of this snapshot.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Snapshot {
    /// Live sessions, by id.
    pub sessions: Vec<SessionInfo>,
    /// Live queues, by session and queue.
    pub queues: Vec<QueueReport>,
    /// Datagram sockets.
    pub ports: Vec<PortReport>,
    /// Counters of the queues that closed, per export (summed over the reactors).
    pub closed: ClosedTotals,
    /// Every export served, in order: its name and identity (`reactor::export_id`).
    pub exports: Vec<(String, usize)>,
    /// Every reactor answered in time: the counters are all there (`metrics::Monotonic`).
    pub complete: bool,
    /// HELLOs answered with a challenge (PROTOCOL.md §12.1).
    pub challenges: u64,
    /// Handshakes refused for authentication or access rules.
    pub refused: u64,
    /// The memory budget (`--max-memory`) and what it has given out, in bytes.
    pub memory_limit: usize,
    pub memory_used: usize,
}

impl Snapshot {
    /// Asks every reactor (`workers`: its inbox and wake eventfd) for its counters and reads
    /// the registry's.
    pub fn gather(registry: &Registry, workers: &[(Sender<Msg>, RawFd)]) -> Snapshot {
        // Taken (and held) before the reactors report: an export's identity is its address,
        // which one added during the scrape could otherwise have had freed for it by an export
        // whose last queue closed after reporting.
        let served = registry.exports();
        let (tx, rx) = mpsc::channel();
        let mut asked = 0;
        for (w, wake) in workers {
            if w.send(Msg::Stats(tx.clone())).is_ok() {
                crate::eventfd_write(*wake);
                asked += 1;
            }
        }
        drop(tx);
        let (mut queues, mut ports, mut closed) = (Vec::new(), Vec::new(), ClosedTotals::default());
        let mut answered = 0;
        // One deadline for all the answers, not one each: reactors each answering just inside
        // the timeout, one after another, would hold a scrape or STATS for N times it.
        let deadline = std::time::Instant::now() + ANSWER_TIMEOUT;
        for _ in 0..asked {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(mut r) => {
                    queues.append(&mut r.queues);
                    ports.append(&mut r.ports);
                    closed.merge(&r.closed);
                    answered += 1;
                }
                Err(_) => break,
            }
        }
        queues.sort_by_key(|q| (q.session, q.queue));
        let budget = registry.budget();
        Snapshot {
            sessions: registry.sessions(),
            queues,
            ports,
            closed,
            exports: served
                .iter()
                .map(|e| (e.name.clone(), crate::reactor::export_id(e)))
                .collect(),
            complete: answered == workers.len(),
            challenges: registry.access.challenges.load(Ordering::Relaxed),
            refused: registry.access.refused.load(Ordering::Relaxed),
            memory_limit: budget.limit(),
            memory_used: budget.used(),
        }
    }

    /// The counters of every queue that has closed since the target started.
    pub fn closed_total(&self) -> QueueStats {
        self.closed.total()
    }

    /// The live queues of one session.
    pub fn queues_of(&self, session: u32) -> impl Iterator<Item = &QueueReport> {
        self.queues.iter().filter(move |q| q.session == session)
    }
}
