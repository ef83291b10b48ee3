//! Tests of the lease table, one per rule.

use std::time::Duration;

use super::*;
use crate::EngineId;

fn rid(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn ms(v: u64) -> Timestamp {
    Timestamp::from_millis(v)
}

fn consumer(rank: u32) -> ConsumerId {
    ConsumerId::new(EngineId::new("decode-0").unwrap(), rank)
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

/// A table of 30 s leases (interval 5 s, extension 20 s).
fn table() -> LeaseTable {
    LeaseTable::new(LeaseConfig::default())
}

fn drain(t: &mut LeaseTable) -> Vec<Released> {
    std::iter::from_fn(|| t.poll_event())
        .map(|Event::Released(r)| r)
        .collect()
}

#[test]
fn grant_sets_expiry_and_fresh_generations() {
    let mut t = table();
    let g1 = t.grant(ms(1_000), rid("a"), blocks(&[1, 2, 3]), 1).unwrap();
    let g2 = t.grant(ms(1_000), rid("b"), blocks(&[4]), 2).unwrap();
    assert_eq!(g1.word(), 1);
    assert!(g2 > g1);
    let info = t.get(&rid("a")).unwrap();
    assert_eq!(info.expiry, ms(31_000));
    assert_eq!(info.granted_at, ms(1_000));
    assert_eq!(info.last_heartbeat, None);
    assert_eq!((info.consumers_reported, info.consumers_expected), (0, 1));
    assert_eq!(info.blocks, 3);
    assert_eq!(t.blocks(&rid("b")), Some(&[BlockId(4)][..]));
    assert_eq!((t.len(), t.blocks_held()), (2, 4));
    assert_eq!(t.poll_timeout(), Some(ms(31_000)));
    assert_eq!(t.stats().granted, 2);

    // Released and granted again: the generation is not reused.
    assert!(t.abort(ms(2_000), &rid("a")));
    let g3 = t.grant(ms(2_000), rid("a"), blocks(&[1]), 1).unwrap();
    assert!(g3 > g2);

    let first = Generation(NonZeroU64::new(1 << 40).unwrap());
    let mut t = LeaseTable::with_first_generation(LeaseConfig::default(), first);
    assert_eq!(t.grant(ms(0), rid("x"), vec![], 1), Ok(first));
}

#[test]
fn grant_rejects_duplicates_and_zero_consumers_without_change() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    assert_eq!(
        t.grant(ms(5), rid("a"), blocks(&[2]), 1),
        Err(GrantError::Duplicate { request: rid("a") })
    );
    assert_eq!(
        t.grant(ms(5), rid("b"), blocks(&[2]), 0),
        Err(GrantError::ZeroConsumers { request: rid("b") })
    );
    assert_eq!((t.len(), t.blocks_held()), (1, 1));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(30_000));
    let far = Timestamp::from_duration(Duration::from_secs(u64::MAX - 1));
    assert_eq!(
        t.grant(far, rid("c"), vec![], 1),
        Err(GrantError::DeadlineOverflow { request: rid("c") })
    );
    let last = Generation(NonZeroU64::MAX);
    let mut t = LeaseTable::with_first_generation(LeaseConfig::default(), last);
    assert_eq!(t.grant(ms(0), rid("a"), vec![], 1), Ok(last));
    assert_eq!(
        t.grant(ms(0), rid("b"), vec![], 1),
        Err(GrantError::GenerationsExhausted { request: rid("b") })
    );
}

#[test]
fn heartbeat_extends_to_now_plus_extension_and_never_shortens() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    // At 5 s, now + 20 s = 25 s < 30 s: the initial lease is not shortened.
    let out = t.handle_heartbeat(ms(5_000), [&rid("a")]);
    assert_eq!((out.held, out.extended, out.unknown), (1, 0, 0));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(30_000));
    assert_eq!(t.get(&rid("a")).unwrap().last_heartbeat, Some(ms(5_000)));
    // At 15 s: 35 s.
    let out = t.handle_heartbeat(ms(15_000), ["a"]);
    assert_eq!((out.held, out.extended), (1, 1));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(35_000));
    // A reordered, older heartbeat does not move it back.
    let out = t.handle_heartbeat(ms(12_000), ["a"]);
    assert_eq!((out.held, out.extended), (1, 0));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(35_000));
    // Duplicates in one message are harmless.
    let out = t.handle_heartbeat(ms(16_000), ["a", "a"]);
    assert_eq!((out.held, out.extended), (2, 1));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(36_000));
    let s = t.stats();
    assert_eq!((s.heartbeat_ids, s.extensions), (5, 2));
}

