//! D's bidirectional mode, the IO of it: the core ([`DecodeCore`]) keeps, renews, evicts
//! and expires finished turns; this module makes a kept turn's blocks readable for P,
//! publishes and clears its fence words, and writes the turn's params.

use kvlease_engine::{DecoderKvParams, HoldRefused, KeptTurn, TurnEnd, block_hashes};

use super::*;

impl DecodeEngine {
    // ------------------------------------------------------------ bidirectional mode

    /// Ends a finished request: in bidirectional mode the core keeps its blocks for the
    /// next turn and this answers D's cached-blocks params; `None` (the blocks are freed)
    /// without bidirectional mode, when the core refuses, or when the blocks cannot be
    /// made readable.
    pub(super) fn keep_for_next_turn(&mut self, id: &RequestId) -> Option<serde_json::Value> {
        let now = self.now();
        let kept = match self.core.request_finished_hold(now, id) {
            Ok(k) => k,
            Err(HoldRefused::NotDecoding { .. } | HoldRefused::NoHold) => return None,
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "cannot keep the turn's blocks; freed");
                return None;
            }
        };
        let params = self.serve_turn(id, &kept);
        if params.is_none() {
            self.core.drop_turn(now, &kept.turn);
            self.drain_turns();
        }
        self.metrics
            .decoder_cached_blocks
            .set(self.core.turn_blocks_held() as i64);
        params
    }

    /// Makes a kept turn readable for P (blocks synced for peers, the generation published)
    /// and writes its params; `None` when the blocks cannot be synced.
    fn serve_turn(&mut self, id: &RequestId, kept: &KeptTurn) -> Option<serde_json::Value> {
        let b = self.cfg.bidir.as_ref()?;
        let req = self.reqs.get(id)?;
        // P pulls these blocks: a verbs-mirrored pool must hold them in its mirror (reads
        // that came over TCP wrote the pool only).
        let ids: Vec<u32> = kept.blocks.iter().map(|b| b.0).collect();
        for w in &self.workers {
            let region = kvlease_transport::RegionId(w.pool_desc.id);
            if let Err(e) = crate::prefill::sync_blocks_for_peers(&w.agent, region, &w.pool, &ids) {
                tracing::warn!(request = %id, error = %e, "cannot sync the turn's blocks for peers; freeing them");
                return None;
            }
        }
        for w in &self.workers {
            if let Some((f, _)) = &w.fence
                && let Err(e) = f.publish(&kept.blocks, kept.generation.word())
            {
                tracing::error!(error = %e, "fence publish failed");
            }
        }
        let tokens = &req.job.tokens;
        let bs = self.cfg.shape.block_size;
        // The deadline on the clock D shows P (its clock probe's).
        let ttl_ns = u64::try_from(kept.ttl.as_nanos()).unwrap_or(u64::MAX);
        let params = DecoderKvParams {
            kvlease_bidir: true,
            remote_engine_id: self.cfg.engine_id.to_string(),
            remote_host: b.advertise_host.clone(),
            remote_port: b.side_channel_port,
            kvlease_clock_port: b.clock_port,
            remote_block_ids: ids,
            remote_request_id: kept.turn.to_string(),
            tp_size: self.cfg.tp_size,
            kvlease_generation: kept.generation.word(),
            conversation_id: req.job.conversation_id.clone().unwrap_or_default(),
            kvlease_num_tokens: tokens.len() as u32,
            kvlease_block_size: bs,
            kvlease_block_hashes: block_hashes(tokens, bs)
                .into_iter()
                .map(|h| format!("{h:016x}"))
                .collect(),
            kvlease_deadline_ns: b.clock.now_ns().saturating_add(ttl_ns),
            kvlease_ttl_remaining: kept.ttl,
            kvlease_renew_extension_ms: kept.renew_extension.map_or(0, |e| e.as_millis() as u64),
        };
        Some(bidir::params_to_value(&params))
    }

    /// Clears the fences of every held turn the core released (a pull still in flight
    /// fails its fence); the core frees the blocks as it hands each one out.
    pub(super) fn drain_turns(&mut self) {
        while let Some(r) = self.core.poll_turn_released() {
            for w in &self.workers {
                if let Some((f, _)) = &w.fence
                    && let Err(e) = f.publish(&r.blocks, Generation::FREE_WORD)
                {
                    tracing::error!(error = %e, "fence publish failed");
                }
            }
            match r.end {
                TurnEnd::Pulled => {
                    self.metrics.decoder_cache_pulled.inc();
                }
                TurnEnd::Expired => {
                    self.metrics.decoder_cache_expired.inc();
                    tracing::info!(request = %r.turn, "cached turn expired; blocks freed");
                }
                TurnEnd::Evicted => {
                    self.metrics.decoder_cache_evicted.inc();
                    tracing::info!(request = %r.turn, "cached turn evicted for a new request");
                }
                TurnEnd::Dropped => {}
            }
        }
        self.metrics
            .decoder_cached_blocks
            .set(self.core.turn_blocks_held() as i64);
    }
}
