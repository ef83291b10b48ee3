//! Bidirectional multi-turn KV transfer (SPEC, "Bidirectional mode"): D keeps a
//! finished turn's blocks for `decoder_kv_blocks_ttl`, P pulls them on the next turn
//! instead of recomputing the shared prefix.
//!
//! The decisions live in the engine ([`kvlease_engine`]: [`DecoderKvParams`],
//! [`plan_pull`](kvlease_engine::plan_pull), [`DecoderHold`](kvlease_engine::DecoderHold)),
//! so that the simulator drives the same code. This module holds what touches the outside:
//! - the JSON codec of [`DecoderKvParams`] ([`params_from_value`], [`params_to_value`],
//!   [`is_decoder_params`]), the `kv_transfer_params` D answers with in bidirectional mode;
//! - [`PeerClock`]: the clock an agent shows its peers;
//! - [`ClockProbeServer`] / [`probe_clock`]: a tiny request (own port, 16-byte frames) that
//!   gives P `(t0, t_remote, t1)` samples of D's clock for the [`ClockOffsetEstimator`];
//! - [`ConversationStore`](crate::proxy::ConversationStore): the proxy's memory of D's
//!   params between turns, keyed by [`conversation_key`](crate::proxy::conversation_key);
//! - [`TEST_CLOCK_OFFSET_ENV`]: an offset added to the clock an agent reports, so tests can
//!   run two agents with ±10 s of skew on one host.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvlease_engine::DecoderKvParams;
use kvlease_lease::{ClockOffsetEstimator, PeerTimestamp, Timestamp};
use serde::{Deserialize, Serialize};
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

// ------------------------------------------------------------------- JSON codec

/// The JSON form of [`DecoderKvParams`] (the engine holds them as plain data): the same
/// fields under the same keys, the relative TTL as whole milliseconds.
#[derive(Serialize, Deserialize)]
#[serde(remote = "DecoderKvParams")]
struct Wire {
    kvlease_bidir: bool,
    remote_engine_id: String,
    remote_host: String,
    remote_port: u16,
    kvlease_clock_port: u16,
    remote_block_ids: Vec<u32>,
    remote_request_id: String,
    tp_size: u32,
    kvlease_generation: u64,
    conversation_id: String,
    kvlease_num_tokens: u32,
    kvlease_block_size: u32,
    kvlease_block_hashes: Vec<String>,
    kvlease_deadline_ns: u64,
    #[serde(rename = "kvlease_ttl_remaining_ms", with = "whole_millis")]
    kvlease_ttl_remaining: Duration,
    #[serde(default)]
    kvlease_renew_extension_ms: u64,
}

/// A [`Duration`] as whole milliseconds (truncated, saturating).
mod whole_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// Parses D's cached-blocks params as P gets them (D's answer, copied by a proxy), naming
/// the field at fault.
///
/// # Errors
/// 400 naming `kv_transfer_params.<field>` for a missing or mistyped field or one that
/// fails [`DecoderKvParams::check`].
pub fn params_from_value(v: &Value) -> Result<DecoderKvParams, ApiError> {
    let p = Wire::deserialize(v).map_err(|e| {
        ApiError::bad_field(
            "kv_transfer_params",
            format!("bidirectional params from D: {e}"),
        )
    })?;
    p.check()
        .map_err(|e| ApiError::bad_field(format!("kv_transfer_params.{}", e.field), e.reason))?;
    Ok(p)
}

/// The JSON form of `p`.
pub fn params_to_value(p: &DecoderKvParams) -> Value {
    // Invariant: every field is a plain string, integer, bool or list of those.
    Wire::serialize(p, serde_json::value::Serializer).unwrap_or(Value::Null)
}

/// Whether `v` (a request's `kv_transfer_params`) carries D's cached-blocks params.
pub fn is_decoder_params(v: Option<&Value>) -> bool {
    v.and_then(|v| v.get("kvlease_bidir"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

// ------------------------------------------------------------------- clock probe

const PROBE_REQ: &[u8; 8] = b"KVLCLK01";
/// Read/write timeout of every clock-probe socket.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most clock-probe connections served at once.
pub const MAX_PROBE_CONNS: usize = 32;
/// Most probes answered on one connection.
pub const MAX_PROBES_PER_CONN: u32 = 64;

/// Answers clock probes: each 8-byte request `KVLCLK01` gets `KVLCLK01` and the clock's
/// nanoseconds (big endian). It reveals only the time, so it needs no token.
pub struct ClockProbeServer {
    /// The clock reported.
    pub clock: PeerClock,
}

/// A running probe server; stops accepting when dropped.
#[derive(Debug)]
pub struct ProbeHandle {
    /// The bound address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for ProbeHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop; failure means it is already gone.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

impl ClockProbeServer {
    /// Binds `addr` and answers probes on a background thread (one short-lived thread per
    /// connection, at most [`MAX_PROBE_CONNS`]).
    ///
    /// # Errors
    /// The bind error.
    pub fn spawn(self, addr: SocketAddr) -> io::Result<ProbeHandle> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let clock = self.clock;
        let live = Arc::new(AtomicUsize::new(0));
        thread::Builder::new()
            .name("clock-probe".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    if live.fetch_add(1, Ordering::AcqRel) >= MAX_PROBE_CONNS {
                        live.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    let live2 = Arc::clone(&live);
                    let spawned = thread::Builder::new()
                        .name("clock-probe-conn".into())
                        .spawn(move || {
                            let _ = answer_probes(conn, clock);
                            live2.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        live.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?;
        Ok(ProbeHandle { addr, stop })
    }
}

fn answer_probes(mut s: TcpStream, clock: PeerClock) -> io::Result<()> {
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    s.set_write_timeout(Some(PROBE_TIMEOUT))?;
    s.set_nodelay(true)?;
    for _ in 0..MAX_PROBES_PER_CONN {
        let mut req = [0u8; 8];
        s.read_exact(&mut req)?;
        if &req != PROBE_REQ {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a probe"));
        }
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(PROBE_REQ);
        out[8..].copy_from_slice(&clock.now_ns().to_be_bytes());
        s.write_all(&out)?;
    }
    Ok(())
}

/// Sends `samples` probes to `addr` on one connection and feeds each `(t0, t_remote, t1)`
/// into `est`; `local` is this host's clock (as [`Timestamp`]s on the same scale as the
/// ones the deadline check uses). Returns how many samples were added.
///
/// # Errors
/// The IO error or timeout ([`PROBE_TIMEOUT`] per socket operation); a reply that is not a
/// probe answer is [`io::ErrorKind::InvalidData`].
pub fn probe_clock(
    addr: SocketAddr,
    samples: u32,
    local: &dyn Fn() -> Timestamp,
    est: &mut ClockOffsetEstimator,
) -> io::Result<u32> {
    let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)?;
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    s.set_write_timeout(Some(PROBE_TIMEOUT))?;
    s.set_nodelay(true)?;
    let mut added = 0;
    for _ in 0..samples.min(MAX_PROBES_PER_CONN) {
        let t0 = local();
        s.write_all(PROBE_REQ)?;
        let mut reply = [0u8; 16];
        s.read_exact(&mut reply)?;
        let t1 = local();
        let (magic, t) = reply.split_at(8);
        if magic != PROBE_REQ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad probe reply",
            ));
        }
        let mut ns = [0u8; 8];
        ns.copy_from_slice(t);
        let remote = PeerTimestamp::from_nanos(u64::from_be_bytes(ns));
        if est.add_sample(t0, remote, t1).is_ok() {
            added += 1;
        }
    }
    Ok(added)
}

#[cfg(test)]
mod tests;
