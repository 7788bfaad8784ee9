//! `blkwire serve`.

use std::io::Write;
use std::time::Duration;

use blkwire_backend::ExportSpec;
use blkwire_server::{log, Limits, Target, TargetConfig, TlsMode, TlsSettings};

#[derive(clap::Args)]
pub struct Args {
    #[arg(
        long = "listen",
        value_name = "URL",
        default_value = "tcp://0.0.0.0:7700",
        help = "Where to listen (repeatable): tcp://ADDR:PORT (native), nbd://ADDR[:PORT] (NBD, \
                port 10809 by default), udp://ADDR:PORT, eth://IFACE. Port 0 picks a free port."
    )]
    listen: Vec<String>,
    #[arg(
        long = "export",
        value_name = "NAME=BACKEND",
        required = true,
        help = "An export (repeatable): NAME=BACKEND[,ro][,allow=RULES], e.g. \
                disk0=file:/dev/nvme0n1,allow=alice or scratch=mem:4G,ro",
        long_help = export_help()
    )]
    exports: Vec<String>,
    /// Worker threads, each with its own io_uring (default: one per CPU)
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Largest I/O granted to a client
    #[arg(long, value_name = "SIZE", default_value = "1M", value_parser = crate::size_arg)]
    max_io: u64,
    /// Microseconds a worker spins for new requests before sleeping (0 = never spin)
    #[arg(long, value_name = "US", default_value_t = 50)]
    poll_us: u64,
    /// Seconds after which a datagram queue that sent no frame is forgotten. Tests shorten it;
    /// initiators send a KEEPALIVE every 5 s, so keep it well above that (PROTOCOL.md §9.1).
    #[arg(long, value_name = "SECS", default_value_t = 60, hide = true)]
    datagram_idle_timeout: u64,
    /// Sessions (initiators) served at once; more are refused until one ends
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_sessions: usize,
    /// Memory all connection and session buffers may hold together (receive, transmit and
    /// data buffers): a session may take half of it, a connection a quarter; past it,
    /// connections wait for memory instead of growing and new sessions get NO_MEMORY. Default:
    /// a quarter of RAM, at least 256M. Exports (mem:) are not part of it
    #[arg(long, value_name = "SIZE", value_parser = crate::size_arg)]
    max_memory: Option<u64>,
    /// Sessions from one address; more are refused until one ends
    #[arg(long, value_name = "N", default_value_t = 128)]
    max_sessions_per_host: usize,
    /// Connections open at once (handshakes included); more are closed when accepted
    #[arg(long, value_name = "N", default_value_t = 4096)]
    max_connections: usize,
    /// Connections open at once from one address
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_connections_per_host: usize,
    /// Seconds a connection has for its whole handshake. Tests shorten it.
    #[arg(long, value_name = "SECS", default_value_t = 10, hide = true)]
    handshake_timeout: u64,
    /// Handshakes in progress at once; more connections are closed until one finishes.
    #[arg(long, value_name = "N", default_value_t = 256, hide = true)]
    max_handshakes: usize,
    /// Key file of the hosts this target knows (HOST-ID:HEXKEY lines, `blkwire key gen`; mode
    /// 0600). With it every host must prove its key, and the target proves it back; also the
    /// TLS-PSK keys (the PSK identity is the host id)
    #[arg(long, value_name = "FILE")]
    keys: Option<std::path::PathBuf>,
    /// A host (repeatable) that may read the live counters (`blkwire stats`) on a target with
    /// --keys; without --keys anyone may
    #[arg(long, value_name = "HOST-ID")]
    admin: Vec<String>,
    /// error, warn, info or debug
    #[arg(long, default_value = "info")]
    log_level: String,
    /// TLS on tcp:// and nbd:// listeners: off, on (TLS and plain) or require (TLS only;
    /// NBD clients must use STARTTLS). Credentials: --keys (TLS-PSK, the PSK identity is the
    /// host id) and/or --tls-cert/--tls-key (X.509)
    #[arg(long, value_name = "MODE", default_value = "off", value_parser = TlsMode::parse)]
    tls: TlsMode,
    /// The target's X.509 certificate chain (PEM), with --tls on|require
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM)
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

/// `--export` in `--help`: every backend the registry knows, with what it is.
fn export_help() -> String {
    let mut h = String::from(
        "An export (repeatable): NAME=BACKEND[,ro][,allow=RULE[+RULE...]]; ',ro' serves it \
         read-only; 'allow=' admits only the hosts it names (host ids proven by --keys), address \
         prefixes (10.0.0.0/8, fd00::/64) or MACs (raw Ethernet). Backends:",
    );
    for k in blkwire_backend::registry::KINDS {
        h.push_str(&format!("\n  {:<22} {}", k.usage, k.about));
    }
    h
}

