//! Datagram queues (UDP and raw Ethernet, PROTOCOL.md §9): every frame carries a CRC, messages
//! are fragmented to the negotiated frame payload, lost frames are detected by an adaptive timer
//! and only what is missing is sent again, and a congestion window bounded by the target's credit
//! keeps a fast initiator from overrunning the target.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use blkwire_net::rx_ring::RxRing;
use blkwire_net::udp_offload::{self, Cmsg, SendBatch};
use blkwire_wire::datagram::{self, Packer};
use blkwire_wire::{bitmap, fragment_count, Flags, Header, Opcode, Status, Tag, HEADER_LEN};

use crate::queue::{Cmd, Completion, Parts, QueueStats};
use crate::{Error, Result};

/// Timer bounds (PROTOCOL.md §9.2).
const RTO_MIN: Duration = Duration::from_millis(5);
const RTO_MAX: Duration = Duration::from_secs(1);
const RTO_INITIAL: Duration = Duration::from_millis(20);
/// Floor of the tail-loss probe timeout: below this, scheduling noise on a busy host would fire it.
const PTO_MIN: Duration = Duration::from_micros(200);
/// Frames sent or received per syscall.
const BATCH: usize = 32;
/// A queue that has sent nothing for this long sends a KEEPALIVE from `poll`, so the target
/// (which forgets a session after 60 s without frames) keeps it (PROTOCOL.md §9.1).
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
/// Slot number in the tag of internal keepalives: outside every slot table (depth <= 65535), so
/// their answers are told from those of requests and never reach the caller.
const KEEPALIVE_SLOT: u16 = u16::MAX;

/// Where frames go: a connected UDP socket, or a packet socket with the target's MAC.
pub(crate) struct Link {
    pub fd: OwnedFd,
    /// For packet sockets: the destination link-layer address; `None` for connected UDP.
    pub dest: Option<libc::sockaddr_ll>,
    /// Largest frame (header + payload) the link carries.
    pub mtu_payload: u32,
    /// Raw Ethernet: a socket the data path sends on, so the kernel never wakes `fd`'s waiter
    /// for write space (`blkwire_net::packet_send_socket`); `None` sends on `fd`.
    pub send_fd: Option<OwnedFd>,
    /// Usable receive buffer of the socket: READ replies in flight must fit in it.
    pub rcvbuf: u32,
}

impl Link {
    /// Sends one frame outside the batched data path (control exchanges, discovery).
    fn send_one(&self, frame: &[u8]) {
        let mut dest = self.dest;
        let (name, namelen) = match dest.as_mut() {
            Some(d) => (
                (d as *mut libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            ),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: sendto from the caller's buffer to an optional link-layer address. A lost
        // frame is the caller's retransmission problem, so the result is not needed.
        unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                name,
                namelen,
            )
        };
    }

    /// Waits until `until` for the next reply frame with a valid CRC; returns its header, its
    /// payload and the sender's link-layer address (meaningful on packet sockets only).
    fn recv_reply<'b>(
        &self,
        buf: &'b mut [u8],
        until: Instant,
    ) -> Option<(Header, &'b [u8], libc::sockaddr_ll)> {
        while Instant::now() < until {
            let ms = until
                .saturating_duration_since(Instant::now())
                .as_millis()
                .max(1) as i32;
            let mut p = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on our fd.
            if unsafe { libc::poll(&mut p, 1, ms) } <= 0 {
                continue;
            }
            // SAFETY: an all-zero sockaddr_ll is valid; recvfrom fills it (or truncates a
            // longer IP address into it, which callers on UDP ignore).
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut fl = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: recvfrom into our buffers.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut fl,
                )
            };
            if n < HEADER_LEN as isize {
                continue;
            }
            // Control replies travel alone in their datagram (PROTOCOL.md §9.6): the first frame.
            let (r, end) = match datagram::frames(&buf[..n as usize], 65536).next() {
                Some(Ok((r, p))) if r.is_reply() => (r, HEADER_LEN + p.len()),
                _ => continue,
            };
            return Some((r, &buf[HEADER_LEN..end], from));
        }
        None
    }
}

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
    sent_at: Instant,
    rto: Duration,
    give_up_at: Instant,
    retransmitted: bool,
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
            sent_at: Instant::now(),
            rto: RTO_INITIAL,
            give_up_at: Instant::now(),
            retransmitted: false,
            status: Status::Ok,
        }
    }
}

