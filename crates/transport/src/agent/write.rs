//! Fenced writes: a batch checked, cut into chunks and handed to the peer's link (the
//! writer's side); the write-fence word published and cleared under the lock the
//! receiver lands writes under (the receiver's side). Polled as reads are
//! ([`Agent::poll_batch`]).

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use kvlease_gpu_mem::RegionBytes;

use super::Agent;
use crate::batch::Batch;
use crate::error::{RegisterError, TransferError};
use crate::ids::{BatchId, LocalRange, PeerId, RegionId, WriteBatch, WriteGrant};
use crate::link::WriteChunk;
use crate::sync::lock;
use crate::tcp::wire::MAX_WRITE_LEN;

impl Agent {
    /// Posts a batch of fenced writes to `peer`: each op's source range of this agent
    /// into a range the peer registered. The sources are sent straight from their
    /// regions by the connections' writer threads (memory a socket cannot read, CUDA
    /// device or staged host memory, through a host bounce buffer: one chunk copied
    /// out, then sent): keep them unchanged until the batch ended (as a read's
    /// destination). The peer lands into destinations of any memory kind. Ops longer
    /// than `limits.chunk_len` (or 16 MiB) are split; the chunks are striped over the
    /// peer's connections.
    ///
    /// The peer lands each chunk only if, once its bytes arrived, the fence word
    /// `batch.fence.remote` holds `batch.fence.expected` (checked under the lock of the
    /// peer's [`set_write_fence`](Self::set_write_fence)); otherwise nothing of that
    /// chunk lands and the batch fails with [`TransferError::Stale`]. Every backend that
    /// writes lands on the peer's side this way, in the peer's process. The notification,
    /// if any, is sent only once every chunk landed. The batch ends as a read batch does
    /// ([`poll_batch`](Self::poll_batch)): `Done`, or `Failed` with `Stale`, a refusal, a
    /// disconnect or [`TransferError::Timeout`]. Chunks that landed before a failure
    /// stay landed.
    ///
    /// TCP and shared-memory links write (a shared-memory link sends the chunks on its
    /// Unix socket and the peer's process lands them, see `shm::write`; this call then
    /// returns once every chunk was answered); a verbs link sends them over its TCP link
    /// (RDMA WRITEs need the peer's grants: [`post_write_granted`](Self::post_write_granted)).
    ///
    /// # Errors
    /// [`TransferError::UnknownPeer`]; [`TransferError::InvalidBatch`] for no ops, more
    /// than `limits.max_ops_per_batch`, an unregistered local region, a write of zero
    /// bytes or a notification over the limit; [`TransferError::Local`] for a source
    /// outside its region; [`TransferError::Disconnected`] when no connection is left;
    /// [`TransferError::Unsupported`] on a backend without writes.
    pub fn post_write(
        &self,
        peer: PeerId,
        batch: WriteBatch,
        timeout: Duration,
    ) -> Result<BatchId, TransferError> {
        self.post_write_granted(peer, batch, &[], timeout)
    }

    /// [`post_write`](Self::post_write) into ranges the peer granted remote-write access
    /// to ([`grant_write`](Self::grant_write) on the peer, one grant per range, handed
    /// over with the reservation). On a verbs link the chunks go as RDMA WRITEs naming
    /// the grants' rkeys, with no CPU of the peer involved: the peer's fence is the
    /// grant, which it revokes when the reservation's fence word changes, so a write
    /// after that fails here with [`TransferError::Stale`] and changes no byte there.
    /// Other links ignore the grants and land the writes as `post_write` does.
    ///
    /// # Errors
    /// As `post_write`; [`TransferError::InvalidBatch`] (on a verbs link) for a grant of
    /// another generation than `batch.fence.expected` or a write outside every grant.
    pub fn post_write_granted(
        &self,
        peer: PeerId,
        batch: WriteBatch,
        grants: &[WriteGrant],
        timeout: Duration,
    ) -> Result<BatchId, TransferError> {
        let p = self.peer(peer)?;
        let limits = &self.inner.ctx.limits;
        let invalid = |reason: String| TransferError::InvalidBatch {
            peer: p.name.clone(),
            reason,
        };
        if batch.ops.is_empty() {
            return Err(invalid("a batch needs at least one write".into()));
        }
        if batch.ops.len() > limits.max_ops_per_batch {
            return Err(invalid(format!(
                "{} ops exceed the limit of {}",
                batch.ops.len(),
                limits.max_ops_per_batch
            )));
        }
        if let Some(n) = &batch.notif
            && n.len() > limits.max_notif_len
        {
            return Err(TransferError::NotifTooLarge {
                peer: p.name.clone(),
                len: n.len(),
                max: limits.max_notif_len,
            });
        }
        let chunk = limits.chunk_len.min(MAX_WRITE_LEN);
        let mut chunks = Vec::with_capacity(batch.ops.len());
        {
            let regions = self
                .inner
                .ctx
                .regions
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            for op in &batch.ops {
                let local = regions.get(&op.local.region.0).ok_or_else(|| {
                    invalid(format!(
                        "local region {:?} is not registered",
                        op.local.region
                    ))
                })?;
                if op.local.len == 0 {
                    return Err(invalid("a write of zero bytes".into()));
                }
                super::read::check_local_range(&p, local, &op.local)?;
                if op.remote.offset.checked_add(op.local.len).is_none() {
                    return Err(invalid("remote range overflows".into()));
                }
                for (done, remote, len) in super::read::pieces(op.remote, op.local.len, chunk) {
                    chunks.push(WriteChunk {
                        src: local.region.clone(),
                        src_offset: op.local.offset + done,
                        remote,
                        len,
                    });
                }
            }
        }
        let id = self.inner.ctx.fresh_id();
        let b = Arc::new(Batch::new(
            id,
            p.name.clone(),
            timeout,
            chunks.len(),
            batch.ops.len(),
            None,
            batch.notif,
        ));
        lock(&self.inner.batches).insert(id, (b.clone(), p.clone()));
        let posted = if grants.is_empty() {
            p.link.post_writes(&b, chunks, batch.fence)
        } else {
            p.link.post_granted_writes(&b, chunks, batch.fence, grants)
        };
        if let Err(e) = posted {
            lock(&self.inner.batches).remove(&id);
            return Err(e);
        }
        Ok(BatchId(id))
    }

