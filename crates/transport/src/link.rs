//! The backend seam: what every backend (TCP, shared memory with cross-memory attach and
//! CUDA IPC, verbs) implements for one connected peer.
//!
//! The agent cuts a [`ReadBatch`](crate::ReadBatch) into [`Chunk`]s and hands them to the
//! peer's [`Link`]; the link completes them through the shared batch state
//! ([`Batch::lock`] → `chunk_done` / `fence_done` / `finish` / `fail`, see `batch.rs`),
//! performing the fence read and sending the notification in the order
//! [`Next`](crate::batch::Next) says. Received notifications reach the agent through the
//! [`Context`](crate::context::Context) the backend was given (`deliver_notif`) or a
//! [`NotifSource`](crate::notify::NotifSource) it registered. A fenced one-sided WRITE
//! is [`post_writes`](Link::post_writes): the same batch state, completed chunk by chunk
//! as the peer acknowledges each write landed; TCP and shared memory implement it (the
//! peer's process lands each write under its write-fence lock); a verbs link sends them
//! over its TCP link, or as RDMA WRITEs into ranges the peer granted
//! ([`post_granted_writes`](Link::post_granted_writes)).

use std::fmt;
use std::sync::Arc;

use kvlease_gpu_mem::DmaRegion;

use crate::batch::Batch;
use crate::error::TransferError;
use crate::ids::{RemoteRange, WriteFence, WriteGrant};

/// One chunk of a read op: `len` bytes from `remote` into `dest` at `dest_offset`.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) dest: Arc<dyn DmaRegion>,
    pub(crate) dest_offset: u64,
    pub(crate) remote: RemoteRange,
    pub(crate) len: u64,
}

/// One chunk of a write op: `len` bytes of `src` at `src_offset` into `remote`.
#[derive(Debug, Clone)]
pub(crate) struct WriteChunk {
    pub(crate) src: Arc<dyn DmaRegion>,
    pub(crate) src_offset: u64,
    pub(crate) remote: RemoteRange,
    pub(crate) len: u64,
}

/// How reads and notifications reach one connected peer.
pub(crate) trait Link: Send + Sync + fmt::Debug {
    /// Starts the chunks' reads into `batch`; completes them through [`Batch::lock`].
    fn post_reads(&self, batch: &Arc<Batch>, chunks: Vec<Chunk>) -> Result<(), TransferError>;

    /// Starts the chunks' fenced writes into `batch`, each checked on the peer against
    /// `fence`; completes them through [`Batch::lock`] as the peer acknowledges each.
    /// Backends without a write path refuse with [`TransferError::Unsupported`].
    fn post_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), TransferError> {
        let _ = (chunks, fence);
        Err(TransferError::Unsupported {
            peer: batch.peer.clone(),
            reason: "write not supported on this backend".into(),
        })
    }

    /// Starts fenced writes that the peer also granted remote-write access for
    /// (`grants`, one per granted range; every chunk lies inside one). A backend whose
    /// writes land in the peer's process ignores the grants (the peer's receiver checks
    /// the fence word); verbs posts RDMA WRITEs naming the grants' rkeys.
    fn post_granted_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
        grants: &[WriteGrant],
    ) -> Result<(), TransferError> {
        let _ = grants;
        self.post_writes(batch, chunks, fence)
    }

    /// Sends one notification to the peer, in order with the batches' notifications.
    fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError>;

    /// Reaps completions of a backend whose hardware completes reads (verbs) on the
    /// caller's thread; backends that complete on their own threads do nothing.
    fn progress(&self) {}

    /// `batch` timed out: stop transfers into its memory.
    fn on_timeout(&self, batch: &Batch);

    /// Closes the link; posted batches fail.
    fn close(&self);
}
