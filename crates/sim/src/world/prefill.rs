//! The P shell: what the prefill agent does around its `PrefillCore` (jobs, prefills that
//! write the blocks, grants that publish the generation, fence clears, expiry notices), and
//! P crashes and restarts.

use super::*;

impl World {
    pub(super) fn arrival(&mut self) {
        if self.arrivals_left == 0 {
            return;
        }
        self.arrivals_left -= 1;
        self.stats.arrived += 1;
        let p = self.rng.index(self.p.len());
        let request = request_id(self.next_request);
        self.next_request += 1;
        let (lo, hi) = self.config.blocks_per_request;
        let n = self.rng.range(u64::from(lo.max(1)), u64::from(hi.max(1)));
        let tokens =
            (n * u64::from(BLOCK_SIZE) - self.rng.range(0, u64::from(BLOCK_SIZE) - 1)) as usize;
        // Bidirectional mode: the request is the first turn of a conversation.
        let conv = self.config.bidir.map(|b| self.new_conv(b, tokens));
        let engine = &mut self.p[p];
        let watched = engine.alive && engine.watch_from.is_some_and(|t| t <= self.now);
        if watched {
            engine.watch_from = None;
        }
        self.requests.insert(
            request.clone(),
            Req::arrived(p, tokens, self.now, watched, conv),
        );
        let alive = engine.alive;
        self.trace(&[4, self.now, p as u64]);
        if alive {
            let engine = &mut self.p[p];
            engine.jobs.push_back(request.clone());
            engine.pending.insert(request);
        } else {
            self.end(&request, End::LostWithP);
        }
        if self.arrivals_left > 0 {
            let gap = self.rng.range(0, 2 * nanos(self.config.arrival_gap));
            self.schedule(self.now + gap, Ev::Arrival);
        }
    }

    pub(super) fn p_step(&mut self, p: usize) {
        let local = self.p[p].clock.local(self.now);
        let local_ns = local.as_nanos_saturating();
        // 0. Bidirectional mode (symmetric lease): heartbeats for the cached turns whose
        // next turns wait here.
        self.heartbeat_cached(p, local);
        // 1. New requests.
        while let Some(request) = self.p[p].jobs.pop_front() {
            let tokens = self.requests.get(&request).map_or(0, |r| r.tokens);
            if self.p[p]
                .core
                .handle_job(local, request.clone(), tokens)
                .is_err()
            {
                self.p[p].pending.remove(&request);
                self.end(&request, End::RefusedAtP);
            }
            self.p_drain(p, local_ns);
        }
        // 2. Prefills computed: grant, publish the generation, hand the request to a D.
        while self.p[p]
            .prefilling
            .front()
            .is_some_and(|(done, _)| *done <= self.now)
        {
            let Some((_, request)) = self.p[p].prefilling.pop_front() else {
                break;
            };
            match self.p[p].core.handle_prefill_done(local, &request) {
                Ok(granted) => {
                    self.grant(p, local_ns, &request, granted.generation, &granted.blocks)
                }
                Err(_) => {
                    self.p[p].pending.remove(&request);
                    self.end(&request, End::RefusedAtP);
                }
            }
            self.p_drain(p, local_ns);
        }
        // 3. Prefills to start: the compute writes the blocks from its first layer on.
        while let Some(start) = self.p[p].core.poll_prefill(local) {
            let seed = self.rng.next_u64();
            if let Some(r) = self.requests.get_mut(&start.request) {
                r.content_seed = seed;
            }
            for (w, pool) in self.p[p].pools.iter_mut().enumerate() {
                for (i, b) in start.blocks.iter().enumerate() {
                    if let Some(c) = pool.content.get_mut(b.0 as usize) {
                        // `w` indexes the workers, so it fits u32.
                        *c = block_content(seed, w as u32, i);
                    }
                }
            }
            // Bidirectional mode: a next turn may first pull its shared prefix from D.
            let pull = self.start_pull(p, &start.request, local);
            let done = self.now + pull + nanos(self.config.prefill);
            // In completion order (without pulls, that is arrival order).
            let prefilling = &mut self.p[p].prefilling;
            let at = prefilling
                .iter()
                .position(|(t, _)| *t > done)
                .unwrap_or(prefilling.len());
            prefilling.insert(at, (done, start.request));
            self.p_drain(p, local_ns);
        }
        self.p_drain(p, local_ns);
        // 4. Notifications.
        while let Some((from, bytes)) = self.p[p].inbox.pop_front() {
            self.p_notif(p, local, from, &bytes);
            self.p_drain(p, local_ns);
        }
        // 5. The reaper.
        self.reap(p, local);
        self.p_drain(p, local_ns);
        self.check_overdue(p, local_ns);
    }

