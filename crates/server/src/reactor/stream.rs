//! Requests of a stream connection: decode with the connection's frontend, refuse or run with
//! its executor, and build replies (READ data straight behind the frontend's prefix).

use blkwire_backend::{AlignedBuf, BlockRequest, Extent, IoFlags, MAX_EXTENTS};
use blkwire_wire::Status;

use super::conn::{extents_bound, list_bytes, Broadcast, Conn, Slot, REPLY_SLACK};
use super::ring::{ud, Pusher, KIND_IO};
use crate::bufpool::Buffers;
use crate::executor::{result_status, Copied, Outcome, Started};
use crate::frontend::{Decoded, Kind, Piece, ReadFraming, Req};
use crate::log::Level;

/// READs of at least this many bytes from a backend that fills a buffer are sent from that
/// buffer (`Conn::queue_data`); smaller ones are copied into the transmit buffer, where a
/// batch of them goes out in one send.
const SEND_IN_PLACE: usize = 64 << 10;

/// Broadcasts (reservation changes) one connection may have on their way to the other
/// reactors before it decodes nothing more.
const MAX_BROADCASTS: usize = 4;

/// Requests a frontend makes up itself (the parts of a compound command: NVMe/TCP's
/// deallocation of many ranges, iSCSI's UNMAP or WRITE SAME) taken in one pass: they consume
/// no bytes, so one command of millions of parts that each finish at once (an advisory trim)
/// would otherwise hold the reactor until its last. The reactor's service loop takes the
/// connection again at once (a pass that took some is progress), up to its rounds, then puts
/// it back in line behind the other connections.
const PARTS_PER_PASS: usize = 64;

/// Dispatches every complete message in `rx[rx_start..rx_end]`.
pub(super) fn parse_frames(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    // Starved with nothing running, it waits only for what its own buffers grew to (a large
    // WRITE's receive buffer, a large READ's transmit buffer): they go back now, not at the
    // idle trim a second or two later, the frame it waits on kept.
    if std::mem::take(&mut c.starved) && c.inflight == 0 && c.tx_backlog() == 0 {
        c.trim_starved();
    }
    c.request_waits = false;
    run_deferred(c, idx, sq);
    let mut parts = 0;
    loop {
        if c.dead || c.tx_backlog() >= c.tx_high_water() {
            return;
        }
        // A broadcast takes no slot and no buffer, and the frontend commits its change when it
        // decodes it: without a bound of its own, an initiator sending PERSISTENT RESERVE OUT
        // after PERSISTENT RESERVE OUT faster than they are sent on would queue a copy of the
        // export's reservation state per command (and its reply never goes before the
        // reactor's turn ends). The reactor services the connection again once it sent them
        // (`Reactor::send_broadcasts`) or an acknowledgement answers one.
        if c.broadcasts.len() >= MAX_BROADCASTS || parts >= PARTS_PER_PASS {
            return;
        }
        // Room for small replies (status, refusals), or for what the frontend may answer the
        // next message with itself, without letting `Vec` double the buffer behind the
        // budget's back.
        let room =
            c.fe.reply_bound(&c.rx[c.rx_start..c.rx_end])
                .max(REPLY_SLACK);
        if c.tx.capacity() - c.tx.len() < room {
            if c.covers(room, 0) {
                c.grow_tx(room);
            } else if !c.fe.next_is_data(&c.rx[c.rx_start..c.rx_end]) {
                return;
            }
            // Solicited data goes in even then: the writes it completes give memory back,
            // and their replies are a few bytes each.
        }
        // Requests of frontends with cookies take a server-side slot when they go to a backend
        // that does not finish inline or wait for solicited data: stop when none is free
        // (unless the next message needs none, `needs_no_slot`); a completion frees one and
        // services this connection again.
        if c.fe.server_assigns_slots()
            && c.free_slots.is_empty()
            && !c.fe.needs_no_slot(&c.rx[c.rx_start..c.rx_end])
        {
            return;
        }
        let decoded = c.fe.decode(&c.rx[c.rx_start..c.rx_end], &mut c.tx);
        let (len, payload_len, trailer) = match decoded {
            // Closing, nothing more is read: a frame not whole now never will be, and waits
            // for no memory (the connection would stay starved, retried for ever).
            Decoded::Need(_) if c.closing => break,
            Decoded::Need(total) => {
                c.make_room(total);
                break;
            }
            Decoded::Violation(e) => return c.violation(&e),
            Decoded::Request {
                len,
                payload_len,
                trailer,
                ..
            }
            | Decoded::Data {
                len,
                payload_len,
                trailer,
                ..
            } => (len, payload_len, trailer),
            Decoded::Answered { len } | Decoded::Dropped { len } | Decoded::Release { len, .. } => {
                (len, 0, 0)
            }
        };
        // What a request will hold must fit the high-water mark and the memory budget
        // (`request_cover`). Solicited data and answered messages still go through, so a write
        // waiting for its data can always complete.
        if let Decoded::Request {
            req, payload_len, ..
        } = &decoded
        {
            // Decoded from a message that needed no slot (`next_is_data`: iSCSI Data-Out that
            // completes a parameter list makes UNMAP's first part, say) while none is free: it
            // waits untaken, as for memory, until a completion frees one (`take_slot` counts
            // on one). Not a broadcast: it runs in no slot, and the change it carries is
            // committed to the export's shared state already (iSCSI PERSISTENT RESERVE OUT);
            // left untaken, it would be lost with a connection that dies before a slot frees,
            // and the other connections and reactors would never see the change. Nor a
            // LOGOUT: it runs in no slot either, and the writes holding them for data the
            // initiator will no longer send are answered by it (`dispatch`).
            if req.slot.is_none()
                && !matches!(req.kind, Kind::Broadcast | Kind::Logout)
                && c.fe.server_assigns_slots()
                && c.free_slots.is_empty()
            {
                break;
            }
            match request_cover(c, req, *payload_len) {
                Cover::Yes => {}
                // While writes wait for data the initiator sends after this request, the
                // request waits in a slot instead of in rx: stopping the stream here would keep
                // that data, and the memory those writes will free, from ever arriving.
                // A write whose unsolicited data follows cannot wait in a slot without a
                // buffer for it, nor stop the stream while other writes wait for data behind
                // it: it is refused (the initiator retries it) and its data dropped.
                Cover::Wait if c.fe.data_follows(req) && writes_wait(c) => {
                    refuse_for_memory(c, req, len);
                    continue;
                }
                Cover::Wait if *payload_len == 0 && req.slot.is_none() && writes_wait(c) => {
                    let req = *req;
                    c.fe.taken(&req);
                    c.rx_start += len;
                    c.stats().frames_in += 1;
                    park(c, &req);
                    continue;
                }
                // A small write that brings all its data (NVMe/TCP in-capsule data) runs, a
                // little past the budget (its slots bound how much), rather than keep the data
                // of the waiting writes out.
                Cover::Wait
                    if *payload_len == req.length as usize
                        && *payload_len <= SMALL_PAYLOAD
                        && req.slot.is_none()
                        && writes_wait(c) => {}
                // Any other write that brings data (iSCSI immediate data, up to
                // FirstBurstLength) would stop the stream just the same: it waits in a slot
                // with a copy of what it brought, or is refused if the budget cannot hold even
                // that (`park_with_data`).
                Cover::Wait
                    if req.is_write()
                        && *payload_len > 0
                        && req.slot.is_none()
                        && writes_wait(c) =>
                {
                    let req = *req;
                    let payload_len = *payload_len;
                    c.fe.taken(&req);
                    let payload_at = c.rx_start + len - trailer - payload_len;
                    c.rx_start += len;
                    c.stats().frames_in += 1;
                    park_with_data(c, &req, payload_at, payload_len);
                    continue;
                }
                // Anything else that must wait (a COPY, whose ranges NVMe/TCP sends as its
                // payload: its bounce buffer, or the one COPY a queue runs at a time) cannot
                // wait in a slot: while writes wait for their data it is refused (the initiator
                // retries it), for stopping the stream would keep that data out, and with it
                // the memory its writes give back.
                // (Not one that waits only for the COPY running: its completion services the
                // connection again.)
                Cover::Wait if writes_wait(c) && !(req.kind == Kind::Copy && c.copying) => {
                    refuse_for_memory(c, req, len);
                    continue;
                }
                Cover::Wait => {
                    c.request_waits = true;
                    break;
                }
                Cover::Never => {
                    refuse_for_memory(c, req, len);
                    continue;
                }
            }
        }
        let payload_at = c.rx_start + len - trailer - payload_len;
        c.rx_start += len;
        c.stats().frames_in += 1;
        parts += usize::from(len == 0 && matches!(decoded, Decoded::Request { .. }));
        match decoded {
            Decoded::Request { req, .. } => {
                c.fe.taken(&req);
                dispatch(c, idx, &req, payload_at, payload_len, sq);
                // A write that came without its data may have joined the queue of those
                // waiting for memory: solicit now what memory allows.
                if !c.deferred.is_empty() {
                    run_deferred(c, idx, sq);
                }
            }
            Decoded::Data { slot, offset, .. } => {
                take_data(c, idx, slot, offset, payload_at, payload_len, sq);
                // A write that ran gave its memory back: what waits for memory may go on.
                if !c.deferred.is_empty() {
                    run_deferred(c, idx, sq);
                }
            }
            Decoded::Release { slot, .. } => {
                release_held(c, slot);
                // All of them now: a parked write aborted with it must not be run by
                // `run_deferred` first.
                while let Some(slot) = c.fe.next_release() {
                    release_held(c, slot);
                }
            }
            Decoded::Dropped { .. } => c.stats().dropped_duplicates += 1,
            // Counted as answered even when the frontend's protocol has no answer for it.
            _ => c.stats().frames_out += 1,
        }
    }
    if c.rx_start == c.rx_end {
        c.rx_start = 0;
        c.rx_end = 0;
    }
}

/// Whether the memory budget covers a data request now, later, or never.
enum Cover {
    Yes,
    Wait,
    Never,
}

/// Whether the memory budget covers a request that brought `payload_len` bytes of its data,
/// now, later or never (`parse_frames`, and parked requests in `run_deferred`).
fn request_cover(c: &mut Conn, req: &Req, payload_len: usize) -> Cover {
    let moves_data = matches!(req.kind, Kind::Block(op) if op.moves_data());
    // A WRITE that brings none of its data waits in its slot (no buffer yet) until memory lets
    // its solicitation go out (`hold_write`): it never stops the stream, since the data of the
    // writes before it may be right behind it.
    let follows = req.is_write() && c.fe.data_follows(req);
    let unsolicited = req.is_write() && payload_len == 0 && req.length > 0 && !follows;
    // Data of requests in flight counts against the same high-water mark as replies not yet
    // sent: a client cannot make us hold more by asking for large reads from a backend that
    // answers later. (Letting 1 MiB reads past four in flight did not pay: rbd: reads took twice
    // as long at the backend for the same IOPS, and iSCSI reads from a tmpfs file lost 10-40%;
    // docs/BENCHMARKS.md, issue 18.) A write whose data follows unsolicited gets its buffer now
    // or never, as a write waiting for memory gets it in `run_deferred`: by the memory budget
    // alone.
    let pending = if req.is_read() {
        c.replies_pending()
    } else {
        c.data_pending()
    };
    if moves_data && !unsolicited && !follows && pending >= c.tx_high_water() {
        return Cover::Wait;
    }
    // And the memory budget must cover what the request will add: its reply data, and a data
    // buffer unless it runs inline or a spare fits; a COPY's bounce buffer. Otherwise it waits,
    // unless it could never fit this connection's share: then it fails (ENOMEM).
    match req.kind {
        Kind::Copy => covers_copy(c),
        Kind::BlockStatus => covers_block_status(c, req),
        _ if unsolicited => match covers_request(c, req, payload_len) {
            Cover::Never => Cover::Never,
            _ => Cover::Yes,
        },
        _ if moves_data => covers_request(c, req, payload_len),
        _ => Cover::Yes,
    }
}

/// Whether a COPY may start (see `parse_frames`): one at a time per queue (the next waits in
/// rx, and the socket back-pressures the initiator), its bounce buffer inside the budget.
/// Sessions are granted COPY only where a connection's share holds one, but the connection's
/// own buffers may have grown past leaving room for it.
fn covers_copy(c: &mut Conn) -> Cover {
    let bounce = blkwire_backend::COPY_CHUNK as usize;
    if c.least_held() + bounce > c.mem.cap() {
        Cover::Never
    } else if c.copying || !c.covers(0, bounce) {
        Cover::Wait
    } else {
        Cover::Yes
    }
}

/// Whether an allocation query may be taken (see `parse_frames`). It is not a data request,
/// but its reply may list as many extents as the client asked for, up to MAX_EXTENTS (512 KiB
/// for NBD), and the list it is built from takes 16 bytes an extent (1 MiB at most): like a
/// READ's data, the reply counts against the high-water mark while the query runs, and the
/// budget must cover both before it is taken, or the connection waits. A query for one extent
/// (NBD's REQ_ONE) takes a few bytes, not 1 MiB.
fn covers_block_status(c: &mut Conn, req: &Req) -> Cover {
    let reply = block_status_bound(c, req);
    let list = extents_bound(query_extents(c, req));
    if c.least_held() + reply + list > c.mem.cap() {
        return Cover::Never;
    }
    // Not counting WRITE data (`replies_pending`, as for a READ): counted, the data of
    // writes parked behind the query kept it waiting while they waited behind it.
    if c.replies_pending() >= c.tx_high_water() || !c.covers(reply, list) {
        return Cover::Wait;
    }
    Cover::Yes
}

/// The most the reply to the allocation query `req` takes in the transmit buffer.
fn block_status_bound(c: &Conn, req: &Req) -> usize {
    c.fe.block_status_len(req, query_extents(c, req))
}

/// The most extents the reply to the allocation query `req` lists: one under NBD's REQ_ONE,
/// what the frontend's answer holds (iSCSI: the allocation length), at most MAX_EXTENTS. The
/// backend is asked for no more, and its list is reserved for that many.
fn query_extents(c: &Conn, req: &Req) -> usize {
    let max = if req.flags.has(IoFlags::REQ_ONE) {
        1
    } else {
        c.fe.block_status_extents(req)
    };
    max.clamp(1, MAX_EXTENTS)
}

/// Whether the memory budget covers a data request that brought `payload_len` bytes of its
/// data (see `parse_frames`).
fn covers_request(c: &mut Conn, req: &Req, payload_len: usize) -> Cover {
    let len = req.length as usize;
    let read = req.is_read();
    let framing = read.then(|| c.fe.read_framing(req));
    let chunked = framing.and_then(ReadFraming::chunked).is_some();
    // The reply: its data and what frames it, or room for a status should it fail.
    let extra_tx = match framing {
        Some(ReadFraming::Chunked { framing }) => len + framing.max(REPLY_SLACK),
        // Exactly what it takes (or a failure's status): an estimate a few KiB over would
        // have a transmit buffer that holds the last reply of this size grow by half.
        Some(ReadFraming::Contiguous { prefix, suffix }) => {
            (len + prefix + suffix).max(REPLY_SLACK)
        }
        None => 0,
    };
    // A WRITE without all of its data waits for the rest in a slot's buffer, even on an
    // export that completes inline (`hold_write`).
    let waits = req.is_write() && payload_len < len;
    let pooled = !c.inline(req) || chunked || waits;
    // What it needs even on an idle connection.
    if c.least_held() + extra_tx + if pooled { len } else { 0 } > c.mem.cap() {
        return Cover::Never;
    }
    if c.covers_buffer(extra_tx, if pooled { len } else { 0 }) {
        Cover::Yes
    } else {
        Cover::Wait
    }
}

