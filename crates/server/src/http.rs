//! The HTTP/1.x requests of the metrics endpoint ([`crate::Target::serve_metrics`]): where a
//! request's head ends and what its request line asks for. Pure functions over bytes from the
//! network, so they are fuzzed (`fuzz/fuzz_targets/http.rs`); none may panic on any input.

/// Most bytes of a request head (request line and headers) the endpoint reads; a head that
/// does not end within them is answered [`Reply::HeadTooLarge`].
pub const MAX_HEAD: usize = 8 << 10;

/// The one path served.
pub const METRICS_PATH: &[u8] = b"/metrics";

/// How the endpoint answers a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// 200, with the metrics: a GET of [`METRICS_PATH`] (a query string is ignored).
    Metrics,
    /// 400: not an HTTP request line.
    BadRequest,
    /// 404: a path other than [`METRICS_PATH`].
    NotFound,
    /// 405: a method other than GET on [`METRICS_PATH`].
    MethodNotAllowed,
    /// 408: the head did not arrive in time.
    RequestTimeout,
    /// 431: the head did not end within [`MAX_HEAD`] bytes.
    HeadTooLarge,
    /// 505: an HTTP version other than 1.x.
    VersionNotSupported,
}

impl Reply {
    /// The status code and its reason phrase.
    pub fn status(self) -> (u16, &'static str) {
        match self {
            Reply::Metrics => (200, "OK"),
            Reply::BadRequest => (400, "Bad Request"),
            Reply::NotFound => (404, "Not Found"),
            Reply::MethodNotAllowed => (405, "Method Not Allowed"),
            Reply::RequestTimeout => (408, "Request Timeout"),
            Reply::HeadTooLarge => (431, "Request Header Fields Too Large"),
            Reply::VersionNotSupported => (505, "HTTP Version Not Supported"),
        }
    }
}

/// Where a request head ends in `buf`: just past the empty line that ends it (CRLF CRLF, or
/// bare LFs, which RFC 9112 §2.2 lets a server accept), if it is there. Empty lines before the
/// request line do not end it: they are skipped, as [`reply_to`] skips them (§2.2).
pub fn head_end(buf: &[u8]) -> Option<usize> {
    let mut from = skip_empty_lines(buf);
    while let Some(i) = buf[from..].iter().position(|&b| b == b'\n') {
        let at = from + i;
        match buf.get(at + 1..) {
            Some([b'\n', ..]) => return Some(at + 2),
            Some([b'\r', b'\n', ..]) => return Some(at + 3),
            _ => from = at + 1,
        }
    }
    None
}

/// How to answer a request whose head is `head`: only its request line matters (RFC 9112
/// §3: `method SP request-target SP HTTP-version`); empty lines before it are skipped (§2.2),
/// the headers are not read.
pub fn reply_to(head: &[u8]) -> Reply {
    let rest = &head[skip_empty_lines(head)..];
    let Some(end) = rest.iter().position(|&b| b == b'\n') else {
        return Reply::BadRequest;
    };
    let line = rest[..end].strip_suffix(b"\r").unwrap_or(&rest[..end]);
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Reply::BadRequest;
    };
    if method.is_empty() || !method.iter().all(|&b| is_token_char(b)) {
        return Reply::BadRequest;
    }
    // Origin form only ("/path?query"): what scrapers send.
    if target.first() != Some(&b'/') || !target.iter().all(|&b| b.is_ascii_graphic()) {
        return Reply::BadRequest;
    }
    match version {
        [b'H', b'T', b'T', b'P', b'/', b'1', b'.', minor] if minor.is_ascii_digit() => {}
        [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
            if major.is_ascii_digit() && minor.is_ascii_digit() =>
        {
            return Reply::VersionNotSupported
        }
        _ => return Reply::BadRequest,
    }
    let path = target.split(|&b| b == b'?').next().unwrap_or(target);
    if path != METRICS_PATH {
        Reply::NotFound
    } else if method != b"GET" {
        Reply::MethodNotAllowed
    } else {
        Reply::Metrics
    }
}

/// Where the request line starts: past any CRs and LFs.
fn skip_empty_lines(buf: &[u8]) -> usize {
    buf.iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len())
}

/// A `tchar` of RFC 9110 §5.6.2, what a method is made of.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_ends_at_its_first_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\n"), Some(17));
        assert_eq!(
            head_end(b"\r\n\nGET / HTTP/1.1\r\n\r\n"),
            Some(21),
            "empty lines before the request line are not its end"
        );
        for unfinished in [
            &b""[..],
            b"GET / HTTP/1.1\r\n",
            b"a\r\nb\r\n\r",
            b"\r\r\r\r",
            b"\n\n",
            b"\r\n\r\n\r\n",
        ] {
            assert_eq!(head_end(unfinished), None, "{unfinished:?}");
        }
        assert_eq!(head_end(&vec![b'a'; MAX_HEAD]), None);
    }

    #[test]
    fn only_a_get_of_the_metrics_path_gets_the_metrics() {
        let cases: &[(&[u8], Reply)] = &[
            (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", Reply::Metrics),
            (b"GET /metrics HTTP/1.0\r\n\r\n", Reply::Metrics),
            (b"GET /metrics?name[]=x HTTP/1.1\r\n\r\n", Reply::Metrics),
            (b"\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n", Reply::Metrics),
            (b"GET /metrics HTTP/1.1\n\n", Reply::Metrics),
            (b"GET / HTTP/1.1\r\n\r\n", Reply::NotFound),
            (b"GET /metrics/ HTTP/1.1\r\n\r\n", Reply::NotFound),
            (b"GET /METRICS HTTP/1.1\r\n\r\n", Reply::NotFound),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Reply::MethodNotAllowed),
            (b"HEAD /metrics HTTP/1.1\r\n\r\n", Reply::MethodNotAllowed),
            (b"get /metrics HTTP/1.1\r\n\r\n", Reply::MethodNotAllowed),
            (b"GET /metrics HTTP/2.0\r\n\r\n", Reply::VersionNotSupported),
            (b"GET /metrics HTTP/1.1", Reply::BadRequest),
            (b"", Reply::BadRequest),
            (b"\r\n", Reply::BadRequest),
            (b"GET /metrics\r\n\r\n", Reply::BadRequest),
            (b"GET  /metrics HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"GET /metrics HTTP/1.1 x\r\n\r\n", Reply::BadRequest),
            (b"GET http://h/metrics HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"GET * HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"GET /met\x00rics HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"GET /m\xc3\xa9trics HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"G(T /metrics HTTP/1.1\r\n\r\n", Reply::BadRequest),
            (b"GET /metrics HTTP/1.x\r\n\r\n", Reply::BadRequest),
            (b"GET /metrics http/1.1\r\n\r\n", Reply::BadRequest),
            (
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n",
                Reply::BadRequest,
            ),
        ];
        for (head, want) in cases {
            assert_eq!(reply_to(head), *want, "{:?}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn an_oversized_head_is_just_bytes_with_no_end() {
        let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        big.resize(1 << 20, b'a');
        assert_eq!(head_end(&big), None);
        // The request line alone still parses: the reader, not the parser, caps the size.
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(head_end(&big), Some(big.len()));
        assert_eq!(reply_to(&big), Reply::Metrics);
    }
}
