//! What both kinds of device share: the `BlockDevice` trait the daemon drives them through, the
//! mapping they serve (`Spec`), the connection to the export made before any device exists, and
//! the last flush of a queue on the way out.

use std::time::Duration;

use blkwire_client::{Cmd, ConnectOptions, ExportInfo, Queue, QueueRef, Url};
use blkwire_wire::{Features, Status};

use crate::log;
use crate::state::Record;

/// A kind of local block device serving an export (FUSE file + loop device, or ublk). The daemon
/// takes every mapping through the same steps whichever kind serves it; only the choice of the
/// implementation depends on the kind.
pub(crate) trait BlockDevice: Sized {
    /// The kind's name in records and `ls`.
    const KIND: &'static str;
    /// What `prepare` found out or opened, handed to `setup`.
    type Prepared;

    /// Checks that this machine can create such a device at all (root, kernel modules).
    fn preflight() -> Result<(), String>;
    /// Refuses a mapping this kind cannot serve as asked.
    fn check(_spec: &Spec) -> Result<(), String> {
        Ok(())
    }
    /// Does `device` name a device of this kind (`unmap`, `map --recover`)?
    fn names(device: &str) -> bool;
    /// What must hold before the export is connected, so that a kernel that cannot serve the
    /// mapping fails it before the target sees a session.
    fn prepare(spec: &Spec) -> Result<Self::Prepared, String>;
    /// Creates the device for a connected export (or, recovering, takes over the record's), with
    /// its queues running; on error everything created so far is undone.
    fn setup(spec: &Spec, prepared: Self::Prepared, conn: Connected) -> Result<Self, String>;
    /// The device node, as reported once it is ready.
    fn path(&self) -> String;
    /// Serves until the mapping ends (unmap, a signal, a dead connection), then tears the
    /// device down.
    fn serve(self) -> Result<(), String>;
    /// `map --recover DEVICE`: the record of the dead mapping, its device path and whether the
    /// new daemon serves it read-only, or why it cannot be recovered.
    fn recoverable(device: &str) -> Result<(Record, String, bool), String>;
    /// `unmap DEVICE`: ends the mapping whether or not its daemon is alive.
    fn unmap(device: &str) -> Result<(), String>;
}

/// `--fuse-io`: how the fuse device exchanges requests with the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FuseIo {
    /// io_uring when the kernel's switch is on and the kernel offers it at INIT, else read.
    Auto,
    /// io_uring or fail; turns the kernel's switch on (root) when it is off.
    Uring,
    /// read()/writev() on /dev/fuse.
    Read,
}

/// What records (and `ls`) say about a fuse mapping's I/O path: FUSE over io_uring.
pub(crate) const FUSE_IO_URING: &str = "uring";
/// What records (and `ls`) say about a fuse mapping's I/O path: read/writev on /dev/fuse.
pub(crate) const FUSE_IO_READ: &str = "read";

/// Whether a mapping makes a new device or takes over a dead daemon's.
pub(crate) enum Mode {
    /// A new device, numbered `dev_num` if given.
    New { dev_num: Option<u32> },
    /// Re-serve the read-only device of this record, whose daemon died.
    Recover(Box<Record>),
}

/// A mapping as a daemon serves it: `map`'s options resolved, or a record being recovered.
pub(crate) struct Spec {
    pub url: Url,
    pub readonly: bool,
    pub queues: u16,
    pub depth: u16,
    pub max_io: u32,
    pub hdd: bool,
    pub timeout: Duration,
    pub logfile: Option<String>,
    pub mode: Mode,
    pub fuse_io: FuseIo,
    pub credentials: blkwire_client::Credentials,
}

/// The session a device serves, connected before the device exists.
pub(crate) struct Connected {
    pub session: blkwire_client::Session,
    pub info: ExportInfo,
    /// What one queue reconnects with: its own connection, the depth the target granted.
    pub reconnect: ConnectOptions,
    /// Asked for, or the export is read-only.
    pub readonly: bool,
}

/// What a device was set up with, which every session serving it must still grant. A queue that
/// reconnects (a broken connection, a restarted target) lands on a new session while the device
/// stays as it is, so a session granting less would fail requests the kernel already sends: it
/// is refused, and the queue keeps trying (its requests fail at their deadline meanwhile). Both
/// frontends check their reconnections here.
///
/// Not checked, because it cannot be: that the session is of the same export. The protocol
/// names an export but carries no identity for it, so an export removed and added again under
/// the same name (other data, same or larger size) passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Needs {
    /// The device's size. The export may have grown since (`export_resize`; the device keeps
    /// its size), but a smaller one cannot hold the device's end.
    pub size: u64,
    /// The device's logical block size: the kernel aligns requests to it, and an export with
    /// other blocks refuses them (or, smaller, would be mapped with the wrong geometry).
    pub logical_block: u32,
    /// The largest READ or WRITE the device sends as one command.
    pub max_io: u32,
    /// Commands one queue must be able to have in flight at once.
    pub depth: u16,
    /// Mapped read-write: the export must still take writes.
    pub writable: bool,
}