fn dispatch(
    c: &mut Conn,
    idx: usize,
    req: &Req,
    payload_at: usize,
    payload_len: usize,
    sq: &mut Pusher<'_>,
) {
    // A target the connection does not have, or one fenced since (its export or namespace was
    // removed), runs nothing; a LOGOUT addresses the connection, not a target, and a broadcast
    // carries a change already made to the export's shared state, which every reactor must see
    // whatever became of this connection's view of the export.
    if !matches!(req.kind, Kind::Logout | Kind::Broadcast)
        && c.targets.get(req.target as usize).is_none_or(|t| t.fenced)
    {
        return c.reply(&req.refused(), Status::NoExport);
    }
    let block = match req.kind {
        Kind::Block(_) => req.block().expect("a block request"),
        Kind::Logout => {
            // Nothing after LOGOUT/DISC is executed (PROTOCOL.md §2.5); what is in flight is
            // still answered before the queue closes, and before the LOGOUT itself (its answer
            // then goes when the last is sent, `Reactor::service`). Requests still waiting,
            // for memory or (writes) for data nothing will read now, are answered NO_MEMORY
            // first: left, they could run after the LOGOUT's answer, or never.
            let waiting: Vec<u16> = (0..c.slots.len() as u16)
                .filter(|&i| {
                    let s = &c.slots[i as usize];
                    s.busy && (s.awaiting.is_some() || c.deferred.contains(&i))
                })
                .collect();
            for slot in waiting {
                let Some(r) = c.slots[slot as usize].req else {
                    continue;
                };
                // Parked (the frontend was told): waiting in `deferred`, for memory.
                let parked = c.deferred.contains(&slot);
                release_held(c, slot);
                if parked {
                    c.fe.unparked(slot);
                }
                c.reply(&r.refused(), Status::NoMemory);
            }
            if c.inflight == 0 {
                c.reply(req, Status::Ok);
            } else {
                c.logout = Some(*req);
            }
            c.closing = true;
            c.rx_start = c.rx_end;
            return;
        }
        Kind::Unsupported => return c.reply(req, Status::Unsupported),
        Kind::Broadcast => {
            let Some(update) = c.fe.take_broadcast(req) else {
                return c.reply(req, Status::Ok);
            };
            // Sent by the reactor once this connection has been serviced
            // (`Reactor::send_broadcasts`); answered when every other reactor acknowledged it.
            let seq = c.next_broadcast;
            c.next_broadcast = seq.wrapping_add(1);
            c.inflight += 1;
            c.broadcasts.push(Broadcast {
                req: *req,
                seq,
                update: Some(update),
                left: 0,
            });
            return;
        }
        Kind::Invalid => return c.reply(req, Status::Invalid),
        Kind::Copy => return copy(c, idx, req, payload_at, payload_len, sq),
        Kind::Cache | Kind::BlockStatus => {
            if let Err(st) = c.exec(req).check_range(req.offset, req.length) {
                return c.reply(req, st);
            }
            if req.kind == Kind::BlockStatus {
                return block_status(c, idx, req, sq);
            }
            // Advisory: nothing to prefetch into for memory, and files have the page cache.
            return c.reply(req, Status::Ok);
        }
    };
    if !client_slot_free(c, req, req) {
        return;
    }
    if let Err(st) = c.exec(req).admit(&block) {
        return c.reply(req, st);
    }
    let len = block.len;
    if req.is_write() && payload_len < len as usize {
        return hold_write(c, req, payload_at, payload_len as u32);
    }

    let framing = req.is_read().then(|| c.fe.read_framing(req));
    let chunked_framing = framing.and_then(ReadFraming::chunked);
    if let Some(framing) = chunked_framing {
        if c.inline(req) && read_mapped_chunked(c, req, &block, framing) {
            return;
        }
    }
    // A chunked READ reply is otherwise built from a slot's buffer even on inline exports, and
    // a long TRIM or WRITE_ZEROES runs in a slot there too: it gives the thread back between
    // its pieces.
    if c.inline(req) && chunked_framing.is_none() && c.exec(req).finishes_in_start(&block) {
        // mem:/null: the request completes inside start(); READ lands straight in the reply
        // buffer and WRITE is taken straight from the receive buffer: one copy each way.
        if let Some(ReadFraming::Contiguous { prefix, suffix }) = framing {
            if read_hole(c, req, &block) || read_mapped(c, req, &block, prefix, suffix) {
                return;
            }
            c.grow_tx(prefix + len as usize + suffix);
            let at = c.tx.len();
            // The prefix is zeroed, the data is not: the backend writes it straight into the
            // spare capacity and only then does the buffer grow over it.
            c.tx.resize(at + prefix, 0);
            c.tx.reserve(len as usize + suffix);
            // SAFETY: `reserve` made room for `len` bytes after the prefix.
            let buf = unsafe { c.tx.as_mut_ptr().add(at + prefix) };
            // SAFETY: the export completes inline, so the buffer is only used during the call.
            let status = match unsafe { c.exec(req).start(&block, buf, 0, sq) } {
                Outcome::Done(st) => st,
                Outcome::Pending(_) => unreachable!("inline exports finish in start"),
            };
            if status == Status::Ok {
                // SAFETY: the backend initialised all `len` bytes (it reported success).
                unsafe { c.tx.set_len(at + prefix + len as usize) };
                c.tx.resize(at + prefix + len as usize + suffix, 0);
                let (head, rest) = c.tx[at..].split_at_mut(prefix);
                let (data, tail) = rest.split_at_mut(len as usize);
                c.fe.finish_read_reply(req, head, data, tail);
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
        let status = match unsafe { c.exec(req).start(&block, buf, 0, sq) } {
            Outcome::Done(st) => st,
            Outcome::Pending(_) => unreachable!("inline exports finish in start"),
        };
        return c.reply(req, status);
    }

    // A backend that finishes later: the slot owns a buffer that lives until the completion.
    let slot = take_slot(c, req);
    if block.op.moves_data() {
        let align = c.exec(req).buffer_alignment();
        let b = slot_buffer(&mut c.slots, &mut c.bufs, &mut c.held, align, slot, len);
        if req.is_write() {
            b.as_mut_slice()[..len as usize]
                .copy_from_slice(&c.rx[payload_at..payload_at + len as usize]);
            c.held_in += len as usize;
        }
    }
    run_in_slot(c, idx, req, slot, sq);
}

/// A server-side COPY (PROTOCOL.md §13): checked, then run in its slot like any request the
/// backend may finish later; its data never passes through the connection.
fn copy(
    c: &mut Conn,
    idx: usize,
    req: &Req,
    payload_at: usize,
    payload_len: usize,
    sq: &mut Pusher<'_>,
) {
    let refused = req.refused();
    if !client_slot_free(c, req, &refused) {
        return;
    }
    let Some(desc) =
        c.fe.copy_descriptor(req, &c.rx[payload_at..payload_at + payload_len])
    else {
        return c.reply(&refused, Status::Invalid);
    };
    let source_is = c.fe.copy_source(&desc);
    let slot = take_slot(c, req);
    let tag = ud(KIND_IO, c.incarnation, idx, slot);
    let s = &mut c.slots[slot as usize];
    s.busy = true;
    s.req = Some(*req);
    match c.exec(req).start_copy(
        &desc,
        source_is.as_ref(),
        req.offset,
        req.length,
        req.flags,
        tag,
        sq,
    ) {
        Some(done) => settle_copy(c, slot, done),
        None => {
            c.copying = true;
            c.inflight += 1;
        }
    }
}

/// Whether the slot a client chose for `req` exists and is free (server-assigned slots always
/// are): a slot past the depth is answered INVALID (with `refused` as the request), one in
/// flight breaks the protocol and closes the queue.
fn client_slot_free(c: &mut Conn, req: &Req, refused: &Req) -> bool {
    let Some(s) = req.slot else {
        return true;
    };
    match c.slots.get(s as usize) {
        None => c.reply(refused, Status::Invalid),
        Some(slot) if slot.busy => c.violation(&format_args!("slot {s} reused while in flight")),
        Some(_) => return true,
    }
    false
}

/// Answers the COPY in `slot`: the reply's length is what it copied (PROTOCOL.md §13).
fn settle_copy(c: &mut Conn, slot: u16, done: Copied) {
    if let Some(req) = c.slots[slot as usize].req.as_mut() {
        req.length = done.bytes;
    }
    settle(c, slot, done.status);
}

/// The slot a request runs in: the client's, or a free one the server picks.
fn take_slot(c: &mut Conn, req: &Req) -> u16 {
    match req.slot {
        Some(s) => s,
        None => c
            .free_slots
            .pop()
            .expect("parse_frames checked for a free slot"),
    }
}

/// Gives the slot a buffer for `len` bytes, held until the slot is settled.
fn slot_buffer<'a>(
    slots: &'a mut [Slot],
    bufs: &mut Buffers,
    held: &mut usize,
    align: usize,
    slot: u16,
    len: u32,
) -> &'a mut AlignedBuf {
    let s = &mut slots[slot as usize];
    debug_assert!(s.buf.is_none(), "a slot gets one buffer per request");
    *held += len as usize;
    s.buf = Some(bufs.take(len as usize, align));
    s.buf.as_mut().expect("just set")
}

/// Runs `req` on the backend from `slot`, whose buffer holds a WRITE's data (or receives a
/// READ's); answers at once or marks the slot in flight.
fn run_in_slot(c: &mut Conn, idx: usize, req: &Req, slot: u16, sq: &mut Pusher<'_>) {
    let block = req.block().expect("a block request");
    let tag = ud(KIND_IO, c.incarnation, idx, slot);
    let buf = match c.slots[slot as usize].buf.as_mut() {
        Some(b) if block.op.moves_data() => b.as_mut_ptr(),
        _ => std::ptr::null_mut(),
    };
    let s = &mut c.slots[slot as usize];
    s.busy = true;
    s.req = Some(*req);
    // A WRITE that waited for its data or for memory may find its target fenced since
    // (`dispatch` checked it when it came): it must not land on a removed namespace.
    if c.targets.get(req.target as usize).is_none_or(|t| t.fenced) {
        return settle(c, slot, Status::NoExport);
    }
    // SAFETY: the slot's buffer holds `len` bytes and is neither freed nor touched until the
    // slot is released, which happens only once the result is delivered (a busy slot is never
    // reused, and a connection with slots in flight is never dropped).
    match unsafe { c.exec(req).start(&block, buf, tag, sq) } {
        Outcome::Done(status) => settle(c, slot, status),
        Outcome::Pending(started) => {
            c.slots[slot as usize].started = Some(started);
            c.inflight += 1;
        }
    }
}

/// A WRITE that came with `got` bytes of its data: it waits in a slot (with what it brought)
/// while the frontend asks the initiator for the rest. One that brought nothing waits without a
/// buffer while the memory budget cannot give it one (`run_deferred`).
fn hold_write(c: &mut Conn, req: &Req, payload_at: usize, got: u32) {
    let slot = take_slot(c, req);
    let s = &mut c.slots[slot as usize];
    s.busy = true;
    s.req = Some(*req);
    s.awaiting = Some(got);
    if got == 0 && !c.fe.data_follows(req) {
        c.deferred.push_back(slot);
        c.fe.parked(req, slot);
        return;
    }
    let align = c.exec(req).buffer_alignment();
    let b = slot_buffer(
        &mut c.slots,
        &mut c.bufs,
        &mut c.held,
        align,
        slot,
        req.length,
    );
    b.as_mut_slice()[..got as usize].copy_from_slice(&c.rx[payload_at..payload_at + got as usize]);
    c.held_in += req.length as usize;
    c.fe.solicit(req, slot, got, req.length - got, &mut c.tx);
}

/// The most data a write may bring and still run past the budget while writes wait for their
/// data (NVMe/TCP's in-capsule size is 8 KiB).
const SMALL_PAYLOAD: usize = 64 << 10;

/// Takes `req` (the first `len` bytes of rx) and answers it NO_MEMORY without running it: the
/// initiator retries it.
fn refuse_for_memory(c: &mut Conn, req: &Req, len: usize) {
    c.fe.taken(req);
    c.rx_start += len;
    c.stats().frames_in += 1;
    c.reply(&req.refused(), Status::NoMemory);
}

/// Whether writes wait in slots for data the initiator has yet to send (or for the memory to
/// ask for it).
pub(super) fn writes_wait(c: &Conn) -> bool {
    !c.deferred.is_empty() || c.slots.iter().any(|s| s.awaiting.is_some())
}

/// A request that must wait for memory while writes wait for their data: it waits in a slot
/// of its own (slots bound how many), queued behind the others waiting (`run_deferred`). The
/// frontend is told, so its task management can give it up before it runs (`Decoded::Release`).
fn park(c: &mut Conn, req: &Req) {
    let slot = take_slot(c, req);
    let s = &mut c.slots[slot as usize];
    s.busy = true;
    s.req = Some(*req);
    c.deferred.push_back(slot);
    c.fe.parked(req, slot);
}

/// A WRITE that brought `got` bytes of its data (at `payload_at` in rx) and must wait for
/// memory while writes wait for their data: it waits in a slot of its own, queued behind the
/// others waiting (`run_deferred`), with a buffer of only what it brought, so the memory it
/// holds meanwhile is bounded by what one write may bring (iSCSI: FirstBurstLength) and is
/// covered by the budget. If the budget cannot cover even that, it is refused (NO_MEMORY,
/// which the initiator retries) rather than held past the budget. What `dispatch` would
/// refuse at once is refused now, before its data is copied.
fn park_with_data(c: &mut Conn, req: &Req, payload_at: usize, got: usize) {
    if c.targets.get(req.target as usize).is_none_or(|t| t.fenced) {
        return c.reply(&req.refused(), Status::NoExport);
    }
    let block = req.block().expect("a block request");
    if let Err(st) = c.exec(req).admit(&block) {
        return c.reply(req, st);
    }
    if !c.covers_buffer(0, got) {
        return c.reply(req, Status::NoMemory);
    }
    let align = c.exec(req).buffer_alignment();
    let mut brought = c.bufs.take(got, align);
    brought.as_mut_slice()[..got].copy_from_slice(&c.rx[payload_at..payload_at + got]);
    c.held += got;
    c.held_in += got;
    let slot = take_slot(c, req);
    let s = &mut c.slots[slot as usize];
    s.busy = true;
    s.req = Some(*req);
    s.awaiting = Some(got as u32);
    s.brought = Some(brought);
    c.deferred.push_back(slot);
    c.fe.parked(req, slot);
}

/// Runs what waits for memory in slots, oldest first, as far as the memory budget covers it:
/// WRITEs that came without all their data get their buffers and their solicitation (those
/// that brought all of it run); parked requests are dispatched. The rest wait for memory a
/// completion frees (the connection is then starved and retried).
fn run_deferred(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    while let Some(&slot) = c.deferred.front() {
        let s = &c.slots[slot as usize];
        let Some(req) = s.req else {
            c.deferred.pop_front();
            continue;
        };
        if s.awaiting.is_none() {
            // Parked: it runs as if it had just arrived, in the slot it gives back.
            match request_cover(c, &req, 0) {
                Cover::Yes => {}
                Cover::Wait => return,
                // It cannot fit the connection's share as things are now (the receive buffer
                // grew for a large PDU since it was parked): answered NO_MEMORY (the initiator
                // retries it) rather than holding up every request queued behind it.
                Cover::Never => {
                    c.deferred.pop_front();
                    c.fe.unparked(slot);
                    let s = &mut c.slots[slot as usize];
                    s.busy = false;
                    s.req = None;
                    release_slot(c, slot);
                    c.reply(&req.refused(), Status::NoMemory);
                    continue;
                }
            }
            c.deferred.pop_front();
            c.fe.unparked(slot);
            let s = &mut c.slots[slot as usize];
            s.busy = false;
            s.req = None;
            release_slot(c, slot);
            dispatch(c, idx, &req, 0, 0, sq);
            continue;
        }
        let len = req.length as usize;
        let got = s.awaiting.unwrap_or(0);
        // One that brought all its data runs from the buffer that holds it: nothing to add.
        let whole = got as usize >= len;
        let need = if whole { 0 } else { len };
        if need > 0 && c.least_held() + need > c.mem.cap() {
            // Its buffer cannot fit the connection's share beside the receive buffer it
            // needs: answered NO_MEMORY rather than holding up the queue.
            c.deferred.pop_front();
            c.fe.unparked(slot);
            release_held(c, slot);
            c.reply(&req.refused(), Status::NoMemory);
            continue;
        }
        if !c.covers_buffer(0, need) {
            return;
        }
        c.deferred.pop_front();
        c.fe.unparked(slot);
        if whole {
            let s = &mut c.slots[slot as usize];
            s.buf = s.brought.take();
            s.awaiting = None;
            run_in_slot(c, idx, &req, slot, sq);
            continue;
        }
        let brought = c.slots[slot as usize].brought.take();
        let align = c.exec(&req).buffer_alignment();
        let buf = slot_buffer(
            &mut c.slots,
            &mut c.bufs,
            &mut c.held,
            align,
            slot,
            req.length,
        );
        c.held_in += len;
        if let Some(b) = brought {
            buf.as_mut_slice()[..got as usize].copy_from_slice(&b.as_slice()[..got as usize]);
            c.held -= got as usize;
            c.held_in -= got as usize;
            c.bufs.give_back(b);
        }
        // Data the frontend holds itself needs no solicitation.
        if got == 0 && c.fe.fill(&req, &mut buf.as_mut_slice()[..len]) {
            c.slots[slot as usize].awaiting = None;
            run_in_slot(c, idx, &req, slot, sq);
            continue;
        }
        c.fe.solicit(&req, slot, got, req.length - got, &mut c.tx);
    }
}

/// Solicited data for the WRITE waiting in `slot`: stored in order; once all of it is in, the
/// write runs. Data for a slot that waits for none, out of order or past the write's end
/// breaks the protocol.
fn take_data(
    c: &mut Conn,
    idx: usize,
    slot: u16,
    offset: u32,
    payload_at: usize,
    payload_len: usize,
    sq: &mut Pusher<'_>,
) {
    let waiting = c
        .slots
        .get(slot as usize)
        .filter(|s| s.buf.is_some())
        .and_then(|s| Some((s.awaiting?, s.req?)));
    let Some((got, req)) = waiting else {
        return c.violation(&format_args!("data for slot {slot}, which waits for none"));
    };
    let end = offset as u64 + payload_len as u64;
    if offset != got || end > req.length as u64 {
        return c.violation(&format_args!(
            "data for slot {slot} at {offset}+{payload_len}: expected it at {got}, within {}",
            req.length
        ));
    }
    let s = &mut c.slots[slot as usize];
    let buf = s.buf.as_mut().expect("a held write has a buffer");
    buf.as_mut_slice()[offset as usize..end as usize]
        .copy_from_slice(&c.rx[payload_at..payload_at + payload_len]);
    if end < req.length as u64 {
        s.awaiting = Some(end as u32);
        return;
    }
    s.awaiting = None;
    run_in_slot(c, idx, &req, slot, sq);
}

/// Answers a large READ from an inline export by sending its data from the export's memory
/// when all of it is there (mem:): the data is copied once, into the socket, instead of into
/// `tx` first. Not under TLS (which seals what `tx` holds) nor when a data digest follows the
/// data (`read_suffix_digests`: it would be computed now over bytes the kernel reads later); a
/// suffix that does not depend on the data (NVMe/TCP's CapsuleResp) follows it from `tx`.
fn read_mapped(
    c: &mut Conn,
    req: &Req,
    block: &BlockRequest,
    prefix: usize,
    suffix: usize,
) -> bool {
    let len = block.len as usize;
    if c.tls.is_some() || (suffix != 0 && c.fe.read_suffix_digests(req)) {
        return false;
    }
    let Some(data) = c.exec(req).read_mapped(block) else {
        return false;
    };
    c.grow_tx(prefix + suffix);
    let at = c.tx.len();
    c.tx.resize(at + prefix + suffix, 0);
    // SAFETY: `len` bytes at `data` stay mapped while the connection holds its targets.
    let bytes = unsafe { std::slice::from_raw_parts(data, len) };
    let (head, tail) = c.tx[at..].split_at_mut(prefix);
    c.fe.finish_read_reply(req, head, bytes, tail);
    c.queue_mapped(at + prefix, data, len);
    c.count_reply(Status::Ok);
    true
}

/// `read_mapped` for a reply with headers between pieces of its data (iSCSI Data-In PDUs):
/// each piece goes out from the export's memory (`StreamFrontend::encode_read_framing`). Not
/// when a data digest follows a piece, for the reason `read_mapped` gives.
fn read_mapped_chunked(c: &mut Conn, req: &Req, block: &BlockRequest, framing: usize) -> bool {
    let len = block.len as usize;
    if c.tls.is_some() || len < SEND_IN_PLACE || c.fe.read_suffix_digests(req) {
        return false;
    }
    // Counted only once the frontend framed it: otherwise the slot's path reads and counts it.
    let started = Started::now();
    let Some(data) = c.exec(req).mapped(block) else {
        return false;
    };
    // SAFETY: `len` bytes at `data` stay mapped while the connection holds its targets; the
    // frontend only reads them to find the pieces (no digest is computed over them).
    let Some(pieces) = (unsafe { frame_chunked(c, req, data, len, framing) }) else {
        return false;
    };
    c.check_pieces(&pieces, len);
    for p in &pieces {
        // SAFETY: inside the `len` mapped bytes (`check_pieces`).
        c.queue_mapped(p.at, unsafe { data.add(p.from) }, p.len);
    }
    c.pieces = pieces;
    c.exec(req).mapped_read_done(block, started);
    c.count_reply(Status::Ok);
    true
}

/// Has the frontend frame a chunked READ reply of the `len` bytes at `data` in pieces
/// (`StreamFrontend::encode_read_framing`): its headers, at most `framing` bytes
/// (`ReadFraming::Chunked`), go into `tx`, and the pieces come back
/// in the connection's own vector, to be put back in `c.pieces` once queued. `None` when the
/// frontend does not frame this reply (nothing written).
///
/// # Safety
///
/// `data` must be readable for `len` bytes during the call.
unsafe fn frame_chunked(
    c: &mut Conn,
    req: &Req,
    data: *const u8,
    len: usize,
    framing: usize,
) -> Option<Vec<Piece>> {
    let mut pieces = std::mem::take(&mut c.pieces);
    pieces.clear();
    c.grow_tx(framing.max(REPLY_SLACK));
    // SAFETY: readable for `len` bytes (the caller's promise).
    let bytes = unsafe { std::slice::from_raw_parts(data, len) };
    if c.fe.encode_read_framing(req, bytes, &mut c.tx, &mut pieces) {
        Some(pieces)
    } else {
        c.pieces = pieces;
        None
    }
}

