//! The kvlease agents: the `lease`, `notif`, `transport` and `gpu-mem` crates composed into
//! prefill (P) and decode (D) engines with forward loops, plus the routing proxy.
//!
//! - [`kv`]: the deterministic KV content generator, its pool layout and `kv_digest`;
//! - [`api`]: HTTP request and response bodies, OpenAI-shaped errors;
//! - [`sidechannel`]: P's handshake and metadata endpoint (like vLLM's NIXL side channel).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod config;
pub mod kv;
pub mod metrics;
pub mod proxy;
pub mod sidechannel;
pub mod telemetry;
