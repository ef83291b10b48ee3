//! The kvlease agents: the `lease`, `notif`, `transport` and `gpu-mem` crates composed into
//! prefill (P) and decode (D) engines with forward loops, plus the routing proxy.
//!
//! - [`kv`]: the deterministic KV content generator, its pool layout and `kv_digest`;
//! - [`bidir`]: bidirectional multi-turn mode (D keeps a turn's blocks, P pulls them);
//! - [`api`]: HTTP request and response bodies, OpenAI-shaped errors;
//! - [`apikey`]: the HTTP API's bearer key (`--api-key`);
//! - [`sidechannel`]: P's handshake and metadata endpoint (like vLLM's NIXL side channel);
//! - [`prefill`] / [`decode`]: the P and D engines and their forward loops;
//! - [`http`]: the OpenAI-shaped HTTP API on axum, with its limits;
//! - [`health`]: the engine loop's heartbeat behind `/health`;
//! - [`link`]: how the engines use the transport;
//! - [`serve`]: what the `prefill-agent` and `decode-agent` binaries run;
//! - [`push`]: push mode's request contract and D's peer message;
//! - [`shell`]: what the P and D shells share (pool setup, peer names, addresses).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod apikey;
pub mod bidir;
pub mod config;
pub mod decode;
pub mod health;
pub mod http;
pub mod kv;
pub mod link;
pub mod metrics;
pub mod prefill;
pub mod proxy;
pub mod push;
pub mod serve;
pub mod shell;
pub mod sidechannel;
pub mod telemetry;
