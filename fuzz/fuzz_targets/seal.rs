//! Sealed datagrams (PROTOCOL.md §12.4): the frame walk and the seal opener take any bytes
//! without panicking, and nothing opens without the key: a frame built by the fuzzer never
//! verifies under a key it cannot know, whatever it claims (flags, lengths, sequence numbers).

#![no_main]

use blkwire_auth::seal::Opener;
use blkwire_wire::{datagram, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = [0x5au8; 32];
    for encrypt in [false, true] {
        let mut opener = Opener::new(&key, encrypt);
        let mut scratch = vec![0u8; 65536];
        for f in datagram::frames(data, 65536).flatten() {
            if f.sealed() {
                assert!(
                    opener.open(f.raw, HEADER_LEN, &mut scratch).is_err(),
                    "a forged frame opened"
                );
            }
        }
        // And raw bytes straight into the opener, framed or not.
        let _ = opener.open(data, HEADER_LEN.min(data.len()), &mut scratch);
    }
});
