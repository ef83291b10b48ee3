//! The D shell: what the decode agent does around its `DecodeCore` (admission, handshakes,
//! heartbeats and aborts to every P worker, fenced reads, verification, decoding, lost
//! connections), and D crashes and restarts.

use super::*;

impl World {
    pub(super) fn arrive_at_d(
        &mut self,
        d: usize,
        request: RequestId,
        tokens: usize,
        remote: RemoteKv,
    ) {
        if !self.d[d].alive {
            self.end(&request, End::LostWithD);
            return;
        }
        self.trace(&[10, self.now, d as u64]);
        self.trace_str(request.as_str());
        self.d[d].arrivals.push_back((request, tokens, remote));
    }

    pub(super) fn d_step(&mut self, d: usize) {
        let local = self.d[d].clock.local(self.now);
        let since = self.now.saturating_sub(self.d[d].last_step);
        self.stats.tracked_request_ns += self.d[d].tracked.len() as u128 * u128::from(since);
        self.d[d].last_step = self.now;
        // 1. Arrivals: tracked at once.
        while let Some((request, tokens, remote)) = self.d[d].arrivals.pop_front() {
            match self.d[d]
                .core
                .on_new_request(local, request.clone(), tokens, remote)
            {
                Ok(()) => {
                    self.d[d].admitted.insert(request.clone(), self.now);
                    self.d[d].tracked.insert(request);
                }
                Err(_) => self.end(&request, End::RefusedAtD),
            }
            self.d_drain(d);
        }
        // 2. Handshakes that ended, connections that broke.
        while let Some((p, result)) = self.d[d].handshakes.pop_front() {
            let engine = self.p[p].id.clone();
            let result = match result {
                Some(incarnation) => {
                    self.d[d].conns.insert(p, incarnation);
                    let incarnation_d = self.d[d].incarnation;
                    self.last_batch.remove(&(d, incarnation_d, p));
                    Ok(
                        RemoteEngine::new(self.config.p_tp, self.config.blocks_per_worker)
                            .with_instance(instance_of(incarnation)),
                    )
                }
                None => Err(HandshakeError::Connect(cause("P engine unreachable"))),
            };
            self.d[d].core.handle_handshake(local, &engine, result);
            self.d_drain(d);
        }
        while let Some((p, incarnation)) = self.d[d].lost_conns.pop_front() {
            if self.d[d].conns.get(&p) == Some(&incarnation) {
                self.forget(d, p);
            }
        }
        // 3. Notifications (expiry notices, forged ones).
        while let Some((from, bytes)) = self.d[d].inbox.pop_front() {
            self.d_notif(d, from, &bytes);
            self.d_drain(d);
        }
        // 4. Reads that ended.
        self.finish_loads(d);
        // 5. Decodes that ended.
        let now = self.now;
        let mut finished: Vec<RequestId> = Vec::new();
        self.d[d].decoding.retain(|(at, id)| {
            if *at <= now {
                finished.push(id.clone());
                false
            } else {
                true
            }
        });
        for id in finished {
            if self.config.bidir.is_some() {
                self.finish_turn(d, &id, local);
            } else {
                let _ = self.d[d].core.request_finished(&id);
                self.d_drain(d);
            }
        }
        // 5b. Bidirectional mode: cached turns whose TTL passed.
        self.hold_timeout(d, local);
        // 6. A client goes away.
        if !self.d[d].admitted.is_empty() && self.rng.chance(self.config.client_abort_per_million) {
            let i = self.rng.index(self.d[d].admitted.len());
            if let Some(id) = self.d[d].admitted.keys().nth(i).cloned()
                && self.d[d].core.abort(&id)
            {
                self.stats.client_aborts += 1;
                self.d_drain(d);
            }
        }
        // 7. Handshakes to start.
        while let Some(start) = self.d[d].core.poll_handshake() {
            self.stats.handshakes += 1;
            let Some(&p) = self.p_by_id.get(&start.engine) else {
                self.fail(format!(
                    "D{d}: handshake with unknown engine {}",
                    start.engine
                ));
                continue;
            };
            let ev = Ev::HandshakeDone {
                d,
                incarnation: self.d[d].incarnation,
                p,
            };
            self.schedule(self.now + nanos(self.config.handshake), ev);
        }
        // 8. Heartbeats and aborts, each to every worker of its P engine.
        self.d_transmit(d, local);
        // 9. Loads to post.
        self.post_loads(d);
    }

