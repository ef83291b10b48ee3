//! How [`Metrics::new`](super::Metrics::new) registers its metrics: the [`Registrar`] that
//! names each `kvlease_*` and keeps a handle, and the histograms' buckets.

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

/// Buckets in seconds from 1 ms to about 17 minutes (×2 each): covers a sub-second test
/// lease as well as the 480 s fixed timeout.
pub(super) fn seconds_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 21)
}

/// Buckets in seconds from 10 µs to about 10 s (×2 each), for read latency.
pub(super) fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.000_01, 2.0, 21)
}

/// Registers metrics in one registry, each under `kvlease_` + its name and its help, and
/// hands back the handle the [`Metrics`](super::Metrics) field keeps (the registry keeps a
/// clone).
pub(super) struct Registrar<'a>(pub(super) &'a mut Registry);

impl Registrar<'_> {
    pub(super) fn add<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        self.0
            .register(format!("kvlease_{name}"), help, metric.clone());
        metric
    }

    pub(super) fn gauge(&mut self, name: &str, help: &str) -> Gauge {
        self.add(name, help, Gauge::default())
    }

    pub(super) fn counter(&mut self, name: &str, help: &str) -> Counter {
        self.add(name, help, Counter::default())
    }

    pub(super) fn histogram(
        &mut self,
        name: &str,
        help: &str,
        buckets: impl Iterator<Item = f64>,
    ) -> Histogram {
        self.add(name, help, Histogram::new(buckets))
    }

    pub(super) fn family<S, M>(&mut self, name: &str, help: &str) -> Family<S, M>
    where
        S: EncodeLabelSet + Clone + std::hash::Hash + Eq + Send + Sync + std::fmt::Debug + 'static,
        M: prometheus_client::metrics::TypedMetric
            + EncodeMetric
            + Default
            + Send
            + Sync
            + std::fmt::Debug
            + 'static,
    {
        self.add(name, help, Family::<S, M>::default())
    }
}
