//! The management plane (docs/MANAGEMENT.md): every change to a running target is a *call*, a
//! method name with JSON parameters. `serve`'s flags become calls, `serve --config FILE` replays
//! a list of them, the control socket (`rpc.rs`) takes them one at a time (`OneAtATime`: calls
//! from all its clients, and from anywhere else, run one after the other), and `save_config`
//! writes the running state back as calls. One code path for all four.
//!
//! Control path only: calls take the registry's lock and send messages to reactors; the data
//! path never waits for them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use blkwire_backend::{format_size, parse_size, ExportSpec, ResizeError};

use crate::session::Limits;
use crate::tls::{TlsMode, TlsSettings};
use crate::Shared;

/// One call: a method and its parameters, as in a config file (`[{"method", "params"}, ...]`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Call {
    /// The method's name (`rpc_get_methods` lists them).
    pub method: String,
    /// Its parameters (an object; absent = none).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub params: Value,
}

impl Call {
    /// A call with these parameters.
    pub fn new(method: &str, params: Value) -> Call {
        Call {
            method: method.into(),
            params,
        }
    }
}

/// Reads a config file: a JSON array of calls. Errors name the file and what is wrong.
pub fn parse_config(text: &str, source: &str) -> Result<Vec<Call>, String> {
    serde_json::from_str::<Vec<Call>>(text).map_err(|e| {
        format!(
            "{source}: not a blkwire config ({e}): expected a JSON array of \
             {{\"method\": ..., \"params\": {{...}}}} calls, as save_config writes"
        )
    })
}

/// A JSON-RPC 2.0 error: a code and one line a person can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcError {
    /// JSON-RPC's code (the constants below).
    pub code: i32,
    /// What was wrong and what to do.
    pub message: String,
}

impl RpcError {
    /// The request is not valid JSON.
    pub const PARSE: i32 = -32700;
    /// Valid JSON, but not a JSON-RPC 2.0 request.
    pub const INVALID_REQUEST: i32 = -32600;
    /// No method of that name.
    pub const NO_METHOD: i32 = -32601;
    /// The parameters are missing, of the wrong type, or out of range.
    pub const INVALID_PARAMS: i32 = -32602;
    /// A valid request the target cannot do now (an export in use, an address taken, ...).
    pub const REFUSED: i32 = -32000;
    /// The caller may not use the control socket.
    pub const PERMISSION: i32 = -32001;

    fn params(message: String) -> RpcError {
        RpcError {
            code: Self::INVALID_PARAMS,
            message,
        }
    }

    fn refused(message: String) -> RpcError {
        RpcError {
            code: Self::REFUSED,
            message,
        }
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// What is fixed when a target starts: its threads, limits and TLS. In a config it is the
/// `target_options` call, which must come first; on a running target that call only checks
/// that nothing would change.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Reactor threads (0 = one per CPU).
    pub threads: usize,
    /// What a client may be granted at most, and the resource limits.
    pub limits: Limits,
    /// How long a reactor spins for new work before sleeping (trades CPU for latency).
    pub poll: Duration,
    /// `--tls`, `--tls-cert`, `--tls-key`: TLS on stream listeners (TLS-PSK keys come from
    /// the key store).
    pub tls: TlsSettings,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            threads: 0,
            limits: Limits::default(),
            poll: Duration::from_micros(50),
            tls: TlsSettings::default(),
        }
    }
}

/// The option names of `target_options`, with what each sets (for errors and the docs).
pub const OPTION_NAMES: &[&str] = &[
    "threads",
    "poll_us",
    "max_io",
    "max_sessions",
    "max_memory",
    "max_sessions_per_host",
    "max_connections",
    "max_connections_per_host",
    "handshake_timeout_s",
    "max_handshakes",
    "datagram_idle_timeout_s",
    "tls",
    "tls_cert",
    "tls_key",
];

impl Options {
    /// The `target_options` parameters that reproduce these options.
    pub fn to_json(&self) -> Value {
        let l = &self.limits;
        json!({
            "threads": self.threads,
            "poll_us": self.poll.as_micros() as u64,
            "max_io": l.max_io,
            "max_sessions": l.max_sessions,
            "max_memory": l.max_memory,
            "max_sessions_per_host": l.max_sessions_per_host,
            "max_connections": l.max_connections,
            "max_connections_per_host": l.max_connections_per_host,
            "handshake_timeout_s": l.handshake_timeout.as_secs(),
            "max_handshakes": l.max_handshakes,
            "datagram_idle_timeout_s": l.datagram_idle.as_secs(),
            "tls": self.tls.mode.name(),
            "tls_cert": self.tls.cert,
            "tls_key": self.tls.key,
        })
    }

