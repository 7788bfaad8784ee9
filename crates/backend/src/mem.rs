//! `mem:SIZE`: sparse RAM, held in a memfd (an unlinked tmpfs file). A page exists only once it
//! is written, so a `mem:1T` export costs nothing until used, and the kernel's own bookkeeping
//! answers "where is data" exactly (SEEK_DATA/SEEK_HOLE) for `cp` and NBD block status.
//!
//! Writes copy into a shared mapping of the memfd, into pages backed first (`fallocate`, where
//! the record below does not call them written: one call for a range's first write): under
//! strict overcommit a store into a page the kernel cannot give raises SIGBUS, which would end
//! the target, where `fallocate` fails the one request (NO_SPACE; the kernel lab's
//! `mem-overcommit` scenario). A read fault on a hole of that mapping would
//! allocate the page and make never-written ranges look allocated, so reads go through the
//! mapping only where every page was written, as the export's own record says ([`Written`], a
//! bit a page, set by writes, cleared by the holes punched); elsewhere they `pread`, which
//! returns zeros for a hole without allocating. 4 KiB `pread`s from a 1 GiB export took 38% of
//! a saturated target thread, most of it the page cache's lookup, and asking `mincore` first
//! was nearly as dear; a copy from the mapping after a look at the record took 8-82% more 4 KiB
//! reads a second out of the same target thread, depending on the transport
//! (docs/BENCHMARKS.md, "Reads of `mem:` from its mapping"). Large READ replies are sent
//! straight from the mapping on the same condition (`Backend::mapped`). TRIM and WRITE_ZEROES
//! punch holes, returning the memory (WRITE_ZEROES with NO_HOLE writes zeros instead). Both run
//! on the calling thread, so the generic layer hands long ones over in pieces of at most
//! `INLINE_PIECE` and gives the thread back between them.
//!
//! The record and the memfd can disagree only where requests race on the same pages, or one
//! fails halfway, and never in a way that changes what a READ returns: a page the record calls
//! a hole is read with `pread`, whatever it holds; a page it calls written reads the same
//! through the mapping. The memory can: a TRIM racing a READ of its pages can bring one back
//! (zeroed), and a WRITE racing a TRIM of its pages can leave a hole marked written (the next
//! READ of it then allocates a zeroed page). Either is a page of RAM the export may hold anyway,
//! and the next TRIM there returns it. A COPY that fails halfway leaves what it copied
//! unmarked: read with `pread`. Allocation queries (NBD block status) take a page as data
//! where the record says written or `mincore` sees it, at a cost bounded by the range asked
//! about (SEEK_HOLE on tmpfs walks every page up to the next hole, which can be the whole
//! export; `mincore` alone would call a page swapped out a hole).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Backend, Capabilities, Op, QueueIo, Started, Submitter, Support};

/// The page size `mincore` reports in.
const PAGE: u64 = 4096;

