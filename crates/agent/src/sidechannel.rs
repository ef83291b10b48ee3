//! The handshake side channel (like vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`): a TCP endpoint on
//! which P hands its transport metadata and KV layout to a D that proves the cluster token.
//!
//! The wire format is `kvlease_proto::sidechannel`'s, the same the Python binding speaks
//! (a P of one serves a D of the other), and the connection's two halves are
//! `kvlease_transport::sidechannel`'s; this module keeps the agents' listener, limits and
//! types:
//!
//! 1. The authenticated exchange of `kvlease_proto::auth` (side-channel roles): D proves
//!    the token under its engine id, P under its own, both nonces and both names bound
//!    into each proof. A wrong or missing token is refused either way.
//! 2. Only once P proved the token does D register: its TP size, instance and the
//!    transport metadata of each D worker (so P can reach D with expiry notices): D names
//!    nothing of its regions to a peer that has not proven the token.
//! 3. P answers with a welcome (its engine info, `kvlease_proto::engine_info`'s
//!    `EngineInfo`, and its wall clock) or a refusal.
//!
//! Without a token no proofs are sent and only a peer with a token set fails (a mismatch
//! of configuration). Every socket has read and write timeouts; the server runs one
//! short-lived thread per connection.
//!
//! Everything the server reads comes from a peer that has not proven the token yet, so
//! the server is bounded by [`ServerLimits`]: at most `max_connections` handshakes (and
//! threads) at once, and at most `max_per_address` from one peer address, more are
//! closed at once; each whole handshake ends by an absolute
//! deadline from accept; and no frame over `max_frame` is accepted (the auth frames before
//! D's proof are bounded tighter by the format). A frame's buffer grows with the bytes
//! that actually arrive, so announcing a large length costs the peer as much as it costs
//! us.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlease_proto::engine_info::EngineInfo;
use kvlease_transport::acceptor::{Acceptor, Handler, Limits};
use kvlease_transport::deadline::Deadlined;
use kvlease_transport::sidechannel::{self as sc, Outcome, Registration};
use prometheus_client::metrics::counter::Counter;

/// Largest frame D accepts from a P that proved the token (the welcome, with P's info).
pub const MAX_FRAME: usize = 4 << 20;
/// Read/write timeout of every socket D opens to a side channel.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Default for [`ServerLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default for [`ServerLimits::max_per_address`].
pub const DEFAULT_MAX_PER_ADDRESS: usize = 16;
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
    /// Handshakes served at once for one peer address (below `max_connections`, so that
    /// one source cannot take every slot); more from that address are closed at once and
    /// counted like the others. Default [`DEFAULT_MAX_PER_ADDRESS`].
    pub max_per_address: usize,
    /// A whole handshake, from accept to the welcome, must end within this; reads and
    /// writes get only the time left. Default [`DEFAULT_HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: Duration,
    /// Largest frame read from a peer (its registration; the frames before its proof are
    /// bounded tighter by the format); a longer announced length closes the connection
    /// before anything is allocated for it. Default
    /// [`DEFAULT_MAX_PREAUTH_FRAME`].
    pub max_frame: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_address: DEFAULT_MAX_PER_ADDRESS,
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
    /// The side channel is served by another engine than the one asked for (the name
    /// it proved in the exchange).
    #[error("side channel {addr}: served by engine {serves}, not the one asked for")]
    WrongEngine {
        /// The peer.
        addr: String,
        /// The engine it proved to be.
        serves: String,
    },
    /// The peer refused us (wrong token) or failed to prove the token.
    #[error("side channel {addr}: authentication failed: {message}")]
    Auth {
        /// The peer.
        addr: String,
        /// Why.
        message: String,
    },
    /// The peer serves too many handshakes at once and told us to retry.
    #[error("side channel {addr}: {message}")]
    Busy {
        /// The peer.
        addr: String,
        /// What it said.
        message: String,
    },
}

impl HandshakeError {
    /// Whether a retry shortly may succeed: the peer was busy, or the connection broke
    /// or timed out after it was accepted (not refused: nothing listens there then).
    #[must_use]
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Busy { .. } => true,
            Self::Io { source, .. } => source.kind() != io::ErrorKind::ConnectionRefused,
            _ => false,
        }
    }
}

