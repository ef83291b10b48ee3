//! The handshake side channel of the vLLM connector: a TCP endpoint on which a P
//! engine's scheduler hands its engine info (transport metadata of every worker, KV
//! layout, TP size, instance) to a D that proves the cluster token, and proves it back.
//!
//! The wire format is `kvlease_proto::sidechannel`'s, the one the agents speak too (a
//! Python P serves an agent D and the reverse), and both halves of a connection are
//! `kvlease_transport::sidechannel`'s: the authenticated exchange of `kvlease_proto::auth`
//! (D proves the token under its engine id, P under its own, both nonces and names bound
//! into each proof; D checks P's proof before it sends anything else, so a peer without
//! the token learns nothing of D), then D's registration (empty from this client), then
//! P's welcome carrying the payload. This module keeps the listener and the PyO3 surface.
//!
//! Everything the server reads before a peer proved the token is bounded by the format
//! (auth messages of at most `kvlease_proto::auth::MAX_BODY` bytes); at most
//! `max_connections` handshakes run at once (one short-lived thread each) and each ends by
//! an absolute deadline from accept. The server listens on loopback unless told otherwise,
//! and refuses to listen beyond loopback without a token unless the caller opts out.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use kvlease_engine::{Cause, HandshakeError};
use kvlease_transport::acceptor::{Acceptor, Handler, Limits};
use kvlease_transport::deadline::Deadlined;
use kvlease_transport::sidechannel::{self as sc, Outcome, Registration};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::cores::cause;
use crate::errors::{Family, check_unauthenticated_listen, handshake, invalid};

/// Largest registration a server reads (from a D that proved the token): room for the
/// transport metadata of hundreds of TP workers.
const MAX_REGISTRATION: usize = 256 << 10;
/// Largest payload a client accepts.
const MAX_PAYLOAD: usize = 64 << 20;
/// Longest handshake or fetch timeout (a deadline past what `Instant` holds would panic).
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);
/// The engine id of a server or client whose caller names none.
const DEFAULT_ENGINE_ID: &str = "kvlease-python";

