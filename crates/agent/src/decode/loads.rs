//! D's loads: posting the read batches the core schedules, reporting finished batches,
//! and verifying a loaded request's bytes.

use super::*;

impl DecodeEngine {
    /// Posts the read batches of a scheduled load (one per overlapping (D worker, P worker)
    /// pair, fenced); a batch that cannot be set up or posted is reported failed to the core.
    pub(super) fn post_reads(&mut self, plan: LoadPlan) {
        let Some(Remote::Ready(ready)) = self.remotes.get(&plan.remote.engine) else {
            // The core plans only for ready engines; fail every batch if the shell lost it.
            for i in 0..plan.batches.len() {
                let cause: Cause = Arc::new(HandshakeFailure::Thread);
                self.core
                    .handle_batch_done(&plan.request, i, BatchResult::Failed(cause));
            }
            return;
        };
        let p_blocks: Vec<u32> = plan.remote.blocks.iter().map(|b| b.0).collect();
        let mut posted = Vec::new();
        let mut failed = Vec::new();
        for (i, b) in plan.batches.iter().enumerate() {
            let wi = b.d_worker as usize;
            let (Some(w), Some(pw), Some(&peer)) = (
                self.workers.get(wi),
                ready.info.workers.get(b.p_rank as usize),
                ready.peers.get(wi).and_then(|v| v.get(b.p_rank as usize)),
            ) else {
                failed.push((i, ReadSetupError::NotConnected { p_rank: b.p_rank }));
                continue;
            };
            let ops = match build_ops(
                w,
                pw,
                &ready.info,
                &plan.blocks,
                &p_blocks,
                b.heads.clone(),
                b.p_first_head,
            ) {
                Ok(ops) => ops,
                Err(e) => {
                    failed.push((i, e));
                    continue;
                }
            };
            let first = p_blocks.first().copied().unwrap_or(0);
            let fence = link::Fence {
                region: pw.fence,
                offset: u64::from(first) * FenceTable::WORD_BYTES,
                expected: plan.fence_generation,
            };
            match link::post_read(
                &w.agent,
                peer,
                ops,
                Some(b.notif.clone()),
                Some(fence),
                self.cfg.read_timeout,
            ) {
                Ok(batch) => posted.push(Posted {
                    worker: wi,
                    batch,
                    backend: link::peer_backend(&w.agent, peer),
                    done: false,
                }),
                Err(e) => failed.push((i, ReadSetupError::Post(e))),
            }
        }
        let now = Instant::now();
        if let Some(req) = self.reqs.get_mut(&plan.request) {
            self.metrics
                .queue_wait_seconds
                .observe(now.duration_since(req.job.arrived).as_secs_f64());
            req.scheduled = Some(now);
            req.load_started = Some(now);
            // Batches are reported by their index in the plan.
            let mut posted = posted.into_iter();
            req.posted = (0..plan.batches.len())
                .map(|i| {
                    if failed.iter().any(|(f, _)| *f == i) {
                        None
                    } else {
                        posted.next()
                    }
                })
                .collect();
        }
        for (i, e) in failed {
            let cause: Cause = Arc::new(e);
            self.core
                .handle_batch_done(&plan.request, i, BatchResult::Failed(cause));
        }
    }

    /// Polls the posted batches and reports every finished one to the core.
    pub(super) fn finish_loads(&mut self) {
        let mut results = Vec::new();
        for (id, req) in &mut self.reqs {
            for (i, p) in req.posted.iter_mut().enumerate() {
                let Some(p) = p else { continue };
                if p.done {
                    continue;
                }
                let Some(w) = self.workers.get(p.worker) else {
                    continue;
                };
                match link::poll(&w.agent, p.batch) {
                    LinkStatus::Pending => {}
                    LinkStatus::Done { bytes, backend } => {
                        self.metrics.read_bytes(backend).inc_by(bytes);
                        p.backend = backend;
                        p.done = true;
                        results.push((id.clone(), i, BatchResult::Done { bytes }));
                    }
                    LinkStatus::Failed(f) => {
                        p.done = true;
                        let r = if f.is_stale() {
                            self.metrics.stale_reads.inc();
                            BatchResult::Stale
                        } else {
                            let cause: Cause = Arc::new(ReadSetupError::Transfer(f.0));
                            BatchResult::Failed(cause)
                        };
                        results.push((id.clone(), i, r));
                    }
                }
            }
        }
        for (id, i, r) in results {
            if let BatchResult::Done { bytes } = &r {
                self.metrics.transfer_bytes.inc_by(*bytes);
            }
            self.core.handle_batch_done(&id, i, r);
            self.drain_events();
        }
        // Requests answered while their reads ran are gone once the reads ended.
        self.reqs
            .retain(|_, r| !r.answered || r.posted.iter().flatten().any(|p| !p.done));
    }

    /// Verifies a loaded request's bytes against its tokens and P's digest, then starts
    /// its decode.
    pub(super) fn on_loaded(&mut self, id: &RequestId, blocks: &[BlockId], bytes: u64) {
        let Some(req) = self.reqs.get(id) else {
            self.core.handle_verified(id, Ok(()));
            return;
        };
        let read_time = req.load_started.map_or(Duration::ZERO, |s| s.elapsed());
        self.metrics.read_seconds.observe(read_time.as_secs_f64());
        match self.verify(req, blocks) {
            Err(e) => {
                let cause: Cause = Arc::new(e);
                self.core.handle_verified(id, Err(cause));
            }
            Ok(digest) => {
                // One transfer per request, under the backend of its links when every
                // batch of it went over the same one (shm, cma or verbs); mixed counts as TCP.
                let mut backends = req.posted.iter().flatten().map(|b| b.backend);
                let first = backends.next().unwrap_or(kvlease_transport::Backend::Tcp);
                let backend = if backends.all(|b| b == first) {
                    first
                } else {
                    kvlease_transport::Backend::Tcp
                };
                self.metrics.transfer(backend).inc();
                let queue_ms = req.scheduled.map_or(0.0, |s| {
                    s.duration_since(req.job.arrived).as_secs_f64() * 1e3
                });
                let summary = Summary {
                    kv_digest: digest.to_string(),
                    stats: TransferStats {
                        bytes,
                        backend: backend.as_str().to_owned(),
                        queue_time_ms: queue_ms,
                        read_time_ms: read_time.as_secs_f64() * 1e3,
                        remote_workers: req.posted.len() as u32,
                    },
                    kv_transfer_params: None,
                };
                let text = kv::decode_text(digest, req.job.max_tokens as usize);
                if let Some(req) = self.reqs.get_mut(id) {
                    req.decoding = Some((text, 0, summary));
                }
                self.core.handle_verified(id, Ok(()));
            }
        }
    }

    fn verify(&self, req: &Req, blocks: &[BlockId]) -> Result<KvDigest, VerifyError> {
        let hashes = kv::prefix_hashes(&req.job.tokens);
        let digest = kv::digest_workers(
            &self.workers,
            || VerifyError::Panicked,
            |w| verify_worker(w, blocks, &hashes),
        )?;
        let want = req.job.kv_digest;
        if digest != want {
            return Err(VerifyError::Digest { read: digest, want });
        }
        Ok(digest)
    }
}
