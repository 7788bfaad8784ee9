//! The target's stateless challenge (docs/PROTOCOL.md §12.1): a nonce only this target could
//! have issued to this address for this attempt, recomputed instead of remembered, so a flood
//! of first HELLOs costs the target nothing but the 80-byte answers.

use std::time::{SystemTime, UNIX_EPOCH};

use ring::hmac;

use crate::proof::LEN;

/// Seconds per epoch; a challenge is good for one to two of them.
const EPOCH_SECS: u64 = 30;

/// Issues and checks challenge nonces.
pub struct Challenger {
    key: hmac::Key,
}

impl Default for Challenger {
    fn default() -> Self {
        Self::new()
    }
}

impl Challenger {
    /// A challenger with a fresh random secret (a restarted target's old challenges are void).
    pub fn new() -> Challenger {
        let mut secret = [0u8; LEN];
        crate::random(&mut secret);
        Challenger {
            key: hmac::Key::new(hmac::HMAC_SHA256, &secret),
        }
    }

    fn epoch() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() / EPOCH_SECS)
            .unwrap_or(0)
    }

    fn at(&self, epoch: u64, address: &[u8], nonce_c: &[u8; LEN]) -> [u8; LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(&epoch.to_le_bytes());
        ctx.update(&[address.len() as u8]);
        ctx.update(address);
        ctx.update(nonce_c);
        ctx.sign().as_ref().try_into().expect("32 bytes")
    }

    /// The nonce to send `address` for an attempt named by `nonce_c`.
    pub fn issue(&self, address: &[u8], nonce_c: &[u8; LEN]) -> [u8; LEN] {
        self.at(Self::epoch(), address, nonce_c)
    }

    /// Did this target issue `nonce_s` to `address` for `nonce_c`, this epoch or the last?
    pub fn check(&self, address: &[u8], nonce_c: &[u8; LEN], nonce_s: &[u8; LEN]) -> bool {
        let now = Self::epoch();
        [now, now.saturating_sub(1)]
            .iter()
            .any(|e| crate::proof::same(&self.at(*e, address, nonce_c), nonce_s))
    }
}

/// The bytes that name an address in a challenge: IP and port, or a MAC.
pub fn address_bytes(addr: &crate::PeerAddr, port: u16, out: &mut [u8; 18]) -> usize {
    match addr {
        crate::PeerAddr::Ip(std::net::IpAddr::V4(v4)) => {
            out[..4].copy_from_slice(&v4.octets());
            out[4..6].copy_from_slice(&port.to_le_bytes());
            6
        }
        crate::PeerAddr::Ip(std::net::IpAddr::V6(v6)) => {
            out[..16].copy_from_slice(&v6.octets());
            out[16..18].copy_from_slice(&port.to_le_bytes());
            18
        }
        crate::PeerAddr::Mac(m) => {
            out[..6].copy_from_slice(m);
            6
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_check_only_for_the_same_address_attempt_and_target() {
        let c = Challenger::new();
        let n = [9u8; 32];
        let s = c.issue(b"10.0.0.1:5", &n);
        assert!(c.check(b"10.0.0.1:5", &n, &s));
        assert!(!c.check(b"10.0.0.2:5", &n, &s), "other address");
        assert!(!c.check(b"10.0.0.1:5", &[8u8; 32], &s), "other attempt");
        assert!(
            !Challenger::new().check(b"10.0.0.1:5", &n, &s),
            "other target"
        );
        assert!(!c.check(b"10.0.0.1:5", &n, &[0u8; 32]), "zeros");
        let old = c.at(Challenger::epoch() - 2, b"10.0.0.1:5", &n);
        assert!(!c.check(b"10.0.0.1:5", &n, &old), "expired");
    }
}
