//! dmabuf export of CUDA device memory, for the verbs backend's `ibv_reg_dmabuf_mr`.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::{DriverError, sys};

use super::{CudaError, context, device_ordinal, driver};
use crate::region::DmaRegion;

/// A dmabuf file descriptor for device memory, for `ibv_reg_dmabuf_mr(pd, offset, len,
/// iova, fd, access)`.
///
/// The handle keeps the region alive (it holds an `Arc` of it) so the fd never refers to
/// freed memory; keep the handle (or the region) alive as long as a memory region
/// registered from the fd is in use. The fd is closed on drop.
#[derive(Debug)]
pub struct DmabufHandle {
    /// The dmabuf file descriptor (closed on drop, before the region is let go).
    pub fd: OwnedFd,
    /// Offset of the region's first byte inside the dmabuf.
    pub offset: u64,
    /// The region's length (the dmabuf may be larger: it covers whole pages).
    pub len: u64,
    _region: Arc<dyn DmaRegion>,
}

fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096).max(1)
}

/// Exports CUDA device memory as a dmabuf through `cuMemGetHandleForAddressRange`, where
/// the device reports `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (the verbs backend then
/// registers it with `ibv_reg_dmabuf_mr`). Where it does not, the caller stages through
/// pinned buffers instead ([`CudaCopier`](super::CudaCopier) and [`staging`](crate::staging)).
///
/// The exported range is the region rounded out to host pages; [`CudaDeviceRegion`](super::CudaDeviceRegion)
/// allocations are page aligned and padded, so that range is theirs.
///
/// # Errors
/// [`CudaError::DmabufUnsupported`] (device attribute false, the driver answers
/// `CUDA_ERROR_NOT_SUPPORTED`, or the region is not page aligned), [`CudaError::NotDeviceMemory`], [`CudaError::NoDriver`],
/// [`CudaError::Driver`] (the driver refused the export).
pub fn export_dmabuf(region: &Arc<dyn DmaRegion>) -> Result<DmabufHandle, CudaError> {
    let ordinal = device_ordinal(region.as_ref())?;
    let ctx = context(ordinal)?;
    let supported = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
        .map_err(driver("cuDeviceGetAttribute"))?;
    if supported == 0 {
        return Err(CudaError::DmabufUnsupported {
            ordinal,
            why: "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0",
        });
    }
    let page = host_page_size();
    let start = region.base_ptr().addr();
    if !start.is_multiple_of(page) {
        return Err(CudaError::DmabufUnsupported {
            ordinal,
            why: "the region does not start on a host page",
        });
    }
    let size = region.len().next_multiple_of(page);
    let mut fd: libc::c_int = -1;
    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
    // SAFETY: `fd` is a live c_int, which is what the driver writes for
    // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD; the range is page aligned and lies inside the
    // region's allocation (DmaRegion contract; our allocations are padded to 2 MiB), which
    // `region` keeps alive during the call.
    let exported = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&raw mut fd).cast(),
            start as sys::CUdeviceptr,
            size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    match exported.result() {
        Ok(()) => {}
        // The attribute can be true where the kernel side is missing (no open kernel
        // modules, a sandboxed kernel): the same answer as an unsupported device.
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)) => {
            return Err(CudaError::DmabufUnsupported {
                ordinal,
                why: "the driver refused the export with CUDA_ERROR_NOT_SUPPORTED",
            });
        }
        Err(source) => {
            return Err(CudaError::Driver {
                call: "cuMemGetHandleForAddressRange",
                source,
            });
        }
    }
    if fd < 0 {
        return Err(CudaError::Driver {
            call: "cuMemGetHandleForAddressRange",
            source: DriverError(sys::CUresult::CUDA_ERROR_INVALID_HANDLE),
        });
    }
    // SAFETY: the driver just opened `fd` for this call and hands its ownership to us;
    // nothing else closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmabufHandle {
        fd,
        offset: 0,
        len: region.len() as u64,
        _region: Arc::clone(region),
    })
}
