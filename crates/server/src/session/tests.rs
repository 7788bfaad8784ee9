use std::sync::RwLock;

use blkwire_auth::seal::Sealer;
use blkwire_auth::KeyStore;
use blkwire_wire::{AuthBlock, AuthMethod, Header, Opcode, Tag, HEADER_LEN};

use super::*;

const LINK: u32 = 8192;

fn key() -> Key {
    Key::new(&[7; 32]).unwrap()
}

/// A registry serving `d=mem:1M`; with `key`, a target whose key store knows host `h` by it.
fn registry(key: Option<&Key>) -> Registry {
    let keys = key.map(|k| {
        let mut s = KeyStore::default();
        s.insert("h", k.clone());
        Arc::new(s)
    });
    let r = Registry::new(Access::new(Arc::new(RwLock::new(keys))), Limits::default());
    r.add_export(blkwire_backend::ExportSpec::parse("d=mem:1M").unwrap())
        .unwrap();
    r
}

fn peer(port: u16) -> PeerId {
    PeerId::ip(([127, 0, 0, 1], port).into())
}

/// Opens a session of two queues from `peer`, over a datagram link (`datagram`) or a stream,
/// proven with `key` if given, as an initiator would: its HELLO reply, and the key root the
/// initiator derives.
fn open(
    r: &Registry,
    peer: &PeerId,
    datagram: bool,
    key: Option<&Key>,
) -> (HelloReply, Option<SessionSecret>) {
    let method = match key {
        Some(_) => AuthMethod::Psk,
        None => AuthMethod::None,
    };
    let mut h = Hello {
        queues: 2,
        depth: 4,
        max_io: 64 << 10,
        client_features: 0,
        frame_payload: if datagram { LINK } else { 0 },
        nonce: 1,
        host_id: "h".into(),
        export: "d".into(),
        auth: AuthBlock::first(method, false, datagram, [3; 32]),
        replaces: None,
    };
    let link = datagram.then_some(LINK);
    let HelloAnswer::Challenge(n) = r.hello(&h, peer, (link, datagram), None, &Vec::new) else {
        panic!("the first HELLO was not challenged");
    };
    h.auth.nonce_s = n;
    let t = proof::transcript(&h.transcript_bytes().unwrap());
    if let Some(k) = key {
        h.auth.proof_c = proof::initiator_proof(k, &t);
    }
    let HelloAnswer::Welcome(p, Some(_)) = r.hello(&h, peer, (link, datagram), None, &Vec::new)
    else {
        panic!("the HELLO was refused");
    };
    let secret = key.map(|k| SessionSecret::derive(k, &h.auth.nonce_c, &h.auth.nonce_s, &t));
    (HelloReply::decode(&p).unwrap(), secret)
}

/// The JOIN of queue 1 the session's initiator would send, answering challenge `nonce_s`.
fn join_payload(
    reply: &HelloReply,
    secret: Option<&SessionSecret>,
    nonce_s: [u8; AUTH_LEN],
) -> [u8; Join::LEN] {
    Join {
        cookie: reply.cookie,
        proof: secret.map_or([0; AUTH_LEN], |s| {
            s.join_proof(reply.session, 1, reply.cookie)
        }),
        nonce_s,
    }
    .encode()
}

/// `payload` as the sealed JOIN frame of queue 1 (PROTOCOL.md §12.4).
fn sealed(sealer: &mut Sealer, reply: &HelloReply, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::request(Opcode::Join, Tag::new(0, 0), 0, 0);
    h.session = reply.session;
    h.queue = 1;
    h.payload_len = payload.len() as u32;
    h.mark_sealed();
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(payload);
    f.extend_from_slice(&[0; SEAL_LEN]);
    sealer.seal(&mut f, HEADER_LEN);
    f
}

fn sealer(secret: &SessionSecret, reply: &HelloReply) -> Sealer {
    let k = secret.frame_key(reply.session, 1, Direction::ToTarget);
    Sealer::new(&k, false)
}

