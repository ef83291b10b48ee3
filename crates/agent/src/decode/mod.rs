//! The decode engine (D): one engine thread runs the forward loop over `tp_size` workers,
//! each with its own block pool and transport endpoint. Every decision — tracking,
//! heartbeats, scheduling, which reads to post, how a request ends — is the
//! [`DecodeCore`]'s (`kvlease-engine`); this module is its IO shell.
//!
//! One step, every `step`:
//! 1. take new requests and aborts from the HTTP layer (the core tracks a request on
//!    arrival); start the handshakes the core asks for on background threads;
//! 2. `start_load_kv`: send what the core has for P (heartbeat batches, aborts) to every
//!    P worker of the engine;
//! 3. poll notifications and hand them to the core (an expiry notice fails a waiting
//!    request: never output);
//! 4. post the read batches of every request the core schedules (one per overlapping
//!    (D worker, P worker) pair, fenced; the batch's notification is the read completion);
//! 5. report finished batches; verify a loaded request's bytes against its tokens and the
//!    digest against P's;
//! 6. decode one token for every running request; a finished one frees its blocks, or in
//!    bidirectional mode the core keeps them as a held turn for P to pull (the core
//!    decides keeping, renewal, eviction and expiry; the shell syncs the blocks for
//!    peers, publishes and clears their fences, and writes the turn's params).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvlease_engine::{
    AdmitError, BatchResult, Cause, DecodeConfig, DecodeCore, DecodeEvent, DecodeNotif,
    HandshakeError, LoadError, LoadPlan, Outcome, RemoteEngine, RemoteKv, TransmitKind,
};
use kvlease_gpu_mem::{BlockPool, FenceTable, KvHalf, KvLayout, MemoryRequest};
use kvlease_lease::{BlockId, DecoderTtl, EngineId, Generation, LeaseConfig, RequestId, Timestamp};
use kvlease_proto::engine_info::EngineInfo;
use kvlease_proto::params::KvTransferParams;
use kvlease_transport::{Agent, PeerId, RegionDesc};
use tokio::sync::{mpsc, oneshot};

use crate::api::{ApiError, TransferStats};
use crate::bidir::{self, PeerClock};
use crate::config::LoadFailurePolicy;
use crate::kv::{self, KvDigest, KvShape, RankLayout};
use crate::link::{self, LinkConfig, LinkStatus, ReadOp};
use crate::metrics::{HandshakeOutcome, Metrics};
use crate::shell::{
    EngineError, HandshakeFailure, Me, PeerEngine, engine_of_peer, host_port, instance_now,
    rank_pool, worker_info,
};
use crate::sidechannel;
use crate::telemetry::error_chain;

mod errors;
mod handshakes;
mod hold;
mod loads;
mod push;
mod reads;

pub use push::PushJob;

pub use errors::{ReadSetupError, VerifyError};
use errors::{handshake_api, handshake_error};
use reads::{build_ops, handshake, verify_worker};

/// A decode request handed from HTTP to the engine.
#[derive(Debug)]
pub struct DecodeJob {
    /// D's id of the request.
    pub id: RequestId,
    /// Prompt tokens (must be the ones P prefilled).
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// P's `kv_transfer_params`.
    pub params: KvTransferParams,
    /// The digest P published (`kv_transfer_params.kv_digest`, required on D): the KV read
    /// must sum to it.
    pub kv_digest: KvDigest,
    /// The request's `conversation_id` (bidirectional mode echoes it).
    pub conversation_id: Option<String>,
    /// When the HTTP layer got it.
    pub arrived: Instant,
    /// Tokens, then the end or the error.
    pub events: mpsc::UnboundedSender<DecodeStreamEvent>,
}

/// What the HTTP layer sends D's engine.
#[derive(Debug)]
pub enum Job {
    /// Decode a request prefilled by P.
    Decode(Box<DecodeJob>),
    /// Push mode: receive a request's KV from P, then decode it.
    Push(Box<PushJob>),
    /// Abort a request (by D's id or P's `remote_request_id`); answers whether it was known.
    Abort {
        /// The request.
        id: RequestId,
        /// Where the answer goes (none for a client disconnect).
        reply: Option<oneshot::Sender<bool>>,
    },
}

