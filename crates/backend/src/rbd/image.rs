//! The `rbd:` backend proper: one cluster connection and one open image per export, shared
//! by every queue (librbd's image handle takes concurrent asynchronous calls from any thread,
//! as QEMU and SPDK use it).

use std::ffi::{c_int, c_void, CString};
use std::io;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::sys;
use super::{errno_text, Spec};
use crate::completions::{Completions, Poster};
use crate::{
    export::push_extent_within, push_extent, Backend, Capabilities, Extent, Op, QueueIo, Started,
    Storage, Submitter, Support, MAX_EXTENTS,
};

/// The librados and librbd handles of one export, released in reverse order of creation.
struct Handle {
    cluster: sys::RadosT,
    ioctx: sys::IoCtxT,
    image: sys::ImageT,
}

// SAFETY: librados and librbd handles may be used from any thread (QEMU and SPDK issue
// rbd_aio_* on one image from several); a Handle is only moved, to the thread that closes it.
unsafe impl Send for Handle {}

impl Handle {
    /// Flushes the image (librbd's cache may hold acknowledged writes: writeback, or
    /// writearound's writes in flight), closes it (which releases its exclusive lock and
    /// watch), then the pool and the connection. Returns the flush's result (0 or a negative
    /// errno); every handle is released whatever it is. Each step is bounded by the Ceph
    /// timeouts, the close by several of them (it flushes again, releases the lock, unwatches).
    fn release(&mut self) -> c_int {
        let mut flushed = 0;
        // SAFETY: each handle was created by the matching call and is released once (nulled
        // here), image before pool before cluster; no operation of ours is in flight (queues
        // wait for theirs before they go, and the helper has ended), and rbd_close waits for
        // librbd's own outstanding work.
        unsafe {
            if !self.image.is_null() {
                flushed = sys::rbd_flush(self.image);
                sys::rbd_close(self.image);
                self.image = ptr::null_mut();
            }
            if !self.ioctx.is_null() {
                sys::rados_ioctx_destroy(self.ioctx);
                self.ioctx = ptr::null_mut();
            }
            if !self.cluster.is_null() {
                sys::rados_shutdown(self.cluster);
                self.cluster = ptr::null_mut();
            }
        }
        flushed
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.release();
    }
}

/// How long a close may take, in Ceph timeouts (`timeout=`): a final flush and a lock release
/// that each time out once. rbd_close on a dead cluster takes about seven (measured: 35 s at
/// `timeout=5`), so beyond this the cluster is not answering: the close is left to finish on
/// its own thread (the cluster expires the watch, and the next opener breaks the lock).
const CLOSE_TIMEOUTS: u32 = 2;

/// The image pointer, for the threads that call librbd on it (queues' completions, the helper).
#[derive(Clone, Copy)]
struct Image(sys::ImageT);
// SAFETY: librbd takes calls on one image from any thread; the backend keeps it open while a
// queue or the helper may use it (see `Life`).
unsafe impl Send for Image {}

/// A Ceph RBD image served as an export.
pub(crate) struct RbdBackend {
    /// The open image: queues, the allocation helper and the control path (resize, allocation
    /// queries, which come through a queue's executor) call librbd on it. Valid until `close`,
    /// which waits for a resize in progress, refuses while a queue is open, joins the helper,
    /// and makes `open_queue` and `resize` refuse from then on.
    image: sys::ImageT,
    /// `rbd:POOL/IMAGE`.
    name: String,
    /// The image, named as `name` (one cluster per target, as configured).
    storage: Storage,
    read_only: bool,
    /// `timeout=`: seconds a Ceph operation may take.
    timeout_secs: u32,
    /// Grows with `resize`; read on the control path and at handshakes only.
    size: AtomicU64,
    /// One resize at a time, and none while the image closes.
    resizing: Mutex<()>,
    life: Mutex<Life>,
}

// SAFETY: `image` is used as `Image` says; the handles are behind `life`'s lock.
unsafe impl Send for RbdBackend {}
// SAFETY: as above.
unsafe impl Sync for RbdBackend {}

/// What opens and closes with the image (control path only).
struct Life {
    /// The handles; `None` once closed.
    handle: Option<Handle>,
    /// The allocation helper's job queue and thread, started with the first queue.
    helper: Option<Helper>,
    /// Queues open (from `open_queue` to the end of their Drop): the image closes only when
    /// there are none.
    queues: usize,
}

