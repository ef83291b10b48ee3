//! Model tests: random operation sequences against the lease table and the heartbeat
//! tracker, each checked against a naive reference model (oracle versus subject).
//!
//! `PROPTEST_CASES=N` sets the number of cases (default 256 per property).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use kvlease_lease::{
    BlockId, ConsumerId, EngineId, Event, GrantError, HeartbeatTracker, LeaseConfig, LeaseMode,
    LeaseTable, ReadCompleteOutcome, ReleaseReason, Released, RequestId, Timestamp,
};
use proptest::prelude::*;

const TOTAL_BLOCKS: u32 = 48;
/// Ids 0..10 are granted; 10..14 are never granted (unknown to P).
const IDS: u8 = 14;
const GRANTABLE: u8 = 10;

fn rid(i: u8) -> RequestId {
    RequestId::new(&format!("req-{i}")).unwrap()
}

fn engine(i: u8) -> EngineId {
    EngineId::new(&format!("engine-{i}")).unwrap()
}

fn ns(t: Timestamp) -> u64 {
    t.as_nanos_saturating()
}

#[derive(Debug, Clone)]
enum Op {
    Grant {
        id: u8,
        blocks: u8,
        expected: u32,
    },
    Heartbeat {
        ids: Vec<u8>,
    },
    ReadComplete {
        id: u8,
        engine: u8,
        rank: u32,
        total: Option<u32>,
    },
    Abort {
        id: u8,
    },
    /// Move time forward by `ms`; with `drive`, call the reaper at every `poll_timeout` on
    /// the way, as a driver does; without, let it run late.
    Advance {
        ms: u64,
        drive: bool,
    },
    Timeout,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..GRANTABLE, 0u8..5, 0u32..4).prop_map(|(id, blocks, expected)| Op::Grant { id, blocks, expected }),
        4 => prop::collection::vec(0..IDS, 0..6).prop_map(|ids| Op::Heartbeat { ids }),
        2 => (0..IDS, 0u8..2, 0u32..3, prop::option::of(0u32..4))
            .prop_map(|(id, engine, rank, total)| Op::ReadComplete { id, engine, rank, total }),
        1 => (0..IDS).prop_map(|id| Op::Abort { id }),
        4 => (prop_oneof![0u64..300, 0u64..40_000], any::<bool>())
            .prop_map(|(ms, drive)| Op::Advance { ms, drive }),
        1 => Just(Op::Timeout),
    ]
}

fn config() -> impl Strategy<Value = LeaseConfig> {
    prop_oneof![
        Just(LeaseConfig::default()),
        Just(LeaseConfig::from_secs_f64(1.5).unwrap()),
        Just(LeaseConfig::from_secs_f64(7.0).unwrap()),
        Just(
            LeaseConfig::from_secs_f64(10.0)
                .unwrap()
                .with_mode(LeaseMode::Fixed)
        ),
    ]
}

/// The reference: a plain list of leases, every rule written the obvious way.
#[derive(Debug)]
struct ModelLease {
    id: u8,
    blocks: Vec<BlockId>,
    generation: u64,
    granted_at: u64,
    expiry: u64,
    last_heartbeat: Option<u64>,
    expected: u32,
    consumers: Vec<(u8, u32)>,
}

struct Model {
    config: LeaseConfig,
    leases: Vec<ModelLease>,
    free: Vec<BlockId>,
}

impl Model {
    fn find(&self, id: u8) -> Option<usize> {
        self.leases.iter().position(|l| l.id == id)
    }

    fn take(&mut self, id: u8) -> ModelLease {
        let i = self.find(id).unwrap();
        self.leases.remove(i)
    }
}

struct Harness {
    table: LeaseTable,
    model: Model,
    now: u64,
    released: BTreeSet<u64>,
    granted: BTreeSet<u64>,
    /// Highest expiry seen per generation: it never decreases.
    expiry_seen: HashMap<u64, u64>,
}

