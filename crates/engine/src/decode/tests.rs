use std::ops::Range;
use std::time::Duration;

use kvlease_lease::{Generation, LeaseConfig};
use kvlease_notif::ExpiredLease;

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

/// D with TP 2 over 4 heads, 16-token blocks, 8 blocks.
fn core() -> DecodeCore {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    DecodeCore::new(DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease).with_limits(1, 2))
}

fn remote(req: &str, p_tp: u32, blocks: u32) -> RemoteKv {
    RemoteKv::new(
        engine("p"),
        id(req),
        (0..blocks).map(BlockId).collect(),
        7,
        p_tp,
        blocks * 16,
        "127.0.0.1".into(),
        1,
    )
}

fn ready(c: &mut DecodeCore, now: Timestamp, p_tp: u32) {
    let hs = c.poll_handshake().unwrap();
    assert_eq!(hs.engine, engine("p"));
    c.handle_handshake(now, &engine("p"), Ok(RemoteEngine::new(p_tp, 64)));
}

fn finished(c: &mut DecodeCore) -> Vec<(RequestId, Outcome)> {
    std::iter::from_fn(|| c.poll_event())
        .filter_map(|e| match e {
            DecodeEvent::Finished { request, outcome } => Some((request, outcome)),
            _ => None,
        })
        .collect()
}

fn transmits(c: &mut DecodeCore, now: Timestamp) -> Vec<Transmit> {
    std::iter::from_fn(|| c.poll_transmit(now)).collect()
}

#[test]
fn heartbeats_wait_for_the_handshake_then_go_at_once() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 32, remote("ra", 2, 2))
        .unwrap();
    assert!(
        transmits(&mut c, at(0)).is_empty(),
        "deferred: still handshaking"
    );
    assert_eq!(c.stats().deferred_batches, 1);
    ready(&mut c, at(1), 2);
    let t = transmits(&mut c, at(1));
    assert!(matches!(
        &t[..],
        [Transmit {
            kind: TransmitKind::Heartbeat { ids: 1 },
            workers: 2,
            ..
        }]
    ));
    assert!(
        transmits(&mut c, at(2)).is_empty(),
        "throttled to one batch per interval"
    );
}

#[test]
fn heterogeneous_tp_plans_one_consumer_per_overlapping_pair() {
    // D TP 2 reading P TP 4: each D worker overlaps two P workers.
    let mut c = core();
    c.on_new_request(at(0), id("a"), 32, remote("ra", 4, 2))
        .unwrap();
    ready(&mut c, at(0), 4);
    let plan = c.poll_load().unwrap();
    assert_eq!(plan.batches.len(), 4);
    let pairs: Vec<(u32, u32)> = plan
        .batches
        .iter()
        .map(|b| (b.d_worker, b.p_rank))
        .collect();
    assert_eq!(pairs, [(0, 0), (0, 1), (1, 2), (1, 3)]);
    assert_eq!(plan.batches[3].heads, 3..4);
    // P TP 1: both D workers read P worker 0.
    let mut c = core();
    c.on_new_request(at(0), id("b"), 16, remote("rb", 1, 1))
        .unwrap();
    ready(&mut c, at(0), 1);
    let plan = c.poll_load().unwrap();
    let pairs: Vec<(u32, u32)> = plan
        .batches
        .iter()
        .map(|b| (b.d_worker, b.p_rank))
        .collect();
    assert_eq!(pairs, [(0, 0), (1, 0)]);
}

#[test]
fn a_good_load_verifies_decodes_and_ends_done_once() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 32, remote("ra", 2, 2))
        .unwrap();
    ready(&mut c, at(0), 2);
    let plan = c.poll_load().unwrap();
    assert_eq!(c.blocks_allocated(), 2);
    for i in 0..plan.batches.len() {
        c.handle_batch_done(&id("a"), i, BatchResult::Done { bytes: 10 });
    }
    let loaded =
        std::iter::from_fn(|| c.poll_event()).find(|e| matches!(e, DecodeEvent::Loaded { .. }));
    assert!(matches!(
        loaded,
        Some(DecodeEvent::Loaded { bytes: 20, .. })
    ));
    assert_eq!(c.tracked(), 0, "tracking stops when the transfer completes");
    c.handle_verified(&id("a"), Ok(()));
    assert!(c.request_finished(&id("a")));
    assert!(!c.request_finished(&id("a")));
    let f = finished(&mut c);
    assert!(matches!(&f[..], [(_, Outcome::Done)]));
    assert!(c.is_idle());
}

