//! A TPACKET_V2 receive ring on a packet socket (raw Ethernet, PROTOCOL.md §9): the kernel copies
//! each frame into memory shared with us while it still holds the frame in its receive path, and
//! frees its buffer there and then; we read frames in place, in order, and hand each slot back.
//! Compared with `recvmmsg` this saves the syscall per batch, the socket queue and its lock, and
//! the freeing of the kernel's buffer on the reader's CPU; waiting for a frame is a load from
//! memory instead of a poll syscall.

use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// Socket options and version (linux/if_packet.h).
const PACKET_RX_RING: libc::c_int = 5;
const PACKET_VERSION: libc::c_int = 10;
const TPACKET_V2: libc::c_int = 1;
/// `tp_status` bits.
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;
/// `struct tpacket2_hdr` is 32 bytes; the kernel writes a `sockaddr_ll` right after it.
const TPACKET2_HDR: usize = 32;
/// Room the kernel keeps before the packet data in each slot: the header, the sockaddr_ll and
/// alignment (it places the data at TPACKET_ALIGN(32 + 20) + 16 = 80 for cooked sockets).
const SLOT_OVERHEAD: usize = 128;

#[repr(C)]
struct Tpacket2Hdr {
    tp_status: u32,
    tp_len: u32,
    tp_snaplen: u32,
    tp_mac: u16,
    tp_net: u16,
    tp_sec: u32,
    tp_nsec: u32,
    tp_vlan_tci: u16,
    tp_vlan_tpid: u16,
    tp_padding: [u8; 4],
}

#[repr(C)]
struct TpacketReq {
    tp_block_size: u32,
    tp_block_nr: u32,
    tp_frame_size: u32,
    tp_frame_nr: u32,
}

/// One frame in the ring: its bytes (the Ethernet payload) and the link-layer header the kernel
/// filled in (source MAC, packet type).
pub struct RxFrame<'a> {
    /// The frame's bytes (the blkwire datagram).
    pub data: &'a [u8],
    /// The sender's link-layer address, as the kernel filled it in.
    pub from: &'a libc::sockaddr_ll,
}

/// A mapped TPACKET_V2 receive ring: frames are read in place, oldest first.
pub struct RxRing {
    base: NonNull<u8>,
    map_len: usize,
    slot_size: usize,
    block_size: usize,
    slots_per_block: usize,
    slots: usize,
    next: usize,
    /// The interface the socket is bound to: frames from any other are passed over
    /// (`for_this_link`).
    ifindex: i32,
}

// SAFETY: the mapping belongs to this value alone (the socket is only read through it), so moving
// it to another thread moves the only access.
unsafe impl Send for RxRing {}

