//! The engine-info handshake payload for Python: `kvlease_proto::engine_info`'s one type
//! and codec as the pyclasses `EngineInfo` and `WorkerInfo`, so that the connector's P
//! builds what it serves on the side channel, and its D reads what it fetched, with the
//! same checks as the agents.
//!
//! P builds with the constructor (keyword arguments; each worker a dict whose
//! `agent_metadata` is bytes), D reads with `from_bytes`; both raise the codec's
//! `InvalidArgument` naming the field (`field`, `reason` attributes). The getters hand
//! back plain Python values (ints, strings, bytes, lists, dicts).

use kvlease_proto::engine_info::{
    self as info, BlockFormat, ENGINE_INFO, InfoError, RegionInfo, base64_encode,
};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyMapping, PyString};
use serde_json::{Map, Value};

use crate::errors::{Family, raise_with};
use crate::params::{to_json, to_py};

/// `InvalidArgument` naming the field at fault (`field`, `reason` attributes).
fn info_err(py: Python<'_>, e: &InfoError) -> PyErr {
    let text = |s: &str| PyString::new(py, s).into_any().unbind();
    raise_with(
        py,
        Family::InvalidArgument,
        e.to_string(),
        &[("field", text(&e.field)), ("reason", text(&e.reason))],
    )
}

/// A worker given as a dict, as JSON: `agent_metadata` may be bytes (written as base64).
fn worker_json(w: &Bound<'_, PyAny>, i: usize) -> PyResult<Value> {
    let py = w.py();
    let path = format!("{ENGINE_INFO}.workers[{i}]");
    let Ok(m) = w.cast::<PyMapping>() else {
        return Err(info_err(
            py,
            &InfoError {
                field: path,
                reason: "must be a dict".into(),
            },
        ));
    };
    let mut out = Map::new();
    for item in m.items()?.iter() {
        let (k, v): (String, Bound<'_, PyAny>) = item.extract()?;
        let v = if k == "agent_metadata"
            && (v.is_instance_of::<PyBytes>() || v.is_instance_of::<PyByteArray>())
        {
            Value::String(base64_encode(&v.extract::<Vec<u8>>()?))
        } else {
            to_json(&v, &path, Some(&k), 1)?
        };
        out.insert(k, v);
    }
    Ok(Value::Object(out))
}

fn region_dict(py: Python<'_>, r: Option<RegionInfo>) -> PyResult<Py<PyAny>> {
    let Some(r) = r else { return Ok(py.None()) };
    let d = PyDict::new(py);
    d.set_item("id", r.id)?;
    d.set_item("base", r.base)?;
    d.set_item("len", r.len)?;
    d.set_item("key", r.key)?;
    Ok(d.into_any().unbind())
}

fn formats_py(
    py: Python<'_>,
    f: &std::collections::BTreeMap<String, BlockFormat>,
) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    for (name, b) in f {
        let list = (b.dtype.as_str(), b.shape.clone(), b.order.clone())
            .into_pyobject(py)?
            .to_list();
        // An older connector's three; else axes and backend (None where not known).
        if b.axes.is_some() || b.backend.is_some() {
            list.append(b.axes.as_deref())?;
            list.append(b.backend.as_deref())?;
        }
        d.set_item(name, list)?;
    }
    Ok(d.into_any().unbind())
}

/// One P worker of an [`EngineInfo`].
#[pyclass(module = "kvlease._kvlease", frozen, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct WorkerInfo(info::WorkerInfo);

#[pymethods]
impl WorkerInfo {
    /// TP rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank
    }

    /// Its transport agent's metadata (`Agent.connect`).
    #[getter]
    fn agent_metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.agent_metadata)
    }

    /// The id of its fence-words region.
    #[getter]
    fn fence_region(&self) -> u64 {
        self.0.fence_region
    }

    /// The connector's: the agent's name, if given.
    #[getter]
    fn agent_name(&self) -> Option<&str> {
        self.0.agent_name.as_deref()
    }

    /// The connector's: the device of its KV, if given.
    #[getter]
    fn device(&self) -> Option<&str> {
        self.0.device.as_deref()
    }

    /// The connector's: blocks per layer, if given.
    #[getter]
    fn num_blocks(&self) -> Option<u32> {
        self.0.num_blocks
    }

    /// The connector's: `(name, region, offset, block stride, block bytes, num blocks)`
    /// per KV cache layer (empty for an agent).
    #[getter]
    fn layers(&self) -> Vec<(String, u64, u64, u64, u64, u64)> {
        self.0
            .layers
            .iter()
            .map(|l| {
                (
                    l.name.clone(),
                    l.region,
                    l.offset,
                    l.block_stride,
                    l.block_bytes,
                    l.num_blocks,
                )
            })
            .collect()
    }

    /// The connector's: layer name -> `[dtype, block shape, order]`; `None` when P names
    /// none.
    #[getter]
    fn kv_format(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match &self.0.kv_format {
            Some(f) => formats_py(py, f),
            None => Ok(py.None()),
        }
    }

    /// The agents': the pool region (`{"id", "base", "len", "key"}`), if given.
    #[getter]
    fn pool(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        region_dict(py, self.0.pool)
    }

    /// The agents': the fence region (`{"id", "base", "len", "key"}`), if given.
    #[getter]
    fn fence(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        region_dict(py, self.0.fence)
    }

    fn __repr__(&self) -> String {
        format!(
            "WorkerInfo(rank={}, layers={}, fence_region={})",
            self.0.rank,
            self.0.layers.len(),
            self.0.fence_region
        )
    }
}

/// What a P engine serves on its side channel: one type for the agents' P and the
/// connector's, encoded and checked by the same codec as the agents'.
#[pyclass(module = "kvlease._kvlease", frozen, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct EngineInfo(info::EngineInfo);

