//! Persistent reservations (SPC-4 persistent reservations) shared by every I_T nexus of an
//! export, whichever reactor serves it: one authoritative [`Reservations`] per export under a
//! mutex that only PERSISTENT RESERVE IN/OUT and EXTENDED COPY (for its sources) take (rare
//! commands), and, on the data path,
//! an [`Access`] per connection, worked out from an immutable
//! snapshot the reactors hand every connection by message ([`Update`]; docs/ARCHITECTURE.md,
//! "Persistent reservations across reactors").
//!
//! The order that makes a new reservation binding: a PERSISTENT RESERVE OUT that changed what
//! the conflict check sees bumps the export's version and its reactor sends the snapshot to
//! every other reactor (`crate::reactor::Msg::Reservations`); each installs it in its
//! connections before it acknowledges, and the command's GOOD goes out only once all have. A
//! command that arrives after that GOOD is therefore checked against the new state on every
//! reactor. A connection that joins a reactor reads the current state then
//! ([`crate::frontend::StreamFrontend::attached`]): a change committed after that read reaches
//! the reactor's inbox after the connection did, and versions drop an older snapshot that
//! arrives after a newer read.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use blkwire_backend::Export;
use blkwire_wire::scsi::pr::{Access, Nexus, Outcome, Reservations};
use blkwire_wire::scsi::Sense;

use crate::reactor::Msg;

/// A change of one export's reservation state, as every connection installs it.
#[derive(Debug)]
pub struct Update {
    /// The export's [`Lu::id`].
    pub lu: u64,
    /// Bumped by every change (newer wins: snapshots may arrive out of order).
    pub version: u64,
    /// The state the conflict check works from; `None` while nothing is reserved (then nothing
    /// conflicts, whatever is registered, and the data path pays nothing).
    pub snapshot: Option<Arc<Reservations>>,
}

/// Where a reactor acknowledges an [`Update`]: the connection waiting for it (its index and
/// incarnation on reactor `reactor`) and which of that connection's updates it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The index of the reactor that sent the update.
    pub reactor: usize,
    /// The connection's index on that reactor.
    pub conn: usize,
    /// The connection's incarnation (a later connection in the same place is not it).
    pub incarnation: u32,
    /// The connection's number for the update.
    pub seq: u32,
}

/// One export's reservation state (SCSI: its logical unit).
#[derive(Debug)]
pub struct Lu {
    id: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    pr: Reservations,
    version: u64,
}

impl Lu {
    /// A logical unit of its own, in no table (tests).
    pub fn detached() -> Arc<Lu> {
        Arc::new(Lu {
            id: u64::MAX,
            state: Mutex::default(),
        })
    }

    /// Its id (unique among the table's logical units while it lives).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state now, as an [`Update`] a connection installs when it joins its reactor.
    pub fn current(&self) -> Update {
        let st = self.lock();
        Update {
            lu: self.id,
            version: st.version,
            snapshot: st.pr.reserved().then(|| Arc::new(st.pr.clone())),
        }
    }

    /// What `who` may do under the state now, read under the lock: for an export a command
    /// reaches besides the LU it was sent to (an EXTENDED COPY's source), of which the
    /// connection holds no snapshot. A change committed before this read is seen, whether or
    /// not every reactor has installed it yet.
    pub fn access(&self, who: &Nexus) -> Access {
        self.lock().pr.access(who)
    }

    /// PERSISTENT RESERVE IN (SPC-4): the parameter data, at most `alloc_len` bytes.
    pub fn reserve_in(&self, sa: u8, alloc_len: u32) -> Result<Vec<u8>, Sense> {
        self.lock().pr.reserve_in(sa, alloc_len)
    }

    /// PERSISTENT RESERVE OUT (SPC-4) from `who`. `Ok(Some(update))`: the command changed what
    /// the conflict check sees (a reservation was or is now in place), and it may complete only
    /// once every reactor installed `update`; `Ok(None)`: nothing the data path sees changed
    /// (registrations while nothing is reserved), it completes at once.
    pub fn reserve_out(
        &self,
        who: &Nexus,
        sa: u8,
        scope: u8,
        kind: u8,
        params: &[u8],
    ) -> Result<Option<Arc<Update>>, Outcome> {
        let mut st = self.lock();
        let before = st.pr.reserved();
        st.pr.reserve_out(who, sa, scope, kind, params)?;
        if !before && !st.pr.reserved() {
            return Ok(None);
        }
        st.version += 1;
        Ok(Some(Arc::new(Update {
            lu: self.id,
            version: st.version,
            snapshot: st.pr.reserved().then(|| Arc::new(st.pr.clone())),
        })))
    }
}

