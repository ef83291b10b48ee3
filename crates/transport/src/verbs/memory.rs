//! Protection domains and memory registration.

use std::{alloc::Layout, fmt, io, ptr::NonNull, sync::Arc};

use kvlease_gpu_mem::{DmaRegion, MemoryKind};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::{
    MemoryRegion as RawMemoryRegion, RegisterMemoryRegionErrorKind,
};
use sideway::ibverbs::protection_domain::ProtectionDomain as RawProtectionDomain;

use super::{Device, VerbsError};

/// A protection domain. Cheap to clone; memory regions and endpoints keep it alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    // Drop order: the PD (`ibv_dealloc_pd`) before our handle on the device; sideway's PD
    // holds its own Arc of the context, so the context closes last either way.
    pub(crate) pd: Arc<RawProtectionDomain>,
    pub(crate) device: Device,
}

impl ProtectionDomain {
    pub(crate) fn new(device: Device) -> Result<Self, VerbsError> {
        let pd = device
            .inner
            .ctx
            .alloc_pd()
            .map_err(|e| VerbsError::Device {
                device: device.inner.name.clone(),
                op: "ibv_alloc_pd",
                source: Box::new(e),
            })?;
        Ok(Self {
            inner: Arc::new(PdInner { pd, device }),
        })
    }

