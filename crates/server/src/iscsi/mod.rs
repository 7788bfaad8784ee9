//! iSCSI frontend, login (RFC 7143 §6, §11.12–11.13, §12.1.3, §13): the Login Phase of a new
//! `iscsi://` connection, on the handshake thread with its deadline. Every export is a target
//! (`iqn.2026-11.io.blkwire:NAME`) with one LUN (LUN 0); configured targets (`serve
//! --iscsi-target`, the `iscsi_target_*` calls, [`targets`]) have several LUNs and an
//! initiator ACL.
//!
//! - Security stage: AuthMethod CHAP (CHAP_A=5, MD5; one-way, or mutual when the initiator
//!   sends CHAP_I/CHAP_C) with the secrets of the key store's `IQN:CHAP:SECRET [TARGET]`
//!   lines. With a key store every initiator must authenticate, and CHAP_N must be its
//!   InitiatorName: that name is then the proven host the exports' `allow=` rules match.
//!   Without one, AuthMethod=None and only address rules apply (as for NVMe/TCP).
//! - Operational stage: digests, data segment and burst lengths, R2T and immediate data,
//!   MaxConnections=1, ErrorRecoveryLevel=0 (what [`Negotiated`] holds).
//! - A discovery session (SessionType=Discovery) answers Text `SendTargets=All` with the
//!   targets this initiator may open and a TargetAddress per `iscsi://` listener (in continued
//!   Text Responses when longer than one PDU), here on the handshake thread, until Logout or
//!   the deadline.
//! - A normal session becomes a blkwire session (TSIH = session id & 0xffff, never 0), and the
//!   connection goes to a reactor with the full feature phase frontend (`frontend/iscsi.rs`).
//!   A configured target is one blkwire session per LUN the initiator may open, each a target
//!   of the connection (`Req::target`), as NVMe/TCP namespaces are.

pub mod targets;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkwire_auth::{Key, PeerAddr};
use blkwire_backend::Export;
use blkwire_wire::iscsi::{
    self, flag, op, pdu_len, Bhs, Digests, LoginRequest, PduError, Progress, BLKWIRE_IQN_PREFIX,
    RESERVED_TAG,
};

use crate::budget::Reservation;
use crate::frontend::iscsi::{lun_info, Iscsi, IscsiSetup, Peer, SetupLun, LIST_ROOM};
use crate::frontend::StreamFrontend;
use crate::log::Level;
use crate::session::{Admitted, Owner, Registry};

/// The data segment a peer may send before MaxRecvDataSegmentLength is negotiated (§13.12's
/// default), and during login and discovery.
pub const LOGIN_MAX_DATA: u32 = 8192;
/// Most text one login or text request may carry across continued PDUs.
const MAX_TEXT: usize = 64 << 10;
/// The data segment we receive at most in the full feature phase (our
/// MaxRecvDataSegmentLength): immediate data and each Data-Out PDU.
pub const OUR_MAX_RECV: u32 = 256 << 10;
/// Largest FirstBurstLength we accept (unsolicited data, immediate data included).
pub const OUR_FIRST_BURST: u32 = 256 << 10;
/// Commands in flight per session at most (the CmdSN window).
pub const MAX_DEPTH: u16 = 128;
/// Login PDUs one connection may send (the stages, CHAP's three steps, continued text).
const MAX_LOGIN_PDUS: usize = 32;
/// How long a login reinstating a session waits for the old one to end (what it runs to
/// complete) before it is refused with SERVICE UNAVAILABLE (the initiator tries again).
const REINSTATE_WAIT: Duration = Duration::from_secs(5);

/// Status classes and details of a Login Response (§11.13.5).
pub mod status {
    /// Success.
    pub const SUCCESS: u16 = 0x0000;
    /// Initiator error: authentication failed.
    pub const AUTH_FAILED: u16 = 0x0201;
    /// Initiator error: not allowed to access this target.
    pub const FORBIDDEN: u16 = 0x0202;
    /// Initiator error: the target does not exist.
    pub const NOT_FOUND: u16 = 0x0203;
    /// Initiator error: unsupported version.
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    /// Initiator error: a required parameter is missing.
    pub const MISSING_PARAMETER: u16 = 0x0207;
    /// Initiator error: the session to add a connection to does not exist.
    pub const NO_SESSION: u16 = 0x020a;
    /// Initiator error: a login request that is not valid here.
    pub const INVALID_REQUEST: u16 = 0x020b;
    /// Target error: service unavailable (try again later).
    pub const SERVICE_UNAVAILABLE: u16 = 0x0301;
    /// Target error: out of resources.
    pub const OUT_OF_RESOURCES: u16 = 0x0302;
}

/// The `iscsi://` listeners (SendTargets lists them) and the sessions logged in (for
/// `iscsi_target_list`). Only logins and the control plane take its lock.
#[derive(Default)]
pub struct Portals {
    inner: Mutex<PortalTable>,
}

#[derive(Default)]
struct PortalTable {
    listeners: Vec<(u32, SocketAddr)>,
    sessions: Vec<SessionEntry>,
    targets: targets::Targets,
}

impl PortalTable {
    /// Forgets the logins whose sessions all ended (`live`: the registry's open ones): a login
    /// lives while one of its LUNs' sessions does.
    fn forget_ended(&mut self, live: &dyn Fn(u32) -> bool) {
        self.sessions
            .retain(|s| s.luns.iter().any(|&(_, id)| live(id)));
    }
}

#[derive(Clone)]
struct SessionEntry {
    /// The session of its first LUN (the one `session_list` shows it by).
    session: u32,
    /// (LUN, session) of every LUN it logged in with, in the connection's target order.
    luns: Vec<(u64, u32)>,
    target: String,
    initiator: String,
    isid: [u8; 6],
    tsih: u16,
    peer: String,
    /// The peer's address, and whether CHAP proved `initiator`: who may reinstate it.
    addr: PeerAddr,
    proven: bool,
    digests: Digests,
}

impl Portals {
    fn lock(&self) -> std::sync::MutexGuard<'_, PortalTable> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an `iscsi://` listener.
    pub fn add_listener(&self, id: u32, addr: SocketAddr) {
        self.lock().listeners.push((id, addr));
    }

    /// Forgets a listener.
    pub fn remove_listener(&self, id: u32) {
        self.lock().listeners.retain(|(i, _)| *i != id);
    }

    /// The listeners, `local` standing in for a wildcard address.
    fn listeners(&self, local: IpAddr) -> Vec<SocketAddr> {
        self.lock()
            .listeners
            .iter()
            .filter_map(|&(_, a)| crate::reachable_address(a, local))
            .collect()
    }

    /// The `iscsi://` listeners' bound addresses (`ADDR:PORT`).
    pub fn portals(&self) -> Vec<String> {
        self.lock()
            .listeners
            .iter()
            .map(|(_, a)| a.to_string())
            .collect()
    }

    /// Records a login's sessions, forgetting those that ended (bounded by the live ones);
    /// false, recording nothing, when its configured target changed since the login looked at
    /// it (deleted, `who` no longer admitted, one of its LUNs removed). Under the lock the
    /// control calls take: a change either sees this login's sessions (and closes them) or
    /// the login sees the change.
    fn add_session(&self, e: SessionEntry, who: &str, live: &dyn Fn(u32) -> bool) -> bool {
        let mut t = self.lock();
        let still = match t.targets.list.iter().find(|c| c.iqn == e.target) {
            Some(c) => {
                c.admits(who)
                    && e.luns
                        .iter()
                        .all(|(l, _)| c.luns.iter().any(|(n, _)| n == l))
            }
            // An export's own target (its removal closes the sessions itself), or deleted.
            None => e.target.starts_with(BLKWIRE_IQN_PREFIX),
        };
        if !still {
            return false;
        }
        t.forget_ended(live);
        t.sessions.push(e);
        true
    }

