//! Cross-memory attach: reading ranges of another process's memory on this host with
//! `process_vm_readv` (as UCX's `cma` transport does), for host memory that is not
//! memfd-backed and so cannot be mapped by a peer ([`ForeignRegion`](crate::ForeignRegion):
//! Python buffers and tensors, a serving engine's own CPU cache).
//!
//! The kernel decides who may read: `process_vm_readv` needs the same permission as
//! `ptrace` attach (`PTRACE_MODE_ATTACH_REALCREDS`): the same user and a dumpable target,
//! or `CAP_SYS_PTRACE`; under Yama (`/proc/sys/kernel/yama/ptrace_scope`) 1 only a
//! process the target named ([`set_ptracer`]) or one of its ancestors, under 2 only
//! `CAP_SYS_PTRACE`, under 3 nobody. A refusal is [`CmaError::Refused`].

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::MAX_HOST_REGION;
use crate::region::{DmaRegion, RegionAccessError, check_bounds};

/// Largest piece one `process_vm_readv` call is asked for (the kernel caps a call at
/// about 2 GiB).
const MAX_CALL: usize = 1 << 30;

/// Why a [`PeerProcessRange`] could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CmaError {
    /// The range lies outside the peer's range or the destination, or the destination is
    /// not host memory; nothing was read.
    #[error(transparent)]
    Access(#[from] RegionAccessError),
    /// The kernel refused the read before copying anything: `EPERM` (ptrace permission:
    /// Yama's `ptrace_scope`, another user, no `CAP_SYS_PTRACE`, a non-dumpable target)
    /// or `ESRCH` (no such process).
    #[error("the kernel refused process_vm_readv")]
    Refused {
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The read failed part-way or for another reason (`EFAULT`: the peer's range is no
    /// longer mapped; `ENOMEM`): the destination bytes are unspecified.
    #[error("process_vm_readv copied {copied} of {len} bytes")]
    Failed {
        /// Bytes copied before the failure.
        copied: usize,
        /// Bytes asked for.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl CmaError {
    /// Whether the kernel refused the read for want of permission, or because the process
    /// is gone (the caller falls back to another transport).
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Refused { .. })
    }
}

/// Why [`PeerProcessRange::new`] refused a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerRangeError {
    /// Process id 0, or one that does not fit a `pid_t`.
    #[error("process id {pid} is not a process")]
    BadPid {
        /// The id given.
        pid: u32,
    },
    /// Address 0, length 0, a length over [`MAX_HOST_REGION`], or a range that wraps the
    /// address space.
    #[error("the range {addr:#x}+{len} is not a range of host memory")]
    BadRange {
        /// The start address.
        addr: u64,
        /// The length.
        len: u64,
    },
}

/// `len` bytes at address `addr` of process `pid` (another process on this host, or this
/// one), read with `process_vm_readv`. Holds no reference to that process: the pid names
/// whichever process has it when a read runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerProcessRange {
    pid: libc::pid_t,
    addr: usize,
    len: usize,
}

impl PeerProcessRange {
    /// The range `addr .. addr + len` of process `pid`.
    ///
    /// # Errors
    /// [`PeerRangeError`] for pid 0 or one past `pid_t`, a null address, an empty range,
    /// one over [`MAX_HOST_REGION`] bytes or one that wraps.
    pub fn new(pid: u32, addr: u64, len: u64) -> Result<Self, PeerRangeError> {
        let pid = libc::pid_t::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .ok_or(PeerRangeError::BadPid { pid })?;
        let bad = PeerRangeError::BadRange { addr, len };
        let (Ok(a), Ok(l)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(bad);
        };
        if a == 0 || l == 0 || l > MAX_HOST_REGION || a.checked_add(l).is_none() {
            return Err(bad);
        }
        Ok(Self {
            pid,
            addr: a,
            len: l,
        })
    }

    /// The range's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty (never: [`new`](Self::new) refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The process the range belongs to.
    pub fn pid(&self) -> u32 {
        // Positive (checked in `new`).
        self.pid.unsigned_abs()
    }

