//! The ublk kernel ABI (include/uapi/linux/ublk_cmd.h, Linux 6.12): command numbers, flags,
//! the structs the control and queue commands carry, and the decoding of an I/O descriptor into
//! a blkwire command (`map_op`), which is pure so it is tested (and fuzzed) without a kernel.

use blkwire_client::{BlockOp, BlockRequest, ExportInfo, IoFlags};
use blkwire_wire::Features;

/// The control device every ublk command goes to.
pub(crate) const UBLK_CONTROL: &str = "/dev/ublk-control";

pub(crate) const IOC_WRITE: u32 = 1;
pub(crate) const IOC_READ: u32 = 2;

/// `_IOC(dir, 'u', nr, size)`.
pub(crate) const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}

pub(crate) const CTRL_LEN: usize = std::mem::size_of::<CtrlCmd>();
pub(crate) const IO_LEN: usize = std::mem::size_of::<IoCmd>();

pub(crate) const UBLK_U_CMD_GET_DEV_INFO: u32 = ioc(IOC_READ, 0x02, CTRL_LEN);
pub(crate) const UBLK_U_CMD_ADD_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x04, CTRL_LEN);
pub(crate) const UBLK_U_CMD_DEL_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x05, CTRL_LEN);
pub(crate) const UBLK_U_CMD_START_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x06, CTRL_LEN);
pub(crate) const UBLK_U_CMD_STOP_DEV: u32 = ioc(IOC_READ | IOC_WRITE, 0x07, CTRL_LEN);
pub(crate) const UBLK_U_CMD_SET_PARAMS: u32 = ioc(IOC_READ | IOC_WRITE, 0x08, CTRL_LEN);
pub(crate) const UBLK_U_CMD_START_USER_RECOVERY: u32 = ioc(IOC_READ | IOC_WRITE, 0x10, CTRL_LEN);
pub(crate) const UBLK_U_CMD_END_USER_RECOVERY: u32 = ioc(IOC_READ | IOC_WRITE, 0x11, CTRL_LEN);
pub(crate) const UBLK_U_CMD_GET_FEATURES: u32 = ioc(IOC_READ, 0x13, CTRL_LEN);
/// DEL_DEV without waiting for the device's last user (Linux >= 6.9).
pub(crate) const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ioc(IOC_READ, 0x14, CTRL_LEN);
pub(crate) const UBLK_U_IO_FETCH_REQ: u32 = ioc(IOC_READ | IOC_WRITE, 0x20, IO_LEN);
pub(crate) const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = ioc(IOC_READ | IOC_WRITE, 0x21, IO_LEN);

/// GET_DEV_INFO's `state` once the kernel has quiesced a USER_RECOVERY device whose server's
/// queues went away (its rings were torn down: the server died), holding its I/O.
pub(crate) const UBLK_S_DEV_QUIESCED: u16 = 2;

pub(crate) const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub(crate) const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub(crate) const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub(crate) const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;

pub(crate) const UBLK_IO_OP_READ: u8 = 0;
pub(crate) const UBLK_IO_OP_WRITE: u8 = 1;
pub(crate) const UBLK_IO_OP_FLUSH: u8 = 2;
pub(crate) const UBLK_IO_OP_DISCARD: u8 = 3;
pub(crate) const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub(crate) const UBLK_IO_F_FUA: u32 = 1 << 13;
pub(crate) const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;

pub(crate) const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub(crate) const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub(crate) const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub(crate) const UBLK_ATTR_FUA: u32 = 1 << 3;
pub(crate) const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub(crate) const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;

