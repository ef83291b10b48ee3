use proptest::prelude::*;
use serde_json::json;

use super::*;

/// What the agents' P answers.
fn agent_answer() -> Value {
    json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "p0", "remote_block_ids": [3, 1],
        "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_request_id": "r1", "tp_size": 2,
        "kvlease_generation": 9, "kvlease_num_tokens": 20, "kvlease_lease_ms": 3000,
        "kv_digest": "kvd-00000000000000ff", "kvlease_instance": 5,
    })
}

/// What the vLLM connector's P answers today (vLLM's keys, the old lease key, no digest).
fn connector_answer() -> Value {
    json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [4, 5, 6], "remote_engine_id": "p0",
        "remote_request_id": "cmpl-1", "remote_host": "10.0.0.11", "remote_port": 5601,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
        "transfer_mode": "pull", "kvlease_generation": 7, "kvlease_instance": 123,
        "kvlease_num_tokens": 40, "kvlease_lease_duration": 30.0,
    })
}

fn field_of(v: &Value) -> String {
    KvTransferParams::from_value(v).expect_err("invalid").field
}

#[test]
fn the_agents_answer_round_trips_unchanged() {
    let p = KvTransferParams::from_value(&agent_answer()).expect("valid params");
    assert_eq!(p.kv_digest, Some(KvDigest(0xff)));
    assert_eq!(p.require_digest(), Ok(KvDigest(0xff)));
    assert_eq!(p.to_value(), agent_answer());
}

#[test]
fn the_connectors_answer_reads_with_the_lease_in_ms() {
    let p = KvTransferParams::from_value(&connector_answer()).expect("valid params");
    assert_eq!(p.kvlease_lease_ms, Some(30_000));
    assert_eq!(p.remote_block_ids, [4, 5, 6]);
    assert_eq!((p.dcp_size, p.pp_size), (Some(1), Some(1)));
    assert_eq!(p.remote_num_tokens, Some(40));
    assert_eq!(p.transfer_mode.as_deref(), Some("pull"));
    assert_eq!(p.kvlease_instance, 123);
    assert_eq!(p.kv_digest, None);
    assert_eq!(
        p.require_digest().expect_err("no digest").field,
        "kv_transfer_params.kv_digest"
    );
    // Written back under the canonical key only.
    let out = p.to_value();
    assert_eq!(out["kvlease_lease_ms"], 30_000);
    assert!(out.get("kvlease_lease_duration").is_none());
    assert_eq!(KvTransferParams::from_value(&out), Ok(p));
}

#[test]
fn the_old_lease_key_is_seconds_and_the_canonical_one_wins() {
    let mut v = connector_answer();
    v["kvlease_lease_duration"] = json!(2);
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("valid")
            .kvlease_lease_ms,
        Some(2000)
    );
    v["kvlease_lease_duration"] = json!(0.0015);
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("valid")
            .kvlease_lease_ms,
        Some(2)
    );
    v["kvlease_lease_ms"] = json!(1500);
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("valid")
            .kvlease_lease_ms,
        Some(1500)
    );
    // Neither: the lease is not announced.
    let mut v = connector_answer();
    v.as_object_mut()
        .map(|m| m.remove("kvlease_lease_duration"));
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("valid")
            .kvlease_lease_ms,
        None
    );
}

#[test]
fn the_old_lease_key_refuses_zero_negative_and_absurd() {
    for bad in [
        json!(0),
        json!(0.0004),
        json!(-1.0),
        json!(86_400.001),
        json!(1e300),
        json!("30"),
    ] {
        let mut v = connector_answer();
        v["kvlease_lease_duration"] = bad.clone();
        assert_eq!(
            field_of(&v),
            "kv_transfer_params.kvlease_lease_duration",
            "{bad}"
        );
    }
    let mut v = connector_answer();
    v["kvlease_lease_duration"] = json!(86_400);
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("a day")
            .kvlease_lease_ms,
        Some(MAX_LEASE_MS)
    );
}

