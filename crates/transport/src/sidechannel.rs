//! The side channel's blocking IO: one frame reader and the two halves of one connection
//! over `kvlease_proto::sidechannel`, shared by the agents and the Python binding (each
//! keeps its own listener, connection cap, deadline and limits).
//!
//! The wire format and the exchange are `kvlease_proto::sidechannel`'s: the authenticated
//! exchange of `kvlease_proto::auth` (D the client, named by its engine id; P the server,
//! named by its own), then, only once P proved the token, D's registration, then P's
//! welcome. Nonces are drawn here.

use std::io::{self, Read, Write};

use kvlease_proto::auth;
use kvlease_proto::sidechannel::{
    self as proto, Client, Decoded, HEADER_LEN, Kind, ProofVerdict, Server,
};

pub use kvlease_proto::auth::AuthError;
pub use kvlease_proto::sidechannel::{Peer, Registration, Served, SideChannelError, Welcome};

/// Why one side-channel connection failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket failed, timed out or closed early.
    #[error("side channel IO failed")]
    Io(#[from] io::Error),
    /// No randomness for our nonce.
    #[error("no randomness for a nonce: {0}")]
    Random(getrandom::Error),
    /// The peer broke the protocol, failed the exchange or refused us.
    #[error(transparent)]
    Protocol(#[from] SideChannelError),
    /// Server side: D hung up after P's verdict instead of registering: it refused P's
    /// proof (a different cluster token on the two sides?).
    #[error(
        "engine {engine_id} closed the handshake after our proof: it refused it (a different \
         cluster token on the two sides?)"
    )]
    ClientGaveUp {
        /// D's engine id (proven with a token).
        engine_id: String,
    },
}

impl Error {
    /// Whether the cluster token failed either way: the peer refused our proof or did not
    /// prove the token. (A P that refuses a registration after both proofs, with its
    /// reason, is no token failure.)
    #[must_use]
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            Self::Protocol(SideChannelError::Auth(
                AuthError::Rejected | AuthError::PeerAuthFailed
            )) | Self::ClientGaveUp { .. }
        )
    }
}

impl From<AuthError> for Error {
    fn from(e: AuthError) -> Self {
        Self::Protocol(e.into())
    }
}

/// Reads one frame with a body of at most `max_body` bytes (auth messages are bounded
/// tighter by the format). The buffer grows with the bytes that arrive, never to an
/// announced length up front, and an oversized length is refused from the header.
///
/// # Errors
/// [`Error::Io`] (`UnexpectedEof` for a frame cut short), [`Error::Protocol`].
pub fn read_frame(s: &mut impl Read, max_body: usize) -> Result<(Kind, Vec<u8>), Error> {
    let mut buf = Vec::new();
    loop {
        let need = match proto::decode_frame(&buf, max_body)? {
            Decoded::Frame { kind, .. } => {
                buf.drain(..HEADER_LEN);
                return Ok((kind, buf));
            }
            Decoded::Need(n) => n,
        };
        let got = s.by_ref().take(need as u64).read_to_end(&mut buf)?;
        if got < need {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
    }
}

fn nonce() -> Result<auth::Nonce, Error> {
    let mut n = [0u8; auth::NONCE_LEN];
    getrandom::fill(&mut n).map_err(Error::Random)?;
    Ok(n)
}

/// D's half on `s`: proves `token` as `engine_id` (P must be called `expected`, if
/// given), checks that P proves it too, and only then sends `registration`. Returns P's
/// welcome, of at most `max_welcome` bytes.
///
/// # Errors
/// [`Error`]; [`Error::is_auth`] for a token mismatch either way.
pub fn fetch(
    s: &mut (impl Read + Write),
    engine_id: &str,
    token: Option<&[u8]>,
    expected: Option<&str>,
    registration: &Registration,
    max_welcome: usize,
) -> Result<Served, Error> {
    let d = Client::new(engine_id, nonce()?, token, expected);
    s.write_all(&d.hello())?;
    let (kind, body) = read_frame(s, auth::MAX_BODY)?;
    let (d, proof) = d.on_challenge(kind, &body)?;
    s.write_all(&proof)?;
    let (kind, body) = read_frame(s, auth::MAX_BODY)?;
    let (d, register) = d.on_result(kind, &body, registration)?;
    s.write_all(&register)?;
    let (kind, body) = read_frame(s, max_welcome.saturating_add(8))?;
    Ok(d.on_answer(kind, &body)?)
}

/// How P's half of one connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// D proved the token (or none is set), registered and was welcomed.
    Welcomed(Peer),
    /// D did not prove the token; it was told so and nothing else.
    Refused {
        /// The engine id D claimed (unproven).
        claimed: String,
    },
    /// D proved the token, and P declined its registration, telling it why.
    Declined {
        /// D's engine id (proven with a token).
        engine_id: String,
        /// Why, as D was told.
        reason: String,
    },
}

