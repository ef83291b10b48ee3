//! What a world looks like: sizes, timings, faults. [`WorldConfig::random`] draws one
//! from a seed; the named constructors build the scenarios of the test suite.

use std::time::Duration;

use kvlease_lease::LeaseMode;

use crate::rng::Rng;

/// A deliberate bug planted in a shell (the code around the engine cores that the agents
/// and the simulator each write), to prove that the checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// The P shell drops heartbeats instead of feeding them to its core (no extension).
    IgnoreHeartbeats,
    /// The P shell never calls the core's reaper; it walks its leases in grant order and
    /// stops at the first live one (vLLM #58222), aborting the expired ones it reaches.
    GrantOrderReaper,
    /// The D shell rewrites each read completion to `consumers_total = 1` whatever the TP
    /// ratio, so P frees after the first of several consumers.
    UnderreportConsumers,
    /// The P shell drains `ClearFences` but publishes neither the free word nor poison:
    /// a reused block keeps the old generation while the next prefill writes it.
    SkipFenceClear,
    /// The D shell reports every read that reached P as done, whatever its fence word.
    IgnoreFence,
    /// The D shell never calls `forget_engine` and answers every handshake from a cache of
    /// its first connection to that engine: a restarted P stays "connected" through a
    /// dead connection.
    NeverForget,
    /// The P shell drops the core's `Refused` events (the client is never answered).
    DropRefusals,
    /// The D shell drops the read results of a request aborted while its reads ran (its
    /// blocks are never given back).
    SkipAbortedReads,
    /// Bidirectional mode: P's pull of a cached turn reports every read that reached D as
    /// done, whatever D's fence word (a reader that ignores the fence).
    PullIgnoresFence,
    /// Bidirectional mode: the D shell drops P's read completions of cached turns instead
    /// of handing them to its core (they stay held until their TTL).
    KeepHoldAfterRead,
    /// Bidirectional mode: the D shell never runs its core's timer (`handle_timeout`:
    /// cached turns stay held past their TTL until read).
    NoHoldExpiry,
    /// Bidirectional mode: the D shell skips publishing the free word and poison of a
    /// cached turn its core released (a pull of a reused block still matches).
    SkipHoldFenceClear,
    /// Bidirectional mode: a restarted D starts its held turns' generations where its
    /// first incarnation did (a pull with the earlier incarnation's params can match a
    /// turn held now on the same blocks).
    HoldGenerationsRepeat,
}

/// Bidirectional multi-turn mode in the main world ([`WorldConfig::bidir`]): every request
/// starts a conversation; when a turn finishes on D, D's core keeps its blocks
/// (`DecodeCore::request_finished_hold`) and D answers its
/// [`DecoderKvParams`](kvlease_engine::DecoderKvParams); the conversation's next turn
/// arrives at a P engine after a think time, and P decides with
/// [`plan_pull`](kvlease_engine::plan_pull) whether to read the shared prefix from D's
/// held blocks (fenced by the hold's generation) or to recompute it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BidirSim {
    /// `decoder_kv_blocks_ttl`.
    pub ttl: Duration,
    /// The symmetric lease: P heartbeats a cached turn while its next turn waits on P, and
    /// D extends the hold like a lease.
    pub symmetric: bool,
    /// Turns per conversation, uniform in this range (the first turn included).
    pub turns: (u32, u32),
    /// The client's think time between a turn's answer and its next turn's arrival at P,
    /// uniform in this range (drawn around the TTL, so that P's decisions fall near the
    /// deadline).
    pub think: (Duration, Duration),
    /// Blocks of each D engine's pool (small: new requests evict held turns).
    pub d_blocks: u32,
    /// Time of P's one-sided read of D's held blocks (also P's expected transfer time).
    pub pull_read: Duration,
    /// `pull_safety_margin`.
    pub safety_margin: Duration,
    /// `kv_recompute_threshold`, in tokens.
    pub threshold_tokens: u32,
    /// Probability per next turn that its prompt does not extend the last one (the client
    /// rewrote the history: no common block, P recomputes), per million.
    pub rewrite_per_million: u32,
}

/// The notification network between every pair of endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// Smallest one-way delay.
    pub delay: Duration,
    /// Extra delay, uniform in `0..=jitter` per message (this is what reorders).
    pub jitter: Duration,
    /// Probability that a message is lost, per million.
    pub loss_per_million: u32,
    /// When set, a link never loses more than this many messages in a row.
    pub max_consecutive_losses: Option<u32>,
    /// Probability that a message is delivered twice, per million.
    pub duplicate_per_million: u32,
}

