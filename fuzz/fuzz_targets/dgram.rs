//! The target's datagram port (crates/server/src/dgram.rs), in process over UDP on loopback
//! (`blkwire_server::fuzzing::DatagramPort`): what any host that reaches a udp:// or eth://
//! listener can send it. Each run first opens a session as an initiator does (HELLO, the
//! address challenge, HELLO again) from one of two peer sockets; then the input is a series of
//! frames, each from either peer, which the harness gives a valid CRC (else the port would drop
//! them at the first check) unless the input asks for a broken one, and the session's id or one
//! of the input's. Every other header field and every payload is the fuzzer's: fragments of
//! writes and reads out of order, duplicates and stale generations, control requests (HELLOs,
//! LISTs, JOINs, which without the session's cookie reach only their refusals), several frames
//! packed in one datagram, or raw datagrams.
//!
//! No panic on any input; RAM exports complete inline, so the port never hands io_uring
//! anything; and every datagram the port sends back is a well-formed reply: frames with a valid
//! CRC, of one session and queue, each marked REPLY.

#![no_main]

use std::net::UdpSocket;
use std::time::Duration;

use blkwire_server::fuzzing::DatagramPort;
use blkwire_wire::datagram;
use blkwire_wire::{
    AuthBlock, AuthMethod, Flags, Header, Hello, HelloReply, Opcode, Status, Tag, HEADER_CRC,
};
use libfuzzer_sys::fuzz_target;

#[path = "dgram_common.rs"]
mod dgram_common;
use dgram_common::{next_step, push_frame};

/// Frame payload of the port's link (a jumbo frame's, as eth:// at MTU 9000).
const LINK_PAYLOAD: u32 = 8192;

/// Drains what the port sent `peer` and checks every datagram of it. With `wait`, waits (up to
/// 5 s) for the first: on loopback a datagram is usually there when `send` returns, but a busy
/// machine may leave its delivery to a softirq thread.
fn answers(peer: &UdpSocket, wait: bool) -> Vec<(Header, Vec<u8>)> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    if wait {
        peer.set_nonblocking(false).expect("blocking");
        peer.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
    }
    while let Ok(n) = peer.recv(&mut buf) {
        peer.set_nonblocking(true).expect("non-blocking");
        for f in datagram::frames(&buf[..n], LINK_PAYLOAD) {
            let f = f.unwrap_or_else(|e| panic!("the port sent a malformed frame: {e}"));
            assert!(
                f.header.is_reply(),
                "the port sent a request: {:?}",
                f.header
            );
            out.push((f.header, f.payload.to_vec()));
        }
    }
    peer.set_nonblocking(true).expect("non-blocking");
    out
}

/// Hands the frames waiting to be packed to the port, from peer `who`.
fn deliver(port: &mut DatagramPort, peers: &[UdpSocket; 2], pending: &mut Vec<u8>, who: usize) {
    if !pending.is_empty() {
        port.receive(pending, peers[who].local_addr().expect("bound"));
        pending.clear();
    }
}

