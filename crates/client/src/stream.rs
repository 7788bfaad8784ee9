//! TCP queues: one connection, `depth` slots, frames pipelined through one send buffer. A TLS
//! queue encrypts that buffer and decrypts into the receive buffer, record by record, through
//! its session on the same non-blocking socket.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use blkwire_wire::{Flags, Header, Opcode, Status, Tag, HEADER_LEN};

use blkwire_wire::nvme_tcp::{self, Pdu, Progress};

use crate::nvme::Framing;
use crate::queue::{Cmd, Completion, Parts, QueueStats};
use crate::tls::Link;
use crate::{ConnectOptions, Error, ExportInfo, Result};

/// How soon `poll` must run again while queued bytes wait for room in a full socket: the
/// caller sleeps on the socket's POLLIN and its timers, not POLLOUT.
const SEND_RETRY: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Default)]
struct Slot {
    generation: u16,
    busy: bool,
    opcode: u8,
    len: u32,
    user: u64,
}

pub(crate) struct StreamQueue {
    sock: Link,
    index: u16,
    max_io: u32,
    slots: Vec<Slot>,
    free: Vec<u16>,
    tx: Vec<u8>,
    tx_sent: usize,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    /// Most the receive buffer grows to while a send waits (`fill`).
    rx_cap: usize,
    timeout: Duration,
    /// `poll`: since when requests have been in flight without any answer (None: nothing in
    /// flight). An answer resets it; `timeout` past it is `Error::Timeout`, as in `complete`.
    waiting_since: Option<Instant>,
    /// TLS: `poll` stopped at its budget before the session said it held nothing more. The
    /// session may hold whole records it took off the socket, which then shows nothing to
    /// wait for: `deadline` is now until `poll` runs again.
    unread: bool,
    spin: blkwire_spin::AdaptiveSpin,
    stats: QueueStats,
    /// NVMe/TCP framing instead of blkwire frames (`nvme-tcp://`, `nvme.rs`).
    nvme: Option<Box<Framing>>,
}

impl StreamQueue {
    pub(crate) fn new(
        sock: Link,
        index: u16,
        info: &ExportInfo,
        opts: &ConnectOptions,
    ) -> Result<StreamQueue> {
        sock.tcp().set_nonblocking(true)?;
        let depth = info.depth;
        let rx_len = info.max_io as usize + HEADER_LEN + (256 << 10);
        Ok(StreamQueue {
            sock,
            index,
            max_io: info.max_io,
            slots: vec![Slot::default(); depth as usize],
            free: (0..depth).rev().collect(),
            tx: Vec::with_capacity(256 << 10),
            tx_sent: 0,
            rx: vec![0; rx_len],
            rx_start: 0,
            rx_end: 0,
            // While we send, the target may send every reply we await: at most `depth`, of at
            // most max_io each. More than that is not an answer to anything.
            rx_cap: rx_len + depth as usize * (info.max_io as usize + HEADER_LEN),
            timeout: opts.timeout,
            waiting_since: None,
            unread: false,
            spin: blkwire_spin::AdaptiveSpin::new(opts.poll),
            stats: QueueStats::default(),
            nvme: None,
        })
    }

