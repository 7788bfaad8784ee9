//! `rbd:POOL/IMAGE[?conf=FILE&id=NAME&keyring=FILE&timeout=SECS]`: a Ceph RBD image through
//! librbd, with a thin FFI of our own (`sys.rs`) instead of bindgen or a crate (the published
//! bindings are librados-only or unmaintained).
//!
//! librbd completes on its own threads, so this is the asynchronous kind of backend the
//! contract describes (`memthread.rs` is its model): `start` hands the operation to
//! `rbd_aio_*` and returns [`crate::Started::Async`]; librbd's completion callback posts
//! `(tag, result)` to the queue's [`crate::completions::Completions`] and bumps its eventfd;
//! the queue thread reaps. Allocation maps (`rbd_diff_iterate2`, a synchronous walk that asks
//! the OSDs) run on a helper thread of the export's and answer the same way.
//!
//! Whether librbd is there is decided at build time (build.rs sets `cfg(blkwire_rbd)`); a
//! build without it still knows the scheme and parses the spec, and refuses to open one with
//! a line saying what to install.

#[cfg(blkwire_rbd)]
mod image;

/// Waits at most `limit` for images of removed exports still closing on their own threads;
/// how many still are.
pub(crate) fn wait_for_closes(_limit: std::time::Duration) -> usize {
    #[cfg(blkwire_rbd)]
    return image::wait_for_closes(_limit);
    #[cfg(not(blkwire_rbd))]
    0
}
#[cfg(blkwire_rbd)]
mod sys;

use std::sync::Arc;

use crate::Backend;

/// What an `rbd:` export says when this build has no librbd.
#[cfg(all(feature = "rbd", not(blkwire_rbd)))]
pub(crate) const NOT_BUILT: &str =
    "this blkwire was built without librbd: apt-get install librbd-dev and rebuild";
/// What an `rbd:` export says when the `rbd` feature was turned off.
#[cfg(not(feature = "rbd"))]
pub(crate) const NOT_BUILT: &str =
    "this blkwire was built without the 'rbd' feature: rebuild with default features \
     (and librbd-dev installed)";

/// Seconds a Ceph operation may take before it fails with ETIMEDOUT, unless `timeout=` says
/// otherwise: connecting, monitor commands and every OSD operation. librados waits forever by
/// default; a block target must answer within its clients' I/O timeout (30 s for blkwire's)
/// so that a dead cluster gives I/O errors, not hangs.
pub(crate) const DEFAULT_TIMEOUT_SECS: u32 = 10;

/// An `rbd:` argument, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) pool: String,
    pub(crate) image: String,
    /// `conf=`: the ceph.conf to read; `None`: librados' search ($CEPH_CONF, /etc/ceph/ceph.conf).
    pub(crate) conf: Option<String>,
    /// `id=`: the client name, `client.` added when missing; `None`: client.admin.
    pub(crate) id: Option<String>,
    /// `keyring=`: the keyring file; `None`: the config's.
    pub(crate) keyring: Option<String>,
    pub(crate) timeout_secs: u32,
}

impl Spec {
    /// Parses `POOL/IMAGE[?key=value&...]`. Errors are one line.
    pub(crate) fn parse(arg: &str) -> Result<Spec, String> {
        let (path, query) = arg.split_once('?').unwrap_or((arg, ""));
        let (pool, image) = path
            .split_once('/')
            .ok_or_else(|| format!("rbd:{arg}: expected rbd:POOL/IMAGE"))?;
        if pool.is_empty() || image.is_empty() || image.contains('/') || image.contains('@') {
            return Err(format!(
                "rbd:{arg}: expected rbd:POOL/IMAGE (one pool, one image name; snapshots and \
                 namespaces are not supported)"
            ));
        }
        let mut spec = Spec {
            pool: pool.to_string(),
            image: image.to_string(),
            conf: None,
            id: None,
            keyring: None,
            timeout_secs: DEFAULT_TIMEOUT_SECS,
        };
        for kv in query.split('&').filter(|q| !q.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            if v.is_empty() || v.contains('\0') {
                return Err(format!("rbd: option '{kv}' needs a value"));
            }
            match k {
                "conf" => spec.conf = Some(v.to_string()),
                "id" => spec.id = Some(v.to_string()),
                "keyring" => spec.keyring = Some(v.to_string()),
                "timeout" => {
                    spec.timeout_secs = v
                        .parse()
                        .ok()
                        .filter(|s| (1..=3600).contains(s))
                        .ok_or_else(|| format!("rbd: timeout={v}: give 1 to 3600 seconds"))?
                }
                _ => {
                    return Err(format!(
                        "unknown rbd option '{k}' (known: conf=FILE, id=NAME, keyring=FILE, \
                         timeout=SECS)"
                    ))
                }
            }
        }
        Ok(spec)
    }

