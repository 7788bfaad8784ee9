//! Per-export allow rules: `allow=RULE[+RULE...]` where a rule is a host id (`alice`), an
//! address prefix (`10.0.0.0/8`, `fd00::/64`, or one address) or a MAC address
//! (`02:00:00:00:00:01`, raw Ethernet).
//!
//! A peer is admitted when it matches at least one host-id rule (if there are any) **and** at
//! least one address or MAC rule (if there are any): host ids say who, addresses say from
//! where, and an export that names both wants both. An empty list admits everyone the target's
//! other checks admit.

use std::net::IpAddr;

/// Where a peer speaks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerAddr {
    /// An IP address (TCP, UDP, NBD).
    Ip(IpAddr),
    /// A MAC address (raw Ethernet).
    Mac([u8; 6]),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Rule {
    Host(String),
    Prefix(IpAddr, u8),
    Mac([u8; 6]),
}

/// An export's allow list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acl {
    rules: Vec<Rule>,
}

/// A MAC address written `aa:bb:cc:dd:ee:ff` (or with `-`): six pairs of hex digits.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split([':', '-']);
    for b in mac.iter_mut() {
        let p = parts.next()?;
        // from_str_radix takes a sign too ("+2").
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

impl Acl {
    /// Parses `RULE[+RULE...]`; the error names the rule and the forms accepted.
    pub fn parse(s: &str) -> Result<Acl, String> {
        let mut rules = Vec::new();
        for r in s.split('+') {
            let rule = if r.is_empty() {
                return Err("allow= has an empty rule (rules are joined by '+')".into());
            } else if let Some((ip, scoped)) = r
                .split_once('%')
                .filter(|(ip, _)| ip.parse::<IpAddr>().is_ok())
            {
                // What to write instead keeps a prefix length after the scope (RFC 4007's
                // `fe80::%eth0/64`).
                let prefix = scoped
                    .split_once('/')
                    .map_or(String::new(), |(_, n)| format!("/{n}"));
                let ip = format!("{ip}{prefix}");
                // Not a host id with a '%' in it: rules match an address on every link, and a
                // scope kept silently as a host id would match no one (or be refused for
                // naming a host id without keys, which says nothing of the real mistake).
                return Err(format!(
                    "allow rule '{r}': a scope (%IFACE) is not supported; rules match the \
                     address on every link: write '{ip}'"
                ));
            } else if r.contains(',') {
                // An export spec's options end at ',': such a rule could not be written back
                // into one (a saved config), and is likelier a list typed with the wrong
                // separator than a host id.
                return Err(format!(
                    "allow rule '{r}' contains ',': join rules with '+' (allow=db1+db2)"
                ));
            } else if let Some(mac) = parse_mac(r) {
                Rule::Mac(mac)
            } else if let Some((ip, bits)) = r.split_once('/') {
                let ip: IpAddr = ip
                    .parse()
                    .map_err(|_| format!("allow rule '{r}': '{ip}' is not an IP address"))?;
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let bits: u8 =
                    bits.parse().ok().filter(|b| *b <= max).ok_or_else(|| {
                        format!("allow rule '{r}': prefix length must be 0 to {max}")
                    })?;
                ipv4_form(r, ip, bits)?
            } else if let Ok(ip) = r.parse::<IpAddr>() {
                ipv4_form(r, ip, if ip.is_ipv4() { 32 } else { 128 })?
            } else {
                crate::keys::check_host_id(r).map_err(|e| {
                    format!("allow rule '{r}' is not a host id, address prefix or MAC: {e}")
                })?;
                Rule::Host(r.to_string())
            };
            rules.push(rule);
        }
        Ok(Acl { rules })
    }

    /// No rules: everyone passes this check.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The host ids the list names.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().filter_map(|r| match r {
            Rule::Host(h) => Some(h.as_str()),
            _ => None,
        })
    }

    /// Does a peer proven to be `host` (`None`: not authenticated) at `addr` pass?
    pub fn permits(&self, host: Option<&str>, addr: &PeerAddr) -> bool {
        let mut host_rules = false;
        let mut host_ok = false;
        let mut addr_rules = false;
        let mut addr_ok = false;
        for r in &self.rules {
            match r {
                Rule::Host(h) => {
                    host_rules = true;
                    host_ok |= host == Some(h.as_str());
                }
                Rule::Prefix(net, bits) => {
                    addr_rules = true;
                    addr_ok |= matches!(addr, PeerAddr::Ip(ip) if in_prefix(ip, net, *bits));
                }
                Rule::Mac(m) => {
                    addr_rules = true;
                    addr_ok |= *addr == PeerAddr::Mac(*m);
                }
            }
        }
        (!host_rules || host_ok) && (!addr_rules || addr_ok)
    }
}

impl std::fmt::Display for Acl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, r) in self.rules.iter().enumerate() {
            if i > 0 {
                f.write_str("+")?;
            }
            match r {
                Rule::Host(h) => f.write_str(h)?,
                Rule::Prefix(ip, bits) => write!(f, "{ip}/{bits}")?,
                Rule::Mac(m) => write!(
                    f,
                    "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                    m[0], m[1], m[2], m[3], m[4], m[5]
                )?,
            }
        }
        Ok(())
    }
}

