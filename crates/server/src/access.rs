//! Who may do what (docs/PROTOCOL.md §12): the key store, each export's allow list, the admin
//! hosts, the stateless challenger, and the refusal counters and rate-limited log.
//!
//! Control path only (handshakes); the data path never calls in here.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use blkwire_auth::cookie::{address_bytes, Challenger, Purpose, ADDRESS_LEN};
use blkwire_auth::proof;
use blkwire_auth::{Acl, Key, KeyStore, PeerAddr};
use blkwire_wire::{AuthMethod, Hello};

use crate::log::{Level, Throttle};

/// The target's key store, shared by the native handshake (`Access`) and the TLS-PSK callback,
/// and replaced whole when keys are loaded again.
pub type SharedKeys = Arc<RwLock<Option<Arc<KeyStore>>>>;

/// Where a handshake comes from: an address (and port, for the challenge) or a MAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerId {
    /// The address an ACL matches.
    pub addr: PeerAddr,
    /// UDP/TCP source port (0 on Ethernet).
    pub port: u16,
    /// The IPv6 scope id (the interface a link-local address is on; 0 for other addresses):
    /// the same link-local address on two links is two peers to the address challenge and to
    /// a keyless take-over. Allow rules match the address on every link (`Acl::parse`).
    pub scope: u32,
}

impl PeerId {
    /// A TCP or UDP peer.
    pub fn ip(a: SocketAddr) -> PeerId {
        PeerId {
            addr: PeerAddr::Ip(a.ip()),
            port: a.port(),
            scope: match a {
                SocketAddr::V6(v6) => v6.scope_id(),
                SocketAddr::V4(_) => 0,
            },
        }
    }

    /// A raw Ethernet peer.
    pub fn mac(m: [u8; 6]) -> PeerId {
        PeerId {
            addr: PeerAddr::Mac(m),
            port: 0,
            scope: 0,
        }
    }
}

impl std::fmt::Display for PeerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            PeerAddr::Ip(ip @ IpAddr::V4(_)) => write!(f, "{ip}:{}", self.port),
            PeerAddr::Ip(ip) if self.scope != 0 => write!(f, "[{ip}%{}]:{}", self.scope, self.port),
            PeerAddr::Ip(ip) => write!(f, "[{ip}]:{}", self.port),
            PeerAddr::Mac(m) => write!(
                f,
                "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            ),
        }
    }
}

/// A host that proved who it is (method 1), with what the session's keys derive from.
pub struct Proven {
    /// Its host id.
    pub host: String,
    /// Its key.
    pub key: Key,
    /// The transcript hash `T` of its HELLO.
    pub transcript: [u8; proof::LEN],
}

/// What the authentication step of a HELLO decided.
pub enum Checked {
    /// Answer with CHALLENGE and this nonce (§12.1).
    Challenge([u8; proof::LEN]),
    /// Address proven; `Some` when the host also proved its key.
    Passed(Option<Proven>),
    /// Refused with ACCESS; the reason is for the log.
    Refused(String),
}

/// The target's access policy.
pub struct Access {
    /// Replaced whole by `keys_load` (and read by the TLS-PSK callback too): handshakes read
    /// it, the data path never does.
    keys: SharedKeys,
    admins: RwLock<Vec<String>>,
    challenger: Challenger,
    /// HELLOs answered with a challenge.
    pub challenges: AtomicU64,
    /// Handshakes refused for authentication or access rules.
    pub refused: AtomicU64,
    log_limit: Mutex<Throttle>,
    /// HELLO attempts that were answered (`Attempts`).
    attempts: Mutex<Attempts>,
}

/// Most answered HELLO attempts remembered at once (`Attempts`).
const MAX_ATTEMPTS: usize = 16384;

/// The HELLO attempts (peer, `nonce_c`) this target answered with a session or a query's
/// answer, for as long as their challenge is good (§12.1): the same final HELLO sent again, to
/// any listener and over any transport, is refused instead of opening another session. A
/// datagram port answers a retransmission of a HELLO it welcomed from its own cache before
/// asking here; an initiator never sends one attempt to two listeners. Bounded: once
/// `MAX_ATTEMPTS` are remembered the oldest is forgotten first, so a replay gets through only
/// after that many handshakes of others within the challenge's life.
#[derive(Default)]
struct Attempts {
    answered: std::collections::HashSet<(PeerId, [u8; proof::LEN])>,
    /// The same, oldest first, with when each was answered.
    order: std::collections::VecDeque<(std::time::Instant, PeerId, [u8; proof::LEN])>,
}

impl Attempts {
    /// Records `attempt` of `peer` as answered; false if it already was.
    fn claim(
        &mut self,
        peer: &PeerId,
        attempt: &[u8; proof::LEN],
        now: std::time::Instant,
    ) -> bool {
        while let Some(&(at, p, a)) = self.order.front() {
            let expired = now.duration_since(at) > blkwire_auth::cookie::CHALLENGE_LIFE;
            if !expired && self.order.len() < MAX_ATTEMPTS {
                break;
            }
            self.order.pop_front();
            self.answered.remove(&(p, a));
        }
        if !self.answered.insert((*peer, *attempt)) {
            return false;
        }
        self.order.push_back((now, *peer, *attempt));
        true
    }

