//! A stream connection's socket and buffers: non-blocking receive into `rx`, replies gathered
//! in `tx` and sent as the socket takes them, with a high-water mark so a client that never
//! reads cannot make the target buffer without bound.

use std::os::fd::{AsRawFd, OwnedFd};

use blkwire_backend::{AlignedBuf, Extent, Submitter, MAX_EXTENTS};
use blkwire_wire::{Status, HEADER_LEN};
use io_uring::{opcode, types};

use super::ring::{ud, Pusher, KIND_POLL_OUT};
use super::stream::{parse_frames, writes_wait};
use crate::budget::Account;
use crate::bufpool::Buffers;
use crate::executor::{Executor, Started};
use crate::frontend::{Piece, Req, StreamFrontend};
use crate::log::Level;
use crate::tls::{self, TlsStream};

#[derive(Default)]
pub(super) struct Slot {
    pub(super) busy: bool,
    pub(super) req: Option<Req>,
    pub(super) buf: Option<AlignedBuf>,
    /// An allocation query's answer, filled by a backend that runs queries on its own threads
    /// (counted in `Conn::lists`).
    pub(super) extents: Vec<Extent>,
    /// What that query's reply may take, held in `Conn::held` while it runs.
    pub(super) reply_held: usize,
    /// What that query's list is counted at in `Conn::lists` while it runs: room for the
    /// extents its reply can hold, reserved before it starts (`stream::query_extents`).
    pub(super) list_held: usize,
    /// A WRITE waiting for the data the frontend solicited: how many bytes of it are in `buf`
    /// (or in `brought` while it waits for memory).
    pub(super) awaiting: Option<u32>,
    /// The data a WRITE brought while it waits in `Conn::deferred` for memory, before it gets
    /// its full-length `buf` (`stream::park_with_data`): only what it brought, so that the
    /// writes waiting this way hold no more than their slots times the most one may bring.
    pub(super) brought: Option<AlignedBuf>,
    /// When the block request running on the backend started (its latency is recorded when
    /// it finishes).
    pub(super) started: Option<Started>,
}

/// A READ's data, sent from where it is instead of copied into `tx`: at 1 MiB that copy was
/// a third of the reactor thread's time (perf, rbd: export). Goes on the wire after
/// `tx[..at]` and before `tx[at..]`.
pub(super) struct TxData {
    pub(super) at: usize,
    pub(super) from: TxFrom,
    pub(super) len: usize,
    pub(super) sent: usize,
}

/// Where queued READ data lies.
pub(super) enum TxFrom {
    /// The buffer the backend filled, from `offset` on: its last stretch in the reply. Back
    /// to the pool once sent, when `held` bytes of data held by requests are given back.
    Pooled {
        buf: AlignedBuf,
        offset: usize,
        held: usize,
    },
    /// An earlier stretch of such a buffer, which a later entry owns: entries leave in order,
    /// so the buffer outlives it.
    Part(*const u8),
    /// The export's own memory ([`crate::executor::Executor::read_mapped`]), valid as long
    /// as the connection's targets, which the connection keeps until it is dropped.
    Mapped(*const u8),
}

impl TxData {
    /// Where the bytes not sent yet start, and how many there are. An address and a length,
    /// not a slice: other reactors may write an export's memory while it waits here, and only
    /// the kernel reads it (a racing WRITE shows through, as PROTOCOL.md §2 allows).
    pub(super) fn rest(&self) -> (*const u8, usize) {
        let start = match &self.from {
            TxFrom::Pooled { buf, offset, .. } => buf.as_slice()[*offset..][..self.len].as_ptr(),
            TxFrom::Part(p) | TxFrom::Mapped(p) => *p,
        };
        // SAFETY: `sent <= len`, inside the buffer or the mapped range.
        (unsafe { start.add(self.sent) }, self.len - self.sent)
    }
}

/// One export a connection serves: a request's [`Req::target`] indexes the connection's
/// list of them. Native and NBD connections have one; an NVMe/TCP I/O queue has one per
/// namespace of its controller, each admitted into its own session (`crate::session`), so
/// every export's access rules, session limits and memory floor apply as if it were alone.
pub(super) struct Target {
    pub(super) exec: Executor,
    /// The export completes inside `start` (mem:, null:).
    pub(super) inline: bool,
    /// The session and queue this connection is in that export's session.
    pub(super) session: u32,
    pub(super) queue: u16,
    /// Its session was closed (export or namespace removed, rules changed) while others of the
    /// connection live on: its requests are answered NO_EXPORT (NVMe: Invalid Namespace); what
    /// it has in flight still completes.
    pub(super) fenced: bool,
    /// The memory floor this queue reserved in that session (the connection's buffers are
    /// charged to the first target's account, `Conn::mem`): held until the connection closes.
    pub(super) _floor: Option<Account>,
}

