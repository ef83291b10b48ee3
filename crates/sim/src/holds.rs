//! Bidirectional mode's symmetric lease under faults: the engine that decoded a turn holds
//! its blocks ([`PrefillCore::hold_in`]), the next turn's reader tracks, heartbeats and
//! reads them with a [`DecodeCore`], as the vLLM connector runs both.
//!
//! One holder H (its serving engine allocates blocks, [`BlockSource::External`]) and one
//! reader R, several conversations at once. A conversation's turn ends on H: H holds its
//! blocks, publishes the hold's generation in the blocks' fence words and hands the params
//! to R. After a think time drawn around the hold's TTL the next turn arrives at R, which
//! tracks it (heartbeats renew the hold from then on), handshakes, reads it with a fenced
//! one-sided read (the bytes copied first, the fence word of the first block checked at the
//! end) and reports the read complete; then H decodes the next turn. Blocks H lets go are
//! cleared (the free word), then reused at once by other work (new content), so a read
//! that a fence did not stop sees foreign bytes.
//!
//! Faults, all drawn from the seed: messages lost, duplicated and delayed (reordered); R
//! stalls (no steps: no heartbeats, no reads) for up to twice the TTL; R crashes (its
//! tracked turns are lost) and restarts; think times past the TTL.
//!
//! Oracles: no verified read with content other than the turn's (no wrong turn-2 KV);
//! every hold ends exactly once on H, and every turn exactly once on R; at the end H holds
//! nothing, every block is free with the free word, R tracks nothing.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;

use kvlease_engine::{
    BatchResult, BlockSource, DecodeConfig, DecodeCore, DecodeEvent, Outcome, Peer, PrefillAction,
    PrefillConfig, PrefillCore, PrefillEvent, RemoteEngine, RemoteKv,
};
use kvlease_lease::{
    BlockId, EngineId, Generation, LeaseConfig, ReleaseReason, RequestId, Timestamp,
};

use kvlease_notif::Notif;

use crate::rng::Rng;

const BLOCK_SIZE: u32 = 16;
const NUM_KV_HEADS: u32 = 2;
/// Content of a block nobody holds: other work wrote it.
const FOREIGN: u64 = u64::MAX;

/// A deliberate bug, to prove that the oracles catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldsBug {
    /// The reader uses a read whose fence did not match.
    ReaderIgnoresFence,
    /// The holder lets the blocks go without publishing the free word.
    HolderSkipsClear,
}

/// One run's parameters.
#[derive(Debug, Clone)]
pub struct HoldsConfig {
    /// The seed every draw comes from.
    pub seed: u64,
    /// Conversations at once.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Blocks in H's pool.
    pub blocks: u32,
    /// The holds' TTL (their terms: heartbeats extend them as a lease's).
    pub ttl: Duration,
    /// Think time between turns: drawn from `0..think_max`.
    pub think_max: Duration,
    /// A read's time on the wire.
    pub read: (Duration, Duration),
    /// A message's one-way delay.
    pub delay: (Duration, Duration),
    /// Messages lost, per million.
    pub loss_per_million: u32,
    /// Messages delivered twice, per million.
    pub dup_per_million: u32,
    /// R stalls, per million steps.
    pub stall_per_million: u32,
    /// R crashes, per million steps.
    pub crash_per_million: u32,
    /// The planted bug, if any.
    pub bug: Option<HoldsBug>,
}

impl HoldsConfig {
    /// The default scenario for `seed`: 6 conversations of 6 turns, 2 s holds, every fault.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            conversations: 6,
            turns: 6,
            blocks: 24,
            ttl: Duration::from_secs(2),
            think_max: Duration::from_secs(3),
            read: (Duration::from_millis(5), Duration::from_millis(400)),
            delay: (Duration::from_millis(1), Duration::from_millis(60)),
            loss_per_million: 50_000,
            dup_per_million: 20_000,
            stall_per_million: 4_000,
            crash_per_million: 1_000,
            bug: None,
        }
    }
}

