//! The endpoint's public value types: its tuning, the reads it takes, the connection
//! info exchanged with the peer (and its wire format), its state and batch handles.

use crate::verbs::device::Gid;
use crate::verbs::{MemoryRegion, VerbsError};

/// Wire format version tag of [`ConnectionInfo`].
const INFO_MAGIC: [u8; 4] = *b"KVV1";
/// Encoded length of [`ConnectionInfo`].
const INFO_LEN: usize = 40;

/// Tuning of an [`Endpoint`](super::Endpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointConfig {
    /// RDMA READ (and WRITE) work requests in flight at most (the send queue's share
    /// for data; writes count against it as reads do).
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
    /// Local ACK timeout: the queue pair retransmits a request the peer has not answered
    /// after 4.096 µs × 2^`ack_timeout` (14: 67 ms; at most 31). 0 waits for ever (the
    /// InfiniBand meaning): only the caller's own stall check then ends a lost request.
    pub ack_timeout: u8,
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
            ack_timeout: 14,
        }
    }
}

/// A peer's region as its metadata describes it: address on the peer, length, rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) rkey: u32,
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

/// One RDMA READ on the queue pair: `len` bytes from the peer's registered `remote` at
/// `remote_offset` into our registered `local` at `local_offset`. (The
/// [`Agent`](crate::Agent)'s reads, [`ReadOp`](crate::ReadOp), name regions by id
/// instead, whatever the backend.)
#[derive(Debug, Clone)]
pub struct RdmaRead {
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

/// One RDMA WRITE on the queue pair: `len` bytes of our registered `local` at
/// `local_offset` into the peer's `remote` at `remote_offset`. The peer's range must be
/// registered for remote writes (a pool registration is not: see
/// [`Agent::grant_write`](crate::Agent::grant_write)).
#[derive(Debug, Clone)]
pub struct RdmaWrite {
    /// Source (registered in the endpoint's protection domain).
    pub local: MemoryRegion,
    /// Offset in `local`.
    pub local_offset: u64,
    /// Destination on the peer.
    pub remote: RemoteRegion,
    /// Offset in `remote`.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a peer needs to connect its queue pair to ours; exchanged over the caller's TCP
/// side channel (see [`encode`](Self::encode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
pub enum EndpointState {
    /// Created; waiting for the peer's [`ConnectionInfo`] ([`Endpoint::connect`](super::Endpoint::connect)).
    Init,
    /// Connected: reads and notifications flow.
    Connected,
    /// The queue pair failed and was reset; exchange [`Endpoint::local_info`](super::Endpoint::local_info) with the
    /// peer again (it must [`Endpoint::reset`](super::Endpoint::reset) too) and [`Endpoint::connect`](super::Endpoint::connect). Batches and
    /// notifications posted meanwhile wait.
    NeedsReconnect,
    /// Closed.
    Closed,
}

/// How a batch posted on an endpoint stands.
#[derive(Debug)]
pub enum EndpointBatchStatus {
    /// Work requests are queued or in flight.
    Pending,
    /// Every read completed; its bytes are in the destination.
    Done,
    /// It failed; its other reads were cancelled.
    Failed(VerbsError),
}
