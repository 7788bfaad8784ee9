//! Host identities and pre-shared key files.
//!
//! A key file holds one line per host (blank lines and lines starting with `#` are ignored):
//!
//! - `HOST-ID:HEXKEY`: nbdkit's `--tls-psk` format, so the same file serves the native
//!   handshake and NBD over TLS-PSK, and files can be concatenated;
//! - `HOST-ID:DHHC-1:XX:BASE64: [DHHC-1:XX:BASE64:]`: the host's NVMe DH-HMAC-CHAP secret as
//!   `nvme gen-dhchap-key` prints it, optionally followed (after white space) by the
//!   controller's secret for bidirectional authentication with that host. The host secret's
//!   key bytes also serve as the host's key for blkwire's own handshake.
//! - `HOST-ID:CHAP:SECRET [TARGET-SECRET]`: the iSCSI CHAP secret (RFC 7143 §12.1.3) of the
//!   initiator named HOST-ID (its iSCSI name, which is also its CHAP_N), 16 to 64 printable
//!   characters as they are typed into the initiator's configuration, optionally followed by
//!   the target's secret for mutual CHAP. The secret's bytes also serve as the host's key.
//!
//! Host ids may contain ':' (NVMe host NQNs do: `nqn.2014-08.org.nvmexpress:uuid:...`): a
//! hex line splits at its last ':', a DH-HMAC-CHAP line at the `:DHHC-1:` that starts the
//! secret. A key file readable or writable by anyone but its owner is refused: a leaked key
//! lets its holder act as that host.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::dhchap::Secret;

/// Shortest key accepted, in bytes (128 bits).
pub const MIN_KEY: usize = 16;
/// Longest key accepted, in bytes.
pub const MAX_KEY: usize = 64;
/// Bytes in a key `blkwire key gen` writes (256 bits).
pub const GENERATED_KEY: usize = 32;
/// Longest host id (it travels as a §7 string).
pub const MAX_HOST_ID: usize = 255;

/// A pre-shared key. Its bytes are wiped when dropped and never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Vec<u8>);

impl Key {
    /// A key from raw bytes (`MIN_KEY..=MAX_KEY` of them).
    pub fn new(bytes: &[u8]) -> Result<Key, String> {
        if !(MIN_KEY..=MAX_KEY).contains(&bytes.len()) {
            return Err(format!(
                "a key must be {MIN_KEY} to {MAX_KEY} bytes ({} to {} hex digits), not {}",
                MIN_KEY * 2,
                MAX_KEY * 2,
                bytes.len()
            ));
        }
        Ok(Key(bytes.to_vec()))
    }

    /// A fresh random key of `GENERATED_KEY` bytes.
    pub fn generate() -> Key {
        let mut b = vec![0u8; GENERATED_KEY];
        crate::random(&mut b);
        Key(b)
    }

    /// The key's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Lower-case hex, as key files hold it.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_hex(s: &str) -> Result<Key, String> {
        if !s.len().is_multiple_of(2) {
            return Err("the key has an odd number of hex digits".into());
        }
        // from_str_radix takes a sign too: "+f" would be a byte of 4 bits.
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("the key is not hexadecimal".into());
        }
        let bytes = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2).unwrap_or("x"), 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| "the key is not hexadecimal".to_string())?;
        Key::new(&bytes)
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        // Volatile writes so the wipe is not optimised away.
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference into our own buffer.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} bytes)", self.0.len())
    }
}

/// Checks a host id: 1 to 255 bytes of printable ASCII without spaces, so it can be logged
/// and written to a key file as it is. ':' is allowed (NVMe host NQNs hold several); only
/// what starts a secret on a key file line is not (`DHHC-1:`, `:CHAP:`), nor an ending that
/// makes one with the ':' after the id (`alice:CHAP` + `:HEX` read back as alice's CHAP line).
pub fn check_host_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_HOST_ID {
        return Err(format!(
            "a host id must be 1 to {MAX_HOST_ID} characters, not {}",
            id.len()
        ));
    }
    if let Some(c) = id.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "host id '{}' contains {c:?}: use printable ASCII without spaces",
            id.escape_debug()
        ));
    }
    if id.starts_with(DHHC_PREFIX) || id.contains(DHHC_SEPARATOR) {
        return Err(format!(
            "host id '{}' contains '{DHHC_PREFIX}', which starts a secret in key files",
            id.escape_debug()
        ));
    }
    if id.contains(CHAP_SEPARATOR) {
        return Err(format!(
            "host id '{}' contains '{CHAP_SEPARATOR}', which starts a CHAP secret in key files",
            id.escape_debug()
        ));
    }
    // `DHHC-1:HEX` reads as a secret without a host id, `#...` as a comment.
    if id == "DHHC-1" || id.starts_with('#') {
        return Err(format!(
            "host id '{}' would not read back from a key file: pick another id",
            id.escape_debug()
        ));
    }
    for (end, what) in [
        (":CHAP", "a CHAP secret"),
        (":DHHC-1", "a DH-HMAC-CHAP secret"),
    ] {
        if id.ends_with(end) {
            return Err(format!(
                "host id '{}' ends in '{end}', which would start {what} in key files: pick \
                 another id",
                id.escape_debug()
            ));
        }
    }
    Ok(())
}

