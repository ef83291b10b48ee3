//! The routing proxy (`kvlease-proxy`): one OpenAI-style endpoint in front of prefill (P)
//! and decode (D) agents, in the shape of vLLM's disaggregated-serving proxies.
//!
//! For each `POST /v1/completions` or `POST /v1/chat/completions`:
//!
//! 1. the request goes to the next P (round-robin) with `max_tokens: 1`, `stream: false`,
//!    an `X-Request-Id` header and `kv_transfer_params: {do_remote_decode: true,
//!    do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host:
//!    null, remote_port: null}`;
//! 2. the original body, with P's returned `kv_transfer_params` copied verbatim, goes to the
//!    next D (round-robin) with the same `X-Request-Id`; D's answer (JSON, or server-sent
//!    events when `stream: true`) is passed through to the client;
//! 3. when D answers with a retryable KV failure ([`is_retryable_kv_failure`]: HTTP 503 with
//!    `{"error": {"type": "kv_load_failed", "retryable": true}}`, the body of
//!    [`crate::api::ApiError::kv_load_failed`]), the request is prefilled again on the next
//!    P and sent to the next D, once, and `kvlease_proxy_retries_total` counts it;
//! 4. bidirectional mode: when D's (non-streamed) answer carries its cached-blocks params
//!    ([`DecoderKvParams`]), they are remembered for the conversation
//!    ([`conversation_key`]: `conversation_id`, else a hash of the first message) and merged
//!    into the `kv_transfer_params` P gets with the conversation's next turn (aged by the
//!    time held); P's `cached_tokens_pulled` is added to D's answer.
//!
//! That is pull mode (`--transfer-mode pull`, the default): D reads P's blocks, so D's
//! leg needs what P's prefill returned. **Push mode** (`--transfer-mode push`, the flow
//! of vLLM's push proxy: P writes into blocks D reserved) needs only P's identity on D's
//! leg, so both legs can run at once:
//!
//! 1. per client request (and per retry) the proxy makes a transfer id `T`
//!    (`{prefix}-t{n}`: this process's random prefix and a counter; never the client's
//!    `X-Request-Id`, which both legs carry as in pull mode);
//! 2. P's leg is pull's step 1, its `kv_transfer_params` with `transfer_id: T` added;
//! 3. D's leg is the client's body with `kv_transfer_params: {do_remote_prefill: true,
//!    do_remote_decode: false, transfer_mode: "push", transfer_id: T, remote_engine_id,
//!    remote_host, remote_port, tp_size}`, the last four P's identity;
//! 4. P's identity comes from P's answers (their `kv_transfer_params`' `remote_engine_id`,
//!    `remote_host`, `remote_port`, `tp_size`), remembered per P base URL, the newest
//!    answer replacing the older (`kvlease_proxy_push_identity_changes_total` counts a
//!    change: a restarted P). When the chosen P's identity is not known (its first
//!    request, or a P leg sent to it with its D leg failed since), the proxy waits for
//!    P's answer (as pull does: P's error answers are passed through, an unreachable P is
//!    tried on the next P once, an answer without the identity is a 502 naming the key)
//!    and sends D's leg with the identity it carried. When it is known, P's leg runs on a
//!    task of its own and D's leg goes out at once
//!    (`kvlease_proxy_push_legs_total{dispatch="concurrent"|"sequential"}`); D's answer is
//!    passed through as in pull mode. P's answer to such a leg (read within the same
//!    limits and budget, its copy of the request counted in the budget) only refreshes
//!    P's identity; a failed one (P unreachable, an error status, an answer unreadable or
//!    without the identity) does not fail the client's request, which D ends when P's
//!    write never comes (a kvlease decode agent answers the retryable `kv_load_failed`,
//!    retried in step 5; the vLLM connector computes the prompt): it is counted
//!    (`kvlease_proxy_push_prefill_failures_total`), logged at warn, and the next request
//!    to that P waits for its answer again;
//! 5. D's retryable KV failure is retried once as in pull mode (step 3), through the same
//!    push flow with a new transfer id;
//! 6. bidirectional mode (step 4) is pull's only: push mode neither keeps nor sends a
//!    conversation's params.
//!
//! An unreachable upstream is a 502, an upstream that does not answer in time a 504, an
//! answer the proxy must read whole (P's, D's non-streamed one) over
//! `--max-upstream-body-bytes` a 502 naming the limit (read no further), all in the
//! OpenAI error shape; P's own errors (400, 503 ...) are passed through. Every body the
//! proxy holds whole (the client's, P's answer, D's non-streamed answer) counts against
//! one budget, `--max-buffered-body-bytes` (module `budget`): a body that does not fit is a
//! retryable 503 with `Retry-After`, so many large bodies at once cannot add up. The
//! proxy keeps no per-request state (only the bounded per-conversation params of step
//! 4, and push mode's P identities): a client that disconnects drops the upstream
//! request, which D sees as an abort (a push mode P leg sent with its D leg runs to its
//! end).
//!
//! **Loops.** Every request the proxy forwards carries its hop header ([`HOP_HEADER`]: the
//! ids of the proxies it passed, this one's added); a request that arrives with this
//! proxy's id in it (a proxy that is, directly or not, its own upstream) is refused with
//! 508 `loop_detected`, as is one that passed [`MAX_HOPS`] proxies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlease_engine::DecoderKvParams;

