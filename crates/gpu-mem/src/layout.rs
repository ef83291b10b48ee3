//! Where each KV block lives in a pool: SPEC's "What moves" layout.
//!
//! The pool is `layers × blocks × (K, V) × heads × block_size × head_dim` elements of
//! `dtype_bytes` each. Layer `l` is one contiguous region (its per-layer region); inside
//! it, block `b` is `[K: heads][V: heads]`, each head `block_size × head_dim` elements.
//! So one (layer, block) is contiguous, and so is any head sub-range of its K or V half,
//! which is what a decode rank of a different tensor-parallel size reads from each
//! prefill rank.

use std::ops::Range;

use kvlease_lease::BlockId;

/// Largest pool a layout may describe (1 TiB): larger is a configuration error.
pub const MAX_POOL_BYTES: u64 = 1 << 40;

/// Which half of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvHalf {
    /// Keys (first half of the block).
    K,
    /// Values (second half).
    V,
}

/// Why a layout or a position in it is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A dimension is zero.
    #[error("layout dimension `{name}` is zero")]
    ZeroDimension {
        /// The field's name.
        name: &'static str,
    },
    /// `dtype_bytes` is not 1, 2, 4 or 8.
    #[error("dtype_bytes = {0} (must be 1, 2, 4 or 8)")]
    BadDtype(u32),
    /// The pool would exceed [`MAX_POOL_BYTES`] (or overflow).
    #[error("layout needs more than {MAX_POOL_BYTES} bytes")]
    TooLarge,
    /// A layer index past `num_layers`.
    #[error("layer {layer} out of range (num_layers = {num_layers})")]
    LayerOutOfRange {
        /// Index asked for.
        layer: u32,
        /// Number of layers.
        num_layers: u32,
    },
    /// A block id past `num_blocks`.
    #[error("block {block} out of range (num_blocks = {num_blocks})")]
    BlockOutOfRange {
        /// Block asked for.
        block: u32,
        /// Number of blocks.
        num_blocks: u32,
    },
    /// An empty or out-of-range head range.
    #[error("head range {start}..{end} invalid (num_kv_heads = {num_kv_heads})")]
    BadHeadRange {
        /// Start of the range.
        start: u32,
        /// End of the range.
        end: u32,
        /// Heads of this rank.
        num_kv_heads: u32,
    },
}

/// The shape of a KV block pool (this rank's share of the heads). Sizes are checked at
/// construction, so the offset methods cannot overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    num_layers: u32,
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    dtype_bytes: u32,
}

impl KvLayout {
    /// Checks and builds a layout. `num_kv_heads` is this rank's number of KV heads;
    /// `block_size` is in tokens; `dtype_bytes` is 2 for bf16.
    ///
    /// # Errors
    /// [`LayoutError::ZeroDimension`], [`LayoutError::BadDtype`] or
    /// [`LayoutError::TooLarge`] when the whole pool exceeds [`MAX_POOL_BYTES`].
    pub fn new(
        num_layers: u32,
        num_blocks: u32,
        num_kv_heads: u32,
        block_size: u32,
        head_dim: u32,
        dtype_bytes: u32,
    ) -> Result<Self, LayoutError> {
        for (name, v) in [
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("num_kv_heads", num_kv_heads),
            ("block_size", block_size),
            ("head_dim", head_dim),
        ] {
            if v == 0 {
                return Err(LayoutError::ZeroDimension { name });
            }
        }
        if !matches!(dtype_bytes, 1 | 2 | 4 | 8) {
            return Err(LayoutError::BadDtype(dtype_bytes));
        }
        let total = [
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
            dtype_bytes,
            2,
        ]
        .into_iter()
        .try_fold(u64::from(num_layers), |acc, v| {
            acc.checked_mul(u64::from(v))
        })
        .ok_or(LayoutError::TooLarge)?;
        if total > MAX_POOL_BYTES {
            return Err(LayoutError::TooLarge);
        }
        Ok(Self {
            num_layers,
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
            dtype_bytes,
        })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }
    /// Number of blocks per layer.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// KV heads of this rank.
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Elements per head per token.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Bytes per element.
    pub fn dtype_bytes(&self) -> u32 {
        self.dtype_bytes
    }

    /// Bytes of one head of one half (K or V) of one block: `block_size × head_dim × dtype`.
    pub fn head_bytes(&self) -> u64 {
        u64::from(self.block_size) * u64::from(self.head_dim) * u64::from(self.dtype_bytes)
    }
    /// Bytes of one half (K or V) of one block in one layer.
    pub fn half_bytes(&self) -> u64 {
        self.head_bytes() * u64::from(self.num_kv_heads)
    }
    /// Bytes of one block in one layer (K and V).
    pub fn block_bytes(&self) -> u64 {
        self.half_bytes() * 2
    }
    /// Bytes of one layer's region.
    pub fn layer_bytes(&self) -> u64 {
        self.block_bytes() * u64::from(self.num_blocks)
    }
    /// Bytes of the whole pool.
    pub fn total_bytes(&self) -> u64 {
        self.layer_bytes() * u64::from(self.num_layers)
    }

