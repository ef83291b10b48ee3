use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvlease_lease::ClockOffsetEstimator;

use kvlease_engine::block_hashes;

use super::*;
use crate::proxy::{ConversationStore, conversation_key};
use serde_json::json;

const BS: u32 = 16;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed) % 251).collect()
}

/// D's answer for a cached turn of `turn` tokens with `ttl` left, in its JSON form.
fn answer(turn: &[u32], ttl: Duration) -> Value {
    let blocks = turn.len().div_ceil(BS as usize) as u32;
    json!({
        "kvlease_bidir": true,
        "remote_engine_id": "d0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "kvlease_clock_port": 5602,
        "remote_block_ids": (100..100 + blocks).collect::<Vec<u32>>(),
        "remote_request_id": "cache-1",
        "tp_size": 1,
        "kvlease_generation": 7,
        "conversation_id": "conv",
        "kvlease_num_tokens": turn.len(),
        "kvlease_block_size": BS,
        "kvlease_block_hashes": block_hashes(turn, BS)
            .iter()
            .map(|h| format!("{h:016x}"))
            .collect::<Vec<String>>(),
        "kvlease_deadline_ns": ttl.as_nanos() as u64,
        "kvlease_ttl_remaining_ms": ttl.as_millis() as u64,
    })
}

/// The params as P reads D's answer.
fn params(turn: &[u32], ttl: Duration) -> DecoderKvParams {
    params_from_value(&answer(turn, ttl)).expect("D's answer reads")
}

#[test]
fn relative_ttl_is_aged_by_the_holder() {
    let p = params(&tokens(128, 5), Duration::from_secs(8));
    let mut store = ConversationStore::new(4);
    let t = Instant::now();
    store.remember("id:c".into(), p, t);
    let aged = store
        .take("id:c", t + Duration::from_secs(4))
        .expect("held");
    assert_eq!(aged.kvlease_ttl_remaining, Duration::from_secs(4));
    assert!(store.take("id:c", t).is_none(), "taken once");
    // What the proxy forwards to P carries the aged TTL.
    assert_eq!(
        params_to_value(&aged)["kvlease_ttl_remaining_ms"],
        json!(4_000)
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
    let p = params(&tokens(32, 1), Duration::from_secs(1));
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
    let p = params(&turn, Duration::from_secs(9));
    let v = params_to_value(&p);
    assert_eq!(
        v["kvlease_ttl_remaining_ms"],
        json!(9_000),
        "whole milliseconds on the wire"
    );
    let sub_ms = p.clone().aged_by(Duration::from_micros(1_500));
    assert_eq!(
        params_to_value(&sub_ms)["kvlease_ttl_remaining_ms"],
        json!(8_998)
    );
    assert!(is_decoder_params(Some(&v)));
    assert!(!is_decoder_params(Some(&json!({"do_remote_decode": true}))));
    assert_eq!(params_from_value(&v).expect("valid"), p);
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
        (
            "remote_port",
            json!(70_000),
            "kv_transfer_params.remote_port",
        ),
        (
            "remote_engine_id",
            json!(""),
            "kv_transfer_params.remote_engine_id",
        ),
    ] {
        let mut bad = v.clone();
        bad[key] = val;
        let e = params_from_value(&bad).expect_err(key);
        assert_eq!(e.param.as_deref(), Some(param), "{key}");
    }
}

#[test]
fn probe_over_loopback_measures_an_injected_skew() {
    let local = PeerClock::new(0);
    for skew_ms in [-10_000i64, 10_000] {
        let skewed = PeerClock::new(skew_ms);
        let h = ClockProbeServer::new(move || skewed.now_ns())
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
    let h = ClockProbeServer::new(|| PeerClock::new(0).now_ns())
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