    /// An NVMe/TCP I/O queue (connected and admitted by `nvme::connect`).
    pub(crate) fn new_nvme(
        sock: Link,
        index: u16,
        info: &ExportInfo,
        opts: &ConnectOptions,
        framing: Framing,
    ) -> Result<StreamQueue> {
        let mut q = StreamQueue::new(sock, index, info, opts)?;
        q.nvme = Some(Box::new(framing));
        Ok(q)
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
    /// The longest wait for a reply (`ConnectOptions::timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }
    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Queues a command for sending (nothing is sent until [`Queue::send`] or a wait). `user` comes
    /// back in its completion. Fails only when every slot is busy or the command is malformed.
    pub fn submit(&mut self, cmd: Cmd<'_>, user: u64) -> Result<()> {
        if self.nvme.is_some() {
            return self.submit_nvme(cmd, user);
        }
        let Parts {
            opcode: op,
            offset,
            len,
            flags,
            payload,
        } = cmd.parts(self.max_io)?;
        let slot = self
            .free
            .pop()
            .ok_or_else(|| Error::Usage("all queue slots are busy".into()))?;
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        s.busy = true;
        s.opcode = op as u8;
        s.len = len;
        s.user = user;
        let mut h = Header::request(op, Tag::new(slot, s.generation), offset, len);
        h.flags = Flags(flags);
        h.queue = self.index;
        h.payload_len = payload.len() as u32;
        self.tx.extend_from_slice(&h.to_bytes());
        self.tx.extend_from_slice(payload);
        self.stats.frames_out += 1;
        Ok(())
    }

    fn submit_nvme(&mut self, cmd: Cmd<'_>, user: u64) -> Result<()> {
        let Parts { opcode, len, .. } = cmd.parts(self.max_io)?;
        let slot = *self
            .free
            .last()
            .ok_or_else(|| Error::Usage("all queue slots are busy".into()))?;
        let generation = self.slots[slot as usize].generation.wrapping_add(1);
        let cid = crate::nvme::cid(slot, generation);
        let fr = self.nvme.as_mut().expect("an NVMe/TCP queue");
        fr.encode(cmd, slot, cid, &mut self.tx)?;
        self.free.pop();
        let s = &mut self.slots[slot as usize];
        s.generation = generation;
        s.busy = true;
        s.opcode = opcode as u8;
        s.len = len;
        s.user = user;
        self.stats.frames_out += 1;
        Ok(())
    }

    /// Sends what the socket takes now; true once everything queued went (the buffer is then
    /// emptied), false when the socket is full.
    fn send_now(&mut self) -> Result<bool> {
        while self.tx_sent < self.tx.len() {
            match self.sock.send_nb(&self.tx[self.tx_sent..]) {
                Ok(n) => self.tx_sent += n,
                Err(e) => match e.kind() {
                    ErrorKind::Interrupted => continue,
                    ErrorKind::WouldBlock => return Ok(false),
                    ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => {
                        return Err(Error::Closed)
                    }
                    _ => return Err(Error::Io(e)),
                },
            }
        }
        self.tx.clear();
        self.tx_sent = 0;
        Ok(true)
    }

    /// Sends what the socket takes now and keeps the rest, for `poll`, which must not block:
    /// the caller comes back when [`StreamQueue::deadline`] says (soon, while bytes wait), or
    /// when a reply comes. A TLS session too: its socket is non-blocking, a write the socket
    /// cannot take is WANT_WRITE, and OpenSSL's retry rule holds (the bytes not sent are the
    /// same, at the front of the slice given again, which may have moved and grown: the
    /// connector's ACCEPT_MOVING_WRITE_BUFFER and ENABLE_PARTIAL_WRITE).
    fn send_some(&mut self) -> Result<()> {
        // What went is dropped from the front once it is the larger part, so requests queued
        // behind do not grow the buffer by everything sent.
        if !self.send_now()? && self.tx_sent >= self.tx.len() - self.tx_sent {
            self.tx.drain(..self.tx_sent);
            self.tx_sent = 0;
        }
        Ok(())
    }

    /// Sends everything queued. While the socket is full it keeps reading replies into the receive
    /// buffer, so a target blocked on sending to us can never deadlock with us. The timeout is
    /// for a target that hardly moves: each `PROGRESS` bytes it takes or sends start it again
    /// (a slow link takes longer than the timeout to carry a queue's depth of large writes, all
    /// of them answered as they land), a byte now and then does not (that would hold the
    /// caller for ever).
    pub fn send(&mut self) -> Result<()> {
        const PROGRESS: usize = 64 << 10;
        let mut deadline = crate::deadline::later(Instant::now(), self.timeout);
        let mut moved = 0;
        loop {
            let (sent, received) = (self.tx_sent, self.rx_end);
            if self.send_now()? {
                return Ok(());
            }
            moved += self.tx_sent - sent;
            let ev = self.wait_fd(libc::POLLOUT | libc::POLLIN, deadline)?;
            if ev & libc::POLLIN != 0 && self.fill(true)? {
                // `fill` may move what it holds to the front first: count what it added.
                moved += self.rx_end.saturating_sub(received.min(self.rx_end));
            }
            if moved >= PROGRESS {
                moved = 0;
                deadline = crate::deadline::later(Instant::now(), self.timeout);
            }
        }
    }

    /// Sends what is queued, then delivers completions to `f` until at least `min` have been
    /// delivered (0: only those already received). Returns how many were delivered.
    pub fn complete(&mut self, min: usize, mut f: impl FnMut(Completion<'_>)) -> Result<usize> {
        self.send()?;
        let mut done = self.deliver(&mut f, true)?;
        let mut deadline = crate::deadline::later(Instant::now(), self.timeout);
        while done < min {
            if self.in_flight() == 0 {
                return Err(Error::Usage(
                    "waiting for completions with nothing in flight".into(),
                ));
            }
            // Checked here too, not only when the socket is empty: replies to nothing coming
            // as fast as we read them are no answer, and must not hold us past the timeout.
            if Instant::now() >= deadline {
                return Err(Error::Timeout(self.timeout));
            }
            let mut spin = std::mem::take(&mut self.spin);
            let mut failed = None;
            let got = spin.spin(|| match self.fill(false) {
                Ok(got) => got,
                Err(e) => {
                    failed = Some(e);
                    true
                }
            });
            self.spin = spin;
            if let Some(e) = failed {
                return Err(e);
            }
            if !got {
                loop {
                    self.wait_fd(libc::POLLIN, deadline)?;
                    if self.fill(false)? {
                        break;
                    }
                }
            }
            let n = self.deliver(&mut f, true)?;
            if n > 0 {
                deadline = crate::deadline::later(Instant::now(), self.timeout);
            }
            done += n;
        }
        Ok(done)
    }

    /// Sends what the socket takes of what is queued, then delivers every reply that has
    /// arrived, without waiting for either (a target that stops reading must not stop the
    /// caller from taking the replies it did send, nor from timing its requests out). Fails
    /// with `Error::Timeout` once requests have been in flight for the timeout without any
    /// reply (the timer runs across calls; see [`StreamQueue::deadline`]).
    pub fn poll(&mut self, mut f: impl FnMut(Completion<'_>)) -> Result<usize> {
        self.send_some()?;
        let mut done = self.deliver(&mut f, false)?;
        // About a receive buffer's worth per call: a target sending faster than we read must
        // not keep poll from returning (nor from seeing the timeout below). A TLS session
        // stopped there may hold records it read ahead (OpenSSL 3.0 reports none pending:
        // neither SSL_pending nor SSL_has_pending counts them), which the socket no longer
        // shows: `deadline` then asks for another poll at once.
        let mut taken = 0;
        let mut drained = false;
        while taken < self.rx.len() {
            let before = self.rx_end - self.rx_start;
            if !self.fill(false)? {
                drained = true;
                break;
            }
            taken += self.rx_end - self.rx_start - before;
            done += self.deliver(&mut f, false)?;
        }
        self.unread = !drained && crate::deadline::Socket::reads_records(&self.sock);
        if self.in_flight() == 0 {
            self.waiting_since = None;
        } else {
            let now = Instant::now();
            match self.waiting_since {
                Some(t) if done == 0 => {
                    if now.duration_since(t) >= self.timeout {
                        return Err(Error::Timeout(self.timeout));
                    }
                }
                _ => self.waiting_since = Some(now),
            }
        }
        Ok(done)
    }

    /// The receive buffer's length now, and the most it may ever grow to: `rx_cap`, which
    /// bounds `fill` while a send waits, and is more than `make_room` ever asks (a native
    /// frame fits the buffer as made; an NVMe/TCP read's C2HData held until its CapsuleResp
    /// is in is two PDUs of at most `max_io` + 4 KiB, the PLEN bound `nvme::connect` sets).
    pub(crate) fn rx_buffer(&self) -> (usize, usize) {
        (self.rx.len(), self.rx_cap)
    }

    /// When `poll` must run even if the socket stays quiet: to report the timeout, soon while
    /// queued bytes wait for room in the socket (`send_some`), and now when a TLS session may
    /// hold replies `poll` left for its next call (`unread`).
    pub fn deadline(&self) -> Option<Instant> {
        if self.unread {
            return Some(Instant::now());
        }
        let timeout = self
            .waiting_since
            .filter(|_| self.in_flight() > 0)
            .map(|t| crate::deadline::later(t, self.timeout));
        let unsent = (self.tx_sent < self.tx.len()).then(|| Instant::now() + SEND_RETRY);
        timeout.into_iter().chain(unsent).min()
    }

    pub fn fd(&self) -> RawFd {
        self.sock.tcp().as_raw_fd()
    }

    /// Reads whatever the socket holds. Returns false when nothing was there.
    /// With `grow`, the buffer grows instead of stopping when full (used while sending).
    fn fill(&mut self, grow: bool) -> Result<bool> {
        if self.rx_end == self.rx.len() {
            if self.rx_start > 0 {
                self.rx.copy_within(self.rx_start..self.rx_end, 0);
                self.rx_end -= self.rx_start;
                self.rx_start = 0;
            } else if grow {
                let new = (self.rx.len() * 2).min(self.rx_cap);
                if new == self.rx.len() {
                    return Err(Error::Protocol("more reply data than requested".into()));
                }
                self.rx.resize(new, 0);
            } else {
                return Ok(true); // full of unprocessed frames: the caller delivers them first
            }
        }
        loop {
            // TLS: Ok(false) only once the session holds no decrypted bytes either, so a caller
            // that then waits for the socket never leaves replies behind.
            match self.sock.recv_nb(&mut self.rx[self.rx_end..]) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => {
                    self.rx_end += n;
                    return Ok(true);
                }
                Err(e) => match e.kind() {
                    ErrorKind::Interrupted => continue,
                    ErrorKind::WouldBlock => return Ok(false),
                    ErrorKind::ConnectionReset => return Err(Error::Closed),
                    _ => return Err(Error::Io(e)),
                },
            }
        }
    }

    fn wait_fd(&self, events: i16, deadline: Instant) -> Result<i16> {
        let revents = crate::deadline::poll_until(self.fd(), events, deadline, self.timeout)?;
        if revents & (libc::POLLERR | libc::POLLHUP) != 0 && revents & libc::POLLIN == 0 {
            return Err(Error::Closed);
        }
        Ok(revents)
    }

    /// Hands every complete reply in the receive buffer to `f`; `block`: sends what R2Ts ask
    /// for even while the socket is full (else what it takes, `poll`).
    fn deliver(&mut self, f: &mut impl FnMut(Completion<'_>), block: bool) -> Result<usize> {
        if self.nvme.is_some() {
            let mut n = self.deliver_nvme(f, block)?;
            // Data the target asked for (R2T) goes out at once (from `poll`, as far as the
            // socket takes it): its write waits for it. What arrives while it goes is delivered
            // too, since the caller waits on the socket next.
            while !self.tx.is_empty() {
                let before = self.tx.len() - self.tx_sent;
                if block {
                    self.send()?;
                } else {
                    self.send_some()?;
                }
                let more = self.deliver_nvme(f, block)?;
                n += more;
                if !block && more == 0 && self.tx.len() - self.tx_sent >= before {
                    break; // the socket is full: `deadline` brings the caller back
                }
            }
            return Ok(n);
        }
        let mut n = 0;
        loop {
            let avail = self.rx_end - self.rx_start;
            if avail < HEADER_LEN {
                break;
            }
            let h = Header::decode(&self.rx[self.rx_start..self.rx_end], self.max_io)
                .map_err(|e| Error::Protocol(e.to_string()))?;
            let total = HEADER_LEN + h.payload_len as usize;
            if avail < total {
                self.make_room(total);
                break;
            }
            let at = self.rx_start + HEADER_LEN;
            self.rx_start += total;
            self.stats.frames_in += 1;
            if !h.is_reply() {
                return Err(Error::Protocol(format!(
                    "unexpected {:?} request from the target",
                    h.opcode
                )));
            }
            let slot = h.tag.slot() as usize;
            let matches = self.slots.get(slot).is_some_and(|s| {
                s.busy && s.generation == h.tag.generation() && s.opcode == h.opcode as u8
            });
            if !matches {
                self.stats.late_replies += 1;
                continue;
            }
            let s = self.slots[slot];
            let expect = if h.opcode == Opcode::Read && h.status == Status::Ok {
                s.len
            } else {
                0
            };
            if h.payload_len != expect {
                return Err(Error::Protocol(format!(
                    "reply carries {} bytes, expected {expect}",
                    h.payload_len
                )));
            }
            h.check_stream_crc(
                &self.rx[at - HEADER_LEN..],
                &self.rx[at..at + total - HEADER_LEN],
            )
            .map_err(|e| Error::Protocol(e.to_string()))?;
            self.slots[slot].busy = false;
            self.free.push(slot as u16);
            if h.status != Status::Ok {
                self.stats.errors += 1;
            }
            n += 1;
            f(Completion {
                user: s.user,
                // The request's, as on every transport; a COPY's answer is in the reply's.
                length: if h.opcode == Opcode::Copy {
                    h.length
                } else {
                    s.len
                },
                status: h.status,
                data: &self.rx[at..at + expect as usize],
            });
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        Ok(n)
    }

    /// `deliver` for NVMe/TCP: CapsuleResps complete commands; a read's single C2HData is
    /// delivered in place once its CapsuleResp is in the buffer too (or at once with SUCCESS),
    /// data in pieces is gathered per slot; R2Ts are answered with the write's data.
    fn deliver_nvme(&mut self, f: &mut impl FnMut(Completion<'_>), block: bool) -> Result<usize> {
        let mut n = 0;
        loop {
            // Data answering R2Ts goes out as it piles up, not after every PDU in the buffer
            // is handled: what waits here stays within a couple of writes (without `block`, as
            // far as the socket takes it: R2Ts come only for the writes in flight, so what
            // waits is bounded by them).
            if self.tx.len() - self.tx_sent > 2 * self.max_io as usize {
                if block {
                    self.send()?;
                } else {
                    self.send_some()?;
                }
            }
            let fr = self.nvme.as_mut().expect("an NVMe/TCP queue");
            let avail = &self.rx[self.rx_start..self.rx_end];
            let need = |r: std::result::Result<Progress, nvme_tcp::PduError>| match r {
                Ok(p) => Ok(p),
                Err(e) => Err(Error::Protocol(e.to_string())),
            };
            let len = match need(nvme_tcp::pdu_len(avail, &fr.rx))? {
                Progress::Complete(len) => len,
                Progress::Need(total) => {
                    self.make_room(total);
                    break;
                }
            };
            let pdu = nvme_tcp::decode(&avail[..len], &fr.rx)
                .map_err(|e| Error::Protocol(e.to_string()))?;
            let mut done: Option<Finished> = None;
            let mut consumed = len;
            match pdu {
                Pdu::CapsuleResp(c) => {
                    if let Some(slot) = live_slot(&self.slots, c.cid) {
                        done = Some((slot, None, crate::nvme::status(&c)));
                    } else {
                        self.stats.late_replies += 1;
                    }
                }
                Pdu::C2HData(d) => {
                    // Only a read takes data, and with SUCCESS it would complete any command.
                    let Some(slot) = live_slot(&self.slots, d.cccid)
                        .filter(|&s| self.slots[s].opcode == Opcode::Read as u8)
                    else {
                        return Err(Error::Protocol(format!(
                            "C2HData for CID {:#x}, which is not a read in flight",
                            d.cccid
                        )));
                    };
                    let at = self.rx_start + (d.data.as_ptr() as usize - avail.as_ptr() as usize);
                    let whole =
                        d.datao == 0 && d.last && d.data.len() == self.slots[slot].len as usize;
                    if whole && d.success {
                        done = Some((slot, Some((at, d.data.len())), Status::Ok));
                    } else if whole {
                        // Its CapsuleResp normally follows at once: deliver the data where it
                        // lies when that is in the buffer, wait for it when it is not.
                        let rest = &avail[len..];
                        match need(nvme_tcp::pdu_len(rest, &fr.rx))? {
                            Progress::Need(more) => {
                                self.make_room(len + more);
                                break;
                            }
                            Progress::Complete(m) => match nvme_tcp::decode(&rest[..m], &fr.rx) {
                                Ok(Pdu::CapsuleResp(c)) if c.cid == d.cccid => {
                                    consumed = len + m;
                                    done = Some((
                                        slot,
                                        Some((at, d.data.len())),
                                        crate::nvme::status(&c),
                                    ));
                                }
                                _ => gather(fr, slot, d.datao, d.data, self.slots[slot].len)?,
                            },
                        }
                    } else {
                        let want = self.slots[slot].len;
                        gather(fr, slot, d.datao, d.data, want)?;
                        if d.success {
                            // The last piece with SUCCESS (the decoder refuses it on any
                            // other): no CapsuleResp follows, the read is done with what was
                            // gathered, all of it.
                            if fr.gathered[slot].len() != want as usize {
                                return Err(Error::Protocol(format!(
                                    "C2HData with SUCCESS after {} of a {want}-byte read",
                                    fr.gathered[slot].len()
                                )));
                            }
                            done = Some((slot, None, Status::Ok));
                        }
                    }
                }
                Pdu::R2T(r) => {
                    let Some(slot) = live_slot(&self.slots, r.cccid) else {
                        return Err(Error::Protocol(format!(
                            "R2T for CID {:#x}, which is not in flight",
                            r.cccid
                        )));
                    };
                    let fr = self.nvme.as_mut().expect("an NVMe/TCP queue");
                    fr.answer_r2t(slot as u16, &r, &mut self.tx)?;
                }
                Pdu::C2HTermReq(t) => {
                    return Err(Error::Protocol(format!(
                        "the target ended the queue (C2HTermReq FES {:#x}, FEI {:#x})",
                        t.fes, t.fei
                    )))
                }
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected {:?} from the target",
                        other.typ()
                    )))
                }
            }
            self.rx_start += consumed;
            self.stats.frames_in += 1;
            let Some((slot, range, status)) = done else {
                continue;
            };
            let s = self.slots[slot];
            let fr = self.nvme.as_mut().expect("an NVMe/TCP queue");
            let data: &[u8] = match range {
                _ if status != Status::Ok || s.opcode != Opcode::Read as u8 => &[],
                Some((at, len)) => &self.rx[at..at + len],
                None => &fr.gathered[slot],
            };
            // Checked before the slot is let go, as on native replies: a request the queue
            // fails on stays in flight rather than vanish without a completion.
            if s.opcode == Opcode::Read as u8
                && status == Status::Ok
                && data.len() != s.len as usize
            {
                return Err(Error::Protocol(format!(
                    "a read of {} bytes got {}",
                    s.len,
                    data.len()
                )));
            }
            self.slots[slot].busy = false;
            self.free.push(slot as u16);
            if status != Status::Ok {
                self.stats.errors += 1;
            }
            n += 1;
            f(Completion {
                user: s.user,
                length: s.len,
                status,
                data,
            });
            fr.gathered[slot].clear();
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        Ok(n)
    }

    /// Makes room for a message of `total` bytes starting at `rx_start`: moves what is buffered
    /// to the front, and grows the buffer only for a message larger than it (never a native
    /// frame: the buffer holds the largest one the session allows).
    fn make_room(&mut self, total: usize) {
        if self.rx.len() - self.rx_start < total {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
            if self.rx.len() < total {
                self.rx.resize(total, 0);
            }
        }
    }

    /// Ends the queue cleanly after everything in flight (PROTOCOL.md §2.5).
    pub fn logout(&mut self) -> Result<()> {
        if self.nvme.is_some() {
            // Closing the connection ends an NVMe/TCP I/O queue; the controller ends with the
            // session's last queue.
            return self.send();
        }
        let h = Header::request(Opcode::Logout, Tag::new(0, 0), 0, 0);
        self.tx.extend_from_slice(&h.to_bytes());
        self.send()
    }
}

/// A command the PDUs just taken complete: its slot, where its read data lies in the receive
/// buffer (None: gathered in the slot, or no data), and its status.
type Finished = (usize, Option<(usize, usize)>, Status);

/// The slot a CID names, if that command is in flight (same generation).
fn live_slot(slots: &[Slot], cid: u16) -> Option<usize> {
    let (slot, _) = crate::nvme::slot_of(cid);
    let s = slots.get(slot as usize)?;
    (s.busy && crate::nvme::cid(slot, s.generation) == cid).then_some(slot as usize)
}

/// Copies read data that came in pieces into the slot's buffer, in order.
fn gather(fr: &mut Framing, slot: usize, datao: u32, data: &[u8], len: u32) -> Result<()> {
    let g = &mut fr.gathered[slot];
    if datao as usize != g.len() || g.len() + data.len() > len as usize {
        return Err(Error::Protocol(format!(
            "C2HData at {datao}+{} of a {len}-byte read, expected at {}",
            data.len(),
            g.len()
        )));
    }
    g.extend_from_slice(data);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::testing::{self, granted};
    use crate::Queue;

    /// A reply frame whose tag matches nothing a queue sends (slot 999).
    fn unmatched() -> [u8; HEADER_LEN] {
        Header::request(Opcode::Keepalive, Tag::new(999, 0), 0, 0)
            .reply(Status::Ok, 0)
            .to_bytes()
    }

    /// `frames` unmatched replies in one buffer.
    fn flood(frames: usize) -> Vec<u8> {
        unmatched().repeat(frames)
    }

    fn options(timeout: Duration) -> ConnectOptions {
        ConnectOptions {
            queues: 1,
            depth: 8,
            max_io: 1 << 20,
            timeout,
            ..Default::default()
        }
    }

    /// A queue granted `opts.depth` slots of 1 MiB I/O on a loopback connection, past any
    /// handshake, and the target's end of it.
    fn queue_on_loopback(opts: &ConnectOptions) -> (StreamQueue, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sock = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (target, _) = l.accept().unwrap();
        let url = crate::Url::parse("tcp://127.0.0.1/x").unwrap();
        let info = crate::info_from(&url, &granted(1, opts.depth, 1 << 20, 1 << 20));
        let q = StreamQueue::new(Link::Plain(sock), 0, &info, opts).unwrap();
        (q, target)
    }

    /// Queues `n` WRITEs of 1 MiB, one after another from offset 0.
    fn submit_mib_writes(q: &mut StreamQueue, n: u64) {
        let data = vec![7u8; 1 << 20];
        for i in 0..n {
            let w = Cmd::Write {
                offset: i << 20,
                data: &data,
                fua: false,
            };
            q.submit(w, i).unwrap();
        }
    }

    /// The timeout is for a target that takes nothing: one that takes the writes slowly but
    /// steadily (a slow link) keeps `send` going, however long the whole takes.
    #[test]
    fn a_target_that_takes_writes_slowly_is_no_timeout() {
        let opts = ConnectOptions {
            depth: 32,
            ..options(Duration::from_millis(500))
        };
        let (mut q, mut target) = queue_on_loopback(&opts);
        submit_mib_writes(&mut q, 32);
        // At most 1 MiB every 100 ms: 32 MiB take seconds, several timeouts, past what the
        // socket buffers hold; the client sees room every fraction of one.
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut total = 0;
            while let Ok(n) = std::io::Read::read(&mut target, &mut buf) {
                if n == 0 {
                    break;
                }
                total += n;
                std::thread::sleep(Duration::from_millis(100));
            }
            total
        });
        let started = Instant::now();
        q.send().expect("sent, slowly");
        let took = started.elapsed();
        drop(q);
        assert!(reader.join().unwrap() >= 32 << 20);
        // Not a measurement: the test means nothing if the socket buffers took it all.
        assert!(
            took > Duration::from_millis(500),
            "sent within one timeout ({took:?})"
        );
    }