fn cstring(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("rbd: {what} '{s}' contains a NUL byte"))
}

impl RbdBackend {
    /// Connects to the cluster and opens the image. Errors are one line naming what is
    /// missing: the config, the cluster, the pool or the image.
    pub(crate) fn open(spec: &Spec, read_only: bool) -> Result<RbdBackend, String> {
        let name = format!("rbd:{}/{}", spec.pool, spec.image);
        let client = spec.client_name();
        let c_client = cstring("client name", &client)?;
        let c_pool = cstring("pool", &spec.pool)?;
        let c_image = cstring("image", &spec.image)?;
        let c_conf = spec
            .conf
            .as_deref()
            .map(|c| cstring("conf", c))
            .transpose()?;
        let mut h = Handle {
            cluster: ptr::null_mut(),
            ioctx: ptr::null_mut(),
            image: ptr::null_mut(),
        };
        // SAFETY: creates a cluster handle into `h.cluster`; both strings are NUL-terminated
        // and outlive the call.
        let r =
            unsafe { sys::rados_create2(&mut h.cluster, c"ceph".as_ptr(), c_client.as_ptr(), 0) };
        if r < 0 {
            return Err(format!(
                "{name}: cannot create a Ceph client as {client}: {}",
                errno_text(r.into())
            ));
        }
        // From here `h` releases whatever was created when it is dropped on an error.
        let conf_ptr = c_conf.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        // SAFETY: a valid, unconnected cluster handle; a NUL-terminated path or NULL (librados'
        // default search: $CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf).
        let r = unsafe { sys::rados_conf_read_file(h.cluster, conf_ptr) };
        if r < 0 {
            return Err(match &spec.conf {
                Some(c) => format!(
                    "{name}: cannot read Ceph config {c}: {}",
                    errno_text(r.into())
                ),
                None => format!(
                    "{name}: no Ceph config found ($CEPH_CONF, /etc/ceph/ceph.conf): name one \
                     with ?conf=FILE"
                ),
            });
        }
        let timeout = spec.timeout_secs.to_string();
        let mut settings: Vec<(&str, &str)> = vec![
            // librados would print its retries to stderr; serve's errors are ours, one line.
            ("log_to_stderr", "false"),
            ("err_to_stderr", "false"),
            ("client_mount_timeout", &timeout),
            ("rados_mon_op_timeout", &timeout),
            ("rados_osd_op_timeout", &timeout),
            // librbd's cache stays write-through until the first flush, a guard for clients
            // that never flush. Every blkwire client can (FLUSH is advertised, FUA is write then
            // flush), and a write is only promised durable after one, as on a disk with a
            // volatile cache; without this, writes run at half speed until some client happens
            // to flush (docs/BENCHMARKS.md, issue 18).
            ("rbd_cache_writethrough_until_flush", "false"),
        ];
        if let Some(k) = &spec.keyring {
            settings.push(("keyring", k));
        }
        for (k, v) in settings {
            let (ck, cv) = (cstring("option", k)?, cstring("option value", v)?);
            // SAFETY: a valid, unconnected cluster handle and NUL-terminated strings.
            let r = unsafe { sys::rados_conf_set(h.cluster, ck.as_ptr(), cv.as_ptr()) };
            if r < 0 {
                return Err(format!(
                    "{name}: cannot set Ceph option {k}={v}: {}",
                    errno_text(r.into())
                ));
            }
        }
        // SAFETY: a configured cluster handle; blocks at most client_mount_timeout.
        let r = unsafe { sys::rados_connect(h.cluster) };
        if r < 0 {
            let conf = spec.conf.as_deref().unwrap_or("the default ceph.conf");
            return Err(format!(
                "{name}: cannot connect to the Ceph cluster of {conf} as {client} within {}s: {}",
                spec.timeout_secs,
                errno_text(r.into())
            ));
        }
        // SAFETY: a connected cluster; the pool name is NUL-terminated; fills `h.ioctx`.
        let r = unsafe { sys::rados_ioctx_create(h.cluster, c_pool.as_ptr(), &mut h.ioctx) };
        if r < 0 {
            return Err(if r == -libc::ENOENT {
                format!("{name}: pool '{}' does not exist", spec.pool)
            } else {
                format!(
                    "{name}: cannot open pool '{}': {}",
                    spec.pool,
                    errno_text(r.into())
                )
            });
        }
        // SAFETY: an open pool, a NUL-terminated image name, no snapshot; fills `h.image`.
        let r = unsafe {
            if read_only {
                sys::rbd_open_read_only(h.ioctx, c_image.as_ptr(), &mut h.image, ptr::null())
            } else {
                sys::rbd_open(h.ioctx, c_image.as_ptr(), &mut h.image, ptr::null())
            }
        };
        if r < 0 {
            return Err(if r == -libc::ENOENT {
                format!(
                    "{name}: image '{}' does not exist in pool '{}'",
                    spec.image, spec.pool
                )
            } else {
                format!("{name}: cannot open the image: {}", errno_text(r.into()))
            });
        }
        let size = image_size(h.image).map_err(|r| {
            format!(
                "{name}: cannot read the image's size: {}",
                errno_text(r.into())
            )
        })?;
        if size == 0 || !size.is_multiple_of(512) {
            return Err(format!(
                "{name}: the image is {size} bytes: an export needs a non-zero multiple of 512"
            ));
        }
        Ok(RbdBackend {
            image: h.image,
            storage: Storage {
                name: name.clone(),
                start: 0,
            },
            name,
            read_only,
            timeout_secs: spec.timeout_secs,
            size: AtomicU64::new(size),
            resizing: Mutex::new(()),
            life: Mutex::new(Life {
                handle: Some(h),
                helper: None,
                queues: 0,
            }),
        })
    }

