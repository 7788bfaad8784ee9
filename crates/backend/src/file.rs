//! `file:PATH[?direct=1]`: a regular file or a block device.
//!
//! READ, WRITE and FLUSH go through the queue thread's io_uring (FUA as `RWF_DSYNC`, FLUSH as
//! `fdatasync`). TRIM, WRITE_ZEROES, COPY and allocation queries run on one helper thread per
//! export and complete through the queue's notifier (the backend contract's asynchronous path):
//! they are usually quick metadata operations (`fallocate`, `BLKDISCARD`/`BLKZEROOUT`,
//! `copy_file_range`, SEEK_DATA/SEEK_HOLE), but their fallbacks (writing up to 4 GiB of zeros,
//! copying by reads and writes) and a slow filesystem must not stall every queue of a reactor.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use io_uring::{opcode, types};

use crate::completions::{Completions, Poster};
use crate::{Backend, Capabilities, Extent, Op, QueueIo, Started, Storage, Submitter, Support};

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;
const BLKPBSZGET: libc::c_ulong = 0x127b;
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

/// The most one TRIM or WRITE_ZEROES job of the helper thread covers: the generic layer cuts
/// longer ones, and each piece queues behind the jobs that came meanwhile. One helper serves
/// every queue of the export, so a 4 GiB zeroing written out by the kernel (a device without
/// WRITE ZEROES) or by `pwrite` would otherwise hold every other queue's TRIM, zeroing, COPY
/// and allocation query for tens of seconds, past initiators' timeouts.
const FILE_PIECE: u64 = 64 << 20;

/// A regular file or block device, served through the queue thread's io_uring.
pub struct FileBackend {
    path: PathBuf,
    fd: libc::c_int,
    /// Grows with `resize` (read on the control path and at handshakes only).
    size: AtomicU64,
    /// One resize at a time: the file's length and `size` change together.
    resizing: Mutex<()>,
    block_device: bool,
    /// Opened O_RDONLY (a read-only export): the file cannot be grown through it.
    read_only: bool,
    direct: bool,
    logical: u32,
    physical: u32,
    punch_hole: bool,
    /// WRITE_ZEROES is a metadata operation (NBD's FAST_ZERO), see [`device_zeroes_fast`].
    fast_zero: bool,
    rotational: bool,
    /// The helper thread's job queue, started with the first queue.
    helper: Mutex<Option<Sender<SlowJob>>>,
    /// The file's device and inode, or the whole block device's (`Backend::storage`).
    storage: Storage,
}

/// Work the helper thread does for a queue.
enum Slow {
    /// TRIM, WRITE_ZEROES or COPY (they name no buffer of the caller's).
    Op(Op),
    Allocation {
        offset: u64,
        len: u64,
        max: usize,
        out: *mut Vec<Extent>,
    },
}

struct SlowJob {
    work: Slow,
    file: Arc<FileBackend>,
    tag: u64,
    done: Poster,
}

// SAFETY: the extent list an allocation query writes to stays valid, and untouched by its
// queue, until the result is reaped (QueueIo::start_allocation's contract); the ops sent here
// (TRIM, WRITE_ZEROES, COPY) carry no pointer; the rest is owned.
unsafe impl Send for SlowJob {}

/// The one-line error for a file export that could not be opened: what to do about it.
fn open_hint(path: &Path, e: &io::Error, direct: bool, read_only: bool) -> String {
    match e.raw_os_error() {
        Some(libc::ENOENT) => format!(
            "{}: no such file; create it first, e.g. `truncate -s 10G {}`",
            path.display(),
            path.display()
        ),
        Some(libc::EISDIR) => format!(
            "{}: is a directory; give a file or a block device, e.g. `truncate -s 10G {}/disk.img` and file:{}/disk.img",
            path.display(),
            path.display(),
            path.display()
        ),
        Some(libc::EACCES | libc::EROFS) if !read_only => format!(
            "{}: {e}: give this user write access to it, or serve it read-only \
             (add ,ro to the export)",
            path.display()
        ),
        Some(libc::EACCES) => format!(
            "{}: {e}: give this user read access to it (and search access to its \
             directories)",
            path.display()
        ),
        Some(libc::EINVAL) if direct => {
            format!(
                "{}: this filesystem does not support O_DIRECT; drop ?direct=1",
                path.display()
            )
        }
        _ => format!("{}: {e}", path.display()),
    }
}

impl FileBackend {
    /// The sender of the export's helper thread, started on first use.
    fn helper(&self) -> io::Result<Sender<SlowJob>> {
        let mut h = self.helper.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = h.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel::<SlowJob>();
        let job_is_block_device = self.block_device;
        std::thread::Builder::new()
            .name("blkwire-file".into())
            .spawn(move || {
                let (mut zeros, mut scratch) = (ZeroBuf::default(), ZeroBuf::default());
                // Until the filesystem refuses a reflink once (then it never will).
                let mut reflink = !job_is_block_device;
                for job in rx {
                    let f = &job.file;
                    let res = match job.work {
                        Slow::Op(Op::Trim { offset, len, .. }) => f.trim(offset, len),
                        Slow::Op(Op::WriteZeroes {
                            offset,
                            len,
                            no_hole,
                            fast,
                            ..
                        }) => f.write_zeroes(offset, len, no_hole, fast, &mut zeros),
                        Slow::Op(Op::Copy { src, dst, len }) => {
                            f.copy(f.fd, src, dst, len, &mut reflink, &mut scratch)
                        }
                        // Another export's file: a refused reflink there (another filesystem)
                        // says nothing of reflinks within this file, so it is tried each time.
                        Slow::Op(Op::CopyFrom { fd, src, dst, len }) => {
                            f.copy(fd, src, dst, len, &mut true, &mut scratch)
                        }
                        Slow::Op(_) => -libc::EINVAL, // READ, WRITE and FLUSH use the ring
                        Slow::Allocation {
                            offset,
                            len,
                            max,
                            out,
                        } => {
                            // SAFETY: the queue keeps the list valid and untouched until this
                            // result is reaped (start_allocation's contract).
                            f.allocation(offset, len, max, unsafe { &mut *out });
                            0
                        }
                    };
                    job.done.post(job.tag, res);
                }
            })?;
        *h = Some(tx.clone());
        Ok(tx)
    }

