//! How an agent's region becomes readable (and writable) over verbs: one of three paths.
//!
//! - **Direct**: host-accessible memory (host, CUDA pinned) is registered with
//!   `ibv_reg_mr`; the NIC reads and writes the region itself.
//! - **Dmabuf**: CUDA device memory (with the `cuda` feature) is exported as a dmabuf and
//!   registered with `ibv_reg_dmabuf_mr` ([`ProtectionDomain::register`]); the NIC reads and
//!   writes device memory (GPUDirect RDMA), no copy.
//! - **Mirror**: memory neither path can register (CUDA device memory without dmabuf
//!   support, [`MemoryKind::StagedHost`]) gets a host mirror of the same length (CUDA pinned
//!   memory for CUDA regions, host memory for staged host regions), and the mirror is
//!   registered instead. Its address and rkey stand for the region in the agent's verbs
//!   metadata (`"mirrors"`, `"rkeys"`). The source copies region → mirror
//!   ([`Registration::sync_out`], `Agent::sync_for_peers`) before peers read; a read into
//!   a mirror-backed destination lands in the mirror and is copied mirror → region
//!   ([`Registration::sync_in`]) before its batch is reported done. A mirrored (or
//!   dmabuf) region gets no remote-write grant (`Agent::grant_write`): a peer's RDMA
//!   WRITE would land in the mirror with nothing of this agent to copy it into the
//!   region, so pushes into it go over TCP, landed by this agent's receiver. This is vLLM
//!   NixlConnector's `kv_buffer_device=cpu`: host transfer buffers the size of the KV cache,
//!   a device→host copy after prefill, a host→device copy after the read. It costs host
//!   memory equal to the region (pinned, and counted against `RLIMIT_MEMLOCK`) and one copy
//!   on each side of a transfer.

use std::sync::{Arc, Mutex};

use kvlease_gpu_mem::{DmaRegion, HostRegion, MemoryKind, RegionAccessError, RegionBytes, staging};

use super::error::MirrorError;
use super::{MemoryRegion, ProtectionDomain, VerbsError};
use crate::error::LinkError;

/// The registration path a memory kind tries first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// `ibv_reg_mr` on the region.
    Direct,
    /// dmabuf export + `ibv_reg_dmabuf_mr` (falls back to [`Path::Mirror`] when refused).
    Dmabuf,
    /// A registered host mirror.
    Mirror,
}

/// The memory a mirror of a `kind` region is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MirrorMemory {
    /// Page-aligned host memory.
    Host,
    /// CUDA pinned memory in the primary context of device `ordinal` (DMA-able by the
    /// GPU's copy engines at full speed).
    CudaPinned {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
}

/// The first path for `kind` (in a build with or without the `cuda` feature).
pub(crate) fn first_path(kind: MemoryKind, cuda: bool) -> Path {
    if kind.is_host_accessible() {
        Path::Direct
    } else if cuda && matches!(kind, MemoryKind::CudaDevice { .. }) {
        Path::Dmabuf
    } else {
        Path::Mirror
    }
}

/// The memory a mirror of a `kind` region is made of, or `None` for kinds that need none.
pub(crate) fn mirror_memory(kind: MemoryKind) -> Option<MirrorMemory> {
    match kind {
        MemoryKind::CudaDevice { ordinal } => Some(MirrorMemory::CudaPinned { ordinal }),
        MemoryKind::StagedHost => Some(MirrorMemory::Host),
        _ => None,
    }
}

/// Allocates a zeroed mirror of `len` bytes.
fn alloc_mirror(memory: MirrorMemory, len: usize) -> Result<Arc<dyn DmaRegion>, LinkError> {
    match memory {
        MirrorMemory::Host => HostRegion::new(len)
            .map(|r| Arc::new(r) as Arc<dyn DmaRegion>)
            .map_err(|e| {
                LinkError::Mirror(MirrorError::Alloc {
                    memory: "host",
                    len,
                    source: Box::new(e),
                })
            }),
        #[cfg(feature = "cuda")]
        MirrorMemory::CudaPinned { ordinal } => {
            kvlease_gpu_mem::cuda::CudaPinnedRegion::new(ordinal, len)
                .map(|r| Arc::new(r) as Arc<dyn DmaRegion>)
                .map_err(|e| {
                    LinkError::Mirror(MirrorError::Alloc {
                        memory: "cuda-pinned",
                        len,
                        source: Box::new(e),
                    })
                })
        }
        #[cfg(not(feature = "cuda"))]
        MirrorMemory::CudaPinned { ordinal } => {
            Err(LinkError::Mirror(MirrorError::NoCudaMirror { ordinal }))
        }
    }
}

