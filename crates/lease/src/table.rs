//! The prefill side: which blocks are leased to which request, until when.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::num::NonZeroU64;
use std::time::Duration;

use crate::config::{LeaseConfig, LeaseMode};
use crate::ids::{BlockId, ConsumerId, Generation, RequestId};
use crate::index::{Fingerprint, Hashers, SlotIndex};
use crate::time::{Timestamp, duration_nanos};

/// `last_heartbeat` of a lease that never got one. A heartbeat at `u64::MAX` ns (584 years
/// after the epoch) reads as none; no driver gets there.
const NO_HEARTBEAT: u64 = u64::MAX;

/// The most leases one table holds at once (2^31; far beyond memory, but it keeps slot
/// numbers and index positions in 32 bits).
pub const MAX_LEASES: usize = 1 << 31;

/// Heartbeat ids hashed before their lookups run (see `handle_heartbeat`).
const HEARTBEAT_GROUP: usize = 16;

/// Why a grant was refused. Nothing changed in the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The table already holds a lease for this request.
    #[error("request {request} already holds a lease")]
    Duplicate {
        /// The request.
        request: RequestId,
    },
    /// `expected_consumers` was zero: nobody would ever complete the lease.
    #[error("request {request}: a lease needs at least one expected consumer")]
    ZeroConsumers {
        /// The request.
        request: RequestId,
    },
    /// `now + duration` does not fit in a [`Timestamp`] (centuries after the epoch).
    #[error("request {request}: the lease deadline overflows the clock")]
    DeadlineOverflow {
        /// The request.
        request: RequestId,
    },
    /// The table holds [`MAX_LEASES`] leases already.
    #[error("request {request}: the lease table is full ({MAX_LEASES} leases)")]
    TableFull {
        /// The request.
        request: RequestId,
    },
    /// The table handed out every generation up to `u64::MAX`.
    #[error("request {request}: no fresh lease generation is left")]
    GenerationsExhausted {
        /// The request.
        request: RequestId,
    },
}

/// Why a lease was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// The expected number of distinct consumers reported their read complete.
    Completed,
    /// The lease passed its expiry (no heartbeat kept it alive).
    Expired,
    /// The request was aborted ([`LeaseTable::abort`]).
    Aborted,
}

/// A lease ended; its blocks are free for the caller to reuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The request the lease was granted to.
    pub request: RequestId,
    /// Its blocks, as given to [`LeaseTable::grant`].
    pub blocks: Vec<BlockId>,
    /// The lease's fencing token; the caller publishes [`Generation::FREE_WORD`] for the blocks.
    pub generation: Generation,
    /// Why it ended.
    pub reason: ReleaseReason,
    /// When it was granted.
    pub granted_at: Timestamp,
    /// Its expiry when it ended (for [`ReleaseReason::Expired`], the deadline that passed).
    pub expiry: Timestamp,
    /// It expired at its maximum lifetime ([`LeaseConfig::max_lifetime`]) although
    /// heartbeats had renewed it past that.
    pub at_max_lifetime: bool,
    /// When the last heartbeat naming it arrived, if any did.
    pub last_heartbeat: Option<Timestamp>,
    /// The `now` of the call that released it.
    pub released_at: Timestamp,
}

/// What the table reports, drained with [`LeaseTable::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A lease ended.
    Released(Released),
}

/// What one [`LeaseTable::handle_heartbeat`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeartbeatOutcome {
    /// Ids that named a live lease (a duplicate id counts each time). The counts of one
    /// call saturate at `u32::MAX`.
    pub held: u32,
    /// Of those, how many moved the expiry later. Zero in [`LeaseMode::Fixed`]; also zero for
    /// a heartbeat so early that `now + extension` is before the initial expiry.
    pub extended: u32,
    /// Ids that named no lease: never granted, already released, or from another P.
    pub unknown: u32,
    /// Ids of leases already past their expiry that [`LeaseTable::handle_timeout`] has not
    /// reaped yet. A late heartbeat does not revive a lease.
    pub late: u32,
}