/// A datagram session's JOIN (cookie and proof, readable on the wire when frames are only
/// authenticated) replayed over TCP would join an unsealed queue into a sealed session: a
/// JOIN is admitted only over the kind of link that created its session.
#[test]
fn a_datagram_sessions_join_is_refused_over_a_stream() {
    let k = key();
    let r = registry(Some(&k));
    // The control: a stream session's JOIN over a stream is admitted.
    let (reply, secret) = open(&r, &peer(1000), false, Some(&k));
    let j = join_payload(&reply, secret.as_ref(), [0; AUTH_LEN]);
    let adm = r.join(reply.session, 1, &j, &peer(1001), false, None);
    assert!(adm.is_ok_and(|a| a.seal.is_none()));
    // The same JOIN, right cookie and proof, for a datagram session.
    let (reply, secret) = open(&r, &peer(2000), true, Some(&k));
    let j = join_payload(&reply, secret.as_ref(), [0; AUTH_LEN]);
    let got = r.join(reply.session, 1, &j, &peer(2001), false, None);
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
    // Without keys too (the cookie is all a keyless JOIN has, and it travels in clear).
    let r = registry(None);
    let (reply, _) = open(&r, &peer(3000), true, None);
    let j = join_payload(&reply, None, [0; AUTH_LEN]);
    let got = r.join(reply.session, 1, &j, &peer(3001), false, None);
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
}

/// The other way round: a stream session's queue does not join over datagrams, even with a
/// JOIN sealed under the queue's own key.
#[test]
fn a_stream_sessions_join_is_refused_over_datagrams() {
    let k = key();
    let r = registry(Some(&k));
    // The control: a datagram session's sealed JOIN is challenged at its address, then
    // admitted with its frame keys.
    let (reply, secret) = open(&r, &peer(1000), true, Some(&k));
    let secret = secret.unwrap();
    let mut s = sealer(&secret, &reply);
    let j = join_payload(&reply, Some(&secret), [0; AUTH_LEN]);
    let f = sealed(&mut s, &reply, &j);
    let got = r.join(reply.session, 1, &j, &peer(1001), true, Some(&f));
    let Err(JoinRefused::Challenge(n)) = got else {
        panic!("the first datagram JOIN was not challenged");
    };
    let j = join_payload(&reply, Some(&secret), n);
    let f = sealed(&mut s, &reply, &j);
    let adm = r.join(reply.session, 1, &j, &peer(1001), true, Some(&f));
    assert!(adm.is_ok_and(|a| a.seal.is_some()));
    // The same JOIN for a stream session.
    let (reply, secret) = open(&r, &peer(2000), false, Some(&k));
    let secret = secret.unwrap();
    let j = join_payload(&reply, Some(&secret), [0; AUTH_LEN]);
    let f = sealed(&mut sealer(&secret, &reply), &reply, &j);
    let got = r.join(reply.session, 1, &j, &peer(2001), true, Some(&f));
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
    // Without keys too.
    let r = registry(None);
    let (reply, _) = open(&r, &peer(3000), false, None);
    let j = join_payload(&reply, None, [0; AUTH_LEN]);
    let got = r.join(reply.session, 1, &j, &peer(3001), true, None);
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
}

