use std::time::Duration;

use kvlease_notif::{Abort, ReadComplete};

use super::*;

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn engine(s: &str) -> EngineId {
    EngineId::new(s).unwrap()
}

fn at(ms: u64) -> Timestamp {
    Timestamp::from_nanos(ms * 1_000_000)
}

fn core(blocks: u32) -> PrefillCore<&'static str> {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    PrefillCore::new(
        PrefillConfig::new(engine("p"), 2, blocks, 16, lease)
            .with_pool_wait(Duration::from_millis(100)),
    )
}

fn d(name: &'static str) -> Peer<&'static str> {
    let engine_name = name.split('/').next().unwrap();
    Peer {
        engine: engine(engine_name),
        addr: name,
    }
}

/// Runs one request to its grant.
fn granted(c: &mut PrefillCore<&'static str>, now: Timestamp, req: &str, tokens: usize) -> Granted {
    c.handle_job(now, id(req), tokens).unwrap();
    let start = c.poll_prefill(now).unwrap();
    assert_eq!(start.request, id(req));
    c.handle_prefill_done(now, &id(req)).unwrap()
}

fn drain(c: &mut PrefillCore<&'static str>) -> Vec<PrefillAction<&'static str>> {
    std::iter::from_fn(|| c.poll_action()).collect()
}

fn hb(ids: &[&str]) -> Vec<u8> {
    let ids: Vec<RequestId> = ids.iter().map(|s| id(s)).collect();
    kvlease_notif::encode_heartbeats(&ids, kvlease_notif::MAX_NOTIF_LEN)
        .unwrap()
        .remove(0)
}

fn rc(req: &str, from: &str, rank: u32, total: u32) -> Vec<u8> {
    ReadComplete {
        request: id(req),
        consumer: ConsumerId::new(engine(from), rank),
        consumers_total: total,
    }
    .encode()
}

#[test]
fn grant_then_every_consumer_completes() {
    let mut c = core(8);
    let g = granted(&mut c, at(0), "r1", 40);
    assert_eq!(g.blocks.len(), 3);
    assert_eq!(c.blocks_leased(), 3);
    let out = c.handle_notif(at(1), &d("d1/d0"), &rc("r1", "d1", 0, 2));
    assert!(matches!(out, PrefillNotif::ReadComplete { .. }));
    assert!(drain(&mut c).is_empty());
    c.handle_notif(at(2), &d("d1/d1"), &rc("r1", "d1", 1, 2));
    let actions = drain(&mut c);
    assert!(
        matches!(&actions[..], [PrefillAction::ClearFences { released }]
        if released.reason == ReleaseReason::Completed && released.blocks == g.blocks)
    );
    assert!(c.is_idle());
}

#[test]
fn a_pushed_prefill_frees_its_blocks_without_a_lease() {
    let mut c = core(3);
    c.handle_job(at(0), id("r1"), 48).unwrap();
    let start = c.poll_prefill(at(0)).unwrap();
    assert_eq!(c.blocks_allocated(), 3);
    assert_eq!(c.blocks_leased(), 0);
    let refused = c.stats().refused;
    assert!(c.handle_pushed(&id("r1")));
    assert!(!c.handle_pushed(&id("r1")), "freed once");
    assert_eq!(c.stats().refused, refused, "a push is no refusal");
    assert!(
        drain(&mut c).is_empty(),
        "no fence was published: nothing to clear"
    );
    c.handle_job(at(1), id("r2"), 48).unwrap();
    assert_eq!(
        c.poll_prefill(at(1)).unwrap().blocks.len(),
        start.blocks.len()
    );
}

#[test]
fn blocks_are_reused_only_after_their_fence_clear_was_polled() {
    let mut c = core(3);
    granted(&mut c, at(0), "r1", 48);
    c.handle_job(at(1), id("r2"), 48).unwrap();
    assert!(c.poll_prefill(at(1)).is_none(), "pool full");
    c.handle_notif(
        at(2),
        &d("d1/d0"),
        &Abort {
            request: id("r1"),
            consumer: ConsumerId::new(engine("d1"), 0),
        }
        .encode(),
    );
    assert!(
        c.poll_prefill(at(2)).is_none(),
        "fence clear not polled yet"
    );
    assert_eq!(drain(&mut c).len(), 1);
    assert!(c.poll_prefill(at(2)).is_some());
}

#[test]
fn heartbeats_renew_and_expiry_is_announced_to_the_last_heartbeater() {
    let mut c = core(8);
    granted(&mut c, at(0), "r1", 16);
    c.handle_notif(at(2_000), &d("d1/d0"), &hb(&["r1"]));
    c.handle_timeout(at(3_500));
    assert_eq!(c.leases(), 1, "renewed past the initial 3 s");
    c.handle_timeout(at(10_000));
    let actions = drain(&mut c);
    assert_eq!(actions.len(), 2);
    assert!(matches!(
        &actions[1],
        PrefillAction::Transmit { to: "d1/d0", .. }
    ));
    assert_eq!(c.stats().released_expired, 1);
}

#[test]
fn a_lease_belongs_to_the_first_engine_that_heartbeats_it() {
    let mut c = core(8);
    granted(&mut c, at(0), "r1", 16);
    c.handle_notif(at(1), &d("d1/d0"), &hb(&["r1"]));
    assert_eq!(c.owner(&id("r1")), Some(&engine("d1")));
    // A third peer's heartbeat, completion and abort change nothing.
    let out = c.handle_notif(at(2), &d("evil/d0"), &hb(&["r1"]));
    assert!(matches!(out, PrefillNotif::Heartbeat { foreign: 1, .. }));
    let out = c.handle_notif(at(3), &d("evil/d0"), &rc("r1", "evil", 0, 1));
    assert!(matches!(out, PrefillNotif::Foreign { .. }));
    let out = c.handle_notif(
        at(4),
        &d("evil/d0"),
        &Abort {
            request: id("r1"),
            consumer: ConsumerId::new(engine("evil"), 0),
        }
        .encode(),
    );
    assert!(matches!(out, PrefillNotif::Foreign { .. }));
    // A completion whose consumer names another engine than its sender is forged too.
    let out = c.handle_notif(at(5), &d("evil/d0"), &rc("r1", "d1", 0, 1));
    assert!(matches!(out, PrefillNotif::Foreign { .. }));
    assert_eq!(c.leases(), 1);
    assert_eq!(c.stats().foreign_notifs, 4);
    // The owner completes it.
    c.handle_notif(at(6), &d("d1/d0"), &rc("r1", "d1", 0, 1));
    assert_eq!(c.leases(), 0);
}

#[test]
fn consumers_total_is_bounded() {
    let mut c = core(8);
    granted(&mut c, at(0), "r1", 16);
    let out = c.handle_notif(at(1), &d("d1/d0"), &rc("r1", "d1", 0, u32::MAX));
    assert!(matches!(out, PrefillNotif::Foreign { .. }));
    assert_eq!(c.leases(), 1);
}

#[test]
fn head_of_line_waits_then_is_refused() {
    let mut c = core(2);
    granted(&mut c, at(0), "r1", 32);
    c.handle_job(at(10), id("r2"), 16).unwrap();
    assert!(c.poll_prefill(at(50)).is_none());
    assert_eq!(c.poll_timeout(), Some(at(110)));
    assert!(c.poll_prefill(at(110)).is_none());
    assert!(matches!(
        c.poll_event(),
        Some(PrefillEvent::Refused {
            error: PrefillError::PoolWaitTimeout { needed: 1, .. },
            ..
        })
    ));
}

#[test]
fn refusals_on_arrival() {
    let mut c = core(2);
    assert_eq!(
        c.handle_job(at(0), id("r0"), 0),
        Err(PrefillError::EmptyPrompt)
    );
    assert!(matches!(
        c.handle_job(at(0), id("r1"), 100),
        Err(PrefillError::PromptTooLong { needed: 7, pool: 2 })
    ));
    c.handle_job(at(0), id("r2"), 1).unwrap();
    assert!(matches!(
        c.handle_job(at(0), id("r2"), 1),
        Err(PrefillError::Duplicate { .. })
    ));
}

#[test]
fn a_retry_under_the_same_id_supersedes_the_old_lease() {
    let mut c = core(8);
    let first = granted(&mut c, at(0), "r1", 16);
    let second = granted(&mut c, at(1), "r1", 16);
    assert!(second.superseded);
    assert!(second.generation > first.generation);
    let actions = drain(&mut c);
    assert!(
        matches!(&actions[..], [PrefillAction::ClearFences { released }]
        if released.generation == first.generation)
    );
    assert_eq!(c.leases(), 1);
}

#[test]
fn malformed_input_changes_nothing() {
    let mut c = core(8);
    granted(&mut c, at(0), "r1", 16);
    for bytes in [
        &b"KVL1:HB:"[..],
        b"KVL1:RC:\xff",
        b"KVL1:AB:",
        b"KVL1:EX:zz",
    ] {
        let out = c.handle_notif(at(1), &d("d1/d0"), bytes);
        assert!(
            matches!(out, PrefillNotif::Malformed(_) | PrefillNotif::Ignored),
            "{out:?}"
        );
    }
    assert_eq!(c.leases(), 1);
}

fn external_core(blocks: u32) -> PrefillCore<&'static str> {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    PrefillCore::new(
        PrefillConfig::new(engine("p"), 1, blocks, 16, lease)
            .with_block_source(BlockSource::External),
    )
}

