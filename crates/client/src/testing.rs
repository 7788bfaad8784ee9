//! Stand-in targets on loopback for this crate's tests: each answers the handshake as a real
//! target would (or as a test makes it lie), then hands the connection to the test, so the
//! initiator can be checked against a hostile target without running one.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use blkwire_wire::{CopyLimits, Features, Header, HelloReply, Status, HEADER_LEN};

use crate::Url;

/// A HELLO reply granting `queues` x `depth`, max I/O `max_io` and frame payload
/// `frame_payload`, for a 1 MiB export of 512-byte blocks without COPY.
pub(crate) fn granted(queues: u16, depth: u16, max_io: u32, frame_payload: u32) -> HelloReply {
    HelloReply {
        size: 1 << 20,
        logical_block: 512,
        physical_block: 4096,
        features: Features(0),
        queues,
        depth,
        max_io,
        session: 1,
        cookie: 2,
        frame_payload,
        copy: CopyLimits::default(),
        session_flags: 0,
        target_proof: [0; 32],
    }
}

/// A native TCP target on loopback that serves one connection: it answers the first HELLO
/// (no challenge, no key) with `reply`, then hands the connection to `serve` on its own thread.
/// Returns the URL of its export.
pub(crate) fn native(reply: HelloReply, serve: impl FnOnce(TcpStream) + Send + 'static) -> Url {
    raw(move |mut s| {
        let Some((h, _)) = read_frame(&mut s) else {
            return;
        };
        let p = reply.encode();
        let mut out = h.reply(Status::Ok, p.len() as u32).to_bytes().to_vec();
        out.extend_from_slice(&p);
        if s.write_all(&out).is_ok() {
            serve(s);
        }
    })
}

/// A TLS 1.3 server context whose only credential is the pre-shared key `k` (any identity):
/// a target's end of a `--tls` session with a key, for tests that speak TLS themselves.
pub(crate) fn psk_server(k: Vec<u8>) -> openssl::ssl::SslContext {
    use openssl::ssl::{SslContextBuilder, SslMethod, SslVersion};
    let mut b = SslContextBuilder::new(SslMethod::tls_server()).unwrap();
    b.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
    b.set_psk_server_callback(move |_, _, psk| {
        psk[..k.len()].copy_from_slice(&k);
        Ok(k.len())
    });
    b.build()
}

/// A TCP listener on loopback that hands its first connection to `serve` on its own thread,
/// before any handshake. Returns a `tcp://` URL of it.
pub(crate) fn raw(serve: impl FnOnce(TcpStream) + Send + 'static) -> Url {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let port = l.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        if let Ok((s, _)) = l.accept() {
            serve(s);
        }
    });
    Url::parse(&format!("tcp://127.0.0.1:{port}/x")).expect("a URL")
}

/// Reads one native frame (header and payload) from a blocking stream; None once it is closed
/// or sends what is not a frame.
pub(crate) fn read_frame(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let h = Header::decode(&hb, 64 << 20).ok()?;
    let mut p = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut p).ok()?;
    Some((h, p))
}

/// A stand-in NVMe/TCP controller: the admin commands `nvme::connect` sends, answered as the
/// fields say, and I/O queues handed to the test after their Connect.
pub(crate) mod nvme {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;
    use std::time::Duration;

    use blkwire_wire::nvme_tcp::{self, C2HData, Cqe, Direction, IcResp, Params, Pdu, Progress};

    use crate::Url;

    /// The Identify controller IOCCSZ it reports, in 16-byte units: 4 KiB of data in the
    /// capsule.
    const IOCCSZ: u32 = (4096 + 64) / 16;

    /// What the controller answers.
    #[derive(Clone)]
    pub(crate) struct Controller {
        /// CAP.MQES (0's based).
        pub mqes: u16,
        /// Set Features (number of queues) answer: NSQA | NCQA << 16, 0's based.
        pub queues: u32,
        /// Identify controller data goes in this many C2HData PDUs of 4096 bytes each (one
        /// is what was asked for).
        pub identify_pieces: u32,
        /// The admin queue's ICResp goes out a byte at a time, this long apart.
        pub trickle: Option<Duration>,
        /// Namespace 1's size, in blocks of 4 KiB.
        pub blocks: u64,
        /// Identify controller ONCS: the optional commands offered.
        pub oncs: u16,
        /// CAP.TO, in 500 ms units.
        pub cap_to: u8,
        /// How many reads of CSTS after enabling find it not yet ready.
        pub not_ready: u32,
        /// CSTS.CFS once enabled.
        pub fatal: bool,
        /// The ICResp's MAXH2CDATA.
        pub maxh2cdata: u32,
    }

