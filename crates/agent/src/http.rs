//! The agents' HTTP API on axum: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `POST /v1/abort/{id}` (D), `GET /health`, `GET /metrics`.
//!
//! Handlers only parse and validate; the engine thread does the work. A handler sends a job
//! over a channel and awaits the engine's answer. Every request ends in exactly one
//! `kvlease_requests_total{outcome}` count: an [`OutcomeGuard`] counts on drop, so a
//! request whose client went away (the handler future or the SSE body dropped) is counted
//! as `aborted`, and D is told to abort it.
//!
//! Every resource a client can hold is bounded by [`HttpLimits`]: open connections, in all
//! and per client address (more are closed at accept), the time to send the headers
//! (from accept: also the pre-request and the idle keep-alive limit),
//! the time and size of the body (408 and 413), the time to the response head (408), and
//! a text prompt's length, checked before it is tokenized. Every refusal answers in the
//! JSON error shape of [`ApiError`]. `/health` answers 503 when the engine loop has
//! stalled ([`EngineHeartbeat`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRef, FromRequest, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use kvlease_lease::RequestId;
use kvlease_proto::params::{KvTransferParams, check_prefill_request};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::api::{self, ApiError, ChatRequest, CompletionRequest};
use crate::decode::{self, DecodeStreamEvent};
use crate::health::EngineHeartbeat;
use crate::metrics::{Metrics, RequestOutcome};
use crate::prefill;

/// Longest an HTTP handler waits for its engine before answering 504.
pub const ENGINE_REPLY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a shutdown waits for open requests to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What an HTTP client may make an agent spend (the `--http-*` and
/// `--health-engine-stall-ms` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections open at once; more are closed at accept and counted
    /// (`kvlease_http_connections_refused_total`). Default 256.
    pub max_connections: usize,
    /// Connections one client address may hold at once (so that one source cannot take
    /// every slot of `max_connections`); more are closed at accept and counted with the
    /// others. Default 224, seven eighths of the default `max_connections`.
    pub max_connections_per_source: usize,
    /// Largest request body (larger: 413). Default 2 MiB.
    pub max_body_bytes: usize,
    /// Longest text prompt, in bytes, checked before tokenizing (longer: 400). Default
    /// 256 KiB.
    pub max_prompt_bytes: usize,
    /// A request's whole body must arrive within this (else 408). Default 30 s.
    pub body_timeout: Duration,
    /// A request's headers must arrive within this; an idle keep-alive connection is
    /// closed after it. Default 10 s.
    pub header_timeout: Duration,
    /// Longest a request may take to its response head (else 408). Default 600 s.
    pub request_timeout: Duration,
    /// `/health` answers 503 when the engine loop has not completed an iteration for this
    /// long. Default 30 s.
    pub engine_stall: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_connections_per_source: 224,
            max_body_bytes: 2 << 20,
            max_prompt_bytes: 256 << 10,
            body_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(600),
            engine_stall: Duration::from_secs(30),
        }
    }
}

/// A request body read whole under [`HttpLimits::max_body_bytes`] (the router's
/// [`DefaultBodyLimit`]) and within [`HttpLimits::body_timeout`]; the rejection is an
/// [`ApiError`] (413 too large, 408 too slow).
#[derive(Debug)]
pub struct BoundedBody(pub Bytes);

impl<S> FromRequest<S> for BoundedBody
where
    S: Send + Sync,
    HttpLimits: FromRef<S>,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limits = HttpLimits::from_ref(state);
        match tokio::time::timeout(limits.body_timeout, Bytes::from_request(req, state)).await {
            Ok(Ok(bytes)) => Ok(Self(bytes)),
            Ok(Err(rejection)) => {
                let status = rejection.status();
                tracing::debug!(%status, reason = %rejection.body_text(), "request body refused");
                Err(error_for_status(status, rejection.body_text()))
            }
            Err(_) => {
                tracing::debug!(limit = ?limits.body_timeout, "request body too slow");
                Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} ms",
                        limits.body_timeout.as_millis()
                    ),
                ))
            }
        }
    }
}

/// The [`ApiError`] for a refusal that only has a status (from a middleware).
fn error_for_status(status: StatusCode, message: impl Into<String>) -> ApiError {
    let kind = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::REQUEST_TIMEOUT => "request_timeout",
        s if s.is_client_error() => "invalid_request_error",
        _ => "internal_error",
    };
    ApiError::new(status, kind, message)
}

/// Gives an error response without a body (the timeout middleware's 408) the JSON error
/// shape.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    if (status.is_client_error() || status.is_server_error())
        && !response.headers().contains_key(header::CONTENT_TYPE)
    {
        let message = status
            .canonical_reason()
            .unwrap_or("request refused")
            .to_owned();
        return error_for_status(status, message).into_response();
    }
    response
}