#[test]
fn a_stale_batch_fails_the_request_and_frees_p() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    transmits(&mut c, at(0));
    let plan = c.poll_load().unwrap();
    c.handle_batch_done(&id("a"), 0, BatchResult::Done { bytes: 1 });
    c.handle_batch_done(&id("a"), 1, BatchResult::Stale);
    let f = finished(&mut c);
    assert!(matches!(
        &f[..],
        [(_, Outcome::Failed(LoadError::Stale { p_rank: 1 }))]
    ));
    let t = transmits(&mut c, at(1));
    assert!(t.iter().any(|t| t.kind == TransmitKind::Abort));
    assert_eq!(plan.batches.len(), 2);
    assert!(c.is_idle());
}

#[test]
fn abort_while_loading_answers_once_and_frees_after_the_reads() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    c.poll_load().unwrap();
    assert!(c.abort(&id("ra")), "by P's id");
    assert!(!c.abort(&id("a")), "answered already");
    assert_eq!(c.blocks_allocated(), 1, "the transport still writes");
    c.handle_batch_done(&id("a"), 0, BatchResult::Done { bytes: 1 });
    c.handle_batch_done(&id("a"), 1, BatchResult::Done { bytes: 1 });
    assert!(c.is_idle());
    let f = finished(&mut c);
    assert!(matches!(&f[..], [(_, Outcome::Aborted)]));
}

#[test]
fn expiry_notices_fail_waiting_requests_only_from_their_engine() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    c.on_new_request(at(0), id("b"), 16, remote("rb", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    c.poll_load().unwrap(); // a loads, b waits (max_running 1)
    let notice = |req: &str| {
        kvlease_notif::encode_expired(
            &[ExpiredLease {
                request: id(req),
                generation: Generation(std::num::NonZeroU64::new(7).unwrap()),
            }],
            kvlease_notif::MAX_NOTIF_LEN,
        )
        .unwrap()
        .remove(0)
    };
    assert_eq!(
        c.handle_notif(&engine("evil"), &notice("rb")),
        DecodeNotif::Foreign
    );
    assert!(finished(&mut c).is_empty());
    let out = c.handle_notif(&engine("p"), &notice("rb"));
    assert_eq!(
        out,
        DecodeNotif::Expired {
            leases: 1,
            failed: 1
        }
    );
    let out = c.handle_notif(&engine("p"), &notice("ra"));
    assert_eq!(
        out,
        DecodeNotif::Expired {
            leases: 1,
            failed: 0
        },
        "in flight: the fence decides"
    );
    let f = finished(&mut c);
    assert!(matches!(&f[..], [(r, Outcome::Failed(LoadError::Expired { .. }))] if r == &id("b")));
}

#[test]
fn refusals_with_valid_coordinates_tell_a_connected_p() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    transmits(&mut c, at(0));
    let e = c
        .on_new_request(at(1), id("b"), 17, remote("rb", 2, 1))
        .unwrap_err();
    assert!(matches!(e, AdmitError::TokenCount { .. }));
    assert_eq!(e.field(), Some("kvlease_num_tokens"));
    let mut bad = remote("rc", 2, 1);
    bad.blocks = vec![BlockId(64)];
    let e = c.on_new_request(at(1), id("c"), 16, bad).unwrap_err();
    assert!(matches!(
        e,
        AdmitError::BlockOutOfRange {
            block: 64,
            pool: 64
        }
    ));
    c.on_new_request(at(1), id("d"), 16, remote("rd", 2, 1))
        .unwrap();
    let e = c
        .on_new_request(at(1), id("e"), 16, remote("re", 2, 1))
        .unwrap_err();
    assert!(matches!(e, AdmitError::QueueFull { max: 2 }));
    let aborts = transmits(&mut c, at(1))
        .into_iter()
        .filter(|t| t.kind == TransmitKind::Abort)
        .count();
    assert_eq!(aborts, 3);
    // A duplicate never aborts: the lease is the running request's.
    let e = c
        .on_new_request(at(1), id("a"), 16, remote("ra", 2, 1))
        .unwrap_err();
    assert!(matches!(e, AdmitError::Duplicate { .. }));
    assert!(transmits(&mut c, at(1)).is_empty());
}

#[test]
fn a_failed_handshake_fails_its_requests_and_the_next_one_retries() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    c.poll_handshake().unwrap();
    let cause: Cause = Arc::new(std::io::Error::other("refused"));
    c.handle_handshake(at(1), &engine("p"), Err(HandshakeError::Connect(cause)));
    let f = finished(&mut c);
    assert!(matches!(&f[..], [(_, Outcome::Failed(e))] if e.is_retryable()));
    assert!(c.is_idle());
    c.on_new_request(at(2), id("b"), 16, remote("rb", 2, 1))
        .unwrap();
    assert!(c.poll_handshake().is_some());
}

