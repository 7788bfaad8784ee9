//! Export URLs:
//! - `tcp://HOST[:PORT]/EXPORT` (IPv6 as `tcp://[::1]:7700/x`; the port defaults to 7700),
//! - `udp://HOST[:PORT]/EXPORT` (the port defaults to 7701),
//! - `eth://IFACE/TARGET-MAC/EXPORT` (raw Ethernet on a local interface),
//! - `nvme-tcp://HOST[:PORT]/NAME` (NVMe/TCP; NAME an NQN or a blkwire export; port 4420).

use crate::Error;

pub const DEFAULT_PORT: u16 = 7700;
pub const DEFAULT_UDP_PORT: u16 = 7701;
/// NVMe/TCP's port (IANA).
pub const DEFAULT_NVME_PORT: u16 = 4420;

/// How frames reach the target (PROTOCOL.md §9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One TCP connection per queue.
    Tcp,
    /// One UDP socket per queue.
    Udp,
    /// Raw Ethernet to the target's MAC address on a local interface.
    Eth {
        /// The target's MAC address.
        mac: [u8; 6],
    },
    /// NVMe/TCP (`nvme-tcp://HOST[:PORT]/NQN-or-EXPORT`): any NVMe/TCP target, blkwire's
    /// frontend among them (`nvme.rs`).
    NvmeTcp,
}

/// A parsed export URL: `tcp://HOST[:PORT]/EXPORT`, `udp://HOST[:PORT]/EXPORT` or
/// `eth://IFACE/TARGET-MAC/EXPORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    /// The transport the scheme names.
    pub transport: Transport,
    /// Host name or address; for `eth://`, the interface name.
    pub host: String,
    /// TCP or UDP port (unused for `eth://`).
    pub port: u16,
    /// Empty when the URL names only the target.
    pub export: String,
    /// `?encrypt=1`: datagram frames encrypted, not only authenticated (PROTOCOL.md §12.4;
    /// needs a key, like `--encrypt`).
    pub encrypt: bool,
    /// `?qdisc=bypass` (eth:// only): frames go to the interface's driver without passing its
    /// queueing discipline (`PACKET_QDISC_BYPASS`): less CPU per frame, but the qdisc and tc
    /// egress rules no longer see them, and a full device queue drops a frame
    /// instead of queueing it (the protocol resends it).
    pub bypass_qdisc: bool,
    /// `?crc=header` (udp:// only): the CRC of WRITE and READ data frames covers their header
    /// only, and UDP's own checksum their payload, as for tcp:// (PROTOCOL.md §9.7): less CPU
    /// per byte, with TCP's protection instead of a CRC32C over the data.
    pub header_crc: bool,
}

/// A URL's options (`?encrypt=1`, `?qdisc=bypass`, `?crc=header`, joined by `&`).
#[derive(Default)]
struct Query {
    encrypt: bool,
    bypass_qdisc: bool,
    header_crc: bool,
}

/// Splits the query off the end of a URL: what is left, and the options.
fn split_query(s: &str) -> Result<(&str, Query), String> {
    let Some((rest, q)) = s.split_once('?') else {
        return Ok((s, Query::default()));
    };
    let mut o = Query::default();
    for kv in q.split('&') {
        match kv {
            "encrypt=1" => o.encrypt = true,
            "encrypt=0" => o.encrypt = false,
            "qdisc=bypass" => o.bypass_qdisc = true,
            "crc=header" => o.header_crc = true,
            "crc=full" => o.header_crc = false,
            _ => {
                return Err(format!(
                    "unknown option '{kv}' (known: encrypt=1, qdisc=bypass for eth://, \
                     crc=header for udp://)"
                ))
            }
        }
    }
    Ok((rest, o))
}

/// The interface index an IPv6 zone names (`fe80::1%eth0`, `%25eth0` as RFC 6874 writes it in
/// URLs, or `%2`): the form the socket address takes.
fn zone_index(zone: &str) -> Result<u32, String> {
    let zone = zone
        .strip_prefix("25")
        .filter(|z| !z.is_empty())
        .unwrap_or(zone);
    if let Ok(i) = zone.parse::<u32>() {
        return Ok(i);
    }
    let name = std::ffi::CString::new(zone).map_err(|_| format!("bad IPv6 zone '{zone}'"))?;
    // SAFETY: a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(format!(
            "no interface '{zone}' for the IPv6 zone (`ip link` lists them)"
        )),
        i => Ok(i),
    }
}

