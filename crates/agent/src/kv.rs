//! Deterministic KV content, its layout in a rank's block pool, and the `kv_digest`.
//!
//! The prefill agent stands in for a model: the KV value at (layer, token position `i`,
//! K|V, **global** head, dim) is a bf16 bit pattern derived from a rolling hash of
//! `tokens[0..=i]`. Two requests that share a prefix therefore get identical KV for that
//! prefix (what multi-turn reuse needs), and the decode agent can recompute and check every
//! byte it read.
//!
//! The digest is a wrapping sum of one hash per (layer, position, K|V, global head) chunk of
//! `head_dim` values, keyed by those global coordinates. A sum does not depend on the order
//! of its terms, so the digest is the same whichever TP split produced or read the chunks:
//! each rank sums its own heads and the ranks' partial digests add up to the whole.
//!
//! Tokenizer: byte level. A prompt's token ids are its UTF-8 bytes (0..=255); requests may
//! instead give `prompt_token_ids` (any `u32`). Generated text maps each output token onto a
//! lowercase ASCII letter, so it is always valid UTF-8.

use std::ops::Range;

/// The rolling hash of `tokens[0..=i]` for every `i`: the engine's, the one D's
/// cached-blocks params carry per block.
pub use kvlease_engine::prefix_hashes;

/// Bytes per KV element (bf16), the model shape and why a shape is unusable: the agents'
/// part of the engine-info handshake payload, defined with it in `kvlease_proto`.
pub use kvlease_proto::engine_info::{DTYPE_BYTES, KvShape, ShapeError};

/// Where a rank's KV bytes live inside its pool: `num_layers` layer regions one after the
/// other, each `num_blocks` blocks; block `b` of layer `l` is `[K heads][V heads]`, each head
/// `block_size × head_dim` bf16 values (the agreed `KvLayout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLayout {
    /// The model shape.
    pub shape: KvShape,
    /// Global heads of this rank.
    pub heads: Range<u32>,
    /// Blocks per layer in the pool.
    pub num_blocks: u32,
}

impl RankLayout {
    /// Heads on this rank.
    pub fn local_heads(&self) -> u32 {
        self.heads.end - self.heads.start
    }

    /// Bytes of one block of one layer (K and V of every local head).
    pub fn block_bytes(&self) -> usize {
        2 * self.local_heads() as usize * self.shape.head_block_bytes()
    }

    /// Bytes of one layer region.
    pub fn layer_bytes(&self) -> usize {
        self.num_blocks as usize * self.block_bytes()
    }

    /// Bytes of the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.shape.num_layers as usize * self.layer_bytes()
    }

    /// Byte offset of the head slice (`local_head` of K (`kv = 0`) or V (`kv = 1`)) of block
    /// `block` in layer `layer`.
    pub fn head_offset(&self, layer: u32, block: u32, kv: u32, local_head: u32) -> usize {
        layer as usize * self.layer_bytes()
            + block as usize * self.block_bytes()
            + (kv * self.local_heads() + local_head) as usize * self.shape.head_block_bytes()
    }

    /// Byte offset of the `head_dim` values of token `slot` inside that head slice.
    pub fn token_offset(
        &self,
        layer: u32,
        block: u32,
        kv: u32,
        local_head: u32,
        slot: u32,
    ) -> usize {
        self.head_offset(layer, block, kv, local_head)
            + slot as usize * self.shape.head_dim as usize * DTYPE_BYTES
    }
}

/// A finaliser with good avalanche (splitmix64's).
pub const fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Byte-level tokenizer: one token per UTF-8 byte.
pub fn tokenize(prompt: &str) -> Vec<u32> {
    prompt.bytes().map(u32::from).collect()
}

fn coord_key(prefix: u64, layer: u32, kv: u32, head: u32) -> u64 {
    mix(prefix ^ mix((u64::from(layer) << 40) ^ (u64::from(kv) << 39) ^ u64::from(head)))
}

/// Writes the `head_dim` bf16 values of (prefix hash, layer, K|V, global head) into `out`
/// (`head_dim × 2` bytes, little endian).
pub fn fill_values(out: &mut [u8], prefix: u64, layer: u32, kv: u32, head: u32) {
    let key = coord_key(prefix, layer, kv, head);
    for (dim, pair) in out.chunks_exact_mut(DTYPE_BYTES).enumerate() {
        let r = mix(key ^ dim as u64);
        // A finite bf16 of magnitude 2^-7 .. 2^4: sign, exponent 120..=131, 7 mantissa bits.
        let sign = ((r >> 63) as u16) << 15;
        let exp = 120 + (r % 12) as u16;
        let mant = ((r >> 8) & 0x7F) as u16;
        pair.copy_from_slice(&(sign | exp << 7 | mant).to_le_bytes());
    }
}

