//! Bidirectional multi-turn mode's decisions (SPEC, "Bidirectional mode"): D keeps
//! a finished turn's blocks for `decoder_kv_blocks_ttl`, P pulls them on the next turn
//! instead of recomputing the shared prefix.
//!
//! What is decided here, with time as an argument and no IO:
//! - [`DecoderKvParams`]: what D answers with in bidirectional mode (D's engine id, side
//!   channel, block ids, the deadline on D's clock **and** the remaining TTL, the
//!   conversation id, one prefix hash per whole block), as plain data. Its JSON form (under
//!   `kv_transfer_params`) is `kvlease-proto`'s turn ([`KvTransferParams`], converted with
//!   [`DecoderKvParams::from_turn`] / [`DecoderKvParams::to_turn`]);
//! - [`plan_pull`]: P's pull-or-recompute decision. It checks the token prefix itself,
//!   block by block (vLLM#43094: a prompt of the right length whose tokens differ, e.g.
//!   stripped reasoning traces, must not reuse KV), the `kv_recompute_threshold`, and that
//!   the deadline leaves `pull_safety_margin` — converted into P's clock with the
//!   lowest-RTT clock offset ([`DeadlineBasis::ClockOffset`]) or from the relative TTL
//!   ([`DeadlineBasis::RelativeTtl`]);
//! - [`DecoderHold`]: D's holding of cached turns, either the fixed TTL
//!   ([`DecoderCache`]) or the **symmetric lease** (P heartbeats D's cached blocks while a
//!   next-turn request waits on P; D extends them like P's leases, bounded), and which
//!   turn gives way first when a new request needs blocks ([`DecoderHold::evict_oldest`]).
//!   The decode core owns one as a sub-state machine
//!   ([`DecodeConfig::with_hold`](crate::DecodeConfig::with_hold));
//! - [`TurnHeartbeats`]: P's schedule of the symmetric lease's heartbeats for D's held
//!   turns while their next-turn requests wait on P.
//!
//! The drivers: the agents (`decode-agent` holds turns through its `DecodeCore`,
//! `prefill-agent` plans pulls and polls its [`TurnHeartbeats`], the
//! proxy ages the params between turns; the clock probes that feed the
//! [`ClockOffsetEstimator`](kvlease_lease::ClockOffsetEstimator) are theirs) and the
//! simulator (`kvlease-sim`'s `run_bidir`: skewed, drifting clocks and asymmetric delays).

use std::collections::VecDeque;
use std::time::Duration;

use kvlease_lease::{
    BlockId, ClockOffset, DecoderCache, DecoderTtl, EngineId, Event, Generation, GrantError,
    LeaseConfig, LeaseTable, PeerTimestamp, RequestId, Timestamp,
};
use kvlease_proto::params::{KvTransferParams, TurnParams};

mod turn_heartbeats;

pub use turn_heartbeats::{
    HeartbeatRun, TURN_HEARTBEATS_PER_EXTENSION, TurnHeartbeat, TurnHeartbeats,
};

/// Most block ids / hashes accepted in one [`DecoderKvParams`].
pub const MAX_PARAM_BLOCKS: usize = 1 << 20;

// ------------------------------------------------------------------- prefix hashes

/// SplitMix64's finalizer.
const fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rolling hash of `tokens[0..=i]` for every `i`: what P and D compare a prompt's
/// prefix on ([`block_hashes`]).
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0x6B76_6C65_6173_6521_u64; // "kvlease!"
    tokens
        .iter()
        .map(|&t| {
            h = mix(h ^ u64::from(t).wrapping_mul(0xA24B_AED4_963E_E407));
            h
        })
        .collect()
}

/// The per-whole-block prefix hashes of `tokens` for `block_size`-token blocks.
pub fn block_hashes(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let bs = block_size.max(1) as usize;
    prefix_hashes(tokens)
        .chunks_exact(bs)
        .filter_map(|c| c.last().copied())
        .collect()
}

// ------------------------------------------------------------------- D's params