impl HeartbeatOutcome {
    /// Both outcomes' counts together (saturating): one heartbeat applied to two tables.
    #[must_use]
    pub fn plus(self, other: Self) -> Self {
        Self {
            held: self.held.saturating_add(other.held),
            extended: self.extended.saturating_add(other.extended),
            unknown: self.unknown.saturating_add(other.unknown),
            late: self.late.saturating_add(other.late),
        }
    }
}

/// What one [`LeaseTable::handle_read_complete`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadCompleteOutcome {
    /// The last expected consumer reported; the lease was released
    /// ([`ReleaseReason::Completed`]).
    Released,
    /// Counted; the lease waits for `remaining` more distinct consumers.
    Waiting {
        /// Distinct consumers still to report.
        remaining: u32,
    },
    /// This consumer had already reported; nothing changed but a `consumers_total` override.
    Duplicate {
        /// Distinct consumers still to report.
        remaining: u32,
    },
    /// No lease for this request (never granted, or already released).
    Unknown,
    /// `consumers_total` was `Some(0)`: invalid, ignored, the lease is unchanged.
    InvalidTotal,
}

/// A lease as [`LeaseTable::get`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseInfo {
    /// Its fencing token.
    pub generation: Generation,
    /// When it was granted.
    pub granted_at: Timestamp,
    /// When it expires unless renewed; never decreases.
    pub expiry: Timestamp,
    /// When the last heartbeat naming it arrived, if any did.
    pub last_heartbeat: Option<Timestamp>,
    /// Distinct consumers that reported their read complete.
    pub consumers_reported: u32,
    /// Distinct consumers needed to complete it.
    pub consumers_expected: u32,
    /// How many blocks it holds.
    pub blocks: usize,
}

/// Counters since the table was created. All are monotonic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeaseStats {
    /// Successful grants.
    pub granted: u64,
    /// Ids seen in heartbeats, of any kind.
    pub heartbeat_ids: u64,
    /// Heartbeat ids that moved an expiry later.
    pub extensions: u64,
    /// Heartbeat ids that named no lease.
    pub unknown_ids: u64,
    /// Heartbeat ids that named a lease past its expiry, not yet reaped.
    pub late_ids: u64,
    /// Read completions that named a lease and a new consumer.
    pub read_completions: u64,
    /// Read completions from a consumer that had already reported.
    pub duplicate_completions: u64,
    /// Read completions that named no lease.
    pub unknown_completions: u64,
    /// Leases released as [`ReleaseReason::Completed`].
    pub released_completed: u64,
    /// Leases released as [`ReleaseReason::Expired`].
    pub released_expired: u64,
    /// Leases released as [`ReleaseReason::Aborted`].
    pub released_aborted: u64,
    /// Of the expired ones, leases that heartbeats had renewed past their maximum lifetime
    /// ([`Released::at_max_lifetime`]).
    pub released_at_max_lifetime: u64,
    /// Reaper deadlines that came due for a lease renewed since they were filed, and were
    /// filed again at the current expiry (the reaper's only work beyond what expires).
    pub reaper_refiles: u64,
}

/// What a heartbeat reads and writes, kept apart from the rest of the lease in an array of
/// its own: 32 bytes, aligned to 32, so one renewal touches exactly one cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Hot {
    /// The generation of the lease in this slot; 0 while the slot is vacant.
    generation: u64,
    /// The id's second keyed hash (see [`crate::index`]).
    h2: u64,
    /// Nanoseconds since the epoch, like the other times here (8 bytes instead of 16).
    expiry: u64,
    last_heartbeat: u64,
}

impl Hot {
    const VACANT: Self = Self {
        generation: 0,
        h2: 0,
        expiry: 0,
        last_heartbeat: NO_HEARTBEAT,
    };

    fn is_occupied(&self) -> bool {
        self.generation != 0
    }
}

