//! TLS 1.3 for `tcp://` (OpenSSL, as the target; docs/ARCHITECTURE.md, "TLS"): TLS-PSK with this
//! host's key (the identity is the host id) or X.509 verified against `--tls-ca` (else the
//! system's roots). The handshake waits for the socket by a deadline; the queues then use the
//! same session on the non-blocking socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

pub(crate) use openssl::ssl::SslConnector;
use openssl::ssl::{
    ErrorCode, HandshakeError, MidHandshakeSslStream, SslMethod, SslStream, SslVersion,
};

use crate::deadline::Deadline;
use crate::{ConnectOptions, Error, Result, Url};

/// A connection to the target: plain, or TLS over the same TCP socket.
pub(crate) enum Link {
    Plain(TcpStream),
    Tls(Box<SslStream<TcpStream>>),
}

impl Link {
    /// The TCP socket underneath (for timeouts, poll and blocking mode).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Tls(t) => t.get_ref(),
        }
    }

    /// Sends a prefix of `buf` without blocking: `WouldBlock` when nothing can go now.
    pub(crate) fn send_nb(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => {
                // SAFETY: send from the caller's buffer on our own socket.
                let n = unsafe {
                    libc::send(
                        s.as_raw_fd(),
                        buf.as_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                    )
                };
                if n < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(n as usize)
            }
            Link::Tls(t) => t.ssl_write(buf).map_err(tls_io),
        }
    }

    /// Receives into `buf` without blocking: Ok(0) when the target closed, `WouldBlock` when
    /// nothing is there (for TLS: nor buffered inside the session).
    pub(crate) fn recv_nb(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => {
                // SAFETY: recv into the caller's buffer on our own socket.
                let n = unsafe {
                    libc::recv(
                        s.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(n as usize)
            }
            Link::Tls(t) => match t.ssl_read(buf) {
                Ok(n) => Ok(n),
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
                Err(e) if e.code() == ErrorCode::SYSCALL && e.io_error().is_none() => Ok(0),
                Err(e) => Err(tls_io(e)),
            },
        }
    }
}

/// A non-blocking TLS call's error as the socket error it stands for.
fn tls_io(e: openssl::ssl::Error) -> std::io::Error {
    match e.code() {
        ErrorCode::WANT_READ | ErrorCode::WANT_WRITE => std::io::ErrorKind::WouldBlock.into(),
        _ => match e.into_io_error() {
            Ok(io) => io,
            Err(e) => std::io::Error::other(e.to_string()),
        },
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(s) => s.write(buf),
            Link::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Link::Plain(s) => s.flush(),
            Link::Tls(t) => t.flush(),
        }
    }
}

/// OpenSSL's error stack as one line.
fn stack_line(e: &openssl::error::ErrorStack) -> String {
    let v: Vec<&str> = e
        .errors()
        .iter()
        .map(|e| e.reason().unwrap_or("unknown error"))
        .collect();
    if v.is_empty() {
        "unknown TLS error".into()
    } else {
        v.join("; ")
    }
}

/// The TLS settings of a session's connections, made once per session: building them reads the
/// system's CA store (tens of milliseconds), which every queue of a session would otherwise pay.
pub(crate) fn connector(opts: &ConnectOptions) -> Result<SslConnector> {
    let setup =
        |e: openssl::error::ErrorStack| Error::Tls(format!("TLS setup: {}", stack_line(&e)));
    let mut b = SslConnector::builder(SslMethod::tls_client()).map_err(setup)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))
        .map_err(setup)?;
    // Header and body of a record in one recv, not two (the target does the same).
    b.set_read_ahead(true);
    if let Some(key) = &opts.key {
        // TLS-PSK: the identity is the host id (what nbdkit calls the PSK user name).
        let (id, k) = (opts.host_id.clone().into_bytes(), key.bytes().to_vec());
        b.set_psk_client_callback(move |_ssl, _hint, identity, psk| {
            if id.len() >= identity.len() || k.len() > psk.len() {
                return Ok(0);
            }
            identity[..id.len()].copy_from_slice(&id);
            identity[id.len()] = 0;
            psk[..k.len()].copy_from_slice(&k);
            Ok(k.len())
        });
    }
    if let Some(ca) = &opts.tls_ca {
        // Only that CA: added to the system's store (which the connector starts from), any
        // publicly trusted certificate for the target's name would do as well.
        let not_pem = |why: String| {
            Error::Usage(format!(
                "--tls-ca {}: not a PEM certificate file ({why})",
                ca.display()
            ))
        };
        let pem = std::fs::read(ca).map_err(|e| not_pem(e.to_string()))?;
        let certs =
            openssl::x509::X509::stack_from_pem(&pem).map_err(|e| not_pem(stack_line(&e)))?;
        if certs.is_empty() {
            return Err(not_pem("no certificate in it".into()));
        }
        let mut store = openssl::x509::store::X509StoreBuilder::new().map_err(setup)?;
        for c in certs {
            store.add_cert(c).map_err(setup)?;
        }
        // An intermediate CA, or the target's own certificate, is an anchor too: the file is
        // what is trusted, whether or not its certificates are self-signed roots.
        store
            .set_flags(openssl::x509::verify::X509VerifyFlags::PARTIAL_CHAIN)
            .map_err(setup)?;
        b.set_cert_store(store.build());
    }
    Ok(b.build())
}

