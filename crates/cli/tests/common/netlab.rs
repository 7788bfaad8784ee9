//! Two network namespaces joined by a veth pair (`NetLab`), and targets started in them
//! (`Served`): for the datagram transports' tests and for mappings over eth:// and udp://.

use std::process::{Child, Command, Stdio};

use super::BIN;

/// A target started through `ip netns exec` (or directly), with every `listening` URL it printed.
pub struct Served {
    pub child: Child,
    pub urls: Vec<String>,
}

impl Served {
    pub fn start(netns: Option<&str>, listen: &[&str], exports: &[&str]) -> Served {
        Self::start_with(netns, listen, exports, &[])
    }

    /// `start` with extra `serve` arguments (keys, limits).
    pub fn start_with(
        netns: Option<&str>,
        listen: &[&str],
        exports: &[&str],
        extra: &[&str],
    ) -> Served {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, BIN]);
                c
            }
            None => Command::new(BIN),
        };
        cmd.args(["serve", "--log-level", "warn", "--threads", "2"]);
        if !extra.contains(&"--rpc-socket") {
            // Not the machine's default socket (see `serve_command`).
            cmd.args(["--rpc-socket", "none"]);
        }
        for l in listen {
            cmd.args(["--listen", l]);
        }
        for e in exports {
            cmd.args(["--export", e]);
        }
        cmd.args(extra);
        let (child, urls) = super::spawn_serve(&mut cmd, listen.len());
        Served { child, urls }
    }

    pub fn url(&self, scheme: &str) -> String {
        self.urls
            .iter()
            .find(|u| u.starts_with(scheme))
            .cloned()
            .expect("listener")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.stdin(Stdio::null()).output().expect("run command");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn sh(args: &[&str]) {
    let (ok, _, err) = run(Command::new(args[0]).args(&args[1..]));
    assert!(ok, "{args:?} failed: {err}");
}

/// Two namespaces, `<tag>t` (target, 10.99.N.1) and `<tag>i` (initiator, 10.99.N.2), joined by a
/// veth pair; removed on drop, also when a test fails.
pub struct NetLab {
    pub t: String,
    pub i: String,
}

impl NetLab {
    pub fn new(n: u8, mtu: u32) -> NetLab {
        assert_eq!(
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() },
            0,
            "namespace tests need root (CI runs as root)"
        );
        let tag = format!("bw{}n{n}", std::process::id() % 100_000);
        let lab = NetLab {
            t: format!("{tag}t"),
            i: format!("{tag}i"),
        };
        let (t, i) = (lab.t.as_str(), lab.i.as_str());
        sh(&["ip", "netns", "add", t]);
        sh(&["ip", "netns", "add", i]);
        sh(&[
            "ip", "link", "add", "vt", "netns", t, "type", "veth", "peer", "name", "vi", "netns", i,
        ]);
        for (ns, dev, addr) in [
            (t, "vt", format!("10.99.{n}.1/24")),
            (i, "vi", format!("10.99.{n}.2/24")),
        ] {
            sh(&["ip", "-n", ns, "addr", "add", &addr, "dev", dev]);
            sh(&["ip", "-n", ns, "link", "set", dev, "mtu", &mtu.to_string()]);
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        lab
    }

    pub fn mac(&self) -> String {
        let (ok, out, _) = run(Command::new("ip").args([
            "netns",
            "exec",
            &self.t,
            "cat",
            "/sys/class/net/vt/address",
        ]));
        assert!(ok);
        out.trim().to_string()
    }

    /// Runs the CLI in the initiator namespace.
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        run(Command::new("ip")
            .args(["netns", "exec", &self.i, BIN])
            .args(args))
    }

    /// nftables `netdev` rules on both ends: drop `loss`% of blkwire frames (UDP and Ethernet) at
    /// ingress, duplicate `dup`% at egress.
    pub fn impair(&self, loss: u32, dup: u32) {
        for (ns, dev) in [(&self.t, "vt"), (&self.i, "vi")] {
            let nft = |rule: &str| sh(&["ip", "netns", "exec", ns, "nft", rule]);
            let _ = run(Command::new("ip").args([
                "netns",
                "exec",
                ns,
                "nft",
                "delete table netdev lossy",
            ]));
            nft("add table netdev lossy");
            nft(&format!("add chain netdev lossy in {{ type filter hook ingress device {dev} priority 0 ; }}"));
            nft(&format!("add chain netdev lossy out {{ type filter hook egress device {dev} priority 0 ; }}"));
            for m in ["ether type 0x88b5", "udp dport 7701", "udp sport 7701"] {
                if loss > 0 {
                    nft(&format!(
                        "add rule netdev lossy in {m} numgen random mod 100 < {loss} drop"
                    ));
                }
                if dup > 0 {
                    nft(&format!("add rule netdev lossy out {m} numgen random mod 100 < {dup} dup to \"{dev}\""));
                }
            }
        }
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for ns in [&self.t, &self.i] {
            let _ = run(Command::new("ip").args(["netns", "del", ns]));
        }
    }
}
