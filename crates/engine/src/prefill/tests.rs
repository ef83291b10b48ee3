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
