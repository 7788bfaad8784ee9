#![deny(missing_docs)]
//! blkwire initiator library.
//!
//! [`connect`] opens a session (PROTOCOL.md §2): one TCP connection per queue. Each [`Queue`] is
//! independent and meant to be owned by one thread: it pipelines requests (`submit`), sends them
//! in one syscall, and hands back completions with the read data borrowed straight from its
//! receive buffer. [`Queue::read_at`] and friends are the simple blocking API on top.
//!
//! Every wait is bounded: a target that dies or stops answering yields [`Error::Closed`] or
//! [`Error::Timeout`], never a hang.

mod auth;
mod deadline;
mod dgram;
#[doc(hidden)]
pub mod fuzzing;
mod nvme;
mod queue;
mod stream;
#[cfg(test)]
mod testing;
mod tls;
mod url;

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use deadline::Deadline;
use tls::Link;

use blkwire_wire::{
    fragment_count, ExportEntry, Features, Header, HelloReply, Join, Opcode, Status, Tag, AUTH_LEN,
    HEADER_CRC, HEADER_LEN, MAX_FRAGMENTS, QUERY_LIST, QUERY_STATS, SESSION_HEADER_CRC,
};

pub use blkwire_block::{BlockOp, BlockRequest, CopyRange, IoFlags};
pub use blkwire_wire::{CopyLimits, QueueRef};
pub use dgram::{discover_eth, discover_udp, Discovered};
pub use queue::{overlapping_source, Cmd, Completion, Queue, QueueStats, COPY_COMMAND_MAX};
pub use url::{format_mac, parse_mac, Transport, Url};

/// Everything that can go wrong, each with a one-line explanation.
#[derive(Debug)]
pub enum Error {
    /// Bad user input (URL, sizes, ranges).
    Usage(String),
    /// Could not reach the target.
    Connect {
        /// The address dialled.
        addr: String,
        /// Why the connection failed.
        source: std::io::Error,
    },
    /// The target refused the handshake or a command.
    Status {
        /// What was asked (handshake, command).
        what: String,
        /// The status the target answered.
        status: Status,
    },
    /// The target closed the connection.
    Closed,
    /// Datagrams: the target no longer knows this session (it restarted, or the session sat
    /// idle past its expiry). Reconnect and send again.
    SessionLost,
    /// No answer within the I/O timeout.
    Timeout(Duration),
    /// The target broke the protocol.
    Protocol(String),
    /// Authentication failed: the target refused this host, or could not prove its own key.
    Auth(String),
    /// A COPY failed (PROTOCOL.md §13): `copied` bytes from its destination are known to hold
    /// the copied data; bytes after them are unchanged or partly copied.
    Copy {
        /// The status the target answered.
        status: Status,
        /// Bytes from the destination offset known copied.
        copied: u64,
    },
    /// A socket call failed.
    Io(std::io::Error),
    /// TLS could not be set up with the target (handshake refused, certificate not trusted).
    Tls(String),
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
            Error::SessionLost => write!(
                f,
                "the target no longer knows this session (it restarted or the session was idle too long); reconnect"
            ),
            // Debug: "10s", "300ms" (whole seconds said "0s" for a timeout under one).
            Error::Timeout(d) => write!(f, "no reply from the target in {d:?}"),
            Error::Protocol(s) => write!(f, "protocol error from the target: {s}"),
            Error::Auth(s) => f.write_str(s),
            Error::Copy { status, copied } => {
                write!(f, "copy failed after {copied} bytes: {status}")
            }
            Error::Io(e) => write!(f, "network error: {e}"),
            Error::Tls(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e)
    }
}

/// The result of every fallible call of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What a session asks for.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Queues wanted (the target may grant fewer).
    pub queues: u16,
    /// Requests in flight per queue wanted.
    pub depth: u16,
    /// Largest I/O wanted, in bytes (the target may grant less).
    pub max_io: u32,
    /// Identity sent in HELLO: `--host-id`, else `BLKWIRE_HOST_ID`, else derived from
    /// /etc/machine-id ([`blkwire_auth::default_host_id`]).
    pub host_id: String,
    /// This host's pre-shared key (`--key FILE`, the line for `host_id`): with one, the
    /// handshake proves both ends know it (PROTOCOL.md §12), and TLS uses it as its PSK.
    pub key: Option<blkwire_auth::Key>,
    /// Datagram sessions with a key: encrypt frames, not only authenticate them
    /// (PROTOCOL.md §12.4; `--encrypt`, or `?encrypt=1` on the URL).
    pub encrypt: bool,
    /// TLS 1.3 on `tcp://` (`--tls`): with `key`, TLS-PSK (the identity is `host_id`); without,
    /// X.509, the target's certificate verified against `tls_ca` (else the system's roots).
    pub tls: bool,
    /// `--tls-ca FILE`: the CA certificates (PEM) the target's certificate must chain to.
    pub tls_ca: Option<PathBuf>,
    /// Longest wait for any reply before giving up with [`Error::Timeout`].
    pub timeout: Duration,
    /// Datagram queues: how long a request is sent again before it is given up and answered
    /// with an I/O error, the queue left open (default: `timeout`). A caller that times its
    /// requests out itself and fences the queue of a change it gave up (PROTOCOL.md §2.6, the
    /// map daemons) sets it past its own limits: a WRITE failed here while the target may
    /// still run it would reach that caller as a plain failure, unfenced, and the old WRITE
    /// could land after the caller wrote those blocks again.
    pub give_up: Option<Duration>,
    /// How long to spin for a reply before sleeping (trades CPU for latency).
    pub poll: Duration,
    /// A reconnection's queue of the session it replaces ([`Queue::identity`], PROTOCOL.md
    /// §2.6): the target ends that queue and welcomes the new session only once none of the
    /// old queue's requests still runs, so a write resent on the new session can never be
    /// overtaken by the old copy of it. `connect` retries while the target says the old queue
    /// is still draining (`BUSY`), up to `timeout`.
    pub replaces: Option<QueueRef>,
    /// Only the first queue is connected: the grant is read (`Session::info` says what the
    /// target allows, `queues` included) without a connection for every queue it allows, each
    /// of which takes the target's memory (`blkwire info`). `Session::queues` then holds one.
    pub probe: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            queues: 1,
            depth: 128,
            max_io: 1 << 20,
            host_id: blkwire_auth::default_host_id(),
            key: None,
            encrypt: false,
            tls: false,
            tls_ca: None,
            timeout: Duration::from_secs(30),
            give_up: None,
            poll: Duration::from_micros(50),
            replaces: None,
            probe: false,
        }
    }
}

