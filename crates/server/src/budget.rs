//! The memory budget (`serve --max-memory`): what connection and session buffers may hold in
//! total (receive and transmit buffers, data buffers of requests in flight, spare pool buffers,
//! datagram slot buffers), and what is set aside for other memory a peer can make the target
//! hold ([`Reservation`]: an iSCSI connection's parameter list).
//!
//! A [`Budget`] is a counter with a limit; a session's budget is a child of the target's, so a
//! charge must fit both (the per-session share). An [`Account`] is what one connection (or
//! datagram port) holds of a budget; it is owned by the reactor thread that owns the connection
//! and is charged or credited only when buffers grow or shrink (admission, buffer growth, an
//! idle connection giving its buffers back), never per I/O: in steady state a connection's
//! buffers keep their size and the shared counter is not touched.
//!
//! Growth that can wait asks first ([`Account::try_cover`]): when the budget (or the
//! connection's share) is used up, the connection stops taking requests and reading until
//! memory comes back. Growth that cannot wait (a reply to a request already running) is
//! charged after the fact ([`Account::settle`]); the gates before it make that small.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Accounts are charged in steps of this many bytes, and give back only whole steps beyond
/// what they use, so buffers that move by a few bytes do not touch the shared counter.
pub const GRAIN: usize = 256 << 10;

/// A limit on bytes held, shared by the accounts charged to it.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
    /// A session's budget charges the target's too.
    parent: Option<Arc<Budget>>,
}

impl Budget {
    /// The target's budget.
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
            parent: None,
        })
    }

    /// A share of `parent` that may hold at most `limit` bytes of it.
    pub fn child(parent: &Arc<Budget>, limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
            parent: Some(parent.clone()),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges `n` bytes if they fit here and in every parent; nothing is charged otherwise.
    /// Growth (`growth`) may use only three quarters of the target's budget: the last quarter
    /// is kept for the minimum of new sessions, so connections that grew to their share
    /// (hostile ones included) cannot make every newcomer NO_MEMORY.
    fn try_charge(&self, n: usize, growth: bool) -> bool {
        let limit = if growth && self.parent.is_none() {
            self.limit - self.limit / 4
        } else {
            self.limit
        };
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            if cur.saturating_add(n) > limit {
                return false;
            }
            match self.used.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        if let Some(p) = &self.parent {
            if !p.try_charge(n, growth) {
                self.used.fetch_sub(n, Ordering::Relaxed);
                return false;
            }
        }
        true
    }

    /// Charges `n` bytes already allocated (they may take the count past the limit; the gates
    /// keep that small, and new growth waits until the count is back under).
    pub fn force_charge(&self, n: usize) {
        self.used.fetch_add(n, Ordering::Relaxed);
        if let Some(p) = &self.parent {
            p.force_charge(n);
        }
    }

    pub fn release(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::Relaxed);
        if let Some(p) = &self.parent {
            p.release(n);
        }
    }
}

/// Bytes set aside in a budget for as long as the holder lives, for memory that is not a
/// connection buffer and must never wait for room once its owner exists (an iSCSI connection's
/// parameter list: [`crate::frontend::iscsi`]). Given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    /// Charged for as long as the reservation lives; given back when it drops.
    _held: Account,
}

impl Reservation {
    /// Sets `bytes` aside in `budget`; `None` when it cannot spare them.
    pub fn new(budget: &Arc<Budget>, bytes: usize) -> Option<Reservation> {
        Account::reserve(budget, bytes, bytes).map(|a| Reservation { _held: a })
    }

    /// A reservation in a budget of its own, limited by nothing: for a frontend built where
    /// no target's budget applies (unit tests, fuzzing).
    pub fn detached(bytes: usize) -> Reservation {
        Reservation {
            _held: Account::forced(&Budget::new(usize::MAX), bytes, bytes),
        }
    }
}

/// What one connection or port holds of a budget: at least `floor` (reserved when it was
/// admitted, so it can always serve one request at a time), at most `cap` (its share).
#[derive(Debug)]
pub struct Account {
    budget: Arc<Budget>,
    charged: usize,
    floor: usize,
    cap: usize,
}

impl Account {
    /// Reserves `floor` bytes for a new connection; `None` when the budget cannot spare them
    /// (the connection is refused with NO_MEMORY).
    pub fn reserve(budget: &Arc<Budget>, floor: usize, cap: usize) -> Option<Account> {
        budget.try_charge(floor, false).then(|| Account {
            budget: budget.clone(),
            charged: floor,
            floor,
            cap: cap.max(floor),
        })
    }

