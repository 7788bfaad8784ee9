//! What both kinds of device share: the `BlockDevice` trait the daemon drives them through, the
//! mapping they serve (`Spec`), the connection to the export made before any device exists, and
//! the last flush of a queue on the way out.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use blkwire_client::{Cmd, ConnectOptions, ExportInfo, Queue, QueueRef, Url};
use blkwire_wire::{Features, Status};

use crate::log;
use crate::state::{Liveness, Record};

/// A kind of local block device serving an export (FUSE file + loop device, or ublk). The daemon
/// takes every mapping through the same steps whichever kind serves it; only the choice of the
/// implementation depends on the kind.
pub(crate) trait BlockDevice: Sized {
    /// The kind's name in records and `ls`.
    const KIND: &'static str;
    /// What `prepare` found out or opened, handed to `setup`.
    type Prepared;
    /// A recovered device keeps the size it was made with, so an export that grew since serves
    /// it as well (ublk: a recovery sets no parameters); otherwise (a loop device's file, which
    /// LOOP_CHANGE_FD swaps only for one of the same size) the export must have kept its size.
    const RECOVERS_GROWN: bool = false;

    /// Checks that this machine can create such a device at all (root, kernel modules).
    fn preflight() -> Result<(), String>;
    /// Refuses a mapping this kind cannot serve as asked.
    fn check(_spec: &Spec) -> Result<(), String> {
        Ok(())
    }
    /// Does `device` name a device of this kind (`unmap`, `map --recover`)?
    fn names(device: &str) -> bool;
    /// What must hold before the export is connected, so that a kernel that cannot serve the
    /// mapping fails it before the target sees a session. Recovering a ublk device, also the
    /// kernel's word that the old daemon died and the fence of its queues, which must come
    /// before the new daemon's session ([`connect`]).
    fn prepare(spec: &Spec) -> Result<Self::Prepared, String>;
    /// Creates the device for a connected export (or, recovering, takes over the record's), with
    /// its queues running; on error everything created so far is undone.
    fn setup(spec: &Spec, prepared: Self::Prepared, conn: Connected) -> Result<Self, String>;
    /// The device node, as reported once it is ready.
    fn path(&self) -> String;
    /// Serves until the mapping ends (unmap, a signal, a dead connection), then tears the
    /// device down.
    fn serve(self) -> Result<(), String>;
    /// Tears the device down at once, whatever holds it (as a stop signal repeated after a
    /// refusal does): for a device nobody was told of, which no user of it can expect to stay.
    fn stop_now(self) -> Result<(), String>;
    /// `map --recover DEVICE`: the record of the dead mapping, its device path and whether the
    /// new daemon serves it read-only, or why it cannot be recovered.
    fn recoverable(device: &str) -> Result<(Record, String, bool), String>;
    /// `unmap DEVICE`: ends the mapping whether or not its daemon is alive.
    fn unmap(device: &str) -> Result<(), String>;
    /// What `ls` says about the mapping `rec` records: whether its daemon runs, and (where the
    /// kind can tell) whether a dead one's device is still there to recover or unmap.
    fn liveness(rec: &Record) -> Liveness {
        rec.liveness()
    }
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
    /// The kernel was told the device has a volatile write cache, so it sends FLUSH and FUA.
    /// Told it has none (the export did not offer FLUSH), it never does: an export that now
    /// caches writes (re-added as a file, say) would hold writes the kernel takes for durable.
    pub volatile_cache: bool,
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
        if self.writable && !self.volatile_cache && info.features.has(Features::FLUSH) {
            return Err(
                "the export now has a write cache (it offers FLUSH) and the device was \
                        set up without one: the kernel would never flush what it writes"
                    .into(),
            );
        }
        Ok(())
    }
}

