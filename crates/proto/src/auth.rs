//! The one authenticated challenge/response exchange under the cluster token, sans-IO.
//!
//! Every kvlease connection that must prove the token runs it: the TCP backend's data and
//! notification connections, the shared-memory backend's Unix socket, and the side channel
//! (`super::sidechannel`). Each carries the four messages in its own frames; this module
//! owns their bodies (integers little-endian), the proofs and every HMAC label:
//!
//! | message | dir | body |
//! | --- | --- | --- |
//! | [`Hello`] | client → server | version u16, extra u16, 32-byte nonce, name len u16, name |
//! | [`Challenge`] | server → client | version u16, auth required u8, 32-byte nonce, name len u16, name |
//! | [`ProofMsg`] | client → server | proof len u8 (0 or 32), proof |
//! | [`AuthResult`] | server → client | ok u8, proof len u8 (0 or 32), proof |
//!
//! The client proves `"kvlease-tcp-v1 " ‖ client role ‖ server nonce ‖ client nonce ‖
//! client name ‖ 0 ‖ server name`; the server answers, only once the client's proof held,
//! with `"kvlease-tcp-v1 " ‖ server role ‖ client nonce ‖ server nonce ‖ server name ‖ 0 ‖
//! client name` (HMAC-SHA256 under the token). Both nonces are fresh per connection and
//! both names are bound into each proof, so a recorded proof is worthless on another
//! connection or under another name; each kind of connection has its own [`Roles`], so a
//! proof of one kind is worthless in another. Proofs are compared in constant time.
//!
//! Without a token no proof is sent; a server without a token accepts every client, and a
//! client with a token refuses a server that did not prove it.
//!
//! [`ClientAuth`] and [`ServerAuth`] are the two halves as state machines: each takes the
//! peer's body and returns the body to send, so a shell only moves bytes. Nonces are
//! arguments: the shells draw them (`getrandom`).
//!
//! # Bound data
//! A kind of connection whose exchange also carries data of its own (the verbs backend's
//! queue-pair info) binds it into the proofs: the client's proof covers the client's data
//! ([`ClientAuth::with_binding`]), the server's answer covers both sides' data
//! ([`Checked::reply`], [`ClientProved::on_result_bound`]), each appended to the proven
//! bytes as `0 ‖ length u32 LE ‖ data`. A proof of one exchange is then worthless with
//! other data, and data swapped on the way fails the proof. Without bound data the proofs
//! are exactly the bytes above.
//!
//! # Sessions
//! An exchange under a token also gives both sides a [`Session`]: a key only the two of
//! them (and whoever holds the token and saw both nonces) can compute,
//! `HMAC(token, "kvlease-session-v1 " ‖ client role ‖ server nonce ‖ client nonce ‖
//! client name ‖ 0 ‖ server name)`. The side channel uses it to tie D's later transport
//! connections to the registration that exchange carried: a server that holds a session
//! for a client's name ([`AwaitingProof::on_proof_keyed`]) checks that client's proof
//! under the session's key instead of the token, and the client proves with the key in
//! the token's place. Such a proof holds only on a connection of the party that ran
//! that exchange.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Protocol version spoken in [`Hello`] and [`Challenge`].
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;
/// Longest name (engine or agent name) in a hello or challenge.
pub const MAX_NAME_LEN: usize = 1024;
/// Largest body of any of the four messages (a hello or challenge with the longest name);
/// a frame header announcing more is malformed before anything is read.
pub const MAX_BODY: usize = 2 + 2 + NONCE_LEN + 2 + MAX_NAME_LEN;

/// A connection's fresh random nonce.
pub type Nonce = [u8; NONCE_LEN];
/// An HMAC-SHA256 proof.
pub type Proof = [u8; PROOF_LEN];

/// The prefix of every proof.
const PROOF_LABEL: &[u8] = b"kvlease-tcp-v1 ";
/// The prefix of a session's key.
const SESSION_LABEL: &[u8] = b"kvlease-session-v1 ";

/// The key an exchange under a token gave both its sides (see the module doc): a later
/// connection of the client proves with it in the token's place.
#[derive(Clone, PartialEq, Eq)]
pub struct Session {
    key: [u8; 32],
}

impl Session {
    /// The key (the HMAC key of the proofs made with it).
    #[must_use]
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// A public name of the session: the first 8 bytes of `HMAC(key, "kvlease-session-id")`
    /// (it tells sessions apart without revealing the key).
    #[must_use]
    pub fn id(&self) -> u64 {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.key).unwrap_or_else(|_| unreachable!());
        mac.update(b"kvlease-session-id");
        let out = mac.finalize().into_bytes();
        u64::from_le_bytes([
            out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7],
        ])
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({:016x})", self.id())
    }
}

