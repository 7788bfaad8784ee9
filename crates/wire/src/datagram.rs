//! Datagram carriage (PROTOCOL.md §9.6): a UDP datagram or an Ethernet frame carries one or more
//! frames back to back, all for the same session and queue, each sealed with its own CRC32C.
//!
//! Packing several small frames (request headers, 4 KiB read replies on a jumbo link) into one
//! datagram is what lets a datagram transport move as few packets per I/O as TCP's segmentation
//! offload does: the per-packet cost of the network stack, not the bytes, bounds small I/O.

use crate::frame::{Flags, FrameError, Header, HEADER_LEN};

/// Bytes a seal adds after a sealed frame's payload (§12.4: u64 seq, 16-byte tag).
pub const SEAL_LEN: usize = 24;

/// One frame of a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Its header, validated (§1).
    pub header: Header,
    /// Its payload (still encrypted if the session encrypts, §12.4).
    pub payload: &'a [u8],
    /// All its bytes as received: header, payload and, if sealed, the seal.
    pub raw: &'a [u8],
}

impl Frame<'_> {
    /// Does a seal follow the payload (§12.4)? It must be opened before the frame is trusted.
    pub fn sealed(&self) -> bool {
        self.header.flags.has(Flags::SEALED)
    }
}

/// The frames of one received datagram, in order. Validation is per frame (§1 and §9): a frame
/// that fails it ends the walk (what follows cannot be trusted to be framed correctly), but the
/// frames before it stand; each was complete and CRC-checked on its own (or carries a seal,
/// §12.4, which only the receiver's session keys can check).
pub struct Frames<'a> {
    rest: &'a [u8],
    max_payload: u32,
    first: Option<(u32, u16)>,
}

/// Walks `datagram`; `max_payload` is the receiver's own per-frame limit.
pub fn frames(datagram: &[u8], max_payload: u32) -> Frames<'_> {
    Frames {
        rest: datagram,
        max_payload,
        first: None,
    }
}

impl<'a> Frames<'a> {
    fn next_frame(&mut self) -> Result<Frame<'a>, FrameError> {
        let h = Header::decode(self.rest, self.max_payload)?;
        let end = HEADER_LEN + h.payload_len as usize;
        let payload = self
            .rest
            .get(HEADER_LEN..end)
            .ok_or(FrameError::Truncated)?;
        let end = if h.flags.has(Flags::SEALED) {
            if h.flags.has(Flags::CRC) || h.crc != 0 {
                return Err(FrameError::MissingCrc);
            }
            end + SEAL_LEN
        } else {
            if !h.flags.has(Flags::CRC) {
                return Err(FrameError::MissingCrc);
            }
            h.check_crc(self.rest, payload)?;
            end
        };
        let raw = self.rest.get(..end).ok_or(FrameError::Truncated)?;
        let key = (h.session, h.queue);
        if *self.first.get_or_insert(key) != key {
            return Err(FrameError::MixedQueues);
        }
        self.rest = &self.rest[end..];
        Ok(Frame {
            header: h,
            payload,
            raw,
        })
    }
}

/// A frame received in two pieces: its header in one buffer and its payload, scattered by the
/// receive itself, in another (a target placing a WRITE fragment where it belongs, §9.3).
/// Validated as [`frames`] validates a frame, except that a sealed frame is refused: a seal is
/// opened over the frame's bytes in one piece. `raw` is the header alone.
pub fn frame_in_two<'a>(
    header: &'a [u8],
    payload: &'a [u8],
    max_payload: u32,
) -> Result<Frame<'a>, FrameError> {
    let h = Header::decode(header, max_payload)?;
    if header.len() != HEADER_LEN || h.payload_len as usize != payload.len() {
        return Err(FrameError::Truncated);
    }
    if h.flags.has(Flags::SEALED) || !h.flags.has(Flags::CRC) {
        return Err(FrameError::MissingCrc);
    }
    h.check_crc(header, payload)?;
    Ok(Frame {
        header: h,
        payload,
        raw: header,
    })
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<Frame<'a>, FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let r = self.next_frame();
        if r.is_err() {
            self.rest = &[];
        }
        Some(r)
    }
}

