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
    /// Host memory that is treated as **not** host-accessible: the transport moves it only
    /// through the staging pipeline ([`crate::staging::Stager`], with a
    /// [`crate::staging::HostCopier`] in place of the CUDA copier), exactly as it moves
    /// device memory. It exists so that the device paths run, and are tested and
    /// measured, on machines without a GPU ([`crate::StagedHostRegion`]).
    StagedHost,
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
            Self::StagedHost => f.write_str("staged-host"),
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
    /// A word access at an offset that is not a multiple of 8 (or an unaligned base).
    #[error("u64 word access at offset {offset} is not 8-byte aligned")]
    Misaligned {
        /// The offset asked for.
        offset: u64,
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
/// - for [`MemoryKind::StagedHost`], the same holds as for `Host` (the kind only tells
///   the transport to stage it);
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

/// Safe, bounds-checked byte access to host-accessible [`DmaRegion`]s.
///
/// Implemented for every `DmaRegion` (also `dyn DmaRegion`). Every method checks that the
/// range lies inside the region and that the memory is host-accessible
/// ([`MemoryKind::is_host_accessible`]); device memory is refused with
/// [`RegionAccessError::NotHostAccessible`].
///
/// # Aliasing model
/// A registered region is shared with "DMA engines": a NIC doing RDMA READ, or the TCP
/// backend's server thread copying bytes to a socket, may read any registered byte at
/// any time, while the owner writes other blocks (and the TCP reader writes received bytes
/// into a destination region while the owner reads other blocks). Nothing here locks:
/// the **lease protocol** decides which bytes are stable (P writes a block only while no
/// lease on it is live, D reads a destination only after the batch completed), and
/// **fenced reads** detect after the fact when that rule was broken (a lease expired or
/// was reused mid-read). Concurrent accesses to *disjoint* ranges are always fine.
///
/// The borrows handed to [`with_bytes`](Self::with_bytes) /
/// [`with_bytes_mut`](Self::with_bytes_mut) last only for the closure and are meant for
/// IO syscalls (`write`/`read` on a socket) and `memcpy`. If a peer breaks the protocol and
/// an overlapping range is written concurrently, the bytes seen are unspecified, exactly
/// as with a NIC; callers must not rely on such a borrow being immutable beyond copying
/// it. Generation words that must not tear go through [`load_u64`](Self::load_u64) /
/// [`store_u64`](Self::store_u64), which are atomic.
pub trait RegionBytes {
    /// Checks that `offset..offset + len` is inside the region and host-accessible.
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`] or [`RegionAccessError::NotHostAccessible`].
    fn check_host_range(&self, offset: u64, len: u64) -> Result<(), RegionAccessError>;

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range).
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionAccessError>;

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range).
    fn write_from(&self, offset: u64, src: &[u8]) -> Result<(), RegionAccessError>;

    /// Lends `offset..offset + len` as a shared slice for the duration of `f` (zero-copy
    /// send). See the aliasing model in the trait doc.
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); `f` is not called then.
    fn with_bytes<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionAccessError>;

    /// Lends `offset..offset + len` as a mutable slice for the duration of `f` (zero-copy
    /// receive). See the aliasing model in the trait doc: callers keep concurrent users of
    /// the same bytes apart (the transport gives each in-flight read its own range).
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); `f` is not called then.
    fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionAccessError>;

    /// Atomically loads the little-endian-native `u64` word at `offset` (acquire).
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range), or
    /// [`RegionAccessError::Misaligned`] when the word's address is not 8-byte aligned.
    fn load_u64(&self, offset: u64) -> Result<u64, RegionAccessError>;

    /// Atomically stores `value` into the `u64` word at `offset` (release).
    ///
    /// # Errors
    /// As [`load_u64`](Self::load_u64).
    fn store_u64(&self, offset: u64, value: u64) -> Result<(), RegionAccessError>;
}

/// Checks the range and returns the start pointer of it.
fn host_ptr<T: DmaRegion + ?Sized>(
    region: &T,
    offset: u64,
    len: u64,
) -> Result<*mut u8, RegionAccessError> {
    let kind = region.kind();
    if !kind.is_host_accessible() {
        return Err(RegionAccessError::NotHostAccessible { kind });
    }
    range_ptr(region, offset, len)
}

/// Checks only the range (not the kind) and returns its start pointer.
fn range_ptr<T: DmaRegion + ?Sized>(
    region: &T,
    offset: u64,
    len: u64,
) -> Result<*mut u8, RegionAccessError> {
    let region_len = region.len() as u64;
    match offset.checked_add(len) {
        Some(end) if end <= region_len => {}
        _ => {
            return Err(RegionAccessError::OutOfBounds {
                offset,
                len,
                region_len,
            });
        }
    }
    // `offset <= region_len`, which is a `usize`, so the cast is lossless.
    Ok(region.base_ptr().wrapping_add(offset as usize))
}

/// The start of `offset..offset + len` of a region whose bytes are host memory, including
/// [`MemoryKind::StagedHost`] (which [`RegionBytes`] refuses on purpose): the staging
/// copier's access.
fn staged_ptr(region: &dyn DmaRegion, offset: u64, len: u64) -> Result<*mut u8, RegionAccessError> {
    let kind = region.kind();
    if !(kind.is_host_accessible() || kind == MemoryKind::StagedHost) {
        return Err(RegionAccessError::NotHostAccessible { kind });
    }
    range_ptr(region, offset, len)
}

/// Copies `dst.len()` bytes at `offset` of a host-memory region (any host kind, staged
/// host included) into `dst`.
pub(crate) fn staged_read(
    region: &dyn DmaRegion,
    offset: u64,
    dst: &mut [u8],
) -> Result<(), RegionAccessError> {
    let src = staged_ptr(region, offset, dst.len() as u64)?;
    // SAFETY: `staged_ptr` checked that the range lies inside the region and that the
    // region's kind is host memory (Host, CudaPinned or StagedHost, whose `DmaRegion`
    // implementors guarantee host memory valid for reads from any thread while they live).
    unsafe { std::ptr::copy(src, dst.as_mut_ptr(), dst.len()) };
    Ok(())
}

/// Copies `src` into a host-memory region (any host kind, staged host included) at `offset`.
pub(crate) fn staged_write(
    region: &dyn DmaRegion,
    offset: u64,
    src: &[u8],
) -> Result<(), RegionAccessError> {
    let dst = staged_ptr(region, offset, src.len() as u64)?;
    // SAFETY: as in `staged_read`: in bounds, host memory writable from any thread while
    // the region lives; `copy` tolerates overlap with `src`.
    unsafe { std::ptr::copy(src.as_ptr(), dst, src.len()) };
    Ok(())
}

fn word_ptr<T: DmaRegion + ?Sized>(region: &T, offset: u64) -> Result<*mut u64, RegionAccessError> {
    let ptr = host_ptr(region, offset, 8)?;
    if !(ptr as usize).is_multiple_of(8) {
        return Err(RegionAccessError::Misaligned { offset });
    }
    Ok(ptr.cast::<u64>())
}

impl<T: DmaRegion + ?Sized> RegionBytes for T {
    fn check_host_range(&self, offset: u64, len: u64) -> Result<(), RegionAccessError> {
        host_ptr(self, offset, len).map(drop)
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionAccessError> {
        let src = host_ptr(self, offset, dst.len() as u64)?;
        // SAFETY: `host_ptr` checked that `offset..offset + dst.len()` lies inside the
        // region, which the `DmaRegion` contract keeps mapped, host-accessible and valid
        // for reads for as long as `self` lives; `dst` is a distinct Rust allocation (it
        // is borrowed mutably; should it alias the region, `copy` tolerates overlap).
        unsafe { std::ptr::copy(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn write_from(&self, offset: u64, src: &[u8]) -> Result<(), RegionAccessError> {
        let dst = host_ptr(self, offset, src.len() as u64)?;
        // SAFETY: `host_ptr` checked that the destination range lies inside the region,
        // which the `DmaRegion` contract keeps mapped and writable from any thread while
        // `self` lives; `copy` tolerates overlap with `src`.
        unsafe { std::ptr::copy(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    fn with_bytes<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // SAFETY: the range is inside the region (checked by `host_ptr`, so `len` fits a
        // `usize`), valid for reads while `self` is borrowed, which outlives the closure
        // call; concurrent writers follow the DMA aliasing model in the trait doc.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len as usize) };
        Ok(f(bytes))
    }

    fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // SAFETY: the range is inside the region (checked by `host_ptr`), valid for reads
        // and writes from any thread while `self` is borrowed, which outlives the closure
        // call; exclusivity of the range is the caller's part of the DMA aliasing model
        // in the trait doc.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
        Ok(f(bytes))
    }

    fn load_u64(&self, offset: u64) -> Result<u64, RegionAccessError> {
        let ptr = word_ptr(self, offset)?;
        // SAFETY: `word_ptr` checked bounds, host accessibility and 8-byte alignment; the
        // word stays valid while `self` lives, and every access to fence words in kvlease
        // goes through these atomic accessors.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
        Ok(word.load(std::sync::atomic::Ordering::Acquire))
    }

    fn store_u64(&self, offset: u64, value: u64) -> Result<(), RegionAccessError> {
        let ptr = word_ptr(self, offset)?;
        // SAFETY: as in `load_u64`: in bounds, host memory, aligned, valid while `self`
        // lives.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
        word.store(value, std::sync::atomic::Ordering::Release);
        Ok(())
    }
}