/// The role labels of one kind of connection: the client proves with `client`, the
/// server answers with `server`. Distinct labels per kind keep a proof of one kind from
/// being replayed in another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// The client's label.
    pub client: &'static [u8],
    /// The server's label.
    pub server: &'static [u8],
}

/// The TCP backend's data and notification connections.
pub const TCP_ROLES: Roles = Roles {
    client: b"client",
    server: b"server",
};

/// The shared-memory backend's Unix socket.
pub const SHM_ROLES: Roles = Roles {
    client: b"shm-client",
    server: b"shm-server",
};

/// The verbs backend's connection setup (its own exchange over the queue pair's first
/// messages; the labels are defined here with the others).
pub const VERBS_ROLES: Roles = Roles {
    client: b"verbs-client",
    server: b"verbs-server",
};

/// The side channel: D (the client) fetches P's engine info.
pub const SIDE_CHANNEL_ROLES: Roles = Roles {
    client: b"side-channel-client",
    server: b"side-channel-server",
};

/// Why a message was refused or the exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A body ended before its fields did.
    #[error("truncated handshake body")]
    Truncated,
    /// A body went on after its fields.
    #[error("trailing bytes in handshake body")]
    Trailing,
    /// A name that is not UTF-8.
    #[error("name is not UTF-8")]
    NameNotUtf8,
    /// A name over [`MAX_NAME_LEN`] bytes.
    #[error("name of {0} bytes exceeds {MAX_NAME_LEN}")]
    NameTooLong(usize),
    /// A proof length other than 0 or 32.
    #[error("proof of {0} bytes")]
    ProofLen(u8),
    /// The peer speaks this other protocol version.
    #[error("peer speaks protocol version {0}, we speak {PROTOCOL_VERSION}")]
    Version(u16),
    /// The server is called this, not the name the client expected.
    #[error("the peer is called {0:?}, not the expected name")]
    WrongName(String),
    /// The server refused the client's proof (wrong or missing token).
    #[error("the peer refused our proof (wrong or missing cluster token)")]
    Rejected,
    /// The client holds a token and the server did not prove it.
    #[error("the peer did not prove the cluster token")]
    PeerAuthFailed,
}

/// The client's first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the client.
    pub version: u16,
    /// Per-kind data: the TCP backend's connection index; 0 elsewhere.
    pub extra: u16,
    /// The client's nonce.
    pub nonce: Nonce,
    /// The client's name.
    pub name: String,
}

/// The server's answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// [`PROTOCOL_VERSION`] of the server.
    pub version: u16,
    /// Whether the server holds a token (and will prove it).
    pub auth_required: bool,
    /// The server's nonce.
    pub nonce: Nonce,
    /// The server's name.
    pub name: String,
}

/// The client's proof (none without a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProofMsg {
    /// The proof.
    pub proof: Option<Proof>,
}

/// The server's verdict on the client's proof, with its own proof when it held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthResult {
    /// Whether the client's proof held.
    pub ok: bool,
    /// The server's proof (none without a token or when the client's failed).
    pub proof: Option<Proof>,
}

/// A cursor over a body.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], AuthError> {
        if self.0.len() < n {
            return Err(AuthError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, AuthError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, AuthError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn array32(&mut self) -> Result<[u8; 32], AuthError> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32)?);
        Ok(a)
    }
    fn name(&mut self) -> Result<String, AuthError> {
        let n = usize::from(self.u16()?);
        if n > MAX_NAME_LEN {
            return Err(AuthError::NameTooLong(n));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| AuthError::NameNotUtf8)
    }
    fn proof(&mut self) -> Result<Option<Proof>, AuthError> {
        match self.u8()? {
            0 => Ok(None),
            32 => Ok(Some(self.array32()?)),
            n => Err(AuthError::ProofLen(n)),
        }
    }
    fn finish(&self) -> Result<(), AuthError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(AuthError::Trailing)
        }
    }
}

fn put_name(b: &mut Vec<u8>, name: &str) {
    // Names longer than MAX_NAME_LEN are refused where they are made (`check_name`); the
    // length is capped here so the body stays self-consistent either way.
    let bytes = &name.as_bytes()[..name.len().min(MAX_NAME_LEN)];
    #[allow(clippy::cast_possible_truncation, reason = "at most MAX_NAME_LEN")]
    b.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    b.extend_from_slice(bytes);
}

fn put_proof(b: &mut Vec<u8>, proof: Option<&Proof>) {
    match proof {
        Some(p) => {
            b.push(32);
            b.extend_from_slice(p);
        }
        None => b.push(0),
    }
}

/// The group of a client name `{group}/{worker}`: what comes before its last `/` (the
/// whole name without one). The agents name a worker `{engine}/d{rank}`, so a worker's
/// group is its engine id (which may hold `/` itself); a [`Session`] is bound to a group.
#[must_use]
pub fn name_group(name: &str) -> &str {
    name.rsplit_once('/').map_or(name, |(group, _)| group)
}

