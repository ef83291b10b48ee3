//! `kv_transfer_params` for Python: `kvlease_proto::params`'s one codec as the pyclass
//! `KvTransferParams`, so that the connector and the agents read and write the same keys
//! with the same checks.
//!
//! Dicts cross as JSON values: `from_dict` converts the dict, then the codec reads it;
//! the constructor does the same with its keyword arguments (so both raise the codec's
//! errors); `to_dict` writes the codec's object.

use std::time::Duration;

use kvlease_engine::{
    DeadlineBasis, DecoderKvParams, PullDecision, PullPolicy, RecomputeReason, plan_pull,
};
use kvlease_proto::params::{self, KvDigest, ParamsError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PyMapping, PySequence, PyString, PyTuple};
use serde_json::{Map, Number, Value};

use crate::cores::RemoteKv;
use crate::errors::{Family, raise_with};

/// How deep a value inside the dict may nest (no kvlease key nests more than twice).
const MAX_DEPTH: usize = 8;

/// `InvalidArgument` naming the field at fault (`field`, `reason` attributes).
fn params_err(py: Python<'_>, e: &ParamsError) -> PyErr {
    let text = |s: &str| PyString::new(py, s).into_any().unbind();
    raise_with(
        py,
        Family::InvalidArgument,
        e.to_string(),
        &[("field", text(&e.field)), ("reason", text(&e.reason))],
    )
}

/// `InvalidArgument` for a value no JSON holds, naming the key it came under in the
/// object `root` (`kv_transfer_params`, `engine_info`).
fn unusable(py: Python<'_>, root: &str, key: Option<&str>, what: &str) -> PyErr {
    let field = match key {
        Some(k) => format!("{root}.{k}"),
        None => root.to_owned(),
    };
    params_err(
        py,
        &ParamsError {
            field,
            reason: what.to_owned(),
        },
    )
}

/// A Python value as JSON; `key` is the top-level key of the object `root` it is under
/// (for errors).
pub(crate) fn to_json(
    v: &Bound<'_, PyAny>,
    root: &str,
    key: Option<&str>,
    depth: usize,
) -> PyResult<Value> {
    let py = v.py();
    if depth > MAX_DEPTH {
        return Err(unusable(py, root, key, "nested too deeply"));
    }
    if v.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Value::String(s.to_str()?.to_owned()));
    }
    if !v.is_instance_of::<PyFloat>() {
        // Python ints, and anything with `__index__` (numpy integers).
        if let Ok(n) = v.extract::<u64>() {
            return Ok(n.into());
        }
        if let Ok(n) = v.extract::<i64>() {
            return Ok(n.into());
        }
    }
    if v.is_instance_of::<PyFloat>() || v.hasattr("__index__")? {
        // Floats, and ints beyond 64 bits (read as an out-of-range number).
        let Ok(f) = v.extract::<f64>() else {
            return Err(unusable(py, root, key, "a number too large"));
        };
        return Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| unusable(py, root, key, "not a finite number"));
    }
    if let Ok(d) = v.cast::<PyMapping>() {
        let mut m = Map::new();
        for item in d.items()?.iter() {
            let (k, val): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let k = k.str()?.to_str()?.to_owned();
            let under = key.or(Some(k.as_str())).map(str::to_owned);
            let val = to_json(&val, root, under.as_deref(), depth + 1)?;
            m.insert(k, val);
        }
        return Ok(Value::Object(m));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let seq = v.cast::<PySequence>()?;
        let mut out = Vec::with_capacity(seq.len()?);
        for item in seq.try_iter()? {
            out.push(to_json(&item?, root, key, depth + 1)?);
        }
        return Ok(Value::Array(out));
    }
    let type_name = v.get_type().name()?;
    Err(unusable(
        py,
        root,
        key,
        &format!("a {type_name} is not a JSON value"),
    ))
}