/// The rest of a lease (the slot's cold part).
#[derive(Debug)]
struct Lease {
    request: RequestId,
    blocks: Vec<BlockId>,
    /// Distinct consumers that reported. Boxed: almost every lease has one consumer and is
    /// released when it reports, so this stays `None` and costs 8 bytes.
    consumers: Option<Box<Consumers>>,
    granted_at: u64,
    expected: u32,
}

/// The distinct consumers that reported a lease's read (a handful at most: one per D rank).
#[derive(Debug, Default)]
struct Consumers(Vec<ConsumerId>);

impl Lease {
    fn reported(&self) -> u32 {
        self.consumers
            .as_ref()
            .map_or(0, |c| u32::try_from(c.0.len()).unwrap_or(u32::MAX))
    }
}

#[derive(Debug)]
enum Slot {
    Occupied(Lease),
    Vacant { next_free: u32 },
}

/// End of the free list of slots.
const NO_SLOT: u32 = u32::MAX;

/// A deadline in the reaper's min-heap. Valid while the slot holds a lease of this
/// generation; then `deadline <= min(that lease's expiry, its cap)` (expiries only grow).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Due {
    deadline: u64,
    generation: u64,
    slot: u32,
}

/// The prefill side's leases: blocks pinned per request until the reader reports, the
/// request is aborted, or the lease expires.
///
/// A sans-IO state machine (quinn-proto style): it reads no clock, every method that
/// depends on time takes `now`, and what happens comes out as [`Event`]s.
///
/// # Call order
/// Every forward-loop step of the prefill engine:
/// 1. [`grant`](Self::grant) for each request whose prefill finished;
/// 2. feed the inputs that arrived: [`handle_heartbeat`](Self::handle_heartbeat) for each
///    `HB:` message, [`handle_read_complete`](Self::handle_read_complete) for each
///    completion, [`abort`](Self::abort) for each aborted request;
/// 3. [`handle_timeout`](Self::handle_timeout) when `now >=`
///    [`poll_timeout`](Self::poll_timeout) (calling it every step is also fine: with
///    nothing due it costs one heap peek);
/// 4. drain [`poll_event`](Self::poll_event) until `None` and free the released blocks.
///
/// Whether 2 comes before 3 changes little: a lease is dead to heartbeats from its expiry
/// on, reaped yet or not (a late heartbeat never revives it). Only the reason differs for a
/// completion or abort that arrives for a lease past its expiry: fed before the reaper it
/// releases the lease as `Completed`/`Aborted` (its blocks were never reused), after it
/// finds the lease already `Expired`.
///
/// # Rules
/// - A lease lives while `now < expiry`. Grant: expiry = now + duration.
/// - Heartbeat ([`LeaseMode::Lease`]): expiry = max(expiry, now + extension), never shortened.
///   Unknown ids are counted and change nothing. In [`LeaseMode::Fixed`] heartbeats are
///   counted and never extend.
/// - A lease never outlives `grant + max_lifetime` ([`LeaseConfig::max_lifetime`]): the
///   reaper releases it then ([`ReleaseReason::Expired`], [`Released::at_max_lifetime`])
///   whatever its heartbeats renewed it to.
/// - Read completion: released after the expected number of *distinct* consumers reported.
/// - The reaper releases every lease whose expiry passed, in deadline order, whatever the
///   grant order (vLLM #58222).
///
/// # Cost
/// `handle_heartbeat` is one hash lookup and a store per id: renewal does not touch the
/// reaper's heap. The heap holds one entry per lease, keyed by a deadline no later than the
/// lease's expiry; when an entry comes due and the lease was renewed since, it is pushed
/// back with the current expiry. So `handle_timeout` costs O((expired + renewed-since-push)
/// · log n), never O(held): a lease is filed again only if a heartbeat extended it since
/// its last filing, and with one heartbeat per interval that is about once per extension
/// ([`LeaseStats::reaper_refiles`]). Entries of completed or aborted leases are dropped lazily; the heap is rebuilt
/// when they outnumber the live leases.
#[derive(Debug)]
pub struct LeaseTable {
    config: LeaseConfig,
    hashers: Hashers,
    index: SlotIndex,
    /// Parallel arrays indexed by slot number.
    hot: Vec<Hot>,
    slots: Vec<Slot>,
    free_head: u32,
    heap: BinaryHeap<Reverse<Due>>,
    next_generation: Option<NonZeroU64>,
    blocks_held: usize,
    events: VecDeque<Event>,
    stats: LeaseStats,
}

