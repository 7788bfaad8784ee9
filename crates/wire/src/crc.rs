//! CRC32C (Castagnoli, reflected, as in iSCSI and the `crc32c` crate) for frame checksums (§1).
//!
//! Every frame's payload is checksummed at both ends, so this is on the data path. On x86_64,
//! inputs of `FAST_MIN` bytes or more are folded with carry-less multiplication (Intel, "Fast CRC
//! Computation for Generic Polynomials Using PCLMULQDQ", reflected variant) down to 128 bits, and
//! the SSE4.2 `crc32` instruction then finishes those 16 bytes plus the tail (no Barrett reduction
//! needed). CPUs with AVX-512 and VPCLMULQDQ fold 4 x 512 bits at a time (`x86::fold512`); the
//! others with PCLMULQDQ (every x86_64 server CPU since 2010, Cascade Lake included) fold
//! 4 x 128 bits (`x86::fold128`). Everything else goes to the `crc32c` crate, which uses the
//! `crc32` instruction alone (three streams in parallel).

/// CRC32C of `data`; the same value as `crc32c::crc32c`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// CRC32C of the data `crc` was computed over followed by `data`, so that
/// `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`; the same value as `crc32c::crc32c_append`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    append(crc, data, 0)
}

/// `crc32c_append` over a piece of a longer stretch of memory whose next `next` bytes, right
/// after `data`, are checksummed next (the rest of a large READ or WRITE whose fragments are
/// sent from where the data lies): up to `PREFETCH_AHEAD` of them are asked for ahead of time
/// too (prefetch hints, which dereference nothing and cannot fault), so the next call does not
/// start by waiting for them. The same value as `crc32c_append`. On the narrow path only (the
/// one measured).
#[inline]
pub fn crc32c_append_streaming(crc: u32, data: &[u8], next: usize) -> u32 {
    append(crc, data, next.min(PREFETCH_AHEAD))
}

/// How far ahead the narrow fold asks for memory: one page. Measured with
/// `examples/crc_speed.rs` over 1 GiB not in the caches, in 9000-byte pieces each followed by
/// the next: 512, 1024, 2048, 4096 and 8192 bytes gave 10.0, 10.6, 11.2, 11.7 and 11.5 GB/s,
/// against 8.3-9.6 fetching nothing past each piece (the crate: 8.6).
pub const PREFETCH_AHEAD: usize = 4096;

#[inline]
fn append(crc: u32, data: &[u8], past_end: usize) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if data.len() >= FAST_MIN {
        match x86::path() {
            // SAFETY: `path` saw every CPU feature the fold is compiled for (a length under the
            // 64 bytes the folds take would be a panic, not undefined behaviour).
            x86::Path::Wide => return unsafe { x86::fold512(crc, data) },
            // SAFETY: as above.
            x86::Path::Narrow => return unsafe { x86::fold128(crc, data, past_end) },
            x86::Path::Crate => {}
        }
    }
    let _ = past_end;
    crc32c::crc32c_append(crc, data)
}

/// Which way this CPU computes inputs of `FAST_MIN` bytes or more: "vpclmulqdq" (4 x 512-bit
/// folding), "pclmulqdq" (4 x 128-bit folding) or "crc32c crate".
pub fn fast_path() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    return match x86::path() {
        x86::Path::Wide => "vpclmulqdq",
        x86::Path::Narrow => "pclmulqdq",
        x86::Path::Crate => "crc32c crate",
    };
    #[cfg(not(target_arch = "x86_64"))]
    "crc32c crate"
}

/// Shortest input folded: one 512-bit block (four accumulators of 128 bits on the narrow path).
/// Measured with `examples/crc_speed.rs`, both folds are already faster than the crate at 64
/// bytes (wide about 1.7x; narrow 3.1x on a Cascade Lake, 1.2-1.8x from 512 bytes to 64 KiB),
/// so there is no higher break-even point.
pub const FAST_MIN: usize = 64;

/// The reflected polynomial: P(x) = x^32 + 0x1EDC6F41, bit 31 - d holding the coefficient of x^d.
const POLY_REFLECTED: u32 = 0x82F6_3B78;

