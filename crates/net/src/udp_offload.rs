//! UDP segmentation offload (PROTOCOL.md §9.6): a run of equal-sized datagrams to one peer leaves
//! in one send with a `UDP_SEGMENT` size (GSO), and a receiver that asked for `UDP_GRO` gets runs
//! that arrive together as one buffer plus the segment size. The datagrams on the wire are the
//! same either way; what changes is how many times each end crosses the network stack. Over veth
//! and loopback the run travels as one packet, as TCP's segments do; on a NIC with UDP
//! segmentation offload the card cuts it.

use std::os::fd::RawFd;

/// Receive buffer for one coalesced run: the largest UDP payload of one IP packet, rounded up.
pub const GRO_BUFFER: usize = 65536;
/// Most datagrams in one segmented send (the kernel's UDP_MAX_SEGMENTS was 64 before Linux 6.0).
pub const GSO_MAX_SEGMENTS: usize = 64;
/// Most bytes in one segmented send: one IPv6 packet's payload less its UDP header, rounded down.
pub const GSO_MAX_BYTES: usize = 65_000;

/// Asks the kernel to hand over coalesced runs (UDP_GRO, Linux 5.0). False when it refuses;
/// then every receive is one datagram, as without this.
pub fn enable_gro(fd: RawFd) -> bool {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt with an int on a socket the caller owns.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_UDP,
            libc::UDP_GRO,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// Room for the one control message a segmented send or a coalescing receive carries.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct Cmsg([u8; 32]);

impl Cmsg {
    /// Makes `msg` a segmented send: its payload is datagrams of `segment` bytes, the last
    /// possibly shorter. `msg` points into `self` afterwards; both must live until the send.
    pub fn attach_segment(&mut self, msg: &mut libc::msghdr, segment: u16) {
        let room = Self::space(std::mem::size_of::<u16>());
        msg.msg_control = self.0.as_mut_ptr().cast();
        msg.msg_controllen = room;
        // SAFETY: msg_control points at our 32 aligned bytes, enough for CMSG_SPACE(2) = 24;
        // CMSG_FIRSTHDR is therefore non-null and CMSG_DATA lies inside the buffer.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(msg);
            (*c).cmsg_level = libc::SOL_UDP;
            (*c).cmsg_type = libc::UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), segment);
        }
    }

    /// Gives `msg` room for the UDP_GRO message of a receive.
    pub fn attach_for_receive(&mut self, msg: &mut libc::msghdr) {
        msg.msg_control = self.0.as_mut_ptr().cast();
        msg.msg_controllen = Self::space(std::mem::size_of::<libc::c_int>());
    }

    /// After a receive into `msg`, whose control buffer `attach_for_receive` made `self`: the
    /// segment size of a coalesced run, `None` for a lone datagram (the kernel adds the message
    /// only when it coalesced) or when `msg` does not point at `self`. Only `self`'s own bytes
    /// are read, so this is safe whatever `msg` holds.
    pub fn received_segment(&self, msg: &libc::msghdr) -> Option<usize> {
        if msg.msg_control.cast_const() != self.0.as_ptr().cast() {
            return None;
        }
        // SAFETY: an all-zero msghdr (null pointers, zero lengths) is a valid value.
        let mut own: libc::msghdr = unsafe { std::mem::zeroed() };
        own.msg_control = self.0.as_ptr().cast_mut().cast();
        own.msg_controllen = msg.msg_controllen.min(self.0.len());
        // SAFETY: `own` describes our own buffer, no longer than it.
        unsafe { Self::walk_for_gro(&own) }
    }

    /// The UDP_GRO segment size among `msg`'s control messages.
    ///
    /// # Safety
    ///
    /// `msg.msg_control` must point at `msg.msg_controllen` readable bytes (or be null with a
    /// length of 0).
    unsafe fn walk_for_gro(msg: &libc::msghdr) -> Option<usize> {
        let base = msg.msg_control as usize;
        let end = base + msg.msg_controllen;
        // SAFETY: CMSG_FIRSTHDR/NXTHDR only return headers that lie inside the msg_controllen
        // bytes the caller vouches for; the data is read only when it lies inside them too, so
        // even a malformed length cannot make this read outside the buffer.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(msg);
            while !c.is_null() {
                let data = libc::CMSG_DATA(c);
                if (*c).cmsg_level == libc::SOL_UDP
                    && (*c).cmsg_type == libc::UDP_GRO
                    && data as usize + std::mem::size_of::<libc::c_int>() <= end
                {
                    let v = std::ptr::read_unaligned(data.cast::<libc::c_int>());
                    return usize::try_from(v).ok().filter(|&s| s > 0);
                }
                c = libc::CMSG_NXTHDR(msg, c);
            }
        }
        None
    }

    fn space(data: usize) -> usize {
        // SAFETY: CMSG_SPACE only computes a length; it touches no memory.
        unsafe { libc::CMSG_SPACE(data as u32) as usize }
    }
}

