//! The decode engine (D): one engine thread runs the forward loop over `tp_size` workers,
//! each with its own block pool and transport endpoint.
//!
//! A request is **tracked on arrival** (its heartbeats start before it is scheduled: the
//! waiting time is unbounded) and queued; the waiting queue is bounded in length. One step,
//! every `step`:
//! 1. take new requests and aborts from the HTTP layer; an unknown P engine starts the
//!    side-channel handshake on a background thread (preemptive handshake);
//! 2. `start_load_kv`: send every heartbeat batch that is due, one `HB:` message per P
//!    worker of the engine (an engine still handshaking is deferred to a later step);
//! 3. poll notifications: an expiry notice from P fails the request (never output);
//! 4. schedule waiting requests up to `max_running`: allocate D blocks and post, from every
//!    D worker, one fenced read batch per P worker that holds its heads;
//! 5. finish loads: when every batch is done, verify every byte against the request's
//!    tokens and the digest against P's, untrack, report the read complete to each P
//!    worker read from (the batch's notification); a fence mismatch, an expiry notice or a
//!    read failure ends in the failure policy;
//! 6. decode one token for every running request; a finished one frees its blocks.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvlease_gpu_mem::{BlockAllocator, BlockPool, FenceTable, KvHalf, KvLayout, MemoryRequest};
use kvlease_lease::{
    BlockId, ConsumerId, DecoderTtl, EngineId, Event, Generation, HeartbeatTracker, LeaseConfig,
    ReleaseReason, RequestId, Timestamp,
};
use kvlease_notif::{Abort, Notif, ReadComplete};
use kvlease_transport::{Agent, PeerId, RegionDesc};
use tokio::sync::{mpsc, oneshot};

use crate::api::{ApiError, RemoteParams, TransferStats};
use crate::bidir::{self, DecoderHold, DecoderKvParams, PeerClock};
use crate::config::LoadFailurePolicy;
use crate::kv::{self, KvDigest, KvShape, RankLayout};
use crate::link::{self, LinkConfig, LinkStatus, ReadOp};
use crate::metrics::{HandshakeOutcome, Metrics};
use crate::prefill::{EngineError, EngineInfo, WorkerInfo, rank_pool};
use crate::sidechannel;

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
    pub params: RemoteParams,
    /// The request's `conversation_id` (bidirectional mode echoes it).
    pub conversation_id: Option<String>,
    /// When the HTTP layer got it.
    pub arrived: Instant,
    /// Tokens, then the end or the error.
    pub events: mpsc::UnboundedSender<DecodeEvent>,
}