    fn life(&self) -> MutexGuard<'_, Life> {
        // Every change to Life is one assignment: a panic cannot leave it half-made.
        self.life.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocation helper's queue, started on first use, for a queue being opened.
    fn helper(&self, life: &mut Life) -> io::Result<Sender<AllocJob>> {
        if let Some((tx, _)) = life.helper.as_ref() {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel::<AllocJob>();
        // It ends when the last sender (the backend's and every queue's) is gone; `close`
        // drops the backend's once no queue is left, and joins it before the image closes.
        let image = Image(self.image);
        let thread = std::thread::Builder::new()
            .name("blkwire-rbd-alloc".into())
            .spawn(move || {
                for job in rx {
                    // SAFETY: the queue that started the query keeps the list valid and
                    // untouched until the result is reaped (start_allocation's contract),
                    // which is after this post.
                    let out = unsafe { &mut *job.out.0 };
                    let res = diff_extents(image, job.offset, job.len, job.max, out);
                    job.poster.post(job.tag, Done { res, end: 0 });
                }
            })?;
        life.helper = Some((tx.clone(), thread));
        Ok(tx)
    }

    /// The refusal of a resize or a queue once the image was closed.
    fn closed(&self) -> io::Error {
        io::Error::other(format!(
            "{}: the image is closed (the target is stopping)",
            self.name
        ))
    }

    /// Stops the helper, then flushes and closes the image, within [`CLOSE_TIMEOUTS`] Ceph
    /// timeouts: for `shutdown` and Drop. A no-op once closed; refused while a queue is open.
    fn close(&self) -> Result<(), String> {
        let _no_resize = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        let (handle, helper) = {
            let mut life = self.life();
            if life.queues > 0 {
                return Err(format!(
                    "{}: {} queue(s) still open: the image stays open",
                    self.name, life.queues
                ));
            }
            match life.handle.take() {
                Some(h) => (h, life.helper.take()),
                None => return Ok(()),
            }
        };
        let limit = Duration::from_secs(u64::from(CLOSE_TIMEOUTS * self.timeout_secs));
        let flushed = match close_apart(handle, helper, false).recv_timeout(limit) {
            Ok(r) => r,
            // The thread ended without a result: it panicked; librbd's own state is unknown,
            // and nothing is left to wait for.
            Err(mpsc::RecvTimeoutError::Disconnected) => -libc::EIO,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "{}: the cluster did not answer the final flush and close within {}s: left \
                     closing (acknowledged writes it did not take are lost)",
                    self.name,
                    limit.as_secs()
                ))
            }
        };
        if flushed < 0 {
            return Err(format!(
                "{}: the final flush failed: {} (the image is closed)",
                self.name,
                errno_text(flushed.into())
            ));
        }
        Ok(())
    }
}

