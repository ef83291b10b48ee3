//! The engine cores for Python: [`PrefillCore`] and [`DecodeCore`] with Python types.
//!
//! Every decision stays in `kvlease-engine`; these types only convert. Time is an
//! argument: `now` is seconds on one monotonic clock per core (`time.monotonic()`).

use std::sync::Arc;
use std::time::Duration;

use kvlease_engine as engine;
use kvlease_engine::{
    BatchResult, BlockSource, DecodeConfig, DecodeEvent, DecodeNotif, Outcome, PrefillAction,
    PrefillConfig, PrefillEvent, PrefillNotif, RemoteEngine, TransmitKind,
};
use kvlease_lease::{
    BlockId, EngineId, Generation, LeaseConfig, ReadCompleteOutcome, ReleaseReason, RequestId,
    Timestamp,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{Family, ToPyErr, invalid, raise_err};

/// `now` (seconds) as a core's timestamp.
fn at(py: Python<'_>, now: f64) -> PyResult<Timestamp> {
    Duration::try_from_secs_f64(now)
        .map(Timestamp::from_duration)
        .map_err(|_| {
            invalid(
                py,
                format!("now must be a finite number of seconds >= 0, not {now}"),
            )
        })
}

fn secs(t: Timestamp) -> f64 {
    t.as_duration().as_secs_f64()
}

fn request_id(py: Python<'_>, s: &str) -> PyResult<RequestId> {
    RequestId::new(s).map_err(|e| {
        invalid(
            py,
            format!("request id {s:?}: {}", crate::errors::chain(&e)),
        )
    })
}

fn engine_id(py: Python<'_>, s: &str) -> PyResult<EngineId> {
    EngineId::new(s)
        .map_err(|e| invalid(py, format!("engine id {s:?}: {}", crate::errors::chain(&e))))
}

fn block_ids(blocks: Vec<u32>) -> Vec<BlockId> {
    blocks.into_iter().map(BlockId).collect()
}

fn block_list(blocks: &[BlockId]) -> Vec<u32> {
    blocks.iter().map(|b| b.0).collect()
}

fn lease_config(py: Python<'_>, duration: f64) -> PyResult<LeaseConfig> {
    LeaseConfig::from_secs_f64(duration).map_err(|e| e.to_py(py))
}

/// A Rust error built from a Python message (a shell's cause of a failed read or
/// handshake).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
struct ShellError {
    message: String,
}

fn cause(message: String) -> engine::Cause {
    Arc::new(ShellError { message })
}

// ---------------------------------------------------------------------------- prefill

/// A request whose blocks a pool core allocated: compute and fill them, then call
/// `handle_prefill_done`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PrefillStart {
    /// The request.
    request: String,
    /// Its blocks, the same ids on every worker.
    blocks: Vec<u32>,
    /// Seconds it waited for them.
    waited: f64,
}

/// A granted lease: publish `generation` in every worker's fence words of `blocks`,
/// then answer with the request's transfer parameters.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Granted {
    /// The request.
    request: String,
    /// Its blocks.
    blocks: Vec<u32>,
    /// The lease's fencing token (the word to publish).
    generation: u64,
    /// Whether the grant replaced an older lease of the same request id.
    superseded: bool,
}

/// A lease that ended (`reason`: `"completed"`, `"expired"` or `"aborted"`).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Released {
    /// The request.
    request: String,
    /// Its blocks.
    blocks: Vec<u32>,
    /// The lease's generation.
    generation: u64,
    /// Why it ended.
    reason: &'static str,
    /// When it was granted (the core's clock, seconds).
    granted_at: f64,
    /// Its expiry when it ended.
    expiry: f64,
    /// When the last heartbeat naming it arrived, if any did.
    last_heartbeat: Option<f64>,
    /// When it was released.
    released_at: f64,
}

impl Released {
    fn new(r: &kvlease_lease::Released) -> Self {
        Self {
            request: r.request.as_str().to_owned(),
            blocks: block_list(&r.blocks),
            generation: r.generation.word(),
            reason: match r.reason {
                ReleaseReason::Completed => "completed",
                ReleaseReason::Expired => "expired",
                ReleaseReason::Aborted => "aborted",
            },
            granted_at: secs(r.granted_at),
            expiry: secs(r.expiry),
            last_heartbeat: r.last_heartbeat.map(secs),
            released_at: secs(r.released_at),
        }
    }
}

#[pymethods]
impl Released {
    fn __repr__(&self) -> String {
        format!(
            "Released(request={:?}, reason={:?}, blocks={})",
            self.request,
            self.reason,
            self.blocks.len()
        )
    }
}

/// A lease ended: publish the free word (0) in every worker's fence words of
/// `released.blocks` **now**; from then on the blocks may be reused (a core with
/// external blocks: the serving engine may free them).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct ClearFences {
    /// The lease that ended.
    released: Py<Released>,
}

/// Send `message` (an expiry notice) to the D endpoint named `to`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct SendNotif {
    /// The endpoint (the sender name `handle_notif` was given).
    to: String,
    /// The encoded notification.
    message: Py<PyBytes>,
}

