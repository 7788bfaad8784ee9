//! `mem:SIZE`: sparse RAM, held in a memfd (an unlinked tmpfs file). A page exists only once it
//! is written, so a `mem:1T` export costs nothing until used, and the kernel's own bookkeeping
//! answers "where is data" exactly (SEEK_DATA/SEEK_HOLE) for `cp` and NBD block status.
//!
//! Writes copy into a shared mapping of the memfd. Reads use `pread`, not the mapping: a read
//! fault on a hole would allocate a page and make never-written ranges look allocated (`pread`
//! of a hole returns zeros without allocating). So `mincore` on the mapping tells exactly which
//! pages hold data, at a cost bounded by the range asked about (SEEK_HOLE on tmpfs walks every
//! page up to the next hole, which can be the whole export). TRIM and WRITE_ZEROES punch holes,
//! returning the memory.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::{Backend, Caps, Op, QueueIo, Started, Submitter};

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
unsafe impl Sync for MemBackend {}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl MemBackend {
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
            return Err(io::Error::last_os_error());
        }
        Ok(MemBackend {
            fd,
            base: p.cast(),
            size,
        })
    }

    /// Bytes of RAM actually backing the export (pages written and not trimmed).
    pub fn resident_bytes(&self) -> u64 {
        // SAFETY: fstat on our fd into a zeroed stat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
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

    fn read(&self, offset: u64, buf: *mut u8, len: u32) -> i32 {
        let mut done = 0usize;
        while done < len as usize {
            // SAFETY: the caller's buffer holds `len` bytes; the range is inside the file.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
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
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new() mapped; no queue outlives the backend (Arc).
        unsafe { libc::munmap(self.base.cast(), self.size as usize) };
    }
}

impl Backend for MemBackend {
    fn describe(&self) -> String {
        format!("mem:{}", crate::format_size(self.size))
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 4096)
    }
    fn caps(&self) -> Caps {
        Caps {
            flush: false,
            fua: false,
            trim: true,
            write_zeroes: true,
            rotational: false,
            fast_zero: true,
        }
    }
    fn reads_as_zero(&self) -> bool {
        self.resident_bytes() == 0
    }
    fn allocation(&self, offset: u64, len: u64, out: &mut Vec<crate::Extent>) {
        const PAGE: u64 = 4096;
        let first = offset / PAGE;
        let end = offset + len;
        let pages = ((end.div_ceil(PAGE) - first) as usize).min(crate::MAX_EXTENTS * 16);
        let mut vec = vec![0u8; pages];
        // SAFETY: the pages lie inside our mapping (range checked by Export); one byte per page.
        let r = unsafe {
            libc::mincore(
                self.base.add((first * PAGE) as usize).cast(),
                pages * PAGE as usize,
                vec.as_mut_ptr(),
            )
        };
        if r != 0 {
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
    fn start(&mut self, op: Op, _user_data: u64, _sq: &mut dyn Submitter) -> Started {
        let mem = &*self.mem;
        Started::Done(match op {
            Op::Read { offset, buf, len } => mem.read(offset, buf, len),
            Op::Write {
                offset, buf, len, ..
            } => {
                // SAFETY: range bounds-checked by Export; the caller's buffer holds `len` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(buf, mem.base.add(offset as usize), len as usize)
                };
                0
            }
            Op::Flush => 0,
            Op::Trim { offset, len }
            | Op::WriteZeroes {
                offset,
                len,
                no_hole: false,
            } => mem.punch(offset, len as u64),
            Op::WriteZeroes {
                offset,
                len,
                no_hole: true,
            } => {
                // Allocated zeros, as asked: write them.
                // SAFETY: range bounds-checked by Export.
                unsafe { std::ptr::write_bytes(mem.base.add(offset as usize), 0, len as usize) };
                0
            }
        })
    }
}