/// A READ of a range that is all hole, for frontends that can say so without the zeros. Only
/// for large reads, where saving the data is worth an allocation query.
fn read_hole(c: &mut Conn, req: &Req, block: &BlockRequest) -> bool {
    if !c.fe.replies_with_holes() || req.length < (64 << 10) {
        return false;
    }
    let started = Started::now();
    let mut extents = std::mem::take(&mut c.extents);
    let counted = list_bytes(&extents);
    extents.clear();
    // One extent says it: a hole that covers the range.
    c.exec(req)
        .export()
        .backend()
        .allocation(req.offset, req.length as u64, 1, &mut extents);
    let hole = extents.len() == 1 && extents[0].hole && extents[0].len >= req.length as u64;
    c.rest_list(&mut extents, counted);
    c.extents = extents;
    if hole {
        c.fe.hole_reply(req, &mut c.tx);
        // A READ served as any other: counted, its bytes and latency too.
        c.exec(req).mapped_read_done(block, started);
        c.count_reply(Status::Ok);
    }
    hole
}

/// A WRITE whose data will not come, or a request parked for memory (the initiator aborted
/// it): its slot and buffer go back, and it never runs nor is answered. Anything else in the
/// slot (a request that left the wait and runs, or completed meanwhile) is left.
fn release_held(c: &mut Conn, slot: u16) {
    // A parked request that brought no data waits in `deferred` with nothing in `awaiting`.
    let parked = c.deferred.contains(&slot);
    let Some(s) = c.slots.get_mut(slot as usize) else {
        return;
    };
    if !s.busy || (s.awaiting.is_none() && !parked) {
        return;
    }
    let len = s.req.map_or(0, |r| r.length as usize);
    // (Only a WRITE holds data here: a parked request of another kind has no buffer yet.)
    let inbound = if s.req.is_some_and(|r| r.is_write()) {
        len
    } else {
        0
    };
    let got = s.awaiting.take().unwrap_or(0) as usize;
    s.busy = false;
    s.req = None;
    let brought = s.brought.take();
    if let Some(buf) = s.buf.take() {
        c.held -= len;
        c.held_in -= inbound;
        c.bufs.give_back(buf);
    }
    // A write that still waited for memory holds only what it brought.
    if let Some(b) = brought {
        c.held -= got;
        c.held_in -= got;
        c.bufs.give_back(b);
    }
    c.deferred.retain(|&d| d != slot);
    release_slot(c, slot);
}

/// Returns a server-assigned slot to the free list (client-assigned slots are the client's).
fn release_slot(c: &mut Conn, slot: u16) {
    if c.fe.server_assigns_slots() {
        c.free_slots.push(slot);
    }
}

