//! NBD frontend, handshake phase (fixed newstyle, doc/proto.md of the NetworkBlockDevice
//! project). Runs on the short-lived handshake thread with blocking I/O and a timeout; once the
//! client enters transmission (NBD_OPT_GO or NBD_OPT_EXPORT_NAME) the socket goes to a reactor and
//! is served by the same data path as the native protocol (`frontend/nbd.rs`, `reactor/`).

use std::io::Read;

use blkwire_backend::Export;
use blkwire_wire::nbd::{self, info, opt, rep, InfoRequest, MetaRequest};
use blkwire_wire::Status;

use crate::access::PeerId;
use crate::frontend::{nbd::Nbd, StreamFrontend};
use crate::log::Level;
use crate::session::{Admitted, Registry};
use crate::stats::QueueStats;
use crate::tls::{Tls, TlsMode};
use crate::Handshake;

/// Largest option payload read; anything bigger is refused with ERR_TOO_BIG after skipping it.
const MAX_OPTION_DATA: u32 = 64 << 10;
/// Options one client may send before giving up on it (a loop of LIST must end).
const MAX_OPTIONS: usize = 1024;
/// Largest request payload advertised (NBD_INFO_BLOCK_SIZE), and accepted from a client that
/// asked for the block size constraints (the spec says up to 32 MiB must not be treated as an
/// attack), when the memory budget allows it (`max_payload`).
pub const NBD_MAX_PAYLOAD: u32 = 32 << 20;
/// ... accepted from a client that did not ask for them (EXPORT_NAME, or GO without
/// NBD_INFO_BLOCK_SIZE): it never agreed to our maximum, and some send larger requests; nbdkit
/// takes up to 64 MiB. Within the memory budget: a request larger than a connection's share
/// gets ENOMEM.
pub const NBD_MAX_UNNEGOTIATED: u32 = 64 << 20;
/// The largest request payload a connection with `share` bytes of the memory budget can always
/// be served: 32 MiB, or the largest power of two (1 MiB at least) that fits twice beside the
/// connection's first buffers. A request is held twice at worst: a WRITE in the receive buffer
/// and in a data buffer, a READ in a data buffer and in its reply. Advertised so to a client
/// that asks (NBD_INFO_BLOCK_SIZE), which then never sends one that gets ENOMEM or, a WRITE
/// whose frame cannot fit, ends the connection.
pub fn max_payload(share: usize) -> u32 {
    // The connection's first buffers (its floor without the data buffer), and room for a
    // reply's framing and the next request's header beside the request's bytes.
    const SLACK: usize = 64 << 10;
    let first = crate::reactor::stream_floor(1 << 20) - (1 << 20) + SLACK;
    let room = share.saturating_sub(first) / 2;
    let mut max = NBD_MAX_PAYLOAD;
    while max as usize > room && max > 1 << 20 {
        max /= 2;
    }
    max
}

/// Requests of one connection processed in parallel against async backends.
pub const NBD_DEPTH: u16 = 128;

/// Transmission flags: exactly what the export can do, natively or emulated.
fn transmission_flags(e: &Export, structured: bool) -> u16 {
    crate::advertise::Advertised::of(e).nbd(structured)
}

/// Whether a FAST_ZERO flag goes on to the executor: where the transmission flags told the
/// client it may ask for fast zeroing, and on a read-only export, whose zeroing is EPERM
/// whatever its flags (the spec prefers that to EINVAL).
fn advertises_fast_zero(e: &Export, structured: bool) -> bool {
    let f = transmission_flags(e, structured);
    f & (nbd::tflag::SEND_FAST_ZERO | nbd::tflag::READ_ONLY) != 0
}

fn send(s: &mut dyn Handshake, buf: &[u8]) -> Option<()> {
    s.write_all(buf).ok()
}

fn reply(s: &mut dyn Handshake, option: u32, typ: u32, data: &[u8]) -> Option<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    nbd::option_reply(&mut out, option, typ, data);
    send(s, &out)
}

