//! Per-queue counters. Each queue's counters are owned by the thread serving it (plain integers,
//! no atomics); they are reported when asked by message and, when the queue closes, added to
//! its thread's closed totals of the export.

use std::collections::HashSet;
use std::time::Duration;

use blkwire_backend::BlockOp;
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct QueueStats {
    pub frames_in: u64,
    pub frames_out: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub flushes: u64,
    pub trims: u64,
    pub write_zeroes: u64,
    /// COPYs started (PROTOCOL.md §13), and the bytes they copied inside the target.
    pub copies: u64,
    pub bytes_copied: u64,
    /// Replies with a non-OK status.
    pub errors: u64,
    /// Frames that broke the protocol (the queue is closed after one).
    pub protocol_errors: u64,
    /// Late or duplicate requests dropped: datagram transports, and iSCSI commands outside the
    /// CmdSN window or already taken (RFC 7143 §4.2.2.1); 0 on the other stream protocols.
    pub dropped_duplicates: u64,
    /// Left out of the STATS document, which must stay under 1 MiB (PROTOCOL.md §11); the
    /// metrics endpoint shows them.
    #[serde(skip)]
    pub latency: Latency,
}

impl QueueStats {
    pub fn add(&mut self, o: &QueueStats) {
        self.frames_in += o.frames_in;
        self.frames_out += o.frames_out;
        self.reads += o.reads;
        self.writes += o.writes;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.flushes += o.flushes;
        self.trims += o.trims;
        self.write_zeroes += o.write_zeroes;
        self.copies += o.copies;
        self.bytes_copied += o.bytes_copied;
        self.errors += o.errors;
        self.protocol_errors += o.protocol_errors;
        self.dropped_duplicates += o.dropped_duplicates;
        self.latency.add(&o.latency);
    }

    /// Requests of `op` started.
    pub fn started(&self, op: BlockOp) -> u64 {
        match op {
            BlockOp::Read => self.reads,
            BlockOp::Write => self.writes,
            BlockOp::Flush => self.flushes,
            BlockOp::Trim => self.trims,
            BlockOp::WriteZeroes => self.write_zeroes,
        }
    }
}

/// Every block operation, with its name in metrics (the `op` label).
pub const OPS: [(BlockOp, &str); 5] = [
    (BlockOp::Read, "read"),
    (BlockOp::Write, "write"),
    (BlockOp::Flush, "flush"),
    (BlockOp::Trim, "trim"),
    (BlockOp::WriteZeroes, "write_zeroes"),
];

/// How long requests took, per operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    by_op: [Histogram; OPS.len()],
}

impl Latency {
    /// Counts one finished request of `op` that took `took`.
    pub fn record(&mut self, op: BlockOp, took: Duration) {
        self.by_op[Self::index(op)].record(took);
    }

    pub fn of(&self, op: BlockOp) -> &Histogram {
        &self.by_op[Self::index(op)]
    }

    fn index(op: BlockOp) -> usize {
        match op {
            BlockOp::Read => 0,
            BlockOp::Write => 1,
            BlockOp::Flush => 2,
            BlockOp::Trim => 3,
            BlockOp::WriteZeroes => 4,
        }
    }

    fn add(&mut self, o: &Latency) {
        for (h, o) in self.by_op.iter_mut().zip(&o.by_op) {
            h.add(o);
        }
    }
}

/// Finite buckets of a [`Histogram`]: upper bounds 1 us, 2 us, 4 us ... 2^23 us (8.4 s).
pub const BUCKETS: usize = 24;

/// A latency histogram with fixed powers-of-two buckets: recording is a division, a count of
/// leading zeros and two additions, with no allocation (it lives inside [`QueueStats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Histogram {
    /// `counts[i]` for `i < BUCKETS`: requests that took more than bucket `i - 1`'s bound and
    /// at most bucket `i`'s; `counts[BUCKETS]`: slower than the last bound.
    counts: [u64; BUCKETS + 1],
    sum_ns: u64,
}

impl Histogram {
    /// Bucket `i`'s upper bound (inclusive), in nanoseconds: 1 us x 2^i.
    pub fn bound_ns(i: usize) -> u64 {
        1000 << i
    }