/// A crash of one engine at a time (and, optionally, its restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    /// Which engine (index among the P or D engines).
    pub engine: usize,
    /// When, in virtual time since the start.
    pub at: Duration,
    /// When it comes back, counted from the crash; `None`: never.
    pub restart_after: Option<Duration>,
}

/// An engine that takes no steps and handles no messages during `[at, at + duration)`:
/// its messages, arrivals and handshake results queue up, then it resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    /// Which engine (index among the P or D engines).
    pub engine: usize,
    /// When, in virtual time since the start.
    pub at: Duration,
    /// How long.
    pub duration: Duration,
}

/// A network partition between one D engine and one P engine: every message between
/// them, both ways, is dropped during `[at, at + duration)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    /// The D engine.
    pub d: usize,
    /// The P engine.
    pub p: usize,
    /// Start, in virtual time since the start.
    pub at: Duration,
    /// How long it lasts.
    pub duration: Duration,
}

/// Everything that defines a world. The same config gives the same run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldConfig {
    /// Seed of every random choice during the run.
    pub seed: u64,
    /// `kv_lease_duration`.
    pub lease: Duration,
    /// Number of P engines.
    pub p_engines: usize,
    /// Workers (TP ranks) per P engine; each holds its own block pool (fence and content
    /// words), every worker the same block ids.
    pub p_tp: u32,
    /// Blocks in each P worker's pool.
    pub blocks_per_worker: u32,
    /// Number of D engines.
    pub d_engines: usize,
    /// Workers (TP ranks) per D engine; every (D worker, P worker) pair whose heads
    /// overlap reads one batch and is one consumer of the lease.
    pub d_tp: u32,
    /// Requests a D engine reads and decodes at once (its running slots).
    pub d_slots: usize,
    /// Forward-loop step of a P engine (true time; jitter added).
    pub p_step: Duration,
    /// Forward-loop step of a D engine.
    pub d_step: Duration,
    /// Extra step length, uniform in `0..=step_jitter`.
    pub step_jitter: Duration,
    /// Prefill time of a request on P.
    pub prefill: Duration,
    /// Time of the one-sided read on D.
    pub read: Duration,
    /// Decode time, uniform in this range, during which the slot stays busy.
    pub decode: (Duration, Duration),
    /// Requests that arrive at the P engines.
    pub requests: usize,
    /// Mean gap between arrivals (exponential-ish: uniform in `0..=2×gap`).
    pub arrival_gap: Duration,
    /// Blocks per request and worker, uniform in this range.
    pub blocks_per_request: (u32, u32),
    /// Delay from P's grant to the request's arrival at D (router and proxy).
    pub transfer_delay: Duration,
    /// Time of D's handshake with a P engine it has not met (its heartbeats wait for it),
    /// and the time D takes to notice that a connection broke (P crashed).
    pub handshake: Duration,
    /// The notification network.
    pub net: NetConfig,
    /// Largest per-engine clock offset from true time.
    pub clock_offset_max: Duration,
    /// Largest clock drift, in parts per million (either sign).
    pub drift_ppm_max: u32,
    /// Crashes of D engines.
    pub d_crashes: Vec<Crash>,
    /// Crashes of P engines.
    pub p_crashes: Vec<Crash>,
    /// Partitions between a D and a P engine.
    pub partitions: Vec<Partition>,
    /// Stalls of P engines (longer than the lease in the random worlds).
    pub p_stalls: Vec<Stall>,
    /// Stalls of D engines.
    pub d_stalls: Vec<Stall>,
    /// Mean gap between forged notifications from a rogue endpoint (heartbeats, read
    /// completions and aborts for real request ids to P, expiry notices to D); `None`: no
    /// rogue.
    pub forged_gap: Option<Duration>,
    /// Probability per D step that the client aborts one of D's requests, per million.
    pub client_abort_per_million: u32,
    /// Check that no lease expires while its D engine is alive and tracks it.
    pub expect_no_expiry_while_tracked: bool,
    /// Whether a D notices that its connection to a crashed P broke (a `handshake` time
    /// after the crash) and forgets the engine. Without it, D learns of the restart from a
    /// failed read or send, or from a check of P's instance that a request naming a newer
    /// one started.
    pub notice_lost_connections: bool,
    /// A deliberate bug, for the checker's own tests.
    pub bug: Option<Bug>,
    /// [`LeaseMode::Lease`] (heartbeats extend), or [`LeaseMode::Fixed`]: the baseline of
    /// one fixed timeout (`lease`), which heartbeats do not extend.
    pub mode: LeaseMode,
    /// Bidirectional multi-turn mode; `None`: every request is a single turn.
    pub bidir: Option<BidirSim>,
}

