//! CUDA IPC: reading another process's device memory on the same host.
//!
//! The exporter turns a device region into an [`IpcHandle`] ([`export`]): the driver's
//! 64-byte `CUipcMemHandle` of the allocation (`cuIpcGetMemHandle`), where the region lies
//! in it, its length, and the UUID and ordinal of the device. The handle travels as bytes
//! ([`IpcHandle::to_bytes`], [`IpcHandle::WIRE_LEN`] of them); the importer parses them
//! ([`IpcHandle::from_bytes`], which refuses malformed input with an
//! [`IpcHandleError`] and never panics) and opens them with [`IpcMapping::open`]
//! (`cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, in the primary
//! context of the local device with the same UUID). A mapping is read-only here: it copies
//! bounds-checked ranges into host memory (`cuMemcpyDtoH`) or into a local device region
//! (`cuMemcpyDtoD` on the same device, `cuMemcpyPeer` from another one), each copy
//! finished before the call returns, and closes the handle on drop.
//!
//! # What the importer trusts
//! The handle is peer input. A malformed one is refused by the parser; one the driver
//! does not know is refused by `cuIpcOpenMemHandle`. The importer does not trust the
//! length the peer claims: after opening, it asks the driver for the size of the mapped
//! allocation (`cuMemGetAddressRange`) and refuses a handle whose range does not fit in it
//! ([`IpcError::BeyondAllocation`]), so every copy stays inside memory the driver mapped
//! for this handle. What the peer does with its own memory meanwhile (writing it, or
//! freeing it) can make the bytes read unspecified or make a copy fail with a driver
//! error, as a NIC reading a peer's memory would; it cannot make this process write
//! outside the destination it passed. CUDA requires the exporter to keep the allocation
//! alive while importers use it: [`IpcExport`] holds the region for that reason, and a
//! protocol that hands a handle out keeps its [`IpcExport`] as long as the peer may read.
//!
//! # Limits
//! `cuIpcOpenMemHandle` fails in the exporting process itself (a second process is the
//! point), and only allocations made with `cuMemAlloc` (such as
//! [`CudaDeviceRegion`](super::CudaDeviceRegion)) can be exported; not every platform
//! supports CUDA IPC (the driver answers `CUDA_ERROR_NOT_SUPPORTED`:
//! [`IpcError::Unsupported`]). A handle may be opened by only one context per device in
//! a process, and some drivers refuse to open the same handle twice
//! (`CUDA_ERROR_ALREADY_MAPPED`): open each handle once and share the [`IpcMapping`].
//!
//! # Status
//! The wire form, the parser and the no-driver paths are tested everywhere. The driver
//! paths (export, open, the copies, close) are exercised only by
//! `ipc_export_is_read_by_another_process` in `tests/cuda.rs`, which needs a GPU and is
//! `#[ignore]`d; it has not yet been run on one.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

use super::{
    CudaError, context, device_address, device_count, device_ordinal, driver, report_drop,
};
use crate::region::{DmaRegion, MemoryKind, RegionAccessError};
use crate::staging;

/// The UUID of a CUDA device (`cuDeviceGetUuid`): the same device has the same UUID in
/// every process, whatever its ordinal there (`CUDA_VISIBLE_DEVICES` renumbers devices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceUuid(pub [u8; 16]);

