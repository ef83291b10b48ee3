//! The prefill engine (P): one engine thread runs the forward loop over `tp_size` workers,
//! each with its own block pool, fence table and transport endpoint.
//!
//! One step:
//! 1. take new requests from the HTTP layer;
//! 2. prefill the waiting ones in arrival order: allocate blocks (the same block ids on
//!    every worker, as in vLLM), spend the per-token cost, fill every worker's blocks with
//!    the deterministic KV ([`crate::kv`]), grant the lease, publish its generation in every
//!    worker's fence words, answer with `kv_transfer_params`. A request that finds the pool
//!    full waits (head of line) up to `pool_wait`, then gets a 503;
//! 3. poll every worker's notifications and route them: `HB:` renews leases, read
//!    completions and aborts release them, anything malformed is counted;
//! 4. reap expired leases; every release publishes the free word before the blocks go
//!    back to the allocator, and an expiry is announced to the D that heartbeated it.
//!
//! There is no heartbeat thread: heartbeats are handled in step 3 (SPEC, "Forward loop").

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvlease_engine::{
    DecoderKvParams, Peer, PrefillAction, PrefillConfig, PrefillCore, PrefillError, PrefillEvent,
    PrefillNotif, PullPolicy, TurnHeartbeats,
};
use kvlease_gpu_mem::{BlockPool, FenceTable, KvLayout, MemoryRequest};
use kvlease_lease::{
    BlockId, EngineId, Generation, LeaseConfig, ReleaseReason, Released, RequestId, Timestamp,
};
use kvlease_proto::engine_info::EngineInfo;
use kvlease_proto::params::KvTransferParams;
use kvlease_transport::{Agent, PeerId, RegionDesc, RegionId};
use tokio::sync::oneshot;

use crate::api::ApiError;
use crate::bidir::{PeerClock, probe_clock};
use crate::kv::{self, KvDigest, KvShape, RankLayout};
use crate::link::{self, LinkConfig};
use crate::metrics::{self, Metrics};
use crate::shell::{EngineError, PeerEngine, host_port, instance_now, rank_pool, worker_info};
use crate::sidechannel::{self, Hello};

mod connect_back;
mod fill;
mod pull;
mod push;

pub use connect_back::Registrar;

pub use fill::FillError;
use fill::fill_workers;
pub(crate) use fill::sync_blocks_for_peers;
pub use pull::PullError;

/// A prefill request handed from HTTP to the engine.
#[derive(Debug)]
pub struct Job {
    /// The request id (also P's `remote_request_id`).
    pub id: RequestId,
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// When the HTTP layer got it.
    pub arrived: Instant,
    /// Bidirectional mode: D's cached-blocks params of the previous turn, to pull the
    /// shared prefix from.
    pub decoder: Option<DecoderKvParams>,
    /// Push mode: the leg's transfer id (`kv_transfer_params.transfer_id`).
    pub push: Option<RequestId>,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Prefilled, ApiError>>,
}

/// A finished prefill.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// What D needs.
    pub params: KvTransferParams,
    /// Push mode: the `kv_transfer_params` answered instead of `params` (P's identity
    /// and the transfer).
    pub push_params: Option<serde_json::Value>,
    /// The digest of the KV P filled (also in `params`).
    pub kv_digest: KvDigest,
    /// Time spent computing and filling.
    pub prefill_ms: f64,
    /// Time spent waiting for free blocks.
    pub pool_wait_ms: f64,
    /// Prompt tokens whose KV was read from D's cached turn instead of computed.
    pub cached_tokens_pulled: u32,
}

/// P's bidirectional mode: pull a next turn's shared prefix from D.
#[derive(Debug, Clone)]
pub struct PrefillBidir {
    /// Threshold, safety margin and deadline basis.
    pub policy: PullPolicy,
    /// P's clock (the deadline check and the clock probe use it).
    pub clock: PeerClock,
    /// Limit for the pull's reads.
    pub read_timeout: Duration,
    /// `symmetric_decoder_lease`: heartbeat D's cached entries while their next-turn
    /// requests wait on P.
    pub symmetric: bool,
}

/// Clock-probe round trips per pull (the lowest-RTT one is kept).
const PROBE_SAMPLES: u32 = 8;
/// Bandwidth assumed for the expected transfer time that the safety margin adds.
const ASSUMED_PULL_BYTES_PER_SEC: f64 = 1e9;

