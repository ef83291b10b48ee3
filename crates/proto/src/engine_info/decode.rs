//! Reading an engine info: every field checked as it is read, errors naming its path.

use std::collections::BTreeMap;

use kvlease_lease::EngineId;
use serde_json::Value;

use super::text::{base64_decode, from_hex};
use super::types::{
    BlockFormat, ENGINE_INFO, EngineInfo, InfoError, KvDescriptor, KvShape, MAX_DIMS, MAX_LAYERS,
    MAX_METADATA, MAX_PAYLOAD, MAX_STRING, RegionInfo, RemoteLayer, WorkerInfo,
};
use crate::compat::{CARRIED_KEYS, DESCRIPTOR_KEYS};
use crate::json::{FieldError, Fields};
use crate::params::MAX_PARALLEL;

impl EngineInfo {
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
