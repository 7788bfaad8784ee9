//! Sealed datagram frames (docs/PROTOCOL.md §12.4): AES-256-GCM over each frame, keyed per
//! session, queue and direction, with a 64-bit sequence number as nonce and a replay window.
//!
//! A sealed frame is `header || payload || seq (u64) || tag (16)`. Without encryption the
//! header and payload are the additional data and the payload stays readable (GMAC, NIST SP
//! 800-38D: AES-GCM with an empty plaintext); with it the payload is encrypted in place. Each
//! `Sealer`/`Opener` belongs to one queue's owner thread: no locks, no allocation per frame.
//!
//! Two libraries, by measurement (docs/BENCHMARKS.md, "Authentication"): `ring`'s fused
//! AES-GCM encrypts a 4 KiB payload in about 0.55 us here, but it hashes additional data with a
//! slower GHASH (2.3 us for the same 4 KiB, 3.5 us to verify), so authentication-only frames
//! with a payload use OpenSSL's GMAC (0.75 us), whose GHASH is the aggregated one; header-only
//! frames (requests, most replies) stay with `ring`, whose call costs a quarter of OpenSSL's.
//! Both compute the same AES-256-GCM tag on the same keys and nonces.

use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;
use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey};

/// Bytes a seal adds after the payload.
pub const TRAILER: usize = 24;
/// How far behind the newest accepted frame an older one may still arrive (frames).
pub const REPLAY_WINDOW: u64 = 1024;

fn key(bytes: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&aead::AES_256_GCM, bytes).expect("a 32-byte AES-256-GCM key"))
}

fn nonce_bytes(seq: u64) -> [u8; aead::NONCE_LEN] {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..].copy_from_slice(&seq.to_le_bytes());
    n
}

fn nonce(seq: u64) -> Nonce {
    Nonce::assume_unique_for_key(nonce_bytes(seq))
}

/// How a frame is sealed: GMAC over header and payload, or AEAD encryption of the payload.
enum Engine {
    Gmac { ctx: CipherCtx, small: LessSafeKey },
    Aead(LessSafeKey),
}

/// Frames up to this many bytes are authenticated by `ring` (cheaper call), longer ones by
/// OpenSSL (faster hashing): measured crossover on this machine's AES-NI/VPCLMULQDQ.
const SMALL_FRAME: usize = 512;

impl Engine {
    fn new(key_bytes: &[u8; 32], encrypt: bool, sealing: bool) -> Engine {
        if encrypt {
            return Engine::Aead(key(key_bytes));
        }
        let mut ctx = CipherCtx::new().expect("OpenSSL cipher context");
        let r = if sealing {
            ctx.encrypt_init(Some(Cipher::aes_256_gcm()), Some(key_bytes), None)
        } else {
            ctx.decrypt_init(Some(Cipher::aes_256_gcm()), Some(key_bytes), None)
        };
        r.expect("AES-256-GCM with a 32-byte key");
        Engine::Gmac {
            ctx,
            small: key(key_bytes),
        }
    }
}

/// GMAC of `data` under nonce `seq` (the context keeps its key; only the nonce changes).
fn gmac(ctx: &mut CipherCtx, seq: u64, data: &[u8], tag: &mut [u8; 16]) {
    ctx.encrypt_init(None, None, Some(&nonce_bytes(seq)))
        .and_then(|_| ctx.cipher_update(data, None))
        .and_then(|_| ctx.cipher_final(&mut []))
        .and_then(|_| ctx.tag(tag))
        .expect("GMAC over a frame");
}

/// Checks a GMAC: false when the tag does not verify.
fn gmac_verify(ctx: &mut CipherCtx, seq: u64, data: &[u8], tag: &[u8; 16]) -> bool {
    ctx.decrypt_init(None, None, Some(&nonce_bytes(seq)))
        .and_then(|_| ctx.cipher_update(data, None))
        .and_then(|_| ctx.set_tag(tag))
        .and_then(|_| ctx.cipher_final(&mut []))
        .is_ok()
}

/// Seals the frames one queue sends in one direction.
pub struct Sealer {
    engine: Engine,
    seq: u64,
}

impl Sealer {
    /// A sealer for frame key `key`; `encrypt` hides payloads too.
    pub fn new(key_bytes: &[u8; 32], encrypt: bool) -> Sealer {
        Sealer {
            engine: Engine::new(key_bytes, encrypt, true),
            seq: 0,
        }
    }

