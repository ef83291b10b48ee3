//! Clock probes for bidirectional mode: the holder of a turn serves its wall clock
//! ([`ClockProbeServer`]), the next turn's reader measures the offset to it
//! ([`probe_clock`] → [`ClockOffset`]) and reads the hold's deadline on its own clock
//! (`KvTransferParams.plan_pull(..., clock_offset=...)`). The frames are
//! `kvlease_proto::clock`'s, the sockets `kvlease_transport::clock_probe`'s, the
//! estimate `kvlease_lease::ClockOffsetEstimator`'s (lowest round trip).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{SystemTime, UNIX_EPOCH};

use kvlease_lease::{ClockOffsetEstimator, Timestamp};
use kvlease_transport::clock_probe::{self, ProbeHandle};
use pyo3::prelude::*;

use crate::errors::{Family, invalid, raise};

/// The most probes one call sends.
const MAX_SAMPLES: u32 = 64;
/// The most an injected test skew may be, in milliseconds (a day).
const MAX_TEST_SKEW_MS: i64 = 86_400_000;

/// Wall-clock nanoseconds since the Unix epoch (Python's `time.time_ns()`), shifted by
/// `skew_ms`, saturating at 0 and `u64::MAX`.
pub(crate) fn wall_ns(skew_ms: i64) -> u64 {
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let wall = i128::try_from(wall).unwrap_or(i128::MAX);
    let ns = wall.saturating_add(i128::from(skew_ms) * 1_000_000);
    u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
}

/// Answers clock probes with this host's wall clock (`time.time_ns()`, the clock a turn's
/// `kvlease_deadline_ns` is on) on `listen` (`host:port`, port 0 for any), from a
/// background thread, until `close()` or garbage collection. It reveals only the time, so
/// it takes no token. `test_skew_ms` shifts the clock it reports (tests only).
#[pyclass(module = "kvlease._kvlease")]
pub(crate) struct ClockProbeServer {
    handle: Option<ProbeHandle>,
    addr: SocketAddr,
}

#[pymethods]
impl ClockProbeServer {
    #[new]
    #[pyo3(signature = (listen, *, test_skew_ms = 0))]
    fn new(py: Python<'_>, listen: &str, test_skew_ms: i64) -> PyResult<Self> {
        if test_skew_ms.abs() > MAX_TEST_SKEW_MS {
            return Err(invalid(py, "test_skew_ms must be within a day"));
        }
        let addr = listen
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| invalid(py, format!("listen: {listen:?} is not host:port")))?;
        let handle = clock_probe::ClockProbeServer::new(move || wall_ns(test_skew_ms))
            .spawn(addr)
            .map_err(|e| raise(py, Family::Connect, format!("clock probe on {addr}: {e}")))?;
        Ok(Self {
            addr: handle.addr,
            handle: Some(handle),
        })
    }

    /// The bound port.
    #[getter]
    fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The bound address, `host:port`.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Stops accepting probes.
    fn close(&mut self) {
        self.handle = None;
    }

    fn __repr__(&self) -> String {
        format!(
            "ClockProbeServer({}{})",
            self.addr,
            if self.handle.is_some() {
                ""
            } else {
                ", closed"
            }
        )
    }
}

/// A peer's clock relative to this host's wall clock: `offset_ns` = peer − local, within
/// ± `rtt_ns` / 2 (the round trip of the best sample).
#[pyclass(module = "kvlease._kvlease", frozen, from_py_object)]
#[derive(Clone, Copy)]
pub(crate) struct ClockOffset(pub(crate) kvlease_lease::ClockOffset);

#[pymethods]
impl ClockOffset {
    /// Peer minus local, in nanoseconds.
    #[getter]
    fn offset_ns(&self) -> i128 {
        self.0.peer_minus_local_nanos()
    }

    /// The round trip of the sample it came from, in nanoseconds.
    #[getter]
    fn rtt_ns(&self) -> u128 {
        self.0.rtt().as_nanos()
    }

    fn __repr__(&self) -> String {
        format!(
            "ClockOffset(offset_ns={}, rtt_ns={})",
            self.0.peer_minus_local_nanos(),
            self.0.rtt().as_nanos()
        )
    }
}

/// Probes the clock at `host:port` `samples` times on one connection (at most 64, 2 s per
/// socket operation) and returns the offset of the lowest round trip. Releases the GIL.
/// Raises `ConnectError` when the server cannot be reached or answers something else.
#[pyfunction]
#[pyo3(signature = (host, port, *, samples = 8))]
pub(crate) fn probe_clock(
    py: Python<'_>,
    host: &str,
    port: u16,
    samples: u32,
) -> PyResult<ClockOffset> {
    if samples == 0 || samples > MAX_SAMPLES {
        return Err(invalid(py, format!("samples must be 1..={MAX_SAMPLES}")));
    }
    let result = py.detach(|| {
        let addr = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("resolving {host}:{port}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host}:{port} resolves to nothing"))?;
        let mut est = ClockOffsetEstimator::new();
        let local = || Timestamp::from_nanos(wall_ns(0));
        clock_probe::probe_clock(addr, samples, &local, &mut est)
            .map_err(|e| format!("clock probe {addr}: {e}"))?;
        est.offset()
            .ok_or_else(|| format!("clock probe {addr}: no usable sample"))
    });
    result
        .map(ClockOffset)
        .map_err(|message| raise(py, Family::Connect, message))
}