/// What P learns of a D that proved the token.
#[derive(Debug, Clone)]
pub struct Hello {
    /// D's engine id, as proven in the exchange.
    pub engine_id: String,
    /// D's TP size.
    pub tp_size: u32,
    /// Hex transport metadata of each D worker, by rank.
    pub workers: Vec<String>,
    /// D's instance (its start time in microseconds): a restarted D under the same engine
    /// id has a larger one, and P replaces its connections to the old one. 0 when unsaid.
    pub instance: u64,
    /// The address D's side-channel connection came from (P connects back only to D
    /// workers there unless told otherwise). `None` when unknown.
    pub peer_ip: Option<std::net::IpAddr>,
    /// The exchange's session (with a token): D's transport connections prove it.
    pub session: Option<kvlease_transport::Session>,
}

/// Lowercase hex of bytes, and back (`None` if not hex).
pub use kvlease_proto::engine_info::{from_hex, to_hex};

/// What P's side channel serves, and what it does with a D that proved the token.
pub struct Server {
    /// P's engine id, its name in the exchange.
    pub engine_id: String,
    /// The engine info every authenticated D receives.
    pub info: EngineInfo,
    /// The cluster token, if any.
    pub token: Option<String>,
    /// Called with each authenticated D's hello, before D is answered: `Err` declines
    /// the registration, and D is told the reason instead of welcomed.
    pub on_peer: Box<dyn Fn(Hello) -> Result<(), String> + Send + Sync>,
    /// This host's wall clock, in ns (for D's clock offset estimate).
    pub clock_ns: Box<dyn Fn() -> u64 + Send + Sync>,
    /// What peers may make the server spend.
    pub limits: ServerLimits,
    /// Counts connections closed unserved because `limits.max_connections` handshakes
    /// were running and none could be evicted (they were told to retry).
    pub refused: Counter,
    /// Counts handshakes cut off to make room for another address's
    /// (`kvlease_side_channel_evicted_total`).
    pub evicted: Counter,
}

/// A running side channel; stops accepting when dropped.
#[derive(Debug)]
pub struct ServerHandle {
    /// The bound address.
    pub addr: SocketAddr,
    _acceptor: Acceptor,
}

impl Server {
    /// Binds `addr` and serves handshakes on a background thread.
    ///
    /// # Errors
    /// The bind error; `InvalidInput` for a limit of zero.
    pub fn spawn(self, addr: SocketAddr) -> io::Result<ServerHandle> {
        let l = &self.limits;
        if l.max_connections == 0
            || l.max_per_address == 0
            || l.handshake_timeout.is_zero()
            || l.max_frame == 0
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "side-channel limits must be non-zero",
            ));
        }
        // The handshakes at once are few; a newcomer evicts the oldest of the address
        // holding the most (its socket shut down).
        let limits = Limits {
            max_connections: l.max_connections,
            max_per_address: l.max_per_address.min(l.max_connections),
            evict: true,
        };
        let acceptor = Acceptor::bind(addr, "side-channel", limits, Arc::new(self))?;
        Ok(ServerHandle {
            addr: acceptor.local_addr(),
            _acceptor: acceptor,
        })
    }

    /// P's half of one handshake, by its deadline.
    fn handshake(&self, mut s: Deadlined) -> Result<(), sc::Error> {
        s.get_ref().set_nodelay(true)?;
        let peer_ip = s.get_ref().peer_addr().ok().map(|a| a.ip());
        let token = self.token.as_deref().map(str::as_bytes);
        let outcome = sc::serve(
            &mut s,
            &self.engine_id,
            token,
            self.limits.max_frame,
            |peer| {
                let r = &peer.registration;
                // Hand the peer over before answering, so that when D holds its welcome,
                // P already knows it (and can send it expiry notices).
                (self.on_peer)(Hello {
                    engine_id: peer.engine_id.clone(),
                    tp_size: r.tp_size,
                    workers: r.workers.iter().map(|w| to_hex(w)).collect(),
                    instance: r.instance,
                    peer_ip,
                    session: peer.session.clone(),
                })?;
                Ok(sc::Welcome {
                    server_time_ns: (self.clock_ns)(),
                    payload: self.info.encode(),
                })
            },
        )?;
        match outcome {
            Outcome::Refused { claimed } => tracing::warn!(
                engine = %claimed,
                "side-channel peer refused: wrong or missing cluster token"
            ),
            Outcome::Declined { engine_id, reason } => tracing::warn!(
                engine = %engine_id,
                %reason,
                "side-channel registration declined"
            ),
            _ => {}
        }
        Ok(())
    }
}

impl Handler for Server {
    fn serve(&self, conn: TcpStream, peer: SocketAddr, accepted: Instant) {
        let s = Deadlined::new(conn, accepted + self.limits.handshake_timeout);
        if let Err(e) = self.handshake(s) {
            let error = crate::telemetry::error_chain(&e);
            tracing::warn!(%peer, %error, "side-channel handshake failed");
        }
    }