pub fn run(a: Args) -> Result<(), String> {
    log::init_stderr(log::Level::parse(&a.log_level)?);
    let exports = a
        .exports
        .iter()
        .map(|s| ExportSpec::parse(s).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.threads > 4 * cpus {
        return Err(format!(
            "--threads {} is more than 4 per CPU ({cpus} CPUs): each worker owns a core's worth \
             of queues; use at most {}, or 0 for one per CPU",
            a.threads,
            4 * cpus
        ));
    }
    let max_io = u32::try_from(a.max_io)
        .ok()
        .filter(|m| (4096..=blkwire_wire::MAX_PAYLOAD_LIMIT).contains(m))
        .ok_or_else(|| {
            format!(
                "--max-io must be between 4K and {}",
                blkwire_backend::format_size(blkwire_wire::MAX_PAYLOAD_LIMIT as u64)
            )
        })?;
    let max_memory = match a.max_memory {
        Some(m) if m < MIN_MEMORY as u64 => {
            return Err(format!(
                "--max-memory must be at least {} (one connection's buffers and the datagram \
                 ports' take a few MiB each)",
                blkwire_backend::format_size(MIN_MEMORY as u64)
            ))
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        None => default_memory(),
    };
    return_freed_buffers();
    // Signals are taken by a dedicated thread (below): block them before any thread starts so
    // every thread inherits the mask and none is interrupted mid-I/O.
    let sigs = block_signals();
    let cfg = TargetConfig {
        listen: a.listen,
        exports,
        threads: a.threads,
        limits: Limits {
            max_io,
            datagram_idle: Duration::from_secs(a.datagram_idle_timeout.max(1)),
            handshake_timeout: Duration::from_secs(a.handshake_timeout.max(1)),
            max_handshakes: a.max_handshakes.max(1),
            max_sessions: a.max_sessions.max(1),
            max_memory,
            max_sessions_per_host: a.max_sessions_per_host.max(1),
            max_connections: a.max_connections.max(1),
            max_connections_per_host: a.max_connections_per_host.max(1),
            ..Limits::default()
        },
        poll: Duration::from_micros(a.poll_us),
        keys: a
            .keys
            .as_deref()
            .map(blkwire_auth::KeyStore::load)
            .transpose()?,
        admins: a.admin,
        tls: TlsSettings {
            mode: a.tls,
            cert: a.tls_cert,
            key: a.tls_key,
        },
    };
    let target = Target::bind(&cfg).map_err(|e| e.to_string())?;
    let stop = target.stop_handle();
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: sigwait on the set we blocked.
        unsafe { libc::sigwait(&sigs, &mut sig) };
        stop.stop();
    });
    let names: Vec<String> = target
        .exports()
        .iter()
        .map(|e| {
            format!(
                "{}={}{}",
                e.name,
                e.backend().describe(),
                if e.read_only { ",ro" } else { "" }
            )
        })
        .collect();
    {
        let mut out = std::io::stdout().lock();
        for u in target.urls() {
            // Scripts wait for these lines: one per listener, flushed at once.
            let _ = writeln!(out, "listening {u}");
        }
        let _ = out.flush();
    }
    log!(log::Level::Info, "exports: {}", names.join(" "));
    target.run().map_err(|e| e.to_string())
}

/// The smallest `--max-memory` accepted.
const MIN_MEMORY: usize = 64 << 20;

/// `--max-memory` by default: a quarter of RAM (the rest is for the page cache, mem: exports
/// and everything else on the machine), at least 256 MiB.
fn default_memory() -> usize {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let ram = (pages.max(0) as usize).saturating_mul(page.max(0) as usize);
    (ram / 4).max(256 << 20)
}

/// Buffers of 128 KiB and more get their own mapping, returned to the system when freed. By
/// default glibc raises that threshold each time such a buffer is freed (up to 32 MiB), after
/// which freed connection buffers stay in its heap: the memory budget got them back but the
/// process kept them (157 MiB after a hostile load whose buffers were all freed). Connection
/// buffers are pooled and grow rarely, so the extra mmap calls are not on the I/O path.
fn return_freed_buffers() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; called before the other threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

fn block_signals() -> libc::sigset_t {
    // SAFETY: building and applying a signal mask for this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}
