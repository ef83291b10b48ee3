//! The world: engine cores in their shells, network, virtual time, faults, and the checker.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use kvlease_engine::{
    BatchResult, Cause, DecodeConfig, DecodeCore, DecodeEvent, DecodeNotif, LoadError, LoadPlan,
    Outcome, Peer, PrefillAction, PrefillConfig, PrefillCore, PrefillEvent, PrefillNotif,
    RemoteEngine, RemoteKv, TransmitKind,
};
use kvlease_lease::{
    ConsumerId, EngineId, Generation, LeaseConfig, LeaseMode, ReadCompleteOutcome, ReleaseReason,
    Released, RequestId, Timestamp,
};
use kvlease_notif::{
    Abort, ExpiredLease, MAX_NOTIF_LEN, Notif, ReadComplete, decode, encode_expired,
    encode_heartbeats,
};

use crate::config::{Bug, WorldConfig};
use crate::rng::Rng;

/// Content of a freed block: what P writes over blocks it releases.
const POISON: u64 = 0xdead_dead_dead_dead;

/// Stop after this much virtual time past the last arrival, drained or not.
const MAX_DRAIN: Duration = Duration::from_secs(600);

/// Failures kept per run (the first ones are the interesting ones).
const MAX_FAILURES: usize = 20;

/// Tokens per block, on P and D.
const BLOCK_SIZE: u32 = 16;

/// Global KV heads of the simulated model (divisible by every TP size the worlds use).
const NUM_KV_HEADS: u32 = 8;

/// An endpoint of the notification network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Addr {
    P {
        engine: usize,
        worker: u32,
    },
    D {
        engine: usize,
        rank: u32,
    },
    /// The forger: a third peer that sniffs request ids and sends notifications under its
    /// own (authenticated) engine id.
    Rogue,
}

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimStats {
    /// Requests that arrived at P.
    pub arrived: u64,
    /// Requests that ended in exactly one outcome.
    pub outcomes_ok: u64,
    /// Outcome: refused by P (no blocks, or a prompt it cannot take).
    pub refused_at_p: u64,
    /// Outcome: refused by D on arrival.
    pub refused_at_d: u64,
    /// Outcome: lost with a crashed P (queued or prefilling when it crashed, or arrived
    /// while it was down).
    pub lost_with_p: u64,
    /// Outcome: lost with a crashed D.
    pub lost_with_d: u64,
    /// Outcome: decoded to the end.
    pub done: u64,
    /// Outcome: the load failed (no output).
    pub failed: u64,
    /// Outcome: aborted by the client.
    pub aborted: u64,
    /// Leases granted.
    pub granted: u64,
    /// Leases released because every consumer reported.
    pub released_completed: u64,
    /// Leases released by the reaper.
    pub released_expired: u64,
    /// Leases released by an abort.
    pub released_aborted: u64,
    /// Requests D read and verified.
    pub reads_ok: u64,
    /// Read batches that found a changed fence word.
    pub stale_reads: u64,
    /// Read batches that failed because P was gone, restarted or unreachable.
    pub failed_reads: u64,
    /// Requests D failed without reading, after an expiry notice.
    pub recomputed_after_notice: u64,
    /// Requests the client aborted on D.
    pub client_aborts: u64,
    /// Heartbeat messages sent (one per P worker).
    pub heartbeat_messages: u64,
    /// Bytes of those messages.
    pub heartbeat_bytes: u64,
    /// Heartbeat ids routed on P that named no live lease (late or unknown).
    pub heartbeat_ids_unknown_or_late: u64,
    /// Heartbeat ids that arrived after their lease was released.
    pub heartbeats_after_release: u64,
    /// Expiry notices (messages) sent by P.
    pub expiry_notices: u64,
    /// Messages lost by the network.
    pub messages_lost: u64,
    /// Messages duplicated by the network.
    pub messages_duplicated: u64,
    /// Of the lost messages, those dropped by a partition.
    pub messages_partitioned: u64,
    /// Partitions that began.
    pub partitions: u64,
    /// P engines restarted (under the same engine id).
    pub p_restarts: u64,
    /// D engines restarted (under the same engine id).
    pub d_restarts: u64,
    /// Stalls (P or D) that began.
    pub stalls: u64,
    /// Forged notifications sent by the rogue.
    pub forged: u64,
    /// Forged notifications a core ignored as another engine's.
    pub forged_ignored: u64,
    /// Leases the rogue claimed first (released without the early-release checks).
    pub rogue_owned: u64,
    /// `forget_engine` calls (a connection to P was lost).
    pub forgotten_engines: u64,
    /// Requests checked by the restart oracle (the first one to a restarted P past the bound).
    pub restart_checks: u64,
    /// Leases reclaimed after their D crashed.
    pub crash_reclaims: u64,
    /// Smallest and largest time from the last delivered heartbeat to the reclaim of a
    /// lease whose D crashed (P's clock).
    pub crash_reclaim_after_heartbeat: Option<(Duration, Duration)>,
    /// Longest time from a D crash to the reclaim of one of its leases (true time).
    pub crash_reclaim_since_crash_max: Duration,
    /// Longest time a request stayed admitted on D before its load began.
    pub max_queue_wait: Duration,
    /// Read completions P accepted.
    pub read_completions: u64,
    /// Handshakes D started.
    pub handshakes: u64,
    /// Heartbeat batches deferred while their engine handshaked.
    pub deferred_batches: u64,
    /// Integral of the requests D tracks over true time (request·ns), for the mean.
    pub tracked_request_ns: u128,
    /// Virtual time at the end.
    pub end: Duration,
}

/// The outcome of one run.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// A hash of every event in order; the same config gives the same hash.
    pub trace_hash: u64,
    /// The counters.
    pub stats: SimStats,
    /// Every broken rule (at most 20), with the virtual time; empty for a good run.
    pub failures: Vec<String>,
}

/// A clock: local = offset + true × (1 + drift).
#[derive(Debug, Clone, Copy)]
struct Clock {
    offset_ns: u64,
    drift_ppm: i64,
}

impl Clock {
    fn local(&self, true_ns: u64) -> Timestamp {
        let drift = i128::from(true_ns) * i128::from(self.drift_ppm) / 1_000_000;
        let ns = i128::from(self.offset_ns) + i128::from(true_ns) + drift;
        Timestamp::from_nanos(u64::try_from(ns.max(0)).unwrap_or(u64::MAX))
    }
}

/// A shell's error, as the typed cause the cores keep.
#[derive(Debug)]
struct SimError(&'static str);

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for SimError {}

fn cause(what: &'static str) -> Cause {
    Arc::new(SimError(what))
}

/// How a request ended, as the world saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    RefusedAtP,
    RefusedAtD,
    LostWithP,
    LostWithD,
    Done,
    Failed,
    Aborted,
}

/// Everything the world knows of one request (the oracle's record).
#[derive(Debug)]
struct Req {
    p: usize,
    tokens: usize,
    arrived: u64,
    content_seed: u64,
    generation: u64,
    end: Option<(End, u64)>,
    /// Ends recorded (more than one fails the run).
    ends: u32,
    /// The restart oracle checks this request.
    watched: bool,
    /// The rogue claimed, completed or aborted its lease (a fault on its way).
    rogue_hit: bool,
}

/// What the oracle expects P's core to answer to one message.
#[derive(Debug, Clone, Copy, Default)]
struct Expect {
    /// A heartbeat's held, late, unknown and foreign ids.
    heartbeat: (u32, u32, u32, u32),
    /// A completion or abort that is another engine's.
    foreign: bool,
    /// A completion or abort for a lease P does not hold.
    unknown: bool,
}

/// What the oracle knows of one lease, on P's clock.
#[derive(Debug, Clone)]
struct OracleLease {
    /// The engine that claimed it first (the oracle's own model of ownership).
    owner: Option<EngineId>,
    generation: Generation,
    expiry_ns: u64,
    last_heartbeat_ns: Option<u64>,
    consumers: HashSet<ConsumerId>,
    aborted: bool,
    d_engine: usize,
    granted_true_ns: u64,
}

/// One P worker's memory: the fence word and the content of every block.
#[derive(Debug)]
struct Pool {
    words: Vec<u64>,
    content: Vec<u64>,
}

impl Pool {
    fn new(blocks: u32) -> Self {
        Self {
            words: vec![Generation::FREE_WORD; blocks as usize],
            content: vec![POISON; blocks as usize],
        }
    }
}

#[derive(Debug)]
struct PEngine {
    id: EngineId,
    alive: bool,
    incarnation: u32,
    clock: Clock,
    core: PrefillCore<Addr>,
    pools: Vec<Pool>,
    /// Arrivals not yet handed to the core (the core sees them at its next step).
    jobs: VecDeque<RequestId>,
    /// Requests between arrival and their grant or refusal.
    pending: BTreeSet<RequestId>,
    /// Prefills being computed: when each is done.
    prefilling: VecDeque<(u64, RequestId)>,
    inbox: VecDeque<(Addr, Vec<u8>)>,
    /// Oracle: every lease the core should hold.
    oracle: HashMap<RequestId, OracleLease>,
    /// Oracle: (expiry, request) of the same leases, to find overdue ones.
    deadlines: BTreeSet<(u64, RequestId)>,
    /// Grant order (the planted grant-order reaper, the rogue's choice of victims).
    grant_order: VecDeque<RequestId>,
    stalled_until: u64,
    /// True time the latest stall ended (0: none).
    stall_end: u64,
    /// The restart oracle watches the first arrival at or after this true time.
    watch_from: Option<u64>,
}

/// A request's reads in flight.
#[derive(Debug)]
struct Load {
    p: usize,
    /// The P incarnation of the connection the reads go over.
    conn: Option<u32>,
    plan: LoadPlan,
    /// What each batch copied out of P's memory (at the start of the read).
    copied: Vec<Vec<u64>>,
    /// Whether each batch's fence word matched at its end (the truth, whatever the shell
    /// reports).
    fence_matched: Vec<bool>,
    results: Vec<Option<BatchResult>>,
    admitted_at: u64,
}

