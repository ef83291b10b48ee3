//! Page-aligned host memory: one shared mapping of a sealed memfd, huge pages tried first;
//! the read-only view another process maps of it ([`SharedRegionView`]); and handing its
//! file descriptor over a Unix socket ([`send_with_fds`], [`recv_with_fds`]).
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

use crate::region::{DmaRegion, MemoryKind, RegionAccessError};

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

/// Why a peer's shared region could not be mapped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
/// peer's [`HostRegion`] with it).
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
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => {}
            _ => {
                return Err(RegionAccessError::OutOfBounds {
                    offset,
                    len,
                    region_len: self.len as u64,
                });
            }
        }
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

/// Most descriptors [`send_with_fds`] sends and [`recv_with_fds`] accepts in one message.
pub const MAX_FDS_PER_MESSAGE: usize = 16;

/// Room for `MAX_FDS_PER_MESSAGE` descriptors in a control message, in `u64`s (aligned
/// for `cmsghdr`).
const CMSG_WORDS: usize = 16 + MAX_FDS_PER_MESSAGE / 2;

/// Sends `bytes` on the Unix stream socket `socket` with `fds` attached (`SCM_RIGHTS`, on
/// the first byte), retrying on `EINTR` and after partial sends (the descriptors go with
/// the first part).
///
/// # Errors
/// `InvalidInput` for no bytes or more than [`MAX_FDS_PER_MESSAGE`] descriptors; the OS
/// error of `sendmsg` (`EPIPE` and the like; `SIGPIPE` is suppressed).
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    if bytes.is_empty() || fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let raw: Vec<libc::c_int> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let data_len = size_of_val(raw.as_slice());
    let mut cmsg = [0u64; CMSG_WORDS];
    let mut sent = 0;
    let mut first = true;
    while sent < bytes.len() {
        let rest = &bytes[sent..];
        let mut iov = libc::iovec {
            iov_base: rest.as_ptr().cast_mut().cast(),
            iov_len: rest.len(),
        };
        // SAFETY: an all-zero msghdr is a valid "no name, no iov, no control" value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        if first && !raw.is_empty() {
            // `data_len` is at most 16 * 4 bytes.
            // SAFETY: CMSG_SPACE only computes a size.
            let space = unsafe { libc::CMSG_SPACE(data_len as libc::c_uint) } as usize;
            debug_assert!(space <= size_of_val(&cmsg));
            msg.msg_control = cmsg.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: `msg.msg_control` points at `space` zeroed, u64-aligned bytes, room
            // for one header (CMSG_SPACE of the payload), so the first header is non-null
            // and inside the buffer.
            let hdr = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
            // SAFETY: CMSG_LEN only computes a size.
            let hdr_len = unsafe { libc::CMSG_LEN(data_len as libc::c_uint) } as usize;
            let header = libc::cmsghdr {
                cmsg_len: hdr_len as _,
                cmsg_level: libc::SOL_SOCKET,
                cmsg_type: libc::SCM_RIGHTS,
            };
            // SAFETY: `hdr` is the aligned first header slot inside `cmsg` (see above).
            unsafe { hdr.write(header) };
            // SAFETY: CMSG_DATA of a header inside the buffer points at its payload, which
            // CMSG_SPACE sized for `data_len` bytes.
            let data = unsafe { libc::CMSG_DATA(hdr) };
            // SAFETY: `data..data + data_len` lies inside `cmsg` (sized by CMSG_SPACE);
            // `raw` is a distinct allocation of exactly `data_len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), data, data_len) };
        }
        // SAFETY: `msg` names one iovec over the live borrow `rest` and, on the first
        // send, the control buffer `cmsg` built above; sendmsg only reads them.
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
        let Ok(n) = usize::try_from(n) else {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        first = false;
        sent += n;
    }
    Ok(())
}

