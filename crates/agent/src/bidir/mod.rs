//! Bidirectional multi-turn KV transfer (SPEC, "Bidirectional mode"; issue 8): D keeps a
//! finished turn's blocks for `decoder_kv_blocks_ttl`, P pulls them on the next turn
//! instead of recomputing the shared prefix.
//!
//! This module holds the parts that decide, and the wire forms they decide on:
//! - [`DecoderKvParams`]: the `kv_transfer_params` D answers with in bidirectional mode
//!   (D's engine id, side channel, block ids, the deadline on D's clock **and** the
//!   remaining TTL, the conversation id, one prefix hash per whole block);
//! - [`plan_pull`]: P's pull-or-recompute decision. It checks the token prefix itself,
//!   block by block (vLLM#43094: a prompt of the right length whose tokens differ, e.g.
//!   stripped reasoning traces, must not reuse KV), the `kv_recompute_threshold`, and that
//!   the deadline leaves `pull_safety_margin` — converted into P's clock with the
//!   lowest-RTT clock offset ([`DeadlineBasis::ClockOffset`]) or from the relative TTL
//!   ([`DeadlineBasis::RelativeTtl`]);
//! - [`DecoderHold`]: D's holding of cached blocks, either the fixed TTL
//!   ([`DecoderCache`]) or the **symmetric lease** (P heartbeats D's cached blocks while a
//!   next-turn request waits on P; D extends them like P's leases, bounded);
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

use kvlease_lease::{
    BlockId, ClockOffset, ClockOffsetEstimator, DecoderCache, DecoderTtl, Event, Generation,
    LeaseConfig, LeaseTable, PeerTimestamp, RequestId, Timestamp,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::ApiError;
use crate::kv;

/// The environment variable holding a clock offset in milliseconds (signed) that an agent
/// adds to the wall clock it reports to peers. For tests only: it simulates skew between
/// hosts on one machine.
pub const TEST_CLOCK_OFFSET_ENV: &str = "KVLEASE_TEST_CLOCK_OFFSET_MS";

/// Largest injected offset accepted (one day).
pub const MAX_TEST_CLOCK_OFFSET_MS: i64 = 86_400_000;

/// Most block ids / hashes accepted in one [`DecoderKvParams`].
pub const MAX_PARAM_BLOCKS: usize = 1 << 20;

/// Why a bidirectional-mode input was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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

// ------------------------------------------------------------------- wire form

/// What D answers with in bidirectional mode, under `kv_transfer_params`: enough for P to
/// pull the cached blocks on the next turn. Field names follow vLLM's where they exist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderKvParams {
    /// Always true: marks D's cached-blocks params (P's own params never carry it).
    pub kvlease_bidir: bool,
    /// D's engine id.
    pub remote_engine_id: String,
    /// Host of D's side channel.
    pub remote_host: String,
    /// Port of D's side channel.
    pub remote_port: u16,
    /// Port of D's clock probe ([`ClockProbeServer`]).
    pub kvlease_clock_port: u16,
    /// D's block ids holding the turn, in token order.
    pub remote_block_ids: Vec<u32>,
    /// D's id of the cached entry (the read-complete notification names it).
    pub remote_request_id: String,
    /// D's TP size.
    pub tp_size: u32,
    /// The cached entry's fencing generation.
    pub kvlease_generation: u64,
    /// The conversation the turn belongs to.
    pub conversation_id: String,
    /// Tokens whose KV the blocks hold.
    pub kvlease_num_tokens: u32,
    /// Tokens per block.
    pub kvlease_block_size: u32,
    /// For each **whole** block `i`, the rolling prefix hash ([`kv::prefix_hashes`]) of the
    /// tokens `0..(i+1)·block_size`, as `16` hex digits. P compares them with its prompt's.
    pub kvlease_block_hashes: Vec<String>,
    /// Until when D keeps the blocks, in nanoseconds on D's clock (a [`PeerTimestamp`]).
    pub kvlease_deadline_ns: u64,
    /// The same deadline relative to when D answered: milliseconds left then. Whoever
    /// holds the params between turns ages it ([`DecoderKvParams::aged_by`]).
    pub kvlease_ttl_remaining_ms: u64,
    /// Symmetric lease (`symmetric_decoder_lease`): how far each of P's heartbeats for the
    /// entry moves its expiry (from when D receives it), in milliseconds; zero for the
    /// fixed TTL (heartbeats are ignored).
    #[serde(default)]
    pub kvlease_renew_extension_ms: u64,
}