pub(super) struct Conn {
    pub(super) sock: OwnedFd,
    pub(super) incarnation: u32,
    pub(super) fe: Box<dyn StreamFrontend>,
    /// The exports served, indexed by `Req::target` (never empty; small: no map, no allocation
    /// per request). The connection's own counters (frames, errors) are the first one's.
    pub(super) targets: Vec<Target>,
    /// The first target's session and queue (logs).
    pub(super) session: u32,
    pub(super) queue: u16,
    pub(super) max_io: u32,
    pub(super) peer: String,
    pub(super) rx: Vec<u8>,
    pub(super) rx_start: usize,
    pub(super) rx_end: usize,
    pub(super) tx: Vec<u8>,
    pub(super) tx_sent: usize,
    /// The most `tx` held since it last drained (`all_sent`): what the bursts of this
    /// connection need, so that it keeps that much capacity instead of giving it back and
    /// faulting it in again at every burst.
    pub(super) tx_peak: usize,
    /// READ data sent from where it lies (the buffer the backend filled, or the export's
    /// memory), each between two stretches of `tx` (`Conn::queue_data`), in order.
    pub(super) tx_data: std::collections::VecDeque<TxData>,
    /// Where a chunked READ reply's data goes (`StreamFrontend::encode_read_framing`), kept
    /// for its capacity.
    pub(super) pieces: Vec<Piece>,
    /// Bytes of `tx_data` not sent yet.
    pub(super) tx_data_left: usize,
    /// Bytes of the buffers in `tx_data` (part of `held` until they are sent).
    pub(super) queued: usize,
    pub(super) slots: Vec<Slot>,
    /// Slots free for server-assigned requests (frontends whose requests carry cookies).
    pub(super) free_slots: Vec<u16>,
    /// Requests waiting in their slots for memory, oldest first (`run_deferred`): WRITEs that
    /// came without their data (their solicitation, R2T, goes out once the budget covers
    /// their buffer), WRITEs parked with the part of their data they brought (`brought`), and
    /// other requests that had to wait for memory while writes waited for their data
    /// (`park`). Bounded by the slots.
    pub(super) deferred: std::collections::VecDeque<u16>,
    pub(super) inflight: u32,
    /// Scratch for allocation maps (NBD block status) of exports that answer inline (counted
    /// in `lists`).
    pub(super) extents: Vec<Extent>,
    /// Bytes of allocation lists (`extents`, and the slots'): a running query's list at the
    /// room reserved for it (`Slot::list_held`: the extents its reply can hold, at most
    /// [`extents_bound`]`(MAX_EXTENTS)`), which a backend thread filling it never grows past, and the
    /// capacity of the others.
    pub(super) lists: usize,
    /// Spare data buffers for the next requests.
    pub(super) bufs: Buffers,
    /// Bytes held for requests: their data buffers (in flight, or waiting for solicited
    /// data), the data parked writes brought, and the replies of allocation queries running
    /// on a backend's thread (`Slot::reply_held`).
    pub(super) held: usize,
    /// The part of `held` that is WRITE data (in buffers, or what parked writes brought):
    /// it goes to the backend, never into `tx`, so the transmit buffer's growth foreseen
    /// from `held` leaves it out (it is counted once, in the pool).
    pub(super) held_in: usize,
    /// A COPY is running (at most one per queue): its bounce buffer, up to
    /// [`blkwire_backend::COPY_CHUNK`], counts in the footprint.
    pub(super) copying: bool,
    /// The socket may hold unread bytes (we stopped before EAGAIN).
    pub(super) readable: bool,
    /// Waiting for POLLOUT after a short send.
    pub(super) want_out: bool,
    /// No more requests are read; close once in-flight I/O is answered and sent.
    pub(super) closing: bool,
    /// A LOGOUT (iSCSI Logout, native LOGOUT, NBD DISC) that came while requests ran: answered
    /// once they are, its answer the last (iSCSI: no response follows the Logout Response).
    pub(super) logout: Option<Req>,
    /// The socket is dead: drop the connection as soon as nothing is in flight.
    pub(super) dead: bool,
    pub(super) bytes_sent: u64,
    /// TLS session: `receive` and `transmit` go through it instead of the socket calls (one
    /// branch each; plain connections pay nothing more). Lives on this reactor only.
    pub(super) tls: Option<Box<TlsStream>>,
    /// This connection's part of the memory budget: its buffers stay within what it holds.
    pub(super) mem: Account,
    /// A request or frame waits for memory the budget could not give: nothing more is read
    /// until the reactor retries (`Reactor::starved`).
    pub(super) starved: bool,
    /// On the reactor's list of starved connections.
    pub(super) waiting: bool,
    /// Parsing stopped at a whole request the budget cannot cover yet (`Cover::Wait`): a
    /// closing connection (the peer shut its side) stays, retried, until it is answered.
    pub(super) request_waits: bool,
    /// Frames received when the reactor last looked: unchanged a second later means idle.
    pub(super) idle_mark: u64,
    /// Counted against `--max-connections` until the connection closes.
    pub(super) _counted: Option<crate::ConnCount>,
    /// [`crate::frontend::Kind::Broadcast`] requests waiting for the other reactors (each in
    /// flight until answered). Empty but for a PERSISTENT RESERVE OUT's moment.
    pub(super) broadcasts: Vec<Broadcast>,
    /// The number the next broadcast gets (acknowledgements name it).
    pub(super) next_broadcast: u32,
}