    fn refuse(&self, conn: &TcpStream, peer: SocketAddr) {
        self.refused.inc();
        tracing::debug!(
            %peer,
            limit = self.limits.max_connections,
            "side channel: too many handshakes at once, none to evict; refused"
        );
        // Tell D to retry (a few bytes into a fresh socket's buffer).
        let _ = io::Write::write_all(
            &mut &*conn,
            &kvlease_proto::sidechannel::refused(kvlease_proto::sidechannel::BUSY),
        );
    }

    fn evicted(&self) {
        self.evicted.inc();
    }
}

/// What a successful handshake returns to D.
#[derive(Debug, Clone)]
pub struct Welcome {
    /// P's info.
    pub info: serde_json::Value,
    /// P's wall clock at the answer, in ns.
    pub server_time_ns: u64,
    /// The exchange's session (with a token): D's workers connect to P's proving it, so
    /// that P takes their notifications as this registration's.
    pub session: Option<kvlease_transport::Session>,
}

/// Runs the handshake against P's side channel at `addr` (D side). With `expected`, the
/// server must prove that engine id in the exchange (else
/// [`HandshakeError::WrongEngine`], before D names any of its workers).
///
/// # Errors
/// [`HandshakeError`]: IO or timeout, a protocol violation, a server proving another
/// engine id, or failed authentication either way.
pub fn handshake(
    addr: &str,
    token: Option<&str>,
    expected: Option<&str>,
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
    let registration = Registration {
        tp_size,
        instance,
        workers: workers.to_vec(),
    };
    let token = token.map(str::as_bytes);
    let served = sc::fetch(&mut s, engine_id, token, expected, &registration, MAX_FRAME).map_err(
        |e| match e {
            sc::Error::Io(source) => io_err(source),
            sc::Error::Protocol(sc::SideChannelError::Auth(sc::AuthError::WrongName(serves))) => {
                HandshakeError::WrongEngine {
                    addr: addr.to_owned(),
                    serves,
                }
            }
            e if e.is_auth() => HandshakeError::Auth {
                addr: addr.to_owned(),
                message: auth_message(&e),
            },
            sc::Error::Protocol(e) if e.is_busy() => HandshakeError::Busy {
                addr: addr.to_owned(),
                message: e.to_string(),
            },
            e => HandshakeError::Protocol {
                addr: addr.to_owned(),
                message: e.to_string(),
            },
        },
    )?;
    let info = serde_json::from_slice(&served.welcome.payload)
        .map_err(|e| proto(&format!("the welcome is not JSON: {e}")))?;
    Ok(Welcome {
        info,
        server_time_ns: served.welcome.server_time_ns,
        session: served.session,
    })
}