pub(crate) struct DgramQueue {
    link: Link,
    session: u32,
    index: u16,
    max_io: u32,
    frame_payload: u32,
    slots: Vec<Slot>,
    free: Vec<u16>,
    pending: VecDeque<u16>,
    done: VecDeque<u16>,
    in_flight_frames: u32,
    /// Congestion window in frames (AIMD), never above `credit`.
    cwnd: f64,
    credit: u32,
    /// Frames of replies our receive buffer holds.
    rx_cap: u32,
    /// The target answered ACCESS: it has forgotten this session.
    session_lost: bool,
    /// When the window was last halved: at most once per round trip (one loss episode).
    last_decrease: Instant,
    /// Send time of the most recently sent request that has been answered (loss detection).
    newest_answered: Option<Instant>,
    /// Smallest round trip seen: tells an answer to a retransmission from a late first answer.
    min_rtt: Option<Duration>,
    /// Last valid reply, or last tail-loss probe.
    last_progress: Instant,
    /// When `timers` last looked at every slot.
    last_scan: Instant,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    /// Floor of `rto` (RTO_MIN; tests raise it to show what the tail-loss probe alone recovers).
    rto_min: Duration,
    give_up: Duration,
    spin: blkwire_spin::AdaptiveSpin,
    /// Encoded frames, packed into datagrams (PROTOCOL.md §9.6), waiting for one sendmmsg.
    tx: Packer<()>,
    rx: Vec<Vec<u8>>,
    stats: QueueStats,
    /// Read once per receive batch (RTT samples of one batch share it).
    now: Instant,
    /// When a datagram last went out: the keepalive is due `keepalive_every` after it.
    last_sent: Instant,
    keepalive_every: Duration,
    /// Generation of the next internal keepalive (its answers are recognised by the slot).
    keepalive_gen: u16,
    /// UDP: runs of equal datagrams leave in one segmented send (PROTOCOL.md §9.6); turned off
    /// for good if the kernel refuses one.
    gso: bool,
    /// UDP: the kernel hands over runs that arrived together as one buffer.
    gro: bool,
    /// Raw Ethernet: replies are read in place from a receive ring shared with the kernel.
    ring: Option<RxRing>,
}