/// Sets up (or, all zero, takes down) the receive ring of packet socket `fd`; setsockopt's result.
fn set_ring(fd: RawFd, req: &TpacketReq) -> libc::c_int {
    // SAFETY: the option value is the caller's tpacket_req, with its true size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            PACKET_RX_RING,
            (req as *const TpacketReq).cast(),
            std::mem::size_of::<TpacketReq>() as libc::socklen_t,
        )
    }
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl RxRing {
    /// Sets up a ring of `slots` frames of up to `frame` bytes on packet socket `fd`. From then on
    /// the kernel delivers to the ring, not to `recv`.
    pub fn new(fd: RawFd, frame: usize, slots: usize, ifindex: i32) -> Result<RxRing, String> {
        let version = TPACKET_V2;
        // SAFETY: the option value is a local int, with its true size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_PACKET,
                PACKET_VERSION,
                (&version as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(os_err("packet ring version"));
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let slot_size = (frame + SLOT_OVERHEAD).next_multiple_of(16);
        let block_size = slot_size.next_multiple_of(page);
        let slots_per_block = block_size / slot_size;
        let blocks = slots.max(1).div_ceil(slots_per_block);
        let slots = blocks * slots_per_block;
        let req = TpacketReq {
            tp_block_size: block_size as u32,
            tp_block_nr: blocks as u32,
            tp_frame_size: slot_size as u32,
            tp_frame_nr: slots as u32,
        };
        if set_ring(fd, &req) != 0 {
            return Err(os_err("packet receive ring"));
        }
        let map_len = block_size * blocks;
        // SAFETY: mapping the ring the kernel just allocated for this socket.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = os_err("map packet receive ring");
            // The ring stays set up unless taken down: the kernel would deliver every frame
            // to it, unmapped, and the caller's `recv` fallback would never see one.
            // (An all-zero request frees the ring.)
            set_ring(
                fd,
                &TpacketReq {
                    tp_block_size: 0,
                    tp_block_nr: 0,
                    tp_frame_size: 0,
                    tp_frame_nr: 0,
                },
            );
            return Err(e);
        }
        Ok(RxRing {
            base: NonNull::new(p.cast()).expect("mmap succeeded"),
            map_len,
            slot_size,
            block_size,
            slots_per_block,
            slots,
            next: 0,
            ifindex,
        })
    }

    /// Frames the ring holds: what the receiver can take before the kernel drops.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The slot the next frame will be in.
    fn current(&self) -> *mut u8 {
        let i = self.next;
        let at = (i / self.slots_per_block) * self.block_size
            + (i % self.slots_per_block) * self.slot_size;
        // SAFETY: `next` is always below `slots` (it starts at 0 and `release` wraps it), so the
        // slot starts inside the mapping of `slots` slots laid out in whole blocks.
        unsafe { self.base.as_ptr().add(at) }
    }

    fn status(&self) -> &AtomicU32 {
        // SAFETY: every slot starts with a 16-aligned tpacket2_hdr whose first field is the status
        // word the kernel and we hand over with; the kernel writes it with release semantics.
        unsafe { &*self.current().cast::<AtomicU32>() }
    }

    /// Whether a frame is waiting.
    pub fn ready(&self) -> bool {
        self.status().load(Ordering::Acquire) & TP_STATUS_USER != 0
    }

    /// The oldest frame waiting, if any. It stays valid until `release`.
    pub fn peek(&self) -> Option<RxFrame<'_>> {
        if !self.ready() {
            return None;
        }
        let s = self.current();
        // SAFETY: the kernel filled this slot (status USER, acquired above) and does not touch it
        // until we hand it back. The data window comes from the kernel but is checked against the
        // slot before it is used, so a bad value yields an empty frame, never a read outside.
        unsafe {
            let h = &*s.cast::<Tpacket2Hdr>();
            let start = h.tp_net as usize;
            let len = h.tp_snaplen as usize;
            // A frame longer than its slot arrives cut (tp_len > tp_snaplen): handed over
            // empty, so it is dropped as malformed instead of read as a shorter frame.
            let whole = h.tp_len == h.tp_snaplen;
            let data = if whole && start >= TPACKET2_HDR && start + len <= self.slot_size {
                std::slice::from_raw_parts(s.add(start), len)
            } else {
                &[]
            };
            let from = &*s.add(TPACKET2_HDR).cast::<libc::sockaddr_ll>();
            Some(RxFrame { data, from })
        }
    }

    /// Takes the frames waiting, at most one lap of the ring (so a flood cannot hold the caller),
    /// and hands each to `f` with its sender's link-layer address, then back to the kernel.
    /// Frames that are not this link's (`for_this_link`: sent by this host, for another
    /// station, from another interface or VLAN) are skipped. Returns the frames taken.
    pub fn take_lap(&mut self, mut f: impl FnMut(&[u8], &libc::sockaddr_ll)) -> usize {
        let mut taken = 0;
        while taken < self.slots {
            let Some(frame) = self.peek() else { break };
            if crate::for_this_link(frame.from, self.ifindex) {
                f(frame.data, frame.from);
            }
            self.release();
            taken += 1;
        }
        taken
    }

    /// Hands the frame `peek` returned back to the kernel.
    pub fn release(&mut self) {
        self.status().store(TP_STATUS_KERNEL, Ordering::Release);
        self.next = (self.next + 1) % self.slots;
    }
}

