//! Bidirectional multi-turn KV transfer (SPEC, "Bidirectional mode"): D keeps a
//! finished turn's blocks for `decoder_kv_blocks_ttl`, P pulls them on the next turn
//! instead of recomputing the shared prefix.
//!
//! The decisions live in the engine ([`kvlease_engine`]: [`DecoderKvParams`],
//! [`plan_pull`](kvlease_engine::plan_pull), D's hold on finished turns inside its
//! [`DecodeCore`](kvlease_engine::DecodeCore), P's heartbeat schedule
//! [`TurnHeartbeats`](kvlease_engine::TurnHeartbeats)), so that the simulator drives the
//! same code. This module holds what touches the outside:
//! - the JSON form of [`DecoderKvParams`], the `kv_transfer_params` D answers with in
//!   bidirectional mode: `kvlease-proto`'s codec of a turn, converted in one place
//!   ([`params_from_value`], [`params_to_value`], [`is_decoder_params`]);
//! - [`PeerClock`]: the clock an agent shows its peers;
//! - [`ClockProbeServer`] / [`probe_clock`] (from `kvlease_transport::clock_probe`, the
//!   frames from `kvlease_proto::clock`): a tiny request (own port, 16-byte frames) that
//!   gives P `(t0, t_remote, t1)` samples of D's clock for the `ClockOffsetEstimator`;
//! - [`ConversationStore`](crate::proxy::ConversationStore): the proxy's memory of D's
//!   params between turns, keyed by [`conversation_key`](crate::proxy::conversation_key);
//! - [`TEST_CLOCK_OFFSET_ENV`]: an offset added to the clock an agent reports, so tests can
//!   run two agents with ±10 s of skew on one host.

use std::time::{SystemTime, UNIX_EPOCH};

use kvlease_engine::DecoderKvParams;
use kvlease_lease::Timestamp;
use kvlease_proto::params::KvTransferParams;
use serde_json::Value;

use crate::api::ApiError;

/// The environment variable holding a clock offset in milliseconds (signed) that an agent
/// adds to the wall clock it reports to peers. For tests only: it simulates skew between
/// hosts on one machine.
pub const TEST_CLOCK_OFFSET_ENV: &str = "KVLEASE_TEST_CLOCK_OFFSET_MS";

/// Largest injected offset accepted (one day).
pub const MAX_TEST_CLOCK_OFFSET_MS: i64 = 86_400_000;

/// Why a bidirectional-mode input was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BidirError {
    /// [`TEST_CLOCK_OFFSET_ENV`] is not a signed integer within range.
    #[error(
        "{TEST_CLOCK_OFFSET_ENV}={value}: must be an integer of milliseconds within ±{MAX_TEST_CLOCK_OFFSET_MS}"
    )]
    BadClockOffset {
        /// The value found.
        value: String,
    },
}

/// The injected test clock offset from [`TEST_CLOCK_OFFSET_ENV`], zero when unset.
///
/// # Errors
/// [`BidirError::BadClockOffset`] when set to anything but an in-range integer.
pub fn test_clock_offset_from_env() -> Result<i64, BidirError> {
    match std::env::var(TEST_CLOCK_OFFSET_ENV) {
        Err(_) => Ok(0),
        Ok(v) => parse_clock_offset(&v),
    }
}

/// Parses a [`TEST_CLOCK_OFFSET_ENV`] value.
///
/// # Errors
/// [`BidirError::BadClockOffset`] unless `v` is an integer within ±[`MAX_TEST_CLOCK_OFFSET_MS`].
pub fn parse_clock_offset(v: &str) -> Result<i64, BidirError> {
    v.trim()
        .parse::<i64>()
        .ok()
        .filter(|ms| ms.abs() <= MAX_TEST_CLOCK_OFFSET_MS)
        .ok_or_else(|| BidirError::BadClockOffset {
            value: v.to_owned(),
        })
}

/// The clock an agent shows its peers: wall-clock nanoseconds since the Unix epoch plus an
/// injected offset (milliseconds, tests only). Used for D's deadlines and for answering
/// clock probes, so both are on the same (possibly skewed) clock.
#[derive(Debug, Clone, Copy)]
pub struct PeerClock {
    offset_ms: i64,
}

impl PeerClock {
    /// The wall clock shifted by `offset_ms`.
    pub fn new(offset_ms: i64) -> Self {
        Self { offset_ms }
    }

    /// The current reading, in nanoseconds (saturating at zero and `u64::MAX`).
    pub fn now_ns(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let wall = i128::try_from(wall).unwrap_or(i128::MAX);
        let ns = wall.saturating_add(i128::from(self.offset_ms) * 1_000_000);
        u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
    }

    /// The reading as a local [`Timestamp`] (what this host compares its own deadlines on).
    pub fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.now_ns())
    }
}

// ------------------------------------------------------------------- JSON form

/// Reads D's cached-blocks params as P gets them (D's answer, copied by a proxy) with
/// `kvlease-proto`'s codec of a turn ([`KvTransferParams::from_turn_value`]), as the
/// engine's [`DecoderKvParams`].
///
/// # Errors
/// 400 naming `kv_transfer_params.<field>` for a missing, mistyped or inconsistent field.
pub fn params_from_value(v: &Value) -> Result<DecoderKvParams, ApiError> {
    let p = KvTransferParams::from_turn_value(v)?;
    DecoderKvParams::from_turn(&p).ok_or_else(|| {
        ApiError::bad_field("kv_transfer_params.kvlease_bidir", "must be true in a turn")
    })
}

/// The JSON form of `p` (`kvlease-proto`'s turn); `Null` for params that fail
/// [`DecoderKvParams::to_turn`] (D never builds such).
pub fn params_to_value(p: &DecoderKvParams) -> Value {
    p.to_turn().map_or(Value::Null, |t| t.to_value())
}

/// Whether `v` (a request's `kv_transfer_params`) carries D's cached-blocks params.
pub use kvlease_proto::params::is_turn as is_decoder_params;

// ------------------------------------------------------------------- clock probe

pub use kvlease_transport::clock_probe::{
    ClockProbeServer, MAX_PROBE_CONNS, MAX_PROBES_PER_CONN, PROBE_TIMEOUT, ProbeHandle, probe_clock,
};

#[cfg(test)]
mod tests;