    pub(super) fn d_transmit(&mut self, d: usize, local: Timestamp) {
        let mut transmits = Vec::new();
        while let Some(t) = self.d[d].core.poll_transmit(local) {
            self.note(|| format!("D{d} transmit {t:?}"));
            transmits.push(t);
        }
        let local_ns = local.as_nanos_saturating();
        let incarnation = self.d[d].incarnation;
        for t in transmits {
            let Some(&p) = self.p_by_id.get(&t.engine) else {
                self.fail(format!("D{d}: transmit for unknown engine {}", t.engine));
                continue;
            };
            let connected =
                self.p[p].alive && self.d[d].conns.get(&p) == Some(&self.p[p].incarnation);
            if !connected {
                // The connection is gone: the send fails.
                self.forget(d, p);
                continue;
            }
            if let TransmitKind::Heartbeat { .. } = t.kind {
                //= docs/spec.md#tracking
                //# one batched message per P worker per interval renews all of that engine's requests.
                if let Some(last) = self.last_batch.insert((d, incarnation, p), local_ns)
                    && last != local_ns
                    && local_ns - last < nanos(self.lease.interval())
                {
                    self.fail(format!(
                        "D{d}: two heartbeat batches for P{p} {} apart, within one interval",
                        fmt_ns(local_ns - last)
                    ));
                }
                self.stats.heartbeat_messages += u64::from(t.workers);
                self.stats.heartbeat_bytes += u64::from(t.workers) * t.bytes.len() as u64;
            }
            for worker in 0..t.workers {
                self.send(
                    Addr::D { engine: d, rank: 0 },
                    Addr::P { engine: p, worker },
                    t.bytes.clone(),
                );
            }
        }
    }

    /// The connection to P `p` is lost: the shell tells the core (the next request
    /// handshakes again).
    pub(super) fn forget(&mut self, d: usize, p: usize) {
        if self.config.bug == Some(Bug::NeverForget) {
            return;
        }
        self.d[d].conns.remove(&p);
        let engine = self.p[p].id.clone();
        if self.d[d].core.is_ready(&engine) {
            self.stats.forgotten_engines += 1;
        }
        self.d[d].core.forget_engine(&engine);
        self.d_drain(d);
    }

    pub(super) fn d_notif(&mut self, d: usize, from: Addr, bytes: &[u8]) {
        let engine = self.sender_engine(from);
        let honest = matches!(from, Addr::P { .. });
        let handled = if self.config.bidir.is_some() {
            self.hold_notif(d, &engine, bytes, honest)
        } else {
            self.d[d].core.handle_notif(&engine, bytes)
        };
        let problem = match handled {
            DecodeNotif::Expired { failed, .. } => {
                if honest {
                    self.stats.recomputed_after_notice += u64::from(failed);
                    None
                } else {
                    (failed > 0).then(|| format!("a forged expiry notice failed {failed} requests"))
                }
            }
            DecodeNotif::Foreign => {
                if honest {
                    Some("an expiry notice from P was ignored as foreign".to_string())
                } else {
                    self.stats.forged_ignored += 1;
                    None
                }
            }
            DecodeNotif::Malformed(e) => Some(format!("message rejected: {e}")),
            DecodeNotif::CacheHeartbeat(ids) if honest && self.config.bidir.is_some() => {
                self.hold_heartbeat(d, &ids);
                None
            }
            DecodeNotif::CacheReadComplete(hold) if honest && self.config.bidir.is_some() => {
                self.hold_read_complete(d, &hold);
                None
            }
            DecodeNotif::CacheHeartbeat(_)
            | DecodeNotif::CacheReadComplete(_)
            | DecodeNotif::Ignored => honest.then(|| "a message from P was ignored".to_string()),
        };
        if let Some(problem) = problem {
            self.fail(format!("D{d}: {problem}"));
        }
    }