/// Every export's reservation state, and the way to every reactor. Only PERSISTENT RESERVE
/// IN/OUT, logins and connections joining a reactor take its locks.
#[derive(Default)]
pub struct Table {
    lus: Mutex<Lus>,
    reactors: OnceLock<Vec<(Sender<Msg>, OwnedFd)>>,
    /// Reactors that stopped taking updates (their index): `broadcast` skips them. Under a
    /// lock with the sends, so an update is either sent before a reactor's last look at its
    /// inbox (and acknowledged there) or not sent to it at all.
    exited: Mutex<Vec<usize>>,
}

#[derive(Default)]
struct Lus {
    /// By export: the weak reference keeps the export's address from being reused while the
    /// entry lives, and an entry whose export is gone is dropped (its state with it: a new
    /// export of the same name is a new logical unit).
    list: Vec<(Weak<Export>, Arc<Lu>)>,
    next_id: u64,
}

impl Table {
    /// The reactors (their channels and wake-up eventfds, copies of their own), once all are
    /// running; later calls are ignored.
    pub(crate) fn set_reactors(&self, reactors: Vec<(Sender<Msg>, OwnedFd)>) {
        let _ = self.reactors.set(reactors);
    }

    /// The reservation state of `export`, created empty the first time.
    pub fn lu(&self, export: &Arc<Export>) -> Arc<Lu> {
        let mut lus = self.lus(std::slice::from_ref(export));
        lus.pop().expect("one per export")
    }

    /// [`Table::lu`] of each of `exports`, in their order, under one lock and with one look
    /// through the table: an iSCSI login asks for every export its initiator may open.
    pub fn lus(&self, exports: &[Arc<Export>]) -> Vec<Arc<Lu>> {
        let mut t = self.lus.lock().unwrap_or_else(|p| p.into_inner());
        t.list.retain(|(e, _)| e.strong_count() > 0);
        let mut known: HashMap<*const Export, Arc<Lu>> = t
            .list
            .iter()
            .map(|(e, lu)| (e.as_ptr(), lu.clone()))
            .collect();
        exports
            .iter()
            .map(|export| {
                let at = Arc::as_ptr(export);
                if let Some(lu) = known.get(&at) {
                    return lu.clone();
                }
                let id = t.next_id;
                t.next_id += 1;
                let lu = Arc::new(Lu {
                    id,
                    state: Mutex::default(),
                });
                t.list.push((Arc::downgrade(export), lu.clone()));
                known.insert(at, lu.clone());
                lu
            })
            .collect()
    }

    /// Sends `update` to every reactor but `ack.reactor`, each to acknowledge to `ack`; returns
    /// how many were sent (a reactor that stopped taking updates, `exiting`, is not sent one).
    pub(crate) fn broadcast(&self, update: &Arc<Update>, ack: Ack) -> usize {
        let Some(reactors) = self.reactors.get() else {
            return 0;
        };
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent = 0;
        for (i, (tx, wake)) in reactors.iter().enumerate() {
            if i == ack.reactor || exited.contains(&i) {
                continue;
            }
            let m = Msg::Reservations {
                update: update.clone(),
                ack: Some(ack),
            };
            if tx.send(m).is_ok() {
                crate::eventfd_write(wake.as_raw_fd());
                sent += 1;
            }
        }
        sent
    }

    /// Reactor `reactor` takes no more updates: after this, nothing is sent to it, and what
    /// was sent before is in its inbox for its last look.
    pub(crate) fn exiting(&self, reactor: usize) {
        self.exited
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(reactor);
    }

    /// Tells the reactor waiting for `ack` that this one installed the update.
    pub(crate) fn acknowledge(&self, ack: Ack) {
        let Some((tx, wake)) = self.reactors.get().and_then(|r| r.get(ack.reactor)) else {
            return;
        };
        if tx.send(Msg::ReservationsAck(ack)).is_ok() {
            crate::eventfd_write(wake.as_raw_fd());
        }
    }
}

