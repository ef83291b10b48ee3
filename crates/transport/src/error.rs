//! Errors, one enum per operation family.

use std::error::Error as StdError;
use std::io;

use kvlease_gpu_mem::RegionAccessError;

use crate::config::Backend;
use crate::ids::{BatchId, PeerId, RegionId};
use crate::shm::error::ShmError;
#[cfg(feature = "verbs")]
use crate::verbs::error::{MirrorError, VerbsLinkError};

/// Why [`Agent::new`](crate::Agent::new) failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is unusable.
    #[error("invalid agent configuration: {0}")]
    Config(&'static str),
    /// Binding the TCP listener failed.
    #[error("binding TCP listener on {addr} failed")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Starting the listener thread failed.
    #[error("starting the TCP listener thread failed")]
    Thread(#[source] io::Error),
    /// Creating the poller of the TCP notification connections (an epoll instance)
    /// failed.
    #[error("creating the notification poller failed")]
    Poller(#[source] io::Error),
}

/// Why a registration call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The region has zero length.
    #[error("cannot register an empty region")]
    Empty,
    /// No region is registered under this id.
    #[error("region {0:?} is not registered")]
    Unknown(RegionId),
    /// The OS random source failed (keys must be unguessable).
    #[error("random source failed: {0}")]
    Random(getrandom::Error),
    /// A range given to [`Agent::sync_for_peers`](crate::Agent::sync_for_peers) lies
    /// outside the region.
    #[error("range of region {region:?} is unusable")]
    Range {
        /// The region.
        region: RegionId,
        /// Why.
        #[source]
        source: RegionAccessError,
    },
    /// [`Agent::grant_write`](crate::Agent::grant_write) granted nothing.
    #[error("no write access granted on region {region:?}: {reason}")]
    Grant {
        /// The destination region.
        region: RegionId,
        /// Why.
        reason: String,
    },
    /// Copying a region's range into the host mirror that verbs peers read failed
    /// (a CUDA copy error); peers must not be told to read that range.
    #[error("copying region {region:?} into its verbs mirror failed")]
    Mirror {
        /// The region.
        region: RegionId,
        /// What the copy said.
        #[source]
        source: LinkError,
    },
}

/// Why peer metadata could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// Not valid metadata JSON.
    #[error("peer metadata is not valid: {0}")]
    Invalid(#[source] serde_json::Error),
    /// A format version this build does not speak.
    #[error("peer metadata has format version {found}; this build speaks {supported}")]
    Version {
        /// Version found.
        found: u32,
        /// Version supported.
        supported: u32,
    },
}

/// Why [`Agent::connect`](crate::Agent::connect) failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The metadata could not be loaded.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// TCP connect or handshake IO failed.
    #[error("connecting to peer {peer} at {addr} failed")]
    Io {
        /// Peer name from its metadata.
        peer: String,
        /// Its address.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer speaks another protocol version or broke the handshake.
    #[error("handshake with peer {peer} failed: {reason}")]
    Handshake {
        /// Peer name.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The peer refused our proof of the cluster token (or we have none and it wants one).
    #[error("peer {peer} rejected our authentication (cluster token mismatch or missing)")]
    AuthRejected {
        /// Peer name.
        peer: String,
    },
    /// The peer could not prove the cluster token we hold.
    #[error("peer {peer} failed to prove the cluster token")]
    PeerAuthFailed {
        /// Peer name.
        peer: String,
    },
    /// The requested backend cannot reach this peer.
    #[error("backend {backend} unavailable for peer {peer}")]
    BackendUnavailable {
        /// The backend that was asked for.
        backend: Backend,
        /// Peer name.
        peer: String,
        /// Why (boxed: it is the largest cause of a connect error).
        #[source]
        source: Box<LinkError>,
    },
    /// The OS random source failed.
    #[error("random source failed: {0}")]
    Random(getrandom::Error),
    /// Starting a connection thread failed.
    #[error("starting a connection thread failed")]
    Thread(#[source] io::Error),
}

/// Why the verbs backend cannot serve a peer, a region or a range: the cause of
/// [`ConnectError::BackendUnavailable`] and [`RegisterError::Mirror`], and (rendered with
/// its causes) the reason [`Agent::peer_backend`](crate::Agent::peer_backend) gives for a
/// peer that fell back to TCP.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// The agent's backend choice excludes this backend (`tcp`, `shm` or `verbs` only).
    #[error("backend {0} was asked for")]
    Requested(Backend),
    /// The crate was built without the `verbs` feature.
    #[error("this build has no verbs backend (feature `verbs` off)")]
    NotBuilt,
    /// This agent has no verbs backend: starting it failed (shared by every peer, hence
    /// the `Arc`).
    #[error("this agent has no verbs backend")]
    NoBackend(#[source] std::sync::Arc<Self>),
    /// The OS random source failed (side-channel nonces must be unguessable).
    #[error("random source failed: {0}")]
    Random(getrandom::Error),
    /// The shared-memory backend cannot serve the peer.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The verbs backend cannot serve the peer.
    #[cfg(feature = "verbs")]
    #[error(transparent)]
    Verbs(#[from] VerbsLinkError),
    /// A region cannot be mirrored for verbs peers, or a mirror copy failed.
    #[cfg(feature = "verbs")]
    #[error(transparent)]
    Mirror(#[from] MirrorError),
}

impl LinkError {
    /// The error and its causes, joined with `": "` (for the log and
    /// [`Agent::peer_backend`](crate::Agent::peer_backend)).
    pub(crate) fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut cause = self.source();
        while let Some(e) = cause {
            out.push_str(": ");
            out.push_str(&e.to_string());
            cause = e.source();
        }
        out
    }
}

/// Why the target refused one read or write op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Our connection has not completed the (authenticated) handshake.
    Unauthenticated,
    /// No region with that id is registered on the target.
    UnknownRegion,
    /// The key does not match the region's.
    BadKey,
    /// The range lies outside the region.
    OutOfBounds,
    /// The region's memory is not host-accessible (TCP cannot serve device memory).
    NotHostAccessible,
    /// The op is longer than the target's limit.
    TooLong,
    /// A write's fence word did not hold the write's generation when its bytes arrived:
    /// nothing of the write landed.
    Stale,
    /// A pulled write's source could not be read from the writer's process (the kernel
    /// refused cross-memory attach, or the range was not mapped there): the writer sends
    /// the write's bytes itself instead. Destination bytes of the write are unspecified.
    SourceUnreadable,
    /// A code this build does not know.
    Other(u8),
}

impl Refusal {
    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Unauthenticated => 1,
            Self::UnknownRegion => 2,
            Self::BadKey => 3,
            Self::OutOfBounds => 4,
            Self::NotHostAccessible => 5,
            Self::TooLong => 6,
            Self::Stale => 7,
            Self::SourceUnreadable => 8,
            Self::Other(c) => c,
        }
    }

    pub(crate) fn from_code(code: u8) -> Self {
        match code {
            1 => Self::Unauthenticated,
            2 => Self::UnknownRegion,
            3 => Self::BadKey,
            4 => Self::OutOfBounds,
            5 => Self::NotHostAccessible,
            6 => Self::TooLong,
            7 => Self::Stale,
            8 => Self::SourceUnreadable,
            c => Self::Other(c),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unauthenticated => f.write_str("unauthenticated"),
            Self::UnknownRegion => f.write_str("unknown region"),
            Self::BadKey => f.write_str("wrong region key"),
            Self::OutOfBounds => f.write_str("range outside the region"),
            Self::NotHostAccessible => f.write_str("region not host-accessible"),
            Self::TooLong => f.write_str("op longer than the target's limit"),
            Self::Stale => f.write_str("write fence no longer holds the write's generation"),
            Self::SourceUnreadable => {
                f.write_str("the writer's memory could not be read (cross-memory attach)")
            }
            Self::Other(c) => write!(f, "refusal code {c}"),
        }
    }
}

/// Why a read batch (or posting it) failed. Every variant names the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// No such peer.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// No such batch (never posted, or already reported Done/Failed).
    #[error("unknown batch {0:?}")]
    UnknownBatch(BatchId),
    /// The batch is invalid before anything is sent (empty, too many ops, bad local range).
    #[error("invalid batch for peer {peer}: {reason}")]
    InvalidBatch {
        /// Peer name.
        peer: String,
        /// What is wrong.
        reason: String,
    },
    /// A local destination range is unusable.
    #[error("local range for peer {peer} refused")]
    Local {
        /// Peer name.
        peer: String,
        /// Why.
        #[source]
        source: RegionAccessError,
    },
    /// The target refused a read op.
    #[error("peer {peer} refused a read of region {region} [{offset}+{len}]: {reason}")]
    Refused {
        /// Peer name.
        peer: String,
        /// Remote region id.
        region: u64,
        /// Remote offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: Refusal,
    },
    /// Every connection to the peer is gone (or it closed mid-batch).
    #[error("peer {peer} disconnected: {reason}")]
    Disconnected {
        /// Peer name.
        peer: String,
        /// What the connection saw.
        reason: String,
    },
    /// The batch did not complete within the caller's timeout (peer stalled).
    #[error("batch to peer {peer} timed out after {timeout:?}")]
    Timeout {
        /// Peer name.
        peer: String,
        /// The timeout the caller gave.
        timeout: std::time::Duration,
    },
    /// The fence word read after all data differs from the expected generation: the
    /// data read may come from released or reused blocks and must not be used.
    #[error("fence mismatch on peer {peer}: expected generation {expected}, found {found}")]
    FenceMismatch {
        /// Peer name.
        peer: String,
        /// The generation the reader was given.
        expected: u64,
        /// The word found after the data reads.
        found: u64,
    },
    /// The peer refused a write because its write fence no longer held the batch's
    /// generation when the write's bytes arrived (D released or reused the blocks): no
    /// byte of that write landed, and none of the batch's later writes will.
    #[error(
        "peer {peer} refused a write into region {region} [{offset}+{len}]: fence no longer \
         holds generation {expected}"
    )]
    Stale {
        /// Peer name.
        peer: String,
        /// Remote (destination) region id.
        region: u64,
        /// Remote offset.
        offset: u64,
        /// Length.
        len: u64,
        /// The generation the write carried.
        expected: u64,
    },
    /// The notification is larger than the limit.
    #[error("notification of {len} bytes exceeds the limit of {max} bytes (peer {peer})")]
    NotifTooLarge {
        /// Peer name.
        peer: String,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The peer on the same host left its shared-memory notification ring full for about
    /// 10 ms (it has not called `get_new_notifs`): the notification was not sent (a
    /// batch's notification: the batch failed).
    #[error(
        "peer {peer} left its notification ring ({capacity} bytes) full; notification of {len} bytes not sent"
    )]
    NotifRingFull {
        /// Peer name.
        peer: String,
        /// The notification's length.
        len: usize,
        /// The ring's capacity in bytes.
        capacity: usize,
    },
    /// The peer has not read the notifications already sent to it: the socket is full
    /// and the link's queue (`limits.max_queued_notif_bytes`) has no room for this one.
    /// Nothing of it was sent; the queue drains as the peer polls, and is written on by
    /// this agent's next `send_notif` or `get_new_notifs` to that peer's link. For a
    /// batch's notification, the batch fails with this error (its reads completed).
    #[error(
        "notification to peer {peer} not sent: {queued} bytes already wait for it \
         (limit {max}); the peer is not polling"
    )]
    NotifQueueFull {
        /// Peer name.
        peer: String,
        /// Bytes waiting in the queue.
        queued: usize,
        /// The limit.
        max: usize,
    },
    /// The reads completed into a host mirror of a local destination (memory verbs can
    /// register only through a mirror), and copying them on into the destination failed;
    /// the destination bytes are unspecified.
    #[error("copying the bytes read from peer {peer} out of the verbs mirror failed: {reason}")]
    LocalCopy {
        /// Peer name.
        peer: String,
        /// What the copy said.
        reason: String,
    },
    /// The backend cannot do this (e.g. a verbs peer without the feature).
    #[error("backend of peer {peer} cannot do this: {reason}")]
    Unsupported {
        /// Peer name.
        peer: String,
        /// Why.
        reason: String,
    },
}
