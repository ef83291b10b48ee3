//! P's core for Python: [`PrefillCore`] and what it returns (grants, releases, actions,
//! events, what a notification did).

use std::time::Duration;

use kvlease_engine as engine;
use kvlease_engine::{BlockSource, PrefillAction, PrefillConfig, PrefillEvent, PrefillNotif};
use kvlease_lease::{Generation, LeaseMode, ReadCompleteOutcome, ReleaseReason};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{PyEnum, at, block_ids, block_list, engine_id, lease_config, request_id, secs};
use crate::errors::{ToPyErr, invalid};

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

/// A lease that ended (`reason`: a `ReleaseReason`, `completed`, `expired` or `aborted`).
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Released {
    /// The request.
    request: String,
    /// Its blocks.
    blocks: Vec<u32>,
    /// The lease's generation.
    generation: u64,
    /// Why it ended (a `ReleaseReason`).
    reason: Py<PyAny>,
    /// When it was granted (the core's clock, seconds).
    granted_at: f64,
    /// Its expiry when it ended.
    expiry: f64,
    /// It expired at its maximum lifetime although heartbeats had renewed it past that.
    at_max_lifetime: bool,
    /// It was a hold on a finished turn (`hold_in`), not a lease.
    hold: bool,
    /// When the last heartbeat naming it arrived, if any did.
    last_heartbeat: Option<f64>,
    /// When it was released.
    released_at: f64,
}

impl Released {
    fn new(py: Python<'_>, r: &kvlease_lease::Released, hold: bool) -> PyResult<Self> {
        let reason = match r.reason {
            ReleaseReason::Completed => "completed",
            ReleaseReason::Expired => "expired",
            ReleaseReason::Aborted => "aborted",
        };
        Ok(Self {
            request: r.request.as_str().to_owned(),
            blocks: block_list(&r.blocks),
            generation: r.generation.word(),
            reason: PyEnum::ReleaseReason.member(py, reason)?,
            granted_at: secs(r.granted_at),
            expiry: secs(r.expiry),
            at_max_lifetime: r.at_max_lifetime,
            hold,
            last_heartbeat: r.last_heartbeat.map(secs),
            released_at: secs(r.released_at),
        })
    }
}

