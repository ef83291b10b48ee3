//! The seam between memory and the transport.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

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
    /// A file whose bytes `0..len()` are this region's bytes and whose size is sealed
    /// (a memfd with `F_SEAL_SHRINK`), which another process on this host may map to read
    /// them ([`SharedRegionView`](crate::SharedRegionView)); `None` (the default) for
    /// memory that cannot be shared that way.
    ///
    /// Not part of the `unsafe` contract: a reader validates what it maps (the seal and
    /// the size) and only ever copies out of its own mapping, so a wrong file gives it
    /// wrong bytes, never unsoundness.
    fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        None
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
/// The safe methods never create a Rust reference to region bytes: they copy through raw
/// pointers ([`read_into`](Self::read_into), [`write_from`](Self::write_from)), hand the
/// range to the kernel ([`write_to_fd`](Self::write_to_fd),
/// [`read_from_fd`](Self::read_from_fd): zero-copy socket IO, the kernel copying as a
/// NIC would), or access one word atomically ([`load_u64`](Self::load_u64) /
/// [`store_u64`](Self::store_u64), for generation words that must not tear). So a peer or
/// a thread that breaks the protocol can make the bytes seen unspecified, as with a NIC,
/// but cannot make safe code alias a `&mut`.
///
/// [`with_bytes`](Self::with_bytes) / [`with_bytes_mut`](Self::with_bytes_mut) do lend
/// `&[u8]` / `&mut [u8]`, and are `unsafe`: Rust's aliasing rules for those borrows cannot
/// be met by the DMA model above, so the caller must rule out overlapping access from
/// Rust code for as long as the closure runs (see their `# Safety` sections).
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

    /// Writes `header` and then `offset..offset + len` of the region to `fd` (a socket),
    /// with `writev` straight from the region: no staging copy, and no Rust reference to
    /// the region's bytes (the kernel reads them, as a NIC's RDMA READ would).
    ///
    /// The inner result is the IO outcome: the first error other than `EINTR`
    /// (`WouldBlock` when a send timeout expires), or `WriteZero`.
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); nothing is written then.
    fn write_to_fd(
        &self,
        header: &[u8],
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<io::Result<()>, RegionAccessError>;

    /// Reads exactly `len` bytes from `fd` (a socket) into `offset..offset + len` of the
    /// region, with `read` straight into the region: no staging copy, and no Rust
    /// reference to the region's bytes (the kernel writes them, as a NIC's RDMA READ into
    /// a local destination would).
    ///
    /// The inner result is the IO outcome: the first error other than `EINTR`
    /// (`WouldBlock` when a receive timeout expires), or `UnexpectedEof` when the stream
    /// ends early (the bytes that arrived are in the region).
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); nothing is read then.
    fn read_from_fd(
        &self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<io::Result<()>, RegionAccessError>;

    /// Lends `offset..offset + len` as a shared slice for the duration of `f`.
    ///
    /// Prefer [`read_into`](Self::read_into) or [`write_to_fd`](Self::write_to_fd), which
    /// are safe.
    ///
    /// # Safety
    /// While `f` runs, no Rust code may write any byte of `offset..offset + len` of this
    /// memory: no [`write_from`](Self::write_from), [`store_u64`](Self::store_u64),
    /// [`read_from_fd`](Self::read_from_fd) or `with_bytes_mut` of an overlapping range,
    /// on any thread and through any handle of the same memory (an `Arc` clone, another
    /// `DmaRegion` over it). A shared slice promises the compiler that its bytes do not
    /// change; the caller must make that true. (Writes by hardware — a NIC's DMA — are
    /// outside the Rust memory model; they are the lease protocol's business and make the
    /// bytes unspecified, as for any DMA buffer.)
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); `f` is not called then.
    unsafe fn with_bytes<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionAccessError>;

    /// Lends `offset..offset + len` as a mutable slice for the duration of `f`.
    ///
    /// Prefer [`write_from`](Self::write_from) or [`read_from_fd`](Self::read_from_fd),
    /// which are safe.
    ///
    /// # Safety
    /// While `f` runs, no Rust code other than `f` may read or write any byte of
    /// `offset..offset + len` of this memory: no other `with_bytes`/`with_bytes_mut` of
    /// an overlapping range and no [`read_into`](Self::read_into),
    /// [`write_from`](Self::write_from), [`load_u64`](Self::load_u64),
    /// [`store_u64`](Self::store_u64), [`write_to_fd`](Self::write_to_fd) or
    /// [`read_from_fd`](Self::read_from_fd) on it, on any thread and through any handle
    /// of the same memory (an `Arc` clone, another `DmaRegion` over it). Two calls on
    /// clones of one `Arc` would otherwise hand out aliased `&mut [u8]`. (Hardware DMA into
    /// the range is outside the Rust memory model, as for
    /// [`with_bytes`](Self::with_bytes).)
    ///
    /// # Errors
    /// As [`check_host_range`](Self::check_host_range); `f` is not called then.
    unsafe fn with_bytes_mut<R>(
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
pub(crate) fn host_ptr<T: DmaRegion + ?Sized>(
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

/// Checks that `offset..offset + len` lies inside `region_len` bytes (without overflow).
///
/// # Errors
/// [`RegionAccessError::OutOfBounds`] naming the three.
pub(crate) fn check_bounds(
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<(), RegionAccessError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(RegionAccessError::OutOfBounds {
            offset,
            len,
            region_len,
        }),
    }
}

/// Checks only the range (not the kind) and returns its start pointer.
fn range_ptr<T: DmaRegion + ?Sized>(
    region: &T,
    offset: u64,
    len: u64,
) -> Result<*mut u8, RegionAccessError> {
    check_bounds(offset, len, region.len() as u64)?;
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

/// Writes all of `header`, then all of `payload`, to `fd` (`writev`, retrying on `EINTR`
/// and after partial writes).
pub(crate) fn write_all_fd(fd: BorrowedFd<'_>, header: &[u8], payload: &[u8]) -> io::Result<()> {
    writev_all(fd, header, payload.as_ptr().cast_mut(), payload.len())
}

/// Writes all of `header`, then `len` bytes at `ptr` (a checked range of a host region,
/// or a borrowed slice) to `fd` with `writev`, retrying on `EINTR` and after partial
/// writes.
fn writev_all(
    fd: BorrowedFd<'_>,
    mut header: &[u8],
    mut ptr: *mut u8,
    mut len: usize,
) -> io::Result<()> {
    while !header.is_empty() || len > 0 {
        let iov = [
            libc::iovec {
                iov_base: header.as_ptr().cast_mut().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            },
        ];
        let iov = if header.is_empty() {
            &iov[1..]
        } else {
            &iov[..]
        };
        // SAFETY: each iovec names memory valid for reads for the whole call: `header` is
        // a live borrow, and `ptr..ptr + len` is the unsent tail of either a range that
        // `host_ptr` checked inside a host region the caller borrows (valid while it
        // lives, `DmaRegion` contract) or a slice `write_all_fd` borrows. `writev` only
        // reads them, into the kernel (the `*mut` is the iovec's type, never written
        // through), and creates no Rust reference to the region. `iov.len()` is 1 or 2.
        let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
        let Ok(mut n) = usize::try_from(n) else {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_header = n.min(header.len());
        header = &header[from_header..];
        n -= from_header;
        // The kernel wrote at most what it was given: `n <= len`.
        ptr = ptr.wrapping_add(n);
        len -= n;
    }
    Ok(())
}

/// Reads exactly `len` bytes from `fd` into `ptr..ptr + len` (a checked range of a host
/// region), retrying on `EINTR` and after short reads.
fn read_exact_fd(fd: BorrowedFd<'_>, ptr: *mut u8, len: usize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        // `read` takes at most `isize::MAX` bytes (the kernel caps it lower anyway).
        let want = (len - done).min(isize::MAX as usize);
        // SAFETY: `ptr + done .. ptr + done + want` lies inside a range that `host_ptr`
        // checked inside a host region the caller borrows, valid for writes from any
        // thread while it lives (`DmaRegion` contract). The kernel writes it directly (as
        // a NIC's DMA would); no Rust reference to the region's bytes is created.
        let n = unsafe { libc::read(fd.as_raw_fd(), ptr.wrapping_add(done).cast(), want) };
        match usize::try_from(n) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(_) => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
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

    fn write_to_fd(
        &self,
        header: &[u8],
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<io::Result<()>, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // `host_ptr` checked `offset + len <= self.len()`, a `usize`.
        Ok(writev_all(fd, header, ptr, len as usize))
    }

    fn read_from_fd(
        &self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<io::Result<()>, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // `host_ptr` checked `offset + len <= self.len()`, a `usize`.
        Ok(read_exact_fd(fd, ptr, len as usize))
    }

    unsafe fn with_bytes<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // SAFETY: the range is inside the region (checked by `host_ptr`, so `len` fits a
        // `usize`) and host memory that the `DmaRegion` contract keeps valid for reads
        // while `self` is borrowed, which outlives the closure call; the caller
        // guarantees that no Rust code writes it while the slice lives (`# Safety`).
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len as usize) };
        Ok(f(bytes))
    }

    unsafe fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RegionAccessError> {
        let ptr = host_ptr(self, offset, len)?;
        // SAFETY: the range is inside the region (checked by `host_ptr`) and host memory
        // valid for reads and writes from any thread while `self` is borrowed, which
        // outlives the closure call; the caller guarantees that no other Rust code
        // accesses it while the slice lives (`# Safety`), so the `&mut` is unique.
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::HostRegion;

    #[test]
    fn socket_io_goes_straight_between_region_and_fd() {
        let src = HostRegion::new(3 << 20).expect("maps");
        let data: Vec<u8> = (0..src.len()).map(|i| (i % 251) as u8).collect();
        src.write_from(0, &data).expect("in bounds");
        let (mut a, b) = UnixStream::pair().expect("socketpair");
        let len = (2 << 20) + 3;
        // The writer blocks until the reader drains: run it on its own thread.
        let writer = std::thread::spawn(move || {
            let sent = src.write_to_fd(b"HDR", 5, len, b.as_fd());
            (sent.expect("in bounds").map_err(|e| e.kind()), b)
        });
        let mut header = [0; 3];
        a.read_exact(&mut header).expect("header");
        assert_eq!(&header, b"HDR");
        let dst = HostRegion::new(3 << 20).expect("maps");
        dst.read_from_fd(7, len, a.as_fd())
            .expect("in bounds")
            .expect("all bytes arrive");
        let (sent, mut b) = writer.join().expect("writer");
        assert_eq!(sent, Ok(()));
        let mut got = vec![0; len as usize];
        dst.read_into(7, &mut got).expect("in bounds");
        assert!(got == data[5..5 + len as usize]);

        // A short stream is UnexpectedEof; a range outside the region is refused first.
        b.write_all(&[1, 2]).expect("socket open");
        drop(b);
        let short = dst.read_from_fd(0, 3, a.as_fd()).expect("in bounds");
        assert_eq!(
            short.map_err(|e| e.kind()),
            Err(io::ErrorKind::UnexpectedEof)
        );
        assert!(matches!(
            dst.read_from_fd(dst.len() as u64 - 1, 2, a.as_fd()),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            dst.write_to_fd(b"", 0, dst.len() as u64 + 1, a.as_fd()),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
    }
}
