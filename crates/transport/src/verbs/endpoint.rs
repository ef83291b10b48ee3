//! One RC queue pair to one peer: batched RDMA READs, SEND/RECV notifications, recovery.

use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid as RawGid};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairAttributeMask,
    QueuePairState, QueuePairType, SetScatterGatherEntry, WorkRequestFlags,
};

use super::device::{Gid, mtu_bytes};
use super::memory::HeapBuffer;
use super::{MemoryRegion, ProtectionDomain, VerbsError, WorkCompletionStatus, drop_guarded};

/// Receive work requests carry this bit in their `wr_id`; send-queue ones never do.
const RECV_BIT: u64 = 1 << 63;
/// How many empty polls teardown and recovery wait for flushed completions before they
/// reset the queue pair anyway (a reset stops all DMA, so this only bounds the wait).
const DRAIN_POLLS: u32 = 200_000;
/// Wire format version tag of [`ConnectionInfo`].
const INFO_MAGIC: [u8; 4] = *b"KVV1";
/// Encoded length of [`ConnectionInfo`].
const INFO_LEN: usize = 40;

/// Tuning of an [`Endpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointConfig {
    /// RDMA READ work requests in flight at most (the send queue's read share).
    pub max_outstanding_reads: u32,
    /// Request a completion at least every this many work requests (selective signalling;
    /// the last work request of each chain and of each batch is always signalled).
    pub signal_every: u32,
    /// Work requests chained into one `ibv_post_send` (one doorbell), at most half of
    /// `max_outstanding_reads`; while reads are in flight, queued reads are posted only in
    /// whole chains (see `post_pending`).
    pub wrs_per_doorbell: u32,
    /// Reads longer than this are split into several work requests.
    pub max_wr_bytes: u32,
    /// Size of one notification slot: the largest notification, in bytes.
    pub notif_slot_size: u32,
    /// Receive slots kept posted.
    pub recv_slots: u32,
    /// Send slots (notifications in flight at most).
    pub send_slots: u32,
    /// Notifications queued while the endpoint cannot send, at most.
    pub max_queued_notifs: u32,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            max_outstanding_reads: 128,
            signal_every: 64,
            wrs_per_doorbell: 64,
            max_wr_bytes: 1 << 20,
            notif_slot_size: 4096,
            recv_slots: 64,
            send_slots: 32,
            max_queued_notifs: 4096,
        }
    }
}

/// A peer's region as its metadata describes it: address on the peer, length, rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    addr: u64,
    len: u64,
    rkey: u32,
}

impl RemoteRegion {
    /// A region of `len` bytes at `addr` on the peer, readable with `rkey`.
    pub fn new(addr: u64, len: u64, rkey: u32) -> Self {
        Self { addr, len, rkey }
    }
    /// Address on the peer.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

/// One read: `len` bytes from `remote` at `remote_offset` into `local` at `local_offset`.
#[derive(Debug, Clone)]
pub struct ReadOp {
    /// Destination (registered in the endpoint's protection domain).
    pub local: MemoryRegion,
    /// Offset in `local`.
    pub local_offset: u64,
    /// Source on the peer.
    pub remote: RemoteRegion,
    /// Offset in `remote`.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a peer needs to connect its queue pair to ours; exchanged over the caller's TCP
/// side channel (see [`encode`](Self::encode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Source GID (RoCE v2).
    pub gid: Gid,
    /// Active MTU as an `ibv_mtu` value (1 = 256 … 5 = 4096).
    pub mtu: u8,
    /// RDMA READs this side serves in parallel per queue pair (`max_qp_rd_atom`).
    pub max_rd_atom: u8,
    /// Size of this side's receive slots: the largest notification it accepts.
    pub notif_slot_size: u32,
    /// Receive slots this side keeps posted.
    pub recv_slots: u32,
}

impl ConnectionInfo {
    /// The fixed 40-byte wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(INFO_LEN);
        out.extend_from_slice(&INFO_MAGIC);
        out.extend_from_slice(&self.qpn.to_be_bytes());
        out.extend_from_slice(&self.psn.to_be_bytes());
        out.extend_from_slice(&self.gid.0);
        out.push(self.mtu);
        out.push(self.max_rd_atom);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.notif_slot_size.to_be_bytes());
        out.extend_from_slice(&self.recv_slots.to_be_bytes());
        out
    }

    /// Parses the wire form; peer input, so every field is checked.
    ///
    /// # Errors
    /// [`VerbsError::BadConnectionInfo`] for a wrong length, version, MTU, PSN or slot size.
    pub fn decode(bytes: &[u8]) -> Result<Self, VerbsError> {
        let bad = |reason| VerbsError::BadConnectionInfo { reason };
        if bytes.len() != INFO_LEN {
            return Err(bad("length is not 40 bytes"));
        }
        if bytes[..4] != INFO_MAGIC {
            return Err(bad("unknown version tag"));
        }
        let u32_at = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&bytes[i..i + 4]);
            u32::from_be_bytes(b)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[12..28]);
        let info = Self {
            qpn: u32_at(4),
            psn: u32_at(8),
            gid: Gid(gid),
            mtu: bytes[28],
            max_rd_atom: bytes[29],
            notif_slot_size: u32_at(32),
            recv_slots: u32_at(36),
        };
        if info.qpn == 0 || info.qpn > 0x00ff_ffff {
            return Err(bad("queue pair number is not 24-bit non-zero"));
        }
        if info.psn > 0x00ff_ffff {
            return Err(bad("PSN is wider than 24 bits"));
        }
        if !(1..=5).contains(&info.mtu) {
            return Err(bad("MTU is not an ibv_mtu value"));
        }
        if info.notif_slot_size == 0 || info.recv_slots == 0 {
            return Err(bad("no notification slots"));
        }
        Ok(info)
    }
}

