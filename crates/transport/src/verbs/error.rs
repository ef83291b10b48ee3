//! Errors of the verbs backend.

use std::{error::Error as StdError, fmt, io};

use kvlease_gpu_mem::{MemoryKind, RegionAccessError, staging::StagingError};

/// A boxed error from `sideway` (its error types are per operation).
type Source = Box<dyn StdError + Send + Sync + 'static>;

/// Why a verbs operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No usable RDMA device: libibverbs is missing, no device exists, or none matches.
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// What was looked for and what was found.
        reason: String,
    },
    /// A device-level call failed.
    #[error("RDMA device {device}: {op} failed")]
    Device {
        /// The device name.
        device: String,
        /// The call that failed.
        op: &'static str,
        /// The error from libibverbs.
        #[source]
        source: Source,
    },
    /// `ibv_reg_mr` failed with ENOMEM: the locked-memory limit is too low.
    #[error(
        "registering {len} bytes on {device} failed: not enough locked memory \
         (RLIMIT_MEMLOCK); raise it with `ulimit -l unlimited` (or LimitMEMLOCK=infinity \
         in a systemd unit, `--ulimit memlock=-1` for docker)"
    )]
    MemlockLimit {
        /// The device name.
        device: String,
        /// Bytes that were to be registered.
        len: usize,
        /// The error from libibverbs.
        #[source]
        source: io::Error,
    },
    /// `ibv_reg_mr` failed for another reason.
    #[error("registering {len} bytes on {device} failed")]
    Register {
        /// The device name.
        device: String,
        /// Bytes that were to be registered.
        len: usize,
        /// The error from libibverbs.
        #[source]
        source: io::Error,
    },
    /// [`ProtectionDomain::register`](super::ProtectionDomain::register) cannot register
    /// this memory itself: it is not host memory and, for CUDA device memory, dmabuf
    /// registration is not possible (`why` says which step failed). The transport agent
    /// then registers a host mirror of the region instead (pinned memory for CUDA
    /// regions) and copies through it; only where that fails too do peers read the
    /// region over TCP.
    #[error(
        "{kind} memory cannot be registered with the verbs backend itself ({why}); \
         register a host mirror of it instead (the transport agent does)"
    )]
    UnsupportedMemory {
        /// The region's kind.
        kind: MemoryKind,
        /// Why: not host memory and no dmabuf path, or what the dmabuf export or
        /// `ibv_reg_dmabuf_mr` answered.
        why: String,
    },
    /// A queue pair operation (create, state change, query, post) failed.
    #[error("queue pair {qpn:#x}: {op} failed")]
    QueuePair {
        /// The local queue pair number (0 before it exists).
        qpn: u32,
        /// The operation.
        op: &'static str,
        /// The error from libibverbs.
        #[source]
        source: Source,
    },
    /// A work request completed with an error status.
    #[error("RDMA {op} work request failed on queue pair {qpn:#x}: {status}")]
    WorkRequest {
        /// The operation (`READ`, `SEND`, `RECV`).
        op: &'static str,
        /// The local queue pair number.
        qpn: u32,
        /// The completion status.
        status: WorkCompletionStatus,
    },
    /// The queue pair failed earlier and this batch was posted to it; see the log.
    #[error("queue pair {qpn:#x} is in error and must be reconnected")]
    NeedsReconnect {
        /// The local queue pair number.
        qpn: u32,
    },
    /// A range lies outside its memory region.
    #[error("{side} range {offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// `local` or `remote`.
        side: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// A memory region was registered in another protection domain than the endpoint's.
    #[error("memory region belongs to another protection domain")]
    ForeignRegion,
    /// A notification is larger than a receive slot; it was not sent (never truncated).
    #[error("notification of {len} bytes exceeds the {limit}-byte limit")]
    NotifTooLarge {
        /// The message length.
        len: usize,
        /// The slot size.
        limit: usize,
    },
    /// Every send slot is in flight; poll and retry.
    #[error("all {slots} notification send slots are in flight")]
    NotifRingFull {
        /// The number of send slots.
        slots: usize,
    },
    /// The endpoint is not connected (or is being reconnected).
    #[error("endpoint is {state:?}, not connected")]
    NotConnected {
        /// Its state.
        state: super::EndpointState,
    },
    /// A peer's connection info could not be decoded.
    #[error("malformed connection info: {reason}")]
    BadConnectionInfo {
        /// What was wrong.
        reason: &'static str,
    },
    /// The queue pair did not flush its work requests in time during teardown.
    #[error("queue pair {qpn:#x}: {left} work requests did not flush during teardown")]
    DrainIncomplete {
        /// The local queue pair number.
        qpn: u32,
        /// Work requests still outstanding.
        left: usize,
    },
}

