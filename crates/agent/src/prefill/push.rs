//! P's push mode (`--transfer-mode push`): the IO shell of a [`PushCore`].
//!
//! A push leg is admitted when it arrives (so that D's registration, which may come
//! first, finds it), queued and prefilled like a pull leg, but its blocks are never
//! leased: they stay the request's until the core says the push ended. D's frames (its
//! peer message, `KVL1:PR:` registrations and `KVL1:RR:` releases) are taken here before
//! the pull core sees the notifications. The peer message names D's side channel: P
//! handshakes with it on a background thread (the bidirectional mode's path,
//! [`PullCtx`](super::pull::PullCtx)), and then sends D its heartbeats (`KVL1:PH:`) and
//! the core's messages (`KVL1:WD:` / `KVL1:PF:`) from worker 0, and writes from each
//! worker the heads it shares with each D worker (D's worker of the same rank when the TP
//! sizes are equal), fenced by D's generation. Every decision —
//! when to write, into which blocks, who is told what, when a push ends — is the core's.

use std::collections::HashSet;

use kvlease_engine::{PushAction, PushConfig, PushCore, PushEnded, PushOutcome, WritePlan};
use kvlease_gpu_mem::KvHalf;
use kvlease_notif::Notif;
use kvlease_transport::{LocalRange, WriteBatch, WriteFence, WriteOp};

use super::*;

/// How long one push write may take before it counts as failed.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most transfers P keeps D's write grants for (pushes admitted and not ended); a
/// grants message past it is dropped (that write goes over the link's TCP connection).
const MAX_GRANTED_TRANSFERS: usize = 4096;
/// How long P keeps grants no write used (the push ended without one): swept after this.
const GRANTS_KEPT: Duration = Duration::from_secs(600);

/// A handshake with a D engine that ended: the engine, and why it failed.
type HandshakeEnded = (EngineId, Result<(), String>);

/// A write in flight: one batch per worker.
struct InFlight {
    generation: Generation,
    batches: Vec<(usize, kvlease_transport::BatchId)>,
    failed: bool,
}

/// P's push state.
pub(super) struct PushP {
    core: PushCore,
    /// P's request id → its transfer, while admitted and not prefilled.
    transfers: HashMap<RequestId, RequestId>,
    /// D engines' side channels (`host:port`), from their peer messages.
    peers: HashMap<EngineId, String>,
    /// D engines a handshake thread runs for.
    handshaking: HashSet<EngineId>,
    /// D engines whose last handshake failed, and why.
    unreachable: HashMap<EngineId, String>,
    /// Handshakes that ended.
    handshaken: (
        crossbeam_channel::Sender<HandshakeEnded>,
        crossbeam_channel::Receiver<HandshakeEnded>,
    ),
    /// Writes waiting for the handshake with their D engine.
    parked: Vec<WritePlan>,
    /// Writes in flight, by transfer.
    writes: HashMap<RequestId, InFlight>,
    /// D's write grants, by transfer (verbs links), until the push ends.
    grants: HashMap<RequestId, (EngineId, crate::push::PushGrants, Instant)>,
}

impl PushP {
    pub(super) fn new(lease: LeaseConfig) -> Self {
        Self {
            core: PushCore::new(PushConfig::new(lease)),
            transfers: HashMap::new(),
            peers: HashMap::new(),
            handshaking: HashSet::new(),
            unreachable: HashMap::new(),
            handshaken: crossbeam_channel::unbounded(),
            parked: Vec::new(),
            writes: HashMap::new(),
            grants: HashMap::new(),
        }
    }
}

impl PrefillEngine {
    /// Admits a push leg (P's id `request`) under `transfer`.
    ///
    /// # Errors
    /// The answer for a duplicate or ended transfer (409).
    pub(super) fn admit_push(
        &mut self,
        request: &RequestId,
        transfer: &RequestId,
    ) -> Result<(), ApiError> {
        let now = self.now();
        let Some(push) = self.push.as_mut() else {
            return Err(ApiError::bad_field(
                "kv_transfer_params.transfer_id",
                "this prefill agent runs --transfer-mode pull",
            ));
        };
        push.core
            // No prompt digest: the agents' transfer id is the router's `transfer_id`,
            // never derived from a client's request id.
            .admit(now, transfer.clone(), request.clone(), None)
            .map_err(|e| {
                ApiError::new(axum::http::StatusCode::CONFLICT, "conflict", e.to_string())
            })?;
        push.transfers.insert(request.clone(), transfer.clone());
        self.metrics.pushes_admitted.inc();
        tracing::debug!(%request, %transfer, "push admitted");
        Ok(())
    }