impl Harness {
    fn new(config: LeaseConfig) -> Self {
        Self {
            table: LeaseTable::new(config),
            model: Model {
                config,
                leases: Vec::new(),
                free: (0..TOTAL_BLOCKS).map(BlockId).collect(),
            },
            now: 0,
            released: BTreeSet::new(),
            granted: BTreeSet::new(),
            expiry_seen: HashMap::new(),
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.now)
    }

    fn extension(&self) -> u64 {
        self.model.config.extension().as_nanos() as u64
    }

    /// Drains the table's events and checks them against the releases the model expects,
    /// in order.
    fn expect_released(&mut self, expected: Vec<(ModelLease, ReleaseReason)>) {
        let events: Vec<Released> = std::iter::from_fn(|| self.table.poll_event())
            .map(|e| match e {
                Event::Released(r) => r,
            })
            .collect();
        assert_eq!(
            events.len(),
            expected.len(),
            "events {events:?} expected {expected:?}"
        );
        for (r, (m, reason)) in events.into_iter().zip(expected) {
            assert_eq!(r.request, rid(m.id));
            assert_eq!(r.reason, reason);
            assert_eq!(r.generation.word(), m.generation);
            assert_eq!(r.blocks, m.blocks);
            assert_eq!(ns(r.granted_at), m.granted_at);
            assert_eq!(ns(r.expiry), m.expiry);
            assert_eq!(r.last_heartbeat.map(ns), m.last_heartbeat);
            assert_eq!(ns(r.released_at), self.now);
            match reason {
                // Nothing expires early.
                ReleaseReason::Expired => assert!(m.expiry <= self.now),
                // Completed or aborted: may be before expiry.
                ReleaseReason::Completed | ReleaseReason::Aborted => {}
            }
            // Released exactly once.
            assert!(self.released.insert(m.generation), "released twice");
            self.model.free.extend(r.blocks);
        }
    }

    fn reap(&mut self) -> usize {
        let now = self.now;
        let mut due: Vec<ModelLease> = Vec::new();
        let mut i = 0;
        while i < self.model.leases.len() {
            if self.model.leases[i].expiry <= now {
                due.push(self.model.leases.remove(i));
            } else {
                i += 1;
            }
        }
        // Deadline order (ties: grant order).
        due.sort_by_key(|l| (l.expiry, l.generation));
        let n = self.table.handle_timeout(self.now());
        assert_eq!(n, due.len());
        self.expect_released(
            due.into_iter()
                .map(|l| (l, ReleaseReason::Expired))
                .collect(),
        );
        n
    }

    fn apply(&mut self, op: Op) {
        let now = self.now();
        match op {
            Op::Grant {
                id,
                blocks,
                expected,
            } => self.grant(now, id, blocks, expected),
            Op::Heartbeat { ids } => self.heartbeat(now, ids),
            Op::ReadComplete {
                id,
                engine: e,
                rank,
                total,
            } => self.read_complete(now, id, e, rank, total),
            Op::Abort { id } => self.abort(now, id),
            Op::Advance { ms, drive } => self.advance(ms, drive),
            Op::Timeout => {
                self.reap();
            }
        }
        self.check();
    }

    /// A grant: refused for no consumers or a held id, else the model takes the blocks.
    fn grant(&mut self, now: Timestamp, id: u8, blocks: u8, expected: u32) {
        let n = usize::from(blocks).min(self.model.free.len());
        let at = self.model.free.len() - n;
        let blocks: Vec<BlockId> = self.model.free[at..].to_vec();
        let result = self.table.grant(now, rid(id), blocks.clone(), expected);
        if expected == 0 {
            assert_eq!(result, Err(GrantError::ZeroConsumers { request: rid(id) }));
        } else if self.model.find(id).is_some() {
            assert_eq!(result, Err(GrantError::Duplicate { request: rid(id) }));
        } else {
            let generation = result.unwrap().word();
            assert!(self.granted.insert(generation), "generation reused");
            self.model.free.truncate(at);
            self.model.leases.push(ModelLease {
                id,
                blocks,
                generation,
                granted_at: self.now,
                expiry: self.now + self.model.config.duration().as_nanos() as u64,
                last_heartbeat: None,
                expected,
                consumers: Vec::new(),
            });
        }
        self.expect_released(Vec::new());
    }

