//! `tcp://HOST[:PORT]/EXPORT` (IPv6 as `tcp://[::1]:7700/x`; the port defaults to 7700).

use crate::Error;

pub const DEFAULT_PORT: u16 = 7700;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    /// Empty when the URL names only the target.
    pub export: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, Error> {
        let bad = |why: &str| {
            Error::Usage(format!("bad URL '{s}': {why}; expected tcp://HOST:PORT/EXPORT, e.g. tcp://127.0.0.1:7700/disk0"))
        };
        let rest = match s.split_once("://") {
            Some(("tcp", rest)) => rest,
            Some((scheme @ ("udp" | "eth" | "nbd"), _)) => {
                return Err(bad(&format!(
                    "{scheme}:// is not supported by this version"
                )))
            }
            Some((scheme, _)) => return Err(bad(&format!("unknown scheme '{scheme}'"))),
            None => return Err(bad("no scheme")),
        };
        let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("unclosed '[' in IPv6 address"))?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| bad("junk after ']'"))?),
            };
            (h, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => p.parse().map_err(|_| bad(&format!("bad port '{p}'")))?,
        };
        if export.contains('/') || export.len() > 255 {
            return Err(bad("export names have at most 255 characters and no '/'"));
        }
        Ok(Url {
            host: host.to_string(),
            port,
            export: export.to_string(),
        })
    }

    /// `host:port`, bracketing IPv6 literals, for connecting and messages.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// True when `s` looks like a URL rather than a local path.
    pub fn is_url(s: &str) -> bool {
        s.contains("://")
    }
}

impl std::fmt::Display for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tcp://{}/{}", self.authority(), self.export)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        let u = Url::parse("tcp://storage1:7701/disk0").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.export.as_str()),
            ("storage1", 7701, "disk0")
        );
        let u = Url::parse("tcp://[::1]:7700/x").unwrap();
        assert_eq!(
            (u.host.as_str(), u.authority().as_str()),
            ("::1", "[::1]:7700")
        );
        assert_eq!(Url::parse("tcp://h/e").unwrap().port, DEFAULT_PORT);
        assert_eq!(Url::parse("tcp://h:1").unwrap().export, "");
        assert_eq!(Url::parse("tcp://[::1]/e").unwrap().port, DEFAULT_PORT);
        assert_eq!(
            Url::parse("tcp://h:1/e").unwrap().to_string(),
            "tcp://h:1/e"
        );
    }

    #[test]
    fn rejects_bad_urls() {
        for s in [
            "disk0",
            "http://h/e",
            "tcp:///e",
            "tcp://h:port/e",
            "tcp://[::1/e",
            "tcp://h:1/a/b",
            "udp://h:1/e",
        ] {
            let e = Url::parse(s).unwrap_err().to_string();
            assert!(e.contains("bad URL"), "{s}: {e}");
        }
    }
}
