//! `blkwire copy URL --src OFF:LEN[,OFF:LEN...] --dst OFF`: ranges copied inside the target
//! (server-side COPY, PROTOCOL.md §13), within one export or from another export of the same
//! target (`--from`); no data crosses the network.

use std::time::Instant;

use blkwire_backend::{format_size, parse_size};
use blkwire_client::{ConnectOptions, CopyRange, Error};
use blkwire_wire::Features;

#[derive(clap::Args)]
pub struct Args {
    /// The destination export: tcp://HOST[:PORT]/EXPORT, udp://HOST[:PORT]/EXPORT or
    /// eth://IFACE/MAC/EXPORT
    url: String,
    /// Source ranges, copied in order to consecutive bytes from --dst: OFFSET:LENGTH with
    /// sizes such as 4096, 64K or 1G, several separated by commas
    #[arg(long, value_name = "OFF:LEN[,OFF:LEN...]", required = true)]
    src: String,
    /// Where the first source byte lands in the destination export
    #[arg(long, value_name = "OFFSET")]
    dst: String,
    /// Copy from this export of the same target instead of from the destination export itself
    /// (within one export no source range may overlap the destination)
    #[arg(long, value_name = "EXPORT")]
    from: Option<String>,
    /// Seconds a COPY may go unanswered before the copy fails
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    timeout: u64,
    #[command(flatten)]
    id: crate::identity::Identity,
}

/// `OFF:LEN[,OFF:LEN...]`, each part a size as `serve` takes them.
fn parse_ranges(s: &str) -> Result<Vec<CopyRange>, String> {
    s.split(',')
        .map(|part| {
            let (off, len) = part.split_once(':').ok_or_else(|| {
                format!("--src '{part}': give OFFSET:LENGTH, e.g. 0:1M (several with commas)")
            })?;
            let offset = parse_size(off).map_err(|e| format!("--src '{part}': offset {e}"))?;
            let len = parse_size(len).map_err(|e| format!("--src '{part}': length {e}"))?;
            if len == 0 || len > u32::MAX as u64 {
                return Err(format!(
                    "--src '{part}': a range is at least 1 byte and shorter than 4 GiB; split longer ones"
                ));
            }
            Ok(CopyRange {
                offset,
                len: len as u32,
            })
        })
        .collect()
}

/// Within one export a source range may not overlap the destination: the result would depend
/// on the order the target copies in, so the target refuses it (PROTOCOL.md §13); say so
/// before connecting.
fn check_overlap(ranges: &[CopyRange], dst: u64) -> Result<(), String> {
    match blkwire_client::overlapping_source(ranges, dst) {
        Some((r, end)) => Err(format!(
            "--src {}:{} overlaps the destination {dst}..{end}: within one export a copy's \
             source and destination may not overlap; copy through a scratch range",
            r.offset, r.len
        )),
        None => Ok(()),
    }
}

