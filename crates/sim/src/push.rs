//! Push mode under faults: D reserves blocks and registers them, P writes into them.
//!
//! The decisions are the engine's, as a shell runs them: every D engine holds a
//! [`Reservations`] table, every P engine a [`PushCore`], and every message between them
//! goes through the real `kvlease-notif` codec. The shell here owns the (virtual) memory,
//! network and time, and decides nothing about reservations or writes.
//!
//! # World
//! - A request names one P and one D engine; the router sends both legs at once (each
//!   arrives after its own small delay). D's leg: D allocates the blocks its prefix cache
//!   lacks (the prompt's last `n - hit` blocks; a full pool refuses the request),
//!   reserves them and sends the registration. P's leg: P allocates the prompt's `n`
//!   blocks, admits the push, and its prefill ends a random time later, writing the
//!   request's content into its blocks.
//! - A write is posted when P's core plans it: it copies P's source blocks then and lands
//!   at D a random time later, where D's shell asks the fence
//!   ([`Reservations::admits_write`]) before any byte lands; P learns the result then (a
//!   refused write is a failed one). A post may also fail at once.
//! - Every engine runs a forward loop every `step`: it handles what arrived since (inputs
//!   wait in its inbox), runs its reaper, drains its core's outputs, sends heartbeats.
//!
//! # Faults
//! Lost, duplicated, delayed and reordered messages (every frame, both ways); failed
//! write posts; D aborting requests; a P that dies (its core, memory, inbox and writes'
//! results vanish; legs that arrive later are lost); a P that stalls longer than the
//! lease (no steps; its inbox queues up).
//!
//! # Oracles
//! - **No write lands in blocks not held for it**: every block a landing write touches is
//!   held, by D's own reserve and ended events, for that transfer and generation.
//! - **No wrong KV**: a reservation that ends written holds, block by block, P's content
//!   for the prompt's last blocks (a prefix-hit trim at the wrong end fails this).
//! - **Every reservation ends exactly once**; **every push** admitted by a P that lives to
//!   the end ends exactly once; at the end nothing is held, pushed or allocated.
//! - **A dead P's reservations are freed within about one lease**: each ends no later
//!   than `max(death + max delay + extension, reserved + duration) + step`.
//!
//! The same config gives the same [`PushReport`], log included.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_engine::{
    FenceVerdict, PushAction, PushConfig, PushCore, ReservationOutcome, Reservations, WritePlan,
};
use kvlease_lease::{
    BlockAllocator, BlockId, EngineId, Generation, LeaseConfig, RequestId, Timestamp,
};
use kvlease_notif::{
    MAX_NOTIF_LEN, Notif, PushNotice, ReservationRef, decode, encode_push_heartbeats,
};

use crate::rng::Rng;

/// Content of freed blocks.
const POISON: u64 = u64::MAX;

/// One push world. The same config gives the same run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushWorldConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// P engines.
    pub p_engines: u32,
    /// D engines.
    pub d_engines: u32,
    /// Requests, arriving uniformly over `arrivals`.
    pub requests: u32,
    /// The window the requests arrive in.
    pub arrivals: Duration,
    /// The reservation lease (D) and heartbeat terms (P).
    pub lease: Duration,
    /// Every engine's forward-loop period.
    pub step: Duration,
    /// Blocks per D pool.
    pub d_blocks: u32,
    /// Smallest one-way message delay.
    pub delay: Duration,
    /// Extra delay per message, uniform in `0..=jitter` (so messages reorder).
    pub jitter: Duration,
    /// Chance that a message is lost, per million.
    pub loss_ppm: u32,
    /// Chance that a message is delivered twice, per million.
    pub dup_ppm: u32,
    /// Chance that a write fails to post, per million.
    pub write_fail_ppm: u32,
    /// Chance that D aborts a request at a random time, per million.
    pub abort_ppm: u32,
    /// P engine 0 dies at this time.
    pub p_death: Option<Duration>,
    /// P engine `p_engines - 1` stalls from `.0` for `.1`.
    pub p_stall: Option<(Duration, Duration)>,
}

