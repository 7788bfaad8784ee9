//! Requests of a stream connection: decode with the connection's frontend, refuse or run with
//! its executor, and build replies (READ data straight behind the frontend's prefix).

use blkwire_backend::{AlignedBuf, Extent, IoFlags};
use blkwire_wire::Status;

use super::conn::Conn;
use super::ring::{ud, Pusher, KIND_IO};
use crate::executor::{result_status, Outcome};
use crate::frontend::{Decoded, Kind, Req};
use crate::log::Level;

/// Dispatches every complete message in `rx[rx_start..rx_end]`.
pub(super) fn parse_frames(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    loop {
        if c.dead || c.tx_backlog() >= c.tx_high_water() {
            return;
        }
        // Requests of frontends with cookies take a server-side slot if they go to a backend
        // that does not finish inline: stop when none is free; a completion frees one and
        // services this connection again.
        if !c.inline && c.fe.server_assigns_slots() && c.free_slots.is_empty() {
            return;
        }
        let (req, len, payload_len) = match c.fe.decode(&c.rx[c.rx_start..c.rx_end]) {
            Decoded::Need(total) => {
                c.make_room(total);
                break;
            }
            Decoded::Violation(e) => return c.violation(&e),
            Decoded::Request {
                req,
                len,
                payload_len,
            } => (req, len, payload_len),
        };
        let payload_at = c.rx_start + len - payload_len;
        c.rx_start += len;
        c.exec.stats.frames_in += 1;
        dispatch(c, idx, &req, payload_at, sq);
    }
    if c.rx_start == c.rx_end {
        c.rx_start = 0;
        c.rx_end = 0;
    }
}

fn dispatch(c: &mut Conn, idx: usize, req: &Req, payload_at: usize, sq: &mut Pusher<'_>) {
    let block = match req.kind {
        Kind::Block(_) => req.block().expect("a block request"),
        Kind::Keepalive => return c.reply(req, Status::Ok),
        Kind::Logout => {
            // Nothing after LOGOUT/DISC is executed (PROTOCOL.md §2.5); what is in flight is
            // still answered before the queue closes.
            c.reply(req, Status::Ok);
            c.closing = true;
            c.rx_start = c.rx_end;
            return;
        }
        Kind::Unsupported => return c.reply(req, Status::Unsupported),
        Kind::Invalid => return c.reply(req, Status::Invalid),
        Kind::Cache | Kind::BlockStatus => {
            if let Err(st) = c.exec.check_range(req.offset, req.length) {
                return c.reply(req, st);
            }
            if req.kind == Kind::BlockStatus {
                return block_status(c, idx, req, sq);
            }
            // Advisory: nothing to prefetch into for memory, and files have the page cache.
            return c.reply(req, Status::Ok);
        }
    };
    if let Some(s) = req.slot {
        match c.slots.get(s as usize) {
            None => return c.reply(req, Status::Invalid),
            Some(slot) if slot.busy => {
                return c.violation(&format_args!("slot {s} reused while in flight"))
            }
            Some(_) => {}
        }
    }
    if let Err(st) = c.exec.admit(&block) {
        return c.reply(req, st);
    }
    let len = block.len;

    if c.inline {
        // mem:/null: the request completes inside start(); READ lands straight in the reply
        // buffer and WRITE is taken straight from the receive buffer: one copy each way.
        if req.is_read() {
            if read_hole(c, req) {
                return;
            }
            let at = c.tx.len();
            let prefix = c.fe.read_prefix_len();
            // The prefix is zeroed, the data is not: the backend writes it straight into the
            // spare capacity and only then does the buffer grow over it.
            c.tx.resize(at + prefix, 0);
            c.tx.reserve(len as usize);
            // SAFETY: `reserve` made room for `len` bytes after the prefix.
            let buf = unsafe { c.tx.as_mut_ptr().add(at + prefix) };
            // SAFETY: the export completes inline, so the buffer is only used during the call.
            let status = match unsafe { c.exec.start(&block, buf, 0, sq) } {
                Outcome::Done(st) => st,
                Outcome::Pending => unreachable!("inline exports finish in start"),
            };
            if status == Status::Ok {
                // SAFETY: the backend initialised all `len` bytes (it reported success).
                unsafe { c.tx.set_len(at + prefix + len as usize) };
                c.fe.write_read_prefix(req, &mut c.tx[at..at + prefix]);
                c.count_reply(status);
            } else {
                c.tx.truncate(at);
                c.reply(req, status);
            }
            return;
        }
        // Only WRITE uses the buffer, and only reads it.
        let buf = c.rx[payload_at..].as_mut_ptr();
        // SAFETY: for a WRITE the receive buffer holds the whole payload (decode saw it), and
        // the export completes inline, so the buffer is only read during the call.
        let status = match unsafe { c.exec.start(&block, buf, 0, sq) } {
            Outcome::Done(st) => st,
            Outcome::Pending => unreachable!("inline exports finish in start"),
        };
        return c.reply(req, status);
    }

    // A backend that finishes later: the slot owns a buffer that lives until the completion.
    let slot = match req.slot {
        Some(s) => s,
        None => c
            .free_slots
            .pop()
            .expect("parse_frames checked for a free slot"),
    };
    let tag = ud(KIND_IO, c.incarnation, idx, slot);
    let align = c.exec.buffer_alignment();
    let s = &mut c.slots[slot as usize];
    let mut buf = std::ptr::null_mut();
    if block.op.moves_data() {
        if s.buf.as_ref().is_none_or(|b| b.len() < len as usize) {
            s.buf = Some(AlignedBuf::zeroed(len as usize, align));
        }
        let b = s.buf.as_mut().expect("just set");
        if req.is_read() {
            buf = b.as_mut_ptr();
        } else {
            b.as_mut_slice()[..len as usize]
                .copy_from_slice(&c.rx[payload_at..payload_at + len as usize]);
            buf = b.as_mut_ptr();
        }
    }
    // SAFETY: the slot's buffer holds `len` bytes and is neither freed nor touched until the
    // slot is released, which happens only once the result is delivered (a busy slot is never
    // reused, and a connection with slots in flight is never dropped).
    match unsafe { c.exec.start(&block, buf, tag, sq) } {
        Outcome::Done(status) => {
            release_slot(c, slot);
            c.reply(req, status);
        }
        Outcome::Pending => {
            let s = &mut c.slots[slot as usize];
            s.busy = true;
            s.req = Some(*req);
            c.inflight += 1;
        }
    }
}