/// `/health`: `ok`, or 503 in the JSON error shape when the engine loop has stalled.
fn health(heartbeat: &EngineHeartbeat, stall: Duration) -> Response {
    let age = heartbeat.age();
    if age > stall {
        tracing::warn!(?age, limit = ?stall, "engine loop stalled; /health answers 503");
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "engine_stalled",
            format!(
                "the engine loop has not completed an iteration for {} ms (limit {} ms)",
                age.as_millis(),
                stall.as_millis()
            ),
        )
        .into_response();
    }
    "ok".into_response()
}

/// The layers every agent router gets: the body limit, the request timeout and JSON
/// errors for both.
fn with_limits(router: Router, limits: &HttpLimits) -> Router {
    router
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .layer(axum::middleware::map_response(json_errors))
}

/// Counts a request's outcome exactly once: the last [`set`](Self::set) wins, and a guard
/// dropped without one counts `aborted` (the client went away) and runs `on_abort`.
pub struct OutcomeGuard {
    metrics: Metrics,
    outcome: Option<RequestOutcome>,
    on_abort: Option<Box<dyn FnOnce() + Send>>,
}

impl OutcomeGuard {
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

impl Drop for OutcomeGuard {
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
        "invalid_request_error"
        | "not_found"
        | "conflict"
        | "request_too_large"
        | "request_timeout" => RequestOutcome::BadRequest,
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
    /// What a client may make the agent spend.
    pub limits: HttpLimits,
    /// The engine loop's liveness, for `/health`.
    pub heartbeat: Arc<EngineHeartbeat>,
    /// `--transfer-mode`: legs of the other mode are refused (400).
    pub transfer_mode: crate::config::TransferMode,
}

impl FromRef<Arc<PrefillApi>> for HttpLimits {
    fn from_ref(api: &Arc<PrefillApi>) -> Self {
        api.limits
    }
}

/// P's router.
pub fn prefill_router(api: PrefillApi) -> Router {
    let m1 = api.metrics.clone();
    let limits = api.limits;
    let router = Router::new()
        .route("/v1/completions", post(p_completions))
        .route("/v1/chat/completions", post(p_chat))
        .route(
            "/health",
            get(|State(api): State<Arc<PrefillApi>>| async move {
                health(&api.heartbeat, api.limits.engine_stall)
            }),
        )
        .route("/metrics", get(move || metrics_handler(m1.clone())))
        .fallback(not_found)
        .with_state(Arc::new(api));
    with_limits(router, &limits)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn p_completions(
    State(api): State<Arc<PrefillApi>>,
    headers: HeaderMap,
    body: Result<BoundedBody, ApiError>,
) -> Response {
    let mut outcome = OutcomeGuard::new(api.metrics.clone());
    let req = match body.and_then(|b| parse_json::<CompletionRequest>(&b.0)) {
        Ok(r) => r,
        Err(e) => return outcome.fail(e).into_response(),
    };
    p_serve(&api, &headers, req, "text_completion", &mut outcome).await
}

async fn p_chat(
    State(api): State<Arc<PrefillApi>>,
    headers: HeaderMap,
    body: Result<BoundedBody, ApiError>,
) -> Response {
    let mut outcome = OutcomeGuard::new(api.metrics.clone());
    let req = match body.and_then(|b| parse_json::<ChatRequest>(&b.0)) {
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
    outcome: &mut OutcomeGuard,
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
    check_prefill_request(req.kv_transfer_params.as_ref())?;
    let push = crate::push::prefill_leg(api.transfer_mode, req.kv_transfer_params.as_ref())?;
    // Bidirectional mode: D's cached-blocks params of the previous turn, passed by the proxy.
    let decoder = match req.kv_transfer_params.as_ref() {
        Some(v) if crate::bidir::is_decoder_params(Some(v)) => {
            Some(crate::bidir::params_from_value(v)?)
        }
        _ => None,
    };
    req.check_prompt_bytes(api.limits.max_prompt_bytes)?;
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
            push,
            reply,
        })
        .map_err(|_| engine_gone())?;
    let done = await_engine(rx).await??;
    let model = req.model.as_deref().unwrap_or(&api.model);
    // The one token a prefill produces is the first output token (vLLM returns it too).
    let first = crate::kv::decode_text(done.kv_digest, 1).concat();
    let mut body = completion_body(id.as_str(), model, object, &first, prompt_tokens, 1);
    body["kv_transfer_params"] = match done.push_params {
        Some(p) => p,
        None => done.params.to_value(),
    };
    body["kv_digest"] = Value::String(done.kv_digest.to_string());
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
    /// What a client may make the agent spend.
    pub limits: HttpLimits,
    /// The engine loop's liveness, for `/health`.
    pub heartbeat: Arc<EngineHeartbeat>,
    /// `--transfer-mode`: legs of the other mode are refused (400).
    pub transfer_mode: crate::config::TransferMode,
}

impl FromRef<Arc<DecodeApi>> for HttpLimits {
    fn from_ref(api: &Arc<DecodeApi>) -> Self {
        api.limits
    }
}

/// D's router.
pub fn decode_router(api: DecodeApi) -> Router {
    let m1 = api.metrics.clone();
    let limits = api.limits;
    let router = Router::new()
        .route("/v1/completions", post(d_completions))
        .route("/v1/chat/completions", post(d_chat))
        .route("/v1/abort/{id}", post(d_abort))
        .route(
            "/health",
            get(|State(api): State<Arc<DecodeApi>>| async move {
                health(&api.heartbeat, api.limits.engine_stall)
            }),
        )
        .route("/metrics", get(move || metrics_handler(m1.clone())))
        .fallback(not_found)
        .with_state(Arc::new(api));
    with_limits(router, &limits)
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
    body: Result<BoundedBody, ApiError>,
) -> Response {
    let mut outcome = OutcomeGuard::new(api.metrics.clone());
    match body.and_then(|b| parse_json::<CompletionRequest>(&b.0)) {
        Ok(r) => d_serve(api, &headers, r, "text_completion", outcome).await,
        Err(e) => outcome.fail(e).into_response(),
    }
}

async fn d_chat(
    State(api): State<Arc<DecodeApi>>,
    headers: HeaderMap,
    body: Result<BoundedBody, ApiError>,
) -> Response {
    let mut outcome = OutcomeGuard::new(api.metrics.clone());
    match body.and_then(|b| parse_json::<ChatRequest>(&b.0)) {
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
    events: mpsc::UnboundedReceiver<DecodeStreamEvent>,
}

fn d_submit(
    api: &Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    outcome: &mut OutcomeGuard,
) -> Result<DRequest, ApiError> {
    if crate::push::decode_leg_is_push(api.transfer_mode, req.kv_transfer_params.as_ref())? {
        return d_submit_push(api, headers, req, outcome);
    }
    let params = match &req.kv_transfer_params {
        Some(v) => KvTransferParams::from_value(v)?,
        None => {
            return Err(ApiError::bad_field(
                "kv_transfer_params",
                "missing: D needs P's kv_transfer_params (do_remote_prefill: true, ...)",
            ));
        }
    };
    let kv_digest = params.require_digest()?;
    let conversation_id = req.conversation_id.clone();
    d_enqueue(
        api,
        headers,
        req,
        outcome,
        |id, tokens, max_tokens, events| {
            decode::Job::Decode(Box::new(decode::DecodeJob {
                id,
                tokens,
                max_tokens,
                params,
                kv_digest,
                conversation_id,
                arrived: Instant::now(),
                events,
            }))
        },
    )
}

/// D's push leg: the transfer and P's identity instead of P's answer.
fn d_submit_push(
    api: &Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    outcome: &mut OutcomeGuard,
) -> Result<DRequest, ApiError> {
    let leg = match &req.kv_transfer_params {
        Some(v) => crate::push::decode_leg(v)?,
        None => return Err(ApiError::bad_field("kv_transfer_params", "missing")),
    };
    d_enqueue(
        api,
        headers,
        req,
        outcome,
        |id, tokens, max_tokens, events| {
            decode::Job::Push(Box::new(decode::PushJob {
                id,
                tokens,
                max_tokens,
                leg,
                arrived: Instant::now(),
                events,
            }))
        },
    )
}

/// What D's pull and push legs share once their params are read: the prompt's checks,
/// the request id, the job (`job(id, tokens, max_tokens, events)`) sent to the engine,
/// and its abort when the client goes away.
fn d_enqueue(
    api: &Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    outcome: &mut OutcomeGuard,
    job: impl FnOnce(RequestId, Vec<u32>, u32, mpsc::UnboundedSender<DecodeStreamEvent>) -> decode::Job,
) -> Result<DRequest, ApiError> {
    req.check_prompt_bytes(api.limits.max_prompt_bytes)?;
    let tokens = req.tokens()?;
    let max_tokens = req.max_tokens()?;
    let id = request_id(headers, req.request_id.as_deref())?;
    let prompt_tokens = tokens.len();
    let (tx, events) = mpsc::unbounded_channel();
    api.jobs
        .send(job(id.clone(), tokens, max_tokens, tx))
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
        prompt_tokens,
        stream: req.stream.unwrap_or(false),
        events,
    })
}

