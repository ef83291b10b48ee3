//! The engine-info handshake payload: what a P engine serves, in the side channel's
//! [`Welcome`](crate::sidechannel::Welcome), to a D that proved the cluster token: how D's
//! workers reach P's workers and read P's KV blocks. One type, [`EngineInfo`], and one
//! codec ([`EngineInfo::decode`], [`EngineInfo::encode`]) for every kvlease shell: the
//! agents' P builds it and their D reads it; the vLLM connector's P scheduler builds it
//! and its D scheduler reads it, both through the Python binding.
//!
//! Two kinds of P fill it, and they describe their KV in different terms. Both parts are
//! optional parts of the one type: a D uses the part of its own kind and refuses a P that
//! lacks it.
//!
//! - **The agents** describe a model shape ([`KvShape`]: layers, global KV heads, block
//!   size, head dim; bf16 elements) from which D computes each rank's layout, and per
//!   worker the full descriptors of its block pool and fence regions (`pool`, `fence`).
//! - **The vLLM connector** describes its KV as vLLM holds it: a compatibility descriptor
//!   ([`KvDescriptor`], `kv`) D compares with its own, and per worker its KV cache layers
//!   by vLLM layer name ([`RemoteLayer`]: region id, offset, strides) with their block
//!   formats ([`BlockFormat`], `kv_format`); D resolves region ids through P's agent
//!   metadata.
//!
//! Every P names its engine, instance, TP size and pool size, and per worker its rank, its
//! transport agent's metadata and the id of its fence-words region.
//!
//! The wire is a JSON object:
//!
//! | key | type | |
//! |---|---|---|
//! | `format` | [`FORMAT`] | written; read and ignored |
//! | `engine_id` | [`EngineId`] | required |
//! | `instance` | u64 | P's start time in µs; 0 when absent |
//! | `tp_size` | 1..=[`MAX_PARALLEL`] | required |
//! | `num_blocks` | 1..=2^32-1 | required: blocks per worker pool |
//! | `block_size`, `num_kv_heads` | u32 | optional (the connector's) |
//! | `shape` | [`KvShape`] object | optional (the agents') |
//! | `kv` | [`KvDescriptor`] object | optional (the connector's) |
//! | `sessions` | bool | optional, false when absent (the agents'): P binds the side-channel exchange's session to the registrant's worker names, whose transport connections must prove it |
//! | `workers` | list of [`WorkerInfo`] objects, at most `tp_size` | required |
//!
//! and each worker:
//!
//! | key | type | |
//! |---|---|---|
//! | `rank` | 0..`tp_size`, unique | required |
//! | `agent_metadata` | base64 | required; the agents' old `metadata` (hex) is still read |
//! | `fence_region` | u64 | required; an old agents' payload gives it as `fence.id` |
//! | `pool`, `fence` | [`RegionInfo`] objects | optional (the agents') |
//! | `agent_name`, `device` | string | optional (the connector's) |
//! | `num_blocks` | u32 | optional (the connector's) |
//! | `layers` | list of [`RemoteLayer`] `[name, region, offset, block stride, block bytes, num blocks]` | optional (the connector's) |
//! | `kv_format` | layer name -> [`BlockFormat`] `[dtype, shape, order, axes, backend]` | optional (the connector's) |
//!
//! A `null` value is read as an absent key, unknown keys are ignored (a newer P may say
//! more). Errors name the field by its path ([`InfoError::field`],
//! `engine_info.workers[0].agent_metadata`). Sizes are bounded: the payload by
//! [`MAX_PAYLOAD`], the lists and strings by the `MAX_*` constants, so a decoder never
//! allocates more than a bounded multiple of the bytes it got.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;

use kvlease_lease::EngineId;
use serde_json::{Map, Value};

