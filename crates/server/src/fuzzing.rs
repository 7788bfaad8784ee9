//! In-process entry points for the fuzz targets under `fuzz/`; not an API (hidden from the
//! docs, no stability). The datagram port is the target's most exposed decoder: any host that
//! can send it a UDP datagram or an Ethernet frame reaches its session table, its fragment
//! reassembly and the exactly-once rules of PROTOCOL.md §6 and §9, so `fuzz/fuzz_targets/
//! dgram.rs` drives it here the way the reactor does, one datagram at a time.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use blkwire_backend::{ExportSpec, Submitter};

use crate::access::Access;
use crate::dgram::{DgramPort, Peer, PortKind, PortSetup};
use crate::session::{Limits, Registry};

/// A UDP datagram port on 127.0.0.1 serving RAM exports, fed datagrams by the caller.
pub struct DatagramPort {
    pub(crate) port: DgramPort,
    registry: Arc<Registry>,
    link_payload: u32,
    pushed: usize,
}

/// The reactor's ring, as far as a port serving RAM exports needs one: their I/O completes
/// inline, so nothing should be pushed; what is (counted) never completes.
struct Entries<'a>(&'a mut usize);

impl Submitter for Entries<'_> {
    fn push(&mut self, _: io_uring::squeue::Entry) {
        *self.0 += 1;
    }
}

impl DatagramPort {
    /// A port with frames of up to `link_payload` bytes of payload and these exports
    /// (`NAME=mem:SIZE`), open to every host (no keys), with the default limits.
    pub fn new(exports: &[&str], link_payload: u32) -> io::Result<DatagramPort> {
        let registry = Arc::new(Registry::new(
            Access::new(Default::default()),
            Limits::default(),
        ));
        for spec in exports {
            let spec = ExportSpec::parse(spec).map_err(|e| io::Error::other(e.to_string()))?;
            registry.add_export(spec).map_err(io::Error::other)?;
        }
        Self::serving(registry, link_payload)
    }

    /// Another port of the same target (its registry, so its sessions and its checks), as
    /// a second UDP listener is.
    pub fn sibling(&self) -> io::Result<DatagramPort> {
        Self::serving(self.registry.clone(), self.link_payload)
    }

    pub(crate) fn serving(registry: Arc<Registry>, link_payload: u32) -> io::Result<DatagramPort> {
        let socket = UdpSocket::bind("127.0.0.1:0")?;
        socket.set_nonblocking(true)?;
        let setup = PortSetup {
            fd: OwnedFd::from(socket),
            kind: PortKind::Udp,
            link_payload,
            rcvbuf: 1 << 20,
            send_fd: None,
            ring: None,
            claim: None,
        };
        Ok(DatagramPort {
            port: DgramPort::new(setup, 0, registry.clone()),
            registry,
            link_payload,
            pushed: 0,
        })
    }

    /// Handles one datagram from `from`, then sends what it answered (to `from`, on loopback).
    pub fn receive(&mut self, datagram: &[u8], from: SocketAddr) {
        let mut ring = Entries(&mut self.pushed);
        self.port
            .receive_datagram(datagram, Peer::Ip(from), &mut ring, &|_, _, _| 0);
        self.port.sweep();
    }

    /// io_uring entries pushed so far: 0 for RAM exports, whose I/O completes inline.
    pub fn entries_pushed(&self) -> usize {
        self.pushed
    }
}

/// The host names the login targets' key store knows (`login`).
pub const LOGIN_INITIATOR: &str = "iqn.2026-11.io.test:fuzz";
pub const LOGIN_HOSTNQN: &str = "nqn.2026-11.io.test:fuzz";
/// The CHAP secret of [`LOGIN_INITIATOR`] and the key of [`LOGIN_HOSTNQN`], on a target with keys.
pub const LOGIN_SECRET: &[u8] = b"fuzz-secret-0123456789";

/// What one `login` run did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LoginRun {
    /// A session (iSCSI) or a controller (NVMe/TCP admin or I/O queue) was admitted.
    pub admitted: bool,
    /// Bytes the target answered.
    pub answered: usize,
}