/// What D answers with in bidirectional mode, under `kv_transfer_params`: enough for P to
/// pull the cached blocks on the next turn. Field names follow the JSON keys (vLLM's where
/// they exist). The JSON codec is `kvlease-proto`'s (a turn's [`KvTransferParams`]):
/// [`DecoderKvParams::from_turn`] and [`DecoderKvParams::to_turn`] convert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecoderKvParams {
    /// Always true: marks D's cached-blocks params (P's own params never carry it).
    pub kvlease_bidir: bool,
    /// D's engine id.
    pub remote_engine_id: String,
    /// Host of D's side channel.
    pub remote_host: String,
    /// Port of D's side channel.
    pub remote_port: u16,
    /// Port of D's clock probe.
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
    /// For each **whole** block `i`, the rolling prefix hash ([`prefix_hashes`]) of the
    /// tokens `0..(i+1)·block_size`, as `16` hex digits. P compares them with its prompt's.
    pub kvlease_block_hashes: Vec<String>,
    /// Until when D keeps the blocks, in nanoseconds on D's clock (a [`PeerTimestamp`]).
    pub kvlease_deadline_ns: u64,
    /// The same deadline relative to when D answered: the time left then (on the wire:
    /// `kvlease_ttl_remaining_ms`, whole milliseconds). Whoever holds the params between
    /// turns ages it ([`DecoderKvParams::aged_by`]).
    pub kvlease_ttl_remaining: Duration,
    /// Symmetric lease (`symmetric_decoder_lease`): how far each of P's heartbeats for the
    /// entry moves its expiry (from when D receives it), in milliseconds; zero for the
    /// fixed TTL (heartbeats are ignored).
    pub kvlease_renew_extension_ms: u64,
}