    /// The sessions a new login to `target` of `initiator` with `isid` reinstates (RFC 7143
    /// §6.3.5: the same initiator port, I_T nexus, logging in again after it lost its
    /// connection, while the target may still hold the old one): those of its login to that
    /// target with that ISID. Without CHAP the name proves nothing, so only from the address
    /// that logged in then (a host claiming another's name cannot end its sessions); `None`
    /// while such a login of the nexus lives elsewhere: the new one may not run beside it
    /// either, as the same I_T nexus (its reservations and registrations are the nexus's),
    /// nor could its I/O be kept from being overtaken by the old one's. Logins whose
    /// sessions all ended (`live`: the registry's open ones) are forgotten first: there is
    /// nothing of theirs to end.
    fn reinstated(
        &self,
        target: &str,
        initiator: &str,
        (isid, proven, addr): ([u8; 6], bool, PeerAddr),
        live: &dyn Fn(u32) -> bool,
    ) -> Option<Vec<u32>> {
        let mut t = self.lock();
        t.forget_ended(live);
        let mut out = Vec::new();
        for s in t
            .sessions
            .iter()
            .filter(|s| s.target == target && s.initiator == initiator && s.isid == isid)
        {
            let ids = s.luns.iter().map(|&(_, id)| id).filter(|&id| live(id));
            if (proven && s.proven) || s.addr == addr {
                out.extend(ids);
            } else if ids.count() > 0 {
                return None;
            }
        }
        Some(out)
    }

    /// Forgets the iSCSI facts of sessions that ended (`live`: the registry's open ones): a
    /// login lives while one of its LUNs' sessions does.
    pub fn retain_sessions(&self, live: &dyn Fn(u32) -> bool) {
        self.lock().forget_ended(live);
    }

    /// The sessions logins to `iqn` hold for LUN `lun` (every LUN: None), of initiator `who`
    /// only when given.
    fn sessions_of(&self, iqn: &str, lun: Option<u64>, who: Option<&str>) -> Vec<u32> {
        self.lock()
            .sessions
            .iter()
            .filter(|s| s.target == iqn && who.is_none_or(|w| s.initiator == w))
            .flat_map(|s| s.luns.iter())
            .filter(|(l, _)| lun.is_none_or(|n| *l == n))
            .map(|&(_, id)| id)
            .collect()
    }

    /// Creates a configured target with no LUNs yet (`iscsi_target_create`): `initiators`
    /// None admits any initiator. `taken`: the IQN is an export's own target.
    pub fn create_target(
        &self,
        iqn: &str,
        initiators: Option<Vec<String>>,
        taken: bool,
    ) -> Result<targets::ConfiguredTarget, String> {
        self.lock().targets.create(iqn, initiators, taken)
    }

    /// Deletes a configured target; returns the sessions of its logins (to close).
    pub fn delete_target(&self, iqn: &str) -> Result<Vec<u32>, String> {
        self.lock().targets.delete(iqn)?;
        Ok(self.sessions_of(iqn, None, None))
    }

    /// Adds export `export` as LUN `lun` (None: the lowest free one); returns the LUN.
    /// Logins made before do not see it; initiators see it when they log in again.
    pub fn add_lun(&self, iqn: &str, export: &str, lun: Option<u64>) -> Result<u64, String> {
        self.lock().targets.add_lun(iqn, export, lun)
    }

    /// Removes LUN `lun`; returns the sessions logins hold on it (to close: their connections
    /// fence it and answer LOGICAL UNIT NOT SUPPORTED for it) and its export.
    pub fn remove_lun(&self, iqn: &str, lun: u64) -> Result<(Vec<u32>, String), String> {
        let export = self.lock().targets.remove_lun(iqn, lun)?;
        Ok((self.sessions_of(iqn, Some(lun), None), export))
    }

    /// Admits initiator `who` to `iqn`; a target that admitted any initiator admits only its
    /// list from then on: returns the sessions of the others' logins (to close).
    pub fn add_initiator(&self, iqn: &str, who: &str) -> Result<Vec<u32>, String> {
        let was_open = {
            let mut t = self.lock();
            let open = t.targets.get_mut(iqn)?.any_initiator;
            t.targets.add_initiator(iqn, who)?;
            open
        };
        if !was_open {
            return Ok(Vec::new());
        }
        let t = self.lock();
        Ok(t.sessions
            .iter()
            .filter(|s| s.target == iqn && s.initiator != who)
            .flat_map(|s| s.luns.iter().map(|&(_, id)| id))
            .collect())
    }

    /// No longer admits initiator `who`; returns the sessions of its logins (to close).
    pub fn remove_initiator(&self, iqn: &str, who: &str) -> Result<Vec<u32>, String> {
        self.lock().targets.remove_initiator(iqn, who)?;
        Ok(self.sessions_of(iqn, None, Some(who)))
    }

    /// Forgets export `name` as a LUN of every configured target (it was removed; its
    /// sessions are closed by the export's removal).
    pub fn forget_export(&self, name: &str) {
        for t in self.lock().targets.list.iter_mut() {
            t.luns.retain(|(_, e)| e != name);
        }
    }

    /// The configured targets, in the order they were created.
    pub fn targets(&self) -> Vec<targets::ConfiguredTarget> {
        self.lock().targets.list.clone()
    }

    /// Configured target `iqn`, if there is one.
    pub fn target(&self, iqn: &str) -> Option<targets::ConfiguredTarget> {
        self.lock()
            .targets
            .list
            .iter()
            .find(|t| t.iqn == iqn)
            .cloned()
    }

    /// The logged-in sessions of one target, for `iscsi_target_list`.
    /// The logins to `target` whose first session is `shown` (not closing).
    pub fn describe_sessions(
        &self,
        target: &str,
        shown: &dyn Fn(u32) -> bool,
    ) -> Vec<serde_json::Value> {
        self.lock()
            .sessions
            .iter()
            .filter(|s| s.target == target && shown(s.session))
            .map(|s| {
                serde_json::json!({
                    "session": s.session,
                    "luns": s.luns.iter()
                        .map(|(l, id)| serde_json::json!({ "lun": l, "session": id }))
                        .collect::<Vec<_>>(),
                    "initiator": s.initiator,
                    "isid": iscsi::hex(&s.isid),
                    "tsih": s.tsih,
                    "address": s.peer,
                    "header_digest": s.digests.header,
                    "data_digest": s.digests.data,
                })
            })
            .collect()
    }
}

/// What the Login Phase settled for the full feature phase (§13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// HeaderDigest / DataDigest.
    pub digests: Digests,
    /// The initiator's MaxRecvDataSegmentLength: the most data we put in one PDU.
    pub send_max: u32,
    /// Ours: the most data a PDU it sends may carry.
    pub recv_max: u32,
    /// MaxBurstLength: the most one R2T asks for, and one Data-In sequence carries.
    pub max_burst: u32,
    /// FirstBurstLength: unsolicited data (immediate included) at most.
    pub first_burst: u32,
    /// InitialR2T: no unsolicited Data-Out PDUs.
    pub initial_r2t: bool,
    /// ImmediateData: data may come in the SCSI Command PDU.
    pub immediate_data: bool,
    /// MaxOutstandingR2T per task.
    pub max_r2t: u32,
}

impl Default for Negotiated {
    /// The values RFC 7143 §13 gives when a key is not negotiated.
    fn default() -> Negotiated {
        Negotiated {
            digests: Digests::default(),
            send_max: 8192,
            recv_max: 8192,
            max_burst: 262144,
            first_burst: 65536,
            initial_r2t: true,
            immediate_data: true,
            max_r2t: 1,
        }
    }
}

/// Reads one whole PDU into `buf` (blocking). `Ok(Err(e))`: a PDU the protocol refuses.
pub fn read_pdu<R: Read>(
    r: &mut R,
    buf: &mut Vec<u8>,
    d: &Digests,
    max_data: u32,
) -> std::io::Result<Result<usize, PduError>> {
    buf.clear();
    let mut have = 0;
    let mut want = iscsi::BHS_LEN;
    loop {
        buf.resize(want, 0);
        r.read_exact(&mut buf[have..want])?;
        have = want;
        match pdu_len(&buf[..have], d, max_data) {
            Ok(Progress::Complete(n)) => return Ok(Ok(n)),
            Ok(Progress::Need(n)) => want = n,
            Err(e) => return Ok(Err(e)),
        }
    }
}

