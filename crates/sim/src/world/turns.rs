//! Bidirectional multi-turn mode ([`BidirSim`]): conversations whose turns go P → D → P.
//!
//! The D shell does what the decode agent does (`decode/hold.rs`) around its
//! `DecodeCore`, built `with_hold`: when a turn finishes, `request_finished_hold` keeps
//! its blocks (the shell publishes the turn's generation into D's fence words) and the
//! shell answers [`DecoderKvParams`]; P's heartbeats and read completions go to
//! `handle_notif_at`; `handle_timeout` expires turns each step and, before each load,
//! evicts the oldest while the next request is short of blocks; for each turn that
//! `poll_turn_released` hands out, the shell publishes the free word and poison (the core
//! frees the blocks). Planted bugs drop or skip what the core asks of the shell. The P
//! shell does what the prefill agent does (`prefill/pull.rs`): while a next turn waits, it
//! heartbeats the cached turn on the agent's schedule
//! ([`TurnHeartbeats`](kvlease_engine::TurnHeartbeats), symmetric lease); when its
//! prefill starts,
//! it probes D's clock, decides with [`plan_pull`] and either reads D's held blocks (a
//! one-sided read: the content when it starts, the fence word of the first block when it
//! ends) or recomputes; then it tells D it has read.
//!
//! The hold oracle follows every cached turn ([`HoldRec`]): a pull that completes saw the
//! blocks of the conversation's previous turn under the hold's generation; every hold ends
//! exactly once (pulled, expired, evicted or lost with a crashed D), never before its
//! deadline when it expires and never more than one D step after it (or after the end of
//! a D stall), and at once when D gets P's read completion.

use kvlease_engine::{
    DeadlineBasis, DecoderKvParams, HoldRefused, KeptTurn, PullDecision, PullPolicy, TurnEnd,
    TurnHeartbeat, block_hashes, plan_pull,
};
use kvlease_lease::{BlockId, ClockOffsetEstimator, PeerTimestamp};

use super::*;
use crate::config::BidirSim;

/// One conversation.
#[derive(Debug)]
pub(super) struct Conv {
    /// Seed of its tokens (a rewritten history draws a new one).
    token_seed: u64,
    /// Turns still to come.
    turns_left: u32,
    /// Prompt length of its latest turn.
    prompt: usize,
}

/// How a cached turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HoldEnd {
    /// P read it (or gave up reading) and told D.
    Pulled,
    /// Its TTL passed.
    Expired,
    /// A new request needed its blocks.
    Evicted,
    /// Its D crashed.
    LostWithD,
}

/// The oracle's record of one cached turn.
#[derive(Debug)]
pub(super) struct HoldRec {
    d: usize,
    incarnation: u32,
    /// The turn whose blocks are held.
    request: RequestId,
    generation: u64,
    blocks: Vec<BlockId>,
    /// The deadline on D's clock, in the oracle's own model (the TTL from the insert; with
    /// the symmetric lease, `max(deadline, received + extension)` for every heartbeat D
    /// handles before the deadline).
    deadline_ns: u64,
    extension_ns: Option<u64>,
    end: Option<HoldEnd>,
    ends: u32,
}

/// A next turn waiting on P with D's params of the last turn.
#[derive(Debug)]
pub(super) struct TurnIn {
    params: DecoderKvParams,
    d: usize,
    /// D's incarnation that held the turn.
    d_incarnation: u32,
}

/// P's read of D's held blocks, in flight.
#[derive(Debug)]
pub(super) struct Pull {
    d: usize,
    /// D's incarnation that held the turn.
    held_in: u32,
    /// D's incarnation P's handshake for pulls reached (`None`: D was down).
    conn: Option<u32>,
    hold: RequestId,
    generation: u64,
    blocks: Vec<BlockId>,
    /// What the read copied out of D's memory (at its start).
    copied: Vec<u64>,
}

/// Token `i` of a conversation whose tokens come from `seed`.
fn token(seed: u64, i: usize) -> u32 {
    (block_content(seed, 0, i) >> 40) as u32
}

fn tokens(seed: u64, len: usize) -> Vec<u32> {
    (0..len).map(|i| token(seed, i)).collect()
}

