//! Agent configuration.

use std::net::SocketAddr;
use std::time::Duration;

/// Default for [`Limits::max_notif_len`]: 64 KiB. Keep it equal to `kvlease-notif`'s
/// `MAX_NOTIF_LEN` (the transport does not depend on that crate; the agent passes the
/// value in).
pub const DEFAULT_MAX_NOTIF_LEN: usize = 64 * 1024;

/// Default for [`Limits::max_pending_notif_bytes`]: 16 MiB.
pub const DEFAULT_MAX_PENDING_NOTIF_BYTES: usize = 16 << 20;

/// Which backend carries reads to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Per peer: shared memory when the peer runs on the same host (same boot id and
    /// network namespace), else verbs where both sides have a usable RDMA device and the
    /// queue pair connects, else TCP (with a log line saying why).
    #[default]
    Auto,
    /// Verbs only: connecting to a peer without a usable device is an error.
    Verbs,
    /// Shared memory only: connecting to a peer on another host (or one that offers no
    /// shared memory) is an error.
    Shm,
    /// TCP only.
    Tcp,
}

/// The backend that carries a peer's reads, or that moved a batch's bytes
/// ([`BatchStats::backend`](crate::BatchStats::backend),
/// [`Agent::peer_backend`](crate::Agent::peer_backend)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// RDMA READ over an RC queue pair (the `verbs` feature).
    Verbs,
    /// The TCP backend (always built).
    Tcp,
    /// Shared memory with a peer on the same host (plain copies out of its memfd-backed
    /// regions, mapped read-only).
    Shm,
    /// Cross-memory attach with a peer on the same host (`process_vm_readv` out of its
    /// host regions that are not memfd-backed: buffers and tensors registered from
    /// Python). A link is [`Shm`](Self::Shm); a batch that read any of its bytes so is
    /// `Cma`.
    Cma,
}

impl Backend {
    /// Every backend, in the order metrics list them.
    pub const ALL: [Self; 4] = [Self::Verbs, Self::Tcp, Self::Shm, Self::Cma];

    /// The backend's name as logs and metrics write it: `"verbs"`, `"tcp"`, `"shm"` or
    /// `"cma"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Verbs => "verbs",
            Self::Tcp => "tcp",
            Self::Shm => "shm",
            Self::Cma => "cma",
        }
    }
}

