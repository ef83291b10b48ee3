use std::time::Instant;

use super::*;
use crate::proxy::{ConversationStore, conversation_key};
use serde_json::json;

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
        kvlease_ttl_remaining_ms: ttl.as_millis() as u64,
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
}

#[test]
fn relative_ttl_is_aged_by_the_holder() {
    let turn1 = tokens(128, 5);
    let p = params(&turn1, PeerTimestamp::ZERO, Duration::from_secs(8));
    let mut store = ConversationStore::new(4);
    let t = Instant::now();
    store.remember("id:c".into(), p, t);
    let aged = store
        .take("id:c", t + Duration::from_secs(4))
        .expect("held");
    assert_eq!(aged.kvlease_ttl_remaining_ms, 4_000);
    assert!(store.take("id:c", t).is_none(), "taken once");
    assert_eq!(
        plan_pull(
            &policy(DeadlineBasis::RelativeTtl),
            &aged,
            &turn1,
            BS,
            secs(0),
            None,
            Duration::ZERO
        ),
        PullDecision::Recompute(RecomputeReason::DeadlineTooClose)
    );
}

#[test]
fn conversation_store_keys_expires_and_bounds() {
    assert_eq!(
        conversation_key(&json!({"conversation_id": "abc", "messages": []})).as_deref(),
        Some("id:abc")
    );
    let a = conversation_key(&json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"}]}));
    let b = conversation_key(&json!({"messages": [{"role": "user", "content": "hi"}]}));
    let c = conversation_key(&json!({"messages": [{"role": "user", "content": "ho"}]}));
    assert!(a.is_some());
    assert_eq!(a, b, "same first message, same conversation");
    assert_ne!(a, c);
    assert_eq!(conversation_key(&json!({"prompt": "x"})), None);

    let t = Instant::now();
    let p = params(&tokens(32, 1), PeerTimestamp::ZERO, Duration::from_secs(1));
    let mut s = ConversationStore::new(2);
    s.remember("a".into(), p.clone(), t);
    assert!(
        s.take("a", t + Duration::from_secs(2)).is_none(),
        "past its TTL"
    );
    s.remember("a".into(), p.clone(), t);
    s.remember("b".into(), p.clone(), t + Duration::from_millis(1));
    s.remember("c".into(), p, t + Duration::from_millis(2));
    assert_eq!(s.len(), 2);
    assert!(s.take("a", t).is_none(), "oldest evicted when full");
}

#[test]
fn params_round_trip_and_name_bad_fields() {
    let turn = tokens(40, 2);
    let p = params(&turn, PeerTimestamp::from_millis(5), Duration::from_secs(9));
    let v = p.to_value();
    assert!(is_decoder_params(Some(&v)));
    assert!(!is_decoder_params(Some(&json!({"do_remote_decode": true}))));
    assert_eq!(DecoderKvParams::from_value(&v).expect("valid"), p);
    for (key, val, param) in [
        (
            "kvlease_block_hashes",
            json!(["zz"]),
            "kv_transfer_params.kvlease_block_hashes",
        ),
        (
            "remote_block_ids",
            json!([1]),
            "kv_transfer_params.remote_block_ids",
        ),
        (
            "kvlease_block_size",
            json!(0),
            "kv_transfer_params.kvlease_block_size",
        ),
        (
            "kvlease_bidir",
            json!(false),
            "kv_transfer_params.kvlease_bidir",
        ),
        ("remote_port", json!(70_000), "kv_transfer_params"),
    ] {
        let mut bad = v.clone();
        bad[key] = val;
        let e = DecoderKvParams::from_value(&bad).expect_err(key);
        assert_eq!(e.param.as_deref(), Some(param), "{key}");
    }
}

#[test]
fn fixed_hold_is_never_renewed_and_symmetric_hold_is() {
    let ttl = DecoderTtl::from_duration(Duration::from_secs(6)).expect("in range");
    let id = RequestId::new("c1").expect("valid id");
    for symmetric in [false, true] {
        let mut h = DecoderHold::new(ttl, symmetric);
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
fn probe_over_loopback_measures_an_injected_skew() {
    let local = PeerClock::new(0);
    for skew_ms in [-10_000i64, 10_000] {
        let h = ClockProbeServer {
            clock: PeerClock::new(skew_ms),
        }
        .spawn("127.0.0.1:0".parse().expect("literal address"))
        .expect("bind loopback");
        let mut est = ClockOffsetEstimator::new();
        let n = probe_clock(h.addr, 8, &|| local.now(), &mut est).expect("probe");
        assert_eq!(n, 8);
        let o = est.offset().expect("samples");
        let err = o.peer_minus_local_nanos() - i128::from(skew_ms) * 1_000_000;
        // Within the sample's error bound (plus the clock's granularity).
        assert!(
            err.unsigned_abs() <= o.rtt().as_nanos() / 2 + 1_000_000,
            "skew {skew_ms} ms estimated with error {err} ns, rtt {:?}",
            o.rtt()
        );
    }
}

#[test]
fn probe_server_refuses_garbage() {
    let h = ClockProbeServer {
        clock: PeerClock::new(0),
    }
    .spawn("127.0.0.1:0".parse().expect("literal address"))
    .expect("bind loopback");
    let mut s = TcpStream::connect(h.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    s.write_all(b"GET / HT").expect("write");
    let mut buf = [0u8; 16];
    // The server closes without an answer.
    assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
}

#[test]
fn test_clock_offset_parses_in_range_integers_only() {
    assert_eq!(parse_clock_offset("-10000"), Ok(-10_000));
    assert_eq!(parse_clock_offset(" 250 "), Ok(250));
    assert!(parse_clock_offset("1.5").is_err());
    assert!(parse_clock_offset("999999999999").is_err());
    let skewed = PeerClock::new(10_000).now_ns() as i128 - PeerClock::new(0).now_ns() as i128;
    assert!((skewed - 10_000_000_000).abs() < 1_000_000_000, "{skewed}");
}
