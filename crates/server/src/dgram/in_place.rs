//! WRITE fragments received where they belong (PROTOCOL.md §9.3). A WRITE larger than a frame
//! arrives as runs of datagrams that UDP_GRO hands over as one buffer; copied out of that
//! buffer, every byte crosses memory twice on the target (the kernel's copy into the buffer,
//! then ours into the export or the slot's buffer). After a fragment of a WRITE of at least
//! `IN_PLACE_MIN` bytes, the next run is peeked at first (its first header and its source,
//! `MSG_PEEK`): when it carries more fragments of such a WRITE being assembled on a queue of its
//! source, it is received with a scatter list that puts each fragment's header in the receive
//! buffer and its payload straight where that fragment goes, so the kernel's copy is the only
//! one. A run that begins such a WRITE has its first datagram peeked at whole and handled first
//! (that sets the slot up), the rest placed behind it.
//!
//! Only what the peek can vouch for is placed: the run's source is the queue's peer, the queue
//! is not sealed (a seal is opened over the frame in one piece), and each payload goes to a
//! fragment of that WRITE not yet received whose length is the datagram's. Everything is then
//! checked where it landed, all of them before any of the run is handled (`frame_in_two`: CRC
//! over both pieces), then handed to `on_frame`. A datagram of the run that is not the fragment
//! it was placed as (damaged, another request's, packed frames) is put back together in the
//! receive buffer and handled as any other, so the bytes that landed are then those of a
//! fragment the WRITE has yet to receive: the range of a WRITE not yet answered holds unknown
//! data, as it already may while it is assembled in place (§9.3), and nothing lands outside the
//! range or from another address than the queue's.

use std::os::fd::AsRawFd;

use blkwire_backend::Submitter;
use blkwire_net::udp_offload::{self, Scatter};
use blkwire_wire::{datagram, Flags, Header, Opcode, HEADER_LEN};

use super::{bitmap, DgramPort, Peer, SlotState, UserData};

pub(super) use blkwire_net::udp_offload::{Peeked, IN_PLACE_MIN};

/// How a peeked run is received: datagram `k` is fragment `first + k` of the WRITE `head`
/// belongs to, on queue `qi`, and `scatter` says which go where they belong. Datagram 0 is
/// `handled` when it was handled from the peek already (it began that WRITE): received again,
/// it is not looked at.
struct Plan {
    peer: Peer,
    qi: usize,
    head: Header,
    first: u32,
    handled: bool,
    scatter: Scatter,
}

impl DgramPort {
    /// Peeks at the next run; receives it in place when it carries fragments of a WRITE being
    /// assembled, or begins one (see the module's comment).
    pub(super) fn receive_in_place(&mut self, sq: &mut dyn Submitter, ud: UserData) -> Peeked {
        let mut head = [0u8; HEADER_LEN];
        let (len, seg, peer) = match self.peek(&mut head) {
            Ok((len, seg, Some(peer))) => (len, seg, peer),
            Ok((_, _, None)) => return Peeked::Other,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Peeked::Empty,
            // A pending error (an ICMP one, say): the usual receive takes it.
            Err(_) => return Peeked::Other,
        };
        let Some(h) = self.fragment_head(&head, len, seg, peer) else {
            return Peeked::Other;
        };
        let plan = if h.frag_index == 0 && !self.assembling(&h) {
            // The run begins a WRITE: its first datagram is handled as any would be (checked,
            // and the slot set up for the WRITE), then the rest are placed behind it.
            let mut first = std::mem::take(&mut self.rx[1]);
            let got = seg.min(len);
            let handled = self
                .peek(&mut first[..got])
                .is_ok_and(|(l, _, p)| l == len && p == Some(peer));
            if handled {
                self.on_datagram(&first[..got], peer, sq, ud);
            }
            self.rx[1] = first;
            if !handled {
                return Peeked::Other;
            }
            self.plan(h, (len, seg), peer, true)
        } else {
            self.plan(h, (len, seg), peer, false)
        };
        // Never `None` here: `fragment_head` takes a run only when `Scatter::new` does.
        let Some(plan) = plan else {
            return Peeked::Other;
        };
        match self.receive_planned(&plan, sq, ud) {
            true => Peeked::Taken,
            // The receive failed twice: left for the next readiness.
            false => Peeked::Empty,
        }
    }

