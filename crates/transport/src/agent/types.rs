//! The agent's public value types (ids, ranges, batches, statistics) and its counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Backend;
use crate::error::TransferError;
use crate::metadata::RegionDesc;

/// Longest agent name, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// A locally registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A connected peer (returned by [`Agent::connect`](super::Agent::connect)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub(super) u64);

/// A posted read batch (returned by [`Agent::post_read`](super::Agent::post_read)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub(super) u64);

/// A peer's name, as it announced it in its metadata and handshake.
pub type PeerName = String;

/// Who sent a notification: the name its connection proved, and the id of the session it
/// proved it with ([`Agent::bind_session`](super::Agent::bind_session); `None`: the
/// cluster token, or no token at all).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sender {
    /// The proven name.
    pub name: PeerName,
    /// [`Session::id`](kvlease_proto::auth::Session::id) of the session it proved.
    pub session: Option<u64>,
}

impl Sender {
    /// A sender that proved `name` without a session.
    pub fn unbound(name: impl Into<PeerName>) -> Self {
        Self {
            name: name.into(),
            session: None,
        }
    }
}

impl std::fmt::Display for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.session {
            Some(id) => write!(f, "{} (session {id:016x})", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// A destination range in a locally registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRange {
    /// The local region.
    pub region: RegionId,
    /// Offset inside it.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
}

/// A source position in a peer's registered region (from its [`RegionDesc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// The peer's region id ([`RegionDesc::id`]).
    pub region: u64,
    /// The region's key ([`RegionDesc::key`]).
    pub key: u64,
    /// Offset inside the region.
    pub offset: u64,
}

impl RegionDesc {
    /// The position `offset` bytes into this region.
    pub fn at(&self, offset: u64) -> RemoteRange {
        RemoteRange {
            region: self.id,
            key: self.key,
            offset,
        }
    }
}

/// One read: `local.len` bytes from `remote` into `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    /// Destination.
    pub local: LocalRange,
    /// Source.
    pub remote: RemoteRange,
}

/// A read of one 8-byte generation word, performed only after every data read of the
/// batch completed; the batch fails with [`TransferError::FenceMismatch`] when the word
/// differs from `expected`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRead {
    /// The word (8 bytes, 8-aligned, e.g. a `FenceTable` slot on the peer).
    pub remote: RemoteRange,
    /// The generation the reader was given.
    pub expected: u64,
}

/// A batch of reads from one peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// The reads (at least one).
    pub ops: Vec<ReadOp>,
    /// Sent to the peer only after every read (and the fence) completed and matched.
    pub notif: Option<Vec<u8>>,
    /// The fence read that ends the batch.
    pub fence: Option<FenceRead>,
}

/// What a finished batch moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchStats {
    /// Data bytes read (the fence word not included).
    pub bytes: u64,
    /// Read ops in the batch.
    pub ops: usize,
    /// The fence word read, when the batch had a fence.
    pub fence_word: Option<u64>,
    /// The backend that moved the bytes. A peer connected over verbs still has batches
    /// that touch memory verbs could not register (not even through a host mirror, or
    /// registered after connect) moved over TCP.
    pub backend: Backend,
}

/// Where a batch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchStatus {
    /// Still running.
    Pending,
    /// Every read completed (and the fence matched); the notification was handed to the
    /// connection.
    Done(BatchStats),
    /// The batch failed; the destination bytes are unspecified. No transfer into them is
    /// running any more.
    Failed(TransferError),
}

/// Counters of this agent (monotonic since it was built).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStats {
    /// Inbound connections accepted.
    pub connections_accepted: u64,
    /// Connections (either direction) closed because a frame broke the format.
    pub malformed_frames: u64,
    /// Inbound handshakes whose token proof failed.
    pub auth_failures: u64,
    /// Of those, handshakes under a name whose group has a bound session that did not
    /// prove it ([`Agent::bind_session`](super::Agent::bind_session)).
    pub session_refusals: u64,
    /// Read ops served.
    pub reads_served: u64,
    /// Bytes served.
    pub bytes_served: u64,
    /// Read ops refused (any reason).
    pub reads_refused: u64,
    /// Read ops refused because the peer was not authenticated.
    pub reads_refused_unauthenticated: u64,
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
    pub(crate) notifs_received: AtomicU64,
    pub(crate) notifs_dropped_unauthenticated: AtomicU64,
    pub(crate) notifs_dropped_overflow: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    pub(crate) preauth_evicted: AtomicU64,
    pub(crate) preauth_refused: AtomicU64,
    pub(crate) notif_rings_corrupt: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> TransportStats {
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
            notifs_received: g(&self.notifs_received),
            notifs_dropped_unauthenticated: g(&self.notifs_dropped_unauthenticated),
            notifs_dropped_overflow: g(&self.notifs_dropped_overflow),
            handshake_timeouts: g(&self.handshake_timeouts),
            preauth_evicted: g(&self.preauth_evicted),
            preauth_refused: g(&self.preauth_refused),
            notif_rings_corrupt: g(&self.notif_rings_corrupt),
        }
    }
}

/// A handle on an [`Agent`](super::Agent)'s counters that outlives neither more nor less than the
/// caller wants: it holds only the counters, so whoever exports metrics can read them
/// without owning the agent (see [`Agent::stats_handle`](super::Agent::stats_handle)).
#[derive(Debug, Clone)]
pub struct StatsHandle {
    pub(super) counters: Arc<Counters>,
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
