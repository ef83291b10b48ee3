//! Lease durations and the values derived from them.

use std::fmt;
use std::time::Duration;

/// `kv_lease_duration` when none is configured (SPEC: 30 s).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(30);
/// `decoder_kv_blocks_ttl` when none is configured (SPEC: 480 s).
pub const DEFAULT_DECODER_TTL: Duration = Duration::from_secs(480);
/// The longest a lease lives whatever its heartbeats say, when none is configured: 10
/// minutes (or the lease duration, when that is longer). See [`LeaseConfig::max_lifetime`].
pub const DEFAULT_MAX_LEASE_LIFETIME: Duration = Duration::from_secs(600);
/// The shortest lease or TTL accepted: 1 ms (its heartbeat interval is still 166 µs).
pub const MIN_DURATION: Duration = Duration::from_millis(1);
/// The longest lease or TTL accepted: one day. Anything longer is a unit mistake (a value
/// in milliseconds given as seconds), and it would defeat the point of a lease.
pub const MAX_DURATION: Duration = Duration::from_secs(86_400);

/// Why a duration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The value in seconds is NaN or infinite.
    #[error("{what} of {value} s is not a finite number; allowed: {} s to {} s", MIN_DURATION.as_secs_f64(), MAX_DURATION.as_secs_f64())]
    NotFinite {
        /// What the value configures (`"lease duration"`, `"decoder TTL"`).
        what: &'static str,
        /// The value given, in seconds.
        value: f64,
    },
    /// The value lies outside [`MIN_DURATION`]`..=`[`MAX_DURATION`] (zero and negative
    /// values included).
    #[error("{what} of {value} s is out of range; allowed: {} s to {} s", MIN_DURATION.as_secs_f64(), MAX_DURATION.as_secs_f64())]
    OutOfRange {
        /// What the value configures (`"lease duration"`, `"decoder TTL"`).
        what: &'static str,
        /// The value given, in seconds.
        value: f64,
    },
    /// A maximum lease lifetime shorter than the lease itself.
    #[error("lease max lifetime of {value} s is shorter than the lease duration of {duration} s")]
    LifetimeBelowDuration {
        /// The lifetime given, in seconds.
        value: f64,
        /// The lease duration, in seconds.
        duration: f64,
    },
}

fn check_duration(what: &'static str, d: Duration) -> Result<Duration, ConfigError> {
    if (MIN_DURATION..=MAX_DURATION).contains(&d) {
        Ok(d)
    } else {
        Err(ConfigError::OutOfRange {
            what,
            value: d.as_secs_f64(),
        })
    }
}

fn check_secs(what: &'static str, secs: f64) -> Result<Duration, ConfigError> {
    if !secs.is_finite() {
        return Err(ConfigError::NotFinite { what, value: secs });
    }
    if !(MIN_DURATION.as_secs_f64()..=MAX_DURATION.as_secs_f64()).contains(&secs) {
        return Err(ConfigError::OutOfRange { what, value: secs });
    }
    // In range and finite, so the conversion cannot fail; map the error anyway instead of
    // unwrapping.
    let d = Duration::try_from_secs_f64(secs)
        .map_err(|_| ConfigError::OutOfRange { what, value: secs })?;
    check_duration(what, d)
}

/// How P treats heartbeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LeaseMode {
    /// Leases: the initial lease is the duration, every heartbeat extends the expiry to at
    /// least `now + extension` (SPEC, "Renew").
    #[default]
    Lease,
    /// The single-timeout baseline (vLLM's `abort_request_timeout`): the expiry is
    /// `grant + duration` and heartbeats do **not** extend it (they are still counted).
    Fixed,
}

/// A validated lease duration and the values derived from it, in nanoseconds.
///
/// interval = duration / 6, extension = duration × 2 / 3 (SPEC, "Semantics"), so a 30 s
/// lease heartbeats every 5 s and each heartbeat extends to 20 s from its arrival, and a
/// 1.5 s lease (tests) heartbeats every 250 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseConfig {
    duration: Duration,
    interval: Duration,
    extension: Duration,
    mode: LeaseMode,
    max_lifetime: Duration,
}

impl LeaseConfig {
    /// A lease of `duration` in [`LeaseMode::Lease`].
    ///
    /// # Errors
    /// [`ConfigError::OutOfRange`] unless `duration` lies in
    /// [`MIN_DURATION`]`..=`[`MAX_DURATION`].
    pub fn from_duration(duration: Duration) -> Result<Self, ConfigError> {
        let duration = check_duration("lease duration", duration)?;
        Ok(Self::derive(duration))
    }