/// Who an initiator says it is, as the user gave it: kept as given (a key file's path, not the
/// key) so a mapping's daemon can read it again when it recovers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credentials {
    /// `--host-id` (default: [`blkwire_auth::default_host_id`]).
    pub host_id: Option<String>,
    /// `--key FILE`: its line for the host id is used.
    pub key_file: Option<std::path::PathBuf>,
    /// `--encrypt`.
    pub encrypt: bool,
    /// `--tls` (implied by `--tls-ca`): TLS 1.3 on `tcp://`.
    pub tls: bool,
    /// `--tls-ca FILE`: the CA certificates the target's X.509 certificate must chain to.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl Credentials {
    /// Fills the host id, key, encryption and TLS of `opts`; errors are one line that says what
    /// to do.
    pub fn apply(&self, opts: &mut ConnectOptions) -> std::result::Result<(), String> {
        opts.tls = self.tls || self.tls_ca.is_some();
        opts.tls_ca = self.tls_ca.clone();
        if let Some(ca) = &self.tls_ca {
            // Before connecting, and with the cause OpenSSL would not name.
            std::fs::File::open(ca)
                .map_err(|e| format!("--tls-ca {}: cannot read it: {e}", ca.display()))?;
        }
        if let Some(id) = &self.host_id {
            blkwire_auth::keys::check_host_id(id).map_err(|e| format!("--host-id: {e}"))?;
            opts.host_id = id.clone();
        }
        if let Some(path) = &self.key_file {
            let store = blkwire_auth::KeyStore::load(path)?;
            let key = store.get(&opts.host_id).ok_or_else(|| {
                let hosts: Vec<&str> = store.hosts().collect();
                format!(
                    "key file {} has no key for host '{}' (it has: {}): pass --host-id ID, \
                     or make one with `blkwire key gen FILE --host-id {}`",
                    path.display(),
                    opts.host_id,
                    hosts.join(", "),
                    opts.host_id
                )
            })?;
            opts.key = Some(key.clone());
        }
        if self.encrypt && opts.key.is_none() {
            return Err(
                "--encrypt needs a key: the frame keys come from the authenticated handshake \
                 (pass --key FILE)"
                    .into(),
            );
        }
        opts.encrypt = self.encrypt;
        Ok(())
    }
}

/// A random 64-bit value from the kernel (HELLO nonces).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is a local 8-byte buffer and 8 is its length.
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

/// An export as the session sees it.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    /// Export name.
    pub name: String,
    /// Export size in bytes.
    pub size: u64,
    /// Smallest addressable unit, in bytes.
    pub logical_block: u32,
    /// Unit the export writes without read-modify-write, in bytes.
    pub physical_block: u32,
    /// What the export does (PROTOCOL.md §7).
    pub features: Features,
    /// Queues granted.
    pub queues: u16,
    /// Requests in flight per queue granted.
    pub depth: u16,
    /// Largest I/O granted, in bytes.
    pub max_io: u32,
    /// Session id the target gave.
    pub session: u32,
    /// What one COPY may do (PROTOCOL.md §13), as this initiator uses the grant; disabled
    /// where the session has no COPY or limits too small to use.
    pub copy: CopyLimits,
    /// Datagram sessions: the CRC of data frames covers their header only, UDP's checksum
    /// their data (`udp://...?crc=header`, granted: PROTOCOL.md §9.7).
    pub header_crc: bool,
    /// The most one TRIM or WRITE ZEROES covers, in bytes (a multiple of the logical block):
    /// [`MAX_RANGE`] natively; on NVMe/TCP what a WRITE ZEROES' 16-bit block count reaches.
    /// Longer ranges are split at it ([`Queue::write_zeroes`], the map daemons).
    pub max_range: u32,
}

/// The most one native TRIM or WRITE ZEROES covers: its 32-bit length, in whole GiB.
pub const MAX_RANGE: u32 = 1 << 30;

/// An open session: its export's description and its queues.
pub struct Session {
    /// The export and what the target granted.
    pub info: ExportInfo,
    /// One per granted queue (one only for a `probe`), each meant for one thread.
    pub queues: Vec<Queue>,
}

/// Connects to a `tcp://` target, with TLS when the session has its settings (`tls`, from
/// [`tls_for`]), and returns the link with the deadline its handshake (TLS, then HELLO or
/// JOIN) must meet: the timeout from when the connection was made (the dial has its own).
fn open_link(
    url: &Url,
    opts: &ConnectOptions,
    tls: Option<&tls::SslConnector>,
) -> Result<(Link, Deadline)> {
    let s = dial(url, opts.timeout)?;
    let deadline = Deadline::after(opts.timeout);
    let link = match tls {
        Some(c) => tls::connect(url, opts, c, s, &deadline)?,
        None => Link::Plain(s),
    };
    Ok((link, deadline))
}