/// What a run saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldsReport {
    /// Turns held by H.
    pub held: u64,
    /// Turns H could not hold (no blocks): the reader computes them.
    pub not_held: u64,
    /// Turns read back and verified.
    pub read_ok: u64,
    /// Turns whose read was refused (fence, expiry): recomputed.
    pub recomputed: u64,
    /// Turns lost with a crashed reader.
    pub lost: u64,
    /// Holds released by a read completion / by expiry / by an abort.
    pub released: [u64; 3],
    /// R's stalls and crashes.
    pub stalls: u64,
    /// R's crashes.
    pub crashes: u64,
    /// Oracle violations (empty when the run was safe).
    pub violations: Vec<String>,
    /// A digest of every event in order: equal for two runs of one config.
    pub digest: u64,
}

#[derive(Debug)]
enum Ev {
    HolderFinish {
        conv: usize,
    },
    NextTurn {
        conv: usize,
        incarnation: u32,
        remote: RemoteKv,
    },
    HStep,
    RStep {
        incarnation: u32,
    },
    ToH {
        incarnation: u32,
        bytes: Vec<u8>,
    },
    ToR {
        incarnation: u32,
        bytes: Vec<u8>,
    },
    HandshakeDone {
        incarnation: u32,
    },
    ReadDone {
        incarnation: u32,
        request: RequestId,
    },
    RRestart,
}

/// One turn as the oracles see it.
#[derive(Debug, Default)]
struct Turn {
    conv: usize,
    content: Vec<u64>,
    /// When H held it, and last saw a heartbeat naming it.
    held_at: u64,
    last_heartbeat: Option<u64>,
    hold_ends: u32,
    reader_ends: u32,
}

struct Read {
    copied: Vec<u64>,
    fence: u64,
    first: Option<BlockId>,
    notif: Vec<u8>,
    result: Option<BatchResult>,
}

struct Sim {
    cfg: HoldsConfig,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    events: BTreeMap<usize, Ev>,
    next_ev: usize,
    terms: LeaseConfig,
    holder: PrefillCore<u32>,
    holder_id: EngineId,
    words: Vec<u64>,
    content: Vec<u64>,
    free: std::collections::VecDeque<BlockId>,
    reader: DecodeCore,
    reader_id: EngineId,
    incarnation: u32,
    alive: bool,
    stalled_until: u64,
    reads: BTreeMap<RequestId, Read>,
    /// Conversation -> turns done.
    convs: Vec<usize>,
    turns: BTreeMap<RequestId, Turn>,
    report: HoldsReport,
    digest: u64,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn ts(n: u64) -> Timestamp {
    Timestamp::from_nanos(n)
}

fn turn_id(conv: usize, turn: usize) -> RequestId {
    RequestId::new(&format!("c{conv}t{turn}")).expect("a short ascii id")
}

fn reader_core(cfg: &HoldsConfig, terms: LeaseConfig, id: EngineId) -> DecodeCore {
    DecodeCore::new(DecodeConfig::new(
        id,
        1,
        NUM_KV_HEADS,
        BLOCK_SIZE,
        cfg.blocks * 2,
        terms,
    ))
}

impl Sim {
    fn new(cfg: HoldsConfig) -> Self {
        let terms = LeaseConfig::from_duration(cfg.ttl).expect("a valid TTL");
        let holder_id = EngineId::new("d0").expect("id");
        let reader_id = EngineId::new("p0").expect("id");
        // Leases (unused here) and holds on the same terms; the serving engine allocates.
        let holder = PrefillCore::new(
            PrefillConfig::new(holder_id.clone(), 1, cfg.blocks, BLOCK_SIZE, terms)
                .with_block_source(BlockSource::External)
                .with_holds(terms),
        );
        let reader = reader_core(&cfg, terms, reader_id.clone());
        let n = cfg.blocks as usize;
        Self {
            rng: Rng::new(cfg.seed),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            next_ev: 0,
            terms,
            holder,
            holder_id,
            words: vec![Generation::FREE_WORD; n],
            content: vec![FOREIGN; n],
            free: (0..cfg.blocks).map(BlockId).collect(),
            reader,
            reader_id,
            incarnation: 0,
            alive: true,
            stalled_until: 0,
            reads: BTreeMap::new(),
            convs: vec![0; cfg.conversations],
            turns: BTreeMap::new(),
            report: HoldsReport::default(),
            digest: 0xcbf2_9ce4_8422_2325,
            cfg,
        }
    }