#[derive(Debug)]
struct DEngine {
    id: EngineId,
    alive: bool,
    incarnation: u32,
    clock: Clock,
    core: DecodeCore,
    arrivals: VecDeque<(RequestId, usize, RemoteKv)>,
    handshakes: VecDeque<(usize, Option<u32>)>,
    lost_conns: VecDeque<(usize, u32)>,
    inbox: VecDeque<(Addr, Vec<u8>)>,
    loads: BTreeMap<RequestId, Load>,
    decoding: Vec<(u64, RequestId)>,
    /// Admitted and not finished, with the admission time.
    admitted: BTreeMap<RequestId, u64>,
    /// Admitted and not yet loaded (tracked for heartbeats).
    tracked: HashSet<RequestId>,
    /// P engine → the incarnation this D's connection reaches.
    conns: HashMap<usize, u32>,
    stalled_until: u64,
    last_step: u64,
}

#[derive(Debug)]
enum Ev {
    Arrival,
    PStep {
        p: usize,
        incarnation: u32,
    },
    DStep {
        d: usize,
        incarnation: u32,
    },
    Deliver {
        from: Addr,
        to: Addr,
        bytes: Vec<u8>,
    },
    Transfer {
        d: usize,
        request: RequestId,
        tokens: usize,
        remote: RemoteKv,
    },
    HandshakeDone {
        d: usize,
        incarnation: u32,
        p: usize,
    },
    ConnLost {
        d: usize,
        incarnation: u32,
        p: usize,
        p_incarnation: u32,
    },
    ReadDone {
        d: usize,
        incarnation: u32,
        request: RequestId,
    },
    CrashD {
        d: usize,
        restart_after: Option<Duration>,
    },
    RestartD {
        d: usize,
    },
    CrashP {
        p: usize,
        restart_after: Option<Duration>,
    },
    RestartP {
        p: usize,
    },
    Stall {
        on_p: bool,
        engine: usize,
        duration: Duration,
    },
    Partition {
        duration: Duration,
    },
    Forge,
}