/// What a decode request produces, in order.
#[derive(Debug)]
pub enum DecodeStreamEvent {
    /// One output token's text.
    Token(String),
    /// The request finished.
    Done(Summary),
    /// The request failed (no token was output before a KV failure).
    Failed(ApiError),
}

/// The end of a successful decode.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The verified digest.
    pub kv_digest: String,
    /// Transfer statistics.
    pub stats: TransferStats,
    /// Bidirectional mode: D's cached-blocks params
    /// ([`DecoderKvParams`](kvlease_engine::DecoderKvParams)) for P's next turn; `None` when
    /// D does not keep the turn.
    pub kv_transfer_params: Option<serde_json::Value>,
}

/// D's bidirectional mode (`bidirectional_kv_xfer: true`, `kv_role: kv_both`): keep a
/// finished turn's blocks for P to pull.
#[derive(Debug, Clone)]
pub struct DecodeBidir {
    /// `decoder_kv_blocks_ttl`.
    pub ttl: DecoderTtl,
    /// The symmetric lease: P's heartbeats extend the cached blocks.
    pub symmetric: bool,
    /// The clock D's deadlines are on (the one its clock probe answers with).
    pub clock: PeerClock,
    /// Host P should reach D's side channel on.
    pub advertise_host: String,
    /// D's side-channel port.
    pub side_channel_port: u16,
    /// D's clock-probe port.
    pub clock_port: u16,
}

/// How to build a D engine.
#[derive(Debug, Clone)]
pub struct DecodeAgentConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// Workers.
    pub tp_size: u32,
    /// Model shape (global heads).
    pub shape: KvShape,
    /// Blocks per worker pool.
    pub num_blocks: u32,
    /// Heartbeat timing.
    pub lease: LeaseConfig,
    /// Forward-pass time.
    pub step: Duration,
    /// Requests loading or decoding at once.
    pub max_running: u32,
    /// Waiting queue length bound.
    pub max_waiting: u32,
    /// What a failed KV load becomes.
    pub policy: LoadFailurePolicy,
    /// Pool memory kind.
    pub memory: MemoryRequest,
    /// Transport settings (and the cluster token for the side channel).
    pub link: LinkConfig,
    /// Limit for one read batch.
    pub read_timeout: Duration,
    /// Bidirectional mode; `None` frees a finished request's blocks at once.
    pub bidir: Option<DecodeBidir>,
    /// `--allowed-prefill-hosts`: the networks whose P agents D may connect to (side
    /// channel and transport); empty allows any.
    pub allowed_prefill: Vec<crate::config::Cidr>,
    /// `--max-prefill-engines`: P engines kept at once.
    pub max_engines: usize,
    /// `--transfer-mode`.
    pub transfer_mode: crate::config::TransferMode,
    /// Host P should reach D's side channel on (push mode's peer message).
    pub advertise_host: String,
    /// D's side-channel port (served in bidirectional and push mode).
    pub side_channel_port: u16,
}

struct Worker {
    layout: RankLayout,
    pool: BlockPool,
    agent: Arc<Agent>,
    pool_desc: RegionDesc,
    /// Bidirectional mode: the fence words of cached blocks, P's pulls check them.
    fence: Option<(FenceTable, RegionDesc)>,
}

/// A handshaken P engine: its info and, per D worker, a peer per P worker.
struct Ready {
    info: PeerEngine,
    peers: Vec<Vec<PeerId>>,
}

/// A handshake thread's answer.
type HandshakeResult = crossbeam_channel::Receiver<Result<reads::Handshaken, HandshakeFailure>>;

/// The shell's side of a remote P engine (the core decides when to handshake).
enum Remote {
    Handshaking(HandshakeResult),
    Ready(Ready),
    /// Connected, and checking P's instance with its side channel.
    Checking(Ready, HandshakeResult),
}

/// One posted read batch, as the shell polls it.
struct Posted {
    worker: usize,
    batch: link::BatchId,
    /// The backend of the peer the batch reads from, replaced at completion by the one
    /// that moved its bytes (a verbs peer's batches on memory verbs could not register go
    /// over TCP).
    backend: kvlease_transport::Backend,
    done: bool,
}