use crate::compat::{
    CARRIED_KEYS, DESCRIPTOR_KEYS, KNOWN_ON_BOTH_SIDES, KvMismatch, SHAPE_KEYS, mismatches,
};
use crate::json::{FieldError, Fields};
use crate::params::MAX_PARALLEL;

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
    fn at(field: &str, reason: impl Into<String>) -> Self {
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

impl KvDescriptor {
    /// Reads a descriptor (the `kv` object of an engine info; `path` prefixes the field
    /// paths of its errors).
    ///
    /// # Errors
    /// [`InfoError`] naming the field at fault.
    pub fn from_value(v: &Value, path: &str) -> Result<Self, InfoError> {
        descriptor(v, path)
    }

    /// The descriptor as JSON, as the engine info carries it.
    #[must_use]
    pub fn to_value(&self) -> Value {
        descriptor_value(self)
    }

    /// Every compared key ([`DESCRIPTOR_KEYS`]) on which P's descriptor `p` differs from
    /// this (D's) one, in key order: empty when P's blocks mean the same KV here as far as
    /// the descriptors tell (`block_order` is compared only when both sides know it).
    #[must_use]
    pub fn mismatches(&self, p: &Self) -> Vec<KvMismatch> {
        mismatches(
            &DESCRIPTOR_KEYS,
            &KNOWN_ON_BOTH_SIDES,
            &descriptor_value(self),
            &descriptor_value(p),
        )
    }
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
    /// P's TP size, 1..=[`MAX_PARALLEL`].
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

    /// Reads a payload.
    ///
    /// # Errors
    /// An [`InfoError`] naming the first field at fault: `engine_info` when the bytes are
    /// over [`MAX_PAYLOAD`], not JSON or not an object.
    pub fn decode(bytes: &[u8]) -> Result<Self, InfoError> {
        if bytes.len() > MAX_PAYLOAD {
            return Err(InfoError::at(
                ENGINE_INFO,
                format!("{} bytes, over the {MAX_PAYLOAD} allowed", bytes.len()),
            ));
        }
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| InfoError::at(ENGINE_INFO, format!("not JSON ({e})")))?;
        Self::from_value(&v)
    }

    /// Reads a payload already parsed as JSON.
    ///
    /// # Errors
    /// An [`InfoError`] naming the first field at fault.
    pub fn from_value(v: &Value) -> Result<Self, InfoError> {
        let r = obj(v, ENGINE_INFO.to_owned())?;
        let engine_id = EngineId::new(r.string("engine_id")?)
            .map_err(|e| InfoError::at(&r.path("engine_id"), e.to_string()))?;
        let tp_size = to_u32(r.uint("tp_size", 1, u64::from(MAX_PARALLEL))?);
        let mut info = Self {
            engine_id,
            instance: r.opt_uint("instance", 0, u64::MAX)?.unwrap_or(0),
            tp_size,
            num_blocks: to_u32(r.uint("num_blocks", 1, u64::from(u32::MAX))?),
            block_size: r.opt_u32("block_size")?,
            num_kv_heads: r.opt_u32("num_kv_heads")?,
            shape: r
                .opt("shape")
                .map(|v| shape(v, &r.path("shape")))
                .transpose()?,
            kv: r
                .opt("kv")
                .map(|v| descriptor(v, &r.path("kv")))
                .transpose()?,
            sessions: match r.opt("sessions") {
                None => false,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| InfoError::at(&r.path("sessions"), "must be true or false"))?,
            },
            workers: Vec::new(),
        };
        r.opt_uint("format", 0, u64::from(u32::MAX))?;
        let path = r.path("workers");
        let list = r
            .req("workers")?
            .as_array()
            .ok_or_else(|| InfoError::at(&path, "must be a list"))?;
        if list.len() > tp_size as usize {
            return Err(InfoError::at(
                &path,
                format!("{} workers, more than tp_size {tp_size}", list.len()),
            ));
        }
        for (i, w) in list.iter().enumerate() {
            info.workers
                .push(worker(w, &format!("{path}[{i}]"), tp_size)?);
        }
        info.validate()?;
        Ok(info)
    }

    /// Checks what the typed fields do not hold by themselves: `tp_size` in
    /// 1..=[`MAX_PARALLEL`], `num_blocks` not 0, at most `tp_size` workers with unique
    /// ranks below it, a fence descriptor matching `fence_region`, layers that fit a u64,
    /// and the size bounds.
    ///
    /// # Errors
    /// An [`InfoError`] naming the first field at fault.
    pub fn validate(&self) -> Result<(), InfoError> {
        let at =
            |key: &str, reason: String| Err(InfoError::at(&format!("{ENGINE_INFO}.{key}"), reason));
        if !(1..=MAX_PARALLEL).contains(&self.tp_size) {
            return at(
                "tp_size",
                format!("must be an integer in 1..={MAX_PARALLEL}"),
            );
        }
        if self.num_blocks == 0 {
            return at("num_blocks", "must be at least 1".into());
        }
        if let Some(s) = &self.shape {
            for (key, v) in s.dims() {
                if v == 0 {
                    return at(&format!("shape.{key}"), "must be at least 1".into());
                }
            }
        }
        if let Some(kv) = &self.kv {
            check_strings(
                &format!("{ENGINE_INFO}.kv"),
                [
                    &kv.model,
                    &kv.dtype,
                    &kv.cache_dtype,
                    &kv.kv_cache_layout,
                    &kv.block_order,
                ],
            )?;
            check_formats(&format!("{ENGINE_INFO}.kv.layers"), &kv.layers)?;
        }
        if self.workers.len() > self.tp_size as usize {
            return at(
                "workers",
                format!(
                    "{} workers, more than tp_size {}",
                    self.workers.len(),
                    self.tp_size
                ),
            );
        }
        for (i, w) in self.workers.iter().enumerate() {
            let path = format!("{ENGINE_INFO}.workers[{i}]");
            let wat =
                |key: &str, reason: String| Err(InfoError::at(&format!("{path}.{key}"), reason));
            if w.rank >= self.tp_size {
                return wat(
                    "rank",
                    format!("must be an integer in 0..={}", self.tp_size - 1),
                );
            }
            if self.workers[..i].iter().any(|o| o.rank == w.rank) {
                return wat("rank", format!("two workers of rank {}", w.rank));
            }
            if w.agent_metadata.len() > MAX_METADATA {
                return wat("agent_metadata", format!("over {MAX_METADATA} bytes"));
            }
            if let Some(f) = w.fence
                && f.id != w.fence_region
            {
                return wat(
                    "fence_region",
                    format!("is {}, but fence.id is {}", w.fence_region, f.id),
                );
            }
            check_strings(&path, [&w.agent_name, &w.device])?;
            if w.layers.len() > MAX_LAYERS {
                return wat("layers", format!("more than {MAX_LAYERS} layers"));
            }
            for (j, l) in w.layers.iter().enumerate() {
                let lpath = format!("{path}.layers[{j}]");
                if l.name.len() > MAX_STRING {
                    return Err(InfoError::at(
                        &lpath,
                        format!("name over {MAX_STRING} bytes"),
                    ));
                }
                let end = l
                    .num_blocks
                    .checked_mul(l.block_stride)
                    .and_then(|b| b.checked_add(l.offset));
                if end.is_none() {
                    return Err(InfoError::at(&lpath, "reaches past 2^64 bytes"));
                }
            }
            if let Some(f) = &w.kv_format {
                check_formats(&format!("{path}.kv_format"), f)?;
            }
        }
        Ok(())
    }

    /// The payload as JSON: every field under its canonical key, optional ones only when
    /// set, plus `format`.
    #[must_use]
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("format".into(), FORMAT.into());
        m.insert("engine_id".into(), self.engine_id.as_str().into());
        m.insert("instance".into(), self.instance.into());
        m.insert("tp_size".into(), self.tp_size.into());
        m.insert("num_blocks".into(), self.num_blocks.into());
        put(&mut m, "block_size", self.block_size);
        put(&mut m, "num_kv_heads", self.num_kv_heads);
        if let Some(s) = self.shape {
            m.insert("shape".into(), s.to_value());
        }
        if let Some(kv) = &self.kv {
            m.insert("kv".into(), descriptor_value(kv));
        }
        if self.sessions {
            m.insert("sessions".into(), true.into());
        }
        m.insert(
            "workers".into(),
            self.workers.iter().map(worker_value).collect(),
        );
        Value::Object(m)
    }

    /// The payload's bytes (compact JSON).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        self.to_value().to_string().into_bytes()
    }
}

