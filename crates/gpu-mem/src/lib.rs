//! The KV block pool of kvlease: one contiguous allocation of `num_blocks` KV blocks in
//! host, CUDA pinned or CUDA device memory, a free-list allocator of block ids, and the
//! [`DmaRegion`] seam through which the transport registers that memory.
//!
//! - [`DmaRegion`] + [`RegionBytes`]: the memory contract and its safe, bounds-checked
//!   byte accessors (with the DMA-like aliasing model documented on [`RegionBytes`]).
//! - [`HostRegion`]: one page-aligned shared mapping of a sealed memfd, huge pages tried
//!   first; [`SharedRegionView`]: another process's read-only mapping of it, and
//!   [`send_with_fds`] / [`recv_with_fds`] to hand its descriptor over a Unix socket;
//!   [`PeerProcessRange`]: host memory of another process on this host that is not
//!   memfd-backed, read with cross-memory attach (`process_vm_readv`), with
//!   [`set_ptracer`] and [`socket_peer_pid`] for the permission the kernel asks.
//! - [`RingReader`] / [`RingWriter`]: a bounded single-producer, single-consumer ring of
//!   byte records in a sealed memfd shared by two processes, each end distrusting the
//!   other (the transport's same-host notifications).
//! - [`ForeignRegion`]: memory another runtime owns (a Python buffer, a torch tensor),
//!   kept alive by an owner value the region holds.
//! - [`KvLayout`]: byte offsets of (layer, block) and of head sub-ranges of K or V.
//! - [`BlockPool`]: a layout over one region, allocated as a [`MemoryRequest`] asks
//!   (CUDA kinds behind the `cuda` feature); [`FenceTable`]: the generation words.
//! - [`BlockAllocator`]: the free list of [`BlockId`](kvlease_lease::BlockId)s.
//! - `cuda::ipc` (behind the `cuda` feature): CUDA IPC between two processes on one host:
//!   export a device region as an `IpcHandle`, open a peer's handle as an `IpcMapping`
//!   and copy bounds-checked ranges out of it into host or device memory. Its GPU test
//!   (`tests/cuda.rs`, `#[ignore]`d; `scripts/gpu-check.sh` runs it) passed on one H200.
//!
//! This crate does not move data between hosts (that is `kvlease-transport`), starts no
//! threads and reads no clock.
#![deny(unsafe_code)]
#![warn(missing_docs)]

// `unsafe` is allowed only in the modules that own raw memory: `region` (the DmaRegion
// contract, its bounds-checked byte accessors and socket IO), `host` (memfd, mmap,
// passing a memfd over a Unix socket, and `process_vm_readv`), `ring` (atomics and copies on a ring shared with
// another process), `foreign` (memory owned by another language's runtime) and `cuda`
// with its `cuda::ipc` (cudarc).
#[allow(unsafe_code)]
mod region;

#[allow(unsafe_code)]
mod host;

#[allow(unsafe_code)]
mod foreign;

#[allow(unsafe_code)]
mod ring;

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;
pub mod staging;

mod layout;
mod pool;
mod request;

pub use foreign::{ForeignRegion, ForeignRegionError};
pub use host::{
    CmaError, CmaRead, HUGE_PAGE_SIZE, HostAllocError, HostRegion, HugePagePolicy, MAX_CMA_IOVECS,
    MAX_FDS_PER_MESSAGE, MAX_HOST_REGION, PageKind, PeerProcessRange, PeerRangeError, Ptracer,
    ShareError, SharedRegionView, StagedHostRegion, read_vectored, recv_with_fds, send_with_fds,
    set_ptracer, socket_peer_pid, yama_ptrace_scope,
};
/// The free list of block ids lives in the sans-IO `kvlease-lease` crate (the engine cores
/// allocate blocks); re-exported here where the pools are.
pub use kvlease_lease::{AllocError, BlockAllocator};
pub use layout::{KvHalf, KvLayout, LayoutError, MAX_POOL_BYTES};
pub use pool::{BlockCopyError, BlockPool, FenceTable, PoolError};
pub use region::{DmaRegion, MemoryKind, RegionAccessError, RegionBytes};
pub use request::MemoryRequest;
pub use ring::{
    MAX_RING_CAPACITY, MIN_RING_CAPACITY, PushError, RING_HEADER_LEN, RING_RECORD_HEADER,
    RingCorrupt, RingError, RingReader, RingWriter,
};

#[cfg(test)]
mod tests {
    //! The public types cross threads (like tokio's `tests/async_send_sync.rs`): the
    //! `unsafe impl Send/Sync` live only on private pointer types (`host::Mapping`,
    //! `cuda::PinnedPtr`), so these hold only as long as those stay correct.
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        send_sync::<HostRegion>();
        send_sync::<SharedRegionView>();
        send_sync::<RingReader>();
        send_sync::<RingWriter>();
        send_sync::<RingError>();
        send_sync::<ForeignRegion>();
        send_sync::<ShareError>();
        send_sync::<PeerProcessRange>();
        send_sync::<CmaError>();
        send_sync::<StagedHostRegion>();
        send_sync::<std::sync::Arc<dyn DmaRegion>>();
        send_sync::<BlockPool>();
        send_sync::<FenceTable>();
        send_sync::<BlockAllocator>();
        send_sync::<KvLayout>();
        send_sync::<staging::StagingConfig>();
        send::<staging::Stager>();
        send::<staging::HostCopier>();
        send_sync::<HostAllocError>();
        send_sync::<RegionAccessError>();
        send_sync::<PoolError>();
        send_sync::<staging::StagingError>();
        #[cfg(feature = "cuda")]
        {
            send_sync::<cuda::CudaPinnedRegion>();
            send_sync::<cuda::CudaDeviceRegion>();
            send_sync::<cuda::DmabufHandle>();
            send::<cuda::CudaCopier>();
            send_sync::<cuda::CudaError>();
            send_sync::<cuda::ipc::IpcHandle>();
            send_sync::<cuda::ipc::IpcExport>();
            send_sync::<cuda::ipc::IpcMapping>();
            send_sync::<cuda::ipc::IpcError>();
        }
    }
}