/// A handshaken D engine: per P worker, its peers on the D workers that share heads with
/// it, with their ranks (D's worker of the same rank when the TP sizes are equal).
struct DRemote {
    info: PeerEngine,
    peers: Vec<Vec<(u32, PeerId)>>,
}

impl DRemote {
    /// P's worker 0's peer on D's worker 0 (both hold head 0): the link P's messages to
    /// D go over.
    fn first_peer(&self) -> Option<PeerId> {
        self.peers.first()?.first().map(|&(_, p)| p)
    }

    /// Whether D's TP size is P's (`tp_size`): each P worker has one peer, D's worker of
    /// its rank.
    fn same_tp(&self, tp_size: u32) -> bool {
        self.info.tp_size == tp_size
            && self
                .peers
                .iter()
                .zip(0u32..)
                .all(|(row, rank)| matches!(row.as_slice(), [(r, _)] if *r == rank))
    }
}

/// How to build a P engine.
#[derive(Debug, Clone)]
pub struct PrefillAgentConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// Workers.
    pub tp_size: u32,
    /// Model shape (global heads).
    pub shape: KvShape,
    /// Blocks per worker pool.
    pub num_blocks: u32,
    /// Lease timing and mode.
    pub lease: LeaseConfig,
    /// Stand-in for the model's compute.
    pub cost_per_token: Duration,
    /// How long a request may wait for free blocks before a 503.
    pub pool_wait: Duration,
    /// Host D should use for the side channel (`remote_host`).
    pub advertise_host: String,
    /// Port of the side channel (`remote_port`).
    pub side_channel_port: u16,
    /// Pool memory kind.
    pub memory: MemoryRequest,
    /// Transport settings.
    pub link: LinkConfig,
    /// Bidirectional mode; `None` ignores D's cached-blocks params (always computes).
    pub bidir: Option<PrefillBidir>,
    /// `--connect-back-any-host`: connect back to D workers wherever their metadata
    /// points; `false` only to those on the address D's handshake came from
    /// (the same address, or both on loopback).
    pub connect_back_any_host: bool,
    /// `--transfer-mode`.
    pub transfer_mode: crate::config::TransferMode,
}

/// Whether P may connect back to a D worker listening on `worker` when D's side-channel
/// handshake came from `peer`: the same address (an IPv4-mapped IPv6 address counts as
/// IPv4), or both on loopback.
pub(crate) fn same_host(peer: std::net::IpAddr, worker: std::net::IpAddr) -> bool {
    let canon = |ip: std::net::IpAddr| match ip {
        std::net::IpAddr::V6(v6) => v6.to_canonical(),
        v4 => v4,
    };
    let (peer, worker) = (canon(peer), canon(worker));
    peer == worker || (peer.is_loopback() && worker.is_loopback())
}

struct Worker {
    layout: RankLayout,
    pool: BlockPool,
    fence: FenceTable,
    agent: Arc<Agent>,
    /// The block pool region, as registered.
    pool_desc: RegionDesc,
    /// The fence words region, as registered.
    fence_desc: RegionDesc,
}

/// A connection back to a D worker, made off the engine thread.
struct ConnectedBack {
    engine: String,
    instance: u64,
    name: String,
    peer: Option<PeerId>,
}

/// The shell's side of a request the core holds (queued or prefilling).
struct Pending {
    job: Job,
    since: Instant,
}