/// Where a CHAP line's host id ends.
const CHAP_SEPARATOR: &str = ":CHAP:";

/// Parses the part of a key file line after `HOST-ID:CHAP:`: the initiator's CHAP secret,
/// then optionally the target's (mutual CHAP). Secrets are printable ASCII without spaces,
/// as long as keys (RFC 7143 §12.1.3 asks for at least 96 bits; keys here are 128 or more).
fn parse_chap(text: &str) -> Result<(Key, ChapSecrets), String> {
    let mut words = text.split_whitespace();
    let check = |w: &str, what: &str| -> Result<Vec<u8>, String> {
        if !(MIN_KEY..=MAX_KEY).contains(&w.len()) || !w.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{what} CHAP secret must be {MIN_KEY} to {MAX_KEY} printable characters, not {}",
                w.len()
            ));
        }
        Ok(w.as_bytes().to_vec())
    };
    let host = check(words.next().unwrap_or_default(), "the initiator's")?;
    let target = words.next().map(|w| check(w, "the target's")).transpose()?;
    if target.as_ref() == Some(&host) {
        // RFC 7143 §12.1.3: the two directions must not share a secret.
        return Err("the target's CHAP secret must differ from the initiator's".into());
    }
    if words.next().is_some() {
        return Err(
            "expected at most two CHAP secrets (the initiator's, then the target's)".into(),
        );
    }
    Ok((Key::new(&host)?, (host, target)))
}

/// An initiator's CHAP secret and, for mutual CHAP, the target's.
type ChapSecrets = (Vec<u8>, Option<Vec<u8>>);

/// What starts a DH-HMAC-CHAP secret.
const DHHC_PREFIX: &str = "DHHC-1:";
/// Where a DH-HMAC-CHAP line's host id ends.
const DHHC_SEPARATOR: &str = ":DHHC-1:";

/// This machine's host id: `blkwire-` and 16 hex digits of a hash of /etc/machine-id (the
/// machine id itself is not exposed, as systemd asks of applications), or the host name where
/// there is no machine id.
pub fn default_host_id() -> String {
    let id = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    let id = id.trim();
    if id.is_empty() {
        let name = hostname();
        if check_host_id(&name).is_ok() {
            return name;
        }
        return "blkwire-host".into();
    }
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"blkwire host id\0");
    ctx.update(id.as_bytes());
    let d = ctx.finish();
    let hex: String = d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("blkwire-{hex}")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// One host's credentials.
#[derive(Clone, Debug)]
struct Entry {
    id: String,
    /// The key of blkwire's own handshake and TLS-PSK.
    key: Key,
    /// The host's DH-HMAC-CHAP secret (a hex key as `DHHC-1:00:`, no transformation).
    host_secret: Secret,
    /// The controller's DH-HMAC-CHAP secret for bidirectional authentication.
    ctrl_secret: Option<Secret>,
    /// The iSCSI CHAP secrets: the initiator's, and the target's for mutual CHAP.
    chap: Option<ChapSecrets>,
}

/// Host ids and their keys, from one or more key files.
#[derive(Clone, Default, Debug)]
pub struct KeyStore {
    entries: Vec<Entry>,
}