impl LeaseTable {
    /// An empty table; the first grant gets generation 1.
    pub fn new(config: LeaseConfig) -> Self {
        Self::with_first_generation(config, Generation(NonZeroU64::MIN))
    }

    /// An empty table whose first grant gets generation `first`, then `first + 1`, …
    ///
    /// A P that restarts with the same registered memory should start above every generation
    /// it handed out before (e.g. from the wall clock in microseconds), so that a reader of
    /// the old incarnation can never match a new lease.
    pub fn with_first_generation(config: LeaseConfig, first: Generation) -> Self {
        Self {
            config,
            hashers: Hashers::default(),
            index: SlotIndex::default(),
            hot: Vec::new(),
            slots: Vec::new(),
            free_head: NO_SLOT,
            heap: BinaryHeap::new(),
            next_generation: Some(first.0),
            blocks_held: 0,
            events: VecDeque::new(),
            stats: LeaseStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Leases held (granted, not yet released).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no lease is held.
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// Blocks held by all leases.
    pub fn blocks_held(&self) -> usize {
        self.blocks_held
    }

    /// The counters.
    pub fn stats(&self) -> LeaseStats {
        self.stats
    }

    /// The lease of `request`, if one is held.
    pub fn get(&self, request: &RequestId) -> Option<LeaseInfo> {
        let slot = self.find_str(request.as_str())?;
        let (hot, lease) = self.occupied(slot)?;
        Some(LeaseInfo {
            generation: generation_of(hot),
            granted_at: Timestamp::from_nanos(lease.granted_at),
            expiry: Timestamp::from_nanos(hot.expiry),
            last_heartbeat: last_heartbeat_of(hot),
            consumers_reported: lease.reported(),
            consumers_expected: lease.expected,
            blocks: lease.blocks.len(),
        })
        .map(|mut info| {
            info.expiry = info.expiry.min(Timestamp::from_nanos(self.cap(lease)));
            info
        })
    }

    /// Whether the id `request` holds a lease (no [`RequestId`] needed: a notification's
    /// ids are looked up as they come).
    pub fn holds(&self, request: &str) -> bool {
        self.find_str(request).is_some()
    }

    /// The blocks `request` holds, if it holds a lease.
    pub fn blocks(&self, request: &RequestId) -> Option<&[BlockId]> {
        self.lease(request.as_str()).map(|l| l.blocks.as_slice())
    }

    /// The requests holding a lease, in slot order: not grant order, but the same for
    /// the same calls (slots are reused from a free list, never placed by a hash).
    pub fn requests(&self) -> impl Iterator<Item = &RequestId> + '_ {
        self.slots.iter().filter_map(|slot| match slot {
            Slot::Occupied(lease) => Some(&lease.request),
            Slot::Vacant { .. } => None,
        })
    }

    /// Leases `blocks` to `request` until `now + duration`, to be read by
    /// `expected_consumers` distinct consumers. Returns the lease's fresh generation.
    ///
    /// # Errors
    /// [`GrantError::Duplicate`] when `request` already holds a lease,
    /// [`GrantError::ZeroConsumers`] when `expected_consumers` is 0,
    /// [`GrantError::TableFull`], [`GrantError::DeadlineOverflow`] and
    /// [`GrantError::GenerationsExhausted`] at the ends of the number ranges. The table is
    /// unchanged on error.
    pub fn grant(
        &mut self,
        now: Timestamp,
        request: RequestId,
        blocks: Vec<BlockId>,
        expected_consumers: u32,
    ) -> Result<Generation, GrantError> {
        if expected_consumers == 0 {
            return Err(GrantError::ZeroConsumers { request });
        }
        if self.index.len() >= MAX_LEASES {
            return Err(GrantError::TableFull { request });
        }
        let fingerprint = self.hashers.fingerprint(request.as_str());
        if self
            .find(request.as_str(), fingerprint.h1, fingerprint.h2)
            .is_some()
        {
            return Err(GrantError::Duplicate { request });
        }
        //= docs/spec.md#grant
        //# P pins its blocks with expiry = now + duration
        let Some(expiry) = now
            .checked_add(self.config.duration())
            .map(Timestamp::as_nanos_saturating)
            .filter(|&e| e != u64::MAX)
        else {
            return Err(GrantError::DeadlineOverflow { request });
        };
        let Some(generation) = self.next_generation else {
            return Err(GrantError::GenerationsExhausted { request });
        };
        self.next_generation = generation.checked_add(1);
        self.blocks_held += blocks.len();
        let granted_at = now.as_nanos_saturating();
        let lease = Lease {
            request,
            blocks,
            consumers: None,
            granted_at,
            expected: expected_consumers,
        };
        let hot = Hot {
            generation: generation.get(),
            h2: fingerprint.h2,
            expiry,
            last_heartbeat: NO_HEARTBEAT,
        };
        let slot = self.alloc_slot(hot, lease);
        self.index.insert(fingerprint.h1, slot);
        self.heap.push(Reverse(Due {
            deadline: expiry,
            generation: generation.get(),
            slot,
        }));
        self.stats.granted += 1;
        Ok(Generation(generation))
    }

    /// Handles one heartbeat message that names `ids` (an `HB:` message, already decoded).
    ///
    /// For each id that names a live lease, expiry = max(expiry, now + extension) (in
    /// [`LeaseMode::Lease`]). Ids that name nothing are ignored and counted; so are ids of
    /// leases already past their expiry (not revived). Accepts `&[RequestId]`, `&[&str]`,
    /// or any iterator of string-like ids, so a decoder need not allocate.
    pub fn handle_heartbeat<I>(&mut self, now: Timestamp, ids: I) -> HeartbeatOutcome
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let now_ns = now.as_nanos_saturating();
        let renewed = match self.config.mode() {
            LeaseMode::Lease => Some(add_nanos(now_ns, self.config.extension())),
            LeaseMode::Fixed => None,
        };
        let mut out = HeartbeatOutcome::default();
        // Ids go in groups: hash a group first, then look it up. The lookups of a group are
        // independent and short, so the CPU overlaps their cache misses (index entry, then
        // slot) instead of waiting for one id's misses before hashing the next.
        let mut ids = ids.into_iter();
        let mut group = [Fingerprint { h1: 0, h2: 0 }; HEARTBEAT_GROUP];
        loop {
            let mut n = 0;
            for id in ids.by_ref().take(HEARTBEAT_GROUP) {
                group[n] = self.hashers.fingerprint(id.as_ref());
                n += 1;
            }
            if n == 0 {
                break;
            }
            for fingerprint in &group[..n] {
                self.renew(fingerprint, now_ns, renewed, &mut out);
            }
        }
        self.stats.heartbeat_ids +=
            u64::from(out.held) + u64::from(out.unknown) + u64::from(out.late);
        self.stats.extensions += u64::from(out.extended);
        self.stats.unknown_ids += u64::from(out.unknown);
        self.stats.late_ids += u64::from(out.late);
        out
    }

