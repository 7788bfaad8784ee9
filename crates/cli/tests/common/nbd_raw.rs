//! A raw NBD speaker (std TcpStream) for tests that need the handshake and transmission
//! details a real client hides, or that send hostile input: option and request builders, reply
//! and chunk readers, and a check that the target closed the connection.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use blkwire_wire::nbd::{self, chunk, cmd, info, opt, rep};

/// Big-endian integers at the start of `b` (NBD is big-endian throughout).
pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// A u32-length-prefixed string, as option data carries names.
pub fn name_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d
}

/// NBD_OPT_INFO / GO data asking for `infos`.
pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = name_data(name);
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// NBD_OPT_LIST/SET_META_CONTEXT data: the export and the context queries.
pub fn meta_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = name_data(export);
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&name_data(q));
    }
    d
}

/// One structured reply chunk, payload included.
#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub typ: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

impl Chunk {
    pub fn is_error(&self) -> bool {
        self.typ & 0x8000 != 0
    }
    pub fn error(&self) -> u32 {
        assert!(self.is_error(), "not an error chunk: {self:?}");
        be32(&self.payload)
    }
}

/// A reply of either kind (read data is not part of it: see `read_simple`).
#[derive(Debug)]
pub enum Reply {
    Simple { error: u32, cookie: u64 },
    Structured(Vec<Chunk>),
}

impl Reply {
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Structured(c) => c.iter().find(|c| c.is_error()).map_or(0, Chunk::error),
        }
    }
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } => *cookie,
            Reply::Structured(c) => c[0].cookie,
        }
    }
}

/// One connection to a target's NBD listener, driven byte by byte.
pub struct Raw(pub TcpStream);

impl Raw {
    /// Connects and reads the server's greeting, without answering it.
    pub fn greet(addr: &str) -> Raw {
        let s = TcpStream::connect(addr).expect("connect to the NBD listener");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        let mut r = Raw(s);
        let g = r.read_n(18);
        assert_eq!(be64(&g[0..]), nbd::NBDMAGIC, "greeting magic");
        assert_eq!(be64(&g[8..]), nbd::IHAVEOPT, "fixed newstyle greeting");
        assert_eq!(
            be16(&g[16..]),
            nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES,
            "handshake flags"
        );
        r
    }

    /// Greeting answered with FIXED_NEWSTYLE | NO_ZEROES: ready for options.
    pub fn open(addr: &str) -> Raw {
        let mut r = Raw::greet(addr);
        r.send(&((nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES) as u32).to_be_bytes());
        r
    }

    /// Negotiates (optionally structured replies and base:allocation) and enters transmission
    /// with NBD_OPT_GO. Returns (size, transmission flags).
    pub fn go(addr: &str, export: &str, structured: bool, allocation: bool) -> (Raw, u64, u16) {
        let mut r = Raw::open(addr);
        if structured {
            r.option(opt::STRUCTURED_REPLY, &[]);
            assert_eq!(r.opt_reply().1, rep::ACK, "STRUCTURED_REPLY acked");
        }
        if allocation {
            r.option(
                opt::SET_META_CONTEXT,
                &meta_data(export, &[nbd::BASE_ALLOCATION]),
            );
            let (_, t, d) = r.opt_reply();
            assert_eq!(t, rep::META_CONTEXT, "base:allocation selected");
            assert_eq!(&d[4..], nbd::BASE_ALLOCATION.as_bytes());
            assert_eq!(r.opt_reply().1, rep::ACK);
        }
        r.option(opt::GO, &info_data(export, &[]));
        let (mut size, mut flags) = (None, 0);
        loop {
            let (o, t, d) = r.opt_reply();
            assert_eq!(o, opt::GO, "reply is for GO");
            match t {
                rep::INFO if be16(&d) == info::EXPORT => {
                    size = Some(be64(&d[2..]));
                    flags = be16(&d[10..]);
                }
                rep::INFO => {}
                rep::ACK => break,
                t => panic!(
                    "GO {export}: unexpected reply {t:#x}: {:?}",
                    String::from_utf8_lossy(&d)
                ),
            }
        }
        (r, size.expect("NBD_INFO_EXPORT sent before ACK"), flags)
    }

    /// NBD_OPT_GO of `export` on a connection already negotiating (what it negotiated kept):
    /// its INFO replies taken, up to the ACK; any other reply fails the test.
    pub fn go_on(&mut self, export: &str) {
        self.option(opt::GO, &info_data(export, &[]));
        loop {
            match self.opt_reply() {
                (_, rep::ACK, _) => break,
                (_, rep::INFO, _) => {}
                (_, t, d) => panic!("GO {export}: reply {t:#x}: {}", String::from_utf8_lossy(&d)),
            }
        }
    }

