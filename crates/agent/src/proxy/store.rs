//! The proxy's conversation store: which D turn a next turn of the same conversation
//! should pull from (bidirectional mode).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvlease_engine::DecoderKvParams;
use serde_json::Value;

use crate::kv;

/// The key that associates turns: the request's `conversation_id` when it has one, else a
/// hash of the first chat message (`role` and `content`). `None` when neither exists.
pub fn conversation_key(body: &Value) -> Option<String> {
    if let Some(id) = body.get("conversation_id").and_then(Value::as_str) {
        return Some(format!("id:{id}"));
    }
    let first = body.get("messages")?.as_array()?.first()?;
    let role = first.get("role").and_then(Value::as_str).unwrap_or("");
    let content = first.get("content").and_then(Value::as_str).unwrap_or("");
    let mut tokens = kv::tokenize(role);
    tokens.push(u32::MAX);
    tokens.extend(kv::tokenize(content));
    let h = kv::prefix_hashes(&tokens).last().copied().unwrap_or(0);
    Some(format!("msg:{h:016x}"))
}

/// The proxy's memory of D's cached-blocks params between turns, bounded in entries and
/// time: an entry older than its relative TTL is dropped, the oldest goes when full.
#[derive(Debug)]
pub struct ConversationStore {
    cap: usize,
    entries: HashMap<String, (DecoderKvParams, Instant)>,
}

impl ConversationStore {
    /// A store of at most `cap` conversations (at least one).
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            entries: HashMap::new(),
        }
    }

    /// Remembers D's params for `key` (replacing the previous turn's).
    pub fn remember(&mut self, key: String, params: DecoderKvParams, now: Instant) {
        self.entries
            .retain(|_, (p, at)| now.saturating_duration_since(*at) < p.kvlease_ttl_remaining);
        if self.entries.len() >= self.cap
            && !self.entries.contains_key(&key)
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone())
        {
            self.entries.remove(&oldest);
        }
        self.entries.insert(key, (params, now));
    }

    /// Takes `key`'s params, aged by the time they were held; `None` when unknown or
    /// already past their TTL.
    pub fn take(&mut self, key: &str, now: Instant) -> Option<DecoderKvParams> {
        let (p, at) = self.entries.remove(key)?;
        // Aged by whole milliseconds, the precision of the TTL on the wire.
        let held = now.saturating_duration_since(at).as_millis();
        let p = p.aged_by(Duration::from_millis(
            u64::try_from(held).unwrap_or(u64::MAX),
        ));
        (!p.kvlease_ttl_remaining.is_zero()).then_some(p)
    }

    /// Conversations held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