#[test]
fn errors_name_the_field_at_fault() {
    for (key, val) in [
        ("remote_block_ids", json!([1, -1])),
        ("remote_block_ids", json!([1, 4_294_967_296_u64])),
        ("remote_block_ids", json!("1,2")),
        ("remote_block_ids", json!([[1], 2])),
        ("remote_block_ids", json!([[1], [-2]])),
        ("remote_block_ids", Value::Null),
        ("remote_port", json!(70000)),
        ("remote_port", json!("5600")),
        ("remote_engine_id", Value::Null),
        ("remote_engine_id", json!("p 0")),
        ("remote_engine_id", json!(7)),
        ("remote_request_id", json!("")),
        ("remote_host", json!(["h"])),
        ("kv_digest", json!("x")),
        ("kv_digest", json!("kvd-+00000000000000f")),
        ("kvlease_generation", json!(-1)),
        ("kvlease_num_tokens", json!(4_294_967_296_u64)),
        ("kvlease_instance", json!(-1)),
        ("kvlease_lease_ms", json!(3000.5)),
        ("do_remote_prefill", json!(false)),
        ("do_remote_prefill", Value::Null),
        ("do_remote_prefill", json!("true")),
        ("do_remote_decode", json!("no")),
        ("dcp_size", json!(0)),
        ("pp_size", json!(2000)),
        ("remote_num_tokens", json!(-3)),
        ("transfer_mode", json!(1)),
    ] {
        let mut v = agent_answer();
        v[key] = val.clone();
        let e = KvTransferParams::from_value(&v).expect_err("invalid");
        assert_eq!(
            e.field,
            format!("kv_transfer_params.{key}"),
            "{key} = {val}"
        );
        assert!(e.to_string().starts_with(&e.field), "{e}");
    }
    assert_eq!(field_of(&json!([1])), "kv_transfer_params");
    assert_eq!(field_of(&Value::Null), "kv_transfer_params");
}

#[test]
fn nulls_read_as_absent_optional_keys() {
    let mut v = agent_answer();
    for key in [
        "kvlease_instance",
        "kvlease_lease_ms",
        "kv_digest",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "transfer_mode",
        "do_remote_decode",
    ] {
        v[key] = Value::Null;
    }
    let p = KvTransferParams::from_value(&v).expect("valid");
    assert_eq!(
        (p.kvlease_instance, p.kvlease_lease_ms, p.kv_digest),
        (0, None, None)
    );
}

#[test]
fn one_kv_cache_group_reads_as_the_list() {
    let mut v = agent_answer();
    v["remote_block_ids"] = json!([[7, 8, 9]]);
    let p = KvTransferParams::from_value(&v).expect("one group");
    assert_eq!(p.remote_block_ids, [7, 8, 9]);
    assert_eq!(p.to_value()["remote_block_ids"], json!([7, 8, 9]));
    v["remote_block_ids"] = json!([]);
    assert!(
        KvTransferParams::from_value(&v)
            .expect("no blocks")
            .remote_block_ids
            .is_empty()
    );
    assert!(p.remote_block_groups.is_empty());
}

/// A hybrid model's groups (full attention, sliding window) are one
/// lease over all their blocks, and read back as they were written.
#[test]
fn several_kv_cache_groups_are_one_block_list_with_counts() {
    let mut v = agent_answer();
    v["remote_block_ids"] = json!([[1, 2, 3], [7, 8], []]);
    let p = KvTransferParams::from_value(&v).expect("three groups");
    assert_eq!(p.remote_block_ids, [1, 2, 3, 7, 8]);
    assert_eq!(p.remote_block_groups, [3, 2, 0]);
    assert_eq!(p.block_groups(), [&[1, 2, 3][..], &[7, 8][..], &[][..]]);
    assert_eq!(
        p.to_value()["remote_block_ids"],
        json!([[1, 2, 3], [7, 8], []])
    );
    assert_eq!(KvTransferParams::from_value(&p.to_value()), Ok(p.clone()));
    // One group stays a flat list on the wire.
    let one = KvTransferParams {
        remote_block_groups: Vec::new(),
        ..p.clone()
    };
    assert_eq!(one.to_value()["remote_block_ids"], json!([1, 2, 3, 7, 8]));
    assert_eq!(one.block_groups(), [&[1, 2, 3, 7, 8][..]]);
    for groups in [vec![5], vec![3, 3], vec![1, 1]] {
        let bad = KvTransferParams {
            remote_block_groups: groups.clone(),
            ..p.clone()
        };
        assert_eq!(
            bad.validate().expect_err("counts off").field,
            "kv_transfer_params.remote_block_ids",
            "{groups:?}"
        );
    }
}

