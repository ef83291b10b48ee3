//! Local time as an argument.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time on this host, as the [`Duration`] since an epoch the caller chooses
/// (the agent uses the start of the process; tests use zero).
///
/// Opaque on purpose: the state machines never read a clock, so a test or a simulation can
/// build any value. Another host's time is a different type (`PeerTimestamp`) and cannot be
/// compared with this one.
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

    /// The time since the epoch.
    pub const fn as_duration(self) -> Duration {
        self.0
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
