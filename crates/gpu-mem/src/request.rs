//! What memory a caller asks for: the request that both the pool and the CUDA allocator
//! read, kept apart from both so that neither imports the other for it.

/// Which memory a [`BlockPool`](crate::BlockPool) should live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryRequest {
    /// Page-aligned host memory (mmap, huge pages tried).
    Host,
    /// CUDA pinned host memory (needs the `cuda` feature and a CUDA driver).
    Pinned,
    /// CUDA device memory on device `ordinal` (needs the `cuda` feature and a GPU).
    Cuda {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
    /// The best CUDA kind available; host memory, with a log line, where CUDA is not.
    Auto,
    /// Host memory that the transport stages as if it were device memory
    /// ([`MemoryKind::StagedHost`](crate::MemoryKind::StagedHost), [`StagedHostRegion`](crate::StagedHostRegion)): runs the
    /// device paths (staged fill, pipelined TCP staging, copy-back verify) without a GPU.
    StagedHost,
}