    impl Default for Controller {
        fn default() -> Self {
            Controller {
                mqes: 127,
                queues: 0,
                identify_pieces: 1,
                trickle: None,
                blocks: 2048,
                oncs: 0,
                cap_to: 1,
                not_ready: 0,
                fatal: false,
                maxh2cdata: 1 << 20,
            }
        }
    }

    /// An I/O queue, connected: the test speaks PDUs on it.
    pub(crate) struct Io {
        pub s: TcpStream,
        /// How PDUs to the host are encoded.
        tx: Params,
        rx: Params,
    }

    impl Io {
        /// The next PDU from the host, whole; None once it is closed.
        pub fn recv(&mut self) -> Option<Vec<u8>> {
            read_pdu(&mut self.s, &self.rx)
        }

        /// Decodes a PDU `recv` returned.
        pub fn decode<'a>(&self, b: &'a [u8]) -> Pdu<'a> {
            nvme_tcp::decode(b, &self.rx).expect("a PDU the host encoded")
        }

        /// Sends PDUs, in one write.
        pub fn send(&mut self, pdus: &[Pdu<'_>]) -> std::io::Result<()> {
            let mut out = Vec::new();
            for p in pdus {
                p.encode(&self.tx, &mut out);
            }
            self.s.write_all(&out)
        }
    }

    /// A CapsuleResp for command `cid` with `dw0` and NVMe status `status` (SCT/SC, 0: success).
    pub(crate) fn resp(cid: u16, dw0: u32, status: u16) -> Pdu<'static> {
        Pdu::CapsuleResp(Cqe {
            dw0,
            dw1: 0,
            sq_head: 0,
            sq_id: 0,
            cid,
            status: status << 1,
        })
    }

    fn params() -> (Params, Params) {
        (
            Params::initial(Direction::HostToController, 64 << 20),
            Params::initial(Direction::ControllerToHost, 64 << 20),
        )
    }

    fn read_pdu(s: &mut TcpStream, p: &Params) -> Option<Vec<u8>> {
        let mut b = vec![0u8; nvme_tcp::CH_LEN];
        s.read_exact(&mut b).ok()?;
        match nvme_tcp::pdu_len(&b, p).ok()? {
            Progress::Complete(_) => Some(b),
            Progress::Need(n) => {
                let have = b.len();
                b.resize(n, 0);
                s.read_exact(&mut b[have..]).ok()?;
                Some(b)
            }
        }
    }

    /// Takes the ICReq and answers it (trickled if `trickle`).
    fn initialize(s: &mut TcpStream, trickle: Option<Duration>, maxh2cdata: u32) -> Option<()> {
        let (rx, tx) = params();
        let b = read_pdu(s, &rx)?;
        let Ok(Pdu::IcReq(_)) = nvme_tcp::decode(&b, &rx) else {
            return None;
        };
        let mut out = Vec::new();
        Pdu::IcResp(IcResp {
            pfv: 0,
            cpda: 0,
            hdgst: false,
            ddgst: false,
            maxh2cdata,
        })
        .encode(&tx, &mut out);
        match trickle {
            None => s.write_all(&out).ok(),
            Some(pause) => {
                for b in out {
                    // A throttle: the host reads whenever the byte comes.
                    std::thread::sleep(pause);
                    s.write_all(&[b]).ok()?;
                }
                Some(())
            }
        }
    }

    /// Answers admin commands until the host closes the admin queue.
    fn admin(c: &Controller, s: &mut TcpStream) -> Option<()> {
        let (rx, tx) = params();
        let mut not_ready = c.not_ready;
        loop {
            let b = read_pdu(s, &rx)?;
            let Ok(Pdu::CapsuleCmd(cmd)) = nvme_tcp::decode(&b, &rx) else {
                return None;
            };
            let q = cmd.sqe;
            let mut out = Vec::new();
            let mut data = vec![0u8; 4096];
            let (dw0, data) = match (q.opcode, q.nsid & 0xff) {
                // Fabrics Connect (controller 1), Property Set, Property Get of CSTS or CAP.
                (0x7f, 0x01) => (1, None),
                (0x7f, 0x00) => (0, None),
                (0x7f, 0x04) if q.cdw11 == 0x1c && c.fatal => (2, None),
                (0x7f, 0x04) if q.cdw11 == 0x1c && not_ready > 0 => {
                    not_ready -= 1;
                    (0, None)
                }
                (0x7f, 0x04) if q.cdw11 == 0x1c => (1, None),
                (0x7f, 0x04) => (c.mqes as u32 | u32::from(c.cap_to) << 24, None),
                // Identify controller: IOCCSZ, MAXCMD 128, ONCS, a volatile write cache.
                (0x06, _) if q.cdw10 & 0xff == 1 => {
                    data[514..516].copy_from_slice(&128u16.to_le_bytes());
                    data[520..522].copy_from_slice(&c.oncs.to_le_bytes());
                    data[525] = 1;
                    data[1792..1796].copy_from_slice(&IOCCSZ.to_le_bytes());
                    (0, Some((data, c.identify_pieces)))
                }
                // Identify namespace 1: `blocks` blocks of 4 KiB.
                (0x06, _) => {
                    data[0..8].copy_from_slice(&c.blocks.to_le_bytes());
                    data[8..16].copy_from_slice(&c.blocks.to_le_bytes());
                    data[130] = 12;
                    (0, Some((data, 1)))
                }
                (0x09, _) => (c.queues, None),
                _ => return None,
            };
            if let Some((data, pieces)) = data {
                for i in 0..pieces {
                    Pdu::C2HData(C2HData {
                        cccid: q.cid,
                        datao: i * 4096,
                        last: i + 1 == pieces,
                        success: false,
                        data: &data,
                    })
                    .encode(&tx, &mut out);
                }
            }
            resp(q.cid, dw0, 0).encode(&tx, &mut out);
            s.write_all(&out).ok()?;
        }
    }

    /// Takes an I/O queue's Connect and answers it.
    fn connect_io(s: &mut TcpStream) -> Option<()> {
        let (rx, tx) = params();
        let b = read_pdu(s, &rx)?;
        let Ok(Pdu::CapsuleCmd(cmd)) = nvme_tcp::decode(&b, &rx) else {
            return None;
        };
        let mut out = Vec::new();
        resp(cmd.sqe.cid, 0, 0).encode(&tx, &mut out);
        s.write_all(&out).ok()
    }

    /// A running controller: `url` names it; dropped, it stops accepting connections and
    /// gives its port back (the queues it has taken end as their host closes them).
    pub(crate) struct Running {
        pub url: Url,
        addr: SocketAddr,
        stop: Arc<AtomicBool>,
        accepting: Option<JoinHandle<()>>,
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::SeqCst);
            // Wakes the accept the thread is blocked in; it sees `stop` and ends. Joined only
            // if the wake-up got through (the thread never blocks on anything but accept).
            if TcpStream::connect(self.addr).is_ok() {
                if let Some(t) = self.accepting.take() {
                    let _ = t.join();
                }
            }
        }
    }

    /// Starts the controller: the first connection is its admin queue, every later one an I/O
    /// queue handed to `io` once connected; each on its own thread, so that the accepting one
    /// waits on nothing else.
    pub(crate) fn start(c: Controller, io: impl Fn(Io) + Send + Sync + 'static) -> Running {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = l.local_addr().expect("its address");
        let io = Arc::new(io);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let accepting = std::thread::spawn(move || {
            let maxh2cdata = c.maxh2cdata;
            let mut admin_queue = Some(c);
            while let Ok((mut s, _)) = l.accept() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(c) = admin_queue.take() {
                    // The admin queue stays open beside the I/O queues, as the host holds it.
                    std::thread::spawn(move || {
                        if initialize(&mut s, c.trickle, c.maxh2cdata).is_some() {
                            admin(&c, &mut s);
                        }
                    });
                    continue;
                }
                let io = io.clone();
                std::thread::spawn(move || {
                    if initialize(&mut s, None, maxh2cdata).is_some()
                        && connect_io(&mut s).is_some()
                    {
                        let (rx, tx) = params();
                        io(Io { s, tx, rx });
                    }
                });
            }
        });
        Running {
            url: Url::parse(&format!("nvme-tcp://{addr}/x")).expect("a URL"),
            addr,
            stop,
            accepting: Some(accepting),
        }
    }

    #[test]
    fn a_dropped_controller_stops_accepting() {
        let c = start(Controller::default(), |_| {});
        let addr = c.addr;
        drop(c);
        let r = TcpStream::connect(addr);
        assert!(r.is_err(), "{addr} still accepts connections");
    }
}

/// The error of `connect`, which must fail well inside 3 s (the tests give it a timeout of a
/// few hundred milliseconds against a target that would hold it far longer).
pub(crate) fn fails_in_time(
    connect: impl FnOnce() -> crate::Result<crate::Session>,
) -> crate::Error {
    let start = std::time::Instant::now();
    let r = connect();
    assert!(
        start.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    match r {
        Ok(s) => panic!("connected: a session of {} bytes", s.info.size),
        Err(e) => e,
    }
}