    /// The device this domain belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Registers a whole region for local writes (the destination of our reads) and remote
    /// reads (the source of a peer's reads). Register each pool once, not per block.
    ///
    /// Host and CUDA pinned memory go through `ibv_reg_mr`. CUDA device memory (with the
    /// `cuda` feature) is exported as a dmabuf (`cuMemGetHandleForAddressRange`, where the
    /// device reports `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`) and registered with
    /// `ibv_reg_dmabuf_mr`, its iova set to the device address so peers name it like any
    /// other region. Other kinds are refused.
    ///
    /// The returned [`MemoryRegion`] keeps `region` (and a dmabuf's fd) alive; the memory
    /// is deregistered before either is let go.
    ///
    /// # Errors
    /// [`VerbsError::UnsupportedMemory`] for memory that is neither host memory nor CUDA
    /// device memory this device and driver can register through dmabuf (the reason says
    /// which step failed); [`VerbsError::MemlockLimit`] when `ibv_reg_mr` says ENOMEM (the
    /// RLIMIT_MEMLOCK limit), [`VerbsError::Register`] otherwise.
    pub fn register(&self, region: Arc<dyn DmaRegion>) -> Result<MemoryRegion, VerbsError> {
        let kind = region.kind();
        if !kind.is_host_accessible() {
            return self.register_device(region);
        }
        let len = region.len();
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteRead;
        // SAFETY: the DmaRegion contract makes base_ptr()..+len() one host allocation that
        // stays valid while `region` lives; the MemoryRegion built below owns `region` and
        // drops the registration (its first field) before it, so the NIC's mapping never
        // outlives the memory.
        let result = unsafe {
            self.inner
                .pd
                .reg_mr(region.base_ptr() as usize, len, access)
        };
        let mr = result.map_err(|e| self.register_error(len, e.0))?;
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                dmabuf: None,
                region,
                pd: self.clone(),
            }),
        })
    }

    /// Registers `offset..offset + len` of a host-accessible `region` for remote writes
    /// only: the access a peer's RDMA WRITE needs for the life of one reservation (the
    /// pool's own registration, [`register`](Self::register), never grants remote
    /// writes). The returned [`WriteAccess`] carries its own rkey; dropping it (or
    /// [`WriteAccess::revoke`]) deregisters the range, after which a WRITE naming that
    /// rkey fails at the writer with a remote access error and changes nothing.
    ///
    /// # Errors
    /// [`VerbsError::UnsupportedMemory`] for memory that is not host-accessible (device
    /// memory and staged memory take other paths, see `mirror`);
    /// [`VerbsError::OutOfBounds`] for a range outside the region or of zero bytes;
    /// [`VerbsError::MemlockLimit`] / [`VerbsError::Register`] as `register`.
    pub fn register_remote_write(
        &self,
        region: Arc<dyn DmaRegion>,
        offset: u64,
        len: u64,
    ) -> Result<WriteAccess, VerbsError> {
        let kind = region.kind();
        if !kind.is_host_accessible() {
            return Err(VerbsError::UnsupportedMemory {
                kind,
                why: "remote writes are granted only on host-accessible memory".into(),
            });
        }
        let region_len = region.len() as u64;
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|end| end > region_len) {
            return Err(VerbsError::OutOfBounds {
                side: "local",
                offset,
                len,
                region_len,
            });
        }
        // In bounds of a `usize`-long region, so both fit a usize.
        let (start, size) = (offset as usize, len as usize);
        let addr = region.base_ptr() as usize + start;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite;
        // SAFETY: `addr..addr + size` lies inside the region (checked above), one host
        // allocation valid while `region` lives (the DmaRegion contract); the WriteAccess
        // built below owns `region` and drops the registration (its first field) before
        // it, so the NIC's mapping never outlives the memory.
        let result = unsafe { self.inner.pd.reg_mr(addr, size, access) };
        let mr = result.map_err(|e| self.register_error(size, e.0))?;
        Ok(WriteAccess {
            mr: Some(mr),
            region,
            offset,
            len,
            _pd: self.clone(),
        })
    }

    /// Device memory: dmabuf where the CUDA driver and the RDMA provider support it.
    #[cfg(feature = "cuda")]
    fn register_device(&self, region: Arc<dyn DmaRegion>) -> Result<MemoryRegion, VerbsError> {
        use std::os::fd::AsRawFd;
        let kind = region.kind();
        if !matches!(kind, MemoryKind::CudaDevice { .. }) {
            return Err(VerbsError::UnsupportedMemory {
                kind,
                why: "not host memory, and only CUDA device memory has a dmabuf path".into(),
            });
        }
        let handle = kvlease_gpu_mem::cuda::export_dmabuf(&region).map_err(|e| {
            VerbsError::UnsupportedMemory {
                kind,
                why: format!("dmabuf export: {e}"),
            }
        })?;
        let len = region.len();
        let iova = region.base_ptr() as u64;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteRead;
        // SAFETY: `handle.fd` is a dmabuf the CUDA driver exported for this region's pages
        // (`handle.offset..+len` lies inside it, export_dmabuf's contract); the MrInner
        // built below owns both the handle (which holds the region) and the registration,
        // and drops the registration first, so neither the fd nor the device memory goes
        // away while the NIC may access it. The iova is the device address, so the
        // addresses this module computes (`base_ptr() + offset`) fall inside the MR.
        let result = unsafe {
            self.inner
                .pd
                .reg_dmabuf_mr(handle.offset, len, iova, handle.fd.as_raw_fd(), access)
        };
        let mr = result.map_err(|e| {
            let source = match e.0 {
                RegisterMemoryRegionErrorKind::Ibverbs(io) => io,
                other => io::Error::other(other.to_string()),
            };
            match source.raw_os_error() {
                // The provider (rxe, older mlx5 kernels) has no dmabuf MRs.
                Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EPROTONOSUPPORT | libc::EINVAL) => {
                    VerbsError::UnsupportedMemory {
                        kind,
                        why: format!(
                            "ibv_reg_dmabuf_mr on {}: {source}",
                            self.inner.device.inner.name
                        ),
                    }
                }
                _ => self.register_error(len, RegisterMemoryRegionErrorKind::Ibverbs(source)),
            }
        })?;
        tracing::info!(
            device = %self.inner.device.inner.name,
            %kind,
            len,
            "device memory registered through dmabuf"
        );
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                dmabuf: Some(handle),
                region,
                pd: self.clone(),
            }),
        })
    }

    /// Device memory without the `cuda` feature: no dmabuf path.
    #[cfg(not(feature = "cuda"))]
    fn register_device(&self, region: Arc<dyn DmaRegion>) -> Result<MemoryRegion, VerbsError> {
        Err(VerbsError::UnsupportedMemory {
            kind: region.kind(),
            why: "not host memory, and this build has no `cuda` feature for dmabuf".into(),
        })
    }

    fn register_error(&self, len: usize, e: RegisterMemoryRegionErrorKind) -> VerbsError {
        let device = self.inner.device.inner.name.clone();
        let source = match e {
            RegisterMemoryRegionErrorKind::Ibverbs(io) => io,
            other => io::Error::other(other.to_string()),
        };
        if source.raw_os_error() == Some(libc::ENOMEM) {
            VerbsError::MemlockLimit {
                device,
                len,
                source,
            }
        } else {
            VerbsError::Register {
                device,
                len,
                source,
            }
        }
    }

    pub(crate) fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.device.inner.name)
            .finish_non_exhaustive()
    }
}

