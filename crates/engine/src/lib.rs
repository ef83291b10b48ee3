//! The engine cores of kvlease: [`PrefillCore`] and [`DecodeCore`] hold everything a
//! prefill (P) and a decode (D) engine **decide** — which blocks a request gets, when a
//! lease is granted, renewed, released and announced, which requests D tracks and
//! heartbeats, when one is scheduled and read, and how every request ends — and nothing
//! they **do**.
//!
//! This crate does not take care of threads, clocks, sockets, HTTP, memory or the
//! environment: time is an argument (a [`Timestamp`](kvlease_lease::Timestamp) on the
//! engine's own clock), inputs come in through `handle_*` / `on_*` methods, outputs are
//! drained through `poll_*` methods, as in quinn-proto's `Connection`. Two drivers run the
//! same cores: the agents (`prefill-agent`, `decode-agent`: real threads, transports and
//! HTTP) and the deterministic simulator (`kvlease-sim`: virtual time and network, faults,
//! oracles), so that the simulator checks the code users run.
//!
//! # The serving engine's hooks
//! vLLM's KV connector splits the work into scheduler-side and worker-side hooks; a
//! serving engine that embeds these cores calls them at the same points:
//!
//! | vLLM connector hook | P ([`PrefillCore`]) | D ([`DecodeCore`]) |
//! | --- | --- | --- |
//! | scheduler `on_new_request` | [`handle_job`](PrefillCore::handle_job) | [`on_new_request`](DecodeCore::on_new_request) (tracked at once) |
//! | `get_num_new_matched_tokens` | — | [`on_new_request`](DecodeCore::on_new_request) validates P's coordinates: all prompt tokens load remotely |
//! | `update_state_after_alloc` | [`poll_prefill`](PrefillCore::poll_prefill) (blocks allocated) | [`poll_load`](DecodeCore::poll_load) (blocks allocated, reads planned); external blocks: [`start_load`](DecodeCore::start_load) with vLLM's blocks |
//! | `build_connector_meta` | — | [`poll_transmit`](DecodeCore::poll_transmit) (throttled heartbeats, aborts) and the [`LoadPlan`]s |
//! | `request_finished` | [`handle_prefill_done`](PrefillCore::handle_prefill_done) grants the lease; external blocks: [`handle_prefill_done_in`](PrefillCore::handle_prefill_done_in) with vLLM's blocks | [`request_finished`](DecodeCore::request_finished) frees D's blocks |
//! | `update_connector_output` | [`poll_event`](PrefillCore::poll_event) | [`poll_event`](DecodeCore::poll_event) ([`DecodeEvent::Finished`]) |
//! | worker `start_load_kv` | — | post each [`BatchPlan`]; send each [`Transmit`] |
//! | worker `get_finished` | [`handle_notif`](PrefillCore::handle_notif) (read completions release) | [`handle_batch_done`](DecodeCore::handle_batch_done), [`DecodeEvent::Loaded`] |
//! | `get_block_ids_with_load_errors` | — | [`Outcome::Failed`] (a stale fence never produces output) |
//! | the reaper (none in vLLM) | [`handle_timeout`](PrefillCore::handle_timeout) | — |
//!
//! # Who allocates blocks
//! In vLLM the KV cache manager allocates every block; the connector only learns which
//! ones a request got. A core built with [`BlockSource::External`] takes those ids
//! ([`PrefillCore::handle_prefill_done_in`], [`DecodeCore::start_load`]) and tells the
//! shell when they may be freed (a release's [`PrefillAction::ClearFences`], a
//! request's [`DecodeEvent::Finished`]) instead of keeping a free list. The agents and
//! the simulator use the default, [`BlockSource::Pool`]: the core allocates. Every lease
//! and request decision is the same code either way; `kvlease.vllm` (the Python
//! connector in `crates/python`) drives external-block cores.
//!
//! # Ownership of a lease
//! A lease belongs to the first D engine that heartbeats, reads or aborts it; P ignores
//! (and counts) notifications about it from any other engine, and D ignores expiry notices
//! from any engine but the one holding the request's lease.
//!
//! # Every request ends once
//! On D, every request admitted by [`DecodeCore::on_new_request`] ends in exactly one
//! [`DecodeEvent::Finished`]. On P, every job ends in an error from
//! [`PrefillCore::handle_job`] or [`PrefillCore::handle_prefill_done`], a
//! [`PrefillEvent::Refused`], or a grant whose lease is released exactly once.
//! In push mode, every reservation ends in exactly one [`ReservationEnded`] on D, and
//! every push admitted by [`PushCore::admit`] in exactly one [`PushAction::Ended`] on P.
//!
//! # Bidirectional multi-turn mode
//! D keeps a finished turn's blocks in a [`DecoderHold`] (fixed TTL or symmetric lease;
//! oldest evicted first when a new request needs blocks) and answers with
//! [`DecoderKvParams`]; P decides with [`plan_pull`] whether the next turn's prompt pulls
//! the common whole blocks or recomputes. The agents carry the params as JSON and probe
//! clocks; the simulator drives the same functions under skew and drift.
//!
//! # Push mode
//! D reserves blocks at admission under a lease ([`Reservations`]) and registers them
//! with P; P's [`PushCore`] heartbeats the reservation while the request waits or
//! prefills, writes into D's blocks when its prefill ends ([`WritePlan`]) and tells D
//! (write-done or push-failed). The reservation's generation fences every write: D
//! admits one only while it holds the blocks under that generation.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bidir;
mod blocks;
mod decode;
pub mod instance;
mod prefill;
mod push;
pub mod registry;
mod tp;

pub use bidir::{
    BadParam, DeadlineBasis, DecoderHold, DecoderKvParams, HeartbeatRun, Held, MAX_PARAM_BLOCKS,
    PullDecision, PullPolicy, RecomputeReason, TURN_HEARTBEATS_PER_EXTENSION, TurnHeartbeat,
    TurnHeartbeats, block_hashes, common_blocks, estimated_deadline, plan_pull, prefix_hashes,
};
pub use blocks::BlockSource;
pub use decode::{
    AdmitError, BatchPlan, BatchResult, Cause, DEFAULT_INSTANCE_CHECK_INTERVAL,
    DEFAULT_MAX_ENGINES, DecodeConfig, DecodeCore, DecodeEvent, DecodeNotif, DecodeStats,
    HandshakeError, HandshakeStart, HoldRefused, HoldTerms, KeptTurn, KvSplit, LoadError, LoadPlan,
    Outcome, RemoteEngine, RemoteKv, StartLoadError, Transmit, TransmitKind, TurnEnd, TurnReleased,
};
pub use prefill::{
    Granted, HOLD_GENERATIONS, Peer, PrefillAction, PrefillConfig, PrefillCore, PrefillError,
    PrefillEvent, PrefillNotif, PrefillStart, PrefillStats,
};
pub use push::{
    FenceVerdict, PushAction, PushConfig, PushCore, PushEnded, PushError, PushMessage, PushOutcome,
    PushStats, RegistrationOutcome, Reservation, ReservationEnded, ReservationOutcome,
    ReservationStats, Reservations, WritePlan, write_pairs,
};
pub use tp::{HeadPair, head_pairs, heads_of_rank, tp_pairs};