/// Parses the part of a key file line after `HOST-ID:` that starts with `DHHC-1:`: the
/// host's secret, then optionally the controller's.
fn parse_dhchap(text: &str) -> Result<(Key, Secret, Option<Secret>), String> {
    let mut words = text.split_whitespace();
    let host = words.next().unwrap_or_default();
    let host = Secret::parse(host).map_err(|e| format!("host secret: {e}"))?;
    let ctrl = words
        .next()
        .map(|w| Secret::parse(w).map_err(|e| format!("controller secret: {e}")))
        .transpose()?;
    if words.next().is_some() {
        return Err("expected at most two secrets (the host's, then the controller's)".into());
    }
    let key = Key::new(host.bytes()).map_err(|e| format!("host secret: {e}"))?;
    Ok((key, host, ctrl))
}

/// The largest key file read: 4 MiB, tens of thousands of hosts (a line is 80 to 250 bytes).
pub const MAX_KEY_FILE: u64 = 4 << 20;

/// Reads a whole regular file of at most `max` bytes as text, with its metadata (of the file
/// opened, not of whatever the path names a moment later). Anything else is refused before a
/// byte is read: a FIFO (which would block the reader until someone writes, and is opened
/// without waiting for a writer), a device such as /dev/zero (which never ends), a directory;
/// so is a longer file. Errors are one line without the path (the caller names the file).
pub fn read_regular(path: &Path, max: u64) -> Result<(String, std::fs::Metadata), String> {
    use std::io::Read;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    let too_long = || {
        format!(
            "larger than {} MiB, the most read: is it the right file?",
            max >> 20
        )
    };
    if !meta.is_file() {
        return Err(
            "not a regular file (a FIFO, a device or a directory): give a file's path".into(),
        );
    }
    if meta.len() > max {
        return Err(too_long());
    }
    // Bounded by the read too: the file may grow meanwhile (and some report no size).
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > max {
        return Err(too_long());
    }
    let text = String::from_utf8(bytes).map_err(|_| "not text (invalid UTF-8)".to_string())?;
    Ok((text, meta))
}

impl KeyStore {
    /// Reads a key file (a regular file of at most `MAX_KEY_FILE` bytes). Errors are one line
    /// naming the file and what to do.
    pub fn load(path: &Path) -> Result<KeyStore, String> {
        Self::load_checked(path, false)
    }

    /// [`KeyStore::load`] for a target's key store, which also must belong to root or to the
    /// user that reads it (as sshd asks of its authorized keys): whoever owns the file decides
    /// which hosts exist. Not an initiator's own key: `sudo blkwire map --key ~/me.key` reads
    /// a file its user owns.
    pub fn load_owned(path: &Path) -> Result<KeyStore, String> {
        Self::load_checked(path, true)
    }

    fn load_checked(path: &Path, owned: bool) -> Result<KeyStore, String> {
        let shown = path.display();
        let (text, meta) =
            read_regular(path, MAX_KEY_FILE).map_err(|e| format!("key file {shown}: {e}"))?;
        if meta.mode() & 0o077 != 0 {
            return Err(format!(
                "key file {shown} is mode {:04o}: keys must be readable by their owner only \
                 (chmod 600 {shown})",
                meta.mode() & 0o7777
            ));
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if owned && meta.uid() != 0 && meta.uid() != me {
            return Err(format!(
                "key file {shown} is owned by uid {}: keys must belong to root or to the user \
                 that reads them (uid {me}; chown {me} {shown})",
                meta.uid()
            ));
        }
        let mut store = KeyStore::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |e: String| format!("key file {shown} line {}: {e}", n + 1);
            let mut chap = None;
            // Neither separator can be in a host id: the first on the line ends it (a CHAP
            // secret may hold ":DHHC-1:").
            let dhhc = line.find(DHHC_SEPARATOR);
            let chap_at = line.find(CHAP_SEPARATOR);
            let (id, key, host_secret, ctrl_secret) = if let Some(i) =
                dhhc.filter(|&d| chap_at.is_none_or(|c| d < c))
            {
                let id = &line[..i];
                check_host_id(id).map_err(at)?;
                let (key, host, ctrl) = parse_dhchap(&line[i + 1..]).map_err(at)?;
                (id, key, host, ctrl)
            } else if let Some(i) = chap_at {
                let id = &line[..i];
                check_host_id(id).map_err(at)?;
                let (key, secrets) = parse_chap(&line[i + CHAP_SEPARATOR.len()..]).map_err(at)?;
                chap = Some(secrets);
                let secret = Secret::from_key(&key);
                (id, key, secret, None)
            } else {
                let (id, hex) = line.rsplit_once(':').ok_or_else(|| {
                    at("expected HOST-ID:HEXKEY or HOST-ID:DHHC-1:XX:BASE64:".into())
                })?;
                if line.starts_with(DHHC_PREFIX) {
                    return Err(at("a secret without a host id before it \
                                       (expected HOST-ID:DHHC-1:XX:BASE64:)"
                        .into()));
                }
                // Not quoted: `id` is all before the line's last ':', which on a mistyped line
                // (a space for the ':' before DHHC-1:, or before CHAP: and a secret holding
                // ':') holds the secret or part of it.
                check_host_id(id).map_err(|_| {
                    at(
                        "what precedes the last ':' is not a host id (1 to 255 printable \
                        ASCII characters without spaces); expected HOST-ID:HEXKEY, \
                        HOST-ID:DHHC-1:XX:BASE64: or HOST-ID:CHAP:SECRET"
                            .into(),
                    )
                })?;
                let key = Key::from_hex(hex).map_err(at)?;
                let host = Secret::from_key(&key);
                (id, key, host, None)
            };
            if store.get(id).is_some() {
                return Err(at(format!("host id '{id}' appears twice")));
            }
            if let Some(secrets) = &chap {
                store
                    .chap_secrets_apart(id, secrets)
                    .map_err(|e| at(e.to_string()))?;
            }
            store.entries.push(Entry {
                id: id.to_string(),
                key,
                host_secret,
                ctrl_secret,
                chap,
            });
        }
        if store.entries.is_empty() {
            return Err(format!(
                "key file {shown} holds no keys (expected HOST-ID:HEXKEY, \
                 HOST-ID:DHHC-1:XX:BASE64: or HOST-ID:CHAP:SECRET lines; `blkwire key gen FILE` \
                 writes one)"
            ));
        }
        Ok(store)
    }

