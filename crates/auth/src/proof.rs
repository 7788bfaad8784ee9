//! The handshake's proofs and the keys derived from them (docs/PROTOCOL.md §12.2).

use ring::{digest, hkdf, hmac};

use crate::Key;

/// Bytes of a nonce, a proof and a transcript hash.
pub const LEN: usize = 32;

/// `T`: SHA-256 of the second HELLO's payload with its proof zeroed (§12.2).
pub fn transcript(hello_payload_without_proof: &[u8]) -> [u8; LEN] {
    let d = digest::digest(&digest::SHA256, hello_payload_without_proof);
    d.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; LEN] {
    let k = hmac::Key::new(hmac::HMAC_SHA256, key);
    let mut ctx = hmac::Context::with_key(&k);
    for p in parts {
        ctx.update(p);
    }
    ctx.sign()
        .as_ref()
        .try_into()
        .expect("HMAC-SHA-256 is 32 bytes")
}

/// Constant-time comparison (a proof compared byte by byte with an early exit would tell an
/// attacker how many leading bytes of a guess are right).
pub fn same(a: &[u8; LEN], b: &[u8; LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `proof_c`: the initiator's proof that it holds `key`.
pub fn initiator_proof(key: &Key, t: &[u8; LEN]) -> [u8; LEN] {
    mac(key.bytes(), &[b"blkwire-v1 initiator", t])
}

/// `target_proof`: the target's proof that it holds `key`, bound to what it answered.
pub fn target_proof(key: &Key, t: &[u8; LEN], reply_without_proof: &[u8]) -> [u8; LEN] {
    mac(key.bytes(), &[b"blkwire-v1 target", t, reply_without_proof])
}

/// Which way a frame travels (the frame keys differ, so a frame can never be reflected back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Initiator to target (requests).
    ToTarget = 0,
    /// Target to initiator (replies).
    ToInitiator = 1,
}

/// What both ends derive from a method-1 handshake: the root of every key of the session.
pub struct SessionSecret {
    prk: hkdf::Prk,
    t: [u8; LEN],
}

struct Len32;

impl hkdf::KeyType for Len32 {
    fn len(&self) -> usize {
        LEN
    }
}

impl SessionSecret {
    /// `PRK = HKDF-Extract(nonce_c || nonce_s, K)`, kept with the transcript `T`.
    pub fn derive(
        key: &Key,
        nonce_c: &[u8; LEN],
        nonce_s: &[u8; LEN],
        t: &[u8; LEN],
    ) -> SessionSecret {
        let mut salt = [0u8; 2 * LEN];
        salt[..LEN].copy_from_slice(nonce_c);
        salt[LEN..].copy_from_slice(nonce_s);
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(key.bytes());
        SessionSecret { prk, t: *t }
    }

    fn expand(&self, info: &[&[u8]]) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        self.prk
            .expand(info, Len32)
            .and_then(|okm| okm.fill(&mut out))
            .expect("32 bytes is a valid HKDF-SHA-256 output length");
        out
    }

    /// The AES-256-GCM key of one queue and direction.
    pub fn frame_key(&self, session: u32, queue: u16, dir: Direction) -> [u8; LEN] {
        self.expand(&[
            b"blkwire-v1 frames",
            &self.t,
            &session.to_le_bytes(),
            &queue.to_le_bytes(),
            &[dir as u8],
        ])
    }

    /// The proof a JOIN for `queue` carries after the cookie.
    pub fn join_proof(&self, session: u32, queue: u16, cookie: u64) -> [u8; LEN] {
        let k = self.expand(&[b"blkwire-v1 join", &self.t]);
        mac(
            &k,
            &[
                &session.to_le_bytes(),
                &queue.to_le_bytes(),
                &cookie.to_le_bytes(),
            ],
        )
    }
}

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> Key {
        Key::new(&[b; 32]).unwrap()
    }

    #[test]
    fn proofs_depend_on_key_transcript_and_role() {
        let t = transcript(b"hello");
        let p = initiator_proof(&key(1), &t);
        assert_eq!(p, initiator_proof(&key(1), &t), "deterministic");
        assert_ne!(p, initiator_proof(&key(2), &t), "key");
        assert_ne!(
            p,
            initiator_proof(&key(1), &transcript(b"hellp")),
            "transcript"
        );
        assert_ne!(p, target_proof(&key(1), &t, b""), "role");
        assert_ne!(
            target_proof(&key(1), &t, b"a"),
            target_proof(&key(1), &t, b"b")
        );
        assert!(same(&p, &p.clone()));
        let mut q = p;
        q[31] ^= 1;
        assert!(!same(&p, &q));
    }

    #[test]
    fn both_ends_derive_the_same_keys_and_every_key_differs() {
        let (nc, ns, t) = ([1u8; 32], [2u8; 32], transcript(b"x"));
        let a = SessionSecret::derive(&key(7), &nc, &ns, &t);
        let b = SessionSecret::derive(&key(7), &nc, &ns, &t);
        let k = a.frame_key(5, 0, Direction::ToTarget);
        assert_eq!(k, b.frame_key(5, 0, Direction::ToTarget));
        assert_ne!(k, a.frame_key(5, 0, Direction::ToInitiator));
        assert_ne!(k, a.frame_key(5, 1, Direction::ToTarget));
        assert_ne!(k, a.frame_key(6, 0, Direction::ToTarget));
        let other = SessionSecret::derive(&key(7), &nc, &[3u8; 32], &t);
        assert_ne!(k, other.frame_key(5, 0, Direction::ToTarget), "nonces");
        assert_eq!(a.join_proof(5, 1, 9), b.join_proof(5, 1, 9));
        assert_ne!(a.join_proof(5, 1, 9), a.join_proof(5, 2, 9));
    }
}
