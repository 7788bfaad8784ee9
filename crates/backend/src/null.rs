//! `null:SIZE`: reads return zeros, writes are discarded. Measures the protocol, not the storage.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Backend, Capabilities, Op, QueueIo, Started, Submitter, Support};

/// A backend without storage: reads return zeros, writes vanish.
pub struct NullBackend {
    /// Grows with `resize` (read on the control path and at handshakes only).
    size: AtomicU64,
}

impl NullBackend {
    /// A null export of `size` bytes (a non-zero multiple of 512).
    pub fn new(size: u64) -> io::Result<NullBackend> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("null size {size} must be a non-zero multiple of 512"),
            ));
        }
        Ok(NullBackend {
            size: AtomicU64::new(size),
        })
    }
}

impl Backend for NullBackend {
    fn describe(&self) -> String {
        format!("null:{}", crate::format_size(self.size()))
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    /// Just the number: there is no storage to grow.
    fn resize(&self, new_size: u64) -> io::Result<()> {
        self.size
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                (new_size >= old).then_some(new_size)
            })
            .map(drop)
            .map_err(|old| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("null: is {old} bytes and only grows"),
                )
            })
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 4096)
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            trim: Support::Native,
            write_zeroes: Support::Native,
            copy: Support::Native,
            fast_zero: true,
            ..Capabilities::default()
        }
    }
    fn reads_as_zero(&self) -> bool {
        true
    }
    fn allocation(&self, _offset: u64, len: u64, _max: usize, out: &mut Vec<crate::Extent>) {
        out.push(crate::Extent { len, hole: true });
    }

    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        Ok(Box::new(NullQueue))
    }
}

struct NullQueue;

impl QueueIo for NullQueue {
    fn completes_inline(&self) -> bool {
        true
    }
    unsafe fn start(&mut self, op: Op, _tag: u64, _sq: &mut dyn Submitter) -> Started {
        Started::Done(match op {
            Op::Read { buf, len, .. } => {
                // SAFETY: the caller vouches that the buffer holds `len` writable bytes.
                unsafe { std::ptr::write_bytes(buf, 0, len as usize) };
                len as i32
            }
            Op::Write { len, .. } | Op::Copy { len, .. } | Op::CopyFrom { len, .. } => len as i32,
            _ => 0,
        })
    }
}
