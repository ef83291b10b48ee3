//! A peer's region mapped into this process, and the copies out of it.

use std::sync::Arc;

use kvlease_gpu_mem::{
    CmaError, DmaRegion, MemoryKind, PeerProcessRange, RegionAccessError, SharedRegionView,
};

/// A peer's region mapped into this process.
#[derive(Debug)]
pub(super) struct MappedRegion {
    pub(super) key: u64,
    /// Its slot in the peer's grant table.
    pub(super) slot: u64,
    /// Shared with the copies under way.
    pub(super) source: Arc<Source>,
}

/// Where a mapped region's bytes are read from.
#[derive(Debug)]
pub(super) enum Source {
    /// The peer's memfd, mapped read-only: plain memory copies.
    Host(SharedRegionView),
    /// The peer's host memory that is not memfd-backed: cross-memory attach
    /// (`process_vm_readv`).
    Cma(PeerProcessRange),
    /// The peer's CUDA device memory, opened through CUDA IPC: device copies.
    #[cfg(feature = "cuda")]
    Device(kvlease_gpu_mem::cuda::ipc::IpcMapping),
}

/// Why a copy out of a mapped region failed (the ranges were checked when the batch was
/// posted, so this is the driver's or a check's last word).
#[derive(Debug, thiserror::Error)]
pub(super) enum CopyError {
    /// Out of the peer's memfd.
    #[error(transparent)]
    Host(#[from] RegionAccessError),
    /// Out of the peer's process with `process_vm_readv`.
    #[error(transparent)]
    Cma(#[from] CmaError),
    /// Out of the peer's device memory.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Device(#[from] kvlease_gpu_mem::cuda::ipc::IpcError),
}

impl Source {
    pub(super) fn len(&self) -> u64 {
        match self {
            Self::Host(view) => view.len() as u64,
            Self::Cma(range) => range.len() as u64,
            #[cfg(feature = "cuda")]
            Self::Device(mapping) => mapping.region_len() as u64,
        }
    }

    /// Whether copies from here can land in memory of `kind`.
    pub(super) fn accepts(&self, kind: MemoryKind) -> bool {
        match self {
            Self::Host(_) | Self::Cma(_) => kind.is_host_accessible(),
            #[cfg(feature = "cuda")]
            Self::Device(_) => super::cuda::accepts(kind),
        }
    }

    /// Copies `len` bytes at `offset` into `dest` at `dest_offset`.
    pub(super) fn copy_to(
        &self,
        offset: u64,
        dest: &dyn DmaRegion,
        dest_offset: u64,
        len: u64,
    ) -> Result<(), CopyError> {
        match self {
            Self::Host(view) => Ok(view.copy_to(offset, dest, dest_offset, len)?),
            Self::Cma(range) => Ok(range.copy_to(offset, dest, dest_offset, len)?),
            #[cfg(feature = "cuda")]
            Self::Device(mapping) => {
                Ok(super::cuda::copy(mapping, offset, dest, dest_offset, len)?)
            }
        }
    }
}
