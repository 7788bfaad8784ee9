//! Tables for a terminal: columns as wide as their widest cell, so names and numbers of any
//! length line up (`stats`, `export ls`, `listener ls`, `session ls`).

use serde_json::Value;

/// Where a column's cells sit in its width: text to the left, numbers to the right.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A JSON value as a table cell: strings without their quotes, a missing value as `-`.
pub fn cell(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
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