#[test]
fn external_blocks_are_granted_released_and_handed_back_without_a_pool() {
    let mut c = external_core(8);
    // vLLM allocated blocks 5 and 2 for the request: the core leases exactly those.
    let g = c
        .handle_prefill_done_in(at(0), id("r1"), vec![BlockId(5), BlockId(2)])
        .unwrap();
    assert_eq!(g.blocks, [BlockId(5), BlockId(2)]);
    assert_eq!(c.blocks_allocated(), 2);
    assert_eq!(c.blocks_leased(), 2);
    assert!(
        c.poll_prefill(at(0)).is_none(),
        "the core hands out no blocks"
    );
    // The reader completes: the lease ends, and the fence clear tells the shell that
    // vLLM may free the blocks now.
    c.handle_notif(at(1), &d("d1/d0"), &rc("r1", "d1", 0, 1));
    let actions = drain(&mut c);
    assert!(
        matches!(&actions[..], [PrefillAction::ClearFences { released }]
            if released.blocks == [BlockId(5), BlockId(2)]
            && released.reason == ReleaseReason::Completed)
    );
    assert!(c.is_idle());

    // Expiry gives them back the same way.
    c.handle_prefill_done_in(at(10), id("r2"), vec![BlockId(0)])
        .unwrap();
    c.handle_timeout(at(10 + 3_000));
    assert!(matches!(
        &drain(&mut c)[..],
        [PrefillAction::ClearFences { released }] if released.reason == ReleaseReason::Expired
    ));
    assert!(c.is_idle());
}