    /// The request `request` retired before its prefill ended (refused, aborted, failed):
    /// its push ends and D, if it registered, is told.
    pub(super) fn retire_push(&mut self, request: &RequestId) {
        let now = self.now();
        if let Some(push) = self.push.as_mut()
            && let Some(transfer) = push.transfers.remove(request)
            && push.core.retire(now, &transfer)
        {
            tracing::info!(%request, %transfer, "push retired before its prefill ended");
        }
        self.drain_push();
    }

    /// The prefill of push leg `w` is done in `blocks` (filled on every worker): the core
    /// plans the write (at once when D registered). Answers the client with P's identity.
    pub(super) fn push_prefilled(
        &mut self,
        w: Pending,
        transfer: &RequestId,
        blocks: Vec<BlockId>,
        digest: KvDigest,
        started: Instant,
    ) {
        let now = self.now();
        let request = w.job.id.clone();
        let refused = match self.push.as_mut() {
            Some(push) => {
                push.transfers.remove(&request);
                push.core
                    .handle_prefill_done(now, transfer, blocks)
                    .err()
                    .map(|e| e.to_string())
            }
            None => Some("not in push mode".to_owned()),
        };
        if let Some(why) = refused {
            // The push ended before the prefill did (D released, the leg retired): the
            // blocks are ours to free, nothing is written.
            tracing::info!(%request, %transfer, why, "prefill done but not pushed; blocks freed");
            self.core.handle_pushed(&request);
        }
        self.metrics
            .prefill_tokens
            .inc_by(w.job.tokens.len() as u64);
        let push_params = crate::push::prefill_answer(
            &self.cfg.engine_id,
            &self.cfg.advertise_host,
            self.cfg.side_channel_port,
            self.cfg.tp_size,
            transfer,
        );
        let params = KvTransferParams {
            remote_engine_id: self.cfg.engine_id.clone(),
            remote_block_ids: Vec::new(),
            remote_block_groups: Vec::new(),
            remote_host: self.cfg.advertise_host.clone(),
            remote_port: self.cfg.side_channel_port,
            remote_request_id: request.clone(),
            tp_size: self.cfg.tp_size,
            dcp_size: None,
            pp_size: None,
            remote_num_tokens: None,
            transfer_mode: Some("push".into()),
            kvlease_generation: 0,
            kvlease_num_tokens: w.job.tokens.len() as u32,
            kvlease_lease_ms: None,
            kvlease_instance: self.instance,
            kv_digest: Some(digest),
            turn: None,
        };
        let done = Prefilled {
            params,
            push_params: Some(push_params),
            kv_digest: digest,
            prefill_ms: started.elapsed().as_secs_f64() * 1e3,
            pool_wait_ms: started.duration_since(w.since).as_secs_f64() * 1e3,
            cached_tokens_pulled: 0,
        };
        // The push goes on whether or not P's client still listens.
        let _ = w.job.reply.send(Ok(done));
        self.drain_push();
    }