/// What D says of a token mismatch.
fn auth_message(e: &sc::Error) -> String {
    match e {
        sc::Error::Protocol(sc::SideChannelError::Auth(sc::AuthError::PeerAuthFailed)) => {
            "the prefill engine did not prove the cluster token".into()
        }
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::Mutex;
    use std::thread;

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
            engine_id: "p0".into(),
            info: EngineInfo::new(
                kvlease_lease::EngineId::new("p0").expect("valid id"),
                0,
                2,
                1,
            ),
            token: token.map(str::to_owned),
            on_peer: Box::new(move |hello| {
                if let Ok(mut v) = p2.lock() {
                    v.push(hello);
                }
                Ok(())
            }),
            clock_ns: Box::new(|| 42),
            limits,
            refused,
            evicted: Counter::default(),
        }
        .spawn("127.0.0.1:0".parse().expect("literal address"))
        .expect("bind loopback");
        (h, peers)
    }

    /// D names its workers (its transport metadata, its regions) only after P proved
    /// the token: a peer posing as P sees only the auth exchange's hello and proof.
    #[test]
    fn d_names_its_workers_only_after_p_proved_the_token() {
        use kvlease_proto::auth;
        use kvlease_proto::sidechannel::{Kind, encode_frame};
        let fake_p = TcpListener::bind("127.0.0.1:0").expect("loopback");
        let addr = fake_p.local_addr().expect("bound").to_string();
        let seen = thread::spawn(move || {
            let (mut s, _) = fake_p.accept().expect("D connects");
            let (hello, _) = sc::read_frame(&mut s, MAX_FRAME).expect("a frame");
            let challenge = auth::Challenge {
                version: auth::PROTOCOL_VERSION,
                auth_required: true,
                nonce: [7; 32],
                name: "p0".into(),
            };
            s.write_all(&encode_frame(Kind::Challenge, &challenge.encode()))
                .expect("write");
            let (proof, _) = sc::read_frame(&mut s, MAX_FRAME).expect("a frame");
            // A verdict whose proof was made without the token.
            let result = auth::AuthResult {
                ok: true,
                proof: Some([0; 32]),
            };
            s.write_all(&encode_frame(Kind::AuthResult, &result.encode()))
                .expect("write");
            let next = sc::read_frame(&mut s, MAX_FRAME);
            (hello, proof, next.is_ok())
        });
        let r = handshake(&addr, Some("s3cret"), None, "d0", 1, &[vec![9; 64]], 1);
        assert!(matches!(r, Err(HandshakeError::Auth { .. })));
        let (hello, proof, sent_more) = seen.join().expect("fake P");
        assert_eq!(hello, Kind::Hello, "the hello names no worker");
        assert_eq!(proof, Kind::Proof, "the proof names no worker");
        assert!(!sent_more, "D sent nothing after P's bad proof");
    }

    #[test]
    fn token_is_proven_both_ways_and_mismatches_are_refused() {
        let (h, peers) = serve(Some("s3cret"));
        let addr = h.addr.to_string();
        let w = handshake(
            &addr,
            Some("s3cret"),
            None,
            "d0",
            2,
            &[vec![1, 2], vec![3]],
            7,
        )
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
            handshake(&addr, Some("wrong"), None, "d0", 2, &[], 7),
            Err(HandshakeError::Auth { .. })
        ));
        // No token at all against a server that requires one: P refuses.
        assert!(matches!(
            handshake(&addr, None, None, "d0", 2, &[], 7),
            Err(HandshakeError::Auth { .. })
        ));
        assert_eq!(peers.lock().expect("not poisoned").len(), 1);

        let (open, _) = serve(None);
        assert!(handshake(&open.addr.to_string(), None, None, "d1", 1, &[], 7).is_ok());
        assert!(handshake(&open.addr.to_string(), Some("x"), None, "d1", 1, &[], 7).is_err());
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
            max_per_address: 2,
            handshake_timeout: Duration::from_millis(300),
            max_frame: 1024,
        };
        let refused = Counter::default();
        let (h, peers) = serve_with(Some("t"), limits, refused.clone());
        // An announced frame over the limit: closed before anything is read or answered.
        let mut big = TcpStream::connect(h.addr).expect("connect");
        let mut header = vec![kvlease_proto::sidechannel::Kind::Hello as u8];
        header.extend_from_slice(&(4u32 << 20).to_le_bytes());
        big.write_all(&header).expect("write");
        assert!(closed_unanswered(&mut big));
        // Two silent peers take both slots; a third from the same address takes the slot
        // of its own oldest, which is closed (the address keeps its share, no more).
        let mut slow: Vec<TcpStream> = (0..2)
            .map(|_| TcpStream::connect(h.addr).expect("connect"))
            .collect();
        thread::sleep(Duration::from_millis(50));
        let third = TcpStream::connect(h.addr).expect("connect");
        assert!(closed_unanswered(&mut slow[0]));
        assert_eq!(refused.get(), 0);
        slow[0] = third;
        // A peer dribbling a valid-length frame is still cut off by the whole deadline.
        let mut header = vec![kvlease_proto::sidechannel::Kind::Hello as u8];
        header.extend_from_slice(&100u32.to_le_bytes());
        slow[0].write_all(&header).expect("write");
        let start = Instant::now();
        for s in &mut slow {
            assert!(closed_unanswered(s));
        }
        assert!(start.elapsed() < Duration::from_secs(3));
        // The slots are free again: an honest handshake works.
        let addr = h.addr.to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        while handshake(&addr, Some("t"), None, "d0", 1, &[], 1).is_err() {
            assert!(Instant::now() < deadline, "slots never freed");
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(peers.lock().expect("not poisoned").len(), 1);
    }

    /// D checks the engine id P proved against the one it asked for, before it names
    /// any of its workers.
    #[test]
    fn d_refuses_a_side_channel_proving_another_engine() {
        let (h, peers) = serve(Some("s3cret"));
        let addr = h.addr.to_string();
        let r = handshake(&addr, Some("s3cret"), Some("p1"), "d0", 1, &[vec![1]], 1);
        assert!(
            matches!(&r, Err(HandshakeError::WrongEngine { serves, .. }) if serves == "p0"),
            "{r:?}"
        );
        assert!(peers.lock().expect("not poisoned").is_empty());
        assert!(handshake(&addr, Some("s3cret"), Some("p0"), "d0", 1, &[vec![1]], 1).is_ok());
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(from_hex(&to_hex(&[0, 255, 16])), Some(vec![0, 255, 16]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