    /// Copies the first bytes of the next run into `buf` without taking it: the run's length,
    /// its segment size and its source (`None`: not one a reply could go to).
    fn peek(&self, buf: &mut [u8]) -> std::io::Result<(usize, usize, Option<Peer>)> {
        // SAFETY: an all-zero address is a valid value; the kernel fills it in.
        let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let (len, seg) = udp_offload::peek_run(self.fd.as_raw_fd(), buf, Some(&mut name))?;
        Ok((len, seg, self.peer_of(&name)))
    }

    /// The header that begins a run of `len` bytes in datagrams of `seg` from `peer`, if it is
    /// a fragment of a multi-fragment WRITE of one of `peer`'s unsealed queues (not yet
    /// checked: the CRC is not in the peek).
    fn fragment_head(&self, head: &[u8], len: usize, seg: usize, peer: Peer) -> Option<Header> {
        let h = Header::decode(head, self.link_payload.max(4096)).ok()?;
        let q = self.queues[*self.index.get(&(h.session, h.queue))?].as_ref()?;
        // A run of one datagram is read the usual way: one receive takes many of those.
        let fits = Scatter::new(len, seg, HEADER_LEN, (std::ptr::null_mut(), 0, 0)).is_some()
            && len <= self.rx.first()?.len()
            && seg <= self.rx.get(1)?.len();
        (fits
            && h.length >= IN_PLACE_MIN
            && h.opcode == Opcode::Write
            && !h.is_reply()
            && h.session != 0
            && h.frag_count > 1
            && !h.flags.has(Flags::SEALED)
            && !h.flags.has(Flags::HAVE)
            && q.peer == peer
            && q.seal.is_none())
        .then_some(h)
    }

    /// Is the WRITE `h` is a fragment of being assembled?
    fn assembling(&self, h: &Header) -> bool {
        self.index
            .get(&(h.session, h.queue))
            .and_then(|&qi| self.queues[qi].as_ref())
            .and_then(|q| q.slots.get(h.tag.slot() as usize))
            .is_some_and(|s| s.state == SlotState::Assembling && s.hdr.tag == h.tag)
    }

    /// Which datagrams of the run `h` begins can go where they belong. With `handled`, the
    /// first was handled from the peek. Placing nothing when the WRITE is not (or no longer)
    /// being assembled: the run is then received and handled as usual. `None` only for a run
    /// `fragment_head` would not have taken.
    fn plan(
        &mut self,
        h: Header,
        (len, seg): (usize, usize),
        peer: Peer,
        handled: bool,
    ) -> Option<Plan> {
        let first = h.frag_index as u32;
        let nowhere = (std::ptr::null_mut(), 0, 0);
        let mut plan = Plan {
            peer,
            qi: 0,
            head: h,
            first,
            handled,
            scatter: Scatter::new(len, seg, HEADER_LEN, nowhere)?,
        };
        let Some(&qi) = self.index.get(&(h.session, h.queue)) else {
            return Some(plan);
        };
        let Some(q) = self.queues[qi].as_mut() else {
            return Some(plan);
        };
        let fp = q.fp as usize;
        let Some(s) = q.slots.get_mut(h.tag.slot() as usize) else {
            return Some(plan);
        };
        if s.state != SlotState::Assembling
            || s.hdr.tag != h.tag
            || s.hdr.length != h.length
            || h.frag_count as u32 != s.frags
        {
            return Some(plan);
        }
        let base = match (s.into, s.buf.as_mut()) {
            (Some(into), _) => into,
            (None, Some(buf)) => buf.as_mut_ptr(),
            (None, None) => return Some(plan),
        };
        plan.qi = qi;
        plan.scatter = Scatter::new(len, seg, HEADER_LEN, (base, first as usize, fp))?;
        for k in handled as usize..plan.scatter.segments() {
            let i = first + k as u32;
            let expect = (s.hdr.length as usize)
                .saturating_sub(i as usize * fp)
                .min(fp);
            // Fragment `i` lies whole inside the WRITE's `length` bytes at `base` (the export's
            // memory, kept as long as the queue's executor, or the slot's buffer, which only
            // this thread touches): what `place` asks to be vouched for.
            if i < s.frags && !bitmap::get(&s.have, i) && plan.scatter.carries(k) == Some(expect) {
                plan.scatter.place(k);
            }
        }
        Some(plan)
    }