/// The connection setup of iSCSI (login, CHAP, a discovery session's SendTargets) and NVMe/TCP
/// (ICReq, Connect and its data, in the capsule or solicited), what any host that reaches an
/// `iscsi://` or `nvme-tcp://` listener sends before it has proved anything, run over a byte
/// stream as the handshake thread runs it over a socket. An NVMe/TCP admin queue that Connect
/// creates then serves what follows (admin and fabrics commands: Identify, Get Log Page,
/// features, properties, DH-HMAC-CHAP), over a loopback TCP connection, as the handshake thread
/// serves it for the controller's life. The first byte of `input`: bit 0 picks NVMe/TCP (else
/// iSCSI), bit 1 a target with keys ([`LOGIN_INITIATOR`] with [`LOGIN_SECRET`] for CHAP,
/// [`LOGIN_HOSTNQN`] with it as its key); the rest is what the host sends, then the end of the
/// stream. The target serves one RAM export, `a`.
pub fn login(input: &[u8]) -> LoginRun {
    login_kept(input, None)
}

/// [`login`], keeping what the target sent in `kept` (the tests read the answers).
fn login_kept(input: &[u8], kept: Option<&mut Vec<u8>>) -> LoginRun {
    let Some((&how, bytes)) = input.split_first() else {
        return LoginRun::default();
    };
    let keys = fuzz_keys(how & 2 != 0, true);
    let registry = ram_target(keys);
    let mut s = Feed {
        input: bytes,
        answered: 0,
        kept,
    };
    let peer: SocketAddr = ([127, 0, 0, 1], 40000).into();
    let local: SocketAddr = ([127, 0, 0, 1], 3260).into();
    let admitted = if how & 1 != 0 {
        match crate::nvme::accept(&mut s, peer, local, &registry) {
            Some(crate::nvme::Accepted::Admin(q)) => {
                // What the controller answers counts with what the handshake did.
                let served = serve_admin(*q, s.input, &registry);
                io::Write::write_all(&mut s, &served).expect("a Feed takes everything");
                true
            }
            accepted => accepted.is_some(),
        }
    } else {
        crate::iscsi::accept(&mut s, peer, local, &registry).is_some()
    };
    LoginRun {
        admitted,
        answered: s.answered,
    }
}

/// Serves the admin queue `q` as the handshake thread does, over a loopback TCP connection the
/// host side of which sends `rest` and then closes; returns what the controller sent. The
/// sockets are real because the queue waits for them to be readable between commands (its
/// keep-alive and revocation checks).
fn serve_admin(q: crate::nvme::admin::AdminQueue, rest: &[u8], registry: &Registry) -> Vec<u8> {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
    let host = TcpStream::connect(listener.local_addr().expect("its address")).expect("connect");
    let (controller, _) = listener.accept().expect("accept");
    let mut reader = host.try_clone().expect("a second handle");
    let rest = rest.to_vec();
    // The host writes while the controller answers: neither may wait for the other.
    let writer = std::thread::spawn(move || {
        let mut host = host;
        let _ = host.write_all(&rest);
        let _ = host.shutdown(Shutdown::Write);
    });
    let answers = std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = reader.read_to_end(&mut got);
        got
    });
    let sock = crate::Bounded {
        s: controller,
        deadline: std::time::Instant::now(),
    };
    // Its sessions end with the registry, dropped after the run.
    q.serve(sock, registry, "127.0.0.1:40000");
    writer.join().expect("the host's writer");
    answers.join().expect("the host's reader")
}

/// NBD's option haggling (fixed newstyle: client flags, then options up to GO or
/// EXPORT_NAME), what any client that reaches an `nbd://` listener sends before it has proved
/// anything, run over a byte stream as the handshake thread runs it over a socket. The first
/// byte of `input`: bit 0 gives the target keys ([`LOGIN_HOSTNQN`] with [`LOGIN_SECRET`]),
/// bits 1-2 its TLS mode (0 off, 1 on, 2 require; TLS-PSK only, so only with keys, as `serve`
/// requires: else off); a STARTTLS the target accepts then fails its handshake, as a client that cannot
/// finish one does. The rest is what the client sends, then the end of the stream. The
/// target serves one RAM export, `a`.
pub fn nbd_options(input: &[u8]) -> LoginRun {
    nbd_options_kept(input, None)
}