    /// An account for buffers that exist whatever the load (a datagram port's receive
    /// buffers): `floor` is charged even past the limit.
    pub fn forced(budget: &Arc<Budget>, floor: usize, cap: usize) -> Account {
        budget.force_charge(floor);
        Account {
            budget: budget.clone(),
            charged: floor,
            floor,
            cap: cap.max(floor),
        }
    }

    /// Bytes charged.
    #[cfg(test)]
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// Whether it holds more than its floor (something an idle owner could give back).
    pub fn above_floor(&self) -> bool {
        self.charged > self.floor
    }

    /// The most this account may hold.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Makes sure `want` bytes are charged, charging more (in whole grains) if needed; false
    /// when they do not fit this account's share or the budget: the caller waits instead of
    /// growing.
    pub fn try_cover(&mut self, want: usize) -> bool {
        if want <= self.charged {
            return true;
        }
        if want > self.cap {
            return false;
        }
        let more = (want - self.charged).next_multiple_of(GRAIN);
        let more = more.min(self.cap - self.charged).max(want - self.charged);
        if self.budget.try_charge(more, true) {
            self.charged += more;
            true
        } else {
            false
        }
    }

    /// The buffers now hold `have` bytes: charges what exceeds the charge (growth that could
    /// not wait), and gives back what is unused when that is at least half the charge and two
    /// grains (never below the floor): a busy connection whose buffers breathe with the
    /// requests in flight keeps its charge instead of touching the shared counter each time;
    /// an idle one that gave its buffers back (`trim`) returns the memory.
    pub fn settle(&mut self, have: usize) {
        if have > self.charged {
            let more = have - self.charged;
            self.budget.force_charge(more);
            self.charged = have;
            return;
        }
        let keep = have.max(self.floor).next_multiple_of(GRAIN).max(self.floor);
        if self.charged >= keep + (2 * GRAIN).max(self.charged / 2) {
            self.budget.release(self.charged - keep);
            self.charged = keep;
        }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        self.budget.release(self.charged);
    }
}

/// Returns what the allocator holds in free chunks to the system. Freed buffers stay in glibc's
/// heap otherwise: the budget got them back, the process did not (157 MiB after a hostile load
/// whose buffers were all freed). Fixing glibc's mmap threshold at 128 KiB did that too, but it
/// made every large allocation of every library in the process a fresh mapping: librbd's 1 MiB
/// read buffers page-faulted and were zeroed on each read (1 MiB rbd reads at 0.6x of librbd
/// driven directly). Called by reactors after a connection closed or an idle trim, and under
/// churn at most ten times a second, when the budget shrank.
pub fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists, under its locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_stay_within_their_share_and_the_budget() {
        let target = Budget::new(8 << 20);
        let session = Budget::child(&target, 6 << 20);
        let mut a = Account::reserve(&session, 1 << 20, 4 << 20).unwrap();
        assert!(a.try_cover(3 << 20));
        assert!(!a.try_cover(5 << 20), "past the connection's share");
        let mut b = Account::reserve(&session, 1 << 20, 4 << 20).unwrap();
        assert!(b.try_cover(2 << 20));
        assert!(
            !b.try_cover(4 << 20),
            "past the session's share: {} + {}",
            a.charged(),
            b.charged()
        );
        assert!(Account::reserve(&target, 4 << 20, 4 << 20).is_none());
        let mut late = Account::reserve(&target, 1 << 20, 4 << 20).unwrap();
        assert!(
            !late.try_cover(2 << 20),
            "growth stops at three quarters of the budget: {} used",
            target.used()
        );
        drop(late);
        let c = Account::reserve(&target, 2 << 20, 2 << 20).unwrap();
        assert_eq!(target.used(), 7 << 20);
        assert!(
            Account::reserve(&target, 2 << 20, 2 << 20).is_none(),
            "full"
        );
        // Idle: back to the floor, which a new connection can then take.
        a.settle(0);
        assert_eq!(a.charged(), 1 << 20);
        assert!(Account::reserve(&target, 2 << 20, 2 << 20).is_some());
        drop((a, b, c));
        assert_eq!((target.used(), session.used()), (0, 0));
    }

    #[test]
    fn settling_charges_what_grew_and_keeps_small_changes() {
        let target = Budget::new(4 << 20);
        let mut a = Account::reserve(&target, GRAIN, 8 << 20).unwrap();
        a.settle(5 << 20);
        assert_eq!(
            target.used(),
            5 << 20,
            "growth that could not wait is charged"
        );
        assert!(!a.try_cover(6 << 20), "nothing more while over the limit");
        a.settle((5 << 20) - 1000);
        assert_eq!(a.charged(), 5 << 20, "a few bytes less gives nothing back");
        a.settle(1 << 20);
        assert_eq!(a.charged(), 1 << 20);
        assert_eq!(target.used(), 1 << 20);
    }
}
