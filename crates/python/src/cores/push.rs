//! Push mode's cores for Python: D's [`Reservations`] and P's [`PushCore`], and what they
//! return (reservations, ended reservations, writes to post, messages to send, ended
//! pushes). The vLLM connector's push mode (`kvlease.vllm.push`) drives them.

use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_engine as engine;
use kvlease_engine::{FenceVerdict, PushAction, PushConfig, PushError, PushMessage};
use kvlease_lease::{Generation, GrantError, LeaseConfig};
use kvlease_notif::PromptDigest;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvlease_lease::Timestamp;

use super::{PyEnum, at, block_ids, block_list, engine_id, lease_config, request_id, secs};
use crate::errors::{Family, ToPyErr, bool_obj, chain, invalid, raise_with};

/// A generation from Python: a positive 64-bit word.
fn generation(py: Python<'_>, word: u64) -> PyResult<Generation> {
    NonZeroU64::new(word)
        .map(Generation)
        .ok_or_else(|| invalid(py, "a generation is a positive integer, not 0"))
}

/// A prompt digest from Python: `None`, or exactly 32 lowercase hex digits.
fn prompt_digest(py: Python<'_>, prompt: Option<&str>) -> PyResult<Option<PromptDigest>> {
    prompt
        .map(|text| {
            PromptDigest::parse(text)
                .map_err(|e| invalid(py, format!("prompt digest {text:?}: {}", chain(&e))))
        })
        .transpose()
}

fn seconds(py: Python<'_>, what: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        invalid(
            py,
            format!("{what} must be a finite number of seconds >= 0, not {secs}"),
        )
    })
}

/// The longest `registration_wait` / `remember_ended` a `PushCore` takes: a year.
const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

fn lease_terms(py: Python<'_>, duration: f64, max_lifetime: Option<f64>) -> PyResult<LeaseConfig> {
    let lease = lease_config(py, duration)?;
    match max_lifetime {
        Some(max) => lease
            .with_max_lifetime_secs_f64(max)
            .map_err(|e| e.to_py(py)),
        None => Ok(lease),
    }
}

fn verdict(py: Python<'_>, v: FenceVerdict) -> PyResult<Py<PyAny>> {
    let name = match v {
        FenceVerdict::Accepted => "accepted",
        FenceVerdict::Stale => "stale",
        FenceVerdict::Unknown => "unknown",
        FenceVerdict::Foreign => "foreign",
    };
    PyEnum::FenceVerdict.member(py, name)
}

/// A refused reservation: `AdmitError` (`retryable` when the table is full).
fn grant_error(py: Python<'_>, e: &GrantError) -> PyErr {
    let retryable = matches!(e, GrantError::TableFull { .. });
    raise_with(
        py,
        Family::Admit,
        chain(e),
        &[("field", py.None()), ("retryable", bool_obj(py, retryable))],
    )
}

/// A refused push command: `PrefillError` (never retryable: nothing changed, and the same
/// command stays refused).
fn push_error(py: Python<'_>, e: &PushError) -> PyErr {
    raise_with(
        py,
        Family::Prefill,
        chain(e),
        &[("retryable", bool_obj(py, false))],
    )
}

/// What D registers with P for one transfer (from `Reservations.reserve`): publish
/// `generation` in the write-fence word (`Agent.set_write_fence`), then send it to P.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct Reservation {
    /// The transfer id both legs carry.
    transfer: String,
    /// D's blocks P writes into, in token order (the last blocks of the prompt).
    blocks: Vec<u32>,
    /// The reservation's fencing generation.
    generation: u64,
    /// The reservation's lease duration, seconds.
    lease: f64,
    /// The digest of D's prompt it carries (32 lowercase hex digits), or `None`.
    prompt: Option<String>,
}

#[pymethods]
impl Reservation {
    fn __repr__(&self) -> String {
        format!(
            "Reservation(transfer={:?}, generation={}, blocks={})",
            self.transfer,
            self.generation,
            self.blocks.len()
        )
    }
}

