//! The agent: registration, metadata, peers, batches and notifications.

mod connect;
mod read;
mod types;

pub use types::{
    BatchId, BatchStats, BatchStatus, FenceRead, LocalRange, MAX_NAME_LEN, PeerId, PeerName,
    ReadBatch, ReadOp, RegionId, RemoteRange, Sender, StatsHandle, TransportStats,
};
pub(crate) use types::{Counters, bump};

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use kvlease_gpu_mem::{DmaRegion, RegionAccessError};

use crate::batch::Batch;
use crate::config::{AgentConfig, Backend, BackendChoice, Limits};
use crate::error::{AgentError, RegisterError, TransferError};
use crate::metadata::{AgentMetadata, METADATA_FORMAT, RegionDesc, encode_metadata};
use crate::tcp;

#[derive(Debug)]
pub(crate) struct Registered {
    pub(crate) region: Arc<dyn DmaRegion>,
    pub(crate) desc: RegionDesc,
}

/// Notifications received and not yet drained, grouped by sender in order of first
/// arrival.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    pub(crate) groups: crate::notify::Groups,
    pub(crate) count: usize,
    /// Bytes of the bodies in `groups` (bounded by `limits.max_pending_notif_bytes`).
    pub(crate) bytes: usize,
}

/// A posted batch and the peer it reads from.
type BatchEntry = (Arc<Batch>, Arc<Peer>);

/// The state shared by the agent and its threads.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) name: String,
    pub(crate) token: Option<Vec<u8>>,
    /// Sessions inbound connections must prove, by the group of their name.
    pub(crate) sessions: crate::sessions::Sessions,
    pub(crate) limits: Limits,
    pub(crate) num_connections: usize,
    pub(crate) backend: BackendChoice,
    /// Cross-memory attach on the shared-memory backend.
    pub(crate) cma: crate::config::CmaPolicy,
    pub(crate) local_addr: SocketAddr,
    pub(crate) advertise: SocketAddr,
    pub(crate) regions: RwLock<HashMap<u64, Registered>>,
    pub(crate) next_id: AtomicU64,
    peers: Mutex<HashMap<u64, Arc<Peer>>>,
    batches: Mutex<HashMap<u64, BatchEntry>>,
    pub(crate) inbox: Mutex<Inbox>,
    /// Messages in the inbox, readable without the lock (see `get_new_notifs`).
    inbox_len: AtomicUsize,
    /// Where else `get_new_notifs` finds notifications (same-host peers' rings).
    pub(crate) notif_sources: crate::notify::NotifSources,
    pub(crate) counters: Arc<Counters>,
    pub(crate) shutdown: AtomicBool,
    /// Inbound sockets by connection id, shut down when the agent drops.
    pub(crate) inbound: Mutex<HashMap<u64, TcpStream>>,
    /// Inbound TCP connections held per peer address (`limits.max_inbound_per_address`).
    pub(crate) per_address: crate::slots::PerAddress,
    /// Inbound connections not authenticated yet (`limits.max_preauth_connections`).
    pub(crate) preauth: crate::slots::FairSlots,
    /// Inbound TCP notification connections (read by `get_new_notifs`) and outbound
    /// notification queues waiting for their sockets.
    pub(crate) tcp_notifs: tcp::NotifHub,
    /// Backend extension entries of this agent's metadata (see `metadata`).
    backend_meta: Mutex<BTreeMap<String, serde_json::Value>>,
    /// The shared-memory backend's socket (P's side), where this agent offers one.
    shm: Mutex<Option<crate::shm::Server>>,
    /// The verbs backend, or why this agent has none.
    #[cfg(feature = "verbs")]
    pub(crate) verbs: Result<crate::verbs::link::VerbsDomain, Arc<crate::error::LinkError>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the data consistent before anything that can panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inner {
    pub(crate) fn fresh_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sets (or with `None` removes) this agent's metadata entry for `backend`. The
    /// extension point for backends: the verbs backend stores its GID, port and QP
    /// information here and reads the peer's entry from [`AgentMetadata::backends`].
    pub(crate) fn set_backend_metadata(&self, backend: &str, value: Option<serde_json::Value>) {
        let mut meta = lock(&self.backend_meta);
        match value {
            Some(v) => meta.insert(backend.to_owned(), v),
            None => meta.remove(backend),
        };
    }

    /// Whether the inbox has room for one more notification of `len` bytes.
    fn inbox_has_room(&self, inbox: &Inbox, len: usize) -> bool {
        inbox.count < self.limits.max_pending_notifs
            && inbox.bytes.saturating_add(len) <= self.limits.max_pending_notif_bytes
    }

    /// Queues a notification read by the caller's poll (a TCP notification connection)
    /// when the inbox has room. Returns false, having queued and counted nothing, when it
    /// has none: the caller keeps the bytes (and stops reading) until the inbox is
    /// drained.
    pub(crate) fn deliver_notif_if_room(&self, from: &Sender, bytes: &[u8]) -> bool {
        let inbox = lock(&self.inbox);
        if !self.inbox_has_room(&inbox, bytes.len()) {
            return false;
        }
        self.push_notif(inbox, from, bytes.to_vec());
        true
    }

    /// Queues a received notification from an authenticated peer (a serving thread's
    /// connection): one that does not fit the inbox is dropped and counted.
    pub(crate) fn deliver_notif(&self, from: &Sender, bytes: Vec<u8>) {
        let inbox = lock(&self.inbox);
        if !self.inbox_has_room(&inbox, bytes.len()) {
            let (count, held) = (inbox.count, inbox.bytes);
            drop(inbox);
            bump(&self.counters.notifs_dropped_overflow);
            tracing::warn!(
                peer = %from,
                count,
                bytes = held,
                max_count = self.limits.max_pending_notifs,
                max_bytes = self.limits.max_pending_notif_bytes,
                "notification inbox full; notification dropped"
            );
            return;
        }
        self.push_notif(inbox, from, bytes);
    }

    fn push_notif(&self, mut inbox: MutexGuard<'_, Inbox>, from: &Sender, bytes: Vec<u8>) {
        inbox.count += 1;
        inbox.bytes += bytes.len();
        self.inbox_len.store(inbox.count, Ordering::Release);
        crate::notify::push_grouped(&mut inbox.groups, from, bytes);
        drop(inbox);
        bump(&self.counters.notifs_received);
    }
}

