//! Hostile peers for `bench/hostile-load.sh` (issue 13): every kind of load a target must survive
//! with bounded memory, run at once against one target for a while, then closed.
//!
//! ```text
//! hostile_load TCP_ADDR NBD_ADDR UDP_ADDR EXPORT SECONDS
//! ```
//!
//! - 16 clients that never read, each with 64 READs of 1 MiB in flight;
//! - 4 slow readers (64 KiB every 10 ms) keeping 32 READs of 1 MiB in flight;
//! - 12 NBD connections each sending a WRITE that announces 32 MiB, then payload for as long as
//!   the target takes it, never all of it;
//! - 2 NBD connections with 16 READs of 32 MiB each, never read;
//! - a UDP session flooded with READs of 1 MiB on every slot, replies never read (from
//!   127.0.0.3);
//! - a UDP HELLO flood answering the target's challenges (a new nonce each time, so each would
//!   be a session; from 127.0.0.2);
//! - 2000 connections trickling one byte every 5 s, from 127.0.0.2 to 127.0.0.9 (so the
//!   per-host limit of the legitimate client's 127.0.0.1 is not theirs).
//!
//! It prints what each group achieved (how many connections the target took, how many were
//! refused or cut) when done.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkwire_wire::nbd;
use blkwire_wire::{
    AuthBlock, AuthMethod, Header, Hello, HelloReply, Opcode, Status, Tag, HEADER_LEN,
};

type Counter = Arc<AtomicU64>;

fn hello(depth: u16, max_io: u32, frame_payload: u32, nonce: u64, export: &str) -> Hello {
    Hello {
        queues: 1,
        depth,
        max_io,
        client_features: 0,
        frame_payload,
        nonce,
        host_id: "hostile-load".into(),
        export: export.into(),
        // Datagram HELLOs carry a frame payload, TCP ones 0 (as the client's).
        auth: AuthBlock::first(
            AuthMethod::None,
            false,
            frame_payload != 0,
            (nonce as u32)
                .to_le_bytes()
                .repeat(8)
                .try_into()
                .expect("32 bytes"),
        ),
        replaces: None,
    }
}

fn hello_frame(h: &Hello, tag: Tag) -> (Header, Vec<u8>) {
    let p = h.encode().expect("a HELLO payload");
    let mut hdr = Header::request(Opcode::Hello, tag, 0, 0);
    hdr.payload_len = p.len() as u32;
    (hdr, p)
}

/// One HELLO on TCP and its reply (header, payload).
fn tcp_hello(s: &mut TcpStream, h: &Hello) -> Option<(Header, Vec<u8>)> {
    let (hdr, p) = hello_frame(h, Tag::new(0, 0));
    s.write_all(&hdr.to_bytes()).ok()?;
    s.write_all(&p).ok()?;
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let r = Header::decode(&hb, 4096).ok()?;
    let mut p = vec![0u8; r.payload_len as usize];
    s.read_exact(&mut p).ok()?;
    Some((r, p))
}

/// A native session on TCP: (stream, granted depth), or None if refused. The first HELLO is
/// challenged (PROTOCOL.md §12.1); the second answers the challenge.
fn native(addr: &str, export: &str, depth: u16) -> Option<(TcpStream, u16)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut h = hello(depth, 1 << 20, 0, 1, export);
    let (mut r, mut p) = tcp_hello(&mut s, &h)?;
    if r.status == Status::Challenge {
        h.auth.nonce_s = p.try_into().ok()?;
        (r, p) = tcp_hello(&mut s, &h)?;
    }
    if r.status != Status::Ok {
        return None;
    }
    Some((s, HelloReply::decode(&p).ok()?.depth))
}

fn reads(slots: u16, gen: u16, len: u32) -> Vec<u8> {
    let mut all = Vec::new();
    for slot in 0..slots {
        let off = (slot as u64 % 64) * len as u64;
        all.extend_from_slice(
            &Header::request(Opcode::Read, Tag::new(slot, gen), off, len).to_bytes(),
        );
    }
    all
}

