//! The one place a block request runs, whatever frontend or transport carried it:
//! validate -> export range and read-only check -> start -> complete -> status, with the
//! queue's counters and latency histograms (timed from start to status). Where the export shows
//! its memory (`mem:`), a READ may instead be answered from it (`read_mapped`) and a datagram
//! WRITE copied into it fragment by fragment (`write_mapped`), each after the same checks
//! (`admit`). The stream reactor (native and NBD over TCP) and the datagram ports (UDP,
//! raw Ethernet) each own one `Executor` per queue; they differ only in how requests arrive and
//! replies leave (docs/ARCHITECTURE.md, "Data path").

use std::os::fd::RawFd;
use std::sync::{Arc, Weak};
use std::time::Instant;

use blkwire_backend::{
    BlockOp, BlockRequest, Export, ExportQueue, Extent, IoFlags, Op, Progress, Refusal, Submitter,
};
use blkwire_wire::{CopyDescriptor, Status};

use crate::session::Registry;

use crate::stats::QueueStats;

/// How far a request got when it was started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome<P = Started> {
    /// Answered already (inline backends, emulated no-ops, refusals).
    Done(Status),
    /// Running: its result comes through [`Executor::complete`] or [`Executor::reap`]; a block
    /// request's [`Started`] goes with it to [`Executor::status`].
    Pending(P),
}

/// When a block request that is still running started: its slot keeps it (no allocation, no
/// map by tag) and hands it to [`Executor::status`], which records the request's latency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Started(Instant);

impl Started {
    /// Now: for requests that start outside [`Executor::start`] (a datagram COPY's slot).
    pub fn now() -> Started {
        Started(Instant::now())
    }
}

/// Smaller READs are read, not sent from the export's memory: a backend that can show its
/// memory (`mem:`) copies them out of it as cheaply, and sending small replies from where they
/// lie cost more than copying them (docs/BENCHMARKS.md, "Datagram READ replies gathered").
pub const MAPPED_READ_MIN: u32 = 64 << 10;

/// One queue's handle on an export: emulation layer, limits and counters.
pub struct Executor {
    export: Arc<Export>,
    io: ExportQueue,
    max_io: u32,
    /// Where a COPY from another export finds it, as the session's host may open it (None:
    /// COPY only within this export).
    sources: Option<(Arc<Registry>, u32)>,
    /// The export's size the queue's session was given: its bound for the queue's life (an
    /// export only grows, so this never passes the end of the storage), kept here so that a
    /// request's checks read no shared state.
    size: u64,
    /// The queue's counters; transports add their own (frames, duplicates) here too.
    pub stats: QueueStats,
    /// Tags of the COPYs running with FUA (a datagram host may run several, on its queues):
    /// the failure of one may be its flush's.
    fua_copies: Vec<u64>,
}

/// A COPY's answer (PROTOCOL.md §13): its status and the bytes from its destination offset
/// known to hold copied data (all of them on `Ok`), which go in the reply's length field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copied {
    /// The reply's status.
    pub status: Status,
    /// The reply's length.
    pub bytes: u32,
}

impl Executor {
    /// Lets go of what the queue keeps of exports removed since (`ExportQueue::drop_gone_sources`).
    pub fn drop_gone_sources(&mut self) {
        self.io.drop_gone_sources();
    }

    /// True while the queue keeps spare source queues of other exports.
    pub fn holds_spare_sources(&self) -> bool {
        self.io.holds_spare_sources()
    }

    /// Opens a queue on `export` that accepts READ/WRITE of at most `max_io` bytes inside the
    /// first `size` bytes (the size its session was given, at most the export's size now).
    pub fn open(export: Arc<Export>, max_io: u32, size: u64) -> std::io::Result<Executor> {
        debug_assert!(
            size <= export.size(),
            "a session is never given more than there is"
        );
        Ok(Executor {
            io: export.open_queue()?,
            export,
            max_io,
            sources: None,
            size,
            stats: QueueStats::default(),
            fua_copies: Vec::new(),
        })
    }

    /// Opens the executor of an admitted queue; when the backend refuses (the error is logged),
    /// the queue leaves the registry and there is nothing to serve.
    pub fn for_queue(
        registry: &Arc<Registry>,
        export: &Arc<Export>,
        (session, queue): (u32, u16),
        max_io: u32,
        size: u64,
    ) -> Option<Executor> {
        match Executor::open(export.clone(), max_io, size) {
            Ok(mut x) => {
                x.sources = Some((registry.clone(), session));
                Some(x)
            }
            Err(e) => {
                crate::log!(
                    crate::log::Level::Error,
                    "export {}: cannot open queue: {e}",
                    export.name
                );
                registry.leave(session, queue, &QueueStats::default());
                None
            }
        }
    }

    /// The export served.
    pub fn export(&self) -> &Arc<Export> {
        &self.export
    }

    /// True when the export completes inline: every READ, WRITE and FLUSH finishes inside
    /// [`Executor::start`], so READ may land straight in the reply buffer and WRITE come
    /// straight from the receive buffer. A long TRIM or WRITE_ZEROES may not (see
    /// [`Executor::finishes_in_start`]).
    pub fn completes_inline(&self) -> bool {
        self.io.completes_inline()
    }

    /// True when `req` finishes inside [`Executor::start`]: on an inline export, all but a
    /// TRIM or WRITE_ZEROES that runs in pieces and gives the thread back between them
    /// ([`blkwire_backend::INLINE_PIECE`]); that one needs a slot and a tag, like a request
    /// on a backend that completes later.
    pub fn finishes_in_start(&self, req: &BlockRequest) -> bool {
        self.io.finishes_in_start(req.op, req.len)
    }

    /// Alignment of buffers handed to [`Executor::start`] (O_DIRECT wants block-aligned memory).
    pub fn buffer_alignment(&self) -> usize {
        self.export.backend().buffer_alignment().max(4096)
    }

    /// For backends that complete on their own threads: the descriptor to watch.
    pub fn notifier(&self) -> Option<RawFd> {
        self.io.notifier()
    }

    /// Checks that `offset..offset+len` lies inside the session's size of the export
    /// (queries: CACHE, BLOCK_STATUS).
    pub fn check_range(&self, offset: u64, len: u32) -> Result<(), Status> {
        self.export
            .check_within(self.size, false, offset, len as u64)
            .map_err(refusal_status)
    }

