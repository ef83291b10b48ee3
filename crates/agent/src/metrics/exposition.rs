//! The exposition format: what `GET /metrics` serves.

use prometheus_client::registry::Registry;

/// The HTTP `Content-Type` of [`Metrics::encode`](super::Metrics::encode)'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders `registry` in the OpenMetrics text format.
pub(crate) fn encode_registry(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; an Err here would come only from a metric's own
    // encoder, and ours (counters, gauges, histograms with static labels) have none.
    if let Err(error) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::error!(%error, "encoding metrics failed");
    }
    out
}
