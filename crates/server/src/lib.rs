//! The blkwire target: listeners accept connections, a short-lived handshake thread admits each
//! one (HELLO/JOIN/LIST, PROTOCOL.md §2), and the admitted queue is handed by message to one of
//! the reactor threads, which owns it from then on (see `reactor/` and docs/ARCHITECTURE.md).

#![deny(missing_docs)]

mod access;
mod advertise;
mod budget;
mod bufpool;
mod control;
mod dgram;
mod executor;
pub mod frontend;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod iscsi;
pub mod log;
mod metrics;
mod nbd;
pub mod nvme;
mod ports;
mod reactor;
pub mod reservations;
mod rpc;
mod session;
mod snapshot;
mod stats;
mod tls;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkwire_backend::{Export, ExportSpec};
use blkwire_wire::{ExportEntry, Header, Hello, Opcode, Status, HEADER_LEN};

use crate::log::{Level, Throttle};
pub use budget::Reservation;
pub use control::{
    config_text, parse_config, write_config, write_private, Call, Options, RpcError,
    MAX_CONFIG_FILE, MIN_MEMORY,
};
use frontend::StreamFrontend;
use reactor::{Msg, NewQueue, Reactor};
pub use rpc::{
    decode as decode_rpc_request, permitted as control_peer_permitted,
    MAX_REQUEST as MAX_RPC_REQUEST,
};
pub use session::Limits;
use session::{HelloAnswer, Registry};
use snapshot::Snapshot;
use stats::QueueStats;
use tls::{Tls, TlsStream};
pub use tls::{TlsMode, TlsSettings};

/// Largest handshake payload accepted (a HELLO is at most ~530 bytes).
const MAX_HANDSHAKE_PAYLOAD: u32 = 4096;

/// A blocking socket whose every read and write must be done by `deadline`, however the peer
/// trickles its bytes: a timeout per call would let one byte every few seconds hold the thread
/// serving it for ever. A handshake has one deadline ([`Admission`]); an NVMe/TCP admin queue
/// sets one for each PDU and command (`nvme::admin`); a control-socket client one for each
/// request line and each reply (`rpc`).
pub(crate) struct Bounded<S = TcpStream> {
    pub(crate) s: S,
    pub(crate) deadline: Instant,
}

/// A blocking socket whose calls take timeouts ([`Bounded`]).
pub(crate) trait Timed: Read + Write {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl Timed for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        std::os::unix::net::UnixStream::set_write_timeout(self, t)
    }
}

/// Most bytes one write of a [`Bounded`] socket hands the kernel: a Unix socket's send
/// timeout bounds each wait for room within one `write`, not the call, so a reader taking a
/// little every so often kept one large write going for hours past the deadline.
const BOUNDED_WRITE: usize = 16 << 10;

impl<S> Bounded<S> {
    /// Time left, or a TimedOut error once the deadline has passed.
    pub(crate) fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "not finished in time",
            ));
        }
        Ok(left)
    }
}

impl<S: Timed> Read for Bounded<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf)
    }
}

impl<S: Timed> Write for Bounded<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.s.set_write_timeout(Some(left))?;
        self.s.write(&buf[..buf.len().min(BOUNDED_WRITE)])
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

/// A connection being admitted: every read and write must be done by its deadline (`s`).
pub(crate) struct Admission {
    s: Bounded,
    /// The TLS session once one was negotiated: every later byte goes through it.
    tls: Option<Box<TlsStream>>,
}

impl Admission {
    /// Time left, or a TimedOut error once the deadline has passed.
    fn left(&self) -> std::io::Result<Duration> {
        self.s
            .left()
            .map_err(|e| std::io::Error::new(e.kind(), "handshake not finished in time"))
    }

    /// When the handshake must be over.
    fn deadline(&self) -> Instant {
        self.s.deadline
    }

    /// The socket.
    fn socket(&self) -> &TcpStream {
        &self.s.s
    }
}

/// The connection a handshake runs over: a socket with its deadline ([`Admission`]), or a
/// fuzz target's byte stream (`fuzzing`).
pub(crate) trait Handshake: Read + Write {
    /// Whether the connection is encrypted from here on.
    fn is_tls(&self) -> bool;
    /// Runs the TLS handshake (server side). Returns the host id the client proved with its
    /// PSK and that key, if it used one.
    fn start_tls(&mut self, tls: &Tls) -> Result<Option<tls::PskHost>, String>;
}

impl Handshake for Admission {
    fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Sends everything after the handshake through the session.
    fn start_tls(&mut self, tls: &Tls) -> Result<Option<tls::PskHost>, String> {
        let (session, host) = tls.accept(self.socket().as_raw_fd(), self.deadline())?;
        self.tls = Some(Box::new(session));
        Ok(host)
    }
}

impl Read for Admission {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.left()?;
        if let Some(t) = &mut self.tls {
            // The session's transport waits for the socket until the deadline itself.
            return t.read(buf);
        }
        self.s.read(buf)
    }
}

impl Write for Admission {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.left()?;
        if let Some(t) = &mut self.tls {
            return t.write(buf);
        }
        self.s.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

/// Everything `serve` was asked for on its command line, which [`TargetConfig::calls`] turns
/// into the same calls a config file holds (docs/MANAGEMENT.md).
#[derive(Clone, Debug, Default)]
pub struct TargetConfig {
    /// Threads, limits, TLS: fixed at start.
    pub options: Options,
    /// `--listen` URLs.
    pub listen: Vec<String>,
    /// `--export NAME=BACKEND[,ro]`, in order (the first is NBD's default export).
    pub exports: Vec<ExportSpec>,
    /// `--keys FILE`: the hosts this target knows and their pre-shared keys (native handshake,
    /// PROTOCOL.md §12, and TLS-PSK). With any, unknown hosts are refused.
    pub keys: Option<PathBuf>,
    /// `--admin HOST`: proven hosts that may read STATS on a target with keys.
    pub admins: Vec<String>,
    /// `--metrics ADDR:PORT`: the Prometheus endpoint.
    pub metrics: Option<String>,
    /// `--subsystem`: NVMe/TCP subsystems of several exports, after the exports.
    pub subsystems: Vec<nvme::SubsystemSpec>,
    /// `--iscsi-target`: iSCSI targets of several LUNs, after the exports.
    pub iscsi_targets: Vec<iscsi::targets::TargetSpec>,
}

impl TargetConfig {
    /// The calls that build this target, after `target_options`: keys, admins, exports,
    /// listeners.
    pub fn calls(&self) -> Vec<Call> {
        let mut calls = Vec::new();
        if let Some(k) = &self.keys {
            calls.push(Call::new("keys_load", serde_json::json!({ "path": k })));
        }
        if !self.admins.is_empty() {
            calls.push(Call::new(
                "admins_set",
                serde_json::json!({ "hosts": self.admins }),
            ));
        }
        for e in &self.exports {
            calls.push(Call::new(
                "export_add",
                serde_json::json!({ "name": e.name, "spec": e.options() }),
            ));
        }
        for s in &self.subsystems {
            calls.extend(s.calls());
        }
        for t in &self.iscsi_targets {
            calls.extend(t.calls());
        }
        for l in &self.listen {
            calls.push(Call::new("listener_add", serde_json::json!({ "url": l })));
        }
        if let Some(m) = &self.metrics {
            calls.push(Call::new(
                "metrics_listen",
                serde_json::json!({ "addr": m }),
            ));
        }
        calls
    }
}

struct Worker {
    tx: Sender<Msg>,
    wake: OwnedFd,
}

/// What the accept loop, the control socket and the reactors' owner share: the registry, the
/// way to each reactor, the listeners. Control path only.
pub(crate) struct Shared {
    registry: Arc<Registry>,
    workers: Vec<Worker>,
    tls: Arc<Tls>,
    options: Options,
    /// Where `keys_load` read the keys (saved in the config).
    keys_path: Mutex<Option<PathBuf>>,
    listeners: Mutex<Listeners>,
    /// Written when `listeners` changes: the accept loop polls the new set.
    changed: OwnedFd,
    stop: Arc<OwnedFd>,
    /// `run` has begun: changes from now on are logged (at start, `serve` sums them up in one
    /// line, and a bad flag's error stays the only line).
    serving: std::sync::atomic::AtomicBool,
    /// The metrics endpoint's bound `ADDR:PORT`, once `metrics_listen` opened it.
    metrics: Mutex<Option<String>>,
    /// Calls run one at a time (`control::dispatch`, `control::apply`).
    calls: control::OneAtATime,
}

#[derive(Default)]
struct Listeners {
    list: Vec<Listener>,
    next_id: u32,
}

struct Listener {
    id: u32,
    /// The URL asked for, and the one bound (with the real port when 0 was asked for).
    asked: String,
    url: String,
    /// Stream listeners' sockets; datagram listeners' sockets belong to the reactors.
    stream: Option<(Arc<TcpListener>, ListenerKind)>,
}

impl Listener {
    fn kind(&self) -> &'static str {
        match &self.stream {
            Some((_, ListenerKind::Native)) => "tcp",
            Some((_, ListenerKind::Nbd)) => "nbd",
            Some((_, ListenerKind::NvmeTcp)) => "nvme-tcp",
            Some((_, ListenerKind::Iscsi)) => "iscsi",
            None if self.url.starts_with("udp://") => "udp",
            None => "eth",
        }
    }

    /// The URL that opens this listener again (`save_config`): the bound one (a port the
    /// kernel picked stays the one clients were told), but for raw Ethernet the one asked
    /// for, whose EtherType and qdisc options the bound `eth://IFACE/MAC` does not carry.
    fn config_url(&self) -> &str {
        match self.kind() {
            "eth" => &self.asked,
            _ => &self.url,
        }
    }

