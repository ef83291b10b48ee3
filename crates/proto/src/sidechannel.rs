//! The side channel's wire format, sans-IO: on it P hands its engine info to a D that
//! proved the cluster token. Both the agents (`kvlease-agent`) and the Python binding
//! speak it, so a P of one serves a D of the other.
//!
//! Every frame is `[kind: u8][body_len: u32 LE][body]`. The kinds are distinct from the
//! TCP backend's frame types, so a side-channel peer that reached a transport port (or the
//! reverse) fails on the first frame.
//!
//! | kind | dir | body |
//! | --- | --- | --- |
//! | 21 [`Kind::Hello`] | D→P | [`auth::Hello`], extra 0, name = D's engine id |
//! | 22 [`Kind::Challenge`] | P→D | [`auth::Challenge`], name = P's engine id |
//! | 23 [`Kind::Proof`] | D→P | [`auth::ProofMsg`] |
//! | 24 [`Kind::AuthResult`] | P→D | [`auth::AuthResult`] |
//! | 25 [`Kind::Register`] | D→P | [`Registration`] |
//! | 26 [`Kind::Welcome`] | P→D | [`Welcome`] |
//! | 27 [`Kind::Refused`] | P→D | UTF-8 message |
//!
//! 1. The exchange of [`auth`] with [`auth::SIDE_CHANNEL_ROLES`]: D is the client, P the
//!    server. P answers a bad proof with a failed `AuthResult` and nothing else.
//! 2. Only once P proved the token (D checks P's proof in the `AuthResult`) does D send
//!    its [`Registration`]: its TP size, instance and the transport metadata of each of
//!    its workers. D names nothing of its regions to a peer that has not proven the token.
//! 3. P answers [`Welcome`] (its payload, opaque here: every kvlease P puts its
//!    [`EngineInfo`](crate::engine_info::EngineInfo) in it, encoded by that codec) or
//!    `Refused`.
//!
//! Every frame a peer sends before it proved the token is an auth message, at most
//! [`auth::MAX_BODY`] bytes; the shells bound the rest ([`decode_frame`]'s `max_body`).

use crate::auth;

/// Header bytes: kind, body length.
pub const HEADER_LEN: usize = 5;

/// A frame's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`auth::Hello`].
    Hello = 21,
    /// [`auth::Challenge`].
    Challenge = 22,
    /// [`auth::ProofMsg`].
    Proof = 23,
    /// [`auth::AuthResult`].
    AuthResult = 24,
    /// [`Registration`].
    Register = 25,
    /// [`Welcome`].
    Welcome = 26,
    /// A refusal, with a message.
    Refused = 27,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            21 => Self::Hello,
            22 => Self::Challenge,
            23 => Self::Proof,
            24 => Self::AuthResult,
            25 => Self::Register,
            26 => Self::Welcome,
            27 => Self::Refused,
            _ => return None,
        })
    }

    /// Largest body of this kind whatever the shell allows: the auth messages are small.
    fn cap(self) -> usize {
        match self {
            Self::Hello | Self::Challenge | Self::Proof | Self::AuthResult => auth::MAX_BODY,
            Self::Register | Self::Welcome | Self::Refused => u32::MAX as usize,
        }
    }
}

/// Why bytes are not the side channel.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SideChannelError {
    /// A frame kind that is not the side channel's.
    #[error("unknown side-channel frame kind {0}")]
    UnknownKind(u8),
    /// A frame announced over the limit.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The kind.
        kind: Kind,
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame of another kind than the protocol's next step.
    #[error("expected a {expected} frame, got {got:?}")]
    Unexpected {
        /// What the step expects.
        expected: &'static str,
        /// What came.
        got: Kind,
    },
    /// A body that does not parse.
    #[error("malformed {0} body")]
    Malformed(&'static str),
    /// The auth exchange failed or a message of it is malformed.
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    /// P refused D, saying why.
    #[error("refused: {0}")]
    Refused(String),
}

/// What [`decode_frame`] found at the front of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A whole frame, `len` bytes of the buffer with its header.
    Frame {
        /// Its kind.
        kind: Kind,
        /// Its body.
        body: &'a [u8],
        /// Bytes it took from the buffer.
        len: usize,
    },
    /// The buffer holds a frame's beginning: at least this many more bytes are needed.
    Need(usize),
}