    pub(super) fn post_loads(&mut self, d: usize) {
        loop {
            // Bidirectional mode: held turns give way to the next request short of blocks
            // (the core picks which), their fences cleared before their blocks are reused.
            if self.config.bidir.is_some() {
                let local = self.d[d].clock.local(self.now);
                self.hold_timeout(d, local);
            }
            let Some(plan) = self.d[d].core.poll_load() else {
                break;
            };
            let Some(&p) = self.p_by_id.get(&plan.remote.engine) else {
                self.fail(format!(
                    "D{d}: load from unknown engine {}",
                    plan.remote.engine
                ));
                continue;
            };
            let conn = self.d[d].conns.get(&p).copied();
            let reachable = self.reachable(d, p, conn);
            // The one-sided read copies the bytes first; the fence word is checked at its end.
            // Bidirectional mode: the read writes D's blocks as it runs (a block freed by a
            // cached turn is overwritten at once).
            if reachable && self.config.bidir.is_some() {
                let seed = self
                    .requests
                    .get(&plan.request)
                    .map_or(0, |r| r.content_seed);
                for (j, b) in plan.blocks.iter().enumerate() {
                    if let Some(c) = self.d[d].mem.content.get_mut(b.0 as usize) {
                        *c = block_content(seed, 0, j);
                    }
                }
            }
            let copied = plan
                .batches
                .iter()
                .map(|b| {
                    let pool = self.p[p].pools.get(b.p_rank as usize).filter(|_| reachable);
                    plan.remote
                        .blocks
                        .iter()
                        .map(|blk| {
                            pool.and_then(|pool| pool.content.get(blk.0 as usize))
                                .copied()
                                .unwrap_or(POISON)
                        })
                        .collect()
                })
                .collect();
            let n = plan.batches.len();
            let admitted_at = self.d[d]
                .admitted
                .get(&plan.request)
                .copied()
                .unwrap_or(self.now);
            let waited = Duration::from_nanos(self.now.saturating_sub(admitted_at));
            self.stats.max_queue_wait = self.stats.max_queue_wait.max(waited);
            let request = plan.request.clone();
            self.d[d].loads.insert(
                request.clone(),
                Load {
                    p,
                    conn,
                    plan,
                    copied,
                    fence_matched: vec![false; n],
                    results: vec![None; n],
                    admitted_at,
                },
            );
            let ev = Ev::ReadDone {
                d,
                incarnation: self.d[d].incarnation,
                request,
            };
            self.schedule(self.now + nanos(self.config.read), ev);
        }
    }

    /// Whether a read over D's connection (to P incarnation `conn`) reaches P now.
    pub(super) fn reachable(&self, d: usize, p: usize, conn: Option<u32>) -> bool {
        self.p[p].alive
            && conn == Some(self.p[p].incarnation)
            && !self.partitioned(
                Addr::D { engine: d, rank: 0 },
                Addr::P {
                    engine: p,
                    worker: 0,
                },
            )
    }

    /// The end of a request's reads (the NIC's time, whatever D's engine thread does): the
    /// fence word of the first block, on every P worker read.
    pub(super) fn read_done(&mut self, d: usize, incarnation: u32, request: &RequestId) {
        if !self.d[d].alive || self.d[d].incarnation != incarnation {
            return;
        }
        let Some(load) = self.d[d].loads.get(request) else {
            return;
        };
        let (p, conn) = (load.p, load.conn);
        let reachable = self.reachable(d, p, conn);
        let fence = load.plan.fence_generation;
        let first = load.plan.remote.blocks.first().map(|b| b.0 as usize);
        let bytes = load.plan.remote.blocks.len() as u64;
        let words: Vec<Option<u64>> = load
            .plan
            .batches
            .iter()
            .map(|b| {
                let pool = self.p[p].pools.get(b.p_rank as usize)?;
                pool.words.get(first?).copied()
            })
            .collect();
        let ignore_fence = self.config.bug == Some(Bug::IgnoreFence);
        let mut stale = 0;
        let mut failed = 0;
        let Some(load) = self.d[d].loads.get_mut(request) else {
            return;
        };
        for (i, word) in words.into_iter().enumerate() {
            let result = if !reachable {
                failed += 1;
                BatchResult::Failed(cause(
                    "P engine unreachable (crashed, restarted or cut off)",
                ))
            } else {
                let matched = word == Some(fence);
                load.fence_matched[i] = matched;
                if matched || ignore_fence {
                    BatchResult::Done { bytes }
                } else {
                    stale += 1;
                    BatchResult::Stale
                }
            };
            load.results[i] = Some(result);
        }
        self.stats.stale_reads += stale;
        self.stats.failed_reads += failed;
        self.trace(&[11, self.now, d as u64, stale, failed]);
    }

    /// Reports the reads that ended to the core; a done batch sends its read completion
    /// to the P worker it read.
    pub(super) fn finish_loads(&mut self, d: usize) {
        let ready: Vec<RequestId> = self.d[d]
            .loads
            .iter()
            .filter(|(_, l)| l.results.iter().all(Option::is_some))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ready {
            if self.config.bug == Some(Bug::SkipAbortedReads)
                && !self.d[d].admitted.contains_key(&id)
            {
                self.d[d].loads.remove(&id);
                continue;
            }
            let Some(load) = self.d[d].loads.get_mut(&id) else {
                continue;
            };
            let p = load.p;
            let results: Vec<Option<BatchResult>> =
                load.results.iter_mut().map(Option::take).collect();
            let notifs: Vec<(u32, u32, Vec<u8>)> = load
                .plan
                .batches
                .iter()
                .map(|b| (b.d_worker, b.p_rank, b.notif.clone()))
                .collect();
            let mut lost = false;
            for (i, (result, (d_worker, p_rank, notif))) in
                results.into_iter().zip(notifs).enumerate()
            {
                let Some(result) = result else { continue };
                match &result {
                    BatchResult::Done { .. } => {
                        let bytes = self.maybe_underreport(notif);
                        self.send(
                            Addr::D {
                                engine: d,
                                rank: d_worker,
                            },
                            Addr::P {
                                engine: p,
                                worker: p_rank,
                            },
                            bytes,
                        );
                    }
                    BatchResult::Failed(_) => lost = true,
                    BatchResult::Stale => {}
                }
                self.d[d].core.handle_batch_done(&id, i, result);
                self.d_drain(d);
            }
            self.d[d].loads.remove(&id);
            if lost {
                self.forget(d, p);
            }
        }
    }