/// [`nbd_options`], keeping what the target sent in `kept` (the tests read the replies).
fn nbd_options_kept(input: &[u8], kept: Option<&mut Vec<u8>>) -> LoginRun {
    let Some((&how, bytes)) = input.split_first() else {
        return LoginRun::default();
    };
    let keys = fuzz_keys(how & 1 != 0, false);
    let mode = match (how >> 1) & 3 {
        1 => crate::tls::TlsMode::On,
        2 => crate::tls::TlsMode::Require,
        _ => crate::tls::TlsMode::Off,
    };
    let settings = |mode| crate::tls::TlsSettings {
        mode,
        cert: None,
        key: None,
    };
    let tls = crate::tls::Tls::build(&settings(mode), &keys)
        .ok()
        .filter(|t| t.check_credentials(how & 1 != 0).is_ok());
    let tls = match tls {
        Some(t) => t,
        None => crate::tls::Tls::build(&settings(crate::tls::TlsMode::Off), &keys)
            .expect("TLS off always builds"),
    };
    let registry = ram_target(keys);
    let mut s = Feed {
        input: bytes,
        answered: 0,
        kept,
    };
    let admitted = crate::nbd::negotiate(&mut s, "127.0.0.1:40000", &registry, &tls).is_some();
    LoginRun {
        admitted,
        answered: s.answered,
    }
}

/// The key store of a fuzzed target: none, or [`LOGIN_HOSTNQN`]'s key [`LOGIN_SECRET`] and,
/// with `chap`, [`LOGIN_INITIATOR`]'s CHAP secret.
fn fuzz_keys(with: bool, chap: bool) -> crate::access::SharedKeys {
    let keys: crate::access::SharedKeys = Default::default();
    if with {
        let mut store = blkwire_auth::KeyStore::default();
        if chap {
            store
                .insert_chap(LOGIN_INITIATOR, LOGIN_SECRET, None)
                .expect("a valid secret");
        }
        store.insert(
            LOGIN_HOSTNQN,
            blkwire_auth::Key::new(LOGIN_SECRET).expect("a valid key"),
        );
        *keys.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(store));
    }
    keys
}

/// A target with these keys and the default limits serving one RAM export, `a`.
fn ram_target(keys: crate::access::SharedKeys) -> Registry {
    let registry = Registry::new(Access::new(keys), Limits::default());
    let spec = ExportSpec::parse("a=mem:1M").expect("a valid export");
    registry.add_export(spec).expect("a RAM export");
    registry
}

/// A connection whose host sends `input` and then closes; what the target sends is counted.
struct Feed<'a> {
    input: &'a [u8],
    answered: usize,
    kept: Option<&'a mut Vec<u8>>,
}

impl io::Read for Feed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl crate::Handshake for Feed<'_> {
    fn is_tls(&self) -> bool {
        false
    }

    /// No TLS over the fuzzer's bytes: the handshake fails, which ends the connection.
    fn start_tls(&mut self, _: &crate::tls::Tls) -> Result<Option<crate::tls::PskHost>, String> {
        Err("no TLS handshake over a fuzz input".into())
    }
}