/// MD5 for CHAP (RFC 1994 §4.1 via RFC 7143 §12.1.3): OpenSSL's, never our own.
fn md5(parts: &[&[u8]]) -> Option<Vec<u8>> {
    let mut h = openssl::hash::Hasher::new(openssl::hash::MessageDigest::md5()).ok()?;
    for p in parts {
        h.update(p).ok()?;
    }
    Some(h.finish().ok()?.to_vec())
}

/// CHAP_R for identifier `id`, `secret` and `challenge`: MD5(id || secret || challenge).
pub fn chap_response(id: u8, secret: &[u8], challenge: &[u8]) -> Option<Vec<u8>> {
    md5(&[&[id], secret, challenge])
}

/// The target's CHAP_N on discovery sessions (mutual CHAP): `iqn.2026-11.io.blkwire`.
pub const DISCOVERY_CHAP_NAME: &str = "iqn.2026-11.io.blkwire";

/// Bytes of the CHAP challenge we send (RFC 7143 §12.1.3 asks for unpredictable ones; RFC
/// 1994 for at least 16 bytes with MD5).
const CHAP_CHALLENGE: usize = 16;
/// Longest CHAP challenge accepted from an initiator (mutual CHAP), bytes.
const MAX_PEER_CHALLENGE: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Auth {
    /// Nothing negotiated yet.
    Start,
    /// AuthMethod=CHAP agreed: CHAP_A comes next.
    Chap,
    /// Our challenge is out: CHAP_N and CHAP_R come next.
    Challenged { id: u8, challenge: Vec<u8> },
    /// Authenticated (or no authentication needed).
    Done,
}

/// The Login Phase of one connection.
struct Login {
    local: IpAddr,
    keys: bool,
    initiator: Option<String>,
    target: Option<String>,
    discovery: bool,
    isid: [u8; 6],
    itt: u32,
    cmdsn: u32,
    statsn: u32,
    first: bool,
    auth: Auth,
    /// The identity CHAP proved (the initiator name).
    proven: Option<String>,
    /// Its key in the key store CHAP checked the response against: its sessions record it.
    key: Option<Key>,
    neg: Negotiated,
    /// Sent TargetPortalGroupTag already.
    tpgt_sent: bool,
    /// Our MaxBurstLength bound.
    max_io: u32,
    /// The commands the connection will take at once: its login responses' MaxCmdSN window.
    /// The configured depth, then, in the final response, what its sessions were admitted
    /// with (an initiator keeps the largest MaxCmdSN it was given, and past the connection's
    /// slots its commands would wait for one that never frees behind their own Data-Out).
    depth: u16,
    /// The largest MaxCmdSN a login response gave: the full feature phase's window starts at
    /// least there.
    granted: Option<u32>,
}

/// Why a login ends: the status to answer with, and what to log.
struct Refusal(u16, String);

impl Login {
    /// A login on a connection to `local`, of a target with keys or not, whose I/O is at most
    /// `max_io` bytes and `max_depth` commands at once.
    fn new(local: IpAddr, keys: bool, max_io: u32, max_depth: u16) -> Login {
        Login {
            local,
            keys,
            initiator: None,
            target: None,
            discovery: false,
            isid: [0; 6],
            itt: 0,
            cmdsn: 0,
            statsn: 0,
            first: true,
            auth: Auth::Start,
            proven: None,
            key: None,
            neg: Negotiated::default(),
            tpgt_sent: false,
            max_io: max_io.clamp(512, 16_777_215),
            depth: MAX_DEPTH.min(max_depth).max(1),
            granted: None,
        }
    }

    /// Answers the request with `flags` (T, C, CSG, NSG), `status`, `tsih` and `text`.
    fn respond<S: Write>(
        &mut self,
        s: &mut S,
        flags: u8,
        st: u16,
        tsih: u16,
        text: &[u8],
    ) -> Option<()> {
        let mut b = Bhs::new(op::LOGIN_RSP, flags);
        b.0[2] = 0; // version-max
        b.0[3] = 0; // version-active
        b.0[8..14].copy_from_slice(&self.isid);
        b.0[14..16].copy_from_slice(&tsih.to_be_bytes());
        b.itt(self.itt);
        let max = self.cmdsn.wrapping_add(self.depth as u32 - 1);
        match self.granted {
            Some(g) if !crate::frontend::iscsi::serial_after(max, g) => {}
            _ => self.granted = Some(max),
        }
        b.sn(self.statsn, self.cmdsn, max);
        b.0[36] = (st >> 8) as u8;
        b.0[37] = st as u8;
        self.statsn = self.statsn.wrapping_add(1);
        let mut out = Vec::with_capacity(iscsi::BHS_LEN + text.len() + 4);
        b.encode(text, &Digests::default(), &mut out);
        s.write_all(&out).ok()
    }

    /// Handles the keys of one login request in stage `csg`; appends the answers to `out`.
    fn keys(
        &mut self,
        csg: u8,
        text: &[u8],
        registry: &Registry,
        out: &mut Vec<u8>,
    ) -> Result<(), Refusal> {
        let mut chap_n = None;
        let mut chap_r = None;
        let mut chap_i = None;
        let mut chap_c = None;
        for pair in iscsi::pairs(text) {
            let (k, v) = pair.map_err(|e| Refusal(status::INVALID_REQUEST, e.to_string()))?;
            match k {
                // Declared once (RFC 7143 §13.6): CHAP proves the name first declared, and the
                // session, its SCSI identity (reservations) and revocation all go by it, so a
                // name changed after CHAP would take another host's reservations.
                "InitiatorName" | "TargetName" => {
                    let name = match k {
                        "InitiatorName" => &mut self.initiator,
                        _ => &mut self.target,
                    };
                    if v.len() > 223 {
                        return Err(Refusal(
                            status::INVALID_REQUEST,
                            format!("{k} is longer than 223 bytes (RFC 7143 §4.2.7.1)"),
                        ));
                    }
                    // An empty name names no one: the session, its reservations' nexus and
                    // the rules would all go by "".
                    if v.is_empty() {
                        return Err(Refusal(
                            status::MISSING_PARAMETER,
                            format!("{k} is empty (RFC 7143 §4.2.7.1)"),
                        ));
                    }
                    match name {
                        Some(first) if first != v => {
                            return Err(Refusal(
                                status::INVALID_REQUEST,
                                format!("{k} may not change during login (RFC 7143 §13.6)"),
                            ))
                        }
                        _ => *name = Some(v.to_string()),
                    }
                }
                "SessionType" => match v {
                    "Discovery" => self.discovery = true,
                    "Normal" => self.discovery = false,
                    _ => {
                        return Err(Refusal(
                            status::INVALID_REQUEST,
                            format!("SessionType={}", v.escape_debug()),
                        ))
                    }
                },
                "InitiatorAlias" => {}
                "AuthMethod" => {
                    if csg != 0 {
                        iscsi::push_pair(out, k, "Irrelevant");
                        continue;
                    }
                    let offered: Vec<&str> = v.split(',').collect();
                    let chosen = if self.keys {
                        offered.contains(&"CHAP").then_some("CHAP")
                    } else if offered.contains(&"None") {
                        Some("None")
                    } else {
                        None
                    };
                    match chosen {
                        Some("CHAP") => self.auth = Auth::Chap,
                        Some(_) => self.auth = Auth::Done,
                        None => {
                            return Err(Refusal(
                                status::AUTH_FAILED,
                                // The peer's bytes, escaped: this goes to the log.
                                format!(
                                    "AuthMethod={}: this target needs {}",
                                    v.escape_debug(),
                                    if self.keys { "CHAP" } else { "None" }
                                ),
                            ));
                        }
                    }
                    iscsi::push_pair(out, k, chosen.unwrap_or("Reject"));
                }
                "CHAP_A" => {
                    if self.auth != Auth::Chap {
                        return Err(Refusal(
                            status::INVALID_REQUEST,
                            "CHAP_A out of turn".into(),
                        ));
                    }
                    if !v.split(',').any(|a| a == "5") {
                        return Err(Refusal(
                            status::AUTH_FAILED,
                            format!("CHAP_A={}: only 5 (MD5) is offered", v.escape_debug()),
                        ));
                    }
                    let mut c = vec![0u8; CHAP_CHALLENGE + 1];
                    blkwire_auth::random(&mut c);
                    let id = c[0];
                    let challenge = c[1..].to_vec();
                    iscsi::push_pair(out, "CHAP_A", "5");
                    iscsi::push_pair(out, "CHAP_I", &id.to_string());
                    iscsi::push_pair(out, "CHAP_C", &iscsi::hex(&challenge));
                    self.auth = Auth::Challenged { id, challenge };
                }
                "CHAP_N" => chap_n = Some(v.to_string()),
                "CHAP_R" => chap_r = Some(v.to_string()),
                "CHAP_I" => chap_i = Some(v.to_string()),
                "CHAP_C" => chap_c = Some(v.to_string()),
                _ => self.operational(k, v, out),
            }
        }
        if chap_n.is_some() || chap_r.is_some() {
            self.chap_answer(chap_n, chap_r, chap_i, chap_c, registry, out)?;
        }
        Ok(())
    }

