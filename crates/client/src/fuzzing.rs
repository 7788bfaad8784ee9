//! In-process entry points for the fuzz targets under `fuzz/`; not an API (hidden from the
//! docs, no stability). An initiator's datagram queue takes replies from its target's address
//! (UDP) or MAC (raw Ethernet), which anyone on the path can forge; `fuzz/fuzz_targets/
//! dgram_reply.rs` sends such replies to a queue with requests in flight. A TCP queue takes
//! whatever bytes its target sends (native reply frames, or NVMe/TCP PDUs);
//! `fuzz/fuzz_targets/stream_reply.rs` sends those to a queue made by [`tcp_queue`].

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use blkwire_wire::nvme_tcp::{Direction, Params};
use blkwire_wire::{CopyLimits, Features};

use crate::dgram::{udp_link, DgramQueue, Grant};
use crate::nvme::Framing;
use crate::stream::StreamQueue;
use crate::tls::Link;
use crate::{ConnectOptions, ExportInfo, Queue, Result};

/// A datagram queue of session `session` talking to `target` (a UDP socket on loopback the
/// caller holds): `depth` slots, I/O up to `max_io` bytes in frames of `frame_payload`, data
/// frames' CRCs over their header only if `header_crc` (PROTOCOL.md §9.7). It gives a request
/// up after `give_up` and never spins.
pub fn udp_queue(
    target: SocketAddr,
    session: u32,
    depth: u16,
    max_io: u32,
    frame_payload: u32,
    header_crc: bool,
    give_up: Duration,
) -> Result<Queue> {
    let grant = Grant {
        session,
        index: 0,
        depth,
        max_io,
        frame_payload,
        credit: 64,
        header_crc,
    };
    let q = DgramQueue::new(udp_link(target)?, grant, None, give_up, Duration::ZERO);
    Ok(Queue::dgram(q, CopyLimits::default(), crate::MAX_RANGE))
}

/// What an NVMe/TCP I/O queue negotiated (ICReq/ICResp, Identify; see `nvme::connect`).
/// blkwire's client asks for no digests and HPDA 0 today; the framing takes any of them.
#[derive(Clone, Copy, Debug)]
pub struct NvmeTcp {
    /// Header digests, both directions.
    pub hdgst: bool,
    /// Data digests, both directions.
    pub ddgst: bool,
    /// HPDA: data alignment of the PDUs the queue receives (0's based, in dwords).
    pub hpda: u8,
    /// CPDA: data alignment of the PDUs the queue sends.
    pub cpda: u8,
    /// Largest write sent in its capsule; larger ones wait for the target's R2Ts.
    pub incapsule: u32,
    /// log2 of the namespace's block size (9..=16).
    pub lba_shift: u32,
    /// MAXH2CDATA: most data of one H2CData PDU (answers to an R2T are cut to it).
    pub maxh2cdata: u32,
}

/// A TCP queue on `sock` (connected to a socket the caller holds, past any handshake), as
/// `connect` makes it once the session is granted: `depth` slots, I/O up to `max_io` bytes;
/// blkwire frames, or NVMe/TCP PDUs with `nvme` (PLEN bound `max_io` + 4 KiB, as
/// `nvme::connect` sets). `timeout` bounds every wait (as `ConnectOptions::timeout`); it never
/// spins. A native queue's COPYs are not checked against any limits (`Cmd::Copy` as given).
pub fn tcp_queue(
    sock: TcpStream,
    depth: u16,
    max_io: u32,
    nvme: Option<NvmeTcp>,
    timeout: Duration,
) -> Result<Queue> {
    let block = nvme.map_or(512, |n| 1 << n.lba_shift);
    let info = ExportInfo {
        name: String::new(),
        size: 1 << 40,
        logical_block: block,
        physical_block: block,
        features: Features(Features::FLUSH | Features::TRIM | Features::FUA),
        queues: 1,
        depth,
        max_io,
        session: 1,
        copy: CopyLimits::default(),
        header_crc: false,
        max_range: crate::MAX_RANGE,
    };
    let opts = ConnectOptions {
        queues: 1,
        depth,
        max_io,
        host_id: String::new(),
        key: None,
        encrypt: false,
        tls: false,
        tls_ca: None,
        timeout,
        give_up: None,
        poll: Duration::ZERO,
        replaces: None,
        probe: false,
    };
    let q = match nvme {
        None => StreamQueue::new(Link::Plain(sock), 0, &info, &opts)?,
        Some(n) => {
            let params = |direction, pda, max_plen| Params {
                direction,
                hdgst: n.hdgst,
                ddgst: n.ddgst,
                pda,
                max_plen,
            };
            let framing = Framing {
                tx: params(Direction::HostToController, n.cpda, u32::MAX),
                rx: params(Direction::ControllerToHost, n.hpda, max_io + 4096),
                incapsule: n.incapsule,
                lba_shift: n.lba_shift,
                maxh2cdata: n.maxh2cdata,
                pending: vec![Vec::new(); depth as usize],
                r2t_sent: vec![None; depth as usize],
                gathered: vec![Vec::new(); depth as usize],
                // Stands for the admin queue, which only has to live as long as this one.
                _admin: Arc::new(sock.try_clone()?),
            };
            StreamQueue::new_nvme(Link::Plain(sock), 0, &info, &opts, framing)?
        }
    };
    Ok(Queue::stream(q, CopyLimits::default(), info.max_range))
}

/// A TCP queue's receive buffer: its length now, and the most it may ever grow to. None for
/// a datagram queue.
pub fn rx_buffer(q: &Queue) -> Option<(usize, usize)> {
    q.as_stream().map(|s| s.rx_buffer())
}

/// Waits up to `timeout` for the queue's socket to turn readable (or to report an error or
/// the end of the stream, which the next `poll` takes too). False when it did not.
pub fn wait_readable(q: &Queue, timeout: Duration) -> bool {
    let at = std::time::Instant::now() + timeout;
    crate::deadline::poll_until(q.fd(), libc::POLLIN, at, timeout).is_ok()
}
