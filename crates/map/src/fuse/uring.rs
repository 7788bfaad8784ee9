//! FUSE over io_uring (Linux >= 6.14; linux/fuse.h 7.42, fs/fuse/dev_uring.c): requests and
//! answers travel through buffers registered with the kernel instead of read()/writev() on
//! /dev/fuse.
//!
//! How the kernel does it (checked against fs/fuse/dev_uring.c of 6.18):
//! - the module parameter `enable_uring` must be on when a command arrives, or the connection
//!   must have negotiated FUSE_OVER_IO_URING at INIT while it was on;
//! - the connection has one ring queue per possible CPU; a request goes to the queue of the CPU
//!   its task runs on, and the ring takes requests only once *every* queue has an entry
//!   registered (until then, and for FORGET and INTERRUPT always, /dev/fuse's read() is used);
//! - an entry is an SQE128 IORING_OP_URING_CMD on a /dev/fuse descriptor: REGISTER (addr =
//!   `iovec[2]`: header buffer, payload buffer of at least max_write; len = 2) parks it, and its
//!   CQE (result 0) means a request sits in its buffers; COMMIT_AND_FETCH (commit_id = the
//!   request's unique) hands back the answer from the same buffers and parks the entry again;
//! - a request is the in header (in_out), the opcode's first argument (op_in, up to 128 bytes)
//!   and the remaining arguments (payload, `payload_sz` bytes); an answer is the out header in
//!   in_out and its body in the payload, `payload_sz` bytes long;
//! - when the connection ends, parked entries complete with -ENOTCONN.
//!
//! `Ring` owns one io_uring with the entries of one or more ring queues, their buffers (mapped
//! once, touched lazily), the worker's cloned /dev/fuse descriptor for the traffic that still
//! goes through read(), and polls on that descriptor, on the worker's reconnection eventfd and
//! on the socket of its blkwire queue (sockpoll.rs), so its thread sleeps in one place: new
//! requests are taken while the target's answers are outstanding, and the other way round. The worker loop that uses it is in worker.rs.

use std::collections::HashMap;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::abi;
use super::channel::Channel;
use crate::sockpoll::SockPoll;

/// The system-wide switch (fuse module parameter).
pub(crate) const SWITCH: &str = "/sys/module/fuse/parameters/enable_uring";

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// struct fuse_uring_req_header: `in_out[128]`, `op_in[128]`, struct fuse_uring_ent_in_out.
const IN_OUT_LEN: usize = 128;
const OP_IN_LEN: usize = 128;
const ENT_IN_OUT_AT: usize = IN_OUT_LEN + OP_IN_LEN;
/// fuse_uring_ent_in_out: flags u64, commit_id u64, payload_sz u32, padding u32, reserved u64.
const COMMIT_ID_AT: usize = ENT_IN_OUT_AT + 8;
const PAYLOAD_SZ_AT: usize = ENT_IN_OUT_AT + 16;
/// Length of a ring entry's header buffer (struct fuse_uring_req_header).
pub const HEADER_LEN: usize = ENT_IN_OUT_AT + 32;

/// user_data of the /dev/fuse and eventfd polls; entries use their index, the socket poll
/// SockPoll's values.
const POLL_DEV: u64 = u64::MAX;
const POLL_WAKE: u64 = u64::MAX - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Switch {
    On,
    Off,
    /// The kernel has no FUSE over io_uring (older than 6.14 or built without it).
    Missing,
}

pub(crate) fn switch() -> Switch {
    match std::fs::read_to_string(SWITCH) {
        Ok(s) if s.trim() == "Y" || s.trim() == "1" => Switch::On,
        Ok(_) => Switch::Off,
        Err(_) => Switch::Missing,
    }
}

pub(crate) fn set_switch(on: bool) -> io::Result<()> {
    std::fs::write(SWITCH, if on { "Y" } else { "N" })
}

/// Ring queues of a connection: the kernel makes one per possible CPU (num_possible_cpus()),
/// which is the number of CPUs listed in /sys/devices/system/cpu/possible ("0-1", "0,2-5").
pub(crate) fn ring_queues() -> Result<usize, String> {
    const POSSIBLE: &str = "/sys/devices/system/cpu/possible";
    let s = std::fs::read_to_string(POSSIBLE).map_err(|e| format!("{POSSIBLE}: {e}"))?;
    count_cpu_list(s.trim()).ok_or_else(|| format!("{POSSIBLE}: cannot parse '{}'", s.trim()))
}