impl KvShape {
    /// Every dimension on which P's shape `p` differs from this (D's) one: empty when
    /// P's blocks mean the same KV here.
    #[must_use]
    pub fn mismatches(&self, p: &Self) -> Vec<KvMismatch> {
        mismatches(&SHAPE_KEYS, &[], &self.to_value(), &p.to_value())
    }

    fn to_value(self) -> Value {
        Value::Object(
            self.dims()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.into()))
                .collect(),
        )
    }

    /// The dimensions by their wire keys.
    fn dims(&self) -> [(&'static str, u32); 4] {
        [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("block_size", self.block_size),
            ("head_dim", self.head_dim),
        ]
    }
}

fn check_strings<'a>(
    path: &str,
    strings: impl IntoIterator<Item = &'a Option<String>>,
) -> Result<(), InfoError> {
    if strings.into_iter().flatten().any(|s| s.len() > MAX_STRING) {
        return Err(InfoError::at(
            path,
            format!("a string over {MAX_STRING} bytes"),
        ));
    }
    Ok(())
}

fn check_formats(path: &str, formats: &BTreeMap<String, BlockFormat>) -> Result<(), InfoError> {
    if formats.len() > MAX_LAYERS {
        return Err(InfoError::at(
            path,
            format!("more than {MAX_LAYERS} layers"),
        ));
    }
    for (name, f) in formats {
        if name.len() > MAX_STRING || f.dtype.len() > MAX_STRING {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("a string over {MAX_STRING} bytes"),
            ));
        }
        if f.shape.len() > MAX_DIMS || f.order.len() > MAX_DIMS {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("more than {MAX_DIMS} dims"),
            ));
        }
        if let Some(a) = &f.axes
            && (a.len() != f.shape.len() || !a.bytes().all(|b| b.is_ascii_uppercase()))
        {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!(
                    "axes {a:?} must name each of the {} dims with a capital letter",
                    f.shape.len()
                ),
            ));
        }
        if f.backend.as_ref().is_some_and(|b| b.len() > MAX_STRING) {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("a string over {MAX_STRING} bytes"),
            ));
        }
    }
    Ok(())
}

