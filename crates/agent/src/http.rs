//! The agents' HTTP API on axum: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `POST /v1/abort/{id}` (D), `GET /health`, `GET /metrics`.
//!
//! Handlers only parse and validate; the engine thread does the work. A handler sends a job
//! over a channel and awaits the engine's answer. Every request ends in exactly one
//! `kvlease_requests_total{outcome}` count: an [`Outcome`] guard counts on drop, so a
//! request whose client went away (the handler future or the SSE body dropped) is counted
//! as `aborted`, and D is told to abort it.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvlease_lease::RequestId;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::api::{self, ApiError, ChatRequest, CompletionRequest, RemoteParams};
use crate::decode::{self, DecodeEvent};
use crate::metrics::{Metrics, RequestOutcome};
use crate::prefill;

/// Longest an HTTP handler waits for its engine before answering 504.
pub const ENGINE_REPLY_TIMEOUT: Duration = Duration::from_secs(600);
/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Counts a request's outcome exactly once: the last [`set`](Self::set) wins, and a guard
/// dropped without one counts `aborted` (the client went away) and runs `on_abort`.
pub struct Outcome {
    metrics: Metrics,
    outcome: Option<RequestOutcome>,
    on_abort: Option<Box<dyn FnOnce() + Send>>,
}

impl Outcome {
    /// A guard for one request.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            outcome: None,
            on_abort: None,
        }
    }

    /// Records how the request ended.
    pub fn set(&mut self, outcome: RequestOutcome) {
        self.outcome = Some(outcome);
    }

    /// Records an error's outcome and returns the error.
    pub fn fail(&mut self, e: ApiError) -> ApiError {
        self.set(outcome_of(&e));
        e
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(RequestOutcome::Aborted);
        self.metrics.request(outcome).inc();
        if self.outcome.is_none()
            && let Some(f) = self.on_abort.take()
        {
            f();
        }
    }
}

/// The `kvlease_requests_total` outcome an error counts as.
pub fn outcome_of(e: &ApiError) -> RequestOutcome {
    match e.kind {
        "invalid_request_error" | "not_found" | "conflict" => RequestOutcome::BadRequest,
        "peer_auth_failed" | "unauthorized" => RequestOutcome::Unauthorized,
        "overloaded" => RequestOutcome::Overloaded,
        api::KV_LOAD_FAILED => RequestOutcome::KvLoadFailed,
        "kv_load_error" => RequestOutcome::Failed,
        "aborted" => RequestOutcome::Aborted,
        _ => RequestOutcome::Error,
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The request id: `X-Request-Id`, else the body's `request_id`, else a fresh `cmpl-…`.
///
/// # Errors
/// 400 naming the header or field when it is not a valid id.
pub fn request_id(headers: &HeaderMap, body: Option<&str>) -> Result<RequestId, ApiError> {
    if let Some(h) = headers.get("x-request-id") {
        let s = h
            .to_str()
            .map_err(|_| ApiError::bad_field("X-Request-Id", "not ASCII"))?;
        return RequestId::new(s).map_err(|e| ApiError::bad_field("X-Request-Id", e.to_string()));
    }
    if let Some(s) = body {
        return RequestId::new(s).map_err(|e| ApiError::bad_field("request_id", e.to_string()));
    }
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let salt = std::process::id();
    RequestId::new(&format!("cmpl-{salt:x}-{n:x}")).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            e.to_string(),
        )
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("malformed JSON body: {e}"),
        )
    })
}

fn completion_body(
    id: &str,
    model: &str,
    object: &str,
    text: &str,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    let choice = if object == "chat.completion" {
        json!({"index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": "length", "logprobs": null})
    } else {
        json!({"index": 0, "text": text, "finish_reason": "length", "logprobs": null})
    };
    json!({
        "id": id,
        "object": object,
        "created": now_secs(),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    })
}

async fn metrics_handler(metrics: Metrics) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        metrics.encode(),
    )
        .into_response()
}

