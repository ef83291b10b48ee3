//! Page-aligned host memory: one shared mapping of a sealed memfd, huge pages tried first;
//! the read-only view another process maps of it ([`SharedRegionView`]); and handing its
//! file descriptor over a Unix socket ([`send_with_fds`], [`recv_with_fds`]); and reading
//! host memory of another process that is not memfd-backed with cross-memory attach
//! ([`PeerProcessRange`], `process_vm_readv`).
//!
//! # Why memfd
//! A [`HostRegion`] is a `MAP_SHARED` mapping of a `memfd_create` file rather than an
//! anonymous private mapping, so that a process on the same host that was handed the
//! file descriptor can map the same pages (the transport's shared-memory backend). The
//! file is sealed against resizing (`F_SEAL_SHRINK | F_SEAL_GROW`) before its descriptor
//! can leave this module: a reader's mapping can then never lose pages under it (which
//! would raise `SIGBUS`), whatever the owner does later. Once the owner's own mapping
//! exists, the file is also sealed against every later writer (`F_SEAL_FUTURE_WRITE |
//! F_SEAL_SEAL`): a process handed the descriptor can map it read-only, but neither map
//! it writable nor `write` to it, so a peer can read the owner's memory and never change
//! it. Explicit huge
//! pages work the same way (`MFD_HUGETLB`). Transparent huge pages follow the kernel's
//! *shmem* setting (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`) rather than the
//! anonymous one; [`HostRegion::pages`] reports what the setting allows.

use std::ffi::CStr;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::region::{DmaRegion, MemoryKind};

mod cma;
mod fds;
mod view;

pub use cma::{
    CmaError, CmaRead, MAX_CMA_IOVECS, PeerProcessRange, PeerRangeError, Ptracer, read_vectored,
    set_ptracer, socket_peer_pid, yama_ptrace_scope,
};
pub use fds::{MAX_FDS_PER_MESSAGE, recv_with_fds, send_with_fds};
pub(crate) use view::sealed_file;
pub use view::{ShareError, SharedRegionView};

/// Size of an explicit huge page (MAP_HUGE_2MB).
pub const HUGE_PAGE_SIZE: usize = 2 << 20;
/// Base page size assumed for rounding (the kernel rounds to its own page size anyway).
const PAGE_SIZE: usize = 4096;
/// Largest host region accepted (1 TiB): larger requests are configuration errors.
pub const MAX_HOST_REGION: usize = 1 << 40;

/// How hard [`HostRegion::new`] tries to use huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
        source: io::Error,
    },
}

/// One contiguous, page-aligned, zero-filled shared mapping of a sealed memfd, unmapped
/// on drop; its descriptor ([`DmaRegion::shared_fd`]) lets another process on this host
/// map the same bytes read-only ([`SharedRegionView`]).
pub struct HostRegion {
    map: Mapping,
    len: usize,
    pages: PageKind,
    /// The memfd behind the mapping (`mapped_len` bytes, sealed against shrinking).
    file: File,
}