async fn d_serve(
    api: Arc<DecodeApi>,
    headers: &HeaderMap,
    req: CompletionRequest,
    object: &'static str,
    mut outcome: OutcomeGuard,
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
            Some(DecodeStreamEvent::Token(t)) => {
                text.push_str(&t);
                n += 1;
            }
            Some(DecodeStreamEvent::Done(summary)) => {
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
            Some(DecodeStreamEvent::Failed(e)) => return outcome.fail(e).into_response(),
            None => return outcome.fail(engine_gone()).into_response(),
        }
    }
}

fn d_stream(r: DRequest, object: &'static str, outcome: OutcomeGuard) -> Response {
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
                    Some(DecodeStreamEvent::Token(t)) => {
                        n += 1;
                        (format!("data: {}\n\n", chunk(&t, None)), false)
                    }
                    Some(DecodeStreamEvent::Done(summary)) => {
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
                    Some(DecodeStreamEvent::Failed(e)) => {
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

/// The answer to a connection refused at accept, every slot held by a busy connection
/// (see [`serve`]): a `503` in the error shape of [`ApiError::overloaded`], which the
/// client may retry after a second.
fn busy_response() -> Vec<u8> {
    let e = ApiError::overloaded("too many connections are busy; try again");
    let body = e.body().to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets open requests finish
/// (for up to 10 s).
///
/// `axum::serve` has no header timeout and no connection cap, so this is its accept loop
/// on hyper's HTTP/1 builder with a timer, each connection with `limits.header_timeout`
/// from accept to send a request's headers, between requests too. Connections take the
/// slots of a [`FairSlots`](kvlease_transport::slots::FairSlots): at most
/// `limits.max_connections` in all and `limits.max_connections_per_source` from one client
/// address. A newcomer over either makes room by closing an *idle* connection (no request
/// in flight, its answer sent) of its own address, or, when all slots are held, of the
/// address holding the most: a few addresses flooding idle connections keep no one out.
/// Only when every connection it could take is busy is the newcomer refused: a `503`
/// (`overloaded`, `retryable: true`, `Retry-After: 1`). `counters` counts both.
///
/// # Errors
/// None so far: accept errors (out of descriptors) are logged and retried.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: &HttpLimits,
    counters: &ConnectionCounters,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let refused = &counters.refused;
    let slots = kvlease_transport::slots::FairSlots::new(
        limits.max_connections,
        limits.max_connections_per_source,
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut open = tokio::task::JoinSet::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let busy_answer = busy_response();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        while open.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(error) => {
                    tracing::warn!(%error, "HTTP accept failed");
                    // Out of descriptors and similar: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let busy = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(tokio::sync::Notify::new());
        let slot = {
            let (busy, close) = (Arc::clone(&busy), Arc::clone(&close));
            let evicted = counters.evicted.clone();
            slots.admit(peer.ip(), move || {
                if busy.load(Ordering::Acquire) > 0 {
                    return false;
                }
                evicted.inc();
                close.notify_one();
                true
            })
        };
        let Some(slot) = slot else {
            refused.inc();
            tracing::debug!(
                %peer,
                limit = limits.max_connections,
                per_source = limits.max_connections_per_source,
                "every HTTP connection it could replace is busy; answered 503"
            );
            // A fresh socket's buffer takes these few bytes at once.
            let _ = stream.try_write(&busy_answer);
            continue;
        };
        let service = tracked(router.clone(), busy);
        let conn = http1.serve_connection(TokioIo::new(stream), service);
        let mut stopped = stopped.clone();
        open.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            let mut closing = false;
            let result = loop {
                tokio::select! {
                    result = conn.as_mut() => break result,
                    () = close.notified(), if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = stopped.changed(), if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            };
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "HTTP connection ended");
            }
            drop(slot);
        });
    }
    drop(listener);
    let _ = stop.send(true);
    let drained = async { while open.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::warn!("HTTP requests still open after the shutdown grace period");
    }
    Ok(())
}

/// What [`serve`] counts of the connections it makes room for.
#[derive(Debug, Clone, Default)]
pub struct ConnectionCounters {
    /// Connections answered 503 at accept: every slot they could take was busy.
    pub refused: prometheus_client::metrics::counter::Counter,
    /// Idle connections closed to make room for a newcomer.
    pub evicted: prometheus_client::metrics::counter::Counter,
}

/// `router` for one connection, counting its requests in flight in `busy` from the
/// request's arrival until its answer's body was sent (or dropped).
fn tracked(
    router: Router,
    busy: Arc<AtomicUsize>,
) -> impl hyper::service::Service<
    Request<hyper::body::Incoming>,
    Response = Response,
    Error = Infallible,
    Future = impl Future<Output = Result<Response, Infallible>> + Send,
> + Clone {
    let inner = TowerToHyperService::new(router);
    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        busy.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight(Arc::clone(&busy));
        let answer = hyper::service::Service::call(&inner, request);
        async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                let stream = futures_util::StreamExt::map(body.into_data_stream(), move |chunk| {
                    let _held = &guard;
                    chunk
                });
                Body::from_stream(stream)
            }))
        }
    })
}

/// One request in flight on a connection; counted down when dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