impl fmt::Display for DeviceUuid {
    /// The form `nvidia-smi -L` prints: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// Why bytes are not an [`IpcHandle`] ([`IpcHandle::from_bytes`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpcHandleError {
    /// The input is not [`IpcHandle::WIRE_LEN`] bytes long.
    #[error("a CUDA IPC handle is {expected} bytes, got {got}")]
    Length {
        /// Bytes received.
        got: usize,
        /// [`IpcHandle::WIRE_LEN`].
        expected: usize,
    },
    /// The first four bytes are not the handle's magic.
    #[error("not a CUDA IPC handle (wrong magic bytes)")]
    Magic,
    /// A version this code does not know.
    #[error("CUDA IPC handle version {got} is not supported (this side knows version {known})")]
    Version {
        /// The version received.
        got: u8,
        /// The version this code writes and reads.
        known: u8,
    },
    /// A reserved byte is not zero.
    #[error("CUDA IPC handle: reserved byte {index} is {value:#04x}, not zero")]
    Reserved {
        /// The byte's index in the wire form.
        index: usize,
        /// Its value.
        value: u8,
    },
    /// The handle describes an empty range.
    #[error("CUDA IPC handle: the region is 0 bytes long")]
    ZeroLength,
    /// `offset + len` does not fit in this process's address space.
    #[error("CUDA IPC handle: range {offset}+{len} does not fit in an address")]
    TooLarge {
        /// The region's offset in its allocation.
        offset: u64,
        /// The region's length.
        len: u64,
    },
}

/// Why exporting or importing device memory through CUDA IPC failed.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// No driver, no such device, not device memory, a driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// No device of this process has the exporter's UUID (another device, or one hidden
    /// by `CUDA_VISIBLE_DEVICES`).
    #[error(
        "CUDA device {uuid} (device {exporter_ordinal} of the exporter) is not visible in this process"
    )]
    DeviceNotVisible {
        /// The exporter's device.
        uuid: DeviceUuid,
        /// Its ordinal in the exporting process.
        exporter_ordinal: u32,
    },
    /// The driver does not support CUDA IPC for this memory or on this platform.
    #[error(
        "CUDA device {ordinal}: CUDA IPC is not supported ({call} answered CUDA_ERROR_NOT_SUPPORTED)"
    )]
    Unsupported {
        /// The local device.
        ordinal: u32,
        /// The call that refused.
        call: &'static str,
    },
    /// The handle's range does not lie inside the allocation the driver mapped for it
    /// (on import: the peer claimed more than it exported; on export: the region is not
    /// inside one `cuMemAlloc` allocation).
    #[error("CUDA IPC: range {offset}+{len} lies outside the {allocation}-byte allocation")]
    BeyondAllocation {
        /// The region's offset in the allocation.
        offset: u64,
        /// The region's length.
        len: u64,
        /// The allocation's size.
        allocation: u64,
    },
    /// A copy's source range (in the mapping) or destination range lies outside.
    #[error(transparent)]
    Range(#[from] RegionAccessError),
    /// The peer's handle is malformed.
    #[error(transparent)]
    Handle(#[from] IpcHandleError),
}

/// A device region as another process can open it: the driver's IPC handle of its
/// allocation, where the region lies in that allocation, and the device it is on.
///
/// Plain data (it owns nothing): [`export`] makes one, [`to_bytes`](Self::to_bytes) /
/// [`from_bytes`](Self::from_bytes) carry it, [`IpcMapping::open`] opens it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    raw: [u8; 64],
    uuid: DeviceUuid,
    exporter_ordinal: u32,
    offset: u64,
    len: u64,
}

impl fmt::Debug for IpcHandle {
    // The raw handle is 64 opaque bytes; the rest says what it is.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("uuid", &format_args!("{}", self.uuid))
            .field("exporter_ordinal", &self.exporter_ordinal)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The wire form's first bytes.
const MAGIC: [u8; 4] = *b"KVCI";
/// The wire form's version.
const VERSION: u8 = 1;
// Byte ranges of the wire form (little-endian integers):
//   0..4 magic, 4 version, 5..8 reserved (0), 8..72 CUipcMemHandle, 72..88 device UUID,
//   88..92 exporter ordinal (u32), 92..96 reserved (0), 96..104 offset (u64),
//   104..112 length (u64).
const RAW: std::ops::Range<usize> = 8..72;
const UUID: std::ops::Range<usize> = 72..88;
const ORDINAL: std::ops::Range<usize> = 88..92;
const OFFSET: std::ops::Range<usize> = 96..104;
const LEN: std::ops::Range<usize> = 104..112;
const RESERVED: [std::ops::Range<usize>; 2] = [5..8, 92..96];

impl IpcHandle {
    /// Bytes in the wire form.
    pub const WIRE_LEN: usize = 112;