/// The range an error states is the range accepted.
#[test]
fn tp_size_zero_is_refused_with_the_range_that_is_accepted() {
    for bad in [json!(0), json!(1025), json!(-1), json!(1.5)] {
        let mut v = agent_answer();
        v["tp_size"] = bad.clone();
        let e = KvTransferParams::from_value(&v).expect_err("invalid tp_size");
        assert_eq!(e.field, "kv_transfer_params.tp_size");
        assert_eq!(e.reason, "must be an integer in 1..=1024", "{bad}");
    }
    let mut v = agent_answer();
    v["tp_size"] = json!(1024);
    assert_eq!(
        KvTransferParams::from_value(&v).expect("max tp").tp_size,
        1024
    );
}

/// Port 0 is no side channel.
#[test]
fn remote_port_zero_is_refused() {
    let mut v = agent_answer();
    v["remote_port"] = json!(0);
    let e = KvTransferParams::from_value(&v).expect_err("port 0");
    assert_eq!(e.field, "kv_transfer_params.remote_port");
    assert_eq!(e.reason, "must be an integer in 1..=65535");
    v["remote_port"] = json!(65535);
    assert!(KvTransferParams::from_value(&v).is_ok());
}

/// A lease of 0 ms or of more than a day is a mistake, not a lease.
#[test]
fn lease_ms_zero_or_absurd_is_refused() {
    for bad in [
        json!(0),
        json!(MAX_LEASE_MS + 1),
        json!(1_u64 << 63),
        json!(u64::MAX),
    ] {
        let mut v = agent_answer();
        v["kvlease_lease_ms"] = bad.clone();
        let e = KvTransferParams::from_value(&v).expect_err("absurd lease");
        assert_eq!(e.field, "kv_transfer_params.kvlease_lease_ms", "{bad}");
        assert_eq!(e.reason, "must be an integer in 1..=86400000");
    }
}

#[test]
fn the_generation_must_not_be_zero() {
    let mut v = agent_answer();
    v["kvlease_generation"] = json!(0);
    assert_eq!(field_of(&v), "kv_transfer_params.kvlease_generation");
    v["kvlease_generation"] = json!(u64::MAX);
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect("max generation")
            .kvlease_generation,
        u64::MAX
    );
}

#[test]
fn validate_checks_what_the_types_do_not() {
    let p = KvTransferParams::from_value(&agent_answer()).expect("valid");
    assert_eq!(p.validate(), Ok(()));
    for (bad, field) in [
        (
            KvTransferParams {
                remote_port: 0,
                ..p.clone()
            },
            "remote_port",
        ),
        (
            KvTransferParams {
                tp_size: 0,
                ..p.clone()
            },
            "tp_size",
        ),
        (
            KvTransferParams {
                pp_size: Some(0),
                ..p.clone()
            },
            "pp_size",
        ),
        (
            KvTransferParams {
                kvlease_generation: 0,
                ..p.clone()
            },
            "kvlease_generation",
        ),
        (
            KvTransferParams {
                kvlease_lease_ms: Some(0),
                ..p
            },
            "kvlease_lease_ms",
        ),
    ] {
        assert_eq!(
            bad.validate().expect_err("out of range").field,
            format!("kv_transfer_params.{field}")
        );
    }
}

#[test]
fn the_prefill_request_needs_do_remote_decode() {
    // vLLM's proxies send the other keys as null.
    let proxy = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
        "remote_port": null});
    assert_eq!(check_prefill_request(Some(&proxy)), Ok(()));
    let field = |v: Option<&Value>| check_prefill_request(v).expect_err("refused").field;
    assert_eq!(field(None), "kv_transfer_params");
    assert_eq!(field(Some(&json!("x"))), "kv_transfer_params");
    for bad in [
        json!({}),
        json!({"do_remote_decode": false}),
        json!({"do_remote_decode": "yes"}),
        json!({"do_remote_decode": null}),
    ] {
        assert_eq!(
            field(Some(&bad)),
            "kv_transfer_params.do_remote_decode",
            "{bad}"
        );
    }
}

