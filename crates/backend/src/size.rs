//! Human sizes: `512`, `4k`, `1M`, `1G`, `2T` (binary multiples; `KiB`/`K`/`k` all accepted).

/// Parses a size; the error says what was wrong and what is accepted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad =
        || format!("bad size '{s}': use a number with an optional unit, e.g. 512, 4k, 1M, 1G, 2T");
    if num.is_empty() {
        return Err(bad());
    }
    // Only digits are left here, so a parse error is an overflow.
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size '{s}' is too large (at most 16 EiB, e.g. 2T)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{s}' is too large (at most 16 EiB, e.g. 2T)"))
}

/// Formats bytes the way `parse_size` reads them back when exact (`4K`, `1.5G` otherwise).
pub fn format_size(n: u64) -> String {
    const UNITS: [&str; 5] = ["", "K", "M", "G", "T"];
    let mut i = 0;
    let mut v = n as f64;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}{}", UNITS[i])
    } else {
        format!("{v:.1}{}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
    }

    #[test]
    fn rejects_garbage() {
        for s in ["", "k", "4x", "-1", "1.5G", "99999999999999999999"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_size("99999999999999999999")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(4096), "4K");
        assert_eq!(format_size(3 << 29), "1.5G");
        assert_eq!(format_size(100), "100");
    }
}
