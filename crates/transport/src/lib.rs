//! Registered memory, batched one-sided reads, fenced one-sided writes and notifications
//! for kvlease, shaped like NIXL's agent.
//!
//! An [`Agent`] registers [`DmaRegion`](kvlease_gpu_mem::DmaRegion)s, publishes its
//! [`metadata`](Agent::metadata), [`connect`](Agent::connect)s to peers from theirs, posts
//! [`ReadBatch`]es (local destination ranges ← remote ranges, an optional notification
//! delivered after the reads, an optional [`FenceRead`]) and polls them, and exchanges
//! notifications ([`Agent::send_notif`], [`Agent::get_new_notifs`]).
//!
//! # Backends
//! - **TCP** (always built): P's agent serves reads on its own threads straight from
//!   registered memory; D receives straight into the destination. Every read carries the
//!   region key and is bounds-checked; with a cluster token, only peers that proved it
//!   get reads served or notifications accepted. Notifications have a connection of
//!   their own per link, read by [`Agent::get_new_notifs`] on the caller's thread (no
//!   thread wake-up per message) and written without blocking (a bounded queue, then
//!   [`TransferError::NotifQueueFull`]). See the `tcp` module.
//! - **shm** (always built, Linux): a peer on the same host (same boot id and network
//!   namespace, announced in the metadata) gets P's memfd-backed host regions over an
//!   abstract Unix socket (`SCM_RIGHTS`, after the same token proof as TCP), maps them
//!   read-only and serves its reads with plain memory copies on the posting thread; its
//!   notifications travel through a shared-memory ring P created for it, which P's
//!   [`Agent::get_new_notifs`] drains on the caller's thread. With the `cuda` feature, P's
//!   CUDA device regions are handed over as CUDA IPC handles and D reads them with device
//!   copies (correct on one H200, 2026-12-04; figures in `docs/benchmarks.md`). P's host regions that are not memfd-backed (Python
//!   buffers and tensors) are handed over as (address, length) and D reads them with
//!   cross-memory attach (`process_vm_readv`, [`CmaPolicy`]), or over TCP where the kernel
//!   refuses it. See the `shm` module.
//! - **verbs** (feature `verbs`): RDMA READ over RC queue pairs, in `src/verbs/`.
//!
//! # Layering
//! From the bottom up: `ids` (the shared ids and ranges; it imports nothing of the crate),
//! `config`, `stats`, `sync`, `error`, `metadata`, `batch` (the backend-neutral state of
//! a read batch), `notify` (notification sources and sinks), `context` (the narrow state
//! a backend receives: name, credentials, limits, registered regions, the inbox, the
//! counters, inbound-connection bookkeeping, its metadata entry), `link` (the `Link`
//! trait each backend implements for one peer: post reads, post writes, send
//! notifications, progress, time out, close), then the backends
//! `tcp`, `shm` (with cross-memory attach and CUDA IPC) and `verbs`, and on top the
//! [`Agent`], which owns the context and each backend's own state and picks a backend
//! per peer in `Agent::connect` ([`BackendChoice::Auto`]: shm, then verbs, then TCP).
//! A backend stores what its peers need in the metadata's `backends` map
//! (`Context::set_backend_metadata`). No module imports one above it.
//!
//! # Fenced reads
//! A batch may end with a [`FenceRead`] of an 8-byte generation word (e.g. a slot of
//! `kvlease_gpu_mem::FenceTable`), performed only after every data read of the batch
//! completed. A word other than the expected one fails the batch with
//! [`TransferError::FenceMismatch`] (and its notification is not sent): the data may come
//! from released or reused blocks.
//!
//! # Fenced writes
//! Push mode's data path: [`Agent::post_write`] posts a [`WriteBatch`] (local source
//! ranges → ranges the peer registered, an optional notification sent once every write
//! landed, and a [`WriteFence`]: the peer's generation word and the generation the writes
//! answer). The receiver lands a write only if, once its bytes arrived and under the lock
//! its [`Agent::set_write_fence`] takes, the word holds that generation; otherwise nothing
//! of it lands and the batch fails with [`TransferError::Stale`]. So once the receiver
//! cleared the word, no write for the old generation lands. TCP and shm implement it (on
//! shm the writer sends each write on the link's Unix socket and the receiver's process
//! lands it, into memfd-backed or plain heap memory alike); verbs refuses writes with
//! [`TransferError::Unsupported`].
//!
//! # What this crate does not do
//! It reads no clock except to enforce the timeouts the caller passes, does not decide
//! what to read (that is the agents' lease protocol), does not retry or reconnect, and
//! does not parse notifications (that is `kvlease-notif`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod acceptor;
mod agent;
mod batch;
pub mod clock_probe;
mod config;
mod context;
pub mod deadline;
mod error;
mod ids;
mod link;
pub mod metadata;
mod notify;
mod sessions;
mod shm;
pub mod sidechannel;
pub mod slots;
mod stats;
mod sync;
mod tcp;

// `unsafe` is allowed only in three verbs modules, each with its own
// `#[allow(unsafe_code)]`: `verbs::memory` and `verbs::endpoint` (raw memory handed to
// libibverbs) and `verbs::mirror` (a mirror's bytes lent to the staging copy).
#[cfg(feature = "verbs")]
pub mod verbs;

pub use agent::Agent;
pub use batch::{BatchStats, BatchStatus};
pub use config::{
    AgentConfig, Backend, BackendChoice, CmaPolicy, DEFAULT_MAX_NOTIF_LEN,
    DEFAULT_MAX_PENDING_NOTIF_BYTES, Limits,
};
pub use error::{
    AgentError, ConnectError, LinkError, MetadataError, Refusal, RegisterError, TransferError,
};
pub use ids::{
    BatchId, FenceRead, LocalRange, MAX_NAME_LEN, PeerId, PeerName, ReadBatch, ReadOp, RegionId,
    RemoteRange, Sender, WriteBatch, WriteFence, WriteGrant, WriteOp,
};
pub use kvlease_proto::auth::Session;
pub use metadata::{AgentMetadata, RegionDesc};
pub use shm::error::ShmError;
pub use stats::{StatsHandle, TransportStats};
