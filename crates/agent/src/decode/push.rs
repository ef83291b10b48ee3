//! D's push mode (`--transfer-mode push`): the IO shell of [`Reservations`].
//!
//! A push leg names P (engine, side channel, TP size) and the transfer. D handshakes with
//! P as pull does (its side channel, then every D worker to every P worker), allocates
//! the request's blocks from its own pool (a full pool: the leg waits in a FIFO queue of
//! at most `--max-waiting` legs, for at most half a lease duration, then gets a retryable
//! 503), reserves them (a lease of the agent's lease duration), publishes the reservation's generation in the write-fence words of the
//! blocks on every worker (`Agent::set_write_fence`) and only then sends P its peer
//! message (where D's side channel is, so that P connects to D's workers) and the
//! registration (`KVL1:PR:`). P's heartbeats (`KVL1:PH:`), write-done (`KVL1:WD:`) and
//! push-failed (`KVL1:PF:`) go to the reservations; every end of a reservation first
//! clears the fence words (no write of that generation lands after that), then:
//! written — the blocks are verified against the request's tokens and decoded;
//! failed or expired — the blocks are freed and the client gets the retryable KV
//! failure; aborted (the client went away) — the blocks are freed and P is told
//! (`KVL1:RR:`, as for an expiry). Every decision is the core's.

use std::collections::VecDeque;

use kvlease_engine::{Reservation, ReservationEnded, ReservationOutcome, Reservations};
use kvlease_lease::BlockAllocator;
use kvlease_notif::{Notif, PushNotice, ReservationRef};

use super::*;
use crate::push::PushLeg;
use reads::Handshaken;

/// A push leg handed from HTTP to D's engine.
#[derive(Debug)]
pub struct PushJob {
    /// D's id of the request.
    pub id: RequestId,
    /// Prompt tokens (the ones P prefills).
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// The transfer and P's identity.
    pub leg: PushLeg,
    /// When the HTTP layer got it.
    pub arrived: Instant,
    /// Tokens, then the end or the error.
    pub events: mpsc::UnboundedSender<DecodeStreamEvent>,
}

/// Where a push leg is.
enum LegState {
    /// Waiting for the handshake with P.
    Connecting,
    /// Handshaken, waiting in [`PushD::waiting`] for free blocks since then.
    WaitingBlocks(Instant),
    /// Reserved and registered: waiting for P's write.
    Reserved,
    /// Written and verified: streaming its tokens (the blocks are freed at the end).
    Decoding {
        text: Vec<String>,
        next: usize,
        summary: Summary,
        blocks: Vec<BlockId>,
    },
}

struct Leg {
    job: PushJob,
    state: LegState,
    reserved_at: Option<Instant>,
}

/// The shell's side of a P engine for pushes.
enum PRemote {
    Handshaking(HandshakeResult),
    Ready(Ready),
}

/// D's push state.
pub(super) struct PushD {
    reservations: Reservations,
    blocks: BlockAllocator,
    remotes: HashMap<EngineId, PRemote>,
    legs: HashMap<RequestId, Leg>,
    /// Transfer → D's id of the leg.
    by_transfer: HashMap<RequestId, RequestId>,
    /// Legs waiting for free blocks, first come first served (an id whose leg ended or
    /// moved on is skipped when it comes up).
    waiting: VecDeque<RequestId>,
}

