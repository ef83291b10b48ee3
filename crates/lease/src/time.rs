//! Local time as an argument, and another host's time as its own type.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time on this host, as the [`Duration`] since an epoch the caller chooses
/// (the agent uses the start of the process; tests use zero).
///
/// Opaque on purpose: the state machines never read a clock, so a test or a simulation can
/// build any value. Another host's time is a different type ([`PeerTimestamp`]) and cannot be
/// compared with this one; convert it with a [`ClockOffset`](crate::ClockOffset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(Duration);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Self = Self(Duration::ZERO);

    /// The timestamp `d` after the epoch.
    pub const fn from_duration(d: Duration) -> Self {
        Self(d)
    }

    /// The timestamp `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// The timestamp `ns` nanoseconds after the epoch.
    pub const fn from_nanos(ns: u64) -> Self {
        Self(Duration::from_nanos(ns))
    }

    /// The time since the epoch.
    pub const fn as_duration(self) -> Duration {
        self.0
    }

    /// Nanoseconds since the epoch, saturating at `u64::MAX` (about 584 years).
    pub fn as_nanos_saturating(self) -> u64 {
        duration_nanos(self.0)
    }

    /// `self - earlier`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Self) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + d`, or `None` on overflow.
    pub fn checked_add(self, d: Duration) -> Option<Self> {
        self.0.checked_add(d).map(Self)
    }
}

impl Add<Duration> for Timestamp {
    type Output = Self;
    /// # Panics
    /// On overflow of [`Duration`] (centuries past the epoch); use [`Timestamp::checked_add`].
    fn add(self, d: Duration) -> Self {
        Self(self.0 + d)
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Self;
    /// Saturates at the epoch.
    fn sub(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(d))
    }
}

/// A point in time on **another** host's clock, as the [`Duration`] since that host's epoch.
///
/// Bidirectional mode sends deadlines across hosts (D tells P until when it keeps a cached
/// request's blocks). The two clocks have different epochs and drift, so a peer's time is
/// its own type: it has no ordering with [`Timestamp`] and converts only through a
/// [`ClockOffset`](crate::ClockOffset) measured at handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PeerTimestamp(Duration);

impl PeerTimestamp {
    /// The peer's epoch.
    pub const ZERO: Self = Self(Duration::ZERO);

    /// The peer timestamp `d` after the peer's epoch.
    pub const fn from_duration(d: Duration) -> Self {
        Self(d)
    }

    /// The peer timestamp `ms` milliseconds after the peer's epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// The peer timestamp `ns` nanoseconds after the peer's epoch (the wire form).
    pub const fn from_nanos(ns: u64) -> Self {
        Self(Duration::from_nanos(ns))
    }

    /// The time since the peer's epoch.
    pub const fn as_duration(self) -> Duration {
        self.0
    }

    /// Nanoseconds since the peer's epoch, saturating at `u64::MAX` (the wire form).
    pub fn as_nanos_saturating(self) -> u64 {
        duration_nanos(self.0)
    }
}

/// A duration in nanoseconds, saturating at `u64::MAX`.
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nanos_round_trip_and_saturate() {
        let t = Timestamp::from_nanos(1_500_000_001);
        assert_eq!(t.as_nanos_saturating(), 1_500_000_001);
        assert_eq!(t.as_duration(), Duration::new(1, 500_000_001));
        let far = Timestamp::from_duration(Duration::from_secs(u64::MAX));
        assert_eq!(far.as_nanos_saturating(), u64::MAX);
        assert_eq!(
            PeerTimestamp::from_millis(7).as_nanos_saturating(),
            7_000_000
        );
        assert_eq!(
            Timestamp::from_millis(5) - Duration::from_secs(1),
            Timestamp::ZERO
        );
    }
}
