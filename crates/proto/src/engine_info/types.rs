//! The engine info's types and bounds: what a P engine serves (see the module above for
//! the wire).

use std::collections::BTreeMap;
use std::ops::Range;

use kvlease_lease::EngineId;
use serde_json::{Map, Value};

/// The name of the whole object, and the prefix of every field path in an [`InfoError`].
pub const ENGINE_INFO: &str = "engine_info";

/// The payload format this build writes (2: the connector's format with a KV
/// compatibility descriptor; the agents' payload had none).
pub const FORMAT: u32 = 2;

/// The largest encoded payload [`EngineInfo::decode`] reads (the agents' D reads no larger
/// side-channel frame).
pub const MAX_PAYLOAD: usize = 4 << 20;

/// The most KV cache layers a worker may list (and layer formats a map may hold).
pub const MAX_LAYERS: usize = 1 << 16;

/// The longest string (engine id aside, which [`EngineId`] bounds): layer names, dtypes,
/// model names, device names.
pub const MAX_STRING: usize = 4096;

/// The most dimensions a [`BlockFormat`] may list.
pub const MAX_DIMS: usize = 16;

/// The most bytes of transport metadata per worker.
pub const MAX_METADATA: usize = 1 << 20;

/// Bytes per KV element of the agents' KV (bf16): an agents' [`KvShape`] implies it.
pub const DTYPE_BYTES: usize = 2;

/// The model shape both agents agree on (global heads, not per rank): the agents' part of
/// [`EngineInfo`] (`shape`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads of the whole model (split across TP ranks).
    pub num_kv_heads: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Elements per head per token.
    pub head_dim: u32,
}

/// Why a shape or TP split is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A dimension is zero.
    #[error("{field} must be at least 1")]
    Zero {
        /// The flag or field name.
        field: &'static str,
    },
    /// The heads do not split evenly across the ranks.
    #[error("num_kv_heads {num_kv_heads} is not divisible by tp_size {tp_size}")]
    Indivisible {
        /// Global heads.
        num_kv_heads: u32,
        /// TP size.
        tp_size: u32,
    },
    /// The rank is outside the TP group.
    #[error("rank {rank} is outside tp_size {tp_size}")]
    BadRank {
        /// The rank.
        rank: u32,
        /// TP size.
        tp_size: u32,
    },
}

impl KvShape {
    /// The dimensions by their wire keys.
    pub(super) fn dims(&self) -> [(&'static str, u32); 4] {
        [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("block_size", self.block_size),
            ("head_dim", self.head_dim),
        ]
    }

    /// Checks every dimension is non-zero and that `tp_size` divides the heads.
    ///
    /// # Errors
    /// [`ShapeError`] naming the offending field.
    pub fn validate(&self, tp_size: u32) -> Result<(), ShapeError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("block_size", self.block_size),
            ("head_dim", self.head_dim),
            ("tp_size", tp_size),
        ] {
            if v == 0 {
                return Err(ShapeError::Zero { field });
            }
        }
        if !self.num_kv_heads.is_multiple_of(tp_size) {
            return Err(ShapeError::Indivisible {
                num_kv_heads: self.num_kv_heads,
                tp_size,
            });
        }
        Ok(())
    }

    /// The global heads that `rank` of a `tp_size` group holds.
    ///
    /// # Errors
    /// [`ShapeError`] when the split is invalid or `rank >= tp_size`.
    pub fn heads_of_rank(&self, tp_size: u32, rank: u32) -> Result<Range<u32>, ShapeError> {
        self.validate(tp_size)?;
        if rank >= tp_size {
            return Err(ShapeError::BadRank { rank, tp_size });
        }
        let per = self.num_kv_heads / tp_size;
        Ok(rank * per..(rank + 1) * per)
    }

    /// Blocks needed for `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size as usize)
    }

    /// Bytes of one head's slice of one block (`block_size × head_dim` elements).
    pub fn head_block_bytes(&self) -> usize {
        self.block_size as usize * self.head_dim as usize * DTYPE_BYTES
    }
}

/// A field of the engine info at fault, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InfoError {
    /// The field's path (`engine_info.workers[0].layers[2]`), or `engine_info` for the
    /// whole payload.
    pub field: String,
    /// What is wrong with it, for a human (`must be an integer in 1..=1024`).
    pub reason: String,
}

impl InfoError {
    pub(super) fn at(field: &str, reason: impl Into<String>) -> Self {
        Self {
            field: field.to_owned(),
            reason: reason.into(),
        }
    }
}

/// A registered region as the agents describe it in full (their D reads with it directly):
/// the transport's region descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionInfo {
    /// Region id, unique per agent.
    pub id: u64,
    /// Base address in the owner's address space.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// The key a reader presents.
    pub key: u64,
}

/// One KV cache layer of a vLLM P worker: where its blocks lie in a registered region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteLayer {
    /// vLLM's layer name.
    pub name: String,
    /// The id of P's registered region that holds it.
    pub region: u64,
    /// Byte offset of block 0 in the region.
    pub offset: u64,
    /// Bytes from one block to the next.
    pub block_stride: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Blocks of the layer. `offset + num_blocks × block_stride` fits a u64.
    pub num_blocks: u64,
}