    /// Seals `frame` = header (`header_len` bytes, already carrying the SEALED flag and a zero
    /// CRC) || payload || `TRAILER` bytes of room, in place.
    pub fn seal(&mut self, frame: &mut [u8], header_len: usize) {
        let body = frame.len() - TRAILER;
        // Never wraps: 2^64 frames is centuries at any rate a NIC can carry.
        self.seq += 1;
        let (data, trailer) = frame.split_at_mut(body);
        let mut tag = [0u8; 16];
        match &mut self.engine {
            Engine::Aead(key) => {
                let (h, p) = data.split_at_mut(header_len);
                let t = key
                    .seal_in_place_separate_tag(nonce(self.seq), Aad::from(&*h), p)
                    .expect("frames are far below AES-GCM's length limit");
                tag.copy_from_slice(t.as_ref());
            }
            Engine::Gmac { small, .. } if data.len() <= SMALL_FRAME => {
                let t = small
                    .seal_in_place_separate_tag(nonce(self.seq), Aad::from(&*data), &mut [])
                    .expect("frames are far below AES-GCM's length limit");
                tag.copy_from_slice(t.as_ref());
            }
            Engine::Gmac { ctx, .. } => gmac(ctx, self.seq, data, &mut tag),
        }
        trailer[..8].copy_from_slice(&self.seq.to_le_bytes());
        trailer[8..].copy_from_slice(&tag);
    }
}

/// Checks (and, when encrypted, decrypts) the frames one queue receives in one direction.
pub struct Opener {
    engine: Engine,
    highest: u64,
    seen: [u64; (REPLAY_WINDOW / 64) as usize],
}

/// Why a sealed frame was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Shorter than a header and a trailer.
    Short,
    /// Seen already, or too old to tell.
    Replayed,
    /// The tag does not verify: forged, corrupted, or sealed under another key.
    Forged,
}

impl Opener {
    /// An opener for frame key `key`; `encrypt` as the sender's.
    pub fn new(key_bytes: &[u8; 32], encrypt: bool) -> Opener {
        Opener {
            engine: Engine::new(key_bytes, encrypt, false),
            highest: 0,
            seen: [0; (REPLAY_WINDOW / 64) as usize],
        }
    }