    /// Whether this datagram listener already serves what `d` asks for: the same UDP
    /// address (however it was spelt), or the same interface and EtherType (a second packet
    /// socket would hear every frame the first does, and answer its sessions' frames with
    /// ACCESS, knowing none of them).
    fn serves(&self, d: &ports::DgramListen) -> bool {
        match (d, ports::parse(&self.asked)) {
            (ports::DgramListen::Udp(a), _) => a.port() != 0 && self.url == format!("udp://{a}"),
            (
                ports::DgramListen::Eth {
                    iface, ethertype, ..
                },
                Some(Ok(ports::DgramListen::Eth {
                    iface: i,
                    ethertype: e,
                    ..
                })),
            ) => (iface, ethertype) == (&i, &e),
            _ => false,
        }
    }
}

impl Shared {
    /// The level a change is logged at: info once serving, debug while starting.
    fn change_level(&self) -> Level {
        if self.serving.load(std::sync::atomic::Ordering::Relaxed) {
            Level::Info
        } else {
            Level::Debug
        }
    }

    /// Tells every reactor export `name` was removed (`Msg::ExportRemoved`).
    fn export_removed(&self, name: &str) {
        let name: Arc<str> = name.into();
        self.tell_reactors(|| Msg::ExportRemoved(name.clone()));
    }

    /// Sends every reactor the message `msg` makes and wakes it (one that has stopped is
    /// passed over).
    fn tell_reactors(&self, msg: impl Fn() -> Msg) {
        for w in &self.workers {
            if w.tx.send(msg()).is_ok() {
                eventfd_write(w.wake.as_raw_fd());
            }
        }
    }

    /// Closes every queue of these sessions, on whichever reactor serves them.
    fn close_sessions(&self, sessions: &[u32]) {
        if sessions.is_empty() {
            return;
        }
        let workers = self.workers.iter().map(|w| (&w.tx, w.wake.as_raw_fd()));
        close_on_reactors(workers, sessions);
    }

    fn lock_listeners(&self) -> std::sync::MutexGuard<'_, Listeners> {
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a listener (`listener_add`): a stream socket the accept loop polls from now on, or
    /// one datagram socket per reactor. Returns the bound URL.
    fn add_listener(&self, url: &str) -> Result<String, RpcError> {
        let bad = |m: String| RpcError {
            code: RpcError::INVALID_PARAMS,
            message: m,
        };
        let refused = |m: String| RpcError {
            code: RpcError::REFUSED,
            message: m,
        };
        // The bound URL only: asking twice for port 0 is two listeners, and any other address
        // taken twice is refused by the bind itself.
        if self.lock_listeners().list.iter().any(|l| l.url == url) {
            return Err(refused(format!("already listening on {url}")));
        }
        let id;
        let bound = if let Some(d) = ports::parse(url) {
            let d = d.map_err(bad)?;
            let full = |ls: &Listeners| {
                if let Some(l) = ls.list.iter().find(|l| l.stream.is_none() && l.serves(&d)) {
                    return Some(refused(format!(
                        "already listening on {url} (as {})",
                        l.url
                    )));
                }
                let datagram = ls.list.iter().filter(|l| l.stream.is_none()).count();
                (datagram >= reactor::MAX_PORTS).then(|| {
                    refused(format!(
                        "already {datagram} datagram listeners (udp://, eth://), the most a \
                         target serves at once: remove one first (listener_remove)"
                    ))
                })
            };
            if let Some(e) = full(&self.lock_listeners()) {
                return Err(e);
            }
            let (setups, bound) = match &d {
                ports::DgramListen::Udp(a) => ports::open_udp(*a, self.workers.len()),
                ports::DgramListen::Eth {
                    iface,
                    ethertype,
                    bypass_qdisc,
                } => ports::open_eth(iface, *ethertype, *bypass_qdisc, self.workers.len()),
            }
            .map_err(refused)?;
            let mut ls = self.lock_listeners();
            // Again under the lock the listener goes in under: two adds at once.
            if let Some(e) = full(&ls) {
                return Err(e);
            }
            id = ls.next_id;
            ls.next_id += 1;
            for (w, setup) in self.workers.iter().zip(setups) {
                w.tx.send(Msg::Port(setup, id))
                    .map_err(|_| refused("a reactor thread died".into()))?;
                eventfd_write(w.wake.as_raw_fd());
            }
            ls.list.push(Listener {
                id,
                asked: url.to_string(),
                url: bound.clone(),
                stream: None,
            });
            bound
        } else {
            let (frontend, addrs) = parse_listen(url).map_err(bad)?;
            if frontend == ListenerKind::NvmeTcp && self.registry.limits().max_io < 8192 {
                // MDTS counts 4 KiB pages as a power of two and 0 means no limit: 4 KiB cannot
                // be said, and hosts would send what the target must refuse.
                return Err(bad(format!(
                    "{url}: NVMe/TCP needs --max-io of at least 8K (this target has {}): \
                     NVMe cannot advertise a limit of one 4 KiB page",
                    blkwire_backend::format_size(u64::from(self.registry.limits().max_io))
                )));
            }
            let l = TcpListener::bind(&addrs[..])
                .map_err(|e| refused(format!("cannot listen on {url}: {e}")))?;
            let local = l.local_addr().map_err(|e| refused(format!("{url}: {e}")))?;
            let scheme = match frontend {
                ListenerKind::Native => "tcp",
                ListenerKind::Nbd => "nbd",
                ListenerKind::NvmeTcp => "nvme-tcp",
                ListenerKind::Iscsi => "iscsi",
            };
            let bound = format!("{scheme}://{local}");
            let mut ls = self.lock_listeners();
            id = ls.next_id;
            ls.next_id += 1;
            if frontend == ListenerKind::NvmeTcp {
                self.registry.nvme.add_listener(id, local);
            }
            if frontend == ListenerKind::Iscsi {
                self.registry.iscsi.add_listener(id, local);
            }
            ls.list.push(Listener {
                id,
                asked: url.to_string(),
                url: bound.clone(),
                stream: Some((Arc::new(l), frontend)),
            });
            drop(ls);
            eventfd_write(self.changed.as_raw_fd());
            bound
        };
        if !self.registry.access.has_keys() && !is_loopback_url(&bound) {
            crate::log!(
                Level::Warn,
                "{bound} is reachable from the network and any host may use every export: \
                 add --keys FILE (blkwire key gen) or allow= rules before serving real data"
            );
        }
        // What --tls require does not cover, said as such a listener opens.
        let scheme = bound.split("://").next().unwrap_or_default();
        let uncovered = match scheme {
            "nvme-tcp" | "iscsi" => Some(
                ": --tls require covers tcp:// and nbd:// only (blkwire has no NVMe/TCP or \
                 iSCSI TLS); serve it on a trusted network, or leave this listener out",
            ),
            "udp" | "eth" => Some(
                " unless a host asks for encryption (?encrypt=1, --encrypt): --tls require \
                 covers tcp:// and nbd:// only; datagram sessions are sealed with the host's key \
                 but their data is readable",
            ),
            _ => None,
        };
        if let Some(why) = uncovered.filter(|_| self.tls.mode == TlsMode::Require) {
            crate::log!(Level::Warn, "{bound} carries its exports in clear{why}");
        }
        crate::log!(self.change_level(), "listening on {bound} (listener {id})");
        Ok(bound)
    }

    /// Closes a listener (`listener_remove`), named by the URL asked for or the one bound.
    /// Stream connections it accepted carry on; datagram sessions on it end with its sockets.
    fn remove_listener(&self, url: &str) -> Result<String, String> {
        let mut ls = self.lock_listeners();
        let at = ls
            .list
            .iter()
            .position(|l| l.asked == url || l.url == url)
            .ok_or_else(|| {
                format!("no listener {url} (`blkwire listener ls` or listener_list shows them)")
            })?;
        let l = ls.list.remove(at);
        drop(ls);
        self.registry.nvme.remove_listener(l.id);
        self.registry.iscsi.remove_listener(l.id);
        if l.stream.is_some() {
            eventfd_write(self.changed.as_raw_fd());
        } else {
            self.tell_reactors(|| Msg::ClosePort(l.id));
        }
        crate::log!(Level::Info, "stopped listening on {}", l.url);
        Ok(l.url)
    }

    /// Each listener's bound URL and kind, in the order they were added.
    fn listener_urls(&self) -> Vec<(String, &'static str)> {
        self.lock_listeners()
            .list
            .iter()
            .map(|l| (l.url.clone(), l.kind()))
            .collect()
    }

    /// The stream listeners to accept on, and their poll set: one entry each, then the stop
    /// eventfd, then the listeners-changed eventfd.
    #[allow(clippy::type_complexity)]
    fn poll_set(&self) -> (Vec<(Arc<TcpListener>, ListenerKind)>, Vec<libc::pollfd>) {
        let live: Vec<_> = self
            .lock_listeners()
            .list
            .iter()
            .filter_map(|l| l.stream.clone())
            .collect();
        let mut fds: Vec<libc::pollfd> = live
            .iter()
            .map(|(l, _)| l.as_raw_fd())
            .chain([self.stop.as_raw_fd(), self.changed.as_raw_fd()])
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        fds.shrink_to_fit();
        (live, fds)
    }

    /// The `stats` method: the STATS document with its sessions paged (`offset`, at most
    /// `limit`), never cut short.
    fn stats_page(&self, offset: usize, limit: usize) -> serde_json::Value {
        let workers: Vec<(Sender<Msg>, i32)> = self
            .workers
            .iter()
            .map(|w| (w.tx.clone(), w.wake.as_raw_fd()))
            .collect();
        let doc = stats_json(&self.registry, &workers, usize::MAX);
        let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap_or_default();
        let sessions = v["sessions"].as_array().cloned().unwrap_or_default();
        let total = sessions.len();
        let page: Vec<_> = sessions.into_iter().skip(offset).take(limit).collect();
        // Checked: `offset + limit` overflows for a limit of "everything" (usize::MAX).
        let next = offset.checked_add(limit).filter(|&n| n < total);
        v["sessions"] = page.into();
        v["offset"] = offset.into();
        v["total"] = total.into();
        v["next"] = next.into();
        v
    }
}