impl PushWorldConfig {
    /// A world with every fault drawn from `seed`: 2 P and 2 D engines, 120 requests over
    /// 8 s, a 1.2 s lease, 10 ms steps, 1–6 ms delays, up to 5% loss and duplication, up
    /// to 10% failed posts and D aborts, a P death mid-run in half the worlds and a stall
    /// of 1.5–3 leases in half.
    pub fn random(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x9055_f00d);
        let lease = Duration::from_millis(1200);
        Self {
            seed,
            p_engines: 2,
            d_engines: 2,
            requests: 120,
            arrivals: Duration::from_secs(8),
            lease,
            step: Duration::from_millis(10),
            d_blocks: 48,
            delay: Duration::from_millis(1),
            jitter: Duration::from_millis(5),
            loss_ppm: rng.range(0, 50_000) as u32,
            dup_ppm: rng.range(0, 50_000) as u32,
            write_fail_ppm: rng.range(0, 100_000) as u32,
            abort_ppm: rng.range(0, 100_000) as u32,
            p_death: rng
                .chance(500_000)
                .then(|| Duration::from_millis(rng.range(500, 7_000))),
            p_stall: rng.chance(500_000).then(|| {
                (
                    Duration::from_millis(rng.range(500, 6_000)),
                    Duration::from_millis(rng.range(1_800, 3_600)),
                )
            }),
        }
    }
}

/// The outcome of one push run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushReport {
    /// The seed.
    pub seed: u64,
    /// Requests D refused (its pool was full).
    pub refused_at_d: u64,
    /// Reservations ended written (and verified).
    pub written: u64,
    /// Reservations ended aborted.
    pub aborted: u64,
    /// Reservations ended expired.
    pub expired: u64,
    /// Reservations ended failed.
    pub failed: u64,
    /// Writes that landed.
    pub landed: u64,
    /// Writes the fence refused.
    pub refused_writes: u64,
    /// Writes that failed to post.
    pub failed_posts: u64,
    /// Pushes lost with a dead P.
    pub lost_with_p: u64,
    /// The longest time from a P's death (or the reservation, when it came later) to the
    /// end of one of its reservations at D.
    pub dead_p_reclaim: Duration,
    /// Every broken rule.
    pub failures: Vec<String>,
    /// One line per event, in order (for the determinism check).
    pub log: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    P(u32),
    D(u32),
}

#[derive(Debug)]
enum Ev {
    Step(Node),
    /// A message or a local input reaches `node`'s inbox.
    Arrive(Node, Input),
    /// A posted write reaches D.
    Land {
        p: u32,
        plan: WritePlan,
        contents: Vec<u64>,
    },
    PDies(u32),
    DAbort(u32, RequestId),
}

#[derive(Debug)]
enum Input {
    Message {
        from: Node,
        bytes: Vec<u8>,
    },
    Leg(u32),
    PrefillDone(u32),
    WriteResult {
        transfer: RequestId,
        generation: Generation,
        ok: bool,
    },
}

struct Request {
    transfer: RequestId,
    p: u32,
    d: u32,
    /// Prompt blocks.
    n: u32,
    /// D's prefix-hit blocks.
    hit: u32,
}

struct PEngine {
    core: PushCore,
    pool: BlockAllocator,
    memory: Vec<u64>,
    inbox: Vec<Input>,
    alive: bool,
    /// `(from, until)` in ns: no steps in between.
    stall: Option<(u64, u64)>,
    /// Blocks of each admitted push, by request index.
    blocks: HashMap<u32, Vec<BlockId>>,
}

struct DEngine {
    res: Reservations,
    pool: BlockAllocator,
    memory: Vec<u64>,
    inbox: Vec<Input>,
    /// The oracle: which (transfer, generation) holds each block, from D's own events.
    owner: HashMap<BlockId, (RequestId, Generation)>,
}

struct Sim {
    cfg: PushWorldConfig,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Ev>,
    requests: Vec<Request>,
    index: HashMap<RequestId, u32>,
    ps: Vec<PEngine>,
    ds: Vec<DEngine>,
    /// Per request: reservation ends seen, reserved at (ns), generation.
    reservation_ends: HashMap<u32, u32>,
    reserved: HashMap<u32, (u64, Generation)>,
    admitted: HashMap<u32, u32>,
    push_ends: HashMap<u32, u32>,
    death: Option<u64>,
    report: PushReport,
}

