//! The read-only view another process maps of a sealed shared region.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::{HUGE_PAGE_SIZE, MAX_HOST_REGION, Mapping};
use crate::region::{DmaRegion, RegionAccessError};

/// Why a peer's shared region could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// Zero bytes, or more than [`MAX_HOST_REGION`].
    #[error("shared region of {len} bytes refused (must be 1..={MAX_HOST_REGION})")]
    BadLength {
        /// The length asked for.
        len: u64,
    },
    /// The file's size is not sealed against shrinking (not a sealed memfd): a mapping of
    /// it could lose pages under the reader.
    #[error("the shared file is not sealed against shrinking (not a sealed memfd)")]
    NotSealed,
    /// The file is shorter than the region it should hold.
    #[error("the shared file has {file_len} bytes, fewer than the region's {len}")]
    TooShort {
        /// The file's size.
        file_len: u64,
        /// The region's length.
        len: u64,
    },
    /// A system call failed.
    #[error("{op} failed")]
    Io {
        /// What was done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// A read-only mapping of a region that another process on this host shares through its
/// [`shared_fd`](DmaRegion::shared_fd) (the transport's shared-memory backend maps a
/// peer's [`HostRegion`](super::HostRegion) with it).
///
/// # Concurrent writers
/// The owner (another process) writes its region while this view exists, at any time.
/// That is the same DMA model as [`RegionBytes`](crate::RegionBytes): this type never
/// hands out a reference to the mapped bytes, only copies them into the reader's own
/// memory through raw pointers ([`copy_to`](Self::copy_to)) or loads one aligned word
/// atomically ([`load_u64`](Self::load_u64)). A copy racing a write yields unspecified
/// bytes (which the lease protocol and fenced reads detect), never a torn Rust value or
/// an aliased borrow. The mapping itself cannot disappear: [`map`](Self::map) requires the
/// file's size to be sealed (`F_SEAL_SHRINK`), so no later truncation can leave pages
/// unbacked (`SIGBUS`), and the mapping keeps the pages alive after the owner unmaps them.
pub struct SharedRegionView {
    map: Mapping,
    len: usize,
}

impl SharedRegionView {
    /// Maps the file `fd` read-only and exposes its first `len` bytes. The descriptor is
    /// closed once mapped (the mapping keeps the pages).
    ///
    /// # Errors
    /// [`ShareError::BadLength`] for 0 or more than [`MAX_HOST_REGION`] bytes;
    /// [`ShareError::NotSealed`] when the file's size is not sealed against shrinking;
    /// [`ShareError::TooShort`]; [`ShareError::Io`] when `fstat`, `fcntl` or `mmap` fail.
    pub fn map(fd: OwnedFd, len: u64) -> Result<Self, ShareError> {
        if len == 0 || len > MAX_HOST_REGION as u64 {
            return Err(ShareError::BadLength { len });
        }
        let (file, file_len) = sealed_file(fd, len)?;
        // Map the whole file (a hugetlb file maps only in whole huge pages); it is at most
        // a few pages longer than `len`, which is at most MAX_HOST_REGION.
        let mapped_len = usize::try_from(file_len)
            .ok()
            .filter(|&l| l <= MAX_HOST_REGION + HUGE_PAGE_SIZE)
            .ok_or(ShareError::BadLength { len: file_len })?;
        let map = Mapping::new(&file, mapped_len, libc::PROT_READ)
            .map_err(|source| ShareError::Io { op: "mmap", source })?;
        Ok(Self {
            map,
            // `len <= file_len == mapped_len`, a `usize`.
            len: len as usize,
        })
    }

    /// The bytes this view exposes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty (never: [`map`](Self::map) refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range_ptr(&self, offset: u64, len: u64) -> Result<*const u8, RegionAccessError> {
        crate::region::check_bounds(offset, len, self.len as u64)?;
        // `offset <= self.len`, a `usize`.
        Ok(self.map.as_ptr().wrapping_add(offset as usize).cast_const())
    }

    /// Copies `len` bytes at `offset` of this view into `dst` at `dst_offset` (a plain
    /// memory copy; see "Concurrent writers").
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`] when either range lies outside its region,
    /// [`RegionAccessError::NotHostAccessible`] when `dst` is not host memory; nothing is
    /// copied then.
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &dyn DmaRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), RegionAccessError> {
        let src = self.range_ptr(offset, len)?;
        let to = crate::region::host_ptr(dst, dst_offset, len)?;
        // SAFETY: `src..src + len` lies inside this view's mapping (checked by
        // `range_ptr`), readable while `self` lives; `to..to + len` lies inside `dst`'s
        // host memory (checked by `host_ptr`), writable from any thread while `dst` lives
        // (`DmaRegion` contract). No reference to either range is created; `copy`
        // tolerates overlap. `len` fits a `usize` (it is inside the view).
        unsafe { std::ptr::copy(src, to, len as usize) };
        Ok(())
    }

    /// Atomically loads the native-endian `u64` word at `offset` (acquire): a generation
    /// word the owner stores atomically never tears.
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`], or [`RegionAccessError::Misaligned`] for an
    /// address that is not 8-byte aligned.
    pub fn load_u64(&self, offset: u64) -> Result<u64, RegionAccessError> {
        let ptr = self.range_ptr(offset, 8)?;
        if !(ptr as usize).is_multiple_of(8) {
            return Err(RegionAccessError::Misaligned { offset });
        }
        // SAFETY: in bounds and 8-aligned (checked above), valid while `self` lives. The
        // page is mapped read-only; an acquire load of a 64-bit atomic is a plain load on
        // every 64-bit target with native atomics, which the `AtomicU64` docs allow on
        // read-only memory. Nothing stores through this pointer.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr.cast_mut().cast()) };
        Ok(word.load(std::sync::atomic::Ordering::Acquire))
    }
}

/// Checks that `fd` is a file whose size is sealed against shrinking and that holds at
/// least `len` bytes; returns it with its size.
pub(crate) fn sealed_file(fd: OwnedFd, len: u64) -> Result<(File, u64), ShareError> {
    // SAFETY: fcntl(F_GET_SEALS) on a descriptor we own reads no memory of ours.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let source = io::Error::last_os_error();
        return Err(if source.raw_os_error() == Some(libc::EINVAL) {
            ShareError::NotSealed
        } else {
            ShareError::Io {
                op: "fcntl(F_GET_SEALS)",
                source,
            }
        });
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShareError::NotSealed);
    }
    let file = File::from(fd);
    let file_len = file
        .metadata()
        .map_err(|source| ShareError::Io {
            op: "fstat",
            source,
        })?
        .len();
    if file_len < len {
        return Err(ShareError::TooShort { file_len, len });
    }
    Ok((file, file_len))
}

impl fmt::Debug for SharedRegionView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegionView")
            .field("ptr", &self.map.ptr)
            .field("len", &self.len)
            .field("mapped_len", &self.map.len)
            .finish()
    }
}