#[test]
fn unknown_and_released_ids_change_nothing_but_are_counted() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    t.grant(ms(0), rid("b"), blocks(&[2]), 1).unwrap();
    assert!(t.abort(ms(1), &rid("b")));
    let _ = drain(&mut t);
    let out = t.handle_heartbeat(ms(20_000), ["nope", "b"]);
    assert_eq!((out.held, out.extended, out.unknown), (0, 0, 2));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(30_000));
    assert!(t.get(&rid("b")).is_none());
    assert_eq!(t.stats().unknown_ids, 2);
    assert!(t.poll_event().is_none());
}

#[test]
fn late_heartbeat_does_not_revive_an_expired_lease() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    // Expired at 30 s, not reaped yet.
    let out = t.handle_heartbeat(ms(30_000), ["a"]);
    assert_eq!((out.held, out.late), (0, 1));
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(30_000));
    assert_eq!(t.handle_timeout(ms(30_000)), 1);
    let r = drain(&mut t);
    assert_eq!(r[0].reason, ReleaseReason::Expired);
    assert_eq!(r[0].last_heartbeat, None);
    assert_eq!(t.stats().late_ids, 1);
}

#[test]
fn fixed_mode_counts_heartbeats_but_never_extends() {
    let config = LeaseConfig::from_secs_f64(480.0)
        .unwrap()
        .with_mode(LeaseMode::Fixed);
    let mut t = LeaseTable::new(config);
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    for s in (5..480).step_by(5) {
        let out = t.handle_heartbeat(ms(s * 1_000), ["a"]);
        assert_eq!((out.held, out.extended), (1, 0));
    }
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(480_000));
    assert_eq!(t.get(&rid("a")).unwrap().last_heartbeat, Some(ms(475_000)));
    assert_eq!(t.stats().heartbeat_ids, 95);
    assert_eq!(t.stats().extensions, 0);
    assert_eq!(t.handle_timeout(ms(479_999)), 0);
    assert_eq!(t.handle_timeout(ms(480_000)), 1);
}

#[test]
fn read_complete_frees_after_distinct_consumers() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1, 2]), 2).unwrap();
    assert_eq!(
        t.handle_read_complete(ms(10), &rid("a"), consumer(0), None),
        ReadCompleteOutcome::Waiting { remaining: 1 }
    );
    // The same rank again counts once.
    assert_eq!(
        t.handle_read_complete(ms(11), &rid("a"), consumer(0), None),
        ReadCompleteOutcome::Duplicate { remaining: 1 }
    );
    assert_eq!(t.len(), 1);
    assert_eq!(t.get(&rid("a")).unwrap().consumers_reported, 1);
    assert_eq!(
        t.handle_read_complete(ms(12), &rid("a"), consumer(1), None),
        ReadCompleteOutcome::Released
    );
    let r = drain(&mut t);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].reason, ReleaseReason::Completed);
    assert_eq!(r[0].blocks, blocks(&[1, 2]));
    assert_eq!(r[0].released_at, ms(12));
    assert_eq!((t.len(), t.blocks_held()), (0, 0));
    // After release: unknown.
    assert_eq!(
        t.handle_read_complete(ms(13), &rid("a"), consumer(2), None),
        ReadCompleteOutcome::Unknown
    );
    let s = t.stats();
    assert_eq!(
        (
            s.read_completions,
            s.duplicate_completions,
            s.unknown_completions,
            s.released_completed
        ),
        (2, 1, 1, 1)
    );
}

#[test]
fn consumers_total_from_the_reader_overrides_the_grant() {
    let mut t = table();
    // P thought one consumer; D (TP=4) says four.
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    assert_eq!(
        t.handle_read_complete(ms(1), &rid("a"), consumer(0), Some(4)),
        ReadCompleteOutcome::Waiting { remaining: 3 }
    );
    assert_eq!(t.get(&rid("a")).unwrap().consumers_expected, 4);
    for rank in 1..3 {
        assert!(matches!(
            t.handle_read_complete(ms(2), &rid("a"), consumer(rank), Some(4)),
            ReadCompleteOutcome::Waiting { .. }
        ));
    }
    assert_eq!(
        t.handle_read_complete(ms(3), &rid("a"), consumer(3), Some(4)),
        ReadCompleteOutcome::Released
    );
    // P thought four; D says one.
    t.grant(ms(0), rid("b"), blocks(&[1]), 4).unwrap();
    assert_eq!(
        t.handle_read_complete(ms(1), &rid("b"), consumer(0), Some(1)),
        ReadCompleteOutcome::Released
    );
    // Zero is invalid and changes nothing.
    t.grant(ms(0), rid("c"), blocks(&[1]), 1).unwrap();
    assert_eq!(
        t.handle_read_complete(ms(1), &rid("c"), consumer(0), Some(0)),
        ReadCompleteOutcome::InvalidTotal
    );
    assert_eq!(t.get(&rid("c")).unwrap().consumers_reported, 0);
    // Another engine's rank 0 is a distinct consumer.
    t.grant(ms(0), rid("d"), blocks(&[1]), 2).unwrap();
    let other = ConsumerId::new(EngineId::new("decode-1").unwrap(), 0);
    let _ = t.handle_read_complete(ms(1), &rid("d"), consumer(0), None);
    assert_eq!(
        t.handle_read_complete(ms(1), &rid("d"), other, None),
        ReadCompleteOutcome::Released
    );
}