/// A reservation ended on D (`outcome`: a `ReservationOutcome`): clear its write fence
/// (`Agent.set_write_fence(..., 0)`) before its blocks go to another request.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct ReservationEnded {
    /// The transfer.
    transfer: String,
    /// The P engine it was registered with.
    prefill: String,
    /// D's blocks it held.
    blocks: Vec<u32>,
    /// Its generation.
    generation: u64,
    /// How it ended (a `ReservationOutcome`).
    outcome: Py<PyAny>,
    /// When (the core's clock, seconds).
    at: f64,
    /// Whether D tells P (`KVL1:RR:`): aborted or expired.
    tells_prefill: bool,
    /// Whether D must recompute the prompt (or fail the request): every outcome but
    /// written.
    needs_recompute: bool,
}

#[pymethods]
impl ReservationEnded {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ReservationEnded(transfer={:?}, outcome={:?}, generation={})",
            self.transfer,
            self.outcome.bind(py).to_string(),
            self.generation
        )
    }
}

/// D's reservations in push mode: the `kvlease-engine` table of reserved blocks, their
/// leases (renewed by P's reservation heartbeats) and the write fence.
///
/// Per input: `reserve` on admitting a pushed request, `handle_heartbeat` /
/// `handle_write_done` / `handle_push_failed` for P's messages, `abort` when the request
/// ends on D, `handle_timeout` when `poll_timeout` says; then `poll_event` until `None`.
/// Time is `now`, seconds on one monotonic clock.
#[pyclass(module = "kvlease._kvlease")]
pub(crate) struct Reservations {
    core: engine::Reservations,
}

#[pymethods]
impl Reservations {
    /// An empty table: reservations last `lease_duration` seconds (heartbeats every
    /// sixth, each extending by two thirds) and at most `max_lease_lifetime` seconds.
    /// Generations count up from `first_generation` (a restarted D starts above every
    /// generation it handed out before).
    #[new]
    #[pyo3(signature = (*, lease_duration = 30.0, max_lease_lifetime = None, first_generation = 1))]
    fn new(
        py: Python<'_>,
        lease_duration: f64,
        max_lease_lifetime: Option<f64>,
        first_generation: u64,
    ) -> PyResult<Self> {
        let lease = lease_terms(py, lease_duration, max_lease_lifetime)?;
        let first = NonZeroU64::new(first_generation)
            .ok_or_else(|| invalid(py, "first_generation must be positive"))?;
        Ok(Self {
            core: engine::Reservations::new(lease, Generation(first)),
        })
    }

    /// The reservations' lease duration, seconds.
    #[getter]
    fn lease_duration(&self) -> f64 {
        self.core.config().duration().as_secs_f64()
    }

    /// Reservations held.
    fn __len__(&self) -> usize {
        self.core.len()
    }

    /// Blocks held by all reservations.
    #[getter]
    fn blocks_held(&self) -> usize {
        self.core.blocks_held()
    }

    /// `(generation, blocks)` of `transfer`'s reservation, or `None`.
    fn get(&self, py: Python<'_>, transfer: &str) -> PyResult<Option<(u64, Vec<u32>)>> {
        let transfer = request_id(py, transfer)?;
        Ok(self
            .core
            .get(&transfer)
            .map(|(g, blocks)| (g.word(), block_list(blocks))))
    }

    /// The expiry of `transfer`'s reservation (seconds), or `None`.
    fn expiry(&self, py: Python<'_>, transfer: &str) -> PyResult<Option<f64>> {
        let transfer = request_id(py, transfer)?;
        Ok(self.core.expiry(&transfer).map(secs))
    }