/// A running target: reactors started, configured by calls ([`Target::call`]); [`Target::run`]
/// accepts connections until stopped.
pub struct Target {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// The control socket, when one was opened.
    rpc: Option<rpc::ControlSocket>,
}

/// Why a target cannot start, or stopped serving. Each message is one line that says what was
/// wrong and, where the user can, what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The configuration cannot be served: no exports, an export or listen address that is
    /// malformed or names something that cannot be opened.
    Config(String),
    /// A listener could not be opened or bound (address in use, not local, no permission).
    Listen(String),
    /// The system refused something the target needs (io_uring, an eventfd, a thread, poll).
    System(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Config(m) | Error::Listen(m) | Error::System(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

/// Stops a running target from another thread or a signal handler thread.
#[derive(Clone)]
pub struct StopHandle(Arc<OwnedFd>);

impl StopHandle {
    /// Asks [`Target::run`] to drain and return.
    pub fn stop(&self) {
        eventfd_write(self.0.as_raw_fd());
    }
}

fn eventfd() -> Result<OwnedFd, Error> {
    // SAFETY: creating a new fd.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::System(format!("eventfd: {e}")));
    }
    // SAFETY: we own the new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn eventfd_read(fd: i32) {
    let mut v: u64 = 0;
    // SAFETY: 8-byte read from an eventfd into a local.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

fn eventfd_write(fd: i32) {
    let one: u64 = 1;
    // SAFETY: 8-byte write to an eventfd.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// The address a host is told to connect to for a listener bound to `bound` (discovery logs,
/// SendTargets): `local`, the address the host reached us at, stands in for a wildcard, since
/// the host can reach that one again. An IPv4 host that reached a dual-stack `[::]` listener
/// shows as `::ffff:a.b.c.d`: it is told `a.b.c.d` (an IPv4 entry, which its tools compare
/// with the address they connected to). None for a `0.0.0.0` listener and a host that came
/// over IPv6: that listener does not serve the address the host knows.
pub(crate) fn reachable_address(bound: SocketAddr, local: IpAddr) -> Option<SocketAddr> {
    if !bound.ip().is_unspecified() {
        return Some(bound);
    }
    let local = access::canonical_ip(local);
    if bound.is_ipv4() && local.is_ipv6() {
        return None;
    }
    Some(SocketAddr::new(local, bound.port()))
}

/// Which protocol a stream listener speaks (which handshake admits its connections).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ListenerKind {
    /// blkwire's own protocol (`tcp://`).
    Native,
    /// NBD fixed newstyle (`nbd://`), for stock clients.
    Nbd,
    /// NVMe/TCP (`nvme-tcp://`), for the kernel's nvme-tcp host and nvme-cli.
    NvmeTcp,
    /// iSCSI (`iscsi://`), for open-iscsi, libiscsi and other initiators.
    Iscsi,
}

/// `ADDR[:PORT]` of a listen URL `url` as `to_socket_addrs` takes it, `port` added when none
/// is given: an IPv6 address in brackets, a port of digits (0: any free one), no export.
pub(crate) fn listen_authority(url: &str, rest: &str, port: u16) -> Result<String, String> {
    let bad = |why: String| Err(format!("bad listen address '{url}': {why}"));
    if rest.contains('/') {
        return bad("a listener names no export (leave out '/...')".into());
    }
    let (host, given) = if let Some(v6) = rest.strip_prefix('[') {
        let Some((h, after)) = v6.split_once(']') else {
            return bad("unclosed '[' in IPv6 address".into());
        };
        match after {
            "" => (format!("[{h}]"), None),
            _ => match after.strip_prefix(':') {
                Some(p) => (format!("[{h}]"), Some(p)),
                None => return bad(format!("junk after ']': '{after}'")),
            },
        }
    } else if rest.matches(':').count() > 1 {
        return bad(
            "an IPv6 address goes in brackets, the port after them, e.g. [::1]:7700 or [::]".into(),
        );
    } else {
        match rest.split_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (rest.to_string(), None),
        }
    };
    let port = match given {
        None => port,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if p.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => return bad(format!("bad port '{p}' (0 to 65535; 0 takes any free one)")),
        },
    };
    Ok(format!("{host}:{port}"))
}

/// Parses `tcp://ADDR[:PORT]` (7700 by default, the port initiators assume), `nbd://ADDR[:PORT]`
/// (10809), `nvme-tcp://ADDR[:PORT]` (4420) or `iscsi://ADDR[:PORT]` (3260).
fn parse_listen(url: &str) -> Result<(ListenerKind, Vec<SocketAddr>), String> {
    let help = "expected tcp://ADDR[:PORT], nbd://ADDR[:PORT], nvme-tcp://ADDR[:PORT], \
                iscsi://ADDR[:PORT], udp://ADDR[:PORT] or eth://IFACE, e.g. tcp://0.0.0.0:7700, \
                nbd://0.0.0.0, tcp://[::1]:7700";
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("bad listen address '{url}': {help}"));
    };
    let (kind, port) = match scheme {
        "tcp" => (ListenerKind::Native, 7700),
        "nbd" => (ListenerKind::Nbd, 10809),
        "nvme-tcp" => (ListenerKind::NvmeTcp, 4420),
        "iscsi" => (ListenerKind::Iscsi, blkwire_wire::iscsi::DEFAULT_PORT),
        _ => return Err(format!("bad listen address '{url}': {help}")),
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() {
        return Err(format!("bad listen address '{url}': no address; {help}"));
    }
    let addr = listen_authority(url, rest, port)?;
    let addrs = addr
        .to_socket_addrs()
        .map_err(|e| format!("listen address '{url}': cannot resolve {addr}: {e}"))?
        .collect::<Vec<_>>();
    if addrs.is_empty() {
        return Err(format!(
            "listen address '{url}': {addr} resolves to no address"
        ));
    }
    Ok((kind, addrs))
}