#[test]
fn abort_frees_at_once() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[7, 8]), 1).unwrap();
    assert!(t.abort(ms(100), &rid("a")));
    assert!(!t.abort(ms(100), &rid("a")));
    let r = drain(&mut t);
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].reason, r[0].released_at),
        (ReleaseReason::Aborted, ms(100))
    );
    assert_eq!(t.blocks_held(), 0);
    assert_eq!(t.stats().released_aborted, 1);
    // Its heap entry is stale; the reaper skips it.
    assert_eq!(t.handle_timeout(ms(60_000)), 0);
    assert!(t.poll_event().is_none());
    assert_eq!(t.poll_timeout(), None);
}

/// vLLM issue #58222: the reaper walked leases in grant order and stopped at the first live
/// one, so an old lease that was renewed hid a younger lease that had expired behind it.
#[test]
fn issue_58222_renewed_old_lease_does_not_hide_expired_young_one() {
    let mut t = table();
    t.grant(ms(0), rid("old"), blocks(&[1]), 1).unwrap(); // expiry 30 s
    t.grant(ms(1_000), rid("young"), blocks(&[2]), 1).unwrap(); // expiry 31 s
    // D keeps heartbeating "old" only; "young" was lost by its reader.
    for s in [15u64, 20, 25, 30] {
        let _ = t.handle_heartbeat(ms(s * 1_000), ["old"]);
    }
    assert_eq!(t.get(&rid("old")).unwrap().expiry, ms(50_000));
    // At 31 s the young lease, granted after the old one, is expired.
    assert_eq!(t.handle_timeout(ms(31_000)), 1);
    let r = drain(&mut t);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].request, rid("young"));
    assert_eq!(r[0].reason, ReleaseReason::Expired);
    assert_eq!(r[0].expiry, ms(31_000));
    assert!(t.get(&rid("old")).is_some());
    assert_eq!(t.blocks_held(), 1);
    assert_eq!(t.poll_timeout(), Some(ms(50_000)));
}

#[test]
fn reaper_releases_every_expired_lease_in_deadline_order() {
    let mut t = table();
    // Grant order a, b, c, d; renew so that the deadlines are d < b < a < c.
    for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
        t.grant(ms(i as u64), rid(id), blocks(&[i as u32]), 1)
            .unwrap();
    }
    let _ = t.handle_heartbeat(ms(12_000), ["a"]); // 32 s
    let _ = t.handle_heartbeat(ms(11_000), ["b"]); // 31 s
    let _ = t.handle_heartbeat(ms(13_000), ["c"]); // 33 s
    // d keeps 30.003 s.
    // Not due yet: poll_timeout may be early, but nothing is released.
    let early = t.poll_timeout().unwrap();
    assert!(early <= ms(30_003));
    assert_eq!(t.handle_timeout(ms(30_002)), 0);
    assert_eq!(t.handle_timeout(ms(40_000)), 4);
    let order: Vec<_> = drain(&mut t)
        .into_iter()
        .map(|r| (r.request.to_string(), r.expiry))
        .collect();
    assert_eq!(
        order,
        [
            ("d".to_string(), ms(30_003)),
            ("b".to_string(), ms(31_000)),
            ("a".to_string(), ms(32_000)),
            ("c".to_string(), ms(33_000)),
        ]
    );
    assert!(t.is_empty());
    assert_eq!(t.poll_timeout(), None);
}

#[test]
fn poll_timeout_is_never_later_than_the_earliest_expiry() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    t.grant(ms(0), rid("b"), blocks(&[2]), 1).unwrap();
    let _ = t.handle_heartbeat(ms(20_000), ["a", "b"]); // both 40 s
    assert!(t.poll_timeout().unwrap() <= ms(40_000));
    // Calling the reaper at the early deadline files the real one.
    assert_eq!(t.handle_timeout(t.poll_timeout().unwrap()), 0);
    assert_eq!(t.poll_timeout(), Some(ms(40_000)));
    assert_eq!(t.handle_timeout(ms(40_000)), 2);
}