impl Needs {
    /// One reconnection of a device's queue: a new one-queue session on `url` (`opts` naming
    /// the queue it replaces, PROTOCOL.md §2.6), kept only if it can serve the device. Every
    /// tag may be in flight at once and the device's limits were set from the first session:
    /// one granting less would fail requests. A session not used is closed as it is dropped.
    pub(crate) fn reconnect(&self, url: &Url, opts: &ConnectOptions) -> Result<Queue, String> {
        let mut s = blkwire_client::connect(url, opts).map_err(|e| e.to_string())?;
        self.check(&s.info)
            .map_err(|e| format!("{e}; not using it"))?;
        s.queues
            .pop()
            .ok_or_else(|| "the target granted no queue".to_string())
    }

    /// Why a session described by `info` cannot serve this device, if it cannot.
    pub(crate) fn check(&self, info: &ExportInfo) -> Result<(), String> {
        if info.size < self.size {
            return Err(format!(
                "the export shrank from {} to {} bytes",
                self.size, info.size
            ));
        }
        if info.logical_block != self.logical_block {
            return Err(format!(
                "the export's logical block size changed from {} to {} bytes",
                self.logical_block, info.logical_block
            ));
        }
        if info.max_io < self.max_io {
            return Err(format!(
                "the target now grants I/O of at most {} bytes, the device sends up to {}",
                info.max_io, self.max_io
            ));
        }
        if info.depth < self.depth {
            return Err(format!(
                "the target now grants queue depth {}, the device needs {}",
                info.depth, self.depth
            ));
        }
        if self.writable && info.features.has(Features::READ_ONLY) {
            return Err("the export is now read-only and the device is writable".into());
        }
        Ok(())
    }
}

/// Connects the session a mapping serves with, first (so an unknown export or an unreachable
/// target fails before anything exists), and checks that the export can be a block device.
pub(crate) fn connect(spec: &Spec) -> Result<Connected, String> {
    let mut opts = ConnectOptions {
        queues: spec.queues,
        depth: spec.depth,
        max_io: spec.max_io,
        timeout: spec.timeout,
        ..Default::default()
    };
    spec.credentials.apply(&mut opts)?;
    if let Mode::Recover(dead) = &spec.mode {
        fence_dead_daemon(dead, &spec.url, &opts)?;
    }
    let session = blkwire_client::connect(&spec.url, &opts).map_err(|e| e.to_string())?;
    let info = session.info.clone();
    check_export(&info, spec)?;
    Ok(Connected {
        readonly: spec.readonly || info.features.has(Features::READ_ONLY),
        reconnect: ConnectOptions {
            queues: 1,
            depth: info.depth,
            ..opts
        },
        session,
        info,
    })
}

/// `map --recover` of a writable mapping: before the new daemon sends anything, ends the queues
/// its record names (the dead daemon's, PROTOCOL.md §2.6) and waits until none of their writes
/// still runs on the target, so that no write of the dead daemon lands after one of the new
/// daemon's (the kernel reissues the requests that were in flight, to the same blocks). A
/// read-only device sent no writes: nothing to fence. A target that restarted since knows none
/// of these queues, and nothing needs fencing there.
fn fence_dead_daemon(dead: &Record, url: &Url, opts: &ConnectOptions) -> Result<(), String> {
    if dead.readonly {
        return Ok(());
    }
    let Some(refs) = &dead.queue_refs else {
        log!(
            "warn",
            "{}: its record (written by an older blkwire) does not name the dead daemon's sessions: its writes still running on the target, if any, are not fenced and may land after newer ones",
            dead.device
        );
        return Ok(());
    };
    if refs.len() != dead.queues as usize {
        return Err(format!(
            "{}: damaged record: it names {} target queue(s) for {} device queue(s); cannot recover",
            dead.device,
            refs.len(),
            dead.queues
        ));
    }
    let known: Vec<QueueRef> = refs.iter().flatten().map(|&q| q.into()).collect();
    if known.len() < refs.len() {
        log!(
            "warn",
            "{}: {} of the dead daemon's {} queue(s) had no session identity (nvme-tcp://): their writes still running on the target, if any, are not fenced",
            dead.device,
            refs.len() - known.len(),
            refs.len()
        );
    }
    if known.is_empty() {
        return Ok(());
    }
    fence_recorded(url, opts, &known)
        .map_err(|e| format!("{}: {e}; cannot recover", dead.device))?;
    log!(
        "info",
        "{}: the dead daemon's {} queue(s) on {url} are closed with none of their requests running",
        dead.device,
        known.len()
    );
    Ok(())
}

