//! A queue: `depth` slots owned by one thread (PROTOCOL.md §6), over whichever transport the
//! session uses. The pipelined API (`submit`, `send`, `complete`) is the transport's; the blocking
//! helpers (`read_at`, `write_at`, ...) are written once on top of it.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use blkwire_block::{BlockOp, BlockRequest, CopyRange, IoFlags};
use blkwire_wire::{CopyDescriptor, CopyLimits, Flags, Opcode, QueueRef, Status};

use crate::dgram::DgramQueue;
use crate::stream::StreamQueue;
use crate::{Error, Result};

/// A command to submit. Offsets and lengths in bytes.
#[derive(Clone, Copy, Debug)]
pub enum Cmd<'a> {
    /// Read `len` bytes at `offset`.
    Read {
        /// Byte offset in the export.
        offset: u64,
        /// Bytes to read.
        len: u32,
    },
    /// Write `data` at `offset`.
    Write {
        /// Byte offset in the export.
        offset: u64,
        /// The bytes to write (copied at submit on datagram queues, kept for retransmission).
        data: &'a [u8],
        /// Durable before it completes (PROTOCOL.md §10).
        fua: bool,
    },
    /// Make every completed write durable (PROTOCOL.md §10).
    Flush,
    /// Discard a range (advisory).
    Trim {
        /// Byte offset in the export.
        offset: u64,
        /// Bytes to discard.
        len: u32,
    },
    /// Make a range read back as zeros.
    WriteZeroes {
        /// Byte offset in the export.
        offset: u64,
        /// Bytes to zero.
        len: u32,
        /// Allocate rather than punch a hole.
        no_hole: bool,
    },
    /// Copy inside the target (PROTOCOL.md §13): `len` bytes to `dst`, from the source ranges
    /// of `descriptor` (an encoded [`CopyDescriptor`]; their lengths must add up to `len`).
    /// The completion's `length` is the bytes copied. [`Queue::copy`] builds and splits these.
    Copy {
        /// Destination offset in the session's export.
        dst: u64,
        /// Bytes copied in all.
        len: u32,
        /// The encoded descriptor.
        descriptor: &'a [u8],
    },
    /// Ask the target to answer at once (proves it alive).
    Keepalive,
}

/// A command taken apart into the fields every transport puts in its frame header.
pub(crate) struct Parts<'a> {
    pub opcode: Opcode,
    pub offset: u64,
    pub len: u32,
    pub flags: u16,
    /// WRITE data; empty otherwise.
    pub payload: &'a [u8],
}

impl<'a> Cmd<'a> {
    /// The command for a block request; `data` is a WRITE's payload (`req.len` bytes of it are
    /// sent) and ignored for the others.
    pub fn from_request(req: &BlockRequest, data: &'a [u8]) -> Cmd<'a> {
        let (offset, len) = (req.offset, req.len);
        match req.op {
            BlockOp::Read => Cmd::Read { offset, len },
            BlockOp::Write => Cmd::Write {
                offset,
                data: &data[..(len as usize).min(data.len())],
                fua: req.flags.has(IoFlags::FUA),
            },
            BlockOp::Flush => Cmd::Flush,
            BlockOp::Trim => Cmd::Trim { offset, len },
            BlockOp::WriteZeroes => Cmd::WriteZeroes {
                offset,
                len,
                no_hole: req.flags.has(IoFlags::NO_HOLE),
            },
        }
    }

    /// The block request this command is; `None` for KEEPALIVE. Fails for a WRITE of more than
    /// 4 GiB.
    pub fn request(&self) -> Result<Option<BlockRequest>> {
        let r = |op, offset, len| Some(BlockRequest::new(op, offset, len));
        Ok(match *self {
            Cmd::Read { offset, len } => r(BlockOp::Read, offset, len),
            Cmd::Write { offset, data, fua } => {
                let len = u32::try_from(data.len())
                    .map_err(|_| Error::Usage("write too large".into()))?;
                r(BlockOp::Write, offset, len)
                    .map(|q| q.flagged(IoFlags::empty().with(IoFlags::FUA, fua)))
            }
            Cmd::Flush => r(BlockOp::Flush, 0, 0),
            Cmd::Trim { offset, len } => r(BlockOp::Trim, offset, len),
            Cmd::WriteZeroes {
                offset,
                len,
                no_hole,
            } => r(BlockOp::WriteZeroes, offset, len)
                .map(|q| q.flagged(IoFlags::empty().with(IoFlags::NO_HOLE, no_hole))),
            Cmd::Keepalive | Cmd::Copy { .. } => None,
        })
    }

    /// Checks the command against the session's max I/O and returns its header fields.
    pub(crate) fn parts(self, max_io: u32) -> Result<Parts<'a>> {
        if let Cmd::Copy {
            dst,
            len,
            descriptor,
        } = self
        {
            return Ok(Parts {
                opcode: Opcode::Copy,
                offset: dst,
                len,
                flags: 0,
                payload: descriptor,
            });
        }
        let payload: &[u8] = match self {
            Cmd::Write { data, .. } => data,
            _ => &[],
        };
        let Some(req) = self.request()? else {
            return Ok(Parts {
                opcode: Opcode::Keepalive,
                offset: 0,
                len: 0,
                flags: 0,
                payload,
            });
        };
        if req.op.moves_data() && (req.len == 0 || req.len > max_io) {
            return Err(Error::Usage(format!(
                "I/O of {} bytes outside 1..={max_io} (split larger requests)",
                req.len
            )));
        }
        Ok(Parts {
            opcode: Opcode::for_block(req.op),
            offset: req.offset,
            len: req.len,
            flags: Flags::for_io(req.flags),
            payload,
        })
    }
}

