//! /dev/ublk-control: the commands that add, configure, start, stop, delete and recover a
//! device, each an IORING_OP_URING_CMD on a ring of 128-byte entries.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::abi::*;

type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

fn new_ring() -> io::Result<Ring> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(4)
}

/// An open /dev/ublk-control with the ring its commands go through.
pub struct Ctrl {
    fd: File,
    /// None after a command was given up on (`cmd`): the next command makes a new ring, so an
    /// entry of the old one that was never submitted cannot run later, nor its late completion
    /// be taken for another command's.
    ring: Option<Ring>,
    /// The user_data of the last command submitted: each gets the next, so that a completion is
    /// only ever taken for the command that made it.
    last: u64,
}

/// Where `wait_completion` finds completions and waits for more.
trait Completions {
    /// The completions queued now, as (user_data, result).
    fn reap(&mut self) -> Vec<(u64, i32)>;
    /// Submits what is queued and waits until at least one completion arrives, or the wait is
    /// interrupted.
    fn wait(&mut self) -> io::Result<()>;
}

impl Completions for Ring {
    fn reap(&mut self) -> Vec<(u64, i32)> {
        self.completion()
            .map(|c| (c.user_data(), c.result()))
            .collect()
    }
    fn wait(&mut self) -> io::Result<()> {
        self.submit_and_wait(1).map(|_| ())
    }
}

/// Waits for the completion whose user_data is `want` and returns its result. The driver runs
/// control commands on io-wq, so the command is usually still running when io_uring_enter
/// returns: a wait that ends without its completion (EINTR; or the number submitted, which
/// io_uring_enter returns when a signal, SIGSTOP/SIGCONT or a ptrace attach ends the wait after
/// it submitted) is waited again, since the kernel may still write the command's buffer.
/// Completions of other commands are dropped: one that arrives after its command was given up on
/// must not be taken for this one's. EAGAIN and EBUSY (no memory for the submission yet, or
/// completions to reap first) are retried too; any other error is returned, the command's fate
/// unknown.
fn wait_completion(want: u64, ring: &mut impl Completions) -> io::Result<i32> {
    loop {
        if let Some((_, r)) = ring.reap().into_iter().find(|&(u, _)| u == want) {
            return Ok(r);
        }
        match ring.wait() {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(e) => return Err(e),
        }
    }
}

impl Ctrl {
    /// Opens the control device (ublk_drv must be loaded).
    pub fn open() -> Result<Ctrl, String> {
        let fd = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(UBLK_CONTROL)
            .map_err(|e| format!("{UBLK_CONTROL}: {e}"))?;
        let ring =
            new_ring().map_err(|e| format!("creating an io_uring with 128-byte entries: {e}"))?;
        Ok(Ctrl {
            fd,
            ring: Some(ring),
            last: 0,
        })
    }