#[test]
fn external_blocks_are_checked_and_each_source_refuses_the_others_calls() {
    let mut c = external_core(8);
    let err = |r: Result<Granted, PrefillError>| r.unwrap_err();
    assert_eq!(
        err(c.handle_prefill_done_in(at(0), id("a"), vec![BlockId(8)])),
        PrefillError::BlockOutOfRange { block: 8, pool: 8 }
    );
    assert_eq!(
        err(c.handle_prefill_done_in(at(0), id("a"), vec![])),
        PrefillError::EmptyPrompt
    );
    assert!(matches!(
        err(c.handle_prefill_done_in(at(0), id("a"), (0..9).map(BlockId).collect())),
        PrefillError::PromptTooLong { needed: 9, pool: 8 }
    ));
    assert_eq!(
        c.handle_job(at(0), id("a"), 16),
        Err(PrefillError::WrongBlockSource {
            core: BlockSource::External
        })
    );
    assert!(c.is_idle(), "refusals hold nothing");
    assert_eq!(c.stats().refused, 4);

    let mut pool = core(8);
    assert_eq!(
        pool.handle_prefill_done_in(at(0), id("a"), vec![BlockId(0)])
            .unwrap_err(),
        PrefillError::WrongBlockSource {
            core: BlockSource::Pool
        }
    );
    assert!(pool.is_idle());
}

/// An external core that also holds finished turns (bidirectional mode): leases of 3 s,
/// holds of 60 s renewed by heartbeats (extension 40 s).
fn holding_core(blocks: u32) -> PrefillCore<&'static str> {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let holds = LeaseConfig::from_duration(Duration::from_secs(60)).unwrap();
    PrefillCore::new(
        PrefillConfig::new(engine("d"), 1, blocks, 16, lease)
            .with_block_source(BlockSource::External)
            .with_first_generation(Generation(std::num::NonZeroU64::new(1000).unwrap()))
            .with_holds(holds),
    )
}

