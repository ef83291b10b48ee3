//! The proxy's own logic against small in-process FAKE upstreams (axum servers that record
//! what they receive and answer canned bodies): round-robin, `kv_transfer_params` copying,
//! retry-once on a retryable KV failure, pass-through of errors and streams, 502 / 504,
//! and push mode's legs (`--transfer-mode push`: transfer ids, P's identity, both legs at
//! once).
//!
//! These are not end-to-end tests of P and D: the real agents are exercised by the
//! system tests of the prefill and decode engines and by `scripts/demo.sh`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use clap::Parser as _;
use kvlease_agent::api::ApiError;
use kvlease_agent::proxy::{Proxy, ProxyArgs};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

/// One request a fake upstream received.
#[derive(Debug, Clone)]
struct Call {
    path: String,
    request_id: Option<String>,
    authorization: Option<String>,
    body: Value,
}

type Responder = dyn Fn(usize, &Value) -> Response + Send + Sync;

/// A fake upstream: records every call, answers with `respond(call_index, body)`.
struct Fake {
    calls: Mutex<Vec<Call>>,
    count: AtomicUsize,
    respond: Box<Responder>,
}

impl Fake {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("fake upstream lock").clone()
    }
}

async fn fake_handler(
    State(fake): State<Arc<Fake>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    fake.calls.lock().expect("fake upstream lock").push(Call {
        path: uri.path().to_owned(),
        request_id: header("x-request-id"),
        authorization: header("authorization"),
        body: body.clone(),
    });
    let index = fake.count.fetch_add(1, Ordering::SeqCst);
    (fake.respond)(index, &body)
}

/// Starts a fake upstream; returns it and its base URL.
async fn start_fake(
    respond: impl Fn(usize, &Value) -> Response + Send + Sync + 'static,
) -> Result<(Arc<Fake>, String)> {
    let fake = Arc::new(Fake {
        calls: Mutex::new(Vec::new()),
        count: AtomicUsize::new(0),
        respond: Box::new(respond),
    });
    let router = fake_router(fake.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok((fake, url))
}

fn fake_router(fake: Arc<Fake>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", axum::routing::post(fake_handler))
        .route("/v1/chat/completions", axum::routing::post(fake_handler))
        .with_state(fake)
}

/// A fake P whose params name it and count its calls.
async fn fake_prefill(name: &'static str) -> Result<(Arc<Fake>, String)> {
    start_fake(move |index, _| {
        axum::Json(json!({
            "id": "cmpl-p",
            "choices": [{"text": "x", "index": 0}],
            "kv_transfer_params": {
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_engine_id": name,
                "remote_block_ids": [index, index + 1],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_request_id": format!("{name}-{index}"),
                "tp_size": 1,
                "kvlease_generation": index + 1,
            }
        }))
        .into_response()
    })
    .await
}

/// A fake D answering a completion that echoes the params it got.
async fn fake_decode(name: &'static str) -> Result<(Arc<Fake>, String)> {
    start_fake(move |_, body| {
        axum::Json(json!({
            "choices": [{"text": format!("decoded by {name}"), "index": 0}],
            "echo_params": body["kv_transfer_params"],
        }))
        .into_response()
    })
    .await
}

/// Starts the proxy in front of `prefill` and `decode`; returns its base URL.
async fn start_proxy(prefill: &[&str], decode: &[&str], extra: &[&str]) -> Result<String> {
    let mut argv = vec!["kvlease-proxy", "--prefill"];
    argv.extend_from_slice(prefill);
    argv.push("--decode");
    argv.extend_from_slice(decode);
    argv.extend_from_slice(extra);
    let config = ProxyArgs::try_parse_from(argv)?.config()?;
    let proxy = Proxy::new(config)?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(proxy.serve(listener));
    Ok(url)
}

async fn post(url: &str, body: &Value) -> Result<(StatusCode, Value)> {
    let response = reqwest::Client::new()
        .post(url)
        .header("authorization", "Bearer sk-test")
        .json(body)
        .send()
        .await?;
    let status = response.status();
    let text = response.text().await?;
    let value = serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?;
    Ok((status, value))
}

async fn metric(proxy: &str, name: &str) -> Result<f64> {
    let text = reqwest::get(format!("{proxy}/metrics"))
        .await?
        .text()
        .await?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .with_context(|| format!("{name} missing from:\n{text}"))
}

/// The URL of a loopback port nothing listens on (connect is refused), and the socket
/// that keeps it bound, not listening, for as long as the caller holds it: the kernel
/// hands the port to no other bind meanwhile (a port bound and dropped could become the
/// listen port of the next proxy the test starts, which then proxied to itself).
fn closed_port_url() -> Result<(tokio::net::TcpSocket, String)> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind("127.0.0.1:0".parse()?)?;
    let url = format!("http://{}", socket.local_addr()?);
    Ok((socket, url))
}