/// What the shell keeps of a request beside the core's state.
struct Req {
    job: DecodeJob,
    scheduled: Option<Instant>,
    /// By batch index of the plan; `None` for a batch that could not be posted.
    posted: Vec<Option<Posted>>,
    load_started: Option<Instant>,
    /// Decoding: the text to stream, the next token, and the summary for the end.
    decoding: Option<(Vec<String>, usize, Summary)>,
    /// The client has its answer (aborted while reads ran): the entry stays only so that
    /// its batches are polled to the end and reported; the core frees the blocks then.
    answered: bool,
}

/// The D engine; [`run`](Self::run) is its forward loop. It drives a [`DecodeCore`] (every
/// decision) and does the IO: transport endpoints, handshakes, reads, verification, the
/// model's tokens and the client's events.
pub struct DecodeEngine {
    cfg: DecodeAgentConfig,
    metrics: Metrics,
    workers: Vec<Worker>,
    core: DecodeCore,
    /// This instance (the wall clock in µs at start), told to P in the handshake.
    instance: u64,
    remotes: HashMap<EngineId, Remote>,
    reqs: HashMap<RequestId, Req>,
    epoch: Instant,
    worker_metadata: Vec<Vec<u8>>,
    /// Push mode (`--transfer-mode push`).
    push: Option<push::PushD>,
}

impl DecodeEngine {
    /// Allocates the pools, starts the transport endpoints and registers the memory.
    ///
    /// # Errors
    /// [`EngineError`] naming the step that failed.
    pub fn new(cfg: DecodeAgentConfig, metrics: Metrics) -> Result<Self, EngineError> {
        let mut workers = Vec::new();
        for rank in 0..cfg.tp_size {
            let (layout, pool) =
                rank_pool(cfg.shape, cfg.tp_size, rank, cfg.num_blocks, cfg.memory)?;
            let agent = Arc::new(link::agent(
                &cfg.link,
                &format!("{}/d{rank}", cfg.engine_id),
            )?);
            let pool_desc = agent
                .register(Arc::clone(pool.region()))
                .map_err(|e| EngineError::setup("register pool", e))?;
            let pushes = cfg.transfer_mode == crate::config::TransferMode::Push;
            let fence = match cfg.bidir {
                _ if cfg.bidir.is_some() || pushes => {
                    let f = FenceTable::new(cfg.num_blocks)
                        .map_err(|e| EngineError::setup("fence table", e))?;
                    let d = agent
                        .register(f.region())
                        .map_err(|e| EngineError::setup("register fence", e))?;
                    Some((f, d))
                }
                _ => None,
            };
            workers.push(Worker {
                layout,
                pool,
                agent,
                pool_desc,
                fence,
            });
        }
        metrics.blocks_total.set(i64::from(cfg.num_blocks));
        let worker_metadata = workers.iter().map(|w| w.agent.metadata()).collect();
        let mut config = DecodeConfig::new(
            cfg.engine_id.clone(),
            cfg.tp_size,
            cfg.shape.num_kv_heads,
            cfg.shape.block_size,
            cfg.num_blocks,
            cfg.lease,
        )
        .with_limits(cfg.max_running, cfg.max_waiting)
        .with_retry(cfg.step)
        .with_max_engines(cfg.max_engines);
        // The instance is the wall clock in microseconds: a restarted D has a larger one, and
        // starting the held turns' generations there means P's pull with an earlier
        // instance's params never matches a turn held now on the same blocks.
        let instance = instance_now();
        if let Some(b) = &cfg.bidir {
            let first = std::num::NonZeroU64::new(instance)
                .map_or(Generation(std::num::NonZeroU64::MIN), Generation);
            config = config
                .with_hold(b.ttl, b.symmetric)
                .with_hold_first_generation(first);
        }
        let core = DecodeCore::new(config);
        // A restarted D starts its reservations' generations above every one it handed
        // out before (the instance is the wall clock in µs).
        let push = (cfg.transfer_mode == crate::config::TransferMode::Push).then(|| {
            let first = std::num::NonZeroU64::new(instance)
                .map_or(Generation(std::num::NonZeroU64::MIN), Generation);
            push::PushD::new(cfg.lease, cfg.num_blocks, first)
        });
        Ok(Self {
            push,
            core,
            instance,
            remotes: HashMap::new(),
            reqs: HashMap::new(),
            epoch: Instant::now(),
            worker_metadata,
            cfg,
            metrics,
            workers,
        })
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_duration(self.epoch.elapsed())
    }