/// Encodes one frame.
///
/// # Panics
/// Never for bodies under 4 GiB, which every shell bounds far below.
#[must_use]
pub fn encode_frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    let mut v = Vec::with_capacity(HEADER_LEN + body.len());
    v.push(kind as u8);
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// Decodes the frame at the front of `buf`, refusing a body over `max_body` (or over
/// [`auth::MAX_BODY`] for an auth message) as soon as the header says so, before any of
/// it is read.
///
/// # Errors
/// [`SideChannelError::UnknownKind`], [`SideChannelError::TooLarge`].
pub fn decode_frame(buf: &[u8], max_body: usize) -> Result<Decoded<'_>, SideChannelError> {
    let Some(&k) = buf.first() else {
        return Ok(Decoded::Need(HEADER_LEN));
    };
    let kind = Kind::from_u8(k).ok_or(SideChannelError::UnknownKind(k))?;
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Ok(Decoded::Need(HEADER_LEN - buf.len()));
    };
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
    let max = max_body.min(kind.cap());
    if len > max {
        return Err(SideChannelError::TooLarge { kind, len, max });
    }
    let total = HEADER_LEN + len;
    match buf.get(HEADER_LEN..total) {
        Some(body) => Ok(Decoded::Frame {
            kind,
            body,
            len: total,
        }),
        None => Ok(Decoded::Need(total - buf.len())),
    }
}

/// What D registers with P once P proved the token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registration {
    /// D's TP size (0: unsaid, a D that only fetches).
    pub tp_size: u32,
    /// D's instance (its start time in microseconds): a restarted D under the same engine
    /// id has a larger one. 0 when unsaid.
    pub instance: u64,
    /// The transport metadata of each D worker, by rank (none: a D that only fetches).
    pub workers: Vec<Vec<u8>>,
}

impl Registration {
    /// The body: tp_size u32, instance u64, worker count u32, then each worker's length
    /// u32 and bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b =
            Vec::with_capacity(16 + self.workers.iter().map(|w| 4 + w.len()).sum::<usize>());
        b.extend_from_slice(&self.tp_size.to_le_bytes());
        b.extend_from_slice(&self.instance.to_le_bytes());
        put_len(&mut b, self.workers.len());
        for w in &self.workers {
            put_len(&mut b, w.len());
            b.extend_from_slice(w);
        }
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`SideChannelError::Malformed`].
    pub fn decode(body: &[u8]) -> Result<Self, SideChannelError> {
        let bad = || SideChannelError::Malformed("registration");
        let mut r = Cursor(body);
        let tp_size = r.u32().ok_or_else(bad)?;
        let instance = r.u64().ok_or_else(bad)?;
        let n = r.u32().ok_or_else(bad)? as usize;
        // Each worker takes at least its 4-byte length: a count past that is a lie.
        if n > r.0.len() / 4 {
            return Err(bad());
        }
        let mut workers = Vec::with_capacity(n);
        for _ in 0..n {
            let len = r.u32().ok_or_else(bad)? as usize;
            workers.push(r.take(len).ok_or_else(bad)?.to_vec());
        }
        if !r.0.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            tp_size,
            instance,
            workers,
        })
    }
}

/// P's answer to a registered D.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Welcome {
    /// P's wall clock at the answer, in ns since the Unix epoch (for D's clock offset
    /// estimate).
    pub server_time_ns: u64,
    /// What P serves (opaque here).
    pub payload: Vec<u8>,
}

impl Welcome {
    /// The body: server_time_ns u64, then the payload.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(8 + self.payload.len());
        b.extend_from_slice(&self.server_time_ns.to_le_bytes());
        b.extend_from_slice(&self.payload);
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`SideChannelError::Malformed`].
    pub fn decode(body: &[u8]) -> Result<Self, SideChannelError> {
        let mut r = Cursor(body);
        let server_time_ns = r.u64().ok_or(SideChannelError::Malformed("welcome"))?;
        Ok(Self {
            server_time_ns,
            payload: r.0.to_vec(),
        })
    }
}

fn put_len(b: &mut Vec<u8>, n: usize) {
    b.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Some(u64::from_le_bytes(a))
    }
}

/// Checks a frame's kind against the step's; a refusal in its place is P's last word.
fn expect(
    kind: Kind,
    body: &[u8],
    want: Kind,
    expected: &'static str,
) -> Result<(), SideChannelError> {
    match kind {
        k if k == want => Ok(()),
        Kind::Refused => Err(SideChannelError::Refused(
            String::from_utf8_lossy(body).into_owned(),
        )),
        got => Err(SideChannelError::Unexpected { expected, got }),
    }
}