#[test]
fn a_handshake_whose_tp_size_cannot_split_the_heads_fails_like_a_refused_one() {
    for bad_tp in [0, 3, u32::MAX] {
        let mut c = core();
        c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
            .unwrap();
        c.poll_handshake().unwrap();
        c.handle_handshake(at(1), &engine("p"), Ok(RemoteEngine::new(bad_tp, 64)));
        assert!(c.poll_load().is_none(), "tp {bad_tp}");
        let f = finished(&mut c);
        assert!(
            matches!(
                &f[..],
                [(_, Outcome::Failed(LoadError::Handshake {
                    source: HandshakeError::TpSize { p_tp, .. },
                    ..
                }))] if *p_tp == bad_tp
            ),
            "tp {bad_tp}: {f:?}"
        );
        assert!(c.is_idle());
        c.on_new_request(at(2), id("b"), 16, remote("rb", 2, 1))
            .unwrap();
        assert!(c.poll_handshake().is_some(), "tp {bad_tp}");
    }
}

#[test]
fn a_lost_engine_fails_waiting_requests_and_handshakes_again() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    c.on_new_request(at(0), id("b"), 16, remote("rb", 2, 1))
        .unwrap();
    c.poll_load().unwrap();
    c.forget_engine(&engine("p"));
    let f = finished(&mut c);
    assert!(matches!(&f[..], [(r, Outcome::Failed(LoadError::PeerLost { .. }))] if r == &id("b")));
    c.on_new_request(at(1), id("c"), 16, remote("rc", 2, 1))
        .unwrap();
    assert!(c.poll_handshake().is_some());
}

/// A connected engine at instance 100 with request `a` loading and `b` waiting.
fn connected_at_100() -> DecodeCore {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let mut c =
        DecodeCore::new(DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease).with_limits(1, 8));
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1).with_instance(100))
        .unwrap();
    let hs = c.poll_handshake().unwrap();
    assert_eq!(hs.check_instance, None, "a first handshake");
    c.handle_handshake(
        at(0),
        &hs.engine,
        Ok(RemoteEngine::new(2, 64).with_instance(100)),
    );
    c.on_new_request(at(1), id("b"), 16, remote("rb", 2, 1).with_instance(100))
        .unwrap();
    c.poll_load().unwrap(); // a loads; b waits
    c
}

#[test]
fn a_restarted_p_is_found_by_a_check_of_its_side_channel() {
    let mut c = connected_at_100();
    // A request names a newer instance: D keeps its connection and asks P.
    c.on_new_request(at(2), id("c"), 16, remote("rc", 2, 1).with_instance(200))
        .unwrap();
    assert!(
        c.is_ready(&engine("p")),
        "the connection stays until P says otherwise"
    );
    assert!(finished(&mut c).is_empty());
    let hs = c.poll_handshake().expect("a check");
    assert_eq!(hs.check_instance, Some(100));
    assert_eq!(c.stats().instance_checks, 1);
    // P's side channel announces 200: P restarted.
    c.handle_handshake(
        at(3),
        &hs.engine,
        Ok(RemoteEngine::new(2, 64).with_instance(200)),
    );
    assert_eq!(c.stats().peer_restarts, 1);
    let f = finished(&mut c);
    assert!(
        matches!(&f[..], [(r, Outcome::Failed(e @ LoadError::PeerLost { .. }))] if r == &id("b") && e.is_retryable()),
        "{f:?}"
    );
    // Old-instance params arriving late are refused, retryably.
    let e = c
        .on_new_request(at(4), id("d"), 16, remote("rd", 2, 1).with_instance(100))
        .unwrap_err();
    assert!(matches!(e, AdmitError::StaleInstance { .. }) && e.is_retryable());
    assert_eq!(c.poll_load().map(|p| p.request), None, "a is still running");
}

