//! The engine cores for Python: [`PrefillCore`] and [`DecodeCore`] with Python types.
//!
//! Every decision stays in `kvlease-engine`; these types only convert. Time is an
//! argument: `now` is seconds on one monotonic clock per core (`time.monotonic()`).
//!
//! - `prefill`: P's core and what it returns (grants, releases, actions, events).
//! - `decode`: D's core and what it returns (load plans, transmits, events).
//! - `notif`: decoding and encoding notifications without a core.
//! - `push`: push mode's cores, D's `Reservations` and P's `PushCore`, and what they
//!   return.
//! - here: the conversions both use, and [`PyEnum`], the enums of `kvlease.kinds` every
//!   kind, status, reason and outcome is returned as.

use std::sync::Arc;
use std::time::Duration;

use kvlease_engine as engine;
use kvlease_lease::{BlockId, EngineId, LeaseConfig, RequestId, Timestamp};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::errors::{ToPyErr, invalid};

mod decode;
mod notif;
mod prefill;
mod push;

pub(crate) use decode::{
    BatchPlan, DecodeCore, DecodeNotifOutcome, EngineDropped, Finished, HandshakeDone,
    HandshakeStart, LoadPlan, Loaded, RemoteKv, Transmit,
};
pub(crate) use notif::{DecodedNotif, decode_notif, encode_heartbeats};
pub(crate) use prefill::{
    ClearFences, Granted, PrefillCore, PrefillNotifOutcome, PrefillStart, Refused, Released,
    SendNotif,
};
pub(crate) use push::{
    PushCore, PushEnded, PushSend, PushWrite, Reservation, ReservationEnded, Reservations, tp_pairs,
};

/// The Python module that defines the enums.
const KINDS: &str = "kvlease.kinds";

/// An enum of `kvlease.kinds`: a Python `str` enum (equal to its value), built by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PyEnum {
    /// How a read batch ended: `done`, `stale`, `failed`.
    BatchStatus,
    /// Why a lease ended: `completed`, `expired`, `aborted`.
    ReleaseReason,
    /// How a request ended on D: `done`, `failed`, `aborted`, `shutdown`.
    Outcome,
    /// A notification for P: `heartbeat`, `abort`.
    TransmitKind,
    /// What a notification was, or what a core did with it.
    NotifKind,
    /// What P's core did with a read completion.
    ReadCompleteOutcome,
    /// Whether D's reservations admit a write: `accepted`, `stale`, `unknown`, `foreign`.
    FenceVerdict,
    /// How a reservation ended on D.
    ReservationOutcome,
    /// How a push ended on P.
    PushOutcome,
    /// What P's push core did with a registration.
    RegistrationOutcome,
    /// Why a handshake failed (`kvlease.errors.HandshakeError.kind`).
    HandshakeKind,
}

impl PyEnum {
    fn class_name(self) -> &'static str {
        match self {
            Self::BatchStatus => "BatchStatus",
            Self::ReleaseReason => "ReleaseReason",
            Self::Outcome => "Outcome",
            Self::TransmitKind => "TransmitKind",
            Self::NotifKind => "NotifKind",
            Self::ReadCompleteOutcome => "ReadCompleteOutcome",
            Self::FenceVerdict => "FenceVerdict",
            Self::ReservationOutcome => "ReservationOutcome",
            Self::PushOutcome => "PushOutcome",
            Self::RegistrationOutcome => "RegistrationOutcome",
            Self::HandshakeKind => "HandshakeKind",
        }
    }

    fn cell(self) -> &'static PyOnceLock<Py<PyType>> {
        static CELLS: [PyOnceLock<Py<PyType>>; 11] = [const { PyOnceLock::new() }; 11];
        &CELLS[self as usize]
    }

    /// The member whose value is `value` (an `ImportError` when the package is not
    /// importable, a `ValueError` for a value the enum lacks).
    pub(crate) fn member(self, py: Python<'_>, value: &str) -> PyResult<Py<PyAny>> {
        let class = self.cell().import(py, KINDS, self.class_name())?;
        Ok(class.call1((value,))?.unbind())
    }
}

/// `now` (seconds) as a core's timestamp.
pub(crate) fn at(py: Python<'_>, now: f64) -> PyResult<Timestamp> {
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

pub(crate) fn cause(message: String) -> engine::Cause {
    Arc::new(ShellError { message })
}