    /// Checks CHAP_N/CHAP_R and, for mutual CHAP, answers the initiator's CHAP_I/CHAP_C.
    fn chap_answer(
        &mut self,
        n: Option<String>,
        r: Option<String>,
        i: Option<String>,
        c: Option<String>,
        registry: &Registry,
        out: &mut Vec<u8>,
    ) -> Result<(), Refusal> {
        let fail = |m: String| Refusal(status::AUTH_FAILED, m);
        let Auth::Challenged { id, challenge } = std::mem::replace(&mut self.auth, Auth::Start)
        else {
            return Err(Refusal(
                status::INVALID_REQUEST,
                "CHAP_R out of turn".into(),
            ));
        };
        let (Some(n), Some(r)) = (n, r) else {
            return Err(fail("CHAP_N and CHAP_R must come together".into()));
        };
        let initiator = self.initiator.clone().unwrap_or_default();
        if n != initiator {
            return Err(fail(format!(
                "CHAP_N '{}' is not the initiator name",
                n.escape_debug()
            )));
        }
        let keys = registry.access.keys();
        let Some((secret, target_secret)) = keys.as_ref().and_then(|k| k.chap(&n)) else {
            return Err(fail("no CHAP secret in the key store".into()));
        };
        let got = iscsi::binary(&r).ok_or_else(|| fail("CHAP_R is not a binary value".into()))?;
        let want =
            chap_response(id, secret, &challenge).ok_or_else(|| fail("MD5 unavailable".into()))?;
        if want.len() != got.len() || !openssl::memcmp::eq(&want, &got) {
            return Err(fail("wrong CHAP response".into()));
        }
        match (i, c) {
            (None, None) => {}
            (Some(i), Some(c)) => {
                let Some(ts) = target_secret else {
                    return Err(fail(
                        "mutual CHAP asked for, but the key line has no target secret".into(),
                    ));
                };
                let id = iscsi::number(&i)
                    .filter(|v| *v <= 255)
                    .ok_or_else(|| fail("CHAP_I is not 0 to 255".into()))?;
                let theirs = iscsi::binary(&c)
                    .filter(|c| !c.is_empty() && c.len() <= MAX_PEER_CHALLENGE)
                    .ok_or_else(|| {
                        fail("CHAP_C is not a binary value of 1 to 1024 bytes".into())
                    })?;
                // §12.1.3: a challenge equal to ours would let the initiator reflect it.
                if theirs == challenge {
                    return Err(fail("the initiator's CHAP challenge repeats ours".into()));
                }
                let resp = chap_response(id as u8, ts, &theirs)
                    .ok_or_else(|| fail("MD5 unavailable".into()))?;
                // Our CHAP name: the target's name, or on a discovery session (which names
                // no target) the blkwire IQN prefix without its ':'.
                let name = self
                    .target
                    .clone()
                    .unwrap_or_else(|| DISCOVERY_CHAP_NAME.into());
                iscsi::push_pair(out, "CHAP_N", &name);
                iscsi::push_pair(out, "CHAP_R", &iscsi::hex(&resp));
            }
            _ => return Err(fail("CHAP_I and CHAP_C must come together".into())),
        }
        self.key = keys.as_ref().and_then(|k| k.get(&n)).cloned();
        self.proven = Some(n);
        self.auth = Auth::Done;
        Ok(())
    }

    /// One operational key (§13): our answer appended to `out`.
    fn operational(&mut self, k: &str, v: &str, out: &mut Vec<u8>) {
        let n = &mut self.neg;
        let num = iscsi::number(v);
        let yes = match v {
            "Yes" => Some(true),
            "No" => Some(false),
            _ => None,
        };
        let answer: String = match k {
            "HeaderDigest" | "DataDigest" => {
                // The first of the initiator's list we support (§13.1).
                let pick = v.split(',').find(|d| *d == "CRC32C" || *d == "None");
                match pick {
                    Some(d) => {
                        let on = d == "CRC32C";
                        if k == "HeaderDigest" {
                            n.digests.header = on;
                        } else {
                            n.digests.data = on;
                        }
                        d.to_string()
                    }
                    None => "Reject".into(),
                }
            }
            "MaxRecvDataSegmentLength" => match num {
                // Declarative (§13.12): what the initiator receives; ours goes out below.
                Some(x) if (512..=16_777_215).contains(&x) => {
                    n.send_max = x as u32;
                    return;
                }
                _ => "Reject".into(),
            },
            "MaxBurstLength" => match num {
                Some(x) if (512..=16_777_215).contains(&x) => {
                    n.max_burst = (x as u32).min(self.max_io);
                    n.max_burst.to_string()
                }
                _ => "Reject".into(),
            },
            "FirstBurstLength" => match num {
                Some(x) if (512..=16_777_215).contains(&x) => {
                    // Never past MaxBurstLength's bound (§13.14), so the value answered is
                    // the one enforced.
                    n.first_burst = (x as u32).min(OUR_FIRST_BURST).min(self.max_io);
                    n.first_burst.to_string()
                }
                _ => "Reject".into(),
            },
            "InitialR2T" => match yes {
                // OR (§13.10): we are content with No, so the initiator's value is the
                // result: No lets it send unsolicited Data-Out up to FirstBurstLength.
                Some(y) => {
                    n.initial_r2t = y;
                    if y { "Yes" } else { "No" }.into()
                }
                None => "Reject".into(),
            },
            "ImmediateData" => match yes {
                // AND (§13.11).
                Some(y) => {
                    n.immediate_data = y;
                    if y { "Yes" } else { "No" }.into()
                }
                None => "Reject".into(),
            },
            "MaxOutstandingR2T" => match num {
                Some(x) if (1..=65535).contains(&x) => {
                    n.max_r2t = 1;
                    "1".into()
                }
                _ => "Reject".into(),
            },
            "MaxConnections" => match num {
                Some(x) if (1..=65535).contains(&x) => "1".into(),
                _ => "Reject".into(),
            },
            "ErrorRecoveryLevel" => match num {
                Some(x) if x <= 2 => "0".into(),
                _ => "Reject".into(),
            },
            "DefaultTime2Wait" => match num {
                Some(x) if x <= 3600 => x.max(2).to_string(),
                _ => "Reject".into(),
            },
            "DefaultTime2Retain" => match num {
                Some(x) if x <= 3600 => x.min(20).to_string(),
                _ => "Reject".into(),
            },
            "DataPDUInOrder" | "DataSequenceInOrder" => match yes {
                Some(_) => "Yes".into(),
                None => "Reject".into(),
            },
            "IFMarker" | "OFMarker" => match yes {
                Some(_) => "No".into(),
                None => "Reject".into(),
            },
            "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => {
                // Keys only a target sends (§13.7–13.9).
                "Irrelevant".into()
            }
            _ => "NotUnderstood".into(),
        };
        if self.discovery
            && !matches!(
                k,
                "HeaderDigest"
                    | "DataDigest"
                    | "MaxRecvDataSegmentLength"
                    | "DefaultTime2Wait"
                    | "DefaultTime2Retain"
                    | "ErrorRecoveryLevel"
            )
            && answer != "NotUnderstood"
        {
            // Session-wide data keys mean nothing to a discovery session (§13).
            iscsi::push_pair(out, k, "Irrelevant");
            return;
        }
        iscsi::push_pair(out, k, &answer);
    }
}