/// A JSON value as Python.
pub(crate) fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any().unbind(),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.into_pyobject(py)?.into_any().unbind(),
            (None, Some(i), _) => i.into_pyobject(py)?.into_any().unbind(),
            (None, None, f) => f.unwrap_or(f64::NAN).into_pyobject(py)?.into_any().unbind(),
        },
        Value::String(s) => PyString::new(py, s).into_any().unbind(),
        Value::Array(items) => {
            let items = items
                .iter()
                .map(|i| to_py(py, i))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, val) in m {
                d.set_item(k, to_py(py, val)?)?;
            }
            d.into_any().unbind()
        }
    })
}

/// `kv_transfer_params` as P answers them and D takes them: vLLM's keys and kvlease's,
/// read and checked by the same codec as the agents'.
#[pyclass(module = "kvlease._kvlease", frozen, eq, skip_from_py_object)]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct KvTransferParams(params::KvTransferParams);

impl KvTransferParams {
    fn read(py: Python<'_>, v: &Value) -> PyResult<Self> {
        params::KvTransferParams::from_value(v)
            .map(Self)
            .map_err(|e| params_err(py, &e))
    }

    fn read_turn(py: Python<'_>, v: &Value) -> PyResult<Self> {
        params::KvTransferParams::from_turn_value(v)
            .map(Self)
            .map_err(|e| params_err(py, &e))
    }

    /// The turn as the engine's bidirectional types take it (`plan_pull`).
    fn decoder_params(&self) -> Option<DecoderKvParams> {
        DecoderKvParams::from_turn(&self.0)
    }
}

/// What `KvTransferParams.plan_pull` decided for a next-turn prompt: `pull` D's first
/// `blocks` (they hold the KV of `tokens` prompt tokens; `diverged`: the prompt left the
/// cached turn inside it), or recompute for `reason` (`no_common_block`,
/// `below_threshold`, `deadline_too_close`, `no_clock_sample`, `block_size_mismatch`).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PullPlan {
    pull: bool,
    reason: Option<&'static str>,
    blocks: Vec<u32>,
    tokens: usize,
    diverged: bool,
}

#[pymethods]
impl PullPlan {
    fn __repr__(&self) -> String {
        match self.reason {
            None => format!(
                "PullPlan(pull, blocks={}, tokens={})",
                self.blocks.len(),
                self.tokens
            ),
            Some(r) => format!("PullPlan(recompute, reason={r:?})"),
        }
    }
}

