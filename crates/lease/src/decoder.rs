//! The decode side's cache of finished requests' blocks (bidirectional mode).

use std::num::NonZeroU64;

use crate::config::{DecoderTtl, LeaseConfig, LeaseMode};
use crate::ids::{BlockId, ConsumerId, Generation, RequestId};
use crate::table::{Event, GrantError, LeaseTable, ReadCompleteOutcome};
use crate::time::Timestamp;

/// What [`DecoderCache::insert`] hands back: what D tells P about the cached blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cached {
    /// The fencing token of the cached blocks.
    pub generation: Generation,
    /// Until when D keeps them (local time; send it as D's clock reading, P converts it with
    /// its [`ClockOffset`](crate::ClockOffset)).
    pub deadline: Timestamp,
}

/// Bidirectional mode on D: a finished request's blocks are kept for a fixed
/// `decoder_kv_blocks_ttl` so that P can pull them on the next turn. The next turn depends
/// on the client, so nothing renews them: no heartbeats (SPEC, "Bidirectional mode").
///
/// A [`LeaseTable`] in [`LeaseMode::Fixed`] with duration = TTL, one consumer per entry.
///
/// # Call order
/// Each D step: [`insert`](Self::insert) finished requests, [`remove`](Self::remove)
/// those the client ended, [`handle_read_complete`](Self::handle_read_complete) when P
/// reports its pull, [`handle_timeout`](Self::handle_timeout) when
/// [`poll_timeout`](Self::poll_timeout) passed, then drain
/// [`poll_event`](Self::poll_event) and free the released blocks.
#[derive(Debug)]
pub struct DecoderCache {
    ttl: DecoderTtl,
    table: LeaseTable,
}

impl DecoderCache {
    /// An empty cache keeping blocks for `ttl`; its first entry gets generation 1.
    pub fn new(ttl: DecoderTtl) -> Self {
        Self::with_first_generation(ttl, Generation(NonZeroU64::MIN))
    }

    /// An empty cache keeping blocks for `ttl`, whose first entry gets generation `first`,
    /// then `first + 1`, … A D that restarts should start above every generation it
    /// handed out before (e.g. from the wall clock in microseconds), so that a pull with
    /// an earlier instance's params never matches a new entry on the same blocks.
    pub fn with_first_generation(ttl: DecoderTtl, first: Generation) -> Self {
        // DecoderTtl was validated against the same range as lease durations.
        let config = LeaseConfig::derive(ttl.as_duration()).with_mode(LeaseMode::Fixed);
        Self {
            ttl,
            table: LeaseTable::with_first_generation(config, first),
        }
    }

    /// The TTL.
    pub fn ttl(&self) -> DecoderTtl {
        self.ttl
    }

    /// Keeps `blocks` of `request` until `now + ttl`.
    ///
    /// # Errors
    /// [`GrantError::Duplicate`] when `request` is already cached, and the overflow errors
    /// of [`LeaseTable::grant`].
    pub fn insert(
        &mut self,
        now: Timestamp,
        request: RequestId,
        blocks: Vec<BlockId>,
    ) -> Result<Cached, GrantError> {
        //= docs/spec.md#bidirectional-mode
        //# The next turn depends on the client, so heartbeats do not apply:
        //# a fixed `decoder_kv_blocks_ttl` [480 s] holds them on D.
        let generation = self.table.grant(now, request, blocks, 1)?;
        Ok(Cached {
            generation,
            deadline: now + self.table.config().duration(),
        })
    }

    /// P reports it pulled `request`'s blocks: they are released ([`crate::ReleaseReason::Completed`]).
    pub fn handle_read_complete(
        &mut self,
        now: Timestamp,
        request: &RequestId,
        consumer: ConsumerId,
    ) -> ReadCompleteOutcome {
        self.table
            .handle_read_complete(now, request, consumer, None)
    }

    /// Drops `request`'s blocks at once ([`crate::ReleaseReason::Aborted`]). Returns whether
    /// it was cached.
    pub fn remove(&mut self, now: Timestamp, request: &RequestId) -> bool {
        self.table.abort(now, request)
    }

