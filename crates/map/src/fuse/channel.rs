//! /dev/fuse itself: opening and cloning descriptors, reading requests and writing replies
//! (the read path), mounting and unmounting the filesystem.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::abi::{out_header, OUT_HEADER_LEN};

/// `_IOR(229, 0, uint32_t)`: attach a new /dev/fuse descriptor to an existing connection.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_E500;

/// One /dev/fuse descriptor. Each worker thread owns one (the first opened, the others cloned),
/// so replies go back on the descriptor the request was read from, as the kernel requires.
pub(crate) struct Channel {
    fd: OwnedFd,
    nonblocking: bool,
}

impl Channel {
    pub fn open() -> io::Result<Channel> {
        // SAFETY: plain open of a device node; the result is checked.
        let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Channel {
            fd,
            nonblocking: false,
        })
    }

    /// A new descriptor on the same connection (FUSE_DEV_IOC_CLONE): requests are shared between
    /// all descriptors, each with its own list of requests being processed.
    pub fn clone_channel(&self) -> io::Result<Channel> {
        let c = Channel::open()?;
        let src: u32 = self.fd.as_raw_fd() as u32;
        // SAFETY: the ioctl reads one u32 (the source descriptor).
        if unsafe { libc::ioctl(c.fd.as_raw_fd(), FUSE_DEV_IOC_CLONE, &src) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(c)
    }

    /// Switches O_NONBLOCK (a no-op when already in that mode).
    pub fn set_nonblocking(&mut self, on: bool) -> io::Result<()> {
        if self.nonblocking == on {
            return Ok(());
        }
        let fd = self.fd.as_raw_fd();
        // SAFETY: fcntl on our own descriptor.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if fl < 0 {
            return Err(io::Error::last_os_error());
        }
        let fl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, fl) } < 0 {
            return Err(io::Error::last_os_error());
        }
        self.nonblocking = on;
        Ok(())
    }

    /// Reads one whole request. `buf` must hold max_write + REQUEST_OVERHEAD bytes.
    /// ENODEV: the filesystem was unmounted (or the connection aborted); EAGAIN: nothing queued
    /// (non-blocking mode); ENOENT: the request was interrupted before we got it.
    pub fn receive(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: read into our own buffer.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        }
    }

    /// Answers request `unique`: `errno` 0 with `parts` as the body, or an error.
    /// ENOENT means the request no longer exists (interrupted): not an error for the caller.
    pub fn reply(&self, unique: u64, errno: i32, parts: &[&[u8]]) -> io::Result<()> {
        let body: usize = if errno == 0 {
            parts.iter().map(|p| p.len()).sum()
        } else {
            0
        };
        let mut hdr = out_header(unique, errno, body);
        let mut iov = [libc::iovec {
            iov_base: hdr.as_mut_ptr().cast(),
            iov_len: OUT_HEADER_LEN,
        }; 4];
        let mut n = 1;
        if errno == 0 {
            for p in parts.iter().filter(|p| !p.is_empty()).take(3) {
                iov[n] = libc::iovec {
                    iov_base: p.as_ptr() as *mut libc::c_void,
                    iov_len: p.len(),
                };
                n += 1;
            }
        }
        loop {
            // SAFETY: the iovecs point at live buffers for the duration of the call; the kernel
            // only reads from them.
            let r = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), n as libc::c_int) };
            if r >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ENOENT) => return Ok(()),
                _ => return Err(e),
            }
        }
    }

    /// Waits until a request is queued or `ms` elapse (-1: no limit). Returns true when readable.
    pub fn wait_readable(&self, ms: i32) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd of ours.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                return Ok(false);
            }
            return Err(e);
        }
        Ok(n > 0)
    }
}

impl AsRawFd for Channel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Mounts the connection behind `ch` at `mountpoint` (mount(2), root only). After this the
/// kernel has queued INIT on the channel.
pub(crate) fn mount(
    ch: &Channel,
    mountpoint: &Path,
    source: &str,
    max_read: u32,
) -> io::Result<()> {
    let target = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let source = CString::new(source).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // rootmode=40000: the root is a directory; allow_other: the loop driver's worker threads and
    // other root processes may use the file, not only this process.
    let data = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,max_read={max_read}",
        ch.as_raw_fd()
    );
    let data = CString::new(data).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"fuse.blkwire".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_NOATIME,
            data.as_ptr().cast(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Lazily unmounts `mountpoint` (MNT_DETACH never blocks on users of the mount). Returns false
/// when nothing was mounted there.
pub(crate) fn unmount_lazy(mountpoint: &Path) -> io::Result<bool> {
    let target = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: NUL-terminated path.
    let r = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(false),
        _ => Err(e),
    }
}

/// The kernel's cap on pages per request (1 MiB with 4 KiB pages unless raised).
pub(crate) fn max_pages_limit() -> u32 {
    std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(256)
}
