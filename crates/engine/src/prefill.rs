//! The prefill core ([`PrefillCore`]): which request gets which blocks, when its lease is
//! granted, renewed and released, and who is told.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use kvlease_lease::{
    AllocError, BlockId, ConsumerId, EngineId, Event, Generation, GrantError, HeartbeatOutcome,
    LeaseConfig, LeaseTable, ReadCompleteOutcome, ReleaseReason, Released, RequestId, Timestamp,
};
use kvlease_notif::{DecodeError, ExpiredLease, Notif, expiry_notice};

use crate::blocks::{BlockSource, Blocks};

/// How far above the first lease generation the holds' generations start
/// ([`PrefillConfig::with_holds`]): leases count up from `first_generation`, holds from
/// `first_generation + HOLD_GENERATIONS`, so the fence words both publish never see a
/// generation twice on a block (that takes 2^62 leases).
pub const HOLD_GENERATIONS: u64 = 1 << 62;

/// The first hold generation for a core whose leases start at `first`. Saturating: a first
/// generation with no room above it leaves the holds one generation (`u64::MAX`), after
/// which every hold is refused, never a generation repeated.
fn hold_generation(first: Generation) -> Generation {
    Generation(first.0.saturating_add(HOLD_GENERATIONS))
}

/// Which of the core's tables: the leases P grants on prefilled prompts, or the holds on
/// finished turns (bidirectional mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Book {
    Leases,
    Holds,
}

/// The sender of a notification, as the transport authenticated it: the engine it belongs
/// to and the shell's own address of that endpoint (a transport peer name in the agent, a
/// virtual address in the simulator).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Peer<A> {
    /// The engine the sender belongs to.
    pub engine: EngineId,
    /// Where replies to it go (expiry notices).
    pub addr: A,
}

/// How to build a [`PrefillCore`].
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// Workers (TP ranks); every worker holds the same block ids of a request.
    pub tp_size: u32,
    /// Blocks per worker pool.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Lease timing and mode.
    pub lease: LeaseConfig,
    /// How long a request may wait at the head of the queue for free blocks.
    pub pool_wait: Duration,
    /// The first lease generation. A restarted P must start above every generation an old
    /// reader could still hold (the agent uses the wall clock in microseconds).
    pub first_generation: Generation,
    /// The most consumers a read-completion may claim (`consumers_total`): a forged or
    /// broken report cannot make a lease wait for more readers than can exist.
    pub max_consumers: u32,
    /// Where block ids come from: the core's own pool (default) or the serving engine.
    pub block_source: BlockSource,
    /// Bidirectional mode: the terms of the holds on this engine's own finished turns
    /// ([`PrefillCore::hold_in`]), `None` (default) for no holds.
    pub holds: Option<LeaseConfig>,
}

impl PrefillConfig {
    /// A config with the defaults for everything but the engine's shape: no pool wait,
    /// generations from 1, at most `max(tp_size, 64)` consumers.
    pub fn new(
        engine_id: EngineId,
        tp_size: u32,
        num_blocks: u32,
        block_size: u32,
        lease: LeaseConfig,
    ) -> Self {
        Self {
            engine_id,
            tp_size,
            num_blocks,
            block_size,
            lease,
            pool_wait: Duration::ZERO,
            first_generation: Generation(std::num::NonZeroU64::MIN),
            max_consumers: tp_size.max(64),
            block_source: BlockSource::Pool,
            holds: None,
        }
    }

    /// Sets [`block_source`](Self::block_source).
    #[must_use]
    pub fn with_block_source(mut self, source: BlockSource) -> Self {
        self.block_source = source;
        self
    }

    /// Sets [`pool_wait`](Self::pool_wait).
    #[must_use]
    pub fn with_pool_wait(mut self, wait: Duration) -> Self {
        self.pool_wait = wait;
        self
    }

    /// Sets [`first_generation`](Self::first_generation).
    #[must_use]
    pub fn with_first_generation(mut self, first: Generation) -> Self {
        self.first_generation = first;
        self
    }

    /// Sets [`holds`](Self::holds): a finished turn's blocks are held on these terms
    /// (bidirectional mode: `decoder_kv_blocks_ttl`, renewed by the next turn's reader's
    /// heartbeats in [`LeaseMode::Lease`](kvlease_lease::LeaseMode), not in `Fixed`).
    #[must_use]
    pub fn with_holds(mut self, terms: LeaseConfig) -> Self {
        self.holds = Some(terms);
        self
    }

