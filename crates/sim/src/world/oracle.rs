//! The checks: the lease oracle (its own model of ownership and expiry), the content and
//! fence oracle of every load, and the end-of-run checks (one outcome per request, the
//! restart bound, no leak).

use super::*;

impl World {
    /// The end of the run: every request ended exactly once (oracle 1), the first request
    /// after each P restart completed (oracle 3), nothing leaked (oracle 4).
    pub(super) fn check_end(&mut self) {
        let mut problems = Vec::new();
        let mut ok = 0;
        let mut restart_checks = 0;
        for (id, r) in &self.requests {
            match (r.ends, r.end) {
                (1, Some((end, ended))) => {
                    ok += 1;
                    if r.watched {
                        let hit = r.rogue_hit
                            || self
                                .faults
                                .iter()
                                .any(|&(a, b)| a <= ended && r.arrived <= b);
                        if end == End::Failed && !hit {
                            problems.push(format!(
                                "restart: {id}, the first request to restarted P{} past restart + handshake + lease, ended {end:?} with no fault (nor the rogue) on its way",
                                r.p
                            ));
                        }
                        restart_checks += u64::from(!hit);
                    }
                }
                (0, _) => problems.push(format!("outcome: {id} ended in no outcome")),
                (n, _) => problems.push(format!("outcome: {id} ended in {n} outcomes")),
            }
        }
        self.stats.outcomes_ok = ok;
        self.stats.peer_restarts_seen = self.d.iter().map(|d| d.core.stats().peer_restarts).sum();
        self.stats.instance_checks = self.d.iter().map(|d| d.core.stats().instance_checks).sum();
        self.stats.deferred_batches = self.d.iter().map(|d| d.core.stats().deferred_batches).sum();
        self.stats.restart_checks = restart_checks;
        for p in self.p.iter().filter(|p| p.alive) {
            if !p.core.is_idle() || p.core.blocks_allocated() != 0 || p.core.leases() != 0 {
                problems.push(format!(
                    "leak: {} is not idle at the end: {} leases, {} blocks allocated, {} waiting, {} prefilling",
                    p.id,
                    p.core.leases(),
                    p.core.blocks_allocated(),
                    p.core.waiting(),
                    p.core.prefilling()
                ));
            }
            for (w, pool) in p.pools.iter().enumerate() {
                let fenced = pool
                    .words
                    .iter()
                    .filter(|&&x| x != Generation::FREE_WORD)
                    .count();
                if fenced > 0 {
                    problems.push(format!(
                        "leak: {} worker {w} has {fenced} blocks with a live fence word at the end",
                        p.id
                    ));
                }
            }
            if !p.oracle.is_empty() {
                problems.push(format!(
                    "leak: the oracle of {} still has {} leases",
                    p.id,
                    p.oracle.len()
                ));
            }
        }
        for d in self.d.iter().filter(|d| d.alive) {
            if !d.core.is_idle() || d.core.tracked() != 0 || d.core.blocks_allocated() != 0 {
                problems.push(format!(
                    "leak: {} is not idle at the end: {} tracked, {} blocks allocated, {} running, {} waiting",
                    d.id,
                    d.core.tracked(),
                    d.core.blocks_allocated(),
                    d.core.running(),
                    d.core.waiting()
                ));
            }
            if !d.loads.is_empty() || !d.decoding.is_empty() {
                problems.push(format!(
                    "leak: {} has {} loads and {} decodes at the end",
                    d.id,
                    d.loads.len(),
                    d.decoding.len()
                ));
            }
        }
        problems.extend(self.check_holds_end());
        for p in problems {
            self.fail(p);
        }
    }