use crate::bidir::{is_decoder_params, params_from_value, params_to_value};

mod budget;
mod config;
mod metrics;
mod store;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
pub use config::{ProxyArgs, ProxyConfig, ProxyError, TransferMode};
pub use metrics::{ProxyMetrics, ProxyOutcome, PushDispatch};
use reqwest::Url;
use serde_json::{Map, Value, json};
pub use store::{ConversationStore, conversation_key};

use crate::api::{ApiError, KV_LOAD_FAILED};

/// The header carrying the request id to P and D (as vLLM's proxies send it).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The hop header: the comma-separated ids of the kvlease proxies a request passed.
pub const HOP_HEADER: &str = "x-kvlease-proxy";

/// Most proxies a request may pass (the hop header's ids) before one refuses it.
pub const MAX_HOPS: usize = 8;

/// Largest request body accepted from a client.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Largest error body read from D to decide whether to retry.
const MAX_ERROR_BODY_BYTES: usize = 64 << 10;

/// With one D, the pauses before trying it again after it refused the connection (D never
/// saw the request, so sending it again is safe): a D restarting on its port, or briefly
/// past its listen backlog, costs the request about 1.75 s at most instead of a 502.
/// P's lease holds the blocks meanwhile.
const ONLY_D_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_millis(1000),
];

/// Whether D's answer is the retryable KV failure the proxy retries from P: status 503 and
/// a JSON body `{"error": {"type": "kv_load_failed", "retryable": true, ...}}`.
pub fn is_retryable_kv_failure(status: StatusCode, body: &[u8]) -> bool {
    if status != StatusCode::SERVICE_UNAVAILABLE {
        return false;
    }
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let error = &value["error"];
    error["type"] == KV_LOAD_FAILED && error["retryable"] == true
}

#[derive(Debug)]
struct Inner {
    config: ProxyConfig,
    client: reqwest::Client,
    metrics: ProxyMetrics,
    next_prefill: AtomicUsize,
    next_decode: AtomicUsize,
    next_id: AtomicU64,
    /// Push mode: the next transfer id's number.
    next_transfer: AtomicU64,
    id_prefix: String,
    /// This proxy's id in the hop header (random, per process).
    hop_id: String,
    /// The bodies held whole (`--max-buffered-body-bytes`).
    budget: Arc<budget::Budget>,
    /// Bidirectional mode: D's cached-blocks params of each conversation's last turn.
    conversations: Mutex<ConversationStore>,
    /// Push mode: each P's identity from its newest answer, by P base URL (one entry per
    /// configured P at most).
    identities: Mutex<HashMap<String, KnownIdentity>>,
}

/// Conversations whose D params the proxy remembers at once (the oldest goes first).
pub const MAX_CONVERSATIONS: usize = 65_536;

/// The proxy: cheap to clone, every clone shares the upstream rotation and the metrics.
#[derive(Debug, Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

/// The headers every upstream request of one client request carries.
#[derive(Clone)]
struct Upstream {
    /// The client's `Authorization`, passed on.
    auth: Option<HeaderValue>,
    /// The hop header: the proxies the request passed, this one's id last.
    hop: HeaderValue,
}

/// What the decode step of one turn needs to know for bidirectional mode.
struct Turn {
    /// The conversation ([`conversation_key`]), if the request names one.
    key: Option<String>,
    /// P's `cached_tokens_pulled`, added to D's (non-streamed) answer.
    cached_tokens_pulled: Option<u64>,
}

/// Push mode: what D's leg names of P (`remote_engine_id`, `remote_host`, `remote_port`,
/// `tp_size`), from P's answers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PrefillIdentity {
    engine_id: String,
    host: String,
    port: u16,
    tp_size: u64,
}

impl PrefillIdentity {
    /// P's identity in its answer's `kv_transfer_params`; else what is wrong, naming the
    /// key ("without remote_port").
    fn from_params(params: &Value) -> Result<Self, String> {
        let field = |key: &str| match params.get(key) {
            None | Some(Value::Null) => Err(format!("without {key}")),
            Some(v) => Ok(v),
        };
        let string = |key: &str| {
            field(key)?
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| format!("with {key} not a non-empty string"))
        };
        let engine_id = string("remote_engine_id")?;
        let host = string("remote_host")?;
        let port = field("remote_port")?
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| "with remote_port not a port number".to_owned())?;
        let tp_size = field("tp_size")?
            .as_u64()
            .filter(|n| *n != 0)
            .ok_or_else(|| "with tp_size not a positive integer".to_owned())?;
        Ok(Self {
            engine_id,
            host,
            port,
            tp_size,
        })
    }
}

/// Push mode: a P's identity as the proxy remembers it.
#[derive(Debug)]
struct KnownIdentity {
    identity: PrefillIdentity,
    /// False once a P leg sent with D's leg failed: the next request to that P waits for
    /// P's answer again (the identity stays, to notice a change).
    usable: bool,
}

/// What a prefill leg adds to `kv_transfer_params`.
#[derive(Clone)]
enum PrefillExtra<'a> {
    /// Pull mode: D's cached-blocks params of the conversation's previous turn, if any.
    Pull(Option<DecoderKvParams>),
    /// Push mode: the transfer id.
    Push(&'a str),
}

