//! Tensor-parallel pairing: which worker of one engine moves which KV heads to which
//! worker of another, when the two TP sizes may differ. D's reads (the decode core's
//! plan) and P's pushes (the agents' and the connector's writes) both follow these pairs.

use std::ops::Range;

use crate::KvSplit;

/// A (source worker, destination worker) pair whose heads overlap, and the global heads
/// they share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadPair {
    /// The source engine's rank.
    pub src: u32,
    /// The destination engine's rank.
    pub dst: u32,
    /// The global heads both hold.
    pub heads: Range<u32>,
}

/// The global heads rank `rank` of a `tp`-worker engine holds when `num_kv_heads` are
/// split evenly by head (`tp` must divide them; a zero `tp` is taken as one).
#[must_use]
pub fn heads_of_rank(num_kv_heads: u32, tp: u32, rank: u32) -> Range<u32> {
    let per = num_kv_heads / tp.max(1);
    rank * per..(rank + 1) * per
}

/// Every (source, destination) pair whose heads overlap, ordered by destination rank,
/// then source rank. With equal TP sizes that is each rank with itself, every head of
/// it; with `src_tp` a multiple of `dst_tp`, each destination gathers from
/// `src_tp / dst_tp` sources; the other way round each source scatters to
/// `dst_tp / src_tp` destinations. Both sizes must divide `num_kv_heads`.
#[must_use]
pub fn head_pairs(num_kv_heads: u32, src_tp: u32, dst_tp: u32) -> Vec<HeadPair> {
    (0..dst_tp)
        .flat_map(|dst| (0..src_tp).map(move |src| (src, dst)))
        .filter_map(|(src, dst)| {
            let (s, d) = (
                heads_of_rank(num_kv_heads, src_tp, src),
                heads_of_rank(num_kv_heads, dst_tp, dst),
            );
            let heads = s.start.max(d.start)..s.end.min(d.end);
            (heads.start < heads.end).then_some(HeadPair { src, dst, heads })
        })
        .collect()
}

/// The pairs that move KV from a `src_tp`-worker engine to a `dst_tp`-worker one:
/// split by head, [`head_pairs`]; replicated (MLA), each destination once, from source
/// rank `dst · src_tp / dst_tp` (spread over the sources when there are more, shared
/// when fewer), every head.
#[must_use]
pub fn tp_pairs(split: KvSplit, num_kv_heads: u32, src_tp: u32, dst_tp: u32) -> Vec<HeadPair> {
    match split {
        KvSplit::Heads => head_pairs(num_kv_heads, src_tp, dst_tp),
        KvSplit::Replicated => (0..dst_tp)
            .map(|dst| {
                let src = u64::from(dst) * u64::from(src_tp) / u64::from(dst_tp.max(1));
                HeadPair {
                    src: u32::try_from(src).unwrap_or(0),
                    dst,
                    heads: 0..num_kv_heads,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(h: u32, s: u32, d: u32) -> Vec<(u32, u32, Range<u32>)> {
        head_pairs(h, s, d)
            .into_iter()
            .map(|p| (p.src, p.dst, p.heads))
            .collect()
    }

    #[test]
    fn equal_sizes_pair_each_rank_with_itself() {
        assert_eq!(pairs(8, 2, 2), vec![(0, 0, 0..4), (1, 1, 4..8)]);
    }

    #[test]
    fn more_sources_gather_and_fewer_scatter() {
        assert_eq!(
            pairs(8, 4, 2),
            vec![(0, 0, 0..2), (1, 0, 2..4), (2, 1, 4..6), (3, 1, 6..8)]
        );
        assert_eq!(
            pairs(8, 1, 4),
            vec![(0, 0, 0..2), (0, 1, 2..4), (0, 2, 4..6), (0, 3, 6..8)]
        );
    }

    #[test]
    fn replicated_kv_is_moved_once_per_destination() {
        let r = |s, d| -> Vec<(u32, u32)> {
            tp_pairs(KvSplit::Replicated, 1, s, d)
                .into_iter()
                .map(|p| (p.src, p.dst))
                .collect()
        };
        assert_eq!(r(4, 2), vec![(0, 0), (2, 1)]);
        assert_eq!(r(1, 2), vec![(0, 0), (0, 1)]);
        assert_eq!(tp_pairs(KvSplit::Heads, 8, 2, 1), head_pairs(8, 2, 1));
    }

    #[test]
    fn every_head_is_covered_exactly_once() {
        for h in [1u32, 2, 4, 8, 12, 16] {
            let divisors: Vec<u32> = (1..=h).filter(|t| h % t == 0).collect();
            for &s in &divisors {
                for &d in &divisors {
                    let mut seen = vec![0u32; h as usize];
                    for p in head_pairs(h, s, d) {
                        assert!(heads_of_rank(h, s, p.src).start <= p.heads.start);
                        assert!(p.heads.end <= heads_of_rank(h, d, p.dst).end);
                        for x in p.heads {
                            seen[x as usize] += 1;
                        }
                    }
                    assert!(
                        seen.iter().all(|&n| n == 1),
                        "{h} heads, {s} -> {d}: {seen:?}"
                    );
                }
            }
        }
    }
}
