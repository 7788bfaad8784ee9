//! Discovery (PROTOCOL.md §9.5): a LIST frame broadcast on a link, or sent to one UDP target,
//! and every answer collected until a deadline.

use std::time::{Duration, Instant};

use blkwire_wire::{Header, Opcode, Tag};

use super::link::{udp_link, Link};
use crate::{Error, Result};

/// One target that answered a discovery query.
#[derive(Clone, Debug)]
pub struct Discovered {
    /// `eth://IFACE/MAC` or `udp://HOST:PORT`: prefix of the export URLs.
    pub base: String,
    /// What it exports (§7 LIST entries).
    pub exports: Vec<blkwire_wire::ExportEntry>,
}

/// Sends a LIST frame (PROTOCOL.md §9.5) and collects every answer until `wait` passes.
/// `link` sends to the broadcast (or a unicast) address on a packet socket, or to its connected
/// UDP peer; `base_of` names a target after the address its answer came from.
fn discover_on(
    link: &Link,
    wait: Duration,
    base_of: &dyn Fn(&libc::sockaddr_ll) -> String,
) -> Vec<Discovered> {
    let mut h = Header::request(Opcode::List, Tag::new(0, 0), 0, 0);
    h.seal_crc(&[]);
    link.send_one(&h.to_bytes());
    let deadline = Instant::now() + wait;
    let mut found: Vec<Discovered> = Vec::new();
    let mut buf = vec![0u8; 65536];
    while let Some((r, p, from)) = link.recv_reply(&mut buf, deadline) {
        if r.opcode != Opcode::List {
            continue;
        }
        let Ok(exports) = blkwire_wire::ExportEntry::decode_list(p) else {
            continue;
        };
        let base = base_of(&from);
        if !found.iter().any(|d| d.base == base) {
            found.push(Discovered { base, exports });
        }
    }
    found
}

/// Broadcasts a LIST on `iface` and returns every target that answered within `wait`.
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
        mtu_payload: 0,
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
