//! The agent's counters: the atomics every backend bumps and the snapshot callers read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of this agent (monotonic since it was built).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Inbound connections accepted.
    pub connections_accepted: u64,
    /// Connections (either direction) closed because a frame broke the format.
    pub malformed_frames: u64,
    /// Inbound handshakes whose token proof failed.
    pub auth_failures: u64,
    /// Of those, handshakes under a name whose group has a bound session that did not
    /// prove it ([`Agent::bind_session`](crate::Agent::bind_session)).
    pub session_refusals: u64,
    /// Read ops served.
    pub reads_served: u64,
    /// Bytes served.
    pub bytes_served: u64,
    /// Read ops refused (any reason).
    pub reads_refused: u64,
    /// Read ops refused because the peer was not authenticated.
    pub reads_refused_unauthenticated: u64,
    /// Peers' writes that landed in this agent's regions.
    pub writes_landed: u64,
    /// Bytes of those writes.
    pub bytes_landed: u64,
    /// Of the writes landed, those this agent copied from the writer's memory itself (a
    /// same-host writer's memfd it mapped, or its process read with cross-memory
    /// attach), rather than from a payload the writer sent.
    pub writes_pulled: u64,
    /// Peers' writes refused before any byte landed (the stale ones included).
    pub writes_refused: u64,
    /// Peers' writes refused because the write fence no longer held their generation.
    pub writes_stale: u64,
    /// Notifications accepted: into the inbox, or drained from a same-host peer's
    /// shared-memory ring.
    pub notifs_received: u64,
    /// Notifications dropped because the sender had not completed the handshake.
    pub notifs_dropped_unauthenticated: u64,
    /// Notifications dropped because the inbox was full (in count or in bytes).
    pub notifs_dropped_overflow: u64,
    /// Inbound connections closed because they had not authenticated within
    /// `limits.handshake_timeout` of being accepted.
    pub handshake_timeouts: u64,
    /// Unauthenticated inbound connections shut down to make room for a newcomer
    /// (`limits.max_preauth_connections`).
    pub preauth_evicted: u64,
    /// Inbound connections closed at accept: every pre-auth slot was held and none could
    /// be evicted.
    pub preauth_refused: u64,
    /// Same-host peers' notification rings closed because the peer wrote something into
    /// the shared ring that no honest peer could have (see the `shm` module).
    pub notif_rings_corrupt: u64,
    /// Verbs queue pairs reset because they completed nothing for
    /// [`Limits::verbs_stall_timeout`](crate::Limits::verbs_stall_timeout) with work
    /// outstanding (their unconfirmed work was posted again).
    pub verbs_stall_resets: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections_accepted: AtomicU64,
    pub(crate) malformed_frames: AtomicU64,
    pub(crate) auth_failures: AtomicU64,
    pub(crate) session_refusals: AtomicU64,
    pub(crate) reads_served: AtomicU64,
    pub(crate) bytes_served: AtomicU64,
    pub(crate) reads_refused: AtomicU64,
    pub(crate) reads_refused_unauthenticated: AtomicU64,
    pub(crate) writes_landed: AtomicU64,
    pub(crate) bytes_landed: AtomicU64,
    pub(crate) writes_pulled: AtomicU64,
    pub(crate) writes_refused: AtomicU64,
    pub(crate) writes_stale: AtomicU64,
    pub(crate) notifs_received: AtomicU64,
    pub(crate) notifs_dropped_unauthenticated: AtomicU64,
    pub(crate) notifs_dropped_overflow: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) preauth_evicted: AtomicU64,
    pub(crate) preauth_refused: AtomicU64,
    pub(crate) notif_rings_corrupt: AtomicU64,
    pub(crate) verbs_stall_resets: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> TransportStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TransportStats {
            connections_accepted: g(&self.connections_accepted),
            malformed_frames: g(&self.malformed_frames),
            auth_failures: g(&self.auth_failures),
            session_refusals: g(&self.session_refusals),
            reads_served: g(&self.reads_served),
            bytes_served: g(&self.bytes_served),
            reads_refused: g(&self.reads_refused),
            reads_refused_unauthenticated: g(&self.reads_refused_unauthenticated),
            writes_landed: g(&self.writes_landed),
            bytes_landed: g(&self.bytes_landed),
            writes_pulled: g(&self.writes_pulled),
            writes_refused: g(&self.writes_refused),
            writes_stale: g(&self.writes_stale),
            notifs_received: g(&self.notifs_received),
            notifs_dropped_unauthenticated: g(&self.notifs_dropped_unauthenticated),
            notifs_dropped_overflow: g(&self.notifs_dropped_overflow),
            handshake_timeouts: g(&self.handshake_timeouts),
            preauth_evicted: g(&self.preauth_evicted),
            preauth_refused: g(&self.preauth_refused),
            notif_rings_corrupt: g(&self.notif_rings_corrupt),
            verbs_stall_resets: g(&self.verbs_stall_resets),
        }
    }
}

/// A handle on an [`Agent`](crate::Agent)'s counters that outlives neither more nor less than the
/// caller wants: it holds only the counters, so whoever exports metrics can read them
/// without owning the agent (see [`Agent::stats_handle`](crate::Agent::stats_handle)).
#[derive(Debug, Clone)]
pub struct StatsHandle {
    pub(crate) counters: Arc<Counters>,
}

impl StatsHandle {
    /// The counters now (each monotonic since the agent was built).
    pub fn stats(&self) -> TransportStats {
        self.counters.snapshot()
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