/// The P engine; [`run`](Self::run) is its forward loop. It drives a [`PrefillCore`] (every
/// lease decision) and does the IO: pools, fence words, transport endpoints, the compute
/// stand-in, the client's answer.
pub struct PrefillEngine {
    cfg: PrefillAgentConfig,
    metrics: Metrics,
    workers: Vec<Worker>,
    core: PrefillCore<String>,
    /// This instance (the wall clock in µs at start).
    instance: u64,
    /// Jobs the core holds, by request id.
    jobs: HashMap<RequestId, Pending>,
    epoch: Instant,
    /// D workers reachable for expiry notices, by transport name (connected from worker 0).
    d_peers: HashMap<String, PeerId>,
    /// The D engines registered on the side channel (shared with the side channel's
    /// [`Registrar`]): a notification is taken only from a connection that speaks for one.
    registry: Arc<std::sync::Mutex<kvlease_engine::registry::Registry>>,
    /// Registrations the registrar took (taken before every notification poll, so that a
    /// D's registration is known before its first notification).
    registrations: (
        crossbeam_channel::Sender<connect_back::Registration>,
        crossbeam_channel::Receiver<connect_back::Registration>,
    ),
    /// D workers being connected to (off the engine thread).
    connecting: std::collections::HashSet<String>,
    /// Connections made off the engine thread: (D instance, worker name, peer).
    connected: (
        crossbeam_channel::Sender<ConnectedBack>,
        crossbeam_channel::Receiver<ConnectedBack>,
    ),
    /// Bidirectional mode: D engines handshaken for pulls, by engine id (shared with the
    /// pull threads).
    d_caches: Arc<std::sync::Mutex<HashMap<String, Arc<DRemote>>>>,
    /// Bidirectional mode: what pull threads run with.
    pull_ctx: Option<pull::PullCtx>,
    /// Requests whose pull runs: the job, its blocks, when its prefill started.
    pulling: HashMap<RequestId, (Pending, Vec<BlockId>, Instant)>,
    /// Pull results from the pull threads.
    pulled: (
        crossbeam_channel::Sender<pull::Pulled>,
        crossbeam_channel::Receiver<pull::Pulled>,
    ),
    /// D engines a background handshake runs for (cached-turn heartbeats).
    handshaking: std::collections::HashSet<String>,
    /// Background handshakes that ended.
    handshaken: (
        crossbeam_channel::Sender<String>,
        crossbeam_channel::Receiver<String>,
    ),
    /// Symmetric lease: which of D's held turns P heartbeats, and when (on P's
    /// [`PrefillBidir::clock`]).
    turn_heartbeats: TurnHeartbeats,
    /// Push mode (`--transfer-mode push`).
    push: Option<push::PushP>,
}

impl PrefillEngine {
    /// Allocates the pools and fence tables, starts the transport endpoints and registers
    /// the memory.
    ///
    /// # Errors
    /// [`EngineError`] naming the step that failed.
    pub fn new(cfg: PrefillAgentConfig, metrics: Metrics) -> Result<Self, EngineError> {
        let mut workers = Vec::new();
        for rank in 0..cfg.tp_size {
            let (layout, pool) =
                rank_pool(cfg.shape, cfg.tp_size, rank, cfg.num_blocks, cfg.memory)?;
            let fence = FenceTable::new(cfg.num_blocks)
                .map_err(|e| EngineError::setup("fence table", e))?;
            let agent = Arc::new(link::agent(
                &cfg.link,
                &format!("{}/p{rank}", cfg.engine_id),
            )?);
            let pool_desc = agent
                .register(Arc::clone(pool.region()))
                .map_err(|e| EngineError::setup("register pool", e))?;
            let fence_desc = agent
                .register(fence.region())
                .map_err(|e| EngineError::setup("register fence", e))?;
            workers.push(Worker {
                layout,
                pool,
                fence,
                agent,
                pool_desc,
                fence_desc,
            });
        }
        metrics.blocks_total.set(i64::from(cfg.num_blocks));
        // A restarted P must never hand out a generation an old reader could still hold:
        // start from the wall clock in microseconds.
        // The instance is the wall clock in microseconds: a restarted P has a larger one,
        // and starting the generations there means it never hands out one an old reader
        // could still hold.
        let instance = instance_now();
        let first = std::num::NonZeroU64::new(instance)
            .map_or(Generation(std::num::NonZeroU64::MIN), Generation);
        let max_consumers = cfg.shape.num_kv_heads.max(cfg.tp_size);
        let core = PrefillCore::new(
            PrefillConfig::new(
                cfg.engine_id.clone(),
                cfg.tp_size,
                cfg.num_blocks,
                cfg.shape.block_size,
                cfg.lease,
            )
            .with_pool_wait(cfg.pool_wait)
            .with_first_generation(first)
            .with_max_consumers(max_consumers),
        );
        let mut engine = Self {
            core,
            instance,
            jobs: HashMap::new(),
            epoch: Instant::now(),
            d_peers: HashMap::new(),
            registry: Arc::default(),
            registrations: crossbeam_channel::unbounded(),
            connecting: std::collections::HashSet::new(),
            connected: crossbeam_channel::unbounded(),
            d_caches: Arc::default(),
            pull_ctx: None,
            pulling: HashMap::new(),
            pulled: crossbeam_channel::unbounded(),
            handshaking: std::collections::HashSet::new(),
            handshaken: crossbeam_channel::unbounded(),
            turn_heartbeats: TurnHeartbeats::default(),
            push: (cfg.transfer_mode == crate::config::TransferMode::Push)
                .then(|| push::PushP::new(cfg.lease)),
            cfg,
            metrics,
            workers,
        };
        engine.pull_ctx = engine.pull_ctx();
        Ok(engine)
    }

