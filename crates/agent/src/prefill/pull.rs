//! P's bidirectional mode: pulling a next turn's shared prefix from D's cached turn, and
//! heartbeating D's cached entries while their next turns wait here (symmetric lease).

use super::*;

/// Why a pull of D's cached turn failed (P recomputes instead).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PullError {
    /// No handshake with that D engine.
    #[error("engine not handshaken")]
    NotHandshaken,
    /// A block is outside a pool.
    #[error("block range: {0}")]
    Layout(#[from] kvlease_gpu_mem::LayoutError),
    /// The transport refused or failed a read.
    #[error("read from D: {0}")]
    Read(#[from] kvlease_transport::TransferError),
    /// The reads did not finish in time.
    #[error("the pull's reads timed out")]
    TimedOut,
}
use crate::shell::{HandshakeFailure, Me, connect_worker, remote_engine};

impl PrefillEngine {
    /// Bidirectional mode: reads the common whole blocks of D's cached turn into the
    /// first of `ids`, when [`plan_pull`] allows; returns how many blocks it read (zero:
    /// compute everything). Blocks the engine thread for at most the probe and read
    /// timeouts.
    pub(super) fn pull(&mut self, params: &DecoderKvParams, tokens: &[u32], ids: &[u32]) -> usize {
        let Some(b) = self.cfg.bidir.clone() else {
            return 0;
        };
        let engine = params.remote_engine_id.clone();
        if params.tp_size != self.cfg.tp_size {
            tracing::info!(%engine, "D's TP size differs; recomputing instead of pulling");
            return 0;
        }
        let host = if params.remote_host.contains(':') && !params.remote_host.starts_with('[') {
            format!("[{}]", params.remote_host)
        } else {
            params.remote_host.clone()
        };
        let mut est = kvlease_lease::ClockOffsetEstimator::new();
        let clock = b.clock;
        let probe = format!("{host}:{}", params.kvlease_clock_port)
            .parse()
            .map_err(|e| format!("{e}"))
            .and_then(|addr| {
                probe_clock(addr, PROBE_SAMPLES, &|| clock.now(), &mut est)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = probe {
            tracing::info!(%engine, error = %e, "clock probe of D failed");
        }
        // Symmetric lease: a heartbeat sent at t0 keeps the entry until at least
        // t0 (on D's clock) + the extension.
        let renewed;
        let mut params = params;
        if let (Some(&t0), Some(offset)) = (
            self.cache_heartbeats.get(&params.remote_request_id),
            est.offset(),
        ) && params.kvlease_renew_extension_ms > 0
        {
            let until = offset
                .to_peer(t0)
                .as_nanos_saturating()
                .saturating_add(params.kvlease_renew_extension_ms.saturating_mul(1_000_000));
            if until > params.kvlease_deadline_ns {
                let mut p = params.clone();
                p.kvlease_deadline_ns = until;
                renewed = p;
                params = &renewed;
            }
        }
        self.cache_heartbeats.remove(&params.remote_request_id);
        let bytes = self
            .workers
            .iter()
            .map(|w| w.layout.block_bytes())
            .sum::<usize>() as f64
            * params.remote_block_ids.len() as f64;
        let expected = Duration::from_secs_f64(bytes / ASSUMED_PULL_BYTES_PER_SEC);
        let decision = plan_pull(
            &b.policy,
            params,
            tokens,
            self.cfg.shape.block_size,
            clock.now(),
            est.offset(),
            expected,
        );
        let (d_blocks, diverged) = match decision {
            PullDecision::Pull {
                blocks, diverged, ..
            } => (blocks, diverged),
            PullDecision::Recompute(reason) => {
                tracing::info!(%engine, ?reason, "recomputing instead of pulling");
                return 0;
            }
        };
        let n = d_blocks.len().min(ids.len());
        if let Err(e) = self.ensure_d_remote(&engine, &format!("{host}:{}", params.remote_port)) {
            tracing::warn!(%engine, error = %e, "cannot reach D for a pull; recomputing");
            return 0;
        }
        match self.read_from_d(&engine, params, &d_blocks[..n], &ids[..n], b.read_timeout) {
            Ok(()) => {
                tracing::info!(%engine, blocks = n, diverged, "pulled the shared prefix from D");
                n
            }
            Err(e) => {
                tracing::warn!(%engine, error = %e, "pull from D failed; recomputing");
                0
            }
        }
    }

    /// Symmetric lease: heartbeats D's cached entries whose next-turn requests wait here,
    /// `CACHE_HEARTBEATS_PER_EXTENSION` times per extension.
    pub(super) fn heartbeat_cached(&mut self) {
        let Some(b) = &self.cfg.bidir else { return };
        if !b.symmetric {
            return;
        }
        let now = b.clock.now();
        // Forget entries whose requests no longer wait (prefilled, refused, gone).
        let waiting: std::collections::HashSet<&str> = self
            .jobs
            .values()
            .filter_map(|w| w.job.decoder.as_ref())
            .map(|p| p.remote_request_id.as_str())
            .collect();
        self.cache_heartbeats
            .retain(|k, _| waiting.contains(k.as_str()));
        let due: Vec<(String, String, String)> = self
            .jobs
            .values()
            .filter_map(|w| w.job.decoder.as_ref())
            .filter(|p| p.kvlease_renew_extension_ms > 0)
            .filter(|p| {
                let every = Duration::from_millis(p.kvlease_renew_extension_ms)
                    / CACHE_HEARTBEATS_PER_EXTENSION;
                self.cache_heartbeats
                    .get(&p.remote_request_id)
                    .is_none_or(|&last| now.saturating_duration_since(last) >= every)
            })
            .map(|p| {
                (
                    p.remote_engine_id.clone(),
                    format!("{}:{}", p.remote_host, p.remote_port),
                    p.remote_request_id.clone(),
                )
            })
            .collect();
        for (engine, addr, request) in due {
            if let Err(e) = self.ensure_d_remote(&engine, &addr) {
                tracing::debug!(%engine, error = %e, "cannot heartbeat D's cached blocks");
                continue;
            }
            let Ok(id) = RequestId::new(&request) else {
                continue;
            };
            let (Some(w0), Some(&peer)) = (
                self.workers.first(),
                self.d_caches.get(&engine).and_then(|r| r.peers.first()),
            ) else {
                continue;
            };
            let Ok(msgs) = kvlease_notif::encode_heartbeats([&id], kvlease_notif::MAX_NOTIF_LEN)
            else {
                continue;
            };
            let mut sent = true;
            for m in msgs {
                if let Err(e) = w0.agent.send_notif(peer, m) {
                    tracing::debug!(%engine, error = %e, "cached-blocks heartbeat not sent");
                    sent = false;
                }
            }
            if sent {
                self.metrics.heartbeats_sent.inc();
                self.cache_heartbeats.insert(request, now);
            }
        }
    }

    pub(super) fn ensure_d_remote(
        &mut self,
        engine: &str,
        addr: &str,
    ) -> Result<(), HandshakeFailure> {
        if self.d_caches.contains_key(engine) {
            return Ok(());
        }
        let want = EngineId::new(engine).map_err(|_| HandshakeFailure::Metadata {
            engine: self.cfg.engine_id.clone(),
        })?;
        let mds: Vec<Vec<u8>> = self.workers.iter().map(|w| w.agent.metadata()).collect();
        let me = Me {
            token: self.cfg.link.auth_token.as_deref(),
            engine: self.cfg.engine_id.as_str(),
            tp_size: self.cfg.tp_size,
            metadata: &mds,
            shape: self.cfg.shape,
            instance: self.instance,
        };
        let info = remote_engine(addr, &me, &want)?;
        if info.tp_size != self.cfg.tp_size {
            return Err(HandshakeFailure::TpSize {
                engine: want,
                theirs: info.tp_size,
                ours: self.cfg.tp_size,
            });
        }
        // Worker i pulls from D's worker i (same TP size, same heads).
        let peers = self
            .workers
            .iter()
            .zip(0..)
            .map(|(w, rank)| connect_worker(&w.agent, &info, rank, &want))
            .collect::<Result<Vec<_>, _>>()?;
        self.d_caches
            .insert(engine.to_owned(), DRemote { info, peers });
        Ok(())
    }

    /// Reads D's `d_blocks` into P's `p_blocks` on every worker (fenced by the cached
    /// entry's generation), then tells D it has read.
    pub(super) fn read_from_d(
        &mut self,
        engine: &str,
        params: &DecoderKvParams,
        d_blocks: &[BlockId],
        p_blocks: &[u32],
        timeout: Duration,
    ) -> Result<(), PullError> {
        let remote = self.d_caches.get(engine).ok_or(PullError::NotHandshaken)?;
        let mut batches = Vec::new();
        for (w, (dw, &peer)) in self
            .workers
            .iter()
            .zip(remote.info.workers.iter().zip(&remote.peers))
        {
            let d_layout = KvLayout::new(
                remote.info.shape.num_layers,
                remote.info.num_blocks,
                w.layout.local_heads(),
                remote.info.shape.block_size,
                remote.info.shape.head_dim,
                kv::DTYPE_BYTES as u32,
            )?;
            let mut ops = Vec::new();
            for layer in 0..self.cfg.shape.num_layers {
                for (&db, &pb) in d_blocks.iter().zip(p_blocks) {
                    let local = w.pool.layout().block_range(layer, BlockId(pb))?;
                    let far = d_layout.block_range(layer, db)?;
                    ops.push(link::ReadOp {
                        local: w.info.pool,
                        local_offset: local.start,
                        remote: dw.pool,
                        remote_offset: far.start,
                        len: local.end - local.start,
                    });
                }
            }
            let first = d_blocks.first().map_or(0, |b| b.0);
            let fence = link::Fence {
                region: dw.fence,
                offset: u64::from(first) * FenceTable::WORD_BYTES,
                expected: params.kvlease_generation,
            };
            let batch = link::post_read(&w.agent, peer, ops, None, Some(fence), timeout)?;
            batches.push((w, batch));
        }
        let until = Instant::now() + timeout + Duration::from_secs(1);
        let mut result = Ok(());
        for (w, batch) in batches {
            loop {
                match link::poll(&w.agent, batch) {
                    link::LinkStatus::Pending if Instant::now() < until => {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    link::LinkStatus::Pending => {
                        result = Err(PullError::TimedOut);
                        break;
                    }
                    link::LinkStatus::Done { bytes, .. } => {
                        self.metrics.transfer_bytes.inc_by(bytes);
                        break;
                    }
                    link::LinkStatus::Failed(f) => {
                        if f.is_stale() {
                            self.metrics.stale_reads.inc();
                        }
                        result = Err(PullError::Read(f.0));
                        break;
                    }
                }
            }
        }
        // Read (or failed for good): D may free the cached turn now.
        if let (Some(w0), Some(&peer), Ok(request)) = (
            self.workers.first(),
            remote.peers.first(),
            RequestId::new(&params.remote_request_id),
        ) {
            let msg = kvlease_notif::ReadComplete {
                request,
                consumer: kvlease_lease::ConsumerId::new(self.cfg.engine_id.clone(), 0),
                consumers_total: 1,
            }
            .encode();
            if let Err(e) = w0.agent.send_notif(peer, msg) {
                tracing::warn!(%engine, error = %e, "read-done notice to D not sent");
            }
        }
        result
    }
}
