//! blkwire block devices: `map` turns an export into a local block device, `unmap` ends it,
//! `list` shows what is mapped (docs/ARCHITECTURE.md, "Map daemon").
//!
//! Frontends: **fuse** (a one-file FUSE filesystem served by a daemon, bound to a loop device
//! with direct I/O) works on any kernel with FUSE and loop. **ublk** (`ublk`: the kernel's
//! userspace block driver over io_uring, with USER_RECOVERY) is chosen by `auto` when the kernel
//! offers /dev/ublk-control.
//!
//! Modules: `ublk` (the ublk frontend: ABI, control commands, queue threads), `fuse` (kernel
//! protocol over /dev/fuse), `fuse_uring` (FUSE over io_uring: switch, ABI, ring entries), `loopdev` (loop ioctls), `state` (mapping
//! records and liveness), `worker` (per-queue data path), `daemon` (setup, readiness, teardown),
//! `unmap`, `sys` (signals, pidfds), `log`.

pub mod fuse;
pub mod fuse_uring;
pub mod log;
pub mod loopdev;
pub mod state;

mod daemon;
mod sockpoll;
mod sys;
pub mod ublk;
mod unmap;
mod worker;

pub use daemon::{map, recover, MapOptions};
pub use state::{Liveness, Record};
pub use unmap::unmap;

pub const FRONTEND_FUSE: &str = "fuse";
pub const FRONTEND_UBLK: &str = "ublk";
const UBLK_CONTROL: &str = "/dev/ublk-control";
/// The ublk frontend is built in: `auto` picks it when the kernel offers /dev/ublk-control.
const UBLK_BUILT: bool = true;

/// `--fuse-io`: how the fuse frontend exchanges requests with the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FuseIo {
    /// io_uring when the kernel's switch is on and the kernel offers it at INIT, else read.
    Auto,
    /// io_uring or fail; turns the kernel's switch on (root) when it is off.
    Uring,
    /// read()/writev() on /dev/fuse.
    Read,
}

/// What records (and `ls`) say about a fuse mapping's I/O path.
pub const FUSE_IO_URING: &str = "uring";
pub const FUSE_IO_READ: &str = "read";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frontend {
    Auto,
    Ublk,
    Fuse,
}

/// Resolves `--frontend` to the frontend that will serve the mapping, or says why it cannot.
pub fn choose_frontend(f: Frontend) -> Result<&'static str, String> {
    let has_ublk = std::path::Path::new(UBLK_CONTROL).exists();
    match f {
        Frontend::Fuse => Ok(FRONTEND_FUSE),
        Frontend::Auto if has_ublk && UBLK_BUILT => Ok(FRONTEND_UBLK),
        Frontend::Auto => Ok(FRONTEND_FUSE),
        Frontend::Ublk if !has_ublk => Err(format!(
            "the ublk frontend needs {UBLK_CONTROL}, which this machine lacks (Linux >= 6.5 with ublk_drv loaded: modprobe ublk_drv); use --frontend fuse"
        )),
        Frontend::Ublk if !UBLK_BUILT => Err(
            "the ublk frontend is not in this build yet; use --frontend fuse".into(),
        ),
        Frontend::Ublk => Ok(FRONTEND_UBLK),
    }
}

/// Every mapping with its state, sorted by device; unreadable records as errors.
pub fn list() -> Vec<Result<(Record, Liveness), String>> {
    state::list()
        .into_iter()
        .map(|r| {
            r.map(|r| {
                let l = r.liveness();
                (r, l)
            })
        })
        .collect()
}