/// What a mapping's sessions connect with: the spec's queues, depth, I/O size, timeout and
/// credentials.
pub(crate) fn connect_options(spec: &Spec) -> Result<ConnectOptions, String> {
    let mut opts = ConnectOptions {
        queues: spec.queues,
        depth: spec.depth,
        max_io: spec.max_io,
        timeout: spec.timeout,
        // The daemons time requests out themselves (`--timeout`, a change held for the fence
        // up to `answer_limit`) and drop the queue of one they gave up: the client must never
        // fail one first, unfenced (a WRITE failed so could land after it was written again).
        give_up: Some(answer_limit(spec.timeout) + spec.timeout),
        ..Default::default()
    };
    spec.credentials.apply(&mut opts)?;
    Ok(opts)
}

/// Connects the session a mapping serves with, first (so an unknown export or an unreachable
/// target fails before anything exists), and checks that the export can be a block device.
///
/// Recovering (`map --recover`), this runs after `BlockDevice::prepare`, which for ublk has
/// fenced the dead daemon's queues ([`fence_dead_daemon`]) once the kernel confirmed that
/// daemon is gone: this session is made after the fence, not only used after it. (Connecting
/// sends no I/O, so "no write of ours before the fence" would hold either way; connecting
/// after it also keeps the dead daemon's lingering sessions from counting against the target's
/// session limits while ours are made.)
pub(crate) fn connect(spec: &Spec, recovers_grown: bool) -> Result<Connected, String> {
    let opts = connect_options(spec)?;
    let session = blkwire_client::connect(&spec.url, &opts).map_err(|e| e.to_string())?;
    let info = session.info.clone();
    check_export(&info, spec, recovers_grown)?;
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

/// What `map --recover` fences of a dead daemon's mapping ([`fence_plan`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Fence {
    /// The target queues the dead daemon may have sent writes on, as its record names them.
    pub queues: Vec<QueueRef>,
    /// Why some or all of the dead daemon's writes cannot be fenced, if so: a warning to log.
    pub unfenced: Option<String>,
}

/// What to fence before re-serving `dead`'s device, whose kernel side has `device_queues`
/// queues (GET_DEV_INFO), or why the record cannot be trusted. No I/O: the daemon logs the
/// warning and fences ([`fence_dead_daemon`]). A read-only device sent no writes: nothing to
/// fence. A record written by an older blkwire names no queue, and a queue without session
/// identity (nvme-tcp://) has none to name: recovery goes on unfenced there, with a warning.
/// A record naming another count of queues than the device has is damaged: refused before a
/// session, let alone a thread, is made per entry.
pub(crate) fn fence_plan(dead: &Record, device_queues: u16) -> Result<Fence, String> {
    let nothing = |unfenced: Option<String>| Fence {
        queues: Vec::new(),
        unfenced,
    };
    if dead.readonly {
        return Ok(nothing(None));
    }
    let Some(refs) = &dead.queue_refs else {
        return Ok(nothing(Some(format!(
            "{}: its record (written by an older blkwire) does not name the dead daemon's sessions: its writes still running on the target, if any, are not fenced and may land after newer ones",
            dead.device
        ))));
    };
    if refs.len() != device_queues as usize || dead.queues != device_queues {
        return Err(format!(
            "{}: damaged record: it names {} target queue(s) for {} device queue(s), and the device has {device_queues}; cannot recover",
            dead.device,
            refs.len(),
            dead.queues
        ));
    }
    let queues: Vec<QueueRef> = refs.iter().flatten().map(|&q| q.into()).collect();
    let unfenced = (queues.len() < refs.len()).then(|| {
        format!(
            "{}: {} of the dead daemon's {} queue(s) had no session identity (nvme-tcp://): their writes still running on the target, if any, are not fenced",
            dead.device,
            refs.len() - queues.len(),
            refs.len()
        )
    });
    Ok(Fence { queues, unfenced })
}