/// Consecutive datagrams to one destination that can leave in one segmented send (UDP GSO).
pub struct Run<D> {
    /// Their pieces, in order (`Packer::pieces`).
    pieces: std::ops::Range<usize>,
    /// Where they go.
    pub dest: D,
    /// Length of every datagram but the last, which may be shorter.
    pub segment: usize,
    /// Datagrams in the run.
    pub count: usize,
    /// Bytes in the run.
    pub bytes: usize,
}

/// Payloads shorter than this are copied even when offered with `push_lent`: a piece of their
/// own would cost the kernel more than the copy saves, and it keeps a datagram's pieces few.
pub const LEND_MIN: usize = 1024;

/// Most pieces (I/O vectors) a run may have; the kernel takes at most 1024 (UIO_MAXIOV). A
/// safeguard: within a segmented send's 65,000 bytes, with lent pieces of at least
/// [`LEND_MIN`], a run has at most about 130.
pub const MAX_RUN_PIECES: usize = 1024;

/// Part of an outgoing datagram: bytes in the packer's buffer, or bytes lent where they lie.
#[derive(Clone, Copy)]
enum Piece {
    Own {
        at: usize,
        len: usize,
    },
    /// An address, not a pointer, so that a packer can move between threads; see `push_lent`.
    Lent {
        addr: usize,
        len: usize,
    },
}

/// Builds outgoing datagrams: frames are appended to one buffer and a frame joins the previous
/// datagram when it is for the same destination, session and queue and still fits `limit`
/// bytes (the receiver's datagram size, §9.6). Control frames (session 0) always travel alone.
///
/// A datagram is a list of pieces: ranges of the packer's buffer (headers, small or sealed
/// payloads) and payloads lent by the caller (`push_lent`), which the kernel gathers when it
/// sends them, so a large READ's data is copied once, into the socket, not first into here.
pub struct Packer<D> {
    buf: Vec<u8>,
    pieces: Vec<Piece>,
    /// (first piece, length, destination) of each datagram.
    datagrams: Vec<(usize, usize, D)>,
    /// The last datagram still open for packing: its session, queue and byte limit.
    open: Option<(u32, u16, usize)>,
}

impl<D: Copy + PartialEq> Packer<D> {
    /// An empty packer with room for `datagrams` datagrams of `bytes` bytes in all.
    pub fn with_capacity(datagrams: usize, bytes: usize) -> Packer<D> {
        Packer {
            buf: Vec::with_capacity(bytes),
            pieces: Vec::with_capacity(4 * datagrams),
            datagrams: Vec::with_capacity(datagrams),
            open: None,
        }
    }

    /// Appends an encoded, sealed frame; `limit` 0 means "never pack this one".
    pub fn push(&mut self, h: &Header, payload: &[u8], dest: D, limit: usize) {
        self.start_frame(h, HEADER_LEN + payload.len(), dest, limit);
        self.own(&h.to_bytes());
        self.own(payload);
    }

    /// Opens a frame of `len` bytes: in the open datagram if it joins it, else in a new one.
    fn start_frame(&mut self, h: &Header, len: usize, dest: D, limit: usize) {
        let key = (h.session, h.queue);
        let joins = match (self.open, self.datagrams.last()) {
            (Some((s, q, lim)), Some(&(_, dl, d))) => {
                (s, q) == key && d == dest && dl + len <= lim && limit > 0
            }
            _ => false,
        };
        if joins {
            self.datagrams.last_mut().expect("open datagram").1 += len;
        } else {
            self.datagrams.push((self.pieces.len(), len, dest));
            self.open = (limit > 0 && h.session != 0).then_some((key.0, key.1, limit));
        }
    }

    /// Appends bytes to the buffer, growing the last piece when it ends where they start (and
    /// is part of the last datagram).
    fn own(&mut self, bytes: &[u8]) {
        let at = self.buf.len();
        self.buf.extend_from_slice(bytes);
        let first = self.datagrams.last().map_or(0, |d| d.0);
        let in_datagram = self.pieces.len() > first;
        match self.pieces.last_mut() {
            Some(Piece::Own { at: a, len }) if in_datagram && *a + *len == at => {
                *len += bytes.len()
            }
            _ => self.pieces.push(Piece::Own {
                at,
                len: bytes.len(),
            }),
        }
    }

