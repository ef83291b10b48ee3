//! The decode core's inputs and outputs: its configuration, the typed coordinates of a
//! request's KV on P, refusals, load errors, outcomes, read plans, notifications and
//! events.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use kvlease_lease::{BlockId, EngineId, Generation, LeaseConfig, RequestId, TrackError};
use kvlease_notif::DecodeError;

use crate::BlockSource;

/// A shell's error, kept as the typed cause of an outcome (a transport or handshake error).
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// How to build a [`DecodeCore`](super::DecodeCore).
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// This engine.
    pub engine_id: EngineId,
    /// Workers (TP ranks).
    pub tp_size: u32,
    /// Global KV heads of the model (split over the workers).
    pub num_kv_heads: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per worker pool.
    pub num_blocks: u32,
    /// Heartbeat timing.
    pub lease: LeaseConfig,
    /// Requests loading or decoding at once.
    pub max_running: u32,
    /// Waiting queue length bound.
    pub max_waiting: u32,
    /// How long a heartbeat batch for an engine still handshaking is deferred.
    pub retry: Duration,
    /// Where block ids come from: the core's own pool (default) or the serving engine.
    pub block_source: BlockSource,
    /// How the KV is spread over the TP ranks (of D and of every P): split by head
    /// (default) or replicated whole on every rank (MLA's latent cache).
    pub kv_split: KvSplit,
    /// P engines D keeps at once (handshaking or connected). A request naming another
    /// engine evicts the least recently used idle one (no request of D names it), or is
    /// refused ([`AdmitError::TooManyEngines`]) when none is idle. Default
    /// [`DEFAULT_MAX_ENGINES`].
    pub max_engines: usize,
    /// Least time between two checks of a connected P engine's instance (a request that
    /// names a newer instance than the connected one makes D ask P's side channel); a
    /// request naming a newer instance sooner is refused retryably
    /// ([`AdmitError::InstanceUnconfirmed`]). Default [`DEFAULT_INSTANCE_CHECK_INTERVAL`].
    pub instance_check_interval: Duration,
    /// Bidirectional mode: how finished turns are kept for P to pull; `None` (default)
    /// keeps none.
    pub hold: Option<super::HoldTerms>,
    /// Bidirectional mode: the fencing generation of the first held turn, then one more
    /// for each. A D that restarts should start above every generation it handed out
    /// before (the decode agent uses its instance, the wall clock in microseconds), so
    /// that P's pull with an earlier instance's params never matches a new turn held on
    /// the same blocks. Default 1.
    pub hold_first_generation: Generation,
}

/// Default for [`DecodeConfig::max_engines`].
pub const DEFAULT_MAX_ENGINES: usize = 64;
/// Default for [`DecodeConfig::instance_check_interval`].
pub const DEFAULT_INSTANCE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How a model's KV cache is spread over an engine's TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvSplit {
    /// Each rank holds `num_kv_heads / tp_size` consecutive heads: a D worker reads its
    /// heads from every P rank that holds some of them.
    #[default]
    Heads,
    /// Every rank holds the whole KV (MLA: one latent vector per token, no heads to
    /// split): each D worker reads it once, from one P rank.
    Replicated,
}

impl DecodeConfig {
    /// A config with 64 running, 1,024 waiting and a 5 ms handshake retry.
    pub fn new(
        engine_id: EngineId,
        tp_size: u32,
        num_kv_heads: u32,
        block_size: u32,
        num_blocks: u32,
        lease: LeaseConfig,
    ) -> Self {
        Self {
            engine_id,
            tp_size,
            num_kv_heads,
            block_size,
            num_blocks,
            lease,
            max_running: 64,
            max_waiting: 1024,
            retry: Duration::from_millis(5),
            block_source: BlockSource::Pool,
            kv_split: KvSplit::Heads,
            max_engines: DEFAULT_MAX_ENGINES,
            instance_check_interval: DEFAULT_INSTANCE_CHECK_INTERVAL,
            hold: None,
            hold_first_generation: Generation(std::num::NonZeroU64::MIN),
        }
    }