/// x^n mod P in the reflected 32-bit form (bit j holds the coefficient of x^(31 - j)).
const fn xpow_mod(n: u32) -> u32 {
    let mut v = 1u32 << 31; // x^0
    let mut i = 0;
    while i < n {
        // Multiplying by x moves every coefficient one bit right; x^31 becomes x^32 = P - x^32.
        v = if v & 1 != 0 {
            (v >> 1) ^ POLY_REFLECTED
        } else {
            v >> 1
        };
        i += 1;
    }
    v
}

/// The two multipliers that move a 128-bit block `bits` further along the message (to be xored
/// onto the block that ends `bits` bits later), for the low and the high 64-bit half.
///
/// A loaded block B = L·x^64 + H (the low qword L holds the earlier, higher-degree bits). Moving
/// it is multiplying by x^bits mod P: L·x^(bits+64) + H·x^bits. `pclmulqdq` of a reflected
/// 64-bit half with a 32-bit constant reflected in the low dword yields the product times x^33 as
/// a reflected 128-bit value, so the constants are x^(bits+31) and x^(bits-33) mod P; the product
/// has degree below 128 and so fits the block it is xored onto.
const fn fold_pair(bits: u32) -> (u64, u64) {
    (xpow_mod(bits + 31) as u64, xpow_mod(bits - 33) as u64)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{fold_pair, PREFETCH_AHEAD};
    use std::arch::x86_64::*;
    use std::sync::atomic::{AtomicU8, Ordering};

    // Evaluated at compile time: `xpow_mod` loops `bits` times.
    const K128: (u64, u64) = fold_pair(128);
    const K256: (u64, u64) = fold_pair(256);
    const K384: (u64, u64) = fold_pair(384);
    const K512: (u64, u64) = fold_pair(512);
    const K1024: (u64, u64) = fold_pair(1024);
    const K1536: (u64, u64) = fold_pair(1536);
    const K2048: (u64, u64) = fold_pair(2048);

    /// How inputs of `FAST_MIN` bytes or more are computed on this CPU.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(u8)]
    pub enum Path {
        /// `fold512`: AVX-512 with VPCLMULQDQ.
        Wide = 1,
        /// `fold128`: PCLMULQDQ and SSE4.2 without the above.
        Narrow = 2,
        /// Neither: the `crc32c` crate.
        Crate = 3,
    }

    /// `DETECTED` before the first call: no `Path` has this value.
    const UNKNOWN: u8 = 0;
    /// The detected `Path` as its `u8`, or `UNKNOWN`.
    static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);

    /// The path for this CPU; one relaxed load after the first call. Every thread that
    /// detects stores the same value, and nothing else is published with it.
    #[inline]
    pub fn path() -> Path {
        let seen = DETECTED.load(Ordering::Relaxed);
        for p in [Path::Wide, Path::Narrow, Path::Crate] {
            if seen == p as u8 {
                return p;
            }
        }
        let p = detect();
        DETECTED.store(p as u8, Ordering::Relaxed);
        p
    }

    fn detect() -> Path {
        let narrow = is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse4.2");
        if narrow && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("vpclmulqdq") {
            Path::Wide
        } else if narrow {
            Path::Narrow
        } else {
            Path::Crate
        }
    }

    /// Whether `fold128` may run here (the wide path's CPUs have its features too).
    #[cfg(test)]
    pub fn narrow_available() -> bool {
        path() != Path::Crate
    }

    /// The same multiplier pair in every 128-bit lane.
    #[target_feature(enable = "avx512f")]
    fn splat((lo, hi): (u64, u64)) -> __m512i {
        _mm512_set_epi64(
            hi as i64, lo as i64, hi as i64, lo as i64, hi as i64, lo as i64, hi as i64, lo as i64,
        )
    }

    #[target_feature(enable = "avx512f")]
    fn load(block: &[u8]) -> __m512i {
        assert!(block.len() >= 64);
        // SAFETY: 64 bytes are readable (checked above); loadu has no alignment requirement.
        unsafe { _mm512_loadu_si512(block.as_ptr().cast()) }
    }

    /// Every 128-bit lane of `x` multiplied by its lane's pair in `k`, that is moved forward.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold_by(x: __m512i, k: __m512i) -> __m512i {
        _mm512_xor_si512(
            _mm512_clmulepi64_epi128(x, k, 0x00),
            _mm512_clmulepi64_epi128(x, k, 0x11),
        )
    }

    /// `x` moved forward by `k`, xored onto `next`.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold_onto(x: __m512i, k: __m512i, next: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128(x, k, 0x00);
        let hi = _mm512_clmulepi64_epi128(x, k, 0x11);
        _mm512_ternarylogic_epi64(lo, hi, next, 0x96) // lo ^ hi ^ next
    }

    /// `crc32c_append` for `data.len() >= 64`.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub fn fold512(crc: u32, data: &[u8]) -> u32 {
        // The running CRC (pre-inverted, as the crate does) xored onto the first four bytes gives
        // the same remainder as starting the register with it: both contribute crc·x^(8·len).
        let init = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, i64::from(!crc));
        let k512 = splat(K512);
        let mut x;
        let rest;
        if data.len() >= 256 {
            // Four independent 512-bit accumulators keep the clmul units busy; each moves 256 bytes.
            let mut blocks = data.chunks_exact(256);
            let b = blocks.next().expect("at least 256 bytes");
            let mut x0 = _mm512_xor_si512(load(b), init);
            let mut x1 = load(&b[64..]);
            let mut x2 = load(&b[128..]);
            let mut x3 = load(&b[192..]);
            let k2048 = splat(K2048);
            for b in &mut blocks {
                x0 = fold_onto(x0, k2048, load(b));
                x1 = fold_onto(x1, k2048, load(&b[64..]));
                x2 = fold_onto(x2, k2048, load(&b[128..]));
                x3 = fold_onto(x3, k2048, load(&b[192..]));
            }
            let a = fold_by(x0, splat(K1536));
            let b = fold_by(x1, splat(K1024));
            x = _mm512_ternarylogic_epi64(a, b, fold_onto(x2, k512, x3), 0x96);
            rest = blocks.remainder();
        } else {
            x = _mm512_xor_si512(load(data), init);
            rest = &data[64..];
        }
        let mut blocks = rest.chunks_exact(64);
        for b in &mut blocks {
            x = fold_onto(x, k512, load(b));
        }
        let tail = blocks.remainder();

        // 512 -> 128 bits: lanes 0, 1 and 2 move 384, 256 and 128 bits onto lane 3 (lane 3's
        // multipliers are zero; it is taken from `x` unmoved).
        let ((l384, h384), (l256, h256), (l128, h128)) = (K384, K256, K128);
        let k = _mm512_set_epi64(
            0,
            0,
            h128 as i64,
            l128 as i64,
            h256 as i64,
            l256 as i64,
            h384 as i64,
            l384 as i64,
        );
        let t = fold_by(x, k);
        let v = _mm_xor_si128(
            _mm_xor_si128(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32(t, 1)),
            _mm_xor_si128(
                _mm512_extracti32x4_epi32(t, 2),
                _mm512_extracti32x4_epi32(x, 3),
            ),
        );

        finish(v, tail)
    }

    /// The CRC of a message whose folded remainder is `v`, followed by `tail`. The 16 bytes of
    /// `v` are a message of their own with the same remainder; `crc32` with a zero register
    /// takes them, then the tail, as raw CRC steps.
    #[target_feature(enable = "sse4.2")]
    fn finish(v: __m128i, tail: &[u8]) -> u32 {
        let mut c = _mm_crc32_u64(0, _mm_cvtsi128_si64(v) as u64);
        c = _mm_crc32_u64(c, _mm_extract_epi64(v, 1) as u64);
        let mut words = tail.chunks_exact(8);
        for w in &mut words {
            c = _mm_crc32_u64(c, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let mut c = c as u32;
        for &b in words.remainder() {
            c = _mm_crc32_u8(c, b);
        }
        !c
    }

    /// A multiplier pair as one 128-bit register: low half `lo`, high half `hi`.
    #[target_feature(enable = "sse2")]
    fn pair128((lo, hi): (u64, u64)) -> __m128i {
        _mm_set_epi64x(hi as i64, lo as i64)
    }

    #[target_feature(enable = "sse2")]
    fn load128(block: &[u8]) -> __m128i {
        assert!(block.len() >= 16);
        // SAFETY: 16 bytes are readable (checked above); loadu has no alignment requirement.
        unsafe { _mm_loadu_si128(block.as_ptr().cast()) }
    }

    /// `x` moved forward by `k` (the 128-bit form of `fold_by`).
    #[target_feature(enable = "pclmulqdq")]
    fn fold_by128(x: __m128i, k: __m128i) -> __m128i {
        _mm_xor_si128(
            _mm_clmulepi64_si128(x, k, 0x00),
            _mm_clmulepi64_si128(x, k, 0x11),
        )
    }

    /// `crc32c_append` for `data.len() >= 64` with 128-bit carry-less multiplication: four
    /// accumulators, each moving 64 bytes per step, keep `pclmulqdq` (one a cycle, a latency of
    /// about seven) busy, as the wide path's four 512-bit ones do. Memory is fetched
    /// `PREFETCH_AHEAD` bytes ahead of the fold, up to `past_end` bytes past `data`'s end.
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    pub fn fold128(crc: u32, data: &[u8], past_end: usize) -> u32 {
        let init = _mm_cvtsi32_si128(!crc as i32);
        let mut blocks = data.chunks_exact(64);
        let b = blocks.next().expect("at least 64 bytes");
        let mut x0 = _mm_xor_si128(load128(b), init);
        let mut x1 = load128(&b[16..]);
        let mut x2 = load128(&b[32..]);
        let mut x3 = load128(&b[48..]);
        let k512 = pair128(K512);
        // Fetched ahead: the hardware's prefetchers stop at each 4 KiB page, and a first pass
        // over memory the caches do not hold (a large READ from a RAM export) waits on every
        // new page. `_mm_prefetch` is a hint: it never faults, and a pointer computed with
        // `wrapping_add` may point anywhere.
        let fetch_end = data.as_ptr().wrapping_add(data.len() + past_end);
        for b in &mut blocks {
            let ahead = b.as_ptr().wrapping_add(PREFETCH_AHEAD);
            if ahead < fetch_end {
                // Safe to call from Rust 1.93 on; `unsafe` for the declared 1.87.
                #[allow(unused_unsafe)]
                // SAFETY: a prefetch is a hint: it dereferences nothing and cannot fault.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast())
                };
            }
            x0 = _mm_xor_si128(fold_by128(x0, k512), load128(b));
            x1 = _mm_xor_si128(fold_by128(x1, k512), load128(&b[16..]));
            x2 = _mm_xor_si128(fold_by128(x2, k512), load128(&b[32..]));
            x3 = _mm_xor_si128(fold_by128(x3, k512), load128(&b[48..]));
        }
        // Four to one: x0, x1 and x2 move 384, 256 and 128 bits onto x3.
        let mut x = _mm_xor_si128(
            _mm_xor_si128(fold_by128(x0, pair128(K384)), fold_by128(x1, pair128(K256))),
            _mm_xor_si128(fold_by128(x2, pair128(K128)), x3),
        );
        let k128 = pair128(K128);
        let mut rest = blocks.remainder().chunks_exact(16);
        for b in &mut rest {
            x = _mm_xor_si128(fold_by128(x, k128), load128(b));
        }
        finish(x, rest.remainder())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x^n mod P derived independently of `xpow_mod`: unreflected polynomial arithmetic (bit d is
    /// the coefficient of x^d), by square-and-multiply, then reflected.
    fn xpow_mod_slow(n: u32) -> u32 {
        const P: u64 = 0x1_1EDC_6F41;
        fn mulmod(a: u32, b: u32) -> u32 {
            let mut prod: u64 = 0;
            for i in 0..32 {
                if b >> i & 1 != 0 {
                    prod ^= (a as u64) << i;
                }
            }
            for d in (32..64).rev() {
                if prod >> d & 1 != 0 {
                    prod ^= P << (d - 32);
                }
            }
            prod as u32
        }
        let (mut result, mut base, mut e) = (1u32, 2u32, n); // x^0, x^1
        while e > 0 {
            if e & 1 != 0 {
                result = mulmod(result, base);
            }
            base = mulmod(base, base);
            e >>= 1;
        }
        result.reverse_bits()
    }

    #[test]
    fn fold_constants_match_an_independent_derivation() {
        for n in (0..64).chain([95, 159, 223, 287, 351, 415, 479, 543, 991, 1503, 2015, 2079]) {
            assert_eq!(xpow_mod(n), xpow_mod_slow(n), "x^{n} mod P");
        }
        for bits in [128, 256, 384, 512, 1024, 1536, 2048] {
            let (lo, hi) = fold_pair(bits);
            assert_eq!(lo as u32, xpow_mod_slow(bits + 31));
            assert_eq!(hi as u32, xpow_mod_slow(bits - 33));
        }
        // x^32 mod P is the polynomial itself without x^32.
        assert_eq!(xpow_mod(32), POLY_REFLECTED);
    }

    /// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn the_fastest_path_the_cpu_has_is_taken() {
        let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let has = |f: &str| {
            flags
                .lines()
                .find(|l| l.starts_with("flags"))
                .is_some_and(|l| l.split_whitespace().any(|w| w == f))
        };
        let want = if !cfg!(target_arch = "x86_64") || !has("pclmulqdq") || !has("sse4_2") {
            "crc32c crate"
        } else if has("avx512f") && has("vpclmulqdq") {
            "vpclmulqdq"
        } else {
            "pclmulqdq"
        };
        assert_eq!(fast_path(), want, "per the flags in /proc/cpuinfo");
    }

    #[test]
    fn every_short_length_at_every_misalignment() {
        let buf = bytes(2048 + 64, 1);
        for off in 0..64 {
            for len in 0..=2048 {
                let d = &buf[off..off + len];
                assert_eq!(crc32c(d), crc32c::crc32c(d), "len {len} offset {off}");
            }
        }
    }

    /// Each fold itself from its 64-byte minimum, including the lengths the dispatcher sends to
    /// the crate, so the single-step starts are covered whatever `FAST_MIN` is, and the narrow
    /// fold also where the CPU would take the wide one.
    #[cfg(target_arch = "x86_64")]
    fn fold_from_its_minimum_length(fold: unsafe fn(u32, &[u8]) -> u32) {
        let buf = bytes(1024 + 16, 2);
        for off in 0..16 {
            for len in 64..=1024 {
                let d = &buf[off..off + len];
                // SAFETY: the caller detected the fold's features; len >= 64.
                let got = unsafe { fold(0xDEAD_BEEF, d) };
                assert_eq!(
                    got,
                    crc32c::crc32c_append(0xDEAD_BEEF, d),
                    "len {len} offset {off}"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fold128_from_its_minimum_length() {
        assert!(
            x86::narrow_available(),
            "this x86_64 CPU lacks PCLMULQDQ or SSE4.2, which the narrow fold needs"
        );
        /// The narrow fold with nothing fetched past the end.
        unsafe fn narrow(c: u32, d: &[u8]) -> u32 {
            // SAFETY: the features were detected above (the caller's promise).
            unsafe { x86::fold128(c, d, 0) }
        }
        /// The narrow fold fetching a page past the end.
        unsafe fn narrow_streaming(c: u32, d: &[u8]) -> u32 {
            // SAFETY: as `narrow`.
            unsafe { x86::fold128(c, d, PREFETCH_AHEAD) }
        }
        fold_from_its_minimum_length(narrow);
        fold_from_its_minimum_length(narrow_streaming);
    }

    /// Ignored by default: most CPUs (this project's CI's among them) cannot run the fold,
    /// and `the_fastest_path_the_cpu_has_is_taken` proves the dispatcher never takes it
    /// there. Run with `--ignored` on a CPU that has AVX-512 and VPCLMULQDQ; elsewhere it fails
    /// and says so, rather than pass without having run.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs a CPU with AVX-512 and VPCLMULQDQ: run with --ignored on one"]
    fn fold512_from_its_minimum_length() {
        assert!(
            x86::path() == x86::Path::Wide,
            "this CPU lacks AVX-512/VPCLMULQDQ: fold512 cannot run here"
        );
        fold_from_its_minimum_length(x86::fold512);
    }

    /// The narrow fold over long inputs also where the CPU would take the wide one (the
    /// dispatcher tests above reach only this CPU's path).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fold128_large_inputs() {
        assert!(
            x86::narrow_available(),
            "this x86_64 CPU lacks PCLMULQDQ or SSE4.2"
        );
        for (i, len) in [4096, 4096 + 48, 9000, 65536, 1 << 20]
            .into_iter()
            .enumerate()
        {
            let d = bytes(len + 3, i as u64 + 70);
            for off in [0, 1, 3] {
                let d = &d[off..off + len];
                // SAFETY: features detected above; len >= 64.
                let got = unsafe { x86::fold128(0x1234_5678, d, 0) };
                assert_eq!(
                    got,
                    crc32c::crc32c_append(0x1234_5678, d),
                    "len {len} offset {off}"
                );
                assert_eq!(crc32c_append_streaming(0x1234_5678, d, 1 << 20), got);
            }
        }
    }

    #[test]
    fn large_random_inputs() {
        for (i, len) in [4096, 4096 + 48, 9000, 65536, 1 << 20]
            .into_iter()
            .enumerate()
        {
            let d = bytes(len + 3, i as u64 + 7);
            for off in [0, 1, 3] {
                let d = &d[off..off + len];
                assert_eq!(crc32c(d), crc32c::crc32c(d), "len {len} offset {off}");
                assert_eq!(
                    crc32c_append(0x1234_5678, d),
                    crc32c::crc32c_append(0x1234_5678, d)
                );
            }
        }
    }

    /// The narrow fold's prefetch past the end never faults: slices that end right before a page
    /// nothing may touch, and right before a page not mapped at all, give the crate's CRC.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streaming_at_the_end_of_a_mapping() {
        assert!(
            x86::narrow_available(),
            "this x86_64 CPU lacks PCLMULQDQ or SSE4.2"
        );
        // SAFETY: sysconf has no preconditions.
        let page =
            usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).expect("page size");
        let readable = 3 * page;
        for protect in [true, false] {
            // Unmapped on any exit from here, failed assertions included.
            struct Mapping(*mut libc::c_void, usize);
            impl Drop for Mapping {
                fn drop(&mut self) {
                    // SAFETY: unmaps this test's own mapping (a page of it may be unmapped
                    // already, which munmap allows), not borrowed any more.
                    unsafe { libc::munmap(self.0, self.1) };
                }
            }
            // SAFETY: a fresh private anonymous mapping, checked below.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    readable + page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(
                base,
                libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            let mapping = Mapping(base, readable + page);
            let base = mapping.0.cast::<u8>();
            // SAFETY: the page after the readable ones is this mapping's own.
            let after = unsafe { base.add(readable) }.cast();
            // SAFETY: as above; the call changes this mapping alone.
            let r = unsafe {
                if protect {
                    libc::mprotect(after, page, libc::PROT_NONE)
                } else {
                    libc::munmap(after, page)
                }
            };
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
            // SAFETY: the first pages are mapped readable and writable, nothing else uses
            // them, and the slice is gone before `mapping`.
            let pages = unsafe { std::slice::from_raw_parts_mut(base, readable) };
            pages.copy_from_slice(&bytes(readable, 11));
            for len in [64, 65, 127, 1000, 4032, 4095, 4096, 8924, readable] {
                let d = &pages[readable - len..];
                let want = crc32c::crc32c_append(0x0BAD_F00D, d);
                // SAFETY: features detected above; len >= 64.
                let got = unsafe { x86::fold128(0x0BAD_F00D, d, PREFETCH_AHEAD) };
                assert_eq!(got, want, "len {len}, next page protected {protect}");
                let got = crc32c_append_streaming(0x0BAD_F00D, d, PREFETCH_AHEAD);
                assert_eq!(got, want, "len {len}, next page protected {protect}");
            }
            drop(mapping);
        }
    }

    #[test]
    fn appends_split_anywhere() {
        let d = bytes(20_000, 99);
        let splits = bytes(400, 5);
        for w in splits.chunks_exact(4) {
            let len = usize::from(u16::from_le_bytes([w[0], w[1]])) % d.len();
            let at = usize::from(u16::from_le_bytes([w[2], w[3]])) % (len + 1);
            let whole = crc32c::crc32c(&d[..len]);
            let (a, b) = d[..len].split_at(at);
            assert_eq!(crc32c_append(crc32c(a), b), whole, "len {len} split {at}");
            assert_eq!(crc32c_append(crc32c::crc32c(a), b), whole);
        }
    }

    #[test]
    fn all_zero_and_all_ones() {
        for len in [0, 1, 63, 64, 255, 256, 257, 4096, 4144, 9000, 65536] {
            for fill in [0x00, 0xFF] {
                let d = vec![fill; len];
                assert_eq!(crc32c(&d), crc32c::crc32c(&d), "len {len} fill {fill:#x}");
            }
        }
    }

    #[test]
    fn known_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let d = [0u8; 4096];
        assert_eq!(crc32c(&d), crc32c::crc32c(&d));
    }
}
