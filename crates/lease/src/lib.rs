//! Sans-IO lease machinery for kvlease.
//!
//! A prefill instance **P** keeps a finished request's KV blocks pinned under a short
//! **lease**; the decode instance **D** renews it with heartbeats while the request waits
//! or reads, and P frees the blocks when D reports the read complete, or reclaims them
//! soon after the heartbeats stop. This crate holds both ends as pure state machines:
//!
//! - [`LeaseTable`] (P): grants, renewals, completions, aborts and the deadline-ordered
//!   reaper. Releases come out as [`Event::Released`].
//! - [`HeartbeatTracker`] (D): which requests to heartbeat to which P engine, one batch per
//!   engine per interval ([`HeartbeatBatch`]).
//! - [`DecoderCache`] (D, bidirectional mode): a finished request's blocks kept for a fixed
//!   TTL, no heartbeats.
//! - [`LeaseConfig`] / [`DecoderTtl`]: validated durations; interval = d/6, extension = 2d/3,
//!   in nanoseconds.
//! - Time: [`Timestamp`] (this host), [`PeerTimestamp`] (another host, a separate type),
//!   [`ClockOffsetEstimator`] / [`ClockOffset`] (lowest-RTT handshake sample; "pull or
//!   recompute" with [`ClockOffset::deadline_leaves`]).
//! - Ids: [`RequestId`], [`EngineId`], [`BlockId`], [`Generation`] (fencing token),
//!   [`ConsumerId`].
//!
//! # The state machines
//! **P, per request** ([`LeaseTable`]): `grant` → *held* (expiry = now + duration) →
//! heartbeats move expiry to max(expiry, now + extension) → *released* exactly once, as
//! `Completed` (the expected number of distinct consumers reported), `Aborted`, or
//! `Expired` (`now >= expiry` at a `handle_timeout`). A released request id is unknown:
//! later heartbeats and completions for it change nothing and are counted.
//!
//! **D, per request** ([`HeartbeatTracker`]): `track` on arrival → listed in every batch of
//! its engine → `untrack` when the transfer completed or the request finished or was
//! aborted. **D, per engine**: due at once when first seen, then one interval after each
//! batch handed out; `defer` moves the due time when the batch could not be sent.
//!
//! Each type's doc states its call order. The driver (the agent) calls them from its
//! forward loop: feed inputs (`handle_*`, commands), then drain every `poll_*`.
//!
//! # What this crate does not do
//! It does not read a clock, sleep, start threads or do any IO: every method that depends
//! on time takes `now` as its first argument, so tests and the simulator can drive it on
//! virtual time. It does not encode or decode notifications (`kvlease-notif` does), send
//! heartbeats, free blocks (the caller does, on [`Event::Released`]) or publish generations
//! into registered memory (the agent does).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod alloc;
mod clock;
mod config;
mod decoder;
mod ids;
mod index;
mod table;
mod time;
mod tracker;

pub use alloc::{AllocError, BlockAllocator};
pub use clock::{ClockOffset, ClockOffsetEstimator, ClockSampleError};
pub use config::{
    ConfigError, DEFAULT_DECODER_TTL, DEFAULT_LEASE_DURATION, DEFAULT_MAX_LEASE_LIFETIME,
    DecoderTtl, LeaseConfig, LeaseMode, MAX_DURATION, MIN_DURATION,
};
pub use decoder::{Cached, DecoderCache};
pub use ids::{BlockId, ConsumerId, EngineId, Generation, InvalidId, MAX_ID_LEN, RequestId};
pub use table::{
    Event, GrantError, HeartbeatOutcome, LeaseInfo, LeaseStats, LeaseTable, MAX_LEASES,
    ReadCompleteOutcome, ReleaseReason, Released,
};
pub use time::{PeerTimestamp, Timestamp};
pub use tracker::{HeartbeatBatch, HeartbeatTracker, TrackError, TrackerStats};

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent moves the state machines into its engine thread and shares ids across
    /// threads.
    #[test]
    fn state_machines_are_send_and_sync() {
        fn is_send_sync<T: Send + Sync>() {}
        is_send_sync::<LeaseTable>();
        is_send_sync::<HeartbeatTracker>();
        is_send_sync::<DecoderCache>();
        is_send_sync::<ClockOffsetEstimator>();
        is_send_sync::<Event>();
        is_send_sync::<HeartbeatBatch>();
        is_send_sync::<RequestId>();
        is_send_sync::<ConsumerId>();
    }
}