/// A request whose state change the other reactors must install before it is answered.
pub(super) struct Broadcast {
    pub(super) req: Req,
    pub(super) seq: u32,
    /// Not sent yet (the reactor sends it after servicing the connection).
    pub(super) update: Option<std::sync::Arc<crate::reservations::Update>>,
    /// Acknowledgements still to come.
    pub(super) left: usize,
}

/// One receive step, for plain sockets and TLS alike.
enum Step {
    /// Bytes moved.
    Moved(usize),
    /// The peer closed.
    Closed,
    /// Nothing until the socket is readable again.
    Again,
    /// TLS: the session must send before it reads on (a key update answered while the socket
    /// and the gathered records are full); the bytes it took are inside it, so no POLLIN may
    /// come: the records are sent at once and the read goes on, or, the socket full, the
    /// connection stays readable and is serviced again once POLLOUT drains them.
    AgainAfterSend,
    Interrupted,
    Failed(String),
}

impl Step {
    fn from_sys(n: isize) -> Step {
        if n > 0 {
            return Step::Moved(n as usize);
        }
        if n == 0 {
            return Step::Closed;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) => Step::Again,
            Some(libc::EINTR) => Step::Interrupted,
            _ => Step::Failed(err.to_string()),
        }
    }

    fn from_tls(io: tls::Io) -> Step {
        match io {
            tls::Io::Done(n) => Step::Moved(n),
            tls::Io::Closed => Step::Closed,
            tls::Io::Again { out: false } => Step::Again,
            tls::Io::Again { out: true } => Step::AgainAfterSend,
            tls::Io::Failed(e) => Step::Failed(e),
        }
    }
}

/// Receive buffer of a new connection: one frame of up to 1 MiB plus room to batch small ones.
pub(super) fn rx_base(max_io: u32) -> usize {
    (max_io as usize).min(1 << 20) + HEADER_LEN + (256 << 10)
}

/// What a stream connection reserves of the memory budget when admitted, so that it can always
/// serve one request of up to 1 MiB: its receive and transmit buffers and one data buffer (for
/// a backend that answers later, or a read replied in chunks).
pub fn stream_floor(max_io: u32) -> usize {
    // OpenSSL's record buffers are in it for every connection: which are TLS is not known
    // where the floor is reserved (the session's admission).
    rx_base(max_io) + TX_KEEP + (max_io as usize).min(1 << 20) + tls::SESSION_BUFFERS
}

/// Room for a reply's framing beside its data (headers, digests, chunk headers).
pub(super) const REPLY_SLACK: usize = 4096;

/// The most an allocation query's list holds when it asks for `max` extents: backends append
/// at most that many, and never more than MAX_EXTENTS (`Backend::allocation`), 1 MiB.
pub(super) fn extents_bound(max: usize) -> usize {
    max.min(MAX_EXTENTS) * std::mem::size_of::<Extent>()
}

/// Extents a list keeps between queries (4 KiB): small maps need no allocation each, and the
/// 1 MiB a large map took is not kept in every slot a query once ran in.
const EXTENTS_KEEP: usize = 256;

/// Bytes an allocation list holds.
pub(super) fn list_bytes(list: &Vec<Extent>) -> usize {
    list.capacity() * std::mem::size_of::<Extent>()
}

