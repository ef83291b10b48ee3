//! D's side of push mode: blocks reserved for a transfer under a lease that P renews.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use kvlease_lease::{
    BlockId, EngineId, Event, Generation, GrantError, HeartbeatOutcome, LeaseConfig, LeaseTable,
    ReleaseReason, RequestId, Timestamp,
};
use kvlease_notif::{PromptDigest, PushRegistration};

/// What D registers with P for one transfer: the blocks P writes into, the fence, and the
/// lease P must keep renewed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The transfer id the router gave both legs; heartbeats, writes and write-dones name it.
    pub transfer: RequestId,
    /// D's blocks for the tokens D must receive (those its prefix cache lacks), in token
    /// order: the **last** `blocks.len()` blocks of the prompt.
    pub blocks: Vec<BlockId>,
    /// The reservation's fencing generation; P's write and write-done carry it.
    pub generation: Generation,
    /// The reservation's lease duration: D frees the blocks this long after the
    /// reservation (or `2/3` of it after the last heartbeat) unless renewed.
    pub lease: Duration,
    /// A digest of D's prompt's token ids, when D's shell computed one: P refuses the
    /// registration when its own leg carries another digest (the transfer id matched
    /// another request's leg).
    pub prompt: Option<PromptDigest>,
}

impl Reservation {
    /// The registration frame's fields (`KVL1:PR:`; encode with
    /// [`PushRegistration::encode`]). The lease is written in whole milliseconds, at
    /// least 1.
    #[must_use]
    pub fn registration(&self) -> PushRegistration {
        PushRegistration {
            transfer: self.transfer.clone(),
            generation: self.generation,
            lease_ms: u64::try_from(self.lease.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            blocks: self.blocks.clone(),
            prompt: self.prompt,
        }
    }
}

impl From<PushRegistration> for Reservation {
    /// What P received: the registration frame's fields.
    fn from(r: PushRegistration) -> Self {
        Self {
            lease: r.lease(),
            transfer: r.transfer,
            blocks: r.blocks,
            generation: r.generation,
            prompt: r.prompt,
        }
    }
}

/// How a reservation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReservationOutcome {
    /// P reported the write done under the reservation's generation: the blocks hold the
    /// KV.
    Written,
    /// D aborted the request ([`Reservations::abort`]).
    Aborted,
    /// No heartbeat renewed the lease in time: P is dead, stalled or cut off.
    Expired,
    /// P reported that it cannot write (a post failed, or the request retired on P).
    Failed,
}

impl ReservationOutcome {
    /// The outcome's name in metrics and logs: `written`, `aborted`, `expired`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Written => "written",
            Self::Aborted => "aborted",
            Self::Expired => "expired",
            Self::Failed => "failed",
        }
    }
}

/// A reservation ended; its blocks are D's again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationEnded {
    /// The transfer.
    pub transfer: RequestId,
    /// The P engine the reservation was registered with.
    pub prefill: EngineId,
    /// The reserved blocks. The shell revokes remote access to them (verbs) or clears
    /// their fence before it reuses them.
    pub blocks: Vec<BlockId>,
    /// The generation that ended; no write of it lands from now on.
    pub generation: Generation,
    /// How it ended.
    pub outcome: ReservationOutcome,
    /// The `now` of the call that ended it.
    pub at: Timestamp,
}

impl ReservationEnded {
    /// Whether P must be told (a reservation-released message): D gave the blocks up while
    /// P may still be going to write (aborted, expired). After `Written` or `Failed`, P
    /// spoke last and knows.
    pub fn tells_prefill(&self) -> bool {
        matches!(
            self.outcome,
            ReservationOutcome::Aborted | ReservationOutcome::Expired
        )
    }

    /// Whether the request still needs its KV: D recomputes the prompt (or fails the
    /// request cleanly); it never decodes from these blocks.
    pub fn needs_recompute(&self) -> bool {
        matches!(
            self.outcome,
            ReservationOutcome::Expired | ReservationOutcome::Failed
        )
    }
}

/// What a fenced message (a write, a write-done, a push-failed) met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceVerdict {
    /// The reservation is held under this generation by this P.
    Accepted,
    /// The transfer is held, but under another generation: a late message of an old
    /// reservation. Refused.
    Stale,
    /// No reservation for this transfer (never made, or ended). Refused.
    Unknown,
    /// Held, but registered with another P engine. Refused.
    Foreign,
}