#[pymethods]
impl KvTransferParams {
    /// P's answer: checked as D will read it (`InvalidArgument` naming the field).
    #[new]
    #[pyo3(signature = (
        *,
        remote_engine_id,
        remote_request_id,
        remote_block_ids,
        remote_host,
        remote_port,
        tp_size,
        kvlease_generation,
        kvlease_num_tokens,
        kvlease_lease_ms = None,
        kvlease_instance = None,
        kv_digest = None,
        dcp_size = None,
        pp_size = None,
        remote_num_tokens = None,
        transfer_mode = None,
    ))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments, one per key"
    )]
    fn new(
        py: Python<'_>,
        remote_engine_id: &Bound<'_, PyAny>,
        remote_request_id: &Bound<'_, PyAny>,
        remote_block_ids: &Bound<'_, PyAny>,
        remote_host: &Bound<'_, PyAny>,
        remote_port: &Bound<'_, PyAny>,
        tp_size: &Bound<'_, PyAny>,
        kvlease_generation: &Bound<'_, PyAny>,
        kvlease_num_tokens: &Bound<'_, PyAny>,
        kvlease_lease_ms: Option<&Bound<'_, PyAny>>,
        kvlease_instance: Option<&Bound<'_, PyAny>>,
        kv_digest: Option<&Bound<'_, PyAny>>,
        dcp_size: Option<&Bound<'_, PyAny>>,
        pp_size: Option<&Bound<'_, PyAny>>,
        remote_num_tokens: Option<&Bound<'_, PyAny>>,
        transfer_mode: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut m = Map::new();
        m.insert("do_remote_prefill".into(), Value::Bool(true));
        for (key, v) in [
            ("remote_engine_id", Some(remote_engine_id)),
            ("remote_request_id", Some(remote_request_id)),
            ("remote_block_ids", Some(remote_block_ids)),
            ("remote_host", Some(remote_host)),
            ("remote_port", Some(remote_port)),
            ("tp_size", Some(tp_size)),
            ("kvlease_generation", Some(kvlease_generation)),
            ("kvlease_num_tokens", Some(kvlease_num_tokens)),
            (params::LEASE_MS_KEY, kvlease_lease_ms),
            ("kvlease_instance", kvlease_instance),
            ("kv_digest", kv_digest),
            ("dcp_size", dcp_size),
            ("pp_size", pp_size),
            ("remote_num_tokens", remote_num_tokens),
            ("transfer_mode", transfer_mode),
        ] {
            if let Some(v) = v {
                m.insert(key.into(), to_json(v, params::PARAMS, Some(key), 0)?);
            }
        }
        Self::read(py, &Value::Object(m))
    }

    /// A turn (bidirectional mode): the lease keys of the engine that decoded it, naming
    /// its own blocks and hold, and what a turn adds; checked as the next turn's P reads
    /// it (`InvalidArgument` naming the field).
    #[staticmethod]
    #[pyo3(signature = (
        *,
        remote_engine_id,
        remote_request_id,
        remote_block_ids,
        remote_host,
        remote_port,
        tp_size,
        kvlease_generation,
        kvlease_num_tokens,
        kvlease_block_size,
        kvlease_block_hashes,
        kvlease_deadline_ns,
        kvlease_ttl_remaining_ms,
        kvlease_renew_extension_ms = None,
        kvlease_lease_ms = None,
        kvlease_instance = None,
        remote_num_tokens = None,
        remote_blocks_expiry_time = None,
        conversation_id = None,
        kvlease_clock_port = None,
    ))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments, one per key"
    )]
    fn turn(
        py: Python<'_>,
        remote_engine_id: &Bound<'_, PyAny>,
        remote_request_id: &Bound<'_, PyAny>,
        remote_block_ids: &Bound<'_, PyAny>,
        remote_host: &Bound<'_, PyAny>,
        remote_port: &Bound<'_, PyAny>,
        tp_size: &Bound<'_, PyAny>,
        kvlease_generation: &Bound<'_, PyAny>,
        kvlease_num_tokens: &Bound<'_, PyAny>,
        kvlease_block_size: &Bound<'_, PyAny>,
        kvlease_block_hashes: Vec<u64>,
        kvlease_deadline_ns: &Bound<'_, PyAny>,
        kvlease_ttl_remaining_ms: &Bound<'_, PyAny>,
        kvlease_renew_extension_ms: Option<&Bound<'_, PyAny>>,
        kvlease_lease_ms: Option<&Bound<'_, PyAny>>,
        kvlease_instance: Option<&Bound<'_, PyAny>>,
        remote_num_tokens: Option<&Bound<'_, PyAny>>,
        remote_blocks_expiry_time: Option<&Bound<'_, PyAny>>,
        conversation_id: Option<&Bound<'_, PyAny>>,
        kvlease_clock_port: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut m = Map::new();
        m.insert("do_remote_decode".into(), Value::Bool(true));
        m.insert("kvlease_bidir".into(), Value::Bool(true));
        m.insert(
            "kvlease_block_hashes".into(),
            kvlease_block_hashes
                .iter()
                .map(|h| Value::from(format!("{h:016x}")))
                .collect(),
        );
        for (key, v) in [
            ("remote_engine_id", Some(remote_engine_id)),
            ("remote_request_id", Some(remote_request_id)),
            ("remote_block_ids", Some(remote_block_ids)),
            ("remote_host", Some(remote_host)),
            ("remote_port", Some(remote_port)),
            ("tp_size", Some(tp_size)),
            ("kvlease_generation", Some(kvlease_generation)),
            ("kvlease_num_tokens", Some(kvlease_num_tokens)),
            ("kvlease_block_size", Some(kvlease_block_size)),
            ("kvlease_deadline_ns", Some(kvlease_deadline_ns)),
            ("kvlease_ttl_remaining_ms", Some(kvlease_ttl_remaining_ms)),
            ("kvlease_renew_extension_ms", kvlease_renew_extension_ms),
            (params::LEASE_MS_KEY, kvlease_lease_ms),
            ("kvlease_instance", kvlease_instance),
            ("remote_num_tokens", remote_num_tokens),
            ("remote_blocks_expiry_time", remote_blocks_expiry_time),
            ("conversation_id", conversation_id),
            ("kvlease_clock_port", kvlease_clock_port),
        ] {
            if let Some(v) = v {
                m.insert(key.into(), to_json(v, params::PARAMS, Some(key), 0)?);
            }
        }
        Self::read_turn(py, &Value::Object(m))
    }

    /// Reads a turn (bidirectional mode) as the next turn's P gets it: `kvlease_bidir`
    /// true, the holding engine's lease keys and the turn's.
    #[staticmethod]
    fn from_turn_dict(py: Python<'_>, params: &Bound<'_, PyAny>) -> PyResult<Self> {
        let v = to_json(params, params::PARAMS, None, 0)?;
        Self::read_turn(py, &v)
    }

    /// Whether these are a turn's params (bidirectional mode) rather than P's lease.
    #[getter]
    fn is_turn(&self) -> bool {
        self.0.turn.is_some()
    }

    /// A turn's tokens per block.
    #[getter]
    fn kvlease_block_size(&self) -> Option<u32> {
        self.0.turn.as_ref().map(|t| t.kvlease_block_size)
    }

    /// A turn's prefix hashes, one per whole block (`block_hashes`).
    #[getter]
    fn kvlease_block_hashes(&self) -> Option<Vec<u64>> {
        self.0.turn.as_ref().map(|t| t.kvlease_block_hashes.clone())
    }

    /// A turn's end on its holder's clock, nanoseconds.
    #[getter]
    fn kvlease_deadline_ns(&self) -> Option<u64> {
        self.0.turn.as_ref().map(|t| t.kvlease_deadline_ns)
    }

    /// A turn's time left when its holder answered, milliseconds.
    #[getter]
    fn kvlease_ttl_remaining_ms(&self) -> Option<u64> {
        self.0.turn.as_ref().map(|t| t.kvlease_ttl_remaining_ms)
    }

    /// A turn holder's clock probe port (0: it serves none).
    #[getter]
    fn kvlease_clock_port(&self) -> Option<u16> {
        self.0.turn.as_ref().map(|t| t.kvlease_clock_port)
    }

    /// How far each heartbeat of its reader moves a turn's end (0: a fixed TTL), ms.
    #[getter]
    fn kvlease_renew_extension_ms(&self) -> Option<u64> {
        self.0.turn.as_ref().map(|t| t.kvlease_renew_extension_ms)
    }

    /// P's decision for the next turn's `prompt` (token ids) with blocks of `block_size`
    /// tokens, at `now` (seconds): pull the whole blocks of the turn whose prefix hashes
    /// equal the prompt's, when they hold at least `threshold_tokens` tokens and the end
    /// of the hold leaves `safety_margin` + `expected_transfer` seconds after `now`, or
    /// recompute. With `clock_offset` (`probe_clock` of the holder's clock probe) the end
    /// is the turn's `kvlease_deadline_ns` on the holder's clock, read on this host's wall
    /// clock within the offset's error bound; without, it is the time left the turn
    /// announced (`kvlease_ttl_remaining_ms`, counted from when `received_at`, seconds on
    /// `now`'s clock) — the engine's `plan_pull`, as the agents decide.
    #[pyo3(signature = (prompt, block_size, now, *, threshold_tokens, safety_margin, received_at, expected_transfer = 0.0, clock_offset = None))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python method's keyword arguments"
    )]
    fn plan_pull(
        &self,
        py: Python<'_>,
        prompt: Vec<u32>,
        block_size: u32,
        now: f64,
        threshold_tokens: u32,
        safety_margin: f64,
        received_at: f64,
        expected_transfer: f64,
        clock_offset: Option<crate::clock::ClockOffset>,
    ) -> PyResult<PullPlan> {
        let Some(mut turn) = self.decoder_params() else {
            return Err(params_err(
                py,
                &ParamsError {
                    field: format!("{}.kvlease_bidir", params::PARAMS),
                    reason: "not a turn's params".into(),
                },
            ));
        };
        let secs = |what: &str, s: f64| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                crate::errors::invalid(py, format!("{what} must be a number of seconds >= 0"))
            })
        };
        // The time left as of `now`: what the turn announced, less the time since it came.
        let held = secs("now - received_at", (now - received_at).max(0.0))?;
        turn.kvlease_ttl_remaining = turn.kvlease_ttl_remaining.saturating_sub(held);
        let policy = PullPolicy {
            threshold_tokens,
            safety_margin: secs("safety_margin", safety_margin)?,
            basis: if clock_offset.is_some() {
                DeadlineBasis::ClockOffset
            } else {
                DeadlineBasis::RelativeTtl
            },
        };
        // The offset relates the holder's clock to this host's wall clock, so the deadline
        // is compared with the wall clock now; the time left, with `now`.
        let now_ts = match clock_offset {
            Some(_) => kvlease_lease::Timestamp::from_nanos(crate::clock::wall_ns(0)),
            None => crate::cores::at(py, now)?,
        };
        let decision = plan_pull(
            &policy,
            &turn,
            &prompt,
            block_size,
            now_ts,
            clock_offset.map(|o| o.0),
            secs("expected_transfer", expected_transfer)?,
        );
        Ok(match decision {
            PullDecision::Pull {
                blocks,
                tokens,
                diverged,
            } => PullPlan {
                pull: true,
                reason: None,
                blocks: blocks.iter().map(|b| b.0).collect(),
                tokens,
                diverged,
            },
            PullDecision::Recompute(why) => PullPlan {
                pull: false,
                reason: Some(match why {
                    RecomputeReason::NoCommonBlock => "no_common_block",
                    RecomputeReason::BelowThreshold { .. } => "below_threshold",
                    RecomputeReason::DeadlineTooClose => "deadline_too_close",
                    RecomputeReason::NoClockSample => "no_clock_sample",
                    RecomputeReason::BlockSizeMismatch => "block_size_mismatch",
                }),
                blocks: Vec::new(),
                tokens: 0,
                diverged: false,
            },
        })
    }

    /// Reads D's `kv_transfer_params` (P's answer, copied by a proxy). Accepts the old
    /// `kvlease_lease_duration` (seconds) and KV cache groups' `[[...],[...]]` block lists.
    #[staticmethod]
    fn from_dict(py: Python<'_>, params: &Bound<'_, PyAny>) -> PyResult<Self> {
        let v = to_json(params, params::PARAMS, None, 0)?;
        Self::read(py, &v)
    }

    /// The dict P answers with (canonical keys; `do_remote_prefill: True`,
    /// `do_remote_decode: False`; optional keys only when set); a turn's the other way
    /// round, with `kvlease_bidir: True` and the turn's keys.
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py(py, &self.0.to_value())
    }

    /// The typed coordinates D's core takes (`DecodeCore.on_new_request`).
    fn to_remote_kv<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let p = &self.0;
        let kwargs = PyDict::new(py);
        kwargs.set_item("engine", p.remote_engine_id.as_str())?;
        kwargs.set_item("request", p.remote_request_id.as_str())?;
        kwargs.set_item("blocks", p.remote_block_ids.clone())?;
        kwargs.set_item("generation", p.kvlease_generation)?;
        kwargs.set_item("tp_size", p.tp_size)?;
        kwargs.set_item("num_tokens", p.kvlease_num_tokens)?;
        kwargs.set_item("host", p.remote_host.as_str())?;
        kwargs.set_item("port", p.remote_port)?;
        kwargs.set_item("instance", p.kvlease_instance)?;
        py.get_type::<RemoteKv>().call((), Some(&kwargs))
    }

    /// P's engine id.
    #[getter]
    fn remote_engine_id(&self) -> &str {
        self.0.remote_engine_id.as_str()
    }

    /// P's id of the request.
    #[getter]
    fn remote_request_id(&self) -> &str {
        self.0.remote_request_id.as_str()
    }

    /// P's block ids, in token order (with several KV cache groups, every group's blocks,
    /// group after group: the one lease's blocks).
    #[getter]
    fn remote_block_ids(&self) -> Vec<u32> {
        self.0.remote_block_ids.clone()
    }

    /// P's block ids per KV cache group (vLLM's hybrid KV cache manager): one list for
    /// one group.
    #[getter]
    fn remote_block_groups(&self) -> Vec<Vec<u32>> {
        self.0
            .block_groups()
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect()
    }

    /// Host of P's side channel.
    #[getter]
    fn remote_host(&self) -> &str {
        &self.0.remote_host
    }

    /// Port of P's side channel.
    #[getter]
    fn remote_port(&self) -> u16 {
        self.0.remote_port
    }

    /// P's TP size.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.0.tp_size
    }

    /// vLLM's `dcp_size`, if given.
    #[getter]
    fn dcp_size(&self) -> Option<u32> {
        self.0.dcp_size
    }

    /// vLLM's `pp_size`, if given.
    #[getter]
    fn pp_size(&self) -> Option<u32> {
        self.0.pp_size
    }

    /// vLLM's `remote_num_tokens`, if given.
    #[getter]
    fn remote_num_tokens(&self) -> Option<u32> {
        self.0.remote_num_tokens
    }

    /// vLLM's `transfer_mode`, if given.
    #[getter]
    fn transfer_mode(&self) -> Option<&str> {
        self.0.transfer_mode.as_deref()
    }

    /// The lease's generation (the fence word to expect).
    #[getter]
    fn kvlease_generation(&self) -> u64 {
        self.0.kvlease_generation
    }

    /// Tokens P prefilled.
    #[getter]
    fn kvlease_num_tokens(&self) -> u32 {
        self.0.kvlease_num_tokens
    }

    /// The lease P granted, milliseconds, if announced.
    #[getter]
    fn kvlease_lease_ms(&self) -> Option<u64> {
        self.0.kvlease_lease_ms
    }

    /// The P instance that granted the lease (0: unknown).
    #[getter]
    fn kvlease_instance(&self) -> u64 {
        self.0.kvlease_instance
    }

    /// The KV's digest (`kvd-<16 hex>`), if P sent one.
    #[getter]
    fn kv_digest(&self) -> Option<String> {
        self.0.kv_digest.map(|d: KvDigest| d.to_string())
    }

    fn __repr__(&self) -> String {
        let p = &self.0;
        format!(
            "KvTransferParams(remote_engine_id={:?}, remote_request_id={:?}, blocks={}, kvlease_generation={})",
            p.remote_engine_id.as_str(),
            p.remote_request_id.as_str(),
            p.remote_block_ids.len(),
            p.kvlease_generation
        )
    }
}

/// The rolling prefix hash of `tokens` at the end of each whole block of `block_size`
/// tokens: what a turn's `kvlease_block_hashes` hold and the next turn's P compares its
/// prompt's with (the engine's `block_hashes`, as the agents compute them).
#[pyfunction]
pub(crate) fn block_hashes(tokens: Vec<u32>, block_size: u32) -> Vec<u64> {
    kvlease_engine::block_hashes(&tokens, block_size)
}
