//! Tests of the heartbeat tracker.

use std::time::Duration;

use super::*;

fn rid(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn eid(s: &str) -> EngineId {
    EngineId::new(s).unwrap()
}

fn ms(v: u64) -> Timestamp {
    Timestamp::from_millis(v)
}

/// 30 s leases: interval 5 s.
fn tracker() -> HeartbeatTracker {
    HeartbeatTracker::new(&LeaseConfig::default())
}

fn drain(t: &mut HeartbeatTracker, now: Timestamp) -> Vec<HeartbeatBatch> {
    std::iter::from_fn(|| t.poll_heartbeat(now)).collect()
}

fn sorted(mut v: Vec<RequestId>) -> Vec<RequestId> {
    v.sort();
    v
}

#[test]
fn new_engine_is_due_at_once_then_every_interval() {
    let mut t = tracker();
    assert_eq!(t.poll_timeout(), None);
    t.track(ms(1_000), rid("a"), eid("p0"), 4).unwrap();
    assert_eq!(t.poll_timeout(), Some(ms(1_000)));
    let b = drain(&mut t, ms(1_010));
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].engine.as_str(), b[0].workers), ("p0", 4));
    assert_eq!(b[0].requests, [rid("a")]);
    // A second request rides the engine's next batch, not an extra one.
    t.track(ms(2_000), rid("b"), eid("p0"), 4).unwrap();
    assert!(drain(&mut t, ms(2_000)).is_empty());
    assert_eq!(t.poll_timeout(), Some(ms(6_010)));
    assert!(drain(&mut t, ms(6_009)).is_empty());
    let b = drain(&mut t, ms(6_010));
    assert_eq!(b.len(), 1);
    assert_eq!(sorted(b[0].requests.clone()), [rid("a"), rid("b")]);
    // A late poll: the next batch is one interval after the poll, not after the due time.
    let b = drain(&mut t, ms(12_000));
    assert_eq!(b.len(), 1);
    assert_eq!(t.poll_timeout(), Some(ms(17_000)));
    assert_eq!(t.stats().batches, 3);
    assert_eq!(t.stats().batch_ids, 5);
}

#[test]
fn throttle_is_per_engine() {
    let mut t = tracker();
    t.track(ms(0), rid("a"), eid("p0"), 1).unwrap();
    assert_eq!(drain(&mut t, ms(0)).len(), 1);
    // A new engine seen 1 s later is heartbeated at once, not at p0's next slot.
    t.track(ms(1_000), rid("b"), eid("p1"), 2).unwrap();
    let b = drain(&mut t, ms(1_000));
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].engine.as_str(), b[0].workers), ("p1", 2));
    assert_eq!(t.engine_count(), 2);
    // Each keeps its own phase.
    let b = drain(&mut t, ms(5_000));
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].engine, eid("p0"));
    let b = drain(&mut t, ms(6_000));
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].engine, eid("p1"));
}

#[test]
fn untrack_is_swap_remove_and_keeps_positions_right() {
    let mut t = tracker();
    for i in 0..5 {
        t.track(ms(0), rid(&format!("r{i}")), eid("p0"), 1).unwrap();
    }
    assert!(t.untrack(&rid("r1")));
    assert!(!t.untrack(&rid("r1")));
    assert!(t.untrack(&rid("r4"))); // r4 was moved into r1's place
    assert!(t.untrack(&rid("r0")));
    assert_eq!(
        sorted(t.requests_of(&eid("p0")).to_vec()),
        [rid("r2"), rid("r3")]
    );
    assert_eq!(t.engine_of(&rid("r3")), Some(&eid("p0")));
    assert_eq!(t.engine_of(&rid("r4")), None);
    assert_eq!(t.len(), 2);
    let b = drain(&mut t, ms(0));
    assert_eq!(sorted(b[0].requests.clone()), [rid("r2"), rid("r3")]);
    assert_eq!(t.stats().untracked, 3);
}

