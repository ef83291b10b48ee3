//! The decode core's hold on finished turns (bidirectional mode, SPEC "Bidirectional
//! mode"): D keeps a finished turn's blocks for the conversation's next turn, whose P pulls
//! them. A sub-state machine of [`DecodeCore`] (a [`DecoderHold`] field) behind the core's
//! own inputs and outputs, as quinn-proto's `Connection` owns its streams:
//! - [`DecodeCore::request_finished_hold`] decides keep or refuse when a request ends;
//! - [`DecodeCore::handle_notif_at`] applies P's heartbeats for held turns and frees a turn
//!   P read;
//! - [`DecodeCore::handle_timeout`] expires held turns and evicts the oldest while the next
//!   request to schedule is short of blocks;
//! - [`DecodeCore::poll_turn_released`] hands out each turn that ended: the shell clears
//!   its fences, and the core frees its blocks as it hands it out.

use std::time::Duration;

use kvlease_lease::{
    BlockId, DecoderTtl, EngineId, Event, Generation, GrantError, RequestId, Timestamp,
};

use super::{DecodeCore, DecodeNotif};
use crate::bidir::DecoderHold;

/// How a [`DecodeCore`] keeps finished turns ([`DecodeConfig::with_hold`](super::DecodeConfig::with_hold)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldTerms {
    /// `decoder_kv_blocks_ttl`.
    pub ttl: DecoderTtl,
    /// The symmetric lease: P's heartbeats extend held turns (else the fixed TTL).
    pub symmetric: bool,
}

/// A finished turn the core keeps for P. The shell makes `blocks` readable for its peers,
/// publishes `generation` in every worker's fence words of `blocks`, then answers with the
/// turn's params (a deadline `ttl` from now on the clock it shows P). When the blocks cannot
/// be made readable it gives the turn back with [`DecodeCore::drop_turn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptTurn {
    /// The held turn's id (P's heartbeats and read completion name it): `turn-<request>`.
    pub turn: RequestId,
    /// The request's blocks, in token order.
    pub blocks: Vec<BlockId>,
    /// The fencing generation P's pull checks.
    pub generation: Generation,
    /// Until when the core keeps the turn (the core's clock).
    pub deadline: Timestamp,
    /// The same deadline, as the time left now.
    pub ttl: Duration,
    /// With the symmetric lease, how far each of P's heartbeats moves the deadline; `None`
    /// for the fixed TTL.
    pub renew_extension: Option<Duration>,
}

/// Why [`DecodeCore::request_finished_hold`] kept nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldRefused {
    /// The request is not decoding (unknown, loading, or answered already): nothing changed.
    #[error("request {request} is not decoding")]
    NotDecoding {
        /// The request.
        request: RequestId,
    },
    /// The core keeps no turns (built without [`HoldTerms`]): the request ended and its
    /// blocks are free.
    #[error("this engine keeps no finished turns (bidirectional mode is off)")]
    NoHold,
    /// `turn-<request>` is not a valid id: the request ended and its blocks are free.
    #[error("request {request} gives no valid turn id")]
    TurnId {
        /// The request.
        request: RequestId,
    },
    /// The hold refused the turn (a full table): the request ended and its blocks are free.
    #[error("cannot keep the turn: {0}")]
    Grant(#[from] GrantError),
}

/// Why a held turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnEnd {
    /// P read it (its read completion).
    Pulled,
    /// Its deadline passed.
    Expired,
    /// It gave way to a new request short of blocks (the oldest held turn goes first).
    Evicted,
    /// The shell could not make it readable ([`DecodeCore::drop_turn`]).
    Dropped,
}

/// A held turn ended: publish [`Generation::FREE_WORD`] in every worker's fence words of
/// `blocks` **now** (a pull still in flight fails its fence). The core frees the blocks as
/// it hands this out, so they are reused only after the shell cleared the fences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnReleased {
    /// The held turn's id.
    pub turn: RequestId,
    /// Its blocks.
    pub blocks: Vec<BlockId>,
    /// The generation it was held under.
    pub generation: Generation,
    /// Why it ended.
    pub end: TurnEnd,
}

impl DecodeCore {
    /// Whether the core keeps finished turns ([`HoldTerms`]).
    pub fn holds_turns(&self) -> bool {
        self.hold.is_some()
    }

    /// Blocks kept by held turns (not counting those being released).
    pub fn turn_blocks_held(&self) -> usize {
        self.hold.as_ref().map_or(0, DecoderHold::blocks_held)
    }

