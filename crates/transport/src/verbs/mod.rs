//! The verbs backend: one-sided RDMA READ over RC queue pairs (libibverbs through
//! `sideway`, loaded at run time), and push mode's RDMA WRITE into ranges the receiver
//! granted remote-write access to for one reservation (`ProtectionDomain::
//! register_remote_write`; pools are registered for remote reads only).
//!
//! Layers, bottom up, each child holding an `Arc` of its parent (like rust-ibverbs):
//! [`Device`] (an opened device context, its port, GID and MTU) → [`ProtectionDomain`] →
//! [`MemoryRegion`] (a whole [`DmaRegion`](kvlease_gpu_mem::DmaRegion), registered once) and
//! [`Endpoint`] (one RC queue pair, its completion queue and its notification rings).
//!
//! What this module guarantees:
//! - no public function takes a local address: reads name a [`MemoryRegion`] and an offset,
//!   bounds-checked before anything is posted;
//! - every posted work request keeps an `Arc` of the memory it touches in the endpoint's
//!   in-flight table until its completion is reaped (or the queue pair is destroyed), so the
//!   NIC never writes into freed memory;
//! - values that come from the device or a peer never reach one of `sideway`'s panicking
//!   conversions (see `docs/VERBS-NOTES.md`); Drop never panics.
//!
//! What the endpoint does not do: it starts no thread and reads no clock. Completions are
//! reaped in [`Endpoint::poll`], which the caller runs from its own loop (the agent's link
//! also times how long outstanding work goes without a completion: `stall.rs`); the
//! exchange of [`ConnectionInfo`] (and re-exchange after a queue pair error) travels over
//! the caller's TCP side channel, not rdma_cm (which does not work inside network
//! namespaces on rxe).

mod device;
// Builds work requests whose scatter-gather entries name registered memory (sideway's
// `setup_sge` is `unsafe`) and takes the CQ out of its `ManuallyDrop` in Drop.
#[allow(unsafe_code)]
mod endpoint;
pub(crate) mod error;
pub(crate) mod link;
// `ibv_reg_mr`/`ibv_reg_dmabuf_mr` on raw addresses, and the notification rings' heap
// buffer.
#[allow(unsafe_code)]
mod memory;
// Lends a mirror's bytes to the staging copy (`RegionBytes::with_bytes{,_mut}` are
// `unsafe`; the registration's lock keeps the borrows unique).
#[allow(unsafe_code)]
pub(crate) mod mirror;
mod stall;

pub use device::{Device, DeviceConfig, Gid};
pub use endpoint::{
    ConnectionInfo, Endpoint, EndpointBatchStatus, EndpointConfig, EndpointState, RdmaRead,
    RdmaWrite, RemoteRegion,
};
pub use error::{MirrorError, VerbsError, VerbsLinkError, WorkCompletionStatus};
pub use memory::{MemoryRegion, ProtectionDomain, WriteAccess};

use std::sync::atomic::{AtomicU64, Ordering};

/// Teardown errors that Drop could only log (see [`drop_errors`]).
static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

/// How many teardown steps failed inside a Drop since the process started.
///
/// Drop cannot return an error: it logs it with `tracing::error!`, counts it here and
/// (in debug builds) asserts. Use [`Endpoint::close`] for an orderly teardown that returns
/// its error instead.
pub fn drop_errors() -> u64 {
    DROP_ERRORS.load(Ordering::Relaxed)
}

/// Records a failed teardown step that happened inside Drop.
fn record_drop_error(what: &str, detail: &dyn std::fmt::Display) {
    DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
    tracing::error!(target: "kvlease_transport::verbs", "teardown: {what}: {detail}");
    if !std::thread::panicking() {
        debug_assert!(false, "verbs teardown failed: {what}: {detail}");
    }
}

/// Runs a `sideway` destructor that asserts on failure (its QP/CQ Drop impls do
/// `assert_eq!(ret, 0)`), turning a panic into a logged, counted error.
fn drop_guarded<T>(what: &str, value: T) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(value)))
    {
        let msg = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("non-string panic");
        record_drop_error(what, &msg);
    }
}

#[cfg(test)]
mod tests;