/// The allocation helper's job queue and thread.
type Helper = (Sender<AllocJob>, JoinHandle<()>);

/// Flushes and closes the image on a thread of its own, the helper stopped first (its last
/// sender goes: it ends once a walk in progress, which uses the image, does). The flush's
/// result comes on the receiver; without a thread to be had, the close runs here. `counted`:
/// in [`CLOSING`] until done, for a stop to wait for (a close nobody waits for: Drop's).
fn close_apart(handle: Handle, helper: Option<Helper>, counted: bool) -> mpsc::Receiver<c_int> {
    fn finish(mut handle: Handle, helper: Option<Helper>) -> c_int {
        if let Some((last, thread)) = helper {
            drop(last);
            let _ = thread.join();
        }
        handle.release()
    }
    let count = move |started: bool| {
        if counted {
            let mut n = CLOSING.0.lock().unwrap_or_else(|e| e.into_inner());
            if started {
                *n += 1;
            } else {
                *n -= 1;
                CLOSING.1.notify_all();
            }
        }
    };
    let (tx, rx) = mpsc::channel();
    let here = tx.clone();
    let work = Arc::new(Mutex::new(Some((handle, helper))));
    let theirs = work.clone();
    count(true);
    let spawned = std::thread::Builder::new()
        .name("blkwire-rbd-close".into())
        .spawn(move || {
            if let Some((handle, helper)) = theirs.lock().unwrap_or_else(|e| e.into_inner()).take()
            {
                let _ = tx.send(finish(handle, helper));
            }
            count(false);
        });
    if spawned.is_err() {
        count(false);
        if let Some((handle, helper)) = work.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = here.send(finish(handle, helper));
        }
    }
    rx
}

/// Images closing on threads of their own (`Drop`), and a wake-up when one is done: a stop
/// waits for them ([`wait_for_closes`]), so the process does not exit under librbd's flush.
static CLOSING: (Mutex<usize>, std::sync::Condvar) = (Mutex::new(0), std::sync::Condvar::new());

/// Waits at most `limit` for the images closing on their own threads; returns how many still
/// are.
pub(crate) fn wait_for_closes(limit: Duration) -> usize {
    let (n, done) = &CLOSING;
    let n = n.lock().unwrap_or_else(|e| e.into_inner());
    let (n, _) = done
        .wait_timeout_while(n, limit, |n| *n > 0)
        .unwrap_or_else(|e| e.into_inner());
    *n
}

impl Drop for RbdBackend {
    /// The last reference went without `shutdown` (the export was removed, or replaced): flush
    /// and close on a thread of its own, not waited for. The last reference is often dropped
    /// on a reactor thread (its last queue closed there), which serves other connections and
    /// must not wait a round trip to the cluster, or its timeouts when it is gone. No queue is
    /// open (each holds a reference); a graceful stop closed already, waiting (`shutdown`).
    fn drop(&mut self) {
        let (handle, helper) = {
            let mut life = self.life();
            (life.handle.take(), life.helper.take())
        };
        if let Some(handle) = handle {
            // Not waited for: the result's receiver goes at once.
            close_apart(handle, helper, true);
        }
    }
}

