//! [`ForeignRegion`]: a [`DmaRegion`] over memory that someone else allocated and owns
//! (a Python buffer, a numpy array, a torch tensor), kept alive by an owner value the
//! region holds.

use std::fmt;
use std::ptr::NonNull;

use crate::region::{DmaRegion, MemoryKind};

/// Why [`ForeignRegion::new`] refused a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForeignRegionError {
    /// The pointer is null.
    #[error("a null pointer cannot be registered")]
    Null,
    /// The length is zero.
    #[error("an empty range cannot be registered")]
    Empty,
    /// `ptr + len` overflows the address space, or `len` exceeds `isize::MAX`.
    #[error("the range {ptr:#x}+{len} overflows the address space")]
    Overflow {
        /// The start address.
        ptr: usize,
        /// The length.
        len: usize,
    },
}

/// The raw start of the range. Only this private type is `Send`/`Sync`: in this crate
/// `unsafe impl` goes only on private pointer types (like `host::Mapping`, `cuda::PinnedPtr`).
struct ForeignPtr(NonNull<u8>);

// SAFETY: a `ForeignPtr` is only built by `ForeignRegion::new`, whose caller promised that
// the range is memory valid for reads and writes from any thread (or device memory that
// the host never dereferences) for as long as the region lives. The pointer itself is a
// plain address; moving it to another thread moves no ownership.
unsafe impl Send for ForeignPtr {}
// SAFETY: as for `Send`: shared use from several threads only copies the address;
// accesses to the bytes go through `RegionBytes` (raw copies and atomics, the DMA model
// documented there), never through references.
unsafe impl Sync for ForeignPtr {}

/// Heap bytes that [`ForeignRegion::from_heap`] took over, freed when the region drops.
struct HeapBytes(NonNull<[u8]>);

// SAFETY: the allocation is owned by exactly this value (taken with `Box::into_raw`) and
// freed once, in `Drop`, from whichever thread drops it; no reference to the bytes is tied
// to it (the region reaches them through raw pointers only).
unsafe impl Send for HeapBytes {}
// SAFETY: `&HeapBytes` gives nothing but the value's existence: no access to the bytes.
unsafe impl Sync for HeapBytes {}