/// A connected peer.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) name: String,
    pub(crate) meta: AgentMetadata,
    pub(crate) link: PeerLink,
    /// Which backend this peer got and why (see [`Agent::peer_backend`]).
    pub(crate) backend: (Backend, String),
}

/// The backend seam: how reads and notifications reach one peer.
///
/// A backend plugs in by adding a variant here (e.g. `Verbs(verbs::Link)` behind
/// `#[cfg(feature = "verbs")]`), and implementing, like [`tcp::TcpLink`]:
/// - `post(batch, chunks)`: start the chunks' reads; complete them through
///   [`Batch::lock`] → `chunk_done` / `fence_done` / `finish` / `fail` (see `batch.rs`),
///   performing the fence read and sending the notification in the order
///   [`crate::batch::Next`] says;
/// - `send_notif(bytes)`, `on_timeout(batch)` (stop transfers into the batch's memory),
///   `close()`;
/// - delivering received notifications with `Inner::deliver_notif` (the TCP connection is
///   always there, so a verbs link can keep notifications on it).
///
/// The selection point is `Agent::connect`: for [`BackendChoice::Auto`] it tries the
/// verbs link when both metadata carry a `"verbs"` entry and falls back to TCP with a log
/// line; `Verbs` makes that failure an error.
#[derive(Debug)]
pub(crate) enum PeerLink {
    /// The TCP backend.
    Tcp(Arc<tcp::TcpLink>),
    /// The shared-memory backend (plain copies; notifications through a shared ring; what
    /// it cannot serve on its TCP link).
    Shm(Arc<crate::shm::ShmLink>),
    /// The verbs backend (RDMA READ; notifications on its TCP link).
    #[cfg(feature = "verbs")]
    Verbs(Arc<crate::verbs::link::Link>),
}

impl PeerLink {
    fn post(&self, batch: &Arc<Batch>, chunks: Vec<tcp::Chunk>) -> Result<(), TransferError> {
        match self {
            Self::Tcp(link) => link.post(batch, chunks),
            Self::Shm(link) => link.post(batch, chunks),
            #[cfg(feature = "verbs")]
            Self::Verbs(link) => link.post(batch, chunks),
        }
    }

    fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        match self {
            Self::Tcp(link) => link.send_notif(bytes),
            Self::Shm(link) => link.send_notif(bytes),
            #[cfg(feature = "verbs")]
            Self::Verbs(link) => link.send_notif(bytes),
        }
    }

    fn on_timeout(&self, batch: &Batch) {
        match self {
            Self::Tcp(link) => link.on_timeout(batch),
            Self::Shm(link) => link.on_timeout(batch),
            #[cfg(feature = "verbs")]
            Self::Verbs(link) => link.on_timeout(batch),
        }
    }

    fn close(&self) {
        match self {
            Self::Tcp(link) => link.close(),
            Self::Shm(link) => link.close(),
            #[cfg(feature = "verbs")]
            Self::Verbs(link) => link.close(),
        }
    }

    /// Reaps completions of backends whose NIC completes reads (verbs); TCP completes
    /// on its own threads.
    fn progress(&self) {
        match self {
            Self::Tcp(_) | Self::Shm(_) => {}
            #[cfg(feature = "verbs")]
            Self::Verbs(link) => link.progress(),
        }
    }
}

/// A transfer agent: registers memory, publishes metadata, connects to peers, reads
/// their registered memory in batches and exchanges notifications with them.
///
/// Call order: [`new`](Self::new) → [`register`](Self::register) the memory peers may
/// read → hand [`metadata`](Self::metadata) to peers (out of band) → [`connect`](Self::connect)
/// with a peer's metadata → [`post_read`](Self::post_read) + [`poll_batch`](Self::poll_batch)
/// until it is no longer pending; [`send_notif`](Self::send_notif) /
/// [`get_new_notifs`](Self::get_new_notifs) at any time after `connect`.
///
/// Notifications travel over the *sender's* link: to send to a peer, connect to it (P
/// connects to D too, as NIXL agents exchange metadata both ways). Each link has a
/// notification connection of its own, which [`get_new_notifs`](Self::get_new_notifs)
/// reads on the caller's thread: poll it regularly (an engine loop's every turn), since
/// notifications wait in the socket until then, and senders to this agent get
/// [`TransferError::NotifQueueFull`] once it and their queue are full.
///
/// The TCP backend serves peers' reads on this agent's own threads (one per inbound data
/// connection, plus a listener), straight from registered memory to the socket. Dropping
/// the agent closes every connection and stops the listener.
#[derive(Debug)]
pub struct Agent {
    inner: Arc<Inner>,
    listener: Option<JoinHandle<()>>,
}