/// `map --recover` of a writable mapping, once the kernel has confirmed that the old daemon is
/// gone (ublk: the device quiesced) and before the new daemon connects its own session: ends
/// the queues `fence` names (the dead daemon's, PROTOCOL.md §2.6) and waits until the
/// target answers, so that no write of the dead daemon lands after one of the new daemon's
/// (the kernel reissues the requests that were in flight, to the same blocks). The target
/// answers once none of a queue's requests runs, or at once when it does not know the queue as
/// this host's: it restarted since (nothing to fence, rightly), or, without keys, the fence
/// comes from another address than the dead daemon's sessions (nothing fenced, wrongly; the
/// answer cannot tell the two apart).
pub(crate) fn fence_dead_daemon(
    device: &str,
    fence: Fence,
    url: &Url,
    opts: &ConnectOptions,
) -> Result<(), String> {
    if let Some(w) = &fence.unfenced {
        log!("warn", "{w}");
    }
    if fence.queues.is_empty() {
        return Ok(());
    }
    fence_recorded(url, opts, &fence.queues)
        .map_err(|e| format!("{device}: {e}; cannot recover"))?;
    log!(
        "info",
        "{device}: asked the target ({url}) to close the dead daemon's {} queue(s); it answered once none of their requests ran, or did not know them",
        fence.queues.len()
    );
    Ok(())
}

/// At most this many fencing sessions at once ([`fence_recorded`]).
const FENCE_THREADS: usize = 8;

/// Fences `queues` of earlier sessions on `url` (PROTOCOL.md §2.6), as `map --recover`
/// does for the queues a dead daemon's record names: per queue, a one-queue session naming it
/// as the one it replaces, each asking again while the target says `BUSY` (the queue's requests
/// still run) up to `opts.timeout`; then that session logs out. Up to `FENCE_THREADS` (8) queues
/// at once; after a failure no further queue is started. Once this returns Ok, nothing those
/// queues were asked to do runs any more on the target (if it knew them). `opts` is what the
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
    let errors = run_bounded(queues, FENCE_THREADS, "blkwire-fence", |&r| fence(r));
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Runs `f` on each of `items` on at most `limit` threads named `name`, each taking the next
/// item until none is left; once one fails (or a thread cannot start), no further item is
/// started. The errors, in the order of their items (a thread's own failure last).
fn run_bounded<T: Sync>(
    items: &[T],
    limit: usize,
    name: &str,
    f: impl Fn(&T) -> Result<(), String> + Sync,
) -> Vec<String> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || -> Vec<(usize, String)> {
        let mut errors = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            if let Err(e) = f(item) {
                failed.store(true, Ordering::Relaxed);
                errors.push((i, e));
            }
        }
        errors
    };
    let mut errors: Vec<(usize, String)> = std::thread::scope(|sc| {
        let mut workers = Vec::new();
        let mut errors = Vec::new();
        for _ in 0..items.len().min(limit.max(1)) {
            match std::thread::Builder::new()
                .name(name.into())
                .spawn_scoped(sc, work)
            {
                Ok(t) => workers.push(t),
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    errors.push((usize::MAX, format!("starting a thread: {e}")));
                    break;
                }
            }
        }
        for t in workers {
            match t.join() {
                Ok(e) => errors.extend(e),
                Err(_) => errors.push((usize::MAX, "a thread panicked".into())),
            }
        }
        errors
    });
    errors.sort();
    errors.into_iter().map(|(_, e)| e).collect()
}

/// `recovers_grown`: [`BlockDevice::RECOVERS_GROWN`] of the device kind.
fn check_export(info: &ExportInfo, spec: &Spec, recovers_grown: bool) -> Result<(), String> {
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
        let serves = info.size == r.size || (recovers_grown && info.size > r.size);
        if !serves {
            return Err(format!(
                "export '{}' changed size ({} -> {} bytes): cannot recover {}",
                info.name, r.size, info.size, r.device
            ));
        }
    }
    Ok(())
}

/// The longest a mapped device's request waits for its answer with `--timeout` `timeout`:
/// that timeout, and for a change of the export the target may still be running then, one more
/// for the give-up fence (PROTOCOL.md §2.6). What stopping a mapping waits for its I/O.
pub(crate) fn answer_limit(timeout: Duration) -> Duration {
    timeout * 2
}

/// What a "connection lost" log line says of the wait for writes the target may still run: the
/// longer one, where the queue lost can be fenced (`fenceable`, it has an identity), nothing
/// where it cannot (nvme-tcp://: nothing is held).
pub(crate) fn held_writes_wait(fenceable: bool, timeout: Duration) -> String {
    match fenceable {
        true => format!(
            " ({}s for a write the target may still be running)",
            answer_limit(timeout).as_secs()
        ),
        false => String::new(),
    }
}

