//! `mem:SIZE`: sparse RAM, held in a memfd (an unlinked tmpfs file). A page exists only once it
//! is written, so a `mem:1T` export costs nothing until used, and the kernel's own bookkeeping
//! answers "where is data" exactly (SEEK_DATA/SEEK_HOLE) for `cp` and NBD block status.
//!
//! Writes copy into a shared mapping of the memfd. Reads use `pread`, not the mapping: a read
//! fault on a hole would allocate a page and make never-written ranges look allocated (`pread`
//! of a hole returns zeros without allocating). So `mincore` on the mapping tells which pages
//! hold data, at a cost bounded by the range asked about (SEEK_HOLE on tmpfs walks every page up
//! to the next hole, which can be the whole export). TRIM and WRITE_ZEROES punch holes,
//! returning the memory. Large READ replies are sent from the mapping where `mincore` says every
//! page of them exists (`Backend::mapped`); a TRIM racing such a send can bring a page back
//! (zeroed), the one case where a page exists that was not written since.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::{Backend, Capabilities, Op, QueueIo, Started, Submitter, Support};

/// The page size `mincore` reports in.
const PAGE: u64 = 4096;

/// Sparse RAM in a memfd.
pub struct MemBackend {
    fd: OwnedFd,
    base: *mut u8,
    size: u64,
}

// SAFETY: the mapping lives as long as the backend and is only accessed through raw copies of
// ranges that the generic layer has bounds-checked. Concurrent writes to the same range from
// different queues race exactly as they would on a disk; the protocol gives no ordering between
// queues (PROTOCOL.md §2.4).
unsafe impl Send for MemBackend {}
// SAFETY: as above: shared use only copies bounds-checked ranges through the raw pointer.
unsafe impl Sync for MemBackend {}

/// Why a RAM export cannot grow: queues copy in and out of one mapping of the export's size,
/// made when it was added, and moving it under them is not worth the risk.
pub(crate) fn mapped_at_its_size(kind: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{kind} is mapped at its size when the export is added: remove and re-add it"),
    )
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl MemBackend {
    /// Which of `out.len()` pages from page `first` exist (`mincore`: bit 0 of each byte). The
    /// pages must lie inside the mapping (callers range-check). False if the kernel refuses.
    fn resident(&self, first: u64, out: &mut [u8]) -> bool {
        // SAFETY: the pages lie inside our mapping (the caller's promise); one byte per page
        // into `out`, which holds that many.
        unsafe {
            libc::mincore(
                self.base.add((first * PAGE) as usize).cast(),
                out.len() * PAGE as usize,
                out.as_mut_ptr(),
            ) == 0
        }
    }

    /// A RAM export of `size` bytes (a non-zero multiple of 512); costs nothing until written.
    pub fn new(size: u64) -> io::Result<MemBackend> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("mem size {size} must be a non-zero multiple of 512"),
            ));
        }
        let len = usize::try_from(size).map_err(|_| io::Error::other("mem size too large"))?;
        // SAFETY: creating a new anonymous file; we own the fd from here on.
        let raw = unsafe { libc::memfd_create(c"blkwire-mem".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing our own file.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh shared mapping of our own file; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "cannot reserve {} of address space for RAM ({e}); use a smaller size",
                    crate::format_size(size)
                ),
            ));
        }
        Ok(MemBackend {
            fd,
            base: p.cast(),
            size,
        })
    }

    /// Bytes of RAM actually backing the export (pages written and not trimmed).
    pub fn resident_bytes(&self) -> u64 {
        // SAFETY: an all-zero stat is a valid value (plain integers).
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on our fd into a stat we own.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return self.size;
        }
        st.st_blocks as u64 * 512
    }

    fn punch(&self, offset: u64, len: u64) -> i32 {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: fallocate on our fd; tmpfs zeroes partial pages at the edges itself.
        let r = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            0
        } else {
            -errno()
        }
    }

    /// # Safety
    /// `buf` must be valid for writes of `len` bytes.
    unsafe fn read(&self, offset: u64, buf: *mut u8, len: u32) -> i32 {
        // SAFETY: passed on from our caller.
        unsafe { read_fd(self.fd.as_raw_fd(), offset, buf, len) }
    }
    /// Runs one range-checked op to completion on the calling thread: bytes moved (READ, WRITE),
    /// 0, or a negative errno.
    ///
    /// # Safety
    /// The op's buffer (READ, WRITE) must be valid for `len` bytes for the duration of the call.
    pub(crate) unsafe fn execute(&self, op: Op) -> i32 {
        match op {
            // SAFETY: the caller vouches for the buffer.
            Op::Read { offset, buf, len } => match unsafe { self.read(offset, buf, len) } {
                0 => len as i32,
                e => e,
            },
            Op::Write {
                offset, buf, len, ..
            } => {
                // SAFETY: the range is bounds-checked by Export and lies inside our mapping; the
                // caller vouches for the buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(buf, self.base.add(offset as usize), len as usize)
                };
                len as i32
            }
            Op::Flush => 0,
            // pread from the memfd, not a copy through the mapping: a source hole stays
            // unallocated instead of being faulted in.
            Op::Copy { src, dst, len } => {
                // SAFETY: the destination range is bounds-checked by Export (check_copy) and
                // lies inside our mapping; the source range is inside the file and does not
                // overlap it.
                match unsafe { self.read(src, self.base.add(dst as usize), len) } {
                    0 => len as i32,
                    e => e,
                }
            }
            // From another export's file or memfd straight into our mapping: one copy.
            Op::CopyFrom { fd, src, dst, len } => {
                // SAFETY: the destination range is bounds-checked by Export (check_copy_from)
                // and lies inside our mapping; the caller keeps `fd` open until the result.
                match unsafe { read_fd(fd, src, self.base.add(dst as usize), len) } {
                    0 => len as i32,
                    e => e,
                }
            }
            Op::Trim { offset, len }
            | Op::WriteZeroes {
                offset,
                len,
                no_hole: false,
            } => self.punch(offset, len as u64),
            Op::WriteZeroes {
                offset,
                len,
                no_hole: true,
            } => {
                // Allocated zeros, as asked: write them.
                // SAFETY: the range is bounds-checked by Export and lies inside our mapping.
                unsafe { std::ptr::write_bytes(self.base.add(offset as usize), 0, len as usize) };
                0
            }
        }
    }
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new() mapped; no queue outlives the backend (Arc).
        unsafe { libc::munmap(self.base.cast(), self.size as usize) };
    }
}

