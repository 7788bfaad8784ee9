//! `mem:SIZE`: sparse RAM. An anonymous `MAP_NORESERVE` mapping: the kernel backs a page only once
//! it is written and returns the shared zero page for everything else, so a `mem:1T` export costs
//! nothing until used. TRIM and WRITE_ZEROES hand whole pages back with `MADV_DONTNEED`.

use std::io;
use std::sync::Arc;

use crate::{Backend, Caps, Op, QueueIo, Started, Submitter};

const PAGE: u64 = 4096;

pub struct MemBackend {
    base: *mut u8,
    size: u64,
}

// SAFETY: the mapping lives as long as the backend and is only accessed through raw copies of
// ranges that the generic layer has bounds-checked. Concurrent writes to the same range from
// different queues race exactly as they would on a disk; the protocol gives no ordering between
// queues (PROTOCOL.md §2.4).
unsafe impl Send for MemBackend {}
unsafe impl Sync for MemBackend {}

impl MemBackend {
    pub fn new(size: u64) -> io::Result<MemBackend> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("mem size {size} must be a non-zero multiple of 512"),
            ));
        }
        let len = usize::try_from(size).map_err(|_| io::Error::other("mem size too large"))?;
        // SAFETY: fresh anonymous private mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MemBackend {
            base: p.cast(),
            size,
        })
    }

    /// Bytes of RAM actually backing the export (pages written and not trimmed).
    pub fn resident_bytes(&self) -> u64 {
        let pages = self.size.div_ceil(PAGE) as usize;
        let mut vec = vec![0u8; pages];
        // SAFETY: base..base+size is our mapping; vec has one byte per page.
        let r = unsafe { libc::mincore(self.base.cast(), self.size as usize, vec.as_mut_ptr()) };
        if r != 0 {
            return self.size;
        }
        vec.iter().filter(|b| **b & 1 != 0).count() as u64 * PAGE
    }

    fn zero_range(&self, offset: u64, len: u64) {
        // Partial pages at either end are memset; whole pages in between are dropped, which both
        // zeroes them and returns their memory.
        let end = offset + len;
        let first_full = offset.div_ceil(PAGE) * PAGE;
        let last_full = end / PAGE * PAGE;
        // SAFETY (all three blocks): ranges are within the mapping (checked by Export).
        unsafe {
            if first_full >= last_full {
                std::ptr::write_bytes(self.base.add(offset as usize), 0, len as usize);
                return;
            }
            std::ptr::write_bytes(
                self.base.add(offset as usize),
                0,
                (first_full - offset) as usize,
            );
            std::ptr::write_bytes(
                self.base.add(last_full as usize),
                0,
                (end - last_full) as usize,
            );
            libc::madvise(
                self.base.add(first_full as usize).cast(),
                (last_full - first_full) as usize,
                libc::MADV_DONTNEED,
            );
        }
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
        // Pages the kernel has not backed read as zero: they are the holes.
        let first = offset / PAGE;
        let end = offset + len;
        let pages = (end.div_ceil(PAGE) - first) as usize;
        let start_len = out.len();
        let mut vec = vec![0u8; pages.min(crate::MAX_EXTENTS * 16)];
        // SAFETY: the range lies inside our mapping (checked by Export); one byte per page.
        let r = unsafe {
            libc::mincore(
                self.base.add((first * PAGE) as usize).cast(),
                vec.len() * PAGE as usize,
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
            if out.len() - start_len >= crate::MAX_EXTENTS {
                break;
            }
        }
    }

    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        Ok(Box::new(MemQueue { mem: self }))
    }
}

/// Per-queue handle: just the mapping; every op completes inline with a memcpy.
struct MemQueue {
    mem: Arc<MemBackend>,
}

impl QueueIo for MemQueue {
    fn completes_inline(&self) -> bool {
        true
    }
    fn start(&mut self, op: Op, _user_data: u64, _sq: &mut dyn Submitter) -> Started {
        let mem = &*self.mem;
        // SAFETY (copies): ranges were bounds-checked by Export; buffers belong to the caller.
        match op {
            Op::Read { offset, buf, len } => unsafe {
                std::ptr::copy_nonoverlapping(mem.base.add(offset as usize), buf, len as usize);
            },
            Op::Write {
                offset, buf, len, ..
            } => unsafe {
                std::ptr::copy_nonoverlapping(buf, mem.base.add(offset as usize), len as usize);
            },
            Op::Flush => {}
            Op::Trim { offset, len } | Op::WriteZeroes { offset, len, .. } => {
                mem.zero_range(offset, len as u64)
            }
        }
        Started::Done(0)
    }
}