    /// Runs one control command; returns its non-negative result or the error. With `v`, the
    /// command reads and (for one that answers in it) writes a copy of `*v` on the heap, copied
    /// back once it completed: if waiting fails, the command may still be running, and that copy
    /// is leaked rather than freed or reused.
    ///
    /// # Safety
    ///
    /// `T` must be the kernel's struct for `op`, made of integers only, so that whatever the
    /// kernel writes into it is a valid `T`.
    unsafe fn cmd<T: Copy>(
        &mut self,
        op: u32,
        mut c: CtrlCmd,
        v: Option<&mut T>,
    ) -> io::Result<i32> {
        let ring = match &mut self.ring {
            Some(r) => r,
            None => self.ring.insert(new_ring()?),
        };
        let buf = match &v {
            Some(v) => Box::into_raw(Box::new(**v)),
            None => std::ptr::null_mut(),
        };
        if !buf.is_null() {
            c.addr = buf as u64;
            c.len = std::mem::size_of::<T>() as u16;
        }
        let mut raw = [0u8; 80];
        // SAFETY: CtrlCmd is repr(C) u32, u16, u16, u64, u64, u16, u16, u32: no padding (the
        // layout test checks its 32 bytes).
        raw[..CTRL_LEN].copy_from_slice(unsafe { as_bytes(&c) });
        self.last += 1;
        let id = self.last;
        let sqe = opcode::UringCmd80::new(types::Fd(self.fd.as_raw_fd()), op)
            .cmd(raw)
            .build()
            .user_data(id);
        // SAFETY: `buf` stays allocated until the command's completion has been seen, and is
        // leaked if it never is (below).
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            if !buf.is_null() {
                // SAFETY: from Box::into_raw above, and never given to the kernel.
                drop(unsafe { Box::from_raw(buf) });
            }
            return Err(io::Error::other("control ring full"));
        }
        let r = match wait_completion(id, ring) {
            Ok(r) => r,
            Err(e) => {
                // The command may be queued or running: its buffer stays ours forever, and the
                // ring goes, taking any entry not yet submitted with it.
                self.ring = None;
                return Err(e);
            }
        };
        if !buf.is_null() {
            // SAFETY: from Box::into_raw above; the command completed, so the kernel is done
            // with it, and whatever it wrote is a valid T (the caller's word).
            let done = unsafe { Box::from_raw(buf) };
            if let Some(v) = v {
                *v = *done;
            }
        }
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(r)
    }

    /// GET_FEATURES: the UBLK_F_* flags this driver supports.
    pub fn features(&mut self) -> io::Result<u64> {
        let mut f = 0u64;
        // SAFETY: any 8 bytes are a u64.
        unsafe {
            self.cmd(
                UBLK_U_CMD_GET_FEATURES,
                CtrlCmd {
                    dev_id: u32::MAX,
                    queue_id: u16::MAX,
                    ..Default::default()
                },
                Some(&mut f),
            )
        }?;
        Ok(f)
    }

    /// A command that reads `v`, or answers in it.
    ///
    /// # Safety
    ///
    /// `T` must be the kernel's struct for `op`, made of integers only, so that whatever the
    /// kernel writes into it is a valid `T`.
    unsafe fn with_buf<T: Copy>(
        &mut self,
        op: u32,
        dev_id: u32,
        v: &mut T,
        data: u64,
    ) -> io::Result<i32> {
        // SAFETY: T is the kernel's integers-only struct for op (the caller's word).
        unsafe {
            self.cmd(
                op,
                CtrlCmd {
                    dev_id,
                    queue_id: u16::MAX,
                    data,
                    ..Default::default()
                },
                Some(v),
            )
        }
    }

    /// A command without a buffer.
    fn simple(&mut self, op: u32, dev_id: u32, data: u64) -> io::Result<i32> {
        // SAFETY: no buffer: addr stays 0, the command refers to no memory of ours.
        unsafe {
            self.cmd::<u64>(
                op,
                CtrlCmd {
                    dev_id,
                    queue_id: u16::MAX,
                    data,
                    ..Default::default()
                },
                None,
            )
        }
    }

    /// ADD_DEV: creates a device as `info` asks; the kernel fills in what it chose (id, flags).
    pub fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let id = info.dev_id;
        // SAFETY: DevInfo is struct ublksrv_ctrl_dev_info, integers only.
        unsafe { self.with_buf(UBLK_U_CMD_ADD_DEV, id, info, 0) }.map(|_| ())
    }
    /// SET_PARAMS: block sizes, limits and attributes, before START_DEV.
    pub fn set_params(&mut self, dev_id: u32, p: &mut Params) -> io::Result<()> {
        // SAFETY: Params is struct ublk_params, integers only.
        unsafe { self.with_buf(UBLK_U_CMD_SET_PARAMS, dev_id, p, 0) }.map(|_| ())
    }
    /// GET_DEV_INFO: the device as the kernel has it.
    pub fn dev_info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut i = DevInfo::default();
        // SAFETY: DevInfo is struct ublksrv_ctrl_dev_info, integers only.
        unsafe { self.with_buf(UBLK_U_CMD_GET_DEV_INFO, dev_id, &mut i, 0) }?;
        Ok(i)
    }
    /// START_DEV: the block device appears; its I/O goes to our queues.
    pub fn start(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_START_DEV, dev_id, std::process::id() as u64)
            .map(|_| ())
    }
    /// STOP_DEV: the block device goes; every fetch completes with ABORT.
    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_STOP_DEV, dev_id, 0).map(|_| ())
    }
    /// DEL_DEV: removes the device, waiting until its char device is closed.
    pub fn delete(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_DEL_DEV, dev_id, 0).map(|_| ())
    }
    /// Deletes the device once its char device is closed (by us exiting), without waiting:
    /// DEL_DEV would wait forever for a queue thread of ours that still holds it.
    pub fn delete_async(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_DEL_DEV_ASYNC, dev_id, 0).map(|_| ())
    }
    /// Removes the device without waiting for its last opener: DEL_DEV waits, without bound
    /// (interrupted only by a signal), until every process holding /dev/ublkbN open lets go,
    /// and a reader without O_EXCL (a VM, `dd`) is not one `refuse_in_use` can see. The block
    /// device goes at once either way; the number is freed with the last reference. Kernels
    /// before DEL_DEV_ASYNC (Linux 6.9) refuse the command, and get DEL_DEV.
    pub fn remove(&mut self, dev_id: u32) -> io::Result<()> {
        match self.delete_async(dev_id) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                self.delete(dev_id)
            }
            r => r,
        }
    }
    /// START_USER_RECOVERY: a quiesced device (its daemon died) is taken over.
    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_START_USER_RECOVERY, dev_id, 0)
            .map(|_| ())
    }
    /// END_USER_RECOVERY: the new daemon fetched every tag; held I/O is issued again.
    pub fn end_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(
            UBLK_U_CMD_END_USER_RECOVERY,
            dev_id,
            std::process::id() as u64,
        )
        .map(|_| ())
    }
}

