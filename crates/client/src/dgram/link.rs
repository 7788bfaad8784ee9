//! The link of a datagram queue (PROTOCOL.md §9): its sockets, the batched send of packed
//! datagrams (§9.6, with UDP segmentation where the kernel takes it), the batched receive
//! (`recvmmsg` with UDP_GRO, or the Ethernet receive ring), waiting for input, and the one-off
//! control exchange. It knows nothing of requests: frames go out as the queue encoded them, and
//! what arrives is handed back datagram by datagram.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use blkwire_net::rx_ring::RxRing;
use blkwire_net::udp_offload::{self, Cmsg, IoVecs, Scatter, SendBatch};
use blkwire_wire::datagram::{self, Packer};
use blkwire_wire::{Flags, Header, HEADER_LEN};

use crate::auth::QueueKeys;
use crate::queue::QueueStats;
use crate::{Error, Result};

/// Errors a socket reports for what the path did (ICMP errors that Linux turns into errno on a
/// connected UDP socket: port, host or network unreachable, administratively prohibited,
/// host unknown or isolated, protocol unreachable) or for this host's route, firewall or
/// interface at the moment (ENETUNREACH, EPERM from a netfilter drop, ENETDOWN): frames lost,
/// as the network may lose them. The retransmission timer sends them again and the give-up
/// timer ends what stays unanswered, so a target behind a firewall that rejects it for a while
/// (a reboot, a rule reloaded) is reached again, as over TCP.
pub(crate) fn lost_on_the_path(e: &std::io::Error, udp: bool) -> bool {
    // ICMP fragmentation needed / ICMPv6 Packet Too Big (the kernel learns the path MTU and
    // fragments what follows), ICMPv6 administratively prohibited (an ip6tables REJECT),
    // ICMP parameter problem: reported once, on a UDP socket only. On a packet socket they
    // are this host's and stay (an interface MTU lowered under the session).
    if udp
        && matches!(
            e.raw_os_error(),
            Some(libc::EMSGSIZE | libc::EACCES | libc::EPROTO)
        )
    {
        return true;
    }
    matches!(
        e.raw_os_error(),
        Some(
            libc::ECONNREFUSED
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::EHOSTDOWN
                | libc::ENETDOWN
                | libc::ENONET
                | libc::ENOPROTOOPT
                | libc::EPERM
        )
    )
}

/// Frames sent or received per syscall.
pub(crate) const BATCH: usize = 32;

/// Where frames go: a connected UDP socket, or a packet socket with the target's MAC.
pub(crate) struct Link {
    pub fd: OwnedFd,
    /// For packet sockets: the destination link-layer address; `None` for connected UDP.
    pub dest: Option<libc::sockaddr_ll>,
    /// Largest frame (header + payload) the link carries.
    pub mtu_payload: u32,
    /// Raw Ethernet: a socket the data path sends on, so the kernel never wakes `fd`'s waiter
    /// for write space (`blkwire_net::packet_send_socket`); `None` sends on `fd`.
    pub send_fd: Option<OwnedFd>,
    /// Usable receive buffer of the socket: READ replies in flight must fit in it.
    pub rcvbuf: u32,
}