    /// Takes D's push frames out of `msgs` (fed to the push core); returns the rest.
    pub(super) fn take_push_frames(
        &mut self,
        now: Timestamp,
        engine: &EngineId,
        msgs: Vec<Vec<u8>>,
    ) -> Vec<Vec<u8>> {
        let Some(push) = self.push.as_mut() else {
            return msgs;
        };
        let mut rest = Vec::new();
        let mut connect = false;
        for msg in msgs {
            if msg.starts_with(crate::push::PEER_PREFIX) {
                match crate::push::decode_peer(&msg) {
                    // The message speaks for the engine the connection proved.
                    Some((named, host, port)) if named == engine.as_str() => {
                        let addr = host_port(&host, port);
                        if push.peers.get(engine) != Some(&addr) {
                            tracing::debug!(%engine, %addr, "D's side channel for pushes");
                            push.unreachable.remove(engine);
                        }
                        push.peers.insert(engine.clone(), addr);
                        connect = true;
                    }
                    _ => {
                        self.metrics.notif_malformed.inc();
                        tracing::debug!(%engine, "malformed or foreign push peer message");
                    }
                }
                continue;
            }
            if msg.starts_with(crate::push::GRANTS_PREFIX) {
                match crate::push::decode_grants(&msg) {
                    Some(g)
                        if push.grants.len() < MAX_GRANTED_TRANSFERS
                            || push.grants.contains_key(&g.transfer) =>
                    {
                        tracing::debug!(%engine, transfer = %g.transfer, grants = g.grants.len(), "D's write grants");
                        push.grants
                            .insert(g.transfer.clone(), (engine.clone(), g, Instant::now()));
                    }
                    Some(g) => {
                        tracing::warn!(%engine, transfer = %g.transfer, "too many transfers with write grants; this one writes over TCP");
                    }
                    None => {
                        self.metrics.notif_malformed.inc();
                        tracing::debug!(%engine, "malformed push grants message");
                    }
                }
                continue;
            }
            match kvlease_notif::decode(&msg) {
                Ok(Notif::PushRegister(r)) => {
                    let transfer = r.transfer.clone();
                    let outcome = push.core.handle_registration(now, engine, r.into());
                    tracing::debug!(%engine, %transfer, ?outcome, "push registration");
                }
                Ok(Notif::ReservationReleased(r)) => {
                    let held = push.core.handle_reservation_released(
                        now,
                        engine,
                        &r.transfer,
                        r.generation,
                    );
                    tracing::info!(%engine, transfer = %r.transfer, held, "D released its reservation");
                }
                Ok(Notif::PushHeartbeat(_) | Notif::WriteDone(_) | Notif::PushFailed(_)) => {
                    self.metrics.notif_malformed.inc();
                    tracing::debug!(%engine, "a P-to-D push frame sent to P; ignored");
                }
                _ => rest.push(msg),
            }
        }
        // Connect to D now, so that the write finds the connection made.
        if connect && self.d_remote(engine).is_none() {
            self.start_d_handshake(engine);
        }
        rest
    }

    /// One push step: handshakes that ended, writes that completed, the reaper, the
    /// core's actions and heartbeats.
    pub(super) fn step_push(&mut self) {
        if self.push.is_none() {
            return;
        }
        self.take_push_handshakes();
        self.poll_writes();
        let now = self.now();
        if let Some(push) = self.push.as_mut() {
            push.core.handle_timeout(now);
            push.grants
                .retain(|_, (_, _, at)| at.elapsed() < GRANTS_KEPT);
        }
        self.drain_push();
        self.send_push_heartbeats();
        if let Some(push) = &self.push {
            self.metrics.pushes_active.set(push.core.pushing() as i64);
        }
    }

    /// Does what the core asks: posts writes (or parks them until D's handshake ends),
    /// sends write-done / push-failed, frees the blocks of ended pushes.
    pub(super) fn drain_push(&mut self) {
        while let Some(action) = self.push.as_mut().and_then(|p| p.core.poll_action()) {
            match action {
                PushAction::Write(plan) => self.post_push_write(plan),
                PushAction::Send { to, message } => {
                    tracing::debug!(%to, ?message, "push message to D");
                    self.send_to_d(&to, message.encode());
                }
                PushAction::Ended(ended) => self.push_ended(ended),
            }
        }
    }

    fn push_ended(&mut self, e: PushEnded) {
        let label = e.outcome.as_str();
        self.metrics.push_ended(label).inc();
        if let Some(push) = self.push.as_mut() {
            push.transfers.remove(&e.request);
            push.grants.remove(&e.transfer);
        }
        if !e.blocks.is_empty() {
            self.core.handle_pushed(&e.request);
        }
        match e.outcome {
            PushOutcome::Written => {
                tracing::debug!(transfer = %e.transfer, request = %e.request, "push written")
            }
            _ => {
                tracing::info!(transfer = %e.transfer, request = %e.request, outcome = label, "push ended without a write")
            }
        }
    }