    /// Opens an existing file or block device. The error names the path and says what to do.
    pub fn open(path: &Path, direct: bool, read_only: bool) -> io::Result<FileBackend> {
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
        let flags = open_flags(direct, read_only);
        // Non-blocking only to open: a FIFO would otherwise hold the open (and the control
        // call adding the export, with every call behind it) until someone writes to it; it is
        // refused below as neither a file nor a device, and the flag is cleared for the rest.
        // SAFETY: plain syscalls on a NUL-terminated path and our own fd.
        let fd = unsafe { libc::open(cpath.as_ptr(), flags | libc::O_NONBLOCK) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let hint = open_hint(path, &e, direct, read_only);
            return Err(io::Error::new(e.kind(), hint));
        }
        let mut b = FileBackend {
            path: path.to_owned(),
            fd,
            size: AtomicU64::new(0),
            resizing: Mutex::new(()),
            block_device: false,
            read_only,
            direct,
            logical: 512,
            physical: 4096,
            punch_hole: false,
            fast_zero: false,
            rotational: false,
            helper: Mutex::new(None),
            storage: Storage::default(),
        };
        // From here `b` owns fd and closes it on error.
        // SAFETY: an all-zero stat is a valid value (plain integers).
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on our fd into a zeroed stat.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if matches!(st.st_mode & libc::S_IFMT, libc::S_IFREG | libc::S_IFBLK) {
            // io_uring would answer EAGAIN instead of waiting for a descriptor with O_NONBLOCK.
            // SAFETY: fcntl on our own descriptor.
            let now = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            // SAFETY: as above.
            if now < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, now & !libc::O_NONBLOCK) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // Two paths to one file (links, a bind mount) or to one device name the same storage.
        b.storage = match st.st_mode & libc::S_IFMT {
            libc::S_IFBLK => block_storage(st.st_rdev),
            _ => file_storage(st.st_dev, st.st_ino as u64),
        };
        let size = match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {
                let size = st.st_size as u64;
                if direct {
                    b.logical = 4096;
                }
                // Punching a hole past EOF changes nothing but tells us if the filesystem can.
                // SAFETY: fallocate on our own descriptor; no memory is involved.
                b.punch_hole = unsafe {
                    libc::fallocate(
                        fd,
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        size as libc::off_t,
                        4096,
                    )
                } == 0;
                b.fast_zero = b.punch_hole;
                size
            }
            libc::S_IFBLK => {
                b.block_device = true;
                let sz = device_size(fd)?;
                let mut lbs: libc::c_int = 512;
                let mut pbs: libc::c_uint = 4096;
                // SAFETY: documented block-device ioctls writing into locals of the right type.
                unsafe {
                    libc::ioctl(fd, BLKSSZGET, &mut lbs);
                    libc::ioctl(fd, BLKPBSZGET, &mut pbs);
                }
                b.logical = (lbs as u32).max(512);
                b.physical = pbs.max(b.logical);
                let sys = Path::new(SYS_DEV_BLOCK);
                b.rotational = queue_attr(sys, st.st_rdev, "rotational").as_deref() == Some("1");
                b.fast_zero =
                    device_zeroes_fast(queue_attr(sys, st.st_rdev, "write_zeroes_max_bytes"));
                sz
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{}: not a regular file or block device", path.display()),
                ))
            }
        };
        *b.size.get_mut() = size;
        if size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: size is 0; give it a size, e.g. `truncate -s 10G {}`",
                    path.display(),
                    path.display()
                ),
            ));
        }
        if !b.logical.is_power_of_two() || !b.physical.is_power_of_two() {
            b.logical = 512;
            b.physical = 4096;
        }
        // A partial last block could be neither read nor written whole by any client.
        if !size.is_multiple_of(u64::from(b.logical)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: its size ({size} bytes) is not a multiple of the {}-byte block size; \
                     round it up with `truncate -s %{} {}`",
                    path.display(),
                    b.logical,
                    b.logical,
                    path.display()
                ),
            ));
        }
        Ok(b)
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u32) -> i32 {
        // SAFETY: fallocate on our fd; range checked by Export.
        let r =
            unsafe { libc::fallocate(self.fd, mode, offset as libc::off_t, len as libc::off_t) };
        if r == 0 {
            0
        } else {
            -io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        }
    }

    fn range_ioctl(&self, req: libc::c_ulong, offset: u64, len: u32) -> i32 {
        let range: [u64; 2] = [offset, len as u64];
        // SAFETY: BLKDISCARD/BLKZEROOUT take a pointer to two u64s.
        let r = unsafe { libc::ioctl(self.fd, req, range.as_ptr()) };
        if r == 0 {
            0
        } else {
            -io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        }
    }

    fn trim(&self, offset: u64, len: u32) -> i32 {
        let r = if self.block_device {
            // BLKDISCARD takes whole logical blocks (EINVAL otherwise), and NBD clients may
            // trim any bytes where the export takes unaligned I/O: the blocks wholly inside
            // the range are discarded (the rest, as the whole, is advisory).
            let lb = u64::from(self.logical.max(1));
            let (start, end) = (
                offset.next_multiple_of(lb),
                (offset + u64::from(len)) / lb * lb,
            );
            if end > start {
                self.range_ioctl(BLKDISCARD, start, (end - start) as u32)
            } else {
                0
            }
        } else if self.punch_hole {
            self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        } else {
            0
        };
        // TRIM is advisory (PROTOCOL.md §3): a device that cannot discard has still done its job.
        if r == -libc::EOPNOTSUPP {
            0
        } else {
            r
        }
    }

    /// Zeroes `offset..offset+len`: a hole where it may (`!no_hole`), else the filesystem's or
    /// device's zeroing, else by writing zeros; when `fast`, never by writing zeros (the
    /// device's own fallback included): `-EOPNOTSUPP` instead.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        no_hole: bool,
        fast: bool,
        zeros: &mut ZeroBuf,
    ) -> i32 {
        if fast && no_hole {
            // Kept allocated means written or zeroed by the device: neither is promised fast.
            return -libc::EOPNOTSUPP;
        }
        if fast {
            // Admission gives FAST_ZERO only without NO_HOLE, where `fast_zero` is claimed:
            // a punched hole in a file; on a block device, fallocate's PUNCH_HOLE, which
            // zeroes with the device's WRITE ZEROES or unmap and never writes zero pages
            // (BLKZEROOUT falls back to writing them).
            let r = self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            );
            return if r == -libc::EINVAL || r == -libc::EOPNOTSUPP {
                -libc::EOPNOTSUPP
            } else {
                r
            };
        }
        let r = if self.block_device {
            self.range_ioctl(BLKZEROOUT, offset, len)
        } else {
            let mut r = -libc::EOPNOTSUPP;
            if !no_hole && self.punch_hole {
                r = self.fallocate(
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                );
            }
            if r != 0 {
                r = self.fallocate(
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                );
            }
            r
        };
        if r == -libc::EOPNOTSUPP || r == -libc::EINVAL {
            // O_DIRECT writes take aligned ranges only: the aligned pieces of a range that is
            // not would be zeroed, then its edge refused (EINVAL after changing the export).
            let align = self.buffer_alignment() as u64;
            if !(offset | u64::from(len)).is_multiple_of(align) {
                return -libc::EINVAL;
            }
            let fd = self.fd;
            return crate::export::write_zeroes_by_writing(
                offset,
                len as u64,
                zeros.get(),
                |buf, off| {
                    // SAFETY: pwrite from our aligned zero buffer.
                    let n = unsafe {
                        libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), off as libc::off_t)
                    };
                    if n < 0 {
                        -io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO)
                    } else {
                        n as i32
                    }
                },
            );
        }
        r
    }
}