/// A region of the agent as the verbs backend serves it.
#[derive(Clone, Debug)]
pub(crate) struct Registration {
    /// The agent's region.
    region: Arc<dyn DmaRegion>,
    /// The NIC's registration: of `region` itself, or of its mirror.
    mr: MemoryRegion,
    /// Held (by every clone) while [`sync_out`](Self::sync_out) or
    /// [`sync_in`](Self::sync_in) borrows the mirror's bytes: the one thing that keeps
    /// two syncs of overlapping ranges (`Agent::sync_for_peers` may run on several
    /// threads at once) from aliasing a `&mut` of the mirror.
    mirror_lock: Arc<Mutex<()>>,
}

impl Registration {
    /// Registers `region` on the first path its kind allows, a mirror where that is
    /// refused; the error says why neither worked.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        region: Arc<dyn DmaRegion>,
    ) -> Result<Self, LinkError> {
        let kind = region.kind();
        let refused = match first_path(kind, cfg!(feature = "cuda")) {
            Path::Direct | Path::Dmabuf => match pd.register(Arc::clone(&region)) {
                Ok(mr) => return Ok(Self::with_mr(region, mr)),
                Err(e @ VerbsError::UnsupportedMemory { .. }) => Some(e),
                Err(source) => {
                    return Err(LinkError::Mirror(MirrorError::Register {
                        op: "registering a region",
                        source,
                    }));
                }
            },
            Path::Mirror => None,
        };
        let Some(memory) = mirror_memory(kind) else {
            return Err(LinkError::Mirror(MirrorError::NotMirrorable {
                kind,
                source: refused,
            }));
        };
        let why = refused.map_or_else(
            || format!("{kind} memory has neither a direct nor a dmabuf path"),
            |e| e.to_string(),
        );
        let len = region.len();
        let mirror = alloc_mirror(memory, len)?;
        let mr = pd.register(mirror).map_err(|source| {
            LinkError::Mirror(MirrorError::Register {
                op: "registering a host mirror",
                source,
            })
        })?;
        tracing::info!(
            %kind,
            len,
            mirror = ?memory,
            reason = %why,
            "verbs: region served through a registered host mirror of the same length \
             (copied region->mirror by sync_for_peers, mirror->region after each read)"
        );
        Ok(Self::with_mr(region, mr))
    }

    fn with_mr(region: Arc<dyn DmaRegion>, mr: MemoryRegion) -> Self {
        Self {
            region,
            mr,
            mirror_lock: Arc::default(),
        }
    }

    /// The agent's region.
    pub(crate) fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.region
    }

    /// The registration the NIC uses (the mirror's, for a mirrored region).
    pub(crate) fn mr(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Whether the NIC works on a mirror rather than on the region.
    pub(crate) fn is_mirror(&self) -> bool {
        !Arc::ptr_eq(self.mr.region(), &self.region)
    }

    /// The address peers name in their reads (the mirror's, for a mirrored region).
    pub(crate) fn remote_base(&self) -> u64 {
        self.mr.region().base_ptr() as u64
    }

    /// Copies `offset..offset + len` region → mirror (device → host for CUDA memory), so
    /// that peers' reads see it. A no-op without a mirror.
    pub(crate) fn sync_out(&self, offset: u64, len: u64) -> Result<(), LinkError> {
        if !self.is_mirror() || len == 0 {
            return Ok(());
        }
        let region = &*self.region;
        let off = mirror_offset(offset, len, self.mr.len())?;
        let _mirror = self
            .mirror_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: no other Rust code touches this range of the mirror while the slice
        // lives. The mirror is private to this registration (created in `new`; only its
        // address and rkey leave it, for the NIC), and the only Rust accesses to its bytes
        // are `sync_out` and `sync_in`, serialized by `mirror_lock`, held here. The NIC's
        // writes (a local read landing in this mirror) are DMA, outside the Rust memory
        // model, and a protocol error (syncing a range that is also being read into).
        unsafe {
            self.mr
                .region()
                .with_bytes_mut(offset, len, |buf| staging::read_region(region, off, buf))
        }
        .map_err(|source| {
            LinkError::Mirror(MirrorError::Range {
                offset,
                len,
                source,
            })
        })?
        .map_err(|source| {
            LinkError::Mirror(MirrorError::SyncOut {
                kind: region.kind(),
                offset,
                len,
                source,
            })
        })
    }

    /// Copies `offset..offset + len` mirror → region (host → device for CUDA memory), after
    /// a read landed in the mirror. A no-op without a mirror.
    pub(crate) fn sync_in(&self, offset: u64, len: u64) -> Result<(), LinkError> {
        if !self.is_mirror() || len == 0 {
            return Ok(());
        }
        let region = &*self.region;
        let off = mirror_offset(offset, len, self.mr.len())?;
        let _mirror = self
            .mirror_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: no Rust code writes this range of the mirror while the slice lives: the
        // mirror is private to this registration, and its only Rust writer, `sync_out`,
        // waits for `mirror_lock`, held here. The NIC finished writing the range (the
        // reads into it completed before their batch copies back).
        unsafe {
            self.mr
                .region()
                .with_bytes(offset, len, |buf| staging::write_region(region, off, buf))
        }
        .map_err(|source| {
            LinkError::Mirror(MirrorError::Range {
                offset,
                len,
                source,
            })
        })?
        .map_err(|source| {
            LinkError::Mirror(MirrorError::SyncIn {
                kind: region.kind(),
                offset,
                len,
                source,
            })
        })
    }
}