#[tokio::test]
async fn fake_upstreams_round_robin_and_params_are_copied_verbatim() -> Result<()> {
    let (p0, p0_url) = fake_prefill("p0").await?;
    let (p1, p1_url) = fake_prefill("p1").await?;
    let (d0, d0_url) = fake_decode("d0").await?;
    let (d1, d1_url) = fake_decode("d1").await?;
    let proxy = start_proxy(&[&p0_url, &p1_url], &[&d0_url, &d1_url], &[]).await?;

    let request = json!({"model": "m", "prompt": "hello", "max_tokens": 7, "stream": false, "temperature": 0});
    let mut answered_by = Vec::new();
    for _ in 0..4 {
        let (status, answer) = post(&format!("{proxy}/v1/completions"), &request).await?;
        assert_eq!(status, StatusCode::OK, "{answer}");
        answered_by.push(
            answer["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        );
        // D got exactly what P returned.
        assert_eq!(answer["echo_params"]["do_remote_prefill"], true);
    }
    assert_eq!(
        answered_by,
        [
            "decoded by d0",
            "decoded by d1",
            "decoded by d0",
            "decoded by d1"
        ]
    );
    let (p0c, p1c, d0c, d1c) = (p0.calls(), p1.calls(), d0.calls(), d1.calls());
    assert_eq!((p0c.len(), p1c.len(), d0c.len(), d1c.len()), (2, 2, 2, 2));

    for call in p0c.iter().chain(&p1c) {
        assert_eq!(call.path, "/v1/completions");
        assert_eq!(call.body["max_tokens"], 1);
        assert_eq!(call.body["stream"], false);
        assert_eq!(call.body["prompt"], "hello");
        assert_eq!(call.body["temperature"], 0);
        assert_eq!(
            call.body["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        assert_eq!(call.authorization.as_deref(), Some("Bearer sk-test"));
        assert!(call.request_id.is_some());
    }
    // Request i went to P (i % 2) and D (i % 2); D's params are that P's answer, verbatim,
    // and D got the original body otherwise.
    let prefill_calls = [&p0c[0], &p1c[0], &p0c[1], &p1c[1]];
    let decode_calls = [&d0c[0], &d1c[0], &d0c[1], &d1c[1]];
    let names = ["p0", "p1", "p0", "p1"];
    let indices = [0, 0, 1, 1];
    for i in 0..4 {
        let (p, d) = (prefill_calls[i], decode_calls[i]);
        assert_eq!(p.request_id, d.request_id, "same X-Request-Id on P and D");
        let params = &d.body["kv_transfer_params"];
        assert_eq!(params["remote_engine_id"], names[i]);
        assert_eq!(
            params["remote_request_id"],
            format!("{}-{}", names[i], indices[i])
        );
        assert_eq!(params["kvlease_generation"], indices[i] + 1);
        assert_eq!(
            params["remote_block_ids"],
            json!([indices[i], indices[i] + 1])
        );
        assert_eq!(d.body["max_tokens"], 7);
        assert_eq!(d.body["prompt"], "hello");
        assert_eq!(d.authorization.as_deref(), Some("Bearer sk-test"));
    }
    let ids: std::collections::HashSet<_> =
        prefill_calls.iter().map(|c| c.request_id.clone()).collect();
    assert_eq!(ids.len(), 4, "every request gets its own id");
    assert_eq!(
        metric(&proxy, "kvlease_proxy_requests_total{outcome=\"ok\"}").await?,
        4.0
    );
    assert_eq!(metric(&proxy, "kvlease_proxy_retries_total").await?, 0.0);
    Ok(())
}

#[tokio::test]
async fn fake_upstreams_chat_goes_to_chat_endpoints_and_client_request_id_is_kept() -> Result<()> {
    let (p, p_url) = fake_prefill("p0").await?;
    let (d, d_url) = fake_decode("d0").await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                      "stream_options": {"include_usage": true}});
    let response = reqwest::Client::new()
        .post(format!("{proxy}/v1/chat/completions"))
        .header("x-request-id", "client-chosen-1")
        .json(&body)
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    let (pc, dc) = (&p.calls()[0], &d.calls()[0]);
    assert_eq!(pc.path, "/v1/chat/completions");
    assert_eq!(dc.path, "/v1/chat/completions");
    assert_eq!(pc.body["max_completion_tokens"], 1);
    assert_eq!(pc.body["max_tokens"], 1);
    assert!(pc.body.get("stream_options").is_none());
    assert_eq!(dc.body["max_completion_tokens"], 9);
    assert_eq!(dc.body["stream_options"]["include_usage"], true);
    assert_eq!(pc.request_id.as_deref(), Some("client-chosen-1"));
    assert_eq!(dc.request_id.as_deref(), Some("client-chosen-1"));
    Ok(())
}

#[tokio::test]
async fn fake_upstreams_retryable_kv_failure_is_retried_once_from_prefill() -> Result<()> {
    let (p, p_url) = fake_prefill("p0").await?;
    // D fails the first request's KV load, then serves.
    let (d, d_url) = start_fake(|index, body| {
        if index == 0 {
            ApiError::kv_load_failed("lease expired before the read").into_response()
        } else {
            axum::Json(
                json!({"choices": [{"text": "ok"}], "echo_params": body["kv_transfer_params"]}),
            )
            .into_response()
        }
    })
    .await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let (status, answer) = post(
        &format!("{proxy}/v1/completions"),
        &json!({"prompt": "a", "max_tokens": 2}),
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        answer["echo_params"]["remote_request_id"], "p0-1",
        "D got the second prefill's params"
    );
    let (pc, dc) = (p.calls(), d.calls());
    assert_eq!((pc.len(), dc.len()), (2, 2));
    assert_ne!(
        pc[0].request_id, pc[1].request_id,
        "the retry is a new request on P"
    );
    assert_eq!(pc[1].request_id, dc[1].request_id);
    assert_eq!(metric(&proxy, "kvlease_proxy_retries_total").await?, 1.0);
    assert_eq!(
        metric(
            &proxy,
            "kvlease_proxy_requests_total{outcome=\"ok_after_retry\"}"
        )
        .await?,
        1.0
    );

    // A D that always fails: one retry, then the failure reaches the client.
    let (p2, p2_url) = fake_prefill("p2").await?;
    let (d2, d2_url) =
        start_fake(|_, _| ApiError::kv_load_failed("stale generation").into_response()).await?;
    let proxy2 = start_proxy(&[&p2_url], &[&d2_url], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy2}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer["error"]["type"], "kv_load_failed");
    assert_eq!(
        (p2.calls().len(), d2.calls().len()),
        (2, 2),
        "retried exactly once"
    );
    assert_eq!(metric(&proxy2, "kvlease_proxy_retries_total").await?, 1.0);
    Ok(())
}

#[tokio::test]
async fn fake_upstreams_other_errors_pass_through_without_retry() -> Result<()> {
    let (p, p_url) = fake_prefill("p0").await?;
    let (d, d_url) =
        start_fake(|_, _| ApiError::overloaded("waiting queue is full (1024)").into_response())
            .await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer["error"]["type"], "overloaded");
    assert_eq!((p.calls().len(), d.calls().len()), (1, 1));
    assert_eq!(metric(&proxy, "kvlease_proxy_retries_total").await?, 0.0);

    // P's 400 reaches the client as is, and D is not called.
    let (bad_p, bad_p_url) = start_fake(|_, _| {
        ApiError::bad_field("kv_transfer_params.do_remote_decode", "must be true").into_response()
    })
    .await?;
    let (d2, d2_url) = fake_decode("d0").await?;
    let proxy2 = start_proxy(&[&bad_p_url], &[&d2_url], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy2}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer["error"]["param"],
        "kv_transfer_params.do_remote_decode"
    );
    assert_eq!((bad_p.calls().len(), d2.calls().len()), (1, 0));

    // A client body that is not a JSON object never reaches an upstream.
    for body in ["[1,2]", "{not json"] {
        let response = reqwest::Client::new()
            .post(format!("{proxy2}/v1/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
    }
    assert_eq!(bad_p.calls().len(), 1);

    // A P answer without kv_transfer_params is a 502, not a D request without them.
    let (plain, plain_url) =
        start_fake(|_, _| axum::Json(json!({"choices": []})).into_response()).await?;
    let proxy3 = start_proxy(&[&plain_url], &[&d2_url], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy3}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("without kv_transfer_params")
    );
    assert_eq!((plain.calls().len(), d2.calls().len()), (1, 0));
    Ok(())
}

