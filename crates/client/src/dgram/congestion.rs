//! Loss detection, retransmission timing and the send window of a datagram queue (PROTOCOL.md
//! §9.2, §9.4): the round-trip estimate, RACK-TLP (RFC 8985) loss detection with its reordering
//! window and tail-loss probe, and the congestion window bounded by the target's credit and our
//! receive buffer.
//!
//! Pure: no I/O and no clock of its own. The queue passes in the `Instant`s it read, so every
//! rule here can be driven through any timeline in a unit test.

use std::time::{Duration, Instant};

/// Timer bounds (PROTOCOL.md §9.2).
pub(crate) const RTO_MIN: Duration = Duration::from_millis(5);
pub(crate) const RTO_MAX: Duration = Duration::from_secs(1);
pub(crate) const RTO_INITIAL: Duration = Duration::from_millis(20);
/// Floor of the tail-loss probe timeout: below this, scheduling noise on a busy host would fire it.
const PTO_MIN: Duration = Duration::from_micros(200);
/// Floor of the reordering window (§9.2): below this, a frame delayed by an interrupt on the
/// path would be taken for lost.
const REORDER_MIN: Duration = Duration::from_micros(50);

/// The timing of one request's latest transmission.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transmission {
    /// When it last left (first send, retransmission or HAVE-driven resend).
    pub sent_at: Instant,
    /// Its own retransmission timeout: the queue's at first send, doubled at each retransmission
    /// (§9.2), so a request that keeps getting lost backs off without slowing the others.
    pub rto: Duration,
    /// When it fails with EIO if still unanswered (§9.2).
    pub give_up_at: Instant,
    /// Sent more than once: an answer may be to any copy (Karn), so it gives no RTT sample.
    pub retransmitted: bool,
    /// When it was taken for lost and a probe asked about it instead of resending it (§9.2);
    /// its timer then runs from here.
    pub suspected_at: Option<Instant>,
}

impl Transmission {
    /// A first transmission at `now`.
    pub fn first(now: Instant, rto: Duration, give_up: Duration) -> Transmission {
        Transmission {
            sent_at: now,
            rto,
            give_up_at: crate::deadline::later(now, give_up),
            retransmitted: false,
            suspected_at: None,
        }
    }

    /// Taken for lost at `now` but not sent again: a probe asks first (§9.2). Its timer backs
    /// off from here; its send time stays, so an answer still times the round trip.
    pub fn suspect(&mut self, now: Instant) {
        self.suspected_at = Some(now);
        self.rto = (self.rto * 2).min(RTO_MAX);
    }

    /// Sent again at `now` because it is taken as lost: its timer backs off (§9.2), once per
    /// loss: a request suspected first backed off then (`suspect`), and doubling again here
    /// made it wait four times as long before the next try.
    pub fn resend(&mut self, now: Instant) {
        self.sent_at = now;
        if self.suspected_at.is_none() {
            self.rto = (self.rto * 2).min(RTO_MAX);
        }
        self.retransmitted = true;
        self.suspected_at = None;
    }

    /// Its missing fragments were sent again at `now` at the target's request (a HAVE reply,
    /// §9.3): not a loss of ours, so the timer does not back off, but an answer can no longer
    /// be timed.
    pub fn refresh(&mut self, now: Instant) {
        self.sent_at = now;
        self.retransmitted = true;
        self.suspected_at = None;
    }

    /// When its retransmission or give-up timer fires, whichever is first.
    pub fn deadline(&self) -> Instant {
        (self.suspected_at.unwrap_or(self.sent_at) + self.rto).min(self.give_up_at)
    }

    /// Past its give-up time at `now`?
    pub fn expired(&self, now: Instant) -> bool {
        now >= self.give_up_at
    }
}

/// What one pass of the timers works with: the round trip and reordering window as they stood
/// when it began, so answers given up on during the pass do not move the bar for the rest.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pass {
    srtt: Duration,
    reorder: Duration,
    /// Whether the slot table is to be scanned this time (see `Congestion::begin_pass`).
    pub scan: bool,
}