#[test]
fn a_request_naming_an_instance_p_does_not_have_never_drops_the_connection() {
    let mut c = connected_at_100();
    c.on_new_request(at(2), id("c"), 16, remote("rc", 2, 1).with_instance(101))
        .unwrap();
    let hs = c.poll_handshake().expect("a check");
    // While the check runs, requests of the connected instance still load, and one more
    // naming the newer instance waits for the same check.
    c.on_new_request(at(3), id("d"), 16, remote("rd", 2, 1).with_instance(101))
        .unwrap();
    assert!(c.poll_handshake().is_none(), "one check at a time");
    c.handle_handshake(
        at(4),
        &hs.engine,
        Ok(RemoteEngine::new(2, 64).with_instance(100)),
    );
    assert!(c.is_ready(&engine("p")));
    assert_eq!(c.stats().peer_restarts, 0);
    let f = finished(&mut c);
    let ids: Vec<&RequestId> = f.iter().map(|(r, _)| r).collect();
    assert_eq!(ids, [&id("c"), &id("d")]);
    for (_, o) in &f {
        assert!(
            matches!(o, Outcome::Failed(e @ LoadError::UnknownInstance { theirs: 101, current: 100, .. }) if !e.is_retryable()),
            "{o:?}"
        );
    }
    assert!(
        c.is_waiting(&id("b")),
        "b of the connected instance still waits"
    );
    // A second claim within the interval is refused, retryably, without a check...
    let e = c
        .on_new_request(at(500), id("e"), 16, remote("re", 2, 1).with_instance(102))
        .unwrap_err();
    assert!(matches!(e, AdmitError::InstanceUnconfirmed { .. }) && e.is_retryable());
    assert!(c.poll_handshake().is_none());
    // ...and checked once the interval has passed; a failed check keeps the connection.
    c.on_new_request(at(1100), id("f"), 16, remote("rf", 2, 1).with_instance(102))
        .unwrap();
    let hs = c.poll_handshake().expect("a second check");
    let gone = HandshakeError::NotFound(Arc::new(std::io::Error::other("refused")));
    c.handle_handshake(at(1200), &hs.engine, Err(gone));
    assert!(c.is_ready(&engine("p")));
    let f = finished(&mut c);
    assert!(
        matches!(&f[..], [(r, Outcome::Failed(LoadError::Handshake { .. }))] if r == &id("f")),
        "{f:?}"
    );
    assert_eq!(c.stats().instance_checks, 2);
}

#[test]
fn idle_engines_make_room_for_new_ones_and_busy_ones_do_not() {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let mut c = DecodeCore::new(
        DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease)
            .with_limits(4, 8)
            .with_max_engines(2),
    );
    let on = |e: &str, req: &str| {
        let mut r = remote(req, 2, 1);
        r.engine = engine(e);
        r
    };
    let load = |c: &mut DecodeCore, e: &str, req: &str, t: u64| {
        c.on_new_request(at(t), id(req), 16, on(e, req)).unwrap();
        if let Some(hs) = c.poll_handshake() {
            c.handle_handshake(at(t), &hs.engine, Ok(RemoteEngine::new(2, 64)));
        }
        let plan = c.poll_load().unwrap();
        for i in 0..plan.batches.len() {
            c.handle_batch_done(&id(req), i, BatchResult::Done { bytes: 1 });
        }
        let _ = std::iter::from_fn(|| c.poll_event()).count();
        c.handle_verified(&id(req), Ok(()));
        assert!(c.request_finished(&id(req)));
    };
    load(&mut c, "p1", "a", 1);
    load(&mut c, "p2", "b", 2);
    // p1 was used longest ago: a request for p3 drops it.
    c.on_new_request(at(3), id("c"), 16, on("p3", "c")).unwrap();
    let dropped: Vec<EngineId> = std::iter::from_fn(|| c.poll_event())
        .filter_map(|e| match e {
            DecodeEvent::EngineDropped { engine } => Some(engine),
            _ => None,
        })
        .collect();
    assert_eq!(dropped, [engine("p1")]);
    assert_eq!((c.engines(), c.stats().engines_evicted), (2, 1));
    // p3 handshakes and p2 gets a waiting request: no engine is idle now.
    c.on_new_request(at(4), id("d"), 16, on("p2", "d")).unwrap();
    let e = c
        .on_new_request(at(5), id("e"), 16, on("p4", "e"))
        .unwrap_err();
    assert!(matches!(e, AdmitError::TooManyEngines { max: 2 }) && e.is_retryable());
    assert_eq!(c.engines(), 2);
}

#[test]
fn a_handshake_with_a_newer_instance_fails_requests_of_the_old_one() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1).with_instance(100))
        .unwrap();
    let hs = c.poll_handshake().unwrap();
    c.handle_handshake(
        at(1),
        &hs.engine,
        Ok(RemoteEngine::new(2, 64).with_instance(200)),
    );
    let f = finished(&mut c);
    assert!(matches!(
        &f[..],
        [(_, Outcome::Failed(LoadError::PeerLost { .. }))]
    ));
    assert!(c.is_idle());
}

