//! Storage backends and the generic layer above them.
//!
//! A [`Backend`] is shared by every queue of an export and declares what it can do natively
//! ([`Caps`]). Each queue thread opens its own [`QueueIo`] handle, so the data path holds no locks:
//! synchronous backends (`mem:`, `null:`) complete in place; `file:` submits to the queue thread's
//! own io_uring. [`Export`] is the generic layer: it checks ranges and read-only state, and emulates
//! what a backend lacks (PROTOCOL.md §7, §10).

mod export;
mod file;
mod mem;
mod null;
mod size;

use std::io;
use std::sync::Arc;

pub use export::{push_extent, AlignedBuf, Export, ExportQueue, ExportSpec, Refusal, SpecError};
pub use file::FileBackend;
pub use mem::MemBackend;
pub use null::NullBackend;
pub use size::{format_size, parse_size};

/// What a backend does natively. The generic layer fills the gaps (see [`Export::features`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Data can be made durable (`FLUSH` means something).
    pub flush: bool,
    /// A write can be made durable on its own (forced unit access).
    pub fua: bool,
    /// Deallocation frees space.
    pub trim: bool,
    /// Ranges can be zeroed without sending zeros.
    pub write_zeroes: bool,
    /// The medium seeks (spinning disk).
    pub rotational: bool,
    /// WRITE_ZEROES is a metadata operation, never a write of zeros (NBD's FAST_ZERO).
    pub fast_zero: bool,
}

/// One run of an export's allocation map (NBD `base:allocation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Unallocated and reads as zeros.
    pub hole: bool,
}

/// Most extents one allocation query returns; the rest of the range is left to a later query.
pub const MAX_EXTENTS: usize = 1 << 16;

/// One I/O as the data path hands it to a backend. Buffers are raw because, for io_uring, they
/// must stay valid until the completion arrives: the caller (the queue) owns them until then.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    Read {
        offset: u64,
        buf: *mut u8,
        len: u32,
    },
    Write {
        offset: u64,
        buf: *const u8,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        no_hole: bool,
    },
}

/// Where a backend puts io_uring submissions: the queue thread's own ring.
pub trait Submitter {
    fn push(&mut self, entry: io_uring::squeue::Entry);
}

/// How an operation started.
#[derive(Debug, PartialEq, Eq)]
pub enum Started {
    /// Finished already: 0 or a negative errno.
    Done(i32),
    /// One io_uring entry was pushed with the given user data; its completion result is the
    /// operation's result (bytes transferred or negative errno).
    Submitted,
}

/// A storage backend, shared by all queues of an export.
pub trait Backend: Send + Sync {
    /// `file:/path`, `mem:4G` and so on: how the user named it.
    fn describe(&self) -> String;
    fn size(&self) -> u64;
    /// (logical, physical) block sizes in bytes, powers of two >= 512.
    fn block_sizes(&self) -> (u32, u32);
    fn caps(&self) -> Caps;
    /// True when every byte reads as zero right now (lets `cp` skip zero blocks).
    fn reads_as_zero(&self) -> bool;
    /// Opens the per-queue handle; called on the queue's own thread.
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>>;
    /// Buffers handed to this backend must be aligned to this (O_DIRECT), 1 otherwise.
    fn buffer_alignment(&self) -> usize {
        1
    }
    /// Appends the allocation map of `offset..offset+len` (already range-checked) to `out`,
    /// coalesced, at most [`MAX_EXTENTS`] entries. The default says: all data.
    fn allocation(&self, _offset: u64, len: u64, out: &mut Vec<Extent>) {
        out.push(Extent { len, hole: false });
    }
}

/// A queue's private handle on a backend. Never shared between threads.
pub trait QueueIo {
    /// True when `start` always returns `Done`: the caller may then read straight into its
    /// reply buffer instead of a pooled one.
    fn completes_inline(&self) -> bool;
    /// Starts `op`, which the generic layer has already range-checked.
    fn start(&mut self, op: Op, user_data: u64, sq: &mut dyn Submitter) -> Started;
}

/// Blocking helper for callers without a ring (tests, tools): runs one op to completion on a
/// private io_uring.
pub fn run_blocking(q: &mut dyn QueueIo, op: Op) -> io::Result<u32> {
    struct Collect(Vec<io_uring::squeue::Entry>);
    impl Submitter for Collect {
        fn push(&mut self, e: io_uring::squeue::Entry) {
            self.0.push(e);
        }
    }
    let mut c = Collect(Vec::new());
    let res = match q.start(op, 1, &mut c) {
        Started::Done(r) => r,
        Started::Submitted => {
            let mut ring = io_uring::IoUring::new(4)?;
            for e in &c.0 {
                // SAFETY: the op's buffers are owned by our caller and outlive this call.
                unsafe {
                    ring.submission()
                        .push(e)
                        .map_err(|_| io::Error::other("ring full"))?
                };
            }
            ring.submit_and_wait(1)?;
            let cqe = ring
                .completion()
                .next()
                .ok_or_else(|| io::Error::other("no completion"))?;
            cqe.result()
        }
    };
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as u32)
    }
}