/// Room for the I/O vectors of one `SendBatch`, kept by its owner between sends so that its
/// capacity is reused.
#[derive(Default)]
pub struct IoVecs(Vec<libc::iovec>);

// SAFETY: the addresses an `IoVecs` holds are only followed by the `sendmmsg` of the batch that
// wrote them, on the thread that made the batch; a new batch empties it first. Between sends it
// is plain numbers, and moving it to another thread follows none of them.
unsafe impl Send for IoVecs {}

/// The messages of one `sendmmsg`: each a run of datagrams to one destination, gathered from
/// pieces, sent as one segmented send when the run holds more than one. The pieces must stay
/// readable until `send` (see `push`).
pub struct SendBatch<'a, const N: usize> {
    /// (first I/O vector, I/O vectors, segment, datagrams) of each message.
    runs: [(usize, usize, usize, usize); N],
    /// The messages' I/O vectors, one after another: the caller's, so it keeps its capacity.
    iov: &'a mut Vec<libc::iovec>,
    names: [libc::sockaddr_storage; N],
    namelens: [libc::socklen_t; N],
    len: usize,
}

/// What one `sendmmsg` sent.
pub struct Sent {
    /// Datagrams the kernel took.
    pub datagrams: usize,
    /// Of those, the datagrams that left in segmented sends.
    pub segmented: usize,
}

/// The first message of a batch failed (nothing was sent).
pub struct Refused {
    /// Why.
    pub error: std::io::Error,
    /// It was a segmented send (see `refused`).
    pub segmented: bool,
    /// Datagrams it held.
    pub datagrams: usize,
}

impl<'a, const N: usize> SendBatch<'a, N> {
    /// An empty batch whose I/O vectors go into `iov` (emptied first).
    pub fn new(iov: &'a mut IoVecs) -> Self {
        let iov = &mut iov.0;
        iov.clear();
        SendBatch {
            runs: [(0, 0, 0, 0); N],
            iov,
            // SAFETY: an all-zero sockaddr_storage (family AF_UNSPEC) is a valid value.
            names: unsafe { std::mem::zeroed() },
            namelens: [0; N],
            len: 0,
        }
    }

    /// No room for another message?
    pub fn is_full(&self) -> bool {
        self.len == N
    }

    /// Adds a message: `count` datagrams, each `segment` bytes but the last, whose bytes are
    /// `pieces` (address, length) one after another. `name` writes the destination and returns
    /// its length; 0 sends to the connected peer.
    ///
    /// # Safety
    ///
    /// Every piece must be readable for its length until `send` returns.
    pub unsafe fn push(
        &mut self,
        pieces: impl IntoIterator<Item = (*const u8, usize)>,
        segment: usize,
        count: usize,
        name: impl FnOnce(&mut libc::sockaddr_storage) -> u32,
    ) {
        assert!(!self.is_full(), "a full send batch");
        self.namelens[self.len] = name(&mut self.names[self.len]);
        let first = self.iov.len();
        self.iov
            .extend(pieces.into_iter().map(|(base, len)| libc::iovec {
                iov_base: base as *mut _,
                iov_len: len,
            }));
        self.runs[self.len] = (first, self.iov.len() - first, segment, count);
        self.len += 1;
    }

