//! Every backend `serve --export NAME=KIND:ARG` can open, by its scheme. Adding a backend is one
//! entry here plus its module (docs/ARCHITECTURE.md, "How to add a backend").

use std::path::Path;
use std::sync::Arc;

use crate::{Backend, FileBackend, MemBackend, MemThreadBackend, NullBackend};

/// Opens a backend from the argument after the ':' and whether the export is read-only.
pub type Opener = fn(arg: &str, read_only: bool) -> Result<Arc<dyn Backend>, String>;

/// One kind of backend.
pub struct BackendKind {
    /// What comes before the ':' (`mem`, `file`, ...).
    pub scheme: &'static str,
    /// How the argument is written, for help and errors (`mem:SIZE`).
    pub usage: &'static str,
    /// One line on what it is.
    pub about: &'static str,
    /// The argument is the backend's size (`mem:SIZE`): a resized export's spec names the new
    /// size ([`crate::ExportSpec::resized`]).
    pub arg_is_size: bool,
    /// Opens one: the argument after the ':' and whether the export is read-only. Errors are one
    /// line and say what to fix.
    pub open: Opener,
}

/// The backends, in the order help lists them.
pub static KINDS: &[BackendKind] = &[
    BackendKind {
        scheme: "mem",
        usage: "mem:SIZE",
        about: "sparse RAM: pages exist only where written",
        arg_is_size: true,
        open: |arg, _| {
            Ok(Arc::new(
                MemBackend::new(size(arg)?).map_err(|e| e.to_string())?,
            ))
        },
    },
    BackendKind {
        scheme: "null",
        usage: "null:SIZE",
        about: "reads zeros, discards writes",
        arg_is_size: true,
        open: |arg, _| {
            Ok(Arc::new(
                NullBackend::new(size(arg)?).map_err(|e| e.to_string())?,
            ))
        },
    },
    BackendKind {
        scheme: "file",
        usage: "file:PATH[?direct=1]",
        about: "a regular file or block device through io_uring (direct=1: O_DIRECT)",
        arg_is_size: false,
        open: open_file,
    },
    BackendKind {
        scheme: "memthread",
        usage: "memthread:SIZE",
        about: "RAM whose I/O completes on a helper thread (exercises the asynchronous \
                completion path, as librbd uses it)",
        arg_is_size: true,
        open: |arg, _| {
            Ok(Arc::new(
                MemThreadBackend::new(size(arg)?).map_err(|e| e.to_string())?,
            ))
        },
    },
    BackendKind {
        scheme: "rbd",
        usage: "rbd:POOL/IMAGE[?conf=FILE&id=NAME&keyring=FILE&timeout=SECS]",
        about: "a Ceph RBD image through librbd (conf: ceph.conf, default $CEPH_CONF or \
                /etc/ceph/ceph.conf; id: client name, default client.admin; timeout: seconds \
                before a Ceph operation fails, default 10)",
        arg_is_size: false,
        open: crate::rbd::open,
    },
];

/// `mem:SIZE, null:SIZE, ...`: every backend's usage, for help and errors.
pub fn usages() -> String {
    KINDS.iter().map(|k| k.usage).collect::<Vec<_>>().join(", ")
}

/// The backend kind a scheme names.
pub fn find(scheme: &str) -> Option<&'static BackendKind> {
    KINDS.iter().find(|k| k.scheme == scheme)
}

fn size(arg: &str) -> Result<u64, String> {
    crate::parse_size(arg)
}

fn open_file(arg: &str, read_only: bool) -> Result<Arc<dyn Backend>, String> {
    let (path, query) = arg.split_once('?').unwrap_or((arg, ""));
    let mut direct = false;
    for kv in query.split('&').filter(|q| !q.is_empty()) {
        match kv {
            "direct=1" | "direct" => direct = true,
            "direct=0" => direct = false,
            _ => return Err(format!("unknown file option '{kv}' (known: direct=1)")),
        }
    }
    if path.is_empty() {
        return Err("file: needs a path".into());
    }
    let b = FileBackend::open(Path::new(path), direct, read_only).map_err(|e| e.to_string())?;
    Ok(Arc::new(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_found_by_its_scheme_and_listed_in_the_usage() {
        for k in KINDS {
            assert!(std::ptr::eq(find(k.scheme).unwrap(), k));
            assert!(k.usage.starts_with(&format!("{}:", k.scheme)));
            assert!(usages().contains(k.usage));
        }
        assert!(find("disk").is_none());
    }
}