impl Backend for RbdBackend {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn storage(&self) -> Option<&Storage> {
        Some(&self.storage)
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    fn block_sizes(&self) -> (u32, u32) {
        // librbd takes any byte range; 4 KiB is what its objects are written in cheaply.
        (512, 4096)
    }
    /// FLUSH, TRIM (discard) and WRITE_ZEROES are librbd's own; FUA is not (librbd has no
    /// per-write durability flag), so the generic layer runs it as write then flush. COPY is
    /// emulated too: librbd's deep copy works on whole images, not ranges.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            flush: Support::Native,
            fua: Support::None,
            trim: Support::Native,
            write_zeroes: Support::Native,
            copy: Support::None,
            // librbd zeroes partial objects by writing them: not always metadata-only.
            fast_zero: false,
            rotational: false,
            ..Capabilities::default()
        }
    }
    fn reads_as_zero(&self) -> bool {
        // Unknown without walking the image; `cp` then reads and compares.
        false
    }
    fn resize(&self, new_size: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is served read-only: it cannot grow", self.name),
            ));
        }
        let _one = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        if self.life().handle.is_none() {
            return Err(self.closed());
        }
        if new_size < self.size() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: an export's image only grows", self.name),
            ));
        }
        // Grow only, checked by librbd against the image's real size, not the size we opened
        // or last grew it to: another client may have grown it since, and a resize to a size
        // between the two would cut what it has there.
        // SAFETY: an open, writable image; librbd orders the resize with in-flight I/O; the
        // progress callback does nothing and needs no argument.
        let r =
            unsafe { sys::rbd_resize2(self.image, new_size, false, no_progress, ptr::null_mut()) };
        if r == -libc::EINVAL {
            if let Some(now) = image_size(self.image).ok().filter(|&now| now > new_size) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{}: the image is {} now (grown behind the export), more than {}: an \
                         export's image only grows (re-add the export to serve its new size)",
                        self.name,
                        crate::format_size(now),
                        crate::format_size(new_size)
                    ),
                ));
            }
        }
        if r < 0 {
            return Err(io::Error::other(format!(
                "{}: rbd_resize2 failed: {}",
                self.name,
                errno_text(r.into())
            )));
        }
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }
    fn allocation(&self, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) {
        if diff_extents(Image(self.image), offset, len, max, out) < 0 {
            // Nothing known: say data, which is always a correct answer.
            out.push(Extent { len, hole: false });
        }
    }
    fn open_queue(self: Arc<Self>) -> io::Result<Box<dyn QueueIo>> {
        let done = Completions::new()?;
        let poster = done.poster();
        let alloc = {
            let mut life = self.life();
            if life.handle.is_none() {
                return Err(self.closed());
            }
            let alloc = self.helper(&mut life)?;
            life.queues += 1;
            alloc
        };
        Ok(Box::new(RbdQueue {
            image: self.image,
            backend: self,
            done,
            poster,
            alloc: Some(alloc),
            in_flight: 0,
            batch: Vec::new(),
        }))
    }
    /// Waits (bounded) for the final flush and close; see `RbdBackend::close`.
    fn shutdown(&self) -> Result<(), String> {
        self.close()
    }
}

/// What librbd's callback posts for one operation: the result to report, and for a WRITE or
/// WRITE_ZEROES that librbd says succeeded, where it ends (0 for the others).
///
/// librbd clips an operation that crosses the image's end to the end (and refuses one that
/// starts past it with EINVAL): the generic layer checked the range against the size the
/// session was given, so that only happens when the image was shrunk behind the export (`rbd
/// resize --allow-shrink`). A clipped READ reports the bytes it read, fewer than asked, which
/// the generic layer answers as an I/O error without sending the buffer (whose tail librbd did
/// not fill: a pooled buffer's old contents). A clipped WRITE still reports 0, as a whole one
/// does: the queue thread compares `end` with the image's size before reporting it done.
#[derive(Clone, Copy)]
struct Done {
    res: i32,
    end: u64,
}

/// What one `rbd_aio_*` call carries to its completion callback.
struct OpCtx {
    poster: Poster<Done>,
    tag: u64,
    kind: Kind,
}

/// How librbd's result becomes the operation's.
#[derive(Clone, Copy)]
enum Kind {
    /// The bytes librbd read (it fills holes with zeros), at most `len`.
    Read { len: u32 },
    /// WRITE (`done` its length) or WRITE_ZEROES (`done` 0): `done` once the image is known to
    /// reach `end`.
    Write { done: i32, end: u64 },
    /// FLUSH, TRIM: 0.
    Other,
}

/// A data operation's negative errno from librbd's. librbd says EINVAL for a range that starts
/// at or past the image's end; the generic layer checked it against the export's size, so the
/// image shrank under the export: an I/O error on the target, not the client's invalid request.
fn data_errno(r: i64) -> i32 {
    match i32::try_from(r) {
        Ok(r) if r < 0 && r != -libc::EINVAL => r,
        _ => -libc::EIO,
    }
}

