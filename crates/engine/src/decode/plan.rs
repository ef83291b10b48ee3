//! The decode core's TP planning: whether P's TP size fits the model, and which (D worker,
//! P worker) pairs read which heads, one read batch and one lease consumer each.

use std::ops::Range;

use kvlease_lease::ConsumerId;
use kvlease_notif::ReadComplete;

use super::{AdmitError, BatchPlan, DecodeCore, KvSplit, RemoteKv};

impl DecodeCore {
    /// Why P's TP size `p_tp` cannot split this model's heads (`None`: it can). A
    /// replicated KV (MLA) fits any P TP size.
    pub(super) fn tp_misfit(&self, p_tp: u32) -> Option<AdmitError> {
        let misfit = match self.config.kv_split {
            KvSplit::Heads => p_tp == 0 || !self.config.num_kv_heads.is_multiple_of(p_tp),
            KvSplit::Replicated => p_tp == 0,
        };
        misfit.then_some(AdmitError::TpSize {
            p_tp,
            heads: self.config.num_kv_heads,
        })
    }

    /// The heads of worker `rank` of an engine of `tp` workers: its share of the heads,
    /// or every head when the KV is replicated.
    pub(super) fn heads_of(&self, tp: u32, rank: u32) -> Range<u32> {
        match self.config.kv_split {
            KvSplit::Heads => crate::tp::heads_of_rank(self.config.num_kv_heads, tp, rank),
            KvSplit::Replicated => 0..self.config.num_kv_heads,
        }
    }

    /// The (D worker, P worker) pairs that read: split by head, every pair whose heads
    /// overlap; replicated, each D worker once, from P rank `w · p_tp / d_tp` (spread
    /// over P's ranks when P has more, shared when D has more).
    fn reader_pairs(&self, p_tp: u32) -> Vec<(u32, u32)> {
        crate::tp::tp_pairs(
            self.config.kv_split,
            self.config.num_kv_heads,
            p_tp,
            self.config.tp_size,
        )
        .into_iter()
        .map(|pair| (pair.dst, pair.src))
        .collect()
    }

    /// Every reading (D worker, P worker) pair is one read batch and one consumer of the
    /// lease: P must not free before the last of them reported, or the fence of a batch
    /// still running on another P worker would (rightly) fail it.
    pub(super) fn plan_batches(&self, remote: &RemoteKv, p_tp: u32) -> Vec<BatchPlan> {
        let d_tp = self.config.tp_size;
        let pairs = self.reader_pairs(p_tp);
        let total = u32::try_from(pairs.len()).unwrap_or(u32::MAX).max(1);
        pairs
            .into_iter()
            .map(|(w, p)| {
                let (mine, theirs) = (self.heads_of(d_tp, w), self.heads_of(p_tp, p));
                BatchPlan {
                    d_worker: w,
                    p_rank: p,
                    heads: mine.start.max(theirs.start)..mine.end.min(theirs.end),
                    p_first_head: theirs.start,
                    d_first_head: mine.start,
                    notif: ReadComplete {
                        request: remote.request.clone(),
                        consumer: ConsumerId::new(
                            self.config.engine_id.clone(),
                            w.saturating_mul(p_tp).saturating_add(p),
                        ),
                        consumers_total: total,
                    }
                    .encode(),
                }
            })
            .collect()
    }
}