/// Whether `name` fits a hello or challenge.
///
/// # Errors
/// [`AuthError::NameTooLong`].
pub fn check_name(name: &str) -> Result<(), AuthError> {
    if name.len() > MAX_NAME_LEN {
        Err(AuthError::NameTooLong(name.len()))
    } else {
        Ok(())
    }
}

impl Hello {
    /// The body.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + 2 + NONCE_LEN + 2 + self.name.len());
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.extra.to_le_bytes());
        b.extend_from_slice(&self.nonce);
        put_name(&mut b, &self.name);
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`AuthError`] for a malformed body.
    pub fn decode(body: &[u8]) -> Result<Self, AuthError> {
        let mut r = Reader(body);
        let hello = Self {
            version: r.u16()?,
            extra: r.u16()?,
            nonce: r.array32()?,
            name: r.name()?,
        };
        r.finish()?;
        Ok(hello)
    }
}

impl Challenge {
    /// The body.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + 1 + NONCE_LEN + 2 + self.name.len());
        b.extend_from_slice(&self.version.to_le_bytes());
        b.push(u8::from(self.auth_required));
        b.extend_from_slice(&self.nonce);
        put_name(&mut b, &self.name);
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`AuthError`] for a malformed body.
    pub fn decode(body: &[u8]) -> Result<Self, AuthError> {
        let mut r = Reader(body);
        let challenge = Self {
            version: r.u16()?,
            auth_required: r.u8()? != 0,
            nonce: r.array32()?,
            name: r.name()?,
        };
        r.finish()?;
        Ok(challenge)
    }
}

impl ProofMsg {
    /// The body.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(1 + PROOF_LEN);
        put_proof(&mut b, self.proof.as_ref());
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`AuthError`] for a malformed body.
    pub fn decode(body: &[u8]) -> Result<Self, AuthError> {
        let mut r = Reader(body);
        let proof = r.proof()?;
        r.finish()?;
        Ok(Self { proof })
    }
}

impl AuthResult {
    /// The body.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + PROOF_LEN);
        b.push(u8::from(self.ok));
        put_proof(&mut b, self.proof.as_ref());
        b
    }

    /// Parses a body.
    ///
    /// # Errors
    /// [`AuthError`] for a malformed body.
    pub fn decode(body: &[u8]) -> Result<Self, AuthError> {
        let mut r = Reader(body);
        let ok = r.u8()? != 0;
        let proof = r.proof()?;
        r.finish()?;
        Ok(Self { ok, proof })
    }
}

/// The proof `"kvlease-tcp-v1 " ‖ role ‖ first ‖ second ‖ own name ‖ 0 ‖ peer name` under
/// `token`.
#[must_use]
pub fn proof(
    token: &[u8],
    role: &[u8],
    first: &Nonce,
    second: &Nonce,
    own_name: &str,
    peer_name: &str,
) -> Proof {
    bound_proof(token, role, first, second, own_name, peer_name, &[])
}

/// [`proof`], followed by `0 ‖ length u32 LE ‖ data` for each of `bound` that is not
/// empty (see "Bound data" in the module doc).
fn bound_proof(
    token: &[u8],
    role: &[u8],
    first: &Nonce,
    second: &Nonce,
    own_name: &str,
    peer_name: &str,
    bound: &[&[u8]],
) -> Proof {
    // HMAC accepts keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).unwrap_or_else(|_| unreachable!());
    mac.update(PROOF_LABEL);
    mac.update(role);
    mac.update(first);
    mac.update(second);
    mac.update(own_name.as_bytes());
    mac.update(&[0]);
    mac.update(peer_name.as_bytes());
    for data in bound.iter().filter(|d| !d.is_empty()) {
        mac.update(&[0]);
        mac.update(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_le_bytes());
        mac.update(data);
    }
    mac.finalize().into_bytes().into()
}

/// Constant-time comparison of two proofs.
#[must_use]
pub fn proofs_equal(a: &Proof, b: &Proof) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// One exchange's identities: the nonces and names of both sides, and the roles.
#[derive(Debug, Clone, Copy)]
pub struct Exchange<'a> {
    /// The kind of connection.
    pub roles: Roles,
    /// The server's nonce.
    pub server_nonce: &'a Nonce,
    /// The client's nonce.
    pub client_nonce: &'a Nonce,
    /// The client's name.
    pub client_name: &'a str,
    /// The server's name.
    pub server_name: &'a str,
    /// Data of the client's that its proof covers (empty: none).
    pub client_binding: &'a [u8],
    /// Data of the server's that its answer covers, with the client's (empty: none).
    pub server_binding: &'a [u8],
}

