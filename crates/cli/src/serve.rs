//! `blkwire serve`.

use std::io::Write;
use std::path::{Path, PathBuf};

use blkwire_backend::ExportSpec;
use blkwire_server::iscsi::targets::TargetSpec as IscsiTargetSpec;
use blkwire_server::nvme::SubsystemSpec;
use blkwire_server::{log, parse_config, Options, Target, TargetConfig, TlsMode, MIN_MEMORY};

#[derive(clap::Args)]
pub struct Args {
    #[arg(
        long = "listen",
        value_name = "URL",
        help = "Where to listen (repeatable): tcp://ADDR[:PORT] (native, port 7700 by default), \
                nbd://ADDR[:PORT] (NBD, port 10809 by default), nvme-tcp://ADDR[:PORT] \
                (NVMe/TCP, port 4420 by default; every export is subsystem \
                nqn.2026-11.io.blkwire:NAME, and see --subsystem), iscsi://ADDR[:PORT] (iSCSI, \
                port 3260 by default; every export is target iqn.2026-11.io.blkwire:NAME with \
                LUN 0, and see --iscsi-target), udp://ADDR[:PORT] (port 7701 by default), \
                eth://IFACE[?qdisc=bypass] (bypass: frames skip the interface's qdisc, less CPU \
                per frame, but the qdisc and tc egress rules no longer see them). Port 0 picks a \
                free port. Default: tcp://0.0.0.0:7700, unless --config is given"
    )]
    listen: Vec<String>,
    #[arg(
        long = "export",
        value_name = "NAME=BACKEND",
        help = "An export (repeatable): NAME=BACKEND[,ro][,allow=RULES], e.g. \
                disk0=file:/dev/nvme0n1,allow=alice or scratch=mem:4G,ro",
        long_help = export_help()
    )]
    exports: Vec<String>,
    /// An NVMe/TCP subsystem of several exports (repeatable):
    /// NQN=EXPORT[@NSID][,EXPORT[@NSID]...][;serial=S][;model=M][;allow=HOSTNQN[+HOSTNQN...]],
    /// e.g. 'nqn.2026-11.com.example:db=data,log;serial=DB1;allow=nqn.2014-08.org.nvmexpress:uuid:1234'.
    /// Namespaces get NSIDs 1, 2, ... in the order given unless @NSID says; serial and model
    /// are what Identify Controller reports; without allow= any host NQN may connect (the
    /// exports' own allow= rules and --keys still apply). Every export stays its own
    /// subsystem nqn.2026-11.io.blkwire:NAME too
    #[arg(long = "subsystem", value_name = "NQN=EXPORTS")]
    subsystems: Vec<String>,
    /// An iSCSI target of several LUNs (repeatable):
    /// IQN=EXPORT[@LUN][,EXPORT[@LUN]...][;allow=INITIATOR_IQN[+INITIATOR_IQN...]],
    /// e.g. 'iqn.2026-11.com.example:db=data,log@5;allow=iqn.1994-05.com.redhat:host1'.
    /// LUNs without @LUN get the lowest free numbers from 0; without allow= any initiator may
    /// log in (with --keys the name CHAP proved is matched, else the InitiatorName); each
    /// export's own allow= rules decide which LUNs an initiator sees. Every export stays its
    /// own target iqn.2026-11.io.blkwire:NAME (LUN 0) too
    #[arg(long = "iscsi-target", value_name = "IQN=EXPORTS")]
    iscsi_targets: Vec<String>,
    /// Replay a config: a JSON list of calls, as `blkwire save-config` writes it
    /// (docs/MANAGEMENT.md). Flags given as well apply after it (and override its
    /// target_options)
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The control socket (JSON-RPC, `blkwire rpc`, `blkwire export add ...`), for root and
    /// the user running the target only; `none` opens none. Default /run/blkwire/blkwire.sock
    /// when it can be had (a second target on the machine logs that and runs without)
    #[arg(long, value_name = "PATH")]
    rpc_socket: Option<String>,
    /// Worker threads, each with its own io_uring (0: one per CPU) [default: one per CPU]
    #[arg(long)]
    threads: Option<usize>,
    /// Largest I/O granted to a client [default: 1M]
    #[arg(long, value_name = "SIZE", value_parser = crate::size_arg)]
    max_io: Option<u64>,
    /// Microseconds a worker spins for new requests before sleeping (0 = never spin) [default:
    /// 50]
    #[arg(long, value_name = "US")]
    poll_us: Option<u64>,
    /// Seconds after which a datagram queue that sent no frame is forgotten. Tests shorten it;
    /// initiators send a KEEPALIVE every 5 s, so keep it well above that (PROTOCOL.md §9.1).
    #[arg(long, value_name = "SECS", hide = true)]
    datagram_idle_timeout: Option<u64>,
    /// Sessions (initiators) served at once; more are refused until one ends [default: 1024]
    #[arg(long, value_name = "N")]
    max_sessions: Option<usize>,
    /// Memory all connection and session buffers may hold together (receive, transmit and
    /// data buffers): a session may take half of it, a connection a quarter; past it,
    /// connections wait for memory instead of growing and new sessions get NO_MEMORY. Default:
    /// a quarter of RAM, at least 256M. Exports (mem:) are not part of it
    #[arg(long, value_name = "SIZE", value_parser = crate::size_arg)]
    max_memory: Option<u64>,
    /// Sessions from one address; more are refused until one ends [default: 128]
    #[arg(long, value_name = "N")]
    max_sessions_per_host: Option<usize>,
    /// Connections open at once (handshakes included); more are closed when accepted
    /// [default: 4096]
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Connections open at once from one address [default: 256]
    #[arg(long, value_name = "N")]
    max_connections_per_host: Option<usize>,
    /// Seconds a connection has for its whole handshake. Tests shorten it.
    #[arg(long, value_name = "SECS", hide = true)]
    handshake_timeout: Option<u64>,
    /// Handshakes in progress at once; more connections are closed until one finishes.
    #[arg(long, value_name = "N", hide = true)]
    max_handshakes: Option<usize>,
    /// Key file of the hosts this target knows (HOST-ID:HEXKEY lines, `blkwire key gen`,
    /// HOST-ID:DHHC-1:XX:BASE64: [DHHC-1:XX:BASE64:] NVMe DH-HMAC-CHAP secrets, or
    /// INITIATOR-IQN:CHAP:SECRET [TARGET-SECRET] iSCSI CHAP secrets; mode 0600).
    /// With it every host must prove its key, and the target proves it back; also the TLS-PSK
    /// keys (the PSK identity is the host id). Reload it live with `blkwire rpc keys_load`
    #[arg(long, value_name = "FILE")]
    keys: Option<PathBuf>,
    /// A host (repeatable) that may read the live counters (`blkwire stats`); needs --keys, since
    /// only a proven host id means anything (without --keys every host may read them)
    #[arg(long, value_name = "HOST-ID")]
    admin: Vec<String>,
    /// error, warn, info or debug
    #[arg(long, default_value = "info")]
    log_level: String,
    /// TLS on tcp:// and nbd:// listeners: off, on (TLS and plain) or require (TLS only;
    /// NBD clients must use STARTTLS). Credentials: --keys (TLS-PSK, the PSK identity is the
    /// host id) and/or --tls-cert/--tls-key (X.509) [default: off]
    #[arg(long, value_name = "MODE", value_parser = TlsMode::parse)]
    tls: Option<TlsMode>,
    /// The target's X.509 certificate chain (PEM), with --tls on|require
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM)
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at ADDR:PORT (GET /metrics), e.g. 127.0.0.1:9100;
    /// port 0 picks a free port. Anyone who reaches the address may read them (docs/METRICS.md)
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
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

