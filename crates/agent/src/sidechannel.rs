//! The handshake side channel (like vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`): a TCP endpoint on
//! which P hands its transport metadata and KV layout to a D that proves the cluster token.
//!
//! Frames are a 4-byte big-endian length and a JSON body (at most [`MAX_FRAME`] bytes).
//!
//! 1. D → P `Hello { engine_id, nonce }`: D's engine id and a fresh 32-byte nonce.
//! 2. P → D `Challenge { nonce, proof }`: P's nonce and, with a token, P's proof
//!    `HMAC-SHA256(token, "kvlease-sc-p" ‖ D's nonce)` (D checks P too).
//! 3. D → P `Proof { proof, workers }`: `HMAC-SHA256(token, "kvlease-sc-d" ‖ P's nonce ‖
//!    engine_id)` and, only now that P proved the token, the transport metadata of each D
//!    worker (so P can reach D with expiry notices): D names nothing of its regions to a
//!    peer that has not proven the token.
//! 4. P → D `Welcome { info, server_time_ns }` or `Refused { message }`.
//!
//! Without a token both proofs are empty and only a peer with a token set is refused (a
//! mismatch of configuration, named in the message). Every socket has read and write
//! timeouts; the server runs one short-lived thread per connection.
//!
//! Everything the server reads comes from a peer that has not proven the token yet, so
//! the server is bounded by [`ServerLimits`]: at most `max_connections` handshakes (and
//! threads) at once, more are closed at once; each whole handshake ends by an absolute
//! deadline from accept; and no frame over `max_frame` is accepted. A frame's buffer
//! grows with the bytes that actually arrive, so announcing a large length costs the
//! peer as much as it costs us.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kvlease_transport::deadline::Deadlined;
use prometheus_client::metrics::counter::Counter;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Largest frame D accepts from a P that proved the token (the welcome, with P's info).
pub const MAX_FRAME: usize = 4 << 20;
/// Largest frame D accepts before P has proven the token (the challenge).
const MAX_CHALLENGE_FRAME: usize = 4 << 10;
/// Read/write timeout of every socket D opens to a side channel.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Default for [`ServerLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default for [`ServerLimits::handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default for [`ServerLimits::max_frame`]: room for the hello of hundreds of TP workers.
pub const DEFAULT_MAX_PREAUTH_FRAME: usize = 256 << 10;

/// What a side-channel server spends on peers, none of which has proven the token while
/// it is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Handshakes served at once, each on its own thread; a connection over the cap is
    /// closed at once and counted. Default [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
    /// A whole handshake, from accept to the welcome, must end within this; reads and
    /// writes get only the time left. Default [`DEFAULT_HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: Duration,
    /// Largest frame read from a peer (hello, proof); a longer announced length closes
    /// the connection before anything is allocated for it. Default
    /// [`DEFAULT_MAX_PREAUTH_FRAME`].
    pub max_frame: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_frame: DEFAULT_MAX_PREAUTH_FRAME,
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed or timed out.
    #[error("side channel {addr}: {source}")]
    Io {
        /// The peer.
        addr: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The peer sent something that is not the protocol.
    #[error("side channel {addr}: protocol error: {message}")]
    Protocol {
        /// The peer.
        addr: String,
        /// What was wrong.
        message: String,
    },
    /// The peer refused us (wrong token) or failed to prove the token.
    #[error("side channel {addr}: authentication failed: {message}")]
    Auth {
        /// The peer.
        addr: String,
        /// Why.
        message: String,
    },
}

/// What a D sends first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// D's engine id.
    pub engine_id: String,
    /// D's TP size.
    pub tp_size: u32,
    /// Hex nonce.
    pub nonce: String,
    /// Hex transport metadata of each D worker, by rank. Sent in the proof frame, after P
    /// proved the token (empty in the hello on the wire).
    #[serde(default)]
    pub workers: Vec<String>,
    /// D's instance (its start time in microseconds): a restarted D under the same engine
    /// id has a larger one, and P replaces its connections to the old one. 0 when unsaid.
    #[serde(default)]
    pub instance: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Frame {
    Hello(Hello),
    Challenge {
        nonce: String,
        proof: String,
    },
    Proof {
        proof: String,
        #[serde(default)]
        workers: Vec<String>,
    },
    Welcome {
        info: serde_json::Value,
        server_time_ns: u64,
    },
    Refused {
        message: String,
    },
}

type HmacSha256 = Hmac<Sha256>;

fn mac(token: &str, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // Invariant: HMAC accepts keys of any length.
    #[allow(clippy::expect_used)]
    let mut m = HmacSha256::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn prove(token: Option<&str>, label: &[u8], parts: &[&[u8]]) -> String {
    token.map_or_else(String::new, |t| {
        to_hex(&mac(t, label, parts).finalize().into_bytes())
    })
}

fn verify(token: Option<&str>, label: &[u8], parts: &[&[u8]], proof: &str) -> bool {
    match token {
        None => proof.is_empty(),
        Some(t) => from_hex(proof).is_some_and(|p| mac(t, label, parts).verify_slice(&p).is_ok()),
    }
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of a hex string, `None` if it is not hex.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

fn nonce() -> io::Result<[u8; 32]> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(n)
}

fn write_frame(s: &mut impl Write, f: &Frame) -> io::Result<()> {
    let body = serde_json::to_vec(f).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    s.write_all(&len.to_be_bytes())?;
    s.write_all(&body)?;
    s.flush()
}

/// Why a frame was not read.
#[derive(Debug, thiserror::Error)]
#[error("frame of {len} bytes exceeds the limit of {max}")]
struct FrameTooLarge {
    len: usize,
    max: usize,
}

/// Reads one frame of at most `max` bytes. The buffer grows with the bytes received, never
/// to an announced length up front.
fn read_frame(s: &mut impl Read, max: usize) -> io::Result<Frame> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            FrameTooLarge { len, max },
        ));
    }
    let mut body = Vec::with_capacity(len.min(4096));
    s.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Holds one of the server's connection slots; frees it when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(Arc::clone(active)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What P's side channel serves, and what it does with a D that proved the token.