/// D's side of the side channel: the [`auth`] exchange, then its registration; the shell
/// moves frames. Start with [`Client::new`] and send [`Client::hello`].
#[derive(Debug, Clone)]
pub struct Client {
    auth: auth::ClientAuth,
}

/// D after its proof, waiting for P's verdict.
#[derive(Debug, Clone)]
pub struct ClientProved {
    auth: auth::ClientProved,
}

/// D registered, waiting for the welcome.
#[derive(Debug, Clone)]
pub struct ClientRegistered {
    server_name: String,
    session: Option<auth::Session>,
}

/// What a D receives from a P that proved the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// P's engine id, as proven (with a token) in the exchange.
    pub engine_id: String,
    /// P's welcome.
    pub welcome: Welcome,
    /// The exchange's session (with a token): D's transport connections to P's workers
    /// prove with it, so that they speak for this registration.
    pub session: Option<auth::Session>,
}

impl Client {
    /// D called `engine_id` (its name in the exchange), with a fresh random `nonce` and
    /// the cluster `token`; with `expected`, P must be called that.
    #[must_use]
    pub fn new(
        engine_id: &str,
        nonce: auth::Nonce,
        token: Option<&[u8]>,
        expected: Option<&str>,
    ) -> Self {
        Self {
            auth: auth::ClientAuth::new(
                auth::SIDE_CHANNEL_ROLES,
                0,
                nonce,
                engine_id,
                token,
                expected,
            ),
        }
    }

    /// The first frame to send.
    #[must_use]
    pub fn hello(&self) -> Vec<u8> {
        encode_frame(Kind::Hello, &self.auth.hello())
    }

    /// Takes P's first frame; returns the proof frame to send.
    ///
    /// # Errors
    /// [`SideChannelError`].
    pub fn on_challenge(
        self,
        kind: Kind,
        body: &[u8],
    ) -> Result<(ClientProved, Vec<u8>), SideChannelError> {
        expect(kind, body, Kind::Challenge, "challenge")?;
        let (auth, proof) = self.auth.on_challenge(body)?;
        Ok((ClientProved { auth }, encode_frame(Kind::Proof, &proof)))
    }
}

impl ClientProved {
    /// Takes P's verdict; once P proved the token, returns the registration frame to send
    /// (only then does D name its workers).
    ///
    /// # Errors
    /// [`SideChannelError::Auth`] when P refused our proof or did not prove the token.
    pub fn on_result(
        self,
        kind: Kind,
        body: &[u8],
        registration: &Registration,
    ) -> Result<(ClientRegistered, Vec<u8>), SideChannelError> {
        expect(kind, body, Kind::AuthResult, "auth result")?;
        let session = self.auth.session();
        let server_name = self.auth.on_result(body)?;
        Ok((
            ClientRegistered {
                server_name,
                session,
            },
            encode_frame(Kind::Register, &registration.encode()),
        ))
    }
}

impl ClientRegistered {
    /// Takes P's answer to the registration.
    ///
    /// # Errors
    /// [`SideChannelError::Refused`] with P's message, or a malformed answer.
    pub fn on_answer(self, kind: Kind, body: &[u8]) -> Result<Served, SideChannelError> {
        expect(kind, body, Kind::Welcome, "welcome")?;
        Ok(Served {
            engine_id: self.server_name,
            welcome: Welcome::decode(body)?,
            session: self.session,
        })
    }
}

/// P's side of one side-channel connection. Start with [`Server::new`].
#[derive(Debug, Clone)]
pub struct Server {
    auth: auth::ServerAuth,
}

/// P waiting for D's proof.
#[derive(Debug, Clone)]
pub struct ServerChallenged {
    auth: auth::AwaitingProof,
}

/// What P learned from a D that proved the token (or from any D, without a token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// D's engine id, as proven in the exchange.
    pub engine_id: String,
    /// D's registration.
    pub registration: Registration,
    /// The exchange's session (with a token): the transport connections that prove with
    /// it are D's, the party that made this registration.
    pub session: Option<auth::Session>,
}

/// P's verdict on D's proof.
#[derive(Debug)]
pub enum ProofVerdict {
    /// D proved the token: send `reply`, then read its registration with
    /// [`ServerProved::on_register`].
    Proved {
        /// The auth-result frame to send.
        reply: Vec<u8>,
        /// The next step.
        next: ServerProved,
    },
    /// D did not prove the token: send `reply` and close.
    Refused {
        /// The auth-result frame to send.
        reply: Vec<u8>,
        /// D's claimed (unproven) engine id, for the logs.
        claimed: String,
    },
}