    /// The wire form: magic `KVCI`, version, the 64-byte `CUipcMemHandle`, the device
    /// UUID, the exporter's ordinal, the region's offset in its allocation and its length
    /// (little-endian), with reserved bytes zero.
    #[must_use]
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0; Self::WIRE_LEN];
        out[..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[RAW].copy_from_slice(&self.raw);
        out[UUID].copy_from_slice(&self.uuid.0);
        out[ORDINAL].copy_from_slice(&self.exporter_ordinal.to_le_bytes());
        out[OFFSET].copy_from_slice(&self.offset.to_le_bytes());
        out[LEN].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Parses the wire form (peer input: never panics).
    ///
    /// # Errors
    /// [`IpcHandleError`]: wrong length, magic or version, a reserved byte that is not
    /// zero, an empty region, or a range whose end does not fit in a `usize`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IpcHandleError> {
        let bytes: &[u8; Self::WIRE_LEN] =
            bytes.try_into().map_err(|_| IpcHandleError::Length {
                got: bytes.len(),
                expected: Self::WIRE_LEN,
            })?;
        if bytes[..4] != MAGIC {
            return Err(IpcHandleError::Magic);
        }
        if bytes[4] != VERSION {
            return Err(IpcHandleError::Version {
                got: bytes[4],
                known: VERSION,
            });
        }
        for index in RESERVED.into_iter().flatten() {
            if bytes[index] != 0 {
                return Err(IpcHandleError::Reserved {
                    index,
                    value: bytes[index],
                });
            }
        }
        let offset = u64::from_le_bytes(array(&bytes[OFFSET]));
        let len = u64::from_le_bytes(array(&bytes[LEN]));
        if len == 0 {
            return Err(IpcHandleError::ZeroLength);
        }
        // Offsets and lengths become `usize` (and device addresses): the end must fit.
        let fits = offset
            .checked_add(len)
            .and_then(|end| usize::try_from(end).ok())
            .is_some_and(|end| end <= isize::MAX as usize);
        if !fits {
            return Err(IpcHandleError::TooLarge { offset, len });
        }
        Ok(Self {
            raw: array(&bytes[RAW]),
            uuid: DeviceUuid(array(&bytes[UUID])),
            exporter_ordinal: u32::from_le_bytes(array(&bytes[ORDINAL])),
            offset,
            len,
        })
    }

    /// The device the memory is on.
    pub fn device_uuid(&self) -> DeviceUuid {
        self.uuid
    }

    /// The device's ordinal in the exporting process (only informative: ordinals differ
    /// between processes; the UUID identifies the device).
    pub fn exporter_ordinal(&self) -> u32 {
        self.exporter_ordinal
    }

    /// The region's length in bytes (never 0).
    pub fn region_len(&self) -> u64 {
        self.len
    }

    /// Where the region starts inside its allocation.
    pub fn offset_in_allocation(&self) -> u64 {
        self.offset
    }
}

/// A fixed-size array from a slice of a range whose length is that size.
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(bytes);
    out
}

/// An exported device region: its [`IpcHandle`], and the region itself, held so that the
/// allocation outlives every use a peer may make of the handle.
#[derive(Debug)]
pub struct IpcExport {
    handle: IpcHandle,
    _region: Arc<dyn DmaRegion>,
}

impl IpcExport {
    /// The handle to send to the peer.
    pub fn handle(&self) -> &IpcHandle {
        &self.handle
    }
}

/// The allocation containing device address `ptr`: `(base, size)`.
fn allocation_of(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize), CudaError> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: `base` and `size` are live locals for the driver to write; `ptr` is only
    // looked up (the driver answers an error for an address it does not know).
    unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr) }
        .result()
        .map_err(driver("cuMemGetAddressRange"))?;
    Ok((base, size))
}