    fn entry(&self, host_id: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.id == host_id)
    }

    /// The key of `host_id` (for a DH-HMAC-CHAP line, the host secret's key bytes).
    pub fn get(&self, host_id: &str) -> Option<&Key> {
        self.entry(host_id).map(|e| &e.key)
    }

    /// The DH-HMAC-CHAP secret of `host_id` (NVMe host NQN), for
    /// [`ControllerAuth::new`](crate::dhchap::ControllerAuth::new): the `DHHC-1` secret of its
    /// line, or its hex key used as `DHHC-1:00:` (no transformation). None: an unknown host,
    /// which must not be let in.
    pub fn host_secret(&self, host_id: &str) -> Option<&Secret> {
        self.entry(host_id).map(|e| &e.host_secret)
    }

    /// The controller's DH-HMAC-CHAP secret towards `host_id`, for bidirectional
    /// authentication (the second secret of its line), if there is one.
    pub fn ctrl_secret(&self, host_id: &str) -> Option<&Secret> {
        self.entry(host_id).and_then(|e| e.ctrl_secret.as_ref())
    }

    /// The iSCSI CHAP secrets of `host_id` (an initiator name): the initiator's, and the
    /// target's for mutual CHAP. None: the host has no CHAP line.
    pub fn chap(&self, host_id: &str) -> Option<(&[u8], Option<&[u8]>)> {
        let (i, t) = self.entry(host_id)?.chap.as_ref()?;
        Some((i.as_slice(), t.as_deref()))
    }

    /// Adds an iSCSI initiator by its CHAP secrets (tests and programmatic targets).
    pub fn insert_chap(
        &mut self,
        host_id: &str,
        secret: &[u8],
        target: Option<&[u8]>,
    ) -> Result<(), String> {
        let key = Key::new(secret)?;
        let secrets = (secret.to_vec(), target.map(<[u8]>::to_vec));
        // Checked before the host's old entry goes: refused, it keeps it.
        self.chap_secrets_apart(host_id, &secrets)?;
        self.entries.retain(|e| e.id != host_id);
        self.entries.push(Entry {
            id: host_id.to_string(),
            host_secret: Secret::from_key(&key),
            key,
            ctrl_secret: None,
            chap: Some(secrets),
        });
        Ok(())
    }

    /// Checks a new CHAP line's secrets against the lines before it: an initiator's secret
    /// may be no other line's (initiator's or target's), and a target's secret no initiator's
    /// (RFC 7143 §9.2.1). CHAP's answer covers only the identifier, the secret and the
    /// challenge, so a host whose own mutual-CHAP login has the target answer a challenge
    /// with a secret that is another host's would get that host's answer and log in as it.
    /// Errors name the other line's host, never a secret.
    fn chap_secrets_apart(&self, id: &str, (host, target): &ChapSecrets) -> Result<(), String> {
        // The host's own entry, which a new one replaces, is not another's.
        for e in self.entries.iter().filter(|e| e.id != id) {
            let Some((h, t)) = &e.chap else { continue };
            let other = &e.id;
            if h == host {
                return Err(format!(
                    "host '{id}' has the CHAP secret of host '{other}': each initiator's \
                     secret must be its own"
                ));
            }
            if t.as_ref() == Some(host) || target.as_ref() == Some(h) {
                return Err(format!(
                    "hosts '{id}' and '{other}' share a secret as initiator and as target: \
                     an initiator's CHAP secret may not serve as a target's (RFC 7143 §9.2.1)"
                ));
            }
        }
        Ok(())
    }

    /// The host ids known, in file order.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.id.as_str())
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No hosts at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds a host (tests and programmatic targets); its key doubles as its DH-HMAC-CHAP
    /// secret without transformation.
    pub fn insert(&mut self, host_id: &str, key: Key) {
        let host_secret = Secret::from_key(&key);
        self.entries.retain(|e| e.id != host_id);
        self.entries.push(Entry {
            id: host_id.to_string(),
            key,
            host_secret,
            ctrl_secret: None,
            chap: None,
        });
    }

    /// Adds a host by its DH-HMAC-CHAP secrets (tests and programmatic targets); the host
    /// secret's key bytes become its key. Fails if they are out of [`MIN_KEY`]..=[`MAX_KEY`].
    pub fn insert_dhchap(
        &mut self,
        host_id: &str,
        host_secret: Secret,
        ctrl_secret: Option<Secret>,
    ) -> Result<(), String> {
        let key = Key::new(host_secret.bytes())?;
        self.entries.retain(|e| e.id != host_id);
        self.entries.push(Entry {
            id: host_id.to_string(),
            key,
            host_secret,
            ctrl_secret,
            chap: None,
        });
        Ok(())
    }
}

