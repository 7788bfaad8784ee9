//! Mapping records: one JSON file per device in `<run dir>/devices/`, written by the daemon that
//! serves it. A record never claims a mapping is alive by itself: it stores the daemon's pid and
//! its start time from /proc/PID/stat, and every reader checks both (a reused pid has another
//! start time), so `ls` cannot show a dead daemon as running.
//!
//! The run directory is /run/blkwire (tmpfs: records vanish at reboot together with the loop
//! devices and mounts they describe). BLKWIRE_RUN_DIR overrides it, so tests and independent
//! instances do not see each other's mappings.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use blkwire_wire::QueueRef;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where records and mounts live: /run/blkwire, or `BLKWIRE_RUN_DIR`.
pub fn run_dir() -> PathBuf {
    std::env::var_os("BLKWIRE_RUN_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/blkwire"))
}

/// One record per mapped device.
pub fn devices_dir() -> PathBuf {
    run_dir().join("devices")
}

/// Where the daemons mount their FUSE filesystems, one directory per daemon.
pub fn mounts_dir() -> PathBuf {
    run_dir().join("mnt")
}

/// Creates the run directories, private to root: the FUSE files in them give raw access to
/// the exports.
pub fn ensure_dirs() -> io::Result<()> {
    for d in [run_dir(), devices_dir(), mounts_dir()] {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&d)?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Everything needed to list, unmap or recover a mapping.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    /// The block device: `/dev/loop3`, `/dev/ublkb0`.
    pub device: String,
    /// The export's URL, as mapped.
    pub url: String,
    /// The export's name.
    pub export: String,
    /// The kind of device: "fuse" or "ublk".
    pub frontend: String,
    /// The daemon serving the device.
    pub pid: i32,
    /// Field 22 of /proc/PID/stat (clock ticks after boot) when the record was written.
    pub start_time: u64,
    /// The daemon's FUSE mount and the file in it that the device is bound to (fuse only).
    pub mountpoint: String,
    /// See `mountpoint`.
    pub file: String,
    /// Size of the export in bytes.
    pub size: u64,
    /// The device is read-only (asked for, or the export is).
    pub readonly: bool,
    /// Queues (worker threads, one connection each).
    pub queues: u16,
    /// Requests in flight per queue, as the target granted.
    pub queue_depth: u16,
    /// Largest I/O in bytes the device hands over.
    pub max_io: u32,
    /// `--timeout`: how long I/O waits for an unreachable target.
    pub timeout_secs: u64,
    /// `--hdd`: the device is marked rotational.
    pub hdd: bool,
    /// `--logfile` of the daemon, if any.
    pub logfile: Option<String>,
    /// fuse frontend: "uring" (FUSE over io_uring) or "read" (read/writev on /dev/fuse).
    /// Absent in records of older versions and of ublk mappings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuse_io: Option<String>,
    /// How the session proves who it is (records of older versions have none of it).
    #[serde(flatten)]
    pub credentials: RecordedCredentials,
    /// ublk: entry i names the target's queue that device queue i was last served by (None: a
    /// queue with no identity, NVMe/TCP), so that `map --recover` can fence the dead daemon's
    /// writes still running on the target (PROTOCOL.md §2.6) before sending any of its own.
    /// Written before a queue's session is used. None in records of older versions and of fuse
    /// mappings (which recover only read-only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_refs: Option<Vec<Option<RecordedQueue>>>,
    /// ublk: whether the kernel was told the device has a volatile write cache
    /// (UBLK_ATTR_VOLATILE_CACHE) when it was made, which a recovery keeps (it sets no
    /// parameters). None in records of older versions (the device's queue's `write_cache`
    /// tells then) and of fuse mappings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volatile_cache: Option<bool>,
}