/// A READ of a range that is all hole, for frontends that can say so without the zeros. Only
/// for large reads, where saving the data is worth an allocation query.
fn read_hole(c: &mut Conn, req: &Req) -> bool {
    if !c.fe.replies_with_holes() || req.length < (64 << 10) {
        return false;
    }
    let mut extents = std::mem::take(&mut c.extents);
    extents.clear();
    c.exec
        .export()
        .backend()
        .allocation(req.offset, req.length as u64, &mut extents);
    let hole = extents.len() == 1 && extents[0].hole && extents[0].len >= req.length as u64;
    c.extents = extents;
    if hole {
        c.fe.hole_reply(req, &mut c.tx);
        c.count_reply(Status::Ok);
    }
    hole
}

/// Returns a server-assigned slot to the free list (client-assigned slots are the client's).
fn release_slot(c: &mut Conn, slot: u16) {
    if c.fe.server_assigns_slots() {
        c.free_slots.push(slot);
    }
}

/// An allocation query: holes are unallocated ranges that read as zero. Exports that complete
/// inline answer on this thread into the connection's scratch list; the others may run the
/// query on their own threads, so it takes a slot whose list outlives it.
fn block_status(c: &mut Conn, idx: usize, req: &Req, sq: &mut Pusher<'_>) {
    if c.inline {
        let mut extents = std::mem::take(&mut c.extents);
        extents.clear();
        // SAFETY: `extents` is ours for the call, and an inline export answers inside it.
        let status = match unsafe {
            c.exec
                .start_allocation(req.offset, req.length, &mut extents, 0, sq)
        } {
            Outcome::Done(st) => st,
            Outcome::Pending => unreachable!("inline exports answer allocation queries inline"),
        };
        answer_block_status(c, req, status, &extents);
        c.extents = extents;
        return;
    }
    let slot = match req.slot {
        Some(s) if c.slots.get(s as usize).is_some_and(|x| !x.busy) => s,
        Some(_) => return c.reply(req, Status::Invalid),
        None => c
            .free_slots
            .pop()
            .expect("parse_frames checked for a free slot"),
    };
    let tag = ud(KIND_IO, c.incarnation, idx, slot);
    let s = &mut c.slots[slot as usize];
    s.extents.clear();
    let out: *mut Vec<Extent> = &mut s.extents;
    // SAFETY: the slot's list is neither touched nor freed until the slot is released, which
    // happens only once the result is delivered (a connection with slots in flight is never
    // dropped).
    match unsafe {
        c.exec
            .start_allocation(req.offset, req.length, out, tag, sq)
    } {
        Outcome::Done(status) => {
            let extents = std::mem::take(&mut c.slots[slot as usize].extents);
            release_slot(c, slot);
            answer_block_status(c, req, status, &extents);
            c.slots[slot as usize].extents = extents;
        }
        Outcome::Pending => {
            let s = &mut c.slots[slot as usize];
            s.busy = true;
            s.req = Some(*req);
            c.inflight += 1;
        }
    }
}

