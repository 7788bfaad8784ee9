//! `blkwire stats`: a target's live counters, per session and queue (PROTOCOL.md §11).

use std::time::Duration;

use blkwire_client::Url;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    /// tcp://HOST:PORT of the target (STATS is served on its native TCP listener)
    url: String,
    /// Print the target's JSON document unchanged
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    id: crate::identity::Identity,
}

const COLUMNS: [&str; 9] = [
    "frames_in",
    "frames_out",
    "reads",
    "writes",
    "bytes_read",
    "bytes_written",
    "errors",
    "protocol_errors",
    "dropped_duplicates",
];

pub fn run(a: Args) -> Result<(), String> {
    let u = Url::parse(&a.url).map_err(|e| e.to_string())?;
    if u.transport != blkwire_client::Transport::Tcp {
        return Err(format!(
            "'{}': stats asks the target's tcp:// listener (STATS is not served over UDP or \
             raw Ethernet); use tcp://HOST:PORT",
            a.url
        ));
    }
    let mut opts = a.id.options()?;
    opts.timeout = Duration::from_secs(10);
    let doc = blkwire_client::stats(&u, &opts).map_err(|e| e.to_string())?;
    if a.json {
        println!("{doc}");
        return Ok(());
    }
    let v: Value =
        serde_json::from_str(&doc).map_err(|e| format!("target sent bad stats JSON: {e}"))?;
    println!(
        "{:<8} {:<12} {:>5} {:>6} {}",
        "session",
        "export",
        "queue",
        "thread",
        COLUMNS.join(" ")
    );
    let empty = Vec::new();
    for s in v["sessions"].as_array().unwrap_or(&empty) {
        for q in s["queues"].as_array().unwrap_or(&empty) {
            let cols: Vec<String> = COLUMNS
                .iter()
                .map(|c| format!("{:>width$}", q[c], width = c.len()))
                .collect();
            println!(
                "{:<8} {:<12} {:>5} {:>6} {}",
                s["session"],
                s["export"].as_str().unwrap_or("?"),
                q["queue"],
                q["thread"],
                cols.join(" ")
            );
        }
    }
    let c = &v["closed"];
    let cols: Vec<String> = COLUMNS
        .iter()
        .map(|k| format!("{:>width$}", c[k], width = k.len()))
        .collect();
    println!(
        "{:<8} {:<12} {:>5} {:>6} {}",
        "closed",
        "(all)",
        "-",
        "-",
        cols.join(" ")
    );
    Ok(())
}