/// A datagram session's queues join on its kind of port: one created over UDP (an IP peer)
/// does not take a queue from raw Ethernet (a MAC), whose link never negotiated its frame
/// payload and where a header-only CRC is not allowed (§9.7); nor the other way round.
#[test]
fn a_datagram_sessions_join_is_refused_from_the_other_kind_of_port() {
    let r = registry(None);
    let mac = PeerId::mac([2, 0, 0, 0, 0, 1]);
    let (reply, _) = open(&r, &peer(1000), true, None);
    let j = join_payload(&reply, None, [0; AUTH_LEN]);
    let got = r.join(reply.session, 1, &j, &mac, true, None);
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
    // The control: from UDP it gets as far as the address challenge.
    let got = r.join(reply.session, 1, &j, &peer(1001), true, None);
    assert!(
        matches!(got, Err(JoinRefused::Challenge(_))),
        "{:?}",
        got.err()
    );
    let (reply, _) = open(&r, &mac, true, None);
    let j = join_payload(&reply, None, [0; AUTH_LEN]);
    let got = r.join(reply.session, 1, &j, &peer(2001), true, None);
    assert_eq!(got.err(), Some(JoinRefused::Status(Status::Access)));
}

/// A HELLO that replaces a queue (PROTOCOL.md §2.6).
mod replacement {
    use crate::session::*;
    use blkwire_wire::{AuthBlock, AuthMethod};
    use std::sync::mpsc;
    use std::time::Duration;

    /// A registry serving `a=mem:1M` to anyone, whose queue closer reports on the channel.
    fn registry() -> (Arc<Registry>, mpsc::Receiver<(u32, u16)>) {
        let r = Arc::new(Registry::new(
            Access::new(Default::default()),
            Limits::default(),
        ));
        r.add_export(ExportSpec::parse("a=mem:1M").unwrap())
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        r.set_queue_closer(Box::new(move |s, q| {
            let _ = tx.lock().unwrap().send((s, q));
        }));
        (r, rx)
    }

    fn attempt() -> [u8; 32] {
        let mut a = [0u8; 32];
        blkwire_auth::random(&mut a);
        a
    }

    fn hello(host: &str, queues: u16, replaces: Option<QueueRef>) -> Hello {
        Hello {
            queues,
            depth: 8,
            max_io: 64 << 10,
            client_features: 0,
            frame_payload: 0,
            nonce: blkwire_auth::random_u64(),
            host_id: host.into(),
            export: "a".into(),
            // Each its own attempt: one attempt is answered once (`Access::claim_attempt`).
            auth: AuthBlock::first(AuthMethod::None, false, false, attempt()),
            replaces,
        }
    }

    /// A HELLO from 127.0.0.1 answered through its challenge: the session's reply, or the
    /// refusal's status.
    fn open(r: &Registry, h: Hello, wait: Option<Instant>) -> Result<HelloReply, Status> {
        open_from(r, h, wait, "127.0.0.1:5000")
    }

    fn open_from(
        r: &Registry,
        mut h: Hello,
        wait: Option<Instant>,
        from: &str,
    ) -> Result<HelloReply, Status> {
        let peer = PeerId::ip(from.parse().unwrap());
        for _ in 0..2 {
            match r.hello(&h, &peer, (None, false), wait, &Vec::new) {
                HelloAnswer::Challenge(n) => h.auth.nonce_s = n,
                HelloAnswer::Welcome(p, _) => return Ok(HelloReply::decode(&p).unwrap()),
                HelloAnswer::Refused(st) => return Err(st),
            }
        }
        panic!("challenged twice");
    }

    fn name(r: &HelloReply, queue: u16) -> QueueRef {
        QueueRef {
            session: r.session,
            queue,
            cookie: r.cookie,
        }
    }