    /// Copies `len` bytes at `offset` of this range into `dst` at `dst_offset` with
    /// `process_vm_readv` (a copy racing the owner's writes yields unspecified bytes, as
    /// [`SharedRegionView::copy_to`](crate::SharedRegionView::copy_to) does).
    ///
    /// # Errors
    /// [`CmaError::Access`] when either range lies outside its region or `dst` is not
    /// host memory (nothing read); [`CmaError::Refused`] when the kernel refuses the read
    /// (nothing read); [`CmaError::Failed`] otherwise.
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &dyn DmaRegion,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), CmaError> {
        check_bounds(offset, len, self.len as u64)?;
        let to = crate::region::host_ptr(dst, dst_offset, len)?;
        // Both fit a `usize`: inside this range (checked above).
        read_one(
            self.pid,
            self.addr + offset as usize,
            to,
            len as usize,
            true,
        )
    }
}

/// Reads `len` bytes at `at` of process `pid` into `to .. to + len`, in calls of at most
/// [`MAX_CALL`] bytes. `first`: nothing was read before, so a refusal is
/// [`CmaError::Refused`] (else [`CmaError::Failed`]).
fn read_one(
    pid: libc::pid_t,
    at: usize,
    to: *mut u8,
    len: usize,
    first: bool,
) -> Result<(), CmaError> {
    let mut copied = 0;
    while copied < len {
        let part = (len - copied).min(MAX_CALL);
        let local = libc::iovec {
            iov_base: to.wrapping_add(copied).cast(),
            iov_len: part,
        };
        let remote = libc::iovec {
            iov_base: std::ptr::without_provenance_mut(at + copied),
            iov_len: part,
        };
        // SAFETY: the caller checked that `to .. to + len` lies inside a destination's
        // host memory (`host_ptr`), writable from any thread while it lives (`DmaRegion`
        // contract; the kernel writes it like a DMA engine, no Rust reference to it
        // exists). The remote iovec names memory of another address space, which the
        // kernel checks and never dereferences in ours. The iovecs live on this stack for
        // the call.
        let n =
            unsafe { libc::process_vm_readv(pid, &raw const local, 1, &raw const remote, 1, 0) };
        match usize::try_from(n) {
            Ok(0) => {
                return Err(CmaError::Failed {
                    copied,
                    len,
                    source: io::ErrorKind::UnexpectedEof.into(),
                });
            }
            Ok(n) => copied += n,
            Err(_) => {
                let source = io::Error::last_os_error();
                match source.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EPERM | libc::ESRCH) if first && copied == 0 => {
                        return Err(CmaError::Refused { source });
                    }
                    _ => {
                        return Err(CmaError::Failed {
                            copied,
                            len,
                            source,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

impl PeerProcessRange {
    /// Reads the native-endian `u64` word at `offset` (8-aligned in the peer's address
    /// space) with one `process_vm_readv`. The kernel copies it with no atomicity
    /// promise, but a word the peer stores atomically changes all its bytes at one
    /// instant: a read that returns a byte of the old value started before that store.
    ///
    /// # Errors
    /// [`CmaError::Access`] for a range outside this one or a misaligned word;
    /// otherwise as [`copy_to`](Self::copy_to).
    pub fn read_u64(&self, offset: u64) -> Result<u64, CmaError> {
        check_bounds(offset, 8, self.len as u64)?;
        // Inside this range, a `usize`.
        let at = self.addr + offset as usize;
        if !at.is_multiple_of(8) {
            return Err(RegionAccessError::Misaligned { offset }.into());
        }
        let mut word = [0u8; 8];
        let local = libc::iovec {
            iov_base: word.as_mut_ptr().cast(),
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: std::ptr::without_provenance_mut(at),
            iov_len: 8,
        };
        // SAFETY: the local iovec is `word`, 8 bytes on this stack, writable; the remote
        // one names memory of another address space, checked by the kernel. Both live
        // for the call.
        let n = unsafe {
            libc::process_vm_readv(self.pid, &raw const local, 1, &raw const remote, 1, 0)
        };
        if n == 8 {
            return Ok(u64::from_ne_bytes(word));
        }
        let source = if n < 0 {
            io::Error::last_os_error()
        } else {
            io::ErrorKind::UnexpectedEof.into()
        };
        Err(match source.raw_os_error() {
            Some(libc::EPERM | libc::ESRCH) => CmaError::Refused { source },
            _ => CmaError::Failed {
                copied: usize::try_from(n).unwrap_or(0),
                len: 8,
                source,
            },
        })
    }
}

/// Most reads one `process_vm_readv` call of [`read_vectored`] takes (the kernel's
/// `IOV_MAX`).
pub const MAX_CMA_IOVECS: usize = 1024;

/// One read of [`read_vectored`]: `len` bytes at `offset` of `src` into `dst` at
/// `dst_offset`.
#[derive(Debug, Clone, Copy)]
pub struct CmaRead<'a> {
    /// The peer's range.
    pub src: &'a PeerProcessRange,
    /// Where in it.
    pub offset: u64,
    /// The destination (host memory).
    pub dst: &'a dyn DmaRegion,
    /// Where in it.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Performs `reads` (all of one process) with as few `process_vm_readv` calls as it
/// can: up to [`MAX_CMA_IOVECS`] reads and 1 GiB per call, one system call instead of one
/// per read. Every range is checked before the first call.
///
/// # Errors
/// [`CmaError::Access`] when a range lies outside its region or a destination is not host
/// memory, or the reads name more than one process (nothing read); [`CmaError::Refused`]
/// when the kernel refuses the first call; [`CmaError::Failed`] otherwise (the
/// destinations' bytes are unspecified).
pub fn read_vectored(reads: &[CmaRead<'_>]) -> Result<(), CmaError> {
    let Some(first) = reads.first() else {
        return Ok(());
    };
    let pid = first.src.pid;
    let mut iovecs = Vec::with_capacity(reads.len());
    for r in reads {
        if r.src.pid != pid {
            return Err(RegionAccessError::OutOfBounds {
                offset: r.offset,
                len: r.len,
                region_len: 0,
            }
            .into());
        }
        check_bounds(r.offset, r.len, r.src.len as u64)?;
        let to = crate::region::host_ptr(r.dst, r.dst_offset, r.len)?;
        // Inside the peer's range: fits a `usize`.
        iovecs.push((to, r.src.addr + r.offset as usize, r.len as usize));
    }
    let mut copied = 0usize;
    let total: usize = iovecs.iter().map(|&(.., len)| len).sum();
    let mut rest = &iovecs[..];
    while let Some(&(to, at, len)) = rest.first() {
        if len > MAX_CALL {
            // One read past what one call takes: in pieces.
            read_one(pid, at, to, len, copied == 0)?;
            copied += len;
            rest = &rest[1..];
            continue;
        }
        let mut n = 0;
        let mut bytes = 0;
        while n < rest.len().min(MAX_CMA_IOVECS) && bytes + rest[n].2 <= MAX_CALL {
            bytes += rest[n].2;
            n += 1;
        }
        let local: Vec<libc::iovec> = rest[..n]
            .iter()
            .map(|&(to, _, len)| libc::iovec {
                iov_base: to.cast(),
                iov_len: len,
            })
            .collect();
        let remote: Vec<libc::iovec> = rest[..n]
            .iter()
            .map(|&(_, at, len)| libc::iovec {
                iov_base: std::ptr::without_provenance_mut(at),
                iov_len: len,
            })
            .collect();
        // `n <= MAX_CMA_IOVECS`, a `c_ulong`.
        let count = n as libc::c_ulong;
        // SAFETY: each local iovec lies inside its destination's host memory (checked by
        // `host_ptr` above), writable from any thread while the destination lives
        // (`DmaRegion` contract; the kernel writes it like a DMA engine, no Rust reference
        // to it exists). The remote iovecs name memory of another address space, which the
        // kernel checks and never dereferences in ours. Both arrays live for the call.
        let got = unsafe {
            libc::process_vm_readv(pid, local.as_ptr(), count, remote.as_ptr(), count, 0)
        };
        match usize::try_from(got) {
            Ok(got) if got == bytes => {
                copied += bytes;
                rest = &rest[n..];
            }
            Ok(got) => {
                return Err(CmaError::Failed {
                    copied: copied + got,
                    len: total,
                    source: io::ErrorKind::UnexpectedEof.into(),
                });
            }
            Err(_) => {
                let source = io::Error::last_os_error();
                match source.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EPERM | libc::ESRCH) if copied == 0 => {
                        return Err(CmaError::Refused { source });
                    }
                    _ => {
                        return Err(CmaError::Failed {
                            copied,
                            len: total,
                            source,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whom [`set_ptracer`] lets read this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ptracer {
    /// That process (and its descendants), in place of the one named before: Yama keeps
    /// one per process.
    Process(u32),
    /// Any process of the same user (`PR_SET_PTRACER_ANY`).
    Any,
}

/// Names who may read (and trace) this process under Yama's `ptrace_scope` 1
/// (`prctl(PR_SET_PTRACER)`). Without Yama the call fails with `EINVAL` and changes
/// nothing (the ordinary ptrace rules apply).
///
/// # Errors
/// The OS error of `prctl` (`EINVAL`: no Yama, or no such process).
pub fn set_ptracer(who: Ptracer) -> io::Result<()> {
    let arg: libc::c_ulong = match who {
        Ptracer::Any => libc::PR_SET_PTRACER_ANY,
        Ptracer::Process(pid) => libc::c_ulong::from(pid),
    };
    // SAFETY: prctl(PR_SET_PTRACER, pid) reads no memory of ours; it only records the
    // tracer in Yama's table.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, arg, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The process id of the peer of the Unix socket `socket`, as the kernel recorded it
/// (`SO_PEERCRED`: the process that connected it, or that called `listen` on the other
/// end), in this process's pid namespace; `None` when that process is not visible there.
///
/// # Errors
/// The OS error of `getsockopt`.
pub fn socket_peer_pid(socket: BorrowedFd<'_>) -> io::Result<Option<u32>> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given; getsockopt writes
    // at most `len` bytes into `cred` and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(cred.pid).ok().filter(|&p| p > 0))
}

/// Yama's `ptrace_scope` (`/proc/sys/kernel/yama/ptrace_scope`), `None` without Yama: for
/// the log line that explains a refusal.
pub fn yama_ptrace_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{ForeignRegion, HostRegion, MemoryKind, RegionBytes};

    fn own(bytes: &[u8]) -> PeerProcessRange {
        PeerProcessRange::new(
            std::process::id(),
            bytes.as_ptr() as u64,
            bytes.len() as u64,
        )
        .expect("a valid range")
    }

    #[test]
    fn reads_this_processes_heap_through_the_kernel() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let range = own(&src);
        let dst = HostRegion::new(200_000).expect("host memory");
        range.copy_to(7, &dst, 3, 99_000).expect("readable");
        let mut got = vec![0; 99_000];
        dst.read_into(3, &mut got).expect("in bounds");
        assert_eq!(got, src[7..99_007]);
    }

    #[test]
    fn out_of_range_reads_and_device_destinations_are_refused_before_the_call() {
        let src = vec![1u8; 4096];
        let range = own(&src);
        let dst = HostRegion::new(8192).expect("host memory");
        assert!(matches!(
            range.copy_to(4000, &dst, 0, 97),
            Err(CmaError::Access(RegionAccessError::OutOfBounds { .. }))
        ));
        assert!(matches!(
            range.copy_to(0, &dst, 8190, 8),
            Err(CmaError::Access(RegionAccessError::OutOfBounds { .. }))
        ));
        // SAFETY: a device kind is never dereferenced on the host.
        let device = unsafe {
            ForeignRegion::new(
                std::ptr::dangling_mut(),
                4096,
                MemoryKind::CudaDevice { ordinal: 0 },
                Box::new(()),
            )
        }
        .expect("a valid range");
        let device: Arc<dyn DmaRegion> = Arc::new(device);
        assert!(matches!(
            range.copy_to(0, device.as_ref(), 0, 8),
            Err(CmaError::Access(
                RegionAccessError::NotHostAccessible { .. }
            ))
        ));
    }

    #[test]
    fn words_are_read_aligned_and_in_range() {
        let words: Vec<u64> = (0..16).map(|i| i * 0x0101_0101).collect();
        let bytes: &[u8] = bytemuck_free(&words);
        let range = own(bytes);
        assert_eq!(range.read_u64(24).expect("aligned"), 3 * 0x0101_0101);
        assert!(matches!(
            range.read_u64(4),
            Err(CmaError::Access(RegionAccessError::Misaligned {
                offset: 4
            }))
        ));
        assert!(matches!(
            range.read_u64(124),
            Err(CmaError::Access(RegionAccessError::OutOfBounds { .. }))
        ));
    }

    /// The bytes of `words` (a `Vec<u64>` is 8-aligned).
    fn bytemuck_free(words: &[u64]) -> &[u8] {
        // SAFETY: any initialised `u64`s are valid bytes; the length is in bytes of the
        // same allocation, borrowed for as long as `words`.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
    }

    #[test]
    fn many_reads_go_in_one_call_and_are_checked_first() {
        let a: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
        let b: Vec<u8> = (0..5000u32).map(|i| (i % 7) as u8).collect();
        let (ra, rb) = (own(&a), own(&b));
        let dst = HostRegion::new(1 << 20).expect("host memory");
        let reads: Vec<CmaRead<'_>> = (0..2000u64)
            .map(|i| CmaRead {
                src: if i % 2 == 0 { &ra } else { &rb },
                offset: i,
                dst: &dst,
                dst_offset: i * 100,
                len: 64,
            })
            .collect();
        read_vectored(&reads).expect("readable");
        for i in [0u64, 1, 1023, 1024, 1999] {
            let mut got = [0u8; 64];
            dst.read_into(i * 100, &mut got).expect("in bounds");
            let src = if i % 2 == 0 { &a } else { &b };
            assert_eq!(got[..], src[i as usize..i as usize + 64], "read {i}");
        }
        let mut bad = reads[..3].to_vec();
        bad[1].offset = 4990; // `b` has 5000 bytes
        dst.write_from(0, &[9; 8]).expect("in bounds");
        assert!(matches!(
            read_vectored(&bad),
            Err(CmaError::Access(RegionAccessError::OutOfBounds { .. }))
        ));
        let mut first = [0u8; 8];
        dst.read_into(0, &mut first).expect("in bounds");
        assert_eq!(first, [9; 8], "nothing read before the checks passed");
        assert!(read_vectored(&[]).is_ok());
    }

    #[test]
    fn bad_ranges_and_pids_are_refused() {
        assert_eq!(
            PeerProcessRange::new(0, 4096, 8),
            Err(PeerRangeError::BadPid { pid: 0 })
        );
        assert_eq!(
            PeerProcessRange::new(u32::MAX, 4096, 8),
            Err(PeerRangeError::BadPid { pid: u32::MAX })
        );
        for (addr, len) in [(0, 8), (4096, 0), (u64::MAX - 3, 8)] {
            assert_eq!(
                PeerProcessRange::new(1, addr, len),
                Err(PeerRangeError::BadRange { addr, len })
            );
        }
    }

    #[test]
    fn an_unmapped_peer_range_fails_and_a_missing_process_is_a_refusal() {
        let dst = HostRegion::new(4096).expect("host memory");
        // Page 0 of this process is never mapped.
        let unmapped = PeerProcessRange::new(std::process::id(), 4096, 4096).expect("a range");
        assert!(matches!(
            unmapped.copy_to(0, &dst, 0, 64),
            Err(CmaError::Failed { copied: 0, .. })
        ));
        // Beyond pid_max (at most 2^22): no such process.
        let gone = PeerProcessRange::new((1 << 22) + 1, 1 << 20, 4096).expect("a range");
        let err = gone.copy_to(0, &dst, 0, 64).expect_err("no such process");
        assert!(err.is_refusal(), "{err:?}");
    }
}
