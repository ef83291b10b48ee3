//! The label values and label sets of the agents' metric families: the enums the engines
//! pass to [`Metrics`](super::Metrics)'s recorders, and how each is written in a series'
//! labels.

use kvlease_transport::Backend;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};

/// Why P released a lease (the `reason` label of `kvlease_leases_released_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// Every expected consumer reported its read.
    Completed,
    /// The lease passed its expiry and the reaper reclaimed it.
    Expired,
    /// D aborted the request (notify-only completion) or P aborted it.
    Aborted,
}

impl ReleaseReason {
    /// Every reason, in label order.
    pub const ALL: [Self; 3] = [Self::Completed, Self::Expired, Self::Aborted];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Expired => "expired",
            Self::Aborted => "aborted",
        }
    }
}

/// How a request to an agent's HTTP API ended (the `outcome` label of
/// `kvlease_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestOutcome {
    /// Served.
    Ok,
    /// D could not load the KV blocks and answered with the retryable `kv_load_failed`
    /// error (policy `recompute`).
    KvLoadFailed,
    /// D could not load the KV blocks and failed the request (policy `fail`).
    Failed,
    /// D recomputed the prompt locally (short prompt, below `kv_recompute_threshold`).
    Recomputed,
    /// Rejected: D's waiting queue or P's pool wait was full (HTTP 503).
    Overloaded,
    /// Rejected: malformed request, bad `kv_transfer_params`, unknown engine (HTTP 4xx).
    BadRequest,
    /// Rejected: wrong or missing auth token.
    Unauthorized,
    /// Aborted by the client (disconnect or `POST /v1/abort/{id}`).
    Aborted,
    /// An internal error (HTTP 500).
    Error,
}

impl RequestOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 9] = [
        Self::Ok,
        Self::KvLoadFailed,
        Self::Failed,
        Self::Recomputed,
        Self::Overloaded,
        Self::BadRequest,
        Self::Unauthorized,
        Self::Aborted,
        Self::Error,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::KvLoadFailed => "kv_load_failed",
            Self::Failed => "failed",
            Self::Recomputed => "recomputed",
            Self::Overloaded => "overloaded",
            Self::BadRequest => "bad_request",
            Self::Unauthorized => "unauthorized",
            Self::Aborted => "aborted",
            Self::Error => "error",
        }
    }
}

/// The data path of a transfer as the `backend` label writes it (the transport's
/// [`Backend::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct BackendName(pub(super) Backend);

impl BackendName {
    /// The label value.
    fn as_str(self) -> &'static str {
        self.0.as_str()
    }
}

/// How a handshake with a peer ended (the `outcome` label of `kvlease_handshakes_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandshakeOutcome {
    /// Metadata exchanged and connected.
    Ok,
    /// The peer did not prove the cluster token, or we could not prove it.
    AuthFailed,
    /// Unreachable, timed out, or malformed.
    Failed,
}

impl HandshakeOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 3] = [Self::Ok, Self::AuthFailed, Self::Failed];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::AuthFailed => "auth_failed",
            Self::Failed => "failed",
        }
    }
}

macro_rules! label_value {
    ($($ty:ty),*) => {$(
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                EncodeLabelValue::encode(&self.as_str(), encoder)
            }
        }
    )*};
}
label_value!(ReleaseReason, RequestOutcome, BackendName, HandshakeOutcome);

/// `{reason="..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub(super) reason: ReleaseReason,
}

/// `{outcome="..."}` for requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct OutcomeLabel {
    pub(super) outcome: RequestOutcome,
}

/// `{outcome="..."}` for handshakes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct HandshakeLabel {
    pub(super) outcome: HandshakeOutcome,
}

/// `{outcome="..."}` for push reservations (D) and pushes (P).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct PushOutcomeLabel {
    pub(super) outcome: String,
}

/// `{backend="..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct BackendLabel {
    pub(super) backend: BackendName,
}

/// `{peer="...",backend="..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct PeerBackendLabel {
    pub(super) peer: String,
    pub(super) backend: BackendName,
}