fn count_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in s.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let a = part.parse::<usize>().ok()?;
                (a, a)
            }
        };
        n = n.checked_add(b.checked_sub(a)?.checked_add(1)?)?;
    }
    // The qid is 16 bits in the command.
    (1..=u16::MAX as usize).contains(&n).then_some(n)
}

/// The 80-byte command area: struct fuse_uring_cmd_req {flags, commit_id, qid, padding}.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn get64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(a)
}

/// Lays a ring request out as read() on /dev/fuse would have returned it (in header, op header,
/// payload), so one parser serves both paths. Everything in `header` is the kernel's word and
/// is checked: Err carries the commit id to answer EIO to.
pub fn request_bytes(header: &[u8], payload: &[u8], out: &mut [u8]) -> Result<usize, u64> {
    let commit_id = get64(header, COMMIT_ID_AT);
    if get64(header, 8) != commit_id {
        // Answers are matched by the header's unique: the two must agree.
        return Err(commit_id);
    }
    let len = get32(header, 0) as usize;
    let payload_sz = get32(header, PAYLOAD_SZ_AT) as usize;
    let op_len = len
        .checked_sub(abi::IN_HEADER_LEN)
        .and_then(|r| r.checked_sub(payload_sz))
        .ok_or(commit_id)?;
    if op_len > OP_IN_LEN || payload_sz > payload.len() || len > out.len() {
        return Err(commit_id);
    }
    let h = abi::IN_HEADER_LEN;
    out[..h].copy_from_slice(&header[..h]);
    out[h..h + op_len].copy_from_slice(&header[IN_OUT_LEN..IN_OUT_LEN + op_len]);
    out[h + op_len..len].copy_from_slice(&payload[..payload_sz]);
    Ok(len)
}

