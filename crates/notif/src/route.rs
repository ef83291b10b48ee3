//! Routing of received notifications to the lease state machines.

use std::collections::HashMap;
use std::hash::Hash;

use kvlease_lease::{
    ConsumerId, HeartbeatOutcome, HeartbeatTracker, LeaseTable, ReadCompleteOutcome, ReleaseReason,
    Released, RequestId, Timestamp,
};

use crate::decode::decode;
use crate::error::DecodeError;
use crate::message::{ExpiredLease, Notif};

/// What [`PrefillRouter::route`] did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Routed<'a> {
    /// A heartbeat, fed to [`LeaseTable::handle_heartbeat`].
    Heartbeat {
        /// How many ids it named.
        ids: u32,
        /// What the table did with them.
        outcome: HeartbeatOutcome,
    },
    /// A read completion, fed to [`LeaseTable::handle_read_complete`].
    ReadComplete {
        /// The request.
        request: RequestId,
        /// Who reported.
        consumer: ConsumerId,
        /// What the table did.
        outcome: ReadCompleteOutcome,
    },
    /// An abort, fed to [`LeaseTable::abort`].
    Aborted {
        /// The request.
        request: RequestId,
        /// Whether a lease was held (and is now released).
        held: bool,
    },
    /// An application message, for the caller to handle.
    App(&'a [u8]),
    /// A message P should never receive (an expiry notice); counted and dropped.
    Misdirected,
    /// A malformed message in the reserved namespace; counted and dropped.
    Rejected(DecodeError),
}

/// Counters of [`PrefillRouter`], cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PrefillStats {
    /// Heartbeat messages routed.
    pub heartbeats: u64,
    /// Ids in those messages.
    pub heartbeat_ids: u64,
    /// Ids whose lease was extended.
    pub extended: u64,
    /// Ids that named no lease.
    pub unknown_ids: u64,
    /// Ids of leases already past their expiry.
    pub late_ids: u64,
    /// Read completions routed.
    pub read_completions: u64,
    /// Aborts routed.
    pub aborts: u64,
    /// Application messages passed through.
    pub app: u64,
    /// Messages that P should not receive.
    pub misdirected: u64,
    /// Malformed messages.
    pub rejected: u64,
}

/// P's side: decodes received notifications and feeds them to the [`LeaseTable`].
///
/// `HB:` → [`LeaseTable::handle_heartbeat`] (no allocation per id: the ids are checked in
/// place and looked up as `&str`), read completions →
/// [`LeaseTable::handle_read_complete`], aborts → [`LeaseTable::abort`], everything else →
/// [`Routed::App`] for the application.
///
/// It also remembers which peers (of the caller's peer type `P`) sent heartbeats and when,
/// so that P can address the explicit expiry signal: [`expiry_notice`](Self::expiry_notice)
/// says whether a released lease deserves one and
/// [`recent_heartbeat_peers`](Self::recent_heartbeat_peers) to whom to send it. That costs
/// one map update per message, not per id.
#[derive(Debug)]
pub struct PrefillRouter<P> {
    stats: PrefillStats,
    heartbeat_peers: HashMap<P, Timestamp>,
}

