//! Datagram queues (UDP and raw Ethernet, PROTOCOL.md §9): every frame carries a CRC, messages
//! are fragmented to the negotiated frame payload, lost frames are detected by an adaptive timer
//! and only what is missing is sent again, and a congestion window bounded by the target's credit
//! keeps a fast initiator from overrunning the target.
//!
//! This module holds the queue itself: the slot table (§6), fragments (§9.3) and keepalives
//! (§9.1). Its sockets are in `link`, its loss detection and window in `congestion` (pure, no
//! I/O or clock), discovery (§9.5) in `discover`.

mod congestion;
mod discover;
mod in_place;
mod link;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use blkwire_wire::datagram;
use blkwire_wire::{bitmap, fragment_count, Flags, Header, Opcode, Status, Tag, HEADER_LEN};

use crate::auth::QueueKeys;
use crate::queue::{Cmd, Completion, Parts, QueueStats};
use crate::{Error, Result};

use congestion::{Congestion, Transmission, RTO_INITIAL, RTO_MAX};
pub use discover::{discover_eth, discover_udp, Discovered};
pub(crate) use link::{eth_link, exchange, exchange_plain, udp_link, Link};
use link::{Receiver, Sender};

/// A queue that has sent nothing for this long sends a KEEPALIVE from `poll`, so the target
/// (which forgets a session after 60 s without frames) keeps it (PROTOCOL.md §9.1).
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
/// A probe in flight: a KEEPALIVE whose answer says what the target has (§9.2).
#[derive(Clone, Copy, Debug)]
struct Probe {
    /// Its tag's generation.
    generation: u16,
    /// Frames this queue had sent, the probe included, when it left: the count the target's
    /// answer must match for nothing to have been lost on the way there.
    sent: u64,
    /// When it left: requests sent later are not in question.
    at: Instant,
}

/// Probes whose answers are still taken (the newest ones).
const PROBES_KEPT: usize = 4;

/// Slot number in the tag of internal keepalives: outside every slot table (depth <= 65535), so
/// their answers are told from those of requests and never reach the caller.
const KEEPALIVE_SLOT: u16 = u16::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Free,
    /// Submitted, waiting for the window to open.
    Pending,
    InFlight,
    /// Finished, waiting to be delivered by `complete`.
    Done,
}

struct Slot {
    state: State,
    generation: u16,
    opcode: Opcode,
    flags: u16,
    offset: u64,
    length: u32,
    user: u64,
    /// WRITE: the data to send (kept for retransmission). READ: the reassembly buffer.
    data: Vec<u8>,
    /// READ: fragments received.
    have: Vec<u8>,
    frags: u32,
    got: u32,
    /// Frames this request counts against the window.
    window_frames: u32,
    /// Its latest transmission's timing (§9.2).
    tx: Transmission,
    /// When it fails with EIO if still unanswered: the give-up time from its submission, so
    /// one waiting for the window (a large request goes alone) is bounded too (§9.2).
    give_up_at: Instant,
    status: Status,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: State::Free,
            generation: 0,
            opcode: Opcode::Keepalive,
            flags: 0,
            offset: 0,
            length: 0,
            user: 0,
            data: Vec::new(),
            have: Vec::new(),
            frags: 1,
            got: 0,
            window_frames: 1,
            tx: Transmission::first(Instant::now(), RTO_INITIAL, Duration::ZERO),
            give_up_at: Instant::now(),
            status: Status::Ok,
        }
    }
}

pub(crate) struct DgramQueue {
    /// Owns the sockets `tx` and `rx` use.
    link: Link,
    session: u32,
    index: u16,
    max_io: u32,
    frame_payload: u32,
    slots: Vec<Slot>,
    free: Vec<u16>,
    pending: VecDeque<u16>,
    done: VecDeque<u16>,
    /// Loss detection, timers and window (§9.2, §9.4).
    cc: Congestion,
    /// The target answered ACCESS: it has forgotten this session.
    session_lost: bool,
    give_up: Duration,
    tx: Sender,
    rx: Receiver,
    stats: QueueStats,
    /// Read once per receive batch (RTT samples of one batch share it).
    now: Instant,
    /// The keepalive is due this long after a datagram last went out.
    keepalive_every: Duration,
    /// Generation of the next internal keepalive (its answers are recognised by the slot).
    keepalive_gen: u16,
    /// Reply frames of this queue accepted (right session and queue, CRC or seal good): what
    /// the target's count of frames sent is checked against (PROTOCOL.md §9.2).
    accepted_in: u64,
    /// Probes awaiting their answers, by generation: the counts are cumulative, so a late
    /// answer to an earlier probe still tells what was lost before it.
    probes: [Option<Probe>; PROBES_KEPT],
    /// Frames the target never got and reply frames we never got, as the last probe's answer
    /// showed: a probe finds a new loss when either grew.
    missing: (u64, u64),
    /// A sealed session's frame keys for this queue (PROTOCOL.md §12.4).
    seal: Option<QueueKeys>,
    /// Where an encrypted reply's payload is decrypted.
    scratch: Vec<u8>,
    /// The session's data frames' CRCs cover their header only (§9.7).
    header_crc: bool,
    /// The last datagram handled was a fragment of a READ reply of several: the next receive
    /// peeks first, to take the rest, or the next such reply, in place (`in_place`).
    expect_read_data: bool,
    /// The fragment being handled was received where it belongs (slot, fragment): `on_frame`
    /// has nothing to copy.
    in_place: Option<(u16, u32)>,
}

/// What the target granted a datagram queue.
pub(crate) struct Grant {
    pub session: u32,
    pub index: u16,
    pub depth: u16,
    pub max_io: u32,
    pub frame_payload: u32,
    /// The window of frames the target's first reply granted (§9.4).
    pub credit: u32,
    /// WRITE and READ data frames' CRCs cover their header only (§9.7).
    pub header_crc: bool,
}

impl DgramQueue {
    pub(crate) fn new(
        link: Link,
        g: Grant,
        seal: Option<QueueKeys>,
        give_up: Duration,
        poll: Duration,
    ) -> DgramQueue {
        let Grant {
            session,
            index,
            depth,
            max_io,
            frame_payload,
            credit,
            header_crc,
        } = g;
        let (tx, rx, rx_cap) = link::data_path(&link, frame_payload, max_io, poll);
        DgramQueue {
            scratch: if seal.is_some() {
                vec![0u8; frame_payload as usize + datagram::SEAL_LEN]
            } else {
                Vec::new()
            },
            seal,
            link,
            session,
            index,
            max_io,
            frame_payload,
            slots: (0..depth).map(|_| Slot::new()).collect(),
            free: (0..depth).rev().collect(),
            pending: VecDeque::new(),
            done: VecDeque::new(),
            cc: Congestion::new(credit, rx_cap, Instant::now()),
            session_lost: false,
            give_up,
            tx,
            rx,
            stats: QueueStats::default(),
            now: Instant::now(),
            keepalive_every: KEEPALIVE_EVERY,
            keepalive_gen: 0,
            accepted_in: 0,
            probes: [None; PROBES_KEPT],
            missing: (0, 0),
            header_crc,
            expect_read_data: false,
            in_place: None,
        }
    }