    pub(super) fn grant(
        &mut self,
        p: usize,
        local_ns: u64,
        request: &RequestId,
        generation: Generation,
        blocks: &[kvlease_lease::BlockId],
    ) {
        let d = self.rng.index(self.d.len());
        let duration = nanos(self.lease.duration());
        let engine = &mut self.p[p];
        for pool in &mut engine.pools {
            for b in blocks {
                if let Some(w) = pool.words.get_mut(b.0 as usize) {
                    *w = generation.word();
                }
            }
        }
        let expiry_ns = local_ns + duration;
        engine.oracle.insert(
            request.clone(),
            OracleLease {
                owner: None,
                generation,
                expiry_ns,
                last_heartbeat_ns: None,
                consumers: HashSet::new(),
                aborted: false,
                d_engine: d,
                granted_true_ns: self.now,
            },
        );
        engine.deadlines.insert((expiry_ns, request.clone()));
        engine.grant_order.push_back(request.clone());
        engine.pending.remove(request);
        let p_id = engine.id.clone();
        self.stats.granted += 1;
        let tokens = match self.requests.get_mut(request) {
            Some(r) => {
                r.generation = generation.word();
                r.tokens
            }
            None => 0,
        };
        let remote = RemoteKv::new(
            p_id,
            request.clone(),
            blocks.to_vec(),
            generation.word(),
            self.config.p_tp,
            u32::try_from(tokens).unwrap_or(u32::MAX),
            format!("p{p}"),
            0,
        )
        .with_instance(instance_of(self.p[p].incarnation));
        self.trace(&[5, self.now, p as u64, d as u64]);
        self.trace_str(request.as_str());
        self.in_flight_transfers += 1;
        let at = self.now + nanos(self.config.transfer_delay);
        self.schedule(
            at,
            Ev::Transfer {
                d,
                request: request.clone(),
                tokens,
                remote,
            },
        );
    }

    /// Drains the core's actions and events (after every input).
    pub(super) fn p_drain(&mut self, p: usize, local_ns: u64) {
        while let Some(action) = self.p[p].core.poll_action() {
            self.note(|| format!("P{p} action {action:?}"));
            match action {
                PrefillAction::ClearFences { released } => {
                    if self.config.bug != Some(Bug::SkipFenceClear) {
                        // Before anything else: the free word, then poison.
                        for pool in &mut self.p[p].pools {
                            for b in &released.blocks {
                                if let Some(w) = pool.words.get_mut(b.0 as usize) {
                                    *w = Generation::FREE_WORD;
                                }
                                if let Some(c) = pool.content.get_mut(b.0 as usize) {
                                    *c = POISON;
                                }
                            }
                        }
                    }
                    self.check_release(p, local_ns, &released);
                    let reason = match released.reason {
                        ReleaseReason::Completed => 1,
                        ReleaseReason::Expired => 2,
                        ReleaseReason::Aborted => 3,
                    };
                    self.trace(&[9, self.now, p as u64, reason]);
                    self.trace_str(released.request.as_str());
                }
                PrefillAction::Transmit { to, bytes } => {
                    self.stats.expiry_notices += 1;
                    self.send(
                        Addr::P {
                            engine: p,
                            worker: 0,
                        },
                        to,
                        bytes,
                    );
                }
            }
        }
        while let Some(event) = self.p[p].core.poll_event() {
            self.note(|| format!("P{p} event {event:?}"));
            if let PrefillEvent::Refused { request, .. } = event {
                self.p[p].pending.remove(&request);
                if self.config.bug != Some(Bug::DropRefusals) {
                    self.end(&request, End::RefusedAtP);
                }
            }
        }
    }

    pub(super) fn p_notif(&mut self, p: usize, local: Timestamp, from: Addr, bytes: &[u8]) {
        let local_ns = local.as_nanos_saturating();
        let sender = self.sender_engine(from);
        let rogue = from == Addr::Rogue;
        let expect = self.p_observe(p, local_ns, &sender, bytes);
        if self.config.bug == Some(Bug::IgnoreHeartbeats)
            && bytes.starts_with(kvlease_notif::HEARTBEAT_PREFIX)
        {
            return;
        }
        let peer = Peer {
            engine: sender,
            addr: from,
        };
        let handled = self.p[p].core.handle_notif(local, &peer, bytes);
        let who = if rogue { "forged" } else { "D" };
        let problem = match handled {
            PrefillNotif::Heartbeat {
                outcome, foreign, ..
            } => {
                self.stats.heartbeat_ids_unknown_or_late +=
                    u64::from(outcome.unknown + outcome.late);
                if rogue && foreign > 0 {
                    self.stats.forged_ignored += 1;
                }
                let got = (outcome.held, outcome.late, outcome.unknown, foreign);
                (got != expect.heartbeat).then(|| {
                    let e = expect.heartbeat;
                    format!(
                        "{who} heartbeat outcome held/late/unknown/foreign = {}/{}/{}/{}, oracle says {}/{}/{}/{}",
                        got.0, got.1, got.2, got.3, e.0, e.1, e.2, e.3
                    )
                })
            }
            PrefillNotif::ReadComplete { request, outcome } => {
                if !rogue {
                    self.stats.read_completions += 1;
                }
                if expect.foreign {
                    Some(format!(
                        "{who} read completion of {request} counted ({outcome:?}); the oracle says it is another engine's"
                    ))
                } else if expect.unknown != (outcome == ReadCompleteOutcome::Unknown) {
                    Some(format!(
                        "{who} read completion of {request}: {outcome:?}, the oracle does not agree"
                    ))
                } else {
                    None
                }
            }
            PrefillNotif::Abort { request, held } => {
                if expect.foreign {
                    Some(format!(
                        "{who} abort of {request} accepted; the oracle says it is another engine's"
                    ))
                } else if held == expect.unknown {
                    Some(format!(
                        "{who} abort of {request}: held={held}, the oracle does not agree"
                    ))
                } else {
                    None
                }
            }
            PrefillNotif::Foreign { request } => {
                if rogue {
                    self.stats.forged_ignored += 1;
                }
                (!expect.foreign).then(|| format!("{who} message about {request} ignored as foreign; the oracle says it may act"))
            }
            PrefillNotif::Malformed(e) => Some(format!("{who} message rejected: {e}")),
            PrefillNotif::Ignored => Some(format!("{who} message ignored")),
        };
        if let Some(problem) = problem {
            self.fail(format!("P{p}: {problem}"));
        }
    }

