//! TLS for stream connections (native `tcp://` and NBD after STARTTLS), with OpenSSL.
//!
//! OpenSSL because it has what the peers need: external PSKs (nbdkit's `user:hexkey` format,
//! which libnbd and qemu speak through GnuTLS) as well as X.509; rustls has no external PSK.
//! See docs/ARCHITECTURE.md, "TLS".
//!
//! The handshake runs on the handshake thread, blocking against the admission deadline. The
//! session then moves with its socket to the reactor that owns the connection: the record layer
//! reads and writes the non-blocking socket itself ([`FdIo`]), so ciphertext is never buffered
//! outside OpenSSL (one record at most) and the plaintext goes through the connection's own
//! bounded `rx`/`tx` buffers.

use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use openssl::ex_data::Index;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslMode, SslOptions,
    SslStream, SslVersion,
};

use crate::Error;
use blkwire_auth::Key;

/// `serve --tls`: whether stream listeners offer TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: NBD refuses STARTTLS, a native TLS ClientHello is refused.
    #[default]
    Off,
    /// TLS and plain connections alike.
    On,
    /// Only TLS: plain native connections are refused, NBD answers every option but STARTTLS
    /// and ABORT with NBD_REP_ERR_TLS_REQD (NBD's FORCEDTLS).
    Require,
}

impl TlsMode {
    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        }
    }

    /// Parses `off`, `on` or `require`.
    pub fn parse(s: &str) -> Result<TlsMode, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("--tls {s}: expected off, on or require")),
        }
    }
}

/// What `serve` was asked for about TLS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// `--tls`.
    pub mode: TlsMode,
    /// `--tls-cert`: the target's X.509 certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// `--tls-key`: its private key (PEM).
    pub key: Option<PathBuf>,
}

/// The target's TLS state, built once at bind: the mode and the context every connection's
/// session is created from.
pub(crate) struct Tls {
    pub(crate) mode: TlsMode,
    /// An X.509 certificate was loaded (else only TLS-PSK, which needs keys).
    has_cert: bool,
    ctx: Option<SslContext>,
}

/// A TLS session over a stream socket.
pub(crate) type TlsStream = SslStream<FdIo>;

/// A host id a client proved with TLS-PSK, and the key it proved (the one the PSK callback
/// found in the store: its sessions record it).
pub(crate) type PskHost = (String, Key);

/// Where the PSK callback leaves the host a client proved (read after the handshake).
fn psk_host_index() -> Result<Index<Ssl, PskHost>, openssl::error::ErrorStack> {
    static INDEX: OnceLock<Index<Ssl, PskHost>> = OnceLock::new();
    if let Some(i) = INDEX.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index()?;
    Ok(*INDEX.get_or_init(|| i))
}

/// OpenSSL's error stack as one line (it can hold several entries).
fn one_line(e: &openssl::error::ErrorStack) -> String {
    let v: Vec<String> = e
        .errors()
        .iter()
        .map(|e| e.reason().unwrap_or("unknown error").to_string())
        .collect();
    if v.is_empty() {
        "unknown TLS error".into()
    } else {
        v.join("; ")
    }
}

