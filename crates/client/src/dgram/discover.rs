//! Discovery (PROTOCOL.md §9.5): a LIST frame broadcast on a link, or sent to one UDP target,
//! and every answer collected until a deadline.

use std::time::{Duration, Instant};

use blkwire_wire::{Header, Opcode, Tag};

use super::link::{udp_link, Link};
use crate::{Error, Result};

/// Largest LIST answer asked for: a few dozen exports.
const LIST_ROOM: u32 = 4096;

/// Most targets one discovery collects: whoever else on the link answers (with made-up MACs)
/// cannot grow the list without bound.
const MAX_TARGETS: usize = 256;

/// One target that answered a discovery query.
#[derive(Clone, Debug)]
pub struct Discovered {
    /// `eth://IFACE/MAC` or `udp://HOST:PORT`: prefix of the export URLs.
    pub base: String,
    /// What it exports (§7 LIST entries).
    pub exports: Vec<blkwire_wire::ExportEntry>,
    /// It answered ACCESS: it has keys and lists its exports only to an authenticated query
    /// (PROTOCOL.md §12.3, `blkwire info URL --key FILE`).
    pub locked: bool,
}

/// Sends a LIST frame (PROTOCOL.md §9.5) and collects every answer until `wait` passes.
/// `link` sends to the broadcast (or a unicast) address on a packet socket, or to its connected
/// UDP peer; `base_of` names a target after the address its answer came from.
fn discover_on(
    link: &Link,
    wait: Duration,
    base_of: &dyn Fn(&libc::sockaddr_ll) -> String,
) -> Vec<Discovered> {
    // Padded: a target answers an unproven address with no more bytes than it sent
    // (PROTOCOL.md §12.5), so the request is as large as the answer wanted.
    let pad = vec![0u8; link.mtu_payload.clamp(512, LIST_ROOM) as usize];
    // A random mark, echoed in the answers (PROTOCOL.md §3): another process's LIST, asked
    // with another host id, may be answered with other exports.
    let mut h = Header::request(Opcode::List, Tag::new(0, 0), crate::random_u64(), 0);
    h.payload_len = pad.len() as u32;
    h.seal_crc(&pad);
    let mut frame = h.to_bytes().to_vec();
    frame.extend_from_slice(&pad);
    link.send_one(&frame);
    let deadline = Instant::now() + wait;
    let mut found: Vec<Discovered> = Vec::new();
    let mut buf = vec![0u8; 65536];
    while let Some((f, from)) = link.recv_reply(&mut buf, deadline) {
        if f.header.opcode != Opcode::List || f.header.offset != h.offset || f.sealed() {
            continue;
        }
        let locked = f.header.status == blkwire_wire::Status::Access;
        let exports = if locked {
            Vec::new()
        } else {
            match blkwire_wire::ExportEntry::decode_list(f.payload) {
                Ok(e) => e,
                Err(_) => continue,
            }
        };
        let base = base_of(&from);
        if !found.iter().any(|d| d.base == base) {
            found.push(Discovered {
                base,
                exports,
                locked,
            });
            if found.len() == MAX_TARGETS {
                break;
            }
        }
    }
    found
}

/// Broadcasts a LIST on `iface` and returns every target that answered within `wait` (the
/// first 256).
pub fn discover_eth(iface: &str, wait: Duration) -> Result<Vec<Discovered>> {
    let info = blkwire_net::iface(iface).map_err(Error::Usage)?;
    let ethertype = blkwire_net::DEFAULT_ETHERTYPE;
    let filter = blkwire_net::Filter::Queue {
        queue: 0,
        session: Some(0),
    };
    let fd = blkwire_net::packet_socket(info.index, ethertype, filter).map_err(Error::Usage)?;
    let link = Link {
        fd,
        dest: Some(blkwire_net::link_addr(info.index, ethertype, [0xff; 6])),
        mtu_payload: blkwire_net::frame_payload_for(info.mtu, 0),
        send_fd: None,
        rcvbuf: 0,
    };
    let iface = iface.to_string();
    Ok(discover_on(&link, wait, &|from| {
        let mut m = [0u8; 6];
        m.copy_from_slice(&from.sll_addr[..6]);
        format!("eth://{iface}/{}", crate::format_mac(&m))
    }))
}

/// Asks one UDP target for its exports.
pub fn discover_udp(addr: std::net::SocketAddr, wait: Duration) -> Result<Vec<Discovered>> {
    let link = udp_link(addr)?;
    Ok(discover_on(&link, wait, &|_| format!("udp://{addr}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkwire_wire::{ExportEntry, Status};
    use std::net::UdpSocket;

    /// More answers than a discovery keeps, each from a target of its own (as many MACs as a
    /// forger on the link cares to make up): the first 256 are kept, and the wait ends there.
    #[test]
    fn a_discovery_keeps_at_most_256_targets() {
        let target = UdpSocket::bind("127.0.0.1:0").unwrap();
        let link = udp_link(target.local_addr().unwrap()).unwrap();
        let answers = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            let (n, from) = target.recv_from(&mut buf).unwrap();
            let f = blkwire_wire::datagram::frames(&buf[..n], 65536)
                .next()
                .unwrap()
                .unwrap();
            let list = ExportEntry::encode_list(&[]).unwrap();
            let mut r = f.header.reply(Status::Ok, list.len() as u32);
            r.seal_crc(&list);
            let mut out = r.to_bytes().to_vec();
            out.extend_from_slice(&list);
            for _ in 0..300 {
                target.send_to(&out, from).unwrap();
            }
        });
        let named = std::cell::Cell::new(0);
        let start = Instant::now();
        let found = discover_on(&link, Duration::from_secs(20), &|_| {
            named.set(named.get() + 1);
            format!("target-{}", named.get())
        });
        answers.join().unwrap();
        assert_eq!(found.len(), MAX_TARGETS);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }
}
