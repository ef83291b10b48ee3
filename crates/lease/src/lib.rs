//! Sans-IO lease machinery for kvlease.
//!
//! This crate holds the prefill side's lease table and the decode side's heartbeat
//! tracker as pure state machines. It does **not** read a clock, sleep, start threads or do
//! any IO: every method that depends on time takes `now` as its first argument.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod ids;
mod time;

pub use ids::{BlockId, EngineId, Generation, InvalidId, RequestId};
pub use time::Timestamp;