#[test]
fn a_request_arriving_after_the_last_one_was_read_is_heartbeated_within_an_interval() {
    let lease = LeaseConfig::from_duration(Duration::from_millis(1500)).unwrap();
    let mut c = DecodeCore::new(
        DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease)
            .with_limits(1, 8)
            .with_retry(Duration::from_millis(40)),
    );
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(10), 2);
    assert_eq!(transmits(&mut c, at(10)).len(), 1);
    let plan = c.poll_load().unwrap();
    for i in 0..plan.batches.len() {
        c.handle_batch_done(&id("a"), i, BatchResult::Done { bytes: 1 });
    }
    let _ = std::iter::from_fn(|| c.poll_event()).count();
    c.handle_verified(&id("a"), Ok(()));
    c.on_new_request(at(200), id("b"), 16, remote("rb", 2, 1))
        .unwrap();
    let mut sent = Vec::new();
    for t in (200..1200).step_by(40) {
        sent.extend(transmits(&mut c, at(t)).into_iter().map(|_| t));
    }
    assert!(
        !sent.is_empty() && sent[0] <= 10 + 250 + 40,
        "heartbeats at {sent:?}"
    );
}

/// D with TP 2 over 4 heads, 16-token blocks, 8 blocks that vLLM allocates.
fn external_core() -> DecodeCore {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    DecodeCore::new(
        DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease)
            .with_limits(1, 4)
            .with_block_source(BlockSource::External),
    )
}

#[test]
fn external_blocks_load_what_the_engine_allocated_past_its_prefix_hit() {
    let mut c = external_core();
    c.on_new_request(at(0), id("a"), 48, remote("ra", 2, 3))
        .unwrap();
    assert!(c.is_waiting(&id("a")));
    assert_eq!(
        c.start_load(&id("a"), vec![BlockId(6)], 2),
        Err(StartLoadError::NotReady {
            engine: engine("p")
        })
    );
    ready(&mut c, at(1), 2);
    assert!(
        c.poll_load().is_none(),
        "the engine schedules, not the core"
    );
    // A local prefix hit covered P's first block: 2 blocks to load.
    assert_eq!(
        c.start_load(&id("a"), vec![BlockId(6)], 1),
        Err(StartLoadError::BlockCount { got: 1, need: 2 })
    );
    let plan = c
        .start_load(&id("a"), vec![BlockId(6), BlockId(3)], 1)
        .unwrap();
    assert_eq!(plan.blocks, [BlockId(6), BlockId(3)]);
    assert_eq!(plan.skip_blocks, 1);
    assert_eq!(
        plan.remote.blocks.len(),
        3,
        "the fence still names P's first block"
    );
    assert_eq!(plan.batches.len(), 2);
    assert_eq!(c.blocks_allocated(), 2);
    assert!(!c.is_waiting(&id("a")));
    assert!(matches!(
        c.start_load(&id("a"), vec![BlockId(6), BlockId(3)], 1),
        Err(StartLoadError::NotWaiting { .. })
    ));
    // A second request is not held back by max_running: vLLM schedules.
    c.on_new_request(at(1), id("b"), 16, remote("rb", 2, 1))
        .unwrap();
    c.start_load(&id("b"), vec![BlockId(0)], 0).unwrap();

    for batch in 0..2 {
        c.handle_batch_done(&id("a"), batch, BatchResult::Done { bytes: 10 });
    }
    let loaded =
        std::iter::from_fn(|| c.poll_event()).find(|e| matches!(e, DecodeEvent::Loaded { .. }));
    assert!(matches!(
        loaded,
        Some(DecodeEvent::Loaded { bytes: 20, .. })
    ));
    c.handle_verified(&id("a"), Ok(()));
    assert!(c.request_finished(&id("a")));
    assert_eq!(
        c.blocks_allocated(),
        1,
        "only b's block is still the core's"
    );
    // A stale read of b ends it; the engine gets its block back.
    c.handle_batch_done(&id("b"), 0, BatchResult::Stale);
    c.handle_batch_done(&id("b"), 1, BatchResult::Done { bytes: 1 });
    let ends = finished(&mut c);
    assert!(matches!(
        &ends[..],
        [(a, Outcome::Done), (b, Outcome::Failed(LoadError::Stale { .. }))]
            if *a == id("a") && *b == id("b")
    ));
    assert!(c.is_idle());
}

#[test]
fn a_pool_core_refuses_start_load() {
    let mut c = core();
    c.on_new_request(at(0), id("a"), 16, remote("ra", 2, 1))
        .unwrap();
    ready(&mut c, at(0), 2);
    assert_eq!(
        c.start_load(&id("a"), vec![BlockId(0)], 0),
        Err(StartLoadError::WrongBlockSource {
            core: BlockSource::Pool
        })
    );
    assert!(c.poll_load().is_some());
}