/// A queue of a session on the target, as a record keeps it ([`QueueRef`]). The cookie is a hex
/// string: JSON readers that hold numbers as doubles would lose its low bits.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RecordedQueue {
    /// The session's id.
    pub session: u32,
    /// The queue's index in it.
    pub queue: u16,
    /// The session's cookie, as 16 hex digits.
    #[serde(serialize_with = "hex_u64", deserialize_with = "u64_from_hex")]
    pub cookie: u64,
}

fn hex_u64<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:016x}"))
}

fn u64_from_hex<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let s = String::deserialize(d)?;
    u64::from_str_radix(&s, 16).map_err(|e| serde::de::Error::custom(format!("cookie '{s}': {e}")))
}

impl From<QueueRef> for RecordedQueue {
    fn from(r: QueueRef) -> Self {
        RecordedQueue {
            session: r.session,
            queue: r.queue,
            cookie: r.cookie,
        }
    }
}

impl From<RecordedQueue> for QueueRef {
    fn from(r: RecordedQueue) -> Self {
        QueueRef {
            session: r.session,
            queue: r.queue,
            cookie: r.cookie,
        }
    }
}

/// A mapping's `--host-id`, `--key`, `--encrypt`, `--tls` and `--tls-ca`, as recorded so that
/// `map --recover` reconnects as the mapping did: file paths, never a key.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RecordedCredentials {
    /// `--host-id`, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_id: Option<String>,
    /// `--key`: the key file's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
    /// `--encrypt`.
    #[serde(default)]
    pub encrypt: bool,
    /// `--tls`.
    #[serde(default)]
    pub tls: bool,
    /// `--tls-ca`: the CA file's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<String>,
}

impl From<&blkwire_client::Credentials> for RecordedCredentials {
    fn from(c: &blkwire_client::Credentials) -> Self {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        RecordedCredentials {
            host_id: c.host_id.clone(),
            key_file: path(&c.key_file),
            encrypt: c.encrypt,
            tls: c.tls,
            tls_ca: path(&c.tls_ca),
        }
    }
}

impl From<&RecordedCredentials> for blkwire_client::Credentials {
    fn from(r: &RecordedCredentials) -> Self {
        blkwire_client::Credentials {
            host_id: r.host_id.clone(),
            key_file: r.key_file.clone().map(Into::into),
            encrypt: r.encrypt,
            tls: r.tls,
            tls_ca: r.tls_ca.clone().map(Into::into),
        }
    }
}

/// What a reader concludes about a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Its daemon is alive.
    Running,
    /// Its daemon is gone: `map --recover` or `unmap` finish it.
    Dead,
    /// Its daemon is gone and so is its device: the kernel has none under the number, or
    /// another one (ublk: its number was reused after ours was deleted). Nothing to recover;
    /// `unmap` removes the record and leaves any other device alone.
    Stale,
}

impl Liveness {
    /// How `ls` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            Liveness::Running => "running",
            Liveness::Dead => "dead",
            Liveness::Stale => "stale",
        }
    }
}

fn record_path_in(dir: &Path, dev_name: &str) -> PathBuf {
    dir.join(format!("{dev_name}.json"))
}

fn dev_name(device: &str) -> &str {
    device.strip_prefix("/dev/").unwrap_or(device)
}

impl Record {
    /// A writable ublk record of `queues` queues for tests (of this crate's modules), naming no
    /// target queues; each test sets what it looks at.
    #[cfg(test)]
    pub(crate) fn sample(queues: u16) -> Record {
        Record {
            device: "/dev/ublkb3".into(),
            url: "tcp://127.0.0.1:1/d".into(),
            export: "d".into(),
            frontend: "ublk".into(),
            pid: 4242,
            start_time: 1,
            mountpoint: String::new(),
            file: String::new(),
            size: 1 << 30,
            readonly: false,
            queues,
            queue_depth: 64,
            max_io: 1 << 20,
            timeout_secs: 30,
            hdd: false,
            logfile: None,
            fuse_io: None,
            credentials: Default::default(),
            queue_refs: None,
            volatile_cache: None,
        }
    }