impl Link {
    /// Sends one frame outside the batched data path (control exchanges, discovery).
    pub(super) fn send_one(&self, frame: &[u8]) {
        let mut dest = self.dest;
        let (name, namelen) = match dest.as_mut() {
            Some(d) => (
                (d as *mut libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            ),
            None => (std::ptr::null_mut(), 0),
        };
        // Where the data path sends too, so the handshake takes the same way out (a bypassed
        // qdisc included).
        let fd = self.send_fd.as_ref().unwrap_or(&self.fd);
        // SAFETY: sendto from the caller's buffer to an optional link-layer address. A lost
        // frame is the caller's retransmission problem, so the result is not needed.
        unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                name,
                namelen,
            )
        };
    }

    /// Is `from` the target this link talks to? A connected UDP socket only receives from its
    /// peer; a packet socket hears the whole link, so the sender's MAC is checked (PROTOCOL.md
    /// §12.4). A broadcast destination (discovery) accepts anyone.
    pub(super) fn sent_by_target(&self, from: &libc::sockaddr_ll) -> bool {
        match &self.dest {
            None => true,
            Some(d) if !blkwire_net::for_this_link(from, d.sll_ifindex) => false,
            Some(d) if d.sll_addr[..6] == [0xff; 6] => true,
            Some(d) => d.sll_addr[..6] == from.sll_addr[..6],
        }
    }

    /// Waits until `until` for the next reply frame with a valid CRC or a seal; returns it (its
    /// bytes in `buf`) and the sender's link-layer address (meaningful on packet sockets only).
    pub(super) fn recv_reply<'b>(
        &self,
        buf: &'b mut [u8],
        until: Instant,
    ) -> Option<(datagram::Frame<'b>, libc::sockaddr_ll)> {
        while Instant::now() < until {
            let ms = until
                .saturating_duration_since(Instant::now())
                .as_millis()
                .max(1) as i32;
            let mut p = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `p` is one valid pollfd on the stack, alive for the call.
            if unsafe { libc::poll(&mut p, 1, ms) } <= 0 {
                continue;
            }
            // SAFETY: an all-zero sockaddr_ll is valid; recvfrom fills it (or truncates a
            // longer IP address into it, which callers on UDP ignore).
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut fl = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `buf` and `from` are ours, writable, and passed with their true sizes.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut fl,
                )
            };
            if n < HEADER_LEN as isize || !self.sent_by_target(&from) {
                continue;
            }
            // Control replies travel alone in their datagram (PROTOCOL.md §9.6): the first frame,
            // its CRC over all of it (a header-only CRC is for data frames only, §9.7).
            let ok = matches!(
                datagram::frames(&buf[..n as usize], 65536).next(),
                Some(Ok(f)) if f.header.is_reply() && !f.header.flags.has(Flags::HEAD_CRC)
            );
            if !ok {
                continue;
            }
            let buf: &'b [u8] = buf;
            let f = datagram::frames(&buf[..n as usize], 65536).next()?.ok()?;
            return Some((f, from));
        }
        None
    }
}

/// The sending half of a queue's link: frames encoded by the queue, packed into datagrams
/// (PROTOCOL.md §9.6), waiting for one `sendmmsg`.
pub(crate) struct Sender {
    /// The socket the data path sends on (`Link::send_fd`, else `Link::fd`).
    fd: RawFd,
    /// Raw Ethernet: the target's link-layer address; `None` on connected UDP.
    dest: Option<libc::sockaddr_ll>,
    tx: Packer<()>,
    /// The I/O vectors of one sendmmsg, kept for their capacity.
    iov: IoVecs,
    /// UDP: runs of equal datagrams leave in one segmented send (PROTOCOL.md §9.6); turned off
    /// for good if the kernel refuses one.
    gso: bool,
    /// When a datagram last went out: the queue's keepalive is due a while after it.
    last_sent: Instant,
}

impl Sender {
    /// Appends an encoded, sealed frame; `limit` is the datagram size it may be packed up to
    /// (0: it travels alone). True when the batch is full and should be flushed.
    pub fn push(&mut self, h: &Header, payload: &[u8], limit: usize) -> bool {
        self.tx.push(h, payload, (), limit);
        self.tx.len() == BATCH
    }

    /// `push` for a sealed session (PROTOCOL.md §12.4): `seal` seals the frame in place.
    pub fn push_sealed(
        &mut self,
        h: &Header,
        payload: &[u8],
        limit: usize,
        seal: impl FnOnce(&mut [u8]),
    ) -> bool {
        self.tx.push_sealed(h, payload, (), limit, seal);
        self.tx.len() == BATCH
    }

    /// `push` for an unsealed frame whose payload is not copied: the datagram points at the
    /// `len` bytes at `data` (`Packer::push_lent`, which also computes the CRC).
    ///
    /// # Safety
    ///
    /// `data` must stay readable and unchanged for `len` bytes until the next `flush`.
    pub unsafe fn push_lent(
        &mut self,
        h: &Header,
        data: *const u8,
        len: usize,
        limit: usize,
    ) -> bool {
        // SAFETY: as promised by the caller; `flush` sends and then clears the packer.
        unsafe { self.tx.push_lent(h, data, len, (), limit) };
        self.tx.len() == BATCH
    }

