//! The decode core ([`DecodeCore`]): which requests are tracked and heartbeated, when one
//! is scheduled and read, and how each one ends.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use kvlease_lease::{BlockId, ConsumerId, EngineId, HeartbeatTracker, RequestId, Timestamp};
use kvlease_notif::{Abort, Notif};

use crate::bidir::DecoderHold;
use crate::blocks::{BlockSource, Blocks};

mod hold;
mod plan;
mod types;

pub use hold::{HoldRefused, HoldTerms, KeptTurn, TurnEnd, TurnReleased};
pub use types::*;

#[derive(Debug)]
enum Remote {
    Handshaking,
    Ready(Connected),
}

/// A P engine D is connected to.
#[derive(Debug)]
struct Connected {
    info: RemoteEngine,
    /// A check of P's instance runs (a request named a newer one).
    checking: bool,
    /// When the last check started.
    last_check: Option<Timestamp>,
    /// When a request last named it (which idle engine goes first).
    last_used: Timestamp,
}

impl Connected {
    /// Whether a request of `instance` may be read over this connection: the instance
    /// P's side channel announced (0 on either side: unsaid).
    fn serves(&self, instance: u64) -> bool {
        instance == 0 || self.info.instance == 0 || instance == self.info.instance
    }
}

#[derive(Debug)]
enum Phase {
    Waiting,
    Loading {
        blocks: Vec<BlockId>,
        /// Per batch of the plan: the P worker it reads, and how it ended.
        results: Vec<(u32, Option<BatchResult>)>,
    },
    Verifying {
        blocks: Vec<BlockId>,
    },
    Decoding {
        blocks: Vec<BlockId>,
    },
}

#[derive(Debug)]
struct Req {
    remote: RemoteKv,
    phase: Phase,
    /// Answered already (aborted while its reads ran): drop what the reads bring.
    answered: bool,
}

impl Req {
    /// Waiting to be loaded, and not answered.
    fn is_waiting(&self) -> bool {
        matches!(self.phase, Phase::Waiting) && !self.answered
    }
}

/// Everything a decode engine (D) decides, and nothing it does.
///
/// # Call order (one forward-loop step)
/// 1. [`on_new_request`](Self::on_new_request) for each arrival (tracked at once: its
///    heartbeats start before it is scheduled), [`abort`](Self::abort) for each abort;
///    [`poll_handshake`](Self::poll_handshake) until `None` and start each one off the
///    engine thread; report with [`handle_handshake`](Self::handle_handshake);
/// 2. [`poll_transmit`](Self::poll_transmit) until `None`: heartbeats (one batch per P
///    engine and interval) and aborts, each to every worker of its P engine;
/// 3. [`handle_notif`](Self::handle_notif) for each notification (expiry notices);
/// 4. [`poll_load`](Self::poll_load) until `None` (or, when the serving engine allocates
///    the blocks, [`start_load`](Self::start_load) for each request it scheduled): post
///    each plan's batches;
///    [`handle_batch_done`](Self::handle_batch_done) as they end; on
///    [`DecodeEvent::Loaded`] verify and call [`handle_verified`](Self::handle_verified);
/// 5. the model decodes; [`request_finished`](Self::request_finished) frees a finished
///    request's blocks, or, in bidirectional mode ([`DecodeConfig::with_hold`]),
///    [`request_finished_hold`](Self::request_finished_hold) keeps them as a held turn for
///    P to pull;
/// 6. after every input: [`poll_event`](Self::poll_event) until `None`.
///
/// # Held turns (bidirectional mode)
/// A core built [`with_hold`](DecodeConfig::with_hold) owns the hold on finished turns as a
/// sub-state machine: notifications go through [`handle_notif_at`](Self::handle_notif_at)
/// (P's heartbeats and read completions for held turns), [`handle_timeout`](Self::handle_timeout)
/// runs before step 4 (expiry, and eviction of the oldest held turn while the next request
/// is short of blocks), and [`poll_turn_released`](Self::poll_turn_released) is drained
/// after each of these and before [`poll_load`](Self::poll_load): clear each released
/// turn's fences, its blocks are free from there.
///
/// # Order
/// Everything the core hands out comes in an order defined by its inputs, never by a
/// hash: requests that end together (a failed handshake, a lost engine) end in arrival
/// order, [`shutdown`](Self::shutdown) ends them in id order, heartbeat batches come in
/// due order. The maps are ordered ones (`BTreeMap`): D holds at most
/// [`DecodeConfig::max_waiting`] + [`DecodeConfig::max_running`] requests and a few P
/// engines, and each request is looked up a handful of times in its life, so O(log n)
/// costs nothing that matters, while no walk over them can depend on a hash seed. The per-id
/// hot path, heartbeats, is the [`HeartbeatTracker`]'s (hashed, never walked).
#[derive(Debug)]
pub struct DecodeCore {
    config: DecodeConfig,
    tracker: HeartbeatTracker,
    blocks: Blocks,
    remotes: BTreeMap<EngineId, Remote>,
    reqs: BTreeMap<RequestId, Req>,
    /// D ids in arrival order, of requests not yet scheduled (exactly those in
    /// [`Phase::Waiting`]).
    queue: VecDeque<RequestId>,
    by_remote: BTreeMap<RequestId, RequestId>,
    handshakes: VecDeque<HandshakeStart>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<DecodeEvent>,
    stats: DecodeStats,
    /// Bidirectional mode: finished turns kept for P ([`DecodeConfig::hold`]).
    hold: Option<DecoderHold>,
    /// Held turns that ended, until [`poll_turn_released`](Self::poll_turn_released).
    released: VecDeque<TurnReleased>,
}