#[tokio::test]
async fn fake_upstreams_down_is_502_and_slow_is_504() -> Result<()> {
    let (_held, dead) = closed_port_url()?;
    let (d, d_url) = fake_decode("d0").await?;
    let proxy = start_proxy(&[&dead], &[&d_url], &["--connect-timeout-ms", "500"]).await?;
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("prefill") && message.contains(&dead),
        "{message}"
    );
    assert!(message.contains("unreachable"), "{message}");
    assert_eq!(d.calls().len(), 0);
    assert_eq!(
        metric(
            &proxy,
            "kvlease_proxy_requests_total{outcome=\"bad_gateway\"}"
        )
        .await?,
        1.0
    );

    let (p, p_url) = fake_prefill("p0").await?;
    let proxy2 = start_proxy(&[&p_url], &[&dead], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy2}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or("")
            .starts_with("decode"),
        "{answer}"
    );
    assert_eq!(p.calls().len(), 1);

    // A D that accepts the connection and never answers: 504 after --timeout-secs.
    let silent = TcpListener::bind("127.0.0.1:0").await?;
    let silent_url = format!("http://{}", silent.local_addr()?);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let proxy3 = start_proxy(&[&p_url], &[&silent_url], &["--timeout-secs", "0.5"]).await?;
    let started = std::time::Instant::now();
    let (status, answer) =
        post(&format!("{proxy3}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{answer}");
    assert_eq!(answer["error"]["type"], "upstream_timeout");
    assert!(started.elapsed() < Duration::from_secs(10));
    Ok(())
}

/// With several agents of a role, one that cannot be reached costs no request: the
/// prefill goes to the next P (a prefill is safe to repeat), and a decode that never
/// reached its D goes to the next D.
#[tokio::test]
async fn fake_upstreams_an_unreachable_agent_is_skipped_for_the_next() -> Result<()> {
    let ((_held_p, dead_p), (_held_d, dead_d)) = (closed_port_url()?, closed_port_url()?);
    let (p, p_url) = fake_prefill("p0").await?;
    let (d, d_url) = fake_decode("d0").await?;
    let proxy = start_proxy(&[&dead_p, &p_url], &[&dead_d, &d_url], &[]).await?;
    for i in 0..4 {
        let (status, answer) = post(
            &format!("{proxy}/v1/completions"),
            &json!({"prompt": format!("prompt {i}")}),
        )
        .await?;
        assert_eq!(status, StatusCode::OK, "request {i}: {answer}");
    }
    assert_eq!((p.calls().len(), d.calls().len()), (4, 4));
    Ok(())
}

/// With one D, a D that refuses the connection for a moment (restarting on its port) gets
/// the request when it listens again; one that stays down is a 502 after the retries.
#[tokio::test]
async fn fake_upstreams_the_only_d_is_tried_again_after_a_refused_connection() -> Result<()> {
    let (p, p_url) = fake_prefill("p0").await?;
    let (socket, d_url) = closed_port_url()?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let d = Arc::new(Fake {
        calls: Mutex::new(Vec::new()),
        count: AtomicUsize::new(0),
        respond: Box::new(|_, body| {
            axum::Json(json!({"choices": [{"text": "late", "index": 0}],
                "echo_params": body["kv_transfer_params"]}))
            .into_response()
        }),
    });
    let router = fake_router(d.clone());
    // D listens 600 ms after the request started: after the first two pauses.
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let listener = socket.listen(64)?;
        tokio::spawn(async move { axum::serve(listener, router).await });
        anyhow::Ok(())
    });
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    late.await??;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["text"], "late");
    assert_eq!((p.calls().len(), d.calls().len()), (1, 1));
    Ok(())
}

/// A raw HTTP/1.1 fake D that sends one SSE chunk, then waits for `release` before the
/// rest: the client can only see the first chunk early if the proxy streams.
async fn start_streaming_fake_decode(
    release: tokio::sync::oneshot::Receiver<()>,
) -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let Ok((mut socket, _)) = listener.accept().await else {
            return;
        };
        // Read the request head and its JSON body (Content-Length) before answering.
        if !read_request(&mut socket).await {
            return;
        }
        let chunk = |data: &str| format!("{:x}\r\n{data}\r\n", data.len());
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let first = chunk("data: {\"choices\":[{\"text\":\"A\"}]}\n\n");
        if socket
            .write_all(format!("{head}{first}").as_bytes())
            .await
            .is_err()
        {
            return;
        }
        let _ = release.await;
        let rest = format!(
            "{}{}0\r\n\r\n",
            chunk("data: {\"choices\":[{\"text\":\"B\"}]}\n\n"),
            chunk("data: [DONE]\n\n")
        );
        let _ = socket.write_all(rest.as_bytes()).await;
        let _ = socket.shutdown().await;
    });
    Ok(url)
}

