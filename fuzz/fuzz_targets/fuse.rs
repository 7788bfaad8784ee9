//! FUSE requests as the kernel hands them over (crates/map): `fuse::abi::parse` on arbitrary
//! bytes (the /dev/fuse read path), and `fuse::uring::request_bytes` on an arbitrary ring entry
//! header and payload (the io_uring path), whose output must then parse without panicking either.
//! The kernel is trusted more than the network, but a decoder that panics takes a mounted disk
//! down.

#![no_main]

use blkwire_map::fuse::{abi, uring};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = abi::parse(data);

    // The ring entry: a fixed-size header buffer filled from the input, the rest as payload.
    let mut header = [0u8; uring::HEADER_LEN];
    let n = data.len().min(header.len());
    header[..n].copy_from_slice(&data[..n]);
    let payload = &data[n..];
    let mut out = vec![0u8; 4096];
    if let Ok(len) = uring::request_bytes(&header, payload, &mut out) {
        assert!(len <= out.len());
        let _ = abi::parse(&out[..len]);
    }
});
