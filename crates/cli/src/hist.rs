//! Latency histogram: log-linear buckets (16 per power of two), ~6% resolution, fixed memory,
//! no allocation while recording.

pub struct Histogram {
    buckets: Vec<u64>,
    count: u64,
    sum: u128,
    max: u64,
}

const SUB: u32 = 4; // 2^4 sub-buckets per power of two

fn index(v: u64) -> usize {
    if v < (1 << SUB) {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB;
    (((shift + 1) << SUB) + ((v >> shift) as u32 & ((1 << SUB) - 1))) as usize
}

fn lower_bound(i: usize) -> u64 {
    let i = i as u32;
    if i < (1 << SUB) {
        return i as u64;
    }
    let shift = (i >> SUB) - 1;
    ((1u64 << SUB) | (i & ((1 << SUB) - 1)) as u64) << shift
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; 64 << SUB],
            count: 0,
            sum: 0,
            max: 0,
        }
    }
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        self.buckets[index(v)] += 1;
        self.count += 1;
        self.sum += v as u128;
        self.max = self.max.max(v);
    }
    pub fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.count += o.count;
        self.sum += o.sum;
        self.max = self.max.max(o.max);
    }
    pub fn count(&self) -> u64 {
        self.count
    }
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }
    /// Value at quantile `q` (0..=1): the midpoint of the bucket holding it.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let lo = lower_bound(i);
                let hi = lower_bound(i + 1);
                return ((lo + hi) / 2).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in [0u64, 1, 15, 16, 17, 100, 1000, 123_456, 1 << 40] {
            let i = index(v);
            assert!(i >= last);
            last = i;
            assert!(lower_bound(i) <= v && v < lower_bound(i + 1), "{v}");
            assert!((lower_bound(i + 1) - lower_bound(i)) as f64 <= 1.0 + v as f64 / 15.0);
        }
    }

    #[test]
    fn quantiles_track_data() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 / 5_000_000.0 - 1.0).abs() < 0.07, "{p50}");
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 / 9_900_000.0 - 1.0).abs() < 0.07, "{p99}");
        assert!((h.mean() - 5_000_500.0).abs() < 1.0);
    }
}