    /// One heartbeat id, already hashed.
    fn renew(
        &mut self,
        fingerprint: &Fingerprint,
        now_ns: u64,
        renewed: Option<u64>,
        out: &mut HeartbeatOutcome,
    ) {
        // Matched on the two keyed hashes, without the string compare (see crate::index): a
        // false match is astronomically unlikely and would only extend.
        let hot = &self.hot;
        let found = self.index.find(fingerprint.h1, |slot| {
            hot.get(slot as usize)
                .is_some_and(|h| h.is_occupied() && h.h2 == fingerprint.h2)
        });
        let Some(lease) = found.and_then(|slot| self.hot.get_mut(slot as usize)) else {
            out.unknown = out.unknown.saturating_add(1);
            return;
        };
        if lease.expiry <= now_ns {
            out.late = out.late.saturating_add(1);
            return;
        }
        out.held = out.held.saturating_add(1);
        lease.last_heartbeat = now_ns;
        //= docs/spec.md#renewal
        //# for each id P holds, expiry = max(old expiry, now + extension) — never shortened.
        if let Some(renewed) = renewed
            && renewed > lease.expiry
        {
            lease.expiry = renewed;
            out.extended = out.extended.saturating_add(1);
        }
    }

    /// Handles a read-completion report of `request` by `consumer`.
    ///
    /// `consumers_total`, when the reader gives it (D knows its TP size), replaces the
    /// expected count given at grant. The lease is released ([`ReleaseReason::Completed`])
    /// once that many distinct consumers reported; a second report from the same consumer
    /// counts once. A completion for a lease past its expiry but not yet reaped still
    /// releases it as completed: its blocks were never reused.
    pub fn handle_read_complete(
        &mut self,
        now: Timestamp,
        request: &RequestId,
        consumer: ConsumerId,
        consumers_total: Option<u32>,
    ) -> ReadCompleteOutcome {
        if consumers_total == Some(0) {
            return ReadCompleteOutcome::InvalidTotal;
        }
        let Some(slot) = self.find_str(request.as_str()) else {
            self.stats.unknown_completions += 1;
            return ReadCompleteOutcome::Unknown;
        };
        let Some(Slot::Occupied(lease)) = self.slots.get_mut(slot as usize) else {
            // The index only names occupied slots; answer rather than panic.
            debug_assert!(false, "index names a vacant slot");
            return ReadCompleteOutcome::Unknown;
        };
        if let Some(total) = consumers_total {
            lease.expected = total;
        }
        let consumers = lease.consumers.get_or_insert_with(Box::default);
        let duplicate = consumers.0.contains(&consumer);
        if duplicate {
            self.stats.duplicate_completions += 1;
        } else {
            consumers.0.push(consumer);
            self.stats.read_completions += 1;
        }
        let remaining = lease.expected.saturating_sub(lease.reported());
        if remaining > 0 {
            return if duplicate {
                ReadCompleteOutcome::Duplicate { remaining }
            } else {
                ReadCompleteOutcome::Waiting { remaining }
            };
        }
        //= docs/spec.md#release
        //# P frees after the expected number of consumers has reported.
        self.release(slot, ReleaseReason::Completed, now);
        ReadCompleteOutcome::Released
    }