/// An NBD connection in transmission (fixed newstyle, OPT_GO), or None.
fn nbd_go(addr: &str, export: &str) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut g = [0u8; 18];
    s.read_exact(&mut g).ok()?;
    let flags = (nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES) as u32;
    s.write_all(&flags.to_be_bytes()).ok()?;
    let mut data = (export.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    let mut o = nbd::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&nbd::opt::GO.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(&data);
    s.write_all(&o).ok()?;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).ok()?;
        let typ = u32::from_be_bytes(h[12..16].try_into().ok()?);
        let len = u32::from_be_bytes(h[16..20].try_into().ok()?) as usize;
        let mut d = vec![0u8; len.min(1 << 20)];
        s.read_exact(&mut d).ok()?;
        match typ {
            nbd::rep::ACK => return Some(s),
            nbd::rep::INFO => continue,
            _ => return None,
        }
    }
}

fn nbd_request(typ: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    nbd::Request {
        flags: 0,
        typ,
        cookie,
        offset,
        length,
    }
    .encode()
    .to_vec()
}

/// A TCP connection from `ip` (bound before connecting).
fn connect_from(ip: std::net::Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let (local, remote) = (sin(ip, 0), sin(*to.ip(), to.port()));
    let len = std::mem::size_of::<libc::sockaddr_in>() as u32;
    // SAFETY: a new socket, owned by the TcpStream at once; the addresses outlive the calls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// Sends one sealed datagram frame.
fn send_frame(u: &UdpSocket, mut h: Header, payload: &[u8]) {
    h.payload_len = payload.len() as u32;
    h.seal_crc(payload);
    let mut b = h.to_bytes().to_vec();
    b.extend_from_slice(payload);
    let _ = u.send(&b);
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
        eprintln!("usage: hostile_load TCP_ADDR NBD_ADDR UDP_ADDR EXPORT SECONDS");
        std::process::exit(2);
    }
    let (tcp, nbd_addr, udp, export) = (a[1].clone(), a[2].clone(), a[3].clone(), a[4].clone());
    let seconds: u64 = a[5].parse().expect("SECONDS");
    let until = Instant::now() + Duration::from_secs(seconds);
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    let mut report: Vec<(&str, Counter, Counter)> = Vec::new();
    let mut group = |name: &'static str| {
        let (ok, no) = (Counter::default(), Counter::default());
        report.push((name, ok.clone(), no.clone()));
        (ok, no)
    };

    // Clients that never read.
    let (ok, no) = group("never-reading clients (64 x READ 1M each)");
    let mut held = Vec::new();
    for _ in 0..16 {
        match native(&tcp, &export, 64) {
            Some((mut s, depth)) => {
                let _ = s.write_all(&reads(depth.min(64), 1, 1 << 20));
                held.push(s);
                ok.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                no.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    // Slow readers.
    let (ok, no) = group("slow readers (32 x READ 1M, 6 MB/s)");
    for _ in 0..4 {
        let (tcp, export, stop, ok, no) = (
            tcp.clone(),
            export.clone(),
            stop.clone(),
            ok.clone(),
            no.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let Some((mut s, depth)) = native(&tcp, &export, 32) else {
                no.fetch_add(1, Ordering::Relaxed);
                return;
            };
            ok.fetch_add(1, Ordering::Relaxed);
            let depth = depth.min(32);
            if s.write_all(&reads(depth, 0, 1 << 20)).is_err() {
                return;
            }
            let mut piece = vec![0u8; 64 << 10];
            let mut hb = [0u8; HEADER_LEN];
            while !stop.load(Ordering::Relaxed) {
                if s.read_exact(&mut hb).is_err() {
                    return;
                }
                let Ok(h) = Header::decode(&hb, 1 << 20) else {
                    return;
                };
                let mut left = h.payload_len as usize;
                while left > 0 && !stop.load(Ordering::Relaxed) {
                    let n = left.min(piece.len());
                    if s.read_exact(&mut piece[..n]).is_err() {
                        return;
                    }
                    left -= n;
                    std::thread::sleep(Duration::from_millis(10));
                }
                let again = Header::request(
                    Opcode::Read,
                    Tag::new(h.tag.slot(), h.tag.generation().wrapping_add(1)),
                    h.offset,
                    1 << 20,
                );
                if s.write_all(&again.to_bytes()).is_err() {
                    return;
                }
            }
        }));
    }

    // NBD WRITEs announcing 32 MiB, payload for as long as the target takes it.
    let (ok, no) = group("NBD WRITE 32M, payload never complete");
    for cookie in 0..12u64 {
        let (nbd_addr, export, stop, ok, no) = (
            nbd_addr.clone(),
            export.clone(),
            stop.clone(),
            ok.clone(),
            no.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let Some(mut s) = nbd_go(&nbd_addr, &export) else {
                no.fetch_add(1, Ordering::Relaxed);
                return;
            };
            ok.fetch_add(1, Ordering::Relaxed);
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
            if s.write_all(&nbd_request(nbd::cmd::WRITE, cookie, 0, 32 << 20))
                .is_err()
            {
                return;
            }
            let piece = vec![0x5au8; 1 << 20];
            let mut sent = 0usize;
            while !stop.load(Ordering::Relaxed) && sent < (31 << 20) {
                match s.write(&piece[..piece.len().min((31 << 20) - sent)]) {
                    Ok(n) => sent += n,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            || e.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => return,
                }
            }
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }

    // NBD READs of 32 MiB, never read.
    let (ok, no) = group("NBD READ 32M x 16, never read");
    for _ in 0..2 {
        match nbd_go(&nbd_addr, &export) {
            Some(mut s) => {
                let mut all = Vec::new();
                for cookie in 0..16u64 {
                    all.extend_from_slice(&nbd_request(nbd::cmd::READ, cookie, 0, 32 << 20));
                }
                let _ = s.write_all(&all);
                held.push(s);
                ok.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                no.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    // UDP: a session flooded with READs of 1 MiB on every slot; a HELLO flood.
    let (ok, no) = group("UDP READ 1M floods (datagrams sent)");
    {
        let (udp, export, stop, ok, no) = (
            udp.clone(),
            export.clone(),
            stop.clone(),
            ok.clone(),
            no.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let u = UdpSocket::bind("127.0.0.3:0").expect("a UDP socket");
            u.connect(&udp).expect("the target's UDP address");
            u.set_read_timeout(Some(Duration::from_secs(2))).ok();
            let mut h = hello(256, 1 << 20, 8192, 7, &export);
            let mut b = vec![0u8; 65536];
            // The first HELLO is challenged; datagrams get lost under load: each step is
            // tried a few times.
            let mut granted = None;
            for _ in 0..10 {
                let (hdr, p) = hello_frame(&h, Tag::new(0, 0));
                send_frame(&u, hdr, &p);
                let Ok(n) = u.recv(&mut b) else { continue };
                let Ok(r) = Header::decode(&b[..n], 65536) else {
                    continue;
                };
                let p = &b[HEADER_LEN..(HEADER_LEN + r.payload_len as usize).min(n)];
                match r.status {
                    Status::Challenge => {
                        if let Ok(nonce) = p.try_into() {
                            h.auth.nonce_s = nonce;
                        }
                    }
                    Status::Ok => {
                        granted = HelloReply::decode(p).ok();
                        break;
                    }
                    _ => break,
                }
            }
            let Some(g) = granted else {
                no.fetch_add(1, Ordering::Relaxed);
                return;
            };
            let mut gen = 0u16;
            while !stop.load(Ordering::Relaxed) {
                gen = gen.wrapping_add(1);
                for slot in 0..g.depth {
                    let mut h = Header::request(
                        Opcode::Read,
                        Tag::new(slot, gen),
                        (slot as u64 % 64) * g.max_io as u64,
                        g.max_io,
                    );
                    h.session = g.session;
                    send_frame(&u, h, &[]);
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    let (ok, no) = group("UDP HELLO flood (HELLOs sent)");
    {
        let (udp, export, stop, ok) = (udp.clone(), export.clone(), stop.clone(), ok.clone());
        let _ = no;
        threads.push(std::thread::spawn(move || {
            let u = UdpSocket::bind("127.0.0.2:0").expect("a UDP socket");
            u.connect(&udp).expect("the target's UDP address");
            u.set_nonblocking(true).ok();
            // Each HELLO is challenged, and the flood answers every challenge it gets (it can:
            // the replies come to its own address), so each one would be a session.
            let mut sent: std::collections::HashMap<u32, Hello> = Default::default();
            let mut b = vec![0u8; 65536];
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..200 {
                    i += 1;
                    let h = hello(64, 1 << 20, 8192, 1000 + i as u64, &export);
                    let (hdr, p) = hello_frame(&h, Tag::new(i as u16, (i >> 16) as u16));
                    send_frame(&u, hdr, &p);
                    sent.insert(i, h);
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                while let Ok(n) = u.recv(&mut b) {
                    let Ok(r) = Header::decode(&b[..n], 65536) else {
                        continue;
                    };
                    let key = r.tag.slot() as u32 | (r.tag.generation() as u32) << 16;
                    let p = &b[HEADER_LEN..(HEADER_LEN + r.payload_len as usize).min(n)];
                    if let (Status::Challenge, Some(mut h)) = (r.status, sent.remove(&key)) {
                        if let Ok(nonce) = p.try_into() {
                            h.auth.nonce_s = nonce;
                            let (hdr, p) = hello_frame(&h, r.tag);
                            send_frame(&u, hdr, &p);
                        }
                    }
                }
                if sent.len() > 100_000 {
                    sent.clear();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }

    // 2000 connections trickling a HELLO header one byte every 5 s.
    let (ok, no) = group("trickling connections (opened / cut or refused)");
    {
        let (tcp, stop, ok, no) = (tcp.clone(), stop.clone(), ok.clone(), no.clone());
        threads.push(std::thread::spawn(move || {
            let to: SocketAddr = tcp.parse().expect("TCP_ADDR");
            let hdr = Header::request(Opcode::Hello, Tag::new(0, 0), 0, 0).to_bytes();
            let mut conns: Vec<(TcpStream, usize)> = Vec::new();
            let mut next_byte = Instant::now();
            let mut opened = 0usize;
            while !stop.load(Ordering::Relaxed) {
                while opened < 2000 && conns.len() < 2000 {
                    let ip = std::net::Ipv4Addr::new(127, 0, 0, 2 + (opened % 8) as u8);
                    opened += 1;
                    match connect_from(ip, to) {
                        Ok(s) => {
                            let _ = s.set_nonblocking(true);
                            conns.push((s, 0));
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            no.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                if Instant::now() >= next_byte {
                    next_byte = Instant::now() + Duration::from_secs(5);
                    conns.retain_mut(|(s, i)| {
                        let gone = match s.write(&hdr[*i % HEADER_LEN..*i % HEADER_LEN + 1]) {
                            Ok(_) => {
                                *i += 1;
                                let mut b = [0u8; 64];
                                matches!(s.read(&mut b), Ok(0))
                            }
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        };
                        if gone {
                            no.fetch_add(1, Ordering::Relaxed);
                        }
                        !gone
                    });
                    // Cut ones are replaced, so the flood stays at 2000 attempts.
                    opened = opened.min(conns.len());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }

    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for s in &held {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    for (name, ok, no) in report {
        println!(
            "  {name:<50} {:>8} ok {:>8} refused/cut",
            ok.load(Ordering::Relaxed),
            no.load(Ordering::Relaxed)
        );
    }
}