#[tokio::test]
async fn fake_upstreams_sse_is_streamed_through_not_buffered() -> Result<()> {
    let (p, p_url) = fake_prefill("p0").await?;
    let (release, released) = tokio::sync::oneshot::channel();
    let d_url = start_streaming_fake_decode(released).await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let mut response = reqwest::Client::new()
        .post(format!("{proxy}/v1/completions"))
        .json(&json!({"prompt": "a", "max_tokens": 2, "stream": true}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    assert_eq!(p.calls()[0].body["stream"], false, "P never streams");
    // The first event arrives while D still holds the rest.
    let first = tokio::time::timeout(Duration::from_secs(10), response.chunk())
        .await
        .context("first SSE chunk did not arrive: the proxy buffers the stream")??
        .context("stream ended early")?;
    assert!(String::from_utf8_lossy(&first).contains("\"A\""));
    let _ = release.send(());
    let mut rest = Vec::new();
    while let Some(chunk) =
        tokio::time::timeout(Duration::from_secs(10), response.chunk()).await??
    {
        rest.extend_from_slice(&chunk);
    }
    let rest = String::from_utf8(rest)?;
    assert!(
        rest.contains("\"B\"") && rest.ends_with("data: [DONE]\n\n"),
        "{rest}"
    );
    Ok(())
}

#[tokio::test]
async fn fake_upstreams_health_and_metrics_endpoints() -> Result<()> {
    let (_p, p_url) = fake_prefill("p0").await?;
    let (_d, d_url) = fake_decode("d0").await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &[]).await?;
    let health = reqwest::get(format!("{proxy}/health")).await?;
    assert_eq!(health.status(), StatusCode::OK);
    let metrics = reqwest::get(format!("{proxy}/metrics")).await?;
    assert!(
        metrics
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/openmetrics-text"))
    );
    let text = metrics.text().await?;
    assert!(text.contains("# TYPE kvlease_proxy_retries counter"));
    Ok(())
}

/// A TCP forwarder in front of `upstream` that counts the connections it accepts; the
/// first `drop_first` of them read the request and are closed without an answer (an agent
/// closing an idle keep-alive connection just as the proxy sends on it).
async fn forwarder(upstream: &str, drop_first: usize) -> Result<(Arc<AtomicUsize>, String)> {
    let upstream = upstream
        .strip_prefix("http://")
        .context("upstream URL")?
        .to_owned();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let index = count.fetch_add(1, Ordering::SeqCst);
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if index < drop_first {
                    let mut buf = [0u8; 1024];
                    let _ = client.read(&mut buf).await;
                    return;
                }
                if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok((accepted, url))
}

/// With one P, a connection that breaks under the prefill is tried once more (on a new
/// connection) instead of answering 502.
#[tokio::test]
async fn fake_upstreams_a_prefill_whose_connection_broke_is_tried_again_on_the_only_p() -> Result<()>
{
    let (p, p_url) = fake_prefill("p0").await?;
    let (accepted, flaky_p) = forwarder(&p_url, 1).await?;
    let (d, d_url) = fake_decode("d0").await?;
    let proxy = start_proxy(&[&flaky_p], &[&d_url], &[]).await?;
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert_eq!((p.calls().len(), d.calls().len()), (1, 1));
    Ok(())
}

/// Idle upstream connections are closed after `--upstream-idle-timeout-ms` (below the
/// agents' keep-alive limit), so a request after a pause opens a new one.
#[tokio::test]
async fn fake_upstreams_idle_connections_are_closed_by_the_proxy_first() -> Result<()> {
    let (_p, p_url) = fake_prefill("p0").await?;
    let (p_conns, p_fwd) = forwarder(&p_url, 0).await?;
    let (_d, d_url) = fake_decode("d0").await?;
    let pooled = start_proxy(&[&p_fwd], &[&d_url], &[]).await?;
    let short = start_proxy(&[&p_fwd], &[&d_url], &["--upstream-idle-timeout-ms", "100"]).await?;
    for proxy in [&pooled, &short] {
        for _ in 0..2 {
            let (status, answer) =
                post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
            assert_eq!(status, StatusCode::OK, "{answer}");
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
    }
    // The default pool kept one connection over the pause; the short one opened two.
    assert_eq!(p_conns.load(Ordering::SeqCst), 3);
    Ok(())
}

/// How a hostile upstream frames its endless body.
#[derive(Debug, Clone, Copy)]
enum Endless {
    /// `Content-Length: 10000000000`, then 64 KiB writes.
    Announced,
    /// `Transfer-Encoding: chunked`, 64 KiB chunks, no length known in advance.
    Chunked,
}

/// Reads one request (head and its `Content-Length` body) from `socket`; false when the
/// peer went away first.
async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&request);
        if let Some(head_end) = text.find("\r\n\r\n") {
            let length = text[..head_end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if request.len() >= head_end + 4 + length {
                return true;
            }
        }
    }
}

/// A hostile upstream (P or D): every request gets `200` and a body that never ends (up
/// to 4 GiB per connection, so the loop is bounded), in 64 KiB writes. Returns the bytes
/// it managed to send, over all connections, and its URL.
async fn start_endless_upstream(framing: Endless) -> Result<(Arc<AtomicUsize>, String)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&sent);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let sent = Arc::clone(&counter);
            tokio::spawn(async move {
                if !read_request(&mut socket).await {
                    return;
                }
                let head = match framing {
                    Endless::Announced => {
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10000000000\r\n\r\n"
                    }
                    Endless::Chunked => {
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                    }
                };
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let data = vec![b' '; 64 << 10];
                let chunk = match framing {
                    Endless::Announced => data,
                    Endless::Chunked => {
                        let mut c = format!("{:x}\r\n", data.len()).into_bytes();
                        c.extend_from_slice(&data);
                        c.extend_from_slice(b"\r\n");
                        c
                    }
                };
                for _ in 0..(4usize << 30) / chunk.len() {
                    if socket.write_all(&chunk).await.is_err() {
                        return;
                    }
                    sent.fetch_add(chunk.len(), Ordering::Relaxed);
                }
            });
        }
    });
    Ok((sent, url))
}

/// A `kvlease-proxy` process (killed on drop), so that its own memory can be read.
struct ProxyProcess {
    child: std::process::Child,
    url: String,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ProxyProcess {
    async fn start(prefill: &str, decode: &str, extra: &[&str]) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease-proxy"))
            .args(["--port", &port.to_string(), "--prefill", prefill])
            .args(["--decode", decode])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("spawning kvlease-proxy")?;
        let proxy = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        for _ in 0..200 {
            if reqwest::get(format!("{}/health", proxy.url))
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(proxy);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("kvlease-proxy did not come up on {}", proxy.url)
    }

    /// The process's peak resident memory (`VmHWM`), in KiB.
    fn peak_rss_kib(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .context("VmHWM missing from /proc/<pid>/status")
    }
}

/// A hostile P or D that answers `200` with an endless body (announced as 10 GB, or
/// chunked without a length) gets a quick 502 naming the limit, and the proxy's peak
/// memory stays far below what the body would take; D's streamed answers still pass
/// through, unbuffered, however long they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_upstream_bodies_are_capped_with_a_502_and_memory_stays_flat() -> Result<()> {
    const LIMIT: &str = "4194304";
    let (_p, honest_p) = fake_prefill("p0").await?;
    let (_d, honest_d) = fake_decode("d0").await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    for framing in [Endless::Announced, Endless::Chunked] {
        for hostile_role in ["prefill", "decode"] {
            let (sent, hostile) = start_endless_upstream(framing).await?;
            let (p, d) = if hostile_role == "prefill" {
                (hostile.as_str(), honest_d.as_str())
            } else {
                (honest_p.as_str(), hostile.as_str())
            };
            let proxy = ProxyProcess::start(
                p,
                d,
                &["--max-upstream-body-bytes", LIMIT, "--timeout-secs", "60"],
            )
            .await?;
            let start = std::time::Instant::now();
            let response = client
                .post(format!("{}/v1/completions", proxy.url))
                .json(&json!({"prompt": "a", "max_tokens": 2}))
                .send()
                .await
                .with_context(|| format!("{framing:?} {hostile_role}: no answer in 20 s"))?;
            let took = start.elapsed();
            let status = response.status();
            let text = response.text().await?;
            let case = format!("{framing:?} body from {hostile_role}");
            assert_eq!(status, StatusCode::BAD_GATEWAY, "{case}: {text}");
            assert!(
                text.contains(LIMIT) && text.contains("--max-upstream-body-bytes"),
                "{case}: the 502 must name the limit: {text}"
            );
            assert!(took < Duration::from_secs(10), "{case}: took {took:?}");
            let peak = proxy.peak_rss_kib()?;
            let sent_mib = sent.load(Ordering::Relaxed) >> 20;
            eprintln!(
                "{case}: 502 after {took:?}, proxy VmHWM {peak} KiB, upstream sent {sent_mib} MiB"
            );
            assert!(
                peak < 64 << 10,
                "{case}: the proxy's peak RSS reached {peak} KiB"
            );
        }
    }