impl Target {
    /// Starts the reactors with these options. The target has no exports and no listeners
    /// until calls add them ([`Target::apply`]); nothing is accepted until [`Target::run`].
    pub fn start(options: &Options) -> Result<Target, Error> {
        let keys: access::SharedKeys = Default::default();
        let tls = Arc::new(Tls::build(&options.tls, &keys)?);
        let access = access::Access::new(keys);
        let registry = Arc::new(Registry::new(access, options.limits));
        let threads = if options.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            options.threads
        };
        let mut workers = Vec::new();
        let mut handles = Vec::new();
        for i in 0..threads {
            let (tx, rx) = mpsc::channel();
            let wake = eventfd()?;
            let wake2 = wake
                .try_clone()
                .map_err(|e| Error::System(format!("eventfd: {e}")))?;
            // The reactor is built on its own thread: its ring and queues never leave it.
            let (ready_tx, ready_rx) = mpsc::channel();
            let (registry2, poll) = (registry.clone(), options.poll);
            let handle = std::thread::Builder::new()
                .name(format!("blkwire-q{i}"))
                .spawn(move || match Reactor::new(i, rx, wake2, registry2, poll) {
                    Ok(r) => {
                        let _ = ready_tx.send(Ok(()));
                        r.run()
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                })
                .map_err(|e| Error::System(format!("cannot start a reactor thread: {e}")))?;
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(Error::System(format!(
                        "cannot create io_uring (is io_uring disabled?): {e}"
                    )))
                }
                Err(_) => return Err(Error::System("reactor thread died while starting".into())),
            }
            workers.push(Worker { tx, wake });
            handles.push(handle);
        }
        // Ways to every reactor for the registry's own messages (their own copies of the
        // wake-up eventfds: they live as long as the registry).
        let reactors = || -> Result<Vec<(Sender<Msg>, OwnedFd)>, Error> {
            workers
                .iter()
                .map(|w| {
                    let wake = w.wake.try_clone();
                    Ok((
                        w.tx.clone(),
                        wake.map_err(|e| Error::System(format!("eventfd: {e}")))?,
                    ))
                })
                .collect()
        };
        // PERSISTENT RESERVE OUT reaches every reactor from whichever serves it.
        registry.reservations.set_reactors(reactors()?);
        // A HELLO that replaces a queue (PROTOCOL.md §2.6) has it closed on whichever reactor
        // serves it: all are told, as for `close_sessions`.
        let closers = reactors()?;
        registry.set_queue_closer(Box::new(move |session, queue| {
            for (tx, wake) in &closers {
                if tx.send(Msg::CloseQueue { session, queue }).is_ok() {
                    eventfd_write(wake.as_raw_fd());
                }
            }
        }));
        Ok(Target {
            shared: Arc::new(Shared {
                registry,
                workers,
                tls,
                options: options.clone(),
                keys_path: Mutex::new(None),
                listeners: Mutex::new(Listeners::default()),
                changed: eventfd()?,
                stop: Arc::new(eventfd()?),
                serving: Default::default(),
                metrics: Mutex::new(None),
                calls: Default::default(),
            }),
            handles,
            rpc: None,
        })
    }

    /// Starts a target as `serve`'s flags describe it and checks it can serve (exports and
    /// listeners present, TLS credentials).
    pub fn bind(cfg: &TargetConfig) -> Result<Target, Error> {
        let t = Target::start(&cfg.options)?;
        t.apply(&cfg.calls(), None)?;
        t.check_ready(false)?;
        Ok(t)
    }

    /// Runs one call (a method and its parameters) on the running target.
    pub fn call(
        &self,
        method: &str,
        params: serde_json::Value,
    ) -> Result<serde_json::Value, RpcError> {
        control::dispatch(&self.shared, method, params)
    }

    /// Applies calls in order; the first that fails stops the rest. `source` names a config
    /// file the calls come from (its errors then say which call failed); `None` for calls made
    /// from command-line flags.
    pub fn apply(&self, calls: &[Call], source: Option<&str>) -> Result<(), Error> {
        control::apply(&self.shared, calls, source.is_some()).map_err(|(method, e)| {
            let message = match source {
                Some(src) => format!("{src}: {}", e.message),
                None => e.message,
            };
            if method == "listener_add" && e.code == RpcError::REFUSED {
                Error::Listen(message)
            } else {
                Error::Config(message)
            }
        })
    }

    /// Whether the target, as configured so far, can serve: TLS has credentials, and there is
    /// something to serve and somewhere to serve it, unless a control socket (`control`) can
    /// add them later.
    pub fn check_ready(&self, control: bool) -> Result<(), Error> {
        let sh = &self.shared;
        sh.tls.check_credentials(sh.registry.access.has_keys())?;
        if control {
            return Ok(());
        }
        if sh.registry.exports().is_empty() {
            return Err(Error::Config(
                "no exports: add at least one --export NAME=BACKEND, e.g. --export disk0=mem:1G"
                    .into(),
            ));
        }
        if sh.lock_listeners().list.is_empty() {
            return Err(Error::Config("nothing to listen on: add --listen tcp://ADDR[:PORT] (or nbd://, udp://, eth://IFACE)".into()));
        }
        Ok(())
    }

    /// Opens the control socket at `path` (docs/MANAGEMENT.md). Returns its path.
    pub fn open_control_socket(&mut self, path: &std::path::Path) -> Result<(), Error> {
        self.rpc = Some(rpc::ControlSocket::open(path, self.shared.clone())?);
        Ok(())
    }

    /// The URLs actually bound (with the real port when 0 was asked for).
    pub fn urls(&self) -> Vec<String> {
        self.shared
            .listener_urls()
            .into_iter()
            .map(|(u, _)| u)
            .collect()
    }

    /// A handle that stops [`Target::run`] from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.shared.stop.clone())
    }

    /// The exports served now.
    pub fn exports(&self) -> Vec<Arc<Export>> {
        self.shared.registry.exports()
    }

    /// The running state as calls (what `save_config` writes).
    pub fn running_config(&self) -> Vec<Call> {
        let _turn = self.shared.calls.turn();
        control::running_config(&self.shared)
    }

    /// Accepts connections until stopped, then drains: requests already received are answered,
    /// then every queue closes and the reactors exit.
    pub fn run(self) -> Result<(), Error> {
        self.shared
            .serving
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let (mut live, mut fds) = self.shared.poll_set();
        let mut stop_at = live.len();
        let workers: Arc<Vec<(Sender<Msg>, i32)>> = Arc::new(
            self.shared
                .workers
                .iter()
                .map(|w| (w.tx.clone(), w.wake.as_raw_fd()))
                .collect(),
        );
        // While accept() fails for lack of descriptors or memory, the listeners stay readable:
        // they are left out of the poll for a while instead of spinning (and logging) on them.
        let mut paused_until: Option<Instant> = None;
        let limits = self.shared.registry.limits();
        let handshakes = Arc::new(Handshakes::new(limits.max_handshakes));
        let mut cut = 0u64;
        let connections = Arc::new(Connections::new(
            limits.max_connections,
            limits.max_connections_per_host,
        ));
        let mut refused = Throttle::new();
        let (mut shed, mut last_shed) = (0u64, None::<Instant>);
        let mut failed = Throttle::new();
        'accept: loop {
            let mut timeout = -1;
            if let Some(until) = paused_until {
                let now = Instant::now();
                if now >= until {
                    paused_until = None;
                    fds[..stop_at]
                        .iter_mut()
                        .for_each(|p| p.events = libc::POLLIN);
                } else {
                    timeout = (until - now).as_millis().max(1) as libc::c_int;
                }
            }
            // SAFETY: poll over our own pollfd array.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(Error::System(format!("poll: {e}")));
            }
            for i in 0..fds.len() {
                if fds[i].revents == 0 {
                    continue;
                }
                if i == stop_at {
                    break 'accept;
                }
                if i == stop_at + 1 {
                    // Listeners were added or removed: poll the new set.
                    eventfd_read(self.shared.changed.as_raw_fd());
                    (live, fds) = self.shared.poll_set();
                    stop_at = live.len();
                    paused_until = None;
                    continue 'accept;
                }
                match live[i].0.accept() {
                    Ok((stream, peer)) => {
                        let counted = match connections.admit(access::canonical_ip(peer.ip())) {
                            Ok(c) => c,
                            Err(limit) => {
                                // Closed at once, before any thread or buffer is spent on it.
                                if let Some(n) = refused.hit() {
                                    crate::log!(
                                        Level::Warn,
                                        "{limit}: closed {n} new connection(s), the latest from \
                                         {peer}"
                                    );
                                }
                                continue;
                            }
                        };
                        let max = handshakes.max;
                        let (in_progress, was_cut) = match handshakes.admit(stream.as_raw_fd()) {
                            Some(admitted) => admitted,
                            None => {
                                // Closed at once: a flood of connections that never finish
                                // their handshake cannot take a thread each.
                                shed += 1;
                                (None, false)
                            }
                        };
                        cut += u64::from(was_cut);
                        if (shed > 0 || cut > 0)
                            && last_shed.is_none_or(|t| t.elapsed() >= Throttle::EVERY)
                        {
                            let cut_said = if cut > 0 {
                                format!(" and cut {cut} that took over {} s", CUT_AFTER.as_secs())
                            } else {
                                String::new()
                            };
                            crate::log!(
                                Level::Warn,
                                "{max} handshakes in progress: closed {shed} new \
                                 connection(s){cut_said}, the latest from {peer}"
                            );
                            last_shed = Some(Instant::now());
                            (shed, cut) = (0, 0);
                        }
                        let Some(in_progress) = in_progress else {
                            continue;
                        };
                        let registry = self.shared.registry.clone();
                        let workers = workers.clone();
                        let frontend = live[i].1;
                        let tls = self.shared.tls.clone();
                        // One value, so that if the thread cannot start, the place is given
                        // back before the socket closes (fields drop in order).
                        let pending = (in_progress, stream);
                        let spawned = std::thread::Builder::new().name("blkwire-hs".into()).spawn(
                            move || {
                                let (place, stream) = pending;
                                let admission = AdmissionSlots { counted, place };
                                handshake(
                                    stream, peer, frontend, &registry, &workers, &tls, admission,
                                )
                            },
                        );
                        if let Err(e) = spawned {
                            crate::log!(Level::Error, "cannot start handshake thread: {e}");
                        }
                    }
                    Err(e) if is_resource_shortage(&e) => {
                        if let Some(n) = failed.hit() {
                            crate::log!(
                                Level::Warn,
                                "accept failed {n} time(s): {e}; pausing new connections for {} \
                                 ms (raise the open-file limit, ulimit -n, or lower the load)",
                                ACCEPT_PAUSE.as_millis()
                            );
                        }
                        paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                        fds[..stop_at].iter_mut().for_each(|p| p.events = 0);
                    }
                    Err(e) => crate::log!(Level::Warn, "accept failed: {e}"),
                }
            }
        }
        crate::log!(Level::Info, "stopping: finishing requests in flight");
        drop(self.rpc);
        // After the control call running now, if any: later ones are refused (`dispatch_unless`).
        let turn = self.shared.calls.turn();
        self.shared.registry.close();
        drop(turn);
        drop(live);
        self.shared.lock_listeners().list.clear();
        self.shared.tell_reactors(|| Msg::Shutdown);
        for h in self.handles {
            let _ = h.join();
        }
        // Every queue has closed. A backend that holds acknowledged writes or a lock of its own
        // (`rbd:`: librbd's cache, the image's exclusive lock) flushes and releases them now,
        // before `serve` returns and the process exits under it (the registry, and the exports
        // with it, may outlive this: a metrics or control client thread can hold it). Several
        // at once, each bounded by its own timeouts, on at most CLOSERS threads.
        let exports = self.shared.registry.exports();
        for_each_on_threads(&exports, CLOSERS, "blkwire-close", |e| {
            if let Err(m) = e.backend().shutdown() {
                crate::log!(Level::Warn, "export '{}': {m}", e.name);
            }
        });
        // And the exports removed before, whose backends close on threads of their own.
        let left = blkwire_backend::wait_for_closes(CLOSES_WAITED);
        if left > 0 {
            crate::log!(
                Level::Warn,
                "{left} removed export(s) still closing after {}s: left (writes they held may \
                 be lost)",
                CLOSES_WAITED.as_secs()
            );
        }
        crate::log!(Level::Info, "stopped");
        Ok(())
    }
}

/// How many exports a stop closes at once: a close can wait out the backend's timeouts (`rbd:`
/// on a cluster that is gone), so one after the other could take hours with many exports, and
/// a thread each would be thousands of threads.
const CLOSERS: usize = 16;

/// Runs `f` on every item, on up to `threads` scoped threads that each take the next item not
/// yet taken, so one slow item holds up only its own thread. With no thread to be had, runs
/// them all on the caller's. An item whose `f` panics (reported by the panic hook) does not
/// keep the others from theirs.
fn for_each_on_threads<T: Sync>(items: &[T], threads: usize, name: &str, f: impl Fn(&T) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        while let Some(item) = items.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(item)));
        }
    };
    std::thread::scope(|s| {
        let spawned = (0..threads.min(items.len()))
            .filter(|_| {
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn_scoped(s, work)
                    .is_ok()
            })
            .count();
        if spawned == 0 {
            work();
        }
    });
}

/// How long a stop waits for removed exports still closing (`blkwire_backend::wait_for_closes`):
/// two of `rbd:`'s default timeouts, what one close is given.
const CLOSES_WAITED: std::time::Duration = std::time::Duration::from_secs(20);

/// Live stream connections, in total and per peer address (`--max-connections`,
/// `--max-connections-per-host`): counted when accepted, until the connection closes (its
/// [`ConnCount`] is dropped: by the handshake thread, or by the reactor that served it).
struct Connections {
    max: usize,
    per_host: usize,
    live: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One connection's place under the connection limits; dropped when the connection closes.
pub struct ConnCount {
    of: Arc<Connections>,
    ip: IpAddr,
}

impl Connections {
    fn new(max: usize, per_host: usize) -> Connections {
        Connections {
            max,
            per_host,
            live: Mutex::new((0, HashMap::new())),
        }
    }

