//! /dev/ublk-control: the commands that add, configure, start, stop, delete and recover a
//! device, each an IORING_OP_URING_CMD on a ring of 128-byte entries.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::abi::*;

pub struct Ctrl {
    fd: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
}

impl Ctrl {
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
    fn cmd(&mut self, op: u32, c: CtrlCmd) -> io::Result<i32> {
        let mut raw = [0u8; 80];
        raw[..CTRL_LEN].copy_from_slice(as_bytes(&c));
        let sqe = opcode::UringCmd80::new(types::Fd(self.fd.as_raw_fd()), op)
            .cmd(raw)
            .build()
            .user_data(op as u64);
        // SAFETY: the buffers `c.addr` points at outlive the call (we wait for its completion).
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

    pub fn features(&mut self) -> io::Result<u64> {
        let mut f = 0u64;
        self.cmd(
            UBLK_U_CMD_GET_FEATURES,
            CtrlCmd {
                dev_id: u32::MAX,
                queue_id: u16::MAX,
                len: 8,
                addr: &mut f as *mut u64 as u64,
                ..Default::default()
            },
        )?;
        Ok(f)
    }

    fn with_buf<T: Copy>(&mut self, op: u32, dev_id: u32, v: &mut T, data: u64) -> io::Result<i32> {
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

    fn simple(&mut self, op: u32, dev_id: u32, data: u64) -> io::Result<i32> {
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

    pub fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let id = info.dev_id;
        self.with_buf(UBLK_U_CMD_ADD_DEV, id, info, 0).map(|_| ())
    }
    pub fn set_params(&mut self, dev_id: u32, p: &mut Params) -> io::Result<()> {
        self.with_buf(UBLK_U_CMD_SET_PARAMS, dev_id, p, 0)
            .map(|_| ())
    }
    pub fn dev_info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut i = DevInfo::default();
        self.with_buf(UBLK_U_CMD_GET_DEV_INFO, dev_id, &mut i, 0)?;
        Ok(i)
    }
    pub fn start(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_START_DEV, dev_id, std::process::id() as u64)
            .map(|_| ())
    }
    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_STOP_DEV, dev_id, 0).map(|_| ())
    }
    pub fn delete(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_DEL_DEV, dev_id, 0).map(|_| ())
    }
    /// Deletes the device once its char device is closed (by us exiting), without waiting:
    /// DEL_DEV would wait forever for a queue thread of ours that still holds it.
    pub fn delete_async(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_DEL_DEV_ASYNC, dev_id, 0).map(|_| ())
    }
    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(UBLK_U_CMD_START_USER_RECOVERY, dev_id, 0)
            .map(|_| ())
    }
    pub fn end_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(
            UBLK_U_CMD_END_USER_RECOVERY,
            dev_id,
            std::process::id() as u64,
        )
        .map(|_| ())
    }
}

/// The flags a mapping needs, with their names for the error message.
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