    // A streamed D answer is passed through as it comes, not read whole: 32 MiB of an
    // endless one leave the proxy's memory where it was.
    let (sent, hostile) = start_endless_upstream(Endless::Chunked).await?;
    let proxy = ProxyProcess::start(
        &honest_p,
        &hostile,
        &["--max-upstream-body-bytes", LIMIT, "--timeout-secs", "60"],
    )
    .await?;
    let mut response = client
        .post(format!("{}/v1/completions", proxy.url))
        .json(&json!({"prompt": "a", "max_tokens": 2, "stream": true}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    let mut received = 0usize;
    while received < 32 << 20 {
        let chunk = response.chunk().await?.context("the stream ended early")?;
        received += chunk.len();
    }
    drop(response);
    let peak = proxy.peak_rss_kib()?;
    eprintln!(
        "streamed: {} MiB through, proxy VmHWM {peak} KiB, upstream sent {} MiB",
        received >> 20,
        sent.load(Ordering::Relaxed) >> 20
    );
    assert!(
        peak < 64 << 10,
        "streamed: the proxy's peak RSS reached {peak} KiB"
    );
    Ok(())
}

/// A proxy that is its own upstream (here its `--prefill` is its own URL; the audit's
/// flaky test got there when a port it had just released became the proxy's listen
/// port) used to call itself until something gave out (P was called 224 times). The
/// request now carries the proxy's hop header, and the proxy refuses a request that
/// already passed through it: one 508 `loop_detected`, one forwarded request, no decode.
#[tokio::test]
async fn fake_upstreams_a_proxy_that_is_its_own_upstream_refuses_the_loop() -> Result<()> {
    let (d, d_url) = fake_decode("d0").await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let own = format!("http://{}", listener.local_addr()?);
    let config =
        ProxyArgs::try_parse_from(["kvlease-proxy", "--prefill", &own, "--decode", &d_url])?
            .config()?;
    tokio::spawn(Proxy::new(config)?.serve(listener));
    let (status, answer) = post(&format!("{own}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::LOOP_DETECTED, "{answer}");
    assert_eq!(answer["error"]["type"], "loop_detected");
    assert_eq!(
        metric(&own, "kvlease_proxy_requests_total{outcome=\"loop\"}").await?,
        1.0
    );
    assert_eq!(
        metric(&own, "kvlease_proxy_prefill_requests_total").await?,
        1.0,
        "the proxy forwarded the request to itself once"
    );
    assert!(d.calls().is_empty());
    // A request from further away that passed too many proxies is refused as well.
    let hops = (0..8)
        .map(|i| format!("p{i}"))
        .collect::<Vec<_>>()
        .join(",");
    let response = reqwest::Client::new()
        .post(format!("{own}/v1/completions"))
        .header("x-kvlease-proxy", hops)
        .json(&json!({"prompt": "a"}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::LOOP_DETECTED);
    Ok(())
}

/// A hostile upstream that answers each request with 3 MiB of body and then stalls (no
/// `Content-Length`: the proxy cannot refuse it up front) used to make the proxy hold
/// every such body at once (32 took 1.3 GB in the audit). The proxy now holds at most
/// `--max-buffered-body-bytes` (16 MiB here) in bodies: the requests beyond it get a
/// retryable 503 with `Retry-After` at once, and its peak memory stays flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bodies_the_proxy_holds_at_once_stay_within_their_budget() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let hostile = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                if !read_request(&mut socket).await {
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if socket.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let mut chunk = format!("{:x}\r\n", 64 << 10).into_bytes();
                chunk.extend_from_slice(&[b' '; 64 << 10]);
                chunk.extend_from_slice(b"\r\n");
                for _ in 0..48 {
                    if socket.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
                // Hold the body open: the proxy keeps what it read until its timeout.
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        }
    });
    let (_d, d_url) = fake_decode("d0").await?;
    let proxy = ProxyProcess::start(
        &hostile,
        &d_url,
        &[
            "--max-upstream-body-bytes",
            "4194304",
            "--max-buffered-body-bytes",
            "16777216",
            "--timeout-secs",
            "4",
        ],
    )
    .await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    let requests = (0..32).map(|i| {
        let (client, url) = (client.clone(), format!("{}/v1/completions", proxy.url));
        tokio::spawn(async move {
            let r = client
                .post(url)
                .json(&json!({"prompt": format!("p{i}")}))
                .send()
                .await?;
            let (status, retry_after) = (r.status(), r.headers().get("retry-after").cloned());
            let body: Value = serde_json::from_str(&r.text().await?)?;
            anyhow::Ok((status, retry_after, body))
        })
    });
    let mut refused = 0;
    for r in futures_util::future::join_all(requests).await {
        let (status, retry_after, body) = r??;
        match status {
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(body["error"]["type"], "overloaded", "{body}");
                assert_eq!(body["error"]["retryable"], true, "{body}");
                assert!(retry_after.is_some(), "no Retry-After: {body}");
                refused += 1;
            }
            StatusCode::GATEWAY_TIMEOUT => {}
            other => panic!("{other}: {body}"),
        }
    }
    // 16 MiB hold 5 bodies of 3 MiB at most (fewer while reads are under way).
    assert!(refused >= 24, "{refused} of 32 refused");
    let peak = proxy.peak_rss_kib()?;
    eprintln!("budget: {refused} refused, proxy VmHWM {peak} KiB");
    assert!(peak < 64 << 10, "the proxy's peak RSS reached {peak} KiB");
    Ok(())
}

// ---- push mode (`--transfer-mode push`) ----

/// What the push-mode fakes did, in order: `p{i} received`, `p{i} answered`,
/// `d{i} received`, `d{i} answered` (`i`: the fake's call index).
type Log = Arc<Mutex<Vec<String>>>;

fn logged(log: &Log) -> Vec<String> {
    log.lock().expect("log lock").clone()
}

fn log_position(log: &Log, entry: &str) -> Option<usize> {
    logged(log).iter().position(|e| e == entry)
}

type PushResponder = dyn Fn(usize, &Value) -> Response + Send + Sync;

/// A push-mode fake upstream: records its calls and logs them; a P may hold its answer to
/// call `i` until the log shows `d{i} received` (at most 5 s), so that a P leg sent
/// alongside its D leg answers only after D's leg arrived, and one sent before D's leg
/// answers after 5 s, its D leg still to come.
struct PushFake {
    role: &'static str,
    calls: Mutex<Vec<Call>>,
    count: AtomicUsize,
    log: Log,
    hold_from: usize,
    respond: Box<PushResponder>,
}

impl PushFake {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("fake upstream lock").clone()
    }
}