/// Why one upstream exchange did not produce an answer to pass through.
enum Failure {
    /// Answer this to the client.
    Respond(Response, ProxyOutcome),
    /// The upstream could not be reached (the request did not get there, or a prefill's
    /// connection broke): try another agent of the same role once; else answer this.
    Unreachable(Response, ProxyOutcome),
    /// D reported a retryable KV failure; its status and body.
    RetryableKv(StatusCode, Bytes),
}

impl Failure {
    /// For a log line: the status the client would get and why.
    fn describe(&self) -> String {
        match self {
            Self::Respond(response, outcome) | Self::Unreachable(response, outcome) => {
                format!("{} ({})", response.status(), outcome.as_str())
            }
            Self::RetryableKv(status, _) => format!("{status} ({KV_LOAD_FAILED})"),
        }
    }
}

impl Proxy {
    /// Builds the proxy and its HTTP client (which never uses an HTTP proxy from the
    /// environment).
    ///
    /// # Errors
    /// [`ProxyError::Client`] when the HTTP client cannot be built.
    pub fn new(config: ProxyConfig) -> Result<Self, ProxyError> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(config.upstream_idle_timeout)
            .read_timeout(config.timeout)
            .no_proxy()
            .build()
            .map_err(|source| ProxyError::Client { source })?;
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        };
        let metrics = ProxyMetrics::new();
        let budget = budget::Budget::new(
            config.max_buffered_body_bytes,
            metrics.buffered_body_bytes.clone(),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client,
                metrics,
                next_prefill: AtomicUsize::new(0),
                next_decode: AtomicUsize::new(0),
                next_id: AtomicU64::new(0),
                next_transfer: AtomicU64::new(0),
                id_prefix: format!("proxy-{:08x}", random as u32),
                hop_id: format!("{random:016x}"),
                budget,
                conversations: Mutex::new(ConversationStore::new(MAX_CONVERSATIONS)),
                identities: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &ProxyMetrics {
        &self.inner.metrics
    }

    /// The axum router: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`,
    /// `GET /metrics`.
    pub fn router(&self) -> axum::Router {
        axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/health", get(|| async { "ok\n" }))
            .route("/metrics", get(metrics))
            .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
    }

    /// Serves on `listener` until the future is dropped or the listener fails, with the
    /// agents' accept loop: the connection caps (in all and per client address) and the
    /// header (and idle keep-alive) timeout of [`ProxyConfig::http`].
    ///
    /// # Errors
    /// The listener's IO error.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let counters = crate::http::ConnectionCounters {
            refused: self.inner.metrics.http_connections_refused.clone(),
            evicted: self.inner.metrics.http_connections_evicted.clone(),
        };
        crate::http::serve(
            listener,
            self.router(),
            &self.inner.config.http,
            &counters,
            std::future::pending(),
        )
        .await
    }

    /// The next agent's base URL of a role (round-robin).
    fn next_base(&self, decode: bool) -> Url {
        let (urls, counter) = if decode {
            (&self.inner.config.decode, &self.inner.next_decode)
        } else {
            (&self.inner.config.prefill, &self.inner.next_prefill)
        };
        // `ProxyArgs::config` guarantees at least one URL of each kind; `max(1)` keeps the
        // modulo defined for a `ProxyConfig` built by hand.
        urls[counter.fetch_add(1, Ordering::Relaxed) % urls.len().max(1)].clone()
    }

    /// The agent of a role to try after `failed` could not be reached: the one after it in
    /// the list (`failed` itself when it is the only one). The rotation advances as for
    /// any request, but the choice does not follow it: other requests move it meanwhile,
    /// so the rotation's next agent may be `failed` again.
    fn base_after(&self, decode: bool, failed: &Url) -> Url {
        let (urls, counter) = if decode {
            (&self.inner.config.decode, &self.inner.next_decode)
        } else {
            (&self.inner.config.prefill, &self.inner.next_prefill)
        };
        let next = counter.fetch_add(1, Ordering::Relaxed);
        let at = urls
            .iter()
            .position(|u| u == failed)
            .map_or(next, |i| i + 1);
        urls[at % urls.len().max(1)].clone()
    }

    /// Push mode: a new transfer id, unique in this proxy process.
    fn transfer_id(&self) -> String {
        format!(
            "{}-t{}",
            self.inner.id_prefix,
            self.inner.next_transfer.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn request_id(&self, headers: &HeaderMap) -> String {
        let given = headers
            .get(REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| kvlease_lease::RequestId::new(v).is_ok() && v.len() <= 200);
        match given {
            Some(id) => id.to_owned(),
            None => format!(
                "{}-{}",
                self.inner.id_prefix,
                self.inner.next_id.fetch_add(1, Ordering::Relaxed)
            ),
        }
    }

    async fn handle(&self, path: &'static str, headers: HeaderMap, body: Body) -> Response {
        let start = Instant::now();
        let metrics = &self.inner.metrics;
        let routed = match self.admit(&headers, body).await {
            Ok((hops, body, _held)) => self.route(path, &headers, &hops, &body).await,
            Err(failure) => Err(failure),
        };
        let (response, outcome) = match routed {
            Ok((response, retried)) => {
                let outcome = match (response.status().is_success(), retried) {
                    (true, false) => ProxyOutcome::Ok,
                    (true, true) => ProxyOutcome::OkAfterRetry,
                    (false, _) => ProxyOutcome::UpstreamError,
                };
                (response, outcome)
            }
            Err(Failure::Respond(response, outcome)) => (response, outcome),
            Err(Failure::Unreachable(response, outcome)) => (response, outcome),
            Err(Failure::RetryableKv(status, body)) => (
                passthrough(
                    status,
                    Some(HeaderValue::from_static("application/json")),
                    body,
                ),
                ProxyOutcome::UpstreamError,
            ),
        };
        metrics.request(outcome).inc();
        metrics
            .request_seconds
            .observe(start.elapsed().as_secs_f64());
        response
    }

    /// Refuses a request that passed this proxy already, or too many, and reads the
    /// client's body within the budget; returns the hop header to forward, the body and
    /// its reservation (held while the request runs).
    async fn admit(
        &self,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<(HeaderValue, Bytes, budget::Reservation), Failure> {
        let hops: Vec<&str> = headers
            .get_all(HOP_HEADER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .collect();
        if hops.contains(&self.inner.hop_id.as_str()) {
            return Err(loop_detected(&format!(
                "the request already passed through this proxy ({HOP_HEADER}: {}): a routing loop (is the proxy its own upstream?)",
                hops.join(",")
            )));
        }
        if hops.len() >= MAX_HOPS {
            return Err(loop_detected(&format!(
                "the request passed {} proxies ({HOP_HEADER}), at most {MAX_HOPS} are allowed",
                hops.len()
            )));
        }
        let mut forward = hops.join(",");
        if !forward.is_empty() {
            forward.push(',');
        }
        forward.push_str(&self.inner.hop_id);
        let hop = HeaderValue::from_str(&forward)
            .map_err(|_| bad_request(&format!("{HOP_HEADER} is not a valid header value")))?;
        let mut held = self.inner.budget.start();
        let mut out = Vec::new();
        let mut stream = body.into_data_stream();
        while let Some(chunk) = futures_util::StreamExt::next(&mut stream).await {
            let chunk =
                chunk.map_err(|e| bad_request(&format!("reading the request body: {e}")))?;
            if chunk.len() > MAX_BODY_BYTES - out.len() {
                return Err(Failure::Respond(
                    ApiError::new(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "request_too_large",
                        format!("the request body exceeds {MAX_BODY_BYTES} bytes"),
                    )
                    .into_response(),
                    ProxyOutcome::BadRequest,
                ));
            }
            if !held.grow(chunk.len()) {
                return Err(self.over_budget());
            }
            out.extend_from_slice(&chunk);
        }
        Ok((hop, Bytes::from(out), held))
    }

    /// The 503 for a body that does not fit `--max-buffered-body-bytes`.
    fn over_budget(&self) -> Failure {
        let limit = self.inner.config.max_buffered_body_bytes;
        tracing::warn!(
            limit,
            "bodies held at once reached --max-buffered-body-bytes; request refused"
        );
        Failure::Respond(
            ApiError::overloaded(format!(
                "the proxy holds {limit} bytes of bodies at once (--max-buffered-body-bytes); try again"
            ))
            .into_response(),
            ProxyOutcome::Overloaded,
        )
    }

    /// P then D (pull), or P and D tied by a transfer id (push), with one retry on a
    /// retryable KV failure. `Ok((answer, retried))`.
    async fn route(
        &self,
        path: &'static str,
        headers: &HeaderMap,
        hop: &HeaderValue,
        body: &Bytes,
    ) -> Result<(Response, bool), Failure> {
        let request = match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(map)) => map,
            Ok(_) => return Err(bad_request("the request body must be a JSON object")),
            Err(e) => return Err(bad_request(&format!("the request body is not JSON: {e}"))),
        };
        let up = Upstream {
            auth: headers.get(header::AUTHORIZATION).cloned(),
            hop: hop.clone(),
        };
        let base_id = self.request_id(headers);
        let push = self.inner.config.transfer_mode == TransferMode::Push;
        // Bidirectional mode (pull only): the previous turn's D params go to P with this
        // turn.
        let key = if push {
            None
        } else {
            conversation_key(&Value::Object(request.clone()))
        };
        let mut cached = key.as_ref().and_then(|k| {
            self.inner
                .conversations
                .lock()
                .ok()
                .and_then(|mut s| s.take(k, Instant::now()))
        });
        let mut last = None;
        for attempt in 0..2u32 {
            let id = if attempt == 0 {
                base_id.clone()
            } else {
                format!("{base_id}-retry{attempt}")
            };
            let (to_decode, turn) = if push {
                let to_decode = self.push_legs(path, &request, &id, &up, body.len()).await?;
                let turn = Turn {
                    key: None,
                    cached_tokens_pulled: None,
                };
                (to_decode, turn)
            } else {
                // A retry prefills from scratch: the cached turn may be gone by now.
                let first = self.next_base(false);
                let extra = PrefillExtra::Pull(cached.take());
                let (_, params, pulled) =
                    self.prefill(first, path, &request, &id, &up, extra).await?;
                let mut to_decode = request.clone();
                to_decode.insert("kv_transfer_params".to_owned(), params);
                let turn = Turn {
                    key: key.clone(),
                    cached_tokens_pulled: pulled,
                };
                (to_decode, turn)
            };
            match self.decode(path, &to_decode, &id, &up, &turn).await {
                Ok(response) => return Ok((response, attempt > 0)),
                Err(Failure::RetryableKv(status, body)) if attempt == 0 => {
                    self.inner.metrics.retries.inc();
                    tracing::warn!(request = %id, "decode could not load the KV; prefilling again once");
                    last = Some((status, body));
                }
                Err(other) => return Err(other),
            }
        }
        // The loop returns on every path of the second attempt.
        let (status, body) = last.unwrap_or((StatusCode::SERVICE_UNAVAILABLE, Bytes::new()));
        Err(Failure::RetryableKv(status, body))
    }

    /// Push mode: P's and D's legs of one try, tied by a new transfer id; returns D's
    /// body. When the chosen P's identity is known, P's leg runs on its own
    /// ([`Self::spawn_prefill_leg`]) and D's body names that identity at once; else P's
    /// answer is awaited (trying the next P once when P cannot be reached) and D's body
    /// names the identity it carries.
    async fn push_legs(
        &self,
        path: &str,
        request: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        request_bytes: usize,
    ) -> Result<Map<String, Value>, Failure> {
        let transfer = self.transfer_id();
        let first = self.next_base(false);
        let (identity, dispatch) = if let Some(identity) = self.known_identity(&first) {
            // The spawned leg holds its copy of the request past this one's end: it counts
            // against the budget as the client's body does.
            let mut held = self.inner.budget.start();
            if !held.grow(request_bytes) {
                return Err(self.over_budget());
            }
            self.spawn_prefill_leg(first, path, request, id, up, &transfer, &identity, held);
            (identity, PushDispatch::Concurrent)
        } else {
            tracing::debug!(request = %id, %transfer, url = %join(&first, path), "push: prefill leg (P's identity unknown: the decode leg waits for its answer)");
            let (base, params, _) = self
                .prefill(first, path, request, id, up, PrefillExtra::Push(&transfer))
                .await?;
            let identity = PrefillIdentity::from_params(&params).map_err(|what| {
                bad_gateway(&format!(
                    "prefill {} answered kv_transfer_params {what} (push mode passes P's \
                     remote_engine_id, remote_host, remote_port and tp_size to D)",
                    join(&base, path)
                ))
            })?;
            self.remember_identity(&base, &identity);
            (identity, PushDispatch::Sequential)
        };
        self.inner.metrics.push_legs(dispatch).inc();
        tracing::debug!(
            request = %id,
            %transfer,
            dispatch = dispatch.as_str(),
            remote_engine_id = %identity.engine_id,
            "push: decode leg"
        );
        let mut body = request.clone();
        body.insert(
            "kv_transfer_params".to_owned(),
            json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "transfer_mode": "push",
                "transfer_id": transfer,
                "remote_engine_id": identity.engine_id,
                "remote_host": identity.host,
                "remote_port": identity.port,
                "tp_size": identity.tp_size,
            }),
        );
        Ok(body)
    }

    /// Push mode: P's leg sent alongside D's, on its own task. P's answer is read only to
    /// refresh P's identity; a failure is counted and logged, and the client's request
    /// goes on with D (which answers the retryable `kv_load_failed`, or computes the
    /// prompt, when P's write never comes).
    #[allow(
        clippy::too_many_arguments,
        reason = "the leg's parts, borrowed from push_legs"
    )]
    fn spawn_prefill_leg(
        &self,
        base: Url,
        path: &str,
        request: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        transfer: &str,
        used: &PrefillIdentity,
        held: budget::Reservation,
    ) {
        let proxy = self.clone();
        let url = join(&base, path);
        let (request, id, up) = (request.clone(), id.to_owned(), up.clone());
        let (transfer, used) = (transfer.to_owned(), used.clone());
        tracing::debug!(request = %id, %transfer, %url, "push: prefill leg (with the decode leg)");
        tokio::spawn(async move {
            let answer = proxy
                .prefill_at(&url, &request, &id, &up, PrefillExtra::Push(&transfer))
                .await;
            drop((request, held));
            let identity = match answer {
                Ok((params, _)) => PrefillIdentity::from_params(&params)
                    .map_err(|what| format!("its kv_transfer_params came {what}")),
                Err(failure) => Err(failure.describe()),
            };
            match identity {
                Ok(identity) => {
                    if identity != used {
                        tracing::warn!(
                            request = %id,
                            %transfer,
                            %url,
                            used = %used.engine_id,
                            answered = %identity.engine_id,
                            "push: the prefill answered another identity than the decode leg named (a restarted P?); D gets no write for this transfer (a retryable kv_load_failed, or the prompt computed)"
                        );
                    }
                    tracing::debug!(request = %id, %transfer, %url, "push: prefill leg done");
                    proxy.remember_identity(&base, &identity);
                }
                Err(why) => {
                    proxy.inner.metrics.push_prefill_failures.inc();
                    tracing::warn!(
                        request = %id,
                        %transfer,
                        %url,
                        error = %why,
                        "push: the prefill leg sent with the decode leg failed; D gets no write for this transfer (a retryable kv_load_failed, retried once, or the prompt computed), and the next request to this P waits for its answer"
                    );
                    proxy.forget_identity(&base, &used);
                }
            }
        });
    }

    /// Push mode: the identity remembered for P `base`, unless a leg to it failed since.
    fn known_identity(&self, base: &Url) -> Option<PrefillIdentity> {
        let known = self.inner.identities.lock().ok()?;
        known
            .get(base.as_str())
            .filter(|k| k.usable)
            .map(|k| k.identity.clone())
    }

    /// Push mode: `identity` is P `base`'s newest; counts a change from the remembered one.
    fn remember_identity(&self, base: &Url, identity: &PrefillIdentity) {
        let Ok(mut known) = self.inner.identities.lock() else {
            return;
        };
        let entry = KnownIdentity {
            identity: identity.clone(),
            usable: true,
        };
        if let Some(old) = known.insert(base.as_str().to_owned(), entry)
            && old.identity != *identity
        {
            self.inner.metrics.push_identity_changes.inc();
            tracing::info!(
                url = %base,
                old = %old.identity.engine_id,
                new = %identity.engine_id,
                "push: prefill identity changed"
            );
        }
    }

    /// Push mode: the next request to P `base` waits for P's answer, unless a newer
    /// answer replaced `used` meanwhile.
    fn forget_identity(&self, base: &Url, used: &PrefillIdentity) {
        if let Ok(mut known) = self.inner.identities.lock()
            && let Some(k) = known.get_mut(base.as_str())
            && k.identity == *used
        {
            k.usable = false;
        }
    }

    /// Sends the prefill request (with D's params of the previous turn, if any, or push
    /// mode's transfer id) to P `first`, and to the next P when that one cannot be reached
    /// (a prefill is safe to repeat: an unused lease expires); returns the base URL of the
    /// P that answered, its `kv_transfer_params` and its `cached_tokens_pulled`.
    async fn prefill(
        &self,
        first: Url,
        path: &str,
        request: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        extra: PrefillExtra<'_>,
    ) -> Result<(Url, Value, Option<u64>), Failure> {
        // Two tries even with one P: a connection that broke under the request (a pooled
        // connection the agent closed as we sent on it) is not a dead P.
        let tries = 2;
        let mut base = first;
        for attempt in 1..=tries {
            if attempt > 1 {
                base = self.base_after(false, &base);
            }
            let url = join(&base, path);
            match self.prefill_at(&url, request, id, up, extra.clone()).await {
                Err(Failure::Unreachable(..)) if attempt < tries => {
                    tracing::warn!(request = %id, %url, "prefill agent unreachable; trying again on the one after it (the same when there is one)");
                }
                Err(Failure::Unreachable(response, outcome)) => {
                    return Err(Failure::Respond(response, outcome));
                }
                Ok((params, pulled)) => return Ok((base, params, pulled)),
                Err(other) => return Err(other),
            }
        }
        Err(bad_gateway("no prefill agent is configured"))
    }

    async fn prefill_at(
        &self,
        url: &Url,
        request: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        extra: PrefillExtra<'_>,
    ) -> Result<(Value, Option<u64>), Failure> {
        let url = url.clone();
        let mut body = request.clone();
        let mut params = json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        });
        match extra {
            PrefillExtra::Pull(cached) => {
                if let (Some(Value::Object(d)), Some(p)) =
                    (cached.map(|c| params_to_value(&c)), params.as_object_mut())
                {
                    p.extend(d);
                    p.insert("do_remote_decode".to_owned(), json!(true));
                }
            }
            PrefillExtra::Push(transfer) => {
                if let Some(p) = params.as_object_mut() {
                    p.insert("transfer_id".to_owned(), json!(transfer));
                }
            }
        }
        body.insert("kv_transfer_params".to_owned(), params);
        body.insert("max_tokens".to_owned(), json!(1));
        if body.contains_key("max_completion_tokens") {
            body.insert("max_completion_tokens".to_owned(), json!(1));
        }
        body.insert("stream".to_owned(), json!(false));
        body.remove("stream_options");
        self.inner.metrics.prefill_requests.inc();
        let unreachable = |e: reqwest::Error| match upstream_failure("prefill", &url, &e) {
            Failure::Respond(response, outcome) if !e.is_timeout() => {
                Failure::Unreachable(response, outcome)
            }
            other => other,
        };
        let response = self
            .send(&url, &body, id, up)
            .timeout(self.inner.config.timeout)
            .send()
            .await
            .map_err(unreachable)?;
        let status = response.status();
        let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
        let limit = self.inner.config.max_upstream_body_bytes;
        let (bytes, _held) = match read_capped(response, limit, self.inner.budget.start()).await {
            Ok(read) => read,
            Err(Capped::Read(e)) => return Err(unreachable(e)),
            Err(Capped::TooLarge) => return Err(too_large("prefill", &url, limit)),
            Err(Capped::OverBudget) => return Err(self.over_budget()),
        };
        if !status.is_success() {
            tracing::debug!(request = %id, %url, %status, "prefill failed; passing its answer through");
            return Err(Failure::Respond(
                passthrough(status, content_type, bytes),
                ProxyOutcome::UpstreamError,
            ));
        }
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|e| bad_gateway(&format!("prefill {url} answered with invalid JSON: {e}")))?;
        let pulled = answer.get("cached_tokens_pulled").and_then(Value::as_u64);
        match answer.get("kv_transfer_params") {
            Some(params @ Value::Object(_)) => Ok((params.clone(), pulled)),
            _ => Err(bad_gateway(&format!(
                "prefill {url} answered without kv_transfer_params (is it a kvlease prefill agent?)"
            ))),
        }
    }

    /// Sends the decode request to the next D, and to the one after it when the request
    /// could not reach that D at all (refused connection: it never saw the lease); with
    /// one D, to it again after each of [`ONLY_D_RETRY_PAUSES`] (a D restarting on its
    /// port gets the request instead of a 502). Returns D's answer to pass through
    /// (streaming), or the retryable KV failure.
    async fn decode(
        &self,
        path: &str,
        body: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        turn: &Turn,
    ) -> Result<Response, Failure> {
        let only = self.inner.config.decode.len() == 1;
        let tries = if only {
            1 + ONLY_D_RETRY_PAUSES.len()
        } else {
            self.inner.config.decode.len().min(2)
        };
        let mut base = self.next_base(true);
        for attempt in 1..=tries {
            if attempt > 1 {
                if only && let Some(pause) = ONLY_D_RETRY_PAUSES.get(attempt - 2) {
                    tokio::time::sleep(*pause).await;
                }
                base = self.base_after(true, &base);
            }
            let url = join(&base, path);
            match self.decode_at(&url, body, id, up, turn).await {
                Err(Failure::Unreachable(..)) if attempt < tries => {
                    if only {
                        tracing::warn!(request = %id, %url, attempt, "the only decode agent refused the connection; trying it again");
                    } else {
                        tracing::warn!(request = %id, %url, "decode agent unreachable; trying the one after it");
                    }
                }
                Err(Failure::Unreachable(response, outcome)) => {
                    return Err(Failure::Respond(response, outcome));
                }
                other => return other,
            }
        }
        Err(bad_gateway("no decode agent is configured"))
    }

    async fn decode_at(
        &self,
        url: &Url,
        body: &Map<String, Value>,
        id: &str,
        up: &Upstream,
        turn: &Turn,
    ) -> Result<Response, Failure> {
        let url = url.clone();
        let streaming = body.get("stream") == Some(&Value::Bool(true));
        self.inner.metrics.decode_requests.inc();
        let mut request = self.send(&url, body, id, up);
        if !streaming {
            request = request.timeout(self.inner.config.timeout);
        }
        // A streamed answer may run for long; its first byte must come in time, and the
        // client's read timeout bounds every gap after it.
        let response = tokio::time::timeout(self.inner.config.timeout, request.send())
            .await
            .map_err(|_| {
                timeout_failure(&format!(
                    "decode {url} did not answer within {:?}",
                    self.inner.config.timeout
                ))
            })?
            .map_err(|e| match upstream_failure("decode", &url, &e) {
                // Only a refused connection proves D never saw the request.
                Failure::Respond(response, outcome) if e.is_connect() => {
                    Failure::Unreachable(response, outcome)
                }
                other => other,
            })?;
        let status = response.status();
        let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let bytes = read_limited(response, MAX_ERROR_BODY_BYTES)
                .await
                .map_err(|e| upstream_failure("decode", &url, &e))?;
            if is_retryable_kv_failure(status, &bytes) {
                return Err(Failure::RetryableKv(status, bytes));
            }
            return Ok(passthrough(status, content_type, bytes));
        }
        if streaming && status.is_success() {
            let mut builder = Response::builder().status(status);
            if let Some(ct) = content_type {
                builder = builder.header(header::CONTENT_TYPE, ct);
            }
            builder = builder.header(header::CACHE_CONTROL, "no-cache");
            return builder
                .body(Body::from_stream(response.bytes_stream()))
                .map_err(|e| bad_gateway(&format!("building the streamed answer: {e}")));
        }
        let limit = self.inner.config.max_upstream_body_bytes;
        let (bytes, held) = read_capped(response, limit, self.inner.budget.start())
            .await
            .map_err(|e| match e {
                Capped::Read(e) => upstream_failure("decode", &url, &e),
                Capped::TooLarge => too_large("decode", &url, limit),
                Capped::OverBudget => self.over_budget(),
            })?;
        if status.is_success()
            && let Ok(Value::Object(mut answer)) = serde_json::from_slice::<Value>(&bytes)
            && is_decoder_params(answer.get("kv_transfer_params"))
        {
            self.remember_turn(turn, &answer);
            if let Some(n) = turn.cached_tokens_pulled {
                answer.insert("cached_tokens_pulled".to_owned(), json!(n));
            }
            if let Ok(out) = serde_json::to_vec(&answer) {
                return Ok(passthrough(status, content_type, Bytes::from(out)));
            }
        }
        // The answer's bytes stay reserved until the client took them.
        let mut response = Response::new(budget::guarded_body(bytes, held));
        *response.status_mut() = status;
        if let Some(ct) = content_type {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        Ok(response)
    }

    /// Bidirectional mode: keeps D's cached-blocks params of a finished turn for the
    /// conversation's next one.
    fn remember_turn(&self, turn: &Turn, answer: &Map<String, Value>) {
        let (Some(key), Some(v)) = (&turn.key, answer.get("kv_transfer_params")) else {
            return;
        };
        if !is_decoder_params(Some(v)) {
            return;
        }
        match params_from_value(v) {
            Ok(p) => {
                if let Ok(mut store) = self.inner.conversations.lock() {
                    store.remember(key.clone(), p, Instant::now());
                }
            }
            Err(e) => tracing::debug!(error = %e.message, "D's cached-blocks params ignored"),
        }
    }

    fn send(
        &self,
        url: &Url,
        body: &Map<String, Value>,
        id: &str,
        up: &Upstream,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .inner
            .client
            .post(url.clone())
            .json(body)
            .header(HeaderName::from_static(REQUEST_ID_HEADER), id)
            .header(HeaderName::from_static(HOP_HEADER), up.hop.clone());
        if let Some(auth) = &up.auth {
            request = request.header(header::AUTHORIZATION, auth.clone());
        }
        request
    }
}