    /// A place for a connection from `ip`, or which limit it is past.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnCount, String> {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (total, hosts) = &mut *live;
        if *total >= self.max {
            return Err(format!("{} connections open (--max-connections)", self.max));
        }
        let n = hosts.entry(ip).or_insert(0);
        if *n >= self.per_host {
            return Err(format!(
                "{} connections open from {ip} (--max-connections-per-host)",
                self.per_host
            ));
        }
        *n += 1;
        *total += 1;
        Ok(ConnCount {
            of: self.clone(),
            ip,
        })
    }
}

impl Drop for ConnCount {
    fn drop(&mut self) {
        let mut live = self.of.live.lock().unwrap_or_else(|p| p.into_inner());
        let (total, hosts) = &mut *live;
        *total -= 1;
        if let Some(n) = hosts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                hosts.remove(&self.ip);
            }
        }
    }
}

/// Handshakes in progress, one thread each, at most `max`. When every place is taken, the
/// oldest handshake, if it has run for [`CUT_AFTER`], is cut (its socket shut down) for the
/// newcomer: an initiator's handshake takes milliseconds, so a flood of connections that
/// trickle theirs cannot keep clients out, it only makes them wait its turn.
struct Handshakes {
    max: usize,
    /// (id, started, socket) of each handshake in progress, and the next id.
    live: Mutex<(Vec<InProgress>, u64)>,
}

/// A handshake in progress: its id, when it started, its socket.
type InProgress = (u64, Instant, RawFd);

/// A handshake this old gives its place to a new connection when all are taken.
const CUT_AFTER: Duration = Duration::from_secs(1);

impl Handshakes {
    fn new(max: usize) -> Handshakes {
        Handshakes {
            max,
            live: Mutex::new((Vec::new(), 0)),
        }
    }

    /// A place for the handshake of socket `fd` (and whether an old one was cut for it), or
    /// `None` when all are taken by handshakes younger than [`CUT_AFTER`].
    fn admit(self: &Arc<Self>, fd: RawFd) -> Option<(Option<HandshakeSlot>, bool)> {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (list, next) = &mut *live;
        let mut cut = false;
        if list.len() >= self.max {
            let (i, &(_, started, old)) = list.iter().enumerate().min_by_key(|(_, e)| e.1)?;
            if started.elapsed() < CUT_AFTER {
                return None;
            }
            // Under the lock: the handshake thread gives its place back (takes this lock)
            // before its socket is closed or handed on, so `old` is still its socket.
            // SAFETY: shutdown on a descriptor that is open, as above.
            unsafe { libc::shutdown(old, libc::SHUT_RDWR) };
            list.swap_remove(i);
            cut = true;
        }
        let id = *next;
        *next += 1;
        list.push((id, Instant::now(), fd));
        Some((
            Some(HandshakeSlot {
                of: self.clone(),
                id,
            }),
            cut,
        ))
    }
}

/// One handshake in progress; dropped (handshake done) gives its place back. Dropped before
/// the socket is closed or handed to a reactor (see [`Handshakes::admit`]).
struct HandshakeSlot {
    of: Arc<Handshakes>,
    id: u64,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut live = self.of.live.lock().unwrap_or_else(|p| p.into_inner());
        live.0.retain(|e| e.0 != self.id);
    }
}

/// Is a bound listener URL reachable only from this machine (a loopback address, or the
/// loopback interface)?
fn is_loopback_url(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    if url.starts_with("eth://") {
        return rest.split('/').next() == Some("lo");
    }
    let host = match rest.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => rest,
    };
    host.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// How long listeners rest after accept() ran out of descriptors or memory.
pub(crate) const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// accept() errors that will repeat until something is freed, not a problem of one connection.
pub(crate) fn is_resource_shortage(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// TCP keepalive, so a peer that vanished without a FIN (power loss, cable pulled) is noticed
/// within about a minute and its queues are released.
fn set_keepalive(s: &TcpStream) {
    let fd = s.as_raw_fd();
    blkwire_net::setopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    blkwire_net::setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30);
    blkwire_net::setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10);
    blkwire_net::setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

fn send_frame(s: &mut Admission, h: &Header, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(&h.to_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)
}

/// Closes every queue of these sessions, on whichever reactor serves them: tells each reactor
/// (its channel and wake-up eventfd). The control plane does it (`Shared::close_sessions`), and
/// so does a handshake thread whose NVMe/TCP controller ended (its I/O queues go with it).
fn close_on_reactors<'a>(
    workers: impl IntoIterator<Item = (&'a Sender<Msg>, i32)>,
    sessions: &[u32],
) {
    let ids: Arc<[u32]> = sessions.into();
    for (tx, wake) in workers {
        if tx.send(Msg::Close(ids.clone())).is_ok() {
            eventfd_write(wake);
        }
    }
}

/// Admits one connection and hands it, by message, to the reactor that will own it.
fn handshake(
    s: TcpStream,
    peer: SocketAddr,
    frontend: ListenerKind,
    registry: &Registry,
    workers: &[(Sender<Msg>, i32)],
    tls: &Tls,
    AdmissionSlots { counted, place }: AdmissionSlots,
) {
    // As the session registry names it (an IPv4-mapped address as IPv4, `PeerId::ip`).
    let peer_s = access::PeerId::ip(peer).to_string();
    let _ = s.set_nodelay(true);
    set_keepalive(&s);
    let mut s = Admission {
        s: Bounded {
            s,
            deadline: Instant::now() + registry.limits().handshake_timeout,
        },
        tls: None,
    };
    let admitted = match frontend {
        ListenerKind::Native => native_tls(&mut s, &peer_s, tls, registry).and_then(|gate| {
            native_handshake(&mut s, peer, registry, workers, gate).map(|a| {
                let fe: Box<dyn StreamFrontend> =
                    Box::new(frontend::native::Native::new(a.depth, a.max_io, a.copy));
                (a, fe, Vec::new())
            })
        }),
        ListenerKind::Nbd => {
            nbd::negotiate(&mut s, &peer_s, registry, tls).map(|(a, fe)| (a, fe, Vec::new()))
        }
        ListenerKind::NvmeTcp => {
            let local = s.socket().local_addr().unwrap_or(peer);
            match nvme::accept(&mut s, peer, local, registry) {
                Some(nvme::Accepted::Io(mut a, fe)) if !a.is_empty() => {
                    // Its first namespace's session carries the connection (placement, memory
                    // account); the others ride along as further targets.
                    let first = a.remove(0);
                    Some((first, fe, a))
                }
                Some(nvme::Accepted::Admin(q)) => {
                    // The admin queue stays on this thread for the controller's life; it no
                    // longer counts as a handshake.
                    drop(place);
                    let ended = (*q).serve(s.s, registry, &peer_s);
                    let ids: Vec<u32> = ended.sessions.iter().map(|s| s.0).collect();
                    for &s in &ids {
                        registry.revoke(s);
                    }
                    close_on_reactors(workers.iter().map(|(t, w)| (t, *w)), &ids);
                    for (session, queue) in ended.sessions {
                        registry.leave(session, queue, &QueueStats::default());
                    }
                    drop(counted);
                    return;
                }
                _ => None,
            }
        }
        ListenerKind::Iscsi => {
            let local = s.socket().local_addr().unwrap_or(peer);
            // Its first LUN's session carries the connection (placement, memory account); the
            // other LUNs ride along as further targets, as NVMe/TCP namespaces do.
            iscsi::accept(&mut s, peer, local, registry).and_then(|(mut a, fe)| {
                (!a.is_empty()).then(|| {
                    let first = a.remove(0);
                    (first, fe, a)
                })
            })
        }
    };
    // Before the socket is closed or handed on: a cut (shutdown) must find it still ours.
    drop(place);
    let Some((admitted, frontend, more)) = admitted else {
        return;
    };
    // From here on the reactor drives the session on the non-blocking socket.
    let tls = s.tls.take().map(|mut t| {
        t.get_mut().set_nonblocking_only();
        t
    });
    let s = s.s.s;
    let _ = s.set_read_timeout(None);
    let _ = s.set_write_timeout(None);
    let _ = s.set_nonblocking(true);
    let w = (admitted.placement as usize + admitted.queue as usize) % workers.len();
    let q = NewQueue {
        sock: OwnedFd::from(s),
        export: admitted.export,
        session: admitted.session,
        queue: admitted.queue,
        size: admitted.size,
        depth: admitted.depth,
        max_io: admitted.max_io,
        peer: peer_s,
        frontend,
        tls,
        mem: admitted.mem,
        counted: Some(counted),
        more,
    };
    match workers[w].0.send(Msg::Queue(q)) {
        Ok(()) => eventfd_write(workers[w].1),
        Err(e) => {
            if let Msg::Queue(q) = e.0 {
                registry.leave(q.session, q.queue, &QueueStats::default());
                for a in q.more {
                    registry.leave(a.session, a.queue, &QueueStats::default());
                }
            }
        }
    }
}

/// What a connection holds while it is admitted: its place among the connections counted
/// (total and per host, kept for the connection's life) and its handshake place (given back
/// when the handshake ends).
struct AdmissionSlots {
    counted: ConnCount,
    place: HandshakeSlot,
}

/// What the TLS check of a native connection decided.
#[derive(Clone, Debug, PartialEq, Eq)]
enum NativeGate {
    /// Plain, allowed (`--tls off|on`).
    Plain,
    /// Plain on a `--tls require` target: its first frame is answered with ACCESS and a
    /// reason, so the initiator can say why, and nothing is served.
    PlainRefused,
    /// TLS; with the host id the client proved with its PSK (None: X.509).
    Tls(Option<String>),
}

