//! Opening datagram listeners: one socket per reactor, so each reactor owns its share of the
//! queues. UDP uses SO_REUSEPORT (the kernel spreads initiator sockets, each with its own source
//! port, over the reactors by flow hash); raw Ethernet uses one packet socket per reactor with a
//! classic BPF filter that accepts only the queues `queue % reactors == r`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::dgram::{PortKind, PortSetup};

/// Default EtherType: IEEE 802 local experimental 1 (PROTOCOL.md §9).
pub const DEFAULT_ETHERTYPE: u16 = blkwire_net::DEFAULT_ETHERTYPE;
pub const DEFAULT_UDP_PORT: u16 = 7701;
/// Largest fragment payload a target offers on UDP (the initiator's path MTU usually decides).
const UDP_MAX_PAYLOAD: u32 = 32 << 10;

/// A datagram listen address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DgramListen {
    Udp(SocketAddr),
    Eth {
        iface: String,
        ethertype: u16,
        /// `?qdisc=bypass`: replies skip the interface's qdisc (`packet_send_socket`).
        bypass_qdisc: bool,
    },
}

/// Parses `udp://ADDR[:PORT]` or `eth://IFACE[?ethertype=0x88b5][&qdisc=bypass]`; `None` for
/// other schemes.
pub fn parse(url: &str) -> Option<Result<DgramListen, String>> {
    let (scheme, rest) = url.split_once("://")?;
    let rest = rest.trim_end_matches('/');
    match scheme {
        "udp" => Some((|| {
            if let Some((_, query)) = rest.split_once('?') {
                return Err(format!(
                    "'{url}': udp:// listeners take no options (got '{query}'; qdisc=bypass is for eth://)"
                ));
            }
            if rest.is_empty() {
                return Err(format!(
                    "bad listen address '{url}': expected udp://ADDR[:PORT], e.g. udp://0.0.0.0:7701"
                ));
            }
            let with_port = crate::listen_authority(url, rest, DEFAULT_UDP_PORT)?;
            let a = with_port
                .to_socket_addrs()
                .map_err(|e| format!("listen address '{url}': cannot resolve {with_port}: {e}"))?
                .next()
                .ok_or_else(|| {
                    format!("listen address '{url}': {with_port} resolves to no address")
                })?;
            Ok(DgramListen::Udp(a))
        })()),
        "eth" => Some((|| {
            let (iface, query) = rest.split_once('?').unwrap_or((rest, ""));
            if iface.is_empty() || iface.len() > 15 || iface.contains('/') {
                return Err(format!(
                    "bad listen address '{url}': expected eth://IFACE, e.g. eth://enp1s0"
                ));
            }
            let mut ethertype = DEFAULT_ETHERTYPE;
            let mut bypass_qdisc = false;
            for kv in query.split('&').filter(|s| !s.is_empty()) {
                match kv {
                    "qdisc=bypass" => bypass_qdisc = true,
                    _ => {
                        let v = kv.strip_prefix("ethertype=").ok_or_else(|| {
                            format!("'{url}': unknown option '{kv}' (known: ethertype=0x88b5, qdisc=bypass)")
                        })?;
                        let v = v.trim_start_matches("0x");
                        ethertype = u16::from_str_radix(v, 16)
                            .ok()
                            .filter(|t| *t >= 0x0600)
                            .ok_or_else(|| format!("'{url}': bad EtherType '{kv}'"))?;
                    }
                }
            }
            Ok(DgramListen::Eth {
                iface: iface.to_string(),
                ethertype,
                bypass_qdisc,
            })
        })()),
        _ => None,
    }
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// SO_REUSEPORT would let a second target join a UDP port another one serves (clients would
/// alternate between the two). A target claims the address with an abstract Unix socket named
/// after it, which the kernel gives to one process per network namespace and takes back the
/// moment that process ends (a probe bind of the UDP port would instead fail for a moment
/// after a restart, while the old io_uring lets go of its sockets).
fn claim_udp_port(addr: SocketAddr) -> Result<OwnedFd, String> {
    // SAFETY: creating a socket.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os_err("unix socket"));
    }
    // SAFETY: we own the new fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = format!("blkwire/udp/{addr}");
    // SAFETY: an all-zero sockaddr_un is valid; the abstract name is filled in below.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays 0: the abstract namespace.
    for (d, s) in sa.sun_path[1..].iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len().min(sa.sun_path.len() - 1);
    // SAFETY: bind with our sockaddr_un and a length inside it.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::EADDRINUSE) {
            format!("cannot listen on udp://{addr}: another blkwire target serves it")
        } else {
            format!("cannot listen on udp://{addr}: claiming the port: {e}")
        });
    }
    Ok(fd)
}

/// With the claim held, a socket still bound to the port belongs to a target that has just
/// ended (its io_uring lets go of its sockets a moment after the process exits) or to another
/// program. Our sockets must not join the old ones' SO_REUSEPORT group: when those leave, the
/// kernel would move flows between our sockets, and a queue's frames would reach a reactor
/// that does not know its session. So wait (briefly) until nobody holds the port.
fn wait_for_udp_port(addr: SocketAddr) -> Result<(), String> {
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match std::net::UdpSocket::bind(addr) {
            Ok(_) => return Ok(()),
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && std::time::Instant::now() < give_up =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(format!("cannot listen on udp://{addr}: {e}")),
        }
    }
}