impl PushD {
    pub(super) fn new(lease: LeaseConfig, num_blocks: u32, first: Generation) -> Self {
        Self {
            reservations: Reservations::new(lease, first),
            blocks: BlockAllocator::new(num_blocks),
            remotes: HashMap::new(),
            legs: HashMap::new(),
            by_transfer: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Blocks held by reservations and decoding legs.
    pub(super) fn blocks_held(&self) -> usize {
        self.blocks.allocated_count()
    }
}

fn aborted(id: &RequestId) -> ApiError {
    ApiError::new(
        StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        "aborted",
        format!("request {id} was aborted"),
    )
}

impl DecodeEngine {
    /// A push leg arrived: handshake with P (once per engine), then reserve.
    pub(super) fn intake_push(&mut self, job: Box<PushJob>) {
        let fail = |job: &PushJob, e: ApiError| {
            let _ = job.events.send(DecodeStreamEvent::Failed(e));
        };
        let Some(push) = self.push.as_mut() else {
            fail(
                &job,
                ApiError::bad_field(
                    "kv_transfer_params.transfer_mode",
                    "this decode agent runs --transfer-mode pull",
                ),
            );
            return;
        };
        // P's TP size may differ from D's (each P worker writes the heads it shares with
        // each D worker), but it must split the model's heads.
        if self.cfg.shape.heads_of_rank(job.leg.tp_size, 0).is_err() {
            fail(
                &job,
                ApiError::bad_field(
                    "kv_transfer_params.tp_size",
                    format!(
                        "P's TP size {} does not split the model's {} KV heads",
                        job.leg.tp_size, self.cfg.shape.num_kv_heads
                    ),
                ),
            );
            return;
        }
        if push.legs.contains_key(&job.id) || push.by_transfer.contains_key(&job.leg.transfer) {
            fail(
                &job,
                ApiError::new(
                    StatusCode::CONFLICT,
                    "conflict",
                    format!("transfer {} is already being received", job.leg.transfer),
                ),
            );
            return;
        }
        let engine = job.leg.engine.clone();
        let addr = host_port(&job.leg.host, job.leg.port);
        let id = job.id.clone();
        push.by_transfer
            .insert(job.leg.transfer.clone(), id.clone());
        push.legs.insert(
            id.clone(),
            Leg {
                job: *job,
                state: LegState::Connecting,
                reserved_at: None,
            },
        );
        match push.remotes.get(&engine) {
            Some(PRemote::Ready(_)) => self.reserve_leg(&id),
            Some(PRemote::Handshaking(_)) => {}
            None => self.start_push_handshake(&engine, addr),
        }
    }

    fn start_push_handshake(&mut self, engine: &EngineId, addr: String) {
        let rx = match self.spawn_handshake("d-push-handshake", addr, engine.clone(), None) {
            Ok(rx) => rx,
            Err(e) => {
                tracing::error!(error = %e, "cannot spawn the handshake thread");
                let (tx, rx) = crossbeam_channel::bounded(1);
                let _ = tx.send(Err(HandshakeFailure::Thread));
                rx
            }
        };
        self.insert_remote(engine, PRemote::Handshaking(rx));
    }

    fn insert_remote(&mut self, engine: &EngineId, r: PRemote) {
        if let Some(push) = self.push.as_mut() {
            push.remotes.insert(engine.clone(), r);
        }
    }

    fn poll_push_handshakes(&mut self) {
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let mut ended = Vec::new();
        for (engine, remote) in &push.remotes {
            let PRemote::Handshaking(rx) = remote else {
                continue;
            };
            match rx.try_recv() {
                Ok(r) => ended.push((engine.clone(), r)),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    ended.push((engine.clone(), Err(HandshakeFailure::Thread)));
                }
            }
        }
        for (engine, r) in ended {
            let Some(push) = self.push.as_mut() else {
                return;
            };
            let waiting: Vec<RequestId> = push
                .legs
                .iter()
                .filter(|(_, l)| {
                    l.job.leg.engine == engine && matches!(l.state, LegState::Connecting)
                })
                .map(|(id, _)| id.clone())
                .collect();
            let failure = match r {
                Ok(Handshaken::Connected(ready)) => {
                    self.metrics.handshake(HandshakeOutcome::Ok).inc();
                    let first_peer = ready.peers.first().and_then(|p| p.first()).copied();
                    if let (Some(w0), Some(peer)) = (self.workers.first(), first_peer) {
                        let name = link::peer_backend(&w0.agent, peer);
                        self.metrics.set_peer_backend(engine.as_str(), name);
                        let reason = link::backend_reason(&w0.agent, peer);
                        tracing::info!(%engine, backend = %name, %reason, "connected to P for pushes");
                    } else {
                        tracing::info!(%engine, "connected to P for pushes");
                    }
                    push.remotes.insert(engine.clone(), PRemote::Ready(ready));
                    for id in waiting {
                        self.reserve_leg(&id);
                    }
                    continue;
                }
                // Only an instance check answers this; pushes run none.
                Ok(Handshaken::Unchanged(_)) => "no connection was made".to_owned(),
                Err(e) => e.to_string(),
            };
            self.metrics.handshake(HandshakeOutcome::Failed).inc();
            tracing::warn!(%engine, error = %failure, "push handshake with P failed");
            push.remotes.remove(&engine);
            let message = format!("handshake with P engine {engine}: {failure}");
            for id in waiting {
                self.fail_leg(&id, ApiError::kv_load_failed(message.clone()));
            }
        }
    }

    /// Ends leg `id` with `e` before it reserved anything.
    fn fail_leg(&mut self, id: &RequestId, e: ApiError) {
        let Some(push) = self.push.as_mut() else {
            return;
        };
        if let Some(leg) = push.legs.remove(id) {
            push.by_transfer.remove(&leg.job.leg.transfer);
            let _ = leg.job.events.send(DecodeStreamEvent::Failed(e));
        }
    }

    /// Reserves leg `id`'s blocks, publishes the fence, then registers with P.
    fn reserve_leg(&mut self, id: &RequestId) {
        let now = self.now();
        let bs = self.cfg.shape.block_size.max(1) as usize;
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let Some(leg) = push.legs.get(id) else {
            return;
        };
        let transfer = leg.job.leg.transfer.clone();
        let engine = leg.job.leg.engine.clone();
        let need = leg.job.tokens.len().div_ceil(bs);
        if need == 0 || need > self.cfg.num_blocks as usize {
            let e = ApiError::bad_field(
                "prompt",
                format!("{need} blocks needed; the pool has {}", self.cfg.num_blocks),
            );
            self.fail_leg(id, e);
            return;
        }
        let queued = matches!(leg.state, LegState::WaitingBlocks(_));
        if !queued && !push.waiting.is_empty() {
            // Others wait for blocks already: this leg queues behind them.
            self.queue_leg(id, need);
            return;
        }
        let blocks = match push.blocks.alloc(need) {
            Ok(b) => b,
            Err(e) if queued => {
                // Only a leg the queue's head found room for gets here.
                self.fail_leg(id, ApiError::overloaded(format!("no free KV blocks: {e}")));
                return;
            }
            Err(_) => {
                self.queue_leg(id, need);
                return;
            }
        };
        let reservation = match push.reservations.reserve(
            now,
            transfer.clone(),
            engine.clone(),
            blocks.clone(),
            None,
        ) {
            Ok(r) => r,
            Err(e) => {
                let _ = push.blocks.free(&blocks);
                self.fail_leg(
                    id,
                    ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string()),
                );
                return;
            }
        };
        //= docs/spec.md#the-write-fence
        //# D publishes a reservation's generation in an 8-byte fence word of a region it
        //# registered
        set_fences(&self.workers, &blocks, reservation.generation.word());
        if let Some(leg) = push.legs.get_mut(id) {
            leg.state = LegState::Reserved;
            leg.reserved_at = Some(Instant::now());
        }
        self.metrics.push_reservations.inc();
        tracing::debug!(request = %id, %transfer, prefill = %engine, blocks = blocks.len(), generation = reservation.generation.word(), "reserved");
        self.register(now, &engine, &reservation);
    }