/// `(d_worker, p_rank, heads, d_first_head, p_first_head, consumer, consumers_total)`.
type BatchRow = (u32, u32, Range<u32>, u32, u32, u32, u32);

/// A [`BatchRow`] for every batch of a plan, the notification decoded.
fn batch_rows(plan: &LoadPlan) -> Vec<BatchRow> {
    plan.batches
        .iter()
        .map(|b| {
            let Ok(Notif::ReadComplete(rc)) = kvlease_notif::decode(&b.notif) else {
                panic!("a batch's notification is not a read completion");
            };
            assert_eq!(rc.request, plan.remote.request);
            (
                b.d_worker,
                b.p_rank,
                b.heads.clone(),
                b.d_first_head,
                b.p_first_head,
                rc.consumer.rank,
                rc.consumers_total,
            )
        })
        .collect()
}

fn plan_for(d_tp: u32, heads: u32, split: KvSplit, p_tp: u32) -> LoadPlan {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let mut c = DecodeCore::new(
        DecodeConfig::new(engine("d"), d_tp, heads, 16, 8, lease).with_kv_split(split),
    );
    c.on_new_request(at(0), id("a"), 32, remote("ra", p_tp, 2))
        .unwrap();
    ready(&mut c, at(0), p_tp);
    c.poll_load().unwrap()
}

#[test]
fn heterogeneous_tp_plans_name_both_sides_first_heads_and_count_every_reader() {
    // P TP 2 -> D TP 1 (4 heads): D's worker reads heads 0..2 from P rank 0 and 2..4
    // from P rank 1, each landing at its global place in D's block.
    assert_eq!(
        batch_rows(&plan_for(1, 4, KvSplit::Heads, 2)),
        [(0, 0, 0..2, 0, 0, 0, 2), (0, 1, 2..4, 0, 2, 1, 2)]
    );
    // P TP 1 -> D TP 2: both D workers read their half of P rank 0's heads.
    assert_eq!(
        batch_rows(&plan_for(2, 4, KvSplit::Heads, 1)),
        [(0, 0, 0..2, 0, 0, 0, 2), (1, 0, 2..4, 2, 0, 1, 2)]
    );
}

#[test]
fn a_replicated_kv_is_read_once_per_d_worker_from_one_p_rank() {
    // MLA (one latent "head", on every rank). P TP 2 -> D TP 1: one batch, from P rank
    // 0 only, and the lease expects exactly that one reader.
    assert_eq!(
        batch_rows(&plan_for(1, 1, KvSplit::Replicated, 2)),
        [(0, 0, 0..1, 0, 0, 0, 1)]
    );
    // P TP 1 -> D TP 2: each D worker reads P rank 0's whole cache once.
    assert_eq!(
        batch_rows(&plan_for(2, 1, KvSplit::Replicated, 1)),
        [(0, 0, 0..1, 0, 0, 0, 2), (1, 0, 0..1, 0, 0, 1, 2)]
    );
    // P TP 4 -> D TP 2: D's workers spread over P's ranks (0 and 2), one read each.
    assert_eq!(
        batch_rows(&plan_for(2, 1, KvSplit::Replicated, 4)),
        [(0, 0, 0..1, 0, 0, 0, 2), (1, 2, 0..1, 0, 0, 6, 2)]
    );
    // Split by head, 1 head cannot go over P TP 2; replicated, any P TP fits.
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let mut c = DecodeCore::new(DecodeConfig::new(engine("d"), 1, 1, 16, 8, lease));
    assert!(matches!(
        c.on_new_request(at(0), id("a"), 32, remote("ra", 2, 2)),
        Err(AdmitError::TpSize { p_tp: 2, heads: 1 })
    ));
}

// ------------------------------------------------------------------ held turns