impl Drop for RxRing {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no frame borrows outlive `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, OwnedFd};

    /// IEEE 802 local experimental 2: not blkwire's EtherType, so a target on this host is
    /// never disturbed.
    const TEST_ETHERTYPE: u16 = 0x88B6;

    /// A packet socket on the loopback interface for the test EtherType and its link address;
    /// the test fails, saying why, without the privilege to open one.
    fn lo_socket() -> (OwnedFd, libc::sockaddr_ll) {
        let fd = crate::open_packet(0).unwrap_or_else(|e| {
            panic!("this test needs root or CAP_NET_RAW (a packet socket): {e}")
        });
        let lo = crate::iface("lo").expect("loopback interface");
        crate::bind_packet(&fd, lo.index, TEST_ETHERTYPE).expect("bind to lo");
        (fd, crate::link_addr(lo.index, TEST_ETHERTYPE, [0; 6]))
    }

    /// Frames sent on the loopback interface come out of the ring whole, in order, slot after
    /// slot and round again; one longer than a slot comes out empty, never cut short nor read
    /// past its slot.
    #[test]
    fn frames_arrive_in_order_and_slots_come_back() {
        let (rx, _) = lo_socket();
        let (tx, to) = lo_socket();
        let mut ring = RxRing::new(rx.as_raw_fd(), 1000, 3, to.sll_ifindex).expect("ring");
        assert!(ring.slots() >= 3);
        assert!(!ring.ready());
        let send = |payload: &[u8]| {
            // SAFETY: sendto from a local buffer to the loopback link address.
            let n = unsafe {
                libc::sendto(
                    tx.as_raw_fd(),
                    payload.as_ptr().cast(),
                    payload.len(),
                    0,
                    (&to as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(
                n,
                payload.len() as isize,
                "{}",
                std::io::Error::last_os_error()
            );
        };
        for round in 0..3 * ring.slots() {
            let payload: Vec<u8> = (0..100 + round).map(|i| (i + round) as u8).collect();
            send(&payload);
            // Loopback delivers in the sender's context: the frame is there when sendto returns.
            let f = ring.peek().expect("frame in the ring");
            assert_eq!(f.data, &payload[..]);
            assert_eq!(u16::from_be(f.from.sll_protocol), TEST_ETHERTYPE);
            ring.release();
            assert!(ring.peek().is_none());
        }
        let long = vec![7u8; 1400];
        send(&long);
        let f = ring.peek().expect("long frame");
        assert!(
            f.data.is_empty(),
            "a frame cut to its slot is handed over empty"
        );
        ring.release();
        // take_lap hands over every waiting frame in order; frames beyond a full ring are
        // dropped by the kernel, not overwritten.
        for b in 1..=ring.slots() as u8 + 2 {
            send(&[b; 10]);
        }
        let mut seen = Vec::new();
        assert_eq!(ring.take_lap(|d, _| seen.push(d[0])), ring.slots());
        let want: Vec<u8> = (1..=ring.slots() as u8).collect();
        assert_eq!(seen, want);
        assert!(
            ring.peek().is_none(),
            "the ring was full: later frames were dropped"
        );
        // A ring for another interface takes the frames off the socket but hands none over
        // (as a socket bound to a NIC hears its VLANs' frames, named by their own devices).
        ring.ifindex = to.sll_ifindex + 1000;
        send(&[9; 10]);
        let mut handed = 0;
        assert_eq!(ring.take_lap(|_, _| handed += 1), 1, "taken off the socket");
        assert_eq!(handed, 0, "another interface's frame handed over");
    }

    /// A frame another station was sent (a promiscuous NIC) or this host sent is no frame of
    /// this link's; one from its own interface addressed here is.
    #[test]
    fn only_frames_for_this_station_on_this_interface_are_this_links() {
        // SAFETY: an all-zero sockaddr_ll is a valid value (plain integers).
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        from.sll_ifindex = 3;
        for (pkttype, ours) in [
            (libc::PACKET_HOST, true),
            (libc::PACKET_BROADCAST, true),
            (libc::PACKET_MULTICAST, true),
            (libc::PACKET_OTHERHOST, false),
            (libc::PACKET_OUTGOING, false),
        ] {
            from.sll_pkttype = pkttype;
            assert_eq!(crate::for_this_link(&from, 3), ours, "type {pkttype}");
            assert!(
                !crate::for_this_link(&from, 4),
                "type {pkttype} on another interface"
            );
        }
    }
}
