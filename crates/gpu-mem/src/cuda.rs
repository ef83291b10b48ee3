//! CUDA memory kinds through cudarc: pinned host memory ([`CudaPinnedRegion`]) and device
//! memory ([`CudaDeviceRegion`]), synchronous copies between host and device
//! ([`copy_htod`], [`copy_dtoh`]), dmabuf export for verbs ([`export_dmabuf`]), the
//! staging copier for TCP ([`CudaCopier`]), the `--memory auto` decision
//! ([`choose_auto`]), and CUDA IPC between processes on one host ([`ipc`]: export a
//! device region as a handle, open a peer's handle and copy out of it).
//!
//! # No driver, no panic
//! cudarc loads `libcuda` at run time and panics when it is missing. Every entry point here
//! first checks [`driver_present`] (cached for the process) and returns
//! [`CudaError::NoDriver`] instead; [`probe`] reports what exists without failing.
//!
//! # Contexts
//! Every region and copier holds the *primary context* of its device (retained through
//! [`CudaContext::new`], released when the last holder is gone), so the context outlives
//! the memory allocated in it. Every driver call binds that context to the calling thread
//! first, so any thread may use the values. Pinned memory is allocated
//! `CU_MEMHOSTALLOC_PORTABLE`, so it is pinned for every context; device pointers are
//! unified addresses, so copies find their device from the pointer.
//!
//! # Content and verification
//! P fills device blocks with the same bytes as host blocks: it generates each block on
//! the host with the same generator it uses for host pools and copies it in with
//! [`copy_htod`]. D verifies device blocks by copying them back to the host with
//! [`copy_dtoh`] (or receiving them through the staging pipeline, which leaves a host
//! copy of every chunk) and digesting the host bytes, so digests match across memory
//! kinds. No kernel is involved.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::region::{DmaRegion, MemoryKind, RegionAccessError};
use crate::request::MemoryRequest;
use crate::staging::{self, SlotError};

mod copier;
mod dmabuf;
pub mod ipc;

pub use copier::CudaCopier;
pub use dmabuf::{DmabufHandle, export_dmabuf};

/// Device allocations are rounded up to this many bytes, so that the page-aligned range a
/// dmabuf export needs lies inside the allocation (2 MiB covers every host page size and
/// is the GPU's large-page size).
pub const DEVICE_ALLOC_GRANULE: usize = 2 << 20;

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded (install the NVIDIA driver, or use host memory)"
    )]
    NoDriver,
    /// The driver loaded but cannot be used (cuInit failed, or it reports no device).
    #[error("the CUDA driver is present but unusable: {reason}")]
    Unusable {
        /// What the driver said.
        reason: String,
    },
    /// A driver call failed.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// There is no device with this ordinal.
    #[error("CUDA device {ordinal} does not exist: the driver reports {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices the driver reports.
        count: u32,
    },
    /// The requested size does not fit in this address space.
    #[error("a CUDA allocation of {bytes} bytes (before rounding) is too large")]
    TooLarge {
        /// The size asked for (for staging: chunk length; see the message's context).
        bytes: usize,
    },
    /// A CUDA allocation of 0 bytes was requested (the driver refuses those).
    #[error("a CUDA allocation of 0 bytes was requested")]
    ZeroLength,
    /// The operation needs CUDA device memory.
    #[error("{kind} memory is not CUDA device memory")]
    NotDeviceMemory {
        /// The region's kind.
        kind: MemoryKind,
    },
    /// [`MemoryRequest::Host`] was passed to [`alloc`].
    #[error("{request:?} is not a CUDA memory request")]
    NotCudaRequest {
        /// The request.
        request: MemoryRequest,
    },
    /// The range lies outside the region.
    #[error(transparent)]
    Range(#[from] RegionAccessError),
    /// A staging copier refused a slot operation.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// The device cannot export this memory as a dmabuf.
    #[error(
        "CUDA device {ordinal} cannot export device memory as a dmabuf ({why}); stage it through pinned buffers instead"
    )]
    DmabufUnsupported {
        /// The device.
        ordinal: u32,
        /// Why not.
        why: &'static str,
    },
    /// [`CudaCopier::set_region`] was given memory of another device.
    #[error("the copier's stream belongs to device {copier}, the region to device {region}")]
    OtherDevice {
        /// The copier's device.
        copier: u32,
        /// The region's device.
        region: u32,
    },
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { call, source }
}

