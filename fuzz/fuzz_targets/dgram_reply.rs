//! An initiator's datagram queue (crates/client/src/dgram) fed forged replies: a queue over UDP
//! on loopback (`blkwire_client::fuzzing::udp_queue`) with five requests in flight (READs of
//! 512 bytes, 12 KiB and 64 KiB, the last two in several fragments, a 12 KiB WRITE and a
//! FLUSH), and the input as a series of frames sent to it from its target's own address, which
//! is what anyone on the path can forge. The harness gives each frame a valid CRC (unless the
//! input asks for a broken one), the REPLY flag and the session's id (or the input's); a frame
//! can take the opcode, tag, offset and length of one of the requests in flight, so that
//! fragments of real answers reach reassembly; everything else is the fuzzer's.
//!
//! No panic on any input; each request completes at most once; a READ that completes OK
//! hands back exactly the bytes it asked for, and nothing else hands back data.

#![no_main]

use std::net::UdpSocket;
use std::time::Duration;

use blkwire_client::fuzzing::udp_queue;
use blkwire_client::{Cmd, Completion};
use blkwire_wire::datagram;
use blkwire_wire::{Flags, Header, Opcode, Tag};
use libfuzzer_sys::fuzz_target;

#[path = "dgram_common.rs"]
mod dgram_common;
use dgram_common::{next_step, push_frame};

const SESSION: u32 = 7;
const FRAME_PAYLOAD: u32 = 8192;

/// What the queue sent the target: the first frame of each request, and where it came from.
/// With `wait`, waits (up to 5 s) for the first datagram: on loopback it is usually there when
/// `send` returns, but a busy machine may leave its delivery to a softirq thread.
fn requests(target: &UdpSocket, out: &mut Vec<Header>, wait: bool) -> Option<std::net::SocketAddr> {
    let mut buf = vec![0u8; 65536];
    let mut from = None;
    if wait {
        target.set_nonblocking(false).expect("blocking");
        target
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
    }
    while let Ok((n, a)) = target.recv_from(&mut buf) {
        target.set_nonblocking(true).expect("non-blocking");
        from = Some(a);
        for f in datagram::frames(&buf[..n], FRAME_PAYLOAD).flatten() {
            let h = f.header;
            if h.frag_index == 0 && !out.iter().any(|o| o.tag == h.tag) {
                out.push(h);
            }
        }
    }
    target.set_nonblocking(true).expect("non-blocking");
    from
}

fuzz_target!(|data: &[u8]| {
    let target = UdpSocket::bind("127.0.0.1:0").expect("target socket");
    target.set_nonblocking(true).expect("non-blocking");
    let addr = target.local_addr().expect("bound");
    let mut q = udp_queue(
        addr,
        SESSION,
        8,
        64 << 10,
        FRAME_PAYLOAD,
        // Both CRC modes (§9.7), chosen by the input's length so the seeds keep their meaning.
        data.len() % 2 == 1,
        Duration::from_secs(30),
    )
    .expect("queue");
    let wdata = vec![0x5a; 12 << 10];
    // user -> bytes a READ asked for (None: not a READ)
    let asked: [(u64, Option<usize>); 5] = [
        (1, Some(512)),
        (2, Some(12 << 10)),
        (3, Some(64 << 10)),
        (4, None),
        (5, None),
    ];
    let cmds = [
        Cmd::Read {
            offset: 0,
            len: 512,
        },
        Cmd::Read {
            offset: 4096,
            len: 12 << 10,
        },
        Cmd::Read {
            offset: 1 << 20,
            len: 64 << 10,
        },
        Cmd::Write {
            offset: 8192,
            data: &wdata,
            fua: false,
        },
        Cmd::Flush,
    ];
    for (cmd, (user, _)) in cmds.into_iter().zip(asked) {
        q.submit(cmd, user).expect("submit");
    }
    q.send().expect("send");
    let mut reqs = Vec::new();
    let Some(initiator) = requests(&target, &mut reqs, true) else {
        panic!("the queue sent nothing");
    };
    let mut done = [false; 6];
    let mut check = |c: Completion<'_>| {
        let i = c.user as usize;
        assert!((1..=5).contains(&i), "a completion for user {}", c.user);
        assert!(!done[i], "user {} completed twice", c.user);
        done[i] = true;
        match asked[i - 1].1 {
            Some(len) if c.status == blkwire_wire::Status::Ok => {
                assert_eq!(c.data.len(), len, "READ {i} handed back the wrong length")
            }
            _ => assert!(c.data.is_empty(), "user {i} handed back data"),
        }
    };

    // A step: control byte, header fields (31 bytes), payload length (2), payload. The rarer
    // cases take two bits of the control byte each, so that most steps are frames the queue
    // acts on:
    //   ctl >= 0xf0:         a raw datagram: the payload as it is, no header
    //   ctl & 0x01:          the opcode, tag, offset and length of request k in flight (k: the
    //                        first field byte) instead of the input's
    //   ctl & 0x0c == 0x0c:  the input's session id instead of the real one
    //   ctl & 0x30 == 0x30:  a broken CRC
    //   ctl & 0x40:          the next step's frame goes into the same datagram
    let mut rest = data;
    let mut pending: Vec<u8> = Vec::new();
    while let Some((ctl, f, payload)) = next_step(&mut rest, 31, FRAME_PAYLOAD as usize + 64) {
        let u16_at = |i: usize| u16::from_le_bytes([f[i], f[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([f[i], f[i + 1], f[i + 2], f[i + 3]]);
        if ctl >= 0xf0 {
            if !pending.is_empty() {
                let _ = target.send_to(&pending, initiator);
                pending.clear();
            }
            let _ = target.send_to(payload, initiator);
        } else {
            let offset = u64::from(u32_at(18)) | u64::from(f[22]) << 56;
            let mut h = Header::request(Opcode::Read, Tag(u32_at(10)), offset, u32_at(14));
            h.flags = Flags(u16_at(1) | Flags::REPLY | Flags::CRC);
            h.queue = u16::from(f[5] & 1);
            h.frag_index = u16::from(f[6]);
            h.frag_count = u16::from(f[7]);
            h.credit = u16_at(8);
            h.frag_offset = u32_at(23);
            h.session = if ctl & 0x0c == 0x0c {
                u32_at(27)
            } else {
                SESSION
            };
            let mut opcode = f[0];
            if ctl & 1 != 0 && !reqs.is_empty() {
                let r = &reqs[f[0] as usize % reqs.len()];
                opcode = r.opcode as u8;
                (h.tag, h.length, h.offset) = (r.tag, r.length, r.offset);
            }
            push_frame(&mut pending, h, payload, ctl & 0x30 == 0x30, |b| {
                b[3] = opcode;
                b[6..8].copy_from_slice(&u16_at(3).to_le_bytes()); // the status
            });
            if ctl & 0x40 == 0 || pending.len() > FRAME_PAYLOAD as usize {
                let _ = target.send_to(&pending, initiator);
                pending.clear();
            }
        }
        // A forged reply may end the session (ACCESS): then the queue says so, and the run ends.
        if q.poll(&mut check).is_err() {
            return;
        }
        requests(&target, &mut reqs, false);
    }
    if !pending.is_empty() {
        let _ = target.send_to(&pending, initiator);
        let _ = q.poll(&mut check);
    }
});