/// Per-queue loss detection and window state (PROTOCOL.md §9.2, §9.4).
#[derive(Debug)]
pub(crate) struct Congestion {
    /// Frames of requests in flight (requests and, for READs, their reply fragments).
    in_flight_frames: u32,
    /// Congestion window in frames (AIMD), never above `credit`.
    cwnd: f64,
    /// Frames the target grants this queue (§9.4), from the latest reply that carried one.
    credit: u32,
    /// Frames of replies our receive buffer holds.
    rx_cap: u32,
    /// When the window was last cut: at most once per round trip (one loss episode).
    last_decrease: Instant,
    /// Send time of the most recently sent request that has been answered (RACK).
    newest_answered: Option<Instant>,
    /// Smallest round trip seen: tells an answer to a retransmission from a late first answer.
    min_rtt: Option<Duration>,
    /// Last valid reply, or last tail-loss probe.
    last_progress: Instant,
    /// Probes sent since the last valid reply: each waits twice as long as the one before.
    probes_unanswered: u32,
    /// When the timers last looked at every request in flight.
    last_scan: Instant,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    /// Floor of `rto` (RTO_MIN; tests raise it to show what the tail-loss probe alone recovers).
    rto_min: Duration,
}

impl Congestion {
    /// A queue granted `credit` frames whose receive buffer holds `rx_cap` reply frames. The
    /// window starts at the credit, at most 64 frames: a LAN's receiver buffer, not slow start,
    /// is what bounds a burst.
    pub fn new(credit: u32, rx_cap: u32, now: Instant) -> Congestion {
        Congestion {
            in_flight_frames: 0,
            cwnd: (credit.max(1) as f64).min(64.0),
            credit: credit.max(1),
            rx_cap,
            last_decrease: now,
            newest_answered: None,
            min_rtt: None,
            last_progress: now,
            probes_unanswered: 0,
            last_scan: now,
            srtt: None,
            rttvar: Duration::ZERO,
            rto: RTO_INITIAL,
            rto_min: RTO_MIN,
        }
    }

    /// Frames that may be in flight: the congestion window, bounded by the target's credit and
    /// by what our receive buffer holds (§9.4).
    pub fn window(&self) -> u32 {
        (self.cwnd as u32).clamp(1, self.credit.min(self.rx_cap))
    }

    /// The retransmission timeout a request sent now gets (§9.2).
    pub fn rto(&self) -> Duration {
        self.rto
    }

    /// Frames of requests in flight.
    #[cfg(test)]
    pub fn in_flight_frames(&self) -> u32 {
        self.in_flight_frames
    }

    /// Raises the floor of the retransmission timeout (tests that isolate the tail-loss probe).
    #[cfg(test)]
    pub fn set_rto_min(&mut self, min: Duration) {
        self.rto_min = min;
    }

    /// May a request counting `frames` against the window leave now? One always may when
    /// nothing is in flight, however large, or it could never be sent.
    pub fn admits(&self, frames: u32) -> bool {
        self.in_flight_frames == 0 || self.in_flight_frames + frames <= self.window()
    }

    /// A request counting `frames` left.
    pub fn on_send(&mut self, frames: u32) {
        self.in_flight_frames += frames;
    }

    /// A reply for this queue carried `credit` (0: none, the grant stands).
    pub fn on_credit(&mut self, credit: u16) {
        if credit > 0 {
            self.credit = credit as u32;
        }
    }

    /// A valid reply to a request in flight arrived at `now`: the tail-loss probe waits again.
    pub fn on_progress(&mut self, now: Instant) {
        self.last_progress = now;
        self.probes_unanswered = 0;
    }

    /// A request counting `frames` was given up unanswered: its frames are free, but nothing
    /// came back, so there is no round trip to learn, no transmission known to have arrived
    /// (an answered one would make every request sent before it look lost), and no reason to
    /// open the window.
    pub fn on_give_up(&mut self, frames: u32) {
        self.in_flight_frames -= frames.min(self.in_flight_frames);
    }