impl Exchange<'_> {
    /// The client's proof (`None` without a token).
    #[must_use]
    pub fn client_proof(&self, token: Option<&[u8]>) -> Option<Proof> {
        token.map(|t| {
            bound_proof(
                t,
                self.roles.client,
                self.server_nonce,
                self.client_nonce,
                self.client_name,
                self.server_name,
                &[self.client_binding],
            )
        })
    }

    /// The server's answer proof (`None` without a token).
    #[must_use]
    pub fn server_proof(&self, token: Option<&[u8]>) -> Option<Proof> {
        token.map(|t| {
            bound_proof(
                t,
                self.roles.server,
                self.client_nonce,
                self.server_nonce,
                self.server_name,
                self.client_name,
                &[self.client_binding, self.server_binding],
            )
        })
    }

    /// The session this exchange gives both sides (`None` without a token).
    #[must_use]
    pub fn session(&self, token: Option<&[u8]>) -> Option<Session> {
        token.map(|t| {
            let mut mac =
                <Hmac<Sha256> as Mac>::new_from_slice(t).unwrap_or_else(|_| unreachable!());
            mac.update(SESSION_LABEL);
            mac.update(self.roles.client);
            mac.update(self.server_nonce);
            mac.update(self.client_nonce);
            mac.update(self.client_name.as_bytes());
            mac.update(&[0]);
            mac.update(self.server_name.as_bytes());
            Session {
                key: mac.finalize().into_bytes().into(),
            }
        })
    }

    /// Server side: whether the client's `given` proof holds (always, without a token)
    /// and, when it does, the answer proof to send back.
    #[must_use]
    pub fn check_client(
        &self,
        token: Option<&[u8]>,
        given: Option<Proof>,
    ) -> (bool, Option<Proof>) {
        match self.client_proof(token) {
            None => (true, None),
            Some(want) => {
                let ok = given.is_some_and(|p| proofs_equal(&p, &want));
                (ok, ok.then(|| self.server_proof(token)).flatten())
            }
        }
    }

    /// Client side: whether the server's `given` answer proof holds (`false` without a
    /// token: nothing to check).
    #[must_use]
    pub fn check_server(&self, token: Option<&[u8]>, given: Option<Proof>) -> bool {
        match (self.server_proof(token), given) {
            (Some(want), Some(got)) => proofs_equal(&got, &want),
            _ => false,
        }
    }
}

/// The client's half, before the challenge: [`ClientAuth::hello`] is the first body to
/// send, [`ClientAuth::on_challenge`] takes the server's answer.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    roles: Roles,
    extra: u16,
    nonce: Nonce,
    name: String,
    token: Option<Vec<u8>>,
    expected: Option<String>,
    binding: Vec<u8>,
}

/// The client's half after its proof: [`ClientProved::on_result`] takes the server's
/// verdict.
#[derive(Debug, Clone)]
pub struct ClientProved {
    roles: Roles,
    client_nonce: Nonce,
    server_nonce: Nonce,
    name: String,
    server_name: String,
    token: Option<Vec<u8>>,
    auth_required: bool,
    binding: Vec<u8>,
}

impl ClientAuth {
    /// A client called `name` with `nonce` (fresh, random), holding `token`; with
    /// `expected`, the server must be called that.
    #[must_use]
    pub fn new(
        roles: Roles,
        extra: u16,
        nonce: Nonce,
        name: &str,
        token: Option<&[u8]>,
        expected: Option<&str>,
    ) -> Self {
        Self {
            roles,
            extra,
            nonce,
            name: name.to_owned(),
            token: token.map(<[u8]>::to_vec),
            expected: expected.map(str::to_owned),
            binding: Vec::new(),
        }
    }

    /// The client's proof also covers `data` (see "Bound data" in the module doc); the
    /// server must check it with the same data ([`AwaitingProof::check`]).
    #[must_use]
    pub fn with_binding(mut self, data: &[u8]) -> Self {
        self.binding = data.to_vec();
        self
    }

    /// The [`Hello`] body to send first.
    #[must_use]
    pub fn hello(&self) -> Vec<u8> {
        Hello {
            version: PROTOCOL_VERSION,
            extra: self.extra,
            nonce: self.nonce,
            name: self.name.clone(),
        }
        .encode()
    }

    /// Takes the server's [`Challenge`] body; returns the [`ProofMsg`] body to send.
    ///
    /// # Errors
    /// A malformed body, [`AuthError::Version`], [`AuthError::WrongName`].
    pub fn on_challenge(self, body: &[u8]) -> Result<(ClientProved, Vec<u8>), AuthError> {
        let c = Challenge::decode(body)?;
        if c.version != PROTOCOL_VERSION {
            return Err(AuthError::Version(c.version));
        }
        if self.expected.as_ref().is_some_and(|e| *e != c.name) {
            return Err(AuthError::WrongName(c.name));
        }
        let proved = ClientProved {
            roles: self.roles,
            client_nonce: self.nonce,
            server_nonce: c.nonce,
            name: self.name,
            server_name: c.name,
            token: self.token,
            auth_required: c.auth_required,
            binding: self.binding,
        };
        let proof = proved.exchange(&[]).client_proof(proved.token.as_deref());
        Ok((proved, ProofMsg { proof }.encode()))
    }
}

