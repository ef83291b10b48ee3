//! Deterministic simulation of many prefill (P) and decode (D) engines on virtual time,
//! driving the engine cores users run: one [`PrefillCore`](kvlease_engine::PrefillCore) per
//! P engine and one [`DecodeCore`](kvlease_engine::DecodeCore) per D engine, through the
//! real `kvlease-notif` codec. The world is their shell, as the agents are: it owns the
//! (virtual) memory, network, clocks and threads, and decides nothing about leases or
//! requests. The checker keeps its own small reference model (the oracle) only to judge
//! the outcome. The simulator does not simulate the transports, the GPU, the HTTP edge or
//! the model: a read is a copy out of a vector, a decode a timer.
//!
//! # World model
//! - **P engines**, each with `p_tp` workers. Every worker has its own pool of fence words
//!   (the generation of the lease that holds a block, `0` when free) and content words;
//!   every worker holds the same block ids of a request. The P shell does what the
//!   prefill agent does: `handle_job` when a request arrives; `poll_prefill` starts a
//!   prefill, which writes the request's content into every worker's blocks from its
//!   start; `prefill` later, `handle_prefill_done` grants the lease, the shell publishes
//!   the generation into every worker's fence words and hands the transfer
//!   ([`RemoteKv`](kvlease_engine::RemoteKv), with P's instance: a restarted P announces a
//!   larger one) to a random D after the proxy delay
//!   (`transfer_delay`, reliable). Each step it feeds every notification received
//!   (`handle_notif` with the sender's authenticated engine and address) and runs the
//!   reaper (`handle_timeout`), draining `poll_action` after every input:
//!   `ClearFences` writes the free word and poison into every worker's blocks before
//!   anything else (the core hands those blocks out again only after that), `Transmit`
//!   sends an expiry notice over the network.
//! - **D engines**, each with `d_tp` workers. The D shell does what the decode agent
//!   does: `on_new_request` when a transfer arrives (tracked at once); `poll_handshake`
//!   starts a handshake that ends `handshake` later in `handle_handshake` (P's TP size,
//!   pool and instance; an error when P is down or cut off then); `poll_transmit` sends each heartbeat or abort to every
//!   worker of its P engine; `poll_load` plans a load: one batch per (D worker, P worker)
//!   pair whose heads overlap (heterogeneous TP; each is one consumer of the lease). A
//!   batch is a one-sided read: it copies P worker `p_rank`'s content words when it is
//!   posted and checks the fence word of the request's first block when it ends, `read`
//!   later: a changed fence is `Stale`, a P that is down, restarted or cut off is
//!   `Failed`, else `Done`, and the batch's read completion goes to that P worker. On
//!   `Loaded` the shell verifies the bytes (the oracle below), then `handle_verified`;
//!   the request decodes for a while, then `request_finished`. Clients abort requests at
//!   random (`abort`). The shell calls `forget_engine` when a read or send to a P fails
//!   or (in worlds with `notice_lost_connections`) its connection breaks, a `handshake`
//!   time after P crashed; the next request handshakes again. A request that names a
//!   newer instance of a connected P makes the core check it (`poll_handshake` with
//!   `check_instance`): the answer replaces the connected engine only when P's instance is
//!   newer.
//! - **Steps**: every engine runs a forward loop of `p_step` / `d_step` (plus jitter);
//!   messages, arrivals and handshake results wait in its inbox for the next step. The
//!   cores see only their engine's local clock.
//!
//! # Fault model
//! - Network between every pair of endpoints: delay + uniform jitter (so messages
//!   reorder), loss (optionally never more than N in a row per link and stream),
//!   duplication.
//! - Clocks: every engine maps true time through its own offset (up to 10 s) and drift (up
//!   to ±200 ppm).
//! - P crash: its core, memory, queue and prefills vanish; requests it had not granted are
//!   lost with it; reads from it fail. Restart under the **same engine id**: a new core
//!   whose first generation is above every earlier one, fresh memory.
//! - D crash: its core, queue, reads and decodes vanish; its requests are lost with it.
//!   Restart under the same engine id with a new core.
//! - Stall of a P or a D engine (longer than the lease in the random worlds): no steps, no
//!   messages handled for `duration`; its inbox queues up, then it resumes. One-sided
//!   reads of a stalled P's memory still complete.
//! - Partition: every message between one D and one P engine is dropped for a while, and
//!   reads and handshakes between them fail.
//! - A rogue endpoint, authenticated as its own engine, sniffs real request ids and sends
//!   heartbeats, read completions (naming its own or the owner's consumer, any
//!   `consumers_total`) and aborts to P workers, and expiry notices to D. It mostly
//!   targets leases an honest D already owns; sometimes any lease, and it may then claim
//!   one first: it owns that lease like any reader would (the transport authenticates
//!   engines, not roles), so it can end it early or keep it alive. An abort needs no claim
//!   either: any engine may abort a lease nobody claimed yet. Such a lease is exempt from
//!   the early-release checks, and its request may fail (a stale read); the fence still
//!   keeps its honest reader from wrong output.
//!
//! # What is checked, in every run
//! - **No wrong output.** A request reaches `Loaded` only if every batch read under its
//!   matching fence word (else the run fails: "output from a read whose fence did not
//!   match"), and every block copied holds the request's own content (else: "wrong
//!   output", poisoned or foreign content under a matching fence).
//! - **Every request ends in exactly one outcome**: refused at P, refused at D, lost with
//!   a crashed P, lost with a crashed D, or D's `Done`, `Failed` or `Aborted`. Two
//!   outcomes, or none at the end, fail the run.
//! - **Ownership and leases** (the oracle's own model of ownership and expiry, on P's
//!   clock): every answer of P's core to a message (held / late / unknown / foreign ids of
//!   a heartbeat, completions and aborts accepted or ignored as another engine's) is the
//!   oracle's; a lease is freed before its expiry only when all its consumers reported
//!   (completed) or its owner aborted it; an expired lease is freed no later than one P
//!   step after its expiry (or after the end of a P stall), and none stays overdue.
//! - At most one heartbeat batch per (D engine, P engine) and interval.
//! - After a D crash, every lease it tracked is reclaimed no earlier than the extension
//!   after its last delivered heartbeat and no later than extension + interval + one step
//!   (+ network delay) after the crash.
//! - **Restart bound**: the first request that arrives at a restarted P at or after
//!   restart + `handshake` + lease duration ends `Done` unless another fault (crash,
//!   restart, stall, partition) overlapped its life, the rogue acted on its lease, the
//!   client aborted it or an engine refused it. By then D forgot the old connection (it
//!   broke, a read or send failed, or a request named the new instance) and handshaked
//!   again (a `handshake` time), and every lease an old reader could hold has ended (the
//!   lease duration).
//! - With `expect_no_expiry_while_tracked` (the overload scenario): no lease expires while
//!   its D is alive and tracks it.
//! - **Nothing leaks**: at the end every live core is idle (no lease, job, prefill,
//!   request, tracked id or allocated block), every fence word is free, no read or decode
//!   is left in a shell.
//!
//! Each check has a planted-bug test ([`Bug`]) that proves it can fail.
//!
//! # Reproducing a failure
//! A failing seed prints the command that replays it, e.g.
//! `KVLEASE_SIM_SEED=1234 cargo test -p kvlease-sim --test sim sim_seeds`. `KVLEASE_SIM_SEEDS=N`
//! runs seeds `0..N` of the sweep (default 64; CI runs 256); the named scenarios run a fixed
//! number of seeds each, and `KVLEASE_SIM_SEED` replays one seed in any of them. The same
//! seed gives the same trace hash and the same full trace ([`World::record_log`]): the
//! cores hand out events and messages in an order their inputs define, and the shell
//! takes them in that order, unsorted, as the agents do. With `KVLEASE_SIM_SEEDS` set,
//! the sweep prints one line, `sim: seeds=N p_restarts=.. d_restarts=.. stalls=.. partitions=.. forged=.. requests=..
//! outcomes_ok=..` (counts over all seeds), and from 256 seeds on it asserts that every
//! fault occurred.
//!
//! # Bidirectional mode
//! With [`WorldConfig::bidir`] (a [`BidirSim`]), the world above runs multi-turn
//! conversations, every fault included. The D shell does what the decode agent does
//! around its `DecodeCore`, built `with_hold`: `request_finished_hold` keeps a finished
//! turn, whose generation the shell publishes into D's fence words, and D answers
//! [`DecoderKvParams`](kvlease_engine::DecoderKvParams); P's heartbeats (symmetric lease)
//! and read completions go to `handle_notif_at`; `handle_timeout` expires turns each step
//! and, before each load, evicts the oldest while the next request is short of blocks
//! (whose read overwrites them at once); for each turn `poll_turn_released` hands out the
//! shell writes the free word and poison. The P shell heartbeats held turns on the
//! prefill agent's schedule, [`TurnHeartbeats`](kvlease_engine::TurnHeartbeats). The next
//! turn reaches a P engine after a think time around the
//! TTL; when its prefill starts, P probes D's clock, decides with
//! [`plan_pull`](kvlease_engine::plan_pull) and either reads D's held blocks (content as the
//! read starts, the first block's fence word as it ends; a D crashed, cut off or restarted
//! since P's handshake with it fails it, and drops that handshake) or recomputes, then
//! tells D it has read. A D's held turns count their generations from above every earlier
//! incarnation's, so a pull with an earlier incarnation's params fails its fence.
//! Checked: a pull that completes read under the hold's generation and got the previous
//! turn's KV; every hold ends exactly once (pulled, expired, evicted, lost with its D),
//! never before its deadline when it expires and no later than one D step after it (or
//! after a stall), and at once on P's read completion; at the end no D holds a block or
//! a live fence word. A turn that is not `Done` ends its conversation.
//!
//! [`run_bidir`] simulates D's cached turns under clock skew, drift and asymmetric delays,
//! driving the engine's bidirectional decisions (D's [`DecoderHold`](kvlease_engine::DecoderHold),
//! P's [`plan_pull`](kvlease_engine::plan_pull)), and compares how P learns their deadline:
//! absolute D timestamps converted with the clock-offset estimate, or relative TTLs on the
//! wire (see [`BidirConfig`]).
//!
//! # Push mode
//! [`run_push`] simulates push mode: D engines reserve blocks ([`Reservations`]) and P
//! engines write into them ([`PushCore`]) under lost, duplicated and reordered frames,
//! failed write posts, D aborts, a P that dies mid-prefill and a P that stalls past the
//! lease; its oracles check that no write lands in blocks not held for that transfer and
//! generation, that written KV is right, that every reservation and push ends exactly
//! once, and that a dead P's reservations are freed within about one lease (see
//! [`PushWorldConfig`]).
//!
//! [`Reservations`]: kvlease_engine::Reservations
//! [`PushCore`]: kvlease_engine::PushCore
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bidir;
mod config;
mod holds;
mod push;
mod rng;
mod world;

pub use bidir::{BidirBug, BidirConfig, BidirReport, FlightAllowance, run_bidir};
pub use config::{BidirSim, Bug, Crash, NetConfig, Partition, Stall, WorldConfig};
pub use holds::{HoldsBug, HoldsConfig, HoldsReport, run_holds};
pub use push::{PushReport, PushWorldConfig, run_push};
pub use rng::Rng;
pub use world::{Report, SimStats, World};

/// A shell's error, as the typed cause the cores keep.
#[derive(Debug)]
struct SimError(&'static str);

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for SimError {}

/// A shell's error `what`, as a core's [`Cause`](kvlease_engine::Cause).
fn cause(what: &'static str) -> kvlease_engine::Cause {
    std::sync::Arc::new(SimError(what))
}

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
