//! D's bidirectional mode: keeping a finished turn's blocks for P to pull, evicting and
//! expiring them.

use kvlease_engine::{DecoderKvParams, block_hashes};

use super::*;

impl DecodeEngine {
    // ------------------------------------------------------------ bidirectional mode

    /// Moves a finished request's blocks into the hold and answers D's cached-blocks
    /// params; `None` (the blocks stay with the request and are freed) without
    /// bidirectional mode or when the hold refuses.
    pub(super) fn keep_for_next_turn(&mut self, id: &RequestId) -> Option<serde_json::Value> {
        if self.cfg.bidir.is_none() || self.hold.is_none() {
            self.core.request_finished(id);
            return None;
        }
        let blocks = self.core.request_finished_keep(id)?;
        let kept = self.hold_turn(id, &blocks);
        if kept.is_none() {
            self.core.free_blocks(&blocks);
        }
        kept
    }

    /// Puts a finished turn's `blocks` into the hold; `None` (the caller frees them) when
    /// the hold refuses.
    pub(super) fn hold_turn(
        &mut self,
        id: &RequestId,
        blocks: &[BlockId],
    ) -> Option<serde_json::Value> {
        let b = self.cfg.bidir.as_ref()?;
        let hold = self.hold.as_mut()?;
        let req = self.reqs.get(id)?;
        let cache_id = RequestId::new(&format!("turn-{}", req.job.id)).ok()?;
        // P pulls these blocks: a verbs-mirrored pool must hold them in its mirror (reads
        // that came over TCP wrote the pool only).
        let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
        for w in &self.workers {
            let region = kvlease_transport::RegionId(w.pool_desc.id);
            if let Err(e) = crate::prefill::sync_blocks_for_peers(&w.agent, region, &w.pool, &ids) {
                tracing::warn!(request = %id, error = %e, "cannot sync the turn's blocks for peers; freeing them");
                return None;
            }
        }
        let now = b.clock.now();
        let held = match hold.insert(now, cache_id.clone(), blocks.to_vec()) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "cannot keep the turn's blocks; freeing them");
                return None;
            }
        };
        for w in &self.workers {
            if let Some((f, _)) = &w.fence
                && let Err(e) = f.publish(blocks, held.generation.word())
            {
                tracing::error!(error = %e, "fence publish failed");
            }
        }
        let tokens = &req.job.tokens;
        let bs = self.cfg.shape.block_size;
        let deadline_ns = held.deadline.as_nanos_saturating();
        let params = DecoderKvParams {
            kvlease_bidir: true,
            remote_engine_id: self.cfg.engine_id.to_string(),
            remote_host: b.advertise_host.clone(),
            remote_port: b.side_channel_port,
            kvlease_clock_port: b.clock_port,
            remote_block_ids: blocks.iter().map(|b| b.0).collect(),
            remote_request_id: cache_id.to_string(),
            tp_size: self.cfg.tp_size,
            kvlease_generation: held.generation.word(),
            conversation_id: req.job.conversation_id.clone().unwrap_or_default(),
            kvlease_num_tokens: tokens.len() as u32,
            kvlease_block_size: bs,
            kvlease_block_hashes: block_hashes(tokens, bs)
                .into_iter()
                .map(|h| format!("{h:016x}"))
                .collect(),
            kvlease_deadline_ns: deadline_ns,
            kvlease_ttl_remaining: held.deadline.saturating_duration_since(now),
            kvlease_renew_extension_ms: hold.renew_extension().map_or(0, |e| e.as_millis() as u64),
        };
        self.metrics
            .decoder_cached_blocks
            .set(hold.blocks_held() as i64);
        Some(bidir::params_to_value(&params))
    }

    /// Frees the oldest cached turn still held, so that a new request gets its blocks;
    /// false when none is left.
    pub(super) fn evict_oldest_cached(&mut self) -> bool {
        let Some(b) = &self.cfg.bidir else {
            return false;
        };
        let now = b.clock.now();
        let Some(hold) = self.hold.as_mut() else {
            return false;
        };
        let Some(id) = hold.evict_oldest(now) else {
            return false;
        };
        self.metrics.decoder_cache_evicted.inc();
        tracing::info!(request = %id, "cached turn evicted for a new request");
        self.drain_cache();
        true
    }

    /// Frees the cached turns whose TTL passed.
    pub(super) fn expire_cache(&mut self) {
        if let (Some(b), Some(hold)) = (&self.cfg.bidir, self.hold.as_mut()) {
            hold.handle_timeout(b.clock.now());
            self.drain_cache();
        }
    }

    /// Frees what the hold released: the free word first (a pull still in flight fails its
    /// fence), then the blocks.
    pub(super) fn drain_cache(&mut self) {
        let Some(hold) = self.hold.as_mut() else {
            return;
        };
        let mut released = Vec::new();
        while let Some(Event::Released(r)) = hold.poll_event() {
            released.push(r);
        }
        let held = hold.blocks_held();
        for r in released {
            for w in &self.workers {
                if let Some((f, _)) = &w.fence
                    && let Err(e) = f.publish(&r.blocks, Generation::FREE_WORD)
                {
                    tracing::error!(error = %e, "fence publish failed");
                }
            }
            self.core.free_blocks(&r.blocks);
            if r.reason == ReleaseReason::Expired {
                self.metrics.decoder_cache_expired.inc();
                tracing::info!(request = %r.request, "cached turn expired; blocks freed");
            }
        }
        self.metrics.decoder_cached_blocks.set(held as i64);
    }
}
