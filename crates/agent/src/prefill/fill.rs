//! Filling a prefilled request's blocks on every worker (and verifying pulled ones), and
//! syncing them into the verbs mirror before their generation is published.

use super::*;

/// Why filling (or syncing) a request's blocks failed.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// A block could not be written or read back.
    #[error("block {block} of layer {layer}: {source}")]
    Copy {
        /// Layer.
        layer: u32,
        /// Block.
        block: u32,
        /// The pool's error.
        #[source]
        source: kvlease_gpu_mem::BlockCopyError,
    },
    /// A block pulled from D does not hold the KV of the tokens.
    #[error("pulled KV mismatch at layer {layer} position {pos}")]
    PulledMismatch {
        /// Layer.
        layer: u32,
        /// Token position.
        pos: usize,
    },
    /// A block id is outside the pool.
    #[error("block range: {0}")]
    Layout(#[from] kvlease_gpu_mem::LayoutError),
    /// The verbs mirror could not be synced.
    #[error("syncing the verbs mirror: {0}")]
    Sync(#[from] kvlease_transport::RegisterError),
    /// A fill thread panicked.
    #[error("fill thread panicked")]
    Panicked,
}

/// Fills the request's blocks on every worker (one thread per worker) and returns the
/// whole digest. The first `pulled` blocks already hold KV read from D: they are verified
/// against the tokens byte by byte and digested instead of filled.
pub(super) fn fill_workers(
    workers: &[Worker],
    blocks: &[u32],
    tokens: &[u32],
    pulled: usize,
) -> Result<KvDigest, FillError> {
    let hashes = kv::prefix_hashes(tokens);
    kv::digest_workers(
        workers,
        || FillError::Panicked,
        |w| fill_worker(w, blocks, &hashes, pulled),
    )
}

pub(super) fn fill_worker(
    w: &Worker,
    blocks: &[u32],
    hashes: &[u64],
    pulled: usize,
) -> Result<KvDigest, FillError> {
    let mut digest = KvDigest::default();
    let mut buf = vec![0u8; w.layout.block_bytes()];
    let mut result = Ok(());
    kv::for_each_block(&w.layout.shape, hashes, |layer, i, first, hs| {
        if result.is_err() {
            return;
        }
        if i < pulled {
            result = w
                .pool
                .read_block(layer, BlockId(blocks[i]), &mut buf)
                .map_err(|source| FillError::Copy {
                    layer,
                    block: blocks[i],
                    source,
                })
                .and_then(
                    |()| match kv::verify_block(&w.layout, &buf, layer, first, hs) {
                        None => Ok(()),
                        Some(m) => Err(FillError::PulledMismatch {
                            layer: m.layer,
                            pos: m.pos,
                        }),
                    },
                );
            if result.is_ok() {
                digest.add(kv::digest_block(&w.layout, &buf, layer, first, hs.len()));
            }
            return;
        }
        buf.fill(0);
        digest.add(kv::fill_block(&w.layout, &mut buf, layer, first, hs));
        // Host memory directly, device memory through a staged copy.
        result = w
            .pool
            .write_block(layer, BlockId(blocks[i]), &buf)
            .map_err(|source| FillError::Copy {
                layer,
                block: blocks[i],
                source,
            });
    });
    result?;
    // Before the fence generation is published: verbs peers of a mirrored pool read the
    // mirror (the pulled blocks too, which may have arrived over TCP into the pool only).
    sync_blocks_for_peers(&w.agent, RegionId(w.pool_desc.id), &w.pool, blocks)?;
    Ok(digest)
}

/// Copies `blocks` (every layer) of `pool`, registered as `region`, into the transport's
/// verbs mirror of it, so that peers' RDMA READs see what was just written. A no-op unless
/// verbs serves the pool through a host mirror (device memory without dmabuf, staged
/// memory). Call it after writing blocks and before publishing their fence generation.
pub(crate) fn sync_blocks_for_peers(
    agent: &Agent,
    region: RegionId,
    pool: &BlockPool,
    blocks: &[u32],
) -> Result<(), FillError> {
    if !agent.is_mirrored(region) {
        return Ok(());
    }
    let layout = pool.layout();
    let sync = |r: std::ops::Range<u64>| agent.sync_for_peers(region, r.start, r.end - r.start);
    for layer in 0..layout.num_layers() {
        // Adjacent blocks are copied in one go.
        let mut run: Option<std::ops::Range<u64>> = None;
        for &b in blocks {
            let r = layout.block_range(layer, BlockId(b))?;
            run = match run {
                Some(cur) if cur.end == r.start => Some(cur.start..r.end),
                Some(cur) => {
                    sync(cur)?;
                    Some(r)
                }
                None => Some(r),
            };
        }
        if let Some(cur) = run {
            sync(cur)?;
        }
    }
    Ok(())
}