    #[test]
    fn a_hello_replacing_a_live_queue_waits_until_it_has_left() {
        let (reg, closed) = registry();
        let old = open(&reg, hello("h", 1, None), None).unwrap();
        // Not waiting: BUSY while the queue is live, and its reactors are told to close it
        // (again at each HELLO: one that was not handed the queue yet when first told).
        let again = || open(&reg, hello("h", 1, Some(name(&old, 0))), None);
        assert_eq!(again().unwrap_err(), Status::Busy);
        assert_eq!(again().unwrap_err(), Status::Busy);
        let told: Vec<_> = closed.try_iter().collect();
        assert_eq!(told, [(old.session, 0), (old.session, 0)]);
        assert!(
            !reg.still_wanted(old.session, 0),
            "a reactor handed it now drops it"
        );
        // Waiting (TCP): the HELLO tells the reactors under the registry's lock, then waits
        // (releasing it); the queue leaves only after that, so the welcome came from the wait.
        let waiting = {
            let reg = reg.clone();
            std::thread::spawn(move || {
                let wait = Some(Instant::now() + Duration::from_secs(60));
                open(&reg, hello("h", 1, Some(name(&old, 0))), wait)
            })
        };
        assert_eq!(closed.recv().unwrap(), (old.session, 0));
        reg.leave(old.session, 0, &QueueStats::default());
        let new = waiting.join().unwrap().unwrap();
        assert_ne!(new.session, old.session);
        assert_eq!(reg.live_queues(old.session), 0, "the old session is gone");
        // A session it names that is gone (the queue left, the target restarted): no wait.
        assert!(open(&reg, hello("h", 1, Some(name(&old, 0))), None).is_ok());
    }

    #[test]
    fn a_hello_waiting_too_long_is_refused_busy() {
        let (reg, _closed) = registry();
        let old = open(&reg, hello("h", 1, None), None).unwrap();
        let wait = Some(Instant::now() + Duration::from_millis(50));
        let got = open(&reg, hello("h", 1, Some(name(&old, 0))), wait);
        assert_eq!(got.unwrap_err(), Status::Busy);
        assert_eq!(reg.live_queues(old.session), 1, "still there, closing");
    }

    #[test]
    fn only_the_holder_of_a_session_replaces_its_queue() {
        let (reg, closed) = registry();
        let old = open(&reg, hello("h", 1, None), None).unwrap();
        let mut wrong_cookie = name(&old, 0);
        wrong_cookie.cookie ^= 1;
        // Not that session (a wrong cookie, another host): nothing to fence, nothing closed.
        assert!(open(&reg, hello("h", 1, Some(wrong_cookie)), None).is_ok());
        assert!(open(&reg, hello("other", 1, Some(name(&old, 0))), None).is_ok());
        // A keyless session's cookie travels in clear: from another address it closes nothing.
        let elsewhere = hello("h", 1, Some(name(&old, 0)));
        assert!(open_from(&reg, elsewhere, None, "127.0.0.2:5000").is_ok());
        assert_eq!(closed.try_iter().count(), 0);
        assert_eq!(reg.live_queues(old.session), 1);
    }

    /// A link-local address is an address on its link: a keyless session opened from
    /// `fe80::1` on interface 2 is not taken over by a HELLO from `fe80::1` on interface 3
    /// (another host, on another link; it gets a session of its own), only by one from
    /// interface 2 (told to wait while the old queue closes).
    #[test]
    fn a_keyless_take_over_comes_from_the_same_link() {
        let (reg, closed) = registry();
        let old = open_from(&reg, hello("h", 1, None), None, "[fe80::1%2]:5000").unwrap();
        let other_link = hello("h", 1, Some(name(&old, 0)));
        assert!(open_from(&reg, other_link, None, "[fe80::1%3]:5000").is_ok());
        assert_eq!(closed.try_iter().count(), 0);
        assert_eq!(reg.live_queues(old.session), 1);
        let same_link = hello("h", 1, Some(name(&old, 0)));
        let got = open_from(&reg, same_link, None, "[fe80::1%2]:5001");
        assert_eq!(got.unwrap_err(), Status::Busy);
        let told: Vec<_> = closed.try_iter().collect();
        assert_eq!(told, [(old.session, 0)], "replaced from its own link");
    }

