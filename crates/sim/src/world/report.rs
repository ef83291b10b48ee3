//! What a run hands back: its counters and its report.

use std::time::Duration;

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Requests that arrived at P.
    pub arrived: u64,
    /// Requests that ended in exactly one outcome.
    pub outcomes_ok: u64,
    /// Outcome: refused by P (no blocks, or a prompt it cannot take).
    pub refused_at_p: u64,
    /// Outcome: refused by D on arrival.
    pub refused_at_d: u64,
    /// Outcome: lost with a crashed P (queued or prefilling when it crashed, or arrived
    /// while it was down).
    pub lost_with_p: u64,
    /// Outcome: lost with a crashed D.
    pub lost_with_d: u64,
    /// Outcome: decoded to the end.
    pub done: u64,
    /// Outcome: the load failed (no output).
    pub failed: u64,
    /// Outcome: aborted by the client.
    pub aborted: u64,
    /// Leases granted.
    pub granted: u64,
    /// Leases released because every consumer reported.
    pub released_completed: u64,
    /// Leases released by the reaper.
    pub released_expired: u64,
    /// Leases released by an abort.
    pub released_aborted: u64,
    /// Requests D read and verified.
    pub reads_ok: u64,
    /// Read batches that found a changed fence word.
    pub stale_reads: u64,
    /// Read batches that failed because P was gone, restarted or unreachable.
    pub failed_reads: u64,
    /// Requests D failed without reading, after an expiry notice.
    pub recomputed_after_notice: u64,
    /// Requests the client aborted on D.
    pub client_aborts: u64,
    /// Heartbeat messages sent (one per P worker).
    pub heartbeat_messages: u64,
    /// Bytes of those messages.
    pub heartbeat_bytes: u64,
    /// Heartbeat ids routed on P that named no live lease (late or unknown).
    pub heartbeat_ids_unknown_or_late: u64,
    /// Heartbeat ids that arrived after their lease was released.
    pub heartbeats_after_release: u64,
    /// Expiry notices (messages) sent by P.
    pub expiry_notices: u64,
    /// Messages lost by the network.
    pub messages_lost: u64,
    /// Messages duplicated by the network.
    pub messages_duplicated: u64,
    /// Of the lost messages, those dropped by a partition.
    pub messages_partitioned: u64,
    /// Partitions that began.
    pub partitions: u64,
    /// P engines restarted (under the same engine id).
    pub p_restarts: u64,
    /// D engines restarted (under the same engine id).
    pub d_restarts: u64,
    /// Stalls (P or D) that began.
    pub stalls: u64,
    /// Forged notifications sent by the rogue.
    pub forged: u64,
    /// Forged notifications a core ignored as another engine's.
    pub forged_ignored: u64,
    /// Leases the rogue claimed first (released without the early-release checks).
    pub rogue_owned: u64,
    /// `forget_engine` calls (a connection to P was lost).
    pub forgotten_engines: u64,
    /// Times a D core found a P engine restarted (P's side channel announced a newer
    /// instance to a check).
    pub peer_restarts_seen: u64,
    /// Checks of a connected P engine's instance (a request named a newer one).
    pub instance_checks: u64,
    /// Requests checked by the restart oracle (the first one to a restarted P past the bound).
    pub restart_checks: u64,
    /// Leases reclaimed after their D crashed.
    pub crash_reclaims: u64,
    /// Smallest and largest time from the last delivered heartbeat to the reclaim of a
    /// lease whose D crashed (P's clock).
    pub crash_reclaim_after_heartbeat: Option<(Duration, Duration)>,
    /// Longest time from a D crash to the reclaim of one of its leases (true time).
    pub crash_reclaim_since_crash_max: Duration,
    /// Longest time a request stayed admitted on D before its load began.
    pub max_queue_wait: Duration,
    /// Read completions P accepted.
    pub read_completions: u64,
    /// Handshakes D started.
    pub handshakes: u64,
    /// Heartbeat batches deferred while their engine handshaked.
    pub deferred_batches: u64,
    /// Bidirectional mode: next turns that reached P.
    pub turns: u64,
    /// Bidirectional mode: next turns whose last turn D did not hold.
    pub turns_without_hold: u64,
    /// Bidirectional mode: next turns P recomputed (`plan_pull` said so, or the pull
    /// failed).
    pub turns_recomputed: u64,
    /// Bidirectional mode: pulls of D's held blocks that completed.
    pub pulls: u64,
    /// Bidirectional mode: pulls that found a changed fence word (the hold ended first).
    pub pulls_stale: u64,
    /// Bidirectional mode: stale pulls of a hold that had expired (P read a hold it
    /// believed renewed or alive: a wasted read).
    pub pulls_stale_expired: u64,
    /// Bidirectional mode: stale pulls with the params of a D incarnation before the one
    /// P reached (D restarted: the new one's generations never match them).
    pub pulls_stale_restarted: u64,
    /// Bidirectional mode: pulls that failed (D crashed, restarted or cut off).
    pub pulls_failed: u64,
    /// Bidirectional mode: finished turns D held.
    pub holds: u64,
    /// Bidirectional mode: holds freed on P's read completion.
    pub holds_pulled: u64,
    /// Bidirectional mode: holds whose TTL passed.
    pub holds_expired: u64,
    /// Bidirectional mode: holds evicted for a new request's blocks.
    pub holds_evicted: u64,
    /// Bidirectional mode: holds lost with a crashed D.
    pub holds_lost_with_d: u64,
    /// Bidirectional mode (symmetric lease): heartbeats P sent for cached turns.
    pub cache_heartbeats: u64,
    /// Bidirectional mode (symmetric lease): cached turns those heartbeats extended on D.
    pub cache_heartbeats_extended: u64,
    /// Integral of the requests D tracks over true time (request·ns), for the mean.
    pub tracked_request_ns: u128,
    /// Virtual time at the end.
    pub end: Duration,
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// A hash of every event in order; the same config gives the same hash.
    pub trace_hash: u64,
    /// Every traced event, every event and action the cores handed out and every message
    /// sent or delivered, in order, one line each, for a world built with
    /// [`World::record_log`](super::World::record_log); empty otherwise.
    pub log: Vec<String>,
    /// The counters.
    pub stats: SimStats,
    /// Every broken rule (at most 20), with the virtual time; empty for a good run.
    pub failures: Vec<String>,
}
