//! One home for the contracts that cross a process boundary in kvlease.
//!
//! Every message two kvlease processes (or kvlease and vLLM) exchange outside the
//! notification grammar (`kvlease-notif`) is defined here once, and every shell that speaks
//! it (the agents, the transport backends, the Python binding) encodes and decodes it
//! through this crate:
//!
//! - [`params`]: `kv_transfer_params`, the JSON object a P engine answers a prefill with and
//!   a D engine receives with the decode request (vLLM's keys and ours, one codec).
//! - [`auth`]: the authenticated challenge/response exchange under the cluster token, with
//!   its HMAC labels, used by every TCP, shared-memory and side-channel connection.
//! - [`sidechannel`]: the side channel's frames, on which P hands its engine info to a D
//!   that proved the token.
//! - [`engine_info`]: that engine info, the handshake payload ([`engine_info::EngineInfo`]),
//!   one type for the agents' P and the vLLM connector's.
//!
//! Like `kvlease-lease` and `kvlease-notif`, this crate does no IO: it owns no socket, no
//! thread and no clock, and draws no randomness (nonces are arguments). Bytes come in as
//! slices and go out as vectors; a decoder that needs more bytes says how many.

pub mod auth;
pub mod clock;
pub mod compat;
pub mod engine_info;
mod json;
pub mod params;
pub mod sidechannel;