    /// Writes the record atomically (temporary file, then rename), so a reader never sees half.
    pub fn save(&self) -> io::Result<()> {
        self.save_in(&devices_dir())
    }

    /// `save` into `dir`. The temporary file's name depends only on the process: threads of one
    /// process must not save at once (`RecordBook`).
    fn save_in(&self, dir: &Path) -> io::Result<()> {
        let path = record_path_in(dir, dev_name(&self.device));
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        let text = serde_json::to_string_pretty(self).map_err(io::Error::other)?;
        std::fs::write(&tmp, text + "\n")?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// The record of `device` (`/dev/loop3` or `loop3`), None when there is none.
    pub fn load(device: &str) -> Result<Option<Record>, String> {
        Record::load_in(&devices_dir(), device)
    }

    fn load_in(dir: &Path, device: &str) -> Result<Option<Record>, String> {
        let path = record_path_in(dir, dev_name(device));
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| format!("{}: unreadable mapping record: {e}", path.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Removes the record of `device`, but only while it still names `pid` as its daemon: a
    /// daemon that recovered the device in the meantime owns it now, and so does a new mapping
    /// that bound the device once it was free. Checked and removed under the records' lock, so
    /// such a mapping cannot write its record in between; if the lock is not had within
    /// `LOCK_WAIT` (its holder stopped), checked and removed without it: removal never waits
    /// without bound.
    pub fn remove_if_owned(device: &str, pid: i32) {
        remove_if_owned_locked(&devices_dir(), device, pid, LOCK_WAIT);
    }

    /// Whether the daemon that wrote the record still runs (the same process, not a reuse of its pid).
    pub fn liveness(&self) -> Liveness {
        if process_alive(self.pid, self.start_time) {
            Liveness::Running
        } else {
            Liveness::Dead
        }
    }
}

/// Saves a daemon's own record in `dir` under the records' lock, or without it once the lock's
/// wait is over (its holder stopped): no other mapping writes a live daemon's record.
fn save_own(dir: &Path, rec: &Record) -> io::Result<()> {
    match RecordsLock::acquire_in(dir.to_path_buf()) {
        Ok(records) => records.save(rec),
        Err(_) => rec.save_in(dir),
    }
}

/// `Record::remove_if_owned` in `dir`, waiting up to `wait` for the lock.
fn remove_if_owned_locked(dir: &Path, device: &str, pid: i32, wait: Duration) {
    match RecordsLock::acquire_within(dir.to_path_buf(), wait) {
        Ok(records) => records.remove_if_owned(device, pid),
        // No records directory: no record.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(_) => remove_if_owned_in(dir, device, pid),
    }
}

fn remove_if_owned_in(dir: &Path, device: &str, pid: i32) {
    if let Ok(Some(r)) = Record::load_in(dir, device) {
        if r.pid == pid {
            let _ = std::fs::remove_file(record_path_in(dir, dev_name(device)));
        }
    }
}

/// How long taking the records' lock may wait: every holder keeps it for a few file operations
/// (and a loop device's binding), so a longer wait means a holder that was stopped.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// How often a wait for the records' lock tries again.
const LOCK_POLL: Duration = Duration::from_millis(10);

/// The records of one run directory, held exclusively: an flock on its devices directory,
/// released on drop. Choosing a device and writing its record, or checking whose a record is and
/// removing it, is one step to every other holder, whichever process or thread (each holder has
/// its own open file, and flock excludes between open files). A holder must not take it again.
pub(crate) struct RecordsLock {
    dir: PathBuf,
    _held: File,
}

impl RecordsLock {
    /// Waits up to `LOCK_WAIT` for the records of this run directory (NotFound: it has none
    /// yet).
    pub(crate) fn acquire() -> io::Result<RecordsLock> {
        RecordsLock::acquire_in(devices_dir())
    }

    /// Waits up to `LOCK_WAIT` for the records kept in `dir`.
    pub(crate) fn acquire_in(dir: PathBuf) -> io::Result<RecordsLock> {
        RecordsLock::acquire_within(dir, LOCK_WAIT)
    }

    /// Waits up to `wait` for the records kept in `dir`; TimedOut, saying so, after that: a
    /// holder that was stopped (SIGSTOP, a debugger) must not block every map and unmap.
    pub(crate) fn acquire_within(dir: PathBuf, wait: Duration) -> io::Result<RecordsLock> {
        let held = File::open(&dir)?;
        let deadline = Instant::now() + wait;
        // SAFETY: a non-blocking flock on a descriptor we own.
        while unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) if Instant::now() < deadline => {
                    std::thread::sleep(LOCK_POLL)
                }
                Some(libc::EWOULDBLOCK) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "another blkwire process has held the lock on {} for over {}s (a stopped `blkwire map`? `fuser -v {}` names it)",
                            dir.display(),
                            wait.as_secs_f32(),
                            dir.display()
                        ),
                    ))
                }
                _ => return Err(e),
            }
        }
        Ok(RecordsLock { dir, _held: held })
    }

    /// The record of `device`, None when there is none.
    pub(crate) fn load(&self, device: &str) -> Result<Option<Record>, String> {
        Record::load_in(&self.dir, device)
    }

    /// Writes `rec` (see `Record::save`).
    pub(crate) fn save(&self, rec: &Record) -> io::Result<()> {
        rec.save_in(&self.dir)
    }

    /// `Record::remove_if_owned` for a holder of the lock.
    pub(crate) fn remove_if_owned(&self, device: &str, pid: i32) {
        remove_if_owned_in(&self.dir, device, pid);
    }
}