fn uuid_of(ctx: &CudaContext) -> Result<DeviceUuid, CudaError> {
    let uuid = ctx.uuid().map_err(driver("cuDeviceGetUuid"))?;
    Ok(DeviceUuid(uuid.bytes.map(|b| b as u8)))
}

/// Exports CUDA device memory for another process on this host: the IPC handle of its
/// `cuMemAlloc` allocation (`cuIpcGetMemHandle`), with the region's place in it.
///
/// # Errors
/// [`CudaError::NotDeviceMemory`] / [`CudaError::ZeroLength`] / [`CudaError::NoDriver`]
/// (inside [`IpcError::Cuda`]), [`IpcError::BeyondAllocation`] (the region is not inside
/// one allocation), [`IpcError::Unsupported`], or a driver error.
pub fn export(region: &Arc<dyn DmaRegion>) -> Result<IpcExport, IpcError> {
    let ordinal = device_ordinal(region.as_ref())?;
    if region.is_empty() {
        return Err(CudaError::ZeroLength.into());
    }
    let ctx = context(ordinal)?;
    let start = device_address(region.as_ref(), 0);
    let (base, size) = allocation_of(start)?;
    let len = region.len() as u64;
    let offset = start.checked_sub(base);
    let Some(offset) = offset.filter(|o| o.checked_add(len).is_some_and(|e| e <= size as u64))
    else {
        return Err(IpcError::BeyondAllocation {
            offset: start.wrapping_sub(base),
            len,
            allocation: size as u64,
        });
    };
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `raw` is a live handle for the driver to write; `base` is the start of a
    // device allocation (the driver just reported it), which `region` keeps alive during
    // the call.
    match unsafe { sys::cuIpcGetMemHandle(&raw mut raw, base) }.result() {
        Ok(()) => {}
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)) => {
            return Err(IpcError::Unsupported {
                ordinal,
                call: "cuIpcGetMemHandle",
            });
        }
        Err(source) => {
            return Err(CudaError::Driver {
                call: "cuIpcGetMemHandle",
                source,
            }
            .into());
        }
    }
    Ok(IpcExport {
        handle: IpcHandle {
            raw: raw.reserved.map(|b| b as u8),
            uuid: uuid_of(&ctx)?,
            exporter_ordinal: ordinal,
            offset,
            len,
        },
        _region: Arc::clone(region),
    })
}