    /// Reserves `blocks` (D's blocks for the tokens it must receive, in token order) for
    /// `transfer`, to be written by P engine `prefill`; `prompt` (32 lowercase hex
    /// digits, or `None`) is a digest of D's prompt that the registration carries for P
    /// to check against its leg's. Raises `AdmitError` when the transfer holds a
    /// reservation already or the table is full (`retryable`), `InvalidArgument` for a
    /// malformed digest.
    #[pyo3(signature = (now, transfer, prefill, blocks, prompt = None))]
    fn reserve(
        &mut self,
        py: Python<'_>,
        now: f64,
        transfer: &str,
        prefill: &str,
        blocks: Vec<u32>,
        prompt: Option<&str>,
    ) -> PyResult<Reservation> {
        let now = at(py, now)?;
        let transfer = request_id(py, transfer)?;
        let prefill = engine_id(py, prefill)?;
        let prompt = prompt_digest(py, prompt)?;
        let r = self
            .core
            .reserve(now, transfer, prefill, block_ids(blocks), prompt)
            .map_err(|e| grant_error(py, &e))?;
        Ok(Reservation {
            transfer: r.transfer.as_str().to_owned(),
            blocks: block_list(&r.blocks),
            generation: r.generation.word(),
            lease: r.lease.as_secs_f64(),
            prompt: r.prompt.map(|p| p.to_string()),
        })
    }

    /// P engine `prefill`'s reservation heartbeat naming `transfers`: `{"held",
    /// "extended", "unknown", "late"}` (ids registered with another P count as unknown).
    fn handle_heartbeat<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
        prefill: &str,
        transfers: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = at(py, now)?;
        let prefill = engine_id(py, prefill)?;
        let out = self.core.handle_heartbeat(now, &prefill, transfers);
        let d = PyDict::new(py);
        d.set_item("held", out.held)?;
        d.set_item("extended", out.extended)?;
        d.set_item("unknown", out.unknown)?;
        d.set_item("late", out.late)?;
        Ok(d)
    }

    /// Whether a write (or message) of `generation` for `transfer` from P engine
    /// `prefill` may land now (a `FenceVerdict`).
    fn admits_write(
        &self,
        py: Python<'_>,
        prefill: &str,
        transfer: &str,
        generation: u64,
    ) -> PyResult<Py<PyAny>> {
        let prefill = engine_id(py, prefill)?;
        let transfer = request_id(py, transfer)?;
        let g = self::generation(py, generation)?;
        verdict(py, self.core.admits_write(&prefill, &transfer, g))
    }

    /// P's write-done for `transfer` under `generation`: the reservation ends `written`
    /// when the fence admits it (`accepted`); any other `FenceVerdict` changed nothing.
    fn handle_write_done(
        &mut self,
        py: Python<'_>,
        now: f64,
        prefill: &str,
        transfer: &str,
        generation: u64,
    ) -> PyResult<Py<PyAny>> {
        let now = at(py, now)?;
        let prefill = engine_id(py, prefill)?;
        let transfer = request_id(py, transfer)?;
        let g = self::generation(py, generation)?;
        verdict(py, self.core.handle_write_done(now, &prefill, &transfer, g))
    }

    /// P's push-failed for `transfer` under `generation`: the reservation ends `failed`
    /// when the fence admits it (`accepted`); any other `FenceVerdict` changed nothing.
    fn handle_push_failed(
        &mut self,
        py: Python<'_>,
        now: f64,
        prefill: &str,
        transfer: &str,
        generation: u64,
    ) -> PyResult<Py<PyAny>> {
        let now = at(py, now)?;
        let prefill = engine_id(py, prefill)?;
        let transfer = request_id(py, transfer)?;
        let g = self::generation(py, generation)?;
        verdict(
            py,
            self.core.handle_push_failed(now, &prefill, &transfer, g),
        )
    }

    /// The request of `transfer` ended on D: its reservation ends `aborted`. Returns
    /// whether one was held.
    fn abort(&mut self, py: Python<'_>, now: f64, transfer: &str) -> PyResult<bool> {
        let now = at(py, now)?;
        let transfer = request_id(py, transfer)?;
        Ok(self.core.abort(now, &transfer))
    }

    /// The reaper: ends every reservation past its expiry (`expired`). Returns how many.
    fn handle_timeout(&mut self, py: Python<'_>, now: f64) -> PyResult<usize> {
        let now = at(py, now)?;
        Ok(self.core.handle_timeout(now))
    }

    /// When `handle_timeout` should next be called (seconds), or `None`.
    fn poll_timeout(&self) -> Option<f64> {
        self.core.poll_timeout().map(secs)
    }

    /// The next ended reservation, or `None`.
    fn poll_event(&mut self, py: Python<'_>) -> PyResult<Option<ReservationEnded>> {
        let Some(e) = self.core.poll_event() else {
            return Ok(None);
        };
        let outcome = e.outcome.as_str();
        Ok(Some(ReservationEnded {
            transfer: e.transfer.as_str().to_owned(),
            prefill: e.prefill.as_str().to_owned(),
            blocks: block_list(&e.blocks),
            generation: e.generation.word(),
            outcome: PyEnum::ReservationOutcome.member(py, outcome)?,
            at: secs(e.at),
            tells_prefill: e.tells_prefill(),
            needs_recompute: e.needs_recompute(),
        }))
    }

    /// The counters, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("reserved", s.reserved)?;
        d.set_item("written", s.written)?;
        d.set_item("aborted", s.aborted)?;
        d.set_item("expired", s.expired)?;
        d.set_item("failed", s.failed)?;
        d.set_item("renewed_ids", s.renewed_ids)?;
        d.set_item("unknown_ids", s.unknown_ids)?;
        d.set_item("foreign_ids", s.foreign_ids)?;
        d.set_item("refused", s.refused)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("Reservations(held={})", self.core.len())
    }
}