/// The hash of one chunk (`head_dim` values) at its global coordinates.
pub fn chunk_hash(bytes: &[u8], layer: u32, pos: usize, kv: u32, head: u32) -> u64 {
    let mut acc = mix((u64::from(layer) << 48)
        ^ ((pos as u64) << 9)
        ^ (u64::from(kv) << 8)
        ^ u64::from(head));
    for word in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..word.len()].copy_from_slice(word);
        acc = mix(acc ^ u64::from_le_bytes(w));
    }
    acc
}

/// An order-independent digest of KV content (the wrapping sum of its chunk hashes); its
/// wire form `kvd-<16 hex>` is part of `kv_transfer_params` and lives with their codec.
pub use kvlease_proto::params::KvDigest;

/// The digest of the whole model's KV for `tokens`, computed from the generator alone
/// (what any correct producer or reader must arrive at).
pub fn expected_digest(shape: &KvShape, tokens: &[u32]) -> KvDigest {
    let hashes = prefix_hashes(tokens);
    let mut buf = vec![0u8; shape.head_dim as usize * DTYPE_BYTES];
    let mut d = KvDigest::default();
    for layer in 0..shape.num_layers {
        for (pos, &h) in hashes.iter().enumerate() {
            for kv in 0..2 {
                for head in 0..shape.num_kv_heads {
                    fill_values(&mut buf, h, layer, kv, head);
                    d.add(KvDigest(chunk_hash(&buf, layer, pos, kv, head)));
                }
            }
        }
    }
    d
}

/// Offset of token `slot` of (K|V, local head) inside one block's image.
fn in_block(layout: &RankLayout, kv: u32, local: u32, slot: usize) -> usize {
    (kv * layout.local_heads() + local) as usize * layout.shape.head_block_bytes()
        + slot * layout.shape.head_dim as usize * DTYPE_BYTES
}

/// Fills the image of one block of one layer (`layout.block_bytes()` bytes) with the KV of
/// the positions `first..first + n` whose prefix hashes are `hashes` (`n = hashes.len()`,
/// at most `block_size`), and returns the partial digest of what it wrote. The tail of a
/// partly used block is left as it was.
///
/// # Panics
/// If `buf` is shorter than a block or `hashes` longer than `block_size` (the caller's
/// layout invariants).
pub fn fill_block(
    layout: &RankLayout,
    buf: &mut [u8],
    layer: u32,
    first: usize,
    hashes: &[u64],
) -> KvDigest {
    let width = layout.shape.head_dim as usize * DTYPE_BYTES;
    let mut d = KvDigest::default();
    for (slot, &h) in hashes.iter().enumerate() {
        for kv in 0..2 {
            for (local, head) in layout.heads.clone().enumerate() {
                let off = in_block(layout, kv, local as u32, slot);
                let out = &mut buf[off..off + width];
                fill_values(out, h, layer, kv, head);
                d.add(KvDigest(chunk_hash(out, layer, first + slot, kv, head)));
            }
        }
    }
    d
}

/// The partial digest of the positions `first..first + n` held in one block image.
///
/// # Panics
/// As [`fill_block`].
pub fn digest_block(
    layout: &RankLayout,
    buf: &[u8],
    layer: u32,
    first: usize,
    n: usize,
) -> KvDigest {
    let width = layout.shape.head_dim as usize * DTYPE_BYTES;
    let mut d = KvDigest::default();
    for slot in 0..n {
        for kv in 0..2 {
            for (local, head) in layout.heads.clone().enumerate() {
                let off = in_block(layout, kv, local as u32, slot);
                d.add(KvDigest(chunk_hash(
                    &buf[off..off + width],
                    layer,
                    first + slot,
                    kv,
                    head,
                )));
            }
        }
    }
    d
}

/// A byte of KV that differs from what the generator makes for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// Layer.
    pub layer: u32,
    /// Token position.
    pub pos: usize,
    /// 0 = K, 1 = V.
    pub kv: u32,
    /// Global head.
    pub head: u32,
}