    pub fn index(&self) -> u16 {
        self.index
    }
    /// How long a request is sent again before it is given up (`ConnectOptions::give_up`).
    pub fn give_up_after(&self) -> Duration {
        self.give_up
    }
    pub fn depth(&self) -> usize {
        self.slots.len()
    }
    pub fn max_io(&self) -> u32 {
        self.max_io
    }
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }
    pub fn fd(&self) -> RawFd {
        self.link.fd.as_raw_fd()
    }

    pub fn stats(&self) -> QueueStats {
        let mut s = self.stats;
        s.rto_us = self.cc.rto().as_micros() as u64;
        s.window = self.cc.window() as u64;
        s
    }

    pub fn submit(&mut self, cmd: Cmd<'_>, user: u64) -> Result<()> {
        let Parts {
            opcode,
            offset,
            len,
            flags,
            payload: data,
        } = cmd.parts(self.max_io)?;
        let slot = self
            .free
            .pop()
            .ok_or_else(|| Error::Usage("all queue slots are busy".into()))?;
        let fp = self.frame_payload;
        let s = &mut self.slots[slot as usize];
        // Every request moves its slot's generation on, so the target tells it from a
        // duplicate (§6), but a KEEPALIVE, which the target answers outside its slot table:
        // 32768 of them on one slot (the free list is a stack) made the next request look
        // older than the last the target saw there, dropped as a duplicate until it failed.
        if opcode != Opcode::Keepalive {
            s.generation = s.generation.wrapping_add(1);
        }
        s.state = State::Pending;
        s.give_up_at = crate::deadline::later(Instant::now(), self.give_up);
        s.opcode = opcode;
        s.flags = flags;
        s.offset = offset;
        s.length = len;
        s.user = user;
        s.tx.retransmitted = false;
        s.status = Status::Ok;
        s.got = 0;
        s.have.clear();
        s.frags = 1;
        s.window_frames = 1;
        match opcode {
            Opcode::Write => {
                s.data.clear();
                s.data.extend_from_slice(data);
                s.frags = fragment_count(len, fp);
                s.window_frames = s.frags;
            }
            Opcode::Copy => {
                // The descriptor: one frame, never fragmented (PROTOCOL.md §13), kept for
                // retransmission. A COPY runs for as long as it takes to move its bytes inside
                // the target, so it is no measure of the path: outside the window, the round
                // trip and loss detection, on its own timer (`send`, `timers`).
                s.data.clear();
                s.data.extend_from_slice(data);
                s.window_frames = 0;
            }
            Opcode::Read => {
                // Not zeroed: the request completes only when every fragment has overwritten
                // its part (the HAVE bitmap), so old bytes never reach the caller.
                s.data.resize(len as usize, 0);
                s.frags = fragment_count(len, fp);
                s.have.resize(bitmap::bytes_for(s.frags), 0);
                // Its reply fragments are frames in flight too: they must fit our receive buffer.
                s.window_frames = s.frags;
            }
            _ => {}
        }
        self.pending.push_back(slot);
        Ok(())
    }

    /// Encodes one frame of `slot` into the transmit batch.
    fn push_frame(&mut self, slot: u16, frag: u32, have: bool) {
        let fp = self.frame_payload;
        let s = &self.slots[slot as usize];
        let mut h = Header::request(s.opcode, Tag::new(slot, s.generation), s.offset, s.length);
        h.flags = Flags(s.flags);
        h.queue = self.index;
        h.session = self.session;
        let payload: &[u8] = if have {
            h.flags.0 |= Flags::HAVE;
            &s.have
        } else if s.opcode == Opcode::Write {
            h.frag_index = frag as u16;
            h.frag_count = s.frags as u16;
            h.frag_offset = frag * fp;
            if self.header_crc {
                h.flags.0 |= Flags::HEAD_CRC;
            }
            let start = (frag * fp) as usize;
            let end = (start + fp as usize).min(s.data.len());
            &s.data[start..end]
        } else if s.opcode == Opcode::Copy {
            &s.data
        } else {
            &[]
        };
        // Several requests of this queue share a datagram up to the size the target receives.
        let limit = HEADER_LEN + fp as usize;
        let full = if s.opcode == Opcode::Write && !have && self.seal.is_none() {
            // A WRITE's data leaves from the slot, gathered by the kernel, not copied here
            // first (a 1 MiB write is copied once on this side, into the socket).
            // SAFETY: `payload` lies in `s.data`, which is neither written nor reallocated
            // until the slot is delivered, and `deliver` sends the batch before it frees any
            // slot.
            unsafe {
                self.tx
                    .push_lent(&h, payload.as_ptr(), payload.len(), limit)
            }
        } else {
            push(&mut self.tx, &mut self.seal, h, payload, limit)
        };
        self.stats.frames_out += 1;
        if full {
            let _ = self.tx.flush(&mut self.stats);
        }
    }

    /// Sends every encoded frame.
    fn flush_tx(&mut self) -> Result<()> {
        self.tx.flush(&mut self.stats)
    }

    /// Moves pending requests into flight as far as the window allows (§9.4), and sends.
    pub fn send(&mut self) -> Result<()> {
        let now = Instant::now();
        while let Some(&slot) = self.pending.front() {
            let need = self.slots[slot as usize].window_frames;
            if !self.cc.admits(need) {
                break;
            }
            self.pending.pop_front();
            let s = &mut self.slots[slot as usize];
            s.state = State::InFlight;
            let rto = if s.opcode == Opcode::Copy {
                RTO_MAX
            } else {
                self.cc.rto()
            };
            s.tx = Transmission::first(now, rto, self.give_up);
            s.tx.give_up_at = s.give_up_at;
            self.cc.on_send(need);
            let frags = if s.opcode == Opcode::Write {
                s.frags
            } else {
                1
            };
            for f in 0..frags {
                self.push_frame(slot, f, false);
            }
        }
        self.flush_tx()
    }

    pub fn complete(&mut self, min: usize, mut f: impl FnMut(Completion<'_>)) -> Result<usize> {
        self.send()?;
        let mut delivered = self.deliver(&mut f);
        while delivered < min {
            if self.in_flight() == 0 {
                return Err(Error::Usage(
                    "waiting for completions with nothing in flight".into(),
                ));
            }
            let got = self.receive()?;
            if self.session_lost {
                return Err(Error::SessionLost);
            }
            if got == 0 {
                let (slots, cc) = (&self.slots, &self.cc);
                self.rx.wait(|| timer_deadline(slots, cc))?;
            }
            self.timers()?;
            self.send()?;
            delivered += self.deliver(&mut f);
        }
        Ok(delivered)
    }

    /// `complete` without waiting: sends, takes what has arrived, runs the timers and the
    /// keepalive of an idle queue, and delivers what finished.
    pub fn poll(&mut self, mut f: impl FnMut(Completion<'_>)) -> Result<usize> {
        self.send()?;
        self.receive()?;
        if self.session_lost {
            return Err(Error::SessionLost);
        }
        self.timers()?;
        // Answers and give-ups free room in the window.
        self.send()?;
        if Instant::now() >= self.tx.last_sent() + self.keepalive_every {
            self.keepalive()?;
        }
        Ok(self.deliver(&mut f))
    }

    /// When `poll` must run even if no frame arrives: the earliest retransmission, give-up or
    /// tail-loss probe timer, or the keepalive.
    pub fn deadline(&self) -> Option<Instant> {
        let keepalive = self.tx.last_sent() + self.keepalive_every;
        Some(timer_deadline(&self.slots, &self.cc).map_or(keepalive, |t| t.min(keepalive)))
    }

    /// Sends a KEEPALIVE outside the slot table. It is not retransmitted: the next one follows
    /// `keepalive_every` later, well within the target's expiry. Its answer is dropped in
    /// `on_frame`, unless it is ACCESS: the target has forgotten the session after all.
    fn keepalive(&mut self) -> Result<()> {
        self.send_keepalive();
        self.flush_tx()
    }

    /// Queues a KEEPALIVE; returns its generation.
    fn send_keepalive(&mut self) -> u16 {
        self.keepalive_gen = self.keepalive_gen.wrapping_add(1);
        let tag = Tag::new(KEEPALIVE_SLOT, self.keepalive_gen);
        let mut h = Header::request(Opcode::Keepalive, tag, 0, 0);
        h.queue = self.index;
        h.session = self.session;
        push(&mut self.tx, &mut self.seal, h, &[], 0);
        self.stats.frames_out += 1;
        self.keepalive_gen
    }

    fn deliver(&mut self, f: &mut impl FnMut(Completion<'_>)) -> usize {
        if self.done.is_empty() {
            return 0;
        }
        // The batch may point at WRITE data of the slots about to be freed (`push_frame`):
        // it leaves before they can be reused. Normally empty here already; a failed send
        // loses frames as the network may, and the retransmission timer recovers them.
        let _ = self.flush_tx();
        let mut n = 0;
        while let Some(slot) = self.done.pop_front() {
            let s = &mut self.slots[slot as usize];
            s.state = State::Free;
            let data: &[u8] = if s.opcode == Opcode::Read && s.status == Status::Ok {
                &s.data
            } else {
                &[]
            };
            f(Completion {
                user: s.user,
                length: s.length,
                status: s.status,
                data,
            });
            self.free.push(slot);
            n += 1;
        }
        n
    }

    /// Reads every frame waiting; returns how many arrived.
    fn receive(&mut self) -> Result<usize> {
        self.now = Instant::now();
        // Runs of READ data first, in place, while they keep coming (at most a batch's worth:
        // the timers must get their turn).
        let mut taken = 0;
        while self.expect_read_data && self.rx.scatters() {
            if taken == link::BATCH {
                // A batch's worth: the rest on the next call, after the timers.
                return Ok(taken);
            }
            match self.receive_in_place()? {
                in_place::Peeked::Taken => taken += 1,
                in_place::Peeked::Empty => return Ok(taken),
                in_place::Peeked::Other => break,
            }
        }
        // Lent out: each datagram is handled by the rest of the queue while the receiver walks.
        let mut rx = std::mem::take(&mut self.rx);
        let r = rx.receive(|d, coalesced| {
            self.stats.datagrams_in += 1;
            self.stats.coalesced_in += coalesced as u64;
            self.on_datagram(d);
        });
        self.rx = rx;
        Ok(r? + taken)
    }

    /// One received datagram: every frame packed in it (PROTOCOL.md §9.6).
    fn on_datagram(&mut self, b: &[u8]) {
        self.expect_read_data = false;
        let mut scratch = std::mem::take(&mut self.scratch);
        for f in datagram::frames(b, self.frame_payload) {
            self.stats.frames_in += 1;
            let f = match f {
                Ok(f) => f,
                // Malformed, truncated, mixed or without a valid CRC32C: dropped, counted.
                Err(_) => {
                    self.stats.crc_errors += 1;
                    continue;
                }
            };
            // A sealed session believes only frames whose seal opens (PROTOCOL.md §12.4),
            // except a bare ACCESS: the target forgot the session, and a new handshake (which
            // proves the target again) is all it can cause.
            let payload = match (&mut self.seal, f.sealed()) {
                (None, false) => f.payload,
                (Some(k), true) => match k.opener.open(f.raw, HEADER_LEN, &mut scratch) {
                    Ok(p) => p,
                    Err(_) => {
                        self.stats.bad_seals += 1;
                        continue;
                    }
                },
                (Some(_), false) if f.header.status == Status::Access && f.payload.is_empty() => {
                    self.on_bare_access(&f.header);
                    continue;
                }
                _ => {
                    self.stats.bad_seals += 1;
                    continue;
                }
            };
            self.on_frame(&f.header, payload);
        }
        self.scratch = scratch;
    }

    /// An unsealed ACCESS in a sealed session (PROTOCOL.md §12.4): the target restarted or
    /// forgot the session. All it may cause is a new handshake, and only when it answers
    /// something this queue sent (a request in flight or a recent keepalive, by tag): anyone
    /// can forge it, so it never moves the credit, the counters a probe compares, or a slot.
    fn on_bare_access(&mut self, h: &Header) {
        let (slot, generation) = (h.tag.slot(), h.tag.generation());
        let ours = h.is_reply()
            && h.session == self.session
            && h.queue == self.index
            && if slot == KEEPALIVE_SLOT && h.opcode == Opcode::Keepalive {
                self.keepalive_gen.wrapping_sub(generation) < PROBES_KEPT as u16
            } else {
                self.slots.get(slot as usize).is_some_and(|s| {
                    s.state == State::InFlight && s.generation == generation && s.opcode == h.opcode
                })
            };
        if ours {
            self.session_lost = true;
        } else {
            self.stats.late_replies += 1;
        }
    }

    fn on_frame(&mut self, h: &Header, payload: &[u8]) {
        if !h.is_reply() || h.session != self.session || h.queue != self.index {
            self.stats.late_replies += 1;
            return;
        }
        // Only READ data may leave its payload to UDP's checksum, and only if we asked (§9.7):
        // anything else with a header-only CRC is taken for a damaged frame.
        if h.flags.has(Flags::HEAD_CRC)
            && !(self.header_crc
                && h.opcode == Opcode::Read
                && h.status == Status::Ok
                && !payload.is_empty())
        {
            self.stats.crc_errors += 1;
            return;
        }
        self.cc.on_credit(h.credit);
        let slot = h.tag.slot();
        if slot == KEEPALIVE_SLOT && h.opcode == Opcode::Keepalive {
            // Our own keepalive's answer: nothing to deliver. ACCESS means the session is gone
            // (an idle queue learns it here rather than from its next request).
            if h.status == Status::Access {
                self.session_lost = true;
            }
            let kept = &mut self.probes[h.tag.generation() as usize % PROBES_KEPT];
            if let Some(p) = kept.filter(|p| p.generation == h.tag.generation()) {
                *kept = None;
                self.probe_answered(p, payload);
            }
            self.accepted_in += 1;
            return;
        }
        if h.opcode == Opcode::Join {
            // A JOIN sent again while the first answer was on its way: answered twice, the
            // second after the queue was made. The target counts no JOIN answer among the
            // frames it sent (§9.2), so neither do we, or the next probe sees a loss.
            self.stats.late_replies += 1;
            return;
        }
        self.accepted_in += 1;
        let fp = self.frame_payload;
        let Some(s) = self.slots.get_mut(slot as usize) else {
            self.stats.late_replies += 1;
            return;
        };
        // §6: only the generation in flight on that slot is answered; anything else is late.
        // A reply carries its request's offset and length (§3; a COPY's length is the bytes
        // copied): one that does not is an older request's that the generation, 16 bits, no
        // longer tells apart, and its data must not be taken for this one's.
        if s.state != State::InFlight
            || s.generation != h.tag.generation()
            || s.opcode != h.opcode
            || h.offset != s.offset
            || (s.opcode != Opcode::Copy && h.length != s.length)
        {
            self.stats.late_replies += 1;
            return;
        }
        self.cc.on_progress(self.now);
        if h.flags.has(Flags::HAVE) {
            if s.opcode != Opcode::Write || h.status != Status::Ok {
                // Only a WRITE's fragments are acknowledged (§9.3). A READ would have each
                // "missing" fragment resent as the whole request, and each of those answered
                // with the whole reply: one forged frame asking for up to 256 of them.
                self.stats.late_replies += 1;
                return;
            }
            // The target holds part of a WRITE: send exactly what it lacks (PROTOCOL.md §9.3).
            let missing: Vec<u32> = (0..s.frags).filter(|&i| !bitmap::get(payload, i)).collect();
            s.tx.refresh(self.now);
            self.stats.retransmits += missing.len() as u64;
            for i in missing {
                self.push_frame(slot, i, false);
            }
            let _ = self.flush_tx();
            return;
        }
        if h.status == Status::Access {
            // Only a target that does not know our session answers an I/O frame with ACCESS
            // (PROTOCOL.md §9.1): the whole queue is gone, not this request.
            self.session_lost = true;
            return;
        }
        if h.status != Status::Ok || s.opcode != Opcode::Read {
            s.status = h.status;
            if s.opcode == Opcode::Copy {
                // A COPY's answer is in its length: the bytes copied (PROTOCOL.md §13).
                s.length = h.length;
            }
            return self.finish(slot);
        }
        // A READ fragment.
        let idx = h.frag_index as u32;
        let expect_len = (s.length - (idx * fp).min(s.length)).min(fp);
        if h.frag_count as u32 != s.frags
            || h.frag_offset != idx * fp
            || h.payload_len != expect_len
        {
            self.stats.late_replies += 1;
            return;
        }
        if bitmap::get(&s.have, idx) {
            self.stats.duplicates += 1;
            return;
        }
        // Received where it belongs already (`in_place`): nothing to copy. Its payload is not
        // its bytes, so one that turns out to be another fragment is dropped, never copied.
        match self.in_place.take() {
            None => {
                let at = h.frag_offset as usize;
                s.data[at..at + payload.len()].copy_from_slice(payload);
            }
            Some(p) if p == (slot, idx) => self.stats.fragments_in_place += 1,
            Some(_) => {
                self.stats.late_replies += 1;
                return;
            }
        }
        bitmap::set(&mut s.have, idx);
        s.got += 1;
        // More of this reply, or the next of a stream of large READs, is likely next.
        self.expect_read_data = s.length >= in_place::IN_PLACE_MIN && self.seal.is_none();
        if s.got == s.frags {
            self.finish(slot);
        }
    }

    /// A request is answered: the window and round trip learn from it, and it is queued for
    /// delivery.
    fn finish(&mut self, slot: u16) {
        self.finish_as(slot, true);
    }

    /// `finish`, of a request `answered` or given up unanswered (`timers`), which teaches the
    /// congestion state nothing.
    fn finish_as(&mut self, slot: u16, answered: bool) {
        let s = &mut self.slots[slot as usize];
        // One still waiting for the window (given up, `give_up`) never counted against it.
        let windowed = s.state == State::InFlight && s.opcode != Opcode::Copy;
        s.state = State::Done;
        if s.status != Status::Ok {
            self.stats.errors += 1;
        }
        if windowed {
            if answered {
                self.cc.on_finish(&s.tx, s.window_frames, self.now);
            } else {
                self.cc.on_give_up(s.window_frames);
            }
        }
        self.done.push_back(slot);
    }

    /// A request past its give-up time, unanswered: EIO (§9.2), and for a COPY nothing known
    /// copied (PROTOCOL.md §13).
    fn give_up(&mut self, slot: u16) {
        let s = &mut self.slots[slot as usize];
        s.status = Status::Io;
        if s.opcode == Opcode::Copy {
            s.length = 0;
        }
        self.stats.timeouts += 1;
        self.finish_as(slot, false);
    }

    /// Finds what may be lost and gives up on what is past its give-up time (§9.2). A request
    /// is taken for lost when its timer fires, or earlier when a request sent more than a
    /// reordering window after it has already been answered (frames on one link do not overtake
    /// each other by more); the first time, a probe asks the target (`probe_answered` resends
    /// what its counts show missing), the second time it is sent again.
    fn timers(&mut self) -> Result<()> {
        let now = Instant::now();
        let mut lost = false;
        let mut suspected = false;
        let pass = self.cc.begin_pass(now);
        if pass.scan {
            for slot in 0..self.slots.len() as u16 {
                let s = &mut self.slots[slot as usize];
                if s.state == State::Pending && now >= s.give_up_at {
                    // Never admitted to the window (a large request waits to go alone, or
                    // the window shrank): given up as one in flight would be.
                    self.pending.retain(|&p| p != slot);
                    self.give_up(slot);
                    continue;
                }
                if s.state != State::InFlight {
                    continue;
                }
                if s.tx.expired(now) {
                    self.give_up(slot);
                    continue;
                }
                if s.opcode == Opcode::Copy {
                    // Its own timer only, and no sign of a congested path (see `submit`).
                    if now >= s.tx.sent_at + s.tx.rto {
                        self.resend(slot, now);
                    }
                    continue;
                }
                if !self.cc.lost(&s.tx, &pass, now) {
                    continue;
                }
                if s.tx.suspected_at.is_none() {
                    // Taken for lost by its timer or by RACK: its timer backs off and the
                    // probe below asks whether it really was.
                    s.tx.suspect(now);
                    suspected = true;
                } else {
                    // Asked about, and still unanswered a backed-off timer later: sent again
                    // whatever the counts said (a WRITE whose fragment 0 was lost with others
                    // is only completed by a repeated fragment 0 and the HAVE it draws, §9.3),
                    // and the target drops or re-answers a copy it already holds (§6).
                    self.resend(slot, now);
                    lost = true;
                }
            }
        }
        // Nothing is resent on a first suspicion (§9.2): a storage target's answers are late
        // for reasons no timer tells from loss (a slow disk, a descheduled thread), and an
        // answer overtaken by a later one may just have had the slower I/O. A request taken
        // for lost, or silence for a probe timeout (the tail-loss probe of RFC 8985 §7:
        // packing can put a whole burst in one lost datagram), sends a probe: a KEEPALIVE whose
        // answer counts what the target received and sent, so only frames really lost are sent
        // again. An unanswered probe is followed by another, each waiting twice as long.
        if suspected || (!lost && self.cc.probe_due(now)) {
            let generation = self.send_keepalive();
            self.probes[generation as usize % PROBES_KEPT] = Some(Probe {
                generation,
                sent: self.stats.frames_out,
                at: now,
            });
            self.stats.probes += 1;
            self.cc.on_probe(now);
        }
        self.cc.end_pass(&pass, lost, now);
        self.flush_tx()
    }

    /// The answer to a probe: `payload` is the target's count of this queue's frames
    /// it received (the probe included) and of frames it sent before the answer (§9.2). When
    /// what went missing each way is what the previous answer showed, nothing was lost since
    /// and the requests in flight are merely slow: nothing is resent. Otherwise (or a target
    /// that does not count) every request sent before the
    /// probe that is still in flight is sent again: the target drops what it already has, and
    /// re-answers what it finished (§6).
    fn probe_answered(&mut self, p: Probe, payload: &[u8]) {
        let counts = (payload.len() == 16).then(|| {
            let word =
                |i: usize| u64::from_le_bytes(payload[i..i + 8].try_into().expect("8 bytes"));
            (word(0), word(8))
        });
        // What went missing each way so far; more than at the last probe is a new loss.
        let missing = counts.map(|(taken, sent)| {
            (
                p.sent.wrapping_sub(taken),
                sent.wrapping_sub(self.accepted_in),
            )
        });
        if missing.is_some() && missing == Some(self.missing) {
            return;
        }
        if let Some(m) = missing {
            self.missing = m;
        }
        let now = Instant::now();
        self.cc.on_loss(now);
        for slot in 0..self.slots.len() as u16 {
            let s = &self.slots[slot as usize];
            if s.state == State::InFlight && s.opcode != Opcode::Copy && s.tx.sent_at <= p.at {
                self.resend(slot, now);
            }
        }
    }

    /// Sends an in-flight request again, with its timer backed off.
    fn resend(&mut self, slot: u16, now: Instant) {
        let s = &mut self.slots[slot as usize];
        s.tx.resend(now);
        self.stats.retransmits += 1;
        match s.opcode {
            // Only fragment 0: the target answers with what it holds (HAVE, §9.3).
            Opcode::Write => self.push_frame(slot, 0, false),
            // Ask only for the fragments still missing.
            Opcode::Read if s.got > 0 => self.push_frame(slot, 0, true),
            _ => self.push_frame(slot, 0, false),
        }
    }

    pub fn logout(&mut self) -> Result<()> {
        let mut h = Header::request(Opcode::Logout, Tag::new(0, 0), 0, 0);
        h.queue = self.index;
        h.session = self.session;
        push(&mut self.tx, &mut self.seal, h, &[], 0);
        self.flush_tx()
    }

    /// Test hook: sends raw bytes as one frame (to replay stale or forged frames).
    pub(crate) fn send_raw(&mut self, frame: &[u8]) -> Result<()> {
        self.tx.push_raw(frame);
        self.flush_tx()
    }

    pub(crate) fn session(&self) -> u32 {
        self.session
    }
}

/// A datagram session has no connection whose close the target would see: a queue dropped
/// says LOGOUT (once, unanswered: a lost one leaves the queue to the target's idle expiry), so
/// a finished `cp` or `bench` does not hold the target's memory for a minute.
impl Drop for DgramQueue {
    fn drop(&mut self) {
        let _ = self.logout();
    }
}

/// Adds one request frame to the transmit batch, sealed if the session is; true when the batch
/// is full.
fn push(
    tx: &mut Sender,
    seal: &mut Option<QueueKeys>,
    mut h: Header,
    payload: &[u8],
    limit: usize,
) -> bool {
    match seal {
        Some(k) => {
            let limit = if limit > 0 {
                limit + datagram::SEAL_LEN
            } else {
                0
            };
            tx.push_sealed(&h, payload, limit, |f| k.sealer.seal(f, HEADER_LEN))
        }
        None => {
            h.payload_len = payload.len() as u32;
            h.seal_crc(payload);
            tx.push(&h, payload, limit)
        }
    }
}

/// The earliest timer of the requests in flight (a retransmission or give-up), of those waiting
/// for the window (their give-up), or the tail-loss probe.
fn timer_deadline(slots: &[Slot], cc: &Congestion) -> Option<Instant> {
    // Slot timers are acted on only by a pass that scans (`Congestion::begin_pass`): one due
    // before the next scan is asked for then, or the caller's wait returned at once, over and
    // over, until the scan came (a busy loop of up to SRTT / 8).
    let scan = cc.next_scan();
    slots
        .iter()
        .filter_map(|s| match s.state {
            State::InFlight => Some(s.tx.deadline().max(scan)),
            State::Pending => Some(s.give_up_at.max(scan)),
            _ => None,
        })
        .chain(cc.probe_deadline())
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_wire::datagram::Packer;
    use std::net::UdpSocket;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A stand-in target on loopback: answers every READ frame of one datagram with 0x5a bytes,
    /// or drops the datagram; returns how many frames it carried (0: none came in `wait`).
    fn answer(target: &UdpSocket, drop: bool, wait: Duration) -> usize {
        answer_with(target, (!drop).then_some(Status::Ok), wait)
    }

    /// `answer` with any status: `None` drops the datagram; a status other than OK is sent
    /// without data (as a target that refuses or does not know the session does).
    fn answer_with(target: &UdpSocket, status: Option<Status>, wait: Duration) -> usize {
        let drop = status.is_none();
        let status = status.unwrap_or(Status::Ok);
        let mut buf = vec![0u8; 65536];
        target.set_read_timeout(Some(wait)).unwrap();
        let Ok((n, from)) = target.recv_from(&mut buf) else {
            return 0;
        };
        let mut frames = 0;
        for f in datagram::frames(&buf[..n], 65536) {
            let h = f.expect("valid request frame").header;
            frames += 1;
            if drop {
                continue;
            }
            let len = if status == Status::Ok { h.length } else { 0 };
            let data = vec![0x5a; len as usize];
            let mut r = h.reply(status, data.len() as u32);
            r.seal_crc(&data);
            let mut out = r.to_bytes().to_vec();
            out.extend_from_slice(&data);
            target.send_to(&out, from).expect("reply");
        }
        frames
    }

    #[test]
    fn a_lost_burst_is_recovered_by_a_probe_not_by_the_timers() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        // Retransmission timers 1 s away: only the probe can recover the burst before that.
        q.cc.set_rto_min(congestion::RTO_MAX);
        let wait = Duration::from_secs(5);
        // Round trips to learn from.
        for i in 0..20 {
            q.submit(
                Cmd::Read {
                    offset: 0,
                    len: 512,
                },
                i,
            )
            .unwrap();
            q.send().unwrap();
            assert_eq!(answer(&target, false, wait), 1);
            q.complete(1, |c| assert_eq!(c.status, Status::Ok)).unwrap();
        }
        let before = q.stats();
        let done = AtomicBool::new(false);
        let (dropped, served) = std::thread::scope(|s| {
            // The stand-in loses the next datagram, then answers everything until told to stop.
            let t = s.spawn(|| {
                let dropped = answer(&target, true, wait);
                let mut served = 0;
                while !done.load(Ordering::Relaxed) {
                    served += answer(&target, false, Duration::from_millis(20));
                }
                (dropped, served)
            });
            // A burst of 8 reads travels in one datagram: the one that is lost.
            for i in 0..8 {
                let read = Cmd::Read {
                    offset: 512 * i,
                    len: 512,
                };
                q.submit(read, 100 + i).unwrap();
            }
            q.send().unwrap();
            assert_eq!(q.stats().datagrams_out - before.datagrams_out, 1);
            let mut got = 0;
            while got < 8 {
                got += q
                    .complete(1, |c| {
                        assert_eq!(c.status, Status::Ok);
                        assert!(c.data.iter().all(|&b| b == 0x5a));
                    })
                    .unwrap();
            }
            done.store(true, Ordering::Relaxed);
            t.join().unwrap()
        });
        let st = q.stats();
        assert_eq!(dropped, 8);
        assert!(served >= 8);
        let probes = st.probes - before.probes;
        assert!(probes >= 1, "no tail-loss probe: {st:?}");
        // The stand-in answers the probe without counts (a target that does not keep them):
        // every request sent before it is sent again, once each. (A later probe or the second
        // timer of a request can send one again before its answer is in.)
        let retransmits = st.retransmits - before.retransmits;
        assert!(
            (8..=probes + 7).contains(&retransmits),
            "8 lost requests need 8 to {} retransmissions: {st:?}",
            probes + 7
        );
        assert_eq!(st.timeouts, 0);
    }

    /// A stand-in target that keeps the counts of PROTOCOL.md §9.2: frames taken in and sent,
    /// reported in its answers to KEEPALIVE.
    struct CountingTarget {
        sock: UdpSocket,
        taken: u64,
        sent: u64,
        /// READs held unanswered (a slow backend), with where to answer them.
        held: Vec<(Header, std::net::SocketAddr)>,
    }

    impl CountingTarget {
        /// Takes one datagram: loses it whole (`lose`), or answers its KEEPALIVEs with the
        /// counts and its READs with 0x5a bytes, or holds the READs (`hold`). Returns
        /// (frames, keepalives) it carried; (0, 0) when none came within `wait`.
        fn step(&mut self, lose: bool, hold: bool, wait: Duration) -> (usize, usize) {
            let mut buf = vec![0u8; 65536];
            self.sock.set_read_timeout(Some(wait)).unwrap();
            let Ok((n, from)) = self.sock.recv_from(&mut buf) else {
                return (0, 0);
            };
            let (mut frames, mut keepalives) = (0, 0);
            for f in datagram::frames(&buf[..n], 65536) {
                let h = f.expect("valid request frame").header;
                frames += 1;
                if lose {
                    continue;
                }
                self.taken += 1;
                if h.opcode == Opcode::Keepalive {
                    keepalives += 1;
                    let mut counts = self.taken.to_le_bytes().to_vec();
                    counts.extend_from_slice(&self.sent.to_le_bytes());
                    self.send(h.reply(Status::Ok, 0), &counts, from);
                } else if hold {
                    self.held.push((h, from));
                } else {
                    self.send(
                        h.reply(Status::Ok, h.length),
                        &vec![0x5a; h.length as usize],
                        from,
                    );
                }
            }
            (frames, keepalives)
        }

        /// Takes datagrams, answering the probes among them, until `n` READs have come (held
        /// or answered as `hold` says): a probe may come before or between them.
        fn reads(&mut self, n: usize, hold: bool, wait: Duration) {
            let mut reads = 0;
            while reads < n {
                let (frames, keepalives) = self.step(false, hold, wait);
                reads += frames - keepalives;
            }
        }

        fn release(&mut self) {
            for (h, from) in std::mem::take(&mut self.held) {
                self.send(
                    h.reply(Status::Ok, h.length),
                    &vec![0x5a; h.length as usize],
                    from,
                );
            }
        }

        fn send(&mut self, mut r: Header, payload: &[u8], to: std::net::SocketAddr) {
            r.payload_len = payload.len() as u32;
            r.seal_crc(payload);
            let mut out = r.to_bytes().to_vec();
            out.extend_from_slice(payload);
            self.sock.send_to(&out, to).expect("reply");
            self.sent += 1;
        }
    }

    /// Fragment `i` of the reply to READ `req` whose data is `data`, with its CRC.
    fn read_fragment(req: &Header, data: &[u8], fp: u32, i: usize) -> Vec<u8> {
        let piece = data.chunks(fp as usize).nth(i).unwrap();
        let mut r = req.reply(Status::Ok, 0);
        r.frag_count = data.len().div_ceil(fp as usize) as u16;
        r.frag_index = i as u16;
        r.frag_offset = i as u32 * fp;
        r.payload_len = piece.len() as u32;
        r.seal_crc(piece);
        let mut v = r.to_bytes().to_vec();
        v.extend_from_slice(piece);
        v
    }

    /// Sends `frames` (equal lengths but for a shorter last) from `from` to `to` as one
    /// segmented send, as a target sends a run of READ data.
    fn send_run(from: &UdpSocket, to: std::net::SocketAddr, frames: &[Vec<u8>]) {
        from.connect(to).unwrap();
        blkwire_net::testing::send_run(from, frames);
    }

    /// A queue of 4 KiB frames with READs of `a` (at 0) and `b` (at 1 MiB) in flight, and its
    /// stand-in target: (target, queue, READ a's header, READ b's header, the queue's address).
    fn two_reads(
        fp: u32,
        a: &[u8],
        b: &[u8],
    ) -> (UdpSocket, DgramQueue, Header, Header, std::net::SocketAddr) {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let mut q = test_queue(link, grant(8, 64 << 10, fp), None);
        for (offset, len, user) in [(0, a.len(), 1), (1 << 20, b.len(), 2)] {
            q.submit(
                Cmd::Read {
                    offset,
                    len: len as u32,
                },
                user,
            )
            .unwrap();
        }
        q.send().unwrap();
        let mut buf = vec![0u8; 65536];
        target
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let (mut reqs, mut from) = (Vec::new(), None);
        while reqs.len() < 2 {
            let (n, f) = target.recv_from(&mut buf).unwrap();
            from = Some(f);
            for f in datagram::frames(&buf[..n], 65536) {
                reqs.push(f.unwrap().header);
            }
        }
        let (ra, rb) = match reqs[0].offset {
            0 => (reqs[0], reqs[1]),
            _ => (reqs[1], reqs[0]),
        };
        (target, q, ra, rb, from.unwrap())
    }

    /// Waits (up to 5 s) until `q` has received `datagrams` datagrams, then for `reads` READs
    /// to complete; returns the completions, by user data.
    fn completions(
        q: &mut DgramQueue,
        datagrams: u64,
        reads: usize,
    ) -> Vec<(u64, Status, Vec<u8>)> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut done = Vec::new();
        while (q.stats().datagrams_in < datagrams || done.len() < reads)
            && Instant::now() < deadline
        {
            q.rx.wait(|| Some(deadline)).unwrap();
            q.poll(|c| done.push((c.user, c.status, c.data.to_vec())))
                .unwrap();
        }
        done.sort_by_key(|d| d.0);
        done
    }

    /// A run whose datagrams are not all placed: A's fragment 3 comes second, where fragment 2
    /// (held already) would go, and B's first fragment comes third, placed where A's fragment 3
    /// goes. Every placed datagram is checked before any of the run is handled, so handling A's
    /// fragment 3 cannot spoil B's before it is looked at: both READs complete whole.
    #[test]
    fn a_run_out_of_order_loses_nothing() {
        let fp = 4096u32;
        let a: Vec<u8> = (0..9 * fp + 1000).map(|i| (i % 239) as u8).collect();
        let b: Vec<u8> = (0..2 * fp).map(|i| (i % 11) as u8 + 70).collect();
        let (target, mut q, ra, rb, to) = two_reads(fp, &a, &b);
        let frag_a = |i| read_fragment(&ra, &a, fp, i);
        for i in [0, 2] {
            target.send_to(&frag_a(i), to).unwrap();
        }
        assert!(completions(&mut q, 2, 0).is_empty());
        send_run(
            &target,
            to,
            &[frag_a(1), frag_a(3), read_fragment(&rb, &b, fp, 0)],
        );
        assert!(completions(&mut q, 5, 0).is_empty());
        assert_eq!(q.stats().fragments_in_place, 1, "A's fragment 1 only");
        assert_eq!(q.stats().crc_errors, 0, "nothing spoiled");
        for d in (4..10).map(frag_a).chain([read_fragment(&rb, &b, fp, 1)]) {
            target.send_to(&d, to).unwrap();
        }
        let done = completions(&mut q, 12, 2);
        assert_eq!(done.len(), 2, "both READs complete");
        assert!(done[0].2 == a && done[1].2 == b, "each with its own bytes");
    }

    /// Only READs of IN_PLACE_MIN or more make the next receive peek: a fragment of a smaller
    /// one leaves the queue reading the usual way.
    #[test]
    fn only_large_reads_make_the_next_receive_peek() {
        let fp = 4096u32;
        let small = vec![3u8; 4 * fp as usize];
        let large = vec![4u8; 9 * fp as usize];
        let (target, mut q, ra, rb, to) = two_reads(fp, &large, &small);
        for (req, data, expect) in [(&rb, &small, false), (&ra, &large, true)] {
            target
                .send_to(&read_fragment(req, data, fp, 0), to)
                .unwrap();
            let seen = q.stats().datagrams_in;
            completions(&mut q, seen + 1, 0);
            assert_eq!(q.expect_read_data, expect, "a READ of {} bytes", data.len());
        }
    }

    /// READ data that comes as a run while a reply of several fragments is coming goes
    /// straight into the request's buffer. In the run, a damaged fragment and one of another
    /// READ are handled as any datagram (dropped; taken for its own READ), and both READs
    /// complete with their own bytes once the missing fragments come.
    #[test]
    fn read_data_in_a_run_is_received_where_it_belongs() {
        let fp = 4096u32;
        let a: Vec<u8> = (0..9 * fp + 1000).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..2 * fp).map(|i| (i % 13) as u8 + 100).collect();
        let (target, mut q, ra, rb, to) = two_reads(fp, &a, &b);
        let frag_a = |i| read_fragment(&ra, &a, fp, i);
        // Fragment 0 the usual way: the queue then expects more of it.
        target.send_to(&frag_a(0), to).unwrap();
        let mut done = Vec::new();
        let mut collect = |q: &mut DgramQueue| {
            q.poll(|c| done.push((c.user, c.status, c.data.to_vec())))
                .unwrap();
        };
        while q.stats().frames_in < 1 {
            q.rx.wait(|| None).unwrap();
            collect(&mut q);
        }
        // Placed as fragments 1 to 5 of A: the second is damaged, the fourth is B's first.
        let mut damaged = frag_a(2);
        damaged[HEADER_LEN + 10] ^= 1;
        let run = [
            frag_a(1),
            damaged,
            frag_a(3),
            read_fragment(&rb, &b, fp, 0),
            frag_a(5),
        ];
        send_run(&target, to, &run);
        while q.stats().datagrams_in < 6 {
            q.rx.wait(|| None).unwrap();
            collect(&mut q);
        }
        let st = q.stats();
        assert_eq!(st.fragments_in_place, 3, "A's fragments 1, 3 and 5");
        assert_eq!(st.crc_errors, 1, "the damaged one");
        assert!(done.is_empty(), "neither READ complete");
        for d in [2, 4, 6, 7, 8, 9].map(frag_a) {
            target.send_to(&d, to).unwrap();
        }
        target.send_to(&read_fragment(&rb, &b, fp, 1), to).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut done = Vec::new();
        while done.len() < 2 && Instant::now() < deadline {
            q.rx.wait(|| Some(deadline)).unwrap();
            q.poll(|c| done.push((c.user, c.status, c.data.to_vec())))
                .unwrap();
        }
        done.sort_by_key(|d| d.0);
        assert_eq!(done.len(), 2, "both READs complete");
        assert_eq!((done[0].1, done[1].1), (Status::Ok, Status::Ok));
        assert!(done[0].2 == a, "A's own bytes");
        assert!(
            done[1].2 == b,
            "B's own bytes, its first fragment from A's run"
        );
    }

    /// An idle queue and a counting stand-in for its target.
    fn counting_pair() -> (DgramQueue, CountingTarget) {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let q = idle_queue(&sock);
        let t = CountingTarget {
            sock,
            taken: 0,
            sent: 0,
            held: Vec::new(),
        };
        (q, t)
    }

    /// Submits `n` 512-byte READs in one datagram and completes them while `target` runs in a
    /// thread; returns the queue's counters.
    fn reads_against(q: &mut DgramQueue, n: u64, target: impl FnOnce() + Send) -> QueueStats {
        std::thread::scope(|s| {
            let t = s.spawn(target);
            for i in 0..n {
                let read = Cmd::Read {
                    offset: 512 * i,
                    len: 512,
                };
                q.submit(read, i).unwrap();
            }
            q.send().unwrap();
            let mut got = 0;
            while got < n as usize {
                got += q
                    .complete(1, |c| {
                        assert_eq!(c.status, Status::Ok);
                        assert!(c.data.iter().all(|&b| b == 0x5a));
                    })
                    .unwrap();
            }
            t.join().unwrap();
        });
        q.stats()
    }

    #[test]
    fn a_slow_target_is_asked_by_probes_and_nothing_is_resent() {
        let (mut q, mut t) = counting_pair();
        let wait = Duration::from_secs(5);
        // A quick round trip learnt, and request timers 1 s away: what fires while the target
        // is slow is the tail-loss probe.
        q.cc.set_rto_min(congestion::RTO_MAX);
        for _ in 0..20 {
            // (A probe may come first if the machine paused this thread.)
            reads_against(&mut q, 1, || t.reads(1, false, wait));
        }
        let st = reads_against(&mut q, 4, || {
            // The READs are held (a slow disk) past several probe timeouts; every probe is
            // answered with counts that show nothing lost. (On a loaded machine a probe may
            // overtake the last READs, which a paused thread sent late.)
            let (mut reads, mut probes) = (0, 0);
            while reads < 4 || probes < 3 {
                let (frames, p) = t.step(false, true, wait);
                reads += frames - p;
                probes += p;
            }
            assert_eq!(reads, 4, "each READ arrives once");
            t.release();
        });
        assert!(st.probes >= 3, "{st:?}");
        assert_eq!((st.retransmits, st.late_replies), (0, 0), "{st:?}");
    }

    #[test]
    fn a_request_unanswered_a_second_timer_after_a_clean_probe_is_sent_again() {
        let (mut q, mut t) = counting_pair();
        let wait = Duration::from_secs(5);
        // Counts that show nothing missing are not trusted forever (a lost WRITE fragment 0
        // is only completed by a repeated one, §9.3; a frame counted on one side only could
        // hide a loss): at its second timer a request goes again.
        let st = reads_against(&mut q, 1, || {
            assert_eq!(t.step(false, true, wait), (1, 0));
            // The resent READ, after the probes.
            t.reads(1, true, wait);
            t.release();
        });
        assert!(st.probes >= 1, "{st:?}");
        assert!(st.retransmits >= 1, "{st:?}");
    }

    #[test]
    fn frames_a_probe_shows_lost_are_resent_once() {
        let (mut q, mut t) = counting_pair();
        let wait = Duration::from_secs(5);
        let st = reads_against(&mut q, 4, || {
            // The datagram with the four READs is lost; the probe's counts show it.
            assert_eq!(t.step(true, false, wait), (4, 0));
            t.reads(4, false, wait);
        });
        assert!(st.probes >= 1, "{st:?}");
        assert_eq!((st.retransmits, st.late_replies), (4, 0), "{st:?}");
    }

    /// The fragments of a 16 KiB write are a run of equal datagrams: one segmented send, which
    /// a receiver without UDP_GRO gets as 16 datagrams. A socket the kernel will not segment
    /// for (here: UDP checksums off, which GSO refuses with EINVAL) falls back to one datagram per
    /// send, and nothing is lost on the way.
    #[test]
    fn write_fragments_leave_segmented_or_one_by_one_if_the_kernel_refuses() {
        for refuse in [false, true] {
            let target = UdpSocket::bind("127.0.0.1:0").unwrap();
            let link = udp_link(target.local_addr().unwrap()).unwrap();
            if refuse {
                blkwire_net::setopt(link.fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NO_CHECK, 1);
            }
            let mut q = test_queue(link, grant(8, 16384, 1024), None);
            let data = vec![0x3c; 16384];
            let write = Cmd::Write {
                offset: 0,
                data: &data,
                fua: false,
            };
            q.submit(write, 1).unwrap();
            q.send().unwrap();
            let st = q.stats();
            assert_eq!(st.datagrams_out, 16, "{st:?}");
            assert_eq!(st.segmented_out, if refuse { 0 } else { 16 }, "{st:?}");
            assert_eq!(q.tx.gso(), !refuse);
            target
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut buf = vec![0u8; 65536];
            for got in 0..16 {
                let n = target.recv(&mut buf).unwrap();
                assert_eq!(n, HEADER_LEN + 1024, "one fragment per datagram");
                let f = datagram::frames(&buf[..n], 65536)
                    .next()
                    .unwrap()
                    .expect("a valid frame");
                let (h, payload) = (f.header, f.payload);
                assert_eq!(h.frag_offset, got * 1024);
                assert!(payload.iter().all(|&b| b == 0x3c));
            }
        }
    }

    /// Queue 0 of session 7 with a window of 64 frames.
    fn grant(depth: u16, max_io: u32, frame_payload: u32) -> Grant {
        Grant {
            session: 7,
            index: 0,
            depth,
            max_io,
            frame_payload,
            credit: 64,
            header_crc: false,
        }
    }

    /// A queue that gives up after 30 s and never spins.
    fn test_queue(link: Link, g: Grant, seal: Option<QueueKeys>) -> DgramQueue {
        DgramQueue::new(link, g, seal, Duration::from_secs(30), Duration::ZERO)
    }

    fn idle_queue(target: &UdpSocket) -> DgramQueue {
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        test_queue(link, grant(8, 4096, 8192), None)
    }

    /// Submits and sends a READ of 512 bytes at `offset` for `user`: its slot.
    fn small_read_in_flight(q: &mut DgramQueue, offset: u64, user: u64) -> usize {
        q.submit(Cmd::Read { offset, len: 512 }, user).unwrap();
        q.send().unwrap();
        q.slots
            .iter()
            .position(|s| s.state == State::InFlight)
            .expect("the READ is in flight")
    }

    /// A slot timer due before the next pass may scan the slots is asked for at that scan: the
    /// caller's wait would otherwise return at once, again and again, until it came.
    #[test]
    fn no_timer_is_asked_for_before_the_slots_can_be_scanned() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        let slot = small_read_in_flight(&mut q, 0, 1);
        q.timers().unwrap();
        // Its timer due now, before the next scan.
        q.slots[slot].tx.rto = Duration::ZERO;
        assert!(q.slots[slot].tx.deadline() < q.cc.next_scan());
        assert_eq!(q.deadline(), Some(q.cc.next_scan()));
        // At that scan it is acted on.
        let at = q.deadline().unwrap();
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        let sent = q.stats().frames_out;
        q.timers().unwrap();
        q.send().unwrap();
        assert!(
            q.stats().frames_out > sent,
            "the timer was acted on at the scan"
        );
    }

    /// A request given up unanswered teaches the congestion state nothing: its give-up is no
    /// round trip (the retransmission timeout stays where it was), and its frames are free.
    /// (Finished as if answered, its 10 ms became a round-trip sample.)
    #[test]
    fn a_request_given_up_teaches_the_timers_nothing() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        // Given up before its first timer (RTO_INITIAL, 20 ms): sent once, never resent.
        let give_up = Duration::from_millis(10);
        let mut q = DgramQueue::new(link, grant(8, 4096, 8192), None, give_up, Duration::ZERO);
        let rto = q.cc.rto();
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            1,
        )
        .unwrap();
        let mut status = None;
        while status.is_none() {
            q.poll(|c| status = Some(c.status)).unwrap();
            if status.is_none() {
                let at = q.deadline().expect("a request in flight has a timer");
                let _ = crate::deadline::poll_until(q.fd(), libc::POLLIN, at, give_up);
            }
        }
        assert_eq!(status, Some(Status::Io));
        assert_eq!((q.stats().timeouts, q.stats().retransmits), (1, 0));
        assert_eq!(q.cc.rto(), rto, "a give-up is no round trip");
        assert_eq!(q.cc.in_flight_frames(), 0);
    }

    /// A request waiting for the window (behind a READ of more frames than the window, which
    /// goes alone) fails at its own give-up time, unsent: it waited for the one ahead to be
    /// given up first, and then its whole give-up time again (the library's read_at of a
    /// dead target took depth x give-up).
    #[test]
    fn a_request_waiting_for_the_window_is_given_up_in_time() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let mut q = test_queue(link, grant(8, 1 << 20, 1024), None);
        let read = |len| Cmd::Read { offset: 0, len };
        q.submit(read(1 << 20), 1).unwrap();
        q.send().unwrap();
        let sent = q.stats().frames_out;
        assert_eq!(q.in_flight(), 1, "the large READ goes alone");
        q.give_up = Duration::from_millis(50);
        q.submit(read(512), 2).unwrap();
        let mut done = Vec::new();
        // The large READ gives up after 30 s: the small one must not wait for it.
        let until = Instant::now() + Duration::from_secs(10);
        while done.is_empty() && Instant::now() < until {
            q.poll(|c| done.push((c.user, c.status))).unwrap();
            if done.is_empty() {
                let at = q.deadline().expect("requests wait: a timer");
                let _ = crate::deadline::poll_until(q.fd(), libc::POLLIN, at, Duration::ZERO);
            }
        }
        assert_eq!(done, [(2, Status::Io)]);
        let st = q.stats();
        assert_eq!(st.timeouts, 1, "{st:?}");
        // Never sent: only the large READ's frames (its probes aside) went out.
        assert_eq!(st.frames_out - st.probes, sent, "{st:?}");
    }

    /// A KEEPALIVE submitted as a request (`Queue::keepalive`) leaves its slot's generation
    /// where it was (the target never sees it in its slot table); a READ moves it on.
    #[test]
    fn keepalives_leave_the_slot_generation_alone() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        let slot = *q.free.last().unwrap() as usize;
        let before = q.slots[slot].generation;
        q.submit(Cmd::Keepalive, 1).unwrap();
        assert_eq!(q.slots[slot].generation, before);
        let slot = *q.free.last().unwrap() as usize;
        let before = q.slots[slot].generation;
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            2,
        )
        .unwrap();
        assert_eq!(q.slots[slot].generation, before.wrapping_add(1));
    }

    /// A JOIN answered twice (sent again while the first answer travelled) does not count
    /// among the frames received: the target does not count it among those it sent (§9.2).
    #[test]
    fn a_late_join_answer_is_not_counted_as_received() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        let mut h = Header::request(Opcode::Join, Tag::new(0, 1), 0, 0);
        h.session = q.session;
        h.queue = q.index;
        let h = h.reply(Status::Ok, 0);
        q.on_frame(&h, &[]);
        assert_eq!(q.accepted_in, 0);
        assert_eq!(q.stats().late_replies, 1);
    }

    /// A reply that does not carry its request's offset and length (§3) is an older
    /// request's, whose 16-bit generation came round again: late, its data never taken.
    #[test]
    fn a_reply_for_another_offset_or_length_is_late() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        let slot = small_read_in_flight(&mut q, 4096, 7);
        let generation = q.slots[slot].generation;
        let (session, index) = (q.session, q.index);
        let reply = |offset, length| {
            let mut h = Header::request(
                Opcode::Read,
                Tag::new(slot as u16, generation),
                offset,
                length,
            );
            h.session = session;
            h.queue = index;
            h.reply(Status::Ok, 512)
        };
        q.on_frame(&reply(0, 512), &[1; 512]);
        q.on_frame(&reply(4096, 1024), &[2; 512]);
        assert_eq!(q.stats().late_replies, 2);
        assert_eq!(q.slots[slot].state, State::InFlight, "still waiting");
        q.on_frame(&reply(4096, 512), &[3; 512]);
        let mut got = Vec::new();
        q.poll(|c| got.push((c.user, c.status, c.data.to_vec())))
            .unwrap();
        assert_eq!(got, [(7, Status::Ok, vec![3; 512])]);
    }

    #[test]
    fn an_idle_queue_sends_keepalives_whose_answers_stay_inside() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        let wait = Duration::from_secs(5);
        // Fresh: the keepalive is due one interval after the last datagram, not before.
        let due = q
            .deadline()
            .expect("a datagram queue always has a deadline");
        assert!(due > Instant::now() + KEEPALIVE_EVERY / 2);
        assert_eq!(q.poll(|_| panic!("nothing was submitted")).unwrap(), 0);
        assert_eq!(q.stats().frames_out, 0);

        // Idle past the interval (made zero here rather than waited for): poll sends one.
        q.keepalive_every = Duration::ZERO;
        assert_eq!(q.poll(|_| panic!("no completion")).unwrap(), 0);
        q.keepalive_every = KEEPALIVE_EVERY;
        assert_eq!(q.stats().frames_out, 1);
        assert_eq!(answer(&target, false, wait), 1);
        // Its answer (already in our socket: loopback delivers in the sender's call) is taken
        // and dropped: no completion, no slot used, not a late reply; the next one is due an
        // interval after this send.
        let sent = Instant::now();
        assert_eq!(
            q.poll(|_| panic!("a keepalive is not a completion"))
                .unwrap(),
            0
        );
        let st = q.stats();
        assert_eq!((st.frames_in, st.late_replies), (1, 0), "{st:?}");
        assert_eq!(q.in_flight(), 0);
        assert!(q.deadline().unwrap() <= sent + KEEPALIVE_EVERY);

        // With a request in flight the caller sees its completion only.
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            42,
        )
        .unwrap();
        q.keepalive_every = Duration::ZERO;
        assert_eq!(q.poll(|_| panic!("not answered yet")).unwrap(), 0);
        q.keepalive_every = KEEPALIVE_EVERY;
        // The read and the keepalive: two datagrams (a keepalive travels alone).
        assert_eq!(answer(&target, false, wait), 1);
        assert_eq!(answer(&target, false, wait), 1);
        let mut users = Vec::new();
        assert_eq!(q.poll(|c| users.push((c.user, c.data.len()))).unwrap(), 1);
        assert_eq!(users, [(42, 512)]);
        assert_eq!(q.in_flight(), 0);
        assert_eq!(q.stats().late_replies, 0);
    }

    #[test]
    fn a_keepalive_answered_access_reports_the_session_lost() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut q = idle_queue(&target);
        q.keepalive_every = Duration::ZERO;
        q.poll(|_| {}).unwrap();
        // A target that has forgotten the session answers ACCESS.
        assert_eq!(
            answer_with(&target, Some(Status::Access), Duration::from_secs(5)),
            1
        );
        assert!(matches!(q.poll(|_| {}), Err(Error::SessionLost)));
    }

    /// A target sending datagrams as fast as we read them cannot hold `poll` (nor the timers
    /// it runs): one call reads about a receive buffer's worth, the next ones the rest.
    #[test]
    fn one_poll_reads_about_a_receive_buffer_of_datagrams() {
        let (target, mut q, h, from) = read_in_flight(grant(4, 4096, 8192), None);
        // Replies for another session: small, so the socket holds many more of them than the
        // frames of the size its buffer is counted in.
        let mut r = Header {
            session: h.session + 1,
            ..h
        }
        .reply(Status::Ok, 0);
        r.seal_crc(&[]);
        let most = q.rx.rounds() * link::BATCH;
        let sent = 4 * most;
        for _ in 0..sent {
            target.send_to(&r.to_bytes(), from).unwrap();
        }
        q.poll(|_| panic!("nothing is answered")).unwrap();
        let first = q.stats().datagrams_in as usize;
        assert!(first > 0 && first <= most, "{first} datagrams in one poll");
        // The rest was waiting: the next calls take it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while q.stats().datagrams_in < sent as u64 && Instant::now() < deadline {
            q.poll(|_| panic!("nothing is answered")).unwrap();
        }
        assert_eq!(q.stats().datagrams_in, sent as u64);
    }

    /// A sealed queue (frame keys `[1; 32]` towards the target, `[2; 32]` back) with a 512-byte
    /// READ (user 1) in flight, and the target's side: its socket, the request as it received
    /// it (opened), and where it came from.
    fn sealed_read_in_flight(
        encrypt: bool,
    ) -> (UdpSocket, DgramQueue, Header, std::net::SocketAddr) {
        read_in_flight(grant(4, 4096, 8192), Some(encrypt))
    }

    /// A queue granted `g`, sealed if `sealed` says so (`Some(encrypt)`, keys as above), with a
    /// 512-byte READ (user 1) in flight: the target's socket, the request as it received it
    /// (opened if sealed), and where it came from.
    fn read_in_flight(
        g: Grant,
        sealed: Option<bool>,
    ) -> (UdpSocket, DgramQueue, Header, std::net::SocketAddr) {
        use blkwire_auth::seal::{Opener, Sealer};
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let keys = sealed.map(|encrypt| QueueKeys {
            sealer: Sealer::new(&[1u8; 32], encrypt),
            opener: Opener::new(&[2u8; 32], encrypt),
        });
        let mut q = test_queue(link, g, keys);
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            1,
        )
        .unwrap();
        q.send().unwrap();
        let mut buf = vec![0u8; 65536];
        target
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let (n, from) = target.recv_from(&mut buf).unwrap();
        let f = datagram::frames(&buf[..n], 65536).next().unwrap().unwrap();
        assert_eq!(
            f.sealed(),
            sealed.is_some(),
            "requests of a sealed session are sealed"
        );
        if let Some(encrypt) = sealed {
            let mut scratch = [0u8; 64];
            Opener::new(&[1u8; 32], encrypt)
                .open(f.raw, HEADER_LEN, &mut scratch)
                .expect("the request opens");
        }
        (target, q, f.header, from)
    }

    /// PROTOCOL.md §12.4 from the initiator's side: in a sealed session a reply that is not
    /// sealed under the target's key (a forgery from another host on the link, or a spoofed
    /// datagram) is dropped and counted, whatever its tag; the sealed one completes the READ.
    #[test]
    fn a_sealed_queue_drops_forged_replies_and_takes_the_sealed_one() {
        use blkwire_auth::seal::Sealer;
        for encrypt in [false, true] {
            let (target, mut q, h, from) = sealed_read_in_flight(encrypt);
            let mut sealer = Sealer::new(&[2u8; 32], encrypt);
            // Forgeries with the right session, queue and tag: a plain CRC'd reply, and one
            // sealed under a key the attacker made up.
            let forged_data = vec![0xee; 512];
            let mut plain = h.reply(Status::Ok, 512);
            plain.flags.0 &= !Flags::SEALED;
            plain.seal_crc(&forged_data);
            let mut b = plain.to_bytes().to_vec();
            b.extend_from_slice(&forged_data);
            target.send_to(&b, from).unwrap();
            let mut fake = Packer::<()>::with_capacity(1, 1024);
            let mut wrong = Sealer::new(&[9u8; 32], encrypt);
            fake.push_sealed(&h.reply(Status::Ok, 0), &forged_data, (), 0, |f| {
                wrong.seal(f, HEADER_LEN)
            });
            target.send_to(&fake.get(0).0, from).unwrap();
            // The real answer.
            let mut real = Packer::<()>::with_capacity(1, 1024);
            real.push_sealed(&h.reply(Status::Ok, 0), &[0x5a; 512], (), 0, |f| {
                sealer.seal(f, HEADER_LEN)
            });
            target.send_to(&real.get(0).0, from).unwrap();
            let mut got = Vec::new();
            q.complete(1, |c| {
                assert_eq!(c.status, Status::Ok);
                got = c.data.to_vec();
            })
            .unwrap();
            assert!(
                got.iter().all(|&b| b == 0x5a),
                "forged data reached the caller (encrypt={encrypt})"
            );
            assert_eq!(
                q.stats().bad_seals,
                2,
                "both forgeries counted (encrypt={encrypt})"
            );
        }
    }

    /// An unsealed ACCESS in a sealed session may only start a new handshake, and only when
    /// its tag answers a request in flight: a forgery with another tag (anyone who learned the
    /// session id can send one) moves neither the window nor the probe counters.
    #[test]
    fn a_forged_bare_access_moves_nothing_but_a_matching_one_ends_the_session() {
        let (target, mut q, h, from) = sealed_read_in_flight(false);
        let (window, accepted) = (q.cc.window(), q.accepted_in);
        let bare = |tag: Tag| {
            let mut r = Header { tag, ..h }.reply(Status::Access, 0);
            r.flags.0 &= !Flags::SEALED;
            r.credit = 1;
            r.seal_crc(&[]);
            r.to_bytes()
        };
        let other = Tag::new(h.tag.slot(), h.tag.generation().wrapping_add(7));
        target.send_to(&bare(other), from).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while q.stats().late_replies == 0 && Instant::now() < deadline {
            q.poll(|_| panic!("nothing is answered")).unwrap();
        }
        assert_eq!(q.stats().late_replies, 1, "the forgery is counted as late");
        assert_eq!((q.cc.window(), q.accepted_in), (window, accepted));
        assert!(!q.session_lost);
        target.send_to(&bare(h.tag), from).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match q.poll(|_| panic!("nothing is answered")) {
                Err(Error::SessionLost) => break,
                Ok(_) => assert!(Instant::now() < deadline, "the matching ACCESS was ignored"),
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// §9.3: `HAVE` acknowledges a WRITE's fragments. On a READ's tag it is late (a forged or
    /// confused frame), not a call to resend: each "missing" fragment of a READ would go out
    /// as the whole request again, and each be answered with the whole reply.
    #[test]
    fn a_have_on_a_read_resends_nothing() {
        let (target, mut q, h, from) = read_in_flight(grant(4, 4096, 8192), None);
        let before = q.stats();
        let mut r = h.reply(Status::Ok, 0);
        r.flags.0 |= Flags::HAVE;
        let bitmap = [0u8; 32];
        r.payload_len = bitmap.len() as u32;
        r.seal_crc(&bitmap);
        let mut out = r.to_bytes().to_vec();
        out.extend_from_slice(&bitmap);
        target.send_to(&out, from).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while q.stats().late_replies == before.late_replies {
            assert!(Instant::now() < deadline, "the HAVE was not taken");
            q.poll(|_| panic!("nothing is answered")).unwrap();
        }
        let st = q.stats();
        assert_eq!(st.retransmits, before.retransmits, "{st:?}");
        assert_eq!(st.frames_out, before.frames_out, "{st:?}");
        // The READ is still in flight and its real answer completes it.
        let data = vec![0x5a; 512];
        let mut r = h.reply(Status::Ok, 512);
        r.seal_crc(&data);
        let mut out = r.to_bytes().to_vec();
        out.extend_from_slice(&data);
        target.send_to(&out, from).unwrap();
        let mut got = 0;
        while got == 0 {
            got = q.complete(1, |c| assert_eq!(c.status, Status::Ok)).unwrap();
        }
    }

    /// §9.7 from the initiator's side: a READ's data with a header-only CRC completes it only
    /// in a queue that asked for that; elsewhere, and on any other reply (here an error
    /// answer), such a frame counts as a CRC error and changes nothing.
    #[test]
    fn header_only_crcs_are_taken_only_on_read_data_of_a_queue_that_asked() {
        for asked in [false, true] {
            let g = Grant {
                header_crc: asked,
                ..grant(4, 4096, 8192)
            };
            let (target, mut q, h, from) = read_in_flight(g, None);
            let send = |status: Status, data: &[u8]| {
                let mut r = h.reply(status, data.len() as u32);
                r.flags.0 |= Flags::HEAD_CRC;
                r.seal_crc(data);
                let mut out = r.to_bytes().to_vec();
                out.extend_from_slice(data);
                target.send_to(&out, from).unwrap();
            };
            send(Status::Io, &[]);
            send(Status::Ok, &[0x5a; 512]);
            let mut got = None;
            let deadline = Instant::now() + Duration::from_secs(5);
            while got.is_none() && q.stats().crc_errors < 2 && Instant::now() < deadline {
                q.poll(|c| got = Some((c.status, c.data.to_vec()))).unwrap();
            }
            if asked {
                assert_eq!(got, Some((Status::Ok, vec![0x5a; 512])));
                assert_eq!(q.stats().crc_errors, 1, "the error answer is not data");
            } else {
                assert_eq!(got, None);
                assert_eq!(q.stats().crc_errors, 2, "neither was asked for");
            }
        }
    }
}