impl World {
    fn bidir(&self) -> Option<BidirSim> {
        self.config.bidir
    }

    /// A new conversation whose first turn has `prompt` tokens.
    pub(super) fn new_conv(&mut self, b: BidirSim, prompt: usize) -> usize {
        let turns = self
            .rng
            .range(u64::from(b.turns.0.max(1)), u64::from(b.turns.1.max(1)));
        let conv = Conv {
            token_seed: self.rng.next_u64(),
            turns_left: u32::try_from(turns - 1).unwrap_or(0),
            prompt,
        };
        self.convs.push(conv);
        self.convs.len() - 1
    }

    // ---- D ------------------------------------------------------------------------------

    /// A turn finished decoding on D: its blocks go into the hold (else back to the core),
    /// and the conversation's next turn, if any, goes to P after the think time.
    pub(super) fn finish_turn(&mut self, d: usize, id: &RequestId, local: Timestamp) {
        let kept = match self.d[d].core.request_finished_hold(local, id) {
            Ok(kept) => kept,
            Err(HoldRefused::NotDecoding { .. }) => {
                self.d_drain(d);
                return;
            }
            Err(e) => {
                self.d_drain(d);
                self.fail(format!("D{d}: the hold refused turn {id}: {e}"));
                return;
            }
        };
        self.d_drain(d);
        let held = self.hold_turn(d, id, &kept, local);
        if held.is_none() {
            // The shell cannot answer the turn's params: it gives the turn back.
            self.d[d].core.drop_turn(local, &kept.turn);
            self.drain_turns(d);
        }
        let Some(b) = self.bidir() else { return };
        let Some(c) = self.requests.get(id).and_then(|r| r.conv) else {
            return;
        };
        let Some(conv) = self.convs.get_mut(c) else {
            return;
        };
        if conv.turns_left == 0 {
            return;
        }
        conv.turns_left -= 1;
        let think = self.rng.range(nanos(b.think.0), nanos(b.think.1));
        self.turns_pending += 1;
        let incarnation = self.d[d].incarnation;
        let held = held.map(|params| Box::new((params, d, incarnation)));
        self.schedule(
            self.now + think,
            Ev::NextTurn {
                conv: c,
                held,
                think,
            },
        );
    }

    /// Publishes the generation of turn `id`, which D's core kept, into the fence words
    /// and answers D's params; `None` when the conversation is unknown.
    fn hold_turn(
        &mut self,
        d: usize,
        id: &RequestId,
        kept: &KeptTurn,
        local: Timestamp,
    ) -> Option<DecoderKvParams> {
        let (seed, len) = {
            let r = self.requests.get(id)?;
            (self.convs.get(r.conv?)?.token_seed, r.tokens)
        };
        let ttl = nanos(self.bidir()?.ttl);
        let hold_id = kept.turn.clone();
        let blocks = &kept.blocks;
        let extension = kept.renew_extension;
        let word = kept.generation.word();
        let mem = &mut self.d[d].mem;
        for b in blocks {
            if let Some(w) = mem.words.get_mut(b.0 as usize) {
                *w = word;
            }
        }
        self.holds.insert(
            hold_id.clone(),
            HoldRec {
                d,
                incarnation: self.d[d].incarnation,
                request: id.clone(),
                generation: word,
                blocks: blocks.to_vec(),
                deadline_ns: local.as_nanos_saturating().saturating_add(ttl),
                extension_ns: extension.map(nanos),
                end: None,
                ends: 0,
            },
        );
        self.stats.holds += 1;
        self.trace(&[20, self.now, d as u64, word]);
        self.trace_str(hold_id.as_str());
        let prompt = tokens(seed, len);
        Some(DecoderKvParams {
            kvlease_bidir: true,
            remote_engine_id: self.d[d].id.to_string(),
            remote_host: format!("d{d}"),
            remote_port: 0,
            kvlease_clock_port: 0,
            remote_block_ids: blocks.iter().map(|b| b.0).collect(),
            remote_request_id: hold_id.to_string(),
            tp_size: self.config.d_tp,
            kvlease_generation: word,
            conversation_id: format!("conv-{}", self.requests.get(id)?.conv?),
            kvlease_num_tokens: u32::try_from(len).unwrap_or(u32::MAX),
            kvlease_block_size: BLOCK_SIZE,
            kvlease_block_hashes: block_hashes(&prompt, BLOCK_SIZE)
                .into_iter()
                .map(|h| format!("{h:016x}"))
                .collect(),
            kvlease_deadline_ns: kept.deadline.as_nanos_saturating(),
            kvlease_ttl_remaining: kept.ttl,
            kvlease_renew_extension_ms: extension.map_or(0, |e| e.as_millis() as u64),
        })
    }