    /// The handshaken D engine `engine`, if any.
    fn d_remote(&self, engine: &EngineId) -> Option<Arc<DRemote>> {
        self.pull_ctx.as_ref()?.cached(engine.as_str())
    }

    /// Starts a handshake with D engine `engine` (its side channel from its peer message)
    /// unless one runs.
    fn start_d_handshake(&mut self, engine: &EngineId) {
        let (Some(push), Some(ctx)) = (self.push.as_mut(), self.pull_ctx.clone()) else {
            return;
        };
        let Some(addr) = push.peers.get(engine).cloned() else {
            return;
        };
        if !push.handshaking.insert(engine.clone()) {
            return;
        }
        let done = push.handshaken.0.clone();
        let engine = engine.clone();
        let spawned = std::thread::Builder::new()
            .name("p-push-handshake".into())
            .spawn(move || {
                let r = ctx
                    .ensure_d_remote(engine.as_str(), &addr)
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                let _ = done.send((engine, r));
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn a push handshake thread");
        }
    }

    fn take_push_handshakes(&mut self) {
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let ended: Vec<_> = push.handshaken.1.try_iter().collect();
        for (engine, r) in ended {
            push.handshaking.remove(&engine);
            match r {
                Ok(()) => {
                    tracing::info!(%engine, "connected to D for pushes");
                    push.unreachable.remove(&engine);
                }
                Err(e) => {
                    tracing::warn!(%engine, error = %e, "cannot connect to D for pushes");
                    push.unreachable.insert(engine, e);
                }
            }
        }
        let parked = std::mem::take(&mut push.parked);
        for plan in parked {
            // Not ended meanwhile (D released, or the reaper ended it).
            let writing = self
                .push
                .as_ref()
                .is_some_and(|p| p.core.is_writing(&plan.transfer));
            if writing {
                self.post_push_write(plan);
            }
        }
    }

    /// Posts the write `plan`: from every worker into D's worker of its rank, P's blocks
    /// into D's, fenced by D's generation on the fence word of D's last block.
    fn post_push_write(&mut self, plan: WritePlan) {
        let now = self.now();
        let Some(remote) = self.d_remote(&plan.decode) else {
            let (known, failed) = match &self.push {
                Some(p) => (
                    p.peers.contains_key(&plan.decode),
                    p.unreachable.get(&plan.decode).cloned(),
                ),
                None => return,
            };
            if let Some(why) =
                failed.or_else(|| (!known).then(|| "D named no side channel".to_owned()))
            {
                self.push_write_failed(now, &plan, &why);
            } else {
                self.start_d_handshake(&plan.decode);
                if let Some(p) = self.push.as_mut() {
                    p.parked.push(plan);
                }
            }
            return;
        };
        // D's grants for this reservation, if it made any (verbs links).
        let grants = self
            .push
            .as_mut()
            .and_then(|p| p.grants.remove(&plan.transfer))
            .filter(|(from, g, _)| *from == plan.decode && g.generation == plan.generation.word())
            .map(|(_, g, _)| g.grants)
            .unwrap_or_default();
        let mut granted = 0;
        let mut batches = Vec::new();
        let mut error = None;
        // Every P worker writes the heads it shares with each D worker (D's worker of its
        // rank when the TP sizes are equal), one fenced batch per pair.
        'workers: for (i, (w, row)) in self.workers.iter().zip(&remote.peers).enumerate() {
            for &(rank, peer) in row {
                let Some(dw) = remote.info.workers.get(rank as usize) else {
                    error = Some(format!("D named no worker of rank {rank}"));
                    break 'workers;
                };
                let posted = write_batch(w, &remote.info, rank, dw, &plan).and_then(|batch| {
                    post_write(w, peer, batch, rank, &grants, &mut granted).map_err(|e| {
                        if matches!(
                            e,
                            kvlease_transport::TransferError::Disconnected { .. }
                                | kvlease_transport::TransferError::UnknownPeer(_)
                        ) && let Some(ctx) = &self.pull_ctx
                        {
                            // D restarted or is gone: the next push handshakes again.
                            ctx.forget_d(plan.decode.as_str(), &remote);
                        }
                        e.to_string()
                    })
                });
                match posted {
                    Ok(id) => batches.push((i, id)),
                    Err(e) => {
                        error = Some(e);
                        break 'workers;
                    }
                }
            }
        }
        if batches.is_empty() && error.is_none() {
            error = Some("no worker pair to write".into());
        }
        self.metrics.push_writes_posted.inc();
        let rdma = granted == batches.len() && error.is_none();
        if rdma {
            self.metrics.push_writes_granted.inc();
        }
        tracing::debug!(transfer = %plan.transfer, decode = %plan.decode, blocks = plan.pairs.len(), granted = rdma, "push write posted");
        let failed = error.is_some();
        if let Some(e) = &error {
            tracing::warn!(transfer = %plan.transfer, decode = %plan.decode, error = %e, "push write not posted");
        }
        if let Some(push) = self.push.as_mut() {
            push.writes.insert(
                plan.transfer.clone(),
                InFlight {
                    generation: plan.generation,
                    batches,
                    failed,
                },
            );
        }
        // A failed post ends when every batch that was posted ended (poll_writes).
        self.poll_writes();
    }