/// P's half on `s`: P is called `engine_id` and holds `token`. A D that proves the token
/// registers (a frame of at most `max_frame` bytes; everything before its proof is
/// bounded tighter by the format), and `welcome` makes the answer for it, or declines the
/// registration with a reason D is told: it runs before the answer goes out, so that
/// when D holds its welcome, P already knows D.
///
/// # Errors
/// [`Error`]: IO, a broken protocol, or [`Error::ClientGaveUp`].
pub fn serve(
    s: &mut (impl Read + Write),
    engine_id: &str,
    token: Option<&[u8]>,
    max_frame: usize,
    welcome: impl FnOnce(&Peer) -> Result<Welcome, String>,
) -> Result<Outcome, Error> {
    let p = Server::new(engine_id, nonce()?, token);
    let (kind, body) = read_frame(s, max_frame)?;
    let (p, challenge) = p.on_hello(kind, &body)?;
    s.write_all(&challenge)?;
    let (kind, body) = read_frame(s, max_frame)?;
    let next = match p.on_proof(kind, &body)? {
        ProofVerdict::Refused { reply, claimed } => {
            s.write_all(&reply)?;
            return Ok(Outcome::Refused { claimed });
        }
        ProofVerdict::Proved { reply, next } => {
            s.write_all(&reply)?;
            next
        }
    };
    let (kind, body) = match read_frame(s, max_frame) {
        Ok(frame) => frame,
        Err(Error::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(Error::ClientGaveUp {
                engine_id: next.engine_id().to_owned(),
            });
        }
        Err(e) => return Err(e),
    };
    let peer = match next.on_register(kind, &body) {
        Ok(peer) => peer,
        Err(e) => {
            // D proved the token: it may hear why.
            s.write_all(&proto::refused(&e.to_string()))?;
            return Err(e.into());
        }
    };
    match welcome(&peer) {
        Ok(answer) => {
            s.write_all(&proto::welcome(&answer))?;
            Ok(Outcome::Welcomed(peer))
        }
        Err(reason) => {
            s.write_all(&proto::refused(&reason))?;
            Ok(Outcome::Declined {
                engine_id: peer.engine_id,
                reason,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::thread;

    fn pair(
        d_token: Option<&'static [u8]>,
        p_token: Option<&'static [u8]>,
    ) -> (Result<Served, Error>, Result<Outcome, Error>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("loopback");
        let addr = l.local_addr().expect("bound");
        let p = thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            serve(&mut s, "p0", p_token, 1 << 16, |_| {
                Ok(Welcome {
                    server_time_ns: 5,
                    payload: b"info".to_vec(),
                })
            })
        });
        let mut s = TcpStream::connect(addr).expect("connect");
        let reg = Registration {
            tp_size: 1,
            instance: 3,
            workers: vec![vec![1; 100]],
        };
        let d = fetch(&mut s, "d0", d_token, Some("p0"), &reg, 1 << 16);
        drop(s);
        (d, p.join().expect("P"))
    }

    #[test]
    fn d_and_p_agree_or_both_know_why_not() {
        let (d, p) = pair(Some(b"t"), Some(b"t"));
        assert_eq!(d.expect("served").welcome.payload, b"info");
        let Ok(Outcome::Welcomed(peer)) = p else {
            panic!("P welcomed D: {p:?}");
        };
        assert_eq!(
            (peer.engine_id.as_str(), peer.registration.instance),
            ("d0", 3)
        );

        let (d, p) = pair(Some(b"wrong"), Some(b"t"));
        assert!(d.is_err_and(|e| e.is_auth()));
        assert!(matches!(p, Ok(Outcome::Refused { claimed }) if claimed == "d0"));

        let (d, p) = pair(Some(b"t"), None);
        assert!(d.is_err_and(|e| e.is_auth()));
        assert!(matches!(p, Err(Error::ClientGaveUp { .. })));
    }

    #[test]
    fn frames_are_read_whole_or_refused() {
        let f = proto::refused("no");
        let mut two = f.clone();
        two.extend_from_slice(&f);
        let mut r = &two[..];
        assert_eq!(
            read_frame(&mut r, 10).expect("frame"),
            (Kind::Refused, b"no".to_vec())
        );
        assert_eq!(r.len(), f.len(), "only one frame was read");
        let mut cut = &f[..f.len() - 1];
        assert!(
            matches!(read_frame(&mut cut, 10), Err(Error::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof)
        );
        let mut r = &f[..];
        assert!(matches!(
            read_frame(&mut r, 1),
            Err(Error::Protocol(SideChannelError::TooLarge { .. }))
        ));
    }
}