    /// A request counting `frames`, last transmitted as `tx`, is answered at `now`: frees its
    /// frames, learns from its round trip and opens the window.
    pub fn on_finish(&mut self, tx: &Transmission, frames: u32, now: Instant) {
        self.in_flight_frames -= frames.min(self.in_flight_frames);
        let elapsed = now.saturating_duration_since(tx.sent_at);
        // The newest transmission known to have arrived (RACK, RFC 8985). An answer to a
        // retransmission that comes sooner than any round trip can be an answer to the first
        // copy, so it proves nothing about when it was sent (§9.2).
        if !tx.retransmitted || self.min_rtt.is_some_and(|m| elapsed >= m) {
            self.newest_answered = Some(
                self.newest_answered
                    .map_or(tx.sent_at, |t| t.max(tx.sent_at)),
            );
        }
        if !tx.retransmitted {
            // Karn: only unambiguous samples; Jacobson/Karels smoothing (§9.2).
            let sample = elapsed;
            self.min_rtt = Some(self.min_rtt.map_or(sample, |m| m.min(sample)));
            let (srtt, var) = match self.srtt {
                None => (sample, sample / 2),
                Some(srtt) => {
                    let diff = srtt.abs_diff(sample);
                    (srtt * 7 / 8 + sample / 8, self.rttvar * 3 / 4 + diff / 4)
                }
            };
            self.srtt = Some(srtt);
            self.rttvar = var;
            self.rto = (srtt + 4 * var).clamp(self.rto_min, RTO_MAX);
        }
        // Growth: every answered frame opens the window by one (it doubles per round trip), up to
        // the target's credit. The receiver's buffer, not a guess, is what bounds us on a LAN.
        self.cwnd = (self.cwnd + frames as f64).min(self.credit as f64);
    }

    /// How far frames on one link may overtake each other (§9.2): `max(SRTT / 4, 50 us)`.
    pub fn reorder_window(&self) -> Duration {
        (self.srtt.unwrap_or(RTO_INITIAL) / 4).max(REORDER_MIN)
    }

    /// When the next pass may scan the slots (`begin_pass`): a slot timer due before that
    /// cannot be acted on sooner, so no caller should wake for it sooner.
    pub fn next_scan(&self) -> Instant {
        self.last_scan + self.reorder_window() / 2
    }

    /// Starts a pass of the timers at `now`. The slot scan runs at most every half reordering
    /// window (25 us or more): no loss can be declared sooner than that after it happens, and a
    /// busy queue calls this every few microseconds, where scanning the whole slot table each
    /// time was a visible cost.
    pub fn begin_pass(&mut self, now: Instant) -> Pass {
        let srtt = self.srtt.unwrap_or(RTO_INITIAL);
        let reorder = self.reorder_window();
        let scan = now >= self.last_scan + reorder / 2;
        if scan {
            self.last_scan = now;
        }
        Pass {
            srtt,
            reorder,
            scan,
        }
    }

    /// Is a request in flight, last transmitted as `tx`, lost at `now`? Its timer fired, or
    /// (RACK, §9.2) a request sent more than a reordering window after it has been answered and
    /// a round trip plus that window has passed since it was sent.
    pub fn lost(&self, tx: &Transmission, pass: &Pass, now: Instant) -> bool {
        // Asked about already: only its backed-off timer tells now.
        if let Some(t) = tx.suspected_at {
            return now >= t + tx.rto;
        }
        let overtaken = self
            .newest_answered
            .is_some_and(|t| t > tx.sent_at + pass.reorder)
            && now >= tx.sent_at + pass.srtt + pass.reorder;
        now >= tx.sent_at + tx.rto || overtaken
    }