impl DgramQueue {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        link: Link,
        session: u32,
        index: u16,
        depth: u16,
        max_io: u32,
        frame_payload: u32,
        credit: u32,
        give_up: Duration,
        poll: Duration,
    ) -> DgramQueue {
        let frame = HEADER_LEN + frame_payload as usize;
        // Counted at the largest reply frame this session can get; packed replies cost the same
        // buffer space per frame as lone ones.
        let largest = HEADER_LEN as u32 + frame_payload.min(max_io);
        let rx_cap = blkwire_net::frames_in_buffer(link.rcvbuf, largest);
        // A connected UDP socket (packet sockets have a destination address) can segment.
        let udp = link.dest.is_none();
        let gro = udp && udp_offload::enable_gro(link.fd.as_raw_fd());
        let rx_len = if gro {
            udp_offload::GRO_BUFFER
        } else {
            frame.max(HEADER_LEN + 4096)
        };
        // As many slots as the receive buffer holds frames, so the window's arithmetic (rx_cap)
        // stays true; without a ring (it cannot be set up) frames come by recvmmsg as before.
        let ring = if udp {
            None
        } else {
            let ring = RxRing::new(link.fd.as_raw_fd(), frame, rx_cap as usize).ok();
            if ring.is_some() {
                drain(link.fd.as_raw_fd());
            }
            ring
        };
        DgramQueue {
            link,
            session,
            index,
            max_io,
            frame_payload,
            slots: (0..depth).map(|_| Slot::new()).collect(),
            free: (0..depth).rev().collect(),
            pending: VecDeque::new(),
            done: VecDeque::new(),
            in_flight_frames: 0,
            cwnd: (credit.max(1) as f64).min(64.0),
            credit: credit.max(1),
            rx_cap,
            session_lost: false,
            last_decrease: Instant::now(),
            newest_answered: None,
            min_rtt: None,
            last_progress: Instant::now(),
            last_scan: Instant::now(),
            srtt: None,
            rttvar: Duration::ZERO,
            rto: RTO_INITIAL,
            rto_min: RTO_MIN,
            give_up,
            spin: blkwire_spin::AdaptiveSpin::new(poll),
            tx: Packer::with_capacity(BATCH, BATCH * frame),
            // A ring queue reads in place: no receive buffers.
            rx: (0..if ring.is_some() { 0 } else { BATCH })
                .map(|_| vec![0u8; rx_len])
                .collect(),
            stats: QueueStats::default(),
            now: Instant::now(),
            last_sent: Instant::now(),
            keepalive_every: KEEPALIVE_EVERY,
            keepalive_gen: 0,
            gso: udp,
            gro,
            ring,
        }
    }

    pub fn index(&self) -> u16 {
        self.index
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
        s.rto_us = self.rto.as_micros() as u64;
        s.window = self.window() as u64;
        s
    }

    fn window(&self) -> u32 {
        (self.cwnd as u32).clamp(1, self.credit.min(self.rx_cap))
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
        s.generation = s.generation.wrapping_add(1);
        s.state = State::Pending;
        s.opcode = opcode;
        s.flags = flags;
        s.offset = offset;
        s.length = len;
        s.user = user;
        s.retransmitted = false;
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
            let start = (frag * fp) as usize;
            let end = (start + fp as usize).min(s.data.len());
            &s.data[start..end]
        } else {
            &[]
        };
        h.payload_len = payload.len() as u32;
        h.seal_crc(payload);
        // Several requests of this queue share a datagram up to the size the target receives.
        self.tx.push(&h, payload, (), HEADER_LEN + fp as usize);
        self.stats.frames_out += 1;
        if self.tx.len() == BATCH {
            let _ = self.flush_tx();
        }
    }

    /// Sends every encoded frame with as few syscalls as the batch allows.
    fn flush_tx(&mut self) -> Result<()> {
        if self.tx.is_empty() {
            return Ok(());
        }
        // Counted as traffic even if the socket refuses it: the keepalive could not do better.
        self.last_sent = Instant::now();
        let send_fd = self
            .link
            .send_fd
            .as_ref()
            .unwrap_or(&self.link.fd)
            .as_raw_fd();
        let mut done = 0;
        while done < self.tx.len() {
            let (max_count, max_bytes) = udp_offload::run_limits(self.gso);
            let mut batch = SendBatch::<BATCH>::default();
            for run in self.tx.runs(done, max_count, max_bytes).take(BATCH) {
                batch.push(run.bytes, run.segment, run.count, |ss| {
                    match &self.link.dest {
                        Some(d) => {
                            // SAFETY: sockaddr_storage is large enough for a sockaddr_ll.
                            unsafe { *(ss as *mut _ as *mut libc::sockaddr_ll) = *d };
                            std::mem::size_of::<libc::sockaddr_ll>() as u32
                        }
                        None => 0,
                    }
                });
            }
            match batch.send(send_fd) {
                Ok(sent) => {
                    self.stats.datagrams_out += sent.datagrams as u64;
                    self.stats.segmented_out += sent.segmented as u64;
                    done += sent.datagrams;
                }
                Err(f) => match f.error.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // This kernel or route cannot segment: datagram by datagram from now on.
                    _ if f.segmented && udp_offload::refused(&f.error) => self.gso = false,
                    // A full socket buffer or an unreachable port loses frames exactly as the
                    // network may: the retransmission timer recovers them.
                    Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::ECONNREFUSED) => {
                        done += f.datagrams;
                    }
                    _ => {
                        self.tx.clear();
                        return Err(Error::Io(f.error));
                    }
                },
            }
        }
        self.tx.clear();
        Ok(())
    }

    /// Moves pending requests into flight as far as the window allows, and sends.
    pub fn send(&mut self) -> Result<()> {
        let now = Instant::now();
        while let Some(&slot) = self.pending.front() {
            let need = self.slots[slot as usize].window_frames;
            if self.in_flight_frames > 0 && self.in_flight_frames + need > self.window() {
                break;
            }
            self.pending.pop_front();
            let rto = self.rto;
            let give_up = self.give_up;
            let s = &mut self.slots[slot as usize];
            s.state = State::InFlight;
            s.sent_at = now;
            s.rto = rto;
            s.give_up_at = now + give_up;
            self.in_flight_frames += need;
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
                self.wait()?;
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
        if Instant::now() >= self.last_sent + self.keepalive_every {
            self.keepalive()?;
        }
        Ok(self.deliver(&mut f))
    }

    /// When `poll` must run even if no frame arrives: the earliest retransmission, give-up or
    /// tail-loss probe timer, or the keepalive.
    pub fn deadline(&self) -> Option<Instant> {
        let keepalive = self.last_sent + self.keepalive_every;
        Some(
            self.timer_deadline()
                .map_or(keepalive, |t| t.min(keepalive)),
        )
    }

    /// The earliest timer of the requests in flight.
    fn timer_deadline(&self) -> Option<Instant> {
        self.slots
            .iter()
            .filter(|s| s.state == State::InFlight)
            .map(|s| (s.sent_at + s.rto).min(s.give_up_at))
            .chain((self.in_flight_frames > 0).then(|| self.last_progress + self.pto()))
            .min()
    }

    /// Sends a KEEPALIVE outside the slot table. It is not retransmitted: the next one follows
    /// `keepalive_every` later, well within the target's expiry. Its answer is dropped in
    /// `on_frame`, unless it is ACCESS: the target has forgotten the session after all.
    fn keepalive(&mut self) -> Result<()> {
        self.keepalive_gen = self.keepalive_gen.wrapping_add(1);
        let tag = Tag::new(KEEPALIVE_SLOT, self.keepalive_gen);
        let mut h = Header::request(Opcode::Keepalive, tag, 0, 0);
        h.queue = self.index;
        h.session = self.session;
        h.seal_crc(&[]);
        self.tx.push(&h, &[], (), 0);
        self.stats.frames_out += 1;
        self.flush_tx()
    }

    fn deliver(&mut self, f: &mut impl FnMut(Completion<'_>)) -> usize {
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
                status: s.status,
                data,
            });
            self.free.push(slot);
            n += 1;
        }
        n
    }

    /// Sleeps until a frame arrives or the earliest timer is due.
    fn wait(&mut self) -> Result<()> {
        let fd = self.link.fd.as_raw_fd();
        let ready = match &self.ring {
            Some(ring) => self.spin.spin(|| ring.ready()),
            None => self.spin.spin(|| blkwire_spin::readable([fd])),
        };
        if ready {
            return Ok(());
        }
        let now = Instant::now();
        let next = self
            .timer_deadline()
            .unwrap_or(now + Duration::from_millis(100));
        let ms = next
            .saturating_duration_since(now)
            .as_micros()
            .div_ceil(1000)
            .min(1000) as i32;
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on our fd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Io(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Reads every frame waiting; returns how many arrived.
    fn receive(&mut self) -> Result<usize> {
        self.now = Instant::now();
        if let Some(mut ring) = self.ring.take() {
            let total = ring.take_lap(|data, _| {
                self.stats.datagrams_in += 1;
                self.on_datagram(data);
            });
            self.ring = Some(ring);
            return Ok(total);
        }
        let mut total = 0;
        loop {
            let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            let mut cmsgs = [Cmsg::default(); BATCH];
            for i in 0..BATCH {
                iov[i] = libc::iovec {
                    iov_base: self.rx[i].as_mut_ptr().cast(),
                    iov_len: self.rx[i].len(),
                };
                msgs[i].msg_hdr.msg_iov = &mut iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                if self.gro {
                    cmsgs[i].attach_for_receive(&mut msgs[i].msg_hdr);
                }
            }
            // SAFETY: buffers owned by self.rx, alive for the call.
            let r = unsafe {
                libc::recvmmsg(
                    self.link.fd.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(total),
                    // ICMP port unreachable from a dead target: keep waiting; the give-up timer ends it.
                    Some(libc::ECONNREFUSED) => Ok(total),
                    _ => Err(Error::Io(e)),
                };
            }
            let n = r as usize;
            for (i, m) in msgs.iter().enumerate().take(n) {
                let len = m.msg_len as usize;
                let segment = Cmsg::gro_segment(&m.msg_hdr);
                let buf = std::mem::take(&mut self.rx[i]);
                for d in udp_offload::segments(&buf[..len.min(buf.len())], segment) {
                    self.stats.datagrams_in += 1;
                    self.stats.coalesced_in += segment.is_some() as u64;
                    self.on_datagram(d);
                }
                self.rx[i] = buf;
            }
            total += n;
            if n < BATCH {
                return Ok(total);
            }
        }
    }

    /// One received datagram: every frame packed in it (PROTOCOL.md §9.6).
    fn on_datagram(&mut self, b: &[u8]) {
        for f in datagram::frames(b, self.frame_payload) {
            self.stats.frames_in += 1;
            match f {
                Ok((h, payload)) => self.on_frame(&h, payload),
                // Malformed, truncated, mixed or without a valid CRC32C: dropped, counted.
                Err(_) => self.stats.crc_errors += 1,
            }
        }
    }

    fn on_frame(&mut self, h: &Header, payload: &[u8]) {
        if !h.is_reply() || h.session != self.session || h.queue != self.index {
            self.stats.late_replies += 1;
            return;
        }
        if h.credit > 0 {
            self.credit = h.credit as u32;
        }
        let slot = h.tag.slot();
        if slot == KEEPALIVE_SLOT && h.opcode == Opcode::Keepalive {
            // Our own keepalive's answer: nothing to deliver. ACCESS means the session is gone
            // (an idle queue learns it here rather than from its next request).
            if h.status == Status::Access {
                self.session_lost = true;
            }
            return;
        }
        let fp = self.frame_payload;
        let Some(s) = self.slots.get_mut(slot as usize) else {
            self.stats.late_replies += 1;
            return;
        };
        if s.state != State::InFlight || s.generation != h.tag.generation() || s.opcode != h.opcode
        {
            self.stats.late_replies += 1;
            return;
        }
        self.last_progress = self.now;
        if h.flags.has(Flags::HAVE) {
            // The target holds part of a WRITE: send exactly what it lacks (PROTOCOL.md §9.3).
            let missing: Vec<u32> = (0..s.frags).filter(|&i| !bitmap::get(payload, i)).collect();
            s.sent_at = self.now;
            s.retransmitted = true;
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
        let at = h.frag_offset as usize;
        s.data[at..at + payload.len()].copy_from_slice(payload);
        bitmap::set(&mut s.have, idx);
        s.got += 1;
        if s.got == s.frags {
            self.finish(slot);
        }
    }

    /// A request is answered: update the RTT estimate and the window, queue it for delivery.
    fn finish(&mut self, slot: u16) {
        let s = &mut self.slots[slot as usize];
        s.state = State::Done;
        self.in_flight_frames -= s.window_frames.min(self.in_flight_frames);
        if s.status != Status::Ok {
            self.stats.errors += 1;
        }
        let elapsed = self.now.saturating_duration_since(s.sent_at);
        // The newest transmission known to have arrived (RACK, RFC 8985). An answer to a
        // retransmission that comes sooner than any round trip can be an answer to the first
        // copy, so it proves nothing about when it was sent.
        if !s.retransmitted || self.min_rtt.is_some_and(|m| elapsed >= m) {
            self.newest_answered =
                Some(self.newest_answered.map_or(s.sent_at, |t| t.max(s.sent_at)));
        }
        if !s.retransmitted {
            // Karn: only unambiguous samples.
            let sample = elapsed;
            self.min_rtt = Some(self.min_rtt.map_or(sample, |m| m.min(sample)));
            let (srtt, var) = match self.srtt {
                None => (sample, sample / 2),
                Some(srtt) => {
                    let diff = srtt.abs_diff(sample);
                    (srtt * 7 / 8 + sample / 8, self.rttvar * 3 / 4 + diff / 4)
                }
            };
            self.srtt = Some(srtt);
            self.rttvar = var;
            self.rto = (srtt + 4 * var).clamp(self.rto_min, RTO_MAX);
        }
        // Growth: every answered frame opens the window by one (it doubles per round trip), up to
        // the target's credit. The receiver's buffer, not a guess, is what bounds us on a LAN.
        self.cwnd = (self.cwnd + s.window_frames as f64).min(self.credit as f64);
        self.done.push_back(slot);
    }

    /// Retransmits what is lost and gives up on what is past its give-up time. A request is lost
    /// when its timer fires, or earlier when a request sent more than a reordering window after
    /// it has already been answered (frames on one link do not overtake each other by more).
    fn timers(&mut self) -> Result<()> {
        let now = Instant::now();
        let mut lost = false;
        let srtt = self.srtt.unwrap_or(RTO_INITIAL);
        let reorder = (srtt / 4).max(Duration::from_micros(50));
        // The slot scan runs at most every half reordering window (25 us or more): no loss can be
        // declared sooner than that after it happens, and a busy queue calls this every few
        // microseconds, where scanning the whole slot table each time was a visible cost.
        let scan = now >= self.last_scan + reorder / 2;
        if scan {
            self.last_scan = now;
            for slot in 0..self.slots.len() as u16 {
                let s = &mut self.slots[slot as usize];
                if s.state != State::InFlight {
                    continue;
                }
                if now >= s.give_up_at {
                    s.status = Status::Io;
                    self.stats.timeouts += 1;
                    self.finish(slot);
                    continue;
                }
                let overtaken = self
                    .newest_answered
                    .is_some_and(|t| t > s.sent_at + reorder)
                    && now >= s.sent_at + srtt + reorder;
                if now < s.sent_at + s.rto && !overtaken {
                    continue;
                }
                lost = true;
                self.resend(slot, now);
            }
        }
        // Tail loss probe (RFC 8985 §7): requests are in flight but nothing has come back for
        // two round trips. Packing can put a whole burst, even the whole queue, in one datagram,
        // and if that one is lost no later answer can show it: resend the newest request, and
        // its answer shows the others lost (overtaken) long before their timers would.
        if !lost && self.in_flight_frames > 0 && now >= self.last_progress + self.pto() {
            let newest = (0..self.slots.len() as u16)
                .filter(|&i| self.slots[i as usize].state == State::InFlight)
                .max_by_key(|&i| self.slots[i as usize].sent_at);
            if let Some(slot) = newest {
                self.stats.probes += 1;
                self.resend(slot, now);
                self.last_progress = now;
            }
        }
        if lost && now.duration_since(self.last_decrease) > srtt {
            // Gentle multiplicative decrease (x 7/8), once per loss episode: on a storage LAN most
            // loss is a full buffer or a corrupt frame, not a congested path, and halving on every
            // random loss starves the queue (measured: 1 % loss cost 80 % of the IOPS). The base
            // timer is left alone: each request backs off its own timer.
            self.cwnd = (self.cwnd * 0.875).max(1.0);
            self.last_decrease = now;
        }
        self.flush_tx()
    }

    /// Sends an in-flight request again, with its timer backed off.
    fn resend(&mut self, slot: u16, now: Instant) {
        let s = &mut self.slots[slot as usize];
        s.sent_at = now;
        s.rto = (s.rto * 2).min(RTO_MAX);
        s.retransmitted = true;
        self.stats.retransmits += 1;
        match s.opcode {
            // Only fragment 0: the target answers with what it holds (HAVE).
            Opcode::Write => self.push_frame(slot, 0, false),
            // Ask only for the fragments still missing.
            Opcode::Read if s.got > 0 => self.push_frame(slot, 0, true),
            _ => self.push_frame(slot, 0, false),
        }
    }

    /// Tail-loss probe timeout: two smoothed round trips, never above the retransmission timeout.
    fn pto(&self) -> Duration {
        (2 * self.srtt.unwrap_or(RTO_INITIAL)).clamp(PTO_MIN, self.rto.max(PTO_MIN))
    }

    pub fn logout(&mut self) -> Result<()> {
        let mut h = Header::request(Opcode::Logout, Tag::new(0, 0), 0, 0);
        h.queue = self.index;
        h.session = self.session;
        h.seal_crc(&[]);
        self.tx.push(&h, &[], (), 0);
        self.flush_tx()
    }

    /// Test hook: sends raw bytes as one frame (to replay stale or forged frames).
    pub(crate) fn send_raw(&mut self, frame: &[u8]) -> Result<()> {
        self.tx.push_raw(frame, ());
        self.flush_tx()
    }

    pub(crate) fn session(&self) -> u32 {
        self.session
    }
}

/// Discards what a socket received before its ring was set up (answers to the control exchange
/// that opened it): the ring only sees what arrives after.
fn drain(fd: RawFd) {
    let mut buf = [0u8; 64];
    // SAFETY: recv into a local buffer; longer frames are truncated, which is what we want.
    while unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) } >= 0 {}
}