    /// What the side channel serves to D: the agents' part of the engine info (the model
    /// shape, each worker's pool and fence regions).
    pub fn info(&self) -> EngineInfo {
        let mut info = EngineInfo::new(
            self.cfg.engine_id.clone(),
            self.instance,
            self.cfg.tp_size,
            self.cfg.num_blocks,
        );
        info.shape = Some(self.cfg.shape);
        // With a token, the registrar binds each registration's session.
        info.sessions = self.cfg.link.auth_token.is_some();
        info.workers = self
            .workers
            .iter()
            .zip(0..)
            .map(|(w, rank)| worker_info(rank, w.agent.metadata(), w.pool_desc, w.fence_desc))
            .collect();
        info
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_duration(self.epoch.elapsed())
    }

    /// The forward loop; returns when `stop` is set or every job sender is gone. Stamps
    /// `heartbeat` once per iteration (`/health` reads it).
    pub fn run(
        mut self,
        jobs: crossbeam_channel::Receiver<Job>,
        stop: Arc<AtomicBool>,
        heartbeat: Arc<crate::health::EngineHeartbeat>,
    ) {
        let idle = Duration::from_millis(1);
        while !stop.load(Ordering::Relaxed) {
            heartbeat.beat();
            // 1. Intake: block briefly only when there is nothing to prefill.
            let first = if self.jobs.is_empty() {
                match jobs.recv_timeout(idle) {
                    Ok(j) => Some(j),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                None
            };
            for job in first.into_iter().chain(jobs.try_iter()) {
                self.intake(job);
            }
            self.take_hellos();
            self.take_connected();
            // 2. Prefill (and the prefills whose pulls from D ended).
            self.drop_gone_clients();
            self.finish_pulls();
            self.prefill_waiting();
            self.heartbeat_cached();
            // 3. Notifications (heartbeats, completions, aborts; push frames).
            self.poll_notifs();
            self.step_push();
            // 4. Reaper.
            let now = self.now();
            self.core.handle_timeout(now);
            self.drain();
            // Push mode's blocks are never leased: they are held from the prefill to the
            // push's end.
            let held = match self.push {
                Some(_) => self.core.blocks_allocated(),
                None => self.core.blocks_leased(),
            };
            self.metrics.blocks_held.set(held as i64);
            self.metrics.leases_active.set(self.core.leases() as i64);
        }
        // Shutdown: answer whoever still waits.
        for (_, (w, _, _)) in self.pulling.drain() {
            let _ = w.job.reply.send(Err(ApiError::overloaded(
                "the prefill engine is shutting down",
            )));
        }
        self.core.shutdown();
        self.drain();
    }

    fn intake(&mut self, mut job: Job) {
        // The lease is keyed by an id nobody can guess: the client's id (which may be
        // predictable) plus 64 random bits. Only the D that gets the transfer params (and
        // the proxy in between) learns it, so no other peer can name the lease.
        job.id = lease_id(&job.id);
        if let Some(transfer) = job.push.clone()
            && let Err(e) = self.admit_push(&job.id, &transfer)
        {
            let _ = job.reply.send(Err(e));
            return;
        }
        let now = self.now();
        match self.core.handle_job(now, job.id.clone(), job.tokens.len()) {
            Ok(()) => {
                self.jobs.insert(
                    job.id.clone(),
                    Pending {
                        job,
                        since: Instant::now(),
                    },
                );
            }
            Err(e) => {
                self.retire_push(&job.id);
                let _ = job.reply.send(Err(prefill_error(&e, job.tokens.len())));
            }
        }
    }

    /// A client that went away before its prefill started is dropped from the queue.
    fn drop_gone_clients(&mut self) {
        let now = self.now();
        let gone: Vec<RequestId> = self
            .jobs
            .iter()
            .filter(|(_, p)| p.job.reply.is_closed())
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            if self.core.abort(now, &id) {
                self.jobs.remove(&id);
                self.retire_push(&id);
            }
        }
    }