/// An allocation query: holes are unallocated ranges that read as zero. Exports that complete
/// inline answer on this thread into the connection's scratch list; the others may run the
/// query on their own threads, so it takes a slot whose list outlives it. Either list is
/// emptied and shrunk once answered (`Conn::rest_list`): a 1 MiB map is not kept per slot.
fn block_status(c: &mut Conn, idx: usize, req: &Req, sq: &mut Pusher<'_>) {
    let max = query_extents(c, req);
    if c.inline(req) {
        let mut extents = std::mem::take(&mut c.extents);
        let counted = list_bytes(&extents);
        extents.clear();
        // SAFETY: `extents` is ours for the call, and an inline export answers inside it.
        let status = match unsafe {
            c.exec(req)
                .start_allocation(req.offset, req.length, max, &mut extents, 0, sq)
        } {
            Outcome::Done(st) => st,
            Outcome::Pending(()) => unreachable!("inline exports answer allocation queries inline"),
        };
        answer_block_status(c, req, status, &extents);
        c.rest_list(&mut extents, counted);
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
    let before = list_bytes(&s.extents);
    s.extents.clear();
    // Room for all the backend may append (`max`), reserved now and counted until answered:
    // the backend's thread fills it without growing it.
    s.extents.reserve_exact(max);
    let counted = list_bytes(&s.extents);
    s.list_held = counted;
    c.lists = c.lists - before + counted;
    let out: *mut Vec<Extent> = &mut s.extents;
    // SAFETY: the slot's list is neither touched nor freed until the slot is released, which
    // happens only once the result is delivered (a connection with slots in flight is never
    // dropped).
    match unsafe {
        c.exec(req)
            .start_allocation(req.offset, req.length, max, out, tag, sq)
    } {
        Outcome::Done(status) => {
            let mut extents = std::mem::take(&mut c.slots[slot as usize].extents);
            c.slots[slot as usize].list_held = 0;
            release_slot(c, slot);
            answer_block_status(c, req, status, &extents);
            c.rest_list(&mut extents, counted);
            c.slots[slot as usize].extents = extents;
        }
        Outcome::Pending(()) => {
            // Its reply is held against the high-water mark and the budget until it is
            // appended (`settle`), as a READ's data is.
            let reply = block_status_bound(c, req);
            c.held += reply;
            let s = &mut c.slots[slot as usize];
            s.reply_held = reply;
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
    // At most what the budget covered (`covers_block_status`), whatever a backend returned:
    // a prefix of the map is an answer too.
    let extents = &extents[..extents.len().min(query_extents(c, req))];
    c.grow_tx(c.fe.block_status_len(req, extents.len()));
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

/// One more reactor installed the update of broadcast `seq` (or, with `acks` 0, the count is
/// settled as it stands): answers the request once none is left to come.
pub(super) fn broadcast_acked(c: &mut Conn, seq: u32, acks: usize) {
    let Some(at) = c.broadcasts.iter().position(|b| b.seq == seq) else {
        return;
    };
    let b = &mut c.broadcasts[at];
    b.left = b.left.saturating_sub(acks);
    if b.left > 0 || b.update.is_some() {
        return;
    }
    let b = c.broadcasts.remove(at);
    c.inflight -= 1;
    c.reply(&b.req, Status::Ok);
}

/// A ring completion for a slot's request; more may be needed before it is finished.
pub(super) fn complete(c: &mut Conn, slot: u16, tag: u64, res: i32, sq: &mut Pusher<'_>) {
    let Some(req) = c
        .slots
        .get(slot as usize)
        .filter(|s| s.busy)
        .and_then(|s| s.req)
    else {
        return;
    };
    if let Some(res) = c.exec(&req).complete(tag, res, sq) {
        finish_result(c, slot, tag, res);
    }
}

/// A finished request's backend result (from a thread-completing backend); `tag` is the one
/// it was started with.
pub(super) fn finish_result(c: &mut Conn, slot: u16, tag: u64, res: i32) {
    let Some(s) = c.slots.get_mut(slot as usize).filter(|s| s.busy) else {
        return;
    };
    let Some(req) = s.req else {
        return;
    };
    if req.kind == Kind::Copy {
        let done = c.exec(&req).copy_status(tag, res, req.length);
        c.copying = false;
        c.inflight -= 1;
        return settle_copy(c, slot, done);
    }
    // A block request started on the backend has its start time; an allocation query has
    // neither.
    let status = match (req.block(), s.started.take()) {
        (Some(block), Some(started)) => c.targets[req.target as usize]
            .exec
            .status(&block, tag, res, started),
        _ => result_status(res),
    };
    finish(c, slot, status);
}

/// A request that was in flight on the backend finished: answer it.
fn finish(c: &mut Conn, slot: u16, status: Status) {
    c.inflight -= 1;
    settle(c, slot, status);
}

/// Answers the request held in `slot` (a READ with the data in the slot's buffer) and frees
/// the slot.
fn settle(c: &mut Conn, slot: u16, status: Status) {
    let s = &mut c.slots[slot as usize];
    s.busy = false;
    let req = s.req.take().expect("busy slot has a request");
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
        c.held -= std::mem::take(&mut c.slots[slot as usize].reply_held);
        let mut extents = std::mem::take(&mut c.slots[slot as usize].extents);
        let counted = std::mem::take(&mut c.slots[slot as usize].list_held);
        answer_block_status(c, &req, status, &extents);
        c.rest_list(&mut extents, counted);
        c.slots[slot as usize].extents = extents;
    } else if req.is_read() && status == Status::Ok {
        let len = req.length as usize;
        let framing = c.fe.read_framing(&req);
        if let ReadFraming::Contiguous { prefix, suffix } = framing {
            if c.tls.is_none() && len >= SEND_IN_PLACE {
                // The data goes out from its buffer; only the framing is copied.
                c.grow_tx(prefix + suffix);
                let at = c.tx.len();
                c.tx.resize(at + prefix + suffix, 0);
                let buf = c.slots[slot as usize].buf.take().expect("read buffer");
                let (head, tail) = c.tx[at..].split_at_mut(prefix);
                c.fe.finish_read_reply(&req, head, &buf.as_slice()[..len], tail);
                // The data goes between the two: the suffix (a digest) follows it on the wire.
                c.queue_data(at + prefix, buf, len);
                c.count_reply(status);
                return;
            }
        }
        let in_pieces = framing
            .chunked()
            .filter(|_| c.tls.is_none() && len >= SEND_IN_PLACE);
        if let Some(framing) = in_pieces {
            // Headers between the pieces of the data (iSCSI Data-In PDUs): only they are
            // copied; the data goes out from its buffer, piece by piece.
            let data = c.slots[slot as usize]
                .buf
                .as_ref()
                .expect("read buffer")
                .as_slice()
                .as_ptr();
            // SAFETY: the slot's buffer holds the `len` bytes read and stays in the slot.
            if let Some(pieces) = unsafe { frame_chunked(c, &req, data, len, framing) } {
                let buf = c.slots[slot as usize].buf.take().expect("read buffer");
                if pieces.is_empty() {
                    c.held -= len;
                    c.bufs.give_back(buf);
                } else {
                    c.queue_pieces(buf, &pieces, len);
                }
                c.pieces = pieces;
                c.count_reply(status);
                return;
            }
        }
        // Grown as the budget check before the request foresaw (`covers_request`).
        c.grow_tx(match framing {
            ReadFraming::Contiguous { prefix, suffix } => prefix + len + suffix,
            ReadFraming::Chunked { framing } => len + framing.max(REPLY_SLACK),
        });
        let data = &c.slots[slot as usize]
            .buf
            .as_ref()
            .expect("read buffer")
            .as_slice()[..len];
        match framing {
            ReadFraming::Contiguous { prefix, suffix } => {
                let at = c.tx.len();
                c.tx.resize(at + prefix, 0);
                c.tx.extend_from_slice(data);
                c.tx.resize(at + prefix + len + suffix, 0);
                let (head, rest) = c.tx[at..].split_at_mut(prefix);
                let (data, tail) = rest.split_at_mut(len);
                c.fe.finish_read_reply(&req, head, data, tail);
            }
            ReadFraming::Chunked { .. } => c.fe.encode_read(&req, data, &mut c.tx),
        }
        c.count_reply(status);
    } else {
        c.reply(&req, status);
    }
    if let Some(buf) = c.slots[slot as usize].buf.take() {
        c.held -= req.length as usize;
        if req.is_write() {
            c.held_in -= req.length as usize;
        }
        c.bufs.give_back(buf);
    }
}

#[cfg(test)]
mod tests {
    //! The request path with a toy frontend that, like NVMe/TCP and iSCSI, takes WRITEs without
    //! their data, asks for it (`solicit`), receives it in separate messages (`Decoded::Data`)
    //! and answers pings itself (`Decoded::Answered`). A READ whose cookie has bit 62 set is
    //! answered without the digest after its data. A WRITE whose cookie has bit 63 set is
    //! followed by data it was not asked for (`data_follows`). Messages (little-endian):
    //! `W cookie:u64 offset:u64 length:u32 inline:u32 data[inline]`, `R cookie offset length`,
    //! `D slot:u16 offset:u32 n:u32 data[n]`, `P`. It writes `T slot offset len` (solicit),
    //! `S cookie status:u16` (reply), `p` (ping answer), and READ data either contiguous
    //! (`S cookie 0`, the data, its CRC32C: a data digest) or chunked (`C n:u32 data[n]` per
    //! 1000 bytes, then `S cookie 0`).
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use blkwire_backend::{BlockOp, Export, ExportSpec, IoFlags};
    use blkwire_wire::Status;

    use super::super::conn::{list_bytes, Conn, Slot};
    use super::super::ring::{Pusher, Ring};
    use super::{parse_frames, MAX_BROADCASTS};
    use crate::budget::{Account, Budget};
    use crate::executor::Executor;
    use crate::frontend::{Decoded, Kind, ReadFraming, Req, StreamFrontend};

    struct Toy {
        chunked: bool,
        /// Large READs of a hole are answered `H cookie`, without their zeros.
        holes: bool,
        /// Further slots the last `X` released (`next_release`).
        releases: Vec<u16>,
        /// The requests the reactor said wait for memory (`parked`), as (cookie, slot), until
        /// it says they left the wait (`unparked`); listed by `K`.
        parked: Vec<(u64, u16)>,
    }

    fn u32_at(b: &[u8], i: usize) -> u32 {
        u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], i: usize) -> u64 {
        u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
    }

    /// The toy's request of `kind` at the front of `rx`: `op cookie offset length`.
    fn request(kind: Kind, rx: &[u8]) -> Req {
        Req {
            kind,
            offset: u64_at(rx, 9),
            length: u32_at(rx, 17),
            flags: IoFlags::empty().with(IoFlags::REQ_ONE, u64_at(rx, 1) as u128 & REQ_ONE != 0),
            slot: None,
            cookie: u64_at(rx, 1) as u128,
            target: 0,
        }
    }

    impl StreamFrontend for Toy {
        fn replies_with_holes(&self) -> bool {
            self.holes
        }
        fn hole_reply(&self, req: &Req, tx: &mut Vec<u8>) {
            tx.push(b'H');
            tx.extend_from_slice(&(req.cookie as u64).to_le_bytes());
        }
        fn decode(&mut self, rx: &[u8], tx: &mut Vec<u8>) -> Decoded {
            let need = |n: usize| {
                if rx.len() < n {
                    Some(Decoded::Need(n))
                } else {
                    None
                }
            };
            // `X cookie offset length` and `payload` bytes: a request of `kind`.
            let fixed = |kind, payload: usize| match need(21 + payload) {
                Some(n) => n,
                None => Decoded::Request {
                    req: request(kind, rx),
                    len: 21 + payload,
                    payload_len: payload,
                    trailer: 0,
                },
            };
            match rx.first() {
                None => Decoded::Need(1),
                // `T n` in front of a request: it addresses the connection's target n.
                Some(b'T') => {
                    if let Some(n) = need(2) {
                        return n;
                    }
                    match self.decode(&rx[2..], tx) {
                        Decoded::Request {
                            mut req,
                            len,
                            payload_len,
                            trailer,
                        } => {
                            req.target = rx[1];
                            Decoded::Request {
                                req,
                                len: len + 2,
                                payload_len,
                                trailer,
                            }
                        }
                        Decoded::Need(n) => Decoded::Need(n + 2),
                        _ => Decoded::Violation("T before something else than a request".into()),
                    }
                }
                // `B cookie`: a state change the other reactors must see first.
                Some(b'B') => {
                    if let Some(n) = need(9) {
                        return n;
                    }
                    Decoded::Request {
                        req: Req::broadcast(0, u64_at(rx, 1) as u128),
                        len: 9,
                        payload_len: 0,
                        trailer: 0,
                    }
                }
                Some(b'P') => {
                    tx.push(b'p');
                    Decoded::Answered { len: 1 }
                }
                // Answered with nothing (as an iSCSI NOP-Out that asks for no NOP-In).
                Some(b'N') => Decoded::Answered { len: 1 },
                // `E n:u32 data[n]`: echoed as `e data` (as an iSCSI NOP-In its ping data).
                Some(b'E') => {
                    if let Some(n) = need(5) {
                        return n;
                    }
                    let n = u32_at(rx, 1) as usize;
                    if let Some(m) = need(5 + n) {
                        return m;
                    }
                    tx.push(b'e');
                    tx.extend_from_slice(&rx[5..5 + n]);
                    Decoded::Answered { len: 5 + n }
                }
                // `A slot`: the request waiting in `slot` given up (iSCSI ABORT TASK).
                Some(b'A') => {
                    if let Some(n) = need(3) {
                        return n;
                    }
                    let slot = u16::from_le_bytes([rx[1], rx[2]]);
                    // No longer a task of the frontend's, as iSCSI's `tmf` forgets it.
                    self.parked.retain(|&(_, s)| s != slot);
                    Decoded::Release { slot, len: 3 }
                }
                // `K`: the requests parked for memory, as `k n:u8 (cookie:u64 slot:u16)...`.
                Some(b'K') => {
                    tx.push(b'k');
                    tx.push(self.parked.len() as u8);
                    for &(cookie, slot) in &self.parked {
                        tx.extend_from_slice(&cookie.to_le_bytes());
                        tx.extend_from_slice(&slot.to_le_bytes());
                    }
                    Decoded::Answered { len: 1 }
                }
                // `X n:u8 slot:u16...`: n writes released at once (iSCSI ABORT TASK SET).
                Some(b'X') => {
                    if let Some(n) = need(2) {
                        return n;
                    }
                    let n = rx[1] as usize;
                    if let Some(m) = need(2 + 2 * n) {
                        return m;
                    }
                    self.releases = rx[2..2 + 2 * n]
                        .chunks(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    match self.releases.pop() {
                        Some(slot) => Decoded::Release {
                            slot,
                            len: 2 + 2 * n,
                        },
                        None => Decoded::Answered { len: 2 },
                    }
                }
                // `Q cookie offset length`: an allocation query.
                Some(b'Q') => {
                    if let Some(n) = need(21) {
                        return n;
                    }
                    let req = request(Kind::BlockStatus, rx);
                    Decoded::Request {
                        req,
                        len: 21,
                        payload_len: 0,
                        trailer: 0,
                    }
                }
                Some(op @ (b'W' | b'R')) => {
                    let hdr = if *op == b'W' { 25 } else { 21 };
                    if let Some(n) = need(hdr) {
                        return n;
                    }
                    let inline = if *op == b'W' {
                        u32_at(rx, 21) as usize
                    } else {
                        0
                    };
                    if let Some(n) = need(hdr + inline) {
                        return n;
                    }
                    let kind = if *op == b'W' {
                        BlockOp::Write
                    } else {
                        BlockOp::Read
                    };
                    let req = request(Kind::Block(kind), rx);
                    Decoded::Request {
                        req,
                        len: hdr + inline,
                        payload_len: inline,
                        trailer: 0,
                    }
                }
                // `O cookie offset length`: a LOGOUT.
                Some(b'O') => fixed(Kind::Logout, 0),
                // `Y cookie offset length` and 8 bytes: a COPY with its descriptor (NVMe/TCP's
                // Copy carries its ranges as payload).
                Some(b'Y') => fixed(Kind::Copy, 8),
                // `L cookie offset length`: a READ decoded from a message that needs no free
                // slot (`next_is_data`), as iSCSI's Data-Out that completes a parameter list
                // makes the command's first part (a VERIFY's read, say).
                Some(b'L') => fixed(Kind::Block(BlockOp::Read), 0),
                Some(b'D') => {
                    if let Some(n) = need(11) {
                        return n;
                    }
                    let n = u32_at(rx, 7) as usize;
                    if let Some(m) = need(11 + n) {
                        return m;
                    }
                    Decoded::Data {
                        slot: u16::from_le_bytes([rx[1], rx[2]]),
                        offset: u32_at(rx, 3),
                        len: 11 + n,
                        payload_len: n,
                        trailer: 0,
                    }
                }
                Some(x) => Decoded::Violation(format!("unknown message {x}")),
            }
        }
        fn server_assigns_slots(&self) -> bool {
            true
        }
        fn take_broadcast(&mut self, _req: &Req) -> Option<Arc<crate::reservations::Update>> {
            Some(Arc::new(crate::reservations::Update {
                lu: 0,
                version: 1,
                snapshot: None,
            }))
        }
        /// `B` too, as iSCSI's Data-Out that completes a PERSISTENT RESERVE OUT's parameter
        /// list makes its broadcast.
        fn next_is_data(&self, rx: &[u8]) -> bool {
            matches!(rx.first(), Some(b'D' | b'L' | b'B'))
        }
        fn reply_bound(&self, rx: &[u8]) -> usize {
            match rx {
                [b'E', n @ ..] if n.len() >= 4 => 1 + u32_at(n, 0) as usize,
                _ => 0,
            }
        }
        fn data_follows(&self, req: &Req) -> bool {
            req.cookie & FOLLOWS != 0
        }
        fn read_framing(&self, req: &Req) -> ReadFraming {
            if self.chunked {
                // `C n` before each piece of at most 1000 bytes, then `S cookie status`.
                ReadFraming::Chunked {
                    framing: (req.length as usize).div_ceil(1000) * 5 + 11,
                }
            } else {
                ReadFraming::Contiguous {
                    prefix: 11,
                    suffix: if req.cookie & TRAILER != 0 {
                        TRAILER_BYTES.len()
                    } else if req.cookie & NO_DIGEST != 0 {
                        0
                    } else {
                        4
                    },
                }
            }
        }
        fn read_suffix_digests(&self, req: &Req) -> bool {
            req.cookie & TRAILER == 0
        }
        fn finish_read_reply(
            &mut self,
            req: &Req,
            prefix: &mut [u8],
            data: &[u8],
            suffix: &mut [u8],
        ) {
            prefix[0] = b'S';
            prefix[1..9].copy_from_slice(&(req.cookie as u64).to_le_bytes());
            prefix[9..11].copy_from_slice(&0u16.to_le_bytes());
            if req.cookie & TRAILER != 0 {
                suffix.copy_from_slice(TRAILER_BYTES);
            } else if !suffix.is_empty() {
                suffix.copy_from_slice(&blkwire_wire::crc::crc32c(data).to_le_bytes());
            }
        }
        fn encode_read_framing(
            &mut self,
            req: &Req,
            data: &[u8],
            tx: &mut Vec<u8>,
            pieces: &mut Vec<crate::frontend::Piece>,
        ) -> bool {
            if req.cookie & NO_PIECES != 0 {
                return false;
            }
            for (i, piece) in data.chunks(1000).enumerate() {
                tx.push(b'C');
                tx.extend_from_slice(&(piece.len() as u32).to_le_bytes());
                pieces.push(crate::frontend::Piece {
                    at: tx.len(),
                    from: i * 1000,
                    len: piece.len(),
                });
            }
            self.reply(req, Status::Ok, tx);
            true
        }
        fn encode_read(&mut self, req: &Req, data: &[u8], tx: &mut Vec<u8>) {
            for piece in data.chunks(1000) {
                tx.push(b'C');
                tx.extend_from_slice(&(piece.len() as u32).to_le_bytes());
                tx.extend_from_slice(piece);
            }
            self.reply(req, Status::Ok, tx);
        }
        fn reply(&mut self, req: &Req, status: Status, tx: &mut Vec<u8>) -> bool {
            tx.push(b'S');
            tx.extend_from_slice(&(req.cookie as u64).to_le_bytes());
            tx.extend_from_slice(&(status as u16).to_le_bytes());
            true
        }
        fn block_status_len(&self, _req: &Req, extents: usize) -> usize {
            13 + 8 * extents
        }
        /// `E cookie count`, then each extent's length and hole flag (u32 each, as NBD's).
        fn block_status_reply(
            &mut self,
            req: &Req,
            extents: &[(u32, bool)],
            tx: &mut Vec<u8>,
        ) -> bool {
            tx.push(b'E');
            tx.extend_from_slice(&(req.cookie as u64).to_le_bytes());
            tx.extend_from_slice(&(extents.len() as u32).to_le_bytes());
            for &(len, hole) in extents {
                tx.extend_from_slice(&len.to_le_bytes());
                tx.extend_from_slice(&u32::from(hole).to_le_bytes());
            }
            true
        }
        fn next_release(&mut self) -> Option<u16> {
            self.releases.pop()
        }
        fn parked(&mut self, req: &Req, slot: u16) {
            self.parked.push((req.cookie as u64, slot));
        }
        fn unparked(&mut self, slot: u16) {
            self.parked.retain(|&(_, s)| s != slot);
        }
        fn solicit(&mut self, _req: &Req, slot: u16, offset: u32, len: u32, tx: &mut Vec<u8>) {
            tx.push(b'T');
            tx.extend_from_slice(&slot.to_le_bytes());
            tx.extend_from_slice(&offset.to_le_bytes());
            tx.extend_from_slice(&len.to_le_bytes());
        }
    }

    /// Cookie bit: the toy's WRITE is followed by unsolicited data.
    const FOLLOWS: u128 = 1 << 63;
    /// A READ whose cookie has this bit is answered without a digest after its data.
    const NO_DIGEST: u128 = 1 << 62;
    /// A READ whose cookie has this bit is answered with `TRAILER_BYTES` after its data, which
    /// do not depend on it (as NVMe/TCP's CapsuleResp after a C2HData PDU).
    const TRAILER: u128 = 1 << 61;
    const TRAILER_BYTES: &[u8] = b"END";
    /// A chunked READ whose cookie has this bit is not framed in pieces: `encode_read` copies.
    const NO_PIECES: u128 = 1 << 60;
    /// An allocation query whose cookie has this bit asks for one extent (NBD's REQ_ONE).
    const REQ_ONE: u128 = 1 << 59;

    fn conn(spec: &str) -> (Conn, UnixStream) {
        conn_with(spec, false)
    }

    fn conn_with(spec: &str, chunked: bool) -> (Conn, UnixStream) {
        conn_budget(spec, chunked, 1 << 30)
    }

    /// A connection of two targets (exports `spec0` and `spec1`, sessions 1 and 2), as an
    /// NVMe/TCP I/O queue of a controller with two namespaces is.
    fn conn_two(spec0: &str, spec1: &str) -> (Conn, UnixStream) {
        let (mut c, b) = conn_budget(spec0, false, 1 << 30);
        let export = Arc::new(Export::open(&ExportSpec::parse(spec1).unwrap()).unwrap());
        let size = export.size();
        let exec = Executor::open(export, 1 << 20, size).unwrap();
        c.targets.push(super::super::conn::Target {
            inline: exec.completes_inline(),
            exec,
            session: 2,
            queue: 0,
            fenced: false,
            _floor: None,
        });
        (c, b)
    }

    fn to(target: u8, msg: Vec<u8>) -> Vec<u8> {
        let mut m = vec![b'T', target];
        m.extend_from_slice(&msg);
        m
    }

    /// Requests reach the export their target names; a fenced target (its session closed) and
    /// a target the connection does not have get NO_EXPORT, and the other target goes on.
    #[test]
    fn requests_go_to_their_target_and_a_fenced_one_runs_nothing() {
        for async1 in [false, true] {
            let mut ring = Ring::new(8).unwrap();
            let spec1 = if async1 { "b=memthread:1M" } else { "b=mem:1M" };
            let (mut c, _peer) = conn_two("a=mem:1M", spec1);
            let d = vec![7u8; 4096];
            feed(&mut c, &mut ring, &to(1, write(1, 0, 4096, &d)));
            settle_target(&mut c, &mut ring, 1);
            assert_eq!(take_tx(&mut c), status_reply(1, Status::Ok), "{spec1}");
            feed(&mut c, &mut ring, &to(0, read(2, 0, 4096)));
            let tx = take_tx(&mut c);
            assert!(
                tx[11..11 + 4096].iter().all(|&b| b == 0),
                "target 0 untouched"
            );
            feed(&mut c, &mut ring, &to(1, read(3, 0, 4096)));
            settle_target(&mut c, &mut ring, 1);
            let tx = take_tx(&mut c);
            assert_eq!(tx[11..11 + 4096], d[..], "{spec1}: target 1 holds the data");
            assert_eq!(
                (
                    c.targets[0].exec.stats.writes,
                    c.targets[1].exec.stats.writes
                ),
                (0, 1)
            );
            // A write that still waits for its data when its target is fenced runs nothing.
            feed(&mut c, &mut ring, &to(1, write(7, 0, 4096, &[])));
            let asked = take_tx(&mut c);
            assert_eq!(asked[0], b'T', "{spec1}: its data is asked for");
            let slot = u16::from_le_bytes([asked[1], asked[2]]);
            c.targets[1].fenced = true;
            feed(&mut c, &mut ring, &data(slot, 0, &d));
            assert_eq!(take_tx(&mut c), status_reply(7, Status::NoExport));
            feed(&mut c, &mut ring, &to(1, write(4, 0, 4096, &d)));
            assert_eq!(take_tx(&mut c), status_reply(4, Status::NoExport));
            feed(&mut c, &mut ring, &to(9, read(5, 0, 512)));
            assert_eq!(take_tx(&mut c), status_reply(5, Status::NoExport));
            assert_eq!(
                c.targets[1].exec.stats.writes, 1,
                "nothing ran on the fenced one"
            );
            feed(&mut c, &mut ring, &to(0, write(6, 0, 4096, &d)));
            assert_eq!(
                take_tx(&mut c),
                status_reply(6, Status::Ok),
                "target 0 goes on"
            );
            assert!(!c.closing);
        }
    }

    /// Waits for what target `t`'s thread-completing backend has in flight and answers it.
    fn settle_target(c: &mut Conn, ring: &mut Ring, t: usize) {
        while c.inflight > 0 {
            let Some(fd) = c.targets[t].exec.notifier() else {
                return;
            };
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one descriptor the backend owns.
            unsafe { libc::poll(&mut pfd, 1, 5000) };
            let mut done = Vec::new();
            c.targets[t]
                .exec
                .reap(&mut Pusher(ring), &mut |tag, r| done.push((tag, r)));
            for (tag, res) in done {
                super::finish_result(c, tag as u16, tag, res);
            }
        }
    }

    /// A connection whose buffers may hold `budget` bytes.
    fn conn_budget(spec: &str, chunked: bool, budget: usize) -> (Conn, UnixStream) {
        conn_sized(spec, chunked, budget, 1 << 20)
    }

    /// As `conn_budget`, granting I/Os of `max_io` bytes.
    fn conn_sized(spec: &str, chunked: bool, budget: usize, max_io: u32) -> (Conn, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let export = Arc::new(Export::open(&ExportSpec::parse(spec).unwrap()).unwrap());
        let size = export.size();
        let exec = Executor::open(export, max_io, size).unwrap();
        let c = Conn {
            sock: OwnedFd::from(a),
            incarnation: 1,
            fe: Box::new(Toy {
                chunked,
                holes: false,
                releases: Vec::new(),
                parked: Vec::new(),
            }),
            targets: vec![super::super::conn::Target {
                inline: exec.completes_inline(),
                exec,
                session: 1,
                queue: 0,
                fenced: false,
                _floor: None,
            }],
            session: 1,
            queue: 0,
            max_io,
            peer: "test".into(),
            rx: vec![0; 1 << 16],
            rx_start: 0,
            rx_end: 0,
            tx: Vec::new(),
            tx_sent: 0,
            tx_peak: 0,
            tx_data: Default::default(),
            tx_data_left: 0,
            pieces: Vec::new(),
            queued: 0,
            slots: (0..4).map(|_| Slot::default()).collect(),
            free_slots: (0..4).rev().collect(),
            deferred: Default::default(),
            inflight: 0,
            extents: Vec::new(),
            lists: 0,
            bufs: Default::default(),
            held: 0,
            held_in: 0,
            copying: false,
            readable: false,
            want_out: false,
            closing: false,
            logout: None,
            dead: false,
            bytes_sent: 0,
            tls: None,
            mem: Account::reserve(&Budget::new(budget), 0, budget).unwrap(),
            starved: false,
            waiting: false,
            request_waits: false,
            idle_mark: 0,
            _counted: None,
            broadcasts: Vec::new(),
            next_broadcast: 0,
        };
        (c, b)
    }

    /// Appends `msg` to the receive buffer and runs the request path over it.
    fn feed(c: &mut Conn, ring: &mut Ring, msg: &[u8]) {
        // As the reactor's receive path grows rx for a message larger than it (make_room).
        if c.rx.len() < c.rx_end + msg.len() {
            c.rx.resize(c.rx_end + msg.len(), 0);
        }
        c.rx[c.rx_end..c.rx_end + msg.len()].copy_from_slice(msg);
        c.rx_end += msg.len();
        parse_frames(c, 0, &mut Pusher(ring));
    }

    /// What would go on the wire, in order (`tx` and the READ data queued in it), as if the
    /// socket took all of it.
    fn take_tx(c: &mut Conn) -> Vec<u8> {
        let mut out = Vec::new();
        let mut pos = c.tx_sent;
        for d in &c.tx_data {
            out.extend_from_slice(&c.tx[pos..d.at]);
            let (p, len) = d.rest();
            // SAFETY: the queued bytes stay valid while the connection holds them, and no
            // other thread writes this test's export.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(p, len) });
            pos = d.at;
        }
        out.extend_from_slice(&c.tx[pos..]);
        c.consume(out.len());
        c.tx.clear();
        c.tx_sent = 0;
        out
    }

    fn write(cookie: u64, offset: u64, length: u32, inline: &[u8]) -> Vec<u8> {
        let mut m = vec![b'W'];
        m.extend_from_slice(&cookie.to_le_bytes());
        m.extend_from_slice(&offset.to_le_bytes());
        m.extend_from_slice(&length.to_le_bytes());
        m.extend_from_slice(&(inline.len() as u32).to_le_bytes());
        m.extend_from_slice(inline);
        m
    }

    /// `n` WRITEs of `len` bytes each (cookies 0.., one after the other) without their data.
    fn writes_without_data(n: u64, len: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| write(i, i * len as u64, len as u32, &[]))
            .collect()
    }

    fn data(slot: u16, offset: u32, bytes: &[u8]) -> Vec<u8> {
        let mut m = vec![b'D'];
        m.extend_from_slice(&slot.to_le_bytes());
        m.extend_from_slice(&offset.to_le_bytes());
        m.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        m.extend_from_slice(bytes);
        m
    }

    fn read(cookie: u64, offset: u64, length: u32) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&cookie.to_le_bytes());
        m.extend_from_slice(&offset.to_le_bytes());
        m.extend_from_slice(&length.to_le_bytes());
        m
    }

    fn status_reply(cookie: u64, st: Status) -> Vec<u8> {
        let mut r = vec![b'S'];
        r.extend_from_slice(&cookie.to_le_bytes());
        r.extend_from_slice(&(st as u16).to_le_bytes());
        r
    }

    /// A broadcast request stays in flight, unanswered, with its update for the reactor to
    /// send; it is answered once the last acknowledgement is in, and requests behind it run
    /// meanwhile.
    #[test]
    fn a_broadcast_is_answered_after_its_last_acknowledgement() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        let mut m = vec![b'B'];
        m.extend_from_slice(&5u64.to_le_bytes());
        feed(&mut c, &mut ring, &m);
        assert!(take_tx(&mut c).is_empty(), "not answered yet");
        assert_eq!((c.inflight, c.broadcasts.len()), (1, 1));
        let seq = c.broadcasts[0].seq;
        // As `Reactor::send_broadcasts`: the update goes out to two other reactors.
        assert!(c.broadcasts[0].update.take().is_some());
        c.broadcasts[0].left = 2;
        super::broadcast_acked(&mut c, seq, 0);
        feed(&mut c, &mut ring, b"P");
        assert_eq!(take_tx(&mut c), b"p", "the connection goes on meanwhile");
        super::broadcast_acked(&mut c, seq, 1);
        assert!(
            take_tx(&mut c).is_empty(),
            "one acknowledgement still to come"
        );
        super::broadcast_acked(&mut c, seq, 1);
        assert_eq!(take_tx(&mut c), status_reply(5, Status::Ok));
        assert_eq!((c.inflight, c.broadcasts.len()), (0, 0));
        // A late or repeated acknowledgement finds nothing.
        super::broadcast_acked(&mut c, seq, 1);
        assert!(take_tx(&mut c).is_empty());
    }

    /// A broadcast decoded while every slot is busy (from a message that needs none, as iSCSI's
    /// Data-Out completing a PERSISTENT RESERVE OUT's parameter list) is taken at once, its
    /// update there for the reactor to send: the change is committed already, and a connection
    /// that died with it untaken in rx, before a slot freed, would keep it from every other
    /// connection.
    #[test]
    fn a_broadcast_is_taken_while_every_slot_is_busy() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=memthread:1M");
        for i in 0..4u64 {
            feed(&mut c, &mut ring, &read(10 + i, 0, 512));
        }
        assert_eq!((c.free_slots.len(), c.inflight), (0, 4));
        let mut m = vec![b'B'];
        m.extend_from_slice(&5u64.to_le_bytes());
        feed(&mut c, &mut ring, &m);
        assert_eq!(c.rx_end - c.rx_start, 0, "taken from rx");
        assert_eq!((c.inflight, c.broadcasts.len()), (5, 1));
        assert!(
            c.broadcasts[0].update.is_some(),
            "its update waits for the reactor to send it"
        );
        // The connection dies now: once the reads are done, the broadcast still keeps it (in
        // flight until acknowledged).
        c.dead = true;
        c.closing = true;
        settle_async_to(&mut c, &mut ring, 1);
        assert_eq!((c.inflight, c.broadcasts.len()), (1, 1));
    }

    /// Broadcasts one after another (an initiator sending PERSISTENT RESERVE OUT in a loop)
    /// are decoded only while fewer than MAX_BROADCASTS are on their way: the rest wait in
    /// rx, and are taken as the first are sent and answered, none lost.
    #[test]
    fn broadcasts_on_their_way_are_bounded() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        let mut flood = Vec::new();
        for i in 0..64u64 {
            flood.push(b'B');
            flood.extend_from_slice(&i.to_le_bytes());
        }
        feed(&mut c, &mut ring, &flood);
        assert_eq!(c.broadcasts.len(), MAX_BROADCASTS);
        assert_eq!(
            c.rx_end - c.rx_start,
            (64 - MAX_BROADCASTS) * 9,
            "the rest wait"
        );
        let mut answered = 0;
        while c.rx_end > c.rx_start || !c.broadcasts.is_empty() {
            // As `Reactor::send_broadcasts` with no other reactor: each is answered at once.
            let seqs: Vec<u32> = c
                .broadcasts
                .iter_mut()
                .filter_map(|b| b.update.take().map(|_| b.seq))
                .collect();
            assert!(!seqs.is_empty(), "nothing left to send, yet not done");
            for seq in seqs {
                super::broadcast_acked(&mut c, seq, 0);
                answered += 1;
            }
            assert!(c.broadcasts.is_empty());
            parse_frames(&mut c, 0, &mut Pusher(&mut ring));
            assert!(c.broadcasts.len() <= MAX_BROADCASTS);
        }
        assert_eq!(answered, 64);
    }

    #[test]
    fn a_write_waits_for_the_data_it_solicited_then_runs() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        let payload: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        // 512 bytes came with the command: the rest is asked for, nothing is answered yet.
        feed(&mut c, &mut ring, &write(7, 8192, 4096, &payload[..512]));
        let tx = take_tx(&mut c);
        assert_eq!(tx[0], b'T', "a solicitation: {tx:?}");
        let slot = u16::from_le_bytes([tx[1], tx[2]]);
        assert_eq!((u32_at(&tx, 3), u32_at(&tx, 7)), (512, 3584));
        assert_eq!(c.targets[0].exec.stats.writes, 0, "nothing ran yet");
        // A ping is answered by the frontend while the write waits.
        feed(&mut c, &mut ring, b"P");
        assert_eq!(take_tx(&mut c), b"p");
        // The rest arrives in two parts; only the last one runs the write.
        feed(&mut c, &mut ring, &data(slot, 512, &payload[512..2048]));
        assert!(c.tx.is_empty() && c.targets[0].exec.stats.writes == 0);
        feed(&mut c, &mut ring, &data(slot, 2048, &payload[2048..]));
        assert_eq!(take_tx(&mut c), status_reply(7, Status::Ok));
        assert_eq!(c.targets[0].exec.stats.writes, 1);
        assert_eq!(c.free_slots.len(), 4, "the slot is free again");
        // The bytes landed where the write said.
        feed(&mut c, &mut ring, &read(8, 8192, 4096));
        let tx = take_tx(&mut c);
        assert_eq!(&tx[..11], &status_reply(8, Status::Ok)[..]);
        assert!(tx[11..11 + 4096] == payload[..]);
        // The data digest the frontend computed over the data where it lay.
        let crc = blkwire_wire::crc::crc32c(&payload).to_le_bytes();
        assert_eq!(&tx[11 + 4096..], &crc[..]);
        assert_eq!(c.targets[0].exec.stats.frames_in, 5);
    }

    #[test]
    fn data_for_waiting_writes_is_read_when_they_hold_every_slot() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        let payload = vec![5u8; 1024];
        // Four writes without their data take all four slots.
        for i in 0..4u64 {
            feed(&mut c, &mut ring, &write(i, i * 4096, 1024, &[]));
        }
        assert!(c.free_slots.is_empty());
        let tx = take_tx(&mut c);
        let slots: Vec<u16> = tx
            .chunks(11)
            .map(|t| u16::from_le_bytes([t[1], t[2]]))
            .collect();
        assert_eq!(slots.len(), 4);
        // Their data needs no slot: it is read, the writes run and free the slots (without
        // this, the connection would wait forever for a slot only that data can free).
        let mut more = Vec::new();
        for &s in &slots {
            more.extend_from_slice(&data(s, 0, &payload));
        }
        feed(&mut c, &mut ring, &more);
        assert_eq!(c.targets[0].exec.stats.writes, 4, "every held write ran");
        assert_eq!(c.free_slots.len(), 4);
        assert_eq!(take_tx(&mut c).len(), 4 * 11, "four write replies");
        feed(&mut c, &mut ring, &read(9, 0, 1024));
        let tx = take_tx(&mut c);
        assert!(
            tx[11..11 + 1024] == payload[..],
            "the data the writes brought reads back"
        );
    }

    /// A request decoded from a message that needs no free slot (`next_is_data`: iSCSI's
    /// Data-Out completing a parameter list makes the command's first part) while every slot
    /// is busy is not taken (`take_slot` has none to give): it waits in rx, and is taken, once,
    /// when a completion frees a slot and the reactor services the connection again.
    #[test]
    fn a_request_decoded_from_data_while_every_slot_is_busy_waits_for_a_slot() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=memthread:1M");
        let payload: Vec<u8> = (0..1024u32).map(|i| (i % 251) as u8).collect();
        feed(&mut c, &mut ring, &write(1, 0, 1024, &payload));
        settle_async(&mut c, &mut ring);
        assert_eq!(take_tx(&mut c), status_reply(1, Status::Ok));
        // Four READs run at the backend, one in each slot.
        for i in 0..4u64 {
            feed(&mut c, &mut ring, &read(10 + i, 0, 512));
        }
        assert_eq!((c.free_slots.len(), c.inflight), (0, 4));
        let mut part = vec![b'L'];
        part.extend_from_slice(&20u64.to_le_bytes());
        part.extend_from_slice(&0u64.to_le_bytes());
        part.extend_from_slice(&1024u32.to_le_bytes());
        feed(&mut c, &mut ring, &part);
        assert_eq!(c.rx_end - c.rx_start, part.len(), "left in rx, untaken");
        assert_eq!((c.free_slots.len(), c.inflight), (0, 4));
        // Serviced again with no slot free (a completion of another connection, say): it
        // still waits.
        feed(&mut c, &mut ring, &[]);
        assert_eq!(c.rx_end - c.rx_start, part.len());
        assert!(take_tx(&mut c).is_empty(), "nothing answered yet");
        settle_async(&mut c, &mut ring);
        assert_eq!(
            take_tx(&mut c).len(),
            4 * (11 + 512 + 4),
            "the four READs answered"
        );
        assert_eq!(
            c.rx_end - c.rx_start,
            part.len(),
            "not taken by the completions"
        );
        // The reactor services the connection after the completions: the request is taken.
        feed(&mut c, &mut ring, &[]);
        assert_eq!((c.rx_end - c.rx_start, c.inflight), (0, 1));
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(tx.len(), 11 + 1024 + 4, "answered once");
        assert_eq!(&tx[..11], &status_reply(20, Status::Ok)[..]);
        assert!(tx[11..11 + 1024] == payload[..], "it read what was written");
        assert_eq!(c.free_slots.len(), 4);
    }

    #[test]
    fn writes_without_data_and_requests_behind_them_wait_in_slots_for_memory() {
        let mut ring = Ring::new(8).unwrap();
        // A budget whose growth cannot hold the buffers of three 512 KiB writes at once (each
        // counted once, in the pool).
        let (mut c, _peer) = conn_budget("m=mem:4M", false, 7 << 18);
        const LEN: usize = 512 << 10;
        let one = vec![3u8; LEN];
        let mut msgs = writes_without_data(3, LEN);
        msgs.extend_from_slice(&read(9, 0, LEN as u32));
        feed(&mut c, &mut ring, &msgs);
        // Not everything fits: some of it waits in slots, and the stream is not stopped.
        assert!(
            !c.deferred.is_empty(),
            "the budget held every buffer: make it smaller"
        );
        assert_eq!(c.rx_start, c.rx_end, "everything sent was taken");
        // Whatever is asked for arrives; each write that runs lets the next one be asked for.
        let mut sent = Vec::new();
        for _ in 0..8 {
            let tx = take_tx(&mut c);
            let asked: Vec<u16> = tx
                .chunks(11)
                .filter(|t| t[0] == b'T')
                .map(|t| u16::from_le_bytes([t[1], t[2]]))
                .collect();
            sent.extend_from_slice(&tx);
            for s in asked {
                feed(&mut c, &mut ring, &data(s, 0, &one));
            }
        }
        assert_eq!(c.targets[0].exec.stats.writes, 3, "every write ran");
        // Idle now: the reactor trims what the data made the buffers grow to, and the starved
        // connection is retried (`trim_idle`, `starved`): the read that waited runs.
        c.trim();
        feed(&mut c, &mut ring, &[]);
        sent.extend_from_slice(&take_tx(&mut c));
        assert!(c.deferred.is_empty());
        let answered = sent
            .windows(11)
            .any(|w| w == &status_reply(9, Status::Ok)[..]);
        assert!(answered, "the read that waited was answered");
    }

    /// A LOGOUT that comes while writes wait for their data (or for memory) answers them
    /// NO_MEMORY first, then itself, last: they ran after its answer once memory came back
    /// (iSCSI: no response may follow the Logout Response), or waited for data nothing reads.
    #[test]
    fn a_logout_answers_the_requests_still_waiting_first() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:4M", false, 8 << 20);
        const LEN: usize = 512 << 10;
        let msgs = writes_without_data(3, LEN);
        feed(&mut c, &mut ring, &msgs);
        let asked = take_tx(&mut c);
        let waiting = (0..c.slots.len()).filter(|&i| c.slots[i].busy).count();
        assert!(waiting > 0, "no write waits");
        let mut logout = vec![b'O'];
        logout.extend_from_slice(&9u64.to_le_bytes());
        logout.extend_from_slice(&[0; 12]);
        feed(&mut c, &mut ring, &logout);
        let tx = take_tx(&mut c);
        let replies: Vec<&[u8]> = tx.chunks(11).collect();
        assert_eq!(replies.len(), waiting + 1, "{asked:?} then {tx:?}");
        for (i, r) in replies[..waiting].iter().enumerate() {
            assert_eq!(&r[..9], &status_reply(i as u64, Status::NoMemory)[..9]);
            assert_eq!(&r[9..], &status_reply(i as u64, Status::NoMemory)[9..]);
        }
        assert_eq!(
            replies[waiting],
            &status_reply(9, Status::Ok)[..],
            "the LOGOUT last"
        );
        assert!(c.closing && c.deferred.is_empty());
        assert!(c.slots.iter().all(|s| !s.busy), "every slot given back");
        assert_eq!(c.targets[0].exec.stats.writes, 0, "nothing ran");
    }

    /// A COPY that must wait for its bounce buffer while writes wait for their data is
    /// refused (the initiator retries it), and the data behind it is read: it stopped the
    /// stream, and the writes it waited on the memory of never got their data.
    #[test]
    fn a_copy_that_must_wait_while_writes_wait_for_data_is_refused() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:4M", false, 3 << 20);
        const LEN: usize = 512 << 10;
        let msgs = writes_without_data(3, LEN);
        feed(&mut c, &mut ring, &msgs);
        assert!(!c.deferred.is_empty() || c.slots.iter().any(|s| s.awaiting.is_some()));
        take_tx(&mut c);
        let mut copy = vec![b'Y'];
        copy.extend_from_slice(&7u64.to_le_bytes());
        copy.extend_from_slice(&0u64.to_le_bytes());
        copy.extend_from_slice(&4096u32.to_le_bytes());
        copy.extend_from_slice(&[0; 8]);
        // Waiting only for the COPY running (one per queue), it waits: that one's completion
        // services the connection again.
        c.copying = true;
        feed(&mut c, &mut ring, &copy);
        assert_eq!(
            c.rx_end - c.rx_start,
            copy.len(),
            "it waits behind the COPY running"
        );
        assert!(take_tx(&mut c).is_empty());
        c.copying = false;
        feed(&mut c, &mut ring, &[]);
        assert_eq!(
            c.rx_start, c.rx_end,
            "the COPY was taken, not left to stop the stream"
        );
        let tx = take_tx(&mut c);
        assert!(
            tx.windows(11)
                .any(|w| w == &status_reply(7, Status::NoMemory)[..]),
            "the COPY refused"
        );
    }

    /// A request parked for memory that can no longer fit the connection's share when its
    /// turn comes (the receive buffer grew meanwhile) is answered NO_MEMORY instead of holding
    /// up the queue behind it for ever.
    #[test]
    fn a_parked_request_that_can_never_fit_is_refused_when_its_turn_comes() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:4M", false, 3 << 19);
        const LEN: usize = 512 << 10;
        let mut msgs = Vec::new();
        // Writes waiting for their data, and a read behind them parked for memory.
        for i in 0..3u64 {
            msgs.extend_from_slice(&write(i, i * LEN as u64, LEN as u32, &[]));
        }
        msgs.extend_from_slice(&read(9, 0, LEN as u32));
        feed(&mut c, &mut ring, &msgs);
        let parked: Vec<u16> = c
            .deferred
            .iter()
            .copied()
            .filter(|&s| c.slots[s as usize].awaiting.is_none())
            .collect();
        assert_eq!(parked.len(), 1, "the read is parked: {:?}", c.deferred);
        // The read's turn: the writes ahead of it in the queue are left out of it here.
        c.deferred.retain(|s| parked.contains(s));
        // The receive buffer grew past what leaves room for the read in the share.
        let cap = c.mem.cap();
        c.rx.reserve(cap);
        feed(&mut c, &mut ring, &[]);
        let tx = take_tx(&mut c);
        assert!(c.deferred.is_empty(), "{:?}", c.deferred);
        assert!(
            tx.windows(11)
                .any(|w| w == &status_reply(9, Status::NoMemory)[..]),
            "the read refused: {tx:?}"
        );
        assert_eq!(c.targets[0].exec.stats.reads, 0, "and not run");
    }

    #[test]
    fn a_write_whose_data_follows_gets_its_buffer_when_taken_or_is_refused() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:4M", false, 3 << 19);
        const LEN: usize = 512 << 10;
        let one = vec![4u8; LEN];
        let follows = 1u64 << 63;
        // Its data is on its way: it never waits for memory without a buffer.
        feed(&mut c, &mut ring, &write(follows | 1, 0, LEN as u32, &[]));
        assert!(c.deferred.is_empty(), "held with a buffer, not deferred");
        let tx = take_tx(&mut c);
        assert_eq!(tx[0], b'T', "the frontend learns its slot: {tx:?}");
        let slot = u16::from_le_bytes([tx[1], tx[2]]);
        feed(&mut c, &mut ring, &data(slot, 0, &one));
        assert_eq!(take_tx(&mut c), status_reply(follows | 1, Status::Ok));
        // Writes waiting for data (some of them for memory) hold the budget: a write whose
        // data follows cannot wait in front of their data, nor without a buffer: refused.
        feed(&mut c, &mut ring, &writes_without_data(3, LEN));
        assert!(
            !c.deferred.is_empty(),
            "the budget held every buffer: make it smaller"
        );
        // (Sent: the transmit buffer keeps its room for replies.)
        c.tx.clear();
        feed(&mut c, &mut ring, &write(follows | 2, 0, LEN as u32, &[]));
        assert_eq!(take_tx(&mut c), status_reply(follows | 2, Status::NoMemory));
        assert_eq!(c.rx_start, c.rx_end, "taken, not left in front of the data");
        assert_eq!(c.free_slots.len(), 1, "its slot is free");
    }

    /// A WRITE's data is counted once against the budget, in the pool that holds it: it goes
    /// to the backend, never into the transmit buffer. (Counted a second time as reply bytes
    /// to come, write-heavy connections reached their share at half of it.)
    #[test]
    fn write_data_is_charged_once() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:8M");
        const LEN: usize = 256 << 10;
        feed(&mut c, &mut ring, &writes_without_data(4, LEN));
        take_tx(&mut c);
        assert_eq!(
            (c.held, c.held_in),
            (4 * LEN, 4 * LEN),
            "four writes wait for data"
        );
        assert_eq!(
            c.footprint(),
            c.rx.capacity() + c.tx.capacity() + c.bufs.allocated(),
            "their buffers, once"
        );
        assert!(c.bufs.allocated() >= 4 * LEN);
        // Their data comes, they run (inline) and give their buffers back.
        for _ in 0..4 {
            let slot = c.slots.iter().position(|s| s.awaiting.is_some()).unwrap() as u16;
            feed(&mut c, &mut ring, &data(slot, 0, &vec![9; LEN]));
        }
        assert_eq!((c.held, c.held_in), (0, 0), "every write ran");
        assert_eq!(c.targets[0].exec.stats.writes, 4);
    }

    #[test]
    fn a_small_write_with_its_data_does_not_stop_the_data_of_writes_before_it() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:8M");
        c.slots = (0..8).map(|_| Slot::default()).collect();
        c.free_slots = (0..8).rev().collect();
        // Four 1 MiB writes without their data hold the high-water mark's worth of buffers.
        const MIB: usize = 1 << 20;
        for i in 0..4u64 {
            feed(
                &mut c,
                &mut ring,
                &write(i, i * MIB as u64, MIB as u32, &[]),
            );
        }
        assert!(c.held >= c.tx_high_water());
        let tx = take_tx(&mut c);
        let asked: Vec<u16> = tx
            .chunks(11)
            .map(|t| u16::from_le_bytes([t[1], t[2]]))
            .collect();
        assert_eq!(asked.len(), 4);
        // Then a small write with its data, and only behind it the data the four wait for.
        let mut msgs = write(9, 5 * MIB as u64, 512, &[1; 512]);
        let big = vec![2u8; MIB];
        for &s in &asked {
            msgs.extend_from_slice(&data(s, 0, &big));
        }
        feed(&mut c, &mut ring, &msgs);
        assert_eq!(c.targets[0].exec.stats.writes, 5, "every write ran");
    }

    /// The solicitations (`T slot offset len`) among what the toy wrote.
    fn solicited(tx: &[u8]) -> Vec<(u16, u32, u32)> {
        tx.chunks(11)
            .filter(|t| t[0] == b'T')
            .map(|t| (u16::from_le_bytes([t[1], t[2]]), u32_at(t, 3), u32_at(t, 7)))
            .collect()
    }

    /// iSCSI with ImmediateData=Yes: 1 MiB writes bring their first 128 KiB in the command.
    /// Four of them hold the high-water mark's worth of buffers while they wait for the rest;
    /// a fifth write that brings more than a small payload, too much to run past the mark,
    /// must not stop the stream in front of the data the four wait for (it did: the four
    /// never ran). It waits in a slot with only what it brought; once the four ran, one that
    /// brought part of its data is asked for the rest, one that brought all of it runs, and
    /// one aborted meanwhile gives its slot and memory back unanswered.
    #[test]
    fn a_large_write_with_its_data_does_not_stop_the_data_of_writes_before_it() {
        const MIB: usize = 1 << 20;
        const IMM: usize = 128 << 10;
        let payload =
            |i: usize| -> Vec<u8> { (0..MIB).map(|b| ((b + 7 * i) % 251) as u8).collect() };
        // The fifth: its length, and whether it is aborted while it waits.
        for (len5, abort) in [(MIB, false), (256 << 10, false), (MIB, true)] {
            let case = format!("fifth of {len5} bytes, aborted: {abort}");
            let mut ring = Ring::new(8).unwrap();
            let (mut c, _peer) = conn("m=mem:8M");
            c.slots = (0..8).map(|_| Slot::default()).collect();
            c.free_slots = (0..8).rev().collect();
            for i in 0..4 {
                let p = payload(i);
                let w = write(i as u64, (i * MIB) as u64, MIB as u32, &p[..IMM]);
                feed(&mut c, &mut ring, &w);
            }
            assert!(c.held >= c.tx_high_water(), "the four hold the mark");
            let asked = solicited(&take_tx(&mut c));
            assert_eq!(asked.len(), 4);
            let held = c.held;
            let p4 = payload(4);
            let imm5 = if len5 == MIB { IMM } else { len5 };
            let mut msgs = write(4, 4 * MIB as u64, len5 as u32, &p4[..imm5]);
            if abort {
                // In the same read, so that nothing lets it be asked for the rest between.
                let slot = *c.free_slots.last().unwrap();
                msgs.push(b'A');
                msgs.extend_from_slice(&slot.to_le_bytes());
            }
            feed(&mut c, &mut ring, &msgs);
            assert_eq!(c.rx_start, c.rx_end, "{case}: the fifth was taken");
            assert!(
                take_tx(&mut c).is_empty(),
                "{case}: not asked for anything yet"
            );
            if abort {
                assert_eq!((c.held, c.deferred.len()), (held, 0), "{case}: given back");
            } else {
                assert_eq!(c.deferred.len(), 1, "{case}: it waits");
                assert_eq!(c.held, held + imm5, "{case}: holding only what it brought");
            }
            // Only now the data the four wait for.
            let mut msgs = Vec::new();
            for (i, &(slot, offset, len)) in asked.iter().enumerate() {
                assert_eq!((offset, len), (IMM as u32, (MIB - IMM) as u32));
                msgs.extend_from_slice(&data(slot, offset, &payload(i)[IMM..]));
            }
            feed(&mut c, &mut ring, &msgs);
            assert_eq!(
                c.targets[0].exec.stats.writes,
                4 + (len5 < MIB) as u64,
                "{case}"
            );
            let tx = take_tx(&mut c);
            let asked = solicited(&tx);
            if len5 == MIB && !abort {
                // Asked for the rest now that the four gave their memory back.
                assert_eq!(
                    asked,
                    [(asked[0].0, IMM as u32, (MIB - IMM) as u32)],
                    "{case}"
                );
                feed(&mut c, &mut ring, &data(asked[0].0, IMM as u32, &p4[IMM..]));
                assert_eq!(take_tx(&mut c), status_reply(4, Status::Ok), "{case}");
            } else {
                assert!(asked.is_empty(), "{case}");
                let answered = tx.windows(11).any(|w| w == status_reply(4, Status::Ok));
                assert_eq!(answered, !abort, "{case}");
            }
            assert_eq!(c.targets[0].exec.stats.writes, 5 - abort as u64, "{case}");
            assert_eq!((c.held, c.free_slots.len()), (0, 8), "{case}");
            for i in 0..5 - abort as usize {
                let len = if i == 4 { len5 } else { MIB };
                feed(&mut c, &mut ring, &read(10, (i * MIB) as u64, len as u32));
                let tx = take_tx(&mut c);
                assert!(
                    tx[11..11 + len] == payload(i)[..len],
                    "{case}: write {i} landed"
                );
            }
        }
    }

    /// Write data never goes into the transmit buffer, so it does not hold READs or allocation
    /// queries back at the high-water mark: with four writes holding the mark's worth of
    /// buffers while they wait for their data (iSCSI ImmediateData), a READ or a query runs at
    /// once, and the writes after it that brought their first data wait for the four (it
    /// waited, parked, and the data the writes parked behind it brought kept it waiting on the
    /// mark once the four ran, while those writes waited behind it: nothing moved again).
    #[test]
    fn write_data_does_not_hold_a_read_or_query_back_at_the_high_water_mark() {
        const MIB: usize = 1 << 20;
        const IMM: usize = 128 << 10;
        let p = vec![5u8; MIB];
        for probe in [read(100, 0, 4096), query(100, 0, 4096)] {
            let what = if probe[0] == b'R' { "READ" } else { "query" };
            let mut ring = Ring::new(8).unwrap();
            let (mut c, _peer) = conn("m=mem:8M");
            c.slots = (0..48).map(|_| Slot::default()).collect();
            c.free_slots = (0..48).rev().collect();
            for i in 0..4 {
                let w = write(i as u64, (i * MIB) as u64, MIB as u32, &p[..IMM]);
                feed(&mut c, &mut ring, &w);
            }
            let asked = solicited(&take_tx(&mut c));
            assert_eq!(asked.len(), 4);
            assert!(
                c.data_pending() >= c.tx_high_water(),
                "the four hold the mark"
            );
            feed(&mut c, &mut ring, &probe);
            assert!(c.deferred.is_empty(), "the {what} did not wait");
            let tx = take_tx(&mut c);
            let ran = if probe[0] == b'R' {
                tx.windows(11).any(|w| w == status_reply(100, Status::Ok))
            } else {
                tx[0] == b'E'
            };
            assert!(ran, "the {what} ran: {:?}", &tx[..tx.len().min(16)]);
            let mut msgs = Vec::new();
            for i in 0..32u64 {
                msgs.extend_from_slice(&write(
                    200 + i,
                    (i % 8) * MIB as u64,
                    MIB as u32,
                    &p[..IMM],
                ));
            }
            feed(&mut c, &mut ring, &msgs);
            assert_eq!(c.deferred.len(), 32, "the writes wait for the four");
            let mut msgs = Vec::new();
            for &(slot, offset, len) in &asked {
                msgs.extend_from_slice(&data(slot, offset, &p[offset as usize..][..len as usize]));
            }
            feed(&mut c, &mut ring, &msgs);
            assert_eq!(c.targets[0].exec.stats.writes, 4);
            assert!(!solicited(&take_tx(&mut c)).is_empty(), "then they go on");
        }
    }

    /// One message that gives up several parked writes (iSCSI ABORT TASK SET) releases them
    /// all before anything waiting for memory goes on: once the writes before them ran and
    /// gave their memory back, neither aborted write runs nor is answered.
    #[test]
    fn writes_parked_and_aborted_together_never_run() {
        const MIB: usize = 1 << 20;
        const IMM: usize = 128 << 10;
        let p = vec![9u8; MIB];
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:8M");
        c.slots = (0..8).map(|_| Slot::default()).collect();
        c.free_slots = (0..8).rev().collect();
        for i in 0..4 {
            let w = write(i as u64, (i * MIB) as u64, MIB as u32, &p[..IMM]);
            feed(&mut c, &mut ring, &w);
        }
        let asked = solicited(&take_tx(&mut c));
        assert_eq!(asked.len(), 4);
        let held = c.held;
        // Two writes park with their immediate data (one that brought all of it, one part),
        // and are aborted together in the same read (nothing lets them go on between).
        let mut slots: Vec<u16> = c.free_slots.iter().rev().take(2).copied().collect();
        let mut msgs = write(4, 4 * MIB as u64, IMM as u32, &p[..IMM]);
        msgs.extend_from_slice(&write(5, 5 * MIB as u64, MIB as u32, &p[..IMM]));
        msgs.extend_from_slice(&[b'X', 2]);
        for s in &slots {
            msgs.extend_from_slice(&s.to_le_bytes());
        }
        feed(&mut c, &mut ring, &msgs);
        assert_eq!(c.rx_start, c.rx_end, "all taken");
        assert_eq!((c.held, c.deferred.len()), (held, 0), "both given back");
        slots.sort();
        assert!(slots.iter().all(|s| c.free_slots.contains(s)));
        let mut msgs = Vec::new();
        for &(slot, offset, len) in &asked {
            msgs.extend_from_slice(&data(slot, offset, &p[..len as usize]));
        }
        feed(&mut c, &mut ring, &msgs);
        let tx = take_tx(&mut c);
        assert_eq!(c.targets[0].exec.stats.writes, 4, "only the four ran");
        assert!(solicited(&tx).is_empty());
        for cookie in [4, 5] {
            assert!(!tx
                .windows(11)
                .any(|w| w[..9] == status_reply(cookie, Status::Ok)[..9]));
        }
        assert_eq!((c.held, c.free_slots.len()), (0, 8));
    }

    /// The requests parked for memory, as `K` lists them: (cookie, slot).
    fn parked(c: &mut Conn, ring: &mut Ring) -> Vec<(u64, u16)> {
        let before = take_tx(c);
        feed(c, ring, b"K");
        let tx = take_tx(c);
        assert_eq!(tx[0], b'k');
        let n = tx[1] as usize;
        let listed = (0..n)
            .map(|i| {
                let at = 2 + 10 * i;
                (
                    u64::from_le_bytes(tx[at..at + 8].try_into().unwrap()),
                    u16::from_le_bytes([tx[at + 8], tx[at + 9]]),
                )
            })
            .collect();
        // What was there before the query is put back.
        c.tx.extend_from_slice(&before);
        listed
    }

    /// A READ (a request that brings no data) that waits in a slot for memory while writes
    /// wait for their data is told to the frontend (`parked`, and `unparked` when it leaves
    /// the wait), so that task management finds it (iSCSI ABORT TASK): released, it never
    /// runs nor is answered, and its slot goes back; the other runs once memory is back.
    #[test]
    fn a_read_parked_for_memory_is_the_frontends_to_release_and_then_never_runs() {
        const BUDGET: usize = 6 << 20;
        const MIB: usize = 1 << 20;
        let p = vec![9u8; MIB];
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:8M", false, BUDGET);
        c.slots = (0..8).map(|_| Slot::default()).collect();
        c.free_slots = (0..8).rev().collect();
        // Four 1 MiB writes waiting for their data leave too little of the budget (6 MiB) for
        // a 1 MiB READ beside them.
        let mut msgs = Vec::new();
        for i in 0..4 {
            msgs.extend_from_slice(&write(i as u64, (i * MIB) as u64, MIB as u32, &[]));
        }
        feed(&mut c, &mut ring, &msgs);
        let asked = solicited(&take_tx(&mut c));
        assert_eq!(asked.len(), 4);
        assert_eq!(parked(&mut c, &mut ring), [], "the writes left the wait");
        // Two READs behind them must wait for memory: each in a slot, told to the frontend.
        let mut msgs = read(8, 0, MIB as u32);
        msgs.extend_from_slice(&read(9, MIB as u64, MIB as u32));
        feed(&mut c, &mut ring, &msgs);
        assert_eq!(c.rx_start, c.rx_end, "both taken");
        assert_eq!(c.deferred.len(), 2);
        let waiting = parked(&mut c, &mut ring);
        assert_eq!(
            waiting.iter().map(|w| w.0).collect::<Vec<_>>(),
            [8, 9],
            "the frontend was told"
        );
        let mut release = vec![b'A'];
        release.extend_from_slice(&waiting[0].1.to_le_bytes());
        feed(&mut c, &mut ring, &release);
        assert_eq!(c.deferred.len(), 1);
        assert!(c.free_slots.contains(&waiting[0].1), "its slot is back");
        // The writes get their data and run; the memory back, the READ left runs.
        let mut msgs = Vec::new();
        for &(slot, offset, len) in &asked {
            msgs.extend_from_slice(&data(slot, offset, &p[..len as usize]));
        }
        feed(&mut c, &mut ring, &msgs);
        let tx = take_tx(&mut c);
        assert_eq!(c.targets[0].exec.stats.writes, 4);
        let answered = |cookie: u64| {
            tx.windows(9)
                .any(|w| w == &status_reply(cookie, Status::Ok)[..9])
        };
        assert!(answered(9), "the READ left waiting ran");
        assert!(!answered(8), "the released READ ran");
        assert_eq!(c.targets[0].exec.stats.reads, 1);
        assert_eq!(
            parked(&mut c, &mut ring),
            [],
            "the READ that ran left the wait"
        );
        assert!(c.deferred.is_empty());
        assert_eq!((c.held, c.free_slots.len()), (0, 8));
    }

    /// The same under the memory budget: while writes wait for memory to ask for their data,
    /// a write that brings data waits with it where the budget holds that, and is refused
    /// (NO_MEMORY: the initiator retries it) where it does not, instead of stopping the
    /// stream in front of the data the waiting writes are asked for, or growing past the
    /// budget.
    #[test]
    fn a_write_with_its_data_waits_or_is_refused_within_the_budget() {
        const LEN: usize = 512 << 10;
        const BUDGET: usize = 5 << 19;
        let one = vec![3u8; LEN];
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:4M", false, BUDGET);
        c.slots = (0..8).map(|_| Slot::default()).collect();
        c.free_slots = (0..8).rev().collect();
        let msgs = writes_without_data(4, LEN);
        feed(&mut c, &mut ring, &msgs);
        assert!(!c.deferred.is_empty(), "the budget held every buffer");
        let mut sent = take_tx(&mut c);
        // One that brings a little of its data waits with it.
        let held = c.held;
        feed(
            &mut c,
            &mut ring,
            &write(20, 4 * LEN as u64, LEN as u32, &one[..8192]),
        );
        assert_eq!(c.rx_start, c.rx_end, "taken");
        assert_eq!(c.held, held + 8192, "waiting with what it brought");
        // One that brings all of a large write, for which the receive buffer grew, runs from
        // the receive buffer that holds it (an inline export copies nothing): no more memory
        // than what already holds it.
        feed(
            &mut c,
            &mut ring,
            &write(21, 5 * LEN as u64, LEN as u32, &one),
        );
        assert_eq!(c.rx_start, c.rx_end, "taken");
        assert!(
            c.footprint() <= BUDGET,
            "{} bytes held against a budget of {BUDGET}",
            c.footprint()
        );
        let tx = take_tx(&mut c);
        assert!(
            tx.ends_with(&status_reply(21, Status::Ok)),
            "the whole write ran in place: {tx:?}"
        );
        sent.extend_from_slice(&tx);
        // Whatever is asked for arrives; each write that runs lets the next one be asked for.
        for _ in 0..8 {
            for (s, offset, len) in solicited(&sent) {
                feed(
                    &mut c,
                    &mut ring,
                    &data(s, offset, &one[offset as usize..][..len as usize]),
                );
            }
            if c.starved {
                // Nothing comes while the writes wait for memory: the reactor's idle tick
                // trims the buffers (`trim_idle`) and retries the starved connection.
                c.trim();
                feed(&mut c, &mut ring, &[]);
            }
            sent = take_tx(&mut c);
            assert!(c.footprint() <= BUDGET, "{} bytes held", c.footprint());
        }
        assert_eq!(c.targets[0].exec.stats.writes, 6, "every write ran");
        assert!(c.deferred.is_empty());
    }

    /// Closing (the peer shut its side), a frame not whole in the receive buffer never will
    /// be: the buffer does not grow for it, and the connection does not wait for memory for it
    /// (`request_waits`, which keeps a closing connection open), unlike a whole request the
    /// budget cannot cover yet.
    #[test]
    fn a_partial_frame_of_a_closing_connection_waits_for_nothing() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_sized("m=mem:8M", false, 8 << 20, 4 << 20);
        // Solicited data, `D slot offset length` and 1 MiB, of which the receive buffer
        // (64 KiB) is full.
        let mut msg = vec![b'D', 0, 0, 0, 0, 0, 0];
        msg.extend_from_slice(&(1u32 << 20).to_le_bytes());
        msg.resize(c.rx.len(), 7);
        c.closing = true;
        feed(&mut c, &mut ring, &msg);
        assert_eq!(
            c.rx.len(),
            64 << 10,
            "grown for a frame that cannot come whole"
        );
        assert!(!c.request_waits);
        // A whole request the budget cannot cover waits, closing or not.
        let (mut c, _peer) = conn_budget("m=memthread:4M", false, 3 << 20);
        let mut both = read(1, 0, 1 << 20);
        both.extend_from_slice(&read(2, 1 << 20, 1 << 20));
        c.closing = true;
        feed(&mut c, &mut ring, &both);
        assert!(c.starved && c.request_waits);
        settle_async(&mut c, &mut ring);
    }

    /// A request whose reply and data buffer the memory budget cannot cover waits in the
    /// receive buffer (the connection is starved) instead of growing past the budget, and runs
    /// once the memory is back; an idle connection gives back what it grew to.
    #[test]
    fn a_request_the_budget_cannot_cover_waits_until_memory_is_back() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=memthread:4M", false, 3 << 20);
        let mut both = read(1, 0, 1 << 20);
        both.extend_from_slice(&read(2, 1 << 20, 1 << 20));
        feed(&mut c, &mut ring, &both);
        assert_eq!(
            c.targets[0].exec.stats.frames_in, 1,
            "the second read does not fit beside the first"
        );
        assert!(c.starved);
        assert!(c.footprint() <= 3 << 20, "{} bytes held", c.footprint());
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(&tx[..11], &status_reply(1, Status::Ok)[..]);
        c.settle_memory();
        // The first reply went out: the second read fits now.
        parse_frames(&mut c, 0, &mut Pusher(&mut ring));
        assert!(!c.starved);
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(&tx[..11], &status_reply(2, Status::Ok)[..]);
        assert_eq!(c.targets[0].exec.stats.frames_in, 2);
        c.settle_memory();
        let busy = c.mem.charged();
        c.trim();
        assert!(
            c.mem.charged() < busy,
            "idle: {} of {busy} bytes kept",
            c.mem.charged()
        );
    }

    /// A READ of the largest size granted, after a WRITE of that size grew the receive buffer
    /// to hold it, is not refused as never fitting (the receive buffer it must fit beside is
    /// what it needs, not what the WRITE made it) and does not wait for the idle trim: the
    /// starved connection gives its grown buffers back when it is retried, and the READ runs.
    #[test]
    fn a_largest_read_after_a_largest_write_runs_once_retried() {
        const MAX: usize = 4 << 20;
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_sized("m=memthread:16M", false, 10 << 20, MAX as u32);
        // A share of 10 MiB of a larger budget (growth may take 3/4 of a budget).
        c.mem = Account::reserve(&Budget::new(64 << 20), 0, 10 << 20).unwrap();
        feed(&mut c, &mut ring, &write(1, 0, MAX as u32, &vec![7u8; MAX]));
        settle_async(&mut c, &mut ring);
        assert_eq!(take_tx(&mut c), status_reply(1, Status::Ok));
        assert!(c.rx.capacity() >= MAX, "the WRITE grew the receive buffer");
        feed(&mut c, &mut ring, &read(2, 0, MAX as u32));
        assert!(take_tx(&mut c).is_empty(), "not refused: it waits");
        assert!(c.starved);
        // The reactor's retry of a starved connection (`Reactor::starved`, 5 ms later).
        parse_frames(&mut c, 0, &mut Pusher(&mut ring));
        assert!(
            !c.starved,
            "it fits once the buffers are back to their size"
        );
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(&tx[..11], &status_reply(2, Status::Ok)[..]);
        assert_eq!(tx.len(), 11 + MAX + 4, "status, data, its CRC");
        assert!(tx[11..11 + MAX].iter().all(|&b| b == 7), "the data written");
        assert!(c.footprint() <= 10 << 20, "{} bytes held", c.footprint());
    }

    /// A large READ of a hole answered without its zeros is a READ served all the same:
    /// counted, with its bytes and its latency.
    #[test]
    fn a_read_answered_as_a_hole_is_counted() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("n=null:16M", false, 16 << 20);
        c.fe = Box::new(Toy {
            chunked: false,
            holes: true,
            releases: Vec::new(),
            parked: Vec::new(),
        });
        feed(&mut c, &mut ring, &read(3, 0, 1 << 20));
        let mut want = vec![b'H'];
        want.extend_from_slice(&3u64.to_le_bytes());
        assert_eq!(take_tx(&mut c), want, "answered as a hole");
        let s = &c.targets[0].exec.stats;
        assert_eq!((s.reads, s.bytes_read), (1, 1 << 20));
        assert_eq!(s.latency.of(BlockOp::Read).count(), 1);
    }

    /// Bytes the connection's buffers and allocation lists really hold (nothing in flight:
    /// a backend thread may be filling a slot's list while its query runs).
    fn held_bytes(c: &Conn) -> usize {
        assert_eq!(c.inflight, 0);
        let lists: usize =
            c.slots.iter().map(|s| s.extents.capacity()).sum::<usize>() + c.extents.capacity();
        c.rx.capacity()
            + c.tx.capacity()
            + c.bufs.allocated()
            + lists * std::mem::size_of::<blkwire_backend::Extent>()
    }

    /// Allocation queries whose maps list MAX_EXTENTS extents each (every other page written)
    /// hold a reply of 8 bytes per extent and a list of 16: the budget covers both before a
    /// query is taken, so queries that do not fit wait (the connection is starved) instead of
    /// growing past it, and the lists are given back once answered, not kept per slot.
    #[test]
    fn allocation_queries_wait_for_the_budget_and_give_their_lists_back() {
        use blkwire_backend::MAX_EXTENTS;
        const BUDGET: usize = 3 << 20;
        const PAGE: u64 = 4096;
        let len = MAX_EXTENTS as u64 * PAGE;
        // A sparse file, the export such maps usually come from: its queries run on the
        // export's helper thread, in slots, like memthread:'s; mem: answers inline.
        let path = std::env::temp_dir().join(format!("blkwire-maps-{}", std::process::id()));
        /// Removes the file also when an assertion fails.
        struct Gone<'a>(&'a std::path::Path);
        impl Drop for Gone<'_> {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(self.0);
            }
        }
        std::fs::File::create(&path).unwrap().set_len(len).unwrap();
        let _gone = Gone(&path);
        let file = format!("m=file:{}", path.display());
        for spec in ["m=mem:256M", "m=memthread:256M", &file] {
            let mut ring = Ring::new(8).unwrap();
            let (mut c, _peer) = conn_budget(spec, false, BUDGET);
            let mut q = c.targets[0].exec.export().open_queue().unwrap();
            for page in (0..MAX_EXTENTS as u64).step_by(2) {
                q.write_blocking(page * PAGE, &[1; 512], false).unwrap();
            }
            drop(q);
            let mut all = Vec::new();
            for cookie in 1..=4u64 {
                all.extend_from_slice(&query(cookie, 0, len as u32));
            }
            feed(&mut c, &mut ring, &all);
            let (mut answered, mut waited) = (0, false);
            while answered < 4 {
                settle_async(&mut c, &mut ring);
                waited |= c.starved;
                assert!(
                    held_bytes(&c) <= BUDGET,
                    "{spec}: {} bytes held against a budget of {BUDGET}",
                    held_bytes(&c)
                );
                assert!(
                    c.footprint() >= held_bytes(&c),
                    "{spec}: the footprint, {}, misses some of the {} bytes held",
                    c.footprint(),
                    held_bytes(&c)
                );
                let kept = c.slots.iter().map(|s| list_bytes(&s.extents)).max();
                assert!(
                    kept.max(Some(list_bytes(&c.extents))) < Some(64 << 10),
                    "{spec}: a list of an answered query kept {kept:?} bytes"
                );
                let tx = take_tx(&mut c);
                let mut at = 0;
                while at < tx.len() {
                    assert_eq!(tx[at], b'E', "{spec}: an allocation map");
                    let n = u32::from_le_bytes(tx[at + 9..at + 13].try_into().unwrap()) as usize;
                    assert_eq!(n, MAX_EXTENTS, "{spec}: a page per extent");
                    let first = &tx[at + 13..at + 21];
                    assert_eq!(first, [0, 16, 0, 0, 0, 0, 0, 0], "{spec}: a page of data");
                    at += 13 + 8 * n;
                    answered += 1;
                }
                c.settle_memory();
                parse_frames(&mut c, 0, &mut Pusher(&mut ring));
            }
            assert!(
                waited,
                "{spec}: four maps fit the budget at once: make it smaller"
            );
            c.trim();
            assert_eq!(
                held_bytes(&c) - c.rx.capacity() - c.tx.capacity(),
                0,
                "{spec}: an idle connection keeps no allocation list"
            );
        }
    }

    /// An allocation query for one extent (NBD's REQ_ONE) reserves room for one, not for
    /// MAX_EXTENTS (1 MiB of list, 512 KiB of reply): the backend is asked for no more, its
    /// list counted at that while it runs, and it is answered where the budget could not hold
    /// a full map; a query without it still reserves for the full map.
    #[test]
    fn an_allocation_query_for_one_extent_reserves_room_for_one() {
        const PAGE: u64 = 4096;
        for spec in ["m=mem:4M", "m=memthread:4M"] {
            let mut ring = Ring::new(8).unwrap();
            let (mut c, _peer) = conn(spec);
            let mut q = c.targets[0].exec.export().open_queue().unwrap();
            for page in (0..64).step_by(2) {
                q.write_blocking(page * PAGE, &[1; 512], false).unwrap();
            }
            let one = REQ_ONE as u64 | 1;
            for (cookie, list_at_most, list_at_least) in [(one, 4096, 0), (2, usize::MAX, 1 << 20)]
            {
                feed(&mut c, &mut ring, &query(cookie, 0, 64 * PAGE as u32));
                if spec.contains("memthread") {
                    assert_eq!(c.inflight, 1, "{spec}: running on the backend's thread");
                    assert!(
                        (list_at_least..=list_at_most).contains(&c.lists),
                        "{spec} {cookie:#x}: its list counted at {} bytes",
                        c.lists
                    );
                    let reserved = c.slots.iter().map(|s| s.extents.capacity()).max();
                    assert!(
                        reserved.unwrap() * 16 <= list_at_most,
                        "{spec} {cookie:#x}: {reserved:?} extents reserved"
                    );
                    settle_target(&mut c, &mut ring, 0);
                }
                let tx = take_tx(&mut c);
                assert_eq!(tx[0], b'E', "{spec}: {tx:?}");
                let n = u32_at(&tx, 9);
                assert_eq!(n, if cookie == one { 1 } else { 64 }, "{spec}");
                assert_eq!(
                    &tx[13..21],
                    [0, 16, 0, 0, 0, 0, 0, 0],
                    "{spec}: a page of data"
                );
            }
            // Under a budget that cannot hold a full map's list and reply, the one-extent
            // query is still answered; the full one is refused.
            let (mut c, _peer) = conn_budget(spec, false, 1 << 20);
            let mut q = c.targets[0].exec.export().open_queue().unwrap();
            q.write_blocking(0, &[1; 512], false).unwrap();
            feed(&mut c, &mut ring, &query(one, 0, 64 * PAGE as u32));
            settle_target(&mut c, &mut ring, 0);
            let tx = take_tx(&mut c);
            assert_eq!(tx[0], b'E', "{spec}: answered: {tx:?}");
            assert_eq!(u32_at(&tx, 9), 1, "{spec}");
            feed(&mut c, &mut ring, &query(3, 0, 64 * PAGE as u32));
            assert_eq!(take_tx(&mut c), status_reply(3, Status::NoMemory), "{spec}");
        }
    }

    /// A peer that sends without end what draws no answer (so the transmit mark never stops
    /// the reading) is read `RECEIVE_BUDGET` bytes per call, `readable` left set for the
    /// reactor's next turn, not until the socket is empty.
    #[test]
    fn one_receive_reads_at_most_its_budget() {
        use super::super::conn::{receive, RECEIVE_BUDGET};
        use std::io::Write;
        let mut ring = Ring::new(8).unwrap();
        let (mut c, mut peer) = conn("m=mem:1M");
        let sent = RECEIVE_BUDGET + (16 << 10);
        peer.write_all(&vec![b'N'; sent]).unwrap();
        c.readable = true;
        // One frame a byte: frames taken count the bytes read.
        assert!(
            receive(&mut c, 0, &mut Pusher(&mut ring)),
            "stopped at the budget"
        );
        let first = c.frames_in() as usize;
        assert!(
            (RECEIVE_BUDGET..sent).contains(&first),
            "read {first} of {sent} in one call"
        );
        assert!(c.readable && !c.closing, "the rest is for the next turn");
        assert!(!receive(&mut c, 0, &mut Pusher(&mut ring)));
        assert_eq!(c.frames_in() as usize, sent);
        assert!(!c.readable, "all read");
        assert!(take_tx(&mut c).is_empty());
    }

    fn query(cookie: u64, offset: u64, length: u32) -> Vec<u8> {
        let mut m = vec![b'Q'];
        m.extend_from_slice(&cookie.to_le_bytes());
        m.extend_from_slice(&offset.to_le_bytes());
        m.extend_from_slice(&length.to_le_bytes());
        m
    }

    /// NVMe/TCP's SQ head moves once per command the queue takes: a command the budget makes
    /// wait is decoded again later, and must not count twice (a host that sees SQHD run ahead
    /// of what it sent takes it for a controller bug, or overruns the queue).
    #[test]
    fn an_nvme_command_decoded_twice_moves_the_sq_head_once() {
        use blkwire_wire::nvme_tcp::{CapsuleCmd, Pdu, Sgl, Sqe};
        let mut ring = Ring::new(8).unwrap();
        // SQSIZE 7 (8 entries); Connect took entry 0, so the head starts at 1.
        let (mut c, _peer, host, ctrl) = nvme_queue_budget("m=memthread:4M", 3 << 20);
        let read = |cid: u16, slba: u64| {
            let sqe = Sqe {
                opcode: 0x02,
                flags: 0x40,
                cid,
                nsid: 1,
                cdw2: 0,
                cdw3: 0,
                mptr: 0,
                dptr: Sgl::TransportDataBlock {
                    subtype: 0xa,
                    length: 1 << 20,
                }
                .to_bytes(),
                cdw10: slba as u32,
                cdw11: 0,
                cdw12: 2047, // 2048 blocks: 1 MiB
                cdw13: 0,
                cdw14: 0,
                cdw15: 0,
            };
            let mut out = Vec::new();
            Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[] }).encode(&host, &mut out);
            out
        };
        // The SQHD of every CapsuleResp in `tx`, by CID.
        let heads = |tx: &[u8]| -> Vec<(u16, u16)> {
            nvme_answers(tx, &ctrl)
                .into_iter()
                .map(|(cid, head, _)| (cid, head))
                .collect()
        };
        let mut both = read(1, 0);
        both.extend_from_slice(&read(2, 2048));
        feed(&mut c, &mut ring, &both);
        assert_eq!(
            c.targets[0].exec.stats.frames_in, 1,
            "the second read waits"
        );
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        // The second command is still in rx: the head counts the first only.
        assert_eq!(heads(&tx), vec![(1, 2)]);
        c.settle_memory();
        parse_frames(&mut c, 0, &mut Pusher(&mut ring));
        assert_eq!(c.targets[0].exec.stats.frames_in, 2);
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(heads(&tx), vec![(2, 3)], "decoded twice, taken once");
    }

    /// An NVMe/TCP I/O queue of namespace 1 (512-byte blocks) over `spec`, with the host's
    /// and the controller's PDU parameters.
    fn nvme_queue(
        spec: &str,
    ) -> (
        Conn,
        UnixStream,
        blkwire_wire::nvme_tcp::Params,
        blkwire_wire::nvme_tcp::Params,
    ) {
        nvme_queue_budget(spec, 1 << 30)
    }

    /// As `nvme_queue`, with a memory budget of `budget` bytes.
    fn nvme_queue_budget(
        spec: &str,
        budget: usize,
    ) -> (
        Conn,
        UnixStream,
        blkwire_wire::nvme_tcp::Params,
        blkwire_wire::nvme_tcp::Params,
    ) {
        use crate::frontend::nvme::{IoQueueSetup, NsIo, NvmeIo};
        use blkwire_wire::nvme_tcp::{Direction, Params};
        let (mut c, peer) = conn_budget(spec, false, budget);
        let host = Params::initial(Direction::HostToController, u32::MAX);
        let ctrl = Params::initial(Direction::ControllerToHost, u32::MAX);
        c.fe = Box::new(NvmeIo::new(IoQueueSetup {
            rx: host,
            tx: ctrl,
            qid: 1,
            entries: 8,
            sq_head: 1,
            sqfc_off: false,
            max_io: 1 << 20,
            maxh2cdata: 1 << 20,
            namespaces: vec![NsIo {
                nsid: 1,
                lba_shift: 9,
                read_only: false,
                copy: Default::default(),
            }],
        }));
        (c, peer, host, ctrl)
    }

    /// A Dataset Management deallocation of `ranges` (slba, blocks), with `cid`.
    fn nvme_dsm(host: &blkwire_wire::nvme_tcp::Params, cid: u16, ranges: &[(u64, u32)]) -> Vec<u8> {
        use blkwire_wire::nvme_tcp::{sgl, CapsuleCmd, Pdu, Sgl, Sqe};
        let mut list = Vec::new();
        for &(slba, blocks) in ranges {
            list.extend_from_slice(&0u32.to_le_bytes());
            list.extend_from_slice(&blocks.to_le_bytes());
            list.extend_from_slice(&slba.to_le_bytes());
        }
        let sqe = Sqe {
            opcode: 0x09,
            flags: 0x40,
            cid,
            nsid: 1,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            dptr: Sgl::DataBlock {
                subtype: sgl::SUBTYPE_OFFSET,
                address: 0,
                length: list.len() as u32,
            }
            .to_bytes(),
            cdw10: ranges.len() as u32 - 1,
            cdw11: 1 << 2, // AD
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        };
        let mut out = Vec::new();
        Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &list }).encode(host, &mut out);
        out
    }

    /// (CID, SQHD, status) of every CapsuleResp in `tx`.
    fn nvme_answers(tx: &[u8], ctrl: &blkwire_wire::nvme_tcp::Params) -> Vec<(u16, u16, u16)> {
        use blkwire_wire::nvme_tcp::{self, Pdu};
        let mut v = Vec::new();
        let mut at = 0;
        while at < tx.len() {
            let n = match nvme_tcp::pdu_len(&tx[at..], ctrl) {
                Ok(nvme_tcp::Progress::Complete(n)) => n,
                other => panic!("a partial PDU in tx: {other:?}"),
            };
            if let Ok(Pdu::CapsuleResp(cqe)) = nvme_tcp::decode(&tx[at..at + n], ctrl) {
                v.push((cqe.cid, cqe.sq_head, cqe.status >> 1));
            }
            at += n;
        }
        v
    }

    /// A deallocation of several ranges, or of one larger than the 1 GiB DMRSL says (hosts
    /// that do not read the NVM command set's Identify Controller data send both), runs as
    /// trims of at most 1 GiB, one after another, and is answered once, after the last: the
    /// SQ head moves once. The next command is decoded while a part runs; a second such
    /// deallocation waits for the first.
    #[test]
    fn an_nvme_deallocation_of_many_ranges_runs_in_parts_and_is_answered_once() {
        let mut ring = Ring::new(8).unwrap();
        // Runs what `c` was fed to the end, as the reactor does: each completion services the
        // connection again. The answers, in order.
        let run = |c: &mut Conn, ring: &mut Ring, ctrl| {
            let mut answers = Vec::new();
            for _ in 0..64 {
                settle_async(c, ring);
                answers.extend(nvme_answers(&take_tx(c), ctrl));
                parse_frames(c, 0, &mut Pusher(ring));
                if c.inflight == 0 && c.rx_start == c.rx_end {
                    break;
                }
            }
            answers.extend(nvme_answers(&take_tx(c), ctrl));
            answers
        };
        let (mut c, _peer, host, ctrl) = nvme_queue("m=memthread:8G");
        let big = ((5u64 << 30) >> 9) as u32; // 5 GiB: five parts
        feed(
            &mut c,
            &mut ring,
            &nvme_dsm(&host, 7, &[(0, 8), (64, 0), (1 << 20, big)]),
        );
        assert_eq!(run(&mut c, &mut ring, &ctrl), vec![(7, 2, 0)]);
        assert_eq!(c.targets[0].exec.stats.frames_in, 6, "1 + 5 trims");

        // The data outside the ranges stays; the second command waits for the first.
        let (mut c, _peer, host, ctrl) = nvme_queue("m=memthread:4M");
        let mut q = c.targets[0].exec.export().open_queue().unwrap();
        q.write_blocking(0, &[0xa5; 4 << 20], false).unwrap();
        let mut both = nvme_dsm(&host, 1, &[(8, 8), (100, 16), (4000, 1)]);
        both.extend_from_slice(&nvme_dsm(&host, 2, &[(200, 8), (300, 8)]));
        feed(&mut c, &mut ring, &both);
        assert_eq!(c.targets[0].exec.stats.frames_in, 1, "one part at a time");
        let answers = run(&mut c, &mut ring, &ctrl);
        assert_eq!(answers, vec![(1, 2, 0), (2, 3, 0)]);
        let mut got = vec![0u8; 4 << 20];
        q.read_blocking(0, &mut got).unwrap();
        for (i, block) in got.chunks(512).enumerate() {
            let trimmed = matches!(i, 8..16 | 100..116 | 4000 | 200..208 | 300..308);
            let want = if trimmed { 0 } else { 0xa5 };
            assert!(block.iter().all(|&b| b == want), "block {i}");
        }
    }

    /// A compound command's parts that finish at once are taken a bounded number per pass
    /// (they consume no bytes): a deallocation of 256 ranges does not hold the reactor until
    /// its last part; each further pass takes the next ones, and it is answered once.
    #[test]
    fn made_up_parts_are_taken_a_bounded_number_per_pass() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer, host, ctrl) = nvme_queue("m=mem:4M");
        let ranges: Vec<(u64, u32)> = (0..256).map(|i| (i * 16, 8)).collect();
        feed(&mut c, &mut ring, &nvme_dsm(&host, 9, &ranges));
        assert_eq!(
            c.targets[0].exec.stats.frames_in,
            1 + super::PARTS_PER_PASS as u64,
            "the command's own part, then one pass's worth"
        );
        let mut answers = nvme_answers(&take_tx(&mut c), &ctrl);
        assert!(answers.is_empty(), "answered before its last part");
        for _ in 0..8 {
            parse_frames(&mut c, 0, &mut Pusher(&mut ring));
            answers.extend(nvme_answers(&take_tx(&mut c), &ctrl));
        }
        assert_eq!(answers, vec![(9, 2, 0)]);
        assert_eq!(c.targets[0].exec.stats.frames_in, 256);
    }

    /// A deallocation in progress when the connection ends on a protocol error makes no
    /// more parts, and no CapsuleResp follows the termination.
    #[test]
    fn a_protocol_error_ends_a_deallocation_in_progress() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer, host, ctrl) = nvme_queue("m=memthread:4M");
        feed(
            &mut c,
            &mut ring,
            &nvme_dsm(&host, 5, &[(0, 8), (64, 8), (128, 8)]),
        );
        assert_eq!(c.targets[0].exec.stats.frames_in, 1, "its first part runs");
        // A PDU type no host sends.
        feed(&mut c, &mut ring, &[0x7f, 0, 8, 0, 8, 0, 0, 0]);
        assert!(c.closing, "the connection ends");
        settle_async(&mut c, &mut ring);
        parse_frames(&mut c, 0, &mut Pusher(&mut ring));
        settle_async(&mut c, &mut ring);
        let tx = take_tx(&mut c);
        assert_eq!(tx.first(), Some(&0x03), "a C2HTermReq: {tx:?}");
        assert_eq!(nvme_answers(&tx, &ctrl), vec![], "no CapsuleResp after it");
        assert_eq!(c.targets[0].exec.stats.frames_in, 1, "no part after it");
    }

    /// A part that fails ends the deallocation: its status answers the command, and the
    /// ranges after it are not trimmed.
    #[test]
    fn a_failed_part_ends_an_nvme_deallocation() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer, host, ctrl) = nvme_queue("m=mem:4M");
        let mut q = c.targets[0].exec.export().open_queue().unwrap();
        q.write_blocking(0, &[0xa5; 4 << 20], false).unwrap();
        // The second range is past the end of the 4 MiB namespace.
        feed(
            &mut c,
            &mut ring,
            &nvme_dsm(&host, 3, &[(0, 8), (1 << 20, 8), (16, 8)]),
        );
        let answers = nvme_answers(&take_tx(&mut c), &ctrl);
        assert_eq!(answers, vec![(3, 2, 0x4080)], "LBA Out of Range, DNR");
        let mut got = vec![0u8; 8 << 10];
        q.read_blocking(0, &mut got).unwrap();
        assert!(got[..4096].iter().all(|&b| b == 0), "the first range ran");
        assert!(got[4096..].iter().all(|&b| b == 0xa5), "the third did not");
        // The queue goes on: a deallocation after it runs.
        feed(&mut c, &mut ring, &nvme_dsm(&host, 4, &[(16, 8), (32, 8)]));
        assert_eq!(nvme_answers(&take_tx(&mut c), &ctrl), vec![(4, 3, 0)]);
    }

    /// The budget sets aside the framing a chunked READ's frontend says it takes, here more
    /// than `REPLY_SLACK`: whatever the budget, the READ either waits or is refused, or runs
    /// within it; it never grows the connection past it (a reply larger than was set aside
    /// would grow the transmit buffer by doubling).
    #[test]
    fn a_chunked_read_is_covered_with_its_framing() {
        const LEN: usize = 1 << 20;
        // The toy's: `C n` before each 1000 bytes, then the status.
        assert!(LEN.div_ceil(1000) * 5 + 11 > super::REPLY_SLACK);
        let mut ring = Ring::new(8).unwrap();
        let cookie = NO_PIECES as u64 | 1;
        let (mut ran, mut held_back) = (0, 0);
        for budget in (2 * LEN..4 * LEN).step_by(16 << 10) {
            let (mut c, _peer) = conn_budget("m=memthread:4M", true, budget);
            feed(&mut c, &mut ring, &read(cookie, 0, LEN as u32));
            settle_async(&mut c, &mut ring);
            assert!(
                c.footprint() <= budget,
                "{} bytes held against a budget of {budget}",
                c.footprint()
            );
            let tx = take_tx(&mut c);
            if tx.len() > LEN {
                assert!(tx == chunked_reply(cookie, &vec![0; LEN]));
                ran += 1;
            } else {
                held_back += 1;
            }
        }
        assert!(ran > 0 && held_back > 0, "ran {ran}, held back {held_back}");
    }

    /// Replies the frontend writes itself (an iSCSI NOP-In echoing 256 KiB) that the client
    /// never reads stay within the connection's part of the budget, here its floor: the room
    /// for each is covered before it is decoded (it was not: `Vec` doubled the transmit buffer
    /// to twice the high-water mark behind the budget's back). Once the client reads, the rest
    /// is answered.
    #[test]
    fn replies_the_frontend_writes_itself_stay_within_the_budget() {
        const PING: usize = 256 << 10;
        let budget = super::super::conn::stream_floor(1 << 20);
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_budget("m=mem:1M", false, budget);
        let mut echo = vec![b'E'];
        echo.extend_from_slice(&(PING as u32).to_le_bytes());
        echo.extend((0..PING).map(|i| (i % 251) as u8));
        let mut sent = 0;
        // Fed one at a time while they are taken (a stopped connection reads nothing more).
        while c.rx_start == c.rx_end && sent < 40 {
            feed(&mut c, &mut ring, &echo);
            sent += 1;
            assert!(
                c.footprint() <= budget && c.footprint() <= c.mem.charged(),
                "after {sent} pings: {} bytes held, {} charged, against a budget of {budget}",
                c.footprint(),
                c.mem.charged()
            );
        }
        assert!(sent < 40, "never stopped: the replies went unbounded");
        let mut answered = take_tx(&mut c).len() / (PING + 1);
        c.settle_memory();
        parse_frames(&mut c, 0, &mut Pusher(&mut ring));
        assert_eq!(
            c.rx_start, c.rx_end,
            "the last one is answered once there is room"
        );
        answered += take_tx(&mut c).len() / (PING + 1);
        assert_eq!(answered, sent, "every ping answered");
    }

    /// What the peer of `c` receives, `len` bytes, read in small bites so that sends are
    /// partial, the sent part of `tx` is dropped from its front and POLLOUT is armed between.
    fn read_in_bites(c: &mut Conn, peer: &mut UnixStream, ring: &mut Ring, len: usize) -> Vec<u8> {
        use std::io::Read;
        peer.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut bite = vec![0u8; 50_000];
        while got.len() < len {
            super::super::conn::transmit(c, 0, &mut Pusher(ring));
            match peer.read(&mut bite) {
                Ok(n) => got.extend_from_slice(&bite[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(
                        c.tx_backlog() > 0,
                        "nothing left to send, {} bytes missing",
                        len - got.len()
                    );
                }
                Err(e) => panic!("{e}"),
            }
        }
        got
    }

    /// Large READ data goes out from the buffer the backend filled, between its reply's header
    /// and digest and in order with the replies copied around it, whatever the socket takes at
    /// a time (partial sends, the sent part dropped from the front of `tx`); the buffers go
    /// back to the pool once sent.
    #[test]
    fn large_read_data_is_sent_from_its_buffer_in_order() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, mut peer) = conn("m=memthread:4M");
        const BIG: usize = 256 << 10;
        let payload: Vec<u8> = (0..2 * BIG + 4096).map(|i| (i * 7 % 251) as u8).collect();
        // Filled through the write path (data in the request).
        for (i, piece) in payload.chunks(BIG).enumerate() {
            feed(
                &mut c,
                &mut ring,
                &write(i as u64, (i * BIG) as u64, piece.len() as u32, piece),
            );
            settle_async(&mut c, &mut ring);
        }
        take_tx(&mut c);
        let mut reads = read(10, 0, BIG as u32);
        reads.extend_from_slice(&read(11, (2 * BIG) as u64, 4096));
        reads.extend_from_slice(&read(12, BIG as u64, BIG as u32));
        feed(&mut c, &mut ring, &reads);
        settle_async(&mut c, &mut ring);
        assert_eq!(
            c.tx_data.len(),
            2,
            "the two large reads wait in their buffers"
        );
        assert!(
            c.tx.len() < 4096 + 3 * 64,
            "only framing and the small read were copied"
        );
        let mut want = Vec::new();
        for (cookie, range) in [
            (10, 0..BIG),
            (11, 2 * BIG..2 * BIG + 4096),
            (12, BIG..2 * BIG),
        ] {
            want.extend_from_slice(&status_reply(cookie, Status::Ok));
            want.extend_from_slice(&payload[range.clone()]);
            want.extend_from_slice(&blkwire_wire::crc::crc32c(&payload[range]).to_le_bytes());
        }
        let got = read_in_bites(&mut c, &mut peer, &mut ring, want.len());
        assert!(got == want, "the wire carries the replies in order");
        assert_eq!((c.tx_backlog(), c.held, c.queued), (0, 0, 0));
        assert!(c.tx_data.is_empty());
        assert!(c.bufs.has_spare(BIG), "the buffers went back to the pool");
    }

    /// A large READ of RAM whose every page was written is sent from the export's memory: nothing
    /// is copied into `tx` but its header (and a trailer that does not depend on the data), and
    /// no buffer is held. A READ over a hole is copied as before (reading a hole through the
    /// mapping would allocate it), and so is one whose digest after the data would be computed
    /// before the data is sent.
    #[test]
    fn large_read_of_ram_is_sent_from_the_export() {
        use super::super::conn::TxFrom;
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:4M");
        const BIG: usize = 256 << 10;
        let payload: Vec<u8> = (0..BIG).map(|i| (i * 13 % 251) as u8).collect();
        feed(&mut c, &mut ring, &write(1, 0, BIG as u32, &payload));
        feed(
            &mut c,
            &mut ring,
            &write(2, 2 * BIG as u64, 4096, &payload[..4096]),
        );
        take_tx(&mut c);
        let no_digest = NO_DIGEST as u64;
        let mut reads = read(no_digest | 10, 0, BIG as u32);
        reads.extend_from_slice(&read(no_digest | 11, 2 * BIG as u64, BIG as u32));
        reads.extend_from_slice(&read(12, 0, BIG as u32));
        let trailer = TRAILER as u64;
        reads.extend_from_slice(&read(trailer | 13, 0, BIG as u32));
        feed(&mut c, &mut ring, &reads);
        assert_eq!(c.tx_data.len(), 2, "two reads wait in the export's memory");
        assert!(c
            .tx_data
            .iter()
            .all(|d| matches!(d.from, TxFrom::Mapped(_))));
        assert_eq!((c.held, c.queued), (0, 0), "it holds no buffer");
        let mut partly = payload[..4096].to_vec();
        partly.resize(BIG, 0);
        let mut want = status_reply(no_digest | 10, Status::Ok);
        want.extend_from_slice(&payload);
        want.extend_from_slice(&status_reply(no_digest | 11, Status::Ok));
        want.extend_from_slice(&partly);
        want.extend_from_slice(&status_reply(12, Status::Ok));
        want.extend_from_slice(&payload);
        want.extend_from_slice(&blkwire_wire::crc::crc32c(&payload).to_le_bytes());
        want.extend_from_slice(&status_reply(trailer | 13, Status::Ok));
        want.extend_from_slice(&payload);
        want.extend_from_slice(TRAILER_BYTES);
        assert!(
            take_tx(&mut c) == want,
            "the wire carries the replies in order"
        );
        assert!(c.tx_data.is_empty());
        let stats = &c.targets[0].exec.stats;
        assert_eq!((stats.reads, stats.bytes_read), (4, 4 * BIG as u64));
        let mut extents = Vec::new();
        c.targets[0].exec.export().backend().allocation(
            2 * BIG as u64 + 4096,
            4096,
            blkwire_backend::MAX_EXTENTS,
            &mut extents,
        );
        assert!(extents[0].hole, "the hole read stays a hole");
    }

    /// The toy's chunked reply to READ `cookie` of `payload`: pieces of 1000 bytes, each after
    /// its header, then the status.
    fn chunked_reply(cookie: u64, payload: &[u8]) -> Vec<u8> {
        let mut want = Vec::new();
        for piece in payload.chunks(1000) {
            want.push(b'C');
            want.extend_from_slice(&(piece.len() as u32).to_le_bytes());
            want.extend_from_slice(piece);
        }
        want.extend_from_slice(&status_reply(cookie, Status::Ok));
        want
    }

    /// A large reply with headers between pieces of its data copies only the headers: each
    /// piece goes out from the slot's buffer, which goes back to the pool after the last, in
    /// order with the replies copied around it, whatever the socket takes at a time.
    #[test]
    fn large_chunked_read_is_sent_from_its_buffer() {
        let mut ring = Ring::new(8).unwrap();
        for spec in ["m=mem:1M", "m=memthread:1M"] {
            let (mut c, mut peer) = conn_with(spec, true);
            const BIG: usize = 200_500;
            let payload: Vec<u8> = (0..BIG).map(|i| (i * 11 % 251) as u8).collect();
            feed(&mut c, &mut ring, &write(1, 0, BIG as u32, &payload));
            settle_async(&mut c, &mut ring);
            assert_eq!(take_tx(&mut c), status_reply(1, Status::Ok), "{spec}");
            let mut reads = read(2, 0, BIG as u32);
            reads.extend_from_slice(&read(3, 0, 3000));
            reads.extend_from_slice(&read(4, 1000, (BIG - 1000) as u32));
            feed(&mut c, &mut ring, &reads);
            settle_async(&mut c, &mut ring);
            let chunks = BIG.div_ceil(1000) + (BIG - 1000).div_ceil(1000);
            assert_eq!(
                c.tx_data.len(),
                chunks,
                "{spec}: every piece waits in its buffer"
            );
            assert!(
                c.tx.len() - c.tx_sent <= chunks * 5 + 3000 + 64,
                "{spec}: only the framing and the small read were copied"
            );
            let mut want = chunked_reply(2, &payload);
            want.extend_from_slice(&chunked_reply(3, &payload[..3000]));
            want.extend_from_slice(&chunked_reply(4, &payload[1000..]));
            let got = read_in_bites(&mut c, &mut peer, &mut ring, want.len());
            assert!(got == want, "{spec}: the replies in order");
            assert!(c.tx_data.is_empty());
            assert_eq!((c.held, c.queued), (0, 0), "{spec}");
            assert!(
                c.bufs.has_spare(BIG),
                "{spec}: the buffer went back to the pool"
            );
        }
    }

    /// A large chunked READ of RAM whose pages were all written, with no digest over its pieces,
    /// sends every piece from the export's memory and holds no buffer; with a digest it goes
    /// through a slot's buffer.
    #[test]
    fn large_chunked_read_of_ram_is_sent_from_the_export() {
        use super::super::conn::TxFrom;
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn_with("m=mem:1M", true);
        const BIG: usize = 100_500;
        let payload: Vec<u8> = (0..BIG).map(|i| (i * 5 % 251) as u8).collect();
        feed(&mut c, &mut ring, &write(1, 0, BIG as u32, &payload));
        take_tx(&mut c);
        let trailer = TRAILER as u64;
        feed(&mut c, &mut ring, &read(trailer | 2, 0, BIG as u32));
        assert_eq!(c.tx_data.len(), BIG.div_ceil(1000));
        assert!(c
            .tx_data
            .iter()
            .all(|d| matches!(d.from, TxFrom::Mapped(_))));
        assert_eq!((c.held, c.queued), (0, 0), "no buffer held");
        assert!(take_tx(&mut c) == chunked_reply(trailer | 2, &payload));
        feed(&mut c, &mut ring, &read(3, 0, BIG as u32));
        assert!(
            matches!(
                c.tx_data.back().map(|d| &d.from),
                Some(TxFrom::Pooled { .. })
            ),
            "from a slot's buffer"
        );
        assert!(take_tx(&mut c) == chunked_reply(3, &payload));
        assert_eq!((c.held, c.queued), (0, 0));
        // A frontend that will not frame it: read through a slot's buffer and copied, counted
        // once.
        let refused = (TRAILER | NO_PIECES) as u64 | 4;
        feed(&mut c, &mut ring, &read(refused, 0, BIG as u32));
        assert!(take_tx(&mut c) == chunked_reply(refused, &payload));
        let stats = &c.targets[0].exec.stats;
        assert_eq!((stats.reads, stats.bytes_read), (3, 3 * BIG as u64));
    }

    /// A reply with headers between pieces of its data is built from a slot's buffer, on an
    /// inline export as on one that completes on its own thread.
    #[test]
    fn chunked_read_replies() {
        let mut ring = Ring::new(8).unwrap();
        for spec in ["m=mem:1M", "m=memthread:1M"] {
            let (mut c, _peer) = conn_with(spec, true);
            let payload: Vec<u8> = (0..2500u32).map(|i| (i % 7) as u8).collect();
            feed(&mut c, &mut ring, &write(1, 0, 2500, &payload));
            settle_async(&mut c, &mut ring);
            assert_eq!(take_tx(&mut c), status_reply(1, Status::Ok), "{spec}");
            feed(&mut c, &mut ring, &read(2, 0, 2500));
            settle_async(&mut c, &mut ring);
            let tx = take_tx(&mut c);
            assert!(tx == chunked_reply(2, &payload), "{spec}: chunked reply");
            assert_eq!(c.free_slots.len(), 4, "{spec}: slots free again");
        }
    }

    /// Waits for what a thread-completing backend has in flight and answers it.
    fn settle_async(c: &mut Conn, ring: &mut Ring) {
        settle_async_to(c, ring, 0);
    }

    /// Completes backend requests until `left` requests are in flight (those that wait for
    /// something else than the backend: a broadcast's acknowledgements).
    fn settle_async_to(c: &mut Conn, ring: &mut Ring, left: u32) {
        while c.inflight > left {
            let mut pfd = libc::pollfd {
                fd: c.targets[0]
                    .exec
                    .notifier()
                    .expect("only asynchronous exports have requests in flight"),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one descriptor the backend owns.
            unsafe { libc::poll(&mut pfd, 1, 5000) };
            let mut done = Vec::new();
            c.targets[0]
                .exec
                .reap(&mut Pusher(ring), &mut |t, r| done.push((t, r)));
            for (tag, res) in done {
                super::finish_result(c, tag as u16, tag, res);
            }
        }
    }

    #[test]
    fn solicited_data_out_of_order_or_for_no_write_breaks_the_protocol() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        feed(&mut c, &mut ring, &data(2, 0, &[1; 16]));
        assert!(
            c.closing && c.targets[0].exec.stats.protocol_errors == 1,
            "no write waits in slot 2"
        );

        let (mut c, _peer) = conn("m=mem:1M");
        feed(&mut c, &mut ring, &write(1, 0, 1024, &[]));
        let slot = u16::from_le_bytes([c.tx[1], c.tx[2]]);
        feed(&mut c, &mut ring, &data(slot, 512, &[1; 512]));
        assert!(
            c.closing && c.targets[0].exec.stats.protocol_errors == 1,
            "a gap before offset 512"
        );

        let (mut c, _peer) = conn("m=mem:1M");
        feed(&mut c, &mut ring, &write(1, 0, 1024, &[]));
        let slot = u16::from_le_bytes([c.tx[1], c.tx[2]]);
        feed(&mut c, &mut ring, &data(slot, 0, &[1; 2048]));
        assert!(
            c.closing && c.targets[0].exec.stats.protocol_errors == 1,
            "past the write's end"
        );
    }

    #[test]
    fn an_aborted_write_gives_its_slot_and_buffer_back_unanswered() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M");
        feed(&mut c, &mut ring, &write(1, 0, 4096, &[7; 512]));
        let slot = u16::from_le_bytes([c.tx[1], c.tx[2]]);
        take_tx(&mut c);
        assert_eq!((c.free_slots.len(), c.held), (3, 4096));
        let mut abort = vec![b'A'];
        abort.extend_from_slice(&slot.to_le_bytes());
        feed(&mut c, &mut ring, &abort);
        assert!(c.tx.is_empty(), "an aborted write is never answered");
        assert_eq!((c.free_slots.len(), c.held), (4, 0));
        assert_eq!(c.targets[0].exec.stats.writes, 0);
        // Releasing a slot that holds no waiting write changes nothing.
        feed(&mut c, &mut ring, &abort);
        assert_eq!(c.free_slots.len(), 4);
        // Its data, if it came now, is for no write.
        feed(&mut c, &mut ring, &data(slot, 512, &[1; 512]));
        assert!(c.closing && c.targets[0].exec.stats.protocol_errors == 1);
    }

    #[test]
    fn a_refused_write_is_answered_without_soliciting_anything() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=mem:1M,ro");
        feed(&mut c, &mut ring, &write(3, 0, 4096, &[]));
        assert_eq!(take_tx(&mut c), status_reply(3, Status::ReadOnly));
        assert_eq!(c.free_slots.len(), 4);
    }

    #[test]
    fn a_write_waits_for_its_data_on_an_asynchronous_backend_too() {
        let mut ring = Ring::new(8).unwrap();
        let (mut c, _peer) = conn("m=memthread:1M");
        feed(&mut c, &mut ring, &write(9, 0, 1024, &[5; 100]));
        let slot = u16::from_le_bytes([c.tx[1], c.tx[2]]);
        take_tx(&mut c);
        feed(&mut c, &mut ring, &data(slot, 100, &[6; 924]));
        assert!(
            c.tx.is_empty() && c.inflight == 1,
            "running on the helper thread"
        );
        settle_async(&mut c, &mut ring);
        assert_eq!(take_tx(&mut c), status_reply(9, Status::Ok));
        assert_eq!(c.inflight, 0);
    }
}