/// A queued request was refused (`error` is a `PrefillError`).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Refused {
    /// The request.
    request: String,
    /// The exception to answer it with.
    error: Py<PyAny>,
}

/// Everything a prefill engine (P) decides about leases, and nothing it does: the
/// `kvlease-engine` core.
///
/// Call order per step: `handle_job` / `poll_prefill` / `handle_prefill_done` (or, with
/// `external_blocks`, only `handle_prefill_done_in`), `handle_notif` for each
/// notification, `handle_timeout`, then after every input `poll_action` until `None`
/// (clear fences, send expiry notices) and `poll_event` until `None`.
#[pyclass(module = "kvlease._kvlease")]
pub(crate) struct PrefillCore {
    core: engine::PrefillCore<String>,
}

#[pymethods]
impl PrefillCore {
    /// A core for P engine `engine_id` with `tp_size` workers and `num_blocks` blocks
    /// of `block_size` tokens per worker; leases last `lease_duration` seconds
    /// (heartbeats every sixth, each extending by two thirds). With `external_blocks`,
    /// the serving engine allocates blocks (`handle_prefill_done_in`).
    #[new]
    #[pyo3(signature = (engine_id, *, tp_size, num_blocks, block_size, lease_duration = 30.0, external_blocks = false, pool_wait = 0.0, first_generation = None, max_consumers = None))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments"
    )]
    fn new(
        py: Python<'_>,
        engine_id: &str,
        tp_size: u32,
        num_blocks: u32,
        block_size: u32,
        lease_duration: f64,
        external_blocks: bool,
        pool_wait: f64,
        first_generation: Option<u64>,
        max_consumers: Option<u32>,
    ) -> PyResult<Self> {
        if tp_size == 0 || num_blocks == 0 || block_size == 0 {
            return Err(invalid(
                py,
                "tp_size, num_blocks and block_size must be positive",
            ));
        }
        let mut config = PrefillConfig::new(
            self::engine_id(py, engine_id)?,
            tp_size,
            num_blocks,
            block_size,
            lease_config(py, lease_duration)?,
        )
        .with_pool_wait(
            Duration::try_from_secs_f64(pool_wait)
                .map_err(|_| invalid(py, "pool_wait must be >= 0 seconds"))?,
        )
        .with_block_source(if external_blocks {
            BlockSource::External
        } else {
            BlockSource::Pool
        });
        if let Some(first) = first_generation {
            let first = std::num::NonZeroU64::new(first)
                .ok_or_else(|| invalid(py, "first_generation must be positive"))?;
            config = config.with_first_generation(Generation(first));
        }
        if let Some(max) = max_consumers {
            config = config.with_max_consumers(max);
        }
        Ok(Self {
            core: engine::PrefillCore::new(config),
        })
    }

    /// The engine's id.
    #[getter]
    fn engine_id(&self) -> String {
        self.core.config().engine_id.as_str().to_owned()
    }

    /// The lease duration, seconds.
    #[getter]
    fn lease_duration(&self) -> f64 {
        self.core.config().lease.duration().as_secs_f64()
    }

    /// The heartbeat interval D keeps (duration / 6), seconds.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        self.core.config().lease.interval().as_secs_f64()
    }

    /// Leases held.
    #[getter]
    fn leases(&self) -> usize {
        self.core.leases()
    }

    /// Blocks held by leases.
    #[getter]
    fn blocks_leased(&self) -> usize {
        self.core.blocks_leased()
    }

    /// Blocks allocated or held (leased, being prefilled, awaiting their fence clear).
    #[getter]
    fn blocks_allocated(&self) -> usize {
        self.core.blocks_allocated()
    }

    /// Requests waiting for blocks.
    #[getter]
    fn waiting(&self) -> usize {
        self.core.waiting()
    }

    /// Whether nothing is queued, prefilling or leased.
    fn is_idle(&self) -> bool {
        self.core.is_idle()
    }

    /// The D engine that owns `request`'s lease, once one heartbeated, read or aborted it.
    fn owner(&self, py: Python<'_>, request: &str) -> PyResult<Option<String>> {
        let request = request_id(py, request)?;
        Ok(self.core.owner(&request).map(|e| e.as_str().to_owned()))
    }

    /// `request`'s lease: `{"generation", "expiry", "last_heartbeat", "blocks",
    /// "consumers_reported", "consumers_expected"}`, or `None`.
    fn lease<'py>(&self, py: Python<'py>, request: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        let request = request_id(py, request)?;
        let Some(info) = self.core.table().get(&request) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("generation", info.generation.word())?;
        d.set_item("granted_at", secs(info.granted_at))?;
        d.set_item("expiry", secs(info.expiry))?;
        d.set_item("last_heartbeat", info.last_heartbeat.map(secs))?;
        d.set_item("blocks", info.blocks)?;
        d.set_item("consumers_reported", info.consumers_reported)?;
        d.set_item("consumers_expected", info.consumers_expected)?;
        Ok(Some(d))
    }

    /// The counters, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("jobs", s.jobs)?;
        d.set_item("granted", s.granted)?;
        d.set_item("refused", s.refused)?;
        d.set_item("released_completed", s.released_completed)?;
        d.set_item("released_expired", s.released_expired)?;
        d.set_item("released_aborted", s.released_aborted)?;
        d.set_item("foreign_notifs", s.foreign_notifs)?;
        d.set_item("malformed_notifs", s.malformed_notifs)?;
        d.set_item("expiry_notices", s.expiry_notices)?;
        Ok(d)
    }

    /// A request of `num_tokens` arrived (pool cores); it waits for blocks.
    fn handle_job(
        &mut self,
        py: Python<'_>,
        now: f64,
        request: &str,
        num_tokens: usize,
    ) -> PyResult<()> {
        let now = at(py, now)?;
        let request = request_id(py, request)?;
        self.core
            .handle_job(now, request, num_tokens)
            .map_err(|e| e.to_py(py))
    }

    /// The next request to prefill with its blocks (pool cores), or `None`.
    fn poll_prefill(&mut self, py: Python<'_>, now: f64) -> PyResult<Option<PrefillStart>> {
        let now = at(py, now)?;
        Ok(self.core.poll_prefill(now).map(|s| PrefillStart {
            request: s.request.as_str().to_owned(),
            blocks: block_list(&s.blocks),
            waited: s.waited.as_secs_f64(),
        }))
    }

    /// The prefill of `request` is done (pool cores): grants its lease.
    fn handle_prefill_done(
        &mut self,
        py: Python<'_>,
        now: f64,
        request: &str,
    ) -> PyResult<Granted> {
        let now = at(py, now)?;
        let request = request_id(py, request)?;
        let g = self
            .core
            .handle_prefill_done(now, &request)
            .map_err(|e| e.to_py(py))?;
        Ok(granted(&g))
    }

    /// The prefill of `request` is done in `blocks`, which the serving engine allocated
    /// (`external_blocks` cores; vLLM's `request_finished`): grants its lease.
    fn handle_prefill_done_in(
        &mut self,
        py: Python<'_>,
        now: f64,
        request: &str,
        blocks: Vec<u32>,
    ) -> PyResult<Granted> {
        let now = at(py, now)?;
        let request = request_id(py, request)?;
        let g = self
            .core
            .handle_prefill_done_in(now, request, block_ids(blocks))
            .map_err(|e| e.to_py(py))?;
        Ok(granted(&g))
    }

    /// The prefill of `request` failed: its blocks go back. Returns whether it was
    /// being prefilled.
    fn handle_prefill_failed(&mut self, py: Python<'_>, request: &str) -> PyResult<bool> {
        let request = request_id(py, request)?;
        Ok(self.core.handle_prefill_failed(&request))
    }

    /// Releases `request`'s lease at once (nobody will read it), or drops it from the
    /// queue. Returns whether anything was held.
    fn abort(&mut self, py: Python<'_>, now: f64, request: &str) -> PyResult<bool> {
        let now = at(py, now)?;
        let request = request_id(py, request)?;
        Ok(self.core.abort(now, &request))
    }

    /// Refuses every queued request.
    fn shutdown(&mut self) {
        self.core.shutdown();
    }

    /// A notification `message` from the authenticated D endpoint `sender` of D engine
    /// `sender_engine`: heartbeats renew, read completions and aborts release. Returns
    /// what it did, as `{"kind": ..., ...}`. Malformed input changes nothing.
    fn handle_notif<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
        sender_engine: &str,
        sender: String,
        message: &[u8],
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = at(py, now)?;
        let from = engine::Peer {
            engine: engine_id(py, sender_engine)?,
            addr: sender,
        };
        let d = PyDict::new(py);
        match self.core.handle_notif(now, &from, message) {
            PrefillNotif::Heartbeat {
                ids,
                outcome,
                foreign,
            } => {
                d.set_item("kind", "heartbeat")?;
                d.set_item("ids", ids)?;
                d.set_item("held", outcome.held)?;
                d.set_item("extended", outcome.extended)?;
                d.set_item("unknown", outcome.unknown)?;
                d.set_item("late", outcome.late)?;
                d.set_item("foreign", foreign)?;
            }
            PrefillNotif::ReadComplete { request, outcome } => {
                d.set_item("kind", "read_complete")?;
                d.set_item("request", request.as_str())?;
                let (what, remaining) = match outcome {
                    ReadCompleteOutcome::Released => ("released", Some(0)),
                    ReadCompleteOutcome::Waiting { remaining } => ("waiting", Some(remaining)),
                    ReadCompleteOutcome::Duplicate { remaining } => ("duplicate", Some(remaining)),
                    ReadCompleteOutcome::Unknown => ("unknown", None),
                    ReadCompleteOutcome::InvalidTotal => ("invalid_total", None),
                };
                d.set_item("outcome", what)?;
                d.set_item("remaining", remaining)?;
            }
            PrefillNotif::Abort { request, held } => {
                d.set_item("kind", "abort")?;
                d.set_item("request", request.as_str())?;
                d.set_item("held", held)?;
            }
            PrefillNotif::Foreign { request } => {
                d.set_item("kind", "foreign")?;
                d.set_item("request", request.as_str())?;
            }
            PrefillNotif::Malformed(e) => {
                d.set_item("kind", "malformed")?;
                d.set_item("error", crate::errors::chain(&e))?;
            }
            _ => d.set_item("kind", "ignored")?,
        }
        Ok(d)
    }

    /// The reaper: releases every lease past its expiry.
    fn handle_timeout(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        let now = at(py, now)?;
        self.core.handle_timeout(now);
        Ok(())
    }

    /// When to call `handle_timeout` next (seconds on the core's clock), or `None`.
    fn poll_timeout(&self) -> Option<f64> {
        self.core.poll_timeout().map(secs)
    }

    /// The next action: `ClearFences`, `SendNotif`, or `None`.
    fn poll_action(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(action) = self.core.poll_action() else {
            return Ok(None);
        };
        let obj = match action {
            PrefillAction::ClearFences { released } => Py::new(
                py,
                ClearFences {
                    released: Py::new(py, Released::new(&released))?,
                },
            )?
            .into_any(),
            PrefillAction::Transmit { to, bytes } => Py::new(
                py,
                SendNotif {
                    to,
                    message: PyBytes::new(py, &bytes).unbind(),
                },
            )?
            .into_any(),
        };
        Ok(Some(obj))
    }

    /// The next event: `Released`, `Refused`, or `None`.
    fn poll_event(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(event) = self.core.poll_event() else {
            return Ok(None);
        };
        let obj = match event {
            PrefillEvent::Released(r) => Py::new(py, Released::new(&r))?.into_any(),
            PrefillEvent::Refused { request, error } => Py::new(
                py,
                Refused {
                    request: request.as_str().to_owned(),
                    error: error.to_py(py).into_value(py).into_any(),
                },
            )?
            .into_any(),
        };
        Ok(Some(obj))
    }
}