impl io::Write for Feed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.answered += buf.len();
        if let Some(k) = &mut self.kept {
            k.extend_from_slice(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use blkwire_wire::nbd::rep;

    /// The option replies in what an NBD target sent (after its 18-byte greeting): option and
    /// reply type of each, up to the first bytes that are not one.
    fn nbd_replies(sent: &[u8]) -> Vec<(u32, u32)> {
        let word = |b: &[u8], at: usize| u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
        let mut out = Vec::new();
        let mut at = 18;
        while sent.len() >= at + 20 && sent[at..at + 8] == 0x3e889045565a9u64.to_be_bytes() {
            out.push((word(sent, at + 8), word(sent, at + 12)));
            at += 20 + word(sent, at + 16) as usize;
        }
        out
    }

    /// The seeds of fuzz target `target` (fuzz/seeds/TARGET/): each file's name and bytes.
    fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
        let dir = format!("{}/../../fuzz/seeds/{target}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("the seeds in {dir}: {e}"))
            .map(|e| {
                let path = e.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().to_string();
                (name, std::fs::read(&path).unwrap())
            })
            .collect()
    }

    /// The `nbd_options` fuzz target's seeds reach what they are named for: a session (GO,
    /// EXPORT_NAME, GO after an option too large to read), or the refusal each is built to get.
    #[test]
    fn nbd_option_seeds_reach_what_they_are_named_for() {
        let seeds = seeds("nbd_options");
        for (name, input) in &seeds {
            let mut sent = Vec::new();
            let run = super::nbd_options_kept(input, Some(&mut sent));
            let replies = nbd_replies(&sent);
            let has = |typ| replies.iter().any(|&(_, t)| t == typ);
            let admitted = ["go", "export-name", "too-big-then-go"].contains(&name.as_str());
            assert_eq!(run.admitted, admitted, "{name}: {replies:?}");
            assert_eq!(run.answered, sent.len());
            let reached = match name.as_str() {
                "go" => has(rep::META_CONTEXT) && has(rep::INFO) && has(rep::ACK),
                "export-name" => sent.len() == 18 + 10,
                "list-info-abort" => has(rep::SERVER) && has(rep::ERR_UNKNOWN) && has(rep::INFO),
                "too-big-then-go" => has(rep::ERR_TOO_BIG) && has(rep::ACK),
                "tls-require" => has(rep::ERR_TLS_REQD) && has(rep::ACK),
                "tls-on-plain" => has(rep::ERR_TLS_REQD) && !has(rep::SERVER),
                "bad-flags" => sent.len() == 18,
                _ => panic!("{name}: a seed this test does not know"),
            };
            assert!(reached, "{name}: {replies:?} ({} bytes)", sent.len());
        }
        assert_eq!(seeds.len(), 7);
    }

    /// The `login` fuzz target's seeds reach what they are named for: a session or a
    /// controller (so the fuzzer starts from inputs that get past the first checks), or, for
    /// CHAP with a wrong response, a discovery session and a Connect naming no controller, an
    /// answer and no admission.
    #[test]
    fn login_seeds_reach_what_they_are_named_for() {
        let seeds = seeds("login");
        for (name, input) in &seeds {
            let run = super::login(input);
            let refused = ["iscsi-chap", "iscsi-discovery", "nvme-io-unknown"];
            assert_eq!(
                run.admitted,
                !refused.contains(&name.as_str()),
                "{name}: {run:?}"
            );
            assert!(run.answered > 0, "{name}: no answer");
        }
        assert_eq!(seeds.len(), 9, "seeds of login");
    }

    /// The seed `name` of fuzz target `target`.
    fn seed(target: &str, name: &str) -> Vec<u8> {
        seeds(target)
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no seed {target}/{name}"))
            .1
    }

    /// The NVMe/TCP PDUs a controller sent, whole (checked): (type, CID, status) of each
    /// CapsuleResp (type 5) and C2HData (type 7, status 0); other types with CID 0.
    fn nvme_pdus(sent: &[u8]) -> Vec<(u8, u16, u16)> {
        let mut pdus = Vec::new();
        let mut at = 0;
        while at + 8 <= sent.len() {
            let plen = u32::from_le_bytes(sent[at + 4..at + 8].try_into().unwrap()) as usize;
            assert!(plen >= 8 && at + plen <= sent.len(), "a PDU at {at}");
            let p = &sent[at..at + plen];
            pdus.push(match p[0] {
                // The CQE after the 8-byte header: CID at 12, status (phase bit 0) at 14.
                0x05 => (
                    5,
                    u16::from_le_bytes([p[20], p[21]]),
                    u16::from_le_bytes([p[22], p[23]]) >> 1,
                ),
                0x07 => (7, u16::from_le_bytes([p[8], p[9]]), 0),
                t => (t, 0, 0),
            });
            at += plen;
        }
        assert_eq!(at, sent.len(), "whole PDUs");
        pdus
    }

    /// A login whose InitiatorName is empty is refused (Missing Parameter: an empty name names
    /// no one, and the session and its nexus would go by it); the same login named is not.
    #[test]
    fn an_empty_initiator_name_is_refused() {
        use blkwire_wire::iscsi::{flag, op, Bhs, Digests, IMMEDIATE};
        for (name, refused) in [("", true), ("iqn.2026-11.io.test:fuzz", false)] {
            let mut input = vec![0u8];
            let mut login = Bhs::new(op::LOGIN_REQ | IMMEDIATE, flag::TRANSIT | 0x07);
            login.lun(0x8000_0001_0000_0000).itt(1).set32(24, 1);
            let text = format!("InitiatorName={name}\0SessionType=Discovery\0");
            login.encode(text.as_bytes(), &Digests::default(), &mut input);
            let mut sent = Vec::new();
            super::login_kept(&input, Some(&mut sent));
            assert!(
                sent.len() >= 48 && sent[0] & 0x3f == 0x23,
                "a login response"
            );
            assert_eq!(
                (sent[36], sent[37]),
                if refused { (2, 7) } else { (0, 0) },
                "{name:?}"
            );
        }
    }

    /// A discovery session echoes a ping's data no longer than the initiator's
    /// MaxRecvDataSegmentLength (it echoed the 4 KiB whole to an initiator taking 512 bytes).
    #[test]
    fn a_discovery_ping_is_echoed_within_the_initiators_segment_length() {
        use blkwire_wire::iscsi::{flag, op, Bhs, Digests, IMMEDIATE};
        let d = Digests::default();
        let mut input = vec![0u8];
        let mut login = Bhs::new(op::LOGIN_REQ | IMMEDIATE, flag::TRANSIT | 0x07);
        login.lun(0x8000_0001_0000_0000).itt(1).set32(24, 1);
        let text = b"InitiatorName=iqn.2026-11.io.test:fuzz\0SessionType=Discovery\0\
                     MaxRecvDataSegmentLength=512\0";
        login.encode(text, &d, &mut input);
        let mut nop = Bhs::new(op::NOP_OUT | IMMEDIATE, flag::FINAL);
        nop.itt(0x10).set32(20, u32::MAX).set32(24, 1).set32(28, 1);
        nop.encode(&[7u8; 4096], &d, &mut input);
        let mut sent = Vec::new();
        super::login_kept(&input, Some(&mut sent));
        // Each PDU: its 48-byte header, then DataSegmentLength (bytes 5-7) padded to 4.
        let mut pdus = Vec::new();
        let mut at = 0;
        while at + 48 <= sent.len() {
            let len = u32::from_be_bytes([0, sent[at + 5], sent[at + 6], sent[at + 7]]) as usize;
            pdus.push((sent[at] & 0x3f, len));
            at += 48 + len.div_ceil(4) * 4;
        }
        assert_eq!(
            pdus.first().map(|p| p.0),
            Some(0x23),
            "a login response: {pdus:?}"
        );
        assert_eq!(pdus.get(1), Some(&(op::NOP_IN, 512)), "{pdus:?}");
    }

    /// An admin command whose answer is longer than the data its host's SGL describes (an
    /// Identify of 4 KiB into 16 bytes) fails with Data SGL Length Invalid and sends no data,
    /// as nvmet does; it used to send all 4 KiB past the host's buffer. The same Identify with
    /// room for it is answered.
    #[test]
    fn admin_data_never_exceeds_the_hosts_sgl() {
        let identify = |cid: u16, room: u32| {
            let mut pdu = vec![0x04, 0, 72, 0];
            pdu.extend_from_slice(&72u32.to_le_bytes());
            let mut sqe = [0u8; 64];
            sqe[0] = 0x06;
            sqe[1] = 0x40;
            sqe[2..4].copy_from_slice(&cid.to_le_bytes());
            sqe[32..36].copy_from_slice(&room.to_le_bytes());
            sqe[39] = 0x5a;
            sqe[40] = 1; // CNS 1: the controller
            pdu.extend_from_slice(&sqe);
            pdu
        };
        let mut input = seed("login", "nvme-admin");
        input.extend(identify(201, 16));
        input.extend(identify(202, 4096));
        let mut sent = Vec::new();
        assert!(super::login_kept(&input, Some(&mut sent)).admitted);
        let pdus = nvme_pdus(&sent);
        let of = |cid| {
            pdus.iter()
                .filter(|p| p.1 == cid)
                .copied()
                .collect::<Vec<_>>()
        };
        assert_eq!(of(201), [(5, 201, 0x0f | 0x4000)], "{pdus:?}");
        assert_eq!(of(202), [(7, 202, 0), (5, 202, 0)], "{pdus:?}");
    }

    /// The `login` seed that goes on past Connect reaches the admin queue: each of its admin
    /// and fabrics commands (CIDs 101-112) is answered with success, and the Asynchronous
    /// Event Request (113) is held.
    #[test]
    fn the_admin_queue_seed_gets_its_commands_answered() {
        let mut sent = Vec::new();
        let run = super::login_kept(&seed("login", "nvme-admin-commands"), Some(&mut sent));
        assert!(run.admitted && run.answered == sent.len(), "{run:?}");
        let answers: Vec<_> = nvme_pdus(&sent)
            .into_iter()
            .filter(|&(typ, cid, _)| typ == 5 && cid > 100)
            .map(|(_, cid, status)| (cid, status))
            .collect();
        let want: Vec<_> = (101..=112).map(|cid| (cid, 0)).collect();
        assert_eq!(answers, want);
    }
}
