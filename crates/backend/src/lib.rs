//! Storage backends and the generic layer above them (backend contract v2, docs/ARCHITECTURE.md).
//!
//! A [`Backend`] is shared by every queue of an export and declares what it does natively
//! ([`Capabilities`], `Native` or `None` per capability). Each queue thread opens its own
//! [`QueueIo`] handle, so the data path holds no locks. A handle finishes an operation in one of
//! three ways ([`Started`]): inline (`mem:`, `null:`), through io_uring entries pushed to the
//! queue thread's own ring (`file:`), or on the backend's own threads, announced through a
//! notifier descriptor the queue thread watches and collected with [`QueueIo::reap`] (the way
//! librbd completes: `rbd:`, modelled on `memthread:`, which exercises it without a cluster).
//! [`Export`] is the generic layer: it checks ranges and read-only state and emulates what a backend lacks ([`Capabilities::effective`],
//! PROTOCOL.md §7, §10). [`registry`] names every backend `serve --export` knows.

#![deny(missing_docs)]

mod completions;
mod export;
mod file;
mod mem;
mod memthread;
mod null;
mod rbd;
pub mod registry;
mod size;
pub mod testing;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use blkwire_block::{BlockOp, BlockRequest, Capabilities, CopyRange, IoFlags, Limits, Support};
pub use export::{
    push_extent, AlignedBuf, Export, ExportQueue, ExportSpec, Progress, Refusal, ResizeError,
    SpecError, COPY_CHUNK, INLINE_PIECE,
};
pub use file::FileBackend;
pub use mem::MemBackend;
pub use memthread::MemThreadBackend;
pub use null::NullBackend;
pub use size::{format_size, parse_size};

/// Backends of removed exports may still be making their writes durable on threads of their
/// own (`rbd:` flushes and closes its image so, not to hold up the thread that dropped it):
/// waits at most `limit` for them, before the process exits. Returns how many are not done.
pub fn wait_for_closes(limit: std::time::Duration) -> usize {
    rbd::wait_for_closes(limit)
}

/// One run of an export's allocation map (NBD `base:allocation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Bytes in the run.
    pub len: u64,
    /// Unallocated and reads as zeros.
    pub hole: bool,
}

/// Most extents one allocation query returns; the rest of the range is left to a later query.
pub const MAX_EXTENTS: usize = 1 << 16;

/// One I/O as the data path hands it to a backend. Buffers are raw because, for io_uring and
/// for backends with threads of their own, they must stay valid until the completion arrives:
/// the queue that started the operation owns them until then (see [`QueueIo::start`]).
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// Fill `buf` with `len` bytes at `offset`.
    Read {
        /// First byte.
        offset: u64,
        /// Destination of `len` bytes.
        buf: *mut u8,
        /// Bytes to read.
        len: u32,
    },
    /// Store `len` bytes from `buf` at `offset`.
    Write {
        /// First byte.
        offset: u64,
        /// Source of `len` bytes.
        buf: *const u8,
        /// Bytes to write.
        len: u32,
        /// Durable before completion (only sent to backends with native FUA).
        fua: bool,
    },
    /// Make completed writes durable.
    Flush,
    /// Deallocate a range.
    Trim {
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u32,
        /// Durable before completion. Never true at a backend: the generic layer follows the
        /// trim with a flush instead (no backend has a FUA of its own for it).
        fua: bool,
    },
    /// Zero a range.
    WriteZeroes {
        /// First byte.
        offset: u64,
        /// Bytes.
        len: u32,
        /// The range must stay allocated.
        no_hole: bool,
        /// Only if it is fast (NBD's FAST_ZERO): a backend that would write zeros instead
        /// (a fallback) fails with `-EOPNOTSUPP`, so the client knows to do without.
        fast: bool,
        /// Durable before completion. Never true at a backend: the generic layer follows the
        /// zeroing with a flush instead.
        fua: bool,
    },
    /// Copy `len` bytes from `src` to `dst` within the export (the ranges do not overlap).
    /// Only sent to backends with native COPY; the result is `len` or a negative errno.
    Copy {
        /// First byte of the source.
        src: u64,
        /// First byte of the destination.
        dst: u64,
        /// Bytes.
        len: u32,
    },
    /// Copy `len` bytes at `src` of the file behind `fd` (another export's, from its
    /// [`Backend::copy_source_fd`]) to `dst` of this export. Only sent to backends whose
    /// [`Backend::copies_from_fd`] is true for `fd`; the result is `len` or a negative errno.
    CopyFrom {
        /// The source export's descriptor, kept open by the caller until the result.
        fd: RawFd,
        /// First byte of the source.
        src: u64,
        /// First byte of the destination.
        dst: u64,
        /// Bytes.
        len: u32,
    },
}