#[test]
fn empty_engine_is_dropped_at_its_next_due_time_and_not_heartbeated_early() {
    let mut t = tracker();
    t.track(ms(0), rid("a"), eid("p0"), 1).unwrap();
    assert_eq!(drain(&mut t, ms(0)).len(), 1);
    assert!(t.untrack(&rid("a")));
    assert_eq!(t.engine_count(), 0);
    assert!(t.is_empty());
    // A new request for the same engine 1 s later waits for the engine's slot (5 s):
    // at most one batch per engine per interval.
    t.track(ms(1_000), rid("b"), eid("p0"), 1).unwrap();
    assert!(drain(&mut t, ms(1_000)).is_empty());
    assert_eq!(drain(&mut t, ms(5_000)).len(), 1);
    // Untracked again: at the due time the engine is dropped, no batch.
    assert!(t.untrack(&rid("b")));
    assert!(drain(&mut t, ms(10_000)).is_empty());
    assert_eq!(t.poll_timeout(), None);
    assert!(t.by_name.is_empty());
    // Seen again later: a new engine, due at once, in the reused slot.
    t.track(ms(20_000), rid("c"), eid("p0"), 1).unwrap();
    assert_eq!(drain(&mut t, ms(20_000)).len(), 1);
    assert_eq!(t.engines.len(), 1);
}

#[test]
fn defer_retries_later_without_losing_the_batch() {
    let mut t = tracker();
    t.track(ms(0), rid("a"), eid("p0"), 2).unwrap();
    let b = drain(&mut t, ms(0));
    assert_eq!(b.len(), 1);
    // No handshake yet: retry at the next step.
    assert!(t.defer(&b[0].engine, ms(20)));
    assert!(!t.defer(&eid("unknown"), ms(20)));
    assert_eq!(t.poll_timeout(), Some(ms(20)));
    assert!(drain(&mut t, ms(10)).is_empty());
    let b = drain(&mut t, ms(20));
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].requests, [rid("a")]);
    assert_eq!(t.poll_timeout(), Some(ms(5_020)));
    assert_eq!(t.stats().deferred, 1);
}

#[test]
fn track_errors_change_nothing() {
    let mut t = tracker();
    t.track(ms(0), rid("a"), eid("p0"), 1).unwrap();
    assert_eq!(
        t.track(ms(0), rid("a"), eid("p1"), 1),
        Err(TrackError::AlreadyTracked {
            request: rid("a"),
            engine: eid("p0")
        })
    );
    assert_eq!(
        t.track(ms(0), rid("b"), eid("p1"), 0),
        Err(TrackError::ZeroPeers {
            request: rid("b"),
            engine: eid("p1")
        })
    );
    assert_eq!((t.len(), t.engine_count()), (1, 1));
    assert!(t.requests_of(&eid("p1")).is_empty());
}

#[test]
fn worker_count_keeps_the_largest() {
    let mut t = tracker();
    t.track(ms(0), rid("a"), eid("p0"), 2).unwrap();
    t.track(ms(0), rid("b"), eid("p0"), 4).unwrap();
    t.track(ms(0), rid("c"), eid("p0"), 1).unwrap();
    assert_eq!(drain(&mut t, ms(0))[0].workers, 4);
}

#[test]
fn short_lease_interval() {
    // 1.5 s lease: a batch every 250 ms.
    let mut t = HeartbeatTracker::new(&LeaseConfig::from_secs_f64(1.5).unwrap());
    t.track(ms(0), rid("a"), eid("p0"), 1).unwrap();
    let mut sent = Vec::new();
    let mut now = ms(0);
    while now <= ms(1_000) {
        if t.poll_heartbeat(now).is_some() {
            sent.push(now);
        }
        now = now + Duration::from_millis(50);
    }
    assert_eq!(sent, [ms(0), ms(250), ms(500), ms(750), ms(1_000)]);
}