/// A shared mapping of a whole file, unmapped (once) on drop: its start and the length
/// mapped. The only type here that needs `unsafe impl Send/Sync`, so that [`HostRegion`]
/// and [`SharedRegionView`] get them from their fields.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by exactly one `Mapping` (other processes may map the same
// file; that does not tie this mapping to a thread); mapped memory is not tied to the
// thread that mapped it, and it is unmapped once, in Drop, from whichever thread drops it.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only yields the address. Every access to the bytes goes through raw
// pointers under the owner's rules: `HostRegion`'s `DmaRegion` contract (bounds-checked
// copies, atomic words, the `unsafe` slice lenders with their own `# Safety`),
// `SharedRegionView`'s read-only copies and atomic loads, or the notification ring's
// (`ring.rs`) bounds-checked copies. No `&`/`&mut` to the bytes is tied to a shared
// `&Mapping`, except the ring's `&AtomicU64` to its header's index words, which are `Sync`
// and only ever accessed atomically in this process.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `file` shared, with protection `prot`.
    pub(crate) fn new(file: &File, len: usize, prot: libc::c_int) -> io::Result<Self> {
        // SAFETY: a new shared mapping of `file` at a kernel-chosen address touches no
        // existing memory; the result is checked against MAP_FAILED below. (For hugetlb
        // files the kernel reserves the huge pages here, so this is where "none free"
        // fails.)
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is exactly the mapping created in `new`, owned by
        // `self`; its owner lends no pointer into it beyond its own life.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            tracing::error!(%err, len = self.len, "munmap failed");
            debug_assert!(false, "munmap failed: {err}");
        }
    }
}

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
            match map_memfd(c"kvlease-host", mapped_len, true, Writers::OnlyThisMapping) {
                Ok((map, file)) => {
                    tracing::info!(len, mapped_len, "host region: explicit 2 MiB huge pages");
                    return Ok(Self {
                        map,
                        len,
                        pages: PageKind::Huge2M,
                        file,
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
                    "host region: no explicit huge pages (MFD_HUGETLB); falling back to normal pages + MADV_HUGEPAGE"
                ),
            }
        }
        let mapped_len = len.next_multiple_of(PAGE_SIZE);
        let (map, file) = map_memfd(c"kvlease-host", mapped_len, false, Writers::OnlyThisMapping)
            .map_err(|source| HostAllocError::Mmap {
            len: mapped_len,
            pages: "normal pages",
            source,
        })?;
        let mut pages = PageKind::Normal;
        if policy != HugePagePolicy::Never {
            // SAFETY: `ptr..ptr + mapped_len` is the mapping just created; madvise only
            // changes paging advice for it.
            let rc = unsafe { libc::madvise(map.as_ptr().cast(), mapped_len, libc::MADV_HUGEPAGE) };
            if rc != 0 {
                let err = io::Error::last_os_error();
                tracing::info!(%err, "host region: MADV_HUGEPAGE refused; normal pages");
            } else if shmem_thp_honours_advice() {
                pages = PageKind::TransparentHuge;
            } else {
                tracing::info!(
                    "host region: shmem transparent huge pages are off \
                     (transparent_hugepage/shmem_enabled); normal pages"
                );
            }
        }
        tracing::info!(len, mapped_len, ?pages, "host region mapped");
        Ok(Self {
            map,
            len,
            pages,
            file,
        })
    }

    /// Which pages the mapping got.
    pub fn pages(&self) -> PageKind {
        self.pages
    }

    /// Bytes actually mapped (the length rounded up to the page size).
    pub fn mapped_len(&self) -> usize {
        self.map.len
    }
}

/// Whether `MADV_HUGEPAGE` gets shmem mappings transparent huge pages: the kernel's
/// `shmem_enabled` setting is `always`, `within_size`, `advise` or `force` (not `never` or
/// `deny`). Unknown (no sysfs): assumed not.
fn shmem_thp_honours_advice() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").is_ok_and(|s| {
        ["[always]", "[within_size]", "[advise]", "[force]"]
            .iter()
            .any(|m| s.contains(m))
    })
}

/// Who may write a memfd's bytes once [`map_memfd`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writers {
    /// Only the mapping made here (`F_SEAL_FUTURE_WRITE`): whoever else gets the
    /// descriptor can map it read-only and not `write` to it.
    OnlyThisMapping,
    /// Anyone holding the descriptor (a ring whose producer is another process).
    AnyHolder,
}

/// Creates a memfd of `len` bytes (explicit 2 MiB pages when `huge`), seals its size,
/// maps all of it shared, readable and writable, and seals it against other writers as
/// `writers` says.
pub(crate) fn map_memfd(
    name: &CStr,
    len: usize,
    huge: bool,
    writers: Writers,
) -> io::Result<(Mapping, File)> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: the name is a NUL-terminated string that outlives the call; memfd_create
    // reads only it and returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len as u64)?;
    // The size is final: a reader that maps the file can never see pages vanish (SIGBUS).
    add_seals(&file, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)?;
    let map = Mapping::new(&file, len, libc::PROT_READ | libc::PROT_WRITE)?;
    // After the mapping above (which stays writable): later writable mappings and
    // `write`s are refused, so a peer handed the descriptor cannot write our memory.
    let last = match writers {
        Writers::OnlyThisMapping => libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL,
        Writers::AnyHolder => libc::F_SEAL_SEAL,
    };
    add_seals(&file, last)?;
    Ok((map, file))
}

fn add_seals(file: &File, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own reads no memory of ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegion")
            .field("ptr", &self.map.ptr)
            .field("len", &self.len)
            .field("mapped_len", &self.map.len)
            .field("pages", &self.pages)
            .finish()
    }
}

// SAFETY: the mapping is valid, fixed and host-readable/writable from any thread for
// `len` bytes for as long as `self` lives (it is unmapped only in `drop`).
unsafe impl DmaRegion for HostRegion {
    fn base_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.file.as_fd())
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
mod tests;