/// The first export a flag (`--subsystem`, `--iscsi-target`, its text `text`) names that no
/// `--export` gives, as the one-line error that says how to add it.
fn no_export<'a>(
    flag: &str,
    text: &str,
    mut names: impl Iterator<Item = &'a String>,
    exports: &[ExportSpec],
) -> Result<(), String> {
    match names.find(|e| !exports.iter().any(|x| &x.name == *e)) {
        Some(e) => Err(format!(
            "{flag} '{}': no export '{}' (add it with --export {}=BACKEND)",
            text.escape_debug(),
            e.escape_debug(),
            e.escape_debug()
        )),
        None => Ok(()),
    }
}

pub fn run(a: Args) -> Result<(), String> {
    log::init_stderr(log::Level::parse(&a.log_level)?);
    let exports = a
        .exports
        .iter()
        .map(|s| ExportSpec::parse(s).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let subsystems = a
        .subsystems
        .iter()
        .map(|s| SubsystemSpec::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let iscsi_targets = a
        .iscsi_targets
        .iter()
        .map(|s| IscsiTargetSpec::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    if a.config.is_none() {
        // Without a config every export comes from --export: name a missing one here, by flag.
        for (t, text) in subsystems.iter().zip(&a.subsystems) {
            no_export(
                "--subsystem",
                text,
                t.namespaces.iter().map(|(e, _)| e),
                &exports,
            )?;
        }
        // Nothing could add an export later: say so before anything is bound.
        if exports.is_empty() && a.rpc_socket.as_deref() == Some("none") {
            return Err(
                "no exports: add at least one --export NAME=BACKEND, e.g. --export disk0=mem:1G \
                 (with --rpc-socket none nothing can add one later)"
                    .into(),
            );
        }
        for (t, text) in iscsi_targets.iter().zip(&a.iscsi_targets) {
            no_export(
                "--iscsi-target",
                text,
                t.luns.iter().map(|(e, _)| e),
                &exports,
            )?;
        }
    }
    // Defaults, then the config's target_options, then the flags given.
    let mut options = Options::default();
    options.limits.max_memory = default_memory();
    let mut file_calls = Vec::new();
    if let Some(path) = &a.config {
        let shown = path.display().to_string();
        let text = crate::manage::read_config(path)
            .map_err(|e| format!("--config {shown}: cannot read it: {e}"))?;
        let mut file = parse_config(&text, &shown)?;
        if file.first().is_some_and(|c| c.method == "target_options") {
            let first = file.remove(0);
            options
                .patch(&first.params)
                .map_err(|e| format!("{shown}: {e}"))?;
        }
        if file.iter().any(|c| c.method == "target_options") {
            return Err(format!(
                "{shown}: target_options must be the first call (it sets what the target \
                 starts with)"
            ));
        }
        file_calls = file;
    }
    options.patch(&flag_options(&a)?).map_err(flag_error)?;
    let listen = if a.listen.is_empty() && a.config.is_none() {
        vec!["tcp://0.0.0.0:7700".to_string()]
    } else {
        a.listen
    };
    let flags = TargetConfig {
        options: options.clone(),
        listen,
        exports,
        keys: a.keys,
        admins: a.admin,
        metrics: a.metrics,
        subsystems,
        iscsi_targets,
    };
    // Signals are taken by a dedicated thread (below): block them before any thread starts so
    // every thread inherits the mask and none is interrupted mid-I/O.
    let sigs = block_signals();
    let mut target = Target::start(&options).map_err(|e| e.to_string())?;
    // Every call first: a bad flag or config fails before anything is opened or said.
    let shown = a.config.as_ref().map(|p| p.display().to_string());
    target
        .apply(&file_calls, shown.as_deref())
        .and_then(|()| target.apply(&flags.calls(), None))
        .map_err(|e| e.to_string())?;
    let wants_control = a.rpc_socket.as_deref() != Some("none");
    target
        .check_ready(wants_control)
        .map_err(|e| e.to_string())?;
    let control = match a.rpc_socket.as_deref() {
        Some("none") => None,
        Some(path) => {
            let path = Path::new(path);
            // Only the default's directory is created: a given path's missing directory is
            // most likely a typo, which must not leave directories behind.
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                if !dir.is_dir() {
                    return Err(format!(
                        "--rpc-socket {}: no directory {} (create it, give another path, or \
                         --rpc-socket none)",
                        path.display(),
                        dir.display()
                    ));
                }
            }
            target
                .open_control_socket(path)
                .map_err(|e| e.to_string())?;
            Some(path)
        }
        None => {
            let path = Path::new(crate::rpc::DEFAULT_SOCKET);
            match target.open_control_socket(path) {
                Ok(()) => Some(path),
                Err(e) => {
                    log!(log::Level::Info, "no control socket: {e}");
                    None
                }
            }
        }
    };
    if control.is_none() {
        // Without a control socket nothing could be added later.
        target.check_ready(false).map_err(|e| e.to_string())?;
    }
    let stop = target.stop_handle();
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: sigwait on the set we blocked.
        unsafe { libc::sigwait(&sigs, &mut sig) };
        stop.stop();
    });
    // --tls covers tcp:// and nbd:// listeners only: asked for with none of them, it protects
    // nothing (listeners added later over the control socket get it). Said before the
    // `listening` lines, which scripts (and tests) wait for.
    let urls = target.urls();
    if a.tls.is_some_and(|t| t.name() != "off")
        && !urls.is_empty()
        && !urls
            .iter()
            .any(|u| u.starts_with("tcp://") || u.starts_with("nbd://"))
    {
        log!(
            log::Level::Warn,
            "--tls applies to tcp:// and nbd:// listeners only, and this target has none: \
             nothing it serves now is encrypted"
        );
    }
    {
        let mut out = std::io::stdout().lock();
        for u in target.urls() {
            // Scripts wait for these lines: one per listener, flushed at once.
            let _ = writeln!(out, "listening {u}");
        }
        if let Some(p) = control {
            // A target built by calls alone may have no listener yet: this line says it is up.
            let _ = writeln!(out, "control {}", p.display());
        }
        if let Some(url) = target.metrics_url() {
            let _ = writeln!(out, "metrics {url}");
        }
        let _ = out.flush();
    }
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
    if names.is_empty() {
        log!(
            log::Level::Info,
            "no exports yet: add them with `blkwire export add NAME SPEC`"
        );
    } else {
        log!(log::Level::Info, "exports: {}", names.join(" "));
    }
    target.run().map_err(|e| e.to_string())
}