/// Opens a UDP socket connected to `addr`, with buffers sized for bursts of frames.
pub(crate) fn udp_link(addr: std::net::SocketAddr) -> Result<Link> {
    let sock = std::net::UdpSocket::bind(if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })?;
    sock.connect(addr)?;
    sock.set_nonblocking(true)?;
    let fd: OwnedFd = sock.into();
    // The path MTU of the connected route decides the frame payload (PROTOCOL.md §9.1).
    let mut mtu: libc::c_int = 1500;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let (level, opt, ip_overhead) = if addr.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_MTU, 28)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU, 48)
    };
    // SAFETY: getsockopt into a local int.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&mut mtu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    let mtu_payload = blkwire_net::frame_payload_for(mtu as u32, ip_overhead);
    let rcvbuf = blkwire_net::size_buffers(fd.as_raw_fd());
    Ok(Link {
        fd,
        dest: None,
        mtu_payload,
        send_fd: None,
        rcvbuf,
    })
}

/// Opens a packet socket on `iface` that receives only this queue's frames (and this session's,
/// once known), addressed to the target's MAC.
pub(crate) fn eth_link(
    iface: &str,
    mac: [u8; 6],
    queue: u16,
    session: Option<u32>,
) -> Result<Link> {
    let info = blkwire_net::iface(iface).map_err(Error::Usage)?;
    let ethertype = blkwire_net::DEFAULT_ETHERTYPE;
    let filter = blkwire_net::Filter::Queue { queue, session };
    let fd = blkwire_net::packet_socket(info.index, ethertype, filter).map_err(Error::Usage)?;
    let rcvbuf = blkwire_net::size_buffers(fd.as_raw_fd());
    Ok(Link {
        fd,
        dest: Some(blkwire_net::link_addr(info.index, ethertype, mac)),
        mtu_payload: blkwire_net::frame_payload_for(info.mtu, 0),
        send_fd: Some(blkwire_net::packet_send_socket(info.index).map_err(Error::Usage)?),
        rcvbuf,
    })
}