/// What a finished Login Phase hands on: the admitted queues (one per LUN, in the order of the
/// connection's targets) and the frontend.
pub type Accepted = (Vec<Admitted>, Box<dyn StreamFrontend>);

/// Runs the Login Phase of a new `iscsi://` connection (and a whole discovery session). None:
/// refused, broken or a discovery session that ended (answered and logged).
pub fn accept<S: Read + Write>(
    s: &mut S,
    peer: SocketAddr,
    local: SocketAddr,
    registry: &Registry,
) -> Option<Accepted> {
    let id = crate::access::PeerId::ip(peer);
    let peer_s = id.to_string();
    let mut l = Login::new(
        local.ip(),
        registry.access.has_keys(),
        registry.limits().max_io,
        registry.limits().max_depth,
    );
    let mut buf = Vec::new();
    let mut text = Vec::new();
    let mut stage = 0u8;
    for _ in 0..MAX_LOGIN_PDUS {
        let n = match read_pdu(s, &mut buf, &Digests::default(), LOGIN_MAX_DATA).ok()? {
            Ok(n) => n,
            Err(e) => {
                crate::log!(Level::Info, "{peer_s}: iSCSI login: {e}");
                return None;
            }
        };
        let p = iscsi::decode(&buf[..n], &Digests::default()).ok()?;
        if p.opcode() != op::LOGIN_REQ {
            crate::log!(
                Level::Info,
                "{peer_s}: iSCSI: opcode {:#04x} during login",
                p.opcode()
            );
            return None;
        }
        let req = iscsi::login_request(&p);
        if l.first {
            l.isid = req.isid;
            l.cmdsn = req.cmdsn;
            l.statsn = req.expstatsn;
            stage = req.csg;
        }
        l.itt = req.itt;
        let tsih_asked = req.tsih;
        match step(&mut l, &req, p.data, &mut text, stage, registry) {
            Step::More => {
                // A continued request: an empty response asks for the rest (§6.2).
                let flags = req.csg << 2;
                l.respond(s, flags, status::SUCCESS, 0, &[])?;
            }
            Step::Answer { out, transit } => {
                let nsg = req.nsg;
                let done = transit && nsg == 3;
                let flags = if transit {
                    flag::TRANSIT | req.csg << 2 | nsg
                } else {
                    req.csg << 2
                };
                if !done {
                    l.respond(s, flags, status::SUCCESS, 0, &out)?;
                    if transit {
                        stage = nsg;
                    }
                    continue;
                }
                return finish(s, l, flags, out, tsih_asked, &id, registry);
            }
            Step::Refuse(Refusal(st, why)) => {
                let who = l
                    .initiator
                    .as_deref()
                    .unwrap_or("?")
                    .escape_debug()
                    .to_string();
                if st == status::AUTH_FAILED || st == status::FORBIDDEN {
                    registry
                        .access
                        .refuse(&peer_s, &format!("iSCSI initiator '{who}': {why}"));
                } else {
                    crate::log!(Level::Info, "{peer_s}: iSCSI initiator '{who}': {why}");
                }
                let _ = l.respond(s, req.csg << 2, st, 0, &[]);
                return None;
            }
        }
    }
    crate::log!(Level::Info, "{peer_s}: iSCSI login took too many PDUs");
    None
}

enum Step {
    More,
    Answer { out: Vec<u8>, transit: bool },
    Refuse(Refusal),
}

/// One login request: its checks, its keys, whether it moves to the next stage.
fn step(
    l: &mut Login,
    req: &LoginRequest,
    data: &[u8],
    text: &mut Vec<u8>,
    stage: u8,
    registry: &Registry,
) -> Step {
    let refuse = |st: u16, m: &str| Step::Refuse(Refusal(st, m.to_string()));
    if req.version.1 > 0 {
        return refuse(status::UNSUPPORTED_VERSION, "version-min above 0");
    }
    if req.tsih != 0 {
        // MaxConnections=1: no connection joins an existing session.
        return refuse(
            status::NO_SESSION,
            "TSIH names a session (MaxConnections=1)",
        );
    }
    if req.csg != stage
        || req.csg == 2
        || req.csg == 3
        || (req.transit && req.nsg <= req.csg)
        || (req.transit && req.nsg == 2)
    {
        return refuse(status::INVALID_REQUEST, "a login stage out of order");
    }
    if text.len() + data.len() > MAX_TEXT {
        return refuse(status::INVALID_REQUEST, "login text too long");
    }
    text.extend_from_slice(data);
    if req.cont {
        return Step::More;
    }
    let all = std::mem::take(text);
    let mut out = Vec::new();
    let was_first = l.first;
    l.first = false;
    if let Err(r) = l.keys(req.csg, &all, registry, &mut out) {
        return Step::Refuse(r);
    }
    if was_first {
        if l.initiator.is_none() {
            return refuse(status::MISSING_PARAMETER, "no InitiatorName");
        }
        if !l.discovery && l.target.is_none() {
            return refuse(status::MISSING_PARAMETER, "no TargetName");
        }
    }
    if req.csg == 0 && !l.keys && l.auth == Auth::Start {
        // No AuthMethod sent: nothing to authenticate against without keys.
        l.auth = Auth::Done;
    }
    if req.csg == 1 && l.auth != Auth::Done {
        if l.keys {
            return refuse(
                status::AUTH_FAILED,
                "operational stage without authentication",
            );
        }
        l.auth = Auth::Done;
    }
    if !l.discovery && !l.tpgt_sent {
        l.tpgt_sent = true;
        iscsi::push_pair(&mut out, "TargetPortalGroupTag", "1");
    }
    let mut transit = req.transit;
    if transit && l.auth != Auth::Done {
        if matches!(l.auth, Auth::Chap | Auth::Challenged { .. }) {
            // CHAP has steps left: stay in the security stage (T=0, §6.2).
            transit = false;
        } else {
            return refuse(
                status::AUTH_FAILED,
                "leaving the security stage unauthenticated",
            );
        }
    }
    if transit && req.nsg == 3 {
        // Our MaxRecvDataSegmentLength, declared once before the full feature phase.
        let recv = if l.discovery {
            LOGIN_MAX_DATA
        } else {
            OUR_MAX_RECV
        };
        l.neg.recv_max = recv;
        iscsi::push_pair(&mut out, "MaxRecvDataSegmentLength", &recv.to_string());
        if l.neg.first_burst > l.neg.max_burst {
            l.neg.first_burst = l.neg.max_burst;
        }
    }
    Step::Answer { out, transit }
}

