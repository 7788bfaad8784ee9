//! The fuse device: a one-file FUSE filesystem served by this daemon, its file bound to a loop
//! device with direct I/O. Works on any kernel with FUSE and loop.
//!
//! `abi` is the kernel protocol (structs, decoding, replies), pure and tested without a kernel;
//! `channel` is /dev/fuse itself (read/writev, mount); `uring` is FUSE over io_uring (the
//! system-wide switch, the ring entries); `loopdev` binds the file to a loop device; `worker`
//! serves one queue over either transport, `partial` the requests it gets that cover part of a
//! logical block; `device` is the `BlockDevice` the daemon drives.

pub mod abi;
mod channel;
mod device;
mod loopdev;
mod partial;
pub mod uring;
mod worker;

pub(crate) use device::FuseDevice;
