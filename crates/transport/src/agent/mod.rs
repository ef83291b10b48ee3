//! The agent: registration, metadata, peers, batches and notifications. It owns the
//! backends' shared [`Context`] and hands each backend only that and its own state.

mod connect;
mod read;
mod write;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use kvlease_gpu_mem::{DmaRegion, RegionAccessError};

use crate::batch::Batch;
use crate::config::{AgentConfig, Backend, BackendChoice};
use crate::context::{Context, Registered};
use crate::error::{AgentError, RegisterError, TransferError};
use crate::ids::{MAX_NAME_LEN, PeerId, PeerName, RegionId, Sender};
use crate::link::Link;
use crate::metadata::{AgentMetadata, METADATA_FORMAT, RegionDesc, encode_metadata};
use crate::stats::{StatsHandle, TransportStats};
use crate::sync::lock;
use crate::tcp;

/// A posted batch and the peer it reads from.
type BatchEntry = (Arc<Batch>, Arc<Peer>);

/// The agent's state: the context its backends share, and what only the agent touches
/// (peers, batches, each backend's own state).
#[derive(Debug)]
struct Inner {
    ctx: Arc<Context>,
    advertise: SocketAddr,
    backend: BackendChoice,
    peers: Mutex<HashMap<u64, Arc<Peer>>>,
    batches: Mutex<HashMap<u64, BatchEntry>>,
    /// Inbound TCP notification connections (read by `get_new_notifs`) and outbound
    /// notification queues waiting for their sockets.
    tcp_notifs: Arc<tcp::NotifHub>,
    /// The shared-memory backend's socket (P's side), where this agent offers one.
    shm: Mutex<Option<crate::shm::Server>>,
    /// The verbs backend, or why this agent has none.
    #[cfg(feature = "verbs")]
    verbs: Result<crate::verbs::link::VerbsDomain, Arc<crate::error::LinkError>>,
}

/// A connected peer.
#[derive(Debug)]
struct Peer {
    name: String,
    meta: AgentMetadata,
    /// The backend seam: how reads and notifications reach this peer (see
    /// [`Link`]). `Agent::connect` picks the backend: for [`BackendChoice::Auto`] shared
    /// memory, then verbs when both metadata carry a `"verbs"` entry, then TCP.
    link: Arc<dyn Link>,
    /// Which backend this peer got and why (see [`Agent::peer_backend`]).
    backend: (Backend, String),
}

/// A transfer agent: registers memory, publishes metadata, connects to peers, reads
/// their registered memory in batches and exchanges notifications with them.
///
/// Call order: [`new`](Self::new) → [`register`](Self::register) the memory peers may
/// read → hand [`metadata`](Self::metadata) to peers (out of band) → [`connect`](Self::connect)
/// with a peer's metadata → [`post_read`](Self::post_read) + [`poll_batch`](Self::poll_batch)
/// until it is no longer pending; [`send_notif`](Self::send_notif) /
/// [`get_new_notifs`](Self::get_new_notifs) at any time after `connect`. Push mode: the
/// receiver publishes a generation with [`set_write_fence`](Self::set_write_fence), the
/// writer [`post_write`](Self::post_write)s under it and polls as for reads.
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
    inner: Inner,
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
        if l.verbs_stall_timeout.is_zero() {
            return Err(AgentError::Config("verbs_stall_timeout must be non-zero"));
        }
        if l.verbs_ack_timeout > 31 {
            return Err(AgentError::Config(
                "verbs_ack_timeout is a 5-bit exponent: at most 31",
            ));
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
        let ctx = Arc::new(Context::new(
            config.name,
            config.auth_token,
            config.limits,
            config.num_connections,
            config.cma,
            local_addr,
        ));
        let inner = Inner {
            ctx,
            advertise,
            backend: config.backend,
            peers: Mutex::new(HashMap::new()),
            batches: Mutex::new(HashMap::new()),
            tcp_notifs: Arc::new(tcp::NotifHub::new().map_err(AgentError::Poller)?),
            shm: Mutex::new(None),
            #[cfg(feature = "verbs")]
            verbs,
        };
        if matches!(inner.backend, BackendChoice::Auto | BackendChoice::Shm) {
            let server = crate::shm::Server::start(&inner.ctx);
            *lock(&inner.shm) = server;
        }
        #[cfg(feature = "verbs")]
        if let Ok(v) = &inner.verbs {
            inner.ctx.set_backend_metadata("verbs", Some(v.metadata()));
        }
        let listener = tcp::server::spawn_listener(
            Arc::clone(&inner.ctx),
            Arc::clone(&inner.tcp_notifs),
            listener,
        )
        .map_err(AgentError::Thread)?;
        tracing::info!(name = %inner.ctx.name, addr = %local_addr, "transport agent listening");
        Ok(Self {
            inner,
            listener: Some(listener),
        })
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.inner.ctx.name
    }

    /// The bound TCP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.ctx.local_addr
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
            id: self.inner.ctx.fresh_id(),
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
            self.inner
                .ctx
                .set_backend_metadata("verbs", Some(v.metadata()));
        }
        if let Some(shm) = lock(&self.inner.shm).as_ref() {
            shm.grant(desc.id, region.as_ref());
        }
        self.inner
            .ctx
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
            .ctx
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
            self.inner
                .ctx
                .set_backend_metadata("verbs", Some(v.metadata()));
        }
        self.inner
            .ctx
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
            .ctx
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|r| r.desc)
            .collect();
        regions.sort_by_key(|r| r.id);
        encode_metadata(&AgentMetadata {
            format: METADATA_FORMAT,
            name: self.inner.ctx.name.clone(),
            tcp_addr: self.inner.advertise.to_string(),
            auth: self.inner.ctx.token.is_some(),
            regions,
            backends: self.inner.ctx.backend_metadata(),
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
        if bytes.len() > self.inner.ctx.limits.max_notif_len {
            return Err(TransferError::NotifTooLarge {
                peer: p.name.clone(),
                len: bytes.len(),
                max: self.inner.ctx.limits.max_notif_len,
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
        self.inner.tcp_notifs.poll(&self.inner.ctx);
        self.inner.ctx.drain_notifs()
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
        if self.inner.ctx.token.is_some() {
            self.inner.ctx.sessions.bind(group, session);
        }
    }

    /// Removes `group`'s session (its names prove the token again); whether it had one.
    pub fn unbind_session(&self, group: &str) -> bool {
        self.inner.ctx.sessions.unbind(group)
    }

    /// This agent's counters.
    pub fn stats(&self) -> TransportStats {
        self.inner.ctx.counters.snapshot()
    }

    /// A handle that reads this agent's counters, for a metrics exporter that does not
    /// own the agent.
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle {
            counters: Arc::clone(&self.inner.ctx.counters),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.inner.ctx.shutdown.store(true, Ordering::SeqCst);
        // Wake the listener's `accept` so that it sees the flag.
        let wake = if self.inner.ctx.local_addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.inner.ctx.local_addr.port()))
        } else {
            self.inner.ctx.local_addr
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
        for (_, s) in lock(&self.inner.ctx.inbound).drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.inner.tcp_notifs.close();
    }
}