/// A TLS record starts with content type 22 (handshake); a native frame with the magic 0xB10C
/// little-endian, i.e. 0x0C: one byte tells which the client speaks.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Looks at a native connection's first byte (without taking it) and runs the TLS handshake
/// if it starts one. None: refused or failed (counted and logged, rate-limited).
fn native_tls(
    s: &mut Admission,
    peer_s: &str,
    tls: &Tls,
    registry: &Registry,
) -> Option<NativeGate> {
    let mut first = [0u8; 1];
    let peeked = s
        .left()
        .and_then(|left| s.socket().set_read_timeout(Some(left)))
        .and_then(|()| s.socket().peek(&mut first));
    match peeked {
        Ok(1) => {}
        Ok(_) => return None,
        Err(e) => {
            crate::log!(Level::Debug, "{peer_s}: closed before handshake: {e}");
            return None;
        }
    }
    if first[0] != TLS_HANDSHAKE_RECORD {
        return Some(if tls.mode == TlsMode::Require {
            NativeGate::PlainRefused
        } else {
            NativeGate::Plain
        });
    }
    if tls.mode == TlsMode::Off {
        registry.access.refuse(
            &peer_s,
            "TLS connection, but this target runs with --tls off",
        );
        return None;
    }
    match s.start_tls(tls) {
        Ok(host) => Some(NativeGate::Tls(host.map(|(h, _)| h))),
        Err(e) => {
            // OpenSSL's reasons, not the peer's bytes: nothing to escape.
            registry
                .access
                .refuse(&peer_s, &format!("TLS handshake failed: {e}"));
            None
        }
    }
}

/// Why a plain native connection to a `--tls require` target is refused, sent as the payload of
/// the ACCESS reply (PROTOCOL.md §2: a refusal may carry a reason).
const TLS_REQUIRED_REASON: &str = "this target requires TLS: connect with --tls";

/// Frames a native handshake may take: two HELLOs (challenge, then answer, PROTOCOL.md §12.1)
/// and a spare for a client that re-sends after an expired challenge.
const HANDSHAKE_FRAMES: usize = 3;

/// How long a TCP handshake thread waits for the queue a HELLO replaces (PROTOCOL.md §2.6) before
/// answering BUSY: short, so the initiator's own HELLO timeout never fires first.
const REPLACE_WAIT: Duration = Duration::from_millis(500);

/// Reads one handshake frame: a valid request header, its payload, its CRC checked.
fn read_handshake_frame(s: &mut Admission, peer_s: &str) -> Option<(Header, Vec<u8>)> {
    let mut hb = [0u8; HEADER_LEN];
    if let Err(e) = s.read_exact(&mut hb) {
        crate::log!(Level::Debug, "{peer_s}: closed during the handshake: {e}");
        return None;
    }
    let h = match Header::decode(&hb, MAX_HANDSHAKE_PAYLOAD) {
        Ok(h) if !h.is_reply() => h,
        Ok(_) => {
            crate::log!(Level::Info, "{peer_s}: handshake refused: reply frame");
            return None;
        }
        Err(e) => {
            crate::log!(Level::Info, "{peer_s}: handshake refused: {e}");
            return None;
        }
    };
    let mut payload = vec![0u8; h.payload_len as usize];
    if let Err(e) = s.read_exact(&mut payload) {
        crate::log!(Level::Info, "{peer_s}: handshake cut short: {e}");
        return None;
    }
    if let Err(e) = h.check_stream_crc(&hb, &payload) {
        crate::log!(Level::Info, "{peer_s}: handshake refused: {e}");
        return None;
    }
    Some((h, payload))
}

/// The native handshake (PROTOCOL.md §2, §12): HELLO (challenged, then proven), JOIN, or a
/// one-shot LIST/STATS query on a target without keys.
fn native_handshake(
    s: &mut Admission,
    peer: SocketAddr,
    registry: &Registry,
    workers: &[(Sender<Msg>, i32)],
    gate: NativeGate,
) -> Option<session::Admitted> {
    let id = access::PeerId::ip(peer);
    let peer_s = &id.to_string();
    let send = |s: &mut Admission, h: &Header, status: Status, payload: &[u8]| {
        send_frame(s, &h.reply(status, payload.len() as u32), payload)
    };
    // The host id a TLS-PSK client proved: its HELLO must name the same host. (The export
    // rules see the host the HELLO proves with the native handshake, the same one.)
    let proven_host = match &gate {
        NativeGate::Tls(h) => h.as_deref(),
        _ => None,
    };
    for _ in 0..HANDSHAKE_FRAMES {
        let (h, payload) = read_handshake_frame(s, peer_s)?;
        if gate == NativeGate::PlainRefused {
            registry.access.refuse(
                &peer_s,
                "plain connection, but this target requires TLS (--tls require)",
            );
            let _ = send(s, &h, Status::Access, TLS_REQUIRED_REASON.as_bytes());
            return None;
        }
        let refuse = |s: &mut Admission, status: Status, why: &str| {
            crate::log!(Level::Info, "{peer_s}: handshake refused: {why}");
            let _ = send(s, &h, status, &[]);
            None
        };
        match h.opcode {
            Opcode::List | Opcode::Stats if registry.access.has_keys() => {
                // Only an authenticated query may see these on a target with keys (§12.3).
                registry
                    .access
                    .refuse(&peer_s, "LIST/STATS without authentication");
                let _ = send(s, &h, Status::Access, &[]);
                return None;
            }
            Opcode::List => {
                let list = registry.list(None, &id.addr);
                let list = ExportEntry::encode_list(&list).unwrap_or_default();
                let _ = send(s, &h, Status::Ok, &list);
                return None;
            }
            Opcode::Stats => {
                let _ = send(s, &h, Status::Ok, &stats_json(registry, workers, MAX_STATS));
                return None;
            }
            Opcode::Hello => {
                let hello = match Hello::decode(&payload) {
                    Ok(x) => x,
                    Err(e) => return refuse(s, Status::Invalid, &e.to_string()),
                };
                if let Some(proven) = proven_host.filter(|p| *p != hello.host_id) {
                    let (said, proven) = (hello.host_id.escape_debug(), proven.escape_debug());
                    return refuse(
                        s,
                        Status::Access,
                        &format!("HELLO names host '{said}' but TLS-PSK proved '{proven}'"),
                    );
                }
                let stats = || stats_json(registry, workers, MAX_STATS);
                // A HELLO replacing a queue (§2.6) waits a little for its requests to finish
                // here; past that it gets BUSY and the initiator asks again.
                let wait = (Instant::now() + REPLACE_WAIT).min(s.deadline());
                match registry.hello(&hello, &id, (None, false), Some(wait), &stats) {
                    HelloAnswer::Challenge(nonce) => {
                        send(s, &h, Status::Challenge, &nonce).ok()?;
                    }
                    HelloAnswer::Welcome(p, adm) => {
                        let sent = send(s, &h, Status::Ok, &p);
                        let adm = adm?;
                        if sent.is_err() {
                            registry.leave(adm.session, 0, &QueueStats::default());
                            return None;
                        }
                        return Some(*adm);
                    }
                    HelloAnswer::Refused(st) => {
                        let _ = send(s, &h, st, &[]);
                        return None;
                    }
                }
            }
            Opcode::Join => {
                // A TCP connection has proven its address already: no challenge.
                return match registry.join(h.session, h.queue, &payload, &id, false, None) {
                    Ok(adm) => {
                        if send(s, &h, Status::Ok, &[]).is_err() {
                            registry.leave(adm.session, adm.queue, &QueueStats::default());
                            return None;
                        }
                        Some(adm)
                    }
                    Err(session::JoinRefused::Status(st)) => {
                        refuse(s, st, &format!("join session {}: {st}", h.session))
                    }
                    Err(session::JoinRefused::Ended) => refuse(
                        s,
                        Status::Access,
                        &format!(
                            "join session {} queue {}: that queue ended",
                            h.session, h.queue
                        ),
                    ),
                    Err(session::JoinRefused::Challenge(_)) => None,
                };
            }
            other => return refuse(s, Status::Invalid, &format!("{other:?} before HELLO")),
        }
    }
    crate::log!(
        Level::Info,
        "{peer_s}: handshake refused: too many challenges"
    );
    None
}

/// The STATS document (PROTOCOL.md §11) from a snapshot of every counter.
fn stats_json(registry: &Registry, workers: &[(Sender<Msg>, i32)], limit: usize) -> Vec<u8> {
    let snap = Snapshot::gather(registry, workers);
    let sessions = snap
        .sessions
        .iter()
        .map(|s| {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            let queues: Vec<_> = snap.queues_of(s.session).collect();
            v["queues"] = serde_json::to_value(queues).unwrap_or_default();
            v
        })
        .collect();
    let auth = serde_json::json!({ "challenges": snap.challenges, "refused": snap.refused });
    let memory = serde_json::json!({ "limit": snap.memory_limit, "used": snap.memory_used });
    fit_stats(
        sessions,
        snap.closed_total(),
        snap.ports,
        auth,
        memory,
        limit,
    )
}

/// Largest STATS reply: what initiators accept (PROTOCOL.md §11).
const MAX_STATS: usize = 1 << 20;