    /// Sends every message with one `sendmmsg` on `fd`; the kernel may take fewer than all.
    pub fn send(&mut self, fd: RawFd) -> Result<Sent, Refused> {
        // SAFETY: an all-zero mmsghdr (null pointers, zero lengths) is a valid value.
        let mut msgs: [libc::mmsghdr; N] = unsafe { std::mem::zeroed() };
        let mut cmsgs = [Cmsg::default(); N];
        // One pointer for all messages: re-borrowing the vector per message would invalidate
        // the pointers taken for the earlier ones.
        let iov = self.iov.as_mut_ptr();
        for i in 0..self.len {
            let (first, n, segment, count) = self.runs[i];
            let m = &mut msgs[i].msg_hdr;
            // SAFETY: `first + n <= self.iov.len()` (`push` recorded them).
            m.msg_iov = unsafe { iov.add(first) };
            m.msg_iovlen = n as _;
            if self.namelens[i] > 0 {
                m.msg_name = (&mut self.names[i] as *mut libc::sockaddr_storage).cast();
                m.msg_namelen = self.namelens[i];
            }
            if count > 1 {
                cmsgs[i].attach_segment(m, segment as u16);
            }
        }
        // SAFETY: every pointer in msgs refers to self.iov, cmsgs or self.names, all alive and
        // unmoved for the call; the I/O vectors point at pieces `push`'s callers keep readable.
        let r = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), self.len as u32, 0) };
        if r < 0 {
            let count = self.runs[0].3;
            return Err(Refused {
                error: std::io::Error::last_os_error(),
                segmented: count > 1,
                datagrams: count,
            });
        }
        let sent = &self.runs[..r as usize];
        Ok(Sent {
            datagrams: sent.iter().map(|r| r.3).sum(),
            segmented: sent.iter().map(|r| r.3).filter(|&c| c > 1).sum(),
        })
    }
}

/// Most datagrams and bytes in one message: a segmented send's limits, or one datagram.
pub fn run_limits(segment: bool) -> (usize, usize) {
    if segment {
        (GSO_MAX_SEGMENTS, GSO_MAX_BYTES)
    } else {
        (1, usize::MAX)
    }
}

/// Destinations refused one by one before a port stops segmenting for all of them.
pub const REFUSED_DESTINATIONS: usize = 16;

/// To which destinations a socket sends runs of datagrams segmented. The kernel refuses a
/// segmented send for one destination when a segment does not fit its path MTU (which that
/// peer can lower for its own address: key destinations by address, not port), and for every
/// destination when the device cannot segment at all. So a refusal stops segmenting to that
/// destination only, and to all once [`REFUSED_DESTINATIONS`] have been refused: one peer
/// cannot turn it off for the others.
#[derive(Debug)]
pub struct Segmenting<D> {
    on: bool,
    refused: Vec<D>,
}

impl<D: PartialEq> Segmenting<D> {
    /// Segmenting to every destination (`on`), or to none.
    pub fn new(on: bool) -> Self {
        Segmenting {
            on,
            refused: Vec::new(),
        }
    }

    /// The run limits (`run_limits`) for a run to `dest`.
    pub fn limits(&self, dest: &D) -> (usize, usize) {
        run_limits(self.on && !self.refused.contains(dest))
    }

    /// Segmenting to any destination at all?
    pub fn on(&self) -> bool {
        self.on
    }

    /// The kernel refused a segmented send to `dest` (`refused`): datagram by datagram to it
    /// from now on, and to every destination once too many were refused.
    pub fn refused_by(&mut self, dest: D) {
        if self.refused.contains(&dest) {
            return;
        }
        if self.refused.len() + 1 >= REFUSED_DESTINATIONS {
            self.on = false;
            self.refused = Vec::new();
        } else {
            self.refused.push(dest);
        }
    }
}

/// Whether a failed segmented send means "this socket cannot segment" (retry without) rather
/// than a transient condition: a segment over the path MTU (EMSGSIZE since Linux 6.13 and the
/// stable kernels it went back to, "udp: gso: do not drop small packets when PMTU reduces";
/// EINVAL before), a missing feature (EINVAL), a device without checksum offload (EIO).
pub fn refused(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::EIO) | Some(libc::EMSGSIZE)
    )
}