    fn prefill_waiting(&mut self) {
        loop {
            self.drain();
            let now = self.now();
            let Some(start) = self.core.poll_prefill(now) else {
                break;
            };
            match self.jobs.remove(&start.request) {
                Some(p) => self.prefill(p, start.blocks),
                None => {
                    self.core.handle_prefill_failed(&start.request);
                }
            }
            // A burst of prefills can outlast a lease's first TTL: take in D's heartbeats
            // and completions between prefills, so that a lease granted at the start of
            // the burst is renewed before the reaper (step 4) looks at it. Push mode: D's
            // reservations are heartbeated between prefills too.
            self.poll_notifs();
            self.step_push();
        }
        self.drain();
    }

    /// Starts a request's prefill: a bidirectional next turn first pulls the shared prefix
    /// from D on a background thread ([`finish_pulls`](Self::finish_pulls) continues it);
    /// everything else is computed now.
    fn prefill(&mut self, w: Pending, blocks: Vec<BlockId>) {
        let pool_wait = w.since.elapsed();
        self.metrics
            .pool_wait_seconds
            .observe(pool_wait.as_secs_f64());
        let started = Instant::now();
        if self.cfg.bidir.is_some()
            && let Some(params) = w.job.decoder.clone()
        {
            let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
            let id = w.job.id.clone();
            if self.start_pull(&id, &params, &w.job.tokens, &ids) {
                self.pulling.insert(id, (w, blocks, started));
                return;
            }
            self.metrics.pull_recomputes.inc();
        }
        self.compute(w, blocks, 0, started);
    }

    /// Continues the prefills whose pulls ended.
    fn finish_pulls(&mut self) {
        while let Ok(p) = self.pulled.1.try_recv() {
            let Some((w, blocks, started)) = self.pulling.remove(&p.request) else {
                continue;
            };
            if p.blocks == 0 {
                self.metrics.pull_recomputes.inc();
            }
            self.compute(w, blocks, p.blocks, started);
        }
    }