    /// Appends raw bytes as a datagram of their own (test hooks replaying stale or forged frames).
    pub fn push_raw(&mut self, frame: &[u8]) {
        self.tx.push_raw(frame, ());
    }

    /// When a datagram last went out (or was handed to a socket that refused it).
    pub fn last_sent(&self) -> Instant {
        self.last_sent
    }

    /// Whether runs still leave as segmented sends.
    #[cfg(test)]
    pub fn gso(&self) -> bool {
        self.gso
    }

    /// Sends every encoded frame with as few syscalls as the batch allows.
    pub fn flush(&mut self, stats: &mut QueueStats) -> Result<()> {
        if self.tx.is_empty() {
            return Ok(());
        }
        // Counted as traffic even if the socket refuses it: the keepalive could not do better.
        self.last_sent = Instant::now();
        let send_fd = self.fd;
        let mut iov = std::mem::take(&mut self.iov);
        let result = self.send_all(send_fd, &mut iov, stats);
        self.iov = iov;
        self.tx.clear();
        result
    }

    fn send_all(&mut self, send_fd: RawFd, iov: &mut IoVecs, stats: &mut QueueStats) -> Result<()> {
        let mut done = 0;
        while done < self.tx.len() {
            let limits = udp_offload::run_limits(self.gso);
            let mut batch = SendBatch::<BATCH>::new(iov);
            for run in self.tx.runs(done, move |_| limits).take(BATCH) {
                let name = |ss: &mut libc::sockaddr_storage| match &self.dest {
                    Some(d) => {
                        // SAFETY: a sockaddr_storage is larger than a sockaddr_ll and at least
                        // as aligned, so the write stays inside `ss` and is aligned.
                        unsafe {
                            *(ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_ll>() = *d
                        };
                        std::mem::size_of::<libc::sockaddr_ll>() as u32
                    }
                    None => 0,
                };
                // SAFETY: the packer holds copies of headers and small payloads, and points at
                // WRITE data the queue's slots keep unchanged until `flush` clears it after
                // this call (`push_lent`).
                unsafe { batch.push(self.tx.pieces(&run), run.segment, run.count, name) };
            }
            match batch.send(send_fd) {
                Ok(sent) => {
                    stats.datagrams_out += sent.datagrams as u64;
                    stats.segmented_out += sent.segmented as u64;
                    done += sent.datagrams;
                }
                Err(f) => match f.error.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // This kernel or route cannot segment: datagram by datagram from now on.
                    _ if f.segmented && udp_offload::refused(&f.error) => self.gso = false,
                    // A full socket buffer, or an error the path reported, loses frames
                    // exactly as the network may: the retransmission timer recovers them.
                    Some(libc::EAGAIN) | Some(libc::ENOBUFS) => done += f.datagrams,
                    _ if lost_on_the_path(&f.error, self.dest.is_none()) => done += f.datagrams,
                    _ => return Err(Error::Io(f.error)),
                },
            }
        }
        Ok(())
    }
}

/// The receiving half of a queue's link: the receive buffers or ring, and the spin before a
/// wait.
pub(crate) struct Receiver {
    fd: RawFd,
    /// `recvmmsg` buffers; none when frames are read from `ring`.
    rx: Vec<Vec<u8>>,
    /// UDP: the kernel hands over runs that arrived together as one buffer.
    gro: bool,
    /// Raw Ethernet: replies are read in place from a receive ring shared with the kernel.
    ring: Option<RxRing>,
    /// Raw Ethernet: the target's MAC and the interface the link is on; frames from any other
    /// sender, or not this link's (`blkwire_net::for_this_link`), are dropped unread.
    target: Option<([u8; 6], i32)>,
    /// Most `recvmmsg` calls one `receive` makes: about the receive buffer's worth of frames.
    rounds: usize,
    spin: blkwire_spin::AdaptiveSpin,
}

/// An empty receiver, to hold a queue's place while its own one is lent out to a receive whose
/// callback needs the rest of the queue.
impl Default for Receiver {
    fn default() -> Self {
        Receiver {
            fd: -1,
            rx: Vec::new(),
            gro: false,
            ring: None,
            target: None,
            rounds: 1,
            spin: blkwire_spin::AdaptiveSpin::default(),
        }
    }
}

