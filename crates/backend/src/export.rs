//! The generic layer: an export is a named backend plus policy (read-only), range checks, and
//! emulation of what the backend lacks (FUA as write then flush, WRITE_ZEROES by writes,
//! advisory TRIM, FLUSH of a volatile medium), run as small per-request step machines so that
//! emulation works the same for inline, io_uring and thread-completing backends.

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use blkwire_block::{BlockOp, BlockRequest};

use crate::{Backend, Capabilities, CopyRange, Op, QueueIo, Started, Submitter, Support};

/// `NAME=BACKEND[,ro]` as given to `serve --export`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// The name clients ask for.
    pub name: String,
    /// `KIND:ARG`, e.g. `mem:1G`.
    pub backend: String,
    /// `,ro` was given.
    pub read_only: bool,
    /// `,allow=RULE[+RULE...]`: who may open it (parsed and checked by the target, which owns
    /// access control; see `blkwire_auth::Acl`).
    pub allow: Option<String>,
}

/// A one-line reason why an export spec cannot be served.
#[derive(Debug, PartialEq, Eq)]
pub struct SpecError(pub String);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SpecError {}

fn spec_help() -> String {
    format!(
        "expected NAME=BACKEND[,ro][,allow=RULE[+RULE...]] with BACKEND one of {}",
        crate::registry::usages()
    )
}

impl ExportSpec {
    /// What follows `NAME=`: `BACKEND[,ro][,allow=RULES]`, as `parse` reads it back.
    pub fn options(&self) -> String {
        let mut s = self.backend.clone();
        if self.read_only {
            s.push_str(",ro");
        }
        if let Some(a) = &self.allow {
            s.push_str(",allow=");
            s.push_str(a);
        }
        s
    }

    /// The kind of backend the spec names ([`crate::registry`]) and its argument; an error
    /// (one line, saying what to fix) for a backend no target knows. Nothing is opened.
    pub fn kind(&self) -> Result<(&'static crate::registry::BackendKind, &str), SpecError> {
        let (scheme, arg) = self.backend.split_once(':').ok_or_else(|| {
            SpecError(format!(
                "bad backend '{}' for export '{}': {}",
                self.backend,
                self.name,
                spec_help()
            ))
        })?;
        let kind = crate::registry::find(scheme).ok_or_else(|| {
            SpecError(format!(
                "unknown backend '{scheme}' for export '{}': {}",
                self.name,
                spec_help()
            ))
        })?;
        Ok((kind, arg))
    }

    /// The spec with a `file:` path made absolute against this process's working directory:
    /// a spec is kept (`save_config`) and read again by a target that may start elsewhere
    /// (systemd runs it in `/`), and sent over the control socket to a target whose working
    /// directory is not the caller's. Other backends, and absolute paths, are unchanged.
    pub fn absolute(mut self) -> ExportSpec {
        let Some(rest) = self.backend.strip_prefix("file:") else {
            return self;
        };
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, format!("?{q}")),
            None => (rest, String::new()),
        };
        if path.is_empty() || path.starts_with('/') {
            return self;
        }
        if let Ok(abs) = std::path::absolute(path) {
            self.backend = format!("file:{}{query}", abs.display());
        }
        self
    }

    /// The spec after its export grew to `size` bytes ([`Export::resize`]), so that a saved
    /// config opens it at that size: backends whose argument is their size (`null:SIZE`) get the
    /// new size; the others (a `file:` carries its size itself) are unchanged.
    pub fn resized(&self, size: u64) -> ExportSpec {
        let mut spec = self.clone();
        if let Some((scheme, _)) = self.backend.split_once(':') {
            if crate::registry::find(scheme).is_some_and(|k| k.arg_is_size) {
                spec.backend = format!("{scheme}:{}", exact_size(size));
            }
        }
        spec
    }

    /// Parses `NAME=BACKEND[,ro][,allow=RULES]`.
    pub fn parse(s: &str) -> Result<ExportSpec, SpecError> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| SpecError(format!("bad export '{s}': {}", spec_help())))?;
        // No control characters either: names go into log lines and one-line errors (a line
        // break in one would forge a line), and into NQNs and iSCSI names.
        if name.is_empty()
            || name.len() > 255
            || name.contains(['/', ' '])
            || name.chars().any(char::is_control)
        {
            return Err(SpecError(format!(
                "bad export name '{}': use 1-255 characters without '/', spaces or control characters",
                name.escape_debug()
            )));
        }
        let mut parts = rest.split(',');
        let backend = parts.next().unwrap_or_default().to_string();
        let mut read_only = false;
        let mut allow = None;
        for opt in parts {
            match opt {
                "ro" | "readonly" => read_only = true,
                _ if opt.starts_with("allow=") => allow = Some(opt["allow=".len()..].to_string()),
                _ => {
                    return Err(SpecError(format!(
                        "bad export option '{opt}' in '{s}': known options are 'ro' and \
                         'allow=RULE[+RULE...]' (host ids, address prefixes, MACs)"
                    )))
                }
            }
        }
        if backend.is_empty() {
            return Err(SpecError(format!("bad export '{s}': {}", spec_help())));
        }
        Ok(ExportSpec {
            name: name.to_string(),
            backend,
            read_only,
            allow,
        })
    }
}

/// `size` as `parse_size` reads it back exactly: `2G` when that is exact, else the bytes.
fn exact_size(size: u64) -> String {
    let short = crate::format_size(size);
    if crate::parse_size(&short) == Ok(size) {
        short
    } else {
        size.to_string()
    }
}

/// Why an export was not resized ([`Export::resize`]); each a line that says what to do.
#[derive(Debug, PartialEq, Eq)]
pub enum ResizeError {
    /// The size asked for can never be this export's (not a multiple of the block it takes I/O in).
    BadSize(String),
    /// A valid size the export will not take: smaller than it is, or a backend that cannot
    /// grow (or failed to).
    Refused(String),
}

impl fmt::Display for ResizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResizeError::BadSize(m) | ResizeError::Refused(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ResizeError {}

/// Why the generic layer refused a request before it reached the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A modifying request on a read-only export.
    ReadOnly,
    /// The range passes the end of the export (or overflows).
    OutOfRange,
    /// The request is malformed for this export (e.g. misaligned for O_DIRECT).
    Invalid,
}

/// A named, opened export.
pub struct Export {
    /// The name clients ask for.
    pub name: String,
    /// Writes, trims and zeroing are refused.
    pub read_only: bool,
    backend: Arc<dyn Backend>,
    capabilities: Capabilities,
    /// One resize at a time, so that each checks against the size the one before it left.
    resizing: Mutex<()>,
    /// A flush, or a change that had to be durable (FUA), failed ([`Export::lose_durability`]).
    durability_lost: AtomicBool,
}

impl Export {
    /// Opens the backend a spec names, through [`crate::registry`]. Errors are one line and say
    /// what to fix.
    pub fn open(spec: &ExportSpec) -> Result<Export, SpecError> {
        let (kind, arg) = spec.kind()?;
        let backend = (kind.open)(arg, spec.read_only)
            .map_err(|e| SpecError(format!("export '{}': {e}", spec.name)))?;
        Ok(Export::new(&spec.name, backend, spec.read_only))
    }

    /// An export of an already opened backend.
    pub fn new(name: &str, backend: Arc<dyn Backend>, read_only: bool) -> Export {
        Export {
            name: name.to_string(),
            read_only,
            capabilities: Capabilities::effective(backend.capabilities()),
            backend,
            resizing: Mutex::new(()),
            durability_lost: AtomicBool::new(false),
        }
    }

    /// Records that a flush, or a change that had to be durable (FUA), failed: writes
    /// acknowledged before it may never reach the storage. Linux reports a writeback error
    /// to one fsync of each open file only, so a flush sent again (NVMe and SCSI hosts retry a
    /// failed one) would succeed over lost data; from now on every such request on the export
    /// fails instead ([`Export::durability_lost`]), until it is removed and added again.
    /// True the first time.
    pub fn lose_durability(&self) -> bool {
        !self.durability_lost.swap(true, Ordering::Relaxed)
    }

    /// Whether a flush or a durable change failed on the export ([`Export::lose_durability`]).
    /// One load of a word written once, on flushes and FUA requests only.
    pub fn durability_lost(&self) -> bool {
        self.durability_lost.load(Ordering::Relaxed)
    }

    /// The backend behind the export.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Size in bytes now: what a new session is given. It only grows ([`Export::resize`]).
    pub fn size(&self) -> u64 {
        self.backend.size()
    }

    /// Grows the export to `new_size` bytes (`export_resize`) and returns the size it had.
    /// Grow only: a session keeps the size its handshake gave it and a queue checks against
    /// that ([`Export::check_within`]), so storage must never end below a size given out. The
    /// size must be a multiple of the logical block; the same size is a no-op. Control path
    /// only: one resize at a time.
    pub fn resize(&self, new_size: u64) -> Result<u64, ResizeError> {
        let _one = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.size();
        let name = &self.name;
        let fmt = crate::format_size;
        if new_size < old {
            return Err(ResizeError::Refused(format!(
                "cannot shrink export '{name}' from {} to {}: exports only grow: a session may \
                 be using the end; remove and re-add the export to shrink",
                fmt(old),
                fmt(new_size)
            )));
        }
        // The block its I/O is taken in (HELLO, NVMe LBA, iSCSI block): sizes are whole blocks.
        let block = self.io_block();
        if !new_size.is_multiple_of(block as u64) {
            return Err(ResizeError::BadSize(format!(
                "export '{name}': {new_size} bytes is not a multiple of its {block}-byte \
                 block"
            )));
        }
        if new_size == old {
            return Ok(old);
        }
        self.backend
            .resize(new_size)
            .map_err(|e| ResizeError::Refused(format!("export '{name}': {e}")))?;
        Ok(old)
    }

    /// What the export serves, natively or emulated: what every frontend advertises.
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    /// Checks a request against the export as it is now before any backend sees it:
    /// read-only policy and bounds. `offset + len` may not overflow or pass the end.
    pub fn check(&self, modifies: bool, offset: u64, len: u64) -> Result<(), Refusal> {
        self.check_within(self.size(), modifies, offset, len)
    }

    /// As [`Export::check`] against `size`, the size a session was given (at most the
    /// export's size, which only grows): the data path's check, which reads no shared state.
    pub fn check_within(
        &self,
        size: u64,
        modifies: bool,
        offset: u64,
        len: u64,
    ) -> Result<(), Refusal> {
        if modifies && self.read_only {
            return Err(Refusal::ReadOnly);
        }
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Refusal::OutOfRange),
        }
    }

    /// Checks a COPY of `sources` (in order) to consecutive bytes from `dst`: a writable export,
    /// 1 to `max_copy_ranges` non-empty sources inside it, at most `max_copy_bytes` in all, a
    /// destination inside it that overlaps no source. Returns the bytes to copy.
    pub fn check_copy(&self, sources: &[CopyRange], dst: u64) -> Result<u64, Refusal> {
        self.check_copy_from(self, sources, dst)
    }

    /// Checks a COPY into this export of `sources` of `src` (this export or another one of the
    /// same target), as [`Export::check_copy`]; sources overlapping the destination matter only
    /// when both are this export or share its storage (`Backend::storage`: a file given to two
    /// exports). Both are checked against their sizes now: exports only grow,
    /// so a range inside one stays inside.
    pub fn check_copy_from(
        &self,
        src: &Export,
        sources: &[CopyRange],
        dst: u64,
    ) -> Result<u64, Refusal> {
        self.check_copy_within(self.size(), src, sources, dst)
    }

    /// As [`Export::check_copy_from`] with this export bounded by `size`, the size a session
    /// was given (as [`Export::check_within`]): the destination, and the sources when `src` is
    /// this export, lie within it; another export's sources within that export's size now.
    /// Aligned as READ and WRITE must be ([`Export::alignment`], O_DIRECT): each source's
    /// offset to the source's alignment, the destination offset to this export's, and each
    /// source's length to both (the destination of each range starts where the one before
    /// ended), so no read or write of the copy fails with EINVAL after others were written.
    pub fn check_copy_within(
        &self,
        size: u64,
        src: &Export,
        sources: &[CopyRange],
        dst: u64,
    ) -> Result<u64, Refusal> {
        if self.read_only {
            return Err(Refusal::ReadOnly);
        }
        let limits = self.capabilities.limits;
        if sources.is_empty() || sources.len() > limits.max_copy_ranges as usize {
            return Err(Refusal::Invalid);
        }
        let same = std::ptr::eq(self, src);
        let src_size = if same { size } else { src.size() };
        let (dst_align, src_align) = (self.alignment(), src.alignment());
        let mut total = 0u64;
        for r in sources {
            if r.len == 0 {
                return Err(Refusal::Invalid);
            }
            src.check_within(src_size, false, r.offset, r.len as u64)?;
            if !r.offset.is_multiple_of(src_align)
                || !(r.len as u64).is_multiple_of(src_align.max(dst_align))
            {
                return Err(Refusal::Invalid);
            }
            total += r.len as u64;
        }
        if total > limits.max_copy_bytes {
            return Err(Refusal::Invalid);
        }
        self.check_within(size, true, dst, total)?;
        if !dst.is_multiple_of(dst_align) {
            return Err(Refusal::Invalid);
        }
        let dst_end = dst + total;
        // The same storage under two exports (a file given twice, a disk and its partition)
        // overlaps as one export's, where their bytes lie in it.
        let starts = match (self.backend.storage(), src.backend.storage()) {
            _ if same => Some((0, 0)),
            (Some(d), Some(s)) if d.name == s.name => Some((d.start, s.start)),
            _ => None,
        };
        if let Some((dst_start, src_start)) = starts {
            let (dst, dst_end) = (
                u128::from(dst) + u128::from(dst_start),
                u128::from(dst_end) + u128::from(dst_start),
            );
            let overlaps = |r: &CopyRange| {
                let at = u128::from(r.offset) + u128::from(src_start);
                at < dst_end && dst < at + u128::from(r.len)
            };
            if sources.iter().any(overlaps) {
                return Err(Refusal::Invalid);
            }
        }
        Ok(total)
    }

    /// The size in whole blocks of `io_block`, what a session is told: a direct=1 block
    /// device of 512-byte sectors may end in part of a page, which no I/O of whole pages
    /// reaches (NVMe/TCP's and iSCSI's block counts leave it out too).
    pub fn served_size(&self) -> u64 {
        let block = u64::from(self.io_block());
        self.size() / block * block
    }

    /// READ and WRITE must start and end on this boundary (O_DIRECT backends); 1 otherwise.
    pub fn alignment(&self) -> u64 {
        self.backend.buffer_alignment().max(1) as u64
    }

    /// The block the export takes I/O in: its logical block, or its alignment where that is
    /// larger (an O_DIRECT export of a 512-byte-sector device takes whole pages). What the
    /// native HELLO, NVMe/TCP's LBA and iSCSI's block announce, so no client is told a block it
    /// would have refused.
    pub fn io_block(&self) -> u32 {
        let (logical, _) = self.backend.block_sizes();
        logical.max(u32::try_from(self.alignment()).unwrap_or(u32::MAX))
    }

    /// Opens the per-queue handle, wrapped in the emulation layer.
    pub fn open_queue(&self) -> io::Result<ExportQueue> {
        Ok(ExportQueue {
            backend: self.backend.clone(),
            io: self.backend.clone().open_queue()?,
            caps: self.capabilities,
            zero_align: self.backend.buffer_alignment().max(4096),
            zeros: None,
            steps: Vec::new(),
            reaped: Vec::new(),
            failed_copies: Vec::new(),
            failed_flushes: Vec::new(),
            flushes: Flushes::default(),
            spare_sources: Vec::new(),
        })
    }
}

