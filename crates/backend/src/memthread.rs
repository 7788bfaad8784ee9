//! `memthread:SIZE`: RAM whose operations complete on a helper thread, one per queue.
//!
//! It exists to exercise the asynchronous completion path of the backend contract in the tests
//! and as the model for backends that complete on threads of their own (librbd): `start` hands
//! the operation to the helper and returns [`Started::Async`]; the helper runs it on a
//! [`MemBackend`], queues `(tag, result)` and bumps an eventfd; the queue thread, which watches
//! that eventfd in its own ring ([`QueueIo::notifier`]), collects results with
//! [`QueueIo::reap`]. Allocation queries take the same way. The data path takes no lock: two
//! channels and an eventfd.

use std::io;
use std::os::fd::RawFd;
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::completions::Completions;
use crate::{Backend, Capabilities, Extent, MemBackend, Op, QueueIo, Started, Submitter};

/// What the helper thread is asked to do.
enum Work {
    Io(Op),
    Allocation {
        offset: u64,
        len: u64,
        max: usize,
        out: *mut Vec<Extent>,
    },
}

/// A [`MemBackend`] served by helper threads.
pub struct MemThreadBackend {
    mem: MemBackend,
}

impl MemThreadBackend {
    /// A sparse RAM export of `size` bytes (a non-zero multiple of 512).
    pub fn new(size: u64) -> io::Result<MemThreadBackend> {
        Ok(MemThreadBackend {
            mem: MemBackend::new(size)?,
        })
    }
}

impl Backend for MemThreadBackend {
    fn describe(&self) -> String {
        format!("memthread:{}", crate::format_size(self.mem.size()))
    }
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn resize(&self, _new_size: u64) -> io::Result<()> {
        Err(crate::mem::mapped_at_its_size("memthread:"))
    }
    fn block_sizes(&self) -> (u32, u32) {
        self.mem.block_sizes()
    }
    fn capabilities(&self) -> Capabilities {
        self.mem.capabilities()
    }
    fn reads_as_zero(&self) -> bool {
        self.mem.reads_as_zero()
    }
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) {
        self.mem.allocation(offset, len, max, out)
    }
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        let done = Completions::new()?;
        let poster = done.poster();
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let helper = std::thread::Builder::new()
            .name("blkwire-memthread".into())
            .spawn(move || {
                for job in job_rx {
                    let res = match job.work.0 {
                        // SAFETY: the queue that started the op keeps its buffer valid until the
                        // result is reaped (QueueIo::start's contract), which happens after this.
                        Work::Io(op) => unsafe { self.mem.execute(op) },
                        Work::Allocation {
                            offset,
                            len,
                            max,
                            out,
                        } => {
                            // SAFETY: as above, for the extent list (start_allocation's contract).
                            self.mem.allocation(offset, len, max, unsafe { &mut *out });
                            0
                        }
                    };
                    if !poster.post(job.tag, res) {
                        return;
                    }
                }
            })?;
        Ok(Box::new(MemThreadQueue {
            jobs: Some(jobs),
            done,
            helper: Some(helper),
        }))
    }
}

/// Work on its way to the helper thread.
struct SendWork(Work);
// SAFETY: the raw buffer and extent-list pointers stay valid until the result is reaped
// (QueueIo::start's and start_allocation's contracts), and the queue touches nothing of work
// in flight.
unsafe impl Send for SendWork {}

struct Job {
    work: SendWork,
    tag: u64,
}

impl MemThreadQueue {
    fn send(&mut self, work: Work, tag: u64) -> Started {
        let job = Job {
            work: SendWork(work),
            tag,
        };
        match self.jobs.as_ref().map(|j| j.send(job)) {
            Some(Ok(())) => Started::Async,
            _ => Started::Done(-libc::EIO),
        }
    }
}

struct MemThreadQueue {
    jobs: Option<Sender<Job>>,
    done: Completions,
    helper: Option<JoinHandle<()>>,
}

impl QueueIo for MemThreadQueue {
    fn completes_inline(&self) -> bool {
        false
    }

    unsafe fn start(&mut self, op: Op, tag: u64, _sq: &mut dyn Submitter) -> Started {
        self.send(Work::Io(op), tag)
    }

    unsafe fn start_allocation(
        &mut self,
        offset: u64,
        len: u64,
        max: usize,
        out: *mut Vec<Extent>,
        tag: u64,
        _sq: &mut dyn Submitter,
    ) -> Option<Started> {
        Some(self.send(
            Work::Allocation {
                offset,
                len,
                max,
                out,
            },
            tag,
        ))
    }

    fn notifier(&self) -> Option<RawFd> {
        Some(self.done.notifier())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        self.done.reap(done)
    }
}

impl Drop for MemThreadQueue {
    fn drop(&mut self) {
        // The helper finishes what it was given before the buffers it writes into can go away.
        drop(self.jobs.take());
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
    }
}