impl Tls {
    /// Checks the settings and loads the certificate; every problem is a one-line config error.
    pub(crate) fn build(s: &TlsSettings, keys: &crate::access::SharedKeys) -> Result<Tls, Error> {
        if s.cert.is_some() != s.key.is_some() {
            return Err(Error::Config(
                "--tls-cert and --tls-key go together: give both (PEM files) or neither".into(),
            ));
        }
        if s.mode == TlsMode::Off {
            if s.cert.is_some() {
                return Err(Error::Config(
                    "--tls-cert/--tls-key given with --tls off: add --tls on or --tls require"
                        .into(),
                ));
            }
            return Ok(Tls {
                mode: TlsMode::Off,
                has_cert: false,
                ctx: None,
            });
        }
        let ssl_err = |what: &str, e: openssl::error::ErrorStack| {
            Error::Config(format!("{what}: {}", one_line(&e)))
        };
        let mut b = SslContextBuilder::new(SslMethod::tls_server())
            .map_err(|e| ssl_err("cannot set up TLS", e))?;
        // TLS 1.3 only: what the issue asks for, and what GnuTLS (libnbd, qemu) negotiates with
        // PSKs and certificates alike.
        b.set_min_proto_version(Some(SslVersion::TLS1_3))
            .map_err(|e| ssl_err("cannot set up TLS", e))?;
        b.set_options(
            SslOptions::NO_COMPRESSION
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::CIPHER_SERVER_PREFERENCE,
        );
        // AES-128-GCM first (clients list AES-256 first): the cipher TLS-PSK uses anyway, and
        // less work per byte on the data path (docs/BENCHMARKS.md, TLS).
        b.set_ciphersuites(
            "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        )
        .map_err(|e| ssl_err("cannot set up TLS", e))?;
        // The reactor retries a write with the same bytes at another address (its buffer may
        // have moved) and counts partial progress: OpenSSL must accept both.
        b.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
        // A record's header and body in one recv (and whatever else of the next records fits in
        // OpenSSL's read buffer), instead of two reads per record. Bounded by that buffer; a
        // read that wants more means nothing whole is buffered (see `read`).
        b.set_read_ahead(true);
        // No session tickets: nothing resumes, and the tickets would be sent after the
        // handshake, when the client may already be waiting for an option reply.
        b.set_num_tickets(0)
            .map_err(|e| ssl_err("cannot set up TLS", e))?;
        if let (Some(cert), Some(key)) = (&s.cert, &s.key) {
            // OpenSSL says only "system lib" for a file it cannot open: name the cause first.
            for (flag, path) in [("--tls-cert", cert), ("--tls-key", key)] {
                std::fs::File::open(path).map_err(|e| {
                    Error::Config(format!("{flag} {}: cannot read it: {e}", path.display()))
                })?;
            }
            b.set_certificate_chain_file(cert).map_err(|e| {
                ssl_err(
                    &format!("--tls-cert {}: not a PEM certificate", cert.display()),
                    e,
                )
            })?;
            b.set_private_key_file(key, SslFiletype::PEM).map_err(|e| {
                ssl_err(
                    &format!("--tls-key {}: not a PEM private key", key.display()),
                    e,
                )
            })?;
            b.check_private_key().map_err(|e| {
                ssl_err(
                    &format!(
                        "--tls-key {} does not belong to --tls-cert {}",
                        key.display(),
                        cert.display()
                    ),
                    e,
                )
            })?;
        }
        // Always installed: keys may be loaded after start (`keys_load`), and the callback
        // reads whatever store is current at each handshake.
        let index = psk_host_index().map_err(|e| ssl_err("cannot set up TLS", e))?;
        let keys = keys.clone();
        // The identity is the client's host id (the PSK user name). An unknown one gets a key
        // nobody holds (derived from the identity under a secret of this process), so its
        // binder fails exactly as a known host's with a wrong key does: the alert does not tell
        // which host ids exist. Where the callback leaves the host is read only once the
        // handshake used the PSK (`accept`).
        let unknown = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &{
            let mut k = [0u8; 32];
            blkwire_auth::random(&mut k);
            k
        });
        b.set_psk_server_callback(move |ssl, identity, psk| {
            let identity = identity.unwrap_or_default();
            let store = keys.read().unwrap_or_else(|p| p.into_inner()).clone();
            let known = std::str::from_utf8(identity)
                .ok()
                .and_then(|id| Some((id, store.as_ref()?.get(id)?)));
            match known {
                Some((id, key)) if key.bytes().len() <= psk.len() => {
                    let k = key.bytes();
                    psk[..k.len()].copy_from_slice(k);
                    ssl.set_ex_data(index, (id.to_string(), key.clone()));
                    Ok(k.len())
                }
                _ => {
                    let tag = ring::hmac::sign(&unknown, identity);
                    let n = tag.as_ref().len().min(psk.len());
                    psk[..n].copy_from_slice(&tag.as_ref()[..n]);
                    Ok(n)
                }
            }
        });
        Ok(Tls {
            mode: s.mode,
            has_cert: s.cert.is_some(),
            ctx: Some(b.build()),
        })
    }