fn granted(g: &engine::Granted) -> Granted {
    Granted {
        request: g.request.as_str().to_owned(),
        blocks: block_list(&g.blocks),
        generation: g.generation.word(),
        superseded: g.superseded,
    }
}

// ----------------------------------------------------------------------------- decode

/// Where a request's KV lives on P: the typed core of `kv_transfer_params`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct RemoteKv {
    /// P's engine (`remote_engine_id`).
    engine: String,
    /// P's id of the request (`remote_request_id`).
    request: String,
    /// P's block ids (`remote_block_ids`).
    blocks: Vec<u32>,
    /// The lease's generation (the fence word to expect).
    generation: u64,
    /// P's TP size.
    tp_size: u32,
    /// Tokens P prefilled.
    num_tokens: u32,
    /// P's side channel host.
    host: String,
    /// P's side channel port.
    port: u16,
    /// The P instance that granted the lease (0: unknown).
    instance: u64,
}

#[pymethods]
impl RemoteKv {
    /// Remote coordinates, as P's `kv_transfer_params` give them.
    #[new]
    #[pyo3(signature = (*, engine, request, blocks, generation, tp_size, num_tokens, host, port, instance = 0))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments"
    )]
    fn new(
        engine: String,
        request: String,
        blocks: Vec<u32>,
        generation: u64,
        tp_size: u32,
        num_tokens: u32,
        host: String,
        port: u16,
        instance: u64,
    ) -> Self {
        Self {
            engine,
            request,
            blocks,
            generation,
            tp_size,
            num_tokens,
            host,
            port,
            instance,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "RemoteKv(engine={:?}, request={:?}, blocks={}, generation={})",
            self.engine,
            self.request,
            self.blocks.len(),
            self.generation
        )
    }
}