/// The status of a failed work completion (`ibv_wc_status`), named.
///
/// Unknown values are kept as numbers instead of reaching `sideway`'s panicking
/// conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletionStatus {
    code: u32,
    vendor_err: u32,
    byte_len: u32,
}

impl WorkCompletionStatus {
    /// `IBV_WC_SUCCESS`.
    pub const SUCCESS: u32 = 0;
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair went to the error state.
    pub const WR_FLUSH_ERR: u32 = 5;
    /// `IBV_WC_REM_ACCESS_ERR`: the responder refused the access (bad rkey or range).
    pub const REM_ACCESS_ERR: u32 = 10;

    pub(crate) fn new(code: u32, vendor_err: u32, byte_len: u32) -> Self {
        Self {
            code,
            vendor_err,
            byte_len,
        }
    }

    /// Bytes received (meaningful for a successful receive only).
    pub(crate) fn byte_len(self) -> u32 {
        self.byte_len
    }

    /// The raw `ibv_wc_status` value.
    pub fn code(self) -> u32 {
        self.code
    }

    /// The vendor error syndrome.
    pub fn vendor_err(self) -> u32 {
        self.vendor_err
    }

    /// Whether this completion only reports a flush (another work request failed first).
    pub fn is_flush(self) -> bool {
        self.code == Self::WR_FLUSH_ERR
    }

    /// The libibverbs name of the status (`IBV_WC_REM_ACCESS_ERR`, ...).
    pub fn name(self) -> &'static str {
        match self.code {
            0 => "IBV_WC_SUCCESS",
            1 => "IBV_WC_LOC_LEN_ERR",
            2 => "IBV_WC_LOC_QP_OP_ERR",
            3 => "IBV_WC_LOC_EEC_OP_ERR",
            4 => "IBV_WC_LOC_PROT_ERR",
            5 => "IBV_WC_WR_FLUSH_ERR",
            6 => "IBV_WC_MW_BIND_ERR",
            7 => "IBV_WC_BAD_RESP_ERR",
            8 => "IBV_WC_LOC_ACCESS_ERR",
            9 => "IBV_WC_REM_INV_REQ_ERR",
            10 => "IBV_WC_REM_ACCESS_ERR",
            11 => "IBV_WC_REM_OP_ERR",
            12 => "IBV_WC_RETRY_EXC_ERR",
            13 => "IBV_WC_RNR_RETRY_EXC_ERR",
            14 => "IBV_WC_LOC_RDD_VIOL_ERR",
            15 => "IBV_WC_REM_INV_RD_REQ_ERR",
            16 => "IBV_WC_REM_ABORT_ERR",
            17 => "IBV_WC_INV_EECN_ERR",
            18 => "IBV_WC_INV_EEC_STATE_ERR",
            19 => "IBV_WC_FATAL_ERR",
            20 => "IBV_WC_RESP_TIMEOUT_ERR",
            21 => "IBV_WC_GENERAL_ERR",
            22 => "IBV_WC_TM_ERR",
            23 => "IBV_WC_TM_RNDV_INCOMPLETE",
            _ => "unknown ibv_wc_status",
        }
    }
}

impl fmt::Display for WorkCompletionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}", self.name(), self.code)?;
        if self.vendor_err != 0 {
            write!(f, ", vendor error {:#x}", self.vendor_err)?;
        }
        f.write_str(")")
    }
}

