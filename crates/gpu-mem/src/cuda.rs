//! CUDA memory kinds (owned by the CUDA work; this file is only the seam `pool.rs` calls
//! until that lands).

use std::sync::Arc;

use crate::pool::MemoryRequest;
use crate::region::DmaRegion;

/// Why a CUDA allocation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CudaError {
    /// CUDA memory kinds are not implemented in this build yet.
    #[error("CUDA memory kinds ({0:?}) are not implemented yet")]
    NotImplemented(MemoryRequest),
}

/// Allocates `bytes` of CUDA memory as `request` asks (`Pinned`, `Cuda { ordinal }` or
/// `Auto`).
///
/// # Errors
/// Always [`CudaError::NotImplemented`] until the CUDA memory kinds land.
pub(crate) fn alloc(
    request: MemoryRequest,
    _bytes: usize,
) -> Result<Arc<dyn DmaRegion>, CudaError> {
    Err(CudaError::NotImplemented(request))
}