    /// Appends a frame with its CRC (§9), computed over the bytes as copied here: a payload that
    /// another thread may change meanwhile (an export's memory) still leaves in a frame whose
    /// CRC matches what it carries.
    pub fn push_crc(&mut self, h: &Header, payload: &[u8], dest: D, limit: usize) {
        let mut h = *h;
        h.payload_len = payload.len() as u32;
        let start = self.buf.len();
        self.push(&h, payload, dest, limit);
        let (head, copied) = self.buf[start..].split_at_mut(HEADER_LEN);
        h.seal_crc(copied);
        head.copy_from_slice(&h.to_bytes());
    }

    /// Appends a frame with its CRC whose payload is not copied: the datagram points at the
    /// `len` bytes at `data`, and the kernel copies them when it sends (shorter payloads than
    /// [`LEND_MIN`] are copied, as by `push_crc`).
    ///
    /// The CRC is computed over the bytes as they are now. If another thread changes them
    /// before the send, the frame arrives with a CRC that does not match and the receiver
    /// drops it, as it drops a frame damaged on the wire: it is never taken for valid data.
    /// With a header-only CRC (`HEAD_CRC`, §9.7) the data is not covered, and such a frame
    /// carries what the kernel copied, as a tcp:// reply sent from the same memory does: a READ
    /// racing a WRITE to the same blocks may return either, or a mix (§2 step 4).
    ///
    /// # Safety
    ///
    /// `data` must be readable for `len` bytes until the packer is cleared or dropped (`get`
    /// reads it too, not only the send).
    pub unsafe fn push_lent(
        &mut self,
        h: &Header,
        data: *const u8,
        len: usize,
        dest: D,
        limit: usize,
    ) {
        // SAFETY: readable for `len` bytes (the caller's promise).
        let payload = unsafe { std::slice::from_raw_parts(data, len) };
        if len < LEND_MIN {
            return self.push_crc(h, payload, dest, limit);
        }
        let mut h = *h;
        h.payload_len = len as u32;
        // Fragments are cut in order from one buffer and pushed in order, so a lent payload is
        // followed in memory by the rest of its message, most likely pushed next: its CRC
        // fetches up to a page of it while it folds this one's. A wrong guess (a fragment the
        // peer already has is skipped) costs that page of memory traffic.
        let rest = (h.length as usize).saturating_sub(h.frag_offset as usize + len);
        h.seal_crc_streaming(payload, rest);
        self.start_frame(&h, HEADER_LEN + len, dest, limit);
        self.own(&h.to_bytes());
        self.pieces.push(Piece::Lent {
            addr: data as usize,
            len,
        });
    }

    /// Appends a frame sealed by `seal` (§12.4): the header is marked sealed, `SEAL_LEN` bytes
    /// of room follow the payload, and `seal` gets the whole frame to fill them (and, if the
    /// session encrypts, to encrypt the payload in place, in this buffer: no extra copy).
    pub fn push_sealed(
        &mut self,
        h: &Header,
        payload: &[u8],
        dest: D,
        limit: usize,
        seal: impl FnOnce(&mut [u8]),
    ) {
        let mut h = *h;
        h.payload_len = payload.len() as u32;
        h.mark_sealed();
        self.start_frame(&h, HEADER_LEN + payload.len() + SEAL_LEN, dest, limit);
        let start = self.buf.len();
        self.own(&h.to_bytes());
        self.own(payload);
        self.own(&[0; SEAL_LEN]);
        seal(&mut self.buf[start..]);
    }

    /// Appends raw bytes as a datagram of their own (test hooks replaying captured frames).
    pub fn push_raw(&mut self, bytes: &[u8], dest: D) {
        self.datagrams.push((self.pieces.len(), bytes.len(), dest));
        self.own(bytes);
        self.open = None;
    }

    /// Datagrams built so far.
    pub fn len(&self) -> usize {
        self.datagrams.len()
    }
    /// No datagram built yet?
    pub fn is_empty(&self) -> bool {
        self.datagrams.is_empty()
    }

    /// Does any datagram point at lent bytes (`push_lent`)?
    pub fn lends(&self) -> bool {
        self.pieces.iter().any(|p| matches!(p, Piece::Lent { .. }))
    }