impl RemoteKv {
    fn to_engine(&self, py: Python<'_>) -> PyResult<engine::RemoteKv> {
        Ok(engine::RemoteKv::new(
            engine_id(py, &self.engine)?,
            request_id(py, &self.request)?,
            block_ids(self.blocks.clone()),
            self.generation,
            self.tp_size,
            self.num_tokens,
            self.host.clone(),
            self.port,
        )
        .with_instance(self.instance))
    }

    fn from_engine(r: &engine::RemoteKv) -> Self {
        Self {
            engine: r.engine.as_str().to_owned(),
            request: r.request.as_str().to_owned(),
            blocks: block_list(&r.blocks),
            generation: r.generation,
            tp_size: r.tp_size,
            num_tokens: r.num_tokens,
            host: r.host.clone(),
            port: r.port,
            instance: r.instance,
        }
    }
}

/// A handshake to start (off the engine's thread): fetch P's info from its side
/// channel, then report with `handle_handshake` or `handle_handshake_failed`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct HandshakeStart {
    /// P's engine.
    engine: String,
    /// P's side-channel host.
    host: String,
    /// P's side-channel port.
    port: u16,
}

/// A notification for P: send `message` to every worker (or the receiving endpoint) of
/// P engine `engine`. `kind` is `"heartbeat"` (naming `ids` requests) or `"abort"`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Transmit {
    /// P's engine.
    engine: String,
    /// How many P workers to send it to.
    workers: u32,
    /// The encoded notification.
    message: Py<PyBytes>,
    /// `"heartbeat"` or `"abort"`.
    kind: &'static str,
    /// Request ids named (heartbeats), else 0.
    ids: u32,
}