/// Why the verbs backend cannot serve a peer (inside [`LinkError::Verbs`](crate::LinkError::Verbs)).
#[derive(Debug, thiserror::Error)]
pub enum VerbsLinkError {
    /// A verbs call failed: opening the device, a protection domain, an endpoint, a
    /// registration, a queue pair transition.
    #[error("verbs: {op} failed")]
    Verbs {
        /// What was done.
        op: &'static str,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
    /// As many remote-write grants as the agent holds at most are held.
    #[error("{max} remote-write grants are held already: clear reservations' fence words first")]
    TooManyGrants {
        /// The limit.
        max: usize,
    },
    /// IO on the queue-pair side channel (TCP) failed.
    #[error("verbs side channel: {op} failed")]
    SideChannel {
        /// What was done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer's metadata has no verbs entry.
    #[error("the peer offers no verbs backend (no RDMA device there)")]
    PeerHasNoVerbs,
    /// The peer's verbs entry lacks a usable side-channel address.
    #[error("the peer's verbs entry has no side-channel address")]
    NoSideChannelAddress,
    /// The other side refused the queue pair; `reason` is its text.
    #[error("the peer refused the queue pair: {reason}")]
    Refused {
        /// What the peer sent (at most 1 KiB, lossily decoded).
        reason: String,
    },
    /// This side refused a peer's request (P's side channel; logged only).
    #[error("refused the peer: {reason}")]
    RefusedPeer {
        /// What was sent to the peer.
        reason: String,
    },
    /// A side-channel message that breaks the format (an unknown or unexpected frame, a
    /// malformed body, another protocol version).
    #[error("malformed verbs side-channel message: {what}")]
    SideChannelMalformed {
        /// What was wrong.
        what: String,
    },
    /// The peer on the side channel is not the agent its metadata names.
    #[error("the peer's verbs side channel is served by {got:?}, not the agent its metadata names")]
    WrongPeer {
        /// The name it proved (or claimed, without a token).
        got: String,
    },
    /// The peer sent a connection info that does not decode.
    #[error("the peer's connection info is malformed")]
    BadConnectionInfo(#[source] VerbsError),
    /// The peer refused this agent's proof: a different or missing cluster token (or the
    /// queue-pair info changed on the way).
    #[error(
        "the peer's verbs side channel refused our proof: configure the same auth token on \
         both agents"
    )]
    ProofRejected,
    /// This agent has a token and the peer did not prove it (none configured there,
    /// another one, or its queue-pair info changed on the way).
    #[error(
        "the peer's verbs side channel did not prove the cluster token over its queue-pair \
         info: refusing it"
    )]
    WrongProof,
}

/// Why a region cannot be served to verbs peers through a host mirror, or a mirror
/// copy failed (inside [`LinkError::Mirror`](crate::LinkError::Mirror)).
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    /// Memory that verbs can register neither itself nor through a mirror.
    #[error("{kind} memory cannot be registered with verbs nor mirrored")]
    NotMirrorable {
        /// The region's kind.
        kind: MemoryKind,
        /// Why verbs refused the region itself, where it was tried.
        #[source]
        source: Option<VerbsError>,
    },
    /// Allocating a host mirror failed.
    #[error("allocating a {memory} mirror of {len} bytes failed")]
    Alloc {
        /// `host` or `cuda-pinned`.
        memory: &'static str,
        /// Its length.
        len: usize,
        /// The allocator's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// A pinned mirror for CUDA memory in a build without the `cuda` feature.
    #[error("pinned mirror on cuda:{ordinal}: this build has no `cuda` feature")]
    NoCudaMirror {
        /// The CUDA device.
        ordinal: u32,
    },
    /// A range of a mirrored region is unusable.
    #[error("range [{offset}+{len}] of a mirrored region is unusable")]
    Range {
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Why.
        #[source]
        source: RegionAccessError,
    },
    /// Copying a range region -> mirror (`sync_for_peers`) failed.
    #[error("copying [{offset}+{len}] of a {kind} region into its mirror failed")]
    SyncOut {
        /// The region's kind.
        kind: MemoryKind,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// The copy's error.
        #[source]
        source: StagingError,
    },
    /// Copying a range mirror -> region (after a read landed in the mirror) failed.
    #[error("copying [{offset}+{len}] from the mirror into its {kind} region failed")]
    SyncIn {
        /// The region's kind.
        kind: MemoryKind,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// The copy's error.
        #[source]
        source: StagingError,
    },
    /// Verbs refused to register the mirror or the region.
    #[error("verbs: {op} failed")]
    Register {
        /// What was done.
        op: &'static str,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
}
