//! `blkwire discover`: targets and exports reachable on a link or at a UDP address
//! (PROTOCOL.md §9.5).

use std::time::Duration;

use blkwire_client::{discover_eth, discover_udp, Transport, Url};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Broadcast on this interface (raw Ethernet)
    #[arg(long, value_name = "IFACE", conflicts_with = "url")]
    interface: Option<String>,
    /// Or ask one target: udp://HOST[:PORT]
    #[arg(value_name = "URL")]
    url: Option<String>,
    /// How long to collect answers, in milliseconds (10 to 60000)
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    wait_ms: u64,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    id: crate::identity::Identity,
}

pub fn run(a: Args) -> Result<(), String> {
    let wait = Duration::from_millis(a.wait_ms);
    let opts = a.id.options()?;
    if opts.tls {
        return Err(
            "--tls is for tcp:// only; discovery runs over udp:// and eth:// \
                    (use --key FILE to authenticate)"
                .into(),
        );
    }
    let mut found = match (&a.interface, &a.url) {
        (Some(iface), _) => discover_eth(iface, wait).map_err(|e| e.to_string())?,
        (None, Some(u)) => {
            let url = Url::parse(u).map_err(|e| e.to_string())?;
            if url.transport != Transport::Udp {
                return Err(format!(
                    "'{u}': discovery asks udp://HOST[:PORT] or --interface IFACE"
                ));
            }
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&url.authority())
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| format!("cannot resolve {}", url.authority()))?;
            discover_udp(addr, wait).map_err(|e| e.to_string())?
        }
        (None, None) => {
            return Err("say where to look: --interface IFACE or udp://HOST[:PORT]".into())
        }
    };
    // Targets with keys list their exports only to an authenticated query (PROTOCOL.md §12.3).
    // One that refuses this host's key (or does not answer it) is reported beside the others,
    // which are listed all the same; the exit status says that one failed.
    let mut failed: Vec<Option<String>> = vec![None; found.len()];
    if opts.key.is_some() {
        for (d, failure) in found.iter_mut().zip(&mut failed).filter(|(d, _)| d.locked) {
            let listed = Url::parse(&format!("{}/", d.base))
                .map_err(|e| e.to_string())
                .and_then(|url| blkwire_client::list(&url, &opts).map_err(|e| e.to_string()));
            match listed {
                Ok(exports) => {
                    d.exports = exports;
                    d.locked = false;
                }
                Err(e) => *failure = Some(e),
            }
        }
    }
    let where_ = a.interface.as_deref().map_or_else(
        || a.url.clone().unwrap_or_default(),
        |i| format!("interface {i}"),
    );
    // Nothing found is a failure a script can test for (exit status 1), as with `grep`; the
    // JSON document still says so for a caller that reads it.
    let none = || {
        format!(
            "no target answered on {where_} within {} ms (is one listening there? a longer --wait-ms?)",
            wait.as_millis()
        )
    };
    if a.json {
        let v: Vec<_> = found
            .iter()
            .zip(&failed)
            .map(|(d, failure)| {
                let exports: Vec<_> = d
                    .exports
                    .iter()
                    .map(|e| json!({"name": e.name, "url": format!("{}/{}", d.base, e.name), "size": e.size, "features": e.features.names()}))
                    .collect();
                let mut t = json!({"target": d.base, "exports": exports, "requires_key": d.locked});
                if let Some(e) = failure {
                    t["error"] = e.as_str().into();
                }
                t
            })
            .collect();
        println!(
            "{}",
            crate::table::json_for_terminal(&json!({ "targets": v }))
        );
    } else {
        for (d, failure) in found.iter().zip(&failed) {
            if failure.is_some() {
                continue; // said in the error line
            } else if d.locked {
                println!(
                    "{}: requires a key (blkwire discover ... --key FILE, or blkwire info {}/ --key FILE)",
                    d.base, d.base
                );
            }
            for e in &d.exports {
                println!(
                    "{}/{:<16} {:>10}  {}",
                    d.base,
                    blkwire_client::shown(&e.name),
                    blkwire_backend::format_size(e.size),
                    e.features.names().join(",")
                );
            }
        }
    }
    if found.is_empty() {
        return Err(none());
    }
    let failures: Vec<String> = found
        .iter()
        .zip(&failed)
        .filter_map(|(d, f)| f.as_ref().map(|e| format!("{}: {e}", d.base)))
        .collect();
    if failures.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} of {} target(s) did not list their exports to this host's key: {}",
        failures.len(),
        found.len(),
        failures.join("; ")
    ))
}
