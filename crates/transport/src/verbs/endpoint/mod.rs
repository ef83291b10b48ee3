//! One RC queue pair to one peer: batched RDMA READs, SEND/RECV notifications, recovery.

mod post;
mod reap;
mod recover;
mod types;

pub use types::{
    ConnectionInfo, EndpointBatchStatus, EndpointConfig, EndpointState, RdmaRead, RdmaWrite,
    RemoteRegion,
};

use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
use std::sync::Arc;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid as RawGid};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
    QueuePairType,
};

use super::device::mtu_bytes;
use super::memory::HeapBuffer;
use super::{MemoryRegion, ProtectionDomain, VerbsError, drop_guarded};
use crate::ids::BatchId;

/// Receive work requests carry this bit in their `wr_id`; send-queue ones never do.
const RECV_BIT: u64 = 1 << 63;
/// How many empty polls teardown and recovery wait for flushed completions before they
/// reset the queue pair anyway (a reset stops all DMA, so this only bounds the wait).
const DRAIN_POLLS: u32 = 200_000;
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
    /// An RDMA WRITE from `local` (instead of a READ into it).
    write: bool,
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
        // A 5-bit field on the wire.
        config.ack_timeout = config.ack_timeout.min(31);
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

    /// Send-queue work the endpoint holds and has not seen complete: work requests posted
    /// and not yet reported by the completion queue, and reads or writes queued behind
    /// them. While it is non-zero, [`reported`](Self::reported) should move: a queue pair
    /// whose marker stands still that long has stopped making progress (a lost request
    /// with [`EndpointConfig::ack_timeout`] 0, or a device that lost it).
    pub fn outstanding(&self) -> usize {
        self.send_q.len() + self.pending.len()
    }

    /// A marker that moves whenever the completion queue reports send-queue work: the
    /// newest work request it reported, whatever its status.
    pub fn reported(&self) -> u64 {
        self.last_reported
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
            .setup_timeout(self.config.ack_timeout)
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
        ops: &[RdmaRead],
        fence: Option<&RdmaRead>,
        notif: Option<Vec<u8>>,
    ) -> Result<BatchId, VerbsError> {
        self.check_post(notif.as_deref())?;
        let batch = self.next_batch;
        let mut chunks = Vec::new();
        for op in ops {
            self.split(batch, op, false, false, &mut chunks)?;
        }
        if let Some(op) = fence {
            let before = chunks.len();
            self.split(batch, op, true, false, &mut chunks)?;
            if chunks.len() != before + 1 {
                return Err(VerbsError::OutOfBounds {
                    side: "fence",
                    offset: op.remote_offset,
                    len: op.len,
                    region_len: u64::from(self.config.max_wr_bytes),
                });
            }
        }
        self.start_batch(batch, chunks, notif)
    }

    /// What a batch of reads or writes, or a notification, is refused for before anything
    /// is queued: a closed endpoint, a notification over the slot size.
    fn check_post(&self, notif: Option<&[u8]>) -> Result<(), VerbsError> {
        if self.state == EndpointState::Closed {
            return Err(VerbsError::NotConnected { state: self.state });
        }
        if let Some(n) = notif {
            self.check_notif_len(n.len())?;
        }
        Ok(())
    }

    /// Records batch `batch` of validated `chunks` (the next batch id) and posts what the
    /// send window admits; a batch of no chunks finishes at once.
    fn start_batch(
        &mut self,
        batch: u64,
        chunks: Vec<Chunk>,
        notif: Option<Vec<u8>>,
    ) -> Result<BatchId, VerbsError> {
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

    /// Posts a batch of RDMA WRITEs (each from our registered `local` into the peer's
    /// range), optionally followed by a notification sent once every write completed. A
    /// write's completion means the peer's NIC acknowledged its bytes; a write into a
    /// range whose access the peer revoked fails its batch with a remote access error
    /// ([`VerbsError::WorkRequest`]) and changes nothing there.
    ///
    /// # Errors
    /// As [`post_read_batch`](Self::post_read_batch); nothing is posted when validation
    /// fails.
    pub fn post_write_batch(
        &mut self,
        ops: &[RdmaWrite],
        notif: Option<Vec<u8>>,
    ) -> Result<BatchId, VerbsError> {
        self.check_post(notif.as_deref())?;
        let batch = self.next_batch;
        let mut chunks = Vec::new();
        for op in ops {
            let shaped = RdmaRead {
                local: op.local.clone(),
                local_offset: op.local_offset,
                remote: op.remote,
                remote_offset: op.remote_offset,
                len: op.len,
            };
            self.split(batch, &shaped, false, true, &mut chunks)?;
        }
        self.start_batch(batch, chunks, notif)
    }

    /// The status of a batch; a final status (done or failed) is returned once, then the
    /// batch is forgotten. `None` for an unknown (or already reported) batch.
    pub fn poll_batch(&mut self, id: BatchId) -> Option<EndpointBatchStatus> {
        let b = self.batches.get(&id.0)?;
        if b.failed.is_some() {
            let b = self.batches.remove(&id.0)?;
            return b.failed.map(EndpointBatchStatus::Failed);
        }
        if b.remaining == 0 {
            self.batches.remove(&id.0);
            return Some(EndpointBatchStatus::Done);
        }
        Some(EndpointBatchStatus::Pending)
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
        self.check_post(Some(bytes))?;
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

fn remote_oob(op: &RdmaRead) -> VerbsError {
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