    /// What D's side channel serves to P in bidirectional mode (P reads cached blocks with
    /// it) and push mode (P writes into reserved blocks with it); `None` otherwise.
    pub fn info(&self) -> Option<EngineInfo> {
        if self.cfg.bidir.is_none() && self.push.is_none() {
            return None;
        }
        let mut info = EngineInfo::new(
            self.cfg.engine_id.clone(),
            self.instance,
            self.cfg.tp_size,
            self.cfg.num_blocks,
        );
        info.shape = Some(self.cfg.shape);
        for (w, rank) in self.workers.iter().zip(0..) {
            let (_, fence) = w.fence.as_ref()?;
            info.workers
                .push(worker_info(rank, w.agent.metadata(), w.pool_desc, *fence));
        }
        Some(info)
    }

    /// The forward loop; returns when `stop` is set or every job sender is gone. Stamps
    /// `heartbeat` once per iteration (`/health` reads it).
    pub fn run(
        mut self,
        jobs: crossbeam_channel::Receiver<Job>,
        stop: Arc<AtomicBool>,
        heartbeat: Arc<crate::health::EngineHeartbeat>,
    ) {
        let mut next_step = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            heartbeat.beat();
            // Wait for the step boundary, taking jobs as they come.
            loop {
                let left = next_step.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match jobs.recv_timeout(left) {
                    Ok(j) => self.intake(j),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => break,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                }
            }
            next_step = Instant::now() + self.cfg.step;
            while let Ok(j) = jobs.try_recv() {
                self.intake(j);
            }
            self.step();
        }
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.core.shutdown();
        self.drain_events();
    }

    fn step(&mut self) {
        self.poll_handshakes();
        self.start_load_kv();
        self.poll_notifs();
        self.drop_gone_clients();
        self.schedule();
        self.finish_loads();
        self.decode_tokens();
        self.step_push();
        self.metrics
            .requests_tracked
            .set(self.core.tracked() as i64);
        self.metrics
            .requests_waiting
            .set(self.core.waiting() as i64);
        self.metrics
            .requests_running
            .set(self.core.running() as i64);
        let pushed = self.push.as_ref().map_or(0, push::PushD::blocks_held);
        self.metrics
            .blocks_held
            .set((self.core.blocks_allocated() + pushed) as i64);
        self.metrics.remote_engines.set(self.core.engines() as i64);
    }

    // ------------------------------------------------------------ intake

    fn intake(&mut self, job: Job) {
        match job {
            Job::Decode(job) => {
                if let Err((job, e)) = self.admit(job) {
                    let _ = job.events.send(DecodeStreamEvent::Failed(e));
                }
                self.start_handshakes();
                self.drain_events();
            }
            Job::Push(job) => self.intake_push(job),
            Job::Abort { id, reply } => {
                let known = self.abort_push(&id) || self.core.abort(&id);
                self.drain_events();
                if let Some(reply) = reply {
                    let _ = reply.send(known);
                }
            }
        }
    }

    /// Validates the request's `kv_transfer_params` into typed coordinates and hands it to
    /// the core; refusals become HTTP errors here, at the edge.
    fn admit(&mut self, job: Box<DecodeJob>) -> Result<(), (Box<DecodeJob>, ApiError)> {
        let p = &job.params;
        // An instance far ahead of the clock would outrank P's real restarts to come.
        if let Err(e) = kvlease_engine::instance::check_instance(p.kvlease_instance, instance_now())
        {
            let e = ApiError::bad_field("kv_transfer_params.kvlease_instance", e.to_string());
            return Err((job, e));
        }
        let (engine, remote_id) = (p.remote_engine_id.clone(), p.remote_request_id.clone());
        let remote = RemoteKv::new(
            engine,
            remote_id,
            p.remote_block_ids.iter().copied().map(BlockId).collect(),
            p.kvlease_generation,
            p.tp_size,
            p.kvlease_num_tokens,
            p.remote_host.clone(),
            p.remote_port,
        )
        .with_instance(p.kvlease_instance);
        let now = self.now();
        match self
            .core
            .on_new_request(now, job.id.clone(), job.tokens.len(), remote)
        {
            Ok(()) => {
                self.reqs.insert(
                    job.id.clone(),
                    Req {
                        job: *job,
                        scheduled: None,
                        posted: Vec::new(),
                        load_started: None,
                        decoding: None,
                        answered: false,
                    },
                );
                Ok(())
            }
            Err(e) => {
                // A refusal with valid coordinates queued an abort for P: send it now.
                self.send_transmits(now);
                Err((job, admit_error(&e)))
            }
        }
    }

    // ------------------------------------------------------------ heartbeats and aborts

    fn start_load_kv(&mut self) {
        let now = self.now();
        self.send_transmits(now);
    }

    /// Sends what the core has for P: every heartbeat batch due and every abort, each to
    /// every P worker of its engine, from D worker 0.
    fn send_transmits(&mut self, now: Timestamp) {
        while let Some(t) = self.core.poll_transmit(now) {
            let (Some(w0), Some(Remote::Ready(ready) | Remote::Checking(ready, _))) =
                (self.workers.first(), self.remotes.get(&t.engine))
            else {
                // The core sends only to engines it knows ready, which the shell made
                // ready first; a miss here is a bug worth seeing.
                tracing::warn!(engine = %t.engine, kind = ?t.kind, "notification for an engine not connected; dropped");
                continue;
            };
            let Some(peers) = ready.peers.first() else {
                continue;
            };
            for &peer in peers {
                match w0.agent.send_notif(peer, t.bytes.clone()) {
                    Ok(()) => {
                        if let TransmitKind::Heartbeat { ids } = t.kind {
                            self.metrics.heartbeats_sent.inc();
                            self.metrics.heartbeat_ids_sent.inc_by(u64::from(ids));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(engine = %t.engine, kind = ?t.kind, error = %e, "notification not sent")
                    }
                }
            }
        }
    }

    // ------------------------------------------------------------ notifications

    fn poll_notifs(&mut self) {
        let mut received = Vec::new();
        for w in &self.workers {
            received.extend(w.agent.get_new_notifs());
        }
        let now = self.now();
        for (from, msgs) in received {
            let Some(engine) = engine_of_peer(&from) else {
                self.metrics.notif_malformed.inc();
                continue;
            };
            for m in msgs {
                // Push mode: P's heartbeats, write-done and push-failed.
                if self.take_push_frame(now, &engine, &m) {
                    continue;
                }
                // The core applies P's frames about held turns (bidirectional mode).
                match self.core.handle_notif_at(now, &engine, &m) {
                    DecodeNotif::Expired { .. } => {
                        self.metrics.expiry_notices_received.inc();
                    }
                    DecodeNotif::CacheHeartbeat(_) | DecodeNotif::CacheReadComplete(_)
                        if self.core.holds_turns() => {}
                    DecodeNotif::Malformed(e) => {
                        self.metrics.notif_malformed.inc();
                        tracing::debug!(error = %e, %from, "malformed notification");
                    }
                    other => tracing::debug!(?other, %from, "notification ignored"),
                }
            }
        }
        self.drain_turns();
        self.drain_events();
    }

    fn drop_gone_clients(&mut self) {
        let gone: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.answered && r.job.events.is_closed())
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.core.abort(&id);
        }
        self.drain_events();
    }

    // ------------------------------------------------------------ scheduling and reads

    fn schedule(&mut self) {
        loop {
            // Held turns expire, and give way to the next request short of blocks (the
            // core picks which); their fences clear before their blocks are reused.
            self.core.handle_timeout(self.now());
            self.drain_turns();
            let Some(plan) = self.core.poll_load() else {
                break;
            };
            self.post_reads(plan);
        }
        self.drain_events();
    }

    fn decode_tokens(&mut self) {
        let mut done = Vec::new();
        for (id, req) in &mut self.reqs {
            let Some((text, next, _)) = &mut req.decoding else {
                continue;
            };
            if let Some(t) = text.get(*next) {
                let _ = req.job.events.send(DecodeStreamEvent::Token(t.clone()));
                *next += 1;
                self.metrics.decode_tokens.inc();
            }
            if *next >= text.len() {
                done.push(id.clone());
            }
        }
        for id in done {
            let kept = self.keep_for_next_turn(&id);
            if let Some(req) = self.reqs.get_mut(&id)
                && let Some((_, _, summary)) = &mut req.decoding
            {
                summary.kv_transfer_params = kept;
            }
            self.drain_events();
        }
    }

    // ------------------------------------------------------------ outcomes

    /// Drains the core's events: verifies loads, answers finished requests.
    fn drain_events(&mut self) {
        while let Some(ev) = self.core.poll_event() {
            match ev {
                DecodeEvent::Loaded {
                    request,
                    blocks,
                    bytes,
                } => {
                    self.on_loaded(&request, &blocks, bytes);
                    // Verifying is the longest thing a step does (every byte of the
                    // request, and slower on device memory): send the heartbeats that
                    // came due meanwhile now rather than at the next step.
                    let now = self.now();
                    self.send_transmits(now);
                }
                DecodeEvent::HandshakeDone { engine } => {
                    tracing::debug!(%engine, "requests of the engine may be scheduled");
                }
                DecodeEvent::EngineDropped { engine } => self.drop_engine(&engine),
                DecodeEvent::Finished { request, outcome } => self.on_finished(&request, outcome),
            }
        }
    }

    fn on_finished(&mut self, id: &RequestId, outcome: Outcome) {
        let event = match outcome {
            Outcome::Done => match self.reqs.get_mut(id).and_then(|r| r.decoding.take()) {
                Some((_, _, summary)) => DecodeStreamEvent::Done(summary),
                None => DecodeStreamEvent::Failed(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "finished without a decode",
                )),
            },
            Outcome::Failed(e) => {
                tracing::warn!(request = %id, error = %error_chain(&e), "KV load failed; no output");
                DecodeStreamEvent::Failed(self.load_error(&e))
            }
            Outcome::Aborted => DecodeStreamEvent::Failed(ApiError::new(
                StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                "aborted",
                format!("request {id} was aborted"),
            )),
            Outcome::Shutdown => DecodeStreamEvent::Failed(ApiError::overloaded(
                "the decode engine is shutting down",
            )),
        };
        let Some(req) = self.reqs.get_mut(id) else {
            return;
        };
        let _ = req.job.events.send(event);
        // Reads still in flight write into the request's blocks: keep polling them, so
        // that the core learns they ended and frees the blocks.
        if req.posted.iter().flatten().any(|p| !p.done) {
            req.answered = true;
        } else {
            self.reqs.remove(id);
        }
    }

    /// The HTTP answer to a failed load, by `load_failure_policy`.
    fn load_error(&self, e: &LoadError) -> ApiError {
        if let LoadError::Handshake { source, .. } = e
            && let Some(api) = handshake_api(source)
        {
            return api;
        }
        if let LoadError::UnknownInstance { .. } = e {
            return ApiError::bad_field("kv_transfer_params.kvlease_instance", e.to_string());
        }
        self.metrics.kv_load_failures.inc();
        let message = error_chain(e);
        match self.cfg.policy {
            LoadFailurePolicy::Recompute => ApiError::kv_load_failed(message),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "kv_load_error", message),
        }
    }
}

/// The HTTP answer to a refusal on arrival.
fn admit_error(e: &AdmitError) -> ApiError {
    match e {
        AdmitError::QueueFull { .. } | AdmitError::TooManyEngines { .. } => {
            ApiError::overloaded(e.to_string())
        }
        AdmitError::InstanceUnconfirmed { interval, .. } => {
            ApiError::overloaded(e.to_string()).retry_after(*interval)
        }
        AdmitError::StaleInstance { .. } => ApiError::kv_load_failed(e.to_string()),
        AdmitError::PromptTooLong { .. } => ApiError::bad_field("prompt", e.to_string()),
        AdmitError::Duplicate { .. } | AdmitError::Track(_) => {
            ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string())
        }
        AdmitError::TokenCount { .. }
        | AdmitError::BlockCount { .. }
        | AdmitError::BlockOutOfRange { .. }
        | AdmitError::TpSize { .. } => match e.field() {
            Some(f) => ApiError::bad_field(format!("kv_transfer_params.{f}"), e.to_string()),
            None => ApiError::bad_field("kv_transfer_params", e.to_string()),
        },
    }
}