    /// Sets [`hold`](Self::hold): finished turns are kept for `ttl`, renewed by P's
    /// heartbeats when `symmetric` (the symmetric lease), else never.
    #[must_use]
    pub fn with_hold(mut self, ttl: kvlease_lease::DecoderTtl, symmetric: bool) -> Self {
        self.hold = Some(super::HoldTerms { ttl, symmetric });
        self
    }

    /// Sets [`hold_first_generation`](Self::hold_first_generation).
    #[must_use]
    pub fn with_hold_first_generation(mut self, first: Generation) -> Self {
        self.hold_first_generation = first;
        self
    }

    /// Sets [`max_engines`](Self::max_engines) (at least 1).
    #[must_use]
    pub fn with_max_engines(mut self, max_engines: usize) -> Self {
        self.max_engines = max_engines.max(1);
        self
    }

    /// Sets [`instance_check_interval`](Self::instance_check_interval).
    #[must_use]
    pub fn with_instance_check_interval(mut self, interval: Duration) -> Self {
        self.instance_check_interval = interval;
        self
    }

    /// Sets [`kv_split`](Self::kv_split).
    #[must_use]
    pub fn with_kv_split(mut self, split: KvSplit) -> Self {
        self.kv_split = split;
        self
    }

    /// Sets [`block_source`](Self::block_source).
    #[must_use]
    pub fn with_block_source(mut self, source: BlockSource) -> Self {
        self.block_source = source;
        self
    }

    /// Sets the running and waiting bounds.
    #[must_use]
    pub fn with_limits(mut self, max_running: u32, max_waiting: u32) -> Self {
        self.max_running = max_running.max(1);
        self.max_waiting = max_waiting;
        self
    }

    /// Sets [`retry`](Self::retry).
    #[must_use]
    pub fn with_retry(mut self, retry: Duration) -> Self {
        self.retry = retry;
        self
    }
}

/// Where a request's KV lives on P: the typed core of `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteKv {
    /// P's engine (`remote_engine_id`).
    pub engine: EngineId,
    /// P's id of the request (`remote_request_id`).
    pub request: RequestId,
    /// P's block ids, the same on every P worker.
    pub blocks: Vec<BlockId>,
    /// The lease's fencing token.
    pub generation: u64,
    /// P's TP size.
    pub tp_size: u32,
    /// Tokens P prefilled.
    pub num_tokens: u32,
    /// P's side channel (`remote_host`, `remote_port`), for the handshake.
    pub host: String,
    /// P's side-channel port.
    pub port: u16,
    /// The P instance that granted the lease (its start time in microseconds, so a
    /// restarted P has a larger one); 0 when P did not say.
    pub instance: u64,
}

impl RemoteKv {
    /// The remote coordinates.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: EngineId,
        request: RequestId,
        blocks: Vec<BlockId>,
        generation: u64,
        tp_size: u32,
        num_tokens: u32,
        host: String,
        port: u16,
    ) -> Self {
        Self {
            engine,
            request,
            blocks,
            generation,
            tp_size,
            num_tokens,
            host,
            port,
            instance: 0,
        }
    }

    /// Sets [`instance`](Self::instance).
    #[must_use]
    pub fn with_instance(mut self, instance: u64) -> Self {
        self.instance = instance;
        self
    }
}