/// What the HTTP layer sends D's engine.
#[derive(Debug)]
pub enum Job {
    /// Decode a request prefilled by P.
    Decode(Box<DecodeJob>),
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
pub enum DecodeEvent {
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
    /// Bidirectional mode: D's cached-blocks params ([`DecoderKvParams`]) for P's next
    /// turn; `None` when D does not keep the turn.
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
pub struct DecodeConfig {
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
    info: EngineInfo,
    peers: Vec<Vec<PeerId>>,
}

enum Remote {
    Handshaking(crossbeam_channel::Receiver<Result<Ready, ApiError>>),
    Ready(Ready),
}

enum Phase {
    Waiting,
    Loading {
        blocks: Vec<BlockId>,
        batches: Vec<Pending>,
        started: Instant,
    },
    Decoding {
        blocks: Vec<BlockId>,
        text: Vec<String>,
        next: usize,
        summary: Summary,
    },
}

struct Pending {
    worker: usize,
    p_rank: u32,
    batch: link::BatchId,
    /// The backend of the peer the batch reads from (`"verbs"` or `"tcp"`), replaced at
    /// completion by the one that moved its bytes (a verbs peer's batches on memory verbs
    /// could not register go over TCP).
    backend: &'static str,
    done: Option<Result<u64, link::Failure>>,
}

struct Req {
    job: DecodeJob,
    remote_id: RequestId,
    engine: EngineId,
    phase: Phase,
    scheduled: Option<Instant>,
    /// The client aborted while reads were in flight: drop the result.
    aborted: bool,
}

/// The D engine; [`run`](Self::run) is its forward loop.
pub struct DecodeEngine {
    cfg: DecodeConfig,
    metrics: Metrics,
    workers: Vec<Worker>,
    tracker: HeartbeatTracker,
    alloc: BlockAllocator,
    remotes: HashMap<EngineId, Remote>,
    reqs: HashMap<RequestId, Req>,
    /// D ids in arrival order, of requests not yet scheduled.
    queue: VecDeque<RequestId>,
    by_remote: HashMap<RequestId, RequestId>,
    epoch: Instant,
    worker_metadata: Vec<Vec<u8>>,
    /// Bidirectional mode: finished turns kept for P (on [`DecodeBidir::clock`]).
    hold: Option<DecoderHold>,
    /// Cached turns in insertion order (some may be gone already), for eviction.
    cache_order: VecDeque<RequestId>,
}

impl DecodeEngine {
    /// Allocates the pools, starts the transport endpoints and registers the memory.
    ///
    /// # Errors
    /// [`EngineError`] naming the step that failed.
    pub fn new(cfg: DecodeConfig, metrics: Metrics) -> Result<Self, EngineError> {
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
            let fence = match cfg.bidir {
                Some(_) => {
                    let f = FenceTable::new(cfg.num_blocks)
                        .map_err(|e| EngineError::setup("fence table", e))?;
                    let d = agent
                        .register(f.region())
                        .map_err(|e| EngineError::setup("register fence", e))?;
                    Some((f, d))
                }
                None => None,
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
        Ok(Self {
            tracker: HeartbeatTracker::new(&cfg.lease),
            alloc: BlockAllocator::new(cfg.num_blocks),
            remotes: HashMap::new(),
            reqs: HashMap::new(),
            queue: VecDeque::new(),
            by_remote: HashMap::new(),
            epoch: Instant::now(),
            worker_metadata,
            hold: cfg
                .bidir
                .as_ref()
                .map(|b| DecoderHold::new(b.ttl, b.symmetric)),
            cache_order: VecDeque::new(),
            cfg,
            metrics,
            workers,
        })
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_duration(self.epoch.elapsed())
    }

    /// What D's side channel serves to P in bidirectional mode (P reads cached blocks with
    /// it); `None` without bidirectional mode.
    pub fn info(&self) -> Option<EngineInfo> {
        self.cfg.bidir.as_ref()?;
        let mut workers = Vec::new();
        for (rank, w) in self.workers.iter().enumerate() {
            let (_, fence) = w.fence.as_ref()?;
            workers.push(WorkerInfo {
                rank: rank as u32,
                metadata: sidechannel::to_hex(&w.agent.metadata()),
                pool: w.pool_desc,
                fence: *fence,
            });
        }
        Some(EngineInfo {
            engine_id: self.cfg.engine_id.to_string(),
            tp_size: self.cfg.tp_size,
            shape: self.cfg.shape,
            num_blocks: self.cfg.num_blocks,
            workers,
        })
    }

    /// The forward loop; returns when `stop` is set or every job sender is gone.
    pub fn run(mut self, jobs: crossbeam_channel::Receiver<Job>, stop: Arc<AtomicBool>) {
        let mut next_step = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            // Wait for the step boundary, taking jobs as they come.
            loop {
                let left = next_step.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match jobs.recv_timeout(left) {
                    Ok(j) => self.intake(j),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => break,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
            }
            next_step = Instant::now() + self.cfg.step;
            while let Ok(j) = jobs.try_recv() {
                self.intake(j);
            }
            self.step();
        }
    }

    fn step(&mut self) {
        self.poll_handshakes();
        self.start_load_kv();
        self.poll_notifs();
        self.drop_gone_clients();
        self.schedule();
        self.finish_loads();
        self.decode_tokens();
        self.expire_cache();
        self.metrics.requests_tracked.set(self.tracker.len() as i64);
        self.metrics.requests_waiting.set(self.queue.len() as i64);
        self.metrics
            .requests_running
            .set((self.reqs.len() - self.queue.len()) as i64);
        self.metrics
            .blocks_held
            .set(self.alloc.allocated_count() as i64);
    }

    // ------------------------------------------------------------ intake

    fn intake(&mut self, job: Job) {
        match job {
            Job::Decode(job) => {
                if let Err((job, e)) = self.admit(job) {
                    let _ = job.events.send(DecodeEvent::Failed(e));
                }
            }
            Job::Abort { id, reply } => {
                let known = self.abort(&id);
                if let Some(reply) = reply {
                    let _ = reply.send(known);
                }
            }
        }
    }

    fn admit(&mut self, job: Box<DecodeJob>) -> Result<(), (Box<DecodeJob>, ApiError)> {
        let p = &job.params;
        let bad = |field: &str, msg: String| {
            ApiError::bad_field(format!("kv_transfer_params.{field}"), msg)
        };
        let engine = match EngineId::new(&p.remote_engine_id) {
            Ok(e) => e,
            Err(e) => return Err((job, bad("remote_engine_id", e.to_string()))),
        };
        let remote_id = match RequestId::new(&p.remote_request_id) {
            Ok(r) => r,
            Err(e) => return Err((job, bad("remote_request_id", e.to_string()))),
        };
        if p.kvlease_num_tokens as usize != job.tokens.len() {
            let msg = format!(
                "P prefilled {} tokens but this prompt has {}",
                p.kvlease_num_tokens,
                job.tokens.len()
            );
            return Err((job, bad("kvlease_num_tokens", msg)));
        }
        let needed = self.cfg.shape.blocks_for(job.tokens.len());
        if p.remote_block_ids.len() != needed {
            let msg = format!(
                "{} block ids for {} tokens (need {needed})",
                p.remote_block_ids.len(),
                job.tokens.len()
            );
            return Err((job, bad("remote_block_ids", msg)));
        }
        if needed > self.cfg.num_blocks as usize {
            let msg = format!(
                "{needed} blocks exceed this engine's pool of {}",
                self.cfg.num_blocks
            );
            return Err((job, ApiError::bad_field("prompt", msg)));
        }
        if !self.cfg.shape.num_kv_heads.is_multiple_of(p.tp_size) {
            let msg = format!(
                "{} does not divide num_kv_heads {}",
                p.tp_size, self.cfg.shape.num_kv_heads
            );
            return Err((job, bad("tp_size", msg)));
        }
        if self.reqs.contains_key(&job.id) || self.by_remote.contains_key(&remote_id) {
            let e = ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("request {} is already running", job.id),
            );
            return Err((job, e));
        }
        if self.queue.len() >= self.cfg.max_waiting as usize {
            // Tell P at once that nobody will read these blocks.
            self.send_abort(&engine, &remote_id);
            let e = ApiError::overloaded(format!(
                "the waiting queue is full ({} requests)",
                self.cfg.max_waiting
            ));
            return Err((job, e));
        }
        let now = self.now();
        //= docs/spec.md#tracking
        //# heartbeating starts when a request with `do_remote_prefill=true` enters
        //# D's scheduler (`on_new_request`), not when it is scheduled
        if let Err(e) = self
            .tracker
            .track(now, remote_id.clone(), engine.clone(), p.tp_size)
        {
            let e = ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string());
            return Err((job, e));
        }
        if !self.remotes.contains_key(&engine) {
            self.start_handshake(&engine, &p.remote_host, p.remote_port);
        }
        self.by_remote.insert(remote_id.clone(), job.id.clone());
        self.queue.push_back(job.id.clone());
        self.reqs.insert(
            job.id.clone(),
            Req {
                job: *job,
                remote_id,
                engine,
                phase: Phase::Waiting,
                scheduled: None,
                aborted: false,
            },
        );
        Ok(())
    }