    /// D's core applied P's heartbeat for cached turns `ids` (symmetric lease): the
    /// oracle's model follows.
    pub(super) fn hold_heartbeat(&mut self, d: usize, ids: &[RequestId]) {
        let local = self.d[d].clock.local(self.now);
        let local_ns = local.as_nanos_saturating();
        let incarnation = self.d[d].incarnation;
        // The oracle's model: the lease rule, never reviving a hold past its deadline.
        for id in ids {
            if let Some(rec) = self.holds.get_mut(id)
                && rec.d == d
                && rec.incarnation == incarnation
                && rec.end.is_none()
                && rec.deadline_ns > local_ns
                && let Some(ext) = rec.extension_ns
            {
                rec.deadline_ns = rec.deadline_ns.max(local_ns.saturating_add(ext));
            }
        }
    }

    /// D's core has P's read completion for cached turn `id` (or P gave up): the hold
    /// oracle checks that D freed it at once.
    pub(super) fn hold_read_complete(&mut self, d: usize, id: &RequestId) {
        let incarnation = self.d[d].incarnation;
        if let Some(rec) = self.holds.get(id)
            && rec.d == d
            && rec.incarnation == incarnation
            && rec.end.is_none()
        {
            self.fail(format!(
                "D{d}: cached turn {id} still held after P's read completion"
            ));
        }
    }

    /// P's frame `bytes` from `engine` to D `d` in bidirectional mode: D's core applies
    /// it at D's clock (heartbeats for held turns, read completions) when P sent it
    /// (`honest`), and the shell clears the fences of the turns it released. Planted
    /// [`Bug::KeepHoldAfterRead`]: a read completion is reported, not applied.
    pub(super) fn hold_notif(
        &mut self,
        d: usize,
        engine: &EngineId,
        bytes: &[u8],
        honest: bool,
    ) -> DecodeNotif {
        let local = self.d[d].clock.local(self.now);
        let keep = self.config.bug == Some(Bug::KeepHoldAfterRead)
            && matches!(decode(bytes), Ok(Notif::ReadComplete(_)));
        let core = &mut self.d[d].core;
        let renewed = core.stats().turns_renewed;
        let handled = if honest && !keep {
            core.handle_notif_at(local, engine, bytes)
        } else {
            core.handle_notif(engine, bytes)
        };
        self.stats.cache_heartbeats_extended += core.stats().turns_renewed - renewed;
        self.drain_turns(d);
        handled
    }