/// The rule for prefix `ip/bits` (rule text `r`), an IPv4-mapped IPv6 prefix
/// (`::ffff:10.0.0.0/104`) in its IPv4 form: peers are matched in IPv4 form (`in_prefix`), so
/// the mapped form would never match anyone. A mapped address with a prefix shorter than 96
/// bits spans more than IPv4 and is refused.
fn ipv4_form(r: &str, ip: IpAddr, bits: u8) -> Result<Rule, String> {
    let IpAddr::V6(v6) = ip else {
        return Ok(Rule::Prefix(ip, bits));
    };
    match v6.to_ipv4_mapped() {
        None => Ok(Rule::Prefix(ip, bits)),
        Some(v4) if bits >= 96 => Ok(Rule::Prefix(IpAddr::V4(v4), bits - 96)),
        Some(v4) => Err(format!(
            "allow rule '{r}': an IPv4-mapped prefix must be /96 or longer (it is matched as \
             IPv4: write {v4}/N)"
        )),
    }
}

fn in_prefix(ip: &IpAddr, net: &IpAddr, bits: u8) -> bool {
    // An IPv4 peer may arrive as an IPv4-mapped IPv6 address on a dual-stack socket.
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(*ip),
        v4 => *v4,
    };
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - bits as u32).unwrap_or(0);
            u32::from(a) & mask == u32::from(*n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - bits as u32).unwrap_or(0);
            u128::from(a) & mask == u128::from(*n) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> PeerAddr {
        PeerAddr::Ip(s.parse().unwrap())
    }

    #[test]
    fn host_and_address_rules_must_both_match_when_both_are_given() {
        let acl = Acl::parse("alice+bob+10.1.0.0/16").unwrap();
        assert!(acl.permits(Some("alice"), &ip("10.1.2.3")));
        assert!(acl.permits(Some("bob"), &ip("10.1.255.1")));
        assert!(!acl.permits(Some("carol"), &ip("10.1.2.3")), "unknown host");
        assert!(
            !acl.permits(Some("alice"), &ip("10.2.0.1")),
            "outside the prefix"
        );
        assert!(!acl.permits(None, &ip("10.1.2.3")), "not authenticated");
        assert_eq!(acl.to_string(), "alice+bob+10.1.0.0/16");
    }

    #[test]
    fn nvme_host_nqns_are_host_rules() {
        let nqn = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-a0c9a2ab1b2c";
        let acl = Acl::parse(&format!("{nqn}+fe80::1")).unwrap();
        assert_eq!(acl.hosts().collect::<Vec<_>>(), [nqn]);
        assert!(acl.permits(Some(nqn), &ip("fe80::1")));
        assert!(!acl.permits(Some("nqn.2014-08.org.nvmexpress:uuid:x"), &ip("fe80::1")));
    }

    #[test]
    fn address_only_and_mac_rules() {
        let acl = Acl::parse("127.0.0.1+fd00::/8").unwrap();
        assert!(acl.permits(None, &ip("127.0.0.1")));
        assert!(acl.permits(None, &ip("::ffff:127.0.0.1")), "v4-mapped");
        assert!(acl.permits(None, &ip("fd12::1")));
        assert!(!acl.permits(None, &ip("127.0.0.2")));
        assert!(!acl.permits(None, &PeerAddr::Mac([2, 0, 0, 0, 0, 1])));
        assert_eq!(
            parse_mac("+2:00:00:00:00:01"),
            None,
            "a sign is no hex digit"
        );
        let acl = Acl::parse("02:00:00:00:00:01").unwrap();
        assert!(acl.permits(Some("x"), &PeerAddr::Mac([2, 0, 0, 0, 0, 1])));
        assert!(!acl.permits(Some("x"), &PeerAddr::Mac([2, 0, 0, 0, 0, 2])));
        assert!(Acl::parse("0.0.0.0/0")
            .unwrap()
            .permits(None, &ip("8.8.8.8")));
        assert!(Acl::default().permits(None, &ip("8.8.8.8")));
    }

    /// Peers are matched in IPv4 form, so rules written IPv4-mapped are taken in IPv4 form
    /// too (they used to match no one), and a mapped prefix wider than IPv4 is refused.
    #[test]
    fn ipv4_mapped_rules_match_ipv4_peers() {
        let acl = Acl::parse("::ffff:10.0.0.0/104+::ffff:192.0.2.7").unwrap();
        assert!(acl.permits(None, &ip("10.1.2.3")));
        assert!(acl.permits(None, &ip("::ffff:10.1.2.3")));
        assert!(acl.permits(None, &ip("192.0.2.7")));
        assert!(!acl.permits(None, &ip("192.0.2.8")));
        assert!(!acl.permits(None, &ip("11.0.0.1")));
        assert_eq!(acl.to_string(), "10.0.0.0/8+192.0.2.7/32");
        let e = Acl::parse("::ffff:10.0.0.0/80").unwrap_err();
        assert!(
            e.contains("/96 or longer") && e.contains("10.0.0.0/N"),
            "{e}"
        );
    }

    #[test]
    fn bad_rules_say_what_is_wrong() {
        for (s, want) in [
            ("alice++bob", "empty rule"),
            ("10.0.0.0/33", "prefix length"),
            ("10.0.0/8", "not an IP"),
            ("a b", "not a host id"),
            ("fe80::1%eth0", "scope (%IFACE) is not supported"),
            ("fe80::1%2+alice", "write 'fe80::1'"),
            ("fe80::%eth0/64", "write 'fe80::/64'"),
            // A list with the wrong separator (export_set_allow takes the rules alone, so
            // nothing else splits them first), and what an export spec could not hold.
            ("db1,db2", "join rules with '+'"),
            ("alice+b,ro", "join rules with '+'"),
        ] {
            let e = Acl::parse(s).unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
