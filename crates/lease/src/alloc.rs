//! The free list of block ids.

use crate::ids::BlockId;

/// Why an allocation or a free was refused. A refused call changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Fewer free blocks than requested.
    #[error("{requested} blocks requested, {free} free")]
    Exhausted {
        /// Blocks asked for.
        requested: usize,
        /// Blocks free.
        free: usize,
    },
    /// The block is already free (or listed twice in one call).
    #[error("double free of block {0:?}")]
    DoubleFree(BlockId),
    /// The id is not one of this allocator's blocks.
    #[error("block {block:?} is not in this pool of {total} blocks")]
    Foreign {
        /// The id.
        block: BlockId,
        /// Blocks in the pool.
        total: u32,
    },
}

/// A free list over the block ids `0..total`, with exact accounting:
/// `free_count() + allocated_count() == total()` always holds.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Free ids, popped from the end (low ids first after construction).
    free: Vec<BlockId>,
    /// `allocated[i]` is whether block `i` is allocated.
    allocated: Vec<bool>,
}

impl BlockAllocator {
    /// An allocator with every one of `total` blocks free.
    pub fn new(total: u32) -> Self {
        Self {
            free: (0..total).rev().map(BlockId).collect(),
            allocated: vec![false; total as usize],
        }
    }

    /// Blocks managed.
    pub fn total(&self) -> u32 {
        // `allocated` was built from a `u32` length.
        self.allocated.len() as u32
    }

    /// Free blocks.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Allocated blocks.
    pub fn allocated_count(&self) -> usize {
        self.allocated.len() - self.free.len()
    }

    /// Whether `block` is currently allocated (false for foreign ids).
    pub fn is_allocated(&self, block: BlockId) -> bool {
        self.allocated
            .get(block.0 as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Takes `n` free blocks, all or nothing.
    ///
    /// # Errors
    /// [`AllocError::Exhausted`] when fewer than `n` are free; nothing is taken then.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<BlockId>, AllocError> {
        if n > self.free.len() {
            return Err(AllocError::Exhausted {
                requested: n,
                free: self.free.len(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for b in &blocks {
            self.allocated[b.0 as usize] = true;
        }
        Ok(blocks)
    }

    /// Returns `blocks` to the free list, all or nothing.
    ///
    /// # Errors
    /// [`AllocError::Foreign`] for an id outside the pool, [`AllocError::DoubleFree`] for
    /// one that is free already or listed twice; nothing is freed then.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), AllocError> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &block in blocks {
            if block.0 >= self.total() {
                return Err(AllocError::Foreign {
                    block,
                    total: self.total(),
                });
            }
            if !self.allocated[block.0 as usize] || !seen.insert(block) {
                return Err(AllocError::DoubleFree(block));
            }
        }
        for &block in blocks {
            self.allocated[block.0 as usize] = false;
            self.free.push(block);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        /// Free a selection of currently allocated blocks (indices into the model's set),
        /// optionally with an extra id that is free, foreign or a duplicate.
        Free(Vec<usize>, Option<u32>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..12).prop_map(Op::Alloc),
            (
                proptest::collection::vec(0usize..64, 0..6),
                proptest::option::of(0u32..40)
            )
                .prop_map(|(v, x)| Op::Free(v, x)),
        ]
    }

    proptest! {
        #[test]
        fn allocator_matches_a_set_model(total in 0u32..32, ops in proptest::collection::vec(op(), 0..60)) {
            let mut subject = BlockAllocator::new(total);
            let mut model: BTreeSet<u32> = BTreeSet::new(); // allocated ids
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let free = total as usize - model.len();
                        match subject.alloc(n) {
                            Ok(blocks) => {
                                prop_assert!(n <= free);
                                prop_assert_eq!(blocks.len(), n);
                                for b in blocks {
                                    prop_assert!(b.0 < total);
                                    prop_assert!(model.insert(b.0), "handed out {:?} twice", b);
                                }
                            }
                            Err(e) => {
                                prop_assert!(n > free);
                                prop_assert_eq!(e, AllocError::Exhausted { requested: n, free });
                            }
                        }
                    }
                    Op::Free(picks, extra) => {
                        let held: Vec<u32> = model.iter().copied().collect();
                        let mut ids: Vec<BlockId> = Vec::new();
                        if !held.is_empty() {
                            let mut chosen = BTreeSet::new();
                            for p in picks {
                                chosen.insert(held[p % held.len()]);
                            }
                            ids.extend(chosen.into_iter().map(BlockId));
                        }
                        if let Some(x) = extra {
                            ids.push(BlockId(x));
                        }
                        let valid = extra.is_none_or(|x| {
                            x < total && model.contains(&x) && !ids[..ids.len() - 1].contains(&BlockId(x))
                        });
                        let before = subject.clone();
                        let result = subject.free(&ids);
                        if valid {
                            prop_assert!(result.is_ok(), "{:?}", result);
                            for b in &ids {
                                model.remove(&b.0);
                            }
                        } else {
                            let x = extra.unwrap_or_default();
                            let expected = if x >= total {
                                AllocError::Foreign { block: BlockId(x), total }
                            } else {
                                AllocError::DoubleFree(BlockId(x))
                            };
                            prop_assert_eq!(result, Err(expected));
                            // A refused free changes nothing.
                            prop_assert_eq!(&subject.free, &before.free);
                            prop_assert_eq!(&subject.allocated, &before.allocated);
                        }
                    }
                }
                prop_assert_eq!(subject.allocated_count(), model.len());
                prop_assert_eq!(subject.free_count() + subject.allocated_count(), total as usize);
                for i in 0..total {
                    prop_assert_eq!(subject.is_allocated(BlockId(i)), model.contains(&i));
                }
            }
        }
    }
}