    /// Computes (the stand-in for the model) and fills the blocks not pulled, then grants
    /// the lease and answers.
    fn compute(
        &mut self,
        w: Pending,
        blocks: Vec<BlockId>,
        pulled_blocks: usize,
        started: Instant,
    ) {
        let pool_wait = started.duration_since(w.since);
        let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
        let tokens = &w.job.tokens;
        let bs = self.cfg.shape.block_size as usize;
        let mut pulled_tokens = (pulled_blocks * bs).min(tokens.len());
        // The model's compute, as configured, for the tokens not pulled.
        std::thread::sleep(
            self.cfg
                .cost_per_token
                .saturating_mul((tokens.len() - pulled_tokens) as u32),
        );
        let mut filled = fill_workers(&self.workers, &ids, tokens, pulled_blocks);
        if pulled_blocks > 0 && filled.is_err() {
            // The pulled bytes did not verify: never use them, compute everything.
            tracing::warn!(request = %w.job.id, "pulled KV did not verify; recomputing");
            self.metrics.pull_recomputes.inc();
            pulled_tokens = 0;
            std::thread::sleep(
                self.cfg
                    .cost_per_token
                    .saturating_mul((pulled_blocks * bs).min(tokens.len()) as u32),
            );
            filled = fill_workers(&self.workers, &ids, tokens, 0);
        }
        let digest = match filled {
            Ok(d) => d,
            Err(e) => {
                self.core.handle_prefill_failed(&w.job.id);
                self.retire_push(&w.job.id);
                tracing::error!(request = %w.job.id, error = %e, "prefill fill failed");
                let _ = w.job.reply.send(Err(ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    e.to_string(),
                )));
                return;
            }
        };
        self.metrics
            .cached_tokens_pulled
            .inc_by(pulled_tokens as u64);
        if let Some(transfer) = w.job.push.clone() {
            // Push mode: no lease; the blocks are the push's until it ends.
            self.push_prefilled(w, &transfer, blocks, digest, started);
            return;
        }
        let now = self.now();
        let granted = match self.core.handle_prefill_done(now, &w.job.id) {
            Ok(g) => g,
            Err(e) => {
                let _ = w.job.reply.send(Err(prefill_error(&e, tokens.len())));
                return;
            }
        };
        // A superseded lease's fences are cleared before this one's are published.
        self.drain();
        let generation = granted.generation;
        for worker in &self.workers {
            if let Err(e) = worker.fence.publish(&blocks, generation.word()) {
                tracing::error!(error = %e, "fence publish failed");
            }
        }
        self.metrics.leases_granted.inc();
        self.metrics.prefill_tokens.inc_by(tokens.len() as u64);
        let params = KvTransferParams {
            remote_engine_id: self.cfg.engine_id.clone(),
            remote_block_ids: ids,
            remote_block_groups: Vec::new(),
            remote_host: self.cfg.advertise_host.clone(),
            remote_port: self.cfg.side_channel_port,
            remote_request_id: w.job.id.clone(),
            tp_size: self.cfg.tp_size,
            dcp_size: None,
            pp_size: None,
            remote_num_tokens: None,
            transfer_mode: None,
            kvlease_generation: generation.word(),
            kvlease_num_tokens: tokens.len() as u32,
            kvlease_lease_ms: Some(self.cfg.lease.duration().as_millis() as u64),
            kvlease_instance: self.instance,
            kv_digest: Some(digest),
            turn: None,
        };
        let done = Prefilled {
            params,
            push_params: None,
            kv_digest: digest,
            prefill_ms: started.elapsed().as_secs_f64() * 1e3,
            pool_wait_ms: pool_wait.as_secs_f64() * 1e3,
            cached_tokens_pulled: pulled_tokens as u32,
        };
        if w.job.reply.send(Ok(done)).is_err() {
            // The client is gone: nobody will read these blocks.
            self.core.abort(now, &w.job.id);
            self.drain();
        }
    }

    fn poll_notifs(&mut self) {
        // A D's registration is known before anything its workers send.
        self.take_hellos();
        let now = self.now();
        let mut batches = Vec::new();
        for w in &self.workers {
            batches.extend(w.agent.get_new_notifs_from());
        }
        for (from, msgs) in batches {
            // `from` is the name the connection proved in the transport's authenticated
            // exchange, and the session it proved it with; it speaks only for the engine
            // whose side-channel registration named it, in that registration's session.
            let Some(engine) = self.speaker(&from) else {
                self.metrics.notifs_unregistered.inc_by(msgs.len() as u64);
                tracing::debug!(connection = %from, count = msgs.len(), "notifications from a connection that speaks for no registered D engine dropped");
                continue;
            };
            let msgs = self.take_push_frames(now, &engine, msgs);
            let peer = Peer {
                engine,
                addr: from.name,
            };
            for msg in msgs {
                self.handle_notif(now, &peer, &msg);
            }
        }
    }

    fn handle_notif(&mut self, now: Timestamp, from: &Peer<String>, msg: &[u8]) {
        match self.core.handle_notif(now, from, msg) {
            PrefillNotif::Heartbeat {
                ids,
                outcome,
                foreign,
            } => {
                self.metrics.heartbeats_received.inc();
                self.metrics.heartbeat_ids_received.inc_by(u64::from(ids));
                self.metrics
                    .heartbeat_unknown_ids
                    .inc_by(u64::from(outcome.unknown));
                self.metrics
                    .lease_extensions
                    .inc_by(u64::from(outcome.extended));
                if foreign > 0 {
                    self.metrics.notifs_foreign.inc();
                    tracing::debug!(from = %from.addr, foreign, "heartbeat ids of leases another D engine owns");
                }
            }
            PrefillNotif::Foreign { request } => {
                self.metrics.notifs_foreign.inc();
                tracing::debug!(from = %from.addr, %request, "notification about a lease another D engine owns");
            }
            PrefillNotif::Malformed(e) => {
                self.metrics.notif_malformed.inc();
                tracing::debug!(error = %e, from = %from.addr, "malformed notification");
            }
            other => tracing::trace!(?other, from = %from.addr, "notification"),
        }
        self.drain();
    }

    /// Does what the core asks (clear fences before blocks are reused, send expiry
    /// notices) and answers what it decided (refusals, releases).
    fn drain(&mut self) {
        while let Some(action) = self.core.poll_action() {
            match action {
                PrefillAction::ClearFences { released } => {
                    // Publish the free word on every worker *before* the blocks can be
                    // reused, so that a reader still holding the old generation sees its
                    // read was fenced off.
                    for w in &self.workers {
                        if let Err(e) = w.fence.publish(&released.blocks, Generation::FREE_WORD) {
                            tracing::error!(error = %e, "fence publish failed");
                        }
                    }
                }
                PrefillAction::Transmit { to, bytes } => self.send_expired(&to, bytes),
            }
        }
        while let Some(event) = self.core.poll_event() {
            match event {
                PrefillEvent::Refused { request, error } => {
                    self.retire_push(&request);
                    if let Some(p) = self.jobs.remove(&request) {
                        self.metrics
                            .pool_wait_seconds
                            .observe(p.since.elapsed().as_secs_f64());
                        let _ = p
                            .job
                            .reply
                            .send(Err(prefill_error(&error, p.job.tokens.len())));
                    }
                }
                // The agents keep no holds (their D keeps its turns in its own hold).
                PrefillEvent::Released(r) | PrefillEvent::HoldReleased(r) => self.release(&r),
            }
        }
    }

    fn release(&mut self, r: &Released) {
        let reason = match r.reason {
            ReleaseReason::Completed => metrics::ReleaseReason::Completed,
            ReleaseReason::Expired => metrics::ReleaseReason::Expired,
            ReleaseReason::Aborted => metrics::ReleaseReason::Aborted,
        };
        self.metrics.lease_released(reason).inc();
        if r.at_max_lifetime {
            self.metrics.leases_max_lifetime.inc();
            tracing::warn!(
                request = %r.request,
                lifetime = ?r.released_at.saturating_duration_since(r.granted_at),
                "lease reached its max lifetime (kv_lease_max_lifetime) though its reader still heartbeats it; blocks reclaimed"
            );
        }
        if r.reason == ReleaseReason::Expired {
            let since = r.last_heartbeat.unwrap_or(r.granted_at);
            self.metrics
                .lease_reclaim_seconds
                .observe(r.released_at.saturating_duration_since(since).as_secs_f64());
            tracing::info!(request = %r.request, "lease expired; blocks reclaimed");
        }
    }

    fn send_expired(&mut self, peer_name: &str, msg: Vec<u8>) {
        let Some(&peer) = self.d_peers.get(peer_name) else {
            tracing::debug!(%peer_name, "no connection to the D worker for an expiry notice");
            return;
        };
        let Some(w0) = self.workers.first() else {
            return;
        };
        match w0.agent.send_notif(peer, msg) {
            Ok(()) => {
                self.metrics.expiry_notices_sent.inc();
            }
            Err(e) => tracing::warn!(%peer_name, error = %e, "expiry notice not sent"),
        }
    }
}