/// Replies to an allocation query with its extents (or its error).
fn answer_block_status(c: &mut Conn, req: &Req, status: Status, extents: &[Extent]) {
    if status != Status::Ok {
        return c.reply(req, status);
    }
    let mut extents = extents;
    if req.flags.has(IoFlags::REQ_ONE) {
        extents = &extents[..extents.len().min(1)];
    }
    // Lengths fit in u32: every extent lies inside the request, whose length is a u32.
    let list: Vec<(u32, bool)> = extents
        .iter()
        .map(|e| (e.len.min(u32::MAX as u64) as u32, e.hole))
        .collect();
    if c.fe.block_status_reply(req, &list, &mut c.tx) {
        c.count_reply(Status::Ok);
    } else {
        c.reply(req, Status::Invalid);
    }
}

/// A ring completion for a slot's request; more may be needed before it is finished.
pub(super) fn complete(c: &mut Conn, slot: u16, tag: u64, res: i32, sq: &mut Pusher<'_>) {
    if !c.slots.get(slot as usize).is_some_and(|s| s.busy) {
        return;
    }
    if let Some(res) = c.exec.complete(tag, res, sq) {
        finish_result(c, slot, res);
    }
}

/// A finished request's backend result (from a thread-completing backend).
pub(super) fn finish_result(c: &mut Conn, slot: u16, res: i32) {
    let Some(req) = c
        .slots
        .get(slot as usize)
        .filter(|s| s.busy)
        .and_then(|s| s.req)
    else {
        return;
    };
    let status = match req.block() {
        Some(block) => c.exec.status(&block, res),
        None => result_status(res), // an allocation query
    };
    finish(c, slot, status);
}

/// A request that ran on the backend finished: build its reply.
fn finish(c: &mut Conn, slot: u16, status: Status) {
    let s = &mut c.slots[slot as usize];
    s.busy = false;
    let req = s.req.take().expect("busy slot has a request");
    c.inflight -= 1;
    release_slot(c, slot);
    if status != Status::Ok {
        crate::log!(
            Level::Warn,
            "session {} queue {}: {:?} at {} len {} failed: {status}",
            c.session,
            c.queue,
            req.kind,
            req.offset,
            req.length,
        );
    }
    if req.kind == Kind::BlockStatus {
        let extents = std::mem::take(&mut c.slots[slot as usize].extents);
        answer_block_status(c, &req, status, &extents);
        c.slots[slot as usize].extents = extents;
    } else if req.is_read() && status == Status::Ok {
        let len = req.length as usize;
        let at = c.tx.len();
        let prefix = c.fe.read_prefix_len();
        c.tx.resize(at + prefix, 0);
        c.fe.write_read_prefix(&req, &mut c.tx[at..at + prefix]);
        let buf = c.slots[slot as usize].buf.as_ref().expect("read buffer");
        c.tx.extend_from_slice(&buf.as_slice()[..len]);
        c.count_reply(status);
    } else {
        c.reply(&req, status);
    }
}