/// Counters since the table was created. All are monotonic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReservationStats {
    /// Reservations made.
    pub reserved: u64,
    /// Reservations ended as [`ReservationOutcome::Written`].
    pub written: u64,
    /// Reservations ended as [`ReservationOutcome::Aborted`].
    pub aborted: u64,
    /// Reservations ended as [`ReservationOutcome::Expired`].
    pub expired: u64,
    /// Reservations ended as [`ReservationOutcome::Failed`].
    pub failed: u64,
    /// Heartbeat ids that renewed a held reservation.
    pub renewed_ids: u64,
    /// Heartbeat ids that named no reservation (or one already past its expiry).
    pub unknown_ids: u64,
    /// Heartbeat ids that named a reservation registered with another P engine.
    pub foreign_ids: u64,
    /// Writes, write-dones and push-faileds refused by the fence.
    pub refused: u64,
}

/// D's reservations for push mode.
///
/// # Call order
/// In each forward-loop step: `reserve` for every admitted push request (then send the
/// [`Reservation`] to P); feed P's messages (`handle_heartbeat`, `handle_write_done`,
/// `handle_push_failed`) and D's own aborts (`abort`); `handle_timeout(now)`; then drain
/// `poll_event` and act on each [`ReservationEnded`]: revoke or fence the blocks before
/// reusing them, tell P when [`ReservationEnded::tells_prefill`], recompute or fail the
/// request when [`ReservationEnded::needs_recompute`], decode when written.
///
/// # Rules
/// - A reservation lives while `now < expiry`; reserve: expiry = now + duration; each
///   heartbeat from the P engine it was registered with: expiry = max(expiry, now +
///   extension), never beyond the lease's maximum lifetime (the lease table's rules).
/// - Heartbeats name transfer ids, the key D reserved under; ids from any other P engine
///   are counted and change nothing.
/// - Every reservation ends exactly once. A message for an ended or re-made reservation
///   (another generation) is refused and changes nothing.
#[derive(Debug)]
pub struct Reservations {
    table: LeaseTable,
    /// The P engine each held reservation was registered with.
    owners: HashMap<RequestId, EngineId>,
    events: VecDeque<ReservationEnded>,
    stats: ReservationStats,
}

impl Reservations {
    /// An empty table with `lease` terms; generations count up from `first`. A D that
    /// restarts with the same registered memory starts above every generation it handed
    /// out before.
    pub fn new(lease: LeaseConfig, first: Generation) -> Self {
        Self {
            table: LeaseTable::with_first_generation(lease, first),
            owners: HashMap::new(),
            events: VecDeque::new(),
            stats: ReservationStats::default(),
        }
    }

    /// The lease terms.
    pub fn config(&self) -> &LeaseConfig {
        self.table.config()
    }

    /// Reservations held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Blocks held by all reservations.
    pub fn blocks_held(&self) -> usize {
        self.table.blocks_held()
    }

    /// The counters.
    pub fn stats(&self) -> ReservationStats {
        self.stats
    }

    /// The generation and blocks `transfer` holds, if it holds a reservation.
    pub fn get(&self, transfer: &RequestId) -> Option<(Generation, &[BlockId])> {
        let info = self.table.get(transfer)?;
        Some((info.generation, self.table.blocks(transfer)?))
    }

    /// The expiry of `transfer`'s reservation, if held.
    pub fn expiry(&self, transfer: &RequestId) -> Option<Timestamp> {
        self.table.get(transfer).map(|i| i.expiry)
    }

    /// Reserves `blocks` (D's blocks for the tokens it must receive, in token order) for
    /// `transfer`, to be written by P engine `prefill`. Returns what to register with P,
    /// carrying `prompt` (a digest of D's prompt, when the shell computed one) for P to
    /// check against its leg's.
    ///
    /// # Errors
    /// The lease table's refusal ([`GrantError::Duplicate`] when `transfer` is held
    /// already, a full table); nothing changes then.
    pub fn reserve(
        &mut self,
        now: Timestamp,
        transfer: RequestId,
        prefill: EngineId,
        blocks: Vec<BlockId>,
        prompt: Option<PromptDigest>,
    ) -> Result<Reservation, GrantError> {
        //= docs/spec.md#push-mode
        //# D reserves the blocks under a lease of the reservation duration from the
        //# moment it admits the request
        let generation = self.table.grant(now, transfer.clone(), blocks.clone(), 1)?;
        self.owners.insert(transfer.clone(), prefill);
        self.stats.reserved += 1;
        Ok(Reservation {
            transfer,
            blocks,
            generation,
            lease: self.table.config().duration(),
            prompt,
        })
    }

