//! The ublk device: the kernel's userspace block driver (ublk_drv, Linux >= 6.0) with blkwire
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
//! the kernel quiesces the device instead of removing it; `map --recover /dev/ublkbN` waits for
//! that, fences the dead daemon's queues on the target (PROTOCOL.md §2.6), connects, runs
//! START_USER_RECOVERY, fetches every tag again from a new daemon, then END_USER_RECOVERY, and
//! the requests that were in flight are issued again.
//!
//! `abi` is the kernel's structs, constants and the decoding of a descriptor (pure, tested and
//! fuzzed without a kernel); `control` the /dev/ublk-control commands; `queue` a queue's thread;
//! `device` the `BlockDevice` the daemon drives.

pub mod abi;
mod control;
mod device;
mod queue;

pub(crate) use abi::UBLK_CONTROL;
pub(crate) use device::UblkDevice;
