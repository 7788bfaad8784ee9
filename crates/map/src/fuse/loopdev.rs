//! Loop devices (linux/loop.h): bind a file to /dev/loopN with LOOP_CONFIGURE, swap the file of a
//! read-only device with LOOP_CHANGE_FD, detach with LOOP_CLR_FD, and the sysfs attributes that
//! tell what a device is bound to.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_CHANGE_FD: libc::c_ulong = 0x4C06;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_ADD: libc::c_ulong = 0x4C80;
const LOOP_CTL_REMOVE: libc::c_ulong = 0x4C81;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

// The kernel ABI sizes; a layout mistake here would corrupt the ioctl.
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// `/dev/loopN`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopDev {
    /// N of /dev/loopN.
    pub index: u32,
}

/// Outcome of a detach request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detach {
    /// The device let go of its file.
    Done,
    /// Someone still has the device open: the kernel detaches it at their last close.
    Deferred,
    /// The device was not bound.
    NotBound,
}

fn open_dev(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: NUL-terminated path; result checked.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ioctl_ret(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl LoopDev {
    /// Accepts `/dev/loop3` or `loop3`.
    pub fn parse(s: &str) -> Option<LoopDev> {
        let name = s.strip_prefix("/dev/").unwrap_or(s);
        let n = name.strip_prefix("loop")?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || n.len() > 9 {
            return None;
        }
        n.parse().ok().map(|index| LoopDev { index })
    }

    /// `/dev/loopN`.
    pub fn path(&self) -> String {
        format!("/dev/loop{}", self.index)
    }

    fn sys(&self, rel: &str) -> PathBuf {
        PathBuf::from(format!("/sys/block/loop{}/{rel}", self.index))
    }

    /// The first unbound loop device, created if needed. Not reserved: LOOP_CONFIGURE on it can
    /// still fail with EBUSY if another program binds it first.
    pub fn get_free() -> io::Result<LoopDev> {
        let ctl = open_dev("/dev/loop-control", libc::O_RDWR)?;
        // SAFETY: LOOP_CTL_GET_FREE takes no argument.
        let n = ioctl_ret(unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) })?;
        Ok(LoopDev { index: n as u32 })
    }

    /// `get_free`, but never one of `skip`: LOOP_CTL_GET_FREE names the lowest unbound device
    /// again and again, so past a skipped one this takes the first other unbound device, or
    /// creates one. Not reserved either.
    pub fn get_free_except(skip: &[u32]) -> io::Result<LoopDev> {
        let free = LoopDev::get_free()?;
        if !skip.contains(&free.index) {
            return Ok(free);
        }
        let mut index = 0;
        loop {
            let d = LoopDev { index };
            if !skip.contains(&index) {
                if !d.sys("").exists() {
                    return LoopDev::ensure(index).map(|(d, _)| d);
                }
                if d.backing_file().is_none() {
                    return Ok(d);
                }
            }
            index = index
                .checked_add(1)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSPC))?;
        }
    }

    /// Makes sure /dev/loopN exists (LOOP_CTL_ADD; an existing device is fine); says whether
    /// it was created here (a failed map removes it again: `remove`).
    pub fn ensure(index: u32) -> io::Result<(LoopDev, bool)> {
        let ctl = open_dev("/dev/loop-control", libc::O_RDWR)?;
        // SAFETY: LOOP_CTL_ADD takes the index by value.
        let r = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_ADD, index as libc::c_ulong) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
            return Ok((LoopDev { index }, false));
        }
        Ok((LoopDev { index }, true))
    }

    /// Removes the device (LOOP_CTL_REMOVE): one `ensure` created for a map that failed.
    /// Refused (EBUSY) while it is bound or open.
    pub fn remove(&self) -> io::Result<()> {
        let ctl = open_dev("/dev/loop-control", libc::O_RDWR)?;
        // SAFETY: LOOP_CTL_REMOVE takes the index by value.
        let r = unsafe {
            libc::ioctl(
                ctl.as_raw_fd(),
                LOOP_CTL_REMOVE,
                self.index as libc::c_ulong,
            )
        };
        ioctl_ret(r).map(|_| ())
    }

    /// Binds `file` with direct I/O (so the data is not cached both in the loop device's page
    /// cache and below it), the given logical block size, and read-only if asked. EBUSY: bound.
    pub fn configure(
        &self,
        file: &File,
        block_size: u32,
        read_only: bool,
        label: &str,
    ) -> io::Result<()> {
        let flags = if read_only {
            libc::O_RDONLY
        } else {
            libc::O_RDWR
        };
        let dev = open_dev(&self.path(), flags)?;
        // SAFETY: an all-zero loop_config is valid (every field is an integer or byte array).
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = file.as_raw_fd() as u32;
        cfg.block_size = block_size;
        cfg.info.lo_flags = LO_FLAGS_DIRECT_IO | if read_only { LO_FLAGS_READ_ONLY } else { 0 };
        let n = label.len().min(LO_NAME_SIZE - 1);
        cfg.info.lo_file_name[..n].copy_from_slice(&label.as_bytes()[..n]);
        // SAFETY: LOOP_CONFIGURE reads one struct loop_config that lives across the call.
        ioctl_ret(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &cfg) })?;
        Ok(())
    }

    /// Swaps the file under a bound, read-only device for `file` (same size). The kernel only
    /// allows this for read-only devices, which is why only those can be recovered.
    pub fn change_fd(&self, file: &File) -> io::Result<()> {
        let dev = open_dev(&self.path(), libc::O_RDONLY)?;
        // SAFETY: LOOP_CHANGE_FD takes the descriptor by value.
        ioctl_ret(unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                LOOP_CHANGE_FD,
                file.as_raw_fd() as libc::c_ulong,
            )
        })?;
        Ok(())
    }

    /// LOOP_CLR_FD. The kernel clears the device at the last close, which is ours when nobody
    /// else has it open: then the file is released before this returns.
    pub fn detach(&self) -> io::Result<Detach> {
        let dev = match open_dev(&self.path(), libc::O_RDONLY) {
            Ok(d) => d,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(Detach::NotBound),
            Err(e) => return Err(e),
        };
        // SAFETY: LOOP_CLR_FD takes no argument.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(Detach::NotBound);
            }
            return Err(e);
        }
        drop(dev);
        Ok(if self.backing_file().is_some() {
            Detach::Deferred
        } else {
            Detach::Done
        })
    }

    /// The path of the bound file, or None when the device is not bound.
    pub fn backing_file(&self) -> Option<String> {
        let s = std::fs::read_to_string(self.sys("loop/backing_file")).ok()?;
        let s = s.trim_end_matches('\n');
        Some(s.strip_suffix(" (deleted)").unwrap_or(s).to_string())
    }

    /// Whether the device does direct I/O to its file.
    pub fn direct_io(&self) -> Option<bool> {
        read_flag(&self.sys("loop/dio"))
    }

    /// queue/rotational, None if unreadable.
    pub fn rotational(&self) -> Option<bool> {
        read_flag(&self.sys("queue/rotational"))
    }

    /// Sets queue/rotational.
    pub fn set_rotational(&self, on: bool) -> io::Result<()> {
        std::fs::write(self.sys("queue/rotational"), if on { "1" } else { "0" })
    }

    /// Caps the device's request size (KiB) so one request maps to one FUSE request.
    pub fn set_max_sectors_kb(&self, kb: u32) -> io::Result<()> {
        std::fs::write(self.sys("queue/max_sectors_kb"), kb.to_string())
    }

    /// Where the device is mounted (in our mount namespace).
    pub fn mount_points(&self) -> Vec<String> {
        crate::sys::mount_points(&format!("loop{}", self.index))
    }
}

fn read_flag(p: &std::path::Path) -> Option<bool> {
    match std::fs::read_to_string(p).ok()?.trim() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!(LoopDev::parse("/dev/loop3"), Some(LoopDev { index: 3 }));
        assert_eq!(LoopDev::parse("loop12"), Some(LoopDev { index: 12 }));
        for bad in [
            "/dev/sda",
            "loop",
            "/dev/loop-control",
            "loop1a",
            "/dev/loop99999999999",
        ] {
            assert_eq!(LoopDev::parse(bad), None, "{bad}");
        }
        assert_eq!(LoopDev { index: 7 }.path(), "/dev/loop7");
    }
}
