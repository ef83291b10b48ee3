//! Clock offset between this host and a peer, from handshake round trips.
//!
//! Bidirectional mode: D tells P until when it keeps a cached request's blocks, as a
//! [`PeerTimestamp`] on D's clock. P measures its offset to D's clock from handshake round
//! trips and declines a pull that would finish too close to the deadline (it recomputes
//! instead).

use std::time::Duration;

use crate::time::{PeerTimestamp, Timestamp, duration_nanos};

/// Why a clock sample was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockSampleError {
    /// The reply was received before the request was sent.
    #[error("clock sample answered at {t1:?}, before it was sent at {t0:?}")]
    Reversed {
        /// When the request was sent (local).
        t0: Timestamp,
        /// When the reply arrived (local).
        t1: Timestamp,
    },
}

/// The measured offset of a peer's clock: `peer time − local time`, with the round trip of
/// the sample it came from.
///
/// Signed: the peer's epoch may be earlier or later than ours. The true offset lies within
/// ± rtt/2 of the estimate (the peer read its clock somewhere during the round trip), which
/// [`ClockOffset::deadline_leaves`] takes into account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClockOffset {
    /// Peer minus local, in nanoseconds.
    peer_minus_local_ns: i128,
    rtt: Duration,
}

impl ClockOffset {
    /// An offset known exactly (tests, simulation): peer time = local time + `peer_minus_local_ns`.
    pub fn from_nanos(peer_minus_local_ns: i128) -> Self {
        Self {
            peer_minus_local_ns,
            rtt: Duration::ZERO,
        }
    }

    /// Peer time minus local time, in nanoseconds.
    pub fn peer_minus_local_nanos(&self) -> i128 {
        self.peer_minus_local_ns
    }

    /// The round trip of the sample this offset came from; the offset's error is at most
    /// half of it.
    pub fn rtt(&self) -> Duration {
        self.rtt
    }

    /// The local time that `peer` corresponds to (the midpoint estimate).
    ///
    /// Saturates at the local epoch (a peer time before our epoch is in the past for us) and
    /// at `u64::MAX` nanoseconds.
    pub fn to_local(&self, peer: PeerTimestamp) -> Timestamp {
        let ns = i128::from(peer.as_nanos_saturating()) - self.peer_minus_local_ns;
        Timestamp::from_nanos(clamp_u64(ns))
    }

    /// The peer time that local `t` corresponds to (the midpoint estimate), saturating at the
    /// peer's epoch and at `u64::MAX` nanoseconds.
    pub fn to_peer(&self, t: Timestamp) -> PeerTimestamp {
        let ns = i128::from(t.as_nanos_saturating()) + self.peer_minus_local_ns;
        PeerTimestamp::from_nanos(clamp_u64(ns))
    }

    /// The earliest peer time that local `t` can correspond to: [`ClockOffset::to_peer`]
    /// minus half the sample's round trip (saturating at the peer's epoch).
    pub fn to_peer_earliest(&self, t: Timestamp) -> PeerTimestamp {
        let half = u64::try_from((self.rtt / 2).as_nanos()).unwrap_or(u64::MAX);
        PeerTimestamp::from_nanos(self.to_peer(t).as_nanos_saturating().saturating_sub(half))
    }

    /// The latest peer time that local `t` can correspond to: [`ClockOffset::to_peer`]
    /// plus half the sample's round trip (saturating at `u64::MAX` nanoseconds).
    pub fn to_peer_latest(&self, t: Timestamp) -> PeerTimestamp {
        let half = u64::try_from((self.rtt / 2).as_nanos()).unwrap_or(u64::MAX);
        PeerTimestamp::from_nanos(self.to_peer(t).as_nanos_saturating().saturating_add(half))
    }

    /// The earliest local time that `peer` can correspond to: [`ClockOffset::to_local`]
    /// minus half the sample's round trip.
    pub fn to_local_earliest(&self, peer: PeerTimestamp) -> Timestamp {
        self.to_local(peer) - self.rtt / 2
    }