    /// Forgets `attempt`: it was not answered after all (refused, or BUSY while the queue it
    /// replaces closes, which the initiator asks again with the same HELLO).
    fn release(&mut self, peer: &PeerId, attempt: &[u8; proof::LEN]) {
        if self.answered.remove(&(*peer, *attempt)) {
            if let Some(i) = self
                .order
                .iter()
                .rposition(|&(_, p, a)| (p, a) == (*peer, *attempt))
            {
                self.order.remove(i);
            }
        }
    }
}

impl Access {
    /// A policy with these keys (`None`: open target) and admin hosts (STATS).
    pub fn new(keys: SharedKeys) -> Access {
        Access {
            keys,
            admins: RwLock::new(Vec::new()),
            challenger: Challenger::new(),
            challenges: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            log_limit: Mutex::new(Throttle::new()),
            attempts: Mutex::new(Attempts::default()),
        }
    }

    /// Claims a HELLO attempt that passed its checks for an answer (`Attempts`): false when it
    /// was answered already, a replay.
    pub fn claim_attempt(&self, peer: &PeerId, attempt: &[u8; proof::LEN]) -> bool {
        let mut a = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        a.claim(peer, attempt, std::time::Instant::now())
    }

    /// Gives back a claim whose HELLO got no answer after all.
    pub fn release_attempt(&self, peer: &PeerId, attempt: &[u8; proof::LEN]) {
        let mut a = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        a.release(peer, attempt);
    }

    /// Does this target authenticate hosts?
    pub fn has_keys(&self) -> bool {
        self.keys().is_some()
    }