    /// Ends a pass in which `lost` requests were found lost: a gentle multiplicative decrease
    /// (x 7/8), once per loss episode (a round trip). On a storage LAN most loss is a full buffer
    /// or a corrupt frame, not a congested path, and halving on every random loss starves the
    /// queue (measured: 1 % loss cost 80 % of the IOPS). The base timer is left alone: each
    /// request backs off its own.
    pub fn end_pass(&mut self, pass: &Pass, lost: bool, now: Instant) {
        if lost && now.duration_since(self.last_decrease) > pass.srtt {
            self.cwnd = (self.cwnd * 0.875).max(1.0);
            self.last_decrease = now;
        }
    }

    /// A probe's answer showed frames lost at `now`: the same decrease, once per loss episode.
    pub fn on_loss(&mut self, now: Instant) {
        let pass = Pass {
            srtt: self.srtt.unwrap_or(RTO_INITIAL),
            reorder: self.reorder_window(),
            scan: false,
        };
        self.end_pass(&pass, true, now);
    }

    /// Tail-loss probe timeout (§9.2): two smoothed round trips, at least 200 us, never above
    /// the retransmission timeout.
    pub fn pto(&self) -> Duration {
        (2 * self.srtt.unwrap_or(RTO_INITIAL)).clamp(PTO_MIN, self.rto.max(PTO_MIN))
    }

    /// When the tail-loss probe is due, if anything is in flight: a PTO after the last reply,
    /// doubled for each probe sent since (up to the RTO), so a target that is merely slow is
    /// not asked every 200 us.
    pub fn probe_deadline(&self) -> Option<Instant> {
        let wait = (self.pto() * (1 << self.probes_unanswered.min(16))).min(self.rto.max(PTO_MIN));
        (self.in_flight_frames > 0).then(|| self.last_progress + wait)
    }

    /// Is a tail-loss probe due at `now` (RFC 8985 §7)? Requests are in flight but nothing has
    /// come back for a probe timeout. Packing can put a whole burst in one datagram, and if that
    /// one is lost no later answer can show it; the probe's answer does.
    pub fn probe_due(&self, now: Instant) -> bool {
        self.probe_deadline().is_some_and(|t| now >= t)
    }