/// The client's half: fetch the payload of the server at `addr`.
fn fetch(
    addr: SocketAddr,
    engine_id: &str,
    token: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>, sc::Error> {
    // The whole exchange, connect included, ends by one deadline.
    let deadline = Instant::now() + timeout;
    let mut s = Deadlined::new(TcpStream::connect_timeout(&addr, timeout)?, deadline);
    s.get_ref().set_nodelay(true)?;
    let served = sc::fetch(
        &mut s,
        engine_id,
        token,
        None,
        &Registration::default(),
        MAX_PAYLOAD,
    )?;
    Ok(served.welcome.payload)
}

#[derive(Debug, Default)]
struct Counters {
    served: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    over_capacity: AtomicU64,
    evicted: AtomicU64,
}

struct Shared {
    engine_id: String,
    token: Option<Vec<u8>>,
    payload: Mutex<Arc<Vec<u8>>>,
    deadline: Duration,
    counters: Counters,
}

/// The server's half of one handshake.
fn serve(shared: &Shared, mut s: Deadlined) -> Result<(), sc::Error> {
    let outcome = sc::serve(
        &mut s,
        &shared.engine_id,
        shared.token.as_deref(),
        MAX_REGISTRATION,
        |_| {
            Ok(sc::Welcome {
                server_time_ns: SystemTime::UNIX_EPOCH
                    .elapsed()
                    .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
                payload: {
                    // Copied without the lock held.
                    let payload = Arc::clone(
                        &shared
                            .payload
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner),
                    );
                    payload.to_vec()
                },
            })
        },
    )?;
    let counter = match outcome {
        Outcome::Welcomed(_) => &shared.counters.served,
        Outcome::Refused { .. } | Outcome::Declined { .. } => &shared.counters.refused,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

impl Handler for Shared {
    fn serve(&self, s: TcpStream, _peer: SocketAddr, accepted: Instant) {
        // The whole handshake, not each read or write, ends by the deadline.
        if let Err(e) = serve(self, Deadlined::new(s, accepted + self.deadline)) {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "side channel: handshake failed");
        }
    }

    fn refuse(&self, s: &TcpStream, peer: SocketAddr) {
        self.counters.over_capacity.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%peer, "side channel: too many handshakes at once, none to evict; told to retry");
        // A fresh socket's buffer takes these few bytes at once.
        let _ = io::Write::write_all(
            &mut &*s,
            &kvlease_proto::sidechannel::refused(kvlease_proto::sidechannel::BUSY),
        );
    }

    fn evicted(&self) {
        self.counters.evicted.fetch_add(1, Ordering::Relaxed);
    }

    fn spawn_failed(&self, _peer: SocketAddr, _error: &io::Error) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The server half of the side channel: serves `payload` to every peer that proves
/// `token` (with no token, to every peer that sends none), on its own threads.
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct SideChannelServer {
    shared: Arc<Shared>,
    address: SocketAddr,
    acceptor: Mutex<Option<Acceptor>>,
}

#[pymethods]
impl SideChannelServer {
    /// Listens on `listen` (`"host:port"`, port 0: any free port; loopback by default)
    /// and serves `payload` as the engine `engine_id`. Without a token, a `listen` address
    /// beyond loopback is refused unless `allow_unauthenticated` says so. At most
    /// `max_connections` handshakes run at once, at most `max_connections_per_address`
    /// of them from one peer address (default a quarter of `max_connections`, at least 1).
    #[new]
    #[pyo3(signature = (payload, *, token = None, listen = "127.0.0.1:0", max_connections = 64, handshake_timeout = 10.0, engine_id = DEFAULT_ENGINE_ID, allow_unauthenticated = false, max_connections_per_address = None))]
    #[allow(clippy::too_many_arguments, reason = "Python keyword arguments")]
    fn new(
        py: Python<'_>,
        payload: Vec<u8>,
        token: Option<Vec<u8>>,
        listen: &str,
        max_connections: usize,
        handshake_timeout: f64,
        engine_id: &str,
        allow_unauthenticated: bool,
        max_connections_per_address: Option<usize>,
    ) -> PyResult<Self> {
        let max_connections = max_connections.max(1);
        let per_address = max_connections_per_address.unwrap_or(max_connections / 4);
        if per_address == 0 && max_connections_per_address.is_some() {
            return Err(invalid(
                py,
                "max_connections_per_address must be at least 1",
            ));
        }
        if per_address > max_connections {
            return Err(invalid(
                py,
                format!(
                    "max_connections_per_address ({per_address}) exceeds max_connections \
                     ({max_connections})"
                ),
            ));
        }
        let per_address = per_address.max(1);
        if token.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(py, "the cluster token must not be empty"));
        }
        kvlease_proto::auth::check_name(engine_id)
            .map_err(|e| invalid(py, format!("engine_id: {e}")))?;
        if payload.len() > MAX_PAYLOAD {
            return Err(invalid(py, "the payload exceeds 64 MiB"));
        }
        let addr: SocketAddr = listen
            .parse()
            .map_err(|e| invalid(py, format!("listen address {listen:?}: {e}")))?;
        check_unauthenticated_listen(
            py,
            addr,
            token.is_some(),
            allow_unauthenticated,
            "the payload",
        )?;
        let deadline = Duration::try_from_secs_f64(handshake_timeout)
            .ok()
            .filter(|d| !d.is_zero() && *d <= MAX_TIMEOUT)
            .ok_or_else(|| invalid(py, "handshake_timeout must be positive, at most a day"))?;
        let shared = Arc::new(Shared {
            engine_id: engine_id.to_owned(),
            token,
            payload: Mutex::new(Arc::new(payload)),
            deadline,
            counters: Counters::default(),
        });
        // A newcomer takes the slot of the oldest handshake of its own address (over its
        // share) or of the address holding the most, so that a few addresses cannot keep
        // others out.
        let limits = Limits {
            max_connections,
            max_per_address: per_address,
            evict: true,
        };
        let handler: Arc<dyn Handler> = Arc::clone(&shared) as Arc<dyn Handler>;
        let acceptor = Acceptor::bind(addr, "kvlease-sc", limits, handler)
            .map_err(|e| serve_error(py, format!("binding {addr}: {e}")))?;
        let address = acceptor.local_addr();
        Ok(Self {
            shared,
            address,
            acceptor: Mutex::new(Some(acceptor)),
        })
    }

    /// The bound port.
    #[getter]
    fn port(&self) -> u16 {
        self.address.port()
    }

    /// The bound address, `"host:port"`.
    #[getter]
    fn address(&self) -> String {
        self.address.to_string()
    }

    /// Replaces the payload served from now on.
    fn set_payload(&self, py: Python<'_>, payload: Vec<u8>) -> PyResult<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(invalid(py, "the payload exceeds 64 MiB"));
        }
        *self
            .shared
            .payload
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(payload);
        Ok(())
    }

    /// Counters: `served`, `refused` (wrong or missing token), `failed` (broken or slow
    /// peers, and those cut off to make room), `over_capacity` (told to retry: no
    /// handshake could be cut off), `evicted` (cut off to make room for a newcomer).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.shared.counters;
        let d = PyDict::new(py);
        d.set_item("served", c.served.load(Ordering::Relaxed))?;
        d.set_item("refused", c.refused.load(Ordering::Relaxed))?;
        d.set_item("failed", c.failed.load(Ordering::Relaxed))?;
        d.set_item("over_capacity", c.over_capacity.load(Ordering::Relaxed))?;
        d.set_item("evicted", c.evicted.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// Stops accepting (idempotent); handshakes under way finish by their deadline.
    fn close(&self, py: Python<'_>) {
        let acceptor = self
            .acceptor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut acceptor) = acceptor {
            py.detach(move || acceptor.shutdown());
        }
    }

    fn __repr__(&self) -> String {
        format!("SideChannelServer(address={:?})", self.address.to_string())
    }
}