    /// Sets the options named in `p` (an object with some of `OPTION_NAMES`), checking
    /// each; the others keep their value.
    pub fn patch(&mut self, p: &Value) -> Result<(), String> {
        let Some(obj) = p.as_object() else {
            return Err("target_options takes an object of options".into());
        };
        for (k, v) in obj {
            let count = |min: u64, max: u64| {
                v.as_u64()
                    .filter(|n| (min..=max).contains(n))
                    .ok_or_else(|| {
                        format!("target_options: {k} must be a whole number from {min} to {max}")
                    })
            };
            let path = || match v {
                Value::Null => Ok(None),
                Value::String(s) if !s.is_empty() => Ok(Some(PathBuf::from(s))),
                _ => Err(format!("target_options: {k} must be a file path or null")),
            };
            let l = &mut self.limits;
            match k.as_str() {
                "threads" => self.threads = count(0, 4096)? as usize,
                "poll_us" => self.poll = Duration::from_micros(count(0, 1_000_000)?),
                "max_io" => {
                    l.max_io = count(4096, blkwire_wire::MAX_PAYLOAD_LIMIT as u64)? as u32;
                }
                "max_sessions" => l.max_sessions = count(1, 1 << 20)? as usize,
                "max_memory" => l.max_memory = count(MIN_MEMORY, u64::MAX)? as usize,
                "max_sessions_per_host" => l.max_sessions_per_host = count(1, 1 << 20)? as usize,
                "max_connections" => l.max_connections = count(1, 1 << 24)? as usize,
                "max_connections_per_host" => {
                    l.max_connections_per_host = count(1, 1 << 24)? as usize;
                }
                "handshake_timeout_s" => {
                    l.handshake_timeout = Duration::from_secs(count(1, 3600)?);
                }
                "max_handshakes" => l.max_handshakes = count(1, 1 << 16)? as usize,
                "datagram_idle_timeout_s" => {
                    l.datagram_idle = Duration::from_secs(count(1, 86400)?);
                }
                "tls" => {
                    self.tls.mode = TlsMode::parse(v.as_str().unwrap_or_default())
                        .map_err(|e| format!("target_options: {e}"))?;
                }
                "tls_cert" => self.tls.cert = path()?,
                "tls_key" => self.tls.key = path()?,
                _ => {
                    return Err(format!(
                        "target_options: unknown option '{k}' (known: {})",
                        OPTION_NAMES.join(", ")
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The smallest memory budget accepted (`--max-memory`).
pub const MIN_MEMORY: u64 = 64 << 20;

/// One method: its name, what it does (for `rpc_get_methods` and the docs) and its code.
struct Method {
    name: &'static str,
    about: &'static str,
    run: fn(&Arc<Shared>, Value) -> Result<Value, RpcError>,
}

const METHODS: &[Method] = &[
    Method {
        name: "target_options",
        about: "threads, limits and TLS: set at start (first call of a config); on a running target only checks they are unchanged",
        run: target_options,
    },
    Method {
        name: "keys_load",
        about: "{path}: (re)load the key file; sessions of hosts whose key went or changed are closed",
        run: keys_load,
    },
    Method {
        name: "admins_set",
        about: "{hosts}: the hosts that may read STATS over the network (needs keys)",
        run: admins_set,
    },
    Method {
        name: "host_list",
        about: "the host ids in the key store (never their keys)",
        run: host_list,
    },
    Method {
        name: "export_add",
        about: "{name, spec}: serve a new export, spec as on the command line (mem:1G,ro)",
        run: export_add,
    },
    Method {
        name: "export_remove",
        about: "{name, force}: stop serving an export; in use, only with force (its sessions are closed)",
        run: export_remove,
    },
    Method {
        name: "export_resize",
        about: "{name, size}: grow an export (bytes or \"2G\"; file:, null: and rbd: only); open sessions keep their size, new ones get the new size",
        run: export_resize,
    },
    Method {
        name: "export_set_allow",
        about: "{name, allow}: replace an export's allow rules (null: no rules); sessions no longer allowed are closed",
        run: export_set_allow,
    },
    Method {
        name: "export_list",
        about: "every export: name, spec, backend, size, rules, sessions",
        run: export_list,
    },
    Method {
        name: "listener_add",
        about: "{url}: listen on tcp://, nbd://, nvme-tcp://, iscsi://, udp:// or eth://; returns the bound URL",
        run: listener_add,
    },
    Method {
        name: "listener_remove",
        about: "{url}: stop accepting on a listener (tcp/nbd/nvme-tcp/iscsi connections stay; udp/eth sessions on it close)",
        run: listener_remove,
    },
    Method {
        name: "listener_list",
        about: "every listener: bound URL and kind",
        run: listener_list,
    },
    Method {
        name: "metrics_listen",
        about: "{addr}: serve Prometheus metrics at ADDR:PORT (GET /metrics); one endpoint per target",
        run: metrics_listen,
    },
    Method {
        name: "nvme_subsystem_list",
        about: "NVMe/TCP: every subsystem (each export's own, then the configured ones: NQN, namespaces, serial, model, hosts or allow rules) and its controllers (id, host NQN, sessions)",
        run: nvme_subsystem_list,
    },
    Method {
        name: "nvme_subsystem_create",
        about: "{nqn, serial?, model?, allow_any_host?}: a subsystem with no namespaces yet; only the hosts added with nvme_subsystem_add_host connect unless allow_any_host",
        run: nvme_subsystem_create,
    },
    Method {
        name: "nvme_subsystem_delete",
        about: "{nqn}: delete a subsystem; its controllers end",
        run: nvme_subsystem_delete,
    },
    Method {
        name: "nvme_subsystem_add_ns",
        about: "{nqn, export, nsid?}: add an export as a namespace (nsid: the lowest free one by default); hosts see it when they connect again",
        run: nvme_subsystem_add_ns,
    },
    Method {
        name: "nvme_subsystem_remove_ns",
        about: "{nqn, nsid}: remove a namespace; connected controllers answer Invalid Namespace for it (and notify the host), the others go on",
        run: nvme_subsystem_remove_ns,
    },
    Method {
        name: "nvme_subsystem_add_host",
        about: "{nqn, host}: let a host NQN connect to a subsystem",
        run: nvme_subsystem_add_host,
    },
    Method {
        name: "nvme_subsystem_remove_host",
        about: "{nqn, host}: stop letting a host NQN connect; its controllers of that subsystem end",
        run: nvme_subsystem_remove_host,
    },
    Method {
        name: "iscsi_target_list",
        about: "iSCSI: every target (each export's own, then the configured ones: IQN, LUNs, allow rules or initiator list, portals) and its logged-in sessions (initiator, ISID, TSIH, digests, LUN sessions)",
        run: iscsi_target_list,
    },
    Method {
        name: "iscsi_target_create",
        about: "{iqn, allow?}: a target with no LUNs yet; allow (a list of initiator IQNs) admits only those, without it any initiator may log in",
        run: iscsi_target_create,
    },
    Method {
        name: "iscsi_target_delete",
        about: "{iqn}: delete a target; its sessions end",
        run: iscsi_target_delete,
    },
    Method {
        name: "iscsi_target_add_lun",
        about: "{iqn, export, lun?}: add an export as a LUN (lun: the lowest free one by default); initiators see it when they log in again",
        run: iscsi_target_add_lun,
    },
    Method {
        name: "iscsi_target_remove_lun",
        about: "{iqn, lun}: remove a LUN; logged-in sessions answer LOGICAL UNIT NOT SUPPORTED for it (and report REPORTED LUNS DATA HAS CHANGED), the other LUNs go on",
        run: iscsi_target_remove_lun,
    },
    Method {
        name: "iscsi_target_add_initiator",
        about: "{iqn, initiator}: let an initiator IQN log in (a target that admitted any initiator admits only its list from then on; the others' sessions end)",
        run: iscsi_target_add_initiator,
    },
    Method {
        name: "iscsi_target_remove_initiator",
        about: "{iqn, initiator}: stop letting an initiator IQN log in; its sessions of that target end",
        run: iscsi_target_remove_initiator,
    },
    Method {
        name: "session_list",
        about: "every session: id, export, host, peer, live queues",
        run: session_list,
    },
    Method {
        name: "session_close",
        about: "{session}: close a session (its I/O in flight fails; the host may connect again)",
        run: session_close,
    },
    Method {
        name: "stats",
        about: "{offset, limit}: live counters, sessions paged (never truncated)",
        run: stats,
    },
    Method {
        name: "save_config",
        about: "{path?}: the running state as a list of calls (also written to path on the target host)",
        run: save_config,
    },
    Method {
        name: "load_config",
        about: "{path} or {config}: apply a list of calls to the running target",
        run: load_config,
    },
    Method {
        name: "rpc_get_methods",
        about: "the methods and what each does",
        run: rpc_get_methods,
    },
];

/// Lets one call run at a time, whoever makes it (the control socket's clients, each on its
/// own thread; `Target::call`; a config applied at start): a call checks what it depends on
/// and then changes it (an NVMe namespace's export exists, then the namespace is added), and
/// another call in between (that export removed) would leave the target in a state no
/// sequence of calls makes.
#[derive(Default)]
pub(crate) struct OneAtATime {
    lock: std::sync::Mutex<()>,
    /// Calls waiting for their turn (not those that found it free).
    waiting: std::sync::atomic::AtomicUsize,
}

impl OneAtATime {
    /// Waits for the call running now, if any, to end; the guard is this call's turn.
    pub(crate) fn turn(&self) -> std::sync::MutexGuard<'_, ()> {
        self.turn_waited().0
    }

    /// `turn`, and whether another call held it first (this one waited).
    pub(crate) fn turn_waited(&self) -> (std::sync::MutexGuard<'_, ()>, bool) {
        use std::sync::atomic::Ordering::Relaxed;
        use std::sync::TryLockError;
        // A call that panicked left nothing half-done that the lock protects (it guards no
        // data): the next call goes on.
        match self.lock.try_lock() {
            Ok(turn) => return (turn, false),
            Err(TryLockError::Poisoned(p)) => return (p.into_inner(), false),
            Err(TryLockError::WouldBlock) => {}
        }
        self.waiting.fetch_add(1, Relaxed);
        let turn = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Relaxed);
        (turn, true)
    }

    /// How many calls wait for their turn.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Runs one call, once any call running now has ended.
pub(crate) fn dispatch(
    shared: &Arc<Shared>,
    method: &str,
    params: Value,
) -> Result<Value, RpcError> {
    dispatch_unless(shared, method, params, &|| false)
}

/// [`dispatch`], unless the call had to wait for its turn and `caller_left` says, once it has
/// it, that nobody waits for its answer any more: a CLI that gave up waiting behind a long call
/// (and told its user the call got no answer) must not have it run minutes later. A call that
/// did not wait runs whoever is left to read its answer (a script may send and close).
pub(crate) fn dispatch_unless(
    shared: &Arc<Shared>,
    method: &str,
    params: Value,
    caller_left: &dyn Fn() -> bool,
) -> Result<Value, RpcError> {
    let (_turn, waited) = shared.calls.turn_waited();
    if waited && caller_left() {
        crate::log!(
            crate::log::Level::Warn,
            "control socket: {} not run: its caller hung up while it waited for its turn",
            method.escape_debug()
        );
        return Err(RpcError {
            code: RpcError::REFUSED,
            message: "not run: the caller hung up while the call waited for its turn".into(),
        });
    }
    // A call that came while the target stops would change what the stop no longer looks at:
    // an export added after the exports were closed, a listener bound after they were dropped.
    if shared.registry.is_closed() {
        return Err(RpcError::refused("the target is stopping".into()));
    }
    run(shared, method, params)
}

/// Runs one call; the caller has its turn.
fn run(shared: &Arc<Shared>, method: &str, params: Value) -> Result<Value, RpcError> {
    let Some(m) = METHODS.iter().find(|m| m.name == method) else {
        return Err(RpcError {
            code: RpcError::NO_METHOD,
            message: format!(
                "no method '{}' (rpc_get_methods lists them)",
                method.escape_debug()
            ),
        });
    };
    (m.run)(shared, params)
}

/// A method that takes no parameters: absent, null or `{}`; any named one is refused, as
/// every method refuses names it does not know (a filter the caller believed applied).
fn no_params(method: &str, p: Value) -> Result<(), RpcError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Empty {}
    params::<Empty>(method, p, "no parameters ({})").map(|_| ())
}

/// Decodes a method's parameters; absent parameters are an empty object.
fn params<T: DeserializeOwned>(method: &str, p: Value, shape: &str) -> Result<T, RpcError> {
    let p = if p.is_null() { json!({}) } else { p };
    serde_json::from_value(p)
        .map_err(|e| RpcError::params(format!("{method}: {e}; expected {shape}")))
}

fn target_options(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let mut want = sh.options.clone();
    // No parameters: the options as they are (what `blkwire rpc target_options` asks).
    let p = if p.is_null() { json!({}) } else { p };
    want.patch(&p).map_err(RpcError::params)?;
    if want != sh.options {
        return Err(RpcError::refused(
            "target options (threads, limits, TLS) are fixed when the target starts: change \
             them in the config file or on the command line and restart"
                .into(),
        ));
    }
    Ok(sh.options.to_json())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PathParam {
    path: PathBuf,
}

fn keys_load(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: PathParam = params("keys_load", p, "{\"path\": \"/etc/blkwire/keys\"}")?;
    let store = blkwire_auth::KeyStore::load_owned(&p.path).map_err(RpcError::refused)?;
    let hosts = store.len();
    sh.registry.access.set_keys(store);
    // Kept (`save_config`) as a path that still names it from another working directory.
    let path = std::path::absolute(&p.path).unwrap_or(p.path);
    *sh.keys_path.lock().unwrap_or_else(|e| e.into_inner()) = Some(path);
    let closed = sh.registry.revoke_unpermitted();
    sh.close_sessions(&closed);
    Ok(json!({ "hosts": hosts, "closed_sessions": closed.len() }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostsParam {
    hosts: Vec<String>,
}

fn admins_set(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: HostsParam = params("admins_set", p, "{\"hosts\": [\"HOST-ID\", ...]}")?;
    sh.registry
        .access
        .set_admins(p.hosts.clone())
        .map_err(RpcError::refused)?;
    Ok(json!({ "hosts": p.hosts }))
}

fn host_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("host_list", p)?;
    let admins = sh.registry.access.admins();
    let hosts: Vec<Value> = match sh.registry.access.keys() {
        Some(k) => k
            .hosts()
            .map(|h| json!({ "host": h, "admin": admins.iter().any(|a| a == h) }))
            .collect(),
        None => Vec::new(),
    };
    Ok(Value::Array(hosts))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportAddParam {
    name: String,
    spec: String,
}

/// An export's `export_list` entry.
fn export_entry(sh: &Arc<Shared>, name: &str) -> Value {
    sh.registry
        .describe_exports()
        .into_iter()
        .find(|e| e["name"] == name)
        .unwrap_or(Value::Null)
}

fn export_add(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: ExportAddParam = params(
        "export_add",
        p,
        "{\"name\": \"disk0\", \"spec\": \"mem:1G\"} (spec as after NAME= on the command line)",
    )?;
    if p.name.contains('=') {
        return Err(RpcError::params(format!(
            "bad export name '{}': it may not contain '='",
            p.name.escape_debug()
        )));
    }
    // An export's own NVMe subsystem is NQN_PREFIX + its name: one configured under that NQN
    // (before the export existed) would hide it, and a saved config (exports first) would
    // not load.
    let own = format!("{}{}", crate::nvme::spec::NQN_PREFIX, p.name);
    if sh.registry.nvme.subsystem(&own).is_some() {
        return Err(RpcError::refused(format!(
            "export name '{}' is taken: NVMe subsystem '{own}' is configured under the NQN \
             that would be its own; choose another name, or delete that subsystem first",
            p.name.escape_debug()
        )));
    }
    let spec = ExportSpec::parse(&format!("{}={}", p.name, p.spec))
        .map_err(|e| RpcError::params(e.to_string()))?
        .absolute();
    // What is wrong with the request itself is INVALID_PARAMS, as a spec's syntax is: a
    // backend no target knows, rules that do not parse. What the target cannot do with it
    // (a name taken, a file it cannot open) is REFUSED.
    spec.kind().map_err(|e| RpcError::params(e.to_string()))?;
    check_rules(&p.name, spec.allow.as_deref())?;
    sh.registry.add_export(spec).map_err(RpcError::refused)?;
    crate::log!(
        sh.change_level(),
        "export '{}' added: {}",
        p.name.escape_debug(),
        p.spec.escape_debug()
    );
    Ok(export_entry(sh, &p.name))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportRemoveParam {
    name: String,
    #[serde(default)]
    force: bool,
}

fn export_remove(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: ExportRemoveParam = params(
        "export_remove",
        p,
        "{\"name\": \"disk0\", \"force\": false}",
    )?;
    let closed = sh
        .registry
        .remove_export(&p.name, p.force)
        .map_err(RpcError::refused)?;
    sh.close_sessions(&closed);
    sh.export_removed(&p.name);
    sh.registry.nvme.forget_export(&p.name);
    sh.registry.iscsi.forget_export(&p.name);
    crate::log!(
        sh.change_level(),
        "export '{}' removed{}",
        p.name,
        match closed.len() {
            0 => String::new(),
            n => format!(", closing {n} session(s)"),
        }
    );
    Ok(json!({ "name": p.name, "closed_sessions": closed.len() }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportResizeParam {
    name: String,
    /// Bytes (a number) or a size as on the command line (a string: "2G").
    size: Value,
}

fn export_resize(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: ExportResizeParam = params(
        "export_resize",
        p,
        "{\"name\": \"disk0\", \"size\": \"2G\"} (size in bytes, or as on the command line)",
    )?;
    let size = match &p.size {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            RpcError::params(format!(
                "export_resize: size {n} is not a whole number of bytes"
            ))
        })?,
        Value::String(s) => {
            parse_size(s).map_err(|e| RpcError::params(format!("export_resize: {e}")))?
        }
        other => {
            return Err(RpcError::params(format!(
            "export_resize: size must be a number of bytes or a size such as \"2G\", not {other}"
        )))
        }
    };
    let old = sh
        .registry
        .resize_export(&p.name, size)
        .map_err(|e| match e {
            ResizeError::BadSize(m) => RpcError::params(m),
            ResizeError::Refused(m) => RpcError::refused(m),
        })?;
    if old != size {
        crate::log!(
            sh.change_level(),
            "export '{}' resized from {} to {}",
            p.name,
            format_size(old),
            format_size(size)
        );
    }
    let mut e = export_entry(sh, &p.name);
    e["previous_size"] = old.into();
    Ok(e)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetAllowParam {
    name: String,
    /// Required, null or not: left out, serde would take it for null, which removes the rules
    /// and opens the export to every host (`Option::deserialize` keeps the field mandatory).
    #[serde(deserialize_with = "Option::deserialize")]
    allow: Option<String>,
}

fn export_set_allow(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: SetAllowParam = params(
        "export_set_allow",
        p,
        "{\"name\": \"disk0\", \"allow\": \"RULE[+RULE...]\" or null}",
    )?;
    // An empty string is not "no rules" (that is null): it is what an unset shell variable
    // gives, and taken for null it would open the export to every host.
    if p.allow.as_deref() == Some("") {
        return Err(RpcError::refused(format!(
            "export '{}': allow is empty: give the rules (RULE[+RULE...]), or null to remove \
             them (the export is then open to every host the target admits)",
            p.name
        )));
    }
    check_rules(&p.name, p.allow.as_deref())?;
    let closed = sh
        .registry
        .set_allow(&p.name, p.allow)
        .map_err(RpcError::refused)?;
    sh.close_sessions(&closed);
    let mut e = export_entry(sh, &p.name);
    e["closed_sessions"] = closed.len().into();
    Ok(e)
}

/// Allow rules that do not parse are the request's fault (INVALID_PARAMS); the registry
/// checks them again with what depends on the target (host ids need keys: REFUSED).
fn check_rules(export: &str, rules: Option<&str>) -> Result<(), RpcError> {
    match rules.map(blkwire_auth::Acl::parse) {
        Some(Err(e)) => Err(RpcError::params(format!("export '{export}': {e}"))),
        _ => Ok(()),
    }
}

fn export_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("export_list", p)?;
    Ok(Value::Array(sh.registry.describe_exports()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UrlParam {
    url: String,
}

fn listener_add(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: UrlParam = params("listener_add", p, "{\"url\": \"tcp://0.0.0.0:7700\"}")?;
    let url = sh.add_listener(&p.url)?;
    Ok(json!({ "url": url }))
}

fn listener_remove(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: UrlParam = params("listener_remove", p, "{\"url\": \"tcp://0.0.0.0:7700\"}")?;
    let url = sh.remove_listener(&p.url).map_err(RpcError::refused)?;
    Ok(json!({ "url": url }))
}

fn listener_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("listener_list", p)?;
    Ok(Value::Array(
        sh.listener_urls()
            .into_iter()
            .map(|(url, kind)| json!({ "url": url, "kind": kind }))
            .collect(),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddrParam {
    addr: String,
}

fn metrics_listen(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: AddrParam = params("metrics_listen", p, "{\"addr\": \"127.0.0.1:9100\"}")?;
    let url = sh.serve_metrics(&p.addr).map_err(|e| match e {
        crate::Error::Config(m) => RpcError::params(m),
        other => RpcError::refused(other.to_string()),
    })?;
    Ok(json!({ "url": url }))
}

fn nvme_subsystem_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("nvme_subsystem_list", p)?;
    use crate::nvme::spec::{default_serial, Namespace, DEFAULT_MODEL, NQN_PREFIX};
    let ctrls = sh.registry.nvme.describe();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let namespace = |nsid: u32, e: &Arc<blkwire_backend::Export>, ns: Namespace| {
        json!({
            "nsid": nsid,
            "export": e.name,
            "size": ns.size,
            "block_size": 1u64 << ns.lba_shift,
            "nguid": hex(&ns.nguid),
            "uuid": hex(&ns.uuid),
            "read_only": e.read_only,
        })
    };
    let controllers = |nqn: &str| {
        ctrls
            .iter()
            .filter(|c| c["subnqn"] == nqn)
            .cloned()
            .collect::<Vec<_>>()
    };
    let exports = sh.registry.exports();
    // Every export's own subsystem, then the configured ones.
    let mut subsystems: Vec<Value> = exports
        .iter()
        .map(|e| {
            let nqn = format!("{NQN_PREFIX}{}", e.name);
            json!({
                "nqn": nqn,
                "configured": false,
                "serial": default_serial(&nqn),
                "model": DEFAULT_MODEL,
                "namespaces": [namespace(1, e, Namespace::of(e, &nqn))],
                "allow": sh.registry.allow_of(&e.name),
                "controllers": controllers(&nqn),
            })
        })
        .collect();
    for sub in sh.registry.nvme.subsystems() {
        let mut v = sub.describe();
        v["configured"] = true.into();
        v["namespaces"] = sub
            .namespaces
            .iter()
            .filter_map(|(nsid, name)| {
                let e = exports.iter().find(|e| &e.name == name)?;
                Some(namespace(*nsid, e, Namespace::in_subsystem(e, &sub.nqn)))
            })
            .collect();
        v["controllers"] = controllers(&sub.nqn).into();
        subsystems.push(v);
    }
    Ok(Value::Array(subsystems))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubsystemCreateParam {
    nqn: String,
    serial: Option<String>,
    model: Option<String>,
    #[serde(default)]
    allow_any_host: bool,
}

fn nvme_subsystem_create(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: SubsystemCreateParam = params(
        "nvme_subsystem_create",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\", \"serial\": \"SN1\", \"model\": \"M\", \
         \"allow_any_host\": false}",
    )?;
    let taken = p
        .nqn
        .strip_prefix(crate::nvme::spec::NQN_PREFIX)
        .is_some_and(|n| sh.registry.has_export(n));
    let sub = sh
        .registry
        .nvme
        .create_subsystem(
            &p.nqn,
            p.serial.as_deref(),
            p.model.as_deref(),
            p.allow_any_host,
            taken,
        )
        .map_err(RpcError::params)?;
    crate::log!(sh.change_level(), "NVMe subsystem '{}' created", p.nqn);
    Ok(sub.describe())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NqnParam {
    nqn: String,
}

/// Closes sessions the NVMe subsystem and iSCSI target calls took away: revoked (no queue
/// joins them any more), then closed on the reactors (connections fence the namespace or LUN,
/// or end with their last one). Returns how many were still open (a removed namespace's
/// session stays listed with its controller, closed already).
fn close_nvme_sessions(sh: &Arc<Shared>, sessions: &[u32]) -> usize {
    let open: Vec<u32> = sessions
        .iter()
        .copied()
        .filter(|&s| !sh.registry.is_revoked(s))
        .collect();
    for &s in &open {
        sh.registry.revoke(s);
    }
    sh.close_sessions(&open);
    open.len()
}

fn nvme_subsystem_delete(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: NqnParam = params(
        "nvme_subsystem_delete",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\"}",
    )?;
    let closed = sh
        .registry
        .nvme
        .delete_subsystem(&p.nqn)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    crate::log!(sh.change_level(), "NVMe subsystem '{}' deleted", p.nqn);
    Ok(json!({ "nqn": p.nqn, "closed_sessions": closed }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddNsParam {
    nqn: String,
    export: String,
    nsid: Option<u32>,
}

fn nvme_subsystem_add_ns(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: AddNsParam = params(
        "nvme_subsystem_add_ns",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\", \"export\": \"disk0\", \"nsid\": 1}",
    )?;
    if !sh.registry.has_export(&p.export) {
        return Err(RpcError::params(format!(
            "nvme_subsystem_add_ns: no export '{}' (`blkwire export ls` or export_list shows them)",
            p.export.escape_debug()
        )));
    }
    let nsid = sh
        .registry
        .nvme
        .add_namespace(&p.nqn, &p.export, p.nsid)
        .map_err(RpcError::params)?;
    crate::log!(
        sh.change_level(),
        "NVMe subsystem '{}': export '{}' is namespace {nsid}",
        p.nqn,
        p.export
    );
    Ok(json!({ "nqn": p.nqn, "export": p.export, "nsid": nsid }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveNsParam {
    nqn: String,
    nsid: u32,
}

fn nvme_subsystem_remove_ns(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: RemoveNsParam = params(
        "nvme_subsystem_remove_ns",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\", \"nsid\": 1}",
    )?;
    let (closed, export) = sh
        .registry
        .nvme
        .remove_namespace(&p.nqn, p.nsid)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    crate::log!(
        sh.change_level(),
        "NVMe subsystem '{}': namespace {} (export '{export}') removed",
        p.nqn,
        p.nsid
    );
    Ok(json!({ "nqn": p.nqn, "nsid": p.nsid, "export": export, "closed_sessions": closed }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostParam {
    nqn: String,
    host: String,
}

fn nvme_subsystem_add_host(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: HostParam = params(
        "nvme_subsystem_add_host",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\", \"host\": \"nqn.2014-08.org.nvmexpress:uuid:...\"}",
    )?;
    sh.registry
        .nvme
        .add_host(&p.nqn, &p.host)
        .map_err(RpcError::params)?;
    Ok(json!({ "nqn": p.nqn, "host": p.host }))
}

fn nvme_subsystem_remove_host(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: HostParam = params(
        "nvme_subsystem_remove_host",
        p,
        "{\"nqn\": \"nqn.2026-11.com.example:db\", \"host\": \"nqn.2014-08.org.nvmexpress:uuid:...\"}",
    )?;
    let closed = sh
        .registry
        .nvme
        .remove_host(&p.nqn, &p.host)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    Ok(json!({ "nqn": p.nqn, "host": p.host, "closed_sessions": closed }))
}

fn iscsi_target_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("iscsi_target_list", p)?;
    let r = &sh.registry;
    // Records are kept while their sessions exist (a reinstating login waits for a closing
    // one); only the open ones are listed.
    r.iscsi.retain_sessions(&|id| r.holds(id));
    let shown = |id| !r.is_revoked(id);
    let portals = r.iscsi.portals();
    let max_io = r.limits().max_io;
    let lun = |n: u64, e: &Arc<blkwire_backend::Export>| {
        let info = crate::frontend::iscsi::lun_info(e, e.size(), max_io, false);
        json!({
            "lun": n,
            "export": e.name,
            "size": e.size(),
            "block_size": info.block_size,
            "read_only": e.read_only,
            "naa": format!("{:016x}", info.naa),
        })
    };
    let exports = r.exports();
    // Every export's own target, then the configured ones.
    let mut targets: Vec<Value> = exports
        .iter()
        .map(|e| {
            let iqn = crate::iscsi::target_name(&e.name);
            json!({
                "iqn": iqn,
                "configured": false,
                "luns": [lun(0, e)],
                "allow": r.allow_of(&e.name),
                "portals": portals,
                "sessions": r.iscsi.describe_sessions(&iqn, &shown),
            })
        })
        .collect();
    for t in r.iscsi.targets() {
        let mut v = t.describe();
        v["luns"] = t
            .luns
            .iter()
            .filter_map(|(n, name)| Some(lun(*n, exports.iter().find(|e| &e.name == name)?)))
            .collect();
        v["portals"] = json!(portals);
        v["sessions"] = r.iscsi.describe_sessions(&t.iqn, &shown).into();
        targets.push(v);
    }
    Ok(Value::Array(targets))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IscsiTargetCreateParam {
    iqn: String,
    allow: Option<Vec<String>>,
}

fn iscsi_target_create(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: IscsiTargetCreateParam = params(
        "iscsi_target_create",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\", \"allow\": [\"iqn.1994-05.com.redhat:host1\"]}",
    )?;
    let taken = p
        .iqn
        .strip_prefix(blkwire_wire::iscsi::BLKWIRE_IQN_PREFIX)
        .is_some_and(|n| sh.registry.has_export(n));
    let t = sh
        .registry
        .iscsi
        .create_target(&p.iqn, p.allow, taken)
        .map_err(RpcError::params)?;
    crate::log!(sh.change_level(), "iSCSI target '{}' created", p.iqn);
    Ok(t.describe())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IqnParam {
    iqn: String,
}

fn iscsi_target_delete(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: IqnParam = params(
        "iscsi_target_delete",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\"}",
    )?;
    let closed = sh
        .registry
        .iscsi
        .delete_target(&p.iqn)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    crate::log!(sh.change_level(), "iSCSI target '{}' deleted", p.iqn);
    Ok(json!({ "iqn": p.iqn, "closed_sessions": closed }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddLunParam {
    iqn: String,
    export: String,
    lun: Option<u64>,
}

fn iscsi_target_add_lun(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: AddLunParam = params(
        "iscsi_target_add_lun",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\", \"export\": \"disk0\", \"lun\": 0}",
    )?;
    if !sh.registry.has_export(&p.export) {
        return Err(RpcError::params(format!(
            "iscsi_target_add_lun: no export '{}' (`blkwire export ls` or export_list shows them)",
            p.export.escape_debug()
        )));
    }
    let lun = sh
        .registry
        .iscsi
        .add_lun(&p.iqn, &p.export, p.lun)
        .map_err(RpcError::params)?;
    crate::log!(
        sh.change_level(),
        "iSCSI target '{}': export '{}' is LUN {lun}",
        p.iqn,
        p.export
    );
    Ok(json!({ "iqn": p.iqn, "export": p.export, "lun": lun }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveLunParam {
    iqn: String,
    lun: u64,
}

fn iscsi_target_remove_lun(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: RemoveLunParam = params(
        "iscsi_target_remove_lun",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\", \"lun\": 0}",
    )?;
    let (closed, export) = sh
        .registry
        .iscsi
        .remove_lun(&p.iqn, p.lun)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    crate::log!(
        sh.change_level(),
        "iSCSI target '{}': LUN {} (export '{export}') removed",
        p.iqn,
        p.lun
    );
    Ok(json!({ "iqn": p.iqn, "lun": p.lun, "export": export, "closed_sessions": closed }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InitiatorParam {
    iqn: String,
    initiator: String,
}

fn iscsi_target_add_initiator(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: InitiatorParam = params(
        "iscsi_target_add_initiator",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\", \"initiator\": \"iqn.1994-05.com.redhat:host1\"}",
    )?;
    let closed = sh
        .registry
        .iscsi
        .add_initiator(&p.iqn, &p.initiator)
        .map_err(RpcError::params)?;
    let closed = close_nvme_sessions(sh, &closed);
    Ok(json!({ "iqn": p.iqn, "initiator": p.initiator, "closed_sessions": closed }))
}

fn iscsi_target_remove_initiator(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: InitiatorParam = params(
        "iscsi_target_remove_initiator",
        p,
        "{\"iqn\": \"iqn.2026-11.com.example:db\", \"initiator\": \"iqn.1994-05.com.redhat:host1\"}",
    )?;
    let closed = sh
        .registry
        .iscsi
        .remove_initiator(&p.iqn, &p.initiator)
        .map_err(RpcError::refused)?;
    let closed = close_nvme_sessions(sh, &closed);
    Ok(json!({ "iqn": p.iqn, "initiator": p.initiator, "closed_sessions": closed }))
}

fn session_list(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("session_list", p)?;
    Ok(Value::Array(sh.registry.describe_sessions()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionParam {
    session: u32,
}

fn session_close(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: SessionParam = params("session_close", p, "{\"session\": 1234}")?;
    if !sh.registry.revoke(p.session) {
        return Err(RpcError::refused(format!(
            "no session {} (`blkwire session ls` or session_list shows them)",
            p.session
        )));
    }
    sh.close_sessions(&[p.session]);
    Ok(json!({ "session": p.session }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PageParam {
    #[serde(default)]
    offset: usize,
    #[serde(default = "default_page")]
    limit: usize,
}

fn default_page() -> usize {
    100
}

fn stats(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: PageParam = params("stats", p, "{\"offset\": 0, \"limit\": 100}")?;
    if p.limit == 0 {
        return Err(RpcError::params("stats: limit must be at least 1".into()));
    }
    Ok(sh.stats_page(p.offset, p.limit))
}

/// The calls that rebuild the running target: its options, keys and admins, its exports in
/// order, then its listeners (bound addresses, so a port 0 comes back as the same port).
pub(crate) fn running_config(sh: &Arc<Shared>) -> Vec<Call> {
    let mut calls = vec![Call::new("target_options", sh.options.to_json())];
    if let Some(p) = sh
        .keys_path
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
    {
        calls.push(Call::new("keys_load", json!({ "path": p })));
    }
    let admins = sh.registry.access.admins();
    if !admins.is_empty() {
        calls.push(Call::new("admins_set", json!({ "hosts": admins })));
    }
    for s in sh.registry.export_specs() {
        calls.push(Call::new(
            "export_add",
            json!({ "name": s.name, "spec": s.options() }),
        ));
    }
    for sub in sh.registry.nvme.subsystems() {
        calls.push(Call::new(
            "nvme_subsystem_create",
            json!({
                "nqn": sub.nqn,
                "serial": sub.serial,
                "model": sub.model,
                "allow_any_host": sub.allow_any_host,
            }),
        ));
        for (nsid, export) in &sub.namespaces {
            calls.push(Call::new(
                "nvme_subsystem_add_ns",
                json!({ "nqn": sub.nqn, "export": export, "nsid": nsid }),
            ));
        }
        for host in &sub.hosts {
            calls.push(Call::new(
                "nvme_subsystem_add_host",
                json!({ "nqn": sub.nqn, "host": host }),
            ));
        }
    }
    for t in sh.registry.iscsi.targets() {
        let mut create = json!({ "iqn": t.iqn });
        if !t.any_initiator {
            create["allow"] = json!(t.initiators);
        }
        calls.push(Call::new("iscsi_target_create", create));
        for (lun, export) in &t.luns {
            calls.push(Call::new(
                "iscsi_target_add_lun",
                json!({ "iqn": t.iqn, "export": export, "lun": lun }),
            ));
        }
    }
    for l in &sh.lock_listeners().list {
        calls.push(Call::new("listener_add", json!({ "url": l.config_url() })));
    }
    if let Some(addr) = sh.metrics.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        calls.push(Call::new("metrics_listen", json!({ "addr": addr })));
    }
    calls
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SaveParam {
    path: Option<PathBuf>,
}

fn save_config(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: SaveParam = params(
        "save_config",
        p,
        "{} or {\"path\": \"/etc/blkwire/target.json\"}",
    )?;
    let calls = running_config(sh);
    let doc = serde_json::to_value(&calls).unwrap_or_default();
    // Checked before a file is written: one the reply cannot carry would be written, then
    // the call answered as failed.
    let len = doc.to_string().len();
    if len + 1024 > crate::rpc::MAX_REPLY {
        return Err(RpcError::refused(format!(
            "the config is {len} bytes, more than one reply carries ({} MiB): nothing was \
             written",
            crate::rpc::MAX_REPLY >> 20
        )));
    }
    if let Some(path) = p.path {
        write_config(&path, &calls).map_err(RpcError::refused)?;
    }
    Ok(doc)
}

/// A config as written to a file: a JSON array of one call per line, readable, and no more
/// than a few bytes a call longer than the reply that carried it (indented, a config near the
/// largest reply would not load again: `MAX_CONFIG_FILE`).
pub fn config_text<T: serde::Serialize>(calls: &[T]) -> String {
    let mut text = String::from("[");
    for (i, c) in calls.iter().enumerate() {
        text.push_str(if i == 0 { "\n  " } else { ",\n  " });
        text.push_str(&serde_json::to_string(c).unwrap_or_default());
    }
    text.push_str("\n]\n");
    text
}

/// Writes a config atomically (`write_private`): it names key files and devices.
pub fn write_config(path: &Path, calls: &[Call]) -> Result<(), String> {
    write_private(path, config_text(calls).as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Writes `path` so that a reader sees the old content or all of the new, never a part, and
/// only its owner may read it (mode 0600): a new temporary file beside it (same filesystem,
/// so the rename is atomic), synced, renamed over it, and the directory synced. The temporary
/// has an unpredictable name and is created exclusively, never following a symlink: in a
/// directory others may write to, nothing they planted is written through or reused.
pub fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    let mut tries = 0;
    let (tmp, mut f) = loop {
        tries += 1;
        let mut n = std::ffi::OsString::from(".");
        n.push(name);
        n.push(format!(".{:016x}.tmp", blkwire_auth::random_u64()));
        let tmp = dir.join(n);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            // Taken (planted, or a one in 2^64 clash): another name.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => continue,
            Err(e) => return Err(e),
        }
    };
    let written = f
        .write_all(data)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename itself lasts once the directory is synced.
    std::fs::File::open(dir)?.sync_all()
}

/// The largest config `load_config` reads from a file: as large as the reply of a
/// `save_config` may be (`rpc::MAX_REPLY`), a hundred thousand exports and more, written a
/// call per line (`config_text`: four bytes a call more).
pub const MAX_CONFIG_FILE: u64 = 20 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadParam {
    path: Option<PathBuf>,
    config: Option<Vec<Call>>,
}

fn load_config(sh: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    let p: LoadParam = params(
        "load_config",
        p,
        "{\"path\": \"FILE\"} or {\"config\": [calls]}",
    )?;
    let calls = match (p.path, p.config) {
        (Some(path), None) => {
            // A regular file of bounded size: a FIFO would hold this call (and, calls taking
            // turns, every other) until someone writes to it, /dev/zero would never end.
            let (text, _) = blkwire_auth::keys::read_regular(&path, MAX_CONFIG_FILE)
                .map_err(|e| RpcError::refused(format!("cannot read {}: {e}", path.display())))?;
            parse_config(&text, &path.display().to_string()).map_err(RpcError::params)?
        }
        (None, Some(c)) => c,
        _ => {
            return Err(RpcError::params(
                "load_config: give either path (a file on the target host) or config (the calls)"
                    .into(),
            ))
        }
    };
    // Within this call's turn: no other call runs between the config's calls.
    apply_in_turn(sh, &calls, true).map_err(|(_, e)| e)?;
    Ok(json!({ "applied": calls.len() }))
}

/// Applies calls in order, stopping at the first that fails, once any call running now has
/// ended, and with no other call between them. With `numbered`, the error says which call it
/// was and that the ones before it were applied (a config file); without, it is the call's own
/// message (calls made from command-line flags, which the user knows by their flag). Also
/// returns the method that failed.
pub(crate) fn apply(
    sh: &Arc<Shared>,
    calls: &[Call],
    numbered: bool,
) -> Result<(), (String, RpcError)> {
    let _turn = sh.calls.turn();
    apply_in_turn(sh, calls, numbered)
}

/// `apply` for a caller that has its turn.
fn apply_in_turn(
    sh: &Arc<Shared>,
    calls: &[Call],
    numbered: bool,
) -> Result<(), (String, RpcError)> {
    for (i, c) in calls.iter().enumerate() {
        let result = if matches!(c.method.as_str(), "load_config" | "save_config") {
            Err(RpcError::params(
                "a config cannot load or save configs".into(),
            ))
        } else {
            run(sh, &c.method, c.params.clone())
        };
        result.map_err(|e| {
            let message = match (numbered, i) {
                (false, _) => e.message,
                (true, 0) => format!("call 1 ({}): {}", c.method, e.message),
                (true, _) => format!(
                    "call {} ({}): {} (the {i} call(s) before it were applied)",
                    i + 1,
                    c.method,
                    e.message
                ),
            };
            (
                c.method.clone(),
                RpcError {
                    code: e.code,
                    message,
                },
            )
        })?;
    }
    Ok(())
}

fn rpc_get_methods(_: &Arc<Shared>, p: Value) -> Result<Value, RpcError> {
    no_params("rpc_get_methods", p)?;
    Ok(Value::Array(
        METHODS
            .iter()
            .map(|m| json!({ "name": m.name, "about": m.about }))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config file is a call per line, parses back to the calls, and is no more than four
    /// bytes a call (and its brackets) longer than the compact reply that carried it: a
    /// config as large as a reply may be loads again (`MAX_CONFIG_FILE`).
    #[test]
    fn a_config_file_is_a_call_per_line_and_about_as_long_as_the_reply() {
        let calls: Vec<Call> = (0..1000)
            .map(|i| {
                Call::new(
                    "export_add",
                    serde_json::json!({"name": format!("e{i}"), "spec": "null:1G"}),
                )
            })
            .collect();
        let text = config_text(&calls);
        assert_eq!(text.lines().count(), calls.len() + 2);
        assert_eq!(parse_config(&text, "test").unwrap().len(), calls.len());
        let compact = serde_json::to_string(&calls).unwrap().len();
        assert!(
            text.len() <= compact + 4 * calls.len() + 4,
            "{} vs {compact}",
            text.len()
        );
        let largest = crate::rpc::MAX_REPLY as u64;
        assert!(
            MAX_CONFIG_FILE >= largest + largest / 4,
            "room for a call per line"
        );
    }

    #[test]
    fn options_round_trip_through_their_call() {
        let mut o = Options {
            threads: 3,
            ..Options::default()
        };
        o.limits.max_memory = 512 << 20;
        o.tls.mode = TlsMode::On;
        o.tls.cert = Some("/c.pem".into());
        let mut back = Options::default();
        back.patch(&o.to_json()).unwrap();
        assert_eq!(back, o);
    }

    #[test]
    fn options_are_checked_one_by_one() {
        let mut o = Options::default();
        let e = o.patch(&json!({"max_io": 12})).unwrap_err();
        assert!(e.contains("max_io must be a whole number from 4096"), "{e}");
        let e = o.patch(&json!({"thread": 2})).unwrap_err();
        assert!(
            e.contains("unknown option 'thread'") && e.contains("threads"),
            "{e}"
        );
        let e = o.patch(&json!({"tls": "maybe"})).unwrap_err();
        assert!(e.contains("off, on or require"), "{e}");
        assert_eq!(
            o,
            Options::default(),
            "a refused patch changes nothing it refused"
        );
    }

    /// A config is written whole or not at all, owner only, and leaves no temporary behind;
    /// a symlink planted where a temporary could be (the fixed name it once had, in a
    /// directory others may write) is not written through.
    #[test]
    fn a_config_is_written_atomically_for_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("blkwire-write-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let names = || {
            let mut n: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            n.sort();
            n
        };
        let file = dir.join("config.json");
        std::fs::write(&file, "old and longer").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("config.json.tmp")).unwrap();
        let calls = [Call::new("export_list", Value::Null)];
        write_config(&file, &calls).unwrap();
        assert_eq!(
            parse_config(&std::fs::read_to_string(&file).unwrap(), "f").unwrap(),
            calls
        );
        let meta = std::fs::symlink_metadata(&file).unwrap();
        assert!(meta.is_file(), "a file, not the planted link");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
        assert_eq!(names(), ["config.json", "config.json.tmp", "victim"]);
        // A rename that fails (over a non-empty directory) leaves no temporary behind either.
        std::fs::create_dir_all(dir.join("sub/dir")).unwrap();
        let e = write_config(&dir.join("sub"), &calls).unwrap_err();
        assert!(
            e.starts_with(&format!("cannot write {}", dir.join("sub").display())),
            "{e}"
        );
        assert_eq!(names(), ["config.json", "config.json.tmp", "sub", "victim"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn configs_are_arrays_of_calls() {
        let c = parse_config(
            r#"[{"method":"export_add","params":{"name":"a","spec":"mem:1M"}},{"method":"export_list"}]"#,
            "t.json",
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].params, Value::Null);
        let e = parse_config(r#"{"method":"x"}"#, "t.json").unwrap_err();
        assert!(e.starts_with("t.json: not a blkwire config"), "{e}");
        let e = parse_config(r#"[{"method":"x","parms":{}}]"#, "t.json").unwrap_err();
        assert!(e.contains("parms"), "{e}");
    }
}
