use kvlease_lease::ClockOffsetEstimator;

use super::*;

const BS: u32 = 16;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed) % 251).collect()
}

/// D's params for a cached turn of `turn` tokens with a deadline `ttl` after D's `d_now`.
fn params(turn: &[u32], d_now: PeerTimestamp, ttl: Duration) -> DecoderKvParams {
    let blocks = turn.len().div_ceil(BS as usize) as u32;
    DecoderKvParams {
        kvlease_bidir: true,
        remote_engine_id: "d0".into(),
        remote_host: "127.0.0.1".into(),
        remote_port: 5601,
        kvlease_clock_port: 5602,
        remote_block_ids: (100..100 + blocks).collect(),
        remote_request_id: "cache-1".into(),
        tp_size: 1,
        kvlease_generation: 7,
        conversation_id: "conv".into(),
        kvlease_num_tokens: turn.len() as u32,
        kvlease_block_size: BS,
        kvlease_block_hashes: block_hashes(turn, BS)
            .iter()
            .map(|h| format!("{h:016x}"))
            .collect(),
        kvlease_deadline_ns: (d_now.as_duration() + ttl).as_nanos() as u64,
        kvlease_ttl_remaining: ttl,
        kvlease_renew_extension_ms: 0,
    }
}

fn policy(basis: DeadlineBasis) -> PullPolicy {
    PullPolicy {
        threshold_tokens: 64,
        safety_margin: Duration::from_secs(5),
        basis,
    }
}

fn secs(s: u64) -> Timestamp {
    Timestamp::from_duration(Duration::from_secs(s))
}

#[test]
fn extended_prompt_pulls_every_whole_cached_block() {
    let turn1 = tokens(100, 3); // 6 whole blocks + 4 tokens
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(40, 9));
    let p = params(
        &turn1,
        PeerTimestamp::from_millis(0),
        Duration::from_secs(60),
    );
    let d = plan_pull(
        &policy(DeadlineBasis::ClockOffset),
        &p,
        &turn2,
        BS,
        secs(0),
        Some(ClockOffset::from_nanos(0)),
        Duration::ZERO,
    );
    assert_eq!(
        d,
        PullDecision::Pull {
            blocks: (100..106).map(BlockId).collect(),
            tokens: 96,
            diverged: false,
        }
    );
}

#[test]
fn divergence_inside_the_prefix_pulls_only_common_whole_blocks_or_nothing() {
    let turn1 = tokens(160, 3); // 10 whole blocks
    let p = params(
        &turn1,
        PeerTimestamp::from_millis(0),
        Duration::from_secs(60),
    );
    let plan = |prompt: &[u32]| {
        plan_pull(
            &policy(DeadlineBasis::RelativeTtl),
            &p,
            prompt,
            BS,
            secs(0),
            None,
            Duration::ZERO,
        )
    };
    // Token 70 (block 4) changed: blocks 0..4 are common, 64 tokens, at the threshold.
    let mut t = turn1.clone();
    t[70] ^= 1;
    t.extend(tokens(20, 1));
    assert_eq!(
        plan(&t),
        PullDecision::Pull {
            blocks: (100..104).map(BlockId).collect(),
            tokens: 64,
            diverged: true,
        }
    );
    // Token 40 (block 2) changed: 32 common tokens, below the threshold of 64.
    let mut t = turn1.clone();
    t[40] ^= 1;
    assert_eq!(
        plan(&t),
        PullDecision::Recompute(RecomputeReason::BelowThreshold { shared_tokens: 32 })
    );
    // Same length, different tokens from the start (vLLM#43094): nothing in common.
    let other = tokens(160, 4);
    assert_eq!(other.len(), turn1.len());
    assert_eq!(
        plan(&other),
        PullDecision::Recompute(RecomputeReason::NoCommonBlock)
    );
    // A shorter prompt covers only its own whole blocks.
    assert_eq!(common_blocks(&p, &turn1[..70]), 4);
    // A different block size is never reused.
    assert_eq!(
        plan_pull(
            &policy(DeadlineBasis::RelativeTtl),
            &p,
            &turn1,
            32,
            secs(0),
            None,
            Duration::ZERO
        ),
        PullDecision::Recompute(RecomputeReason::BlockSizeMismatch)
    );
}

