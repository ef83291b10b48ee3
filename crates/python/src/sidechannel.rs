//! The handshake side channel of the vLLM connector: a TCP endpoint on which a P
//! engine's scheduler hands its engine info (transport metadata of every worker, KV
//! layout, TP size, instance) to a D that proves the cluster token, and proves it back.
//!
//! Frames are a 4-byte big-endian length and a body.
//!
//! 1. D → P: `MAGIC` ‖ D's 32-byte nonce.
//! 2. P → D: P's 32-byte nonce ‖ P's proof (empty without a token):
//!    `HMAC-SHA256(token, "kvlease-sc/p" ‖ D's nonce ‖ P's nonce)`. D checks it before
//!    it sends anything else, so a peer without the token learns nothing of D.
//! 3. D → P: D's proof `HMAC-SHA256(token, "kvlease-sc/d" ‖ P's nonce ‖ D's nonce)`.
//! 4. P → D: `0` ‖ the payload, or `1` ‖ why P refused D's proof.
//!
//! Everything the server reads comes from a peer that has not proven the token yet: at
//! most `max_connections` handshakes run at once (one short-lived thread each), each
//! ends by an absolute deadline from accept, and frames before the payload are at most
//! [`MAX_PREAUTH_FRAME`] bytes.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use kvlease_transport::deadline::Deadlined;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use sha2::Sha256;

use crate::errors::{Family, invalid, raise};

const MAGIC: &[u8; 6] = b"KVLSC1";
const NONCE: usize = 32;
/// Largest frame read before the peer proved the token.
const MAX_PREAUTH_FRAME: usize = 1024;
/// Largest payload a client accepts.
const MAX_PAYLOAD: usize = 64 << 20;
/// Longest handshake or fetch timeout (a deadline past what `Instant` holds would panic).
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);
/// How often the accept loop checks for `close()`.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

type HmacSha256 = Hmac<Sha256>;

/// Why a side-channel exchange failed.
#[derive(Debug, thiserror::Error)]
enum SideChannelError {
    #[error("side channel IO failed")]
    Io(#[from] io::Error),
    #[error("the peer broke the side-channel protocol: {0}")]
    Protocol(&'static str),
    #[error("the server did not prove the cluster token")]
    ServerAuth,
    #[error("the server refused our proof: {0}")]
    TokenRefused(String),
    #[error("random source failed: {0}")]
    Random(getrandom::Error),
}

impl SideChannelError {
    fn is_auth(&self) -> bool {
        matches!(self, Self::ServerAuth | Self::TokenRefused(_))
    }
}

fn proof(token: &[u8], label: &[u8], first: &[u8], second: &[u8]) -> Vec<u8> {
    // HMAC accepts keys of any length.
    let Ok(mut mac) = HmacSha256::new_from_slice(token) else {
        return Vec::new();
    };
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.finalize().into_bytes().to_vec()
}

fn verify(token: &[u8], label: &[u8], first: &[u8], second: &[u8], got: &[u8]) -> bool {
    let Ok(mut mac) = HmacSha256::new_from_slice(token) else {
        return false;
    };
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.verify_slice(got).is_ok()
}

fn write_frame(s: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(body.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(body);
    s.write_all(&buf)
}

fn read_frame(s: &mut impl Read, max: usize) -> Result<Vec<u8>, SideChannelError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(SideChannelError::Protocol("frame too long"));
    }
    // Grows with the bytes that arrive: announcing a large length costs the peer as much.
    let mut body = Vec::new();
    s.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(SideChannelError::Protocol("frame cut short"));
    }
    Ok(body)
}

fn nonce() -> Result<[u8; NONCE], SideChannelError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(SideChannelError::Random)?;
    Ok(n)
}