/// Why D refused a request on arrival. Nothing is tracked; when the request named valid P
/// coordinates and P is connected, an abort frees P's lease at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The prompt is not the one P prefilled.
    #[error("P prefilled {prefilled} tokens but this prompt has {prompt}")]
    TokenCount {
        /// Tokens P prefilled.
        prefilled: u32,
        /// Tokens of this prompt.
        prompt: usize,
    },
    /// The block list does not fit the prompt.
    #[error("{got} block ids for {tokens} tokens (need {need})")]
    BlockCount {
        /// Ids given.
        got: usize,
        /// Tokens.
        tokens: usize,
        /// Ids needed.
        need: usize,
    },
    /// A P block id is outside P's pool (known after the handshake).
    #[error("block id {block} is outside P's pool of {pool} blocks")]
    BlockOutOfRange {
        /// The id.
        block: u32,
        /// P's pool size.
        pool: u32,
    },
    /// The prompt needs more blocks than D's pool has.
    #[error("{needed} blocks exceed this engine's pool of {pool}")]
    PromptTooLong {
        /// Blocks needed.
        needed: usize,
        /// D's pool.
        pool: u32,
    },
    /// P's TP size does not divide the model's heads.
    #[error("{p_tp} does not divide num_kv_heads {heads}")]
    TpSize {
        /// P's TP size.
        p_tp: u32,
        /// Heads.
        heads: u32,
    },
    /// The request (or P's lease of it) is already running here.
    #[error("request {request} is already running")]
    Duplicate {
        /// The request.
        request: RequestId,
    },
    /// The waiting queue is full.
    #[error("the waiting queue is full ({max} requests)")]
    QueueFull {
        /// The bound.
        max: u32,
    },
    /// The request names a P instance older than the one D is connected to: P restarted
    /// since it granted the lease, which is gone with the old instance. Prefill again.
    #[error(
        "engine {engine} restarted since it prefilled this request (instance {theirs}, now {current})"
    )]
    StaleInstance {
        /// P's engine.
        engine: EngineId,
        /// The instance the request names.
        theirs: u64,
        /// The instance D is connected to.
        current: u64,
    },
    /// The request names a newer instance of a connected P engine than the one D is
    /// connected to, and D asked P's side channel about its instance less than
    /// [`DecodeConfig::instance_check_interval`] ago. Only P's side channel can announce
    /// a new instance: try again later.
    #[error(
        "engine {engine} is instance {current}; the request names instance {theirs}, which \
         D checks with P's side channel at most once per {interval:?}: try again later"
    )]
    InstanceUnconfirmed {
        /// P's engine.
        engine: EngineId,
        /// The instance the request names.
        theirs: u64,
        /// The instance D is connected to.
        current: u64,
        /// [`DecodeConfig::instance_check_interval`].
        interval: Duration,
    },
    /// D keeps [`DecodeConfig::max_engines`] P engines, every one of them with requests
    /// here: none can make room for another.
    #[error("this engine keeps {max} P engines, all in use: try again later")]
    TooManyEngines {
        /// [`DecodeConfig::max_engines`].
        max: usize,
    },
    /// The heartbeat tracker refused.
    #[error(transparent)]
    Track(#[from] TrackError),
}

impl AdmitError {
    /// The `kv_transfer_params` field at fault, when there is one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::TokenCount { .. } => Some("kvlease_num_tokens"),
            Self::BlockCount { .. } | Self::BlockOutOfRange { .. } => Some("remote_block_ids"),
            Self::TpSize { .. } => Some("tp_size"),
            Self::PromptTooLong { .. }
            | Self::Duplicate { .. }
            | Self::QueueFull { .. }
            | Self::StaleInstance { .. }
            | Self::InstanceUnconfirmed { .. }
            | Self::TooManyEngines { .. }
            | Self::Track(_) => None,
        }
    }

    /// Whether the client may retry later (D is busy, not the request wrong).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::QueueFull { .. }
                | Self::StaleInstance { .. }
                | Self::InstanceUnconfirmed { .. }
                | Self::TooManyEngines { .. }
        )
    }
}

/// Why [`DecodeCore::start_load`](super::DecodeCore::start_load) refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartLoadError {
    /// The core allocates its own blocks ([`DecodeCore::poll_load`](super::DecodeCore::poll_load)).
    #[error("this decode core's blocks come from {core:?}")]
    WrongBlockSource {
        /// The core's block source.
        core: BlockSource,
    },
    /// The request is not waiting to be scheduled (unknown, loading already, or ended).
    #[error("request {request} is not waiting to be loaded")]
    NotWaiting {
        /// D's id.
        request: RequestId,
    },
    /// The handshake with the request's P engine has not finished.
    #[error("engine {engine} is not handshaken yet")]
    NotReady {
        /// P's engine.
        engine: EngineId,
    },
    /// The blocks given do not match P's blocks left to read.
    #[error("{got} blocks given for {need} blocks to load")]
    BlockCount {
        /// Blocks given.
        got: usize,
        /// P's blocks after the skipped ones (0: nothing to load).
        need: usize,
    },
}