/// A finished command: the caller's token, the status and, for reads, the data (borrowed from the
/// receive buffer until the callback returns).
pub struct Completion<'a> {
    /// The token given to `submit`.
    pub user: u64,
    /// The request's length; for a COPY the reply's, the bytes copied (PROTOCOL.md §13).
    pub length: u32,
    /// The target's answer (or `Io` for a request given up on).
    pub status: Status,
    /// A successful READ's data; empty otherwise.
    pub data: &'a [u8],
}

/// Client-side counters of one queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Frames sent, retransmissions included.
    pub frames_out: u64,
    /// Frames received, bad ones included.
    pub frames_in: u64,
    /// Replies whose tag matched nothing in flight (late or duplicated), dropped.
    pub late_replies: u64,
    /// Replies with a non-OK status.
    pub errors: u64,
    /// Datagrams: frames sent again after a timeout or a HAVE bitmap.
    pub retransmits: u64,
    /// Datagrams: frames dropped for a bad or missing CRC.
    pub crc_errors: u64,
    /// Datagrams of a sealed session: frames dropped because their seal did not open (forged,
    /// corrupted, replayed) or was missing (PROTOCOL.md §12.4).
    pub bad_seals: u64,
    /// Datagrams: fragments received twice, dropped.
    pub duplicates: u64,
    /// Datagrams: requests given up after the give-up time (failed with EIO).
    pub timeouts: u64,
    /// Datagrams: probes sent: KEEPALIVEs asking the target what it received and sent,
    /// when a request was taken for lost or nothing came back for two round trips
    /// (PROTOCOL.md §9.2). Only the frames a probe shows lost are resent (`retransmits`).
    pub probes: u64,
    /// Datagrams: current retransmission timeout, microseconds.
    pub rto_us: u64,
    /// Datagrams: current window of frames in flight.
    pub window: u64,
    /// Datagrams sent and received: fewer than frames when frames share datagrams (§9.6).
    pub datagrams_out: u64,
    /// See `datagrams_out`.
    pub datagrams_in: u64,
    /// Datagrams: READ fragments the kernel received straight into the request's buffer (UDP,
    /// PROTOCOL.md §9.3), with no copy of ours.
    pub fragments_in_place: u64,
    /// UDP: datagrams that left in segmented sends and arrived in coalesced receives (§9.6),
    /// included in the counts above.
    pub segmented_out: u64,
    /// See `segmented_out`.
    pub coalesced_in: u64,
}

/// One queue of a session, owned by one thread.
pub struct Queue {
    inner: Inner,
    /// What one COPY may do (PROTOCOL.md §13), as the target granted.
    copy: CopyLimits,
    /// The most one TRIM or WRITE ZEROES covers (`ExportInfo::max_range`).
    max_range: u32,
    /// Which queue of which session this is, for a reconnection to name (native sessions).
    identity: Option<QueueRef>,
    /// The last batch started (`read_at`, `write_at`, `copy`, ...): its number is in the
    /// `user` of each of its commands (`Batch`), so that completions of an earlier batch that
    /// returned an error with commands still in flight are never taken as this one's.
    batch: u32,
}

/// The commands of one batch: `user` holds the batch's number (24 bits, wrapping) above the
/// command's index (40 bits: no batch has 2^40 commands, which would spill into the number).
#[derive(Clone, Copy)]
struct Batch(u32);

impl Batch {
    const INDEX_BITS: u32 = 40;

    fn user(self, i: usize) -> u64 {
        (u64::from(self.0 & 0xff_ffff) << Self::INDEX_BITS) | i as u64
    }

    /// The index of a completion of this batch; None for an earlier batch's.
    fn index(self, user: u64) -> Option<usize> {
        let mine = user >> Self::INDEX_BITS == u64::from(self.0 & 0xff_ffff);
        mine.then_some((user & ((1 << Self::INDEX_BITS) - 1)) as usize)
    }
}

// Both boxed: a Queue is moved between threads and into vectors; the transports are large.
enum Inner {
    Stream(Box<StreamQueue>),
    Dgram(Box<DgramQueue>),
}

macro_rules! each {
    ($self:expr, $q:ident => $e:expr) => {
        match &mut $self.inner {
            Inner::Stream($q) => $e,
            Inner::Dgram($q) => $e,
        }
    };
}

impl Queue {
    pub(crate) fn stream(q: StreamQueue, copy: CopyLimits, max_range: u32) -> Queue {
        Queue {
            inner: Inner::Stream(Box::new(q)),
            copy,
            max_range,
            identity: None,
            batch: 0,
        }
    }