    /// D's timer in bidirectional mode (the decode agent runs it before each load): the
    /// core expires the cached turns whose deadline passed and evicts the oldest while the
    /// next request is short of blocks; the shell clears their fences; then the oracle
    /// checks that none is overdue. Planted [`Bug::NoHoldExpiry`]: the timer never runs.
    pub(super) fn hold_timeout(&mut self, d: usize, local: Timestamp) {
        if self.config.bug != Some(Bug::NoHoldExpiry) {
            self.d[d].core.handle_timeout(local);
        }
        self.drain_turns(d);
        let local_ns = local.as_nanos_saturating();
        let incarnation = self.d[d].incarnation;
        let overdue: Vec<RequestId> = self
            .holds
            .iter()
            .filter(|(_, r)| {
                r.d == d
                    && r.incarnation == incarnation
                    && r.end.is_none()
                    && r.deadline_ns < local_ns
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in overdue {
            self.fail(format!("D{d}: cached turn {id} held past its deadline"));
        }
    }

    /// Clears the fences of every cached turn D's core released (the free word and
    /// poison: a pull in flight fails its fence); the core frees the blocks as it hands
    /// each one out. Planted [`Bug::SkipHoldFenceClear`]: the fences stay.
    fn drain_turns(&mut self, d: usize) {
        let local = self.d[d].clock.local(self.now);
        let clear = self.config.bug != Some(Bug::SkipHoldFenceClear);
        while let Some(r) = self.d[d].core.poll_turn_released() {
            let mem = &mut self.d[d].mem;
            for b in r.blocks.iter().filter(|_| clear) {
                if let Some(w) = mem.words.get_mut(b.0 as usize) {
                    *w = Generation::FREE_WORD;
                }
                if let Some(c) = mem.content.get_mut(b.0 as usize) {
                    *c = POISON;
                }
            }
            let end = match r.end {
                TurnEnd::Pulled => HoldEnd::Pulled,
                TurnEnd::Expired => HoldEnd::Expired,
                TurnEnd::Evicted => HoldEnd::Evicted,
                // Given back before its params were answered: the oracle never saw it.
                TurnEnd::Dropped => continue,
            };
            self.hold_ended(d, &r.turn, end, local, &r.blocks);
        }
    }

    /// The hold oracle: `id` ended with `end` at D's `local` time.
    fn hold_ended(
        &mut self,
        d: usize,
        id: &RequestId,
        end: HoldEnd,
        local: Timestamp,
        blocks: &[BlockId],
    ) {
        let local_ns = local.as_nanos_saturating();
        // One D step (with jitter and drift), counted from the end of a stall.
        let tolerance = nanos(self.config.d_step) + nanos(self.config.step_jitter) + 1_000_000;
        let stalled_lately = self.now.saturating_sub(self.d[d].stall_end) <= tolerance;
        let mut problems = Vec::new();
        match self.holds.get_mut(id) {
            None => problems.push(format!("D{d}: released {id}, which it never held")),
            Some(rec) => {
                rec.ends += 1;
                if let Some(first) = rec.end {
                    problems.push(format!(
                        "D{d}: cached turn {id} ended twice: {first:?}, then {end:?}"
                    ));
                } else {
                    rec.end = Some(end);
                    if rec.blocks != blocks {
                        problems.push(format!(
                            "D{d}: cached turn {id} released other blocks than it held"
                        ));
                    }
                    if end == HoldEnd::Expired {
                        if local_ns < rec.deadline_ns {
                            problems.push(format!(
                                "D{d}: cached turn {id} expired {} before its deadline",
                                fmt_ns(rec.deadline_ns - local_ns)
                            ));
                        } else if local_ns - rec.deadline_ns > tolerance && !stalled_lately {
                            problems.push(format!(
                                "D{d}: cached turn {id} expired {} after its deadline",
                                fmt_ns(local_ns - rec.deadline_ns)
                            ));
                        }
                    }
                }
            }
        }
        for p in problems {
            self.fail(p);
        }
        match end {
            HoldEnd::Pulled => self.stats.holds_pulled += 1,
            HoldEnd::Expired => self.stats.holds_expired += 1,
            HoldEnd::Evicted => self.stats.holds_evicted += 1,
            HoldEnd::LostWithD => self.stats.holds_lost_with_d += 1,
        }
        self.trace(&[21, self.now, d as u64, end as u64]);
        self.trace_str(id.as_str());
    }

    /// D `d` crashed: every cached turn it held is lost with it.
    pub(super) fn holds_lost_with(&mut self, d: usize) {
        let incarnation = self.d[d].incarnation;
        let lost: Vec<(RequestId, Vec<BlockId>)> = self
            .holds
            .iter()
            .filter(|(_, r)| r.d == d && r.incarnation == incarnation && r.end.is_none())
            .map(|(id, r)| (id.clone(), r.blocks.clone()))
            .collect();
        let local = self.d[d].clock.local(self.now);
        for (id, blocks) in lost {
            self.hold_ended(d, &id, HoldEnd::LostWithD, local, &blocks);
        }
    }

    // ---- P ------------------------------------------------------------------------------

    /// A conversation's next turn reaches P (a random engine), with D's params of the last
    /// turn (`held`: the params, D, and D's incarnation) when D held it.
    pub(super) fn next_turn(
        &mut self,
        c: usize,
        held: Option<(DecoderKvParams, usize, u32)>,
        think: u64,
    ) {
        self.turns_pending -= 1;
        let Some(b) = self.bidir() else { return };
        self.stats.turns += 1;
        // The prompt: the last one, the answer and the next question (or, now and then, a
        // rewritten history that shares nothing).
        let grow = self.rng.range(1, 2 * u64::from(BLOCK_SIZE)) as usize;
        let rewrite = self.rng.chance(b.rewrite_per_million);
        let token_seed = rewrite.then(|| self.rng.next_u64());
        let Some(conv) = self.convs.get_mut(c) else {
            return;
        };
        if let Some(seed) = token_seed {
            conv.token_seed = seed;
        }
        conv.prompt += grow;
        let tokens = conv.prompt;
        let p = self.rng.index(self.p.len());
        let request = request_id(self.next_request);
        self.next_request += 1;
        self.requests.insert(
            request.clone(),
            Req::arrived(p, tokens, self.now, false, Some(c)),
        );
        self.trace(&[22, self.now, p as u64, u64::from(held.is_some())]);
        self.trace_str(request.as_str());
        if !self.p[p].alive {
            self.end(&request, End::LostWithP);
            return;
        }
        let engine = &mut self.p[p];
        engine.jobs.push_back(request.clone());
        engine.pending.insert(request.clone());
        match held {
            // The proxy kept the params for the think time.
            Some((params, d, d_incarnation)) => {
                let params = params.aged_by(Duration::from_nanos(think));
                engine.turns.insert(
                    request,
                    TurnIn {
                        params,
                        d,
                        d_incarnation,
                    },
                );
            }
            None => self.stats.turns_without_hold += 1,
        }
    }

    /// Symmetric lease: sends the heartbeats for cached turns that P `p`'s schedule
    /// ([`TurnHeartbeats`](kvlease_engine::TurnHeartbeats), the prefill agent's) has due
    /// for the next turns waiting on it, from P worker 0 to D rank 0.
    pub(super) fn heartbeat_cached(&mut self, p: usize, local: Timestamp) {
        // Forget next turns that no longer wait (refused, lost).
        let engine = &mut self.p[p];
        let pending = &engine.pending;
        engine.turns.retain(|r, _| pending.contains(r));
        if self.bidir().is_none_or(|b| !b.symmetric) {
            return;
        }
        let engine = &mut self.p[p];
        engine
            .turn_heartbeats
            .handle_waiting(engine.turns.values().map(|t| &t.params));
        for TurnHeartbeat { turn, .. } in engine.turn_heartbeats.due(local) {
            let engine = &self.p[p];
            let Some(d) = engine
                .turns
                .values()
                .find(|t| t.params.remote_request_id == turn)
                .map(|t| t.d)
            else {
                continue;
            };
            let Ok(id) = RequestId::new(&turn) else {
                continue;
            };
            let Ok(msgs) = encode_heartbeats([&id], MAX_NOTIF_LEN) else {
                continue;
            };
            for m in msgs {
                self.stats.cache_heartbeats += 1;
                self.send(
                    Addr::P {
                        engine: p,
                        worker: 0,
                    },
                    Addr::D { engine: d, rank: 0 },
                    m,
                );
            }
            self.p[p].turn_heartbeats.handle_sent(local, &turn);
        }
    }

    /// Whether P `p` reaches D `d` in incarnation `incarnation` now.
    fn d_reachable(&self, p: usize, d: usize, incarnation: u32) -> bool {
        self.d[d].alive
            && self.d[d].incarnation == incarnation
            && !self.partitioned(
                Addr::P {
                    engine: p,
                    worker: 0,
                },
                Addr::D { engine: d, rank: 0 },
            )
    }

    /// A prefill starts on P: a next turn with D's params probes D's clock, plans with
    /// [`plan_pull`] and may start reading D's held blocks. Returns how long the prefill
    /// waits for the read (0: it computes everything).
    pub(super) fn start_pull(&mut self, p: usize, request: &RequestId, local: Timestamp) -> u64 {
        let Some(b) = self.bidir() else { return 0 };
        let Some(turn) = self.p[p].turns.remove(request) else {
            return 0;
        };
        let heartbeats = self.p[p]
            .turn_heartbeats
            .take(&turn.params.remote_request_id);
        let d = turn.d;
        // The clock probe, just before: one sample over the network from whichever D runs
        // (none when D does not answer).
        let mut est = ClockOffsetEstimator::new();
        if self.d_reachable(p, d, self.d[d].incarnation) {
            let net = self.config.net;
            let there = nanos(net.delay) + self.rng.range(0, nanos(net.jitter));
            let back = nanos(net.delay) + self.rng.range(0, nanos(net.jitter));
            let t0 = self.p[p].clock.local(self.now.saturating_sub(there + back));
            let remote = self.d[d].clock.local(self.now.saturating_sub(back));
            let _ = est.add_sample(
                t0,
                PeerTimestamp::from_nanos(remote.as_nanos_saturating()),
                local,
            );
        }
        let mut params = turn.params;
        // P's heartbeats renewed the cached turn, if the first of their run went out before
        // its deadline (and D got them).
        if let (Some(run), Some(offset)) = (heartbeats, est.offset())
            && let Some(renewed) = params.renewed_by_heartbeats(run, &offset)
        {
            params = renewed;
        }
        let Some((seed, len)) = self
            .requests
            .get(request)
            .and_then(|r| Some((self.convs.get(r.conv?)?.token_seed, r.tokens)))
        else {
            return 0;
        };
        let policy = PullPolicy {
            threshold_tokens: b.threshold_tokens,
            safety_margin: b.safety_margin,
            basis: DeadlineBasis::ClockOffset,
        };
        let decision = plan_pull(
            &policy,
            &params,
            &tokens(seed, len),
            BLOCK_SIZE,
            local,
            est.offset(),
            b.pull_read,
        );
        self.note(|| format!("P{p} plan_pull {request}: {decision:?}"));
        let blocks = match decision {
            PullDecision::Pull { blocks, .. } => blocks,
            PullDecision::Recompute(_) => {
                self.stats.turns_recomputed += 1;
                self.trace(&[23, self.now, p as u64]);
                return 0;
            }
        };
        let Ok(hold) = RequestId::new(&params.remote_request_id) else {
            return 0;
        };
        // P's handshake with D for pulls (the agent's `d_caches`): the one it made before,
        // or one with the D running now. An earlier incarnation's connection fails the read.
        let conn = match self.p[p].d_conns.get(&d) {
            Some(&i) => Some(i),
            None if self.d[d].alive => {
                let i = self.d[d].incarnation;
                self.p[p].d_conns.insert(d, i);
                Some(i)
            }
            None => None,
        };
        let reachable = conn.is_some_and(|i| self.d_reachable(p, d, i));
        // The one-sided read copies D's blocks as it starts.
        let mem = &self.d[d].mem;
        let copied = blocks
            .iter()
            .map(|blk| {
                mem.content
                    .get(blk.0 as usize)
                    .copied()
                    .filter(|_| reachable)
                    .unwrap_or(POISON)
            })
            .collect();
        self.p[p].pulls.insert(
            request.clone(),
            Pull {
                d,
                held_in: turn.d_incarnation,
                conn,
                hold,
                generation: params.kvlease_generation,
                blocks,
                copied,
            },
        );
        self.trace(&[24, self.now, p as u64, d as u64]);
        let ev = Ev::PullDone {
            p,
            incarnation: self.p[p].incarnation,
            request: request.clone(),
        };
        self.schedule(self.now + nanos(b.pull_read), ev);
        nanos(b.pull_read)
    }

    /// P's read of D's held blocks ends: the fence word of the first block decides (a
    /// changed one: stale, P recomputes; D gone, restarted since the handshake or cut off:
    /// failed); the oracle checks a completed read; P tells D it has read. A read that
    /// did not complete drops P's handshake with D (the next pull makes a new one, with
    /// the D running then).
    pub(super) fn pull_done(&mut self, p: usize, incarnation: u32, request: &RequestId) {
        if !self.p[p].alive || self.p[p].incarnation != incarnation {
            return;
        }
        let Some(pull) = self.p[p].pulls.remove(request) else {
            return;
        };
        let d = pull.d;
        let reachable = pull.conn.is_some_and(|i| self.d_reachable(p, d, i));
        let word = pull
            .blocks
            .first()
            .and_then(|b| self.d[d].mem.words.get(b.0 as usize))
            .copied();
        let matched = reachable && word == Some(pull.generation);
        let done = matched || (reachable && self.config.bug == Some(Bug::PullIgnoresFence));
        let hold_end = self.holds.get(&pull.hold).and_then(|r| r.end);
        if done {
            self.check_pull(p, request, &pull, matched);
            self.stats.pulls += 1;
        } else {
            if reachable {
                self.stats.pulls_stale += 1;
                if hold_end == Some(HoldEnd::Expired) {
                    self.stats.pulls_stale_expired += 1;
                }
                if pull.conn != Some(pull.held_in) {
                    self.stats.pulls_stale_restarted += 1;
                }
            } else {
                self.stats.pulls_failed += 1;
            }
            self.stats.turns_recomputed += 1;
            if self.p[p].d_conns.get(&d) == pull.conn.as_ref() {
                self.p[p].d_conns.remove(&d);
            }
        }
        self.note(|| {
            format!(
                "P{p} pull of {} done={done} (hold ended: {hold_end:?})",
                pull.hold
            )
        });
        self.trace(&[25, self.now, p as u64, u64::from(done)]);
        // Read (or failed for good): D may free the cached turn now.
        let msg = ReadComplete {
            request: pull.hold,
            consumer: ConsumerId::new(self.p[p].id.clone(), 0),
            consumers_total: 1,
        }
        .encode();
        self.send(
            Addr::P {
                engine: p,
                worker: 0,
            },
            Addr::D { engine: d, rank: 0 },
            msg,
        );
    }

    /// The pull oracle: a completed read of D's held blocks read under the hold's matching
    /// fence, and every block holds the KV of the conversation's previous turn.
    fn check_pull(&mut self, p: usize, request: &RequestId, pull: &Pull, matched: bool) {
        let mut problems = Vec::new();
        if !matched {
            problems.push(format!(
                "P{p}: turn {request} pulled from a read whose fence did not match ({})",
                pull.hold
            ));
        }
        let seed = match self.holds.get(&pull.hold) {
            Some(rec) if rec.generation == pull.generation && rec.d == pull.d => {
                self.requests.get(&rec.request).map(|r| r.content_seed)
            }
            _ => None,
        };
        match seed {
            None => problems.push(format!(
                "P{p}: turn {request} pulled {}, which D never held under generation {}",
                pull.hold, pull.generation
            )),
            Some(seed) => {
                let wrong = pull
                    .copied
                    .iter()
                    .enumerate()
                    .any(|(j, &c)| c != block_content(seed, 0, j));
                if wrong {
                    let poisoned = pull.copied.contains(&POISON);
                    problems.push(format!(
                        "P{p}: wrong turn KV: {request} pulled {} content for {}",
                        if poisoned { "poisoned" } else { "foreign" },
                        pull.hold
                    ));
                }
            }
        }
        for problem in problems {
            self.fail(problem);
        }
    }

    /// The end of the run: every cached turn ended exactly once, and no live D holds a
    /// block or a fence word.
    pub(super) fn check_holds_end(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for (id, rec) in &self.holds {
            match rec.ends {
                1 => {}
                0 => problems.push(format!("hold: cached turn {id} never ended")),
                n => problems.push(format!("hold: cached turn {id} ended {n} times")),
            }
        }
        for d in self.d.iter().filter(|d| d.alive) {
            let held = d.core.turn_blocks_held();
            if held != 0 {
                problems.push(format!(
                    "leak: {} still holds {held} blocks of cached turns at the end",
                    d.id
                ));
            }
            let fenced = d
                .mem
                .words
                .iter()
                .filter(|&&w| w != Generation::FREE_WORD)
                .count();
            if fenced > 0 {
                problems.push(format!(
                    "leak: {} has {fenced} blocks with a live fence word at the end",
                    d.id
                ));
            }
        }
        problems
    }
}