/// The datagrams of one receive: a coalesced run split at `segment` bytes, or the buffer whole.
pub fn segments(buf: &[u8], segment: Option<usize>) -> std::slice::Chunks<'_, u8> {
    buf.chunks(segment.unwrap_or(buf.len()).max(1))
}

/// Most datagrams in one coalesced run (the kernel's UDP_GRO limit).
pub const GRO_MAX_SEGMENTS: usize = 64;

/// Messages at least this long are received with a [`Scatter`] (PROTOCOL.md §9.3), at either
/// end: below, the copies saved do not pay for the peeks (a small message's runs are short,
/// and one receive could have taken many of them).
pub const IN_PLACE_MIN: u32 = 32 << 10;

/// How a coalesced run is received with some datagrams' payloads straight where they belong
/// (PROTOCOL.md §9.3: a message's fragments, into the message's own memory) and the rest whole
/// in a receive buffer. Datagram `k` (`seg` bytes, the last possibly shorter) lies at `k * seg`
/// in the buffer; for a placed one only its first `head` bytes (its header) do, and its payload
/// goes to `base + (first + k) * stride`. Which datagrams are placed, and where, is the caller's
/// to decide; this only lays the receive out and finds the pieces again.
pub struct Scatter {
    len: usize,
    seg: usize,
    head: usize,
    base: *mut u8,
    first: usize,
    stride: usize,
    placed: u64,
}

impl Scatter {
    /// A run of `len` bytes in datagrams of `seg`, each beginning with `head` bytes of header,
    /// whose placed payloads go to `base + (first + k) * stride`. `None` unless the run has
    /// between 2 and `GRO_MAX_SEGMENTS` datagrams longer than their header (a lone datagram is
    /// cheaper read with the others).
    pub fn new(
        len: usize,
        seg: usize,
        head: usize,
        (base, first, stride): (*mut u8, usize, usize),
    ) -> Option<Scatter> {
        (seg > head && len > seg && len.div_ceil(seg) <= GRO_MAX_SEGMENTS).then_some(Scatter {
            len,
            seg,
            head,
            base,
            first,
            stride,
            placed: 0,
        })
    }

    /// The run's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a run has at least two datagrams.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How many datagrams the run holds.
    pub fn segments(&self) -> usize {
        self.len.div_ceil(self.seg)
    }

    /// Where datagram `k` lies in the receive buffer: all of it, or for a placed one its header
    /// followed by room as long as its payload (unused by the receive).
    pub fn in_buffer(&self, k: usize) -> std::ops::Range<usize> {
        let at = k * self.seg;
        at..at + self.seg.min(self.len - at)
    }

    /// The length of datagram `k`'s payload, after its header; `None` when it has none.
    pub fn carries(&self, k: usize) -> Option<usize> {
        self.in_buffer(k)
            .len()
            .checked_sub(self.head)
            .filter(|&c| c > 0)
    }

    /// Has datagram `k`'s payload go to its place. The caller must have made sure that place
    /// holds `carries(k)` bytes it may have a receive write (see `iovecs`).
    pub fn place(&mut self, k: usize) {
        if k < self.segments() && self.carries(k).is_some() {
            self.placed |= 1 << k;
        }
    }

    /// Whether datagram `k`'s payload goes to its place.
    pub fn is_placed(&self, k: usize) -> bool {
        self.placed & (1 << k) != 0
    }

    /// Whether any datagram is placed.
    pub fn places_any(&self) -> bool {
        self.placed != 0
    }