/// Writes a new key file holding one random key for `host_id`, created with mode 0600. An
/// existing file is never overwritten.
pub fn generate_file(path: &Path, host_id: &str) -> Result<Key, String> {
    check_host_id(host_id)?;
    let shown = path.display();
    let key = Key::generate();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => format!(
                "{shown} already exists: pick another name, or remove it first (its key would be lost)"
            ),
            _ => format!("cannot create {shown}: {e}"),
        })?;
    if let Err(e) = writeln!(f, "{host_id}:{}", key.to_hex()).and_then(|_| f.sync_all()) {
        // Left behind, the empty or cut file would be refused as existing next time, as if
        // it held a key.
        drop(f);
        let _ = std::fs::remove_file(path);
        return Err(format!("cannot write {shown}: {e}"));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("blkwire-keys-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    /// Only a regular file of bounded size is read: a FIFO (0600, as a key file must be)
    /// would block the reader until someone writes, forever if nobody does; /dev/zero never
    /// ends; a huge file fills memory. Each is refused in one line, at once.
    #[test]
    fn only_a_regular_file_of_bounded_size_is_read() {
        let fifo = tmp("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let big = tmp("big");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_KEY_FILE + 1).unwrap();
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        for p in [
            fifo.clone(),
            "/dev/zero".into(),
            std::env::temp_dir(),
            big.clone(),
        ] {
            let tx = tx.clone();
            // On a thread: a reader that blocks must fail the test, not hang it.
            std::thread::spawn(move || tx.send((KeyStore::load(&p).err(), p)));
        }
        for _ in 0..4 {
            let (e, p) = rx
                .recv_timeout(std::time::Duration::from_secs(20))
                .expect("answered");
            let e = e.unwrap_or_else(|| panic!("{} loaded", p.display()));
            let why = if p == big {
                "larger than 4 MiB, the most read: is it the right file?"
            } else {
                "not a regular file (a FIFO, a device or a directory): give a file's path"
            };
            assert_eq!(e, format!("key file {}: {why}", p.display()));
        }
        std::fs::remove_file(&fifo).unwrap();
        std::fs::remove_file(&big).unwrap();
    }

    /// Hex digits only: a sign is no digit ("+f" parsed as a byte of 4 bits, so a key of 32
    /// such pairs carried 64 bits, not 128).
    #[test]
    fn a_hex_key_is_hex_digits_only() {
        assert!(Key::from_hex(&"0f".repeat(16)).is_ok());
        for bad in ["+f".repeat(16), "-f".repeat(16), " f".repeat(16)] {
            assert_eq!(
                Key::from_hex(&bad).err().as_deref(),
                Some("the key is not hexadecimal"),
                "{bad}"
            );
        }
    }

    #[test]
    fn generated_files_load_back_and_are_private() {
        let p = tmp("gen");
        let k = generate_file(&p, "alice").unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let store = KeyStore::load(&p).unwrap();
        assert_eq!(store.get("alice"), Some(&k));
        assert_eq!(store.get("bob"), None);
        let again = generate_file(&p, "alice").unwrap_err();
        assert!(again.contains("already exists"), "{again}");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn files_others_can_read_are_refused() {
        let p = tmp("open");
        generate_file(&p, "alice").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = KeyStore::load(&p).unwrap_err();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }

    /// A key file another user owns decides which hosts exist: refused (root runs this in
    /// CI; giving the file away needs it).
    #[test]
    fn files_another_user_owns_are_refused() {
        let p = tmp("owner");
        generate_file(&p, "alice").unwrap();
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: chown of our own file by a NUL-terminated path.
        let r = unsafe { libc::chown(c.as_ptr(), 65534, 65534) };
        assert_eq!(
            r,
            0,
            "chown to nobody: {} (this test needs root)",
            std::io::Error::last_os_error()
        );
        let e = KeyStore::load_owned(&p).unwrap_err();
        assert!(
            e.contains("owned by uid 65534") && e.contains("chown"),
            "{e}"
        );
        // An initiator's own key may be its user's, read by root (sudo).
        assert!(KeyStore::load(&p).is_ok());
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let p = tmp("bad");
        let write = |text: &str| {
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            KeyStore::load(&p)
        };
        let good = "00112233445566778899aabbccddeeff";
        assert!(write(&format!("# hosts\n\nalice:{good}\nbob:{good}\n")).is_ok());
        let e = write(&format!("alice:{good}\nbob {good}\n")).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = write("alice:0011\n").unwrap_err();
        assert!(e.contains("16 to 64 bytes"), "{e}");
        let e = write(&format!("alice:{}zz\n", &good[2..])).unwrap_err();
        assert!(e.contains("not hexadecimal"), "{e}");
        let e = write(&format!("alice:{good}\nalice:{good}\n")).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = write("\n# nothing\n").unwrap_err();
        assert!(e.contains("no keys"), "{e}");
        // A space where the ':' before the secret belongs: the error says so without quoting
        // the secret (which then sits in what would be the host id).
        for line in [
            format!("alice {SPEC}"),
            "alice CHAP:secret:of-sixteen-chars".to_string(),
        ] {
            let e = write(&format!("{line}\n")).unwrap_err();
            assert!(e.contains("line 1") && e.contains("not a host id"), "{e}");
            assert!(!e.contains("ia6z") && !e.contains("CHAP:secret"), "{e}");
        }
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn host_ids_are_checked_and_the_default_is_valid() {
        assert!(check_host_id("alice.example-1").is_ok());
        assert!(check_host_id("").is_err());
        // NVMe host NQNs hold ':'.
        assert!(check_host_id("a:b").is_ok());
        assert!(check_host_id(NQN).is_ok());
        assert!(check_host_id("a:DHHC-1:b").is_err());
        assert!(check_host_id("DHHC-1:00").is_err());
        assert!(check_host_id(&"x".repeat(255)).is_ok());
        assert!(check_host_id(&"x".repeat(256)).is_err());
        assert!(check_host_id("a\tb").is_err());
        assert!(check_host_id("a b").is_err());
        assert!(check_host_id("evil\nline").is_err());
        // `alice:CHAP` with `:HEX` after it read back as alice's CHAP line (another host).
        for id in ["alice:CHAP", "alice:DHHC-1", "DHHC-1", "#alice"] {
            assert!(check_host_id(id).is_err(), "{id}");
            let p = tmp(&format!("ends-{}", id.len()));
            assert!(generate_file(&p, id).is_err(), "{id}");
            assert!(!p.exists());
        }
        let id = default_host_id();
        check_host_id(&id).unwrap();
        assert_eq!(id, default_host_id(), "stable across calls");
    }

    const NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-a0c9a2ab1b2c";
    /// The NVMe specification's example secret; its key is 89aeb31a...1e07594c.
    const SPEC: &str = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:";

    fn load_text(name: &str, text: &str) -> Result<KeyStore, String> {
        let p = tmp(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let r = KeyStore::load(&p);
        std::fs::remove_file(&p).unwrap();
        r
    }

    #[test]
    fn nqn_host_ids_and_dhchap_secrets_load() {
        let good = "00112233445566778899aabbccddeeff";
        let ctrl = SPEC.replace(":00:", ":03:");
        let text = format!(
            "# old and new lines mix\n\
             alice:{good}\n\
             {NQN}:{good}\n\
             {NQN}-2:{SPEC}\n\
             {NQN}-3:{SPEC}  \t{ctrl}\n"
        );
        let store = load_text("nqn", &text).unwrap();
        assert_eq!(store.len(), 4);
        assert_eq!(store.get(NQN).unwrap().to_hex(), good);
        // A hex key is a DHHC-1:00 secret: no transformation.
        let s = store.host_secret(NQN).unwrap();
        assert_eq!(s.bytes(), store.get(NQN).unwrap().bytes());
        assert_eq!(s.transformation(), None);
        assert!(store.ctrl_secret(NQN).is_none());
        let id2 = format!("{NQN}-2");
        assert_eq!(
            store.get(&id2).unwrap().to_hex(),
            "89aeb31a874eaf84841b46736b0dfdf2ba58d30aa2a545a3e235a3521e07594c"
        );
        assert_eq!(store.host_secret(&id2).unwrap().to_dhhc().unwrap(), SPEC);
        assert!(store.ctrl_secret(&id2).is_none());
        let id3 = format!("{NQN}-3");
        assert_eq!(store.ctrl_secret(&id3).unwrap().to_dhhc().unwrap(), ctrl);
        assert_eq!(
            store.ctrl_secret(&id3).unwrap().transformation(),
            Some(crate::dhchap::HashId::Sha512)
        );
        assert!(store.host_secret("nobody").is_none());
        assert_eq!(
            store.hosts().collect::<Vec<_>>(),
            ["alice", NQN, id2.as_str(), id3.as_str()]
        );
        // A generated file for an NQN loads back.
        let p = tmp("gen-nqn");
        let k = generate_file(&p, NQN).unwrap();
        assert_eq!(KeyStore::load(&p).unwrap().get(NQN), Some(&k));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn iscsi_chap_lines_load_and_bad_ones_are_named() {
        const IQN: &str = "iqn.2005-03.org.open-iscsi:abc";
        let text = format!(
            "{IQN}:CHAP:initiator-secret-1\n\
             {IQN}2:CHAP:initiator-secret-2  target-secret-22\n"
        );
        let store = load_text("chap", &text).unwrap();
        assert_eq!(store.chap(IQN), Some((&b"initiator-secret-1"[..], None)));
        let two = format!("{IQN}2");
        assert_eq!(
            store.chap(&two),
            Some((&b"initiator-secret-2"[..], Some(&b"target-secret-22"[..])))
        );
        assert_eq!(store.get(IQN).unwrap().bytes(), b"initiator-secret-1");
        assert!(store.chap("nobody").is_none());
        for (line, want) in [
            (format!("{IQN}:CHAP:short\n"), "16 to 64 printable"),
            (
                format!("{IQN}:CHAP:same-secret-here same-secret-here\n"),
                "must differ",
            ),
            (
                format!("{IQN}:CHAP:aaaaaaaaaaaaaaaa bbbbbbbbbbbbbbbb c\n"),
                "at most two",
            ),
        ] {
            let e = load_text("chap-bad", &line).unwrap_err();
            assert!(e.contains("line 1") && e.contains(want), "{e}");
        }
        assert!(check_host_id("a:CHAP:b").is_err());
    }

    /// An initiator's CHAP secret that is another line's (initiator's or target's) is refused,
    /// naming the lines and hosts, not the secret: a host whose mutual-CHAP login has the
    /// target answer the challenge of another host's login would log in as that host.
    #[test]
    fn chap_secrets_shared_between_lines_are_refused() {
        for (text, want) in [
            (
                "iqn.a:CHAP:alice-secret-0001 shared-target-01\niqn.b:CHAP:shared-target-01\n",
                "line 2: hosts 'iqn.b' and 'iqn.a' share a secret as initiator and as target",
            ),
            (
                "iqn.b:CHAP:shared-target-01\niqn.a:CHAP:alice-secret-0001 shared-target-01\n",
                "line 2: hosts 'iqn.a' and 'iqn.b' share a secret",
            ),
            (
                "iqn.a:CHAP:alice-secret-0001\niqn.b:CHAP:alice-secret-0001\n",
                "line 2: host 'iqn.b' has the CHAP secret of host 'iqn.a'",
            ),
        ] {
            let e = load_text("chap-shared", text).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(
                !e.contains("-secret-0001") && !e.contains("shared-target"),
                "{e}"
            );
        }
        // One target secret for several initiators is common and not refused.
        load_text(
            "chap-target",
            "iqn.a:CHAP:alice-secret-0001 target-secret-01\n\
             iqn.b:CHAP:bobby-secret-0001 target-secret-01\n",
        )
        .unwrap();
        let mut store = KeyStore::default();
        store
            .insert_chap("iqn.a", b"alice-secret-0001", Some(b"target-secret-01"))
            .unwrap();
        let e = store
            .insert_chap("iqn.b", b"target-secret-01", None)
            .unwrap_err();
        assert!(e.contains("share a secret"), "{e}");
        assert!(store.chap("iqn.b").is_none());
        // Refused, a host keeps the entry it had; its own secrets again are no clash.
        store
            .insert_chap("iqn.b", b"bobby-secret-0001", None)
            .unwrap();
        assert!(store
            .insert_chap("iqn.b", b"target-secret-01", None)
            .is_err());
        assert_eq!(store.chap("iqn.b"), Some((&b"bobby-secret-0001"[..], None)));
        store
            .insert_chap("iqn.b", b"bobby-secret-0001", None)
            .unwrap();
    }

    /// A CHAP secret may hold ":DHHC-1:": the line is a CHAP line (its first separator), and
    /// loads.
    #[test]
    fn a_chap_secret_holding_the_dhchap_separator_loads() {
        let store = load_text("chap-dhhc", "iqn.x:CHAP:ab:DHHC-1:cdefghijklmn\n").unwrap();
        assert_eq!(
            store.chap("iqn.x"),
            Some((&b"ab:DHHC-1:cdefghijklmn"[..], None))
        );
    }

    #[test]
    fn bad_dhchap_lines_name_file_line_and_secret() {
        let flipped = SPEC.replacen("ia6zG", "ia6zH", 1);
        let cases = [
            (
                format!("a:{SPEC}\n{NQN}:{flipped}\n"),
                "line 2: host secret: the DH-HMAC-CHAP secret's CRC-32",
            ),
            (
                format!("{NQN}:{SPEC} {flipped}\n"),
                "line 1: controller secret: the DH-HMAC-CHAP secret's CRC-32",
            ),
            (
                format!("{NQN}:{SPEC} {SPEC} {SPEC}\n"),
                "at most two secrets",
            ),
            (
                format!("{NQN}:DHHC-1:07:abcd:\n"),
                "line 1: host secret: DH-HMAC-CHAP secret transformation '07'",
            ),
            (format!("{SPEC}\n"), "without a host id"),
            (format!("{NQN}:{SPEC}\n{NQN}:{SPEC}\n"), "line 2: host id"),
            (
                format!("{NQN} x:{SPEC}\n"),
                "printable ASCII without spaces",
            ),
        ];
        for (text, want) in cases {
            let e = load_text("bad-dhchap", &text).unwrap_err();
            assert!(e.contains("key file ") && e.contains(want), "{text:?}: {e}");
            assert!(!e.contains('\n') && !e.contains("ia6z"), "{e}");
        }
    }

    #[test]
    fn inserted_hosts_have_secrets() {
        let mut store = KeyStore::default();
        store.insert(NQN, Key::new(&[7; 32]).unwrap());
        assert_eq!(store.host_secret(NQN).unwrap().bytes(), &[7; 32]);
        let s = crate::dhchap::Secret::parse(SPEC).unwrap();
        store
            .insert_dhchap("h2", s.clone(), Some(s.clone()))
            .unwrap();
        assert_eq!(store.get("h2").unwrap().bytes(), s.bytes());
        assert_eq!(store.ctrl_secret("h2"), Some(&s));
    }

    #[test]
    fn keys_never_print_their_bytes() {
        let k = Key::new(&[0xab; 16]).unwrap();
        assert!(!format!("{k:?}").contains("ab"));
    }
}
