//! `wire::crc` against the `crc32c` crate (its fallback and reference): the same CRC for any bytes,
//! and the same when taken in two parts split at a point chosen by the first input byte.

#![no_main]

use blkwire_wire::crc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let want = crc32c::crc32c(data);
    assert_eq!(crc::crc32c(data), want);
    let at = data
        .first()
        .map_or(0, |&b| usize::from(b) * data.len() / 255);
    let (a, b) = data.split_at(at);
    assert_eq!(crc::crc32c_append(crc::crc32c(a), b), want);
    assert_eq!(crc::crc32c_append(crc32c::crc32c(a), b), want);
});