#[test]
fn sub_six_second_lease_renews_and_expires_on_a_fine_grid() {
    // 1.5 s lease: interval 250 ms, extension 1 s.
    let mut t = LeaseTable::new(LeaseConfig::from_secs_f64(1.5).unwrap());
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    let mut now = 0;
    while now < 10_000 {
        now += 250;
        let _ = t.handle_heartbeat(ms(now), ["a"]);
        assert_eq!(t.handle_timeout(ms(now)), 0, "at {now} ms");
    }
    assert_eq!(t.get(&rid("a")).unwrap().expiry, ms(11_000));
    // D dies: released one extension after the last heartbeat.
    assert_eq!(t.handle_timeout(ms(10_999)), 0);
    assert_eq!(t.handle_timeout(ms(11_000)), 1);
    assert_eq!(drain(&mut t)[0].last_heartbeat, Some(ms(10_000)));
}

#[test]
fn completion_of_an_expired_unreaped_lease_releases_it_as_completed() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    assert_eq!(
        t.handle_read_complete(ms(30_500), &rid("a"), consumer(0), None),
        ReadCompleteOutcome::Released
    );
    assert_eq!(drain(&mut t)[0].reason, ReleaseReason::Completed);
    assert_eq!(t.handle_timeout(ms(31_000)), 0);
}

#[test]
fn heap_is_compacted_under_churn() {
    let mut t = table();
    t.grant(ms(0), rid("keep"), blocks(&[0]), 1).unwrap();
    for i in 0..10_000u32 {
        let id = rid(&format!("r{i}"));
        t.grant(ms(1), id.clone(), blocks(&[i]), 1).unwrap();
        assert!(t.abort(ms(2), &id));
    }
    let _ = drain(&mut t);
    assert!(t.heap.len() <= 2 * t.len() + 1025, "{}", t.heap.len());
    assert_eq!(t.handle_timeout(ms(30_000)), 1);
    assert!(t.is_empty());
}

#[test]
fn slots_are_reused_and_stale_heap_entries_never_release_the_new_lease() {
    let mut t = table();
    t.grant(ms(0), rid("a"), blocks(&[1]), 1).unwrap();
    assert!(t.abort(ms(1), &rid("a")));
    // Same slot, later deadline. The stale 30 s entry must not release it.
    t.grant(ms(10_000), rid("b"), blocks(&[2]), 1).unwrap();
    assert_eq!(t.slots.len(), 1);
    assert_eq!(t.handle_timeout(ms(30_000)), 0);
    assert!(t.get(&rid("b")).is_some());
    assert_eq!(t.handle_timeout(ms(40_000)), 1);
    let r = drain(&mut t);
    assert_eq!(r.last().unwrap().request, rid("b"));
}

#[test]
fn lease_entry_stays_small() {
    // The per-lease memory budget (256 B with the index, heap entry and id) needs this.
    assert!(size_of::<Slot>() <= 64, "{}", size_of::<Slot>());
    // One cache line holds two, and none straddles a line.
    assert_eq!((size_of::<Hot>(), align_of::<Hot>()), (32, 32));
    assert_eq!(size_of::<Due>(), 24);
}

/// A reader that heartbeats a lease every interval but never reads it used to keep its
/// blocks for as long as it kept sending. With a maximum lifetime of 10 s (30 s leases),
/// the reaper releases it at grant + 10 s whatever the heartbeats say, flagged
/// `at_max_lifetime`; `poll_timeout` is never later than that; a lease left to expire
/// before its cap is an ordinary expiry.
#[test]
fn heartbeats_never_keep_a_lease_past_its_max_lifetime() {
    let config = LeaseConfig::from_duration(Duration::from_secs(3))
        .unwrap()
        .with_max_lifetime(Duration::from_secs(10))
        .unwrap();
    let mut t = LeaseTable::new(config);
    t.grant(ms(1_000), rid("pinned"), blocks(&[1, 2]), 1)
        .unwrap();
    t.grant(ms(1_000), rid("quiet"), blocks(&[3]), 1).unwrap();
    let mut released = Vec::new();
    for now in (1_500..=20_000).step_by(500) {
        t.handle_heartbeat(ms(now), ["pinned"]);
        assert!(
            t.poll_timeout().is_none_or(|due| due <= ms(11_000)),
            "at {now}: due {:?}",
            t.poll_timeout()
        );
        if t.poll_timeout().is_some_and(|due| due <= ms(now)) {
            t.handle_timeout(ms(now));
        }
        released.extend(drain(&mut t).into_iter().map(|r| (now, r)));
    }
    let got: Vec<(u64, &str, bool, Timestamp)> = released
        .iter()
        .map(|(now, r)| (*now, r.request.as_str(), r.at_max_lifetime, r.expiry))
        .collect();
    assert_eq!(
        got,
        [
            (4_000, "quiet", false, ms(4_000)),
            (11_000, "pinned", true, ms(11_000)),
        ]
    );
    assert!(
        released
            .iter()
            .all(|(_, r)| r.reason == ReleaseReason::Expired)
    );
    assert_eq!(t.stats().released_at_max_lifetime, 1);
    assert_eq!(t.stats().released_expired, 2);
    assert!(t.is_empty());
}
