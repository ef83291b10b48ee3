use clap::Parser;

use super::*;

#[test]
fn retryable_kv_failure_is_exactly_the_documented_shape() {
    let body = ApiError::kv_load_failed("stale").body().to_string();
    assert!(is_retryable_kv_failure(
        StatusCode::SERVICE_UNAVAILABLE,
        body.as_bytes()
    ));
    assert!(!is_retryable_kv_failure(
        StatusCode::INTERNAL_SERVER_ERROR,
        body.as_bytes()
    ));
    let overloaded = ApiError::overloaded("queue full").body().to_string();
    assert!(!is_retryable_kv_failure(
        StatusCode::SERVICE_UNAVAILABLE,
        overloaded.as_bytes()
    ));
    let not_retryable = br#"{"error":{"type":"kv_load_failed","retryable":false}}"#;
    assert!(!is_retryable_kv_failure(
        StatusCode::SERVICE_UNAVAILABLE,
        not_retryable
    ));
    assert!(!is_retryable_kv_failure(
        StatusCode::SERVICE_UNAVAILABLE,
        b"<html>"
    ));
}

fn args(extra: &[&str]) -> ProxyArgs {
    let base = [
        "kvlease-proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
    ];
    ProxyArgs::try_parse_from(base.iter().copied().chain(extra.iter().copied())).unwrap()
}

#[test]
fn flags_are_checked_and_errors_name_them() {
    let c = args(&["http://127.0.0.1:2/", "http://localhost:3/base"])
        .config()
        .unwrap();
    assert_eq!(c.decode.len(), 2);
    assert_eq!(
        join(&c.decode[0], "/v1/completions").as_str(),
        "http://127.0.0.1:2/v1/completions"
    );
    assert_eq!(
        join(&c.decode[1], "/v1/completions").as_str(),
        "http://localhost:3/base/v1/completions"
    );
    for (extra, start) in [
        (
            &["https://x:1"][..],
            "--decode: \"https://x:1\": only http://",
        ),
        (&["not a url"][..], "--decode: \"not a url\""),
        (
            &["http://x:1", "--timeout-secs", "0"][..],
            "--timeout-secs: must be > 0",
        ),
        (
            &["http://x:1", "--timeout-secs", "NaN"][..],
            "--timeout-secs: must be > 0",
        ),
        (
            &["http://x:1", "--connect-timeout-ms", "0"][..],
            "--connect-timeout-ms",
        ),
        (
            &["http://x:1", "--upstream-idle-timeout-ms", "0"][..],
            "--upstream-idle-timeout-ms: must be 1..=600000",
        ),
        (&["http://x:1", "--port", "0"][..], "--port"),
        (
            &["http://x:1", "--max-upstream-body-bytes", "0"][..],
            "--max-upstream-body-bytes: must be 1..=1073741824, got 0",
        ),
        (
            &["http://x:1", "--max-upstream-body-bytes", "1073741825"][..],
            "--max-upstream-body-bytes: must be 1..=1073741824",
        ),
        (
            &["http://x:1", "--http-max-connections", "0"][..],
            "--http-max-connections: must be at least 1",
        ),
        (
            &["http://x:1", "--http-max-connections-per-source", "0"][..],
            "--http-max-connections-per-source: must be 1..=--http-max-connections (256), got 0",
        ),
        (
            &[
                "http://x:1",
                "--http-max-connections",
                "8",
                "--http-max-connections-per-source",
                "9",
            ][..],
            "--http-max-connections-per-source: must be 1..=--http-max-connections (8)",
        ),
        (
            &["http://x:1", "--http-header-timeout-ms", "0"][..],
            "--http-header-timeout-ms: must be 1..=600000",
        ),
    ] {
        let message = args(extra).config().unwrap_err().to_string();
        assert!(message.starts_with(start), "{extra:?}: {message}");
    }
    assert!(ProxyArgs::try_parse_from(["kvlease-proxy", "--prefill", "http://a:1"]).is_err());
    let http = args(&["http://x:1"]).config().unwrap().http;
    assert_eq!(
        (http.max_connections, http.max_connections_per_source),
        (256, 224),
        "seven eighths of the global cap by default"
    );
    assert_eq!(http.header_timeout, Duration::from_secs(10));
    let http = args(&["http://x:1", "--http-max-connections", "40"])
        .config()
        .unwrap()
        .http;
    assert_eq!(http.max_connections_per_source, 35);
}