    /// The model finished decoding `request` (vLLM: `request_finished` on D) in
    /// bidirectional mode: it ends [`Outcome::Done`](super::Outcome::Done) and the core
    /// keeps its blocks for the conversation's next turn, from `now` for the
    /// [`HoldTerms::ttl`]. What the shell does with a [`KeptTurn`] is on its doc.
    ///
    /// # Errors
    /// [`HoldRefused`]: nothing changed for [`HoldRefused::NotDecoding`]; otherwise the
    /// request ended and its blocks are free, as [`request_finished`](Self::request_finished)
    /// leaves them.
    pub fn request_finished_hold(
        &mut self,
        now: Timestamp,
        request: &RequestId,
    ) -> Result<KeptTurn, HoldRefused> {
        let Some(blocks) = self.request_finished_keep(request) else {
            return Err(HoldRefused::NotDecoding {
                request: request.clone(),
            });
        };
        let turn = RequestId::new(&format!("turn-{request}"));
        let kept = match (self.hold.as_mut(), turn) {
            (None, _) => Err(HoldRefused::NoHold),
            (Some(_), Err(_)) => Err(HoldRefused::TurnId {
                request: request.clone(),
            }),
            (Some(hold), Ok(turn)) => hold
                .insert(now, turn.clone(), blocks.clone())
                .map(|held| (turn, held, hold.renew_extension()))
                .map_err(HoldRefused::from),
        };
        let (turn, held, renew_extension) = match kept {
            Ok(k) => k,
            Err(e) => {
                self.free(&blocks);
                return Err(e);
            }
        };
        self.stats.turns_held += 1;
        Ok(KeptTurn {
            turn,
            blocks,
            generation: held.generation,
            deadline: held.deadline,
            ttl: held.deadline.saturating_duration_since(now),
            renew_extension,
        })
    }

    /// The shell could not make a [`KeptTurn`]'s blocks readable: the turn ends
    /// ([`TurnEnd::Dropped`]). Returns whether it was held.
    pub fn drop_turn(&mut self, now: Timestamp, turn: &RequestId) -> bool {
        let dropped = self
            .hold
            .as_mut()
            .is_some_and(|h| h.read_complete(now, turn));
        self.drain_hold(TurnEnd::Dropped);
        dropped
    }

    /// Like [`handle_notif`](Self::handle_notif), and for a core that keeps turns, P's
    /// frames about them apply at `now`: a heartbeat extends the held turns it names (the
    /// symmetric lease; the fixed TTL ignores it), a read completion ends the turn
    /// ([`TurnEnd::Pulled`]). Never panics.
    pub fn handle_notif_at(
        &mut self,
        now: Timestamp,
        from: &EngineId,
        bytes: &[u8],
    ) -> DecodeNotif {
        let handled = self.handle_notif(from, bytes);
        let Some(hold) = self.hold.as_mut() else {
            return handled;
        };
        match &handled {
            DecodeNotif::CacheHeartbeat(ids) => {
                let renewed = hold.heartbeat(now, ids);
                self.stats.turns_renewed += u64::from(renewed);
            }
            DecodeNotif::CacheReadComplete(turn) => {
                hold.read_complete(now, turn);
                self.drain_hold(TurnEnd::Pulled);
            }
            _ => {}
        }
        handled
    }

    /// The timer: ends the held turns whose deadline passed ([`TurnEnd::Expired`]); then,
    /// while the next request to schedule ([`poll_load`](Self::poll_load)) is short of
    /// blocks beyond those already on their way back, the oldest held turn gives way
    /// ([`TurnEnd::Evicted`]). Drain [`poll_turn_released`](Self::poll_turn_released)
    /// before the next [`poll_load`](Self::poll_load).
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let Some(hold) = self.hold.as_mut() else {
            return;
        };
        hold.handle_timeout(now);
        self.drain_hold(TurnEnd::Expired);
        loop {
            let coming: usize = self.released.iter().map(|r| r.blocks.len()).sum();
            if self.blocks_short().is_none_or(|short| short <= coming) {
                break;
            }
            let Some(hold) = self.hold.as_mut() else {
                break;
            };
            if hold.evict_oldest(now).is_none() {
                break;
            }
            self.drain_hold(TurnEnd::Evicted);
        }
    }

    /// The next held turn that ended, in order; its blocks are free from here on (clear
    /// their fences first, see [`TurnReleased`]).
    #[must_use]
    pub fn poll_turn_released(&mut self) -> Option<TurnReleased> {
        let r = self.released.pop_front()?;
        self.free(&r.blocks);
        Some(r)
    }

    /// Queues what the hold released, as ending for `end`.
    fn drain_hold(&mut self, end: TurnEnd) {
        let Some(hold) = self.hold.as_mut() else {
            return;
        };
        while let Some(Event::Released(r)) = hold.poll_event() {
            let s = &mut self.stats;
            match end {
                TurnEnd::Pulled => s.turns_pulled += 1,
                TurnEnd::Expired => s.turns_expired += 1,
                TurnEnd::Evicted => s.turns_evicted += 1,
                TurnEnd::Dropped => s.turns_dropped += 1,
            }
            self.released.push_back(TurnReleased {
                turn: r.request,
                blocks: r.blocks,
                generation: r.generation,
                end,
            });
        }
    }
}