/// The client's half: fetch the payload of the server at `addr`.
fn fetch(
    addr: SocketAddr,
    token: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>, SideChannelError> {
    // The whole exchange, connect included, ends by one deadline.
    let deadline = Instant::now() + timeout;
    let mut s = Deadlined::new(TcpStream::connect_timeout(&addr, timeout)?, deadline);
    s.get_ref().set_nodelay(true)?;
    let mine = nonce()?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&mine);
    write_frame(&mut s, &hello)?;
    let challenge = read_frame(&mut s, MAX_PREAUTH_FRAME)?;
    if challenge.len() < NONCE {
        return Err(SideChannelError::Protocol("short challenge"));
    }
    let (theirs, their_proof) = challenge.split_at(NONCE);
    let my_proof = match token {
        Some(token) => {
            if !verify(token, b"kvlease-sc/p", &mine, theirs, their_proof) {
                return Err(SideChannelError::ServerAuth);
            }
            proof(token, b"kvlease-sc/d", theirs, &mine)
        }
        None => Vec::new(),
    };
    write_frame(&mut s, &my_proof)?;
    let answer = read_frame(&mut s, MAX_PAYLOAD + 1)?;
    match answer.split_first() {
        Some((0, payload)) => Ok(payload.to_vec()),
        Some((_, message)) => Err(SideChannelError::TokenRefused(
            String::from_utf8_lossy(message).into_owned(),
        )),
        None => Err(SideChannelError::Protocol("empty answer")),
    }
}

#[derive(Debug, Default)]
struct Counters {
    served: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    over_capacity: AtomicU64,
}

struct Shared {
    token: Option<Vec<u8>>,
    payload: Mutex<Arc<Vec<u8>>>,
    stop: AtomicBool,
    active: AtomicUsize,
    max_connections: usize,
    deadline: Duration,
    counters: Counters,
}