impl Op {
    /// The backend operation for a request; `buf` is used by READ and WRITE only.
    pub fn for_request(req: &BlockRequest, buf: *mut u8) -> Op {
        let (offset, len) = (req.offset, req.len);
        match req.op {
            BlockOp::Read => Op::Read { offset, buf, len },
            BlockOp::Write => Op::Write {
                offset,
                buf,
                len,
                fua: req.flags.has(IoFlags::FUA),
            },
            BlockOp::Flush => Op::Flush,
            BlockOp::Trim => Op::Trim {
                offset,
                len,
                fua: req.flags.has(IoFlags::FUA),
            },
            BlockOp::WriteZeroes => Op::WriteZeroes {
                offset,
                len,
                no_hole: req.flags.has(IoFlags::NO_HOLE),
                fast: req.flags.has(IoFlags::FAST_ZERO),
                fua: req.flags.has(IoFlags::FUA),
            },
        }
    }
}

/// Where a backend puts io_uring submissions: the queue thread's own ring.
pub trait Submitter {
    /// Queues one entry; it is submitted with the thread's next `io_uring_enter`.
    fn push(&mut self, entry: io_uring::squeue::Entry);
}

/// How an operation started.
#[derive(Debug, PartialEq, Eq)]
pub enum Started {
    /// Finished already: bytes transferred (READ/WRITE), 0, or a negative errno.
    Done(i32),
    /// `n` io_uring entries were pushed, each with the caller's tag as user data. The
    /// operation's result is the first entry's result, unless a later one failed.
    Submitted(u8),
    /// Running on the backend's own threads: its result comes from [`QueueIo::reap`].
    Async,
}

/// Storage that more than one export may open (`Backend::storage`), and where in it a
/// backend's byte 0 lies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Storage {
    /// What names it: a file's device and inode, a whole disk's device number, an RBD image.
    pub name: String,
    /// Where the backend starts in it: a partition's first byte on its disk, a loop device's
    /// offset into its file; 0 otherwise.
    pub start: u64,
}