    /// A heartbeat batch: the table's counts match the model's, which renews held leases.
    fn heartbeat(&mut self, now: Timestamp, ids: Vec<u8>) {
        let names: Vec<RequestId> = ids.iter().map(|&i| rid(i)).collect();
        let out = self.table.handle_heartbeat(now, &names);
        let (mut held, mut extended, mut unknown, mut late) = (0, 0, 0, 0);
        let renewed = self.now + self.extension();
        let fixed = self.model.config.mode() == LeaseMode::Fixed;
        for &i in &ids {
            match self.model.find(i) {
                None => unknown += 1,
                Some(k) => {
                    let l = &mut self.model.leases[k];
                    if l.expiry <= self.now {
                        late += 1;
                        continue;
                    }
                    held += 1;
                    l.last_heartbeat = Some(self.now);
                    if !fixed && renewed > l.expiry {
                        l.expiry = renewed;
                        extended += 1;
                    }
                }
            }
        }
        assert_eq!(
            (out.held, out.extended, out.unknown, out.late),
            (held, extended, unknown, late)
        );
        self.expect_released(Vec::new());
    }

    /// A read completion: the table's answer matches the model's, and the last one releases.
    fn read_complete(&mut self, now: Timestamp, id: u8, e: u8, rank: u32, total: Option<u32>) {
        let consumer = ConsumerId::new(engine(e), rank);
        let out = self
            .table
            .handle_read_complete(now, &rid(id), consumer, total);
        let expected_out = if total == Some(0) {
            ReadCompleteOutcome::InvalidTotal
        } else if let Some(k) = self.model.find(id) {
            let l = &mut self.model.leases[k];
            if let Some(t) = total {
                l.expected = t;
            }
            let duplicate = l.consumers.contains(&(e, rank));
            if !duplicate {
                l.consumers.push((e, rank));
            }
            let remaining = l.expected.saturating_sub(l.consumers.len() as u32);
            if remaining == 0 {
                ReadCompleteOutcome::Released
            } else if duplicate {
                ReadCompleteOutcome::Duplicate { remaining }
            } else {
                ReadCompleteOutcome::Waiting { remaining }
            }
        } else {
            ReadCompleteOutcome::Unknown
        };
        assert_eq!(out, expected_out);
        if out == ReadCompleteOutcome::Released {
            let l = self.model.take(id);
            self.expect_released(vec![(l, ReleaseReason::Completed)]);
        } else {
            self.expect_released(Vec::new());
        }
    }

    /// An abort releases a held lease.
    fn abort(&mut self, now: Timestamp, id: u8) {
        let held = self.table.abort(now, &rid(id));
        assert_eq!(held, self.model.find(id).is_some());
        if held {
            let l = self.model.take(id);
            self.expect_released(vec![(l, ReleaseReason::Aborted)]);
        }
    }

    /// Time moves on by `ms`, reaped at every deadline on the way when `drive`.
    fn advance(&mut self, ms: u64, drive: bool) {
        let target = self.now + ms * 1_000_000;
        if drive {
            // A driver: reap at every deadline on the way. Then every lease that
            // expires during the advance is released exactly at its expiry: no
            // later than the last heartbeat + extension.
            let start = self.now;
            while let Some(t) = self.table.poll_timeout() {
                let t = ns(t);
                if t > target {
                    break;
                }
                self.now = self.now.max(t);
                let late: Vec<u64> = self
                    .model
                    .leases
                    .iter()
                    .filter(|l| l.expiry > start && l.expiry < self.now)
                    .map(|l| l.expiry)
                    .collect();
                assert!(
                    late.is_empty(),
                    "missed deadlines {late:?} before {}",
                    self.now
                );
                self.reap();
                assert!(self.table.poll_timeout().is_none_or(|t| ns(t) > self.now));
            }
        }
        self.now = target;
    }

