//! Reads: a batch checked, cut into chunks and handed to the peer's link; its status
//! polled until it settles.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use kvlease_gpu_mem::{RegionAccessError, RegionBytes};

use super::{Agent, Peer};
use crate::batch::{Batch, BatchPhase, BatchStatus};
use crate::context::Registered;
use crate::error::TransferError;
use crate::ids::{BatchId, LocalRange, PeerId, ReadBatch, ReadOp, RemoteRange};
use crate::link::Chunk;
use crate::sync::lock;

impl Agent {
    /// Posts a batch of reads from `peer`. Ops longer than `limits.chunk_len` are split;
    /// the chunks are striped over the peer's connections. The batch fails with
    /// [`TransferError::Timeout`] when it has not completed `timeout` after posting (the
    /// check happens in [`poll_batch`](Self::poll_batch)), earlier when the peer refuses
    /// a read or disconnects. On a shared-memory link the copies run on the calling thread:
    /// this returns once they are done (a batch over 8 MiB: once this thread's part is;
    /// copy threads do the rest).
    ///
    /// # Errors
    /// [`TransferError::UnknownPeer`]; [`TransferError::InvalidBatch`] for no ops, more
    /// than `limits.max_ops_per_batch`, an unregistered local region or a notification
    /// over the limit; [`TransferError::Local`] for a destination outside its region or
    /// not host-accessible; [`TransferError::Disconnected`] when no connection is left.
    pub fn post_read(
        &self,
        peer: PeerId,
        batch: ReadBatch,
        timeout: Duration,
    ) -> Result<BatchId, TransferError> {
        let p = self.peer(peer)?;
        self.check_batch(&p, &batch)?;
        let chunks = self.cut_into_chunks(&p, &batch.ops)?;
        let id = self.inner.ctx.fresh_id();
        let b = Arc::new(Batch::new(
            id,
            p.name.clone(),
            timeout,
            chunks.len(),
            batch.ops.len(),
            batch.fence,
            batch.notif,
        ));
        lock(&self.inner.batches).insert(id, (b.clone(), p.clone()));
        if let Err(e) = p.link.post_reads(&b, chunks) {
            lock(&self.inner.batches).remove(&id);
            return Err(e);
        }
        Ok(BatchId(id))
    }

    /// The checks of a batch as a whole: its number of ops and its notification's size.
    fn check_batch(&self, p: &Peer, batch: &ReadBatch) -> Result<(), TransferError> {
        if batch.ops.is_empty() {
            return Err(invalid(p, "a batch needs at least one read".into()));
        }
        if batch.ops.len() > self.inner.ctx.limits.max_ops_per_batch {
            return Err(invalid(
                p,
                format!(
                    "{} ops exceed the limit of {}",
                    batch.ops.len(),
                    self.inner.ctx.limits.max_ops_per_batch
                ),
            ));
        }
        if let Some(n) = &batch.notif
            && n.len() > self.inner.ctx.limits.max_notif_len
        {
            return Err(TransferError::NotifTooLarge {
                peer: p.name.clone(),
                len: n.len(),
                max: self.inner.ctx.limits.max_notif_len,
            });
        }
        Ok(())
    }

    /// Checks each op against its local region and cuts it into chunks of at most
    /// `limits.chunk_len` bytes, in op order.
    fn cut_into_chunks(&self, p: &Peer, ops: &[ReadOp]) -> Result<Vec<Chunk>, TransferError> {
        let chunk = self.inner.ctx.limits.chunk_len;
        let mut chunks = Vec::with_capacity(ops.len());
        let regions = self
            .inner
            .ctx
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        for op in ops {
            let local = regions.get(&op.local.region.0).ok_or_else(|| {
                invalid(
                    p,
                    format!("local region {:?} is not registered", op.local.region),
                )
            })?;
            check_local_range(p, local, &op.local)?;
            if op.local.len == 0 {
                return Err(invalid(p, "a read of zero bytes".into()));
            }
            if op.remote.offset.checked_add(op.local.len).is_none() {
                return Err(invalid(p, "remote range overflows".into()));
            }
            for (done, remote, len) in pieces(op.remote, op.local.len, chunk) {
                chunks.push(Chunk {
                    dest: local.region.clone(),
                    dest_offset: op.local.offset + done,
                    remote,
                    len,
                });
            }
        }
        Ok(chunks)
    }