    // ------------------------------------------------------------ handshake

    fn start_handshake(&mut self, engine: &EngineId, host: &str, port: u16) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let want = engine.clone();
        let token = self.cfg.link.auth_token.clone();
        let me = self.cfg.engine_id.to_string();
        let tp = self.cfg.tp_size;
        let mds = self.worker_metadata.clone();
        let agents: Vec<Arc<Agent>> = self.workers.iter().map(|w| Arc::clone(&w.agent)).collect();
        let shape = self.cfg.shape;
        let spawned = std::thread::Builder::new()
            .name("d-handshake".into())
            .spawn(move || {
                let r = handshake(
                    &addr,
                    token.as_deref(),
                    &me,
                    tp,
                    &mds,
                    &want,
                    shape,
                    &agents,
                );
                let _ = tx.send(r);
            });
        match spawned {
            Ok(_) => {
                self.remotes.insert(engine.clone(), Remote::Handshaking(rx));
            }
            Err(e) => tracing::error!(error = %e, "cannot spawn the handshake thread"),
        }
    }

    fn poll_handshakes(&mut self) {
        let mut failed = Vec::new();
        let mut ready = Vec::new();
        for (engine, remote) in &mut self.remotes {
            let Remote::Handshaking(rx) = remote else {
                continue;
            };
            match rx.try_recv() {
                Ok(Ok(r)) => {
                    *remote = Remote::Ready(r);
                    ready.push(engine.clone());
                }
                Ok(Err(e)) => failed.push((engine.clone(), e)),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
                Err(crossbeam_channel::TryRecvError::Disconnected) => failed.push((
                    engine.clone(),
                    ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "handshake_failed",
                        "handshake thread died",
                    ),
                )),
            }
        }
        for engine in ready {
            self.metrics.handshake(HandshakeOutcome::Ok).inc();
            let first_peer = match self.remotes.get(&engine) {
                Some(Remote::Ready(r)) => r.peers.first().and_then(|p| p.first()).copied(),
                _ => None,
            };
            if let (Some(w0), Some(peer)) = (self.workers.first(), first_peer) {
                let name = link::backend_name(&w0.agent, peer);
                self.metrics
                    .set_peer_backend(engine.as_str(), link::backend_metric(name));
                let reason = link::backend_reason(&w0.agent, peer);
                tracing::info!(%engine, backend = name, %reason, "handshake complete");
            } else {
                tracing::info!(%engine, "handshake complete");
            }
            // Heartbeat the engine's requests now rather than an interval later.
            self.tracker.defer(&engine, self.now());
        }
        for (engine, e) in failed {
            let outcome = if e.kind == "peer_auth_failed" {
                HandshakeOutcome::AuthFailed
            } else {
                HandshakeOutcome::Failed
            };
            self.metrics.handshake(outcome).inc();
            tracing::warn!(%engine, error = %e.message, "handshake failed");
            self.remotes.remove(&engine);
            let victims: Vec<RequestId> = self
                .reqs
                .iter()
                .filter(|(_, r)| r.engine == engine)
                .map(|(id, _)| id.clone())
                .collect();
            for id in victims {
                self.finish(&id, Err(e.clone()));
            }
        }
    }

    // ------------------------------------------------------------ heartbeats

    fn start_load_kv(&mut self) {
        let now = self.now();
        let retry = now + self.cfg.step;
        while let Some(batch) = self.tracker.poll_heartbeat(now) {
            let Some(Remote::Ready(ready)) = self.remotes.get(&batch.engine) else {
                // Still handshaking: heartbeat on a later step (preemptive handshake).
                self.tracker.defer(&batch.engine, retry);
                continue;
            };
            let msgs = match kvlease_notif::encode_heartbeats(
                &batch.requests,
                kvlease_notif::MAX_NOTIF_LEN,
            ) {
                Ok(m) => m,
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode heartbeats");
                    continue;
                }
            };
            let (Some(w0), Some(peers)) = (self.workers.first(), ready.peers.first()) else {
                continue;
            };
            for &peer in peers {
                for m in &msgs {
                    match w0.agent.send_notif(peer, m.clone()) {
                        Ok(()) => {
                            self.metrics.heartbeats_sent.inc();
                        }
                        Err(e) => {
                            tracing::warn!(engine = %batch.engine, error = %e, "heartbeat not sent")
                        }
                    }
                }
            }
            self.metrics
                .heartbeat_ids_sent
                .inc_by((batch.requests.len() * peers.len()) as u64);
        }
    }

    fn send_abort(&self, engine: &EngineId, remote_id: &RequestId) {
        let Some(Remote::Ready(ready)) = self.remotes.get(engine) else {
            return;
        };
        let (Some(w0), Some(peers)) = (self.workers.first(), ready.peers.first()) else {
            return;
        };
        let msg = Abort {
            request: remote_id.clone(),
            consumer: ConsumerId::new(self.cfg.engine_id.clone(), 0),
        }
        .encode();
        for &peer in peers {
            if let Err(e) = w0.agent.send_notif(peer, msg.clone()) {
                tracing::warn!(%engine, error = %e, "abort notice not sent");
            }
        }
    }

    // ------------------------------------------------------------ notifications

    fn poll_notifs(&mut self) {
        let mut notices = Vec::new();
        let mut pulled = Vec::new();
        let mut cache_heartbeats: Vec<RequestId> = Vec::new();
        for w in &self.workers {
            for (from, msgs) in w.agent.get_new_notifs() {
                for m in msgs {
                    match kvlease_notif::decode(&m) {
                        Ok(Notif::Expired(leases)) => {
                            self.metrics.expiry_notices_received.inc();
                            notices.extend(
                                leases.into_iter().map(|l| (l.request, l.generation.word())),
                            );
                        }
                        Ok(Notif::ReadComplete(rc)) if self.hold.is_some() => {
                            pulled.push(rc.request);
                        }
                        Ok(Notif::Heartbeat(ids)) if self.hold.is_some() => {
                            cache_heartbeats
                                .extend(ids.iter().filter_map(|i| RequestId::new(i).ok()));
                        }
                        Ok(other) => tracing::debug!(?other, %from, "notification ignored"),
                        Err(e) => {
                            self.metrics.notif_malformed.inc();
                            tracing::debug!(error = %e, %from, "malformed notification");
                        }
                    }
                }
            }
        }
        if let (Some(b), Some(hold)) = (&self.cfg.bidir, self.hold.as_mut()) {
            let now = b.clock.now();
            if !cache_heartbeats.is_empty() {
                hold.heartbeat(now, &cache_heartbeats);
            }
            for r in &pulled {
                if hold.read_complete(now, r) {
                    self.metrics.decoder_cache_pulled.inc();
                }
            }
            self.drain_cache();
        }
        for (remote_id, generation) in notices {
            let Some(id) = self.by_remote.get(&remote_id).cloned() else {
                continue;
            };
            let Some(req) = self.reqs.get_mut(&id) else {
                continue;
            };
            if req.job.params.kvlease_generation != generation {
                continue;
            }
            match req.phase {
                Phase::Waiting => {
                    let e = self.load_failure(format!(
                        "P reclaimed the lease of {remote_id} before it was read"
                    ));
                    self.finish(&id, Err(e));
                }
                // In flight: the fence decides. P publishes the free word before it frees
                // the blocks, so a read that still matched its fence never saw a reused
                // byte, whenever the notice arrives.
                Phase::Loading { .. } => {}
                // Already read and verified: the notice came late and changes nothing.
                Phase::Decoding { .. } => {}
            }
        }
    }

    fn load_failure(&self, message: String) -> ApiError {
        self.metrics.kv_load_failures.inc();
        match self.cfg.policy {
            LoadFailurePolicy::Recompute => ApiError::kv_load_failed(message),
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "kv_load_error", message),
        }
    }

    // ------------------------------------------------------------ abort and cleanup

    fn abort(&mut self, id: &RequestId) -> bool {
        let id = if self.reqs.contains_key(id) {
            id.clone()
        } else if let Some(d) = self.by_remote.get(id) {
            d.clone()
        } else {
            return false;
        };
        let e = ApiError::new(
            StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            "aborted",
            format!("request {id} was aborted"),
        );
        self.finish(&id, Err(e));
        true
    }

    fn drop_gone_clients(&mut self) {
        let gone: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.job.events.is_closed() && !r.aborted)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.abort(&id);
        }
    }

    /// Ends a request: untracks it, tells P when it had not read yet, answers the client,
    /// frees D's blocks (at once, or when reads in flight complete).
    fn finish(&mut self, id: &RequestId, result: Result<Summary, ApiError>) {
        let Some(req) = self.reqs.get_mut(id) else {
            return;
        };
        let was_tracked = self.tracker.untrack(&req.remote_id);
        let (engine, remote_id) = (req.engine.clone(), req.remote_id.clone());
        match &result {
            Ok(s) => {
                let _ = req.job.events.send(DecodeEvent::Done(s.clone()));
            }
            Err(e) => {
                let _ = req.job.events.send(DecodeEvent::Failed(e.clone()));
            }
        }
        if matches!(req.phase, Phase::Loading { .. }) {
            // The transport still writes into our blocks: keep them until the batches end.
            req.aborted = true;
            if was_tracked {
                self.send_abort(&engine, &remote_id);
            }
            return;
        }
        let Some(req) = self.reqs.remove(id) else {
            return;
        };
        self.by_remote.remove(&req.remote_id);
        self.queue.retain(|q| q != id);
        if let Phase::Decoding { blocks, .. } = &req.phase {
            self.free_blocks(blocks);
        }
        if was_tracked && result.is_err() {
            // Not read (waiting) and P still holds it: a notify-only completion.
            self.send_abort(&engine, &remote_id);
        }
    }

    fn free_blocks(&mut self, blocks: &[BlockId]) {
        if let Err(e) = self.alloc.free(blocks) {
            tracing::error!(error = %e, "block accounting error");
        }
    }

    // ------------------------------------------------------------ scheduling and reads

    fn running(&self) -> usize {
        self.reqs.len() - self.queue.len()
    }

    fn schedule(&mut self) {
        let mut i = 0;
        while i < self.queue.len() && self.running() < self.cfg.max_running as usize {
            let id = self.queue[i].clone();
            let Some(req) = self.reqs.get(&id) else {
                self.queue.remove(i);
                continue;
            };
            if !matches!(self.remotes.get(&req.engine), Some(Remote::Ready(_))) {
                i += 1;
                continue;
            }
            let needed = req.job.params.remote_block_ids.len();
            // Cached turns give way to new requests, oldest first.
            while self.alloc.free_count() < needed && self.evict_oldest_cached() {}
            let Ok(blocks) = self.alloc.alloc(needed) else {
                // D's pool is full: wait for running requests to finish.
                return;
            };
            self.queue.remove(i);
            self.start_reads(&id, blocks);
        }
    }

    fn start_reads(&mut self, id: &RequestId, blocks: Vec<BlockId>) {
        let Some(req) = self.reqs.get(id) else { return };
        let Some(Remote::Ready(ready)) = self.remotes.get(&req.engine) else {
            return;
        };
        let p = &req.job.params;
        let p_tp = ready.info.tp_size;
        let p_heads = self.cfg.shape.num_kv_heads / p_tp.max(1);
        // Every (D worker, P worker) pair whose heads overlap is one read batch and one
        // consumer of the lease: P must not free before the last of them reported, or the
        // fence of a batch still running on another P worker would (rightly) fail it.
        let overlaps = |w: &Worker, p_rank: u32| {
            let (lo, hi) = (p_rank * p_heads, (p_rank + 1) * p_heads);
            w.layout.heads.start.max(lo) < w.layout.heads.end.min(hi)
        };
        let consumers_total = self
            .workers
            .iter()
            .map(|w| (0..p_tp).filter(|&p| overlaps(w, p)).count() as u32)
            .sum::<u32>()
            .max(1);
        let mut batches = Vec::new();
        let mut error = None;
        'workers: for (wi, w) in self.workers.iter().enumerate() {
            for p_rank in 0..p_tp {
                let p_range = p_rank * p_heads..(p_rank + 1) * p_heads;
                let lo = w.layout.heads.start.max(p_range.start);
                let hi = w.layout.heads.end.min(p_range.end);
                if lo >= hi {
                    continue;
                }
                let (Some(pw), Some(&peer)) = (
                    ready.info.workers.get(p_rank as usize),
                    ready.peers.get(wi).and_then(|v| v.get(p_rank as usize)),
                ) else {
                    error = Some(format!("P worker {p_rank} is not connected"));
                    break 'workers;
                };
                match build_ops(
                    w,
                    pw,
                    &ready.info,
                    &blocks,
                    &p.remote_block_ids,
                    lo..hi,
                    p_range.start,
                ) {
                    Ok(ops) => {
                        let notif = ReadComplete {
                            request: req.remote_id.clone(),
                            consumer: ConsumerId::new(
                                self.cfg.engine_id.clone(),
                                wi as u32 * p_tp + p_rank,
                            ),
                            consumers_total,
                        }
                        .encode();
                        let first = p.remote_block_ids.first().copied().unwrap_or(0);
                        let fence = link::Fence {
                            region: pw.fence,
                            offset: u64::from(first) * FenceTable::WORD_BYTES,
                            expected: p.kvlease_generation,
                        };
                        match link::post_read(
                            &w.agent,
                            peer,
                            ops,
                            Some(notif),
                            Some(fence),
                            self.cfg.read_timeout,
                        ) {
                            Ok(batch) => batches.push(Pending {
                                worker: wi,
                                p_rank,
                                batch,
                                backend: link::backend_name(&w.agent, peer),
                                done: None,
                            }),
                            Err(e) => {
                                error = Some(e);
                                break 'workers;
                            }
                        }
                    }
                    Err(e) => {
                        error = Some(e);
                        break 'workers;
                    }
                }
            }
        }
        if let Some(e) = error
            && batches.is_empty()
        {
            self.free_blocks(&blocks);
            let err = self.load_failure(format!("cannot post the reads: {e}"));
            self.finish(id, Err(err));
            return;
        }
        if let Some(req) = self.reqs.get_mut(id) {
            let now = Instant::now();
            self.metrics
                .queue_wait_seconds
                .observe(now.duration_since(req.job.arrived).as_secs_f64());
            req.scheduled = Some(now);
            req.phase = Phase::Loading {
                blocks,
                batches,
                started: now,
            };
        }
    }

    fn finish_loads(&mut self) {
        let loading: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| matches!(r.phase, Phase::Loading { .. }))
            .map(|(id, _)| id.clone())
            .collect();
        for id in loading {
            let Some(req) = self.reqs.get_mut(&id) else {
                continue;
            };
            let Phase::Loading { batches, .. } = &mut req.phase else {
                continue;
            };
            let mut all_done = true;
            for b in batches.iter_mut() {
                if b.done.is_none() {
                    let agent = &self.workers[b.worker].agent;
                    match link::poll(agent, b.batch) {
                        LinkStatus::Pending => all_done = false,
                        LinkStatus::Done { bytes, backend } => {
                            b.backend = backend;
                            b.done = Some(Ok(bytes));
                        }
                        LinkStatus::Failed(f) => b.done = Some(Err(f)),
                    }
                }
            }
            if all_done {
                self.complete_load(&id);
            }
        }
    }

    fn complete_load(&mut self, id: &RequestId) {
        let Some(mut req) = self.reqs.remove(id) else {
            return;
        };
        let Phase::Loading {
            blocks,
            batches,
            started,
        } = std::mem::replace(&mut req.phase, Phase::Waiting)
        else {
            self.reqs.insert(id.clone(), req);
            return;
        };
        let read_time = started.elapsed();
        self.metrics.read_seconds.observe(read_time.as_secs_f64());
        if req.aborted {
            // Answered already; the reads are over, so the blocks can go.
            self.by_remote.remove(&req.remote_id);
            self.free_blocks(&blocks);
            return;
        }
        let mut bytes = 0u64;
        let mut failure = None;
        for b in &batches {
            match &b.done {
                Some(Ok(n)) => bytes += n,
                Some(Err(f)) => {
                    if f.stale {
                        self.metrics.stale_reads.inc();
                    }
                    failure.get_or_insert_with(|| {
                        format!("read from P worker {}: {}", b.p_rank, f.message)
                    });
                }
                None => {}
            }
        }
        self.metrics.transfer_bytes.inc_by(bytes);
        let result = match failure {
            Some(f) => Err(f),
            None => self.verify(&req, &blocks),
        };
        self.reqs.insert(id.clone(), req);
        match result {
            Err(message) => {
                self.free_blocks(&blocks);
                if let Some(r) = self.reqs.get_mut(id) {
                    r.phase = Phase::Waiting;
                }
                let e = self.load_failure(message);
                self.finish_unscheduled(id, e);
            }
            Ok(digest) => {
                let Some(req) = self.reqs.get_mut(id) else {
                    return;
                };
                //= docs/spec.md#tracking
                //# Tracking stops when the KV transfer completes
                self.tracker.untrack(&req.remote_id);
                // One transfer per request: verbs when every batch of it went over verbs.
                let backend = if batches.iter().all(|b| b.backend == "verbs") {
                    "verbs"
                } else {
                    "tcp"
                };
                self.metrics.transfer(link::backend_metric(backend)).inc();
                let queue_ms = req.scheduled.map_or(0.0, |s| {
                    s.duration_since(req.job.arrived).as_secs_f64() * 1e3
                });
                let summary = Summary {
                    kv_digest: digest.to_string(),
                    stats: TransferStats {
                        bytes,
                        backend: backend.to_owned(),
                        queue_time_ms: queue_ms,
                        read_time_ms: read_time.as_secs_f64() * 1e3,
                        remote_workers: batches.len() as u32,
                    },
                    kv_transfer_params: None,
                };
                req.phase = Phase::Decoding {
                    blocks,
                    text: kv::decode_text(digest, req.job.max_tokens as usize),
                    next: 0,
                    summary,
                };
            }
        }
    }

    /// Fails a request whose D blocks were already freed.
    fn finish_unscheduled(&mut self, id: &RequestId, e: ApiError) {
        let Some(req) = self.reqs.remove(id) else {
            return;
        };
        self.tracker.untrack(&req.remote_id);
        self.by_remote.remove(&req.remote_id);
        let _ = req.job.events.send(DecodeEvent::Failed(e));
        // P's lease: released by the completions already sent (the batch notification) or
        // expired; nothing more to tell it.
    }

    fn verify(&self, req: &Req, blocks: &[BlockId]) -> Result<KvDigest, String> {
        let hashes = kv::prefix_hashes(&req.job.tokens);
        let results: Vec<Result<KvDigest, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter()
                .map(|w| {
                    let hashes = &hashes;
                    s.spawn(move || verify_worker(w, blocks, hashes))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("verify thread panicked".to_owned()))
                })
                .collect()
        });
        let mut digest = KvDigest::default();
        for r in results {
            digest.add(r?);
        }
        let want = KvDigest::parse(&req.job.params.kv_digest).unwrap_or_default();
        if digest != want {
            return Err(format!(
                "kv_digest mismatch: read {digest}, P published {want}"
            ));
        }
        Ok(digest)
    }

    fn decode_tokens(&mut self) {
        let mut done = Vec::new();
        for (id, req) in &mut self.reqs {
            let Phase::Decoding { text, next, .. } = &mut req.phase else {
                continue;
            };
            if let Some(t) = text.get(*next) {
                let _ = req.job.events.send(DecodeEvent::Token(t.clone()));
                *next += 1;
                self.metrics.decode_tokens.inc();
            }
            if *next >= text.len() {
                done.push(id.clone());
            }
        }
        for id in done {
            let Some(req) = self.reqs.get(&id) else {
                continue;
            };
            let Phase::Decoding { summary, .. } = &req.phase else {
                continue;
            };
            let mut s = summary.clone();
            s.kv_transfer_params = self.keep_for_next_turn(&id);
            self.finish(&id, Ok(s));
        }
    }
}