/// Sparse RAM in a memfd.
pub struct MemBackend {
    fd: OwnedFd,
    base: *mut u8,
    size: u64,
    written: Written,
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
        let raw = unsafe {
            libc::memfd_create(
                c"blkwire-mem".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing our own file.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Its size is fixed from here: the file is reachable through /proc/PID/fd, and memory of
        // the mapping past a shrunk end would raise SIGBUS where the data path writes fragments
        // in place or sends replies from it.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: sealing our own file.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Made first: a failure after the mapping would leave it mapped.
        let written = Written::new(size.div_ceil(PAGE))?;
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
            written,
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
        // Whole pages go; tmpfs zeroes the parts of the pages at the edges and keeps them.
        // Cleared first: a READ that still finds a page written is one racing the TRIM.
        self.written
            .clear(offset.div_ceil(PAGE), (offset + len) / PAGE);
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
        if let Some(src) = self.mapped(offset, len as u64) {
            // SAFETY: `len` bytes of the mapping, every page of them written; the caller's
            // buffer holds `len` bytes and is not part of the range read (COPY's ranges do not
            // overlap).
            unsafe { std::ptr::copy_nonoverlapping(src, buf, len as usize) };
            return 0;
        }
        // SAFETY: passed on from our caller.
        unsafe { read_fd(self.fd.as_raw_fd(), offset, buf, len) }
    }

    /// Backs `len` bytes at `offset` with memory before they are written through the mapping,
    /// where the record does not say every page was written: 0, or a negative errno (ENOSPC,
    /// ENOMEM). A store into a page the kernel cannot give (strict overcommit: shmem charges
    /// each page as it is first touched) raises SIGBUS, which would end the whole target;
    /// `fallocate` says no instead, and the request alone fails (NO_SPACE). A TRIM punching
    /// the pages between the two can still leave one to fault: racing requests on the same
    /// pages, as the module's comment says.
    fn back(&self, offset: u64, len: u64) -> i32 {
        if self
            .written
            .all(offset / PAGE, (offset + len).div_ceil(PAGE))
        {
            return 0;
        }
        // SAFETY: fallocate on our fd, inside its (sealed) size; no memory is involved.
        let r = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                0,
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

    /// Records `len` bytes at `offset` as written (after the copy into the mapping).
    fn wrote(&self, offset: u64, len: u32) {
        self.written
            .mark(offset / PAGE, (offset + len as u64).div_ceil(PAGE));
    }
    /// Runs one range-checked op to completion on the calling thread: bytes moved (READ, WRITE),
    /// 0, or a negative errno.
    ///
    /// # Safety
    /// The op's buffer (READ, WRITE) must be valid for `len` bytes for the duration of the call.
    pub(crate) unsafe fn execute(&self, op: Op) -> i32 {
        // What the op stores through the mapping is backed first (`back`).
        let stores = match op {
            Op::Write { offset, len, .. }
            | Op::WriteZeroes {
                offset,
                len,
                no_hole: true,
                ..
            } => Some((offset, len)),
            Op::Copy { dst, len, .. } | Op::CopyFrom { dst, len, .. } => Some((dst, len)),
            _ => None,
        };
        if let Some((at, len)) = stores {
            let backed = self.back(at, len as u64);
            if backed != 0 {
                return backed;
            }
        }
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
                self.wrote(offset, len);
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
                    0 => {
                        self.wrote(dst, len);
                        len as i32
                    }
                    e => e,
                }
            }
            // From another export's file or memfd straight into our mapping: one copy.
            Op::CopyFrom { fd, src, dst, len } => {
                // SAFETY: the destination range is bounds-checked by Export (check_copy_from)
                // and lies inside our mapping; the caller keeps `fd` open until the result.
                match unsafe { read_fd(fd, src, self.base.add(dst as usize), len) } {
                    0 => {
                        self.wrote(dst, len);
                        len as i32
                    }
                    e => e,
                }
            }
            Op::Trim { offset, len, .. }
            | Op::WriteZeroes {
                offset,
                len,
                no_hole: false,
                ..
            } => self.punch(offset, len as u64),
            Op::WriteZeroes {
                offset,
                len,
                no_hole: true,
                ..
            } => {
                // Allocated zeros, as asked: write them.
                // SAFETY: the range is bounds-checked by Export and lies inside our mapping.
                unsafe { std::ptr::write_bytes(self.base.add(offset as usize), 0, len as usize) };
                self.wrote(offset, len);
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

/// Which pages of a RAM export were written through its mapping since a hole was last punched
/// there: one bit a page, in an anonymous mapping of its own (page-aligned, zero-filled) that
/// costs memory only where pages were written: 4 KiB of record for each 128 MiB of the export
/// written to, kept until the export goes (a `mem:1T` written all over holds 32 MiB of it).
/// Queues of any thread mark and clear it; a word is stored to only when a bit in it changes,
/// so reads and rewrites of written data only load it.
struct Written {
    words: *mut AtomicU64,
    len: usize,
}

// SAFETY: the words are atomics in a mapping that lives as long as the record.
unsafe impl Send for Written {}
// SAFETY: as above.
unsafe impl Sync for Written {}

impl Written {
    /// A record of `pages` pages, none written.
    fn new(pages: u64) -> io::Result<Written> {
        let len = usize::try_from(pages.div_ceil(64))
            .map_err(|_| io::Error::other("mem size too large"))?
            .max(1);
        // SAFETY: a fresh private anonymous mapping; zero-filled, which is "none written".
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("cannot reserve address space for the RAM's page record ({e})"),
            ));
        }
        Ok(Written {
            words: p.cast(),
            len,
        })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `len` zero-initialised u64s, page-aligned (so aligned for AtomicU64, which
        // has u64's layout), mapped for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.words, self.len) }
    }

    /// Calls `f(word, mask)` for the words holding pages `first..end`, with the mask of those
    /// pages in each, until it returns false; false if it did.
    fn each(&self, first: u64, end: u64, mut f: impl FnMut(&AtomicU64, u64) -> bool) -> bool {
        let words = self.words();
        let mut page = first;
        while page < end {
            let bit = page % 64;
            let n = (end - page).min(64 - bit);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1 << n) - 1) << bit
            };
            if !f(&words[(page / 64) as usize], mask) {
                return false;
            }
            page += n;
        }
        true
    }

    /// Whether every page of `first..end` was written.
    fn all(&self, first: u64, end: u64) -> bool {
        // Acquire: the pages a write marked are mapped before it marked them.
        self.each(first, end, |w, m| w.load(Ordering::Acquire) & m == m)
    }

    /// Marks pages `first..end` written.
    fn mark(&self, first: u64, end: u64) {
        self.each(first, end, |w, m| {
            if w.load(Ordering::Relaxed) & m != m {
                w.fetch_or(m, Ordering::Release);
            }
            true
        });
    }

    /// Marks pages `first..end` holes (none when `end <= first`).
    fn clear(&self, first: u64, end: u64) {
        self.each(first, end, |w, m| {
            if w.load(Ordering::Relaxed) & m != 0 {
                w.fetch_and(!m, Ordering::Relaxed);
            }
            true
        });
    }
}