/// Called by librbd on one of its threads when an operation completes. Never blocks: a
/// channel send and an eventfd write (no librbd call: asking the image's size may refresh it
/// synchronously, which must not happen on librbd's own threads).
extern "C" fn on_complete(c: sys::CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the OpCtx leaked by `RbdQueue::start` for this completion, and librbd
    // calls back exactly once per completion, so it is taken back exactly once.
    let ctx = unsafe { Box::from_raw(arg.cast::<OpCtx>()) };
    // SAFETY: `c` is the completion being completed; releasing it inside its own callback is
    // allowed (librbd holds a reference until the callback returns; QEMU does the same).
    let r = unsafe {
        let r = sys::rbd_aio_get_return_value(c);
        sys::rbd_aio_release(c);
        r
    };
    let done = match ctx.kind {
        _ if r < 0 => Done {
            res: data_errno(r as i64),
            end: 0,
        },
        Kind::Read { len } => Done {
            res: r.min(len as isize) as i32,
            end: 0,
        },
        Kind::Write { done, end } => Done { res: done, end },
        Kind::Other => Done { res: 0, end: 0 },
    };
    // False once the queue is gone, which cannot happen while this op is in flight (the queue
    // waits for them in Drop); nothing else to do either way.
    let _ = ctx.poster.post(ctx.tag, done);
}

/// `rbd_resize2`'s progress callback: nothing to report to.
extern "C" fn no_progress(_offset: u64, _total: u64, _arg: *mut c_void) -> c_int {
    0
}

/// The image's size as librbd knows it now, or librbd's negative errno.
fn image_size(image: sys::ImageT) -> Result<u64, c_int> {
    let mut size = 0u64;
    // SAFETY: an open image; writes one u64 we own.
    let r = unsafe { sys::rbd_get_size(image, &mut size) };
    if r < 0 {
        Err(r)
    } else {
        Ok(size)
    }
}

/// An extent-list pointer on its way to the helper thread.
struct OutPtr(*mut Vec<Extent>);
// SAFETY: the list stays valid and is touched by nobody else until the result is reaped
// (start_allocation's contract).
unsafe impl Send for OutPtr {}

struct AllocJob {
    offset: u64,
    len: u64,
    max: usize,
    out: OutPtr,
    tag: u64,
    poster: Poster<Done>,
}

struct RbdQueue {
    image: sys::ImageT,
    /// Keeps the image open while this queue may call it (and counts it in `Life::queues`).
    backend: Arc<RbdBackend>,
    done: Completions<Done>,
    poster: Poster<Done>,
    /// `None` only in Drop.
    alloc: Option<Sender<AllocJob>>,
    /// Operations started `Async` whose results are not reaped yet.
    in_flight: usize,
    /// The results of one `reap`, kept for its allocation.
    batch: Vec<(u64, Done)>,
}

impl QueueIo for RbdQueue {
    fn completes_inline(&self) -> bool {
        false
    }