    /// Fills `iov` with the receive's vectors, `buf` (at least `len` bytes) taking what is not
    /// placed; returns how many.
    fn iovecs(&self, buf: &mut [u8], iov: &mut [libc::iovec; 2 * GRO_MAX_SEGMENTS]) -> usize {
        assert!(buf.len() >= self.len, "the receive buffer holds the run");
        let mut n = 0;
        for k in 0..self.segments() {
            let r = self.in_buffer(k);
            let whole = r.len();
            let head = if self.is_placed(k) { self.head } else { whole };
            iov[n] = libc::iovec {
                iov_base: buf[r.start..].as_mut_ptr().cast(),
                iov_len: head,
            };
            n += 1;
            if self.is_placed(k) {
                iov[n] = libc::iovec {
                    iov_base: self.place_of(k).cast(),
                    iov_len: whole - head,
                };
                n += 1;
            }
        }
        n
    }

    /// Receives the next run on `fd` as laid out, `buf` (at least `len` bytes) taking what is
    /// not placed, and the sender's address into `name` if given: the run's length, or `None`
    /// when it was longer than laid out (the rest is lost).
    ///
    /// # Safety
    ///
    /// Every place given to `place` must be memory the kernel may write for the call.
    pub unsafe fn receive(
        &self,
        fd: RawFd,
        buf: &mut [u8],
        name: Option<&mut libc::sockaddr_storage>,
    ) -> std::io::Result<Option<usize>> {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2 * GRO_MAX_SEGMENTS];
        let n = self.iovecs(buf, &mut iov);
        // SAFETY: an all-zero message header (null pointers, zero lengths) is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        if let Some(name) = name {
            msg.msg_name = (name as *mut libc::sockaddr_storage).cast();
            msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
        }
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n;
        // SAFETY: the vectors point into `buf` (`iovecs` keeps to it) or at the places the
        // caller vouches for; `name` is ours for the call.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((msg.msg_flags & libc::MSG_TRUNC == 0).then_some(r as usize))
    }

    /// After `receive`: each placed datagram from `from` on is given to `check` (its index,
    /// its header in `buf`, its payload where it landed), all before the caller handles any of
    /// the run, since handling one may free or overwrite the places of others. One `check`
    /// refuses (`None`) is put back together in `buf`, its payload beside its header, to be
    /// handled as any datagram. Returns what `check` gave, by datagram.
    ///
    /// # Safety
    ///
    /// The places given to `place` still hold what `receive` put there, and nothing writes
    /// them during the call.
    pub unsafe fn check_placed<T: Copy>(
        &self,
        buf: &mut [u8],
        from: usize,
        mut check: impl FnMut(usize, &[u8], &[u8]) -> Option<T>,
    ) -> [Option<T>; GRO_MAX_SEGMENTS] {
        let mut taken = [None; GRO_MAX_SEGMENTS];
        for k in (from..self.segments()).filter(|&k| self.is_placed(k)) {
            let len = self.in_buffer(k).len() - self.head;
            // SAFETY: the caller's: the place holds the datagram's payload, unwritten meanwhile.
            let placed = unsafe { std::slice::from_raw_parts(self.place_of(k), len) };
            let (header, room) = buf[self.in_buffer(k)].split_at_mut(self.head);
            taken[k] = check(k, header, placed);
            if taken[k].is_none() {
                room.copy_from_slice(placed);
            }
        }
        taken
    }

    fn place_of(&self, k: usize) -> *mut u8 {
        self.base.wrapping_add((self.first + k) * self.stride)
    }
}

/// What an attempt to receive the next run in place came to (`peek_run`, then `Scatter`), at
/// either end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peeked {
    /// Nothing waits.
    Empty,
    /// The run was received and handled in place.
    Taken,
    /// Not fragments this end can place: read it the usual way.
    Other,
}