impl Drop for HeapBytes {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::into_raw` in `from_heap` and is freed only
        // here; the region that used the bytes is gone (its owner drops last).
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// A [`DmaRegion`] over memory allocated and owned elsewhere: `len` bytes at `ptr`, kept
/// valid by `owner`, which the region holds (and drops with itself).
///
/// Built for foreign-language memory: the Python binding registers the bytes of a
/// `bytearray`, a numpy array or a torch tensor (host or CUDA) with the owner being a
/// reference to that Python object. Such memory is not memfd-backed, so
/// [`shared_fd`](DmaRegion::shared_fd) is `None`: the transport's shared-memory backend
/// hands a same-host peer its address instead, which the peer reads with cross-memory
/// attach ([`PeerProcessRange`](crate::PeerProcessRange)), or over TCP where the kernel
/// refuses that.
pub struct ForeignRegion {
    ptr: ForeignPtr,
    len: usize,
    kind: MemoryKind,
    // Dropped after the region is no longer used (fields drop in declaration order, and
    // nothing reads `ptr` in `Drop`): the owner keeps the memory alive.
    _owner: Box<dyn Send + Sync>,
}

impl ForeignRegion {
    /// A region over `len` bytes at `ptr`, of `kind`, kept alive by `owner`.
    ///
    /// # Safety
    /// The caller guarantees that, for as long as the returned region (and every `Arc` of
    /// it the transport keeps) lives:
    /// - `ptr .. ptr + len` is one allocation that stays valid, is neither freed nor
    ///   moved nor shrunk, and is kept so by `owner` or by the caller;
    /// - for a host kind ([`MemoryKind::Host`], [`MemoryKind::CudaPinned`],
    ///   [`MemoryKind::StagedHost`]): the range is host memory that may be read and
    ///   written through raw pointers from any thread (not read-only memory, not a
    ///   mapping that can vanish). Other code may keep accessing the bytes: the
    ///   [`RegionBytes`](crate::RegionBytes) aliasing model (DMA-like, raw copies only) applies;
    /// - for [`MemoryKind::CudaDevice`]: `ptr` is a device address (`CUdeviceptr`)
    ///   of that device's primary context, which this crate never dereferences on the
    ///   host.
    ///
    /// # Errors
    /// [`ForeignRegionError`] for a null pointer, an empty range or an overflowing one;
    /// `owner` is dropped then.
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Self, ForeignRegionError> {
        let ptr = NonNull::new(ptr).ok_or(ForeignRegionError::Null)?;
        if len == 0 {
            return Err(ForeignRegionError::Empty);
        }
        let addr = ptr.as_ptr() as usize;
        if len > isize::MAX as usize || addr.checked_add(len).is_none() {
            return Err(ForeignRegionError::Overflow { ptr: addr, len });
        }
        Ok(Self {
            ptr: ForeignPtr(ptr),
            len,
            kind,
            _owner: owner,
        })
    }
}

impl ForeignRegion {
    /// A [`MemoryKind::Host`] region over `bytes`, which it takes over and frees when it
    /// drops: plain heap memory, not memfd-backed (like a serving engine's own CPU cache,
    /// or a buffer registered from Python), for Rust callers and tests.
    ///
    /// # Errors
    /// [`ForeignRegionError::Empty`] for no bytes.
    pub fn from_heap(bytes: Vec<u8>) -> Result<Self, ForeignRegionError> {
        let len = bytes.len();
        let raw = Box::into_raw(bytes.into_boxed_slice());
        // `Box::into_raw` never returns null.
        let owner = HeapBytes(NonNull::new(raw).ok_or(ForeignRegionError::Null)?);
        // SAFETY: `raw` is one heap allocation of `len` bytes that `owner` (moved into the
        // region, dropped after it) keeps alive, never moves and frees only on drop; it is
        // ordinary host memory, readable and writable from any thread, reached from now on
        // only through the region's raw pointers.
        unsafe { Self::new(raw.cast::<u8>(), len, MemoryKind::Host, Box::new(owner)) }
    }
}

impl fmt::Debug for ForeignRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignRegion")
            .field("ptr", &self.ptr.0)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

// SAFETY: `ForeignRegion::new`'s caller guarantees exactly the `DmaRegion` contract for
// `ptr .. ptr + len` and `kind` for as long as the region lives (the owner it holds keeps
// the memory alive); the range never changes after construction.
unsafe impl DmaRegion for ForeignRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.0.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        self.kind
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::{RegionAccessError, RegionBytes};

    /// A heap buffer whose drop is counted (the owner a binding would hand over).
    struct Owned {
        bytes: Box<[u64]>,
        drops: Arc<AtomicUsize>,
    }

    impl Drop for Owned {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn foreign_memory_is_read_and_written_through_the_region_and_kept_alive_by_its_owner() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut owned = Owned {
            bytes: vec![0u64; 64].into_boxed_slice(),
            drops: Arc::clone(&drops),
        };
        let ptr = owned.bytes.as_mut_ptr().cast::<u8>();
        let len = owned.bytes.len() * 8;
        // SAFETY: the boxed slice is one heap allocation of `len` bytes that `owned` keeps
        // alive and never resizes; moving the `Owned` into the region moves the box, not
        // the heap bytes. Host memory, accessed only through the region from here on.
        let region = unsafe { ForeignRegion::new(ptr, len, MemoryKind::Host, Box::new(owned)) }
            .expect("a valid range");
        let region: Arc<dyn DmaRegion> = Arc::new(region);
        assert_eq!(region.len(), 512);
        assert_eq!(region.base_ptr(), ptr);
        assert!(region.shared_fd().is_none());

        region.write_from(3, b"kvlease").expect("in bounds");
        let mut got = [0u8; 7];
        region.read_into(3, &mut got).expect("in bounds");
        assert_eq!(&got, b"kvlease");
        region.store_u64(64, 0xfeed).expect("aligned");
        assert_eq!(region.load_u64(64), Ok(0xfeed));
        assert!(matches!(
            region.read_into(510, &mut got),
            Err(RegionAccessError::OutOfBounds { .. })
        ));

        let clone = Arc::clone(&region);
        drop(region);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "a clone still holds it");
        drop(clone);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the owner goes with the region"
        );
    }

    #[test]
    fn heap_bytes_become_a_host_region() {
        let region = ForeignRegion::from_heap((0..=255u8).collect()).expect("not empty");
        assert_eq!((region.len(), region.kind()), (256, MemoryKind::Host));
        assert!(region.shared_fd().is_none());
        let mut got = [0u8; 4];
        region.read_into(100, &mut got).expect("in bounds");
        assert_eq!(got, [100, 101, 102, 103]);
        assert_eq!(
            ForeignRegion::from_heap(Vec::new()).map(drop),
            Err(ForeignRegionError::Empty)
        );
    }

    #[test]
    fn device_memory_is_never_host_accessible() {
        // The address is never dereferenced for a device kind, so any non-null value will
        // do for this check.
        let fake_device_ptr = std::ptr::dangling_mut::<u8>();
        // SAFETY: a `CudaDevice` region is never dereferenced on the host; nothing here
        // hands it to a transport.
        let region = unsafe {
            ForeignRegion::new(
                fake_device_ptr,
                4096,
                MemoryKind::CudaDevice { ordinal: 0 },
                Box::new(()),
            )
        }
        .expect("a valid range");
        assert!(matches!(
            region.read_into(0, &mut [0u8; 8]),
            Err(RegionAccessError::NotHostAccessible { .. })
        ));
    }

    #[test]
    fn bad_ranges_are_refused() {
        // SAFETY: refused before any region exists (a null pointer).
        let null =
            unsafe { ForeignRegion::new(std::ptr::null_mut(), 8, MemoryKind::Host, Box::new(())) };
        assert_eq!(null.map(drop), Err(ForeignRegionError::Null));
        // SAFETY: refused before any region exists (an empty range).
        let empty = unsafe {
            ForeignRegion::new(std::ptr::dangling_mut(), 0, MemoryKind::Host, Box::new(()))
        };
        assert_eq!(empty.map(drop), Err(ForeignRegionError::Empty));
        let near_end = std::ptr::without_provenance_mut(usize::MAX - 7);
        // SAFETY: refused before any region exists (the range wraps the address space).
        let wraps = unsafe { ForeignRegion::new(near_end, 16, MemoryKind::Host, Box::new(())) };
        assert!(matches!(
            wraps.map(drop),
            Err(ForeignRegionError::Overflow { .. })
        ));
    }
}
