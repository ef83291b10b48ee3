//! P's side of the symmetric lease on held turns: which of D's held turns P heartbeats,
//! and when. P heartbeats a held turn while the conversation's next-turn request waits on
//! P (for blocks, or behind other requests), so that D keeps it until P pulls; D extends it
//! by its `kvlease_renew_extension_ms` per heartbeat ([`DecoderHold`](super::DecoderHold))
//! when it arrives before the turn's deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use kvlease_lease::Timestamp;

use super::DecoderKvParams;

/// How many heartbeats P sends for a held turn per renewal extension: a lost one or two
/// leave the turn held.
pub const TURN_HEARTBEATS_PER_EXTENSION: u32 = 4;

/// One heartbeat for a held turn: to D engine `engine` (its side channel at `host:port`,
/// for a handshake when P has none with it yet), naming `turn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnHeartbeat {
    /// D's engine id.
    pub engine: String,
    /// Host of D's side channel.
    pub host: String,
    /// Port of D's side channel.
    pub port: u16,
    /// The held turn's id (D's `remote_request_id`).
    pub turn: String,
}

/// P's unbroken run of heartbeats for a held turn, on P's clock: what
/// [`TurnHeartbeats::take`] hands to
/// [`DecoderKvParams::renewed_by_heartbeats`](super::DecoderKvParams::renewed_by_heartbeats).
///
/// Each heartbeat of a run went out less than half an extension after the one before
/// (they are due every extension / [`TURN_HEARTBEATS_PER_EXTENSION`]), so when the first
/// found the turn held, each later one reached D while the turn the one before extended
/// was still held (the other half covers the difference of their delays). A longer gap (P
/// stalled, a heartbeat not sent for a while) starts a new run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatRun {
    /// When the run's first heartbeat went out.
    pub first: Timestamp,
    /// When its last heartbeat went out.
    pub last: Timestamp,
}

#[derive(Debug)]
struct Watched {
    to: TurnHeartbeat,
    every: Duration,
    /// The renewal extension: a gap of half of it between heartbeats breaks a run.
    extension: Duration,
    /// The heartbeats sent so far; `None`: due at once.
    run: Option<HeartbeatRun>,
}

/// P's schedule of heartbeats for D's held turns (sans-IO: time is an argument).
///
/// # Call order (one forward-loop step)
/// 1. [`handle_waiting`](Self::handle_waiting) with the params of every next-turn request
///    waiting on P;
/// 2. [`due`](Self::due) at `now`: send each heartbeat (handshaking with its engine first
///    when needed), and report each one sent with [`handle_sent`](Self::handle_sent); one
///    not sent stays due;
/// 3. when a request's pull starts, [`take`](Self::take) its turn: the run of heartbeats
///    bounds how far D extended the turn ([`DecoderKvParams::renewed_by_heartbeats`]).
///
/// Turns are kept in id order, so [`due`](Self::due) hands them out in an order defined by
/// the inputs.
#[derive(Debug)]
pub struct TurnHeartbeats {
    per_extension: u32,
    turns: BTreeMap<String, Watched>,
}

impl Default for TurnHeartbeats {
    fn default() -> Self {
        Self::new(TURN_HEARTBEATS_PER_EXTENSION)
    }
}

impl TurnHeartbeats {
    /// A schedule sending `per_extension` heartbeats (at least 1) per renewal extension.
    pub fn new(per_extension: u32) -> Self {
        Self {
            per_extension: per_extension.max(1),
            turns: BTreeMap::new(),
        }
    }

    /// Held turns heartbeated.
    pub fn len(&self) -> usize {
        self.turns.len()
    }

    /// Whether no turn is heartbeated.
    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// The held turns whose next-turn requests wait on P now (their params), replacing the
    /// last set: a turn no longer waiting is forgotten, a new one is due at once. Turns held
    /// on a fixed TTL (`kvlease_renew_extension_ms` 0) are never heartbeated.
    pub fn handle_waiting<'a>(&mut self, waiting: impl IntoIterator<Item = &'a DecoderKvParams>) {
        let mut next = BTreeMap::new();
        for p in waiting {
            if p.kvlease_renew_extension_ms == 0 {
                continue;
            }
            let extension = Duration::from_millis(p.kvlease_renew_extension_ms);
            let every = extension / self.per_extension;
            let run = self.turns.get(&p.remote_request_id).and_then(|w| w.run);
            next.insert(
                p.remote_request_id.clone(),
                Watched {
                    to: TurnHeartbeat {
                        engine: p.remote_engine_id.clone(),
                        host: p.remote_host.clone(),
                        port: p.remote_port,
                        turn: p.remote_request_id.clone(),
                    },
                    every,
                    extension,
                    run,
                },
            );
        }
        self.turns = next;
    }

    /// The heartbeats due at `now`, in turn-id order: a turn never heartbeated, or whose
    /// last heartbeat is an interval (the extension / heartbeats per extension) old. The
    /// same ones until [`handle_sent`](Self::handle_sent).
    pub fn due(&self, now: Timestamp) -> Vec<TurnHeartbeat> {
        self.turns
            .values()
            .filter(|w| {
                w.run
                    .is_none_or(|r| now.saturating_duration_since(r.last) >= w.every)
            })
            .map(|w| w.to.clone())
            .collect()
    }

    /// A heartbeat for `turn` went out at `now`; returns whether the turn is heartbeated.
    /// It continues the turn's run of heartbeats, or starts a new one when the last went
    /// out half an extension ago or more ([`HeartbeatRun`]).
    pub fn handle_sent(&mut self, now: Timestamp, turn: &str) -> bool {
        match self.turns.get_mut(turn) {
            Some(w) => {
                let first = match w.run {
                    Some(r) if now.saturating_duration_since(r.last) < w.extension / 2 => r.first,
                    _ => now,
                };
                w.run = Some(HeartbeatRun { first, last: now });
                true
            }
            None => false,
        }
    }

    /// P starts pulling `turn` (its request no longer waits): stop heartbeating it. Returns
    /// its latest run of heartbeats, if one went out.
    pub fn take(&mut self, turn: &str) -> Option<HeartbeatRun> {
        self.turns.remove(turn).and_then(|w| w.run)
    }

    /// When the next heartbeat comes due; `None` when no turn is heartbeated.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.turns
            .values()
            .map(|w| match w.run {
                None => Timestamp::ZERO,
                Some(r) => r.last.checked_add(w.every).unwrap_or(r.last),
            })
            .min()
    }
}
