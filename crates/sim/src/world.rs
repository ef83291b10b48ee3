//! The world: engines, network, virtual time, and the checker.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_lease::{
    BlockId, ConsumerId, EngineId, Event, Generation, HeartbeatTracker, LeaseConfig, LeaseMode,
    LeaseTable, ReleaseReason, Released, RequestId, Timestamp,
};
use kvlease_notif::{
    Abort, DecodeRouted, DecodeRouter, Notif, PrefillRouter, ReadComplete, Routed, decode,
    encode_expired, encode_heartbeats,
};

use crate::config::{Bug, WorldConfig};
use crate::rng::Rng;

/// Content of a freed block: what P writes over blocks it releases.
const POISON: u64 = 0xdead_dead_dead_dead;

/// Stop after this much virtual time past the last arrival, drained or not.
const MAX_DRAIN: Duration = Duration::from_secs(600);

/// Failures kept per run (the first ones are the interesting ones).
const MAX_FAILURES: usize = 20;

/// An endpoint of the notification network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Addr {
    P { engine: usize, worker: u32 },
    D { engine: usize, rank: u32 },
}

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimStats {
    /// Requests that arrived at P.
    pub arrived: u64,
    /// Requests P turned away for lack of blocks.
    pub rejected_no_blocks: u64,
    /// Leases granted (one per request and P worker).
    pub granted: u64,
    /// Leases released because every consumer reported.
    pub released_completed: u64,
    /// Leases released by the reaper.
    pub released_expired: u64,
    /// Leases released by an abort.
    pub released_aborted: u64,
    /// Requests D read successfully.
    pub reads_ok: u64,
    /// Reads that found a changed generation and ended in recompute.
    pub stale_reads: u64,
    /// Reads that failed because P was gone, and ended in recompute.
    pub failed_reads: u64,
    /// Requests D recomputed without reading, after an expiry notice.
    pub recomputed_after_notice: u64,
    /// Requests the client aborted on D.
    pub client_aborts: u64,
    /// Requests lost with a crashed D.
    pub lost_with_d: u64,
    /// Heartbeat messages sent.
    pub heartbeat_messages: u64,
    /// Heartbeat ids routed on P that named no live lease (late or unknown).
    pub heartbeat_ids_unknown_or_late: u64,
    /// Heartbeat ids that arrived after their lease was released (completed, aborted or expired).
    pub heartbeats_after_release: u64,
    /// Expiry notices (messages) sent by P.
    pub expiry_notices: u64,
    /// Messages lost / duplicated by the network.
    pub messages_lost: u64,
    /// Messages duplicated by the network.
    pub messages_duplicated: u64,
    /// Of the lost messages, those dropped by a partition.
    pub messages_partitioned: u64,
    /// Leases reclaimed after their D crashed.
    pub crash_reclaims: u64,
    /// Smallest and largest time from the last delivered heartbeat to the reclaim of a
    /// lease whose D crashed (P's clock).
    pub crash_reclaim_after_heartbeat: Option<(Duration, Duration)>,
    /// Longest time from a D crash to the reclaim of one of its leases (true time).
    pub crash_reclaim_since_crash_max: Duration,
    /// Longest time a request waited in a D queue.
    pub max_queue_wait: Duration,
    /// Read completions P routed.
    pub read_completions: u64,
    /// Handshakes D started because a heartbeat was due for a P engine it had not met.
    pub handshakes: u64,
    /// Heartbeat batches deferred (handshake not done yet).
    pub deferred_batches: u64,
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

/// What the oracle knows of one lease, on P's clock.
#[derive(Debug, Clone)]
struct OracleLease {
    generation: Generation,
    expiry_ns: u64,
    last_heartbeat_ns: Option<u64>,
    expected_consumers: u32,
    consumers: HashSet<ConsumerId>,
    aborted: bool,
    d_engine: Option<usize>,
    granted_true_ns: u64,
}

/// A block pool with the fence word and the content of every block.
#[derive(Debug)]
struct Pool {
    words: Vec<u64>,
    content: Vec<u64>,
    free: VecDeque<u32>,
}

impl Pool {
    fn new(blocks: u32) -> Self {
        Self {
            words: vec![Generation::FREE_WORD; blocks as usize],
            content: vec![POISON; blocks as usize],
            free: (0..blocks).collect(),
        }
    }
}

#[derive(Debug)]
struct PWorker {
    table: LeaseTable,
    router: PrefillRouter<Addr>,
    pool: Pool,
    /// Oracle: every lease the table should hold.
    oracle: HashMap<RequestId, OracleLease>,
    /// Oracle: (expiry, request) of the same leases, to find overdue ones.
    deadlines: BTreeSet<(u64, RequestId)>,
    /// Grant order, for the planted grant-order reaper.
    grant_order: VecDeque<RequestId>,
    inbox: Vec<(Addr, Vec<u8>)>,
}

#[derive(Debug, Clone)]
struct Transfer {
    request: RequestId,
    p: usize,
    p_incarnation: u32,
    /// Per P worker: the blocks and the generation granted.
    blocks: Vec<Vec<BlockId>>,
    generations: Vec<Generation>,
    content_seed: u64,
}

#[derive(Debug)]
struct Prefill {
    request: RequestId,
    done_at: u64,
    blocks: Vec<Vec<BlockId>>,
}

#[derive(Debug)]
struct PEngine {
    id: EngineId,
    alive: bool,
    incarnation: u32,
    clock: Clock,
    workers: Vec<PWorker>,
    prefilling: VecDeque<Prefill>,
}

#[derive(Debug)]
struct DRank {
    tracker: HeartbeatTracker,
    router: DecodeRouter,
    inbox: Vec<Vec<u8>>,
}

#[derive(Debug)]
struct Running {
    transfer: Transfer,
    read_done_at: u64,
    read_finished: bool,
    done_at: u64,
}

#[derive(Debug)]
struct DEngine {
    id: EngineId,
    alive: bool,
    incarnation: u32,
    clock: Clock,
    ranks: Vec<DRank>,
    waiting: VecDeque<(Transfer, u64)>,
    running: Vec<Running>,
    /// Requests named in an expiry notice.
    lost: HashSet<RequestId>,
    /// Handshakes with P engines: when each is (or was) done, in true time.
    handshakes: HashMap<usize, u64>,
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
        transfer: Transfer,
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
    /// Local time of the last heartbeat batch per (D engine, incarnation, rank, P engine).
    last_batch: HashMap<(usize, u32, usize, usize), u64>,
    /// Consecutive losses per link and stream (heartbeat or not).
    losses_in_a_row: HashMap<(Addr, Addr, bool), u32>,
    /// True time each D engine crashed (latest crash).
    d_crashed_at: Vec<Option<u64>>,
    /// Which D engine each request was routed to, and whether it still tracks it.
    tracked_by: HashMap<RequestId, usize>,
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

/// Content of block `i` of a request: derived from the request, so that D can check
/// every block it read.
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
    /// that do not divide each other); a test bug, not a simulation outcome.
    pub fn new(config: WorldConfig) -> Self {
        // Invariant: the named configs use leases of 1.2 to 3 s, which the lease crate
        // accepts; a custom config with a rejected duration is a bug of the test.
        let lease = LeaseConfig::from_duration(config.lease)
            .expect("config: valid lease duration")
            .with_mode(config.mode);
        assert!(
            config.p_tp.is_multiple_of(config.d_tp) || config.d_tp.is_multiple_of(config.p_tp),
            "config: TP sizes must divide each other"
        );
        let mut rng = Rng::new(config.seed);
        let clock = |rng: &mut Rng| Clock {
            offset_ns: rng.range(0, nanos(config.clock_offset_max)),
            drift_ppm: rng.range(0, 2 * u64::from(config.drift_ppm_max)) as i64
                - i64::from(config.drift_ppm_max),
        };
        let p = (0..config.p_engines)
            .map(|i| {
                let clock = clock(&mut rng);
                let mut engine = PEngine {
                    id: engine_id(&format!("p{i}")),
                    alive: true,
                    incarnation: 0,
                    clock,
                    workers: Vec::new(),
                    prefilling: VecDeque::new(),
                };
                engine.workers = Self::fresh_workers(&config, &lease, 0);
                engine
            })
            .collect();
        let d = (0..config.d_engines)
            .map(|i| DEngine {
                id: engine_id(&format!("d{i}")),
                alive: true,
                incarnation: 0,
                clock: clock(&mut rng),
                ranks: Self::fresh_ranks(&config, &lease),
                waiting: VecDeque::new(),
                running: Vec::new(),
                lost: HashSet::new(),
                handshakes: HashMap::new(),
            })
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
            losses_in_a_row: HashMap::new(),
            last_batch: HashMap::new(),
            tracked_by: HashMap::new(),
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
            world.schedule(
                nanos(crash.at),
                Ev::CrashD {
                    d: crash.engine,
                    restart_after: crash.restart_after,
                },
            );
        }
        for crash in world.config.p_crashes.clone() {
            world.schedule(
                nanos(crash.at),
                Ev::CrashP {
                    p: crash.engine,
                    restart_after: crash.restart_after,
                },
            );
        }
        world
    }

    fn fresh_workers(config: &WorldConfig, lease: &LeaseConfig, incarnation: u32) -> Vec<PWorker> {
        (0..config.p_tp)
            .map(|_| {
                // A restarted P starts its generations above every earlier one.
                let first = NonZeroU64::new((u64::from(incarnation) << 40) | 1)
                    .map_or(Generation(NonZeroU64::MIN), Generation);
                PWorker {
                    table: LeaseTable::with_first_generation(*lease, first),
                    router: PrefillRouter::new(),
                    pool: Pool::new(config.blocks_per_worker),
                    oracle: HashMap::new(),
                    deadlines: BTreeSet::new(),
                    grant_order: VecDeque::new(),
                    inbox: Vec::new(),
                }
            })
            .collect()
    }

    fn fresh_ranks(config: &WorldConfig, lease: &LeaseConfig) -> Vec<DRank> {
        (0..config.d_tp)
            .map(|_| DRank {
                tracker: HeartbeatTracker::new(lease),
                router: DecodeRouter::new(),
                inbox: Vec::new(),
            })
            .collect()
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

    /// Runs the world until every request is done and every lease is released (or the
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
                } else if self.now >= at + linger && self.tables_empty() {
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

    fn last_arrival_cap(&self) -> u64 {
        nanos(self.config.arrival_gap) * 2 * self.config.requests as u64 + nanos(MAX_DRAIN)
    }

    /// No request in flight anywhere (queues, slots, prefills, transfers).
    fn quiet(&self) -> bool {
        self.in_flight_transfers == 0
            && self.p.iter().all(|p| p.prefilling.is_empty())
            && self
                .d
                .iter()
                .all(|d| d.waiting.is_empty() && d.running.is_empty())
    }

    fn tables_empty(&self) -> bool {
        self.p
            .iter()
            .filter(|p| p.alive)
            .all(|p| p.workers.iter().all(|w| w.table.is_empty()))
    }

    fn check_end(&mut self) {
        let mut problems = Vec::new();
        for p in self.p.iter().filter(|p| p.alive) {
            for (w, worker) in p.workers.iter().enumerate() {
                if !worker.table.is_empty() || worker.table.blocks_held() != 0 {
                    problems.push(format!(
                        "leak: {} worker {w} still holds {} leases ({} blocks) at the end",
                        p.id,
                        worker.table.len(),
                        worker.table.blocks_held()
                    ));
                }
                if worker.pool.free.len() != self.config.blocks_per_worker as usize {
                    problems.push(format!(
                        "leak: {} worker {w} has {} of {} blocks free at the end",
                        p.id,
                        worker.pool.free.len(),
                        self.config.blocks_per_worker
                    ));
                }
                if !worker.oracle.is_empty() {
                    problems.push(format!(
                        "leak: the oracle of {} worker {w} still has {} leases",
                        p.id,
                        worker.oracle.len()
                    ));
                }
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
                    self.trace(&[1, self.now, p as u64]);
                    self.p_step(p);
                    let next = self.now + self.step_len(self.config.p_step);
                    self.schedule(next, Ev::PStep { p, incarnation });
                }
            }
            Ev::DStep { d, incarnation } => {
                if self.d[d].alive && self.d[d].incarnation == incarnation {
                    self.trace(&[2, self.now, d as u64]);
                    self.d_step(d);
                    let next = self.now + self.step_len(self.config.d_step);
                    self.schedule(next, Ev::DStep { d, incarnation });
                }
            }
            Ev::Deliver { from, to, bytes } => self.deliver(from, to, bytes),
            Ev::Transfer { d, transfer } => {
                self.in_flight_transfers -= 1;
                self.arrive_at_d(d, transfer);
            }
            Ev::CrashD { d, restart_after } => self.crash_d(d, restart_after),
            Ev::RestartD { d } => {
                let engine = &mut self.d[d];
                engine.alive = true;
                engine.incarnation += 1;
                engine.ranks = Self::fresh_ranks(&self.config, &self.lease);
                let incarnation = engine.incarnation;
                // Requests of the crashed incarnation are gone for good.
                self.tracked_by.retain(|_, owner| *owner != d);
                self.trace(&[6, self.now, d as u64]);
                self.schedule(self.now, Ev::DStep { d, incarnation });
            }
            Ev::CrashP { p, restart_after } => self.crash_p(p, restart_after),
            Ev::RestartP { p } => {
                let engine = &mut self.p[p];
                engine.alive = true;
                engine.incarnation += 1;
                engine.workers = Self::fresh_workers(&self.config, &self.lease, engine.incarnation);
                let incarnation = engine.incarnation;
                self.trace(&[8, self.now, p as u64]);
                self.schedule(self.now, Ev::PStep { p, incarnation });
            }
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
        self.losses_in_a_row.insert(link, 0);
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
            Addr::P { engine, worker } => {
                let p = &mut self.p[engine];
                if p.alive {
                    p.workers[worker as usize].inbox.push((from, bytes));
                }
            }
            Addr::D { engine, rank } => {
                let d = &mut self.d[engine];
                if d.alive {
                    d.ranks[rank as usize].inbox.push(bytes);
                }
            }
        }
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
        let n = self.rng.range(u64::from(lo), u64::from(hi)) as usize;
        let engine = &mut self.p[p];
        if engine.alive && engine.workers.iter().all(|w| w.pool.free.len() >= n) {
            let blocks = engine
                .workers
                .iter_mut()
                .map(|w| w.pool.free.drain(..n).map(BlockId).collect())
                .collect();
            let done_at = self.now + nanos(self.config.prefill);
            engine.prefilling.push_back(Prefill {
                request,
                done_at,
                blocks,
            });
        } else {
            self.stats.rejected_no_blocks += 1;
        }
        self.trace(&[4, self.now, p as u64]);
        if self.arrivals_left > 0 {
            let gap = self.rng.range(0, 2 * nanos(self.config.arrival_gap));
            self.schedule(self.now + gap, Ev::Arrival);
        }
    }

    fn p_step(&mut self, p: usize) {
        let local = self.p[p].clock.local(self.now);
        let local_ns = local.as_nanos_saturating();
        for w in 0..self.p[p].workers.len() {
            let inbox = std::mem::take(&mut self.p[p].workers[w].inbox);
            for (from, bytes) in inbox {
                self.p_route(p, w, local, from, &bytes);
                // Free at once what the message released, as the agent does.
                self.drain_events(p, w, local_ns);
            }
        }
        // Prefills done: grant on every worker and hand the request to a D engine.
        while self.p[p]
            .prefilling
            .front()
            .is_some_and(|f| f.done_at <= self.now)
        {
            let Some(prefill) = self.p[p].prefilling.pop_front() else {
                break;
            };
            self.grant(p, local, prefill);
        }
        for w in 0..self.p[p].workers.len() {
            self.reap(p, w, local);
            self.drain_events(p, w, local_ns);
            self.check_overdue(p, w, local_ns);
        }
    }

    fn grant(&mut self, p: usize, local: Timestamp, prefill: Prefill) {
        let d_tp = self.config.d_tp;
        let p_tp = self.config.p_tp;
        let expected = (d_tp / p_tp).max(1);
        let content_seed = self.rng.next_u64();
        let d = self.rng.index(self.d.len());
        let duration = nanos(self.lease.duration());
        let engine = &mut self.p[p];
        let mut generations = Vec::new();
        for (w, blocks) in prefill.blocks.iter().enumerate() {
            let worker = &mut engine.workers[w];
            let generation =
                match worker
                    .table
                    .grant(local, prefill.request.clone(), blocks.clone(), expected)
                {
                    Ok(g) => g,
                    Err(e) => {
                        let msg = format!("grant of {} failed: {e}", prefill.request);
                        self.fail(msg);
                        return;
                    }
                };
            for (i, b) in blocks.iter().enumerate() {
                worker.pool.words[b.0 as usize] = generation.word();
                // `w` indexes the workers, so it fits u32.
                worker.pool.content[b.0 as usize] = block_content(content_seed, w as u32, i);
            }
            let expiry_ns = local.as_nanos_saturating() + duration;
            worker.oracle.insert(
                prefill.request.clone(),
                OracleLease {
                    generation,
                    expiry_ns,
                    last_heartbeat_ns: None,
                    expected_consumers: expected,
                    consumers: HashSet::new(),
                    aborted: false,
                    d_engine: Some(d),
                    granted_true_ns: self.now,
                },
            );
            worker
                .deadlines
                .insert((expiry_ns, prefill.request.clone()));
            worker.grant_order.push_back(prefill.request.clone());
            generations.push(generation);
        }
        self.stats.granted += u64::from(p_tp);
        let transfer = Transfer {
            request: prefill.request,
            p,
            p_incarnation: self.p[p].incarnation,
            blocks: prefill.blocks,
            generations,
            content_seed,
        };
        self.trace(&[5, self.now, p as u64, d as u64]);
        self.trace_str(transfer.request.as_str());
        self.in_flight_transfers += 1;
        let at = self.now + nanos(self.config.transfer_delay);
        self.schedule(at, Ev::Transfer { d, transfer });
    }

    fn p_route(&mut self, p: usize, w: usize, local: Timestamp, from: Addr, bytes: &[u8]) {
        let local_ns = local.as_nanos_saturating();
        // The baseline (one fixed timeout) never extends.
        let extension = match self.config.mode {
            LeaseMode::Lease => nanos(self.lease.extension()),
            _ => 0,
        };
        let bug = self.config.bug;
        let worker = &mut self.p[p].workers[w];
        // The oracle's own reading of the message (the real codec).
        let mut expect = (0u32, 0u32, 0u32); // held, late, unknown
        let mut after_release = 0u64;
        match decode(bytes) {
            Ok(Notif::Heartbeat(ids)) => {
                for id in ids.iter() {
                    match worker.oracle.get_mut(id) {
                        Some(lease) if lease.expiry_ns > local_ns => {
                            expect.0 += 1;
                            lease.last_heartbeat_ns = Some(local_ns);
                            let renewed = local_ns + extension;
                            if renewed > lease.expiry_ns {
                                let key = (
                                    lease.expiry_ns,
                                    RequestId::new(id).unwrap_or_else(|_| unreachable_id()),
                                );
                                worker.deadlines.remove(&key);
                                lease.expiry_ns = renewed;
                                worker.deadlines.insert((renewed, key.1));
                            }
                        }
                        Some(_) => expect.1 += 1,
                        None => {
                            expect.2 += 1;
                            after_release += 1;
                        }
                    }
                }
            }
            Ok(Notif::ReadComplete(rc)) => {
                if let Some(lease) = worker.oracle.get_mut(&rc.request) {
                    lease.consumers.insert(rc.consumer.clone());
                }
            }
            Ok(Notif::Abort(a)) => {
                if let Some(lease) = worker.oracle.get_mut(&a.request) {
                    lease.aborted = true;
                }
            }
            _ => {}
        }
        if bug == Some(Bug::IgnoreHeartbeats) && bytes.starts_with(kvlease_notif::HEARTBEAT_PREFIX)
        {
            return;
        }
        let routed = worker.router.route(local, &from, bytes, &mut worker.table);
        match routed {
            Routed::Heartbeat { outcome, .. } => {
                self.stats.heartbeat_ids_unknown_or_late +=
                    u64::from(outcome.unknown + outcome.late);
                self.stats.heartbeats_after_release += after_release;
                if (outcome.held, outcome.late, outcome.unknown) != expect {
                    let msg = format!(
                        "P{p}/{w}: heartbeat outcome held/late/unknown = {}/{}/{}, oracle says {}/{}/{}",
                        outcome.held, outcome.late, outcome.unknown, expect.0, expect.1, expect.2
                    );
                    self.fail(msg);
                }
            }
            Routed::ReadComplete { .. } => self.stats.read_completions += 1,
            Routed::Rejected(e) => {
                let msg = format!("P{p}/{w}: own message rejected: {e}");
                self.fail(msg);
            }
            _ => {}
        }
    }

    fn reap(&mut self, p: usize, w: usize, local: Timestamp) {
        let worker = &mut self.p[p].workers[w];
        if self.config.bug == Some(Bug::GrantOrderReaper) {
            // The planted bug: oldest grant first, stop at the first live lease.
            while let Some(front) = worker.grant_order.front() {
                match worker.table.get(front) {
                    None => {
                        worker.grant_order.pop_front();
                    }
                    Some(info) if info.expiry <= local => {
                        let request = front.clone();
                        worker.table.abort(local, &request);
                        worker.grant_order.pop_front();
                    }
                    Some(_) => break,
                }
            }
            return;
        }
        if worker.table.poll_timeout().is_some_and(|t| t <= local) {
            worker.table.handle_timeout(local);
        }
        // Forget grant order entries of released leases now and then (bounded memory).
        while worker
            .grant_order
            .front()
            .is_some_and(|r| !worker.oracle.contains_key(r))
        {
            worker.grant_order.pop_front();
        }
    }

    fn drain_events(&mut self, p: usize, w: usize, local_ns: u64) {
        let mut notices = Vec::new();
        while let Some(event) = self.p[p].workers[w].table.poll_event() {
            let Event::Released(released) = event else {
                continue;
            };
            self.check_release(p, w, local_ns, &released);
            if let Some(notice) = PrefillRouter::<Addr>::expiry_notice(&released) {
                notices.push(notice);
            }
            let worker = &mut self.p[p].workers[w];
            for b in &released.blocks {
                // Poison: the fence word says "free" and the content is garbage.
                worker.pool.words[b.0 as usize] = Generation::FREE_WORD;
                worker.pool.content[b.0 as usize] = POISON;
                worker.pool.free.push_back(b.0);
            }
            let reason = match released.reason {
                ReleaseReason::Completed => 1,
                ReleaseReason::Expired => 2,
                _ => 3,
            };
            self.trace(&[9, self.now, p as u64, w as u64, reason]);
            self.trace_str(released.request.as_str());
        }
        if notices.is_empty() {
            return;
        }
        let since = Timestamp::from_nanos(local_ns.saturating_sub(nanos(self.lease.extension())));
        let max_len = self.config.heartbeat_max_len;
        let messages = match encode_expired(&notices, max_len) {
            Ok(m) => m,
            Err(e) => {
                self.fail(format!("encode_expired: {e}"));
                return;
            }
        };
        let peers: Vec<Addr> = self.p[p].workers[w]
            .router
            .recent_heartbeat_peers(since)
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // `w` indexes the workers, so it fits u32.
        let from = Addr::P {
            engine: p,
            worker: w as u32,
        };
        for to in peers {
            for m in &messages {
                self.stats.expiry_notices += 1;
                self.send(from, to, m.clone());
            }
        }
    }

    /// The checker's view of a release: was it allowed, and was it on time?
    fn check_release(&mut self, p: usize, w: usize, local_ns: u64, released: &Released) {
        let step_max = self.p_step_max_ns();
        let worker = &mut self.p[p].workers[w];
        let Some(lease) = worker.oracle.remove(&released.request) else {
            let msg = format!(
                "P{p}/{w}: released {} which the oracle does not hold",
                released.request
            );
            self.fail(msg);
            return;
        };
        worker
            .deadlines
            .remove(&(lease.expiry_ns, released.request.clone()));
        if lease.generation != released.generation {
            let msg = format!(
                "P{p}/{w}: {} released with a wrong generation",
                released.request
            );
            self.fail(msg);
        }
        let completed = lease.consumers.len() as u64 >= u64::from(lease.expected_consumers);
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
                "P{p}/{w}: {} freed as completed after {} of {} consumers reported",
                released.request,
                lease.consumers.len(),
                lease.expected_consumers
            );
            self.fail(msg);
        }
        if !legit_early {
            //= docs/spec.md#tracking
            //# Expire (P): blocks whose lease passed are reclaimed.
            if local_ns < lease.expiry_ns {
                let msg = format!(
                    "P{p}/{w}: {} freed ({what}) {} before its expiry, neither completed nor aborted",
                    released.request,
                    fmt_ns(lease.expiry_ns - local_ns)
                );
                self.fail(msg);
            } else if local_ns > lease.expiry_ns + step_max {
                let msg = format!(
                    "P{p}/{w}: {} reclaimed late ({what}): {} after its expiry (limit one step, {})",
                    released.request,
                    fmt_ns(local_ns - lease.expiry_ns),
                    fmt_ns(step_max)
                );
                self.fail(msg);
            }
        }
        if released.reason == ReleaseReason::Expired || !legit_early {
            self.check_expiry_rules(p, w, local_ns, &lease, released);
        }
    }

    fn check_expiry_rules(
        &mut self,
        p: usize,
        w: usize,
        local_ns: u64,
        lease: &OracleLease,
        released: &Released,
    ) {
        let Some(d) = lease.d_engine else { return };
        if self.config.expect_no_expiry_while_tracked
            && self.d[d].alive
            && self.tracked_by.get(&released.request) == Some(&d)
        {
            let msg = format!(
                "P{p}/{w}: {} expired while D{d} is alive and tracks it (last heartbeat {})",
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
        if self.tracked_by.get(&released.request) != Some(&d) || self.d[d].alive {
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
                    "P{p}/{w}: {} reclaimed {} after its last heartbeat, before the extension {}",
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
        // A lease younger than the crash bound runs at least its initial duration.
        let duration = nanos(self.config.lease);
        let initial_end = lease.granted_true_ns + duration + duration / 1000 + self.p_step_max_ns();
        let limit = (crashed_at + bound).max(initial_end);
        if self.now > limit {
            let msg = format!(
                "P{p}/{w}: {} reclaimed {} after D{d} crashed; bound: extension + interval + steps + network = {}",
                released.request,
                fmt_ns(self.now - crashed_at),
                fmt_ns(bound)
            );
            self.fail(msg);
        }
    }

    /// Every lease past its expiry by more than one step must be gone.
    fn check_overdue(&mut self, p: usize, w: usize, local_ns: u64) {
        let step_max = self.p_step_max_ns();
        let worker = &self.p[p].workers[w];
        if let Some((expiry, request)) = worker.deadlines.first() {
            let lease = worker.oracle.get(request);
            let exempt = lease.is_some_and(|l| {
                l.aborted || l.consumers.len() as u64 >= u64::from(l.expected_consumers)
            });
            if !exempt && local_ns > expiry + step_max {
                let key = (*expiry, request.clone());
                let msg = format!(
                    "P{p}/{w}: {} not reclaimed {} after its expiry",
                    key.1,
                    fmt_ns(local_ns - key.0)
                );
                self.fail(msg);
                // Report it once.
                self.p[p].workers[w].deadlines.remove(&key);
            }
        }
    }

    fn crash_p(&mut self, p: usize, restart_after: Option<Duration>) {
        let engine = &mut self.p[p];
        if !engine.alive {
            return;
        }
        engine.alive = false;
        // Its leases, pools and in-flight prefills vanish with it.
        engine.workers.clear();
        engine.prefilling.clear();
        self.trace(&[7, self.now, p as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartP { p });
        }
    }

    // ---- D ------------------------------------------------------------------------------

    fn arrive_at_d(&mut self, d: usize, transfer: Transfer) {
        let engine = &mut self.d[d];
        if !engine.alive {
            self.stats.lost_with_d += 1;
            return;
        }
        let local = engine.clock.local(self.now);
        let p_id = self.p[transfer.p].id.clone();
        let mut errors = Vec::new();
        for rank in &mut engine.ranks {
            //= docs/spec.md#tracking
            //# heartbeating starts when a request with `do_remote_prefill=true` enters
            //# D's scheduler (`on_new_request`), not when it is scheduled
            if let Err(e) = rank.tracker.track(
                local,
                transfer.request.clone(),
                p_id.clone(),
                self.config.p_tp,
            ) {
                errors.push(format!("D{d}: track failed: {e}"));
            }
        }
        for e in errors {
            self.fail(e);
        }
        self.tracked_by.insert(transfer.request.clone(), d);
        self.trace(&[10, self.now, d as u64]);
        self.trace_str(transfer.request.as_str());
        self.d[d].waiting.push_back((transfer, self.now));
    }

    fn untrack(&mut self, d: usize, request: &RequestId) {
        for rank in &mut self.d[d].ranks {
            rank.tracker.untrack(request);
        }
        if self.tracked_by.get(request) == Some(&d) {
            self.tracked_by.remove(request);
        }
    }

    fn d_step(&mut self, d: usize) {
        let local = self.d[d].clock.local(self.now);
        // 1. Notifications: expiry notices.
        for r in 0..self.d[d].ranks.len() {
            let inbox = std::mem::take(&mut self.d[d].ranks[r].inbox);
            for bytes in inbox {
                let rank = &mut self.d[d].ranks[r];
                match rank.router.route(&bytes, &mut rank.tracker) {
                    DecodeRouted::Expired { leases, .. } => {
                        for lease in leases {
                            self.d[d].lost.insert(lease.request);
                        }
                    }
                    DecodeRouted::Rejected(e) => {
                        self.fail(format!("D{d}: own message rejected: {e}"))
                    }
                    _ => {}
                }
            }
        }
        // 2. Reads that finished, decodes that finished.
        let mut i = 0;
        while i < self.d[d].running.len() {
            let run = &self.d[d].running[i];
            if !run.read_finished && run.read_done_at <= self.now {
                let transfer = run.transfer.clone();
                self.finish_read(d, &transfer);
                self.d[d].running[i].read_finished = true;
            }
            let run = &self.d[d].running[i];
            if run.read_finished && run.done_at <= self.now {
                self.d[d].running.swap_remove(i);
            } else {
                i += 1;
            }
        }
        // 3. Client aborts.
        if !self.d[d].waiting.is_empty()
            && self.rng.chance(self.config.client_abort_per_million)
            && let Some((transfer, _)) = self.d[d].waiting.pop_front()
        {
            self.stats.client_aborts += 1;
            self.untrack(d, &transfer.request);
            self.send_abort(d, &transfer);
        }
        // 4. Admission into free slots.
        while self.d[d].running.len() < self.config.d_slots {
            let Some((transfer, arrived)) = self.d[d].waiting.pop_front() else {
                break;
            };
            let waited = Duration::from_nanos(self.now - arrived);
            self.stats.max_queue_wait = self.stats.max_queue_wait.max(waited);
            let decode = self
                .rng
                .range(nanos(self.config.decode.0), nanos(self.config.decode.1));
            if self.d[d].lost.remove(&transfer.request) {
                // P said it reclaimed the lease: recompute instead of reading.
                self.stats.recomputed_after_notice += 1;
                self.untrack(d, &transfer.request);
                self.d[d].running.push(Running {
                    transfer,
                    read_done_at: self.now,
                    read_finished: true,
                    done_at: self.now + decode,
                });
                continue;
            }
            let read_done_at = self.now + nanos(self.config.read);
            self.d[d].running.push(Running {
                transfer,
                read_done_at,
                read_finished: false,
                done_at: read_done_at + decode,
            });
        }
        // 5. Heartbeats, one batch per engine and interval, to every P worker.
        for r in 0..self.d[d].ranks.len() {
            while let Some(batch) = self.d[d].ranks[r].tracker.poll_heartbeat(local) {
                let Some(p) = self.p.iter().position(|p| p.id == batch.engine) else {
                    self.fail(format!(
                        "D{d}: heartbeat batch for unknown engine {}",
                        batch.engine
                    ));
                    continue;
                };
                //= docs/spec.md#preemptive-handshake
                //# if D must heartbeat a P engine it has not handshaken with yet
                //# (common for queued requests),
                //# it starts the handshake off the engine thread and sends the heartbeat on a later step.
                let retry =
                    Timestamp::from_nanos(local.as_nanos_saturating() + nanos(self.config.d_step));
                match self.d[d].handshakes.get(&p) {
                    Some(&done) if done <= self.now => {}
                    pending => {
                        if pending.is_none() {
                            let done = self.now + nanos(self.config.handshake);
                            self.d[d].handshakes.insert(p, done);
                            self.stats.handshakes += 1;
                        }
                        self.stats.deferred_batches += 1;
                        let engine = batch.engine;
                        if !self.d[d].ranks[r].tracker.defer(&engine, retry) {
                            self.fail(format!("D{d}/{r}: defer of tracked engine {engine} failed"));
                        }
                        continue;
                    }
                }
                // At most one batch per (engine, P worker) and interval.
                let key = (d, self.d[d].incarnation, r, p);
                let local_ns = local.as_nanos_saturating();
                if let Some(last) = self.last_batch.insert(key, local_ns)
                    && local_ns - last < nanos(self.lease.interval())
                {
                    self.fail(format!(
                        "D{d}/{r}: two batches for P{p} {} apart, within one interval",
                        fmt_ns(local_ns - last)
                    ));
                }
                let messages =
                    match encode_heartbeats(&batch.requests, self.config.heartbeat_max_len) {
                        Ok(m) => m,
                        Err(e) => {
                            self.fail(format!("encode_heartbeats: {e}"));
                            continue;
                        }
                    };
                // `r` indexes the ranks, so it fits u32.
                let from = Addr::D {
                    engine: d,
                    rank: r as u32,
                };
                for worker in 0..batch.workers {
                    for m in &messages {
                        self.stats.heartbeat_messages += 1;
                        self.send(from, Addr::P { engine: p, worker }, m.clone());
                    }
                }
            }
        }
    }

    /// The one-sided read, checked after the fact like a fenced read: every block's fence
    /// word must still be the granted generation and its content the request's.
    fn finish_read(&mut self, d: usize, transfer: &Transfer) {
        let p = transfer.p;
        let request = &transfer.request;
        self.untrack(d, request);
        let engine = &self.p[p];
        if !engine.alive || engine.incarnation != transfer.p_incarnation {
            self.stats.failed_reads += 1;
            self.trace(&[11, self.now, d as u64]);
            return;
        }
        let local_ns = engine.clock.local(self.now).as_nanos_saturating();
        let mut stale = false;
        let mut failures = Vec::new();
        for (w, blocks) in transfer.blocks.iter().enumerate() {
            let worker = &engine.workers[w];
            let generation = transfer.generations[w];
            for (i, b) in blocks.iter().enumerate() {
                let word = worker.pool.words[b.0 as usize];
                let content = worker.pool.content[b.0 as usize];
                // `w` indexes the workers, so it fits u32.
                let want = block_content(transfer.content_seed, w as u32, i);
                if word != generation.word() {
                    stale = true;
                    if let Some(lease) = worker.oracle.get(request)
                        && lease.expiry_ns > local_ns
                        && !lease.aborted
                    {
                        failures.push(format!(
                            "D{d}: read of {request} block {} found generation {word} \
                             under a live lease of generation {}",
                            b.0,
                            generation.word()
                        ));
                    }
                } else if content != want {
                    failures.push(format!(
                        "D{d}: read of {request} block {} got {} content under its matching generation",
                        b.0,
                        if content == POISON { "poisoned" } else { "foreign" }
                    ));
                }
            }
        }
        for f in failures {
            self.fail(f);
        }
        if stale {
            // Fenced read detected a released lease: recompute, and tell P to free whatever
            // it may still hold.
            self.stats.stale_reads += 1;
            self.send_abort(d, transfer);
            self.trace(&[12, self.now, d as u64]);
            return;
        }
        self.stats.reads_ok += 1;
        self.trace(&[13, self.now, d as u64]);
        let p_tp = self.config.p_tp;
        let d_tp = self.config.d_tp;
        let total = if self.config.bug == Some(Bug::UnderreportConsumers) {
            1
        } else {
            (d_tp / p_tp).max(1)
        };
        for rank in 0..d_tp {
            let workers: Vec<u32> = if p_tp >= d_tp {
                let k = p_tp / d_tp;
                (rank * k..(rank + 1) * k).collect()
            } else {
                vec![rank / (d_tp / p_tp)]
            };
            let rc = ReadComplete {
                request: request.clone(),
                consumer: ConsumerId::new(self.d[d].id.clone(), rank),
                consumers_total: total,
            };
            let bytes = rc.encode();
            for worker in workers {
                self.send(
                    Addr::D { engine: d, rank },
                    Addr::P { engine: p, worker },
                    bytes.clone(),
                );
            }
        }
    }

    fn send_abort(&mut self, d: usize, transfer: &Transfer) {
        let abort = Abort {
            request: transfer.request.clone(),
            consumer: ConsumerId::new(self.d[d].id.clone(), 0),
        };
        let bytes = abort.encode();
        for worker in 0..self.config.p_tp {
            self.send(
                Addr::D { engine: d, rank: 0 },
                Addr::P {
                    engine: transfer.p,
                    worker,
                },
                bytes.clone(),
            );
        }
    }

    fn crash_d(&mut self, d: usize, restart_after: Option<Duration>) {
        let engine = &mut self.d[d];
        if !engine.alive {
            return;
        }
        engine.alive = false;
        self.stats.lost_with_d += (engine.waiting.len() + engine.running.len()) as u64;
        // Its trackers, queue and slots vanish; it sends nothing more.
        engine.waiting.clear();
        engine.running.clear();
        engine.lost.clear();
        engine.handshakes.clear();
        for rank in &mut engine.ranks {
            rank.inbox.clear();
        }
        self.d_crashed_at[d] = Some(self.now);
        self.trace(&[14, self.now, d as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartD { d });
        }
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
