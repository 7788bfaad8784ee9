//! `blkwire info`.

use blkwire_client::{ConnectOptions, Url};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT, eth://IFACE/MAC/EXPORT or
    /// nvme-tcp://HOST[:PORT]/NQN (without EXPORT: list the target's exports)
    url: String,
    /// Print one JSON object
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    timeout: crate::identity::AnswerTimeout,
    #[command(flatten)]
    id: crate::identity::Identity,
}

pub fn run(a: Args) -> Result<(), String> {
    let u = Url::parse(&a.url).map_err(|e| e.to_string())?;
    let timeout = a.timeout.duration()?;
    let mut opts = ConnectOptions {
        queues: 64,
        depth: 1024,
        max_io: 32 << 20,
        // The grant says what the target allows; a connection for each of its queues would
        // only take the target's memory (and fail on a small one).
        probe: true,
        timeout,
        ..Default::default()
    };
    a.id.apply(&mut opts)?;
    if u.export.is_empty() {
        let list = blkwire_client::list(&u, &opts).map_err(|e| e.to_string())?;
        if a.json {
            let v: Vec<_> = list
                .iter()
                .map(|e| json!({"name": e.name, "size": e.size, "features": e.features.names()}))
                .collect();
            println!(
                "{}",
                crate::table::json_for_terminal(&json!({ "exports": v }))
            );
        } else {
            if list.is_empty() {
                eprintln!("blkwire: note: {} serves no exports", u.authority());
            }
            for e in list {
                println!(
                    "{:<20} {:>10}  {}",
                    blkwire_client::shown(&e.name),
                    blkwire_backend::format_size(e.size),
                    e.features.names().join(",")
                );
            }
        }
        return Ok(());
    }
    // Ask for the most the target allows, so the reply shows its limits.
    let s = crate::open(&a.url, &opts)?;
    let i = &s.info;
    if a.json {
        println!(
            "{}",
            crate::table::json_for_terminal(&json!({
                "export": i.name, "size": i.size,
                "logical_block_size": i.logical_block, "physical_block_size": i.physical_block,
                "features": i.features.names(),
                "max_queues": i.queues, "max_queue_depth": i.depth, "max_io": i.max_io,
                "copy_max_bytes": i.copy.max_bytes, "copy_max_range": i.copy.max_range,
                "copy_max_ranges": i.copy.max_ranges, "header_crc": i.header_crc,
            }))
        );
    } else {
        println!("export:           {}", i.name);
        println!(
            "size:             {} ({} bytes)",
            blkwire_backend::format_size(i.size),
            i.size
        );
        println!(
            "block size:       {} logical, {} physical",
            i.logical_block, i.physical_block
        );
        println!("features:         {}", i.features.names().join(" "));
        println!("queues:           up to {}", i.queues);
        println!("queue depth:      up to {}", i.depth);
        println!(
            "max I/O:          {}",
            blkwire_backend::format_size(i.max_io as u64)
        );
        if i.copy.enabled() {
            println!(
                "server-side copy: up to {} in {} ranges per COPY (blkwire copy, cp between exports)",
                blkwire_backend::format_size(i.copy.max_bytes as u64),
                i.copy.max_ranges
            );
        } else {
            let why = if i.features.0 & blkwire_wire::Features::READ_ONLY != 0 {
                "read-only export"
            } else if a.url.starts_with("nvme-tcp://") {
                "blkwire's COPY is not an NVMe/TCP command"
            } else {
                "the target grants none (its memory budget holds no copy buffer) or too \
                 little to use"
            };
            println!("server-side copy: none for this session ({why})");
        }
    }
    if !a.json && a.url.starts_with("udp://") {
        println!(
            "frame check:      {}",
            if opts.key.is_some() {
                "sealed: every frame authenticated with AES-256-GCM (a sealed session has no \
                 CRC, so ?crc=header does not apply)"
            } else if i.header_crc {
                "CRC32C over the header only; UDP's checksum covers the data (?crc=header)"
            } else {
                "CRC32C over header and data"
            }
        );
    }
    for q in s.queues {
        let _ = q.logout();
    }
    Ok(())
}