pub struct Server {
    /// The info every authenticated D receives.
    pub info: serde_json::Value,
    /// The cluster token, if any.
    pub token: Option<String>,
    /// Called with each authenticated D's hello.
    pub on_peer: Box<dyn Fn(Hello) + Send + Sync>,
    /// This host's wall clock, in ns (for D's clock offset estimate).
    pub clock_ns: Box<dyn Fn() -> u64 + Send + Sync>,
    /// What peers may make the server spend.
    pub limits: ServerLimits,
    /// Counts connections closed unserved because `limits.max_connections` handshakes
    /// were running.
    pub refused: Counter,
}

/// A running side channel; stops accepting when dropped.
#[derive(Debug)]
pub struct ServerHandle {
    /// The bound address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop; failure means it is already gone.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

impl Server {
    /// Binds `addr` and serves handshakes on a background thread.
    ///
    /// # Errors
    /// The bind error; `InvalidInput` for a limit of zero.
    pub fn spawn(self, addr: SocketAddr) -> io::Result<ServerHandle> {
        let l = &self.limits;
        if l.max_connections == 0 || l.handshake_timeout.is_zero() || l.max_frame == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "side-channel limits must be non-zero",
            ));
        }
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let this = Arc::new(self);
        let stop2 = Arc::clone(&stop);
        let active = Arc::new(AtomicUsize::new(0));
        thread::Builder::new()
            .name("side-channel".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else {
                        // Out of descriptors and similar: back off instead of spinning.
                        thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let accepted = Instant::now();
                    let Some(slot) = Slot::take(&active, this.limits.max_connections) else {
                        this.refused.inc();
                        tracing::debug!(
                            peer = ?conn.peer_addr().ok(),
                            limit = this.limits.max_connections,
                            "side channel: too many handshakes at once; connection closed"
                        );
                        continue;
                    };
                    let this = Arc::clone(&this);
                    let spawned = thread::Builder::new()
                        .name("side-channel-conn".into())
                        .spawn(move || {
                            let _slot = slot;
                            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                            let s = Deadlined::new(conn, accepted + this.limits.handshake_timeout);
                            if let Err(e) = this.serve(s) {
                                tracing::warn!(%peer, error = %e, "side-channel handshake failed");
                            }
                        });
                    if let Err(e) = spawned {
                        tracing::error!(error = %e, "cannot spawn side-channel thread");
                    }
                }
            })?;
        Ok(ServerHandle { addr, stop })
    }

    fn serve(&self, mut s: Deadlined) -> io::Result<()> {
        s.get_ref().set_nodelay(true)?;
        let max = self.limits.max_frame;
        let Frame::Hello(hello) = read_frame(&mut s, max)? else {
            return write_frame(
                &mut s,
                &Frame::Refused {
                    message: "expected hello".into(),
                },
            );
        };
        let d_nonce = from_hex(&hello.nonce).unwrap_or_default();
        let p_nonce = nonce()?;
        let token = self.token.as_deref();
        write_frame(
            &mut s,
            &Frame::Challenge {
                nonce: to_hex(&p_nonce),
                proof: prove(token, b"kvlease-sc-p", &[&d_nonce]),
            },
        )?;
        // D checks our proof first: a D with another cluster token hangs up here.
        let answer = read_frame(&mut s, max).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "engine {} closed the handshake after our challenge: it refused our \
                         proof (a different cluster token on the two sides?)",
                        hello.engine_id
                    ),
                )
            } else {
                e
            }
        })?;
        let Frame::Proof { proof, workers } = answer else {
            return write_frame(
                &mut s,
                &Frame::Refused {
                    message: "expected proof".into(),
                },
            );
        };
        if !verify(
            token,
            b"kvlease-sc-d",
            &[&p_nonce, hello.engine_id.as_bytes()],
            &proof,
        ) {
            let message = if token.is_some() {
                "wrong or missing cluster token"
            } else {
                "this engine has no cluster token configured but the peer sent a proof"
            };
            tracing::warn!(engine = %hello.engine_id, message, "side-channel peer refused");
            return write_frame(
                &mut s,
                &Frame::Refused {
                    message: message.into(),
                },
            );
        }
        // Hand the peer over before answering, so that when D holds its welcome, P
        // already knows it (and can send it expiry notices).
        let mut hello = hello;
        hello.workers = workers;
        (self.on_peer)(hello);
        write_frame(
            &mut s,
            &Frame::Welcome {
                info: self.info.clone(),
                server_time_ns: (self.clock_ns)(),
            },
        )
    }
}