    /// The oracle's own reading of a message to P, with its own model of ownership (the
    /// first engine that heartbeats or reads a lease owns it; messages about it from any
    /// other engine, and completions or aborts that name another engine's consumer, are
    /// foreign): what P must answer, and the consumers, aborts and renewals it learns.
    pub(super) fn p_observe(
        &mut self,
        p: usize,
        local_ns: u64,
        sender: &EngineId,
        bytes: &[u8],
    ) -> Expect {
        // The baseline (one fixed timeout) never extends.
        let extension = match self.config.mode {
            LeaseMode::Lease => nanos(self.lease.extension()),
            LeaseMode::Fixed => 0,
        };
        let rogue = *sender == self.rogue;
        let engine = &mut self.p[p];
        let mut expect = Expect::default();
        match decode(bytes) {
            Ok(Notif::Heartbeat(ids)) => {
                let mut mine = Vec::new();
                for id in ids.iter() {
                    match engine.oracle.get_mut(id) {
                        Some(lease) if lease.owner.as_ref().is_some_and(|o| o != sender) => {
                            expect.heartbeat.3 += 1;
                        }
                        Some(lease) if lease.expiry_ns > local_ns => {
                            expect.heartbeat.0 += 1;
                            mine.push(id);
                            lease.last_heartbeat_ns = Some(local_ns);
                            let renewed = local_ns + extension;
                            if renewed > lease.expiry_ns {
                                let key = (
                                    lease.expiry_ns,
                                    RequestId::new(id).unwrap_or_else(|_| unreachable_id()),
                                );
                                engine.deadlines.remove(&key);
                                lease.expiry_ns = renewed;
                                engine.deadlines.insert((renewed, key.1));
                            }
                        }
                        Some(_) => {
                            expect.heartbeat.1 += 1;
                            mine.push(id);
                        }
                        None => {
                            expect.heartbeat.2 += 1;
                            if !rogue {
                                self.stats.heartbeats_after_release += 1;
                            }
                        }
                    }
                }
                // A heartbeat that renewed anything claims every lease it named and held.
                if expect.heartbeat.0 > 0 {
                    for id in mine {
                        if let Some(lease) = engine.oracle.get_mut(id) {
                            lease.owner.get_or_insert_with(|| sender.clone());
                        }
                        if rogue && let Some(r) = self.requests.get_mut(id) {
                            r.rogue_hit = true;
                        }
                    }
                }
            }
            Ok(Notif::ReadComplete(rc)) => {
                let lease = engine.oracle.get_mut(&rc.request);
                if rc.consumer.engine != *sender
                    || rc.consumers_total > self.config.p_tp.max(64)
                    || lease
                        .as_ref()
                        .is_some_and(|l| l.owner.as_ref().is_some_and(|o| o != sender))
                {
                    expect.foreign = true;
                } else if let Some(lease) = lease {
                    lease.owner.get_or_insert_with(|| sender.clone());
                    lease.consumers.insert(rc.consumer);
                    if rogue && let Some(r) = self.requests.get_mut(&rc.request) {
                        r.rogue_hit = true;
                    }
                } else {
                    expect.unknown = true;
                }
            }
            Ok(Notif::Abort(a)) => {
                let lease = engine.oracle.get_mut(&a.request);
                if a.consumer.engine != *sender
                    || lease
                        .as_ref()
                        .is_some_and(|l| l.owner.as_ref().is_some_and(|o| o != sender))
                {
                    expect.foreign = true;
                } else if let Some(lease) = lease {
                    lease.aborted = true;
                    if rogue && let Some(r) = self.requests.get_mut(&a.request) {
                        r.rogue_hit = true;
                    }
                } else {
                    expect.unknown = true;
                }
            }
            // The pull world sends no push-mode frames.
            Ok(
                Notif::Expired(_)
                | Notif::App(_)
                | Notif::PushRegister(_)
                | Notif::PushHeartbeat(_)
                | Notif::WriteDone(_)
                | Notif::PushFailed(_)
                | Notif::ReservationReleased(_),
            )
            | Err(_) => {}
        }
        expect
    }

    /// The latest local time at which P may release a lease that expired at `expiry_ns`:
    /// one step past the expiry, or past the end of a stall that covered it.
    pub(super) fn reclaim_limit(&self, p: usize, expiry_ns: u64) -> u64 {
        let engine = &self.p[p];
        let resumed = if engine.stall_end > 0 {
            engine.clock.local(engine.stall_end).as_nanos_saturating()
        } else {
            0
        };
        expiry_ns.max(resumed) + self.p_step_max_ns()
    }

