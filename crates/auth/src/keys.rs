//! Host identities and pre-shared key files.
//!
//! A key file holds one `host-id:hexkey` line per host (nbdkit's `--tls-psk` format, so the
//! same file serves the native handshake and NBD over TLS-PSK, and files can be concatenated).
//! Blank lines and lines starting with `#` are ignored. A key file readable or writable by
//! anyone but its owner is refused: a leaked key lets its holder act as that host.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

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

/// Checks a host id: 1 to 255 bytes of printable ASCII without spaces or `:` (the key file
/// separator), so it can be logged and written to a key file as it is.
pub fn check_host_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_HOST_ID {
        return Err(format!(
            "a host id must be 1 to {MAX_HOST_ID} characters, not {}",
            id.len()
        ));
    }
    if let Some(c) = id.chars().find(|c| !c.is_ascii_graphic() || *c == ':') {
        return Err(format!(
            "host id '{}' contains {c:?}: use letters, digits and punctuation other than ':'",
            id.escape_debug()
        ));
    }
    Ok(())
}

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

/// Host ids and their keys, from one or more key files.
#[derive(Clone, Default, Debug)]
pub struct KeyStore {
    entries: Vec<(String, Key)>,
}

impl KeyStore {
    /// Reads a key file. Errors are one line naming the file and what to do.
    pub fn load(path: &Path) -> Result<KeyStore, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("key file {shown}: {e}"))?;
        if meta.mode() & 0o077 != 0 {
            return Err(format!(
                "key file {shown} is mode {:04o}: keys must be readable by their owner only \
                 (chmod 600 {shown})",
                meta.mode() & 0o7777
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("key file {shown}: {e}"))?;
        let mut store = KeyStore::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (id, hex) = line.rsplit_once(':').ok_or_else(|| {
                format!("key file {shown} line {}: expected HOST-ID:HEXKEY", n + 1)
            })?;
            check_host_id(id).map_err(|e| format!("key file {shown} line {}: {e}", n + 1))?;
            let key =
                Key::from_hex(hex).map_err(|e| format!("key file {shown} line {}: {e}", n + 1))?;
            if store.get(id).is_some() {
                return Err(format!(
                    "key file {shown} line {}: host id '{id}' appears twice",
                    n + 1
                ));
            }
            store.entries.push((id.to_string(), key));
        }
        if store.entries.is_empty() {
            return Err(format!(
                "key file {shown} holds no keys (expected HOST-ID:HEXKEY lines; \
                 `blkwire key gen FILE` writes one)"
            ));
        }
        Ok(store)
    }

    /// The key of `host_id`.
    pub fn get(&self, host_id: &str) -> Option<&Key> {
        self.entries
            .iter()
            .find(|(id, _)| id == host_id)
            .map(|(_, k)| k)
    }

    /// The host ids known, in file order.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(id, _)| id.as_str())
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No hosts at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds a host (tests and programmatic targets).
    pub fn insert(&mut self, host_id: &str, key: Key) {
        self.entries.retain(|(id, _)| id != host_id);
        self.entries.push((host_id.to_string(), key));
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
    writeln!(f, "{host_id}:{}", key.to_hex())
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("cannot write {shown}: {e}"))?;
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
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn host_ids_are_checked_and_the_default_is_valid() {
        assert!(check_host_id("alice.example-1").is_ok());
        assert!(check_host_id("").is_err());
        assert!(check_host_id("a:b").is_err());
        assert!(check_host_id("a b").is_err());
        assert!(check_host_id("evil\nline").is_err());
        let id = default_host_id();
        check_host_id(&id).unwrap();
        assert_eq!(id, default_host_id(), "stable across calls");
    }

    #[test]
    fn keys_never_print_their_bytes() {
        let k = Key::new(&[0xab; 16]).unwrap();
        assert!(!format!("{k:?}").contains("ab"));
    }
}