impl<P: Clone + Eq + Hash> Default for PrefillRouter<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Clone + Eq + Hash> PrefillRouter<P> {
    /// A router with zeroed counters.
    pub fn new() -> Self {
        Self {
            stats: PrefillStats::default(),
            heartbeat_peers: HashMap::new(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> PrefillStats {
        self.stats
    }

    /// Decodes `bytes`, received from `from` at `now`, and feeds it to `table`.
    ///
    /// Never panics; a malformed message is [`Routed::Rejected`] and changes nothing.
    pub fn route<'a>(
        &mut self,
        now: Timestamp,
        from: &P,
        bytes: &'a [u8],
        table: &mut LeaseTable,
    ) -> Routed<'a> {
        match decode(bytes) {
            Ok(Notif::Heartbeat(ids)) => {
                let outcome = table.handle_heartbeat(now, ids.iter());
                match self.heartbeat_peers.get_mut(from) {
                    Some(at) => *at = (*at).max(now),
                    None => {
                        self.heartbeat_peers.insert(from.clone(), now);
                    }
                }
                let count = u32::try_from(ids.len()).unwrap_or(u32::MAX);
                self.stats.heartbeats += 1;
                self.stats.heartbeat_ids += u64::from(count);
                self.stats.extended += u64::from(outcome.extended);
                self.stats.unknown_ids += u64::from(outcome.unknown);
                self.stats.late_ids += u64::from(outcome.late);
                Routed::Heartbeat {
                    ids: count,
                    outcome,
                }
            }
            Ok(Notif::ReadComplete(rc)) => {
                self.stats.read_completions += 1;
                let outcome = table.handle_read_complete(
                    now,
                    &rc.request,
                    rc.consumer.clone(),
                    Some(rc.consumers_total),
                );
                Routed::ReadComplete {
                    request: rc.request,
                    consumer: rc.consumer,
                    outcome,
                }
            }
            Ok(Notif::Abort(abort)) => {
                self.stats.aborts += 1;
                let held = table.abort(now, &abort.request);
                Routed::Aborted {
                    request: abort.request,
                    held,
                }
            }
            Ok(Notif::App(payload)) => {
                self.stats.app += 1;
                Routed::App(payload)
            }
            Ok(_) => {
                self.stats.misdirected += 1;
                Routed::Misdirected
            }
            Err(e) => {
                self.stats.rejected += 1;
                Routed::Rejected(e)
            }
        }
    }

    /// The expiry notice entry for `released`, if it deserves one: it expired (not
    /// completed or aborted) and had been heartbeated, so a D still tracks it.
    pub fn expiry_notice(released: &Released) -> Option<ExpiredLease> {
        (released.reason == ReleaseReason::Expired && released.last_heartbeat.is_some()).then(
            || ExpiredLease {
                request: released.request.clone(),
                generation: released.generation,
            },
        )
    }

    /// The peers that sent a heartbeat at or after `since` (e.g. `now - extension`): the
    /// candidates that may still track a lease that just expired. Forgets peers last heard
    /// before `since`.
    pub fn recent_heartbeat_peers(&mut self, since: Timestamp) -> impl Iterator<Item = &P> + '_ {
        self.heartbeat_peers.retain(|_, at| *at >= since);
        self.heartbeat_peers.keys()
    }
}

/// What [`DecodeRouter::route`] did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeRouted<'a> {
    /// An expiry notice: P reclaimed these leases. The router untracked the ones the
    /// tracker held; the scheduler must not read them (recompute, or abort the request).
    Expired {
        /// Every lease the notice names.
        leases: Vec<ExpiredLease>,
        /// How many of them the tracker held and untracked.
        untracked: u32,
    },
    /// An application message, for the caller to handle.
    App(&'a [u8]),
    /// A message D should never receive (a heartbeat, completion or abort); dropped.
    Misdirected,
    /// A malformed message in the reserved namespace; dropped.
    Rejected(DecodeError),
}

/// Counters of [`DecodeRouter`], cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DecodeStats {
    /// Expiry notices routed.
    pub expiry_notices: u64,
    /// Leases named in them.
    pub expired_leases: u64,
    /// Of those, how many the tracker still held.
    pub untracked: u64,
    /// Application messages passed through.
    pub app: u64,
    /// Messages that D should not receive.
    pub misdirected: u64,
    /// Malformed messages.
    pub rejected: u64,
}

/// D's side: decodes received notifications; expiry notices stop the heartbeats of the
/// named requests ([`HeartbeatTracker::untrack`]) and are returned for the scheduler.
#[derive(Debug, Default)]
pub struct DecodeRouter {
    stats: DecodeStats,
}

impl DecodeRouter {
    /// A router with zeroed counters.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counters.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Decodes `bytes` and applies it to `tracker`.
    ///
    /// Never panics; a malformed message is [`DecodeRouted::Rejected`] and changes nothing.
    pub fn route<'a>(
        &mut self,
        bytes: &'a [u8],
        tracker: &mut HeartbeatTracker,
    ) -> DecodeRouted<'a> {
        match decode(bytes) {
            Ok(Notif::Expired(leases)) => {
                let untracked = leases
                    .iter()
                    .filter(|lease| tracker.untrack(&lease.request))
                    .count();
                let untracked = u32::try_from(untracked).unwrap_or(u32::MAX);
                self.stats.expiry_notices += 1;
                self.stats.expired_leases += leases.len() as u64;
                self.stats.untracked += u64::from(untracked);
                DecodeRouted::Expired { leases, untracked }
            }
            Ok(Notif::App(payload)) => {
                self.stats.app += 1;
                DecodeRouted::App(payload)
            }
            Ok(_) => {
                self.stats.misdirected += 1;
                DecodeRouted::Misdirected
            }
            Err(e) => {
                self.stats.rejected += 1;
                DecodeRouted::Rejected(e)
            }
        }
    }
}