#[pymethods]
impl EngineInfo {
    /// P's engine info, checked as D will read it (`InvalidArgument` naming the field).
    /// `kv` is the KV compatibility descriptor (a dict of JSON values), `workers` a list
    /// of dicts with the keys of `WorkerInfo` (`agent_metadata` as bytes).
    #[new]
    #[pyo3(signature = (
        *,
        engine_id,
        tp_size,
        num_blocks,
        instance = None,
        block_size = None,
        num_kv_heads = None,
        kv = None,
        workers = None,
    ))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments, one per key"
    )]
    fn new(
        py: Python<'_>,
        engine_id: &Bound<'_, PyAny>,
        tp_size: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        instance: Option<&Bound<'_, PyAny>>,
        block_size: Option<&Bound<'_, PyAny>>,
        num_kv_heads: Option<&Bound<'_, PyAny>>,
        kv: Option<&Bound<'_, PyAny>>,
        workers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut m = Map::new();
        for (key, v) in [
            ("engine_id", Some(engine_id)),
            ("tp_size", Some(tp_size)),
            ("num_blocks", Some(num_blocks)),
            ("instance", instance),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("kv", kv),
        ] {
            if let Some(v) = v {
                m.insert(key.into(), to_json(v, ENGINE_INFO, Some(key), 0)?);
            }
        }
        let mut list = Vec::new();
        if let Some(ws) = workers {
            for (i, w) in ws.try_iter()?.enumerate() {
                list.push(worker_json(&w?, i)?);
            }
        }
        m.insert("workers".into(), Value::Array(list));
        info::EngineInfo::from_value(&Value::Object(m))
            .map(Self)
            .map_err(|e| info_err(py, &e))
    }

    /// Reads a payload P served (`InvalidArgument` naming the field at fault).
    #[staticmethod]
    fn from_bytes(py: Python<'_>, raw: &[u8]) -> PyResult<Self> {
        info::EngineInfo::decode(raw)
            .map(Self)
            .map_err(|e| info_err(py, &e))
    }

    /// The payload's bytes.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.encode())
    }

    /// The payload as a dict of JSON values (`agent_metadata` base64).
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py(py, &self.0.to_value())
    }

    /// P's worker `rank`, or `None` when it lists none.
    fn worker(&self, rank: u32) -> Option<WorkerInfo> {
        self.0.worker(rank).cloned().map(WorkerInfo)
    }

    /// P's engine id.
    #[getter]
    fn engine_id(&self) -> &str {
        self.0.engine_id.as_str()
    }

    /// P's start time in µs (0: not sent).
    #[getter]
    fn instance(&self) -> u64 {
        self.0.instance
    }

    /// P's TP size.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.0.tp_size
    }

    /// Blocks per worker pool.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.0.num_blocks
    }

    /// The connector's: tokens per block, if given.
    #[getter]
    fn block_size(&self) -> Option<u32> {
        self.0.block_size
    }

    /// The connector's: KV heads of the engine, if given.
    #[getter]
    fn num_kv_heads(&self) -> Option<u32> {
        self.0.num_kv_heads
    }

    /// The connector's: the KV compatibility descriptor as a dict, `None` when P sent
    /// none.
    #[getter]
    fn kv(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let v = self.0.to_value();
        match v.get("kv") {
            Some(kv) => to_py(py, kv),
            None => Ok(py.None()),
        }
    }

    /// The agents': the model shape (`num_layers`, `num_kv_heads`, `block_size`,
    /// `head_dim`) as a dict, `None` when P sent none.
    #[getter]
    fn shape(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(s) = self.0.shape else {
            return Ok(py.None());
        };
        let d = PyDict::new(py);
        d.set_item("num_layers", s.num_layers)?;
        d.set_item("num_kv_heads", s.num_kv_heads)?;
        d.set_item("block_size", s.block_size)?;
        d.set_item("head_dim", s.head_dim)?;
        Ok(d.into_any().unbind())
    }

    /// P's workers, in the order P listed them.
    #[getter]
    fn workers(&self) -> Vec<WorkerInfo> {
        self.0.workers.iter().cloned().map(WorkerInfo).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "EngineInfo(engine_id={:?}, tp_size={}, num_blocks={}, workers={})",
            self.0.engine_id.as_str(),
            self.0.tp_size,
            self.0.num_blocks,
            self.0.workers.len()
        )
    }
}

/// One differing key as Python sees it: the key, P's value, D's value.
type Mismatch = (&'static str, Py<PyAny>, Py<PyAny>);

/// Every key of `kvlease_proto::compat::DESCRIPTOR_KEYS` on which P's KV compatibility
/// descriptor `theirs` differs from D's `ours` (dicts of JSON values, as the connector's
/// `_kv_descriptor` makes them), in key order: a list of `(key, P's value, D's value)`,
/// empty when they agree. Raises `InvalidArgument` naming the field of a descriptor that
/// does not read.
#[pyfunction]
pub(crate) fn kv_mismatches(
    py: Python<'_>,
    ours: &Bound<'_, PyAny>,
    theirs: &Bound<'_, PyAny>,
) -> PyResult<Vec<Mismatch>> {
    let read = |v: &Bound<'_, PyAny>, side: &str| {
        let path = format!("{ENGINE_INFO}.kv ({side})");
        let json = to_json(v, &path, None, 0)?;
        info::KvDescriptor::from_value(&json, &path).map_err(|e| info_err(py, &e))
    };
    let (d, p) = (read(ours, "D")?, read(theirs, "P")?);
    d.mismatches(&p)
        .into_iter()
        .map(|m| Ok((m.key, to_py(py, &m.p)?, to_py(py, &m.d)?)))
        .collect()
}