    /// Leg `id` (handshaken, needing `need` blocks) waits for free blocks, or gets the
    /// retryable 503 when `--max-waiting` legs wait already.
    fn queue_leg(&mut self, id: &RequestId, need: usize) {
        let max = self.cfg.max_waiting as usize;
        let Some(push) = self.push.as_mut() else {
            return;
        };
        if push.waiting.len() >= max {
            let e = ApiError::overloaded(format!(
                "no free KV blocks for {need} and {max} push legs wait already"
            ));
            self.fail_leg(id, e);
            return;
        }
        if let Some(leg) = push.legs.get_mut(id) {
            leg.state = LegState::WaitingBlocks(Instant::now());
            push.waiting.push_back(id.clone());
            tracing::debug!(request = %id, need, free = push.blocks.free_count(), "push leg waits for free KV blocks");
        }
    }

    /// The waiting legs, in order: those past the wait get the retryable 503; the first
    /// ones the free blocks cover reserve. Call after blocks were freed.
    fn reserve_waiting(&mut self) {
        // Longer than half a lease and P, which gives up on a registration one lease
        // after its prefill, may have freed its blocks already.
        let limit = self.cfg.lease.duration() / 2;
        let bs = self.cfg.shape.block_size.max(1) as usize;
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let mut late = Vec::new();
        push.waiting.retain(|id| match push.legs.get(id) {
            Some(Leg {
                state: LegState::WaitingBlocks(since),
                ..
            }) => {
                if since.elapsed() > limit {
                    late.push(id.clone());
                    false
                } else {
                    true
                }
            }
            _ => false,
        });
        for id in late {
            let e =
                ApiError::overloaded(format!("no free KV blocks within {} ms", limit.as_millis()));
            self.fail_leg(&id, e);
        }
        loop {
            let Some(push) = self.push.as_mut() else {
                return;
            };
            let Some(id) = push.waiting.front().cloned() else {
                break;
            };
            let need = push
                .legs
                .get(&id)
                .map_or(0, |l| l.job.tokens.len().div_ceil(bs));
            if need > push.blocks.free_count() {
                break;
            }
            push.waiting.pop_front();
            self.reserve_leg(&id);
        }
        if let Some(push) = &self.push {
            self.metrics
                .push_legs_waiting
                .set(push.waiting.len() as i64);
        }
    }