    fn push_write_failed(&mut self, now: Timestamp, plan: &WritePlan, why: &str) {
        tracing::warn!(transfer = %plan.transfer, decode = %plan.decode, why, "push write failed");
        self.metrics.push_writes_failed.inc();
        if let Some(push) = self.push.as_mut() {
            push.core
                .handle_write_result(now, &plan.transfer, plan.generation, false);
        }
        self.drain_push();
    }

    /// Reports the writes whose batches all ended.
    fn poll_writes(&mut self) {
        let now = self.now();
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let mut ended = Vec::new();
        for (transfer, w) in push.writes.iter_mut() {
            let mut pending = Vec::new();
            for (i, batch) in w.batches.drain(..) {
                let Some(worker) = self.workers.get(i) else {
                    continue;
                };
                match link::poll(&worker.agent, batch) {
                    link::LinkStatus::Pending => pending.push((i, batch)),
                    link::LinkStatus::Done { bytes, .. } => {
                        self.metrics.transfer_bytes.inc_by(bytes);
                    }
                    link::LinkStatus::Failed(f) => {
                        tracing::warn!(%transfer, error = %f.0, "push write failed");
                        if f.is_stale() {
                            self.metrics.stale_reads.inc();
                        }
                        w.failed = true;
                    }
                }
            }
            w.batches = pending;
            if w.batches.is_empty() {
                ended.push((transfer.clone(), w.generation, !w.failed));
            }
        }
        for (transfer, generation, ok) in ended {
            push.writes.remove(&transfer);
            if !ok {
                self.metrics.push_writes_failed.inc();
            }
            push.core
                .handle_write_result(now, &transfer, generation, ok);
        }
        self.drain_push();
    }

    fn send_push_heartbeats(&mut self) {
        let now = self.now();
        while let Some(batch) = self.push.as_mut().and_then(|p| p.core.poll_heartbeat(now)) {
            let Ok(msgs) = kvlease_notif::encode_push_heartbeats(
                batch.requests.iter(),
                kvlease_notif::MAX_NOTIF_LEN,
            ) else {
                continue;
            };
            for m in msgs {
                if self.send_to_d(&batch.engine, m) {
                    self.metrics.push_heartbeats_sent.inc();
                }
            }
        }
    }

    /// Sends `msg` to D engine `engine`'s worker 0 from P's worker 0; false when P is
    /// not connected to it (a handshake starts; D's lease covers the wait).
    fn send_to_d(&mut self, engine: &EngineId, msg: Vec<u8>) -> bool {
        let Some(remote) = self.d_remote(engine) else {
            tracing::debug!(%engine, "not connected to D yet; push message not sent");
            self.start_d_handshake(engine);
            return false;
        };
        let (Some(w0), Some(peer)) = (self.workers.first(), remote.first_peer()) else {
            return false;
        };
        match w0.agent.send_notif(peer, msg) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%engine, error = %e, "push message to D not sent");
                if matches!(
                    e,
                    kvlease_transport::TransferError::Disconnected { .. }
                        | kvlease_transport::TransferError::UnknownPeer(_)
                ) && let Some(ctx) = &self.pull_ctx
                {
                    ctx.forget_d(engine.as_str(), &remote);
                }
                false
            }
        }
    }
}