fn put(m: &mut Map<String, Value>, key: &str, v: Option<u32>) {
    if let Some(v) = v {
        m.insert(key.into(), v.into());
    }
}

fn put_str(m: &mut Map<String, Value>, key: &str, v: Option<&String>) {
    if let Some(v) = v {
        m.insert(key.into(), v.as_str().into());
    }
}

fn region_value(r: RegionInfo) -> Value {
    serde_json::json!({"id": r.id, "base": r.base, "len": r.len, "key": r.key})
}

fn format_value(f: &BlockFormat) -> Value {
    if f.axes.is_none() && f.backend.is_none() {
        return serde_json::json!([f.dtype, f.shape, f.order]);
    }
    serde_json::json!([f.dtype, f.shape, f.order, f.axes, f.backend])
}

fn formats_value(f: &BTreeMap<String, BlockFormat>) -> Value {
    Value::Object(
        f.iter()
            .map(|(k, v)| (k.clone(), format_value(v)))
            .collect(),
    )
}

fn descriptor_value(kv: &KvDescriptor) -> Value {
    let mut m = kv.extra.clone();
    put_str(&mut m, "model", kv.model.as_ref());
    put_str(&mut m, "dtype", kv.dtype.as_ref());
    put_str(&mut m, "cache_dtype", kv.cache_dtype.as_ref());
    put(&mut m, "num_kv_heads", kv.num_kv_heads);
    put(&mut m, "head_size", kv.head_size);
    put(&mut m, "num_layers", kv.num_layers);
    put(&mut m, "block_size", kv.block_size);
    put_str(&mut m, "kv_cache_layout", kv.kv_cache_layout.as_ref());
    put_str(&mut m, "block_order", kv.block_order.as_ref());
    if let Some(b) = kv.use_mla {
        m.insert("use_mla".into(), b.into());
    }
    m.insert("layers".into(), formats_value(&kv.layers));
    Value::Object(m)
}

fn worker_value(w: &WorkerInfo) -> Value {
    let mut m = Map::new();
    m.insert("rank".into(), w.rank.into());
    m.insert(
        "agent_metadata".into(),
        base64_encode(&w.agent_metadata).into(),
    );
    m.insert("fence_region".into(), w.fence_region.into());
    if let Some(p) = w.pool {
        m.insert("pool".into(), region_value(p));
    }
    if let Some(f) = w.fence {
        m.insert("fence".into(), region_value(f));
    }
    put_str(&mut m, "agent_name", w.agent_name.as_ref());
    put_str(&mut m, "device", w.device.as_ref());
    put(&mut m, "num_blocks", w.num_blocks);
    if !w.layers.is_empty() {
        m.insert(
            "layers".into(),
            w.layers
                .iter()
                .map(|l| {
                    serde_json::json!([
                        l.name,
                        l.region,
                        l.offset,
                        l.block_stride,
                        l.block_bytes,
                        l.num_blocks
                    ])
                })
                .collect(),
        );
    }
    if let Some(f) = &w.kv_format {
        m.insert("kv_format".into(), formats_value(f));
    }
    Value::Object(m)
}

/// A bounded `u32` read: the bound is at most `u32::MAX`.
fn to_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The object `v` at `path`, read with the engine info's rules: a required key's absence
/// is "missing", strings are at most [`MAX_STRING`] bytes.
fn obj(v: &Value, path: String) -> Result<Fields<'_>, FieldError> {
    Fields::of(v, path, "missing", MAX_STRING)
}