    /// Sets [`max_consumers`](Self::max_consumers) (at least 1).
    #[must_use]
    pub fn with_max_consumers(mut self, max: u32) -> Self {
        self.max_consumers = max.max(1);
        self
    }
}

/// Why P refused or could not finish a request. Typed: the HTTP edge maps it to a status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefillError {
    /// The prompt needs more blocks than a pool has.
    #[error("the prompt needs {needed} blocks, the pool has {pool}")]
    PromptTooLong {
        /// Blocks needed.
        needed: usize,
        /// Blocks per pool.
        pool: u32,
    },
    /// The prompt is empty: nothing to prefill.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The request is already queued or being prefilled here.
    #[error("request {request} is already being prefilled")]
    Duplicate {
        /// The request.
        request: RequestId,
    },
    /// No blocks came free within the pool wait.
    #[error("no free KV blocks for {needed} blocks within {} ms", waited.as_millis())]
    PoolWaitTimeout {
        /// Blocks needed.
        needed: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// [`PrefillCore::handle_prefill_done`] for a request the core is not prefilling.
    #[error("request {request} is not being prefilled")]
    NotPrefilling {
        /// The request.
        request: RequestId,
    },
    /// The lease table refused the grant.
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// The call needs the other [`BlockSource`] than the core's (`handle_job` on a core
    /// whose blocks the serving engine allocates, or `handle_prefill_done_in` on one with
    /// its own pool).
    #[error("this prefill core's blocks come from {core:?}")]
    WrongBlockSource {
        /// The core's block source.
        core: BlockSource,
    },
    /// A block id the serving engine gave is outside the pool.
    #[error("block id {block} is outside the pool of {pool} blocks")]
    BlockOutOfRange {
        /// The id.
        block: u32,
        /// Blocks per pool.
        pool: u32,
    },
    /// The engine is shutting down.
    #[error("the prefill engine is shutting down")]
    ShuttingDown,
    /// [`PrefillCore::hold_in`] on a core built without [`PrefillConfig::with_holds`].
    #[error("this engine holds no finished turns (bidirectional mode is off)")]
    NoHolds,
}

impl PrefillError {
    /// Whether the client may retry the same request later (the engine is busy, not the
    /// request wrong).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::PoolWaitTimeout { .. } | Self::ShuttingDown)
    }
}

/// A request whose blocks were allocated: compute and fill them, then call
/// [`PrefillCore::handle_prefill_done`] (or [`handle_prefill_failed`](PrefillCore::handle_prefill_failed)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillStart {
    /// The request.
    pub request: RequestId,
    /// Its blocks, the same ids on every worker.
    pub blocks: Vec<BlockId>,
    /// How long it waited for them.
    pub waited: Duration,
}

/// A granted lease: publish `generation` in every worker's fence words of `blocks`, then
/// answer with the request's transfer parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    /// The request.
    pub request: RequestId,
    /// Its blocks.
    pub blocks: Vec<BlockId>,
    /// The lease's fencing token.
    pub generation: Generation,
    /// Whether the grant replaced an older lease of the same request id (a retry).
    pub superseded: bool,
}

/// Something the shell must do, drained with [`PrefillCore::poll_action`] after every
/// input and before the next [`poll_prefill`](PrefillCore::poll_prefill).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillAction<A> {
    /// A lease ended: publish [`Generation::FREE_WORD`] in every worker's fence words of
    /// `blocks` **now**. The core hands the blocks to the next allocation only after this
    /// action was polled, so a reader still holding the old generation sees its read was
    /// fenced off before any byte is reused.
    ClearFences {
        /// The lease that ended.
        released: Released,
    },
    /// Send `bytes` (an expiry notice) to the D endpoint `to`.
    Transmit {
        /// The D endpoint.
        to: A,
        /// The encoded notification.
        bytes: Vec<u8>,
    },
}

/// What [`PrefillCore::handle_notif`] did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillNotif {
    /// A heartbeat. Ids of leases another D engine owns were not applied.
    Heartbeat {
        /// Ids the message named.
        ids: u32,
        /// What the table did with the ids applied.
        outcome: HeartbeatOutcome,
        /// Ids of leases owned by another D engine (ignored).
        foreign: u32,
    },
    /// A read completion.
    ReadComplete {
        /// The request.
        request: RequestId,
        /// What the table did.
        outcome: ReadCompleteOutcome,
    },
    /// An abort; `held` says whether it released a lease.
    Abort {
        /// The request.
        request: RequestId,
        /// Whether a lease was released.
        held: bool,
    },
    /// A completion or abort for a lease another D engine owns, or whose consumer names
    /// another engine than its sender, or that claims more consumers than can exist:
    /// ignored.
    Foreign {
        /// The request named.
        request: RequestId,
    },
    /// A message P's pull core never expects (an expiry notice, a push-mode frame) or an
    /// application message: ignored.
    Ignored,
    /// A malformed message: ignored.
    Malformed(DecodeError),
}