impl DecodeEngine {
    // ------------------------------------------------------------ bidirectional mode

    /// Moves a finished request's blocks into the hold and answers D's cached-blocks
    /// params; `None` (the blocks stay with the request and are freed) without
    /// bidirectional mode or when the hold refuses.
    fn keep_for_next_turn(&mut self, id: &RequestId) -> Option<serde_json::Value> {
        let b = self.cfg.bidir.as_ref()?;
        let hold = self.hold.as_mut()?;
        let req = self.reqs.get_mut(id)?;
        let Phase::Decoding { blocks, .. } = &mut req.phase else {
            return None;
        };
        let cache_id = RequestId::new(&format!("turn-{}", req.job.id)).ok()?;
        // P pulls these blocks: a verbs-mirrored pool must hold them in its mirror (reads
        // that came over TCP wrote the pool only).
        let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
        for w in &self.workers {
            let region = kvlease_transport::RegionId(w.pool_desc.id);
            if let Err(e) = crate::prefill::sync_blocks_for_peers(&w.agent, region, &w.pool, &ids) {
                tracing::warn!(request = %id, error = %e, "cannot sync the turn's blocks for peers; freeing them");
                return None;
            }
        }
        let now = b.clock.now();
        let held = match hold.insert(now, cache_id.clone(), blocks.clone()) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "cannot keep the turn's blocks; freeing them");
                return None;
            }
        };
        let blocks = std::mem::take(blocks);
        self.cache_order.push_back(cache_id.clone());
        for w in &self.workers {
            if let Some((f, _)) = &w.fence
                && let Err(e) = f.publish(&blocks, held.generation.word())
            {
                tracing::error!(error = %e, "fence publish failed");
            }
        }
        let tokens = &req.job.tokens;
        let bs = self.cfg.shape.block_size;
        let deadline_ns = held.deadline.as_nanos_saturating();
        let params = DecoderKvParams {
            kvlease_bidir: true,
            remote_engine_id: self.cfg.engine_id.to_string(),
            remote_host: b.advertise_host.clone(),
            remote_port: b.side_channel_port,
            kvlease_clock_port: b.clock_port,
            remote_block_ids: blocks.iter().map(|b| b.0).collect(),
            remote_request_id: cache_id.to_string(),
            tp_size: self.cfg.tp_size,
            kvlease_generation: held.generation.word(),
            conversation_id: req.job.conversation_id.clone().unwrap_or_default(),
            kvlease_num_tokens: tokens.len() as u32,
            kvlease_block_size: bs,
            kvlease_block_hashes: bidir::block_hashes(tokens, bs)
                .into_iter()
                .map(|h| format!("{h:016x}"))
                .collect(),
            kvlease_deadline_ns: deadline_ns,
            kvlease_ttl_remaining_ms: deadline_ns.saturating_sub(now.as_nanos_saturating())
                / 1_000_000,
            kvlease_renew_extension_ms: match &*hold {
                DecoderHold::Symmetric(t) => t.config().extension().as_millis() as u64,
                DecoderHold::Fixed(_) => 0,
            },
        };
        self.metrics
            .decoder_cached_blocks
            .set(hold.blocks_held() as i64);
        Some(params.to_value())
    }

    /// Frees the oldest cached turn still held, so that a new request gets its blocks;
    /// false when none is left.
    fn evict_oldest_cached(&mut self) -> bool {
        let Some(b) = &self.cfg.bidir else {
            return false;
        };
        let now = b.clock.now();
        let Some(hold) = self.hold.as_mut() else {
            return false;
        };
        while let Some(id) = self.cache_order.pop_front() {
            if hold.read_complete(now, &id) {
                self.metrics.decoder_cache_evicted.inc();
                tracing::info!(request = %id, "cached turn evicted for a new request");
                self.drain_cache();
                return true;
            }
        }
        false
    }

    /// Frees the cached turns whose TTL passed.
    fn expire_cache(&mut self) {
        if let (Some(b), Some(hold)) = (&self.cfg.bidir, self.hold.as_mut()) {
            hold.handle_timeout(b.clock.now());
            self.drain_cache();
        }
    }

    /// Frees what the hold released: the free word first (a pull still in flight fails its
    /// fence), then the blocks.
    fn drain_cache(&mut self) {
        let Some(hold) = self.hold.as_mut() else {
            return;
        };
        let mut released = Vec::new();
        while let Some(Event::Released(r)) = hold.poll_event() {
            released.push(r);
        }
        let held = hold.blocks_held();
        if held == 0 {
            self.cache_order.clear();
        }
        for r in released {
            for w in &self.workers {
                if let Some((f, _)) = &w.fence
                    && let Err(e) = f.publish(&r.blocks, Generation::FREE_WORD)
                {
                    tracing::error!(error = %e, "fence publish failed");
                }
            }
            self.free_blocks(&r.blocks);
            if r.reason == ReleaseReason::Expired {
                self.metrics.decoder_cache_expired.inc();
                tracing::info!(request = %r.request, "cached turn expired; blocks freed");
            }
        }
        self.metrics.decoder_cached_blocks.set(held as i64);
    }
}