/// The last login response: a discovery session runs here; a normal one is admitted.
fn finish<S: Read + Write>(
    s: &mut S,
    mut l: Login,
    flags: u8,
    out: Vec<u8>,
    _tsih: u16,
    id: &crate::access::PeerId,
    registry: &Registry,
) -> Option<Accepted> {
    let (peer_s, addr) = (id.to_string(), id.addr);
    let initiator = l.initiator.clone().unwrap_or_default();
    let who = initiator.escape_debug().to_string();
    if l.discovery {
        l.respond(s, flags, status::SUCCESS, 1, &out)?;
        discovery(s, &mut l, registry, &addr);
        return None;
    }
    let target = l.target.clone().unwrap_or_default();
    let refuse_flags = flags & !flag::TRANSIT & 0x0c;
    let luns = match resolve(&l, &target, &addr, registry) {
        Ok(luns) => luns,
        Err(Refusal(st, why)) => {
            if st == status::FORBIDDEN {
                registry
                    .access
                    .refuse(&peer_s, &format!("iSCSI initiator '{who}' {why}"));
            } else {
                crate::log!(Level::Info, "{peer_s}: iSCSI initiator '{who}' {why}");
            }
            l.respond(s, refuse_flags, st, 0, &[])?;
            return None;
        }
    };
    let depth = l.depth;
    let owner = Owner {
        proven: l.proven.as_deref(),
        shown: &initiator,
        id,
        peer: &peer_s,
    };
    let max_io = registry.limits().max_io;
    // The room for the parameter list the connection may collect, which waits for its data
    // as long as the initiator likes: set aside first (no session is made, to be left again,
    // for a login the budget cannot take), or the login is refused.
    let Some(list_room) = Reservation::new(registry.budget(), LIST_ROOM) else {
        crate::log!(
            Level::Info,
            "{peer_s}: iSCSI initiator '{who}': refused: no room in the memory budget for its \
             parameter list ({} KiB; serve --max-memory)",
            LIST_ROOM >> 10
        );
        l.respond(s, refuse_flags, status::OUT_OF_RESOURCES, 0, &[])?;
        return None;
    };
    // Session reinstatement (RFC 7143 §6.3.5): the old session of this I_T nexus ends, and
    // what it still runs completes, before the new one is admitted (its place counts against
    // the limits) and answered (its I/O could be overtaken by the old one's).
    let Some(old) = registry.iscsi.reinstated(
        &target,
        &initiator,
        (l.isid, l.proven.is_some(), addr),
        &|id| registry.holds(id),
    ) else {
        crate::log!(
            Level::Info,
            "{peer_s}: iSCSI initiator '{who}': refused: a session of its ISID {} logged in \
             from another address, and without CHAP the name proves nothing: it is not ended \
             for this login, nor served beside it",
            iscsi::hex(&l.isid)
        );
        l.respond(s, refuse_flags, status::SERVICE_UNAVAILABLE, 0, &[])?;
        return None;
    };
    if !old.is_empty() {
        crate::log!(
            Level::Info,
            "{peer_s}: iSCSI initiator '{who}' logs in again with ISID {}: ending its sessions {old:?}",
            iscsi::hex(&l.isid)
        );
        if !registry.end_for_successor(&old, Instant::now() + REINSTATE_WAIT) {
            crate::log!(
                Level::Info,
                "{peer_s}: iSCSI initiator '{who}': refused: its old session still runs I/O \
                 after {} s",
                REINSTATE_WAIT.as_secs()
            );
            l.respond(s, refuse_flags, status::SERVICE_UNAVAILABLE, 0, &[])?;
            return None;
        }
    }
    // One session per LUN, each admitted as if it were the only one: the export's session
    // limits, memory floor and rules apply to each.
    let mut admitted: Vec<Admitted> = Vec::with_capacity(luns.len());
    let leave_all = |admitted: &[Admitted]| {
        for a in admitted {
            registry.leave(a.session, 0, &Default::default());
        }
    };
    for (_, export) in &luns {
        let copy = registry.copy_limits(export, u32::MAX);
        let dims = (export.size(), 1, depth, max_io);
        // The sessions record the key CHAP proved (a key replaced since is refused).
        match registry.admit_first(export, (&owner, l.key.clone()), dims, copy) {
            Ok(a) => admitted.push(a),
            Err(st) => {
                crate::log!(
                    Level::Info,
                    "{peer_s}: iSCSI initiator '{who}': refused: {st}"
                );
                leave_all(&admitted);
                // What the login held goes back before it is answered: a login right after
                // the refusal finds the budget as it was.
                drop(std::mem::take(&mut admitted));
                drop(list_room);
                // ACCESS: the secret CHAP proved was replaced or removed since.
                let code = match st {
                    blkwire_wire::Status::Access => status::AUTH_FAILED,
                    _ => status::OUT_OF_RESOURCES,
                };
                l.respond(s, flags & 0x0c, code, 0, &[])?;
                return None;
            }
        }
    }
    // TSIH: never 0 (§11.12.6); the first session id's low bits identify it in logs.
    let tsih = (admitted[0].session as u16).max(1);
    // Recorded before the answer, so that a control call changing the target meanwhile either
    // closes these sessions or makes this login fail (`add_session`).
    let acl_name = l
        .proven
        .clone()
        .or_else(|| l.initiator.clone())
        .unwrap_or_default();
    let recorded = registry.iscsi.add_session(
        SessionEntry {
            session: admitted[0].session,
            luns: luns
                .iter()
                .zip(&admitted)
                .map(|((lun, _), a)| (*lun, a.session))
                .collect(),
            target: target.clone(),
            initiator: initiator.clone(),
            isid: l.isid,
            tsih,
            peer: peer_s.clone(),
            addr,
            proven: l.proven.is_some(),
            digests: l.neg.digests,
        },
        &acl_name,
        // Kept while they exist, closing included: a login that reinstates one must find it
        // until what it runs has completed (`reinstated`).
        &|id| registry.holds(id),
    );
    if !recorded {
        crate::log!(
            Level::Info,
            "{peer_s}: iSCSI initiator '{who}': refused: target {} changed during the login",
            target.escape_debug()
        );
        leave_all(&admitted);
        drop((admitted, list_room));
        l.respond(s, refuse_flags, status::FORBIDDEN, 0, &[])?;
        return None;
    }
    l.depth = admitted.iter().map(|a| a.depth).min().unwrap_or(depth);
    if l.respond(s, flags, status::SUCCESS, tsih, &out).is_none() {
        // Its sessions end here: the record goes with them (`retain_sessions`).
        leave_all(&admitted);
        return None;
    }
    crate::log!(
        Level::Info,
        "{peer_s}: iSCSI initiator '{who}' logged in to {} ({} LUN(s); digests header {}, data {})",
        target.escape_debug(),
        luns.len(),
        l.neg.digests.header,
        l.neg.digests.data
    );
    let max_io = admitted.iter().map(|a| a.max_io).min().unwrap_or(max_io);
    // The LUNs an EXTENDED COPY may read from: what this initiator may open, each with its
    // reservations (which bind the copy's reads of it).
    let open = registry.open_to(l.proven.as_deref(), &addr);
    let peers = open
        .iter()
        .zip(registry.reservations.lus(&open))
        .map(|(e, reservations)| Peer {
            name: e.name.clone(),
            info: lun_info(e, e.size(), max_io, false),
            reservations,
            export: Arc::downgrade(e),
        })
        .collect();
    let fe = Iscsi::new(IscsiSetup {
        peers,
        neg: l.neg,
        statsn: l.statsn,
        expcmdsn: l.cmdsn,
        depth: l.depth,
        granted: l.granted,
        luns: luns
            .iter()
            .zip(&admitted)
            .map(|((lun, e), a)| SetupLun {
                lun: *lun,
                export: e.clone(),
                // What the session's executor holds its I/O to, whatever the export has grown
                // to since it was admitted.
                size: a.size,
                copy: a.copy,
                reservations: registry.reservations.lu(e),
            })
            .collect(),
        target,
        initiator,
        isid: l.isid,
        max_io,
        list_room,
    });
    Some((admitted, Box::new(fe)))
}