/// A sample as the probe takes it: P sends at `t0` (P's clock), D reads its clock
/// (P's + skew) after `one_way`, the answer arrives `one_way` later.
fn estimate(skew_ms: i64, t0: Timestamp, one_way: Duration) -> ClockOffset {
    let mut est = ClockOffsetEstimator::new();
    let mid = t0 + one_way;
    let remote_ns = mid.as_nanos_saturating() as i128 + i128::from(skew_ms) * 1_000_000;
    est.add_sample(
        t0,
        PeerTimestamp::from_nanos(remote_ns as u64),
        mid + one_way,
    )
    .expect("t1 after t0");
    est.offset().expect("one sample")
}

#[test]
fn ten_second_skew_either_way_gives_the_right_decision_with_the_offset_estimate() {
    let p_now = secs(1_000);
    for skew_ms in [-10_000i64, 10_000] {
        let d_now = ClockOffset::from_nanos(i128::from(skew_ms) * 1_000_000).to_peer(p_now);
        let est = estimate(
            skew_ms,
            p_now - Duration::from_millis(2),
            Duration::from_millis(1),
        );
        for (ttl, pulls) in [(8u64, true), (2, false), (60, true), (4, false)] {
            let turn1 = tokens(128, 5);
            let p = params(&turn1, d_now, Duration::from_secs(ttl));
            let offset = plan_pull(
                &policy(DeadlineBasis::ClockOffset),
                &p,
                &turn1,
                BS,
                p_now,
                Some(est),
                Duration::ZERO,
            );
            let relative = plan_pull(
                &policy(DeadlineBasis::RelativeTtl),
                &p,
                &turn1,
                BS,
                p_now,
                None,
                Duration::ZERO,
            );
            // Ignoring the skew (assuming equal clocks) is the bug the estimate avoids.
            let naive = plan_pull(
                &policy(DeadlineBasis::ClockOffset),
                &p,
                &turn1,
                BS,
                p_now,
                Some(ClockOffset::from_nanos(0)),
                Duration::ZERO,
            );
            let is_pull = |d: &PullDecision| matches!(d, PullDecision::Pull { .. });
            assert_eq!(is_pull(&offset), pulls, "offset skew={skew_ms} ttl={ttl}");
            assert_eq!(
                is_pull(&relative),
                pulls,
                "relative skew={skew_ms} ttl={ttl}"
            );
            if ttl < 50 {
                // D ahead by 10 s: naive sees 10 s more than there is (unsafe pull of an
                // expiring entry); D behind: 10 s less (needless recompute).
                assert_eq!(
                    is_pull(&naive),
                    skew_ms > 0,
                    "naive skew={skew_ms} ttl={ttl}"
                );
            }
        }
    }
}

#[test]
fn offset_decision_accounts_for_the_sample_error_and_transfer_time() {
    let p_now = secs(100);
    let turn1 = tokens(128, 5);
    // 5.3 s left, margin 5 s: a sample with 1 s RTT (±0.5 s) cannot guarantee it.
    let d_now = PeerTimestamp::from_duration(p_now.as_duration());
    let p = params(&turn1, d_now, Duration::from_millis(5_300));
    let exact = Some(ClockOffset::from_nanos(0));
    let loose = Some(estimate(
        0,
        p_now - Duration::from_secs(1),
        Duration::from_millis(500),
    ));
    let pol = policy(DeadlineBasis::ClockOffset);
    let plan = |o, xfer| plan_pull(&pol, &p, &turn1, BS, p_now, o, xfer);
    assert!(matches!(
        plan(exact, Duration::ZERO),
        PullDecision::Pull { .. }
    ));
    assert_eq!(
        plan(loose, Duration::ZERO),
        PullDecision::Recompute(RecomputeReason::DeadlineTooClose)
    );
    assert_eq!(
        plan(exact, Duration::from_millis(400)),
        PullDecision::Recompute(RecomputeReason::DeadlineTooClose)
    );
    assert_eq!(
        plan(None, Duration::ZERO),
        PullDecision::Recompute(RecomputeReason::NoClockSample)
    );
    // The estimate is what the decision compares: the deadline less the sample's error.
    assert_eq!(
        estimated_deadline(DeadlineBasis::ClockOffset, &p, p_now, loose),
        Some(p_now + Duration::from_millis(4_800))
    );
    assert_eq!(
        estimated_deadline(DeadlineBasis::ClockOffset, &p, p_now, None),
        None
    );
}

