//! blkwire initiator library.
//!
//! [`connect`] opens a session (PROTOCOL.md §2): one TCP connection per queue. Each [`Queue`] is
//! independent and meant to be owned by one thread: it pipelines requests (`submit`), sends them
//! in one syscall, and hands back completions with the read data borrowed straight from its
//! receive buffer. [`Queue::read_at`] and friends are the simple blocking API on top.
//!
//! Every wait is bounded: a target that dies or stops answering yields [`Error::Closed`] or
//! [`Error::Timeout`], never a hang.

mod queue;
mod url;

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use blkwire_wire::{
    ExportEntry, Features, Header, Hello, HelloReply, Opcode, Status, Tag, HEADER_LEN,
};

pub use queue::{Cmd, Completion, Queue, QueueStats};
pub use url::Url;

/// Everything that can go wrong, each with a one-line explanation.
#[derive(Debug)]
pub enum Error {
    /// Bad user input (URL, sizes, ranges).
    Usage(String),
    /// Could not reach the target.
    Connect {
        addr: String,
        source: std::io::Error,
    },
    /// The target refused the handshake or a command.
    Status {
        what: String,
        status: Status,
    },
    /// The target closed the connection.
    Closed,
    /// No answer within the I/O timeout.
    Timeout(Duration),
    /// The target broke the protocol.
    Protocol(String),
    Io(std::io::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Usage(s) => f.write_str(s),
            Error::Connect { addr, source } => write!(f, "cannot connect to {addr}: {source}"),
            Error::Status { what, status } => write!(f, "{what}: {status}"),
            Error::Closed => write!(
                f,
                "the target closed the connection (did it stop or crash?)"
            ),
            Error::Timeout(d) => write!(f, "no reply from the target in {}s", d.as_secs()),
            Error::Protocol(s) => write!(f, "protocol error from the target: {s}"),
            Error::Io(e) => write!(f, "network error: {e}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// What a session asks for.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub queues: u16,
    pub depth: u16,
    pub max_io: u32,
    /// Identity sent in HELLO; the host name by default.
    pub host_id: String,
    /// Longest wait for any reply before giving up with [`Error::Timeout`].
    pub timeout: Duration,
    /// How long to spin for a reply before sleeping (trades CPU for latency).
    pub poll: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            queues: 1,
            depth: 128,
            max_io: 1 << 20,
            host_id: hostname(),
            timeout: Duration::from_secs(30),
            poll: Duration::from_micros(50),
        }
    }
}

/// A random 64-bit value from the kernel (HELLO nonces).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    if n == 8 {
        u64::from_le_bytes(b)
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9E37_79B9_7F4A_7C15)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// An export as the session sees it.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    pub name: String,
    pub size: u64,
    pub logical_block: u32,
    pub physical_block: u32,
    pub features: Features,
    pub queues: u16,
    pub depth: u16,
    pub max_io: u32,
    pub session: u32,
}

/// An open session: its export's description and its queues.
pub struct Session {
    pub info: ExportInfo,
    pub queues: Vec<Queue>,
}

fn dial(url: &Url, timeout: Duration) -> Result<TcpStream> {
    let addr = url.authority();
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Error::Connect {
            addr: addr.clone(),
            source: e,
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, timeout.min(Duration::from_secs(10))) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(Error::Connect {
        addr,
        source: last.unwrap_or_else(|| std::io::Error::other("no address found")),
    })
}

/// One blocking request/reply exchange during the handshake.
fn exchange(
    s: &mut TcpStream,
    h: &Header,
    payload: &[u8],
    max_reply: u32,
) -> Result<(Header, Vec<u8>)> {
    let mut buf = h.to_bytes().to_vec();
    buf.extend_from_slice(payload);
    s.write_all(&buf).map_err(|e| map_io(e, s))?;
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).map_err(|e| map_io(e, s))?;
    let r = Header::decode(&hb, max_reply).map_err(|e| Error::Protocol(e.to_string()))?;
    if !r.is_reply() || r.opcode != h.opcode {
        return Err(Error::Protocol(format!("expected a {:?} reply", h.opcode)));
    }
    let mut p = vec![0u8; r.payload_len as usize];
    s.read_exact(&mut p).map_err(|e| map_io(e, s))?;
    Ok((r, p))
}

