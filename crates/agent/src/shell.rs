//! What the prefill and decode shells share: the per-rank pool setup, the engine setup
//! error, and the peer naming and address formatting of the remote-engine handshakes.

use kvlease_gpu_mem::{BlockPool, KvLayout, MemoryRequest};
use kvlease_lease::EngineId;
use kvlease_proto::compat::KvMismatch;
use kvlease_proto::engine_info::{EngineInfo, InfoError, RegionInfo, WorkerInfo};
use kvlease_transport::{Agent, PeerId, RegionDesc};

use crate::kv::{self, KvShape, RankLayout};
use crate::sidechannel;

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A setup step failed.
    #[error("{what}: {message}")]
    Setup {
        /// The step.
        what: &'static str,
        /// The cause.
        message: String,
    },
}

impl EngineError {
    pub(crate) fn setup(what: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Setup {
            what,
            message: e.to_string(),
        }
    }
}

/// One TP rank's heads and its block pool: the setup both engines share.
///
/// # Errors
/// [`EngineError`] naming the step that failed (tp split, kv layout or block pool).
pub(crate) fn rank_pool(
    shape: KvShape,
    tp_size: u32,
    rank: u32,
    num_blocks: u32,
    memory: MemoryRequest,
) -> Result<(RankLayout, BlockPool), EngineError> {
    let heads = shape
        .heads_of_rank(tp_size, rank)
        .map_err(|e| EngineError::setup("tp split", e))?;
    let layout = RankLayout {
        shape,
        heads,
        num_blocks,
    };
    let kv_layout = KvLayout::new(
        shape.num_layers,
        num_blocks,
        layout.local_heads(),
        shape.block_size,
        shape.head_dim,
        kv::DTYPE_BYTES as u32,
    )
    .map_err(|e| EngineError::setup("kv layout", e))?;
    let pool =
        BlockPool::new(kv_layout, memory).map_err(|e| EngineError::setup("block pool", e))?;
    Ok((layout, pool))
}

/// The engine id part of a transport peer name (`{engine}/d{rank}` or `{engine}/p{rank}`):
/// its group ([`kvlease_proto::auth::name_group`]).
pub(crate) fn engine_of_peer(name: &str) -> Option<EngineId> {
    EngineId::new(kvlease_proto::auth::name_group(name)).ok()
}

/// `host:port`, with IPv6 literals in brackets.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Why a handshake with a remote engine (P for D; D for P's pulls) failed. D hands it to
/// its core as a [`HandshakeError`](kvlease_engine::HandshakeError), which is mapped to an
/// HTTP error only at the edge, in one place (`decode::errors::handshake_api`).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeFailure {
    /// P refused our proof, or we refused P's (cluster token).
    #[error(
        "unknown engine {engine}: {source} (check --auth-token / KVLEASE_AUTH_TOKEN on both sides)"
    )]
    Auth {
        /// P's engine.
        engine: EngineId,
        /// The side channel's error.
        #[source]
        source: sidechannel::HandshakeError,
    },
    /// The side channel could not be reached or failed.
    #[error("unknown engine {engine}: side channel at {addr} failed: {source}")]
    SideChannel {
        /// P's engine.
        engine: EngineId,
        /// The address tried.
        addr: String,
        /// The side channel's error.
        #[source]
        source: sidechannel::HandshakeError,
    },
    /// P's engine info did not parse, or lacks what an agent reads with.
    #[error("side channel at {addr} sent bad engine info: {source}")]
    BadInfo {
        /// The address.
        addr: String,
        /// The field at fault.
        #[source]
        source: InfoError,
    },
    /// The side channel serves another engine.
    #[error("unknown engine {engine}: the side channel at {addr} serves engine {serves}")]
    WrongEngine {
        /// The engine asked for.
        engine: EngineId,
        /// The address.
        addr: String,
        /// The engine it serves.
        serves: String,
    },
    /// P's model shape differs (the KV compatibility check of `kvlease_proto::compat`).
    #[error(
        "engine {engine} is not KV-compatible with this engine ({mismatch}): model shape \
         {theirs:?}, this engine {ours:?}"
    )]
    Shape {
        /// P's engine.
        engine: EngineId,
        /// The first dimension that differs, with P's value and ours.
        mismatch: Box<KvMismatch>,
        /// P's shape.
        theirs: KvShape,
        /// D's shape.
        ours: KvShape,
    },
    /// The remote engine's TP size differs where it must match (P's pulls).
    #[error("engine {engine} has TP size {theirs}, this engine {ours}")]
    TpSize {
        /// The remote engine.
        engine: EngineId,
        /// Its TP size.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The remote engine lists no such worker.
    #[error("engine {engine}: bad worker metadata")]
    Metadata {
        /// P's engine.
        engine: EngineId,
    },
    /// A transport connection to a P worker failed.
    #[error("cannot connect to engine {engine} worker {rank}: {source}")]
    Connect {
        /// P's engine.
        engine: EngineId,
        /// P's worker.
        rank: u32,
        /// The transport's error.
        #[source]
        source: kvlease_transport::ConnectError,
    },
    /// The remote engine announced an instance ahead of this host's clock.
    #[error("engine {engine}: {source}")]
    InstanceAhead {
        /// The remote engine.
        engine: EngineId,
        /// The instance and the clock.
        #[source]
        source: kvlease_engine::instance::InstanceAhead,
    },
    /// The P agent's address is outside `--allowed-prefill-hosts`.
    #[error("engine {engine}: {ip} is not in --allowed-prefill-hosts")]
    NotAllowed {
        /// P's engine.
        engine: EngineId,
        /// The refused address.
        ip: std::net::IpAddr,
    },
    /// The handshake thread died or could not start.
    #[error("the handshake thread died")]
    Thread,
}