fn sealed_frame(mut h: Header, payload: &[u8]) -> Vec<u8> {
    h.payload_len = payload.len() as u32;
    h.seal_crc(payload);
    let mut v = h.to_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

/// A session of one queue of 8 slots on export `a`, opened from `peer`, its data frames' CRCs
/// over their header only if `header_crc` (PROTOCOL.md §9.7): its id.
fn open_session(port: &mut DatagramPort, peer: &UdpSocket, header_crc: bool) -> u32 {
    let mut hello = Hello {
        queues: 1,
        depth: 8,
        max_io: 64 << 10,
        client_features: if header_crc { HEADER_CRC } else { 0 },
        frame_payload: LINK_PAYLOAD,
        nonce: 1,
        host_id: "fuzz".into(),
        export: "a".into(),
        auth: AuthBlock::first(AuthMethod::None, false, true, [7; 32]),
        replaces: None,
    };
    let from = peer.local_addr().expect("bound");
    for round in 1..=3 {
        let h = Header::request(Opcode::Hello, Tag::new(0, round), 0, 0);
        port.receive(
            &sealed_frame(h, &hello.encode().expect("valid HELLO")),
            from,
        );
        for (r, p) in answers(peer, true) {
            match r.status {
                Status::Challenge => {
                    hello.auth.nonce_s = p.as_slice().try_into().expect("a 32-byte challenge")
                }
                Status::Ok => return HelloReply::decode(&p).expect("a HELLO reply").session,
                other => panic!("HELLO refused: {other:?}"),
            }
        }
    }
    panic!("no session after three HELLOs");
}

fuzz_target!(|data: &[u8]| {
    let mut port = DatagramPort::new(&["a=mem:1M", "b=mem:64K"], LINK_PAYLOAD).expect("port");
    let peers = [
        UdpSocket::bind("127.0.0.1:0").expect("peer socket"),
        UdpSocket::bind("127.0.0.1:0").expect("peer socket"),
    ];
    for p in &peers {
        p.set_nonblocking(true).expect("non-blocking");
    }
    // Both CRC modes, chosen by the input's length so the seeds keep their meaning.
    let session = open_session(&mut port, &peers[0], data.len() % 2 == 1);

    // A step: control byte, header fields (27 bytes), payload length (2), payload. The rarer
    // cases take two bits of the control byte each, so that most steps are frames the port
    // acts on:
    //   ctl >= 0xf0:         a raw datagram: the payload as it is, no header
    //   ctl & 0x03 == 0x03:  from the second peer (no session of its own: a forged source)
    //   ctl & 0x0c == 0x0c:  the input's session id instead of the real one
    //   ctl & 0x30 == 0x30:  a broken CRC
    //   ctl & 0x40:          the next step's frame goes into the same datagram (if it comes
    //                        from the same peer)
    let mut rest = data;
    let mut pending: Vec<u8> = Vec::new();
    let mut pending_from = 0;
    while let Some((ctl, f, payload)) = next_step(&mut rest, 27, LINK_PAYLOAD as usize + 64) {
        let u16_at = |i: usize| u16::from_le_bytes([f[i], f[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([f[i], f[i + 1], f[i + 2], f[i + 3]]);
        let who = usize::from(ctl & 0x03 == 0x03);
        if ctl >= 0xf0 {
            deliver(&mut port, &peers, &mut pending, pending_from);
            port.receive(payload, peers[who].local_addr().expect("bound"));
        } else {
            if who != pending_from {
                deliver(&mut port, &peers, &mut pending, pending_from);
            }
            // offset: 32 bits, and a high byte that reaches past any export
            let offset = u64::from(u32_at(14)) | u64::from(f[18]) << 56;
            let mut h = Header::request(Opcode::Read, Tag(u32_at(6)), offset, u32_at(10));
            h.flags = Flags(u16_at(1) | Flags::CRC);
            h.queue = u16::from(f[3] & 3);
            h.frag_index = u16::from(f[4]);
            h.frag_count = u16::from(f[5]);
            h.frag_offset = u32_at(19);
            h.session = if ctl & 0x0c == 0x0c {
                u32_at(23)
            } else {
                session
            };
            push_frame(&mut pending, h, payload, ctl & 0x30 == 0x30, |b| {
                b[3] = f[0]; // the opcode
            });
            pending_from = who;
            if ctl & 0x40 == 0 || pending.len() > LINK_PAYLOAD as usize {
                deliver(&mut port, &peers, &mut pending, who);
            }
        }
        for p in &peers {
            answers(p, false);
        }
    }
    deliver(&mut port, &peers, &mut pending, pending_from);
    for p in &peers {
        answers(p, false);
    }
    assert_eq!(port.entries_pushed(), 0, "RAM exports complete inline");
});