/// One read batch: from D worker `d_worker`, read P worker `p_rank`'s part of `heads`
/// (global head numbers, `(start, end)`) of the plan's blocks in every layer, fenced by
/// P's fence word of the request's first block; on success send `notif` to that P
/// worker (one consumer of the lease).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct BatchPlan {
    /// D worker posting the batch.
    d_worker: u32,
    /// P worker read from.
    p_rank: u32,
    /// Global heads read, `(start, end)`.
    heads: (u32, u32),
    /// The first global head of P worker `p_rank`.
    p_first_head: u32,
    /// The read-completion notification for P.
    notif: Py<PyBytes>,
}

/// A request's load: D's `blocks` receive P's blocks `remote.blocks[skip_blocks:]`;
/// post each batch, then report each with `handle_batch_done(request, index, ...)`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct LoadPlan {
    /// D's id of the request.
    request: String,
    /// D's blocks.
    blocks: Vec<u32>,
    /// Where the KV is.
    remote: RemoteKv,
    /// P's blocks skipped (computed locally).
    skip_blocks: usize,
    /// The generation every batch's fence read must find.
    fence_generation: u64,
    /// The batches, in order.
    batches: Vec<Py<BatchPlan>>,
}

fn load_plan(py: Python<'_>, p: &engine::LoadPlan) -> PyResult<LoadPlan> {
    let batches = p
        .batches
        .iter()
        .map(|b| {
            Py::new(
                py,
                BatchPlan {
                    d_worker: b.d_worker,
                    p_rank: b.p_rank,
                    heads: (b.heads.start, b.heads.end),
                    p_first_head: b.p_first_head,
                    notif: PyBytes::new(py, &b.notif).unbind(),
                },
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(LoadPlan {
        request: p.request.as_str().to_owned(),
        blocks: block_list(&p.blocks),
        remote: RemoteKv::from_engine(&p.remote),
        skip_blocks: p.skip_blocks,
        fence_generation: p.fence_generation,
        batches,
    })
}

/// Every batch of a request ended well: its KV is in `blocks` (call `handle_verified`).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Loaded {
    /// D's id.
    request: String,
    /// D's blocks.
    blocks: Vec<u32>,
    /// Bytes moved.
    bytes: u64,
}

/// A handshake finished well; its engine's requests may be loaded.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct HandshakeDone {
    /// P's engine.
    engine: String,
}

/// A request ended: `outcome` is `"done"`, `"failed"` (then `error` is a `LoadError`),
/// `"aborted"` or `"shutdown"`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Finished {
    /// D's id.
    request: String,
    /// How it ended.
    outcome: &'static str,
    /// The load failure, for `"failed"`.
    error: Option<Py<PyAny>>,
    /// Whether prefilling it again may succeed.
    retryable: bool,
}

#[pymethods]
impl Finished {
    fn __repr__(&self) -> String {
        format!(
            "Finished(request={:?}, outcome={:?})",
            self.request, self.outcome
        )
    }
}

/// Everything a decode engine (D) decides about leases, and nothing it does: the
/// `kvlease-engine` core.
///
/// Call order per step: `on_new_request` for each arrival (tracked at once),
/// `poll_handshake` until `None` (start each off-thread, report with
/// `handle_handshake`), `poll_transmit` until `None` (heartbeats, aborts), `handle_notif`
/// for each notification, `poll_load` until `None` (or with `external_blocks`,
/// `start_load` for each request the serving engine scheduled), `handle_batch_done` as
/// batches end, `handle_verified` on `Loaded`, `request_finished` when decoding ends;
/// after every input `poll_event` until `None`.
#[pyclass(module = "kvlease._kvlease")]
pub(crate) struct DecodeCore {
    core: engine::DecodeCore,
}

