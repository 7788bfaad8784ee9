//! NVMe/TCP frontend, connection setup (NVMe/TCP transport 1.0a §3.6.2; NVMe over Fabrics
//! 1.1 Connect §3.3): ICReq/ICResp and the Fabrics Connect that binds a connection to a
//! controller, on the handshake thread with its deadline. Every export is a subsystem
//! (`nqn.2026-11.io.blkwire:NAME`) with one namespace (NSID 1); configured subsystems
//! ([`Subsystem`]: `serve --subsystem`, the `nvme_subsystem_*` calls) have several namespaces
//! (exports), their own serial and model, and the host NQNs they admit. The discovery
//! controller is at the well-known discovery NQN on every `nvme-tcp://` listener.
//!
//! A Connect on queue 0 with CNTLID 0xFFFF creates a controller: a blkwire session per
//! namespace (queue 0 is the admin queue; with keys configured, admitted only once the host has
//! passed DH-HMAC-CHAP: `admit_authenticated`) served by its own thread (`admin.rs`:
//! properties, Identify, features, log pages, keep-alive), bounded by [`MAX_CONTROLLERS`]
//! ([`MAX_CONTROLLERS_PER_HOST`] per address). A Connect on queue N names that controller; the
//! same host NQN, host id and address (and DH-HMAC-CHAP when keys are configured, on the admin
//! queue before and on this queue) admit it as the sessions' queue N, and the connection goes
//! to a reactor with the I/O frontend (`frontend/nvme.rs`). The controller ends with its admin
//! queue (disconnect, or no Keep Alive within KATO; see `admin.rs` for idle and unauthenticated
//! controllers): its sessions are closed, and with them every I/O queue.

pub mod admin;
pub mod spec;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkwire_auth::{Key, PeerAddr};
use blkwire_wire::nvme_tcp::{
    self, pdu_len, C2HData, CapsuleCmd, Cqe, Direction, IcResp, Params, Pdu, PduError, Progress,
    Sgl, TermReq, IC_LEN,
};
use blkwire_wire::Status;

use crate::frontend::nvme::{IoQueueSetup, NsIo, NvmeIo};
use crate::frontend::StreamFrontend;
use crate::log::Level;
use crate::session::{Admitted, Owner, Registry};
use spec::{cqe_status, fctype, sc, Facts, Namespace};

/// Controllers (admin queues, discovery ones included) served at once: each has a thread.
pub const MAX_CONTROLLERS: usize = 128;
/// Controllers one host address may have at once: a quarter of [`MAX_CONTROLLERS`], so that one
/// address (which needs no key to Connect to the discovery controller) cannot take them all and
/// answer every other host's Connect with Controller Busy. A host has one controller per
/// subsystem it uses, plus discovery.
pub const MAX_CONTROLLERS_PER_HOST: usize = MAX_CONTROLLERS / 4;
/// Discovery controllers at once, over all hosts: they hold no session and need no key, so
/// without a cap of their own a few addresses keeping some open (a Keep Alive a minute) would
/// hold every place, and every host's Connect to a subsystem would be told Controller Busy.
/// Twice a host's limit, so one address alone cannot keep every other host from discovery.
pub const MAX_DISCOVERY_CONTROLLERS: usize = MAX_CONTROLLERS / 2;
/// I/O queues a controller may have (Set Features, Number of Queues, grants at most this).
pub const MAX_IO_QUEUES: u16 = 32;
/// Entries per I/O submission queue at most (CAP.MQES + 1, MAXCMD).
pub const MAX_QUEUE_ENTRIES: u16 = 1024;
/// Admin submission queue entries at most (the host asks for 32).
pub const MAX_ADMIN_ENTRIES: u16 = 128;
/// Bytes of the data of a Connect command.
const CONNECT_DATA: usize = 1024;

/// What the controllers of one target share: the table Connect on an I/O queue looks up, and
/// the listeners the discovery log lists. Only connection setup and admin queues take its lock.
#[derive(Default)]
pub struct Controllers {
    inner: Mutex<Table>,
}

impl Table {
    /// Whether configured subsystem `subnqn` exists and admits `hostnqn`.
    fn admits(&self, subnqn: &str, hostnqn: &str) -> bool {
        self.subsystems
            .iter()
            .any(|s| s.nqn == subnqn && s.admits(hostnqn))
    }

    /// Whether configured subsystem `subnqn` still has every namespace of `facts` (each NSID
    /// still that export): checked under the lock `remove_namespace` changes the list under and
    /// looks for controllers to close under, as `admits` is for hosts.
    fn still_has(&self, subnqn: &str, namespaces: &[spec::NsFacts]) -> bool {
        self.subsystems
            .iter()
            .find(|s| s.nqn == subnqn)
            .is_some_and(|s| {
                namespaces.iter().all(|n| {
                    s.namespaces
                        .iter()
                        .any(|(nsid, e)| *nsid == n.nsid && *e == n.ns.export.name)
                })
            })
    }
}

#[derive(Default)]
struct Table {
    next_id: u16,
    ctrls: HashMap<u16, Controller>,
    /// Configured subsystems, in the order they were created.
    subsystems: Vec<Subsystem>,
    /// `nvme-tcp://` listeners: (port id, bound address).
    listeners: Vec<(u16, SocketAddr)>,
}

/// What an I/O queue's Connect is checked against.
#[derive(Clone)]
struct Controller {
    subnqn: String,
    hostnqn: String,
    hostid: [u8; 16],
    ip: IpAddr,
    /// Its namespaces and the session each is served in (none: a discovery controller).
    facts: Arc<Facts>,
    /// I/O queues granted by Set Features (Number of Queues); until then the most there is.
    io_queues: u16,
    /// Its host proved its key on the admin queue, or none was needed (no key store): only
    /// then has it sessions (`facts.namespaces`) and may I/O queues connect.
    authenticated: bool,
    /// When it was connected: one not authenticated after [`PENDING_CUT`] gives its place to a
    /// new controller when the table is full.
    since: Instant,
}

impl Controller {
    fn is_discovery(&self) -> bool {
        self.subnqn == spec::DISCOVERY_NQN
    }
}

/// Why `Controllers::insert` recorded no controller.
#[derive(Debug, PartialEq, Eq)]
enum NotInserted {
    /// Every place is taken (Controller Busy: the host tries again).
    Busy,
    /// Its configured subsystem's host list no longer has the host (not allowed).
    HostRemoved,
    /// A namespace it was given left its configured subsystem meanwhile (Controller Busy: the
    /// host connects again and gets the namespaces there are).
    NamespaceRemoved,
}

/// How long a controller awaiting its host's DH-HMAC-CHAP keeps its place against a new one
/// when every place is taken (as the handshakes' `CUT_AFTER`): the exchange takes a few round
/// trips, so only hosts that connect and never prove their key lose theirs. Without this, hosts
/// that connect admin queues and never authenticate (no key needed for that) held every place
/// for the handshake timeout, again and again, and every other host got Controller Busy.
const PENDING_CUT: Duration = Duration::from_secs(1);