/// Post this write (`PushCore.poll_action`): P's blocks into D's, one `(P block, D
/// block)` pair each, fenced with `generation`; report its result with
/// `handle_write_result`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PushWrite {
    /// The transfer.
    transfer: String,
    /// The D engine to write into.
    decode: String,
    /// D's reservation generation (the write's fence).
    generation: u64,
    /// `(P's block, D's block)` pairs in token order.
    pairs: Vec<(u32, u32)>,
}

#[pymethods]
impl PushWrite {
    fn __repr__(&self) -> String {
        format!(
            "PushWrite(transfer={:?}, decode={:?}, generation={}, pairs={})",
            self.transfer,
            self.decode,
            self.generation,
            self.pairs.len()
        )
    }
}

/// Send a message to D engine `to` (`PushCore.poll_action`): `kind` is `"write_done"` or
/// `"push_failed"`, for `transfer` under `generation`.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PushSend {
    /// The D engine.
    to: String,
    /// `"write_done"` or `"push_failed"`.
    kind: &'static str,
    /// The transfer.
    transfer: String,
    /// The reservation's generation.
    generation: u64,
}

#[pymethods]
impl PushSend {
    fn __repr__(&self) -> String {
        format!(
            "PushSend(to={:?}, kind={:?}, transfer={:?}, generation={})",
            self.to, self.kind, self.transfer, self.generation
        )
    }
}

/// A push ended on P (`PushCore.poll_action`; `outcome`: a `PushOutcome`): free its
/// blocks.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct PushEnded {
    /// The transfer.
    transfer: String,
    /// P's own id of the request.
    request: String,
    /// The D engine that registered, if one did.
    decode: Option<String>,
    /// P's blocks of the request (empty when its prefill never finished).
    blocks: Vec<u32>,
    /// How it ended (a `PushOutcome`).
    outcome: Py<PyAny>,
}

#[pymethods]
impl PushEnded {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PushEnded(transfer={:?}, outcome={:?})",
            self.transfer,
            self.outcome.bind(py).to_string()
        )
    }
}

/// P's side of push mode: the `kvlease-engine` core that decides when P writes, which
/// registrations it heartbeats, and who is told.
///
/// Per input: `admit` P's leg, `handle_registration` for D's registration,
/// `handle_prefill_done`, `handle_write_result` once a posted write ended,
/// `handle_reservation_released` for D's release, `retire` when the request ends on P,
/// `handle_timeout` when `poll_timeout` says; then `poll_heartbeat(now)` until `None`
/// (send each) and `poll_action` until `None`. Time is `now`, seconds on one monotonic
/// clock. Refused commands raise `PrefillError`; nothing changed then.
#[pyclass(module = "kvlease._kvlease")]
pub(crate) struct PushCore {
    core: engine::PushCore,
    /// The longest span the core adds to `now`: every `now` must leave room for it.
    horizon: Duration,
}

