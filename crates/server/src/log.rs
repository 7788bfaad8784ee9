//! Minimal leveled logging to stderr. The level is read on control paths only (connect,
//! disconnect, errors), never per I/O.

use std::sync::atomic::{AtomicU8, Ordering};

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

static LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);

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
}

/// Sets the process-wide level.
pub fn set_level(l: Level) {
    LEVEL.store(l as u8, Ordering::Relaxed);
}

/// True when messages of level `l` are written.
pub fn enabled(l: Level) -> bool {
    l as u8 <= LEVEL.load(Ordering::Relaxed)
}

#[doc(hidden)]
pub fn write(l: Level, args: std::fmt::Arguments<'_>) {
    let tag = match l {
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        Level::Debug => "debug",
    };
    eprintln!("blkwire {tag}: {args}");
}

/// Writes a formatted message at a level, if that level is enabled.
#[macro_export]
macro_rules! log {
    ($lvl:expr, $($arg:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write($lvl, format_args!($($arg)*));
        }
    };
}