async fn push_fake_handler(
    State(fake): State<Arc<PushFake>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let index = {
        let mut calls = fake.calls.lock().expect("fake upstream lock");
        calls.push(Call {
            path: uri.path().to_owned(),
            request_id,
            authorization: None,
            body: body.clone(),
        });
        let index = fake.count.fetch_add(1, Ordering::SeqCst);
        fake.log
            .lock()
            .expect("log lock")
            .push(format!("{}{index} received", fake.role));
        index
    };
    if fake.role == "p" && index >= fake.hold_from {
        let wanted = format!("d{index} received");
        for _ in 0..500 {
            if log_position(&fake.log, &wanted).is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let response = (fake.respond)(index, &body);
    fake.log
        .lock()
        .expect("log lock")
        .push(format!("{}{index} answered", fake.role));
    response
}

async fn start_push_fake(
    role: &'static str,
    log: &Log,
    hold_from: usize,
    respond: impl Fn(usize, &Value) -> Response + Send + Sync + 'static,
) -> Result<(Arc<PushFake>, String)> {
    let fake = Arc::new(PushFake {
        role,
        calls: Mutex::new(Vec::new()),
        count: AtomicUsize::new(0),
        log: Arc::clone(log),
        hold_from,
        respond: Box::new(respond),
    });
    let router = axum::Router::new()
        .route("/v1/completions", axum::routing::post(push_fake_handler))
        .route(
            "/v1/chat/completions",
            axum::routing::post(push_fake_handler),
        )
        .with_state(fake.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok((fake, url))
}

/// A P's push-mode answer naming `engine` (its side channel `host:port`, TP size 2).
fn push_prefill_answer(engine: &str, host: &str, port: u16) -> Response {
    axum::Json(json!({
        "id": "cmpl-p",
        "choices": [{"text": "x", "index": 0}],
        "kv_transfer_params": {
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_mode": "push",
            "remote_engine_id": engine,
            "remote_request_id": "p-internal-id",
            "remote_host": host,
            "remote_port": port,
            "tp_size": 2,
        }
    }))
    .into_response()
}

/// A fake push D: echoes the params it got, as JSON or (`stream: true`) as server-sent
/// events.
fn push_decode_answer(index: usize, body: &Value) -> Response {
    if body["stream"] == true {
        let events = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [{"text": "A"}], "echo_params": body["kv_transfer_params"]}),
            json!({"choices": [{"text": "B"}]}),
        );
        return ([("content-type", "text/event-stream")], events).into_response();
    }
    axum::Json(json!({
        "choices": [{"text": format!("decoded {index}"), "index": 0}],
        "echo_params": body["kv_transfer_params"],
    }))
    .into_response()
}

/// Polls the proxy's `series` until it equals `want` (10 s at most).
async fn wait_metric(proxy: &str, series: &str, want: f64) -> Result<()> {
    for _ in 0..1000 {
        if metric(proxy, series).await? == want {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!(
        "{series} = {}, not {want}, after 10 s",
        metric(proxy, series).await?
    )
}

/// Waits until `fake` logged `entry` (10 s at most).
async fn wait_logged(log: &Log, entry: &str) -> Result<()> {
    for _ in 0..1000 {
        if log_position(log, entry).is_some() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("{entry:?} not logged in 10 s: {:?}", logged(log))
}

const CONCURRENT: &str = "kvlease_proxy_push_legs_total{dispatch=\"concurrent\"}";
const SEQUENTIAL: &str = "kvlease_proxy_push_legs_total{dispatch=\"sequential\"}";
const PUSH_FAILURES: &str = "kvlease_proxy_push_prefill_failures_total";
const IDENTITY_CHANGES: &str = "kvlease_proxy_push_identity_changes_total";

/// The push-mode D params the proxy must send for P `engine` at `host:port` (TP 2).
fn push_params(transfer: &Value, engine: &str, host: &str, port: u16) -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "transfer_mode": "push",
           "transfer_id": transfer, "remote_engine_id": engine, "remote_host": host,
           "remote_port": port, "tp_size": 2})
}