    fn trace(&mut self, words: &[u64]) {
        for w in words {
            for b in w.to_le_bytes() {
                self.digest = (self.digest ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }

    fn at(&mut self, when: u64, ev: Ev) {
        let i = self.next_ev;
        self.next_ev += 1;
        self.events.insert(i, ev);
        self.seq += 1;
        self.queue.push(Reverse((when, self.seq, i)));
    }

    fn draw(&mut self, (lo, hi): (Duration, Duration)) -> u64 {
        self.rng.range(ns(lo), ns(hi).max(ns(lo) + 1))
    }

    fn violation(&mut self, what: String) {
        self.report
            .violations
            .push(format!("t={}ms: {what}", self.now / 1_000_000));
    }

    /// A message over the network: lost, delayed (so reordered), sometimes twice.
    fn send(&mut self, to_holder: bool, bytes: Vec<u8>) {
        if self.rng.chance(self.cfg.loss_per_million) {
            self.trace(&[1, self.now]);
            return;
        }
        let copies = if self.rng.chance(self.cfg.dup_per_million) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let when = self.now + self.draw(self.cfg.delay);
            let incarnation = self.incarnation;
            let bytes = bytes.clone();
            let ev = if to_holder {
                Ev::ToH { incarnation, bytes }
            } else {
                Ev::ToR { incarnation, bytes }
            };
            self.at(when, ev);
        }
    }

    fn run(mut self) -> HoldsReport {
        let step = ns(Duration::from_millis(50));
        for conv in 0..self.cfg.conversations {
            let when = self.draw((Duration::ZERO, self.cfg.ttl));
            self.at(when, Ev::HolderFinish { conv });
        }
        self.at(0, Ev::HStep);
        self.at(0, Ev::RStep { incarnation: 0 });
        // The last turn ends well before this; the rest lets every hold reach its end.
        let horizon = ns(self.cfg.ttl + self.cfg.think_max) * (self.cfg.turns as u64 + 2) * 4;
        while let Some(Reverse((when, _, i))) = self.queue.pop() {
            if when > horizon {
                break;
            }
            self.now = when;
            let Some(ev) = self.events.remove(&i) else {
                continue;
            };
            match ev {
                Ev::HolderFinish { conv } => self.holder_finish(conv),
                Ev::NextTurn {
                    conv,
                    incarnation,
                    remote,
                } => self.next_turn(conv, incarnation, remote),
                Ev::HStep => {
                    self.holder.handle_timeout(ts(self.now));
                    self.h_drain();
                    self.at(self.now + step, Ev::HStep);
                }
                Ev::RStep { incarnation } => {
                    if incarnation == self.incarnation && self.alive {
                        self.r_step();
                        self.at(self.now + step, Ev::RStep { incarnation });
                    }
                }
                Ev::ToH { incarnation, bytes } => {
                    let from = Peer {
                        engine: self.reader_id.clone(),
                        addr: incarnation,
                    };
                    if let Ok(Notif::Heartbeat(ids)) = kvlease_notif::decode(&bytes) {
                        for id in ids.iter() {
                            if let Some(t) = self.turns.get_mut(id) {
                                t.last_heartbeat = Some(self.now);
                            }
                        }
                    }
                    self.holder.handle_notif(ts(self.now), &from, &bytes);
                    self.h_drain();
                }
                Ev::ToR { incarnation, bytes } => {
                    if self.alive && incarnation == self.incarnation {
                        let h = self.holder_id.clone();
                        self.reader.handle_notif(&h, &bytes);
                        self.r_drain();
                    }
                }
                Ev::HandshakeDone { incarnation } => {
                    if self.alive && incarnation == self.incarnation {
                        let h = self.holder_id.clone();
                        let engine = RemoteEngine::new(1, self.cfg.blocks);
                        self.reader.handle_handshake(ts(self.now), &h, Ok(engine));
                        self.r_drain();
                    }
                }
                Ev::ReadDone {
                    incarnation,
                    request,
                } => self.read_done(incarnation, &request),
                Ev::RRestart => {
                    self.alive = true;
                    self.incarnation += 1;
                    let terms = LeaseConfig::from_duration(self.cfg.ttl).expect("TTL");
                    self.reader = reader_core(&self.cfg, terms, self.reader_id.clone());
                    let incarnation = self.incarnation;
                    self.at(self.now, Ev::RStep { incarnation });
                }
            }
        }
        self.check_end();
        self.report.digest = self.digest;
        self.report
    }

    /// H decodes conversation `conv`'s next turn, then holds its blocks for the turn after.
    fn holder_finish(&mut self, conv: usize) {
        let turn = self.convs[conv];
        if turn >= self.cfg.turns {
            return;
        }
        self.convs[conv] += 1;
        let id = turn_id(conv, turn);
        let want = 1 + self.rng.index(4);
        self.trace(&[2, self.now, conv as u64, want as u64]);
        let think = self.draw((Duration::ZERO, self.cfg.think_max));
        if self.free.len() < want {
            // The serving engine has no blocks to keep: the next turn is computed.
            self.report.not_held += 1;
            self.at(self.now + think, Ev::HolderFinish { conv });
            return;
        }
        let blocks: Vec<BlockId> = (0..want).filter_map(|_| self.free.pop_front()).collect();
        let tags: Vec<u64> = (0..want)
            .map(|j| ((conv as u64) << 40) | ((turn as u64) << 20) | j as u64)
            .collect();
        for (b, tag) in blocks.iter().zip(&tags) {
            self.content[b.0 as usize] = *tag;
        }
        match self
            .holder
            .hold_in(ts(self.now), id.clone(), blocks.clone())
        {
            Ok(granted) => {
                // Publish the generation before the params leave.
                for b in &blocks {
                    self.words[b.0 as usize] = granted.generation.word();
                }
                self.report.held += 1;
                self.turns.insert(
                    id.clone(),
                    Turn {
                        conv,
                        content: tags,
                        held_at: self.now,
                        ..Turn::default()
                    },
                );
                let tokens = u32::try_from(want).unwrap_or(1) * BLOCK_SIZE;
                let remote = RemoteKv::new(
                    self.holder_id.clone(),
                    id,
                    blocks,
                    granted.generation.word(),
                    1,
                    tokens,
                    "d0".into(),
                    0,
                );
                let incarnation = self.incarnation;
                self.at(
                    self.now + think,
                    Ev::NextTurn {
                        conv,
                        incarnation,
                        remote,
                    },
                );
            }
            Err(e) => {
                self.violation(format!("H refused to hold {id}: {e}"));
                self.free.extend(blocks);
            }
        }
        self.h_drain();
    }

    /// The next turn of `conv` arrives at R with the held turn's params.
    fn next_turn(&mut self, conv: usize, incarnation: u32, remote: RemoteKv) {
        let id = remote.request.clone();
        if !self.alive || incarnation != self.incarnation {
            // The params died with the reader: the hold ends on its own.
            self.reader_end(&id, "lost");
            self.at(self.now, Ev::HolderFinish { conv });
            return;
        }
        let tokens = remote.num_tokens as usize;
        self.trace(&[3, self.now, conv as u64]);
        if let Err(e) = self
            .reader
            .on_new_request(ts(self.now), id.clone(), tokens, remote)
        {
            self.violation(format!("R refused {id}: {e}"));
            self.reader_end(&id, "refused");
            self.at(self.now, Ev::HolderFinish { conv });
        }
        self.r_drain();
    }

    fn r_step(&mut self) {
        if self.now < self.stalled_until {
            return;
        }
        if self.rng.chance(self.cfg.crash_per_million) {
            self.crash();
            return;
        }
        if self.rng.chance(self.cfg.stall_per_million) {
            self.report.stalls += 1;
            self.stalled_until = self.now + self.rng.range(0, 2 * ns(self.cfg.ttl));
            self.trace(&[4, self.now, self.stalled_until]);
            return;
        }
        let now = ts(self.now);
        while let Some(_start) = self.reader.poll_handshake() {
            let when = self.now + self.draw(self.cfg.delay) * 2;
            let incarnation = self.incarnation;
            self.at(when, Ev::HandshakeDone { incarnation });
        }
        while let Some(t) = self.reader.poll_transmit(now) {
            for _ in 0..t.workers {
                self.send(true, t.bytes.clone());
            }
        }
        while let Some(plan) = self.reader.poll_load() {
            // The one-sided read copies the bytes first; the fence is checked at its end.
            let copied = plan
                .remote
                .blocks
                .iter()
                .map(|b| self.content.get(b.0 as usize).copied().unwrap_or(FOREIGN))
                .collect();
            let notif = plan
                .batches
                .first()
                .map(|b| b.notif.clone())
                .unwrap_or_default();
            let read = Read {
                copied,
                fence: plan.fence_generation,
                first: plan.remote.blocks.first().copied(),
                notif,
                result: None,
            };
            let request = plan.request.clone();
            self.reads.insert(request.clone(), read);
            let when = self.now + self.draw(self.cfg.read);
            let incarnation = self.incarnation;
            self.at(
                when,
                Ev::ReadDone {
                    incarnation,
                    request,
                },
            );
        }
        self.r_drain();
    }

    fn read_done(&mut self, incarnation: u32, request: &RequestId) {
        if !self.alive || incarnation != self.incarnation {
            return;
        }
        let Some(read) = self.reads.get_mut(request) else {
            return;
        };
        let word = read
            .first
            .and_then(|b| self.words.get(b.0 as usize).copied());
        let matched = word == Some(read.fence);
        let result = if matched || self.cfg.bug == Some(HoldsBug::ReaderIgnoresFence) {
            BatchResult::Done {
                bytes: read.copied.len() as u64,
            }
        } else {
            BatchResult::Stale
        };
        let notif = read.notif.clone();
        read.result = Some(result.clone());
        self.trace(&[5, self.now, u64::from(matched)]);
        if matches!(result, BatchResult::Done { .. }) {
            self.send(true, notif);
        }
        self.reader.handle_batch_done(request, 0, result);
        self.r_drain();
    }

    fn r_drain(&mut self) {
        while let Some(event) = self.reader.poll_event() {
            match event {
                DecodeEvent::Loaded { request, .. } => self.verify(&request),
                DecodeEvent::Finished { request, outcome } => {
                    self.reads.remove(&request);
                    let what = match outcome {
                        Outcome::Done => "read",
                        Outcome::Failed(_) => "recomputed",
                        Outcome::Aborted | Outcome::Shutdown => "aborted",
                    };
                    self.reader_end(&request, what);
                    if let Some(conv) = self.turns.get(&request).map(|t| t.conv) {
                        let when = self.now + self.draw(self.cfg.read);
                        self.at(when, Ev::HolderFinish { conv });
                    }
                }
                DecodeEvent::HandshakeDone { .. } | DecodeEvent::EngineDropped { .. } => {}
            }
        }
    }

    /// The read of `request` verified: its bytes must be the turn's.
    fn verify(&mut self, request: &RequestId) {
        let Some(read) = self.reads.get(request) else {
            self.violation(format!("{request} loaded with no read"));
            return;
        };
        let expected = self.turns.get(request).map(|t| t.content.clone());
        let ok = expected.as_ref() == Some(&read.copied);
        if !ok {
            let what = if read.copied.contains(&FOREIGN) {
                "foreign"
            } else {
                "another turn's"
            };
            self.violation(format!(
                "wrong turn KV: {request} read {what} content and used it ({:?})",
                read.result
            ));
        }
        let verdict = if ok {
            Ok(())
        } else {
            Err(crate::cause("the read did not verify"))
        };
        self.reader.handle_verified(request, verdict);
        if ok {
            // R computes the rest of the prompt on top of the read turn, then hands it on.
            self.reader.request_finished(request);
        }
    }

    fn reader_end(&mut self, request: &RequestId, what: &str) {
        match what {
            "read" => self.report.read_ok += 1,
            "recomputed" => self.report.recomputed += 1,
            _ => self.report.lost += 1,
        }
        self.trace(&[6, self.now, what.len() as u64]);
        if let Some(t) = self.turns.get_mut(request) {
            t.reader_ends += 1;
            if t.reader_ends > 1 {
                let n = t.reader_ends;
                self.violation(format!("{request} ended {n} times on the reader"));
            }
        }
    }

    fn crash(&mut self) {
        self.report.crashes += 1;
        self.alive = false;
        self.trace(&[7, self.now]);
        // Every turn R tracked or was reading is lost with it; their conversations go on
        // with a turn R computes.
        let lost: Vec<RequestId> = self
            .turns
            .iter()
            .filter(|(_, t)| t.reader_ends == 0 && t.hold_ends <= 1)
            .map(|(id, _)| id.clone())
            .filter(|id| self.reader.remote_of(id).is_some())
            .collect();
        self.reads.clear();
        for id in lost {
            self.reader_end(&id, "lost");
            if let Some(conv) = self.turns.get(&id).map(|t| t.conv) {
                let when = self.now + self.draw(self.cfg.read);
                self.at(when, Ev::HolderFinish { conv });
            }
        }
        let when = self.now
            + self
                .rng
                .range(ns(Duration::from_millis(200)), ns(self.cfg.ttl));
        self.at(when, Ev::RRestart);
    }

    fn h_drain(&mut self) {
        while let Some(action) = self.holder.poll_action() {
            match action {
                PrefillAction::ClearFences { released } => {
                    for b in &released.blocks {
                        let i = b.0 as usize;
                        if self.cfg.bug != Some(HoldsBug::HolderSkipsClear) {
                            self.words[i] = Generation::FREE_WORD;
                        }
                        // Other work takes the block at once.
                        self.content[i] = FOREIGN;
                        self.free.push_back(*b);
                    }
                }
                PrefillAction::Transmit { to, bytes } => {
                    if to == self.incarnation {
                        self.send(false, bytes);
                    }
                }
            }
        }
        while let Some(event) = self.holder.poll_event() {
            match event {
                PrefillEvent::HoldReleased(r) => {
                    let slot = match r.reason {
                        ReleaseReason::Completed => 0,
                        ReleaseReason::Expired => 1,
                        ReleaseReason::Aborted => 2,
                    };
                    self.report.released[slot] += 1;
                    self.trace(&[8, self.now, slot as u64]);
                    let Some(t) = self.turns.get_mut(&r.request) else {
                        self.violation(format!(
                            "H released a hold it never granted: {}",
                            r.request
                        ));
                        continue;
                    };
                    t.hold_ends += 1;
                    // Reclaimed on time: by the TTL, or one extension after the last
                    // heartbeat H saw, give or take one of H's steps.
                    let due = (t.held_at + ns(self.cfg.ttl)).max(
                        t.last_heartbeat
                            .map_or(0, |h| h + ns(self.terms.extension())),
                    );
                    let late = r.reason == ReleaseReason::Expired
                        && self.now > due + ns(Duration::from_millis(50));
                    if t.hold_ends > 1 {
                        let n = t.hold_ends;
                        self.violation(format!("the hold of {} ended {n} times", r.request));
                    }
                    if late {
                        let by = (self.now - due) / 1_000_000;
                        self.violation(format!("the hold of {} expired {by} ms late", r.request));
                    }
                }
                PrefillEvent::Released(r) => {
                    self.violation(format!(
                        "H released a lease it never granted: {}",
                        r.request
                    ));
                }
                PrefillEvent::Refused { .. } => {}
            }
        }
    }

    fn check_end(&mut self) {
        let ends: Vec<(RequestId, u32, u32)> = self
            .turns
            .iter()
            .map(|(id, t)| (id.clone(), t.hold_ends, t.reader_ends))
            .collect();
        for (id, hold, reader) in ends {
            if hold != 1 {
                self.violation(format!("the hold of {id} ended {hold} times"));
            }
            if reader != 1 {
                self.violation(format!("{id} ended {reader} times on the reader"));
            }
        }
        if !self.holder.is_idle() || self.holder.blocks_allocated() != 0 {
            let n = self.holder.blocks_allocated();
            self.violation(format!(
                "leak: H is not idle at the end ({n} blocks allocated)"
            ));
        }
        let live = self
            .words
            .iter()
            .filter(|&&w| w != Generation::FREE_WORD)
            .count();
        if live > 0 && self.cfg.bug.is_none() {
            self.violation(format!("leak: {live} blocks keep a live fence word"));
        }
        if self.free.len() != self.cfg.blocks as usize {
            let n = self.free.len();
            self.violation(format!("leak: {n} of {} blocks free", self.cfg.blocks));
        }
        if self.alive && self.reader.tracked() != 0 {
            let n = self.reader.tracked();
            self.violation(format!("leak: R still tracks {n} turns"));
        }
    }
}

/// Runs the holds scenario of `config` to the end.
#[must_use]
pub fn run_holds(config: &HoldsConfig) -> HoldsReport {
    Sim::new(config.clone()).run()
}
