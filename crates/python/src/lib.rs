//! The native half of the `kvlease` Python package (`kvlease._kvlease`): the transport
//! agent, the engine cores, the handshake side channel, the `kv_transfer_params` codec and the engine-info
//! handshake payload,
//! with Python types.
//!
//! The Python package (`python/kvlease/`) re-exports these classes, defines the
//! exception classes (`kvlease.errors`, raised from here by name), describes Python
//! memory for registration (`kvlease._memory`) and carries the vLLM connector
//! (`kvlease.vllm`), which drives the engine cores through this module.
//!
//! What this crate does not do: decide anything about leases (that is
//! `kvlease-engine`), move bytes (that is `kvlease-transport`), or run threads of its
//! own beyond what those crates start. Blocking calls release the GIL.
//!
//! `unsafe` is denied here except in one place, `memory::Described::into_region`, which
//! turns an address Python described into a `kvlease_gpu_mem::ForeignRegion`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

use pyo3::prelude::*;

mod agent;
mod clock;
mod cores;
mod engine_info;
mod errors;
mod logs;
mod memory;
mod params;
mod sidechannel;

/// The native module `kvlease._kvlease`.
#[pymodule]
fn _kvlease(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<agent::Region>()?;
    m.add_class::<agent::RemoteRegion>()?;
    m.add_class::<agent::Peer>()?;
    m.add_class::<agent::Batch>()?;
    m.add_class::<agent::BatchResult>()?;
    m.add_class::<memory::FenceWords>()?;
    m.add_class::<cores::PrefillCore>()?;
    m.add_class::<cores::PrefillStart>()?;
    m.add_class::<cores::Granted>()?;
    m.add_class::<cores::Released>()?;
    m.add_class::<cores::ClearFences>()?;
    m.add_class::<cores::SendNotif>()?;
    m.add_class::<cores::Refused>()?;
    m.add_class::<cores::PrefillNotifOutcome>()?;
    m.add_class::<cores::DecodeCore>()?;
    m.add_class::<cores::RemoteKv>()?;
    m.add_class::<cores::HandshakeStart>()?;
    m.add_class::<cores::Transmit>()?;
    m.add_class::<cores::BatchPlan>()?;
    m.add_class::<cores::LoadPlan>()?;
    m.add_class::<cores::Loaded>()?;
    m.add_class::<cores::HandshakeDone>()?;
    m.add_class::<cores::EngineDropped>()?;
    m.add_class::<cores::Finished>()?;
    m.add_class::<cores::Reservations>()?;
    m.add_class::<cores::Reservation>()?;
    m.add_class::<cores::ReservationEnded>()?;
    m.add_class::<cores::PushCore>()?;
    m.add_class::<cores::PushWrite>()?;
    m.add_class::<cores::PushSend>()?;
    m.add_class::<cores::PushEnded>()?;
    m.add_class::<params::KvTransferParams>()?;
    m.add_class::<params::PullPlan>()?;
    m.add_class::<engine_info::EngineInfo>()?;
    m.add_class::<engine_info::WorkerInfo>()?;
    m.add_class::<cores::DecodeNotifOutcome>()?;
    m.add_class::<cores::DecodedNotif>()?;
    m.add_class::<sidechannel::SideChannelServer>()?;
    m.add_class::<clock::ClockProbeServer>()?;
    m.add_class::<clock::ClockOffset>()?;
    m.add_function(wrap_pyfunction!(clock::probe_clock, m)?)?;
    m.add_function(wrap_pyfunction!(sidechannel::side_channel_fetch, m)?)?;
    m.add_function(wrap_pyfunction!(cores::decode_notif, m)?)?;
    m.add_function(wrap_pyfunction!(cores::encode_heartbeats, m)?)?;
    m.add_function(wrap_pyfunction!(cores::tp_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(logs::install_log_bridge, m)?)?;
    m.add_function(wrap_pyfunction!(params::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(engine_info::kv_mismatches, m)?)?;
    m.add_function(wrap_pyfunction!(logs::drain_logs, m)?)?;
    Ok(())
}