#[test]
fn relative_ttl_ages_and_is_read_from_now() {
    let turn1 = tokens(128, 5);
    let p = params(&turn1, PeerTimestamp::ZERO, Duration::from_secs(8));
    let aged = p.clone().aged_by(Duration::from_millis(2_500));
    assert_eq!(aged.kvlease_ttl_remaining, Duration::from_millis(5_500));
    assert_eq!(
        p.aged_by(Duration::from_secs(9)).kvlease_ttl_remaining,
        Duration::ZERO
    );
    assert_eq!(
        estimated_deadline(DeadlineBasis::RelativeTtl, &aged, secs(10), None),
        Some(secs(10) + Duration::from_millis(5_500))
    );
    let plan = |p: &DecoderKvParams| {
        plan_pull(
            &policy(DeadlineBasis::RelativeTtl),
            p,
            &turn1,
            BS,
            secs(0),
            None,
            Duration::ZERO,
        )
    };
    assert!(matches!(plan(&aged), PullDecision::Pull { .. }));
    assert_eq!(
        plan(&aged.aged_by(Duration::from_millis(501))),
        PullDecision::Recompute(RecomputeReason::DeadlineTooClose)
    );
}

#[test]
fn heartbeats_move_a_symmetric_deadline_only_when_their_run_began_before_it() {
    // D's clock reads P's + 10 s, known to ±50 ms: sent at P's 0, D read 10.05 s, back at
    // P's 100 ms.
    let mut est = ClockOffsetEstimator::new();
    est.add_sample(ms(0), PeerTimestamp::from_millis(10_050), ms(100))
        .expect("forward");
    let offset = est.offset().expect("one sample");
    let run = |first: u64, last: u64| HeartbeatRun {
        first: ms(first),
        last: ms(last),
    };
    let turn = tokens(32, 1);
    // Held until D's 16 s.
    let fixed = params(
        &turn,
        PeerTimestamp::from_millis(10_000),
        Duration::from_secs(6),
    );
    assert_eq!(
        fixed.renewed_by_heartbeats(run(1_000, 5_000), &offset),
        None
    );
    let symmetric = DecoderKvParams {
        kvlease_renew_extension_ms: 4_000,
        ..fixed
    };
    let deadline = |r: HeartbeatRun| {
        symmetric
            .renewed_by_heartbeats(r, &offset)
            .map(|p| p.deadline().as_nanos_saturating() / 1_000_000)
    };
    // A run from D's 11 s to 15 s: kept until at least the last one's earliest D time
    // (14.95 s) + 4 s.
    assert_eq!(deadline(run(1_000, 5_000)), Some(18_950));
    let renewed = symmetric
        .renewed_by_heartbeats(run(1_000, 5_000), &offset)
        .expect("later");
    assert_eq!(
        renewed.kvlease_ttl_remaining,
        symmetric.kvlease_ttl_remaining
    );
    // A run that began after the deadline renews nothing: D had let the turn go (a late
    // heartbeat does not revive it), however late the run ended.
    assert_eq!(deadline(run(6_100, 6_100)), None);
    assert_eq!(deadline(run(7_000, 9_000)), None);
    // Nor one that may have begun after it within the offset's error bound (15.99 s ±
    // 50 ms), while 15.9 s (at the latest 15.95 s) counts.
    assert_eq!(deadline(run(5_990, 5_990)), None);
    assert_eq!(deadline(run(5_900, 5_900)), Some(19_850));
    // A run whose bound is not later than the deadline changes nothing.
    assert_eq!(deadline(run(1_000, 1_000)), None);
}

#[test]
fn check_names_the_inconsistent_field() {
    let turn = tokens(40, 2);
    let p = params(&turn, PeerTimestamp::from_millis(5), Duration::from_secs(9));
    assert_eq!(p.check(), Ok(()));
    let field = |f: fn(&mut DecoderKvParams)| {
        let mut bad = p.clone();
        f(&mut bad);
        bad.check().map_err(|e| e.field)
    };
    assert_eq!(
        field(|p| p.kvlease_block_hashes[0] = "zz".into()),
        Err("kvlease_block_hashes")
    );
    assert_eq!(
        field(|p| p.kvlease_block_hashes.push("0".repeat(16))),
        Err("kvlease_block_hashes")
    );
    assert_eq!(
        field(|p| p.remote_block_ids.truncate(1)),
        Err("remote_block_ids")
    );
    assert_eq!(
        field(|p| p.kvlease_block_size = 0),
        Err("kvlease_block_size")
    );
    assert_eq!(field(|p| p.tp_size = 0), Err("tp_size"));
    assert_eq!(field(|p| p.kvlease_bidir = false), Err("kvlease_bidir"));
}

