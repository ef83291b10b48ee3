//! The block pool (layout + one contiguous allocation) and the fence words.

use std::ops::Range;
use std::sync::Arc;

use kvlease_lease::BlockId;

use crate::host::{HostAllocError, HostRegion};
use crate::layout::{KvLayout, LayoutError};
use crate::region::{DmaRegion, MemoryKind, RegionAccessError, RegionBytes};
use crate::request::MemoryRequest;

/// Why a pool could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The layout does not fit in memory addresses of this machine.
    #[error("pool of {bytes} bytes does not fit in this address space")]
    TooLarge {
        /// Bytes needed.
        bytes: u64,
    },
    /// Host allocation failed.
    #[error("host block pool allocation failed")]
    Host(#[from] HostAllocError),
    /// A CUDA kind was requested from a build without the `cuda` feature.
    #[error("{request:?} memory requested, but kvlease-gpu-mem was built without CUDA support")]
    NoCudaSupport {
        /// What was requested.
        request: MemoryRequest,
    },
    /// The CUDA allocation failed (no driver, no device, out of memory, ...).
    #[error("CUDA allocation of {bytes} bytes ({request:?}) failed: {source}")]
    Cuda {
        /// What was requested.
        request: MemoryRequest,
        /// Bytes asked for.
        bytes: usize,
        /// The CUDA layer's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A region handed to [`BlockPool::from_region`] is smaller than the layout.
    #[error("region of {len} bytes is smaller than the layout's {needed}")]
    RegionTooSmall {
        /// The region's length.
        len: usize,
        /// Bytes the layout needs.
        needed: u64,
    },
}

/// A KV block pool: a [`KvLayout`] over one contiguous allocation.
///
/// The pool is one region (registered once with the transport); the per-layer regions are
/// the sub-ranges [`layer_range`](Self::layer_range) of it. Allocation of block ids is
/// [`BlockAllocator`](crate::BlockAllocator)'s job, kept apart so that the lease table can
/// own it.
#[derive(Debug, Clone)]
pub struct BlockPool {
    layout: KvLayout,
    region: Arc<dyn DmaRegion>,
}

impl BlockPool {
    /// Allocates memory for `layout` as `request` asks.
    ///
    /// CUDA kinds go to `crate::cuda::alloc(request, bytes)` (the `cuda` feature's seam);
    /// [`MemoryRequest::Auto`] falls back to host memory with an `info` log line when that
    /// fails or the feature is off.
    ///
    /// # Errors
    /// [`PoolError::TooLarge`], [`PoolError::Host`], [`PoolError::NoCudaSupport`] (a CUDA
    /// kind in a build without `cuda`), [`PoolError::Cuda`].
    pub fn new(layout: KvLayout, request: MemoryRequest) -> Result<Self, PoolError> {
        let bytes = usize::try_from(layout.total_bytes()).map_err(|_| PoolError::TooLarge {
            bytes: layout.total_bytes(),
        })?;
        let region: Arc<dyn DmaRegion> = match request {
            MemoryRequest::Host => Arc::new(HostRegion::new(bytes)?),
            MemoryRequest::StagedHost => Arc::new(crate::host::StagedHostRegion::new(bytes)?),
            MemoryRequest::Auto => match alloc_cuda(request, bytes) {
                Ok(region) => region,
                Err(err) => {
                    tracing::info!(
                        error = %err,
                        bytes,
                        "block pool: no CUDA memory; falling back to host memory"
                    );
                    Arc::new(HostRegion::new(bytes)?)
                }
            },
            MemoryRequest::Pinned | MemoryRequest::Cuda { .. } => alloc_cuda(request, bytes)?,
        };
        Ok(Self { layout, region })
    }

    /// A pool over memory allocated elsewhere.
    ///
    /// # Errors
    /// [`PoolError::RegionTooSmall`].
    pub fn from_region(layout: KvLayout, region: Arc<dyn DmaRegion>) -> Result<Self, PoolError> {
        if (region.len() as u64) < layout.total_bytes() {
            return Err(PoolError::RegionTooSmall {
                len: region.len(),
                needed: layout.total_bytes(),
            });
        }
        Ok(Self { layout, region })
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The whole pool's memory, to register with the transport.
    pub fn region(&self) -> &Arc<dyn DmaRegion> {
        &self.region
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.region.kind()
    }

    /// Layer `layer`'s region inside [`region`](Self::region).
    ///
    /// # Errors
    /// [`LayoutError::LayerOutOfRange`].
    pub fn layer_range(&self, layer: u32) -> Result<Range<u64>, LayoutError> {
        self.layout.layer_range(layer)
    }

    /// Copies block `block` of `layer` into `out` (the first `out.len()` bytes of the
    /// block), whatever the memory kind: host memory directly, device memory through a
    /// staged copy ([`read_region`](crate::staging::read_region)).
    ///
    /// # Errors
    /// [`BlockCopyError::Layout`] for a layer or block outside the layout,
    /// [`BlockCopyError::Copy`] when the copy fails.
    pub fn read_block(
        &self,
        layer: u32,
        block: BlockId,
        out: &mut [u8],
    ) -> Result<(), BlockCopyError> {
        let offset = self.block_offset(layer, block)?;
        Ok(crate::staging::read_region(&*self.region, offset, out)?)
    }

    /// Copies `src` into block `block` of `layer`, whatever the memory kind (the
    /// counterpart of [`read_block`](Self::read_block)).
    ///
    /// # Errors
    /// As [`read_block`](Self::read_block).
    pub fn write_block(
        &self,
        layer: u32,
        block: BlockId,
        src: &[u8],
    ) -> Result<(), BlockCopyError> {
        let offset = self.block_offset(layer, block)?;
        Ok(crate::staging::write_region(&*self.region, offset, src)?)
    }

    fn block_offset(&self, layer: u32, block: BlockId) -> Result<usize, BlockCopyError> {
        let start = self.layout.block_range(layer, block)?.start;
        // The pool's length was checked against usize at construction.
        usize::try_from(start).map_err(|_| BlockCopyError::Layout(LayoutError::TooLarge))
    }
}

/// Why [`BlockPool::read_block`] or [`BlockPool::write_block`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BlockCopyError {
    /// The layer or block is outside the pool's layout.
    #[error("block outside the pool layout: {0}")]
    Layout(#[from] LayoutError),
    /// The copy into or out of the pool's memory failed.
    #[error("block copy failed: {0}")]
    Copy(#[from] crate::staging::StagingError),
}

#[cfg(feature = "cuda")]
fn alloc_cuda(request: MemoryRequest, bytes: usize) -> Result<Arc<dyn DmaRegion>, PoolError> {
    crate::cuda::alloc(request, bytes).map_err(|source| PoolError::Cuda {
        request,
        bytes,
        source: Box::new(source),
    })
}

#[cfg(not(feature = "cuda"))]
fn alloc_cuda(request: MemoryRequest, _bytes: usize) -> Result<Arc<dyn DmaRegion>, PoolError> {
    Err(PoolError::NoCudaSupport { request })
}

/// The fence words P publishes and D reads: one `u64` generation word per block, in a
/// small host region of its own (registered with the transport next to the pool).
///
/// P writes a lease's [`Generation`](kvlease_lease::Generation) word into the slot of every
/// block of the lease when it grants it, and
/// [`Generation::FREE_WORD`](kvlease_lease::Generation::FREE_WORD) into them *before* the
/// blocks are reused. Since a lease's blocks are released together, D checks one block's
/// word (any of them) at the end of its read batch: if it still equals the generation D
/// was given, no byte of the batch came from a reused block. Words are written and read
/// atomically (no tearing).
#[derive(Debug, Clone)]
pub struct FenceTable {
    region: Arc<dyn DmaRegion>,
    slots: u32,
}

impl FenceTable {
    /// Bytes per fence word.
    pub const WORD_BYTES: u64 = 8;

    /// A table of `num_blocks` words, all [`FREE_WORD`](kvlease_lease::Generation::FREE_WORD).
    ///
    /// # Errors
    /// [`HostAllocError`] when the region cannot be mapped (or `num_blocks` is 0).
    pub fn new(num_blocks: u32) -> Result<Self, HostAllocError> {
        let bytes = u64::from(num_blocks) * Self::WORD_BYTES;
        let bytes =
            usize::try_from(bytes).map_err(|_| HostAllocError::BadLength { len: usize::MAX })?;
        let region = HostRegion::with_policy(bytes, crate::host::HugePagePolicy::Never)?;
        Ok(Self {
            region: Arc::new(region),
            slots: num_blocks,
        })
    }

    /// A table of `num_blocks` words in the first `num_blocks * 8` bytes of `region`
    /// (memory another owner provides, e.g. a file mapping that a serving engine's
    /// scheduler and its workers share). The words keep whatever they hold.
    ///
    /// # Errors
    /// [`RegionAccessError::NotHostAccessible`] for device memory,
    /// [`RegionAccessError::OutOfBounds`] when the region is shorter than the table (or
    /// `num_blocks` is 0), [`RegionAccessError::Misaligned`] when the region's start is
    /// not 8-byte aligned.
    pub fn from_region(
        region: Arc<dyn DmaRegion>,
        num_blocks: u32,
    ) -> Result<Self, RegionAccessError> {
        let bytes = u64::from(num_blocks) * Self::WORD_BYTES;
        if num_blocks == 0 {
            return Err(RegionAccessError::OutOfBounds {
                offset: 0,
                len: 0,
                region_len: region.len() as u64,
            });
        }
        region.check_host_range(0, bytes)?;
        // An atomic access to the first word checks the alignment of them all.
        region.load_u64(0)?;
        Ok(Self {
            region,
            slots: num_blocks,
        })
    }

    /// Number of words.
    pub fn len(&self) -> u32 {
        self.slots
    }

    /// Whether the table has no words (never: construction refuses 0).
    pub fn is_empty(&self) -> bool {
        self.slots == 0
    }

    /// The region holding the words, to register with the transport.
    pub fn region(&self) -> Arc<dyn DmaRegion> {
        self.region.clone()
    }

    /// Offset of `block`'s word inside [`region`](Self::region).
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`] for a block past the table.
    pub fn word_offset(&self, block: BlockId) -> Result<u64, RegionAccessError> {
        if block.0 >= self.slots {
            return Err(RegionAccessError::OutOfBounds {
                offset: u64::from(block.0) * Self::WORD_BYTES,
                len: Self::WORD_BYTES,
                region_len: u64::from(self.slots) * Self::WORD_BYTES,
            });
        }
        Ok(u64::from(block.0) * Self::WORD_BYTES)
    }

    /// Publishes `word` for every block in `blocks` (all checked first).
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`] for a block past the table; nothing is written.
    pub fn publish(&self, blocks: &[BlockId], word: u64) -> Result<(), RegionAccessError> {
        let offsets = blocks
            .iter()
            .map(|&b| self.word_offset(b))
            .collect::<Result<Vec<_>, _>>()?;
        for offset in offsets {
            self.region.store_u64(offset, word)?;
        }
        Ok(())
    }

    /// The word published for `block`.
    ///
    /// # Errors
    /// [`RegionAccessError::OutOfBounds`] for a block past the table.
    pub fn word(&self, block: BlockId) -> Result<u64, RegionAccessError> {
        self.region.load_u64(self.word_offset(block)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_pool_covers_the_layout_and_layers_are_disjoint() {
        let layout = KvLayout::new(3, 8, 2, 16, 64, 2).expect("valid");
        let pool = BlockPool::new(layout, MemoryRequest::Host).expect("host memory");
        assert_eq!(pool.kind(), MemoryKind::Host);
        assert!(pool.region().len() as u64 >= layout.total_bytes());
        let r1 = pool.layer_range(1).expect("layer 1");
        pool.region()
            .write_from(r1.start, &[7; 16])
            .expect("layer start in bounds");
        let mut b = [0; 16];
        pool.region()
            .read_into(r1.start, &mut b)
            .expect("in bounds");
        assert_eq!(b, [7; 16]);
        pool.region()
            .read_into(r1.start - 16, &mut b)
            .expect("in bounds");
        assert_eq!(b, [0; 16], "layer 0 untouched");
    }

    /// Whether this machine has a usable CUDA GPU.
    #[cfg(feature = "cuda")]
    fn gpu_usable() -> bool {
        matches!(
            crate::cuda::probe(),
            crate::cuda::CudaAvailability::Available { .. }
        )
    }

    /// Never, without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    fn gpu_usable() -> bool {
        false
    }

    #[test]
    fn auto_pool_falls_back_to_host_without_cuda() {
        let layout = KvLayout::new(1, 4, 1, 16, 64, 2).expect("valid");
        let pool = BlockPool::new(layout, MemoryRequest::Auto).expect("auto always yields memory");
        // Where a GPU is usable Auto picks it: `auto_pool_is_device_memory_on_a_gpu` checks
        // that (gpu-check.sh runs it); everywhere else Auto must land on host memory.
        if !gpu_usable() {
            assert_eq!(pool.kind(), MemoryKind::Host);
        }
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            BlockPool::new(layout, MemoryRequest::Pinned),
            Err(PoolError::NoCudaSupport { .. })
        ));
    }

    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it"]
    fn auto_pool_is_device_memory_on_a_gpu() {
        assert!(gpu_usable(), "this test needs a usable CUDA GPU");
        let layout = KvLayout::new(1, 4, 1, 16, 64, 2).expect("valid");
        let pool = BlockPool::new(layout, MemoryRequest::Auto).expect("auto always yields memory");
        assert_eq!(pool.kind(), MemoryKind::CudaDevice { ordinal: 0 });
    }

    #[test]
    fn from_region_refuses_a_short_region() {
        let layout = KvLayout::new(1, 4, 1, 16, 64, 2).expect("valid");
        let small: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(100).expect("maps"));
        assert!(matches!(
            BlockPool::from_region(layout, small),
            Err(PoolError::RegionTooSmall { len: 100, .. })
        ));
    }

    #[test]
    fn fence_words_publish_and_bounds() {
        let fence = FenceTable::new(4).expect("maps");
        assert_eq!(fence.word(BlockId(3)), Ok(0));
        fence
            .publish(&[BlockId(1), BlockId(3)], 42)
            .expect("in table");
        assert_eq!(fence.word(BlockId(1)), Ok(42));
        assert_eq!(fence.word(BlockId(2)), Ok(0));
        assert_eq!(fence.region().load_u64(24), Ok(42));
        assert!(fence.publish(&[BlockId(0), BlockId(4)], 9).is_err());
        assert_eq!(
            fence.word(BlockId(0)),
            Ok(0),
            "refused publish writes nothing"
        );
        assert!(matches!(
            fence.region().load_u64(4),
            Err(RegionAccessError::Misaligned { offset: 4 })
        ));
    }

    #[test]
    fn a_fence_table_over_another_owners_memory_shares_its_words() {
        // Two tables over one region, as a scheduler and a worker over one shared file.
        let host: Arc<dyn DmaRegion> = Arc::new(HostRegion::new(4096).expect("maps"));
        let a = FenceTable::from_region(Arc::clone(&host), 16).expect("fits");
        let b = FenceTable::from_region(Arc::clone(&host), 16).expect("fits");
        a.publish(&[BlockId(2), BlockId(15)], 7).expect("in range");
        assert_eq!(b.word(BlockId(2)), Ok(7));
        assert_eq!(b.word(BlockId(15)), Ok(7));
        assert_eq!(b.word(BlockId(3)), Ok(0));
        assert!(matches!(
            a.publish(&[BlockId(16)], 1),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            FenceTable::from_region(Arc::clone(&host), 513),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        assert!(FenceTable::from_region(host, 0).is_err());
    }
}