    pub(super) fn reap(&mut self, p: usize, local: Timestamp) {
        let local_ns = local.as_nanos_saturating();
        if self.config.bug == Some(Bug::GrantOrderReaper) {
            // The planted bug: oldest grant first, stop at the first live lease.
            while let Some(front) = self.p[p].grant_order.front().cloned() {
                match self.p[p].core.table().get(&front) {
                    None => {
                        self.p[p].grant_order.pop_front();
                    }
                    Some(info) if info.expiry <= local => {
                        let _ = self.p[p].core.abort(local, &front);
                        self.p[p].grant_order.pop_front();
                        self.p_drain(p, local_ns);
                    }
                    Some(_) => break,
                }
            }
            return;
        }
        self.p[p].core.handle_timeout(local);
        // Forget grant-order entries of released leases (bounded memory).
        let engine = &mut self.p[p];
        while engine
            .grant_order
            .front()
            .is_some_and(|r| !engine.oracle.contains_key(r))
        {
            engine.grant_order.pop_front();
        }
    }

    pub(super) fn crash_p(&mut self, p: usize, restart_after: Option<Duration>) {
        if !self.p[p].alive {
            return;
        }
        let engine = &mut self.p[p];
        engine.alive = false;
        // Its core, memory, queue and prefills vanish with it.
        let lost: Vec<RequestId> = std::mem::take(&mut engine.pending).into_iter().collect();
        engine.jobs.clear();
        engine.prefilling.clear();
        engine.inbox.clear();
        engine.oracle.clear();
        engine.deadlines.clear();
        engine.grant_order.clear();
        engine.watch_from = None;
        engine.turns.clear();
        engine.turn_heartbeats = kvlease_engine::TurnHeartbeats::default();
        engine.d_conns.clear();
        engine.pulls.clear();
        let incarnation = engine.incarnation;
        for request in lost {
            self.end(&request, End::LostWithP);
        }
        // Every D connected to it sees its connection break, a handshake time later.
        let detect = nanos(self.config.handshake);
        let noticed = if self.config.notice_lost_connections {
            self.d.len()
        } else {
            0
        };
        for d in 0..noticed {
            if self.d[d].alive && self.d[d].conns.get(&p) == Some(&incarnation) {
                let ev = Ev::ConnLost {
                    d,
                    incarnation: self.d[d].incarnation,
                    p,
                    p_incarnation: incarnation,
                };
                self.schedule(self.now + detect, ev);
            }
        }
        let back = restart_after.map_or(u64::MAX, |a| self.now + nanos(a));
        self.faults.push((self.now, back));
        self.trace(&[7, self.now, p as u64]);
        if let Some(after) = restart_after {
            self.schedule(self.now + nanos(after), Ev::RestartP { p });
        }
    }

    pub(super) fn restart_p(&mut self, p: usize) {
        let config = &self.config;
        let engine = &mut self.p[p];
        engine.alive = true;
        engine.incarnation += 1;
        engine.core = p_core(config, self.lease, engine.id.clone(), engine.incarnation);
        engine.pools = (0..config.p_tp)
            .map(|_| Pool::new(config.blocks_per_worker))
            .collect();
        engine.stalled_until = 0;
        // The restart bound: D noticed the lost connection (a handshake time after the
        // crash), handshakes again (a handshake time), and every lease of the old
        // incarnation an old reader could hold has ended (a lease duration).
        engine.watch_from = Some(self.now + nanos(config.handshake) + nanos(config.lease));
        let incarnation = engine.incarnation;
        self.stats.p_restarts += 1;
        self.trace(&[8, self.now, p as u64]);
        self.schedule(self.now, Ev::PStep { p, incarnation });
    }

    // ---- D ------------------------------------------------------------------------------
}