impl Controllers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an `nvme-tcp://` listener (listed in the discovery log).
    pub fn add_listener(&self, id: u32, addr: SocketAddr) {
        self.lock().listeners.push((id as u16, addr));
    }

    /// Forgets a listener.
    pub fn remove_listener(&self, id: u32) {
        self.lock().listeners.retain(|(i, _)| *i != id as u16);
    }

    /// The listeners, with `local` standing in for a wildcard address (the address the host
    /// reached us at is one it can reach again).
    fn listeners(&self, local: IpAddr) -> Vec<(u16, SocketAddr)> {
        self.lock()
            .listeners
            .iter()
            .filter_map(|&(id, a)| Some((id, crate::reachable_address(a, local)?)))
            .collect()
    }

    /// Registers a controller for a host at `ip`; its id, or why not: [`MAX_CONTROLLERS`] are
    /// in use, or [`MAX_CONTROLLERS_PER_HOST`] of them are that address's (`Busy`), or
    /// (`configured`: `(subsystem, host, namespaces)` of a configured subsystem and the
    /// namespaces the controller is given) that subsystem no longer admits the host or no
    /// longer has one of those namespaces, checked under the lock its host and namespace lists
    /// change under (see `authenticated`), and before any pending controller gives its place
    /// (a connect refused so must not cost another host its controller).
    fn insert(
        &self,
        ip: IpAddr,
        discovery: bool,
        configured: Option<(&str, &str, &[spec::NsFacts])>,
        make: impl FnOnce(u16) -> Controller,
    ) -> Result<u16, NotInserted> {
        let mut t = self.lock();
        if configured.is_some_and(|(sub, host, _)| !t.admits(sub, host)) {
            return Err(NotInserted::HostRemoved);
        }
        if configured.is_some_and(|(sub, _, ns)| !t.still_has(sub, ns)) {
            return Err(NotInserted::NamespaceRemoved);
        }
        // A host's address: an IPv6 host has a /64 to pick addresses from.
        use crate::access::host_prefix;
        let host = host_prefix(ip);
        // Discovery controllers' own places are full: Busy, with no other host's controller
        // cut for a place this one could not take anyway.
        let discovering = t.ctrls.values().filter(|c| c.is_discovery()).count();
        if discovery && discovering >= MAX_DISCOVERY_CONTROLLERS {
            return Err(NotInserted::Busy);
        }
        let full = |t: &Table| {
            let mine = t
                .ctrls
                .values()
                .filter(|c| host_prefix(c.ip) == host)
                .count();
            (
                t.ctrls.len() >= MAX_CONTROLLERS,
                mine >= MAX_CONTROLLERS_PER_HOST,
            )
        };
        let (all, mine) = full(&t);
        if all || mine {
            // The oldest controller whose host has not authenticated for PENDING_CUT gives its
            // place (one of this address's when the address's limit is what is reached); its
            // admin queue ends at its next look (`contains`), within a TICK.
            let cut = t
                .ctrls
                .iter()
                .filter(|(_, c)| !c.authenticated && c.since.elapsed() >= PENDING_CUT)
                .filter(|(_, c)| !mine || host_prefix(c.ip) == host)
                .min_by_key(|(_, c)| c.since)
                .map(|(id, _)| *id)
                .ok_or(NotInserted::Busy)?;
            let c = t.ctrls.remove(&cut).expect("found");
            crate::log!(
                Level::Info,
                "NVMe host '{}' at {}: controller {} had not authenticated in {} s; its place \
                 goes to a new controller",
                c.hostnqn.escape_debug(),
                c.ip,
                cut,
                PENDING_CUT.as_secs()
            );
            if full(&t) != (false, false) {
                return Err(NotInserted::Busy);
            }
        }
        // Ids 1..=0xFFEF (0xFFF0 and above are reserved), reused only after a wrap.
        let id = loop {
            t.next_id = if t.next_id >= 0xffef {
                1
            } else {
                t.next_id + 1
            };
            if !t.ctrls.contains_key(&t.next_id) {
                break t.next_id;
            }
        };
        t.ctrls.insert(id, make(id));
        Ok(id)
    }

    fn remove(&self, id: u16) {
        self.lock().ctrls.remove(&id);
    }

    /// Whether controller `id` still has its place (one awaiting authentication may have given
    /// it to a new controller: `insert`).
    pub(crate) fn contains(&self, id: u16) -> bool {
        self.lock().ctrls.contains_key(&id)
    }

    fn get(&self, id: u16) -> Option<Controller> {
        self.lock().ctrls.get(&id).cloned()
    }

    /// Controller `id`'s host authenticated: its facts now name its namespaces' sessions.
    /// False if it is gone, or if its subsystem is a configured one that no longer admits its
    /// host or no longer has one of those namespaces (checked under the lock `remove_host`,
    /// `remove_namespace` and `delete_subsystem` change the lists under and look for
    /// controllers to close under: either they see these sessions, or this sees their change;
    /// the check before the sessions were admitted could miss it).
    pub(crate) fn authenticated(&self, id: u16, facts: Arc<Facts>, configured: bool) -> bool {
        let mut t = self.lock();
        let Some(c) = t.ctrls.get(&id) else {
            return false;
        };
        if configured
            && !(t.admits(&c.subnqn, &c.hostnqn) && t.still_has(&c.subnqn, &facts.namespaces))
        {
            return false;
        }
        let c = t.ctrls.get_mut(&id).expect("present");
        c.facts = facts;
        c.authenticated = true;
        true
    }

    fn set_io_queues(&self, id: u16, n: u16) {
        if let Some(c) = self.lock().ctrls.get_mut(&id) {
            c.io_queues = n;
        }
    }

    /// Every controller, for `nvme_subsystem_list`: id, subsystem, host NQN, address,
    /// session, I/O queues granted.
    pub fn describe(&self) -> Vec<serde_json::Value> {
        let t = self.lock();
        let mut v: Vec<_> = t
            .ctrls
            .iter()
            .map(|(id, c)| {
                serde_json::json!({
                    "cntlid": id,
                    "subnqn": c.subnqn,
                    "hostnqn": c.hostnqn,
                    "address": c.ip.to_string(),
                    "session": c.facts.namespaces.first().map(|n| n.session),
                    "namespaces": c.facts.namespaces.iter()
                        .map(|n| serde_json::json!({ "nsid": n.nsid, "session": n.session }))
                        .collect::<Vec<_>>(),
                    "io_queues": c.io_queues,
                    "authenticated": c.authenticated,
                })
            })
            .collect();
        v.sort_by_key(|c| c["cntlid"].as_u64());
        v
    }
}

/// A configured subsystem: an NQN with namespaces (exports, by name), its serial and model
/// numbers and the host NQNs it admits (NVMe over Fabrics 1.1 §1.5.2; how hosts are checked
/// is in `admin_connect`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subsystem {
    /// Its NQN.
    pub nqn: String,
    /// Identify Controller SN.
    pub serial: String,
    /// Identify Controller MN.
    pub model: String,
    /// (NSID, export name), NSID ascending.
    pub namespaces: Vec<(u32, String)>,
    /// Host NQNs admitted (when not `allow_any_host`).
    pub hosts: Vec<String>,
    /// Any host NQN is admitted (the exports' own rules and the key store still apply).
    pub allow_any_host: bool,
}

impl Subsystem {
    /// Whether host `hostnqn` may connect.
    pub fn admits(&self, hostnqn: &str) -> bool {
        self.allow_any_host || self.hosts.iter().any(|h| h == hostnqn)
    }

    /// What `nvme_subsystem_list` and `save_config` show of it.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "nqn": self.nqn,
            "serial": self.serial,
            "model": self.model,
            "allow_any_host": self.allow_any_host,
            "hosts": self.hosts,
            "namespaces": self.namespaces.iter()
                .map(|(nsid, e)| serde_json::json!({ "nsid": nsid, "export": e }))
                .collect::<Vec<_>>(),
        })
    }
}

/// Checks a value for an ASCII field of Identify Controller (SN, MN): printable, not empty, at
/// most `max` bytes.
fn ascii_field(what: &str, v: &str, max: usize) -> Result<(), String> {
    if v.is_empty() || v.len() > max || !v.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(format!(
            "bad {what} '{}': it must be 1 to {max} printable ASCII characters",
            v.escape_debug()
        ));
    }
    Ok(())
}

/// Checks an NQN (Base spec §4.5: UTF-8, at most 223 bytes; "nqn." names).
pub fn check_nqn(what: &str, nqn: &str) -> Result<(), String> {
    if !nqn.starts_with("nqn.") || nqn.len() > 223 || nqn.chars().any(|c| c.is_control()) {
        return Err(format!(
            "bad {what} '{}': expected an NQN such as nqn.2026-11.com.example:name (at most 223 \
             bytes)",
            nqn.escape_debug()
        ));
    }
    Ok(())
}

/// A subsystem as `serve --subsystem` writes it:
/// `NQN=EXPORT[@NSID][,EXPORT[@NSID]...][;serial=S][;model=M][;allow=HOSTNQN[+HOSTNQN...]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubsystemSpec {
    /// Its NQN.
    pub nqn: String,
    /// Exports in NSID order, each with the NSID it asked for (None: the next one).
    pub namespaces: Vec<(String, Option<u32>)>,
    /// Serial number, if given.
    pub serial: Option<String>,
    /// Model number, if given.
    pub model: Option<String>,
    /// The host NQNs admitted (None: any host; the exports' rules still apply).
    pub hosts: Option<Vec<String>>,
}

/// What `--subsystem` looks like, for its errors.
pub const SUBSYSTEM_USAGE: &str =
    "NQN=EXPORT[@NSID][,EXPORT...][;serial=S][;model=M][;allow=HOSTNQN[+HOSTNQN...]]";

