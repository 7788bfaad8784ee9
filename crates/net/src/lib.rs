#![deny(missing_docs)]
//! Link-level socket plumbing for the datagram transports (PROTOCOL.md §9), shared by the target
//! and the initiator so both open, size and filter their sockets the same way.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub mod rx_ring;
pub mod testing;
pub mod udp_offload;

/// Default EtherType: IEEE 802 local experimental 1.
pub const DEFAULT_ETHERTYPE: u16 = 0x88B5;
/// Bytes of the blkwire frame header (PROTOCOL.md §1).
const FRAME_HEADER: u32 = 48;

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// Sets an `int` socket option on `fd`; failure is ignored (callers treat every option as a best effort).
pub fn setopt(fd: i32, level: i32, opt: i32, v: libc::c_int) {
    let _ = try_setopt(fd, level, opt, v);
}

/// Sets an `int` socket option on `fd`, or says why not.
fn try_setopt(fd: i32, level: i32, opt: i32, v: libc::c_int) -> std::io::Result<()> {
    // SAFETY: setsockopt with an int on a socket the caller owns.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Asks for 4 MiB socket buffers (the kernel caps them at rmem_max/wmem_max) and returns the
/// usable receive buffer.
pub fn size_buffers(fd: i32) -> u32 {
    setopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20);
    setopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` is a local int and `len` its true size.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // The kernel reports double the usable size (bookkeeping overhead).
    (v.max(0) as u32) / 2
}

/// Largest multiple of 8 that fits a link MTU after `overhead` bytes of lower headers and the
/// 48-byte frame header (at least 512), capped at 32 KiB so one frame stays well inside a 64 KiB
/// datagram. Every byte of the MTU counts: rounding to 512 would cost a 4 KiB read at MTU 1500 a
/// fourth frame (1024 bytes each instead of 1448).
pub fn frame_payload_for(mtu: u32, overhead: u32) -> u32 {
    let room = mtu.saturating_sub(overhead + FRAME_HEADER).min(32 << 10);
    (room / 8 * 8).max(512)
}

/// Facts about a network interface.
#[derive(Clone, Copy, Debug)]
pub struct Iface {
    /// Interface index (`if_nametoindex`).
    pub index: i32,
    /// Link MTU (1500 if sysfs does not say).
    pub mtu: u32,
    /// The interface's own MAC address.
    pub mac: [u8; 6],
}

/// Looks up interface `name`: its index, MTU and MAC.
pub fn iface(name: &str) -> Result<Iface, String> {
    let c = std::ffi::CString::new(name).map_err(|_| format!("bad interface name '{name}'"))?;
    // SAFETY: if_nametoindex on a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) } as i32;
    if index == 0 {
        return Err(format!("no network interface '{name}' (see `ip link`)"));
    }
    let read =
        |f: &str| std::fs::read_to_string(format!("/sys/class/net/{name}/{f}")).unwrap_or_default();
    let mtu = read("mtu").trim().parse().unwrap_or(1500);
    let mut mac = [0u8; 6];
    for (i, p) in read("address").trim().split(':').enumerate().take(6) {
        mac[i] = u8::from_str_radix(p, 16).unwrap_or(0);
    }
    Ok(Iface { index, mtu, mac })
}

/// What a packet socket lets through, checked in the kernel by a classic BPF program on the
/// frame header (the socket is cooked, so offsets start at the blkwire header).
#[derive(Clone, Copy, Debug)]
pub enum Filter {
    /// Target reactors: queues with `queue % n == r` (low byte of the little-endian queue field).
    QueueShare {
        /// Reactors sharing the interface.
        n: u32,
        /// This reactor's share.
        r: u32,
    },
    /// Initiator queues: exactly this queue (and, once known, this session).
    Queue {
        /// The queue index.
        queue: u16,
        /// The session id, once the HELLO reply gave one.
        session: Option<u32>,
    },
}

const LD_W_ABS: u16 = 0x20;
const LD_H_ABS: u16 = 0x28;
const LD_B_ABS: u16 = 0x30;
const MOD_K: u16 = 0x94;
const JEQ_K: u16 = 0x15;
const RET_K: u16 = 0x06;

fn ins(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Attaches (or replaces) the socket's filter.
pub fn attach_filter(fd: i32, f: Filter) -> Result<(), String> {
    // BPF loads are big-endian; our header is little-endian, so compare with swapped constants.
    let prog: Vec<libc::sock_filter> = match f {
        Filter::QueueShare { n, r } => vec![
            ins(LD_B_ABS, 0, 0, 8),
            ins(MOD_K, 0, 0, n.max(1)),
            ins(JEQ_K, 0, 1, r),
            ins(RET_K, 0, 0, 0xffff),
            ins(RET_K, 0, 0, 0),
        ],
        Filter::Queue {
            queue,
            session: None,
        } => vec![
            ins(LD_H_ABS, 0, 0, 8),
            ins(JEQ_K, 0, 1, queue.swap_bytes() as u32),
            ins(RET_K, 0, 0, 0xffff),
            ins(RET_K, 0, 0, 0),
        ],
        Filter::Queue {
            queue,
            session: Some(s),
        } => vec![
            ins(LD_H_ABS, 0, 0, 8),
            ins(JEQ_K, 0, 3, queue.swap_bytes() as u32),
            ins(LD_W_ABS, 0, 0, 44),
            ins(JEQ_K, 0, 1, s.swap_bytes()),
            ins(RET_K, 0, 0, 0xffff),
            ins(RET_K, 0, 0, 0),
        ],
    };
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut _,
    };
    // SAFETY: the kernel copies the program during the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as u32,
        )
    };
    if rc != 0 {
        return Err(os_err("attach BPF filter"));
    }
    Ok(())
}

/// Whether a packet socket bound to `ifindex` takes a frame it received from `from`: not one
/// this host sent (packet sockets see those loop back), not one addressed to another station
/// (a NIC in promiscuous mode, a bridge member), and one that came in on that very interface.
/// A socket bound to an interface also hears its VLANs, their tag stripped: a frame of a VLAN
/// with a device of its own names that device's index, one without is addressed to no station
/// here. Taken, either would cross the VLAN's boundary with whatever MAC it claims.
pub fn for_this_link(from: &libc::sockaddr_ll, ifindex: i32) -> bool {
    from.sll_pkttype != libc::PACKET_OUTGOING
        && from.sll_pkttype != libc::PACKET_OTHERHOST
        && from.sll_ifindex == ifindex
}

/// A cooked packet socket (the kernel builds the Ethernet header) bound to an interface and an
/// EtherType, non-blocking, with its filter attached before it is bound so nothing slips through:
/// opened for no EtherType, it hears nothing until `bind` names the interface and the type
/// together (opened for the type, it would hear every interface's frames until then).
pub fn packet_socket(ifindex: i32, ethertype: u16, filter: Filter) -> Result<OwnedFd, String> {
    let fd = open_packet(0)?;
    attach_filter(fd.as_raw_fd(), filter)?;
    // No PACKET_QDISC_BYPASS: this socket only sends discovery answers and the like; the data
    // path sends on `packet_send_socket`, which bypasses the qdisc when asked.
    bind_packet(&fd, ifindex, ethertype)?;
    Ok(fd)
}

/// `packet_socket` with its buffers sized and a receive ring (`rx_ring`) set up before it is
/// bound, so no frame can arrive outside the ring: once a ring is there the kernel delivers only
/// to it, and a frame queued on the socket before would never be read. The ring has as many
/// slots as the receive buffer holds frames of `frame` bytes; `None` if the kernel refuses one
/// (frames then come by `recv`). Returns the socket, the ring and the usable receive buffer.
pub fn packet_socket_with_ring(
    ifindex: i32,
    ethertype: u16,
    filter: Filter,
    frame: usize,
) -> Result<(OwnedFd, Option<rx_ring::RxRing>, u32), String> {
    // For no EtherType until bound, as `packet_socket`.
    let fd = open_packet(0)?;
    attach_filter(fd.as_raw_fd(), filter)?;
    let rcvbuf = size_buffers(fd.as_raw_fd());
    let slots = frames_in_buffer(rcvbuf, frame as u32) as usize;
    let ring = rx_ring::RxRing::new(fd.as_raw_fd(), frame, slots, ifindex).ok();
    bind_packet(&fd, ifindex, ethertype)?;
    Ok((fd, ring, rcvbuf))
}

/// A packet socket that only sends, on `ifindex`: bound to no EtherType, it receives nothing, so
/// nobody ever waits on it. Sending on the socket a thread polls for input would make the kernel
/// wake that socket's waiters every time one of its sent frames is freed (write space), which on
/// a busy queue is a lock and a wake-up call per frame.
///
/// `bypass_qdisc` hands frames straight to the driver (`PACKET_QDISC_BYPASS`): 0-12% less CPU
/// per 4 KiB read over veth, within the noise (docs/BENCHMARKS.md), but the qdisc and tc egress
/// rules no longer see the frames (nor, on the 6.18 kernel here, nftables netdev egress rules;
/// kernels may differ), and a full device queue drops a
/// frame instead of holding it (the protocol's recovery resends it). Opt-in, for links where
/// nothing on the host shapes or filters the traffic.
pub fn packet_send_socket(ifindex: i32, bypass_qdisc: bool) -> Result<OwnedFd, String> {
    // Protocol 0 registers no receive hook.
    let fd = open_packet(0)?;
    if bypass_qdisc {
        try_setopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            1,
        )
        .map_err(|e| format!("cannot bypass the qdisc (PACKET_QDISC_BYPASS): {e}"))?;
    }
    bind_packet(&fd, ifindex, 0)?;
    size_buffers(fd.as_raw_fd());
    Ok(fd)
}

/// A non-blocking cooked packet socket for `ethertype` (0: none), not yet bound.
fn open_packet(ethertype: u16) -> Result<OwnedFd, String> {
    // SAFETY: socket(2) takes no pointers; the result is checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            ethertype.to_be() as i32,
        )
    };
    if fd < 0 {
        return Err(format!(
            "{} (raw Ethernet needs root or CAP_NET_RAW)",
            os_err("packet socket")
        ));
    }
    // SAFETY: `fd` was just returned by socket(2), is valid, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn bind_packet(fd: &OwnedFd, ifindex: i32, ethertype: u16) -> Result<(), String> {
    let sll = link_addr(ifindex, ethertype, [0; 6]);
    // SAFETY: `sll` is a local sockaddr_ll passed with its true size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if rc != 0 {
        return Err(os_err("bind packet socket"));
    }
    Ok(())
}

/// A link-layer address for sendto on a packet socket.
pub fn link_addr(ifindex: i32, ethertype: u16, mac: [u8; 6]) -> libc::sockaddr_ll {
    // SAFETY: an all-zero sockaddr_ll (plain integers and bytes) is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ethertype.to_be();
    sll.sll_ifindex = ifindex;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&mac);
    sll
}

/// How many frames of `frame` bytes a socket buffer of `rcvbuf` bytes holds. The kernel charges
/// each packet its buffer's true size (data rounded up to the allocation, plus bookkeeping), not
/// its length, so a 1 KiB frame costs about 2 KiB and a 9 KB jumbo frame 16 KiB.
pub fn frames_in_buffer(rcvbuf: u32, frame: u32) -> u32 {
    let truesize = (frame + 320).next_power_of_two();
    (rcvbuf / truesize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_fit_the_link() {
        assert_eq!(frame_payload_for(1500, 28), 1424);
        assert_eq!(frame_payload_for(9000, 28), 8920);
        assert_eq!(frame_payload_for(1500, 0), 1448);
        assert_eq!(frame_payload_for(65536, 28), 32 << 10);
        assert_eq!(frame_payload_for(100, 28), 512);
        assert_eq!(frames_in_buffer(4 << 20, 1072), 2048);
        assert_eq!(frames_in_buffer(4 << 20, 8752), 256);
        assert_eq!(frames_in_buffer(100, 8752), 1);
    }
}