/// Counters of a [`PrefillCore`], cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillStats {
    /// Jobs taken.
    pub jobs: u64,
    /// Leases granted.
    pub granted: u64,
    /// Requests refused (before or after waiting).
    pub refused: u64,
    /// Leases released because every consumer reported.
    pub released_completed: u64,
    /// Leases released by the reaper.
    pub released_expired: u64,
    /// Leases released by an abort (D's, the client's, or a superseding grant).
    pub released_aborted: u64,
    /// Notifications from a D engine about a lease another engine owns (ignored).
    pub foreign_notifs: u64,
    /// Malformed notifications.
    pub malformed_notifs: u64,
    /// Expiry notices sent (messages).
    pub expiry_notices: u64,
    /// Finished turns held ([`PrefillCore::hold_in`]).
    pub holds_granted: u64,
    /// Holds released because the next turn's reader read them.
    pub holds_released_completed: u64,
    /// Holds that reached their end (the TTL, or the last renewal, passed).
    pub holds_released_expired: u64,
    /// Holds released by an abort (the reader gave up, or the turn was held again).
    pub holds_released_aborted: u64,
}

/// A lease's owner: the first D engine that heartbeated, read or aborted it, and the
/// endpoint of that engine that heartbeated it last (where an expiry notice goes).
#[derive(Debug, Clone)]
struct Claim<A> {
    engine: EngineId,
    heartbeater: Option<A>,
}

#[derive(Debug)]
struct Waiting {
    request: RequestId,
    needed: usize,
    since: Timestamp,
}

/// Everything a prefill engine (P) decides, and nothing it does.
///
/// One core per P engine, whatever its TP size: a request has the same block ids on every
/// worker and one lease (read by every reader that overlaps its heads).
///
/// # Call order (one forward-loop step)
/// 1. [`handle_job`](Self::handle_job) for every new request (errors refuse it at once);
/// 2. [`poll_prefill`](Self::poll_prefill) until `None`: each start is computed and filled
///    by the shell, then [`handle_prefill_done`](Self::handle_prefill_done) grants its
///    lease (publish the generation, answer the client);
/// 3. [`handle_notif`](Self::handle_notif) for every notification received;
/// 4. [`handle_timeout`](Self::handle_timeout) (the reaper);
/// 5. after **every** input: [`poll_action`](Self::poll_action) until `None` (clear fences,
///    send expiry notices) and [`poll_event`](Self::poll_event) until `None` (refusals and
///    releases, for the client and the metrics).
///
/// There is no heartbeat thread: heartbeats are handled in step 3.
///
/// # Order
/// Everything the core hands out comes in an order defined by its inputs, never by a
/// hash: the queue is served in arrival order, the reaper releases in deadline order (then
/// grant order, see [`LeaseTable`]), and the actions and events of one input come in the
/// order the table released. The two hash maps (`prefilling`, `claims`) are looked up,
/// never walked: `claims` holds one entry per lease (up to the table's millions) and is
/// read for every id of every heartbeat, so it keeps O(1) lookups.
#[derive(Debug)]
pub struct PrefillCore<A> {
    config: PrefillConfig,
    table: LeaseTable,
    /// Bidirectional mode: holds on finished turns, on their own terms, their generations
    /// from [`HOLD_GENERATIONS`] up (a reader's fence word tells a hold's from a lease's).
    holds: Option<LeaseTable>,
    blocks: Blocks,
    waiting: VecDeque<Waiting>,
    /// Looked up only, never iterated (its order would be the hash's).
    prefilling: HashMap<RequestId, Vec<BlockId>>,
    /// Looked up only, never iterated (its order would be the hash's).
    claims: HashMap<RequestId, Claim<A>>,
    actions: VecDeque<PrefillAction<A>>,
    events: VecDeque<PrefillEvent>,
    stats: PrefillStats,
}