impl Drop for Written {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new() mapped; nothing borrows the words past `self`.
        unsafe { libc::munmap(self.words.cast(), self.len * 8) };
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

/// True when the file behind `fd` lives in memory: shmem (a memfd, as another `mem:` export's,
/// or a tmpfs file) or hugetlbfs, the file systems that take seals (`F_GET_SEALS` answers
/// where they do, and fails with EINVAL on every other file).
fn in_memory(fd: RawFd) -> bool {
    // SAFETY: F_GET_SEALS only reads the seals of the descriptor, which the caller keeps open.
    unsafe { libc::fcntl(fd, libc::F_GET_SEALS) >= 0 }
}

impl Backend for MemBackend {
    fn describe(&self) -> String {
        format!("mem:{}", crate::format_size(self.size))
    }
    fn copy_source_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }
    /// Only from memory: [`Op::CopyFrom`] runs inline, on the reactor, so a regular file's
    /// `pread` (a hung NFS or FUSE mount, a slow disk) must not; its source is read on a
    /// queue of its own instead, as other destinations do.
    fn copies_from_fd(&self, fd: RawFd) -> bool {
        in_memory(fd)
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
        // Only where every page was written: reading a hole through the mapping would allocate
        // it. A TRIM racing the read may still punch a page we saw; the read then brings back
        // a zero page (RAM the next TRIM returns), as a racing WRITE would have.
        if !self
            .written
            .all(offset / PAGE, (offset + len).div_ceil(PAGE))
        {
            return None;
        }
        // SAFETY: inside the mapping, which lives as long as the backend.
        Some(unsafe { self.base.add(offset as usize) }.cast_const())
    }
    fn mapped_for_write(&self, offset: u64, len: u64) -> Option<*mut u8> {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.size));
        // Backed first (`back`): fragments stored into a page the kernel cannot give would
        // raise SIGBUS. Not backed, the WRITE takes a buffer and fails as any other.
        if self.back(offset, len) != 0 {
            return None;
        }
        // SAFETY: inside the mapping (range-checked by the caller), which lives as long as the
        // backend.
        Some(unsafe { self.base.add(offset as usize) })
    }
    fn wrote_mapped(&self, offset: u64, len: u64) {
        // After the copy, as `wrote` for a WRITE: a TRIM that ran before it cleared the pages
        // and punched them; marking them now never leaves data in a page recorded as a hole.
        self.written
            .mark(offset / PAGE, (offset + len).div_ceil(PAGE));
    }
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<crate::Extent>) {
        let first = offset / PAGE;
        let end = offset + len;
        // One byte per page for mincore: at most 1 MiB, 4 GiB of the export, per query.
        let pages = ((end.div_ceil(PAGE) - first) as usize).min(crate::MAX_EXTENTS * 16);
        let mut vec = vec![0u8; pages];
        if !self.resident(first, &mut vec) {
            out.push(crate::Extent { len, hole: false });
            return;
        }
        let start = out.len();
        let mut at = offset;
        for (i, v) in vec.iter().enumerate() {
            let page = first + i as u64;
            let page_end = ((page + 1) * PAGE).min(end);
            // Data if written or in memory: a written page swapped out is not in memory.
            let hole = v & 1 == 0 && !self.written.all(page, page + 1);
            // Past MAX_EXTENTS, or past the pages scanned, the map is a prefix of the range:
            // the caller asks again from where it ends (Backend::allocation's contract).
            if !crate::export::push_extent_within(out, start, max, page_end - at, hole) {
                return;
            }
            at = page_end;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `op` on `m`, returning its result.
    fn run(m: &MemBackend, op: Op) -> i32 {
        // SAFETY: the tests pass buffers that live across the call, of the op's length.
        unsafe { m.execute(op) }
    }

    fn write(m: &MemBackend, offset: u64, data: &[u8]) {
        let op = Op::Write {
            offset,
            buf: data.as_ptr(),
            len: data.len() as u32,
            fua: false,
        };
        assert_eq!(run(m, op), data.len() as i32);
    }

    fn read(m: &MemBackend, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0xee; len];
        let op = Op::Read {
            offset,
            buf: out.as_mut_ptr(),
            len: len as u32,
        };
        assert_eq!(run(m, op), len as i32);
        out
    }

    /// The file behind the mapping cannot change size, even from another process that opens
    /// it through /proc: a shrink would turn the data path's in-place accesses into SIGBUS.
    #[test]
    fn the_file_behind_the_mapping_keeps_its_size() {
        let m = MemBackend::new(1 << 20).unwrap();
        for size in [4096, 2 << 20] {
            // SAFETY: resizing our own file (refused).
            let r = unsafe { libc::ftruncate(m.fd.as_raw_fd(), size) };
            let e = io::Error::last_os_error();
            assert_eq!((r, e.raw_os_error()), (-1, Some(libc::EPERM)), "to {size}");
        }
        // Holes can still be punched (TRIM), within the size.
        assert_eq!(m.punch(0, 8192), 0);
    }

    /// The record of written pages follows writes, copies, allocated zeros and holes punched,
    /// page by page, and reads through the mapping only where it says so: a read of a range
    /// trimmed or never written allocates nothing.
    #[test]
    fn written_pages_are_read_from_the_mapping_and_holes_are_not() {
        let m = MemBackend::new(1 << 20).unwrap();
        let page = PAGE as usize;
        let data: Vec<u8> = (0..3 * page).map(|i| (i % 251) as u8).collect();
        write(&m, PAGE, &data);
        assert!(m.written.all(1, 4), "pages written");
        assert!(!m.written.all(0, 2), "page 0 never written");
        assert!(
            read(&m, PAGE, 3 * page) == data,
            "read back from the mapping"
        );
        assert!(m.mapped(PAGE, 3 * PAGE).is_some());
        assert!(m.mapped(0, 2 * PAGE).is_none());

        // A read that takes in a hole goes through pread: zeros, and the hole stays one.
        let before = m.resident_bytes();
        let r = read(&m, 0, 2 * page);
        assert!(r[..page].iter().all(|b| *b == 0) && r[page..] == data[..page]);
        assert_eq!(m.resident_bytes(), before, "reading a hole allocated it");

        // TRIM of a page and a half: the whole page goes, the partly trimmed one stays written.
        let trim = Op::Trim {
            offset: PAGE,
            len: (page + page / 2) as u32,
            fua: false,
        };
        assert_eq!(run(&m, trim), 0);
        assert!(!m.written.all(1, 2), "trimmed page still marked written");
        assert!(m.written.all(2, 4), "partly trimmed page is still there");
        let r = read(&m, PAGE, 3 * page);
        assert!(r[..page + page / 2].iter().all(|b| *b == 0));
        assert!(r[page + page / 2..] == data[page + page / 2..]);
        assert_eq!(
            m.resident_bytes(),
            before - PAGE,
            "reading the trimmed page brought it back"
        );

        // Allocated zeros and copies mark what they write; zeros that may be holes do not.
        let zeros = Op::WriteZeroes {
            offset: 8 * PAGE,
            len: page as u32,
            no_hole: true,
            fast: false,
            fua: false,
        };
        assert_eq!(run(&m, zeros), 0);
        assert!(m.written.all(8, 9));
        let copy = Op::Copy {
            src: 2 * PAGE,
            dst: 16 * PAGE,
            len: 2 * page as u32,
        };
        assert_eq!(run(&m, copy), 2 * page as i32);
        assert!(m.written.all(16, 18));
        assert!(read(&m, 16 * PAGE, 2 * page) == read(&m, 2 * PAGE, 2 * page));
        let punch = Op::WriteZeroes {
            offset: 16 * PAGE,
            len: 2 * page as u32,
            no_hole: false,
            fast: false,
            fua: false,
        };
        assert_eq!(run(&m, punch), 0);
        assert!(!m.written.all(16, 17) && !m.written.all(17, 18));
    }

    /// A WRITE copied piece by piece into the mapping (`mapped_for_write`, datagram fragments)
    /// is recorded piece by piece: a TRIM of the range between two pieces never leaves a piece
    /// that landed after it in a page recorded as a hole, and a page no piece reached is not
    /// recorded as written.
    #[test]
    fn writes_into_the_mapping_are_recorded_after_each_piece() {
        let m = MemBackend::new(1 << 20).unwrap();
        let page = PAGE as usize;
        let into = m.mapped_for_write(4 * PAGE, 3 * PAGE).unwrap();
        assert!(!m.written.all(4, 5), "nothing recorded before a byte lands");
        let piece = |i: usize, byte: u8| {
            // SAFETY: pieces of the three pages asked for.
            unsafe { std::ptr::write_bytes(into.add(i * page), byte, page) };
            m.wrote_mapped(4 * PAGE + (i * page) as u64, PAGE);
        };
        piece(0, 1);
        let trim = Op::Trim {
            offset: 4 * PAGE,
            len: 3 * page as u32,
            fua: false,
        };
        assert_eq!(run(&m, trim), 0);
        piece(1, 2);
        assert!(!m.written.all(4, 5), "the trimmed piece is a hole");
        assert!(m.written.all(5, 6), "the piece after the TRIM is data");
        assert!(!m.written.all(6, 7), "no piece reached the last page");
        let mut map = Vec::new();
        m.allocation(4 * PAGE, 3 * PAGE, 16, &mut map);
        assert_eq!(
            map.iter().map(|e| (e.len, e.hole)).collect::<Vec<_>>(),
            [(PAGE, true), (PAGE, false), (PAGE, true)]
        );
        assert!(read(&m, 5 * PAGE, page).iter().all(|b| *b == 2));
    }

    /// A READ of written pages really goes through the mapping: with a page punched behind
    /// the record's back, reading it faults it back in, which `pread` never does.
    #[test]
    fn reads_of_written_pages_use_the_mapping() {
        let m = MemBackend::new(1 << 20).unwrap();
        write(&m, 0, &[7u8; 4096]);
        let before = m.resident_bytes();
        // SAFETY: punching a page of our own memfd.
        let r = unsafe {
            libc::fallocate(
                m.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                4096,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(m.resident_bytes(), before - PAGE);
        assert!(read(&m, 0, 4096).iter().all(|b| *b == 0));
        assert_eq!(
            m.resident_bytes(),
            before,
            "the READ did not go through the mapping"
        );
    }

    /// An export whose size is not a multiple of the page, a TRIM inside one page, a copy
    /// from another export's file, and allocation answers for pages the record knows.
    #[test]
    fn partial_pages_copies_from_files_and_allocation() {
        let size = 3 * PAGE + 512;
        let m = MemBackend::new(size).unwrap();
        write(&m, 3 * PAGE, &[9u8; 512]);
        assert!(m.written.all(3, 4));
        assert!(read(&m, 3 * PAGE, 512) == [9u8; 512]);
        let trim = Op::Trim {
            offset: 3 * PAGE,
            len: 512,
            fua: false,
        };
        assert_eq!(run(&m, trim), 0);
        assert!(m.written.all(3, 4), "a page trimmed in part stays");
        assert!(read(&m, 3 * PAGE, 512).iter().all(|b| *b == 0));
        write(&m, 0, &[1u8; 4096]);
        let trim = Op::Trim {
            offset: 100,
            len: 1000,
            fua: false,
        };
        assert_eq!(run(&m, trim), 0);
        assert!(m.written.all(0, 1), "a TRIM inside a page keeps it");
        let r = read(&m, 0, 4096);
        assert!(r[100..1100].iter().all(|b| *b == 0) && r[..100].iter().all(|b| *b == 1));

        let src = MemBackend::new(1 << 20).unwrap();
        write(&src, 0, &[5u8; 8192]);
        let copy = Op::CopyFrom {
            fd: src.copy_source_fd().unwrap(),
            src: 0,
            dst: PAGE,
            len: 8192,
        };
        assert_eq!(run(&m, copy), 8192);
        assert!(m.written.all(1, 3));
        assert!(read(&m, PAGE, 8192) == [5u8; 8192]);

        let mut extents = Vec::new();
        m.allocation(0, size, crate::MAX_EXTENTS, &mut extents);
        assert_eq!(
            extents,
            [crate::Extent {
                len: size,
                hole: false
            }],
            "every page holds data"
        );
        // A page marked written counts as data even where mincore does not see it (swapped
        // out; here: punched behind the record's back).
        // SAFETY: punching a page of our own memfd.
        let r = unsafe {
            libc::fallocate(
                m.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                PAGE as i64,
                PAGE as i64,
            )
        };
        assert_eq!(r, 0);
        extents.clear();
        m.allocation(0, size, crate::MAX_EXTENTS, &mut extents);
        assert!(extents.iter().all(|e| !e.hole), "{extents:?}");
    }

    /// Queues on several threads marking pages of the same words lose none of the bits.
    /// Every other page written: each page is an extent of its own, so a query over more
    /// pages than MAX_EXTENTS must stop at MAX_EXTENTS (a prefix the caller asks again past)
    /// rather than list them all: the list, and the reply built from it, are bounded by it.
    #[test]
    fn allocation_of_alternating_pages_stops_at_max_extents() {
        let pages = 2 * crate::MAX_EXTENTS as u64 + 64;
        let m = MemBackend::new(pages * PAGE).unwrap();
        for p in (0..pages).step_by(2) {
            write(&m, p * PAGE, &[1]);
        }
        let mut out = vec![crate::Extent { len: 1, hole: true }];
        m.allocation(0, pages * PAGE, crate::MAX_EXTENTS, &mut out);
        let got = &out[1..];
        assert!(
            got.len() <= crate::MAX_EXTENTS,
            "{} extents, more than MAX_EXTENTS",
            got.len()
        );
        // A prefix of the range, page by page, data then hole.
        assert!(!got.is_empty());
        for (i, e) in got.iter().enumerate() {
            assert_eq!((e.len, e.hole), (PAGE, i % 2 == 1), "extent {i}");
        }
    }

    /// A query that may list `max` extents lists at most that many, each whole (the first of
    /// a run of written pages spans the run): NBD's REQ_ONE asks for one.
    #[test]
    fn allocation_stops_at_the_most_the_caller_asks_for() {
        let m = MemBackend::new(64 * PAGE).unwrap();
        for p in [0, 1, 2, 5, 9] {
            write(&m, p * PAGE, &[1]);
        }
        for (max, want) in [
            (1, vec![(3, false)]),
            (2, vec![(3, false), (2, true)]),
            (3, vec![(3, false), (2, true), (1, false)]),
        ] {
            let mut out = Vec::new();
            m.allocation(0, 64 * PAGE, max, &mut out);
            let got: Vec<(u64, bool)> = out.iter().map(|e| (e.len / PAGE, e.hole)).collect();
            assert_eq!(got, want, "max {max}");
        }
    }

    #[test]
    fn marks_from_several_threads_add_up() {
        let w = Written::new(4096).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let w = &w;
                s.spawn(move || {
                    for p in (t..4096).step_by(4) {
                        w.mark(p, p + 1);
                    }
                });
            }
        });
        assert!(w.all(0, 4096));
    }

    /// Ranges across words of the record, and its last, partial word.
    #[test]
    fn written_record_spans_words() {
        let w = Written::new(200).unwrap();
        assert!(!w.all(0, 1));
        w.mark(60, 140);
        assert!(w.all(60, 140) && w.all(63, 65) && w.all(127, 129));
        assert!(!w.all(59, 61) && !w.all(139, 141));
        w.clear(64, 128);
        assert!(w.all(60, 64) && w.all(128, 140));
        assert!((64..128).all(|p| !w.all(p, p + 1)));
        w.mark(0, 200);
        assert!(w.all(0, 200));
        w.clear(5, 5);
        assert!(w.all(0, 200), "an empty range clears nothing");
    }
}