/// One control exchange over a datagram link (HELLO, JOIN, LIST): the request is sent again with
/// a doubling timer until a reply with the same opcode arrives or `timeout` passes.
pub(crate) fn exchange(
    link: &Link,
    mut h: Header,
    payload: &[u8],
    timeout: Duration,
) -> Result<(Header, Vec<u8>)> {
    h.payload_len = payload.len() as u32;
    h.seal_crc(payload);
    let mut frame = h.to_bytes().to_vec();
    frame.extend_from_slice(payload);
    let deadline = Instant::now() + timeout;
    let mut wait = Duration::from_millis(50);
    let mut buf = vec![0u8; 65536];
    loop {
        link.send_one(&frame);
        let until = (Instant::now() + wait).min(deadline);
        while let Some((r, p, _)) = link.recv_reply(&mut buf, until) {
            if r.opcode == h.opcode && r.tag == h.tag {
                return Ok((r, p.to_vec()));
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout(timeout));
        }
        wait = (wait * 2).min(Duration::from_secs(1));
    }
}

/// One target that answered a discovery query.
#[derive(Clone, Debug)]
pub struct Discovered {
    /// `eth://IFACE/MAC` or `udp://HOST:PORT`: prefix of the export URLs.
    pub base: String,
    pub exports: Vec<blkwire_wire::ExportEntry>,
}