/// Opens `n` UDP sockets sharing one address with SO_REUSEPORT. Returns them and the URL bound.
pub fn open_udp(addr: SocketAddr, n: usize) -> Result<(Vec<PortSetup>, String), String> {
    let mut claim = match addr.port() {
        0 => None, // a port the kernel picks is nobody else's
        _ => Some(claim_udp_port(addr)?),
    };
    if claim.is_some() {
        wait_for_udp_port(addr)?;
    }
    let mut out = Vec::new();
    let mut bound = addr;
    for _ in 0..n {
        let domain = if addr.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        // SAFETY: creating a socket.
        let fd = unsafe {
            libc::socket(
                domain,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if fd < 0 {
            return Err(os_err("udp socket"));
        }
        // SAFETY: we own the new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        blkwire_net::setopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEPORT, 1);
        let sock = socket2_addr(bound);
        // SAFETY: bind with a properly sized sockaddr.
        if unsafe { libc::bind(fd.as_raw_fd(), sock.0.as_ptr().cast(), sock.1) } != 0 {
            return Err(format!(
                "cannot listen on udp://{addr}: {}",
                std::io::Error::last_os_error()
            ));
        }
        if bound.port() == 0 {
            bound = local_addr(fd.as_raw_fd()).unwrap_or(bound);
        }
        let rcvbuf = blkwire_net::size_buffers(fd.as_raw_fd());
        out.push(PortSetup {
            fd,
            kind: PortKind::Udp,
            link_payload: UDP_MAX_PAYLOAD,
            rcvbuf,
            // Another socket on the port would join the SO_REUSEPORT group and take a share
            // of the input.
            send_fd: None,
            ring: None,
            claim: claim.take(),
        });
    }
    Ok((out, format!("udp://{bound}")))
}

fn socket2_addr(a: SocketAddr) -> (Vec<u8>, libc::socklen_t) {
    match a {
        SocketAddr::V4(v) => {
            // SAFETY: zeroed sockaddr_in is valid.
            let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            s.sin_family = libc::AF_INET as u16;
            s.sin_port = v.port().to_be();
            s.sin_addr.s_addr = u32::from(*v.ip()).to_be();
            // SAFETY: viewing a plain C struct we own as its bytes, for its whole size.
            let b = unsafe {
                std::slice::from_raw_parts(
                    (&s as *const libc::sockaddr_in).cast::<u8>(),
                    std::mem::size_of_val(&s),
                )
            };
            (b.to_vec(), std::mem::size_of_val(&s) as libc::socklen_t)
        }
        SocketAddr::V6(v) => {
            // SAFETY: zeroed sockaddr_in6 is valid.
            let mut s: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            s.sin6_family = libc::AF_INET6 as u16;
            s.sin6_port = v.port().to_be();
            s.sin6_addr.s6_addr = v.ip().octets();
            s.sin6_scope_id = v.scope_id();
            // SAFETY: viewing a plain C struct we own as its bytes, for its whole size.
            let b = unsafe {
                std::slice::from_raw_parts(
                    (&s as *const libc::sockaddr_in6).cast::<u8>(),
                    std::mem::size_of_val(&s),
                )
            };
            (b.to_vec(), std::mem::size_of_val(&s) as libc::socklen_t)
        }
    }
}

fn local_addr(fd: i32) -> Option<SocketAddr> {
    // SAFETY: getsockname into a sockaddr_storage; the UdpSocket view is borrowed, not owned.
    let sock = std::mem::ManuallyDrop::new(unsafe { std::net::UdpSocket::from_raw_fd(fd) });
    sock.local_addr().ok()
}

/// Opens one packet socket per reactor on `iface`.
pub fn open_eth(
    iface: &str,
    ethertype: u16,
    bypass_qdisc: bool,
    n: usize,
) -> Result<(Vec<PortSetup>, String), String> {
    let info = blkwire_net::iface(iface)?;
    let (ifindex, mac) = (info.index, info.mac);
    let link_payload = blkwire_net::frame_payload_for(info.mtu, 0);
    let mut out = Vec::new();
    for r in 0..n {
        let filter = blkwire_net::Filter::QueueShare {
            n: n as u32,
            r: r as u32,
        };
        // The ring exists before the socket is bound: a frame that arrived before the reactor
        // took the port (a discovery query right after `listening`) waits in it.
        let frame = blkwire_wire::HEADER_LEN + link_payload as usize;
        let (fd, ring, rcvbuf) =
            blkwire_net::packet_socket_with_ring(ifindex, ethertype, filter, frame)?;
        out.push(PortSetup {
            fd,
            kind: PortKind::Eth { ifindex, ethertype },
            link_payload,
            rcvbuf,
            send_fd: Some(blkwire_net::packet_send_socket(ifindex, bypass_qdisc)?),
            ring,
            claim: None,
        });
    }
    let m = mac;
    let url = format!(
        "eth://{iface}/{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    );
    Ok((out, url))
}

#[cfg(test)]
mod tests {
    use super::{parse, DgramListen, DEFAULT_ETHERTYPE};

    #[test]
    fn parses_eth_options() {
        let eth = |url: &str| parse(url).unwrap();
        assert_eq!(
            eth("eth://vt?qdisc=bypass&ethertype=0x88b6").unwrap(),
            DgramListen::Eth {
                iface: "vt".into(),
                ethertype: 0x88b6,
                bypass_qdisc: true,
            }
        );
        assert_eq!(
            eth("eth://vt").unwrap(),
            DgramListen::Eth {
                iface: "vt".into(),
                ethertype: DEFAULT_ETHERTYPE,
                bypass_qdisc: false,
            }
        );
        for bad in [
            "eth://vt?qdisc=fast",
            "eth://vt?ethertype=0x10",
            "eth://vt?mtu=1",
        ] {
            let e = eth(bad).unwrap_err();
            assert!(e.contains(bad), "{bad}: {e}");
        }
        assert!(parse("tcp://h:1").is_none());
        let e = parse("udp://0.0.0.0:7701?qdisc=bypass")
            .unwrap()
            .unwrap_err();
        assert!(e.contains("eth://"), "{e}");
    }
}