    pub fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).expect("send to target");
    }

    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.0
            .read_exact(&mut v)
            .unwrap_or_else(|e| panic!("reading {n} bytes from the target: {e}"));
        v
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut b = nbd::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// (option, reply type, data)
    pub fn opt_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.read_n(20);
        assert_eq!(be64(&h), nbd::OPT_REPLY_MAGIC, "option reply magic");
        let len = be32(&h[16..]) as usize;
        assert!(len < 1 << 20, "option reply of {len} bytes");
        let d = self.read_n(len);
        (be32(&h[8..]), be32(&h[12..]), d)
    }

    pub fn request(&mut self, typ: u16, flags: u16, cookie: u64, offset: u64, length: u32) {
        let r = nbd::Request {
            flags,
            typ,
            cookie,
            offset,
            length,
        };
        self.send(&r.encode());
    }

    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) {
        let mut b = nbd::Request {
            flags: 0,
            typ: cmd::WRITE,
            cookie,
            offset,
            length: data.len() as u32,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(data);
        self.send(&b);
    }

    pub fn chunk(&mut self) -> Chunk {
        let h = self.read_n(nbd::CHUNK_HEADER_LEN);
        assert_eq!(be32(&h), nbd::STRUCTURED_REPLY_MAGIC, "chunk magic");
        let len = be32(&h[16..]) as usize;
        Chunk {
            flags: be16(&h[4..]),
            typ: be16(&h[6..]),
            cookie: be64(&h[8..]),
            payload: self.read_n(len),
        }
    }

    /// The next reply to a request that returns no data (or a failed read): simple, or
    /// structured chunks up to the one flagged DONE (one request in flight).
    pub fn reply(&mut self) -> Reply {
        let m = self.read_n(4);
        match be32(&m) {
            nbd::SIMPLE_REPLY_MAGIC => {
                let r = self.read_n(12);
                Reply::Simple {
                    error: be32(&r),
                    cookie: be64(&r[4..]),
                }
            }
            nbd::STRUCTURED_REPLY_MAGIC => {
                let rest = self.read_n(nbd::CHUNK_HEADER_LEN - 4);
                let len = be32(&rest[12..]) as usize;
                let first = Chunk {
                    flags: be16(&rest),
                    typ: be16(&rest[2..]),
                    cookie: be64(&rest[4..]),
                    payload: self.read_n(len),
                };
                let mut chunks = vec![first];
                while chunks.last().unwrap().flags & chunk::FLAG_DONE == 0 {
                    chunks.push(self.chunk());
                }
                Reply::Structured(chunks)
            }
            m => panic!("not a reply magic: {m:#x}"),
        }
    }

    /// The next reply, or None once the target has closed the connection.
    pub fn try_reply(&mut self) -> Option<Reply> {
        let mut b = [0u8; 1];
        match self.0.read(&mut b) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("waiting for a reply or EOF: {e}"),
        }
        let rest = self.read_n(3);
        let magic = u32::from_be_bytes([b[0], rest[0], rest[1], rest[2]]);
        assert_eq!(magic, nbd::SIMPLE_REPLY_MAGIC, "simple reply magic");
        let r = self.read_n(12);
        Some(Reply::Simple {
            error: be32(&r),
            cookie: be64(&r[4..]),
        })
    }

    /// A simple reply to a READ of `len` bytes: (error, cookie, data).
    pub fn read_simple(&mut self, len: usize) -> (u32, u64, Vec<u8>) {
        let h = self.read_n(nbd::SIMPLE_REPLY_LEN);
        assert_eq!(be32(&h), nbd::SIMPLE_REPLY_MAGIC, "simple reply magic");
        let error = be32(&h[4..]);
        let data = if error == 0 {
            self.read_n(len)
        } else {
            Vec::new()
        };
        (error, be64(&h[8..]), data)
    }

    /// Structured reply to a READ of `len` bytes at `offset`: reassembles data and hole chunks
    /// (checking they stay inside the request) and returns the chunks and the bytes.
    pub fn read_structured(&mut self, offset: u64, len: usize) -> (Vec<Chunk>, Vec<u8>) {
        let mut data = vec![0xeeu8; len];
        let mut covered = 0usize;
        let mut chunks = Vec::new();
        loop {
            let c = self.chunk();
            match c.typ {
                chunk::OFFSET_DATA => {
                    let at = (be64(&c.payload) - offset) as usize;
                    let n = c.payload.len() - 8;
                    assert!(at + n <= len, "data chunk outside the request: {c:?}");
                    data[at..at + n].copy_from_slice(&c.payload[8..]);
                    covered += n;
                }
                chunk::OFFSET_HOLE => {
                    assert_eq!(c.payload.len(), 12, "hole chunk length");
                    let at = (be64(&c.payload) - offset) as usize;
                    let n = be32(&c.payload[8..]) as usize;
                    assert!(n > 0 && at + n <= len, "hole chunk outside the request");
                    data[at..at + n].fill(0);
                    covered += n;
                }
                chunk::NONE => assert!(c.payload.is_empty()),
                t => panic!("unexpected chunk type {t:#x} in a successful read: {c:?}"),
            }
            let done = c.flags & chunk::FLAG_DONE != 0;
            chunks.push(c);
            if done {
                break;
            }
        }
        assert_eq!(covered, len, "content chunks cover the whole read");
        (chunks, data)
    }

    /// Asserts the target closed the connection: sends `probe` (a message the target would
    /// answer if it were still talking to us), then expects EOF or a reset, never an answer
    /// and never silence until the read timeout.
    pub fn assert_closed(mut self, what: &str, probe: &[u8]) {
        let _ = self.0.write_all(probe);
        let mut b = [0u8; 256];
        match self.0.read(&mut b) {
            Ok(0) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::BrokenPipe
                ) => {}
            Ok(n) => panic!(
                "{what}: the target kept the connection and answered: {:02x?}",
                &b[..n.min(32)]
            ),
            Err(e) => panic!("{what}: the target neither closed nor answered: {e}"),
        }
    }
}

/// An option header (NBD_OPT_LIST): what `assert_closed` sends during the handshake.
pub fn list_probe() -> Vec<u8> {
    let mut b = nbd::IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt::LIST.to_be_bytes());
    b.extend_from_slice(&0u32.to_be_bytes());
    b
}

/// A READ of 512 bytes at 0: what `assert_closed` sends during transmission.
pub fn read_probe() -> Vec<u8> {
    nbd::Request {
        flags: 0,
        typ: cmd::READ,
        cookie: 0xdead,
        offset: 0,
        length: 512,
    }
    .encode()
    .to_vec()
}