/// P waiting for the registration of a D that proved the token.
#[derive(Debug, Clone)]
pub struct ServerProved {
    engine_id: String,
    session: Option<auth::Session>,
}

impl Server {
    /// P called `engine_id`, with a fresh random `nonce` and the cluster `token`.
    #[must_use]
    pub fn new(engine_id: &str, nonce: auth::Nonce, token: Option<&[u8]>) -> Self {
        Self {
            auth: auth::ServerAuth::new(auth::SIDE_CHANNEL_ROLES, nonce, engine_id, token),
        }
    }

    /// Takes D's first frame; returns the challenge frame to send.
    ///
    /// # Errors
    /// [`SideChannelError`]: another frame, a malformed hello, another protocol version
    /// (there is one so far: such a D is closed without a challenge).
    pub fn on_hello(
        self,
        kind: Kind,
        body: &[u8],
    ) -> Result<(ServerChallenged, Vec<u8>), SideChannelError> {
        expect(kind, body, Kind::Hello, "hello")?;
        let challenged = self.auth.on_hello(body)?;
        let reply = encode_frame(Kind::Challenge, &challenged.reply);
        let auth = challenged.into_waiting()?;
        Ok((ServerChallenged { auth }, reply))
    }
}

impl ServerChallenged {
    /// D's claimed (not yet proven) engine id.
    #[must_use]
    pub fn claimed(&self) -> &str {
        &self.auth.hello().name
    }

    /// Takes D's proof.
    ///
    /// # Errors
    /// [`SideChannelError`] for another frame or a malformed proof.
    pub fn on_proof(self, kind: Kind, body: &[u8]) -> Result<ProofVerdict, SideChannelError> {
        expect(kind, body, Kind::Proof, "proof")?;
        let v = self.auth.on_proof(body)?;
        let reply = encode_frame(Kind::AuthResult, &v.reply);
        Ok(if v.ok {
            ProofVerdict::Proved {
                reply,
                next: ServerProved {
                    engine_id: v.client_name,
                    session: v.session,
                },
            }
        } else {
            ProofVerdict::Refused {
                reply,
                claimed: v.client_name,
            }
        })
    }
}

impl ServerProved {
    /// D's proven engine id.
    #[must_use]
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// Takes D's registration.
    ///
    /// # Errors
    /// [`SideChannelError`] for another frame or a malformed registration.
    pub fn on_register(self, kind: Kind, body: &[u8]) -> Result<Peer, SideChannelError> {
        expect(kind, body, Kind::Register, "registration")?;
        Ok(Peer {
            engine_id: self.engine_id,
            registration: Registration::decode(body)?,
            session: self.session,
        })
    }
}

/// The welcome frame for a registered D.
#[must_use]
pub fn welcome(welcome: &Welcome) -> Vec<u8> {
    encode_frame(Kind::Welcome, &welcome.encode())
}

/// A refusal frame.
#[must_use]
pub fn refused(message: &str) -> Vec<u8> {
    encode_frame(Kind::Refused, message.as_bytes())
}

/// The start of the refusal a side channel sends instead of a challenge when it serves
/// too many handshakes at once: try again shortly ([`SideChannelError::is_busy`]).
pub const BUSY: &str = "busy: too many side-channel handshakes at once; retry";

