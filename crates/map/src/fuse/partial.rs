//! READ/WRITE requests that cover only part of a logical block of the export.
//!
//! The loop device sends whole logical blocks, but FUSE cuts a direct I/O request into pieces
//! of at most `max_pages` pages of the caller's memory, whatever their byte count
//! (`fuse_direct_io`), and O_DIRECT on a block device needs buffers aligned only to its
//! dma_alignment (512 bytes), not to its logical block. A 1 MiB request from a buffer 512 bytes
//! into a page spans 257 pages and reaches us as 1 MiB - 512 bytes, then 512 bytes; a request of
//! many small iovecs crosses `max_pages` pages long before `max_io` bytes. No limit we can set
//! rules this out: the loop device's max_sectors_kb bounds bytes, its segment limit (not ours
//! to set) segments, neither pages; capping max_sectors_kb a page below max_io would only fix
//! the single-buffer case, and would cut every aligned 1 MiB request in two. `max_pages` is
//! capped by the kernel's fs.fuse.max_pages_limit (256 by default). So the worker serves such
//! pieces itself: the aligned middle as usual, the partial first and last blocks whole. A READ reads those blocks and keeps its part of them. A WRITE reads the block, puts
//! its bytes in and writes the block back, holding the block's lock in `BlockLocks` from
//! before the read until the write is done: the other piece that shares the block (the rest of
//! the same loop request) may be in flight at the same time, on any worker.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::sys::Waker;

/// Where an edge of a request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A WRITE's edge waiting for its block's lock.
    Lock,
    /// The block's read is to be sent, or in flight.
    Read,
    Reading,
    /// The merged block's write is to be sent, or in flight (WRITE only).
    Write,
    Writing,
    Done,
}

impl Step {
    /// The step to take again when the command in flight will not be answered (its connection
    /// lost) or must be sent again (the target refused it for want of memory): its sending.
    pub(crate) fn again(self) -> Step {
        match self {
            Step::Reading => Step::Read,
            Step::Writing => Step::Write,
            s => s,
        }
    }
}

/// A partial first or last block of a READ or WRITE.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Edge {
    /// The block's offset in the export.
    pub at: u64,
    /// Where the request's bytes are in the block.
    pub into: usize,
    /// Where they are in the request's bytes, and how many.
    pub from: usize,
    pub len: usize,
    pub step: Step,
    /// Holds the block's lock (a WRITE's edge between `Lock` and `Done`).
    pub locked: bool,
    /// A WRITE's block: as read, then with the request's bytes in.
    pub block: Vec<u8>,
}

/// A request cut at logical block boundaries: the whole blocks in the middle (`mid_len` bytes
/// at `mid_offset`, starting `mid_from` bytes into the request; possibly none) and at most two
/// partial blocks, the lower first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split {
    pub mid_offset: u64,
    pub mid_len: u64,
    pub mid_from: usize,
    pub edges: Vec<Edge>,
}

/// Cuts `len` bytes at `offset` at the boundaries of `block`-byte blocks (a power of two).
pub(crate) fn split(offset: u64, len: u64, block: u64, write: bool) -> Split {
    let end = offset + len;
    let first = offset.next_multiple_of(block); // first boundary at or after the start
    let last = end - end % block; // last boundary at or before the end
    let edge = |from: u64, to: u64| Edge {
        at: from - from % block,
        into: (from % block) as usize,
        from: (from - offset) as usize,
        len: (to - from) as usize,
        step: if write { Step::Lock } else { Step::Read },
        locked: false,
        block: Vec::new(),
    };
    if first > last {
        // Within one block, touching neither of its ends.
        return Split {
            mid_offset: offset,
            mid_len: 0,
            mid_from: 0,
            edges: vec![edge(offset, end)],
        };
    }
    let mut edges = Vec::new();
    if offset < first {
        edges.push(edge(offset, first));
    }
    if last < end {
        edges.push(edge(last, end));
    }
    Split {
        mid_offset: first,
        mid_len: last - first,
        mid_from: (first - offset) as usize,
        edges,
    }
}

/// Blocks under read-modify-write, shared by all workers of a mapping. A worker whose edge
/// finds its block taken waits; every release wakes all workers, which try again.
#[derive(Default)]
pub(crate) struct BlockLocks {
    held: Mutex<HashSet<u64>>,
    wakers: Mutex<Vec<Arc<Waker>>>,
}

impl BlockLocks {
    /// Wakes `w`'s worker whenever a block is released.
    pub fn watch(&self, w: Arc<Waker>) {
        self.wakers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(w);
    }

    /// Takes the lock of the block at `at`; false if someone holds it.
    pub fn try_take(&self, at: u64) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(at)
    }

    pub fn release(&self, at: u64) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&at);
        for w in self.wakers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            Waker::wake(w.fd());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(s: &Split) -> Vec<(u64, usize, usize, usize)> {
        s.edges
            .iter()
            .map(|e| (e.at, e.into, e.from, e.len))
            .collect()
    }

    #[test]
    fn the_pieces_fuse_cuts_a_request_into_split_at_block_boundaries() {
        const B: u64 = 4096;
        // 1 MiB from a buffer 512 bytes into a page: 1 MiB - 512, then 512.
        let a = split(1 << 20, (1 << 20) - 512, B, true);
        assert_eq!(
            (a.mid_offset, a.mid_len, a.mid_from),
            (1 << 20, (1 << 20) - B, 0)
        );
        assert_eq!(
            ranges(&a),
            [((2 << 20) - B, 0, (1 << 20) - B as usize, 3584)]
        );
        assert_eq!(a.edges[0].step, Step::Lock);
        let b = split((2 << 20) - 512, 512, B, true);
        assert_eq!((b.mid_len, b.mid_from), (0, 512));
        assert_eq!(ranges(&b), [((2 << 20) - B, 3584, 0, 512)]);
        // A middle piece, partial at both ends.
        let c = split(B + 3584, 3 * B, B, false);
        assert_eq!((c.mid_offset, c.mid_len, c.mid_from), (2 * B, 2 * B, 512));
        assert_eq!(
            ranges(&c),
            [(B, 3584, 0, 512), (4 * B, 0, 512 + 2 * B as usize, 3584)]
        );
        assert_eq!(c.edges[0].step, Step::Read);
        // Inside one block, touching neither end.
        let d = split(B + 512, 1024, B, true);
        assert_eq!(d.mid_len, 0);
        assert_eq!(ranges(&d), [(B, 512, 0, 1024)]);
        // Two partial blocks and nothing between them.
        let e = split(B + 2048, B, B, true);
        assert_eq!(e.mid_len, 0);
        assert_eq!(ranges(&e), [(B, 2048, 0, 2048), (2 * B, 0, 2048, 2048)]);
        // Aligned: no edges.
        let f = split(B, 2 * B, B, true);
        assert_eq!((f.mid_offset, f.mid_len, f.edges.len()), (B, 2 * B, 0));
    }

    #[test]
    fn a_block_lock_is_held_once_and_its_release_wakes_every_worker() {
        let l = BlockLocks::default();
        let w = Arc::new(Waker::new().unwrap());
        l.watch(Arc::clone(&w));
        assert!(l.try_take(4096));
        assert!(!l.try_take(4096));
        assert!(l.try_take(8192));
        l.release(4096);
        let mut p = libc::pollfd {
            fd: w.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd of ours.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        assert_eq!(n, 1, "release woke the worker");
        assert!(l.try_take(4096));
    }
}