/// `base` joined with `path`, keeping a path prefix in `base` (`http://h/x` + `/v1/...`).
fn join(base: &Url, path: &str) -> Url {
    let mut url = base.clone();
    let joined = format!("{}{}", base.path().trim_end_matches('/'), path);
    url.set_path(&joined);
    url
}

async fn read_limited(mut response: reqwest::Response, limit: usize) -> reqwest::Result<Bytes> {
    let mut out = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = limit.saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= limit {
            break;
        }
    }
    Ok(Bytes::from(out))
}

/// Why [`read_capped`] returned no body.
enum Capped {
    /// The body announced or sent more than the limit.
    TooLarge,
    /// The body does not fit what is left of the budget.
    OverBudget,
    /// Reading the body failed.
    Read(reqwest::Error),
}

/// The whole body of `response` and its reservation in the budget, or
/// [`Capped::TooLarge`] as soon as its `Content-Length` or the bytes received so far
/// exceed `limit`, or [`Capped::OverBudget`] as soon as they do not fit the budget
/// (dropping the response closes the connection: nothing more is read). An announced
/// length is reserved up front.
async fn read_capped(
    mut response: reqwest::Response,
    limit: usize,
    mut held: budget::Reservation,
) -> Result<(Bytes, budget::Reservation), Capped> {
    let announced = response.content_length();
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(Capped::TooLarge);
    }
    let capacity = announced.map_or(0, |n| usize::try_from(n).unwrap_or(limit).min(limit));
    if !held.grow(capacity) {
        return Err(Capped::OverBudget);
    }
    let mut reserved = capacity;
    let mut out = Vec::with_capacity(capacity);
    while let Some(chunk) = response.chunk().await.map_err(Capped::Read)? {
        if chunk.len() > limit - out.len() {
            return Err(Capped::TooLarge);
        }
        let needed = out.len() + chunk.len();
        if needed > reserved {
            if !held.grow(needed - reserved) {
                return Err(Capped::OverBudget);
            }
            reserved = needed;
        }
        out.extend_from_slice(&chunk);
    }
    Ok((Bytes::from(out), held))
}

