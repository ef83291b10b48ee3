//! Connecting to a peer: its metadata checked, a backend chosen (shared memory, verbs
//! or TCP) and its link made.

use std::sync::Arc;

use super::{Agent, Peer};
use crate::config::{Backend, BackendChoice};
use crate::error::{ConnectError, LinkError, TransferError};
use crate::ids::PeerId;
use crate::link::Link;
use crate::metadata::{AgentMetadata, decode_metadata};
use crate::sync::lock;
use crate::tcp;

impl Agent {
    /// Loads a peer's metadata and connects to it: `num_connections` TCP connections,
    /// each with a full handshake (protocol version, names, and with a token the mutual
    /// HMAC challenge–response). Connecting twice gives two independent peers.
    ///
    /// # Errors
    /// [`ConnectError::Metadata`] for bad metadata; [`ConnectError::Io`] when the peer is
    /// unreachable (each step is bounded by `limits.handshake_timeout`);
    /// [`ConnectError::Handshake`] for a version or name mismatch;
    /// [`ConnectError::AuthRejected`] / [`ConnectError::PeerAuthFailed`] for token
    /// mismatches; [`ConnectError::BackendUnavailable`] when [`BackendChoice::Verbs`] was
    /// asked for and cannot be used.
    pub fn connect(&self, metadata: &[u8]) -> Result<PeerId, ConnectError> {
        self.connect_keyed(metadata, None)
    }

