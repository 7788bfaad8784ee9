//! Backends for tests of the layers above the backends (the generic layer here, the server's
//! executor, reactor and frontends): [`Recorder`], and [`Direct512`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::{Backend, Capabilities, Op, QueueIo, Started, Submitter};

/// An 8 MiB backend that records every operation that reaches it (`log`) and keeps its data in
/// memory (`data`, initially all 0xaa). It declares exactly the capabilities it is given, so a
/// test can see what the generic layer emulates, and completes inline or (`asynchronous`)
/// through its notifier, as a backend with threads of its own would (on the calling thread,
/// so tests stay deterministic).
pub struct Recorder {
    caps: Capabilities,
    asynchronous: bool,
    /// FLUSH fails with EIO (or `flush_errno`, when non-zero) while set.
    pub fail_flush: AtomicBool,
    /// The errno a failing FLUSH fails with, when non-zero.
    pub flush_errno: std::sync::atomic::AtomicI32,
    /// While non-zero, a WRITE, WRITE_ZEROES or COPY that reaches this byte (or past it)
    /// fails with EIO (or `fail_errno`, when non-zero).
    pub fail_from: std::sync::atomic::AtomicU64,
    /// The errno `fail_from` fails with, when non-zero.
    pub fail_errno: std::sync::atomic::AtomicI32,
    /// Opening a queue fails (EMFILE, as when the process is out of descriptors) while set.
    pub fail_open: AtomicBool,
    /// READs and WRITEs move at most this many bytes while non-zero (a file shrunk under
    /// the export, a full filesystem): a short transfer.
    pub short: std::sync::atomic::AtomicU32,
    /// The export's bytes.
    pub data: Mutex<Vec<u8>>,
    log: Mutex<Vec<String>>,
}

impl Recorder {
    /// A recorder declaring `caps`, completing inline or through its notifier.
    pub fn new(caps: Capabilities, asynchronous: bool) -> Arc<Recorder> {
        Arc::new(Recorder {
            caps,
            asynchronous,
            fail_flush: AtomicBool::new(false),
            flush_errno: Default::default(),
            fail_from: Default::default(),
            fail_errno: Default::default(),
            fail_open: AtomicBool::new(false),
            short: Default::default(),
            data: Mutex::new(vec![0xaa; 8 << 20]),
            log: Mutex::new(Vec::new()),
        })
    }
    /// One line per operation that reached the backend, e.g. `write 4096+512 fua=false`.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

impl Backend for Recorder {
    fn describe(&self) -> String {
        "recorder".into()
    }
    fn size(&self) -> u64 {
        8 << 20
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 4096)
    }
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn reads_as_zero(&self) -> bool {
        false
    }
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        if self.fail_open.load(Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EMFILE));
        }
        // SAFETY: creating a new descriptor, owned from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Box::new(RecorderQueue {
            b: self,
            ready: Vec::new(),
            efd,
        }))
    }
}

/// A queue on a [`Recorder`].
struct RecorderQueue {
    b: Arc<Recorder>,
    ready: Vec<(u64, i32)>,
    efd: OwnedFd,
}

impl QueueIo for RecorderQueue {
    fn completes_inline(&self) -> bool {
        !self.b.asynchronous
    }
    unsafe fn start(&mut self, op: Op, tag: u64, _sq: &mut dyn Submitter) -> Started {
        let mut data = self.b.data.lock().unwrap();
        let short = self.b.short.load(Ordering::Relaxed);
        let cut = |len: u32| if short > 0 { len.min(short) } else { len };
        let fail_from = self.b.fail_from.load(Ordering::Relaxed);
        let fails = |offset: u64, len: u32| fail_from > 0 && offset + len as u64 > fail_from;
        let failure = match self.b.fail_errno.load(Ordering::Relaxed) {
            0 => -libc::EIO,
            e => -e,
        };
        let (line, res) = match op {
            Op::Read { offset, buf, len } => {
                let len = cut(len);
                let src = &data[offset as usize..][..len as usize];
                // SAFETY: the caller vouches for the buffer.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf, len as usize) };
                (format!("read {offset}+{len}"), len as i32)
            }
            Op::Write { offset, len, .. } if fails(offset, len) => {
                (format!("write {offset}+{len} failed"), failure)
            }
            Op::Write {
                offset,
                buf,
                len,
                fua,
            } => {
                let len = cut(len);
                // SAFETY: the caller vouches for the buffer.
                let src = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                data[offset as usize..][..len as usize].copy_from_slice(src);
                (format!("write {offset}+{len} fua={fua}"), len as i32)
            }
            Op::Flush => (
                "flush".into(),
                if self.b.fail_flush.load(Ordering::Relaxed) {
                    match self.b.flush_errno.load(Ordering::Relaxed) {
                        0 => -libc::EIO,
                        e => -e,
                    }
                } else {
                    0
                },
            ),
            Op::Trim { offset, len, fua } => {
                assert!(!fua, "the generic layer flushes after a FUA trim instead");
                (format!("trim {offset}+{len}"), 0)
            }
            Op::Copy { src, dst, len } if fails(dst, len) => {
                (format!("copy {src}->{dst}+{len} failed"), failure)
            }
            Op::Copy { src, dst, len } => {
                data.copy_within(src as usize..(src + len as u64) as usize, dst as usize);
                (format!("copy {src}->{dst}+{len}"), len as i32)
            }
            Op::WriteZeroes { offset, len, .. } if fails(offset, len) => {
                (format!("zero {offset}+{len} failed"), failure)
            }
            Op::WriteZeroes {
                offset, len, fua, ..
            } => {
                assert!(
                    !fua,
                    "the generic layer flushes after a FUA zeroing instead"
                );
                data[offset as usize..][..len as usize].fill(0);
                (format!("zero {offset}+{len}"), 0)
            }
            // The recorder copies from no descriptor (`copies_from_fd`).
            Op::CopyFrom { .. } => ("copy-from".into(), -libc::EOPNOTSUPP),
        };
        self.b.log.lock().unwrap().push(line);
        if !self.b.asynchronous {
            return Started::Done(res);
        }
        self.ready.push((tag, res));
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        Started::Async
    }
    fn notifier(&self) -> Option<RawFd> {
        self.b.asynchronous.then(|| self.efd.as_raw_fd())
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        for (tag, res) in self.ready.drain(..) {
            done(tag, res);
        }
    }
}

/// Another backend, reporting 512-byte sectors but taking only 4 KiB-aligned I/O, as an
/// O_DIRECT block device of 512-byte sectors does (`file:` with `direct=1`): what a frontend
/// advertises as its block must be the larger.
pub struct Direct512(pub Arc<dyn Backend>);

impl Backend for Direct512 {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 512)
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    fn reads_as_zero(&self) -> bool {
        self.0.reads_as_zero()
    }
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        self.0.clone().open_queue()
    }
    fn buffer_alignment(&self) -> usize {
        4096
    }
}