    /// A lease of `secs` seconds (the `kv_lease_duration` JSON value).
    ///
    /// # Errors
    /// [`ConfigError::NotFinite`] for NaN and infinities, [`ConfigError::OutOfRange`] for
    /// zero, negative and absurd values.
    pub fn from_secs_f64(secs: f64) -> Result<Self, ConfigError> {
        let duration = check_secs("lease duration", secs)?;
        Ok(Self::derive(duration))
    }

    /// The derived values of an already validated `duration`.
    pub(crate) fn derive(duration: Duration) -> Self {
        //= docs/spec.md#lease-timing
        //# Derived: heartbeat interval = duration / 6 [5 s];
        //# extension = duration × 2 / 3 [20 s]. Compute in milliseconds or finer
        let nanos = duration.as_nanos();
        // duration <= MAX_DURATION, so nanos * 2 fits in u64 easily.
        let interval = Duration::from_nanos(u64::try_from(nanos / 6).unwrap_or(u64::MAX));
        let extension = Duration::from_nanos(u64::try_from(nanos * 2 / 3).unwrap_or(u64::MAX));
        Self {
            duration,
            interval,
            extension,
            mode: LeaseMode::Lease,
            max_lifetime: DEFAULT_MAX_LEASE_LIFETIME.max(duration),
        }
    }

    /// The same lease with a maximum lifetime of `max_lifetime` (see
    /// [`max_lifetime`](Self::max_lifetime)).
    ///
    /// # Errors
    /// [`ConfigError::OutOfRange`] outside [`MIN_DURATION`]`..=`[`MAX_DURATION`],
    /// [`ConfigError::LifetimeBelowDuration`] below the lease duration.
    pub fn with_max_lifetime(mut self, max_lifetime: Duration) -> Result<Self, ConfigError> {
        let max_lifetime = check_duration("lease max lifetime", max_lifetime)?;
        if max_lifetime < self.duration {
            return Err(ConfigError::LifetimeBelowDuration {
                value: max_lifetime.as_secs_f64(),
                duration: self.duration.as_secs_f64(),
            });
        }
        self.max_lifetime = max_lifetime;
        Ok(self)
    }

    /// [`with_max_lifetime`](Self::with_max_lifetime) of `secs` seconds (a JSON value).
    ///
    /// # Errors
    /// As [`with_max_lifetime`](Self::with_max_lifetime); [`ConfigError::NotFinite`] for
    /// NaN and infinities.
    pub fn with_max_lifetime_secs_f64(self, secs: f64) -> Result<Self, ConfigError> {
        self.with_max_lifetime(check_secs("lease max lifetime", secs)?)
    }

    /// The longest a lease lives from its grant, whatever its heartbeats say: at
    /// `granted_at + max_lifetime` P reclaims it even while its reader keeps renewing it (a
    /// reader that heartbeats a lease it never reads cannot pin the blocks for longer).
    /// Default [`DEFAULT_MAX_LEASE_LIFETIME`], or the duration when that is longer; never
    /// below the duration.
    pub fn max_lifetime(&self) -> Duration {
        self.max_lifetime
    }

    /// The same durations with heartbeats treated as `mode` says.
    #[must_use]
    pub fn with_mode(mut self, mode: LeaseMode) -> Self {
        self.mode = mode;
        self
    }

    /// The initial lease (and, in [`LeaseMode::Fixed`], the only one).
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// How often D heartbeats each P worker: duration / 6.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// How far a heartbeat pushes the expiry past its arrival: duration × 2 / 3.
    pub fn extension(&self) -> Duration {
        self.extension
    }

    /// How heartbeats are treated.
    pub fn mode(&self) -> LeaseMode {
        self.mode
    }
}

impl Default for LeaseConfig {
    /// 30 s leases ([`DEFAULT_LEASE_DURATION`]).
    fn default() -> Self {
        Self::derive(DEFAULT_LEASE_DURATION)
    }
}

impl fmt::Display for LeaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} lease {:?} (interval {:?}, extension {:?}, max lifetime {:?})",
            self.mode, self.duration, self.interval, self.extension, self.max_lifetime
        )
    }
}

/// A validated `decoder_kv_blocks_ttl`: how long D keeps a finished request's blocks in
/// bidirectional mode, with no heartbeats (SPEC, "Bidirectional mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecoderTtl(Duration);

impl DecoderTtl {
    /// A TTL of `ttl`.
    ///
    /// # Errors
    /// [`ConfigError::OutOfRange`] unless `ttl` lies in [`MIN_DURATION`]`..=`[`MAX_DURATION`].
    pub fn from_duration(ttl: Duration) -> Result<Self, ConfigError> {
        check_duration("decoder TTL", ttl).map(Self)
    }

