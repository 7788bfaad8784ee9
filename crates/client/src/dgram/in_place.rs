//! READ data received where it belongs (PROTOCOL.md §9.3), as the target receives WRITE data. A
//! READ larger than a frame comes back as runs of datagrams that UDP_GRO hands over as one
//! buffer; copied out of that buffer into the request's, every byte crosses memory twice here.
//! After a fragment of a READ of at least `IN_PLACE_MIN` bytes, the next run is peeked at first
//! (its first header) and, when it carries fragments of such a READ in flight, received with a
//! scatter
//! list that puts each fragment's header in the receive buffer and its payload straight into
//! the request's buffer, so the kernel's copy is the only one.
//!
//! Only what the peek vouches for is placed: an unsealed queue (a seal is opened over the frame
//! in one piece), a READ of this queue in flight with that tag, a fragment not yet received
//! whose length is the datagram's. Each is then checked where it landed, all of them before any
//! of the run is handled (`frame_in_two`: CRC over both pieces), then handed to `on_frame`. A
//! datagram of the run that is not the fragment it was
//! placed as is put back together in the receive buffer and handled as any other; the bytes it
//! left are where a fragment still missing goes, which overwrites them before the READ can
//! complete (the socket is connected: they are the target's in any case).

use blkwire_wire::{bitmap, datagram, Flags, Header, Opcode, Status, HEADER_LEN};

use blkwire_net::udp_offload::{Scatter, GRO_BUFFER};

use super::{DgramQueue, State};
use crate::{Error, Result};

pub(super) use blkwire_net::udp_offload::{Peeked, IN_PLACE_MIN};

/// How a peeked run is received: datagram `k` is fragment `first + k` of the READ `head`
/// answers, and `scatter` says which go straight into its buffer.
struct Plan {
    head: Header,
    first: u32,
    scatter: Scatter,
}

impl DgramQueue {
    /// Peeks at the next run; receives it in place when it carries fragments of a READ in
    /// flight (see the module's comment).
    pub(super) fn receive_in_place(&mut self) -> Result<Peeked> {
        if self.seal.is_some() {
            return Ok(Peeked::Other);
        }
        let mut head = [0u8; HEADER_LEN];
        let (len, seg) = match self.rx.peek(&mut head) {
            Ok(Some(run)) => run,
            Ok(None) => return Ok(Peeked::Empty),
            // A pending error (ICMP port unreachable, say): the usual receive takes it.
            Err(_) => return Ok(Peeked::Other),
        };
        let Some(plan) = self.plan(&head, len, seg) else {
            return Ok(Peeked::Other);
        };
        self.receive_planned(&plan)?;
        Ok(Peeked::Taken)
    }

    /// Which datagrams of a run of `len` bytes in datagrams of `seg`, whose first begins with
    /// `head`, can go where they belong; `None` when none can.
    fn plan(&mut self, head: &[u8], len: usize, seg: usize) -> Option<Plan> {
        let h = Header::decode(head, self.frame_payload).ok()?;
        let fp = self.frame_payload as usize;
        if !h.is_reply()
            || h.opcode != Opcode::Read
            || h.status != Status::Ok
            || (h.session, h.queue) != (self.session, self.index)
            || h.frag_count < 2
            || h.length < IN_PLACE_MIN
            || h.flags.has(Flags::SEALED)
            || h.flags.has(Flags::HAVE)
            || len > GRO_BUFFER
        {
            return None;
        }
        let s = self.slots.get_mut(h.tag.slot() as usize)?;
        if s.state != State::InFlight
            || s.opcode != Opcode::Read
            || s.generation != h.tag.generation()
            || h.frag_count as u32 != s.frags
            || s.data.len() < s.length as usize
        {
            return None;
        }
        let first = h.frag_index as u32;
        // A run of one datagram is read the usual way: one receive takes many of those.
        let mut scatter = Scatter::new(
            len,
            seg,
            HEADER_LEN,
            (s.data.as_mut_ptr(), first as usize, fp),
        )?;
        for k in 0..scatter.segments() {
            let i = first + k as u32;
            let expect = (s.length as usize).saturating_sub(i as usize * fp).min(fp);
            // Fragment `i` lies whole inside the READ's buffer (`length` bytes, checked above),
            // which only this queue touches: what `place` asks to be vouched for.
            if i < s.frags && !bitmap::get(&s.have, i) && scatter.carries(k) == Some(expect) {
                scatter.place(k);
            }
        }
        scatter.places_any().then_some(Plan {
            head: h,
            first,
            scatter,
        })
    }

