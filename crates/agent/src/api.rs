//! The HTTP API's request and response bodies (vLLM's OpenAI server with
//! `kv_transfer_params`) and its error shape.
//!
//! Errors are OpenAI-shaped: `{"error": {"message", "type", "param", "code", "retryable"}}`.
//! A failed KV load on D that the proxy may retry from P is HTTP 503 with
//! `"type": "kv_load_failed"` and `"retryable": true` ([`ApiError::kv_load_failed`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvlease_lease::{EngineId, RequestId};
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
        }
    }

    /// 503, the server is at capacity (queue or pool full): retry later.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
        }
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
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

/// The `kv_transfer_params` P answers with and D takes (vLLM's NixlConnector names plus
/// ours under `kvlease_*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteParams {
    /// Always true in P's answer: D must pull the KV.
    pub do_remote_prefill: bool,
    /// Always false in P's answer.
    pub do_remote_decode: bool,
    /// P's engine id.
    pub remote_engine_id: EngineId,
    /// P's block ids holding the request, in token order (the same ids on every P rank).
    pub remote_block_ids: Vec<u32>,
    /// Host of P's side channel.
    pub remote_host: String,
    /// Port of P's side channel.
    pub remote_port: u16,
    /// P's id of the request (heartbeats and completions name it).
    pub remote_request_id: RequestId,
    /// P's TP size.
    pub tp_size: u32,
    /// The lease's fencing generation, published per block in each P rank's fence region.
    pub kvlease_generation: u64,
    /// Tokens whose KV the blocks hold.
    pub kvlease_num_tokens: u32,
    /// Initial lease in milliseconds (informational: D heartbeats per its own config).
    pub kvlease_lease_ms: u64,
    /// The order-independent digest of the whole KV (all ranks).
    pub kv_digest: kv::KvDigest,
    /// The P instance that granted the lease (its start time in microseconds): D finds a
    /// restarted P by it. 0 (or absent) when unknown.
    #[serde(default)]
    pub kvlease_instance: u64,
}

impl RemoteParams {
    /// Parses D's `kv_transfer_params` (P's answer copied by a proxy), naming the field at
    /// fault.
    ///
    /// # Errors
    /// 400 naming `kv_transfer_params.<field>`.
    pub fn from_value(v: &Value) -> Result<Self, ApiError> {
        let obj = v
            .as_object()
            .ok_or_else(|| ApiError::bad_field("kv_transfer_params", "must be an object"))?;
        let field = |name: &str| -> Result<&Value, ApiError> {
            match obj.get(name) {
                Some(Value::Null) | None => Err(ApiError::bad_field(
                    format!("kv_transfer_params.{name}"),
                    "missing (copy P's kv_transfer_params)",
                )),
                Some(x) => Ok(x),
            }
        };
        let bad = |name: &str, what: &str| {
            ApiError::bad_field(
                format!("kv_transfer_params.{name}"),
                format!("must be {what}"),
            )
        };
        let typed = |name: &str, what: &str| -> Result<&str, ApiError> {
            field(name)?.as_str().ok_or_else(|| bad(name, what))
        };
        let id_err = |name: &str, e: kvlease_lease::InvalidId| {
            ApiError::bad_field(format!("kv_transfer_params.{name}"), e.to_string())
        };
        let string = |name: &str| -> Result<String, ApiError> {
            field(name)?
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad(name, "a string"))
        };
        let uint = |name: &str, max: u64| -> Result<u64, ApiError> {
            field(name)?
                .as_u64()
                .filter(|&n| n <= max)
                .ok_or_else(|| bad(name, &format!("an integer in 0..={max}")))
        };
        let blocks = field("remote_block_ids")?
            .as_array()
            .ok_or_else(|| bad("remote_block_ids", "a list of block ids"))?
            .iter()
            .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad("remote_block_ids", "a list of block ids"))?;
        let p = Self {
            do_remote_prefill: obj
                .get("do_remote_prefill")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            do_remote_decode: obj
                .get("do_remote_decode")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            remote_engine_id: EngineId::new(typed("remote_engine_id", "a string")?)
                .map_err(|e| id_err("remote_engine_id", e))?,
            remote_block_ids: blocks,
            remote_host: string("remote_host")?,
            // Bounds checked by `uint`.
            remote_port: uint("remote_port", u64::from(u16::MAX))? as u16,
            remote_request_id: RequestId::new(typed("remote_request_id", "a string")?)
                .map_err(|e| id_err("remote_request_id", e))?,
            tp_size: uint("tp_size", 1024)? as u32,
            kvlease_generation: uint("kvlease_generation", u64::MAX)?,
            kvlease_num_tokens: uint("kvlease_num_tokens", u64::from(u32::MAX))? as u32,
            kvlease_lease_ms: obj
                .get("kvlease_lease_ms")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            kv_digest: kv::KvDigest::parse(typed("kv_digest", "kvd-<16 hex digits>")?)
                .ok_or_else(|| bad("kv_digest", "kvd-<16 hex digits>"))?,
            kvlease_instance: match obj.get("kvlease_instance") {
                None | Some(Value::Null) => 0,
                Some(_) => uint("kvlease_instance", u64::MAX)?,
            },
        };
        if !p.do_remote_prefill {
            return Err(bad("do_remote_prefill", "true on D"));
        }
        if p.tp_size == 0 {
            return Err(bad("tp_size", "at least 1"));
        }
        if p.kvlease_generation == 0 {
            return Err(bad("kvlease_generation", "a non-zero generation"));
        }
        Ok(p)
    }
}

/// What a request to P asks for, from its `kv_transfer_params`.
///
/// # Errors
/// 400 naming the field when the params are not an object, `do_remote_decode` is not a
/// boolean, or it is false (P only serves remote decode).
pub fn prefill_params(v: Option<&Value>) -> Result<(), ApiError> {
    let Some(v) = v else {
        return Err(ApiError::bad_field(
            "kv_transfer_params",
            "missing: P needs {\"do_remote_decode\": true}",
        ));
    };
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad_field("kv_transfer_params", "must be an object"))?;
    match obj.get("do_remote_decode") {
        Some(Value::Bool(true)) => Ok(()),
        Some(Value::Bool(false)) | None => Err(ApiError::bad_field(
            "kv_transfer_params.do_remote_decode",
            "must be true (this is a prefill-only engine)",
        )),
        Some(_) => Err(ApiError::bad_field(
            "kv_transfer_params.do_remote_decode",
            "must be a boolean",
        )),
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

    #[test]
    fn remote_params_round_trip_and_name_bad_fields() {
        let p = RemoteParams::from_value(&p_answer()).expect("valid params");
        assert_eq!(serde_json::to_value(&p).expect("serializable"), p_answer());
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
        ] {
            let mut v = p_answer();
            v[key] = val;
            let e = RemoteParams::from_value(&v).expect_err("invalid");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param.as_deref(), Some(param), "{key}");
        }
        // Serde validates the typed fields too.
        let mut v = p_answer();
        v["remote_request_id"] = json!("a b");
        assert!(serde_json::from_value::<RemoteParams>(v).is_err());
    }

    #[test]
    fn prefill_accepts_the_vllm_proxy_shape() {
        let v = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null});
        assert!(prefill_params(Some(&v)).is_ok());
        assert!(prefill_params(Some(&json!({"do_remote_decode": "yes"}))).is_err());
        assert!(prefill_params(None).is_err());
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