#[test]
fn fixed_hold_is_never_renewed_and_symmetric_hold_is() {
    let ttl = DecoderTtl::from_duration(Duration::from_secs(6)).expect("in range");
    let id = RequestId::new("c1").expect("valid id");
    for symmetric in [false, true] {
        let mut h = DecoderHold::new(ttl, symmetric);
        assert_eq!(h.renew_extension().is_some(), symmetric);
        let held = h
            .insert(secs(0), id.clone(), vec![BlockId(1), BlockId(2)])
            .expect("fresh id");
        assert_eq!(held.deadline, secs(6));
        assert_eq!(h.blocks_held(), 2);
        let extended = h.heartbeat(secs(5), std::slice::from_ref(&id));
        assert_eq!(extended, u32::from(symmetric), "symmetric={symmetric}");
        // The extension of a 6 s lease is 4 s: 5 s + 4 s = 9 s.
        let want = if symmetric { secs(9) } else { secs(6) };
        assert_eq!(h.deadline(&id), Some(want));
        h.handle_timeout(secs(7));
        let expired = h.poll_event().is_some();
        assert_eq!(expired, !symmetric, "symmetric={symmetric}");
        if symmetric {
            assert!(h.read_complete(secs(8), &id));
            assert!(h.poll_event().is_some());
        }
        assert_eq!(h.blocks_held(), 0);
    }
}

#[test]
fn eviction_frees_the_oldest_turn_still_held() {
    let ttl = DecoderTtl::from_duration(Duration::from_secs(60)).expect("in range");
    for symmetric in [false, true] {
        let mut h = DecoderHold::new(ttl, symmetric);
        let ids: Vec<RequestId> = ["t1", "t2", "t3"]
            .iter()
            .map(|s| RequestId::new(s).expect("valid id"))
            .collect();
        for (i, id) in ids.iter().enumerate() {
            h.insert(secs(i as u64), id.clone(), vec![BlockId(i as u32)])
                .expect("fresh id");
        }
        // The oldest was pulled already: the next one gives way.
        assert!(h.read_complete(secs(3), &ids[0]));
        assert_eq!(h.evict_oldest(secs(3)).as_ref(), Some(&ids[1]));
        assert_eq!(h.deadline(&ids[1]), None);
        assert_eq!(h.evict_oldest(secs(3)).as_ref(), Some(&ids[2]));
        assert_eq!(h.evict_oldest(secs(3)), None, "symmetric={symmetric}");
        while h.poll_event().is_some() {}
        assert_eq!(h.blocks_held(), 0);
    }
}

#[test]
fn prefix_hashes_are_the_wire_contract() {
    // Pinned: P and D compare these across processes, so they must never change.
    let h = prefix_hashes(&[1, 2, 3]);
    assert_eq!(
        h,
        vec![
            0x5b3d_e3f5_8428_910d,
            0x5907_7a27_dff9_c668,
            0x43f2_1205_ef04_93b0
        ]
    );
    assert_eq!(block_hashes(&[1, 2, 3], 2), vec![h[1]]);
    assert_eq!(block_hashes(&[1, 2, 3], 4), Vec::<u64>::new());
    assert_ne!(prefix_hashes(&[1, 2])[1], prefix_hashes(&[2, 1])[1]);
}

#[test]
fn decoder_params_are_protos_turn_both_ways() {
    let p = params(
        &tokens(40, 2),
        PeerTimestamp::from_millis(5),
        Duration::from_millis(9_500),
    );
    let v = p.to_turn().expect("consistent").to_value();
    assert_eq!(v["kvlease_ttl_remaining_ms"], 9_500);
    let back = KvTransferParams::from_turn_value(&v).expect("proto reads it");
    assert_eq!(DecoderKvParams::from_turn(&back).as_ref(), Some(&p));
    // Sub-millisecond TTLs go out truncated.
    let aged = p.clone().aged_by(Duration::from_micros(1_500));
    assert_eq!(
        aged.to_turn().expect("consistent").to_value()["kvlease_ttl_remaining_ms"],
        9_498
    );
    let mut bad = p.clone();
    bad.remote_engine_id.clear();
    assert_eq!(
        bad.to_turn().expect_err("empty id").field,
        "remote_engine_id"
    );
    let mut bad = p;
    bad.kvlease_block_hashes.pop();
    assert_eq!(
        bad.to_turn().expect_err("a hash short").field,
        "kvlease_block_hashes"
    );
}

fn ms(n: u64) -> Timestamp {
    Timestamp::from_duration(Duration::from_millis(n))
}