    /// Receives the peeked run as `plan` says, then handles each of its datagrams. False when
    /// the receive failed and took nothing.
    fn receive_planned(&mut self, plan: &Plan, sq: &mut dyn Submitter, ud: UserData) -> bool {
        let mut rx = std::mem::take(&mut self.rx[0]);
        let sc = &plan.scatter;
        // SAFETY: an all-zero address is a valid value; the kernel fills it in.
        let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let fd = self.fd.as_raw_fd();
        // SAFETY: every place is a fragment's inside the WRITE's own bytes, as `plan` vouched;
        // nothing has moved since.
        let mut got = unsafe { sc.receive(fd, &mut rx, Some(&mut name)) };
        if got.is_err() {
            // An error the socket had pending (an ICMP one) is reported once, then cleared:
            // the run is still there. Taking it now matters when its first datagram was
            // handled from the peek, which must not be handled twice.
            // SAFETY: as above.
            got = unsafe { sc.receive(fd, &mut rx, Some(&mut name)) };
        }
        // The one reader of this socket takes the datagram it peeked at; anything else means
        // the layout above does not describe what arrived: dropped.
        let Ok(got) = got else {
            self.rx[0] = rx;
            return false;
        };
        if got != Some(sc.len()) || self.peer_of(&name) != Some(plan.peer) {
            self.stats.bad_frames += 1;
            self.rx[0] = rx;
            return true;
        }
        // First every placed datagram is checked where its bytes landed, before any of the
        // run is handled: handling one can give the WRITE's buffer back (it completed, a new
        // generation took the slot, the queue logged out) or copy another datagram over these
        // bytes. One that is not what it was placed as is put back together here.
        let max = self.link_payload.max(4096);
        // SAFETY: placed where `plan` vouched, in a WRITE whose buffer nothing has given back
        // yet (nothing of the run was handled).
        let valid = unsafe {
            sc.check_placed(&mut rx, plan.handled as usize, |k, header, placed| {
                datagram::frame_in_two(header, placed, max)
                    .ok()
                    .map(|f| f.header)
                    .filter(|h| is_fragment(h, &plan.head, plan.first + k as u32))
            })
        };
        let run = plan.handled as usize..sc.segments();
        // Then the fragments that are what they were placed as: distinct fragments of one
        // WRITE, each still missing, so none changes where another lies. They go the way of
        // any fragment but for the copy, which `fragment` skips for the one `in_place` names;
        // the payload they are handed is the unused room of the same length in the receive
        // buffer, so nothing reads the WRITE's bytes from here on.
        for (k, h) in valid.iter().enumerate() {
            let Some(h) = *h else { continue };
            let (header, room) = rx[sc.in_buffer(k)].split_at(HEADER_LEN);
            self.refused_in_datagram = false;
            self.in_place = Some((plan.qi, h.tag.slot(), plan.first + k as u32));
            let f = datagram::Frame {
                header: h,
                payload: room,
                raw: header,
            };
            // One frame to its datagram: there is no walk for a bad one to end.
            let _ = self.on_frame(f, sc.in_buffer(k).len(), plan.peer, sq, ud);
            self.in_place = None;
        }
        // Last, everything else, whole in the receive buffer, as any datagram.
        for (k, v) in valid.iter().enumerate().take(run.end).skip(run.start) {
            if v.is_none() {
                self.on_datagram(&rx[sc.in_buffer(k)], plan.peer, sq, ud);
            }
        }
        self.rx[0] = rx;
        true
    }
}

/// Is `h` fragment `i` of the WRITE whose fragment `head` began the run?
fn is_fragment(h: &Header, head: &Header, i: u32) -> bool {
    h.opcode == Opcode::Write
        && !h.is_reply()
        && (h.session, h.queue, h.tag, h.length, h.frag_count)
            == (
                head.session,
                head.queue,
                head.tag,
                head.length,
                head.frag_count,
            )
        && h.frag_index as u32 == i
        && !h.flags.has(Flags::HAVE)
}
