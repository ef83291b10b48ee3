//! What a backend receives from the agent: the narrow, backend-neutral state that serving
//! threads, links and notification paths share.
//!
//! A backend gets an `Arc<Context>`, never the agent itself: its name and credentials,
//! limits, the registered regions it may serve, the inbox it delivers received
//! notifications to, the counters it bumps, the inbound-connection bookkeeping and the
//! metadata entries it publishes for its peers. What belongs to one backend (the TCP
//! notification hub, the shared-memory server, the verbs domain) stays with the agent,
//! which hands it to that backend alone. This module imports no backend.

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use kvlease_gpu_mem::DmaRegion;

use crate::config::{CmaPolicy, Limits};
use crate::ids::Sender;
use crate::metadata::RegionDesc;
use crate::notify::{Groups, NotifSources, push_grouped};
use crate::sessions::Sessions;
use crate::slots::{FairSlots, PerAddress};
use crate::stats::{Counters, bump};
use crate::sync::lock;

/// A registered region and what peers know of it.
#[derive(Debug)]
pub(crate) struct Registered {
    pub(crate) region: Arc<dyn DmaRegion>,
    pub(crate) desc: RegionDesc,
}

/// The write-fence lock, striped by fence word: D's receiver holds a word's stripe from
/// its check of the word until the write's last byte landed, and
/// [`Agent::set_write_fence`](crate::Agent::set_write_fence) holds it while it stores
/// the word, so a write either landed wholly before a clear returned or lands nothing.
#[derive(Debug)]
pub(crate) struct WriteFences {
    stripes: [Mutex<()>; 64],
}

impl Default for WriteFences {
    fn default() -> Self {
        Self {
            stripes: std::array::from_fn(|_| Mutex::new(())),
        }
    }
}

impl WriteFences {
    /// Locks the stripe of the fence word at `offset` of region `region`.
    pub(crate) fn lock(&self, region: u64, offset: u64) -> MutexGuard<'_, ()> {
        // Words are 8-aligned; neighbouring slots of one table take different stripes.
        let i = (region.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (offset >> 3)) % 64;
        // `i < 64`.
        lock(&self.stripes[i as usize])
    }
}

/// Notifications received and not yet drained, grouped by sender in order of first
/// arrival.
#[derive(Debug, Default)]
struct Inbox {
    groups: Groups,
    count: usize,
    /// Bytes of the bodies in `groups` (bounded by `limits.max_pending_notif_bytes`).
    bytes: usize,
}

/// The state the agent shares with its backends and their threads.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) name: String,
    pub(crate) token: Option<Vec<u8>>,
    /// Sessions inbound connections must prove, by the group of their name.
    pub(crate) sessions: Sessions,
    pub(crate) limits: Limits,
    pub(crate) num_connections: usize,
    /// Cross-memory attach on the shared-memory backend.
    pub(crate) cma: CmaPolicy,
    pub(crate) local_addr: SocketAddr,
    pub(crate) regions: RwLock<HashMap<u64, Registered>>,
    /// The lock of the write fences (see [`WriteFences`]).
    pub(crate) write_fences: WriteFences,
    next_id: AtomicU64,
    inbox: Mutex<Inbox>,
    /// Messages in the inbox, readable without the lock (see `drain_inbox`).
    inbox_len: AtomicUsize,
    /// Where else `get_new_notifs` finds notifications (same-host peers' rings).
    pub(crate) notif_sources: NotifSources,
    pub(crate) counters: Arc<Counters>,
    pub(crate) shutdown: AtomicBool,
    /// Inbound sockets by connection id, shut down when the agent drops.
    pub(crate) inbound: Mutex<HashMap<u64, TcpStream>>,
    /// Inbound TCP connections held per peer address (`limits.max_inbound_per_address`).
    pub(crate) per_address: PerAddress,
    /// Inbound connections not authenticated yet (`limits.max_preauth_connections`).
    pub(crate) preauth: FairSlots,
    /// Backend extension entries of this agent's metadata (see `metadata`).
    backend_meta: Mutex<BTreeMap<String, serde_json::Value>>,
}

impl Context {
    /// A context with no regions, no notifications and no inbound connections.
    pub(crate) fn new(
        name: String,
        token: Option<Vec<u8>>,
        limits: Limits,
        num_connections: usize,
        cma: CmaPolicy,
        local_addr: SocketAddr,
    ) -> Self {
        Self {
            name,
            token,
            sessions: Sessions::default(),
            per_address: PerAddress::new(limits.max_inbound_per_address),
            preauth: FairSlots::new(
                limits.max_preauth_connections,
                limits.max_preauth_per_address,
            ),
            limits,
            num_connections,
            cma,
            local_addr,
            regions: RwLock::new(HashMap::new()),
            write_fences: WriteFences::default(),
            next_id: AtomicU64::new(1),
            inbox: Mutex::new(Inbox::default()),
            inbox_len: AtomicUsize::new(0),
            notif_sources: NotifSources::default(),
            counters: Arc::default(),
            shutdown: AtomicBool::new(false),
            inbound: Mutex::new(HashMap::new()),
            backend_meta: Mutex::new(BTreeMap::new()),
        }
    }

    /// A fresh id for a region, peer, batch or connection (unique within this agent).
    pub(crate) fn fresh_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sets (or with `None` removes) this agent's metadata entry for `backend`. The
    /// extension point for backends: the verbs backend stores its GID, port and QP
    /// information here and reads the peer's entry from
    /// [`AgentMetadata::backends`](crate::AgentMetadata::backends).
    pub(crate) fn set_backend_metadata(&self, backend: &str, value: Option<serde_json::Value>) {
        let mut meta = lock(&self.backend_meta);
        match value {
            Some(v) => meta.insert(backend.to_owned(), v),
            None => meta.remove(backend),
        };
    }

    /// This agent's metadata entries by backend.
    pub(crate) fn backend_metadata(&self) -> BTreeMap<String, serde_json::Value> {
        lock(&self.backend_meta).clone()
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
        push_grouped(&mut inbox.groups, from, bytes);
        drop(inbox);
        bump(&self.counters.notifs_received);
    }

    /// Takes every notification in the inbox, then drains the other notification sources
    /// into the same groups.
    pub(crate) fn drain_notifs(&self) -> Groups {
        // The fast path keeps a polling loop from starving the connection threads of the
        // inbox lock.
        let mut groups = if self.inbox_len.load(Ordering::Acquire) == 0 {
            Vec::new()
        } else {
            let mut inbox = lock(&self.inbox);
            inbox.count = 0;
            inbox.bytes = 0;
            self.inbox_len.store(0, Ordering::Release);
            std::mem::take(&mut inbox.groups)
        };
        if !self.notif_sources.is_empty() {
            self.notif_sources.drain_into(&self.counters, &mut groups);
        }
        groups
    }
}