/// The 502 for an upstream answer over `--max-upstream-body-bytes`.
fn too_large(kind: &str, url: &Url, limit: usize) -> Failure {
    bad_gateway(&format!(
        "{kind} {url} answered with a body over the proxy's limit of {limit} bytes \
         (--max-upstream-body-bytes)"
    ))
}

fn passthrough(status: StatusCode, content_type: Option<HeaderValue>, body: Bytes) -> Response {
    let mut response = (status, body).into_response();
    if let Some(ct) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}

fn bad_request(message: &str) -> Failure {
    Failure::Respond(
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).into_response(),
        ProxyOutcome::BadRequest,
    )
}

fn bad_gateway(message: &str) -> Failure {
    tracing::warn!("{message}");
    Failure::Respond(
        ApiError::new(StatusCode::BAD_GATEWAY, "bad_gateway", message).into_response(),
        ProxyOutcome::BadGateway,
    )
}

fn loop_detected(message: &str) -> Failure {
    tracing::warn!("{message}");
    Failure::Respond(
        ApiError::new(StatusCode::LOOP_DETECTED, "loop_detected", message).into_response(),
        ProxyOutcome::Loop,
    )
}

fn timeout_failure(message: &str) -> Failure {
    tracing::warn!("{message}");
    Failure::Respond(
        ApiError::new(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", message).into_response(),
        ProxyOutcome::Timeout,
    )
}

fn upstream_failure(kind: &str, url: &Url, error: &reqwest::Error) -> Failure {
    // Display of a reqwest error omits its cause ("error sending request"); add the chain.
    let cause = crate::telemetry::error_chain(error);
    if error.is_timeout() {
        timeout_failure(&format!("{kind} {url} timed out: {cause}"))
    } else {
        bad_gateway(&format!("{kind} {url} is unreachable: {cause}"))
    }
}

async fn completions(State(proxy): State<Proxy>, headers: HeaderMap, body: Body) -> Response {
    proxy.handle("/v1/completions", headers, body).await
}

async fn chat_completions(State(proxy): State<Proxy>, headers: HeaderMap, body: Body) -> Response {
    proxy.handle("/v1/chat/completions", headers, body).await
}

async fn metrics(State(proxy): State<Proxy>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        proxy.metrics().encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests;