pub(crate) const UBLK_IO_RES_OK: i32 = 0;
pub(crate) const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;
pub(crate) const UBLK_MAX_QUEUE_DEPTH: usize = 4096;
/// What the driver accepts as the I/O buffer size of one request (libublk's default cap too).
pub(crate) const MAX_IO_BUF: u32 = 1 << 20;
/// DISCARD and WRITE_ZEROES are limited so one request is one blkwire command (32-bit length),
/// or less where the session says (`ExportInfo::max_range`).
pub(crate) const MAX_RANGE_SECTORS: u32 = (1 << 30) >> 9;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CtrlCmd {
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
pub(crate) struct DevInfo {
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

/// struct ublksrv_io_desc: one request, as the kernel writes it into the queue's descriptor
/// area.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IoDesc {
    /// op: bits 0-7, flags: bits 8-31
    pub op_flags: u32,
    /// Length in 512-byte sectors (for most operations).
    pub nr_sectors: u32,
    /// First 512-byte sector.
    pub start_sector: u64,
    /// The buffer the server registered for this tag.
    pub addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ParamBasic {
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
pub(crate) struct ParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ParamDevt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ParamZoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

/// `struct ublk_params` as of 6.12 (basic, discard, devt, zoned); `len` tells the driver how
/// much of it we know, so newer kernels with more parameter types accept it too.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Params {
    pub len: u32,
    pub types: u32,
    pub basic: ParamBasic,
    pub discard: ParamDiscard,
    pub devt: ParamDevt,
    pub zoned: ParamZoned,
}

impl IoDesc {
    /// The operation (UBLK_IO_OP_*).
    pub fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }
    /// The flags (UBLK_IO_F_*).
    pub fn flags(&self) -> u32 {
        self.op_flags & !0xff
    }
}

/// The bytes of a command struct, to copy into an SQE's command area.
///
/// # Safety
///
/// `T` must have no padding: every byte of a value is initialised.
pub(crate) unsafe fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: `v` is a live borrow of size_of::<T>() bytes, all initialised (the caller's word).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Size of one queue's descriptor area in the char device's mmap space (the kernel's
/// `ublk_max_cmd_buf_size`) and the length we map (`ublk_queue_cmd_buf_size`).
pub(crate) use crate::sys::page_size;
pub(crate) fn max_cmd_buf_size() -> usize {
    (UBLK_MAX_QUEUE_DEPTH * std::mem::size_of::<IoDesc>()).next_multiple_of(page_size())
}
pub(crate) fn queue_cmd_buf_size(depth: usize) -> usize {
    (depth * std::mem::size_of::<IoDesc>()).next_multiple_of(page_size())
}

/// Decodes a request descriptor into the blkwire command for it, or the errno to answer: a
/// READ or WRITE must fit the tag's buffer (`buf_len`), nothing may change a read-only device.
pub fn map_op(d: &IoDesc, readonly: bool, buf_len: usize) -> Result<BlockRequest, i32> {
    if d.op() == UBLK_IO_OP_FLUSH {
        // A flush names no range: the kernel leaves its sector as it likes (not always 0).
        return Ok(BlockRequest::new(BlockOp::Flush, 0, 0));
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
            Ok(BlockRequest::new(BlockOp::Read, offset, len))
        }
        UBLK_IO_OP_WRITE => {
            fits()?;
            write()?;
            let fua = d.flags() & UBLK_IO_F_FUA != 0;
            Ok(BlockRequest::new(BlockOp::Write, offset, len)
                .flagged(IoFlags::empty().with(IoFlags::FUA, fua)))
        }
        UBLK_IO_OP_DISCARD => {
            write()?;
            Ok(BlockRequest::new(BlockOp::Trim, offset, len))
        }
        UBLK_IO_OP_WRITE_ZEROES => {
            write()?;
            let no_hole = d.flags() & UBLK_IO_F_NOUNMAP != 0;
            Ok(BlockRequest::new(BlockOp::WriteZeroes, offset, len)
                .flagged(IoFlags::empty().with(IoFlags::NO_HOLE, no_hole)))
        }
        _ => Err(libc::EOPNOTSUPP),
    }
}

/// The device parameters for an export.
pub(crate) fn params_for(
    info: &ExportInfo,
    readonly: bool,
    rotational: bool,
    max_io: u32,
) -> Params {
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
        // The kernel splits discards and zeroing at these: one request is one command.
        let range = (info.max_range >> 9).min(MAX_RANGE_SECTORS);
        p.types |= UBLK_PARAM_TYPE_DISCARD;
        p.discard = ParamDiscard {
            discard_alignment: 0,
            discard_granularity: 1 << pbs,
            max_discard_sectors: if trim { range } else { 0 },
            max_write_zeroes_sectors: if zero { range } else { 0 },
            max_discard_segments: 1,
            reserved0: 0,
        };
    }
    p
}

/// The flags a mapping needs, with their names for the error message.
pub(crate) const NEEDED: [(u64, &str); 3] = [
    (UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
];

pub(crate) fn missing_features(have: u64) -> Vec<&'static str> {
    NEEDED
        .iter()
        .filter(|(f, _)| have & f == 0)
        .map(|(_, n)| *n)
        .collect()
}
/// `/dev/ublkb3` -> 3
pub(crate) fn parse_device(s: &str) -> Option<u32> {
    let n = s.strip_prefix("/dev/").unwrap_or(s).strip_prefix("ublkb")?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

pub(crate) fn device_path(id: u32) -> String {
    format!("/dev/ublkb{id}")
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
        assert_eq!(
            m(desc(UBLK_IO_OP_FLUSH, 0, u64::MAX, 0)),
            Ok(BlockRequest::new(BlockOp::Flush, 0, 0))
        );
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
            Ok(BlockRequest::new(BlockOp::Read, 4096, 4096))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, 1, 1)),
            Ok(BlockRequest::new(BlockOp::Write, 512, 512).flagged(IoFlags::FUA))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE, 0, 0, 1)),
            Ok(BlockRequest::new(BlockOp::Write, 0, 512))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_FLUSH, 0, 0, 0)),
            Ok(BlockRequest::new(BlockOp::Flush, 0, 0))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_DISCARD, 0, 16, 2048)),
            Ok(BlockRequest::new(BlockOp::Trim, 8192, 1 << 20))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE_ZEROES, UBLK_IO_F_NOUNMAP, 0, 8)),
            Ok(BlockRequest::new(BlockOp::WriteZeroes, 0, 4096).flagged(IoFlags::NO_HOLE))
        );
        assert_eq!(
            m(desc(UBLK_IO_OP_WRITE_ZEROES, 0, 0, 8)),
            Ok(BlockRequest::new(BlockOp::WriteZeroes, 0, 4096))
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
            Ok(BlockRequest::new(BlockOp::Read, 0, 4096))
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
            copy: Default::default(),
            header_crc: false,
            max_range: blkwire_client::MAX_RANGE,
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
        assert_eq!(p.discard.max_write_zeroes_sectors, MAX_RANGE_SECTORS);
        // An NVMe/TCP session zeroes 65536 blocks per command at most: the device's limit.
        let nvme = ExportInfo {
            max_range: 65536 * 512,
            ..info.clone()
        };
        let p = params_for(&nvme, false, true, 512 << 10);
        assert_eq!(p.discard.max_write_zeroes_sectors, 65536);
        assert_eq!(p.discard.max_discard_sectors, 65536);
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