/// The server's half of one handshake.
fn serve(shared: &Shared, mut s: Deadlined) -> Result<(), SideChannelError> {
    let hello = read_frame(&mut s, MAX_PREAUTH_FRAME)?;
    let Some(theirs) = hello.strip_prefix(MAGIC.as_slice()) else {
        return Err(SideChannelError::Protocol("bad magic"));
    };
    if theirs.len() != NONCE {
        return Err(SideChannelError::Protocol("bad nonce"));
    }
    let mine = nonce()?;
    let mut challenge = mine.to_vec();
    if let Some(token) = &shared.token {
        challenge.extend_from_slice(&proof(token, b"kvlease-sc/p", theirs, &mine));
    }
    write_frame(&mut s, &challenge)?;
    let their_proof = read_frame(&mut s, MAX_PREAUTH_FRAME)?;
    let refusal = match &shared.token {
        Some(_) if their_proof.is_empty() => Some("this engine requires the cluster token"),
        Some(token) if !verify(token, b"kvlease-sc/d", &mine, theirs, &their_proof) => {
            Some("wrong cluster token")
        }
        None if !their_proof.is_empty() => {
            Some("this engine has no cluster token but the peer sent a proof of one")
        }
        _ => None,
    };
    if let Some(message) = refusal {
        shared.counters.refused.fetch_add(1, Ordering::Relaxed);
        let mut answer = vec![1u8];
        answer.extend_from_slice(message.as_bytes());
        write_frame(&mut s, &answer)?;
        return Ok(());
    }
    let payload = Arc::clone(
        &shared
            .payload
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    let mut answer = Vec::with_capacity(1 + payload.len());
    answer.push(0);
    answer.extend_from_slice(&payload);
    write_frame(&mut s, &answer)?;
    shared.counters.served.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.stop.load(Ordering::Acquire) {
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "side channel: accept failed");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        if shared.active.fetch_add(1, Ordering::AcqRel) >= shared.max_connections {
            shared.active.fetch_sub(1, Ordering::AcqRel);
            shared
                .counters
                .over_capacity
                .fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let conn = Arc::clone(shared);
        let accepted = Instant::now();
        let spawned = std::thread::Builder::new()
            .name("kvlease-sc".into())
            .spawn(move || {
                let result = (|| {
                    s.set_nonblocking(false)?;
                    // The whole handshake, not each read or write, ends by the deadline.
                    serve(&conn, Deadlined::new(s, accepted + conn.deadline))
                })();
                if let Err(e) = result {
                    conn.counters.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "side channel: handshake failed");
                }
                conn.active.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            shared.active.fetch_sub(1, Ordering::AcqRel);
            shared.counters.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The server half of the side channel: serves `payload` to every peer that proves
/// `token` (with no token, to every peer that sends none), on its own threads.
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct SideChannelServer {
    shared: Arc<Shared>,
    address: SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[pymethods]
impl SideChannelServer {
    /// Listens on `listen` (`"host:port"`, port 0: any free port) and serves `payload`.
    #[new]
    #[pyo3(signature = (payload, *, token = None, listen = "0.0.0.0:0", max_connections = 64, handshake_timeout = 10.0))]
    fn new(
        py: Python<'_>,
        payload: Vec<u8>,
        token: Option<Vec<u8>>,
        listen: &str,
        max_connections: usize,
        handshake_timeout: f64,
    ) -> PyResult<Self> {
        if token.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(py, "the cluster token must not be empty"));
        }
        if payload.len() > MAX_PAYLOAD {
            return Err(invalid(py, "the payload exceeds 64 MiB"));
        }
        let addr: SocketAddr = listen
            .parse()
            .map_err(|e| invalid(py, format!("listen address {listen:?}: {e}")))?;
        let deadline = Duration::try_from_secs_f64(handshake_timeout)
            .ok()
            .filter(|d| !d.is_zero() && *d <= MAX_TIMEOUT)
            .ok_or_else(|| invalid(py, "handshake_timeout must be positive, at most a day"))?;
        let listener = TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| raise(py, Family::SideChannel, format!("binding {addr}: {e}")))?;
        let address = listener
            .local_addr()
            .map_err(|e| raise(py, Family::SideChannel, format!("binding {addr}: {e}")))?;
        let shared = Arc::new(Shared {
            token,
            payload: Mutex::new(Arc::new(payload)),
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            max_connections: max_connections.max(1),
            deadline,
            counters: Counters::default(),
        });
        let looped = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kvlease-sc-accept".into())
            .spawn(move || accept_loop(&looped, &listener))
            .map_err(|e| {
                raise(
                    py,
                    Family::SideChannel,
                    format!("starting the listener: {e}"),
                )
            })?;
        Ok(Self {
            shared,
            address,
            thread: Mutex::new(Some(thread)),
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
    /// peers), `over_capacity`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.shared.counters;
        let d = PyDict::new(py);
        d.set_item("served", c.served.load(Ordering::Relaxed))?;
        d.set_item("refused", c.refused.load(Ordering::Relaxed))?;
        d.set_item("failed", c.failed.load(Ordering::Relaxed))?;
        d.set_item("over_capacity", c.over_capacity.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// Stops accepting (idempotent); handshakes under way finish by their deadline.
    fn close(&self, py: Python<'_>) {
        self.shared.stop.store(true, Ordering::Release);
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            py.detach(move || {
                if t.join().is_err() {
                    tracing::error!("side channel listener thread panicked");
                }
            });
        }
    }

    fn __repr__(&self) -> String {
        format!("SideChannelServer(address={:?})", self.address.to_string())
    }
}

impl Drop for SideChannelServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
    }
}

/// Fetches the payload of the side channel at `host:port`, proving `token` (and
/// checking the server proves it too). Releases the GIL. Raises `AuthError` for a token
/// mismatch and `SideChannelError` otherwise.
#[pyfunction]
#[pyo3(signature = (host, port, *, token = None, timeout = 5.0))]
pub(crate) fn side_channel_fetch<'py>(
    py: Python<'py>,
    host: &str,
    port: u16,
    token: Option<Vec<u8>>,
    timeout: f64,
) -> PyResult<Bound<'py, PyBytes>> {
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
            Ok((addr, fetch(addr, token.as_deref(), timeout)))
        })
        .map_err(|message: String| raise(py, Family::SideChannel, message))?;
    match result {
        Ok(payload) => Ok(PyBytes::new(py, &payload)),
        Err(e) if e.is_auth() => Err(raise(
            py,
            Family::Auth,
            format!("side channel {addr}: {}", crate::errors::chain(&e)),
        )),
        Err(e) => Err(raise(
            py,
            Family::SideChannel,
            format!("side channel {addr}: {}", crate::errors::chain(&e)),
        )),
    }
}