impl Conn {
    pub(super) fn fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }

    /// Reply bytes not sent yet: plaintext in `tx`, and for TLS the records gathered but not
    /// yet on the socket.
    pub(super) fn tx_backlog(&self) -> usize {
        let sealed = self.tls.as_ref().map_or(0, |t| t.get_ref().pending_out());
        self.tx.len() - self.tx_sent + sealed + self.tx_data_left
    }

    /// Reply data not sent yet and data held by requests, each byte once: what the
    /// high-water mark bounds before a data request is taken (`request_cover`).
    pub(super) fn data_pending(&self) -> usize {
        self.tx_backlog() + self.held - self.queued
    }

    /// `data_pending` but WRITE data (`held_in`), which never goes into `tx`: what the mark
    /// bounds before a READ is taken. Counted, the data of writes parked behind a READ kept
    /// it waiting on the mark while those writes waited behind it, and nothing moved again.
    pub(super) fn replies_pending(&self) -> usize {
        self.tx_backlog() + self.held_out()
    }

    /// Sends `len` bytes of `buf` (a READ's data) from where they are, after `tx[..at]`
    /// (its reply's prefix, the last thing appended but a suffix); the buffer goes back to
    /// the pool once sent. Plain sockets only: TLS seals what `tx` holds.
    pub(super) fn queue_data(&mut self, at: usize, buf: AlignedBuf, len: usize) {
        self.queue_pieces(buf, &[Piece { at, from: 0, len }], len);
    }

    /// Stops a frontend's pieces (`StreamFrontend::encode_read_framing`) of `len` bytes of data
    /// that would go wrong: one outside the data would send other memory, an empty one would
    /// never leave, and pieces out of order would garble the stream.
    pub(super) fn check_pieces(&self, pieces: &[Piece], len: usize) {
        let mut at = self.tx_sent;
        for p in pieces {
            assert!(
                p.len > 0 && p.from + p.len <= len && at <= p.at && p.at <= self.tx.len(),
                "a READ reply's piece outside its data or out of order: {p:?}"
            );
            at = p.at;
        }
    }

    /// `queue_data` for a reply that carries its data in several stretches, each between two
    /// stretches of `tx` (`StreamFrontend::encode_read_framing`); `held` is what the request
    /// holds, given back with the buffer once its last piece is sent.
    pub(super) fn queue_pieces(&mut self, buf: AlignedBuf, pieces: &[Piece], held: usize) {
        let (last, earlier) = pieces.split_last().expect("a reply with data has pieces");
        self.check_pieces(pieces, held.min(buf.len()));
        let base = buf.as_slice().as_ptr();
        for p in earlier {
            // SAFETY: a piece lies inside the data the frontend was given, inside `buf`.
            self.queue(p.at, TxFrom::Part(unsafe { base.add(p.from) }), p.len);
        }
        let from = TxFrom::Pooled {
            buf,
            offset: last.from,
            held,
        };
        self.queue(last.at, from, last.len);
        self.queued += held;
    }

    /// Sends `len` bytes at `data`, memory of the export that stays mapped while the
    /// connection holds its targets (`Executor::read_mapped`), after `tx[..at]`. It holds no
    /// buffer, but counts as reply data not yet sent (`tx_backlog`).
    pub(super) fn queue_mapped(&mut self, at: usize, data: *const u8, len: usize) {
        self.queue(at, TxFrom::Mapped(data), len);
    }

    fn queue(&mut self, at: usize, from: TxFrom, len: usize) {
        debug_assert!(self.tls.is_none());
        self.tx_data.push_back(TxData {
            at,
            from,
            len,
            sent: 0,
        });
        self.tx_data_left += len;
    }

    /// `n` bytes went out: advance through `tx` and the queued data in wire order, giving
    /// back the buffers sent in full.
    pub(super) fn consume(&mut self, mut n: usize) {
        self.bytes_sent += n as u64;
        while n > 0 {
            let next = self.tx_data.front().map_or(self.tx.len(), |d| d.at);
            let plain = n.min(next - self.tx_sent);
            self.tx_sent += plain;
            n -= plain;
            let Some(d) = self.tx_data.front_mut().filter(|d| d.at == self.tx_sent) else {
                // The kernel never reports more than it was given.
                debug_assert_eq!(n, 0);
                break;
            };
            let part = n.min(d.len - d.sent);
            d.sent += part;
            n -= part;
            self.tx_data_left -= part;
            if d.sent == d.len {
                let d = self.tx_data.pop_front().expect("front");
                if let TxFrom::Pooled { buf, held, .. } = d.from {
                    self.queued -= held;
                    self.held -= held;
                    self.bufs.give_back(buf);
                }
            }
        }
    }

    /// Stop reading when this much reply data waits to be sent: a client that sends requests but
    /// never reads replies cannot make us buffer without bound.
    pub(super) fn tx_high_water(&self) -> usize {
        (4 << 20).max(2 * self.max_io as usize + 2 * HEADER_LEN)
    }

    /// Appends a reply that carries no read data.
    pub(super) fn reply(&mut self, req: &Req, status: Status) {
        if self.fe.reply(req, status, &mut self.tx) {
            self.count_reply(status);
        }
    }

    pub(super) fn count_reply(&mut self, status: Status) {
        let stats = self.stats();
        stats.frames_out += 1;
        if status != Status::Ok {
            stats.errors += 1;
        }
    }

    /// The connection's own counters (frames, errors, protocol errors): the first target's.
    pub(super) fn stats(&mut self) -> &mut crate::stats::QueueStats {
        &mut self.targets[0].exec.stats
    }

    /// Frames received so far (idle and progress checks).
    pub(super) fn frames_in(&self) -> u64 {
        self.targets[0].exec.stats.frames_in
    }

    /// The executor of the target `req` addresses (checked by `dispatch` before anything runs).
    pub(super) fn exec(&mut self, req: &Req) -> &mut Executor {
        &mut self.targets[req.target as usize].exec
    }

    /// Whether the export `req` addresses completes inline (an unknown target: as if it did, it
    /// is refused before it needs a buffer).
    pub(super) fn inline(&self, req: &Req) -> bool {
        self.targets
            .get(req.target as usize)
            .is_none_or(|t| t.inline)
    }

    pub(super) fn violation(&mut self, what: &dyn std::fmt::Display) {
        crate::log!(
            Level::Warn,
            "session {} queue {} from {}: protocol violation: {what}; closing the queue",
            self.session,
            self.queue,
            self.peer
        );
        self.stats().protocol_errors += 1;
        self.closing = true;
        self.rx_start = self.rx_end;
    }

    /// Room for the rest of a frame of `total` bytes that starts at rx_start (decode checked
    /// it against the granted max I/O; NBD may send 32 MiB writes). The buffer grows with what
    /// arrives, doubling when it is full, never with what a header announces: a header that
    /// promises 32 MiB and sends nothing commits no memory. Growth the memory budget cannot
    /// cover waits (the connection is starved and reads nothing more).
    pub(super) fn make_room(&mut self, total: usize) {
        if self.rx.len() - self.rx_start >= total {
            return;
        }
        self.rx.copy_within(self.rx_start..self.rx_end, 0);
        self.rx_end -= self.rx_start;
        self.rx_start = 0;
        if self.rx.len() < total && self.rx_end == self.rx.len() {
            let grown = (2 * self.rx.len()).clamp(self.rx_end + 1, total);
            if total + TX_KEEP + self.session_buffers() > self.mem.cap() {
                // It would never fit: waiting would hold the connection forever.
                return self.violation(&format_args!(
                    "a frame of {total} bytes does not fit this connection's share of the \
                     memory budget (--max-memory)"
                ));
            }
            if !self.covers_or_trim(|c| grown + c.besides_rx(0)) {
                return;
            }
            self.rx.reserve_exact(grown - self.rx.len());
            self.rx.resize(grown, 0);
        }
    }

    /// The transmit buffer's capacity once `add` more bytes are appended: unchanged if they
    /// fit, else grown by at least half (so a run of small appends does not reallocate each
    /// time, and the growth is known before it happens, unlike `Vec`'s doubling).
    pub(super) fn tx_after(&self, add: usize) -> usize {
        let (len, cap) = (self.tx.len(), self.tx.capacity());
        if len + add <= cap {
            cap
        } else {
            cap + (len + add - cap).max(cap / 2)
        }
    }

    /// Grows the transmit buffer as [`Conn::tx_after`] says, before `add` bytes are appended.
    pub(super) fn grow_tx(&mut self, add: usize) {
        let cap = self.tx_after(add);
        if cap > self.tx.capacity() {
            self.tx.reserve_exact(cap - self.tx.len());
        }
    }

    /// Bytes this connection's buffers hold, counting the replies of reads and allocation
    /// queries in flight, which will be copied into the transmit buffer, and allocation lists.
    pub(super) fn footprint(&self) -> usize {
        self.rx.capacity() + self.besides_rx(0)
    }

    /// What the buffers other than the receive buffer hold, the transmit buffer grown for
    /// `extra_tx` more bytes of reply: what `footprint`, `covers` and `make_room` add to the
    /// receive buffer each has in mind.
    fn besides_rx(&self, extra_tx: usize) -> usize {
        self.tx_after(self.held_out() + extra_tx)
            + self.bufs.allocated()
            + self.copy_memory()
            + self.lists
            + self.tls_memory()
    }

    /// What the connection holds at least, idle: the receive buffer it needs (`rx_needed`)
    /// and, on TLS, OpenSSL's record buffers. What "never fits" is measured against.
    pub(super) fn least_held(&self) -> usize {
        self.rx_needed() + self.session_buffers()
    }

    /// OpenSSL's record buffers on a TLS connection, none on a plain one.
    fn session_buffers(&self) -> usize {
        if self.tls.is_some() {
            tls::SESSION_BUFFERS
        } else {
            0
        }
    }

    /// What a TLS session holds: the ciphertext gathered for the socket and OpenSSL's record
    /// buffers (none on a plain connection).
    fn tls_memory(&self) -> usize {
        self.tls.as_ref().map_or(0, |t| t.get_ref().out_capacity()) + self.session_buffers()
    }

    /// Held bytes still to be copied into `tx`: read data (and allocation query replies) not
    /// yet appended nor queued to be sent from its buffer.
    pub(super) fn held_out(&self) -> usize {
        debug_assert!(
            self.queued + self.held_in <= self.held,
            "held bytes counted once"
        );
        self.held - self.queued - self.held_in
    }

    /// What the COPY running on this queue may hold (its bounce buffer).
    pub(super) fn copy_memory(&self) -> usize {
        if self.copying {
            blkwire_backend::COPY_CHUNK as usize
        } else {
            0
        }
    }

    /// Whether the budget covers the buffers once a request adds `extra_tx` bytes of reply and
    /// `extra` bytes of something else (an allocation list, a COPY's bounce buffer); if not,
    /// the connection is starved.
    pub(super) fn covers(&mut self, extra_tx: usize, extra: usize) -> bool {
        self.covers_or_trim(|c| c.rx.capacity() + c.besides_rx(extra_tx) + extra)
    }

    /// As [`Conn::covers`], for a request that takes a data buffer of `len` bytes (0: none)
    /// from the pool: a spare one costs nothing more, a new one its size.
    pub(super) fn covers_buffer(&mut self, extra_tx: usize, len: usize) -> bool {
        self.covers_or_trim(|c| {
            let new = if len == 0 || c.bufs.has_spare(len) {
                0
            } else {
                len
            };
            c.rx.capacity() + c.besides_rx(extra_tx) + new
        })
    }

    /// Whether the budget covers `want` (what the buffers need, computed from their state),
    /// once spare buffers are given up if it must. `want` is computed again after: a request
    /// that counted on a spare buffer needs a new one once the spares are gone.
    fn covers_or_trim(&mut self, want: impl Fn(&Conn) -> usize) -> bool {
        if self.mem.try_cover(want(self)) {
            return true;
        }
        // Spare buffers of an idle connection are the first thing to give up (not while a
        // write waiting for its data holds one: those are not spare).
        if self.inflight == 0 && self.held == 0 && self.bufs.allocated() > 0 {
            self.bufs.clear();
            self.settle_memory();
            if self.mem.try_cover(want(self)) {
                return true;
            }
        }
        self.starved = true;
        false
    }

    /// Whether the reactor's idle tick has work here, so it must come even if nothing happens:
    /// buffers above the connection's floor to trim, or spare copy sources kept, which go once
    /// their exports are removed.
    pub(super) fn idle_work(&self) -> bool {
        self.mem.above_floor() || self.targets.iter().any(|t| t.exec.holds_spare_sources())
    }

    /// Charges or gives back the difference between what the buffers hold and the charge.
    pub(super) fn settle_memory(&mut self) {
        let have = self.footprint();
        self.mem.settle(have);
    }

    /// An allocation list whose query was answered, counted in `lists` as `counted` bytes:
    /// emptied, and shrunk to what a list keeps.
    pub(super) fn rest_list(&mut self, list: &mut Vec<Extent>, counted: usize) {
        list.clear();
        list.shrink_to(EXTENTS_KEEP);
        self.lists = self.lists - counted + list_bytes(list);
    }

    /// What the receive buffer shrinks to when trimmed (`trim`): its initial size, or the
    /// bytes it holds that are not consumed yet (the frame being taken), or what it is now if
    /// smaller. What a request must fit beside, where `rx.capacity()` may still be what an
    /// earlier large frame made it.
    pub(super) fn rx_needed(&self) -> usize {
        let keep = rx_base(self.max_io).max(self.rx_end - self.rx_start);
        keep.min(self.rx.capacity())
    }

    /// An idle connection gives back what its buffers grew to beyond their initial size. The
    /// receive buffer shrinks only when empty: one holding part of a frame still arriving
    /// (a large WRITE sent slowly) keeps its size, or every idle tick would shrink and the
    /// next bytes regrow it (see `trim_starved`).
    pub(super) fn trim(&mut self) {
        if self.inflight > 0 {
            return;
        }
        self.bufs.clear();
        // No query runs (none in flight): no backend thread holds a list.
        for s in &mut self.slots {
            s.extents = Vec::new();
        }
        self.extents = Vec::new();
        self.lists = 0;
        if self.tx_backlog() == 0 {
            self.tx.clear();
            self.tx_sent = 0;
            self.tx.shrink_to(TX_KEEP);
            if let Some(t) = self.tls.as_mut() {
                t.get_mut().release_out();
            }
        }
        if self.rx_start == self.rx_end {
            self.shrink_rx();
        }
        self.settle_memory();
    }

    /// `trim` for a connection starved with nothing running, retried: it waits only for what
    /// its own buffers grew to, so the receive buffer also shrinks around the bytes it holds
    /// (a frame that waits for memory: a READ behind the buffer a large WRITE grew). Called
    /// between frames only: nothing holds an offset into `rx`.
    pub(super) fn trim_starved(&mut self) {
        if self.inflight > 0 {
            return;
        }
        self.shrink_rx();
        self.trim();
    }

    /// The receive buffer down to `rx_needed`, what it holds moved to its start.
    fn shrink_rx(&mut self) {
        let keep = self.rx_needed();
        if self.rx.len() > keep {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
            self.rx.truncate(keep);
            self.rx.shrink_to_fit();
        }
    }
}