impl SideChannelError {
    /// Whether the peer refused because it was busy ([`BUSY`]): a retry may succeed.
    #[must_use]
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Refused(m) if m.starts_with("busy:"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn one(buf: &[u8]) -> (Kind, Vec<u8>) {
        match decode_frame(buf, 1 << 20) {
            Ok(Decoded::Frame { kind, body, len }) => {
                assert_eq!(len, buf.len());
                (kind, body.to_vec())
            }
            other => panic!("not one frame: {other:?}"),
        }
    }

    /// D and P in memory, frame by frame.
    fn run(
        d_token: Option<&[u8]>,
        p_token: Option<&[u8]>,
    ) -> (Result<Served, SideChannelError>, Option<Peer>) {
        let reg = Registration {
            tp_size: 2,
            instance: 9,
            workers: vec![vec![1, 2], vec![3]],
        };
        let d = Client::new("d0", [1; 32], d_token, None);
        let p = Server::new("p0", [2; 32], p_token);
        let (k, b) = one(&d.hello());
        let (p, challenge) = p.on_hello(k, &b).expect("hello");
        assert_eq!(p.claimed(), "d0");
        let (k, b) = one(&challenge);
        let (d, proof) = d.on_challenge(k, &b).expect("challenge");
        let (k, b) = one(&proof);
        let (reply, next) = match p.on_proof(k, &b).expect("proof") {
            ProofVerdict::Proved { reply, next } => (reply, Some(next)),
            ProofVerdict::Refused { reply, .. } => (reply, None),
        };
        let (k, b) = one(&reply);
        let (d, register) = match d.on_result(k, &b, &reg) {
            Ok(x) => x,
            Err(e) => return (Err(e), None),
        };
        let (k, b) = one(&register);
        let peer = next
            .expect("P proved D")
            .on_register(k, &b)
            .expect("registration");
        assert_eq!(peer.registration, reg);
        let w = welcome(&Welcome {
            server_time_ns: 42,
            payload: b"info".to_vec(),
        });
        let (k, b) = one(&w);
        (d.on_answer(k, &b), Some(peer))
    }

    #[test]
    fn a_d_that_proves_the_token_registers_and_is_welcomed() {
        let t = Some(&b"t"[..]);
        let (served, peer) = run(t, t);
        let served = served.expect("served");
        assert_eq!(served.engine_id, "p0");
        let both = (
            served.session.clone(),
            peer.as_ref().and_then(|p| p.session.clone()),
        );
        assert!(
            both.0.is_some() && both.0 == both.1,
            "both sides hold one session"
        );
        assert_eq!(served.welcome.payload, b"info");
        assert_eq!(served.welcome.server_time_ns, 42);
        assert_eq!(peer.map(|p| p.engine_id), Some("d0".into()));
        assert!(run(None, None).0.is_ok());
    }

    #[test]
    fn token_mismatches_fail_before_d_registers() {
        let t = Some(&b"t"[..]);
        let w = Some(&b"w"[..]);
        for (d, p, want) in [
            (w, t, auth::AuthError::Rejected),
            (None, t, auth::AuthError::Rejected),
            (t, None, auth::AuthError::PeerAuthFailed),
        ] {
            let (served, peer) = run(d, p);
            assert_eq!(served, Err(SideChannelError::Auth(want)));
            assert!(peer.is_none(), "no registration reached P");
        }
    }

    #[test]
    fn the_decoder_asks_for_what_it_needs_and_bounds_frames_by_their_header() {
        let f = encode_frame(Kind::Welcome, &[7; 10]);
        assert_eq!(decode_frame(&[], 100), Ok(Decoded::Need(HEADER_LEN)));
        assert_eq!(decode_frame(&f[..2], 100), Ok(Decoded::Need(3)));
        assert_eq!(decode_frame(&f[..7], 100), Ok(Decoded::Need(8)));
        assert!(matches!(
            decode_frame(&f, 9),
            Err(SideChannelError::TooLarge {
                len: 10,
                max: 9,
                ..
            })
        ));
        assert_eq!(
            decode_frame(&[1, 0, 0, 0, 0], 100),
            Err(SideChannelError::UnknownKind(1))
        );
        let mut big = vec![Kind::Hello as u8];
        big.extend_from_slice(&(u32::try_from(auth::MAX_BODY + 1).expect("small")).to_le_bytes());
        assert!(matches!(
            decode_frame(&big, 1 << 20),
            Err(SideChannelError::TooLarge {
                kind: Kind::Hello,
                ..
            })
        ));
        let mut two = f.clone();
        two.extend_from_slice(&f);
        assert!(matches!(
            decode_frame(&two, 100),
            Ok(Decoded::Frame { len: 15, .. })
        ));
    }

    #[test]
    fn a_registration_that_lies_about_its_count_is_refused() {
        let mut b = Registration::default().encode();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Registration::decode(&b),
            Err(SideChannelError::Malformed("registration"))
        );
    }

    proptest! {
        #[test]
        fn registrations_round_trip(
            tp_size: u32, instance: u64,
            workers in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 0..5),
        ) {
            let r = Registration { tp_size, instance, workers };
            prop_assert_eq!(Registration::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_frame(&bytes, 32);
            let _ = Registration::decode(&bytes);
            let _ = Welcome::decode(&bytes);
        }
    }
}