    /// Whether a peer's `deadline` leaves at least `margin` after `now`, even if the offset
    /// is off by its whole error bound (rtt/2). P uses it to decide "pull or recompute":
    /// pull only when this is true with `margin` = the expected transfer time plus slack.
    pub fn deadline_leaves(
        &self,
        now: Timestamp,
        deadline: PeerTimestamp,
        margin: Duration,
    ) -> bool {
        match now.checked_add(margin) {
            Some(needed) => self.to_local_earliest(deadline) >= needed,
            None => false,
        }
    }
}

fn clamp_u64(ns: i128) -> u64 {
    u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
}

/// Keeps the lowest-round-trip sample of `(t0, t_remote, t1)` and the offset it gives.
///
/// ```
/// use kvlease_lease::{ClockOffsetEstimator, PeerTimestamp, Timestamp};
/// let mut est = ClockOffsetEstimator::new();
/// // Sent at 100 ms, the peer's clock read 10.150 s, the reply arrived at 200 ms.
/// est.add_sample(Timestamp::from_millis(100), PeerTimestamp::from_millis(10_150), Timestamp::from_millis(200))?;
/// let offset = est.offset().unwrap();
/// assert_eq!(offset.peer_minus_local_nanos(), 10_000_000_000);
/// assert_eq!(offset.to_local(PeerTimestamp::from_millis(10_500)), Timestamp::from_millis(500));
/// # Ok::<(), kvlease_lease::ClockSampleError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct ClockOffsetEstimator {
    best: Option<ClockOffset>,
    samples: u64,
}

impl ClockOffsetEstimator {
    /// An estimator with no sample.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a sample: a request sent at local `t0`, answered with the peer's clock reading
    /// `t_remote`, the answer received at local `t1`. Keeps it when its round trip is lower
    /// than the best so far (ties keep the older one). Returns whether it was kept.
    ///
    /// offset = t_remote − (t0 + t1) / 2 (SPEC, "Bidirectional mode").
    ///
    /// # Errors
    /// [`ClockSampleError::Reversed`] when `t1 < t0`.
    pub fn add_sample(
        &mut self,
        t0: Timestamp,
        t_remote: PeerTimestamp,
        t1: Timestamp,
    ) -> Result<bool, ClockSampleError> {
        if t1 < t0 {
            return Err(ClockSampleError::Reversed { t0, t1 });
        }
        self.samples += 1;
        let rtt = t1.saturating_duration_since(t0);
        if self.best.is_some_and(|b| b.rtt <= rtt) {
            return Ok(false);
        }
        //= docs/spec.md#bidirectional-mode
        //# keep the lowest-RTT sample: offset = t_remote − (t0 + t1) / 2
        let t0 = i128::from(t0.as_nanos_saturating());
        let mid = t0 + i128::from(duration_nanos(rtt)) / 2;
        self.best = Some(ClockOffset {
            peer_minus_local_ns: i128::from(t_remote.as_nanos_saturating()) - mid,
            rtt,
        });
        Ok(true)
    }

    /// The offset from the lowest-RTT sample, or `None` before the first sample.
    pub fn offset(&self) -> Option<ClockOffset> {
        self.best
    }