/// Parses `aa:bb:cc:dd:ee:ff` (or with dashes).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    blkwire_auth::acl::parse_mac(s)
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(m: &[u8; 6]) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    )
}

impl Url {
    /// Parses an export URL; the error says which form was expected.
    pub fn parse(full: &str) -> Result<Url, Error> {
        let s = full;
        let bad = |why: &str| {
            Error::Usage(format!(
                "bad URL '{s}': {why}; expected tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT, eth://IFACE/TARGET-MAC/EXPORT or nvme-tcp://HOST[:PORT]/NQN"
            ))
        };
        let (s, q) = split_query(s).map_err(|why| bad(&why))?;
        let (encrypt, bypass_qdisc) = (q.encrypt, q.bypass_qdisc);
        if bypass_qdisc && !s.starts_with("eth://") {
            return Err(bad("?qdisc=bypass is for eth:// only"));
        }
        if q.header_crc && !s.starts_with("udp://") {
            return Err(bad(
                "?crc=header is for udp:// only (UDP's checksum covers the data there; eth:// \
                 has no end-to-end checksum, tcp:// carries no CRC)",
            ));
        }
        let (transport, rest) = match s.split_once("://") {
            Some(("tcp", rest)) => (Transport::Tcp, rest),
            Some(("udp", rest)) => (Transport::Udp, rest),
            Some(("nvme-tcp", rest)) => (Transport::NvmeTcp, rest),
            Some(("eth", rest)) => {
                let mut parts = rest.splitn(3, '/');
                let iface = parts.next().unwrap_or_default();
                let mac = parts.next().unwrap_or_default();
                let export = parts.next().unwrap_or_default();
                if iface.is_empty() || iface.len() > 15 {
                    return Err(bad("no interface name (at most 15 characters)"));
                }
                let mac = parse_mac(mac).ok_or_else(|| bad(&format!("bad MAC address '{mac}'")))?;
                if export.contains('/') || export.len() > 255 {
                    return Err(bad("export names have at most 255 characters and no '/'"));
                }
                return Ok(Url {
                    transport: Transport::Eth { mac },
                    host: iface.into(),
                    port: 0,
                    export: export.into(),
                    encrypt,
                    bypass_qdisc,
                    header_crc: false,
                });
            }
            Some(("nbd", _)) => return Err(bad("nbd:// is for NBD clients (qemu, nbdinfo); blkwire itself speaks tcp://, udp:// and eth://")),
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
        } else if authority.matches(':').count() > 1 {
            return Err(bad(
                "an IPv6 address goes in brackets, the port after them, e.g. tcp://[::1]:7700/d",
            ));
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let host = match host.split_once('%') {
            Some((addr, zone)) => format!("{addr}%{}", zone_index(zone).map_err(|why| bad(&why))?),
            None => host.to_string(),
        };
        let port = match port {
            None if transport == Transport::Udp => DEFAULT_UDP_PORT,
            None if transport == Transport::NvmeTcp => DEFAULT_NVME_PORT,
            None => DEFAULT_PORT,
            Some(p) => p.parse().map_err(|_| bad(&format!("bad port '{p}'")))?,
        };
        if export.contains('/') || export.len() > 255 {
            return Err(bad("export names have at most 255 characters and no '/'"));
        }
        Ok(Url {
            transport,
            host,
            port,
            export: export.to_string(),
            encrypt,
            bypass_qdisc: false,
            header_crc: q.header_crc,
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
        match &self.transport {
            Transport::Tcp => write!(f, "tcp://{}/{}", self.authority(), self.export)?,
            Transport::Udp => write!(f, "udp://{}/{}", self.authority(), self.export)?,
            Transport::NvmeTcp => write!(f, "nvme-tcp://{}/{}", self.authority(), self.export)?,
            Transport::Eth { mac } => {
                write!(f, "eth://{}/{}/{}", self.host, format_mac(mac), self.export)?
            }
        }
        let mut sep = '?';
        for (on, kv) in [
            (self.encrypt, "encrypt=1"),
            (self.bypass_qdisc, "qdisc=bypass"),
            (self.header_crc, "crc=header"),
        ] {
            if on {
                write!(f, "{sep}{kv}")?;
                sep = '&';
            }
        }
        Ok(())
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
        assert_eq!(Url::parse("udp://h/e").unwrap().port, DEFAULT_UDP_PORT);
        assert_eq!(
            Url::parse("udp://[::1]:9/e").unwrap().transport,
            Transport::Udp
        );
        assert_eq!(Url::parse("tcp://h:1").unwrap().export, "");
        assert_eq!(Url::parse("tcp://[::1]/e").unwrap().port, DEFAULT_PORT);
        assert_eq!(
            Url::parse("tcp://h:1/e").unwrap().to_string(),
            "tcp://h:1/e"
        );
        let e = Url::parse("eth://enp1s0/02:aa:bb:cc:dd:ee/disk0").unwrap();
        assert_eq!(
            e.transport,
            Transport::Eth {
                mac: [2, 0xaa, 0xbb, 0xcc, 0xdd, 0xee]
            }
        );
        assert_eq!((e.host.as_str(), e.export.as_str()), ("enp1s0", "disk0"));
        assert_eq!(e.to_string(), "eth://enp1s0/02:aa:bb:cc:dd:ee/disk0");
        let x = Url::parse("udp://h:1/e?encrypt=1").unwrap();
        assert!(x.encrypt && x.export == "e");
        assert_eq!(x.to_string(), "udp://h:1/e?encrypt=1");
        assert!(
            Url::parse("eth://vi/02:aa:bb:cc:dd:ee/d?encrypt=1")
                .unwrap()
                .encrypt
        );
        assert!(!Url::parse("udp://h:1/e").unwrap().encrypt);
        let x = Url::parse("udp://h:1/e?crc=header").unwrap();
        assert!(x.header_crc);
        assert_eq!(x.to_string(), "udp://h:1/e?crc=header");
        for other in [
            "tcp://h:1/e?crc=header",
            "eth://vi/02:aa:bb:cc:dd:ee/d?crc=header",
        ] {
            let e = Url::parse(other).unwrap_err().to_string();
            assert!(e.contains("?crc=header is for udp:// only"), "{other}: {e}");
        }
        let b = Url::parse("eth://vi/02:aa:bb:cc:dd:ee/d?qdisc=bypass&encrypt=1").unwrap();
        assert!(b.bypass_qdisc && b.encrypt);
        assert_eq!(
            b.to_string(),
            "eth://vi/02:aa:bb:cc:dd:ee/d?encrypt=1&qdisc=bypass"
        );
        assert!(!x.bypass_qdisc);
    }

    /// A link-local address names its interface (zone) by name, by index, or written as RFC
    /// 6874 has it in URLs (`%25`); the socket address takes the index.
    #[test]
    fn ipv6_zones_become_interface_indices() {
        // SAFETY: a NUL-terminated literal.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        assert_ne!(lo, 0, "loopback has an index");
        for s in ["tcp://[fe80::1%lo]:9/e", "tcp://[fe80::1%25lo]:9/e"] {
            let u = Url::parse(s).unwrap();
            assert_eq!(u.authority(), format!("[fe80::1%{lo}]:9"), "{s}");
            use std::net::ToSocketAddrs;
            let a = u.authority().to_socket_addrs().unwrap().next().unwrap();
            assert!(
                matches!(a, std::net::SocketAddr::V6(v) if v.scope_id() == lo),
                "{a}"
            );
        }
        assert_eq!(Url::parse("udp://[fe80::1%7]/e").unwrap().host, "fe80::1%7");
        let e = Url::parse("tcp://[fe80::1%nosuchif0]/e")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no interface 'nosuchif0'"), "{e}");
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
            "nbd://h:1/e",
            "eth://eth0/zz:aa:bb:cc:dd:ee/x",
            "eth:///02:aa:bb:cc:dd:ee/x",
            "eth://eth0/02:aa:bb/x",
            "udp://h:1/e?fast=1",
            "udp://h:1/e?qdisc=bypass",
            "tcp://h:1/e?encrypt=1&qdisc=fast",
            "tcp://::1/e",
            "tcp://fe80::1:7700/e",
        ] {
            let e = Url::parse(s).unwrap_err().to_string();
            assert!(e.contains("bad URL"), "{s}: {e}");
        }
    }
}