    pub(crate) fn dgram(q: DgramQueue, copy: CopyLimits, max_range: u32) -> Queue {
        Queue {
            inner: Inner::Dgram(Box::new(q)),
            copy,
            max_range,
            identity: None,
            batch: 0,
        }
    }

    /// How long a batch keeps sending again what the target refused for want of memory
    /// without any part of it completing: what the queue waits for a reply at most.
    fn patience(&self) -> Duration {
        match &self.inner {
            Inner::Stream(q) => q.timeout(),
            Inner::Dgram(q) => q.give_up_after(),
        }
    }

    /// A new batch's number (`Batch`).
    fn next_batch(&mut self) -> Batch {
        self.batch = self.batch.wrapping_add(1);
        Batch(self.batch)
    }

    /// The TCP queue inside, if this is one (for `fuzzing`).
    pub(crate) fn as_stream(&self) -> Option<&StreamQueue> {
        match &self.inner {
            Inner::Stream(q) => Some(q),
            Inner::Dgram(_) => None,
        }
    }

    /// The same queue, known as `r` (a native session's queue).
    pub(crate) fn known_as(mut self, r: QueueRef) -> Queue {
        self.identity = Some(r);
        self
    }

    /// Which queue of which session this is: what a reconnection that takes over from it names
    /// in [`crate::ConnectOptions::replaces`] (PROTOCOL.md §2.6), so the target finishes this
    /// queue's requests before the new session may send any. None on NVMe/TCP.
    pub fn identity(&self) -> Option<QueueRef> {
        self.identity
    }

    /// What one COPY of this session may do; [`CopyLimits::enabled`] is false when the session
    /// has none (a read-only export, a target whose memory budget cannot hold a copy, or limits
    /// too small to use).
    pub fn copy_limits(&self) -> CopyLimits {
        self.copy
    }

    /// Queue index inside the session.
    pub fn index(&self) -> u16 {
        match &self.inner {
            Inner::Stream(q) => q.index(),
            Inner::Dgram(q) => q.index(),
        }
    }
    /// Requests this queue can have in flight.
    pub fn depth(&self) -> usize {
        match &self.inner {
            Inner::Stream(q) => q.depth(),
            Inner::Dgram(q) => q.depth(),
        }
    }
    /// Largest I/O one command may carry, in bytes.
    pub fn max_io(&self) -> u32 {
        match &self.inner {
            Inner::Stream(q) => q.max_io(),
            Inner::Dgram(q) => q.max_io(),
        }
    }
    /// Commands submitted and not yet delivered.
    pub fn in_flight(&self) -> usize {
        match &self.inner {
            Inner::Stream(q) => q.in_flight(),
            Inner::Dgram(q) => q.in_flight(),
        }
    }
    /// This queue's counters.
    pub fn stats(&self) -> QueueStats {
        match &self.inner {
            Inner::Stream(q) => q.stats(),
            Inner::Dgram(q) => q.stats(),
        }
    }

    /// Queues a command for sending (nothing is sent until [`Queue::send`] or a wait). `user` comes
    /// back in its completion. Fails only when every slot is busy or the command is malformed.
    pub fn submit(&mut self, cmd: Cmd<'_>, user: u64) -> Result<()> {
        each!(self, q => q.submit(cmd, user))
    }

    /// Sends everything queued (as far as flow control allows, on datagrams).
    pub fn send(&mut self) -> Result<()> {
        each!(self, q => q.send())
    }

