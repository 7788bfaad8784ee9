//! The FUSE kernel protocol over `/dev/fuse` (linux/fuse.h, protocol 7.x), reduced to what a
//! filesystem holding exactly one fixed-size file needs.
//!
//! Decoding is pure (`parse`) so it is unit-tested (and fuzzed) without a kernel; `channel` is
//! the part that touches the device. All integers are in host byte order, as the kernel writes
//! them.
/// Node id of the mount's root directory (fixed by the kernel).
pub(crate) const ROOT_ID: u64 = 1;
/// Node id we give the one file.
pub(crate) const FILE_ID: u64 = 2;

/// Protocol we were written against. The kernel adapts to a lower minor than its own; every
/// structure used here has had its current layout since well before 7.28.
pub(crate) const KERNEL_MAJOR: u32 = 7;
pub(crate) const KERNEL_MINOR: u32 = 38;
/// FUSE_MAX_PAGES arrived in 7.28; without it requests are capped at 128 KiB.
pub(crate) const MIN_MINOR: u32 = 28;

/// Opcodes (enum fuse_opcode).
#[allow(dead_code)] // the kernel's opcode table, whole; only some are matched by name
pub(crate) mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

// INIT flags (fuse_init_in/out.flags).
pub(crate) const FUSE_ASYNC_READ: u32 = 1 << 0;
pub(crate) const FUSE_BIG_WRITES: u32 = 1 << 5;
pub(crate) const FUSE_ASYNC_DIO: u32 = 1 << 15;
pub(crate) const FUSE_MAX_PAGES: u32 = 1 << 22;
/// The INIT messages carry `flags2` (the upper 32 bits of the 64-bit flags).
pub(crate) const FUSE_INIT_EXT: u32 = 1 << 30;
/// flags2 bit of FUSE_OVER_IO_URING (1 << 41 in the 64-bit flags, linux/fuse.h 7.42): in the
/// kernel's INIT it means the kernel would accept io_uring commands (the module's
/// enable_uring switch is on); in our reply, that we will send them.
pub(crate) const FUSE_OVER_IO_URING_FLAGS2: u32 = 1 << (41 - 32);

// OPEN reply flags.
pub(crate) const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub(crate) const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

/// SETATTR valid bit for a size change.
pub(crate) const FATTR_SIZE: u32 = 1 << 3;

pub(crate) const IN_HEADER_LEN: usize = 40;
pub(crate) const OUT_HEADER_LEN: usize = 16;
/// The kernel refuses reads into buffers smaller than this, whatever max_write is.
pub(crate) const MIN_READ_BUFFER: usize = 8192;
/// Room for the largest request header in front of WRITE data (in header + fuse_write_in).
pub(crate) const REQUEST_OVERHEAD: usize = 4096;

/// Pages per request the kernel allows when FUSE_MAX_PAGES is not negotiated.
pub(crate) const DEFAULT_MAX_PAGES: u32 = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// struct fuse_in_header: what every request starts with.
pub struct InHeader {
    /// Length of the whole request, header included.
    pub len: u32,
    /// Which request (`op`).
    pub opcode: u32,
    /// The request's id, echoed by its reply.
    pub unique: u64,
    /// The inode it is about (`ROOT_ID`, `FILE_ID`).
    pub nodeid: u64,
    /// The process that caused it.
    pub pid: u32,
}