/// Checks that a block image holds exactly the generator's bytes for the positions whose
/// prefix hashes are `hashes`, starting at `first`.
///
/// # Panics
/// As [`fill_block`].
pub fn verify_block(
    layout: &RankLayout,
    buf: &[u8],
    layer: u32,
    first: usize,
    hashes: &[u64],
) -> Option<Mismatch> {
    let width = layout.shape.head_dim as usize * DTYPE_BYTES;
    let mut want = vec![0u8; width];
    for (slot, &h) in hashes.iter().enumerate() {
        for kv in 0..2 {
            for (local, head) in layout.heads.clone().enumerate() {
                let off = in_block(layout, kv, local as u32, slot);
                fill_values(&mut want, h, layer, kv, head);
                if buf[off..off + width] != want[..] {
                    return Some(Mismatch {
                        layer,
                        pos: first + slot,
                        kv,
                        head,
                    });
                }
            }
        }
    }
    None
}

/// Calls `f(layer, index in blocks, first position, hashes of its positions)` for every
/// (layer, used block) of a request of `hashes.len()` tokens.
pub fn for_each_block(
    shape: &KvShape,
    hashes: &[u64],
    mut f: impl FnMut(u32, usize, usize, &[u64]),
) {
    let bs = shape.block_size as usize;
    for layer in 0..shape.num_layers {
        for (i, chunk) in hashes.chunks(bs).enumerate() {
            f(layer, i, i * bs, chunk);
        }
    }
}

/// Runs `per_worker` for every worker on its own scoped thread and adds up their digests;
/// the first error (a panicked thread counts as `panicked`) ends it.
///
/// # Errors
/// The first worker's error, in worker order.
pub(crate) fn digest_workers<W: Sync, E: Send>(
    workers: &[W],
    panicked: fn() -> E,
    per_worker: impl Fn(&W) -> Result<KvDigest, E> + Sync,
) -> Result<KvDigest, E> {
    let results: Vec<Result<KvDigest, E>> = std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .iter()
            .map(|w| {
                let per_worker = &per_worker;
                s.spawn(move || per_worker(w))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(panicked())))
            .collect()
    });
    let mut digest = KvDigest::default();
    for r in results {
        digest.add(r?);
    }
    Ok(digest)
}

fn block_image<'a>(layout: &RankLayout, pool: &'a [u8], layer: u32, block: u32) -> &'a [u8] {
    let off = layout.head_offset(layer, block, 0, 0);
    &pool[off..off + layout.block_bytes()]
}

/// Fills a whole pool image (tests and tools): the request's `blocks`, in token order.
///
/// # Panics
/// If `blocks` holds fewer than `shape.blocks_for(tokens.len())` ids or `pool` is smaller
/// than `layout.pool_bytes()`.
pub fn fill_rank(layout: &RankLayout, pool: &mut [u8], blocks: &[u32], tokens: &[u32]) -> KvDigest {
    let mut d = KvDigest::default();
    let hashes = prefix_hashes(tokens);
    for_each_block(&layout.shape, &hashes, |layer, i, first, hs| {
        let off = layout.head_offset(layer, blocks[i], 0, 0);
        d.add(fill_block(
            layout,
            &mut pool[off..off + layout.block_bytes()],
            layer,
            first,
            hs,
        ));
    });
    d
}

/// The partial digest of a pool image's request of `num_tokens` tokens in `blocks`.
///
/// # Panics
/// As [`fill_rank`].
pub fn digest_rank(
    layout: &RankLayout,
    pool: &[u8],
    blocks: &[u32],
    num_tokens: usize,
) -> KvDigest {
    let mut d = KvDigest::default();
    let hashes = vec![0; num_tokens];
    for_each_block(&layout.shape, &hashes, |layer, i, first, hs| {
        d.add(digest_block(
            layout,
            block_image(layout, pool, layer, blocks[i]),
            layer,
            first,
            hs.len(),
        ));
    });
    d
}

/// The first [`Mismatch`] of a pool image against the generator for `tokens`, if any.
///
/// # Panics
/// As [`fill_rank`].
pub fn verify_rank(
    layout: &RankLayout,
    pool: &[u8],
    blocks: &[u32],
    tokens: &[u32],
) -> Option<Mismatch> {
    let mut first_bad = None;
    let hashes = prefix_hashes(tokens);
    for_each_block(&layout.shape, &hashes, |layer, i, first, hs| {
        if first_bad.is_none() {
            first_bad = verify_block(
                layout,
                block_image(layout, pool, layer, blocks[i]),
                layer,
                first,
                hs,
            );
        }
    });
    first_bad
}

