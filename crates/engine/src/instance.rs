//! Engine instances: an engine's start time on the wall clock, in microseconds since the
//! Unix epoch, which its peers use to tell a restarted engine (a larger instance under the
//! same engine id) from the one they knew.
//!
//! An instance is peer input, and a number far ahead of the clock would outrank every
//! real restart to come: [`check_instance`] refuses one that lies more than
//! [`MAX_INSTANCE_AHEAD`] ahead of this host's clock (the slack covers clocks that are not
//! in step between hosts). The clock is an argument.

use std::time::Duration;

/// How far ahead of this host's clock a peer's instance may lie.
pub const MAX_INSTANCE_AHEAD: Duration = Duration::from_secs(60);

/// An instance further ahead of this host's clock than [`MAX_INSTANCE_AHEAD`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "instance {instance} (µs since the Unix epoch) lies more than {:?} ahead of this host's \
     clock ({now_us})",
    MAX_INSTANCE_AHEAD
)]
pub struct InstanceAhead {
    /// The instance.
    pub instance: u64,
    /// This host's clock when it was checked, µs since the Unix epoch.
    pub now_us: u64,
}

/// Whether `instance` lies at most [`MAX_INSTANCE_AHEAD`] ahead of `now_us` (this host's
/// wall clock, µs since the Unix epoch). 0 (an instance left unsaid) always passes.
///
/// # Errors
/// [`InstanceAhead`].
pub fn check_instance(instance: u64, now_us: u64) -> Result<(), InstanceAhead> {
    let limit = now_us.saturating_add(MAX_INSTANCE_AHEAD.as_micros() as u64);
    if instance > limit {
        Err(InstanceAhead { instance, now_us })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_may_lie_up_to_a_minute_ahead() {
        let now = 1_700_000_000_000_000;
        assert_eq!(check_instance(0, now), Ok(()));
        assert_eq!(check_instance(now, now), Ok(()));
        assert_eq!(check_instance(now + 60_000_000, now), Ok(()));
        assert_eq!(
            check_instance(now + 60_000_001, now),
            Err(InstanceAhead {
                instance: now + 60_000_001,
                now_us: now
            })
        );
        assert!(check_instance(1 << 63, now).is_err());
        assert_eq!(check_instance(u64::MAX, u64::MAX), Ok(()));
    }
}
