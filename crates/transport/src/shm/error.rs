//! Why a shared-memory link could not be made: the shm backend's part of
//! [`LinkError`](crate::LinkError).

use std::io;

/// Why the shared-memory backend cannot serve a peer (inside [`LinkError::Shm`](crate::LinkError::Shm)).
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The peer's metadata has no shared-memory entry (another build, an agent
    /// configured for TCP or verbs, or a host without `/proc`).
    #[error("the peer offers no shared memory")]
    PeerHasNoShm,
    /// This host's identity (boot id, network namespace) cannot be read from `/proc`.
    #[error("this host's identity (boot id, network namespace) is unreadable")]
    NoHostIdentity,
    /// The peer runs on another host, or in another network namespace.
    #[error("the peer is on another host (boot id or network namespace differs)")]
    NotSameHost,
    /// IO on the peer's shared-memory Unix socket failed.
    #[error("shm socket: {op} failed")]
    Socket {
        /// What was done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer's shared-memory entry or socket broke the protocol.
    #[error("shm: {what}")]
    Malformed {
        /// What was wrong.
        what: &'static str,
    },
    /// The peer refused our proof of the cluster token on its shared-memory socket (we
    /// have none, or another one).
    #[error(
        "the peer's shm socket rejected our authentication (cluster token mismatch or missing)"
    )]
    AuthRejected,
    /// The peer could not prove the cluster token on its shared-memory socket.
    #[error("the peer's shm socket failed to prove the cluster token")]
    PeerAuthFailed,
    /// A region the peer handed over cannot be mapped.
    #[error("mapping the peer's shared region {region} failed")]
    Map {
        /// The peer's region id.
        region: u64,
        /// Why.
        #[source]
        source: kvlease_gpu_mem::ShareError,
    },
    /// A CUDA device region the peer handed over is refused: its IPC handle is malformed,
    /// or claims more memory than the allocation the driver mapped for it. (A handle that
    /// cannot be opened here at all, for want of a driver or of the device, is not an
    /// error: that region is read over TCP.)
    #[cfg(feature = "cuda")]
    #[error("the peer's CUDA IPC entry for region {region} is refused")]
    CudaRegion {
        /// The peer's region id.
        region: u64,
        /// Why.
        #[source]
        source: kvlease_gpu_mem::cuda::ipc::IpcError,
    },
    /// The notification ring the peer handed over cannot be mapped.
    #[error("mapping the peer's notification ring failed")]
    Ring {
        /// Why.
        #[source]
        source: kvlease_gpu_mem::RingError,
    },
}