/// How far an operation got when it was started or one of its completions came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Finished: bytes transferred (READ/WRITE), 0, or a negative errno.
    Done(i32),
    /// More completions are to come (from the ring, or from [`ExportQueue::reap`]).
    Pending,
}

/// Bytes of zeros written per step when WRITE_ZEROES is emulated.
const ZERO_CHUNK: u32 = 1 << 20;
/// Bytes moved per backend operation of a COPY (the bounce buffer's size when emulated): the
/// most memory one COPY in flight holds, which callers count against their budgets.
pub const COPY_CHUNK: u32 = 1 << 20;
/// A COPY gives its thread back (an io_uring NOP, then it goes on) after this many bytes, so
/// that a long copy on a backend that completes inline (`mem:`) does not hold up the other
/// queues of its reactor: about a millisecond of memcpy.
const COPY_YIELD_AFTER: u32 = 8 * COPY_CHUNK;
/// The most bytes one backend operation of a TRIM or WRITE_ZEROES covers on a queue whose
/// backend completes inline, which works on the calling thread (a reactor's): `mem:` writes
/// allocated zeros with a memset and frees punched pages one by one, up to 4 GiB in one request
/// (a 1 GiB punch of written pages took 200 ms). Longer ones run in pieces of this size and give
/// the thread back between them, as a COPY does: about a millisecond or two each.
pub const INLINE_PIECE: u64 = COPY_YIELD_AFTER as u64;

/// Where a COPY is.
struct CopyState {
    ranges: Vec<CopyRange>,
    /// The range being copied, and how far into it.
    idx: usize,
    at: u32,
    /// Where the next chunk lands, and where the first one did.
    dst: u64,
    first_dst: u64,
    /// Bytes the operation now running moves (the result must say as much).
    chunk: u32,
    /// Emulation: the chunk was read into `bounce` and must be written next.
    read_done: bool,
    /// Where the bytes come from. Declared before `bounce` so it is dropped first: a source
    /// queue that reads on its own threads finishes the read it was given (into `bounce`)
    /// before it is gone.
    source: CopySource,
    /// Emulation only: the chunk between its read and its write.
    bounce: Option<AlignedBuf>,
    /// FUA: the destination is flushed once everything is copied.
    flush: bool,
    /// The bounce buffer's alignment: what both exports' backends need (O_DIRECT).
    align: usize,
    /// Bytes moved since the copy last gave its thread back.
    since_yield: u32,
    /// The next operation, held while the copy waits for its NOP to come back.
    parked: Option<Op>,
    /// A read of `source` runs on that backend's own threads: the copy waits for a one-shot
    /// io_uring poll on the source's notifier (tagged like the copy), then reaps the read's
    /// result from the source.
    awaiting_source: bool,
}

/// Where a COPY's bytes come from.
enum CopySource {
    /// This export.
    Own,
    /// Another export whose descriptor this backend copies from itself ([`Op::CopyFrom`]): the
    /// descriptor, and its backend, held so it stays open.
    Fd { fd: RawFd, _open: Arc<dyn Backend> },
    /// Another export, read on a queue of its backend; with the export, to keep the queue for
    /// the next copy from there (`ExportQueue::spare_sources`).
    Queue(Weak<Export>, Box<dyn QueueIo>),
}

impl CopyState {
    /// The queue the reads go to, for a copy from another export read through one.
    fn source_queue(&mut self) -> Option<&mut Box<dyn QueueIo>> {
        match &mut self.source {
            CopySource::Queue(_, q) => Some(q),
            _ => None,
        }
    }

    /// The notifier of a source whose reads complete on its own threads.
    fn source_notifier(&self) -> Option<RawFd> {
        match &self.source {
            CopySource::Queue(_, q) => q.notifier(),
            _ => None,
        }
    }

    /// The result of the source read started with `tag`, if the source has handed it over.
    fn reap_source(&mut self, tag: u64) -> Option<i32> {
        let mut got = None;
        if let Some(q) = self.source_queue() {
            // The source queue is the copy's own: one read at a time is all it runs.
            q.reap(&mut |t, r| {
                if t == tag {
                    got = Some(r);
                }
            });
        }
        got
    }
}

/// A one-shot poll for readability of `fd`, completing with `tag`.
fn poll_entry(fd: RawFd, tag: u64) -> io_uring::squeue::Entry {
    io_uring::opcode::PollAdd::new(io_uring::types::Fd(fd), libc::POLLIN as u32)
        .build()
        .user_data(tag)
}

/// What happens when the backend operation now running for a request completes.
enum Next {
    /// Its result is the request's result.
    Report,
    /// FUA emulated: a flush follows the operation (a WRITE without native FUA, a TRIM or
    /// WRITE_ZEROES, which no backend makes durable by itself) once it succeeded.
    FlushAfter,
    /// The flush of an emulated FUA: the result before it is the request's result.
    ReportFlushed(i32),
    /// WRITE_ZEROES by writes: `at..end` is still to be zeroed, then a flush if `flush` (FUA);
    /// the write before wrote `wrote` bytes (less: the zeroing failed).
    Zero {
        at: u64,
        end: u64,
        flush: bool,
        wrote: u32,
    },
    /// A native TRIM or WRITE_ZEROES longer than the backend takes at once: `at..end` is left,
    /// in pieces of at most `limit` bytes, then a flush if `flush` (FUA).
    Split {
        zero: bool,
        no_hole: bool,
        fast: bool,
        at: u64,
        end: u64,
        limit: u64,
        flush: bool,
    },
    /// A COPY, chunk by chunk: natively, or by a read then a write through a bounce buffer.
    Copy(Box<CopyState>),
    /// The request gave its thread back behind a NOP (a TRIM or WRITE_ZEROES in pieces on an
    /// inline backend): when the NOP completes, the operation runs, then what follows it.
    Resume(Op, Box<Next>),
    /// The request's flush was another's (see [`Flushes`]), which returned the result here;
    /// a NOP brings it back to the request, which goes on as after a flush of its own.
    Flushed(i32, Box<Next>),
}

/// The queue's flushes, one in the backend at a time. Two flushes running at once on one open
/// file may split a writeback error between them: the kernel reports it to the first to
/// look, and the other says OK (errseq, "fsync: report errors to every fd", per open file),
/// which may be answered before the failing one latches the export (PROTOCOL.md §10).
/// Flushes asked for while one runs wait, then share the next one, which starts after each
/// of them was asked for and so covers whatever they must make durable.
#[derive(Default)]
struct Flushes {
    /// The tag of the request whose flush is in the backend.
    running: Option<u64>,
    /// Requests whose flush is the running one's, and what each does after it.
    sharing: Vec<(u64, Next)>,
    /// Requests that asked for a flush while one ran: the next one is theirs.
    waiting: Vec<(u64, Next)>,
}

/// A request whose backend operations are still running.
struct Step {
    tag: u64,
    /// Completions still expected for the running operation (several ring entries).
    pending: u8,
    /// The first entry's result, unless a later one failed.
    result: Option<i32>,
    next: Next,
}

/// A queue's handle on an export: the backend's own handle plus emulation of missing
/// capabilities.
pub struct ExportQueue {
    backend: Arc<dyn Backend>,
    io: Box<dyn QueueIo>,
    caps: Capabilities,
    zero_align: usize,
    /// Source of emulated WRITE_ZEROES, allocated on first use.
    zeros: Option<AlignedBuf>,
    /// Requests made of several backend operations (or ring entries), by tag. Empty on the
    /// fast path, so a plain completion costs one emptiness check.
    steps: Vec<Step>,
    /// Scratch for [`ExportQueue::reap`] (no allocation per batch).
    reaped: Vec<(u64, i32)>,
    /// COPYs that failed, by tag: the bytes from their destination offset known to be copied,
    /// until [`ExportQueue::copied_before_failure`] takes them.
    failed_copies: Vec<(u64, u64)>,
    /// Requests whose own flush (an emulated FUA's, after their change) failed, by tag, until
    /// [`ExportQueue::flush_failed`] takes them: whatever the errno, writes acknowledged
    /// before may be lost, which no error of the change itself says.
    failed_flushes: Vec<u64>,
    /// The flush in the backend and the requests waiting for the next.
    flushes: Flushes,
    /// Queues on other exports' backends that finished copies left idle, by export, for the
    /// next copy from there: opening one may cost a descriptor or a thread (`memthread:`). The
    /// export is held weakly: its allocation stays while the entry does, so no export made
    /// later is taken for it by its address (a `null:` queue holds nothing of its backend),
    /// and once it is gone its queue goes too, at this queue's next request
    /// ([`ExportQueue::drop_gone_sources`]), with the descriptor, thread or open image it holds.
    spare_sources: Vec<(Weak<Export>, Box<dyn QueueIo>)>,
}

/// Idle source queues an export queue keeps for its next copies from other exports.
const SPARE_SOURCES: usize = 2;

impl ExportQueue {
    /// Drops the spare source queues whose exports are gone: an `rbd:` image removed from the
    /// target stays open (its watch and lock held) as long as a queue of it does. Cheap while
    /// there are none, which is every queue that never copied from another export. Called at
    /// each request, and by the reactor at its idle ticks for queues that make none.
    pub fn drop_gone_sources(&mut self) {
        if !self.spare_sources.is_empty() {
            self.spare_sources.retain(|(e, _)| e.strong_count() > 0);
        }
    }

    /// True while the queue keeps spare source queues (of exports that may be removed).
    pub fn holds_spare_sources(&self) -> bool {
        !self.spare_sources.is_empty()
    }

    /// True when the backend completes inline: every operation but a long TRIM or
    /// WRITE_ZEROES finishes inside [`ExportQueue::start`] (emulation on an inline backend
    /// finishes inline too: its steps run one after another in the call). See
    /// [`ExportQueue::finishes_in_start`].
    pub fn completes_inline(&self) -> bool {
        self.io.completes_inline()
    }

    /// True when a request of `op` over `len` bytes finishes inside [`ExportQueue::start`]:
    /// on an inline backend, all but a native TRIM or WRITE_ZEROES longer than one piece
    /// ([`INLINE_PIECE`], or less where the backend takes less), which gives the thread back
    /// between its pieces and completes through [`ExportQueue::complete`].
    pub fn finishes_in_start(&self, op: BlockOp, len: u32) -> bool {
        self.completes_inline() && self.finishes_whole(op, len)
    }

    /// True when a request of `op` over `len` bytes is not split in pieces.
    fn finishes_whole(&self, op: BlockOp, len: u32) -> bool {
        self.piece(op).is_none_or(|p| len as u64 <= p)
    }

    /// The most bytes one backend operation of a native TRIM or WRITE_ZEROES covers on this
    /// queue (`None`: not split: other requests, advisory TRIM, zeroing by writes).
    fn piece(&self, op: BlockOp) -> Option<u64> {
        let (support, limit) = match op {
            BlockOp::Trim => (self.caps.trim, self.caps.limits.max_trim_bytes),
            BlockOp::WriteZeroes => (self.caps.write_zeroes, self.caps.limits.max_zero_bytes),
            _ => return None,
        };
        if support != Support::Native {
            return None;
        }
        // Whole sectors, so that pieces cut on its multiples fall on block boundaries.
        let limit = (limit / 512).max(1) * 512;
        Some(if self.io.completes_inline() {
            limit.min(INLINE_PIECE)
        } else {
            limit
        })
    }

    /// What the export serves (see [`Export::capabilities`]).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Where a READ of `offset..offset+len` (already checked) finds its bytes in memory, valid
    /// as long as this queue lives ([`Backend::mapped`]; the queue holds the backend).
    pub fn mapped(&self, offset: u64, len: u64) -> Option<*const u8> {
        self.backend.mapped(offset, len)
    }

    /// Where a WRITE of `offset..offset+len` (already checked) may copy its bytes as they
    /// arrive, valid as long as this queue lives ([`Backend::mapped_for_write`]).
    pub fn mapped_for_write(&self, offset: u64, len: u64) -> Option<*mut u8> {
        self.backend.mapped_for_write(offset, len)
    }