#[pymethods]
impl Released {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Released(request={:?}, reason={:?}, blocks={})",
            self.request,
            self.reason.bind(py).to_string(),
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
    /// (heartbeats every sixth, each extending by two thirds) and at most
    /// `max_lease_lifetime` seconds from their grant whatever the heartbeats say (default
    /// 600, or `lease_duration` when longer). With `external_blocks`, the serving engine
    /// allocates blocks (`handle_prefill_done_in`). With `hold_duration` (bidirectional
    /// mode) it also holds finished turns (`hold_in`) that long, renewed by their
    /// reader's heartbeats as a lease is (`hold_renewable`, default) or not at all.
    #[new]
    #[pyo3(signature = (engine_id, *, tp_size, num_blocks, block_size, lease_duration = 30.0, external_blocks = false, pool_wait = 0.0, first_generation = None, max_consumers = None, max_lease_lifetime = None, hold_duration = None, hold_renewable = true))]
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
        max_lease_lifetime: Option<f64>,
        hold_duration: Option<f64>,
        hold_renewable: bool,
    ) -> PyResult<Self> {
        if tp_size == 0 || num_blocks == 0 || block_size == 0 {
            return Err(invalid(
                py,
                "tp_size, num_blocks and block_size must be positive",
            ));
        }
        let mut lease = lease_config(py, lease_duration)?;
        if let Some(max) = max_lease_lifetime {
            lease = lease
                .with_max_lifetime_secs_f64(max)
                .map_err(|e| e.to_py(py))?;
        }
        let mut config = PrefillConfig::new(
            self::engine_id(py, engine_id)?,
            tp_size,
            num_blocks,
            block_size,
            lease,
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
        if let Some(ttl) = hold_duration {
            let mut terms = lease_config(py, ttl)?;
            if !hold_renewable {
                terms = terms.with_mode(LeaseMode::Fixed);
            }
            config = config.with_holds(terms);
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
        lease_dict(py, &info).map(Some)
    }

    /// `request`'s hold on a finished turn (`hold_in`), as `lease` describes a lease, or
    /// `None`.
    fn hold<'py>(&self, py: Python<'py>, request: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        let request = request_id(py, request)?;
        let Some(info) = self.core.holds().and_then(|h| h.get(&request)) else {
            return Ok(None);
        };
        lease_dict(py, &info).map(Some)
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
        d.set_item("holds_granted", s.holds_granted)?;
        d.set_item("holds_released_completed", s.holds_released_completed)?;
        d.set_item("holds_released_expired", s.holds_released_expired)?;
        d.set_item("holds_released_aborted", s.holds_released_aborted)?;
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

    /// Bidirectional mode: the serving engine finished decoding `request` in `blocks`
    /// and keeps them for the conversation's next turn: holds them (`hold_duration`),
    /// renewed by the reader's heartbeats, released by its read completion or abort, or
    /// at the end. Raises `PrefillError` without holds, or as `handle_prefill_done_in`.
    fn hold_in(
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
            .hold_in(now, request, block_ids(blocks))
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
    /// what it did (a `PrefillNotifOutcome`). Malformed input changes nothing.
    fn handle_notif(
        &mut self,
        py: Python<'_>,
        now: f64,
        sender_engine: &str,
        sender: String,
        message: &[u8],
    ) -> PyResult<PrefillNotifOutcome> {
        let now = at(py, now)?;
        let from = engine::Peer {
            engine: engine_id(py, sender_engine)?,
            addr: sender,
        };
        PrefillNotifOutcome::new(py, self.core.handle_notif(now, &from, message))
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
                    released: Py::new(
                        py,
                        Released::new(py, &released, self.core.is_hold(released.generation))?,
                    )?,
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
            PrefillEvent::Released(r) => Py::new(py, Released::new(py, &r, false)?)?.into_any(),
            PrefillEvent::HoldReleased(r) => Py::new(py, Released::new(py, &r, true)?)?.into_any(),
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

fn lease_dict<'py>(
    py: Python<'py>,
    info: &kvlease_lease::LeaseInfo,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("generation", info.generation.word())?;
    d.set_item("granted_at", secs(info.granted_at))?;
    d.set_item("expiry", secs(info.expiry))?;
    d.set_item("last_heartbeat", info.last_heartbeat.map(secs))?;
    d.set_item("blocks", info.blocks)?;
    d.set_item("consumers_reported", info.consumers_reported)?;
    d.set_item("consumers_expected", info.consumers_expected)?;
    Ok(d)
}

fn granted(g: &engine::Granted) -> Granted {
    Granted {
        request: g.request.as_str().to_owned(),
        blocks: block_list(&g.blocks),
        generation: g.generation.word(),
        superseded: g.superseded,
    }
}

/// What `PrefillCore.handle_notif` did with a notification: `kind` (a `NotifKind`:
/// `heartbeat`, `read_complete`, `abort`, `foreign`, `malformed` or `ignored`) and the
/// fields of that kind; the others are `None`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PrefillNotifOutcome {
    /// What the notification was (a `NotifKind`).
    kind: Py<PyAny>,
    /// `heartbeat`: ids the message named.
    ids: Option<u32>,
    /// `heartbeat`: ids that named a live lease; `abort`: 1 when it released a lease,
    /// else 0.
    held: Option<u32>,
    /// `heartbeat`: of those, how many moved the expiry later.
    extended: Option<u32>,
    /// `heartbeat`: ids that named no lease.
    unknown: Option<u32>,
    /// `heartbeat`: ids of leases past their expiry, not reaped yet.
    late: Option<u32>,
    /// `heartbeat`: ids of leases another D engine owns (ignored).
    foreign: Option<u32>,
    /// `read_complete`, `abort`, `foreign`: the request named.
    request: Option<String>,
    /// `read_complete`: what the table did (a `ReadCompleteOutcome`).
    outcome: Option<Py<PyAny>>,
    /// `read_complete`: readers still to report, when the lease is known.
    remaining: Option<u32>,
    /// `malformed`: why.
    error: Option<String>,
}

impl PrefillNotifOutcome {
    /// An outcome of `kind` with no fields set.
    fn of(py: Python<'_>, kind: &str) -> PyResult<Self> {
        Ok(Self {
            kind: PyEnum::NotifKind.member(py, kind)?,
            ids: None,
            held: None,
            extended: None,
            unknown: None,
            late: None,
            foreign: None,
            request: None,
            outcome: None,
            remaining: None,
            error: None,
        })
    }

    fn new(py: Python<'_>, notif: PrefillNotif) -> PyResult<Self> {
        Ok(match notif {
            PrefillNotif::Heartbeat {
                ids,
                outcome,
                foreign,
            } => Self {
                ids: Some(ids),
                held: Some(outcome.held),
                extended: Some(outcome.extended),
                unknown: Some(outcome.unknown),
                late: Some(outcome.late),
                foreign: Some(foreign),
                ..Self::of(py, "heartbeat")?
            },
            PrefillNotif::ReadComplete { request, outcome } => {
                let (what, remaining) = match outcome {
                    ReadCompleteOutcome::Released => ("released", Some(0)),
                    ReadCompleteOutcome::Waiting { remaining } => ("waiting", Some(remaining)),
                    ReadCompleteOutcome::Duplicate { remaining } => ("duplicate", Some(remaining)),
                    ReadCompleteOutcome::Unknown => ("unknown", None),
                    ReadCompleteOutcome::InvalidTotal => ("invalid_total", None),
                };
                Self {
                    request: Some(request.as_str().to_owned()),
                    outcome: Some(PyEnum::ReadCompleteOutcome.member(py, what)?),
                    remaining,
                    ..Self::of(py, "read_complete")?
                }
            }
            PrefillNotif::Abort { request, held } => Self {
                request: Some(request.as_str().to_owned()),
                held: Some(u32::from(held)),
                ..Self::of(py, "abort")?
            },
            PrefillNotif::Foreign { request } => Self {
                request: Some(request.as_str().to_owned()),
                ..Self::of(py, "foreign")?
            },
            PrefillNotif::Malformed(e) => Self {
                error: Some(crate::errors::chain(&e)),
                ..Self::of(py, "malformed")?
            },
            PrefillNotif::Ignored => Self::of(py, "ignored")?,
        })
    }
}

#[pymethods]
impl PrefillNotifOutcome {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PrefillNotifOutcome(kind={:?}, request={:?})",
            self.kind.bind(py).to_string(),
            self.request
        )
    }
}