/// The log line, after the one counting requests failed with EIO, for `n` of them that were
/// writes answered without the fence (`url`'s target did not confirm they will not land).
pub(crate) fn unfenced_line(queue: usize, n: u64, url: &Url, timeout: Duration) -> String {
    format!(
        "queue {queue}: of those, {n} write(s) answered EIO unfenced: {url} did not confirm \
         within {}s more that they will not land later",
        timeout.as_secs()
    )
}

/// On the way out: make what this queue wrote durable, then log out. The flush waits at most
/// `timeout` (the mapping's): the queue's own give-up is past it (`connect_options`), and
/// stopping a mapping waits only so long for its workers.
pub(crate) fn final_flush(mut q: Queue, readonly: bool, id: usize, timeout: Duration) {
    const TOKEN: u64 = u64::MAX;
    if !readonly && q.in_flight() < q.depth() && q.submit(Cmd::Flush, TOKEN).is_ok() {
        let until = Instant::now() + timeout;
        let mut done = false;
        let mut status = Status::Ok;
        loop {
            let polled = q.poll(|c| {
                if c.user == TOKEN {
                    done = true;
                    status = c.status;
                }
            });
            if let Err(e) = polled {
                log!("warn", "queue {id}: final flush: {e}");
                return;
            }
            if done {
                break;
            }
            let now = Instant::now();
            if now >= until {
                log!(
                    "warn",
                    "queue {id}: final flush: no answer within {}s",
                    timeout.as_secs()
                );
                return;
            }
            let wake = q.deadline().map_or(until, |d| d.min(until));
            let ms = wake
                .saturating_duration_since(now)
                .as_millis()
                .clamp(1, 1000) as i32;
            let mut p = libc::pollfd {
                fd: q.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd we own, for the duration of the call.
            unsafe { libc::poll(&mut p, 1, ms) };
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
    use crate::state::RecordedQueue;

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
            max_range: blkwire_client::MAX_RANGE,
        }
    }

    fn dead(queues: u16, refs: Option<Vec<Option<RecordedQueue>>>) -> Record {
        Record {
            queue_refs: refs,
            volatile_cache: None,
            ..Record::sample(queues)
        }
    }

    fn rq(session: u32, queue: u16) -> RecordedQueue {
        RecordedQueue {
            session,
            queue,
            cookie: 0xfeed_0000 + session as u64,
        }
    }

    #[test]
    fn recovery_fences_every_recorded_queue_of_a_writable_mapping() {
        let r = dead(2, Some(vec![Some(rq(7, 0)), Some(rq(9, 0))]));
        assert_eq!(
            fence_plan(&r, 2),
            Ok(Fence {
                queues: vec![rq(7, 0).into(), rq(9, 0).into()],
                unfenced: None,
            })
        );
    }

    #[test]
    fn a_read_only_mapping_sent_no_writes_to_fence() {
        for refs in [None, Some(vec![Some(rq(7, 0))]), Some(vec![None; 5])] {
            let r = Record {
                readonly: true,
                ..dead(2, refs)
            };
            let nothing = Fence {
                queues: vec![],
                unfenced: None,
            };
            assert_eq!(fence_plan(&r, 2), Ok(nothing));
        }
    }

    #[test]
    fn an_older_record_recovers_unfenced_with_a_warning() {
        let f = fence_plan(&dead(2, None), 2).unwrap();
        assert!(f.queues.is_empty());
        let w = f.unfenced.expect("no warning");
        assert!(
            w.contains("/dev/ublkb3") && w.contains("older blkwire") && w.contains("not fenced"),
            "{w}"
        );
    }

    #[test]
    fn queues_without_identity_are_left_unfenced_with_a_warning() {
        // nvme-tcp:// queues have no session identity to name.
        let f = fence_plan(&dead(3, Some(vec![None, Some(rq(7, 1)), None])), 3).unwrap();
        assert_eq!(f.queues, vec![QueueRef::from(rq(7, 1))]);
        let w = f.unfenced.expect("no warning");
        assert!(w.contains("2 of the dead daemon's 3 queue(s)"), "{w}");
        let f = fence_plan(&dead(1, Some(vec![None])), 1).unwrap();
        assert!(f.queues.is_empty() && f.unfenced.is_some(), "{f:?}");
    }

    #[test]
    fn a_record_whose_queue_count_is_not_the_devices_is_refused() {
        let one = Some(rq(7, 0));
        // More entries than the record's queues, fewer, or a record claiming more queues than
        // the kernel's device has (a damaged record must not make a session per entry).
        for (queues, refs, device) in [
            (2, vec![one; 3], 2),
            (2, vec![one; 1], 2),
            (65535, vec![one; 65535], 2),
            (2, vec![one; 2], 4),
        ] {
            let e = fence_plan(&dead(queues, Some(refs)), device).unwrap_err();
            assert!(
                e.contains("damaged record") && e.contains("cannot recover"),
                "{e}"
            );
        }
    }

    #[test]
    fn nothing_to_fence_connects_to_nothing() {
        // Port 1 on loopback: a connection would fail.
        let url = Url::parse("tcp://127.0.0.1:1/d").unwrap();
        let f = Fence {
            queues: vec![],
            unfenced: Some("warned".into()),
        };
        assert_eq!(
            fence_dead_daemon("/dev/ublkb3", f, &url, &ConnectOptions::default()),
            Ok(())
        );
        let f = Fence {
            queues: vec![rq(7, 0).into()],
            unfenced: None,
        };
        let opts = ConnectOptions {
            timeout: Duration::from_secs(1),
            ..Default::default()
        };
        let e = fence_dead_daemon("/dev/ublkb3", f, &url, &opts).unwrap_err();
        assert!(
            e.starts_with("/dev/ublkb3: fencing session 7 queue 0:")
                && e.ends_with("cannot recover"),
            "{e}"
        );
    }

    #[test]
    fn fencing_runs_on_a_bounded_number_of_threads() {
        let items: Vec<usize> = (0..40).collect();
        let (now, most, done) = (
            AtomicUsize::new(0),
            AtomicUsize::new(0),
            AtomicUsize::new(0),
        );
        let errors = run_bounded(&items, 4, "t", |_| {
            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(2));
            now.fetch_sub(1, Ordering::SeqCst);
            done.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(done.load(Ordering::SeqCst), 40);
        let most = most.load(Ordering::SeqCst);
        assert!((1..=4).contains(&most), "{most} at once");
        assert!(run_bounded(&[] as &[usize], 4, "t", |_| Err("no".into())).is_empty());
    }

    #[test]
    fn fencing_starts_no_further_queue_after_a_failure() {
        let items: Vec<usize> = (0..1000).collect();
        let started = AtomicUsize::new(0);
        let errors = run_bounded(&items, 2, "t", |&i| {
            started.fetch_add(1, Ordering::SeqCst);
            if i == 3 || i == 1 {
                return Err(format!("queue {i}"));
            }
            std::thread::sleep(Duration::from_millis(1));
            Ok(())
        });
        // In item order; at most the other thread's item runs after the first failure.
        assert!(errors[0] == "queue 1", "{errors:?}");
        assert!(errors.len() <= 2, "{errors:?}");
        let started = started.load(Ordering::SeqCst);
        assert!(started <= 4, "{started} items started");
    }

    const NEEDS: Needs = Needs {
        size: 1 << 30,
        logical_block: 512,
        max_io: 1 << 20,
        depth: 64,
        writable: true,
        volatile_cache: true,
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
        // Set up without a write cache (the export had no FLUSH): one that has one now would
        // never be flushed. A read-only device writes nothing to lose.
        let uncached = Needs {
            volatile_cache: false,
            ..NEEDS
        };
        let e = uncached.check(&info()).expect_err("a new write cache");
        assert!(e.contains("write cache"), "{e}");
        let reader = Needs {
            writable: false,
            ..uncached
        };
        let ro = ExportInfo {
            features: Features(Features::READ_ONLY | Features::FLUSH),
            ..info()
        };
        assert_eq!(reader.check(&ro), Ok(()));
    }
}
