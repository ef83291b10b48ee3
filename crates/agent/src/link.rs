//! The agents' use of `kvlease-transport`: building an endpoint per worker, posting fenced
//! read batches and classifying their outcome.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use kvlease_transport::{
    Agent, AgentConfig, BackendChoice, BatchStatus, Limits, LocalRange, PeerId, ReadBatch,
    RegionDesc, RegionId, TransferError,
};

use crate::metrics::Metrics;
use crate::shell::EngineError;

pub use kvlease_transport::{BatchId, ReadOp};

/// Transport settings shared by every worker of an engine.
#[derive(Clone)]
pub struct LinkConfig {
    /// Backend choice.
    pub backend: BackendChoice,
    /// IP the endpoints listen on (port chosen by the OS).
    pub listen_ip: std::net::IpAddr,
    /// IP written into the endpoints' metadata, where peers connect (`--advertise-host`).
    pub advertise_ip: std::net::IpAddr,
    /// The cluster token.
    pub auth_token: Option<String>,
    /// Bounds on peer input (`max_notif_len` is always the notif crate's limit).
    pub limits: Limits,
    /// Where each endpoint's counters are exported.
    pub metrics: Metrics,
}

impl std::fmt::Debug for LinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkConfig")
            .field("backend", &self.backend)
            .field("listen_ip", &self.listen_ip)
            .field("advertise_ip", &self.advertise_ip)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "<set>"))
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Starts one worker's endpoint, named `name` (peers see the name in notifications).
///
/// # Errors
/// [`EngineError`] when the transport refuses the config or cannot bind.
pub fn agent(cfg: &LinkConfig, name: &str) -> Result<Agent, EngineError> {
    let mut c = AgentConfig::new(name);
    c.backend = cfg.backend;
    c.listen = SocketAddr::new(cfg.listen_ip, 0);
    // Port 0: the transport advertises the port it bound.
    c.advertise = Some(SocketAddr::new(cfg.advertise_ip, 0));
    c.auth_token = cfg.auth_token.as_ref().map(|t| t.as_bytes().to_vec());
    c.limits = cfg.limits.clone();
    c.limits.max_notif_len = kvlease_notif::MAX_NOTIF_LEN;
    let agent = Agent::new(c).map_err(|e| EngineError::setup("transport endpoint", e))?;
    cfg.metrics.watch_transport(agent.stats_handle());
    Ok(agent)
}

/// The read of `local_range` of region `local` from region `remote` at `remote_offset`
/// (as many bytes as the local range holds).
pub fn read_op(
    local: &RegionDesc,
    local_range: Range<u64>,
    remote: &RegionDesc,
    remote_offset: u64,
) -> ReadOp {
    ReadOp {
        local: LocalRange {
            region: RegionId(local.id),
            offset: local_range.start,
            len: local_range.end - local_range.start,
        },
        remote: remote.at(remote_offset),
    }
}

/// The generation word read after the data.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    /// P's fence region.
    pub region: RegionDesc,
    /// The word's offset.
    pub offset: u64,
    /// The generation D was given.
    pub expected: u64,
}

/// Why a batch failed: the transport's error.
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct Failure(pub TransferError);

impl Failure {
    /// The fence word no longer matched: the lease was released (and the blocks maybe
    /// reused) during or before the read.
    pub fn is_stale(&self) -> bool {
        matches!(self.0, TransferError::FenceMismatch { .. })
    }
}

/// Where a batch stands.
#[derive(Debug, Clone)]
pub enum LinkStatus {
    /// Running.
    Pending,
    /// Done; data bytes moved.
    Done {
        /// Bytes.
        bytes: u64,
        /// The backend that moved them.
        backend: kvlease_transport::Backend,
    },
    /// Failed.
    Failed(Failure),
}

/// Posts a fenced batch to `peer`; `notif` is sent by the transport once every read and
/// the fence completed.
///
/// # Errors
/// The transport's refusal.
pub fn post_read(
    agent: &Agent,
    peer: PeerId,
    ops: Vec<ReadOp>,
    notif: Option<Vec<u8>>,
    fence: Option<Fence>,
    timeout: Duration,
) -> Result<BatchId, TransferError> {
    let batch = ReadBatch {
        ops,
        notif,
        fence: fence.map(|f| kvlease_transport::FenceRead {
            remote: f.region.at(f.offset),
            expected: f.expected,
        }),
    };
    agent.post_read(peer, batch, timeout)
}

/// Polls a batch.
pub fn poll(agent: &Agent, batch: BatchId) -> LinkStatus {
    match agent.poll_batch(batch) {
        Ok(BatchStatus::Pending) => LinkStatus::Pending,
        Ok(BatchStatus::Done(stats)) => LinkStatus::Done {
            bytes: stats.bytes,
            backend: stats.backend,
        },
        Ok(BatchStatus::Failed(e)) | Err(e) => LinkStatus::Failed(Failure(e)),
    }
}

/// The backend `peer` was connected with, as `Agent::connect` chose it; TCP for a peer
/// the agent no longer knows.
pub fn peer_backend(agent: &Agent, peer: PeerId) -> kvlease_transport::Backend {
    agent
        .peer_backend(peer)
        .map_or(kvlease_transport::Backend::Tcp, |(backend, _)| backend)
}

/// Why the transport chose `peer`'s backend (for `auto`: the reason verbs was not used).
pub fn backend_reason(agent: &Agent, peer: PeerId) -> String {
    agent
        .peer_backend(peer)
        .map_or_else(|| "unknown peer".to_owned(), |(_, why)| why)
}