    /// Releases `request`'s lease at once ([`ReleaseReason::Aborted`]). Returns whether it
    /// held one.
    pub fn abort(&mut self, now: Timestamp, request: &RequestId) -> bool {
        match self.find_str(request.as_str()) {
            Some(slot) => {
                self.release(slot, ReleaseReason::Aborted, now);
                true
            }
            None => false,
        }
    }

    /// The reaper: releases every lease whose expiry (or maximum lifetime) is at or before
    /// `now`, in deadline order ([`ReleaseReason::Expired`]). Returns how many it released.
    ///
    /// Costs O((expired + renewed-since-push) · log n); it never scans the held leases.
    pub fn handle_timeout(&mut self, now: Timestamp) -> usize {
        let now_ns = now.as_nanos_saturating();
        let mut expired = 0;
        //= docs/spec.md#expiry
        //# The reaper must find *every* expired lease (ordered by deadline, not by grant order
        while let Some(&Reverse(due)) = self.heap.peek() {
            if due.deadline > now_ns {
                break;
            }
            self.heap.pop();
            let Some(expiry) = self.live_expiry(due) else {
                continue; // released since it was pushed
            };
            let cap = match self.slots.get(due.slot as usize) {
                Some(Slot::Occupied(lease)) => self.cap(lease),
                _ => u64::MAX,
            };
            if expiry == due.deadline {
                self.release(due.slot, ReleaseReason::Expired, now);
                expired += 1;
            } else if due.deadline >= cap {
                //= docs/spec.md#max-lifetime
                //# a lease ends at grant + max lifetime whatever its heartbeats say
                self.release(due.slot, ReleaseReason::Expired, now);
                expired += 1;
            } else {
                // Renewed since it was pushed: wait for the current expiry (no later than
                // the cap). Pushing it back (rather than releasing when `expiry <= now`)
                // keeps the release order the deadline order.
                self.stats.reaper_refiles += 1;
                self.heap.push(Reverse(Due {
                    deadline: expiry.min(cap),
                    ..due
                }));
            }
        }
        self.trim_top();
        expired
    }