    unsafe fn start(&mut self, op: Op, tag: u64, _sq: &mut dyn Submitter) -> Started {
        let kind = match op {
            Op::Read { len, .. } => Kind::Read { len },
            Op::Write { offset, len, .. } => Kind::Write {
                done: i32::try_from(len).unwrap_or(i32::MAX),
                end: offset + len as u64,
            },
            Op::WriteZeroes { offset, len, .. } => Kind::Write {
                done: 0,
                end: offset + len as u64,
            },
            Op::Flush | Op::Trim { .. } => Kind::Other,
            // Never sent: COPY is declared `None` and emulated above us.
            Op::Copy { .. } | Op::CopyFrom { .. } => return Started::Done(-libc::EOPNOTSUPP),
        };
        let ctx = Box::into_raw(Box::new(OpCtx {
            poster: self.poster.clone(),
            tag,
            kind,
        }));
        let mut c: sys::CompletionT = ptr::null_mut();
        // SAFETY: creates a completion that will call `on_complete` with `ctx`.
        let r = unsafe { sys::rbd_aio_create_completion(ctx.cast(), on_complete, &mut c) };
        if r < 0 {
            // SAFETY: no completion exists, so nobody else will take `ctx` back.
            drop(unsafe { Box::from_raw(ctx) });
            return Started::Done(r);
        }
        let img = self.image;
        // SAFETY: `img` is open for as long as this queue is (`backend`); the READ buffer is
        // valid for writes and the WRITE buffer for reads of `len` bytes until the result is
        // reaped (this function's contract), which is after librbd's callback, after which
        // librbd no longer touches them.
        let r = unsafe {
            match op {
                Op::Read { offset, buf, len } => {
                    sys::rbd_aio_read(img, offset, len as usize, buf.cast(), c)
                }
                Op::Write {
                    offset, buf, len, ..
                } => sys::rbd_aio_write(img, offset, len as usize, buf.cast(), c),
                Op::Flush => sys::rbd_aio_flush(img, c),
                Op::Trim { offset, len, .. } => sys::rbd_aio_discard(img, offset, len.into(), c),
                Op::WriteZeroes {
                    offset,
                    len,
                    no_hole,
                    ..
                } => {
                    let flags: c_int = if no_hole {
                        sys::WRITE_ZEROES_FLAG_THICK_PROVISION
                    } else {
                        0
                    };
                    sys::rbd_aio_write_zeroes(img, offset, len as usize, c, flags, 0)
                }
                Op::Copy { .. } | Op::CopyFrom { .. } => -libc::EOPNOTSUPP,
            }
        };
        if r < 0 {
            // librbd refused before queueing anything: the callback will not run.
            // SAFETY: `c` is ours and unused; `ctx` is taken back once.
            unsafe {
                sys::rbd_aio_release(c);
                drop(Box::from_raw(ctx));
            }
            return Started::Done(data_errno(r.into()));
        }
        self.in_flight += 1;
        Started::Async
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
        let job = AllocJob {
            offset,
            len,
            max,
            out: OutPtr(out),
            tag,
            poster: self.poster.clone(),
        };
        Some(match self.alloc.as_ref().map(|a| a.send(job)) {
            Some(Ok(())) => {
                self.in_flight += 1;
                Started::Async
            }
            _ => Started::Done(-libc::EIO),
        })
    }

    fn notifier(&self) -> Option<RawFd> {
        Some(self.done.notifier())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) {
        let mut batch = std::mem::take(&mut self.batch);
        self.done.reap(&mut |tag, d| batch.push((tag, d)));
        self.in_flight = self.in_flight.saturating_sub(batch.len());
        // Writes librbd says are done are checked against the image's size, asked once per
        // batch and after the whole batch was posted: a write clipped by a shrink completed
        // after the shrink, so the size asked now is at most the one it was clipped to (unless
        // the image grew back meanwhile). On the queue thread, not in the callback: the call
        // refreshes the image first when another client changed its header (a round trip,
        // bounded by the Ceph timeouts), and is otherwise a lock and a read.
        let mut size: Option<Option<u64>> = None;
        for &(tag, d) in &batch {
            let res = if d.end == 0 {
                d.res
            } else {
                match *size.get_or_insert_with(|| image_size(self.image).ok()) {
                    Some(s) if d.end <= s => d.res,
                    // Clipped (or the size unknown): the bytes past the end went nowhere.
                    _ => -libc::EIO,
                }
            };
            done(tag, res);
        }
        batch.clear();
        self.batch = batch;
    }
}