/// Fences `queues` of earlier sessions on `url` (PROTOCOL.md §2.6), as `map --recover` does for
/// the queues a dead daemon's record names: per queue, a one-queue session naming it as the one
/// it replaces, in parallel, each asking again while the target says `BUSY` (the queue's
/// requests still run) up to `opts.timeout`; then those sessions log out. Once this returns Ok,
/// nothing those queues were asked to do runs any more on the target. `opts` is what the
/// mapping connects with (host id, key, TLS): without a key the target accepts the fence only
/// from the host id and address that held the queue. Err says which queues could not be fenced.
pub fn fence_recorded(url: &Url, opts: &ConnectOptions, queues: &[QueueRef]) -> Result<(), String> {
    let fence = |r: QueueRef| -> Result<(), String> {
        let o = ConnectOptions {
            queues: 1,
            depth: 1,
            replaces: Some(r),
            ..opts.clone()
        };
        let s = blkwire_client::connect(url, &o)
            .map_err(|e| format!("fencing session {} queue {}: {e}", r.session, r.queue))?;
        for q in s.queues {
            let _ = q.logout();
        }
        Ok(())
    };
    let errors: Vec<String> = std::thread::scope(|sc| {
        let running: Vec<_> = queues
            .iter()
            .map(|&r| {
                std::thread::Builder::new()
                    .name("blkwire-fence".into())
                    .spawn_scoped(sc, move || fence(r))
                    .map_err(|e| format!("starting a thread: {e}"))
            })
            .collect();
        running
            .into_iter()
            .filter_map(|t| match t {
                Ok(t) => t
                    .join()
                    .unwrap_or_else(|_| Err("a fencing thread panicked".into()))
                    .err(),
                Err(e) => Some(e),
            })
            .collect()
    });
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

fn check_export(info: &ExportInfo, spec: &Spec) -> Result<(), String> {
    if info.size == 0 {
        return Err(format!("export '{}' is empty", info.name));
    }
    let lb = info.logical_block;
    if !lb.is_power_of_two() || !(512..=4096).contains(&lb) {
        return Err(format!(
            "export '{}' has {lb}-byte blocks; a loop device supports 512 to 4096",
            info.name
        ));
    }
    if info.max_io < 4096 {
        return Err(format!(
            "the target grants I/O of at most {} bytes; mapping needs 4096",
            info.max_io
        ));
    }
    if let Mode::Recover(r) = &spec.mode {
        if r.size != info.size {
            return Err(format!(
                "export '{}' changed size ({} -> {} bytes): cannot recover {}",
                info.name, r.size, info.size, r.device
            ));
        }
    }
    Ok(())
}

/// On the way out: make what this queue wrote durable, then log out.
pub(crate) fn final_flush(mut q: Queue, readonly: bool, id: usize) {
    const TOKEN: u64 = u64::MAX;
    if !readonly && q.in_flight() < q.depth() && q.submit(Cmd::Flush, TOKEN).is_ok() {
        let mut done = false;
        let mut status = Status::Ok;
        while !done {
            match q.complete(1, |c| {
                if c.user == TOKEN {
                    done = true;
                    status = c.status;
                }
            }) {
                Ok(_) => {}
                Err(e) => {
                    log!("warn", "queue {id}: final flush: {e}");
                    return;
                }
            }
        }
        if status != Status::Ok {
            log!("warn", "queue {id}: final flush: {status}");
        }
    }
    let _ = q.logout();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ExportInfo {
        ExportInfo {
            name: "d".into(),
            size: 1 << 30,
            logical_block: 512,
            physical_block: 4096,
            features: Features(Features::FLUSH),
            queues: 1,
            depth: 64,
            max_io: 1 << 20,
            session: 1,
            copy: Default::default(),
            header_crc: false,
        }
    }

    const NEEDS: Needs = Needs {
        size: 1 << 30,
        logical_block: 512,
        max_io: 1 << 20,
        depth: 64,
        writable: true,
    };

    #[test]
    fn the_same_grant_or_more_serves_the_device() {
        assert_eq!(NEEDS.check(&info()), Ok(()));
        // Grown (export_resize), more depth, larger I/O: all fine.
        let more = ExportInfo {
            size: 2 << 30,
            depth: 128,
            max_io: 4 << 20,
            ..info()
        };
        assert_eq!(NEEDS.check(&more), Ok(()));
        // A read-only export serves a read-only device.
        let ro = ExportInfo {
            features: Features(Features::READ_ONLY),
            ..info()
        };
        let reader = Needs {
            writable: false,
            ..NEEDS
        };
        assert_eq!(reader.check(&ro), Ok(()));
    }

    #[test]
    fn a_session_granting_less_is_refused() {
        let refused = |i: ExportInfo, needle: &str| {
            let e = NEEDS.check(&i).expect_err(needle);
            assert!(e.contains(needle), "{e}");
        };
        refused(
            ExportInfo {
                size: (1 << 30) - 512,
                ..info()
            },
            "shrank",
        );
        refused(
            ExportInfo {
                logical_block: 4096,
                ..info()
            },
            "logical block",
        );
        refused(
            ExportInfo {
                logical_block: 256,
                ..info()
            },
            "logical block",
        );
        refused(
            ExportInfo {
                max_io: 512 << 10,
                ..info()
            },
            "I/O of at most",
        );
        refused(
            ExportInfo {
                depth: 32,
                ..info()
            },
            "queue depth",
        );
        refused(
            ExportInfo {
                features: Features(Features::READ_ONLY | Features::FLUSH),
                ..info()
            },
            "read-only",
        );
    }
}