impl From<FieldError> for InfoError {
    fn from(e: FieldError) -> Self {
        Self {
            field: e.field,
            reason: e.reason,
        }
    }
}

fn shape(v: &Value, path: &str) -> Result<KvShape, InfoError> {
    let r = obj(v, path.to_owned())?;
    let dim = |key| r.uint(key, 1, u64::from(u32::MAX)).map(to_u32);
    Ok(KvShape {
        num_layers: dim("num_layers")?,
        num_kv_heads: dim("num_kv_heads")?,
        block_size: dim("block_size")?,
        head_dim: dim("head_dim")?,
    })
}

fn region(v: &Value, path: &str) -> Result<RegionInfo, InfoError> {
    let r = obj(v, path.to_owned())?;
    let u = |key| r.uint(key, 0, u64::MAX);
    Ok(RegionInfo {
        id: u("id")?,
        base: u("base")?,
        len: u("len")?,
        key: u("key")?,
    })
}

fn block_format(v: &Value, path: &str) -> Result<BlockFormat, InfoError> {
    let bad = || {
        InfoError::at(
            path,
            "must be [dtype, shape, order] or [dtype, shape, order, axes, backend]: a string, \
             two lists of at most 16 integers, then one letter per dim of shape (or null) and a \
             string (or null)",
        )
    };
    let (dtype, shape, order, axes, backend) = match v.as_array().map(Vec::as_slice) {
        Some([dtype, shape, order]) => (dtype, shape, order, &Value::Null, &Value::Null),
        Some([dtype, shape, order, axes, backend]) => (dtype, shape, order, axes, backend),
        _ => return Err(bad()),
    };
    let dims = |v: &Value| -> Option<Vec<u64>> {
        let a = v.as_array().filter(|a| a.len() <= MAX_DIMS)?;
        a.iter().map(Value::as_u64).collect()
    };
    // A string or null; `None` for a value that is neither.
    let opt_str = |v: &Value, max: usize| -> Option<Option<String>> {
        match v {
            Value::Null => Some(None),
            Value::String(s) if s.len() <= max => Some(Some(s.clone())),
            _ => None,
        }
    };
    // The axes' letters against the shape: `check_formats`, when the payload is validated.
    Ok(BlockFormat {
        dtype: dtype
            .as_str()
            .filter(|s| s.len() <= MAX_STRING)
            .ok_or_else(bad)?
            .to_owned(),
        shape: dims(shape).ok_or_else(bad)?,
        order: dims(order).ok_or_else(bad)?,
        axes: opt_str(axes, MAX_DIMS).ok_or_else(bad)?,
        backend: opt_str(backend, MAX_STRING).ok_or_else(bad)?,
    })
}

fn formats(v: &Value, path: &str) -> Result<BTreeMap<String, BlockFormat>, InfoError> {
    let m = v
        .as_object()
        .ok_or_else(|| InfoError::at(path, "must map layer names to block formats"))?;
    if m.len() > MAX_LAYERS {
        return Err(InfoError::at(
            path,
            format!("more than {MAX_LAYERS} layers"),
        ));
    }
    m.iter()
        .map(|(k, v)| {
            if k.len() > MAX_STRING {
                return Err(InfoError::at(
                    path,
                    format!("a layer name over {MAX_STRING} bytes"),
                ));
            }
            Ok((k.clone(), block_format(v, &format!("{path}.{k}"))?))
        })
        .collect()
}