    /// Sends P the peer message and the registration. When either cannot be sent (P's
    /// connection broke: P is gone or restarted), P never hears of the reservation and no
    /// write can come: it ends `failed` at once (the client gets the retryable
    /// `kv_load_failed` now, not after the lease).
    fn register(&mut self, now: Timestamp, engine: &EngineId, r: &Reservation) {
        let peer = crate::push::encode_peer(
            &self.cfg.engine_id,
            &self.cfg.advertise_host,
            self.cfg.side_channel_port,
        );
        let grants = self.write_grants(engine, r);
        let sent = match r.registration().encode() {
            Ok(msg) => std::iter::once(peer)
                .chain(grants)
                .chain(std::iter::once(msg))
                .all(|m| self.send_to_p(engine, m)),
            Err(e) => {
                // Too many blocks for one message.
                tracing::warn!(transfer = %r.transfer, error = %e, "registration not encodable");
                false
            }
        };
        if sent {
            return;
        }
        tracing::warn!(%engine, transfer = %r.transfer, "registration not sent; the reservation ends failed");
        if let Some(push) = self.push.as_mut() {
            push.reservations
                .handle_push_failed(now, engine, &r.transfer, r.generation);
        }
        self.drain_reservations();
    }

    /// The grants message for reservation `r` (its fence words already hold its
    /// generation), when P's links to D's workers are verbs: per worker, a remote-write
    /// grant of each contiguous range of the pool the write lands in (a run of
    /// consecutive blocks in one layer), made on the fence word of the reservation's last
    /// block (the word P's write is fenced by). Clearing the fence words at the end of the
    /// reservation revokes them. `None` when a link is not verbs or a grant cannot be
    /// made (memory verbs serves through a mirror or dmabuf): P then writes over the
    /// link's TCP connection, fenced by this agent's receiver. Grants made before such a
    /// failure stay until the clear revokes them.
    fn write_grants(&self, engine: &EngineId, r: &Reservation) -> Option<Vec<u8>> {
        let push = self.push.as_ref()?;
        let Some(PRemote::Ready(ready)) = push.remotes.get(engine) else {
            return None;
        };
        let last = r.blocks.last()?;
        let ranges = grant_ranges(&self.workers, &r.blocks)?;
        if ranges.len() > crate::push::MAX_GRANTS {
            tracing::debug!(transfer = %r.transfer, ranges = ranges.len(), "too many ranges to grant; P writes over TCP");
            return None;
        }
        let generation = r.generation.word();
        let mut grants = Vec::with_capacity(ranges.len());
        for (rank, dest) in ranges {
            let w = self.workers.get(rank as usize)?;
            // Any of P's workers may write into this worker (TP sizes may differ): every
            // link of it to P must be verbs.
            let row = ready.peers.get(rank as usize)?;
            if row.is_empty()
                || row.iter().any(|&peer| {
                    link::peer_backend(&w.agent, peer) != kvlease_transport::Backend::Verbs
                })
            {
                return None;
            }
            let (_, fence) = w.fence.as_ref()?;
            match w.agent.grant_write(
                kvlease_transport::RegionId(fence.id),
                u64::from(last.0) * FenceTable::WORD_BYTES,
                generation,
                dest,
            ) {
                Ok(g) => grants.push((rank, g)),
                Err(e) => {
                    tracing::debug!(transfer = %r.transfer, error = %e, "no write grant; P writes over TCP");
                    return None;
                }
            }
        }
        self.metrics.push_write_grants.inc_by(grants.len() as u64);
        crate::push::encode_grants(&crate::push::PushGrants {
            transfer: r.transfer.clone(),
            generation,
            grants,
        })
    }

