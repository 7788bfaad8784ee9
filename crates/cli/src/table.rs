//! Output for a terminal: tables whose columns are as wide as their widest cell, so names and
//! numbers of any length line up (`stats`, `export ls`, `listener ls`, `session ls`), and JSON
//! documents made of what a target sent, escaped (`info`, `discover`, `stats` with `--json`).

use serde_json::Value;

/// `v` written out again, every control character escaped: JSON lets DEL and the C1 controls
/// (a one-character CSI among them) stand unescaped in strings, and a target's document is
/// not printed as it came. Written compactly, so the only control characters are in strings,
/// where `\uXXXX` means the same.
pub fn json_for_terminal(v: &Value) -> String {
    escaped(&v.to_string(), |_| true)
}

/// `v` written out pretty, for a terminal: as `json_for_terminal`, indented. The only control
/// characters outside strings are the line breaks (in strings JSON escapes those itself), so
/// every other one is escaped where it stands.
pub fn pretty_json_for_terminal(v: &Value) -> String {
    let pretty = serde_json::to_string_pretty(v).expect("a Value always serializes");
    escaped(&pretty, |c| c != '\n')
}

/// `json` with each control character that `escape` picks written as `\uXXXX` (in a JSON
/// string, the same character).
fn escaped(json: &str, escape: impl Fn(char) -> bool) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_control() && escape(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// Where a column's cells sit in its width: text to the left, numbers to the right.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A JSON value as a table cell: strings without their quotes, a missing value as `-`.
/// Control characters are escaped: a cell may hold what a peer sent (a host id in `session ls`),
/// which must not reach the terminal as escape sequences.
pub fn cell(v: &Value) -> String {
    match v {
        Value::String(s) => blkwire_client::shown(s).into_owned(),
        Value::Null => "-".into(),
        v => v.to_string(),
    }
}

/// `rows` (the header first) as lines, two spaces between columns, no trailing blanks.
pub fn aligned(rows: &[Vec<String>], align: &[Align]) -> String {
    let widths: Vec<usize> = (0..align.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .zip(align)
            .map(|((cell, w), a)| match a {
                Align::Left => format!("{cell:<w$}"),
                Align::Right => format!("{cell:>w$}"),
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a peer sent reaches the terminal with its control characters escaped, in a table's
    /// cells and in JSON, which itself leaves DEL and the C1 controls (a one-character CSI)
    /// raw in strings; JSON output still parses to the same value.
    #[test]
    fn control_characters_never_reach_the_terminal() {
        let host = "\x1b]0;pwned\x07\u{9b}2J\u{7f}";
        assert!(!cell(&Value::String(host.into()))
            .chars()
            .any(char::is_control));
        let v = serde_json::json!([{ "host": host, "queues": 2 }]);
        let out = pretty_json_for_terminal(&v);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(out.contains('\n'), "still indented");
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), v);
    }
}
