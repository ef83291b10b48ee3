//! P's bidirectional mode: pulling a next turn's shared prefix from D's cached turn, and
//! heartbeating D's cached entries while their next turns wait here (symmetric lease).
//!
//! Everything that talks to D — the clock probe, the handshake, the reads — runs on a
//! background thread with deadlines ([`PullCtx`]); the engine thread only starts pulls and
//! takes their results, so a D that does not answer delays nothing but its own requests.

use std::sync::Mutex;

use kvlease_engine::{PullDecision, TurnHeartbeat, plan_pull};

use super::*;
use crate::shell::{HandshakeFailure, Me, connect_worker, remote_engine};

/// Why a pull of D's cached turn failed (P recomputes instead).
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The handshake with D failed.
    #[error("handshake: {0}")]
    Handshake(#[from] Box<HandshakeFailure>),
    /// A block is outside a pool.
    #[error("block range: {0}")]
    Layout(#[from] kvlease_gpu_mem::LayoutError),
    /// The transport refused or failed a read.
    #[error("read from D: {0}")]
    Read(#[from] kvlease_transport::TransferError),
    /// The reads did not finish in time.
    #[error("the pull's reads timed out")]
    TimedOut,
    /// D's TP size differs from P's: P pulls only from a D of its own TP size.
    #[error("D's TP size {theirs} differs from P's {ours}")]
    TpSize {
        /// D's.
        theirs: u32,
        /// P's.
        ours: u32,
    },
}

/// One P worker, as a pull thread needs it.
#[derive(Clone)]
pub(super) struct PullWorker {
    agent: Arc<Agent>,
    pool: RegionDesc,
    pool_layout: KvLayout,
    local_heads: u32,
    /// Bytes of one block, every layer.
    block_bytes: usize,
}

/// What pull and handshake threads share with the engine: cheap clones.
#[derive(Clone)]
pub(super) struct PullCtx {
    /// Bidirectional mode; `None` in push mode (which only handshakes with D).
    bidir: Option<PrefillBidir>,
    engine_id: EngineId,
    tp_size: u32,
    shape: KvShape,
    token: Option<String>,
    instance: u64,
    metadata: Vec<Vec<u8>>,
    workers: Vec<PullWorker>,
    metrics: Metrics,
    /// D engines handshaken for pulls, by engine id.
    d_caches: Arc<Mutex<HashMap<String, Arc<DRemote>>>>,
}

/// A pull's result for the engine thread.
pub(super) struct Pulled {
    pub(super) request: RequestId,
    /// Blocks read from D into the first of the request's blocks (0: compute all).
    pub(super) blocks: usize,
}

impl PrefillEngine {
    /// The context pull and handshake threads run with; `None` without bidirectional or
    /// push mode.
    pub(super) fn pull_ctx(&self) -> Option<PullCtx> {
        if self.cfg.bidir.is_none() && self.push.is_none() {
            return None;
        }
        Some(PullCtx {
            bidir: self.cfg.bidir.clone(),
            engine_id: self.cfg.engine_id.clone(),
            tp_size: self.cfg.tp_size,
            shape: self.cfg.shape,
            token: self.cfg.link.auth_token.clone(),
            instance: self.instance,
            metadata: self.workers.iter().map(|w| w.agent.metadata()).collect(),
            workers: self
                .workers
                .iter()
                .map(|w| PullWorker {
                    agent: Arc::clone(&w.agent),
                    pool: w.pool_desc,
                    pool_layout: *w.pool.layout(),
                    local_heads: w.layout.local_heads(),
                    block_bytes: w.layout.block_bytes(),
                })
                .collect(),
            metrics: self.metrics.clone(),
            d_caches: Arc::clone(&self.d_caches),
        })
    }

    /// Starts pulling D's cached turn into the first of `ids` on a background thread;
    /// false when no pull was started (then compute everything now).
    pub(super) fn start_pull(
        &mut self,
        request: &RequestId,
        params: &DecoderKvParams,
        tokens: &[u32],
        ids: &[u32],
    ) -> bool {
        let Some(ctx) = self.pull_ctx.clone() else {
            return false;
        };
        let heartbeats = self.turn_heartbeats.take(&params.remote_request_id);
        let (params, tokens, ids) = (params.clone(), tokens.to_vec(), ids.to_vec());
        let tx = self.pulled.0.clone();
        let request = request.clone();
        let spawned = std::thread::Builder::new()
            .name("p-pull".into())
            .spawn(move || {
                let blocks = ctx.pull(&params, &tokens, &ids, heartbeats);
                let _ = tx.send(Pulled { request, blocks });
            });
        match spawned {
            Ok(_) => true,
            Err(e) => {
                tracing::error!(error = %e, "cannot spawn a pull thread; recomputing");
                false
            }
        }
    }

    /// Symmetric lease: sends the heartbeats for D's held turns that the schedule
    /// ([`TurnHeartbeats`]) has due for the next-turn requests waiting here. An engine not
    /// handshaken yet gets a handshake on a background thread, its heartbeat stays due.
    pub(super) fn heartbeat_cached(&mut self) {
        let (Some(b), Some(ctx)) = (&self.cfg.bidir, &self.pull_ctx) else {
            return;
        };
        if !b.symmetric {
            return;
        }
        let now = b.clock.now();
        self.turn_heartbeats
            .handle_waiting(self.jobs.values().filter_map(|w| w.job.decoder.as_ref()));
        let due = self.turn_heartbeats.due(now);
        let ctx = ctx.clone();
        for TurnHeartbeat {
            engine,
            host,
            port,
            turn: request,
        } in due
        {
            let Some(remote) = ctx.cached(&engine) else {
                let addr = host_port(&host, port);
                if self.handshaking.insert(engine.clone()) {
                    let ctx = ctx.clone();
                    let done = self.handshaken.0.clone();
                    let spawned = std::thread::Builder::new()
                        .name("p-handshake".into())
                        .spawn(move || {
                            if let Err(e) = ctx.ensure_d_remote(&engine, &addr) {
                                tracing::debug!(%engine, error = %e, "cannot heartbeat D's cached blocks");
                            }
                            let _ = done.send(engine);
                        });
                    if let Err(e) = spawned {
                        tracing::error!(error = %e, "cannot spawn a handshake thread");
                    }
                }
                continue;
            };
            let Ok(id) = RequestId::new(&request) else {
                continue;
            };
            let (Some(w), Some(peer)) = (ctx.workers.first(), remote.first_peer()) else {
                continue;
            };
            let Ok(msgs) = kvlease_notif::encode_heartbeats([&id], kvlease_notif::MAX_NOTIF_LEN)
            else {
                continue;
            };
            let mut sent = true;
            let mut broken = false;
            for m in msgs {
                if let Err(e) = w.agent.send_notif(peer, m) {
                    tracing::debug!(%engine, error = %e, "cached-blocks heartbeat not sent");
                    sent = false;
                    broken |= matches!(
                        e,
                        kvlease_transport::TransferError::Disconnected { .. }
                            | kvlease_transport::TransferError::UnknownPeer(_)
                    );
                }
            }
            if sent {
                self.metrics.heartbeats_sent.inc();
                self.turn_heartbeats.handle_sent(now, &request);
            } else if broken {
                // The connection broke (D may have restarted): handshake again. A full
                // queue is only backpressure: the next heartbeat tries the same link.
                ctx.forget_d(&engine, &remote);
            }
        }
        while let Ok(engine) = self.handshaken.1.try_recv() {
            self.handshaking.remove(&engine);
        }
    }
}

impl PullCtx {
    pub(super) fn cached(&self, engine: &str) -> Option<Arc<DRemote>> {
        self.d_caches
            .lock()
            .ok()
            .and_then(|m| m.get(engine).cloned())
    }

    /// Reads the common whole blocks of D's cached turn into the first of `ids`, when
    /// [`plan_pull`] allows; returns how many blocks it read (zero: compute everything).
    /// Runs on a pull thread, bounded by the probe, handshake and read timeouts.
    fn pull(
        &self,
        params: &DecoderKvParams,
        tokens: &[u32],
        ids: &[u32],
        heartbeats: Option<kvlease_engine::HeartbeatRun>,
    ) -> usize {
        let Some(b) = &self.bidir else {
            return 0;
        };
        let engine = params.remote_engine_id.clone();
        if params.tp_size != self.tp_size {
            tracing::info!(%engine, "D's TP size differs; recomputing instead of pulling");
            return 0;
        }
        let mut est = kvlease_lease::ClockOffsetEstimator::new();
        let clock = b.clock;
        let probe = host_port(&params.remote_host, params.kvlease_clock_port);
        match probe.parse() {
            Ok(addr) => {
                if let Err(e) = probe_clock(addr, PROBE_SAMPLES, &|| clock.now(), &mut est) {
                    tracing::info!(%engine, error = %e, "clock probe of D failed");
                }
            }
            Err(e) => tracing::info!(%engine, error = %e, %probe, "clock probe address"),
        }
        // Symmetric lease: P's heartbeats for the entry renewed it, if the first of their run
        // went out before its deadline.
        let renewed;
        let mut params = params;
        if let (Some(run), Some(offset)) = (heartbeats, est.offset())
            && let Some(p) = params.renewed_by_heartbeats(run, &offset)
        {
            renewed = p;
            params = &renewed;
        }
        let block_bytes: usize = self.workers.iter().map(|w| w.block_bytes).sum();
        let bytes = block_bytes as f64 * params.remote_block_ids.len() as f64;
        let expected = Duration::from_secs_f64(bytes / ASSUMED_PULL_BYTES_PER_SEC);
        let decision = plan_pull(
            &b.policy,
            params,
            tokens,
            self.shape.block_size,
            clock.now(),
            est.offset(),
            expected,
        );
        let (d_blocks, diverged) = match decision {
            PullDecision::Pull {
                blocks, diverged, ..
            } => (blocks, diverged),
            PullDecision::Recompute(reason) => {
                tracing::info!(%engine, ?reason, "recomputing instead of pulling");
                return 0;
            }
        };
        let n = d_blocks.len().min(ids.len());
        let addr = host_port(&params.remote_host, params.remote_port);
        let remote = match self.ensure_d_remote(&engine, &addr) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%engine, error = %e, "cannot reach D for a pull; recomputing");
                return 0;
            }
        };
        match self.read_from_d(&remote, params, &d_blocks[..n], &ids[..n], b.read_timeout) {
            Ok(()) => {
                tracing::info!(%engine, blocks = n, diverged, "pulled the shared prefix from D");
                n
            }
            Err(e) => {
                tracing::warn!(%engine, error = %e, "pull from D failed; recomputing");
                // D may have restarted (a stale fence, broken connections): the next pull
                // or heartbeat handshakes with it again.
                self.forget_d(&engine, &remote);
                0
            }
        }
    }

    /// Drops the handshake with D engine `engine` for pulls, when it is still `remote`
    /// (not one another thread made since).
    pub(super) fn forget_d(&self, engine: &str, remote: &Arc<DRemote>) {
        if let Ok(mut m) = self.d_caches.lock()
            && m.get(engine).is_some_and(|r| Arc::ptr_eq(r, remote))
        {
            m.remove(engine);
        }
    }

    /// The handshake with D engine `engine` at `addr` for pulls (once per engine).
    pub(super) fn ensure_d_remote(
        &self,
        engine: &str,
        addr: &str,
    ) -> Result<Arc<DRemote>, PullError> {
        if let Some(r) = self.cached(engine) {
            return Ok(r);
        }
        let want = EngineId::new(engine).map_err(|_| {
            Box::new(HandshakeFailure::Metadata {
                engine: self.engine_id.clone(),
            })
        })?;
        let me = Me {
            token: self.token.as_deref(),
            engine: self.engine_id.as_str(),
            tp_size: self.tp_size,
            metadata: &self.metadata,
            shape: self.shape,
            instance: self.instance,
        };
        let info = remote_engine(addr, &me, &want).map_err(Box::new)?;
        if self.shape.heads_of_rank(info.tp_size, 0).is_err() {
            return Err(Box::new(HandshakeFailure::TpSize {
                engine: want,
                theirs: info.tp_size,
                ours: self.tp_size,
            })
            .into());
        }
        // Each P worker connects to the D workers that share heads with it (pushes write
        // them); with equal TP sizes that is D's worker of its rank (pulls read it).
        let pairs = kvlease_engine::head_pairs(self.shape.num_kv_heads, self.tp_size, info.tp_size);
        let mut peers = vec![Vec::new(); self.workers.len()];
        for pair in pairs {
            let Some(w) = self.workers.get(pair.src as usize) else {
                continue;
            };
            // D's side channel binds no session: P's pulls prove the token.
            let peer = connect_worker(&w.agent, &info, pair.dst, &want, None).map_err(Box::new)?;
            peers[pair.src as usize].push((pair.dst, peer));
        }
        let remote = Arc::new(DRemote { info, peers });
        if let Ok(mut m) = self.d_caches.lock() {
            m.insert(engine.to_owned(), Arc::clone(&remote));
        }
        Ok(remote)
    }

    /// Reads D's `d_blocks` into P's `p_blocks` on every worker (fenced by the cached
    /// entry's generation), then tells D it has read.
    fn read_from_d(
        &self,
        remote: &DRemote,
        params: &DecoderKvParams,
        d_blocks: &[BlockId],
        p_blocks: &[u32],
        timeout: Duration,
    ) -> Result<(), PullError> {
        if !remote.same_tp(self.tp_size) {
            return Err(PullError::TpSize {
                theirs: remote.info.tp_size,
                ours: self.tp_size,
            });
        }
        let mut batches = Vec::new();
        for (w, (dw, row)) in self
            .workers
            .iter()
            .zip(remote.info.workers.iter().zip(&remote.peers))
        {
            let Some(&(_, peer)) = row.first() else {
                continue;
            };
            let d_layout = KvLayout::new(
                remote.info.shape.num_layers,
                remote.info.num_blocks,
                w.local_heads,
                remote.info.shape.block_size,
                remote.info.shape.head_dim,
                kv::DTYPE_BYTES as u32,
            )?;
            let mut ops = Vec::new();
            for layer in 0..self.shape.num_layers {
                for (&db, &pb) in d_blocks.iter().zip(p_blocks) {
                    let local = w.pool_layout.block_range(layer, BlockId(pb))?;
                    let far = d_layout.block_range(layer, db)?;
                    ops.push(link::read_op(&w.pool, local, &dw.pool, far.start));
                }
            }
            let first = d_blocks.first().map_or(0, |b| b.0);
            let fence = link::Fence {
                region: dw.fence,
                offset: u64::from(first) * FenceTable::WORD_BYTES,
                expected: params.kvlease_generation,
            };
            let batch = link::post_read(&w.agent, peer, ops, None, Some(fence), timeout)?;
            batches.push((w, batch));
        }
        let until = Instant::now() + timeout + Duration::from_secs(1);
        let mut result = Ok(());
        for (w, batch) in batches {
            loop {
                match link::poll(&w.agent, batch) {
                    link::LinkStatus::Pending if Instant::now() < until => {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    link::LinkStatus::Pending => {
                        result = Err(PullError::TimedOut);
                        break;
                    }
                    link::LinkStatus::Done { bytes, backend } => {
                        self.metrics.transfer_bytes.inc_by(bytes);
                        self.metrics.read_bytes(backend).inc_by(bytes);
                        break;
                    }
                    link::LinkStatus::Failed(f) => {
                        if f.is_stale() {
                            self.metrics.stale_reads.inc();
                        }
                        result = Err(PullError::Read(f.0));
                        break;
                    }
                }
            }
        }
        // Read (or failed for good): D may free the cached turn now.
        if let (Some(w0), Some(peer), Ok(request)) = (
            self.workers.first(),
            remote.first_peer(),
            RequestId::new(&params.remote_request_id),
        ) {
            let msg = kvlease_notif::ReadComplete {
                request,
                consumer: kvlease_lease::ConsumerId::new(self.engine_id.clone(), 0),
                consumers_total: 1,
            }
            .encode();
            if let Err(e) = w0.agent.send_notif(peer, msg) {
                tracing::warn!(error = %e, "read-done notice to D not sent");
            }
        }
        result
    }
}