/// Copies the first bytes of the next datagram (or coalesced run) waiting on `fd` into `buf`
/// without taking it, and the sender's address into `name` if given: the run's whole length
/// and its segment size (its length for a lone datagram). `WouldBlock` when nothing waits.
pub fn peek_run(
    fd: RawFd,
    buf: &mut [u8],
    name: Option<&mut libc::sockaddr_storage>,
) -> std::io::Result<(usize, usize)> {
    let mut cmsg = Cmsg::default();
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero message header (null pointers, zero lengths) is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    if let Some(name) = name {
        msg.msg_name = (name as *mut libc::sockaddr_storage).cast();
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
    }
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    cmsg.attach_for_receive(&mut msg);
    // MSG_TRUNC: the whole run's length, not what fitted `buf`.
    // SAFETY: `msg` points at `iov` (our `buf`), `cmsg` and `name`, alive for the call.
    let r = unsafe {
        libc::recvmsg(
            fd,
            &mut msg,
            libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_TRUNC,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let len = r as usize;
    Ok((len, cmsg.received_segment(&msg).unwrap_or(len)))
}

#[cfg(test)]
mod tests {
    /// A segment over the path MTU is refused with EMSGSIZE by kernels since "udp: gso: do not
    /// drop small packets when PMTU reduces" and with EINVAL before: both turn segmentation
    /// off for that destination; a full buffer does not.
    #[test]
    fn a_segment_over_the_path_mtu_is_a_refusal_on_every_kernel() {
        let e = std::io::Error::from_raw_os_error;
        for errno in [libc::EMSGSIZE, libc::EINVAL, libc::EIO] {
            assert!(super::refused(&e(errno)), "{errno}");
        }
        for errno in [libc::EAGAIN, libc::ENOBUFS, libc::ECONNREFUSED] {
            assert!(!super::refused(&e(errno)), "{errno}");
        }
    }

    /// A run's layout: what is placed keeps its header in the buffer and sends its payload to
    /// its place; the rest lies whole in the buffer; a datagram with no payload is never placed.
    #[test]
    fn a_scatter_lays_placed_payloads_out_at_their_places() {
        let mut dest = vec![0u8; 4 * 100];
        let mut buf = vec![0u8; 1000];
        assert!(
            super::Scatter::new(100, 100, 10, (dest.as_mut_ptr(), 0, 90)).is_none(),
            "one datagram"
        );
        assert!(
            super::Scatter::new(65 * 20, 20, 10, (dest.as_mut_ptr(), 0, 10)).is_none(),
            "65 datagrams"
        );
        // Three datagrams of 100 bytes and a last of 10 (header only): fragments 1 to 4.
        let mut s = super::Scatter::new(310, 100, 10, (dest.as_mut_ptr(), 1, 90)).unwrap();
        assert_eq!(
            (s.segments(), s.carries(2), s.carries(3)),
            (4, Some(90), None)
        );
        for k in [0, 2, 3] {
            s.place(k);
        }
        assert!(s.is_placed(0) && !s.is_placed(1) && s.is_placed(2) && !s.is_placed(3));
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 128];
        let n = s.iovecs(&mut buf, &mut iov);
        let at =
            |p: *mut libc::c_void, base: &[u8]| (p as usize).wrapping_sub(base.as_ptr() as usize);
        let got: Vec<(usize, usize, bool)> = iov[..n]
            .iter()
            .map(|v| {
                let in_buf = at(v.iov_base, &buf) < buf.len();
                let off = if in_buf {
                    at(v.iov_base, &buf)
                } else {
                    at(v.iov_base, &dest)
                };
                (off, v.iov_len, in_buf)
            })
            .collect();
        assert_eq!(
            got,
            [
                (0, 10, true),
                (90, 90, false),
                (100, 100, true),
                (200, 10, true),
                (270, 90, false),
                (300, 10, true)
            ]
        );
        assert_eq!(s.in_buffer(3), 300..310);
    }

    #[test]
    fn a_refusal_stops_segmenting_to_its_destination_and_enough_of_them_to_all() {
        let mut s = super::Segmenting::new(true);
        let (seg, one) = (super::run_limits(true), super::run_limits(false));
        s.refused_by(1u32);
        s.refused_by(1);
        assert_eq!((s.limits(&1), s.limits(&2)), (one, seg));
        for d in 2..=super::REFUSED_DESTINATIONS as u32 {
            assert!(s.on(), "{d} refusals turned it off for all");
            s.refused_by(d);
        }
        assert!(!s.on());
        assert_eq!(s.limits(&1000), one);
        let off = super::Segmenting::<u32>::new(false);
        assert_eq!(off.limits(&1), one);
    }

    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn segments_split_runs_and_keep_lone_datagrams() {
        let b = [1u8; 10];
        let lens: Vec<usize> = segments(&b, Some(4)).map(<[u8]>::len).collect();
        assert_eq!(lens, [4, 4, 2]);
        assert_eq!(segments(&b, None).count(), 1);
        assert_eq!(segments(&[], None).count(), 0);
    }

    /// A segmented send over loopback arrives as the same datagrams, whether the receiver
    /// coalesces (one buffer plus the segment size) or not (one receive per datagram).
    #[test]
    fn a_segmented_send_arrives_as_its_datagrams() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let plain = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(enable_gro(rx.as_raw_fd()), "UDP_GRO needs Linux 5.0");
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let data: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        for to in [&rx, &plain] {
            tx.connect(to.local_addr().unwrap()).unwrap();
            let mut iov = libc::iovec {
                iov_base: data.as_ptr() as *mut _,
                iov_len: data.len(),
            };
            // SAFETY: a zeroed msghdr is valid; it points at locals alive for the call.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            let mut c = Cmsg::default();
            c.attach_segment(&mut msg, 1000);
            // SAFETY: `msg` points at `iov`, `data` and `c`, all alive for the call.
            let n = unsafe { libc::sendmsg(tx.as_raw_fd(), &msg, 0) };
            assert_eq!(
                n,
                data.len() as isize,
                "{}",
                std::io::Error::last_os_error()
            );
        }
        // Coalescing receiver: one receive, segment size 1000.
        let mut buf = vec![0u8; GRO_BUFFER];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: an all-zero msghdr (null pointers, zero lengths) is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        let mut c = Cmsg::default();
        c.attach_for_receive(&mut msg);
        // SAFETY: recvmsg into locals (blocking: the datagrams were sent above).
        let n = unsafe { libc::recvmsg(rx.as_raw_fd(), &mut msg, 0) };
        assert_eq!(n, data.len() as isize);
        assert_eq!(c.received_segment(&msg), Some(1000));
        // Another buffer's message is not read through.
        assert_eq!(Cmsg::default().received_segment(&msg), None);
        let got: Vec<&[u8]> = segments(&buf[..n as usize], c.received_segment(&msg)).collect();
        let want: Vec<&[u8]> = data.chunks(1000).collect();
        assert_eq!(got, want);
        // Plain receiver: the kernel split the run into three datagrams.
        for want in data.chunks(1000) {
            let n = plain.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], want);
        }
    }

    /// A batch gathers each message from pieces that need not line up with its datagrams: a
    /// segmented run of three datagrams, each a header and data lying elsewhere, and a lone
    /// datagram of two pieces, in one `sendmmsg`, arrive as the datagrams they make up.
    #[test]
    fn a_batch_gathers_its_datagrams_from_pieces() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        // A datagram lost would fail the test, not hang it.
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        tx.connect(rx.local_addr().unwrap()).unwrap();
        let heads: Vec<[u8; 8]> = (0..4u8).map(|i| [i; 8]).collect();
        let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let mut iov = IoVecs::default();
        let mut batch = SendBatch::<4>::new(&mut iov);
        let run = (0..3).flat_map(|i| [(heads[i].as_ptr(), 8), (data[i * 1000..].as_ptr(), 1000)]);
        // SAFETY: `heads` and `data` outlive the send below.
        unsafe {
            batch.push(run, 1008, 3, |_| 0);
            batch.push(
                [(heads[3].as_ptr(), 8), (data.as_ptr(), 500)],
                508,
                1,
                |_| 0,
            );
        }
        let sent = batch
            .send(tx.as_raw_fd())
            .unwrap_or_else(|f| panic!("{}", f.error));
        assert_eq!((sent.datagrams, sent.segmented), (4, 3));
        let mut buf = vec![0u8; 2048];
        for (i, len) in [(0, 1000), (1, 1000), (2, 1000), (3, 500)] {
            let n = rx.recv(&mut buf).unwrap();
            let mut want = heads[i].to_vec();
            let at = if i == 3 { 0 } else { i * 1000 };
            want.extend_from_slice(&data[at..at + len]);
            assert_eq!(&buf[..n], &want[..], "datagram {i}");
        }
    }
}
