//! The proxy's own logic against small in-process FAKE upstreams (axum servers that record
//! what they receive and answer canned bodies): round-robin, `kv_transfer_params` copying,
//! retry-once on a retryable KV failure, pass-through of errors and streams, 502 / 504.
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
    let router = axum::Router::new()
        .route("/v1/completions", axum::routing::post(fake_handler))
        .route("/v1/chat/completions", axum::routing::post(fake_handler))
        .with_state(fake.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok((fake, url))
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
