//! D's core for Python: [`DecodeCore`] and what it returns (load plans, transmits,
//! events, what a notification did).

use std::time::Duration;

use kvlease_engine as engine;
use kvlease_engine::{
    BatchResult, BlockSource, DecodeConfig, DecodeEvent, DecodeNotif, KvSplit, Outcome,
    RemoteEngine, TransmitKind,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{PyEnum, at, block_ids, block_list, cause, engine_id, lease_config, request_id, secs};
use crate::errors::{Family, ToPyErr, invalid, raise_err};

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
    /// A check of an engine already handshaken, as this instance, because a request named
    /// a newer one: fetch P's info, and keep the connections unless P's instance is newer
    /// than this one. `None`: a first handshake.
    check_instance: Option<u64>,
}

/// The core dropped a P engine no request named, to make room for another: close its
/// connections.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct EngineDropped {
    /// P's engine.
    engine: String,
}

/// A notification for P: send `message` to every worker (or the receiving endpoint) of
/// P engine `engine`. `kind` is a `TransmitKind`: `heartbeat` (naming `ids` requests) or
/// `abort`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Transmit {
    /// P's engine.
    engine: String,
    /// How many P workers to send it to.
    workers: u32,
    /// The encoded notification.
    message: Py<PyBytes>,
    /// What it is (a `TransmitKind`).
    kind: Py<PyAny>,
    /// Request ids named (heartbeats), else 0.
    ids: u32,
}

/// One read batch: from D worker `d_worker`, read P worker `p_rank`'s part of `heads`
/// (global head numbers, `(start, end)`) of the plan's blocks in every layer, fenced by
/// P's fence word; on success send `notif` to that P worker (one consumer of the lease,
/// which counts every batch of the plan). Within P's block the heads read are `heads`
/// minus `p_first_head`; within D's, minus `d_first_head`.
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
    /// The first global head of D worker `d_worker`.
    d_first_head: u32,
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
                    d_first_head: b.d_first_head,
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

/// A request ended: `outcome` is an `Outcome`: `done`, `failed` (then `error` is a
/// `LoadError`), `aborted` or `shutdown`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Finished {
    /// D's id.
    request: String,
    /// How it ended (an `Outcome`).
    outcome: Py<PyAny>,
    /// The load failure, for `"failed"`.
    error: Option<Py<PyAny>>,
    /// Whether prefilling it again may succeed.
    retryable: bool,
}

#[pymethods]
impl Finished {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Finished(request={:?}, outcome={:?})",
            self.request,
            self.outcome.bind(py).to_string()
        )
    }
}

/// What `DecodeCore.handle_notif` did with a notification: `kind` (a `NotifKind`:
/// `expired`, `foreign`, `malformed` or `ignored`) and the fields of that kind; the
/// others are `None`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct DecodeNotifOutcome {
    /// What the notification was (a `NotifKind`).
    kind: Py<PyAny>,
    /// `expired`: leases named.
    leases: Option<u32>,
    /// `expired`: waiting requests it failed.
    failed: Option<u32>,
    /// `malformed`: why.
    error: Option<String>,
}

#[pymethods]
impl DecodeNotifOutcome {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "DecodeNotifOutcome(kind={:?})",
            self.kind.bind(py).to_string()
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
    /// blocks and schedules loads (`start_load`). With `replicated_kv`, every worker (of D
    /// and of every P) holds the whole KV (MLA's latent cache, `num_kv_heads` 1): each D
    /// worker reads it once, from one P rank, whatever the two TP sizes.
    #[new]
    #[pyo3(signature = (engine_id, *, tp_size, num_kv_heads, block_size, num_blocks, lease_duration = 30.0, external_blocks = false, max_running = 64, max_waiting = 1024, retry = 0.005, replicated_kv = false))]
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
        replicated_kv: bool,
    ) -> PyResult<Self> {
        if tp_size == 0 || num_kv_heads == 0 || block_size == 0 || num_blocks == 0 {
            return Err(invalid(
                py,
                "tp_size, num_kv_heads, block_size and num_blocks must be positive",
            ));
        }
        if !replicated_kv && !num_kv_heads.is_multiple_of(tp_size) {
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
        })
        .with_kv_split(if replicated_kv {
            KvSplit::Replicated
        } else {
            KvSplit::Heads
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
        d.set_item("instance_checks", s.instance_checks)?;
        d.set_item("engines_evicted", s.engines_evicted)?;
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
            check_instance: h.check_instance,
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

    /// The handshake with `engine` failed with `error`, a `kvlease.HandshakeError` (its
    /// `kind` is the engine's kind of failure): every request waiting for it fails.
    fn handle_handshake_failed(
        &mut self,
        py: Python<'_>,
        now: f64,
        engine: &str,
        error: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let now = at(py, now)?;
        let engine = engine_id(py, engine)?;
        let error = crate::errors::handshake::from_py(error)?;
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
    /// they name). Returns what it did (a `DecodeNotifOutcome`).
    fn handle_notif(
        &mut self,
        py: Python<'_>,
        engine: &str,
        message: &[u8],
    ) -> PyResult<DecodeNotifOutcome> {
        let engine = engine_id(py, engine)?;
        let (kind, leases, failed, error) = match self.core.handle_notif(&engine, message) {
            DecodeNotif::Expired { leases, failed } => {
                ("expired", Some(leases), Some(failed), None)
            }
            DecodeNotif::Foreign => ("foreign", None, None, None),
            DecodeNotif::Malformed(e) => ("malformed", None, None, Some(crate::errors::chain(&e))),
            // Bidirectional mode's cached-turn notices: the connector caches no turns.
            DecodeNotif::CacheHeartbeat(_)
            | DecodeNotif::CacheReadComplete(_)
            | DecodeNotif::Ignored => ("ignored", None, None, None),
        };
        Ok(DecodeNotifOutcome {
            kind: PyEnum::NotifKind.member(py, kind)?,
            leases,
            failed,
            error,
        })
    }

    /// Aborts a request, by D's id or P's id (P is told when it had not been read).
    /// Returns whether it was known.
    fn abort(&mut self, py: Python<'_>, request: &str) -> PyResult<bool> {
        let request = request_id(py, request)?;
        Ok(self.core.abort(&request))
    }

    /// Batch `batch` of `request`'s plan ended: `status` is a `BatchStatus` (or its
    /// value): `done` (with `bytes`), `stale` (the fence did not match) or `failed` (with
    /// `error`, a message).
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
        let Some(t) = self.core.poll_transmit(now) else {
            return Ok(None);
        };
        let (kind, ids) = match t.kind {
            TransmitKind::Heartbeat { ids } => ("heartbeat", ids),
            TransmitKind::Abort => ("abort", 0),
        };
        Ok(Some(Transmit {
            engine: t.engine.as_str().to_owned(),
            workers: t.workers,
            message: PyBytes::new(py, &t.bytes).unbind(),
            kind: PyEnum::TransmitKind.member(py, kind)?,
            ids,
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

    /// The next event: `Loaded`, `HandshakeDone`, `EngineDropped`, `Finished`, or `None`.
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
            DecodeEvent::EngineDropped { engine } => Py::new(
                py,
                EngineDropped {
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
                    Outcome::Shutdown => ("shutdown", None, false),
                };
                Py::new(
                    py,
                    Finished {
                        request: request.as_str().to_owned(),
                        outcome: PyEnum::Outcome.member(py, outcome)?,
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