    /// A piece of such a WRITE was copied there ([`Backend::wrote_mapped`]).
    pub fn wrote_mapped(&self, offset: u64, len: u64) {
        self.backend.wrote_mapped(offset, len)
    }

    /// For backends that complete on their own threads: the descriptor to watch; call
    /// [`ExportQueue::reap`] when it is readable.
    pub fn notifier(&self) -> Option<RawFd> {
        self.io.notifier()
    }

    /// Starts an already checked request. What the backend lacks is emulated here:
    /// - FLUSH of a volatile medium (no flush) completes at once;
    /// - TRIM without native support is advisory and completes at once;
    /// - FUA without native support is a write, then a flush (without flush it is meaningless);
    /// - FUA on TRIM and WRITE_ZEROES is the operation, then a flush (an advisory TRIM changed
    ///   nothing, so it has nothing to make durable);
    /// - WRITE_ZEROES without native support writes zeros, 1 MiB at a time;
    /// - TRIM and WRITE_ZEROES longer than the backend takes at once run in pieces; on an
    ///   inline backend in pieces of at most [`INLINE_PIECE`], with the thread given back (a NOP
    ///   in the ring) between them, so one request does not hold up its reactor.
    ///
    /// Ring entries carry `tag` as user data; feed their completions to
    /// [`ExportQueue::complete`].
    ///
    /// # Safety
    /// As [`QueueIo::start`]: the buffer of a READ or WRITE must stay valid (and a READ's
    /// untouched) until the request's result is delivered by this call, by `complete`, or by
    /// `reap`.
    pub unsafe fn start(&mut self, op: Op, tag: u64, sq: &mut dyn Submitter) -> Progress {
        self.drop_gone_sources();
        let caps = self.caps;
        // No backend makes a TRIM or WRITE_ZEROES durable by itself: FUA on one is a flush once
        // it is done, and the backend never sees the flag. Without flush the medium is
        // volatile and FUA meaningless.
        let durable = caps.flush == Support::Native;
        let (op, flush) = match op {
            Op::Trim { offset, len, fua } => (
                Op::Trim {
                    offset,
                    len,
                    fua: false,
                },
                fua && durable,
            ),
            Op::WriteZeroes {
                offset,
                len,
                no_hole,
                fast,
                fua,
            } => (
                Op::WriteZeroes {
                    offset,
                    len,
                    no_hole,
                    fast,
                    fua: false,
                },
                fua && durable,
            ),
            op => (op, false),
        };
        let (op, next) = match op {
            Op::Flush if caps.flush == Support::None => return Progress::Done(0),
            Op::Trim { .. } if caps.trim != Support::Native => return Progress::Done(0),
            Op::Write {
                offset,
                buf,
                len,
                fua: true,
            } if caps.fua != Support::Native => {
                let write = Op::Write {
                    offset,
                    buf,
                    len,
                    fua: false,
                };
                let next = if caps.fua == Support::Emulated {
                    Next::FlushAfter
                } else {
                    Next::Report
                };
                (write, next)
            }
            // Writing zeros is not fast (admission refuses FAST_ZERO where the backend does
            // not claim it; this keeps the promise whatever the caller checked).
            Op::WriteZeroes { fast: true, .. } if caps.write_zeroes != Support::Native => {
                return Progress::Done(-libc::EOPNOTSUPP)
            }
            Op::WriteZeroes { offset, len, .. } if caps.write_zeroes != Support::Native => {
                let end = offset + len as u64;
                match self.follow(
                    tag,
                    Next::Zero {
                        at: offset,
                        end,
                        flush,
                        wrote: 0,
                    },
                    0,
                ) {
                    Ok(step) => step,
                    Err(r) => return Progress::Done(r),
                }
            }
            Op::Trim { offset, len, .. } if !self.finishes_whole(BlockOp::Trim, len) => {
                let split = Next::Split {
                    zero: false,
                    no_hole: false,
                    fast: false,
                    at: offset,
                    end: offset + len as u64,
                    limit: self.piece(BlockOp::Trim).expect("native"),
                    flush,
                };
                match self.follow(tag, split, 0) {
                    Ok(step) => step,
                    Err(r) => return Progress::Done(r),
                }
            }
            Op::WriteZeroes {
                offset,
                len,
                no_hole,
                fast,
                ..
            } if !self.finishes_whole(BlockOp::WriteZeroes, len) => {
                let split = Next::Split {
                    zero: true,
                    no_hole,
                    fast,
                    at: offset,
                    end: offset + len as u64,
                    limit: self.piece(BlockOp::WriteZeroes).expect("native"),
                    flush,
                };
                match self.follow(tag, split, 0) {
                    Ok(step) => step,
                    Err(r) => return Progress::Done(r),
                }
            }
            op if flush => (op, Next::FlushAfter),
            op => (op, Next::Report),
        };
        // SAFETY: our caller's contract covers `op`'s buffer; emulation only adds operations on
        // our own zero buffer, which lives as long as `self`.
        unsafe { self.drive(op, tag, next, sq) }
    }

