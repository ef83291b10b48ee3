//! Deterministic simulation of many prefill (P) and decode (D) engines on virtual time,
//! driving the real `kvlease-lease` state machines ([`LeaseTable`](kvlease_lease::LeaseTable),
//! [`HeartbeatTracker`](kvlease_lease::HeartbeatTracker)) through the real `kvlease-notif`
//! codec and routers. Nothing of the lease rules is reimplemented to drive the world; the
//! checker keeps its own small reference model (the oracle) only to judge the outcome.
//!
//! # World model
//! - **P engines**, each with `p_tp` workers. A worker has its own lease table, router and
//!   block pool: every block has a fence word (the generation of the lease that holds it,
//!   `0` when free) and a content word. Requests arrive at random P engines, get blocks on
//!   every worker (or are turned away when a pool is full), prefill for a fixed time, and
//!   are granted on every worker at the next P step; P then hands them (through a reliable
//!   "proxy" delay) to a random D engine. On release P *poisons* the blocks (fence word 0,
//!   content garbage) and returns them to the free list, where the next grant reuses them.
//! - **D engines**, each with `d_tp` ranks; each rank tracks (on arrival, not on
//!   scheduling) and heartbeats on its own. A D engine has a waiting queue and `d_slots`
//!   running slots; forward-loop steps of fixed length plus jitter. A scheduled request is
//!   read (a one-sided read of P's pool, checked after the fact like a fenced read),
//!   then decodes for a while. A successful read sends `KVL1:RC:` from every D rank to the
//!   P workers it read (heterogeneous TP: P TP=4 → D TP=2 means rank r reads workers 2r and
//!   2r+1, one consumer each; P TP=1 → D TP=2 means both ranks read worker 0, two
//!   consumers). A read that finds a changed generation ends in recompute and is counted;
//!   so does a read from a crashed P. Clients abort waiting requests at random (notify-only
//!   completion `KVL1:AB:`). Expiry notices from P (`KVL1:EX:`) make D recompute instead of
//!   reading.
//! - **Steps** feed every message received since the previous step, then run the state
//!   machines, like the agents' forward loops: P routes, grants, reaps and drains events;
//!   D routes, finishes reads, admits, and sends the due heartbeat batches (split with
//!   `encode_heartbeats`). The first batch for a P engine D has not met starts a handshake
//!   (SPEC, "Preemptive handshake"); the batch is deferred
//!   ([`HeartbeatTracker::defer`](kvlease_lease::HeartbeatTracker::defer)) until it is done.
//!
//! # Fault model
//! - Network between every pair of endpoints: delay + uniform jitter (so messages
//!   reorder), loss (optionally never more than N in a row per link and stream),
//!   duplication.
//! - Clocks: every engine maps true time through its own offset (up to 10 s) and drift (up
//!   to ±200 ppm); the state machines only ever see their engine's local time.
//! - D crash: its queue, slots and trackers vanish, it sends nothing more; messages to it
//!   are dropped; optionally it restarts empty. P crash: its leases and pools vanish; reads
//!   from it fail and recompute; optionally it restarts with generations above the old ones.
//! - Partitions: every message between one D and one P engine is dropped for a while
//!   (leases may expire; D's fenced reads then detect it and recompute).
//!
//! # What is checked, in every run
//! - A lease is freed before its expiry (the oracle's, on P's clock) only when all its
//!   expected consumers reported (completed) or D aborted it; an expired lease is freed
//!   no later than one P step after its expiry, and no lease stays overdue.
//! - A D read that finds a changed fence word while the oracle says the lease is live, or
//!   poisoned / foreign content under a matching fence word, fails the run.
//! - D sends at most one heartbeat batch per (engine, P worker) and interval.
//! - Every heartbeat's outcome (held / late / unknown ids) equals the oracle's: a late
//!   heartbeat after completion changes nothing.
//! - After a D crash, every lease it held is reclaimed no earlier than the extension
//!   after its last delivered heartbeat and no later than extension + interval + one step
//!   (+ network delay) after the crash.
//! - With `expect_no_expiry_while_tracked` (the overload scenario): no lease expires while
//!   its D is alive and tracks it.
//! - At the end, after the world drained: every table empty, every block free.
//!
//! # Reproducing a failure
//! A failing seed prints the command that replays it, e.g.
//! `KVLEASE_SIM_SEED=1234 cargo test -p kvlease-sim --test sim sim_seeds`. `KVLEASE_SIM_SEEDS=N`
//! runs seeds `0..N` of the sweep (default 64; CI runs 256); the named scenarios run a fixed
//! number of seeds each, and `KVLEASE_SIM_SEED` replays one seed in any of them. The same
//! seed gives the same trace hash.
//!
//! # Bidirectional mode
//! [`run_bidir`] simulates D's cached turns under clock skew, drift and asymmetric delays,
//! and compares how P learns their deadline: absolute D timestamps converted with the
//! clock-offset estimate, or relative TTLs on the wire (see [`BidirConfig`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bidir;
mod config;
mod rng;
mod world;

pub use bidir::{BidirBug, BidirConfig, BidirReport, DeadlineBasis, FlightAllowance, run_bidir};
pub use config::{Bug, Crash, NetConfig, Partition, WorldConfig};
pub use rng::Rng;
pub use world::{Report, SimStats, World};

/// Runs the world of `config` to the end.
pub fn run(config: WorldConfig) -> Report {
    World::new(config).run()
}

/// The seeds to run: `KVLEASE_SIM_SEED=S` gives `[S]`, else `KVLEASE_SIM_SEEDS=N` gives
/// `0..N`, else `0..default`. Unparsable values fall back to the default.
pub fn seeds_from_env(default: u64) -> Vec<u64> {
    if let Some(seed) = std::env::var("KVLEASE_SIM_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        return vec![seed];
    }
    let n = std::env::var("KVLEASE_SIM_SEEDS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default);
    (0..n).collect()
}

/// The seeds of a named scenario: `KVLEASE_SIM_SEED=S` gives `[S]` (to replay a failure),
/// else `0..count`. Scenarios do not scale with `KVLEASE_SIM_SEEDS`, which sizes the sweep.
pub fn scenario_seeds(count: u64) -> Vec<u64> {
    match std::env::var("KVLEASE_SIM_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        Some(seed) => vec![seed],
        None => (0..count).collect(),
    }
}

/// The command that replays `seed` in the test `test` of `crates/sim/tests/sim.rs`.
pub fn repro_command(seed: u64, test: &str) -> String {
    format!(
        "KVLEASE_SIM_SEED={seed} cargo test -p kvlease-sim --test sim {test} -- --exact --nocapture"
    )
}
