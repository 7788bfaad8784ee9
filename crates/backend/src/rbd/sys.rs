//! The few librados and librbd calls the `rbd:` backend makes, declared by hand from Ceph's
//! `rados/librados.h` and `rbd/librbd.h` (16.2). Every handle is an opaque pointer; every call
//! returns 0 (or a count) on success and a negative errno on failure. Linked only when build.rs
//! found librbd (`cfg(blkwire_rbd)`).

use std::ffi::{c_char, c_int, c_void};

/// `rados_t`: a cluster connection.
pub type RadosT = *mut c_void;
/// `rados_ioctx_t`: a pool (I/O context) of a connection.
pub type IoCtxT = *mut c_void;
/// `rbd_image_t`: an open image.
pub type ImageT = *mut c_void;
/// `rbd_completion_t`: one asynchronous operation's completion.
pub type CompletionT = *mut c_void;
/// `rbd_callback_t`: called on a librbd thread when an operation completes.
pub type CallbackT = extern "C" fn(c: CompletionT, arg: *mut c_void);
/// `rbd_diff_iterate2`'s callback: (offset, length, exists, arg); non-zero stops the walk.
pub type DiffCallbackT = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;
/// `librbd_progress_fn_t`: (offset, total, arg); called by long operations (resize, copy).
pub type ProgressFnT = extern "C" fn(u64, u64, *mut c_void) -> c_int;

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: the zeroed range stays allocated.
pub const WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;

#[link(name = "rados")]
extern "C" {
    pub fn rados_create2(
        cluster: *mut RadosT,
        cluster_name: *const c_char,
        name: *const c_char,
        flags: u64,
    ) -> c_int;
    pub fn rados_conf_read_file(cluster: RadosT, path: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: RadosT, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_connect(cluster: RadosT) -> c_int;
    pub fn rados_shutdown(cluster: RadosT);
    pub fn rados_ioctx_create(cluster: RadosT, pool: *const c_char, io: *mut IoCtxT) -> c_int;
    pub fn rados_ioctx_destroy(io: IoCtxT);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_open(
        io: IoCtxT,
        name: *const c_char,
        image: *mut ImageT,
        snap: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: IoCtxT,
        name: *const c_char,
        image: *mut ImageT,
        snap: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: ImageT) -> c_int;
    pub fn rbd_flush(image: ImageT) -> c_int;
    pub fn rbd_get_size(image: ImageT, size: *mut u64) -> c_int;
    /// With `allow_shrink` false, refuses (EINVAL) a size below the image's: atomic with
    /// whoever else resizes it. `cb` is called without a NULL check: pass a function.
    pub fn rbd_resize2(
        image: ImageT,
        size: u64,
        allow_shrink: bool,
        cb: ProgressFnT,
        cbdata: *mut c_void,
    ) -> c_int;
    pub fn rbd_diff_iterate2(
        image: ImageT,
        fromsnap: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: DiffCallbackT,
        arg: *mut c_void,
    ) -> c_int;
    pub fn rbd_aio_create_completion(arg: *mut c_void, cb: CallbackT, c: *mut CompletionT)
        -> c_int;
    pub fn rbd_aio_get_return_value(c: CompletionT) -> isize;
    pub fn rbd_aio_release(c: CompletionT);
    pub fn rbd_aio_read(
        image: ImageT,
        off: u64,
        len: usize,
        buf: *mut c_char,
        c: CompletionT,
    ) -> c_int;
    pub fn rbd_aio_write(
        image: ImageT,
        off: u64,
        len: usize,
        buf: *const c_char,
        c: CompletionT,
    ) -> c_int;
    pub fn rbd_aio_flush(image: ImageT, c: CompletionT) -> c_int;
    pub fn rbd_aio_discard(image: ImageT, off: u64, len: u64, c: CompletionT) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: ImageT,
        off: u64,
        len: usize,
        c: CompletionT,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
}
