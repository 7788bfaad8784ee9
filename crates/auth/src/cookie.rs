//! The target's stateless challenge (docs/PROTOCOL.md §12.1): a nonce only this target could
//! have issued to this address for this attempt, recomputed instead of remembered, so a flood
//! of first HELLOs costs the target nothing but the 80-byte answers.

use std::time::Instant;

use ring::hmac;

use crate::proof::LEN;

/// Seconds per epoch; a challenge is good for one to two of them.
const EPOCH_SECS: u64 = 30;

/// The longest a challenge is good for (issued at the start of an epoch, taken to the end of
/// the next): what remembers an answered attempt must remember it this long.
pub const CHALLENGE_LIFE: std::time::Duration = std::time::Duration::from_secs(2 * EPOCH_SECS);

/// What a challenge is for. Both kinds share one secret, and an attempt is whatever the
/// initiator sends (a HELLO's `nonce_c` is its own choice): hashed in, the purpose keeps a
/// challenge issued for one from ever answering the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A HELLO; the attempt is its `nonce_c`.
    Hello = 1,
    /// A datagram JOIN; the attempt is its session, queue and cookie.
    Join = 2,
}

/// Issues and checks challenge nonces.
pub struct Challenger {
    key: hmac::Key,
    /// Epochs count from here, on the monotonic clock: a wall clock stepped back would make
    /// an old challenge good again, after whatever remembers its answered attempts for a
    /// challenge's life (`CHALLENGE_LIFE`) had forgotten them. The secret is this process's
    /// own, so nothing else needs the epochs to be wall-clock time.
    start: Instant,
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
            start: Instant::now(),
        }
    }

    /// The epoch now: 1 for the first EPOCH_SECS, so the one before it is still a number.
    fn epoch(&self) -> u64 {
        1 + self.start.elapsed().as_secs() / EPOCH_SECS
    }

    fn at(&self, epoch: u64, purpose: Purpose, address: &[u8], nonce_c: &[u8; LEN]) -> [u8; LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(&epoch.to_le_bytes());
        ctx.update(&[purpose as u8, address.len() as u8]);
        ctx.update(address);
        ctx.update(nonce_c);
        ctx.sign().as_ref().try_into().expect("32 bytes")
    }

    /// The nonce to send `address` for an attempt named by `nonce_c`.
    pub fn issue(&self, purpose: Purpose, address: &[u8], nonce_c: &[u8; LEN]) -> [u8; LEN] {
        self.at(self.epoch(), purpose, address, nonce_c)
    }

    /// Did this target issue `nonce_s` to `address` for `nonce_c`, this epoch or the last?
    pub fn check(
        &self,
        purpose: Purpose,
        address: &[u8],
        nonce_c: &[u8; LEN],
        nonce_s: &[u8; LEN],
    ) -> bool {
        self.check_in(self.epoch(), purpose, (address, nonce_c), nonce_s)
    }

    /// [`Challenger::check`] in epoch `now`.
    fn check_in(
        &self,
        now: u64,
        purpose: Purpose,
        (address, nonce_c): (&[u8], &[u8; LEN]),
        nonce_s: &[u8; LEN],
    ) -> bool {
        [now, now.saturating_sub(1)]
            .iter()
            .any(|e| crate::proof::same(&self.at(*e, purpose, address, nonce_c), nonce_s))
    }
}

/// Most bytes [`address_bytes`] writes.
pub const ADDRESS_LEN: usize = 23;