/// The record of a device its daemon serves, which the daemon's threads update (a queue's new
/// session, `set_queue`) one at a time, until the mapping ends (`close`): a thread finishing
/// after that cannot bring a removed record back.
pub(crate) struct RecordBook {
    dir: PathBuf,
    /// None once closed.
    rec: Mutex<Option<Record>>,
}

impl RecordBook {
    /// Saves `rec` (in the devices directory) and keeps it as the device's record.
    pub(crate) fn create(rec: Record) -> io::Result<RecordBook> {
        RecordBook::create_in(devices_dir(), rec)
    }

    /// Under the records' lock, as every change of a record: another daemon's `close` cannot
    /// then remove this record as its own, nor can this one replace a live daemon's.
    fn create_in(dir: PathBuf, rec: Record) -> io::Result<RecordBook> {
        let records = RecordsLock::acquire_in(dir.clone())?;
        if let Ok(Some(old)) = records.load(&rec.device) {
            if old.pid != rec.pid && old.liveness() == Liveness::Running {
                return Err(io::Error::other(format!(
                    "{} is recorded for blkwire pid {}",
                    rec.device, old.pid
                )));
            }
        }
        records.save(&rec)?;
        drop(records);
        Ok(RecordBook {
            dir,
            rec: Mutex::new(Some(rec)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Record>> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that device queue `i` is served from now on by the target's queue `q`, before
    /// that queue is used: a recovery then fences it. Naming a newer queue is always safe (its
    /// session was welcomed only once the one it replaced had nothing running); naming an older
    /// one once the newer has sent anything is not. Fails once the mapping has ended.
    pub(crate) fn set_queue(&self, i: usize, q: Option<QueueRef>) -> io::Result<()> {
        let mut g = self.lock();
        let rec = g
            .as_mut()
            .ok_or_else(|| io::Error::other("the mapping has ended"))?;
        let slot = rec
            .queue_refs
            .as_mut()
            .and_then(|refs| refs.get_mut(i))
            .ok_or_else(|| io::Error::other(format!("the record has no queue {i}")))?;
        let before = std::mem::replace(slot, q.map(Into::into));
        // Its own record, which no other mapping writes while this one lives: saved without
        // the lock past its wait rather than lose the reconnection it records.
        let saved = save_own(&self.dir, rec);
        if saved.is_err() {
            // Not saved: this copy stays what the file says.
            if let Some(refs) = rec.queue_refs.as_mut() {
                refs[i] = before;
            }
        }
        saved
    }

    /// The mapping ended: removes the record (unless a recovering daemon owns it by now) and
    /// ignores later updates.
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        if let Some(rec) = g.take() {
            remove_if_owned_locked(&self.dir, &rec.device, rec.pid, LOCK_WAIT);
        }
    }

    /// A failed recovery: puts back the dead daemon's record `old`, with the queues this one
    /// recorded if it did (they may have sent writes, which the next recovery must fence; the
    /// old ones were fenced before these sessions were made), and ignores later updates.
    pub(crate) fn close_restoring(&self, mut old: Record) {
        let mut g = self.lock();
        if let Some(refs) = g.take().and_then(|r| r.queue_refs) {
            old.queue_refs = Some(refs);
        }
        let _ = save_own(&self.dir, &old);
    }
}

/// Every record, sorted by device. Unreadable records are returned as errors so the caller can
/// say so instead of hiding a mapping.
pub fn list() -> Vec<Result<Record, String>> {
    let dir = match std::fs::read_dir(devices_dir()) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => return vec![Err(format!("{}: {e}", devices_dir().display()))],
    };
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort_by_key(|n| {
        // loop2 before loop10
        let stem = n.trim_end_matches(".json");
        let digits = stem.trim_start_matches(|c: char| !c.is_ascii_digit());
        (
            stem.len() - digits.len(),
            digits.parse::<u64>().unwrap_or(u64::MAX),
            stem.to_string(),
        )
    });
    names
        .iter()
        .filter_map(|n| match Record::load(n.trim_end_matches(".json")) {
            Ok(Some(r)) => Some(Ok(r)),
            Ok(None) => None, // removed while we listed
            Err(e) => Some(Err(e)),
        })
        .collect()
}

/// State letter and start time (fields 3 and 22) of /proc/PID/stat.
pub fn proc_stat(pid: i32) -> Option<(char, u64)> {
    if pid <= 0 {
        return None;
    }
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain anything, even ") ".
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// True when process `pid` exists, is not a zombie, and started at `start_time`.
pub fn process_alive(pid: i32, start_time: u64) -> bool {
    matches!(proc_stat(pid), Some((state, start)) if start == start_time && state != 'Z' && state != 'X')
}

/// Whether some process runs with `pid` (whichever it is: not a zombie).
pub fn pid_running(pid: i32) -> bool {
    matches!(proc_stat(pid), Some((state, _)) if state != 'Z' && state != 'X')
}

/// This process's start time, as records keep it (`proc_stat`).
pub fn self_start_time() -> u64 {
    proc_stat(std::process::id() as i32)
        .map(|(_, s)| s)
        .unwrap_or(0)
}

/// Mount directories are named after the pid of the daemon that made them.
pub fn mount_dir_for(pid: u32) -> PathBuf {
    mounts_dir().join(pid.to_string())
}

/// The pid a mount directory is named after (`mount_dir_for`), if its name is one.
pub fn mount_dir_pid(dir: &Path) -> Option<i32> {
    dir.file_name()?.to_str()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = std::process::id() as i32;
        let start = self_start_time();
        assert!(start > 0);
        assert!(process_alive(me, start));
        assert!(
            !process_alive(me, start + 1),
            "a reused pid has another start time"
        );
        assert!(!process_alive(0, start));
        assert!(!process_alive(i32::MAX, start));
    }

    /// The credentials sit at the top level of a record's JSON, as before they were grouped, and
    /// a record written before they existed still loads.
    #[test]
    fn credentials_are_top_level_keys_and_optional() {
        let old = r#"{"device":"/dev/loop3","url":"tcp://h:1/e","export":"e","frontend":"fuse",
            "pid":1,"start_time":2,"mountpoint":"","file":"","size":4096,"readonly":false,
            "queues":1,"queue_depth":4,"max_io":65536,"timeout_secs":30,"hdd":false,"logfile":null}"#;
        let mut r: Record = serde_json::from_str(old).unwrap();
        assert_eq!(r.credentials, RecordedCredentials::default());
        r.credentials.host_id = Some("db1".into());
        r.credentials.key_file = Some("/etc/k".into());
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(
            (v["host_id"].as_str(), v["key_file"].as_str()),
            (Some("db1"), Some("/etc/k"))
        );
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
    }

    fn record(queues: usize) -> Record {
        Record {
            pid: std::process::id() as i32,
            start_time: self_start_time(),
            device: "/dev/ublkb7".into(),
            url: "udp://h:1/e".into(),
            export: "e".into(),
            size: 1 << 20,
            queue_refs: Some(vec![None; queues]),
            volatile_cache: None,
            ..Record::sample(queues as u16)
        }
    }

    /// A directory of its own for one test, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let d =
                std::env::temp_dir().join(format!("blkwire-state-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A record written before queues were recorded loads with none (and `map --recover` then
    /// knows it cannot fence), and one without them is written without the key.
    #[test]
    fn a_record_of_an_older_version_has_no_queue_refs() {
        let old = r#"{"device":"/dev/ublkb0","url":"tcp://h:1/e","export":"e","frontend":"ublk",
            "pid":1,"start_time":2,"mountpoint":"","file":"","size":4096,"readonly":false,
            "queues":2,"queue_depth":4,"max_io":65536,"timeout_secs":30,"hdd":false,"logfile":null}"#;
        let r: Record = serde_json::from_str(old).unwrap();
        assert_eq!(r.queue_refs, None);
        let v = serde_json::to_value(&r).unwrap();
        assert!(v.get("queue_refs").is_none(), "{v}");
    }

    /// Cookies use all 64 bits: they go through JSON as hex strings, exactly.
    #[test]
    fn recorded_queues_round_trip_exactly() {
        let mut r = record(3);
        let near_max = QueueRef {
            session: u32::MAX,
            queue: 1,
            cookie: u64::MAX - 1,
        };
        let small = QueueRef {
            session: 7,
            queue: 0,
            cookie: 0x1f,
        };
        r.queue_refs = Some(vec![Some(small.into()), Some(near_max.into()), None]);
        let text = serde_json::to_string_pretty(&r).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["queue_refs"][1]["cookie"], "fffffffffffffffe", "{text}");
        assert_eq!(v["queue_refs"][0]["cookie"], "000000000000001f", "{text}");
        assert!(v["queue_refs"][2].is_null(), "{text}");
        let back: Record = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        let refs = back.queue_refs.unwrap();
        assert_eq!(QueueRef::from(refs[1].unwrap()), near_max);
        assert_eq!(QueueRef::from(refs[0].unwrap()), small);
        let bad = text.replace("fffffffffffffffe", "18446744073709551614x");
        assert!(serde_json::from_str::<Record>(&bad).is_err());
    }

    /// A queue's new session is in the record file once `set_queue` returns; after the mapping
    /// ended, a late one neither fails silently nor brings the removed record back.
    #[test]
    fn a_record_book_records_queues_until_closed() {
        let dir = Dir::new("book");
        let book = RecordBook::create_in(dir.0.clone(), record(2)).unwrap();
        let q = QueueRef {
            session: 9,
            queue: 0,
            cookie: u64::MAX,
        };
        book.set_queue(1, Some(q)).unwrap();
        let on_disk = Record::load_in(&dir.0, "ublkb7").unwrap().unwrap();
        assert_eq!(on_disk.queue_refs, Some(vec![None, Some(q.into())]));
        assert!(book.set_queue(2, Some(q)).is_err(), "no such queue");
        book.close();
        assert_eq!(Record::load_in(&dir.0, "ublkb7").unwrap(), None);
        assert!(book.set_queue(0, Some(q)).is_err());
        assert_eq!(
            Record::load_in(&dir.0, "ublkb7").unwrap(),
            None,
            "a late update recreated the record"
        );
    }

    /// A daemon's `close` checks whose the record is and removes it under the records' lock:
    /// another map's record, written while the lock is held, stays.
    #[test]
    fn closing_a_record_book_waits_for_the_records_lock() {
        let dir = Dir::new("close-locked");
        let book = std::sync::Arc::new(RecordBook::create_in(dir.0.clone(), record(1)).unwrap());
        let held = RecordsLock::acquire_in(dir.0.clone()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let closing = std::sync::Arc::clone(&book);
        let t = std::thread::spawn(move || {
            closing.close();
            let _ = tx.send(());
        });
        // Not synchronisation: a close that ignored the lock would be done by now.
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(300))
                .is_err(),
            "close did not wait for the records' lock"
        );
        let mut other = record(1);
        other.pid = std::process::id() as i32 + 1;
        held.save(&other).unwrap();
        drop(held);
        t.join().unwrap();
        assert_eq!(Record::load_in(&dir.0, "ublkb7").unwrap(), Some(other));
    }