impl Agent {
    /// Binds the TCP listener and starts serving.
    ///
    /// # Errors
    /// [`AgentError::Config`] for an empty or over-long name (more than
    /// [`MAX_NAME_LEN`] bytes), zero connections or limits of zero;
    /// [`AgentError::Bind`] / [`AgentError::Thread`] when the OS refuses.
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        if config.name.is_empty() || config.name.len() > MAX_NAME_LEN {
            return Err(AgentError::Config("name must be 1..=1024 bytes"));
        }
        if config.num_connections == 0 || config.num_connections > 64 {
            return Err(AgentError::Config("num_connections must be 1..=64"));
        }
        let l = &config.limits;
        if l.max_notif_len == 0
            || l.chunk_len == 0
            || l.max_ops_per_batch == 0
            || l.max_read_len == 0
        {
            return Err(AgentError::Config("limits must be non-zero"));
        }
        if l.max_notif_len > (1 << 30) {
            return Err(AgentError::Config("max_notif_len must be at most 1 GiB"));
        }
        if l.max_pending_notifs == 0
            || l.max_inbound_connections == 0
            || l.max_inbound_per_address == 0
            || l.max_preauth_connections == 0
            || l.max_preauth_per_address == 0
            || l.max_queued_notif_bytes == 0
        {
            return Err(AgentError::Config("limits must be non-zero"));
        }
        if l.max_pending_notif_bytes < l.max_notif_len {
            return Err(AgentError::Config(
                "max_pending_notif_bytes must be at least max_notif_len",
            ));
        }
        if l.handshake_timeout.is_zero() {
            return Err(AgentError::Config("handshake_timeout must be non-zero"));
        }
        let listener = TcpListener::bind(config.listen).map_err(|source| AgentError::Bind {
            addr: config.listen,
            source,
        })?;
        let local_addr = listener.local_addr().map_err(|source| AgentError::Bind {
            addr: config.listen,
            source,
        })?;
        // An advertised port 0 stands for the port just bound.
        let advertise = match config.advertise {
            Some(a) if a.port() == 0 => SocketAddr::new(a.ip(), local_addr.port()),
            Some(a) => a,
            None => local_addr,
        };
        #[cfg(feature = "verbs")]
        let verbs = crate::verbs::link::start_for(
            &config.backend,
            &config.name,
            &config.auth_token,
            advertise.ip(),
            &config.limits,
        )
        .map_err(Arc::new);
        let inner = Arc::new(Inner {
            name: config.name,
            token: config.auth_token,
            sessions: crate::sessions::Sessions::default(),
            per_address: crate::slots::PerAddress::new(config.limits.max_inbound_per_address),
            preauth: crate::slots::FairSlots::new(
                config.limits.max_preauth_connections,
                config.limits.max_preauth_per_address,
            ),
            limits: config.limits,
            num_connections: config.num_connections,
            backend: config.backend,
            cma: config.cma,
            local_addr,
            advertise,
            regions: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            batches: Mutex::new(HashMap::new()),
            inbox: Mutex::new(Inbox::default()),
            inbox_len: AtomicUsize::new(0),
            notif_sources: crate::notify::NotifSources::default(),
            counters: Arc::default(),
            shutdown: AtomicBool::new(false),
            inbound: Mutex::new(HashMap::new()),
            tcp_notifs: tcp::NotifHub::new().map_err(AgentError::Poller)?,
            backend_meta: Mutex::new(BTreeMap::new()),
            shm: Mutex::new(None),
            #[cfg(feature = "verbs")]
            verbs,
        });
        if matches!(inner.backend, BackendChoice::Auto | BackendChoice::Shm) {
            let server = crate::shm::Server::start(&inner);
            *lock(&inner.shm) = server;
        }
        #[cfg(feature = "verbs")]
        if let Ok(v) = &inner.verbs {
            inner.set_backend_metadata("verbs", Some(v.metadata()));
        }
        let listener =
            tcp::server::spawn_listener(inner.clone(), listener).map_err(AgentError::Thread)?;
        tracing::info!(name = %inner.name, addr = %local_addr, "transport agent listening");
        Ok(Self {
            inner,
            listener: Some(listener),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The bound TCP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Registers `region` so that peers may read it, with a fresh random key.
    ///
    /// # Errors
    /// [`RegisterError::Empty`] for an empty region, [`RegisterError::Random`] when the OS
    /// random source fails.
    pub fn register(&self, region: Arc<dyn DmaRegion>) -> Result<RegionDesc, RegisterError> {
        if region.is_empty() {
            return Err(RegisterError::Empty);
        }
        let key = getrandom::u64().map_err(RegisterError::Random)?;
        let desc = RegionDesc {
            id: self.inner.fresh_id(),
            base: region.base_ptr() as u64,
            len: region.len() as u64,
            key,
        };
        tracing::debug!(id = desc.id, len = desc.len, kind = %region.kind(), "region registered");
        #[cfg(feature = "verbs")]
        if let Ok(v) = &self.inner.verbs {
            // Directly, through dmabuf, or through a host mirror; peers fall back to TCP
            // reads of a region that none of these could register.
            if let Err(e) = v.register(desc.id, region.clone()) {
                tracing::warn!(
                    id = desc.id,
                    "verbs registration failed (TCP only): {}",
                    e.chain()
                );
            }
            self.inner.set_backend_metadata("verbs", Some(v.metadata()));
        }
        if let Some(shm) = lock(&self.inner.shm).as_ref() {
            shm.grant(desc.id, region.as_ref());
        }
        self.inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(desc.id, Registered { region, desc });
        Ok(desc)
    }

    /// Makes `len` bytes at `offset` of `region` visible to peers that read it over
    /// verbs: call it after writing data that peers will read, and before telling them to
    /// read it (before publishing the fence generation that lets them read).
    ///
    /// Memory verbs cannot register directly or through dmabuf (CUDA device memory
    /// without dmabuf support, staged host memory) is served to verbs peers from a
    /// registered host mirror of the same length; this copies the range region → mirror
    /// (device → host for CUDA memory). Until then, verbs peers read the mirror's old
    /// bytes. For regions served directly (host, pinned, dmabuf-registered device
    /// memory), for regions verbs did not register at all, and on an agent without a
    /// verbs backend it only checks the range: TCP peers are always served from the
    /// region itself.
    ///
    /// # Errors
    /// [`RegisterError::Unknown`] when `region` is not registered,
    /// [`RegisterError::Range`] for a range outside it, [`RegisterError::Mirror`] when the
    /// copy fails.
    pub fn sync_for_peers(
        &self,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> Result<(), RegisterError> {
        let region_len = self
            .inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&region.0)
            .map(|r| r.desc.len)
            .ok_or(RegisterError::Unknown(region))?;
        if offset.checked_add(len).is_none_or(|end| end > region_len) {
            return Err(RegisterError::Range {
                region,
                source: RegionAccessError::OutOfBounds {
                    offset,
                    len,
                    region_len,
                },
            });
        }
        #[cfg(feature = "verbs")]
        if let Ok(v) = &self.inner.verbs {
            v.sync_out(region.0, offset, len)
                .map_err(|source| RegisterError::Mirror { region, source })?;
        }
        Ok(())
    }

    /// Whether verbs peers read `region` from a host mirror (so that writes to it reach
    /// them only through [`sync_for_peers`](Self::sync_for_peers)). False without a verbs
    /// backend.
    pub fn is_mirrored(&self, region: RegionId) -> bool {
        #[cfg(feature = "verbs")]
        if let Ok(v) = &self.inner.verbs {
            return v.is_mirrored(region.0);
        }
        let _ = region;
        false
    }

    /// Removes a registration: later reads of it are refused (reads being served right
    /// now finish; they hold their own reference to the memory). Same-host peers that
    /// mapped the region over shared memory refuse batches that read it posted from now
    /// on (copies already running finish; their mapping keeps the pages).
    ///
    /// # Errors
    /// [`RegisterError::Unknown`] when `id` is not registered.
    pub fn deregister(&self, id: RegionId) -> Result<(), RegisterError> {
        #[cfg(feature = "verbs")]
        if let Ok(v) = &self.inner.verbs {
            v.deregister(id.0);
            self.inner.set_backend_metadata("verbs", Some(v.metadata()));
        }
        self.inner
            .regions
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id.0)
            .ok_or(RegisterError::Unknown(id))?;
        // Same-host peers that mapped the region refuse to read it from now on.
        if let Some(shm) = lock(&self.inner.shm).as_ref() {
            shm.revoke(id.0);
        }
        Ok(())
    }

    /// This agent's metadata (versioned JSON, see [`crate::metadata`]): name, TCP
    /// address, whether a token is required, registered regions with keys, and backend
    /// entries. Regions registered later need a fresh copy.
    pub fn metadata(&self) -> Vec<u8> {
        let mut regions: Vec<RegionDesc> = self
            .inner
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|r| r.desc)
            .collect();
        regions.sort_by_key(|r| r.id);
        encode_metadata(&AgentMetadata {
            format: METADATA_FORMAT,
            name: self.inner.name.clone(),
            tcp_addr: self.inner.advertise.to_string(),
            auth: self.inner.token.is_some(),
            regions,
            backends: lock(&self.inner.backend_meta).clone(),
        })
    }

