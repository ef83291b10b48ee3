//! Notifications without a core: [`decode_notif`] (what one says) and
//! [`encode_heartbeats`].

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{PyEnum, request_id};
use crate::errors::{Family, raise_err};

/// What a notification says (`decode_notif`): `kind` (a `NotifKind`: `heartbeat`,
/// `read_complete`, `abort`, `expired`, `push` or `app`) and the fields of that kind; the
/// others are `None`. A `push` frame (push mode) gives its transfer as `request` and
/// `(transfer, generation)` in `leases`, or a push heartbeat's transfer ids in `ids`; a
/// registration (`KVL1:PR:`) also its prompt digest in `prompt`, when it carries one.
#[pyclass(module = "kvlease._kvlease", frozen, get_all)]
pub(crate) struct DecodedNotif {
    /// What it is (a `NotifKind`).
    kind: Py<PyAny>,
    /// `heartbeat`: the request ids named.
    ids: Option<Vec<String>>,
    /// `read_complete`, `abort`: the request.
    request: Option<String>,
    /// `read_complete`, `abort`: the consumer's engine.
    engine: Option<String>,
    /// `read_complete`, `abort`: the consumer's rank.
    rank: Option<u32>,
    /// `read_complete`: how many consumers read the lease.
    consumers_total: Option<u32>,
    /// `expired`: `(request, generation)` of each lease named.
    leases: Option<Vec<(String, u64)>>,
    /// `push` registration: the digest of D's prompt (32 lowercase hex digits), if given.
    prompt: Option<String>,
}

impl DecodedNotif {
    /// A notification of `kind` with no fields set.
    fn of(py: Python<'_>, kind: &str) -> PyResult<Self> {
        Ok(Self {
            kind: PyEnum::NotifKind.member(py, kind)?,
            ids: None,
            request: None,
            engine: None,
            rank: None,
            consumers_total: None,
            leases: None,
            prompt: None,
        })
    }
}

#[pymethods]
impl DecodedNotif {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "DecodedNotif(kind={:?}, request={:?})",
            self.kind.bind(py).to_string(),
            self.request
        )
    }
}

/// What a notification says (a `DecodedNotif`). Raises `NotifError` for a malformed one.
#[pyfunction]
pub(crate) fn decode_notif(py: Python<'_>, message: &[u8]) -> PyResult<DecodedNotif> {
    use kvlease_notif::Notif;
    Ok(match kvlease_notif::decode(message) {
        Ok(Notif::Heartbeat(ids)) => DecodedNotif {
            ids: Some(ids.iter().map(str::to_owned).collect()),
            ..DecodedNotif::of(py, "heartbeat")?
        },
        Ok(Notif::ReadComplete(rc)) => DecodedNotif {
            request: Some(rc.request.as_str().to_owned()),
            engine: Some(rc.consumer.engine.as_str().to_owned()),
            rank: Some(rc.consumer.rank),
            consumers_total: Some(rc.consumers_total),
            ..DecodedNotif::of(py, "read_complete")?
        },
        Ok(Notif::Abort(a)) => DecodedNotif {
            request: Some(a.request.as_str().to_owned()),
            engine: Some(a.consumer.engine.as_str().to_owned()),
            rank: Some(a.consumer.rank),
            ..DecodedNotif::of(py, "abort")?
        },
        Ok(Notif::Expired(leases)) => DecodedNotif {
            leases: Some(
                leases
                    .iter()
                    .map(|l| (l.request.as_str().to_owned(), l.generation.word()))
                    .collect(),
            ),
            ..DecodedNotif::of(py, "expired")?
        },
        Ok(Notif::PushRegister(r)) => DecodedNotif {
            request: Some(r.transfer.as_str().to_owned()),
            leases: Some(vec![(r.transfer.as_str().to_owned(), r.generation.word())]),
            prompt: r.prompt.map(|p| p.to_string()),
            ..DecodedNotif::of(py, "push")?
        },
        Ok(Notif::PushHeartbeat(ids)) => DecodedNotif {
            ids: Some(ids.iter().map(str::to_owned).collect()),
            ..DecodedNotif::of(py, "push")?
        },
        Ok(Notif::WriteDone(r) | Notif::PushFailed(r) | Notif::ReservationReleased(r)) => {
            DecodedNotif {
                request: Some(r.transfer.as_str().to_owned()),
                leases: Some(vec![(r.transfer.as_str().to_owned(), r.generation.word())]),
                ..DecodedNotif::of(py, "push")?
            }
        }
        Ok(Notif::App(_)) => DecodedNotif::of(py, "app")?,
        Err(e) => return Err(raise_err(py, Family::Notif, &e)),
    })
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
