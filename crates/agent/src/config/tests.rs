use clap::Parser;
use kvlease_lease::EngineId;

use super::*;

fn err(json: &str) -> String {
    KvTransferConfig::parse(json)
        .expect_err("config must be rejected")
        .to_string()
}

fn extra(body: &str) -> String {
    format!(
        r#"{{"kv_connector":"kvlease","kv_role":"kv_producer","kv_connector_extra_config":{{{body}}}}}"#
    )
}

#[test]
fn minimal_config_gets_every_default() {
    let c =
        KvTransferConfig::parse(r#"{"kv_connector":"kvlease","kv_role":"kv_consumer"}"#).unwrap();
    assert_eq!(c.connector, Connector::Kvlease);
    assert_eq!(c.role, KvRole::Consumer);
    assert_eq!(c.lease_duration, Duration::from_secs(30));
    assert_eq!(c.heartbeat_interval(), Duration::from_secs(5));
    assert_eq!(c.lease_extension(), Duration::from_secs(20));
    assert_eq!(c.decoder_kv_blocks_ttl, Duration::from_secs(480));
    assert!(!c.bidirectional_kv_xfer);
    assert_eq!(c.load_failure_policy, LoadFailurePolicy::Recompute);
    assert_eq!(c.lease_mode, LeaseModeSetting::Lease);
    assert_eq!(c.abort_request_timeout, Duration::from_secs(480));
    assert_eq!(c.recompute_threshold_tokens, 64);
    assert_eq!(c.pull_safety_margin, Duration::from_secs(5));
    assert_eq!(c.initial_hold(), Duration::from_secs(30));
    let mut d = KvTransferConfig::default_for(AgentRole::Decode);
    d.connector = c.connector;
    assert_eq!(d, c);
}

#[test]
fn every_extra_key_is_parsed() {
    let c = KvTransferConfig::parse(&extra(
        r#""kv_lease_duration":1.5,"decoder_kv_blocks_ttl":60,"bidirectional_kv_xfer":true,
           "kv_load_failure_policy":"fail","lease_mode":"fixed","abort_request_timeout":2.25,
           "kv_recompute_threshold":0,"pull_safety_margin":0,"kv_lease_max_lifetime":90"#,
    ))
    .unwrap();
    assert_eq!(c.lease_duration, Duration::from_millis(1500));
    assert_eq!(c.lease_max_lifetime, Some(Duration::from_secs(90)));
    assert_eq!(c.heartbeat_interval(), Duration::from_millis(250));
    assert_eq!(c.lease_extension(), Duration::from_millis(1000));
    assert_eq!(c.decoder_kv_blocks_ttl, Duration::from_secs(60));
    assert!(c.bidirectional_kv_xfer);
    assert_eq!(c.load_failure_policy, LoadFailurePolicy::Fail);
    assert_eq!(c.lease_mode, LeaseModeSetting::Fixed);
    assert_eq!(c.abort_request_timeout, Duration::from_millis(2250));
    assert_eq!(c.initial_hold(), Duration::from_millis(2250));
    assert_eq!(c.recompute_threshold_tokens, 0);
    assert_eq!(c.pull_safety_margin, Duration::ZERO);
}

#[test]
fn vllm_configs_are_accepted() {
    let c = KvTransferConfig::parse(
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_rank":0,"kv_parallel_size":2,
            "kv_buffer_device":"cuda","kv_buffer_size":1e9,"kv_ip":"127.0.0.1","kv_port":14579,
            "engine_id":"p-0","kv_connector_module_path":null,"kv_load_failure_policy":"fail",
            "kv_connector_extra_config":{"kv_lease_duration":60}}"#,
    )
    .unwrap();
    assert_eq!(c.connector, Connector::NixlAlias);
    assert_eq!(c.role, KvRole::Both);
    assert_eq!(c.engine_id.as_ref().map(EngineId::as_str), Some("p-0"));
    assert_eq!(c.load_failure_policy, LoadFailurePolicy::Fail);
    assert_eq!(c.lease_duration, Duration::from_secs(60));
    assert_eq!(c.ignored_keys.len(), 7);
    assert!(c.ignored_keys.iter().any(|k| k == "kv_ip"));
}