    fn check(&mut self) {
        let m = &self.model;
        assert_eq!(self.table.len(), m.leases.len());
        let held: usize = m.leases.iter().map(|l| l.blocks.len()).sum();
        assert_eq!(self.table.blocks_held(), held);
        // Held + free = total.
        assert_eq!(held + m.free.len(), TOTAL_BLOCKS as usize);
        // poll_timeout is never later than the earliest expiry.
        let earliest = m.leases.iter().map(|l| l.expiry).min();
        match (self.table.poll_timeout(), earliest) {
            (None, None) => {}
            (Some(t), Some(e)) => assert!(ns(t) <= e),
            other => panic!("poll_timeout vs model: {other:?}"),
        }
        for l in &m.leases {
            let info = self.table.get(&rid(l.id)).expect("model lease is held");
            assert_eq!(info.generation.word(), l.generation);
            assert_eq!(ns(info.expiry), l.expiry);
            assert_eq!(ns(info.granted_at), l.granted_at);
            assert_eq!(info.last_heartbeat.map(ns), l.last_heartbeat);
            assert_eq!(info.consumers_expected, l.expected);
            assert_eq!(info.consumers_reported as usize, l.consumers.len());
            assert_eq!(self.table.blocks(&rid(l.id)), Some(l.blocks.as_slice()));
            // Expiry never decreases.
            let seen = self.expiry_seen.entry(l.generation).or_insert(0);
            assert!(l.expiry >= *seen, "expiry decreased");
            *seen = l.expiry;
            // The lease ends by max(grant + duration, last heartbeat + extension).
            let bound =
                (l.granted_at + m.config.duration().as_nanos() as u64).max(match m.config.mode() {
                    LeaseMode::Lease => l.last_heartbeat.map_or(0, |t| t + self.extension()),
                    LeaseMode::Fixed => 0,
                });
            assert_eq!(l.expiry, bound);
        }
        for i in 0..IDS {
            if m.find(i).is_none() {
                assert!(self.table.get(&rid(i)).is_none());
            }
        }
    }

    /// Every grant ends up released exactly once.
    fn finish(mut self) {
        self.now += Duration::from_secs(100_000).as_nanos() as u64;
        self.reap();
        assert!(self.table.is_empty());
        assert_eq!(self.released, self.granted);
        assert_eq!(self.model.free.len(), TOTAL_BLOCKS as usize);
        let s = self.table.stats();
        assert_eq!(
            s.released_completed + s.released_expired + s.released_aborted,
            self.granted.len() as u64
        );
    }
}

fn proptest_config() -> ProptestConfig {
    // Cases from PROPTEST_CASES (default 256); no regression files in the source tree.
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(proptest_config())]
    #[test]
    fn lease_table_matches_model(config in config(), ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new(config);
        for op in ops {
            h.apply(op);
        }
        h.finish();
    }
}

#[derive(Debug, Clone)]
enum TrackOp {
    Track {
        id: u8,
        engine: u8,
        peers: u32,
    },
    Untrack {
        id: u8,
    },
    /// Advance by `ms` and poll (one driver step); a returned batch is deferred to the next
    /// step when `defer` says so (no handshake yet).
    Step {
        ms: u64,
        defer: bool,
    },
}

/// The longest step between polls.
const MAX_STEP_MS: u64 = 400;

fn track_op() -> impl Strategy<Value = TrackOp> {
    prop_oneof![
        3 => (0u8..16, 0u8..3, 1u32..5).prop_map(|(id, engine, peers)| TrackOp::Track { id, engine, peers }),
        2 => (0u8..16).prop_map(|id| TrackOp::Untrack { id }),
        6 => (1u64..=MAX_STEP_MS, prop::bool::weighted(0.15)).prop_map(|(ms, defer)| TrackOp::Step { ms, defer }),
    ]
}

#[derive(Debug, Default)]
struct ModelEngine {
    /// When its last batch was sent (not deferred).
    last_sent: Option<u64>,
    /// Whether a batch was deferred since the last one sent.
    deferred: bool,
}