/// Bytes one `receive` reads at most (less in tests, to fit a socket's buffer).
#[cfg(not(test))]
pub(super) const RECEIVE_BUDGET: usize = 4 << 20;
#[cfg(test)]
pub(super) const RECEIVE_BUDGET: usize = 64 << 10;

/// Reads what waits on the socket, `RECEIVE_BUDGET` bytes at most, and dispatches every
/// complete frame. Stopped at the budget it returns true, `readable` left set: the reactor
/// serves it again after its other connections have had a turn (`service_conn`), so a peer
/// that sends without end (frames answered with nothing, that never raise the transmit mark)
/// cannot hold the reactor.
pub(super) fn receive(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) -> bool {
    let mut taken = 0;
    loop {
        // Dispatch what is buffered first: it may already hold many frames.
        parse_frames(c, idx, sq);
        // Starved (waiting for memory): read nothing more until the reactor retries it, but
        // while writes wait for data (solicited, or for the memory to solicit it): that data
        // completes the writes holding the memory, and the requests behind it wait in slots
        // (`parse_frames`), so stopping here would wait for memory only it frees. Reading
        // only fills the receive buffer as it is: it grows in `make_room`, under the budget.
        if c.closing
            || !c.readable
            || (c.starved && !writes_wait(c))
            || c.tx_backlog() >= c.tx_high_water()
        {
            return false;
        }
        if c.rx_end == c.rx.len() {
            if c.rx_start == 0 {
                return false; // a whole frame is buffered but blocked (tx high water)
            }
            c.rx.copy_within(c.rx_start..c.rx_end, 0);
            c.rx_end -= c.rx_start;
            c.rx_start = 0;
        }
        let step = match &mut c.tls {
            // SAFETY: recv into the unused tail of our own buffer.
            None => Step::from_sys(unsafe {
                libc::recv(
                    c.fd(),
                    c.rx[c.rx_end..].as_mut_ptr().cast(),
                    c.rx.len() - c.rx_end,
                    libc::MSG_DONTWAIT,
                )
            }),
            // The record layer reads the socket itself: at most a record of ciphertext waits
            // inside it, the plaintext lands where a recv would have put it.
            Some(t) => Step::from_tls(tls::read(t, &mut c.rx[c.rx_end..])),
        };
        match step {
            Step::Moved(n) => {
                c.rx_end += n;
                taken += n;
                if taken >= RECEIVE_BUDGET {
                    parse_frames(c, idx, sq);
                    return true;
                }
                continue;
            }
            Step::Closed => {
                // Orderly shutdown by the peer; whatever it sent before is still answered.
                parse_frames(c, idx, sq);
                c.closing = true;
                c.readable = false;
                crate::log!(
                    Level::Debug,
                    "session {} queue {}: peer closed",
                    c.session,
                    c.queue
                );
            }
            Step::Again => c.readable = false,
            Step::AgainAfterSend => {
                // Its records go out now, and the read goes on once they are out: left for
                // POLLOUT, nothing armed it when the plaintext backlog was empty and the next
                // send emptied the records at once, and no POLLIN comes for bytes the session
                // already took from the socket (the connection stalled). A full socket arms
                // POLLOUT, which services the connection again (it stays readable).
                let Some(t) = c.tls.as_mut() else {
                    return false;
                };
                match t.get_mut().flush_out() {
                    Ok(true) => continue,
                    Ok(false) if !c.want_out => wait_for_room(c, idx, sq),
                    Ok(false) => {}
                    Err(e) => tls_send_failed(c, &e.to_string()),
                }
            }
            Step::Interrupted => continue,
            Step::Failed(err) => {
                crate::log!(
                    Level::Info,
                    "session {} queue {}: receive failed: {err}",
                    c.session,
                    c.queue
                );
                c.closing = true;
                c.dead = true;
                c.readable = false;
            }
        }
        return false;
    }
}