/// A core keeping finished turns for `ttl_ms` (the symmetric lease when `symmetric`), with
/// `n` requests of `blocks` blocks each decoded and finished into held turns `turn-r<i>`,
/// at 10 ms apart.
fn holding(ttl_ms: u64, symmetric: bool, n: u32, blocks: u32) -> (DecodeCore, Vec<KeptTurn>) {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let ttl = kvlease_lease::DecoderTtl::from_duration(Duration::from_millis(ttl_ms)).unwrap();
    let mut c = DecodeCore::new(
        DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease)
            .with_limits(1, 4)
            .with_hold(ttl, symmetric),
    );
    let mut kept = Vec::new();
    for i in 0..n {
        let (req, now) = (format!("r{i}"), at(u64::from(i) * 10));
        c.on_new_request(
            now,
            id(&req),
            blocks as usize * 16,
            remote(&format!("p{i}"), 2, blocks),
        )
        .unwrap();
        if i == 0 {
            ready(&mut c, now, 2);
        }
        let plan = c.poll_load().unwrap();
        for b in 0..plan.batches.len() {
            c.handle_batch_done(&id(&req), b, BatchResult::Done { bytes: 1 });
        }
        c.handle_verified(&id(&req), Ok(()));
        kept.push(c.request_finished_hold(now, &id(&req)).unwrap());
    }
    assert_eq!(
        finished(&mut c).len(),
        n as usize,
        "every request ended done"
    );
    (c, kept)
}

fn released(c: &mut DecodeCore) -> Vec<(String, TurnEnd, usize)> {
    std::iter::from_fn(|| c.poll_turn_released())
        .map(|r| (r.turn.to_string(), r.end, r.blocks.len()))
        .collect()
}

fn read_complete(turn: &str) -> Vec<u8> {
    kvlease_notif::ReadComplete {
        request: id(turn),
        consumer: ConsumerId::new(engine("p"), 0),
        consumers_total: 1,
    }
    .encode()
}

#[test]
fn a_finished_turn_is_held_until_pulled_and_its_blocks_return_only_when_handed_out() {
    let (mut c, kept) = holding(10_000, false, 1, 2);
    let k = &kept[0];
    assert_eq!(k.turn, id("turn-r0"));
    assert_eq!(
        (k.blocks.len(), k.ttl, k.renew_extension),
        (2, Duration::from_secs(10), None)
    );
    assert_eq!((c.blocks_allocated(), c.turn_blocks_held()), (2, 2));
    assert!(!c.is_idle(), "held blocks stay allocated");
    let n = c.handle_notif_at(at(50), &engine("p"), &read_complete("turn-r0"));
    assert_eq!(n, DecodeNotif::CacheReadComplete(id("turn-r0")));
    assert_eq!(c.turn_blocks_held(), 0);
    assert_eq!(
        c.blocks_allocated(),
        2,
        "not free before the shell clears the fences"
    );
    assert_eq!(released(&mut c), [("turn-r0".into(), TurnEnd::Pulled, 2)]);
    assert!(c.is_idle());
    assert_eq!((c.stats().turns_held, c.stats().turns_pulled), (1, 1));
    // A second completion changes nothing.
    c.handle_notif_at(at(60), &engine("p"), &read_complete("turn-r0"));
    assert!(released(&mut c).is_empty());
}

#[test]
fn held_turns_give_way_oldest_first_to_a_request_short_of_blocks_then_expire() {
    // 8 blocks: two turns of 3 held, 2 free; a request of 4 needs one turn to go.
    let (mut c, _) = holding(10_000, false, 2, 3);
    c.on_new_request(at(30), id("new"), 64, remote("pn", 2, 4))
        .unwrap();
    assert_eq!(c.blocks_short(), Some(2));
    c.handle_timeout(at(30));
    // Not yet free: the fences come first.
    assert!(c.poll_load().is_none());
    assert_eq!(released(&mut c), [("turn-r0".into(), TurnEnd::Evicted, 3)]);
    c.handle_timeout(at(30));
    assert!(released(&mut c).is_empty(), "one turn was enough");
    let plan = c.poll_load().expect("room now");
    assert_eq!(plan.blocks.len(), 4);
    // The other turn ends at its deadline (held at 10 ms for 10 s), not before.
    c.handle_timeout(at(10_009));
    assert!(released(&mut c).is_empty());
    c.handle_timeout(at(10_010));
    assert_eq!(released(&mut c), [("turn-r1".into(), TurnEnd::Expired, 3)]);
    let s = c.stats();
    assert_eq!((s.turns_evicted, s.turns_expired), (1, 1));
}

#[test]
fn heartbeats_extend_a_symmetric_hold_and_not_a_fixed_one() {
    let hb = kvlease_notif::encode_heartbeats([&id("turn-r0")], kvlease_notif::MAX_NOTIF_LEN)
        .unwrap()
        .remove(0);
    for symmetric in [false, true] {
        let (mut c, kept) = holding(6_000, symmetric, 1, 1);
        assert_eq!(kept[0].renew_extension.is_some(), symmetric);
        let n = c.handle_notif_at(at(5_000), &engine("p"), &hb);
        assert_eq!(n, DecodeNotif::CacheHeartbeat(vec![id("turn-r0")]));
        c.handle_timeout(at(6_000));
        let gone = released(&mut c);
        if symmetric {
            assert!(gone.is_empty(), "renewed past its first deadline");
            c.handle_timeout(at(60_000));
            assert_eq!(
                released(&mut c).len(),
                1,
                "a P that stops heartbeating loses it"
            );
        } else {
            assert_eq!(gone, [("turn-r0".into(), TurnEnd::Expired, 1)]);
        }
    }
}