    /// One attempt opens one session, whichever listener or transport its final HELLO reaches
    /// (a replay from the sender's address to another port, or over TCP): sent again it opens
    /// nothing; over datagrams it gets the same welcome a few times while its session lasts,
    /// then refusals. An attempt refused for something else (an export not there
    /// yet, a queue it replaces still closing) may be sent again.
    #[test]
    fn an_attempt_opens_one_session() {
        let (reg, _closed) = registry();
        let peer = PeerId::ip("127.0.0.1:5000".parse().unwrap());
        let ask = |h: &Hello, link| reg.hello(h, &peer, link, None, &Vec::new);
        let through_challenge = |mut h: Hello, link| {
            let HelloAnswer::Challenge(n) = ask(&h, link) else {
                panic!("a first HELLO is challenged");
            };
            h.auth.nonce_s = n;
            h
        };
        let (stream, datagram) = ((None, false), (Some(super::LINK), true));
        // A datagram HELLO answered with a new session: the HELLO, its welcome, the session.
        let datagram_session = || {
            let mut d = hello("h", 1, None);
            (d.frame_payload, d.auth.datagram) = (super::LINK, true);
            let d = through_challenge(d, datagram);
            let HelloAnswer::Welcome(welcome, Some(adm)) = ask(&d, datagram) else {
                panic!("a session");
            };
            (d, welcome, adm)
        };
        // Over a stream, which cannot lose an answer, a repeat is refused at once.
        let h = through_challenge(hello("h", 1, None), stream);
        assert!(matches!(ask(&h, stream), HelloAnswer::Welcome(_, Some(_))));
        let before = reg.sessions().len();
        assert!(matches!(
            ask(&h, stream),
            HelloAnswer::Refused(Status::Access)
        ));
        assert_eq!(reg.sessions().len(), before, "no second session");
        // Over datagrams, its repeats get the same welcome a few times (its answer may have
        // been lost) and open nothing; then they are refused.
        let (d, welcome, _adm) = datagram_session();
        let before = reg.sessions().len();
        for _ in 0..crate::access::HELLO_ANSWERS {
            let HelloAnswer::Welcome(again, None) = ask(&d, datagram) else {
                panic!("the same welcome again");
            };
            assert_eq!(again, welcome);
        }
        assert!(matches!(
            ask(&d, datagram),
            HelloAnswer::Refused(Status::Access)
        ));
        assert_eq!(reg.sessions().len(), before, "no second session");
        // Once the session has ended, not even a first repeat gets its welcome.
        let (e, _, ended) = datagram_session();
        reg.leave(ended.session, 0, &QueueStats::default());
        assert!(reg.is_revoked(ended.session), "gone");
        assert!(matches!(
            ask(&e, datagram),
            HelloAnswer::Refused(Status::Access)
        ));
        // One refused for something else may be sent again.
        let mut later = hello("h", 1, None);
        later.export = "b".into();
        let later = through_challenge(later, stream);
        assert!(matches!(
            ask(&later, stream),
            HelloAnswer::Refused(Status::NoExport)
        ));
        reg.add_export(blkwire_backend::ExportSpec::parse("b=mem:1M").unwrap())
            .unwrap();
        assert!(matches!(ask(&later, stream), HelloAnswer::Welcome(..)));
    }

    #[test]
    fn a_replaced_queue_never_joined_cannot_be_joined_later() {
        let (reg, closed) = registry();
        let old = open(&reg, hello("h", 2, None), None).unwrap();
        assert!(open(&reg, hello("h", 1, Some(name(&old, 1))), None).is_ok());
        assert_eq!(closed.try_iter().count(), 0, "nothing ran on it");
        let join = Join {
            cookie: old.cookie,
            proof: [0; AUTH_LEN],
            nonce_s: [0; AUTH_LEN],
        };
        let peer = PeerId::ip("127.0.0.1:5001".parse().unwrap());
        let got = reg.join(old.session, 1, &join.encode(), &peer, false, None);
        assert_eq!(got.err(), Some(JoinRefused::Ended));
    }

