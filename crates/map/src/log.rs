//! Timestamped log lines for the map daemon. A daemonised mapping writes them to `--logfile`
//! (or nowhere); a foreground one to stderr. Only control-path events are logged (setup,
//! disconnects, reconnects, errors), never per I/O.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

#[doc(hidden)]
pub fn write(level: &str, args: std::fmt::Arguments<'_>) {
    let line = format!(
        "{} blkwire-map[{}] {level}: {args}\n",
        utc_now(),
        std::process::id()
    );
    // One write per line so lines from several threads do not interleave.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `2026-11-22T02:03:04.567Z`, computed without a date library (civil-from-days).
fn utc_now() -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// `log!("warn", "queue {q}: {e}")`
#[macro_export]
macro_rules! log {
    ($level:literal, $($arg:tt)*) => {
        $crate::log::write($level, format_args!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamp_shape() {
        let t = super::utc_now();
        assert_eq!(t.len(), 24, "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && t.as_bytes()[10] == b'T',
            "{t}"
        );
    }
}