    /// Starts an allocation query of `offset..offset+len` (range-checked): its extents are
    /// appended to `*out`, coalesced, at most `max` (1..=[`crate::MAX_EXTENTS`]). Answered on this thread
    /// unless the backend runs queries on its own threads (then `Pending`, with the result, 0
    /// or a negative errno, from [`ExportQueue::reap`]).
    ///
    /// # Safety
    /// `out` must stay valid, and untouched by anyone else, until the result is delivered.
    pub unsafe fn start_allocation(
        &mut self,
        offset: u64,
        len: u64,
        max: usize,
        out: *mut Vec<crate::Extent>,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Progress {
        let max = max.clamp(1, crate::MAX_EXTENTS);
        // SAFETY: passed on from our caller.
        match unsafe { self.io.start_allocation(offset, len, max, out, tag, sq) } {
            None => {
                // SAFETY: our caller vouches for `out`, and nothing else holds it.
                self.backend
                    .allocation(offset, len, max, unsafe { &mut *out });
                Progress::Done(0)
            }
            Some(Started::Done(r)) => Progress::Done(r),
            Some(Started::Submitted(n)) => self.wait_for(tag, n, Next::Report),
            Some(Started::Async) => Progress::Pending,
        }
    }

    /// Starts a COPY of `sources` (in order) to consecutive bytes from `dst`, already checked
    /// with [`Export::check_copy`]. Natively where the backend can, else by reads and writes
    /// through a bounce buffer of the request's own, inside the target. With `fua` the export
    /// is flushed once everything is copied, and a failed flush fails the copy. Completions and
    /// the result (0 or a negative errno) come as for [`ExportQueue::start`].
    pub fn start_copy(
        &mut self,
        sources: &[CopyRange],
        dst: u64,
        fua: bool,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Progress {
        self.run_copy(sources, CopySource::Own, self.zero_align, dst, fua, tag, sq)
    }

    /// Starts a COPY into this queue's export of `sources` of another export `src` of the same
    /// target, checked with [`Export::check_copy_from`]: by reads on a queue of `src`'s backend
    /// (opened for this copy) and writes on this one, inside the target. A source whose reads
    /// complete on its own threads is awaited through a one-shot io_uring poll on its notifier,
    /// whose completion comes with the copy's tag like any other. `fua` as for
    /// [`ExportQueue::start_copy`]: this export is flushed.
    pub fn start_copy_from(
        &mut self,
        src: &Arc<Export>,
        sources: &[CopyRange],
        dst: u64,
        fua: bool,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Progress {
        // Straight from the source's file or memfd where this backend can (one copy, in the
        // kernel, or shared extents).
        if let Some(fd) = src
            .backend()
            .copy_source_fd()
            .filter(|&fd| self.backend.copies_from_fd(fd))
        {
            let from = CopySource::Fd {
                fd,
                _open: src.backend().clone(),
            };
            return self.run_copy(sources, from, self.zero_align, dst, fua, tag, sq);
        }
        // The others are matched to the source by address: each entry's Weak keeps its
        // export's allocation, so no other export can be at that address.
        self.drop_gone_sources();
        let spare = self
            .spare_sources
            .iter()
            .position(|(e, _)| std::ptr::eq(e.as_ptr(), Arc::as_ptr(src)));
        let source = match spare.map(|i| self.spare_sources.swap_remove(i).1) {
            Some(q) => q,
            None => match src.backend().clone().open_queue() {
                Ok(q) if !q.data_on_own_threads() || q.notifier().is_some() => q,
                // Reads that complete elsewhere, with nothing to say when: cannot be awaited.
                Ok(_) => return Progress::Done(-libc::EOPNOTSUPP),
                Err(e) => return Progress::Done(-e.raw_os_error().unwrap_or(libc::EIO)),
            },
        };
        let align = self.zero_align.max(src.backend().buffer_alignment());
        let source = CopySource::Queue(Arc::downgrade(src), source);
        self.run_copy(sources, source, align, dst, fua, tag, sq)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_copy(
        &mut self,
        sources: &[CopyRange],
        source: CopySource,
        align: usize,
        dst: u64,
        fua: bool,
        tag: u64,
        sq: &mut dyn Submitter,
    ) -> Progress {
        let state = CopyState {
            ranges: sources.to_vec(),
            idx: 0,
            at: 0,
            dst,
            first_dst: dst,
            chunk: 0,
            read_done: false,
            bounce: None,
            flush: fua && self.caps.flush == Support::Native,
            source,
            align,
            since_yield: 0,
            parked: None,
            awaiting_source: false,
        };
        match self.follow(tag, Next::Copy(Box::new(state)), 0) {
            Err(r) => Progress::Done(r),
            // SAFETY: every operation of a copy works on the export and on the bounce buffer
            // its step owns, which lives until the step is done.
            Ok((op, next)) => unsafe { self.drive(op, tag, next, sq) },
        }
    }

    /// How many bytes from its destination offset the COPY started with `tag`, which finished
    /// with an error, is known to have copied (PROTOCOL.md §13: the reply's length); bytes past
    /// them are unchanged or partly copied. 0 when nothing is known (it failed before it began).
    pub fn copied_before_failure(&mut self, tag: u64) -> u64 {
        match self.failed_copies.iter().position(|&(t, _)| t == tag) {
            Some(i) => self.failed_copies.swap_remove(i).1,
            None => 0,
        }
    }

    /// Whether the request started with `tag`, which finished with an error, failed in the
    /// flush that made it durable (an emulated FUA's), not in its change. Asked once.
    pub fn flush_failed(&mut self, tag: u64) -> bool {
        match self.failed_flushes.iter().position(|&t| t == tag) {
            Some(i) => {
                self.failed_flushes.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// A ring completion for `tag`: the request's result when it is finished, `None` while more
    /// is to come.
    pub fn complete(&mut self, tag: u64, res: i32, sq: &mut dyn Submitter) -> Option<i32> {
        let Some(i) = self.steps.iter().position(|s| s.tag == tag) else {
            // One entry, its result the request's (a flush's too: those sharing it go on).
            if self.flushes.running == Some(tag) {
                self.flush_finished(res, sq);
            }
            return Some(res);
        };
        let s = &mut self.steps[i];
        s.result = match s.result {
            None => Some(res),
            Some(first) if first >= 0 && res < 0 => Some(res),
            kept => kept,
        };
        s.pending -= 1;
        if s.pending > 0 {
            return None;
        }
        let mut s = self.steps.swap_remove(i);
        let mut res = s.result.unwrap_or(res);
        if self.flushes.running == Some(tag) {
            // The flush's last entry: its result is the one it shares.
            self.flush_finished(res, sq);
        }
        // A copy's poll on its source's notifier came back: the read's result is the source's.
        if let Next::Copy(st) = &mut s.next {
            if st.awaiting_source && res < 0 {
                // The poll failed (the ring is going away): the copy fails; dropping it waits
                // for the source's read (see `CopyState::source`).
                st.awaiting_source = false;
            } else if st.awaiting_source {
                match st.reap_source(tag) {
                    Some(r) => {
                        st.awaiting_source = false;
                        res = r;
                    }
                    None => {
                        // Woken before the result was posted: wait again.
                        let fd = st
                            .source_notifier()
                            .expect("awaited sources have a notifier");
                        sq.push(poll_entry(fd, tag));
                        self.steps.push(Step {
                            tag,
                            pending: 1,
                            result: None,
                            next: s.next,
                        });
                        return None;
                    }
                }
            }
        }
        match self.follow(tag, s.next, res) {
            Err(r) => Some(r),
            // SAFETY: the follow-up belongs to a request started through `start`, whose caller
            // keeps its buffer valid until the result is delivered, which has not happened yet.
            Ok((op, next)) => match unsafe { self.drive(op, tag, next, sq) } {
                Progress::Done(r) => Some(r),
                Progress::Pending => None,
            },
        }
    }

    /// Collects results of operations that run on the backend's own threads and hands over
    /// each finished request's `(tag, result)`.
    pub fn reap(&mut self, sq: &mut dyn Submitter, done: &mut dyn FnMut(u64, i32)) {
        let mut reaped = std::mem::take(&mut self.reaped);
        self.io.reap(&mut |tag, res| reaped.push((tag, res)));
        for &(tag, res) in &reaped {
            if let Some(r) = self.complete(tag, res, sq) {
                done(tag, r);
            }
        }
        reaped.clear();
        self.reaped = reaped;
    }

    /// Starts backend operations for `tag` until one is left running or the request finished.
    ///
    /// # Safety
    /// `op`'s buffer must stay valid until the request's result is delivered.
    unsafe fn drive(
        &mut self,
        mut op: Op,
        tag: u64,
        mut next: Next,
        sq: &mut dyn Submitter,
    ) -> Progress {
        loop {
            // A long copy gives the thread back now and then: the operation waits behind a NOP,
            // whose completion (through `complete`) takes it up again.
            if let Next::Copy(st) = &mut next {
                if st.since_yield >= COPY_YIELD_AFTER {
                    st.since_yield = 0;
                    st.parked = Some(op);
                    sq.push(io_uring::opcode::Nop::new().build().user_data(tag));
                    return self.wait_for(tag, 1, next);
                }
            }
            // A copy's read from another export goes to its queue there.
            let from_source = matches!(
                &next,
                Next::Copy(st) if st.read_done && matches!(st.source, CopySource::Queue(..))
            );
            let flush = matches!(op, Op::Flush) && !from_source;
            if flush && self.flushes.running.is_some() {
                self.flushes.waiting.push((tag, next));
                return Progress::Pending;
            }
            let io = match &mut next {
                Next::Copy(st) if from_source => st.source_queue().expect("checked"),
                _ => &mut self.io,
            };
            // SAFETY: passed on from our caller.
            let started = unsafe { io.start(op, tag, sq) };
            if flush && !matches!(started, Started::Done(_)) {
                self.flushes.running = Some(tag);
            }
            let res = match started {
                Started::Done(r) => r,
                Started::Submitted(n) => return self.wait_for(tag, n, next),
                Started::Async if from_source => {
                    // Nobody watches the source's notifier but this copy: poll it once.
                    if let Next::Copy(st) = &mut next {
                        let fd = st.source_notifier().expect("checked when the copy began");
                        st.awaiting_source = true;
                        sq.push(poll_entry(fd, tag));
                    }
                    return self.wait_for(tag, 1, next);
                }
                Started::Async => return self.wait_for(tag, 1, next),
            };
            let piece = matches!(next, Next::Split { .. });
            match self.follow(tag, next, res) {
                Err(r) => return Progress::Done(r),
                // A piece that ran on this thread: the next waits behind a NOP, so the thread
                // serves others meanwhile (`INLINE_PIECE`).
                Ok((o, n @ Next::Split { .. })) if piece => {
                    sq.push(io_uring::opcode::Nop::new().build().user_data(tag));
                    return self.wait_for(tag, 1, Next::Resume(o, Box::new(n)));
                }
                Ok((o, n)) => (op, next) = (o, n),
            }
        }
    }

    /// The running flush returned `res`: the requests sharing it go on with it (behind a NOP
    /// each, as their results come out of [`ExportQueue::complete`] one by one), and those
    /// that waited share the next, started now.
    fn flush_finished(&mut self, res: i32, sq: &mut dyn Submitter) {
        self.flushes.running = None;
        for (tag, next) in std::mem::take(&mut self.flushes.sharing) {
            self.resume_after_flush(tag, next, res, sq);
        }
        let mut waiting = std::mem::take(&mut self.flushes.waiting).into_iter();
        let Some((first, next)) = waiting.next() else {
            return;
        };
        // SAFETY: flushes carry no buffer.
        match unsafe { self.io.start(Op::Flush, first, sq) } {
            Started::Done(r) => {
                // Finished at once: every one of them goes on with its result.
                for (tag, next) in std::iter::once((first, next)).chain(waiting) {
                    self.resume_after_flush(tag, next, r, sq);
                }
            }
            started => {
                let n = match started {
                    Started::Submitted(n) => n,
                    _ => 1,
                };
                self.flushes.running = Some(first);
                self.flushes.sharing.extend(waiting);
                self.wait_for(first, n, next);
            }
        }
    }

    /// Brings `res`, a flush's result, back to request `tag` behind a NOP.
    fn resume_after_flush(&mut self, tag: u64, next: Next, res: i32, sq: &mut dyn Submitter) {
        sq.push(io_uring::opcode::Nop::new().build().user_data(tag));
        self.steps.push(Step {
            tag,
            pending: 1,
            result: None,
            next: Next::Flushed(res, Box::new(next)),
        });
    }

    fn wait_for(&mut self, tag: u64, pending: u8, next: Next) -> Progress {
        // One entry whose result is the answer needs no bookkeeping: `complete` passes it on.
        if pending > 1 || !matches!(next, Next::Report) {
            self.steps.push(Step {
                tag,
                pending: pending.max(1),
                result: None,
                next,
            });
        }
        Progress::Pending
    }

    /// [`ExportQueue::after`], remembering how far a COPY got when it fails
    /// ([`ExportQueue::copied_before_failure`]).
    fn follow(&mut self, tag: u64, next: Next, res: i32) -> Result<(Op, Next), i32> {
        // The NOP after a flush run for others came back: the flush's result is this one's.
        if let Next::Flushed(flushed, next) = next {
            return self.follow(tag, *next, flushed);
        }
        // A FUA copy that fails copied nothing known durable: no flush ran over the chunks
        // before the failure (PROTOCOL.md §13: its reply says 0 bytes).
        let copied = match &next {
            Next::Copy(st) if st.flush => Some(0),
            Next::Copy(st) => Some(st.dst - st.first_dst),
            _ => None,
        };
        if res < 0 && matches!(next, Next::ReportFlushed(_)) {
            self.failed_flushes.push(tag);
        }
        let out = self.after(next, res);
        if let (Err(r), Some(copied)) = (&out, copied) {
            if *r < 0 {
                self.failed_copies.push((tag, copied));
            }
        }
        out
    }

    /// What follows a backend result `res`: the next operation, or the request's result.
    fn after(&mut self, next: Next, res: i32) -> Result<(Op, Next), i32> {
        match next {
            Next::Report => Err(res),
            // (`follow` takes these apart first, to see a failed flush.)
            Next::Flushed(flushed, next) => self.after(*next, flushed),
            _ if res < 0 => Err(res),
            Next::Resume(op, then) => Ok((op, *then)),
            Next::Copy(st) => self.copy_step(st, res),
            Next::Split { at, end, flush, .. } if at >= end => then_flush(flush, 0),
            Next::Split {
                zero,
                no_hole,
                fast,
                at,
                end,
                limit,
                flush,
            } => {
                // Pieces end on multiples of the limit (the first may be shorter): a backend
                // that acts only on whole blocks or pages inside each piece (BLKDISCARD, `mem:`
                // freeing pages) would otherwise leave out the one each boundary cuts.
                let len = (end - at).min(limit - at % limit) as u32;
                let op = if zero {
                    Op::WriteZeroes {
                        offset: at,
                        len,
                        no_hole,
                        fast,
                        fua: false,
                    }
                } else {
                    Op::Trim {
                        offset: at,
                        len,
                        fua: false,
                    }
                };
                let next = Next::Split {
                    zero,
                    no_hole,
                    fast,
                    at: at + len as u64,
                    end,
                    limit,
                    flush,
                };
                Ok((op, next))
            }
            Next::FlushAfter => then_flush(true, res),
            Next::ReportFlushed(before) => Err(before),
            // Short: part of the range keeps its old bytes, as a short WRITE found no space.
            Next::Zero { wrote, .. } if res as u32 != wrote => Err(-libc::ENOSPC),
            Next::Zero { at, end, flush, .. } if at >= end => then_flush(flush, 0),
            Next::Zero { at, end, flush, .. } => {
                let len = (end - at).min(ZERO_CHUNK as u64) as u32;
                let align = self.zero_align;
                let zeros = self
                    .zeros
                    .get_or_insert_with(|| AlignedBuf::zeroed(ZERO_CHUNK as usize, align));
                let write = Op::Write {
                    offset: at,
                    buf: zeros.as_mut_ptr(),
                    len,
                    fua: false,
                };
                Ok((
                    write,
                    Next::Zero {
                        at: at + len as u64,
                        end,
                        flush,
                        wrote: len,
                    },
                ))
            }
        }
    }

    /// The next operation of a COPY after one that returned `res` (>= 0).
    fn copy_step(&mut self, mut st: Box<CopyState>, res: i32) -> Result<(Op, Next), i32> {
        if let Some(op) = st.parked.take() {
            return Ok((op, Next::Copy(st))); // the NOP came back: go on where it stopped
        }
        if res as u32 != st.chunk {
            // Short inside the export: a read (its file shrank under us) is an I/O error, a
            // write (or a native copy) found no space, as a short WRITE does.
            return Err(if st.read_done {
                -libc::EIO
            } else {
                -libc::ENOSPC
            });
        }
        if st.read_done {
            // Emulation: the chunk is in the bounce buffer; write it.
            st.read_done = false;
            let buf = st
                .bounce
                .as_mut()
                .expect("emulated copies have a bounce buffer");
            let write = Op::Write {
                offset: st.dst,
                buf: buf.as_mut_ptr(),
                len: st.chunk,
                fua: false,
            };
            return Ok((write, Next::Copy(st)));
        }
        st.at += st.chunk;
        st.dst += st.chunk as u64;
        st.since_yield += st.chunk;
        while st.idx < st.ranges.len() && st.at >= st.ranges[st.idx].len {
            st.idx += 1;
            st.at = 0;
        }
        let Some(r) = st.ranges.get(st.idx).copied() else {
            // Done, nothing running on the source: keep its queue for the next copy.
            if let CopySource::Queue(e, q) = std::mem::replace(&mut st.source, CopySource::Own) {
                self.drop_gone_sources();
                // Only a queue kept makes room: one of a source removed meanwhile goes alone.
                if e.strong_count() > 0 {
                    if self.spare_sources.len() == SPARE_SOURCES {
                        self.spare_sources.remove(0);
                    }
                    self.spare_sources.push((e, q));
                }
            }
            // A failed flush fails the copy with nothing known copied (`follow` records a
            // count only while the copy itself runs): nothing is known durable.
            return then_flush(st.flush, 0);
        };
        let src = r.offset + st.at as u64;
        st.chunk = (r.len - st.at).min(COPY_CHUNK);
        let native = match &st.source {
            CopySource::Fd { fd, .. } => Some(Op::CopyFrom {
                fd: *fd,
                src,
                dst: st.dst,
                len: st.chunk,
            }),
            CopySource::Own if self.caps.copy == Support::Native => Some(Op::Copy {
                src,
                dst: st.dst,
                len: st.chunk,
            }),
            _ => None,
        };
        if let Some(copy) = native {
            return Ok((copy, Next::Copy(st)));
        }
        st.read_done = true;
        let align = st.align;
        let buf = st
            .bounce
            .get_or_insert_with(|| AlignedBuf::zeroed(COPY_CHUNK as usize, align));
        let read = Op::Read {
            offset: src,
            buf: buf.as_mut_ptr(),
            len: st.chunk,
        };
        Ok((read, Next::Copy(st)))
    }

    /// Reads `buf.len()` bytes at `offset` to completion (for callers outside the data path).
    pub fn read_blocking(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let req = BlockRequest::new(BlockOp::Read, offset, len32(buf.len())?);
        let op = Op::for_request(&req, buf.as_mut_ptr());
        // SAFETY: `buf` is borrowed for this whole call, and `blocking` returns only once the
        // result is delivered (or before anything reached the kernel).
        let n = self.blocking(|q, sq| unsafe { q.start(op, BLOCKING_TAG, sq) })?;
        // Short: the rest of `buf` holds what it held, not the export's bytes.
        if n as usize != buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read {n} of {} bytes at {offset}", buf.len()),
            ));
        }
        Ok(())
    }

    /// Writes `data` at `offset` to completion, durably first if `fua`.
    pub fn write_blocking(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let req = BlockRequest::new(BlockOp::Write, offset, len32(data.len())?).flagged(if fua {
            crate::IoFlags::FUA
        } else {
            crate::IoFlags::empty()
        });
        // The backend only reads a WRITE's buffer.
        let op = Op::for_request(&req, data.as_ptr().cast_mut());
        // SAFETY: as in read_blocking.
        let n = self.blocking(|q, sq| unsafe { q.start(op, BLOCKING_TAG, sq) })?;
        if n as usize != data.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("wrote {n} of {} bytes at {offset}", data.len()),
            ));
        }
        Ok(())
    }

    /// Copies `sources` to `dst` to completion (checked with [`Export::check_copy`] first).
    pub fn copy_blocking(&mut self, sources: &[CopyRange], dst: u64) -> io::Result<()> {
        self.blocking(|q, sq| q.start_copy(sources, dst, false, BLOCKING_TAG, sq))
            .map(drop)
    }

    /// The allocation map of `offset..offset+len` (range-checked), however the backend answers.
    pub fn allocation_blocking(&mut self, offset: u64, len: u64) -> io::Result<Vec<crate::Extent>> {
        let mut out = Vec::new();
        let p: *mut Vec<crate::Extent> = &mut out;
        // SAFETY: `out` lives until this function returns, which `blocking` does only once the
        // result is delivered; nothing else touches it meanwhile.
        self.blocking(|q, sq| unsafe {
            q.start_allocation(offset, len, crate::MAX_EXTENTS, p, BLOCKING_TAG, sq)
        })?;
        Ok(out)
    }

    /// Runs a FLUSH, TRIM or WRITE_ZEROES to completion.
    pub fn run_blocking(&mut self, req: &BlockRequest) -> io::Result<()> {
        if req.op.moves_data() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "READ and WRITE need a buffer: use read_blocking or write_blocking",
            ));
        }
        let op = Op::for_request(req, std::ptr::null_mut());
        // SAFETY: no buffer: FLUSH, TRIM and WRITE_ZEROES name none.
        self.blocking(|q, sq| unsafe { q.start(op, BLOCKING_TAG, sq) })
            .map(drop)
    }

    /// Runs one request, started by `start` with [`BLOCKING_TAG`], to completion on a private
    /// ring or by waiting on the notifier; its result (the bytes a READ or WRITE moved). Never
    /// returns while the request may still touch a buffer once anything reached the kernel or
    /// the backend's threads.
    fn blocking(
        &mut self,
        start: impl FnOnce(&mut Self, &mut dyn Submitter) -> Progress,
    ) -> io::Result<i32> {
        let r = self.blocking_run(start);
        if r.is_err() {
            // Given up (no ring, or it failed): nothing of the request may stay behind, above
            // all not a flush taken as running, which every later flush would wait for.
            self.steps.retain(|s| s.tag != BLOCKING_TAG);
            if self.flushes.running == Some(BLOCKING_TAG) {
                self.flushes.running = None;
            }
        }
        r
    }

    fn blocking_run(
        &mut self,
        start: impl FnOnce(&mut Self, &mut dyn Submitter) -> Progress,
    ) -> io::Result<i32> {
        struct Collect(Vec<io_uring::squeue::Entry>);
        impl Submitter for Collect {
            fn push(&mut self, e: io_uring::squeue::Entry) {
                self.0.push(e);
            }
        }
        let mut sub = Collect(Vec::new());
        let mut ring: Option<io_uring::IoUring> = None;
        let mut in_ring = 0usize;
        let mut result = match start(self, &mut sub) {
            Progress::Done(r) => Some(r),
            Progress::Pending => None,
        };
        while result.is_none() {
            if !sub.0.is_empty() || in_ring > 0 {
                let ring = match ring.as_mut() {
                    Some(r) => r,
                    None => ring.insert(io_uring::IoUring::new(8)?),
                };
                for e in sub.0.drain(..) {
                    // SAFETY: the entry's buffer is ours or our caller's, valid until the
                    // result is delivered; the loop does not end before that.
                    while unsafe { ring.submission().push(&e) }.is_err() {
                        ring.submit()?;
                    }
                    in_ring += 1;
                }
                match ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
                let done: Vec<(u64, i32)> = ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                for (tag, res) in done {
                    in_ring -= 1;
                    if let Some(r) = self.complete(tag, res, &mut sub) {
                        result = Some(r);
                    }
                }
            } else if let Some(fd) = self.notifier() {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll on one descriptor the backend owns; EINTR just loops.
                unsafe { libc::poll(&mut p, 1, -1) };
                self.reap(&mut sub, &mut |_, r| result = Some(r));
            } else {
                return Err(io::Error::other(
                    "backend left an operation pending with no way to wait for it",
                ));
            }
        }
        match result {
            Some(r) if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            r => Ok(r.unwrap_or(0)),
        }
    }
}