/// Fetches the payload of the side channel at `host:port` as the engine `engine_id`,
/// proving `token` (and checking the server proves it too). Releases the GIL. Raises
/// `AuthError` for a token mismatch and `SideChannelError` otherwise.
#[pyfunction]
#[pyo3(signature = (host, port, *, token = None, timeout = 5.0, engine_id = DEFAULT_ENGINE_ID))]
pub(crate) fn side_channel_fetch<'py>(
    py: Python<'py>,
    host: &str,
    port: u16,
    token: Option<Vec<u8>>,
    timeout: f64,
    engine_id: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    kvlease_proto::auth::check_name(engine_id)
        .map_err(|e| invalid(py, format!("engine_id: {e}")))?;
    let timeout = Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|d| !d.is_zero() && *d <= MAX_TIMEOUT)
        .ok_or_else(|| invalid(py, "timeout must be positive, at most a day"))?;
    // Name resolution may block too: it runs without the GIL, with the fetch.
    let (addr, result) = py
        .detach(|| {
            let addr = (host, port)
                .to_socket_addrs()
                .map_err(|e| format!("resolving {host}:{port}: {e}"))?
                .next()
                .ok_or_else(|| format!("{host}:{port} resolves to nothing"))?;
            Ok((addr, fetch(addr, engine_id, token.as_deref(), timeout)))
        })
        .map_err(|message: String| {
            let e = HandshakeError::NotFound(cause(message.clone()));
            handshake::to_py_as(py, &e, Family::SideChannel, message)
        })?;
    match result {
        Ok(payload) => Ok(PyBytes::new(py, &payload)),
        Err(e) => {
            let message = format!("side channel {addr}: {}", crate::errors::chain(&e));
            let e = fetch_failure(&e)(cause(message.clone()));
            Err(handshake::to_py_as(py, &e, Family::SideChannel, message))
        }
    }
}

/// `SideChannelError` for a server that cannot serve (kind `other`).
fn serve_error(py: Python<'_>, message: String) -> PyErr {
    let e = HandshakeError::Other(cause(message.clone()));
    handshake::to_py_as(py, &e, Family::SideChannel, message)
}

/// The engine's kind of a failed fetch, as the agents tell them apart: the token failed
/// (`Auth`); P was there but busy, or the connection broke after it was accepted
/// (`Connect`: a retry may succeed); else nothing answered as P (`NotFound`).
fn fetch_failure(e: &sc::Error) -> fn(Cause) -> HandshakeError {
    match e {
        e if e.is_auth() => HandshakeError::Auth,
        sc::Error::Protocol(p) if p.is_busy() => HandshakeError::Connect,
        sc::Error::Io(io) if io.kind() != io::ErrorKind::ConnectionRefused => {
            HandshakeError::Connect
        }
        _ => HandshakeError::NotFound,
    }
}