    /// Sends a notification to `peer` (over the link's notification connection), without
    /// blocking: what the socket does not take now waits in the link's queue, written on
    /// by the next send to `peer` or this agent's next
    /// [`get_new_notifs`](Self::get_new_notifs).
    ///
    /// Ordering: notifications to one peer (this call and batch notifications) arrive in
    /// the order they were handed to the connection, as long as that connection lives;
    /// there is no order across peers. A batch's notification is handed over when the
    /// batch completes. Delivery is not guaranteed when the connection breaks.
    ///
    /// # Errors
    /// [`TransferError::UnknownPeer`]; [`TransferError::NotifTooLarge`] over
    /// `limits.max_notif_len` (never truncated); [`TransferError::NotifQueueFull`] when
    /// the peer has not been reading and `limits.max_queued_notif_bytes` already wait
    /// (nothing is sent); [`TransferError::Disconnected`].
    pub fn send_notif(&self, peer: PeerId, bytes: Vec<u8>) -> Result<(), TransferError> {
        let p = self.peer(peer)?;
        if bytes.len() > self.inner.limits.max_notif_len {
            return Err(TransferError::NotifTooLarge {
                peer: p.name.clone(),
                len: bytes.len(),
                max: self.inner.limits.max_notif_len,
            });
        }
        p.link.send_notif(bytes)
    }

