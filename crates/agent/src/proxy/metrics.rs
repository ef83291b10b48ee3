//! The proxy's own metrics (`kvlease_proxy_*`) on its `/metrics`.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a proxied request ended (the `outcome` label of `kvlease_proxy_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyOutcome {
    /// D answered with a 2xx.
    Ok,
    /// D answered with a 2xx after one retry from P.
    OkAfterRetry,
    /// P or D answered with an error status, passed through.
    UpstreamError,
    /// An upstream was unreachable or answered garbage (502).
    BadGateway,
    /// An upstream did not answer in time (504).
    Timeout,
    /// The client's request was not a JSON object (400).
    BadRequest,
    /// The bodies the proxy held at once filled `--max-buffered-body-bytes` (503).
    Overloaded,
    /// The request had passed through this proxy already: a routing loop (508).
    Loop,
}

impl ProxyOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 8] = [
        Self::Ok,
        Self::OkAfterRetry,
        Self::UpstreamError,
        Self::BadGateway,
        Self::Timeout,
        Self::BadRequest,
        Self::Overloaded,
        Self::Loop,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::OkAfterRetry => "ok_after_retry",
            Self::UpstreamError => "upstream_error",
            Self::BadGateway => "bad_gateway",
            Self::Timeout => "timeout",
            Self::BadRequest => "bad_request",
            Self::Overloaded => "overloaded",
            Self::Loop => "loop",
        }
    }
}

impl EncodeLabelValue for ProxyOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: ProxyOutcome,
}

/// How push mode sent a D leg (the `dispatch` label of `kvlease_proxy_push_legs_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PushDispatch {
    /// P's identity was known: P's and D's legs went out at once.
    Concurrent,
    /// P's identity was not known: D's leg went out after P's answer.
    Sequential,
}

impl PushDispatch {
    /// Both, in label order.
    pub const ALL: [Self; 2] = [Self::Concurrent, Self::Sequential];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Concurrent => "concurrent",
            Self::Sequential => "sequential",
        }
    }
}

impl EncodeLabelValue for PushDispatch {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DispatchLabel {
    dispatch: PushDispatch,
}

/// The proxy's own metrics, on its `/metrics`.
#[derive(Debug, Clone)]
pub struct ProxyMetrics {
    registry: Arc<Registry>,
    /// `kvlease_proxy_retries_total`: requests prefilled again after a retryable KV failure.
    pub retries: Counter,
    /// `kvlease_proxy_prefill_requests_total`: requests sent to P (retries included).
    pub prefill_requests: Counter,
    /// `kvlease_proxy_decode_requests_total`: requests sent to D (retries included).
    pub decode_requests: Counter,
    /// `kvlease_proxy_request_seconds` (histogram): client request to the start of the answer.
    pub request_seconds: Histogram,
    /// `kvlease_proxy_http_connections_refused_total`: client connections closed at accept
    /// because the connection cap (in all, or the client address's share) was reached.
    pub http_connections_refused: Counter,
    /// `kvlease_proxy_http_connections_evicted_total`: idle client connections closed to
    /// make room for a newcomer.
    pub http_connections_evicted: Counter,
    /// `kvlease_proxy_buffered_body_bytes`: bytes of bodies the proxy holds now (at most
    /// `--max-buffered-body-bytes`).
    pub buffered_body_bytes: prometheus_client::metrics::gauge::Gauge,
    /// `kvlease_proxy_push_prefill_failures_total` (push mode): P legs sent alongside their
    /// D leg that failed (P unreachable, an error status, an unreadable answer or one
    /// without P's identity); the client's request went on with D.
    pub push_prefill_failures: Counter,
    /// `kvlease_proxy_push_identity_changes_total` (push mode): times a P answered with an
    /// identity other than the one the proxy remembered for it (a restarted P).
    pub push_identity_changes: Counter,
    requests: Family<OutcomeLabel, Counter>,
    push_legs: Family<DispatchLabel, Counter>,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxyMetrics {
    /// Registers every metric, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let retries = Counter::default();
        let prefill_requests = Counter::default();
        let decode_requests = Counter::default();
        let request_seconds = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 20),
        );
        let requests = Family::<OutcomeLabel, Counter>::default();
        let http_connections_refused = Counter::default();
        let http_connections_evicted = Counter::default();
        let push_legs = Family::<DispatchLabel, Counter>::default();
        let push_prefill_failures = Counter::default();
        let push_identity_changes = Counter::default();
        registry.register(
            "kvlease_proxy_push_legs",
            "Push mode: D legs sent, by dispatch (concurrent: with P's leg; sequential: after P's answer)",
            push_legs.clone(),
        );
        for dispatch in PushDispatch::ALL {
            drop(push_legs.get_or_create(&DispatchLabel { dispatch }));
        }
        registry.register(
            "kvlease_proxy_push_prefill_failures",
            "Push mode: P legs sent alongside their D leg that failed (D gets no write: a retryable KV failure, or the prompt computed)",
            push_prefill_failures.clone(),
        );
        registry.register(
            "kvlease_proxy_push_identity_changes",
            "Push mode: P answers naming an identity other than the one remembered for that P",
            push_identity_changes.clone(),
        );
        registry.register(
            "kvlease_proxy_http_connections_evicted",
            "Idle client connections closed to make room for a newcomer",
            http_connections_evicted.clone(),
        );
        let buffered_body_bytes = prometheus_client::metrics::gauge::Gauge::default();
        registry.register(
            "kvlease_proxy_buffered_body_bytes",
            "Bytes of bodies the proxy holds whole now",
            buffered_body_bytes.clone(),
        );
        registry.register(
            "kvlease_proxy_http_connections_refused",
            "Client connections answered 503 at accept: every connection they could replace was busy",
            http_connections_refused.clone(),
        );
        registry.register(
            "kvlease_proxy_retries",
            "Requests prefilled again after a retryable KV load failure on D",
            retries.clone(),
        );
        registry.register(
            "kvlease_proxy_prefill_requests",
            "Requests sent to prefill agents",
            prefill_requests.clone(),
        );
        registry.register(
            "kvlease_proxy_decode_requests",
            "Requests sent to decode agents",
            decode_requests.clone(),
        );
        registry.register(
            "kvlease_proxy_request_seconds",
            "Seconds from a client request to the start of its answer",
            request_seconds.clone(),
        );
        registry.register(
            "kvlease_proxy_requests",
            "Client requests, by outcome",
            requests.clone(),
        );
        for outcome in ProxyOutcome::ALL {
            drop(requests.get_or_create(&OutcomeLabel { outcome }));
        }
        Self {
            registry: Arc::new(registry),
            retries,
            prefill_requests,
            decode_requests,
            request_seconds,
            http_connections_refused,
            http_connections_evicted,
            buffered_body_bytes,
            push_prefill_failures,
            push_identity_changes,
            requests,
            push_legs,
        }
    }

    /// The counter `kvlease_proxy_push_legs_total{dispatch}`.
    pub fn push_legs(&self, dispatch: PushDispatch) -> Counter {
        self.push_legs
            .get_or_create(&DispatchLabel { dispatch })
            .clone()
    }

    /// The counter `kvlease_proxy_requests_total{outcome}`.
    pub fn request(&self, outcome: ProxyOutcome) -> Counter {
        self.requests
            .get_or_create(&OutcomeLabel { outcome })
            .clone()
    }

    /// Renders the metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        crate::metrics::encode_registry(&self.registry)
    }
}