/// Checks that the driver answers GET_FEATURES with every flag a mapping needs.
pub(crate) fn probe(ctrl: &mut Ctrl) -> Result<(), String> {
    let f = ctrl.features().map_err(|e| {
        format!("the kernel's ublk driver does not answer GET_FEATURES ({e}): it needs Linux >= 6.5; use --frontend fuse")
    })?;
    let missing = missing_features(f);
    if !missing.is_empty() {
        return Err(format!(
            "the kernel's ublk driver lacks {} (features {f:#x}); use --frontend fuse",
            missing.join(", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// How one wait ends, and the completions (user_data, result) that arrived during it.
    type Wait = (io::Result<()>, Vec<(u64, i32)>);

    /// A ring whose waits end as scripted: each wait returns its result after the completions
    /// listed with it have arrived.
    struct Script {
        queued: Vec<(u64, i32)>,
        waits: VecDeque<Wait>,
    }

    impl Completions for Script {
        fn reap(&mut self) -> Vec<(u64, i32)> {
            std::mem::take(&mut self.queued)
        }
        fn wait(&mut self) -> io::Result<()> {
            let (r, arrive) = self
                .waits
                .pop_front()
                .expect("waited again after the command's completion had arrived");
            self.queued.extend(arrive);
            r
        }
    }

    fn errno(e: i32) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(e))
    }

    #[test]
    fn a_control_command_is_waited_for_until_its_own_completion() {
        let mut ring = Script {
            queued: Vec::new(),
            waits: VecDeque::from([
                // io_uring_enter returned 1 (submitted): SIGSTOP/SIGCONT cut its wait short.
                (Ok(()), vec![]),
                (errno(libc::EINTR), vec![]),
                (errno(libc::EAGAIN), vec![]),
                // A late completion of a command given up on earlier.
                (Ok(()), vec![(6, -libc::ENODEV)]),
                (Ok(()), vec![(7, 64)]),
            ]),
        };
        assert_eq!(wait_completion(7, &mut ring).unwrap(), 64);
        assert!(ring.waits.is_empty());
    }

    #[test]
    fn a_stale_completion_is_not_taken_for_the_next_command() {
        let mut ring = Script {
            queued: vec![(2, -libc::EBUSY)],
            waits: VecDeque::from([(Ok(()), vec![(3, 0)])]),
        };
        assert_eq!(wait_completion(3, &mut ring).unwrap(), 0);
        // Both completions arrived together, the stale one first.
        let mut ring = Script {
            queued: Vec::new(),
            waits: VecDeque::from([(Ok(()), vec![(4, -libc::EINVAL), (5, 8)])]),
        };
        assert_eq!(wait_completion(5, &mut ring).unwrap(), 8);
    }

    #[test]
    fn a_failed_wait_is_an_error_not_a_result() {
        let mut ring = Script {
            queued: Vec::new(),
            waits: VecDeque::from([(errno(libc::EBADF), vec![])]),
        };
        let e = wait_completion(1, &mut ring).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