impl ClientProved {
    fn exchange<'a>(&'a self, server_binding: &'a [u8]) -> Exchange<'a> {
        Exchange {
            roles: self.roles,
            server_nonce: &self.server_nonce,
            client_nonce: &self.client_nonce,
            client_name: &self.name,
            server_name: &self.server_name,
            client_binding: &self.binding,
            server_binding,
        }
    }

    /// The server's name, as its challenge gave it (proven only once
    /// [`ClientProved::on_result`] succeeded with a token).
    #[must_use]
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// The session this exchange gives (`None` without a token); it is the server's only
    /// once [`ClientProved::on_result`] succeeded.
    #[must_use]
    pub fn session(&self) -> Option<Session> {
        self.exchange(&[]).session(self.token.as_deref())
    }

    /// Takes the server's [`AuthResult`] body; returns the server's name.
    ///
    /// # Errors
    /// A malformed body; [`AuthError::Rejected`] when the server refused our proof;
    /// [`AuthError::PeerAuthFailed`] when we hold a token and the server did not prove it.
    pub fn on_result(self, body: &[u8]) -> Result<String, AuthError> {
        self.on_result_bound(body, &[])
    }

    /// [`on_result`](Self::on_result) for an exchange whose server answer also covers
    /// the server's `data` (and the client's, [`ClientAuth::with_binding`]).
    ///
    /// # Errors
    /// As [`on_result`](Self::on_result); [`AuthError::PeerAuthFailed`] also when `data`
    /// is not what the server proved.
    pub fn on_result_bound(self, body: &[u8], data: &[u8]) -> Result<String, AuthError> {
        let r = AuthResult::decode(body)?;
        if !r.ok {
            return Err(AuthError::Rejected);
        }
        let token = self.token.as_deref();
        if token.is_some()
            && (!self.auth_required || !self.exchange(data).check_server(token, r.proof))
        {
            return Err(AuthError::PeerAuthFailed);
        }
        Ok(self.server_name)
    }
}

/// The server's half, before the hello.
#[derive(Debug, Clone)]
pub struct ServerAuth {
    roles: Roles,
    nonce: Nonce,
    name: String,
    token: Option<Vec<u8>>,
}

/// The server's half once a hello arrived: send [`Challenged::reply`] (always, even to a
/// client of another version: it sees ours and gives up), then
/// [`Challenged::into_waiting`].
#[derive(Debug, Clone)]
pub struct Challenged {
    /// The [`Challenge`] body to send.
    pub reply: Vec<u8>,
    /// The client's hello.
    pub hello: Hello,
    server: ServerAuth,
}

/// The server's half waiting for the client's proof.
#[derive(Debug, Clone)]
pub struct AwaitingProof {
    hello: Hello,
    server: ServerAuth,
}

/// The server's verdict on the client's proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the client proved the token (always, without a token).
    pub ok: bool,
    /// The client's name (proven when `ok` and the server holds a token).
    pub client_name: String,
    /// The client's [`Hello::extra`].
    pub extra: u16,
    /// The [`AuthResult`] body to send.
    pub reply: Vec<u8>,
    /// When the proof held under a token: the session this exchange gives (see the
    /// module doc). A proof checked under a session's key gives none.
    pub session: Option<Session>,
}

impl ServerAuth {
    /// A server called `name` with `nonce` (fresh, random), holding `token`.
    #[must_use]
    pub fn new(roles: Roles, nonce: Nonce, name: &str, token: Option<&[u8]>) -> Self {
        Self {
            roles,
            nonce,
            name: name.to_owned(),
            token: token.map(<[u8]>::to_vec),
        }
    }

    /// Takes the client's [`Hello`] body.
    ///
    /// # Errors
    /// A malformed body.
    pub fn on_hello(self, body: &[u8]) -> Result<Challenged, AuthError> {
        let hello = Hello::decode(body)?;
        let reply = Challenge {
            version: PROTOCOL_VERSION,
            auth_required: self.token.is_some(),
            nonce: self.nonce,
            name: self.name.clone(),
        }
        .encode();
        Ok(Challenged {
            reply,
            hello,
            server: self,
        })
    }
}

impl Challenged {
    /// After the reply went out: the client speaks our version.
    ///
    /// # Errors
    /// [`AuthError::Version`].
    pub fn into_waiting(self) -> Result<AwaitingProof, AuthError> {
        if self.hello.version != PROTOCOL_VERSION {
            return Err(AuthError::Version(self.hello.version));
        }
        Ok(AwaitingProof {
            hello: self.hello,
            server: self.server,
        })
    }
}

