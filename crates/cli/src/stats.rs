//! `blkwire stats`: a target's live counters, per session and queue (PROTOCOL.md §11).

use blkwire_client::Url;
use serde_json::Value;

use crate::table::{aligned, cell, Align};

#[derive(clap::Args)]
pub struct Args {
    /// tcp://HOST:PORT of the target (STATS is served on its native TCP listener)
    url: String,
    /// Print the target's JSON document (its control characters escaped, keys sorted)
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    timeout: crate::identity::AnswerTimeout,
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
            "'{}': stats asks the target's tcp:// listener (STATS is served on no other); \
             use tcp://HOST:PORT",
            a.url
        ));
    }
    if !u.export.is_empty() {
        return Err(format!(
            "'{}': stats shows the whole target's counters, not an export's: use \
             tcp://{}",
            a.url,
            u.authority()
        ));
    }
    let timeout = a.timeout.duration()?;
    let mut opts = a.id.options()?;
    opts.timeout = timeout;
    let doc = blkwire_client::stats(&u, &opts)
        .map_err(|e| format!("stats from {}: {e}", u.authority()))?;
    let v: Value =
        serde_json::from_str(&doc).map_err(|e| format!("target sent bad stats JSON: {e}"))?;
    if a.json {
        println!("{}", crate::table::json_for_terminal(&v));
        return Ok(());
    }
    print!("{}", table(&v));
    if let Some(n) = omitted(&v) {
        // The document stays under 1 MiB (PROTOCOL.md §11): the rows above are not all.
        eprintln!(
            "blkwire: note: {n} more session(s) not shown: the target left them out of its \
             stats to keep them under 1 MiB"
        );
    }
    Ok(())
}

/// Sessions the target left out of the document (`sessions_omitted`), if any.
fn omitted(v: &Value) -> Option<u64> {
    v["sessions_omitted"].as_u64().filter(|n| *n > 0)
}

/// The counters as a table: session and export left-aligned, numbers right-aligned.
fn table(v: &Value) -> String {
    let mut rows: Vec<Vec<String>> = vec![["session", "export", "queue", "thread"]
        .iter()
        .chain(COLUMNS.iter())
        .map(|h| h.to_string())
        .collect()];
    // Every value is the target's, strings included (which JSON escapes and parsing unescapes).
    let cell = |v: &Value| blkwire_client::shown(&cell(v)).into_owned();
    let empty = Vec::new();
    for s in v["sessions"].as_array().unwrap_or(&empty) {
        for q in s["queues"].as_array().unwrap_or(&empty) {
            let mut row = vec![
                cell(&s["session"]),
                cell(&s["export"]),
                cell(&q["queue"]),
                cell(&q["thread"]),
            ];
            row.extend(COLUMNS.iter().map(|c| cell(&q[c])));
            rows.push(row);
        }
    }
    let c = &v["closed"];
    let mut row = vec!["closed".into(), "(all)".into(), "-".into(), "-".into()];
    row.extend(COLUMNS.iter().map(|k| cell(&c[k])));
    rows.push(row);
    let align: Vec<Align> = (0..rows[0].len())
        .map(|i| if i < 2 { Align::Left } else { Align::Right })
        .collect();
    aligned(&rows, &align)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stats --json` prints no control character a target put in its document, C1 ones
    /// included (serde_json leaves those unescaped), and what it prints means the same.
    #[test]
    fn json_output_escapes_every_control_character() {
        let v = serde_json::json!({"sessions": [{"export": "a\u{9b}2Jb\u{7f}c\u{1b}[0m"}]});
        let out = crate::table::json_for_terminal(&v);
        assert!(out.chars().all(|c| !c.is_control()), "{out:?}");
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), v);
    }

    #[test]
    fn sessions_left_out_are_counted() {
        assert_eq!(omitted(&serde_json::json!({"sessions": []})), None);
        assert_eq!(
            omitted(&serde_json::json!({"sessions_omitted": 7})),
            Some(7)
        );
    }

    #[test]
    fn columns_line_up_whatever_the_widths() {
        let q = |queue: u64, frames: u64| serde_json::json!({"queue": queue, "thread": 0, "frames_in": frames, "frames_out": frames});
        let v = serde_json::json!({
            "sessions": [
                {"session": 1, "export": "a-rather-long-export-name", "queues": [q(0, 7)]},
                {"session": 12345, "export": "d", "queues": [q(1, 123456789)]},
            ],
            "closed": {"frames_in": 3},
        });
        let t = table(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        // Every row puts its frames_out column's last digit at the same place.
        let header_end = lines[0].find("frames_out").unwrap() + "frames_out".len();
        for l in &lines[1..3] {
            assert!(
                l[..header_end].ends_with(|c: char| c.is_ascii_digit()),
                "{t}"
            );
        }
        assert!(!t.contains('"'), "names without JSON quotes: {t}");
    }

    #[test]
    fn control_characters_a_target_names_are_shown_escaped() {
        let v = serde_json::json!({
            "sessions": [{"session": 1, "export": "d\u{1b}[2J", "queues": [
                {"queue": 0, "thread": "\u{1b}]0;owned\u{7}", "frames_in": 1}
            ]}],
            "closed": {},
        });
        let t = table(&v);
        assert!(!t.chars().any(|c| c.is_control() && c != '\n'), "{t:?}");
        assert!(t.contains("d\\u{1b}[2J"), "{t}");
    }
}