    /// Sends what is queued, then delivers completions to `f` until at least `min` have been
    /// delivered (0: only those already received). Returns how many were delivered.
    pub fn complete(&mut self, min: usize, f: impl FnMut(Completion<'_>)) -> Result<usize> {
        each!(self, q => q.complete(min, f))
    }

    /// The socket to wait on for readability (poll(2), epoll or an io_uring POLL_ADD) before
    /// calling [`Queue::poll`]. It changes only with the `Queue`: a reconnection is a new one.
    pub fn fd(&self) -> RawFd {
        match &self.inner {
            Inner::Stream(q) => q.fd(),
            Inner::Dgram(q) => q.fd(),
        }
    }

    /// Progress without waiting, for callers that wait on [`Queue::fd`] and other descriptors
    /// in one place: sends what is queued, takes every reply that has arrived, runs the
    /// datagram timers (retransmission, tail-loss probe, give-up) and the keepalive of an idle
    /// datagram queue, and delivers completions to `f`. Returns how many were delivered.
    /// Errors are those of [`Queue::complete`]: `Error::SessionLost` when the target has
    /// forgotten a datagram session (an idle one learns it from its keepalive), and on TCP
    /// `Error::Timeout` once requests have waited the timeout without any reply. On TCP what the
    /// socket does not take waits in the queue ([`Queue::deadline`] is then 1 ms away); over
    /// TLS the send may wait while the socket buffer is full (reading replies meanwhile).
    pub fn poll(&mut self, f: impl FnMut(Completion<'_>)) -> Result<usize> {
        each!(self, q => q.poll(f))
    }

    /// When [`Queue::poll`] must run even if [`Queue::fd`] stays quiet: the next datagram timer
    /// or keepalive, or on TCP the timeout of requests in flight, 1 ms away while queued
    /// bytes wait for room in the socket, and now when a TLS session may hold replies the last
    /// `poll` left (it stopped at its budget). `None`: only when the fd turns readable (TCP
    /// with nothing in flight).
    pub fn deadline(&self) -> Option<Instant> {
        match &self.inner {
            Inner::Stream(q) => q.deadline(),
            Inner::Dgram(q) => q.deadline(),
        }
    }

    /// Runs a batch of commands of at most `max_io` each, keeping the pipeline full, and returns
    /// the first error. `each(i)` yields command `i`; `done(i, data)` receives read data. An
    /// error of the transport returns at once, commands still in flight: their completions,
    /// if any come, are told apart from a later batch's by the batch number in `user`. A part
    /// the target refused for want of memory (`NO_MEMORY`: it ran nothing, PROTOCOL.md §5) is
    /// sent again after a pause, as the map daemons do, until the batch has gone
    /// [`Queue::patience`] without a part completing.
    fn run_batch<'a>(
        &mut self,
        count: usize,
        mut each: impl FnMut(usize) -> Cmd<'a>,
        mut done: impl FnMut(usize, &[u8]),
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        // Parts sent for the first time so far, and parts of this batch now in flight
        // (in_flight() may count an earlier batch's, not waited for).
        let mut next = 0;
        let mut sent = 0;
        let mut finished = 0;
        let mut failed: Option<(usize, Status)> = None;
        // A part refused as it is sent (NVMe alignment, say) stops the batch, but only once
        // the parts in flight have completed: returned earlier, their completions would be
        // taken by the caller's next batch as its own (the same user numbers).
        let mut refused: Option<Error> = None;
        // Parts refused for want of memory, to send again at `again_at`; then, due, they wait
        // in `resend` for slots, while newer refusals wait for a pause of their own.
        let mut again: Vec<usize> = Vec::new();
        let mut again_at: Option<Instant> = None;
        let mut resend: Vec<usize> = Vec::new();
        let mut pause = RETRY_FIRST;
        let patience = self.patience();
        let mut progress = Instant::now();
        let batch = self.next_batch();
        loop {
            let stopping = failed.is_some() || refused.is_some();
            if finished == count || (stopping && sent == 0) {
                break;
            }
            if again_at.is_some_and(|t| Instant::now() >= t) {
                // A round of parts sent again: the next refusal waits longer.
                resend.append(&mut again);
                again_at = None;
                pause = (pause * 2).min(RETRY_MOST);
            }
            while !stopping && refused.is_none() && self.in_flight() < self.depth() {
                let i = if let Some(i) = resend.pop() {
                    i
                } else if next < count {
                    next += 1;
                    next - 1
                } else {
                    break;
                };
                match self.submit(each(i), batch.user(i)) {
                    Ok(()) => sent += 1,
                    Err(e) => refused = Some(e),
                }
            }
            if sent == 0 {
                let waiting = !again.is_empty() || !resend.is_empty();
                if failed.is_some() || refused.is_some() || (!waiting && next == count) {
                    break;
                }
                if self.in_flight() < self.depth() || self.in_flight() == 0 {
                    // Nothing of this batch in flight: what is left waits for `again_at`.
                    let Some(t) = again_at else { break };
                    std::thread::sleep(t.saturating_duration_since(Instant::now()));
                    continue;
                }
                // Every slot holds an earlier batch's command: its completion frees one.
            }
            self.complete(1, |c| {
                let Some(i) = batch.index(c.user) else {
                    return; // an earlier batch's
                };
                sent -= 1;
                // When it came, not when the wait began: the wait may have been long.
                let now = Instant::now();
                match c.status {
                    Status::NoMemory
                        if failed.is_none() && now.duration_since(progress) < patience =>
                    {
                        again.push(i);
                        again_at.get_or_insert(now + pause);
                        return;
                    }
                    Status::Ok => {
                        progress = now;
                        pause = RETRY_FIRST;
                        done(i, c.data);
                    }
                    s => {
                        failed.get_or_insert((i, s));
                    }
                }
                finished += 1;
            })?;
        }
        if let Some(e) = refused {
            return Err(e);
        }
        match failed {
            Some((_, status)) => Err(Error::Status {
                what: what(),
                status,
            }),
            None if finished < count => Err(no_slot(what())),
            None => Ok(()),
        }
    }

    /// Reads `buf.len()` bytes at `offset`, split into pipelined requests of `max_io`.
    pub fn read_at(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let chunk = self.max_io() as usize;
        let n = buf.len().div_ceil(chunk);
        let total = buf.len();
        let len_of = move |i: usize| (total - i * chunk).min(chunk);
        self.run_batch(
            n,
            |i| Cmd::Read {
                offset: offset + (i * chunk) as u64,
                len: len_of(i) as u32,
            },
            |i, data| buf[i * chunk..i * chunk + data.len()].copy_from_slice(data),
            || format!("read {total} bytes at {offset}"),
        )
    }

    /// Writes `data` at `offset`, split into pipelined requests of `max_io`.
    pub fn write_at(&mut self, data: &[u8], offset: u64, fua: bool) -> Result<()> {
        let chunk = self.max_io() as usize;
        let n = data.len().div_ceil(chunk);
        self.run_batch(
            n,
            |i| Cmd::Write {
                offset: offset + (i * chunk) as u64,
                data: &data[i * chunk..((i + 1) * chunk).min(data.len())],
                fua,
            },
            |_, _| {},
            || format!("write {} bytes at {offset}", data.len()),
        )
    }

    /// Makes every write this session completed durable (PROTOCOL.md §10).
    pub fn flush(&mut self) -> Result<()> {
        self.run_batch(1, |_| Cmd::Flush, |_, _| {}, || "flush".into())
    }

    /// Discards `len` bytes at `offset` (split at `max_io`) and waits for every part.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        self.ranged(offset, len, "trim", |offset, len| Cmd::Trim { offset, len })
    }