/// The ordinal in this process of the device with `uuid`.
fn local_device(uuid: DeviceUuid) -> Result<Option<u32>, CudaError> {
    let count = device_count()?;
    for ordinal in 0..count {
        // `ordinal < count <= i32::MAX` (count came from a c_int).
        let dev = result::device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
        let found = result::device::get_uuid(dev).map_err(driver("cuDeviceGetUuid"))?;
        if DeviceUuid(found.bytes.map(|b| b as u8)) == uuid {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// Another process's device region, opened in this process through its [`IpcHandle`]:
/// a read-only view that copies bounds-checked ranges out. The handle is closed on drop.
///
/// Every copy runs on the mapping's own stream and is finished when the call returns, so
/// no copy outlives the borrow of the mapping or of the destination. Copies from several
/// threads at once are fine (they share the stream).
#[derive(Debug)]
pub struct IpcMapping {
    // Field order is drop order: `Drop::drop` waits for the stream and closes the handle,
    // then the stream goes, then the context (which must outlive both).
    /// The mapped allocation's base, as `cuIpcOpenMemHandle` returned it.
    mapped: sys::CUdeviceptr,
    offset: usize,
    len: usize,
    ordinal: u32,
    uuid: DeviceUuid,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl IpcMapping {
    /// Opens `handle` in the primary context of the local device with the handle's UUID
    /// (`cuIpcOpenMemHandle_v2`, lazily enabling peer access so other devices' copies can
    /// reach it), and checks that the handle's range lies inside the allocation the
    /// driver mapped.
    ///
    /// # Errors
    /// [`IpcError::Cuda`] ([`CudaError::NoDriver`], or a driver error: among them the one
    /// the driver gives in the exporting process itself, or for a handle it does not
    /// know), [`IpcError::DeviceNotVisible`], [`IpcError::Unsupported`],
    /// [`IpcError::BeyondAllocation`].
    pub fn open(handle: &IpcHandle) -> Result<Self, IpcError> {
        let ordinal = local_device(handle.uuid)?.ok_or(IpcError::DeviceNotVisible {
            uuid: handle.uuid,
            exporter_ordinal: handle.exporter_ordinal,
        })?;
        let ctx = context(ordinal)?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        // `from_bytes` and `export` both guarantee that `offset + len` fits in a usize.
        let (offset, len) = match (usize::try_from(handle.offset), usize::try_from(handle.len)) {
            (Ok(offset), Ok(len)) if offset.checked_add(len).is_some() => (offset, len),
            _ => {
                return Err(IpcHandleError::TooLarge {
                    offset: handle.offset,
                    len: handle.len,
                }
                .into());
            }
        };
        let raw = sys::CUipcMemHandle {
            reserved: handle.raw.map(|b| b as core::ffi::c_char),
        };
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as core::ffi::c_uint;
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let mut mapped: sys::CUdeviceptr = 0;
        // SAFETY: `mapped` is a live local for the driver to write; the handle is passed by
        // value and only interpreted by the driver, which refuses handles it does not
        // know. The context of the matching device is current (bound above).
        match unsafe { sys::cuIpcOpenMemHandle_v2(&raw mut mapped, raw, flags) }.result() {
            Ok(()) => {}
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)) => {
                return Err(IpcError::Unsupported {
                    ordinal,
                    call: "cuIpcOpenMemHandle",
                });
            }
            Err(source) => {
                return Err(CudaError::Driver {
                    call: "cuIpcOpenMemHandle",
                    source,
                }
                .into());
            }
        }
        // From here on Drop closes the handle, also on the error paths below.
        let mapping = Self {
            mapped,
            offset,
            len,
            ordinal,
            uuid: handle.uuid,
            stream,
            ctx,
        };
        let (base, size) = allocation_of(mapped)?;
        // The bytes of the allocation from `mapped` on (all of it in practice: the driver
        // maps the allocation at `mapped`).
        let usable = if base <= mapped {
            (base.saturating_add(size as u64).saturating_sub(mapped)) as usize
        } else {
            0
        };
        if offset + len > usable {
            return Err(IpcError::BeyondAllocation {
                offset: handle.offset,
                len: handle.len,
                allocation: usable as u64,
            });
        }
        Ok(mapping)
    }

    /// The region's length in bytes (never 0).
    pub fn region_len(&self) -> usize {
        self.len
    }

    /// The local ordinal of the device the memory is on.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device the memory is on.
    pub fn device_uuid(&self) -> DeviceUuid {
        self.uuid
    }

    /// The device address `offset` bytes into the region (checked by the caller).
    fn source(&self, offset: usize) -> sys::CUdeviceptr {
        // Inside the mapped allocation (checked by the callers and at open): no overflow.
        self.mapped + (self.offset + offset) as sys::CUdeviceptr
    }

    /// Copies `dst.len()` bytes at `offset` of the region into `dst` (`cuMemcpyDtoH`);
    /// returns when they are there.
    ///
    /// # Errors
    /// [`IpcError::Range`] when the range is outside the region; a driver error.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), IpcError> {
        staging::check_range(offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let src = self.source(offset);
        let len = dst.len();
        // SAFETY: `src .. src + len` lies inside the mapped allocation (checked at open and
        // above) and `dst` is `len` writable bytes borrowed exclusively for this call, which
        // waits for the copy (`finish`) before it returns.
        let queued = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, len, self.stream.cu_stream())
        };
        self.finish("cuMemcpyDtoHAsync", queued)
    }

    /// Copies `len` bytes at `offset` of the region into `dst` at `dst_offset`; returns
    /// when they are there. Host-memory destinations (host, CUDA pinned, staged host) are
    /// written by `cuMemcpyDtoH` as a DMA engine would (see the aliasing model of
    /// [`RegionBytes`](crate::RegionBytes)); device memory by `cuMemcpyDtoD` on the same
    /// device and `cuMemcpyPeer` from another.
    ///
    /// # Errors
    /// [`IpcError::Range`] when either range is outside; [`IpcError::Cuda`] for a device
    /// the driver does not have, or a driver error.
    pub fn copy_into(
        &self,
        offset: usize,
        dst: &dyn DmaRegion,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), IpcError> {
        staging::check_range(offset, len, self.len)?;
        staging::check_range(dst_offset, len, dst.len())?;
        if len == 0 {
            return Ok(());
        }
        let src = self.source(offset);
        match dst.kind() {
            MemoryKind::Host | MemoryKind::CudaPinned | MemoryKind::StagedHost => {
                self.bind()?;
                let dst_ptr = dst.base_ptr().wrapping_add(dst_offset);
                // SAFETY: `dst_ptr .. + len` lies inside `dst` (checked above), host memory
                // that may be written through raw pointers from any thread while `dst` lives
                // (DmaRegion contract for these kinds); the borrow of `dst` outlives the
                // copy, which `finish` waits for. The source range is inside the mapping.
                let queued = unsafe {
                    sys::cuMemcpyDtoHAsync_v2(dst_ptr.cast(), src, len, self.stream.cu_stream())
                };
                self.finish("cuMemcpyDtoHAsync", queued)
            }
            MemoryKind::CudaDevice { ordinal } if ordinal == self.ordinal => {
                self.bind()?;
                let dst_ptr = device_address(dst, dst_offset);
                // SAFETY: both ranges are device memory of this device inside their
                // allocations (checked above and at open); `dst` stays allocated while its
                // borrow lives, which outlasts the copy (`finish` waits for it).
                let queued = unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst_ptr, src, len, self.stream.cu_stream())
                };
                self.finish("cuMemcpyDtoDAsync", queued)
            }
            MemoryKind::CudaDevice { ordinal } => {
                let dst_ctx = context(ordinal)?;
                self.bind()?;
                let dst_ptr = device_address(dst, dst_offset);
                // SAFETY: as for the same device; each pointer is named with the context it
                // belongs to, and `dst_ctx` keeps the destination's context alive during the
                // copy, which `finish` waits for.
                let queued = unsafe {
                    sys::cuMemcpyPeerAsync(
                        dst_ptr,
                        dst_ctx.cu_ctx(),
                        src,
                        self.ctx.cu_ctx(),
                        len,
                        self.stream.cu_stream(),
                    )
                };
                self.finish("cuMemcpyPeerAsync", queued)
            }
        }
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    /// Waits for the stream after a copy was queued (or refused), so no copy outlives the
    /// call that borrowed its destination.
    fn finish(&self, call: &'static str, queued: sys::CUresult) -> Result<(), IpcError> {
        let synced = self.stream.synchronize();
        queued.result().map_err(driver(call))?;
        synced.map_err(driver("cuStreamSynchronize"))?;
        Ok(())
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let closed = self.ctx.bind_to_thread().and_then(|()| {
            // Copies wait for themselves; this only covers a copy whose wait failed.
            report_drop("cuStreamSynchronize", self.stream.synchronize());
            // SAFETY: `mapped` came from cuIpcOpenMemHandle in this context and is closed
            // only here; every copy from it has finished (each call waits for its copy,
            // and the stream was synchronised above).
            unsafe { sys::cuIpcCloseMemHandle(self.mapped) }.result()
        });
        report_drop("cuIpcCloseMemHandle", closed);
    }
}

#[cfg(test)]
mod tests;