/// A registered region. Cheap to clone; in-flight work requests hold a clone.
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

pub(crate) struct MrInner {
    // Drop order matters: the registration (`ibv_dereg_mr`) first, then the dmabuf fd,
    // then the memory, then the protection domain.
    pub(crate) mr: Arc<RawMemoryRegion>,
    /// The dmabuf a device-memory registration was made from (its fd closes after the
    /// deregistration above).
    #[cfg(feature = "cuda")]
    pub(crate) dmabuf: Option<kvlease_gpu_mem::cuda::DmabufHandle>,
    #[cfg(not(feature = "cuda"))]
    pub(crate) dmabuf: Option<std::convert::Infallible>,
    pub(crate) region: Arc<dyn DmaRegion>,
    pub(crate) pd: ProtectionDomain,
}

impl MemoryRegion {
    /// The key a peer names in its reads of this region.
    pub fn rkey(&self) -> u32 {
        self.inner.mr.rkey()
    }

    /// The local key.
    pub(crate) fn lkey(&self) -> u32 {
        self.inner.mr.lkey()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.region.len() as u64
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the registration was made from a dmabuf (CUDA device memory).
    pub fn is_dmabuf(&self) -> bool {
        self.inner.dmabuf.is_some()
    }

    /// The region that was registered.
    pub fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.inner.region
    }

    /// What a peer needs to read this region: its address on this host, length and rkey.
    pub fn remote(&self) -> super::RemoteRegion {
        super::RemoteRegion::new(self.inner.region.base_ptr() as u64, self.len(), self.rkey())
    }

    /// The address of `offset` for a scatter-gather entry, after a bounds check.
    pub(crate) fn sge_addr(&self, offset: u64, len: u64) -> Result<u64, VerbsError> {
        let region_len = self.len();
        if offset.checked_add(len).is_none_or(|end| end > region_len) {
            return Err(VerbsError::OutOfBounds {
                side: "local",
                offset,
                len,
                region_len,
            });
        }
        Ok(self.inner.region.base_ptr() as u64 + offset)
    }

    pub(crate) fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len())
            .field("rkey", &self.rkey())
            .field("kind", &self.inner.region.kind())
            .field("dmabuf", &self.is_dmabuf())
            .finish_non_exhaustive()
    }
}

/// Remote-write access to one range of a region, granted for one reservation (see
/// [`ProtectionDomain::register_remote_write`]). Not `Clone`: the registration is held
/// here alone, so [`revoke`](Self::revoke) (or Drop) deregisters it at once.
pub struct WriteAccess {
    // Drop order: the registration first, then the memory, then the protection domain.
    mr: Option<Arc<RawMemoryRegion>>,
    region: Arc<dyn DmaRegion>,
    offset: u64,
    len: u64,
    _pd: ProtectionDomain,
}