/// The per-whole-block prefix hashes of `tokens` for `block_size`-token blocks.
pub fn block_hashes(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let bs = block_size.max(1) as usize;
    kv::prefix_hashes(tokens)
        .chunks_exact(bs)
        .filter_map(|c| c.last().copied())
        .collect()
}

impl DecoderKvParams {
    /// Parses the params as P gets them (D's answer, copied by a proxy), naming the field at
    /// fault.
    ///
    /// # Errors
    /// 400 naming `kv_transfer_params.<field>` for a missing or mistyped field, inconsistent
    /// hash and block counts, or a hash that is not 16 hex digits.
    pub fn from_value(v: &Value) -> Result<Self, ApiError> {
        let p: Self = serde_json::from_value(v.clone()).map_err(|e| {
            ApiError::bad_field(
                "kv_transfer_params",
                format!("bidirectional params from D: {e}"),
            )
        })?;
        let bad = |field: &str, msg: String| {
            ApiError::bad_field(format!("kv_transfer_params.{field}"), msg)
        };
        if !p.kvlease_bidir {
            return Err(bad("kvlease_bidir", "must be true".into()));
        }
        if p.kvlease_block_size == 0 {
            return Err(bad("kvlease_block_size", "must be at least 1".into()));
        }
        if p.tp_size == 0 {
            return Err(bad("tp_size", "must be at least 1".into()));
        }
        if p.remote_block_ids.len() > MAX_PARAM_BLOCKS {
            return Err(bad(
                "remote_block_ids",
                format!("more than {MAX_PARAM_BLOCKS} blocks"),
            ));
        }
        let whole = p.kvlease_num_tokens / p.kvlease_block_size;
        let all = p.kvlease_num_tokens.div_ceil(p.kvlease_block_size);
        if p.kvlease_block_hashes.len() != whole as usize {
            return Err(bad(
                "kvlease_block_hashes",
                format!(
                    "{} hashes for {} whole blocks",
                    p.kvlease_block_hashes.len(),
                    whole
                ),
            ));
        }
        if p.remote_block_ids.len() != all as usize {
            return Err(bad(
                "remote_block_ids",
                format!(
                    "{} block ids for {} tokens (need {all})",
                    p.remote_block_ids.len(),
                    p.kvlease_num_tokens
                ),
            ));
        }
        if p.parsed_hashes().is_none() {
            return Err(bad(
                "kvlease_block_hashes",
                "each must be 16 hex digits".into(),
            ));
        }
        Ok(p)
    }

    fn parsed_hashes(&self) -> Option<Vec<u64>> {
        self.kvlease_block_hashes
            .iter()
            .map(|h| {
                (h.len() == 16)
                    .then(|| u64::from_str_radix(h, 16).ok())
                    .flatten()
            })
            .collect()
    }

    /// The deadline on D's clock.
    pub fn deadline(&self) -> PeerTimestamp {
        PeerTimestamp::from_nanos(self.kvlease_deadline_ns)
    }

    /// The params with `elapsed` taken off the relative TTL (saturating at zero): what a
    /// holder forwards after keeping them for `elapsed`.
    #[must_use]
    pub fn aged_by(mut self, elapsed: Duration) -> Self {
        let ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        self.kvlease_ttl_remaining_ms = self.kvlease_ttl_remaining_ms.saturating_sub(ms);
        self
    }