/// Where an endpoint is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointState {
    /// Created; waiting for the peer's [`ConnectionInfo`] ([`Endpoint::connect`]).
    Init,
    /// Connected: reads and notifications flow.
    Connected,
    /// The queue pair failed and was reset; exchange [`Endpoint::local_info`] with the
    /// peer again (it must [`Endpoint::reset`] too) and [`Endpoint::connect`]. Batches and
    /// notifications posted meanwhile wait.
    NeedsReconnect,
    /// Closed.
    Closed,
}

/// Identifies a posted batch on its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(u64);

/// How a batch stands.
#[derive(Debug)]
#[non_exhaustive]
pub enum BatchStatus {
    /// Work requests are queued or in flight.
    Pending,
    /// Every read completed; its bytes are in the destination.
    Done,
    /// It failed; its other reads were cancelled.
    Failed(VerbsError),
}

/// A piece of a read, at most `max_wr_bytes`: one work request.
#[derive(Debug)]
struct Chunk {
    batch: u64,
    /// Keeps the destination registered and alive until the completion is reaped.
    local: MemoryRegion,
    local_addr: u64,
    remote_addr: u64,
    rkey: u32,
    len: u32,
    fence: bool,
}

/// A posted send-queue work request, in post order (= completion order on an RC QP).
#[derive(Debug)]
struct Posted {
    wr_id: u64,
    what: PostedKind,
}

#[derive(Debug)]
enum PostedKind {
    Read(Chunk),
    Send { slot: u32, len: u32 },
}

#[derive(Debug, Default)]
struct Batch {
    remaining: usize,
    failed: Option<VerbsError>,
    notif: Option<Vec<u8>>,
}

/// A notification ring: one registered buffer cut into equal slots.
#[derive(Debug)]
struct Ring {
    // Drop order: the registration holds an Arc of the buffer; `buf` is our handle for
    // CPU access.
    mr: MemoryRegion,
    buf: Arc<HeapBuffer>,
    slot: u32,
    slots: u32,
}