/// Writes an answer into an entry's buffers: the out header, and the body (errno 0 only) in the
/// payload with its length in `payload_sz`. A body that does not fit (cannot happen: bodies
/// are at most max_write) becomes EIO rather than a short answer.
pub(crate) fn fill_answer(
    header: &mut [u8],
    payload: &mut [u8],
    unique: u64,
    errno: i32,
    parts: &[&[u8]],
) {
    let body: usize = parts.iter().map(|p| p.len()).sum();
    let errno = if errno == 0 && body > payload.len() {
        libc::EIO
    } else {
        errno
    };
    let body = if errno == 0 { body } else { 0 };
    let mut at = 0;
    if errno == 0 {
        for p in parts {
            payload[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
    }
    header[..abi::OUT_HEADER_LEN].copy_from_slice(&abi::out_header(unique, errno, body));
    header[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4].copy_from_slice(&(body as u32).to_ne_bytes());
}

/// Anonymous memory, mapped once and unmapped on drop. Pages are touched only when used, so a
/// 1 MiB payload buffer per entry costs what its largest request wrote into it.
struct Region {
    ptr: *mut u8,
    len: usize,
}

impl Region {
    fn new(len: usize) -> io::Result<Region> {
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            ptr: p.cast(),
            len: len.max(1),
        })
    }

    fn slice(&mut self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len);
        // SAFETY: inside our mapping; &mut self makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One worker's share of the ring: entries of the ring queues `qids`, `per_queue` each.
pub(crate) struct Ring {
    uring: IoUring<squeue::Entry128, cqueue::Entry>,
    ch: Channel,
    wake_fd: RawFd,
    /// Ring queue of each entry.
    qid: Vec<u16>,
    /// Unmapped on drop only once the kernel let go of every entry (see `Drop`).
    headers: ManuallyDrop<Region>,
    payloads: ManuallyDrop<Region>,
    payload_len: usize,
    /// The iovecs REGISTER points at; the kernel reads them while the SQE is submitted.
    iovs: Vec<[libc::iovec; 2]>,
    /// Request (unique) -> entry holding it, for every entry handed to us and not answered yet.
    owner: HashMap<u64, usize>,
    /// Entries holding a new request, from completions not yet taken.
    ready: Vec<usize>,
    alive: usize,
    /// Entries whose command failed, from the last completions (reused, at most one each).
    failed: Vec<(usize, i32)>,
    /// Entries registered again after a refused commit that have not delivered a request since
    /// (see `reap`): each gets one new REGISTER per delivered request, never two in a row.
    reregistered: Vec<bool>,
    started: bool,
    dev_armed: bool,
    wake_armed: bool,
    dev_readable: bool,
    sock: SockPoll,
    /// First error an entry completed with.
    error: Option<i32>,
}

// SAFETY: the raw pointers are our own mappings; a Ring is used by one thread at a time.
unsafe impl Send for Ring {}

impl Ring {
    /// `payload_len` must be at least the kernel's max payload: max(8 KiB, max_write,
    /// max_pages * 4 KiB) for the negotiated values.
    pub(crate) fn new(
        ch: Channel,
        wake_fd: RawFd,
        qids: &[u16],
        per_queue: usize,
        payload_len: usize,
    ) -> Result<Ring, String> {
        let n = qids.len() * per_queue;
        let qid: Vec<u16> = qids
            .iter()
            .flat_map(|&q| std::iter::repeat_n(q, per_queue))
            .collect();
        let headers =
            Region::new(n * HEADER_LEN).map_err(|e| format!("allocating ring headers: {e}"))?;
        let payloads = Region::new(n * payload_len)
            .map_err(|e| format!("allocating ring payload buffers: {e}"))?;
        // Room for every entry's command plus the polls (and the removal of a socket's).
        let size = (n as u32 + 4).next_power_of_two().max(8);
        let uring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(size)
            .map_err(|e| format!("creating an io_uring with 128-byte entries: {e}"))?;
        let iovs = (0..n)
            .map(|i| {
                [
                    libc::iovec {
                        // SAFETY: inside the mappings (i < n).
                        iov_base: unsafe { headers.ptr.add(i * HEADER_LEN) }.cast(),
                        iov_len: HEADER_LEN,
                    },
                    libc::iovec {
                        // SAFETY: as above.
                        iov_base: unsafe { payloads.ptr.add(i * payload_len) }.cast(),
                        iov_len: payload_len,
                    },
                ]
            })
            .collect();
        Ok(Ring {
            uring,
            ch,
            wake_fd,
            qid,
            headers: ManuallyDrop::new(headers),
            payloads: ManuallyDrop::new(payloads),
            payload_len,
            iovs,
            owner: HashMap::with_capacity(n),
            ready: Vec::with_capacity(n),
            alive: n,
            failed: Vec::with_capacity(n),
            reregistered: vec![false; n],
            started: false,
            dev_armed: false,
            wake_armed: false,
            dev_readable: false,
            sock: SockPoll::default(),
            error: None,
        })
    }

    pub(crate) fn channel(&self) -> &Channel {
        &self.ch
    }

    pub(crate) fn entries(&self) -> usize {
        self.qid.len()
    }

    /// Queues an SQE, submitting what is queued when the submission queue is full.
    ///
    /// # Safety
    ///
    /// Every buffer `sqe` refers to must stay valid until its completion (or, for an entry's
    /// buffers, until the kernel can no longer write into them: as long as the ring).
    unsafe fn push(&mut self, sqe: &squeue::Entry128) -> io::Result<()> {
        loop {
            // SAFETY: the caller keeps what the SQE refers to alive.
            if unsafe { self.uring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            crate::sockpoll::submit_for_room(&mut self.uring)?;
        }
    }

    fn uring_cmd(&self, op: u32, entry: usize, commit_id: u64) -> squeue::Entry128 {
        opcode::UringCmd80::new(types::Fd(self.ch.as_raw_fd()), op)
            .cmd(cmd_req(commit_id, self.qid[entry]))
            .build()
            .user_data(entry as u64)
    }

    /// Registers every entry (from the thread that will serve them: the kernel delivers
    /// requests through task work of the submitting task) and arms the polls. An entry the
    /// kernel refuses completes at once with the error, which is returned.
    pub(crate) fn start(&mut self) -> Result<(), String> {
        self.ch
            .set_nonblocking(true)
            .map_err(|e| format!("/dev/fuse: {e}"))?;
        for i in 0..self.entries() {
            let sqe = self.uring_cmd(CMD_REGISTER, i, 0);
            let sqe = with_addr_len(sqe, self.iovs[i].as_ptr() as u64, 2);
            // SAFETY: the iovecs and the entry buffers they point at live as long as the ring.
            unsafe { self.push(&sqe) }
                .map_err(|e| format!("registering FUSE ring entries: {e}"))?;
        }
        self.rearm(true, None)
            .map_err(|e| format!("io_uring: {e}"))?;
        self.uring
            .submit()
            .map_err(|e| format!("registering FUSE ring entries: {e}"))?;
        self.reap();
        self.started = true;
        match self.error {
            Some(e) => Err(format!(
                "the kernel refused FUSE over io_uring: {}",
                io::Error::from_raw_os_error(e)
            )),
            None => Ok(()),
        }
    }

    /// Takes what the kernel completed: new requests, poll events, dead entries.
    pub(crate) fn reap(&mut self) {
        let mut wake = false;
        for c in self.uring.completion() {
            match c.user_data() {
                POLL_DEV => {
                    self.dev_armed = false;
                    self.dev_readable = true;
                }
                POLL_WAKE => {
                    self.wake_armed = false;
                    wake = true;
                }
                // The socket: the worker polls its queue on every turn anyway.
                ud if SockPoll::owns(ud) => self.sock.on_cqe(ud, c.flags()),
                e if (e as usize) < self.qid.len() => {
                    if c.result() == 0 {
                        self.reregistered[e as usize] = false;
                        self.ready.push(e as usize);
                    } else {
                        self.failed.push((e as usize, -c.result()));
                    }
                }
                _ => {}
            }
        }
        let mut failed = std::mem::take(&mut self.failed);
        for &(e, err) in &failed {
            let ending = matches!(err, libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED);
            if self.started && !ending && !self.reregistered[e] {
                // A commit the kernel refused (its request was gone) leaves the entry unparked
                // while the connection lives on: without a new REGISTER its ring queue would
                // lose capacity for good. Once per entry until it delivers a request again, so a
                // kernel that refuses everything cannot keep us busy, and a long-lived mapping
                // never runs out of second chances.
                self.reregistered[e] = true;
                crate::log!(
                    "warn",
                    "FUSE ring entry {e}: {}; registering it again",
                    io::Error::from_raw_os_error(err)
                );
                let sqe = self.uring_cmd(CMD_REGISTER, e, 0);
                let sqe = with_addr_len(sqe, self.iovs[e].as_ptr() as u64, 2);
                // SAFETY: as in `start`: iovecs and entry buffers live as long as the ring.
                if unsafe { self.push(&sqe) }.is_ok() {
                    continue;
                }
            }
            // The end of the connection, or a refusal.
            self.alive = self.alive.saturating_sub(1);
            self.error.get_or_insert(err);
        }
        failed.clear();
        self.failed = failed;
        if wake {
            crate::sys::Waker::clear_fd(self.wake_fd);
        }
    }

    /// Completions are waiting to be reaped.
    pub(crate) fn has_completions(&mut self) -> bool {
        !self.uring.completion().is_empty()
    }

    /// Every entry has ended: the connection is gone.
    pub(crate) fn dead(&self) -> bool {
        self.alive == 0
    }

    /// /dev/fuse had something to read since the last call.
    pub(crate) fn take_readable(&mut self) -> bool {
        std::mem::take(&mut self.dev_readable)
    }

    /// Next entry holding a new request: its request is copied into `out` in read() layout and
    /// the entry remembered for the answer. Err: a malformed request, to answer EIO to.
    pub(crate) fn next_request(&mut self, out: &mut [u8]) -> Option<Result<usize, u64>> {
        let e = self.ready.pop()?;
        let pl = self.payload_len;
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(self.headers.slice(e * HEADER_LEN, HEADER_LEN));
        let payload = self.payloads.slice(e * pl, pl);
        let r = request_bytes(&header, payload, out);
        let unique = match r {
            Ok(_) => get64(&header, 8),
            Err(id) => id,
        };
        if self.owner.insert(unique, e).is_some() {
            // The kernel handed out one unique twice; the older entry is lost to us.
            crate::log!("error", "FUSE ring: request {unique} arrived twice");
        }
        Some(r)
    }

    /// Arms the polls that are not armed: /dev/fuse only with `dev` (a worker whose table is
    /// full would be woken by it at once, again and again), and the socket of the worker's
    /// queue `sock` (number of the queue, descriptor; None while disconnected).
    pub(crate) fn rearm(&mut self, dev: bool, sock: Option<(u64, RawFd)>) -> io::Result<()> {
        for sqe in self.sock.update(sock).into_iter().flatten() {
            // SAFETY: a poll and its removal refer to no buffer.
            unsafe { self.push(&sqe.into()) }?;
        }
        if dev && !self.dev_armed {
            let p = opcode::PollAdd::new(types::Fd(self.ch.as_raw_fd()), libc::POLLIN as u32)
                .build()
                .user_data(POLL_DEV);
            // SAFETY: a poll refers to no buffer.
            unsafe { self.push(&p.into()) }?;
            self.dev_armed = true;
        }
        if !self.wake_armed {
            let p = opcode::PollAdd::new(types::Fd(self.wake_fd), libc::POLLIN as u32)
                .build()
                .user_data(POLL_WAKE);
            // SAFETY: a poll refers to no buffer.
            unsafe { self.push(&p.into()) }?;
            self.wake_armed = true;
        }
        Ok(())
    }

    pub(crate) fn submit(&mut self) -> Result<(), String> {
        crate::sockpoll::submit(&mut self.uring)
    }

    /// Submits and sleeps until something completes, or `limit` passes.
    pub(crate) fn wait(&mut self, limit: Option<Duration>) -> Result<(), String> {
        crate::sockpoll::sleep(&mut self.uring, limit)
    }

    /// Answers request `unique`: through its entry (COMMIT_AND_FETCH, which also parks the
    /// entry for the next request) when it came from the ring, else on /dev/fuse.
    pub(crate) fn answer(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) -> io::Result<()> {
        let Some(e) = self.owner.remove(&unique) else {
            return self.ch.reply(unique, errno, parts);
        };
        let pl = self.payload_len;
        let payload = self.payloads.slice(e * pl, pl);
        let header = self.headers.slice(e * HEADER_LEN, HEADER_LEN);
        fill_answer(header, payload, unique, errno, parts);
        let sqe = self.uring_cmd(CMD_COMMIT_AND_FETCH, e, unique);
        // SAFETY: the command area names the entry, whose buffers live as long as the ring.
        unsafe { self.push(&sqe) }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // An entry still registered keeps the kernel's pointers into these buffers, and the
        // kernel writes a request there (in this thread's context) until the ring's asynchronous
        // teardown cancels it: unmapped memory that a later allocation reuses would be written.
        // Only a worker failing while the connection lives gets here with live entries; the
        // buffers are then left mapped (the daemon ends the mapping in that case anyway).
        if self.alive == 0 {
            // SAFETY: dropped once, here; nothing uses them afterwards.
            unsafe {
                ManuallyDrop::drop(&mut self.headers);
                ManuallyDrop::drop(&mut self.payloads);
            }
        }
    }
}

/// Sets sqe->addr and sqe->len, which the io-uring crate's UringCmd80 does not expose (len):
/// REGISTER takes the iovec array there.
fn with_addr_len(sqe: squeue::Entry128, addr: u64, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C): the 64-byte struct io_uring_sqe, then 64 bytes of command;
    // addr is at byte 16 and len at byte 24 of io_uring_sqe (include/uapi/linux/io_uring.h).
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[16..24].copy_from_slice(&addr.to_ne_bytes());
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: the same bytes with two plain integer fields changed.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn possible_cpu_lists() {
        assert_eq!(count_cpu_list("0-1"), Some(2));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0,2-5,7"), Some(6));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("0-99999"), None);
    }

    fn header(len: u32, unique: u64, payload_sz: u32) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&len.to_ne_bytes());
        h[4..8].copy_from_slice(&abi::op::WRITE.to_ne_bytes());
        h[8..16].copy_from_slice(&unique.to_ne_bytes());
        h[COMMIT_ID_AT..COMMIT_ID_AT + 8].copy_from_slice(&unique.to_ne_bytes());
        h[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4].copy_from_slice(&payload_sz.to_ne_bytes());
        h
    }

    #[test]
    fn ring_requests_become_read_layout_and_parse() {
        // WRITE of 5 bytes at 4096: fuse_write_in in op_in, the data in the payload.
        let mut h = header(40 + 40 + 5, 9, 5);
        h[IN_OUT_LEN + 8..IN_OUT_LEN + 16].copy_from_slice(&4096u64.to_ne_bytes());
        h[IN_OUT_LEN + 16..IN_OUT_LEN + 20].copy_from_slice(&5u32.to_ne_bytes());
        let mut payload = vec![0u8; 8192];
        payload[..5].copy_from_slice(b"hello");
        let mut out = vec![0u8; 8192];
        let n = request_bytes(&h, &payload, &mut out).unwrap();
        assert_eq!(n, 85);
        let (hd, r) = abi::parse(&out[..n]).unwrap();
        assert_eq!(hd.unique, 9);
        assert_eq!(
            r,
            abi::Request::Write {
                offset: 4096,
                data: b"hello"
            }
        );
    }

    #[test]
    fn hostile_ring_headers_are_refused_with_their_commit_id() {
        let payload = vec![0u8; 8192];
        let mut out = vec![0u8; 8192];
        // Length shorter than the header, payload larger than claimed, op header > 128,
        // payload larger than the buffer, request larger than the output.
        for (len, psz) in [
            (10u32, 0u32),
            (40 + 4, 8),
            (40 + 200, 0),
            (40 + 9000, 9000),
            (40 + 8192 + 64, 8192),
        ] {
            let h = header(len, 77, psz);
            assert_eq!(
                request_bytes(&h, &payload, &mut out),
                Err(77),
                "{len} {psz}"
            );
        }
        // A commit id that is not the request's unique.
        let mut h = header(40, 77, 0);
        h[8..16].copy_from_slice(&78u64.to_ne_bytes());
        assert_eq!(request_bytes(&h, &payload, &mut out), Err(77));
        assert_eq!(
            request_bytes(&header(40, 77, 0), &payload, &mut out),
            Ok(40)
        );
    }

    #[test]
    fn answers_fill_header_and_payload() {
        let mut h = vec![0u8; HEADER_LEN];
        let mut p = vec![0u8; 16];
        fill_answer(&mut h, &mut p, 5, 0, &[b"abc", b"de"]);
        assert_eq!(get32(&h, 0), 16 + 5);
        assert_eq!(get32(&h, 4), 0);
        assert_eq!(get64(&h, 8), 5);
        assert_eq!(get32(&h, PAYLOAD_SZ_AT), 5);
        assert_eq!(&p[..5], b"abcde");
        fill_answer(&mut h, &mut p, 6, libc::ENOENT, &[b"ignored"]);
        assert_eq!(get32(&h, 4) as i32, -libc::ENOENT);
        assert_eq!(get32(&h, PAYLOAD_SZ_AT), 0);
        // Too big for the buffer: EIO, nothing copied.
        fill_answer(&mut h, &mut p, 7, 0, &[&[1u8; 17]]);
        assert_eq!(get32(&h, 4) as i32, -libc::EIO);
        assert_eq!(get32(&h, PAYLOAD_SZ_AT), 0);
    }

    #[test]
    fn register_sqe_carries_iovec_address_and_count() {
        let sqe = opcode::UringCmd80::new(types::Fd(3), CMD_REGISTER)
            .cmd(cmd_req(0, 1))
            .build();
        let sqe = with_addr_len(sqe, 0x1234_5678, 2);
        // SAFETY: reading back the bytes of a 128-byte POD.
        let raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        assert_eq!(raw[0], 46, "IORING_OP_URING_CMD");
        assert_eq!(get64(&raw, 16), 0x1234_5678);
        assert_eq!(get32(&raw, 24), 2);
        assert_eq!(get32(&raw, 8), CMD_REGISTER, "cmd_op");
        // The command area starts at byte 48: commit_id at +8, qid at +16.
        assert_eq!(u16::from_ne_bytes([raw[48 + 16], raw[48 + 17]]), 1);
    }
}
