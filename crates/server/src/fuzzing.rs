//! In-process entry points for the fuzz targets under `fuzz/`; not an API (hidden from the
//! docs, no stability). The datagram port is the target's most exposed decoder: any host that
//! can send it a UDP datagram or an Ethernet frame reaches its session table, its fragment
//! reassembly and the exactly-once rules of PROTOCOL.md §6 and §9, so `fuzz/fuzz_targets/
//! dgram.rs` drives it here the way the reactor does, one datagram at a time.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use blkwire_backend::{ExportSpec, Submitter};

use crate::access::Access;
use crate::dgram::{DgramPort, Peer, PortKind, PortSetup};
use crate::session::{Limits, Registry};

/// A UDP datagram port on 127.0.0.1 serving RAM exports, fed datagrams by the caller.
pub struct DatagramPort {
    pub(crate) port: DgramPort,
    registry: Arc<Registry>,
    link_payload: u32,
    pushed: usize,
}

/// The reactor's ring, as far as a port serving RAM exports needs one: their I/O completes
/// inline, so nothing should be pushed; what is (counted) never completes.
struct Entries<'a>(&'a mut usize);

impl Submitter for Entries<'_> {
    fn push(&mut self, _: io_uring::squeue::Entry) {
        *self.0 += 1;
    }
}

impl DatagramPort {
    /// A port with frames of up to `link_payload` bytes of payload and these exports
    /// (`NAME=mem:SIZE`), open to every host (no keys), with the default limits.
    pub fn new(exports: &[&str], link_payload: u32) -> io::Result<DatagramPort> {
        let registry = Arc::new(Registry::new(
            Access::new(Default::default()),
            Limits::default(),
        ));
        for spec in exports {
            let spec = ExportSpec::parse(spec).map_err(|e| io::Error::other(e.to_string()))?;
            registry.add_export(spec).map_err(io::Error::other)?;
        }
        Self::serving(registry, link_payload)
    }

    /// Another port of the same target (its registry, so its sessions and its checks), as
    /// a second UDP listener is.
    pub fn sibling(&self) -> io::Result<DatagramPort> {
        Self::serving(self.registry.clone(), self.link_payload)
    }

    fn serving(registry: Arc<Registry>, link_payload: u32) -> io::Result<DatagramPort> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        socket.set_nonblocking(true)?;
        let setup = PortSetup {
            fd: OwnedFd::from(socket),
            kind: PortKind::Udp,
            link_payload,
            rcvbuf: 1 << 20,
            send_fd: None,
            ring: None,
            claim: None,
        };
        Ok(DatagramPort {
            port: DgramPort::new(setup, 0, registry.clone()),
            registry,
            link_payload,
            pushed: 0,
        })
    }

    /// Handles one datagram from `from`, then sends what it answered (to `from`, on loopback).
    pub fn receive(&mut self, datagram: &[u8], from: SocketAddr) {
        let mut ring = Entries(&mut self.pushed);
        self.port
            .receive_datagram(datagram, Peer::Ip(from), &mut ring, &|_, _, _| 0);
        self.port.sweep();
    }

    /// io_uring entries pushed so far: 0 for RAM exports, whose I/O completes inline.
    pub fn entries_pushed(&self) -> usize {
        self.pushed
    }
}