#[derive(Debug)]
struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The simulated world. Build it with [`World::new`] and run it with [`World::run`].
#[derive(Debug)]
pub struct World {
    config: WorldConfig,
    lease: LeaseConfig,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    p: Vec<PEngine>,
    d: Vec<DEngine>,
    p_by_id: HashMap<EngineId, usize>,
    rogue: EngineId,
    requests: BTreeMap<RequestId, Req>,
    /// Local time of the last heartbeat transmit per (D engine, incarnation, P engine).
    last_batch: HashMap<(usize, u32, usize), u64>,
    /// Consecutive losses per link and stream (heartbeat or not).
    losses_in_a_row: HashMap<(Addr, Addr, bool), u32>,
    /// True time each D engine crashed (latest crash).
    d_crashed_at: Vec<Option<u64>>,
    /// Requests a D engine tracked when it crashed.
    crash_victims: HashMap<RequestId, usize>,
    /// Windows of true time in which a fault (crash, restart, stall, partition) was on.
    faults: Vec<(u64, u64)>,
    arrivals_left: usize,
    next_request: u64,
    in_flight_transfers: usize,
    trace: u64,
    stats: SimStats,
    failures: Vec<String>,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn fmt_ns(ns: u64) -> String {
    format!("{:.3}s", ns as f64 / 1e9)
}

/// Content of block `i` of a request on P worker `worker`: derived from the request, so
/// that D can check every block it read.
fn block_content(seed: u64, worker: u32, i: usize) -> u64 {
    let mut z = seed ^ (u64::from(worker) << 48) ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (z ^ (z >> 29)) | 1
}

fn p_core(
    config: &WorldConfig,
    lease: LeaseConfig,
    id: EngineId,
    incarnation: u32,
) -> PrefillCore<Addr> {
    // A restarted P starts its generations above every earlier one (the agent uses the
    // wall clock in microseconds).
    let first = NonZeroU64::new((u64::from(incarnation) << 40) | 1)
        .map_or(Generation(NonZeroU64::MIN), Generation);
    PrefillCore::new(
        PrefillConfig::new(id, config.p_tp, config.blocks_per_worker, BLOCK_SIZE, lease)
            .with_first_generation(first),
    )
}

fn d_core(config: &WorldConfig, lease: LeaseConfig, id: EngineId) -> DecodeCore {
    DecodeCore::new(
        DecodeConfig::new(
            id,
            config.d_tp,
            NUM_KV_HEADS,
            BLOCK_SIZE,
            config.blocks_per_worker,
            lease,
        )
        .with_limits(u32::try_from(config.d_slots).unwrap_or(u32::MAX), 1 << 20)
        .with_retry(config.d_step),
    )
}

impl World {
    /// A world for `config`.
    ///
    /// # Panics
    /// When the config is unusable (a lease duration the lease crate rejects, or TP sizes
    /// that do not divide the model's heads); a test bug, not a simulation outcome.
    pub fn new(config: WorldConfig) -> Self {
        // Invariant: the named configs use leases of 1.2 to 30 s, which the lease crate
        // accepts; a custom config with a rejected duration is a bug of the test.
        let lease = LeaseConfig::from_duration(config.lease)
            .expect("config: valid lease duration")
            .with_mode(config.mode);
        assert!(
            config.p_tp > 0
                && config.d_tp > 0
                && NUM_KV_HEADS.is_multiple_of(config.p_tp)
                && NUM_KV_HEADS.is_multiple_of(config.d_tp),
            "config: TP sizes must divide {NUM_KV_HEADS} heads"
        );
        let mut rng = Rng::new(config.seed);
        let clock = |rng: &mut Rng| Clock {
            offset_ns: rng.range(0, nanos(config.clock_offset_max)),
            drift_ppm: rng.range(0, 2 * u64::from(config.drift_ppm_max)) as i64
                - i64::from(config.drift_ppm_max),
        };
        let p: Vec<PEngine> = (0..config.p_engines)
            .map(|i| {
                let id = engine_id(&format!("p{i}"));
                PEngine {
                    core: p_core(&config, lease, id.clone(), 0),
                    id,
                    alive: true,
                    incarnation: 0,
                    clock: clock(&mut rng),
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
                }
            })
            .collect();
        let d = (0..config.d_engines)
            .map(|i| {
                let id = engine_id(&format!("d{i}"));
                DEngine {
                    core: d_core(&config, lease, id.clone()),
                    id,
                    alive: true,
                    incarnation: 0,
                    clock: clock(&mut rng),
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
                    last_step: 0,
                }
            })
            .collect();
        let p_by_id = p
            .iter()
            .enumerate()
            .map(|(i, e)| (e.id.clone(), i))
            .collect();
        let mut world = Self {
            d_crashed_at: vec![None; config.d_engines],
            arrivals_left: config.requests,
            lease,
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            p,
            d,
            p_by_id,
            rogue: engine_id("rogue"),
            requests: BTreeMap::new(),
            losses_in_a_row: HashMap::new(),
            last_batch: HashMap::new(),
            crash_victims: HashMap::new(),
            faults: Vec::new(),
            next_request: 0,
            in_flight_transfers: 0,
            trace: 0xcbf2_9ce4_8422_2325,
            stats: SimStats::default(),
            failures: Vec::new(),
            config,
        };
        for p in 0..world.p.len() {
            let at = world.rng.range(0, nanos(world.config.p_step));
            world.schedule(at, Ev::PStep { p, incarnation: 0 });
        }
        for d in 0..world.d.len() {
            let at = world.rng.range(0, nanos(world.config.d_step));
            world.schedule(at, Ev::DStep { d, incarnation: 0 });
        }
        world.schedule(0, Ev::Arrival);
        for crash in world.config.d_crashes.clone() {
            let ev = Ev::CrashD {
                d: crash.engine,
                restart_after: crash.restart_after,
            };
            world.schedule(nanos(crash.at), ev);
        }
        for crash in world.config.p_crashes.clone() {
            let ev = Ev::CrashP {
                p: crash.engine,
                restart_after: crash.restart_after,
            };
            world.schedule(nanos(crash.at), ev);
        }
        for (on_p, stalls) in [
            (true, world.config.p_stalls.clone()),
            (false, world.config.d_stalls.clone()),
        ] {
            for s in stalls {
                let ev = Ev::Stall {
                    on_p,
                    engine: s.engine,
                    duration: s.duration,
                };
                world.schedule(nanos(s.at), ev);
            }
        }
        for cut in world.config.partitions.clone() {
            let ev = Ev::Partition {
                duration: cut.duration,
            };
            world.schedule(nanos(cut.at), ev);
        }
        if let Some(gap) = world.config.forged_gap {
            let at = world.rng.range(0, 2 * nanos(gap));
            world.schedule(at, Ev::Forge);
        }
        world
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled {
            at,
            seq: self.seq,
            ev,
        }));
    }

    fn trace(&mut self, words: &[u64]) {
        for &w in words {
            for b in w.to_le_bytes() {
                self.trace ^= u64::from(b);
                self.trace = self.trace.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }

    fn trace_str(&mut self, s: &str) {
        for b in s.bytes() {
            self.trace ^= u64::from(b);
            self.trace = self.trace.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn fail(&mut self, what: String) {
        if self.failures.len() < MAX_FAILURES {
            self.failures.push(format!("t={} {what}", fmt_ns(self.now)));
        }
    }

    fn step_len(&mut self, step: Duration) -> u64 {
        nanos(step) + self.rng.range(0, nanos(self.config.step_jitter))
    }

    fn p_step_max_ns(&self) -> u64 {
        // Local time can run up to drift faster than true time; 1 ms covers it.
        nanos(self.config.p_step) + nanos(self.config.step_jitter) + 1_000_000
    }

    /// Consumers of one lease: every (D worker, P worker) pair whose heads overlap. With
    /// TP sizes that divide the heads, that is the larger TP size.
    fn consumers(&self) -> u32 {
        self.config.p_tp.max(self.config.d_tp)
    }

    /// Runs the world until every request ended and every lease is released (or the
    /// drain limit passes), then checks that nothing leaked.
    pub fn run(mut self) -> Report {
        let mut drained_at: Option<u64> = None;
        let linger = nanos(self.config.lease) * 2 + self.p_step_max_ns() * 4;
        while let Some(Reverse(next)) = self.queue.pop() {
            self.now = next.at;
            self.handle(next.ev);
            if self.failures.len() >= MAX_FAILURES {
                break;
            }
            if self.arrivals_left == 0 && drained_at.is_none() && self.quiet() {
                drained_at = Some(self.now);
            }
            if let Some(at) = drained_at {
                if !self.quiet() {
                    drained_at = None;
                } else if self.now >= at + linger && self.stalls_over() && self.tables_empty() {
                    break;
                }
            }
            if self.arrivals_left == 0 && self.now > self.last_arrival_cap() {
                self.fail("the world did not drain within the limit".into());
                break;
            }
        }
        self.check_end();
        self.stats.end = Duration::from_nanos(self.now);
        Report {
            seed: self.config.seed,
            trace_hash: self.trace,
            stats: self.stats,
            failures: self.failures,
        }
    }

    /// Runs the world up to `limit` of virtual time and stops there, drained or not (call
    /// it again with a later limit to go on): the checks made while it runs hold, the end
    /// checks (outcomes, leaks) are not made. For measurements (`examples/scale.rs`).
    pub fn run_until(&mut self, limit: Duration) -> Report {
        let limit = nanos(limit);
        while self.failures.len() < MAX_FAILURES {
            let Some(Reverse(next)) = self.queue.peek() else {
                break;
            };
            if next.at > limit {
                break;
            }
            let Some(Reverse(next)) = self.queue.pop() else {
                break;
            };
            self.now = next.at;
            self.handle(next.ev);
        }
        self.now = self.now.max(limit);
        // Close the integral of tracked requests at the limit.
        for d in 0..self.d.len() {
            let since = self.now.saturating_sub(self.d[d].last_step);
            self.stats.tracked_request_ns += self.d[d].tracked.len() as u128 * u128::from(since);
            self.d[d].last_step = self.now;
        }
        self.stats.end = Duration::from_nanos(self.now);
        Report {
            seed: self.config.seed,
            trace_hash: self.trace,
            stats: self.stats.clone(),
            failures: self.failures.clone(),
        }
    }

    fn last_arrival_cap(&self) -> u64 {
        nanos(self.config.arrival_gap) * 2 * self.config.requests as u64 + nanos(MAX_DRAIN)
    }

    /// No request in flight anywhere (queues, prefills, transfers, reads, decodes).
    fn quiet(&self) -> bool {
        self.in_flight_transfers == 0
            && self
                .p
                .iter()
                .filter(|p| p.alive)
                .all(|p| p.pending.is_empty() && p.jobs.is_empty() && p.prefilling.is_empty())
            && self.d.iter().filter(|d| d.alive).all(|d| {
                d.arrivals.is_empty()
                    && d.admitted.is_empty()
                    && d.loads.is_empty()
                    && d.decoding.is_empty()
            })
    }

    fn stalls_over(&self) -> bool {
        self.p.iter().all(|p| p.stalled_until <= self.now)
            && self.d.iter().all(|d| d.stalled_until <= self.now)
    }

    fn tables_empty(&self) -> bool {
        self.p
            .iter()
            .filter(|p| p.alive)
            .all(|p| p.core.leases() == 0)
    }

    /// The end of the run: every request ended exactly once (oracle 1), the first request
    /// after each P restart completed (oracle 3), nothing leaked (oracle 4).
    fn check_end(&mut self) {
        let mut problems = Vec::new();
        let mut ok = 0;
        let mut restart_checks = 0;
        for (id, r) in &self.requests {
            match (r.ends, r.end) {
                (1, Some((end, ended))) => {
                    ok += 1;
                    if r.watched {
                        let hit = r.rogue_hit
                            || self
                                .faults
                                .iter()
                                .any(|&(a, b)| a <= ended && r.arrived <= b);
                        if end == End::Failed && !hit {
                            problems.push(format!(
                                "restart: {id}, the first request to restarted P{} past restart + handshake + lease, ended {end:?} with no fault (nor the rogue) on its way",
                                r.p
                            ));
                        }
                        restart_checks += u64::from(!hit);
                    }
                }
                (0, _) => problems.push(format!("outcome: {id} ended in no outcome")),
                (n, _) => problems.push(format!("outcome: {id} ended in {n} outcomes")),
            }
        }
        self.stats.outcomes_ok = ok;
        self.stats.deferred_batches = self.d.iter().map(|d| d.core.stats().deferred_batches).sum();
        self.stats.restart_checks = restart_checks;
        for p in self.p.iter().filter(|p| p.alive) {
            if !p.core.is_idle() || p.core.blocks_allocated() != 0 || p.core.leases() != 0 {
                problems.push(format!(
                    "leak: {} is not idle at the end: {} leases, {} blocks allocated, {} waiting, {} prefilling",
                    p.id,
                    p.core.leases(),
                    p.core.blocks_allocated(),
                    p.core.waiting(),
                    p.core.prefilling()
                ));
            }
            for (w, pool) in p.pools.iter().enumerate() {
                let fenced = pool
                    .words
                    .iter()
                    .filter(|&&x| x != Generation::FREE_WORD)
                    .count();
                if fenced > 0 {
                    problems.push(format!(
                        "leak: {} worker {w} has {fenced} blocks with a live fence word at the end",
                        p.id
                    ));
                }
            }
            if !p.oracle.is_empty() {
                problems.push(format!(
                    "leak: the oracle of {} still has {} leases",
                    p.id,
                    p.oracle.len()
                ));
            }
        }
        for d in self.d.iter().filter(|d| d.alive) {
            if !d.core.is_idle() || d.core.tracked() != 0 || d.core.blocks_allocated() != 0 {
                problems.push(format!(
                    "leak: {} is not idle at the end: {} tracked, {} blocks allocated, {} running, {} waiting",
                    d.id,
                    d.core.tracked(),
                    d.core.blocks_allocated(),
                    d.core.running(),
                    d.core.waiting()
                ));
            }
            if !d.loads.is_empty() || !d.decoding.is_empty() {
                problems.push(format!(
                    "leak: {} has {} loads and {} decodes at the end",
                    d.id,
                    d.loads.len(),
                    d.decoding.len()
                ));
            }
        }
        for p in problems {
            self.fail(p);
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Arrival => self.arrival(),
            Ev::PStep { p, incarnation } => {
                if self.p[p].alive && self.p[p].incarnation == incarnation {
                    if self.p[p].stalled_until <= self.now {
                        self.trace(&[1, self.now, p as u64]);
                        self.p_step(p);
                    }
                    let next = self.now + self.step_len(self.config.p_step);
                    self.schedule(next, Ev::PStep { p, incarnation });
                }
            }
            Ev::DStep { d, incarnation } => {
                if self.d[d].alive && self.d[d].incarnation == incarnation {
                    if self.d[d].stalled_until <= self.now {
                        self.trace(&[2, self.now, d as u64]);
                        self.d_step(d);
                    }
                    let next = self.now + self.step_len(self.config.d_step);
                    self.schedule(next, Ev::DStep { d, incarnation });
                }
            }
            Ev::Deliver { from, to, bytes } => self.deliver(from, to, bytes),
            Ev::Transfer {
                d,
                request,
                tokens,
                remote,
            } => {
                self.in_flight_transfers -= 1;
                self.arrive_at_d(d, request, tokens, remote);
            }
            Ev::HandshakeDone { d, incarnation, p } => {
                if self.d[d].alive && self.d[d].incarnation == incarnation {
                    let reachable = self.p[p].alive
                        && !self.partitioned(
                            Addr::D { engine: d, rank: 0 },
                            Addr::P {
                                engine: p,
                                worker: 0,
                            },
                        );
                    let result = reachable.then_some(self.p[p].incarnation);
                    self.d[d].handshakes.push_back((p, result));
                }
            }
            Ev::ConnLost {
                d,
                incarnation,
                p,
                p_incarnation,
            } => {
                if self.d[d].alive && self.d[d].incarnation == incarnation {
                    self.d[d].lost_conns.push_back((p, p_incarnation));
                }
            }
            Ev::ReadDone {
                d,
                incarnation,
                request,
            } => self.read_done(d, incarnation, &request),
            Ev::CrashD { d, restart_after } => self.crash_d(d, restart_after),
            Ev::RestartD { d } => self.restart_d(d),
            Ev::CrashP { p, restart_after } => self.crash_p(p, restart_after),
            Ev::RestartP { p } => self.restart_p(p),
            Ev::Stall {
                on_p,
                engine,
                duration,
            } => {
                let until = self.now + nanos(duration);
                if on_p {
                    self.p[engine].stalled_until = until;
                    self.p[engine].stall_end = until;
                } else {
                    self.d[engine].stalled_until = until;
                }
                self.stats.stalls += 1;
                self.faults.push((self.now, until));
                self.trace(&[16, self.now, u64::from(on_p), engine as u64]);
            }
            Ev::Partition { duration } => {
                self.stats.partitions += 1;
                self.faults.push((self.now, self.now + nanos(duration)));
            }
            Ev::Forge => self.forge(),
        }
    }

    // ---- network ------------------------------------------------------------------------

    fn send(&mut self, from: Addr, to: Addr, bytes: Vec<u8>) {
        let net = self.config.net;
        if self.partitioned(from, to) {
            self.stats.messages_lost += 1;
            self.stats.messages_partitioned += 1;
            self.trace(&[15, self.now]);
            return;
        }
        // Consecutive losses count per link and per stream (heartbeats apart from the rest),
        // so that "at most N heartbeats lost in a row" holds whatever else the link carries.
        let link = (from, to, bytes.starts_with(kvlease_notif::HEARTBEAT_PREFIX));
        let in_a_row = self.losses_in_a_row.get(&link).copied().unwrap_or(0);
        let may_lose = net.max_consecutive_losses.is_none_or(|max| in_a_row < max);
        if may_lose && self.rng.chance(net.loss_per_million) {
            self.losses_in_a_row.insert(link, in_a_row + 1);
            self.stats.messages_lost += 1;
            self.trace(&[3, self.now]);
            return;
        }
        if in_a_row > 0 {
            self.losses_in_a_row.insert(link, 0);
        }
        let copies = if self.rng.chance(net.duplicate_per_million) {
            self.stats.messages_duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + nanos(net.delay) + self.rng.range(0, nanos(net.jitter));
            self.schedule(
                at,
                Ev::Deliver {
                    from,
                    to,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    fn partitioned(&self, a: Addr, b: Addr) -> bool {
        let ((Addr::D { engine: d, .. }, Addr::P { engine: p, .. })
        | (Addr::P { engine: p, .. }, Addr::D { engine: d, .. })) = (a, b)
        else {
            return false;
        };
        self.config.partitions.iter().any(|cut| {
            cut.d == d
                && cut.p == p
                && (nanos(cut.at)..nanos(cut.at) + nanos(cut.duration)).contains(&self.now)
        })
    }

    fn deliver(&mut self, from: Addr, to: Addr, bytes: Vec<u8>) {
        match to {
            Addr::P { engine, .. } => {
                let p = &mut self.p[engine];
                if p.alive {
                    p.inbox.push_back((from, bytes));
                }
            }
            Addr::D { engine, .. } => {
                let d = &mut self.d[engine];
                if d.alive {
                    d.inbox.push_back((from, bytes));
                }
            }
            Addr::Rogue => {}
        }
    }

    fn sender_engine(&self, from: Addr) -> EngineId {
        match from {
            Addr::P { engine, .. } => self.p[engine].id.clone(),
            Addr::D { engine, .. } => self.d[engine].id.clone(),
            Addr::Rogue => self.rogue.clone(),
        }
    }

    // ---- outcomes -----------------------------------------------------------------------

    /// Oracle 1: records how `request` ended; a second end fails the run.
    fn end(&mut self, request: &RequestId, end: End) {
        let now = self.now;
        let Some(r) = self.requests.get_mut(request) else {
            self.fail(format!(
                "outcome: {request} ended ({end:?}) but never arrived"
            ));
            return;
        };
        r.ends += 1;
        if let Some((first, _)) = r.end {
            let msg = format!("outcome: {request} ended twice: {first:?}, then {end:?}");
            self.fail(msg);
            return;
        }
        r.end = Some((end, now));
        match end {
            End::RefusedAtP => self.stats.refused_at_p += 1,
            End::RefusedAtD => self.stats.refused_at_d += 1,
            End::LostWithP => self.stats.lost_with_p += 1,
            End::LostWithD => self.stats.lost_with_d += 1,
            End::Done => self.stats.done += 1,
            End::Failed => self.stats.failed += 1,
            End::Aborted => self.stats.aborted += 1,
        }
        self.trace(&[17, now, end as u64]);
        self.trace_str(request.as_str());
    }

    // ---- P ------------------------------------------------------------------------------

    fn arrival(&mut self) {
        if self.arrivals_left == 0 {
            return;
        }
        self.arrivals_left -= 1;
        self.stats.arrived += 1;
        let p = self.rng.index(self.p.len());
        let request = request_id(self.next_request);
        self.next_request += 1;
        let (lo, hi) = self.config.blocks_per_request;
        let n = self.rng.range(u64::from(lo.max(1)), u64::from(hi.max(1)));
        let tokens =
            (n * u64::from(BLOCK_SIZE) - self.rng.range(0, u64::from(BLOCK_SIZE) - 1)) as usize;
        let engine = &mut self.p[p];
        let watched = engine.alive && engine.watch_from.is_some_and(|t| t <= self.now);
        if watched {
            engine.watch_from = None;
        }
        self.requests.insert(
            request.clone(),
            Req {
                p,
                tokens,
                arrived: self.now,
                content_seed: 0,
                generation: 0,
                end: None,
                ends: 0,
                watched,
                rogue_hit: false,
            },
        );
        let alive = engine.alive;
        self.trace(&[4, self.now, p as u64]);
        if alive {
            let engine = &mut self.p[p];
            engine.jobs.push_back(request.clone());
            engine.pending.insert(request);
        } else {
            self.end(&request, End::LostWithP);
        }
        if self.arrivals_left > 0 {
            let gap = self.rng.range(0, 2 * nanos(self.config.arrival_gap));
            self.schedule(self.now + gap, Ev::Arrival);
        }
    }

    fn p_step(&mut self, p: usize) {
        let local = self.p[p].clock.local(self.now);
        let local_ns = local.as_nanos_saturating();
        // 1. New requests.
        while let Some(request) = self.p[p].jobs.pop_front() {
            let tokens = self.requests.get(&request).map_or(0, |r| r.tokens);
            if self.p[p]
                .core
                .handle_job(local, request.clone(), tokens)
                .is_err()
            {
                self.p[p].pending.remove(&request);
                self.end(&request, End::RefusedAtP);
            }
            self.p_drain(p, local_ns);
        }
        // 2. Prefills computed: grant, publish the generation, hand the request to a D.
        while self.p[p]
            .prefilling
            .front()
            .is_some_and(|(done, _)| *done <= self.now)
        {
            let Some((_, request)) = self.p[p].prefilling.pop_front() else {
                break;
            };
            match self.p[p].core.handle_prefill_done(local, &request) {
                Ok(granted) => {
                    self.grant(p, local_ns, &request, granted.generation, &granted.blocks)
                }
                Err(_) => {
                    self.p[p].pending.remove(&request);
                    self.end(&request, End::RefusedAtP);
                }
            }
            self.p_drain(p, local_ns);
        }
        // 3. Prefills to start: the compute writes the blocks from its first layer on.
        while let Some(start) = self.p[p].core.poll_prefill(local) {
            let seed = self.rng.next_u64();
            if let Some(r) = self.requests.get_mut(&start.request) {
                r.content_seed = seed;
            }
            for (w, pool) in self.p[p].pools.iter_mut().enumerate() {
                for (i, b) in start.blocks.iter().enumerate() {
                    if let Some(c) = pool.content.get_mut(b.0 as usize) {
                        // `w` indexes the workers, so it fits u32.
                        *c = block_content(seed, w as u32, i);
                    }
                }
            }
            let done = self.now + nanos(self.config.prefill);
            self.p[p].prefilling.push_back((done, start.request));
            self.p_drain(p, local_ns);
        }
        self.p_drain(p, local_ns);
        // 4. Notifications.
        while let Some((from, bytes)) = self.p[p].inbox.pop_front() {
            self.p_notif(p, local, from, &bytes);
            self.p_drain(p, local_ns);
        }
        // 5. The reaper.
        self.reap(p, local);
        self.p_drain(p, local_ns);
        self.check_overdue(p, local_ns);
    }

    fn grant(
        &mut self,
        p: usize,
        local_ns: u64,
        request: &RequestId,
        generation: Generation,
        blocks: &[kvlease_lease::BlockId],
    ) {
        let d = self.rng.index(self.d.len());
        let duration = nanos(self.lease.duration());
        let engine = &mut self.p[p];
        for pool in &mut engine.pools {
            for b in blocks {
                if let Some(w) = pool.words.get_mut(b.0 as usize) {
                    *w = generation.word();
                }
            }
        }
        let expiry_ns = local_ns + duration;
        engine.oracle.insert(
            request.clone(),
            OracleLease {
                owner: None,
                generation,
                expiry_ns,
                last_heartbeat_ns: None,
                consumers: HashSet::new(),
                aborted: false,
                d_engine: d,
                granted_true_ns: self.now,
            },
        );
        engine.deadlines.insert((expiry_ns, request.clone()));
        engine.grant_order.push_back(request.clone());
        engine.pending.remove(request);
        let p_id = engine.id.clone();
        self.stats.granted += 1;
        let tokens = match self.requests.get_mut(request) {
            Some(r) => {
                r.generation = generation.word();
                r.tokens
            }
            None => 0,
        };
        let remote = RemoteKv::new(
            p_id,
            request.clone(),
            blocks.to_vec(),
            generation.word(),
            self.config.p_tp,
            u32::try_from(tokens).unwrap_or(u32::MAX),
            format!("p{p}"),
            0,
        );
        self.trace(&[5, self.now, p as u64, d as u64]);
        self.trace_str(request.as_str());
        self.in_flight_transfers += 1;
        let at = self.now + nanos(self.config.transfer_delay);
        self.schedule(
            at,
            Ev::Transfer {
                d,
                request: request.clone(),
                tokens,
                remote,
            },
        );
    }

    /// Drains the core's actions and events (after every input).
    fn p_drain(&mut self, p: usize, local_ns: u64) {
        while let Some(action) = self.p[p].core.poll_action() {
            match action {
                PrefillAction::ClearFences { released } => {
                    if self.config.bug != Some(Bug::SkipFenceClear) {
                        // Before anything else: the free word, then poison.
                        for pool in &mut self.p[p].pools {
                            for b in &released.blocks {
                                if let Some(w) = pool.words.get_mut(b.0 as usize) {
                                    *w = Generation::FREE_WORD;
                                }
                                if let Some(c) = pool.content.get_mut(b.0 as usize) {
                                    *c = POISON;
                                }
                            }
                        }
                    }
                    self.check_release(p, local_ns, &released);
                    let reason = match released.reason {
                        ReleaseReason::Completed => 1,
                        ReleaseReason::Expired => 2,
                        _ => 3,
                    };
                    self.trace(&[9, self.now, p as u64, reason]);
                    self.trace_str(released.request.as_str());
                }
                PrefillAction::Transmit { to, bytes } => {
                    self.stats.expiry_notices += 1;
                    self.send(
                        Addr::P {
                            engine: p,
                            worker: 0,
                        },
                        to,
                        bytes,
                    );
                }
                _ => {}
            }
        }
        while let Some(event) = self.p[p].core.poll_event() {
            if let PrefillEvent::Refused { request, .. } = event {
                self.p[p].pending.remove(&request);
                if self.config.bug != Some(Bug::DropRefusals) {
                    self.end(&request, End::RefusedAtP);
                }
            }
        }
    }

    /// The oracle's own reading of a message to P, with its own model of ownership (the
    /// first engine that heartbeats or reads a lease owns it; messages about it from any
    /// other engine, and completions or aborts that name another engine's consumer, are
    /// foreign): what P must answer, and the consumers, aborts and renewals it learns.
    fn p_observe(&mut self, p: usize, local_ns: u64, sender: &EngineId, bytes: &[u8]) -> Expect {
        // The baseline (one fixed timeout) never extends.
        let extension = match self.config.mode {
            LeaseMode::Lease => nanos(self.lease.extension()),
            _ => 0,
        };
        let rogue = *sender == self.rogue;
        let engine = &mut self.p[p];
        let mut expect = Expect::default();
        match decode(bytes) {
            Ok(Notif::Heartbeat(ids)) => {
                let mut mine = Vec::new();
                for id in ids.iter() {
                    match engine.oracle.get_mut(id) {
                        Some(lease) if lease.owner.as_ref().is_some_and(|o| o != sender) => {
                            expect.heartbeat.3 += 1;
                        }
                        Some(lease) if lease.expiry_ns > local_ns => {
                            expect.heartbeat.0 += 1;
                            mine.push(id);
                            lease.last_heartbeat_ns = Some(local_ns);
                            let renewed = local_ns + extension;
                            if renewed > lease.expiry_ns {
                                let key = (
                                    lease.expiry_ns,
                                    RequestId::new(id).unwrap_or_else(|_| unreachable_id()),
                                );
                                engine.deadlines.remove(&key);
                                lease.expiry_ns = renewed;
                                engine.deadlines.insert((renewed, key.1));
                            }
                        }
                        Some(_) => {
                            expect.heartbeat.1 += 1;
                            mine.push(id);
                        }
                        None => {
                            expect.heartbeat.2 += 1;
                            if !rogue {
                                self.stats.heartbeats_after_release += 1;
                            }
                        }
                    }
                }
                // A heartbeat that renewed anything claims every lease it named and held.
                if expect.heartbeat.0 > 0 {
                    for id in mine {
                        if let Some(lease) = engine.oracle.get_mut(id) {
                            lease.owner.get_or_insert_with(|| sender.clone());
                        }
                        if rogue && let Some(r) = self.requests.get_mut(id) {
                            r.rogue_hit = true;
                        }
                    }
                }
            }
            Ok(Notif::ReadComplete(rc)) => {
                let lease = engine.oracle.get_mut(&rc.request);
                if rc.consumer.engine != *sender
                    || rc.consumers_total > self.config.p_tp.max(64)
                    || lease
                        .as_ref()
                        .is_some_and(|l| l.owner.as_ref().is_some_and(|o| o != sender))
                {
                    expect.foreign = true;
                } else if let Some(lease) = lease {
                    lease.owner.get_or_insert_with(|| sender.clone());
                    lease.consumers.insert(rc.consumer);
                    if rogue && let Some(r) = self.requests.get_mut(&rc.request) {
                        r.rogue_hit = true;
                    }
                } else {
                    expect.unknown = true;
                }
            }
            Ok(Notif::Abort(a)) => {
                let lease = engine.oracle.get_mut(&a.request);
                if a.consumer.engine != *sender
                    || lease
                        .as_ref()
                        .is_some_and(|l| l.owner.as_ref().is_some_and(|o| o != sender))
                {
                    expect.foreign = true;
                } else if let Some(lease) = lease {
                    lease.aborted = true;
                    if rogue && let Some(r) = self.requests.get_mut(&a.request) {
                        r.rogue_hit = true;
                    }
                } else {
                    expect.unknown = true;
                }
            }
            _ => {}
        }
        expect
    }

    fn p_notif(&mut self, p: usize, local: Timestamp, from: Addr, bytes: &[u8]) {
        let local_ns = local.as_nanos_saturating();
        let sender = self.sender_engine(from);
        let rogue = from == Addr::Rogue;
        let expect = self.p_observe(p, local_ns, &sender, bytes);
        if self.config.bug == Some(Bug::IgnoreHeartbeats)
            && bytes.starts_with(kvlease_notif::HEARTBEAT_PREFIX)
        {
            return;
        }
        let peer = Peer {
            engine: sender,
            addr: from,
        };
        let handled = self.p[p].core.handle_notif(local, &peer, bytes);
        let who = if rogue { "forged" } else { "D" };
        let problem = match handled {
            PrefillNotif::Heartbeat {
                outcome, foreign, ..
            } => {
                self.stats.heartbeat_ids_unknown_or_late +=
                    u64::from(outcome.unknown + outcome.late);
                if rogue && foreign > 0 {
                    self.stats.forged_ignored += 1;
                }
                let got = (outcome.held, outcome.late, outcome.unknown, foreign);
                (got != expect.heartbeat).then(|| {
                    let e = expect.heartbeat;
                    format!(
                        "{who} heartbeat outcome held/late/unknown/foreign = {}/{}/{}/{}, oracle says {}/{}/{}/{}",
                        got.0, got.1, got.2, got.3, e.0, e.1, e.2, e.3
                    )
                })
            }
            PrefillNotif::ReadComplete { request, outcome } => {
                if !rogue {
                    self.stats.read_completions += 1;
                }
                if expect.foreign {
                    Some(format!(
                        "{who} read completion of {request} counted ({outcome:?}); the oracle says it is another engine's"
                    ))
                } else if expect.unknown != (outcome == ReadCompleteOutcome::Unknown) {
                    Some(format!(
                        "{who} read completion of {request}: {outcome:?}, the oracle does not agree"
                    ))
                } else {
                    None
                }
            }
            PrefillNotif::Abort { request, held } => {
                if expect.foreign {
                    Some(format!(
                        "{who} abort of {request} accepted; the oracle says it is another engine's"
                    ))
                } else if held == expect.unknown {
                    Some(format!(
                        "{who} abort of {request}: held={held}, the oracle does not agree"
                    ))
                } else {
                    None
                }
            }
            PrefillNotif::Foreign { request } => {
                if rogue {
                    self.stats.forged_ignored += 1;
                }
                (!expect.foreign).then(|| format!("{who} message about {request} ignored as foreign; the oracle says it may act"))
            }
            PrefillNotif::Malformed(e) => Some(format!("{who} message rejected: {e}")),
            _ => Some(format!("{who} message ignored")),
        };
        if let Some(problem) = problem {
            self.fail(format!("P{p}: {problem}"));
        }
    }

    fn reap(&mut self, p: usize, local: Timestamp) {
        let local_ns = local.as_nanos_saturating();
        if self.config.bug == Some(Bug::GrantOrderReaper) {
            // The planted bug: oldest grant first, stop at the first live lease.
            while let Some(front) = self.p[p].grant_order.front().cloned() {
                match self.p[p].core.table().get(&front) {
                    None => {
                        self.p[p].grant_order.pop_front();
                    }
                    Some(info) if info.expiry <= local => {
                        let _ = self.p[p].core.abort(local, &front);
                        self.p[p].grant_order.pop_front();
                        self.p_drain(p, local_ns);
                    }
                    Some(_) => break,
                }
            }
            return;
        }
        self.p[p].core.handle_timeout(local);
        // Forget grant-order entries of released leases (bounded memory).
        let engine = &mut self.p[p];
        while engine
            .grant_order
            .front()
            .is_some_and(|r| !engine.oracle.contains_key(r))
        {
            engine.grant_order.pop_front();
        }
    }

    /// The latest local time at which P may release a lease that expired at `expiry_ns`:
    /// one step past the expiry, or past the end of a stall that covered it.
    fn reclaim_limit(&self, p: usize, expiry_ns: u64) -> u64 {
        let engine = &self.p[p];
        let resumed = if engine.stall_end > 0 {
            engine.clock.local(engine.stall_end).as_nanos_saturating()
        } else {
            0
        };
        expiry_ns.max(resumed) + self.p_step_max_ns()
    }

    /// The checker's view of a release: was it allowed, and was it on time?
    fn check_release(&mut self, p: usize, local_ns: u64, released: &Released) {
        let Some(lease) = self.p[p].oracle.remove(&released.request) else {
            let msg = format!(
                "P{p}: released {} which the oracle does not hold",
                released.request
            );
            self.fail(msg);
            return;
        };
        self.p[p]
            .deadlines
            .remove(&(lease.expiry_ns, released.request.clone()));
        if lease.generation != released.generation {
            let msg = format!(
                "P{p}: {} released with a wrong generation",
                released.request
            );
            self.fail(msg);
        }
        if lease.owner.as_ref() == Some(&self.rogue) {
            // The rogue claimed it first: it owns the lease like any reader, and may end
            // it early. Only the fence (no wrong output) protects the honest reader then.
            self.stats.rogue_owned += 1;
            return;
        }
        let expected = self.consumers();
        let completed = lease.consumers.len() as u64 >= u64::from(expected);
        let what = match released.reason {
            ReleaseReason::Completed => {
                self.stats.released_completed += 1;
                "completed"
            }
            ReleaseReason::Expired => {
                self.stats.released_expired += 1;
                "expired"
            }
            _ => {
                self.stats.released_aborted += 1;
                "aborted"
            }
        };
        let legit_early = match released.reason {
            ReleaseReason::Completed => completed,
            ReleaseReason::Expired => false,
            _ => lease.aborted,
        };
        if released.reason == ReleaseReason::Completed && !completed {
            let msg = format!(
                "P{p}: {} freed as completed after {} of {expected} consumers reported",
                released.request,
                lease.consumers.len(),
            );
            self.fail(msg);
        }
        if !legit_early {
            //= docs/spec.md#expiry
            //# P reclaims the blocks of every lease past its expiry.
            let limit = self.reclaim_limit(p, lease.expiry_ns);
            if local_ns < lease.expiry_ns {
                let msg = format!(
                    "P{p}: {} freed ({what}) {} before its expiry, neither completed nor aborted",
                    released.request,
                    fmt_ns(lease.expiry_ns - local_ns)
                );
                self.fail(msg);
            } else if local_ns > limit {
                let msg = format!(
                    "P{p}: {} reclaimed late ({what}): {} after its expiry (limit one step, {})",
                    released.request,
                    fmt_ns(local_ns - lease.expiry_ns),
                    fmt_ns(self.p_step_max_ns())
                );
                self.fail(msg);
            }
        }
        if released.reason == ReleaseReason::Expired || !legit_early {
            self.check_expiry_rules(p, local_ns, &lease, released);
        }
    }

    fn check_expiry_rules(
        &mut self,
        p: usize,
        local_ns: u64,
        lease: &OracleLease,
        released: &Released,
    ) {
        let d = lease.d_engine;
        if self.config.expect_no_expiry_while_tracked
            && self.d[d].alive
            && self.d[d].tracked.contains(&released.request)
        {
            let msg = format!(
                "P{p}: {} expired while D{d} is alive and tracks it (last heartbeat {})",
                released.request,
                lease
                    .last_heartbeat_ns
                    .map_or_else(|| "never".into(), fmt_ns)
            );
            self.fail(msg);
        }
        let Some(crashed_at) = self.d_crashed_at[d] else {
            return;
        };
        if self.crash_victims.get(&released.request) != Some(&d) || self.d[d].alive {
            return;
        }
        // D crashed while tracking this request: the crash bound.
        self.stats.crash_reclaims += 1;
        let since_crash = Duration::from_nanos(self.now.saturating_sub(crashed_at));
        self.stats.crash_reclaim_since_crash_max =
            self.stats.crash_reclaim_since_crash_max.max(since_crash);
        if self.config.mode != LeaseMode::Lease {
            // The baseline holds blocks for its whole timeout; the bound is the lease's.
            return;
        }
        let extension = nanos(self.lease.extension());
        let interval = nanos(self.lease.interval());
        if let Some(hb) = lease.last_heartbeat_ns {
            let after = local_ns.saturating_sub(hb);
            if after < extension {
                let msg = format!(
                    "P{p}: {} reclaimed {} after its last heartbeat, before the extension {}",
                    released.request,
                    fmt_ns(after),
                    fmt_ns(extension)
                );
                self.fail(msg);
            }
        }
        // The last delivered heartbeat set the expiry: the reclaim must come between the
        // extension and the extension + one P step after it.
        if let Some(hb) = lease
            .last_heartbeat_ns
            .filter(|&hb| hb + extension == lease.expiry_ns)
        {
            let after = local_ns.saturating_sub(hb);
            let seen = self
                .stats
                .crash_reclaim_after_heartbeat
                .get_or_insert_with(|| (Duration::from_nanos(after), Duration::from_nanos(after)));
            seen.0 = seen.0.min(Duration::from_nanos(after));
            seen.1 = seen.1.max(Duration::from_nanos(after));
        }
        // True time, from the crash: extension + interval + one D step + the network + one P step.
        let bound = extension
            + interval
            + nanos(self.config.d_step)
            + nanos(self.config.step_jitter)
            + nanos(self.config.net.delay)
            + nanos(self.config.net.jitter)
            + self.p_step_max_ns()
            + (extension + interval) / 1000;
        // A lease younger than the crash bound runs at least its initial duration; a P
        // stall delays every reclaim to its end.
        let duration = nanos(self.config.lease);
        let initial_end = lease.granted_true_ns + duration + duration / 1000 + self.p_step_max_ns();
        let stall_end = self.p[p].stall_end + self.p_step_max_ns();
        let limit = (crashed_at + bound).max(initial_end).max(stall_end);
        if self.now > limit {
            let msg = format!(
                "P{p}: {} reclaimed {} after D{d} crashed; bound: extension + interval + steps + network = {}",
                released.request,
                fmt_ns(self.now - crashed_at),
                fmt_ns(bound)
            );
            self.fail(msg);
        }
    }

    /// Every lease past its expiry by more than one step (or a stall) must be gone.
    fn check_overdue(&mut self, p: usize, local_ns: u64) {
        let Some((expiry, request)) = self.p[p].deadlines.first().cloned() else {
            return;
        };
        let exempt = self.p[p]
            .oracle
            .get(&request)
            .is_some_and(|l| l.aborted || l.consumers.len() as u64 >= u64::from(self.consumers()));
        if !exempt && local_ns > self.reclaim_limit(p, expiry) {
            let msg = format!(
                "P{p}: {request} not reclaimed {} after its expiry",
                fmt_ns(local_ns - expiry)
            );
            self.fail(msg);
            // Report it once.
            self.p[p].deadlines.remove(&(expiry, request));
        }
    }

    fn crash_p(&mut self, p: usize, restart_after: Option<Duration>) {
        if !self.p[p].alive {
            return;
        }
        let engine = &mut self.p[p];
        engine.alive = false;
        // Its core, memory, queue and prefills vanish with it.
        let lost: Vec<RequestId> = std::mem::take(&mut engine.pending).into_iter().collect();
        engine.jobs.clear();
        engine.prefilling.clear();
        engine.inbox.clear();
        engine.oracle.clear();
        engine.deadlines.clear();
        engine.grant_order.clear();
        engine.watch_from = None;
        let incarnation = engine.incarnation;
        for request in lost {
            self.end(&request, End::LostWithP);
        }
        // Every D connected to it sees its connection break, a handshake time later.
        let detect = nanos(self.config.handshake);
        for d in 0..self.d.len() {
            if self.d[d].alive && self.d[d].conns.get(&p) == Some(&incarnation) {
                let ev = Ev::ConnLost {
                    d,
                    incarnation: self.d[d].incarnation,
                    p,
                    p_incarnation: incarnation,
                };
                self.schedule(self.now + detect, ev);
            }
        }
        let back = restart_after.map_or(u64::MAX, |a| self.now + nanos(a));
        self.faults.push((self.now, back));
        self.trace(&[7, self.now, p as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartP { p });
        }
    }

    fn restart_p(&mut self, p: usize) {
        let config = &self.config;
        let engine = &mut self.p[p];
        engine.alive = true;
        engine.incarnation += 1;
        engine.core = p_core(config, self.lease, engine.id.clone(), engine.incarnation);
        engine.pools = (0..config.p_tp)
            .map(|_| Pool::new(config.blocks_per_worker))
            .collect();
        engine.stalled_until = 0;
        // The restart bound: D noticed the lost connection (a handshake time after the
        // crash), handshakes again (a handshake time), and every lease of the old
        // incarnation an old reader could hold has ended (a lease duration).
        engine.watch_from = Some(self.now + nanos(config.handshake) + nanos(config.lease));
        let incarnation = engine.incarnation;
        self.stats.p_restarts += 1;
        self.trace(&[8, self.now, p as u64]);
        self.schedule(self.now, Ev::PStep { p, incarnation });
    }

    // ---- D ------------------------------------------------------------------------------

    fn arrive_at_d(&mut self, d: usize, request: RequestId, tokens: usize, remote: RemoteKv) {
        if !self.d[d].alive {
            self.end(&request, End::LostWithD);
            return;
        }
        self.trace(&[10, self.now, d as u64]);
        self.trace_str(request.as_str());
        self.d[d].arrivals.push_back((request, tokens, remote));
    }

    fn d_step(&mut self, d: usize) {
        let local = self.d[d].clock.local(self.now);
        let since = self.now.saturating_sub(self.d[d].last_step);
        self.stats.tracked_request_ns += self.d[d].tracked.len() as u128 * u128::from(since);
        self.d[d].last_step = self.now;
        // 1. Arrivals: tracked at once.
        while let Some((request, tokens, remote)) = self.d[d].arrivals.pop_front() {
            match self.d[d]
                .core
                .on_new_request(local, request.clone(), tokens, remote)
            {
                Ok(()) => {
                    self.d[d].admitted.insert(request.clone(), self.now);
                    self.d[d].tracked.insert(request);
                }
                Err(_) => self.end(&request, End::RefusedAtD),
            }
            self.d_drain(d);
        }
        // 2. Handshakes that ended, connections that broke.
        while let Some((p, result)) = self.d[d].handshakes.pop_front() {
            let engine = self.p[p].id.clone();
            let result = match result {
                Some(incarnation) => {
                    self.d[d].conns.insert(p, incarnation);
                    let incarnation_d = self.d[d].incarnation;
                    self.last_batch.remove(&(d, incarnation_d, p));
                    Ok(RemoteEngine::new(
                        self.config.p_tp,
                        self.config.blocks_per_worker,
                    ))
                }
                None => Err((false, cause("P engine unreachable"))),
            };
            self.d[d].core.handle_handshake(local, &engine, result);
            self.d_drain(d);
        }
        while let Some((p, incarnation)) = self.d[d].lost_conns.pop_front() {
            if self.d[d].conns.get(&p) == Some(&incarnation) {
                self.forget(d, p);
            }
        }
        // 3. Notifications (expiry notices, forged ones).
        while let Some((from, bytes)) = self.d[d].inbox.pop_front() {
            self.d_notif(d, from, &bytes);
            self.d_drain(d);
        }
        // 4. Reads that ended.
        self.finish_loads(d);
        // 5. Decodes that ended.
        let now = self.now;
        let mut finished: Vec<RequestId> = Vec::new();
        self.d[d].decoding.retain(|(at, id)| {
            if *at <= now {
                finished.push(id.clone());
                false
            } else {
                true
            }
        });
        for id in finished {
            let _ = self.d[d].core.request_finished(&id);
            self.d_drain(d);
        }
        // 6. A client goes away.
        if !self.d[d].admitted.is_empty() && self.rng.chance(self.config.client_abort_per_million) {
            let i = self.rng.index(self.d[d].admitted.len());
            if let Some(id) = self.d[d].admitted.keys().nth(i).cloned()
                && self.d[d].core.abort(&id)
            {
                self.stats.client_aborts += 1;
                self.d_drain(d);
            }
        }
        // 7. Handshakes to start.
        while let Some(start) = self.d[d].core.poll_handshake() {
            self.stats.handshakes += 1;
            let Some(&p) = self.p_by_id.get(&start.engine) else {
                self.fail(format!(
                    "D{d}: handshake with unknown engine {}",
                    start.engine
                ));
                continue;
            };
            let ev = Ev::HandshakeDone {
                d,
                incarnation: self.d[d].incarnation,
                p,
            };
            self.schedule(self.now + nanos(self.config.handshake), ev);
        }
        // 8. Heartbeats and aborts, each to every worker of its P engine.
        self.d_transmit(d, local);
        // 9. Loads to post.
        self.post_loads(d);
    }

    fn d_transmit(&mut self, d: usize, local: Timestamp) {
        let mut transmits = Vec::new();
        while let Some(t) = self.d[d].core.poll_transmit(local) {
            transmits.push(t);
        }
        // The core's order of aborts follows its hash maps; sort for a deterministic run.
        transmits.sort_by(|a, b| (a.engine.as_str(), &a.bytes).cmp(&(b.engine.as_str(), &b.bytes)));
        let local_ns = local.as_nanos_saturating();
        let incarnation = self.d[d].incarnation;
        for t in transmits {
            let Some(&p) = self.p_by_id.get(&t.engine) else {
                self.fail(format!("D{d}: transmit for unknown engine {}", t.engine));
                continue;
            };
            let connected =
                self.p[p].alive && self.d[d].conns.get(&p) == Some(&self.p[p].incarnation);
            if !connected {
                // The connection is gone: the send fails.
                self.forget(d, p);
                continue;
            }
            if let TransmitKind::Heartbeat { .. } = t.kind {
                //= docs/spec.md#tracking
                //# one batched message per P worker per interval renews all of that engine's requests.
                if let Some(last) = self.last_batch.insert((d, incarnation, p), local_ns)
                    && last != local_ns
                    && local_ns - last < nanos(self.lease.interval())
                {
                    self.fail(format!(
                        "D{d}: two heartbeat batches for P{p} {} apart, within one interval",
                        fmt_ns(local_ns - last)
                    ));
                }
                self.stats.heartbeat_messages += u64::from(t.workers);
                self.stats.heartbeat_bytes += u64::from(t.workers) * t.bytes.len() as u64;
            }
            for worker in 0..t.workers {
                self.send(
                    Addr::D { engine: d, rank: 0 },
                    Addr::P { engine: p, worker },
                    t.bytes.clone(),
                );
            }
        }
    }

    /// The connection to P `p` is lost: the shell tells the core (the next request
    /// handshakes again).
    fn forget(&mut self, d: usize, p: usize) {
        if self.config.bug == Some(Bug::NeverForget) {
            return;
        }
        self.d[d].conns.remove(&p);
        let engine = self.p[p].id.clone();
        if self.d[d].core.is_ready(&engine) {
            self.stats.forgotten_engines += 1;
        }
        self.d[d].core.forget_engine(&engine);
        self.d_drain(d);
    }

    fn d_notif(&mut self, d: usize, from: Addr, bytes: &[u8]) {
        let engine = self.sender_engine(from);
        let honest = matches!(from, Addr::P { .. });
        let problem = match self.d[d].core.handle_notif(&engine, bytes) {
            DecodeNotif::Expired { failed, .. } => {
                if honest {
                    self.stats.recomputed_after_notice += u64::from(failed);
                    None
                } else {
                    (failed > 0).then(|| format!("a forged expiry notice failed {failed} requests"))
                }
            }
            DecodeNotif::Foreign => {
                if honest {
                    Some("an expiry notice from P was ignored as foreign".to_string())
                } else {
                    self.stats.forged_ignored += 1;
                    None
                }
            }
            DecodeNotif::Malformed(e) => Some(format!("message rejected: {e}")),
            _ => honest.then(|| "a message from P was ignored".to_string()),
        };
        if let Some(problem) = problem {
            self.fail(format!("D{d}: {problem}"));
        }
    }

    fn post_loads(&mut self, d: usize) {
        while let Some(plan) = self.d[d].core.poll_load() {
            let Some(&p) = self.p_by_id.get(&plan.remote.engine) else {
                self.fail(format!(
                    "D{d}: load from unknown engine {}",
                    plan.remote.engine
                ));
                continue;
            };
            let conn = self.d[d].conns.get(&p).copied();
            let reachable = self.reachable(d, p, conn);
            // The one-sided read copies the bytes first; the fence word is checked at its end.
            let copied = plan
                .batches
                .iter()
                .map(|b| {
                    let pool = self.p[p].pools.get(b.p_rank as usize).filter(|_| reachable);
                    plan.remote
                        .blocks
                        .iter()
                        .map(|blk| {
                            pool.and_then(|pool| pool.content.get(blk.0 as usize))
                                .copied()
                                .unwrap_or(POISON)
                        })
                        .collect()
                })
                .collect();
            let n = plan.batches.len();
            let admitted_at = self.d[d]
                .admitted
                .get(&plan.request)
                .copied()
                .unwrap_or(self.now);
            let waited = Duration::from_nanos(self.now.saturating_sub(admitted_at));
            self.stats.max_queue_wait = self.stats.max_queue_wait.max(waited);
            let request = plan.request.clone();
            self.d[d].loads.insert(
                request.clone(),
                Load {
                    p,
                    conn,
                    plan,
                    copied,
                    fence_matched: vec![false; n],
                    results: vec![None; n],
                    admitted_at,
                },
            );
            let ev = Ev::ReadDone {
                d,
                incarnation: self.d[d].incarnation,
                request,
            };
            self.schedule(self.now + nanos(self.config.read), ev);
        }
    }

    /// Whether a read over D's connection (to P incarnation `conn`) reaches P now.
    fn reachable(&self, d: usize, p: usize, conn: Option<u32>) -> bool {
        self.p[p].alive
            && conn == Some(self.p[p].incarnation)
            && !self.partitioned(
                Addr::D { engine: d, rank: 0 },
                Addr::P {
                    engine: p,
                    worker: 0,
                },
            )
    }

    /// The end of a request's reads (the NIC's time, whatever D's engine thread does): the
    /// fence word of the first block, on every P worker read.
    fn read_done(&mut self, d: usize, incarnation: u32, request: &RequestId) {
        if !self.d[d].alive || self.d[d].incarnation != incarnation {
            return;
        }
        let Some(load) = self.d[d].loads.get(request) else {
            return;
        };
        let (p, conn) = (load.p, load.conn);
        let reachable = self.reachable(d, p, conn);
        let fence = load.plan.fence_generation;
        let first = load.plan.remote.blocks.first().map(|b| b.0 as usize);
        let bytes = load.plan.remote.blocks.len() as u64;
        let words: Vec<Option<u64>> = load
            .plan
            .batches
            .iter()
            .map(|b| {
                let pool = self.p[p].pools.get(b.p_rank as usize)?;
                pool.words.get(first?).copied()
            })
            .collect();
        let ignore_fence = self.config.bug == Some(Bug::IgnoreFence);
        let mut stale = 0;
        let mut failed = 0;
        let Some(load) = self.d[d].loads.get_mut(request) else {
            return;
        };
        for (i, word) in words.into_iter().enumerate() {
            let result = if !reachable {
                failed += 1;
                BatchResult::Failed(cause(
                    "P engine unreachable (crashed, restarted or cut off)",
                ))
            } else {
                let matched = word == Some(fence);
                load.fence_matched[i] = matched;
                if matched || ignore_fence {
                    BatchResult::Done { bytes }
                } else {
                    stale += 1;
                    BatchResult::Stale
                }
            };
            load.results[i] = Some(result);
        }
        self.stats.stale_reads += stale;
        self.stats.failed_reads += failed;
        self.trace(&[11, self.now, d as u64, stale, failed]);
    }

    /// Reports the reads that ended to the core; a done batch sends its read completion
    /// to the P worker it read.
    fn finish_loads(&mut self, d: usize) {
        let ready: Vec<RequestId> = self.d[d]
            .loads
            .iter()
            .filter(|(_, l)| l.results.iter().all(Option::is_some))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ready {
            if self.config.bug == Some(Bug::SkipAbortedReads)
                && !self.d[d].admitted.contains_key(&id)
            {
                self.d[d].loads.remove(&id);
                continue;
            }
            let Some(load) = self.d[d].loads.get_mut(&id) else {
                continue;
            };
            let p = load.p;
            let results: Vec<Option<BatchResult>> =
                load.results.iter_mut().map(Option::take).collect();
            let notifs: Vec<(u32, u32, Vec<u8>)> = load
                .plan
                .batches
                .iter()
                .map(|b| (b.d_worker, b.p_rank, b.notif.clone()))
                .collect();
            let mut lost = false;
            for (i, (result, (d_worker, p_rank, notif))) in
                results.into_iter().zip(notifs).enumerate()
            {
                let Some(result) = result else { continue };
                match &result {
                    BatchResult::Done { .. } => {
                        let bytes = self.maybe_underreport(notif);
                        self.send(
                            Addr::D {
                                engine: d,
                                rank: d_worker,
                            },
                            Addr::P {
                                engine: p,
                                worker: p_rank,
                            },
                            bytes,
                        );
                    }
                    BatchResult::Failed(_) => lost = true,
                    _ => {}
                }
                self.d[d].core.handle_batch_done(&id, i, result);
                self.d_drain(d);
            }
            self.d[d].loads.remove(&id);
            if lost {
                self.forget(d, p);
            }
        }
    }

    /// The planted bug: rewrite a read completion to claim a single consumer.
    fn maybe_underreport(&self, bytes: Vec<u8>) -> Vec<u8> {
        if self.config.bug != Some(Bug::UnderreportConsumers) {
            return bytes;
        }
        match decode(&bytes) {
            Ok(Notif::ReadComplete(rc)) => ReadComplete {
                consumers_total: 1,
                ..rc
            }
            .encode(),
            _ => bytes,
        }
    }

    /// Drains the core's events (after every input). The core's order of simultaneous
    /// endings follows its hash maps; they are sorted for a deterministic run.
    fn d_drain(&mut self, d: usize) {
        loop {
            let mut events = Vec::new();
            while let Some(e) = self.d[d].core.poll_event() {
                events.push(e);
            }
            if events.is_empty() {
                return;
            }
            events.sort_by_key(event_key);
            for event in events {
                match event {
                    DecodeEvent::Loaded { request, .. } => self.verify(d, &request),
                    DecodeEvent::Finished { request, outcome } => {
                        self.d_finished(d, &request, &outcome)
                    }
                    _ => {}
                }
            }
        }
    }

    /// Oracle 2 and the content oracle: a loaded request's every batch read under its
    /// matching fence, and every block holds the request's own content.
    fn verify(&mut self, d: usize, request: &RequestId) {
        let Some(load) = self.d[d].loads.get(request) else {
            self.fail(format!("D{d}: {request} loaded with no reads in flight"));
            return;
        };
        let seed = self.requests.get(request).map_or(0, |r| r.content_seed);
        let mut problems = Vec::new();
        for (i, b) in load.plan.batches.iter().enumerate() {
            if !load.fence_matched[i] {
                problems.push(format!(
                    "D{d}: output from a read whose fence did not match: {request} batch {i} (P worker {})",
                    b.p_rank
                ));
            }
            let copied = &load.copied[i];
            let wrong = copied.len() != load.plan.remote.blocks.len()
                || copied
                    .iter()
                    .enumerate()
                    .any(|(j, &c)| c != block_content(seed, b.p_rank, j));
            if wrong {
                let poisoned = copied.contains(&POISON);
                problems.push(format!(
                    "D{d}: wrong output: {request} batch {i} read {} content under its matching fence",
                    if poisoned { "poisoned" } else { "foreign" }
                ));
            }
        }
        let admitted_at = load.admitted_at;
        let ok = problems.is_empty();
        for p in problems {
            self.fail(p);
        }
        self.d[d].tracked.remove(request);
        let verdict = if ok {
            Ok(())
        } else {
            Err(cause("the KV read did not verify"))
        };
        self.d[d].core.handle_verified(request, verdict);
        if ok {
            self.stats.reads_ok += 1;
            let decode = self
                .rng
                .range(nanos(self.config.decode.0), nanos(self.config.decode.1));
            self.d[d]
                .decoding
                .push((self.now + decode, request.clone()));
            self.trace(&[13, self.now, d as u64, admitted_at]);
        }
    }

    fn d_finished(&mut self, d: usize, request: &RequestId, outcome: &Outcome) {
        self.d[d].admitted.remove(request);
        self.d[d].tracked.remove(request);
        let end = match outcome {
            Outcome::Done => End::Done,
            Outcome::Failed(e) => {
                if matches!(e, LoadError::Expired { .. }) {
                    self.trace(&[12, self.now, d as u64]);
                }
                End::Failed
            }
            Outcome::Aborted => End::Aborted,
            other => {
                self.fail(format!(
                    "D{d}: {request} ended in {other:?}, which no shell asked for"
                ));
                End::Aborted
            }
        };
        self.end(request, end);
    }

    fn crash_d(&mut self, d: usize, restart_after: Option<Duration>) {
        if !self.d[d].alive {
            return;
        }
        let engine = &mut self.d[d];
        engine.alive = false;
        // Its core, queue, reads and decodes vanish; it sends nothing more.
        let mut lost: Vec<RequestId> = std::mem::take(&mut engine.admitted).into_keys().collect();
        lost.extend(engine.arrivals.drain(..).map(|(id, _, _)| id));
        let mut victims: Vec<RequestId> = engine.tracked.drain().collect();
        victims.sort();
        engine.loads.clear();
        engine.decoding.clear();
        engine.inbox.clear();
        engine.handshakes.clear();
        engine.lost_conns.clear();
        engine.conns.clear();
        for request in victims {
            self.crash_victims.insert(request, d);
        }
        for request in lost {
            self.end(&request, End::LostWithD);
        }
        self.d_crashed_at[d] = Some(self.now);
        let back = restart_after.map_or(u64::MAX, |a| self.now + nanos(a));
        self.faults.push((self.now, back));
        self.trace(&[14, self.now, d as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartD { d });
        }
    }

    fn restart_d(&mut self, d: usize) {
        let engine = &mut self.d[d];
        engine.alive = true;
        engine.incarnation += 1;
        engine.core = d_core(&self.config, self.lease, engine.id.clone());
        engine.stalled_until = 0;
        engine.last_step = self.now;
        let incarnation = engine.incarnation;
        self.stats.d_restarts += 1;
        self.trace(&[6, self.now, d as u64]);
        self.schedule(self.now, Ev::DStep { d, incarnation });
    }

    // ---- the rogue ----------------------------------------------------------------------

    /// A forged notification for a real request id. To P: only for leases an honest D
    /// engine already owns (a rogue that claims first owns the lease like any reader; see
    /// the crate doc). To D: an expiry notice for a request it holds.
    fn forge(&mut self) {
        if self.arrivals_left > 0
            && let Some(gap) = self.config.forged_gap
        {
            let next = self.now + self.rng.range(1, 2 * nanos(gap));
            self.schedule(next, Ev::Forge);
        }
        let kind = self.rng.index(4);
        if kind < 3 {
            let p = self.rng.index(self.p.len());
            let engine = &self.p[p];
            if !engine.alive {
                return;
            }
            // Mostly leases an honest engine owns; sometimes any lease, which the rogue may
            // then claim first (it owns the lease like any reader would; see the crate doc).
            let any = self.rng.chance(200_000);
            let targets: Vec<(RequestId, EngineId)> = engine
                .grant_order
                .iter()
                .filter_map(|r| {
                    let owner = engine.oracle.get(r)?.owner.clone();
                    match owner {
                        Some(o) if o != self.rogue => Some((r.clone(), o)),
                        None if any => Some((r.clone(), self.rogue.clone())),
                        _ => None,
                    }
                })
                .collect();
            if targets.is_empty() {
                return;
            }
            let (request, owner) = targets[self.rng.index(targets.len())].clone();
            let as_owner = self.rng.chance(500_000);
            let consumer_engine = if as_owner { owner } else { self.rogue.clone() };
            let rank = self.rng.range(0, 7) as u32;
            let bytes = match kind {
                0 => encode_heartbeats([&request], MAX_NOTIF_LEN)
                    .ok()
                    .and_then(|m| m.into_iter().next()),
                1 => Some(
                    ReadComplete {
                        request,
                        consumer: ConsumerId::new(consumer_engine, rank),
                        consumers_total: [1, 2, 4, 1_000][self.rng.index(4)],
                    }
                    .encode(),
                ),
                _ => Some(
                    Abort {
                        request,
                        consumer: ConsumerId::new(consumer_engine, rank),
                    }
                    .encode(),
                ),
            };
            let Some(bytes) = bytes else { return };
            let worker = self.rng.index(self.config.p_tp as usize) as u32;
            self.stats.forged += 1;
            self.send(Addr::Rogue, Addr::P { engine: p, worker }, bytes);
        } else {
            let d = self.rng.index(self.d.len());
            if !self.d[d].alive || self.d[d].admitted.is_empty() {
                return;
            }
            let i = self.rng.index(self.d[d].admitted.len());
            let Some(request) = self.d[d].admitted.keys().nth(i).cloned() else {
                return;
            };
            let generation = self.requests.get(&request).map_or(0, |r| r.generation);
            let Some(generation) = NonZeroU64::new(generation).map(Generation) else {
                return;
            };
            let lease = ExpiredLease {
                request,
                generation,
            };
            let Ok(messages) = encode_expired([&lease], MAX_NOTIF_LEN) else {
                return;
            };
            for m in messages {
                self.stats.forged += 1;
                self.send(Addr::Rogue, Addr::D { engine: d, rank: 0 }, m);
            }
        }
    }
}

fn event_key(e: &DecodeEvent) -> (u8, String) {
    match e {
        DecodeEvent::Loaded { request, .. } => (0, request.as_str().to_string()),
        DecodeEvent::HandshakeDone { engine } => (1, engine.as_str().to_string()),
        DecodeEvent::Finished { request, .. } => (2, request.as_str().to_string()),
        _ => (3, String::new()),
    }
}

fn engine_id(s: &str) -> EngineId {
    EngineId::new(s).unwrap_or_else(|_| unreachable_engine())
}

fn request_id(n: u64) -> RequestId {
    let mut s = String::with_capacity(24);
    let _ = write!(s, "cmpl-{n:06}-0");
    RequestId::new(&s).unwrap_or_else(|_| unreachable_id())
}

#[cold]
fn unreachable_id() -> RequestId {
    // Ids built here use only `[a-z0-9-]`; reaching this is a bug of the simulator.
    #[allow(clippy::panic)]
    {
        panic!("simulator built an invalid request id")
    }
}

#[cold]
fn unreachable_engine() -> EngineId {
    #[allow(clippy::panic)]
    {
        panic!("simulator built an invalid engine id")
    }
}
