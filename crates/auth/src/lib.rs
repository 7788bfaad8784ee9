//! Who a peer is and what it may do (docs/PROTOCOL.md §12, docs/SECURITY.md).
//!
//! - [`keys`]: host ids and the pre-shared key files both ends read (nbdkit's PSK format).
//! - [`acl`]: per-export allow rules (host ids, address prefixes, MAC addresses).
//! - [`proof`]: the handshake's challenge-response proofs and the session keys derived from them.
//! - [`seal`]: per-frame authentication (and optional encryption) of datagram frames.
//! - [`dhchap`]: NVMe DH-HMAC-CHAP in-band authentication (NVMe Base Spec 2.0 §8.13) for the
//!   NVMe/TCP frontend: secrets, messages, the controller's and the host's state machines.
//! - [`cookie`]: the target's stateless address-proof challenge, so it never answers an
//!   unproven address with more bytes than it received.
//!
//! All cryptography is `ring`'s (HMAC-SHA-256/384/512, HKDF-SHA-256, AES-256-GCM) and, for
//! DH-HMAC-CHAP's finite-field Diffie-Hellman, OpenSSL's; nothing here is hand-rolled beyond
//! putting those pieces together as §12 and the NVMe specification say.
#![deny(missing_docs)]

pub mod acl;
pub mod cookie;
pub mod dhchap;
pub mod keys;
pub mod proof;
pub mod seal;

pub use acl::{Acl, PeerAddr};
pub use keys::{default_host_id, Key, KeyStore};

/// Fills `out` with random bytes from the operating system.
pub fn random(out: &mut [u8]) {
    use ring::rand::SecureRandom;
    // The system generator only fails if the kernel has no entropy source at all, which no
    // machine blkwire runs on lacks; there is no safe way to go on without it.
    ring::rand::SystemRandom::new()
        .fill(out)
        .expect("the operating system's random generator failed");
}

/// A random u64 (session ids, cookies).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    random(&mut b);
    u64::from_le_bytes(b)
}