/// Sets up the data path of `link` for a session with `frame_payload`-byte frames and at most
/// `max_io`-byte I/Os, spinning up to `poll` before each wait. Returns the two halves and how
/// many reply frames the receive buffer holds (what the window may count on, §9.4).
pub(crate) fn data_path(
    link: &Link,
    frame_payload: u32,
    max_io: u32,
    poll: Duration,
) -> (Sender, Receiver, u32) {
    let frame = HEADER_LEN + frame_payload as usize;
    // Counted at the largest reply frame this session can get; packed replies cost the same
    // buffer space per frame as lone ones.
    let largest = HEADER_LEN as u32 + frame_payload.min(max_io);
    let rx_cap = blkwire_net::frames_in_buffer(link.rcvbuf, largest);
    // A connected UDP socket (packet sockets have a destination address) can segment.
    let udp = link.dest.is_none();
    let gro = udp && udp_offload::enable_gro(link.fd.as_raw_fd());
    // (A sealed frame carries its seal after the payload, PROTOCOL.md §12.4.)
    let rx_len = if gro {
        udp_offload::GRO_BUFFER
    } else {
        frame.max(HEADER_LEN + 4096) + blkwire_wire::datagram::SEAL_LEN
    };
    // As many slots as the receive buffer holds frames, so the window's arithmetic (rx_cap)
    // stays true; without a ring (it cannot be set up) frames come by recvmmsg as before.
    let ring = if udp {
        None
    } else {
        let ifindex = link.dest.as_ref().map_or(0, |d| d.sll_ifindex);
        let ring = RxRing::new(link.fd.as_raw_fd(), frame, rx_cap as usize, ifindex).ok();
        if ring.is_some() {
            drain(link.fd.as_raw_fd());
        }
        ring
    };
    let tx = Sender {
        fd: link.send_fd.as_ref().unwrap_or(&link.fd).as_raw_fd(),
        dest: link.dest,
        tx: Packer::with_capacity(BATCH, BATCH * frame),
        iov: IoVecs::default(),
        gso: udp,
        last_sent: Instant::now(),
    };
    let rx = Receiver {
        fd: link.fd.as_raw_fd(),
        // A ring queue reads in place: no receive buffers.
        rx: (0..if ring.is_some() { 0 } else { BATCH })
            .map(|_| vec![0u8; rx_len])
            .collect(),
        gro,
        ring,
        target: link.dest.map(|d| {
            let mut m = [0u8; 6];
            m.copy_from_slice(&d.sll_addr[..6]);
            (m, d.sll_ifindex)
        }),
        rounds: (rx_cap as usize).div_ceil(BATCH).max(1),
        spin: blkwire_spin::AdaptiveSpin::new(poll),
    };
    (tx, rx, rx_cap)
}