    /// P engine `from`'s reservation heartbeat naming transfer `ids`. Returns the lease
    /// table's counts; ids registered with another engine count as unknown there (and as
    /// [`ReservationStats::foreign_ids`]).
    pub fn handle_heartbeat<I>(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        ids: I,
    ) -> HeartbeatOutcome
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut foreign = 0u32;
        let mine: Vec<I::Item> = ids
            .into_iter()
            .filter(|id| match self.owners.get(id.as_ref()) {
                Some(owner) if owner != from => {
                    foreign = foreign.saturating_add(1);
                    false
                }
                _ => true,
            })
            .collect();
        //= docs/spec.md#push-mode
        //# each heartbeat sets expiry = max(old expiry, now + extension)
        let mut out = self.table.handle_heartbeat(now, mine);
        self.stats.renewed_ids += u64::from(out.held);
        self.stats.unknown_ids += u64::from(out.unknown) + u64::from(out.late);
        self.stats.foreign_ids += u64::from(foreign);
        out.unknown = out.unknown.saturating_add(foreign);
        out
    }

    /// The write fence: whether a write (or a message) of `generation` for `transfer` from
    /// P engine `from` may land now. A transport's receiver asks this before any byte of
    /// a write lands; the answer stays right until the reservation ends, which happens
    /// only through this table.
    pub fn admits_write(
        &self,
        from: &EngineId,
        transfer: &RequestId,
        generation: Generation,
    ) -> FenceVerdict {
        //= docs/spec.md#push-mode
        //# A write lands only in blocks D holds for that transfer under that generation
        let Some(info) = self.table.get(transfer) else {
            return FenceVerdict::Unknown;
        };
        if self.owners.get(transfer) != Some(from) {
            return FenceVerdict::Foreign;
        }
        if info.generation != generation {
            return FenceVerdict::Stale;
        }
        FenceVerdict::Accepted
    }

    /// P reports the write of `transfer` under `generation` complete: the reservation ends
    /// [`ReservationOutcome::Written`] when the fence admits it, else nothing changes.
    pub fn handle_write_done(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        transfer: &RequestId,
        generation: Generation,
    ) -> FenceVerdict {
        self.end_fenced(now, from, transfer, generation, ReservationOutcome::Written)
    }

    /// P reports that it cannot write `transfer` (its post failed, or the request retired
    /// on P): the reservation ends [`ReservationOutcome::Failed`] when the fence admits
    /// it, so D never waits for a write that will not come.
    pub fn handle_push_failed(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        transfer: &RequestId,
        generation: Generation,
    ) -> FenceVerdict {
        self.end_fenced(now, from, transfer, generation, ReservationOutcome::Failed)
    }

    /// D aborted `transfer`'s request: the reservation ends at once
    /// ([`ReservationOutcome::Aborted`]). Returns whether one was held.
    pub fn abort(&mut self, now: Timestamp, transfer: &RequestId) -> bool {
        self.end(now, transfer, ReservationOutcome::Aborted)
    }

    /// The reaper: ends every reservation past its expiry ([`ReservationOutcome::Expired`]).
    /// Returns how many.
    pub fn handle_timeout(&mut self, now: Timestamp) -> usize {
        //= docs/spec.md#push-mode
        //# D frees every reservation past its expiry
        let n = self.table.handle_timeout(now);
        while let Some(Event::Released(r)) = self.table.poll_event() {
            debug_assert_eq!(r.reason, ReleaseReason::Expired);
            self.record(
                r.request,
                r.blocks,
                r.generation,
                ReservationOutcome::Expired,
                now,
            );
        }
        n
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called; `None` when
    /// nothing is held.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.table.poll_timeout()
    }

    /// The next ended reservation, or `None` when all were drained.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ReservationEnded> {
        self.events.pop_front()
    }

    fn end_fenced(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        transfer: &RequestId,
        generation: Generation,
        outcome: ReservationOutcome,
    ) -> FenceVerdict {
        let verdict = self.admits_write(from, transfer, generation);
        if verdict == FenceVerdict::Accepted {
            self.end(now, transfer, outcome);
        } else {
            self.stats.refused += 1;
        }
        verdict
    }

    fn end(&mut self, now: Timestamp, transfer: &RequestId, outcome: ReservationOutcome) -> bool {
        if !self.table.abort(now, transfer) {
            return false;
        }
        // `abort` released exactly this lease; its event is the only one queued (the
        // reaper drains its own before returning).
        while let Some(Event::Released(r)) = self.table.poll_event() {
            self.record(r.request, r.blocks, r.generation, outcome, now);
        }
        true
    }

    fn record(
        &mut self,
        transfer: RequestId,
        blocks: Vec<BlockId>,
        generation: Generation,
        outcome: ReservationOutcome,
        at: Timestamp,
    ) {
        let Some(prefill) = self.owners.remove(&transfer) else {
            debug_assert!(false, "a held reservation has an owner");
            return;
        };
        match outcome {
            ReservationOutcome::Written => self.stats.written += 1,
            ReservationOutcome::Aborted => self.stats.aborted += 1,
            ReservationOutcome::Expired => self.stats.expired += 1,
            ReservationOutcome::Failed => self.stats.failed += 1,
        }
        self.events.push_back(ReservationEnded {
            transfer,
            prefill,
            blocks,
            generation,
            outcome,
            at,
        });
    }
}