fn verify_worker(w: &Worker, blocks: &[BlockId], hashes: &[u64]) -> Result<KvDigest, String> {
    let mut digest = KvDigest::default();
    let mut buf = vec![0u8; w.layout.block_bytes()];
    let mut result = Ok(());
    kv::for_each_block(&w.layout.shape, hashes, |layer, i, first, hs| {
        if result.is_err() {
            return;
        }
        // Host memory directly, device memory through a staged copy.
        let r = w
            .pool
            .read_block(layer, blocks[i], &mut buf)
            .map_err(|e| e.to_string());
        if let Err(e) = r {
            result = Err(e);
            return;
        }
        if let Some(m) = kv::verify_block(&w.layout, &buf, layer, first, hs) {
            result = Err(format!(
                "KV mismatch at layer {} position {} {} head {}",
                m.layer,
                m.pos,
                if m.kv == 0 { "K" } else { "V" },
                m.head
            ));
            return;
        }
        digest.add(kv::digest_block(&w.layout, &buf, layer, first, hs.len()));
    });
    result.map(|()| digest)
}

/// The read ops that copy global heads `heads` of the request's blocks from P worker `pw`
/// (whose first global head is `p_first`) into D worker `w`'s blocks.
fn build_ops(
    w: &Worker,
    pw: &WorkerInfo,
    info: &EngineInfo,
    d_blocks: &[BlockId],
    p_blocks: &[u32],
    heads: std::ops::Range<u32>,
    p_first: u32,
) -> Result<Vec<ReadOp>, String> {
    let p_layout = KvLayout::new(
        info.shape.num_layers,
        info.num_blocks,
        info.shape.num_kv_heads / info.tp_size.max(1),
        info.shape.block_size,
        info.shape.head_dim,
        kv::DTYPE_BYTES as u32,
    )
    .map_err(|e| e.to_string())?;
    let d_first = w.layout.heads.start;
    let d_range = heads.start - d_first..heads.end - d_first;
    let p_range = heads.start - p_first..heads.end - p_first;
    let mut ops = Vec::new();
    for layer in 0..info.shape.num_layers {
        for (&db, &pb) in d_blocks.iter().zip(p_blocks) {
            for half in [KvHalf::K, KvHalf::V] {
                let local = w
                    .pool
                    .layout()
                    .heads_range(layer, db, half, d_range.clone())
                    .map_err(|e| e.to_string())?;
                let remote = p_layout
                    .heads_range(layer, BlockId(pb), half, p_range.clone())
                    .map_err(|e| format!("remote block {pb}: {e}"))?;
                ops.push(ReadOp {
                    local: w.pool_desc,
                    local_offset: local.start,
                    remote: pw.pool,
                    remote_offset: remote.start,
                    len: local.end - local.start,
                });
            }
        }
    }
    Ok(ops)
}

