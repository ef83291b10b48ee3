//! Writing an engine info: every field under its canonical key.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::text::base64_encode;
use super::types::{
    BlockFormat, EngineInfo, FORMAT, KvDescriptor, KvShape, RegionInfo, WorkerInfo,
};

impl EngineInfo {
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

impl KvDescriptor {
    /// The descriptor as JSON, as the engine info carries it.
    #[must_use]
    pub fn to_value(&self) -> Value {
        descriptor_value(self)
    }
}

impl KvShape {
    pub(crate) fn to_value(self) -> Value {
        Value::Object(
            self.dims()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.into()))
                .collect(),
        )
    }
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