    /// How many valid samples were added.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Timestamp {
        Timestamp::from_millis(v)
    }

    /// The peer's clock = local + skew (ms, signed). A request sent at t0 takes `up` ms to
    /// reach the peer and `down` ms to come back.
    fn sample(est: &mut ClockOffsetEstimator, skew: i64, t0: u64, up: u64, down: u64) -> bool {
        let remote = i64::try_from(t0 + up).unwrap() + skew;
        est.add_sample(
            ms(t0),
            PeerTimestamp::from_millis(u64::try_from(remote).unwrap()),
            ms(t0 + up + down),
        )
        .unwrap()
    }

    #[test]
    fn keeps_lowest_rtt_sample_with_positive_and_negative_skew() {
        for skew in [10_000i64, -10_000] {
            let mut est = ClockOffsetEstimator::new();
            assert!(est.offset().is_none());
            // Asymmetric: 40 ms up, 2 ms down; error = (40 - 2) / 2 = 19 ms.
            assert!(sample(&mut est, skew, 20_000, 40, 2));
            let o = est.offset().unwrap();
            assert_eq!(
                o.peer_minus_local_nanos(),
                i128::from(skew + 19) * 1_000_000
            );
            assert_eq!(o.rtt(), Duration::from_millis(42));
            // A slower sample is ignored, whatever its offset.
            assert!(!sample(&mut est, skew, 21_000, 100, 100));
            assert_eq!(est.offset(), Some(o));
            // A faster, symmetric sample wins and is exact.
            assert!(sample(&mut est, skew, 22_000, 3, 3));
            let o = est.offset().unwrap();
            assert_eq!(o.peer_minus_local_nanos(), i128::from(skew) * 1_000_000);
            assert_eq!(est.samples(), 3);
            // Round trip of conversions.
            let peer_deadline = o.to_peer(ms(30_000));
            assert_eq!(o.to_local(peer_deadline), ms(30_000));
            assert_eq!(o.to_local_earliest(peer_deadline), ms(29_997));
        }
    }

    #[test]
    fn true_offset_stays_within_half_rtt() {
        // Whatever the asymmetry, |estimate - truth| <= rtt / 2.
        for (up, down) in [(0, 50), (50, 0), (7, 31), (25, 25)] {
            let mut est = ClockOffsetEstimator::new();
            sample(&mut est, -10_000, 15_000, up, down);
            let o = est.offset().unwrap();
            let err = (o.peer_minus_local_nanos() - (-10_000_000_000i128)).abs();
            assert!(
                err <= i128::from(duration_nanos(o.rtt())) / 2,
                "{up} {down}"
            );
        }
    }

    #[test]
    fn conversions_saturate_and_margin_is_conservative() {
        // The peer's clock is 10 s ahead, so its 5 s is before our epoch.
        let ahead = ClockOffset::from_nanos(10_000_000_000);
        assert_eq!(
            ahead.to_local(PeerTimestamp::from_millis(5_000)),
            Timestamp::ZERO
        );
        let behind = ClockOffset::from_nanos(-10_000_000_000);
        assert_eq!(
            behind.to_local(PeerTimestamp::from_millis(5_000)),
            ms(15_000)
        );
        assert_eq!(behind.to_peer(ms(3_000)), PeerTimestamp::ZERO);

        let mut est = ClockOffsetEstimator::new();
        sample(&mut est, 10_000, 1_000, 100, 100); // rtt 200 ms, exact midpoint
        let o = est.offset().unwrap();
        let deadline = o.to_peer(ms(5_000));
        // 5 s deadline, now 2 s: 3 s left minus the 100 ms error bound.
        assert!(o.deadline_leaves(ms(2_000), deadline, Duration::from_millis(2_900)));
        assert!(!o.deadline_leaves(ms(2_000), deadline, Duration::from_millis(2_901)));
        assert!(!o.deadline_leaves(ms(6_000), deadline, Duration::ZERO));
        assert!(!o.deadline_leaves(ms(0), deadline, Duration::MAX));
    }

    #[test]
    fn reversed_sample_is_an_error() {
        let mut est = ClockOffsetEstimator::new();
        let err = est
            .add_sample(ms(5), PeerTimestamp::ZERO, ms(4))
            .unwrap_err();
        assert_eq!(
            err,
            ClockSampleError::Reversed {
                t0: ms(5),
                t1: ms(4)
            }
        );
        assert_eq!(est.samples(), 0);
    }
}