    /// The JSON form.
    pub fn to_value(&self) -> Value {
        // Invariant: every field is a plain string, integer, bool or list of those.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// Whether `v` (a request's `kv_transfer_params`) carries D's cached-blocks params.
pub fn is_decoder_params(v: Option<&Value>) -> bool {
    v.and_then(|v| v.get("kvlease_bidir"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

// ------------------------------------------------------------------- decision

/// How P turns D's deadline into "time left".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineBasis {
    /// The absolute deadline on D's clock, converted with the lowest-RTT clock offset
    /// (worst case within its error bound). Needs a clock sample.
    ClockOffset,
    /// The relative TTL as aged by whoever held the params; immune to clock skew, off by
    /// the (unaccounted) one-way delays of the hops, which the margin must cover.
    RelativeTtl,
}

/// P's pull policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullPolicy {
    /// `kv_recompute_threshold`: a shared prefix shorter than this is recomputed.
    pub threshold_tokens: u32,
    /// `pull_safety_margin`: the time the deadline must still leave after `now` plus the
    /// expected transfer time.
    pub safety_margin: Duration,
    /// How the deadline is read.
    pub basis: DeadlineBasis,
}

/// Why P recomputes instead of pulling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecomputeReason {
    /// The first block already differs (or no whole block is cached).
    NoCommonBlock,
    /// The common whole blocks hold fewer tokens than the threshold.
    BelowThreshold {
        /// Tokens in common whole blocks.
        shared_tokens: usize,
    },
    /// The deadline leaves less than the margin (or has passed).
    DeadlineTooClose,
    /// [`DeadlineBasis::ClockOffset`] without any clock sample of D.
    NoClockSample,
    /// D's block size differs from P's.
    BlockSizeMismatch,
}

/// P's decision for a next-turn prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullDecision {
    /// Read D's first `blocks.len()` blocks: they hold the KV of `tokens` prompt tokens.
    Pull {
        /// D's block ids to read, in token order.
        blocks: Vec<BlockId>,
        /// Prompt tokens they cover (`blocks.len() × block_size`).
        tokens: usize,
        /// Whether the prompt diverged inside the cached prefix (only the common part is
        /// pulled).
        diverged: bool,
    },
    /// Compute the whole prompt.
    Recompute(RecomputeReason),
}

/// Whole blocks, from the first, on which `prompt`'s prefix hashes equal D's. A block
/// counts only when the prompt has all its tokens.
pub fn common_blocks(params: &DecoderKvParams, prompt: &[u32]) -> usize {
    let Some(cached) = params.parsed_hashes() else {
        return 0;
    };
    let mine = block_hashes(prompt, params.kvlease_block_size);
    cached.iter().zip(&mine).take_while(|(a, b)| a == b).count()
}

/// P's decision: pull the common whole blocks of D's cached turn, or recompute.
///
/// - `now`: P's clock; `offset`: P's estimate of D's clock (for
///   [`DeadlineBasis::ClockOffset`]);
/// - `block_size`: P's block size (must equal D's);
/// - `expected_transfer`: how long the read should take (added to the margin).
pub fn plan_pull(
    policy: &PullPolicy,
    params: &DecoderKvParams,
    prompt: &[u32],
    block_size: u32,
    now: Timestamp,
    offset: Option<ClockOffset>,
    expected_transfer: Duration,
) -> PullDecision {
    if params.kvlease_block_size != block_size {
        return PullDecision::Recompute(RecomputeReason::BlockSizeMismatch);
    }
    let n = common_blocks(params, prompt);
    if n == 0 {
        return PullDecision::Recompute(RecomputeReason::NoCommonBlock);
    }
    let tokens = n * block_size as usize;
    if tokens < policy.threshold_tokens as usize {
        return PullDecision::Recompute(RecomputeReason::BelowThreshold {
            shared_tokens: tokens,
        });
    }
    let margin = policy.safety_margin.saturating_add(expected_transfer);
    let leaves = match policy.basis {
        DeadlineBasis::ClockOffset => match offset {
            None => return PullDecision::Recompute(RecomputeReason::NoClockSample),
            Some(o) => o.deadline_leaves(now, params.deadline(), margin),
        },
        DeadlineBasis::RelativeTtl => {
            Duration::from_millis(params.kvlease_ttl_remaining_ms) >= margin
        }
    };
    if !leaves {
        return PullDecision::Recompute(RecomputeReason::DeadlineTooClose);
    }
    let whole = params.kvlease_block_hashes.len();
    PullDecision::Pull {
        blocks: params.remote_block_ids[..n]
            .iter()
            .map(|&b| BlockId(b))
            .collect(),
        tokens,
        diverged: n < whole && prompt.len() >= (n + 1) * block_size as usize,
    }
}

// ------------------------------------------------------------------- D's holding

/// What D does with a cached turn's blocks: the fixed TTL (default), or the symmetric lease.
#[derive(Debug)]
pub enum DecoderHold {
    /// `decoder_kv_blocks_ttl`, no renewal (SPEC).
    Fixed(DecoderCache),
    /// Beyond vLLM: P heartbeats the cached blocks while a next-turn request waits on P;
    /// each heartbeat moves the expiry to `max(expiry, now + extension)` (the lease rule)
    /// with a table whose duration is the TTL. A P that stops heartbeating loses them at
    /// the usual bound.
    Symmetric(LeaseTable),
}

/// A cached entry: its generation and deadline on D's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The fencing generation P's pull checks.
    pub generation: Generation,
    /// Until when D keeps the blocks (D's local clock).
    pub deadline: Timestamp,
}