    pub fn record(&mut self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose bound 1000 x 2^i is >= ns: ns <= 1000 x 2^i exactly when
        // ceil(ns / 1000) <= 2^i, as 2^i is whole.
        let us = ns.div_ceil(1000);
        let i = if us <= 1 {
            0
        } else {
            (u64::BITS - (us - 1).leading_zeros()) as usize
        };
        self.counts[i.min(BUCKETS)] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    /// Requests in bucket `i` (`BUCKETS`: slower than every bound), not cumulative.
    pub fn bucket(&self, i: usize) -> u64 {
        self.counts[i]
    }

    /// Requests recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Their total time, in nanoseconds.
    pub fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    fn add(&mut self, o: &Histogram) {
        for (c, o) in self.counts.iter_mut().zip(&o.counts) {
            *c += o;
        }
        self.sum_ns = self.sum_ns.saturating_add(o.sum_ns);
    }
}

/// The counters of the queues that closed on one thread, per export. Kept by the thread that
/// served the queues and reported with its live queues in one answer, so an export's totals
/// (closed plus live) never count a queue twice or miss it while it closes. An export that is
/// no longer served has its totals folded into one sum (`removed`), so export churn cannot
/// grow the list (and the metrics scraped) for as long as the target runs.
#[derive(Clone, Debug, Default)]
pub struct ClosedTotals {
    exports: Vec<(String, QueueStats)>,
    removed: QueueStats,
}

impl ClosedTotals {
    /// Adds a closed queue's counters to its export's. An export seen for the first time
    /// first folds away those no longer served (so the list holds at most the exports served
    /// and the one added); a queue of an export already removed goes to the removed sum.
    /// `served` names the exports served: asked once, and only then (one look at the
    /// registry, not one per export listed).
    pub fn add(
        &mut self,
        export: &str,
        stats: &QueueStats,
        served: impl FnOnce() -> HashSet<String>,
    ) {
        if let Some((_, total)) = self.exports.iter_mut().find(|(e, _)| e == export) {
            total.add(stats);
            return;
        }
        let served = served();
        self.fold(&served);
        if served.contains(export) {
            self.exports.push((export.to_string(), *stats));
        } else {
            self.removed.add(stats);
        }
    }

    /// Adds the counters of a queue of `export` that closed: to its export's totals while
    /// that very export is served, to the removed sum once it was removed (and maybe added
    /// again under its name since: the new one counts from zero).
    pub fn add_queue(
        &mut self,
        registry: &crate::session::Registry,
        export: &std::sync::Arc<blkwire_backend::Export>,
        stats: &QueueStats,
    ) {
        if registry.serves(export) {
            self.add(&export.name, stats, || registry.export_names());
        } else {
            self.add_removed(stats);
        }
    }

    /// A closed queue's counters whose export is no longer served: the removed sum.
    fn add_removed(&mut self, stats: &QueueStats) {
        self.removed.add(stats);
    }

    /// Folds the totals of export `name` (removed) into the removed sum.
    pub fn forget(&mut self, name: &str) {
        self.keep_only(|e| e != name);
    }

    /// Folds the totals of the exports not `served` into the removed sum.
    pub fn fold(&mut self, served: &HashSet<String>) {
        self.keep_only(|e| served.contains(e));
    }

    /// Folds the totals of the exports `keep` says no to into the removed sum.
    fn keep_only(&mut self, keep: impl Fn(&str) -> bool) {
        let removed = &mut self.removed;
        self.exports.retain(|(e, s)| {
            let kept = keep(e);
            if !kept {
                removed.add(s);
            }
            kept
        });
    }

    /// Adds every export's totals of `other`, folding nothing: a report's sum, whose readers
    /// keep the exports served (`metrics::render_exports`) and count the rest in the total.
    pub fn merge(&mut self, other: &ClosedTotals) {
        for (export, stats) in &other.exports {
            match self.exports.iter_mut().find(|(e, _)| e == export) {
                Some((_, total)) => total.add(stats),
                None => self.exports.push((export.clone(), *stats)),
            }
        }
        self.removed.add(&other.removed);
    }

    /// (export, counters), in the order exports first closed a queue.
    pub fn iter(&self) -> impl Iterator<Item = &(String, QueueStats)> {
        self.exports.iter()
    }