    /// Zeroes `len` bytes at `offset` (split at `ExportInfo::max_range`) and waits for every
    /// part.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, no_hole: bool) -> Result<()> {
        self.ranged(offset, len, "write zeroes", |offset, len| {
            Cmd::WriteZeroes {
                offset,
                len,
                no_hole,
            }
        })
    }

    /// Range commands are split at `max_range`: a native one's 32-bit length, an NVMe WRITE
    /// ZEROES' 16-bit block count.
    fn ranged(
        &mut self,
        offset: u64,
        len: u64,
        what: &str,
        mk: impl Fn(u64, u32) -> Cmd<'static>,
    ) -> Result<()> {
        let step = u64::from(self.max_range.max(1));
        let n = len.div_ceil(step) as usize;
        self.run_batch(
            n,
            |i| {
                let o = i as u64 * step;
                mk(offset + o, (len - o).min(step) as u32)
            },
            |_, _| {},
            || format!("{what} {len} bytes at {offset}"),
        )
    }

    /// Copies `ranges` of the export `source` (another export of the same target this host may
    /// open; "" for this session's own, never its name) to consecutive bytes from `dst` of this session's
    /// export, inside the target: no data crosses the network (PROTOCOL.md §13). Split into
    /// COPY commands within the session's limits of at most [`COPY_COMMAND_MAX`] bytes each,
    /// pipelined. Within one export the ranges may
    /// not overlap the destination (the target refuses such a copy before writing anything).
    /// Fails with [`Error::Copy`] saying how many bytes from `dst` are known copied.
    pub fn copy(&mut self, source: &str, ranges: &[CopyRange], dst: u64) -> Result<()> {
        let limits = self.copy;
        if !limits.enabled() {
            return Err(Error::Usage(
                "this session cannot copy inside the target: the export is read-only, or the \
                 target does not offer COPY (or offers limits too small to use)"
                    .into(),
            ));
        }
        if ranges.iter().any(|r| r.len == 0) {
            return Err(Error::Usage("a copy range is empty".into()));
        }
        // The target checks each COPY against its own destination; split into several, a copy
        // whose sources meet its whole destination would not be refused but come out wrong.
        if let Some((r, end)) = source
            .is_empty()
            .then(|| overlapping_source(ranges, dst))
            .flatten()
        {
            return Err(Error::Usage(format!(
                "copy source {}+{} overlaps the destination {dst}..{end}: within one export \
                 source and destination may not overlap",
                r.offset, r.len
            )));
        }
        // Made as they are sent: a long copy under small limits is many commands.
        let mut commands = copy_commands(source, ranges, dst, limits);
        // Destination and length of each command in flight, by its `user` (this batch's
        // number and its index: an earlier batch's completions match nothing).
        let mut sent: HashMap<u64, (u64, u32)> = HashMap::new();
        let batch = self.next_batch();
        // The first command that failed: its index, status and the bytes known copied.
        let mut failed: Option<(u64, Status, u64)> = None;
        let mut next = 0u64;
        let mut more = true;
        // Until every command sent is answered and none is left to send (or one failed):
        // in_flight() may count an earlier batch's, not waited for.
        while (more && failed.is_none()) || !sent.is_empty() {
            while more && self.in_flight() < self.depth() && failed.is_none() {
                let Some(c) = commands.next() else {
                    more = false;
                    break;
                };
                let (cmd_dst, len, d) = c?;
                let cmd = Cmd::Copy {
                    dst: cmd_dst,
                    len,
                    descriptor: &d,
                };
                let user = batch.user(next as usize);
                self.submit(cmd, user)?;
                sent.insert(user, (cmd_dst, len));
                next += 1;
            }
            if self.in_flight() == 0 {
                break;
            }
            self.complete(1, |c| {
                let Some((cmd_dst, len)) = sent.remove(&c.user) else {
                    return;
                };
                // On OK the length is the request's (PROTOCOL.md §13): a target saying OK to
                // a part copied has not copied the rest, whatever its status.
                let whole = c.status == Status::Ok && c.length == len;
                if !whole && failed.is_none_or(|(j, _, _)| c.user < j) {
                    let status = match c.status {
                        Status::Ok => Status::Io,
                        s => s,
                    };
                    let copied = cmd_dst - dst + c.length.min(len) as u64;
                    failed = Some((c.user, status, copied));
                }
            })?;
        }
        match failed {
            None if more => Err(no_slot("copy".into())),
            None => Ok(()),
            Some((_, status, copied)) => Err(Error::Copy { status, copied }),
        }
    }

    /// Round trip that proves the target is alive.
    pub fn keepalive(&mut self) -> Result<()> {
        self.run_batch(1, |_| Cmd::Keepalive, |_, _| {}, || "keepalive".into())
    }

    /// Test hook: sends `frame` as it is on a datagram queue (to replay stale or forged frames).
    #[doc(hidden)]
    pub fn send_raw_frame(&mut self, frame: &[u8]) -> Result<()> {
        match &mut self.inner {
            Inner::Dgram(q) => q.send_raw(frame),
            Inner::Stream(_) => Err(Error::Usage("raw frames are for datagram queues".into())),
        }
    }

    /// The session id this queue belongs to, for building raw frames in tests.
    #[doc(hidden)]
    pub fn session_id(&self) -> Option<u32> {
        match &self.inner {
            Inner::Dgram(q) => Some(q.session()),
            Inner::Stream(_) => None,
        }
    }

    /// Ends the queue cleanly after everything in flight (PROTOCOL.md §2.5).
    pub fn logout(mut self) -> Result<()> {
        each!(self, q => q.logout())
    }
}

