//! The agents' Prometheus metrics (served on `GET /metrics`).
//!
//! [`Metrics`] holds one typed handle per metric, so the engines write
//! `metrics.leases_granted.inc()`; cloning it is cheap (every handle is an `Arc`) and all
//! clones update the same values. [`Metrics::encode`] renders the OpenMetrics text format
//! ([`CONTENT_TYPE`]), which Prometheus scrapes.
//!
//! Names: prometheus-client appends `_total` to counter sample names itself, so counters are
//! registered without the suffix and exposed with it, exactly as the `REQUIRED` list in
//! this module's tests names them (`kvlease_leases_granted_total`). `kvlease_blocks_total` is
//! a gauge (the pool size), so it is registered under its full name.
//!
//! Labelled families are pre-populated with every label value, so that a scrape shows `0`
//! rather than nothing before the first event (a rate over a missing series is empty).
//!
//! - here: [`Metrics`], its registration and its recorders (the labelled series);
//! - `labels`: the label values ([`ReleaseReason`], [`RequestOutcome`],
//!   [`HandshakeOutcome`]) and label sets;
//! - `registrar`: how each metric is registered, and the histograms' buckets;
//! - `collector`: the transport endpoints' counters, read at each scrape;
//! - `exposition`: the OpenMetrics text served ([`CONTENT_TYPE`]).

use std::sync::{Arc, PoisonError};

use kvlease_transport::{Backend, StatsHandle};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod collector;
mod exposition;
mod labels;
mod registrar;
#[cfg(test)]
mod tests;

use collector::{SharedCollector, TransportCollector};
pub use exposition::CONTENT_TYPE;
pub(crate) use exposition::encode_registry;
use labels::{
    BackendLabel, BackendName, HandshakeLabel, OutcomeLabel, PeerBackendLabel, PushOutcomeLabel,
    ReasonLabel,
};
pub use labels::{HandshakeOutcome, ReleaseReason, RequestOutcome};
use registrar::{Registrar, latency_buckets, seconds_buckets};