impl HandshakeFailure {
    pub(crate) fn is_auth(&self) -> bool {
        matches!(self, Self::Auth { .. })
    }
}

/// This engine's side of a handshake: who it is and what its workers' transports are.
pub(crate) struct Me<'a> {
    /// The cluster token.
    pub(crate) token: Option<&'a str>,
    /// This engine's id.
    pub(crate) engine: &'a str,
    /// This engine's TP size.
    pub(crate) tp_size: u32,
    /// Each worker's transport metadata.
    pub(crate) metadata: &'a [Vec<u8>],
    /// This engine's model shape (the remote's must match).
    pub(crate) shape: KvShape,
    /// This engine's instance ([`instance_now`]).
    pub(crate) instance: u64,
}

/// A new instance number: the wall clock in microseconds, so that a restarted engine
/// (under the same engine id) has a larger one than every earlier instance.
pub(crate) fn instance_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| {
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
        })
}

/// The one remote-engine handshake: authenticates on the side channel at `addr` and checks
/// that it serves engine `want` with our model shape. Connect its workers with
/// [`connect_worker`] (D connects every worker to every P worker; P's pulls connect worker
/// i to D's worker i).
///
/// # Errors
/// [`HandshakeFailure`] naming the step that failed.
pub(crate) fn remote_engine(
    addr: &str,
    me: &Me<'_>,
    want: &EngineId,
) -> Result<PeerEngine, HandshakeFailure> {
    let welcome = sidechannel::handshake(
        addr,
        me.token,
        Some(want.as_str()),
        me.engine,
        me.tp_size,
        me.metadata,
        me.instance,
    )
    .map_err(|e| match e {
        sidechannel::HandshakeError::WrongEngine { serves, .. } => HandshakeFailure::WrongEngine {
            engine: want.clone(),
            addr: addr.to_owned(),
            serves,
        },
        e @ sidechannel::HandshakeError::Auth { .. } => HandshakeFailure::Auth {
            engine: want.clone(),
            source: e,
        },
        e => HandshakeFailure::SideChannel {
            engine: want.clone(),
            addr: addr.to_owned(),
            source: e,
        },
    })?;
    let bad = |source| HandshakeFailure::BadInfo {
        addr: addr.to_owned(),
        source,
    };
    let info = EngineInfo::from_value(&welcome.info).map_err(bad)?;
    if info.engine_id.as_str() != want.as_str() {
        return Err(HandshakeFailure::WrongEngine {
            engine: want.clone(),
            addr: addr.to_owned(),
            serves: info.engine_id.to_string(),
        });
    }
    let mut peer = PeerEngine::of(&info).map_err(bad)?;
    // Only a P that binds sessions (an agents' P with a token) takes connections proving
    // one; any other (a connector's P) takes the token.
    peer.session = welcome.session.filter(|_| info.sessions);
    if let Some(mismatch) = me.shape.mismatches(&peer.shape).into_iter().next() {
        return Err(HandshakeFailure::Shape {
            engine: want.clone(),
            mismatch: Box::new(mismatch),
            theirs: peer.shape,
            ours: me.shape,
        });
    }
    Ok(peer)
}

/// A region descriptor as the engine info carries it.
fn region_info(d: RegionDesc) -> RegionInfo {
    RegionInfo {
        id: d.id,
        base: d.base,
        len: d.len,
        key: d.key,
    }
}

