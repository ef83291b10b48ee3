//! The KV block pool of kvlease: one contiguous allocation of `num_blocks` KV blocks in
//! host, CUDA pinned or CUDA device memory, a free-list allocator of block ids, and the
//! [`DmaRegion`] seam through which the transport registers that memory.
//!
//! - [`DmaRegion`] + [`RegionBytes`]: the memory contract and its safe, bounds-checked
//!   byte accessors (with the DMA-like aliasing model documented on [`RegionBytes`]).
//! - [`HostRegion`]: one page-aligned anonymous mmap, huge pages tried first.
//! - [`KvLayout`]: byte offsets of (layer, block) and of head sub-ranges of K or V.
//! - [`BlockPool`]: a layout over one region, allocated as a [`MemoryRequest`] asks
//!   (CUDA kinds behind the `cuda` feature); [`FenceTable`]: the generation words.
//! - [`BlockAllocator`]: the free list of [`BlockId`](kvlease_lease::BlockId)s.
//!
//! This crate does not move data between hosts (that is `kvlease-transport`), starts no
//! threads and reads no clock.
#![deny(unsafe_code)]
#![warn(missing_docs)]

// `unsafe` is allowed only in the modules that own raw memory: `region` (the DmaRegion
// contract and its bounds-checked byte accessors), `host` (mmap) and `cuda` (cudarc).
#[allow(unsafe_code)]
mod region;

#[allow(unsafe_code)]
mod host;

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
pub mod staging;

mod layout;
mod pool;

pub use host::{
    HUGE_PAGE_SIZE, HostAllocError, HostRegion, HugePagePolicy, MAX_HOST_REGION, PageKind,
    StagedHostRegion,
};
/// The free list of block ids lives in the sans-IO `kvlease-lease` crate (the engine cores
/// allocate blocks); re-exported here where the pools are.
pub use kvlease_lease::{AllocError, BlockAllocator};
pub use layout::{KvHalf, KvLayout, LayoutError, MAX_POOL_BYTES};
pub use pool::{BlockCopyError, BlockPool, FenceTable, MemoryRequest, PoolError};
pub use region::{DmaRegion, MemoryKind, RegionAccessError, RegionBytes};
