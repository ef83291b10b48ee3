//! Engine liveness, for `/health`: the engine loop stamps an [`EngineHeartbeat`] once per
//! iteration and the HTTP layer answers 503 when the stamp is older than
//! `--health-engine-stall-ms` (like vLLM's engine-dead check). A dead engine thread and a
//! stuck one look the same: no stamp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When the engine loop last completed an iteration. Shared (in an `Arc`) by the engine
/// thread, which calls [`beat`](Self::beat), and the HTTP layer, which reads
/// [`age`](Self::age).
#[derive(Debug)]
pub struct EngineHeartbeat {
    epoch: Instant,
    /// Milliseconds from `epoch` to the last beat.
    last_ms: AtomicU64,
}

impl EngineHeartbeat {
    /// A heartbeat stamped now (an engine that is starting counts as alive).
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    /// Records that the engine loop completed an iteration now.
    pub fn beat(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// How long ago the last beat was.
    pub fn age(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }
}

impl Default for EngineHeartbeat {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn age_grows_until_the_next_beat() {
        let h = EngineHeartbeat::new();
        std::thread::sleep(Duration::from_millis(30));
        assert!(h.age() >= Duration::from_millis(30));
        h.beat();
        assert!(h.age() < Duration::from_millis(30));
    }
}
