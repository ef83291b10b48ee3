//! The P and D engines' cores and their state at first start (and the cores a restart
//! builds afresh).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::num::NonZeroU64;

use kvlease_engine::{DecodeConfig, DecodeCore, PrefillConfig, PrefillCore, TurnHeartbeats};
use kvlease_lease::{DecoderTtl, EngineId, Generation, LeaseConfig};

use super::{Addr, BLOCK_SIZE, Clock, DEngine, NUM_KV_HEADS, PEngine, Pool, engine_id};
use crate::config::{Bug, WorldConfig};

/// The first generation of an engine's incarnation: above every generation an earlier
/// incarnation handed out.
fn first_generation(incarnation: u32) -> Generation {
    NonZeroU64::new((u64::from(incarnation) << 40) | 1)
        .map_or(Generation(NonZeroU64::MIN), Generation)
}

pub(super) fn p_core(
    config: &WorldConfig,
    lease: LeaseConfig,
    id: EngineId,
    incarnation: u32,
) -> PrefillCore<Addr> {
    // A restarted P starts its generations above every earlier one (the agent uses the
    // wall clock in microseconds).
    let first = first_generation(incarnation);
    PrefillCore::new(
        PrefillConfig::new(id, config.p_tp, config.blocks_per_worker, BLOCK_SIZE, lease)
            .with_first_generation(first),
    )
}

/// The instance a P incarnation announces in its handshake and its transfer parameters
/// (the agent uses its start time in microseconds: a restarted P has a larger one; 0
/// means "not said").
pub(super) fn instance_of(incarnation: u32) -> u64 {
    u64::from(incarnation) + 1
}

/// A D engine's core in incarnation `incarnation`; in bidirectional mode it keeps finished
/// turns (the decode agent's `with_hold`), their generations starting above every earlier
/// incarnation's (the agent uses its instance, the wall clock in microseconds; planted
/// [`Bug::HoldGenerationsRepeat`]: at 1 in every incarnation).
pub(super) fn d_core(
    config: &WorldConfig,
    lease: LeaseConfig,
    id: EngineId,
    incarnation: u32,
) -> DecodeCore {
    let mut core = DecodeConfig::new(
        id,
        config.d_tp,
        NUM_KV_HEADS,
        BLOCK_SIZE,
        config
            .bidir
            .map_or(config.blocks_per_worker, |b| b.d_blocks),
        lease,
    )
    .with_limits(u32::try_from(config.d_slots).unwrap_or(u32::MAX), 1 << 20)
    .with_retry(config.d_step);
    if let Some(b) = config.bidir
        && let Ok(ttl) = DecoderTtl::from_duration(b.ttl)
    {
        core = core.with_hold(ttl, b.symmetric);
        if config.bug != Some(Bug::HoldGenerationsRepeat) {
            core = core.with_hold_first_generation(first_generation(incarnation));
        }
    }
    DecodeCore::new(core)
}

impl PEngine {
    /// P engine `i`, alive in its first incarnation, with empty pools and queues.
    pub(super) fn new(config: &WorldConfig, lease: LeaseConfig, i: usize, clock: Clock) -> Self {
        let id = engine_id(&format!("p{i}"));
        Self {
            core: p_core(config, lease, id.clone(), 0),
            id,
            alive: true,
            incarnation: 0,
            clock,
            pools: (0..config.p_tp)
                .map(|_| Pool::new(config.blocks_per_worker))
                .collect(),
            jobs: VecDeque::new(),
            pending: BTreeSet::new(),
            prefilling: VecDeque::new(),
            inbox: VecDeque::new(),
            oracle: HashMap::new(),
            deadlines: BTreeSet::new(),
            grant_order: VecDeque::new(),
            stalled_until: 0,
            stall_end: 0,
            watch_from: None,
            turns: BTreeMap::new(),
            turn_heartbeats: TurnHeartbeats::default(),
            d_conns: BTreeMap::new(),
            pulls: BTreeMap::new(),
        }
    }
}

impl DEngine {
    /// D engine `i`, alive in its first incarnation, with nothing admitted.
    pub(super) fn new(config: &WorldConfig, lease: LeaseConfig, i: usize, clock: Clock) -> Self {
        let id = engine_id(&format!("d{i}"));
        Self {
            core: d_core(config, lease, id.clone(), 0),
            id,
            alive: true,
            incarnation: 0,
            clock,
            arrivals: VecDeque::new(),
            handshakes: VecDeque::new(),
            lost_conns: VecDeque::new(),
            inbox: VecDeque::new(),
            loads: BTreeMap::new(),
            decoding: Vec::new(),
            admitted: BTreeMap::new(),
            tracked: HashSet::new(),
            conns: HashMap::new(),
            stalled_until: 0,
            stall_end: 0,
            last_step: 0,
            mem: d_mem(config),
        }
    }
}

/// A D engine's memory in bidirectional mode (P pulls from it); empty without it.
pub(super) fn d_mem(config: &WorldConfig) -> Pool {
    Pool::new(config.bidir.map_or(0, |b| b.d_blocks))
}