impl SubsystemSpec {
    /// Parses `--subsystem`; `Err` is a one-line reason.
    pub fn parse(text: &str) -> Result<SubsystemSpec, String> {
        let bad = |why: String| {
            format!(
                "--subsystem '{}': {why} (expected {SUBSYSTEM_USAGE})",
                text.escape_debug()
            )
        };
        let mut parts = text.split(';');
        let head = parts.next().unwrap_or_default();
        let Some((nqn, exports)) = head.split_once('=') else {
            return Err(bad("no '=' after the NQN".into()));
        };
        check_nqn("subsystem NQN", nqn).map_err(bad)?;
        let mut namespaces = Vec::new();
        for e in exports.split(',') {
            let (name, nsid) = match e.rsplit_once('@') {
                Some((n, id)) => {
                    let id = id
                        .parse::<u32>()
                        .ok()
                        .filter(|&i| (1..=spec::MAX_NSID).contains(&i))
                        .ok_or_else(|| {
                            bad(format!(
                                "bad NSID '{}': namespace ids are 1 to {}",
                                id.escape_debug(),
                                spec::MAX_NSID
                            ))
                        })?;
                    (n, Some(id))
                }
                None => (e, None),
            };
            if name.is_empty() {
                return Err(bad("an empty export name".into()));
            }
            namespaces.push((name.to_string(), nsid));
        }
        if namespaces.len() > spec::MAX_NAMESPACES {
            return Err(bad(format!(
                "more than {} namespaces",
                spec::MAX_NAMESPACES
            )));
        }
        let mut spec = SubsystemSpec {
            nqn: nqn.to_string(),
            namespaces,
            serial: None,
            model: None,
            hosts: None,
        };
        for opt in parts {
            match opt.split_once('=') {
                Some(("serial", v)) => {
                    ascii_field("serial", v, spec::SERIAL_LEN).map_err(bad)?;
                    spec.serial = Some(v.to_string());
                }
                Some(("model", v)) => {
                    ascii_field("model", v, spec::MODEL_LEN).map_err(bad)?;
                    spec.model = Some(v.to_string());
                }
                Some(("allow", v)) => {
                    let hosts: Vec<String> = v.split('+').map(str::to_string).collect();
                    for h in &hosts {
                        check_nqn("host NQN", h).map_err(bad)?;
                    }
                    spec.hosts = Some(hosts);
                }
                _ => {
                    return Err(bad(format!(
                        "unknown option '{}' (options: serial=, model=, allow=)",
                        opt.escape_debug()
                    )))
                }
            }
        }
        Ok(spec)
    }

    /// The calls that build it (after its exports are added).
    pub fn calls(&self) -> Vec<crate::control::Call> {
        use crate::control::Call;
        let mut create = serde_json::json!({
            "nqn": self.nqn,
            "allow_any_host": self.hosts.is_none(),
        });
        if let Some(s) = &self.serial {
            create["serial"] = s.clone().into();
        }
        if let Some(m) = &self.model {
            create["model"] = m.clone().into();
        }
        let mut calls = vec![Call::new("nvme_subsystem_create", create)];
        for (export, nsid) in &self.namespaces {
            let mut p = serde_json::json!({ "nqn": self.nqn, "export": export });
            if let Some(id) = nsid {
                p["nsid"] = (*id).into();
            }
            calls.push(Call::new("nvme_subsystem_add_ns", p));
        }
        for h in self.hosts.iter().flatten() {
            calls.push(Call::new(
                "nvme_subsystem_add_host",
                serde_json::json!({ "nqn": self.nqn, "host": h }),
            ));
        }
        calls
    }
}

impl Controllers {
    /// Creates a subsystem with no namespaces yet (`nvme_subsystem_create`). `taken`: whether
    /// the NQN is an export's own subsystem (`export_add` refuses, the other way round, an
    /// export whose own NQN a subsystem has).
    pub fn create_subsystem(
        &self,
        nqn: &str,
        serial: Option<&str>,
        model: Option<&str>,
        allow_any_host: bool,
        taken: bool,
    ) -> Result<Subsystem, String> {
        check_nqn("subsystem NQN", nqn)?;
        if nqn == spec::DISCOVERY_NQN || taken {
            return Err(format!(
                "subsystem NQN '{}' is taken (the discovery NQN, or an export's own subsystem): \
                 choose another",
                nqn.escape_debug()
            ));
        }
        let serial = serial.map_or_else(|| spec::default_serial(nqn), str::to_string);
        ascii_field("serial", &serial, spec::SERIAL_LEN)?;
        let model = model.unwrap_or(spec::DEFAULT_MODEL).to_string();
        ascii_field("model", &model, spec::MODEL_LEN)?;
        let mut t = self.lock();
        if t.subsystems.iter().any(|s| s.nqn == nqn) {
            return Err(format!("subsystem '{}' exists already", nqn.escape_debug()));
        }
        let sub = Subsystem {
            nqn: nqn.to_string(),
            serial,
            model,
            namespaces: Vec::new(),
            hosts: Vec::new(),
            allow_any_host,
        };
        t.subsystems.push(sub.clone());
        Ok(sub)
    }

    /// Runs `f` on subsystem `nqn`.
    fn with_subsystem<T>(
        &self,
        nqn: &str,
        f: impl FnOnce(&mut Subsystem) -> Result<T, String>,
    ) -> Result<T, String> {
        let mut t = self.lock();
        let s = t
            .subsystems
            .iter_mut()
            .find(|s| s.nqn == nqn)
            .ok_or_else(|| {
                format!(
                    "no subsystem '{}' (`blkwire subsystem ls` or nvme_subsystem_list shows them)",
                    nqn.escape_debug()
                )
            })?;
        f(s)
    }

    /// The sessions controllers of `nqn` hold for namespace `nsid` (every namespace: None).
    fn sessions_of(&self, nqn: &str, nsid: Option<u32>) -> Vec<u32> {
        self.lock()
            .ctrls
            .values()
            .filter(|c| c.subnqn == nqn)
            .flat_map(|c| c.facts.namespaces.iter())
            .filter(|n| nsid.is_none_or(|id| n.nsid == id))
            .map(|n| n.session)
            .collect()
    }

    /// Deletes a subsystem; returns the sessions of its controllers (to close: the controllers
    /// end).
    pub fn delete_subsystem(&self, nqn: &str) -> Result<Vec<u32>, String> {
        self.with_subsystem(nqn, |_| Ok(()))?;
        self.lock().subsystems.retain(|s| s.nqn != nqn);
        Ok(self.sessions_of(nqn, None))
    }

    /// Adds export `export` as namespace `nsid` (None: the lowest free one); returns the NSID.
    /// Controllers connected before do not see it (their namespaces are fixed when their admin
    /// queue connects); hosts see it once they connect again.
    pub fn add_namespace(&self, nqn: &str, export: &str, nsid: Option<u32>) -> Result<u32, String> {
        self.with_subsystem(nqn, |s| {
            if s.namespaces.len() >= spec::MAX_NAMESPACES {
                return Err(format!(
                    "subsystem '{}' has {} namespaces, the most there may be",
                    nqn.escape_debug(),
                    spec::MAX_NAMESPACES
                ));
            }
            if s.namespaces.iter().any(|(_, e)| e == export) {
                return Err(format!(
                    "export '{}' is a namespace of subsystem '{}' already",
                    export.escape_debug(),
                    nqn.escape_debug()
                ));
            }
            let id = match nsid {
                Some(id) if id == 0 || id > spec::MAX_NSID => {
                    return Err(format!(
                        "bad NSID {id}: namespace ids are 1 to {}",
                        spec::MAX_NSID
                    ))
                }
                Some(id) if s.namespaces.iter().any(|(n, _)| *n == id) => {
                    return Err(format!(
                        "NSID {id} of subsystem '{}' is in use: remove it first or choose another",
                        nqn.escape_debug()
                    ))
                }
                Some(id) => id,
                None => (1..=spec::MAX_NSID)
                    .find(|id| s.namespaces.iter().all(|(n, _)| n != id))
                    .expect("fewer namespaces than ids"),
            };
            s.namespaces.push((id, export.to_string()));
            s.namespaces.sort_by_key(|(n, _)| *n);
            Ok(id)
        })
    }

    /// Removes namespace `nsid`; returns the sessions controllers hold on it (to close: their
    /// I/O queues answer Invalid Namespace for it from then on, the rest goes on).
    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(Vec<u32>, String), String> {
        let export = self.with_subsystem(nqn, |s| {
            let i = s
                .namespaces
                .iter()
                .position(|(n, _)| *n == nsid)
                .ok_or_else(|| {
                    format!("subsystem '{}' has no namespace {nsid}", nqn.escape_debug())
                })?;
            Ok(s.namespaces.remove(i).1)
        })?;
        Ok((self.sessions_of(nqn, Some(nsid)), export))
    }

    /// Admits host `host` to subsystem `nqn`.
    pub fn add_host(&self, nqn: &str, host: &str) -> Result<(), String> {
        check_nqn("host NQN", host)?;
        self.with_subsystem(nqn, |s| {
            if !s.hosts.iter().any(|h| h == host) {
                s.hosts.push(host.to_string());
            }
            Ok(())
        })
    }

    /// No longer admits host `host`; returns the sessions of its controllers (to close) unless
    /// the subsystem admits any host.
    pub fn remove_host(&self, nqn: &str, host: &str) -> Result<Vec<u32>, String> {
        let any = self.with_subsystem(nqn, |s| {
            let before = s.hosts.len();
            s.hosts.retain(|h| h != host);
            if s.hosts.len() == before {
                return Err(format!(
                    "host '{}' is not on subsystem '{}''s list",
                    host.escape_debug(),
                    nqn.escape_debug()
                ));
            }
            Ok(s.allow_any_host)
        })?;
        if any {
            return Ok(Vec::new());
        }
        Ok(self
            .lock()
            .ctrls
            .values()
            .filter(|c| c.subnqn == nqn && c.hostnqn == host)
            .flat_map(|c| c.facts.namespaces.iter().map(|n| n.session))
            .collect())
    }

