use kvlease_lease::EngineId;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

/// What the agents' P served before this codec (hex metadata, no `fence_region`).
fn old_agent_payload() -> Value {
    json!({
        "engine_id": "p0", "tp_size": 2, "num_blocks": 64, "instance": 5,
        "shape": {"num_layers": 2, "num_kv_heads": 4, "block_size": 16, "head_dim": 64},
        "workers": [
            {"rank": 0, "metadata": "0a0b", "pool": {"id": 1, "base": 4096, "len": 8192, "key": 7},
             "fence": {"id": 2, "base": 0, "len": 512, "key": 8}},
            {"rank": 1, "metadata": "ff", "pool": {"id": 1, "base": 0, "len": 8192, "key": 9},
             "fence": {"id": 3, "base": 0, "len": 512, "key": 10}},
        ],
    })
}

/// What the vLLM connector's P serves.
fn connector_payload() -> Value {
    json!({
        "format": 2, "engine_id": "p0", "instance": 77, "tp_size": 1, "num_blocks": 64,
        "block_size": 16, "num_kv_heads": 4,
        "kv": {"model": "m", "dtype": "torch.float16", "cache_dtype": "auto",
               "num_kv_heads": 4, "head_size": 16, "num_layers": 2, "block_size": 16,
               "kv_cache_layout": null, "block_order": null, "use_mla": false,
               "layers": {"l0": ["float16", [4, 16, 32], [2, 1, 3]]}, "future_key": [1]},
        "workers": [{
            "rank": 0, "agent_name": "p0#0", "agent_metadata": "YWdlbnQgbWV0YWRhdGE=",
            "layers": [["l0", 1, 0, 4096, 4096, 64]], "fence_region": 2,
            "num_blocks": 64, "device": "cpu",
            "kv_format": {"l0": ["float16", [4, 16, 32], [2, 1, 3]]},
        }],
    })
}

fn field_of(v: &Value) -> String {
    EngineInfo::from_value(v).expect_err("invalid").field
}

#[test]
fn an_old_agents_payload_reads_and_writes_the_canonical_keys() {
    let info = EngineInfo::from_value(&old_agent_payload()).expect("valid");
    assert_eq!(info.shape.map(|s| s.head_dim), Some(64));
    let w = info.worker(0).expect("rank 0");
    assert_eq!(w.agent_metadata, [0x0a, 0x0b]);
    assert_eq!(w.fence_region, 2);
    assert_eq!(w.pool.map(|p| (p.base, p.key)), Some((4096, 7)));
    let out = info.to_value();
    assert_eq!(out["workers"][0]["agent_metadata"], "Cgs=");
    assert!(out["workers"][0].get("metadata").is_none());
    assert!(!info.sessions && out.get("sessions").is_none());
    assert_eq!(EngineInfo::decode(&info.encode()), Ok(info.clone()));
    // An agents' P that binds sessions says so; the flag round-trips and must be a bool.
    let mut binding = info;
    binding.sessions = true;
    assert_eq!(binding.to_value()["sessions"], true);
    assert_eq!(EngineInfo::decode(&binding.encode()), Ok(binding));
    let mut bad = old_agent_payload();
    bad["sessions"] = json!("yes");
    assert_eq!(field_of(&bad), "engine_info.sessions");
}

#[test]
fn the_connectors_payload_round_trips() {
    let info = EngineInfo::decode(connector_payload().to_string().as_bytes()).expect("valid");
    let kv = info.kv.as_ref().expect("descriptor");
    assert_eq!(kv.model.as_deref(), Some("m"));
    assert_eq!(kv.kv_cache_layout, None);
    assert_eq!(kv.extra["future_key"], json!([1]));
    let w = &info.workers[0];
    assert_eq!(w.agent_metadata, b"agent metadata");
    assert_eq!(w.layers[0].name, "l0");
    assert_eq!(w.layers[0].block_stride, 4096);
    assert_eq!(
        w.kv_format.as_ref().map(|f| f["l0"].clone()),
        Some(BlockFormat {
            dtype: "float16".into(),
            shape: vec![4, 16, 32],
            order: vec![2, 1, 3],
            ..BlockFormat::default()
        })
    );
    let mut want = connector_payload();
    // Nulls are absent keys.
    let kv = want["kv"].as_object_mut().expect("object");
    kv.remove("kv_cache_layout");
    kv.remove("block_order");
    assert_eq!(info.to_value(), want);
}

