//! Sealed datagram frames (docs/PROTOCOL.md §12.4): AES-256-GCM over each frame, keyed per
//! session, queue and direction, with a 64-bit sequence number as nonce and a replay window.
//!
//! A sealed frame is `header || payload || seq (u64) || tag (16)`. Without encryption the
//! header and payload are the additional data and the payload stays readable; with it the
//! payload is encrypted in place. Each `Sealer`/`Opener` belongs to one queue's owner thread:
//! no locks, no allocation per frame.

use ring::aead::{self, Aad, LessSafeKey, Nonce, Tag, UnboundKey};

/// Bytes a seal adds after the payload.
pub const TRAILER: usize = 24;
/// How far behind the newest accepted frame an older one may still arrive (frames).
pub const REPLAY_WINDOW: u64 = 1024;

fn key(bytes: &[u8; 32]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&aead::AES_256_GCM, bytes).expect("a 32-byte AES-256-GCM key"))
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..].copy_from_slice(&seq.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals the frames one queue sends in one direction.
pub struct Sealer {
    key: LessSafeKey,
    seq: u64,
    encrypt: bool,
}

impl Sealer {
    /// A sealer for frame key `key`; `encrypt` hides payloads too.
    pub fn new(key_bytes: &[u8; 32], encrypt: bool) -> Sealer {
        Sealer {
            key: key(key_bytes),
            seq: 0,
            encrypt,
        }
    }

    /// Seals `frame` = header (`header_len` bytes, already carrying the SEALED flag and a zero
    /// CRC) || payload || `TRAILER` bytes of room, in place.
    pub fn seal(&mut self, frame: &mut [u8], header_len: usize) {
        let body = frame.len() - TRAILER;
        // Never wraps: 2^64 frames is centuries at any rate a NIC can carry.
        self.seq += 1;
        let (data, trailer) = frame.split_at_mut(body);
        let tag = if self.encrypt {
            let (h, p) = data.split_at_mut(header_len);
            self.key
                .seal_in_place_separate_tag(nonce(self.seq), Aad::from(&*h), p)
        } else {
            self.key
                .seal_in_place_separate_tag(nonce(self.seq), Aad::from(&*data), &mut [])
        }
        .expect("frames are far below AES-GCM's length limit");
        trailer[..8].copy_from_slice(&self.seq.to_le_bytes());
        trailer[8..].copy_from_slice(tag.as_ref());
    }
}

/// Checks (and, when encrypted, decrypts) the frames one queue receives in one direction.
pub struct Opener {
    key: LessSafeKey,
    encrypt: bool,
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
            key: key(key_bytes),
            encrypt,
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
        let tag = Tag::from(tag);
        let (header, payload) = frame[..body].split_at(header_len);
        let out: &'a [u8] = if self.encrypt {
            let out = scratch.get_mut(..payload.len()).ok_or(Refused::Short)?;
            out.copy_from_slice(payload);
            self.key
                .open_in_place_separate_tag(nonce(seq), Aad::from(header), tag, out, 0..)
                .map_err(|_| Refused::Forged)?;
            out
        } else {
            self.key
                .open_in_place_separate_tag(
                    nonce(seq),
                    Aad::from(&frame[..body]),
                    tag,
                    &mut [],
                    0..,
                )
                .map_err(|_| Refused::Forged)?;
            payload
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

    #[test]
    fn the_replay_window_takes_reordering_and_drops_the_too_old() {
        let k = [1u8; 32];
        let mut s = Sealer::new(&k, false);
        let mut o = Opener::new(&k, false);
        let mut scratch = [0u8; 8];
        let frames: Vec<Vec<u8>> = (0..2000)
            .map(|_| {
                let mut f = frame(b"x");
                s.seal(&mut f, H);
                f
            })
            .collect();
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