    /// Where `batch` stands. `Done` and `Failed` are reported once; the id is forgotten
    /// afterwards.
    ///
    /// # Errors
    /// [`TransferError::UnknownBatch`] for an id never posted or already reported.
    pub fn poll_batch(&self, batch: BatchId) -> Result<BatchStatus, TransferError> {
        let (b, peer) = lock(&self.inner.batches)
            .get(&batch.0)
            .cloned()
            .ok_or(TransferError::UnknownBatch(batch))?;
        peer.link.progress();
        let expired = Instant::now() >= b.deadline;
        if !expired && !b.is_settled() {
            return Ok(BatchStatus::Pending);
        }
        let mut st = b.lock();
        if expired {
            st.fail(TransferError::Timeout {
                peer: b.peer.clone(),
                timeout: b.timeout,
            });
            if matches!(st.phase, BatchPhase::Failed(_)) {
                let receiving = st.in_receive > 0;
                drop(st);
                // Cancels queued chunks and cuts short a transfer into the destination.
                peer.link.on_timeout(&b);
                if receiving {
                    // Reported once that transfer has stopped (the next poll).
                    return Ok(BatchStatus::Pending);
                }
                st = b.lock();
            }
        }
        let status = match &st.phase {
            BatchPhase::Running => return Ok(BatchStatus::Pending),
            BatchPhase::Done(stats) => BatchStatus::Done(*stats),
            BatchPhase::Failed(_) if st.in_receive > 0 => return Ok(BatchStatus::Pending),
            BatchPhase::Failed(e) => BatchStatus::Failed(e.clone()),
        };
        drop(st);
        lock(&self.inner.batches).remove(&batch.0);
        Ok(status)
    }
}

/// [`TransferError::InvalidBatch`] for a batch to `p`.
/// `len` bytes from `remote` on, cut into pieces of at most `chunk` bytes (at least 1), in
/// order: `(offset into the op, the piece's remote range, its length)`. The caller has
/// checked that `remote.offset + len` does not overflow.
pub(super) fn pieces(
    remote: RemoteRange,
    len: u64,
    chunk: u64,
) -> impl Iterator<Item = (u64, RemoteRange, u64)> {
    let chunk = chunk.max(1);
    let step = usize::try_from(chunk).unwrap_or(usize::MAX);
    (0..len).step_by(step).map(move |done| {
        let piece = RemoteRange {
            offset: remote.offset + done,
            ..remote
        };
        (done, piece, chunk.min(len - done))
    })
}

fn invalid(p: &Peer, reason: String) -> TransferError {
    TransferError::InvalidBatch {
        peer: p.name.clone(),
        reason,
    }
}

/// Checks that `range` (a read's destination, a write's source) lies inside its local
/// region and, unless it is device memory (the TCP reader stages a read into the region,
/// a write's payload leaves through a host bounce buffer), that it is host-accessible.
pub(super) fn check_local_range(
    p: &Peer,
    local: &Registered,
    range: &LocalRange,
) -> Result<(), TransferError> {
    match local.region.check_host_range(range.offset, range.len) {
        // Device memory: staged on its way.
        Err(RegionAccessError::NotHostAccessible { .. }) => {
            let region_len = local.region.len() as u64;
            if range
                .offset
                .checked_add(range.len)
                .is_none_or(|end| end > region_len)
            {
                return Err(TransferError::Local {
                    peer: p.name.clone(),
                    source: RegionAccessError::OutOfBounds {
                        offset: range.offset,
                        len: range.len,
                        region_len,
                    },
                });
            }
            Ok(())
        }
        r => r.map_err(|source| TransferError::Local {
            peer: p.name.clone(),
            source,
        }),
    }
}
