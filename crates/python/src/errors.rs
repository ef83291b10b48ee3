//! Rust errors → the exception classes of `kvlease.errors` (defined in Python, so that a
//! class may also derive from a builtin such as `ValueError` or `TimeoutError`).

use std::error::Error as StdError;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The module that defines the classes.
const MODULE: &str = "kvlease.errors";

/// An error family: one Python class each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    InvalidArgument,
    Config,
    Register,
    Connect,
    Auth,
    Transfer,
    StaleFence,
    TransferTimeout,
    Notif,
    Prefill,
    Admit,
    Load,
    SideChannel,
    Closed,
}

impl Family {
    fn class_name(self) -> &'static str {
        match self {
            Self::InvalidArgument => "InvalidArgument",
            Self::Config => "ConfigError",
            Self::Register => "RegisterError",
            Self::Connect => "ConnectError",
            Self::Auth => "AuthError",
            Self::Transfer => "TransferError",
            Self::StaleFence => "StaleFenceError",
            Self::TransferTimeout => "TransferTimeout",
            Self::Notif => "NotifError",
            Self::Prefill => "PrefillError",
            Self::Admit => "AdmitError",
            Self::Load => "LoadError",
            Self::SideChannel => "SideChannelError",
            Self::Closed => "ClosedError",
        }
    }

    fn cell(self) -> &'static PyOnceLock<Py<PyType>> {
        static CELLS: [PyOnceLock<Py<PyType>>; 14] = [const { PyOnceLock::new() }; 14];
        &CELLS[self as usize]
    }
}

/// An error and its causes, joined by `": "`.
pub(crate) fn chain(err: &dyn StdError) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        // `#[error(transparent)]` wrappers repeat their source's text.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// A `family` exception with `message` and the attributes `attrs`.
pub(crate) fn raise_with(
    py: Python<'_>,
    family: Family,
    message: impl Into<String>,
    attrs: &[(&str, Py<PyAny>)],
) -> PyErr {
    let message = message.into();
    let class = match family.cell().import(py, MODULE, family.class_name()) {
        Ok(class) => class,
        // The package is not importable (the native module used on its own): the base
        // class of Python still carries the message.
        Err(e) => return e,
    };
    match class.call1((message,)) {
        Ok(instance) => {
            for (name, value) in attrs {
                if let Err(e) = instance.setattr(*name, value) {
                    return e;
                }
            }
            PyErr::from_value(instance)
        }
        Err(e) => e,
    }
}

/// A `family` exception with `message`.
pub(crate) fn raise(py: Python<'_>, family: Family, message: impl Into<String>) -> PyErr {
    raise_with(py, family, message, &[])
}

/// A `family` exception carrying `err` and its causes as the message.
pub(crate) fn raise_err(py: Python<'_>, family: Family, err: &dyn StdError) -> PyErr {
    raise(py, family, chain(err))
}

/// `InvalidArgument` for a value the caller passed.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, Family::InvalidArgument, message)
}

/// Refuses to serve `what` on `addr` beyond loopback without a cluster token (anyone who
/// reaches it would be served), unless the caller opted out with
/// `allow_unauthenticated=True`: the Python half of the agents' `--allow-unauthenticated`.
pub(crate) fn check_unauthenticated_listen(
    py: Python<'_>,
    addr: std::net::SocketAddr,
    has_token: bool,
    allow_unauthenticated: bool,
    what: &str,
) -> PyResult<()> {
    if has_token || addr.ip().is_loopback() || allow_unauthenticated {
        return Ok(());
    }
    Err(invalid(
        py,
        format!(
            "listening on {addr} without a cluster token would serve {what} to anyone who \
             can reach it: set a token, listen on loopback, or pass allow_unauthenticated=True"
        ),
    ))
}

/// Conversion of the Rust crates' errors into their Python family.
pub(crate) trait ToPyErr {
    /// The Python exception for this error.
    fn to_py(&self, py: Python<'_>) -> PyErr;
}

impl ToPyErr for kvlease_transport::AgentError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::Config, self)
    }
}

impl ToPyErr for kvlease_transport::RegisterError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::Register, self)
    }
}

impl ToPyErr for kvlease_transport::ConnectError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let family = match self {
            Self::AuthRejected { .. } | Self::PeerAuthFailed { .. } => Family::Auth,
            _ => Family::Connect,
        };
        raise_err(py, family, self)
    }
}

/// `StaleFenceError` for `err`, with the generation the fence was expected to hold and
/// the one found (`None`: not reported, as for a write the peer refused).
fn stale_fence(
    py: Python<'_>,
    err: &kvlease_transport::TransferError,
    expected: u64,
    found: Option<u64>,
) -> PyErr {
    let int = |v: u64| {
        v.into_pyobject(py)
            .map_or_else(|_| py.None(), |v| v.into_any().unbind())
    };
    raise_with(
        py,
        Family::StaleFence,
        chain(err),
        &[
            ("expected", int(expected)),
            ("found", found.map_or_else(|| py.None(), int)),
        ],
    )
}

impl ToPyErr for kvlease_transport::TransferError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        match self {
            Self::FenceMismatch {
                expected, found, ..
            } => stale_fence(py, self, *expected, Some(*found)),
            // A write the peer's fence refused: nothing of it landed.
            Self::Stale { expected, .. } => stale_fence(py, self, *expected, None),
            Self::Timeout { .. } => raise_err(py, Family::TransferTimeout, self),
            Self::NotifTooLarge { .. } => raise_err(py, Family::Notif, self),
            _ => raise_err(py, Family::Transfer, self),
        }
    }
}

impl ToPyErr for kvlease_lease::InvalidId {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::InvalidArgument, self)
    }
}

impl ToPyErr for kvlease_lease::ConfigError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::Config, self)
    }
}

impl ToPyErr for kvlease_gpu_mem::RegionAccessError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::InvalidArgument, self)
    }
}

impl ToPyErr for kvlease_gpu_mem::ForeignRegionError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_err(py, Family::InvalidArgument, self)
    }
}

impl ToPyErr for kvlease_engine::PrefillError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let retryable = self.is_retryable();
        raise_with(
            py,
            Family::Prefill,
            chain(self),
            &[("retryable", bool_obj(py, retryable))],
        )
    }
}

impl ToPyErr for kvlease_engine::AdmitError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let field = match self.field() {
            Some(f) => f
                .into_pyobject(py)
                .map_or_else(|_| py.None(), |v| v.into_any().unbind()),
            None => py.None(),
        };
        raise_with(
            py,
            Family::Admit,
            chain(self),
            &[
                ("field", field),
                ("retryable", bool_obj(py, self.is_retryable())),
            ],
        )
    }
}

impl ToPyErr for kvlease_engine::LoadError {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        raise_with(
            py,
            Family::Load,
            chain(self),
            &[("retryable", bool_obj(py, self.is_retryable()))],
        )
    }
}

pub(crate) fn bool_obj(py: Python<'_>, value: bool) -> Py<PyAny> {
    pyo3::types::PyBool::new(py, value)
        .to_owned()
        .into_any()
        .unbind()
}