/// Why a request's KV load failed. The request produced no output.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    /// P reclaimed the lease before D read it (an expiry notice).
    #[error("P reclaimed the lease of {request} before it was read")]
    Expired {
        /// P's id of the request.
        request: RequestId,
    },
    /// A read's fence did not match: P released the lease while D read.
    #[error("read from P worker {p_rank}: the lease was released (fence changed)")]
    Stale {
        /// The P worker.
        p_rank: u32,
    },
    /// A read failed.
    #[error("read from P worker {p_rank} failed")]
    Read {
        /// The P worker.
        p_rank: u32,
        /// The transport's error.
        #[source]
        source: Cause,
    },
    /// The reads could not be posted.
    #[error("cannot post the reads")]
    Post {
        /// The transport's error.
        #[source]
        source: Cause,
    },
    /// The bytes read did not verify.
    #[error("the KV read did not verify")]
    Verify {
        /// What did not match.
        #[source]
        source: Cause,
    },
    /// The handshake with P failed.
    #[error("handshake with engine {engine} failed")]
    Handshake {
        /// P's engine.
        engine: EngineId,
        /// Why.
        #[source]
        source: HandshakeError,
    },
    /// The connection to P was lost, or P restarted, before the KV was read.
    #[error("engine {engine} went away or restarted before the KV was read")]
    PeerLost {
        /// P's engine.
        engine: EngineId,
    },
    /// The request names a newer instance of P than P's own side channel announced when
    /// D asked it: the request's `kvlease_instance` is not P's.
    #[error(
        "engine {engine}'s side channel says it is instance {current}; the request names \
         instance {theirs}"
    )]
    UnknownInstance {
        /// P's engine.
        engine: EngineId,
        /// The instance the request names.
        theirs: u64,
        /// The instance P's side channel announced.
        current: u64,
    },
}

impl LoadError {
    /// Whether the request may be prefilled again and succeed (every load failure but a
    /// wrong cluster token and an instance P does not have).
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self,
            Self::Handshake {
                source: HandshakeError::Auth(_),
                ..
            } | Self::UnknownInstance { .. }
        )
    }
}

/// Why a handshake with a P engine failed: what the shell reports to
/// [`DecodeCore::handle_handshake`](super::DecodeCore::handle_handshake) (every variant
/// but [`TpSize`](Self::TpSize), each carrying the shell's own error), or the core's own
/// check of P's answer. The core and the shells decide by the variant; the shell's error
/// is there for the message (each variant shows it as it is, sources included).
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandshakeError {
    /// A proof was refused, ours or P's (the cluster tokens differ): retrying cannot help.
    #[error(transparent)]
    Auth(Cause),
    /// This engine's policy refuses P's address.
    #[error(transparent)]
    NotAllowed(Cause),
    /// The engine the request names is not there as named: its side channel did not
    /// answer, or answered as another engine, with a model of another shape, or with
    /// engine or worker info that does not parse.
    #[error(transparent)]
    NotFound(Cause),
    /// P answered, but its workers could not be connected (or the shell's handshake could
    /// not run at all).
    #[error(transparent)]
    Connect(Cause),
    /// Any other failure, from a shell that does not tell them apart.
    #[error(transparent)]
    Other(Cause),
    /// P's TP size does not divide the model's heads (P's answer, checked by the core;
    /// 0 would plan no read at all).
    #[error("{p_tp} does not divide num_kv_heads {heads}")]
    TpSize {
        /// P's TP size.
        p_tp: u32,
        /// Heads.
        heads: u32,
    },
}

impl HandshakeError {
    /// Whether P refused our proof, or we refused P's.
    pub fn is_auth(&self) -> bool {
        matches!(self, Self::Auth(_))
    }
}

