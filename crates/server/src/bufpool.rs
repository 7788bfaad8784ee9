//! Spare data buffers of one connection or datagram port: a request takes one for its data and
//! gives it back when answered, so buffers do not stay with slots and a peer that used every
//! slot once does not keep depth x max I/O bytes allocated.

use blkwire_backend::AlignedBuf;

/// Most bytes of spare buffers kept.
const SPARE_KEEP: usize = 4 << 20;

/// A small pool of aligned buffers.
#[derive(Default)]
pub struct Buffers {
    spare: Vec<AlignedBuf>,
    /// Bytes of every buffer this pool handed out and not freed, spares included.
    allocated: usize,
}

impl Buffers {
    /// A buffer of at least `len` bytes aligned to `align`: a spare one if one is large enough.
    pub fn take(&mut self, len: usize, align: usize) -> AlignedBuf {
        match self.spare.iter().position(|b| b.len() >= len) {
            Some(i) => self.spare.swap_remove(i),
            None => {
                self.allocated += len;
                AlignedBuf::zeroed(len, align)
            }
        }
    }

    /// Whether [`Buffers::take`] of `len` bytes would reuse a spare (allocate nothing).
    pub fn has_spare(&self, len: usize) -> bool {
        self.spare.iter().any(|b| b.len() >= len)
    }

    /// Bytes allocated: buffers held by requests and spares.
    pub fn allocated(&self) -> usize {
        self.allocated
    }

    /// A buffer no request holds any more: kept as a spare while there is room, else freed.
    pub fn give_back(&mut self, buf: AlignedBuf) {
        let spare: usize = self.spare.iter().map(AlignedBuf::len).sum();
        if spare + buf.len() <= SPARE_KEEP {
            self.spare.push(buf);
        } else {
            self.allocated -= buf.len();
        }
    }

    /// Frees a buffer no request holds any more, keeping no spare: its bytes go back to the
    /// budget (a buffer reclaimed for another size of request).
    pub fn free(&mut self, buf: AlignedBuf) {
        self.allocated -= buf.len();
    }

    /// Bytes of spare buffers.
    pub fn spare(&self) -> usize {
        self.spare.iter().map(AlignedBuf::len).sum()
    }

    /// Frees the spares (an idle owner gives its memory back to the budget).
    pub fn clear(&mut self) {
        let spare: usize = self.spare.iter().map(AlignedBuf::len).sum();
        self.allocated -= spare;
        self.spare.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_are_reused_and_bounded() {
        let mut b = Buffers::default();
        let one = b.take(1 << 20, 4096);
        let p = one.as_slice().as_ptr();
        b.give_back(one);
        let again = b.take(4096, 4096);
        assert_eq!(
            again.as_slice().as_ptr(),
            p,
            "a large enough spare is reused"
        );
        b.give_back(again);
        let eight: Vec<_> = (0..8).map(|_| b.take(1 << 20, 4096)).collect();
        for x in eight {
            b.give_back(x);
        }
        let kept: usize = b.spare.iter().map(AlignedBuf::len).sum();
        assert!(kept <= SPARE_KEEP, "{kept} bytes kept");
        assert_eq!(
            b.allocated(),
            kept,
            "what was not kept is no longer counted"
        );
        let held = b.take(8 << 20, 4096);
        assert_eq!(b.allocated(), kept + (8 << 20));
        b.clear();
        assert_eq!(b.allocated(), 8 << 20, "only the held buffer is left");
        b.give_back(held);
        assert_eq!(b.allocated(), 0, "too large to keep: freed");
    }
}