impl Ring {
    fn new(pd: &ProtectionDomain, slot: u32, slots: u32) -> Result<Self, VerbsError> {
        let len = slot as usize * slots as usize;
        let buf = Arc::new(HeapBuffer::new(len).ok_or(VerbsError::Register {
            device: pd.device().name().to_owned(),
            len,
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?);
        let mr = pd.register(Arc::clone(&buf) as _)?;
        Ok(Self {
            mr,
            buf,
            slot,
            slots,
        })
    }

    fn offset(&self, slot: u32) -> usize {
        slot as usize * self.slot as usize
    }

    fn addr(&self, slot: u32) -> u64 {
        self.mr.remote().addr() + self.offset(slot) as u64
    }
}

/// One RC queue pair to one peer, with its completion queue, the in-flight table and the
/// notification rings.
///
/// Call order: [`new`](Self::new) → exchange [`local_info`](Self::local_info) with the
/// peer → [`connect`](Self::connect) → [`post_read_batch`](Self::post_read_batch) /
/// [`send_notif`](Self::send_notif), and [`poll`](Self::poll) from the caller's loop, which
/// reaps completions, posts queued work and delivers [`take_notifs`](Self::take_notifs).
/// After a queue pair error the state is [`EndpointState::NeedsReconnect`]: both sides
/// [`reset`](Self::reset), exchange infos again and [`connect`](Self::connect).
///
/// Notifications from one endpoint arrive in the order they were sent. After a queue
/// pair error, notifications whose send was not confirmed are sent again after the
/// reconnect (at-least-once; duplicates are possible, losses are not).
pub struct Endpoint {
    // Drop runs `teardown` (QP to ERR, drain, destroy) before any field drops. Then, in
    // declaration order: the in-flight table (Arcs of destination MRs; the QP is gone, so
    // the NIC no longer touches them), the rings (deregistered, then freed), the CQ, the PD.
    qp: Option<BasicQueuePair>,
    send_q: VecDeque<Posted>,
    pending: VecDeque<Chunk>,
    recv: Ring,
    send: Ring,
    /// ManuallyDrop: Drop destroys it through `drop_guarded` after the QP, because
    /// sideway's CQ destructor asserts (and would panic if the QP were still alive).
    cq: ManuallyDrop<Arc<BasicCompletionQueue>>,
    pd: ProtectionDomain,

    config: EndpointConfig,
    state: EndpointState,
    qpn: u32,
    psn: u32,
    remote: Option<ConnectionInfo>,
    /// Largest notification the peer accepts (its slot size), once connected.
    peer_slot: u32,
    next_wr_id: u64,
    next_batch: u64,
    epoch: u64,
    reads_in_flight: u32,
    /// Highest send-queue wr_id the CQ reported (any status).
    last_reported: u64,
    unsignaled: u32,
    recv_posted: u32,
    free_send: Vec<u32>,
    batches: HashMap<u64, Batch>,
    queued_notifs: VecDeque<Vec<u8>>,
    notifs_in: VecDeque<Vec<u8>>,
    errors: u64,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("device", &self.pd.device().name())
            .field("qpn", &self.qpn)
            .field("state", &self.state)
            .field("reads_in_flight", &self.reads_in_flight)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Creates the completion queue, the queue pair (moved to INIT, receive ring posted)
    /// and the notification rings.
    ///
    /// # Errors
    /// [`VerbsError::Device`] / [`VerbsError::QueuePair`] when a verbs call fails;
    /// registration errors of the rings.
    pub fn new(pd: &ProtectionDomain, config: EndpointConfig) -> Result<Self, VerbsError> {
        let mut config = config;
        let dev = &pd.device().inner;
        let cap = dev.max_qp_wr.max(16);
        config.max_outstanding_reads = config.max_outstanding_reads.clamp(1, cap / 2);
        config.send_slots = config.send_slots.clamp(1, cap / 2);
        config.recv_slots = config.recv_slots.clamp(1, cap);
        config.signal_every = config.signal_every.max(1);
        config.wrs_per_doorbell = config.wrs_per_doorbell.max(1);
        config.max_wr_bytes = config.max_wr_bytes.max(1);
        config.notif_slot_size = config.notif_slot_size.max(1);
        let send_depth = config.max_outstanding_reads + config.send_slots;
        let cqe = send_depth + config.recv_slots + 16;
        let cq = dev
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .build()
            .map_err(|e| VerbsError::Device {
                device: dev.name.clone(),
                op: "ibv_create_cq",
                source: Box::new(e),
            })?;
        let qp = pd
            .inner
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(send_depth)
            .setup_max_recv_wr(config.recv_slots)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .build()
            .map_err(|e| VerbsError::QueuePair {
                qpn: 0,
                op: "ibv_create_qp",
                source: Box::new(e),
            })?;
        let recv = Ring::new(pd, config.notif_slot_size, config.recv_slots)?;
        let send = Ring::new(pd, config.notif_slot_size, config.send_slots)?;
        let qpn = qp.qp_number();
        let mut ep = Self {
            qp: Some(qp),
            send_q: VecDeque::new(),
            pending: VecDeque::new(),
            free_send: (0..config.send_slots).rev().collect(),
            recv,
            send,
            cq: ManuallyDrop::new(cq),
            pd: pd.clone(),
            state: EndpointState::Init,
            qpn,
            psn: 0,
            remote: None,
            peer_slot: 0,
            next_wr_id: 1,
            next_batch: 1,
            epoch: 0,
            reads_in_flight: 0,
            last_reported: 0,
            unsignaled: 0,
            recv_posted: 0,
            batches: HashMap::new(),
            queued_notifs: VecDeque::new(),
            notifs_in: VecDeque::new(),
            errors: 0,
            config,
        };
        ep.enter_init()?;
        Ok(ep)
    }

    /// This side's connection info for the peer (fresh PSN after each reset).
    pub fn local_info(&self) -> ConnectionInfo {
        let dev = &self.pd.device().inner;
        ConnectionInfo {
            qpn: self.qpn,
            psn: self.psn,
            gid: dev.gid,
            mtu: dev.active_mtu,
            max_rd_atom: dev.max_qp_rd_atom.max(1),
            notif_slot_size: self.config.notif_slot_size,
            recv_slots: self.config.recv_slots,
        }
    }

    /// The state.
    pub fn state(&self) -> EndpointState {
        self.state
    }

    /// The local queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Queue pair errors seen (each one reset the queue pair).
    pub fn errors(&self) -> u64 {
        self.errors
    }

    /// The configuration in force (after clamping to the device's limits).
    pub fn config(&self) -> &EndpointConfig {
        &self.config
    }

    /// The queue pair's state as the device reports it (`ibv_query_qp`; the cached value
    /// in `ibv_qp` goes stale when the device moves the QP to ERR).
    ///
    /// # Errors
    /// [`VerbsError::QueuePair`] when the query fails.
    pub fn query_qp_state(&self) -> Result<&'static str, VerbsError> {
        let qp = self.qp()?;
        let (attr, _) = qp
            .query(QueuePairAttributeMask::State)
            .map_err(|e| self.qp_err("ibv_query_qp", e))?;
        Ok(match attr.state() {
            QueuePairState::Reset => "RESET",
            QueuePairState::Init => "INIT",
            QueuePairState::ReadyToReceive => "RTR",
            QueuePairState::ReadyToSend => "RTS",
            QueuePairState::SendQueueDrain => "SQD",
            QueuePairState::SendQueueError => "SQE",
            QueuePairState::Error => "ERR",
            _ => "unknown",
        })
    }

    /// Connects to the peer: INIT → RTR → RTS with its info, then posts queued work.
    ///
    /// # Errors
    /// [`VerbsError::NotConnected`] if closed or already connected (reset first);
    /// [`VerbsError::QueuePair`] when a state change fails (the endpoint stays in its
    /// state and may be reset and retried).
    pub fn connect(&mut self, remote: &ConnectionInfo) -> Result<(), VerbsError> {
        if !matches!(
            self.state,
            EndpointState::Init | EndpointState::NeedsReconnect
        ) {
            return Err(VerbsError::NotConnected { state: self.state });
        }
        let dev = Arc::clone(&self.pd.device().inner);
        let path_mtu = match dev.active_mtu.min(remote.mtu) {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            _ => Mtu::Mtu4096,
        };
        let mut ah = AddressHandleAttribute::new();
        ah.setup_port(dev.port)
            .setup_grh_dest_gid(&RawGid { raw: remote.gid.0 })
            .setup_grh_src_gid_index(dev.gid_index)
            .setup_grh_hop_limit(64);
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(path_mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(dev.max_qp_rd_atom.max(1))
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            // 6, not 7: rxe treats a retry count of 7 as "retry forever", so a READ the
            // responder never answers would hang until the batch timeout; a finite count
            // fails the QP (and the batch) after the retries on every provider.
            .setup_retry_cnt(6)
            // 7 = retry forever: a receiver that has not re-posted its ring yet (it does
            // so in its own poll) delays our sends instead of failing the QP.
            .setup_rnr_retry(7)
            .setup_max_read_atomic(dev.max_qp_init_rd_atom.min(remote.max_rd_atom).max(1));
        let qpn = self.qpn;
        let qp = self.qp_mut()?;
        qp.modify(&rtr)
            .map_err(|e| qp_error(qpn, "modify to RTR", e))?;
        qp.modify(&rts)
            .map_err(|e| qp_error(qpn, "modify to RTS", e))?;
        self.remote = Some(*remote);
        self.peer_slot = remote.notif_slot_size.min(self.config.notif_slot_size);
        self.state = EndpointState::Connected;
        tracing::debug!(
            device = %dev.name, qpn = self.qpn, peer_qpn = remote.qpn,
            mtu = mtu_bytes(dev.active_mtu.min(remote.mtu)), "verbs queue pair connected"
        );
        self.post_pending()?;
        self.flush_notifs()
    }

    /// Resets the queue pair for a reconnect (QP → ERR, drain, RESET → INIT with a new
    /// PSN, receive ring re-posted) and returns the new info for the peer. Reads and
    /// notifications that were in flight are queued again (reads are idempotent). If the
    /// endpoint already reset itself after an error and is waiting, this only returns its
    /// info.
    ///
    /// # Errors
    /// [`VerbsError::QueuePair`] when a state change fails; [`VerbsError::NotConnected`]
    /// when closed.
    pub fn reset(&mut self) -> Result<ConnectionInfo, VerbsError> {
        match self.state {
            EndpointState::Closed => Err(VerbsError::NotConnected { state: self.state }),
            EndpointState::NeedsReconnect | EndpointState::Init => Ok(self.local_info()),
            EndpointState::Connected => {
                self.recover()?;
                Ok(self.local_info())
            }
        }
    }

    /// Posts a batch of reads, optionally followed by a fenced read (posted with
    /// `IBV_SEND_FENCE` after the data reads: it starts only once they completed, so the
    /// word it reads, e.g. a lease generation, is not older than the data) and a
    /// notification sent to the peer once the whole batch completed.
    ///
    /// # Errors
    /// [`VerbsError::OutOfBounds`] for a range outside its region,
    /// [`VerbsError::ForeignRegion`] for a destination of another protection domain,
    /// [`VerbsError::NotifTooLarge`], [`VerbsError::NotConnected`] when closed, and post
    /// errors. Nothing is posted when validation fails.
    pub fn post_read_batch(
        &mut self,
        ops: &[ReadOp],
        fence: Option<&ReadOp>,
        notif: Option<Vec<u8>>,
    ) -> Result<BatchId, VerbsError> {
        if self.state == EndpointState::Closed {
            return Err(VerbsError::NotConnected { state: self.state });
        }
        if let Some(n) = &notif {
            self.check_notif_len(n.len())?;
        }
        let batch = self.next_batch;
        let mut chunks = Vec::new();
        for op in ops {
            self.split(batch, op, false, &mut chunks)?;
        }
        if let Some(op) = fence {
            let before = chunks.len();
            self.split(batch, op, true, &mut chunks)?;
            if chunks.len() != before + 1 {
                return Err(VerbsError::OutOfBounds {
                    side: "fence",
                    offset: op.remote_offset,
                    len: op.len,
                    region_len: u64::from(self.config.max_wr_bytes),
                });
            }
        }
        self.next_batch += 1;
        self.batches.insert(
            batch,
            Batch {
                remaining: chunks.len(),
                failed: None,
                notif,
            },
        );
        if chunks.is_empty() {
            self.finish_batch(batch);
        }
        self.pending.extend(chunks);
        self.post_pending()?;
        self.flush_notifs()?;
        Ok(BatchId(batch))
    }

    /// The status of a batch; a final status (done or failed) is returned once, then the
    /// batch is forgotten. `None` for an unknown (or already reported) batch.
    pub fn poll_batch(&mut self, id: BatchId) -> Option<BatchStatus> {
        let b = self.batches.get(&id.0)?;
        if b.failed.is_some() {
            let b = self.batches.remove(&id.0)?;
            return b.failed.map(BatchStatus::Failed);
        }
        if b.remaining == 0 {
            self.batches.remove(&id.0);
            return Some(BatchStatus::Done);
        }
        Some(BatchStatus::Pending)
    }

    /// Gives up on a batch (the caller's timeout): its queued reads are dropped; reads in
    /// flight keep their memory alive until their completions are reaped.
    pub fn abandon_batch(&mut self, id: BatchId) {
        if self.batches.remove(&id.0).is_some() {
            self.pending.retain(|c| c.batch != id.0);
        }
    }

    /// Sends a notification to the peer (SEND into its receive ring), or queues it while
    /// the endpoint is not connected or every send slot is in flight.
    ///
    /// # Errors
    /// [`VerbsError::NotifTooLarge`] when `bytes` exceeds the slot size (nothing is sent,
    /// never truncated); [`VerbsError::NotifRingFull`] when the queue is full;
    /// [`VerbsError::NotConnected`] when closed.
    pub fn send_notif(&mut self, bytes: &[u8]) -> Result<(), VerbsError> {
        if self.state == EndpointState::Closed {
            return Err(VerbsError::NotConnected { state: self.state });
        }
        self.check_notif_len(bytes.len())?;
        if self.queued_notifs.len() >= self.config.max_queued_notifs as usize {
            return Err(VerbsError::NotifRingFull {
                slots: self.config.send_slots as usize,
            });
        }
        self.queued_notifs.push_back(bytes.to_vec());
        self.flush_notifs()
    }

    /// Notifications received since the last call, in arrival order.
    pub fn take_notifs(&mut self) -> Vec<Vec<u8>> {
        self.notifs_in.drain(..).collect()
    }

    /// Reaps completions (without blocking), posts queued reads and notifications, and
    /// recovers from a queue pair error (the state becomes
    /// [`EndpointState::NeedsReconnect`]). Returns how many completions it reaped.
    ///
    /// # Errors
    /// [`VerbsError::QueuePair`] when polling or a recovery step fails.
    pub fn poll(&mut self) -> Result<usize, VerbsError> {
        if self.state == EndpointState::Closed {
            return Ok(0);
        }
        let wcs = self.reap()?;
        let n = wcs.len();
        let mut failed = false;
        for (wr_id, status) in wcs {
            failed |= self.on_completion(wr_id, status, false);
        }
        if failed && self.state == EndpointState::Connected {
            self.recover()?;
        }
        self.post_pending()?;
        self.flush_notifs()?;
        Ok(n)
    }

    /// Orderly teardown: QP → ERR, drain its completions, destroy it; then the memory
    /// that in-flight work requests referenced is released.
    ///
    /// # Errors
    /// [`VerbsError::DrainIncomplete`] when some work requests did not flush in time (the
    /// QP is destroyed anyway, which stops all DMA); [`VerbsError::QueuePair`] when the
    /// state change fails.
    pub fn close(mut self) -> Result<(), VerbsError> {
        self.teardown()
    }

    // ----- internals -----

    fn qp(&self) -> Result<&BasicQueuePair, VerbsError> {
        self.qp
            .as_ref()
            .ok_or(VerbsError::NotConnected { state: self.state })
    }

    fn qp_mut(&mut self) -> Result<&mut BasicQueuePair, VerbsError> {
        let state = self.state;
        self.qp.as_mut().ok_or(VerbsError::NotConnected { state })
    }

    fn qp_err(
        &self,
        op: &'static str,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> VerbsError {
        qp_error(self.qpn, op, e)
    }

    fn check_notif_len(&self, len: usize) -> Result<(), VerbsError> {
        let limit = if self.peer_slot > 0 {
            self.peer_slot
        } else {
            self.config.notif_slot_size
        } as usize;
        if len > limit {
            return Err(VerbsError::NotifTooLarge { len, limit });
        }
        Ok(())
    }

    /// Validates one op and cuts it into work-request-sized chunks.
    fn split(
        &self,
        batch: u64,
        op: &ReadOp,
        fence: bool,
        out: &mut Vec<Chunk>,
    ) -> Result<(), VerbsError> {
        if !op.local.pd().same(&self.pd) {
            return Err(VerbsError::ForeignRegion);
        }
        let local_addr = op.local.sge_addr(op.local_offset, op.len)?;
        let remote_end = op.remote_offset.checked_add(op.len);
        let remote_addr = op.remote.addr.checked_add(op.remote_offset);
        let (Some(remote_addr), Some(end)) = (remote_addr, remote_end) else {
            return Err(remote_oob(op));
        };
        if end > op.remote.len || remote_addr.checked_add(op.len).is_none() {
            return Err(remote_oob(op));
        }
        let step = u64::from(self.config.max_wr_bytes);
        let mut done = 0u64;
        while done < op.len {
            let len = (op.len - done).min(step);
            out.push(Chunk {
                batch,
                local: op.local.clone(),
                local_addr: local_addr + done,
                remote_addr: remote_addr + done,
                rkey: op.remote.rkey,
                // At most max_wr_bytes (a u32).
                len: u32::try_from(len).unwrap_or(u32::MAX),
                fence,
            });
            done += len;
        }
        Ok(())
    }

    /// RESET → INIT with a fresh PSN; posts the whole receive ring.
    fn enter_init(&mut self) -> Result<(), VerbsError> {
        let port = self.pd.device().inner.port;
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
        let qpn = self.qpn;
        self.qp_mut()?
            .modify(&init)
            .map_err(|e| qp_error(qpn, "modify to INIT", e))?;
        self.psn = random_psn();
        self.epoch += 1;
        self.post_recvs(0..self.config.recv_slots)
    }

    fn post_recvs(&mut self, slots: std::ops::Range<u32>) -> Result<(), VerbsError> {
        let n = slots.len() as u32;
        if n == 0 {
            return Ok(());
        }
        let (lkey, slot_len) = (self.recv.mr.lkey(), self.recv.slot);
        let addrs: Vec<(u32, u64)> = slots.map(|s| (s, self.recv.addr(s))).collect();
        let epoch = self.epoch;
        let qpn = self.qpn;
        let qp = self.qp_mut()?;
        let mut guard = qp.start_post_recv();
        for (slot, addr) in addrs {
            let wr = guard.construct_wr(RECV_BIT | (epoch << 32) | u64::from(slot));
            // SAFETY: the slot lies inside the receive ring's registered buffer (`addr`
            // comes from Ring::addr with slot < recv_slots), which the endpoint owns and
            // keeps alive until the QP is destroyed; the CPU reads a slot only after its
            // receive completed and before it is posted again.
            unsafe { wr.setup_sge(lkey, addr, slot_len) };
        }
        guard
            .post()
            .map_err(|e| qp_error(qpn, "ibv_post_recv", e))?;
        self.recv_posted += n;
        Ok(())
    }

    /// Posts queued reads while the outstanding bound allows, one doorbell per chain.
    ///
    /// While reads are in flight it refills in whole chains: it waits until a full chain
    /// fits (or all queued work does) instead of ringing a doorbell for every few
    /// completions. A chain is at most half the outstanding bound, so the next chain is
    /// posted while the previous one is still in flight. Measured on SoftRoCE (64 KiB
    /// reads): doorbells every 16 completions made rxe retry reads (duplicate requests,
    /// completer retries) and ran at 0.6× `ib_read_bw`; whole-chain refills did not.
    fn post_pending(&mut self) -> Result<(), VerbsError> {
        let chain = self
            .config
            .wrs_per_doorbell
            .min((self.config.max_outstanding_reads / 2).max(1));
        while self.state == EndpointState::Connected && !self.pending.is_empty() {
            let room = self
                .config
                .max_outstanding_reads
                .saturating_sub(self.reads_in_flight);
            let n = (self.pending.len() as u32).min(room).min(chain) as usize;
            if n == 0 || (self.reads_in_flight > 0 && n < chain as usize && n < self.pending.len())
            {
                break;
            }
            let chunks: Vec<Chunk> = self.pending.drain(..n).collect();
            let first_id = self.next_wr_id;
            let mut unsignaled = self.unsignaled;
            let mut flags = Vec::with_capacity(n);
            for (i, c) in chunks.iter().enumerate() {
                // The last WR of a batch is signalled too, so that a batch sharing a chain
                // with later ones is reported as soon as it completed.
                let batch_end = chunks.get(i + 1).is_none_or(|next| next.batch != c.batch);
                let signal = batch_end || unsignaled + 1 >= self.config.signal_every;
                let mut f = WorkRequestFlags::none();
                if signal {
                    f |= WorkRequestFlags::Signaled;
                    unsignaled = 0;
                } else {
                    unsignaled += 1;
                }
                if c.fence {
                    f |= WorkRequestFlags::Fence;
                }
                flags.push(f);
            }
            let qpn = self.qpn;
            let qp = self.qp_mut()?;
            let mut guard = qp.start_post_send();
            for (i, c) in chunks.iter().enumerate() {
                let wr = guard
                    .construct_wr(first_id + i as u64, flags[i])
                    .setup_read(c.rkey, c.remote_addr);
                // SAFETY: local_addr..+len was bounds-checked against `c.local` (a
                // registered region of this PD) in `split`, and `c` (holding an Arc of
                // that MemoryRegion) moves into the in-flight table below, where it stays
                // until this work request's completion is reaped or the QP is reset or
                // destroyed: the destination stays registered and alive while the NIC
                // may write it.
                unsafe { wr.setup_sge(c.local.lkey(), c.local_addr, c.len) };
            }
            match guard.post() {
                Ok(()) => {
                    self.next_wr_id += n as u64;
                    self.unsignaled = unsignaled;
                    self.reads_in_flight += n as u32;
                    for (i, c) in chunks.into_iter().enumerate() {
                        self.send_q.push_back(Posted {
                            wr_id: first_id + i as u64,
                            what: PostedKind::Read(c),
                        });
                    }
                }
                Err(e) => {
                    // sideway does not say which WR of the chain was bad (nor whether the
                    // ones before it were posted), so every batch in the chain fails; the
                    // chain's memory stays referenced by `chunks` until here, and a WR
                    // that was posted is flushed by the reset below.
                    let msg = format!("{e}");
                    tracing::warn!(qpn, "ibv_post_send of {n} RDMA READs failed: {msg}");
                    let mut seen = Vec::new();
                    for c in &chunks {
                        if !seen.contains(&c.batch) {
                            seen.push(c.batch);
                        }
                    }
                    for b in seen {
                        let err = qp_error(
                            qpn,
                            "ibv_post_send (RDMA READ)",
                            std::io::Error::other(msg.clone()),
                        );
                        self.fail_batch(b, err);
                    }
                    self.errors += 1;
                    // Keep the chain's memory alive until the QP is reset (it may have
                    // accepted a prefix of the chain).
                    for (i, c) in chunks.into_iter().enumerate() {
                        self.send_q.push_back(Posted {
                            wr_id: first_id + i as u64,
                            what: PostedKind::Read(c),
                        });
                    }
                    self.next_wr_id += n as u64;
                    return self.recover();
                }
            }
        }
        Ok(())
    }

    /// Sends queued notifications into free send slots.
    fn flush_notifs(&mut self) -> Result<(), VerbsError> {
        while self.state == EndpointState::Connected && !self.queued_notifs.is_empty() {
            let Some(slot) = self.free_send.pop() else {
                break;
            };
            let Some(msg) = self.queued_notifs.pop_front() else {
                self.free_send.push(slot);
                break;
            };
            // Checked against the slot size when queued.
            let len = u32::try_from(msg.len())
                .unwrap_or(u32::MAX)
                .min(self.send.slot);
            self.send
                .buf
                .write(self.send.offset(slot), &msg[..len as usize]);
            let (lkey, addr, wr_id, qpn) = (
                self.send.mr.lkey(),
                self.send.addr(slot),
                self.next_wr_id,
                self.qpn,
            );
            let qp = self.qp_mut()?;
            let mut guard = qp.start_post_send();
            let wr = guard
                .construct_wr(wr_id, WorkRequestFlags::Signaled)
                .setup_send();
            // SAFETY: the slot lies inside the send ring's registered buffer, which the
            // endpoint keeps alive until the QP is destroyed; the slot is off the free
            // list until this send's completion is reaped, so the CPU does not rewrite it
            // while the NIC reads it.
            unsafe { wr.setup_sge(lkey, addr, len) };
            if let Err(e) = guard.post() {
                self.free_send.push(slot);
                self.queued_notifs.push_front(msg);
                return Err(qp_error(qpn, "ibv_post_send (SEND)", e));
            }
            self.next_wr_id += 1;
            self.send_q.push_back(Posted {
                wr_id,
                what: PostedKind::Send { slot, len },
            });
        }
        Ok(())
    }

    /// Polls the CQ until it is empty: `(wr_id, status)` pairs.
    fn reap(&mut self) -> Result<Vec<(u64, WorkCompletionStatus)>, VerbsError> {
        let mut out = Vec::new();
        match self.cq.start_poll() {
            Ok(poller) => {
                // Consume the whole iterator: it polls again when its batch is used up,
                // and a completion left in its buffer would be lost.
                for wc in poller {
                    out.push((
                        wc.wr_id(),
                        WorkCompletionStatus::new(wc.status(), wc.vendor_err(), wc.byte_len()),
                    ));
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
            Err(e) => return Err(self.qp_err("ibv_poll_cq", e)),
        }
        Ok(out)
    }

    /// Handles one completion; true if it reports a queue pair error (not a flush).
    fn on_completion(&mut self, wr_id: u64, status: WorkCompletionStatus, draining: bool) -> bool {
        if wr_id & RECV_BIT != 0 {
            return self.on_recv(wr_id, status, draining);
        }
        // Send queue: completions arrive in post order; an unsignalled WR completed
        // successfully once a later WR completes.
        self.last_reported = self.last_reported.max(wr_id);
        let Some(front) = self.send_q.front() else {
            return false;
        };
        if wr_id < front.wr_id {
            return false; // from before a reset
        }
        if status.code() == WorkCompletionStatus::SUCCESS {
            while self.send_q.front().is_some_and(|p| p.wr_id <= wr_id) {
                if let Some(p) = self.send_q.pop_front() {
                    self.complete(p);
                }
            }
            return false;
        }
        if status.is_flush() {
            // Left in the table: recovery requeues everything not confirmed.
            return false;
        }
        // A real error on `wr_id`: everything before it completed.
        while self.send_q.front().is_some_and(|p| p.wr_id < wr_id) {
            if let Some(p) = self.send_q.pop_front() {
                self.complete(p);
            }
        }
        let qpn = self.qpn;
        if let Some(p) = self.send_q.front().filter(|p| p.wr_id == wr_id) {
            let (op, batch) = match &p.what {
                PostedKind::Read(c) => ("READ", Some(c.batch)),
                PostedKind::Send { .. } => ("SEND", None),
            };
            let err = VerbsError::WorkRequest { op, qpn, status };
            tracing::warn!(qpn, "{err}");
            if let Some(b) = batch {
                // Its chunk leaves the table at recovery; the batch fails now.
                self.fail_batch(b, err);
            }
        }
        self.errors += 1;
        true
    }

    fn on_recv(&mut self, wr_id: u64, status: WorkCompletionStatus, draining: bool) -> bool {
        let epoch = (wr_id & !RECV_BIT) >> 32;
        if epoch != self.epoch {
            return false;
        }
        self.recv_posted = self.recv_posted.saturating_sub(1);
        let slot = (wr_id & 0xffff_ffff) as u32;
        if status.code() == WorkCompletionStatus::SUCCESS {
            let len = status.byte_len().min(self.recv.slot) as usize;
            if slot < self.recv.slots {
                self.notifs_in
                    .push_back(self.recv.buf.read(self.recv.offset(slot), len));
                if !draining && let Err(e) = self.post_recvs(slot..slot + 1) {
                    tracing::warn!(qpn = self.qpn, "re-posting a receive failed: {e}");
                    self.errors += 1;
                    return true;
                }
            }
            return false;
        }
        if status.is_flush() {
            // Our QP went to ERR (the peer's fault reached us): recover.
            return !draining && self.state == EndpointState::Connected;
        }
        tracing::warn!(qpn = self.qpn, "RDMA RECV failed: {status}");
        self.errors += 1;
        true
    }

    fn complete(&mut self, p: Posted) {
        match p.what {
            PostedKind::Read(c) => {
                self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
                let done = match self.batches.get_mut(&c.batch) {
                    Some(b) if b.failed.is_none() => {
                        b.remaining = b.remaining.saturating_sub(1);
                        b.remaining == 0
                    }
                    _ => false,
                };
                if done {
                    self.finish_batch(c.batch);
                }
            }
            PostedKind::Send { slot, .. } => self.free_send.push(slot),
        }
    }

    fn finish_batch(&mut self, batch: u64) {
        let notif = self.batches.get_mut(&batch).and_then(|b| b.notif.take());
        if let Some(n) = notif {
            // Length checked when the batch was posted; queued even if the queue is long.
            self.queued_notifs.push_back(n);
        }
    }

    fn fail_batch(&mut self, batch: u64, err: VerbsError) {
        if let Some(b) = self.batches.get_mut(&batch)
            && b.failed.is_none()
        {
            b.failed = Some(err);
            b.notif = None;
        }
        self.pending.retain(|c| c.batch != batch);
    }

    /// QP → ERR, drain, RESET → INIT; requeues unconfirmed work of healthy batches.
    fn recover(&mut self) -> Result<(), VerbsError> {
        tracing::warn!(
            qpn = self.qpn,
            device = self.pd.device().name(),
            "verbs queue pair failed: resetting it"
        );
        self.drain_in_error()?;
        let qpn = self.qpn;
        let mut reset = QueuePairAttribute::new();
        reset.setup_state(QueuePairState::Reset);
        self.qp_mut()?
            .modify(&reset)
            .map_err(|e| qp_error(qpn, "modify to RESET", e))?;
        // The QP is in RESET: the NIC no longer touches anything posted to it.
        let mut requeue = Vec::new();
        for p in std::mem::take(&mut self.send_q) {
            match p.what {
                PostedKind::Read(c) => {
                    let alive = self
                        .batches
                        .get(&c.batch)
                        .is_some_and(|b| b.failed.is_none());
                    if alive {
                        requeue.push(c);
                    }
                }
                PostedKind::Send { slot, len } => {
                    let msg = self.send.buf.read(self.send.offset(slot), len as usize);
                    self.queued_notifs.push_front(msg);
                    self.free_send.push(slot);
                }
            }
        }
        for c in requeue.into_iter().rev() {
            self.pending.push_front(c);
        }
        self.reads_in_flight = 0;
        self.unsignaled = 0;
        self.recv_posted = 0;
        self.state = EndpointState::NeedsReconnect;
        self.enter_init()
    }

    /// Moves the QP to ERR and reaps completions until every posted WR has flushed or the
    /// poll budget is spent. Returns how many work requests did not report back.
    fn drain_in_error(&mut self) -> Result<usize, VerbsError> {
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        let qpn = self.qpn;
        self.qp_mut()?
            .modify(&err)
            .map_err(|e| qp_error(qpn, "modify to ERR", e))?;
        let mut idle = 0;
        // Flushed sends and receives report back (signalled or not, a flush completes
        // each WR on rxe and mlx5); stop when the tables are empty or the budget is gone.
        while idle < DRAIN_POLLS {
            let wcs = self.reap()?;
            if wcs.is_empty() {
                if self.recv_posted == 0 && self.send_q_reported() {
                    break;
                }
                idle += 1;
                std::thread::yield_now();
                continue;
            }
            for (wr_id, status) in wcs {
                self.on_completion(wr_id, status, true);
            }
        }
        Ok(self.recv_posted as usize + self.send_q.len())
    }

    /// Whether every posted send-queue WR reported back. Flushed entries stay in `send_q`
    /// (recovery requeues them); the newest one is always signalled (the last WR of each
    /// chain is), so its report covers all.
    fn send_q_reported(&self) -> bool {
        self.send_q
            .back()
            .is_none_or(|p| p.wr_id <= self.last_reported)
    }

    fn teardown(&mut self) -> Result<(), VerbsError> {
        if self.state == EndpointState::Closed {
            return Ok(());
        }
        self.state = EndpointState::Closed;
        let left = match self.drain_in_error() {
            Ok(left) => left,
            Err(e) => {
                self.destroy_qp();
                return Err(e);
            }
        };
        self.destroy_qp();
        // The QP is destroyed: the NIC no longer touches the in-flight memory.
        self.send_q.clear();
        self.pending.clear();
        if left > 0 {
            return Err(VerbsError::DrainIncomplete {
                qpn: self.qpn,
                left,
            });
        }
        Ok(())
    }

    fn destroy_qp(&mut self) {
        if let Some(qp) = self.qp.take() {
            drop_guarded("ibv_destroy_qp", qp);
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        match self.teardown() {
            Ok(()) => {}
            // Flushes may not report back for every WR; the QP is destroyed anyway.
            Err(VerbsError::DrainIncomplete { qpn, left }) => {
                tracing::debug!(qpn, left, "teardown: some work requests did not flush");
            }
            Err(e) => super::record_drop_error("endpoint teardown", &e),
        }
        // SAFETY: `cq` is taken exactly once, here in Drop, and not used afterwards.
        let cq = unsafe { ManuallyDrop::take(&mut self.cq) };
        drop_guarded("ibv_destroy_cq", cq);
    }
}

fn qp_error(
    qpn: u32,
    op: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> VerbsError {
    VerbsError::QueuePair {
        qpn,
        op,
        source: Box::new(e),
    }
}

fn remote_oob(op: &ReadOp) -> VerbsError {
    VerbsError::OutOfBounds {
        side: "remote",
        offset: op.remote_offset,
        len: op.len,
        region_len: op.remote.len,
    }
}

/// A random 24-bit PSN (a fresh one after every reset, so stale packets are refused).
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        // Any value is correct; randomness only protects against stale packets.
        b = std::process::id().to_be_bytes();
    }
    u32::from_be_bytes(b) & 0x00ff_ffff
}