#[test]
fn digests_print_and_parse() {
    let d = KvDigest(0x0123_4567_89ab_cdef);
    assert_eq!(d.to_string(), "kvd-0123456789abcdef");
    assert_eq!(KvDigest::parse(&d.to_string()), Some(d));
    assert_eq!(KvDigest::parse("kvd-0123456789ABCDEF"), Some(d));
    for bad in [
        "kvd-xyz",
        "kvd-+123456789abcdef",
        "0123456789abcdef",
        "kvd-0123456789abcdef0",
    ] {
        assert_eq!(KvDigest::parse(bad), None, "{bad}");
    }
    let mut sum = KvDigest(u64::MAX);
    sum.add(KvDigest(2));
    assert_eq!(sum, KvDigest(1));
}

fn id() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_.:@/+=-]{1,40}"
}

prop_compose! {
    fn valid_params()(
        engine in id(),
        request in id(),
        remote_block_ids in prop::collection::vec(any::<u32>(), 0..20),
        remote_host in ".{0,20}",
        remote_port in 1..=u16::MAX,
        tp_size in 1..=MAX_PARALLEL,
        dcp_size in prop::option::of(1..=MAX_PARALLEL),
        pp_size in prop::option::of(1..=MAX_PARALLEL),
        remote_num_tokens in prop::option::of(any::<u32>()),
        transfer_mode in prop::option::of("[a-z]{0,8}"),
        kvlease_generation in 1..=u64::MAX,
        kvlease_num_tokens in any::<u32>(),
        kvlease_lease_ms in prop::option::of(1..=MAX_LEASE_MS),
        kvlease_instance in any::<u64>(),
        kv_digest in prop::option::of(any::<u64>().prop_map(KvDigest)),
    ) -> KvTransferParams {
        KvTransferParams {
            remote_engine_id: EngineId::new(&engine).expect("valid id"),
            remote_request_id: RequestId::new(&request).expect("valid id"),
            remote_block_ids, remote_block_groups: Vec::new(), remote_host, remote_port, tp_size, dcp_size, pp_size,
            remote_num_tokens, transfer_mode, kvlease_generation, kvlease_num_tokens,
            kvlease_lease_ms, kvlease_instance, kv_digest, turn: None,
        }
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const KEYS: &[&str] = &[
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "transfer_mode",
    "kvlease_generation",
    "kvlease_num_tokens",
    "kvlease_lease_ms",
    "kvlease_lease_duration",
    "kvlease_instance",
    "kv_digest",
];

proptest! {
    #[test]
    fn to_value_then_from_value_is_the_identity(p in valid_params()) {
        prop_assert_eq!(p.validate(), Ok(()));
        prop_assert_eq!(KvTransferParams::from_value(&p.to_value()), Ok(p));
    }

    #[test]
    fn arbitrary_json_never_panics(v in json_value()) {
        if let Err(e) = KvTransferParams::from_value(&v) {
            prop_assert!(e.field.starts_with(PARAMS));
        }
        let _ = check_prefill_request(Some(&v));
    }

    /// Valid params with one key replaced by anything: read or refused naming a field,
    /// never a panic; what reads writes back and reads again the same.
    #[test]
    fn one_key_changed_never_panics(
        p in valid_params(),
        key in prop::sample::select(KEYS),
        val in json_value(),
    ) {
        let mut v = p.to_value();
        v[key] = val;
        match KvTransferParams::from_value(&v) {
            Ok(q) => prop_assert_eq!(KvTransferParams::from_value(&q.to_value()), Ok(q)),
            Err(e) => prop_assert!(e.field.starts_with("kv_transfer_params")),
        }
    }
}

#[test]
fn the_longest_lease_is_a_day_as_configured() {
    assert_eq!(MAX_LEASE_MS, 86_400_000);
}

/// A turn as the engine that decoded it answers: 40 tokens in blocks of 16 (two whole
/// blocks, one partial), held on its clock.
fn turn_answer() -> Value {
    json!({
        "do_remote_decode": true, "do_remote_prefill": false, "kvlease_bidir": true,
        "remote_engine_id": "d0", "remote_request_id": "cmpl-7", "remote_block_ids": [4, 9, 2],
        "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1,
        "remote_num_tokens": 40, "kvlease_generation": 77, "kvlease_num_tokens": 40,
        "kvlease_lease_ms": 480000, "kvlease_instance": 5,
        "kvlease_block_size": 16, "kvlease_block_hashes": ["00000000000000ff", "0123456789abcdef"],
        "kvlease_deadline_ns": 123_456_789_000_u64, "kvlease_ttl_remaining_ms": 479_000,
        "kvlease_renew_extension_ms": 320_000, "remote_blocks_expiry_time": 1234.5,
    })
}

#[test]
fn a_turn_reads_its_hold_and_round_trips() {
    let t = KvTransferParams::from_turn_value(&turn_answer()).expect("a turn");
    let turn = t.turn.as_ref().expect("turn params");
    assert_eq!(turn.kvlease_block_hashes, [0xff, 0x0123_4567_89ab_cdef]);
    assert_eq!(turn.kvlease_renew_extension_ms, 320_000);
    assert_eq!(turn.remote_blocks_expiry_us, Some(1_234_500_000));
    assert_eq!(
        (turn.kvlease_clock_port, turn.conversation_id.as_str()),
        (0, "")
    );
    assert_eq!(t.remote_block_ids, [4, 9, 2]);
    let v = t.to_value();
    assert_eq!(
        (
            v["do_remote_decode"].clone(),
            v["do_remote_prefill"].clone()
        ),
        (json!(true), json!(false))
    );
    assert_eq!(v["kvlease_bidir"], json!(true));
    assert_eq!(v["remote_blocks_expiry_time"], json!(1234.5));
    assert_eq!(KvTransferParams::from_turn_value(&v), Ok(t.clone()));
    // A turn is not a lease, nor a lease a turn.
    assert_eq!(field_of_turn(&v), "");
    assert_eq!(
        KvTransferParams::from_value(&v)
            .expect_err("not a lease")
            .field,
        "kv_transfer_params.do_remote_prefill"
    );
    let lease = KvTransferParams::from_value(&agent_answer()).expect("lease");
    assert_eq!(
        field_of_turn(&lease.to_value()),
        "kv_transfer_params.kvlease_bidir"
    );
}

/// The field a turn's reading names, or "" when it reads.
fn field_of_turn(v: &Value) -> String {
    KvTransferParams::from_turn_value(v)
        .err()
        .map(|e| e.field)
        .unwrap_or_default()
}

#[test]
fn a_turn_needs_a_hash_per_whole_block_and_a_block_per_block() {
    for (key, value, field) in [
        (
            "kvlease_block_hashes",
            json!(["00000000000000ff"]),
            "kvlease_block_hashes",
        ),
        (
            "kvlease_block_hashes",
            json!(["ff", "0123456789abcdef"]),
            "kvlease_block_hashes",
        ),
        (
            "kvlease_block_hashes",
            json!("00000000000000ff"),
            "kvlease_block_hashes",
        ),
        ("remote_block_ids", json!([4, 9]), "remote_block_ids"),
        ("remote_block_ids", json!([[4, 9], [2]]), "remote_block_ids"),
        ("kvlease_block_size", json!(0), "kvlease_block_size"),
        ("kvlease_deadline_ns", Value::Null, "kvlease_deadline_ns"),
        (
            "kvlease_ttl_remaining_ms",
            json!(-1),
            "kvlease_ttl_remaining_ms",
        ),
        (
            "remote_blocks_expiry_time",
            json!(-3.0),
            "remote_blocks_expiry_time",
        ),
        ("kvlease_bidir", json!(false), "kvlease_bidir"),
        ("do_remote_decode", json!(false), "do_remote_decode"),
        ("conversation_id", json!(7), "conversation_id"),
    ] {
        let mut v = turn_answer();
        v[key] = value;
        assert_eq!(
            field_of_turn(&v),
            format!("kv_transfer_params.{field}"),
            "{key}"
        );
    }
}
