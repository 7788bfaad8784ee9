//! Throughput of `blkwire_wire::crc` against the `crc32c` crate, by hand:
//! `cargo run --release -p blkwire-wire --example crc_speed`. Prints, asserts nothing. Needs
//! about 1 GiB of memory for the cold measurement.

use std::hint::black_box;
use std::time::Instant;

fn gbps(f: impl Fn(&[u8]) -> u32, data: &[u8]) -> f64 {
    let iters = (64usize << 20) / data.len(); // ~64 MiB per measurement
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let mut acc = 0u32;
        for _ in 0..iters {
            acc ^= f(black_box(data));
        }
        black_box(acc);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (iters * data.len()) as f64 / best / 1e9
}

fn main() {
    println!("fast path: {}", blkwire_wire::crc::fast_path());
    println!(
        "{:>7} {:>12} {:>12} {:>7}",
        "bytes", "crc32c GB/s", "new GB/s", "ratio"
    );
    for len in [64, 128, 192, 256, 512, 1024, 4096, 4096 + 48, 9000, 65536] {
        let data: Vec<u8> = (0..len).map(|i| (i * 131 + 7) as u8).collect();
        let old = gbps(crc32c::crc32c, &data);
        let new = gbps(blkwire_wire::crc::crc32c, &data);
        println!("{len:>7} {old:>12.2} {new:>12.2} {:>7.2}", new / old);
    }
    // Cold: one pass in 9000-byte pieces over 1 GiB written beforehand, far more than the caches
    // hold, as a target's CRC over a large READ from a RAM export is the first touch of it.
    let big: Vec<u8> = (0..1usize << 30).map(|i| (i * 131 + 7) as u8).collect();
    for (name, f) in [
        ("crc32c crate", crc32c::crc32c as fn(&[u8]) -> u32),
        ("crc32c", blkwire_wire::crc::crc32c),
        ("crc32c_append_streaming", |d| {
            blkwire_wire::crc::crc32c_append_streaming(0, d, usize::MAX)
        }),
    ] {
        let t = Instant::now();
        let mut acc = 0u32;
        for piece in big.chunks(9000) {
            acc ^= f(black_box(piece));
        }
        black_box(acc);
        println!(
            "cold, 1 GiB in 9000-byte pieces, {name}: {:.2} GB/s",
            big.len() as f64 / t.elapsed().as_secs_f64() / 1e9
        );
    }
}