    /// Forgets export `name` in every subsystem (it was removed; its sessions are closed by
    /// the export's removal).
    pub fn forget_export(&self, name: &str) {
        for s in self.lock().subsystems.iter_mut() {
            s.namespaces.retain(|(_, e)| e != name);
        }
    }

    /// The configured subsystems, in order.
    pub fn subsystems(&self) -> Vec<Subsystem> {
        self.lock().subsystems.clone()
    }

    /// Subsystem `nqn`, if configured.
    pub fn subsystem(&self, nqn: &str) -> Option<Subsystem> {
        self.lock()
            .subsystems
            .iter()
            .find(|s| s.nqn == nqn)
            .cloned()
    }
}

/// A connection after its Connect: an I/O queue for a reactor, or an admin queue for a thread
/// of its own.
pub enum Accepted {
    /// An I/O queue, admitted into the session of each of its controller's namespaces (in
    /// NSID order: the connection's targets).
    Io(Vec<Admitted>, Box<dyn StreamFrontend>),
    /// An admin queue (or a discovery controller's).
    Admin(Box<admin::AdminQueue>),
}

/// Reads one whole PDU into `buf` (blocking; the caller's timeouts apply). `Ok(Err(e))` is a
/// PDU the protocol refuses: answer it with a C2HTermReq ([`terminate`]) and close.
pub fn read_pdu<R: Read>(
    r: &mut R,
    buf: &mut Vec<u8>,
    p: &Params,
) -> std::io::Result<Result<usize, PduError>> {
    buf.clear();
    let mut have = 0;
    let mut want = nvme_tcp::CH_LEN;
    loop {
        buf.resize(want, 0);
        r.read_exact(&mut buf[have..want])?;
        have = want;
        match pdu_len(&buf[..have], p) {
            Ok(Progress::Complete(n)) => return Ok(Ok(n)),
            Ok(Progress::Need(n)) => want = n,
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// Sends a C2HTermReq for `e` (when it names a FES) with the offending header.
pub fn terminate<W: Write>(w: &mut W, e: &PduError, header: &[u8], p: &Params) {
    if let Some((fes, fei)) = e.term_status() {
        let t = TermReq {
            fes,
            fei,
            data: &header[..header.len().min(nvme_tcp::TERM_MAX_DATA)],
        };
        let mut out = Vec::new();
        Pdu::C2HTermReq(t).encode(p, &mut out);
        let _ = w.write_all(&out);
    }
}

/// What a command's completion says: the one way every queue (setup, admin, I/O) answers.
#[derive(Clone, Copy)]
pub struct Completion {
    /// The command's CID.
    pub cid: u16,
    /// The queue's id.
    pub qid: u16,
    /// SQ head: the commands the queue has taken so far.
    pub sq_head: u16,
    /// Status field (`spec::sc`; the phase bit is added here).
    pub status: u16,
    /// Dwords 0 and 1.
    pub result: u64,
}

impl Completion {
    /// Appends the command's data (one C2HData, only when it succeeded and has any), then its
    /// CapsuleResp.
    pub fn encode(&self, p: &Params, data: Option<&[u8]>, out: &mut Vec<u8>) {
        if let Some(d) = data.filter(|d| !d.is_empty() && self.status == sc::SUCCESS) {
            let c = C2HData {
                cccid: self.cid,
                datao: 0,
                last: true,
                success: false,
                data: d,
            };
            Pdu::C2HData(c).encode(p, out);
        }
        let cqe = Cqe {
            dw0: self.result as u32,
            dw1: (self.result >> 32) as u32,
            sq_head: self.sq_head,
            sq_id: self.qid,
            cid: self.cid,
            status: cqe_status(self.status),
        };
        Pdu::CapsuleResp(cqe).encode(p, out);
    }

    /// Encodes and sends it, blocking (setup and admin queues).
    pub fn send<W: Write>(&self, w: &mut W, p: &Params, data: Option<&[u8]>) -> Option<()> {
        let mut out = Vec::new();
        self.encode(p, data, &mut out);
        w.write_all(&out).ok()
    }
}

/// The negotiated parameters of a connection, both directions.
#[derive(Clone, Copy)]
pub struct Link {
    /// What we decode. Until an I/O queue is admitted, PDUs are bounded by the admin queue's
    /// in-capsule size: a host cannot make a handshake or admin thread hold more.
    pub rx: Params,
    /// What we encode.
    pub tx: Params,
    /// MAXH2CDATA as ICResp said.
    pub maxh2cdata: u32,
}

/// ICReq -> ICResp (TCP transport §3.6.2.2–3): digests as the host asks, CPDA 0, MAXH2CDATA
/// `max_io`. None when the host broke the protocol (a C2HTermReq was sent where it helps).
fn initialize<S: Read + Write>(s: &mut S, peer: &str, max_io: u32) -> Option<Link> {
    let first = Params::initial(Direction::HostToController, IC_LEN as u32);
    let mut buf = Vec::with_capacity(IC_LEN);
    let len = match read_pdu(s, &mut buf, &first).ok()? {
        Ok(n) => n,
        Err(e) => {
            crate::log!(Level::Info, "{peer}: NVMe/TCP: {e}");
            terminate(
                s,
                &e,
                &buf,
                &Params::initial(Direction::ControllerToHost, 0),
            );
            return None;
        }
    };
    let req = match nvme_tcp::decode(&buf[..len], &first) {
        Ok(Pdu::IcReq(r)) => r,
        Ok(other) => {
            crate::log!(
                Level::Info,
                "{peer}: NVMe/TCP: expected ICReq, got {:?}",
                other.typ()
            );
            return None;
        }
        Err(e) => {
            crate::log!(Level::Info, "{peer}: NVMe/TCP: {e}");
            terminate(
                s,
                &e,
                &buf,
                &Params::initial(Direction::ControllerToHost, 0),
            );
            return None;
        }
    };
    if req.pfv != nvme_tcp::PFV_1_0 {
        let e = PduError::InvalidField {
            typ: nvme_tcp::PduType::IcReq,
            offset: 8,
        };
        terminate(
            s,
            &e,
            &buf,
            &Params::initial(Direction::ControllerToHost, 0),
        );
        return None;
    }
    let maxh2cdata = max_io / 4 * 4;
    let resp = IcResp {
        pfv: nvme_tcp::PFV_1_0,
        cpda: 0,
        hdgst: req.hdgst,
        ddgst: req.ddgst,
        maxh2cdata,
    };
    let mut out = Vec::with_capacity(IC_LEN);
    Pdu::IcResp(resp).encode(&Params::initial(Direction::ControllerToHost, 0), &mut out);
    s.write_all(&out).ok()?;
    let mut rx = Params {
        direction: Direction::HostToController,
        hdgst: req.hdgst,
        ddgst: req.ddgst,
        pda: 0,
        max_plen: 0,
    };
    rx.max_plen = rx.max_plen_for_data(spec::ADMIN_INCAPSULE);
    let tx = Params {
        direction: Direction::ControllerToHost,
        hdgst: req.hdgst,
        ddgst: req.ddgst,
        pda: req.hpda,
        max_plen: u32::MAX,
    };
    Some(Link { rx, tx, maxh2cdata })
}

/// A command's host-to-controller data: in the capsule, or fetched with one R2T (a blocking
/// exchange, for admin and Connect commands only). None: the host broke the protocol.
pub fn command_data<S: Read + Write>(
    s: &mut S,
    link: &Link,
    c: &CapsuleCmd<'_>,
    max: usize,
) -> Option<Result<Vec<u8>, u16>> {
    match c.sqe.sgl() {
        Sgl::DataBlock {
            subtype: nvme_tcp::sgl::SUBTYPE_OFFSET,
            address: 0,
            length,
        } if length as usize == c.data.len() => Some(Ok(c.data.to_vec())),
        Sgl::TransportDataBlock { length, .. } if c.data.is_empty() => {
            if length as usize > max {
                return Some(Err(sc::SGL_INVALID_DATA | sc::DNR));
            }
            if length == 0 {
                return Some(Ok(Vec::new()));
            }
            let r2t = nvme_tcp::R2T {
                cccid: c.sqe.cid,
                ttag: 0,
                r2to: 0,
                r2tl: length,
            };
            let mut out = Vec::new();
            Pdu::R2T(r2t).encode(&link.tx, &mut out);
            s.write_all(&out).ok()?;
            let mut data = Vec::with_capacity(length as usize);
            let mut buf = Vec::new();
            while data.len() < length as usize {
                let n = match read_pdu(s, &mut buf, &link.rx).ok()? {
                    Ok(n) => n,
                    Err(e) => {
                        terminate(s, &e, &buf, &link.tx);
                        return None;
                    }
                };
                match nvme_tcp::decode(&buf[..n], &link.rx) {
                    Ok(Pdu::H2CData(d))
                        if d.cccid == c.sqe.cid
                            && d.ttag == 0
                            && d.datao as usize == data.len()
                            && data.len() + d.data.len() <= length as usize =>
                    {
                        data.extend_from_slice(d.data)
                    }
                    Ok(_) => {
                        let e = PduError::InvalidField {
                            typ: nvme_tcp::PduType::H2CData,
                            offset: 8,
                        };
                        terminate(s, &e, &buf[..n], &link.tx);
                        return None;
                    }
                    Err(e) => {
                        terminate(s, &e, &buf[..n], &link.tx);
                        return None;
                    }
                }
            }
            Some(Ok(data))
        }
        Sgl::DataBlock { .. } | Sgl::TransportDataBlock { .. } => {
            Some(Err(sc::SGL_INVALID_DATA | sc::DNR))
        }
        _ => Some(Err(sc::SGL_INVALID_TYPE | sc::DNR)),
    }
}

/// The largest transfer a controller offers: a power of two of 4 KiB pages (MDTS) within the
/// target's max I/O, at most 1 MiB.
fn mdts_bytes(max_io: u32) -> u32 {
    let m = max_io.clamp(4096, 1 << 20);
    1 << (31 - m.leading_zeros())
}

/// A Connect command's fields (NVMe-oF 1.1 §3.3, Figures 20–21).
struct Connect {
    cid: u16,
    recfmt: u16,
    qid: u16,
    /// 0's based.
    sqsize: u16,
    cattr: u8,
    kato: u32,
    hostid: [u8; 16],
    cntlid: u16,
    subnqn: String,
    hostnqn: String,
}

/// Where a refused Connect's error lies, for the host's message (Connect response dword 0:
/// IATTR bit 16 set for a field of the data, IPO the byte offset).
fn invalid_param(in_data: bool, offset: u16) -> u32 {
    (in_data as u32) << 16 | offset as u32
}

/// Connect response dword 0 bit the host reads as "authentication required" (ATR; the kernel's
/// NVME_CONNECT_AUTHREQ_ATR).
pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;

/// Runs ICReq/ICResp and Connect on a new `nvme-tcp://` connection. None: refused or broken
/// (answered and logged).
pub fn accept<S: Read + Write>(
    s: &mut S,
    peer: SocketAddr,
    local: SocketAddr,
    registry: &Registry,
) -> Option<Accepted> {
    let id = crate::access::PeerId::ip(peer);
    let peer_s = id.to_string();
    let max_io = mdts_bytes(registry.limits().max_io);
    let link = initialize(s, &peer_s, max_io)?;
    let mut buf = Vec::new();
    let n = match read_pdu(s, &mut buf, &link.rx).ok()? {
        Ok(n) => n,
        Err(e) => {
            crate::log!(Level::Info, "{peer_s}: NVMe/TCP: {e}");
            terminate(s, &e, &buf, &link.tx);
            return None;
        }
    };
    let cmd = match nvme_tcp::decode(&buf[..n], &link.rx) {
        Ok(Pdu::CapsuleCmd(c)) => c,
        Ok(other) => {
            crate::log!(
                Level::Info,
                "{peer_s}: NVMe/TCP: expected a Connect command, got {:?}",
                other.typ()
            );
            return None;
        }
        Err(e) => {
            crate::log!(Level::Info, "{peer_s}: NVMe/TCP: {e}");
            terminate(s, &e, &buf[..n], &link.tx);
            return None;
        }
    };
    let q = cmd.sqe;
    let reply = |s: &mut S, qid: u16, status: u16, dw0: u32| {
        let c = Completion {
            cid: q.cid,
            qid,
            sq_head: 1,
            status,
            result: dw0 as u64,
        };
        c.send(s, &link.tx, None)
    };
    if q.opcode != spec::FABRICS || q.nsid as u8 != fctype::CONNECT {
        // The first command on a queue must be Connect.
        reply(s, 0, sc::CMD_SEQ_ERROR | sc::DNR, 0);
        crate::log!(
            Level::Info,
            "{peer_s}: NVMe/TCP: first command opcode {:#x} is not Connect",
            q.opcode
        );
        return None;
    }
    let data = match command_data(s, &link, &cmd, CONNECT_DATA)? {
        Ok(d) if d.len() == CONNECT_DATA => d,
        _ => {
            reply(s, 0, sc::SGL_INVALID_DATA | sc::DNR, 0);
            return None;
        }
    };
    let c = Connect {
        cid: q.cid,
        recfmt: q.cdw10 as u16,
        qid: (q.cdw10 >> 16) as u16,
        sqsize: q.cdw11 as u16,
        cattr: (q.cdw11 >> 16) as u8,
        kato: q.cdw12,
        hostid: data[0..16].try_into().expect("16 bytes"),
        cntlid: u16::from_le_bytes([data[16], data[17]]),
        subnqn: spec::nqn_field(&data[256..512])
            .unwrap_or_default()
            .to_string(),
        hostnqn: spec::nqn_field(&data[512..768])
            .unwrap_or_default()
            .to_string(),
    };
    let _ = c.cid;
    if c.recfmt != 0 {
        reply(s, c.qid, sc::CONNECT_FORMAT | sc::DNR, 0);
        return None;
    }
    if c.subnqn.is_empty() {
        reply(
            s,
            c.qid,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(true, 256),
        );
        return None;
    }
    if c.hostnqn.is_empty() {
        reply(
            s,
            c.qid,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(true, 512),
        );
        return None;
    }
    let max_entries = if c.qid == 0 {
        MAX_ADMIN_ENTRIES
    } else {
        MAX_QUEUE_ENTRIES.min(registry.limits().max_depth)
    };
    if c.sqsize == 0 || c.sqsize >= max_entries {
        reply(
            s,
            c.qid,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(false, 44),
        );
        return None;
    }
    let who = c.hostnqn.escape_debug().to_string();
    // With a key store, the host NQN is the identity DH-HMAC-CHAP proves; without one, nothing
    // is proven and the export's address rules decide.
    let keys = registry.access.has_keys();
    let has_secret = registry
        .access
        .keys()
        .is_some_and(|k| k.host_secret(&c.hostnqn).is_some());
    if keys && !has_secret {
        registry
            .access
            .refuse(&peer_s, &format!("NVMe host '{who}' has no key"));
        reply(s, c.qid, sc::CONNECT_INVALID_HOST | sc::DNR, 0);
        return None;
    }
    let proven = keys.then(|| c.hostnqn.clone());
    if c.qid == 0 {
        admin_connect(
            s,
            c,
            link,
            (peer, &id, local, proven.as_deref()),
            registry,
            &reply,
        )
    } else {
        io_connect(s, c, link, (peer, &id), registry, &reply)
    }
}

type Reply<'a, S> = &'a dyn Fn(&mut S, u16, u16, u32) -> Option<()>;

fn admin_connect<S: Read + Write>(
    s: &mut S,
    c: Connect,
    link: Link,
    (peer, peer_id, local, proven): (SocketAddr, &crate::access::PeerId, SocketAddr, Option<&str>),
    registry: &Registry,
    reply: Reply<'_, S>,
) -> Option<Accepted> {
    let (peer_s, addr) = (peer_id.to_string(), peer_id.addr);
    let who = c.hostnqn.escape_debug().to_string();
    if c.cntlid != 0xffff {
        // Static controllers do not exist here: every admin queue gets a new controller.
        reply(
            s,
            0,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(true, 16),
        );
        return None;
    }
    // The largest transfer, as `accept` gave it to ICResp (MAXH2CDATA is MDTS's size).
    let max_io = link.maxh2cdata;
    let discovery = c.subnqn == spec::DISCOVERY_NQN;
    let mut admitted: Vec<Admitted> = Vec::new();
    let mut namespaces = Vec::new();
    let mut sub = None;
    if !discovery {
        // Checked now so that a host gets the Connect status that says why; a host that must
        // authenticate is checked again, and its sessions admitted, only once DH-HMAC-CHAP has
        // succeeded (`AdminQueue::admit_namespaces`): until then it holds no session.
        let names = match resolve(&c.subnqn, &c.hostnqn, (&addr, proven), registry) {
            Ok(n) => n,
            Err(r) => {
                r.log(registry, &peer_s, &who);
                reply(s, 0, r.status(), r.dw0());
                return None;
            }
        };
        if proven.is_none() {
            let owner = Owner {
                proven,
                shown: &c.hostnqn,
                id: peer_id,
                peer: &peer_s,
            };
            match admit_namespaces(registry, &names, &c.subnqn, (&owner, None), max_io) {
                Ok((n, a)) => (namespaces, admitted) = (n, a),
                Err(st) => {
                    crate::log!(Level::Info, "{peer_s}: NVMe host '{who}': refused: {st}");
                    reply(s, 0, sc::CONNECT_CTRL_BUSY, 0);
                    return None;
                }
            }
        }
        sub = names.sub;
    }
    let leave_all = |admitted: &[Admitted]| {
        for a in admitted {
            registry.leave(a.session, 0, &Default::default());
        }
    };
    let mut facts = None;
    let ip = crate::access::canonical_ip(peer.ip());
    // Keyless, its sessions are admitted already: the host list is checked again as it goes in.
    let configured =
        (proven.is_none() && sub.is_some()).then_some((&*c.subnqn, &*c.hostnqn, &namespaces[..]));
    let id = registry.nvme.insert(ip, discovery, configured, |id| {
        let f = Arc::new(controller_facts(
            registry,
            (id, &c.subnqn, sub.as_ref()),
            namespaces.clone(),
            max_io,
        ));
        facts = Some(f.clone());
        Controller {
            subnqn: c.subnqn.clone(),
            hostnqn: c.hostnqn.clone(),
            hostid: c.hostid,
            ip,
            facts: f,
            io_queues: MAX_IO_QUEUES,
            authenticated: proven.is_none(),
            since: Instant::now(),
        }
    });
    let (id, facts) = match (id, facts) {
        (Ok(id), Some(facts)) => (id, facts),
        (Err(NotInserted::HostRemoved), _) => {
            leave_all(&admitted);
            registry.access.refuse(
                &peer_s,
                &format!(
                    "NVMe host '{who}' was removed from subsystem '{}'",
                    c.subnqn.escape_debug()
                ),
            );
            reply(s, 0, sc::CONNECT_INVALID_HOST | sc::DNR, 0);
            return None;
        }
        _ => {
            leave_all(&admitted);
            reply(s, 0, sc::CONNECT_CTRL_BUSY, 0);
            return None;
        }
    };
    let atr = if proven.is_some() {
        CONNECT_AUTHREQ_ATR
    } else {
        0
    };
    if reply(s, 0, sc::SUCCESS, id as u32 | atr).is_none() {
        registry.nvme.remove(id);
        leave_all(&admitted);
        return None;
    }
    crate::log!(
        Level::Info,
        "{peer_s}: NVMe host '{who}' connected controller {id} of {}",
        c.subnqn.escape_debug()
    );
    Some(Accepted::Admin(Box::new(admin::AdminQueue::new(
        admin::AdminSetup {
            link,
            entries: c.sqsize + 1,
            kato_ms: c.kato,
            facts,
            hostnqn: c.hostnqn,
            auth_required: proven.is_some(),
            local,
            peer: *peer_id,
        },
        admitted,
    ))))
}

/// What a controller tells its host about itself: Identify's facts for controller `id` of
/// `subnqn` (a configured subsystem's serial and model, or an export's own), with `namespaces`
/// (none: a discovery controller, or one whose host has not authenticated yet).
fn controller_facts(
    registry: &Registry,
    (id, subnqn, sub): (u16, &str, Option<&Subsystem>),
    namespaces: Vec<spec::NsFacts>,
    max_io: u32,
) -> Facts {
    let (serial, model) = match sub {
        Some(s) => (s.serial.clone(), s.model.clone()),
        None => (spec::default_serial(subnqn), spec::DEFAULT_MODEL.into()),
    };
    Facts {
        cntlid: id,
        subnqn: subnqn.to_string(),
        serial,
        model,
        namespaces,
        max_io,
        max_depth: MAX_QUEUE_ENTRIES.min(registry.limits().max_depth),
    }
}

/// One session per namespace of `names`, each admitted as if it were the only one (the
/// export's session limits, memory floor and rules apply to each), queue 0 being the admin
/// queue; `key` is the one the owner proved with DH-HMAC-CHAP (None: no key store). On a
/// refusal the sessions already admitted leave again.
fn admit_namespaces(
    registry: &Registry,
    names: &Resolved,
    subnqn: &str,
    (owner, key): (&Owner, Option<&Key>),
    max_io: u32,
) -> Result<(Vec<spec::NsFacts>, Vec<Admitted>), Status> {
    let mut admitted: Vec<Admitted> = Vec::with_capacity(names.exports.len());
    let mut namespaces = Vec::with_capacity(names.exports.len());
    for (nsid, export) in &names.exports {
        let ns = match &names.sub {
            Some(_) => Namespace::in_subsystem(export, subnqn),
            None => Namespace::of(export, subnqn),
        };
        let copy = {
            let mut l = registry.copy_limits(export, u32::MAX);
            l.max_ranges = l.max_ranges.min(spec::COPY_RANGES);
            // Copy ranges count blocks in 16 bits.
            l.max_range = l.max_range.min((u16::MAX as u32 + 1) << ns.lba_shift);
            l
        };
        match registry.admit_first(
            export,
            (owner, key.cloned()),
            (ns.size, 1 + MAX_IO_QUEUES, MAX_QUEUE_ENTRIES, max_io),
            copy,
        ) {
            Ok(a) => {
                namespaces.push(spec::NsFacts {
                    nsid: *nsid,
                    ns,
                    copy: a.copy,
                    session: a.session,
                });
                admitted.push(a);
            }
            Err(st) => {
                for a in &admitted {
                    registry.leave(a.session, 0, &Default::default());
                }
                return Err(st);
            }
        }
    }
    Ok((namespaces, admitted))
}

/// The exports behind a subsystem NQN, with their NSIDs, as this host may open them.
struct Resolved {
    /// The configured subsystem (None: an export's own subsystem).
    sub: Option<Subsystem>,
    exports: Vec<(u32, Arc<blkwire_backend::Export>)>,
}

/// Why [`resolve`] refused a host.
enum Unresolved {
    /// The subsystem's host list or an export's rules do not admit it (a refusal, counted).
    Host(String),
    /// No such subsystem, or one without namespaces.
    Unknown(String),
}

impl Unresolved {
    /// Logs it, and counts a refused host.
    fn log(&self, registry: &Registry, peer_s: &str, who: &str) {
        match self {
            Unresolved::Host(why) => registry.access.refuse(&peer_s, why),
            Unresolved::Unknown(why) => {
                crate::log!(Level::Info, "{peer_s}: NVMe host '{who}' {why}")
            }
        }
    }

    /// The status Connect answers with.
    fn status(&self) -> u16 {
        match self {
            Unresolved::Host(_) => sc::CONNECT_INVALID_HOST | sc::DNR,
            Unresolved::Unknown(_) => sc::CONNECT_INVALID_PARAM | sc::DNR,
        }
    }

    /// Connect's dword 0: where the error lies.
    fn dw0(&self) -> u32 {
        match self {
            Unresolved::Host(_) => 0,
            Unresolved::Unknown(_) => invalid_param(true, 256),
        }
    }
}

/// Finds subsystem `subnqn` and checks that host `hostnqn` may connect to it: a configured
/// subsystem's host list (the host NQN is what DH-HMAC-CHAP proved when there is a key store),
/// then each namespace's export rules, as a HELLO for that export would.
fn resolve(
    subnqn: &str,
    hostnqn: &str,
    (addr, proven): (&PeerAddr, Option<&str>),
    registry: &Registry,
) -> Result<Resolved, Unresolved> {
    let who = hostnqn.escape_debug();
    let nqn = subnqn.escape_debug();
    if let Some(sub) = registry.nvme.subsystem(subnqn) {
        if !sub.admits(hostnqn) {
            return Err(Unresolved::Host(format!(
                "NVMe host '{who}' is not on subsystem '{nqn}''s host list"
            )));
        }
        if sub.namespaces.is_empty() {
            return Err(Unresolved::Unknown(format!(
                "asked for subsystem '{nqn}', which has no namespaces"
            )));
        }
        let mut exports = Vec::with_capacity(sub.namespaces.len());
        for (nsid, name) in &sub.namespaces {
            let Some(e) = registry.permitted(name, proven, addr) else {
                return Err(Unresolved::Host(format!(
                    "NVMe host '{who}' may not open export '{}' (namespace {nsid} of \
                     subsystem '{nqn}')",
                    name.escape_debug()
                )));
            };
            exports.push((*nsid, e));
        }
        return Ok(Resolved {
            sub: Some(sub),
            exports,
        });
    }
    let name = subnqn.strip_prefix(spec::NQN_PREFIX).unwrap_or("");
    match (!name.is_empty())
        .then(|| registry.permitted(name, proven, addr))
        .flatten()
    {
        Some(e) => Ok(Resolved {
            sub: None,
            exports: vec![(1, e)],
        }),
        None if !name.is_empty() && registry.has_export(name) => Err(Unresolved::Host(format!(
            "NVMe host '{who}' may not open subsystem '{nqn}'"
        ))),
        None => Err(Unresolved::Unknown(format!(
            "asked for unknown subsystem '{nqn}'"
        ))),
    }
}

/// Admits the sessions of a controller whose host has just proved its key (DH-HMAC-CHAP on
/// the admin queue, `admin.rs`): its subsystem is resolved again as it is now (host list,
/// export rules), one session per namespace is admitted, and the controller's entry gets its
/// namespaces, so that its I/O queues may connect. The sessions record `key`, the key the
/// exchange checked the host's proof with (not the store's now: a `keys_load` during the
/// exchange must close them). Returns the new facts and the sessions, or why not (its Connect
/// was answered long ago: the host reads AUTH_Failure1 where Success1 would have been, and the
/// controller ends).
pub(crate) fn admit_authenticated(
    registry: &Registry,
    facts: &Facts,
    (hostnqn, peer, peer_s): (&str, &crate::access::PeerId, &str),
    key: &Key,
) -> Result<(Arc<Facts>, Vec<Admitted>), String> {
    let addr = &peer.addr;
    let names = resolve(&facts.subnqn, hostnqn, (addr, Some(hostnqn)), registry).map_err(|r| {
        r.log(registry, peer_s, &hostnqn.escape_debug().to_string());
        match r {
            Unresolved::Host(why) | Unresolved::Unknown(why) => why,
        }
    })?;
    let owner = Owner {
        proven: Some(hostnqn),
        shown: hostnqn,
        id: peer,
        peer: peer_s,
    };
    let (namespaces, admitted) = admit_namespaces(
        registry,
        &names,
        &facts.subnqn,
        (&owner, Some(key)),
        facts.max_io,
    )
    .map_err(|st| format!("its sessions were refused: {st}"))?;
    let f = Arc::new(controller_facts(
        registry,
        (facts.cntlid, &facts.subnqn, names.sub.as_ref()),
        namespaces,
        facts.max_io,
    ));
    if !registry
        .nvme
        .authenticated(facts.cntlid, f.clone(), names.sub.is_some())
    {
        for a in &admitted {
            registry.leave(a.session, 0, &Default::default());
        }
        return Err(
            "its controller was forgotten, or its subsystem's host list changed meanwhile".into(),
        );
    }
    Ok((f, admitted))
}

fn io_connect<S: Read + Write>(
    s: &mut S,
    c: Connect,
    link: Link,
    (peer, peer_id): (SocketAddr, &crate::access::PeerId),
    registry: &Registry,
    reply: Reply<'_, S>,
) -> Option<Accepted> {
    let peer_s = peer_id.to_string();
    let who = c.hostnqn.escape_debug().to_string();
    let ctrl = registry.nvme.get(c.cntlid).filter(|k| {
        k.subnqn == c.subnqn
            && k.hostnqn == c.hostnqn
            && k.hostid == c.hostid
            && k.ip == crate::access::canonical_ip(peer.ip())
    });
    // Not its own, or one whose admin queue has not authenticated yet (it has no sessions to
    // join): refused alike.
    let ctrl = match ctrl {
        Some(k) if k.authenticated => k,
        other => {
            let why = match other {
                None => "is not its own",
                Some(_) => "has not authenticated",
            };
            registry.access.refuse(
                &peer_s,
                &format!(
                    "NVMe host '{who}': I/O queue {} names controller {}, which {why}",
                    c.qid, c.cntlid
                ),
            );
            reply(
                s,
                c.qid,
                sc::CONNECT_INVALID_PARAM | sc::DNR,
                invalid_param(true, 16),
            );
            return None;
        }
    };
    if ctrl.facts.is_discovery() {
        // A discovery controller has no I/O queues.
        reply(
            s,
            c.qid,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(false, 42),
        );
        return None;
    };
    if c.qid > ctrl.io_queues {
        reply(
            s,
            c.qid,
            sc::CONNECT_INVALID_PARAM | sc::DNR,
            invalid_param(false, 42),
        );
        return None;
    }
    if registry.access.has_keys() {
        // Every queue proves the host again (the kernel authenticates each one). A key
        // removed since the controller was found (`keys_load`): the host is told, not left
        // without an answer to its Connect.
        let Some(auth) = admin::QueueAuth::new(registry, &c.hostnqn, &ctrl.subnqn) else {
            registry.access.refuse(
                &peer_s,
                &format!("NVMe host '{who}' has no key any more (keys_load)"),
            );
            reply(s, c.qid, sc::CONNECT_INVALID_HOST | sc::DNR, 0);
            return None;
        };
        let mut sq_head = 1u16;
        reply(s, c.qid, sc::SUCCESS, c.cntlid as u32 | CONNECT_AUTHREQ_ATR)?;
        let entries = c.sqsize + 1;
        // The queue joins its sessions as soon as the host has proved its key, before the
        // AUTH_Receive that reads Success1: refused then, that reads AUTH_Failure1 instead.
        let mut joined = None;
        let mut refused = false;
        let verdict =
            admin::authenticate_queue(s, &link, c.qid, auth, &mut sq_head, entries, &mut || {
                match io_join(&c, &ctrl, registry, &peer_s) {
                    Ok(j) => {
                        joined = Some(j);
                        true
                    }
                    Err(_) => {
                        refused = true;
                        false
                    }
                }
            });
        match (verdict, joined) {
            (Some(true), Some(j)) => return Some(io_start(c, link, j, sq_head)),
            // The exchange failed after the sessions were joined (the host's Failure2), or the
            // connection broke: they are left.
            (_, Some((joined, _))) => leave_queues(registry, &joined),
            // Refused (the host read Failure1), failed before the host's proof, or broken. (An
            // exchange never succeeds without passing the proof, where `io_join` ran.)
            (_, None) => {}
        }
        if verdict == Some(false) && !refused {
            registry
                .access
                .refuse(&peer_s, &format!("NVMe host '{who}' failed DH-HMAC-CHAP"));
        }
        return None;
    }
    let done = Completion {
        cid: c.cid,
        qid: c.qid,
        sq_head: 1,
        status: sc::SUCCESS,
        result: c.cntlid as u64,
    };
    let j = match io_join(&c, &ctrl, registry, &peer_s) {
        Ok(j) => j,
        Err(_) => {
            let refused = Completion {
                status: sc::CONNECT_INVALID_PARAM | sc::DNR,
                result: invalid_param(false, 42) as u64,
                ..done
            };
            let _ = refused.send(s, &link.tx, None);
            return None;
        }
    };
    if done.send(s, &link.tx, None).is_none() {
        leave_queues(registry, &j.0);
        return None;
    }
    Some(io_start(c, link, j, 1))
}

/// Leaves the sessions an I/O queue joined.
fn leave_queues(registry: &Registry, joined: &[Admitted]) {
    for a in joined {
        registry.leave(a.session, a.queue, &Default::default());
    }
}

/// Joins I/O queue `c.qid` to the session of every namespace of `ctrl` still served (a removed
/// one's session is revoked and refuses it: that namespace is not among the queue's targets):
/// the sessions joined and their namespaces, or why not (logged; nothing stays joined).
fn io_join(
    c: &Connect,
    ctrl: &Controller,
    registry: &Registry,
    peer_s: &str,
) -> Result<(Vec<Admitted>, Vec<NsIo>), Status> {
    let entries = c.sqsize + 1;
    let mut joined: Vec<Admitted> = Vec::with_capacity(ctrl.facts.namespaces.len());
    let mut namespaces = Vec::with_capacity(ctrl.facts.namespaces.len());
    let mut refused = None;
    for n in &ctrl.facts.namespaces {
        match registry.join_verified(n.session, c.qid, entries) {
            Ok(a) => {
                namespaces.push(NsIo {
                    nsid: n.nsid,
                    lba_shift: n.ns.lba_shift,
                    read_only: n.ns.export.read_only,
                    copy: n.copy,
                });
                joined.push(a);
            }
            Err(Status::Access) if registry.is_revoked(n.session) => {}
            Err(st) => {
                refused = Some(st);
                break;
            }
        }
    }
    if joined.is_empty() && refused.is_none() {
        refused = Some(Status::Access);
    }
    if let Some(st) = refused {
        leave_queues(registry, &joined);
        crate::log!(
            Level::Info,
            "{peer_s}: NVMe I/O queue {} of controller {} refused: {st}",
            c.qid,
            c.cntlid
        );
        return Err(st);
    }
    Ok((joined, namespaces))
}

/// The I/O queue, its Connect answered (and its DH-HMAC-CHAP done) and its sessions joined,
/// as the reactor takes it.
fn io_start(
    c: Connect,
    link: Link,
    (joined, namespaces): (Vec<Admitted>, Vec<NsIo>),
    sq_head: u16,
) -> Accepted {
    let entries = c.sqsize + 1;
    let max_io = joined[0].max_io;
    // From here on the queue takes in-capsule writes and H2CData up to MAXH2CDATA, inside the
    // memory budget the reactor keeps.
    let mut rx = link.rx;
    rx.max_plen = rx.max_plen_for_data(link.maxh2cdata.max(spec::IO_INCAPSULE));
    let fe = NvmeIo::new(IoQueueSetup {
        rx,
        tx: link.tx,
        qid: c.qid,
        entries,
        sq_head,
        sqfc_off: c.cattr & 1 << 2 != 0,
        max_io,
        maxh2cdata: link.maxh2cdata,
        namespaces,
    });
    Accepted::Io(joined, Box::new(fe))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUB: &str = "nqn.2026-11.com.example:db";
    const HOST: &str = "nqn.2026-11.com.example:host";

    /// A controller entry of `HOST` at `ip` for `SUB`, connected `age` ago.
    fn ctrl(ip: IpAddr, authenticated: bool, age: Duration) -> impl FnMut(u16) -> Controller {
        move |id| Controller {
            subnqn: SUB.into(),
            hostnqn: HOST.into(),
            hostid: [0; 16],
            ip,
            facts: Arc::new(Facts {
                cntlid: id,
                subnqn: SUB.into(),
                serial: "s".into(),
                model: "m".into(),
                namespaces: Vec::new(),
                max_io: 4096,
                max_depth: 32,
            }),
            io_queues: 1,
            authenticated,
            since: Instant::now() - age,
        }
    }

    /// When an address's places are all taken, the oldest of its controllers that has awaited
    /// authentication for a second gives its place to a new one; younger ones, authenticated
    /// ones and other addresses' keep theirs.
    #[test]
    fn a_controller_that_never_authenticates_gives_its_place() {
        let t = Controllers::default();
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let old = Duration::from_secs(5);
        let other = t.insert(b, false, None, ctrl(b, false, old)).unwrap();
        let authenticated: Vec<u16> = (0..MAX_CONTROLLERS_PER_HOST - 2)
            .map(|_| t.insert(a, false, None, ctrl(a, true, old)).unwrap())
            .collect();
        let young = t
            .insert(a, false, None, ctrl(a, false, Duration::ZERO))
            .unwrap();
        let oldest = t.insert(a, false, None, ctrl(a, false, old)).unwrap();
        let new = t.insert(a, false, None, ctrl(a, false, Duration::ZERO));
        assert!(new.is_ok(), "no place given");
        assert!(
            !t.contains(oldest),
            "the one awaiting authentication longest gave it"
        );
        assert!(t.contains(young) && t.contains(other));
        assert!(authenticated.iter().all(|&id| t.contains(id)));
        // Now every pending one of `a` is young: nobody gives a place.
        assert_eq!(
            t.insert(a, false, None, ctrl(a, false, Duration::ZERO)),
            Err(NotInserted::Busy)
        );
    }

    /// Discovery controllers (no key, no session) have places of their own: hosts keeping
    /// them open cannot take the places of controllers of subsystems. And one IPv6 host is its
    /// /64: its other addresses count against the same per-host limit.
    #[test]
    fn discovery_controllers_and_one_hosts_addresses_cannot_take_every_place() {
        let t = Controllers::default();
        let discovery = |ip| {
            let mut make = ctrl(ip, true, Duration::ZERO);
            move |id| Controller {
                subnqn: spec::DISCOVERY_NQN.into(),
                ..make(id)
            }
        };
        let v4 = |i: usize| IpAddr::from([10, 0, (i / 200) as u8, (i % 200) as u8 + 1]);
        for i in 0..MAX_DISCOVERY_CONTROLLERS {
            t.insert(v4(i), true, None, discovery(v4(i)))
                .expect("a place");
        }
        // A subsystem's controller awaiting its host's proof for long: not cut for a
        // discovery Connect refused all the same.
        let pending = IpAddr::from([10, 9, 9, 9]);
        let waits = t
            .insert(
                pending,
                false,
                None,
                ctrl(pending, false, Duration::from_secs(60)),
            )
            .unwrap();
        let late = v4(MAX_DISCOVERY_CONTROLLERS);
        assert_eq!(
            t.insert(late, true, None, discovery(late)),
            Err(NotInserted::Busy),
            "discovery controllers have their share only"
        );
        assert!(t.contains(waits), "cut for a Connect that was refused");
        assert!(
            t.insert(late, false, None, ctrl(late, true, Duration::ZERO))
                .is_ok(),
            "a subsystem's controller still has a place"
        );
        let v6 = |i: u16| IpAddr::from([0xfd00, 0, 0, 1, 0, 0, 0, i + 1]);
        for i in 0..MAX_CONTROLLERS_PER_HOST as u16 {
            t.insert(v6(i), false, None, ctrl(v6(i), true, Duration::ZERO))
                .expect("a place");
        }
        let next = v6(MAX_CONTROLLERS_PER_HOST as u16);
        assert_eq!(
            t.insert(next, false, None, ctrl(next, true, Duration::ZERO)),
            Err(NotInserted::Busy),
            "another address of the same /64 is the same host"
        );
        let elsewhere = IpAddr::from([0xfd00, 0, 0, 2, 0, 0, 0, 1]);
        assert!(t
            .insert(
                elsewhere,
                false,
                None,
                ctrl(elsewhere, true, Duration::ZERO)
            )
            .is_ok());
    }

    /// A configured subsystem's host list is checked again as the controller is recorded or
    /// authenticated, under the lock `remove_host` takes: a host removed meanwhile is not
    /// admitted (its sessions would be missed by the removal's look for them).
    #[test]
    fn a_host_removed_during_its_connect_is_not_admitted() {
        let t = Controllers::default();
        t.create_subsystem(SUB, None, None, false, false).unwrap();
        t.add_host(SUB, HOST).unwrap();
        let ip = IpAddr::from([10, 0, 0, 1]);
        let id = t
            .insert(
                ip,
                false,
                Some((SUB, HOST, &[])),
                ctrl(ip, false, Duration::ZERO),
            )
            .expect("admitted");
        t.remove_host(SUB, HOST).unwrap();
        let facts = t.get(id).unwrap().facts;
        assert!(
            !t.authenticated(id, facts.clone(), true),
            "authenticated after removal"
        );
        assert!(
            t.authenticated(id, facts, false),
            "an export's own subsystem has no list"
        );
        assert_eq!(
            t.insert(
                ip,
                false,
                Some((SUB, HOST, &[])),
                ctrl(ip, false, Duration::ZERO)
            ),
            Err(NotInserted::HostRemoved)
        );
    }

    /// So are a configured subsystem's namespaces: one removed while a controller that was
    /// given it connects or authenticates is not served by it (`remove_namespace` looked for
    /// sessions to close before the controller was recorded).
    #[test]
    fn a_namespace_removed_during_a_connect_is_not_served() {
        let t = Controllers::default();
        t.create_subsystem(SUB, None, None, true, false).unwrap();
        assert_eq!(t.add_namespace(SUB, "db", Some(1)), Ok(1));
        let spec = blkwire_backend::ExportSpec::parse("db=mem:1M").unwrap();
        let db = [spec::NsFacts {
            nsid: 1,
            ns: spec::Namespace {
                export: Arc::new(blkwire_backend::Export::open(&spec).unwrap()),
                size: 1 << 20,
                lba_shift: 9,
                nguid: [0; 16],
                uuid: [0; 16],
            },
            copy: blkwire_wire::CopyLimits::default(),
            session: 7,
        }];
        let with_db = |ip| {
            let mut make = ctrl(ip, false, Duration::ZERO);
            let db = db.to_vec();
            move |id| {
                let mut c = make(id);
                let mut f = (*c.facts).clone();
                f.namespaces = db;
                c.facts = Arc::new(f);
                c
            }
        };
        let given = Some((SUB, HOST, &db[..]));
        let ip = IpAddr::from([10, 0, 0, 1]);
        let id = t.insert(ip, false, given, with_db(ip)).expect("admitted");
        let facts = t.get(id).unwrap().facts;
        assert!(t.authenticated(id, facts.clone(), true));
        let (closed, _) = t.remove_namespace(SUB, 1).unwrap();
        assert_eq!(closed, [7], "a controller recorded is found");
        assert!(
            !t.authenticated(id, facts, true),
            "authenticated with a namespace removed"
        );
        assert_eq!(
            t.insert(ip, false, given, with_db(ip)).err(),
            Some(NotInserted::NamespaceRemoved)
        );
        // The same NSID given to another export is not the namespace it was given either.
        assert_eq!(t.add_namespace(SUB, "other", Some(1)), Ok(1));
        assert_eq!(
            t.insert(ip, false, given, with_db(ip)).err(),
            Some(NotInserted::NamespaceRemoved)
        );
    }
}