impl DecodeCore {
    /// A core with every block free and nothing tracked.
    pub fn new(config: DecodeConfig) -> Self {
        Self {
            tracker: HeartbeatTracker::new(&config.lease),
            blocks: Blocks::new(config.block_source, config.num_blocks),
            remotes: BTreeMap::new(),
            reqs: BTreeMap::new(),
            queue: VecDeque::new(),
            by_remote: BTreeMap::new(),
            handshakes: VecDeque::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: DecodeStats::default(),
            hold: config.hold.map(|t| {
                DecoderHold::with_first_generation(t.ttl, t.symmetric, config.hold_first_generation)
            }),
            released: VecDeque::new(),
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DecodeConfig {
        &self.config
    }

    /// The counters.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Requests tracked for heartbeats.
    pub fn tracked(&self) -> usize {
        self.tracker.len()
    }

    /// Requests waiting to be scheduled.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Requests loading or decoding (and aborted ones whose reads still run).
    pub fn running(&self) -> usize {
        self.reqs.len() - self.queue.len()
    }

    /// Blocks allocated.
    pub fn blocks_allocated(&self) -> usize {
        self.blocks.allocated_count()
    }

    /// Free blocks.
    pub fn blocks_free(&self) -> usize {
        self.blocks.free_count()
    }

    /// Whether nothing is admitted, tracked or allocated.
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty() && self.tracker.is_empty() && self.blocks.allocated_count() == 0
    }

    /// Whether `request` waits to be scheduled (admitted, not loading, not ended).
    pub fn is_waiting(&self, request: &RequestId) -> bool {
        self.reqs.get(request).is_some_and(Req::is_waiting)
    }

    /// Whether `engine` is handshaken.
    pub fn is_ready(&self, engine: &EngineId) -> bool {
        matches!(self.remotes.get(engine), Some(Remote::Ready(_)))
    }

    /// P engines kept (handshaking or connected); at most [`DecodeConfig::max_engines`].
    pub fn engines(&self) -> usize {
        self.remotes.len()
    }

    /// Whether `req` may be loaded now: its engine is connected, as the instance it names.
    fn loadable(&self, req: &Req) -> bool {
        matches!(self.remotes.get(&req.remote.engine), Some(Remote::Ready(p)) if p.serves(req.remote.instance))
    }

    /// D's id of the request whose P id is `remote`.
    pub fn local_id(&self, remote: &RequestId) -> Option<&RequestId> {
        self.by_remote.get(remote)
    }

    /// The remote coordinates of an admitted request.
    pub fn remote_of(&self, request: &RequestId) -> Option<&RemoteKv> {
        self.reqs.get(request).map(|r| &r.remote)
    }

    // ------------------------------------------------------------------ inputs

    /// A request prefilled by P arrived (vLLM: the scheduler's `on_new_request`,
    /// `get_num_new_matched_tokens` and `update_state_after_alloc` of a
    /// `do_remote_prefill` request). It is tracked at once and queued; an unknown P engine
    /// gets a handshake ([`poll_handshake`](Self::poll_handshake)).
    ///
    /// # Errors
    /// [`AdmitError`]; the request is refused. When its coordinates were valid and P is
    /// connected, an abort tells P to free the lease now.
    pub fn on_new_request(
        &mut self,
        now: Timestamp,
        id: RequestId,
        num_tokens: usize,
        remote: RemoteKv,
    ) -> Result<(), AdmitError> {
        let result = self.admit(now, id, num_tokens, remote);
        match &result {
            Ok(()) => self.stats.admitted += 1,
            Err(_) => self.stats.refused += 1,
        }
        result
    }

    fn admit(
        &mut self,
        now: Timestamp,
        id: RequestId,
        num_tokens: usize,
        remote: RemoteKv,
    ) -> Result<(), AdmitError> {
        if self.reqs.contains_key(&id) || self.by_remote.contains_key(&remote.request) {
            // Never abort here: the lease belongs to the request already running.
            return Err(AdmitError::Duplicate { request: id });
        }
        // A newer instance than the connected one is only P's side channel's to announce:
        // the request waits for a check of it (at most one per interval and engine).
        let mut check = false;
        if let Some(Remote::Ready(p)) = self.remotes.get(&remote.engine)
            && !p.serves(remote.instance)
        {
            let current = p.info.instance;
            if remote.instance < current {
                return Err(AdmitError::StaleInstance {
                    engine: remote.engine.clone(),
                    theirs: remote.instance,
                    current,
                });
            }
            if !p.checking {
                let interval = self.config.instance_check_interval;
                if p.last_check
                    .is_some_and(|t| now < t.checked_add(interval).unwrap_or(t))
                {
                    return Err(AdmitError::InstanceUnconfirmed {
                        engine: remote.engine.clone(),
                        theirs: remote.instance,
                        current,
                        interval,
                    });
                }
                check = true;
            }
        }
        if !self.remotes.contains_key(&remote.engine) && !self.make_room() {
            return Err(AdmitError::TooManyEngines {
                max: self.config.max_engines,
            });
        }
        let need = num_tokens.div_ceil(self.config.block_size.max(1) as usize);
        let refused = if remote.num_tokens as usize != num_tokens {
            Some(AdmitError::TokenCount {
                prefilled: remote.num_tokens,
                prompt: num_tokens,
            })
        } else if remote.blocks.len() != need {
            Some(AdmitError::BlockCount {
                got: remote.blocks.len(),
                tokens: num_tokens,
                need,
            })
        } else if need > self.config.num_blocks as usize {
            Some(AdmitError::PromptTooLong {
                needed: need,
                pool: self.config.num_blocks,
            })
        } else if let Some(e) = self.tp_misfit(remote.tp_size) {
            Some(e)
        } else if let Some(Remote::Ready(p)) = self.remotes.get(&remote.engine)
            && p.serves(remote.instance)
            && let Some(b) = remote.blocks.iter().find(|b| b.0 >= p.info.num_blocks)
        {
            Some(AdmitError::BlockOutOfRange {
                block: b.0,
                pool: p.info.num_blocks,
            })
        } else if self.queue.len() >= self.config.max_waiting as usize {
            Some(AdmitError::QueueFull {
                max: self.config.max_waiting,
            })
        } else {
            None
        };
        if let Some(e) = refused {
            // Every refusal frees what it strands: nobody here will read P's blocks.
            self.send_abort(&remote.engine, &remote.request);
            return Err(e);
        }
        //= docs/spec.md#tracking
        //# heartbeating starts when a request with `do_remote_prefill=true` enters
        //# D's scheduler (`on_new_request`), not when it is scheduled
        self.tracker.track(
            now,
            remote.request.clone(),
            remote.engine.clone(),
            remote.tp_size,
        )?;
        match self.remotes.get_mut(&remote.engine) {
            None => {
                self.remotes
                    .insert(remote.engine.clone(), Remote::Handshaking);
                self.stats.handshakes += 1;
                self.handshakes.push_back(HandshakeStart {
                    engine: remote.engine.clone(),
                    host: remote.host.clone(),
                    port: remote.port,
                    check_instance: None,
                });
            }
            Some(Remote::Ready(p)) => {
                p.last_used = now;
                if check {
                    p.checking = true;
                    p.last_check = Some(now);
                    self.stats.instance_checks += 1;
                    self.handshakes.push_back(HandshakeStart {
                        engine: remote.engine.clone(),
                        host: remote.host.clone(),
                        port: remote.port,
                        check_instance: Some(p.info.instance),
                    });
                }
            }
            Some(Remote::Handshaking) => {}
        }
        self.by_remote.insert(remote.request.clone(), id.clone());
        self.queue.push_back(id.clone());
        self.reqs.insert(
            id,
            Req {
                remote,
                phase: Phase::Waiting,
                answered: false,
            },
        );
        Ok(())
    }

    /// A handshake with `engine` ended. On success its heartbeats go out at the next
    /// [`poll_transmit`](Self::poll_transmit) and its requests may be scheduled; on
    /// failure every request for it ends in [`LoadError::Handshake`] and the engine is
    /// forgotten (the next request handshakes again).
    ///
    /// The answer to a check ([`HandshakeStart::check_instance`]) replaces the connected
    /// engine only when P announced a newer instance than the connected one (requests of
    /// older instances then end in [`LoadError::PeerLost`]). Otherwise D keeps its
    /// connection, and the requests that named another instance end: in
    /// [`LoadError::UnknownInstance`], or, when the check failed, in
    /// [`LoadError::Handshake`]. A result for an engine the core does not wait for is
    /// ignored.
    pub fn handle_handshake(
        &mut self,
        now: Timestamp,
        engine: &EngineId,
        result: Result<RemoteEngine, HandshakeError>,
    ) {
        // P's answer is peer input: a TP size that does not split the heads (0 planned no
        // batch at all, and the load never ended) fails the handshake.
        let result = result.and_then(|info| match self.tp_misfit(info.tp_size) {
            Some(_) => Err(HandshakeError::TpSize {
                p_tp: info.tp_size,
                heads: self.config.num_kv_heads,
            }),
            None => Ok(info),
        });
        let checked = match self.remotes.get_mut(engine) {
            None => return,
            Some(Remote::Handshaking) => None,
            Some(Remote::Ready(p)) if !p.checking => return,
            Some(Remote::Ready(p)) => {
                p.checking = false;
                Some((p.info.instance, p.last_check, p.last_used))
            }
        };
        match (result, checked) {
            (Ok(info), Some((current, ..))) if info.instance <= current || current == 0 => {
                // P's side channel did not announce a newer instance: D keeps its
                // connection, and the requests that named another instance are wrong.
                self.fail_waiting(engine, |r| {
                    (r.remote.instance != current).then(|| LoadError::UnknownInstance {
                        engine: engine.clone(),
                        theirs: r.remote.instance,
                        current: info.instance,
                    })
                });
            }
            (Err(source), Some((current, ..))) => {
                self.fail_waiting(engine, |r| {
                    (r.remote.instance != current).then(|| LoadError::Handshake {
                        engine: engine.clone(),
                        source: source.clone(),
                    })
                });
            }
            (Ok(info), checked) => {
                let (last_check, last_used) = match checked {
                    Some((_, last_check, last_used)) => {
                        // P restarted under the same engine id.
                        self.stats.peer_restarts += 1;
                        (last_check, last_used)
                    }
                    None => (None, now),
                };
                self.remotes.insert(
                    engine.clone(),
                    Remote::Ready(Connected {
                        info,
                        checking: false,
                        last_check,
                        last_used,
                    }),
                );
                // Heartbeat the engine's requests now rather than an interval later.
                self.tracker.defer(engine, now);
                // Requests granted by another instance of P than the one answering lost
                // their leases with it (P restarted): they fail now, retryably.
                self.fail_waiting(engine, |r| {
                    (r.remote.instance != 0
                        && info.instance != 0
                        && r.remote.instance != info.instance)
                        .then(|| LoadError::PeerLost {
                            engine: engine.clone(),
                        })
                });
                // Requests whose block ids P's pool cannot hold fail now.
                self.events.push_back(DecodeEvent::HandshakeDone {
                    engine: engine.clone(),
                });
                self.fail_waiting(engine, |r| {
                    let b = r.remote.blocks.iter().find(|b| b.0 >= info.num_blocks)?;
                    let source: Cause = Arc::new(AdmitError::BlockOutOfRange {
                        block: b.0,
                        pool: info.num_blocks,
                    });
                    Some(LoadError::Post { source })
                });
            }
            (Err(source), None) => {
                self.remotes.remove(engine);
                // Only waiting requests exist for an engine that never became ready.
                self.fail_waiting(engine, |_| {
                    Some(LoadError::Handshake {
                        engine: engine.clone(),
                        source: source.clone(),
                    })
                });
            }
        }
    }

    /// The connection to `engine` is gone (P restarted or died): forget it, so that the
    /// next request handshakes again. Requests waiting for it end in
    /// [`LoadError::PeerLost`]; reads in flight end through their batches.
    pub fn forget_engine(&mut self, engine: &EngineId) {
        if self.remotes.remove(engine).is_none() {
            return;
        }
        self.fail_waiting(engine, |_| {
            Some(LoadError::PeerLost {
                engine: engine.clone(),
            })
        });
    }

    /// Makes room for one more P engine: true when there is some, after dropping the
    /// least recently used connected engine that no request names
    /// ([`DecodeEvent::EngineDropped`]); false when every kept engine is in use.
    fn make_room(&mut self) -> bool {
        if self.remotes.len() < self.config.max_engines {
            return true;
        }
        let victim = self
            .remotes
            .iter()
            .filter_map(|(e, r)| match r {
                Remote::Ready(p) if !p.checking => Some((p.last_used, e)),
                _ => None,
            })
            .filter(|(_, e)| !self.reqs.values().any(|r| &r.remote.engine == *e))
            .min()
            .map(|(_, e)| e.clone());
        let Some(engine) = victim else {
            return false;
        };
        self.remotes.remove(&engine);
        self.stats.engines_evicted += 1;
        self.events.push_back(DecodeEvent::EngineDropped { engine });
        true
    }

    /// Ends every waiting request for `engine` for which `why` gives an error, in arrival
    /// order (the queue's).
    fn fail_waiting(&mut self, engine: &EngineId, why: impl Fn(&Req) -> Option<LoadError>) {
        let victims: Vec<(RequestId, LoadError)> = self
            .queue
            .iter()
            .filter_map(|id| Some((id, self.reqs.get(id)?)))
            .filter(|(_, r)| &r.remote.engine == engine && matches!(r.phase, Phase::Waiting))
            .filter_map(|(id, r)| Some((id.clone(), why(r)?)))
            .collect();
        for (id, e) in victims {
            self.end(&id, Outcome::Failed(e));
        }
    }

    /// A notification from an endpoint of P engine `from`. Expiry notices fail the waiting
    /// requests they name (never read; recompute) when they come from the engine that
    /// holds those leases and name the generation D was given. P's frames about held
    /// turns (bidirectional mode) are reported, not applied: a core that keeps turns takes
    /// its notifications through [`handle_notif_at`](Self::handle_notif_at). Never panics.
    pub fn handle_notif(&mut self, from: &EngineId, bytes: &[u8]) -> DecodeNotif {
        match kvlease_notif::decode(bytes) {
            Ok(Notif::Expired(leases)) => {
                let n = u32::try_from(leases.len()).unwrap_or(u32::MAX);
                let mut failed = 0;
                let mut foreign = false;
                for lease in leases {
                    let Some(id) = self.by_remote.get(&lease.request).cloned() else {
                        continue;
                    };
                    let Some(req) = self.reqs.get(&id) else {
                        continue;
                    };
                    if &req.remote.engine != from {
                        foreign = true;
                        continue;
                    }
                    if req.remote.generation != lease.generation.word() {
                        continue;
                    }
                    // In flight: the fence decides (P publishes the free word before it
                    // frees the blocks). Already read: the notice came late.
                    if req.is_waiting() {
                        failed += 1;
                        let e = LoadError::Expired {
                            request: lease.request,
                        };
                        self.end(&id, Outcome::Failed(e));
                    }
                }
                if foreign {
                    self.stats.foreign_notifs += 1;
                    return DecodeNotif::Foreign;
                }
                self.stats.expiry_notices += 1;
                DecodeNotif::Expired { leases: n, failed }
            }
            Ok(Notif::Heartbeat(ids)) => DecodeNotif::CacheHeartbeat(
                ids.iter().filter_map(|i| RequestId::new(i).ok()).collect(),
            ),
            Ok(Notif::ReadComplete(rc)) => DecodeNotif::CacheReadComplete(rc.request),
            // Push-mode frames are for D's `Reservations`, not the pull core.
            Ok(
                Notif::Abort(_)
                | Notif::App(_)
                | Notif::PushRegister(_)
                | Notif::PushHeartbeat(_)
                | Notif::WriteDone(_)
                | Notif::PushFailed(_)
                | Notif::ReservationReleased(_),
            ) => DecodeNotif::Ignored,
            Err(e) => {
                self.stats.malformed_notifs += 1;
                DecodeNotif::Malformed(e)
            }
        }
    }

    /// Aborts a request, by D's id or P's `remote_request_id` (the client went away, or
    /// `POST /v1/abort`). P is told when it had not been read. Returns whether it was
    /// known.
    pub fn abort(&mut self, id: &RequestId) -> bool {
        let id = if self.reqs.contains_key(id) {
            id.clone()
        } else if let Some(d) = self.by_remote.get(id) {
            d.clone()
        } else {
            return false;
        };
        if self.reqs.get(&id).is_some_and(|r| r.answered) {
            return false;
        }
        self.end(&id, Outcome::Aborted);
        true
    }

    /// A read batch of a request ended (vLLM: the worker's `get_finished`).
    pub fn handle_batch_done(&mut self, request: &RequestId, batch: usize, result: BatchResult) {
        let Some(req) = self.reqs.get_mut(request) else {
            return;
        };
        let Phase::Loading { results, .. } = &mut req.phase else {
            return;
        };
        let Some((_, slot)) = results.get_mut(batch) else {
            return;
        };
        if slot.is_some() {
            return;
        }
        *slot = Some(result);
        if results.iter().any(|(_, r)| r.is_none()) {
            return;
        }
        self.complete_load(request);
    }

    /// The verification after [`DecodeEvent::Loaded`]: `Ok` starts decoding, `Err` ends
    /// the request in [`LoadError::Verify`].
    pub fn handle_verified(&mut self, request: &RequestId, result: Result<(), Cause>) {
        let Some(req) = self.reqs.get_mut(request) else {
            return;
        };
        let Phase::Verifying { blocks } = &mut req.phase else {
            return;
        };
        let blocks = std::mem::take(blocks);
        if req.answered {
            self.remove(request, &blocks);
            return;
        }
        match result {
            Ok(()) => req.phase = Phase::Decoding { blocks },
            Err(source) => {
                req.phase = Phase::Decoding { blocks };
                self.end(request, Outcome::Failed(LoadError::Verify { source }));
            }
        }
    }

    /// The model finished decoding `request` (vLLM: `request_finished` on D): its blocks
    /// are freed and it ends [`Outcome::Done`]. Returns whether it was decoding.
    pub fn request_finished(&mut self, request: &RequestId) -> bool {
        match self.request_finished_keep(request) {
            Some(blocks) => {
                self.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// Like [`request_finished`](Self::request_finished), but hands the request's blocks to
    /// the caller (bidirectional mode keeps a turn for P to pull); give them back with
    /// [`free_blocks`](Self::free_blocks).
    pub fn request_finished_keep(&mut self, request: &RequestId) -> Option<Vec<BlockId>> {
        let req = self.reqs.get_mut(request)?;
        let Phase::Decoding { blocks } = &mut req.phase else {
            return None;
        };
        if req.answered {
            return None;
        }
        let blocks = std::mem::take(blocks);
        self.end(request, Outcome::Done);
        Some(blocks)
    }

    /// Gives back blocks taken with [`request_finished_keep`](Self::request_finished_keep).
    pub fn free_blocks(&mut self, blocks: &[BlockId]) {
        self.free(blocks);
    }

    /// Ends every request ([`Outcome::Shutdown`]), in id order, for a shell that stops.
    pub fn shutdown(&mut self) {
        let ids: Vec<RequestId> = self.reqs.keys().cloned().collect();
        for id in ids {
            if self.reqs.get(&id).is_some_and(|r| !r.answered) {
                self.end(&id, Outcome::Shutdown);
            }
        }
    }

    // ------------------------------------------------------------------ outputs

    /// The next handshake to start.
    #[must_use]
    pub fn poll_handshake(&mut self) -> Option<HandshakeStart> {
        self.handshakes.pop_front()
    }

    /// The next notification for P: aborts first, then every heartbeat batch due at `now`
    /// (vLLM: `build_connector_meta` carries them, `start_load_kv` sends them). A batch for
    /// an engine still handshaking is deferred by [`DecodeConfig::retry`].
    #[must_use]
    pub fn poll_transmit(&mut self, now: Timestamp) -> Option<Transmit> {
        loop {
            if let Some(t) = self.transmits.pop_front() {
                return Some(t);
            }
            let batch = self.tracker.poll_heartbeat(now)?;
            if !self.is_ready(&batch.engine) {
                let retry = now.checked_add(self.config.retry).unwrap_or(now);
                self.tracker.defer(&batch.engine, retry);
                self.stats.deferred_batches += 1;
                continue;
            }
            // Ids validated on entry always encode; an error would only skip one round.
            let Ok(msgs) =
                kvlease_notif::encode_heartbeats(&batch.requests, kvlease_notif::MAX_NOTIF_LEN)
            else {
                continue;
            };
            for bytes in msgs {
                // A message is `HB:` and its ids joined by `,`, a byte no id holds:
                // count the ids without decoding what was just encoded.
                let commas = bytes.iter().filter(|&&b| b == b',').count();
                let ids = u32::try_from(commas + 1).unwrap_or(u32::MAX);
                self.stats.heartbeat_messages += 1;
                self.stats.heartbeat_ids += u64::from(ids);
                self.transmits.push_back(Transmit {
                    engine: batch.engine.clone(),
                    workers: batch.workers,
                    bytes,
                    kind: TransmitKind::Heartbeat { ids },
                });
            }
        }
    }

    /// The next request to load, in arrival order, while fewer than `max_running` run:
    /// D's blocks are allocated and the batches planned. `None` when nothing can start
    /// (no request whose engine is ready, the running bound, or too few free blocks: see
    /// [`blocks_short`](Self::blocks_short)).
    #[must_use]
    pub fn poll_load(&mut self) -> Option<LoadPlan> {
        let i = self.next_schedulable()?;
        let id = self.queue.get(i)?.clone();
        let req = self.reqs.get(&id)?;
        let Some(Remote::Ready(p)) = self.remotes.get(&req.remote.engine) else {
            return None;
        };
        let (p_tp, remote) = (p.info.tp_size, req.remote.clone());
        let blocks = self.blocks.alloc(remote.blocks.len()).ok()?;
        self.queue.remove(i);
        Some(self.begin_load(id, remote, blocks, 0, p_tp))
    }

    /// Blocks the first schedulable request needs beyond those free, or `None` (a shell
    /// with evictable cached blocks frees that many, then polls again).
    pub fn blocks_short(&self) -> Option<usize> {
        let id = self.queue.get(self.next_schedulable()?)?;
        let need = self.reqs.get(id)?.remote.blocks.len();
        need.checked_sub(self.blocks.free_count())
            .filter(|&n| n > 0)
    }

    /// The queue position of the first request whose P engine is ready, while fewer than
    /// `max_running` run; `None` for a core whose blocks the serving engine allocates
    /// (it schedules with [`start_load`](Self::start_load)).
    fn next_schedulable(&self) -> Option<usize> {
        if self.blocks.source() != BlockSource::Pool
            || self.running() >= self.config.max_running as usize
        {
            return None;
        }
        self.queue
            .iter()
            .position(|id| self.reqs.get(id).is_some_and(|r| self.loadable(r)))
    }

    /// The serving engine scheduled waiting `request` and allocated `blocks` for the KV it
    /// loads (vLLM: `update_state_after_alloc` with `num_external_tokens > 0`): plans its
    /// reads, for a core whose [`BlockSource`] is external. The first `skip_blocks` of
    /// P's blocks are not read (the engine computed them already: a local prefix-cache
    /// hit); `blocks[i]` receives P's block `skip_blocks + i`. The serving engine's
    /// scheduling limits apply, not [`DecodeConfig::max_running`].
    ///
    /// # Errors
    /// [`StartLoadError`]; nothing changed.
    pub fn start_load(
        &mut self,
        request: &RequestId,
        blocks: Vec<BlockId>,
        skip_blocks: usize,
    ) -> Result<LoadPlan, StartLoadError> {
        if self.blocks.source() != BlockSource::External {
            return Err(StartLoadError::WrongBlockSource {
                core: self.blocks.source(),
            });
        }
        let Some(req) = self.reqs.get(request).filter(|r| r.is_waiting()) else {
            return Err(StartLoadError::NotWaiting {
                request: request.clone(),
            });
        };
        let Some(Remote::Ready(p)) = self
            .remotes
            .get(&req.remote.engine)
            .filter(|_| self.loadable(req))
        else {
            return Err(StartLoadError::NotReady {
                engine: req.remote.engine.clone(),
            });
        };
        let need = req.remote.blocks.len().saturating_sub(skip_blocks);
        if need == 0 || blocks.len() != need {
            return Err(StartLoadError::BlockCount {
                got: blocks.len(),
                need,
            });
        }
        let (p_tp, remote) = (p.info.tp_size, req.remote.clone());
        self.queue.retain(|q| q != request);
        self.blocks.adopt(&blocks);
        Ok(self.begin_load(request.clone(), remote, blocks, skip_blocks, p_tp))
    }

    /// Plans the load of `request` (waiting, for `remote`, its engine ready with TP
    /// `p_tp`) into `blocks` and moves it to loading.
    fn begin_load(
        &mut self,
        request: RequestId,
        remote: RemoteKv,
        blocks: Vec<BlockId>,
        skip_blocks: usize,
        p_tp: u32,
    ) -> LoadPlan {
        let batches = self.plan_batches(&remote, p_tp);
        if let Some(req) = self.reqs.get_mut(&request) {
            req.phase = Phase::Loading {
                blocks: blocks.clone(),
                results: batches.iter().map(|b| (b.p_rank, None)).collect(),
            };
        }
        LoadPlan {
            request,
            blocks,
            fence_generation: remote.generation,
            remote,
            skip_blocks,
            batches,
        }
    }

    /// When to call [`poll_transmit`](Self::poll_transmit) (and, for a core that keeps
    /// turns, [`handle_timeout`](Self::handle_timeout)) next; `None` when nothing is
    /// tracked or held.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let held = self.hold.as_ref().and_then(DecoderHold::poll_timeout);
        [self.tracker.poll_timeout(), held]
            .into_iter()
            .flatten()
            .min()
    }

    /// The next event, in order.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<DecodeEvent> {
        self.events.pop_front()
    }

    // ------------------------------------------------------------------ internals

    fn complete_load(&mut self, id: &RequestId) {
        let Some(req) = self.reqs.get_mut(id) else {
            return;
        };
        let Phase::Loading { blocks, results } = &mut req.phase else {
            return;
        };
        let blocks = std::mem::take(blocks);
        let results = std::mem::take(results);
        if req.answered {
            // Answered already; the reads are over, so the blocks can go.
            self.remove(id, &blocks);
            return;
        }
        let mut bytes = 0;
        let mut failure = None;
        for (p_rank, r) in results {
            match r {
                Some(BatchResult::Done { bytes: n }) => bytes += n,
                Some(BatchResult::Stale) => {
                    self.stats.stale_reads += 1;
                    failure.get_or_insert(LoadError::Stale { p_rank });
                }
                Some(BatchResult::Failed(source)) => {
                    failure.get_or_insert(LoadError::Read { p_rank, source });
                }
                None => {}
            }
        }
        let Some(req) = self.reqs.get_mut(id) else {
            return;
        };
        match failure {
            Some(e) => {
                req.phase = Phase::Decoding { blocks };
                self.end(id, Outcome::Failed(e));
            }
            None => {
                //= docs/spec.md#tracking
                //# Tracking stops when the KV transfer completes
                self.tracker.untrack(&req.remote.request);
                req.phase = Phase::Verifying {
                    blocks: blocks.clone(),
                };
                self.events.push_back(DecodeEvent::Loaded {
                    request: id.clone(),
                    blocks,
                    bytes,
                });
            }
        }
    }

    /// Ends a request: untracks it, tells P when it had not been read, reports the
    /// outcome, frees its blocks (at once, or when its reads in flight end).
    fn end(&mut self, id: &RequestId, outcome: Outcome) {
        let Some(req) = self.reqs.get_mut(id) else {
            return;
        };
        if req.answered {
            return;
        }
        let was_tracked = self.tracker.untrack(&req.remote.request);
        match &outcome {
            Outcome::Done => self.stats.done += 1,
            Outcome::Failed(_) => self.stats.failed += 1,
            Outcome::Aborted | Outcome::Shutdown => self.stats.aborted += 1,
        }
        let (engine, remote) = (req.remote.engine.clone(), req.remote.request.clone());
        // What to free now: nothing while the transport (or the verifier) still uses the
        // blocks; they go when it is done.
        let free_now = match &mut req.phase {
            Phase::Loading { .. } | Phase::Verifying { .. } => {
                req.answered = true;
                None
            }
            Phase::Waiting => Some(Vec::new()),
            Phase::Decoding { blocks } => Some(std::mem::take(blocks)),
        };
        self.events.push_back(DecodeEvent::Finished {
            request: id.clone(),
            outcome,
        });
        if was_tracked {
            // Not (wholly) read: P may free at once.
            self.send_abort(&engine, &remote);
        }
        if let Some(blocks) = free_now {
            self.queue.retain(|q| q != id);
            self.remove(id, &blocks);
        }
    }

    fn remove(&mut self, id: &RequestId, blocks: &[BlockId]) {
        if let Some(req) = self.reqs.remove(id) {
            self.by_remote.remove(&req.remote.request);
        }
        self.free(blocks);
    }

    fn send_abort(&mut self, engine: &EngineId, remote: &RequestId) {
        let Some(Remote::Ready(p)) = self.remotes.get(engine) else {
            return;
        };
        self.stats.aborts_sent += 1;
        self.transmits.push_back(Transmit {
            engine: engine.clone(),
            workers: p.info.tp_size,
            bytes: Abort {
                request: remote.clone(),
                consumer: ConsumerId::new(self.config.engine_id.clone(), 0),
            }
            .encode(),
            kind: TransmitKind::Abort,
        });
    }

    fn free(&mut self, blocks: &[BlockId]) {
        self.blocks.free(blocks);
    }
}

#[cfg(test)]
mod tests;
