//! The deadline of a handshake. A socket's read timeout bounds each read, not an exchange: a
//! target that sends a byte just before every timeout could hold a HELLO (or a TLS or NVMe/TCP
//! setup) for days. Every blocking read of a connection's handshake waits at most for what is
//! left of one deadline, the timeout after the connection was opened.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// A connection a handshake reads from: its TCP socket carries the read timeout.
pub(crate) trait Socket: Read {
    fn socket(&self) -> &TcpStream;
    /// Whether a read may wait for more than one `recv` (a TLS record arriving in pieces):
    /// such a read runs on the socket made non-blocking, each wait bounded by the deadline.
    fn reads_records(&self) -> bool {
        false
    }
}

impl Socket for TcpStream {
    fn socket(&self) -> &TcpStream {
        self
    }
}

impl Socket for crate::tls::Link {
    fn socket(&self) -> &TcpStream {
        self.tcp()
    }
    fn reads_records(&self) -> bool {
        matches!(self, crate::tls::Link::Tls(_))
    }
}

/// `by` after `at`, or a century if that is past what an `Instant` holds: a timeout too large
/// to add (a library caller's `Duration::MAX`) is as good as none, never a panic.
pub(crate) fn later(at: Instant, by: Duration) -> Instant {
    at.checked_add(by)
        .unwrap_or_else(|| at + Duration::from_secs(100 * 365 * 86400))
}

/// When a handshake must be over; `Error::Timeout` (with the caller's timeout) after.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    at: Instant,
    timeout: Duration,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline {
            at: later(Instant::now(), timeout),
            timeout,
        }
    }

    /// The timeout it was set with (what a `Error::Timeout` reports).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// What is left; `Error::Timeout` once nothing is.
    fn left(&self) -> Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(self.timeout));
        }
        Ok(left)
    }

    /// One read of what has arrived, waiting until the deadline at most. Never 0: a closed
    /// connection is `Error::Closed`.
    pub fn read(&self, s: &mut impl Socket, buf: &mut [u8]) -> Result<usize> {
        if s.reads_records() {
            return self.read_records(s, buf);
        }
        loop {
            s.socket().set_read_timeout(Some(self.left()?))?;
            match s.read(buf) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => return Ok(n),
                // The read timed out (at the deadline, or a signal came): `left` decides.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(crate::map_io(e, self.timeout)),
            }
        }
    }

    /// `read` over TLS: a blocking read would wait for a whole record, each `recv` of it with
    /// the whole time left, so a target trickling a record could hold it for thousands of
    /// timeouts. Non-blocking instead, each wait for the socket by the deadline; blocking again
    /// after (the queue's I/O sets its own mode).
    fn read_records(&self, s: &mut impl Socket, buf: &mut [u8]) -> Result<usize> {
        s.socket().set_nonblocking(true)?;
        let r = loop {
            match s.read(buf) {
                Ok(0) => break Err(Error::Closed),
                Ok(n) => break Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if let Err(e) = self.wait(s.socket(), libc::POLLIN) {
                        break Err(e);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => break Err(crate::map_io(e, self.timeout)),
            }
        };
        s.socket().set_nonblocking(false)?;
        r
    }

    /// Fills `buf`, by the deadline.
    pub fn read_exact(&self, s: &mut impl Socket, buf: &mut [u8]) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            got += self.read(s, &mut buf[got..])?;
        }
        Ok(())
    }

    /// Waits until the non-blocking `s` is ready for `events` (poll(2)), by the deadline.
    pub fn wait(&self, s: &TcpStream, events: i16) -> Result<()> {
        poll_until(s.as_raw_fd(), events, self.at, self.timeout).map(|_| ())
    }
}

/// Waits until `fd` is ready for `events` (poll(2)), by `at`: the events it reported;
/// `Error::Timeout` (reporting `timeout`) once `at` has passed.
pub(crate) fn poll_until(fd: RawFd, events: i16, at: Instant, timeout: Duration) -> Result<i16> {
    loop {
        let left = at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(timeout));
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd on the stack, alive for the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return Ok(p.revents);
        }
        if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Io(std::io::Error::last_os_error()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timeout too large to add to the clock (a library caller's `Duration::MAX`) is a
    /// century, never a panic: the stream queue's waits and a datagram request's give-up
    /// time (`Transmission::first`) are computed with it.
    #[test]
    fn a_timeout_past_the_clock_is_a_century_not_a_panic() {
        let now = Instant::now();
        let far = later(now, Duration::MAX);
        assert!(far >= now + Duration::from_secs(99 * 365 * 86400));
        assert_eq!(
            later(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}