/// The STATS document, valid JSON of at most `limit` bytes: when the sessions do not all fit,
/// the last ones are left out and `sessions_omitted` says how many (cutting the bytes made
/// invalid JSON).
fn fit_stats(
    mut sessions: Vec<serde_json::Value>,
    closed: QueueStats,
    ports: Vec<dgram::PortReport>,
    auth: serde_json::Value,
    memory: serde_json::Value,
    limit: usize,
) -> Vec<u8> {
    let doc = |s: &[serde_json::Value], omitted: usize| {
        let mut d = serde_json::json!({
            "sessions": s, "closed": closed, "ports": ports, "auth": auth, "memory": memory,
        });
        if omitted > 0 {
            d["sessions_omitted"] = omitted.into();
        }
        serde_json::to_vec(&d).unwrap_or_default()
    };
    let all = doc(&sessions, 0);
    if all.len() <= limit {
        return all;
    }
    // Room for the sessions: what the document takes without them, with a margin for the
    // count, the separators and the brackets.
    let total = sessions.len();
    let frame = doc(&[], total).len() + 32;
    let mut used = frame;
    let mut keep = 0;
    for s in &sessions {
        let n = serde_json::to_vec(s).map_or(usize::MAX, |b| b.len() + 1);
        if used.saturating_add(n) > limit {
            break;
        }
        used += n;
        keep += 1;
    }
    sessions.truncate(keep);
    doc(&sessions, total - keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Listen URLs: the default port added, IPv6 in brackets, and what is wrong said plainly
    /// (an unbracketed IPv6 address, a port that is not one, an export), for every scheme.
    #[test]
    fn listen_addresses_say_what_is_wrong() {
        for (rest, port, want) in [
            ("127.0.0.1", 7700, "127.0.0.1:7700"),
            ("127.0.0.1:0", 7700, "127.0.0.1:0"),
            ("[::1]", 10809, "[::1]:10809"),
            ("[::1]:9", 4420, "[::1]:9"),
            ("localhost", 3260, "localhost:3260"),
        ] {
            assert_eq!(listen_authority("u", rest, port).unwrap(), want, "{rest}");
        }
        assert_eq!(parse_listen("tcp://127.0.0.1").unwrap().1[0].port(), 7700);
        for (url, want) in [
            ("tcp://::1:23800", "an IPv6 address goes in brackets"),
            ("tcp://127.0.0.1:abc", "bad port 'abc'"),
            ("tcp://127.0.0.1:-1", "bad port '-1'"),
            ("tcp://127.0.0.1:65536", "bad port '65536'"),
            ("tcp://127.0.0.1:23800/exp", "names no export"),
            ("tcp://[::1", "unclosed '['"),
            ("tcp://[::1]x", "junk after ']'"),
        ] {
            let e = parse_listen(url).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{url}: {e}");
        }
        for url in ["udp://::1:23800", "udp://127.0.0.1:x"] {
            let e = crate::ports::parse(url).unwrap().unwrap_err();
            assert!(e.contains("bad listen address"), "{url}: {e}");
        }
    }

    /// Discovery and SendTargets tell a host an address it can reach the listener at.
    #[test]
    fn a_wildcard_listener_is_listed_at_the_address_the_host_reached() {
        let at = |a: &str| a.parse::<SocketAddr>().unwrap();
        let ip = |a: &str| a.parse::<IpAddr>().unwrap();
        let v4 = ip("10.0.0.5");
        assert_eq!(
            reachable_address(at("192.0.2.1:4420"), v4),
            Some(at("192.0.2.1:4420")),
            "a bound address is its own"
        );
        assert_eq!(
            reachable_address(at("0.0.0.0:4420"), v4),
            Some(at("10.0.0.5:4420"))
        );
        // An IPv4 host on a dual-stack listener: IPv4, not ::ffff:10.0.0.5.
        assert_eq!(
            reachable_address(at("[::]:4420"), ip("::ffff:10.0.0.5")),
            Some(at("10.0.0.5:4420"))
        );
        assert_eq!(
            reachable_address(at("[::]:4420"), ip("fd00::5")),
            Some(at("[fd00::5]:4420"))
        );
        // A host that came over IPv6 cannot reach an IPv4 wildcard there.
        assert_eq!(reachable_address(at("0.0.0.0:4420"), ip("fd00::5")), None);
    }

    fn config(listen: &[&str], exports: &[&str]) -> TargetConfig {
        TargetConfig {
            listen: listen.iter().map(|s| s.to_string()).collect(),
            exports: exports
                .iter()
                .map(|e| ExportSpec::parse(e).unwrap())
                .collect(),
            options: Options {
                threads: 1,
                poll: Duration::ZERO,
                ..Options::default()
            },
            ..TargetConfig::default()
        }
    }

    /// How a stop closes its exports: each once, on no more threads than given, and a close
    /// that hangs holds up only its own thread (here the first waits for all the others, which
    /// one thread after the other could never finish).
    #[test]
    fn items_run_once_each_on_at_most_the_threads_given_and_around_a_slow_one() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let items: Vec<usize> = (0..64).collect();
        let runs: Vec<AtomicUsize> = items.iter().map(|_| AtomicUsize::new(0)).collect();
        let (running, most, others_done) = (
            AtomicUsize::new(0),
            AtomicUsize::new(0),
            AtomicUsize::new(0),
        );
        let (tx, rx) = mpsc::channel();
        let rx = Mutex::new(rx);
        let waited_for_the_others = AtomicUsize::new(0);
        for_each_on_threads(&items, 4, "test-close", |&i| {
            most.fetch_max(running.fetch_add(1, SeqCst) + 1, SeqCst);
            runs[i].fetch_add(1, SeqCst);
            if i == 0 {
                let heard = rx.lock().unwrap().recv_timeout(Duration::from_secs(10));
                waited_for_the_others.store(heard.is_ok() as usize, SeqCst);
            } else if others_done.fetch_add(1, SeqCst) + 1 == items.len() - 1 {
                tx.send(()).unwrap();
            }
            running.fetch_sub(1, SeqCst);
        });
        assert!(runs.iter().all(|r| r.load(SeqCst) == 1), "every item once");
        assert!(
            most.load(SeqCst) <= 4,
            "at most 4 at once, saw {}",
            most.load(SeqCst)
        );
        assert_eq!(
            waited_for_the_others.load(SeqCst),
            1,
            "the others ran around item 0"
        );
    }

    /// A close that panics does not keep the others from theirs, and with no thread to be had
    /// every item runs on the caller's.
    #[test]
    fn a_panicking_item_spares_the_others_and_no_thread_means_the_caller() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let items: Vec<usize> = (0..8).collect();
        let ran = AtomicUsize::new(0);
        for_each_on_threads(&items, 2, "test-close", |&i| {
            assert_ne!(i, 3, "a close that panics (expected in this test)");
            ran.fetch_add(1, SeqCst);
        });
        assert_eq!(ran.load(SeqCst), 7, "all but the one that panicked");
        let caller = std::thread::current().id();
        let on_caller = AtomicUsize::new(0);
        for_each_on_threads(&items, 0, "test-close", |_| {
            on_caller.fetch_add((std::thread::current().id() == caller) as usize, SeqCst);
        });
        assert_eq!(on_caller.load(SeqCst), items.len());
    }

    #[test]
    fn stats_that_do_not_fit_leave_sessions_out_and_stay_valid_json() {
        let sessions: Vec<serde_json::Value> = (0..1000)
            .map(|i| serde_json::json!({ "session": i, "host": "h".repeat(200) }))
            .collect();
        let small = fit_stats(
            sessions[..3].to_vec(),
            QueueStats::default(),
            vec![],
            serde_json::Value::Null,
            serde_json::Value::Null,
            4096,
        );
        let v: serde_json::Value = serde_json::from_slice(&small).unwrap();
        assert_eq!(v["sessions"].as_array().unwrap().len(), 3);
        assert!(v.get("sessions_omitted").is_none());
        let cut = fit_stats(
            sessions,
            QueueStats::default(),
            vec![],
            serde_json::Value::Null,
            serde_json::Value::Null,
            64 << 10,
        );
        assert!(cut.len() <= 64 << 10, "{} bytes", cut.len());
        let v: serde_json::Value = serde_json::from_slice(&cut).expect("valid JSON");
        let kept = v["sessions"].as_array().unwrap().len();
        assert!(kept > 100 && kept < 1000, "{kept}");
        assert_eq!(v["sessions_omitted"], 1000 - kept);
        assert_eq!(
            v["sessions"][0]["session"], 0,
            "the first sessions are kept"
        );
    }

    /// Calls run one at a time, wherever they come from (the control socket runs each client
    /// on its own thread): a call made while another runs waits for it, then runs.
    #[test]
    fn a_call_waits_for_the_call_running_now() {
        let t = Target::start(&config(&[], &[]).options).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|scope| {
            // A call running now (its turn taken here, as `dispatch` takes it).
            let turn = t.shared.calls.turn();
            let add = scope.spawn(|| {
                t.call(
                    "export_add",
                    serde_json::json!({"name": "x", "spec": "mem:1M"}),
                )
            });
            while t.shared.calls.waiting() == 0 {
                assert!(Instant::now() < deadline, "the second call never waited");
                std::thread::yield_now();
            }
            assert!(!t.shared.registry.has_export("x"), "it ran meanwhile");
            drop(turn);
            assert!(add.join().unwrap().is_ok());
        });
        assert!(t.shared.registry.has_export("x"));
        // load_config runs its calls within its own turn (it does not wait for itself).
        let calls = serde_json::json!({"config": [{"method": "export_add", "params": {"name": "y", "spec": "mem:1M"}}]});
        assert_eq!(t.call("load_config", calls).unwrap()["applied"], 1);
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A control call that comes while the target stops is refused: one that ran would change
    /// what the stop no longer looks at (an export added after the exports were closed was
    /// never closed, a listener bound after they were dropped never served), and its caller
    /// would be told it worked.
    #[test]
    fn a_call_during_the_stop_is_refused() {
        let t = Target::start(&config(&[], &[]).options).unwrap();
        t.shared.registry.close();
        let e = t
            .call(
                "export_add",
                serde_json::json!({"name": "x", "spec": "mem:1M"}),
            )
            .unwrap_err();
        assert!(e.message.contains("stopping"), "{}", e.message);
        assert!(!t.shared.registry.has_export("x"));
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A call whose caller hung up while it waited for its turn (a CLI that gave up after its
    /// timeout) is not run when the turn comes; a notification, which nobody waits to hear
    /// about, is; a caller that only shut down its sending side still gets its call run and
    /// answered; and a call that did not wait runs though its caller closed at once.
    #[test]
    fn a_call_whose_caller_left_while_it_waited_is_not_run() {
        use std::io::{BufRead, Write};
        use std::os::unix::net::UnixStream;
        let t = Target::start(&config(&[], &[]).options).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let add = |id: Option<u32>, name: &str| {
            let mut v = serde_json::json!({"jsonrpc": "2.0", "method": "export_add",
                "params": {"name": name, "spec": "mem:1M"}});
            if let Some(id) = id {
                v["id"] = id.into();
            }
            format!("{v}\n")
        };
        std::thread::scope(|scope| {
            // (caller leaves, the call's id, export it adds, whether it must run)
            for (leave, id, name, runs) in [
                (true, Some(1), "gone", false),
                (true, None, "notified", true),
                (false, Some(1), "half", true),
            ] {
                let (server, mut caller) = UnixStream::pair().unwrap();
                let turn = t.shared.calls.turn();
                let served = scope.spawn(|| rpc::client(server, &t.shared));
                caller.write_all(add(id, name).as_bytes()).unwrap();
                while t.shared.calls.waiting() == 0 {
                    assert!(Instant::now() < deadline, "the call never waited");
                    std::thread::yield_now();
                }
                if leave {
                    drop(caller);
                    drop(turn);
                    served.join().unwrap();
                    assert_eq!(t.shared.registry.has_export(name), runs, "{name}");
                } else {
                    caller.shutdown(std::net::Shutdown::Write).unwrap();
                    drop(turn);
                    let mut reply = String::new();
                    std::io::BufReader::new(&caller)
                        .read_line(&mut reply)
                        .unwrap();
                    assert!(reply.contains("\"result\""), "{reply}");
                    served.join().unwrap();
                    assert!(t.shared.registry.has_export(name));
                }
            }
        });
        let (server, mut caller) = UnixStream::pair().unwrap();
        caller.write_all(add(Some(1), "sent").as_bytes()).unwrap();
        drop(caller);
        rpc::client(server, &t.shared);
        assert!(
            t.shared.registry.has_export("sent"),
            "no call ran before it"
        );
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A datagram listener's port counters stay in the stats after the listener is removed:
    /// a counter summed over the thread's ports (as the metrics endpoint does) never goes back.
    #[test]
    fn a_removed_listeners_port_counters_stay_counted() {
        let t = Target::start(&config(&[], &[]).options).unwrap();
        t.call(
            "export_add",
            serde_json::json!({"name": "a", "spec": "mem:1M"}),
        )
        .unwrap();
        let bad_frames = || -> u64 {
            let s = t.call("stats", serde_json::json!({})).unwrap();
            s["ports"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["transport"] == "udp")
                .map(|p| p["bad_frames"].as_u64().unwrap())
                .sum()
        };
        let mut urls = Vec::new();
        for _ in 0..2 {
            let l = t.call(
                "listener_add",
                serde_json::json!({"url": "udp://127.0.0.1:0"}),
            );
            urls.push(l.unwrap()["url"].as_str().unwrap().to_string());
        }
        let addr = urls[0].trim_start_matches("udp://").to_string();
        let sender = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        sender.send_to(&[0u8; 64], &addr).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while bad_frames() == 0 {
            assert!(Instant::now() < deadline, "the bad frame was never counted");
            std::thread::yield_now();
        }
        assert_eq!(bad_frames(), 1);
        t.call("listener_remove", serde_json::json!({"url": urls[0]}))
            .unwrap();
        // Retired once nothing runs on it: at the reactor's next turn, which a stats call is.
        let listed = |url: &str| {
            let l = t.call("listener_list", serde_json::json!({})).unwrap();
            l.as_array().unwrap().iter().any(|x| x["url"] == url)
        };
        assert!(!listed(&urls[0]) && listed(&urls[1]));
        for _ in 0..3 {
            assert_eq!(
                bad_frames(),
                1,
                "the removed port's bad frame still counted"
            );
        }
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A datagram listener serves what another spelling of its address asks for (a UDP port
    /// given or left to the default; not port 0, which is a new port each time), and an
    /// interface with the same EtherType whatever its options; not another EtherType.
    #[test]
    fn a_datagram_listener_is_recognised_however_it_is_asked_for() {
        let listener = |asked: &str, url: &str| Listener {
            id: 1,
            asked: asked.into(),
            url: url.into(),
            stream: None,
        };
        let ask = |url: &str| ports::parse(url).unwrap().unwrap();
        let udp = listener("udp://127.0.0.1", "udp://127.0.0.1:7701");
        assert!(udp.serves(&ask("udp://127.0.0.1:7701")));
        assert!(!udp.serves(&ask("udp://127.0.0.1:7702")));
        assert!(!listener("udp://127.0.0.1:0", "udp://127.0.0.1:40000")
            .serves(&ask("udp://127.0.0.1:0")));
        let eth = listener("eth://vt?ethertype=0x88b6", "eth://vt/02:00:00:00:00:01");
        assert!(eth.serves(&ask("eth://vt?qdisc=bypass&ethertype=0x88b6")));
        assert!(!eth.serves(&ask("eth://vt")));
        assert!(!eth.serves(&ask("eth://vu?ethertype=0x88b6")));
        assert_eq!(eth.config_url(), "eth://vt?ethertype=0x88b6");
        assert_eq!(udp.config_url(), "udp://127.0.0.1:7701");
    }

    /// A request that is wrong in itself is INVALID_PARAMS (a backend no target knows, rules
    /// that do not parse), what this target cannot do with a valid one REFUSED (a name
    /// taken, host-id rules without keys).
    #[test]
    fn bad_specs_and_rules_are_invalid_params_and_what_cannot_be_done_refused() {
        let t = Target::start(&config(&[], &[]).options).unwrap();
        t.call(
            "export_add",
            serde_json::json!({"name": "a", "spec": "mem:1M"}),
        )
        .unwrap();
        let code =
            |method: &str, params: serde_json::Value| t.call(method, params).err().map(|e| e.code);
        let (invalid, refused) = (RpcError::INVALID_PARAMS, RpcError::REFUSED);
        for (method, params, want) in [
            (
                "export_add",
                serde_json::json!({"name": "b", "spec": "disk:1G"}),
                invalid,
            ),
            (
                "export_add",
                serde_json::json!({"name": "b", "spec": "mem:1M,allow=10.0.0.0/99"}),
                invalid,
            ),
            (
                "export_set_allow",
                serde_json::json!({"name": "a", "allow": "10.0.0.0/99"}),
                invalid,
            ),
            (
                "export_add",
                serde_json::json!({"name": "a", "spec": "mem:1M"}),
                refused,
            ),
            (
                "export_set_allow",
                serde_json::json!({"name": "a", "allow": "alice"}),
                refused,
            ),
        ] {
            assert_eq!(code(method, params.clone()), Some(want), "{params}");
        }
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A page of stats of any offset and size is answered (here an empty page, no next), not a
    /// panic on `offset + limit` overflowing (with overflow checks, as in a debug build; a
    /// release build wrapped and happened to answer right).
    #[test]
    fn a_stats_page_of_any_size_is_answered() {
        let t = Target::start(&config(&[], &[]).options).unwrap();
        for offset in [0, 1, usize::MAX] {
            let p = serde_json::json!({"offset": offset, "limit": usize::MAX});
            let s = t.call("stats", p).unwrap();
            assert_eq!(s["next"], serde_json::Value::Null, "{s}");
            assert_eq!(s["sessions"], serde_json::json!([]), "{s}");
        }
        t.stop_handle().stop();
        t.run().unwrap();
    }

    /// A control socket file is taken over only when connecting to it is refused (a target
    /// that died left it): a live target's is not, and neither is a socket that answers
    /// connections otherwise (here a datagram socket: EPROTOTYPE), which may be anyone's.
    #[test]
    fn only_a_stale_control_socket_is_taken_over() {
        let dir = std::env::temp_dir().join(format!("blkwire-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctl.sock");
        let mut t = Target::start(&config(&[], &[]).options).unwrap();
        // Someone's datagram socket.
        let dgram = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        let e = t.open_control_socket(&path).expect_err("not taken over");
        assert!(
            matches!(&e, Error::Listen(m) if m.contains("cannot tell is stale")
                && m.contains("give --rpc-socket another path")),
            "{e:?}"
        );
        assert!(std::fs::symlink_metadata(&path).is_ok(), "left in place");
        drop(dgram);
        // A stream socket nobody listens on any more: stale, taken over.
        std::fs::remove_file(&path).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        t.open_control_socket(&path).unwrap();
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        // A live one (this target's): not taken over.
        let mut other = Target::start(&config(&[], &[]).options).unwrap();
        let e = other.open_control_socket(&path).expect_err("a live socket");
        assert!(
            matches!(&e, Error::Listen(m) if m.contains("another target serves")),
            "{e:?}"
        );
        // Nor when its file is gone (removed by hand, or by a target that started at the
        // same moment and took it for stale): the live target still holds the path.
        std::fs::remove_file(&path).unwrap();
        let e = other
            .open_control_socket(&path)
            .expect_err("the path is held");
        assert!(
            matches!(&e, Error::Listen(m) if m.contains("another target serves")),
            "{e:?}"
        );
        assert!(std::fs::symlink_metadata(&path).is_err(), "nothing bound");
        for t in [t, other] {
            t.stop_handle().stop();
            t.run().unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bind_errors_say_what_kind_of_failure_they_are() {
        let no_exports = Target::bind(&config(&["tcp://127.0.0.1:0"], &[]));
        assert!(matches!(no_exports, Err(Error::Config(m)) if m.contains("--export")));
        let bad_url = Target::bind(&config(&["tcpx://127.0.0.1:0"], &["m=mem:1M"]));
        assert!(matches!(bad_url, Err(Error::Config(m)) if m.contains("tcpx://")));
        let bad_export = Target::bind(&config(&["tcp://127.0.0.1:0"], &["m=disk:1M"]));
        assert!(matches!(bad_export, Err(Error::Config(m)) if m.contains("unknown backend")));
        let first = Target::bind(&config(&["tcp://127.0.0.1:0"], &["m=mem:1M"])).unwrap();
        let taken = first.urls()[0].clone();
        let again = Target::bind(&config(&[&taken], &["m=mem:1M"]));
        let err = again.err().expect("the address is taken");
        assert!(
            matches!(&err, Error::Listen(m) if m.starts_with("cannot listen on")),
            "{err:?}"
        );
        first.stop_handle().stop();
        first.run().unwrap();
    }
}
