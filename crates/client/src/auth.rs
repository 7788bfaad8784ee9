//! The initiator's side of the handshake's challenge and proofs (PROTOCOL.md §12): one HELLO
//! attempt, the answer to the target's challenge, and the check of the target's proof.

use std::sync::Arc;

use blkwire_auth::proof::{self, Direction, SessionSecret};
use blkwire_auth::seal::{Opener, Sealer};
use blkwire_auth::Key;
use blkwire_wire::{
    AuthBlock, AuthMethod, Header, Hello, HelloReply, Opcode, Status, Tag, AUTH_LEN,
};

use crate::{ConnectOptions, Error, Result};

/// One HELLO attempt: the same initiator nonce in both HELLOs.
pub(crate) struct Attempt {
    hello: Hello,
    key: Option<Key>,
    /// Names the target in errors.
    target: String,
}

/// A sealed datagram queue's keys, initiator side: it seals requests and opens replies.
pub(crate) struct QueueKeys {
    pub sealer: Sealer,
    pub opener: Opener,
}

/// What a method-1 session's queues derive their keys from.
#[derive(Clone)]
pub(crate) struct SessionKeys {
    secret: Arc<SessionSecret>,
    encrypt: bool,
}

impl SessionKeys {
    /// Queue `queue`'s frame keys.
    pub fn queue(&self, session: u32, queue: u16) -> QueueKeys {
        QueueKeys {
            sealer: Sealer::new(
                &self.secret.frame_key(session, queue, Direction::ToTarget),
                self.encrypt,
            ),
            opener: Opener::new(
                &self
                    .secret
                    .frame_key(session, queue, Direction::ToInitiator),
                self.encrypt,
            ),
        }
    }

    /// The proof a JOIN for `queue` carries.
    pub fn join_proof(&self, session: u32, queue: u16, cookie: u64) -> [u8; AUTH_LEN] {
        self.secret.join_proof(session, queue, cookie)
    }
}

impl Attempt {
    /// A HELLO for `export` (empty for a query with `features`), proving `opts.key` if any.
    pub fn new(
        target: String,
        export: &str,
        opts: &ConnectOptions,
        frame_payload: u32,
        features: u64,
    ) -> Result<Attempt> {
        blkwire_auth::keys::check_host_id(&opts.host_id).map_err(Error::Usage)?;
        let mut nonce_c = [0u8; AUTH_LEN];
        blkwire_auth::random(&mut nonce_c);
        let method = if opts.key.is_some() {
            AuthMethod::Psk
        } else {
            AuthMethod::None
        };
        let hello = Hello {
            queues: opts.queues.max(1),
            depth: opts.depth.max(1),
            max_io: opts.max_io.max(512),
            client_features: features,
            frame_payload,
            nonce: crate::random_u64(),
            host_id: opts.host_id.clone(),
            export: export.to_string(),
            // Datagram links name their frame payload, streams 0. Said in the proven HELLO,
            // so the target refuses it relayed over the other kind of link (§12.1).
            auth: AuthBlock::first(method, opts.encrypt, frame_payload != 0, nonce_c),
            replaces: opts.replaces.filter(|_| !export.is_empty()),
        };
        hello
            .encode()
            .map_err(|e| Error::Usage(format!("export name: {e}")))?;
        Ok(Attempt {
            hello,
            key: opts.key.clone(),
            target,
        })
    }

    /// The HELLO payload to send now.
    pub fn payload(&self) -> Vec<u8> {
        self.hello.encode().expect("checked in new")
    }

    /// Takes the target's challenge: the next HELLO answers it (and proves the key).
    pub fn answer(&mut self, challenge: &[u8]) -> Result<()> {
        let nonce: [u8; AUTH_LEN] = challenge
            .try_into()
            .map_err(|_| Error::Protocol("malformed challenge from the target".into()))?;
        self.hello.auth.nonce_s = nonce;
        self.hello.auth.proof_c = [0; AUTH_LEN];
        if let Some(key) = &self.key {
            let t = self.transcript();
            self.hello.auth.proof_c = proof::initiator_proof(key, &t);
        }
        Ok(())
    }

    fn transcript(&self) -> [u8; AUTH_LEN] {
        proof::transcript(&self.hello.transcript_bytes().expect("checked in new"))
    }

    /// What this HELLO asks for, in words.
    fn what(&self) -> String {
        match self.hello.client_features {
            _ if !self.hello.is_query() => format!("export '{}'", self.hello.export),
            f if f & blkwire_wire::QUERY_STATS != 0 => "stats".into(),
            _ => "list exports".into(),
        }
    }