impl PushCore {
    /// `now` (seconds) as the core's timestamp, refused when the core's deadlines from it
    /// would not fit the clock.
    fn now(&self, py: Python<'_>, now: f64) -> PyResult<Timestamp> {
        let t = at(py, now)?;
        t.checked_add(self.horizon)
            .map(|_| t)
            .ok_or_else(|| invalid(py, format!("now of {now} s is too far in the future")))
    }
}

#[pymethods]
impl PushCore {
    /// A core heartbeating every sixth of `lease_duration` seconds. A registration waits
    /// `registration_wait` seconds for P's leg (and a prefilled push for its
    /// registration), default one duration; ended transfer ids are remembered
    /// `remember_ended` seconds, default two durations.
    #[new]
    #[pyo3(signature = (*, lease_duration = 30.0, registration_wait = None, remember_ended = None))]
    fn new(
        py: Python<'_>,
        lease_duration: f64,
        registration_wait: Option<f64>,
        remember_ended: Option<f64>,
    ) -> PyResult<Self> {
        let mut config = PushConfig::new(lease_config(py, lease_duration)?);
        if let Some(w) = registration_wait {
            config.registration_wait = seconds(py, "registration_wait", w)?;
        }
        if let Some(r) = remember_ended {
            config.remember_ended = seconds(py, "remember_ended", r)?;
        }
        if config.registration_wait > MAX_WAIT || config.remember_ended > MAX_WAIT {
            return Err(invalid(
                py,
                "registration_wait and remember_ended must be at most a year",
            ));
        }
        let horizon = config
            .registration_wait
            .max(config.remember_ended)
            .max(config.lease.duration());
        Ok(Self {
            core: engine::PushCore::new(config),
            horizon,
        })
    }

    /// The heartbeat interval (duration / 6), seconds.
    #[getter]
    fn heartbeat_interval(&self) -> f64 {
        self.core.config().lease.interval().as_secs_f64()
    }

    /// Admitted pushes not yet ended.
    #[getter]
    fn pushing(&self) -> usize {
        self.core.pushing()
    }

    /// Whether nothing is pushing, waiting, heartbeated or queued.
    fn is_idle(&self) -> bool {
        self.core.is_idle()
    }

    /// Whether `transfer` has a write in flight.
    fn is_writing(&self, py: Python<'_>, transfer: &str) -> PyResult<bool> {
        let transfer = request_id(py, transfer)?;
        Ok(self.core.is_writing(&transfer))
    }

    /// Admits P's leg of `transfer` (P's own id `request`), with `prompt` (32 lowercase
    /// hex digits, or `None`), a digest of P's prompt: a registration carrying another
    /// digest is refused (push-failed to its D), whether it came before or after.
    /// Raises `PrefillError` when refused, `InvalidArgument` for a malformed digest.
    #[pyo3(signature = (now, transfer, request, prompt = None))]
    fn admit(
        &mut self,
        py: Python<'_>,
        now: f64,
        transfer: &str,
        request: &str,
        prompt: Option<&str>,
    ) -> PyResult<()> {
        let now = self.now(py, now)?;
        let transfer = request_id(py, transfer)?;
        let request = request_id(py, request)?;
        let prompt = prompt_digest(py, prompt)?;
        self.core
            .admit(now, transfer, request, prompt)
            .map_err(|e| push_error(py, &e))
    }