impl AwaitingProof {
    /// The client's hello.
    #[must_use]
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Takes the client's [`ProofMsg`] body: the verdict, with the [`AuthResult`] body
    /// to send either way.
    ///
    /// # Errors
    /// A malformed body.
    pub fn on_proof(self, body: &[u8]) -> Result<Verdict, AuthError> {
        self.on_proof_keyed(body, None)
    }

    /// Like [`on_proof`](Self::on_proof), but with `session`, the client's proof and the
    /// answer's are checked and made under the session's key instead of the token: the
    /// proof holds only for the party that ran the exchange that gave the session. A
    /// server without a token ignores `session`.
    ///
    /// # Errors
    /// A malformed body.
    pub fn on_proof_keyed(
        self,
        body: &[u8],
        session: Option<&Session>,
    ) -> Result<Verdict, AuthError> {
        let checked = self.check(body, session, &[])?;
        let reply = checked.reply(&[]);
        Ok(Verdict {
            ok: checked.ok,
            reply,
            session: checked.session(),
            client_name: checked.hello.name,
            extra: checked.hello.extra,
        })
    }

    /// Checks the client's [`ProofMsg`] body (under `session`'s key, as
    /// [`on_proof_keyed`](Self::on_proof_keyed), and covering the client's bound `data`,
    /// [`ClientAuth::with_binding`]); the [`AuthResult`] to send comes from
    /// [`Checked::reply`], which may cover the server's own data, made after this check.
    ///
    /// # Errors
    /// A malformed body.
    pub fn check(
        self,
        body: &[u8],
        session: Option<&Session>,
        data: &[u8],
    ) -> Result<Checked, AuthError> {
        let given = ProofMsg::decode(body)?.proof;
        let token = self.server.token.clone();
        let key = match (session, &token) {
            (Some(session), Some(_)) => Some(session.key().to_vec()),
            _ => token.clone(),
        };
        let mut checked = Checked {
            ok: false,
            key,
            token,
            bound_session: session.is_some(),
            client_binding: data.to_vec(),
            hello: self.hello,
            server: self.server,
        };
        let want = checked.exchange(&[]).client_proof(checked.key.as_deref());
        checked.ok = match want {
            None => true,
            Some(want) => given.is_some_and(|p| proofs_equal(&p, &want)),
        };
        Ok(checked)
    }
}

/// The server's half after checking the client's proof ([`AwaitingProof::check`]).
#[derive(Debug, Clone)]
pub struct Checked {
    /// Whether the client's proof held (always, without a token).
    pub ok: bool,
    /// The key the proofs are made under (the token, or a session's key).
    key: Option<Vec<u8>>,
    token: Option<Vec<u8>>,
    bound_session: bool,
    client_binding: Vec<u8>,
    hello: Hello,
    server: ServerAuth,
}

impl Checked {
    fn exchange<'a>(&'a self, server_binding: &'a [u8]) -> Exchange<'a> {
        Exchange {
            roles: self.server.roles,
            server_nonce: &self.server.nonce,
            client_nonce: &self.hello.nonce,
            client_name: &self.hello.name,
            server_name: &self.server.name,
            client_binding: &self.client_binding,
            server_binding,
        }
    }

    /// The client's hello.
    #[must_use]
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The [`AuthResult`] body to send: the verdict and, when the proof held under a
    /// token, the server's proof, covering the client's bound data and the server's own
    /// `data` (empty: none).
    #[must_use]
    pub fn reply(&self, data: &[u8]) -> Vec<u8> {
        let proof = if self.ok {
            self.exchange(data).server_proof(self.key.as_deref())
        } else {
            None
        };
        AuthResult { ok: self.ok, proof }.encode()
    }