#[test]
fn a_hold_lives_on_its_own_terms_renewed_by_its_readers_heartbeats() {
    let mut c = holding_core(8);
    let lease = c
        .handle_prefill_done_in(at(0), id("p-role"), vec![BlockId(1)])
        .unwrap();
    let hold = c
        .hold_in(at(0), id("turn1"), vec![BlockId(2), BlockId(3)])
        .unwrap();
    // Generations never meet: a reader's fence word tells a hold's from a lease's.
    assert_eq!(lease.generation.0.get(), 1000);
    assert_eq!(hold.generation.0.get(), 1000 + HOLD_GENERATIONS);
    assert_eq!(c.stats().holds_granted, 1);
    assert_eq!(c.blocks_allocated(), 3);
    // The lease ends at 3 s; the hold lives to 60 s.
    c.handle_timeout(at(3_000));
    assert!(matches!(
        &drain(&mut c)[..],
        [PrefillAction::ClearFences { released }] if released.request == id("p-role")
    ));
    assert!(matches!(c.poll_event(), Some(PrefillEvent::Released(_))));
    // The next turn's P heartbeats the hold (with an id the leases do not know): each
    // heartbeat moves its end to now + 40 s.
    let out = c.handle_notif(at(50_000), &d("p2/p0"), &hb(&["turn1", "unknown"]));
    assert!(matches!(out, PrefillNotif::Heartbeat { outcome, .. }
        if outcome.held == 1 && outcome.extended == 1 && outcome.unknown == 1));
    c.handle_timeout(at(60_000));
    assert!(drain(&mut c).is_empty(), "renewed past its TTL");
    // Only its claimer may complete it; its read completion releases it.
    let foreign = c.handle_notif(at(60_001), &d("p3/p0"), &rc("turn1", "p3", 0, 1));
    assert!(matches!(foreign, PrefillNotif::Foreign { .. }));
    c.handle_notif(at(60_002), &d("p2/p0"), &rc("turn1", "p2", 0, 1));
    assert!(matches!(
        &drain(&mut c)[..],
        [PrefillAction::ClearFences { released }]
            if released.request == id("turn1") && released.reason == ReleaseReason::Completed
    ));
    assert!(matches!(c.poll_event(), Some(PrefillEvent::HoldReleased(r)) if r.blocks.len() == 2));
    assert_eq!(c.stats().holds_released_completed, 1);
    assert_eq!(c.stats().released_completed, 0);
    assert!(c.is_idle());
}

#[test]
fn a_hold_nobody_reads_ends_at_its_ttl_and_an_abort_ends_it_at_once() {
    let mut c = holding_core(8);
    c.hold_in(at(0), id("t1"), vec![BlockId(0)]).unwrap();
    c.hold_in(at(0), id("t2"), vec![BlockId(1)]).unwrap();
    assert_eq!(c.poll_timeout(), Some(at(60_000)));
    let abort = Abort {
        request: id("t2"),
        consumer: ConsumerId::new(engine("p2"), 0),
    }
    .encode();
    assert!(matches!(
        c.handle_notif(at(1), &d("p2/p0"), &abort),
        PrefillNotif::Abort { held: true, .. }
    ));
    c.handle_timeout(at(60_000));
    let reasons: Vec<_> = drain(&mut c)
        .into_iter()
        .map(|a| match a {
            PrefillAction::ClearFences { released } => released.reason,
            PrefillAction::Transmit { .. } => panic!("no heartbeater to notify"),
        })
        .collect();
    assert_eq!(reasons, [ReleaseReason::Aborted, ReleaseReason::Expired]);
    let s = c.stats();
    assert_eq!((s.holds_released_aborted, s.holds_released_expired), (1, 1));
    assert!(c.is_idle());
}

#[test]
fn a_core_without_holds_refuses_to_hold_and_keeps_nothing() {
    let mut c = external_core(8);
    assert_eq!(
        c.hold_in(at(0), id("t1"), vec![BlockId(0)]),
        Err(PrefillError::NoHolds)
    );
    assert!(c.is_idle());
    // A hold's blocks are checked as a lease's are.
    let mut h = holding_core(8);
    assert_eq!(
        h.hold_in(at(0), id("t1"), vec![BlockId(8)]),
        Err(PrefillError::BlockOutOfRange { block: 8, pool: 8 })
    );
    assert!(h.is_idle());
}