/// A batch that could not be sent at all: the queue has no slot (a session never grants
/// that, so this stays an error rather than a batch reported done without any I/O).
fn no_slot(what: String) -> Error {
    Error::Protocol(format!("{what}: the queue has no slot to send it on"))
}

/// For a copy within one export of `ranges` to consecutive bytes from `dst`: the first range
/// that overlaps the whole destination, and where the destination ends. Such a copy is not
/// defined (PROTOCOL.md §13): the target refuses it, and [`Queue::copy`] before sending it.
pub fn overlapping_source(ranges: &[CopyRange], dst: u64) -> Option<(CopyRange, u64)> {
    let end = dst.saturating_add(ranges.iter().map(|r| r.len as u64).sum());
    ranges
        .iter()
        .find(|r| r.offset < end && dst < r.offset.saturating_add(r.len as u64))
        .map(|r| (*r, end))
}

/// Most bytes [`Queue::copy`] asks of one COPY: a command's time is bounded (the I/O timeout
/// applies to it like to any request) whatever the target would take.
pub const COPY_COMMAND_MAX: u32 = 64 << 20;

/// The first pause before a part refused for want of memory is sent again (`run_batch`), and
/// the longest it grows to while refusals go on.
const RETRY_FIRST: Duration = Duration::from_millis(10);
const RETRY_MOST: Duration = Duration::from_millis(200);

/// Splits a copy into COPY commands within `limits` (and [`COPY_COMMAND_MAX`]), made one at a
/// time as they are asked for: `(destination, length, descriptor)` each.
fn copy_commands<'a>(
    source: &'a str,
    ranges: &'a [CopyRange],
    dst: u64,
    limits: CopyLimits,
) -> CopyCommands<'a> {
    let max_bytes = limits.max_bytes.min(COPY_COMMAND_MAX);
    CopyCommands {
        source,
        ranges,
        max_bytes,
        max_range: limits.max_range.min(max_bytes),
        max_ranges: limits.max_ranges as usize,
        range: 0,
        taken: 0,
        at: dst,
    }
}

/// The COPY commands of a copy, in order (see [`copy_commands`]).
struct CopyCommands<'a> {
    source: &'a str,
    ranges: &'a [CopyRange],
    max_bytes: u32,
    max_range: u32,
    max_ranges: usize,
    /// The source range the next command starts in, and its bytes already in commands.
    range: usize,
    taken: u64,
    /// Where the next command's bytes go.
    at: u64,
}