    /// Datagram `i`: a copy of its bytes, and its destination.
    pub fn get(&self, i: usize) -> (Vec<u8>, D) {
        let (first, len, d) = self.datagrams[i];
        let end = self.datagrams.get(i + 1).map_or(self.pieces.len(), |n| n.0);
        let mut out = Vec::with_capacity(len);
        for (p, l) in self.pieces_of(first..end) {
            // SAFETY: an own piece lies in `buf`; a lent one is readable until the packer is
            // cleared (`push_lent`'s contract).
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(p, l) });
        }
        (out, d)
    }

    /// The run of datagrams from `i` that can leave in one segmented send (UDP GSO): the same
    /// destination, all as long as the first but a shorter last one, at most `max_count`
    /// datagrams, `max_bytes` bytes and [`MAX_RUN_PIECES`] pieces.
    pub fn run(&self, i: usize, max_count: usize, max_bytes: usize) -> Run<D> {
        let first_piece = |j: usize| self.datagrams.get(j).map_or(self.pieces.len(), |d| d.0);
        let (start, seg, dest) = self.datagrams[i];
        let mut count = 1;
        let mut len = seg;
        for &(_, l, d) in &self.datagrams[i + 1..] {
            if count == max_count
                || d != dest
                || l > seg
                || len + l > max_bytes
                || first_piece(i + count + 1) - start > MAX_RUN_PIECES
            {
                break;
            }
            count += 1;
            len += l;
            if l < seg {
                break;
            }
        }
        Run {
            pieces: start..first_piece(i + count),
            dest,
            segment: seg,
            count,
            bytes: len,
        }
    }

    /// The runs from datagram `i` on, in order (each as `run` makes it), within the limits
    /// (most datagrams, most bytes) `limits` gives for its destination.
    pub fn runs<'a>(
        &'a self,
        mut i: usize,
        limits: impl Fn(&D) -> (usize, usize) + 'a,
    ) -> impl Iterator<Item = Run<D>> + 'a {
        std::iter::from_fn(move || {
            (i < self.len()).then(|| {
                let (max_count, max_bytes) = limits(&self.datagrams[i].2);
                let r = self.run(i, max_count, max_bytes);
                i += r.count;
                r
            })
        })
    }

    /// Where datagram `i` goes.
    pub fn dest(&self, i: usize) -> D {
        self.datagrams[i].2
    }

    /// A run's pieces, in order, as (address, length): ranges of this packer's buffer, valid
    /// until it is next changed, and lent bytes (`push_lent`).
    pub fn pieces(&self, run: &Run<D>) -> impl Iterator<Item = (*const u8, usize)> + '_ {
        self.pieces_of(run.pieces.clone())
    }

    /// Pieces that lie back to back (copied frames of consecutive datagrams) come as one: a
    /// send from one I/O vector takes the kernel's faster single-buffer copy (udp:// 4k reads
    /// at QD32 cost the target 6.1-6.7 us per I/O with a vector per datagram, 5.3-5.5 with one
    /// per run).
    fn pieces_of(
        &self,
        r: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (*const u8, usize)> + '_ {
        let mut it = self.pieces[r]
            .iter()
            .map(|p| match *p {
                Piece::Own { at, len } => (self.buf[at..at + len].as_ptr(), len),
                Piece::Lent { addr, len } => (addr as *const u8, len),
            })
            .peekable();
        std::iter::from_fn(move || {
            let (at, mut len) = it.next()?;
            while let Some(&(next, more)) = it.peek() {
                if at.wrapping_add(len) != next {
                    break;
                }
                len += more;
                it.next();
            }
            Some((at, len))
        })
    }

    /// Forgets every datagram (after they are sent).
    pub fn clear(&mut self) {
        self.buf.clear();
        self.pieces.clear();
        self.datagrams.clear();
        self.open = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Opcode, Tag};

    fn frame(session: u32, queue: u16, slot: u16, payload: &[u8]) -> (Header, Vec<u8>) {
        let mut h = Header::request(Opcode::Write, Tag::new(slot, 1), 0, 4096);
        h.session = session;
        h.queue = queue;
        h.payload_len = payload.len() as u32;
        h.seal_crc(payload);
        (h, payload.to_vec())
    }

    #[test]
    fn packs_same_queue_up_to_the_limit_and_walks_back() {
        let mut p = Packer::with_capacity(4, 1 << 16);
        let data = [7u8; 100];
        let limit = 3 * (HEADER_LEN + 100);
        for slot in 0..4 {
            let (h, pl) = frame(9, 2, slot, &data);
            p.push(&h, &pl, 1u8, limit);
        }
        assert_eq!(
            p.len(),
            2,
            "three frames fit the limit, the fourth starts a datagram"
        );
        let (d, dest) = p.get(0);
        assert_eq!((d.len(), dest), (limit, 1));
        let slots: Vec<u16> = frames(&d, 4096)
            .map(|r| r.expect("valid").header.tag.slot())
            .collect();
        assert_eq!(slots, [0, 1, 2]);
        let (d, _) = p.get(1);
        assert_eq!(frames(&d, 4096).count(), 1);
    }

    /// A frame in two pieces is taken only whole, with its CRC over both pieces, and never
    /// sealed: a damaged payload, a payload of another length or a sealed header is refused.
    #[test]
    fn a_frame_in_two_pieces_is_checked_as_one() {
        let (h, payload) = frame(9, 2, 1, &[3u8; 512]);
        let header = h.to_bytes();
        let f = frame_in_two(&header, &payload, 4096).expect("valid");
        assert_eq!((f.header, f.payload, f.raw), (h, &payload[..], &header[..]));
        let mut damaged = payload.clone();
        damaged[100] ^= 1;
        assert!(matches!(
            frame_in_two(&header, &damaged, 4096),
            Err(FrameError::BadCrc { .. })
        ));
        assert!(frame_in_two(&header, &payload[..511], 4096).is_err());
        assert!(frame_in_two(&header[..47], &payload, 4096).is_err());
        let mut sealed = h;
        sealed.mark_sealed();
        assert!(frame_in_two(&sealed.to_bytes(), &payload, 4096).is_err());
        let mut none = h;
        none.flags.0 &= !Flags::CRC;
        none.crc = 0;
        assert!(frame_in_two(&none.to_bytes(), &payload, 4096).is_err());
    }

    /// A datagram's frames, each checked against its CRC, as (payload length, first byte).
    fn checked_frames(d: &[u8]) -> Vec<(u32, u8)> {
        frames(d, 1 << 16)
            .map(|r| r.expect("a valid frame"))
            .map(|f| {
                f.header
                    .check_crc(f.raw, f.payload)
                    .expect("its CRC matches");
                (f.header.payload_len, f.payload[0])
            })
            .collect()
    }

    /// `push_crc` frames carry their length and a CRC over what they carry, packed as `push`
    /// packs them.
    #[test]
    fn push_crc_seals_what_it_copied() {
        let mut p = Packer::with_capacity(4, 1 << 16);
        let mut h = Header::request(Opcode::Read, Tag::new(3, 1), 0, 200);
        h.session = 9;
        p.push_crc(&h, &[5u8; 200], 1u8, 2 * (HEADER_LEN + 200));
        p.push_crc(&h, &[6u8; 100], 1u8, 2 * (HEADER_LEN + 200));
        assert_eq!(p.len(), 1);
        assert_eq!(checked_frames(&p.get(0).0), [(200, 5), (100, 6)]);
    }

    /// A lent payload is not copied: its datagram points at it, the kernel gathers header and
    /// payload, and the CRC covers the payload as it was when pushed. Short payloads are copied.
    #[test]
    fn push_lent_points_at_the_payload_and_seals_it() {
        let mut p = Packer::with_capacity(4, 1 << 16);
        let mut h = Header::request(Opcode::Read, Tag::new(3, 1), 0, 8192);
        h.session = 9;
        let big = vec![7u8; 4000];
        let small = [8u8; 100];
        let limit = 2 * (HEADER_LEN + 4000) + HEADER_LEN + 100;
        // SAFETY: `big` and `small` outlive the packer's use of them below.
        unsafe {
            p.push_lent(&h, big.as_ptr(), big.len(), 1u8, limit);
            p.push_lent(&h, small.as_ptr(), small.len(), 1u8, limit);
            p.push_lent(&h, big.as_ptr(), big.len(), 1u8, limit);
        }
        assert_eq!(p.len(), 1, "lent frames pack like any other");
        assert!(p.lends());
        let run = p.run(0, 64, 1 << 16);
        let pieces: Vec<(*const u8, usize)> = p.pieces(&run).collect();
        assert_eq!(
            pieces.iter().map(|x| x.1).collect::<Vec<_>>(),
            [HEADER_LEN, 4000, 2 * HEADER_LEN + 100, 4000],
            "header, lent payload, the small frame copied with the next header, lent payload"
        );
        assert_eq!((pieces[1].0, pieces[3].0), (big.as_ptr(), big.as_ptr()));
        assert_eq!(
            checked_frames(&p.get(0).0),
            [(4000, 7), (100, 8), (4000, 7)]
        );
        p.clear();
        assert!(!p.lends() && p.is_empty());
    }

    /// Lent frames one per datagram form a run whose pieces alternate between the packer's
    /// headers and the lent data, in order; each datagram reads back whole.
    #[test]
    fn a_run_of_lent_datagrams_lists_every_piece_in_order() {
        let mut p = Packer::with_capacity(4, 1 << 16);
        let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        let limit = HEADER_LEN + 2000;
        for i in 0..3u16 {
            let mut h = Header::request(Opcode::Read, Tag::new(i, 1), 0, 2000);
            h.session = 9;
            let at = i as usize * 2000;
            // SAFETY: `data` outlives the packer's use of it below.
            unsafe { p.push_lent(&h, data[at..].as_ptr(), 2000, 1u8, limit) };
        }
        assert_eq!(p.len(), 3, "a frame fills each datagram");
        let run = p.run(0, 64, 1 << 16);
        assert_eq!((run.count, run.segment, run.bytes), (3, limit, 3 * limit));
        let pieces: Vec<(*const u8, usize)> = p.pieces(&run).collect();
        assert_eq!(pieces.len(), 6);
        for i in 0..3 {
            assert_eq!(pieces[2 * i].1, HEADER_LEN);
            assert_eq!(pieces[2 * i + 1], (data[i * 2000..].as_ptr(), 2000));
        }
        for i in 0..3 {
            let (d, dest) = p.get(i);
            assert_eq!(dest, 1);
            let f = frames(&d, 4096).next().expect("a frame").expect("valid");
            assert_eq!(f.header.tag.slot(), i as u16);
            assert_eq!(f.payload, &data[i * 2000..(i + 1) * 2000]);
        }
    }

    #[test]
    fn runs_group_equal_datagrams_to_one_destination() {
        let mut p = Packer::with_capacity(8, 1 << 16);
        let limit = HEADER_LEN + 100;
        for (len, dest) in [
            (100, 1u8),
            (100, 1),
            (60, 1),
            (100, 1),
            (100, 2),
            (100, 2),
            (100, 2),
        ] {
            let (h, pl) = frame(9, 0, 0, &vec![3u8; len]);
            p.push(&h, &pl, dest, limit);
        }
        let r = p.run(0, 64, 1 << 16);
        assert_eq!(
            (r.count, r.segment, r.dest),
            (3, HEADER_LEN + 100, 1),
            "a shorter datagram ends a run"
        );
        assert_eq!(r.bytes, 2 * (HEADER_LEN + 100) + HEADER_LEN + 60);
        assert_eq!(
            p.pieces(&r).count(),
            1,
            "copied frames back to back are one piece, across datagrams too"
        );
        let r = p.run(3, 64, 1 << 16);
        assert_eq!((r.count, r.dest), (1, 1), "another destination ends a run");
        assert_eq!(p.run(4, 2, 1 << 16).count, 2, "at most max_count");
        assert_eq!(
            p.run(4, 64, 2 * (HEADER_LEN + 100)).count,
            2,
            "at most max_bytes"
        );
        assert_eq!(p.run(4, 64, 1 << 16).count, 3);
        assert_eq!(p.run(6, 64, 1 << 16).count, 1);
        let counts: Vec<usize> = p.runs(0, |_| (64, 1 << 16)).map(|r| r.count).collect();
        assert_eq!(
            counts,
            [3, 1, 3],
            "the runs cover every datagram once, in order"
        );
        assert_eq!(
            p.runs(4, |_| (2, 1 << 16)).map(|r| r.count).sum::<usize>(),
            3
        );
        let one_by_one_to_2 = |d: &u8| {
            if *d == 2 {
                (1, usize::MAX)
            } else {
                (64, 1 << 16)
            }
        };
        let counts: Vec<usize> = p.runs(0, one_by_one_to_2).map(|r| r.count).collect();
        assert_eq!(counts, [3, 1, 1, 1, 1], "the limits are the destination's");
        assert_eq!((p.dest(3), p.dest(4)), (1, 2));
    }

    #[test]
    fn never_packs_across_queues_destinations_or_control_frames() {
        let mut p = Packer::with_capacity(8, 1 << 16);
        let (a, _) = frame(9, 0, 0, &[]);
        let (b, _) = frame(9, 1, 0, &[]);
        let (c, _) = frame(0, 0, 0, &[]);
        p.push(&a, &[], 1u8, 1000);
        p.push(&b, &[], 1u8, 1000); // other queue
        p.push(&b, &[], 2u8, 1000); // other destination
        p.push(&c, &[], 2u8, 1000); // control
        p.push(&c, &[], 2u8, 1000); // control again
        p.push(&a, &[], 2u8, 0); // not packable
        assert_eq!(p.len(), 6);
        p.clear();
        assert!(p.is_empty());
    }

    #[test]
    fn sealed_frames_carry_their_seal_and_need_no_crc() {
        let mut p = Packer::with_capacity(4, 1 << 16);
        let (h, _) = frame(9, 1, 0, &[]);
        let seal = |f: &mut [u8]| {
            let n = f.len();
            f[n - SEAL_LEN..].fill(0xee);
        };
        p.push_sealed(&h, b"abc", 1u8, 1000, seal);
        p.push_sealed(&h, b"de", 1u8, 1000, seal);
        assert_eq!(p.len(), 1, "sealed frames pack like any other");
        let (d, _) = p.get(0);
        let got: Vec<Frame<'_>> = frames(&d, 4096).map(|f| f.unwrap()).collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].sealed() && !got[0].header.flags.has(Flags::CRC));
        assert_eq!(got[0].payload, b"abc");
        assert_eq!(got[0].raw.len(), HEADER_LEN + 3 + SEAL_LEN);
        assert!(got[0].raw.ends_with(&[0xee; SEAL_LEN]));
        assert_eq!(got[1].payload, b"de");
        // A seal cut short is a truncated frame; a sealed frame claiming a CRC is refused.
        assert_eq!(
            frames(&d[..d.len() - 1], 4096).nth(1),
            Some(Err(FrameError::Truncated))
        );
        let mut both = got[0].raw.to_vec();
        both[4] |= Flags::CRC as u8;
        assert_eq!(
            frames(&both, 4096).next(),
            Some(Err(FrameError::MissingCrc))
        );
    }

    #[test]
    fn a_bad_frame_ends_the_walk_but_keeps_the_frames_before_it() {
        let (h1, _) = frame(5, 0, 1, &[]);
        let (h2, _) = frame(5, 0, 2, &[1, 2, 3]);
        let mut d = h1.to_bytes().to_vec();
        d.extend_from_slice(&h2.to_bytes());
        d.extend_from_slice(&[1, 2]); // one payload byte short
        let got: Vec<_> = frames(&d, 4096).collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].is_ok());
        assert_eq!(got[1], Err(FrameError::Truncated));

        let (h3, _) = frame(5, 1, 3, &[]);
        let mut d = h1.to_bytes().to_vec();
        d.extend_from_slice(&h3.to_bytes());
        let got: Vec<_> = frames(&d, 4096).collect();
        assert_eq!(got[1], Err(FrameError::MixedQueues));

        let mut bare = Header::request(Opcode::Read, Tag::new(0, 1), 0, 512);
        bare.session = 5;
        let bare = bare.to_bytes();
        let got: Vec<_> = frames(&bare, 4096).collect();
        assert_eq!(got, [Err(FrameError::MissingCrc)]);

        let mut flipped = h2.to_bytes().to_vec();
        flipped.extend_from_slice(&[1, 2, 4]);
        assert!(matches!(
            frames(&flipped, 4096).next(),
            Some(Err(FrameError::BadCrc { .. }))
        ));
        assert_eq!(
            frames(&[0u8; 10], 4096).next(),
            Some(Err(FrameError::Short))
        );
        assert_eq!(frames(&[], 4096).next(), None);
    }
}