    /// D engine `decode` registered its reservation of `transfer`: `generation`, its
    /// lease (`lease` seconds), D's `blocks` in token order and the digest of D's prompt
    /// (`prompt`: 32 lowercase hex digits, or `None`). Returns a `RegistrationOutcome`
    /// (`prompt_mismatch` when P's leg carries another digest: P answered push-failed).
    #[allow(
        clippy::too_many_arguments,
        reason = "a registration's fields as Python arguments"
    )]
    #[pyo3(signature = (now, decode, transfer, generation, lease, blocks, prompt = None))]
    fn handle_registration(
        &mut self,
        py: Python<'_>,
        now: f64,
        decode: &str,
        transfer: &str,
        generation: u64,
        lease: f64,
        blocks: Vec<u32>,
        prompt: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let now = self.now(py, now)?;
        let decode = engine_id(py, decode)?;
        let reservation = engine::Reservation {
            transfer: request_id(py, transfer)?,
            blocks: block_ids(blocks),
            generation: self::generation(py, generation)?,
            lease: seconds(py, "lease", lease)?,
            prompt: prompt_digest(py, prompt)?,
        };
        let outcome = self.core.handle_registration(now, &decode, reservation);
        PyEnum::RegistrationOutcome.member(py, outcome.as_str())
    }

    /// P's prefill of `transfer` ended; `blocks` hold the whole prompt's KV in token
    /// order. Raises `PrefillError` when the transfer is not being pushed (free `blocks`
    /// yourself) or was reported done already.
    fn handle_prefill_done(
        &mut self,
        py: Python<'_>,
        now: f64,
        transfer: &str,
        blocks: Vec<u32>,
    ) -> PyResult<()> {
        let now = self.now(py, now)?;
        let transfer = request_id(py, transfer)?;
        self.core
            .handle_prefill_done(now, &transfer, block_ids(blocks))
            .map_err(|e| push_error(py, &e))
    }

    /// The write of `transfer` under `generation` ended (`ok`: every byte landed).
    /// Returns whether it named the write in flight.
    fn handle_write_result(
        &mut self,
        py: Python<'_>,
        now: f64,
        transfer: &str,
        generation: u64,
        ok: bool,
    ) -> PyResult<bool> {
        let now = self.now(py, now)?;
        let transfer = request_id(py, transfer)?;
        let g = self::generation(py, generation)?;
        Ok(self.core.handle_write_result(now, &transfer, g, ok))
    }

    /// D engine `decode` released its reservation of `transfer` under `generation`.
    /// Returns whether it named the registration P holds.
    fn handle_reservation_released(
        &mut self,
        py: Python<'_>,
        now: f64,
        decode: &str,
        transfer: &str,
        generation: u64,
    ) -> PyResult<bool> {
        let now = self.now(py, now)?;
        let decode = engine_id(py, decode)?;
        let transfer = request_id(py, transfer)?;
        let g = self::generation(py, generation)?;
        Ok(self
            .core
            .handle_reservation_released(now, &decode, &transfer, g))
    }

    /// The request of `transfer` retired on P. Returns whether it was pushing.
    fn retire(&mut self, py: Python<'_>, now: f64, transfer: &str) -> PyResult<bool> {
        let now = self.now(py, now)?;
        let transfer = request_id(py, transfer)?;
        Ok(self.core.retire(now, &transfer))
    }

    /// Ends what waited too long and forgets old ended transfers.
    fn handle_timeout(&mut self, py: Python<'_>, now: f64) -> PyResult<()> {
        let now = self.now(py, now)?;
        self.core.handle_timeout(now);
        Ok(())
    }

    /// When `handle_timeout` or `poll_heartbeat` should next be called (seconds), or
    /// `None`.
    fn poll_timeout(&self) -> Option<f64> {
        self.core.poll_timeout().map(secs)
    }

    /// The next reservation heartbeat due at `now`: `(decode engine, [transfer, ...])`,
    /// or `None`. Call until `None`.
    fn poll_heartbeat(
        &mut self,
        py: Python<'_>,
        now: f64,
    ) -> PyResult<Option<(String, Vec<String>)>> {
        let now = self.now(py, now)?;
        Ok(self.core.poll_heartbeat(now).map(|b| {
            (
                b.engine.as_str().to_owned(),
                b.requests.iter().map(|r| r.as_str().to_owned()).collect(),
            )
        }))
    }

    /// The next thing to do, in order — a `PushWrite`, `PushSend` or `PushEnded` — or
    /// `None`.
    fn poll_action(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(action) = self.core.poll_action() else {
            return Ok(None);
        };
        let obj = match action {
            PushAction::Write(w) => Py::new(
                py,
                PushWrite {
                    transfer: w.transfer.as_str().to_owned(),
                    decode: w.decode.as_str().to_owned(),
                    generation: w.generation.word(),
                    pairs: w.pairs.iter().map(|(p, d)| (p.0, d.0)).collect(),
                },
            )?
            .into_any(),
            PushAction::Send { to, message } => {
                let (kind, transfer, generation) = match message {
                    PushMessage::WriteDone {
                        transfer,
                        generation,
                    } => ("write_done", transfer, generation),
                    PushMessage::PushFailed {
                        transfer,
                        generation,
                    } => ("push_failed", transfer, generation),
                };
                Py::new(
                    py,
                    PushSend {
                        to: to.as_str().to_owned(),
                        kind,
                        transfer: transfer.as_str().to_owned(),
                        generation: generation.word(),
                    },
                )?
                .into_any()
            }
            PushAction::Ended(e) => {
                let outcome = e.outcome.as_str();
                Py::new(
                    py,
                    PushEnded {
                        transfer: e.transfer.as_str().to_owned(),
                        request: e.request.as_str().to_owned(),
                        decode: e.decode.as_ref().map(|d| d.as_str().to_owned()),
                        blocks: block_list(&e.blocks),
                        outcome: PyEnum::PushOutcome.member(py, outcome)?,
                    },
                )?
                .into_any()
            }
        };
        Ok(Some(obj))
    }

    /// The counters, by name.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("admitted", s.admitted)?;
        d.set_item("registrations", s.registrations)?;
        d.set_item("registrations_ignored", s.registrations_ignored)?;
        d.set_item("registrations_dropped", s.registrations_dropped)?;
        d.set_item("writes", s.writes)?;
        d.set_item("ended", s.ended)?;
        d.set_item("releases_ignored", s.releases_ignored)?;
        d.set_item("prompt_mismatches", s.prompt_mismatches)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("PushCore(pushing={})", self.core.pushing())
    }
}