/// A [`DecoderKvParams`] field whose value is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct BadParam {
    /// The field's name (its JSON key).
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl DecoderKvParams {
    /// Whether the params are consistent: marked as D's, a block and TP size of at least
    /// one, one hash per whole block, one block id per (partial) block, at most
    /// [`MAX_PARAM_BLOCKS`] blocks, each hash 16 hex digits.
    ///
    /// # Errors
    /// The first field at fault.
    pub fn check(&self) -> Result<(), BadParam> {
        let bad = |field, reason: String| Err(BadParam { field, reason });
        if !self.kvlease_bidir {
            return bad("kvlease_bidir", "must be true".into());
        }
        if self.kvlease_block_size == 0 {
            return bad("kvlease_block_size", "must be at least 1".into());
        }
        if self.tp_size == 0 {
            return bad("tp_size", "must be at least 1".into());
        }
        if self.remote_block_ids.len() > MAX_PARAM_BLOCKS {
            return bad(
                "remote_block_ids",
                format!("more than {MAX_PARAM_BLOCKS} blocks"),
            );
        }
        let whole = self.kvlease_num_tokens / self.kvlease_block_size;
        let all = self.kvlease_num_tokens.div_ceil(self.kvlease_block_size);
        if self.kvlease_block_hashes.len() != whole as usize {
            return bad(
                "kvlease_block_hashes",
                format!(
                    "{} hashes for {} whole blocks",
                    self.kvlease_block_hashes.len(),
                    whole
                ),
            );
        }
        if self.remote_block_ids.len() != all as usize {
            return bad(
                "remote_block_ids",
                format!(
                    "{} block ids for {} tokens (need {all})",
                    self.remote_block_ids.len(),
                    self.kvlease_num_tokens
                ),
            );
        }
        if self.parsed_hashes().is_none() {
            return bad("kvlease_block_hashes", "each must be 16 hex digits".into());
        }
        Ok(())
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

    /// With the symmetric lease (`kvlease_renew_extension_ms` > 0): the params as P's
    /// `run` of heartbeats for the entry leaves them, read on D's clock with `offset`.
    ///
    /// D extends a held entry only when a heartbeat reaches it **before** the entry's
    /// deadline (the lease rule: a late heartbeat does not revive an expired entry). So the
    /// run counts only when its first heartbeat was sent before the advertised deadline
    /// even at the latest D time it can have been sent at (P's send time plus the offset's
    /// error bound, rtt/2); each later heartbeat of the run then came while the entry was
    /// held ([`HeartbeatRun`]). D then keeps the entry until at least the last heartbeat's
    /// earliest send time on D's clock plus the extension; the deadline moves there when
    /// that is later. `None` when nothing changes (the fixed TTL, a run that began at or
    /// after the deadline, or no later bound). The one-way delay of the first heartbeat is
    /// not counted (P cannot know it), nor a heartbeat lost on the way: the pull's fence
    /// catches a hold that ended all the same.
    pub fn renewed_by_heartbeats(&self, run: HeartbeatRun, offset: &ClockOffset) -> Option<Self> {
        if self.kvlease_renew_extension_ms == 0 {
            return None;
        }
        if offset.to_peer_latest(run.first).as_nanos_saturating() >= self.kvlease_deadline_ns {
            return None;
        }
        let until = offset
            .to_peer_earliest(run.last)
            .as_nanos_saturating()
            .saturating_add(self.kvlease_renew_extension_ms.saturating_mul(1_000_000));
        (until > self.kvlease_deadline_ns).then(|| Self {
            kvlease_deadline_ns: until,
            ..self.clone()
        })
    }

    /// The params with `elapsed` taken off the relative TTL (saturating at zero): what a
    /// holder forwards after keeping them for `elapsed`.
    #[must_use]
    pub fn aged_by(mut self, elapsed: Duration) -> Self {
        self.kvlease_ttl_remaining = self.kvlease_ttl_remaining.saturating_sub(elapsed);
        self
    }

    /// The params of a turn read with `kvlease-proto`'s codec
    /// ([`KvTransferParams::from_turn_value`], which checked them); `None` when `p` is a
    /// lease, not a turn.
    pub fn from_turn(p: &KvTransferParams) -> Option<Self> {
        let t = p.turn.as_ref()?;
        Some(Self {
            kvlease_bidir: true,
            remote_engine_id: p.remote_engine_id.as_str().to_owned(),
            remote_host: p.remote_host.clone(),
            remote_port: p.remote_port,
            kvlease_clock_port: t.kvlease_clock_port,
            remote_block_ids: p.remote_block_ids.clone(),
            remote_request_id: p.remote_request_id.as_str().to_owned(),
            tp_size: p.tp_size,
            kvlease_generation: p.kvlease_generation,
            conversation_id: t.conversation_id.clone(),
            kvlease_num_tokens: p.kvlease_num_tokens,
            kvlease_block_size: t.kvlease_block_size,
            kvlease_block_hashes: t
                .kvlease_block_hashes
                .iter()
                .map(|h| format!("{h:016x}"))
                .collect(),
            kvlease_deadline_ns: t.kvlease_deadline_ns,
            kvlease_ttl_remaining: Duration::from_millis(t.kvlease_ttl_remaining_ms),
            kvlease_renew_extension_ms: t.kvlease_renew_extension_ms,
        })
    }

    /// The params as `kvlease-proto`'s turn, to write with [`KvTransferParams::to_value`]
    /// (the relative TTL in whole milliseconds, truncated).
    ///
    /// # Errors
    /// The field at fault when [`check`](Self::check) fails or an id is not a valid id.
    pub fn to_turn(&self) -> Result<KvTransferParams, BadParam> {
        self.check()?;
        let bad_id = |field| {
            move |e: kvlease_lease::InvalidId| BadParam {
                field,
                reason: e.to_string(),
            }
        };
        Ok(KvTransferParams {
            remote_engine_id: EngineId::new(&self.remote_engine_id)
                .map_err(bad_id("remote_engine_id"))?,
            remote_request_id: RequestId::new(&self.remote_request_id)
                .map_err(bad_id("remote_request_id"))?,
            remote_block_ids: self.remote_block_ids.clone(),
            remote_block_groups: Vec::new(),
            remote_host: self.remote_host.clone(),
            remote_port: self.remote_port,
            tp_size: self.tp_size,
            dcp_size: None,
            pp_size: None,
            remote_num_tokens: None,
            transfer_mode: None,
            kvlease_generation: self.kvlease_generation,
            kvlease_num_tokens: self.kvlease_num_tokens,
            kvlease_lease_ms: None,
            kvlease_instance: 0,
            kv_digest: None,
            turn: Some(TurnParams {
                kvlease_block_size: self.kvlease_block_size,
                kvlease_block_hashes: self.parsed_hashes().unwrap_or_default(),
                kvlease_deadline_ns: self.kvlease_deadline_ns,
                kvlease_ttl_remaining_ms: u64::try_from(self.kvlease_ttl_remaining.as_millis())
                    .unwrap_or(u64::MAX),
                kvlease_renew_extension_ms: self.kvlease_renew_extension_ms,
                kvlease_clock_port: self.kvlease_clock_port,
                conversation_id: self.conversation_id.clone(),
                remote_blocks_expiry_us: None,
            }),
        })
    }
}

// ------------------------------------------------------------------- P's decision

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

/// D's deadline as P reads it on its own clock at `now`, on `basis`: for
/// [`DeadlineBasis::ClockOffset`] the earliest it may be given `offset`'s error bound
/// (`None` without a clock sample), for [`DeadlineBasis::RelativeTtl`] `now` plus the
/// remaining TTL (as aged until `now`). [`plan_pull`] pulls only when it leaves the margin
/// after `now`.
pub fn estimated_deadline(
    basis: DeadlineBasis,
    params: &DecoderKvParams,
    now: Timestamp,
    offset: Option<ClockOffset>,
) -> Option<Timestamp> {
    match basis {
        DeadlineBasis::ClockOffset => offset.map(|o| o.to_local_earliest(params.deadline())),
        DeadlineBasis::RelativeTtl => now.checked_add(params.kvlease_ttl_remaining),
    }
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
        DeadlineBasis::RelativeTtl => params.kvlease_ttl_remaining >= margin,
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

/// What D does with cached turns' blocks: the fixed TTL (default), or the symmetric lease;
/// and which turn gives way first when a new request needs blocks (the oldest).
#[derive(Debug)]
pub struct DecoderHold {
    kind: HoldKind,
    /// Cached turns in insertion order (some may be gone already), for eviction.
    order: VecDeque<RequestId>,
}

#[derive(Debug)]
enum HoldKind {
    /// `decoder_kv_blocks_ttl`, no renewal (SPEC).
    Fixed(DecoderCache),
    /// Beyond vLLM: P heartbeats the cached blocks while a next-turn request waits on P;
    /// each heartbeat moves the expiry to `max(expiry, now + extension)` (the lease rule)
    /// with a table whose duration is the TTL. A P that stops heartbeating loses them at
    /// the usual bound.
    Symmetric(LeaseTable),
}

impl HoldKind {
    fn holds(&self, request: &RequestId) -> bool {
        match self {
            Self::Fixed(c) => c.deadline(request).is_some(),
            Self::Symmetric(t) => t.get(request).is_some(),
        }
    }
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
    /// A hold of `ttl`; `symmetric` selects the renewable variant. Its first entry gets
    /// generation 1 ([`with_first_generation`](Self::with_first_generation)).
    pub fn new(ttl: DecoderTtl, symmetric: bool) -> Self {
        Self::with_first_generation(ttl, symmetric, Generation(std::num::NonZeroU64::MIN))
    }

    /// A hold of `ttl` whose first entry gets generation `first`, then `first + 1`, …: a D
    /// that restarts starts above every generation it handed out before, so that a pull
    /// with an earlier instance's params never matches a new entry on the same blocks.
    pub fn with_first_generation(ttl: DecoderTtl, symmetric: bool, first: Generation) -> Self {
        let fixed = || HoldKind::Fixed(DecoderCache::with_first_generation(ttl, first));
        let kind = if symmetric {
            // DecoderTtl is validated against the same range as lease durations, so the
            // derivation cannot fail; fall back to the fixed cache if it ever does.
            match LeaseConfig::from_duration(ttl.as_duration()) {
                Ok(c) => HoldKind::Symmetric(LeaseTable::with_first_generation(c, first)),
                Err(_) => fixed(),
            }
        } else {
            fixed()
        };
        Self {
            kind,
            order: VecDeque::new(),
        }
    }

    /// With the symmetric lease, how far each of P's heartbeats moves an entry's expiry;
    /// `None` for the fixed TTL (never renewed).
    pub fn renew_extension(&self) -> Option<Duration> {
        match &self.kind {
            HoldKind::Fixed(_) => None,
            HoldKind::Symmetric(t) => Some(t.config().extension()),
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
    ) -> Result<Held, GrantError> {
        let held = match &mut self.kind {
            HoldKind::Fixed(c) => c.insert(now, request.clone(), blocks).map(|c| Held {
                generation: c.generation,
                deadline: c.deadline,
            })?,
            HoldKind::Symmetric(t) => {
                let generation = t.grant(now, request.clone(), blocks, 1)?;
                Held {
                    generation,
                    deadline: now + t.config().duration(),
                }
            }
        };
        self.order.push_back(request);
        // Turns pulled or expired leave their ids in the eviction order: prune them once
        // they outnumber the turns held, so the order stays within about twice what is
        // held (amortized O(1) per insert) rather than growing with every turn ever held.
        if self.order.len() > 2 * self.len() + 16 {
            let kind = &self.kind;
            self.order.retain(|id| kind.holds(id));
        }
        Ok(held)
    }

    /// Turns held.
    pub fn len(&self) -> usize {
        match &self.kind {
            HoldKind::Fixed(c) => c.len(),
            HoldKind::Symmetric(t) => t.len(),
        }
    }

    /// Whether no turn is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// P's heartbeat for cached `ids`; returns how many it extended (always zero for the
    /// fixed TTL: it is never renewed).
    pub fn heartbeat(&mut self, now: Timestamp, ids: &[RequestId]) -> u32 {
        match &mut self.kind {
            HoldKind::Fixed(_) => 0,
            HoldKind::Symmetric(t) => t.handle_heartbeat(now, ids).extended,
        }
    }

    /// P read the blocks: free them.
    pub fn read_complete(&mut self, now: Timestamp, request: &RequestId) -> bool {
        match &mut self.kind {
            HoldKind::Fixed(c) => c.remove(now, request),
            HoldKind::Symmetric(t) => t.abort(now, request),
        }
    }

    /// Frees the oldest cached turn still held, so that a new request gets its blocks;
    /// `None` when none is left. Then drain [`DecoderHold::poll_event`].
    pub fn evict_oldest(&mut self, now: Timestamp) -> Option<RequestId> {
        while let Some(id) = self.order.pop_front() {
            if self.read_complete(now, &id) {
                return Some(id);
            }
        }
        None
    }

    /// Expires what is due; then drain [`DecoderHold::poll_event`].
    pub fn handle_timeout(&mut self, now: Timestamp) -> usize {
        match &mut self.kind {
            HoldKind::Fixed(c) => c.handle_timeout(now),
            HoldKind::Symmetric(t) => t.handle_timeout(now),
        }
    }

    /// The next release; `None` once all are drained (the eviction order is then
    /// forgotten if nothing is held).
    pub fn poll_event(&mut self) -> Option<Event> {
        let e = match &mut self.kind {
            HoldKind::Fixed(c) => c.poll_event(),
            HoldKind::Symmetric(t) => t.poll_event(),
        };
        if e.is_none() && self.blocks_held() == 0 {
            self.order.clear();
        }
        e
    }

    /// The earliest deadline of an entry held, when to call
    /// [`handle_timeout`](Self::handle_timeout) next; `None` when nothing is held.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match &self.kind {
            HoldKind::Fixed(c) => c.poll_timeout(),
            HoldKind::Symmetric(t) => t.poll_timeout(),
        }
    }

    /// The current deadline of `request`.
    pub fn deadline(&self, request: &RequestId) -> Option<Timestamp> {
        match &self.kind {
            HoldKind::Fixed(c) => c.deadline(request),
            HoldKind::Symmetric(t) => t.get(request).map(|i| i.expiry),
        }
    }

    /// Blocks held by all entries.
    pub fn blocks_held(&self) -> usize {
        match &self.kind {
            HoldKind::Fixed(c) => c.blocks_held(),
            HoldKind::Symmetric(t) => t.blocks_held(),
        }
    }
}

#[cfg(test)]
mod tests;
