//! The KV block pool of kvlease: one contiguous allocation of `num_blocks` KV blocks in
//! host, CUDA pinned or CUDA device memory, a free-list allocator of block ids, and the
//! [`DmaRegion`] seam through which the transport registers that memory.
//!
//! This crate does not move data between hosts (that is `kvlease-transport`), starts no
//! threads and reads no clock.
#![deny(unsafe_code)]
#![warn(missing_docs)]

// `unsafe` is allowed only in the modules that own raw memory: `region` (the DmaRegion
// contract and its bounds-checked byte accessors), `host` (mmap) and `cuda` (cudarc).
#[allow(unsafe_code)]
mod region;

pub use region::{DmaRegion, MemoryKind, RegionAccessError};