#[cfg(test)]
mod tests {
    use blkwire_backend::ExportSpec;
    use blkwire_wire::scsi::pr::{kind, out_parameters, sa_out};

    use super::*;

    fn export(name: &str) -> Arc<Export> {
        Arc::new(Export::open(&ExportSpec::parse(&format!("{name}=mem:1M")).unwrap()).unwrap())
    }

    fn nexus(n: u8) -> Nexus {
        Nexus {
            initiator: format!("iqn.2026-11.test:{n},i,0x000000000001"),
            target_port: 1,
        }
    }

    /// One state per export, the same for every lookup; a removed export's state goes with it.
    #[test]
    fn one_state_per_export() {
        let t = Table::default();
        let (a, b) = (export("a"), export("b"));
        let la = t.lu(&a);
        assert!(Arc::ptr_eq(&la, &t.lu(&a)));
        assert_ne!(la.id(), t.lu(&b).id());
        // Many at once (an iSCSI login's): the same states, in order, a new one made once.
        let c = export("c");
        let many = t.lus(&[a.clone(), c.clone(), b.clone(), c.clone()]);
        assert!(Arc::ptr_eq(&many[0], &la) && Arc::ptr_eq(&many[2], &t.lu(&b)));
        assert!(Arc::ptr_eq(&many[1], &many[3]) && Arc::ptr_eq(&many[1], &t.lu(&c)));
        drop((many, c));
        la.reserve_out(&nexus(1), sa_out::REGISTER, 0, 0, &out_parameters(0, 5))
            .unwrap();
        drop(a);
        let again = export("a");
        let fresh = t.lu(&again);
        assert_ne!(fresh.id(), la.id());
        assert_eq!(fresh.reserve_in(0, 100).unwrap(), [0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            t.lus.lock().unwrap().list.len(),
            2,
            "the dropped export's entry went"
        );
    }

    /// An update goes to every other reactor but those that stopped taking them (a reactor
    /// shutting down would never acknowledge it).
    #[test]
    fn updates_skip_reactors_that_stopped() {
        let t = Table::default();
        let mut inboxes = Vec::new();
        let mut reactors = Vec::new();
        for _ in 0..3 {
            let (tx, rx) = std::sync::mpsc::channel();
            reactors.push((tx, crate::eventfd().unwrap()));
            inboxes.push(rx);
        }
        t.set_reactors(reactors);
        let update = Arc::new(Update {
            lu: 1,
            version: 1,
            snapshot: None,
        });
        let ack = Ack {
            reactor: 0,
            conn: 0,
            incarnation: 1,
            seq: 0,
        };
        assert_eq!(t.broadcast(&update, ack), 2);
        t.exiting(2);
        assert_eq!(
            t.broadcast(&update, ack),
            1,
            "reactor 2 stopped taking updates"
        );
        assert_eq!(inboxes[1].try_iter().count(), 2);
        assert_eq!(
            inboxes[2].try_iter().count(),
            1,
            "only the one sent before it stopped"
        );
    }

    /// Registering while nothing is reserved changes nothing the data path sees: no update.
    /// Reserving and releasing do, each with a newer version; the snapshot is there only while
    /// something is reserved.
    #[test]
    fn updates_only_when_the_conflict_check_changes() {
        let lu = Lu::detached();
        let a = nexus(1);
        let reg = lu.reserve_out(&a, sa_out::REGISTER, 0, 0, &out_parameters(0, 7));
        assert!(matches!(reg, Ok(None)));
        let u = lu
            .reserve_out(
                &a,
                sa_out::RESERVE,
                0,
                kind::WRITE_EXCLUSIVE,
                &out_parameters(7, 0),
            )
            .unwrap()
            .expect("an update");
        assert_eq!(u.version, 1);
        assert!(u.snapshot.as_ref().is_some_and(|s| s.reserved()));
        assert_eq!(lu.current().version, 1);
        // A refused command changes nothing.
        assert!(lu
            .reserve_out(&nexus(2), sa_out::RESERVE, 0, 1, &out_parameters(9, 0))
            .is_err());
        let u = lu
            .reserve_out(
                &a,
                sa_out::RELEASE,
                0,
                kind::WRITE_EXCLUSIVE,
                &out_parameters(7, 0),
            )
            .unwrap()
            .expect("an update");
        assert_eq!((u.version, u.snapshot.is_none()), (2, true));
        assert!(lu.current().snapshot.is_none());
    }
}
