//! An initiator's NVMe/TCP connect (crates/client/src/nvme.rs: `connect`, through
//! `blkwire_client::connect` on an `nvme-tcp://` URL) against a hostile controller on
//! loopback: the answers to ICReq, Fabrics Connect, the property get/set of CC, CSTS and CAP,
//! Identify controller and namespace and Set Features (number of queues) on the admin queue,
//! then ICReq and Connect on each I/O queue, are what the input says.
//!
//! Byte 0 sets up the host:
//!   bits 0-1:  queues asked: 1, 2, 3, 4
//!   bits 2-3:  depth asked: 1, 4, 32, 1023
//!   bits 4-5:  max I/O asked: 4 KiB, 64 KiB, 1 MiB, 2 MiB
//!
//! The rest is one piece per connection, in the order the host makes them (the admin queue
//! first): a 16-bit little-endian length, then that many bytes, which the controller sends
//! at once and ends with FIN (a short last piece is all there is; a connection with no piece
//! gets FIN alone). The host's own PDUs are read by no one; its commands' CIDs count from 1
//! per connection, so a stream written ahead of them can answer them.
//!
//! No panic on any input, every failure an `Err`, and a session that opens is what the
//! host asked for at most and consistent: one TCP connection per I/O queue granted beside
//! the admin queue, 1..=queues asked, depth 1..=asked, max I/O within what was asked, a
//! power-of-two block of 512 B..64 KiB, a size of whole blocks, a zeroing range of whole
//! blocks within `MAX_RANGE`.

#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use blkwire_client::{ConnectOptions, Url};
use libfuzzer_sys::fuzz_target;

/// Set before the harness wakes the controller thread with a connection of its own: that
/// connection ends the run.
static DONE: AtomicBool = AtomicBool::new(false);

fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("listener"))
}

/// The controller: each connection gets its piece and FIN; all are held open until the run
/// ends (closing one with the host's PDUs unread would reset it, and the host might lose the
/// answers before reading them). Returns how many connections the host made.
fn controller(pieces: Vec<Vec<u8>>) -> usize {
    let mut held = Vec::new();
    loop {
        let (mut s, _) = listener().accept().expect("accept");
        if DONE.load(Ordering::SeqCst) {
            return held.len();
        }
        if let Some(p) = pieces.get(held.len()) {
            let _ = s.write_all(p);
        }
        let _ = s.shutdown(Shutdown::Write);
        held.push(s);
    }
}

/// The pieces of the input after byte 0.
fn pieces(mut b: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while b.len() >= 2 {
        let n = (u16::from_le_bytes([b[0], b[1]]) as usize).min(b.len() - 2);
        out.push(b[2..2 + n].to_vec());
        b = &b[2 + n..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&setup, rest)) = data.split_first() else {
        return;
    };
    let queues = 1 + (setup & 3) as u16;
    let depth = [1u16, 4, 32, 1023][(setup >> 2 & 3) as usize];
    let max_io = [4u32 << 10, 64 << 10, 1 << 20, 2 << 20][(setup >> 4 & 3) as usize];
    let port = listener().local_addr().expect("its address").port();
    DONE.store(false, Ordering::SeqCst);
    let pieces = pieces(rest);
    let ctrl = std::thread::spawn(move || controller(pieces));

    let url = Url::parse(&format!("nvme-tcp://127.0.0.1:{port}/fuzz")).expect("a URL");
    let opts = ConnectOptions {
        queues,
        depth,
        max_io,
        // Never needed: every connection ends with the controller's FIN.
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let result = blkwire_client::connect(&url, &opts);

    DONE.store(true, Ordering::SeqCst);
    let _stop = TcpStream::connect(("127.0.0.1", port)).expect("end the run");
    let connections = ctrl.join().expect("the controller thread");

    let Ok(s) = result else {
        return;
    };
    let i = &s.info;
    assert_eq!(
        s.queues.len(),
        i.queues as usize,
        "a queue per queue granted"
    );
    assert!(
        (1..=queues).contains(&i.queues),
        "{} queues of {queues}",
        i.queues
    );
    assert_eq!(
        connections,
        1 + i.queues as usize,
        "admin and I/O connections"
    );
    assert!(
        (1..=depth).contains(&i.depth),
        "depth {} of {depth}",
        i.depth
    );
    assert!(i.max_io <= max_io.min(1 << 20), "max I/O {}", i.max_io);
    assert!(i.logical_block.is_power_of_two() && (512..=65536).contains(&i.logical_block));
    assert_eq!(i.size % u64::from(i.logical_block), 0, "whole blocks");
    assert!(i.max_range > 0 && i.max_range <= blkwire_client::MAX_RANGE);
    assert_eq!(
        i.max_range % i.logical_block,
        0,
        "a zeroing range of whole blocks"
    );
});