#[test]
fn a_block_format_names_its_axes_and_backend_or_is_the_old_three() {
    let mut v = connector_payload();
    v["workers"][0]["kv_format"]["l0"] =
        json!(["float32", [2, 2, 32, 64], [1, 2, 3, 4], "HKND", "CPU_ATTN"]);
    let info = EngineInfo::decode(v.to_string().as_bytes()).expect("decodes");
    let f = &info.workers[0].kv_format.as_ref().expect("formats")["l0"];
    assert_eq!(f.axes.as_deref(), Some("HKND"));
    assert_eq!(f.backend.as_deref(), Some("CPU_ATTN"));
    assert_eq!(
        info.to_value()["workers"][0]["kv_format"],
        v["workers"][0]["kv_format"]
    );
    // Not known: nulls, kept as nulls.
    v["workers"][0]["kv_format"]["l0"] = json!(["float32", [2, 32, 128], [1, 2, 3], null, null]);
    let info = EngineInfo::decode(v.to_string().as_bytes()).expect("decodes");
    let f = &info.workers[0].kv_format.as_ref().expect("formats")["l0"];
    assert_eq!((f.axes.as_ref(), f.backend.as_ref()), (None, None));
    for bad in [
        json!(["float32", [2, 32, 128], [1, 2, 3], "HN", "X"]),
        json!(["float32", [2, 32, 128], [1, 2, 3], "hnc", "X"]),
        json!(["float32", [2, 32, 128], [1, 2, 3], "HNC"]),
        json!(["float32", [2, 32, 128], [1, 2, 3], 7, "X"]),
        json!(["float32", [2, 32, 128], [1, 2, 3], "HNC", 7]),
    ] {
        v["workers"][0]["kv_format"]["l0"] = bad.clone();
        assert_eq!(field_of(&v), "engine_info.workers[0].kv_format.l0", "{bad}");
    }
}

#[test]
fn errors_name_the_field() {
    let mut v = connector_payload();
    v["workers"][0]["rank"] = json!(1);
    assert_eq!(field_of(&v), "engine_info.workers[0].rank");
    let mut v = connector_payload();
    v["workers"][0]["agent_metadata"] = json!("not base64!");
    assert_eq!(field_of(&v), "engine_info.workers[0].agent_metadata");
    let mut v = connector_payload();
    v["workers"][0]["layers"] = json!([["l0", 1, 0, 1u64 << 63, 4096, 64]]);
    assert_eq!(field_of(&v), "engine_info.workers[0].layers[0]");
    let mut v = connector_payload();
    v["kv"]["layers"]["l0"] = json!(5);
    assert_eq!(field_of(&v), "engine_info.kv.layers.l0");
    let mut v = connector_payload();
    v["tp_size"] = json!(0);
    assert_eq!(field_of(&v), "engine_info.tp_size");
    let mut v = connector_payload();
    v["workers"][0]["fence_region"] = Value::Null;
    assert_eq!(field_of(&v), "engine_info.workers[0].fence_region");
    let mut v = old_agent_payload();
    v["workers"][1]["rank"] = json!(0);
    assert_eq!(field_of(&v), "engine_info.workers[1].rank");
    let mut v = old_agent_payload();
    v["shape"]["head_dim"] = json!(0);
    assert_eq!(field_of(&v), "engine_info.shape.head_dim");
    assert_eq!(field_of(&json!([1])), "engine_info");
    assert_eq!(
        EngineInfo::decode(b"{not json").expect_err("bad").field,
        "engine_info"
    );
    let big = vec![b' '; MAX_PAYLOAD + 1];
    assert_eq!(
        EngineInfo::decode(&big).expect_err("big").field,
        "engine_info"
    );
}

#[test]
fn base64_is_strict_and_round_trips() {
    for (raw, b64) in [
        (&b""[..], ""),
        (b"f", "Zg=="),
        (b"fo", "Zm8="),
        (b"foo", "Zm9v"),
    ] {
        assert_eq!(base64_encode(raw), b64);
        assert_eq!(base64_decode(b64).as_deref(), Some(raw));
    }
    for bad in [
        "Zg=", "Zg===", "Z===", "Zg==Zg==", "Zm 9v", "Zm9v\n", "!!!!",
    ] {
        assert_eq!(base64_decode(bad), None, "{bad}");
    }
}

fn arb_format() -> impl Strategy<Value = BlockFormat> {
    (
        "[a-z0-9]{1,8}",
        prop::collection::vec(any::<u64>(), 0..5),
        prop::collection::vec(any::<u64>(), 0..5),
        any::<bool>(),
        prop::option::of("[A-Z_]{1,12}"),
    )
        .prop_map(|(dtype, shape, order, named, backend)| {
            // Axes name every dim (a letter each), or are not known.
            let axes = named.then(|| "HNCKDXYZ"[..shape.len()].to_owned());
            BlockFormat {
                dtype,
                shape,
                order,
                axes,
                backend,
            }
        })
}