fn error_reply(s: &mut dyn Handshake, option: u32, typ: u32, msg: &str) -> Option<()> {
    reply(s, option, typ, msg.as_bytes())
}

/// Finds an export by NBD name; "" is the default export (the first one), as qemu and libnbd
/// use it for `nbd://host` without a path.
/// The export a client names (the first one for an empty name), if this client may open it:
/// an export it may not open is as unknown to it as one that does not exist (PROTOCOL.md §12).
/// `host` is the identity the client proved (TLS-PSK), `None` for a plain connection.
fn find(
    registry: &Registry,
    (host, peer): (Option<&str>, &PeerId),
    name: &str,
) -> Option<std::sync::Arc<Export>> {
    let name = if name.is_empty() {
        registry.first_export()?
    } else {
        name.to_string()
    };
    registry.permitted(&name, host, &peer.addr)
}

/// Whether a client that finds no export should be told to start TLS first: with keys, only a
/// host proven with TLS-PSK is let in (`Access::permits`), so a plain client on a target that
/// offers TLS can open nothing before it does. (Meta-context options get no contexts instead:
/// the spec keeps NBD_REP_ERR_TLS_REQD to INFO, GO and EXPORT_NAME.)
fn tls_first(s: &dyn Handshake, tls: &Tls, registry: &Registry, proven: bool) -> bool {
    !proven && !s.is_tls() && tls.mode != TlsMode::Off && registry.access.has_keys()
}

/// Answers INFO or GO naming an export the client may not open (or that does not exist): under
/// `tls_first`, that TLS is required (the spec's answer with selective TLS, which qemu and
/// libnbd report as such; said for any name, so it tells nothing of which exist).
fn not_found(s: &mut dyn Handshake, option: u32, name: &str, tls_first: bool) -> Option<()> {
    if tls_first {
        let why = "this target admits only hosts proven with TLS-PSK: use STARTTLS";
        return error_reply(s, option, rep::ERR_TLS_REQD, why);
    }
    error_reply(
        s,
        option,
        rep::ERR_UNKNOWN,
        &format!("no export named '{name}'"),
    )
}

/// What LIST and INFO say about an export of `size` bytes: its size, never a backend path.
fn description(size: u64) -> String {
    format!("{size} bytes")
}