#[pymethods]
impl DecodeCore {
    /// A core for D engine `engine_id` with `tp_size` workers over `num_kv_heads` KV
    /// heads, `num_blocks` blocks of `block_size` tokens; heartbeats every
    /// `lease_duration / 6` seconds. With `external_blocks`, the serving engine allocates
    /// blocks and schedules loads (`start_load`).
    #[new]
    #[pyo3(signature = (engine_id, *, tp_size, num_kv_heads, block_size, num_blocks, lease_duration = 30.0, external_blocks = false, max_running = 64, max_waiting = 1024, retry = 0.005))]
    #[allow(
        clippy::too_many_arguments,
        reason = "a Python constructor's keyword arguments"
    )]
    fn new(
        py: Python<'_>,
        engine_id: &str,
        tp_size: u32,
        num_kv_heads: u32,
        block_size: u32,
        num_blocks: u32,
        lease_duration: f64,
        external_blocks: bool,
        max_running: u32,
        max_waiting: u32,
        retry: f64,
    ) -> PyResult<Self> {
        if tp_size == 0 || num_kv_heads == 0 || block_size == 0 || num_blocks == 0 {
            return Err(invalid(
                py,
                "tp_size, num_kv_heads, block_size and num_blocks must be positive",
            ));
        }
        if !num_kv_heads.is_multiple_of(tp_size) {
            return Err(invalid(
                py,
                format!("tp_size {tp_size} does not divide num_kv_heads {num_kv_heads}"),
            ));
        }
        let config = DecodeConfig::new(
            self::engine_id(py, engine_id)?,
            tp_size,
            num_kv_heads,
            block_size,
            num_blocks,
            lease_config(py, lease_duration)?,
        )
        .with_limits(max_running, max_waiting)
        .with_retry(
            Duration::try_from_secs_f64(retry)
                .map_err(|_| invalid(py, "retry must be >= 0 seconds"))?,
        )
        .with_block_source(if external_blocks {
            BlockSource::External
        } else {
            BlockSource::Pool
        });
        Ok(Self {
            core: engine::DecodeCore::new(config),
        })
    }

    /// The engine's id.
    #[getter]
    fn engine_id(&self) -> String {
        self.core.config().engine_id.as_str().to_owned()
    }

    /// The heartbeat interval, seconds.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        self.core.config().lease.interval().as_secs_f64()
    }

    /// Requests tracked for heartbeats.
    #[getter]
    fn tracked(&self) -> usize {
        self.core.tracked()
    }

    /// Requests waiting to be loaded.
    #[getter]
    fn waiting(&self) -> usize {
        self.core.waiting()
    }

    /// Requests loading or decoding.
    #[getter]
    fn running(&self) -> usize {
        self.core.running()
    }

    /// Blocks allocated (or, with external blocks, held for loads and decodes).
    #[getter]
    fn blocks_allocated(&self) -> usize {
        self.core.blocks_allocated()
    }

    /// Whether nothing is admitted, tracked or allocated.
    fn is_idle(&self) -> bool {
        self.core.is_idle()
    }

    /// Whether P engine `engine` is handshaken.
    fn is_ready(&self, py: Python<'_>, engine: &str) -> PyResult<bool> {
        Ok(self.core.is_ready(&engine_id(py, engine)?))
    }

    /// Whether `request` waits to be loaded.
    fn is_waiting(&self, py: Python<'_>, request: &str) -> PyResult<bool> {
        Ok(self.core.is_waiting(&request_id(py, request)?))
    }

    /// The remote coordinates of an admitted request, or `None`.
    fn remote_of(&self, py: Python<'_>, request: &str) -> PyResult<Option<RemoteKv>> {
        let request = request_id(py, request)?;
        Ok(self.core.remote_of(&request).map(RemoteKv::from_engine))
    }

    /// D's id of the request whose P id is `remote`, or `None`.
    fn local_id(&self, py: Python<'_>, remote: &str) -> PyResult<Option<String>> {
        let remote = request_id(py, remote)?;
        Ok(self.core.local_id(&remote).map(|r| r.as_str().to_owned()))
    }

    /// The counters, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("admitted", s.admitted)?;
        d.set_item("refused", s.refused)?;
        d.set_item("done", s.done)?;
        d.set_item("failed", s.failed)?;
        d.set_item("aborted", s.aborted)?;
        d.set_item("stale_reads", s.stale_reads)?;
        d.set_item("heartbeat_messages", s.heartbeat_messages)?;
        d.set_item("heartbeat_ids", s.heartbeat_ids)?;
        d.set_item("deferred_batches", s.deferred_batches)?;
        d.set_item("aborts_sent", s.aborts_sent)?;
        d.set_item("handshakes", s.handshakes)?;
        d.set_item("expiry_notices", s.expiry_notices)?;
        d.set_item("foreign_notifs", s.foreign_notifs)?;
        d.set_item("malformed_notifs", s.malformed_notifs)?;
        d.set_item("peer_restarts", s.peer_restarts)?;
        Ok(d)
    }

    /// A request of `num_tokens` prompt tokens prefilled by P at `remote` arrived: it is
    /// tracked (heartbeated) at once and waits to be loaded. Raises `AdmitError` when
    /// refused (an abort then frees P's lease at once, if P is connected).
    fn on_new_request(
        &mut self,
        py: Python<'_>,
        now: f64,
        request: &str,
        num_tokens: usize,
        remote: &RemoteKv,
    ) -> PyResult<()> {
        let now = at(py, now)?;
        let request = request_id(py, request)?;
        let remote = remote.to_engine(py)?;
        self.core
            .on_new_request(now, request, num_tokens, remote)
            .map_err(|e| e.to_py(py))
    }

    /// The next handshake to start, or `None`.
    fn poll_handshake(&mut self) -> Option<HandshakeStart> {
        self.core.poll_handshake().map(|h| HandshakeStart {
            engine: h.engine.as_str().to_owned(),
            host: h.host,
            port: h.port,
        })
    }

    /// The handshake with `engine` succeeded: P has `tp_size` workers of `num_blocks`
    /// blocks, and is instance `instance` (0: unknown).
    #[pyo3(signature = (now, engine, *, tp_size, num_blocks, instance = 0))]
    fn handle_handshake(
        &mut self,
        py: Python<'_>,
        now: f64,
        engine: &str,
        tp_size: u32,
        num_blocks: u32,
        instance: u64,
    ) -> PyResult<()> {
        let now = at(py, now)?;
        let engine = engine_id(py, engine)?;
        let info = RemoteEngine::new(tp_size, num_blocks).with_instance(instance);
        self.core.handle_handshake(now, &engine, Ok(info));
        Ok(())
    }

    /// The handshake with `engine` failed (`auth`: P refused our proof of the cluster
    /// token): every request waiting for it fails.
    #[pyo3(signature = (now, engine, message, *, auth = false))]
    fn handle_handshake_failed(
        &mut self,
        py: Python<'_>,
        now: f64,
        engine: &str,
        message: String,
        auth: bool,
    ) -> PyResult<()> {
        let now = at(py, now)?;
        let engine = engine_id(py, engine)?;
        let error = if auth {
            engine::HandshakeError::Auth(cause(message))
        } else {
            engine::HandshakeError::Other(cause(message))
        };
        self.core.handle_handshake(now, &engine, Err(error));
        Ok(())
    }

    /// The connection to `engine` is gone: forget it (requests waiting for it fail).
    fn forget_engine(&mut self, py: Python<'_>, engine: &str) -> PyResult<()> {
        let engine = engine_id(py, engine)?;
        self.core.forget_engine(&engine);
        Ok(())
    }

    /// A notification from P engine `engine` (expiry notices fail the waiting requests
    /// they name). Returns what it did, as `{"kind": ..., ...}`.
    fn handle_notif<'py>(
        &mut self,
        py: Python<'py>,
        engine: &str,
        message: &[u8],
    ) -> PyResult<Bound<'py, PyDict>> {
        let engine = engine_id(py, engine)?;
        let d = PyDict::new(py);
        match self.core.handle_notif(&engine, message) {
            DecodeNotif::Expired { leases, failed } => {
                d.set_item("kind", "expired")?;
                d.set_item("leases", leases)?;
                d.set_item("failed", failed)?;
            }
            DecodeNotif::Foreign => d.set_item("kind", "foreign")?,
            DecodeNotif::Malformed(e) => {
                d.set_item("kind", "malformed")?;
                d.set_item("error", crate::errors::chain(&e))?;
            }
            _ => d.set_item("kind", "ignored")?,
        }
        Ok(d)
    }

    /// Aborts a request, by D's id or P's id (P is told when it had not been read).
    /// Returns whether it was known.
    fn abort(&mut self, py: Python<'_>, request: &str) -> PyResult<bool> {
        let request = request_id(py, request)?;
        Ok(self.core.abort(&request))
    }

    /// Batch `batch` of `request`'s plan ended: `status` is `"done"` (with `bytes`),
    /// `"stale"` (the fence did not match) or `"failed"` (with `error`, a message).
    #[pyo3(signature = (request, batch, status, *, bytes = 0, error = None))]
    fn handle_batch_done(
        &mut self,
        py: Python<'_>,
        request: &str,
        batch: usize,
        status: &str,
        bytes: u64,
        error: Option<String>,
    ) -> PyResult<()> {
        let request = request_id(py, request)?;
        let result = match status {
            "done" => BatchResult::Done { bytes },
            "stale" => BatchResult::Stale,
            "failed" => BatchResult::Failed(cause(error.unwrap_or_else(|| "read failed".into()))),
            other => {
                return Err(invalid(
                    py,
                    format!("status must be 'done', 'stale' or 'failed', not {other:?}"),
                ));
            }
        };
        self.core.handle_batch_done(&request, batch, result);
        Ok(())
    }

    /// The verification after `Loaded`: `error` `None` starts decoding, a message ends
    /// the request failed.
    #[pyo3(signature = (request, error = None))]
    fn handle_verified(
        &mut self,
        py: Python<'_>,
        request: &str,
        error: Option<String>,
    ) -> PyResult<()> {
        let request = request_id(py, request)?;
        self.core
            .handle_verified(&request, error.map_or(Ok(()), |m| Err(cause(m))));
        Ok(())
    }

    /// The model finished decoding `request`: it ends `"done"`. Returns whether it was
    /// decoding.
    fn request_finished(&mut self, py: Python<'_>, request: &str) -> PyResult<bool> {
        let request = request_id(py, request)?;
        Ok(self.core.request_finished(&request))
    }

    /// Ends every request (`"shutdown"`).
    fn shutdown(&mut self) {
        self.core.shutdown();
    }

    /// The next notification for P (aborts first, then heartbeat batches due at `now`),
    /// or `None`.
    fn poll_transmit(&mut self, py: Python<'_>, now: f64) -> PyResult<Option<Transmit>> {
        let now = at(py, now)?;
        Ok(self.core.poll_transmit(now).map(|t| {
            let (kind, ids) = match t.kind {
                TransmitKind::Heartbeat { ids } => ("heartbeat", ids),
                _ => ("abort", 0),
            };
            Transmit {
                engine: t.engine.as_str().to_owned(),
                workers: t.workers,
                message: PyBytes::new(py, &t.bytes).unbind(),
                kind,
                ids,
            }
        }))
    }

    /// The next request to load, with its blocks allocated (pool cores), or `None`.
    fn poll_load(&mut self, py: Python<'_>) -> PyResult<Option<LoadPlan>> {
        self.core.poll_load().map(|p| load_plan(py, &p)).transpose()
    }

    /// The serving engine scheduled waiting `request` into `blocks` (`external_blocks`
    /// cores): plans its reads of P's blocks `skip_blocks..`. Raises `InvalidArgument`
    /// when the request is not waiting, its P engine is not handshaken, or the block
    /// count is wrong.
    #[pyo3(signature = (request, blocks, skip_blocks = 0))]
    fn start_load(
        &mut self,
        py: Python<'_>,
        request: &str,
        blocks: Vec<u32>,
        skip_blocks: usize,
    ) -> PyResult<LoadPlan> {
        let request = request_id(py, request)?;
        let plan = self
            .core
            .start_load(&request, block_ids(blocks), skip_blocks)
            .map_err(|e| raise_err(py, Family::InvalidArgument, &e))?;
        load_plan(py, &plan)
    }

    /// Blocks the first schedulable request needs beyond those free (pool cores).
    fn blocks_short(&self) -> Option<usize> {
        self.core.blocks_short()
    }

    /// When to call `poll_transmit` next (seconds on the core's clock), or `None`.
    fn poll_timeout(&self) -> Option<f64> {
        self.core.poll_timeout().map(secs)
    }

    /// The next event: `Loaded`, `HandshakeDone`, `Finished`, or `None`.
    fn poll_event(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(event) = self.core.poll_event() else {
            return Ok(None);
        };
        let obj = match event {
            DecodeEvent::Loaded {
                request,
                blocks,
                bytes,
            } => Py::new(
                py,
                Loaded {
                    request: request.as_str().to_owned(),
                    blocks: block_list(&blocks),
                    bytes,
                },
            )?
            .into_any(),
            DecodeEvent::HandshakeDone { engine } => Py::new(
                py,
                HandshakeDone {
                    engine: engine.as_str().to_owned(),
                },
            )?
            .into_any(),
            DecodeEvent::Finished { request, outcome } => {
                let (outcome, error, retryable) = match outcome {
                    Outcome::Done => ("done", None, false),
                    Outcome::Failed(e) => (
                        "failed",
                        Some(e.to_py(py).into_value(py).into_any()),
                        e.is_retryable(),
                    ),
                    Outcome::Aborted => ("aborted", None, false),
                    _ => ("shutdown", None, false),
                };
                Py::new(
                    py,
                    Finished {
                        request: request.as_str().to_owned(),
                        outcome,
                        error,
                        retryable,
                    },
                )?
                .into_any()
            }
        };
        Ok(Some(obj))
    }
}