/// How one vLLM layer stores a block (the connector's `layout.layer_format`): element
/// dtype, the block's shape, the order of its dims from the largest stride to the smallest
/// (1-based, size-1 dims left out), what each dim holds, and the attention backend whose
/// view it is. On the wire `[dtype, shape, order, axes, backend]`; an older connector
/// writes only `[dtype, shape, order]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockFormat {
    /// Element dtype (`float16`).
    pub dtype: String,
    /// The block's shape, in the dims `axes` names.
    pub shape: Vec<u64>,
    /// The physical order of the block's dims.
    pub order: Vec<u64>,
    /// One letter per dim of `shape` saying what it holds (`HNC`: heads, tokens, one
    /// token-head's K then V; `HKND`: heads, the K or V plane, tokens, a head's
    /// elements); `None` when the writer did not know what its backend's bytes mean.
    pub axes: Option<String>,
    /// The attention backend that reads the block (`FLASH_ATTN`, `CPU_ATTN`), if known.
    pub backend: Option<String>,
}

/// What makes a vLLM engine's KV block bytes mean the same on two engines (the connector's
/// `_kv_descriptor`): D compares P's with its own before it loads any of P's blocks. Every
/// key is optional on the wire; keys this build does not know are kept in `extra` and
/// written back, so a newer connector's keys reach the D that compares them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvDescriptor {
    /// The model.
    pub model: Option<String>,
    /// The model's dtype.
    pub dtype: Option<String>,
    /// The KV cache dtype.
    pub cache_dtype: Option<String>,
    /// KV heads of the whole model.
    pub num_kv_heads: Option<u32>,
    /// Elements per head per token.
    pub head_size: Option<u32>,
    /// Transformer layers.
    pub num_layers: Option<u32>,
    /// Tokens per block.
    pub block_size: Option<u32>,
    /// vLLM's KV cache layout name (`LBNHC`), when resolved.
    pub kv_cache_layout: Option<String>,
    /// The order of heads, tokens and K|V inside one layer's block (`NHC`), when resolved.
    pub block_order: Option<String>,
    /// Whether the model uses MLA (one latent vector per token, on every rank).
    pub use_mla: Option<bool>,
    /// Layer name -> block format, of the engine's lowest rank (empty when unknown).
    pub layers: BTreeMap<String, BlockFormat>,
    /// Keys this build does not know, as received.
    pub extra: Map<String, Value>,
}

/// One P worker: how D's workers reach it and read its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    /// TP rank.
    pub rank: u32,
    /// Its transport agent's metadata (what `Agent::connect` takes).
    pub agent_metadata: Vec<u8>,
    /// The id of its region holding the fence words.
    pub fence_region: u64,
    /// The agents': the block pool region.
    pub pool: Option<RegionInfo>,
    /// The agents': the fence words region (its id is `fence_region`).
    pub fence: Option<RegionInfo>,
    /// The connector's: the agent's name.
    pub agent_name: Option<String>,
    /// The connector's: the device the KV lives on (`cuda:0`, `cpu`).
    pub device: Option<String>,
    /// The connector's: blocks per layer.
    pub num_blocks: Option<u32>,
    /// The connector's: its KV cache layers, by name (empty for the agents).
    pub layers: Vec<RemoteLayer>,
    /// The connector's: layer name -> block format; `None` when P names none (an older
    /// kvlease: its reads are refused).
    pub kv_format: Option<BTreeMap<String, BlockFormat>>,
}

impl WorkerInfo {
    /// A worker with only the parts every P names.
    #[must_use]
    pub fn new(rank: u32, agent_metadata: Vec<u8>, fence_region: u64) -> Self {
        Self {
            rank,
            agent_metadata,
            fence_region,
            pool: None,
            fence: None,
            agent_name: None,
            device: None,
            num_blocks: None,
            layers: Vec::new(),
            kv_format: None,
        }
    }
}

/// What a P engine serves on its side channel (see the module's tables). Build it as a
/// value and [`encode`](Self::encode) it; read it with [`decode`](Self::decode). A value
/// that passes [`validate`](Self::validate) decodes equal from its own encoding.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// P's engine id.
    pub engine_id: EngineId,
    /// P's instance (its start time in µs): a larger one means P restarted. 0 when unsaid.
    pub instance: u64,
    /// P's TP size, 1..=[`MAX_PARALLEL`](crate::params::MAX_PARALLEL).
    pub tp_size: u32,
    /// Blocks per worker pool (at least 1).
    pub num_blocks: u32,
    /// The connector's: tokens per block.
    pub block_size: Option<u32>,
    /// The connector's: KV heads of the whole engine (1 for MLA).
    pub num_kv_heads: Option<u32>,
    /// The agents': the model shape.
    pub shape: Option<KvShape>,
    /// The connector's: the KV compatibility descriptor.
    pub kv: Option<KvDescriptor>,
    /// The agents': P binds the session of the side-channel exchange to the registering
    /// D's worker names (`kvlease_proto::auth::Session`): D's transport connections to P's
    /// workers must prove it instead of the token.
    pub sessions: bool,
    /// P's workers (at most `tp_size`, ranks unique; a connector's P may list fewer).
    pub workers: Vec<WorkerInfo>,
}

impl EngineInfo {
    /// An engine with only the parts every P names, and no workers.
    #[must_use]
    pub fn new(engine_id: EngineId, instance: u64, tp_size: u32, num_blocks: u32) -> Self {
        Self {
            engine_id,
            instance,
            tp_size,
            num_blocks,
            block_size: None,
            num_kv_heads: None,
            shape: None,
            kv: None,
            sessions: false,
            workers: Vec::new(),
        }
    }

    /// P's worker `rank`, if it lists one.
    #[must_use]
    pub fn worker(&self, rank: u32) -> Option<&WorkerInfo> {
        self.workers.iter().find(|w| w.rank == rank)
    }
}