/// Runs the option haggling. Returns the admitted queue and its protocol state on success;
/// `None` when the client left, aborted, or broke the protocol (already logged).
pub fn negotiate(
    s: &mut dyn Handshake,
    peer: &str,
    registry: &Registry,
    tls: &Tls,
) -> Option<(Admitted, Box<dyn StreamFrontend>)> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&nbd::NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&nbd::IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES).to_be_bytes());
    send(s, &hello)?;
    let mut cf = [0u8; 4];
    s.read_exact(&mut cf).ok()?;
    let client_flags = u32::from_be_bytes(cf);
    let known = (nbd::FLAG_FIXED_NEWSTYLE | nbd::FLAG_NO_ZEROES) as u32;
    if client_flags & nbd::FLAG_FIXED_NEWSTYLE as u32 == 0 || client_flags & !known != 0 {
        // The spec: a server MUST drop a client that sets flags it does not know.
        crate::log!(
            Level::Info,
            "{peer}: NBD client flags {client_flags:#x} refused"
        );
        return None;
    }
    let no_zeroes = client_flags & nbd::FLAG_NO_ZEROES as u32 != 0;
    let id = match peer.parse::<std::net::SocketAddr>() {
        Ok(a) => PeerId::ip(a),
        Err(_) => return None,
    };
    let mut structured = false;
    // base:allocation selected by SET_META_CONTEXT, and for which export (its name, whatever
    // name found it): a context id is valid for the export it was negotiated for only
    // (proto.md), so a GO or EXPORT_NAME of another export enters transmission without it.
    let mut allocation = false;
    let mut allocation_for = String::new();
    // The host id a TLS-PSK client proved (the PSK user name) and the key it proved: admission
    // records both, and the per-export ACL check (issue 12 item 5) takes the id as the
    // authenticated host.
    let mut proven_host: Option<crate::tls::PskHost> = None;
    let mut said_tls_required = false;
    for _ in 0..MAX_OPTIONS {
        let mut oh = [0u8; nbd::OPTION_HEADER_LEN];
        s.read_exact(&mut oh).ok()?;
        let (option, len) = match nbd::decode_option_header(&oh) {
            Ok(x) => x,
            Err(e) => {
                crate::log!(Level::Info, "{peer}: NBD handshake refused: {e}");
                return None;
            }
        };
        if len > MAX_OPTION_DATA {
            // Skip the data without buffering it, then say why.
            let skipped =
                std::io::copy(&mut (&mut *s).take(len as u64), &mut std::io::sink()).ok()?;
            if skipped != len as u64 {
                return None;
            }
            match option {
                // No error reply exists for EXPORT_NAME: the spec has the connection closed.
                opt::EXPORT_NAME => return None,
                // ABORT is acknowledged whatever came with it.
                opt::ABORT => {
                    let _ = reply(s, option, rep::ACK, &[]);
                    return None;
                }
                _ => error_reply(s, option, rep::ERR_TOO_BIG, "option data too large")?,
            }
            continue;
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).ok()?;
        if option == opt::STARTTLS {
            if tls.mode == TlsMode::Off {
                error_reply(s, option, rep::ERR_UNSUP, "TLS is not offered")?;
            } else if s.is_tls() {
                error_reply(s, option, rep::ERR_INVALID, "TLS is already negotiated")?;
            } else if !data.is_empty() {
                error_reply(s, option, rep::ERR_INVALID, "STARTTLS takes no data")?;
            } else {
                reply(s, option, rep::ACK, &[])?;
                // Past the ACK there is no way back to plain: a failed handshake ends it.
                match s.start_tls(tls) {
                    Ok(host) => proven_host = host,
                    Err(e) => {
                        registry
                            .access
                            .refuse(&peer, &format!("NBD TLS handshake failed: {e}"));
                        return None;
                    }
                }
                // The spec: nothing negotiated before STARTTLS survives it.
                structured = false;
                allocation = false;
            }
            continue;
        }
        if tls.mode == TlsMode::Require && !s.is_tls() && option != opt::ABORT {
            if !said_tls_required {
                registry.access.refuse(
                    &peer,
                    "NBD option before STARTTLS, but this target requires TLS (--tls require)",
                );
                said_tls_required = true;
            }
            if option == opt::EXPORT_NAME {
                return None; // it has no error reply: the spec says to hang up
            }
            error_reply(
                s,
                option,
                rep::ERR_TLS_REQD,
                "TLS is required: use STARTTLS",
            )?;
            continue;
        }
        // Who the client is for the export rules: the host it proved with TLS-PSK, if any.
        let who = (proven_host.as_ref().map(|(h, _)| h.as_str()), &id);
        let key = proven_host.as_ref().map(|(_, k)| k);
        match option {
            opt::EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data).into_owned();
                // No error reply exists for EXPORT_NAME: an unknown name closes the connection.
                let e = find(registry, who, &name)?;
                // Nor for a refused session: the connection closes (logged by `admit`).
                let adm = admit(
                    registry,
                    &e,
                    (peer, who, key),
                    NBD_MAX_UNNEGOTIATED,
                    e.served_size(),
                );
                let adm = adm.ok()?;
                let mut out = Vec::with_capacity(134);
                out.extend_from_slice(&adm.size.to_be_bytes());
                out.extend_from_slice(&transmission_flags(&e, structured).to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                admitted_if_sent(registry, &adm, send(s, &out))?;
                let fe = Nbd {
                    structured,
                    allocation: allocation && allocation_for == e.name,
                    max_io: adm.max_io,
                    fast_zero: advertises_fast_zero(&e, structured),
                };
                return Some((adm, Box::new(fe)));
            }
            opt::ABORT => {
                let _ = reply(s, option, rep::ACK, &[]);
                return None;
            }
            opt::LIST => {
                if !data.is_empty() {
                    error_reply(s, option, rep::ERR_INVALID, "LIST takes no data")?;
                    continue;
                }
                for e in &registry.open_to(who.0, &who.1.addr) {
                    let mut d = Vec::with_capacity(4 + e.name.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(description(e.served_size()).as_bytes());
                    reply(s, option, rep::SERVER, &d)?;
                }
                reply(s, option, rep::ACK, &[])?;
            }
            opt::INFO | opt::GO => {
                let req = match InfoRequest::decode(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        error_reply(s, option, rep::ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some(e) = find(registry, who, &req.name) else {
                    let proven = proven_host.is_some();
                    let tls_first = tls_first(s, tls, registry, proven);
                    not_found(s, option, &req.name, tls_first)?;
                    continue;
                };
                // Read once: the size INFO gives is the size a GO's session checks against, in
                // whole blocks of the minimum block INFO gives (a direct=1 device of 512-byte
                // sectors may end in part of a page).
                let size = e.served_size();
                let share = registry.connection_share();
                send_info(s, option, (&e, size, share), &req, structured)?;
                if option == opt::GO {
                    let max = if req.requests.contains(&info::BLOCK_SIZE) {
                        max_payload(share)
                    } else {
                        NBD_MAX_UNNEGOTIATED
                    };
                    let adm = match admit(registry, &e, (peer, who, key), max, size) {
                        Ok(a) => a,
                        Err(st) => {
                            // The client is told why, as for any refused option (proto.md: a
                            // GO ends in ACK or an error), instead of finding the connection
                            // closed after the INFO replies; it may try again or give up.
                            let typ = if st == Status::Shutdown {
                                rep::ERR_SHUTDOWN
                            } else {
                                rep::ERR_POLICY
                            };
                            error_reply(s, option, typ, &format!("session refused: {st}"))?;
                            continue;
                        }
                    };
                    admitted_if_sent(registry, &adm, reply(s, option, rep::ACK, &[]))?;
                    let fe = Nbd {
                        structured,
                        allocation: allocation && allocation_for == e.name,
                        max_io: adm.max_io,
                        fast_zero: advertises_fast_zero(&e, structured),
                    };
                    return Some((adm, Box::new(fe)));
                }
                reply(s, option, rep::ACK, &[])?;
            }
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    error_reply(
                        s,
                        option,
                        rep::ERR_INVALID,
                        "STRUCTURED_REPLY takes no data",
                    )?;
                    continue;
                }
                structured = true;
                reply(s, option, rep::ACK, &[])?;
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                let set = option == opt::SET_META_CONTEXT;
                if set {
                    // The spec: a SET replaces what was selected, also when it fails.
                    allocation = false;
                }
                if set && !structured {
                    error_reply(
                        s,
                        option,
                        rep::ERR_INVALID,
                        "negotiate structured replies first",
                    )?;
                    continue;
                }
                let req = match MetaRequest::decode(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        error_reply(s, option, rep::ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some(named) = find(registry, who, &req.export) else {
                    if tls_first(s, tls, registry, proven_host.is_some()) {
                        // NBD_REP_ERR_TLS_REQD is for INFO, GO and EXPORT_NAME only (proto.md):
                        // no context, as for any name, and the GO that follows is told.
                        reply(s, option, rep::ACK, &[])?;
                    } else {
                        not_found(s, option, &req.export, false)?;
                    }
                    continue;
                };
                // LIST with no query lists everything; "base:" is the namespace wildcard.
                let matched = req.queries.iter().any(|q| q == nbd::BASE_ALLOCATION)
                    || (!set
                        && (req.queries.is_empty() || req.queries.iter().any(|q| q == "base:")));
                if set {
                    allocation = matched;
                    // The export the name found ("" is the default one), not the name: a GO
                    // may name it either way.
                    allocation_for.clone_from(&named.name);
                }
                if matched {
                    // LIST answers with id 0 (the spec: its ids mean nothing); SET with the id
                    // block status replies will carry.
                    let id = if set { nbd::BASE_ALLOCATION_ID } else { 0 };
                    let mut d = Vec::new();
                    d.extend_from_slice(&id.to_be_bytes());
                    d.extend_from_slice(nbd::BASE_ALLOCATION.as_bytes());
                    reply(s, option, rep::META_CONTEXT, &d)?;
                }
                reply(s, option, rep::ACK, &[])?;
            }
            // Extended headers are refused cleanly (libnbd falls back).
            _ => error_reply(s, option, rep::ERR_UNSUP, "option not supported")?,
        }
    }
    crate::log!(
        Level::Info,
        "{peer}: NBD client sent more than {MAX_OPTIONS} options"
    );
    None
}

fn send_info(
    s: &mut dyn Handshake,
    option: u32,
    (e, size, share): (&Export, u64, usize),
    req: &InfoRequest,
    structured: bool,
) -> Option<()> {
    let mut d = Vec::with_capacity(12);
    d.extend_from_slice(&info::EXPORT.to_be_bytes());
    d.extend_from_slice(&size.to_be_bytes());
    d.extend_from_slice(&transmission_flags(e, structured).to_be_bytes());
    reply(s, option, rep::INFO, &d)?;
    if req.requests.contains(&info::NAME) {
        let mut d = info::NAME.to_be_bytes().to_vec();
        d.extend_from_slice(e.name.as_bytes());
        reply(s, option, rep::INFO, &d)?;
    }
    if req.requests.contains(&info::DESCRIPTION) {
        let mut d = info::DESCRIPTION.to_be_bytes().to_vec();
        d.extend_from_slice(description(size).as_bytes());
        reply(s, option, rep::INFO, &d)?;
    }
    // Always sent: the constraints match the backend (O_DIRECT needs aligned I/O).
    let (_, physical) = e.backend().block_sizes();
    let min = e.alignment() as u32;
    let mut d = info::BLOCK_SIZE.to_be_bytes().to_vec();
    d.extend_from_slice(&min.to_be_bytes());
    d.extend_from_slice(&physical.max(min).max(512).to_be_bytes());
    d.extend_from_slice(&max_payload(share).to_be_bytes());
    reply(s, option, rep::INFO, &d)
}

/// `sent`, the handshake's last answer after the session was admitted: if it failed, the client
/// is gone and the session is left at once. No reactor holds its queue yet, so nothing else
/// would ever leave it: it would count against the session limits and keep its export.
fn admitted_if_sent(registry: &Registry, adm: &Admitted, sent: Option<()>) -> Option<()> {
    if sent.is_none() {
        registry.leave(adm.session, adm.queue, &QueueStats::default());
    }
    sent
}

/// Admits the client at `peer` to export `e` with requests of up to `max_payload` bytes and
/// the export's `size` its handshake sent; `proven` is the host id it proved with TLS-PSK
/// (None: plain or X.509, no identity) and `key` the key it proved it with.
fn admit(
    registry: &Registry,
    e: &std::sync::Arc<Export>,
    (peer, (proven, id), key): (&str, (Option<&str>, &PeerId), Option<&blkwire_auth::Key>),
    max_payload: u32,
    size: u64,
) -> Result<Admitted, Status> {
    let owner = crate::session::Owner {
        proven,
        shown: proven.unwrap_or("nbd client"),
        id,
        peer,
    };
    registry
        .admit_single(e, (&owner, key.cloned()), size, NBD_DEPTH, max_payload)
        .inspect_err(|st| crate::log!(Level::Info, "{peer}: NBD session refused: {st}"))
}