    /// A probe was sent at `now`: the next one waits a probe timeout from here.
    pub fn on_probe(&mut self, now: Instant) {
        self.last_progress = now;
        self.probes_unanswered += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    /// A queue with ample credit that has learnt a steady round trip of `rtt` from `n` answers;
    /// returns it and the time the last answer came.
    fn learnt(rtt: Duration, n: u32) -> (Congestion, Instant) {
        let t0 = Instant::now();
        let mut c = Congestion::new(64, 1024, t0);
        let mut now = t0;
        for _ in 0..n {
            let tx = Transmission::first(now, c.rto(), Duration::from_secs(30));
            c.on_send(1);
            now += rtt;
            c.on_finish(&tx, 1, now);
            c.on_progress(now);
        }
        (c, now)
    }

    #[test]
    fn round_trips_set_the_timer_within_its_bounds() {
        // The first sample: SRTT = sample, RTTVAR = sample / 2, RTO = 3 samples.
        let (c, _) = learnt(4 * MS, 1);
        assert_eq!(c.srtt, Some(4 * MS));
        assert_eq!(c.rto(), 12 * MS);
        // A steady 100 us round trip converges below the 5 ms floor: clamped to it.
        let (c, _) = learnt(100 * US, 50);
        assert_eq!(c.rto(), RTO_MIN);
        // A 400 ms round trip would need more than a second: clamped to the ceiling.
        let (c, _) = learnt(400 * MS, 1);
        assert_eq!(c.rto(), RTO_MAX);
    }

    #[test]
    fn a_retransmitted_request_gives_no_round_trip_sample() {
        let (mut c, now) = learnt(4 * MS, 1);
        let mut tx = Transmission::first(now, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        tx.resend(now + 12 * MS);
        // Answered 1 ms after the resend, or 13 ms after the first copy: either could be meant.
        c.on_finish(&tx, 1, now + 13 * MS);
        assert_eq!(
            (c.srtt, c.rto(), c.min_rtt),
            (Some(4 * MS), 12 * MS, Some(4 * MS))
        );
        assert_eq!(c.in_flight_frames(), 0);
    }

    #[test]
    fn each_retransmission_doubles_the_request_timer_up_to_one_second() {
        let now = Instant::now();
        let mut tx = Transmission::first(now, 20 * MS, Duration::from_secs(30));
        let mut want = 20 * MS;
        for i in 1..10 {
            tx.resend(now + i * MS);
            want = (want * 2).min(RTO_MAX);
            assert_eq!(tx.rto, want);
            assert_eq!(tx.sent_at, now + i * MS);
            assert!(tx.retransmitted);
        }
        assert_eq!(tx.rto, RTO_MAX);
        // Suspected first (its timer backed off then, a probe asked), then sent again: one
        // back-off for the one loss, not two.
        let mut tx = Transmission::first(now, 20 * MS, Duration::from_secs(30));
        tx.suspect(now + MS);
        assert_eq!(tx.rto, 40 * MS);
        tx.resend(now + 41 * MS);
        assert_eq!((tx.rto, tx.suspected_at), (40 * MS, None));
        tx.resend(now + 81 * MS);
        assert_eq!(tx.rto, 80 * MS, "the next loss backs off again");
        // A HAVE-driven resend is not our loss: no back-off.
        let mut tx = Transmission::first(now, 20 * MS, Duration::from_secs(30));
        tx.refresh(now + MS);
        assert_eq!(
            (tx.rto, tx.sent_at, tx.retransmitted),
            (20 * MS, now + MS, true)
        );
    }

    /// Sends `a`, then `b` `gap` later, answers `b` one round trip after it, and returns the
    /// queue, `a`'s transmission and the time of `b`'s answer.
    fn overtake(gap: Duration) -> (Congestion, Transmission, Instant) {
        let rtt = 400 * US;
        let (mut c, t) = learnt(rtt, 20);
        let a = Transmission::first(t, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        let b = Transmission::first(t + gap, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        c.on_finish(&b, 1, t + gap + rtt);
        (c, a, t + gap + rtt)
    }

    #[test]
    fn a_lost_request_is_detected_once_a_later_one_is_answered_and_the_window_has_passed() {
        let (mut c, a, answered) = overtake(300 * US);
        // SRTT 400 us: the reordering window is 100 us, far below the 5 ms timer.
        assert_eq!(c.reorder_window(), 100 * US);
        let due = a.sent_at + 400 * US + 100 * US;
        assert!(due < a.sent_at + a.rto);
        let pass = c.begin_pass(answered);
        assert!(
            !c.lost(&a, &pass, due - US),
            "declared lost inside the window"
        );
        assert!(c.lost(&a, &pass, due), "not declared lost after the window");
    }

    #[test]
    fn a_request_overtaken_within_the_reordering_window_is_only_reordered() {
        // `b` left only 80 us after `a`: its answer coming first is reordering, not loss.
        let (mut c, a, answered) = overtake(80 * US);
        let pass = c.begin_pass(answered);
        let later = a.sent_at + 4 * MS;
        assert!(!c.lost(&a, &pass, later));
        // Its own timer still fires.
        assert!(c.lost(&a, &pass, a.sent_at + a.rto));
    }

    #[test]
    fn an_answer_sooner_than_the_smallest_round_trip_is_not_proof() {
        let rtt = 400 * US;
        let (mut c, t) = learnt(rtt, 20);
        let a = Transmission::first(t, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        let mut b = Transmission::first(t + 10 * US, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        // `b` is probed 1 ms later, and an answer comes 100 us after the probe: sooner than any
        // round trip, so it may answer b's first copy and says nothing about the probe's time.
        b.resend(t + MS);
        c.on_finish(&b, 1, t + MS + 100 * US);
        let now = t + 2 * MS;
        let pass = c.begin_pass(now);
        assert!(
            !c.lost(&a, &pass, now),
            "a quick answer to a resend overtook `a`"
        );

        // The same answer a full round trip after the probe proves the probe arrived.
        let (mut c, t) = learnt(rtt, 20);
        let a = Transmission::first(t, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        let mut b = Transmission::first(t + 10 * US, c.rto(), Duration::from_secs(30));
        c.on_send(1);
        b.resend(t + MS);
        c.on_finish(&b, 1, t + MS + rtt);
        let now = t + 2 * MS;
        let pass = c.begin_pass(now);
        assert!(
            c.lost(&a, &pass, now),
            "a timed answer to a resend did not overtake `a`"
        );
    }

    #[test]
    fn the_probe_fires_after_two_round_trips_of_silence() {
        let rtt = 400 * US;
        let (mut c, t) = learnt(rtt, 20);
        assert_eq!(
            c.probe_deadline(),
            None,
            "nothing in flight, nothing to probe"
        );
        assert!(!c.probe_due(t + Duration::from_secs(1)));
        c.on_send(1);
        assert_eq!(c.pto(), 2 * rtt);
        assert!(!c.probe_due(t + 2 * rtt - US));
        assert!(c.probe_due(t + 2 * rtt));
        // The probe restarts the wait, doubled for each probe without an answer in between:
        // a target that is merely slow is not asked every PTO.
        c.on_probe(t + 2 * rtt);
        assert!(!c.probe_due(t + 6 * rtt - US));
        assert!(c.probe_due(t + 6 * rtt));
        c.on_probe(t + 6 * rtt);
        assert!(!c.probe_due(t + 14 * rtt - US));
        assert!(c.probe_due(t + 14 * rtt));
        // An answer restarts it at one PTO.
        c.on_progress(t + 7 * rtt);
        assert!(!c.probe_due(t + 9 * rtt - US));
        assert!(c.probe_due(t + 9 * rtt));
    }

    #[test]
    fn probes_back_off_no_further_than_the_rto() {
        let rtt = 400 * US;
        let (mut c, t) = learnt(rtt, 20);
        c.on_send(1);
        let mut at = t;
        for _ in 0..40 {
            at = c.probe_deadline().expect("in flight");
            c.on_probe(at);
        }
        assert_eq!(c.probe_deadline(), Some(at + c.rto()));
    }

    #[test]
    fn the_probe_timeout_stays_between_200_us_and_the_rto() {
        // 2 * 20 us would fire on scheduling noise.
        let (c, _) = learnt(20 * US, 50);
        assert_eq!(c.pto(), PTO_MIN);
        // 2 * 600 ms is above the RTO (clamped to 1 s): the timer would come first anyway.
        let (c, _) = learnt(600 * MS, 1);
        assert_eq!(c.rto(), RTO_MAX);
        assert_eq!(c.pto(), c.rto());
    }

    /// A request given up unanswered frees its frames and teaches nothing: the round trip,
    /// the window and the newest transmission known to have arrived are as they were.
    #[test]
    fn a_request_given_up_frees_its_frames_and_teaches_nothing() {
        let (mut c, now) = learnt(100 * US, 8);
        let late = now + 5 * MS;
        let tx = Transmission::first(now, c.rto(), 2 * MS);
        c.on_send(3);
        let (srtt, cwnd, newest, frames) = (c.srtt, c.cwnd, c.newest_answered, c.in_flight_frames);
        c.on_give_up(3);
        assert_eq!(c.in_flight_frames, frames - 3);
        assert_eq!((c.srtt, c.cwnd, c.newest_answered), (srtt, cwnd, newest));
        // Taken for an answer, it would have changed them.
        c.on_send(3);
        c.on_finish(&tx, 3, late);
        assert_ne!((c.srtt, c.cwnd, c.newest_answered), (srtt, cwnd, newest));
    }

    #[test]
    fn credit_and_receive_buffer_bound_what_may_be_sent() {
        let now = Instant::now();
        let mut c = Congestion::new(8, 1024, now);
        assert_eq!(c.window(), 8);
        // Nothing in flight: even a request larger than the window may go, or it never would.
        assert!(c.admits(20));
        c.on_send(6);
        assert!(c.admits(2));
        assert!(!c.admits(3));
        // The target lowers its grant: fewer frames may follow.
        c.on_credit(7);
        assert!(!c.admits(2));
        assert!(c.admits(1));
        // A reply without a credit leaves the grant alone.
        c.on_credit(0);
        assert_eq!(c.window(), 7);
        // Our receive buffer bounds the window as much as the target's credit does.
        let c = Congestion::new(64, 5, now);
        assert_eq!(c.window(), 5);
    }

    #[test]
    fn answers_open_the_window_up_to_the_credit() {
        let now = Instant::now();
        let mut c = Congestion::new(512, 4096, now);
        assert_eq!(c.window(), 64, "the window starts at 64 frames at most");
        let tx = Transmission::first(now, c.rto(), Duration::from_secs(30));
        c.on_send(16);
        c.on_finish(&tx, 16, now + MS);
        assert_eq!(c.window(), 80);
        for _ in 0..100 {
            c.on_send(16);
            c.on_finish(&tx, 16, now + MS);
        }
        assert_eq!(c.window(), 512);
    }

    #[test]
    fn losses_cut_the_window_by_an_eighth_once_per_round_trip() {
        let rtt = 400 * US;
        let (mut c, t) = learnt(rtt, 20);
        let before = c.cwnd;
        let pass = c.begin_pass(t + MS);
        c.end_pass(&pass, true, t + MS);
        assert_eq!(c.cwnd, before * 0.875);
        // Another loss in the same round trip is the same episode.
        let pass = c.begin_pass(t + MS + rtt / 2);
        c.end_pass(&pass, true, t + MS + rtt / 2);
        assert_eq!(c.cwnd, before * 0.875);
        // A pass without loss changes nothing; a loss a round trip later cuts again.
        let pass = c.begin_pass(t + 2 * MS);
        c.end_pass(&pass, false, t + 2 * MS);
        assert_eq!(c.cwnd, before * 0.875);
        let pass = c.begin_pass(t + 2 * MS);
        c.end_pass(&pass, true, t + 2 * MS);
        assert_eq!(c.cwnd, before * 0.875 * 0.875);
    }

    #[test]
    fn the_slot_scan_runs_at_most_every_half_reordering_window() {
        let (mut c, t) = learnt(400 * US, 20);
        // Reordering window 100 us: a scan at most every 50 us.
        assert!(c.begin_pass(t + 50 * US).scan);
        assert!(!c.begin_pass(t + 99 * US).scan);
        assert!(c.begin_pass(t + 100 * US).scan);
        // With no round trip yet the window is SRTT 20 ms / 4 = 5 ms, a scan every 2.5 ms.
        let t = Instant::now();
        let mut c = Congestion::new(64, 1024, t);
        assert!(!c.begin_pass(t + 2 * MS).scan);
        assert!(c.begin_pass(t + 2500 * US).scan);
        // The window never shrinks below 50 us.
        let (c, _) = learnt(20 * US, 50);
        assert_eq!(c.reorder_window(), REORDER_MIN);
    }

    #[test]
    fn a_request_times_out_by_its_own_timer_and_gives_up_at_its_deadline() {
        let now = Instant::now();
        let tx = Transmission::first(now, 20 * MS, 30 * MS);
        assert_eq!(tx.deadline(), now + 20 * MS);
        assert!(!tx.expired(now + 30 * MS - US));
        assert!(tx.expired(now + 30 * MS));
        let mut c = Congestion::new(64, 1024, now);
        let pass = c.begin_pass(now);
        assert!(!c.lost(&tx, &pass, now + 20 * MS - US));
        assert!(c.lost(&tx, &pass, now + 20 * MS));
        // Give-up before the timer: the earlier of the two is the deadline.
        let tx = Transmission::first(now, 20 * MS, 10 * MS);
        assert_eq!(tx.deadline(), now + 10 * MS);
    }
}