/// Sends as much of the reply backlog as the socket takes; arms POLLOUT if it fills up.
pub(super) fn transmit(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    if c.tls.is_some() {
        return transmit_tls(c, idx, sq);
    }
    while c.tx_sent < c.tx.len() || !c.tx_data.is_empty() {
        let n = if c.tx_data.is_empty() {
            // SAFETY: send from our own buffer.
            unsafe {
                libc::send(
                    c.fd(),
                    c.tx[c.tx_sent..].as_ptr().cast(),
                    c.tx.len() - c.tx_sent,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            }
        } else {
            send_gathered(c)
        };
        if n >= 0 {
            c.consume(n as usize);
            continue;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return wait_for_room(c, idx, sq),
            _ => {
                crate::log!(
                    Level::Info,
                    "session {} queue {}: send failed: {err}",
                    c.session,
                    c.queue
                );
                c.dead = true;
                c.closing = true;
                return;
            }
        }
    }
    all_sent(c);
}

/// The socket is full: keep what waits (dropping what was sent from the buffer's front) and
/// come back on POLLOUT.
fn wait_for_room(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    // A reader slower than we answer never lets the buffer drain completely, so what was sent
    // is dropped from its front here; otherwise the buffer would grow by every byte ever sent.
    // Only once the sent part is at least as long as what waits, so the move costs no more than
    // the sending did.
    c.tx_peak = c.tx_peak.max(c.tx.len());
    if c.tx_sent >= c.tx.len() - c.tx_sent {
        c.tx.drain(..c.tx_sent);
        // Queued data waits at or after what was sent (`consume` stops at it).
        for d in &mut c.tx_data {
            d.at -= c.tx_sent;
        }
        c.tx_sent = 0;
    }
    c.want_out = true;
    let poll = opcode::PollAdd::new(types::Fd(c.fd()), libc::POLLOUT as u32)
        .build()
        .user_data(ud(KIND_POLL_OUT, c.incarnation, idx, 0));
    sq.push(poll);
}

/// Most pieces one `sendmsg` gathers (stretches of `tx` and queued READ data).
const GATHER: usize = 32;

/// One `sendmsg` of what waits, in wire order: `tx` up to each queued READ's data, that data,
/// and so on. Returns what `sendmsg` returned.
fn send_gathered(c: &Conn) -> isize {
    // SAFETY: iovec is plain data; unused entries are never passed to the kernel.
    let mut iov: [libc::iovec; GATHER] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    let mut pos = c.tx_sent;
    let piece = |iov: &mut [libc::iovec; GATHER], n: &mut usize, (p, len): (*const u8, usize)| {
        iov[*n] = libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: len,
        };
        *n += 1;
    };
    let part = |b: &[u8]| (b.as_ptr(), b.len());
    let mut all = true;
    for d in &c.tx_data {
        if n + 2 > GATHER {
            all = false;
            break;
        }
        if d.at > pos {
            piece(&mut iov, &mut n, part(&c.tx[pos..d.at]));
        }
        pos = d.at;
        piece(&mut iov, &mut n, d.rest());
    }
    if all && pos < c.tx.len() && n < GATHER {
        piece(&mut iov, &mut n, part(&c.tx[pos..]));
    }
    // SAFETY: msghdr is plain data; every iovec points into `tx` or a queued buffer, both
    // alive and unchanged during the call.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        libc::sendmsg(c.fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    }
}