/// What a successful handshake returns to D.
#[derive(Debug, Clone)]
pub struct Welcome {
    /// P's info.
    pub info: serde_json::Value,
    /// P's wall clock at the answer, in ns.
    pub server_time_ns: u64,
}

/// Runs the handshake against P's side channel at `addr` (D side).
///
/// # Errors
/// [`HandshakeError`]: IO or timeout, a protocol violation, or failed authentication
/// either way.
pub fn handshake(
    addr: &str,
    token: Option<&str>,
    engine_id: &str,
    tp_size: u32,
    workers: &[Vec<u8>],
    instance: u64,
) -> Result<Welcome, HandshakeError> {
    let io_err = |source| HandshakeError::Io {
        addr: addr.to_owned(),
        source,
    };
    let proto = |message: &str| HandshakeError::Protocol {
        addr: addr.to_owned(),
        message: message.to_owned(),
    };
    let sock: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(io_err)?
        .next()
        .ok_or_else(|| proto("address resolves to nothing"))?;
    let mut s = TcpStream::connect_timeout(&sock, IO_TIMEOUT).map_err(io_err)?;
    s.set_read_timeout(Some(IO_TIMEOUT)).map_err(io_err)?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(io_err)?;
    s.set_nodelay(true).map_err(io_err)?;
    let d_nonce = nonce().map_err(io_err)?;
    let hello = Hello {
        engine_id: engine_id.to_owned(),
        tp_size,
        nonce: to_hex(&d_nonce),
        // Named only in the proof, once P proved the token.
        workers: Vec::new(),
        instance,
    };
    write_frame(&mut s, &Frame::Hello(hello)).map_err(io_err)?;
    let (p_nonce, p_proof) = match read_frame(&mut s, MAX_CHALLENGE_FRAME).map_err(io_err)? {
        Frame::Challenge { nonce, proof } => {
            (from_hex(&nonce).ok_or_else(|| proto("bad nonce"))?, proof)
        }
        Frame::Refused { message } => {
            return Err(HandshakeError::Auth {
                addr: addr.to_owned(),
                message,
            });
        }
        _ => return Err(proto("expected challenge")),
    };
    if !verify(token, b"kvlease-sc-p", &[&d_nonce], &p_proof) {
        return Err(HandshakeError::Auth {
            addr: addr.to_owned(),
            message: "the prefill engine did not prove the cluster token".into(),
        });
    }
    let proof = prove(token, b"kvlease-sc-d", &[&p_nonce, engine_id.as_bytes()]);
    let workers = workers.iter().map(|w| to_hex(w)).collect();
    write_frame(&mut s, &Frame::Proof { proof, workers }).map_err(io_err)?;
    match read_frame(&mut s, MAX_FRAME).map_err(io_err)? {
        Frame::Welcome {
            info,
            server_time_ns,
        } => Ok(Welcome {
            info,
            server_time_ns,
        }),
        Frame::Refused { message } => Err(HandshakeError::Auth {
            addr: addr.to_owned(),
            message,
        }),
        _ => Err(proto("expected welcome")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn serve(token: Option<&str>) -> (ServerHandle, Arc<Mutex<Vec<Hello>>>) {
        serve_with(token, ServerLimits::default(), Counter::default())
    }

    fn serve_with(
        token: Option<&str>,
        limits: ServerLimits,
        refused: Counter,
    ) -> (ServerHandle, Arc<Mutex<Vec<Hello>>>) {
        let peers = Arc::new(Mutex::new(Vec::new()));
        let p2 = Arc::clone(&peers);
        let h = Server {
            info: serde_json::json!({"engine_id": "p0", "tp_size": 2}),
            token: token.map(str::to_owned),
            on_peer: Box::new(move |hello| {
                if let Ok(mut v) = p2.lock() {
                    v.push(hello);
                }
            }),
            clock_ns: Box::new(|| 42),
            limits,
            refused,
        }
        .spawn("127.0.0.1:0".parse().expect("literal address"))
        .expect("bind loopback");
        (h, peers)
    }

    /// D names its workers (its transport metadata, its regions) only after P proved
    /// the token: a peer posing as P sees a hello without them.
    #[test]
    fn d_names_its_workers_only_after_p_proved_the_token() {
        let fake_p = TcpListener::bind("127.0.0.1:0").expect("loopback");
        let addr = fake_p.local_addr().expect("bound").to_string();
        let seen = thread::spawn(move || {
            let (mut s, _) = fake_p.accept().expect("D connects");
            let hello = read_frame(&mut s, MAX_FRAME).expect("a frame");
            // A challenge with a proof made without the token.
            write_frame(
                &mut s,
                &Frame::Challenge {
                    nonce: to_hex(&[7; 32]),
                    proof: to_hex(&[0; 32]),
                },
            )
            .expect("write");
            let next = read_frame(&mut s, MAX_FRAME);
            (hello, next.is_ok())
        });
        let r = handshake(&addr, Some("s3cret"), "d0", 1, &[vec![9; 64]], 1);
        assert!(matches!(r, Err(HandshakeError::Auth { .. })));
        let (hello, sent_more) = seen.join().expect("fake P");
        let Frame::Hello(hello) = hello else {
            panic!("expected a hello");
        };
        assert!(hello.workers.is_empty(), "the hello names no worker");
        assert!(!sent_more, "D sent nothing after P's bad proof");
    }

    #[test]
    fn token_is_proven_both_ways_and_mismatches_are_refused() {
        let (h, peers) = serve(Some("s3cret"));
        let addr = h.addr.to_string();
        let w = handshake(&addr, Some("s3cret"), "d0", 2, &[vec![1, 2], vec![3]], 7)
            .expect("handshake");
        assert_eq!(w.info["engine_id"], "p0");
        assert_eq!(w.server_time_ns, 42);
        {
            let v = peers.lock().expect("not poisoned");
            assert_eq!(v.len(), 1);
            assert_eq!(v[0].workers, vec!["0102".to_owned(), "03".to_owned()]);
            assert_eq!(v[0].instance, 7);
        }
        // Wrong token: P's proof fails on D's side first.
        assert!(matches!(
            handshake(&addr, Some("wrong"), "d0", 2, &[], 7),
            Err(HandshakeError::Auth { .. })
        ));
        // No token at all against a server that requires one: P refuses.
        assert!(matches!(
            handshake(&addr, None, "d0", 2, &[], 7),
            Err(HandshakeError::Auth { .. })
        ));
        assert_eq!(peers.lock().expect("not poisoned").len(), 1);

        let (open, _) = serve(None);
        assert!(handshake(&open.addr.to_string(), None, "d1", 1, &[], 7).is_ok());
        assert!(handshake(&open.addr.to_string(), Some("x"), "d1", 1, &[], 7).is_err());
    }

    /// Whether the server closed `s` within 5 s without answering.
    fn closed_unanswered(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("set timeout");
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }

    #[test]
    fn frames_over_the_limit_slow_handshakes_and_extra_connections_are_closed() {
        let limits = ServerLimits {
            max_connections: 2,
            handshake_timeout: Duration::from_millis(300),
            max_frame: 1024,
        };
        let refused = Counter::default();
        let (h, peers) = serve_with(Some("t"), limits, refused.clone());
        // An announced frame over the limit: closed before anything is read or answered.
        let mut big = TcpStream::connect(h.addr).expect("connect");
        big.write_all(&(4u32 << 20).to_be_bytes()).expect("write");
        assert!(closed_unanswered(&mut big));
        // Two silent peers take both slots; a third is closed at once and counted.
        let mut slow: Vec<TcpStream> = (0..2)
            .map(|_| TcpStream::connect(h.addr).expect("connect"))
            .collect();
        thread::sleep(Duration::from_millis(50));
        let mut third = TcpStream::connect(h.addr).expect("connect");
        assert!(closed_unanswered(&mut third));
        assert_eq!(refused.get(), 1);
        // A peer dribbling a valid-length frame is still cut off by the whole deadline.
        slow[0].write_all(&100u32.to_be_bytes()).expect("write");
        let start = Instant::now();
        for s in &mut slow {
            assert!(closed_unanswered(s));
        }
        assert!(start.elapsed() < Duration::from_secs(3));
        // The slots are free again: an honest handshake works.
        let addr = h.addr.to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        while handshake(&addr, Some("t"), "d0", 1, &[], 1).is_err() {
            assert!(Instant::now() < deadline, "slots never freed");
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(peers.lock().expect("not poisoned").len(), 1);
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(from_hex(&to_hex(&[0, 255, 16])), Some(vec![0, 255, 16]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