// ---------------------------------------------------------------- prefill (P)

/// What P's HTTP layer needs.
#[derive(Clone)]
pub struct PrefillApi {
    /// Jobs to the engine thread.
    pub jobs: crossbeam_channel::Sender<prefill::Job>,
    /// The registry.
    pub metrics: Metrics,
    /// Model name echoed back when the request names none.
    pub model: String,
}

/// P's router.
pub fn prefill_router(api: PrefillApi) -> Router {
    let m1 = api.metrics.clone();
    Router::new()
        .route("/v1/completions", post(p_completions))
        .route("/v1/chat/completions", post(p_chat))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(move || metrics_handler(m1.clone())))
        .fallback(not_found)
        .with_state(Arc::new(api))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn p_completions(
    State(api): State<Arc<PrefillApi>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut outcome = Outcome::new(api.metrics.clone());
    let req = match parse_json::<CompletionRequest>(&body) {
        Ok(r) => r,
        Err(e) => return outcome.fail(e).into_response(),
    };
    p_serve(&api, &headers, req, "text_completion", &mut outcome).await
}

async fn p_chat(State(api): State<Arc<PrefillApi>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut outcome = Outcome::new(api.metrics.clone());
    let req = match parse_json::<ChatRequest>(&body) {
        Ok(r) => r.into_completion(),
        Err(e) => return outcome.fail(e).into_response(),
    };
    p_serve(&api, &headers, req, "chat.completion", &mut outcome).await
}

async fn p_serve(
    api: &PrefillApi,
    headers: &HeaderMap,
    req: CompletionRequest,
    object: &str,
    outcome: &mut Outcome,
) -> Response {
    match p_run(api, headers, req, object).await {
        Ok(v) => {
            outcome.set(RequestOutcome::Ok);
            axum::Json(v).into_response()
        }
        Err(e) => outcome.fail(e).into_response(),
    }
}

async fn p_run(
    api: &PrefillApi,
    headers: &HeaderMap,
    req: CompletionRequest,
    object: &str,
) -> Result<Value, ApiError> {
    api::prefill_params(req.kv_transfer_params.as_ref())?;
    // Bidirectional mode: D's cached-blocks params of the previous turn, passed by the proxy.
    let decoder = match req.kv_transfer_params.as_ref() {
        Some(v) if crate::bidir::is_decoder_params(Some(v)) => {
            Some(crate::bidir::DecoderKvParams::from_value(v)?)
        }
        _ => None,
    };
    let tokens = req.tokens()?;
    req.max_tokens()?;
    let id = request_id(headers, req.request_id.as_deref())?;
    let (reply, rx) = oneshot::channel();
    let prompt_tokens = tokens.len();
    api.jobs
        .send(prefill::Job {
            id: id.clone(),
            tokens,
            arrived: Instant::now(),
            decoder,
            reply,
        })
        .map_err(|_| engine_gone())?;
    let done = await_engine(rx).await??;
    let model = req.model.as_deref().unwrap_or(&api.model);
    // The one token a prefill produces is the first output token (vLLM returns it too).
    let digest = done.params.kv_digest;
    let first = crate::kv::decode_text(digest, 1).concat();
    let mut body = completion_body(id.as_str(), model, object, &first, prompt_tokens, 1);
    body["kv_transfer_params"] = serde_json::to_value(&done.params).map_err(internal)?;
    body["kv_digest"] = Value::String(done.params.kv_digest.to_string());
    body["cached_tokens_pulled"] = json!(done.cached_tokens_pulled);
    body["kvlease"] = json!({
        "prefill_time_ms": done.prefill_ms,
        "pool_wait_ms": done.pool_wait_ms,
        "cached_tokens_pulled": done.cached_tokens_pulled,
    });
    Ok(body)
}

fn engine_gone() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "engine_stopped",
        "the engine is shutting down",
    )
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
        e.to_string(),
    )
}