impl Iterator for CopyCommands<'_> {
    type Item = Result<(u64, u32, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.at;
        let mut cur: Vec<CopyRange> = Vec::new();
        let mut total = 0u32;
        while self.range < self.ranges.len()
            && cur.len() < self.max_ranges
            && total < self.max_bytes
        {
            let r = self.ranges[self.range];
            let len = (r.len as u64 - self.taken)
                .min(self.max_range as u64)
                .min((self.max_bytes - total) as u64) as u32;
            if len > 0 {
                cur.push(CopyRange {
                    offset: r.offset + self.taken,
                    len,
                });
            }
            self.taken += len as u64;
            self.at += len as u64;
            total += len;
            if self.taken == r.len as u64 {
                self.range += 1;
                self.taken = 0;
            }
        }
        if cur.is_empty() {
            return None;
        }
        let d = CopyDescriptor {
            source: self.source.to_string(),
            ranges: cur,
        }
        .encode()
        .map_err(|e| Error::Usage(format!("copy: {e}")));
        Some(d.map(|d| (start, total, d)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, granted};
    use crate::{ConnectOptions, HelloReply};
    use std::io::Write;

    /// A target that grants `copy` and refuses every request after the HELLO (`Io`): a
    /// request sent that should not have been fails rather than waits.
    fn refusing(copy: CopyLimits) -> crate::Url {
        let reply = HelloReply {
            copy,
            ..granted(1, 8, 1 << 20, 1 << 20)
        };
        testing::native(reply, move |mut s| {
            while let Some((h, _)) = testing::read_frame(&mut s) {
                if s.write_all(&h.reply(Status::Io, 0).to_bytes()).is_err() {
                    return;
                }
            }
        })
    }

    /// A batch that returned an error with a command in flight (a timeout) leaves that
    /// command's completion to come: the next batch on the queue must not take it for its own
    /// (the read returned the bytes of the earlier read, at another offset, as its data).
    #[test]
    fn a_late_completion_of_a_failed_batch_is_not_taken_by_the_next() {
        let url = testing::native(granted(1, 8, 1 << 20, 1 << 20), |mut s| {
            let Some((first, _)) = testing::read_frame(&mut s) else {
                return;
            };
            // The second read comes once the first has timed out: then both are answered.
            let Some((second, _)) = testing::read_frame(&mut s) else {
                return;
            };
            for (h, byte) in [(first, 0xaa), (second, 0xbb)] {
                let mut out = h.reply(Status::Ok, h.length).to_bytes().to_vec();
                out.extend(std::iter::repeat_n(byte, h.length as usize));
                if s.write_all(&out).is_err() {
                    return;
                }
            }
            let _ = testing::read_frame(&mut s); // until the initiator goes
        });
        let opts = ConnectOptions {
            timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        };
        let mut s = crate::connect(&url, &opts).unwrap();
        let q = &mut s.queues[0];
        let mut buf = vec![0u8; 4096];
        let r = q.read_at(&mut buf, 0);
        assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
        q.read_at(&mut buf, 8192).unwrap();
        assert!(
            buf.iter().all(|b| *b == 0xbb),
            "the read at 8192 returned the bytes of the one at 0 ({:#x})",
            buf[0]
        );
    }

    /// A part the target refused for want of memory (it ran nothing) is sent again and the
    /// batch succeeds; every part is written once, none reported done unwritten. A target
    /// that refuses for ever fails the batch with NO_MEMORY once the queue's timeout has
    /// passed without a part completing.
    #[test]
    fn parts_refused_for_want_of_memory_are_sent_again() {
        let (tx, rx) = std::sync::mpsc::channel();
        let url = testing::native(granted(1, 4, 4096, 4096), move |mut s| {
            let mut refused = std::collections::HashSet::new();
            while let Some((h, _)) = testing::read_frame(&mut s) {
                let status = if refused.insert(h.offset) {
                    Status::NoMemory
                } else {
                    Status::Ok
                };
                let _ = tx.send((h.offset, status));
                if s.write_all(&h.reply(status, 0).to_bytes()).is_err() {
                    return;
                }
            }
        });
        let mut s = crate::connect(&url, &ConnectOptions::default()).unwrap();
        s.queues[0].write_at(&[7u8; 4 * 4096], 0, false).unwrap();
        drop(s);
        let mut seen: Vec<(u64, Status)> = rx.iter().collect();
        seen.sort_by_key(|&(o, st)| (o, st == Status::Ok));
        let want: Vec<(u64, Status)> = (0..4u64)
            .flat_map(|i| [(i * 4096, Status::NoMemory), (i * 4096, Status::Ok)])
            .collect();
        assert_eq!(seen, want);

        let url = testing::native(granted(1, 4, 4096, 4096), |mut s| {
            while let Some((h, _)) = testing::read_frame(&mut s) {
                if s.write_all(&h.reply(Status::NoMemory, 0).to_bytes())
                    .is_err()
                {
                    return;
                }
            }
        });
        let opts = ConnectOptions {
            timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        };
        let mut s = crate::connect(&url, &opts).unwrap();
        let r = s.queues[0].write_at(&[7u8; 2 * 4096], 0, false);
        assert!(
            matches!(
                r,
                Err(Error::Status {
                    status: Status::NoMemory,
                    ..
                })
            ),
            "{r:?}"
        );
        s.queues[0].flush().expect_err("refused as well");
    }

    /// A batch after one that failed with a command in flight ends with its own commands: it
    /// does not wait for the earlier one's (a copy that had done all it was asked returned the
    /// timeout of the earlier read's command, which never came).
    #[test]
    fn a_batch_ends_with_its_own_commands() {
        let copy = CopyLimits {
            max_bytes: 1 << 20,
            max_range: 1 << 20,
            max_ranges: 8,
        };
        let reply = HelloReply {
            copy,
            ..granted(1, 8, 1 << 20, 1 << 20)
        };
        let url = testing::native(reply, |mut s| {
            // The first request (a READ) is never answered; every later one is.
            if testing::read_frame(&mut s).is_none() {
                return;
            }
            while let Some((h, _)) = testing::read_frame(&mut s) {
                if s.write_all(&h.reply(Status::Ok, 0).to_bytes()).is_err() {
                    return;
                }
            }
        });
        let opts = ConnectOptions {
            timeout: std::time::Duration::from_millis(300),
            ..Default::default()
        };
        let mut s = crate::connect(&url, &opts).unwrap();
        let q = &mut s.queues[0];
        let mut buf = vec![0u8; 4096];
        assert!(matches!(q.read_at(&mut buf, 0), Err(Error::Timeout(_))));
        let range = CopyRange {
            offset: 0,
            len: 1 << 20,
        };
        q.copy("other", &[range], 4 << 20).unwrap();
        q.flush().unwrap();
    }

    /// A COPY answered OK with fewer bytes than asked did not copy the rest (PROTOCOL.md §13
    /// says OK carries the request's length): the copy fails, saying what is known copied.
    #[test]
    fn a_copy_answered_ok_for_part_of_it_fails_with_what_was_copied() {
        let copy = CopyLimits {
            max_bytes: 64 << 20,
            max_range: 64 << 20,
            max_ranges: 128,
        };
        let reply = HelloReply {
            copy,
            ..granted(1, 8, 1 << 20, 1 << 20)
        };
        let url = testing::native(reply, |mut s| {
            while let Some((h, _)) = testing::read_frame(&mut s) {
                let mut r = h.reply(Status::Ok, 0);
                r.length = h.length / 2;
                if s.write_all(&r.to_bytes()).is_err() {
                    return;
                }
            }
        });
        let mut s = crate::connect(&url, &ConnectOptions::default()).unwrap();
        let range = CopyRange {
            offset: 0,
            len: 1 << 20,
        };
        let r = s.queues[0].copy("other", &[range], 0);
        assert!(
            matches!(
                r,
                Err(Error::Copy {
                    status: Status::Io,
                    copied: 524288
                })
            ),
            "{r:?}"
        );
    }

    /// A queue of no slots (no session grants one) fails what it is given rather than
    /// report it done without sending anything.
    #[test]
    fn a_queue_without_slots_fails_its_batches() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let opts = ConnectOptions::default();
        let mut info = crate::info_from(
            &crate::Url::parse("tcp://127.0.0.1/x").unwrap(),
            &granted(1, 8, 1 << 20, 1 << 20),
        );
        info.depth = 0;
        let q = StreamQueue::new(crate::tls::Link::Plain(s), 0, &info, &opts).unwrap();
        let copy = CopyLimits {
            max_bytes: 1 << 20,
            max_range: 1 << 20,
            max_ranges: 8,
        };
        let mut q = Queue::stream(q, copy, crate::MAX_RANGE);
        assert_eq!(q.depth(), 0);
        let r = q.read_at(&mut [0u8; 4096], 0);
        assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
        let r = q.write_at(&[0u8; 4096], 0, false);
        assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
        let range = CopyRange {
            offset: 0,
            len: 4096,
        };
        let r = q.copy("other", &[range], 0);
        assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    }

    /// COPY limits of a byte each would make a copy one command per byte (built before any
    /// was sent): the session takes them as no COPY.
    #[test]
    fn a_session_granted_copies_of_a_byte_has_no_copy() {
        let tiny = CopyLimits {
            max_bytes: 1,
            max_range: 1,
            max_ranges: 1,
        };
        let url = refusing(tiny);
        let mut s = crate::connect(&url, &ConnectOptions::default()).unwrap();
        assert!(!s.info.copy.enabled());
        let q = &mut s.queues[0];
        assert!(!q.copy_limits().enabled());
        let range = CopyRange {
            offset: 0,
            len: 64 << 10,
        };
        let r = q.copy("other", &[range], 0);
        assert!(matches!(r, Err(Error::Usage(_))), "{r:?}");
    }

    #[test]
    fn copies_are_split_within_the_sessions_limits_and_keep_their_order() {
        let limits = CopyLimits {
            max_bytes: 100,
            max_range: 40,
            max_ranges: 2,
        };
        let ranges = [
            CopyRange {
                offset: 1000,
                len: 90,
            },
            CopyRange {
                offset: 5000,
                len: 30,
            },
        ];
        let cmds: Vec<_> = copy_commands("src", &ranges, 7, limits)
            .collect::<Result<_>>()
            .unwrap();
        let decoded: Vec<(u64, u32, Vec<CopyRange>)> = cmds
            .iter()
            .map(|(d, l, b)| {
                let desc = CopyDescriptor::decode(b, 2).unwrap();
                assert_eq!(desc.source, "src");
                assert_eq!(desc.total(), *l as u64);
                (*d, *l, desc.ranges)
            })
            .collect();
        let r = |offset, len| CopyRange { offset, len };
        assert_eq!(
            decoded,
            vec![
                (7, 80, vec![r(1000, 40), r(1040, 40)]),
                (87, 40, vec![r(1080, 10), r(5000, 30)]),
            ]
        );
    }
}