/// Maps a handshake I/O error; a timeout reports the socket's own limit.
fn map_io(e: std::io::Error, s: &TcpStream) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => Error::Closed,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Timeout(s.read_timeout().ok().flatten().unwrap_or_default())
        }
        _ => Error::Io(e),
    }
}

/// Lists the exports of the target a URL points at (the export part is ignored).
pub fn list(url: &Url, timeout: Duration) -> Result<Vec<ExportEntry>> {
    let mut s = dial(url, timeout)?;
    let (r, p) = exchange(
        &mut s,
        &Header::request(Opcode::List, Tag::new(0, 0), 0, 0),
        &[],
        1 << 20,
    )?;
    if r.status != Status::Ok {
        return Err(Error::Status {
            what: "list exports".into(),
            status: r.status,
        });
    }
    ExportEntry::decode_list(&p).map_err(|e| Error::Protocol(e.to_string()))
}

/// Fetches the target's live per-queue counters as the JSON document of PROTOCOL.md §11.
pub fn stats(url: &Url, timeout: Duration) -> Result<String> {
    let mut s = dial(url, timeout)?;
    let (r, p) = exchange(
        &mut s,
        &Header::request(Opcode::Stats, Tag::new(0, 0), 0, 0),
        &[],
        1 << 20,
    )?;
    if r.status != Status::Ok {
        return Err(Error::Status {
            what: "stats".into(),
            status: r.status,
        });
    }
    String::from_utf8(p).map_err(|_| Error::Protocol("stats reply is not UTF-8".into()))
}

/// Opens a session on `url`'s export with as many queues as the target grants.
pub fn connect(url: &Url, opts: &ConnectOptions) -> Result<Session> {
    let mut s0 = dial(url, opts.timeout)?;
    let hello = Hello {
        queues: opts.queues.max(1),
        depth: opts.depth.max(1),
        max_io: opts.max_io.max(512),
        client_features: 0,
        frame_payload: 0,
        nonce: random_u64(),
        host_id: opts.host_id.chars().take(255).collect(),
        export: url.export.clone(),
        auth: vec![],
    };
    let payload = hello
        .encode()
        .map_err(|e| Error::Usage(format!("export name: {e}")))?;
    let mut h = Header::request(Opcode::Hello, Tag::new(0, 0), 0, 0);
    h.payload_len = payload.len() as u32;
    let (r, p) = exchange(&mut s0, &h, &payload, 4096)?;
    if r.status != Status::Ok {
        let what = match r.status {
            Status::NoExport => {
                let names = list(url, opts.timeout)
                    .map(|l| l.into_iter().map(|e| e.name).collect::<Vec<_>>().join(", "))
                    .unwrap_or_default();
                format!(
                    "export '{}' on {} (available: {names})",
                    url.export,
                    url.authority()
                )
            }
            _ => format!("open export '{}' on {}", url.export, url.authority()),
        };
        return Err(Error::Status {
            what,
            status: r.status,
        });
    }
    let reply = HelloReply::decode(&p).map_err(|e| Error::Protocol(e.to_string()))?;
    let info = ExportInfo {
        name: url.export.clone(),
        size: reply.size,
        logical_block: reply.logical_block,
        physical_block: reply.physical_block,
        features: reply.features,
        queues: reply.queues,
        depth: reply.depth,
        max_io: reply.max_io,
        session: reply.session,
    };
    let mut queues = vec![Queue::new(s0, 0, &info, opts)?];
    for q in 1..reply.queues {
        let mut s = dial(url, opts.timeout)?;
        let mut h = Header::request(Opcode::Join, Tag::new(0, 0), 0, 0);
        h.session = reply.session;
        h.queue = q;
        h.payload_len = 8;
        let (r, _) = exchange(&mut s, &h, &reply.cookie.to_le_bytes(), 0)?;
        if r.status != Status::Ok {
            return Err(Error::Status {
                what: format!("join queue {q}"),
                status: r.status,
            });
        }
        queues.push(Queue::new(s, q, &info, opts)?);
    }
    Ok(Session { info, queues })
}