    /// The key store now (None: an open target).
    pub fn keys(&self) -> Option<Arc<KeyStore>> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the key store (`keys_load`). The caller closes the sessions it no longer
    /// admits (`Registry::revoke_unpermitted`).
    pub fn set_keys(&self, keys: KeyStore) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(keys));
    }

    /// The key a host has now.
    pub fn key_of(&self, host: &str) -> Option<Key> {
        self.keys()?.get(host).cloned()
    }

    /// The hosts allowed to read STATS (`--admin`).
    pub fn admins(&self) -> Vec<String> {
        self.admins
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the admin hosts (`admins_set`); they must be valid host ids and need keys.
    pub fn set_admins(&self, hosts: Vec<String>) -> Result<(), String> {
        if !hosts.is_empty() && !self.has_keys() {
            return Err(
                "admins name hosts, but a host id is only proven with a key: load keys \
                        first (serve --keys FILE, or the keys_load method); without keys anyone \
                        may read STATS"
                    .into(),
            );
        }
        for h in &hosts {
            blkwire_auth::keys::check_host_id(h).map_err(|e| format!("admin '{h}': {e}"))?;
        }
        *self.admins.write().unwrap_or_else(|p| p.into_inner()) = hosts;
        Ok(())
    }

    /// May a host proven as `host` (`None`: unauthenticated) at `addr` use an export with `acl`?
    /// With a key store, only proven hosts may use anything.
    pub fn permits(&self, acl: &Acl, host: Option<&str>, addr: &PeerAddr) -> bool {
        (host.is_some() || !self.has_keys()) && acl.permits(host, addr)
    }

    /// May this host read the STATS document? Anyone on a target without keys (a local demo);
    /// with keys, only proven hosts named by `--admin`.
    pub fn is_admin(&self, host: Option<&str>) -> bool {
        match host {
            _ if !self.has_keys() => true,
            Some(h) => self.admins().iter().any(|a| a == h),
            None => false,
        }
    }

    /// The address step (§12.1): `None` when `peer` answered the challenge for `attempt` (of
    /// a HELLO or a JOIN: `purpose`), else the challenge to send it.
    pub fn address(
        &self,
        peer: &PeerId,
        purpose: Purpose,
        attempt: &[u8; proof::LEN],
        answer: &[u8; proof::LEN],
    ) -> Option<[u8; proof::LEN]> {
        let mut a = [0u8; ADDRESS_LEN];
        let n = address_bytes(&peer.addr, peer.port, peer.scope, &mut a);
        if self.challenger.check(purpose, &a[..n], attempt, answer) {
            return None;
        }
        self.challenges.fetch_add(1, Ordering::Relaxed);
        Some(self.challenger.issue(purpose, &a[..n], attempt))
    }

    /// The challenge and proof steps of a HELLO (§12.1, §12.2), which arrived over a datagram
    /// link (`datagram`) or a stream.
    pub fn check(&self, h: &Hello, peer: &PeerId, datagram: bool) -> Checked {
        if let Some(c) = self.address(peer, Purpose::Hello, &h.auth.nonce_c, &h.auth.nonce_s) {
            return Checked::Challenge(c);
        }
        let host = h.host_id.escape_debug();
        // The initiator says which kind of link it sends on, under its proof: a HELLO relayed
        // from a datagram link to a stream would get an unsealed session the initiator
        // believes sealed. Keyless HELLOs prove nothing, but are held to the same rule.
        if h.auth.datagram != datagram {
            let (said, is) = match datagram {
                true => ("a stream", "a datagram link"),
                false => ("a datagram link", "a stream"),
            };
            return Checked::Refused(format!(
                "host '{host}' sent a HELLO for {said} over {is} (relayed?)"
            ));
        }
        match (h.auth.method, self.keys().as_deref()) {
            (AuthMethod::None, None) => Checked::Passed(None),
            (AuthMethod::None, Some(_)) => Checked::Refused(format!(
                "host '{host}' sent no key proof and this target requires one"
            )),
            (AuthMethod::Psk, None) => Checked::Refused(format!(
                "host '{host}' offered a key but this target has none (serve --keys)"
            )),
            (AuthMethod::Psk, Some(keys)) => {
                let Some(key) = keys.get(&h.host_id) else {
                    return Checked::Refused(format!("unknown host '{host}'"));
                };
                let Ok(t) = h.transcript_bytes().map(|b| proof::transcript(&b)) else {
                    return Checked::Refused(format!("host '{host}': malformed HELLO"));
                };
                if !proof::same(&proof::initiator_proof(key, &t), &h.auth.proof_c) {
                    return Checked::Refused(format!("host '{host}' proved a wrong key"));
                }
                Checked::Passed(Some(Proven {
                    host: h.host_id.clone(),
                    key: key.clone(),
                    transcript: t,
                }))
            }
        }
    }

    /// Counts a refusal and logs it, at most one line per second (with how many were not
    /// logged). `why` must already have peer-supplied strings escaped.
    pub fn refuse(&self, peer: &dyn std::fmt::Display, why: &str) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let said = self
            .log_limit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .hit();
        let Some(n) = said else {
            return;
        };
        let more = if n > 1 {
            format!(" ({} more refusals since the last line)", n - 1)
        } else {
            String::new()
        };
        crate::log!(Level::Warn, "{peer}: refused: {why}{more}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer keeps the scope of a link-local IPv6 address, shown as `SocketAddrV6` shows it;
    /// other addresses have none.
    #[test]
    fn a_link_local_peer_keeps_its_scope() {
        let p = PeerId::ip("[fe80::1%3]:7700".parse().unwrap());
        assert_eq!((p.scope, p.to_string()), (3, "[fe80::1%3]:7700".into()));
        let q = PeerId::ip("[2001:db8::1]:7700".parse().unwrap());
        assert_eq!((q.scope, q.to_string()), (0, "[2001:db8::1]:7700".into()));
        let v4 = PeerId::ip("192.0.2.1:7700".parse().unwrap());
        assert_eq!((v4.scope, v4.to_string()), (0, "192.0.2.1:7700".into()));
        assert_ne!(p, PeerId::ip("[fe80::1%2]:7700".parse().unwrap()));
    }

    /// An answered attempt is remembered for as long as its challenge is good, then
    /// forgotten; at most MAX_ATTEMPTS at once, the oldest forgotten first; a released one at
    /// once. Attempts are per peer (address, port and scope).
    #[test]
    fn answered_attempts_are_remembered_for_the_life_of_a_challenge_and_bounded() {
        use std::time::{Duration, Instant};
        let mut a = Attempts::default();
        let t0 = Instant::now();
        let peer = PeerId::ip("10.0.0.1:5000".parse().unwrap());
        let other = PeerId::ip("10.0.0.1:5001".parse().unwrap());
        assert!(a.claim(&peer, &[1; 32], t0));
        assert!(!a.claim(&peer, &[1; 32], t0), "answered already");
        assert!(a.claim(&other, &[1; 32], t0), "another peer's attempt");
        let life = blkwire_auth::cookie::CHALLENGE_LIFE;
        assert!(!a.claim(&peer, &[1; 32], t0 + life), "still good");
        assert!(a.claim(&peer, &[1; 32], t0 + life + Duration::from_secs(1)));
        a.release(&peer, &[1; 32]);
        assert!(a.claim(&peer, &[1; 32], t0 + life + Duration::from_secs(1)));
        let mut a = Attempts::default();
        for i in 0..MAX_ATTEMPTS as u32 + 1 {
            let mut attempt = [0; 32];
            attempt[..4].copy_from_slice(&i.to_le_bytes());
            assert!(a.claim(&peer, &attempt, t0));
        }
        assert_eq!(
            (a.answered.len(), a.order.len()),
            (MAX_ATTEMPTS, MAX_ATTEMPTS)
        );
        assert!(a.claim(&peer, &[0; 32], t0), "the oldest was forgotten");
        let mut last = [0; 32];
        last[..4].copy_from_slice(&(MAX_ATTEMPTS as u32).to_le_bytes());
        assert!(!a.claim(&peer, &last, t0), "the newest is remembered");
    }
}