/// A session's TLS settings when the options ask for TLS, made once for all its connections.
fn tls_for(opts: &ConnectOptions) -> Result<Option<tls::SslConnector>> {
    opts.tls.then(|| tls::connector(opts)).transpose()
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

/// One blocking request/reply exchange during the handshake, answered by `deadline`.
fn exchange(
    s: &mut Link,
    h: &Header,
    payload: &[u8],
    max_reply: u32,
    deadline: &Deadline,
) -> Result<(Header, Vec<u8>)> {
    let mut h = *h;
    h.payload_len = payload.len() as u32;
    let mut buf = h.to_bytes().to_vec();
    buf.extend_from_slice(payload);
    s.write_all(&buf)
        .map_err(|e| map_io(e, deadline.timeout()))?;
    let mut hb = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match deadline.read(s, &mut hb[got..]) {
            Ok(n) => got += n,
            // An NBD listener greets first, then hangs up on what it cannot parse.
            Err(Error::Closed) if hb[..got].starts_with(NBD_GREETING) => {
                return Err(Error::Protocol(
                    "this is an NBD listener, not blkwire's own protocol: use nbd:// with an \
                     NBD client (nbdinfo, qemu-img), or the target's tcp:// port"
                        .into(),
                ))
            }
            Err(e) => return Err(e),
        }
    }
    let r = Header::decode(&hb, max_reply).map_err(|e| Error::Protocol(e.to_string()))?;
    if !r.is_reply() || r.opcode != h.opcode {
        return Err(Error::Protocol(format!("expected a {:?} reply", h.opcode)));
    }
    let mut p = vec![0u8; r.payload_len as usize];
    deadline.read_exact(s, &mut p)?;
    Ok((r, p))
}

/// How an NBD server's greeting starts ("NBDMAGIC").
const NBD_GREETING: &[u8] = b"NBDMAGIC";

/// Maps a handshake I/O error; a timeout reports `timeout`, the limit the caller set.
fn map_io(e: std::io::Error, timeout: Duration) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => Error::Closed,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout(timeout),
        _ => Error::Io(e),
    }
}

/// The reason a target may give with a refusal (PROTOCOL.md §2): shown only when it is short
/// and [`printable`].
pub(crate) fn refusal_reason(p: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(p).ok()?;
    (!s.is_empty() && s.len() <= 256 && printable(s)).then_some(s)
}

/// Whether a string a target sent may go to a terminal as it is: without control characters,
/// a hostile target cannot move the cursor, rewrite lines or reprogram the terminal with it.
pub(crate) fn printable(s: &str) -> bool {
    s.chars().all(|c| !c.is_control())
}

/// A string a target sent (an export name, a counter's label) as it may be shown on a
/// terminal: itself when it has no control characters, else with them escaped (`\u{1b}`).
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    if printable(s) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// How many of the `granted` queues a session connects (`ConnectOptions::probe`).
fn joined(opts: &ConnectOptions, granted: u16) -> u16 {
    if opts.probe {
        granted.min(1)
    } else {
        granted
    }
}

/// Lists the exports of the target a URL points at that this host may open (the export part
/// is ignored). On TCP, and on UDP with a key, this is an authenticated query (PROTOCOL.md
/// §12.3); otherwise a discovery LIST (§9.5).
pub fn list(url: &Url, opts: &ConnectOptions) -> Result<Vec<ExportEntry>> {
    refuse_nvme(url, "listing exports")?;
    check_protection(url, opts)?;
    let wait = opts.timeout.min(Duration::from_secs(2));
    let first = |found: Vec<Discovered>| {
        found
            .into_iter()
            .next()
            .map(|d| d.exports)
            .ok_or_else(|| Error::Connect {
                addr: url.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "no target answered"),
            })
    };
    let answer = match url.transport {
        Transport::Udp if opts.key.is_none() => return first(discover_udp(resolve(url)?, wait)?),
        Transport::Eth { mac } if opts.key.is_none() => {
            let want = format!("eth://{}/{}", url.host, format_mac(&mac));
            let found = discover_eth(&url.host, wait)?;
            return first(found.into_iter().filter(|d| d.base == want).collect());
        }
        _ => query(url, opts, QUERY_LIST)?,
    };
    ExportEntry::decode_list(&answer).map_err(|e| Error::Protocol(e.to_string()))
}

/// Fetches the target's live per-queue counters as the JSON document of PROTOCOL.md §11 (an
/// authenticated query, §12.3: on a target with keys only `--admin` hosts may).
pub fn stats(url: &Url, opts: &ConnectOptions) -> Result<String> {
    refuse_nvme(url, "stats")?;
    check_protection(url, opts)?;
    let p = query(url, opts, QUERY_STATS)?;
    String::from_utf8(p).map_err(|_| Error::Protocol("stats reply is not UTF-8".into()))
}

