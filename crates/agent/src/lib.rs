//! The kvlease agents: the `lease`, `notif`, `transport` and `gpu-mem` crates composed into
//! prefill (P) and decode (D) engines with forward loops, plus the routing proxy.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod metrics;
pub mod proxy;
pub mod telemetry;