/// A decoded request. Borrowed slices point into the read buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// The connection's first request: protocol version and capabilities.
    Init(InitIn),
    /// A name in the root directory.
    Lookup {
        /// The name looked up, without its NUL.
        name: &'a [u8],
    },
    /// Attributes of the node.
    Getattr,
    /// A change of attributes; only a size change matters.
    Setattr {
        /// Which attributes change (FATTR_*).
        valid: u32,
        /// The new size, if `valid` says so.
        size: u64,
    },
    /// Opening the file.
    Open {
        /// open(2) flags.
        flags: u32,
    },
    /// Reading `size` bytes at `offset`.
    Read {
        /// Byte offset in the file.
        offset: u64,
        /// Bytes.
        size: u32,
    },
    /// Writing `data` at `offset`.
    Write {
        /// Byte offset in the file.
        offset: u64,
        /// The bytes to write.
        data: &'a [u8],
    },
    /// Filesystem statistics.
    Statfs,
    /// The last close of an open file.
    Release,
    /// Make written data durable.
    Fsync,
    /// A close(2) of a descriptor of the file.
    Flush,
    /// Opening the root directory.
    Opendir,
    /// Directory entries from `offset` on, at most `size` bytes of them.
    Readdir {
        /// Entry to resume at.
        offset: u64,
        /// Room in the reply, in bytes.
        size: u32,
    },
    /// The last close of the directory.
    Releasedir,
    /// Allocate, punch a hole in or zero `length` bytes at `offset`.
    Fallocate {
        /// Byte offset in the file.
        offset: u64,
        /// Bytes affected.
        length: u64,
        /// fallocate(2) mode flags.
        mode: u32,
    },
    /// The kernel gave up on a request (its answer is still expected).
    Interrupt,
    /// The filesystem is going away.
    Destroy,
    /// FORGET and BATCH_FORGET: the kernel expects no reply.
    Forget,
    /// Everything else (including GETXATTR/LISTXATTR): answered ENOSYS, which also tells the
    /// kernel not to ask again for most of them.
    Unsupported(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// struct fuse_init_in: what the kernel offers at INIT.
pub struct InitIn {
    /// Protocol major version.
    pub major: u32,
    /// Protocol minor version.
    pub minor: u32,
    /// The kernel's read-ahead limit in bytes.
    pub max_readahead: u32,
    /// Capabilities offered (FUSE_*).
    pub flags: u32,
    /// 0 unless `flags` has FUSE_INIT_EXT (older kernels send a shorter body).
    pub flags2: u32,
}

impl InitIn {
    /// The kernel offers FUSE over io_uring on this connection.
    pub fn offers_uring(&self) -> bool {
        self.flags & FUSE_INIT_EXT != 0 && self.flags2 & FUSE_OVER_IO_URING_FLAGS2 != 0
    }
}

#[derive(Debug, PartialEq, Eq)]
/// Why a request could not be decoded.
pub enum ParseError {
    /// Not even a header: nothing can be answered.
    Short,
    /// The header is fine, the body is not: answer EIO to `unique`.
    Body(InHeader),
}

/// Little cursor over a request body; every read is bounds-checked.
struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|s| {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_ne_bytes(a)
        })
    }
    fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }
    fn rest(&self) -> &'a [u8] {
        &self.b[self.at.min(self.b.len())..]
    }
}

/// Decodes one request as read from /dev/fuse (exactly the bytes `read` returned).
pub fn parse(buf: &[u8]) -> Result<(InHeader, Request<'_>), ParseError> {
    let mut r = Rd { b: buf, at: 0 };
    let (len, opcode, unique, nodeid) = match (r.u32(), r.u32(), r.u64(), r.u64()) {
        (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
        _ => return Err(ParseError::Short),
    };
    let pid = r.u32().and(r.u32()).and(r.u32()).unwrap_or(0);
    let h = InHeader {
        len,
        opcode,
        unique,
        nodeid,
        pid,
    };
    if buf.len() < IN_HEADER_LEN || len as usize != buf.len() {
        return Err(ParseError::Body(h));
    }
    let mut r = Rd {
        b: buf,
        at: IN_HEADER_LEN,
    };
    let bad = || ParseError::Body(h);
    let req = match opcode {
        op::INIT => {
            let major = r.u32().ok_or_else(bad)?;
            let minor = r.u32().ok_or_else(bad)?;
            let max_readahead = r.u32().ok_or_else(bad)?;
            let flags = r.u32().ok_or_else(bad)?;
            let flags2 = if flags & FUSE_INIT_EXT != 0 {
                r.u32().unwrap_or(0)
            } else {
                0
            };
            Request::Init(InitIn {
                major,
                minor,
                max_readahead,
                flags,
                flags2,
            })
        }
        op::LOOKUP => {
            let name = r.rest();
            // NUL-terminated name.
            let name = name.strip_suffix(&[0]).unwrap_or(name);
            Request::Lookup { name }
        }
        op::GETATTR => Request::Getattr,
        op::SETATTR => {
            let valid = r.u32().ok_or_else(bad)?;
            r.skip(4 + 8).ok_or_else(bad)?; // padding, fh
            let size = r.u64().ok_or_else(bad)?;
            Request::Setattr { valid, size }
        }
        op::OPEN => Request::Open {
            flags: r.u32().ok_or_else(bad)?,
        },
        op::READ | op::READDIR => {
            r.skip(8).ok_or_else(bad)?; // fh
            let offset = r.u64().ok_or_else(bad)?;
            let size = r.u32().ok_or_else(bad)?;
            if opcode == op::READ {
                Request::Read { offset, size }
            } else {
                Request::Readdir { offset, size }
            }
        }
        op::WRITE => {
            r.skip(8).ok_or_else(bad)?; // fh
            let offset = r.u64().ok_or_else(bad)?;
            let size = r.u32().ok_or_else(bad)?;
            r.skip(4 + 8 + 4 + 4).ok_or_else(bad)?; // write_flags, lock_owner, flags, padding
            let data = r.take(size as usize).ok_or_else(bad)?;
            Request::Write { offset, data }
        }
        op::STATFS => Request::Statfs,
        op::RELEASE => Request::Release,
        op::FSYNC => Request::Fsync,
        op::FLUSH => Request::Flush,
        op::OPENDIR => Request::Opendir,
        op::RELEASEDIR => Request::Releasedir,
        op::FALLOCATE => {
            r.skip(8).ok_or_else(bad)?; // fh
            let offset = r.u64().ok_or_else(bad)?;
            let length = r.u64().ok_or_else(bad)?;
            let mode = r.u32().ok_or_else(bad)?;
            Request::Fallocate {
                offset,
                length,
                mode,
            }
        }
        op::INTERRUPT => Request::Interrupt,
        op::DESTROY => Request::Destroy,
        op::FORGET | op::BATCH_FORGET => Request::Forget,
        other => Request::Unsupported(other),
    };
    Ok((h, req))
}

/// What we answer INIT with, and the I/O size that results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Negotiated {
    pub reply: [u8; 64],
    /// Largest READ/WRITE the kernel will send (max_read is set to the same by mount option).
    pub max_io: u32,
    pub minor: u32,
    /// We told the kernel we will use FUSE over io_uring.
    pub uring: bool,
    /// The kernel's page size, which max_pages counts.
    pub page: u32,
}