/// Whether `libcuda` can be loaded (checked once per process).
///
/// Nothing else in this module touches cudarc before this returned `true`.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` dlopens libcuda (running its initialisers) and closes
        // it again. libcuda is the NVIDIA driver's library, made to be loaded this way
        // (cudarc loads it the same way for every call), and nothing from it is kept.
        unsafe { sys::is_culib_present() }
    })
}

fn ensure_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

fn device_count() -> Result<u32, CudaError> {
    ensure_driver()?;
    result::init().map_err(|err| CudaError::Unusable {
        reason: format!("cuInit failed: {err}"),
    })?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// The primary context of device `ordinal`, bound to the calling thread.
///
/// Contexts are shared while someone holds them (a cache of weak handles), so that
/// cuInit and the retain happen once per device rather than once per call.
fn context(ordinal: u32) -> Result<Arc<CudaContext>, CudaError> {
    static CONTEXTS: Mutex<Vec<Weak<CudaContext>>> = Mutex::new(Vec::new());
    ensure_driver()?;
    let index = ordinal as usize;
    // The cache holds only weak handles, so a panic elsewhere cannot leave it inconsistent.
    let mut cache = CONTEXTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(ctx) = cache.get(index).and_then(Weak::upgrade) {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        return Ok(ctx);
    }
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let ctx = CudaContext::new(index).map_err(driver("cuDevicePrimaryCtxRetain"))?;
    if cache.len() <= index {
        cache.resize(index + 1, Weak::new());
    }
    cache[index] = Arc::downgrade(&ctx);
    Ok(ctx)
}

/// The device ordinal of CUDA device memory.
fn device_ordinal(region: &dyn DmaRegion) -> Result<u32, CudaError> {
    match region.kind() {
        MemoryKind::CudaDevice { ordinal } => Ok(ordinal),
        kind => Err(CudaError::NotDeviceMemory { kind }),
    }
}

/// The device address `offset` bytes into `region` (device memory's `base_ptr` is a
/// `CUdeviceptr`, never dereferenced).
fn device_address(region: &dyn DmaRegion, offset: usize) -> sys::CUdeviceptr {
    (region.base_ptr().addr() + offset) as sys::CUdeviceptr
}

static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// How many driver calls failed inside `Drop` (a free, a stream sync) since the process
/// started. Each one was also logged with `tracing::error!`.
pub fn drop_errors() -> u64 {
    DROP_ERRORS.load(Ordering::Relaxed)
}

/// Drop never panics in release builds: log, count, and assert only in debug builds.
fn report_drop(call: &'static str, result: Result<(), DriverError>) {
    if let Err(err) = &result {
        DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
        tracing::error!(call, error = %err, "CUDA call failed while dropping");
    }
    debug_assert!(result.is_ok(), "{call} failed in Drop: {result:?}");
}

/// What the CUDA driver offers on this machine ([`probe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaAvailability {
    /// `libcuda` could not be loaded.
    NoDriver,
    /// The driver loaded but is unusable (cuInit failed, or no device).
    Unusable {
        /// What went wrong.
        reason: String,
    },
    /// The driver works and reports at least one device.
    Available {
        /// `cuDriverGetVersion`, e.g. 12080 for CUDA 12.8.
        driver_version: i32,
        /// The devices, in ordinal order (never empty).
        devices: Vec<CudaDeviceInfo>,
    },
}

/// One CUDA device as [`probe`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The device ordinal.
    pub ordinal: u32,
    /// The device's name, e.g. "NVIDIA H200".
    pub name: String,
    /// Device memory in bytes.
    pub total_bytes: usize,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: whether [`export_dmabuf`] can work.
    pub dmabuf_supported: bool,
}

/// Reports whether a driver exists, its version and its devices. Never fails and never
/// panics; creates no context.
#[must_use]
pub fn probe() -> CudaAvailability {
    if !driver_present() {
        return CudaAvailability::NoDriver;
    }
    match probe_devices() {
        Ok((driver_version, devices)) if !devices.is_empty() => CudaAvailability::Available {
            driver_version,
            devices,
        },
        Ok(_) => CudaAvailability::Unusable {
            reason: "the driver reports no CUDA device".to_owned(),
        },
        Err(CudaError::Unusable { reason }) => CudaAvailability::Unusable { reason },
        Err(err) => CudaAvailability::Unusable {
            reason: err.to_string(),
        },
    }
}

