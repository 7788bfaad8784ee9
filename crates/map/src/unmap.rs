//! `unmap`: ends a mapping whether or not its daemon is alive, and never waits without bound.
//!
//! With a live daemon, detaching the loop device makes the kernel release the FUSE file; the
//! daemon sees that, unmounts, flushes, removes its record and exits, and we wait for that exit
//! (bounded by its I/O timeout). With a dead daemon the FUSE connection is already aborted, so
//! the detach cannot block on it, and we do the rest of the cleanup ourselves.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::fuse;
use crate::loopdev::{Detach, LoopDev};
use crate::state::{self, Record};
use crate::sys::Proc;

/// Extra time a live daemon gets beyond its I/O timeout to flush and exit.
const EXIT_GRACE: Duration = Duration::from_secs(10);
/// How long an exclusive hold on an unmounted device may last before unmap gives up: the kernel
/// drops a filesystem's claim shortly after umount returns, not always before.
const RELEASE_GRACE: Duration = Duration::from_secs(2);

/// LOOP_CLR_FD waits for the device's I/O in flight, which a live daemon finishes within its
/// timeout. One that does not (stopped, stuck) is killed: its FUSE connection dies with it, the
/// I/O fails at once and the detach completes.
fn detach_bounded(dev: LoopDev, daemon: Option<&(Proc, u64)>) -> Result<Detach, String> {
    let path = dev.path();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(dev.detach());
    });
    let limit = daemon.map_or(EXIT_GRACE, |(_, t)| Duration::from_secs(*t) + EXIT_GRACE);
    let r = match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => {
            if let Some((p, _)) = daemon {
                let _ = p.kill(libc::SIGKILL);
            }
            rx.recv_timeout(EXIT_GRACE)
                .map_err(|_| format!("detaching {path} is stuck in the kernel"))?
        }
    };
    r.map_err(|e| format!("detaching {path}: {e}"))
}

/// Refuses to detach a device in use: detaching would only be deferred to its last close,
/// leaving the mapping half-removed for an unknown time.
fn check_not_in_use(dev: &LoopDev) -> Result<(), String> {
    let path = dev.path();
    if let Some(at) = dev.mount_points().first() {
        return Err(format!(
            "{path} is mounted on {at}: unmount it first, then unmap it"
        ));
    }
    let deadline = Instant::now() + RELEASE_GRACE;
    while dev.held_exclusively() {
        if Instant::now() >= deadline {
            return Err(format!(
                "{path} is held open exclusively (device-mapper, swap, another mount namespace?): release it first, then unmap it"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

pub fn unmap(device: &str) -> Result<(), String> {
    if let Some(id) = crate::ublk::parse_device(device) {
        return crate::ublk::unmap(device, id);
    }
    crate::daemon::preflight()?;
    let not_ours =
        || format!("{device} is not a blkwire device (`blkwire ls` lists the mapped devices)");
    let dev = LoopDev::parse(device).ok_or_else(not_ours)?;
    let path = dev.path();
    let rec = Record::load(&path)?;
    let backing = dev.backing_file();
    let mounts = state::mounts_dir();
    // Bound to a blkwire file: the recorded one, or (no record: a daemon killed before writing
    // it) any file under our mount directory.
    let bound_to_us = match (&rec, &backing) {
        (Some(r), Some(b)) => *b == r.file,
        (None, Some(b)) => Path::new(b).starts_with(&mounts),
        _ => false,
    };
    if rec.is_none() && !bound_to_us {
        return Err(not_ours());
    }
    let daemon = rec
        .as_ref()
        .and_then(|r| Proc::open(r.pid, r.start_time).map(|p| (p, r.timeout_secs)));
    if bound_to_us {
        check_not_in_use(&dev)?;
        match detach_bounded(dev, daemon.as_ref())? {
            Detach::Done | Detach::NotBound => {}
            Detach::Deferred => {
                let then = if daemon.is_some() {
                    "and its daemon then cleans up"
                } else {
                    "then run unmap again"
                };
                return Err(format!(
                    "{path} is open in another process: it is detached when that process closes it; {then}"
                ));
            }
        }
    }
    if let Some((p, timeout_secs)) = &daemon {
        if !p.wait_exit(Duration::from_secs(*timeout_secs) + EXIT_GRACE) {
            // Stuck: its cleanup is ours now.
            let _ = p.kill(libc::SIGKILL);
            p.wait_exit(EXIT_GRACE);
        }
    }
    let mountpoint = match (&rec, &backing) {
        (Some(r), _) => Some(r.mountpoint.clone()),
        (None, Some(b)) => Path::new(b).parent().map(|p| p.display().to_string()),
        _ => None,
    };
    if let Some(m) = mountpoint {
        let m = Path::new(&m);
        fuse::unmount_lazy(m).map_err(|e| format!("unmounting {}: {e}", m.display()))?;
        let _ = std::fs::remove_dir(m);
    }
    Record::remove(&path);
    state::collect_orphan_mounts();
    Ok(())
}
