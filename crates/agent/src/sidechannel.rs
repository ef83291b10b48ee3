//! The handshake side channel (like vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`): a TCP endpoint on
//! which P hands its transport metadata and KV layout to a D that proves the cluster token.
//!
//! Frames are a 4-byte big-endian length and a JSON body (at most [`MAX_FRAME`] bytes).
//!
//! 1. D → P `Hello { engine_id, nonce, workers }`: D's engine id, a fresh 32-byte nonce and
//!    the transport metadata of each D worker (so P can reach D with expiry notices).
//! 2. P → D `Challenge { nonce, proof }`: P's nonce and, with a token, P's proof
//!    `HMAC-SHA256(token, "kvlease-sc-p" ‖ D's nonce)` (D checks P too).
//! 3. D → P `Proof { proof }`: `HMAC-SHA256(token, "kvlease-sc-d" ‖ P's nonce ‖ engine_id)`.
//! 4. P → D `Welcome { info, server_time_ns }` or `Refused { message }`.
//!
//! Without a token both proofs are empty and only a peer with a token set is refused (a
//! mismatch of configuration, named in the message). Every socket has read and write
//! timeouts; the server runs one short-lived thread per connection.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Largest frame accepted.
pub const MAX_FRAME: usize = 4 << 20;
/// Read/write timeout of every side-channel socket.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// Hex transport metadata of each D worker, by rank.
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

fn write_frame(s: &mut TcpStream, f: &Frame) -> io::Result<()> {
    let body = serde_json::to_vec(f).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    s.write_all(&len.to_be_bytes())?;
    s.write_all(&body)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> io::Result<Frame> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame too large",
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
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
    /// The bind error.
    pub fn spawn(self, addr: SocketAddr) -> io::Result<ServerHandle> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let this = Arc::new(self);
        let stop2 = Arc::clone(&stop);
        thread::Builder::new()
            .name("side-channel".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let this = Arc::clone(&this);
                    let spawned = thread::Builder::new()
                        .name("side-channel-conn".into())
                        .spawn(move || {
                            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                            if let Err(e) = this.serve(conn) {
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

    fn serve(&self, mut s: TcpStream) -> io::Result<()> {
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        s.set_nodelay(true)?;
        let Frame::Hello(hello) = read_frame(&mut s)? else {
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
        let Frame::Proof { proof } = read_frame(&mut s)? else {
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
            return write_frame(
                &mut s,
                &Frame::Refused {
                    message: message.into(),
                },
            );
        }
        // Hand the peer over before answering, so that when D holds its welcome, P
        // already knows it (and can send it expiry notices).
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
        workers: workers.iter().map(|w| to_hex(w)).collect(),
        instance,
    };
    write_frame(&mut s, &Frame::Hello(hello)).map_err(io_err)?;
    let (p_nonce, p_proof) = match read_frame(&mut s).map_err(io_err)? {
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
    write_frame(&mut s, &Frame::Proof { proof }).map_err(io_err)?;
    match read_frame(&mut s).map_err(io_err)? {
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
        }
        .spawn("127.0.0.1:0".parse().expect("literal address"))
        .expect("bind loopback");
        (h, peers)
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

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(from_hex(&to_hex(&[0, 255, 16])), Some(vec![0, 255, 16]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