    /// Every closed queue's counters: the exports' and the removed ones'.
    pub fn total(&self) -> QueueStats {
        let mut total = self.removed;
        for (_, s) in &self.exports {
            total.add(s);
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_the_first_bucket_whose_bound_holds_them() {
        let at = |ns: u64| {
            let mut h = Histogram::default();
            h.record(Duration::from_nanos(ns));
            (0..=BUCKETS).find(|&i| h.bucket(i) == 1).unwrap()
        };
        assert_eq!(at(0), 0);
        assert_eq!(at(1000), 0, "the bound is inclusive");
        assert_eq!(at(1001), 1);
        assert_eq!(at(2000), 1);
        assert_eq!(at(2001), 2);
        assert_eq!(at(1_000_000), 10, "1 ms <= 1.024 ms");
        let last = Histogram::bound_ns(BUCKETS - 1);
        assert_eq!(last, 8_388_608_000);
        assert_eq!(at(last), BUCKETS - 1);
        assert_eq!(at(last + 1), BUCKETS, "slower than every bound");
        assert_eq!(at(u64::MAX), BUCKETS);
        for i in 0..BUCKETS {
            assert_eq!(at(Histogram::bound_ns(i)), i);
            assert_eq!(at(Histogram::bound_ns(i) + 1), i + 1);
        }
    }

    #[test]
    fn histograms_add_up_per_operation() {
        let mut a = QueueStats::default();
        a.latency.record(BlockOp::Read, Duration::from_micros(3));
        a.latency.record(BlockOp::Read, Duration::from_secs(60));
        a.latency.record(BlockOp::Write, Duration::from_micros(1));
        let mut total = QueueStats::default();
        total.add(&a);
        total.add(&a);
        let r = total.latency.of(BlockOp::Read);
        assert_eq!((r.count(), r.bucket(2), r.bucket(BUCKETS)), (4, 2, 2));
        assert_eq!(r.sum_ns(), 2 * (3_000 + 60_000_000_000));
        assert_eq!(total.latency.of(BlockOp::Write).count(), 2);
        assert_eq!(total.latency.of(BlockOp::Flush).count(), 0);
    }

    #[test]
    fn closed_totals_are_kept_per_export() {
        let s = |reads| QueueStats {
            reads,
            ..QueueStats::default()
        };
        let all = || HashSet::from(["x".to_string(), "y".to_string()]);
        let mut a = ClosedTotals::default();
        a.add("x", &s(1), all);
        a.add("y", &s(10), all);
        let mut b = ClosedTotals::default();
        b.add("x", &s(2), all);
        b.merge(&a);
        let got: Vec<_> = b.iter().map(|(e, s)| (e.as_str(), s.reads)).collect();
        assert_eq!(got, [("x", 3), ("y", 10)]);
        assert_eq!(b.total().reads, 13);
    }

    /// An export removed is forgotten by name (its totals to the removed sum), whatever is
    /// served by then: one added again under the name at once counts from zero, and a queue
    /// of the old one closing later adds to the removed sum, not to the new one.
    #[test]
    fn a_removed_export_is_forgotten_by_name() {
        let s = |reads| QueueStats {
            reads,
            ..QueueStats::default()
        };
        let served = || HashSet::from(["x".to_string()]);
        let mut t = ClosedTotals::default();
        t.add("x", &s(5), served);
        t.forget("x");
        t.add_removed(&s(3));
        assert_eq!(t.iter().count(), 0, "nothing listed under x");
        t.add("x", &s(2), served);
        let got: Vec<_> = t.iter().map(|(e, s)| (e.as_str(), s.reads)).collect();
        assert_eq!(got, [("x", 2)]);
        assert_eq!(t.total().reads, 10, "nothing lost from the total");
    }

    /// Export churn (add, serve, remove, again and again) must not grow a thread's list: the
    /// exports removed are folded into one sum, which keeps the target's total.
    #[test]
    fn removed_exports_fold_into_one_sum() {
        let s = |reads| QueueStats {
            reads,
            ..QueueStats::default()
        };
        let mut t = ClosedTotals::default();
        for i in 0..1000u64 {
            let name = format!("e{i}");
            let served = || HashSet::from([name.clone(), "kept".to_string()]);
            t.add(&name, &s(1), served);
            t.add("kept", &s(2), served);
        }
        let got: Vec<_> = t.iter().map(|(e, s)| (e.as_str(), s.reads)).collect();
        assert_eq!(got, [("kept", 2000), ("e999", 1)], "e0..e998 removed");
        assert_eq!(t.total().reads, 3000, "nothing lost from the total");
        t.add("gone", &s(5), || HashSet::from(["kept".to_string()]));
        assert_eq!(t.iter().count(), 1, "e999 folded, gone never listed");
        assert_eq!(t.total().reads, 3005);
        let mut u = ClosedTotals::default();
        u.merge(&t);
        assert_eq!(
            u.total().reads,
            3005,
            "the removed sum travels with a merge"
        );
    }
}