#[test]
fn errors_name_the_key() {
    assert_eq!(
        err(&extra(r#""kv_lease_duration":-1"#)),
        "kv_connector_extra_config.kv_lease_duration: must be > 0 seconds, got -1"
    );
    assert_eq!(
        err(&extra(r#""kv_lease_duration":0"#)),
        "kv_connector_extra_config.kv_lease_duration: must be > 0 seconds, got 0"
    );
    assert_eq!(
        err(&extra(r#""kv_lease_max_lifetime":-5"#)),
        "kv_connector_extra_config.kv_lease_max_lifetime: must be > 0 seconds, got -5"
    );
    for (body, key) in [
        (
            r#""kv_lease_duration":1e9"#,
            "kv_connector_extra_config.kv_lease_duration: must be between",
        ),
        (
            r#""kv_lease_duration":0.001"#,
            "kv_connector_extra_config.kv_lease_duration: must be between",
        ),
        (
            r#""kv_lease_duration":"30""#,
            "kv_connector_extra_config.kv_lease_duration: expected a number",
        ),
        (
            r#""decoder_kv_blocks_ttl":-0.5"#,
            "kv_connector_extra_config.decoder_kv_blocks_ttl: must be > 0",
        ),
        (
            r#""abort_request_timeout":null"#,
            "kv_connector_extra_config.abort_request_timeout: expected",
        ),
        (
            r#""bidirectional_kv_xfer":1"#,
            "kv_connector_extra_config.bidirectional_kv_xfer: expected true or false",
        ),
        (
            r#""kv_load_failure_policy":"retry""#,
            "kv_connector_extra_config.kv_load_failure_policy: must be",
        ),
        (
            r#""lease_mode":true"#,
            "kv_connector_extra_config.lease_mode: expected a string",
        ),
        (
            r#""lease_mode":"renew""#,
            "kv_connector_extra_config.lease_mode: must be \"lease\" or \"fixed\"",
        ),
        (
            r#""kv_recompute_threshold":-1"#,
            "kv_connector_extra_config.kv_recompute_threshold: must be a whole",
        ),
        (
            r#""kv_recompute_threshold":1.5"#,
            "kv_connector_extra_config.kv_recompute_threshold: must be a whole",
        ),
        (
            r#""kv_recompute_threshold":5000000000"#,
            "kv_connector_extra_config.kv_recompute_threshold: must be at most",
        ),
        (
            r#""pull_safety_margin":-1"#,
            "kv_connector_extra_config.pull_safety_margin: must be a finite",
        ),
        (
            r#""pull_safety_margin":480"#,
            "kv_connector_extra_config.pull_safety_margin: must be below",
        ),
        (
            r#""kv_lease_duraton":30"#,
            "kv_connector_extra_config.kv_lease_duraton: unknown key",
        ),
    ] {
        let message = err(&extra(body));
        assert!(message.starts_with(key), "{body}: {message}");
    }
    for (json, key) in [
        (
            r#"{"kv_role":"kv_producer"}"#,
            "kv_connector: required key is missing",
        ),
        (
            r#"{"kv_connector":"kvlease"}"#,
            "kv_role: required key is missing",
        ),
        (
            r#"{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer"}"#,
            "kv_connector: must be",
        ),
        (
            r#"{"kv_connector":"kvlease","kv_role":"producer"}"#,
            "kv_role: must be",
        ),
        (
            r#"{"kv_connector":"kvlease","kv_role":"kv_producer","kv_lease_duration":3}"#,
            "kv_lease_duration: unknown key",
        ),
        (
            r#"{"kv_connector":"kvlease","kv_role":"kv_producer","engine_id":"a b"}"#,
            "engine_id: identifier holds",
        ),
        (
            r#"{"kv_connector":"kvlease","kv_role":"kv_producer","kv_connector_extra_config":[]}"#,
            "kv_connector_extra_config: expected a JSON object",
        ),
        ("[1]", "kv-transfer-config: expected a JSON object"),
        ("{", "kv-transfer-config is not valid JSON"),
    ] {
        let message = err(json);
        assert!(message.starts_with(key), "{json}: {message}");
    }
    let conflict = KvTransferConfig::parse(
        r#"{"kv_connector":"kvlease","kv_role":"kv_producer","kv_load_failure_policy":"fail",
            "kv_connector_extra_config":{"kv_load_failure_policy":"recompute"}}"#,
    )
    .unwrap_err();
    assert_eq!(conflict.key(), Some("kv_load_failure_policy"));
}

#[test]
fn role_must_fit_the_agent() {
    let consumer =
        KvTransferConfig::parse(r#"{"kv_connector":"kvlease","kv_role":"kv_consumer"}"#).unwrap();
    assert!(consumer.check_role(AgentRole::Decode).is_ok());
    let message = consumer
        .check_role(AgentRole::Prefill)
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "kv_role: prefill-agent needs kv_producer or kv_both, got \"kv_consumer\""
    );
    let both =
        KvTransferConfig::parse(r#"{"kv_connector":"kvlease","kv_role":"kv_both"}"#).unwrap();
    assert!(
        both.check_role(AgentRole::Prefill).is_ok() && both.check_role(AgentRole::Decode).is_ok()
    );
}

fn prefill(args: &[&str]) -> Result<PrefillArgs, clap::Error> {
    PrefillArgs::try_parse_from(std::iter::once("prefill-agent").chain(args.iter().copied()))
}

#[test]
fn cli_defaults_are_a_small_valid_model() {
    let p = prefill(&[]).unwrap();
    p.validate().unwrap();
    assert_eq!(
        p.common.pool_bytes_per_rank(),
        2 * 512 * 2 * 8 * 16 * 64 * 2
    );
    assert_eq!(
        p.common.kv_config(AgentRole::Prefill).role,
        KvRole::Producer
    );
    let first = p.common.engine_id();
    assert!(first.as_str().starts_with("kvlease-"));
    assert_eq!(p.common.engine_id(), first, "the generated id is stable");
    assert_ne!(
        prefill(&[]).unwrap().common.engine_id(),
        first,
        "each start gets its own id"
    );
    let d = DecodeArgs::try_parse_from(["decode-agent", "--max-running", "1", "--step-ms", "5"])
        .unwrap();
    d.validate().unwrap();
    assert_eq!(d.step(), Duration::from_millis(5));
}

#[test]
fn cli_validation_names_the_flag() {
    for (args, flag) in [
        (
            &["--tp-size", "3"][..],
            "--tp-size: 3 does not divide --num-kv-heads 8",
        ),
        (&["--tp-size", "0"][..], "--tp-size: must be"),
        (&["--num-blocks", "0"][..], "--num-blocks: must be"),
        (&["--head-dim", "0"][..], "--head-dim: must be"),
        (&["--port", "0"][..], "--port: must be"),
        (
            &["--port", "5600", "--side-channel-port", "5600"][..],
            "--port: 5600 is also --side-channel-port",
        ),
        (
            &["--num-blocks", "4000000000", "--head-dim", "4096"][..],
            "--num-blocks: a pool of",
        ),
        (
            &["--pool-wait-ms", "9999999"][..],
            "--pool-wait-ms: must be",
        ),
        (
            &[
                "--kv-transfer-config",
                r#"{"kv_connector":"kvlease","kv_role":"kv_consumer"}"#,
            ][..],
            "--kv-transfer-config: kv_role: prefill-agent needs",
        ),
    ] {
        let message = prefill(args).unwrap().validate().unwrap_err().to_string();
        assert!(message.starts_with(flag), "{args:?}: {message}");
    }
    let clap_err = prefill(&["--kv-transfer-config", &extra(r#""kv_lease_duration":-1"#)])
        .unwrap_err()
        .to_string();
    assert!(clap_err.contains("--kv-transfer-config"), "{clap_err}");
    assert!(
        clap_err.contains("kv_connector_extra_config.kv_lease_duration: must be > 0 seconds"),
        "{clap_err}"
    );
    assert!(prefill(&["--transport", "rdma"]).is_err());
    let negative = prefill(&["--tp-size", "-1"]).unwrap_err().to_string();
    assert!(negative.contains("--tp-size"), "{negative}");
    assert!(prefill(&["--auth-token", ""]).is_err());
    for (args, flag) in [
        (&["--max-running", "0"][..], "--max-running: must be"),
        (&["--step-ms", "0"][..], "--step-ms: must be"),
        (&["--max-waiting", "0"][..], "--max-waiting: must be"),
    ] {
        let d =
            DecodeArgs::try_parse_from(std::iter::once("decode-agent").chain(args.iter().copied()))
                .unwrap();
        let message = d.validate().unwrap_err().to_string();
        assert!(message.starts_with(flag), "{args:?}: {message}");
    }
}

#[test]
fn engine_id_precedence_and_token_redaction() {
    let cfg = r#"{"kv_connector":"kvlease","kv_role":"kv_producer","engine_id":"from-config"}"#;
    let p = prefill(&["--kv-transfer-config", cfg]).unwrap();
    assert_eq!(p.common.engine_id().as_str(), "from-config");
    let p = prefill(&[
        "--kv-transfer-config",
        cfg,
        "--engine-id",
        "from-flag",
        "--auth-token",
        "s3cret",
    ])
    .unwrap();
    assert_eq!(p.common.engine_id().as_str(), "from-flag");
    assert!(prefill(&["--engine-id", "bad id"]).is_err());
    assert_eq!(
        p.common.auth_token.as_ref().map(AuthToken::as_bytes),
        Some(&b"s3cret"[..])
    );
    assert!(!format!("{p:?}").contains("s3cret"));
}

#[test]
fn cidrs_parse_and_match() {
    let net: Cidr = "10.0.0.0/8".parse().expect("valid");
    assert!(net.contains("10.1.2.3".parse().expect("ip")));
    assert!(!net.contains("11.0.0.1".parse().expect("ip")));
    assert!(
        net.contains("::ffff:10.0.0.1".parse().expect("ip")),
        "v4-mapped"
    );
    let host: Cidr = "192.0.2.7".parse().expect("a bare address");
    assert!(host.contains("192.0.2.7".parse().expect("ip")));
    assert!(!host.contains("192.0.2.8".parse().expect("ip")));
    let v6: Cidr = "fd00::/8".parse().expect("valid");
    assert!(v6.contains("fd12::1".parse().expect("ip")));
    let all: Cidr = "0.0.0.0/0".parse().expect("valid");
    assert!(all.contains("203.0.113.9".parse().expect("ip")));
    for bad in ["10.0.0.0/33", "fd00::/129", "nope", "10.0.0.0/x", ""] {
        assert!(bad.parse::<Cidr>().is_err(), "{bad}");
    }
}

#[test]
fn limit_flags_default_sanely_and_refuse_zero() {
    let l = prefill(&[]).unwrap().common.limits;
    assert_eq!(l.side_channel_max_connections, 64);
    assert_eq!(l.max_pending_notif_bytes, 16 << 20);
    assert_eq!(l.http_max_body_bytes, 2 << 20);
    assert_eq!(l.health_engine_stall(), Duration::from_secs(30));
    let p = prefill(&[
        "--http-max-connections",
        "3",
        "--http-header-timeout-ms",
        "250",
    ])
    .unwrap();
    p.validate().unwrap();
    assert_eq!(p.common.limits.http_max_connections, 3);
    assert_eq!(
        p.common.limits.http_header_timeout(),
        Duration::from_millis(250)
    );
    for (args, flag) in [
        (
            &["--side-channel-max-connections", "0"][..],
            "--side-channel-max-connections: must be",
        ),
        (
            &["--http-request-timeout-ms", "0"][..],
            "--http-request-timeout-ms: must be",
        ),
        (
            &["--max-pending-notif-bytes", "100"][..],
            "--max-pending-notif-bytes: must hold",
        ),
    ] {
        let message = prefill(args).unwrap().validate().unwrap_err().to_string();
        assert!(message.starts_with(flag), "{args:?}: {message}");
    }
    // A D step at least as long as the stall bound would read as a stalled engine.
    let d = DecodeArgs::try_parse_from([
        "decode-agent",
        "--step-ms",
        "500",
        "--health-engine-stall-ms",
        "500",
    ])
    .unwrap();
    let message = d.validate().unwrap_err().to_string();
    assert!(message.starts_with("--health-engine-stall-ms"), "{message}");
}

#[test]
fn http_per_source_cap_defaults_to_seven_eighths_and_stays_under_the_global_cap() {
    let l = prefill(&[]).unwrap().common.limits;
    assert_eq!(l.http_max_connections_per_source(), 224);
    let l = prefill(&["--http-max-connections", "10"])
        .unwrap()
        .common
        .limits;
    assert_eq!(l.http_max_connections_per_source(), 9);
    let l = prefill(&["--http-max-connections", "1"])
        .unwrap()
        .common
        .limits;
    assert_eq!(l.http_max_connections_per_source(), 1, "at least 1");
    let p = prefill(&[
        "--http-max-connections",
        "8",
        "--http-max-connections-per-source",
        "8",
    ])
    .unwrap();
    p.validate().unwrap();
    for args in [
        &["--http-max-connections-per-source", "0"][..],
        &[
            "--http-max-connections",
            "8",
            "--http-max-connections-per-source",
            "9",
        ][..],
    ] {
        let message = prefill(args).unwrap().validate().unwrap_err().to_string();
        assert!(
            message.starts_with("--http-max-connections-per-source: must be"),
            "{args:?}: {message}"
        );
    }
}