/// `offset` as a `usize`, or the range error that `offset..offset + len` is outside a
/// region of `region_len` bytes (an offset beyond the address space is outside every
/// region).
fn mirror_offset(offset: u64, len: u64, region_len: u64) -> Result<usize, LinkError> {
    usize::try_from(offset).map_err(|_| {
        LinkError::Mirror(MirrorError::Range {
            offset,
            len,
            source: RegionAccessError::OutOfBounds {
                offset,
                len,
                region_len,
            },
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_accessible_kinds_register_directly() {
        for cuda in [false, true] {
            assert_eq!(first_path(MemoryKind::Host, cuda), Path::Direct);
            assert_eq!(first_path(MemoryKind::CudaPinned, cuda), Path::Direct);
        }
        assert_eq!(mirror_memory(MemoryKind::Host), None);
        assert_eq!(mirror_memory(MemoryKind::CudaPinned), None);
    }

    #[test]
    fn device_memory_tries_dmabuf_then_a_pinned_mirror_on_its_device() {
        let kind = MemoryKind::CudaDevice { ordinal: 3 };
        assert_eq!(first_path(kind, true), Path::Dmabuf);
        assert_eq!(first_path(kind, false), Path::Mirror);
        assert_eq!(
            mirror_memory(kind),
            Some(MirrorMemory::CudaPinned { ordinal: 3 })
        );
    }

    #[test]
    fn staged_host_memory_is_mirrored_in_host_memory() {
        for cuda in [false, true] {
            assert_eq!(first_path(MemoryKind::StagedHost, cuda), Path::Mirror);
        }
        assert_eq!(
            mirror_memory(MemoryKind::StagedHost),
            Some(MirrorMemory::Host)
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_pinned_mirror_needs_the_cuda_feature() {
        let err = alloc_mirror(MirrorMemory::CudaPinned { ordinal: 0 }, 4096).unwrap_err();
        assert!(
            matches!(
                err,
                LinkError::Mirror(MirrorError::NoCudaMirror { ordinal: 0 })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("`cuda` feature"), "{err}");
    }

    #[test]
    fn a_host_mirror_is_host_memory_of_the_same_length() {
        let m = alloc_mirror(MirrorMemory::Host, 3 * 4096 + 5).unwrap();
        assert_eq!(m.kind(), MemoryKind::Host);
        assert_eq!(m.len(), 3 * 4096 + 5);
    }
}