async fn await_engine<T>(rx: oneshot::Receiver<T>) -> Result<T, ApiError> {
    match tokio::time::timeout(ENGINE_REPLY_TIMEOUT, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(engine_gone()),
        Err(_) => Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "the engine did not answer in time",
        )),
    }
}

// ---------------------------------------------------------------- decode (D)

/// What D's HTTP layer needs.
#[derive(Clone)]
pub struct DecodeApi {
    /// Jobs to the engine thread.
    pub jobs: crossbeam_channel::Sender<decode::Job>,
    /// The registry.
    pub metrics: Metrics,
    /// Model name echoed back when the request names none.
    pub model: String,
}

/// D's router.
pub fn decode_router(api: DecodeApi) -> Router {
    let m1 = api.metrics.clone();
    Router::new()
        .route("/v1/completions", post(d_completions))
        .route("/v1/chat/completions", post(d_chat))
        .route("/v1/abort/{id}", post(d_abort))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(move || metrics_handler(m1.clone())))
        .fallback(not_found)
        .with_state(Arc::new(api))
}

async fn d_abort(State(api): State<Arc<DecodeApi>>, Path(id): Path<String>) -> Response {
    let Ok(id) = RequestId::new(&id) else {
        return ApiError::bad_field("id", "not a valid request id").into_response();
    };
    let (reply, rx) = oneshot::channel();
    if api
        .jobs
        .send(decode::Job::Abort {
            id: id.clone(),
            reply: Some(reply),
        })
        .is_err()
    {
        return engine_gone().into_response();
    }
    match await_engine(rx).await {
        Ok(true) => axum::Json(json!({"id": id.as_str(), "aborted": true})).into_response(),
        Ok(false) => ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no running request {id}"),
        )
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn d_completions(
    State(api): State<Arc<DecodeApi>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut outcome = Outcome::new(api.metrics.clone());
    match parse_json::<CompletionRequest>(&body) {
        Ok(r) => d_serve(api, &headers, r, "text_completion", outcome).await,
        Err(e) => outcome.fail(e).into_response(),
    }
}

async fn d_chat(State(api): State<Arc<DecodeApi>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut outcome = Outcome::new(api.metrics.clone());
    match parse_json::<ChatRequest>(&body) {
        Ok(r) => {
            d_serve(
                api,
                &headers,
                r.into_completion(),
                "chat.completion",
                outcome,
            )
            .await
        }
        Err(e) => outcome.fail(e).into_response(),
    }
}

struct DRequest {
    id: RequestId,
    model: String,
    prompt_tokens: usize,
    stream: bool,
    events: mpsc::UnboundedReceiver<DecodeEvent>,
}

fn d_submit(
    api: &Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    outcome: &mut Outcome,
) -> Result<DRequest, ApiError> {
    let params = match &req.kv_transfer_params {
        Some(v) => RemoteParams::from_value(v)?,
        None => {
            return Err(ApiError::bad_field(
                "kv_transfer_params",
                "missing: D needs P's kv_transfer_params (do_remote_prefill: true, ...)",
            ));
        }
    };
    let tokens = req.tokens()?;
    let max_tokens = req.max_tokens()?;
    let id = request_id(headers, req.request_id.as_deref())?;
    let (tx, events) = mpsc::unbounded_channel();
    api.jobs
        .send(decode::Job::Decode(Box::new(decode::DecodeJob {
            id: id.clone(),
            tokens: tokens.clone(),
            max_tokens,
            params,
            conversation_id: req.conversation_id.clone(),
            arrived: Instant::now(),
            events: tx,
        })))
        .map_err(|_| engine_gone())?;
    let jobs = api.jobs.clone();
    let abort_id = id.clone();
    outcome.on_abort = Some(Box::new(move || {
        // The engine may be gone at shutdown; nothing is left to abort then.
        let _ = jobs.send(decode::Job::Abort {
            id: abort_id,
            reply: None,
        });
    }));
    Ok(DRequest {
        id,
        model: req.model.unwrap_or_else(|| api.model.clone()),
        prompt_tokens: tokens.len(),
        stream: req.stream.unwrap_or(false),
        events,
    })
}

async fn d_serve(
    api: Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    object: &'static str,
    mut outcome: Outcome,
) -> Response {
    let r = match d_submit(&api, headers, req, &mut outcome) {
        Ok(r) => r,
        Err(e) => return outcome.fail(e).into_response(),
    };
    if r.stream {
        return d_stream(r, object, outcome);
    }
    let DRequest {
        id,
        model,
        prompt_tokens,
        mut events,
        ..
    } = r;
    let mut text = String::new();
    let mut n = 0usize;
    loop {
        match events.recv().await {
            Some(DecodeEvent::Token(t)) => {
                text.push_str(&t);
                n += 1;
            }
            Some(DecodeEvent::Done(summary)) => {
                outcome.set(RequestOutcome::Ok);
                let mut body =
                    completion_body(id.as_str(), &model, object, &text, prompt_tokens, n);
                body["kv_digest"] = Value::String(summary.kv_digest.clone());
                body["kv_transfer_stats"] =
                    serde_json::to_value(&summary.stats).unwrap_or(Value::Null);
                if let Some(p) = summary.kv_transfer_params {
                    body["kv_transfer_params"] = p;
                }
                return axum::Json(body).into_response();
            }
            Some(DecodeEvent::Failed(e)) => return outcome.fail(e).into_response(),
            None => return outcome.fail(engine_gone()).into_response(),
        }
    }
}

fn d_stream(r: DRequest, object: &'static str, outcome: Outcome) -> Response {
    let DRequest {
        id,
        model,
        prompt_tokens,
        events,
        ..
    } = r;
    let chunk_object = if object == "chat.completion" {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let state = (events, outcome, 0usize, false);
    let stream = futures_util::stream::unfold(
        state,
        move |(mut events, mut outcome, mut n, finished)| {
            let id = id.clone();
            let model = model.clone();
            async move {
                if finished {
                    return None;
                }
                let chunk = |text: &str, finish: Option<&str>| -> Value {
                    let choice = if chunk_object == "chat.completion.chunk" {
                        json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
                    } else {
                        json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
                    };
                    json!({"id": id.as_str(), "object": chunk_object, "created": now_secs(), "model": model, "choices": [choice]})
                };
                let (frame, done) = match events.recv().await {
                    Some(DecodeEvent::Token(t)) => {
                        n += 1;
                        (format!("data: {}\n\n", chunk(&t, None)), false)
                    }
                    Some(DecodeEvent::Done(summary)) => {
                        outcome.set(RequestOutcome::Ok);
                        let mut last = chunk("", Some("length"));
                        last["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": n,
                        "total_tokens": prompt_tokens + n});
                        last["kv_digest"] = Value::String(summary.kv_digest.clone());
                        last["kv_transfer_stats"] =
                            serde_json::to_value(&summary.stats).unwrap_or(Value::Null);
                        if let Some(p) = summary.kv_transfer_params {
                            last["kv_transfer_params"] = p;
                        }
                        (format!("data: {last}\n\ndata: [DONE]\n\n"), true)
                    }
                    Some(DecodeEvent::Failed(e)) => {
                        let e = outcome.fail(e);
                        (format!("data: {}\n\ndata: [DONE]\n\n", e.body()), true)
                    }
                    None => {
                        let e = outcome.fail(engine_gone());
                        (format!("data: {}\n\ndata: [DONE]\n\n", e.body()), true)
                    }
                };
                Some((
                    Ok::<_, Infallible>(Bytes::from(frame)),
                    (events, outcome, n, done),
                ))
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| internal(e).into_response())
}

/// Serves `router` on `listener` until `shutdown` resolves.
///
/// # Errors
/// The server's IO error.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router.layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