/// A storage backend, shared by all queues of an export.
pub trait Backend: Send + Sync {
    /// `file:/path`, `mem:4G` and so on: how the user named it.
    fn describe(&self) -> String;
    /// Size in bytes. It may grow while the backend is served ([`Backend::resize`]), never
    /// shrink; the data path does not read it per request (a queue checks against the size its
    /// session was given, see [`Export::check_within`]).
    fn size(&self) -> u64;
    /// (logical, physical) block sizes in bytes, powers of two >= 512.
    fn block_sizes(&self) -> (u32, u32);
    /// What the backend does natively: each capability `Native` or `None`. What it lacks is the
    /// generic layer's job ([`Capabilities::effective`]).
    fn capabilities(&self) -> Capabilities;
    /// True when every byte reads as zero right now (lets `cp` skip zero blocks).
    fn reads_as_zero(&self) -> bool;
    /// Opens the per-queue handle; called on the queue's own thread.
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>>;
    /// A descriptor whose bytes are the export's, for COPYs into other exports to read with
    /// `copy_file_range`, a reflink or `pread` ([`Op::CopyFrom`]): a regular file or a memfd.
    /// `None` (the default): other exports read it through a queue and a bounce buffer.
    fn copy_source_fd(&self) -> Option<RawFd> {
        None
    }
    /// True when this backend copies from `fd`, another export's [`Backend::copy_source_fd`],
    /// itself ([`Op::CopyFrom`]): one copy in the kernel (or a shared extent) instead of a read
    /// and a write through a bounce buffer. A backend that completes inline answers true only
    /// for a descriptor whose reads never wait for a device or a filesystem (a memfd): it would
    /// run them on the reactor. Otherwise (the default) the source is read on a queue of its own.
    fn copies_from_fd(&self, _fd: RawFd) -> bool {
        false
    }
    /// Buffers handed to this backend must be aligned to this (O_DIRECT), 1 otherwise.
    fn buffer_alignment(&self) -> usize {
        1
    }
    /// Where this backend's bytes lie in storage another export may open too (a file or
    /// device given twice, a partition and its disk, a loop device and its file, an RBD
    /// image): a COPY between two exports of the same storage is checked for overlap as one
    /// within an export is, since copying forward over its own source corrupts it. `None`
    /// (the default): its storage is its own.
    fn storage(&self) -> Option<&Storage> {
        None
    }
    /// Grows the backend to `new_size` bytes (`export_resize`; the caller, [`Export::resize`],
    /// has checked that it is more than [`Backend::size`] and a multiple of the logical block).
    /// The storage grows first, then `size()` reports the new size, so whoever reads the new
    /// size finds every byte below it backed. Never shrinks: sessions keep the size their
    /// handshake gave them. The default refuses with an `Unsupported` error whose message is
    /// one line saying why and what to do instead.
    fn resize(&self, new_size: u64) -> io::Result<()> {
        let _ = new_size;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{} cannot be resized: remove and re-add the export at the new size",
                self.describe()
            ),
        ))
    }
    /// Where the bytes `offset..offset+len` (already range-checked) lie in this process's
    /// memory, when they are all there and stay mapped as long as the backend lives: a READ's
    /// reply can then be sent from there, one copy fewer than reading it into a buffer first.
    /// The bytes are read when they are sent, so a WRITE or TRIM of the same range that runs
    /// meanwhile may show through, as it may when requests overlap on a disk. `None`, the
    /// default: read it with [`QueueIo::start`].
    fn mapped(&self, _offset: u64, _len: u64) -> Option<*const u8> {
        None
    }
    /// Where a WRITE of `offset..offset+len` (already range-checked) may copy its bytes
    /// straight into the export's memory, valid as long as the backend lives. Used where a
    /// WRITE's data arrives in pieces (datagram fragments): each goes where it belongs as it
    /// arrives instead of into a buffer copied in once complete, and [`Backend::wrote_mapped`]
    /// follows each piece. Until the last, a READ of the range sees some pieces and not others,
    /// as it may see part of a WRITE running on a disk, and a WRITE given up before all its
    /// pieces arrived leaves those that did (a failed WRITE's range holds unknown data).
    /// `None`, the default: assemble it and start it as usual.
    fn mapped_for_write(&self, _offset: u64, _len: u64) -> Option<*mut u8> {
        None
    }
    /// The `len` bytes at `offset` were copied where [`Backend::mapped_for_write`] said: after
    /// each piece, so whatever the backend records of where data lies (allocation queries)
    /// counts them, even if a TRIM of the range ran between two pieces.
    fn wrote_mapped(&self, _offset: u64, _len: u64) {}
    /// Appends the allocation map of `offset..offset+len` (already range-checked) to `out`,
    /// coalesced, at most `max` entries (1..=[`MAX_EXTENTS`]; a prefix of the range when there
    /// are more, its last entry whole, or when the backend bounds what one query costs: `rbd:`
    /// walks at most 64 MiB; at least one entry), and never more meanwhile: the server covers the list's
    /// memory by that bound, and asks for no more than its answer can hold (NBD's REQ_ONE: 1).
    /// The default says: all data.
    fn allocation(&self, _offset: u64, len: u64, _max: usize, out: &mut Vec<Extent>) {
        out.push(Extent { len, hole: false });
    }
    /// The target is stopping and every queue of this backend has closed: make the writes it
    /// acknowledged durable and release what others wait for (`rbd:`: a final flush of
    /// librbd's cache, then the image's exclusive lock and watch), waiting for it, within a
    /// bounded time (a few of the backend's own timeouts). The backend may refuse queues and
    /// resizes from then on. `Err` is one line saying what was not done, to log. The default
    /// has nothing to do: files and memory keep nothing back from the kernel (dropping the
    /// backend releases the rest).
    fn shutdown(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A queue's private handle on a backend. Never shared between threads.
pub trait QueueIo {
    /// True when `start` always returns `Done`: the caller may then read straight into its
    /// reply buffer instead of a pooled one.
    fn completes_inline(&self) -> bool;

    /// Starts `op`, which the generic layer has already range-checked. `tag` comes back with
    /// the result: as the user data of every io_uring entry pushed, or from [`QueueIo::reap`].
    ///
    /// # Safety
    /// A READ's `buf` must be valid for writes of `len` bytes, and a WRITE's for reads of `len`
    /// bytes, from this call until the operation's result is delivered (returned as `Done`,
    /// reaped from the ring, or handed over by `reap`); nobody else may access a READ buffer
    /// meanwhile.
    unsafe fn start(&mut self, op: Op, tag: u64, sq: &mut dyn Submitter) -> Started;

    /// For backends that complete on their own threads: a descriptor that becomes readable when
    /// [`QueueIo::reap`] has results. The queue thread watches it in its own ring.
    fn notifier(&self) -> Option<RawFd> {
        None
    }

    /// Hands over the results of operations that started `Async`: `(tag, result)` each.
    fn reap(&mut self, _done: &mut dyn FnMut(u64, i32)) {}

    /// True when READ and WRITE may complete on the backend's own threads (through the
    /// notifier), not only inline or on the ring. The default: whenever there is a notifier.
    fn data_on_own_threads(&self) -> bool {
        self.notifier().is_some()
    }

    /// Starts an allocation query of `offset..offset+len` (range-checked) whose extents, at
    /// most `max`, are appended to `*out`, as [`Backend::allocation`] would, and reports 0 or a negative errno
    /// like any operation. `None`, the default, means the backend answers on the calling thread
    /// through [`Backend::allocation`]; backends whose query is slow or remote (librbd's diff
    /// iteration) run it on their own threads and return `Some(Started::Async)`. A backend whose
    /// `completes_inline` is true must answer inline here too.
    ///
    /// # Safety
    /// `out` must stay valid, and untouched by anyone else, until the result is delivered.
    unsafe fn start_allocation(
        &mut self,
        _offset: u64,
        _len: u64,
        _max: usize,
        _out: *mut Vec<Extent>,
        _tag: u64,
        _sq: &mut dyn Submitter,
    ) -> Option<Started> {
        None
    }
}