/// A `target_options` error about a value given by flag, naming the flag (`--max-sessions`,
/// not the option `max_sessions`; `_s` options are the flags without their unit).
fn flag_error(e: String) -> String {
    let Some(rest) = e.strip_prefix("target_options: ") else {
        return e;
    };
    let (key, tail) = rest.split_once(' ').unwrap_or((rest, ""));
    let flag = key.strip_suffix("_s").unwrap_or(key).replace('_', "-");
    format!("--{flag} {tail}").trim_end().to_string()
}

/// The target options the flags set, with the flags' own words when one is out of range.
fn flag_options(a: &Args) -> Result<serde_json::Value, String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut o = serde_json::Map::new();
    if let Some(t) = a.threads {
        if t > 4 * cpus {
            return Err(format!(
                "--threads {t} is more than 4 per CPU ({cpus} CPUs): each worker owns a core's \
                 worth of queues; use at most {}, or 0 for one per CPU",
                4 * cpus
            ));
        }
        o.insert("threads".into(), t.into());
    }
    if let Some(m) = a.max_io {
        if !(4096..=blkwire_wire::MAX_PAYLOAD_LIMIT as u64).contains(&m) {
            return Err(format!(
                "--max-io must be between 4K and {}",
                blkwire_backend::format_size(blkwire_wire::MAX_PAYLOAD_LIMIT as u64)
            ));
        }
        o.insert("max_io".into(), m.into());
    }
    if let Some(m) = a.max_memory {
        if m < MIN_MEMORY {
            return Err(format!(
                "--max-memory must be at least {} (one connection's buffers and the datagram \
                 ports' take a few MiB each)",
                blkwire_backend::format_size(MIN_MEMORY)
            ));
        }
        o.insert("max_memory".into(), m.into());
    }
    // Passed as given: `target_options` refuses a count or duration of 0 in the flag's
    // words (0 was taken as 1, which a user meaning "no limit" did not expect).
    let mut put = |k: &str, v: Option<u64>| {
        if let Some(v) = v {
            o.insert(k.into(), v.into());
        }
    };
    put("datagram_idle_timeout_s", a.datagram_idle_timeout);
    put("max_sessions", a.max_sessions.map(|n| n as u64));
    put(
        "max_sessions_per_host",
        a.max_sessions_per_host.map(|n| n as u64),
    );
    put("max_connections", a.max_connections.map(|n| n as u64));
    put(
        "max_connections_per_host",
        a.max_connections_per_host.map(|n| n as u64),
    );
    put("handshake_timeout_s", a.handshake_timeout);
    put("max_handshakes", a.max_handshakes.map(|n| n as u64));
    if let Some(p) = a.poll_us {
        o.insert("poll_us".into(), p.into()); // 0 is allowed: never spin
    }
    if let Some(t) = a.tls {
        o.insert("tls".into(), t.name().into());
    }
    // Absolute: a saved config is read again by a target that may start elsewhere.
    let absolute = |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    if let Some(c) = &a.tls_cert {
        o.insert("tls_cert".into(), absolute(c).display().to_string().into());
    }
    if let Some(k) = &a.tls_key {
        o.insert("tls_key".into(), absolute(k).display().to_string().into());
    }
    Ok(o.into())
}

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