/// Posts worker `w`'s batch to D's worker `peer` (of rank `rank`): into D's grants for
/// that rank with RDMA WRITEs when the link is verbs and D granted any (`granted` counts
/// those), else as a plain fenced write (landed by D's receiver).
fn post_write(
    w: &Worker,
    peer: PeerId,
    batch: WriteBatch,
    rank: u32,
    grants: &[(u32, kvlease_transport::WriteGrant)],
    granted: &mut usize,
) -> Result<kvlease_transport::BatchId, kvlease_transport::TransferError> {
    let mine: Vec<kvlease_transport::WriteGrant> = grants
        .iter()
        .filter(|(r, _)| *r == rank)
        .map(|(_, g)| *g)
        .collect();
    if mine.is_empty() || link::peer_backend(&w.agent, peer) != kvlease_transport::Backend::Verbs {
        return w.agent.post_write(peer, batch, WRITE_TIMEOUT);
    }
    let id = w
        .agent
        .post_write_granted(peer, batch, &mine, WRITE_TIMEOUT)?;
    *granted += 1;
    Ok(id)
}

/// The write batch of worker `w` into D's worker `dw` (of rank `rank` in `info`): for
/// `plan`'s pairs, every layer, the heads both hold. With the same heads on both sides a
/// block is one range; otherwise each block's K and V halves carry the shared heads.
fn write_batch(
    w: &Worker,
    info: &PeerEngine,
    rank: u32,
    dw: &crate::shell::PeerWorker,
    plan: &WritePlan,
) -> Result<WriteBatch, String> {
    let d_heads = info
        .shape
        .heads_of_rank(info.tp_size, rank)
        .map_err(|e| e.to_string())?;
    let p_heads = w.layout.heads.clone();
    let shared = p_heads.start.max(d_heads.start)..p_heads.end.min(d_heads.end);
    if shared.start >= shared.end {
        return Err(format!(
            "P's heads {p_heads:?} and D rank {rank}'s {d_heads:?} do not overlap"
        ));
    }
    let d_layout = KvLayout::new(
        info.shape.num_layers,
        info.num_blocks,
        d_heads.end - d_heads.start,
        info.shape.block_size,
        info.shape.head_dim,
        kv::DTYPE_BYTES as u32,
    )
    .map_err(|e| e.to_string())?;
    let whole = p_heads == d_heads;
    let (p_range, d_range) = (
        shared.start - p_heads.start..shared.end - p_heads.start,
        shared.start - d_heads.start..shared.end - d_heads.start,
    );
    let halves: &[Option<KvHalf>] = if whole {
        &[None]
    } else {
        &[Some(KvHalf::K), Some(KvHalf::V)]
    };
    let mut ops =
        Vec::with_capacity(plan.pairs.len() * info.shape.num_layers as usize * halves.len());
    for layer in 0..info.shape.num_layers {
        for &(pb, db) in &plan.pairs {
            for half in halves {
                let (local, far) = match *half {
                    None => (
                        w.pool.layout().block_range(layer, pb),
                        d_layout.block_range(layer, db),
                    ),
                    Some(h) => (
                        w.pool.layout().heads_range(layer, pb, h, p_range.clone()),
                        d_layout.heads_range(layer, db, h, d_range.clone()),
                    ),
                };
                let (local, far) = (
                    local.map_err(|e| e.to_string())?,
                    far.map_err(|e| e.to_string())?,
                );
                ops.push(WriteOp {
                    local: LocalRange {
                        region: RegionId(w.pool_desc.id),
                        offset: local.start,
                        len: local.end - local.start,
                    },
                    remote: dw.pool.at(far.start),
                });
            }
        }
    }
    let last = plan
        .pairs
        .last()
        .map(|&(_, d)| d)
        .ok_or("no blocks to write")?;
    Ok(WriteBatch {
        ops,
        notif: None,
        fence: WriteFence {
            remote: dw.fence.at(u64::from(last.0) * FenceTable::WORD_BYTES),
            expected: plan.generation.word(),
        },
    })
}