fn descriptor(v: &Value, path: &str) -> Result<KvDescriptor, InfoError> {
    let r = obj(v, path.to_owned())?;
    Ok(KvDescriptor {
        model: r.opt_string("model")?,
        dtype: r.opt_string("dtype")?,
        cache_dtype: r.opt_string("cache_dtype")?,
        num_kv_heads: r.opt_u32("num_kv_heads")?,
        head_size: r.opt_u32("head_size")?,
        num_layers: r.opt_u32("num_layers")?,
        block_size: r.opt_u32("block_size")?,
        kv_cache_layout: r.opt_string("kv_cache_layout")?,
        block_order: r.opt_string("block_order")?,
        use_mla: r.opt_bool("use_mla")?,
        layers: r
            .opt("layers")
            .map(|v| formats(v, &r.path("layers")))
            .transpose()?
            .unwrap_or_default(),
        extra: r
            .map()
            .iter()
            .filter(|(k, _)| {
                !DESCRIPTOR_KEYS.contains(&k.as_str()) && !CARRIED_KEYS.contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    })
}

fn layer(v: &Value, path: &str) -> Result<RemoteLayer, InfoError> {
    let bad = || {
        InfoError::at(
            path,
            "must be [name, region, offset, block stride, block bytes, num blocks]",
        )
    };
    let Some([name, rest @ ..]) = v.as_array().map(Vec::as_slice) else {
        return Err(bad());
    };
    let name = name
        .as_str()
        .filter(|s| s.len() <= MAX_STRING)
        .ok_or_else(bad)?;
    let nums: Vec<u64> = rest
        .iter()
        .map(Value::as_u64)
        .collect::<Option<_>>()
        .ok_or_else(bad)?;
    let [region, offset, block_stride, block_bytes, num_blocks] = nums[..] else {
        return Err(bad());
    };
    if num_blocks
        .checked_mul(block_stride)
        .and_then(|b| b.checked_add(offset))
        .is_none()
    {
        return Err(InfoError::at(
            path,
            format!("layer {name} reaches past 2^64 bytes"),
        ));
    }
    Ok(RemoteLayer {
        name: name.to_owned(),
        region,
        offset,
        block_stride,
        block_bytes,
        num_blocks,
    })
}

fn worker(v: &Value, path: &str, tp_size: u32) -> Result<WorkerInfo, InfoError> {
    let r = obj(v, path.to_owned())?;
    let rank = to_u32(r.uint("rank", 0, u64::from(tp_size - 1))?);
    let agent_metadata = if let Some(b64) = r.opt("agent_metadata") {
        let s = r.str_of("agent_metadata", b64).ok();
        s.filter(|s| s.len() <= MAX_METADATA.div_ceil(3) * 4)
            .and_then(base64_decode)
            .ok_or_else(|| r.must_be("agent_metadata", "base64 of at most 1 MiB"))?
    } else if let Some(hex) = r.opt("metadata") {
        hex.as_str()
            .filter(|s| s.len() <= 2 * MAX_METADATA)
            .and_then(from_hex)
            .ok_or_else(|| r.must_be("metadata", "hex of at most 1 MiB"))?
    } else {
        return Err(InfoError::at(&r.path("agent_metadata"), "missing"));
    };
    let pool = r
        .opt("pool")
        .map(|v| region(v, &r.path("pool")))
        .transpose()?;
    let fence = r
        .opt("fence")
        .map(|v| region(v, &r.path("fence")))
        .transpose()?;
    let fence_region = match (r.opt_uint("fence_region", 0, u64::MAX)?, fence) {
        (Some(id), _) => id,
        (None, Some(f)) => f.id,
        (None, None) => return Err(InfoError::at(&r.path("fence_region"), "missing")),
    };
    let layers = match r.opt("layers") {
        None => Vec::new(),
        Some(v) => {
            let lpath = r.path("layers");
            let list = v
                .as_array()
                .filter(|l| l.len() <= MAX_LAYERS)
                .ok_or_else(|| {
                    InfoError::at(
                        &lpath,
                        format!("must be a list of at most {MAX_LAYERS} layers"),
                    )
                })?;
            list.iter()
                .enumerate()
                .map(|(j, l)| layer(l, &format!("{lpath}[{j}]")))
                .collect::<Result<_, _>>()?
        }
    };
    Ok(WorkerInfo {
        rank,
        agent_metadata,
        fence_region,
        pool,
        fence,
        agent_name: r.opt_string("agent_name")?,
        device: r.opt_string("device")?,
        num_blocks: r.opt_u32("num_blocks")?,
        layers,
        kv_format: r
            .opt("kv_format")
            .map(|v| formats(v, &r.path("kv_format")))
            .transpose()?,
    })
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
#[must_use]
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                s.push(char::from(B64[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Strict standard base64 (padding required, no whitespace, as Python's
/// `b64decode(validate=True)`); `None` when `s` is not that.
#[must_use]
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return None;
    }
    let val = |c: u8| {
        B64.iter()
            .position(|&x| x == c)
            .and_then(|p| u32::try_from(p).ok())
    };
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    let chunks = b.len() / 4;
    for (i, q) in b.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != chunks) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = (n << 6) | val(c)?;
        }
        n <<= 6 * pad;
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
}

/// Lowercase hex of `bytes`.
#[must_use]
pub fn to_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Bytes of a hex string, `None` if it is not hex.
#[must_use]
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests;