    /// Like [`connect`](Self::connect), proving `session` (from a side-channel exchange
    /// with the peer's engine, see [`crate::Session`]) instead of the cluster token, so
    /// that the peer takes this link's notifications as the ones of the party that ran
    /// that exchange. The peer must have bound the session to this agent's name
    /// ([`bind_session`](Self::bind_session)), else it refuses the link
    /// ([`ConnectError::AuthRejected`]).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn connect_with_session(
        &self,
        metadata: &[u8],
        session: &crate::Session,
    ) -> Result<PeerId, ConnectError> {
        self.connect_keyed(metadata, Some(session))
    }

    fn connect_keyed(
        &self,
        metadata: &[u8],
        session: Option<&crate::Session>,
    ) -> Result<PeerId, ConnectError> {
        let meta = decode_metadata(metadata)?;
        // A session's key proves in the token's place.
        let key = session
            .map(crate::Session::key)
            .or(self.inner.ctx.token.as_deref());
        let (link, backend) = match self.inner.backend {
            BackendChoice::Tcp => (
                tcp::client::connect(&self.inner.ctx, &self.inner.tcp_notifs, &meta, key)?
                    as Arc<dyn Link>,
                (Backend::Tcp, LinkError::Requested(Backend::Tcp).to_string()),
            ),
            BackendChoice::Shm => {
                let tcp =
                    tcp::client::connect(&self.inner.ctx, &self.inner.tcp_notifs, &meta, key)?;
                match crate::shm::connect(&self.inner.ctx, &meta, key, Arc::clone(&tcp)) {
                    Ok(link) => (Arc::new(link) as Arc<dyn Link>, Self::shm_reason(&meta)),
                    Err(source) => {
                        tcp.close();
                        return Err(ConnectError::BackendUnavailable {
                            backend: Backend::Shm,
                            peer: meta.name,
                            source: Box::new(source),
                        });
                    }
                }
            }
            BackendChoice::Verbs | BackendChoice::Auto => {
                let tcp =
                    tcp::client::connect(&self.inner.ctx, &self.inner.tcp_notifs, &meta, key)?;
                let shm = if self.inner.backend == BackendChoice::Auto {
                    crate::shm::connect(&self.inner.ctx, &meta, key, Arc::clone(&tcp))
                } else {
                    Err(LinkError::Requested(Backend::Verbs))
                };
                match shm {
                    Ok(link) => (Arc::new(link) as Arc<dyn Link>, Self::shm_reason(&meta)),
                    Err(shm_err) => {
                        if self.inner.backend == BackendChoice::Auto {
                            tracing::debug!(peer = %meta.name, reason = %shm_err.chain(), "backend auto: shm unusable for this peer");
                        }
                        match self.connect_verbs(&meta, &tcp) {
                            Ok(link) => {
                                tracing::info!(peer = %meta.name, "backend: verbs (RDMA READ over an RC queue pair)");
                                (
                                    link,
                                    (
                                        Backend::Verbs,
                                        "both sides have a usable RDMA device and the queue pair connected"
                                            .to_owned(),
                                    ),
                                )
                            }
                            Err(source) if self.inner.backend == BackendChoice::Verbs => {
                                tcp.close();
                                return Err(ConnectError::BackendUnavailable {
                                    backend: Backend::Verbs,
                                    peer: meta.name,
                                    source: Box::new(source),
                                });
                            }
                            Err(e) => {
                                let reason = format!("{} (shm: {})", e.chain(), shm_err.chain());
                                tracing::info!(peer = %meta.name, %reason, "backend auto: verbs unusable for this peer; using TCP");
                                (tcp as Arc<dyn Link>, (Backend::Tcp, reason))
                            }
                        }
                    }
                }
            }
        };
        let id = self.inner.ctx.fresh_id();
        let peer = Arc::new(Peer {
            name: meta.name.clone(),
            meta,
            link,
            backend,
        });
        lock(&self.inner.peers).insert(id, peer);
        Ok(PeerId(id))
    }

    /// Which backend `peer` got and why (for `auto` on TCP: the reason verbs was not used,
    /// a [`LinkError`] with its causes, e.g. "this agent has no verbs backend: verbs:
    /// opening the device failed: no RDMA device: ...", followed by the reason shared
    /// memory was not, e.g. "(shm: the peer is on another host ...)").
    pub fn peer_backend(&self, peer: PeerId) -> Option<(Backend, String)> {
        lock(&self.inner.peers)
            .get(&peer.0)
            .map(|p| p.backend.clone())
    }

    fn shm_reason(meta: &AgentMetadata) -> (Backend, String) {
        tracing::info!(peer = %meta.name, "backend: shm (same host; the peer's regions mapped read-only)");
        (
            Backend::Shm,
            "the peer is on the same host and handed over its regions".to_owned(),
        )
    }

    #[cfg(feature = "verbs")]
    fn connect_verbs(
        &self,
        meta: &AgentMetadata,
        tcp: &Arc<tcp::TcpLink>,
    ) -> Result<Arc<dyn Link>, LinkError> {
        let backend = self
            .inner
            .verbs
            .as_ref()
            .map_err(|e| LinkError::NoBackend(Arc::clone(e)))?;
        let link = backend.connect(
            &self.inner.ctx.name,
            meta,
            Arc::clone(tcp),
            Arc::clone(&self.inner.ctx.counters),
        )?;
        Ok(Arc::new(link))
    }

    #[cfg(not(feature = "verbs"))]
    #[allow(clippy::unused_self, reason = "same shape as the verbs build")]
    fn connect_verbs(
        &self,
        _meta: &AgentMetadata,
        _tcp: &Arc<tcp::TcpLink>,
    ) -> Result<Arc<dyn Link>, LinkError> {
        Err(LinkError::NotBuilt)
    }

    /// Closes the connections to `peer`; its running batches fail with
    /// [`TransferError::Disconnected`].
    ///
    /// # Errors
    /// [`TransferError::UnknownPeer`].
    pub fn disconnect(&self, peer: PeerId) -> Result<(), TransferError> {
        let p = lock(&self.inner.peers)
            .remove(&peer.0)
            .ok_or(TransferError::UnknownPeer(peer))?;
        p.link.close();
        Ok(())
    }

    /// The metadata `peer` was connected with (its regions and backend entries).
    pub fn peer_metadata(&self, peer: PeerId) -> Option<AgentMetadata> {
        lock(&self.inner.peers).get(&peer.0).map(|p| p.meta.clone())
    }

    pub(super) fn peer(&self, peer: PeerId) -> Result<Arc<Peer>, TransferError> {
        lock(&self.inner.peers)
            .get(&peer.0)
            .cloned()
            .ok_or(TransferError::UnknownPeer(peer))
    }
}