impl Receiver {
    /// Most `recvmmsg` calls one `receive` makes.
    #[cfg(test)]
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    /// Sleeps until a frame arrives or `deadline` (asked only if the spin found nothing) is due.
    pub fn wait(&mut self, deadline: impl FnOnce() -> Option<Instant>) -> Result<()> {
        let fd = self.fd;
        let ready = match &self.ring {
            Some(ring) => self.spin.spin(|| ring.ready()),
            None => self.spin.spin(|| blkwire_spin::readable([fd])),
        };
        if ready {
            return Ok(());
        }
        let now = Instant::now();
        let next = deadline().unwrap_or(now + Duration::from_millis(100));
        let ms = next
            .saturating_duration_since(now)
            .as_micros()
            .div_ceil(1000)
            .min(1000) as i32;
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is one valid pollfd, alive for the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Io(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Can a run be peeked at and received scattered (UDP with GRO)?
    pub fn scatters(&self) -> bool {
        self.gro && !self.rx.is_empty()
    }

    /// UDP with GRO: copies the first bytes of the next run into `buf` without taking it, and
    /// says how long the run is and its segment size (`None`: no run waits). The socket is
    /// connected: every run is the target's.
    pub fn peek(&self, buf: &mut [u8]) -> std::io::Result<Option<(usize, usize)>> {
        if !self.scatters() {
            return Err(std::io::ErrorKind::Unsupported.into());
        }
        match udp_offload::peek_run(self.fd, buf, None) {
            Ok(run) => Ok(Some(run)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The first receive buffer, lent for a scattered receive (`receive_scattered`) and
    /// given back with `give_back`.
    pub fn lend(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.rx[0])
    }

    /// Takes back what `lend` lent.
    pub fn give_back(&mut self, buf: Vec<u8>) {
        self.rx[0] = buf;
    }

    /// Receives the next run as `scatter` lays it out, `buf` taking what is not placed: its
    /// length, or `None` when it was longer than laid out (the rest is lost).
    ///
    /// # Safety
    ///
    /// As [`Scatter::receive`]: every place given to `place` may be written for the call.
    pub unsafe fn receive_scattered(
        &self,
        scatter: &Scatter,
        buf: &mut [u8],
    ) -> std::io::Result<Option<usize>> {
        // SAFETY: the caller's.
        unsafe { scatter.receive(self.fd, buf, None) }
    }

    /// Reads the datagrams waiting, about a receive buffer's worth at most (a lap of the ring,
    /// or as many `recvmmsg` calls), and hands each to `f` with whether it came out of a
    /// coalesced run; returns how many receive slots (ring frames or `recvmmsg` messages) were
    /// taken. Bounded so that a target sending as fast as we read cannot keep the caller from
    /// its timers: what is left is read on the next call.
    pub fn receive(&mut self, mut f: impl FnMut(&[u8], bool)) -> Result<usize> {
        if let Some(ring) = &mut self.ring {
            let target = self.target;
            // Another host on the link may send frames that pass the socket's filter (it only
            // looks at the frame's session and queue): only the target's are read.
            return Ok(ring.take_lap(|data, from| {
                if target.is_none_or(|(t, _)| from.sll_addr[..6] == t) {
                    f(data, false)
                }
            }));
        }
        let mut total = 0;
        for _ in 0..self.rounds {
            // SAFETY: an all-zero iovec (null base, length 0) is a valid value; filled below.
            let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: an all-zero mmsghdr (null pointers, zero lengths) is a valid value.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            let mut cmsgs = [Cmsg::default(); BATCH];
            // SAFETY: an all-zero sockaddr_ll is a valid value; the kernel fills it.
            let mut names: [libc::sockaddr_ll; BATCH] = unsafe { std::mem::zeroed() };
            for i in 0..BATCH {
                iov[i] = libc::iovec {
                    iov_base: self.rx[i].as_mut_ptr().cast(),
                    iov_len: self.rx[i].len(),
                };
                msgs[i].msg_hdr.msg_iov = &mut iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                if self.target.is_some() {
                    // A packet socket without its ring: the sender is checked here too.
                    msgs[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_ll).cast();
                    msgs[i].msg_hdr.msg_namelen =
                        std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                }
                if self.gro {
                    cmsgs[i].attach_for_receive(&mut msgs[i].msg_hdr);
                }
            }
            // SAFETY: every pointer in `msgs` refers to `iov`, `cmsgs`, `names` or the buffers
            // of `self.rx`, all alive and unmoved for the call, with their true lengths.
            let r = unsafe {
                libc::recvmmsg(
                    self.fd,
                    msgs.as_mut_ptr(),
                    BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(total),
                    // An ICMP error (a dead target's port, a firewall): keep waiting; the
                    // give-up timer ends what stays unanswered.
                    _ if lost_on_the_path(&e, self.target.is_none()) => Ok(total),
                    _ => Err(Error::Io(e)),
                };
            }
            let n = r as usize;
            for (i, m) in msgs.iter().enumerate().take(n) {
                let foreign = |(t, ifindex): ([u8; 6], i32)| {
                    names[i].sll_addr[..6] != t || !blkwire_net::for_this_link(&names[i], ifindex)
                };
                if self.target.is_some_and(foreign) {
                    continue;
                }
                let len = m.msg_len as usize;
                let segment = cmsgs[i].received_segment(&m.msg_hdr);
                let buf = &self.rx[i];
                for d in udp_offload::segments(&buf[..len.min(buf.len())], segment) {
                    f(d, segment.is_some());
                }
            }
            total += n;
            if n < BATCH {
                break;
            }
        }
        Ok(total)
    }
}

/// Discards what a socket received before its ring was set up (answers to the control exchange
/// that opened it): the ring only sees what arrives after.
fn drain(fd: RawFd) {
    let mut buf = [0u8; 64];
    // SAFETY: recv into a local buffer; longer frames are truncated, which is what we want.
    while unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) } >= 0 {}
}

/// Opens a UDP socket connected to `addr`, with buffers sized for bursts of frames.
pub(crate) fn udp_link(addr: std::net::SocketAddr) -> Result<Link> {
    let sock = std::net::UdpSocket::bind(if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })?;
    sock.connect(addr)?;
    sock.set_nonblocking(true)?;
    let fd: OwnedFd = sock.into();
    // The path MTU of the connected route decides the frame payload (PROTOCOL.md §9.1).
    let mut mtu: libc::c_int = 1500;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let (level, opt, ip_overhead) = if addr.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_MTU, 28)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU, 48)
    };
    // SAFETY: `mtu` is a local int and `len` its true size.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&mut mtu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    let mtu_payload = blkwire_net::frame_payload_for(mtu as u32, ip_overhead);
    let rcvbuf = blkwire_net::size_buffers(fd.as_raw_fd());
    Ok(Link {
        fd,
        dest: None,
        mtu_payload,
        send_fd: None,
        rcvbuf,
    })
}