    /// Drops entries of released leases from the top of the heap, so that
    /// [`poll_timeout`](Self::poll_timeout) is not needlessly early (and `None` once the
    /// table is empty). Each entry is popped once, so this is amortised O(log n).
    fn trim_top(&mut self) {
        while let Some(&Reverse(due)) = self.heap.peek() {
            if self.live_expiry(due).is_some() {
                break;
            }
            self.heap.pop();
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called, or `None` when no
    /// lease is held.
    ///
    /// Never later than the earliest expiry. It may be earlier when that lease was renewed
    /// since its deadline was filed (renewal does not touch the heap): the call then
    /// releases nothing and files the real deadline.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.heap
            .peek()
            .map(|Reverse(due)| Timestamp::from_nanos(due.deadline))
    }

    /// The next event, or `None` when all were drained.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    fn lease(&self, request: &str) -> Option<&Lease> {
        let slot = self.find_str(request)?;
        self.occupied(slot).map(|(_, lease)| lease)
    }

    fn occupied(&self, slot: u32) -> Option<(&Hot, &Lease)> {
        let hot = self.hot.get(slot as usize).filter(|h| h.is_occupied())?;
        match self.slots.get(slot as usize) {
            Some(Slot::Occupied(lease)) => Some((hot, lease)),
            _ => None,
        }
    }

    /// The slot of `request`'s lease, matched on both hashes and the string.
    fn find_str(&self, request: &str) -> Option<u32> {
        let fingerprint = self.hashers.fingerprint(request);
        self.find(request, fingerprint.h1, fingerprint.h2)
    }

    fn find(&self, request: &str, h1: u64, h2: u64) -> Option<u32> {
        self.index.find(h1, |slot| {
            self.occupied(slot)
                .is_some_and(|(hot, lease)| hot.h2 == h2 && lease.request.as_str() == request)
        })
    }

    /// When `lease` ends whatever its heartbeats say: `granted_at + max_lifetime` (never
    /// before its first expiry, since `max_lifetime >= duration`).
    fn cap(&self, lease: &Lease) -> u64 {
        add_nanos(lease.granted_at, self.config.max_lifetime())
    }

    /// The expiry of the lease `due` refers to, if it is still held.
    fn live_expiry(&self, due: Due) -> Option<u64> {
        // Vacant slots have generation 0, which no entry carries.
        self.hot
            .get(due.slot as usize)
            .filter(|h| h.generation == due.generation)
            .map(|h| h.expiry)
    }

