//! `blkwire discover`: targets and exports reachable on a link or at a UDP address
//! (PROTOCOL.md §9.5).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkwire_client::{discover_eth, discover_udp, ConnectOptions, Discovered, Transport, Url};
use blkwire_wire::ExportEntry;
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
            if !url.export.is_empty() {
                return Err(format!(
                    "'{u}': discovery lists every export of the target: use udp://{}",
                    url.authority()
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
    let failed = if opts.key.is_some() {
        list_locked(&mut found, &opts, |base, o| {
            Url::parse(&format!("{base}/"))
                .map_err(|e| e.to_string())
                .and_then(|url| blkwire_client::list(&url, o).map_err(|e| e.to_string()))
        })
    } else {
        vec![None; found.len()]
    };
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

/// Locked targets asked at once: up to 256 answered a broadcast (anyone on the link can make
/// them up), and one asked after another, each silent until the timeout, took hours.
const QUERIES_AT_ONCE: usize = 16;

/// Asks every locked target in `found` for its exports with `list` (`QUERIES_AT_ONCE` at a time),
/// none started once `opts.timeout` has passed, each given what is left of it (a query's dial
/// and its exchange each wait that long at most, so the last may end up to twice as late); a
/// target listed is unlocked. Returns, per target, why it was not listed (a target left when
/// the time is up is not asked).
fn list_locked(
    found: &mut [Discovered],
    opts: &ConnectOptions,
    list: impl Fn(&str, &ConnectOptions) -> Result<Vec<ExportEntry>, String> + Sync,
) -> Vec<Option<String>> {
    let until = Instant::now() + opts.timeout;
    let locked: Vec<(usize, String)> = (found.iter().enumerate())
        .filter(|(_, d)| d.locked)
        .map(|(i, d)| (i, d.base.clone()))
        .collect();
    let next = AtomicUsize::new(0);
    let answers = Mutex::new(Vec::with_capacity(locked.len()));
    std::thread::scope(|s| {
        for _ in 0..locked.len().min(QUERIES_AT_ONCE) {
            s.spawn(|| {
                while let Some((i, base)) = locked.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let left = until.saturating_duration_since(Instant::now());
                    let answer = if left.is_zero() {
                        Err(format!(
                            "not asked: the {} s for every locked target's query were over",
                            opts.timeout.as_secs_f64()
                        ))
                    } else {
                        list(
                            base,
                            &ConnectOptions {
                                timeout: left,
                                ..opts.clone()
                            },
                        )
                    };
                    answers.lock().expect("no query panics").push((*i, answer));
                }
            });
        }
    });
    let mut failed = vec![None; found.len()];
    for (i, answer) in answers.into_inner().expect("no query panics") {
        match answer {
            Ok(exports) => {
                found[i].exports = exports;
                found[i].locked = false;
            }
            Err(e) => failed[i] = Some(e),
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Locked targets are asked several at once, all within one timeout: 64 that each hold
    /// their query for the whole of it are not asked one after another (an hour with 256
    /// made-up answers and a 30 s timeout); those not asked in time say so, and a target
    /// that answers is listed.
    #[test]
    fn locked_targets_are_asked_at_once_within_one_timeout() {
        // The first answers the query; the last is not locked.
        let mut found: Vec<Discovered> = std::iter::once(Discovered {
            base: "udp://10.0.1.1:7701".into(),
            exports: Vec::new(),
            locked: true,
        })
        .chain((0..64).map(|i| Discovered {
            base: format!("udp://10.0.0.{i}:7701"),
            exports: Vec::new(),
            locked: i != 63,
        }))
        .collect();
        let opts = ConnectOptions {
            timeout: Duration::from_millis(300),
            ..ConnectOptions::default()
        };
        let asked = AtomicUsize::new(0);
        let failed = list_locked(&mut found, &opts, |base, o| {
            assert!(o.timeout <= opts.timeout, "{:?}", o.timeout);
            asked.fetch_add(1, Ordering::SeqCst);
            if base == "udp://10.0.1.1:7701" {
                return Ok(vec![ExportEntry {
                    name: "d".into(),
                    size: 4096,
                    features: blkwire_wire::Features(0),
                }]);
            }
            // A target that never answers: the query takes the whole of its timeout.
            std::thread::sleep(o.timeout);
            Err("timed out".into())
        });
        let asked = asked.into_inner();
        assert!(asked < 64, "every one of 64 asked in turn ({asked})");
        assert!(asked > 1, "{asked}");
        let unlisted = failed.iter().filter(|f| f.is_some()).count();
        assert_eq!(unlisted, 63, "{failed:?}");
        assert!(failed[64].is_none(), "not locked: not asked");
        assert!(failed
            .iter()
            .flatten()
            .any(|e| e.contains("not asked: the 0.3 s")));
        let listed = &found[0];
        assert!(!listed.locked && listed.exports[0].name == "d");
    }
}