fn probe_devices() -> Result<(i32, Vec<CudaDeviceInfo>), CudaError> {
    let count = device_count()?;
    let mut version = 0;
    // SAFETY: `version` is a live c_int for the driver to write; cuInit succeeded above.
    unsafe { sys::cuDriverGetVersion(&raw mut version) }
        .result()
        .map_err(driver("cuDriverGetVersion"))?;
    let mut devices = Vec::new();
    for ordinal in 0..count {
        // `ordinal < count <= i32::MAX` (count came from a c_int).
        let dev = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
        // SAFETY: `dev` was returned by cuDeviceGet above.
        let total_bytes =
            unsafe { result::device::total_mem(dev) }.map_err(driver("cuDeviceTotalMem"))?;
        let dmabuf = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED;
        // SAFETY: `dev` was returned by cuDeviceGet above.
        let dmabuf = unsafe { result::device::get_attribute(dev, dmabuf) }
            .map_err(driver("cuDeviceGetAttribute"))?;
        devices.push(CudaDeviceInfo {
            ordinal,
            name,
            total_bytes,
            dmabuf_supported: dmabuf != 0,
        });
    }
    Ok((version, devices))
}

/// The outcome of `--memory auto` ([`choose_auto`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoChoice {
    /// The memory to use: `CudaDevice` where a GPU works, else `Host`.
    pub kind: MemoryKind,
    /// Why, in words (for the log and the agent's startup line).
    pub reason: String,
}

/// Decides `--memory auto` for TP rank `rank`: CUDA device memory on device
/// `rank % device_count` where the driver works, else host memory. Logs the choice and
/// why at `info`.
#[must_use]
pub fn choose_auto(rank: u32) -> AutoChoice {
    let host = |reason: String| AutoChoice {
        kind: MemoryKind::Host,
        reason,
    };
    let choice = match probe() {
        CudaAvailability::NoDriver => {
            host("no CUDA driver (libcuda.so could not be loaded)".to_owned())
        }
        CudaAvailability::Unusable { reason } => host(format!("CUDA is unusable: {reason}")),
        CudaAvailability::Available {
            driver_version,
            devices,
        } => {
            let count = devices.len();
            match devices.get(rank as usize % count.max(1)) {
                Some(device) => AutoChoice {
                    kind: MemoryKind::CudaDevice {
                        ordinal: device.ordinal,
                    },
                    reason: format!(
                        "CUDA driver {}.{} with {count} device(s): rank {rank} uses device {} ({}, {} MiB)",
                        driver_version / 1000,
                        driver_version % 1000 / 10,
                        device.ordinal,
                        device.name,
                        device.total_bytes >> 20,
                    ),
                },
                None => host("the driver reports no CUDA device".to_owned()),
            }
        }
    };
    tracing::info!(memory = %choice.kind, reason = %choice.reason, "--memory auto");
    choice
}

/// Allocates `bytes` of CUDA memory as `request` asks: the seam [`BlockPool::new`]
/// calls (`Pinned`, `Cuda { ordinal }`, or `Auto`, which takes [`choose_auto`]`(0)`).
///
/// [`BlockPool::new`]: crate::BlockPool::new
///
/// # Errors
/// For `Auto` without a usable GPU: [`CudaError::NoDriver`] or [`CudaError::Unusable`],
/// whose message says why (the pool then falls back to host memory). Otherwise as
/// [`CudaPinnedRegion::new`] / [`CudaDeviceRegion::new`];
/// [`CudaError::NotCudaRequest`] for `Host`.
pub fn alloc(request: MemoryRequest, bytes: usize) -> Result<Arc<dyn DmaRegion>, CudaError> {
    match request {
        MemoryRequest::Pinned => Ok(Arc::new(CudaPinnedRegion::new(0, bytes)?)),
        MemoryRequest::Cuda { ordinal } => Ok(Arc::new(CudaDeviceRegion::new(ordinal, bytes)?)),
        MemoryRequest::Auto => {
            let choice = choose_auto(0);
            match choice.kind {
                MemoryKind::CudaDevice { ordinal } => {
                    Ok(Arc::new(CudaDeviceRegion::new(ordinal, bytes)?))
                }
                _ if !driver_present() => Err(CudaError::NoDriver),
                _ => Err(CudaError::Unusable {
                    reason: choice.reason,
                }),
            }
        }
        _ => Err(CudaError::NotCudaRequest { request }),
    }
}

