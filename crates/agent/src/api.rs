//! The HTTP API's request and response bodies (vLLM's OpenAI server with
//! `kv_transfer_params`) and its error shape.
//!
//! Errors are OpenAI-shaped: `{"error": {"message", "type", "param", "code", "retryable"}}`.
//! A failed KV load on D that the proxy may retry from P is HTTP 503 with
//! `"type": "kv_load_failed"` and `"retryable": true` ([`ApiError::kv_load_failed`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvlease_proto::params::ParamsError;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::kv;

/// The error `type` of a retryable KV load failure on D (what the proxy retries on).
pub const KV_LOAD_FAILED: &str = "kv_load_failed";

/// An error answered to an HTTP client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// The field at fault, if any (`kv_transfer_params.remote_block_ids`).
    pub param: Option<String>,
    /// What went wrong, for a human.
    pub message: String,
    /// Whether the client (the proxy) may retry the whole request from prefill.
    pub retryable: bool,
    /// When to try again: sent as `Retry-After` (whole seconds, at least 1).
    pub retry_after: Option<std::time::Duration>,
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn bad_field(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!("{param}: {}", message.into()),
            param: Some(param),
            retryable: false,
            retry_after: None,
        }
    }

    /// A 4xx/5xx of the given type without a field.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            param: None,
            message: message.into(),
            retryable: false,
            retry_after: None,
        }
    }

    /// 503, the server is at capacity (queue or pool full): retry later (`Retry-After: 1`).
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            retry_after: Some(std::time::Duration::from_secs(1)),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
        }
    }

    /// Sets [`retry_after`](Self::retry_after).
    #[must_use]
    pub fn retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The `Retry-After` value: whole seconds, rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after
            .map(|d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
            .map(|s| s.max(1))
    }

    /// 503 `kv_load_failed`, retryable: the KV could not be loaded (stale fence, expiry
    /// notice, read failure); prefill again.
    pub fn kv_load_failed(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, KV_LOAD_FAILED, message)
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
            "retryable": self.retryable,
        }})
    }
}

/// The codec's errors are 400s naming the field (`kv_transfer_params.remote_block_ids`):
/// the one place `kv_transfer_params` errors become HTTP answers.
impl From<ParamsError> for ApiError {
    fn from(e: ParamsError) -> Self {
        Self::bad_field(e.field, e.reason)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs() {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        r
    }
}

/// A prompt: text, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized byte by byte.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of one text (OpenAI allows a list; we take exactly one).
    Batch(Vec<String>),
}

/// `POST /v1/completions` body (fields we do not use, such as `temperature`, are ignored,
/// as vLLM's proxies send them).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model name (echoed back).
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    #[serde(default)]
    pub prompt: Option<Prompt>,
    /// Token ids instead of a prompt.
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The connector's parameters, validated separately so errors name the field.
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    /// A request id chosen by the client (vLLM's proxies use `X-Request-Id` instead).
    #[serde(default)]
    pub request_id: Option<String>,
    /// The conversation the turn belongs to (bidirectional mode; D echoes it in its
    /// cached-blocks params).
    #[serde(default)]
    pub conversation_id: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tokens to generate (`max_completion_tokens` is the newer name).
    #[serde(default, alias = "max_completion_tokens")]
    pub max_tokens: Option<u32>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The connector's parameters.
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    /// The conversation the turn belongs to (bidirectional mode).
    #[serde(default)]
    pub conversation_id: Option<String>,
}

impl ChatRequest {
    /// The prompt the messages make: `<|role|>\ncontent\n` per message, then
    /// `<|assistant|>\n`.
    pub fn into_completion(self) -> CompletionRequest {
        let mut prompt = String::new();
        for m in &self.messages {
            prompt.push_str("<|");
            prompt.push_str(&m.role);
            prompt.push_str("|>\n");
            prompt.push_str(&m.content);
            prompt.push('\n');
        }
        prompt.push_str("<|assistant|>\n");
        CompletionRequest {
            model: self.model,
            prompt: Some(Prompt::Text(prompt)),
            prompt_token_ids: None,
            max_tokens: self.max_tokens,
            stream: self.stream,
            kv_transfer_params: self.kv_transfer_params,
            request_id: None,
            conversation_id: self.conversation_id,
        }
    }
}

fn too_many_tokens(n: usize) -> ApiError {
    ApiError::bad_field(
        "prompt",
        format!("{n} tokens; the limit is {MAX_PROMPT_TOKENS}"),
    )
}

/// Longest prompt accepted, in tokens.
pub const MAX_PROMPT_TOKENS: usize = 1 << 16;
/// Most tokens one request may generate.
pub const MAX_GEN_TOKENS: u32 = 1 << 14;

impl CompletionRequest {
    /// Checks a text prompt's length before it is tokenized (token-id prompts are
    /// bounded by [`tokens`](Self::tokens)).
    ///
    /// # Errors
    /// 400 naming `prompt` when the text is longer than `max_bytes`.
    pub fn check_prompt_bytes(&self, max_bytes: usize) -> Result<(), ApiError> {
        let len = match &self.prompt {
            Some(Prompt::Text(s)) => s.len(),
            Some(Prompt::Batch(b)) => b.iter().map(String::len).sum(),
            Some(Prompt::Tokens(_)) | None => 0,
        };
        if len > max_bytes {
            tracing::debug!(len, max_bytes, "prompt refused before tokenizing");
            return Err(ApiError::bad_field(
                "prompt",
                format!("{len} bytes of text; the limit is {max_bytes}"),
            ));
        }
        Ok(())
    }

