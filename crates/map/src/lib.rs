//! blkwire block devices: `map` turns an export into a local block device, `unmap` ends it,
//! `list` shows what is mapped (docs/ARCHITECTURE.md, "Map daemon").
//!
//! Two kinds of device serve a mapping, both behind one trait, `device::BlockDevice`, that the
//! daemon drives (prepare, set up for a connected export, serve, tear down, recover, unmap):
//! **fuse** (`fuse`: a one-file FUSE filesystem served by the daemon, bound to a loop device with
//! direct I/O) works on any kernel with FUSE and loop; **ublk** (`ublk`: the kernel's userspace
//! block driver over io_uring, with USER_RECOVERY) is chosen by `auto` when the kernel offers
//! /dev/ublk-control.
//!
//! Layering (checked by hand with crates/map/check-layers.sh): a module uses only modules of a
//! lower number, and modules on one line use none of each other; inside `fuse` and `ublk` a
//! module uses only the ones before it.
//! 1. `log` (timestamped lines), `state` (mapping records and liveness)
//! 2. `sys` (signals, pidfds, eventfd, mount points), `sockpoll` (a queue's socket in a ring)
//! 3. `device` (the `BlockDevice` trait, the mapping spec, connecting, the last flush)
//! 4. `fuse`: `abi` < `channel` < `uring` < `loopdev`, `partial` < `worker` < `device`;
//!    `ublk`: `abi` < `control` < `queue` < `device`
//! 5. `daemon` (`map`, `recover`, `unmap`: picks the kind, forks, reports readiness)

#![deny(missing_docs)]

pub mod log;
mod state;

mod sockpoll;
mod sys;

mod device;

pub mod fuse;
pub mod ublk;

mod daemon;

pub use daemon::{choose_kind, map, recover, unmap, DeviceKind, MapOptions};
pub use device::{fence_recorded, FuseIo};
pub use state::{Liveness, Record, RecordedQueue};

/// Every mapping with its state, sorted by device; unreadable records as errors.
pub fn list() -> Vec<Result<(Record, Liveness), String>> {
    state::list()
        .into_iter()
        .map(|r| {
            r.map(|r| {
                let l = daemon::liveness(&r);
                (r, l)
            })
        })
        .collect()
}