mod holds_under_random_inputs {
    //! Leases and holds side by side under arbitrary inputs: every grant ends exactly
    //! once, in its own table, with its own generation range, and the blocks come back.

    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Lease(u8),
        Hold(u8),
        Heartbeat(u8, u8),
        ReadComplete(u8, u8),
        Abort(u8, u8),
        Advance(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..8u8).prop_map(Op::Lease),
            (0..8u8).prop_map(Op::Hold),
            (0..8u8, 0..2u8).prop_map(|(r, e)| Op::Heartbeat(r, e)),
            (0..8u8, 0..2u8).prop_map(|(r, e)| Op::ReadComplete(r, e)),
            (0..8u8, 0..2u8).prop_map(|(r, e)| Op::Abort(r, e)),
            (0..20_000u16).prop_map(Op::Advance),
        ]
    }

    proptest! {
        #[test]
        fn every_grant_ends_once_in_its_own_table(ops in prop::collection::vec(op(), 1..200)) {
            let mut c = holding_core(64);
            let mut now = 0u64;
            // Request -> (a hold?, its generation) while granted.
            let mut live: HashMap<String, (bool, u64)> = HashMap::new();
            let readers = ["p1", "p2"];
            let mut next_block = 0u32;
            for op in ops {
                match op {
                    Op::Lease(r) | Op::Hold(r) => {
                        let hold = matches!(op, Op::Hold(_));
                        let req = format!("r{r}");
                        if live.contains_key(&req) {
                            continue; // vLLM never grants a request id twice at once
                        }
                        let blocks = vec![BlockId(next_block % 64)];
                        next_block += 1;
                        let g = if hold {
                            c.hold_in(at(now), id(&req), blocks)
                        } else {
                            c.handle_prefill_done_in(at(now), id(&req), blocks)
                        };
                        if let Ok(g) = g {
                            let word = g.generation.0.get();
                            prop_assert_eq!(word >= 1000 + HOLD_GENERATIONS, hold);
                            live.insert(req, (hold, word));
                        }
                    }
                    Op::Heartbeat(r, e) => {
                        let from = if e == 0 { "p1/p0" } else { "p2/p0" };
                        let _ = c.handle_notif(at(now), &d(from), &hb(&[&format!("r{r}")]));
                    }
                    Op::ReadComplete(r, e) => {
                        let who = readers[e as usize];
                        let from = if e == 0 { "p1/p0" } else { "p2/p0" };
                        let _ = c.handle_notif(at(now), &d(from), &rc(&format!("r{r}"), who, 0, 1));
                    }
                    Op::Abort(r, e) => {
                        let who = readers[e as usize];
                        let from = if e == 0 { "p1/p0" } else { "p2/p0" };
                        let abort = Abort {
                            request: id(&format!("r{r}")),
                            consumer: ConsumerId::new(engine(who), 0),
                        }
                        .encode();
                        let _ = c.handle_notif(at(now), &d(from), &abort);
                    }
                    Op::Advance(ms) => {
                        now += u64::from(ms);
                        c.handle_timeout(at(now));
                    }
                }
                drain(&mut c);
                while let Some(ev) = c.poll_event() {
                    let (r, hold) = match ev {
                        PrefillEvent::Released(r) => (r, false),
                        PrefillEvent::HoldReleased(r) => (r, true),
                        PrefillEvent::Refused { .. } => continue,
                    };
                    let granted = live.remove(r.request.as_str());
                    prop_assert_eq!(granted, Some((hold, r.generation.0.get())),
                        "released once, from the table it was granted in");
                }
            }
            // Everything ends by the holds' TTL (no heartbeat renews a hold past its
            // maximum lifetime either).
            c.handle_timeout(at(now + 700_000));
            drain(&mut c);
            while let Some(ev) = c.poll_event() {
                if let PrefillEvent::Released(r) | PrefillEvent::HoldReleased(r) = ev {
                    prop_assert!(live.remove(r.request.as_str()).is_some());
                }
            }
            prop_assert!(live.is_empty(), "never released: {:?}", live);
            prop_assert!(c.is_idle());
            prop_assert_eq!(c.blocks_allocated(), 0);
        }
    }
}