proptest! {
    #![proptest_config(proptest_config())]
    #[test]
    fn heartbeat_tracker_matches_model(ops in prop::collection::vec(track_op(), 1..120)) {
        // 1.5 s leases: interval 250 ms, steps up to 400 ms.
        let config = LeaseConfig::from_secs_f64(1.5).unwrap();
        let interval = config.interval().as_nanos() as u64;
        let max_step = MAX_STEP_MS * 1_000_000;
        let mut t = HeartbeatTracker::new(&config);
        let mut now = 0u64;
        // request -> (engine, peers, last time it was covered by a sent batch or tracked)
        let mut tracked: BTreeMap<u8, (u8, u32, u64)> = BTreeMap::new();
        let mut engines: HashMap<u8, ModelEngine> = HashMap::new();
        for op in ops {
            match op {
                TrackOp::Track { id, engine: e, peers } => {
                    let r = t.track(Timestamp::from_nanos(now), rid(id), engine(e), peers);
                    match tracked.entry(id) {
                        std::collections::btree_map::Entry::Occupied(_) => prop_assert!(r.is_err()),
                        std::collections::btree_map::Entry::Vacant(v) => {
                            prop_assert!(r.is_ok());
                            v.insert((e, peers, now));
                        }
                    }
                }
                TrackOp::Untrack { id } => {
                    prop_assert_eq!(t.untrack(&rid(id)), tracked.remove(&id).is_some());
                }
                TrackOp::Step { ms, defer } => {
                    now += ms * 1_000_000;
                    let ts = Timestamp::from_nanos(now);
                    let mut seen = BTreeSet::new();
                    while let Some(b) = t.poll_heartbeat(ts) {
                        let e: u8 = b.engine.as_str()["engine-".len()..].parse().unwrap();
                        // One batch per engine per poll.
                        prop_assert!(seen.insert(e));
                        // It lists exactly the engine's tracked requests.
                        let want: BTreeSet<RequestId> = tracked
                            .iter()
                            .filter(|(_, v)| v.0 == e)
                            .map(|(&id, _)| rid(id))
                            .collect();
                        let got: BTreeSet<RequestId> = b.requests.iter().cloned().collect();
                        prop_assert_eq!(got.len(), b.requests.len(), "duplicate ids in a batch");
                        prop_assert_eq!(&got, &want);
                        prop_assert!(!want.is_empty(), "batch for an engine with no requests");
                        let max_peers = tracked.values().filter(|v| v.0 == e).map(|v| v.1).max();
                        prop_assert!(Some(b.workers) >= max_peers);
                        let me = engines.entry(e).or_default();
                        if defer {
                            prop_assert!(t.defer(&b.engine, Timestamp::from_nanos(now + 1)));
                            me.deferred = true;
                            continue;
                        }
                        // At most one batch per engine per interval.
                        if let Some(last) = me.last_sent {
                            prop_assert!(now - last >= interval, "two batches within an interval");
                        }
                        me.last_sent = Some(now);
                        me.deferred = false;
                        for v in tracked.values_mut().filter(|v| v.0 == e) {
                            v.2 = now;
                        }
                    }
                    // Every tracked request is heartbeated every interval (plus one step),
                    // unless its engine's batch is waiting for a handshake.
                    for (id, &(e, _, covered)) in &tracked {
                        if engines.get(&e).is_some_and(|me| me.deferred) {
                            continue;
                        }
                        prop_assert!(
                            now - covered <= interval + max_step,
                            "request {} not heartbeated for {} ns", id, now - covered
                        );
                    }
                    // poll_timeout is exact: the next batch is due after now.
                    prop_assert!(t.poll_timeout().is_none_or(|d| d > ts));
                }
            }
            prop_assert_eq!(t.len(), tracked.len());
            let live: BTreeSet<u8> = tracked.values().map(|v| v.0).collect();
            prop_assert_eq!(t.engine_count(), live.len());
            for (&id, v) in &tracked {
                prop_assert_eq!(t.engine_of(&rid(id)), Some(&engine(v.0)));
            }
        }
    }
}