    /// A stopped holder of the records' lock makes taking it fail after the wait, not hang, and
    /// a removal then checks the owner without it.
    #[test]
    fn a_held_records_lock_is_waited_for_only_so_long() {
        let dir = Dir::new("lock-wait");
        let rec = record(1);
        rec.save_in(&dir.0).unwrap();
        let held = RecordsLock::acquire_in(dir.0.clone()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.0.clone();
        let pid = rec.pid;
        std::thread::spawn(move || {
            let wait = Duration::from_millis(50);
            let taken = RecordsLock::acquire_within(d.clone(), wait).map(drop);
            // Another's record stays, ours goes.
            remove_if_owned_locked(&d, "/dev/ublkb7", pid + 1, wait);
            let kept = Record::load_in(&d, "/dev/ublkb7").unwrap().is_some();
            remove_if_owned_locked(&d, "/dev/ublkb7", pid, wait);
            let _ = tx.send((taken, kept));
        });
        // Only a guard against hanging: the waits above are 50 ms each.
        let (taken, kept) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("waited for the records' lock without bound");
        let e = taken.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("held the lock"), "{e}");
        assert!(kept, "removed another daemon's record");
        assert_eq!(Record::load_in(&dir.0, "ublkb7").unwrap(), None);
        drop(held);
    }