/// A query HELLO (empty export, PROTOCOL.md §12.3): challenged and proven like a session.
fn query(url: &Url, opts: &ConnectOptions, features: u64) -> Result<Vec<u8>> {
    let (attempt, (r, p)) = match url.transport {
        Transport::Tcp => {
            let (mut s, deadline) = open_link(url, opts, tls_for(opts)?.as_ref())?;
            let mut a = auth::Attempt::new(target_name(url), "", opts, 0, features)?;
            // STATS is up to 1 MiB, and the proof follows it.
            let max = (1 << 20) + AUTH_LEN as u32;
            let rp = auth::hello_exchange(&mut a, |h, p| exchange(&mut s, h, p, max, &deadline))?;
            (a, rp)
        }
        _ => {
            let link = match url.transport {
                Transport::Eth { mac } => {
                    dgram::eth_link(&url.host, mac, 0, Some(0), url.bypass_qdisc)?
                }
                _ => dgram::udp_link(resolve(url)?)?,
            };
            let mut a = auth::Attempt::new(target_name(url), "", opts, link.mtu_payload, features)?;
            let timeout = opts.timeout.min(Duration::from_secs(10));
            let rp =
                auth::hello_exchange(&mut a, |h, p| dgram::exchange_plain(&link, *h, p, timeout))
                    .map_err(|e| no_answer(url, e))?;
            (a, rp)
        }
    };
    if r.status != Status::Ok {
        return Err(attempt.refused(r.status, &p));
    }
    Ok(attempt.check_query(&p)?.to_vec())
}

/// A HELLO header with `tag` (each HELLO of an attempt has its own, PROTOCOL.md §12.1).
/// How errors name the target a URL points at: its address, or on Ethernet its link and MAC.
fn target_name(url: &Url) -> String {
    match url.transport {
        Transport::Eth { mac } => format!("eth://{}/{}", url.host, format_mac(&mac)),
        _ => url.authority(),
    }
}

/// A datagram handshake that timed out: nothing answered at that address.
fn no_answer(url: &Url, e: Error) -> Error {
    match e {
        Error::Timeout(_) => Error::Connect {
            addr: url.authority(),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no answer over {}",
                    if matches!(url.transport, Transport::Udp) {
                        "UDP"
                    } else {
                        "Ethernet"
                    }
                ),
            ),
        },
        e => e,
    }
}

/// Refuses protection asked for on a transport that cannot give it, so that traffic the user
/// asked to protect never leaves unprotected: TLS is for streams (`tcp://`), sealing with
/// `--encrypt` for datagrams (`udp://`, `eth://`, PROTOCOL.md §12.4).
fn check_protection(url: &Url, opts: &ConnectOptions) -> Result<()> {
    let datagram = matches!(url.transport, Transport::Udp | Transport::Eth { .. });
    if datagram && (opts.tls || opts.tls_ca.is_some()) {
        return Err(Error::Usage(format!(
            "{url}: --tls is for tcp:// only; udp:// and eth:// are protected by --key FILE \
             (add --encrypt to encrypt too)"
        )));
    }
    if !datagram && (opts.encrypt || url.encrypt) {
        let instead = match url.transport {
            Transport::Tcp => "; over tcp:// use --tls",
            _ => "",
        };
        return Err(Error::Usage(format!(
            "{url}: --encrypt (?encrypt=1) is for udp:// and eth:// only{instead}"
        )));
    }
    // The frame keys come from the authenticated handshake: without a key the session would
    // go in clear, which the user asked not to.
    if (opts.encrypt || url.encrypt) && opts.key.is_none() {
        return Err(Error::Usage(format!(
            "{url}: --encrypt (?encrypt=1) needs a key: the frame keys come from the \
             authenticated handshake (pass --key FILE)"
        )));
    }
    Ok(())
}

/// Refuses the blkwire queries (LIST, STATS) on `nvme-tcp://`, which has neither: they would
/// go to the NVMe port over UDP and time out.
fn refuse_nvme(url: &Url, what: &str) -> Result<()> {
    if url.transport == Transport::NvmeTcp {
        return Err(Error::Usage(format!(
            "{url}: {what} is for blkwire's own transports (tcp://, udp://, eth://); an \
             nvme-tcp:// URL names one subsystem (nvme-tcp://HOST[:PORT]/NQN), and \
             `nvme discover` lists a target's"
        )));
    }
    Ok(())
}