const MS: u64 = 1_000_000;

fn nanos_of(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl WorldConfig {
    /// A world drawn from `seed`: sizes, timings, network faults, clock skew and drift,
    /// and sometimes D and P crashes. Small enough that 256 seeds run in well under a
    /// minute in a debug build.
    pub fn random(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x5eed_c0f1_9000_0000);
        let lease = Duration::from_nanos(rng.range(1_200 * MS, 3_000 * MS));
        let tps = [1u32, 2, 4];
        let p_tp = tps[rng.index(3)];
        let d_tp = tps[rng.index(2)];
        let p_engines = 1 + rng.index(2);
        let d_engines = 1 + rng.index(3);
        let requests = 20 + rng.index(40);
        let arrival_gap = ms(rng.range(20, 150));
        let span = arrival_gap.as_nanos() as u64 * requests as u64;
        let mut d_crashes = Vec::new();
        if rng.chance(350_000) {
            d_crashes.push(Crash {
                engine: rng.index(d_engines),
                at: Duration::from_nanos(rng.range(span / 4, span)),
                restart_after: rng
                    .chance(500_000)
                    .then(|| Duration::from_nanos(rng.range(100 * MS, 2_000 * MS))),
            });
        }
        let mut p_crashes = Vec::new();
        if rng.chance(150_000) {
            p_crashes.push(Crash {
                engine: rng.index(p_engines),
                at: Duration::from_nanos(rng.range(span / 4, span)),
                restart_after: rng
                    .chance(700_000)
                    .then(|| Duration::from_nanos(rng.range(100 * MS, 1_000 * MS))),
            });
        }
        let mut partitions = Vec::new();
        if rng.chance(200_000) {
            partitions.push(Partition {
                d: rng.index(d_engines),
                p: rng.index(p_engines),
                at: Duration::from_nanos(rng.range(0, span)),
                duration: Duration::from_nanos(rng.range(nanos_of(lease) / 4, nanos_of(lease) * 2)),
            });
        }
        let stall = |rng: &mut Rng, engines: usize| Stall {
            engine: rng.index(engines),
            at: Duration::from_nanos(rng.range(0, span)),
            duration: Duration::from_nanos(
                rng.range(nanos_of(lease) * 6 / 5, nanos_of(lease) * 5 / 2),
            ),
        };
        let mut p_stalls = Vec::new();
        if rng.chance(150_000) {
            p_stalls.push(stall(&mut rng, p_engines));
        }
        let mut d_stalls = Vec::new();
        if rng.chance(150_000) {
            d_stalls.push(stall(&mut rng, d_engines));
        }
        let forged_gap = rng.chance(300_000).then(|| ms(rng.range(20, 200)));
        let loss = [0, 0, 10_000, 50_000, 200_000][rng.index(5)];
        Self {
            seed,
            lease,
            p_engines,
            p_tp,
            blocks_per_worker: 64 + rng.range(0, 192) as u32,
            d_engines,
            d_tp,
            d_slots: 1 + rng.index(4),
            p_step: ms(rng.range(5, 20)),
            d_step: ms(rng.range(5, 20)),
            step_jitter: ms(rng.range(0, 5)),
            prefill: ms(rng.range(5, 50)),
            read: ms(rng.range(1, 20)),
            decode: (ms(10), ms(rng.range(20, 600))),
            requests,
            arrival_gap,
            blocks_per_request: (1, 1 + rng.range(0, 7) as u32),
            transfer_delay: ms(rng.range(1, 30)),
            handshake: ms(rng.range(1, 100)),
            net: NetConfig {
                delay: Duration::from_micros(rng.range(50, 2_000)),
                jitter: Duration::from_micros(rng.range(0, 30_000)),
                loss_per_million: loss,
                max_consecutive_losses: None,
                duplicate_per_million: [0, 10_000, 50_000][rng.index(3)],
            },
            clock_offset_max: Duration::from_secs(10),
            drift_ppm_max: 200,
            d_crashes,
            p_crashes,
            partitions,
            p_stalls,
            d_stalls,
            forged_gap,
            client_abort_per_million: [0, 2_000, 10_000][rng.index(3)],
            expect_no_expiry_while_tracked: false,
            notice_lost_connections: rng.chance(500_000),
            bug: None,
            mode: LeaseMode::Lease,
            bidir: None,
        }
    }

    /// The random world of `seed` in bidirectional multi-turn mode (every fault of
    /// [`WorldConfig::random`] applies): fewer, multi-turn conversations, a D pool small
    /// enough that new requests evict held turns, think times around the TTL, and,
    /// for some seeds, the symmetric lease.
    pub fn bidir(seed: u64) -> Self {
        let mut c = Self::random(seed);
        // A stream of its own: the random world's draws stay those of `random`.
        let mut rng = Rng::new(seed ^ 0xb1d1_7e57_0000_0000);
        c.requests = 8 + rng.index(16);
        // At least one whole block in a first turn: something to pull.
        c.blocks_per_request = (2, 2 + rng.range(0, 2) as u32);
        let turns = (2, 2 + rng.range(0, 2) as u32);
        // A prompt grows by at most two blocks a turn.
        let max_blocks = c.blocks_per_request.1 + 2 * turns.1;
        let ttl = Duration::from_nanos(rng.range(1_200 * MS, 2_500 * MS));
        let d_slots = c.d_slots as u32;
        c.bidir = Some(BidirSim {
            ttl,
            symmetric: rng.chance(500_000),
            turns,
            think: (ttl / 2, ttl * 3 / 2),
            d_blocks: max_blocks * d_slots + rng.range(0, u64::from(2 * max_blocks)) as u32,
            pull_read: ms(rng.range(5, 60)),
            safety_margin: ms(rng.range(0, 50)),
            threshold_tokens: [0, 16, 32][rng.index(3)],
            rewrite_per_million: 100_000,
        });
        c
    }

    /// D alive and overloaded: one slot, long decodes, so requests wait at least 10 lease
    /// durations in D's queue; the network loses heartbeats but never more than 2 in a row.
    /// No lease may expire while D tracks it.
    pub fn overloaded(seed: u64) -> Self {
        let mut c = Self::random(seed);
        c.lease = ms(1_500);
        c.p_engines = 1;
        c.d_engines = 1;
        c.d_slots = 1;
        c.requests = 24;
        c.arrival_gap = ms(20);
        c.decode = (ms(1_200), ms(1_600));
        c.net.loss_per_million = 300_000;
        c.net.max_consecutive_losses = Some(2);
        c.d_crashes.clear();
        c.p_crashes.clear();
        c.partitions.clear();
        c.p_stalls.clear();
        c.d_stalls.clear();
        c.forged_gap = None;
        c.client_abort_per_million = 0;
        c.blocks_per_worker = 256;
        c.expect_no_expiry_while_tracked = true;
        c
    }

    /// One D engine crashes for good while it tracks requests; the others go on.
    pub fn d_crash(seed: u64) -> Self {
        let mut c = Self::random(seed);
        c.d_engines = 2;
        c.d_slots = 1;
        c.requests = 30;
        c.arrival_gap = ms(30);
        c.decode = (ms(400), ms(800));
        // Late enough that the queued requests' expiries were set by heartbeats (more than
        // a third of a lease after their grant), early enough that D0 still queues many.
        c.d_crashes = vec![Crash {
            engine: 0,
            at: c.lease * 2,
            restart_after: None,
        }];
        c.p_crashes.clear();
        c.p_stalls.clear();
        c.d_stalls.clear();
        c.partitions.clear();
        c.forged_gap = None;
        c
    }

    /// Heterogeneous TP: P with `p_tp` workers, D with `d_tp` ranks.
    pub fn hetero_tp(seed: u64, p_tp: u32, d_tp: u32) -> Self {
        let mut c = Self::random(seed);
        c.p_tp = p_tp;
        c.d_tp = d_tp;
        c.d_crashes.clear();
        c.p_crashes.clear();
        c
    }

    /// Completions race late heartbeats: a slow, duplicating, reordering network.
    pub fn late_heartbeats(seed: u64) -> Self {
        let mut c = Self::random(seed);
        c.net.delay = ms(5);
        c.net.jitter = ms(200);
        c.net.duplicate_per_million = 300_000;
        c.net.loss_per_million = 0;
        c.d_slots = 4;
        c.read = ms(1);
        c.d_crashes.clear();
        c.p_crashes.clear();
        c
    }

    /// One P engine crashes and restarts under the same engine id while requests keep
    /// arriving: D must notice the lost connection, handshake again, and the first request
    /// routed to it after restart + handshake + lease duration must complete.
    pub fn p_restart(seed: u64) -> Self {
        let mut c = Self::random(seed);
        c.lease = ms(1_500);
        c.p_engines = 1 + (seed % 2) as usize;
        c.requests = 100;
        c.arrival_gap = ms(40);
        c.decode = (ms(10), ms(200));
        c.p_crashes = vec![Crash {
            engine: 0,
            at: ms(800 + (seed % 7) * 100),
            restart_after: Some(ms(200 + (seed % 5) * 100)),
        }];
        c.d_crashes.clear();
        c.partitions.clear();
        c.p_stalls.clear();
        c.d_stalls.clear();
        c.net.loss_per_million = 0;
        c.client_abort_per_million = 0;
        c.forged_gap = None;
        c.notice_lost_connections = (seed / 2).is_multiple_of(2);
        c
    }

    /// Blocks change hands fast while readers fall behind: a small P pool, long prefills
    /// (a reused block is written long before its new generation is published), D
    /// overloaded under the fixed-timeout baseline, a lossy network (expiry notices lost,
    /// so D reads released blocks), a rogue, and frequent client aborts.
    pub fn churn(seed: u64) -> Self {
        let mut c = Self::random(seed);
        c.mode = LeaseMode::Fixed;
        c.lease = ms(1_200);
        c.p_engines = 1;
        c.d_engines = 1;
        c.d_slots = 1;
        c.blocks_per_worker = 64;
        c.blocks_per_request = (1, 4);
        c.prefill = ms(300);
        c.read = ms(40);
        c.requests = 120;
        c.arrival_gap = ms(25);
        c.decode = (ms(400), ms(800));
        c.net.loss_per_million = 400_000;
        c.net.max_consecutive_losses = None;
        c.client_abort_per_million = 30_000;
        c.forged_gap = Some(ms(30));
        c.d_crashes.clear();
        c.p_crashes.clear();
        c.partitions.clear();
        c.p_stalls.clear();
        c.d_stalls.clear();
        c
    }

    /// The scale world of `examples/scale.rs`: 256 P engines (TP 2) and 1,024 D engines
    /// (TP 2), the production lease (30 s: heartbeats every 5 s), `requests` arrivals over
    /// the first 30 s, and D engines that each decode one request for longer than the run,
    /// so every other request stays tracked (heartbeated) for the rest of it. No faults.
    pub fn scale(seed: u64, requests: usize) -> Self {
        let mut c = Self::random(seed);
        c.lease = Duration::from_secs(30);
        c.p_engines = 256;
        c.p_tp = 2;
        c.d_engines = 1024;
        c.d_tp = 2;
        c.d_slots = 1;
        c.blocks_per_worker = 8192;
        c.blocks_per_request = (1, 4);
        c.p_step = ms(10);
        c.d_step = ms(10);
        c.step_jitter = ms(1);
        c.prefill = ms(20);
        c.read = ms(5);
        c.decode = (Duration::from_secs(600), Duration::from_secs(600));
        c.requests = requests;
        c.arrival_gap = Duration::from_nanos(15_000_000_000 / requests.max(1) as u64);
        c.transfer_delay = ms(5);
        c.handshake = ms(20);
        c.net = NetConfig {
            delay: Duration::from_micros(200),
            jitter: Duration::from_micros(500),
            loss_per_million: 0,
            max_consecutive_losses: None,
            duplicate_per_million: 0,
        };
        c.d_crashes.clear();
        c.p_crashes.clear();
        c.partitions.clear();
        c.p_stalls.clear();
        c.d_stalls.clear();
        c.forged_gap = None;
        c.client_abort_per_million = 0;
        c
    }

    /// The same world with the single-timeout baseline of `timeout` instead of leases.
    #[must_use]
    pub fn with_fixed_timeout(mut self, timeout: Duration) -> Self {
        self.mode = LeaseMode::Fixed;
        self.lease = timeout;
        self.expect_no_expiry_while_tracked = false;
        self
    }

    /// The same world with `bug` planted.
    #[must_use]
    pub fn with_bug(mut self, bug: Bug) -> Self {
        self.bug = Some(bug);
        self
    }
}