    //= docs/spec.md#the-write-fence
    //# D gives blocks to another request only after the reservation ended, and it revokes
    //# remote access to them (verbs) or stops admitting the generation (every other
    //# backend) before that
    /// Stores `generation` into the write-fence word at `offset` of the registered
    /// region `region` (8 bytes, 8-aligned, host memory), under the lock this agent's
    /// receiver lands peers' writes under. Publish a reservation's generation with it
    /// before peers write, and clear it (store any other value, e.g. 0) when the
    /// reservation ends: once this returns, no write checked against the old generation
    /// lands any more, not even one whose bytes were arriving during the call (it lands
    /// wholly before, or not at all). Change a write-fence word only through this.
    ///
    /// # Errors
    /// [`RegisterError::Unknown`] when `region` is not registered;
    /// [`RegisterError::Range`] when the word lies outside it, is misaligned or not in
    /// host memory.
    pub fn set_write_fence(
        &self,
        region: RegionId,
        offset: u64,
        generation: u64,
    ) -> Result<(), RegisterError> {
        let r = self
            .inner
            .ctx
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&region.0)
            .map(|r| r.region.clone())
            .ok_or(RegisterError::Unknown(region))?;
        let _fence = self.inner.ctx.write_fences.lock(region.0, offset);
        r.store_u64(offset, generation)
            .map_err(|source| RegisterError::Range { region, source })?;
        // Verbs grants of any other generation on this word are deregistered before
        // this returns: a peer's RDMA WRITE naming one fails from now on.
        #[cfg(feature = "verbs")]
        if let Ok(v) = &self.inner.verbs {
            v.revoke_writes(region.0, offset, generation);
        }
        Ok(())
    }

    //= docs/spec.md#the-write-fence
    //# D gives blocks to another request only after the reservation ended, and it revokes
    //# remote access to them (verbs) or stops admitting the generation (every other
    //# backend) before that
    /// Grants verbs peers remote-write access to `dest` (a range of a registered host
    /// region of this agent) for the reservation whose fence word is at `fence_offset`
    /// of `fence_region` and currently holds `generation` (published with
    /// [`set_write_fence`](Self::set_write_fence)). Hand the returned grant to the
    /// writer with the reservation; it names it in
    /// [`post_write_granted`](Self::post_write_granted).
    ///
    /// The range gets a registration of its own with remote-write access (the region's
    /// own registration serves only reads), and a fresh rkey. The grant lives until the
    /// fence word changes: `set_write_fence` on that word with any other value
    /// deregisters it before returning, so once the clear returned, no RDMA WRITE of
    /// the old generation lands in `dest`, not even one in flight during the call.
    ///
    /// # Errors
    /// [`RegisterError::Unknown`] for an unregistered region;
    /// [`RegisterError::Range`] for a fence word outside its region or misaligned;
    /// [`RegisterError::Grant`] when the fence word does not hold `generation` (nothing
    /// granted), on an agent without a verbs backend, or when the registration fails
    /// (memory verbs serves through a mirror or dmabuf gets no grant: its writers use
    /// [`post_write`](Self::post_write), fenced by this agent's receiver).
    pub fn grant_write(
        &self,
        fence_region: RegionId,
        fence_offset: u64,
        generation: u64,
        dest: LocalRange,
    ) -> Result<WriteGrant, RegisterError> {
        let regions = self
            .inner
            .ctx
            .regions
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let fence = regions
            .get(&fence_region.0)
            .map(|r| r.region.clone())
            .ok_or(RegisterError::Unknown(fence_region))?;
        let target = regions
            .get(&dest.region.0)
            .map(|r| r.region.clone())
            .ok_or(RegisterError::Unknown(dest.region))?;
        drop(regions);
        let _fence = self
            .inner
            .ctx
            .write_fences
            .lock(fence_region.0, fence_offset);
        let word = fence
            .load_u64(fence_offset)
            .map_err(|source| RegisterError::Range {
                region: fence_region,
                source,
            })?;
        if word != generation {
            return Err(RegisterError::Grant {
                region: dest.region,
                reason: format!(
                    "the fence word holds generation {word}, not {generation}: publish it with set_write_fence first"
                ),
            });
        }
        #[cfg(feature = "verbs")]
        {
            let v = self
                .inner
                .verbs
                .as_ref()
                .map_err(|e| RegisterError::Grant {
                    region: dest.region,
                    reason: format!("no verbs backend: {}", e.chain()),
                })?;
            let rkey = v
                .grant_write(
                    (fence_region.0, fence_offset),
                    generation,
                    dest.region.0,
                    target,
                    dest.offset,
                    dest.len,
                )
                .map_err(|e| RegisterError::Grant {
                    region: dest.region,
                    reason: e.chain(),
                })?;
            Ok(WriteGrant {
                region: dest.region.0,
                offset: dest.offset,
                len: dest.len,
                generation,
                rkey,
            })
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = target;
            Err(RegisterError::Grant {
                region: dest.region,
                reason: "this build has no verbs backend (feature `verbs` off)".into(),
            })
        }
    }
}