    /// A TTL of `secs` seconds (the `decoder_kv_blocks_ttl` JSON value).
    ///
    /// # Errors
    /// [`ConfigError::NotFinite`] for NaN and infinities, [`ConfigError::OutOfRange`] for
    /// zero, negative and absurd values.
    pub fn from_secs_f64(secs: f64) -> Result<Self, ConfigError> {
        check_secs("decoder TTL", secs).map(Self)
    }

    /// The TTL.
    pub fn as_duration(self) -> Duration {
        self.0
    }
}

impl Default for DecoderTtl {
    /// 480 s ([`DEFAULT_DECODER_TTL`]).
    fn default() -> Self {
        Self(DEFAULT_DECODER_TTL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_lease_derives_spec_values() {
        let c = LeaseConfig::default();
        assert_eq!(c.duration(), Duration::from_secs(30));
        assert_eq!(c.interval(), Duration::from_secs(5));
        assert_eq!(c.extension(), Duration::from_secs(20));
        assert_eq!(c.mode(), LeaseMode::Lease);
        assert_eq!(c.max_lifetime(), Duration::from_secs(600));
        assert_eq!(LeaseConfig::from_secs_f64(30.0), Ok(c));
    }

    #[test]
    fn a_max_lifetime_is_never_below_the_lease() {
        let day = LeaseConfig::from_duration(MAX_DURATION).unwrap();
        assert_eq!(day.max_lifetime(), MAX_DURATION);
        let c = LeaseConfig::from_secs_f64(2.0).unwrap();
        assert_eq!(
            c.with_max_lifetime_secs_f64(10.0).map(|c| c.max_lifetime()),
            Ok(Duration::from_secs(10))
        );
        let e = c.with_max_lifetime_secs_f64(1.0).unwrap_err();
        assert_eq!(
            e,
            ConfigError::LifetimeBelowDuration {
                value: 1.0,
                duration: 2.0
            }
        );
        assert!(matches!(
            c.with_max_lifetime_secs_f64(f64::NAN),
            Err(ConfigError::NotFinite { .. })
        ));
        assert!(c.with_max_lifetime(Duration::from_secs(86_401)).is_err());
    }

    #[test]
    fn sub_six_second_leases_get_nonzero_intervals() {
        let c = LeaseConfig::from_secs_f64(1.5).unwrap();
        assert_eq!(c.interval(), Duration::from_millis(250));
        assert_eq!(c.extension(), Duration::from_secs(1));
        let c = LeaseConfig::from_duration(Duration::from_secs(1)).unwrap();
        assert_eq!(c.interval(), Duration::from_nanos(166_666_666));
        assert_eq!(c.extension(), Duration::from_nanos(666_666_666));
        let c = LeaseConfig::from_duration(MIN_DURATION).unwrap();
        assert!(c.interval() > Duration::ZERO);
    }

    #[test]
    fn rejects_zero_negative_nan_infinite_and_absurd() {
        for bad in [0.0, -0.0, -1.0, 0.0009, 86_400.5, 1e300] {
            let err = LeaseConfig::from_secs_f64(bad).unwrap_err();
            assert!(
                matches!(err, ConfigError::OutOfRange { value, .. } if value == bad || (value == 0.0 && bad == 0.0))
            );
            let msg = err.to_string();
            assert!(msg.contains("lease duration"), "{msg}");
            assert!(msg.contains("0.001 s to 86400 s"), "{msg}");
        }
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let err = LeaseConfig::from_secs_f64(bad).unwrap_err();
            assert!(matches!(err, ConfigError::NotFinite { .. }), "{err}");
        }
        assert_eq!(
            LeaseConfig::from_duration(Duration::ZERO),
            Err(ConfigError::OutOfRange {
                what: "lease duration",
                value: 0.0
            })
        );
        assert!(LeaseConfig::from_duration(Duration::from_secs(86_401)).is_err());
        assert!(LeaseConfig::from_duration(MAX_DURATION).is_ok());
        let msg = DecoderTtl::from_secs_f64(-3.0).unwrap_err().to_string();
        assert!(msg.contains("decoder TTL of -3 s"), "{msg}");
    }

    #[test]
    fn fixed_mode_keeps_durations() {
        let c = LeaseConfig::from_secs_f64(480.0)
            .unwrap()
            .with_mode(LeaseMode::Fixed);
        assert_eq!(c.mode(), LeaseMode::Fixed);
        assert_eq!(c.duration(), Duration::from_secs(480));
        assert_eq!(
            DecoderTtl::default().as_duration(),
            Duration::from_secs(480)
        );
        assert_eq!(
            DecoderTtl::from_secs_f64(2.5).unwrap().as_duration(),
            Duration::from_millis(2500)
        );
    }
}
