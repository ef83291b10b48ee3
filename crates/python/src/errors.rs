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
    Handshake,
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
            Self::Handshake => "HandshakeError",
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

    /// The class (an `ImportError` when the package is not importable).
    fn class<'py>(self, py: Python<'py>) -> PyResult<&'py Bound<'py, PyType>> {
        self.cell().import(py, MODULE, self.class_name())
    }

    fn cell(self) -> &'static PyOnceLock<Py<PyType>> {
        static CELLS: [PyOnceLock<Py<PyType>>; 15] = [const { PyOnceLock::new() }; 15];
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
    let class = match family.class(py) {
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
        let handshake = match self {
            Self::Handshake { source, .. } => source.to_py(py).into_value(py).into_any(),
            _ => py.None(),
        };
        raise_with(
            py,
            Family::Load,
            chain(self),
            &[
                ("retryable", bool_obj(py, self.is_retryable())),
                ("handshake", handshake),
            ],
        )
    }
}

/// The one mapping between the engine's [`HandshakeError`](kvlease_engine::HandshakeError)
/// and Python's typed handshake errors: each variant is a value of
/// `kvlease.kinds.HandshakeKind`, and `kvlease.errors.HandshakeError.kind` carries it
/// (`AuthError` for [`Auth`](kvlease_engine::HandshakeError::Auth)).
pub(crate) mod handshake {
    use kvlease_engine::{Cause, HandshakeError};
    use pyo3::prelude::*;

    use super::{Family, ToPyErr, chain, invalid, raise_with};
    use crate::cores::{PyEnum, cause};

    /// The `HandshakeKind` value of `e`.
    pub(crate) fn kind(e: &HandshakeError) -> &'static str {
        match e {
            HandshakeError::Auth(_) => "auth",
            HandshakeError::NotAllowed(_) => "not_allowed",
            HandshakeError::NotFound(_) => "not_found",
            HandshakeError::Connect(_) => "connect",
            HandshakeError::Other(_) => "other",
            HandshakeError::TpSize { .. } => "incompatible",
        }
    }

    /// The variant a shell reports for the `HandshakeKind` value `kind`, carrying
    /// `cause`; `None` for `incompatible` (the core's own check) and unknown values.
    pub(crate) fn from_kind(kind: &str, cause: Cause) -> Option<HandshakeError> {
        Some(match kind {
            "auth" => HandshakeError::Auth(cause),
            "not_allowed" => HandshakeError::NotAllowed(cause),
            "not_found" => HandshakeError::NotFound(cause),
            "connect" => HandshakeError::Connect(cause),
            "other" => HandshakeError::Other(cause),
            _ => return None,
        })
    }

    /// The engine's error for the Python exception `error`, an instance of
    /// `kvlease.errors.HandshakeError` (its `kind` and message).
    pub(crate) fn from_py(error: &Bound<'_, PyAny>) -> PyResult<HandshakeError> {
        let py = error.py();
        let class = Family::Handshake.class(py)?;
        if !error.is_instance(class)? {
            return Err(invalid(
                py,
                format!(
                    "error must be a kvlease.HandshakeError, not {}",
                    error.get_type().name()?
                ),
            ));
        }
        let kind: String = error.getattr("kind")?.extract()?;
        let message = error.str()?.to_string();
        from_kind(&kind, cause(message)).ok_or_else(|| {
            invalid(
                py,
                format!(
                    "a shell reports a handshake of kind auth, not_allowed, not_found, \
                     connect or other, not {kind:?}"
                ),
            )
        })
    }

    /// The Python exception for `e`, of `family` (`AuthError` whatever `family` for
    /// [`Auth`](HandshakeError::Auth)), with `message` and `kind` set.
    pub(crate) fn to_py_as(
        py: Python<'_>,
        e: &HandshakeError,
        family: Family,
        message: String,
    ) -> PyErr {
        let family = if e.is_auth() { Family::Auth } else { family };
        let kind = match PyEnum::HandshakeKind.member(py, kind(e)) {
            Ok(kind) => kind,
            Err(err) => return err,
        };
        raise_with(py, family, message, &[("kind", kind)])
    }

    impl ToPyErr for HandshakeError {
        fn to_py(&self, py: Python<'_>) -> PyErr {
            to_py_as(py, self, Family::Handshake, chain(self))
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_kind_a_shell_reports_names_its_variant_and_back() {
            for k in ["auth", "not_allowed", "not_found", "connect", "other"] {
                let e = from_kind(k, cause(k.to_owned())).expect("a shell's kind");
                assert_eq!(kind(&e), k);
                assert_eq!(e.to_string(), k, "the message is the shell's");
            }
            assert_eq!(
                kind(&HandshakeError::TpSize { p_tp: 3, heads: 2 }),
                "incompatible"
            );
            assert!(from_kind("incompatible", cause(String::new())).is_none());
            assert!(from_kind("AUTH", cause(String::new())).is_none());
        }
    }
}

pub(crate) fn bool_obj(py: Python<'_>, value: bool) -> Py<PyAny> {
    pyo3::types::PyBool::new(py, value)
        .to_owned()
        .into_any()
        .unbind()
}
