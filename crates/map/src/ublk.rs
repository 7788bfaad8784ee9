//! The ublk frontend: the kernel's userspace block driver (ublk_drv, Linux >= 6.0) with blkwire
//! queues behind it, written directly on io_uring (no libublk).
//!
//! Control path: /dev/ublk-control takes IORING_OP_URING_CMD commands on an SQE128 ring
//! (`Ctrl`): GET_FEATURES, ADD_DEV, SET_PARAMS, START_DEV, STOP_DEV, DEL_DEV, GET_DEV_INFO,
//! START_USER_RECOVERY, END_USER_RECOVERY, all with their ioctl-encoded numbers.
//!
//! Data path: one thread per ublk queue, each with its own io_uring and its own blkwire `Queue`.
//! The thread maps its queue's I/O descriptor array (read-only) from /dev/ublkcN, sends FETCH_REQ
//! for every tag with that tag's buffer, and answers each request with COMMIT_AND_FETCH_REQ. Data
//! is copied by the kernel between the request's pages and the tag buffer (no USER_COPY, no zero
//! copy), so a WRITE's data is in the buffer when the request arrives and a READ's data must be
//! there when it is committed.
//!
//! Recovery: devices are created with USER_RECOVERY | USER_RECOVERY_REISSUE. When the daemon dies
//! the kernel quiesces the device instead of removing it; `map --recover /dev/ublkbN` runs
//! START_USER_RECOVERY, fetches every tag again from a new daemon, then END_USER_RECOVERY, and
//! the requests that were in flight are issued again.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use blkwire_client::{Cmd, Completion, ConnectOptions, ExportInfo, Queue, Url};
use blkwire_spin::AdaptiveSpin;
use blkwire_wire::{Features, Status};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::daemon::{Mode, Notify, Spec};
use crate::sockpoll::SockPoll;
use crate::state::{self, Record};
use crate::sys::{self, Proc};
use crate::{log, FRONTEND_UBLK, UBLK_CONTROL};
use blkwire_spin::readable;