/// Sends a LIST frame (PROTOCOL.md §9.5) and collects every answer until `wait` passes.
/// `dest` is the broadcast (or unicast) address on a packet socket; `None` on connected UDP.
fn discover_on(
    link: &Link,
    wait: Duration,
    base_of: &dyn Fn(&libc::sockaddr_ll) -> String,
) -> Vec<Discovered> {
    let mut h = Header::request(Opcode::List, Tag::new(0, 0), 0, 0);
    h.seal_crc(&[]);
    link.send_one(&h.to_bytes());
    let deadline = Instant::now() + wait;
    let mut found: Vec<Discovered> = Vec::new();
    let mut buf = vec![0u8; 65536];
    while let Some((r, p, from)) = link.recv_reply(&mut buf, deadline) {
        if r.opcode != Opcode::List {
            continue;
        }
        let Ok(exports) = blkwire_wire::ExportEntry::decode_list(p) else {
            continue;
        };
        let base = base_of(&from);
        if !found.iter().any(|d| d.base == base) {
            found.push(Discovered { base, exports });
        }
    }
    found
}

/// Broadcasts a LIST on `iface` and returns every target that answered within `wait`.
pub fn discover_eth(iface: &str, wait: Duration) -> Result<Vec<Discovered>> {
    let info = blkwire_net::iface(iface).map_err(Error::Usage)?;
    let ethertype = blkwire_net::DEFAULT_ETHERTYPE;
    let filter = blkwire_net::Filter::Queue {
        queue: 0,
        session: Some(0),
    };
    let fd = blkwire_net::packet_socket(info.index, ethertype, filter).map_err(Error::Usage)?;
    let link = Link {
        fd,
        dest: Some(blkwire_net::link_addr(info.index, ethertype, [0xff; 6])),
        mtu_payload: 0,
        send_fd: None,
        rcvbuf: 0,
    };
    let iface = iface.to_string();
    Ok(discover_on(&link, wait, &|from| {
        let mut m = [0u8; 6];
        m.copy_from_slice(&from.sll_addr[..6]);
        format!("eth://{iface}/{}", crate::format_mac(&m))
    }))
}