    /// The full client name librados wants (`client.admin`).
    #[cfg_attr(not(blkwire_rbd), allow(dead_code))]
    pub(crate) fn client_name(&self) -> String {
        match &self.id {
            Some(id) if id.starts_with("client.") => id.clone(),
            Some(id) => format!("client.{id}"),
            None => "client.admin".to_string(),
        }
    }
}

/// The registry's opener for `rbd:`.
pub(crate) fn open(arg: &str, read_only: bool) -> Result<Arc<dyn Backend>, String> {
    let spec = Spec::parse(arg)?;
    #[cfg(blkwire_rbd)]
    {
        let b = image::RbdBackend::open(&spec, read_only)?;
        Ok(Arc::new(b))
    }
    #[cfg(not(blkwire_rbd))]
    {
        let _ = (spec, read_only);
        Err(NOT_BUILT.to_string())
    }
}

/// `strerror` for a negative errno, without std's "(os error N)" tail.
#[cfg_attr(not(blkwire_rbd), allow(dead_code))]
pub(crate) fn errno_text(r: i64) -> String {
    let code = i32::try_from(r.unsigned_abs()).unwrap_or(libc::EIO);
    let s = std::io::Error::from_raw_os_error(code).to_string();
    match s.rfind(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_their_options() {
        let s = Spec::parse("rbd/disk1").unwrap();
        assert_eq!((s.pool.as_str(), s.image.as_str()), ("rbd", "disk1"));
        assert_eq!((s.conf, s.id, s.keyring), (None, None, None));
        assert_eq!(s.timeout_secs, DEFAULT_TIMEOUT_SECS);
        let s = Spec::parse("p/i?conf=/tmp/c.conf&id=bob&keyring=/k&timeout=3").unwrap();
        assert_eq!(s.conf.as_deref(), Some("/tmp/c.conf"));
        assert_eq!(s.client_name(), "client.bob");
        assert_eq!(s.keyring.as_deref(), Some("/k"));
        assert_eq!(s.timeout_secs, 3);
        let s = Spec::parse("p/i?id=client.x").unwrap();
        assert_eq!(s.client_name(), "client.x");
        assert_eq!(Spec::parse("p/i").unwrap().client_name(), "client.admin");
    }

    #[test]
    fn bad_specs_are_refused_with_one_line() {
        for bad in [
            "disk",
            "/i",
            "p/",
            "p/a/b",
            "p/i@snap",
            "p/i?conf=",
            "p/i?colour=red",
            "p/i?timeout=0",
            "p/i?timeout=x",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(!e.contains('\n') && !e.is_empty(), "{bad}: {e}");
        }
    }

    /// Runs in builds without librbd: `LIBRBD_DIR=/nonexistent cargo test -p blkwire-backend rbd`.
    #[cfg(not(blkwire_rbd))]
    #[test]
    fn without_librbd_an_rbd_export_says_what_to_install() {
        let e = open("rbd/image", false).err().unwrap();
        assert_eq!(e, NOT_BUILT);
        assert!(!e.contains('\n'));
        // The spec is still checked first: a bad one says what is wrong with it.
        assert!(open("image", false)
            .err()
            .unwrap()
            .contains("expected rbd:POOL/IMAGE"));
    }

    #[test]
    fn errno_text_has_no_os_error_tail() {
        assert_eq!(errno_text(-2), "No such file or directory");
        assert_eq!(errno_text(i64::MIN), errno_text(-(libc::EIO as i64)));
    }
}