/// Chooses the INIT reply. `want_io` is the I/O size the blkwire session granted: the kernel
/// must never send a request larger than one blkwire command. `max_pages_limit` is the
/// kernel's cap (/proc/sys/fs/fuse/max_pages_limit, 256 = 1 MiB by default). `background`
/// bounds asynchronous requests in flight; the kernel's default (12) would cap the loop device's
/// queue depth at 12, so we raise it to what the queues can carry. `uring`: ask for FUSE over
/// io_uring, which happens only when the kernel offered it. `page`: the kernel's page size
/// (`sys::page_size`), in which it counts max_pages (a ring entry registered for 4 KiB pages
/// on a 64 KiB-page kernel is 16 times too small, and refused).
pub(crate) fn negotiate(
    init: &InitIn,
    want_io: u32,
    max_pages_limit: u32,
    background: u16,
    uring: bool,
    page: u32,
) -> Result<Negotiated, String> {
    if init.major != KERNEL_MAJOR {
        return Err(format!(
            "kernel speaks FUSE {}.{}, this build needs {KERNEL_MAJOR}.x",
            init.major, init.minor
        ));
    }
    if init.minor < MIN_MINOR {
        return Err(format!(
            "kernel FUSE protocol 7.{} is older than the 7.{MIN_MINOR} this build needs (large requests)",
            init.minor
        ));
    }
    let minor = init.minor.min(KERNEL_MINOR);
    let want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_MAX_PAGES;
    let flags = init.flags & want;
    let pages_cap = if flags & FUSE_MAX_PAGES != 0 {
        max_pages_limit.clamp(1, u16::MAX as u32)
    } else {
        DEFAULT_MAX_PAGES
    };
    // Whole pages: the kernel splits direct I/O at page granularity. Never more than the
    // session takes, though (a grant under one large page: whole 4 KiB blocks of it).
    let pages = (want_io / page).clamp(1, pages_cap);
    let max_io = (pages * page).min((want_io / 4096).max(1) * 4096);
    let background = background.max(16);
    let mut b = [0u8; 64];
    put32(&mut b, 0, KERNEL_MAJOR);
    put32(&mut b, 4, minor);
    put32(&mut b, 8, init.max_readahead);
    put32(&mut b, 12, flags);
    put16(&mut b, 16, background);
    put16(&mut b, 18, background / 4 * 3); // congestion_threshold
    put32(&mut b, 20, max_io); // max_write
    put32(&mut b, 24, 1); // time_gran: nanoseconds
    put16(&mut b, 28, pages as u16); // max_pages
    let uring = uring && init.offers_uring();
    if uring {
        // process_init_reply reads flags2 only when FUSE_INIT_EXT is set.
        put32(&mut b, 12, flags | FUSE_INIT_EXT);
        put32(&mut b, 32, FUSE_OVER_IO_URING_FLAGS2); // flags2
    }
    Ok(Negotiated {
        reply: b,
        max_io,
        minor,
        uring,
        page,
    })
}