/// Opens a packet socket on `iface` that receives only this queue's frames (and this session's,
/// once known), addressed to the target's MAC; its frames skip the qdisc when `bypass_qdisc`
/// (`?qdisc=bypass`, `blkwire_net::packet_send_socket`).
pub(crate) fn eth_link(
    iface: &str,
    mac: [u8; 6],
    queue: u16,
    session: Option<u32>,
    bypass_qdisc: bool,
) -> Result<Link> {
    let info = blkwire_net::iface(iface).map_err(Error::Usage)?;
    let ethertype = blkwire_net::DEFAULT_ETHERTYPE;
    let filter = blkwire_net::Filter::Queue { queue, session };
    let fd = blkwire_net::packet_socket(info.index, ethertype, filter).map_err(Error::Usage)?;
    let rcvbuf = blkwire_net::size_buffers(fd.as_raw_fd());
    Ok(Link {
        fd,
        dest: Some(blkwire_net::link_addr(info.index, ethertype, mac)),
        mtu_payload: blkwire_net::frame_payload_for(info.mtu, 0),
        send_fd: Some(
            blkwire_net::packet_send_socket(info.index, bypass_qdisc).map_err(Error::Usage)?,
        ),
        rcvbuf,
    })
}

/// One control exchange over a datagram link (HELLO, LIST): the request is sent again with a
/// doubling timer until a reply with the same opcode, tag and offset arrives or `timeout`
/// passes.
pub(crate) fn exchange_plain(
    link: &Link,
    h: Header,
    payload: &[u8],
    timeout: Duration,
) -> Result<(Header, Vec<u8>)> {
    exchange(link, h, payload, timeout, None)
}