#[allow(clippy::too_many_arguments)]
fn handshake(
    addr: &str,
    token: Option<&str>,
    me: &str,
    tp: u32,
    mds: &[Vec<u8>],
    want: &EngineId,
    shape: KvShape,
    agents: &[Arc<Agent>],
) -> Result<Ready, ApiError> {
    let unknown = |msg: String| {
        let mut e = ApiError::bad_field("kv_transfer_params.remote_engine_id", msg);
        e.status = StatusCode::BAD_REQUEST;
        e
    };
    let welcome = sidechannel::handshake(addr, token, me, tp, mds).map_err(|e| match e {
        sidechannel::HandshakeError::Auth { .. } => ApiError::new(
            StatusCode::FORBIDDEN,
            "peer_auth_failed",
            format!(
                "unknown engine {want}: {e} (check --auth-token / KVLEASE_AUTH_TOKEN on both sides)"
            ),
        ),
        other => unknown(format!(
            "unknown engine {want}: side channel at {addr} failed: {other}"
        )),
    })?;
    let info: EngineInfo = serde_json::from_value(welcome.info)
        .map_err(|e| unknown(format!("side channel at {addr} sent bad engine info: {e}")))?;
    if info.engine_id != want.as_str() {
        return Err(unknown(format!(
            "unknown engine {want}: the side channel at {addr} serves engine {}",
            info.engine_id
        )));
    }
    if info.shape != shape {
        return Err(unknown(format!(
            "engine {want} has model shape {:?}, this engine {shape:?}",
            info.shape
        )));
    }
    let mut peers = Vec::new();
    for agent in agents {
        let mut row = Vec::new();
        for w in &info.workers {
            let md = sidechannel::from_hex(&w.metadata)
                .ok_or_else(|| unknown(format!("engine {want}: bad worker metadata")))?;
            let peer = agent.connect(&md).map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "handshake_failed",
                    format!("cannot connect to engine {want} worker {}: {e}", w.rank),
                )
            })?;
            row.push(peer);
        }
        peers.push(row);
    }
    Ok(Ready { info, peers })
}