/// A pinned host pointer owned by a [`CudaPinnedRegion`].
#[derive(Debug)]
struct PinnedPtr(NonNull<u8>);

// SAFETY: the pointer is the start of a portable pinned allocation owned by exactly one
// region; host memory may be accessed from any thread, and the region's users follow the
// DmaRegion aliasing rules, not Rust references through this pointer.
unsafe impl Send for PinnedPtr {}
// SAFETY: as for Send: shared access only hands out the address.
unsafe impl Sync for PinnedPtr {}

/// CUDA pinned host memory: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE` (not
/// write-combined, because the CPU reads it), zeroed, freed on drop.
#[derive(Debug)]
pub struct CudaPinnedRegion {
    ptr: PinnedPtr,
    len: usize,
    // Dropped after `Drop::drop` freed the memory: the context must outlive it.
    ctx: Arc<CudaContext>,
}

impl CudaPinnedRegion {
    /// Allocates `len` zeroed bytes of pinned memory in the primary context of device
    /// `ordinal` (portable: usable with every context).
    ///
    /// # Errors
    /// [`CudaError::NoDriver`], [`CudaError::NoSuchDevice`], [`CudaError::ZeroLength`],
    /// [`CudaError::Driver`] (e.g. out of memory).
    pub fn new(ordinal: u32, len: usize) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(CudaError::ZeroLength);
        }
        let ctx = context(ordinal)?;
        // SAFETY: a context is current on this thread (`context` bound it). The memory is
        // uninitialised; it is zeroed below before anything reads it.
        let raw = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver("cuMemHostAlloc"))?;
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
            return Err(CudaError::Driver {
                call: "cuMemHostAlloc",
                source: DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            });
        };
        let region = Self {
            ptr: PinnedPtr(ptr),
            len,
            ctx,
        };
        // SAFETY: `ptr .. ptr + len` is the allocation just made, writable, and not yet
        // shared with anyone.
        unsafe { ptr.as_ptr().write_bytes(0, len) };
        Ok(region)
    }
}

impl Drop for CudaPinnedRegion {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: the pointer came from cuMemHostAlloc and is freed only here; the
            // region is being dropped, so no holder of it (a registration, a copier) is
            // left to use the memory.
            unsafe { result::free_host(self.ptr.0.as_ptr().cast()) }
        });
        report_drop("cuMemFreeHost", freed);
    }
}

// SAFETY: `ptr .. ptr + len` is one cuMemHostAlloc allocation owned by the region, freed
// only in Drop, never moved or resized; it is host memory, pinned and portable, that any
// thread may read and write through raw pointers.
unsafe impl DmaRegion for CudaPinnedRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.0.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::CudaPinned
    }
}

/// CUDA device memory: `cuMemAlloc` (not the stream-ordered pool), zeroed, freed on drop.
///
/// Its [`base_ptr`](DmaRegion::base_ptr) is the `CUdeviceptr`, never dereferenced on the
/// host: move bytes with [`copy_htod`] / [`copy_dtoh`] or a [`CudaCopier`].
#[derive(Debug)]
pub struct CudaDeviceRegion {
    dptr: sys::CUdeviceptr,
    len: usize,
    ordinal: u32,
    // Dropped after `Drop::drop` freed the memory: the context must outlive it.
    ctx: Arc<CudaContext>,
}