/// A control exchange on a queue's link (JOIN, or HELLO/LIST with `seal` `None`). In a sealed
/// session (PROTOCOL.md §12.4) every copy sent is sealed anew (a resent copy is a new frame to
/// the target's replay window) and only a reply whose seal opens is taken.
pub(crate) fn exchange(
    link: &Link,
    mut h: Header,
    payload: &[u8],
    timeout: Duration,
    mut seal: Option<&mut QueueKeys>,
) -> Result<(Header, Vec<u8>)> {
    h.payload_len = payload.len() as u32;
    let deadline = Instant::now() + timeout;
    let mut wait = Duration::from_millis(50);
    let mut buf = vec![0u8; 65536];
    let mut scratch = vec![0u8; 65536];
    let mut out = Packer::with_capacity(1, HEADER_LEN + payload.len() + datagram::SEAL_LEN);
    loop {
        out.clear();
        match seal.as_deref_mut() {
            Some(k) => out.push_sealed(&h, payload, (), 0, |f| k.sealer.seal(f, HEADER_LEN)),
            None => {
                let mut h = h;
                h.seal_crc(payload);
                out.push(&h, payload, (), 0);
            }
        }
        link.send_one(&out.get(0).0);
        let until = (Instant::now() + wait).min(deadline);
        while let Some((f, _)) = link.recv_reply(&mut buf, until) {
            // The reply echoes the request's offset (PROTOCOL.md §3): HELLO and LIST put a
            // random mark there, which tells this process's answer from another's on a link
            // every process of the host hears (Ethernet).
            if f.header.opcode != h.opcode || f.header.tag != h.tag || f.header.offset != h.offset {
                continue;
            }
            let payload = match (seal.as_deref_mut(), f.sealed()) {
                (None, false) => f.payload,
                (Some(k), true) => match k.opener.open(f.raw, HEADER_LEN, &mut scratch) {
                    Ok(p) => p,
                    Err(_) => continue,
                },
                // Unsealed in a sealed exchange: a refusal (the target does not know the
                // session: it restarted) or a JOIN challenge (sent before the queue has keys);
                // a forged one can only make us ask again. Nothing else unsealed is believed.
                (Some(_), false)
                    if matches!(
                        f.header.status,
                        blkwire_wire::Status::Access | blkwire_wire::Status::Challenge
                    ) =>
                {
                    f.payload
                }
                _ => continue,
            };
            return Ok((f.header, payload.to_vec()));
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout(timeout));
        }
        wait = (wait * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    /// What a connected UDP socket reports of ICMP errors is loss, which retransmission
    /// recovers: the path MTU shrinking (EMSGSIZE), an ip6tables REJECT (EACCES), a parameter
    /// problem (EPROTO) ended the queue. A bad address of ours is not.
    #[test]
    fn icmp_errors_are_loss_on_the_path() {
        let e = std::io::Error::from_raw_os_error;
        for errno in [
            libc::EMSGSIZE,
            libc::EACCES,
            libc::EPROTO,
            libc::ECONNREFUSED,
            libc::EHOSTUNREACH,
        ] {
            assert!(super::lost_on_the_path(&e(errno), true), "{errno}");
        }
        for errno in [libc::EFAULT, libc::EBADF, libc::EINVAL] {
            assert!(!super::lost_on_the_path(&e(errno), true), "{errno}");
        }
        // On a packet socket EMSGSIZE is this host's MTU, and stays: not loss.
        for errno in [libc::EMSGSIZE, libc::EACCES, libc::EPROTO] {
            assert!(!super::lost_on_the_path(&e(errno), false), "{errno}");
        }
        assert!(super::lost_on_the_path(&e(libc::ENETDOWN), false));
    }

    /// A control exchange takes only the reply echoing its request's offset (PROTOCOL.md §3),
    /// where HELLO and LIST carry a random mark: on Ethernet another process's HELLO to the
    /// same target, with the same opcode and tag, is answered to the same host.
    #[test]
    fn a_control_exchange_takes_only_the_answer_echoing_its_mark() {
        use blkwire_wire::{Header, Opcode, Status, Tag};
        let target = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = super::udp_link(target.local_addr().unwrap()).unwrap();
        let answer = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            let (n, from) = target.recv_from(&mut buf).unwrap();
            let h = Header::decode(&buf[..n], 4096).unwrap();
            // Another process's answer first (its mark), then ours.
            for (offset, body) in [(h.offset ^ 1, b"theirs"), (h.offset, b"ours!!")] {
                let mut r = Header { offset, ..h }.reply(Status::Ok, body.len() as u32);
                r.seal_crc(body);
                let mut f = r.to_bytes().to_vec();
                f.extend_from_slice(body);
                target.send_to(&f, from).unwrap();
            }
            h.offset
        });
        let h = Header::request(Opcode::Hello, Tag::new(0, 1), 0x5eed_1234_5678_9abc, 0);
        let (r, p) =
            super::exchange_plain(&link, h, b"hello", std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(answer.join().unwrap(), h.offset, "the mark went out");
        assert_eq!((r.offset, p.as_slice()), (h.offset, &b"ours!!"[..]));
    }
}