fn arb_worker(rank: u32) -> impl Strategy<Value = WorkerInfo> {
    (
        prop::collection::vec(any::<u8>(), 0..40),
        any::<u64>(),
        prop::option::of((any::<u64>(), any::<u64>(), any::<u64>())),
        prop::collection::vec(
            (
                "[a-z.0-9]{1,12}",
                any::<u64>(),
                0..1u64 << 40,
                0..1u64 << 20,
                any::<u64>(),
                0..1u64 << 20,
            ),
            0..3,
        ),
        prop::option::of(prop::collection::btree_map(
            "[a-z]{1,6}",
            arb_format(),
            0..3,
        )),
        prop::option::of("[a-z:0-9]{0,8}"),
    )
        .prop_map(
            move |(md, fence_region, pool, layers, kv_format, device)| WorkerInfo {
                rank,
                agent_metadata: md,
                fence_region,
                pool: pool.map(|(base, len, key)| RegionInfo {
                    id: 1,
                    base,
                    len,
                    key,
                }),
                fence: pool.map(|(base, len, key)| RegionInfo {
                    id: fence_region,
                    base,
                    len,
                    key,
                }),
                agent_name: device.as_ref().map(|d| format!("p#{d}")),
                device,
                num_blocks: kv_format
                    .as_ref()
                    .map(|f| u32::try_from(f.len()).unwrap_or(0)),
                layers: layers
                    .into_iter()
                    .map(
                        |(name, region, offset, block_stride, block_bytes, num_blocks)| {
                            RemoteLayer {
                                name,
                                region,
                                offset,
                                block_stride,
                                block_bytes,
                                num_blocks,
                            }
                        },
                    )
                    .collect(),
                kv_format,
            },
        )
}

fn arb_info() -> impl Strategy<Value = EngineInfo> {
    (
        1..5u32,
        any::<u64>(),
        1..=u32::MAX,
        any::<bool>(),
        prop::option::of(arb_format()),
    )
        .prop_flat_map(|(tp, instance, blocks, agents, fmt)| {
            let workers = (0..tp).map(arb_worker).collect::<Vec<_>>();
            (Just((tp, instance, blocks, agents, fmt)), workers)
        })
        .prop_map(|((tp, instance, blocks, agents, fmt), workers)| {
            let mut info = EngineInfo::new(
                EngineId::new("p-0").expect("valid id"),
                instance,
                tp,
                blocks,
            );
            info.workers = workers;
            if agents {
                info.shape = Some(KvShape {
                    num_layers: 2,
                    num_kv_heads: 4,
                    block_size: 16,
                    head_dim: 64,
                });
            } else {
                info.block_size = Some(16);
                info.num_kv_heads = Some(tp);
                info.kv = Some(KvDescriptor {
                    model: Some("m".into()),
                    use_mla: Some(false),
                    layers: fmt.into_iter().map(|f| ("l0".to_owned(), f)).collect(),
                    ..KvDescriptor::default()
                });
            }
            info
        })
}

proptest! {
    #[test]
    fn a_valid_info_decodes_equal_from_its_encoding(info in arb_info()) {
        prop_assert_eq!(info.validate(), Ok(()));
        prop_assert_eq!(EngineInfo::decode(&info.encode()), Ok(info));
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = EngineInfo::decode(&bytes);
    }

    #[test]
    fn decoding_a_mutated_payload_never_panics(
        info in arb_info(),
        cuts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = info.encode();
        for (at, b) in cuts {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        if let Ok(back) = EngineInfo::decode(&bytes) {
            prop_assert_eq!(back.validate(), Ok(()));
        }
    }
}

#[test]
fn kv_compatibility_names_the_key_and_both_values() {
    let d = KvShape {
        num_layers: 2,
        num_kv_heads: 4,
        block_size: 16,
        head_dim: 64,
    };
    assert!(d.mismatches(&d).is_empty());
    let p = KvShape {
        block_size: 32,
        ..d
    };
    let got = d.mismatches(&p);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].to_string(), "block_size: P 32, D 16");

    let ours = KvDescriptor {
        model: Some("m".into()),
        block_size: Some(16),
        block_order: Some("NHC".into()),
        use_mla: Some(false),
        ..KvDescriptor::default()
    };
    // A layout one side did not resolve is not compared; the other keys are, in order.
    let theirs = KvDescriptor {
        block_order: None,
        block_size: Some(32),
        head_size: Some(8),
        ..ours.clone()
    };
    let got: Vec<String> = ours
        .mismatches(&theirs)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(got, ["head_size: P 8, D null", "block_size: P 32, D 16"]);
    let back = KvDescriptor::from_value(&ours.to_value(), "kv").expect("reads back");
    assert_eq!(back, ours);
}