    fn bit(seq: u64) -> (usize, u64) {
        let i = seq % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    fn fresh(&self, seq: u64) -> bool {
        if seq > self.highest {
            return true;
        }
        // Written as a difference: a hostile seq near u64::MAX must not overflow a sum.
        if seq == 0 || self.highest - seq >= REPLAY_WINDOW {
            return false;
        }
        let (w, b) = Self::bit(seq);
        self.seen[w] & b == 0
    }

    fn accept(&mut self, seq: u64) {
        if seq > self.highest {
            if seq - self.highest >= REPLAY_WINDOW {
                self.seen = [0; (REPLAY_WINDOW / 64) as usize];
            } else {
                for s in self.highest + 1..seq {
                    let (w, b) = Self::bit(s);
                    self.seen[w] &= !b;
                }
            }
            self.highest = seq;
        }
        let (w, b) = Self::bit(seq);
        self.seen[w] |= b;
    }

    /// From now on refuses every sequence number up to the highest opened, seen or not: frames
    /// sealed before that one under this key, but opened by another opener (a datagram queue's
    /// JOINs before the one that admitted it, each checked by an opener of its own attempt),
    /// must not open here later as if new.
    pub fn refuse_older(&mut self) {
        self.seen = [u64::MAX; (REPLAY_WINDOW / 64) as usize];
    }

    /// Opens a sealed `frame` (header || payload || trailer) and returns its payload: the
    /// frame's own bytes when only authenticated, or the plaintext written into `scratch`
    /// (which must hold the payload) when encrypted. Nothing is accepted unless it verifies.
    pub fn open<'a>(
        &mut self,
        frame: &'a [u8],
        header_len: usize,
        scratch: &'a mut [u8],
    ) -> Result<&'a [u8], Refused> {
        if frame.len() < header_len + TRAILER {
            return Err(Refused::Short);
        }
        let body = frame.len() - TRAILER;
        let seq = u64::from_le_bytes(frame[body..body + 8].try_into().expect("8"));
        if !self.fresh(seq) {
            return Err(Refused::Replayed);
        }
        let tag: [u8; 16] = frame[body + 8..].try_into().expect("16");
        let (header, payload) = frame[..body].split_at(header_len);
        let out: &'a [u8] = match &mut self.engine {
            Engine::Aead(key) => {
                let out = scratch.get_mut(..payload.len()).ok_or(Refused::Short)?;
                out.copy_from_slice(payload);
                key.open_in_place_separate_tag(
                    nonce(seq),
                    Aad::from(header),
                    Tag::from(tag),
                    out,
                    0..,
                )
                .map_err(|_| Refused::Forged)?;
                out
            }
            Engine::Gmac { small, .. } if body <= SMALL_FRAME => {
                small
                    .open_in_place_separate_tag(
                        nonce(seq),
                        Aad::from(&frame[..body]),
                        Tag::from(tag),
                        &mut [],
                        0..,
                    )
                    .map_err(|_| Refused::Forged)?;
                payload
            }
            Engine::Gmac { ctx, .. } => {
                if !gmac_verify(ctx, seq, &frame[..body], &tag) {
                    return Err(Refused::Forged);
                }
                payload
            }
        };
        self.accept(seq);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: usize = 48;

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![7u8; H];
        f.extend_from_slice(payload);
        f.extend_from_slice(&[0u8; TRAILER]);
        f
    }

    /// `n` frames of one byte sealed by `s`, one sequence number after the other.
    fn sealed(s: &mut Sealer, n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|_| {
                let mut f = frame(b"x");
                s.seal(&mut f, H);
                f
            })
            .collect()
    }

    #[test]
    fn round_trip_authenticated_and_encrypted() {
        for encrypt in [false, true] {
            let k = [5u8; 32];
            let (mut s, mut o) = (Sealer::new(&k, encrypt), Opener::new(&k, encrypt));
            let mut f = frame(b"block data");
            s.seal(&mut f, H);
            assert_eq!(
                &f[H..H + 10] == b"block data",
                !encrypt,
                "encrypt={encrypt}"
            );
            let mut scratch = [0u8; 64];
            assert_eq!(o.open(&f, H, &mut scratch).unwrap(), b"block data");
        }
    }

    /// The two GMAC paths (ring for short frames, OpenSSL for long ones) compute the same tag:
    /// a frame sealed by either opens with the other.
    #[test]
    fn both_gmac_paths_agree() {
        let k = [3u8; 32];
        let mut s = Sealer::new(&k, false);
        let mut f = frame(&[9u8; 1000]);
        s.seal(&mut f, H);
        let small = match Engine::new(&k, false, true) {
            Engine::Gmac { small, .. } => small,
            Engine::Aead(_) => unreachable!(),
        };
        let body = f.len() - TRAILER;
        let t = small
            .seal_in_place_separate_tag(nonce(1), Aad::from(&f[..body]), &mut [])
            .unwrap();
        assert_eq!(t.as_ref(), &f[body + 8..], "ring and OpenSSL GMAC differ");
    }

    #[test]
    fn forged_replayed_and_foreign_frames_are_refused() {
        let k = [5u8; 32];
        let mut s = Sealer::new(&k, false);
        let mut o = Opener::new(&k, false);
        let mut scratch = [0u8; 64];
        let mut f = frame(b"abc");
        s.seal(&mut f, H);
        for i in [0, H, H + 2, f.len() - 1] {
            let mut bad = f.clone();
            bad[i] ^= 1;
            assert!(o.open(&bad, H, &mut scratch).is_err(), "byte {i} flipped");
        }
        assert!(o.open(&f, H, &mut scratch).is_ok());
        assert_eq!(o.open(&f, H, &mut scratch), Err(Refused::Replayed));
        let mut other = Opener::new(&[6u8; 32], false);
        let mut g = frame(b"abc");
        s.seal(&mut g, H);
        assert_eq!(other.open(&g, H, &mut scratch), Err(Refused::Forged));
        assert!(
            o.open(&g, H, &mut scratch).is_ok(),
            "a refused forgery does not burn the seq"
        );
        assert_eq!(
            o.open(&frame(b"abc"), H, &mut scratch),
            Err(Refused::Replayed),
            "seq 0"
        );
    }

    /// After `refuse_older`, nothing at or below the highest number opened opens (however
    /// late it comes, seen or not); what comes after does.
    #[test]
    fn refuse_older_refuses_every_number_up_to_the_highest() {
        let k = [2u8; 32];
        let mut s = Sealer::new(&k, false);
        let mut o = Opener::new(&k, false);
        let mut scratch = [0u8; 8];
        let frames = sealed(&mut s, 4);
        assert!(o.open(&frames[1], H, &mut scratch).is_ok());
        o.refuse_older();
        assert_eq!(o.open(&frames[0], H, &mut scratch), Err(Refused::Replayed));
        assert_eq!(o.open(&frames[1], H, &mut scratch), Err(Refused::Replayed));
        assert!(o.open(&frames[3], H, &mut scratch).is_ok());
        assert!(
            o.open(&frames[2], H, &mut scratch).is_ok(),
            "newer ones still reorder"
        );
    }

    #[test]
    fn the_replay_window_takes_reordering_and_drops_the_too_old() {
        let k = [1u8; 32];
        let mut s = Sealer::new(&k, false);
        let mut o = Opener::new(&k, false);
        let mut scratch = [0u8; 8];
        let frames = sealed(&mut s, 2000);
        // 10 arrives first, then 1..9 late (reordered): all accepted once.
        assert!(o.open(&frames[9], H, &mut scratch).is_ok());
        for f in &frames[..9] {
            assert!(o.open(f, H, &mut scratch).is_ok());
        }
        for f in &frames[..10] {
            assert!(o.open(f, H, &mut scratch).is_err(), "second copy");
        }
        // Jump ahead: frames more than the window behind are refused, the rest still open.
        assert!(o.open(&frames[1999], H, &mut scratch).is_ok());
        assert!(o
            .open(&frames[1999 - REPLAY_WINDOW as usize], H, &mut scratch)
            .is_err());
        assert!(o
            .open(&frames[1999 - REPLAY_WINDOW as usize + 1], H, &mut scratch)
            .is_ok());
        assert!(o.open(&frames[1500], H, &mut scratch).is_ok());
    }
}