    /// A target that takes nothing and sends a byte now and then does not hold `send` for
    /// ever: a trickle is no progress.
    #[test]
    fn a_target_that_trickles_bytes_times_send_out() {
        let (mut q, mut target) = queue_on_loopback(&options(Duration::from_millis(500)));
        submit_mib_writes(&mut q, 8);
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(q.send());
        });
        // Reads nothing; a byte every 100 ms, until the client gives up (or 20 s).
        for _ in 0..200 {
            if let Ok(r) = ended.recv_timeout(Duration::from_millis(100)) {
                assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
                return;
            }
            let _ = std::io::Write::write_all(&mut target, &[0]);
        }
        panic!("send still going after 20 s of a trickle");
    }

    /// A timeout past the clock (a library caller's `Duration::MAX`) is no panic where the
    /// map daemons' loop asks for the next deadline with requests in flight.
    #[test]
    fn a_timeout_past_the_clock_gives_a_deadline_not_a_panic() {
        let (mut q, _target) = queue_on_loopback(&options(Duration::MAX));
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 4096,
            },
            1,
        )
        .unwrap();
        assert_eq!(q.poll(|_| panic!("nothing was answered")).unwrap(), 0);
        assert!(q.deadline().is_some_and(|d| d > Instant::now()));
    }

    /// A queue of `depth` slots of `max_io` bytes on a TLS-PSK target on loopback (host "h"),
    /// which `serve` runs once the handshake is done.
    fn tls_queue(
        depth: u16,
        max_io: u32,
        timeout: Duration,
        serve: impl FnOnce(openssl::ssl::SslStream<std::net::TcpStream>) + Send + 'static,
    ) -> (StreamQueue, ConnectOptions) {
        let key = blkwire_auth::Key::generate();
        let k = key.bytes().to_vec();
        let url = testing::raw(move |s| {
            serve(
                openssl::ssl::Ssl::new(&testing::psk_server(k))
                    .unwrap()
                    .accept(s)
                    .unwrap(),
            )
        });
        let opts = ConnectOptions {
            tls: true,
            key: Some(key),
            host_id: "h".into(),
            depth,
            ..options(timeout)
        };
        let sock = std::net::TcpStream::connect(url.authority()).unwrap();
        let deadline = crate::deadline::Deadline::after(Duration::from_secs(10));
        let c = crate::tls::connector(&opts).unwrap();
        let link = crate::tls::connect(&url, &opts, &c, sock, &deadline).unwrap();
        let info = crate::info_from(&url, &granted(1, depth, max_io, max_io));
        (StreamQueue::new(link, 0, &info, &opts).unwrap(), opts)
    }

    /// Submits `depth` WRITEs of 1 MiB (more than loopback's socket buffers hold while the
    /// target reads nothing): `poll` sends what the socket takes and returns, bytes left.
    fn fill_a_socket_nobody_reads(q: &mut StreamQueue, depth: u16) {
        let data = vec![7u8; 1 << 20];
        for i in 0..depth {
            let offset = u64::from(i) << 20;
            let write = Cmd::Write {
                offset,
                data: &data,
                fua: false,
            };
            q.submit(write, u64::from(i)).unwrap();
        }
        let r = q.poll(|_| panic!("nothing was answered"));
        assert!(matches!(r, Ok(0)), "{r:?}");
        assert!(
            q.tx_sent < q.tx.len(),
            "the socket took everything: send more"
        );
    }

    /// The same over TLS: `poll` sends what the socket takes and returns, where the session's
    /// send waited (until the timeout) for a target that stopped reading.
    #[test]
    fn poll_does_not_wait_for_a_tls_target_that_stops_reading() {
        const DEPTH: u16 = 64;
        let (go_tx, go) = std::sync::mpsc::channel::<()>();
        let (mut q, opts) = tls_queue(DEPTH, 1 << 20, Duration::from_secs(20), move |mut t| {
            // Reads nothing until told.
            let _ = go.recv();
            for _ in 0..DEPTH {
                let mut hb = [0u8; HEADER_LEN];
                std::io::Read::read_exact(&mut t, &mut hb).unwrap();
                let h = Header::decode(&hb, 1 << 20).unwrap();
                let mut data = vec![0u8; h.payload_len as usize];
                std::io::Read::read_exact(&mut t, &mut data).unwrap();
                t.write_all(&h.reply(Status::Ok, 0).to_bytes()).unwrap();
            }
            t.flush().unwrap();
            let _ = std::io::copy(&mut t, &mut std::io::sink());
        });
        fill_a_socket_nobody_reads(&mut q, DEPTH);
        go_tx.send(()).unwrap();
        let mut answered = 0;
        loop {
            answered += q.poll(|c| assert_eq!(c.status, Status::Ok)).unwrap();
            if answered == usize::from(DEPTH) {
                break;
            }
            let wait = q.deadline().expect("writes in flight");
            let _ = crate::deadline::poll_until(q.fd(), libc::POLLIN, wait, opts.timeout);
        }
        assert_eq!(q.tx_sent, q.tx.len(), "everything went");
    }

    /// A TLS target that goes away without close_notify (it stopped, or closed the session)
    /// ends the stream as a plain one would: `Error::Closed`, not an I/O error.
    #[test]
    fn a_tls_target_closing_without_close_notify_is_closed() {
        let (mut q, opts) = tls_queue(8, 64 << 10, Duration::from_secs(10), |mut t| {
            let mut hb = [0u8; HEADER_LEN];
            std::io::Read::read_exact(&mut t, &mut hb).unwrap();
            // Dropped: the socket closes with no close_notify sent.
        });
        q.submit(
            Cmd::Read {
                offset: 0,
                len: 512,
            },
            1,
        )
        .unwrap();
        let r = loop {
            match q.poll(|_| panic!("nothing was answered")) {
                Ok(_) => {
                    let wait = q.deadline().expect("a READ in flight");
                    let _ = crate::deadline::poll_until(q.fd(), libc::POLLIN, wait, opts.timeout);
                }
                Err(e) => break e,
            }
        };
        assert!(matches!(r, Error::Closed), "{r:?}");
    }

    /// Replies to READs that come faster than `poll` takes them over TLS: a `poll` stopped at
    /// its budget may leave whole records in the session (read ahead), which the socket no
    /// longer shows. A caller that waits on the socket until `deadline`, as the map daemons
    /// do, must still get every reply without waiting out a timeout.
    #[test]
    fn replies_a_tls_session_holds_past_polls_budget_are_not_left_waiting() {
        // READs whose replies pass what one `poll` takes (the receive buffer: 64 KiB I/Os
        // granted, a header, 256 KiB), each sent in records of its own, the last ones small:
        // the session reads them in with the record before them, and holds them when `poll`
        // stops.
        const N: u64 = 8;
        let lens = [65536, 65536, 65536, 65536, 65536, 100, 100, 100];
        let (written_tx, written) = std::sync::mpsc::channel();
        let (mut q, _) = tls_queue(8, 64 << 10, Duration::from_secs(30), move |mut t| {
            let mut replies = Vec::new();
            for _ in 0..N {
                let mut hb = [0u8; HEADER_LEN];
                std::io::Read::read_exact(&mut t, &mut hb).unwrap();
                let h = Header::decode(&hb, 64 << 20).unwrap();
                let mut r = h.reply(Status::Ok, h.length).to_bytes().to_vec();
                r.extend(std::iter::repeat_n(5u8, h.length as usize));
                replies.push(r);
            }
            // All on the client's socket before it reads any.
            for r in &replies {
                t.write_all(r).unwrap();
            }
            t.flush().unwrap();
            written_tx.send(()).unwrap();
            let _ = std::io::copy(&mut t, &mut std::io::sink());
        });
        for (i, len) in lens.into_iter().enumerate() {
            q.submit(
                Cmd::Read {
                    offset: (i as u64) << 20,
                    len,
                },
                i as u64,
            )
            .unwrap();
        }
        q.send().unwrap();
        written.recv_timeout(Duration::from_secs(10)).unwrap();
        let mut done = 0;
        while done < N {
            let got = q.poll(|c| {
                assert_eq!(c.data.len(), lens[c.user as usize] as usize);
            });
            done += got.unwrap() as u64;
            if done == N {
                break;
            }
            // As a caller does: wait for the socket, at most until `deadline`.
            let wait = q.deadline().map_or(Duration::from_secs(30), |d| {
                d.saturating_duration_since(Instant::now())
            });
            let mut p = libc::pollfd {
                fd: q.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = wait.min(Duration::from_secs(3)).as_millis() as i32;
            // SAFETY: poll on the queue's socket.
            let ready = unsafe { libc::poll(&mut p, 1, ms) };
            assert!(
                ready > 0 || ms < 3000,
                "{done} of {N} replies taken, the rest held where the socket does not show them"
            );
        }
    }

    /// A session with a target that answers nothing asked and sends replies to nothing as
    /// fast as it can (for 10 s, so that a queue that waits for the flood to end fails its
    /// test rather than hangs), with one 4 KiB READ in flight; and when it was made.
    fn flooded(timeout: Duration) -> (crate::Session, Instant) {
        let url = testing::native(granted(1, 8, 1 << 20, 1 << 20), |mut s| {
            let b = flood(1 << 14);
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                if s.write_all(&b).is_err() {
                    return;
                }
            }
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let mut s = crate::connect(&url, &options(timeout)).unwrap();
        let read = Cmd::Read {
            offset: 0,
            len: 4096,
        };
        s.queues[0].submit(read, 1).unwrap();
        (s, Instant::now())
    }

    /// `r` is the unanswered READ's timeout, reached well before the flood (10 s) ends.
    fn timed_out_soon(r: Result<usize>, start: Instant) {
        assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    /// `poll` sends what the socket takes and returns: a target that stops reading must not
    /// hold the caller, which then takes no reply and times nothing out (it blocked up to the
    /// timeout). `deadline` asks to be called back soon while bytes wait, and the rest goes
    /// once the target reads again.
    #[test]
    fn poll_does_not_wait_for_a_target_that_stops_reading() {
        const DEPTH: u16 = 64;
        let mut opts = options(Duration::from_secs(20));
        opts.depth = DEPTH;
        let (mut q, mut target) = queue_on_loopback(&opts);
        fill_a_socket_nobody_reads(&mut q, DEPTH);
        let soon = Instant::now() + Duration::from_secs(1);
        assert!(
            q.deadline().is_some_and(|d| d < soon),
            "no call back while bytes wait"
        );
        // The target reads again and answers every write.
        let answering = std::thread::spawn(move || {
            use std::io::Read;
            for _ in 0..DEPTH {
                let mut hb = [0u8; HEADER_LEN];
                target.read_exact(&mut hb).unwrap();
                let h = Header::decode(&hb, 1 << 20).unwrap();
                std::io::copy(
                    &mut (&mut target).take(u64::from(h.payload_len)),
                    &mut std::io::sink(),
                )
                .unwrap();
                target
                    .write_all(&h.reply(Status::Ok, 0).to_bytes())
                    .unwrap();
            }
            target
        });
        let mut answered = 0;
        loop {
            answered += q.poll(|c| assert_eq!(c.status, Status::Ok)).unwrap();
            if answered == usize::from(DEPTH) {
                break;
            }
            let wait = q.deadline().expect("writes in flight");
            let _ = crate::deadline::poll_until(q.fd(), libc::POLLIN, wait, opts.timeout);
        }
        assert_eq!(q.tx_sent, q.tx.len(), "everything went");
        drop(answering.join().unwrap());
    }

    /// `complete` times out while replies to nothing keep coming: they are no answer. A flood
    /// that outpaces the reader need not (a reader that catches up sees the timeout all the
    /// same), so here the timeout is zero and replies to nothing are already waiting when
    /// `complete` is called: it looks at its deadline before it reads, and takes none of them.
    /// A `complete` that looked only once the socket was empty reads them all first.
    #[test]
    fn a_flood_of_replies_to_nothing_does_not_hold_complete_past_its_timeout() {
        let (mut q, mut target) = queue_on_loopback(&options(Duration::ZERO));
        target.write_all(&flood(64)).unwrap();
        let soon = Instant::now() + Duration::from_secs(10);
        crate::deadline::poll_until(q.fd(), libc::POLLIN, soon, Duration::from_secs(10)).unwrap();
        let read = Cmd::Read {
            offset: 0,
            len: 4096,
        };
        q.submit(read, 1).unwrap();
        let r = q.complete(1, |_| panic!("nothing was answered"));
        assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
        assert_eq!(q.stats().frames_in, 0, "replies read past the deadline");
    }

    /// `poll` takes about a receive buffer's worth each call, not all that keeps coming, and
    /// reports the timeout of the READ nobody answers.
    #[test]
    fn a_flood_of_replies_to_nothing_does_not_hold_poll() {
        let (mut s, start) = flooded(Duration::from_millis(300));
        let q = &mut s.queues[0];
        // The receive buffer is 1.25 MiB; the read that passes one buffer's worth is the last.
        let most = 3 << 20;
        let r = loop {
            let before = q.stats().frames_in;
            let r = q.poll(|_| panic!("nothing was answered"));
            let took = (q.stats().frames_in - before) as usize * HEADER_LEN;
            assert!(took <= most, "one poll took {took} bytes");
            if r.is_err() {
                break r;
            }
        };
        timed_out_soon(r, start);
    }

    /// A completion's length is the request's, whatever length the reply's header names
    /// (only a COPY's reply says something with it).
    #[test]
    fn a_completion_carries_the_requests_length() {
        let url = testing::native(granted(1, 8, 1 << 20, 1 << 20), |mut s| {
            while let Some((h, _)) = testing::read_frame(&mut s) {
                let mut r = h.reply(Status::Ok, h.length);
                r.length = 1 << 20;
                let mut out = r.to_bytes().to_vec();
                out.resize(HEADER_LEN + h.length as usize, 0x5a);
                if s.write_all(&out).is_err() {
                    return;
                }
            }
        });
        let mut s = crate::connect(&url, &options(Duration::from_secs(10))).unwrap();
        let q = &mut s.queues[0];
        let read = Cmd::Read {
            offset: 0,
            len: 4096,
        };
        q.submit(read, 1).unwrap();
        let mut got = None;
        q.complete(1, |c| got = Some((c.status, c.length, c.data.len())))
            .unwrap();
        assert_eq!(got, Some((Status::Ok, 4096, 4096)));
    }

    /// A target that reads nothing and sends replies to nothing while we send: the receive
    /// buffer holds what could be answers (`depth` replies of max I/O), then the send fails.
    #[test]
    fn replies_to_nothing_while_we_send_cannot_grow_the_receive_buffer() {
        let url = testing::native(granted(1, 8, 1 << 20, 1 << 20), |mut s| {
            // A small receive buffer, as the initiator's send buffer below: the 8 MiB sent
            // cannot fit in the two, however the host tunes its TCP buffers (a buffer set
            // explicitly is not autotuned).
            blkwire_net::setopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, 64 << 10);
            let b = flood(1 << 16);
            for _ in 0..64 {
                if s.write_all(&b).is_err() {
                    return;
                }
            }
            // Only then is what was sent read (192 MiB of replies held meanwhile would be
            // accepted), until the initiator hangs up.
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        });
        let mut s = crate::connect(&url, &options(Duration::from_secs(5))).unwrap();
        let q: &mut Queue = &mut s.queues[0];
        blkwire_net::setopt(q.fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 64 << 10);
        let data = vec![1u8; 1 << 20];
        for i in 0..8 {
            let w = Cmd::Write {
                offset: 0,
                data: &data,
                fua: false,
            };
            q.submit(w, i).unwrap();
        }
        let r = q.send();
        assert!(
            matches!(&r, Err(Error::Protocol(m)) if m.contains("more reply data")),
            "{r:?}"
        );
    }
}