/// The end of a request whose last operation returned `res` (>= 0): a flush first when it
/// carried FUA, whose failure fails the request; else `res` is its result.
fn then_flush(flush: bool, res: i32) -> Result<(Op, Next), i32> {
    if flush {
        Ok((Op::Flush, Next::ReportFlushed(res)))
    } else {
        Err(res)
    }
}

/// The tag of requests run by the blocking helpers (they run one at a time).
const BLOCKING_TAG: u64 = 1;

fn len32(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "buffer over 4 GiB"))
}

/// [`push_extent`] for a query that appends from `out[first..]`: false, and nothing appended,
/// when the extent would be one past `max` (at most [`crate::MAX_EXTENTS`]: the query stops
/// there, a prefix of its range). Never letting the list past the bound, not truncating it afterwards, is what
/// keeps its capacity, and the memory the server covers for it, within the bound.
pub(crate) fn push_extent_within(
    out: &mut Vec<crate::Extent>,
    first: usize,
    max: usize,
    len: u64,
    hole: bool,
) -> bool {
    let merges = len == 0 || out.last().is_some_and(|l| l.hole == hole);
    if !merges && out.len() - first >= max.min(crate::MAX_EXTENTS) {
        return false;
    }
    push_extent(out, len, hole);
    true
}

/// Appends an extent to an allocation map, merging it with the previous one when alike.
pub fn push_extent(out: &mut Vec<crate::Extent>, len: u64, hole: bool) {
    if len == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.hole == hole => last.len += len,
        _ => out.push(crate::Extent { len, hole }),
    }
}

/// WRITE_ZEROES emulation for backends that cannot zero natively: writes `zeros` repeatedly.
/// `write(buf, offset)` returns bytes written or a negative errno. Returns 0 or a negative errno.
pub(crate) fn write_zeroes_by_writing(
    mut offset: u64,
    len: u64,
    zeros: &[u8],
    mut write: impl FnMut(&[u8], u64) -> i32,
) -> i32 {
    let end = offset + len;
    while offset < end {
        let n = (end - offset).min(zeros.len() as u64) as usize;
        let r = write(&zeros[..n], offset);
        if r < 0 {
            return r;
        }
        if r == 0 {
            return -libc::EIO;
        }
        offset += r as u64;
    }
    0
}