    /// The byte range of layer `layer`'s region.
    ///
    /// # Errors
    /// [`LayoutError::LayerOutOfRange`].
    pub fn layer_range(&self, layer: u32) -> Result<Range<u64>, LayoutError> {
        self.check_layer(layer)?;
        let start = u64::from(layer) * self.layer_bytes();
        Ok(start..start + self.layer_bytes())
    }

    /// The byte range of block `block` in layer `layer` (K then V).
    ///
    /// # Errors
    /// [`LayoutError::LayerOutOfRange`] or [`LayoutError::BlockOutOfRange`].
    pub fn block_range(&self, layer: u32, block: BlockId) -> Result<Range<u64>, LayoutError> {
        let start = self.layer_range(layer)?.start + self.block_index(block)? * self.block_bytes();
        Ok(start..start + self.block_bytes())
    }

    /// The byte range of heads `heads` of half `half` of block `block` in layer `layer`
    /// (contiguous, because heads are the outer dimension of a half).
    ///
    /// # Errors
    /// As [`block_range`](Self::block_range), or [`LayoutError::BadHeadRange`] for an empty
    /// range or one past `num_kv_heads`.
    pub fn heads_range(
        &self,
        layer: u32,
        block: BlockId,
        half: KvHalf,
        heads: Range<u32>,
    ) -> Result<Range<u64>, LayoutError> {
        if heads.start >= heads.end || heads.end > self.num_kv_heads {
            return Err(LayoutError::BadHeadRange {
                start: heads.start,
                end: heads.end,
                num_kv_heads: self.num_kv_heads,
            });
        }
        let half_start = match half {
            KvHalf::K => 0,
            KvHalf::V => self.half_bytes(),
        };
        let start = self.block_range(layer, block)?.start
            + half_start
            + u64::from(heads.start) * self.head_bytes();
        Ok(start..start + u64::from(heads.end - heads.start) * self.head_bytes())
    }

    fn check_layer(&self, layer: u32) -> Result<(), LayoutError> {
        if layer >= self.num_layers {
            return Err(LayoutError::LayerOutOfRange {
                layer,
                num_layers: self.num_layers,
            });
        }
        Ok(())
    }

    fn block_index(&self, block: BlockId) -> Result<u64, LayoutError> {
        if block.0 >= self.num_blocks {
            return Err(LayoutError::BlockOutOfRange {
                block: block.0,
                num_blocks: self.num_blocks,
            });
        }
        Ok(u64::from(block.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_layers_blocks_kv_heads() {
        // 2 layers, 4 blocks, 3 heads, 16 tokens, 8 dims, bf16.
        let l = KvLayout::new(2, 4, 3, 16, 8, 2).expect("valid");
        assert_eq!(l.head_bytes(), 16 * 8 * 2);
        assert_eq!(l.block_bytes(), 2 * 3 * 256);
        assert_eq!(l.layer_bytes(), 4 * 1536);
        assert_eq!(l.total_bytes(), 2 * 6144);
        assert_eq!(l.layer_range(1), Ok(6144..12288));
        assert_eq!(l.block_range(1, BlockId(2)), Ok(6144 + 3072..6144 + 4608));
        assert_eq!(l.heads_range(0, BlockId(0), KvHalf::K, 0..3), Ok(0..768));
        assert_eq!(
            l.heads_range(0, BlockId(0), KvHalf::V, 1..2),
            Ok(768 + 256..768 + 512)
        );
        assert_eq!(
            l.heads_range(1, BlockId(3), KvHalf::V, 2..3),
            Ok(6144 + 4608 + 768 + 512..6144 + 6144)
        );
        // Every (layer, block) range tiles the pool exactly.
        let mut next = 0;
        for layer in 0..2 {
            for b in 0..4 {
                let r = l.block_range(layer, BlockId(b)).expect("in range");
                assert_eq!(r.start, next);
                next = r.end;
            }
        }
        assert_eq!(next, l.total_bytes());
    }

    #[test]
    fn bad_positions_and_absurd_sizes_are_errors() {
        let l = KvLayout::new(2, 4, 3, 16, 8, 2).expect("valid");
        assert!(matches!(
            l.layer_range(2),
            Err(LayoutError::LayerOutOfRange { .. })
        ));
        assert!(matches!(
            l.block_range(0, BlockId(4)),
            Err(LayoutError::BlockOutOfRange { .. })
        ));
        assert!(l.heads_range(0, BlockId(0), KvHalf::K, 2..2).is_err());
        assert!(l.heads_range(0, BlockId(0), KvHalf::K, 2..4).is_err());
        assert_eq!(
            KvLayout::new(0, 1, 1, 1, 1, 2),
            Err(LayoutError::ZeroDimension { name: "num_layers" })
        );
        assert_eq!(
            KvLayout::new(1, 1, 1, 1, 1, 3),
            Err(LayoutError::BadDtype(3))
        );
        assert_eq!(
            KvLayout::new(u32::MAX, u32::MAX, u32::MAX, u32::MAX, u32::MAX, 8),
            Err(LayoutError::TooLarge)
        );
        assert_eq!(
            KvLayout::new(80, 1 << 20, 8, 16, 128, 2),
            Err(LayoutError::TooLarge)
        );
    }
}