impl FileBackend {
    /// COPY into the file from `from` (this file's own descriptor, or another export's): a
    /// reflink (`FICLONERANGE`: the ranges share extents, nothing is copied) while `reflink`
    /// holds and the filesystem takes it, else `copy_file_range` (the filesystem may still share
    /// extents or copy in the kernel), and where the filesystem refuses that too, reads and
    /// writes through `bounce`. Runs on the export's helper thread; `len` or a negative errno.
    fn copy(
        &self,
        from: RawFd,
        src: u64,
        dst: u64,
        len: u32,
        reflink: &mut bool,
        bounce: &mut ZeroBuf,
    ) -> i32 {
        if *reflink {
            match self.clone_range(from, src, dst, len) {
                Ok(()) => return len as i32,
                // Not this filesystem (or a regular file on it): never again for this export.
                Err(libc::EOPNOTSUPP | libc::ENOTTY | libc::EXDEV | libc::ENOSYS) => {
                    *reflink = false
                }
                // Misaligned ranges (a reflink shares whole blocks) or a busy file: copy this
                // chunk, try again with the next.
                Err(_) => {}
            }
        }
        let (mut s, mut d, mut left) = (src as libc::loff_t, dst as libc::loff_t, len as usize);
        while left > 0 {
            // SAFETY: copy_file_range between ranges of our own descriptor; the kernel advances
            // the offsets we pass.
            let n = unsafe { libc::copy_file_range(from, &mut s, self.fd, &mut d, left, 0) };
            match n {
                n if n > 0 => left -= n as usize,
                0 => return -libc::EIO,
                _ => match io::Error::last_os_error().raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => {
                        return self
                            .copy_by_reading(from, s as u64, d as u64, left, bounce.get_mut())
                            .map_or_else(|e| e, |()| len as i32);
                    }
                    e => return -e.unwrap_or(libc::EIO),
                },
            }
        }
        len as i32
    }

    /// `FICLONERANGE` of `len` bytes from `src` of `from` to `dst` of the file; the errno when
    /// the filesystem refuses.
    fn clone_range(&self, from: RawFd, src: u64, dst: u64, len: u32) -> Result<(), i32> {
        /// `struct file_clone_range` of linux/fs.h.
        #[repr(C)]
        struct FileCloneRange {
            src_fd: i64,
            src_offset: u64,
            src_length: u64,
            dest_offset: u64,
        }
        /// `_IOW(0x94, 13, struct file_clone_range)`.
        const FICLONERANGE: libc::c_ulong = 0x4020_940d;
        let arg = FileCloneRange {
            src_fd: from as i64,
            src_offset: src,
            src_length: len as u64,
            dest_offset: dst,
        };
        // SAFETY: the ioctl reads the struct, which lives across the call; both ranges are in
        // our own file, inside the export (checked by the generic layer).
        let r = unsafe { libc::ioctl(self.fd, FICLONERANGE, &arg) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO))
        }
    }

    fn copy_by_reading(
        &self,
        from: RawFd,
        mut src: u64,
        mut dst: u64,
        mut left: usize,
        buf: &mut [u8],
    ) -> Result<(), i32> {
        let errno = || {
            -io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        };
        while left > 0 {
            let n = left.min(buf.len());
            // SAFETY: pread into our own buffer of at least `n` bytes.
            let r = unsafe { libc::pread(from, buf.as_mut_ptr().cast(), n, src as libc::off_t) };
            if r <= 0 {
                return Err(if r == 0 { -libc::EIO } else { errno() });
            }
            let r = r as usize;
            // SAFETY: pwrite of the `r` bytes just read.
            let w = unsafe { libc::pwrite(self.fd, buf.as_ptr().cast(), r, dst as libc::off_t) };
            if w <= 0 {
                return Err(if w == 0 { -libc::EIO } else { errno() });
            }
            let w = w as usize;
            src += w as u64;
            dst += w as u64;
            left -= w;
        }
        Ok(())
    }
}

/// True when a file has no data extent at all (one big hole).
pub(crate) fn no_data(fd: libc::c_int) -> bool {
    // SAFETY: lseek on the caller's fd.
    let r = unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) };
    r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO)
}

/// Appends the allocation map of `offset..offset+len` of a file, walking data and holes with
/// SEEK_DATA/SEEK_HOLE, at most `max` entries; any surprise reports the rest as data.
pub(crate) fn seek_extents(
    fd: libc::c_int,
    offset: u64,
    len: u64,
    max: usize,
    out: &mut Vec<crate::Extent>,
) {
    let end = offset + len;
    let start_len = out.len();
    let mut at = offset;
    // Each turn appends at most one entry (a hole, or the data up to the next hole), whole.
    while at < end && out.len() - start_len < max.min(crate::MAX_EXTENTS) {
        // SAFETY: lseek on the caller's fd.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        let data = if data >= 0 {
            (data as u64).min(end)
        } else if io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
            end // no data from `at` on: a hole to the end
        } else {
            // Anything else (EIO or ESTALE on NFS or FUSE, a filesystem without SEEK_DATA)
            // says nothing about holes: calling the rest one would let block status report
            // data as zeros and copies skip it.
            crate::push_extent(out, end - at, false);
            return;
        };
        if data > at {
            crate::push_extent(out, data - at, true);
            at = data;
            continue;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_HOLE) };
        let hole = if hole < 0 {
            end
        } else {
            (hole as u64).min(end)
        };
        let next = if hole > at { hole } else { end };
        crate::push_extent(out, next - at, false);
        at = next;
    }
}

/// Where the kernel lists block devices by number.
const SYS_DEV_BLOCK: &str = "/sys/dev/block";

/// A block device's queue attribute `name`, trimmed, from `sys` (`/sys/dev/block`): its
/// `M:m/queue/NAME`, or for a partition, which has no queue of its own, its disk's (the
/// kernel resolves `..` after the `M:m` link, to the disk's directory).
fn queue_attr(sys: &Path, rdev: libc::dev_t, name: &str) -> Option<String> {
    let dev = sys.join(format!("{}:{}", libc::major(rdev), libc::minor(rdev)));
    [dev.join("queue"), dev.join("../queue")]
        .iter()
        .find_map(|q| std::fs::read_to_string(q.join(name)).ok())
        .map(|s| s.trim().to_owned())
}

/// A file's storage: its device and inode, whatever path it was opened by.
fn file_storage(dev: u64, ino: u64) -> Storage {
    Storage {
        name: format!("file {dev} {ino}"),
        start: 0,
    }
}