#[test]
fn turn_heartbeats_go_per_extension_while_the_next_turn_waits() {
    let base = params(&tokens(32, 1), PeerTimestamp::ZERO, Duration::from_secs(9));
    let turn = |id: &str, extension_ms: u64| DecoderKvParams {
        remote_request_id: id.into(),
        kvlease_renew_extension_ms: extension_ms,
        ..base.clone()
    };
    let (a, b, fixed) = (
        turn("turn-a", 4_000),
        turn("turn-b", 8_000),
        turn("turn-c", 0),
    );
    let ids = |v: Vec<TurnHeartbeat>| v.into_iter().map(|h| h.turn).collect::<Vec<_>>();
    let mut s = TurnHeartbeats::new(4);
    s.handle_waiting([&b, &fixed, &a]);
    assert_eq!(s.len(), 2, "a fixed TTL is never heartbeated");
    assert_eq!(
        ids(s.due(ms(0))),
        ["turn-a", "turn-b"],
        "new turns at once, in id order"
    );
    let first = &s.due(ms(0))[0];
    assert_eq!((first.engine.as_str(), first.port), ("d0", 5601));
    assert!(s.handle_sent(ms(0), "turn-a"));
    assert_eq!(ids(s.due(ms(0))), ["turn-b"], "one not sent stays due");
    s.handle_sent(ms(0), "turn-b");
    assert!(s.due(ms(999)).is_empty());
    assert_eq!(s.poll_timeout(), Some(ms(1_000)), "every extension / 4");
    assert_eq!(ids(s.due(ms(1_000))), ["turn-a"]);
    s.handle_sent(ms(1_000), "turn-a");
    assert_eq!(ids(s.due(ms(2_000))), ["turn-a", "turn-b"]);
    // The waiting set is renewed every step: a turn kept waiting keeps its schedule, one
    // no longer waiting is forgotten.
    s.handle_waiting([&b]);
    assert!(!s.handle_sent(ms(2_000), "turn-a"));
    assert!(s.due(ms(1_999)).is_empty());
    // The pull starts: the run of heartbeats bounds D's renewal.
    assert_eq!(
        s.take("turn-b"),
        Some(HeartbeatRun {
            first: ms(0),
            last: ms(0)
        })
    );
    assert_eq!(s.take("turn-b"), None);
    assert!(s.is_empty());
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn a_gap_of_half_an_extension_starts_a_new_heartbeat_run() {
    let turn = DecoderKvParams {
        remote_request_id: "turn-a".into(),
        kvlease_renew_extension_ms: 4_000,
        ..params(
            &tokens(32, 1),
            PeerTimestamp::from_millis(0),
            Duration::from_secs(6),
        )
    };
    let mut s = TurnHeartbeats::new(4);
    s.handle_waiting([&turn]);
    for t in [0, 1_000, 2_900] {
        assert!(s.handle_sent(ms(t), "turn-a"));
    }
    // 1.9 s apart: still the run from 0. Then P stalls for 2 s (half the extension).
    assert!(s.handle_sent(ms(4_900), "turn-a"));
    assert!(s.handle_sent(ms(5_900), "turn-a"));
    assert_eq!(
        s.take("turn-a"),
        Some(HeartbeatRun {
            first: ms(4_900),
            last: ms(5_900)
        })
    );
}

#[test]
fn the_eviction_order_forgets_turns_no_longer_held() {
    let ttl = DecoderTtl::from_duration(Duration::from_secs(60)).expect("in range");
    for symmetric in [false, true] {
        let mut h = DecoderHold::new(ttl, symmetric);
        let kept = RequestId::new("kept").expect("valid id");
        h.insert(secs(0), kept.clone(), vec![BlockId(0)])
            .expect("fresh id");
        // Turn after turn pulled while one stays held: the order does not keep them all.
        for i in 1..1_000u32 {
            let id = RequestId::new(&format!("t{i}")).expect("valid id");
            h.insert(secs(1), id.clone(), vec![BlockId(i)])
                .expect("fresh id");
            assert!(h.read_complete(secs(1), &id));
            while h.poll_event().is_some() {}
            assert!(h.order.len() <= 2 * h.len() + 18, "symmetric={symmetric}");
        }
        assert_eq!(h.len(), 1);
        assert_eq!(h.evict_oldest(secs(2)), Some(kept), "still the oldest held");
        assert_eq!(h.evict_oldest(secs(2)), None);
    }
}
