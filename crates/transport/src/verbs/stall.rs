//! Noticing a queue pair that stopped completing work.
//!
//! A reliable-connected queue pair retransmits a lost request after its local ACK
//! timeout and fails after its retry count, so a lost packet normally ends in a
//! completion (success after a retransmission, or an error that resets the queue pair).
//! A device can still lose a request without either: SoftRoCE under load was seen to
//! hold a READ for 30 s with no retransmission and no error, until the batch timed out;
//! with an ACK timeout of 0 (wait for ever) any lost packet does that. [`StallWatch`]
//! notices it from the outside: work outstanding, and the completion queue's progress
//! marker ([`Endpoint::reported`](super::Endpoint::reported)) standing still for the
//! stall limit. The link then resets and reconnects the queue pair, which posts the
//! unconfirmed reads and writes again (both are idempotent: the same bytes to the same
//! place, each batch's fence read after its data again).
//!
//! Sans-IO: the caller passes the time.

use std::time::{Duration, Instant};

/// Watches one endpoint's progress marker while it has work outstanding.
#[derive(Debug)]
pub(crate) struct StallWatch {
    base: Duration,
    /// The current limit: `base`, doubled after each stall the reset did not cure (no
    /// progress in between), so that a device merely slower than the limit is not reset
    /// over and over with the same work.
    limit: Duration,
    /// The marker when it last moved (or when work became outstanding), and since when.
    last: Option<(u64, Instant)>,
}

/// The limit grows to at most this many times the base.
const MAX_BACKOFF: u32 = 8;

impl StallWatch {
    /// A watch that reports a stall after `limit` without progress.
    pub(crate) fn new(limit: Duration) -> Self {
        Self {
            base: limit,
            limit,
            last: None,
        }
    }

    /// Called after each poll of the endpoint, with its progress `marker`, whether it has
    /// work `outstanding`, and the time. Returns how long the marker stood still when that
    /// reaches the limit; the watch then starts over, with the limit doubled until the
    /// marker moves again.
    pub(crate) fn observe(
        &mut self,
        marker: u64,
        outstanding: bool,
        now: Instant,
    ) -> Option<Duration> {
        if !outstanding {
            self.last = None;
            return None;
        }
        match self.last {
            Some((seen, since)) if seen == marker => {
                let still = now.saturating_duration_since(since);
                if still < self.limit {
                    return None;
                }
                self.last = Some((marker, now));
                self.limit = (self.limit * 2).min(self.base * MAX_BACKOFF);
                Some(still)
            }
            Some(_) => {
                // The completion queue reported work: progress.
                self.limit = self.base;
                self.last = Some((marker, now));
                None
            }
            None => {
                // Work just became outstanding.
                self.last = Some((marker, now));
                None
            }
        }
    }

    /// Forgets the marker: the queue pair was reset for another reason (an error or a
    /// timed-out batch), and the work it posts again gets a full limit.
    pub(crate) fn restart(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn an_idle_queue_pair_never_stalls() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(LIMIT);
        for s in 0..100 {
            assert_eq!(w.observe(7, false, at(t0, s * 1000)), None);
        }
    }

    #[test]
    fn outstanding_work_with_a_still_marker_stalls_and_backs_off() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(LIMIT);
        assert_eq!(w.observe(3, true, t0), None);
        assert_eq!(w.observe(3, true, at(t0, 9_999)), None);
        assert_eq!(
            w.observe(3, true, at(t0, 10_000)),
            Some(Duration::from_secs(10))
        );
        // Started over, and the reset did not cure it: the next report waits twice as
        // long, then four times, up to eight times the base.
        assert_eq!(w.observe(3, true, at(t0, 29_999)), None);
        assert_eq!(
            w.observe(3, true, at(t0, 30_500)),
            Some(Duration::from_millis(20_500))
        );
        assert_eq!(w.observe(3, true, at(t0, 70_499)), None);
        assert!(w.observe(3, true, at(t0, 70_500)).is_some());
        assert!(w.observe(3, true, at(t0, 150_500)).is_some());
        assert_eq!(w.observe(3, true, at(t0, 230_499)), None);
        assert!(w.observe(3, true, at(t0, 230_500)).is_some());
        // Progress brings the base limit back.
        assert_eq!(w.observe(4, true, at(t0, 231_000)), None);
        assert_eq!(w.observe(4, true, at(t0, 240_999)), None);
        assert!(w.observe(4, true, at(t0, 241_000)).is_some());
    }

    #[test]
    fn a_moving_marker_is_progress() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(LIMIT);
        for s in 0..100u64 {
            // One completion every 9 s: slow, never stalled.
            assert_eq!(w.observe(s, true, at(t0, s * 9_000)), None);
        }
    }

    #[test]
    fn the_clock_starts_when_work_becomes_outstanding() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(LIMIT);
        assert_eq!(w.observe(5, true, t0), None);
        // Idle for a minute: work posted now is not 60 s late.
        assert_eq!(w.observe(5, false, at(t0, 1_000)), None);
        assert_eq!(w.observe(5, true, at(t0, 60_000)), None);
        assert_eq!(w.observe(5, true, at(t0, 69_000)), None);
        // A reset for another reason gives the re-posted work a full limit too.
        w.restart();
        assert_eq!(w.observe(5, true, at(t0, 69_500)), None);
        assert_eq!(w.observe(5, true, at(t0, 79_499)), None);
        assert!(w.observe(5, true, at(t0, 79_500)).is_some());
    }
}
