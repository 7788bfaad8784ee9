//! A raw speaker of the native protocol over TCP (std TcpStream), for tests that send what no
//! real initiator would: hand-built frames, lies about lengths, half frames.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use blkwire_wire::{AuthBlock, AuthMethod, Header, Hello, Opcode, Status, Tag, HEADER_LEN};

use super::Target;

/// A plain TCP connection to `t`'s native listener, reads bounded by 10 s.
pub fn raw(t: &Target) -> TcpStream {
    let addr = t.base.trim_start_matches("tcp://");
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Sends a HELLO for `export` (2 queues, depth 4, 64 KiB I/O) and returns the reply frame.
pub fn hello(s: &mut TcpStream, export: &str) -> (Header, Vec<u8>) {
    hello_with(s, export, 4, 65536)
}

/// Sends a HELLO for `export` asking for `depth` slots and `max_io` bytes per I/O.
pub fn hello_with(s: &mut TcpStream, export: &str, depth: u16, max_io: u32) -> (Header, Vec<u8>) {
    hello_as(s, "hostile", export, depth, max_io)
}

/// Sends a HELLO from host id `host` for `export` (2 queues of `depth` slots, `max_io` bytes).
pub fn hello_as(
    s: &mut TcpStream,
    host: &str,
    export: &str,
    depth: u16,
    max_io: u32,
) -> (Header, Vec<u8>) {
    let mut hello = Hello {
        queues: 2,
        depth,
        max_io,
        client_features: 0,
        frame_payload: 0,
        nonce: 1,
        host_id: host.into(),
        export: export.into(),
        auth: AuthBlock::first(AuthMethod::None, false, false, [7; 32]),
        replaces: None,
    };
    // The target challenges the first HELLO (PROTOCOL.md §12.1); the second answers it.
    let (r, p) = send_hello(s, &hello);
    if r.status != Status::Challenge {
        return (r, p);
    }
    hello.auth.nonce_s = p.try_into().expect("a 32-byte challenge");
    send_hello(s, &hello)
}

/// Sends one HELLO frame and returns the reply.
pub fn send_hello(s: &mut TcpStream, hello: &Hello) -> (Header, Vec<u8>) {
    let p = hello.encode().unwrap();
    let mut h = Header::request(Opcode::Hello, Tag::new(0, 0), 0, 0);
    h.payload_len = p.len() as u32;
    s.write_all(&h.to_bytes()).unwrap();
    s.write_all(&p).unwrap();
    read_frame(s).expect("hello reply")
}

/// Sends one HELLO datagram (its CRC set) from `sock` to `to` and returns its size, the answer's
/// header and the answer's payload.
pub fn send_hello_udp(
    sock: &std::net::UdpSocket,
    to: &str,
    hello: &Hello,
) -> (usize, Header, Vec<u8>) {
    let p = hello.encode().unwrap();
    let mut h = Header::request(Opcode::Hello, Tag::new(0, 0), 0, 0);
    h.payload_len = p.len() as u32;
    h.seal_crc(&p);
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(&p);
    sock.send_to(&f, to).unwrap();
    let mut buf = [0u8; 2048];
    let n = sock.recv(&mut buf).expect("an answer");
    let r = Header::decode(&buf, 4096).unwrap();
    (f.len(), r, buf[blkwire_wire::HEADER_LEN..n].to_vec())
}

/// A JOIN of `queue` to `session` with `cookie`, without a proof or a challenge answer (an
/// unauthenticated session's): the header, its payload length set, and the payload.
pub fn join_request(session: u32, queue: u16, cookie: u64) -> (Header, Vec<u8>) {
    let j = blkwire_wire::Join {
        cookie,
        proof: [0; 32],
        nonce_s: [0; 32],
    }
    .encode();
    let mut h = Header::request(Opcode::Join, Tag::new(0, 0), 0, 0);
    h.session = session;
    h.queue = queue;
    h.payload_len = j.len() as u32;
    (h, j.to_vec())
}

/// A stand-in target on loopback for tests of what the initiator makes of a hostile one: it
/// answers the first request frame of its one connection (a HELLO, unchallenged) with
/// `answer(request)`, a reply header and payload. Returns its `tcp://HOST:PORT`.
pub fn answering_target(
    answer: impl FnOnce(&Header) -> (Header, Vec<u8>) + Send + 'static,
) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let Some((h, _)) = read_frame(&mut s) else {
            return;
        };
        let (mut r, p) = answer(&h);
        r.payload_len = p.len() as u32;
        let _ = s.write_all(&r.to_bytes());
        let _ = s.write_all(&p);
        // Held until the initiator hangs up.
        let _ = std::io::copy(&mut s, &mut std::io::sink());
    });
    format!("tcp://{addr}")
}

/// The next frame, or `None` once the connection is closed (or the header is malformed).
pub fn read_frame(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let h = Header::decode(&hb, 64 << 20).ok()?;
    let mut p = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut p).ok()?;
    Some((h, p))
}

/// The connection is closed by the target (EOF or reset), not left hanging.
pub fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(_) => continue, // replies sent before the violation
        }
    }
}