/// The first request to a P waits for P's answer: D's leg goes out after it, names the
/// identity that answer carried and the transfer id P's leg got; the client gets D's
/// answer. P's leg is pull's, plus the transfer id.
#[tokio::test]
async fn push_the_first_request_to_a_prefill_waits_for_its_answer() -> Result<()> {
    let log = Log::default();
    let (p, p_url) = start_push_fake("p", &log, usize::MAX, |_, _| {
        push_prefill_answer("p0", "10.0.0.11", 5601)
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, push_decode_answer).await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let request = json!({"model": "m", "prompt": "hello", "max_tokens": 7, "temperature": 0});
    let (status, answer) = post(&format!("{proxy}/v1/completions"), &request).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["text"], "decoded 0", "D's answer");
    assert_eq!(
        logged(&log),
        ["p0 received", "p0 answered", "d0 received", "d0 answered"],
        "D's leg after P's answer"
    );
    let (pc, dc) = (&p.calls()[0], &d.calls()[0]);
    let transfer = &pc.body["kv_transfer_params"]["transfer_id"];
    assert!(transfer.is_string(), "{}", pc.body);
    assert_eq!(
        pc.body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null,
               "transfer_id": transfer})
    );
    assert_eq!(
        (pc.body["max_tokens"].clone(), pc.body["stream"].clone()),
        (json!(1), json!(false))
    );
    assert_eq!(
        dc.body["kv_transfer_params"],
        push_params(transfer, "p0", "10.0.0.11", 5601)
    );
    assert_eq!(answer["echo_params"], dc.body["kv_transfer_params"]);
    assert_eq!(dc.body["max_tokens"], 7);
    assert_eq!(dc.body["prompt"], "hello");
    assert!(pc.request_id.is_some());
    assert_eq!(pc.request_id, dc.request_id, "same X-Request-Id on P and D");
    assert_eq!(metric(&proxy, SEQUENTIAL).await?, 1.0);
    assert_eq!(metric(&proxy, CONCURRENT).await?, 0.0);
    assert_eq!(
        metric(&proxy, "kvlease_proxy_requests_total{outcome=\"ok\"}").await?,
        1.0
    );

    // A P answer without its identity: 502 naming the missing key, and D is not asked.
    let (plain, plain_url) = start_fake(|_, _| {
        axum::Json(json!({"kv_transfer_params": {"remote_engine_id": "p1",
                                                   "remote_host": "h", "tp_size": 1}}))
        .into_response()
    })
    .await?;
    let (d2, d2_url) = fake_decode("d2").await?;
    let proxy2 = start_proxy(&[&plain_url], &[&d2_url], &["--transfer-mode", "push"]).await?;
    let (status, answer) =
        post(&format!("{proxy2}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("without remote_port"), "{message}");
    assert_eq!((plain.calls().len(), d2.calls().len()), (1, 0));
    Ok(())
}

/// Once a P's identity is known, P's and D's legs go out at once: D's leg arrives while P
/// still holds its answer, names the identity learned before and the transfer id of this
/// request's P leg; D's answers, JSON or server-sent events, reach the client.
#[tokio::test]
async fn push_a_known_prefill_gets_its_leg_at_the_same_time_as_decode() -> Result<()> {
    let log = Log::default();
    // P holds its answers from the second call on until D's leg of that request came.
    let (p, p_url) = start_push_fake("p", &log, 1, |_, _| {
        push_prefill_answer("p0", "10.0.0.11", 5601)
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, push_decode_answer).await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let url = format!("{proxy}/v1/completions");
    let (status, answer) = post(&url, &json!({"prompt": "one", "max_tokens": 3})).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");

    // The second request: JSON, with the client's own X-Request-Id.
    let response = reqwest::Client::new()
        .post(&url)
        .header("x-request-id", "client-id-2")
        .json(&json!({"prompt": "two", "max_tokens": 3}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    let answer: Value = response.json().await?;
    assert_eq!(answer["choices"][0]["text"], "decoded 1");
    wait_logged(&log, "p1 answered").await?;
    let (d_at, p_at) = (
        log_position(&log, "d1 received"),
        log_position(&log, "p1 answered"),
    );
    assert!(
        d_at.is_some() && d_at < p_at,
        "D's leg before P's answer: {:?}",
        logged(&log)
    );

    // The third: streamed; its events pass through.
    let mut response = reqwest::Client::new()
        .post(&url)
        .json(&json!({"prompt": "three", "max_tokens": 3, "stream": true}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    let mut text = Vec::new();
    while let Some(chunk) =
        tokio::time::timeout(Duration::from_secs(10), response.chunk()).await??
    {
        text.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(text)?;
    assert!(
        text.contains("\"A\"") && text.contains("\"B\"") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    wait_logged(&log, "p2 answered").await?;
    let (d_at, p_at) = (
        log_position(&log, "d2 received"),
        log_position(&log, "p2 answered"),
    );
    assert!(
        d_at.is_some() && d_at < p_at,
        "D's leg before P's answer: {:?}",
        logged(&log)
    );

    let (pc, dc) = (p.calls(), d.calls());
    assert_eq!((pc.len(), dc.len()), (3, 3));
    for i in 1..3 {
        let transfer = &pc[i].body["kv_transfer_params"]["transfer_id"];
        assert_eq!(
            dc[i].body["kv_transfer_params"],
            push_params(transfer, "p0", "10.0.0.11", 5601),
            "request {i}"
        );
        assert_ne!(
            transfer,
            &pc[i - 1].body["kv_transfer_params"]["transfer_id"],
            "a new transfer id per request"
        );
        assert_eq!(pc[i].request_id, dc[i].request_id);
        assert_eq!(pc[i].body["stream"], false, "P never streams");
        assert_eq!(pc[i].body["max_tokens"], 1);
    }
    assert_eq!(pc[1].request_id.as_deref(), Some("client-id-2"));
    assert_eq!(dc[2].body["stream"], true);
    assert_eq!(metric(&proxy, SEQUENTIAL).await?, 1.0);
    assert_eq!(metric(&proxy, CONCURRENT).await?, 2.0);
    assert_eq!(metric(&proxy, PUSH_FAILURES).await?, 0.0);
    assert_eq!(metric(&proxy, IDENTITY_CHANGES).await?, 0.0);
    assert_eq!(
        metric(&proxy, "kvlease_proxy_requests_total{outcome=\"ok\"}").await?,
        3.0
    );
    Ok(())
}

/// A P that answers its first request and then closes the connection of the second
/// without an answer (`Connection: close` on every answer: no pooled connections), and
/// answers again from the third on.
async fn start_prefill_that_drops_its_second_call() -> Result<(Arc<AtomicUsize>, String)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let calls = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&calls);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                if !read_request(&mut socket).await {
                    return;
                }
                if count.fetch_add(1, Ordering::SeqCst) == 1 {
                    return; // closed without an answer
                }
                let body = json!({"kv_transfer_params": {"remote_engine_id": "p0",
                    "remote_host": "10.0.0.11", "remote_port": 5601, "tp_size": 2}})
                .to_string();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    Ok((calls, url))
}

/// A P leg sent alongside its D leg that fails (an error status, or a connection closed
/// without an answer) does not fail the client's request: D's answer reaches the client,
/// the failure is counted, and the next request to that P waits for its answer again.
#[tokio::test]
async fn push_a_failed_prefill_leg_sent_with_decode_leaves_the_request_to_decode() -> Result<()> {
    let log = Log::default();
    let (p500, p500_url) = start_push_fake("p", &log, usize::MAX, |index, _| {
        if index == 1 {
            (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response()
        } else {
            push_prefill_answer("p0", "10.0.0.11", 5601)
        }
    })
    .await?;
    let (pclosed_calls, pclosed_url) = start_prefill_that_drops_its_second_call().await?;
    for (case, p_url) in [("500", &p500_url), ("closed", &pclosed_url)] {
        let (d, d_url) = fake_decode("d0").await?;
        let proxy = start_proxy(&[p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
        let url = format!("{proxy}/v1/completions");
        for i in 0..3 {
            let (status, answer) = post(&url, &json!({"prompt": format!("p{i}")})).await?;
            assert_eq!(status, StatusCode::OK, "{case}: request {i}: {answer}");
            assert_eq!(answer["choices"][0]["text"], "decoded by d0");
            if i == 1 {
                // The second request's P leg fails on its own task.
                wait_metric(&proxy, PUSH_FAILURES, 1.0).await?;
            }
        }
        assert_eq!(d.calls().len(), 3, "{case}");
        assert_eq!(metric(&proxy, PUSH_FAILURES).await?, 1.0, "{case}");
        // The first and the third (after the failure) waited for P; the second did not.
        assert_eq!(metric(&proxy, SEQUENTIAL).await?, 2.0, "{case}");
        assert_eq!(metric(&proxy, CONCURRENT).await?, 1.0, "{case}");
        assert_eq!(
            metric(&proxy, "kvlease_proxy_requests_total{outcome=\"ok\"}").await?,
            3.0,
            "{case}"
        );
    }
    assert_eq!(p500.calls().len(), 3);
    assert_eq!(pclosed_calls.load(Ordering::SeqCst), 3);
    Ok(())
}

/// A P that answers with another identity (restarted) replaces the one remembered: the
/// next D leg names the new one, and the change is counted.
#[tokio::test]
async fn push_a_changed_prefill_identity_is_learned_and_counted() -> Result<()> {
    let log = Log::default();
    let (p, p_url) = start_push_fake("p", &log, usize::MAX, |index, _| {
        if index == 0 {
            push_prefill_answer("p0-old", "10.0.0.11", 5601)
        } else {
            push_prefill_answer("p0-new", "10.0.0.12", 5602)
        }
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, push_decode_answer).await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let url = format!("{proxy}/v1/completions");
    for i in 0..3 {
        let (status, answer) = post(&url, &json!({"prompt": format!("p{i}")})).await?;
        assert_eq!(status, StatusCode::OK, "request {i}: {answer}");
        wait_logged(&log, &format!("p{i} answered")).await?;
        if i == 1 {
            // P's answer to the second request (sent with its D leg) names the new one.
            wait_metric(&proxy, IDENTITY_CHANGES, 1.0).await?;
        }
    }
    let (pc, dc) = (p.calls(), d.calls());
    let transfer = |i: usize| pc[i].body["kv_transfer_params"]["transfer_id"].clone();
    // The first waited for P; the second named what P answered to the first (P answered
    // it another identity); the third names the new one.
    assert_eq!(
        dc[0].body["kv_transfer_params"],
        push_params(&transfer(0), "p0-old", "10.0.0.11", 5601)
    );
    assert_eq!(
        dc[1].body["kv_transfer_params"],
        push_params(&transfer(1), "p0-old", "10.0.0.11", 5601)
    );
    assert_eq!(
        dc[2].body["kv_transfer_params"],
        push_params(&transfer(2), "p0-new", "10.0.0.12", 5602)
    );
    assert_eq!(metric(&proxy, IDENTITY_CHANGES).await?, 1.0);
    assert_eq!(metric(&proxy, PUSH_FAILURES).await?, 0.0);
    assert_eq!(metric(&proxy, CONCURRENT).await?, 2.0);
    Ok(())
}

/// Transfer ids are the proxy's own: distinct across requests (and retries), never the
/// client's X-Request-Id, which both legs carry as in pull mode.
#[tokio::test]
async fn push_transfer_ids_are_distinct_and_not_the_client_request_id() -> Result<()> {
    let log = Log::default();
    let (p, p_url) = start_push_fake("p", &log, usize::MAX, |_, _| {
        push_prefill_answer("p0", "10.0.0.11", 5601)
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, push_decode_answer).await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let ids = ["same", "same", "client-3", "client-4"];
    for id in ids {
        let response = reqwest::Client::new()
            .post(format!("{proxy}/v1/completions"))
            .header("x-request-id", id)
            .json(&json!({"prompt": "a"}))
            .send()
            .await?;
        assert_eq!(response.status(), StatusCode::OK);
    }
    wait_logged(&log, "p3 answered").await?;
    let (pc, dc) = (p.calls(), d.calls());
    assert_eq!((pc.len(), dc.len()), (4, 4));
    let p_transfers: Vec<String> = pc
        .iter()
        .map(|c| {
            c.body["kv_transfer_params"]["transfer_id"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    let d_transfers: Vec<String> = dc
        .iter()
        .map(|c| {
            c.body["kv_transfer_params"]["transfer_id"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(
        p_transfers, d_transfers,
        "each D leg has its P leg's transfer id"
    );
    let distinct: std::collections::HashSet<_> = p_transfers.iter().collect();
    assert_eq!(distinct.len(), 4, "{p_transfers:?}");
    for (i, t) in p_transfers.iter().enumerate() {
        assert!(!t.is_empty());
        assert!(!ids.contains(&t.as_str()), "{t} is a client's id");
        assert_eq!(pc[i].request_id.as_deref(), Some(ids[i]));
        assert_eq!(dc[i].request_id.as_deref(), Some(ids[i]));
    }
    Ok(())
}

/// D's retryable KV failure is retried once through the push flow, with a new transfer
/// id (here on the only P, whose identity is known by then: both legs at once).
#[tokio::test]
async fn push_a_retryable_kv_failure_is_retried_once_with_a_new_transfer_id() -> Result<()> {
    let log = Log::default();
    let (p, p_url) = start_push_fake("p", &log, usize::MAX, |_, _| {
        push_prefill_answer("p0", "10.0.0.11", 5601)
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, |index, body| {
        if index == 0 {
            ApiError::kv_load_failed("the push failed").into_response()
        } else {
            push_decode_answer(index, body)
        }
    })
    .await?;
    let proxy = start_proxy(&[&p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    wait_logged(&log, "p1 answered").await?;
    let (pc, dc) = (p.calls(), d.calls());
    assert_eq!((pc.len(), dc.len()), (2, 2));
    let transfer = |c: &Call| c.body["kv_transfer_params"]["transfer_id"].clone();
    assert_ne!(transfer(&pc[0]), transfer(&pc[1]), "a new transfer id");
    for i in 0..2 {
        assert_eq!(transfer(&pc[i]), transfer(&dc[i]));
    }
    assert_ne!(
        pc[0].request_id, pc[1].request_id,
        "the retry is a new request"
    );
    assert_eq!(
        answer["echo_params"],
        push_params(&transfer(&pc[1]), "p0", "10.0.0.11", 5601)
    );
    assert_eq!(metric(&proxy, "kvlease_proxy_retries_total").await?, 1.0);
    assert_eq!(
        metric(
            &proxy,
            "kvlease_proxy_requests_total{outcome=\"ok_after_retry\"}"
        )
        .await?,
        1.0
    );
    assert_eq!(metric(&proxy, SEQUENTIAL).await?, 1.0);
    assert_eq!(metric(&proxy, CONCURRENT).await?, 1.0);
    Ok(())
}

/// A P that cannot be reached while the proxy waits for its answer is skipped for the
/// next P, as in pull mode; D's leg names the P that answered.
#[tokio::test]
async fn push_an_unreachable_prefill_is_skipped_when_its_answer_is_awaited() -> Result<()> {
    let (_held, dead) = closed_port_url()?;
    let log = Log::default();
    let (p, p_url) = start_push_fake("p", &log, usize::MAX, |_, _| {
        push_prefill_answer("p1", "10.0.0.12", 5602)
    })
    .await?;
    let (d, d_url) = start_push_fake("d", &log, 0, push_decode_answer).await?;
    let proxy = start_proxy(&[&dead, &p_url], &[&d_url], &["--transfer-mode", "push"]).await?;
    let (status, answer) =
        post(&format!("{proxy}/v1/completions"), &json!({"prompt": "a"})).await?;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let transfer = p.calls()[0].body["kv_transfer_params"]["transfer_id"].clone();
    assert_eq!(
        d.calls()[0].body["kv_transfer_params"],
        push_params(&transfer, "p1", "10.0.0.12", 5602)
    );
    assert_eq!(metric(&proxy, SEQUENTIAL).await?, 1.0);
    Ok(())
}