impl CudaDeviceRegion {
    /// Allocates `len` zeroed bytes on device `ordinal` (rounded up internally to
    /// [`DEVICE_ALLOC_GRANULE`]).
    ///
    /// # Errors
    /// [`CudaError::NoDriver`], [`CudaError::NoSuchDevice`], [`CudaError::ZeroLength`],
    /// [`CudaError::Driver`] (e.g. out of memory).
    pub fn new(ordinal: u32, len: usize) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(CudaError::ZeroLength);
        }
        let alloc_len = len
            .checked_next_multiple_of(DEVICE_ALLOC_GRANULE)
            .ok_or(CudaError::TooLarge { bytes: len })?;
        let ctx = context(ordinal)?;
        // SAFETY: a context is current on this thread (`context` bound it). The memory is
        // uninitialised; it is zeroed below before anything reads it.
        let dptr = unsafe { result::malloc_sync(alloc_len) }.map_err(driver("cuMemAlloc"))?;
        // From here on Drop frees the allocation, also on the error path below.
        let region = Self {
            dptr,
            len,
            ordinal,
            ctx,
        };
        // SAFETY: `dptr .. dptr + alloc_len` is the allocation just made, not yet shared.
        unsafe { result::memset_d8_sync(dptr, 0, alloc_len) }.map_err(driver("cuMemsetD8"))?;
        sync_legacy_stream()?;
        Ok(region)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

impl Drop for CudaDeviceRegion {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `dptr` came from cuMemAlloc and is freed only here; the region is
            // being dropped, so no holder (a registration, a copier, whose copies are
            // synchronised before it lets go) is left to use it. cuMemFree waits for
            // outstanding work on the memory.
            unsafe { result::free_sync(self.dptr) }
        });
        report_drop("cuMemFree", freed);
    }
}

// SAFETY: `dptr .. dptr + len` lies inside one cuMemAlloc allocation (of `len` rounded up
// to DEVICE_ALLOC_GRANULE) owned by the region, freed only in Drop, never moved or resized; `base_ptr` is
// that device address, and this crate never dereferences device memory on the host.
unsafe impl DmaRegion for CudaDeviceRegion {
    fn base_ptr(&self) -> *mut u8 {
        std::ptr::without_provenance_mut(self.dptr as usize)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::CudaDevice {
            ordinal: self.ordinal,
        }
    }
}

/// Copies `src` into device memory at `offset` of `region`; returns when the bytes are
/// on the device.
///
/// # Errors
/// [`CudaError::NotDeviceMemory`] when `region` is not CUDA device memory (host kinds have
/// [`RegionBytes`](crate::RegionBytes)), [`CudaError::Range`] when the range is outside,
/// [`CudaError::NoDriver`] / [`CudaError::Driver`].
pub fn copy_htod(region: &dyn DmaRegion, offset: usize, src: &[u8]) -> Result<(), CudaError> {
    let ordinal = device_ordinal(region)?;
    staging::check_range(offset, src.len(), region.len())?;
    if src.is_empty() {
        return Ok(());
    }
    let _ctx = context(ordinal)?;
    let dst = device_address(region, offset);
    // SAFETY: `dst .. dst + src.len()` lies inside the region (checked above), which the
    // DmaRegion contract keeps allocated while the borrow `region` lives; the call has
    // read `src` when it returns (pageable memory is staged by the driver).
    unsafe { result::memcpy_htod_sync(dst, src) }.map_err(driver("cuMemcpyHtoD"))?;
    sync_legacy_stream()
}

/// Waits for the legacy default stream, where the "synchronous" copy and memset calls
/// run. Those may return before the device has the bytes (a memset, or a copy from
/// pageable host memory), and work on the copiers' non-blocking streams is not ordered
/// after them, so every such call is followed by this wait.
fn sync_legacy_stream() -> Result<(), CudaError> {
    // SAFETY: the null handle names the legacy default stream, which exists in every
    // context; the caller bound the context the work was issued in.
    unsafe { result::stream::synchronize(result::stream::null()) }
        .map_err(driver("cuStreamSynchronize"))
}

/// Copies `dst.len()` bytes of device memory at `offset` of `region` into `dst`; returns
/// when they are in `dst`.
///
/// # Errors
/// As [`copy_htod`].
pub fn copy_dtoh(region: &dyn DmaRegion, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
    let ordinal = device_ordinal(region)?;
    staging::check_range(offset, dst.len(), region.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    let _ctx = context(ordinal)?;
    let src = device_address(region, offset);
    // SAFETY: `src .. src + dst.len()` lies inside the region (checked above), which the
    // DmaRegion contract keeps allocated while the borrow `region` lives; the copy is
    // synchronous, so `dst` is only written during the call.
    unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(driver("cuMemcpyDtoH"))
}

#[cfg(test)]
mod tests;