    /// Receives the peeked run as `plan` says, then handles each of its datagrams.
    fn receive_planned(&mut self, plan: &Plan) -> Result<()> {
        let mut rx = self.rx.lend();
        let sc = &plan.scatter;
        if rx.len() < sc.len() {
            self.rx.give_back(rx);
            return Ok(());
        }
        // SAFETY: every place is a fragment's inside the READ's own buffer, as `plan` vouched;
        // nothing else touches it during the call.
        let got = unsafe { self.rx.receive_scattered(sc, &mut rx) };
        let got = match got {
            Ok(Some(got)) => got,
            Ok(None) => usize::MAX,
            Err(e) => {
                self.rx.give_back(rx);
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(()),
                    _ if super::link::lost_on_the_path(&e, true) => Ok(()),
                    _ => Err(Error::Io(e)),
                };
            }
        };
        if got != sc.len() {
            // The one reader of this socket takes the run it peeked at: anything else means
            // the layout above does not describe what arrived. Dropped, as a damaged datagram.
            self.stats.crc_errors += 1;
            self.rx.give_back(rx);
            return Ok(());
        }
        // Counted as the usual receive counts a coalesced run (a plan has two datagrams or more).
        self.stats.datagrams_in += sc.segments() as u64;
        self.stats.coalesced_in += sc.segments() as u64;
        // First every placed datagram is checked where its bytes landed, before any of the
        // run is handled (handling one could copy another datagram over these bytes); one
        // that is not what it was placed as is put back together here.
        let max = self.frame_payload;
        // SAFETY: placed where `plan` vouched, in the READ's buffer, which stays until the READ
        // is delivered (not during a receive).
        let valid = unsafe {
            sc.check_placed(&mut rx, 0, |k, header, placed| {
                datagram::frame_in_two(header, placed, max)
                    .ok()
                    .map(|f| f.header)
                    .filter(|h| is_fragment(h, &plan.head, plan.first + k as u32))
            })
        };
        // Then the fragments that are what they were placed as (distinct fragments of one
        // READ, each still missing), the way of any but for the copy, which `on_frame` skips
        // for the one `in_place` names; the payload they are handed is the unused room of the
        // same length in the receive buffer.
        for (k, h) in valid.iter().enumerate() {
            let Some(h) = *h else { continue };
            self.stats.frames_in += 1;
            self.in_place = Some((h.tag.slot(), plan.first + k as u32));
            self.on_frame(&h, &rx[sc.in_buffer(k)][HEADER_LEN..]);
            self.in_place = None;
        }
        // Last, everything else, whole in the receive buffer, as any datagram.
        for (k, v) in valid.iter().enumerate().take(sc.segments()) {
            if v.is_none() {
                self.on_datagram(&rx[sc.in_buffer(k)]);
            }
        }
        self.rx.give_back(rx);
        Ok(())
    }
}

/// Is `h` fragment `i` of the READ reply whose fragment `head` began the run?
fn is_fragment(h: &Header, head: &Header, i: u32) -> bool {
    h.is_reply()
        && h.opcode == Opcode::Read
        && h.status == Status::Ok
        && (h.session, h.queue, h.tag, h.frag_count)
            == (head.session, head.queue, head.tag, head.frag_count)
        && h.frag_index as u32 == i
        && !h.flags.has(Flags::HAVE)
}