    /// Sends `msg` to P engine `engine`'s worker 0 from D's worker 0. A broken
    /// connection (P restarted or gone) drops the engine: the next leg naming it
    /// handshakes again.
    fn send_to_p(&mut self, engine: &EngineId, msg: Vec<u8>) -> bool {
        let Some(push) = self.push.as_mut() else {
            return false;
        };
        let Some(PRemote::Ready(ready)) = push.remotes.get(engine) else {
            return false;
        };
        let (Some(w0), Some(&peer)) = (
            self.workers.first(),
            ready.peers.first().and_then(|row| row.first()),
        ) else {
            return false;
        };
        match w0.agent.send_notif(peer, msg) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(%engine, error = %e, "push message to P not sent");
                if matches!(
                    e,
                    kvlease_transport::TransferError::Disconnected { .. }
                        | kvlease_transport::TransferError::UnknownPeer(_)
                ) && let Some(PRemote::Ready(old)) = push.remotes.remove(engine)
                {
                    for (w, row) in self.workers.iter().zip(&old.peers) {
                        for &p in row {
                            let _ = w.agent.disconnect(p);
                        }
                    }
                }
                false
            }
        }
    }

    /// Feeds P's push frames to the reservations; returns whether `msg` was one.
    pub(super) fn take_push_frame(
        &mut self,
        now: Timestamp,
        engine: &EngineId,
        msg: &[u8],
    ) -> bool {
        let Some(push) = self.push.as_mut() else {
            return false;
        };
        match kvlease_notif::decode(msg) {
            Ok(Notif::PushHeartbeat(ids)) => {
                let outcome = push.reservations.handle_heartbeat(now, engine, ids.iter());
                self.metrics.heartbeats_received.inc();
                tracing::trace!(%engine, ?outcome, "push heartbeat");
                true
            }
            Ok(Notif::WriteDone(r)) => {
                let verdict =
                    push.reservations
                        .handle_write_done(now, engine, &r.transfer, r.generation);
                tracing::debug!(%engine, transfer = %r.transfer, ?verdict, "write done");
                true
            }
            Ok(Notif::PushFailed(r)) => {
                let verdict =
                    push.reservations
                        .handle_push_failed(now, engine, &r.transfer, r.generation);
                tracing::info!(%engine, transfer = %r.transfer, ?verdict, "P reported the push failed");
                true
            }
            Ok(Notif::PushRegister(_) | Notif::ReservationReleased(_)) => true,
            _ => false,
        }
    }

    /// Aborts push leg `id`; returns whether it was one.
    pub(super) fn abort_push(&mut self, id: &RequestId) -> bool {
        let now = self.now();
        let Some(push) = self.push.as_mut() else {
            return false;
        };
        let Some(leg) = push.legs.get(id) else {
            return false;
        };
        match &leg.state {
            LegState::Connecting | LegState::WaitingBlocks(_) => {
                self.fail_leg(id, aborted(id));
            }
            LegState::Reserved => {
                let transfer = leg.job.leg.transfer.clone();
                push.reservations.abort(now, &transfer);
                self.drain_reservations();
            }
            LegState::Decoding { .. } => {
                if let Some(leg) = push.legs.remove(id) {
                    push.by_transfer.remove(&leg.job.leg.transfer);
                    if let LegState::Decoding { blocks, .. } = &leg.state {
                        let _ = push.blocks.free(blocks);
                    }
                    let _ = leg.job.events.send(DecodeStreamEvent::Failed(aborted(id)));
                }
            }
        }
        true
    }

    /// One push step: handshakes, gone clients, the reaper, the ends, the tokens.
    pub(super) fn step_push(&mut self) {
        if self.push.is_none() {
            return;
        }
        self.poll_push_handshakes();
        let gone: Vec<RequestId> = self
            .push
            .as_ref()
            .map(|p| {
                p.legs
                    .iter()
                    .filter(|(_, l)| l.job.events.is_closed())
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default();
        for id in gone {
            tracing::info!(request = %id, "push client gone; aborting");
            self.abort_push(&id);
        }
        let now = self.now();
        if let Some(push) = self.push.as_mut() {
            push.reservations.handle_timeout(now);
        }
        self.drain_reservations();
        self.push_tokens();
        self.reserve_waiting();
        if let Some(push) = &self.push {
            self.metrics
                .push_reservations_active
                .set(push.reservations.len() as i64);
        }
    }

    /// Acts on every reservation that ended: fences cleared first, then P told, the
    /// blocks decoded or freed, the client answered.
    fn drain_reservations(&mut self) {
        while let Some(ev) = self.push.as_mut().and_then(|p| p.reservations.poll_event()) {
            self.reservation_ended(ev);
        }
    }

    fn reservation_ended(&mut self, ev: ReservationEnded) {
        //= docs/spec.md#the-write-fence
        //# D gives blocks to another request only after the reservation ended, and it
        //# revokes remote access to them (verbs) or stops admitting the generation (every
        //# other backend) before that
        set_fences(&self.workers, &ev.blocks, Generation::FREE_WORD);
        let label = ev.outcome.as_str();
        self.metrics.push_reservation_ended(label).inc();
        if ev.tells_prefill() {
            let r = ReservationRef {
                transfer: ev.transfer.clone(),
                generation: ev.generation,
            };
            self.send_to_p(&ev.prefill, r.encode(PushNotice::ReservationReleased));
        }
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let Some(id) = push.by_transfer.get(&ev.transfer).cloned() else {
            let _ = push.blocks.free(&ev.blocks);
            return;
        };
        if ev.outcome != ReservationOutcome::Written {
            let _ = push.blocks.free(&ev.blocks);
            push.by_transfer.remove(&ev.transfer);
            let Some(leg) = push.legs.remove(&id) else {
                return;
            };
            let e = match ev.outcome {
                ReservationOutcome::Aborted => aborted(&id),
                _ => {
                    self.metrics.kv_load_failures.inc();
                    tracing::warn!(request = %id, transfer = %ev.transfer, outcome = label, "push not received; no output");
                    ApiError::kv_load_failed(format!(
                        "the push of transfer {} ended {label} on D (P engine {}); retry",
                        ev.transfer, ev.prefill
                    ))
                }
            };
            let _ = leg.job.events.send(DecodeStreamEvent::Failed(e));
            return;
        }
        let Some(leg) = push.legs.get(&id) else {
            return;
        };
        let hashes = kv::prefix_hashes(&leg.job.tokens);
        let want = kv::expected_digest(&self.cfg.shape, &leg.job.tokens);
        let verified = kv::digest_workers(
            &self.workers,
            || VerifyError::Panicked,
            |w| verify_worker(w, &ev.blocks, &hashes),
        )
        .and_then(|d| {
            if d == want {
                Ok(d)
            } else {
                Err(VerifyError::Digest { read: d, want })
            }
        });
        match verified {
            Err(e) => {
                let _ = push.blocks.free(&ev.blocks);
                push.by_transfer.remove(&ev.transfer);
                self.metrics.kv_load_failures.inc();
                tracing::warn!(request = %id, transfer = %ev.transfer, error = %e, "pushed KV did not verify; no output");
                if let Some(leg) = push.legs.remove(&id) {
                    let _ =
                        leg.job
                            .events
                            .send(DecodeStreamEvent::Failed(ApiError::kv_load_failed(
                                format!("pushed KV did not verify: {e}"),
                            )));
                }
            }
            Ok(digest) => {
                let backend = match (self.workers.first(), push.remotes.get(&ev.prefill)) {
                    (Some(w0), Some(PRemote::Ready(r))) => r
                        .peers
                        .first()
                        .and_then(|row| row.first())
                        .map_or(kvlease_transport::Backend::Tcp, |&p| {
                            link::peer_backend(&w0.agent, p)
                        }),
                    _ => kvlease_transport::Backend::Tcp,
                };
                self.metrics.transfer(backend).inc();
                let p_workers = match push.remotes.get(&ev.prefill) {
                    Some(PRemote::Ready(r)) => r.info.tp_size,
                    _ => 0,
                };
                let Some(leg) = push.legs.get_mut(&id) else {
                    return;
                };
                let bytes: usize = self.workers.iter().map(|w| w.layout.block_bytes()).sum();
                let wait = leg.reserved_at.map_or(Duration::ZERO, |t| t.elapsed());
                let summary = Summary {
                    kv_digest: digest.to_string(),
                    stats: TransferStats {
                        bytes: (bytes * ev.blocks.len()) as u64,
                        backend: backend.as_str().to_owned(),
                        queue_time_ms: 0.0,
                        read_time_ms: wait.as_secs_f64() * 1e3,
                        remote_workers: if p_workers == 0 {
                            leg.job.leg.tp_size
                        } else {
                            p_workers
                        },
                    },
                    kv_transfer_params: None,
                };
                tracing::debug!(request = %id, transfer = %ev.transfer, "pushed KV verified");
                leg.state = LegState::Decoding {
                    text: kv::decode_text(digest, leg.job.max_tokens as usize),
                    next: 0,
                    summary,
                    blocks: ev.blocks,
                };
            }
        }
    }

    /// One token for every decoding push leg; a finished one frees its blocks.
    fn push_tokens(&mut self) {
        let Some(push) = self.push.as_mut() else {
            return;
        };
        let mut done = Vec::new();
        for (id, leg) in &mut push.legs {
            let LegState::Decoding { text, next, .. } = &mut leg.state else {
                continue;
            };
            if let Some(t) = text.get(*next) {
                let _ = leg.job.events.send(DecodeStreamEvent::Token(t.clone()));
                *next += 1;
                self.metrics.decode_tokens.inc();
            }
            if *next >= text.len() {
                done.push(id.clone());
            }
        }
        for id in done {
            let Some(leg) = push.legs.remove(&id) else {
                continue;
            };
            push.by_transfer.remove(&leg.job.leg.transfer);
            if let LegState::Decoding {
                summary, blocks, ..
            } = leg.state
            {
                let _ = push.blocks.free(&blocks);
                let _ = leg.job.events.send(DecodeStreamEvent::Done(summary));
            }
        }
    }
}

/// Stores `word` in the write-fence words of `blocks` on every worker.
fn set_fences(workers: &[Worker], blocks: &[BlockId], word: u64) {
    for w in workers {
        let Some((_, fence)) = &w.fence else {
            continue;
        };
        for b in blocks {
            let offset = u64::from(b.0) * FenceTable::WORD_BYTES;
            if let Err(e) =
                w.agent
                    .set_write_fence(kvlease_transport::RegionId(fence.id), offset, word)
            {
                tracing::error!(block = b.0, error = %e, "write fence not set");
            }
        }
    }
}

/// The ranges of every worker's pool that a write into `blocks` lands in: per worker and
/// layer, one range per run of consecutive block ids (ranges that touch are merged);
/// `None` when a block lies outside a layout.
fn grant_ranges(
    workers: &[Worker],
    blocks: &[BlockId],
) -> Option<Vec<(u32, kvlease_transport::LocalRange)>> {
    let mut ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for id in ids {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(id) => *last = id,
            _ => runs.push((id, id)),
        }
    }
    let mut out = Vec::new();
    for (rank, w) in workers.iter().enumerate() {
        let layout = w.pool.layout();
        let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
        for layer in 0..layout.num_layers() {
            for &(first, last) in &runs {
                let start = layout.block_range(layer, BlockId(first)).ok()?.start;
                let end = layout.block_range(layer, BlockId(last)).ok()?.end;
                match ranges.last_mut() {
                    Some(prev) if prev.end == start => prev.end = end,
                    _ => ranges.push(start..end),
                }
            }
        }
        let rank = u32::try_from(rank).ok()?;
        out.extend(ranges.into_iter().map(|r| {
            (
                rank,
                kvlease_transport::LocalRange {
                    region: kvlease_transport::RegionId(w.pool_desc.id),
                    offset: r.start,
                    len: r.end - r.start,
                },
            )
        }));
    }
    Some(out)
}
