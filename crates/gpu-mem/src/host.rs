//! Page-aligned host memory: one anonymous mmap, huge pages tried first.

use std::fmt;
use std::ptr::NonNull;

use crate::region::{DmaRegion, MemoryKind};

/// Size of an explicit huge page (MAP_HUGE_2MB).
pub const HUGE_PAGE_SIZE: usize = 2 << 20;
/// Base page size assumed for rounding (the kernel rounds to its own page size anyway).
const PAGE_SIZE: usize = 4096;
/// Largest host region accepted (1 TiB): larger requests are configuration errors.
pub const MAX_HOST_REGION: usize = 1 << 40;

/// How hard [`HostRegion::new`] tries to use huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HugePagePolicy {
    /// Try explicit 2 MiB pages (MAP_HUGETLB), else normal pages + `MADV_HUGEPAGE`.
    #[default]
    Try,
    /// Normal pages + `MADV_HUGEPAGE` (transparent huge pages where the kernel allows).
    Transparent,
    /// Explicit 2 MiB pages or an error.
    Require,
    /// Normal pages, no advice.
    Never,
}

/// Which pages a [`HostRegion`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PageKind {
    /// Explicit 2 MiB huge pages (MAP_HUGETLB | MAP_HUGE_2MB).
    Huge2M,
    /// Normal pages with `madvise(MADV_HUGEPAGE)` accepted.
    TransparentHuge,
    /// Normal pages (no huge-page advice, or the advice was refused).
    Normal,
}

/// Why a host allocation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostAllocError {
    /// Zero bytes, or more than [`MAX_HOST_REGION`].
    #[error("host region of {len} bytes refused (must be 1..={MAX_HOST_REGION})")]
    BadLength {
        /// The length asked for.
        len: usize,
    },
    /// `mmap` failed.
    #[error("mmap of {len} bytes ({pages}) failed")]
    Mmap {
        /// The mapped length asked for.
        len: usize,
        /// Which pages were asked for.
        pages: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// One contiguous, page-aligned, zero-filled anonymous mapping, unmapped on drop.
pub struct HostRegion {
    ptr: MapPtr,
    len: usize,
    mapped_len: usize,
    pages: PageKind,
}

/// The start of a [`HostRegion`]'s mapping: the only field that needs `unsafe impl
/// Send/Sync`, so that the public type gets them from its fields.
struct MapPtr(NonNull<u8>);

// SAFETY: the pointer is the start of a private anonymous mapping owned by exactly one
// `HostRegion`; mapped memory is not tied to the thread that mapped it, and the region
// unmaps it (once, in Drop) from whichever thread drops it.
unsafe impl Send for MapPtr {}
// SAFETY: `&MapPtr` only yields the address. Every access to the bytes goes through raw
// pointers under the `DmaRegion` rules (bounds-checked copies, atomic words, the `unsafe`
// slice lenders with their own `# Safety` contract); no `&`/`&mut` to the bytes is tied
// to a shared `&HostRegion`.
unsafe impl Sync for MapPtr {}

impl HostRegion {
    /// Maps `len` bytes with [`HugePagePolicy::Try`].
    ///
    /// # Errors
    /// As [`with_policy`](Self::with_policy).
    pub fn new(len: usize) -> Result<Self, HostAllocError> {
        Self::with_policy(len, HugePagePolicy::Try)
    }

    /// Maps `len` bytes (rounded up to the page size) following `policy`, and logs which
    /// pages it got.
    ///
    /// # Errors
    /// [`HostAllocError::BadLength`] for 0 or more than [`MAX_HOST_REGION`] bytes;
    /// [`HostAllocError::Mmap`] when the kernel refuses (for `Require`: when no explicit
    /// huge pages are available).
    pub fn with_policy(len: usize, policy: HugePagePolicy) -> Result<Self, HostAllocError> {
        if len == 0 || len > MAX_HOST_REGION {
            return Err(HostAllocError::BadLength { len });
        }
        let want_huge = matches!(policy, HugePagePolicy::Try | HugePagePolicy::Require);
        if want_huge {
            let mapped_len = len.next_multiple_of(HUGE_PAGE_SIZE);
            match map(mapped_len, true) {
                Ok(ptr) => {
                    tracing::info!(len, mapped_len, "host region: explicit 2 MiB huge pages");
                    return Ok(Self {
                        ptr: MapPtr(ptr),
                        len,
                        mapped_len,
                        pages: PageKind::Huge2M,
                    });
                }
                Err(source) if policy == HugePagePolicy::Require => {
                    return Err(HostAllocError::Mmap {
                        len: mapped_len,
                        pages: "2 MiB huge pages",
                        source,
                    });
                }
                Err(err) => tracing::info!(
                    len,
                    %err,
                    "host region: no explicit huge pages (MAP_HUGETLB); falling back to normal pages + MADV_HUGEPAGE"
                ),
            }
        }
        let mapped_len = len.next_multiple_of(PAGE_SIZE);
        let ptr = map(mapped_len, false).map_err(|source| HostAllocError::Mmap {
            len: mapped_len,
            pages: "normal pages",
            source,
        })?;
        let mut pages = PageKind::Normal;
        if policy != HugePagePolicy::Never {
            // SAFETY: `ptr..ptr + mapped_len` is the mapping just created; madvise only
            // changes paging advice for it.
            let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), mapped_len, libc::MADV_HUGEPAGE) };
            if rc == 0 {
                pages = PageKind::TransparentHuge;
            } else {
                let err = std::io::Error::last_os_error();
                tracing::info!(%err, "host region: MADV_HUGEPAGE refused; normal pages");
            }
        }
        tracing::info!(len, mapped_len, ?pages, "host region mapped");
        Ok(Self {
            ptr: MapPtr(ptr),
            len,
            mapped_len,
            pages,
        })
    }

    /// Which pages the mapping got.
    pub fn pages(&self) -> PageKind {
        self.pages
    }

    /// Bytes actually mapped (the length rounded up to the page size).
    pub fn mapped_len(&self) -> usize {
        self.mapped_len
    }
}