/// Whether same-host peers read this agent's host memory that is not memfd-backed with
/// cross-memory attach (`process_vm_readv`), and whom this process names as its ptracer
/// for it (Yama's `ptrace_scope` 1 lets only a named process read another's memory).
///
/// Yama holds one ptracer per process: with [`LastPeer`](Self::LastPeer) and several
/// peers on this host, the one that authenticated last may read; the others' reads are
/// refused by the kernel and go over TCP (logged once per link). Without Yama (or with
/// `ptrace_scope` 0) every peer of the same user may read; with 2 only peers with
/// `CAP_SYS_PTRACE`, with 3 none. Naming a process as ptracer lets it attach to this one
/// with `ptrace`, not only read it: the kernel has no read-only grant. This process names
/// one only for an authenticated peer (it proved the cluster token), and only when it has
/// such regions to hand over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CmaPolicy {
    /// On: after a same-host peer proved the token on the shared-memory socket, this
    /// process names that peer's process (its pid as the kernel reports it for the
    /// socket, `SO_PEERCRED`) as its ptracer (`PR_SET_PTRACER`), replacing the one named
    /// before, and hands it the address and length of its registered host regions that
    /// are not memfd-backed.
    #[default]
    LastPeer,
    /// On, for several peers at once: this process lets any process of its user trace
    /// it (`PR_SET_PTRACER_ANY`). Only the addresses of registered regions are handed
    /// over, and only to authenticated peers, but under Yama scope 1 any process of the
    /// user could then attach to this one: set it only where that is acceptable.
    AnyProcess,
    /// Off: this agent hands no addresses over and reads none; such regions of a
    /// same-host peer are read over TCP.
    Off,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Sizes and timeouts that bound what a peer can make this agent do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest notification accepted or sent, in bytes. Larger ones are refused with an
    /// error (sending) or close the connection as a malformed frame (receiving), never
    /// truncated. Default [`DEFAULT_MAX_NOTIF_LEN`].
    pub max_notif_len: usize,
    /// Notifications kept until [`get_new_notifs`](crate::Agent::get_new_notifs) drains
    /// them, and the most one call returns. Notification connections are read only as
    /// far as this leaves room (the rest waits in the socket, pushing back on the
    /// sender); notifications that arrive otherwise (over a data connection, from an
    /// older peer) and do not fit are dropped and counted (`notifs_dropped_overflow`).
    /// (A same-host peer's notifications over shared memory wait in its ring instead,
    /// which its size bounds; a full ring fails the sender.) Default 65 536.
    pub max_pending_notifs: usize,
    /// Bytes of notification bodies kept until
    /// [`get_new_notifs`](crate::Agent::get_new_notifs) drains them, like
    /// [`max_pending_notifs`](Self::max_pending_notifs), so a slow engine costs at most
    /// this much memory. Must be at least [`max_notif_len`](Self::max_notif_len).
    /// Default [`DEFAULT_MAX_PENDING_NOTIF_BYTES`].
    pub max_pending_notif_bytes: usize,
    /// Bytes of notifications to one peer that wait for its socket (the peer is not
    /// polling and the socket buffers are full); a notification that does not fit is
    /// refused with [`TransferError::NotifQueueFull`](crate::TransferError::NotifQueueFull).
    /// The rest of a notification the socket took in part is always queued, so the queue
    /// may hold up to one notification more than this. Must be non-zero. Default 4 MiB.
    pub max_queued_notif_bytes: usize,
    /// Most read ops in one batch. Default 1 048 576.
    pub max_ops_per_batch: usize,
    /// Largest single read op, in bytes (larger are refused by the target). Default 1 GiB.
    pub max_read_len: u64,
    /// Ops longer than this are split into chunks striped over the peer's connections.
    /// Default 1 MiB.
    pub chunk_len: u64,
    /// Limit for TCP connect and for each step of an outbound handshake. On the serving
    /// side it is absolute: an inbound connection that has not authenticated this long
    /// after it was accepted is closed, whatever it sends meanwhile (refused reads,
    /// dropped notifications), and counted (`handshake_timeouts`). Default 5 s.
    pub handshake_timeout: Duration,
    /// Inbound connections held at once (each data connection has a thread; notification
    /// connections count too, one per link); more are closed at once with a log line.
    /// Default 1024.
    pub max_inbound_connections: usize,
    /// Inbound TCP connections held at once from one peer address (data and notification
    /// connections, authenticated or not), so that one source cannot take all of
    /// `max_inbound_connections`; more are closed at once with a log line. Default 256.
    pub max_inbound_per_address: usize,
    /// Inbound connections (TCP and shared memory, and the verbs side channel's) that have
    /// not authenticated yet, at once (each holds a thread and a descriptor until it
    /// does, or until `handshake_timeout`). A newcomer over it evicts the oldest such
    /// connection of the address holding the most ([`crate::slots::FairSlots`]), so that
    /// a few addresses cannot keep others out; one is refused only when no address holds
    /// more than it would. Default 64.
    pub max_preauth_connections: usize,
    /// Of those, from one peer address (a newcomer over it evicts that address's oldest).
    /// Default 8.
    pub max_preauth_per_address: usize,
    /// A target-side (serving) socket write that makes no progress for this long closes
    /// the connection (a reader that stopped reading). Default 30 s.
    pub serve_write_timeout: Duration,
    /// Verbs: a queue pair with reads or writes outstanding whose completion queue reports
    /// nothing for this long is reset and reconnected, and its unconfirmed work is posted
    /// again (reads and writes are idempotent), counted in `verbs_stall_resets`. The
    /// limit doubles (up to 8 times) while resets do not bring progress, so a device
    /// slower than it is not reset over and over with the same work. A healthy queue
    /// pair reports a completion at least every 64 MiB (a chain of 64 work requests of
    /// 1 MiB: 3 s on SoftRoCE under emulation); keep it below the batch timeout, so that
    /// a batch whose request the device lost still completes. Default 5 s.
    pub verbs_stall_timeout: Duration,
    /// Verbs: local ACK timeout of the queue pairs this agent connects, as the InfiniBand
    /// exponent: a request the peer has not answered is retransmitted after 4.096 µs ×
    /// 2^n, up to 6 times before the queue pair fails (and is reset). 0 waits for ever
    /// (then only `verbs_stall_timeout` ends a lost request); at most 31. Default 14
    /// (67 ms).
    pub verbs_ack_timeout: u8,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_notif_len: DEFAULT_MAX_NOTIF_LEN,
            max_pending_notifs: 1 << 16,
            max_pending_notif_bytes: DEFAULT_MAX_PENDING_NOTIF_BYTES,
            max_queued_notif_bytes: 4 << 20,
            max_ops_per_batch: 1 << 20,
            max_read_len: 1 << 30,
            chunk_len: 1 << 20,
            handshake_timeout: Duration::from_secs(5),
            max_inbound_connections: 1024,
            max_inbound_per_address: 256,
            max_preauth_connections: 64,
            max_preauth_per_address: 8,
            serve_write_timeout: Duration::from_secs(30),
            verbs_stall_timeout: Duration::from_secs(5),
            verbs_ack_timeout: 14,
        }
    }
}

/// How to build an [`Agent`](crate::Agent). Start from [`AgentConfig::new`] and set fields.
#[derive(Clone)]
#[non_exhaustive]
pub struct AgentConfig {
    /// This agent's name, as peers see it (in metadata, the handshake and notifications).
    pub name: String,
    /// Backend selection.
    pub backend: BackendChoice,
    /// TCP listen address for data and control (port 0: any free port). Default
    /// `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// Address written into the metadata, when it differs from the bound one (listening on
    /// `0.0.0.0`); port 0 means the bound port. Default: the bound address.
    pub advertise: Option<SocketAddr>,
    /// TCP data connections per peer (reads of a batch are striped over them), besides
    /// the one notification connection. Default 2.
    pub num_connections: usize,
    /// Cluster token: when set, only peers that prove it (HMAC-SHA256 challenge–response)
    /// get reads served and notifications accepted, and this agent only connects to
    /// peers that prove it back.
    pub auth_token: Option<Vec<u8>>,
    /// Cross-memory attach on the shared-memory backend. Default
    /// [`CmaPolicy::LastPeer`].
    pub cma: CmaPolicy,
    /// Bounds on peer input.
    pub limits: Limits,
}

impl AgentConfig {
    /// Defaults for an agent called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            backend: BackendChoice::Auto,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            num_connections: 2,
            auth_token: None,
            cma: CmaPolicy::default(),
            limits: Limits::default(),
        }
    }
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("name", &self.name)
            .field("backend", &self.backend)
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("num_connections", &self.num_connections)
            // Never print the token.
            .field("auth_token", &self.auth_token.as_ref().map(|_| "<set>"))
            .field("cma", &self.cma)
            .field("limits", &self.limits)
            .finish()
    }
}