/// The storage a block device's bytes lie in: a partition's are its disk's from its start, a
/// loop device's its backing file's from its offset (a partition of a loop device: both), so
/// two exports of one disk or file overlap where their bytes do. Any other device (dm, md:
/// their tables are not read) is storage of its own.
fn block_storage(rdev: libc::dev_t) -> Storage {
    block_storage_in(Path::new(SYS_DEV_BLOCK), rdev)
}

/// `block_storage` reading `sys` for `/sys/dev/block`.
fn block_storage_in(sys: &Path, rdev: libc::dev_t) -> Storage {
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    let number = |p: PathBuf| read(p).and_then(|s| s.parse::<u64>().ok());
    let mut dev = sys.join(format!("{}:{}", libc::major(rdev), libc::minor(rdev)));
    let mut disk = rdev;
    let mut start = 0u64;
    if dev.join("partition").exists() {
        // The disk is the directory above (the kernel resolves `..` after the `M:m` link);
        // `start` counts 512-byte sectors whatever the disk's block size.
        let parent = read(dev.join("../dev")).and_then(|s| {
            let (maj, min) = s.split_once(':')?;
            Some(libc::makedev(maj.parse().ok()?, min.parse().ok()?))
        });
        if let (Some(sector), Some(parent)) = (number(dev.join("start")), parent) {
            start = sector.saturating_mul(512);
            disk = parent;
            dev = dev.join("..");
        }
    }
    if let Some(file) = read(dev.join("loop/backing_file")) {
        use std::os::unix::fs::MetadataExt;
        // A file deleted since (" (deleted)" appended) cannot be opened again: no other
        // export can share it.
        if let Ok(m) = std::fs::metadata(&file) {
            let offset = number(dev.join("loop/offset")).unwrap_or(0);
            return Storage {
                start: start.saturating_add(offset),
                ..file_storage(m.dev(), m.ino())
            };
        }
    }
    Storage {
        name: format!("block device {disk}"),
        start,
    }
}

/// Whether a block device zeroes as a metadata operation (NBD's FAST_ZERO), given its
/// `queue/write_zeroes_max_bytes`. WRITE_ZEROES is BLKZEROOUT, which the kernel runs as the
/// device's own WRITE ZEROES command where it has one (a non-zero limit) and otherwise by
/// writing pages of zeros: as slow as the writes a client that asks for FAST_ZERO wants to
/// avoid. An unreadable value says nothing, so it is not fast either (refusing FAST_ZERO is
/// always safe: the client writes the zeros itself).
fn device_zeroes_fast(write_zeroes_max_bytes: Option<String>) -> bool {
    write_zeroes_max_bytes.is_some_and(|v| v.parse::<u64>().is_ok_and(|n| n > 0))
}

/// How an export's file is opened: read-only or not, O_DIRECT or not.
fn open_flags(direct: bool, read_only: bool) -> libc::c_int {
    let access = if read_only {
        libc::O_RDONLY
    } else {
        libc::O_RDWR
    };
    libc::O_CLOEXEC | access | if direct { libc::O_DIRECT } else { 0 }
}

/// A block device's size in bytes now.
fn device_size(fd: libc::c_int) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 into a u64 of ours, on the caller's descriptor.
    if unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

impl FileBackend {
    fn queue(self: Arc<Self>) -> io::Result<FileQueue> {
        let helper = self.helper()?;
        Ok(FileQueue {
            own: self.open_description().ok(),
            // (A read-only export takes no write.)
            dsync: if self.read_only {
                None
            } else {
                self.open_description().ok()
            },
            file: self,
            helper,
            done: Completions::new()?,
        })
    }

    /// A new open file description of the file, for one queue's reads, writes and flushes:
    /// the kernel reports a writeback error to each description's next fsync once ("errseq"),
    /// so a queue's flush sees an error whatever another queue's flush saw first, where on one
    /// shared description only the first would (and the other queue's client be told its
    /// data was durable). Through /proc, so it is the file opened, whatever its path is now.
    fn open_description(&self) -> io::Result<OwnedFd> {
        let path = CString::new(format!("/proc/self/fd/{}", self.fd)).expect("no NUL in it");
        let flags = open_flags(self.direct, self.read_only);
        // SAFETY: a plain open of a NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor was just opened and is ours alone.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for FileBackend {
    fn drop(&mut self) {
        // SAFETY: closing the fd we opened; every queue holds an Arc to us, so none is left.
        unsafe { libc::close(self.fd) };
    }
}

impl Backend for FileBackend {
    fn copy_source_fd(&self) -> Option<RawFd> {
        (!self.block_device).then_some(self.fd)
    }
    fn storage(&self) -> Option<&Storage> {
        Some(&self.storage)
    }
    /// On the export's helper thread (a slow source filesystem stalls only that).
    fn copies_from_fd(&self, _fd: RawFd) -> bool {
        !self.block_device
    }
    fn describe(&self) -> String {
        let d = if self.direct { "?direct=1" } else { "" };
        format!("file:{}{d}", self.path.display())
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    fn block_sizes(&self) -> (u32, u32) {
        (self.logical, self.physical)
    }
    /// A regular file grows to `new_size` with `ftruncate` (sparse: no data is written), unless
    /// it is that long already (grown outside blkwire): a file is never cut short here. A block
    /// device is grown first by whatever manages it (lvextend, losetup -c); the export then
    /// takes up to the device's size as it is now. Then `size()` reports the new size.
    fn resize(&self, new_size: u64) -> io::Result<()> {
        let path = self.path.display();
        let _one = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        if self.block_device {
            let device = device_size(self.fd)
                .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
            if new_size > device {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{path} is a block device of {device} bytes: grow the device first \
                         (lvextend, losetup -c, ...), then resize the export"
                    ),
                ));
            }
            self.size.store(new_size, Ordering::Release);
            return Ok(());
        }
        if new_size < self.size() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{path}: an export's file only grows"),
            ));
        }
        let len = i64::try_from(new_size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
        // SAFETY: an all-zero stat is a valid value (plain integers).
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on our fd into a stat we own.
        if unsafe { libc::fstat(self.fd, &mut st) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("{path}: {e}")));
        }
        if st.st_size < len {
            if self.read_only {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{path} is open read-only (a read-only export): grow the file first \
                         (truncate -s {new_size} {path}), then resize the export"
                    ),
                ));
            }
            // fallocate of the last byte only ever extends the file: ftruncate to `len` would
            // shrink it again if someone grew it past `len` since the fstat (another export of
            // the same file resizing at once, a `truncate -s` from outside), cutting off what
            // their writers wrote there. ftruncate only where the filesystem has no fallocate,
            // or no block to give the last byte (full, or a quota): a sparse file still grows.
            // SAFETY: fallocate and ftruncate on our own descriptor; no memory is involved.
            let grown = unsafe { libc::fallocate(self.fd, 0, len - 1, 1) } == 0
                || (matches!(
                    io::Error::last_os_error().raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::ENOSPC | libc::EDQUOT)
                ) && unsafe { libc::ftruncate(self.fd, len) } == 0);
            if !grown {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(
                    e.kind(),
                    format!("{path}: cannot grow to {new_size} bytes: {e}"),
                ));
            }
        }
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            flush: Support::Native,
            fua: Support::Native,
            trim: Support::native_if(self.block_device || self.punch_hole),
            write_zeroes: Support::Native,
            copy: Support::Native,
            rotational: self.rotational,
            fast_zero: self.fast_zero,
            limits: crate::Limits {
                max_trim_bytes: FILE_PIECE,
                max_zero_bytes: FILE_PIECE,
                ..crate::Limits::default()
            },
        }
    }
    fn reads_as_zero(&self) -> bool {
        !self.block_device && no_data(self.fd)
    }
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<crate::Extent>) {
        if self.block_device {
            out.push(crate::Extent { len, hole: false });
            return;
        }
        seek_extents(self.fd, offset, len, max, out);
    }

    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        Ok(Box::new(self.queue()?))
    }
    fn buffer_alignment(&self) -> usize {
        if self.direct {
            self.logical.max(4096) as usize
        } else {
            1
        }
    }
}

