//! The transport endpoints' counters, read at each scrape (the transport counts them
//! itself; [`Metrics::watch_transport`](super::Metrics::watch_transport) adds an endpoint).

use std::sync::{Arc, Mutex, PoisonError};

use kvlease_transport::StatsHandle;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;

/// Reads the transport endpoints' counters at each scrape.
#[derive(Debug, Default)]
pub(super) struct TransportCollector {
    pub(super) endpoints: Mutex<Vec<StatsHandle>>,
}

/// The registry owns one collector; [`Metrics`](super::Metrics) keeps another `Arc` of it
/// to add endpoints.
#[derive(Debug)]
pub(super) struct SharedCollector(pub(super) Arc<TransportCollector>);

impl Collector for SharedCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (dropped, refused, sessions, stalls) = self
            .0
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(StatsHandle::stats)
            .fold((0u64, 0u64, 0u64, 0u64), |(d, r, x, v), s| {
                (
                    d + s.notifs_dropped_overflow,
                    r + s.notifs_dropped_unauthenticated,
                    x + s.session_refusals,
                    v + s.verbs_stall_resets,
                )
            });
        for (name, help, value) in [
            (
                "kvlease_notifs_dropped",
                "Notifications dropped because the engine had not taken the earlier ones",
                dropped,
            ),
            (
                "kvlease_notifs_refused",
                "Notifications refused from peers that had not authenticated",
                refused,
            ),
            (
                "kvlease_session_refusals",
                "Transport connections refused: a registered engine's worker name without that registration's session",
                sessions,
            ),
            (
                "kvlease_verbs_stall_resets",
                "Verbs queue pairs reset because they completed nothing for --verbs-stall-timeout-ms with work outstanding (the work was posted again)",
                stalls,
            ),
        ] {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}