    /// Every check a request passes before it may start (PROTOCOL.md §3, §5): data length
    /// within max I/O, range inside the session's size of the export, read-only policy,
    /// O_DIRECT alignment, and
    /// NBD's FAST_ZERO (refused unless zeroing is a cheap metadata operation).
    pub fn admit(&self, req: &BlockRequest) -> Result<(), Status> {
        let len = req.len;
        if req.op.moves_data() && (len == 0 || len > self.max_io) {
            return Err(Status::Invalid);
        }
        self.export
            .check_within(self.size, req.op.modifies(), req.offset, len as u64)
            .map_err(refusal_status)?;
        let align = self.export.alignment();
        if req.op.moves_data()
            && (!req.offset.is_multiple_of(align) || !(len as u64).is_multiple_of(align))
        {
            return Err(Status::Invalid);
        }
        // A zeroing off the logical blocks of an O_DIRECT export (a device's sectors, a file's
        // 4 KiB, the block its clients are told) may only be refusable (no BLKZEROOUT takes it,
        // no O_DIRECT write either): refused here, before the generic layer's 64 MiB pieces,
        // where the last piece's refusal came after the others were zeroed. A device's whole
        // sectors, not whole pages, are zeroed as they can be.
        let (sector, _) = self.export.backend().block_sizes();
        if req.op == BlockOp::WriteZeroes
            && align > 1
            && !(req.offset | len as u64).is_multiple_of(u64::from(sector.max(1)))
        {
            return Err(Status::Invalid);
        }
        // FAST_ZERO where the backend cannot promise it; and off the export's blocks, where
        // a device's zeroing refuses the range's edge after the pieces before it were zeroed
        // (a FAST_ZERO refused must leave the export as it was: NBD's proto.md).
        let block = self.export.io_block() as u64;
        if req.op == BlockOp::WriteZeroes
            && req.flags.has(IoFlags::FAST_ZERO)
            && (req.flags.has(IoFlags::NO_HOLE)
                || !self.export.capabilities().fast_zero
                || !(req.offset | len as u64).is_multiple_of(block))
        {
            return Err(Status::Unsupported);
        }
        Ok(())
    }