    /// Releases every entry whose TTL passed ([`crate::ReleaseReason::Expired`]). Returns how
    /// many.
    pub fn handle_timeout(&mut self, now: Timestamp) -> usize {
        self.table.handle_timeout(now)
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.table.poll_timeout()
    }

    /// The next release, or `None`.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.table.poll_event()
    }

    /// The deadline of `request`'s cached blocks, if cached.
    pub fn deadline(&self, request: &RequestId) -> Option<Timestamp> {
        self.table.get(request).map(|info| info.expiry)
    }

    /// Entries cached.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Blocks held by all entries.
    pub fn blocks_held(&self) -> usize {
        self.table.blocks_held()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{EngineId, ReleaseReason};

    fn rid(s: &str) -> RequestId {
        RequestId::new(s).unwrap()
    }

    #[test]
    fn generations_count_up_from_the_first_one() {
        let ttl = DecoderTtl::from_secs_f64(10.0).unwrap();
        let first = Generation(NonZeroU64::new(1 << 40).unwrap());
        let mut cache = DecoderCache::with_first_generation(ttl, first);
        let t0 = Timestamp::from_millis(1);
        let a = cache.insert(t0, rid("a"), vec![BlockId(0)]).unwrap();
        let b = cache.insert(t0, rid("b"), vec![BlockId(1)]).unwrap();
        assert_eq!(
            (a.generation.word(), b.generation.word()),
            (1 << 40, (1 << 40) + 1)
        );
        let mut plain = DecoderCache::new(ttl);
        assert_eq!(
            plain
                .insert(t0, rid("a"), vec![])
                .unwrap()
                .generation
                .word(),
            1
        );
    }

    #[test]
    fn entries_expire_after_ttl_and_can_be_completed_or_removed() {
        let ttl = DecoderTtl::from_secs_f64(480.0).unwrap();
        let mut cache = DecoderCache::new(ttl);
        assert_eq!(cache.ttl(), ttl);
        let t0 = Timestamp::from_millis(1_000);
        let a = cache
            .insert(t0, rid("a"), vec![BlockId(1), BlockId(2)])
            .unwrap();
        assert_eq!(a.deadline, t0 + Duration::from_secs(480));
        let b = cache.insert(t0, rid("b"), vec![BlockId(3)]).unwrap();
        assert_ne!(a.generation, b.generation);
        cache.insert(t0, rid("c"), vec![BlockId(4)]).unwrap();
        assert!(matches!(
            cache.insert(t0, rid("c"), vec![]),
            Err(GrantError::Duplicate { .. })
        ));
        assert_eq!(cache.blocks_held(), 4);
        assert_eq!(cache.poll_timeout(), Some(a.deadline));

        let p = ConsumerId::new(EngineId::new("p0").unwrap(), 0);
        assert_eq!(
            cache.handle_read_complete(t0, &rid("b"), p),
            ReadCompleteOutcome::Released
        );
        assert!(cache.remove(t0, &rid("c")));
        assert!(!cache.remove(t0, &rid("c")));
        let reasons: Vec<_> = std::iter::from_fn(|| cache.poll_event())
            .map(|Event::Released(r)| (r.request, r.reason))
            .collect();
        assert_eq!(
            reasons,
            [
                (rid("b"), ReleaseReason::Completed),
                (rid("c"), ReleaseReason::Aborted)
            ]
        );

        assert_eq!(
            cache.handle_timeout(a.deadline - Duration::from_nanos(1)),
            0
        );
        assert_eq!(cache.deadline(&rid("a")), Some(a.deadline));
        assert_eq!(cache.handle_timeout(a.deadline), 1);
        let Some(Event::Released(r)) = cache.poll_event() else {
            panic!("expected a release");
        };
        assert_eq!((r.request, r.reason), (rid("a"), ReleaseReason::Expired));
        assert_eq!(r.blocks, [BlockId(1), BlockId(2)]);
        assert!(cache.is_empty());
        assert_eq!(cache.blocks_held(), 0);
    }
}