// ---------------------------------------------------------------------- notifications

/// What a notification says: `{"kind": "heartbeat", "ids": [...]}`,
/// `{"kind": "read_complete", "request", "engine", "rank", "consumers_total"}`,
/// `{"kind": "abort", "request", "engine", "rank"}`, `{"kind": "expired", "leases":
/// [(request, generation), ...]}` or `{"kind": "app"}`. Raises `NotifError` for a
/// malformed one.
#[pyfunction]
pub(crate) fn decode_notif<'py>(py: Python<'py>, message: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    use kvlease_notif::Notif;
    let d = PyDict::new(py);
    match kvlease_notif::decode(message) {
        Ok(Notif::Heartbeat(ids)) => {
            d.set_item("kind", "heartbeat")?;
            d.set_item("ids", ids.iter().collect::<Vec<&str>>())?;
        }
        Ok(Notif::ReadComplete(rc)) => {
            d.set_item("kind", "read_complete")?;
            d.set_item("request", rc.request.as_str())?;
            d.set_item("engine", rc.consumer.engine.as_str())?;
            d.set_item("rank", rc.consumer.rank)?;
            d.set_item("consumers_total", rc.consumers_total)?;
        }
        Ok(Notif::Abort(a)) => {
            d.set_item("kind", "abort")?;
            d.set_item("request", a.request.as_str())?;
            d.set_item("engine", a.consumer.engine.as_str())?;
            d.set_item("rank", a.consumer.rank)?;
        }
        Ok(Notif::Expired(leases)) => {
            d.set_item("kind", "expired")?;
            let list: Vec<(String, u64)> = leases
                .iter()
                .map(|l| (l.request.as_str().to_owned(), l.generation.word()))
                .collect();
            d.set_item("leases", list)?;
        }
        Ok(_) => d.set_item("kind", "app")?,
        Err(e) => return Err(raise_err(py, Family::Notif, &e)),
    }
    Ok(d)
}

/// The heartbeat messages (`HB:` and ids joined by commas) naming `requests`, split to
/// fit `max_len` bytes each.
#[pyfunction]
#[pyo3(signature = (requests, max_len = kvlease_notif::MAX_NOTIF_LEN))]
pub(crate) fn encode_heartbeats<'py>(
    py: Python<'py>,
    requests: Vec<String>,
    max_len: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let ids = requests
        .iter()
        .map(|r| request_id(py, r))
        .collect::<PyResult<Vec<_>>>()?;
    let msgs = kvlease_notif::encode_heartbeats(&ids, max_len)
        .map_err(|e| raise_err(py, Family::Notif, &e))?;
    Ok(msgs.iter().map(|m| PyBytes::new(py, m)).collect())
}