/// Opens a session on `url`'s export with as many queues as the target grants.
pub fn connect(url: &Url, opts: &ConnectOptions) -> Result<Session> {
    check_protection(url, opts)?;
    if url.encrypt && !opts.encrypt {
        let opts = ConnectOptions {
            encrypt: true,
            ..opts.clone()
        };
        return connect(url, &opts);
    }
    let Some(replaced) = opts.replaces else {
        return connect_once(url, opts);
    };
    // The target ends the replaced queue at the first HELLO and says BUSY until the requests
    // it was running have finished (PROTOCOL.md §2.6): ask again until then.
    let deadline = deadline::later(Instant::now(), opts.timeout);
    let mut pause = Duration::from_millis(2);
    loop {
        match connect_once(url, opts) {
            Err(Error::Status {
                status: Status::Busy,
                what,
            }) => {
                if Instant::now() + pause >= deadline {
                    return Err(Error::Status {
                        what: format!(
                            "{what} (session {} queue {}, which it replaces, still has requests running there after {:.0?})",
                            replaced.session, replaced.queue, opts.timeout
                        ),
                        status: Status::Busy,
                    });
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            r => return r,
        }
    }
}

/// One attempt of [`connect`].
fn connect_once(url: &Url, opts: &ConnectOptions) -> Result<Session> {
    match url.transport {
        Transport::Tcp => connect_tcp(url, opts),
        Transport::Udp => {
            let addr = resolve(url)?;
            connect_dgram(url, opts, &|_, _| dgram::udp_link(addr))
        }
        Transport::Eth { mac } => connect_dgram(url, opts, &|queue, session| {
            dgram::eth_link(&url.host, mac, queue, session, url.bypass_qdisc)
        }),
        Transport::NvmeTcp => nvme::connect(url, opts),
    }
}

/// A target may grant less than asked (PROTOCOL.md §2.2), never more: a hostile or broken
/// target must not make the initiator open more connections or allocate larger buffers than
/// its caller chose. Returns the grant as the session uses it: its COPY limits narrowed by
/// [`usable_copy`].
fn check_grant(
    opts: &ConnectOptions,
    frame_payload: u32,
    reply: &HelloReply,
) -> Result<HelloReply> {
    let asked = (opts.queues.max(1), opts.depth.max(1), opts.max_io.max(512));
    let granted = (reply.queues, reply.depth, reply.max_io);
    let fits = (1..=asked.0).contains(&granted.0)
        && (1..=asked.1).contains(&granted.1)
        && (1..=asked.2).contains(&granted.2)
        && (frame_payload == 0 || (1..=frame_payload.max(512)).contains(&reply.frame_payload));
    if fits && frame_payload != 0 {
        // §9.3: a message of more frames is a burst no receiver's backlog holds, and more than
        // the 16-bit fragment fields of a frame can count.
        let frags = fragment_count(reply.max_io, reply.frame_payload);
        if frags > MAX_FRAGMENTS {
            return Err(Error::Protocol(format!(
                "the target granted max I/O {} in frames of {} bytes: {frags} fragments a \
                 message, more than the {MAX_FRAGMENTS} PROTOCOL.md §9.3 allows",
                reply.max_io, reply.frame_payload
            )));
        }
    }
    if fits {
        // A COPY descriptor travels in one frame (§13): a datagram's, or on TCP one of max_io.
        let frame = if frame_payload == 0 {
            reply.max_io
        } else {
            reply.frame_payload
        };
        Ok(HelloReply {
            copy: usable_copy(reply.copy, reply.logical_block, frame),
            ..*reply
        })
    } else {
        Err(Error::Protocol(format!(
            "the target granted {} queues x {} deep, max I/O {} (frame {}), outside the {} x {}, {} (frame {}) asked for",
            granted.0,
            granted.1,
            granted.2,
            reply.frame_payload,
            asked.0,
            asked.1,
            asked.2,
            frame_payload
        )))
    }
}

/// Fewest bytes one COPY must be able to move for a session to use COPY: below it a copy is a
/// flood of tiny commands (a target granting 1 byte would make `cp` send one per byte).
const COPY_MIN_BYTES: u32 = 64 << 10;

/// The COPY limits a session uses of those granted (PROTOCOL.md §13): at most the ranges a
/// descriptor in one `frame`-byte payload holds, and none at all where a range could not hold
/// a logical block or one COPY could not move [`COPY_MIN_BYTES`].
fn usable_copy(granted: CopyLimits, logical_block: u32, frame: u32) -> CopyLimits {
    let c = CopyLimits {
        max_ranges: granted
            .max_ranges
            .min(blkwire_wire::CopyDescriptor::ranges_fitting(frame)),
        ..granted
    };
    let per_command = c
        .max_bytes
        .min(c.max_range.saturating_mul(c.max_ranges as u32));
    if c.enabled() && c.max_range >= logical_block && per_command >= COPY_MIN_BYTES {
        c
    } else {
        CopyLimits::default()
    }
}

/// A HELLO for an export the target does not have: the error lists those it has.
fn no_such_export(url: &Url, opts: &ConnectOptions) -> Error {
    let names = list(url, opts)
        .map(|l| {
            let names: Vec<_> = l.iter().map(|e| shown(&e.name).into_owned()).collect();
            names.join(", ")
        })
        .unwrap_or_default();
    Error::Status {
        what: format!(
            "export '{}' on {} (available: {names})",
            url.export,
            url.authority()
        ),
        status: Status::NoExport,
    }
}

fn info_from(url: &Url, reply: &HelloReply) -> ExportInfo {
    ExportInfo {
        name: url.export.clone(),
        size: reply.size,
        logical_block: reply.logical_block,
        physical_block: reply.physical_block,
        features: reply.features,
        queues: reply.queues,
        depth: reply.depth,
        max_io: reply.max_io,
        session: reply.session,
        copy: reply.copy,
        header_crc: url.header_crc && reply.session_flags & SESSION_HEADER_CRC != 0,
        max_range: MAX_RANGE,
    }
}

fn resolve(url: &Url) -> Result<std::net::SocketAddr> {
    let addr = url.authority();
    addr.to_socket_addrs()
        .map_err(|e| Error::Connect {
            addr: addr.clone(),
            source: e,
        })?
        .next()
        .ok_or_else(|| Error::Connect {
            addr,
            source: std::io::Error::other("no address found"),
        })
}

/// Opens the link of queue `q` (with the session id once known).
type LinkFactory<'a> = &'a dyn Fn(u16, Option<u32>) -> Result<dgram::Link>;

/// Datagram session (PROTOCOL.md §9): one socket per queue (UDP: its own source port; Ethernet:
/// a packet socket filtered to that queue).
fn connect_dgram(url: &Url, opts: &ConnectOptions, open: LinkFactory<'_>) -> Result<Session> {
    let hs_timeout = opts.timeout.min(Duration::from_secs(10));
    let link0 = open(0, None)?;
    let features = if url.header_crc { HEADER_CRC } else { 0 };
    let mut attempt = auth::Attempt::new(
        target_name(url),
        &url.export,
        opts,
        link0.mtu_payload,
        features,
    )?;
    let (r, p) = auth::hello_exchange(&mut attempt, |h, p| {
        dgram::exchange_plain(&link0, *h, p, hs_timeout)
    })
    .map_err(|e| no_answer(url, e))?;
    if r.status != Status::Ok {
        return Err(refused(url, opts, &attempt, r.status, &p));
    }
    let reply = HelloReply::decode(&p).map_err(|e| Error::Protocol(e.to_string()))?;
    let keys = attempt.check_welcome(&reply)?;
    let reply = check_grant(opts, link0.mtu_payload, &reply)?;
    let info = info_from(url, &reply);
    // Queue 0's socket was opened before the session existed: narrow its filter now.
    let link0 = match url.transport {
        Transport::Eth { .. } => open(0, Some(reply.session))?,
        _ => link0,
    };
    let name = |queue| QueueRef {
        session: reply.session,
        queue,
        cookie: reply.cookie,
    };
    let mk = |link, q, credit: u16, seal| {
        Queue::dgram(
            dgram::DgramQueue::new(
                link,
                dgram::Grant {
                    session: reply.session,
                    index: q,
                    depth: reply.depth,
                    max_io: reply.max_io,
                    frame_payload: reply.frame_payload,
                    credit: credit as u32,
                    // Asked for, and granted: a sealed session is never granted it (its frames
                    // carry no CRC: the seal covers header and data).
                    header_crc: info.header_crc,
                },
                seal,
                opts.give_up.unwrap_or(opts.timeout),
                opts.poll,
            ),
            reply.copy,
            MAX_RANGE,
        )
        .known_as(name(q))
    };
    let seal0 = keys.as_ref().map(|k| k.queue(reply.session, 0));
    let mut queues = vec![mk(link0, 0, r.credit, seal0)];
    for q in 1..joined(opts, reply.queues) {
        let link = open(q, Some(reply.session))?;
        let mut h = Header::request(Opcode::Join, Tag::new(0, 0), 0, 0);
        h.session = reply.session;
        h.queue = q;
        let mut join = Join {
            cookie: reply.cookie,
            proof: keys
                .as_ref()
                .map_or([0; 32], |k| k.join_proof(reply.session, q, reply.cookie)),
            nonce_s: [0; 32],
        };
        let mut seal = keys.as_ref().map(|k| k.queue(reply.session, q));
        // The target challenges the queue's address first (PROTOCOL.md §12.1), like a HELLO;
        // each JOIN has its own tag, so a late answer to an earlier copy is not taken for the
        // answer to the next.
        let mut answer = None;
        for round in 1..=3 {
            h.tag = Tag::new(0, round);
            let (r, p) = dgram::exchange(&link, h, &join.encode(), hs_timeout, seal.as_mut())?;
            if r.status != Status::Challenge {
                answer = Some(r);
                break;
            }
            join.nonce_s = p
                .try_into()
                .map_err(|_| Error::Protocol("malformed JOIN challenge".into()))?;
        }
        let r = answer.ok_or_else(|| {
            Error::Protocol(format!(
                "{} keeps challenging JOIN of queue {q}",
                target_name(url)
            ))
        })?;
        if r.status != Status::Ok {
            return Err(Error::Status {
                what: format!("join queue {q}"),
                status: r.status,
            });
        }
        queues.push(mk(link, q, r.credit, seal));
    }
    Ok(Session { info, queues })
}

/// A refused HELLO as the error the user sees: the target's own reason when it gave one (e.g.
/// TLS required); authentication refusals name the host and the target; an unknown export
/// lists what there is.
fn refused(
    url: &Url,
    opts: &ConnectOptions,
    attempt: &auth::Attempt,
    status: Status,
    reason: &[u8],
) -> Error {
    match status {
        Status::NoExport if refusal_reason(reason).is_none() => no_such_export(url, opts),
        _ => attempt.refused(status, reason),
    }
}

fn connect_tcp(url: &Url, opts: &ConnectOptions) -> Result<Session> {
    // Each connection's handshake (TLS, HELLO or JOIN) is over within the timeout, however
    // the target trickles its answers: a connect (a mapping's reconnection) cannot be held.
    let tls = tls_for(opts)?;
    let (mut s0, deadline) = open_link(url, opts, tls.as_ref())?;
    let mut attempt = auth::Attempt::new(target_name(url), &url.export, opts, 0, 0)?;
    let (r, p) = auth::hello_exchange(&mut attempt, |h, p| {
        exchange(&mut s0, h, p, 4096, &deadline)
    })?;
    if r.status != Status::Ok {
        return Err(refused(url, opts, &attempt, r.status, &p));
    }
    let reply = HelloReply::decode(&p).map_err(|e| Error::Protocol(e.to_string()))?;
    let keys = attempt.check_welcome(&reply)?;
    let reply = check_grant(opts, 0, &reply)?;
    let info = info_from(url, &reply);
    let name = |queue| QueueRef {
        session: reply.session,
        queue,
        cookie: reply.cookie,
    };
    let mut queues = vec![Queue::stream(
        stream::StreamQueue::new(s0, 0, &info, opts)?,
        info.copy,
        info.max_range,
    )
    .known_as(name(0))];
    for q in 1..joined(opts, reply.queues) {
        // Every queue of a TLS session is a TLS connection of its own.
        let (mut s, deadline) = open_link(url, opts, tls.as_ref())?;
        let mut h = Header::request(Opcode::Join, Tag::new(0, 0), 0, 0);
        h.session = reply.session;
        h.queue = q;
        let join = Join {
            cookie: reply.cookie,
            proof: keys
                .as_ref()
                .map_or([0; 32], |k| k.join_proof(reply.session, q, reply.cookie)),
            nonce_s: [0; 32],
        };
        let (r, _) = exchange(&mut s, &h, &join.encode(), 0, &deadline)?;
        if r.status != Status::Ok {
            return Err(Error::Status {
                what: format!("join queue {q}"),
                status: r.status,
            });
        }
        queues.push(
            Queue::stream(
                stream::StreamQueue::new(s, q, &info, opts)?,
                info.copy,
                info.max_range,
            )
            .known_as(name(q)),
        );
    }
    Ok(Session { info, queues })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, granted};
    use blkwire_wire::CopyDescriptor;
    use std::io::Read;

    /// Protection asked for that cannot be given is refused before anything is sent: sealing
    /// without a key (the session would go in clear), and blkwire's queries on nvme-tcp://
    /// (they would go to the NVMe port over UDP).
    #[test]
    fn what_cannot_be_done_as_asked_is_refused_up_front() {
        let udp = Url::parse("udp://127.0.0.1:9/d").unwrap();
        let opts = ConnectOptions {
            encrypt: true,
            ..Default::default()
        };
        for r in [connect(&udp, &opts).err(), list(&udp, &opts).err()] {
            assert!(
                matches!(&r, Some(Error::Usage(m)) if m.contains("needs a key")),
                "{r:?}"
            );
        }
        let nvme = Url::parse("nvme-tcp://127.0.0.1:9/").unwrap();
        let plain = ConnectOptions::default();
        for r in [list(&nvme, &plain).err(), stats(&nvme, &plain).err()] {
            assert!(
                matches!(&r, Some(Error::Usage(m)) if m.contains("nvme discover")),
                "{r:?}"
            );
        }
    }

    /// A BUSY refusal stays a BUSY status with the target's reason, so a HELLO replacing a
    /// queue waits it out (`connect`) whatever the target said; other refusals with a reason
    /// are authentication errors.
    #[test]
    fn a_busy_refusal_with_a_reason_stays_busy() {
        let a = auth::Attempt::new("t".into(), "d", &ConnectOptions::default(), 0, 0).unwrap();
        let e = a.refused(Status::Busy, b"still running");
        assert!(
            matches!(&e, Error::Status { status: Status::Busy, what } if what.contains("still running")),
            "{e:?}"
        );
        let e = a.refused(Status::Access, b"not you");
        assert!(
            matches!(&e, Error::Auth(m) if m.contains("not you")),
            "{e:?}"
        );
    }

    #[test]
    fn a_target_may_grant_less_than_asked_never_more() {
        let opts = ConnectOptions {
            queues: 4,
            depth: 32,
            max_io: 1 << 20,
            ..Default::default()
        };
        assert!(check_grant(&opts, 0, &granted(4, 32, 1 << 20, 1 << 20)).is_ok());
        assert!(check_grant(&opts, 0, &granted(1, 8, 65536, 65536)).is_ok());
        assert!(check_grant(&opts, 1448, &granted(2, 16, 65536, 1448)).is_ok());
        assert!(
            check_grant(&opts, 400, &granted(2, 16, 65536, 512)).is_ok(),
            "512 is the floor"
        );
        for (bad, what) in [
            (granted(64, 32, 1 << 20, 0), "queues"),
            (granted(4, 1024, 1 << 20, 0), "depth"),
            (granted(4, 32, 32 << 20, 0), "max I/O"),
            (granted(0, 32, 1 << 20, 0), "no queue"),
        ] {
            let e = check_grant(&opts, 0, &bad).unwrap_err();
            assert!(matches!(e, Error::Protocol(_)), "{what}: {e}");
        }
        assert!(
            check_grant(&opts, 1448, &granted(4, 32, 1 << 20, 9000)).is_err(),
            "frame"
        );
    }

    /// A datagram grant whose largest I/O takes more than 256 frames (PROTOCOL.md §9.3) is
    /// refused: its fragment index would not even fit the frame's 16-bit field at 65536.
    #[test]
    fn a_datagram_grant_of_more_than_256_fragments_a_message_is_refused() {
        let opts = ConnectOptions::default();
        assert!(check_grant(&opts, 1448, &granted(1, 8, 256 * 1448, 1448)).is_ok());
        for (max_io, frame) in [(257 * 1448, 1448), (1 << 20, 1448), (1 << 20, 1)] {
            let e = check_grant(&opts, 1448, &granted(1, 8, max_io, frame)).unwrap_err();
            assert!(
                matches!(&e, Error::Protocol(m) if m.contains("fragments")),
                "{max_io} in {frame}: {e}"
            );
        }
        assert!(
            check_grant(&opts, 0, &granted(1, 8, 1 << 20, 1 << 20)).is_ok(),
            "TCP does not fragment"
        );
    }

    /// A target trickling its HELLO reply, a byte well within the timeout each, is given up
    /// at the timeout: the read timeout bounds each read, the deadline the handshake.
    #[test]
    fn a_trickled_hello_reply_ends_at_the_timeout() {
        let url = testing::raw(|mut s| {
            let Some((h, _)) = testing::read_frame(&mut s) else {
                return;
            };
            let p = granted(1, 8, 1 << 20, 1 << 20).encode();
            let mut out = h.reply(Status::Ok, p.len() as u32).to_bytes().to_vec();
            out.extend_from_slice(&p);
            for b in out {
                // A throttle: the initiator reads whenever the byte comes.
                std::thread::sleep(Duration::from_millis(50));
                if s.write_all(&[b]).is_err() {
                    return;
                }
            }
        });
        let opts = ConnectOptions {
            timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let e = testing::fails_in_time(|| connect(&url, &opts));
        assert!(matches!(e, Error::Timeout(_)), "{e:?}");
    }

    /// The same in TLS: a target trickling a record of 16 KiB does not hold the handshake
    /// past the timeout.
    #[test]
    fn a_trickled_tls_handshake_ends_at_the_timeout() {
        let url = testing::raw(|mut s| {
            let mut hello = [0u8; 512];
            if s.read(&mut hello).is_err() {
                return;
            }
            // A handshake record header announcing 16 KiB, then its bytes slowly (8 s in all).
            let _ = s.write_all(&[0x16, 0x03, 0x03, 0x40, 0x00]);
            for _ in 0..160 {
                std::thread::sleep(Duration::from_millis(50));
                if s.write_all(&[0]).is_err() {
                    return;
                }
            }
        });
        let opts = ConnectOptions {
            timeout: Duration::from_millis(300),
            tls: true,
            ..Default::default()
        };
        let e = testing::fails_in_time(|| connect(&url, &opts));
        assert!(
            matches!(&e, Error::Tls(m) if m.contains("no answer in time")),
            "{e:?}"
        );
    }

    /// After the TLS handshake, a target trickling the record that carries its HELLO answer
    /// (a byte every 50 ms, each within the time left) does not hold the HELLO past the
    /// timeout either: a blocking TLS read would wait for the whole record.
    #[test]
    fn a_trickled_hello_over_tls_ends_at_the_timeout() {
        use openssl::ssl::Ssl;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;

        /// A socket whose writes go a byte at a time, slowly, once `slow` is set.
        struct Trickle(TcpStream, Arc<AtomicBool>);
        impl Read for Trickle {
            fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
                self.0.read(b)
            }
        }
        impl std::io::Write for Trickle {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                if !self.1.load(Ordering::Relaxed) || b.is_empty() {
                    return self.0.write(b);
                }
                std::thread::sleep(Duration::from_millis(50));
                self.0.write(&b[..1])
            }
            fn flush(&mut self) -> std::io::Result<()> {
                self.0.flush()
            }
        }
        let key = blkwire_auth::Key::generate();
        let k = key.bytes().to_vec();
        let url = testing::raw(move |s| {
            let slow = Arc::new(AtomicBool::new(false));
            let ssl = Ssl::new(&testing::psk_server(k)).unwrap();
            let Ok(mut t) = ssl.accept(Trickle(s, slow.clone())) else {
                return;
            };
            let mut hello = [0u8; HEADER_LEN];
            if t.read_exact(&mut hello).is_err() {
                return;
            }
            slow.store(true, Ordering::Relaxed);
            // 400 bytes in one record: 20 s at this pace.
            let _ = std::io::Write::write_all(&mut t, &[0u8; 400]);
        });
        let opts = ConnectOptions {
            timeout: Duration::from_millis(300),
            tls: true,
            key: Some(key),
            host_id: "h".into(),
            ..Default::default()
        };
        let e = testing::fails_in_time(|| connect(&url, &opts));
        assert!(matches!(e, Error::Timeout(_)), "{e:?}");
    }

    #[test]
    fn strings_from_a_target_reach_the_terminal_without_control_characters() {
        assert_eq!(shown("disk-0 é"), "disk-0 é");
        assert_eq!(shown("a\u{1b}[2Jb\n"), "a\\u{1b}[2Jb\\n");
        assert!(printable("disk") && !printable("x\u{7}") && !printable("x\u{9b}"));
        assert_eq!(refusal_reason(b"TLS required"), Some("TLS required"));
        assert_eq!(refusal_reason(b"bad\x1b[31m"), None);
    }

    #[test]
    fn copy_limits_too_small_to_use_are_no_copy_and_ranges_fit_a_frame() {
        let opts = ConnectOptions::default();
        let with = |max_bytes, max_range, max_ranges, frame_payload| {
            let copy = CopyLimits {
                max_bytes,
                max_range,
                max_ranges,
            };
            // On datagrams, the most a message of 256 frames holds.
            let max_io = match frame_payload {
                0 => 1 << 20,
                f => 256 * f,
            };
            let reply = HelloReply {
                copy,
                ..granted(1, 8, max_io, frame_payload)
            };
            check_grant(&opts, frame_payload, &reply).unwrap().copy
        };
        for (bytes, range, ranges, what) in [
            (1, 1, 1, "a byte per COPY"),
            (64 << 20, 256, 128, "ranges shorter than a block"),
            (32 << 10, 32 << 10, 128, "less than 64 KiB per COPY"),
            (64 << 20, 512, 1, "one block per COPY"),
        ] {
            assert_eq!(
                with(bytes, range, ranges, 0),
                CopyLimits::default(),
                "{what}"
            );
        }
        let fine = CopyLimits {
            max_bytes: 64 << 20,
            max_range: 64 << 20,
            max_ranges: 1000,
        };
        let got = with(fine.max_bytes, fine.max_range, fine.max_ranges, 0);
        assert_eq!(
            got.max_ranges,
            CopyDescriptor::ranges_fitting(1 << 20).min(1000)
        );
        // A datagram session's descriptor fits one frame's payload.
        let got = with(fine.max_bytes, fine.max_range, fine.max_ranges, 1448);
        assert_eq!(
            (got.max_bytes, got.max_ranges),
            (64 << 20, CopyDescriptor::ranges_fitting(1448))
        );
    }
}