/// The `n` output tokens a decode derives from the verified KV: each step hashes the digest
/// with the step number and maps it onto a letter `a..=z`.
pub fn decode_text(digest: KvDigest, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let r = mix(digest.0 ^ mix(i as u64));
            char::from(b'a' + (r % 26) as u8).to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape {
        num_layers: 2,
        num_kv_heads: 4,
        block_size: 4,
        head_dim: 8,
    };

    fn filled(
        tp: u32,
        rank: u32,
        tokens: &[u32],
        blocks: &[u32],
    ) -> (RankLayout, Vec<u8>, KvDigest) {
        let layout = RankLayout {
            shape: SHAPE,
            heads: SHAPE.heads_of_rank(tp, rank).expect("valid split"),
            num_blocks: 8,
        };
        let mut pool = vec![0u8; layout.pool_bytes()];
        let d = fill_rank(&layout, &mut pool, blocks, tokens);
        (layout, pool, d)
    }

    #[test]
    fn digest_is_the_same_for_every_tp_split() {
        let tokens = tokenize("hello, kvlease");
        let want = expected_digest(&SHAPE, &tokens);
        for tp in [1, 2, 4] {
            let mut sum = KvDigest::default();
            for rank in 0..tp {
                let (layout, pool, d) = filled(tp, rank, &tokens, &[7, 2, 5, 0]);
                assert_eq!(digest_rank(&layout, &pool, &[7, 2, 5, 0], tokens.len()), d);
                assert_eq!(verify_rank(&layout, &pool, &[7, 2, 5, 0], &tokens), None);
                sum.add(d);
            }
            assert_eq!(sum, want, "tp {tp}");
        }
    }

    #[test]
    fn shared_prefix_gives_identical_kv_and_one_flipped_bit_is_caught() {
        let a = tokenize("shared prefix A");
        let b = tokenize("shared prefix B");
        let (layout, pa, _) = filled(2, 1, &a, &[0, 1, 2, 3]);
        let (_, pb, _) = filled(2, 1, &b, &[0, 1, 2, 3]);
        // Tokens 0..=13 are shared: block 0..=2 and the first 2 slots of block 3 match.
        let shared = layout.token_offset(0, 3, 0, 0, 2);
        assert_eq!(pa[..shared], pb[..shared]);
        assert_ne!(pa, pb);

        let mut bad = pa.clone();
        let off = layout.token_offset(1, 2, 1, 1, 3) + 5;
        bad[off] ^= 0x01;
        assert_eq!(
            verify_rank(&layout, &bad, &[0, 1, 2, 3], &a),
            Some(Mismatch {
                layer: 1,
                pos: 11,
                kv: 1,
                head: 3
            })
        );
        let good = digest_rank(&layout, &pa, &[0, 1, 2, 3], a.len());
        assert_ne!(digest_rank(&layout, &bad, &[0, 1, 2, 3], a.len()), good);
    }

    #[test]
    fn values_are_finite_bf16_and_digest_round_trips() {
        let mut buf = vec![0u8; 64 * 2];
        fill_values(&mut buf, 42, 0, 1, 3);
        for pair in buf.chunks_exact(2) {
            let bits = u16::from_le_bytes([pair[0], pair[1]]);
            let exp = (bits >> 7) & 0xFF;
            assert!((120..=131).contains(&exp));
        }
        let d = KvDigest(0x0123_4567_89ab_cdef);
        assert_eq!(KvDigest::parse(&d.to_string()), Some(d));
        assert_eq!(KvDigest::parse("kvd-xyz"), None);
        assert_eq!(decode_text(d, 3), decode_text(d, 3));
        assert_eq!(decode_text(d, 5).len(), 5);
    }

    #[test]
    fn bad_splits_are_rejected_by_name() {
        assert_eq!(
            SHAPE.heads_of_rank(3, 0),
            Err(ShapeError::Indivisible {
                num_kv_heads: 4,
                tp_size: 3
            })
        );
        assert_eq!(
            SHAPE.heads_of_rank(2, 2),
            Err(ShapeError::BadRank {
                rank: 2,
                tp_size: 2
            })
        );
        let zero = KvShape {
            head_dim: 0,
            ..SHAPE
        };
        assert_eq!(
            zero.validate(1),
            Err(ShapeError::Zero { field: "head_dim" })
        );
    }
}