    /// With TLS on, the target must have credentials once configured: a certificate, or keys
    /// for TLS-PSK (checked after the start-up calls, which may load the keys).
    pub(crate) fn check_credentials(&self, has_keys: bool) -> Result<(), Error> {
        if self.mode != TlsMode::Off && !self.has_cert && !has_keys {
            return Err(Error::Config(
                "--tls on/require needs credentials: --keys FILE (TLS-PSK) and/or --tls-cert FILE \
                 --tls-key FILE (X.509)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Runs the server side of a TLS handshake on `fd` by `deadline`. Returns the session and
    /// the host id the client proved with its PSK, with that key (None: X.509, which proves
    /// only the server).
    pub(crate) fn accept(
        &self,
        fd: RawFd,
        deadline: Instant,
    ) -> Result<(TlsStream, Option<PskHost>), String> {
        let ctx = self.ctx.as_ref().ok_or("TLS is off")?;
        let ssl = Ssl::new(ctx).map_err(|e| one_line(&e))?;
        let io = FdIo {
            fd,
            deadline: Some(deadline),
            out: Vec::new(),
            out_sent: 0,
        };
        let mut s = SslStream::new(ssl, io).map_err(|e| one_line(&e))?;
        if let Err(e) = s.accept() {
            return Err(match (e.ssl_error(), e.io_error()) {
                (Some(st), _) => one_line(st),
                (None, Some(io)) => io.to_string(),
                _ => format!("TLS handshake failed ({:?})", e.code()),
            });
        }
        // The callback ran for the identity the client offered, but OpenSSL may still have
        // set that PSK aside and finished the handshake on the certificate (TLS 1.3: a PSK
        // whose hash differs from the cipher suite chosen, e.g. a client offering only
        // TLS_AES_256_GCM_SHA384, is skipped without its binder being checked). Only a
        // handshake that used the PSK, which OpenSSL reports as a resumption, proved the key.
        let host = psk_host_index()
            .ok()
            .and_then(|i| s.ssl().ex_data(i).cloned())
            .filter(|_| s.ssl().session_reused());
        Ok((s, host))
    }
}

/// A socket as OpenSSL's transport, by its raw descriptor: the connection's owner (the
/// admission, then the reactor's `Conn`) keeps the descriptor and closes it after the session.
/// With a deadline (handshake thread) it waits for the socket until then; without one
/// (reactor) it never blocks, and OpenSSL reports WANT_READ/WANT_WRITE.
///
/// On the reactor, records are gathered in `out` and sent together by [`FdIo::flush_out`]: one
/// `send` per batch of replies, as for a plain connection, instead of one per record (each send
/// woke the client, which on a small machine then took the CPU from the target mid-batch).
pub(crate) struct FdIo {
    fd: RawFd,
    deadline: Option<Instant>,
    /// Ciphertext waiting to be sent (reactor only), from `out_sent` on.
    out: Vec<u8>,
    out_sent: usize,
}

/// Ciphertext gathered before a write reports WANT_WRITE: a batch of replies, bounded (the
/// plaintext behind it is bounded by the connection's high-water mark anyway).
const OUT_CAP: usize = 256 << 10;

/// The most the gathered ciphertext's buffer grows to: `OUT_CAP` and one record written past
/// it (a TLS record of 16 KiB and its overhead; OpenSSL writes one at a time). Grown by
/// doubling, the `Vec` reached 512 KiB, then 1 MiB, past what the budget's checks foresee.
const OUT_MOST: usize = OUT_CAP + (17 << 10);

/// What OpenSSL holds for a session besides what we see: its read and write record buffers
/// (a record of 16 KiB and its overhead each), kept for the session's life. Counted in the
/// connection's memory account with the gathered ciphertext (`FdIo::out_capacity`).
pub(crate) const SESSION_BUFFERS: usize = 40 << 10;

impl FdIo {
    /// Waits until the socket is ready for `events`, or fails at the deadline (or at once
    /// without one: the reactor waits through io_uring instead).
    fn wait(&self, events: i16) -> std::io::Result<()> {
        let Some(deadline) = self.deadline else {
            return Err(std::io::ErrorKind::WouldBlock.into());
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "handshake not finished in time",
                ));
            }
            let mut p = libc::pollfd {
                fd: self.fd,
                events,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one pollfd on the stack, alive for the call.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n > 0 {
                return Ok(());
            }
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }

    /// From now on the socket belongs to a reactor: never block, gather records.
    pub(crate) fn set_nonblocking_only(&mut self) {
        self.deadline = None;
    }

    /// Ciphertext gathered and not yet sent.
    pub(crate) fn pending_out(&self) -> usize {
        self.out.len() - self.out_sent
    }

    /// What the gathered ciphertext's buffer takes (its capacity): part of the connection's
    /// memory account.
    pub(crate) fn out_capacity(&self) -> usize {
        self.out.capacity()
    }

    /// Gives the gathered ciphertext's buffer back when nothing waits in it (an idle
    /// connection trims its buffers): after a burst it would otherwise keep up to `OUT_CAP`
    /// for the connection's life.
    pub(crate) fn release_out(&mut self) {
        if self.pending_out() == 0 {
            self.out = Vec::new();
            self.out_sent = 0;
        }
    }

    /// Sends what was gathered. Ok(true): all of it went; Ok(false): the socket is full (wait
    /// for POLLOUT).
    pub(crate) fn flush_out(&mut self) -> std::io::Result<bool> {
        while self.out_sent < self.out.len() {
            // SAFETY: send from our own buffer.
            let n = unsafe {
                libc::send(
                    self.fd,
                    self.out[self.out_sent..].as_ptr().cast(),
                    self.out.len() - self.out_sent,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                self.out_sent += n as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::WouldBlock => {
                    // What went is dropped from the front once it is at least as long as what
                    // waits, so the buffer never grows by what was sent.
                    if self.out_sent >= self.out.len() - self.out_sent {
                        self.out.drain(..self.out_sent);
                        self.out_sent = 0;
                    }
                    return Ok(false);
                }
                _ => return Err(e),
            }
        }
        self.out.clear();
        self.out_sent = 0;
        if self.out.capacity() > OUT_CAP + (64 << 10) {
            self.out.shrink_to(OUT_CAP);
        }
        Ok(true)
    }
}

impl Read for FdIo {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: recv into the caller's buffer.
            let n = unsafe {
                libc::recv(
                    self.fd,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::WouldBlock => self.wait(libc::POLLIN)?,
                _ => return Err(e),
            }
        }
    }
}

impl Write for FdIo {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.deadline.is_none() {
            // Reactor: gather (see the type's comment); full means WANT_WRITE until flushed.
            if self.pending_out() >= OUT_CAP && !self.flush_out()? {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            if self.out.len() + buf.len() > self.out.capacity() {
                // Room first from what was sent already, then growth bounded by `OUT_MOST`.
                if self.out_sent > 0 {
                    self.out.drain(..self.out_sent);
                    self.out_sent = 0;
                }
                let need = self.out.len() + buf.len();
                if need > self.out.capacity() {
                    let target = (2 * self.out.capacity()).clamp(need, OUT_MOST.max(need));
                    self.out.reserve_exact(target - self.out.len());
                }
            }
            self.out.extend_from_slice(buf);
            return Ok(buf.len());
        }
        loop {
            // SAFETY: send from the caller's buffer.
            let n = unsafe {
                libc::send(
                    self.fd,
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::WouldBlock => self.wait(libc::POLLOUT)?,
                _ => return Err(e),
            }
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a non-blocking TLS read or write did, in the terms of the socket calls it replaces.
pub(crate) enum Io {
    /// Plaintext bytes moved.
    Done(usize),
    /// The peer ended the session (close_notify or EOF).
    Closed,
    /// Nothing to do until the socket is readable (`true`: writable) again.
    Again {
        /// The socket must become writable (a record is half sent).
        out: bool,
    },
    /// The session failed (bad record, reset socket).
    Failed(String),
}

fn classify(e: openssl::ssl::Error) -> Io {
    match e.code() {
        ErrorCode::ZERO_RETURN => Io::Closed,
        ErrorCode::WANT_READ => Io::Again { out: false },
        ErrorCode::WANT_WRITE => Io::Again { out: true },
        ErrorCode::SYSCALL if e.io_error().is_none() => Io::Closed,
        _ => Io::Failed(match (e.ssl_error(), e.io_error()) {
            (Some(st), _) => one_line(st),
            (None, Some(io)) => io.to_string(),
            _ => format!("TLS error {:?}", e.code()),
        }),
    }
}

/// Decrypts what the socket holds into `buf` (non-blocking).
pub(crate) fn read(s: &mut TlsStream, buf: &mut [u8]) -> Io {
    match s.ssl_read(buf) {
        Ok(0) => Io::Closed,
        Ok(n) => Io::Done(n),
        Err(e) => classify(e),
    }
}

/// Encrypts and sends a prefix of `buf` (non-blocking).
pub(crate) fn write(s: &mut TlsStream, buf: &[u8]) -> Io {
    match s.ssl_write(buf) {
        Ok(n) => Io::Done(n),
        Err(e) => classify(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::ssl::{SslConnector, SslVerifyMode};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::{Arc, RwLock};
    use std::time::Duration;

    /// A self-signed certificate and its key, as PEM files in a fresh directory.
    fn certificate() -> (PathBuf, PathBuf) {
        use openssl::asn1::Asn1Time;
        use openssl::ec::{EcGroup, EcKey};
        use openssl::hash::MessageDigest;
        use openssl::nid::Nid;
        use openssl::pkey::PKey;
        use openssl::x509::{X509Builder, X509NameBuilder};
        let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
        let key = PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap();
        let mut name = X509NameBuilder::new().unwrap();
        name.append_entry_by_text("CN", "127.0.0.1").unwrap();
        let name = name.build();
        let mut b = X509Builder::new().unwrap();
        b.set_version(2).unwrap();
        b.set_subject_name(&name).unwrap();
        b.set_issuer_name(&name).unwrap();
        b.set_pubkey(&key).unwrap();
        b.set_not_before(&Asn1Time::days_from_now(0).unwrap())
            .unwrap();
        b.set_not_after(&Asn1Time::days_from_now(1).unwrap())
            .unwrap();
        b.sign(&key, MessageDigest::sha256()).unwrap();
        let dir = std::env::temp_dir().join(format!(
            "blkwire-tls-{}-{}",
            std::process::id(),
            blkwire_auth::random_u64()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, b.build().to_pem().unwrap()).unwrap();
        std::fs::write(&k, key.private_key_to_pem_pkcs8().unwrap()).unwrap();
        (c, k)
    }

    /// A target's TLS settings with a fresh self-signed certificate (its files gone once read)
    /// and the key store `keys`.
    fn target_tls(keys: &crate::access::SharedKeys) -> Tls {
        let (cert, key) = certificate();
        let settings = TlsSettings {
            mode: TlsMode::Require,
            cert: Some(cert.clone()),
            key: Some(key),
        };
        let tls = Tls::build(&settings, keys).expect("a TLS context");
        std::fs::remove_dir_all(cert.parent().unwrap()).unwrap();
        tls
    }

    /// One handshake against a target with a certificate and host `h`'s key: the client offers
    /// `suites`, identity `id` and key `psk`. What the target says the client proved, or how
    /// the handshake failed.
    fn handshake(suites: &str, id: &str, psk: [u8; 32]) -> Result<Option<String>, String> {
        let mut store = blkwire_auth::KeyStore::default();
        store.insert("h", Key::new(&[7; 32]).unwrap());
        let tls = target_tls(&Arc::new(RwLock::new(Some(Arc::new(store)))));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let id = id.to_string();
        let suites = suites.to_string();
        let client = std::thread::spawn(move || {
            let mut c = SslConnector::builder(SslMethod::tls_client()).unwrap();
            c.set_min_proto_version(Some(SslVersion::TLS1_3)).unwrap();
            c.set_ciphersuites(&suites).unwrap();
            c.set_verify(SslVerifyMode::NONE);
            c.set_psk_client_callback(move |_, _, identity, out| {
                identity[..id.len()].copy_from_slice(id.as_bytes());
                identity[id.len()] = 0;
                out[..32].copy_from_slice(&psk);
                Ok(32)
            });
            let s = TcpStream::connect(addr).unwrap();
            let c = c.build().configure().unwrap().verify_hostname(false);
            // The outcome is the target's to tell; the client's side only has to end.
            let _ = c.connect("127.0.0.1", s);
        });
        let (s, _) = l.accept().unwrap();
        let got = tls.accept(s.as_raw_fd(), Instant::now() + Duration::from_secs(10));
        drop(s);
        client.join().unwrap();
        got.map(|(_, host)| host.map(|(h, _)| h))
    }

    const SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384";

    /// The ciphertext a reactor's session gathers for its socket has a size the connection's
    /// account can read (`out_capacity`), and goes back once sent when the connection trims
    /// (`release_out`), but never while some of it waits.
    /// A TLS client of the target at `addr` that checks no certificate.
    fn tls_client(addr: std::net::SocketAddr) -> openssl::ssl::SslStream<TcpStream> {
        let mut c = SslConnector::builder(SslMethod::tls_client()).unwrap();
        c.set_verify(SslVerifyMode::NONE);
        let s = TcpStream::connect(addr).unwrap();
        let c = c.build().configure().unwrap().verify_hostname(false);
        c.connect("127.0.0.1", s).unwrap()
    }

    #[test]
    fn gathered_ciphertext_is_measured_and_given_back_once_sent() {
        let tls = target_tls(&Arc::new(RwLock::new(None)));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (go, ready) = std::sync::mpsc::channel::<()>();
        let client = std::thread::spawn(move || {
            let mut t = tls_client(addr);
            // Reads nothing until told: what the target writes waits in its socket, then in
            // its gathered ciphertext.
            let _ = ready.recv();
            let mut sink = [0u8; 1 << 16];
            while std::io::Read::read(&mut t, &mut sink).is_ok_and(|n| n > 0) {}
        });
        let (s, _) = l.accept().unwrap();
        let (mut t, _) = tls
            .accept(s.as_raw_fd(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        t.get_mut().set_nonblocking_only();
        // More than loopback's socket buffers hold unread, however tuned (tcp_wmem and
        // tcp_rmem top out at a few MiB each by default).
        let data = vec![3u8; 64 << 20];
        let mut at = 0;
        while at < data.len() {
            // In small replies' records: the buffer grows a record at a time, and a last one
            // past a doubled capacity doubled it again (to 512 KiB).
            match write(&mut t, &data[at..(at + 1000).min(data.len())]) {
                Io::Done(n) => at += n,
                _ => break,
            }
        }
        assert!(at < data.len(), "the socket took 64 MiB unread");
        assert!(t.get_ref().pending_out() > 0);
        assert!(t.get_ref().out_capacity() >= t.get_ref().pending_out());
        assert!(
            t.get_ref().out_capacity() <= OUT_MOST,
            "grown to {} bytes, past {OUT_MOST}",
            t.get_ref().out_capacity()
        );
        t.get_mut().release_out();
        assert!(t.get_ref().pending_out() > 0, "kept while some of it waits");
        go.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !t.get_mut().flush_out().unwrap() {
            assert!(Instant::now() < deadline, "the client reads");
            std::thread::yield_now();
        }
        assert!(t.get_ref().out_capacity() > 0, "kept after a burst");
        t.get_mut().release_out();
        assert_eq!(t.get_ref().out_capacity(), 0, "given back");
        drop((t, s));
        client.join().unwrap();
    }

    /// A client's FIN without close_notify ends the stream as on plain TCP: what it sent
    /// before is read, then `Closed` (were it `Failed`, the connection's whole requests before
    /// it would go unanswered). Frames are length-delimited: a stream cut short leaves a
    /// request incomplete, never taken for a whole one.
    #[test]
    fn a_fin_without_close_notify_is_the_end_of_the_stream() {
        let tls = target_tls(&Arc::new(RwLock::new(None)));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut t = tls_client(addr);
            std::io::Write::write_all(&mut t, b"a whole request").unwrap();
            // FIN, no close_notify.
            t.get_ref().shutdown(std::net::Shutdown::Write).unwrap();
            let mut sink = [0u8; 64];
            while std::io::Read::read(&mut t, &mut sink).is_ok_and(|n| n > 0) {}
        });
        let (s, _) = l.accept().unwrap();
        let (mut t, _) = tls
            .accept(s.as_raw_fd(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        t.get_mut().set_nonblocking_only();
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        let deadline = Instant::now() + Duration::from_secs(10);
        let end = loop {
            match read(&mut t, &mut buf) {
                Io::Done(n) => got.extend_from_slice(&buf[..n]),
                Io::Again { .. } => {
                    assert!(Instant::now() < deadline, "nothing came");
                    std::thread::yield_now();
                }
                other => break other,
            }
        };
        assert_eq!(got, b"a whole request");
        let why = match end {
            Io::Closed => None,
            Io::Failed(e) => Some(e),
            _ => Some("neither closed nor failed".into()),
        };
        assert_eq!(why, None, "the stream did not end as closed");
        drop((t, s));
        client.join().unwrap();
    }

    #[test]
    fn a_host_proves_its_key_with_tls_psk() {
        assert_eq!(handshake(SUITES, "h", [7; 32]), Ok(Some("h".into())));
    }

    /// A client that offers only a SHA-384 suite makes OpenSSL set the PSK aside (its hash
    /// does not match) without checking its binder, and finish on the certificate: it proved
    /// nothing, whatever identity it named.
    #[test]
    fn a_psk_the_handshake_did_not_use_proves_nothing() {
        assert_eq!(
            handshake("TLS_AES_256_GCM_SHA384", "h", [9; 32]),
            Ok(None),
            "a wrong key passed for host h's"
        );
    }

    /// A wrong key and an unknown identity fail alike: the handshake does not tell which
    /// host ids the target knows.
    #[test]
    fn unknown_identities_fail_as_wrong_keys_do() {
        let wrong = handshake(SUITES, "h", [9; 32]);
        let unknown = handshake(SUITES, "nobody", [9; 32]);
        assert!(wrong.is_err(), "{wrong:?}");
        assert_eq!(wrong, unknown);
    }
}