    fn alloc_slot(&mut self, hot: Hot, lease: Lease) -> u32 {
        if self.free_head != NO_SLOT {
            let slot = self.free_head;
            let entry = &mut self.slots[slot as usize];
            if let Slot::Vacant { next_free } = *entry {
                self.free_head = next_free;
            }
            *entry = Slot::Occupied(lease);
            self.hot[slot as usize] = hot;
            slot
        } else {
            // At most MAX_LEASES (2^31) slots are ever occupied, and vacant ones are reused
            // first, so the slot number fits in 31 bits.
            let slot = u32::try_from(self.slots.len()).unwrap_or(NO_SLOT);
            debug_assert!(slot < NO_SLOT);
            self.slots.push(Slot::Occupied(lease));
            self.hot.push(hot);
            slot
        }
    }

    fn release(&mut self, slot: u32, reason: ReleaseReason, now: Timestamp) {
        let Some(entry) = self.slots.get_mut(slot as usize) else {
            return;
        };
        let vacant = Slot::Vacant {
            next_free: self.free_head,
        };
        let lease = match std::mem::replace(entry, vacant) {
            Slot::Occupied(lease) => lease,
            was_vacant => {
                // Callers only pass slots the index names; put it back untouched.
                debug_assert!(false, "release of a vacant slot");
                *entry = was_vacant;
                return;
            }
        };
        // `hot` and `slots` always have the same length.
        let hot = std::mem::replace(&mut self.hot[slot as usize], Hot::VACANT);
        self.free_head = slot;
        let removed = self
            .index
            .remove(self.hashers.h1(lease.request.as_str()), slot);
        debug_assert!(removed, "a held lease is in the index");
        self.blocks_held -= lease.blocks.len();
        match reason {
            ReleaseReason::Completed => self.stats.released_completed += 1,
            ReleaseReason::Expired => self.stats.released_expired += 1,
            ReleaseReason::Aborted => self.stats.released_aborted += 1,
        }
        let cap = self.cap(&lease);
        let at_max_lifetime = reason == ReleaseReason::Expired && hot.expiry > cap;
        if at_max_lifetime {
            self.stats.released_at_max_lifetime += 1;
        }
        self.events.push_back(Event::Released(Released {
            request: lease.request,
            blocks: lease.blocks,
            generation: generation_of(&hot),
            reason,
            granted_at: Timestamp::from_nanos(lease.granted_at),
            expiry: Timestamp::from_nanos(hot.expiry.min(cap)),
            at_max_lifetime,
            last_heartbeat: last_heartbeat_of(&hot),
            released_at: now,
        }));
        if reason != ReleaseReason::Expired {
            // The reaper trims the top itself once it is done.
            self.trim_top();
            self.maybe_compact();
        }
    }

    /// Rebuilds the heap from the live leases when entries of released ones outnumber them,
    /// so the heap stays O(held) under churn. Amortised O(1) per release.
    fn maybe_compact(&mut self) {
        if self.heap.len() <= 2 * self.index.len() + 1024 {
            return;
        }
        let live: Vec<Reverse<Due>> = self
            .hot
            .iter()
            .zip(&self.slots)
            .enumerate()
            .filter_map(|(slot, (hot, entry))| match entry {
                Slot::Occupied(lease) if hot.is_occupied() => Some(Reverse(Due {
                    deadline: hot.expiry.min(self.cap(lease)),
                    generation: hot.generation,
                    slot: u32::try_from(slot).unwrap_or(NO_SLOT),
                })),
                _ => None,
            })
            .collect();
        self.heap = BinaryHeap::from(live);
    }
}

/// The generation of an occupied slot.
fn generation_of(hot: &Hot) -> Generation {
    // Occupied slots carry the non-zero generation they were granted with.
    Generation(NonZeroU64::new(hot.generation).unwrap_or(NonZeroU64::MIN))
}

fn last_heartbeat_of(hot: &Hot) -> Option<Timestamp> {
    (hot.last_heartbeat != NO_HEARTBEAT).then(|| Timestamp::from_nanos(hot.last_heartbeat))
}

fn add_nanos(t: u64, d: Duration) -> u64 {
    t.saturating_add(duration_nanos(d))
}

#[cfg(test)]
mod tests;