pub fn run(a: Args) -> Result<(), String> {
    let ranges = parse_ranges(&a.src)?;
    let dst = parse_size(&a.dst).map_err(|e| format!("--dst '{}': {e}", a.dst))?;
    // --from naming the destination's own export is a copy within it.
    let own = blkwire_client::Url::parse(&a.url)
        .map(|u| u.export)
        .unwrap_or_default();
    let from = a.from.as_deref().filter(|f| *f != own);
    if from.is_none() {
        check_overlap(&ranges, dst)?;
    }
    let mut opts = ConnectOptions {
        queues: 1,
        depth: 16,
        timeout: std::time::Duration::from_secs(a.timeout),
        ..Default::default()
    };
    a.id.apply(&mut opts)?;
    // Another export's end is checked here as the destination's is below: its size is what a
    // session of it is granted (one queue, one slot, closed before the copy opens its own).
    let source_size = match from {
        Some(name) => Some(source_size(&a.url, name, &opts)?),
        None => None,
    };
    let mut s = crate::open(&a.url, &opts)?;
    if s.info.features.has(Features::READ_ONLY) {
        return Err(format!(
            "{}: export is read-only: copy into a writable export",
            a.url
        ));
    }
    let total: u64 = ranges.iter().map(|r| r.len as u64).sum();
    // What the target would refuse, refused before anything is copied: a long copy goes as
    // several COPYs, each checked by itself, and one refused after others ran would leave
    // the export half changed.
    let size = s.info.size;
    if dst.checked_add(total).is_none_or(|end| end > size) {
        return Err(format!(
            "{}: {total} bytes to offset {dst} go beyond the end of the export ({size} bytes): \
             nothing was copied",
            a.url
        ));
    }
    // (Alignment is the target's to check: only an O_DIRECT export demands it, §13.)
    let (source, source_end) = match (from, source_size) {
        (Some(name), Some(end)) => (format!("export {name}"), end),
        _ => ("export".to_string(), size),
    };
    let past = |r: &&CopyRange| {
        r.offset
            .checked_add(r.len as u64)
            .is_none_or(|end| end > source_end)
    };
    if let Some(r) = ranges.iter().find(past) {
        return Err(format!(
            "{}: the range {}:{} goes beyond the end of the {source} ({source_end} bytes): \
             nothing was copied",
            a.url, r.offset, r.len
        ));
    }
    let q = s.queues.first_mut().ok_or("the target granted no queue")?;
    let start = Instant::now();
    let source = from.unwrap_or("");
    let result = q.copy(source, &ranges, dst);
    // Durable before it says "copied", as cp is: a COPY without FUA is visible, not durable
    // (PROTOCOL.md §10); one FLUSH covers it.
    let flushed = result.is_ok().then(|| q.flush());
    let secs = start.elapsed().as_secs_f64();
    for q in s.queues {
        let _ = q.logout();
    }
    if let Some(Err(e)) = flushed {
        return Err(format!(
            "{}: the copy ran, but the target could not make it durable (FLUSH: {e})",
            a.url
        ));
    }
    match result {
        Ok(()) => {
            println!(
                "copied {} ({total} bytes) to offset {dst} in {secs:.2}s, inside the target",
                format_size(total)
            );
            Ok(())
        }
        Err(Error::Copy { status, copied }) => Err(format!(
            "{}: copy failed after {copied} of {total} bytes: {status}",
            a.url
        )),
        Err(e) => Err(format!("{}: {e}", a.url)),
    }
}

/// The size of export `name` of the target `url` names, from a session of it.
fn source_size(url: &str, name: &str, opts: &ConnectOptions) -> Result<u64, String> {
    let mut u = blkwire_client::Url::parse(url).map_err(|e| e.to_string())?;
    u.export = name.to_string();
    let one = ConnectOptions {
        queues: 1,
        depth: 1,
        ..opts.clone()
    };
    let s = crate::open(&u.to_string(), &one).map_err(|e| format!("--from {name}: {e}"))?;
    for q in s.queues {
        let _ = q.logout();
    }
    Ok(s.info.size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_with_sizes_and_refuse_what_cannot_be_sent() {
        assert_eq!(
            parse_ranges("0:4096,1M:64K").unwrap(),
            vec![
                CopyRange {
                    offset: 0,
                    len: 4096
                },
                CopyRange {
                    offset: 1 << 20,
                    len: 64 << 10
                }
            ]
        );
        for bad in ["", "4096", "0:0", "x:1", "0:8G", "0:1M,"] {
            assert!(parse_ranges(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn overlapping_source_and_destination_are_refused_touching_ones_are_not() {
        let r = |offset, len| CopyRange { offset, len };
        assert!(check_overlap(&[r(0, 4096)], 4096).is_ok());
        assert!(check_overlap(&[r(8192, 4096)], 4096).is_ok());
        assert!(check_overlap(&[r(0, 4097)], 4096).is_err());
        // The destination spans every range's bytes: 0..4106 here, which the second one meets.
        assert!(check_overlap(&[r(100_000, 4096), r(4000, 10)], 0).is_err());
        assert!(check_overlap(&[r(100_000, 4096), r(4106, 10)], 0).is_ok());
    }
}