impl DecoderHold {
    /// A hold of `ttl`; `symmetric` selects the renewable variant.
    pub fn new(ttl: DecoderTtl, symmetric: bool) -> Self {
        if symmetric {
            // DecoderTtl is validated against the same range as lease durations, so the
            // derivation cannot fail; fall back to the fixed cache if it ever does.
            match LeaseConfig::from_duration(ttl.as_duration()) {
                Ok(c) => Self::Symmetric(LeaseTable::new(c)),
                Err(_) => Self::Fixed(DecoderCache::new(ttl)),
            }
        } else {
            Self::Fixed(DecoderCache::new(ttl))
        }
    }

    /// Keeps `blocks` of `request` from `now`.
    ///
    /// # Errors
    /// The lease table's refusal (a duplicate id, a full table).
    pub fn insert(
        &mut self,
        now: Timestamp,
        request: RequestId,
        blocks: Vec<BlockId>,
    ) -> Result<Held, kvlease_lease::GrantError> {
        match self {
            Self::Fixed(c) => c.insert(now, request, blocks).map(|c| Held {
                generation: c.generation,
                deadline: c.deadline,
            }),
            Self::Symmetric(t) => {
                let generation = t.grant(now, request, blocks, 1)?;
                Ok(Held {
                    generation,
                    deadline: now + t.config().duration(),
                })
            }
        }
    }

    /// P's heartbeat for cached `ids`; returns how many it extended (always zero for
    /// [`DecoderHold::Fixed`]: a fixed TTL is never renewed).
    pub fn heartbeat(&mut self, now: Timestamp, ids: &[RequestId]) -> u32 {
        match self {
            Self::Fixed(_) => 0,
            Self::Symmetric(t) => t.handle_heartbeat(now, ids).extended,
        }
    }

    /// P read the blocks: free them.
    pub fn read_complete(&mut self, now: Timestamp, request: &RequestId) -> bool {
        match self {
            Self::Fixed(c) => c.remove(now, request),
            Self::Symmetric(t) => t.abort(now, request),
        }
    }

    /// Expires what is due; then drain [`DecoderHold::poll_event`].
    pub fn handle_timeout(&mut self, now: Timestamp) -> usize {
        match self {
            Self::Fixed(c) => c.handle_timeout(now),
            Self::Symmetric(t) => t.handle_timeout(now),
        }
    }

    /// The next release.
    pub fn poll_event(&mut self) -> Option<Event> {
        match self {
            Self::Fixed(c) => c.poll_event(),
            Self::Symmetric(t) => t.poll_event(),
        }
    }

    /// The current deadline of `request`.
    pub fn deadline(&self, request: &RequestId) -> Option<Timestamp> {
        match self {
            Self::Fixed(c) => c.deadline(request),
            Self::Symmetric(t) => t.get(request).map(|i| i.expiry),
        }
    }

    /// Blocks held by all entries.
    pub fn blocks_held(&self) -> usize {
        match self {
            Self::Fixed(c) => c.blocks_held(),
            Self::Symmetric(t) => t.blocks_held(),
        }
    }
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