/// Runs the client side of the TLS handshake on a connected socket, with the session's
/// `connector`, over by `deadline`. The
/// socket is non-blocking meanwhile, so every wait is for what is left of the deadline (OpenSSL's
/// own blocking reads would each have the socket's whole timeout); it is blocking again after.
pub(crate) fn connect(
    url: &Url,
    opts: &ConnectOptions,
    connector: &SslConnector,
    s: TcpStream,
    deadline: &Deadline,
) -> Result<Link> {
    let addr = url.authority();
    let setup =
        |e: openssl::error::ErrorStack| Error::Tls(format!("TLS setup: {}", stack_line(&e)));
    let cfg = connector.configure().map_err(setup)?;
    let failed = |why: String| Error::Tls(format!("TLS handshake with {addr} failed: {why}"));
    s.set_nonblocking(true)?;
    let mut step = cfg.connect(&url.host, s);
    loop {
        match step {
            // With a key, the target must prove itself with it: a certificate in its place
            // (however trusted) is not the target that holds this host's key, and the HELLO
            // that follows would pass through whoever it is.
            Ok(t) if opts.key.is_some() && !t.ssl().session_reused() => {
                return Err(failed(format!(
                    "the target answered with a certificate, not the TLS-PSK key of host '{}': \
                     it does not hold that key (something may pose as the target)",
                    opts.host_id
                )));
            }
            Ok(t) => {
                t.get_ref().set_nonblocking(false)?;
                return Ok(Link::Tls(Box::new(t)));
            }
            Err(HandshakeError::SetupFailure(e)) => return Err(setup(e)),
            Err(HandshakeError::WouldBlock(mid)) => {
                let events = if mid.error().code() == ErrorCode::WANT_WRITE {
                    libc::POLLOUT
                } else {
                    libc::POLLIN
                };
                match deadline.wait(mid.get_ref(), events) {
                    Ok(()) => step = mid.handshake(),
                    Err(Error::Timeout(_)) => return Err(failed("no answer in time".into())),
                    Err(e) => return Err(e),
                }
            }
            Err(HandshakeError::Failure(mid)) => return Err(failed(why_failed(&mid, opts))),
        }
    }
}

/// Why a TLS handshake the target answered failed, with what to check.
fn why_failed(mid: &MidHandshakeSslStream<TcpStream>, opts: &ConnectOptions) -> String {
    let verify = mid.ssl().verify_result();
    let e = mid.error();
    if verify != openssl::x509::X509VerifyResult::OK {
        format!(
            "the target's certificate is not trusted: {} (give its CA with --tls-ca)",
            verify.error_string()
        )
    } else if let Some(st) = e.ssl_error() {
        let line = stack_line(st);
        if opts.key.is_some() {
            format!(
                "the target did not take the TLS-PSK key of host '{}' (is it the key the \
                 target has for that host id?); OpenSSL: {line}",
                opts.host_id
            )
        } else {
            format!("{line} (a target without a certificate takes only TLS-PSK: pass --key)")
        }
    } else if let Some(io) = e.io_error() {
        if matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
        ) {
            // A target without TLS hangs up on a ClientHello.
            format!(
                "{io}: the target hung up (does it run with --tls on or require, and does it \
                 know this host's key?)"
            )
        } else {
            io.to_string()
        }
    } else {
        "the target closed the connection (does it run with --tls on or require, and does it \
         know this host's key?)"
            .into()
    }
}