/// Every metric of an agent. P and D share the type; each updates the ones that apply to
/// it, the rest stay at zero.
///
/// Clone freely: clones share the values.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Arc<Registry>,

    // Pool and leases (P).
    /// `kvlease_blocks_total` (gauge): KV blocks in the pool, all ranks together.
    pub blocks_total: Gauge,
    /// `kvlease_blocks_held` (gauge): blocks pinned by a lease or a running prefill.
    pub blocks_held: Gauge,
    /// `kvlease_leases_active` (gauge): leases not yet released.
    pub leases_active: Gauge,
    /// `kvlease_leases_granted_total`.
    pub leases_granted: Counter,
    /// `kvlease_leases_released_total{reason}`: use [`Metrics::lease_released`].
    leases_released: Family<ReasonLabel, Counter>,
    /// `kvlease_heartbeats_received_total`: `HB:` messages received (P).
    pub heartbeats_received: Counter,
    /// `kvlease_heartbeat_ids_received_total`: request ids in the heartbeats received (P).
    pub heartbeat_ids_received: Counter,
    /// `kvlease_heartbeat_unknown_ids_total`: ids P did not hold (released or never granted).
    pub heartbeat_unknown_ids: Counter,
    /// `kvlease_lease_extensions_total`: heartbeats that pushed an expiry later.
    pub lease_extensions: Counter,
    /// `kvlease_lease_reclaim_seconds` (histogram): last heartbeat (or grant, when none
    /// came) to the reclaim of an expired lease.
    pub lease_reclaim_seconds: Histogram,
    /// `kvlease_expiry_notices_sent_total`: explicit expiry signals P sent to D.
    pub expiry_notices_sent: Counter,
    /// `kvlease_pool_wait_seconds` (histogram): how long prefills waited for free blocks.
    pub pool_wait_seconds: Histogram,
    /// `kvlease_prefill_tokens_total`: prompt tokens prefilled.
    pub prefill_tokens: Counter,

    // Heartbeats, queue and reads (D).
    /// `kvlease_heartbeats_sent_total`: `HB:` messages sent (D).
    pub heartbeats_sent: Counter,
    /// `kvlease_heartbeat_ids_sent_total`: request ids in the heartbeats sent (D).
    pub heartbeat_ids_sent: Counter,
    /// `kvlease_requests_tracked` (gauge): requests D heartbeats for.
    pub requests_tracked: Gauge,
    /// `kvlease_requests_waiting` (gauge): D's waiting queue length.
    pub requests_waiting: Gauge,
    /// `kvlease_requests_running` (gauge): requests decoding on D.
    pub requests_running: Gauge,
    /// `kvlease_queue_wait_seconds` (histogram): arrival to scheduled, on D.
    pub queue_wait_seconds: Histogram,
    /// `kvlease_read_seconds` (histogram): post of a KV read batch to its completion.
    pub read_seconds: Histogram,
    /// `kvlease_stale_reads_total`: reads whose fence showed the lease was gone.
    pub stale_reads: Counter,
    /// `kvlease_expiry_notices_received_total`: explicit expiry signals D received.
    pub expiry_notices_received: Counter,
    /// `kvlease_kv_load_failures_total`: requests whose KV load failed for any reason.
    pub kv_load_failures: Counter,
    /// `kvlease_decode_tokens_total`: tokens decoded.
    pub decode_tokens: Counter,
    /// `kvlease_transfer_bytes_total`: KV bytes moved (read by D, served by P's TCP server).
    pub transfer_bytes: Counter,
    /// `kvlease_transfers_total{backend}`: use [`Metrics::transfer`].
    transfers: Family<BackendLabel, Counter>,
    /// `kvlease_read_bytes_total{backend}`: KV bytes this engine read, by the backend each
    /// batch really used (a link that says `shm` may move a batch with `cma`): use
    /// [`Metrics::read_bytes`].
    read_bytes: Family<BackendLabel, Counter>,
    /// `kvlease_peer_backend{peer,backend}` (gauge, 1 = in use): use [`Metrics::set_peer_backend`].
    peer_backend: Family<PeerBackendLabel, Gauge>,
    /// `kvlease_handshakes_total{outcome}`: use [`Metrics::handshake`].
    handshakes: Family<HandshakeLabel, Counter>,

    // Bidirectional mode.
    /// `kvlease_decoder_cached_blocks` (gauge): blocks D keeps for a next turn (D).
    pub decoder_cached_blocks: Gauge,
    /// `kvlease_decoder_cache_expired_total`: cached turns D freed at their TTL (D).
    pub decoder_cache_expired: Counter,
    /// `kvlease_decoder_cache_pulled_total`: cached turns P reported read, freed (D).
    pub decoder_cache_pulled: Counter,
    /// `kvlease_decoder_cache_evicted_total`: cached turns D freed early because a new
    /// request needed the blocks (D).
    pub decoder_cache_evicted: Counter,
    /// `kvlease_cached_tokens_pulled_total`: prompt tokens P read from D instead of
    /// computing them (P).
    pub cached_tokens_pulled: Counter,
    /// `kvlease_pull_recomputes_total`: next-turn requests with D's params that P
    /// recomputed instead (deadline too close, prefix diverged, below threshold, D gone).
    pub pull_recomputes: Counter,

    // Both.
    /// `kvlease_requests_total{outcome}`: use [`Metrics::request`].
    requests: Family<OutcomeLabel, Counter>,
    /// `kvlease_notif_malformed_total`: notifications that did not decode.
    pub notif_malformed: Counter,
    /// `kvlease_notifs_foreign_total` (P): heartbeats, completions and aborts about a
    /// lease another D engine owns (ignored).
    pub notifs_foreign: Counter,
    /// `kvlease_notifs_unregistered_total` (P): notifications from a transport connection
    /// whose proven name is no worker a D engine registered on the side channel (dropped).
    pub notifs_unregistered: Counter,
    /// `kvlease_connect_back_refused_total` (P): D workers P did not connect back to
    /// because their address is not the one D's side-channel handshake came from.
    pub connect_back_refused: Counter,
    /// `kvlease_leases_max_lifetime_total` (P): leases reclaimed at their maximum lifetime
    /// (`kv_lease_max_lifetime`) although heartbeats had renewed them past it (they count
    /// in `kvlease_leases_released_total{reason="expired"}` too).
    pub leases_max_lifetime: Counter,
    /// `kvlease_registrations_refused_total` (P): D side-channel registrations P declined:
    /// an instance more than a minute ahead of P's clock, or one that does not outrank
    /// the engine's instance on record.
    pub registrations_refused: Counter,
    /// `kvlease_d_engines_registered` (P): D engines registered on the side channel.
    pub d_engines_registered: Gauge,
    /// `kvlease_remote_engines` (D): P engines D keeps, handshaking or connected (at most
    /// `--max-prefill-engines`).
    pub remote_engines: Gauge,
    /// `kvlease_remote_engines_evicted_total` (D): idle P engines D dropped, connections
    /// closed, to make room for another.
    pub remote_engines_evicted: Counter,
    /// `kvlease_instance_checks_total` (D): checks of a connected P engine's instance with
    /// its side channel, because a request named a newer one.
    pub instance_checks: Counter,
    /// `kvlease_peer_restarts_total` (D): P engines whose side channel announced a newer
    /// instance (their old connections closed).
    pub peer_restarts: Counter,

    // Limits.
    /// `kvlease_notifs_dropped_total`: notifications the transport dropped because the
    /// engine had not taken the earlier ones (`--max-pending-notif-bytes`; only those that
    /// arrive on a data connection, from older peers: a link's notification connection
    /// leaves them in the socket instead), and
    /// `kvlease_notifs_refused_total`: notifications from peers that had not completed an
    /// authenticated handshake, and `kvlease_session_refusals_total`: transport
    /// connections refused because they named a registered engine's worker without
    /// proving that registration's session; all summed over the endpoints given to
    /// [`Metrics::watch_transport`] at each scrape.
    transports: Arc<TransportCollector>,
    /// `kvlease_side_channel_refused_total`: side-channel connections refused at accept
    /// (told to retry) because `--side-channel-max-connections` handshakes were running
    /// and none could be evicted.
    pub side_channel_refused: Counter,
    /// `kvlease_side_channel_evicted_total`: side-channel handshakes cut off to make room
    /// for another address's (the address holding the most gave its oldest).
    pub side_channel_evicted: Counter,
    /// `kvlease_http_connections_refused_total`: HTTP connections answered 503 at accept
    /// because `--http-max-connections` were open (or `--http-max-connections-per-source`
    /// from the client's address) and every one they could replace was busy.
    pub http_connections_refused: Counter,
    /// `kvlease_http_connections_evicted_total`: idle HTTP connections closed to make room
    /// for a newcomer.
    pub http_connections_evicted: Counter,

    // Push mode.
    /// `kvlease_push_reservations_total` (D): reservations made.
    pub push_reservations: Counter,
    /// `kvlease_push_write_grants_total` (D): remote-write grants made for reservations
    /// (verbs links; one per contiguous range of a worker's pool the write lands in).
    pub push_write_grants: Counter,
    /// `kvlease_push_reservations_active` (gauge, D): reservations not yet ended.
    pub push_reservations_active: Gauge,
    /// `kvlease_push_legs_waiting` (gauge, D): push legs waiting for free KV blocks.
    pub push_legs_waiting: Gauge,
    /// `kvlease_push_reservations_ended_total{outcome}` (D): use
    /// [`Metrics::push_reservation_ended`].
    push_reservations_ended: Family<PushOutcomeLabel, Counter>,
    /// `kvlease_pushes_admitted_total` (P): push legs admitted.
    pub pushes_admitted: Counter,
    /// `kvlease_pushes_active` (gauge, P): admitted pushes not yet ended.
    pub pushes_active: Gauge,
    /// `kvlease_pushes_ended_total{outcome}` (P): use [`Metrics::push_ended`].
    pushes_ended: Family<PushOutcomeLabel, Counter>,
    /// `kvlease_push_writes_posted_total` (P): fenced writes posted (one per push, all
    /// workers together).
    pub push_writes_posted: Counter,
    /// `kvlease_push_writes_granted_total` (P): writes posted as RDMA WRITEs into D's
    /// grants (every worker's batch named grants; verbs links).
    pub push_writes_granted: Counter,
    /// `kvlease_push_writes_failed_total` (P): writes that failed to post or complete.
    pub push_writes_failed: Counter,
    /// `kvlease_push_heartbeats_sent_total` (P): `KVL1:PH:` messages sent.
    pub push_heartbeats_sent: Counter,
}