    /// The planted bug: rewrite a read completion to claim a single consumer.
    pub(super) fn maybe_underreport(&self, bytes: Vec<u8>) -> Vec<u8> {
        if self.config.bug != Some(Bug::UnderreportConsumers) {
            return bytes;
        }
        match decode(&bytes) {
            Ok(Notif::ReadComplete(rc)) => ReadComplete {
                consumers_total: 1,
                ..rc
            }
            .encode(),
            _ => bytes,
        }
    }

    /// Drains the core's events (after every input), in the core's order.
    pub(super) fn d_drain(&mut self, d: usize) {
        loop {
            let mut events = Vec::new();
            while let Some(e) = self.d[d].core.poll_event() {
                self.note(|| format!("D{d} event {e:?}"));
                events.push(e);
            }
            if events.is_empty() {
                return;
            }
            for event in events {
                match event {
                    DecodeEvent::Loaded { request, .. } => self.verify(d, &request),
                    DecodeEvent::Finished { request, outcome } => {
                        self.d_finished(d, &request, &outcome)
                    }
                    DecodeEvent::HandshakeDone { .. } | DecodeEvent::EngineDropped { .. } => {}
                }
            }
        }
    }

    pub(super) fn d_finished(&mut self, d: usize, request: &RequestId, outcome: &Outcome) {
        self.d[d].admitted.remove(request);
        self.d[d].tracked.remove(request);
        let end = match outcome {
            Outcome::Done => End::Done,
            Outcome::Failed(e) => {
                if matches!(e, LoadError::Expired { .. }) {
                    self.trace(&[12, self.now, d as u64]);
                }
                End::Failed
            }
            Outcome::Aborted => End::Aborted,
            other @ Outcome::Shutdown => {
                self.fail(format!(
                    "D{d}: {request} ended in {other:?}, which no shell asked for"
                ));
                End::Aborted
            }
        };
        self.end(request, end);
    }

    pub(super) fn crash_d(&mut self, d: usize, restart_after: Option<Duration>) {
        if !self.d[d].alive {
            return;
        }
        let engine = &mut self.d[d];
        engine.alive = false;
        // Its core, queue, reads and decodes vanish; it sends nothing more.
        let mut lost: Vec<RequestId> = std::mem::take(&mut engine.admitted).into_keys().collect();
        lost.extend(engine.arrivals.drain(..).map(|(id, _, _)| id));
        let mut victims: Vec<RequestId> = engine.tracked.drain().collect();
        victims.sort();
        engine.loads.clear();
        engine.decoding.clear();
        engine.inbox.clear();
        engine.handshakes.clear();
        engine.lost_conns.clear();
        engine.conns.clear();
        for request in victims {
            self.crash_victims.insert(request, d);
        }
        for request in lost {
            self.end(&request, End::LostWithD);
        }
        self.holds_lost_with(d);
        self.d_crashed_at[d] = Some(self.now);
        let back = restart_after.map_or(u64::MAX, |a| self.now + nanos(a));
        self.faults.push((self.now, back));
        self.trace(&[14, self.now, d as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartD { d });
        }
    }

    pub(super) fn restart_d(&mut self, d: usize) {
        let engine = &mut self.d[d];
        engine.alive = true;
        engine.incarnation += 1;
        engine.core = d_core(
            &self.config,
            self.lease,
            engine.id.clone(),
            engine.incarnation,
        );
        engine.mem = engines::d_mem(&self.config);
        engine.stalled_until = 0;
        engine.last_step = self.now;
        let incarnation = engine.incarnation;
        self.stats.d_restarts += 1;
        self.trace(&[6, self.now, d as u64]);
        self.schedule(self.now, Ev::DStep { d, incarnation });
    }

    // ---- the rogue ----------------------------------------------------------------------
}