/// `{request}-{64 random bits}` (or a fresh random id when that would be too long).
fn lease_id(request: &RequestId) -> RequestId {
    let mut r = [0u8; 8];
    // Without OS randomness the wall clock in nanoseconds still keeps ids apart.
    if getrandom::fill(&mut r).is_err() {
        r = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            .to_le_bytes();
    }
    let salt = u64::from_le_bytes(r);
    let id = format!("{request}-{salt:016x}");
    RequestId::new(&id)
        .or_else(|_| RequestId::new(&format!("cmpl-{salt:016x}")))
        .unwrap_or_else(|_| request.clone())
}

/// The HTTP answer to a refused or failed prefill.
fn prefill_error(e: &PrefillError, tokens: usize) -> ApiError {
    match e {
        PrefillError::PromptTooLong { needed, pool } => ApiError::bad_field(
            "prompt",
            format!("{tokens} tokens need {needed} blocks; the pool has {pool}"),
        ),
        PrefillError::EmptyPrompt => ApiError::bad_field("prompt", e.to_string()),
        PrefillError::Duplicate { .. } | PrefillError::Grant(_) => {
            ApiError::new(axum::http::StatusCode::CONFLICT, "conflict", e.to_string())
        }
        PrefillError::PoolWaitTimeout { .. } | PrefillError::ShuttingDown => {
            ApiError::overloaded(e.to_string())
        }
        PrefillError::NotPrefilling { .. }
        | PrefillError::WrongBlockSource { .. }
        | PrefillError::BlockOutOfRange { .. }
        | PrefillError::NoHolds => ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::same_host;

    #[test]
    fn connect_back_only_to_the_handshakes_address() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("literal");
        assert!(same_host(ip("10.0.0.5"), ip("10.0.0.5")));
        assert!(same_host(ip("::ffff:10.0.0.5"), ip("10.0.0.5")));
        assert!(same_host(ip("127.0.0.1"), ip("127.0.0.2")));
        assert!(same_host(ip("::1"), ip("127.0.0.1")));
        assert!(!same_host(ip("10.0.0.5"), ip("10.0.0.6")));
        assert!(!same_host(ip("127.0.0.1"), ip("10.0.0.5")));
    }
}