    /// A failed recovery puts the dead daemon's record back, but with the queues it recorded
    /// itself: those may have sent writes.
    #[test]
    fn a_failed_recovery_restores_the_record_with_the_newer_queues() {
        let dir = Dir::new("restore");
        let mut old = record(1);
        old.pid = 1;
        let dead = QueueRef {
            session: 1,
            queue: 0,
            cookie: 11,
        };
        old.queue_refs = Some(vec![Some(dead.into())]);
        let book = RecordBook::create_in(dir.0.clone(), record(1)).unwrap();
        let newer = QueueRef {
            session: 2,
            queue: 0,
            cookie: 22,
        };
        book.set_queue(0, Some(newer)).unwrap();
        book.close_restoring(old.clone());
        let back = Record::load_in(&dir.0, "ublkb7").unwrap().unwrap();
        assert_eq!(back.pid, 1);
        assert_eq!(back.queue_refs, Some(vec![Some(newer.into())]));
        // Closed: a late update changes nothing.
        assert!(book.set_queue(0, Some(dead)).is_err());
        assert_eq!(Record::load_in(&dir.0, "ublkb7").unwrap(), Some(back));
    }

    #[test]
    fn zombies_are_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Wait for the exit without reaping (WNOWAIT): the child stays a zombie, with its pid
        // and start time still listed in /proc.
        // SAFETY: waitid fills a siginfo_t we own.
        let r = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        assert_eq!(r, 0);
        let (state, start) = proc_stat(pid).expect("unreaped child is listed");
        assert_eq!(state, 'Z');
        assert!(!process_alive(pid, start));
        child.wait().unwrap();
    }
}
