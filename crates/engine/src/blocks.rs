//! Where a core's block ids come from: its own pool, or the serving engine's KV cache
//! manager (vLLM allocates every block itself and tells the connector which ones a
//! request got).

use kvlease_lease::{AllocError, BlockAllocator, BlockId};

/// Where a core's block ids come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockSource {
    /// The core allocates from its own pool of `num_blocks` blocks
    /// ([`PrefillCore::poll_prefill`](crate::PrefillCore::poll_prefill),
    /// [`DecodeCore::poll_load`](crate::DecodeCore::poll_load)) and frees into it: the
    /// agents and the simulator.
    #[default]
    Pool,
    /// The serving engine allocates (vLLM's KV cache manager): the core is told which
    /// blocks a request got
    /// ([`PrefillCore::handle_prefill_done_in`](crate::PrefillCore::handle_prefill_done_in),
    /// [`DecodeCore::start_load`](crate::DecodeCore::start_load)), never hands blocks out
    /// itself, and reports when they may be freed (a release's
    /// [`PrefillAction::ClearFences`](crate::PrefillAction::ClearFences), a request's
    /// [`DecodeEvent::Finished`](crate::DecodeEvent::Finished)).
    External,
}

/// The blocks of one core: a free list, or a count of the blocks the serving engine
/// handed in and the core has not given back yet.
#[derive(Debug)]
pub(crate) enum Blocks {
    Pool(BlockAllocator),
    External { total: u32, held: usize },
}

impl Blocks {
    pub(crate) fn new(source: BlockSource, total: u32) -> Self {
        match source {
            BlockSource::Pool => Self::Pool(BlockAllocator::new(total)),
            BlockSource::External => Self::External { total, held: 0 },
        }
    }

    pub(crate) fn source(&self) -> BlockSource {
        match self {
            Self::Pool(_) => BlockSource::Pool,
            Self::External { .. } => BlockSource::External,
        }
    }

    /// `n` blocks from the pool; an external source never hands any out.
    pub(crate) fn alloc(&mut self, n: usize) -> Result<Vec<BlockId>, AllocError> {
        match self {
            Self::Pool(alloc) => alloc.alloc(n),
            Self::External { .. } => Err(AllocError::Exhausted {
                requested: n,
                free: 0,
            }),
        }
    }

    /// Blocks the serving engine allocated are now the core's to account for.
    pub(crate) fn adopt(&mut self, blocks: &[BlockId]) {
        match self {
            Self::External { held, .. } => *held += blocks.len(),
            Self::Pool(_) => debug_assert!(false, "a pool core adopts no blocks"),
        }
    }

    /// Gives blocks back: to the free list, or (external) out of the core's account.
    pub(crate) fn free(&mut self, blocks: &[BlockId]) {
        match self {
            Self::Pool(alloc) => {
                // Every id freed here was handed out by this allocator exactly once; a
                // refusal would be a bug of the core, kept out of release builds' way.
                let freed = alloc.free(blocks);
                debug_assert!(freed.is_ok(), "block accounting: {freed:?}");
            }
            Self::External { held, .. } => {
                debug_assert!(*held >= blocks.len(), "block accounting: external");
                *held = held.saturating_sub(blocks.len());
            }
        }
    }

    /// Blocks handed out (pool) or held (external).
    pub(crate) fn allocated_count(&self) -> usize {
        match self {
            Self::Pool(alloc) => alloc.allocated_count(),
            Self::External { held, .. } => *held,
        }
    }

    /// Free blocks of the pool (external: the pool size less what the core holds).
    pub(crate) fn free_count(&self) -> usize {
        match self {
            Self::Pool(alloc) => alloc.free_count(),
            Self::External { total, held } => (*total as usize).saturating_sub(*held),
        }
    }
}