/// How a request admitted by [`DecodeCore::on_new_request`](super::DecodeCore::on_new_request) ended. Every admitted
/// request ends in exactly one.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Decoded to the end.
    Done,
    /// The KV load failed; no output was produced.
    Failed(LoadError),
    /// The client or the operator aborted it.
    Aborted,
    /// The engine shut down.
    Shutdown,
}

/// One read batch to post: from D worker `d_worker`, read P worker `p_rank`'s part of
/// `heads` (global head numbers) of every block and layer, fenced by P's fence word of the
/// request's first block, and send `notif` to that P worker when it completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// D worker posting the batch.
    pub d_worker: u32,
    /// P worker read from.
    pub p_rank: u32,
    /// Global heads read.
    pub heads: Range<u32>,
    /// The first global head of P worker `p_rank` (`heads - p_first_head`: the heads read
    /// within P's block).
    pub p_first_head: u32,
    /// The first global head of D worker `d_worker` (`heads - d_first_head`: the heads
    /// written within D's block).
    pub d_first_head: u32,
    /// The read-completion notification for P (one consumer of the lease).
    pub notif: Vec<u8>,
}

/// A request scheduled for loading: allocate-and-read plan of
/// [`DecodeCore::poll_load`](super::DecodeCore::poll_load) (vLLM: `start_load_kv`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    /// D's id of the request.
    pub request: RequestId,
    /// D's blocks, the same on every D worker.
    pub blocks: Vec<BlockId>,
    /// Where the KV is.
    pub remote: RemoteKv,
    /// P's blocks before this index are not read (D computed them already); `blocks[i]`
    /// receives `remote.blocks[skip_blocks + i]`. Always 0 from
    /// [`DecodeCore::poll_load`](super::DecodeCore::poll_load).
    pub skip_blocks: usize,
    /// The fence every batch checks: P's word of `remote.blocks[0]` must hold this.
    pub fence_generation: u64,
    /// One entry per batch; report each with [`DecodeCore::handle_batch_done`](super::DecodeCore::handle_batch_done).
    pub batches: Vec<BatchPlan>,
}

/// How one read batch ended, reported by the shell.
#[derive(Debug, Clone)]
pub enum BatchResult {
    /// Every byte arrived under a matching fence.
    Done {
        /// Bytes moved.
        bytes: u64,
    },
    /// The fence did not match: nothing was used.
    Stale,
    /// The transport failed.
    Failed(Cause),
}

/// A notification for P, drained with [`DecodeCore::poll_transmit`](super::DecodeCore::poll_transmit): send `bytes` to every
/// worker of P engine `engine` (from D worker 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// P's engine.
    pub engine: EngineId,
    /// How many P workers to send it to.
    pub workers: u32,
    /// The encoded notification.
    pub bytes: Vec<u8>,
    /// What it is.
    pub kind: TransmitKind,
}

/// What a [`Transmit`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransmitKind {
    /// A heartbeat naming `ids` requests.
    Heartbeat {
        /// Ids in this message.
        ids: u32,
    },
    /// An abort (notify-only completion) of a lease nobody will read.
    Abort,
}

/// A handshake to start (off the engine thread): connect to P's side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeStart {
    /// P's engine.
    pub engine: EngineId,
    /// P's side-channel host.
    pub host: String,
    /// P's side-channel port.
    pub port: u16,
    /// `Some(instance)`: a check of an engine D is connected to, as `instance`, because a
    /// request named a newer one. Ask P's side channel for its info without registering
    /// again, and keep the connections D has unless P answers a newer instance than this
    /// (then register and connect as for a first handshake, and close the old
    /// connections once the core took the answer). `None`: a first handshake.
    pub check_instance: Option<u64>,
}

/// What a finished handshake learned of P.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteEngine {
    /// P's TP size.
    pub tp_size: u32,
    /// Blocks per P worker pool.
    pub num_blocks: u32,
    /// P's instance (0: P did not say).
    pub instance: u64,
}

impl RemoteEngine {
    /// What a handshake learned.
    pub fn new(tp_size: u32, num_blocks: u32) -> Self {
        Self {
            tp_size,
            num_blocks,
            instance: 0,
        }
    }