/// The LUNs of target `target` this initiator may open, as (LUN, export), LUN ascending:
/// a configured target's that its ACL and each export's rules allow (the others are masked),
/// or an export's own target's LUN 0. `Err`: the status to refuse the login with, and why.
fn resolve(
    l: &Login,
    target: &str,
    addr: &PeerAddr,
    registry: &Registry,
) -> Result<Vec<(u64, Arc<Export>)>, Refusal> {
    let t = target.escape_debug();
    let proven = l.proven.as_deref();
    if let Some(c) = registry.iscsi.target(target) {
        let name = proven.or(l.initiator.as_deref()).unwrap_or_default();
        if !c.admits(name) {
            return Err(Refusal(
                status::FORBIDDEN,
                format!("is not on target '{t}''s initiator list"),
            ));
        }
        let luns: Vec<_> = c
            .luns
            .iter()
            .filter_map(|(lun, e)| Some((*lun, registry.permitted(e, proven, addr)?)))
            .collect();
        return match luns.is_empty() {
            false => Ok(luns),
            true if c.luns.is_empty() => Err(Refusal(
                status::NOT_FOUND,
                format!("asked for target '{t}', which has no LUNs"),
            )),
            true => Err(Refusal(
                status::FORBIDDEN,
                format!("may open no LUN of target '{t}'"),
            )),
        };
    }
    let name = target.strip_prefix(BLKWIRE_IQN_PREFIX).unwrap_or("");
    match (!name.is_empty())
        .then(|| registry.permitted(name, proven, addr))
        .flatten()
    {
        Some(e) => Ok(vec![(0, e)]),
        None if !name.is_empty() && registry.has_export(name) => Err(Refusal(
            status::FORBIDDEN,
            format!("may not open target '{t}'"),
        )),
        None => Err(Refusal(
            status::NOT_FOUND,
            format!("asked for unknown target '{t}'"),
        )),
    }
}

/// Most text one SendTargets answer holds (some thousands of targets): the listing stops at the
/// last target that fits.
const MAX_SEND_TARGETS: usize = 1 << 20;

/// A discovery session's full feature phase (§4.3, Appendix C): Text SendTargets, NOP-Out,
/// Logout, until the initiator logs out or the handshake deadline passes. An answer longer than
/// the initiator's MaxRecvDataSegmentLength goes out in several Text Responses (§11.11): each
/// but the last with F=0 and a Target Transfer Tag, which the initiator sends back in an empty
/// Text Request to get the next (§11.10.4).
fn discovery<S: Read + Write>(s: &mut S, l: &mut Login, registry: &Registry, addr: &PeerAddr) {
    let d = l.neg.digests;
    let mut buf = Vec::new();
    let mut expcmdsn = l.cmdsn;
    // The rest of an answer being sent in parts: ITT, TTT, text, offset sent so far.
    let mut more: Option<(u32, u32, Vec<u8>, usize)> = None;
    let mut ttt = 0u32;
    let mut requests = 0;
    while requests < MAX_LOGIN_PDUS {
        let Ok(Ok(n)) = read_pdu(s, &mut buf, &d, LOGIN_MAX_DATA) else {
            return;
        };
        let Ok(p) = iscsi::decode(&buf[..n], &d) else {
            return;
        };
        if !p.immediate() {
            expcmdsn = p.cmdsn().wrapping_add(1);
        }
        let mut fin = true;
        let mut rsp_ttt = RESERVED_TAG;
        let (opcode, data): (u8, Vec<u8>) = match p.opcode() {
            op::TEXT_REQ if p.word20() != RESERVED_TAG => {
                // The next part of the answer `more` holds (bounded by it: not counted).
                let Some((itt, want, text, at)) = more.take() else {
                    return;
                };
                if p.itt() != itt || p.word20() != want || !p.data.is_empty() {
                    // Not the continuation we offered (§11.10.4): the exchange is over.
                    return;
                }
                let end = text_part(&text, at, l.neg.send_max as usize);
                let part = text[at..end].to_vec();
                if end < text.len() {
                    fin = false;
                    rsp_ttt = want;
                    more = Some((itt, want, text, end));
                }
                (op::TEXT_RSP, part)
            }
            op::TEXT_REQ => {
                requests += 1;
                // A new request ends any answer still in parts (§11.10.4).
                more = None;
                let mut out = Vec::new();
                for pair in iscsi::pairs(p.data).flatten() {
                    match pair {
                        ("SendTargets", v) => send_targets(v, l, registry, addr, &mut out),
                        (k, _) => iscsi::push_pair(&mut out, k, "NotUnderstood"),
                    }
                }
                let end = text_part(&out, 0, l.neg.send_max as usize);
                if end < out.len() {
                    ttt = ttt.wrapping_add(1) & 0x7fff_ffff;
                    fin = false;
                    rsp_ttt = ttt;
                    let part = out[..end].to_vec();
                    more = Some((p.itt(), ttt, out, end));
                    (op::TEXT_RSP, part)
                } else {
                    (op::TEXT_RSP, out)
                }
            }
            op::NOP_OUT if p.itt() != RESERVED_TAG => {
                requests += 1;
                // The ping data back, cut to what the initiator takes in one PDU (as the
                // full feature phase does).
                let most = p.data.len().min(l.neg.send_max as usize);
                (op::NOP_IN, p.data[..most].to_vec())
            }
            op::NOP_OUT => {
                requests += 1;
                continue;
            }
            op::LOGOUT_REQ => (op::LOGOUT_RSP, Vec::new()),
            _ => return,
        };
        let flags = match (fin, data.last()) {
            (true, _) => flag::FINAL,
            // A pair cut in two (C, §11.11.1): never for SendTargets' short pairs.
            (false, Some(&b)) if b != 0 => flag::CONTINUE,
            (false, _) => 0,
        };
        let mut b = Bhs::new(opcode, flags);
        b.itt(p.itt());
        if opcode == op::NOP_IN || opcode == op::TEXT_RSP {
            b.set32(20, rsp_ttt);
        }
        if opcode == op::NOP_IN {
            b.lun(p.lun());
        }
        b.sn(
            l.statsn,
            expcmdsn,
            expcmdsn.wrapping_add(MAX_DEPTH as u32 - 1),
        );
        l.statsn = l.statsn.wrapping_add(1);
        let mut out = Vec::new();
        b.encode(&data, &d, &mut out);
        if s.write_all(&out).is_err() || opcode == op::LOGOUT_RSP {
            return;
        }
    }
}

/// Where the part of `text` from `at` ends in a Text Response carrying at most `max` bytes:
/// after the last whole key=value pair that fits (a pair longer than `max`, which no target
/// name and address make, is cut).
pub(crate) fn text_part(text: &[u8], at: usize, max: usize) -> usize {
    let limit = (at + max.max(1)).min(text.len());
    if limit == text.len() {
        return limit;
    }
    match text[at..limit].iter().rposition(|&b| b == 0) {
        Some(i) => at + i + 1,
        None => limit,
    }
}

/// SendTargets (§13 and Appendix C): `All` lists every target this initiator may open (the
/// exports' own, then the configured ones whose ACL admits it and that have a LUN it may
/// open); a target name lists that one.
fn send_targets(v: &str, l: &Login, registry: &Registry, addr: &PeerAddr, out: &mut Vec<u8>) {
    let portals = registry.iscsi.listeners(l.local);
    let proven = l.proven.as_deref();
    let open = registry.open_to(proven, addr);
    let who = proven.or(l.initiator.as_deref()).unwrap_or_default();
    let configured = registry.iscsi.targets().into_iter().filter(|t| {
        t.admits(who)
            && t.luns
                .iter()
                .any(|(_, e)| open.iter().any(|o| &o.name == e))
    });
    let names = open
        .iter()
        .map(|e| format!("{BLKWIRE_IQN_PREFIX}{}", e.name))
        .chain(configured.map(|t| t.iqn));
    for name in names {
        if v != "All" && v != name {
            continue;
        }
        let at = out.len();
        iscsi::push_pair(out, "TargetName", &name);
        for p in &portals {
            let host = match p.ip() {
                IpAddr::V4(a) => a.to_string(),
                IpAddr::V6(a) => format!("[{a}]"),
            };
            iscsi::push_pair(out, "TargetAddress", &format!("{host}:{},1", p.port()));
        }
        if out.len() > MAX_SEND_TARGETS {
            // The answer is bounded: the targets that fit it.
            out.truncate(at);
            return;
        }
    }
}