fn map(len: usize, huge: bool) -> Result<NonNull<u8>, std::io::Error> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_2MB;
    }
    // SAFETY: an anonymous private mapping at a kernel-chosen address touches no existing
    // memory; the result is checked against MAP_FAILED below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + mapped_len` is exactly the mapping created in `with_policy`,
        // owned by `self`, and no borrow of it outlives `self`.
        let rc = unsafe { libc::munmap(self.ptr.0.as_ptr().cast(), self.mapped_len) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            tracing::error!(%err, len = self.mapped_len, "munmap of a host region failed");
            debug_assert!(false, "munmap failed: {err}");
        }
    }
}

impl fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegion")
            .field("ptr", &self.ptr.0)
            .field("len", &self.len)
            .field("mapped_len", &self.mapped_len)
            .field("pages", &self.pages)
            .finish()
    }
}

// SAFETY: the mapping is valid, fixed and host-readable/writable from any thread for
// `len` bytes for as long as `self` lives (it is unmapped only in `drop`).
unsafe impl DmaRegion for HostRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.0.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

/// A [`HostRegion`] whose [`kind`](DmaRegion::kind) is [`MemoryKind::StagedHost`]: host
/// memory that the transport must move through the staging pipeline as if it were device
/// memory. [`RegionBytes`](crate::RegionBytes) refuses it; the staging module's
/// [`write_region`](crate::staging::write_region) /
/// [`read_region`](crate::staging::read_region) and
/// [`HostCopier`](crate::staging::HostCopier) reach its bytes. For tests and benchmarks of
/// the device paths on machines without a GPU.
#[derive(Debug)]
pub struct StagedHostRegion(HostRegion);

impl StagedHostRegion {
    /// A zero-filled staged region of `len` bytes (base pages).
    ///
    /// # Errors
    /// As [`HostRegion::with_policy`].
    pub fn new(len: usize) -> Result<Self, HostAllocError> {
        HostRegion::with_policy(len, HugePagePolicy::Never).map(Self)
    }
}

// SAFETY: delegates to the inner `HostRegion`, whose mapping is valid, fixed and host
// memory for `len` bytes while `self` lives; only the reported kind differs, and the
// `DmaRegion` contract requires the same of `StagedHost` as of `Host`.
unsafe impl DmaRegion for StagedHostRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.0.base_ptr()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::StagedHost
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::RegionBytes;

    fn explicit_huge_pages_free() -> bool {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find(|l| l.starts_with("HugePages_Free:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .is_some_and(|n| n > 0)
    }

    #[test]
    fn try_policy_falls_back_when_no_explicit_huge_pages() {
        let region = HostRegion::new(3 << 20).expect("3 MiB of normal pages maps");
        assert_eq!(region.len(), 3 << 20);
        assert_eq!(region.base_ptr() as usize % PAGE_SIZE, 0);
        if explicit_huge_pages_free() {
            assert_eq!(region.pages(), PageKind::Huge2M);
        } else {
            assert_ne!(region.pages(), PageKind::Huge2M);
            let required = HostRegion::with_policy(3 << 20, HugePagePolicy::Require);
            assert!(
                matches!(required, Err(HostAllocError::Mmap { .. })),
                "{required:?}"
            );
        }
    }

    #[test]
    fn normal_pages_round_up_and_are_zeroed_and_writable() {
        let region = HostRegion::with_policy(5000, HugePagePolicy::Never).expect("maps");
        assert_eq!(region.pages(), PageKind::Normal);
        assert_eq!(region.mapped_len(), 8192);
        let mut buf = [1u8; 16];
        region.read_into(4984, &mut buf).expect("in bounds");
        assert_eq!(buf, [0; 16]);
        region.write_from(4990, b"abcdefghij").expect("in bounds");
        region.read_into(4990, &mut buf[..10]).expect("in bounds");
        assert_eq!(&buf[..10], b"abcdefghij");
        assert!(region.write_from(4991, b"abcdefghij").is_err());
    }

    #[test]
    fn absurd_lengths_are_refused() {
        assert!(matches!(
            HostRegion::new(0),
            Err(HostAllocError::BadLength { len: 0 })
        ));
        assert!(matches!(
            HostRegion::new(MAX_HOST_REGION + 1),
            Err(HostAllocError::BadLength { .. })
        ));
    }
}