/// A heap buffer with a chosen alignment (O_DIRECT needs block-aligned memory).
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a uniquely owned heap allocation.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes aligned to `align`.
    pub fn zeroed(len: usize, align: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), align.max(1)).expect("valid layout");
        // SAFETY: non-zero size layout.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }
    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    /// Never: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
    /// The first byte, for I/O that fills the buffer while it is not borrowed.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len())
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in zeroed() with this layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Recorder;
    use crate::{FileBackend, MemBackend};

    #[test]
    fn relative_file_paths_are_made_absolute_and_nothing_else_changes() {
        let cwd = std::env::current_dir().unwrap();
        let spec = |s: &str| ExportSpec::parse(s).unwrap().absolute().options();
        assert_eq!(
            spec("d=file:d.img?direct=1,ro,allow=10.0.0.0/8"),
            format!(
                "file:{}?direct=1,ro,allow=10.0.0.0/8",
                cwd.join("d.img").display()
            )
        );
        assert_eq!(spec("d=file:/abs/d.img"), "file:/abs/d.img");
        assert_eq!(spec("d=mem:1G"), "mem:1G");
    }

    #[test]
    fn spec_parsing() {
        assert_eq!(
            ExportSpec::parse("d=file:/x?direct=1,ro").unwrap(),
            ExportSpec {
                name: "d".into(),
                backend: "file:/x?direct=1".into(),
                read_only: true,
                allow: None,
            }
        );
        assert_eq!(
            ExportSpec::parse("d=mem:1M,allow=alice+10.0.0.0/8")
                .unwrap()
                .allow
                .as_deref(),
            Some("alice+10.0.0.0/8")
        );
        assert!(ExportSpec::parse("nobackend").is_err());
        assert!(ExportSpec::parse("=mem:1M").is_err());
        for bad in ["a\nb", "a\rb", "a\tb", "a\u{7f}b", "a\u{85}b"] {
            let e = ExportSpec::parse(&format!("{bad}=mem:1M")).unwrap_err().0;
            assert!(!e.contains(['\n', '\r']), "one line: {e}");
            assert!(e.contains("control characters"), "{e}");
        }
        assert!(ExportSpec::parse("a=mem:1M,bogus")
            .unwrap_err()
            .0
            .contains("bogus"));
        assert!(Export::open(&ExportSpec::parse("a=disk:1M").unwrap()).is_err());
        assert!(Export::open(&ExportSpec::parse("a=mem:12q").unwrap()).is_err());
        let e = Export::open(&ExportSpec::parse("a=file:/nonexistent/x").unwrap())
            .err()
            .unwrap();
        assert!(e.0.contains("no such file"), "{e}");
    }

    #[test]
    fn range_and_read_only_checks() {
        let e = Export::open(&ExportSpec::parse("a=mem:1M,ro").unwrap()).unwrap();
        assert_eq!(e.check(false, 0, 1 << 20), Ok(()));
        assert_eq!(e.check(false, 1, 1 << 20), Err(Refusal::OutOfRange));
        assert_eq!(e.check(false, u64::MAX, 2), Err(Refusal::OutOfRange));
        assert_eq!(e.check(true, 0, 512), Err(Refusal::ReadOnly));
    }

    /// `file:` grows (sparse, never cutting a file that is longer already), `null:` grows by
    /// its number; shrinking, misaligned sizes and backends that cannot grow are refused in
    /// one line, and a refusal changes nothing.
    #[test]
    fn exports_grow_and_refuse_what_they_cannot() {
        let dir = std::env::temp_dir().join(format!("blkwire-resize-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("grow.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let len = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
        let spec = ExportSpec::parse(&format!("f=file:{}", path.display())).unwrap();
        let e = Export::open(&spec).unwrap();
        // A queue opened before the resize, with data at the old end.
        let mut q = e.open_queue().unwrap();
        let before = pattern(4096, 3);
        q.write_blocking((1 << 20) - 4096, &before, false).unwrap();
        assert_eq!(e.check(false, 1 << 20, 4096), Err(Refusal::OutOfRange));
        assert_eq!(e.resize(2 << 20), Ok(1 << 20), "returns the old size");
        assert_eq!((e.size(), len(&path)), (2 << 20, 2 << 20));
        assert_eq!(e.check(false, 1 << 20, 4096), Ok(()));
        assert_eq!(
            e.check_within(1 << 20, false, 1 << 20, 4096),
            Err(Refusal::OutOfRange),
            "a session given the old size keeps it"
        );
        let after = pattern(8192, 4);
        q.write_blocking((1 << 20) - 4096, &after, false).unwrap();
        let mut back = vec![0u8; 8192];
        q.read_blocking((1 << 20) - 4096, &mut back).unwrap();
        assert!(
            back == after,
            "the new end is storage, through a queue opened before"
        );
        assert_eq!(spec.resized(2 << 20), spec, "a file carries its size");
        // Refusals: nothing changes.
        let refused = |r: Result<u64, ResizeError>, needle: &str| match r {
            Err(ResizeError::Refused(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{other:?}: expected a refusal with '{needle}'"),
        };
        refused(e.resize(1 << 20), "exports only grow");
        refused(e.resize(0), "remove and re-add the export to shrink");
        match e.resize((2 << 20) + 100) {
            Err(ResizeError::BadSize(m)) => {
                assert!(m.contains("not a multiple of its 512-byte block"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((e.size(), len(&path)), (2 << 20, 2 << 20));
        assert_eq!(e.resize(2 << 20), Ok(2 << 20), "the same size is a no-op");
        // Grown outside blkwire past the size asked for: adopted, never cut short.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        assert_eq!(e.resize(4 << 20), Ok(2 << 20));
        assert_eq!((e.size(), len(&path)), (4 << 20, 8 << 20));
        // A read-only export's file is open read-only: it grows only once the file has.
        let ro_path = dir.join("ro.img");
        std::fs::File::create(&ro_path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let ro =
            Export::open(&ExportSpec::parse(&format!("r=file:{},ro", ro_path.display())).unwrap())
                .unwrap();
        refused(ro.resize(2 << 20), "grow the file first");
        assert_eq!((ro.size(), len(&ro_path)), (1 << 20, 1 << 20));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&ro_path)
            .unwrap()
            .set_len(2 << 20)
            .unwrap();
        assert_eq!(ro.resize(2 << 20), Ok(1 << 20));
        assert_eq!(ro.size(), 2 << 20);
        std::fs::remove_dir_all(&dir).unwrap();

        // null: just the number, and the spec names it (exactly) for a saved config.
        let spec = ExportSpec::parse("n=null:1M,ro").unwrap();
        let n = Export::open(&spec).unwrap();
        assert_eq!(n.resize(3 << 30), Ok(1 << 20));
        assert_eq!(
            (n.size(), n.backend().describe()),
            (3 << 30, "null:3G".into())
        );
        refused(n.resize(2 << 30), "exports only grow");
        assert_eq!(spec.resized(3 << 30).options(), "null:3G,ro");
        assert_eq!(
            spec.resized((1 << 20) + 512).backend,
            "null:1049088",
            "1.0005M would not parse back"
        );
        let back = Export::open(&spec.resized(3 << 30)).unwrap();
        assert_eq!(back.size(), 3 << 30);

        // RAM is mapped at its size; other backends refuse by default.
        for (s, needle) in [
            (
                "m=mem:1M",
                "mem: is mapped at its size when the export is added: remove and re-add it",
            ),
            ("t=memthread:1M", "memthread: is mapped at its size"),
        ] {
            let m = Export::open(&ExportSpec::parse(s).unwrap()).unwrap();
            refused(m.resize(2 << 20), needle);
            assert_eq!(m.size(), 1 << 20);
        }
        let r = Export::new("r", Recorder::new(Capabilities::default(), false), false);
        let size = r.size();
        refused(r.resize(size * 2), "cannot be resized");
    }

    fn round_trip(spec: &str) {
        let e = Export::open(&ExportSpec::parse(spec).unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let align = e.backend().buffer_alignment().max(1);
        let mut w = AlignedBuf::zeroed(8192, align);
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        let mut r = AlignedBuf::zeroed(8192, align);
        q.write_blocking(8192, w.as_slice(), true).unwrap();
        q.run_blocking(&BlockRequest::new(BlockOp::Flush, 0, 0))
            .unwrap();
        q.read_blocking(8192, r.as_mut_slice()).unwrap();
        assert_eq!(r.as_slice(), w.as_slice(), "{spec}: read back");
        q.run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 8192 + 100, 4096))
            .unwrap();
        q.read_blocking(8192, r.as_mut_slice()).unwrap();
        assert!(
            r.as_slice()[100..4196].iter().all(|b| *b == 0),
            "{spec}: zeroed"
        );
        assert_eq!(
            r.as_slice()[..100],
            w.as_slice()[..100],
            "{spec}: before zero range kept"
        );
        assert_eq!(
            r.as_slice()[4196..],
            w.as_slice()[4196..],
            "{spec}: after zero range kept"
        );
        q.run_blocking(&BlockRequest::new(BlockOp::Trim, 0, 1 << 20))
            .unwrap();
    }

    #[test]
    fn mem_backend_round_trip_and_sparseness() {
        round_trip("m=mem:1M");
        let m = MemBackend::new(1 << 30).unwrap();
        assert_eq!(m.resident_bytes(), 0);
        assert!(m.reads_as_zero());
    }

    /// `mem:` shows a READ where its bytes lie only when every page of it was written (and not
    /// trimmed since): a hole read through the mapping would be allocated by the read.
    #[test]
    fn mem_backend_maps_only_ranges_without_holes() {
        let e = Export::open(&ExportSpec::parse("m=mem:4M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let data: Vec<u8> = (0..(1 << 20) + 4096).map(|i| (i % 253) as u8).collect();
        q.write_blocking(0, &data, false).unwrap();
        let p = q.mapped(4096, 1 << 20).expect("written pages are mapped");
        // SAFETY: 1 MiB of the export's mapping, which the queue keeps.
        let shown = unsafe { std::slice::from_raw_parts(p, 1 << 20) };
        assert!(shown == &data[4096..], "the mapping holds what was written");
        assert!(
            q.mapped(1 << 20, 8192).is_none(),
            "the second page is a hole"
        );
        assert!(q.mapped(3 << 20, 4096).is_none());
        assert!(q.mapped(2 << 20, 1 << 20).is_none());
        q.run_blocking(&BlockRequest::new(BlockOp::Trim, 8192, 4096))
            .unwrap();
        assert!(
            q.mapped(4096, 1 << 20).is_none(),
            "a trimmed page inside the range"
        );
        assert!(q.mapped(12288, 4096).is_some());
        let mut extents = Vec::new();
        e.backend()
            .allocation(2 << 20, 1 << 20, crate::MAX_EXTENTS, &mut extents);
        assert_eq!(
            extents,
            [crate::Extent {
                len: 1 << 20,
                hole: true
            }],
            "asking allocates nothing"
        );
        let f = Export::open(&ExportSpec::parse("m=memthread:1M").unwrap()).unwrap();
        let fq = f.open_queue().unwrap();
        assert!(fq.mapped(0, 4096).is_none(), "only mem: shows its memory");
    }

    #[test]
    fn memthread_backend_completes_on_its_helper_thread() {
        round_trip("m=memthread:1M");
        let e = Export::open(&ExportSpec::parse("m=memthread:1M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        assert!(!q.completes_inline() && q.notifier().is_some());
        // An allocation query also runs on the helper thread: Pending, then reaped.
        q.write_blocking(8192, &[1u8; 4096], false).unwrap();
        struct NoRing;
        impl Submitter for NoRing {
            fn push(&mut self, _: io_uring::squeue::Entry) {
                panic!("memthread uses no ring")
            }
        }
        let mut out = Vec::new();
        // SAFETY: `out` outlives the query, whose result is reaped below before it is read.
        let p =
            unsafe { q.start_allocation(0, 1 << 20, crate::MAX_EXTENTS, &mut out, 5, &mut NoRing) };
        assert_eq!(p, Progress::Pending);
        let mut got = None;
        while got.is_none() {
            let mut pfd = libc::pollfd {
                fd: q.notifier().unwrap(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one descriptor the backend owns.
            unsafe { libc::poll(&mut pfd, 1, 5000) };
            q.reap(&mut NoRing, &mut |t, r| got = Some((t, r)));
        }
        assert_eq!(got, Some((5, 0)));
        let data: Vec<_> = out.iter().filter(|x| !x.hole).collect();
        assert_eq!(data.len(), 1, "{out:?}");
        assert_eq!(out.iter().map(|x| x.len).sum::<u64>(), 1 << 20);
        assert_eq!(q.allocation_blocking(0, 1 << 20).unwrap(), out);
    }

    fn flush_only() -> Capabilities {
        Capabilities {
            flush: Support::Native,
            write_zeroes: Support::Native,
            ..Capabilities::default()
        }
    }

    #[test]
    fn fua_on_a_flush_only_backend_is_a_write_then_a_flush() {
        for asynchronous in [false, true] {
            let b = Recorder::new(flush_only(), asynchronous);
            let e = Export::new("t", b.clone(), false);
            assert_eq!(e.capabilities().fua, Support::Emulated);
            let mut q = e.open_queue().unwrap();
            q.write_blocking(4096, &[5u8; 4096], true).unwrap();
            q.write_blocking(8192, &[6u8; 512], false).unwrap();
            assert_eq!(
                b.log(),
                [
                    "write 4096+4096 fua=false",
                    "flush",
                    "write 8192+512 fua=false"
                ],
                "asynchronous={asynchronous}"
            );
        }
    }

    #[test]
    fn an_emulated_fua_write_fails_when_its_flush_fails() {
        let b = Recorder::new(flush_only(), true);
        b.fail_flush
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut q = Export::new("t", b.clone(), false).open_queue().unwrap();
        let err = q.write_blocking(0, &[1u8; 512], true).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
        assert_eq!(b.log(), ["write 0+512 fua=false", "flush"]);
    }

    #[test]
    fn the_data_path_reports_an_emulated_fua_write_once_its_flush_completed() {
        let b = Recorder::new(flush_only(), true);
        let mut q = Export::new("t", b.clone(), false).open_queue().unwrap();
        let data = [3u8; 1024];
        struct NoRing;
        impl Submitter for NoRing {
            fn push(&mut self, _: io_uring::squeue::Entry) {
                panic!("this backend uses no ring")
            }
        }
        let op = Op::Write {
            offset: 0,
            buf: data.as_ptr(),
            len: 1024,
            fua: true,
        };
        // SAFETY: `data` outlives every completion collected below.
        assert_eq!(unsafe { q.start(op, 7, &mut NoRing) }, Progress::Pending);
        let mut got = Vec::new();
        // The write's completion starts the flush: no result yet.
        q.reap(&mut NoRing, &mut |t, r| got.push((t, r)));
        assert_eq!(got, []);
        assert_eq!(b.log(), ["write 0+1024 fua=false", "flush"]);
        q.reap(&mut NoRing, &mut |t, r| got.push((t, r)));
        assert_eq!(got, [(7, 1024)], "the write's byte count, after the flush");
    }

    /// A queue has one flush in the backend at a time; flushes asked for meanwhile wait, then
    /// share the next (two at once on one open file could split a writeback error between
    /// them, and the one told OK be answered first: see `Flushes`).
    #[test]
    fn flushes_run_one_at_a_time_and_those_asked_for_meanwhile_share_the_next() {
        for fail in [false, true] {
            let caps = Capabilities {
                trim: Support::Native,
                ..flush_only()
            };
            let b = Recorder::new(caps, true);
            b.fail_flush
                .store(fail, std::sync::atomic::Ordering::Relaxed);
            let want = if fail { -libc::EIO } else { 0 };
            let mut q = Export::new("t", b.clone(), false).open_queue().unwrap();
            let mut sq = Collect(Vec::new());
            let trim = Op::Trim {
                offset: 0,
                len: 4096,
                fua: true,
            };
            // SAFETY: trims and flushes carry no buffer.
            unsafe {
                assert_eq!(q.start(trim, 3, &mut sq), Progress::Pending);
                assert_eq!(q.start(Op::Flush, 1, &mut sq), Progress::Pending);
                assert_eq!(q.start(Op::Flush, 2, &mut sq), Progress::Pending);
            }
            assert_eq!(b.log(), ["trim 0+4096", "flush"], "flush 2 waits for 1");
            let mut got = Vec::new();
            // The trim's flush waits too; flush 1's end starts one flush for both.
            q.reap(&mut sq, &mut |t, r| got.push((t, r)));
            assert_eq!(got, [(1, want)]);
            assert_eq!(b.log(), ["trim 0+4096", "flush", "flush"]);
            q.reap(&mut sq, &mut |t, r| got.push((t, r)));
            assert_eq!(got, [(1, want), (2, want)]);
            // The trim sharing flush 2 has its result behind a NOP.
            assert_eq!(sq.0.drain(..).collect::<Vec<_>>(), [3]);
            assert_eq!(q.complete(3, 0, &mut sq), Some(want), "fail={fail}");
            assert_eq!(q.flush_failed(3), fail, "the trim's own flush failed");
            assert_eq!(b.log().len(), 3, "three durable requests, two flushes");
            assert!(q.steps.is_empty() && q.flushes.running.is_none());
            // Idle again: a flush starts at once.
            // SAFETY: as above.
            assert_eq!(unsafe { q.start(Op::Flush, 4, &mut sq) }, Progress::Pending);
            assert_eq!(b.log().len(), 4);
        }
    }

    #[test]
    fn trims_and_zeroing_longer_than_the_backend_takes_are_split() {
        for asynchronous in [false, true] {
            let mut caps = Capabilities {
                trim: Support::Native,
                write_zeroes: Support::Native,
                ..Capabilities::default()
            };
            caps.limits.max_trim_bytes = 4096;
            caps.limits.max_zero_bytes = 8192;
            let b = Recorder::new(caps, asynchronous);
            let mut q = Export::new("t", b.clone(), false).open_queue().unwrap();
            q.run_blocking(&BlockRequest::new(BlockOp::Trim, 512, 10000))
                .unwrap();
            q.run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 0, 8192))
                .unwrap();
            q.run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 0, 8193))
                .unwrap();
            assert_eq!(
                b.log(),
                [
                    "trim 512+3584",
                    "trim 4096+4096",
                    "trim 8192+2320",
                    "zero 0+8192",
                    "zero 0+8192",
                    "zero 8192+1",
                ],
                "asynchronous={asynchronous}"
            );
        }
    }

    /// A FUA TRIM or WRITE_ZEROES run in pieces, or zeroed by writes, is flushed once, after
    /// its last piece.
    #[test]
    fn fua_on_split_or_emulated_zeroing_is_one_flush_at_the_end() {
        use crate::IoFlags;
        for asynchronous in [false, true] {
            let mut caps = flush_only();
            caps.trim = Support::Native;
            caps.limits.max_trim_bytes = 4096;
            caps.limits.max_zero_bytes = 4096;
            let b = Recorder::new(caps, asynchronous);
            let mut q = Export::new("t", b.clone(), false).open_queue().unwrap();
            for op in [BlockOp::Trim, BlockOp::WriteZeroes] {
                let req = BlockRequest::new(op, 0, 8192).flagged(IoFlags::FUA);
                q.run_blocking(&req).unwrap();
            }
            let flush = Capabilities {
                flush: Support::Native,
                ..Capabilities::default()
            };
            let emulated = Recorder::new(flush, asynchronous);
            let mut eq = Export::new("e", emulated.clone(), false)
                .open_queue()
                .unwrap();
            let req = BlockRequest::new(BlockOp::WriteZeroes, 0, 4096).flagged(IoFlags::FUA);
            eq.run_blocking(&req).unwrap();
            assert_eq!(
                b.log(),
                [
                    "trim 0+4096",
                    "trim 4096+4096",
                    "flush",
                    "zero 0+4096",
                    "zero 4096+4096",
                    "flush"
                ],
                "asynchronous={asynchronous}"
            );
            assert_eq!(emulated.log(), ["write 0+4096 fua=false", "flush"]);
        }
    }

    #[test]
    fn write_zeroes_without_native_support_writes_zeros_in_chunks() {
        for asynchronous in [false, true] {
            let b = Recorder::new(Capabilities::default(), asynchronous);
            let e = Export::new("t", b.clone(), false);
            assert_eq!(e.capabilities().write_zeroes, Support::Emulated);
            assert_eq!(e.capabilities().flush, Support::None);
            let mut q = e.open_queue().unwrap();
            // Emulation on an inline backend finishes inline: its steps run in the call.
            assert_eq!(q.completes_inline(), !asynchronous);
            let len = ZERO_CHUNK * 2 + 4096;
            q.run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 512, len))
                .unwrap();
            let data = b.data.lock().unwrap().clone();
            assert!(data[512..512 + len as usize].iter().all(|&x| x == 0));
            assert_eq!(data[511], 0xaa);
            assert_eq!(data[512 + len as usize], 0xaa);
            // Writing zeros is not fast: a FAST_ZERO is refused, nothing written.
            let mut fast = BlockRequest::new(BlockOp::WriteZeroes, 0, 4096);
            fast.flags = crate::IoFlags::FAST_ZERO;
            let e = q.run_blocking(&fast).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
            let mb = ZERO_CHUNK as u64;
            assert_eq!(
                b.log(),
                [
                    format!("write 512+{mb} fua=false"),
                    format!("write {}+{mb} fua=false", 512 + mb),
                    format!("write {}+4096 fua=false", 512 + 2 * mb),
                ]
            );
            // TRIM and FLUSH have nothing to do here: they never reach the backend.
            q.run_blocking(&BlockRequest::new(BlockOp::Trim, 0, 4096))
                .unwrap();
            q.run_blocking(&BlockRequest::new(BlockOp::Flush, 0, 0))
                .unwrap();
            assert_eq!(b.log().len(), 3);
            // A short write leaves old bytes behind: the zeroing fails (no space, as a short
            // WRITE), and so do a short READ and WRITE of the blocking helpers.
            b.short.store(1000, std::sync::atomic::Ordering::Relaxed);
            let e = q
                .run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 0, 4096))
                .unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            let e = q.read_blocking(0, &mut [0u8; 4096]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
            let e = q.write_blocking(0, &[0u8; 4096], false).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::WriteZero, "{e}");
            b.short.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// Three sources copied to one destination, read back, on a backend: the destination holds
    /// the sources in order, and nothing around it changed.
    fn copy_round_trip(q: &mut ExportQueue, e: &Export) {
        let a = pattern(4096, 1);
        let b = pattern(COPY_CHUNK as usize + 8192, 2); // more than one chunk
        let c = pattern(512, 3);
        q.write_blocking(0, &a, false).unwrap();
        q.write_blocking(1 << 20, &b, false).unwrap();
        q.write_blocking(3 << 20, &c, false).unwrap();
        let sources = [
            CopyRange {
                offset: 0,
                len: 4096,
            },
            CopyRange {
                offset: 1 << 20,
                len: b.len() as u32,
            },
            CopyRange {
                offset: 3 << 20,
                len: 512,
            },
        ];
        let dst = 4 << 20;
        let total = e.check_copy(&sources, dst).unwrap();
        assert_eq!(total, (a.len() + b.len() + c.len()) as u64);
        q.copy_blocking(&sources, dst).unwrap();
        let mut back = vec![0u8; total as usize + 512];
        q.read_blocking(dst - 256, &mut back).unwrap();
        let want: Vec<u8> = [&a[..], &b[..], &c[..]].concat();
        assert!(
            back[256..256 + total as usize] == want[..],
            "copied data differs"
        );
        assert!(
            back[..256].iter().all(|&x| x == back[0]),
            "bytes before the destination kept"
        );
    }

    /// Tags of the entries an operation submitted (its NOPs).
    struct Collect(Vec<u64>);
    impl Submitter for Collect {
        fn push(&mut self, e: io_uring::squeue::Entry) {
            self.0.push(e.get_user_data());
        }
    }

    /// Completes each NOP an operation of tag 42 hands its thread back through (one at a time,
    /// with its tag) until it is done: what it ended with, and how many times it yielded.
    fn run_yields(
        q: &mut ExportQueue,
        sq: &mut Collect,
        mut progress: Progress,
    ) -> (Progress, u32) {
        let mut yields = 0;
        while progress == Progress::Pending {
            assert_eq!(
                sq.0.drain(..).collect::<Vec<_>>(),
                [42],
                "one NOP, with the tag"
            );
            yields += 1;
            progress = match q.complete(42, 0, sq) {
                Some(r) => Progress::Done(r),
                None => Progress::Pending,
            };
        }
        (progress, yields)
    }

    /// A copy longer than `COPY_YIELD_AFTER` on an inline backend does not run to the end
    /// inside `start_copy`: it hands its thread back through a NOP, goes on when the NOP
    /// completes, and copies everything.
    #[test]
    fn a_long_copy_on_an_inline_backend_gives_its_thread_back() {
        let len = 3 * COPY_YIELD_AFTER; // 24 MiB: two yields
        let e = Export::open(&ExportSpec::parse("m=mem:64M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let data = pattern(len as usize, 5);
        q.write_blocking(0, &data, false).unwrap();
        let sources = [CopyRange { offset: 0, len }];
        let dst = 32 << 20;
        e.check_copy(&sources, dst).unwrap();
        let mut sq = Collect(Vec::new());
        let progress = q.start_copy(&sources, dst, false, 42, &mut sq);
        let (progress, yields) = run_yields(&mut q, &mut sq, progress);
        assert_eq!(progress, Progress::Done(0));
        assert_eq!(yields, 2, "24 MiB in 8 MiB stretches");
        let mut back = vec![0u8; len as usize];
        q.read_blocking(dst, &mut back).unwrap();
        assert!(back == data, "the copy is whole");
    }

    /// A TRIM or WRITE_ZEROES longer than `INLINE_PIECE` on an inline backend (`mem:`, which
    /// memsets allocated zeros and frees punched pages on the calling thread) runs one piece of
    /// at most that per call: it hands the thread back through a NOP between pieces, goes on
    /// when the NOP completes, and zeroes everything. One whole 4 GiB request used to run in
    /// `start`, holding up every connection of the reactor.
    #[test]
    fn long_zeroing_on_an_inline_backend_runs_in_pieces_and_gives_its_thread_back() {
        let piece = INLINE_PIECE as usize;
        let len = 2 * piece + 4096;
        let e = Export::open(&ExportSpec::parse("m=mem:64M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let data = pattern(len + 8192, 9);
        assert!(q.finishes_in_start(BlockOp::WriteZeroes, piece as u32));
        assert!(!q.finishes_in_start(BlockOp::WriteZeroes, len as u32));
        assert!(!q.finishes_in_start(BlockOp::Trim, len as u32));
        assert!(q.finishes_in_start(BlockOp::Write, 1 << 20));
        let allocated = Op::WriteZeroes {
            offset: 4096,
            len: len as u32,
            no_hole: true,
            fast: false,
            fua: false,
        };
        let trim = Op::Trim {
            offset: 4096,
            len: len as u32,
            fua: false,
        };
        for op in [allocated, trim] {
            q.write_blocking(0, &data, false).unwrap();
            let mut sq = Collect(Vec::new());
            // SAFETY: neither names a buffer.
            let progress = unsafe { q.start(op, 42, &mut sq) };
            assert_eq!(progress, Progress::Pending, "{op:?}");
            // Only the first piece ran in `start`, up to the first multiple of a piece.
            let mut back = vec![0u8; len + 8192];
            q.read_blocking(0, &mut back).unwrap();
            assert!(back[4096..piece].iter().all(|&b| b == 0));
            assert!(back[piece..] == data[piece..], "{op:?}");
            let (progress, yields) = run_yields(&mut q, &mut sq, progress);
            assert_eq!(progress, Progress::Done(0));
            assert_eq!(yields, 2, "{op:?}: 8 MiB less 4 KiB, 8 MiB, then 8 KiB");
            q.read_blocking(0, &mut back).unwrap();
            assert!(back[..4096] == data[..4096]);
            assert!(back[4096..4096 + len].iter().all(|&b| b == 0), "{op:?}");
            assert!(back[4096 + len..] == data[4096 + len..]);
        }
        // The same request through the blocking helper (its private ring takes the NOPs).
        q.run_blocking(&BlockRequest::new(BlockOp::WriteZeroes, 0, len as u32))
            .unwrap();
    }

    #[test]
    fn copy_is_native_on_mem_and_file_and_emulated_elsewhere() {
        let m = Export::open(&ExportSpec::parse("m=mem:8M").unwrap()).unwrap();
        assert_eq!(m.capabilities().copy, Support::Native);
        copy_round_trip(&mut m.open_queue().unwrap(), &m);

        let dir = std::env::temp_dir().join(format!("blkwire-copy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let f = Export::open(&ExportSpec::parse(&format!("f=file:{}", path.display())).unwrap())
            .unwrap();
        assert_eq!(f.capabilities().copy, Support::Native);
        copy_round_trip(&mut f.open_queue().unwrap(), &f);
        std::fs::remove_dir_all(&dir).unwrap();

        for asynchronous in [false, true] {
            let b = Recorder::new(Capabilities::default(), asynchronous);
            let e = Export::new("t", b.clone(), false);
            assert_eq!(e.capabilities().copy, Support::Emulated);
            copy_round_trip(&mut e.open_queue().unwrap(), &e);
            let log = b.log();
            assert!(
                !log.iter().any(|l| l.starts_with("copy")),
                "emulated: {log:?}"
            );
            // 4 KiB, then 1 MiB + 8 KiB in two chunks, then 512 B: each a read and a write.
            let reads = log.iter().filter(|l| l.starts_with("read")).count();
            assert_eq!(reads, 4 + 1, "{log:?}"); // + the read-back
        }
        let b = Recorder::new(
            Capabilities {
                copy: Support::Native,
                ..Capabilities::default()
            },
            true,
        );
        let e = Export::new("t", b.clone(), false);
        copy_round_trip(&mut e.open_queue().unwrap(), &e);
        let copies = b.log().iter().filter(|l| l.starts_with("copy")).count();
        assert_eq!(copies, 4, "native copies go to the backend in chunks");
    }

    #[test]
    fn copy_between_exports_reads_there_and_writes_here() {
        let dir = std::env::temp_dir().join(format!("blkwire-xcopy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("src.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let file = Arc::new(
            Export::open(&ExportSpec::parse(&format!("f=file:{}", path.display())).unwrap())
                .unwrap(),
        );
        let mem = Export::open(&ExportSpec::parse("m=mem:4M").unwrap()).unwrap();
        let a = pattern(COPY_CHUNK as usize + 4096, 9);
        file.open_queue()
            .unwrap()
            .write_blocking(8192, &a, false)
            .unwrap();
        let sources = [
            CopyRange {
                offset: 8192,
                len: a.len() as u32,
            },
            CopyRange {
                offset: 8192,
                len: 512,
            },
        ];
        // The same range twice, onto offset 0 of the other export: no overlap across exports.
        assert_eq!(
            mem.check_copy_from(&file, &sources, 0),
            Ok(a.len() as u64 + 512)
        );
        assert_eq!(
            file.check_copy(&sources, 0),
            Err(Refusal::Invalid),
            "within one export the destination overlaps the sources"
        );
        // The same file under another name (a second export of it, by a link): its storage,
        // so overlapping ranges are refused as within one export; apart, they copy.
        let link = path.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(&path, &link).unwrap();
        let twin = Export::open(&ExportSpec::parse(&format!("t=file:{}", link.display())).unwrap())
            .unwrap();
        std::fs::remove_file(&link).unwrap();
        assert_eq!(
            twin.check_copy_from(&file, &sources, 4096),
            Err(Refusal::Invalid),
            "the same file's bytes overlap across exports"
        );
        let far = 8192 + 2 * COPY_CHUNK as u64;
        assert_eq!(
            twin.check_copy_from(&file, &sources, far),
            Ok(a.len() as u64 + 512)
        );
        let mut q = mem.open_queue().unwrap();
        // file: reads go to the ring; collect them through the blocking helper's private ring
        // by running the copy there.
        q.blocking(|q, sq| q.start_copy_from(&file, &sources, 0, false, BLOCKING_TAG, sq))
            .unwrap();
        let mut back = vec![0u8; a.len() + 512];
        q.read_blocking(0, &mut back).unwrap();
        assert!(back[..a.len()] == a[..] && back[a.len()..] == a[..512]);
        // A source whose reads complete on its own threads: each read is awaited by a poll of
        // its notifier (through the blocking helper's ring here), and its queue is kept for the
        // next copy from it.
        let threaded =
            Arc::new(Export::open(&ExportSpec::parse("t=memthread:4M").unwrap()).unwrap());
        let data: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        threaded
            .open_queue()
            .unwrap()
            .write_blocking(0, &data, false)
            .unwrap();
        for _ in 0..2 {
            let whole = [CopyRange {
                offset: 0,
                len: data.len() as u32,
            }];
            q.blocking(|q, sq| q.start_copy_from(&threaded, &whole, 4096, false, BLOCKING_TAG, sq))
                .unwrap();
            let kept = q
                .spare_sources
                .iter()
                .filter(|(e, _)| std::ptr::eq(e.as_ptr(), Arc::as_ptr(&threaded)))
                .count();
            assert_eq!(kept, 1, "the source queue is kept, once");
        }
        let mut back = vec![0u8; data.len()];
        q.read_blocking(4096, &mut back).unwrap();
        assert!(back == data, "copied from the threaded source");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `mem:` destination completes inline, on the reactor: it copies straight from another
    /// `mem:` export's memfd there, but a `file:` source (whose `pread` could hang on a slow
    /// filesystem) is read on a queue of its own, through the ring, and the copy waits for it.
    #[test]
    fn a_mem_destination_reads_only_memory_inline() {
        // The source must be a file on a disk: tmpfs files take seals as memfds do (and copy
        // inline, from memory). /tmp is tmpfs on many systems.
        let on_disk = |d: &std::path::Path| {
            let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: an all-zero statfs is a valid value; statfs writes into ours.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: a NUL-terminated path and a statfs we own.
            let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
            r == 0 && st.f_type != libc::TMPFS_MAGIC
        };
        let base = [
            std::env::temp_dir(),
            "/var/tmp".into(),
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
        ]
        .into_iter()
        .find(|d| on_disk(d))
        .expect("a directory on a disk filesystem: the temporary directory, /var/tmp and target/ are all tmpfs");
        let dir = base.join(format!("blkwire-memfrom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("src.img");
        let a = pattern(8192, 4);
        std::fs::write(&path, &a).unwrap();
        let file = Arc::new(
            Export::open(&ExportSpec::parse(&format!("f=file:{}", path.display())).unwrap())
                .unwrap(),
        );
        let other = Arc::new(Export::open(&ExportSpec::parse("o=mem:1M").unwrap()).unwrap());
        other
            .open_queue()
            .unwrap()
            .write_blocking(0, &a, false)
            .unwrap();
        let mem = Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap();
        let fd = |e: &Export| e.backend().copy_source_fd().unwrap();
        assert!(mem.backend().copies_from_fd(fd(&other)), "a memfd");
        assert!(!mem.backend().copies_from_fd(fd(&file)), "a regular file");
        assert!(
            file.backend().copies_from_fd(fd(&other)),
            "file: copies on its helper"
        );
        let whole = [CopyRange {
            offset: 0,
            len: 8192,
        }];
        let mut q = mem.open_queue().unwrap();
        let mut sq = Collect(Vec::new());
        assert_eq!(
            q.start_copy_from(&other, &whole, 0, false, 7, &mut sq),
            Progress::Done(0),
            "from a memfd: inline"
        );
        assert!(sq.0.is_empty());
        assert_eq!(
            q.start_copy_from(&file, &whole, 65536, false, 8, &mut sq),
            Progress::Pending,
            "from a file: not inline"
        );
        assert_eq!(sq.0, [8], "the file's read, on the ring");
        // That one never reaches a kernel; the same copy through the blocking helper's ring.
        drop(q);
        let mut q = mem.open_queue().unwrap();
        q.blocking(|q, sq| q.start_copy_from(&file, &whole, 65536, false, BLOCKING_TAG, sq))
            .unwrap();
        let mut back = vec![0u8; 65536 + 8192];
        q.read_blocking(0, &mut back).unwrap();
        assert!(back[..8192] == a[..], "copied from the memfd");
        assert!(back[65536..] == a[..], "copied from the file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Spare source queues belong to their exports: a copy from another export does not take
    /// one of a different export, and once a source export is gone its spare goes at the next
    /// request of any kind, with the queue that held its backend (a `memthread:` backend's
    /// thread, here) open.
    #[test]
    fn spare_source_queues_follow_their_exports() {
        let open = |spec: &str| Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
        let (a, b) = (open("a=memthread:1M"), open("b=null:1M"));
        let mem = open("m=mem:1M");
        let mut q = mem.open_queue().unwrap();
        let whole = [CopyRange {
            offset: 0,
            len: 4096,
        }];
        let spares = |q: &ExportQueue, e: &Arc<Export>| {
            q.spare_sources
                .iter()
                .filter(|(s, _)| std::ptr::eq(s.as_ptr(), Arc::as_ptr(e)))
                .count()
        };
        for src in [&a, &b, &a, &b] {
            q.blocking(|q, sq| q.start_copy_from(src, &whole, 0, false, BLOCKING_TAG, sq))
                .unwrap();
        }
        assert_eq!(
            (spares(&q, &a), spares(&q, &b)),
            (1, 1),
            "one each, none shared"
        );
        let backend = Arc::downgrade(a.backend());
        drop(a);
        let mut buf = vec![0u8; 4096];
        q.read_blocking(0, &mut buf).unwrap();
        assert_eq!(
            q.spare_sources.len(),
            1,
            "the removed source's spare went at a READ"
        );
        assert!(
            backend.upgrade().is_none(),
            "the removed source's backend is released"
        );
    }

    /// TRIM, WRITE_ZEROES (whose fallback may write gigabytes of zeros), COPY and allocation
    /// queries on a file never run on the calling (reactor) thread: they come back through the
    /// notifier from the export's helper thread.
    #[test]
    fn slow_file_operations_leave_the_calling_thread() {
        let dir = std::env::temp_dir().join(format!("blkwire-slow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let e = Export::open(&ExportSpec::parse(&format!("f=file:{}", path.display())).unwrap())
            .unwrap();
        let mut q = e.open_queue().unwrap();
        struct NoRing;
        impl Submitter for NoRing {
            fn push(&mut self, _: io_uring::squeue::Entry) {
                panic!("metadata operations do not use the ring")
            }
        }
        let mut out = Vec::new();
        let ops = [
            Op::Trim {
                offset: 0,
                len: 4096,
                fua: false,
            },
            Op::WriteZeroes {
                offset: 0,
                len: 1 << 20,
                no_hole: true,
                fast: false,
                fua: false,
            },
        ];
        for (i, op) in ops.into_iter().enumerate() {
            // SAFETY: these ops name no buffer.
            let p = unsafe { q.start(op, i as u64, &mut NoRing) };
            assert_eq!(p, Progress::Pending);
        }
        assert_eq!(
            q.start_copy(
                &[CopyRange {
                    offset: 0,
                    len: 4096
                }],
                1 << 20,
                false,
                2,
                &mut NoRing
            ),
            Progress::Pending
        );
        // SAFETY: `out` outlives the query, reaped below.
        let p =
            unsafe { q.start_allocation(0, 4 << 20, crate::MAX_EXTENTS, &mut out, 3, &mut NoRing) };
        assert_eq!(p, Progress::Pending);
        let mut done = Vec::new();
        while done.len() < 4 {
            let mut pfd = libc::pollfd {
                fd: q.notifier().unwrap(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one descriptor the backend owns.
            unsafe { libc::poll(&mut pfd, 1, 5000) };
            q.reap(&mut NoRing, &mut |t, r| done.push((t, r)));
        }
        done.sort();
        assert_eq!(done, [(0, 0), (1, 0), (2, 0), (3, 0)]);
        assert_eq!(out.iter().map(|x| x.len).sum::<u64>(), 4 << 20);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn copy_checks() {
        let e = Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap();
        let r = |offset, len| CopyRange { offset, len };
        assert_eq!(e.check_copy(&[r(0, 4096)], 8192), Ok(4096));
        assert_eq!(e.check_copy(&[], 0), Err(Refusal::Invalid), "no source");
        assert_eq!(
            e.check_copy(&[r(0, 0)], 8192),
            Err(Refusal::Invalid),
            "empty source"
        );
        assert_eq!(
            e.check_copy(&[r(0, 8192)], 4096),
            Err(Refusal::Invalid),
            "overlap"
        );
        assert_eq!(
            e.check_copy(&[r(8192, 4096)], 4096),
            Ok(4096),
            "adjacent is fine"
        );
        assert_eq!(
            e.check_copy(&[r((1 << 20) - 512, 1024)], 0),
            Err(Refusal::OutOfRange),
            "source past the end"
        );
        assert_eq!(
            e.check_copy(&[r(0, 4096)], (1 << 20) - 512),
            Err(Refusal::OutOfRange),
            "destination past the end"
        );
        assert_eq!(e.check_copy(&[r(u64::MAX, 2)], 0), Err(Refusal::OutOfRange));
        let many = vec![r(0, 512); 129];
        assert_eq!(
            e.check_copy(&many, 1 << 19),
            Err(Refusal::Invalid),
            "too many ranges"
        );
        let ro = Export::open(&ExportSpec::parse("m=mem:1M,ro").unwrap()).unwrap();
        assert_eq!(ro.check_copy(&[r(0, 512)], 4096), Err(Refusal::ReadOnly));
    }

    /// An O_DIRECT export takes COPYs as it takes READ and WRITE: its offsets and lengths
    /// aligned (here 4096), as destination and as source, checked before anything is written;
    /// an unaligned export beside it adds nothing.
    #[test]
    fn copies_into_and_out_of_o_direct_exports_are_aligned() {
        let dir = std::env::temp_dir().join(format!("blkwire-copyalign-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let spec = format!("d=file:{}?direct=1", path.display());
        let d = Export::open(&ExportSpec::parse(&spec).unwrap()).unwrap();
        let a = d.alignment();
        assert!(a >= 512, "O_DIRECT: alignment {a}");
        let m = Export::open(&ExportSpec::parse("m=mem:1M").unwrap()).unwrap();
        let r = |offset, len| CopyRange { offset, len };
        // Within the O_DIRECT export.
        assert_eq!(d.check_copy(&[r(0, a as u32)], 4 * a), Ok(a));
        assert_eq!(
            d.check_copy(&[r(0, a as u32), r(a, 2 * a as u32)], 4 * a),
            Ok(3 * a)
        );
        for (sources, dst, what) in [
            (vec![r(0, a as u32)], 4 * a + 512, "destination offset"),
            (vec![r(512, a as u32)], 4 * a, "source offset"),
            (vec![r(0, 512)], 4 * a, "length"),
            (
                vec![r(0, a as u32), r(a, a as u32 - 512)],
                4 * a,
                "a later range's length",
            ),
        ] {
            assert_eq!(d.check_copy(&sources, dst), Err(Refusal::Invalid), "{what}");
        }
        // Into it from an unaligned export: the destination's alignment; out of it into one:
        // the source's.
        assert_eq!(d.check_copy_from(&m, &[r(512, a as u32)], a), Ok(a));
        assert_eq!(
            d.check_copy_from(&m, &[r(0, 512)], a),
            Err(Refusal::Invalid)
        );
        assert_eq!(
            d.check_copy_from(&m, &[r(0, a as u32)], 512),
            Err(Refusal::Invalid)
        );
        assert_eq!(m.check_copy_from(&d, &[r(a, a as u32)], 512), Ok(a));
        assert_eq!(
            m.check_copy_from(&d, &[r(512, a as u32)], 0),
            Err(Refusal::Invalid)
        );
        assert_eq!(
            m.check_copy_from(&d, &[r(0, 512)], 0),
            Err(Refusal::Invalid)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A backend's queue whose every operation is two ring entries (NOPs with its tag).
    struct TwoEntries;
    impl QueueIo for TwoEntries {
        fn completes_inline(&self) -> bool {
            false
        }
        unsafe fn start(&mut self, _op: Op, tag: u64, sq: &mut dyn Submitter) -> Started {
            for _ in 0..2 {
                sq.push(io_uring::opcode::Nop::new().build().user_data(tag));
            }
            Started::Submitted(2)
        }
    }

    /// A flush-only export's queue over `io`, a backend's queue of the test's own.
    fn queue_over(io: Box<dyn QueueIo>) -> ExportQueue {
        ExportQueue {
            backend: Arc::new(MemBackend::new(1 << 20).unwrap()),
            io,
            caps: Capabilities::effective(flush_only()),
            zero_align: 4096,
            zeros: None,
            steps: Vec::new(),
            reaped: Vec::new(),
            failed_copies: Vec::new(),
            failed_flushes: Vec::new(),
            flushes: Flushes::default(),
            spare_sources: Vec::new(),
        }
    }

    #[test]
    fn several_ring_entries_fold_into_one_result() {
        struct Drop_;
        impl Submitter for Drop_ {
            fn push(&mut self, _: io_uring::squeue::Entry) {}
        }
        let mut q = queue_over(Box::new(TwoEntries));
        let buf = [0u8; 512];
        let op = Op::Write {
            offset: 0,
            buf: buf.as_ptr(),
            len: 512,
            fua: false,
        };
        // SAFETY: nothing reads the buffer (the entries are never submitted).
        assert_eq!(unsafe { q.start(op, 9, &mut Drop_) }, Progress::Pending);
        assert_eq!(q.complete(9, 512, &mut Drop_), None);
        assert_eq!(
            q.complete(9, 0, &mut Drop_),
            Some(512),
            "the first entry's result"
        );
        // SAFETY: as above.
        assert_eq!(unsafe { q.start(op, 10, &mut Drop_) }, Progress::Pending);
        assert_eq!(q.complete(10, 512, &mut Drop_), None);
        assert_eq!(
            q.complete(10, -libc::ECANCELED, &mut Drop_),
            Some(-libc::ECANCELED)
        );
        assert!(q.steps.is_empty());
    }

    /// A flush of several ring entries is running until its last entry is in: the next
    /// flush starts then, and those sharing it get the folded result.
    #[test]
    fn a_flush_of_several_entries_runs_until_its_last() {
        let mut q = queue_over(Box::new(TwoEntries));
        let mut sq = Collect(Vec::new());
        // SAFETY: flushes carry no buffer.
        unsafe {
            assert_eq!(q.start(Op::Flush, 1, &mut sq), Progress::Pending);
            assert_eq!(q.start(Op::Flush, 2, &mut sq), Progress::Pending);
        }
        assert_eq!(sq.0.drain(..).collect::<Vec<_>>(), [1, 1], "flush 2 waits");
        assert_eq!(q.complete(1, 0, &mut sq), None);
        assert!(sq.0.is_empty(), "flush 1 still runs: flush 2 still waits");
        assert_eq!(q.complete(1, -libc::EIO, &mut sq), Some(-libc::EIO));
        assert_eq!(
            sq.0.drain(..).collect::<Vec<_>>(),
            [2, 2],
            "now flush 2 runs"
        );
        assert_eq!(q.complete(2, 0, &mut sq), None);
        assert_eq!(q.complete(2, 0, &mut sq), Some(0));
        assert!(q.steps.is_empty() && q.flushes.running.is_none());
    }

    #[test]
    fn file_backend_round_trip() {
        let dir = std::env::temp_dir().join(format!("blkwire-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        let fb = FileBackend::open(&path, false, false).unwrap();
        assert!(fb.reads_as_zero(), "fresh sparse file reads as zero");
        drop(fb);
        round_trip(&format!("f=file:{}", path.display()));
        let ro =
            Export::open(&ExportSpec::parse(&format!("f=file:{},ro", path.display())).unwrap());
        assert!(ro.unwrap().read_only);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn allocation_maps_show_holes_where_nothing_was_written() {
        let m = MemBackend::new(1 << 20).unwrap();
        let e = Export::new("m", std::sync::Arc::new(m), false);
        let mut q = e.open_queue().unwrap();
        let b = vec![1u8; 8192];
        q.write_blocking(65536, &b, false).unwrap();
        let mut out = Vec::new();
        e.backend()
            .allocation(0, 1 << 20, crate::MAX_EXTENTS, &mut out);
        let want = [
            crate::Extent {
                len: 65536,
                hole: true,
            },
            crate::Extent {
                len: 8192,
                hole: false,
            },
            crate::Extent {
                len: (1 << 20) - 65536 - 8192,
                hole: true,
            },
        ];
        assert_eq!(out, want);
        let mut part = Vec::new();
        e.backend()
            .allocation(100, 65536, crate::MAX_EXTENTS, &mut part);
        assert_eq!(
            part,
            [
                crate::Extent {
                    len: 65436,
                    hole: true
                },
                crate::Extent {
                    len: 100,
                    hole: false
                }
            ]
        );

        let dir = std::env::temp_dir().join(format!("blkwire-alloc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let fb = FileBackend::open(&path, false, false).unwrap();
        let e = Export::new("f", std::sync::Arc::new(fb), false);
        let mut q = e.open_queue().unwrap();
        q.write_blocking(65536, &b, false).unwrap();
        let mut out = Vec::new();
        e.backend()
            .allocation(0, 1 << 20, crate::MAX_EXTENTS, &mut out);
        let data: Vec<_> = out.iter().filter(|x| !x.hole).collect();
        assert_eq!(out.iter().map(|x| x.len).sum::<u64>(), 1 << 20);
        assert_eq!(data.len(), 1, "{out:?}");
        assert!(out[0].hole && out[0].len <= 65536, "{out:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn null_backend_reads_zero() {
        let e = Export::open(&ExportSpec::parse("n=null:1M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let mut b = vec![7u8; 4096];
        q.write_blocking(0, &b, false).unwrap();
        q.read_blocking(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 0));
    }

    #[test]
    fn zero_emulation_writes_everything() {
        let mut written = Vec::new();
        let zeros = [0u8; 1000];
        let r = write_zeroes_by_writing(10, 2500, &zeros, |b, off| {
            written.push((off, b.len()));
            b.len() as i32
        });
        assert_eq!(r, 0);
        assert_eq!(written, vec![(10, 1000), (1010, 1000), (2010, 500)]);
    }
}