    /// A queue that ended (its connection closed, or replaced while live) is refused ACCESS
    /// at a JOIN, for good: BUSY (for a queue connected now) would say to try again.
    #[test]
    fn an_ended_queue_is_refused_access_and_a_connected_one_busy() {
        let (reg, _closed) = registry();
        let s = open(&reg, hello("h", 3, None), None).unwrap();
        let join = Join {
            cookie: s.cookie,
            proof: [0; AUTH_LEN],
            nonce_s: [0; AUTH_LEN],
        };
        let peer = PeerId::ip("127.0.0.1:5001".parse().unwrap());
        let try_join = |q| reg.join(s.session, q, &join.encode(), &peer, false, None);
        assert!(try_join(1).is_ok());
        assert!(try_join(2).is_ok());
        assert_eq!(try_join(1).err(), Some(JoinRefused::Status(Status::Busy)));
        reg.leave(s.session, 1, &QueueStats::default());
        assert_eq!(try_join(1).err(), Some(JoinRefused::Ended));
        // Replaced while live: closing, then gone; never joinable again.
        assert_eq!(
            open(&reg, hello("h", 1, Some(name(&s, 2))), None).unwrap_err(),
            Status::Busy
        );
        assert_eq!(try_join(2).err(), Some(JoinRefused::Ended));
    }
}

/// A session records the key its host proved, not the one the store holds when the session
/// is registered, and registration checks it against the store under the registry's lock: a
/// `keys_load` (the store swapped, then `revoke_unpermitted`) racing a handshake either finds
/// the session and closes it, or comes first, and then the session is refused.
#[test]
fn a_session_keeps_the_key_it_was_proven_with() {
    let (old, new) = (key(), Key::new(&[8; 32]).unwrap());
    let r = registry(Some(&old));
    let export = r.exports()[0].clone();
    let id = peer(1);
    let owner = Owner {
        proven: Some("h"),
        shown: "h",
        id: &id,
        peer: "127.0.0.1:1",
    };
    let max_io = 64 << 10;
    let create = |key: &Key| {
        r.create(
            &export,
            &owner,
            (1 << 20, 1, 4, max_io, max_io, CopyLimits::default()),
            (None, Some(key.clone())),
            (false, false, false),
            Registry::queue_floor(max_io, 4, false),
        )
        .map(|(id, ..)| id)
    };
    // Registered before the keys are replaced: closed by the replacement.
    let id = create(&old).unwrap();
    let mut store = KeyStore::default();
    store.insert("h", new.clone());
    r.access.set_keys(store);
    assert_eq!(r.revoke_unpermitted(), [id]);
    // The HELLO's proof was checked with `old`, then the keys were replaced (the revocation
    // found nothing of it), then the session is registered: refused.
    assert_eq!(create(&old), Err(Status::Access));
    assert!(r.revoke_unpermitted().is_empty());
    // Proven with the host's key now, it is admitted.
    assert!(create(&new).is_ok());
}

/// A backend that records, when it is dropped, whether the registry's lock was held then.
struct DropProbe {
    registry: std::sync::Weak<Registry>,
    /// None until dropped; then whether the lock was held.
    locked: Arc<Mutex<Option<bool>>>,
}

impl blkwire_backend::Backend for DropProbe {
    fn describe(&self) -> String {
        "probe".into()
    }
    fn size(&self) -> u64 {
        1 << 20
    }
    fn block_sizes(&self) -> (u32, u32) {
        (512, 4096)
    }
    fn capabilities(&self) -> blkwire_backend::Capabilities {
        blkwire_backend::Capabilities::default()
    }
    fn reads_as_zero(&self) -> bool {
        true
    }
    fn open_queue(self: Arc<Self>) -> std::io::Result<Box<dyn blkwire_backend::QueueIo>> {
        Err(std::io::Error::other("a probe has no queues"))
    }
}