/// The target name of an export.
pub fn target_name(export: &str) -> String {
    format!("{BLKWIRE_IQN_PREFIX}{export}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FirstBurstLength is answered within MaxBurstLength's bound (RFC 7143 §13.14): under a
    /// small `--max-io` the target answered 262144 beside a MaxBurstLength of 65536 and then
    /// enforced 65536.
    #[test]
    fn the_first_burst_answered_is_the_one_enforced() {
        let answers = |max_io: u32| {
            let mut l = Login::new(IpAddr::from([127, 0, 0, 1]), false, max_io, 128);
            let mut out = Vec::new();
            l.operational("MaxBurstLength", "16776192", &mut out);
            l.operational("FirstBurstLength", "262144", &mut out);
            let pairs: Vec<(String, String)> = iscsi::pairs(&out)
                .map(|p| p.map(|(k, v)| (k.to_string(), v.to_string())).unwrap())
                .collect();
            (pairs, l.neg.first_burst)
        };
        let (pairs, first) = answers(64 << 10);
        assert_eq!(first, 64 << 10);
        assert!(
            pairs.contains(&("FirstBurstLength".into(), "65536".into())),
            "{pairs:?}"
        );
        assert!(pairs.contains(&("MaxBurstLength".into(), "65536".into())));
        let (pairs, first) = answers(1 << 20);
        assert_eq!(first, OUR_FIRST_BURST.min(262144));
        assert!(pairs.contains(&("FirstBurstLength".into(), first.to_string())));
    }

    /// A login refused for a value the peer chose says the value escaped: refusals go to the
    /// log, where a line break would let the peer write lines of its own.
    #[test]
    fn refusals_quote_the_peers_values_escaped() {
        let keys = crate::access::SharedKeys::default();
        let registry = Registry::new(crate::access::Access::new(keys), Default::default());
        for text in [
            &b"SessionType=x\nblkwire info: forged\0"[..],
            b"AuthMethod=x\nblkwire info: forged\0",
        ] {
            let mut l = Login::new(IpAddr::from([127, 0, 0, 1]), false, 1 << 20, 128);
            let Err(Refusal(_, why)) = l.keys(0, text, &registry, &mut Vec::new()) else {
                panic!("accepted {text:?}");
            };
            assert!(
                !why.contains('\n') && why.contains("x\\nblkwire"),
                "{why:?}"
            );
        }
    }

    /// A login records its sessions only if its configured target is as it found it: a
    /// control call that changed it between the two is never missed.
    #[test]
    fn a_login_is_recorded_only_if_its_target_did_not_change_meanwhile() {
        const IQN: &str = "iqn.2026-11.com.example:t";
        let p = Portals::default();
        p.create_target(IQN, Some(vec!["iqn.a".into(), "iqn.b".into()]), false)
            .unwrap();
        p.add_lun(IQN, "x", Some(0)).unwrap();
        p.add_lun(IQN, "y", Some(3)).unwrap();
        let entry = |target: &str, luns: &[u64]| SessionEntry {
            session: 1,
            luns: luns.iter().map(|&l| (l, 1 + l as u32)).collect(),
            target: target.into(),
            initiator: "iqn.a".into(),
            isid: [0; 6],
            tsih: 1,
            peer: "test".into(),
            addr: PeerAddr::Ip(IpAddr::from([127, 0, 0, 1])),
            proven: false,
            digests: Digests::default(),
        };
        let live = |_| true;
        assert!(p.add_session(entry(IQN, &[0, 3]), "iqn.a", &live));
        p.remove_initiator(IQN, "iqn.a").unwrap();
        assert!(
            !p.add_session(entry(IQN, &[0, 3]), "iqn.a", &live),
            "no longer admitted"
        );
        assert!(p.add_session(entry(IQN, &[0, 3]), "iqn.b", &live));
        p.remove_lun(IQN, 3).unwrap();
        assert!(
            !p.add_session(entry(IQN, &[0, 3]), "iqn.b", &live),
            "LUN 3 removed"
        );
        assert!(p.add_session(entry(IQN, &[0]), "iqn.b", &live));
        p.delete_target(IQN).unwrap();
        assert!(
            !p.add_session(entry(IQN, &[0]), "iqn.b", &live),
            "target deleted"
        );
        let own = format!("{BLKWIRE_IQN_PREFIX}x");
        assert!(
            p.add_session(entry(&own, &[0]), "iqn.b", &live),
            "an export's own target"
        );
    }

    /// A login reinstates the sessions of its initiator's earlier login with the same ISID to
    /// the same target, from the same address unless both proved their name, and only those
    /// still open: one whose sessions ended is forgotten, not reported as ended again.
    #[test]
    fn a_login_reinstates_only_the_open_sessions_of_its_nexus() {
        const IQN: &str = "iqn.2026-11.com.example:t";
        let p = Portals::default();
        p.create_target(IQN, None, false).unwrap();
        p.add_lun(IQN, "x", Some(0)).unwrap();
        p.add_lun(IQN, "y", Some(1)).unwrap();
        let here = PeerAddr::Ip(IpAddr::from([127, 0, 0, 1]));
        let there = PeerAddr::Ip(IpAddr::from([127, 0, 0, 2]));
        let entry = |id: u32, isid: u8, proven: bool| SessionEntry {
            session: id,
            luns: vec![(0, id), (1, id + 100)],
            target: IQN.into(),
            initiator: "iqn.a".into(),
            isid: [isid; 6],
            tsih: 1,
            peer: "test".into(),
            addr: here,
            proven,
            digests: Digests::default(),
        };
        let all = |_| true;
        assert!(p.add_session(entry(7, 1, false), "iqn.a", &all));
        assert!(p.add_session(entry(8, 2, true), "iqn.a", &all));
        let ask = |isid: u8, proven, addr, live: &dyn Fn(u32) -> bool| {
            p.reinstated(IQN, "iqn.a", ([isid; 6], proven, addr), live)
        };
        let none: Option<Vec<u32>> = Some(vec![]);
        assert_eq!(ask(1, false, here, &all), Some(vec![7, 107]));
        assert_eq!(
            ask(1, true, there, &all),
            None,
            "unproven, elsewhere: neither ended nor run beside"
        );
        assert_eq!(
            ask(2, true, there, &all),
            Some(vec![8, 108]),
            "both proved the name"
        );
        assert_eq!(ask(2, false, there, &all), None, "this one did not");
        assert_eq!(ask(3, false, here, &all), none, "another ISID");
        assert_eq!(
            p.reinstated("iqn.other", "iqn.a", ([1; 6], false, here), &all),
            none
        );
        let live = |id| id != 107;
        assert_eq!(
            ask(1, false, here, &live),
            Some(vec![7]),
            "LUN 1's session ended"
        );
        let live = |id| id != 7 && id != 107;
        assert_eq!(ask(1, false, here, &live), none, "both ended");
        assert_eq!(
            ask(1, false, there, &live),
            none,
            "elsewhere, once it ended"
        );
        assert_eq!(
            p.sessions_of(IQN, None, None),
            [8, 108],
            "and its login is forgotten"
        );
    }

    /// SendTargets answers are cut after whole key=value pairs.
    #[test]
    fn text_parts_end_after_whole_pairs() {
        let text = b"TargetName=a\0TargetAddress=1\0TargetName=bb\0";
        assert_eq!(text_part(text, 0, 20), 13, "TargetName=a and its NUL");
        assert_eq!(text_part(text, 13, 20), 29);
        assert_eq!(text_part(text, 29, 20), text.len(), "the rest fits");
        assert_eq!(text_part(text, 0, 5), 5, "a pair longer than a PDU is cut");
    }

    /// RFC 1994's CHAP over MD5, with a vector computed independently (Python hashlib):
    /// MD5(0x01 || "secretsecret1234" || 00 01 .. 0f).
    #[test]
    fn chap_response_is_md5_of_id_secret_challenge() {
        let challenge: Vec<u8> = (0..16).collect();
        let r = chap_response(1, b"secretsecret1234", &challenge).unwrap();
        assert_eq!(iscsi::hex(&r), "0xab7c55adbe54eac30221152f0cf60099");
        assert_ne!(
            r,
            chap_response(2, b"secretsecret1234", &challenge).unwrap()
        );
    }
}
