#![deny(missing_docs)]
//! Adaptive busy polling.
//!
//! Sleeping and being woken costs tens of microseconds per hop on a VM; at queue depth 1 that is
//! most of an I/O's latency, so both ends spin briefly before they sleep. Spinning only pays when
//! the peer runs on another idle core: on a loaded machine the spinner steals the very CPU the
//! peer needs and latency gets far worse (measured: 20 us -> 165 us on 2 busy cores, see
//! docs/BENCHMARKS.md). So the budget adapts: a spin that ends with work found keeps (and
//! regrows) the budget; one that runs dry halves it, down to zero; with zero budget every 64th
//! wait probes again with a quarter budget, so spinning resumes when the machine quietens. And a
//! spinner offers its core to other runnable threads every 2 us, so when threads outnumber cores
//! the peer it waits for is not kept off the CPU by the wait itself.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Is any of `fds` readable now? The check a spinner makes on its sockets (a zero-timeout
/// poll(2); negative descriptors are ignored, as poll does).
pub fn readable<const N: usize>(fds: [RawFd; N]) -> bool {
    let mut p = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    // SAFETY: a zero-timeout poll on our own array of pollfds.
    unsafe { libc::poll(p.as_mut_ptr(), N as libc::nfds_t, 0) > 0 }
}

/// Below this a spin is not worth starting.
const MIN_NS: u64 = 2_000;
/// How often a spinner offers its core to other runnable threads.
const YIELD_EVERY: Duration = Duration::from_micros(2);
/// Waits skipped between probes once spinning has stopped paying.
const PROBE_EVERY: u32 = 64;

/// A waiter's spin budget, adapted to whether spinning finds work (see the crate docs).
#[derive(Debug, Clone, Default)]
pub struct AdaptiveSpin {
    max_ns: u64,
    cur_ns: u64,
    skipped: u32,
}

impl AdaptiveSpin {
    /// `max` is the longest single spin; zero disables spinning.
    pub fn new(max: Duration) -> AdaptiveSpin {
        let max_ns = max.as_nanos().min(u64::MAX as u128) as u64;
        AdaptiveSpin {
            max_ns,
            cur_ns: max_ns,
            skipped: 0,
        }
    }

    /// The current budget (for tests and diagnostics).
    pub fn budget(&self) -> Duration {
        Duration::from_nanos(self.cur_ns)
    }

    /// Spins until `ready()` is true or the budget runs out; returns what `ready()` last said.
    /// Every `YIELD_EVERY` of spinning it offers the core to other runnable threads: with more
    /// threads than cores (initiator and target on one host, two jobs on two cores) a spinner
    /// would otherwise hold the core its peer needs until the scheduler preempts it (measured:
    /// 4k QD32 over eth:// with two jobs, 216k -> 397k IOPS; see docs/BENCHMARKS.md).
    pub fn spin(&mut self, ready: impl FnMut() -> bool) -> bool {
        self.spin_yielding(ready, std::thread::yield_now)
    }

    fn spin_yielding(
        &mut self,
        mut ready: impl FnMut() -> bool,
        mut give_way: impl FnMut(),
    ) -> bool {
        if self.max_ns == 0 {
            return ready();
        }
        if self.cur_ns == 0 {
            self.skipped += 1;
            if self.skipped < PROBE_EVERY {
                return ready();
            }
            self.skipped = 0;
            self.cur_ns = (self.max_ns / 4).max(MIN_NS);
        }
        let start = Instant::now();
        let limit = Duration::from_nanos(self.cur_ns);
        let mut next_yield = YIELD_EVERY;
        loop {
            if ready() {
                self.cur_ns = (self.cur_ns * 2).min(self.max_ns);
                return true;
            }
            let spun = start.elapsed();
            if spun >= next_yield {
                // Give the core to a thread waiting for it, if any (it may be the very peer we
                // are waiting for); with none, this returns at once.
                give_way();
                next_yield = spun + YIELD_EVERY;
            }
            if spun >= limit {
                self.cur_ns /= 2;
                if self.cur_ns < MIN_NS {
                    self.cur_ns = 0;
                }
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dry_spins_shrink_the_budget_to_zero_and_probes_restore_it() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(64));
        let mut dry = 0;
        while s.budget() > Duration::ZERO {
            assert!(!s.spin(|| false));
            dry += 1;
            assert!(dry < 10, "budget must collapse after a few dry spins");
        }
        // With no budget, waits do not spin: `ready` is asked exactly once.
        let mut asked = 0;
        s.spin(|| {
            asked += 1;
            false
        });
        assert_eq!(asked, 1);
        // A probe that finds work brings the budget back.
        for _ in 0..PROBE_EVERY {
            s.spin(|| true);
        }
        assert!(s.budget() > Duration::ZERO);
        for _ in 0..8 {
            s.spin(|| true);
        }
        assert_eq!(s.budget(), Duration::from_micros(64));
    }

    #[test]
    fn a_long_spin_offers_the_core_a_quick_one_does_not() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(64));
        let mut offers = 0;
        // A dry spin lasts its whole budget (64 us), well past the first offer at 2 us.
        assert!(!s.spin_yielding(|| false, || offers += 1));
        assert!(offers >= 1, "a 64 us spin never offered the core");
        let mut offers = 0;
        assert!(s.spin_yielding(|| true, || offers += 1));
        assert_eq!(offers, 0, "found work at once, offered nothing");
    }

    #[test]
    fn zero_max_never_spins() {
        let mut s = AdaptiveSpin::new(Duration::ZERO);
        let mut asked = 0;
        assert!(!s.spin(|| {
            asked += 1;
            false
        }));
        assert_eq!(asked, 1);
    }

    #[test]
    fn successful_spin_returns_true_once_ready() {
        // A budget no stall of a loaded machine eats up before the 100th look.
        let mut s = AdaptiveSpin::new(Duration::from_secs(5));
        let mut n = 0;
        assert!(s.spin(|| {
            n += 1;
            n == 100
        }));
        assert_eq!(n, 100);
    }
}