    /// Counts and starts an admitted request. Ring entries carry `tag` as user data. Its
    /// latency is recorded when it is answered here, or by [`Executor::status`] with the
    /// [`Started`] of [`Outcome::Pending`].
    ///
    /// # Safety
    /// For READ, `buf` must be valid for writes of `req.len` bytes, and for WRITE for reads of
    /// `req.len` bytes, until the request's result is delivered (returned here, by `complete`
    /// or by `reap`); nobody else may touch a READ buffer meanwhile. Other requests ignore it.
    pub unsafe fn start(
        &mut self,
        req: &BlockRequest,
        buf: *mut u8,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Outcome {
        // One clock read (vDSO, no syscall) here and one at the status.
        let started = Started(Instant::now());
        let s = &mut self.stats;
        match req.op {
            BlockOp::Read => s.reads += 1,
            BlockOp::Write => {
                s.writes += 1;
                s.bytes_written += req.len as u64;
            }
            BlockOp::Flush => s.flushes += 1,
            BlockOp::Trim => s.trims += 1,
            BlockOp::WriteZeroes => s.write_zeroes += 1,
        }
        if matches!(req.op, BlockOp::Trim | BlockOp::WriteZeroes) && req.len == 0 {
            return Outcome::Done(self.judge(req, 0, started, false));
        }
        if durable(req) && self.export.durability_lost() {
            return Outcome::Done(self.judge(req, -libc::EIO, started, false));
        }
        // SAFETY: passed on from our caller.
        match unsafe { self.io.start(Op::for_request(req, buf), tag, sq) } {
            Progress::Done(res) => Outcome::Done(self.status(req, tag, res, started)),
            Progress::Pending => Outcome::Pending(started),
        }
    }

    /// An admitted READ of at least [`MAPPED_READ_MIN`] bytes whose bytes lie in memory that
    /// lives as long as this queue ([`blkwire_backend::Backend::mapped`]): their address, and
    /// the READ counts as done. `None`: start it as usual.
    pub fn read_mapped(&mut self, req: &BlockRequest) -> Option<*const u8> {
        let started = Started::now();
        let data = self.mapped(req)?;
        self.mapped_read_done(req, started);
        Some(data)
    }

    /// `read_mapped` for a caller that may still turn the address down (a frontend that will
    /// not frame the reply around it): nothing is counted until [`Executor::mapped_read_done`].
    pub fn mapped(&self, req: &BlockRequest) -> Option<*const u8> {
        debug_assert_eq!(req.op, BlockOp::Read);
        if req.len < MAPPED_READ_MIN {
            return None;
        }
        self.io.mapped(req.offset, req.len as u64)
    }

    /// Where an admitted WRITE without FUA may copy its bytes as they arrive, straight into
    /// the export's memory ([`blkwire_backend::Backend::mapped_for_write`]: RAM), instead of
    /// assembling them in a buffer for [`Executor::start`] to copy in once more; it counts
    /// as done at [`Executor::mapped_write_done`]. `None`: assemble and start it as usual.
    pub fn write_mapped(&self, req: &BlockRequest) -> Option<*mut u8> {
        if req.op != BlockOp::Write || req.flags != IoFlags::empty() {
            return None;
        }
        self.io.mapped_for_write(req.offset, req.len as u64)
    }

    /// `len` bytes at `offset` of a WRITE were copied where [`Executor::write_mapped`] said.
    pub fn wrote_mapped(&self, offset: u64, len: u64) {
        self.io.wrote_mapped(offset, len)
    }

    /// A WRITE whose bytes were all copied where [`Executor::write_mapped`] said counts as
    /// done.
    pub fn mapped_write_done(&mut self, req: &BlockRequest, started: Started) {
        self.stats.writes += 1;
        self.stats.bytes_written += req.len as u64;
        self.judge(req, req.len as i32, started, false);
    }

    /// A READ answered from the address [`Executor::mapped`] gave counts as done.
    pub fn mapped_read_done(&mut self, req: &BlockRequest, started: Started) {
        self.stats.reads += 1;
        self.judge(req, req.len as i32, started, false);
    }

    /// Checks and starts a COPY (PROTOCOL.md §13) to `dst` of `total` bytes (the request's
    /// length), its ranges and source export in `desc`, with the request's `flags`: FUA makes the
    /// copied bytes durable before the answer (a flush once everything is copied, whose failure
    /// fails the COPY). The source is looked up as the session's
    /// host may open it, so an export it may not open is as unknown as a missing one; and when
    /// the frontend checked the source as a particular export (`source_is`: iSCSI's EXTENDED
    /// COPY, against that export's reservations), one of that name that is not it (removed and
    /// added again since) is unknown too. Refusals come back as `Done` before anything is
    /// written; once running, its result (0 or a negative errno, from [`Executor::complete`] or
    /// [`Executor::reap`]) goes to [`Executor::copy_status`] with the same tag.
    #[allow(clippy::too_many_arguments)]
    pub fn start_copy(
        &mut self,
        desc: &CopyDescriptor,
        source_is: Option<&Weak<Export>>,
        dst: u64,
        total: u32,
        flags: IoFlags,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Option<Copied> {
        let refused = |status| Some(Copied { status, bytes: 0 });
        let source = if desc.source.is_empty() || desc.source == self.export.name {
            None
        } else {
            let found = self
                .sources
                .as_ref()
                .and_then(|(registry, session)| registry.copy_source(*session, &desc.source));
            let checked = |e: &Arc<Export>| {
                source_is.is_none_or(|w| w.upgrade().is_some_and(|c| Arc::ptr_eq(&c, e)))
            };
            match found.filter(checked) {
                Some(e) => Some(e),
                None => return refused(Status::NoExport),
            }
        };
        // What this session addresses (the destination, and sources in its own export) stays
        // within the size it was given, whatever the export has grown to since.
        let src = source.as_deref().unwrap_or(&self.export);
        match self
            .export
            .check_copy_within(self.size, src, &desc.ranges, dst)
        {
            Ok(n) if n == total as u64 => {}
            Ok(_) => return refused(Status::Invalid),
            Err(r) => return refused(refusal_status(r)),
        }
        let fua = flags.has(IoFlags::FUA);
        if fua && self.export.durability_lost() {
            return refused(Status::Io);
        }
        // Counted once it starts: a refused COPY is an error reply, not a COPY started.
        self.stats.copies += 1;
        if fua {
            self.fua_copies.push(tag);
        }
        let progress = match &source {
            None => self.io.start_copy(&desc.ranges, dst, fua, tag, sq),
            Some(src) => self
                .io
                .start_copy_from(src, &desc.ranges, dst, fua, tag, sq),
        };
        match progress {
            Progress::Done(res) => Some(self.copy_status(tag, res, total)),
            Progress::Pending => None,
        }
    }

    /// Latches the export's lost durability ([`Export::lose_durability`]) after a `what`
    /// failed with `res`, saying so once.
    fn durability_lost(&self, what: &str, res: i32) {
        if self.export.lose_durability() {
            crate::log!(
                crate::log::Level::Error,
                "export {}: a {what} failed ({}): writes acknowledged before it may be lost; every flush and FUA request on it fails from now on (check its storage, then remove and add the export again)",
                self.export.name.escape_debug(),
                std::io::Error::from_raw_os_error(-res)
            );
        }
    }

    /// The answer to a COPY started with `tag` whose result is `res`.
    pub fn copy_status(&mut self, tag: u64, res: i32, total: u32) -> Copied {
        let fua = match self.fua_copies.iter().position(|&t| t == tag) {
            Some(i) => {
                self.fua_copies.swap_remove(i);
                true
            }
            None => false,
        };
        // A COPY's writes carry no sync of their own: only its flush (FUA) can latch.
        if res < 0 && self.io.flush_failed(tag) {
            self.durability_lost("FUA copy", res);
        }
        if fua && res >= 0 && self.export.durability_lost() {
            // As for a FUA request (`judge`): another flush failed while its own ran.
            return Copied {
                status: Status::Io,
                bytes: 0,
            };
        }
        if res < 0 {
            let bytes = self.io.copied_before_failure(tag).min(total as u64) as u32;
            self.stats.bytes_copied += bytes as u64;
            return Copied {
                status: Status::from_errno(-res),
                bytes,
            };
        }
        self.stats.bytes_copied += total as u64;
        Copied {
            status: Status::Ok,
            bytes: total,
        }
    }

    /// A ring completion for the request started with `tag`: its backend result once it is
    /// finished (turn it into a status with [`Executor::status`]), `None` while more is to come.
    pub fn complete(&mut self, tag: u64, res: i32, sq: &mut dyn Submitter) -> Option<i32> {
        self.io.complete(tag, res, sq)
    }

    /// Starts an allocation query (range-checked with [`Executor::check_range`]) whose extents,
    /// at most `max`, are appended to `*out`. Exports that complete inline answer it inline
    /// too.
    ///
    /// # Safety
    /// `out` must stay valid, and untouched by anyone else, until the result is delivered.
    pub unsafe fn start_allocation(
        &mut self,
        offset: u64,
        len: u32,
        max: usize,
        out: *mut Vec<Extent>,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Outcome<()> {
        // SAFETY: passed on from our caller.
        match unsafe {
            self.io
                .start_allocation(offset, len as u64, max, out, tag, sq)
        } {
            Progress::Done(res) => Outcome::Done(result_status(res)),
            Progress::Pending => Outcome::Pending(()),
        }
    }

    /// Collects requests finished on the backend's own threads: `(tag, result)` each; turn a
    /// result into a status with [`Executor::status`].
    pub fn reap(&mut self, sq: &mut dyn Submitter, done: &mut dyn FnMut(u64, i32)) {
        self.io.reap(sq, done)
    }

    /// The status of a finished request started with `tag` from its backend result (bytes or a
    /// negative errno); counts bytes read and records how long it took since `started`.
    pub fn status(&mut self, req: &BlockRequest, tag: u64, res: i32, started: Started) -> Status {
        // Failures only: nothing more on the path of every answered request.
        let flush_failed = res < 0 && self.io.flush_failed(tag);
        self.judge(req, res, started, flush_failed)
    }

    /// [`Executor::status`], told whether the request failed in its own flush (an emulated
    /// FUA's): that latches whatever the errno, as any failed flush does.
    fn judge(
        &mut self,
        req: &BlockRequest,
        res: i32,
        started: Started,
        flush_failed: bool,
    ) -> Status {
        self.stats.latency.record(req.op, started.0.elapsed());
        let native_fua = || self.export.capabilities().fua == blkwire_backend::Support::Native;
        if res < 0 && (flush_failed || latches(req.op, durable(req), native_fua(), res)) {
            let what = if req.op == BlockOp::Flush {
                "flush"
            } else {
                "FUA request"
            };
            self.durability_lost(what, res);
        }
        let status = if res < 0 {
            Status::from_errno(-res)
        } else if req.op.moves_data() && res as u32 != req.len {
            // A short transfer inside the export: the file shrank under us (read) or the
            // filesystem is full (write).
            if req.op == BlockOp::Read {
                Status::Io
            } else {
                Status::NoSpace
            }
        } else if durable(req) && self.export.durability_lost() {
            // Another flush of the export failed while this one ran: Linux reports a writeback
            // error to one fsync of a file only, so this one's success may cover lost writes.
            Status::Io
        } else {
            Status::Ok
        };
        if status == Status::Ok && req.op == BlockOp::Read {
            self.stats.bytes_read += req.len as u64;
        }
        status
    }
}

/// Whether `req` makes something durable: a flush, or a change with FUA. Once the export's
/// durability is lost ([`blkwire_backend::Export::lose_durability`]) these fail.
fn durable(req: &BlockRequest) -> bool {
    req.op == BlockOp::Flush || (req.op.modifies() && req.flags.has(IoFlags::FUA))
}

/// Whether a result `res` of `op` loses the export's durability: a failed flush (what it
/// covered may be lost, and Linux reports that once), and a FUA WRITE synced with its data
/// (`native_fua`: `RWF_DSYNC`, one result for both) failing with what its sync reports of
/// writes acknowledged before: EIO, and ENOSPC and EDQUOT, which writeback reports on full
/// thin storage or an NFS quota. A FUA request's own flush after its change (emulated FUA: a
/// write, a zeroing, a trim, a COPY) is told apart by
/// [`blkwire_backend::ExportQueue::flush_failed`]; its change failing before that flush ran
/// (refused, out of space, a write the backend could not make) says nothing of what was
/// acknowledged before.
fn latches(op: BlockOp, durable: bool, native_fua: bool, res: i32) -> bool {
    let synced_with_data = durable && op == BlockOp::Write && native_fua;
    res < 0
        && (op == BlockOp::Flush
            || (synced_with_data && matches!(-res, libc::EIO | libc::ENOSPC | libc::EDQUOT)))
}

/// The status of an operation that moves no data: 0 or a negative errno.
pub fn result_status(res: i32) -> Status {
    if res < 0 {
        Status::from_errno(-res)
    } else {
        Status::Ok
    }
}

fn refusal_status(r: Refusal) -> Status {
    match r {
        Refusal::ReadOnly => Status::ReadOnly,
        Refusal::OutOfRange => Status::OutOfRange,
        Refusal::Invalid => Status::Invalid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_backend::{ExportSpec, MemBackend};

    struct NoRing;
    impl Submitter for NoRing {
        fn push(&mut self, _: io_uring::squeue::Entry) {
            panic!("inline backends push nothing")
        }
    }

    fn exec(spec: &str, max_io: u32) -> Executor {
        let e = Export::open(&ExportSpec::parse(spec).unwrap()).unwrap();
        let size = e.size();
        Executor::open(Arc::new(e), max_io, size).unwrap()
    }

    /// Only READs of at least `MAPPED_READ_MIN` of RAM that exists are answered from the
    /// export's memory, and each counts as one READ of its bytes.
    #[test]
    fn reads_from_the_mapping_from_64k_on() {
        let mut x = exec("m=mem:1M", 1 << 20);
        let data = vec![9u8; 1 << 17];
        let w = BlockRequest::new(BlockOp::Write, 0, 1 << 17);
        // SAFETY: `data` outlives the inline call.
        let st = unsafe { x.start(&w, data.as_ptr().cast_mut(), 0, &mut NoRing) };
        assert_eq!(st, Outcome::Done(Status::Ok));
        let read = |len| BlockRequest::new(BlockOp::Read, 0, len);
        assert!(x.read_mapped(&read(4096)).is_none(), "a small READ is read");
        let p = x
            .read_mapped(&read(MAPPED_READ_MIN))
            .expect("64 KiB of written RAM");
        // SAFETY: 64 KiB of the mapping, which the executor keeps.
        let shown = unsafe { std::slice::from_raw_parts(p, MAPPED_READ_MIN as usize) };
        assert!(shown == &data[..65536]);
        let hole = BlockRequest::new(BlockOp::Read, 1 << 18, 1 << 17);
        assert!(x.read_mapped(&hole).is_none(), "a hole is read");
        assert_eq!((x.stats.reads, x.stats.bytes_read), (1, 65536));
    }

    /// A COPY is counted when it starts; one refused (its ranges outside the export, or
    /// adding up to another length than the request's) is not.
    #[test]
    fn refused_copies_are_not_counted_as_copies() {
        let mut x = exec("m=mem:1M", 65536);
        let copy = |offset, len| CopyDescriptor {
            source: String::new(),
            ranges: vec![blkwire_backend::CopyRange { offset, len }],
        };
        let copy_to = |x: &mut Executor, desc, dst, total| {
            x.start_copy(&desc, None, dst, total, IoFlags::empty(), 1, &mut NoRing)
        };
        let outside = copy_to(&mut x, copy(1 << 20, 4096), 0, 4096);
        assert!(outside.is_some_and(|c| c.status != Status::Ok));
        let short = copy_to(&mut x, copy(0, 4096), 8192, 8192);
        assert!(short.is_some_and(|c| c.status == Status::Invalid));
        assert_eq!(x.stats.copies, 0);
        let done = copy_to(&mut x, copy(0, 4096), 8192, 4096);
        assert!(done.is_some_and(|c| c.status == Status::Ok && c.bytes == 4096));
        assert_eq!((x.stats.copies, x.stats.bytes_copied), (1, 4096));
    }

    #[test]
    fn admission_checks() {
        let x = exec("m=mem:1M", 65536);
        let r = |op, offset, len| BlockRequest::new(op, offset, len);
        assert_eq!(x.admit(&r(BlockOp::Read, 0, 65536)), Ok(()));
        assert_eq!(
            x.admit(&r(BlockOp::Read, 0, 65537)),
            Err(Status::Invalid),
            "over max I/O"
        );
        assert_eq!(
            x.admit(&r(BlockOp::Write, 0, 0)),
            Err(Status::Invalid),
            "empty write"
        );
        assert_eq!(
            x.admit(&r(BlockOp::Read, (1 << 20) - 512, 1024)),
            Err(Status::OutOfRange)
        );
        assert_eq!(
            x.admit(&r(BlockOp::Trim, u64::MAX, 2)),
            Err(Status::OutOfRange)
        );
        assert_eq!(
            x.admit(&r(BlockOp::Trim, 0, 0)),
            Ok(()),
            "empty trim is fine"
        );
        let fast = r(BlockOp::WriteZeroes, 0, 4096).flagged(IoFlags::FAST_ZERO);
        assert_eq!(x.admit(&fast), Ok(()), "RAM zeroes by punching holes");
        assert_eq!(
            x.admit(&fast.flagged(IoFlags::NO_HOLE)),
            Err(Status::Unsupported),
            "allocated zeros are written, never fast"
        );
        let block = x.export().io_block();
        assert_eq!(
            x.admit(&r(BlockOp::WriteZeroes, 0, 4096 + block / 2).flagged(IoFlags::FAST_ZERO)),
            Err(Status::Unsupported),
            "off the export's blocks: refused before anything is zeroed"
        );
        assert_eq!(
            x.admit(&r(BlockOp::WriteZeroes, 0, 4096 + block / 2)),
            Ok(()),
            "without FAST_ZERO the edges are zeroed as they can be"
        );
        assert_eq!(
            x.admit(&r(BlockOp::WriteZeroes, 100, 4096)),
            Ok(()),
            "any bytes of an export without alignment"
        );
        // An O_DIRECT export of a 512-byte-sector device (4 KiB I/O): zeroing off its sectors
        // is refused before anything is zeroed; whole sectors are not.
        let mem = Export::open(&ExportSpec::parse("m=mem:128M").unwrap()).unwrap();
        let direct = Export::new(
            "d",
            Arc::new(blkwire_backend::testing::Direct512(mem.backend().clone())),
            false,
        );
        let d = Executor::open(Arc::new(direct), 65536, 128 << 20).unwrap();
        for (offset, len, want) in [
            (0, (64 << 20) + 100, Err(Status::Invalid)),
            (100, 4096, Err(Status::Invalid)),
            (0, (64 << 20) + 512, Ok(())),
            (512, 4096, Ok(())),
        ] {
            assert_eq!(
                d.admit(&r(BlockOp::WriteZeroes, offset, len)),
                want,
                "{offset}+{len}"
            );
        }
        let ro = exec("m=mem:1M,ro", 65536);
        assert_eq!(ro.admit(&r(BlockOp::Write, 0, 512)), Err(Status::ReadOnly));
        assert_eq!(ro.admit(&r(BlockOp::Read, 0, 512)), Ok(()));
    }

    /// A queue checks against the size its session was given: an export that grows under it
    /// changes nothing for it (its client was told the old size), while a queue opened with
    /// the new size reaches the new end.
    #[test]
    fn a_queue_keeps_its_sessions_size_when_the_export_grows() {
        let e = Arc::new(Export::open(&ExportSpec::parse("n=null:1M").unwrap()).unwrap());
        let old = Executor::open(e.clone(), 65536, e.size()).unwrap();
        assert_eq!(e.resize(2 << 20), Ok(1 << 20));
        let new = Executor::open(e.clone(), 65536, e.size()).unwrap();
        let past_old_end = BlockRequest::new(BlockOp::Write, 1 << 20, 4096);
        let last_old = BlockRequest::new(BlockOp::Write, (1 << 20) - 4096, 4096);
        assert_eq!(old.admit(&past_old_end), Err(Status::OutOfRange));
        assert_eq!(old.check_range(1 << 20, 512), Err(Status::OutOfRange));
        assert_eq!(old.admit(&last_old), Ok(()));
        assert_eq!((old.size, new.size), (1 << 20, 2 << 20));
        assert_eq!(new.admit(&past_old_end), Ok(()));
        assert_eq!(new.check_range((2 << 20) - 512, 512), Ok(()));
        assert_eq!(
            new.admit(&BlockRequest::new(BlockOp::Read, 2 << 20, 512)),
            Err(Status::OutOfRange)
        );
    }

    #[test]
    fn inline_requests_finish_in_start_and_are_counted() {
        let mut x = exec("m=mem:1M", 65536);
        let mut data = vec![9u8; 4096];
        let w = BlockRequest::new(BlockOp::Write, 4096, 4096);
        // SAFETY: `data` outlives the call, which completes inline.
        let o = unsafe { x.start(&w, data.as_mut_ptr(), 0, &mut NoRing) };
        assert_eq!(o, Outcome::Done(Status::Ok));
        let mut back = vec![0u8; 4096];
        let r = BlockRequest::new(BlockOp::Read, 4096, 4096);
        // SAFETY: as above.
        let o = unsafe { x.start(&r, back.as_mut_ptr(), 0, &mut NoRing) };
        assert_eq!(o, Outcome::Done(Status::Ok));
        assert_eq!(back, data);
        assert_eq!((x.stats.reads, x.stats.writes), (1, 1));
        assert_eq!((x.stats.bytes_read, x.stats.bytes_written), (4096, 4096));
        for op in [BlockOp::Read, BlockOp::Write] {
            assert_eq!(x.stats.latency.of(op).count(), 1, "{op:?} timed");
        }
        let trim = BlockRequest::new(BlockOp::Trim, 0, 0);
        // SAFETY: a trim reads no buffer.
        let o = unsafe { x.start(&trim, std::ptr::null_mut(), 0, &mut NoRing) };
        assert_eq!(o, Outcome::Done(Status::Ok));
        assert_eq!(
            x.stats.latency.of(BlockOp::Trim).count(),
            1,
            "an empty trim, answered without the backend, is timed too"
        );
    }

    /// An executor on a `Recorder` with native flush and write-zeroes and this `trim`,
    /// completing inline or (`asynchronous`) on its own threads.
    fn recorder(
        trim: blkwire_backend::Support,
        asynchronous: bool,
    ) -> (Arc<blkwire_backend::testing::Recorder>, Executor) {
        use blkwire_backend::{Capabilities, Support};
        let caps = Capabilities {
            flush: Support::Native,
            write_zeroes: Support::Native,
            trim,
            ..Capabilities::default()
        };
        recorder_of(caps, asynchronous)
    }

    /// A recorder export declaring `caps`, and an executor on it.
    fn recorder_of(
        caps: blkwire_backend::Capabilities,
        asynchronous: bool,
    ) -> (Arc<blkwire_backend::testing::Recorder>, Executor) {
        let b = blkwire_backend::testing::Recorder::new(caps, asynchronous);
        let e = Export::new("r", b.clone(), false);
        let size = e.size();
        (b, Executor::open(Arc::new(e), 65536, size).unwrap())
    }

    /// What a protocol asks as FUA reaches a flush-only backend that completes on its own
    /// threads as a write and then a flush, and is answered once, after the flush.
    #[test]
    fn fua_through_the_executor_on_an_asynchronous_flush_only_backend() {
        use blkwire_backend::Support;
        let (b, mut x) = recorder(Support::None, true);
        let mut data = vec![4u8; 4096];
        let w = BlockRequest::new(BlockOp::Write, 0, 4096).flagged(IoFlags::FUA);
        assert_eq!(x.admit(&w), Ok(()));
        // SAFETY: `data` outlives every result collected below.
        let o = unsafe { x.start(&w, data.as_mut_ptr(), 77, &mut NoRing) };
        let Outcome::Pending(started) = o else {
            panic!("{o:?}: the backend answers on its own thread")
        };
        let mut done = Vec::new();
        for _ in 0..2 {
            x.reap(&mut NoRing, &mut |tag, res| done.push((tag, res)));
        }
        assert_eq!(
            done,
            [(77, 4096)],
            "one answer, with the write's byte count"
        );
        assert_eq!(x.status(&w, 77, done[0].1, started), Status::Ok);
        assert_eq!(b.log(), ["write 0+4096 fua=false", "flush"]);
        assert_eq!(x.stats.writes, 1);
        assert_eq!(x.stats.latency.of(BlockOp::Write).count(), 1, "timed once");
    }

    /// FUA on a WRITE_ZEROES, TRIM or COPY is a flush once the operation is done, answered
    /// after the flush (no backend makes these durable by itself); a failed flush fails the
    /// request. Without it the flag was dropped and the range answered before it was stable.
    #[test]
    fn fua_on_zeroes_trims_and_copies_is_a_flush_before_the_answer() {
        use blkwire_backend::{CopyRange, Support};
        use std::sync::atomic::Ordering;
        for trim in [Support::None, Support::Native] {
            let (b, mut x) = recorder(trim, false);
            let run = |x: &mut Executor, op| {
                let req = BlockRequest::new(op, 0, 4096).flagged(IoFlags::FUA);
                assert_eq!(x.admit(&req), Ok(()));
                // SAFETY: neither names a buffer; the backend completes inline.
                unsafe { x.start(&req, std::ptr::null_mut(), 1, &mut NoRing) }
            };
            assert_eq!(run(&mut x, BlockOp::WriteZeroes), Outcome::Done(Status::Ok));
            assert_eq!(b.log(), ["zero 0+4096", "flush"]);
            assert_eq!(run(&mut x, BlockOp::Trim), Outcome::Done(Status::Ok));
            let trimmed: &[&str] = if trim == Support::Native {
                &["zero 0+4096", "flush", "trim 0+4096", "flush"]
            } else {
                // An advisory TRIM changes nothing: nothing to make durable.
                &["zero 0+4096", "flush"]
            };
            assert_eq!(b.log(), trimmed, "trim {trim:?}");
            let desc = CopyDescriptor {
                source: String::new(),
                ranges: vec![CopyRange {
                    offset: 0,
                    len: 4096,
                }],
            };
            let copied = x.start_copy(&desc, None, 8192, 4096, IoFlags::FUA, 2, &mut NoRing);
            assert_eq!(
                copied,
                Some(Copied {
                    status: Status::Ok,
                    bytes: 4096
                })
            );
            let log = b.log();
            assert_eq!(
                log[trimmed.len()..],
                ["read 0+4096", "write 8192+4096 fua=false", "flush"],
                "an emulated copy, then the flush"
            );
            // Without FUA, no flush.
            let plain = BlockRequest::new(BlockOp::WriteZeroes, 0, 4096);
            // SAFETY: as above.
            let o = unsafe { x.start(&plain, std::ptr::null_mut(), 3, &mut NoRing) };
            assert_eq!(o, Outcome::Done(Status::Ok));
            assert_eq!(b.log()[log.len()..], ["zero 0+4096"]);
            // A flush that fails fails the request.
            b.fail_flush.store(true, Ordering::Relaxed);
            assert_eq!(run(&mut x, BlockOp::WriteZeroes), Outcome::Done(Status::Io));
            let failed = x.start_copy(&desc, None, 8192, 4096, IoFlags::FUA, 4, &mut NoRing);
            assert_eq!(
                failed,
                Some(Copied {
                    status: Status::Io,
                    bytes: 0
                }),
                "copied but not known durable"
            );
        }
    }

    /// A COPY that fails part way reports what it copied before (the initiator copies the
    /// rest again), but under FUA nothing: no flush ran over those bytes, so none is known
    /// durable (PROTOCOL.md §13).
    #[test]
    fn a_fua_copy_that_fails_part_way_reports_nothing_copied() {
        use blkwire_backend::{CopyRange, Support};
        use std::sync::atomic::Ordering;
        let (b, mut x) = recorder(Support::None, false);
        let desc = CopyDescriptor {
            source: String::new(),
            ranges: vec![
                CopyRange {
                    offset: 0,
                    len: 4096,
                },
                CopyRange {
                    offset: 65536,
                    len: 4096,
                },
            ],
        };
        // The second range's write fails.
        b.fail_from.store((1 << 20) + 4096 + 1, Ordering::Relaxed);
        for (flags, bytes) in [(IoFlags::empty(), 4096), (IoFlags::FUA, 0)] {
            let copied = x.start_copy(&desc, None, 1 << 20, 8192, flags, 1, &mut NoRing);
            assert_eq!(
                copied,
                Some(Copied {
                    status: Status::Io,
                    bytes
                }),
                "{flags:?}"
            );
        }
    }

    /// A failed flush is not forgotten: Linux reports a writeback error to one fsync only,
    /// so the flush a host sends again (NVMe and SCSI hosts retry) would succeed over lost
    /// data. Every flush and FUA request on the export fails from then on, on every queue,
    /// without reaching the backend; plain writes and reads go on.
    #[test]
    fn a_failed_flush_fails_every_later_flush_of_the_export() {
        use blkwire_backend::Support;
        use std::sync::atomic::Ordering;
        let (b, mut x) = recorder(Support::None, false);
        let mut other = Executor::open(Arc::clone(x.export()), 65536, x.size).unwrap();
        let flush = BlockRequest::new(BlockOp::Flush, 0, 0);
        let run = |x: &mut Executor, req: &BlockRequest| {
            let mut buf = vec![0u8; req.len as usize];
            // SAFETY: `buf` holds the request's length; the backend completes inline.
            unsafe { x.start(req, buf.as_mut_ptr(), 1, &mut NoRing) }
        };
        assert_eq!(run(&mut x, &flush), Outcome::Done(Status::Ok));
        b.fail_flush.store(true, Ordering::Relaxed);
        assert_eq!(run(&mut x, &flush), Outcome::Done(Status::Io));
        b.fail_flush.store(false, Ordering::Relaxed);
        let seen = b.log().len();
        let fua = BlockRequest::new(BlockOp::Write, 0, 4096).flagged(IoFlags::FUA);
        for x in [&mut x, &mut other] {
            assert_eq!(run(x, &flush), Outcome::Done(Status::Io), "retried");
            assert_eq!(run(x, &fua), Outcome::Done(Status::Io));
        }
        assert_eq!(b.log().len(), seen, "none reached the backend");
        let plain = BlockRequest::new(BlockOp::Write, 0, 4096);
        assert_eq!(run(&mut other, &plain), Outcome::Done(Status::Ok));
        // A FUA write that fails latches it too.
        let (b, mut x) = recorder(Support::None, false);
        b.fail_flush.store(true, Ordering::Relaxed);
        assert_eq!(
            run(&mut x, &fua),
            Outcome::Done(Status::Io),
            "write, then flush"
        );
        b.fail_flush.store(false, Ordering::Relaxed);
        assert_eq!(run(&mut x, &flush), Outcome::Done(Status::Io));
        // So does a FUA write's EIO or ENOSPC where the write carries its sync (native FUA:
        // the sync may report an earlier write's writeback on full thin storage), not its
        // EINVAL; nor an emulated FUA write or a FUA zeroing failing before their flush (out
        // of space, or a write the backend could not make, as `rbd:` answers a write it cannot
        // tell was whole): what was acknowledged before is not in doubt.
        let zero = BlockRequest::new(BlockOp::WriteZeroes, 0, 4096).flagged(IoFlags::FUA);
        let native = blkwire_backend::Capabilities {
            flush: Support::Native,
            fua: Support::Native,
            write_zeroes: Support::Native,
            ..Default::default()
        };
        for (fua_native, req, errno, latched) in [
            (true, &fua, libc::ENOSPC, true),
            (true, &fua, libc::EIO, true),
            (true, &fua, libc::EINVAL, false),
            (false, &fua, libc::ENOSPC, false),
            (false, &fua, libc::EIO, false),
            (false, &zero, libc::ENOSPC, false),
            (false, &zero, libc::EIO, false),
        ] {
            let (b, mut x) = if fua_native {
                recorder_of(native, false)
            } else {
                recorder(Support::None, false)
            };
            b.fail_from.store(1, Ordering::Relaxed);
            b.fail_errno.store(errno, Ordering::Relaxed);
            assert_ne!(run(&mut x, req), Outcome::Done(Status::Ok));
            let after = if latched { Status::Io } else { Status::Ok };
            assert_eq!(
                run(&mut x, &flush),
                Outcome::Done(after),
                "{:?} (native FUA: {fua_native}) failing with errno {errno}",
                req.op
            );
        }
        // A FUA copy whose flush fails latches it.
        use blkwire_backend::CopyRange;
        let desc = CopyDescriptor {
            source: String::new(),
            ranges: vec![CopyRange {
                offset: 0,
                len: 4096,
            }],
        };
        let (b, mut x) = recorder(Support::None, false);
        b.fail_flush.store(true, Ordering::Relaxed);
        let copied = x.start_copy(&desc, None, 8192, 4096, IoFlags::FUA, 7, &mut NoRing);
        assert_eq!(copied.map(|c| c.status), Some(Status::Io));
        b.fail_flush.store(false, Ordering::Relaxed);
        assert_eq!(
            run(&mut x, &flush),
            Outcome::Done(Status::Io),
            "after the copy"
        );
    }

    /// A flush that succeeds while another on the export failed (Linux reports a writeback
    /// error to one of the fsyncs running at once) is answered IO, not OK: the writes it
    /// covers may be lost.
    #[test]
    fn a_flush_finishing_after_another_failed_is_not_ok() {
        use blkwire_backend::Support;
        use std::sync::atomic::Ordering;
        let (b, mut x) = recorder(Support::Native, true);
        let mut other = Executor::open(Arc::clone(x.export()), 65536, x.size).unwrap();
        let flush = BlockRequest::new(BlockOp::Flush, 0, 0);
        let mut none = [0u8; 0];
        // SAFETY: a flush moves no data.
        let started = match unsafe { x.start(&flush, none.as_mut_ptr(), 1, &mut NoRing) } {
            Outcome::Pending(started) => started,
            Outcome::Done(st) => panic!("asynchronous, yet answered {st:?}"),
        };
        let mut done = Vec::new();
        x.reap(&mut NoRing, &mut |tag, res| done.push((tag, res)));
        assert_eq!(done, [(1, 0)], "this flush succeeded on the backend");
        b.fail_flush.store(true, Ordering::Relaxed);
        // SAFETY: as above.
        let o = unsafe { other.start(&flush, none.as_mut_ptr(), 2, &mut NoRing) };
        let failed = match o {
            Outcome::Done(st) => st,
            Outcome::Pending(started) => {
                let mut r = Vec::new();
                other.reap(&mut NoRing, &mut |tag, res| r.push((tag, res)));
                other.status(&flush, r[0].0, r[0].1, started)
            }
        };
        assert_eq!(failed, Status::Io);
        assert_eq!(
            x.status(&flush, 1, 0, started),
            Status::Io,
            "answered after"
        );
    }

    /// A FUA request whose own flush (emulated FUA) fails latches the export whatever the
    /// errno: a writeback error of writes acknowledged before (ENOSPC on full thin storage,
    /// EDQUOT on an NFS quota) reported to that flush would not be reported to the next one.
    /// On backends completing inline and on their own threads; for FUA writes, zeroings,
    /// trims and copies.
    #[test]
    fn a_fua_requests_own_flush_failing_out_of_space_latches() {
        use blkwire_backend::{CopyRange, Support};
        use std::sync::atomic::Ordering;
        let flush = BlockRequest::new(BlockOp::Flush, 0, 0);
        let desc = CopyDescriptor {
            source: String::new(),
            ranges: vec![CopyRange {
                offset: 0,
                len: 4096,
            }],
        };
        for asynchronous in [false, true] {
            for op in [
                BlockOp::Write,
                BlockOp::WriteZeroes,
                BlockOp::Trim,
                BlockOp::Flush,
            ] {
                let (b, mut x) = recorder(Support::Native, asynchronous);
                b.fail_flush.store(true, Ordering::Relaxed);
                b.flush_errno.store(libc::ENOSPC, Ordering::Relaxed);
                // `Flush` here stands for a FUA COPY.
                let failed = if op == BlockOp::Flush {
                    let c = x.start_copy(&desc, None, 8192, 4096, IoFlags::FUA, 9, &mut NoRing);
                    let c = c.or_else(|| {
                        let mut out = None;
                        for _ in 0..4 {
                            x.reap(&mut NoRing, &mut |tag, res| out = Some((tag, res)));
                        }
                        out.map(|(tag, res)| x.copy_status(tag, res, 4096))
                    });
                    c.map(|c| c.status)
                } else {
                    let req = BlockRequest::new(op, 0, 4096).flagged(IoFlags::FUA);
                    let mut buf = vec![0u8; 4096];
                    // SAFETY: `buf` holds the request's length and outlives it.
                    match unsafe { x.start(&req, buf.as_mut_ptr(), 9, &mut NoRing) } {
                        Outcome::Done(st) => Some(st),
                        Outcome::Pending(started) => {
                            // The change, then its flush: a reap each.
                            let mut out = None;
                            for _ in 0..4 {
                                x.reap(&mut NoRing, &mut |tag, res| out = Some((tag, res)));
                            }
                            out.map(|(tag, res)| x.status(&req, tag, res, started))
                        }
                    }
                };
                assert_eq!(failed, Some(Status::NoSpace), "{op:?} async {asynchronous}");
                b.fail_flush.store(false, Ordering::Relaxed);
                let mut none = [0u8; 0];
                // SAFETY: a flush moves no data.
                let later = match unsafe { x.start(&flush, none.as_mut_ptr(), 10, &mut NoRing) } {
                    Outcome::Done(st) => st,
                    Outcome::Pending(_) => panic!("a latched export answers at once"),
                };
                assert_eq!(later, Status::Io, "{op:?} (async {asynchronous}): latched");
            }
        }
    }

    /// The same on a backend that completes on its own threads: one answer, after the flush.
    #[test]
    fn fua_zeroes_on_an_asynchronous_backend_are_answered_after_the_flush() {
        use blkwire_backend::Support;
        let (b, mut x) = recorder(Support::None, true);
        let z = BlockRequest::new(BlockOp::WriteZeroes, 0, 4096).flagged(IoFlags::FUA);
        // SAFETY: a WRITE_ZEROES names no buffer.
        let o = unsafe { x.start(&z, std::ptr::null_mut(), 5, &mut NoRing) };
        let Outcome::Pending(started) = o else {
            panic!("{o:?}: the backend answers on its own thread")
        };
        let mut done = Vec::new();
        x.reap(&mut NoRing, &mut |tag, res| done.push((tag, res)));
        assert_eq!(done, [], "not answered before the flush");
        assert_eq!(b.log(), ["zero 0+4096", "flush"]);
        x.reap(&mut NoRing, &mut |tag, res| done.push((tag, res)));
        assert_eq!(done, [(5, 0)]);
        assert_eq!(x.status(&z, 5, 0, started), Status::Ok);
    }

    #[test]
    fn results_map_to_statuses() {
        let e = Export::new("m", Arc::new(MemBackend::new(1 << 20).unwrap()), false);
        let mut x = Executor::open(Arc::new(e), 65536, 1 << 20).unwrap();
        let r = BlockRequest::new(BlockOp::Read, 0, 4096);
        let w = BlockRequest::new(BlockOp::Write, 0, 4096);
        let f = BlockRequest::new(BlockOp::Flush, 0, 0);
        let t = Started::now();
        assert_eq!(x.status(&r, 1, 4096, t), Status::Ok);
        assert_eq!(x.status(&r, 1, 100, t), Status::Io, "short read");
        assert_eq!(
            x.status(&w, 1, 100, t),
            Status::NoSpace,
            "short write: no space"
        );
        assert_eq!(x.status(&f, 1, 0, t), Status::Ok);
        assert_eq!(x.status(&f, 1, -libc::EIO, t), Status::Io);
        assert_eq!(x.status(&w, 1, -libc::ENOSPC, t), Status::NoSpace);
        assert_eq!(x.stats.bytes_read, 4096, "only the successful read counts");
        let timed = |op| x.stats.latency.of(op).count();
        assert_eq!(
            (
                timed(BlockOp::Read),
                timed(BlockOp::Write),
                timed(BlockOp::Flush)
            ),
            (2, 2, 2),
            "failures are timed too"
        );
    }
}
