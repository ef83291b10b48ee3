//! The seam between memory and the transport.

use std::fmt;

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Page-aligned host memory (mmap).
    Host,
    /// CUDA pinned host memory (cuMemHostAlloc, portable, not write-combined).
    CudaPinned,
    /// CUDA device memory on the device with this ordinal (cuMemAlloc).
    CudaDevice {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
}

impl MemoryKind {
    /// Whether the CPU can load and store these bytes directly.
    pub fn is_host_accessible(self) -> bool {
        matches!(self, Self::Host | Self::CudaPinned)
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::CudaPinned => f.write_str("cuda-pinned"),
            Self::CudaDevice { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Why a region access was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionAccessError {
    /// `offset + len` lies outside the region.
    #[error("range {offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The memory is not host-accessible (device memory): stage it instead.
    #[error("{kind} memory is not host-accessible; stage it through pinned memory")]
    NotHostAccessible {
        /// The region's kind.
        kind: MemoryKind,
    },
}

/// Memory that a NIC or a transport thread may read and write while it is registered.
///
/// The bytes behave like DMA memory: a peer's RDMA READ, or the TCP backend's server
/// thread, may read them at any time while they are registered, concurrently with the
/// owner. Nothing here synchronises those accesses; the lease protocol (and the fenced
/// reads) decide which bytes are stable when.
///
/// # Safety
/// An implementor guarantees that:
/// - `base_ptr()` .. `base_ptr() + len()` is one allocation that stays valid (mapped and
///   not freed) for as long as the value lives, and neither moves nor shrinks;
/// - for [`MemoryKind::Host`] and [`MemoryKind::CudaPinned`], that range is host memory
///   that may be read and written through raw pointers from any thread;
/// - for [`MemoryKind::CudaDevice`], `base_ptr()` is the device address (a `CUdeviceptr`)
///   and is never dereferenced on the host.
pub unsafe trait DmaRegion: Send + Sync + fmt::Debug {
    /// The first byte (host address, or device address for device memory).
    fn base_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Where the bytes live.
    fn kind(&self) -> MemoryKind;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