/// A lazily allocated, aligned buffer of zeros for emulated WRITE_ZEROES.
#[derive(Default)]
struct ZeroBuf(Option<crate::export::AlignedBuf>);

impl ZeroBuf {
    fn buf(&mut self) -> &mut crate::export::AlignedBuf {
        self.0
            .get_or_insert_with(|| crate::export::AlignedBuf::zeroed(1 << 20, 4096))
    }

    fn get(&mut self) -> &[u8] {
        self.buf().as_slice()
    }

    /// The buffer as scratch (a queue's COPY fallback has a `ZeroBuf` of its own, never the
    /// one that WRITE_ZEROES writes from).
    fn get_mut(&mut self) -> &mut [u8] {
        self.buf().as_mut_slice()
    }
}

struct FileQueue {
    file: Arc<FileBackend>,
    /// The queue's own open file description ([`FileBackend::open_description`]); the
    /// export's shared one if it could not be had (no /proc, the file's permissions changed
    /// since the export was added).
    own: Option<OwnedFd>,
    /// Another, for FUA writes (`RWF_DSYNC`): their sync reports a writeback error as an
    /// fsync does, once per description, so on the flushes' description one could take the
    /// error a FLUSH running beside it then misses (told OK before the write's EIO latched).
    /// Two FUA writes on it can still split one (PROTOCOL.md §10).
    dsync: Option<OwnedFd>,
    /// The export's helper thread, for TRIM, WRITE_ZEROES, COPY and allocation queries.
    helper: Sender<SlowJob>,
    /// Results from the helper, and the queue's notifier.
    done: Completions,
}

impl FileQueue {
    fn slow(&self, work: Slow, tag: u64) -> Started {
        let job = SlowJob {
            work,
            file: self.file.clone(),
            tag,
            done: self.done.poster(),
        };
        match self.helper.send(job) {
            Ok(()) => Started::Async,
            Err(_) => Started::Done(-libc::EIO),
        }
    }
}