// ---------------------------------------------------------------------------------------------
// ABI (include/uapi/linux/ublk_cmd.h, Linux 6.12)

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, 'u', nr, size)`.
pub const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}

const CTRL_LEN: usize = std::mem::size_of::<CtrlCmd>();
const IO_LEN: usize = std::mem::size_of::<IoCmd>();

pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ioc(IOC_READ, 0x02, CTRL_LEN);
pub const UBLK_U_CMD_ADD_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x04, CTRL_LEN);
pub const UBLK_U_CMD_DEL_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x05, CTRL_LEN);
pub const UBLK_U_CMD_START_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x06, CTRL_LEN);
pub const UBLK_U_CMD_STOP_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x07, CTRL_LEN);
pub const UBLK_U_CMD_SET_PARAMS: u32 = ioc(IOC_READ | IOC_WRITE, 0x08, CTRL_LEN);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 = ioc(IOC_READ | IOC_WRITE, 0x10, CTRL_LEN);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = ioc(IOC_READ | IOC_WRITE, 0x11, CTRL_LEN);
pub const UBLK_U_CMD_GET_FEATURES: u32 = ioc(IOC_READ, 0x13, CTRL_LEN);
/// DEL_DEV without waiting for the device's last user (Linux >= 6.9).
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ioc(IOC_READ, 0x14, CTRL_LEN);
pub const UBLK_U_IO_FETCH_REQ: u32 = ioc(IOC_READ | IOC_WRITE, 0x20, IO_LEN);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = ioc(IOC_READ | IOC_WRITE, 0x21, IO_LEN);

pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;

pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;

pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;

pub const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;
pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;

const UBLK_IO_RES_OK: i32 = 0;
const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;
const UBLK_MAX_QUEUE_DEPTH: usize = 4096;
/// What the driver accepts as the I/O buffer size of one request (libublk's default cap too).
const MAX_IO_BUF: u32 = 1 << 20;
/// DISCARD and WRITE_ZEROES are limited so one request is one blkwire command (32-bit length).
const MAX_RANGE_SECTORS: u32 = (1 << 30) >> 9;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CtrlCmd {
    pub dev_id: u32,
    pub queue_id: u16,
    pub len: u16,
    pub addr: u64,
    pub data: u64,
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IoDesc {
    /// op: bits 0-7, flags: bits 8-31
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamDevt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParamZoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

/// `struct ublk_params` as of 6.12 (basic, discard, devt, zoned); `len` tells the driver how
/// much of it we know, so newer kernels with more parameter types accept it too.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub len: u32,
    pub types: u32,
    pub basic: ParamBasic,
    pub discard: ParamDiscard,
    pub devt: ParamDevt,
    pub zoned: ParamZoned,
}

impl IoDesc {
    pub fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }
    pub fn flags(&self) -> u32 {
        self.op_flags & !0xff
    }
}

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: plain-old-data repr(C) structs without padding holes that matter to the kernel.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Size of one queue's descriptor area in the char device's mmap space (the kernel's
/// `ublk_max_cmd_buf_size`) and the length we map (`ublk_queue_cmd_buf_size`).
fn page_size() -> usize {
    // SAFETY: sysconf has no side effects.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}
fn max_cmd_buf_size() -> usize {
    (UBLK_MAX_QUEUE_DEPTH * std::mem::size_of::<IoDesc>()).next_multiple_of(page_size())
}
fn queue_cmd_buf_size(depth: usize) -> usize {
    (depth * std::mem::size_of::<IoDesc>()).next_multiple_of(page_size())
}

/// The blkwire command for one ublk request, or the errno to answer it with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
    },
    Zero {
        offset: u64,
        len: u32,
        no_hole: bool,
    },
}

pub fn map_op(d: &IoDesc, readonly: bool, buf_len: usize) -> Result<Op, i32> {
    if d.op() == UBLK_IO_OP_FLUSH {
        // A flush names no range: the kernel leaves its sector as it likes (not always 0).
        return Ok(Op::Flush);
    }
    // A sector number whose byte offset does not fit 64 bits cannot be on any device.
    let offset = d.start_sector.checked_mul(512).ok_or(libc::EINVAL)?;
    let len64 = (d.nr_sectors as u64) << 9;
    let len = u32::try_from(len64).map_err(|_| libc::EINVAL)?;
    let fits = || {
        if len as usize > buf_len {
            Err(libc::EINVAL)
        } else {
            Ok(())
        }
    };
    let write = || if readonly { Err(libc::EROFS) } else { Ok(()) };
    match d.op() {
        UBLK_IO_OP_READ => {
            fits()?;
            Ok(Op::Read { offset, len })
        }
        UBLK_IO_OP_WRITE => {
            fits()?;
            write()?;
            Ok(Op::Write {
                offset,
                len,
                fua: d.flags() & UBLK_IO_F_FUA != 0,
            })
        }
        UBLK_IO_OP_DISCARD => {
            write()?;
            Ok(Op::Trim { offset, len })
        }
        UBLK_IO_OP_WRITE_ZEROES => {
            write()?;
            Ok(Op::Zero {
                offset,
                len,
                no_hole: d.flags() & UBLK_IO_F_NOUNMAP != 0,
            })
        }
        _ => Err(libc::EOPNOTSUPP),
    }
}

/// The device parameters for an export.
pub fn params_for(info: &ExportInfo, readonly: bool, rotational: bool, max_io: u32) -> Params {
    let shift = |v: u32| v.clamp(512, 4096).trailing_zeros() as u8;
    let lbs = shift(info.logical_block);
    let pbs = shift(info.physical_block.max(info.logical_block));
    let f = info.features;
    let mut attrs = 0;
    if readonly {
        attrs |= UBLK_ATTR_READ_ONLY;
    }
    if rotational {
        attrs |= UBLK_ATTR_ROTATIONAL;
    }
    if f.has(Features::FLUSH) {
        attrs |= UBLK_ATTR_VOLATILE_CACHE;
    }
    if f.has(Features::FUA) {
        attrs |= UBLK_ATTR_FUA;
    }
    let mut p = Params {
        len: std::mem::size_of::<Params>() as u32,
        types: UBLK_PARAM_TYPE_BASIC,
        basic: ParamBasic {
            attrs,
            logical_bs_shift: lbs,
            physical_bs_shift: pbs,
            io_opt_shift: pbs,
            io_min_shift: pbs,
            max_sectors: max_io >> 9,
            chunk_sectors: 0,
            dev_sectors: info.size >> 9,
            virt_boundary_mask: 0,
        },
        ..Default::default()
    };
    let trim = f.has(Features::TRIM) && !readonly;
    let zero = f.has(Features::WRITE_ZEROES) && !readonly;
    if trim || zero {
        p.types |= UBLK_PARAM_TYPE_DISCARD;
        p.discard = ParamDiscard {
            discard_alignment: 0,
            discard_granularity: 1 << pbs,
            max_discard_sectors: if trim { MAX_RANGE_SECTORS } else { 0 },
            max_write_zeroes_sectors: if zero { MAX_RANGE_SECTORS } else { 0 },
            max_discard_segments: 1,
            reserved0: 0,
        };
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Control device

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
const NEEDED: [(u64, &str); 3] = [
    (UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
];

pub fn missing_features(have: u64) -> Vec<&'static str> {
    NEEDED
        .iter()
        .filter(|(f, _)| have & f == 0)
        .map(|(_, n)| *n)
        .collect()
}

fn probe(ctrl: &mut Ctrl) -> Result<(), String> {
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

/// `/dev/ublkb3` -> 3
pub fn parse_device(s: &str) -> Option<u32> {
    let n = s.strip_prefix("/dev/").unwrap_or(s).strip_prefix("ublkb")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

pub fn device_path(id: u32) -> String {
    format!("/dev/ublkb{id}")
}

fn wait_for_path(p: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while !Path::new(p).exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

pub(crate) fn preflight() -> Result<(), String> {
    if !sys::is_root() {
        return Err("mapping needs root: it creates a ublk device".into());
    }
    if !Path::new(UBLK_CONTROL).exists() {
        return Err(format!(
            "the ublk frontend needs {UBLK_CONTROL}, which this machine lacks (Linux >= 6.5 with ublk_drv loaded: modprobe ublk_drv); use --frontend fuse"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Per-queue worker

enum QEvent {
    /// Every tag of the queue is fetched (or setting up failed).
    Fetched(usize, Result<(), String>),
    Exited(usize, Option<String>),
    Signal(i32),
}

struct Slot {
    op: Option<Op>,
    /// Sent to the target and not answered yet.
    sent: bool,
    deadline: Instant,
}

struct QueueWorker {
    id: u16,
    cdev: Arc<File>,
    depth: usize,
    buf_len: usize,
    descs: *const IoDesc,
    descs_len: usize,
    bufs: *mut u8,
    ring: IoUring,
    link: Option<Queue>,
    /// Changes with every new `Queue` (see `SockPoll`).
    link_id: u64,
    /// The ring also watches the queue's socket, so the thread sleeps in one place.
    sock: SockPoll,
    /// Completions taken from the ring (reused).
    cqes: Vec<(u64, i32, u32)>,
    /// Before sleeping with answers outstanding, the thread spins as `Queue::complete` does.
    spin: AdaptiveSpin,
    slots: Vec<Slot>,
    /// Completions of one `complete` call: tag and result to commit.
    done: Vec<(usize, i32)>,
    alive_tags: usize,
    url: Url,
    reconnect: ConnectOptions,
    readonly: bool,
    timeout: Duration,
}

// SAFETY: the raw pointers are mappings owned by the worker, used by one thread at a time.
unsafe impl Send for QueueWorker {}

impl Drop for QueueWorker {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mappings.
        unsafe {
            libc::munmap(self.descs as *mut libc::c_void, self.descs_len);
            libc::munmap(self.bufs.cast(), self.depth * self.buf_len);
        }
    }
}

impl QueueWorker {
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: u16,
        cdev: Arc<File>,
        depth: usize,
        buf_len: usize,
        q: Queue,
        url: Url,
        reconnect: ConnectOptions,
        readonly: bool,
        timeout: Duration,
    ) -> Result<QueueWorker, String> {
        let descs_len = queue_cmd_buf_size(depth);
        let off = id as usize * max_cmd_buf_size();
        // SAFETY: mapping the driver's descriptor array of this queue, read-only.
        let descs = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                descs_len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                cdev.as_raw_fd(),
                off as libc::off_t,
            )
        };
        if descs == libc::MAP_FAILED {
            return Err(format!(
                "mapping the descriptors of ublk queue {id}: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: anonymous memory for the tag buffers.
        let bufs = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                depth * buf_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if bufs == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: our mapping from above.
            unsafe { libc::munmap(descs, descs_len) };
            return Err(format!("allocating I/O buffers: {e}"));
        }
        let ring = IoUring::new((depth as u32 * 2).next_power_of_two().max(8))
            .map_err(|e| format!("creating the io_uring of ublk queue {id}: {e}"))?;
        let now = Instant::now();
        Ok(QueueWorker {
            id,
            cdev,
            depth,
            buf_len,
            descs: descs as *const IoDesc,
            descs_len,
            bufs: bufs.cast(),
            ring,
            link: Some(q),
            link_id: 0,
            sock: SockPoll::default(),
            cqes: Vec::with_capacity(depth * 2),
            spin: AdaptiveSpin::new(reconnect.poll),
            slots: (0..depth)
                .map(|_| Slot {
                    op: None,
                    sent: false,
                    deadline: now,
                })
                .collect(),
            done: Vec::with_capacity(depth),
            alive_tags: depth,
            url,
            reconnect,
            readonly,
            timeout,
        })
    }

    fn buf(&self, tag: usize) -> *mut u8 {
        // SAFETY: tag < depth, inside the buffer mapping.
        unsafe { self.bufs.add(tag * self.buf_len) }
    }

    fn push_cmd(&mut self, op: u32, tag: usize, result: i32) -> Result<(), String> {
        let c = IoCmd {
            q_id: self.id,
            tag: tag as u16,
            result,
            addr: self.buf(tag) as u64,
        };
        let mut raw = [0u8; 16];
        raw.copy_from_slice(as_bytes(&c));
        let sqe = opcode::UringCmd16::new(types::Fd(self.cdev.as_raw_fd()), op)
            .cmd(raw)
            .build()
            .user_data(tag as u64);
        self.push(&sqe)
    }

    /// Queues an SQE, submitting what is queued when the submission queue is full.
    fn push(&mut self, sqe: &squeue::Entry) -> Result<(), String> {
        loop {
            // SAFETY: tag commands refer to tag buffers, which live as long as the worker; polls
            // refer to nothing.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.ring
                .submit()
                .map_err(|e| format!("io_uring submit: {e}"))?;
        }
    }

    fn fetch_all(&mut self) -> Result<(), String> {
        for tag in 0..self.depth {
            self.push_cmd(UBLK_U_IO_FETCH_REQ, tag, 0)?;
        }
        self.ring
            .submit()
            .map_err(|e| format!("sending FETCH_REQ: {e}"))?;
        Ok(())
    }

    fn commit(&mut self, tag: usize, result: i32) -> Result<(), String> {
        self.slots[tag].op = None;
        self.slots[tag].sent = false;
        self.push_cmd(UBLK_U_IO_COMMIT_AND_FETCH_REQ, tag, result)
    }

    fn desc(&self, tag: usize) -> IoDesc {
        // SAFETY: tag < depth; the kernel wrote the descriptor before completing the fetch.
        unsafe { std::ptr::read_volatile(self.descs.add(tag)) }
    }

    /// A request arrived on `tag`.
    fn start(&mut self, tag: usize) -> Result<(), String> {
        let d = self.desc(tag);
        match map_op(&d, self.readonly, self.buf_len) {
            Ok(op) => {
                let s = &mut self.slots[tag];
                s.op = Some(op);
                s.sent = false;
                s.deadline = Instant::now() + self.timeout;
                self.send(tag)
            }
            Err(errno) => self.commit(tag, -errno),
        }
    }

    fn send(&mut self, tag: usize) -> Result<(), String> {
        let Some(op) = self.slots[tag].op else {
            return Ok(());
        };
        if self.link.is_none() {
            self.try_reconnect_once();
        }
        let buf = self.buf(tag);
        let Some(q) = self.link.as_mut() else {
            return self.commit(tag, -libc::EIO);
        };
        let cmd = match op {
            Op::Read { offset, len } => Cmd::Read { offset, len },
            Op::Write { offset, len, fua } => Cmd::Write {
                offset,
                // SAFETY: the kernel copied the request's data into this tag's buffer.
                data: unsafe { std::slice::from_raw_parts(buf, len as usize) },
                fua,
            },
            Op::Flush => Cmd::Flush,
            Op::Trim { offset, len } => Cmd::Trim { offset, len },
            Op::Zero {
                offset,
                len,
                no_hole,
            } => Cmd::WriteZeroes {
                offset,
                len,
                no_hole,
            },
        };
        match q.submit(cmd, tag as u64) {
            Ok(()) => {
                self.slots[tag].sent = true;
                Ok(())
            }
            Err(e) => {
                log!("error", "queue {}: cannot send a request: {e}", self.id);
                self.commit(tag, -libc::EIO)
            }
        }
    }

    /// The result to commit for a blkwire completion; read data goes into the tag's buffer.
    fn result_of(slots: &[Slot], bufs: *mut u8, buf_len: usize, c: &Completion<'_>) -> Option<i32> {
        let tag = c.user as usize;
        let op = slots.get(tag)?.op?;
        if c.status != Status::Ok {
            return Some(-libc::EIO);
        }
        Some(match op {
            Op::Read { len, .. } => {
                let len = len as usize;
                let n = c.data.len().min(len);
                // SAFETY: n <= len <= buf_len (checked by map_op): inside this tag's buffer.
                unsafe {
                    let buf = bufs.add(tag * buf_len);
                    std::ptr::copy_nonoverlapping(c.data.as_ptr(), buf, n);
                    std::ptr::write_bytes(buf.add(n), 0, len - n);
                }
                len as i32
            }
            Op::Write { len, .. } => len as i32,
            _ => 0,
        })
    }

    fn try_reconnect_once(&mut self) {
        match blkwire_client::connect(&self.url, &self.reconnect) {
            Ok(mut s) => {
                if let Some(q) = s.queues.pop() {
                    log!("info", "queue {}: reconnected to {}", self.id, self.url);
                    self.link = Some(q);
                    self.link_id += 1;
                }
            }
            Err(e) => log!("warn", "queue {}: reconnecting: {e}", self.id),
        }
    }

    /// The connection broke: reconnect until the oldest request's deadline, then send again
    /// what was in flight; fail it with EIO when that does not work out.
    fn link_down(&mut self, why: &str) -> Result<(), String> {
        log!("warn", "queue {}: connection lost: {why}", self.id);
        self.link = None;
        let deadline = self
            .slots
            .iter()
            .filter(|s| s.op.is_some())
            .map(|s| s.deadline)
            .min()
            .unwrap_or_else(|| Instant::now() + self.timeout);
        let mut backoff = Duration::from_millis(100);
        while self.link.is_none() && Instant::now() < deadline {
            self.try_reconnect_once();
            if self.link.is_none() {
                std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
        for tag in 0..self.depth {
            if self.slots[tag].op.is_some() {
                self.slots[tag].sent = false;
                if self.link.is_some() {
                    self.send(tag)?;
                } else {
                    self.commit(tag, -libc::EIO)?;
                }
            }
        }
        Ok(())
    }

    /// One loop for both sides: the kernel's requests (ring completions of the tags) and the
    /// target's answers (the queue's socket, polled by the same ring, and `Queue::poll`), so
    /// requests the kernel hands over while others are in flight are sent at once, and the
    /// thread sleeps in one place until either side has something or the queue's next timer.
    fn serve(&mut self, ev: &mpsc::Sender<QEvent>) -> Result<(), String> {
        let r = self.fetch_all();
        let _ = ev.send(QEvent::Fetched(self.id as usize, r.clone()));
        r?;
        loop {
            // Requests from the kernel, and socket poll events.
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(ud, res, flags) in &cqes {
                if SockPoll::owns(ud) {
                    self.sock.on_cqe(ud, flags);
                    continue;
                }
                let tag = ud as usize;
                match res {
                    UBLK_IO_RES_OK => self.start(tag)?,
                    UBLK_IO_RES_ABORT => self.alive_tags -= 1,
                    e => {
                        log!(
                            "error",
                            "queue {}: tag {tag}: {}",
                            self.id,
                            io::Error::from_raw_os_error(-e)
                        );
                        self.alive_tags -= 1;
                    }
                }
            }
            cqes.clear();
            self.cqes = cqes;
            if self.alive_tags == 0 {
                return Ok(());
            }
            // The target's answers, without waiting.
            let mut done = std::mem::take(&mut self.done);
            let r = match self.link.as_mut() {
                Some(q) => {
                    let (slots, bufs, buf_len) = (&self.slots, self.bufs, self.buf_len);
                    q.poll(|c| {
                        if let Some(res) = Self::result_of(slots, bufs, buf_len, &c) {
                            done.push((c.user as usize, res));
                        }
                    })
                }
                None => Ok(0),
            };
            for &(tag, res) in &done {
                self.commit(tag, res)?;
            }
            done.clear();
            self.done = done;
            if let Err(e) = r {
                self.link_down(&e.to_string())?;
            }
            let want = self.link.as_ref().map(|q| (self.link_id, q.fd()));
            for sqe in self.sock.update(want).into_iter().flatten() {
                self.push(&sqe)?;
            }
            // Commits go out; with answers outstanding the thread spins briefly for one or for a
            // request (the poll(2) also lets the kernel run the ring's task work), then sleeps
            // until a request, an answer or a timer.
            if let Some(fd) = self
                .link
                .as_ref()
                .filter(|q| q.in_flight() > 0)
                .map(|q| q.fd())
            {
                self.ring
                    .submit()
                    .map_err(|e| format!("io_uring submit: {e}"))?;
                let ring = &mut self.ring;
                if self
                    .spin
                    .spin(|| readable([fd]) || !ring.completion().is_empty())
                {
                    continue;
                }
            }
            let limit = self
                .link
                .as_ref()
                .and_then(|q| q.deadline())
                .map(|d| d.saturating_duration_since(Instant::now()));
            crate::sockpoll::sleep(&mut self.ring, limit)?;
        }
    }

    fn run(mut self, ev: mpsc::Sender<QEvent>) {
        let error = self.serve(&ev).err();
        if let Some(q) = self.link.take() {
            crate::worker::final_flush(q, self.readonly, self.id as usize);
        }
        let id = self.id as usize;
        drop(self); // unmaps and closes before the main thread deletes the device
        let _ = ev.send(QEvent::Exited(id, error));
    }
}

// ---------------------------------------------------------------------------------------------
// Daemon

struct Undo<'a> {
    ctrl: &'a mut Ctrl,
    dev_id: Option<u32>,
    started: bool,
    /// Queue threads hold the char device: delete without waiting for it.
    threads: bool,
    record: Option<String>,
    restore: Option<Record>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if let Some(r) = &self.restore {
            let _ = r.save();
        } else if let Some(d) = &self.record {
            Record::remove(d);
        }
        if let Some(id) = self.dev_id {
            if self.started {
                let _ = self.ctrl.stop(id);
            }
            if self.ctrl.delete_async(id).is_err() && !self.threads {
                let _ = self.ctrl.delete(id);
            }
        }
    }
}

struct Running {
    ctrl: Ctrl,
    dev_id: u32,
    events: mpsc::Receiver<QEvent>,
    queues: usize,
    timeout: Duration,
}

pub(crate) fn run(spec: &Spec, notify: &mut Notify<'_>) -> Result<(), String> {
    let r = match setup(spec) {
        Ok(r) => r,
        Err(e) => {
            log!("error", "{e}");
            notify.failed(&e);
            return Err(e);
        }
    };
    notify.ready(&device_path(r.dev_id));
    serve(r);
    Ok(())
}

fn setup(spec: &Spec) -> Result<Running, String> {
    state::ensure_dirs().map_err(|e| format!("{}: {e}", state::run_dir().display()))?;
    let mut ctrl = Ctrl::open()?;
    probe(&mut ctrl)?;
    let crate::daemon::Connected {
        session,
        info,
        reconnect,
        readonly,
    } = crate::daemon::connect(spec)?;
    let rotational = spec.hdd || info.features.has(Features::ROTATIONAL);
    let sigs = sys::block_stop_signals();
    if let Err(e) = sys::set_io_flusher() {
        log!("warn", "PR_SET_IO_FLUSHER: {e}");
    }
    let nq = session.queues.len();
    let depth = (info.depth as usize).clamp(1, UBLK_MAX_QUEUE_DEPTH);
    let page = page_size() as u32;
    let max_io = (info.max_io.min(MAX_IO_BUF) / page * page).max(page);

    let mut ctrl2 = Ctrl::open()?; // the one Undo holds; `ctrl` stays for the main loop
    let mut undo = Undo {
        ctrl: &mut ctrl2,
        dev_id: None,
        started: false,
        threads: false,
        record: None,
        restore: None,
    };
    let pid = std::process::id() as i32;
    let (dev_id, depth, max_io) = match &spec.mode {
        Mode::New { dev_num } => {
            let mut di = DevInfo {
                nr_hw_queues: nq as u16,
                queue_depth: depth as u16,
                max_io_buf_bytes: max_io,
                dev_id: dev_num.unwrap_or(u32::MAX),
                flags: UBLK_F_USER_RECOVERY
                    | UBLK_F_USER_RECOVERY_REISSUE
                    | UBLK_F_CMD_IOCTL_ENCODE
                    | UBLK_F_URING_CMD_COMP_IN_TASK,
                ..Default::default()
            };
            undo.ctrl.add(&mut di).map_err(|e| match dev_num {
                Some(n) if e.raw_os_error() == Some(libc::EEXIST) => {
                    format!("{} already exists", device_path(*n))
                }
                _ => format!("creating a ublk device (ADD_DEV): {e}"),
            })?;
            undo.dev_id = Some(di.dev_id);
            if di.flags & UBLK_F_USER_RECOVERY == 0 {
                return Err("the kernel's ublk driver dropped USER_RECOVERY from the device flags; use --frontend fuse".into());
            }
            let max_io = di.max_io_buf_bytes.min(max_io);
            let mut p = params_for(&info, readonly, rotational, max_io);
            undo.ctrl.set_params(di.dev_id, &mut p).map_err(|e| {
                format!(
                    "setting the parameters of ublk device {} (SET_PARAMS): {e}",
                    di.dev_id
                )
            })?;
            (di.dev_id, di.queue_depth as usize, max_io)
        }
        Mode::Recover(old) => {
            let id = parse_device(&old.device)
                .ok_or_else(|| format!("bad device '{}' in the record", old.device))?;
            let di = ctrl
                .dev_info(id)
                .map_err(|e| format!("{}: GET_DEV_INFO: {e}", old.device))?;
            if di.nr_hw_queues as usize != nq {
                return Err(format!(
                    "{} has {} queue(s) but the target granted {nq}: cannot recover",
                    old.device, di.nr_hw_queues
                ));
            }
            if di.max_io_buf_bytes > max_io {
                return Err(format!(
                    "{} takes I/O of up to {} bytes but the target now grants {max_io}: cannot recover",
                    old.device, di.max_io_buf_bytes
                ));
            }
            if (di.queue_depth as usize) > depth {
                return Err(format!(
                    "{} has queue depth {} but the target now grants {depth}: cannot recover",
                    old.device, di.queue_depth
                ));
            }
            // The kernel quiesces the device a few seconds after the old daemon died.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match ctrl.start_recovery(id) {
                    Ok(()) => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(200))
                    }
                    Err(e) => {
                        return Err(format!(
                            "{}: START_USER_RECOVERY: {e} (state {})",
                            old.device, di.state
                        ))
                    }
                }
            }
            undo.restore = Some((**old).clone());
            (id, di.queue_depth as usize, di.max_io_buf_bytes)
        }
    };
    let device = device_path(dev_id);
    let record = Record {
        device: device.clone(),
        url: spec.url.to_string(),
        export: spec.url.export.clone(),
        frontend: FRONTEND_UBLK.into(),
        pid,
        start_time: state::self_start_time(),
        mountpoint: String::new(),
        file: String::new(),
        size: info.size,
        readonly,
        queues: nq as u16,
        queue_depth: depth as u16,
        max_io,
        timeout_secs: spec.timeout.as_secs(),
        hdd: spec.hdd,
        logfile: spec.logfile.clone(),
        fuse_io: None,
    };
    if let Mode::New { .. } = spec.mode {
        if let Some(old) = Record::load(&device)? {
            if old.liveness() == state::Liveness::Running {
                return Err(format!(
                    "{device} is still recorded for blkwire pid {}",
                    old.pid
                ));
            }
        }
        undo.record = Some(device.clone());
    }
    record
        .save()
        .map_err(|e| format!("writing the record of {device}: {e}"))?;

    let cdev_path = format!("/dev/ublkc{dev_id}");
    if !wait_for_path(&cdev_path, Duration::from_secs(5)) {
        return Err(format!("{cdev_path} did not appear"));
    }
    let cdev = Arc::new(
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&cdev_path)
            .map_err(|e| format!("{cdev_path}: {e}"))?,
    );
    let (tx, events) = mpsc::channel();
    for (i, q) in session.queues.into_iter().enumerate() {
        let w = QueueWorker::new(
            i as u16,
            Arc::clone(&cdev),
            depth,
            max_io as usize,
            q,
            spec.url.clone(),
            reconnect.clone(),
            readonly,
            spec.timeout,
        )?;
        let tx = tx.clone();
        undo.threads = true;
        std::thread::Builder::new()
            .name(format!("blkwire-ublk-q{i}"))
            .spawn(move || w.run(tx))
            .map_err(|e| format!("starting a queue thread: {e}"))?;
    }
    drop(cdev);
    let mut fetched = 0;
    while fetched < nq {
        match events.recv_timeout(Duration::from_secs(10)) {
            Ok(QEvent::Fetched(_, Ok(()))) => fetched += 1,
            Ok(QEvent::Fetched(i, Err(e))) => return Err(format!("ublk queue {i}: {e}")),
            Ok(QEvent::Exited(i, e)) => {
                return Err(format!(
                    "ublk queue {i} stopped during setup: {}",
                    e.unwrap_or_default()
                ))
            }
            Ok(QEvent::Signal(_)) => {}
            Err(_) => return Err("the ublk queues did not start in time".into()),
        }
    }
    match &spec.mode {
        Mode::New { .. } => {
            undo.ctrl
                .start(dev_id)
                .map_err(|e| format!("starting {device} (START_DEV): {e}"))?;
            undo.started = true;
        }
        Mode::Recover(_) => ctrl
            .end_recovery(dev_id)
            .map_err(|e| format!("{device}: END_USER_RECOVERY: {e}"))?,
    }
    if !wait_for_path(&device, Duration::from_secs(5)) {
        return Err(format!("{device} did not appear"));
    }
    let sig_tx = tx;
    std::thread::Builder::new()
        .name("blkwire-signals".into())
        .spawn(move || loop {
            let sig = sys::wait_signal(&sigs);
            if sig_tx.send(QEvent::Signal(sig)).is_err() {
                break;
            }
        })
        .map_err(|e| format!("starting the signal thread: {e}"))?;
    undo.dev_id = None;
    undo.record = None;
    undo.restore = None;
    drop(undo);
    log!(
        "info",
        "{device} serves {} ({} bytes{}): {nq} queue(s) x depth {depth}, I/O up to {} KiB, I/O timeout {}s",
        spec.url,
        info.size,
        if readonly { ", read-only" } else { "" },
        max_io / 1024,
        spec.timeout.as_secs()
    );
    Ok(Running {
        ctrl,
        dev_id,
        events,
        queues: nq,
        timeout: spec.timeout,
    })
}

fn serve(mut r: Running) {
    let device = device_path(r.dev_id);
    let mut exited = 0;
    let mut stopping = false;
    while exited < r.queues {
        let ev = if stopping {
            match r.events.recv_timeout(r.timeout + Duration::from_secs(5)) {
                Ok(ev) => ev,
                Err(_) => {
                    log!("warn", "the ublk queues did not stop in time");
                    break;
                }
            }
        } else {
            match r.events.recv() {
                Ok(ev) => ev,
                Err(_) => break,
            }
        };
        match ev {
            QEvent::Signal(sig) => {
                if stopping {
                    continue;
                }
                stopping = true;
                log!("info", "signal {sig}: stopping {device}");
                if let Err(e) = r.ctrl.stop(r.dev_id) {
                    log!("error", "stopping {device}: {e}");
                }
            }
            QEvent::Exited(i, e) => {
                exited += 1;
                if let Some(e) = e {
                    log!("error", "ublk queue {i} stopped: {e}");
                }
                if !stopping {
                    // The device was stopped from outside, or a queue failed: stop it all.
                    stopping = true;
                    let _ = r.ctrl.stop(r.dev_id);
                }
            }
            QEvent::Fetched(..) => {}
        }
    }
    let deleted = if exited == r.queues {
        r.ctrl.delete(r.dev_id)
    } else {
        // Stuck queue threads still hold the char device: the kernel deletes the device once
        // this process is gone.
        r.ctrl.delete_async(r.dev_id)
    };
    if let Err(e) = deleted {
        log!("warn", "deleting {device}: {e}");
    }
    Record::remove_if_owned(&device, std::process::id() as i32);
    log!("info", "{device} unmapped");
}

/// `unmap /dev/ublkbN`: a live daemon is asked to stop (SIGTERM) and waited for; a dead one's
/// device is stopped and deleted here.
pub(crate) fn unmap(device: &str, id: u32) -> Result<(), String> {
    let path = device_path(id);
    let not_ours =
        || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
    let rec = Record::load(&path)?.ok_or_else(not_ours)?;
    if rec.frontend != FRONTEND_UBLK {
        return Err(not_ours());
    }
    preflight()?;
    if let Some(at) = crate::loopdev::mount_points(path.trim_start_matches("/dev/")).first() {
        return Err(format!(
            "{path} is mounted on {at}: unmount it first, then unmap it"
        ));
    }
    if let Some(p) = Proc::open(rec.pid, rec.start_time) {
        let _ = p.kill(libc::SIGTERM);
        let limit = Duration::from_secs(rec.timeout_secs) + Duration::from_secs(10);
        if !p.wait_exit(limit) {
            let _ = p.kill(libc::SIGKILL);
            p.wait_exit(Duration::from_secs(10));
        }
    }
    let mut ctrl = Ctrl::open()?;
    match ctrl.stop(id) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
        Err(e) => return Err(format!("stopping {path}: {e}")),
    }
    match ctrl.delete(id) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
        Err(e) => return Err(format!("deleting {path}: {e}")),
    }
    Record::remove(&path);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn struct_layouts_match_the_kernel_abi() {
        assert_eq!(size_of::<CtrlCmd>(), 32);
        assert_eq!(offset_of!(CtrlCmd, addr), 8);
        assert_eq!(offset_of!(CtrlCmd, data), 16);
        assert_eq!(offset_of!(CtrlCmd, dev_path_len), 24);
        assert_eq!(size_of::<DevInfo>(), 64);
        assert_eq!(offset_of!(DevInfo, max_io_buf_bytes), 8);
        assert_eq!(offset_of!(DevInfo, dev_id), 12);
        assert_eq!(offset_of!(DevInfo, ublksrv_pid), 16);
        assert_eq!(offset_of!(DevInfo, flags), 24);
        assert_eq!(offset_of!(DevInfo, owner_uid), 40);
        assert_eq!(size_of::<IoDesc>(), 24);
        assert_eq!(offset_of!(IoDesc, start_sector), 8);
        assert_eq!(offset_of!(IoDesc, addr), 16);
        assert_eq!(size_of::<IoCmd>(), 16);
        assert_eq!(offset_of!(IoCmd, result), 4);
        assert_eq!(offset_of!(IoCmd, addr), 8);
        assert_eq!(size_of::<ParamBasic>(), 32);
        assert_eq!(offset_of!(ParamBasic, max_sectors), 8);
        assert_eq!(offset_of!(ParamBasic, dev_sectors), 16);
        assert_eq!(size_of::<ParamDiscard>(), 20);
        assert_eq!(size_of::<ParamDevt>(), 16);
        assert_eq!(size_of::<ParamZoned>(), 32);
        assert_eq!(offset_of!(Params, basic), 8);
        assert_eq!(offset_of!(Params, discard), 40);
        assert_eq!(offset_of!(Params, devt), 60);
        assert_eq!(offset_of!(Params, zoned), 76);
        assert_eq!(size_of::<Params>(), 112);
    }

    #[test]
    fn command_numbers_are_ioctl_encoded() {
        // Values from linux/ublk_cmd.h (_IOR/_IOWR('u', nr, type)).
        assert_eq!(UBLK_U_CMD_GET_DEV_INFO, 0x8020_7502);
        assert_eq!(UBLK_U_CMD_ADD_DEV, 0xc020_7504);
        assert_eq!(UBLK_U_CMD_DEL_DEV, 0xc020_7505);
        assert_eq!(UBLK_U_CMD_START_DEV, 0xc020_7506);
        assert_eq!(UBLK_U_CMD_STOP_DEV, 0xc020_7507);
        assert_eq!(UBLK_U_CMD_SET_PARAMS, 0xc020_7508);
        assert_eq!(UBLK_U_CMD_START_USER_RECOVERY, 0xc020_7510);
        assert_eq!(UBLK_U_CMD_END_USER_RECOVERY, 0xc020_7511);
        assert_eq!(UBLK_U_CMD_GET_FEATURES, 0x8020_7513);
        assert_eq!(UBLK_U_CMD_DEL_DEV_ASYNC, 0x8020_7514);
        assert_eq!(UBLK_U_IO_FETCH_REQ, 0xc010_7520);
        assert_eq!(UBLK_U_IO_COMMIT_AND_FETCH_REQ, 0xc010_7521);
    }

    fn desc(op: u8, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: op as u32 | flags,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        }
    }

    #[test]
    fn a_flush_ignores_its_sector_and_an_overflowing_sector_is_refused() {
        let m = |d: IoDesc| map_op(&d, false, 1 << 20);
        // The kernel does not zero a flush's sector (kernel lab: mkfs failed when it was checked).
        assert_eq!(m(desc(UBLK_IO_OP_FLUSH, 0, u64::MAX, 0)), Ok(Op::Flush));
        assert_eq!(
            m(desc(UBLK_IO_OP_READ, 0, u64::MAX / 256, 8)),
            Err(libc::EINVAL)
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_DISCARD, 0, 1 << 55, 8)),
            Err(libc::EINVAL)
        );
    }

    #[test]
    fn ops_map_to_blkwire_commands() {
        let m = |d: IoDesc| map_op(&d, false, 1 << 20);
        assert_eq!(
            m(desc(UBLK_IO_OP_READ, 0, 8, 8)),
            Ok(Op::Read {
                offset: 4096,
                len: 4096
            })
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, 1, 1)),
            Ok(Op::Write {
                offset: 512,
                len: 512,
                fua: true
            })
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE, 0, 0, 1)),
            Ok(Op::Write {
                offset: 0,
                len: 512,
                fua: false
            })
        );
        assert_eq!(m(desc(UBLK_IO_OP_FLUSH, 0, 0, 0)), Ok(Op::Flush));
        assert_eq!(
            m(desc(UBLK_IO_OP_DISCARD, 0, 16, 2048)),
            Ok(Op::Trim {
                offset: 8192,
                len: 1 << 20
            })
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE_ZEROES, UBLK_IO_F_NOUNMAP, 0, 8)),
            Ok(Op::Zero {
                offset: 0,
                len: 4096,
                no_hole: true
            })
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE_ZEROES, 0, 0, 8)),
            Ok(Op::Zero {
                offset: 0,
                len: 4096,
                no_hole: false
            })
        );
        // Larger than the tag buffer, unknown ops, writes to a read-only device.
        assert_eq!(m(desc(UBLK_IO_OP_READ, 0, 0, 4096)), Err(libc::EINVAL));
        assert_eq!(m(desc(4, 0, 0, 8)), Err(libc::EOPNOTSUPP));
        assert_eq!(
            map_op(&desc(UBLK_IO_OP_WRITE, 0, 0, 8), true, 1 << 20),
            Err(libc::EROFS)
        );
        assert_eq!(
            map_op(&desc(UBLK_IO_OP_READ, 0, 0, 8), true, 1 << 20),
            Ok(Op::Read {
                offset: 0,
                len: 4096
            })
        );
    }

    #[test]
    fn params_follow_the_export() {
        let info = ExportInfo {
            name: "d".into(),
            size: 1 << 30,
            logical_block: 512,
            physical_block: 4096,
            features: Features(
                Features::FLUSH
                    | Features::FUA
                    | Features::TRIM
                    | Features::WRITE_ZEROES
                    | Features::ROTATIONAL,
            ),
            queues: 2,
            depth: 64,
            max_io: 1 << 20,
            session: 1,
        };
        let p = params_for(&info, false, true, 512 << 10);
        assert_eq!(p.types, UBLK_PARAM_TYPE_BASIC | UBLK_PARAM_TYPE_DISCARD);
        assert_eq!(p.basic.logical_bs_shift, 9);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.max_sectors, 1024);
        assert_eq!(p.basic.dev_sectors, 1 << 21);
        assert_eq!(
            p.basic.attrs,
            UBLK_ATTR_ROTATIONAL | UBLK_ATTR_VOLATILE_CACHE | UBLK_ATTR_FUA
        );
        assert_eq!(p.discard.max_discard_segments, 1);
        assert_eq!(p.discard.discard_granularity, 4096);
        assert_eq!(p.discard.max_discard_sectors, MAX_RANGE_SECTORS);
        let ro = params_for(&info, true, false, 512 << 10);
        assert_eq!(ro.basic.attrs & UBLK_ATTR_READ_ONLY, UBLK_ATTR_READ_ONLY);
        assert_eq!(ro.types, UBLK_PARAM_TYPE_BASIC);
    }

    #[test]
    fn features_and_devices() {
        assert!(missing_features(
            UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE | UBLK_F_CMD_IOCTL_ENCODE
        )
        .is_empty());
        assert_eq!(
            missing_features(UBLK_F_CMD_IOCTL_ENCODE),
            vec!["USER_RECOVERY", "USER_RECOVERY_REISSUE"]
        );
        assert_eq!(parse_device("/dev/ublkb3"), Some(3));
        assert_eq!(parse_device("ublkb12"), Some(12));
        for bad in ["/dev/ublkc0", "/dev/ublkb", "/dev/loop0", "ublkb1x"] {
            assert_eq!(parse_device(bad), None, "{bad}");
        }
        assert_eq!(queue_cmd_buf_size(64), 4096);
        assert_eq!(max_cmd_buf_size() % page_size(), 0);
    }
}