/// Outcomes of D's reservations (`kvlease_push_reservations_ended_total`).
pub const RESERVATION_OUTCOMES: [&str; 4] = ["written", "failed", "expired", "aborted"];
/// Outcomes of P's pushes (`kvlease_pushes_ended_total`).
pub const PUSH_OUTCOMES: [&str; 6] = [
    "written",
    "write_failed",
    "reservation_gone",
    "retired",
    "no_registration",
    "lease_too_short",
];

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric, all at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let transports = Arc::new(TransportCollector::default());
        registry.register_collector(Box::new(SharedCollector(Arc::clone(&transports))));
        let mut r = Registrar(&mut registry);

        let metrics = Self {
            blocks_total: r.gauge("blocks_total", "KV blocks in the pool (all ranks)"),
            blocks_held: r.gauge(
                "blocks_held",
                "KV blocks pinned by a lease or a running prefill",
            ),
            leases_active: r.gauge("leases_active", "Leases granted and not yet released"),
            leases_granted: r.counter("leases_granted", "Leases granted"),
            leases_released: r.family("leases_released", "Leases released, by reason"),
            heartbeats_received: r
                .counter("heartbeats_received", "HB: heartbeat messages received"),
            heartbeat_ids_received: r.counter(
                "heartbeat_ids_received",
                "Request ids in received heartbeats",
            ),
            heartbeat_unknown_ids: r
                .counter("heartbeat_unknown_ids", "Heartbeat ids for leases not held"),
            lease_extensions: r.counter(
                "lease_extensions",
                "Heartbeats that extended a lease's expiry",
            ),
            lease_reclaim_seconds: r.histogram(
                "lease_reclaim_seconds",
                "Seconds from the last heartbeat (or the grant) to the reclaim of an expired lease",
                seconds_buckets(),
            ),
            expiry_notices_sent: r.counter("expiry_notices_sent", "Expiry signals sent to D"),
            pool_wait_seconds: r.histogram(
                "pool_wait_seconds",
                "Seconds prefills waited for free KV blocks",
                seconds_buckets(),
            ),
            prefill_tokens: r.counter("prefill_tokens", "Prompt tokens prefilled"),
            heartbeats_sent: r.counter("heartbeats_sent", "HB: heartbeat messages sent"),
            heartbeat_ids_sent: r.counter("heartbeat_ids_sent", "Request ids in sent heartbeats"),
            requests_tracked: r.gauge("requests_tracked", "Requests whose leases D renews"),
            requests_waiting: r.gauge("requests_waiting", "Requests in D's waiting queue"),
            requests_running: r.gauge("requests_running", "Requests decoding on D"),
            queue_wait_seconds: r.histogram(
                "queue_wait_seconds",
                "Seconds from arrival on D to scheduling",
                seconds_buckets(),
            ),
            read_seconds: r.histogram(
                "read_seconds",
                "Seconds per KV read batch",
                latency_buckets(),
            ),
            stale_reads: r.counter(
                "stale_reads",
                "KV reads whose fence showed the lease was released",
            ),
            expiry_notices_received: r
                .counter("expiry_notices_received", "Expiry signals received from P"),
            kv_load_failures: r.counter("kv_load_failures", "Requests whose KV load failed"),
            decode_tokens: r.counter("decode_tokens", "Tokens decoded"),
            transfer_bytes: r.counter("transfer_bytes", "KV bytes transferred"),
            transfers: r.family("transfers", "KV read batches completed, by backend"),
            read_bytes: r.family(
                "read_bytes",
                "KV bytes read, by the backend each batch really used",
            ),
            peer_backend: r.family(
                "peer_backend",
                "Backend in use per peer engine (1 = in use)",
            ),
            handshakes: r.family("handshakes", "Side-channel handshakes, by outcome"),
            requests: r.family("requests", "HTTP requests, by outcome"),
            decoder_cached_blocks: r.gauge(
                "decoder_cached_blocks",
                "KV blocks D keeps for a next turn (bidirectional mode)",
            ),
            decoder_cache_expired: r.counter(
                "decoder_cache_expired",
                "Cached turns D freed at decoder_kv_blocks_ttl",
            ),
            decoder_cache_pulled: r.counter(
                "decoder_cache_pulled",
                "Cached turns P reported read, then freed by D",
            ),
            decoder_cache_evicted: r.counter(
                "decoder_cache_evicted",
                "Cached turns D freed early because a new request needed the blocks",
            ),
            cached_tokens_pulled: r.counter(
                "cached_tokens_pulled",
                "Prompt tokens P read from D instead of computing them",
            ),
            pull_recomputes: r.counter(
                "pull_recomputes",
                "Next-turn requests with D's params that P recomputed",
            ),
            notif_malformed: r.counter("notif_malformed", "Notifications that did not decode"),
            notifs_foreign: r.counter(
                "notifs_foreign",
                "Notifications about a lease another D engine owns (ignored)",
            ),
            notifs_unregistered: r.counter(
                "notifs_unregistered",
                "Notifications from a connection no D engine registered on the side channel (dropped)",
            ),
            connect_back_refused: r.counter(
                "connect_back_refused",
                "D workers not connected back to: not on the address of D's side-channel handshake",
            ),
            leases_max_lifetime: r.counter(
                "leases_max_lifetime",
                "Leases reclaimed at their max lifetime though heartbeats renewed them past it",
            ),
            registrations_refused: r.counter(
                "registrations_refused",
                "D side-channel registrations declined: instance ahead of the clock or not newer",
            ),
            d_engines_registered: r.gauge(
                "d_engines_registered",
                "D engines registered on the side channel",
            ),
            remote_engines: r.gauge(
                "remote_engines",
                "P engines D keeps, handshaking or connected",
            ),
            remote_engines_evicted: r.counter(
                "remote_engines_evicted",
                "Idle P engines D dropped to make room for another",
            ),
            instance_checks: r.counter(
                "instance_checks",
                "Checks of a connected P engine's instance with its side channel",
            ),
            peer_restarts: r.counter(
                "peer_restarts",
                "P engines whose side channel announced a newer instance",
            ),
            transports: Arc::clone(&transports),
            side_channel_refused: r.counter(
                "side_channel_refused",
                "Side-channel connections refused at accept (told to retry): too many handshakes at once",
            ),
            side_channel_evicted: r.counter(
                "side_channel_evicted",
                "Side-channel handshakes cut off to make room for another address's",
            ),
            http_connections_refused: r.counter(
                "http_connections_refused",
                "HTTP connections answered 503 at accept: every connection they could replace was busy",
            ),
            push_reservations: r.counter("push_reservations", "Push reservations made (D)"),
            push_write_grants: r.counter(
                "push_write_grants",
                "Remote-write grants made for push reservations (D, verbs)",
            ),
            push_reservations_active: r.gauge(
                "push_reservations_active",
                "Push reservations not yet ended (D)",
            ),
            push_legs_waiting: r.gauge(
                "push_legs_waiting",
                "Push legs waiting for free KV blocks before they reserve (D)",
            ),
            push_reservations_ended: r.family(
                "push_reservations_ended",
                "Push reservations ended, by outcome (D)",
            ),
            pushes_admitted: r.counter("pushes_admitted", "Push legs admitted (P)"),
            pushes_active: r.gauge("pushes_active", "Admitted pushes not yet ended (P)"),
            pushes_ended: r.family("pushes_ended", "Pushes ended, by outcome (P)"),
            push_writes_posted: r.counter("push_writes_posted", "Fenced push writes posted (P)"),
            push_writes_granted: r.counter(
                "push_writes_granted",
                "Push writes posted as RDMA WRITEs into D's grants (P, verbs)",
            ),
            push_writes_failed: r.counter(
                "push_writes_failed",
                "Push writes that failed to post or complete (P)",
            ),
            push_heartbeats_sent: r.counter(
                "push_heartbeats_sent",
                "KVL1:PH: reservation heartbeats sent (P)",
            ),
            http_connections_evicted: r.counter(
                "http_connections_evicted",
                "Idle HTTP connections closed to make room for a newcomer",
            ),
            registry: Arc::new(registry),
        };
        metrics.create_label_sets();
        metrics
    }

    /// Creates every labelled series at zero, so that a scrape shows each label value
    /// before its first event.
    fn create_label_sets(&self) {
        for outcome in RESERVATION_OUTCOMES {
            drop(self.push_reservation_ended(outcome));
        }
        for outcome in PUSH_OUTCOMES {
            drop(self.push_ended(outcome));
        }
        for reason in ReleaseReason::ALL {
            drop(self.leases_released.get_or_create(&ReasonLabel { reason }));
        }
        for outcome in RequestOutcome::ALL {
            drop(self.requests.get_or_create(&OutcomeLabel { outcome }));
        }
        for outcome in HandshakeOutcome::ALL {
            drop(self.handshakes.get_or_create(&HandshakeLabel { outcome }));
        }
        for backend in Backend::ALL {
            drop(self.transfers.get_or_create(&BackendLabel {
                backend: BackendName(backend),
            }));
            drop(self.read_bytes.get_or_create(&BackendLabel {
                backend: BackendName(backend),
            }));
        }
    }

    /// The counter `kvlease_leases_released_total{reason}`.
    pub fn lease_released(&self, reason: ReleaseReason) -> Counter {
        self.leases_released
            .get_or_create(&ReasonLabel { reason })
            .clone()
    }

    /// The counter `kvlease_push_reservations_ended_total{outcome}` (one of
    /// [`RESERVATION_OUTCOMES`]).
    pub fn push_reservation_ended(&self, outcome: &str) -> Counter {
        self.push_reservations_ended
            .get_or_create(&PushOutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .clone()
    }

    /// The counter `kvlease_pushes_ended_total{outcome}` (one of [`PUSH_OUTCOMES`]).
    pub fn push_ended(&self, outcome: &str) -> Counter {
        self.pushes_ended
            .get_or_create(&PushOutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .clone()
    }

    /// The counter `kvlease_requests_total{outcome}`.
    pub fn request(&self, outcome: RequestOutcome) -> Counter {
        self.requests
            .get_or_create(&OutcomeLabel { outcome })
            .clone()
    }

    /// The counter `kvlease_transfers_total{backend}`.
    pub fn transfer(&self, backend: Backend) -> Counter {
        self.transfers
            .get_or_create(&BackendLabel {
                backend: BackendName(backend),
            })
            .clone()
    }

    /// The counter `kvlease_read_bytes_total{backend}`.
    pub fn read_bytes(&self, backend: Backend) -> Counter {
        self.read_bytes
            .get_or_create(&BackendLabel {
                backend: BackendName(backend),
            })
            .clone()
    }

    /// The counter `kvlease_handshakes_total{outcome}`.
    pub fn handshake(&self, outcome: HandshakeOutcome) -> Counter {
        self.handshakes
            .get_or_create(&HandshakeLabel { outcome })
            .clone()
    }

    /// Removes `peer`'s `kvlease_peer_backend` series (D dropped the engine).
    pub fn clear_peer_backend(&self, peer: &str) {
        for backend in Backend::ALL {
            self.peer_backend.remove(&PeerBackendLabel {
                peer: peer.to_owned(),
                backend: BackendName(backend),
            });
        }
    }

    /// Records that `peer` (an engine id) is reached over `backend`: sets
    /// `kvlease_peer_backend{peer,backend}` to 1 and the other backend's series to 0.
    pub fn set_peer_backend(&self, peer: &str, backend: Backend) {
        for other in Backend::ALL {
            let label = PeerBackendLabel {
                peer: peer.to_owned(),
                backend: BackendName(other),
            };
            if other == backend {
                self.peer_backend.get_or_create(&label).set(1);
            } else {
                self.peer_backend.remove(&label);
            }
        }
    }

    /// Forgets `peer`'s `kvlease_peer_backend` series (the peer is gone).
    pub fn remove_peer(&self, peer: &str) {
        for backend in Backend::ALL {
            self.peer_backend.remove(&PeerBackendLabel {
                peer: peer.to_owned(),
                backend: BackendName(backend),
            });
        }
    }

    /// Adds a transport endpoint whose counters the scrape reads
    /// (`kvlease_notifs_dropped_total`, `kvlease_notifs_refused_total`).
    pub fn watch_transport(&self, endpoint: StatsHandle) {
        self.transports
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(endpoint);
    }

    /// Renders every metric in the OpenMetrics text format (serve it with [`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}