    /// The session this exchange gives (a proof that held under the token; none under a
    /// session's key).
    #[must_use]
    pub fn session(&self) -> Option<Session> {
        if self.ok && !self.bound_session {
            self.exchange(&[]).session(self.token.as_deref())
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs a whole exchange; the client's outcome and the server's verdict.
    fn run(
        roles: (Roles, Roles),
        client_token: Option<&[u8]>,
        server_token: Option<&[u8]>,
    ) -> (Result<String, AuthError>, bool) {
        let client = ClientAuth::new(roles.0, 7, [1; 32], "d0", client_token, Some("p0"));
        let server = ServerAuth::new(roles.1, [2; 32], "p0", server_token);
        let challenged = server.on_hello(&client.hello()).expect("hello");
        assert_eq!(challenged.hello.extra, 7);
        let waiting = challenged.clone().into_waiting().expect("version");
        let (proved, proof) = client.on_challenge(&challenged.reply).expect("challenge");
        let verdict = waiting.on_proof(&proof).expect("proof");
        assert_eq!(verdict.client_name, "d0");
        (proved.on_result(&verdict.reply), verdict.ok)
    }

    #[test]
    fn matching_tokens_prove_both_ways() {
        let t = Some(&b"s3cret"[..]);
        assert_eq!(run((TCP_ROLES, TCP_ROLES), t, t), (Ok("p0".into()), true));
        assert_eq!(
            run((TCP_ROLES, TCP_ROLES), None, None),
            (Ok("p0".into()), true)
        );
    }

    #[test]
    fn mismatches_fail_on_the_side_that_holds_a_token() {
        let t = Some(&b"s3cret"[..]);
        let w = Some(&b"wrong"[..]);
        let r = (SIDE_CHANNEL_ROLES, SIDE_CHANNEL_ROLES);
        assert_eq!(run(r, w, t), (Err(AuthError::Rejected), false));
        assert_eq!(run(r, None, t), (Err(AuthError::Rejected), false));
        assert_eq!(run(r, t, None), (Err(AuthError::PeerAuthFailed), true));
    }

    #[test]
    fn a_proof_of_one_kind_is_worthless_in_another() {
        let t = Some(&b"s3cret"[..]);
        assert_eq!(
            run((TCP_ROLES, SHM_ROLES), t, t),
            (Err(AuthError::Rejected), false)
        );
        assert_eq!(
            run((SIDE_CHANNEL_ROLES, TCP_ROLES), t, t),
            (Err(AuthError::Rejected), false)
        );
        let all = [TCP_ROLES, SHM_ROLES, VERBS_ROLES, SIDE_CHANNEL_ROLES];
        for (i, a) in all.iter().enumerate() {
            assert_ne!(a.client, a.server);
            for b in &all[i + 1..] {
                for x in [a.client, a.server] {
                    assert!(x != b.client && x != b.server);
                }
            }
        }
    }

    /// An exchange up to the client's proof: the client after it, the server waiting for
    /// it, and the proof body.
    fn up_to_the_proof(
        client: ClientAuth,
        server: ServerAuth,
    ) -> (ClientProved, AwaitingProof, Vec<u8>) {
        let challenged = server.on_hello(&client.hello()).expect("hello");
        let (proved, proof) = client.on_challenge(&challenged.reply).expect("challenge");
        (proved, challenged.into_waiting().expect("version"), proof)
    }

    #[test]
    fn a_session_stands_in_for_the_token_only_for_its_own_party() {
        let t = Some(&b"s3cret"[..]);
        // The exchange that gives the session: both sides compute the same one.
        let (proved, waiting, proof) = up_to_the_proof(
            ClientAuth::new(SIDE_CHANNEL_ROLES, 0, [1; 32], "vic", t, Some("p0")),
            ServerAuth::new(SIDE_CHANNEL_ROLES, [2; 32], "p0", t),
        );
        let verdict = waiting.on_proof(&proof).expect("proof");
        let session = verdict.session.expect("a session under a token");
        assert_eq!(proved.session(), Some(session.clone()));
        assert_eq!(
            format!("{session:?}"),
            format!("Session({:016x})", session.id())
        );
        // A later connection: the session's key in the token's place holds...
        let run = |client_key: Option<&[u8]>, bound: Option<&Session>| {
            let (c, waiting, proof) = up_to_the_proof(
                ClientAuth::new(TCP_ROLES, 0, [3; 32], "vic/d0", client_key, Some("p0/p0")),
                ServerAuth::new(TCP_ROLES, [4; 32], "p0/p0", t),
            );
            let v = waiting.on_proof_keyed(&proof, bound).expect("proof");
            (c.on_result(&v.reply).is_ok(), v.ok, v.session.is_some())
        };
        assert_eq!(
            run(Some(session.key()), Some(&session)),
            (true, true, false)
        );
        // ...the token does not, for a name the server holds a session for...
        assert_eq!(run(t, Some(&session)), (false, false, false));
        // ...nor does another exchange's session; without one, the token holds as before.
        let other = ClientAuth::new(SIDE_CHANNEL_ROLES, 0, [9; 32], "vic", t, Some("p0"))
            .on_challenge(&challenged_reply(t))
            .expect("challenge")
            .0
            .session()
            .expect("session");
        assert_ne!(other, session);
        assert_eq!(
            run(Some(other.key()), Some(&session)),
            (false, false, false)
        );
        assert_eq!(run(t, None), (true, true, true));
    }

    fn challenged_reply(t: Option<&[u8]>) -> Vec<u8> {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            extra: 0,
            nonce: [9; 32],
            name: "vic".into(),
        };
        ServerAuth::new(SIDE_CHANNEL_ROLES, [8; 32], "p0", t)
            .on_hello(&hello.encode())
            .expect("hello")
            .reply
    }

    /// Data bound into the exchange (the verbs backend's queue-pair info): the client's
    /// proof holds only with the client's data, the server's answer only with both sides'.
    #[test]
    fn bound_data_changed_on_the_way_fails_the_proof() {
        let t = Some(&b"s3cret"[..]);
        let run = |sent: &[u8], seen: &[u8], answered: &[u8], received: &[u8]| {
            let (proved, waiting, proof) = up_to_the_proof(
                ClientAuth::new(VERBS_ROLES, 0, [1; 32], "d/d0", t, Some("p/p0"))
                    .with_binding(sent),
                ServerAuth::new(VERBS_ROLES, [2; 32], "p/p0", t),
            );
            let checked = waiting.check(&proof, None, seen).expect("proof");
            let reply = checked.reply(answered);
            (checked.ok, proved.on_result_bound(&reply, received).is_ok())
        };
        assert_eq!(run(b"qp-d", b"qp-d", b"qp-p", b"qp-p"), (true, true));
        // The client's info swapped before the server saw it.
        assert_eq!(run(b"qp-d", b"qp-x", b"qp-p", b"qp-p"), (false, false));
        // The server's info swapped before the client saw it.
        assert_eq!(run(b"qp-d", b"qp-d", b"qp-p", b"qp-x"), (true, false));
        // No data at all: the plain exchange's proofs.
        let plain = proof(b"k", b"r", &[1; 32], &[2; 32], "a", "b");
        assert_eq!(
            plain,
            bound_proof(b"k", b"r", &[1; 32], &[2; 32], "a", "b", &[b"", b""])
        );
        assert_ne!(
            plain,
            bound_proof(b"k", b"r", &[1; 32], &[2; 32], "a", "b", &[b"x"])
        );
    }

    #[test]
    fn a_name_belongs_to_the_group_before_its_last_slash() {
        assert_eq!(name_group("vic/d0"), "vic");
        assert_eq!(name_group("a/b/d0"), "a/b");
        assert_eq!(name_group("vic"), "vic");
        assert_eq!(name_group("/d0"), "");
    }

    #[test]
    fn the_client_checks_the_server_name_and_version() {
        let client = ClientAuth::new(TCP_ROLES, 0, [1; 32], "d0", None, Some("p0"));
        let other = Challenge {
            version: PROTOCOL_VERSION,
            auth_required: false,
            nonce: [3; 32],
            name: "p1".into(),
        };
        assert_eq!(
            client.clone().on_challenge(&other.encode()).map(|_| ()),
            Err(AuthError::WrongName("p1".into()))
        );
        let newer = Challenge {
            version: 2,
            name: "p0".into(),
            ..other
        };
        assert_eq!(
            client.on_challenge(&newer.encode()).map(|_| ()),
            Err(AuthError::Version(2))
        );
        let hello = Hello {
            version: 9,
            extra: 0,
            nonce: [0; 32],
            name: "d".into(),
        };
        let challenged = ServerAuth::new(TCP_ROLES, [2; 32], "p0", None)
            .on_hello(&hello.encode())
            .expect("a well-formed hello is answered");
        assert_eq!(
            Challenge::decode(&challenged.reply).map(|c| c.version),
            Ok(PROTOCOL_VERSION)
        );
        assert_eq!(
            challenged.into_waiting().map(|_| ()),
            Err(AuthError::Version(9))
        );
    }

    /// The wire bytes are the TCP backend's since its first version.
    #[test]
    fn bodies_keep_their_bytes() {
        let hello = Hello {
            version: 1,
            extra: 0xffff,
            nonce: [0xab; 32],
            name: "ab".into(),
        };
        let mut want = vec![1, 0, 0xff, 0xff];
        want.extend_from_slice(&[0xab; 32]);
        want.extend_from_slice(&[2, 0, b'a', b'b']);
        assert_eq!(hello.encode(), want);
        assert_eq!(
            AuthResult {
                ok: true,
                proof: None
            }
            .encode(),
            vec![1, 0]
        );
        assert_eq!(ProofMsg { proof: None }.encode(), vec![0]);
        assert_eq!(ProofMsg::decode(&[5]), Err(AuthError::ProofLen(5)));
        assert_eq!(ProofMsg::decode(&[0, 0]), Err(AuthError::Trailing));
        assert_eq!(AuthResult::decode(&[1]), Err(AuthError::Truncated));
    }

    proptest! {
        #[test]
        fn bodies_round_trip(
            version: u16, extra: u16, nonce: [u8; 32], name in "[a-z0-9/]{0,40}",
            ok: bool, proof: Option<[u8; 32]>,
        ) {
            let h = Hello { version, extra, nonce, name: name.clone() };
            prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
            let c = Challenge { version, auth_required: ok, nonce, name };
            prop_assert_eq!(Challenge::decode(&c.encode()), Ok(c));
            let p = ProofMsg { proof };
            prop_assert_eq!(ProofMsg::decode(&p.encode()), Ok(p));
            let r = AuthResult { ok, proof };
            prop_assert_eq!(AuthResult::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Hello::decode(&bytes);
            let _ = Challenge::decode(&bytes);
            let _ = ProofMsg::decode(&bytes);
            let _ = AuthResult::decode(&bytes);
        }
    }
}