    /// The checker's view of a release: was it allowed, and was it on time?
    pub(super) fn check_release(&mut self, p: usize, local_ns: u64, released: &Released) {
        let Some(lease) = self.p[p].oracle.remove(&released.request) else {
            let msg = format!(
                "P{p}: released {} which the oracle does not hold",
                released.request
            );
            self.fail(msg);
            return;
        };
        self.p[p]
            .deadlines
            .remove(&(lease.expiry_ns, released.request.clone()));
        if lease.generation != released.generation {
            let msg = format!(
                "P{p}: {} released with a wrong generation",
                released.request
            );
            self.fail(msg);
        }
        if lease.owner.as_ref() == Some(&self.rogue) {
            // The rogue claimed it first: it owns the lease like any reader, and may end
            // it early. Only the fence (no wrong output) protects the honest reader then.
            self.stats.rogue_owned += 1;
            return;
        }
        let expected = self.consumers();
        let completed = lease.consumers.len() as u64 >= u64::from(expected);
        let what = match released.reason {
            ReleaseReason::Completed => {
                self.stats.released_completed += 1;
                "completed"
            }
            ReleaseReason::Expired => {
                self.stats.released_expired += 1;
                "expired"
            }
            ReleaseReason::Aborted => {
                self.stats.released_aborted += 1;
                "aborted"
            }
        };
        let legit_early = match released.reason {
            ReleaseReason::Completed => completed,
            ReleaseReason::Expired => false,
            ReleaseReason::Aborted => lease.aborted,
        };
        if released.reason == ReleaseReason::Completed && !completed {
            let msg = format!(
                "P{p}: {} freed as completed after {} of {expected} consumers reported",
                released.request,
                lease.consumers.len(),
            );
            self.fail(msg);
        }
        if !legit_early {
            //= docs/spec.md#expiry
            //# P reclaims the blocks of every lease past its expiry.
            let limit = self.reclaim_limit(p, lease.expiry_ns);
            if local_ns < lease.expiry_ns {
                let msg = format!(
                    "P{p}: {} freed ({what}) {} before its expiry, neither completed nor aborted",
                    released.request,
                    fmt_ns(lease.expiry_ns - local_ns)
                );
                self.fail(msg);
            } else if local_ns > limit {
                let msg = format!(
                    "P{p}: {} reclaimed late ({what}): {} after its expiry (limit one step, {})",
                    released.request,
                    fmt_ns(local_ns - lease.expiry_ns),
                    fmt_ns(self.p_step_max_ns())
                );
                self.fail(msg);
            }
        }
        if released.reason == ReleaseReason::Expired || !legit_early {
            self.check_expiry_rules(p, local_ns, &lease, released);
        }
    }

    pub(super) fn check_expiry_rules(
        &mut self,
        p: usize,
        local_ns: u64,
        lease: &OracleLease,
        released: &Released,
    ) {
        let d = lease.d_engine;
        if self.config.expect_no_expiry_while_tracked
            && self.d[d].alive
            && self.d[d].tracked.contains(&released.request)
        {
            let msg = format!(
                "P{p}: {} expired while D{d} is alive and tracks it (last heartbeat {})",
                released.request,
                lease
                    .last_heartbeat_ns
                    .map_or_else(|| "never".into(), fmt_ns)
            );
            self.fail(msg);
        }
        let Some(crashed_at) = self.d_crashed_at[d] else {
            return;
        };
        if self.crash_victims.get(&released.request) != Some(&d) || self.d[d].alive {
            return;
        }
        // D crashed while tracking this request: the crash bound.
        self.stats.crash_reclaims += 1;
        let since_crash = Duration::from_nanos(self.now.saturating_sub(crashed_at));
        self.stats.crash_reclaim_since_crash_max =
            self.stats.crash_reclaim_since_crash_max.max(since_crash);
        if self.config.mode != LeaseMode::Lease {
            // The baseline holds blocks for its whole timeout; the bound is the lease's.
            return;
        }
        let extension = nanos(self.lease.extension());
        let interval = nanos(self.lease.interval());
        if let Some(hb) = lease.last_heartbeat_ns {
            let after = local_ns.saturating_sub(hb);
            if after < extension {
                let msg = format!(
                    "P{p}: {} reclaimed {} after its last heartbeat, before the extension {}",
                    released.request,
                    fmt_ns(after),
                    fmt_ns(extension)
                );
                self.fail(msg);
            }
        }
        // The last delivered heartbeat set the expiry: the reclaim must come between the
        // extension and the extension + one P step after it.
        if let Some(hb) = lease
            .last_heartbeat_ns
            .filter(|&hb| hb + extension == lease.expiry_ns)
        {
            let after = local_ns.saturating_sub(hb);
            let seen = self
                .stats
                .crash_reclaim_after_heartbeat
                .get_or_insert_with(|| (Duration::from_nanos(after), Duration::from_nanos(after)));
            seen.0 = seen.0.min(Duration::from_nanos(after));
            seen.1 = seen.1.max(Duration::from_nanos(after));
        }
        // True time, from the crash: extension + interval + one D step + the network + one P step.
        let bound = extension
            + interval
            + nanos(self.config.d_step)
            + nanos(self.config.step_jitter)
            + nanos(self.config.net.delay)
            + nanos(self.config.net.jitter)
            + self.p_step_max_ns()
            + (extension + interval) / 1000;
        // A lease younger than the crash bound runs at least its initial duration; a P
        // stall delays every reclaim to its end.
        let duration = nanos(self.config.lease);
        let initial_end = lease.granted_true_ns + duration + duration / 1000 + self.p_step_max_ns();
        let stall_end = self.p[p].stall_end + self.p_step_max_ns();
        let limit = (crashed_at + bound).max(initial_end).max(stall_end);
        if self.now > limit {
            let msg = format!(
                "P{p}: {} reclaimed {} after D{d} crashed; bound: extension + interval + steps + network = {}",
                released.request,
                fmt_ns(self.now - crashed_at),
                fmt_ns(bound)
            );
            self.fail(msg);
        }
    }