/// The bytes that name an address in a challenge: a kind byte, then IP and port (and for IPv6
/// the scope, the interface index of a link-local address: `fe80::1` on two links is two
/// addresses, and a challenge received at one must not answer for the other), or a MAC.
/// The kind byte matters: an IPv4 address and port are 6 bytes, as a MAC is, so without it a
/// challenge fetched on Ethernet from a forged MAC `a.b.c.d || port` would answer a UDP HELLO
/// forged from `a.b.c.d:port`, an address the forger never received at.
pub fn address_bytes(
    addr: &crate::PeerAddr,
    port: u16,
    scope: u32,
    out: &mut [u8; ADDRESS_LEN],
) -> usize {
    match addr {
        crate::PeerAddr::Ip(std::net::IpAddr::V4(v4)) => {
            out[0] = 4;
            out[1..5].copy_from_slice(&v4.octets());
            out[5..7].copy_from_slice(&port.to_le_bytes());
            7
        }
        crate::PeerAddr::Ip(std::net::IpAddr::V6(v6)) => {
            out[0] = 6;
            out[1..17].copy_from_slice(&v6.octets());
            out[17..19].copy_from_slice(&port.to_le_bytes());
            out[19..23].copy_from_slice(&scope.to_le_bytes());
            23
        }
        crate::PeerAddr::Mac(m) => {
            out[0] = b'M';
            out[1..7].copy_from_slice(m);
            7
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HELLO: Purpose = Purpose::Hello;

    #[test]
    fn challenges_check_only_for_the_same_address_attempt_and_target() {
        let c = Challenger::new();
        let n = [9u8; 32];
        let s = c.issue(HELLO, b"10.0.0.1:5", &n);
        assert!(c.check(HELLO, b"10.0.0.1:5", &n, &s));
        assert!(!c.check(HELLO, b"10.0.0.2:5", &n, &s), "other address");
        assert!(
            !c.check(HELLO, b"10.0.0.1:5", &[8u8; 32], &s),
            "other attempt"
        );
        assert!(
            !Challenger::new().check(HELLO, b"10.0.0.1:5", &n, &s),
            "other target"
        );
        assert!(!c.check(HELLO, b"10.0.0.1:5", &n, &[0u8; 32]), "zeros");
        // A challenge of epoch 2 is good in epochs 2 and 3, not in 4.
        let a = (&b"10.0.0.1:5"[..], &n);
        let issued = c.at(2, HELLO, a.0, a.1);
        assert!(c.check_in(2, HELLO, a, &issued) && c.check_in(3, HELLO, a, &issued));
        assert!(!c.check_in(4, HELLO, a, &issued), "expired");
        // Epochs count from the challenger's start, on the monotonic clock.
        assert_eq!(c.epoch(), 1);
    }

    fn bytes(addr: crate::PeerAddr, port: u16) -> Vec<u8> {
        scoped(addr, port, 0)
    }

    fn scoped(addr: crate::PeerAddr, port: u16, scope: u32) -> Vec<u8> {
        let mut a = [0u8; ADDRESS_LEN];
        let n = address_bytes(&addr, port, scope, &mut a);
        a[..n].to_vec()
    }

    /// A link-local IPv6 address is an address on its link: `fe80::1` port 7737 on interface
    /// 2 and on interface 3 are two addresses, and a challenge one received does not answer a
    /// HELLO forged from the other.
    #[test]
    fn the_same_link_local_address_on_two_links_is_two_addresses() {
        let c = Challenger::new();
        let n = [9u8; 32];
        let fe80: std::net::IpAddr = "fe80::1".parse().unwrap();
        let (a, b) = (
            scoped(crate::PeerAddr::Ip(fe80), 7737, 2),
            scoped(crate::PeerAddr::Ip(fe80), 7737, 3),
        );
        let s = c.issue(HELLO, &a, &n);
        assert!(c.check(HELLO, &a, &n, &s));
        assert!(!c.check(HELLO, &b, &n, &s), "taken on another link");
    }

    /// A MAC whose six bytes are an IPv4 address and a port (little-endian) names another
    /// address than that IP and port: a challenge a forger fetched on Ethernet with such a
    /// MAC does not answer a UDP HELLO forged from the IP address.
    #[test]
    fn a_mac_and_an_ipv4_address_of_the_same_bytes_are_different_addresses() {
        let c = Challenger::new();
        let n = [9u8; 32];
        let mac = bytes(crate::PeerAddr::Mac([10, 0, 0, 1, 0x39, 0x1e]), 0);
        let ip = bytes(crate::PeerAddr::Ip([10, 0, 0, 1].into()), 7737);
        let s = c.issue(HELLO, &mac, &n);
        assert!(c.check(HELLO, &mac, &n, &s));
        assert!(!c.check(HELLO, &ip, &n, &s), "MAC challenge taken for UDP");
        let s = c.issue(HELLO, &ip, &n);
        assert!(!c.check(HELLO, &mac, &n, &s), "UDP challenge taken for MAC");
    }

    /// A HELLO's attempt is the initiator's choice: one equal to a JOIN's attempt still gets a
    /// challenge that does not answer the JOIN, nor the other way round.
    #[test]
    fn hello_and_join_challenges_do_not_answer_each_other() {
        let c = Challenger::new();
        let (a, n) = (b"10.0.0.1:5", [9u8; 32]);
        let s = c.issue(Purpose::Hello, a, &n);
        assert!(!c.check(Purpose::Join, a, &n, &s));
        let s = c.issue(Purpose::Join, a, &n);
        assert!(!c.check(Purpose::Hello, a, &n, &s));
        assert!(c.check(Purpose::Join, a, &n, &s));
    }
}