    /// Drains the notifications received since the last call, grouped by sender (in
    /// order of each sender's first message; each group in arrival order). Only peers
    /// that completed the handshake are heard; others' notifications are dropped and
    /// counted. [`get_new_notifs_from`](Self::get_new_notifs_from) also says which
    /// session each sender proved.
    pub fn get_new_notifs(&self) -> Vec<(PeerName, Vec<Vec<u8>>)> {
        self.get_new_notifs_from()
            .into_iter()
            .map(|(from, msgs)| (from.name, msgs))
            .collect()
    }

    /// Like [`get_new_notifs`](Self::get_new_notifs), with each sender's session: a
    /// sender is a name and the session its connection proved (two connections under one
    /// name with different sessions are two senders).
    ///
    /// This call reads the TCP notification connections itself (non-blocking; one
    /// `epoll_wait(0)` when none has anything, whatever the number of peers), taking at
    /// most `limits.max_pending_notifs` notifications and
    /// `limits.max_pending_notif_bytes` bytes; the rest waits for the next call. It also
    /// writes on this agent's own queued notifications. Notifications from a peer on the
    /// same host that connected over shared memory are read here too, from that peer's
    /// ring (no system call when nothing arrived).
    pub fn get_new_notifs_from(&self) -> Vec<(Sender, Vec<Vec<u8>>)> {
        // TCP notification connections are read here, on the caller's thread (no thread
        // hand-off per message; one `epoll_wait(0)` when none has anything), and this
        // agent's queued notifications are written on.
        self.inner.tcp_notifs.poll(&self.inner);
        // The fast path keeps a polling loop from starving the connection threads of the
        // inbox lock.
        let mut groups = if self.inner.inbox_len.load(Ordering::Acquire) == 0 {
            Vec::new()
        } else {
            let mut inbox = lock(&self.inner.inbox);
            inbox.count = 0;
            inbox.bytes = 0;
            self.inner.inbox_len.store(0, Ordering::Release);
            std::mem::take(&mut inbox.groups)
        };
        if !self.inner.notif_sources.is_empty() {
            self.inner
                .notif_sources
                .drain_into(&self.inner, &mut groups);
        }
        groups
    }

    /// Binds `session` to the peer group `group` (see [`crate::Session`] and the module
    /// `sessions`): from now on an inbound connection whose name's group
    /// ([`name_group`](kvlease_proto::auth::name_group): before its last `/`) is `group`
    /// must prove the session's key instead of the cluster token, or is
    /// refused (counted in [`TransportStats::session_refusals`], logged at warn). It
    /// replaces the group's earlier session; connections made under that one stay open,
    /// and their notifications carry its id ([`Sender::session`]). No effect on an agent
    /// without a token.
    pub fn bind_session(&self, group: &str, session: crate::Session) {
        if self.inner.token.is_some() {
            self.inner.sessions.bind(group, session);
        }
    }

    /// Removes `group`'s session (its names prove the token again); whether it had one.
    pub fn unbind_session(&self, group: &str) -> bool {
        self.inner.sessions.unbind(group)
    }

    /// This agent's counters.
    pub fn stats(&self) -> TransportStats {
        self.inner.counters.snapshot()
    }

    /// A handle that reads this agent's counters, for a metrics exporter that does not
    /// own the agent.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle {
            counters: Arc::clone(&self.inner.counters),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        // Wake the listener's `accept` so that it sees the flag.
        let wake = if self.inner.local_addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.inner.local_addr.port()))
        } else {
            self.inner.local_addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(h) = self.listener.take()
            && h.join().is_err()
        {
            tracing::error!("transport listener thread panicked");
        }
        if let Some(mut server) = lock(&self.inner.shm).take() {
            server.stop();
        }
        for (_, peer) in lock(&self.inner.peers).drain() {
            peer.link.close();
        }
        for (_, s) in lock(&self.inner.inbound).drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.inner.tcp_notifs.close();
    }
}