    /// Every lease past its expiry by more than one step (or a stall) must be gone.
    pub(super) fn check_overdue(&mut self, p: usize, local_ns: u64) {
        let Some((expiry, request)) = self.p[p].deadlines.first().cloned() else {
            return;
        };
        let exempt = self.p[p]
            .oracle
            .get(&request)
            .is_some_and(|l| l.aborted || l.consumers.len() as u64 >= u64::from(self.consumers()));
        if !exempt && local_ns > self.reclaim_limit(p, expiry) {
            let msg = format!(
                "P{p}: {request} not reclaimed {} after its expiry",
                fmt_ns(local_ns - expiry)
            );
            self.fail(msg);
            // Report it once.
            self.p[p].deadlines.remove(&(expiry, request));
        }
    }

    /// Oracle 2 and the content oracle: a loaded request's every batch read under its
    /// matching fence, and every block holds the request's own content.
    pub(super) fn verify(&mut self, d: usize, request: &RequestId) {
        let Some(load) = self.d[d].loads.get(request) else {
            self.fail(format!("D{d}: {request} loaded with no reads in flight"));
            return;
        };
        let seed = self.requests.get(request).map_or(0, |r| r.content_seed);
        let mut problems = Vec::new();
        for (i, b) in load.plan.batches.iter().enumerate() {
            if !load.fence_matched[i] {
                problems.push(format!(
                    "D{d}: output from a read whose fence did not match: {request} batch {i} (P worker {})",
                    b.p_rank
                ));
            }
            let copied = &load.copied[i];
            let wrong = copied.len() != load.plan.remote.blocks.len()
                || copied
                    .iter()
                    .enumerate()
                    .any(|(j, &c)| c != block_content(seed, b.p_rank, j));
            if wrong {
                let poisoned = copied.contains(&POISON);
                problems.push(format!(
                    "D{d}: wrong output: {request} batch {i} read {} content under its matching fence",
                    if poisoned { "poisoned" } else { "foreign" }
                ));
            }
        }
        let admitted_at = load.admitted_at;
        let ok = problems.is_empty();
        for p in problems {
            self.fail(p);
        }
        self.d[d].tracked.remove(request);
        let verdict = if ok {
            Ok(())
        } else {
            Err(cause("the KV read did not verify"))
        };
        self.d[d].core.handle_verified(request, verdict);
        if ok {
            self.stats.reads_ok += 1;
            let decode = self
                .rng
                .range(nanos(self.config.decode.0), nanos(self.config.decode.1));
            self.d[d]
                .decoding
                .push((self.now + decode, request.clone()));
            self.trace(&[13, self.now, d as u64, admitted_at]);
        }
    }
}