/// Everything queued went out: empty the buffer, and give back what an unusual burst made it
/// grow to past the high-water mark. A buffer that this burst filled to half its capacity or
/// more keeps it: shrinking it after every burst of large replies cost 1 MiB of page faults and
/// zeroing per 1 MiB read (perf: 15% of a TLS reactor's time at 1 MiB reads, QD8).
fn all_sent(c: &mut Conn) {
    debug_assert!(c.tx_data.is_empty());
    let peak = std::mem::take(&mut c.tx_peak).max(c.tx.len());
    c.tx.clear();
    c.tx_sent = 0;
    if let Some(keep) = drained_capacity(c.tx.capacity(), c.tx_high_water(), peak) {
        c.tx.shrink_to(keep);
    }
}

/// What a drained transmit buffer of `capacity` bytes shrinks to (`all_sent`), if anything,
/// when the burst that just drained held at most `peak` bytes.
fn drained_capacity(capacity: usize, high_water: usize, peak: usize) -> Option<usize> {
    (capacity > high_water && capacity > 2 * peak).then(|| TX_KEEP.max(peak))
}

/// `transmit` for TLS: replies are sealed into records gathered by the session's transport
/// (bounded), then sent in one go; when the socket fills, POLLOUT brings us back.
fn transmit_tls(c: &mut Conn, idx: usize, sq: &mut Pusher<'_>) {
    let Some(t) = c.tls.as_mut() else { return };
    loop {
        while c.tx_sent < c.tx.len() {
            match tls::write(t, &c.tx[c.tx_sent..]) {
                tls::Io::Done(n) => {
                    c.tx_sent += n;
                    c.bytes_sent += n as u64;
                }
                // The gathered records fill their bound: send them first.
                tls::Io::Again { out: true } => break,
                tls::Io::Again { out: false } => {
                    // A TLS 1.3 write waits for input only when a post-handshake message (a
                    // KeyUpdate, a few bytes) came in part, its record split: no TLS stack
                    // sends one so, and such a peer's connection ends rather than wait.
                    return tls_send_failed(c, "TLS send waits for input");
                }
                tls::Io::Closed => return tls_send_failed(c, "connection closed"),
                tls::Io::Failed(e) => return tls_send_failed(c, &e),
            }
        }
        match t.get_mut().flush_out() {
            Ok(true) if c.tx_sent == c.tx.len() => break,
            Ok(true) => {}
            Ok(false) => return wait_for_room(c, idx, sq),
            Err(e) => return tls_send_failed(c, &e.to_string()),
        }
    }
    all_sent(c);
}

fn tls_send_failed(c: &mut Conn, why: &str) {
    crate::log!(
        Level::Info,
        "session {} queue {}: send failed: {why}",
        c.session,
        c.queue
    );
    c.dead = true;
    c.closing = true;
}

/// Capacity a drained transmit buffer keeps: a batch of small replies or one 1 MiB read.
pub(super) const TX_KEEP: usize = (1 << 20) + 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// Bursts that fill the buffer keep its capacity however large; past the high-water mark,
    /// a buffer much larger than its last burst gives the rest back.
    #[test]
    fn a_drained_buffer_keeps_what_its_bursts_use() {
        const MB: usize = 1 << 20;
        assert_eq!(drained_capacity(3 * MB, 4 * MB, 0), None, "under the mark");
        assert_eq!(
            drained_capacity(12 * MB, 4 * MB, 6 * MB),
            None,
            "bursts fill it"
        );
        assert_eq!(
            drained_capacity(12 * MB, 4 * MB, 100 << 10),
            Some(TX_KEEP),
            "one big burst, then small ones"
        );
        assert_eq!(drained_capacity(12 * MB, 4 * MB, 5 * MB), Some(5 * MB));
    }
}
