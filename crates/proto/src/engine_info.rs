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
//! | `engine_id` | [`EngineId`](kvlease_lease::EngineId) | required |
//! | `instance` | u64 | P's start time in µs; 0 when absent |
//! | `tp_size` | 1..=[`MAX_PARALLEL`](crate::params::MAX_PARALLEL) | required |
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

mod decode;
mod encode;
mod text;
pub(crate) mod types;
mod validate;

pub use text::{base64_decode, base64_encode, from_hex, to_hex};
pub use types::{
    BlockFormat, DTYPE_BYTES, ENGINE_INFO, EngineInfo, FORMAT, InfoError, KvDescriptor, KvShape,
    MAX_DIMS, MAX_LAYERS, MAX_METADATA, MAX_PAYLOAD, MAX_STRING, RegionInfo, RemoteLayer,
    ShapeError, WorkerInfo,
};

#[cfg(test)]
mod tests;
