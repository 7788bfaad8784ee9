//! /dev/ublk-control: the commands that add, configure, start, stop, delete and recover a
//! device, each an IORING_OP_URING_CMD on a ring of 128-byte entries.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::abi::*;

/// An open /dev/ublk-control with the ring its commands go through.
pub struct Ctrl {
    fd: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
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
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(4)
            .map_err(|e| format!("creating an io_uring with 128-byte entries: {e}"))?;
        Ok(Ctrl { fd, ring })
    }

    /// Runs one control command; returns its non-negative result or the error.
    ///
    /// # Safety
    ///
    /// Unless it is 0, `c.addr` must point at `c.len` bytes that the command may read and (for a
    /// command that answers in it) write with any values, valid for the call.
    unsafe fn cmd(&mut self, op: u32, c: CtrlCmd) -> io::Result<i32> {
        let mut raw = [0u8; 80];
        // SAFETY: CtrlCmd is repr(C) u32, u16, u16, u64, u64, u16, u16, u32: no padding (the
        // layout test checks its 32 bytes).
        raw[..CTRL_LEN].copy_from_slice(unsafe { as_bytes(&c) });
        let sqe = opcode::UringCmd80::new(types::Fd(self.fd.as_raw_fd()), op)
            .cmd(raw)
            .build()
            .user_data(op as u64);
        // SAFETY: what `c.addr` points at outlives the call (the caller's word; we wait for the
        // completion before returning).
        unsafe {
            self.ring
                .submission()
                .push(&sqe)
                .map_err(|_| io::Error::other("control ring full"))?;
        }
        self.ring.submit_and_wait(1)?;
        let cqe = self
            .ring
            .completion()
            .next()
            .ok_or_else(|| io::Error::other("no completion for a control command"))?;
        let r = cqe.result();
        if r < 0 {
            return Err(io::Error::from_raw_os_error(-r));
        }
        Ok(r)
    }

    /// GET_FEATURES: the UBLK_F_* flags this driver supports.
    pub fn features(&mut self) -> io::Result<u64> {
        let mut f = 0u64;
        // SAFETY: addr is `f`, 8 bytes (len) that live across the call; any value is a u64.
        unsafe {
            self.cmd(
                UBLK_U_CMD_GET_FEATURES,
                CtrlCmd {
                    dev_id: u32::MAX,
                    queue_id: u16::MAX,
                    len: 8,
                    addr: &mut f as *mut u64 as u64,
                    ..Default::default()
                },
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
        // SAFETY: addr is `v`, an exclusive borrow of len bytes that lives across the call, and
        // any bytes the kernel writes there make a valid T (the caller's word).
        unsafe {
            self.cmd(
                op,
                CtrlCmd {
                    dev_id,
                    queue_id: u16::MAX,
                    len: std::mem::size_of::<T>() as u16,
                    addr: v as *mut T as u64,
                    data,
                    ..Default::default()
                },
            )
        }
    }

    /// A command without a buffer.
    fn simple(&mut self, op: u32, dev_id: u32, data: u64) -> io::Result<i32> {
        // SAFETY: addr is 0: the command refers to no memory of ours.
        unsafe {
            self.cmd(
                op,
                CtrlCmd {
                    dev_id,
                    queue_id: u16::MAX,
                    data,
                    ..Default::default()
                },
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