/// Receives at most `buf.len()` bytes from the Unix stream socket `socket` (one
/// `recvmsg`, retried on `EINTR`) with the descriptors attached to them (`SCM_RIGHTS`,
/// close-on-exec). Returns the bytes received (0: the peer closed) and the descriptors.
///
/// # Errors
/// `InvalidData` when the control data was truncated (more than
/// [`MAX_FDS_PER_MESSAGE`] descriptors; those that arrived are closed); the OS error of
/// `recvmsg` (`WouldBlock` when a receive timeout expires).
pub fn recv_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = [0u64; CMSG_WORDS];
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: an all-zero msghdr is a valid "no name, no iov, no control" value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&cmsg) as _;
        // SAFETY: `msg` names one iovec over the live `&mut buf` and the control buffer
        // `cmsg`, both writable for their lengths; recvmsg writes only inside them.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
        let Ok(n) = usize::try_from(n) else {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        };
        let mut fds = Vec::new();
        // SAFETY: `msg` was filled by recvmsg: its control pointer and (kernel-set) length
        // describe headers inside `cmsg`; CMSG_FIRSTHDR returns the first or null.
        let mut hdr = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
        while !hdr.is_null() {
            // SAFETY: a non-null header from CMSG_FIRSTHDR/CMSG_NXTHDR lies inside `cmsg`
            // (the kernel wrote it) and is aligned for `cmsghdr`.
            let h = unsafe { hdr.read() };
            if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN only computes a size.
                let head = unsafe { libc::CMSG_LEN(0) } as usize;
                let count = (h.cmsg_len as usize).saturating_sub(head) / 4;
                // SAFETY: the payload of a header inside `cmsg`.
                let data = unsafe { libc::CMSG_DATA(hdr) }.cast::<libc::c_int>();
                for i in 0..count {
                    // SAFETY: the kernel wrote `count` descriptors after the header, inside
                    // `cmsg`; the payload need not be aligned for `c_int`.
                    let fd = unsafe { data.wrapping_add(i).read_unaligned() };
                    // SAFETY: SCM_RIGHTS installed `fd` in this process for us alone.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            // SAFETY: `hdr` is a header inside `msg`'s control buffer; CMSG_NXTHDR returns
            // the next one inside it or null.
            hdr = unsafe { libc::CMSG_NXTHDR(&raw const msg, hdr) };
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more descriptors than MAX_FDS_PER_MESSAGE",
            ));
        }
        return Ok((n, fds));
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
    fn a_view_sees_the_owners_writes_through_a_passed_descriptor() {
        let owner = HostRegion::new(3 << 20).expect("maps");
        owner.write_from(4096, b"before").expect("in bounds");
        owner.store_u64(8, 7).expect("aligned");
        // Hand the descriptor over a socket pair, as to another process.
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        let fd = owner.shared_fd().expect("host regions are shareable");
        send_with_fds(a.as_fd(), b"R", &[fd]).expect("sent");
        let mut buf = [0u8; 4];
        let (n, mut fds) = recv_with_fds(b.as_fd(), &mut buf).expect("received");
        assert_eq!((n, fds.len(), buf[0]), (1, 1, b'R'));
        let view = SharedRegionView::map(fds.pop().expect("one fd"), owner.len() as u64)
            .expect("sealed memfd maps");
        let dst = HostRegion::with_policy(4096, HugePagePolicy::Never).expect("maps");
        view.copy_to(4096, &dst, 10, 6).expect("in bounds");
        let mut got = [0u8; 6];
        dst.read_into(10, &mut got).expect("in bounds");
        assert_eq!(&got, b"before");
        // Later writes by the owner are visible: the same pages.
        owner.write_from(4096, b"after!").expect("in bounds");
        owner.store_u64(8, 8).expect("aligned");
        view.copy_to(4096, &dst, 10, 6).expect("in bounds");
        dst.read_into(10, &mut got).expect("in bounds");
        assert_eq!(&got, b"after!");
        assert_eq!(view.load_u64(8), Ok(8));
        assert!(matches!(
            view.load_u64(4),
            Err(RegionAccessError::Misaligned { .. })
        ));
        // Bounds on both sides; nothing copied then.
        let end = owner.len() as u64;
        assert!(matches!(
            view.copy_to(end - 3, &dst, 0, 4),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            view.copy_to(0, &dst, 4093, 4),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        // The view outlives the owner's mapping.
        drop(owner);
        assert_eq!(view.load_u64(8), Ok(8));
    }

    #[test]
    fn a_peer_holding_the_descriptor_cannot_write_the_owners_memory() {
        use std::os::unix::fs::FileExt;
        let owner = HostRegion::with_policy(8192, HugePagePolicy::Never).expect("maps");
        owner
            .write_from(0, b"owner")
            .expect("the owner still writes");
        let fd = || {
            owner
                .shared_fd()
                .expect("shareable")
                .try_clone_to_owned()
                .expect("dup")
        };
        // No `write` through the descriptor (nor through a reopened one: the seal is on
        // the file).
        let file = File::from(fd());
        let err = file
            .write_at(b"peer", 0)
            .expect_err("sealed against writes");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        let reopened = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .expect("reopen");
        assert!(reopened.write_at(b"peer", 0).is_err());
        // No writable shared mapping of it either.
        let err = Mapping::new(&file, 8192, libc::PROT_READ | libc::PROT_WRITE)
            .err()
            .expect("sealed against writable mappings");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        // Read-only views work, and the owner's writes still land.
        let view = SharedRegionView::map(fd(), 8192).expect("read-only view");
        owner
            .write_from(0, b"again")
            .expect("the owner still writes");
        let dst = HostRegion::with_policy(4096, HugePagePolicy::Never).expect("maps");
        view.copy_to(0, &dst, 0, 5).expect("in bounds");
        let mut got = [0u8; 5];
        dst.read_into(0, &mut got).expect("in bounds");
        assert_eq!(&got, b"again");
    }

    #[test]
    fn unsealed_or_short_files_are_refused() {
        let owner = HostRegion::with_policy(8192, HugePagePolicy::Never).expect("maps");
        let fd = owner
            .shared_fd()
            .expect("shareable")
            .try_clone_to_owned()
            .expect("dup");
        assert!(matches!(
            SharedRegionView::map(fd, 8193),
            Err(ShareError::TooShort {
                file_len: 8192,
                len: 8193
            })
        ));
        let fd = owner
            .shared_fd()
            .expect("shareable")
            .try_clone_to_owned()
            .expect("dup");
        assert!(matches!(
            SharedRegionView::map(fd, 0),
            Err(ShareError::BadLength { .. })
        ));
        // A pipe (or any file without seals) is not mapped.
        let (r, _w) = io::pipe().expect("pipe");
        assert!(matches!(
            SharedRegionView::map(OwnedFd::from(r), 10),
            Err(ShareError::NotSealed)
        ));
        // Staged host memory is never shared.
        let staged = StagedHostRegion::new(4096).expect("maps");
        assert!(staged.shared_fd().is_none());
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