    /// Sets [`instance`](Self::instance).
    #[must_use]
    pub fn with_instance(mut self, instance: u64) -> Self {
        self.instance = instance;
        self
    }
}

/// What the core reports, drained with [`DecodeCore::poll_event`](super::DecodeCore::poll_event).
#[derive(Debug, Clone)]
pub enum DecodeEvent {
    /// Every batch of a request ended well (vLLM: `get_finished` reports it): verify the
    /// bytes in `blocks` now and report with [`DecodeCore::handle_verified`](super::DecodeCore::handle_verified) before any
    /// other input.
    Loaded {
        /// D's id.
        request: RequestId,
        /// D's blocks.
        blocks: Vec<BlockId>,
        /// Bytes moved.
        bytes: u64,
    },
    /// A handshake finished well; its engine's requests may be scheduled.
    HandshakeDone {
        /// P's engine.
        engine: EngineId,
    },
    /// The core dropped a connected P engine that no request named, to make room for
    /// another ([`DecodeConfig::max_engines`]): close its connections.
    EngineDropped {
        /// P's engine.
        engine: EngineId,
    },
    /// A request ended (answer its client).
    Finished {
        /// D's id.
        request: RequestId,
        /// How.
        outcome: Outcome,
    },
}

/// What [`DecodeCore::handle_notif`](super::DecodeCore::handle_notif) did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeNotif {
    /// An expiry notice from the engine that holds the leases: `failed` waiting requests
    /// ended in [`LoadError::Expired`].
    Expired {
        /// Leases named.
        leases: u32,
        /// Requests failed by it.
        failed: u32,
    },
    /// An expiry notice naming leases of another engine than its sender: ignored.
    Foreign,
    /// Bidirectional mode: P heartbeats D's held turns (applied by
    /// [`DecodeCore::handle_notif_at`](super::DecodeCore::handle_notif_at)).
    CacheHeartbeat(Vec<RequestId>),
    /// Bidirectional mode: P read a held turn (which
    /// [`DecodeCore::handle_notif_at`](super::DecodeCore::handle_notif_at) ends).
    CacheReadComplete(RequestId),
    /// A message D does not expect: ignored.
    Ignored,
    /// Malformed: ignored.
    Malformed(DecodeError),
}

/// Counters of a [`DecodeCore`](super::DecodeCore), cumulative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeStats {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused on arrival.
    pub refused: u64,
    /// Outcomes: done, failed, aborted.
    pub done: u64,
    /// Failed loads.
    pub failed: u64,
    /// Aborted requests.
    pub aborted: u64,
    /// Stale reads (fence mismatch).
    pub stale_reads: u64,
    /// Heartbeat messages handed out (each goes to every P worker of its engine).
    pub heartbeat_messages: u64,
    /// Ids in those messages.
    pub heartbeat_ids: u64,
    /// Heartbeat batches deferred while their engine handshakes.
    pub deferred_batches: u64,
    /// Aborts sent to P.
    pub aborts_sent: u64,
    /// Handshakes started.
    pub handshakes: u64,
    /// Expiry notices received from the engine holding the lease.
    pub expiry_notices: u64,
    /// Notifications ignored as forged (naming another engine's leases).
    pub foreign_notifs: u64,
    /// Malformed notifications.
    pub malformed_notifs: u64,
    /// Times a P engine was found restarted (its side channel announced a newer
    /// instance).
    pub peer_restarts: u64,
    /// Checks of a connected P engine's instance started (a request named a newer one).
    pub instance_checks: u64,
    /// Idle P engines dropped to make room for another.
    pub engines_evicted: u64,
    /// Bidirectional mode: finished turns kept for P.
    pub turns_held: u64,
    /// Held turns P read.
    pub turns_pulled: u64,
    /// Held turns whose deadline passed.
    pub turns_expired: u64,
    /// Held turns evicted for a new request short of blocks.
    pub turns_evicted: u64,
    /// Held turns the shell could not make readable.
    pub turns_dropped: u64,
    /// Held turns a heartbeat of P extended (the symmetric lease), one per turn named.
    pub turns_renewed: u64,
}