impl Drop for RbdQueue {
    /// librbd may still write into buffers of operations in flight: wait for every result
    /// before the caller frees them. Bounded: every Ceph operation times out (`timeout=`).
    fn drop(&mut self) {
        while self.in_flight > 0 {
            let mut pfd = libc::pollfd {
                fd: self.done.notifier(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polls one descriptor we own, with a pollfd on our stack.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            let mut n = 0usize;
            self.done.reap(&mut |_, _| n += 1);
            self.in_flight = self.in_flight.saturating_sub(n);
        }
        // Our sender goes before we are counted out: a close that finds no queue open then
        // holds the helper's last sender.
        self.alloc = None;
        self.backend.life().queues -= 1;
    }
}

/// What the diff walk collects: data extents as librbd reports them.
struct Walk {
    data: Vec<(u64, u64)>,
    /// The most entries the map may have (each data extent makes at least one).
    max: usize,
    /// Stopped early (too many extents): the map ends at the last extent collected.
    stopped: bool,
}

extern "C" fn on_diff(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the Walk `diff_extents` passed, alive and ours for the whole call.
    let walk = unsafe { &mut *arg.cast::<Walk>() };
    if walk.data.len() >= walk.max {
        walk.stopped = true;
        return -libc::ECANCELED;
    }
    // With no starting snapshot, `exists == 0` marks a discarded range: a hole.
    if exists != 0 {
        walk.data.push((offset, len as u64));
    }
    0
}

/// The most of the image one allocation query walks: 16 of librbd's default 4 MiB objects.
/// `rbd_diff_iterate2` asks the OSDs about every object of the range, a synchronous walk on the
/// export's one helper thread, and only a full extent list stops it early: a sparse range (an
/// NBD BLOCK_STATUS may ask for up to 4 GiB) was walked to its end while every other query of
/// the export waited. The map of a longer range is a prefix of it, which the caller asks on
/// from (the backend contract).
const WALK_MAX: u64 = 64 << 20;

/// Appends the allocation map of `offset..offset+len` to `out` (coalesced, at most `max`
/// entries; a prefix of the range when there would be more, and never past [`WALK_MAX`]
/// bytes); 0 or a negative errno. Holes are what `rbd_diff_iterate2` since the image's creation
/// does not report.
fn diff_extents(image: Image, offset: u64, len: u64, max: usize, out: &mut Vec<Extent>) -> i32 {
    let len = len.min(WALK_MAX);
    let mut walk = Walk {
        data: Vec::new(),
        max: max.clamp(1, MAX_EXTENTS),
        stopped: false,
    };
    // SAFETY: an open image; the callback gets `walk`, which outlives the synchronous call.
    let r = unsafe {
        sys::rbd_diff_iterate2(
            image.0,
            ptr::null(),
            offset,
            len,
            1,
            0,
            on_diff,
            (&mut walk as *mut Walk).cast(),
        )
    };
    if r < 0 && !walk.stopped {
        return r;
    }
    map_of_walk(walk, offset, len, out);
    0
}

/// Appends the allocation map of `offset..offset+len` that a diff walk found to `out`: holes
/// between the data extents, at most `walk.max` entries (a prefix of the range when there
/// would be more).
fn map_of_walk(mut walk: Walk, offset: u64, len: u64, out: &mut Vec<Extent>) {
    walk.data.sort_unstable();
    let end = offset.saturating_add(len);
    let limit = if walk.stopped {
        walk.data.last().map_or(offset, |&(o, l)| (o + l).min(end))
    } else {
        end
    };
    let (first, max) = (out.len(), walk.max);
    let mut pos = offset;
    // Each data extent may add two entries: stop at the bound rather than build twice as many
    // and truncate, so the list never holds (nor its capacity grows to) more than the bound.
    let mut whole = true;
    for (o, l) in walk.data {
        let (o, e) = (o.max(pos), o.saturating_add(l).min(limit));
        if e <= o {
            continue;
        }
        if !push_extent_within(out, first, max, o - pos, true)
            || !push_extent_within(out, first, max, e - o, false)
        {
            whole = false;
            break;
        }
        pos = e;
    }
    if whole && pos < limit {
        push_extent_within(out, first, max, limit - pos, true);
    }
    if out.len() == first {
        // An empty prefix (stopped before anything): say one data extent of the first bytes
        // rather than nothing, so the caller always makes progress.
        push_extent(out, len.min(4096), false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A walk stopped at MAX_EXTENTS data extents, holes between them: the map is a prefix of
    /// at most MAX_EXTENTS entries, and building it never grows the list past that (a list
    /// with room for exactly MAX_EXTENTS keeps its allocation), since the server covers that
    /// much memory for it and no more.
    #[test]
    fn a_map_of_many_extents_never_grows_past_max_extents() {
        const B: u64 = 4096;
        let walk = Walk {
            data: (0..MAX_EXTENTS as u64)
                .map(|i| ((2 * i + 1) * B, B))
                .collect(),
            max: MAX_EXTENTS,
            stopped: true,
        };
        let mut out = Vec::with_capacity(MAX_EXTENTS);
        let cap = out.capacity();
        map_of_walk(walk, 0, 1 << 32, &mut out);
        assert_eq!(
            out.capacity(),
            cap,
            "the list grew past MAX_EXTENTS entries"
        );
        assert_eq!(out.len(), MAX_EXTENTS);
        for (i, e) in out.iter().enumerate() {
            assert_eq!((e.len, e.hole), (B, i % 2 == 0), "extent {i}");
        }
    }
}