impl QueueIo for FileQueue {
    fn completes_inline(&self) -> bool {
        false
    }
    unsafe fn start(&mut self, op: Op, tag: u64, sq: &mut dyn Submitter) -> Started {
        let fd_of = |own: &Option<OwnedFd>| own.as_ref().map_or(self.file.fd, |fd| fd.as_raw_fd());
        let fd = types::Fd(fd_of(&self.own));
        let entry = match op {
            Op::Read { offset, buf, len } => opcode::Read::new(fd, buf, len).offset(offset).build(),
            Op::Write {
                offset,
                buf,
                len,
                fua,
            } => {
                // FUA writes sync on a description of their own (`dsync`).
                let fd = types::Fd(fd_of(if fua { &self.dsync } else { &self.own }));
                opcode::Write::new(fd, buf, len)
                    .offset(offset)
                    .rw_flags(if fua { libc::RWF_DSYNC } else { 0 })
                    .build()
            }
            Op::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Trim { .. } | Op::WriteZeroes { .. } | Op::Copy { .. } | Op::CopyFrom { .. } => {
                return self.slow(Slow::Op(op), tag)
            }
        };
        // The entry names the op's buffer, which our caller keeps valid until the completion.
        sq.push(entry.user_data(tag));
        Started::Submitted(1)
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
        Some(self.slow(
            Slow::Allocation {
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

    fn data_on_own_threads(&self) -> bool {
        false // READ and WRITE go to the ring; only the slow metadata work goes to the helper
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        self.done.reap(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file the target may not open says what to do: write access or `,ro` for a writable
    /// export (or a read-only filesystem), read access for a read-only one.
    #[test]
    fn a_file_export_that_cannot_be_opened_says_what_to_do() {
        let p = Path::new("/srv/d.img");
        let e = io::Error::from_raw_os_error;
        let rw = open_hint(p, &e(libc::EACCES), false, false);
        assert!(
            rw.starts_with("/srv/d.img: Permission denied") && rw.contains(",ro"),
            "{rw}"
        );
        assert!(open_hint(p, &e(libc::EROFS), false, false).contains(",ro"));
        let ro = open_hint(p, &e(libc::EACCES), false, true);
        assert!(ro.contains("read access") && !ro.contains(",ro"), "{ro}");
        assert!(open_hint(p, &e(libc::ENOENT), false, false).contains("truncate -s 10G"));
    }

    /// A loop device (`losetup --find --show EXTRA FILE`) over a scratch file of its own,
    /// detached and its file removed on drop, also when the test fails. Needs root and loop
    /// devices: the test fails saying so otherwise.
    struct LoopDev {
        dev: String,
        dir: PathBuf,
    }

    impl LoopDev {
        /// Over a file of `len` bytes of `fill` (0: a sparse file), in a directory named
        /// after `tag`.
        fn over(tag: &str, len: usize, fill: u8, extra: &[&str]) -> LoopDev {
            let dir = std::env::temp_dir().join(format!("blkwire-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("f.img");
            if fill == 0 {
                std::fs::File::create(&file)
                    .unwrap()
                    .set_len(len as u64)
                    .unwrap();
            } else {
                std::fs::write(&file, vec![fill; len]).unwrap();
            }
            let out = std::process::Command::new("losetup")
                .args(["--find", "--show"])
                .args(extra)
                .arg(&file)
                .output()
                .expect("losetup (util-linux) runs");
            assert!(
                out.status.success(),
                "losetup: {} (this test needs root and loop devices)",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
            LoopDev { dev, dir }
        }

        /// The file behind it.
        fn file(&self) -> PathBuf {
            self.dir.join("f.img")
        }
    }

    impl AsRef<std::ffi::OsStr> for LoopDev {
        fn as_ref(&self) -> &std::ffi::OsStr {
            self.dev.as_ref()
        }
    }

    impl AsRef<Path> for LoopDev {
        fn as_ref(&self) -> &Path {
            self.dev.as_ref()
        }
    }

    impl std::fmt::Display for LoopDev {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.dev)
        }
    }

    impl Drop for LoopDev {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.dev])
                .status();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// A partition is its disk's storage from its start, a loop device its file's from its
    /// offset, a partition of a loop device both; other devices are their own (a fake sysfs
    /// laid out as the kernel's: `M:m` links to the device's directory, a partition's under
    /// its disk's).
    #[test]
    fn block_storage_is_the_disk_or_file_underneath_from_where_the_device_starts() {
        use std::os::unix::fs::{symlink, MetadataExt};
        let root =
            std::env::temp_dir().join(format!("blkwire-sysfs-storage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let sys = root.join("dev/block");
        std::fs::create_dir_all(&sys).unwrap();
        let file = root.join("backing.img");
        std::fs::write(&file, b"x").unwrap();
        let m = std::fs::metadata(&file).unwrap();
        let device = |path: &str, number: &str, attrs: &[(&str, String)]| {
            let d = root.join("devices").join(path);
            std::fs::create_dir_all(d.join("loop")).unwrap();
            std::fs::write(d.join("dev"), format!("{number}\n")).unwrap();
            for (name, value) in attrs {
                std::fs::write(d.join(name), format!("{value}\n")).unwrap();
            }
            symlink(&d, sys.join(number)).unwrap();
        };
        device("sda", "8:0", &[]);
        device(
            "sda/sda2",
            "8:2",
            &[("partition", "2".into()), ("start", "2048".into())],
        );
        let backing = file.display().to_string();
        device(
            "loop3",
            "7:3",
            &[
                ("loop/backing_file", backing.clone()),
                ("loop/offset", "4096".into()),
            ],
        );
        device(
            "loop3/loop3p1",
            "259:0",
            &[("partition", "1".into()), ("start", "8".into())],
        );
        device(
            "loop4",
            "7:4",
            &[("loop/backing_file", format!("{backing} (deleted)"))],
        );
        let at = |maj, min| block_storage_in(&sys, libc::makedev(maj, min));
        let disk = format!("block device {}", libc::makedev(8, 0));
        let on_file = format!("file {} {}", m.dev(), m.ino());
        assert_eq!(
            at(8, 0),
            Storage {
                name: disk.clone(),
                start: 0
            }
        );
        assert_eq!(
            at(8, 2),
            Storage {
                name: disk,
                start: 2048 * 512
            }
        );
        assert_eq!(
            at(7, 3),
            Storage {
                name: on_file.clone(),
                start: 4096
            }
        );
        assert_eq!(
            at(259, 0),
            Storage {
                name: on_file,
                start: 4096 + 8 * 512
            }
        );
        let gone = format!("block device {}", libc::makedev(7, 4));
        assert_eq!(
            at(7, 4),
            Storage {
                name: gone,
                start: 0
            },
            "its file cannot be opened"
        );
        let none = format!("block device {}", libc::makedev(253, 1));
        assert_eq!(
            at(253, 1),
            Storage {
                name: none,
                start: 0
            },
            "not in sysfs"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A loop device at an offset into a file and the file itself, exported side by side:
    /// a COPY between them whose bytes meet in the file is refused (a forward copy over its
    /// own source corrupts it), one whose bytes lie apart is checked as any other; on the
    /// running kernel's sysfs. Needs root and losetup.
    #[test]
    fn a_copy_between_a_file_and_a_loop_device_over_it_is_checked_for_overlap() {
        let dev = LoopDev::over("loopcopy", 4 << 20, 0, &["--offset", "1048576"]);
        let file = dev.file();
        let open = |name: &str, path: &str| {
            let spec = crate::ExportSpec::parse(&format!("{name}=file:{path}")).unwrap();
            crate::Export::open(&spec).unwrap()
        };
        let whole = open("whole", &file.display().to_string());
        let lo = open("lo", &dev.to_string());
        let under = whole.backend().storage().unwrap().clone();
        assert_eq!(
            lo.backend().storage(),
            Some(&Storage {
                start: 1 << 20,
                ..under
            })
        );
        let r = |offset| [crate::CopyRange { offset, len: 65536 }];
        // The loop device's 0 is the file's 1 MiB.
        assert_eq!(
            whole.check_copy_from(&lo, &r(0), (1 << 20) + 4096),
            Err(crate::Refusal::Invalid),
            "the loop device's first 64 KiB onto the file 4 KiB further"
        );
        assert_eq!(
            lo.check_copy_from(&whole, &r(1 << 20), 4096),
            Err(crate::Refusal::Invalid),
            "and the other way"
        );
        assert_eq!(
            whole.check_copy_from(&lo, &r(0), 0),
            Ok(65536),
            "apart in the file"
        );
        assert_eq!(
            lo.check_copy_from(&whole, &r(0), 0),
            Ok(65536),
            "apart in the file"
        );
        drop((whole, lo));
    }

    /// A TRIM of a block device that does not cover whole logical blocks discards the blocks
    /// wholly inside it and succeeds (TRIM is advisory); BLKDISCARD refused it with EINVAL,
    /// which NBD clients (whose TRIMs may be unaligned on such an export) got back. On a loop
    /// device over a file of 4 KiB blocks; needs root and losetup.
    #[test]
    fn an_unaligned_trim_of_a_block_device_trims_the_blocks_inside() {
        let dev = LoopDev::over("trim", 64 << 10, 7, &["--sector-size", "4096"]);
        let b = FileBackend::open(Path::new(&dev), false, false).unwrap();
        assert_eq!(b.logical, 4096);
        assert_eq!(b.trim(100, 10000), 0, "unaligned, over the block at 4096");
        assert_eq!(b.trim(100, 1000), 0, "inside one block: nothing to discard");
        assert_eq!(b.trim(0, 8192), 0, "aligned");
        // FAST_ZERO: the device's own zeroing (loop punches the file), never zero pages
        // written; kept allocated is not promised fast.
        let mut zeros = ZeroBuf::default();
        assert_eq!(b.write_zeroes(16384, 8192, false, true, &mut zeros), 0);
        assert_eq!(
            b.write_zeroes(16384, 8192, true, true, &mut zeros),
            -libc::EOPNOTSUPP
        );
        let mut back = vec![1u8; 12288];
        // SAFETY: pread into a buffer of that length from the backend's descriptor.
        let n = unsafe { libc::pread(b.fd, back.as_mut_ptr().cast(), back.len(), 12288) };
        assert_eq!(n, 12288);
        assert!(back[..4096].iter().all(|&x| x == 7), "before the range");
        assert!(back[4096..].iter().all(|&x| x == 0), "the range zeroed");
        drop(b);
    }

    /// On an O_DIRECT block device, a zeroing its BLKZEROOUT refuses (not whole sectors) is
    /// refused before anything is zeroed: the fallback writes zeros with O_DIRECT, which
    /// zeroed the aligned pieces, then failed at the edge. Needs root and losetup.
    #[test]
    fn an_unaligned_zeroing_of_a_direct_device_changes_nothing() {
        let dev = LoopDev::over("dzero", 4 << 20, 7, &[]);
        let b = FileBackend::open(Path::new(&dev), true, false).unwrap();
        assert_eq!(b.buffer_alignment(), 4096);
        let mut zeros = ZeroBuf::default();
        assert_eq!(
            b.write_zeroes(0, (1 << 20) + 100, false, false, &mut zeros),
            -libc::EINVAL
        );
        drop(b);
        let back = std::fs::read(&dev).unwrap();
        assert!(back.iter().all(|&x| x == 7), "nothing zeroed");
        // Whole sectors, not whole pages: BLKZEROOUT zeroes them (no O_DIRECT write).
        let b = FileBackend::open(Path::new(&dev), true, false).unwrap();
        assert_eq!(
            b.write_zeroes(0, (1 << 20) + 512, false, false, &mut zeros),
            0
        );
        drop(b);
        let back = std::fs::read(&dev).unwrap();
        assert!(back[..(1 << 20) + 512].iter().all(|&x| x == 0));
        assert!(back[(1 << 20) + 512..].iter().all(|&x| x == 7));
    }

    /// A block device grown under its export (a loop device over a longer file, `losetup -c`):
    /// the export grows up to the device's new size, not past it. Needs root and losetup.
    #[test]
    fn a_block_device_export_grows_to_the_device_grown_under_it() {
        let dev = LoopDev::over("bgrow", 4 << 20, 0, &[]);
        let b = FileBackend::open(Path::new(&dev), false, false).unwrap();
        assert_eq!(b.size(), 4 << 20);
        let e = b.resize(8 << 20).unwrap_err();
        assert!(e.to_string().contains("grow the device first"), "{e}");
        assert_eq!(b.size(), 4 << 20, "unchanged");
        std::fs::OpenOptions::new()
            .write(true)
            .open(dev.file())
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let out = std::process::Command::new("losetup")
            .args(["-c", &dev.dev])
            .output()
            .expect("losetup (util-linux) runs");
        assert!(out.status.success(), "losetup -c: {out:?}");
        b.resize(8 << 20).unwrap();
        assert_eq!(b.size(), 8 << 20);
        assert!(b.resize(12 << 20).is_err(), "past the device");
    }

    /// A block device whose size is not whole pages, exported with O_DIRECT (4 KiB blocks):
    /// served, its size told to sessions in whole blocks (`Export::served_size`: NBD told
    /// the size with its partial last page, which no I/O of whole pages reaches). Needs root
    /// and losetup.
    #[test]
    fn a_direct_device_of_a_partial_last_page_is_served_in_whole_blocks() {
        let dev = LoopDev::over("dtail", (1 << 20) + 512, 7, &[]);
        let spec = crate::ExportSpec::parse(&format!("d=file:{dev}?direct=1")).unwrap();
        let e = crate::Export::open(&spec).unwrap();
        assert_eq!((e.size(), e.io_block()), ((1 << 20) + 512, 4096));
        assert_eq!(e.served_size(), 1 << 20);
        drop(e);
    }

    /// A long zeroing reaches the helper in pieces of `FILE_PIECE` (so other queues' jobs
    /// interleave), which together zero the whole range and nothing around it.
    #[test]
    fn long_zeroing_goes_to_the_helper_in_pieces_that_cover_it() {
        let dir = std::env::temp_dir().join(format!("blkwire-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f.img");
        std::fs::File::create(&file)
            .unwrap()
            .set_len(4 * FILE_PIECE)
            .unwrap();
        let spec = crate::ExportSpec::parse(&format!("f=file:{}", file.display())).unwrap();
        let e = crate::Export::open(&spec).unwrap();
        let limits = e.capabilities().limits;
        assert_eq!(
            (limits.max_zero_bytes, limits.max_trim_bytes),
            (FILE_PIECE, FILE_PIECE)
        );
        let mut q = e.open_queue().unwrap();
        let marks = [
            4095,
            4096,
            FILE_PIECE - 1,
            FILE_PIECE,
            3 * FILE_PIECE - 1,
            3 * FILE_PIECE,
        ];
        for &at in &marks {
            q.write_blocking(at & !4095, &[9u8; 4096], false).unwrap();
        }
        let (start, len) = (4096, 3 * FILE_PIECE - 4096);
        for no_hole in [false, true] {
            let mut z = crate::BlockRequest::new(crate::BlockOp::WriteZeroes, start, len as u32);
            if no_hole {
                z.flags = crate::IoFlags::NO_HOLE;
            }
            q.run_blocking(&z).unwrap();
            for &at in &marks {
                let mut b = [0u8; 4096];
                q.read_blocking(at & !4095, &mut b).unwrap();
                let inside = (start..start + len).contains(&at);
                let want = if inside { 0 } else { 9 };
                assert_eq!(
                    b[(at % 4096) as usize],
                    want,
                    "byte {at}, no_hole {no_hole}"
                );
            }
        }
        drop((q, e));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Each queue reads, writes and flushes through an open file description of its own, of
    /// the same file and with the export's flags: a writeback error is then reported to each
    /// queue's next flush, not only to the first of them (`open_description`).
    #[test]
    fn each_queue_has_an_open_file_description_of_its_own() {
        let dir = std::env::temp_dir().join(format!("blkwire-desc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let b = Arc::new(FileBackend::open(&path, false, false).unwrap());
        let (q1, q2) = (b.clone().queue().unwrap(), b.clone().queue().unwrap());
        std::fs::rename(&path, dir.join("moved.img")).unwrap();
        let raw = |fd: &Option<OwnedFd>| fd.as_ref().unwrap().as_raw_fd();
        // And FUA writes another of their own, so their syncs take no error from the flushes.
        let fds = [
            b.fd,
            raw(&q1.own),
            raw(&q2.own),
            raw(&q1.dsync),
            raw(&q2.dsync),
        ];
        let stat = |fd| {
            // SAFETY: an all-zero stat is a valid value; fstat fills it from our descriptor.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as said.
            let r = unsafe { libc::fstat(fd, &mut st) };
            assert_eq!(r, 0);
            (st.st_dev, st.st_ino)
        };
        // A file position is per open file description: moving one moves no other.
        for (i, &fd) in fds.iter().enumerate() {
            let at = 4096 * (i as i64 + 1);
            // SAFETY: lseek on descriptors the backend and its queues hold open.
            assert_eq!(unsafe { libc::lseek(fd, at, libc::SEEK_SET) }, at);
        }
        for (i, &fd) in fds.iter().enumerate() {
            // SAFETY: as above.
            let at = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
            assert_eq!(at, 4096 * (i as i64 + 1), "descriptor {i}");
            assert_eq!(stat(fd), stat(b.fd), "the same file, though renamed");
            // SAFETY: fcntl on an open descriptor.
            let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            assert_eq!(fl & libc::O_ACCMODE, libc::O_RDWR, "the export's flags");
        }
        // A read-only export's queue has no FUA writes' description (it takes no write).
        let ro = Arc::new(FileBackend::open(&dir.join("moved.img"), false, true).unwrap());
        let q = ro.clone().queue().unwrap();
        assert!(q.own.is_some() && q.dsync.is_none());
        // SAFETY: fcntl on an open descriptor.
        let fl = unsafe { libc::fcntl(raw(&q.own), libc::F_GETFL) };
        assert_eq!(
            fl & libc::O_ACCMODE,
            libc::O_RDONLY,
            "a read-only export's flags"
        );
        drop(q);
        // Which description each op goes to: a FUA write's is the FUA writes' own.
        struct Fds(Vec<i32>);
        impl crate::Submitter for Fds {
            fn push(&mut self, e: io_uring::squeue::Entry) {
                // SAFETY: an entry is a 64-byte io_uring_sqe; its fd is the i32 at offset 4.
                let b: [u8; 64] = unsafe { std::mem::transmute(e) };
                self.0.push(i32::from_ne_bytes(b[4..8].try_into().unwrap()));
            }
        }
        let mut q1 = q1;
        let mut sq = Fds(Vec::new());
        let buf = [0u8; 4096];
        for (op, tag) in [
            (
                Op::Read {
                    offset: 0,
                    buf: buf.as_ptr() as *mut u8,
                    len: 4096,
                },
                1,
            ),
            (Op::Flush, 2),
            (
                Op::Write {
                    offset: 0,
                    buf: buf.as_ptr(),
                    len: 4096,
                    fua: true,
                },
                3,
            ),
        ] {
            // SAFETY: the entries are never submitted.
            let _ = unsafe { q1.start(op, tag, &mut sq) };
        }
        assert_eq!(sq.0, [raw(&q1.own), raw(&q1.own), raw(&q1.dsync)]);
        drop((q1, q2));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A FIFO is refused at once (the open does not wait for a writer), and a file is used
    /// with a blocking descriptor (io_uring answers EAGAIN on a non-blocking one).
    #[test]
    fn a_fifo_is_refused_without_waiting_and_a_file_opens_blocking() {
        let dir = std::env::temp_dir().join(format!("blkwire-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let p = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(FileBackend::open(&p, false, true).map(|_| ()));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(10));
        if got.is_err() {
            // Let the open go (a writer appears), so the thread ends.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
        let e = got
            .expect("the open of a FIFO waited for a writer")
            .unwrap_err();
        assert!(
            e.to_string().contains("not a regular file or block device"),
            "{e}"
        );
        let file = dir.join("f.img");
        std::fs::write(&file, vec![0u8; 4096]).unwrap();
        let b = FileBackend::open(&file, false, false).unwrap();
        // SAFETY: fcntl on the backend's descriptor.
        let fl = unsafe { libc::fcntl(b.fd, libc::F_GETFL) };
        assert_eq!(
            fl & libc::O_NONBLOCK,
            0,
            "the file's descriptor is non-blocking"
        );
        drop(b);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// FAST_ZERO on a block device only where it has a WRITE ZEROES command of its own: a
    /// virtio disk without one (write_zeroes_max_bytes 0) would have BLKZEROOUT write zeros.
    #[test]
    fn a_block_device_zeroes_fast_only_with_a_write_zeroes_limit() {
        let fast = |v: Option<&str>| device_zeroes_fast(v.map(str::to_owned));
        assert!(fast(Some("4294966784")), "a loop device over a file");
        assert!(!fast(Some("0")), "BLKZEROOUT would write pages of zeros");
        assert!(!fast(None), "unknown: not claimed");
        assert!(!fast(Some("")));
    }

    /// The attribute is the device's queue's, and a partition's is its disk's, as sysfs lays
    /// them out (`M:m` links to the device's directory; a partition's lies in its disk's).
    #[test]
    fn queue_attributes_of_disks_and_partitions() {
        let root = std::env::temp_dir().join(format!("blkwire-sysfs-queue-{}", std::process::id()));
        let disk = root.join("devices/vda");
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::create_dir_all(disk.join("vda1")).unwrap();
        std::fs::write(disk.join("queue/write_zeroes_max_bytes"), "0\n").unwrap();
        std::fs::write(disk.join("queue/rotational"), "1\n").unwrap();
        let sys = root.join("dev/block");
        std::fs::create_dir_all(&sys).unwrap();
        std::os::unix::fs::symlink("../../devices/vda", sys.join("254:0")).unwrap();
        std::os::unix::fs::symlink("../../devices/vda/vda1", sys.join("254:1")).unwrap();
        let attr = |minor, name| queue_attr(&sys, libc::makedev(254, minor), name);
        let got = [
            attr(0, "write_zeroes_max_bytes"),
            attr(1, "write_zeroes_max_bytes"),
            attr(1, "rotational"),
            attr(2, "rotational"),
        ];
        std::fs::remove_dir_all(&root).unwrap();
        let s = |v: &str| Some(v.to_owned());
        assert_eq!(got, [s("0"), s("0"), s("1"), None]);
    }

    /// A walk that may list `max` extents lists at most that many, a prefix of the range (on
    /// a filesystem with holes: data, hole, data, hole, one by one).
    #[test]
    fn a_seek_walk_stops_at_the_most_the_caller_asks_for() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let path = std::env::temp_dir().join(format!("blkwire-seek-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(4 << 20).unwrap();
        f.write_all_at(&[1; 4096], 0).unwrap();
        f.write_all_at(&[1; 4096], 2 << 20).unwrap();
        f.sync_all().unwrap();
        let mut all = Vec::new();
        seek_extents(f.as_raw_fd(), 0, 4 << 20, crate::MAX_EXTENTS, &mut all);
        for max in 1..=4 {
            let mut out = Vec::new();
            seek_extents(f.as_raw_fd(), 0, 4 << 20, max, &mut out);
            assert_eq!(out[..], all[..all.len().min(max)], "max {max}");
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// A SEEK_DATA that fails for any reason but ENXIO (here ESPIPE, as a transient EIO or
    /// ESTALE on NFS would) reports the range as data, never as a hole.
    #[test]
    fn a_failed_seek_reports_data_not_a_hole() {
        let mut fds = [0; 2];
        // SAFETY: pipe into an array of two descriptors, closed below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let mut out = Vec::new();
        seek_extents(fds[0], 4096, 1 << 20, crate::MAX_EXTENTS, &mut out);
        // SAFETY: closing the two descriptors pipe made.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert_eq!(
            out,
            [Extent {
                len: 1 << 20,
                hole: false
            }]
        );
    }
}