impl Drop for DropProbe {
    fn drop(&mut self) {
        let held = self.registry.upgrade().map(|r| r.inner.try_lock().is_err());
        *self.locked.lock().unwrap() = held;
    }
}

/// The registry lets go of an export's last reference after its lock, never under it: a
/// backend's drop may wait on the network (`rbd:` flushes and closes its image, for up to two
/// Ceph timeouts), and every handshake takes that lock. Both ways the last reference can go:
/// the removal of an export no session uses, and the end of the last session of a removed one.
#[test]
fn an_exports_last_reference_goes_outside_the_registry_lock() {
    let r = Arc::new(registry(None));
    let locked = Arc::new(Mutex::new(None));
    let add = |name: &str| {
        let probe = DropProbe {
            registry: Arc::downgrade(&r),
            locked: locked.clone(),
        };
        let export = Arc::new(Export::new(name, Arc::new(probe), false));
        r.lock().exports.push(Served {
            spec: ExportSpec::parse(&format!("{name}=null:1M")).unwrap(),
            export: export.clone(),
            acl: Acl::default(),
        });
        export
    };

    drop(add("p"));
    r.remove_export("p", false).unwrap();
    assert_eq!(
        *locked.lock().unwrap(),
        Some(false),
        "removal: dropped under the lock"
    );

    *locked.lock().unwrap() = None;
    let export = add("q");
    let id = peer(1);
    let owner = Owner {
        proven: None,
        shown: "h",
        id: &id,
        peer: "127.0.0.1:1",
    };
    let max_io = 64 << 10;
    let (id, ..) = r
        .create(
            &export,
            &owner,
            (1 << 20, 1, 4, max_io, max_io, CopyLimits::default()),
            (None, None),
            (false, false, false),
            Registry::queue_floor(max_io, 4, false),
        )
        .unwrap();
    drop(export);
    assert_eq!(r.remove_export("q", true).unwrap(), [id]);
    assert_eq!(*locked.lock().unwrap(), None, "the session still holds it");
    r.leave(id, 0, &QueueStats::default());
    assert_eq!(
        *locked.lock().unwrap(),
        Some(false),
        "session end: dropped under the lock"
    );
}

/// A handshake checks the export's allow rules (`permitted`) long before it registers its
/// session (an NBD handshake sends the export's facts to a client that may not read them; a
/// HELLO replacing a session waits for it), and `export_set_allow` or a first `keys_load`
/// in between revokes only the sessions registered already: registration checks the rules
/// again under the registry's lock, and refuses a host they no longer admit.
#[test]
fn rules_changed_during_a_handshake_refuse_its_session() {
    let r = registry(None);
    let id = peer(1);
    let owner = Owner {
        proven: None,
        shown: "nbd client",
        id: &id,
        peer: "127.0.0.1:1",
    };
    let admit = |e: &Arc<Export>| r.admit_single(e, (&owner, None), 1 << 20, 4, 64 << 10);
    // The control: admitted when nothing changed.
    let e = r.permitted("d", None, &id.addr).unwrap();
    assert!(admit(&e).is_ok());
    // Allowed at the handshake, then the rules name another address only.
    let e = r.permitted("d", None, &id.addr).unwrap();
    assert_eq!(r.set_allow("d", Some("10.0.0.1".into())).unwrap().len(), 1);
    assert_eq!(admit(&e).err(), Some(Status::Access));
    assert!(r.revoke_unpermitted().is_empty());
    // Allowed again, and a keyless handshake passes; then keys are loaded: keys are required.
    r.set_allow("d", None).unwrap();
    let e = r.permitted("d", None, &id.addr).unwrap();
    let mut store = KeyStore::default();
    store.insert("h", key());
    r.access.set_keys(store);
    assert!(r.revoke_unpermitted().is_empty());
    assert_eq!(admit(&e).err(), Some(Status::Access));
}