/// `(src_rank, dst_rank, (first_head, end_head))`, as [`tp_pairs`] returns them.
type TpPair = (u32, u32, (u32, u32));

/// The pairs of workers that move a request's KV from an engine of `src_tp` workers to
/// one of `dst_tp` (`kvlease_engine::tp_pairs`, the pairing D's read plan uses): a list
/// of `(src_rank, dst_rank, (first_head, end_head))`, the heads global, ordered by
/// destination then source. `replicated`: the KV is the same on every rank (MLA), moved
/// once per destination; otherwise each rank holds `num_kv_heads / tp` heads.
///
/// Raises `InvalidArgument` when a TP size is zero or, split by head, does not divide
/// `num_kv_heads`.
#[pyfunction]
#[pyo3(signature = (num_kv_heads, src_tp, dst_tp, replicated = false))]
pub(crate) fn tp_pairs(
    py: Python<'_>,
    num_kv_heads: u32,
    src_tp: u32,
    dst_tp: u32,
    replicated: bool,
) -> PyResult<Vec<TpPair>> {
    let split = if replicated {
        engine::KvSplit::Replicated
    } else {
        engine::KvSplit::Heads
    };
    let splits = |tp: u32| tp > 0 && (replicated || num_kv_heads.is_multiple_of(tp));
    if num_kv_heads == 0 || !splits(src_tp) || !splits(dst_tp) {
        return Err(invalid(
            py,
            format!("TP sizes {src_tp} and {dst_tp} do not both split {num_kv_heads} KV heads"),
        ));
    }
    Ok(engine::tp_pairs(split, num_kv_heads, src_tp, dst_tp)
        .into_iter()
        .map(|p| (p.src, p.dst, (p.heads.start, p.heads.end)))
        .collect())
}
