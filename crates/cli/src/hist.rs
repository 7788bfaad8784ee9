//! Latency histogram for `bench`: HdrHistogram (3 significant digits, 1 ns to an hour), whose
//! counts are allocated up front, so recording allocates nothing. It replaced a hand-written
//! log-linear one (16 buckets per power of two, ~6% resolution): recording costs about 2 ns
//! more, and quantiles are within 0.1% instead of 6% (docs/ARCHITECTURE.md, "Hand-written or
//! a crate").

/// Latencies in nanoseconds.
pub struct Histogram(hdrhistogram::Histogram<u64>);

/// Longest latency kept apart (an hour); longer ones count as this.
const HIGHEST: u64 = 3_600_000_000_000;

impl Default for Histogram {
    fn default() -> Self {
        Histogram(
            hdrhistogram::Histogram::new_with_bounds(1, HIGHEST, 3)
                .expect("valid histogram bounds"),
        )
    }
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        self.0.saturating_record(v.max(1));
    }
    pub fn merge(&mut self, o: &Histogram) {
        // Both have the same bounds, so adding cannot fail.
        let _ = self.0.add(&o.0);
    }
    pub fn count(&self) -> u64 {
        self.0.len()
    }
    pub fn mean(&self) -> f64 {
        self.0.mean()
    }
    /// The longest latency recorded.
    pub fn max(&self) -> u64 {
        self.0.max()
    }
    /// Value at quantile `q` (0..=1).
    pub fn quantile(&self, q: f64) -> u64 {
        self.0.value_at_quantile(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_track_data() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 / 5_000_000.0 - 1.0).abs() < 0.002, "{p50}");
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 / 9_900_000.0 - 1.0).abs() < 0.002, "{p99}");
        assert!((h.mean() / 5_000_500.0 - 1.0).abs() < 0.002);
        assert!((h.max() as f64 / 10_000_000.0 - 1.0).abs() < 0.002);
        let mut other = Histogram::default();
        other.record(u64::MAX);
        h.merge(&other);
        assert_eq!(
            h.count(),
            10_001,
            "an out-of-range value is kept (as the highest)"
        );
    }
}