    /// The error a refusal of this HELLO becomes: the target's own reason if it gave one
    /// (`reason`, the refusal's payload), else one that names the host and the target.
    pub fn refused(&self, status: Status, reason: &[u8]) -> Error {
        let host = &self.hello.host_id;
        let target = &self.target;
        if let Some(why) = crate::refusal_reason(reason) {
            let to = if self.hello.is_query() { " to" } else { "" };
            let what = format!("{target} refused{to} {}: {why}", self.what());
            // BUSY stays a status with its reason: a HELLO replacing a queue waits it out
            // (`connect`), whatever the target said.
            if status == Status::Busy {
                return Error::Status { what, status };
            }
            return Error::Auth(what);
        }
        if self.hello.client_features & blkwire_wire::QUERY_STATS != 0 && status == Status::Access {
            return Error::Auth(format!(
                "{target} refused host '{host}' the live counters: only proven hosts named by \
                 `serve --admin` may read them"
            ));
        }
        let why = match (status, &self.key) {
            (Status::Access, Some(_)) => format!(
                "{target} refused host '{host}': its key is wrong or unknown there, or the \
                 export does not allow this host (check --host-id and --key)"
            ),
            (Status::Access, None) => format!(
                "{target} refused host '{host}': it requires a key (pass --key FILE, or set \
                 BLKWIRE_KEY_FILE) or the export does not allow this host"
            ),
            _ if self.hello.is_query() => {
                return Error::Status {
                    what: self.what(),
                    status,
                }
            }
            _ => {
                return Error::Status {
                    what: format!("open {} on {target}", self.what()),
                    status,
                }
            }
        };
        Error::Auth(why)
    }

    /// Checks a HELLO reply's `target_proof`; with a key, returns what the session's keys
    /// derive from. A target that cannot prove the key is refused: it may be an impostor.
    pub fn check_welcome(&self, reply: &HelloReply) -> Result<Option<SessionKeys>> {
        self.check_proof(&reply.proven_bytes(), &reply.target_proof)
    }

    /// Checks a query's answer (payload followed by `target_proof`) and returns the payload.
    pub fn check_query<'a>(&self, answer: &'a [u8]) -> Result<&'a [u8]> {
        let n = answer
            .len()
            .checked_sub(AUTH_LEN)
            .ok_or_else(|| Error::Protocol("query answer without a proof".into()))?;
        let proof: [u8; AUTH_LEN] = answer[n..].try_into().expect("32");
        self.check_proof(&answer[..n], &proof)?;
        Ok(&answer[..n])
    }

    fn check_proof(&self, proven: &[u8], got: &[u8; AUTH_LEN]) -> Result<Option<SessionKeys>> {
        let Some(key) = &self.key else {
            return Ok(None);
        };
        let t = self.transcript();
        if !proof::same(&proof::target_proof(key, &t, proven), got) {
            return Err(Error::Auth(format!(
                "{} did not prove it holds host '{}''s key: it is not the target the key was \
                 made for (an impostor, or a target without this host in its --keys)",
                self.target, self.hello.host_id
            )));
        }
        let a = &self.hello.auth;
        Ok(Some(SessionKeys {
            secret: Arc::new(SessionSecret::derive(key, &a.nonce_c, &a.nonce_s, &t)),
            encrypt: a.encrypt,
        }))
    }
}

/// Runs the HELLO exchange of PROTOCOL.md §12.1 over `send` (one request with the given
/// header, one reply): first HELLO, the target's challenge, the answering HELLO. Each HELLO
/// carries its own tag, so on datagrams a late answer to an earlier (retransmitted) HELLO is
/// never taken for the answer to a later one, and the attempt's random nonce in its `offset`,
/// which the reply echoes (§3): on Ethernet every process of a host sees the answers to the
/// host's HELLOs, and one must not take another's (its session, or a challenge it did not
/// ask for). Returns the final reply (status OK or a refusal, for the caller to judge).
pub(crate) fn hello_exchange(
    attempt: &mut Attempt,
    mut send: impl FnMut(&Header, &[u8]) -> Result<(Header, Vec<u8>)>,
) -> Result<(Header, Vec<u8>)> {
    // A challenge may expire between the two HELLOs (a slow link, an epoch boundary): one
    // fresh challenge is answered once more, then the target is judged broken.
    for round in 1..=3 {
        let h = Header::request(Opcode::Hello, Tag::new(0, round), attempt.hello.nonce, 0);
        let (r, p) = send(&h, &attempt.payload())?;
        if r.status != Status::Challenge {
            return Ok((r, p));
        }
        attempt.answer(&p)?;
    }
    Err(Error::Protocol(format!(
        "{} keeps challenging the handshake",
        attempt.target
    )))
}