/// `pread`s `len` bytes at `offset` of `fd` into `buf`: 0, or a negative errno (EIO at the
/// file's end).
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes.
unsafe fn read_fd(fd: RawFd, offset: u64, buf: *mut u8, len: u32) -> i32 {
    let mut done = 0usize;
    while done < len as usize {
        // SAFETY: the caller's buffer holds `len` bytes.
        let n = unsafe {
            libc::pread(
                fd,
                buf.add(done).cast(),
                len as usize - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return -libc::EIO,
            _ if errno() == libc::EINTR => continue,
            _ => return -errno(),
        }
    }
    0
}

impl Backend for MemBackend {
    fn describe(&self) -> String {
        format!("mem:{}", crate::format_size(self.size))
    }
    fn copy_source_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }
    fn copies_from_fds(&self) -> bool {
        true
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 4096)
    }
    fn resize(&self, _new_size: u64) -> io::Result<()> {
        Err(mapped_at_its_size("mem:"))
    }
    fn capabilities(&self) -> Capabilities {
        // Volatile by design: no flush, no FUA (PROTOCOL.md §10).
        Capabilities {
            trim: Support::Native,
            write_zeroes: Support::Native,
            copy: Support::Native,
            fast_zero: true,
            ..Capabilities::default()
        }
    }
    fn reads_as_zero(&self) -> bool {
        self.resident_bytes() == 0
    }
    fn mapped(&self, offset: u64, len: u64) -> Option<*const u8> {
        // Only where every page exists: reading a hole through the mapping would allocate it.
        // A TRIM racing the send may still punch a page we saw; the send's read then brings
        // back a zero page (RAM the next TRIM returns), as a racing WRITE would have.
        const BATCH: u64 = 256;
        let end = (offset + len).div_ceil(PAGE);
        let mut vec = [0u8; BATCH as usize];
        let mut page = offset / PAGE;
        while page < end {
            let n = (end - page).min(BATCH) as usize;
            if !self.resident(page, &mut vec[..n]) || vec[..n].iter().any(|v| v & 1 == 0) {
                return None;
            }
            page += n as u64;
        }
        // SAFETY: inside the mapping, which lives as long as the backend.
        Some(unsafe { self.base.add(offset as usize) }.cast_const())
    }
    fn allocation(&self, offset: u64, len: u64, out: &mut Vec<crate::Extent>) {
        let first = offset / PAGE;
        let end = offset + len;
        let pages = ((end.div_ceil(PAGE) - first) as usize).min(crate::MAX_EXTENTS * 16);
        let mut vec = vec![0u8; pages];
        if !self.resident(first, &mut vec) {
            out.push(crate::Extent { len, hole: false });
            return;
        }
        let mut at = offset;
        for (i, v) in vec.iter().enumerate() {
            let page_end = ((first + i as u64 + 1) * PAGE).min(end);
            crate::push_extent(out, page_end - at, v & 1 == 0);
            at = page_end;
        }
        if at < end {
            // More pages than one query covers: the rest is reported as data (safe answer).
            crate::push_extent(out, end - at, false);
        }
    }
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        Ok(Box::new(MemQueue { mem: self }))
    }
}

/// Per-queue handle: every op completes inline.
struct MemQueue {
    mem: Arc<MemBackend>,
}

impl QueueIo for MemQueue {
    fn completes_inline(&self) -> bool {
        true
    }
    unsafe fn start(&mut self, op: Op, _tag: u64, _sq: &mut dyn Submitter) -> Started {
        // SAFETY: our caller keeps the op's buffer valid for the call (QueueIo::start's contract).
        Started::Done(unsafe { self.mem.execute(op) })
    }
}