#[test]
fn proxy_metrics_expose_the_retry_counter() {
    let m = ProxyMetrics::new();
    m.retries.inc();
    m.request(ProxyOutcome::OkAfterRetry).inc();
    let text = m.encode();
    assert!(text.contains("# TYPE kvlease_proxy_retries counter\n"));
    assert!(text.contains("\nkvlease_proxy_retries_total 1\n"), "{text}");
    assert!(text.contains("kvlease_proxy_requests_total{outcome=\"ok_after_retry\"} 1\n"));
    assert!(text.contains("kvlease_proxy_requests_total{outcome=\"bad_gateway\"} 0\n"));
}

#[test]
fn transfer_mode_defaults_to_pull_and_a_bad_one_is_refused_naming_the_flag() {
    assert_eq!(
        args(&["http://x:1"]).config().unwrap().transfer_mode,
        TransferMode::Pull
    );
    assert_eq!(
        args(&["http://x:1", "--transfer-mode", "push"])
            .config()
            .unwrap()
            .transfer_mode,
        TransferMode::Push
    );
    let error = ProxyArgs::try_parse_from([
        "kvlease-proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--transfer-mode",
        "bogus",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("--transfer-mode") && error.contains("bogus"),
        "{error}"
    );
    assert!(error.contains("pull") && error.contains("push"), "{error}");
}

#[test]
fn prefill_identity_needs_every_key_and_names_the_one_at_fault() {
    let good = json!({"remote_engine_id": "p0", "remote_host": "10.0.0.1", "remote_port": 5600,
                      "tp_size": 2, "remote_request_id": "r", "remote_block_ids": null});
    assert_eq!(
        PrefillIdentity::from_params(&good).unwrap(),
        PrefillIdentity {
            engine_id: "p0".to_owned(),
            host: "10.0.0.1".to_owned(),
            port: 5600,
            tp_size: 2,
        }
    );
    for (key, bad, said) in [
        ("remote_engine_id", Value::Null, "without remote_engine_id"),
        (
            "remote_host",
            json!(""),
            "with remote_host not a non-empty string",
        ),
        (
            "remote_port",
            json!(70_000),
            "with remote_port not a port number",
        ),
        (
            "remote_port",
            json!("5600"),
            "with remote_port not a port number",
        ),
        ("tp_size", json!(0), "with tp_size not a positive integer"),
    ] {
        let mut params = good.clone();
        params[key] = bad;
        assert_eq!(PrefillIdentity::from_params(&params).unwrap_err(), said);
    }
    let mut params = good;
    params.as_object_mut().unwrap().remove("tp_size");
    assert_eq!(
        PrefillIdentity::from_params(&params).unwrap_err(),
        "without tp_size"
    );
}

#[test]
fn proxy_metrics_expose_the_push_counters() {
    let m = ProxyMetrics::new();
    m.push_legs(PushDispatch::Concurrent).inc();
    m.push_prefill_failures.inc();
    let text = m.encode();
    assert!(
        text.contains("kvlease_proxy_push_legs_total{dispatch=\"concurrent\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("kvlease_proxy_push_legs_total{dispatch=\"sequential\"} 0\n"));
    assert!(text.contains("\nkvlease_proxy_push_prefill_failures_total 1\n"));
    assert!(text.contains("\nkvlease_proxy_push_identity_changes_total 0\n"));
}

/// An agent that could not be reached is followed by the one after it in the list, even
/// when other requests moved the rotation so that its next agent is the failed one again
/// (with two P and concurrent requests, a dead P was tried twice and the request failed
/// with a 502 while the other P was up).
#[test]
fn an_unreachable_agent_is_followed_by_the_one_after_it_whatever_the_rotation_says() {
    let argv = [
        "kvlease-proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "--decode",
        "http://127.0.0.1:3",
        "http://127.0.0.1:4",
    ];
    let config = ProxyArgs::try_parse_from(argv).unwrap().config().unwrap();
    let (prefill, decode) = (config.prefill.clone(), config.decode.clone());
    let proxy = Proxy::new(config).unwrap();
    for (is_decode, urls) in [(false, &prefill), (true, &decode)] {
        // This request's first try went to urls[0], then another request took urls[1]:
        // the rotation's next is urls[0], the one that failed.
        assert_eq!(proxy.next_base(is_decode), urls[0]);
        assert_eq!(proxy.next_base(is_decode), urls[1]);
        assert_eq!(proxy.base_after(is_decode, &urls[0]), urls[1]);
        assert_eq!(proxy.base_after(is_decode, &urls[1]), urls[0]);
    }
    let one = ProxyArgs::try_parse_from([
        "kvlease-proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:3",
    ])
    .unwrap()
    .config()
    .unwrap();
    let only = one.prefill[0].clone();
    let proxy = Proxy::new(one).unwrap();
    assert_eq!(proxy.base_after(false, &only), only);
}
