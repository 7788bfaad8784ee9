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
    /// A TCP or UDP peer. An IPv4 peer is one whether it reached a v4 listener or arrived
    /// IPv4-mapped at a dual-stack one (`::ffff:a.b.c.d`), as the allow rules see it: the
    /// address challenge and a keyless take-over see the same peer either way.
    pub fn ip(a: SocketAddr) -> PeerId {
        let addr = canonical_ip(a.ip());
        let scope = match (a, addr) {
            (SocketAddr::V6(v6), IpAddr::V6(_)) => v6.scope_id(),
            _ => 0,
        };
        PeerId {
            addr: PeerAddr::Ip(addr),
            port: a.port(),
            scope,
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

/// A peer's IP address as every limit and rule counts it: an IPv4-mapped IPv6 address (a v4
/// peer at a dual-stack listener) as the IPv4 address it is.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The part of a peer's address that names the host, for limits per host: an IPv4 address,
/// an IPv6 address's /64 (a host on a LAN has all of one to pick addresses from).
pub fn host_prefix(ip: IpAddr) -> IpAddr {
    match canonical_ip(ip) {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
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

/// Times the answer to one HELLO attempt is sent again for its repeats (a retransmission whose
/// answer was lost, or a replay from the sender's address by someone who saw it): past that,
/// repeats are dropped or refused, so a replayed HELLO stops drawing answers (§12.5).
pub const HELLO_ANSWERS: u8 = 8;

/// An attempt: the peer and its HELLO's `nonce_c`, which the address challenge binds.
type AttemptKey = (PeerId, [u8; proof::LEN]);

/// What the target remembers of one answered attempt.
struct Answered {
    /// The claim that made it: a release gives back only its own claim, never a newer one of
    /// the same attempt (after the older was forgotten for room).
    seq: u64,
    /// A new datagram session's welcome and the session, sent again for the attempt's repeats
    /// while that session lasts (a query's answer is not kept: it may be large, and a query
    /// can simply be asked again; nor is a stream's, which cannot lose it).
    welcome: Option<(Vec<u8>, u32)>,
    /// Repeats answered with `welcome`.
    repeats: u8,
}

/// The HELLO attempts this target answered with a session or a query's answer, for as long as
/// their challenge is good (§12.1), whichever listener or transport they came by: the same
/// final HELLO again opens no second session. A session's welcome is sent again, at most
/// `HELLO_ANSWERS` times while its session lasts (a datagram port answers retransmissions from
/// its own cache first, but may have pushed the attempt out of it); anything else is refused.
/// Bounded: at most `MAX_ATTEMPTS` (with a welcome, a HELLO reply of about 100 bytes, each:
/// some 6 to 8 MiB in all, outside the memory budget but fixed), the oldest forgotten first,
/// so a replay gets through only after that many handshakes of others within the challenge's
/// life.
#[derive(Default)]
struct Attempts {
    answered: std::collections::HashMap<AttemptKey, Answered>,
    /// Their claims, oldest first, with when each was made.
    order: std::collections::VecDeque<(std::time::Instant, u64, AttemptKey)>,
    next: u64,
}

/// What a claim on an attempt found.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// Not answered before: answer it, then `welcomed` or `release_attempt` with this claim.
    New(u64),
    /// Answered before: send this welcome again if its session (the `u32`) still lasts, or
    /// refuse if there is none (a query's, a stream's, or repeated too often).
    Answered(Option<(Vec<u8>, u32)>),
}

impl Attempts {
    fn claim(&mut self, key: AttemptKey, now: std::time::Instant) -> Claim {
        while let Some(&(at, seq, k)) = self.order.front() {
            let expired = now.duration_since(at) > blkwire_auth::cookie::CHALLENGE_LIFE;
            if !expired && self.order.len() < MAX_ATTEMPTS {
                break;
            }
            self.order.pop_front();
            if self.answered.get(&k).is_some_and(|a| a.seq == seq) {
                self.answered.remove(&k);
            }
        }
        if let Some(a) = self.answered.get_mut(&key) {
            let again = a.welcome.clone().filter(|_| a.repeats < HELLO_ANSWERS);
            a.repeats += u8::from(again.is_some());
            return Claim::Answered(again);
        }
        let seq = self.next;
        self.next += 1;
        let a = Answered {
            seq,
            welcome: None,
            repeats: 0,
        };
        self.answered.insert(key, a);
        self.order.push_back((now, seq, key));
        Claim::New(seq)
    }

    /// Claim `seq` of `key` opened datagram session `session`, welcomed with `reply`.
    fn welcomed(&mut self, key: AttemptKey, seq: u64, reply: &[u8], session: u32) {
        if let Some(a) = self.answered.get_mut(&key).filter(|a| a.seq == seq) {
            a.welcome = Some((reply.to_vec(), session));
        }
    }

    /// Claim `seq` of `key` got no answer after all (refused, or BUSY while the queue it
    /// replaces closes): a repeat of the HELLO (its refusal was lost) is answered afresh.
    fn release(&mut self, key: AttemptKey, seq: u64) {
        if self.answered.get(&key).is_some_and(|a| a.seq == seq) {
            self.answered.remove(&key);
            if let Some(i) = self.order.iter().rposition(|&(_, s, _)| s == seq) {
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

    /// Claims a HELLO attempt that passed its checks for an answer (`Attempts`).
    pub fn claim_attempt(&self, peer: &PeerId, attempt: &[u8; proof::LEN]) -> Claim {
        self.attempts()
            .claim((*peer, *attempt), std::time::Instant::now())
    }

    /// Claim `seq` (`Claim::New`) of this attempt opened datagram session `session`, welcomed
    /// with `reply`.
    pub fn attempt_welcomed(
        &self,
        (peer, attempt): (&PeerId, &[u8; proof::LEN]),
        seq: u64,
        reply: &[u8],
        session: u32,
    ) {
        self.attempts()
            .welcomed((*peer, *attempt), seq, reply, session);
    }

    /// Gives back claim `seq` of this attempt: its HELLO got no answer after all.
    pub fn release_attempt(&self, peer: &PeerId, attempt: &[u8; proof::LEN], seq: u64) {
        self.attempts().release((*peer, *attempt), seq);
    }

    fn attempts(&self) -> std::sync::MutexGuard<'_, Attempts> {
        self.attempts.lock().unwrap_or_else(|p| p.into_inner())
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
        // Not refused (keys may be loaded later), but most likely a typo.
        if let Some(keys) = self.keys() {
            for h in hosts.iter().filter(|h| keys.get(h).is_none()) {
                crate::log!(
                    crate::log::Level::Warn,
                    "admin '{}' has no key in the key store: it cannot read STATS until one \
                     is added",
                    h.escape_debug()
                );
            }
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
        let mapped = PeerId::ip("[::ffff:192.0.2.1]:7700".parse().unwrap());
        assert_eq!(mapped, v4, "IPv4-mapped is IPv4");
        // As the connection and controller limits count them.
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(canonical_ip(ip("::ffff:192.0.2.1")), ip("192.0.2.1"));
        assert_eq!(canonical_ip(ip("2001:db8::1")), ip("2001:db8::1"));
        assert_eq!(canonical_ip(ip("192.0.2.1")), ip("192.0.2.1"));
    }

    /// Attempt `i` of a run: its number, then `fill`.
    fn numbered(i: u32, fill: u8) -> [u8; 32] {
        let mut attempt = [fill; 32];
        attempt[..4].copy_from_slice(&i.to_le_bytes());
        attempt
    }

    /// An answered attempt is remembered for as long as its challenge is good, then
    /// forgotten; at most MAX_ATTEMPTS at once, the oldest forgotten first; a released one at
    /// once. Attempts are per peer (address, port and scope).
    #[test]
    fn answered_attempts_are_remembered_for_the_life_of_a_challenge_and_bounded() {
        use std::time::{Duration, Instant};
        let new = |c: Claim| matches!(c, Claim::New(_));
        let mut a = Attempts::default();
        let t0 = Instant::now();
        let peer = PeerId::ip("10.0.0.1:5000".parse().unwrap());
        let other = PeerId::ip("10.0.0.1:5001".parse().unwrap());
        assert!(new(a.claim((peer, [1; 32]), t0)));
        assert!(!new(a.claim((peer, [1; 32]), t0)), "answered already");
        assert!(new(a.claim((other, [1; 32]), t0)), "another peer's attempt");
        let life = blkwire_auth::cookie::CHALLENGE_LIFE;
        assert!(!new(a.claim((peer, [1; 32]), t0 + life)), "still good");
        let later = t0 + life + Duration::from_secs(1);
        let Claim::New(seq) = a.claim((peer, [1; 32]), later) else {
            panic!("forgotten once its challenge is no longer good");
        };
        a.release((peer, [1; 32]), seq);
        assert!(new(a.claim((peer, [1; 32]), later)), "released");
        let mut a = Attempts::default();
        for i in 0..MAX_ATTEMPTS as u32 + 1 {
            assert!(new(a.claim((peer, numbered(i, 0)), t0)));
        }
        assert_eq!(
            (a.answered.len(), a.order.len()),
            (MAX_ATTEMPTS, MAX_ATTEMPTS)
        );
        assert!(
            new(a.claim((peer, [0; 32]), t0)),
            "the oldest was forgotten"
        );
        let last = numbered(MAX_ATTEMPTS as u32, 0);
        assert!(!new(a.claim((peer, last), t0)), "the newest is remembered");
    }

    /// A session's welcome is sent again for its attempt's repeats, HELLO_ANSWERS times, then
    /// they are refused; a query's answer is not kept, so its repeats are refused at once.
    #[test]
    fn a_welcome_is_sent_again_a_few_times_then_refused() {
        let now = std::time::Instant::now();
        let peer = PeerId::ip("10.0.0.1:5000".parse().unwrap());
        let mut a = Attempts::default();
        let Claim::New(seq) = a.claim((peer, [1; 32]), now) else {
            panic!("a new attempt");
        };
        a.welcomed((peer, [1; 32]), seq, b"welcome", 7);
        for _ in 0..HELLO_ANSWERS {
            assert_eq!(
                a.claim((peer, [1; 32]), now),
                Claim::Answered(Some((b"welcome".to_vec(), 7)))
            );
        }
        assert_eq!(a.claim((peer, [1; 32]), now), Claim::Answered(None));
        let Claim::New(_) = a.claim((peer, [2; 32]), now) else {
            panic!("a new attempt");
        };
        assert_eq!(
            a.claim((peer, [2; 32]), now),
            Claim::Answered(None),
            "a query's"
        );
    }

    /// A claim forgotten for room and made again by a replay is not given back by the first
    /// claim's release (its HELLO refused BUSY meanwhile): the replay's record stays.
    #[test]
    fn a_release_gives_back_only_its_own_claim() {
        let now = std::time::Instant::now();
        let peer = PeerId::ip("10.0.0.1:5000".parse().unwrap());
        let mut a = Attempts::default();
        let Claim::New(first) = a.claim((peer, [1; 32]), now) else {
            panic!("a new attempt");
        };
        for i in 0..MAX_ATTEMPTS as u32 {
            a.claim((peer, numbered(i, 9)), now);
        }
        let Claim::New(second) = a.claim((peer, [1; 32]), now) else {
            panic!("forgotten for room");
        };
        assert_ne!(first, second);
        a.release((peer, [1; 32]), first);
        assert_eq!(a.claim((peer, [1; 32]), now), Claim::Answered(None));
        assert_eq!(a.answered.len(), a.order.len());
    }
}
