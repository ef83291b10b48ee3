//! The world: engine cores in their shells, network, virtual time, faults, and the checker.
//!
//! `mod.rs` holds the world's state and its event loop; `net` is the network, `prefill`
//! and `decode` are the P and D shells, `engines` builds their cores and first state,
//! `oracle` the checks, `rogue` the forger, `turns` bidirectional mode (D's held turns,
//! P's pulls, and their oracle), and `report` what a run hands back.

mod decode;
mod engines;
mod net;
mod oracle;
mod prefill;
mod report;
mod rogue;
mod turns;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_engine::{
    BatchResult, DecodeCore, DecodeEvent, DecodeNotif, DecoderKvParams, HandshakeError, LoadError,
    LoadPlan, Outcome, Peer, PrefillAction, PrefillCore, PrefillEvent, PrefillNotif, RemoteEngine,
    RemoteKv, TransmitKind,
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
use engines::{d_core, instance_of, p_core};
use turns::{Conv, HoldRec, Pull, TurnIn};

pub use report::{Report, SimStats};

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

use crate::cause;

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
    /// Bidirectional mode: the conversation this request is a turn of.
    conv: Option<usize>,
}

impl Req {
    /// A request that arrived at P engine `p` at `arrived`, nothing yet done to it.
    fn arrived(p: usize, tokens: usize, arrived: u64, watched: bool, conv: Option<usize>) -> Self {
        Self {
            p,
            tokens,
            arrived,
            content_seed: 0,
            generation: 0,
            end: None,
            ends: 0,
            watched,
            rogue_hit: false,
            conv,
        }
    }
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
    /// Bidirectional mode: next turns waiting here with D's cached-turn params.
    turns: BTreeMap<RequestId, TurnIn>,
    /// Bidirectional mode, symmetric lease: P's schedule of heartbeats for the held turns
    /// of the next turns waiting here (the prefill agent's).
    turn_heartbeats: kvlease_engine::TurnHeartbeats,
    /// Bidirectional mode: P's handshakes with D engines for pulls (the prefill agent's
    /// `d_caches`): D → the incarnation it reached. A failed pull drops it; the next pull
    /// handshakes with the D then running.
    d_conns: BTreeMap<usize, u32>,
    /// Bidirectional mode: pulls of D's held blocks in flight.
    pulls: BTreeMap<RequestId, Pull>,
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
    /// True time the latest stall ended (0: none).
    stall_end: u64,
    last_step: u64,
    /// Bidirectional mode: D's memory (one pool for all its workers): the fence word and
    /// the content of every block.
    mem: Pool,
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
    /// Bidirectional mode: a conversation's next turn reaches P, with D's params of the
    /// last turn when D held it.
    NextTurn {
        conv: usize,
        held: Option<Box<(DecoderKvParams, usize, u32)>>,
        think: u64,
    },
    /// Bidirectional mode: P's read of D's held blocks ends.
    PullDone {
        p: usize,
        incarnation: u32,
        request: RequestId,
    },
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
    /// Bidirectional mode: every conversation.
    convs: Vec<Conv>,
    /// Bidirectional mode: every cached turn D held (the hold oracle's record), by hold id.
    holds: BTreeMap<RequestId, HoldRec>,
    /// Bidirectional mode: next turns in the client's think time.
    turns_pending: usize,
    arrivals_left: usize,
    next_request: u64,
    in_flight_transfers: usize,
    trace: u64,
    /// The full trace, when recorded ([`World::record_log`]).
    log: Option<Vec<String>>,
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
        if let Some(b) = &config.bidir {
            // Invariant: the bidirectional worlds use TTLs of 1.2 to 2.5 s.
            kvlease_lease::DecoderTtl::from_duration(b.ttl).expect("config: valid decoder TTL");
        }
        let mut rng = Rng::new(config.seed);
        let clock = |rng: &mut Rng| Clock {
            offset_ns: rng.range(0, nanos(config.clock_offset_max)),
            drift_ppm: rng.range(0, 2 * u64::from(config.drift_ppm_max)) as i64
                - i64::from(config.drift_ppm_max),
        };
        let p: Vec<PEngine> = (0..config.p_engines)
            .map(|i| PEngine::new(&config, lease, i, clock(&mut rng)))
            .collect();
        let d = (0..config.d_engines)
            .map(|i| DEngine::new(&config, lease, i, clock(&mut rng)))
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
            convs: Vec::new(),
            holds: BTreeMap::new(),
            turns_pending: 0,
            next_request: 0,
            in_flight_transfers: 0,
            trace: 0xcbf2_9ce4_8422_2325,
            log: None,
            stats: SimStats::default(),
            failures: Vec::new(),
            config,
        };
        world.schedule_start();
        world
    }

    /// The first events: every engine's first step (at a random phase), the first
    /// arrival, and every configured crash, stall, partition and forgery.
    fn schedule_start(&mut self) {
        for p in 0..self.p.len() {
            let at = self.rng.range(0, nanos(self.config.p_step));
            self.schedule(at, Ev::PStep { p, incarnation: 0 });
        }
        for d in 0..self.d.len() {
            let at = self.rng.range(0, nanos(self.config.d_step));
            self.schedule(at, Ev::DStep { d, incarnation: 0 });
        }
        self.schedule(0, Ev::Arrival);
        for crash in self.config.d_crashes.clone() {
            let ev = Ev::CrashD {
                d: crash.engine,
                restart_after: crash.restart_after,
            };
            self.schedule(nanos(crash.at), ev);
        }
        for crash in self.config.p_crashes.clone() {
            let ev = Ev::CrashP {
                p: crash.engine,
                restart_after: crash.restart_after,
            };
            self.schedule(nanos(crash.at), ev);
        }
        for (on_p, stalls) in [
            (true, self.config.p_stalls.clone()),
            (false, self.config.d_stalls.clone()),
        ] {
            for s in stalls {
                let ev = Ev::Stall {
                    on_p,
                    engine: s.engine,
                    duration: s.duration,
                };
                self.schedule(nanos(s.at), ev);
            }
        }
        for cut in self.config.partitions.clone() {
            let ev = Ev::Partition {
                duration: cut.duration,
            };
            self.schedule(nanos(cut.at), ev);
        }
        if let Some(gap) = self.config.forged_gap {
            let at = self.rng.range(0, 2 * nanos(gap));
            self.schedule(at, Ev::Forge);
        }
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled {
            at,
            seq: self.seq,
            ev,
        }));
    }

    /// Records the full trace as well as its hash ([`Report::log`]), to compare two runs
    /// line by line.
    #[must_use]
    pub fn record_log(mut self) -> Self {
        self.log = Some(Vec::new());
        self
    }

    /// Adds a line to the full trace, when it is recorded (`what` is only called then).
    fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some(log) = &mut self.log {
            log.push(format!("{} {}", self.now, what()));
        }
    }

    fn trace(&mut self, words: &[u64]) {
        self.note(|| format!("trace {words:?}"));
        for &w in words {
            for b in w.to_le_bytes() {
                self.trace ^= u64::from(b);
                self.trace = self.trace.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }

    fn trace_str(&mut self, s: &str) {
        self.note(|| format!("trace {s}"));
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
            log: self.log.unwrap_or_default(),
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
            log: self.log.clone().unwrap_or_default(),
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
            && self.turns_pending == 0
            && self.p.iter().filter(|p| p.alive).all(|p| {
                p.pending.is_empty()
                    && p.jobs.is_empty()
                    && p.prefilling.is_empty()
                    && p.pulls.is_empty()
            })
            && self.d.iter().filter(|d| d.alive).all(|d| {
                d.arrivals.is_empty()
                    && d.admitted.is_empty()
                    && d.loads.is_empty()
                    && d.decoding.is_empty()
                    && d.core.turn_blocks_held() == 0
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
                    let cached = self.d[d].conns.get(&p).copied();
                    let result = match cached {
                        // The planted bug: a stale connection cache answers the handshake.
                        Some(old) if self.config.bug == Some(Bug::NeverForget) => Some(old),
                        _ => reachable.then_some(self.p[p].incarnation),
                    };
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
                    self.d[engine].stall_end = until;
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
            Ev::NextTurn { conv, held, think } => self.next_turn(conv, held.map(|h| *h), think),
            Ev::PullDone {
                p,
                incarnation,
                request,
            } => self.pull_done(p, incarnation, &request),
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