/// Runs the push world of `config` to the end.
pub fn run_push(config: PushWorldConfig) -> PushReport {
    let mut sim = Sim::new(config);
    sim.run();
    sim.finish()
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn content(transfer: u32, block: u32) -> u64 {
    (u64::from(transfer) << 32) | u64::from(block)
}

fn engine(node: Node) -> EngineId {
    let name = match node {
        Node::P(i) => format!("p{i}"),
        Node::D(i) => format!("d{i}"),
    };
    // `p<digits>` and `d<digits>` are valid engine ids.
    EngineId::new(&name).unwrap_or_else(|_| unreachable!())
}

impl Sim {
    fn new(cfg: PushWorldConfig) -> Self {
        let lease = LeaseConfig::from_duration(cfg.lease).unwrap_or_default();
        let mut rng = Rng::new(cfg.seed);
        let ps = (0..cfg.p_engines)
            .map(|_| PEngine {
                core: PushCore::new(PushConfig::new(lease)),
                pool: BlockAllocator::new(4096),
                memory: vec![POISON; 4096],
                inbox: Vec::new(),
                alive: true,
                stall: None,
                blocks: HashMap::new(),
            })
            .collect();
        let ds = (0..cfg.d_engines)
            .map(|_| DEngine {
                res: Reservations::new(lease, Generation(NonZeroU64::MIN)),
                pool: BlockAllocator::new(cfg.d_blocks),
                memory: vec![POISON; cfg.d_blocks as usize],
                inbox: Vec::new(),
                owner: HashMap::new(),
            })
            .collect();
        let requests = (0..cfg.requests)
            .map(|i| {
                let n = rng.range(1, 6) as u32;
                Request {
                    transfer: RequestId::new(&format!("xfer-{i}"))
                        .unwrap_or_else(|_| unreachable!()),
                    p: rng.index(cfg.p_engines as usize) as u32,
                    d: rng.index(cfg.d_engines as usize) as u32,
                    n,
                    hit: rng.range(0, u64::from(n - 1)) as u32,
                }
            })
            .collect::<Vec<_>>();
        let index = requests
            .iter()
            .enumerate()
            .map(|(i, r)| (r.transfer.clone(), i as u32))
            .collect();
        let mut sim = Self {
            report: PushReport {
                seed: cfg.seed,
                ..PushReport::default()
            },
            cfg,
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            requests,
            index,
            ps,
            ds,
            reservation_ends: HashMap::new(),
            reserved: HashMap::new(),
            admitted: HashMap::new(),
            push_ends: HashMap::new(),
            death: None,
        };
        sim.schedule_start();
        sim
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn log(&mut self, line: String) {
        let line = format!("{:>12} {line}", self.now);
        self.report.log.push(line);
    }

    fn fail(&mut self, what: String) {
        let line = format!("at {} ns: {what}", self.now);
        self.report.failures.push(line);
    }

    fn schedule_start(&mut self) {
        let window = ns(self.cfg.arrivals);
        for i in 0..self.cfg.requests {
            let t = self.rng.range(0, window.max(1));
            let (p, d) = (self.requests[i as usize].p, self.requests[i as usize].d);
            let (lp, ld) = (self.rng.range(0, 3_000_000), self.rng.range(0, 3_000_000));
            self.at(t + lp, Ev::Arrive(Node::P(p), Input::Leg(i)));
            self.at(t + ld, Ev::Arrive(Node::D(d), Input::Leg(i)));
            if self.rng.chance(self.cfg.abort_ppm) {
                let when = t + ld + self.rng.range(0, 2 * ns(self.cfg.lease));
                let transfer = self.requests[i as usize].transfer.clone();
                self.at(when, Ev::DAbort(d, transfer));
            }
        }
        for p in 0..self.cfg.p_engines {
            self.at(0, Ev::Step(Node::P(p)));
        }
        for d in 0..self.cfg.d_engines {
            self.at(0, Ev::Step(Node::D(d)));
        }
        if let Some(t) = self.cfg.p_death {
            self.at(ns(t), Ev::PDies(0));
        }
        if let Some((from, len)) = self.cfg.p_stall {
            let p = self.cfg.p_engines.saturating_sub(1) as usize;
            self.ps[p].stall = Some((ns(from), ns(from).saturating_add(ns(len))));
        }
    }

    fn end_time(&self) -> u64 {
        // Arrivals, the longest stall, then ten leases for everything to settle.
        let stall = self.cfg.p_stall.map_or(0, |(a, b)| ns(a) + ns(b));
        ns(self.cfg.arrivals).max(stall) + 10 * ns(self.cfg.lease)
    }

    fn run(&mut self) {
        let end = self.end_time();
        while let Some(Reverse((t, seq))) = self.queue.pop() {
            if t > end {
                break;
            }
            self.now = t;
            let Some(ev) = self.events.remove(&seq) else {
                continue;
            };
            self.handle(ev);
        }
    }
}

impl Sim {
    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Step(Node::P(p)) => self.p_step(p),
            Ev::Step(Node::D(d)) => self.d_step(d),
            Ev::Arrive(Node::P(p), input) => {
                if self.ps[p as usize].alive {
                    self.ps[p as usize].inbox.push(input);
                } else if let Input::Leg(i) = input {
                    self.log(format!("p{p} down: leg of request {i} lost"));
                }
            }
            Ev::Arrive(Node::D(d), input) => self.ds[d as usize].inbox.push(input),
            Ev::Land { p, plan, contents } => self.land(p, plan, contents),
            Ev::PDies(p) => {
                let e = &mut self.ps[p as usize];
                e.alive = false;
                e.inbox.clear();
                let lost = e.core.pushing() as u64;
                self.report.lost_with_p += lost;
                self.death = Some(self.now);
                self.log(format!("p{p} dies with {lost} pushes"));
            }
            Ev::DAbort(d, transfer) => {
                let now = Timestamp::from_nanos(self.now);
                if self.ds[d as usize].res.abort(now, &transfer) {
                    self.log(format!("d{d} aborts {transfer}"));
                    self.drain_d(d);
                }
            }
        }
    }

    /// Sends `bytes` from `from` to `to` over the faulty network.
    fn send(&mut self, from: Node, to: Node, bytes: Vec<u8>) {
        if self.rng.chance(self.cfg.loss_ppm) {
            self.log(format!(
                "{from:?}->{to:?} lost {}",
                String::from_utf8_lossy(&bytes)
            ));
            return;
        }
        let copies = if self.rng.chance(self.cfg.dup_ppm) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let t = self.now + ns(self.cfg.delay) + self.rng.range(0, ns(self.cfg.jitter) + 1);
            self.at(
                t,
                Ev::Arrive(
                    to,
                    Input::Message {
                        from,
                        bytes: bytes.clone(),
                    },
                ),
            );
        }
    }

    fn p_step(&mut self, p: u32) {
        let pi = p as usize;
        if !self.ps[pi].alive {
            return;
        }
        let step = ns(self.cfg.step);
        if let Some((from, until)) = self.ps[pi].stall
            && self.now >= from
            && self.now < until
        {
            self.at(until, Ev::Step(Node::P(p)));
            return;
        }
        self.at(self.now + step, Ev::Step(Node::P(p)));
        let now = Timestamp::from_nanos(self.now);
        let inbox = std::mem::take(&mut self.ps[pi].inbox);
        for input in inbox {
            match input {
                Input::Leg(i) => self.p_leg(p, i),
                Input::PrefillDone(i) => {
                    let transfer = self.requests[i as usize].transfer.clone();
                    let blocks = self.ps[pi].blocks.get(&i).cloned().unwrap_or_default();
                    // The prefill wrote the prompt's KV: block k holds content (i, k).
                    for (k, b) in (0u32..).zip(&blocks) {
                        if let Some(slot) = self.ps[pi].memory.get_mut(b.0 as usize) {
                            *slot = content(i, k);
                        }
                    }
                    if let Err(e) = self.ps[pi].core.handle_prefill_done(now, &transfer, blocks) {
                        self.log(format!("p{p} prefill of {transfer} done, not pushed: {e}"));
                        if let Some(b) = self.ps[pi].blocks.remove(&i) {
                            self.free_p(p, &b);
                        }
                    }
                }
                Input::WriteResult {
                    transfer,
                    generation,
                    ok,
                } => {
                    self.ps[pi]
                        .core
                        .handle_write_result(now, &transfer, generation, ok);
                }
                Input::Message { from, bytes } => self.p_message(p, from, &bytes),
            }
        }
        self.ps[pi].core.handle_timeout(now);
        self.drain_p(p);
        while let Some(batch) = self.ps[pi].core.poll_heartbeat(now) {
            let Some(d) = self.d_of(&batch.engine) else {
                continue;
            };
            let messages =
                encode_push_heartbeats(&batch.requests, MAX_NOTIF_LEN).unwrap_or_default();
            for m in messages {
                self.send(Node::P(p), Node::D(d), m);
            }
        }
    }

    fn d_of(&self, engine: &EngineId) -> Option<u32> {
        engine.as_str().strip_prefix('d')?.parse().ok()
    }

    fn p_leg(&mut self, p: u32, i: u32) {
        let pi = p as usize;
        let now = Timestamp::from_nanos(self.now);
        let r = &self.requests[i as usize];
        let (n, transfer) = (r.n, r.transfer.clone());
        let Ok(blocks) = self.ps[pi].pool.alloc(n as usize) else {
            self.fail(format!("p{p}: pool exhausted"));
            return;
        };
        let request = RequestId::new(&format!("p{p}-req-{i}")).unwrap_or_else(|_| unreachable!());
        if let Err(e) = self.ps[pi].core.admit(now, transfer.clone(), request, None) {
            self.fail(format!("p{p}: admit of {transfer} refused: {e}"));
            self.free_p(p, &blocks);
            return;
        }
        *self.admitted.entry(i).or_default() += 1;
        self.ps[pi].blocks.insert(i, blocks);
        let prefill = self.rng.range(20_000_000, 1_500_000_000);
        self.log(format!("p{p} admits {transfer}, prefill {prefill} ns"));
        self.at(
            self.now + prefill,
            Ev::Arrive(Node::P(p), Input::PrefillDone(i)),
        );
        self.drain_p(p);
    }

    fn p_message(&mut self, p: u32, from: Node, bytes: &[u8]) {
        let pi = p as usize;
        let now = Timestamp::from_nanos(self.now);
        let sender = engine(from);
        match decode(bytes) {
            Ok(Notif::PushRegister(r)) => {
                let out = self.ps[pi].core.handle_registration(now, &sender, r.into());
                self.log(format!("p{p} registration from {sender}: {out:?}"));
            }
            Ok(Notif::ReservationReleased(r)) => {
                let held = self.ps[pi].core.handle_reservation_released(
                    now,
                    &sender,
                    &r.transfer,
                    r.generation,
                );
                self.log(format!("p{p} {sender} released {}: {held}", r.transfer));
            }
            other => self.fail(format!("p{p}: unexpected message {other:?}")),
        }
        self.drain_p(p);
    }

    fn drain_p(&mut self, p: u32) {
        let pi = p as usize;
        while let Some(action) = self.ps[pi].core.poll_action() {
            match action {
                PushAction::Write(plan) => self.post(p, plan),
                PushAction::Send { to, message } => {
                    let Some(d) = self.d_of(&to) else { continue };
                    let bytes = message.encode();
                    self.send(Node::P(p), Node::D(d), bytes);
                }
                PushAction::Ended(e) => {
                    let Some(&i) = self.index.get(&e.transfer) else {
                        continue;
                    };
                    *self.push_ends.entry(i).or_default() += 1;
                    self.log(format!("p{p} push {} ended {:?}", e.transfer, e.outcome));
                    if let Some(b) = self.ps[pi].blocks.remove(&i) {
                        if b != e.blocks && !e.blocks.is_empty() {
                            self.fail(format!("p{p}: push {} ended with other blocks", e.transfer));
                        }
                        self.free_p(p, &b);
                    }
                }
            }
        }
    }

    fn free_p(&mut self, p: u32, blocks: &[BlockId]) {
        let e = &mut self.ps[p as usize];
        for b in blocks {
            e.memory[b.0 as usize] = POISON;
        }
        if e.pool.free(blocks).is_err() {
            self.fail(format!("p{p}: double free"));
        }
    }

    /// Posts a write: it fails at once, or copies P's blocks now and lands later.
    fn post(&mut self, p: u32, plan: WritePlan) {
        let Some(d) = self.d_of(&plan.decode) else {
            return;
        };
        if self.rng.chance(self.cfg.write_fail_ppm) {
            self.report.failed_posts += 1;
            self.log(format!("p{p} write of {} fails to post", plan.transfer));
            let result = Input::WriteResult {
                transfer: plan.transfer,
                generation: plan.generation,
                ok: false,
            };
            self.at(self.now, Ev::Arrive(Node::P(p), result));
            return;
        }
        let memory = &self.ps[p as usize].memory;
        let contents = plan
            .pairs
            .iter()
            .map(|(src, _)| memory.get(src.0 as usize).copied().unwrap_or(POISON))
            .collect();
        let t = self.now + self.rng.range(1_000_000, 300_000_000);
        self.log(format!("p{p} posts write of {} to d{d}", plan.transfer));
        self.at(t, Ev::Land { p, plan, contents });
    }

    /// A write reaches D: the fence decides, then P learns the result.
    fn land(&mut self, p: u32, plan: WritePlan, contents: Vec<u64>) {
        let Some(d) = self.d_of(&plan.decode) else {
            return;
        };
        let di = d as usize;
        //= docs/spec.md#push-mode
        //# A write lands only in blocks D holds for that transfer under that generation
        let verdict =
            self.ds[di]
                .res
                .admits_write(&engine(Node::P(p)), &plan.transfer, plan.generation);
        let ok = verdict == FenceVerdict::Accepted;
        if ok {
            self.report.landed += 1;
            for ((_, dst), value) in plan.pairs.iter().zip(&contents) {
                let held = self.ds[di].owner.get(dst);
                if held != Some(&(plan.transfer.clone(), plan.generation)) {
                    let what = format!(
                        "write of {} gen {:?} landed in d{d} block {} held by {held:?}",
                        plan.transfer, plan.generation, dst.0
                    );
                    self.fail(what);
                }
                if let Some(slot) = self.ds[di].memory.get_mut(dst.0 as usize) {
                    *slot = *value;
                }
            }
        } else {
            self.report.refused_writes += 1;
        }
        self.log(format!(
            "d{d} write of {} from p{p}: {verdict:?}",
            plan.transfer
        ));
        if self.ps[p as usize].alive {
            let result = Input::WriteResult {
                transfer: plan.transfer,
                generation: plan.generation,
                ok,
            };
            self.at(self.now, Ev::Arrive(Node::P(p), result));
        }
    }

    fn d_step(&mut self, d: u32) {
        let di = d as usize;
        self.at(self.now + ns(self.cfg.step), Ev::Step(Node::D(d)));
        let now = Timestamp::from_nanos(self.now);
        let inbox = std::mem::take(&mut self.ds[di].inbox);
        for input in inbox {
            match input {
                Input::Leg(i) => self.d_leg(d, i),
                Input::Message { from, bytes } => {
                    let sender = engine(from);
                    let res = &mut self.ds[di].res;
                    match decode(&bytes) {
                        Ok(Notif::PushHeartbeat(ids)) => {
                            res.handle_heartbeat(now, &sender, ids);
                        }
                        Ok(Notif::WriteDone(r)) => {
                            let v = res.handle_write_done(now, &sender, &r.transfer, r.generation);
                            self.log(format!("d{d} write-done {}: {v:?}", r.transfer));
                        }
                        Ok(Notif::PushFailed(r)) => {
                            let v = res.handle_push_failed(now, &sender, &r.transfer, r.generation);
                            self.log(format!("d{d} push-failed {}: {v:?}", r.transfer));
                        }
                        other => self.fail(format!("d{d}: unexpected message {other:?}")),
                    }
                }
                Input::PrefillDone(_) | Input::WriteResult { .. } => {}
            }
        }
        self.ds[di].res.handle_timeout(now);
        self.drain_d(d);
    }

    fn d_leg(&mut self, d: u32, i: u32) {
        let di = d as usize;
        let now = Timestamp::from_nanos(self.now);
        let r = &self.requests[i as usize];
        let (transfer, p, need) = (r.transfer.clone(), r.p, r.n - r.hit);
        let Ok(blocks) = self.ds[di].pool.alloc(need as usize) else {
            self.report.refused_at_d += 1;
            self.log(format!("d{d} refuses {transfer}: pool full"));
            return;
        };
        let reservation = match self.ds[di].res.reserve(
            now,
            transfer.clone(),
            engine(Node::P(p)),
            blocks.clone(),
            None,
        ) {
            Ok(r) => r,
            Err(e) => {
                self.fail(format!("d{d}: reserve of {transfer} refused: {e}"));
                return;
            }
        };
        for b in &blocks {
            let old = self.ds[di]
                .owner
                .insert(*b, (transfer.clone(), reservation.generation));
            if old.is_some() {
                self.fail(format!("d{d}: block {} reserved twice", b.0));
            }
        }
        self.reserved.insert(i, (self.now, reservation.generation));
        match reservation.registration().encode() {
            Ok(bytes) => self.send(Node::D(d), Node::P(p), bytes),
            Err(e) => self.fail(format!("d{d}: registration of {transfer}: {e}")),
        }
        self.log(format!(
            "d{d} reserves {transfer} gen {:?}",
            reservation.generation
        ));
    }

    fn drain_d(&mut self, d: u32) {
        let di = d as usize;
        while let Some(e) = self.ds[di].res.poll_event() {
            let Some(&i) = self.index.get(&e.transfer) else {
                continue;
            };
            *self.reservation_ends.entry(i).or_default() += 1;
            self.log(format!(
                "d{d} reservation {} ended {:?}",
                e.transfer, e.outcome
            ));
            for b in &e.blocks {
                let held = self.ds[di].owner.remove(b);
                if held != Some((e.transfer.clone(), e.generation)) {
                    self.fail(format!(
                        "d{d}: ended {} freed block {} held by {held:?}",
                        e.transfer, b.0
                    ));
                }
            }
            match e.outcome {
                ReservationOutcome::Written => {
                    self.report.written += 1;
                    let r = &self.requests[i as usize];
                    let want: Vec<u64> = (r.hit..r.n).map(|k| content(i, k)).collect();
                    let got: Vec<u64> = e
                        .blocks
                        .iter()
                        .map(|b| {
                            self.ds[di]
                                .memory
                                .get(b.0 as usize)
                                .copied()
                                .unwrap_or(POISON)
                        })
                        .collect();
                    if got != want {
                        self.fail(format!(
                            "d{d}: wrong KV for {}: {got:x?} != {want:x?}",
                            e.transfer
                        ));
                    }
                }
                ReservationOutcome::Aborted => self.report.aborted += 1,
                ReservationOutcome::Expired => self.report.expired += 1,
                ReservationOutcome::Failed => self.report.failed += 1,
            }
            // A dead P's reservations: freed within about one lease of its death.
            if !self.ps[self.requests[i as usize].p as usize].alive
                && let (Some(death), Some(&(reserved_at, _))) = (self.death, self.reserved.get(&i))
            {
                let lease = LeaseConfig::from_duration(self.cfg.lease).unwrap_or_default();
                let delay = ns(self.cfg.delay) + ns(self.cfg.jitter);
                let bound = (death + delay + ns(lease.extension()))
                    .max(reserved_at + ns(lease.duration()))
                    + ns(self.cfg.step);
                if self.now > bound {
                    self.fail(format!(
                        "d{d}: {} of dead p freed {} ns after the bound",
                        e.transfer,
                        self.now - bound
                    ));
                }
                let after = Duration::from_nanos(self.now.saturating_sub(death.max(reserved_at)));
                self.report.dead_p_reclaim = self.report.dead_p_reclaim.max(after);
            }
            for b in &e.blocks {
                if let Some(slot) = self.ds[di].memory.get_mut(b.0 as usize) {
                    *slot = POISON;
                }
            }
            if self.ds[di].pool.free(&e.blocks).is_err() {
                self.fail(format!("d{d}: double free"));
            }
            if e.tells_prefill() {
                let p = self.requests[i as usize].p;
                let bytes = ReservationRef {
                    transfer: e.transfer,
                    generation: e.generation,
                }
                .encode(PushNotice::ReservationReleased);
                self.send(Node::D(d), Node::P(p), bytes);
            }
        }
    }

    fn finish(mut self) -> PushReport {
        for (&i, &n) in &self.reservation_ends {
            if n != 1 {
                self.report
                    .failures
                    .push(format!("reservation of request {i} ended {n} times"));
            }
        }
        for &i in self.reserved.keys() {
            if !self.reservation_ends.contains_key(&i) {
                self.report
                    .failures
                    .push(format!("reservation of request {i} never ended"));
            }
        }
        for (&i, &n) in &self.admitted {
            let ended = self.push_ends.get(&i).copied().unwrap_or(0);
            let alive = self.ps[self.requests[i as usize].p as usize].alive;
            if ended > n || (alive && ended != n) {
                self.report.failures.push(format!(
                    "push of request {i} admitted {n} times, ended {ended} times"
                ));
            }
        }
        for (p, e) in self.ps.iter().enumerate() {
            if e.alive && (!e.core.is_idle() || e.pool.allocated_count() != 0) {
                self.report
                    .failures
                    .push(format!("p{p} not idle at the end"));
            }
        }
        for (d, e) in self.ds.iter().enumerate() {
            if !e.res.is_empty() || e.pool.allocated_count() != 0 || !e.owner.is_empty() {
                self.report
                    .failures
                    .push(format!("d{d} holds blocks at the end"));
            }
        }
        self.report.failures.sort();
        self.report
    }
}