impl Negotiated {
    /// Smallest payload buffer a ring entry may register: the kernel's max_payload_sz,
    /// max(FUSE_MIN_READ_BUFFER, max_write, max_pages pages), with max_pages 32 when
    /// FUSE_MAX_PAGES was not agreed on.
    pub fn ring_payload(&self) -> usize {
        let flags = u32::from_ne_bytes([
            self.reply[12],
            self.reply[13],
            self.reply[14],
            self.reply[15],
        ]);
        let pages = if flags & FUSE_MAX_PAGES != 0 {
            u16::from_ne_bytes([self.reply[28], self.reply[29]]) as usize
        } else {
            DEFAULT_MAX_PAGES as usize
        };
        (self.max_io as usize)
            .max(MIN_READ_BUFFER)
            .max(pages * self.page as usize)
    }
}

/// struct fuse_out_header of an answer to `unique`: `errno` 0 with `body` bytes following, or an
/// error without a body.
pub(crate) fn out_header(unique: u64, errno: i32, body: usize) -> [u8; OUT_HEADER_LEN] {
    let mut hdr = [0u8; OUT_HEADER_LEN];
    put32(&mut hdr, 0, (OUT_HEADER_LEN + body) as u32);
    hdr[4..8].copy_from_slice(&(-errno).to_ne_bytes());
    put64(&mut hdr, 8, unique);
    hdr
}

/// Attributes of the root or of the file (struct fuse_attr).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attr {
    pub ino: u64,
    pub size: u64,
    pub mode: u32,
    pub nlink: u32,
    pub blksize: u32,
    pub time: u64,
}

pub(crate) const ATTR_LEN: usize = 88;
/// Attribute and entry validity: nothing about this filesystem ever changes.
pub(crate) const VALID_SECS: u64 = 3600;

pub(crate) fn put_attr(b: &mut [u8], at: usize, a: &Attr) {
    put64(b, at, a.ino);
    put64(b, at + 8, a.size);
    put64(b, at + 16, a.size.div_ceil(512)); // blocks
    for i in 0..3 {
        put64(b, at + 24 + i * 8, a.time); // atime, mtime, ctime
    }
    put32(b, at + 60, a.mode);
    put32(b, at + 64, a.nlink);
    // uid, gid, rdev, flags stay 0 (root-owned).
    put32(b, at + 80, a.blksize);
}

/// struct fuse_entry_out (LOOKUP).
pub(crate) fn entry_out(a: &Attr) -> [u8; 40 + ATTR_LEN] {
    let mut b = [0u8; 40 + ATTR_LEN];
    put64(&mut b, 0, a.ino); // nodeid
    put64(&mut b, 8, 1); // generation
    put64(&mut b, 16, VALID_SECS);
    put64(&mut b, 24, VALID_SECS);
    put_attr(&mut b, 40, a);
    b
}

/// struct fuse_attr_out (GETATTR, SETATTR).
pub(crate) fn attr_out(a: &Attr) -> [u8; 16 + ATTR_LEN] {
    let mut b = [0u8; 16 + ATTR_LEN];
    put64(&mut b, 0, VALID_SECS);
    put_attr(&mut b, 16, a);
    b
}

/// struct fuse_open_out.
pub(crate) fn open_out(fh: u64, open_flags: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    put64(&mut b, 0, fh);
    put32(&mut b, 8, open_flags);
    b
}

/// struct fuse_write_out.
pub(crate) fn write_out(size: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    put32(&mut b, 0, size);
    b
}

/// struct fuse_statfs_out: a full filesystem of `blocks` blocks of `bsize` (loop reads the
/// block size as its discard granularity).
pub(crate) fn statfs_out(blocks: u64, bsize: u32) -> [u8; 80] {
    let mut b = [0u8; 80];
    put64(&mut b, 0, blocks);
    put64(&mut b, 24, 1); // files
    put32(&mut b, 40, bsize);
    put32(&mut b, 44, 255); // namelen
    put32(&mut b, 48, bsize); // frsize
    b
}

