//! Leveled logging through the `log` facade, so a program that embeds the target gets its
//! messages in its own logger (env_logger, tracing-log, syslog), with the usual levels and
//! `blkwire_server::...` targets. `blkwire serve` installs [`init_stderr`]: one line per event on
//! stderr, `blkwire LEVEL: message`. Logging happens on control paths only (connect,
//! disconnect, refusals, errors), never per I/O.

/// The facade, re-exported so the [`log!`](crate::log!) macro works in crates that do not
/// depend on it themselves.
pub use ::log as facade;

/// How much to say: each level includes the ones above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Something failed that the operator must see.
    Error = 0,
    /// A peer misbehaved or a request failed.
    Warn = 1,
    /// Sessions coming and going, start and stop.
    Info = 2,
    /// Per-queue detail.
    Debug = 3,
}

impl Level {
    /// `error`, `warn`, `info` or `debug`.
    pub fn parse(s: &str) -> Result<Level, String> {
        Ok(match s {
            "error" => Level::Error,
            "warn" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            _ => {
                return Err(format!(
                    "bad log level '{s}': use error, warn, info or debug"
                ))
            }
        })
    }

    /// The facade's level.
    pub fn facade(self) -> ::log::Level {
        match self {
            Level::Error => ::log::Level::Error,
            Level::Warn => ::log::Level::Warn,
            Level::Info => ::log::Level::Info,
            Level::Debug => ::log::Level::Debug,
        }
    }
}

/// Sets the process-wide level (the facade's maximum).
pub fn set_level(l: Level) {
    ::log::set_max_level(l.facade().to_level_filter());
}

/// True when messages of level `l` would be written.
pub fn enabled(l: Level) -> bool {
    l.facade() <= ::log::max_level()
}

/// Writes `blkwire LEVEL: message` lines to stderr.
struct Stderr;

impl ::log::Log for Stderr {
    fn enabled(&self, m: &::log::Metadata<'_>) -> bool {
        m.level() <= ::log::max_level()
    }

    fn log(&self, r: &::log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let tag = r.level().as_str().to_ascii_lowercase();
            eprintln!("blkwire {tag}: {}", r.args());
        }
    }

    fn flush(&self) {}
}

/// Installs the stderr logger at level `l` (`blkwire serve`); a program that installed its own
/// logger first keeps it, and only the level is set.
pub fn init_stderr(l: Level) {
    static STDERR: Stderr = Stderr;
    let _ = ::log::set_logger(&STDERR);
    set_level(l);
}

/// Says something that may happen in floods at most once a second, with how often it happened
/// since it was last said: a hostile peer must not be able to flood the log.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Option<std::time::Instant>,
    count: u64,
}

impl Throttle {
    /// At most one line this often.
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(1);

    /// Nothing said yet.
    pub const fn new() -> Throttle {
        Throttle {
            last: None,
            count: 0,
        }
    }

    /// Counts one occurrence. When a line is due, returns how many occurred since the last line
    /// (this one included); else `None`.
    pub fn hit(&mut self) -> Option<u64> {
        self.count += 1;
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.count))
    }
}

/// Writes a formatted message at a [`Level`] through the facade, if that level is enabled.
#[macro_export]
macro_rules! log {
    ($lvl:expr, $($arg:tt)*) => {
        $crate::log::facade::log!($crate::log::Level::facade($lvl), $($arg)*)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_map_onto_the_facade_and_filter() {
        set_level(Level::Warn);
        assert!(enabled(Level::Error) && enabled(Level::Warn));
        assert!(!enabled(Level::Info) && !enabled(Level::Debug));
        set_level(Level::Debug);
        assert!(enabled(Level::Debug));
        assert!(Level::parse("loud")
            .unwrap_err()
            .contains("error, warn, info or debug"));
        set_level(Level::Info);
    }

    #[test]
    fn a_throttle_says_the_first_then_counts_until_a_second_has_passed() {
        let mut t = Throttle::new();
        assert_eq!(t.hit(), Some(1));
        assert_eq!((t.hit(), t.hit()), (None, None));
        t.last = t.last.map(|l| l - Throttle::EVERY);
        assert_eq!(t.hit(), Some(3), "the two unsaid and this one");
        assert_eq!(t.hit(), None);
    }
}