/// Rules changed to keep out an address a queue joined from close the session, as they do
/// one whose HELLO came from there (a keyless cookie travels in clear: anyone the old rules
/// admitted could join with it); a queue joined from the HELLO's own address keeps it.
#[test]
fn changed_rules_close_a_session_with_a_queue_joined_from_an_address_they_keep_out() {
    for (joiner, closed) in [([127, 0, 0, 1], false), ([127, 0, 0, 2], true)] {
        let r = registry(None);
        let (reply, _) = open(&r, &peer(1000), false, None);
        let j = join_payload(&reply, None, [0; AUTH_LEN]);
        let from = PeerId::ip((joiner, 1001).into());
        assert!(r.join(reply.session, 1, &j, &from, false, None).is_ok());
        let revoked = r.set_allow("d", Some("127.0.0.1".into())).unwrap();
        assert_eq!(
            revoked == [reply.session],
            closed,
            "joined from {joiner:?}: {revoked:?}"
        );
    }
}

/// Rules for an export that does not exist say so first, not what is wrong with the rules
/// (a host id on a target without keys).
#[test]
fn rules_for_an_unknown_export_say_it_is_unknown() {
    let r = registry(None);
    let e = r.set_allow("nosuch", Some("db1".into())).unwrap_err();
    assert!(e.contains("no export named 'nosuch'"), "{e}");
    let e = r.set_allow("d", Some("db1".into())).unwrap_err();
    assert!(e.contains("only proven with a key"), "{e}");
}

/// A COPY's source is checked against every address the session's queues came from: a queue
/// joined from an address the source's rules keep out may not copy from it (the session's
/// first address could).
#[test]
fn a_copy_source_admits_every_address_the_session_came_from() {
    for (joiner, allowed) in [([127, 0, 0, 1], true), ([127, 0, 0, 2], false)] {
        let r = registry(None);
        r.add_export(blkwire_backend::ExportSpec::parse("b=mem:1M,allow=127.0.0.1").unwrap())
            .unwrap();
        let (reply, _) = open(&r, &peer(1000), false, None);
        assert!(r.copy_source(reply.session, "b").is_some());
        let j = join_payload(&reply, None, [0; AUTH_LEN]);
        let from = PeerId::ip((joiner, 1001).into());
        assert!(r.join(reply.session, 1, &j, &from, false, None).is_ok());
        assert_eq!(
            r.copy_source(reply.session, "b").is_some(),
            allowed,
            "joined from {joiner:?}"
        );
        assert!(r.copy_source(reply.session, "d").is_some());
        assert!(r.copy_source(reply.session, "nosuch").is_none());
    }
}

/// A HELLO's logical block is the block the export takes I/O in: a backend that needs page
/// alignment (O_DIRECT on a 512-byte-sector device) announces 4096, and max I/O is a multiple
/// of it, over streams and datagrams, as NBD, NVMe/TCP and iSCSI announce it.
#[test]
fn the_logical_block_is_the_unit_the_export_takes_io_in() {
    let r = Registry::new(Access::new(Arc::new(RwLock::new(None))), Limits::default());
    let mem = Export::open(&blkwire_backend::ExportSpec::parse("d=mem:1M").unwrap()).unwrap();
    let direct = Export::new(
        "d",
        Arc::new(blkwire_backend::testing::Direct512(mem.backend().clone())),
        false,
    );
    assert_eq!(direct.backend().block_sizes().0, 512);
    r.lock().exports.push(Served {
        spec: blkwire_backend::ExportSpec::parse("d=mem:1M").unwrap(),
        export: Arc::new(direct),
        acl: Acl::default(),
    });
    for (port, datagram) in [(1, false), (2, true)] {
        let (reply, _) = open(&r, &peer(port), datagram, None);
        assert_eq!(reply.logical_block, 4096, "datagram {datagram}");
        assert!(reply.physical_block >= 4096);
        assert_eq!(reply.max_io % 4096, 0, "max I/O {}", reply.max_io);
    }
}