/// Asks one UDP target for its exports.
pub fn discover_udp(addr: std::net::SocketAddr, wait: Duration) -> Result<Vec<Discovered>> {
    let link = udp_link(addr)?;
    Ok(discover_on(&link, wait, &|_| format!("udp://{addr}")))
}

#[cfg(test)]
mod tests {
    use super::*;
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
            let (h, _) = f.expect("valid request frame");
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
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let give_up = Duration::from_secs(30);
        let mut q = DgramQueue::new(link, 7, 0, 8, 4096, 8192, 64, give_up, Duration::ZERO);
        // Retransmission timers 1 s away: only the probe can recover the burst before that.
        q.rto_min = RTO_MAX;
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
        // The probes resend the newest request; its answer shows the others lost, and each is
        // sent again once. (A second probe can fire when the first one's answer comes back
        // sooner than the smallest round trip seen, which cannot tell it from a late answer to
        // the original: then the second probe resends one of the others.)
        let retransmits = st.retransmits - before.retransmits;
        assert!(
            (8..=probes + 7).contains(&retransmits),
            "8 lost requests need 8 to {} retransmissions: {st:?}",
            probes + 7
        );
        assert_eq!(st.timeouts, 0);
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
            let give_up = Duration::from_secs(30);
            let mut q = DgramQueue::new(link, 7, 0, 8, 16384, 1024, 64, give_up, Duration::ZERO);
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
            assert_eq!(q.gso, !refuse);
            target
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut buf = vec![0u8; 65536];
            for got in 0..16 {
                let n = target.recv(&mut buf).unwrap();
                assert_eq!(n, HEADER_LEN + 1024, "one fragment per datagram");
                let (h, payload) = datagram::frames(&buf[..n], 65536)
                    .next()
                    .unwrap()
                    .expect("a valid frame");
                assert_eq!(h.frag_offset, got * 1024);
                assert!(payload.iter().all(|&b| b == 0x3c));
            }
        }
    }

    fn idle_queue(target: &UdpSocket) -> DgramQueue {
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let give_up = Duration::from_secs(30);
        DgramQueue::new(link, 7, 0, 8, 4096, 8192, 64, give_up, Duration::ZERO)
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
}