    /// The prompt's token ids.
    ///
    /// # Errors
    /// 400 naming `prompt` or `prompt_token_ids` when both or neither are given, or the
    /// prompt is empty or too long.
    pub fn tokens(&self) -> Result<Vec<u32>, ApiError> {
        let tokens = match (&self.prompt, &self.prompt_token_ids) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_field(
                    "prompt",
                    "give prompt or prompt_token_ids, not both",
                ));
            }
            (None, None) => return Err(ApiError::bad_field("prompt", "missing")),
            (Some(Prompt::Text(s)), None) => kv::tokenize(s),
            (Some(Prompt::Tokens(t)), None) | (None, Some(t)) => {
                if t.len() > MAX_PROMPT_TOKENS {
                    return Err(too_many_tokens(t.len()));
                }
                t.clone()
            }
            (Some(Prompt::Batch(b)), None) => match b.as_slice() {
                [one] => kv::tokenize(one),
                _ => {
                    return Err(ApiError::bad_field(
                        "prompt",
                        "exactly one prompt per request",
                    ));
                }
            },
        };
        if tokens.is_empty() {
            return Err(ApiError::bad_field("prompt", "empty"));
        }
        if tokens.len() > MAX_PROMPT_TOKENS {
            return Err(too_many_tokens(tokens.len()));
        }
        Ok(tokens)
    }

    /// `max_tokens`, default 16.
    ///
    /// # Errors
    /// 400 naming `max_tokens` when it is above [`MAX_GEN_TOKENS`].
    pub fn max_tokens(&self) -> Result<u32, ApiError> {
        let n = self.max_tokens.unwrap_or(16);
        if n > MAX_GEN_TOKENS {
            return Err(ApiError::bad_field(
                "max_tokens",
                format!("{n}; the limit is {MAX_GEN_TOKENS}"),
            ));
        }
        Ok(n)
    }
}

/// Transfer statistics D adds to its answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TransferStats {
    /// Bytes read from P.
    pub bytes: u64,
    /// `tcp` or `verbs`.
    pub backend: String,
    /// Arrival to scheduling.
    pub queue_time_ms: f64,
    /// Posting the reads to the last completion.
    pub read_time_ms: f64,
    /// P workers read from.
    pub remote_workers: u32,
}

#[cfg(test)]
mod tests {
    use kvlease_proto::params::{KvTransferParams, check_prefill_request};

    use super::*;

    fn p_answer() -> Value {
        json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "p0", "remote_block_ids": [3, 1],
            "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_request_id": "r1", "tp_size": 2,
            "kvlease_generation": 9, "kvlease_num_tokens": 20, "kvlease_lease_ms": 3000,
            "kv_digest": "kvd-00000000000000ff", "kvlease_instance": 5,
        })
    }

    /// D's parse at the HTTP edge: the codec, its errors as 400s naming the field.
    fn d_params(v: &Value) -> Result<KvTransferParams, ApiError> {
        Ok(KvTransferParams::from_value(v)?)
    }

    #[test]
    fn remote_params_round_trip_and_name_bad_fields() {
        let p = d_params(&p_answer()).expect("valid params");
        assert_eq!(p.to_value(), p_answer());
        for (key, val, param) in [
            (
                "remote_block_ids",
                json!([1, -1]),
                "kv_transfer_params.remote_block_ids",
            ),
            (
                "remote_port",
                json!(70000),
                "kv_transfer_params.remote_port",
            ),
            (
                "remote_engine_id",
                Value::Null,
                "kv_transfer_params.remote_engine_id",
            ),
            ("kv_digest", json!("x"), "kv_transfer_params.kv_digest"),
            (
                "remote_engine_id",
                json!("p 0"),
                "kv_transfer_params.remote_engine_id",
            ),
            (
                "remote_request_id",
                json!(""),
                "kv_transfer_params.remote_request_id",
            ),
            (
                "do_remote_prefill",
                json!(false),
                "kv_transfer_params.do_remote_prefill",
            ),
            (
                "remote_request_id",
                json!("a b"),
                "kv_transfer_params.remote_request_id",
            ),
            ("tp_size", json!(0), "kv_transfer_params.tp_size"),
            ("remote_port", json!(0), "kv_transfer_params.remote_port"),
            (
                "kvlease_lease_ms",
                json!(0),
                "kv_transfer_params.kvlease_lease_ms",
            ),
        ] {
            let mut v = p_answer();
            v[key] = val;
            let e = d_params(&v).expect_err("invalid");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param.as_deref(), Some(param), "{key}");
            assert!(e.message.starts_with(param), "{}", e.message);
            assert_eq!(e.body()["error"]["param"], param);
        }
    }

    #[test]
    fn prefill_accepts_the_vllm_proxy_shape() {
        let v = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null});
        let p = |v: Option<&Value>| -> Result<(), ApiError> { Ok(check_prefill_request(v)?) };
        assert!(p(Some(&v)).is_ok());
        let e = p(Some(&json!({"do_remote_decode": "yes"}))).expect_err("not a boolean");
        assert_eq!(
            e.param.as_deref(),
            Some("kv_transfer_params.do_remote_decode")
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = p(None).expect_err("missing");
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params"));
        let req: CompletionRequest =
            serde_json::from_value(json!({"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}))
                .expect("valid body");
        assert_eq!(req.tokens().expect("tokens"), vec![1, 2, 3]);
        let chat: ChatRequest =
            serde_json::from_value(json!({"messages": [{"role": "user", "content": "hi"}]}))
                .expect("valid chat");
        let c = chat.into_completion();
        assert_eq!(
            c.tokens().expect("tokens"),
            kv::tokenize("<|user|>\nhi\n<|assistant|>\n")
        );
        assert_eq!(
            ApiError::kv_load_failed("x").body()["error"]["type"],
            KV_LOAD_FAILED
        );
    }
}