impl WriteAccess {
    /// The key a peer names in its RDMA WRITEs into the range.
    pub fn rkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, |mr| mr.rkey())
    }

    /// The granted range: offset in the region and length.
    pub fn range(&self) -> (u64, u64) {
        (self.offset, self.len)
    }

    /// The region the range lies in.
    pub fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.region
    }

    /// What a peer needs to write the range: its address on this host, length and rkey.
    pub fn remote(&self) -> super::RemoteRegion {
        let addr = self.region.base_ptr() as u64 + self.offset;
        super::RemoteRegion::new(addr, self.len, self.rkey())
    }

    /// Deregisters the range (`ibv_dereg_mr`). Once this returns the rkey is invalid: a
    /// WRITE naming it fails at the writer with a remote access error, and the provider
    /// no longer touches the range through it (the kernel's deregistration waits for the
    /// responder's references to the registration to drop).
    pub fn revoke(mut self) {
        self.revoke_now();
    }

    fn revoke_now(&mut self) {
        if let Some(mr) = self.mr.take() {
            // The only reference (never cloned): dropping it deregisters. sideway's Drop
            // discards ibv_dereg_mr's result; the one documented failure (EBUSY: memory
            // windows bound to the region) cannot happen, kvlease binds none.
            super::drop_guarded("ibv_dereg_mr (write access)", mr);
        }
    }
}

impl Drop for WriteAccess {
    fn drop(&mut self) {
        self.revoke_now();
    }
}

impl fmt::Debug for WriteAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteAccess")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("rkey", &self.rkey())
            .field("revoked", &self.mr.is_none())
            .finish_non_exhaustive()
    }
}

/// Page-aligned, zeroed heap memory for the endpoint's notification rings.
pub(crate) struct HeapBuffer {
    ptr: HeapPtr,
    layout: Layout,
}

/// The start of a [`HeapBuffer`]'s allocation: the one field that carries `unsafe impl
/// Send/Sync`, so the buffer gets them from its fields.
struct HeapPtr(NonNull<u8>);

// SAFETY: the pointer is the start of a heap allocation owned by exactly one `HeapBuffer`
// (like a `Box<[u8]>`), freed once in its Drop from whichever thread drops it.
unsafe impl Send for HeapPtr {}
// SAFETY: `&HeapPtr` only yields the address; the bytes are reached only through
// `HeapBuffer::read`/`write`, whose callers own the slot they touch (a slot is either
// posted to the NIC or owned by the CPU, never both).
unsafe impl Sync for HeapPtr {}

impl HeapBuffer {
    pub(crate) fn new(len: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Self {
            ptr: HeapPtr(NonNull::new(ptr)?),
            layout,
        })
    }

    /// Copies `len` bytes at `offset` out. Caller owns that range (no WR posted on it).
    pub(crate) fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.layout.size(), "slot out of range");
        let mut out = vec![0u8; len];
        let src = self.ptr.0.as_ptr().wrapping_add(offset);
        // SAFETY: `src..src+len` is in bounds (asserted), and the caller owns the range: the
        // NIC finished writing it (its receive completed) and nothing re-posted it yet.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), len) };
        out
    }

    /// Copies `data` in at `offset`. Caller owns that range (no WR posted on it).
    pub(crate) fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset + data.len() <= self.layout.size(),
            "slot out of range"
        );
        let dst = self.ptr.0.as_ptr().wrapping_add(offset);
        // SAFETY: `dst..dst+len` is in bounds (asserted); the slot is free (its last send
        // completed), so neither the NIC nor another thread accesses it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    }
}

impl Drop for HeapBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once here.
        unsafe { std::alloc::dealloc(self.ptr.0.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for HeapBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeapBuffer")
            .field("len", &self.layout.size())
            .finish()
    }
}

// SAFETY: ptr..ptr+len is one allocation owned by this value, valid until it drops, never
// moved or resized; it is host memory.
unsafe impl DmaRegion for HeapBuffer {
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}