/// An agent worker as its engine info describes it (P's and D's alike): rank, transport
/// metadata, pool and fence regions.
pub(crate) fn worker_info(
    rank: u32,
    metadata: Vec<u8>,
    pool: RegionDesc,
    fence: RegionDesc,
) -> WorkerInfo {
    let mut wi = WorkerInfo::new(rank, metadata, fence.id);
    wi.pool = Some(region_info(pool));
    wi.fence = Some(region_info(fence));
    wi
}

/// A remote agents' engine, as its engine info ([`EngineInfo`]) described it and this
/// engine checked it: the agents' part is there (a model shape, every worker's pool and
/// fence regions), and the workers are listed by rank.
#[derive(Debug, Clone)]
pub(crate) struct PeerEngine {
    /// Its TP size.
    pub(crate) tp_size: u32,
    /// Its model shape.
    pub(crate) shape: KvShape,
    /// Blocks per worker pool.
    pub(crate) num_blocks: u32,
    /// Its instance (0 when unsaid).
    pub(crate) instance: u64,
    /// Its workers, by rank.
    pub(crate) workers: Vec<PeerWorker>,
    /// The session of the side-channel exchange that described it (with a token): P
    /// takes the notifications of D's connections that prove it as that registration's.
    pub(crate) session: Option<kvlease_transport::Session>,
}

/// One worker of a [`PeerEngine`].
#[derive(Debug, Clone)]
pub(crate) struct PeerWorker {
    /// Its transport metadata.
    pub(crate) metadata: Vec<u8>,
    /// Its block pool region.
    pub(crate) pool: RegionDesc,
    /// Its fence words region.
    pub(crate) fence: RegionDesc,
}

impl PeerEngine {
    /// The agents' part of `info`.
    ///
    /// # Errors
    /// An [`InfoError`] naming what an agent's engine info lacks: a missing `shape`, a
    /// missing worker, or a worker without `pool` or `fence` (a vLLM connector's P).
    pub(crate) fn of(info: &EngineInfo) -> Result<Self, InfoError> {
        use kvlease_proto::engine_info::ENGINE_INFO;
        let missing = |field: String, what: &str| InfoError {
            field,
            reason: format!("missing: {what} (not a kvlease agent's engine?)"),
        };
        let shape = info
            .shape
            .ok_or_else(|| missing(format!("{ENGINE_INFO}.shape"), "the model shape"))?;
        let desc = |r: RegionInfo| RegionDesc {
            id: r.id,
            base: r.base,
            len: r.len,
            key: r.key,
        };
        let workers = (0..info.tp_size)
            .map(|rank| {
                let w = info.worker(rank).ok_or_else(|| {
                    missing(format!("{ENGINE_INFO}.workers"), &format!("worker {rank}"))
                })?;
                let at = |key| format!("{ENGINE_INFO}.workers[{rank}].{key}");
                Ok(PeerWorker {
                    metadata: w.agent_metadata.clone(),
                    pool: desc(
                        w.pool
                            .ok_or_else(|| missing(at("pool"), "the pool region"))?,
                    ),
                    fence: desc(
                        w.fence
                            .ok_or_else(|| missing(at("fence"), "the fence region"))?,
                    ),
                })
            })
            .collect::<Result<_, InfoError>>()?;
        Ok(Self {
            tp_size: info.tp_size,
            shape,
            num_blocks: info.num_blocks,
            instance: info.instance,
            workers,
            session: None,
        })
    }
}

/// Connects `agent` to worker `rank` of the remote engine `info` describes, proving
/// `session` (the side-channel exchange's, so that the remote takes this connection's
/// notifications as its registration's; the cluster token when the remote refuses it) or,
/// without one, the cluster token.
///
/// # Errors
/// [`HandshakeFailure::Metadata`] for a missing or garbled worker,
/// [`HandshakeFailure::Connect`] when the transport fails.
pub(crate) fn connect_worker(
    agent: &Agent,
    info: &PeerEngine,
    rank: u32,
    want: &EngineId,
    session: Option<&kvlease_transport::Session>,
) -> Result<PeerId, HandshakeFailure> {
    let md = info
        .workers
        .get(rank as usize)
        .map(|w| &w.metadata)
        .ok_or_else(|| HandshakeFailure::Metadata {
            engine: want.clone(),
        })?;
    match session {
        // A P that binds no session for us (its info was served by another side channel
        // than its own) refuses the session's proof: the token's is all D has then.
        Some(s) => agent.connect_with_session(md, s).or_else(|e| match e {
            kvlease_transport::ConnectError::AuthRejected { .. } => agent.connect(md),
            e => Err(e),
        }),
        None => agent.connect(md),
    }
    .map_err(|source| HandshakeFailure::Connect {
        engine: want.clone(),
        rank,
        source,
    })
}