/// READDIR reply: `entries` (ino, type, name) from index `offset` on, as many as fit in `size`.
pub(crate) fn dirents(entries: &[(u64, u32, &[u8])], offset: u64, size: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (ino, typ, name)) in entries.iter().enumerate().skip(offset as usize) {
        let len = (24 + name.len()).next_multiple_of(8);
        if out.len() + len > size as usize {
            break;
        }
        let at = out.len();
        out.resize(at + len, 0);
        put64(&mut out, at, *ino);
        put64(&mut out, at + 8, i as u64 + 1); // offset of the next entry
        put32(&mut out, at + 16, name.len() as u32);
        put32(&mut out, at + 20, *typ);
        out[at + 24..at + 24 + name.len()].copy_from_slice(name);
    }
    out
}

pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_ne_bytes());
}
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}
pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(len: usize, opcode: u32, unique: u64, nodeid: u64) -> Vec<u8> {
        let mut b = vec![0u8; IN_HEADER_LEN];
        put32(&mut b, 0, len as u32);
        put32(&mut b, 4, opcode);
        put64(&mut b, 8, unique);
        put64(&mut b, 16, nodeid);
        b
    }

    fn request(opcode: u32, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut b = header(IN_HEADER_LEN + body.len(), opcode, 7, nodeid);
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn parses_write_with_its_data() {
        let mut body = vec![0u8; 40];
        put64(&mut body, 8, 4096); // offset
        put32(&mut body, 16, 5); // size
        body.extend_from_slice(b"hello");
        let b = request(op::WRITE, FILE_ID, &body);
        let (h, r) = parse(&b).unwrap();
        assert_eq!((h.unique, h.nodeid, h.opcode), (7, FILE_ID, op::WRITE));
        assert_eq!(
            r,
            Request::Write {
                offset: 4096,
                data: b"hello"
            }
        );
    }

    #[test]
    fn rejects_truncated_and_inconsistent_requests() {
        assert_eq!(parse(&[0u8; 10]), Err(ParseError::Short));
        // WRITE claiming more data than present.
        let mut body = vec![0u8; 40];
        put32(&mut body, 16, 100);
        let b = request(op::WRITE, FILE_ID, &body);
        assert!(matches!(parse(&b), Err(ParseError::Body(h)) if h.unique == 7));
        // Header length disagreeing with what was read.
        let mut b = request(op::GETATTR, FILE_ID, &[0u8; 16]);
        put32(&mut b, 0, 1000);
        assert!(matches!(parse(&b), Err(ParseError::Body(_))));
        // READ with a short body.
        let b = request(op::READ, FILE_ID, &[0u8; 12]);
        assert!(matches!(parse(&b), Err(ParseError::Body(_))));
    }

    #[test]
    fn parses_lookup_fallocate_setattr_and_unknown() {
        let b = request(op::LOOKUP, ROOT_ID, b"disk0\0");
        assert_eq!(parse(&b).unwrap().1, Request::Lookup { name: b"disk0" });
        let mut body = vec![0u8; 32];
        put64(&mut body, 8, 1 << 20);
        put64(&mut body, 16, 1 << 30);
        put32(&mut body, 24, 3);
        let b = request(op::FALLOCATE, FILE_ID, &body);
        assert_eq!(
            parse(&b).unwrap().1,
            Request::Fallocate {
                offset: 1 << 20,
                length: 1 << 30,
                mode: 3
            }
        );
        let mut body = vec![0u8; 88];
        put32(&mut body, 0, FATTR_SIZE);
        put64(&mut body, 16, 12345);
        let b = request(op::SETATTR, FILE_ID, &body);
        assert_eq!(
            parse(&b).unwrap().1,
            Request::Setattr {
                valid: FATTR_SIZE,
                size: 12345
            }
        );
        let b = request(op::GETXATTR, FILE_ID, &[0u8; 8]);
        assert_eq!(parse(&b).unwrap().1, Request::Unsupported(op::GETXATTR));
    }

    #[test]
    fn negotiation_caps_io_at_the_session_and_kernel_limits() {
        let init = InitIn {
            major: 7,
            minor: 41,
            max_readahead: 1 << 17,
            flags: u32::MAX,
            flags2: 0,
        };
        let n = negotiate(&init, 1 << 20, 256, 256, false, 4096).unwrap();
        assert_eq!((n.max_io, n.minor), (1 << 20, KERNEL_MINOR));
        let flags = u32::from_ne_bytes(n.reply[12..16].try_into().unwrap());
        assert_eq!(
            flags,
            FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_MAX_PAGES
        );
        assert_eq!(u16::from_ne_bytes([n.reply[28], n.reply[29]]), 256);
        assert_eq!(u16::from_ne_bytes([n.reply[16], n.reply[17]]), 256);
        // The session granted less: requests must fit one blkwire command.
        assert_eq!(
            negotiate(&init, 256 << 10, 256, 64, false, 4096)
                .unwrap()
                .max_io,
            256 << 10
        );
        // The kernel allows less.
        assert_eq!(
            negotiate(&init, 8 << 20, 256, 64, false, 4096)
                .unwrap()
                .max_io,
            1 << 20
        );
        // No FUSE_MAX_PAGES: 32 pages.
        let old = InitIn {
            flags: FUSE_ASYNC_READ,
            ..init
        };
        assert_eq!(
            negotiate(&old, 1 << 20, 256, 64, false, 4096)
                .unwrap()
                .max_io,
            128 << 10
        );
        // A kernel of 64 KiB pages counts max_pages in them, and sizes a ring entry's payload
        // by them (one registered for 4 KiB pages was refused: every REGISTER failed).
        let big = negotiate(&init, 1 << 20, 256, 64, true, 65536).unwrap();
        assert_eq!(big.max_io, 1 << 20);
        assert_eq!(u16::from_ne_bytes([big.reply[28], big.reply[29]]), 16);
        assert_eq!(big.ring_payload(), 1 << 20);
        let n = negotiate(&old, 1 << 20, 256, 64, false, 65536).unwrap();
        assert_eq!(
            (n.max_io, n.ring_payload()),
            (1 << 20, 2 << 20),
            "32 pages of 64 KiB"
        );
        assert_eq!(
            negotiate(&init, 16 << 10, 256, 64, false, 65536)
                .unwrap()
                .max_io,
            16 << 10,
            "a grant under one page: never more than the session takes"
        );
        assert!(negotiate(&InitIn { major: 8, ..init }, 1 << 20, 256, 64, false, 4096).is_err());
        assert!(negotiate(&InitIn { minor: 20, ..init }, 1 << 20, 256, 64, false, 4096).is_err());
    }

    #[test]
    fn uring_is_asked_for_only_when_offered_and_wanted() {
        let mut body = vec![0u8; 64];
        put32(&mut body, 0, 7);
        put32(&mut body, 4, 45);
        put32(&mut body, 12, FUSE_ASYNC_READ | FUSE_INIT_EXT);
        put32(&mut body, 16, FUSE_OVER_IO_URING_FLAGS2);
        let b = request(op::INIT, 0, &body);
        let Request::Init(init) = parse(&b).unwrap().1 else {
            panic!("not INIT")
        };
        assert!(init.offers_uring());
        let n = negotiate(&init, 1 << 20, 256, 64, true, 4096).unwrap();
        assert!(n.uring);
        let flags = u32::from_ne_bytes(n.reply[12..16].try_into().unwrap());
        assert_eq!(flags, FUSE_ASYNC_READ | FUSE_INIT_EXT);
        assert_eq!(
            u32::from_ne_bytes(n.reply[32..36].try_into().unwrap()),
            1 << 9
        );
        // Not wanted: neither flag in the reply.
        let n = negotiate(&init, 1 << 20, 256, 64, false, 4096).unwrap();
        assert!(!n.uring);
        assert_eq!(n.reply[32..36], [0; 4]);
        assert_eq!(
            u32::from_ne_bytes(n.reply[12..16].try_into().unwrap()) & FUSE_INIT_EXT,
            0
        );
        // Without FUSE_INIT_EXT flags2 means nothing (and a short body is fine).
        put32(&mut body, 12, FUSE_ASYNC_READ);
        let b = request(op::INIT, 0, &body[..16]);
        let Request::Init(old) = parse(&b).unwrap().1 else {
            panic!("not INIT")
        };
        assert!(!old.offers_uring());
        assert!(!negotiate(&old, 1 << 20, 256, 64, true, 4096).unwrap().uring);
    }

    #[test]
    fn dirents_are_aligned_and_resume_at_offset() {
        let e: [(u64, u32, &[u8]); 3] = [(1, 4, b"."), (1, 4, b".."), (2, 8, b"disk0")];
        let all = dirents(&e, 0, 4096);
        assert_eq!(all.len(), 32 + 32 + 32);
        let rest = dirents(&e, 2, 4096);
        assert_eq!(rest.len(), 32);
        assert_eq!(&rest[24..29], b"disk0");
        assert_eq!(u64::from_ne_bytes(rest[8..16].try_into().unwrap()), 3);
        assert!(dirents(&e, 0, 40).len() == 32, "only what fits");
    }
}