/// What the core reports, drained with [`PrefillCore::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillEvent {
    /// A queued request was refused (no blocks within the pool wait, shutdown): answer the
    /// client with `error`. Every job ends in exactly one of this, an error from
    /// [`PrefillCore::handle_job`] or [`PrefillCore::handle_prefill_done`], or a grant.
    Refused {
        /// The request.
        request: RequestId,
        /// Why.
        error: PrefillError,
    },
    /// A lease ended (its fences are cleared through [`PrefillAction::ClearFences`]).
    Released(Released),
    /// A hold ended (its fences are cleared through [`PrefillAction::ClearFences`]).
    HoldReleased(Released),
}

impl<A: Clone + Eq + Hash> PrefillCore<A> {
    /// A core with every block free and no lease.
    pub fn new(config: PrefillConfig) -> Self {
        Self {
            table: LeaseTable::with_first_generation(config.lease, config.first_generation),
            holds: config.holds.map(|terms| {
                LeaseTable::with_first_generation(terms, hold_generation(config.first_generation))
            }),
            blocks: Blocks::new(config.block_source, config.num_blocks),
            waiting: VecDeque::new(),
            prefilling: HashMap::new(),
            claims: HashMap::new(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            stats: PrefillStats::default(),
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PrefillConfig {
        &self.config
    }

    /// The counters.
    pub fn stats(&self) -> PrefillStats {
        self.stats
    }

    /// The lease table (read only).
    pub fn table(&self) -> &LeaseTable {
        &self.table
    }

    /// The holds on finished turns (bidirectional mode), if the core keeps any.
    #[must_use]
    pub fn holds(&self) -> Option<&LeaseTable> {
        self.holds.as_ref()
    }

    /// Whether `generation` is a hold's (from the holds' range) rather than a lease's.
    #[must_use]
    pub fn is_hold(&self, generation: Generation) -> bool {
        self.holds.is_some() && generation >= hold_generation(self.config.first_generation)
    }

    /// Leases held.
    pub fn leases(&self) -> usize {
        self.table.len()
    }

    /// Blocks held by leases.
    pub fn blocks_leased(&self) -> usize {
        self.table.blocks_held()
    }

    /// Blocks allocated (leased, being prefilled, or awaiting their fence clear).
    pub fn blocks_allocated(&self) -> usize {
        self.blocks.allocated_count()
    }

    /// Requests waiting for blocks.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests between [`poll_prefill`](Self::poll_prefill) and their
    /// [`handle_prefill_done`](Self::handle_prefill_done).
    pub fn prefilling(&self) -> usize {
        self.prefilling.len()
    }

    /// The D engine that owns `request`'s lease, once one heartbeated, read or aborted it.
    pub fn owner(&self, request: &RequestId) -> Option<&EngineId> {
        self.claims.get(request).map(|c| &c.engine)
    }

    /// Whether nothing is queued, prefilling or leased, and every block is free.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.prefilling.is_empty()
            && self.table.is_empty()
            && self.blocks.allocated_count() == 0
    }

    /// Blocks needed for `num_tokens`.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.config.block_size.max(1) as usize)
    }

    // ------------------------------------------------------------------ inputs

    /// A request arrived (vLLM: the scheduler's `add_request`); it waits for blocks.
    ///
    /// # Errors
    /// [`PrefillError::EmptyPrompt`], [`PrefillError::PromptTooLong`] or
    /// [`PrefillError::Duplicate`]; [`PrefillError::WrongBlockSource`] when the serving
    /// engine allocates (use [`handle_prefill_done_in`](Self::handle_prefill_done_in)).
    /// The request is refused and nothing changed.
    pub fn handle_job(
        &mut self,
        now: Timestamp,
        request: RequestId,
        num_tokens: usize,
    ) -> Result<(), PrefillError> {
        self.stats.jobs += 1;
        let needed = self.blocks_for(num_tokens);
        let refused = if self.blocks.source() != BlockSource::Pool {
            Some(PrefillError::WrongBlockSource {
                core: self.blocks.source(),
            })
        } else if needed == 0 {
            Some(PrefillError::EmptyPrompt)
        } else if needed > self.config.num_blocks as usize {
            Some(PrefillError::PromptTooLong {
                needed,
                pool: self.config.num_blocks,
            })
        } else if self.prefilling.contains_key(&request)
            || self.waiting.iter().any(|w| w.request == request)
        {
            Some(PrefillError::Duplicate {
                request: request.clone(),
            })
        } else {
            None
        };
        if let Some(e) = refused {
            self.stats.refused += 1;
            return Err(e);
        }
        self.waiting.push_back(Waiting {
            request,
            needed,
            since: now,
        });
        Ok(())
    }

    /// The next request to prefill, with its blocks, in arrival order; `None` when the
    /// queue is empty or its head waits for blocks. A head that waited longer than the
    /// pool wait is refused ([`PrefillEvent::Refused`]) and the next one is tried.
    ///
    /// Returns `None` while fence clears are undrained ([`poll_action`](Self::poll_action)).
    pub fn poll_prefill(&mut self, now: Timestamp) -> Option<PrefillStart> {
        // Released blocks return to the allocator only as their fence clears are polled:
        // allocate nothing while one is pending.
        if self
            .actions
            .iter()
            .any(|a| matches!(a, PrefillAction::ClearFences { .. }))
        {
            return None;
        }
        while let Some(head) = self.waiting.front() {
            let waited = now.saturating_duration_since(head.since);
            match self.blocks.alloc(head.needed) {
                Ok(blocks) => {
                    let head = self.waiting.pop_front()?;
                    self.prefilling.insert(head.request.clone(), blocks.clone());
                    return Some(PrefillStart {
                        request: head.request,
                        blocks,
                        waited,
                    });
                }
                Err(AllocError::Exhausted { .. }) if waited < self.config.pool_wait => {
                    // Head of line waits for releases.
                    return None;
                }
                Err(_) => {
                    let head = self.waiting.pop_front()?;
                    self.stats.refused += 1;
                    self.events.push_back(PrefillEvent::Refused {
                        request: head.request,
                        error: PrefillError::PoolWaitTimeout {
                            needed: head.needed,
                            waited,
                        },
                    });
                }
            }
        }
        None
    }

    /// The prefill of `request` is computed and its blocks filled on every worker (vLLM:
    /// the scheduler's `request_finished` on P): grant the lease. The caller publishes
    /// [`Granted::generation`] in the fence words and answers the client. A lease still
    /// held under the same request id (a retry after a failed load) is aborted first.
    ///
    /// # Errors
    /// [`PrefillError::NotPrefilling`] for an unknown request; [`PrefillError::Grant`]
    /// when the table refuses (the blocks are freed).
    pub fn handle_prefill_done(
        &mut self,
        now: Timestamp,
        request: &RequestId,
    ) -> Result<Granted, PrefillError> {
        let Some(blocks) = self.prefilling.remove(request) else {
            return Err(PrefillError::NotPrefilling {
                request: request.clone(),
            });
        };
        self.grant(now, request, blocks, Book::Leases)
    }

    /// Grants the lease (or, in [`Book::Holds`], the hold) of `request` over `blocks`
    /// (the core's to account for), aborting one still held under the same id in that
    /// table first; the blocks are freed when the table refuses.
    fn grant(
        &mut self,
        now: Timestamp,
        request: &RequestId,
        blocks: Vec<BlockId>,
        book: Book,
    ) -> Result<Granted, PrefillError> {
        let consumers = self.config.tp_size.max(1);
        let Some(table) = self.table_mut(book) else {
            self.stats.refused += 1;
            self.free(&blocks);
            return Err(PrefillError::NoHolds);
        };
        let superseded = table.abort(now, request);
        let granted = table.grant(now, request.clone(), blocks.clone(), consumers);
        if superseded {
            self.drain_table();
        }
        match granted {
            Ok(generation) => {
                match book {
                    Book::Leases => self.stats.granted += 1,
                    Book::Holds => self.stats.holds_granted += 1,
                }
                self.claims.remove(request);
                Ok(Granted {
                    request: request.clone(),
                    blocks,
                    generation,
                    superseded,
                })
            }
            Err(e) => {
                self.stats.refused += 1;
                self.free(&blocks);
                Err(e.into())
            }
        }
    }

    fn table_mut(&mut self, book: Book) -> Option<&mut LeaseTable> {
        match book {
            Book::Leases => Some(&mut self.table),
            Book::Holds => self.holds.as_mut(),
        }
    }

    /// The table that holds `request` now: the holds when they do, else the leases.
    fn book_of(&self, request: &str) -> Book {
        if self.holds.as_ref().is_some_and(|h| h.holds(request)) {
            Book::Holds
        } else {
            Book::Leases
        }
    }

    /// The prefill of `request` is done in `blocks`, which the serving engine allocated
    /// (vLLM: the scheduler's `request_finished` on P, with the request's block ids):
    /// grants the lease, as [`handle_prefill_done`](Self::handle_prefill_done) does, for a
    /// core whose [`BlockSource`] is external. The blocks are the core's to account for
    /// until the lease's [`PrefillAction::ClearFences`] is polled: from then on the
    /// serving engine may free them.
    ///
    /// # Errors
    /// [`PrefillError::WrongBlockSource`] for a core with its own pool;
    /// [`PrefillError::EmptyPrompt`] for no blocks; [`PrefillError::PromptTooLong`] and
    /// [`PrefillError::BlockOutOfRange`] for blocks the pool cannot hold;
    /// [`PrefillError::Grant`] when the table refuses. Nothing is held then.
    pub fn handle_prefill_done_in(
        &mut self,
        now: Timestamp,
        request: RequestId,
        blocks: Vec<BlockId>,
    ) -> Result<Granted, PrefillError> {
        self.stats.jobs += 1;
        self.adopt(&blocks)?;
        self.grant(now, &request, blocks, Book::Leases)
    }

    /// Bidirectional mode: the serving engine finished decoding `request` in `blocks` and
    /// keeps them for the conversation's next turn, whose P reads them back (as a D reads a
    /// lease): holds them on the [`holds`](PrefillConfig::holds) terms, renewed by that
    /// reader's heartbeats (in [`LeaseMode::Lease`](kvlease_lease::LeaseMode)), released
    /// by its read completion or abort, or at the end. Publish the generation, then answer
    /// with the turn's params; a hold ends as a lease does
    /// ([`PrefillAction::ClearFences`], [`PrefillEvent::HoldReleased`]).
    ///
    /// # Errors
    /// [`PrefillError::NoHolds`] without holds; otherwise as
    /// [`handle_prefill_done_in`](Self::handle_prefill_done_in). Nothing is held then.
    pub fn hold_in(
        &mut self,
        now: Timestamp,
        request: RequestId,
        blocks: Vec<BlockId>,
    ) -> Result<Granted, PrefillError> {
        if self.holds.is_none() {
            self.stats.refused += 1;
            return Err(PrefillError::NoHolds);
        }
        self.adopt(&blocks)?;
        self.grant(now, &request, blocks, Book::Holds)
    }

    /// Takes `blocks` from the serving engine for a grant, or refuses them (counted):
    /// a core with its own pool, no blocks, or blocks the pool cannot hold.
    fn adopt(&mut self, blocks: &[BlockId]) -> Result<(), PrefillError> {
        let pool = self.config.num_blocks;
        let refused = if self.blocks.source() != BlockSource::External {
            Some(PrefillError::WrongBlockSource {
                core: self.blocks.source(),
            })
        } else if blocks.is_empty() {
            Some(PrefillError::EmptyPrompt)
        } else if blocks.len() > pool as usize {
            Some(PrefillError::PromptTooLong {
                needed: blocks.len(),
                pool,
            })
        } else {
            // (Nothing is ever being prefilled in an external core: `handle_job` refuses
            // it, so there is no duplicate to look for.)
            blocks
                .iter()
                .find(|b| b.0 >= pool)
                .map(|b| PrefillError::BlockOutOfRange { block: b.0, pool })
        };
        if let Some(e) = refused {
            self.stats.refused += 1;
            return Err(e);
        }
        self.blocks.adopt(blocks);
        Ok(())
    }

    /// The prefill of `request` failed (compute or fill error): its blocks go back. No
    /// generation was published for them.
    pub fn handle_prefill_failed(&mut self, request: &RequestId) -> bool {
        match self.prefilling.remove(request) {
            Some(blocks) => {
                self.stats.refused += 1;
                self.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// Push mode: the push of `request` ended (its KV was written into D's blocks, or it
    /// will not be): its blocks, held since [`poll_prefill`](Self::poll_prefill) and never
    /// leased (no generation was published for them), go back. Returns whether it was
    /// prefilling.
    pub fn handle_pushed(&mut self, request: &RequestId) -> bool {
        match self.prefilling.remove(request) {
            Some(blocks) => {
                self.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// The client of `request` is gone after its grant (nobody will read it), or the
    /// operator aborts it: releases the lease at once. Also drops it from the queue.
    pub fn abort(&mut self, now: Timestamp, request: &RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| &w.request == request) {
            self.waiting.remove(i);
            return true;
        }
        let book = self.book_of(request.as_str());
        let held = self
            .table_mut(book)
            .is_some_and(|table| table.abort(now, request));
        self.drain_table();
        held
    }

    /// Refuses every queued request ([`PrefillError::ShuttingDown`]), for a shell that
    /// stops.
    pub fn shutdown(&mut self) {
        for w in self.waiting.drain(..) {
            self.stats.refused += 1;
            self.events.push_back(PrefillEvent::Refused {
                request: w.request,
                error: PrefillError::ShuttingDown,
            });
        }
    }

    /// A notification from the authenticated D endpoint `from`.
    ///
    /// `HB:` renews the leases it names, read completions and aborts release them. A lease
    /// belongs to the first D engine that heartbeats, reads or aborts it; messages about it
    /// from any other engine are ignored and counted ([`PrefillStats::foreign_notifs`]).
    /// Never panics; malformed input changes nothing.
    pub fn handle_notif(&mut self, now: Timestamp, from: &Peer<A>, bytes: &[u8]) -> PrefillNotif {
        let handled = match kvlease_notif::decode(bytes) {
            Ok(Notif::Heartbeat(ids)) => {
                let mut foreign = 0u32;
                let mut count = 0u32;
                let mut mine: Vec<&str> = Vec::with_capacity(ids.len());
                for id in ids.iter() {
                    count = count.saturating_add(1);
                    match self.claims.get(id) {
                        Some(c) if c.engine != from.engine => foreign += 1,
                        _ => mine.push(id),
                    }
                }
                // A heartbeat names what a reader waits to read: leases, and holds on
                // finished turns (the symmetric lease of bidirectional mode).
                let outcome = match self.holds.as_mut() {
                    None => self.table.handle_heartbeat(now, mine.iter()),
                    Some(holds) => {
                        let (held, leased): (Vec<&str>, Vec<&str>) =
                            mine.iter().partition(|id| holds.holds(id));
                        let h = holds.handle_heartbeat(now, held.iter());
                        h.plus(self.table.handle_heartbeat(now, leased.iter()))
                    }
                };
                if outcome.held > 0 {
                    for id in mine {
                        self.claim(id, from, true);
                    }
                }
                self.stats.foreign_notifs += u64::from(foreign > 0);
                PrefillNotif::Heartbeat {
                    ids: count,
                    outcome,
                    foreign,
                }
            }
            Ok(Notif::ReadComplete(rc)) => {
                if !self.may_act(&rc.request, from, Some(&rc.consumer))
                    || rc.consumers_total > self.config.max_consumers
                {
                    self.stats.foreign_notifs += 1;
                    PrefillNotif::Foreign {
                        request: rc.request,
                    }
                } else {
                    self.claim(rc.request.as_str(), from, false);
                    let book = self.book_of(rc.request.as_str());
                    let outcome = match self.table_mut(book) {
                        Some(table) => table.handle_read_complete(
                            now,
                            &rc.request,
                            rc.consumer,
                            Some(rc.consumers_total),
                        ),
                        None => ReadCompleteOutcome::Unknown,
                    };
                    PrefillNotif::ReadComplete {
                        request: rc.request,
                        outcome,
                    }
                }
            }
            Ok(Notif::Abort(a)) => {
                if self.may_act(&a.request, from, Some(&a.consumer)) {
                    let book = self.book_of(a.request.as_str());
                    let held = self
                        .table_mut(book)
                        .is_some_and(|table| table.abort(now, &a.request));
                    PrefillNotif::Abort {
                        request: a.request,
                        held,
                    }
                } else {
                    self.stats.foreign_notifs += 1;
                    PrefillNotif::Foreign { request: a.request }
                }
            }
            // Push-mode frames are the push core's (`PushCore`), not the pull core's.
            Ok(
                Notif::Expired(_)
                | Notif::App(_)
                | Notif::PushRegister(_)
                | Notif::PushHeartbeat(_)
                | Notif::WriteDone(_)
                | Notif::PushFailed(_)
                | Notif::ReservationReleased(_),
            ) => PrefillNotif::Ignored,
            Err(e) => {
                self.stats.malformed_notifs += 1;
                PrefillNotif::Malformed(e)
            }
        };
        self.drain_table();
        handled
    }

    /// The reaper: releases every lease past its expiry; an expired lease that a D engine
    /// heartbeated is announced to it ([`PrefillAction::Transmit`]).
    pub fn handle_timeout(&mut self, now: Timestamp) {
        self.table.handle_timeout(now);
        if let Some(holds) = self.holds.as_mut() {
            holds.handle_timeout(now);
        }
        self.drain_table();
    }

    // ------------------------------------------------------------------ outputs

    /// When to call [`handle_timeout`](Self::handle_timeout) (or
    /// [`poll_prefill`](Self::poll_prefill), for a head of line whose pool wait ends)
    /// next; `None` when nothing is timed.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let pool = self
            .waiting
            .front()
            .and_then(|w| w.since.checked_add(self.config.pool_wait));
        let holds = self.holds.as_ref().and_then(LeaseTable::poll_timeout);
        [self.table.poll_timeout(), holds, pool]
            .into_iter()
            .flatten()
            .min()
    }

    /// The next action for the shell, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<PrefillAction<A>> {
        let action = self.actions.pop_front()?;
        if let PrefillAction::ClearFences { released } = &action {
            // The shell publishes the free word now; from here the blocks may be reused.
            self.free(&released.blocks);
        }
        Some(action)
    }

    /// The next event, in order.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<PrefillEvent> {
        self.events.pop_front()
    }

    // ------------------------------------------------------------------ internals

    /// Whether `from` may complete or abort `request`: no other engine owns it, and the
    /// consumer it names is of its own engine.
    fn may_act(&self, request: &RequestId, from: &Peer<A>, consumer: Option<&ConsumerId>) -> bool {
        if consumer.is_some_and(|c| c.engine != from.engine) {
            return false;
        }
        self.claims
            .get(request)
            .is_none_or(|c| c.engine == from.engine)
    }

    fn claim(&mut self, id: &str, from: &Peer<A>, heartbeat: bool) {
        if let Some(c) = self.claims.get_mut(id) {
            if heartbeat && c.engine == from.engine && c.heartbeater.as_ref() != Some(&from.addr) {
                c.heartbeater = Some(from.addr.clone());
            }
            return;
        }
        let Ok(request) = RequestId::new(id) else {
            return;
        };
        if self.table.blocks(&request).is_none()
            && self
                .holds
                .as_ref()
                .is_none_or(|h| h.blocks(&request).is_none())
        {
            return;
        }
        self.claims.insert(
            request,
            Claim {
                engine: from.engine.clone(),
                heartbeater: heartbeat.then(|| from.addr.clone()),
            },
        );
    }

    fn free(&mut self, blocks: &[BlockId]) {
        self.blocks.free(blocks);
    }

    /// Turns the tables' releases into fence clears, expiry notices and events.
    fn drain_table(&mut self) {
        let mut notices: Vec<(A, Vec<ExpiredLease>)> = Vec::new();
        loop {
            let released = |event: Option<Event>| match event {
                Some(Event::Released(r)) => Some(r),
                _ => None,
            };
            let next = released(self.table.poll_event())
                .map(|r| (r, Book::Leases))
                .or_else(|| {
                    released(self.holds.as_mut().and_then(LeaseTable::poll_event))
                        .map(|r| (r, Book::Holds))
                });
            let Some((r, book)) = next else { break };
            let claim = self.claims.remove(&r.request);
            let s = &mut self.stats;
            let counter = match (book, r.reason) {
                (Book::Leases, ReleaseReason::Completed) => &mut s.released_completed,
                (Book::Leases, ReleaseReason::Expired) => &mut s.released_expired,
                (Book::Leases, ReleaseReason::Aborted) => &mut s.released_aborted,
                (Book::Holds, ReleaseReason::Completed) => &mut s.holds_released_completed,
                (Book::Holds, ReleaseReason::Expired) => &mut s.holds_released_expired,
                (Book::Holds, ReleaseReason::Aborted) => &mut s.holds_released_aborted,
            };
            *counter += 1;
            if let (Some(notice), Some(to)) = (expiry_notice(&r), claim.and_then(|c| c.heartbeater))
            {
                match notices.iter_mut().find(|(a, _)| *a == to) {
                    Some((_, v)) => v.push(notice),
                    None => notices.push((to, vec![notice])),
                }
            }
            self.actions.push_back(PrefillAction::ClearFences {
                released: r.clone(),
            });
            self.events.push_back(match book {
                Book::Leases => PrefillEvent::Released(r),
                Book::Holds => PrefillEvent::HoldReleased(r),
            });
        }
        for (to, leases) in notices {
            // Expiry notices of valid ids always encode; a failure would only drop a hint
            // (D's fenced read still catches the reuse).
            if let Ok(msgs) = kvlease_notif::encode_expired(&leases, kvlease_notif::MAX_NOTIF_LEN) {
                for bytes in msgs {
                    self.stats.expiry_notices += 1;
                    self.actions.push_back(PrefillAction::Transmit {
                        to: to.clone(),
                        bytes,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