#[test]
fn a_turn_the_shell_cannot_serve_is_dropped_and_a_core_without_hold_frees_at_once() {
    let (mut c, kept) = holding(10_000, false, 1, 2);
    assert!(c.drop_turn(at(20), &kept[0].turn));
    assert!(!c.drop_turn(at(20), &kept[0].turn));
    assert_eq!(released(&mut c), [("turn-r0".into(), TurnEnd::Dropped, 2)]);
    assert!(c.is_idle());

    let mut c = core();
    c.on_new_request(at(0), id("a"), 32, remote("ra", 2, 2))
        .unwrap();
    ready(&mut c, at(0), 2);
    let plan = c.poll_load().unwrap();
    assert_eq!(
        c.request_finished_hold(at(0), &id("a")),
        Err(HoldRefused::NotDecoding { request: id("a") }),
        "still loading: nothing changes"
    );
    for i in 0..plan.batches.len() {
        c.handle_batch_done(&id("a"), i, BatchResult::Done { bytes: 1 });
    }
    c.handle_verified(&id("a"), Ok(()));
    assert_eq!(
        c.request_finished_hold(at(0), &id("a")),
        Err(HoldRefused::NoHold)
    );
    assert!(matches!(&finished(&mut c)[..], [(_, Outcome::Done)]));
    assert!(c.is_idle());
}

/// The generations of the first `n` turns a core keeps (each pulled before the next), the
/// core's hold starting at `first` (`None`: the default).
fn hold_generations(symmetric: bool, first: Option<u64>, n: u32) -> Vec<u64> {
    let lease = LeaseConfig::from_duration(Duration::from_secs(3)).unwrap();
    let ttl = kvlease_lease::DecoderTtl::from_duration(Duration::from_secs(10)).unwrap();
    let mut config = DecodeConfig::new(engine("d"), 2, 4, 16, 8, lease)
        .with_limits(1, 4)
        .with_hold(ttl, symmetric);
    if let Some(first) = first {
        let first = Generation(std::num::NonZeroU64::new(first).unwrap());
        config = config.with_hold_first_generation(first);
    }
    let mut c = DecodeCore::new(config);
    let mut generations = Vec::new();
    for i in 0..n {
        let (req, now) = (format!("r{i}"), at(u64::from(i) * 10));
        c.on_new_request(now, id(&req), 32, remote(&format!("p{i}"), 2, 2))
            .unwrap();
        if i == 0 {
            ready(&mut c, now, 2);
        }
        let plan = c.poll_load().expect("every block free again");
        for b in 0..plan.batches.len() {
            c.handle_batch_done(&id(&req), b, BatchResult::Done { bytes: 1 });
        }
        c.handle_verified(&id(&req), Ok(()));
        let kept = c.request_finished_hold(now, &id(&req)).unwrap();
        generations.push(kept.generation.word());
        c.handle_notif_at(now, &engine("p"), &read_complete(kept.turn.as_str()));
        assert_eq!(released(&mut c).len(), 1);
    }
    generations
}

#[test]
fn restarted_cores_with_later_first_generations_never_repeat_a_hold_generation() {
    for symmetric in [false, true] {
        // Two instances of one D, the second started 1 s after the first (the agent's
        // instance: the wall clock in microseconds).
        let first = 1_765_000_000_000_000;
        let before = hold_generations(symmetric, Some(first), 64);
        let after = hold_generations(symmetric, Some(first + 1_000_000), 64);
        assert_eq!(
            before[0], first,
            "the first held turn gets the first generation"
        );
        assert!(
            before.windows(2).all(|w| w[0] < w[1]),
            "rising within an instance"
        );
        assert!(
            before.iter().all(|g| !after.contains(g)),
            "symmetric={symmetric}: a generation of the earlier instance came back"
        );
        // Without a first generation every instance starts at the same one: a pull with
        // an earlier instance's params could match a new turn on the same blocks.
        let (a, b) = (
            hold_generations(symmetric, None, 4),
            hold_generations(symmetric, None, 4),
        );
        assert_eq!(a, b);
    }
}
