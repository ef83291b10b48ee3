//! The TCP backend's wire format.
//!
//! Every frame is `[type: u8][body_len: u32 LE][body]`, integers little-endian. A
//! `READ_RESP` body is followed by its payload (`len` raw bytes, not counted in
//! `body_len`), which the reader receives straight into the destination region. A
//! `WRITE_REQ` body is followed by its payload the same way (at most [`MAX_WRITE_LEN`]
//! bytes): the receiver takes it into a bounded buffer of the connection and lands it
//! only after all of it arrived, under the write-fence lock (see `server`). Writes
//! travel on the writer's data connections, which the receiver serves as it serves
//! reads; their answers come back on the same connection.
//!
//! | type | dir | body |
//! | --- | --- | --- |
//! | 1 `HELLO` | D→P | version u16, conn index u16 ([`NOTIF_CONN_INDEX`]: the notification connection), 32-byte nonce, name len u16, name |
//! | 2 `CHALLENGE` | P→D | version u16, auth required u8, 32-byte nonce, name len u16, name |
//! | 3 `PROOF` | D→P | proof len u8 (0 or 32), proof |
//! | 4 `AUTH_RESULT` | P→D | ok u8, proof len u8 (0 or 32), proof |
//! | 5 `READ_REQ` | D→P | req id u64, region u64, key u64, offset u64, len u64 |
//! | 6 `READ_RESP` | P→D | req id u64, len u64, then `len` payload bytes |
//! | 7 `READ_ERR` | P→D | req id u64, refusal code u8 |
//! | 8 `NOTIF` | D→P | the notification bytes (on the notification connection) |
//! | 9 `SHM_REGION` | P→D | region u64, key u64, len u64, grant slot u64; one memfd attached (`SCM_RIGHTS`) |
//! | 10 `SHM_END` | P→D | empty: no more regions |
//! | 11 `SHM_RING` | P→D | capacity u64, largest record u64; one memfd attached: D's notification ring to P |
//! | 12 `SHM_GRANTS` | P→D | len u64; one memfd attached: P's grant table (slot → registered region id, 0 once deregistered) |
//! | 13 `SHM_CUDA_REGION` | P→D | region u64, key u64, len u64, grant slot u64, CUDA IPC handle (112 bytes); no descriptor |
//! | 14 `SHM_CMA_REGION` | P→D | region u64, key u64, len u64, grant slot u64, address u64 in P's process; no descriptor: D reads it with `process_vm_readv` |
//! | 15 `VERBS_INFO` | both | a queue pair's connection info (40 bytes) |
//! | 16 `VERBS_REFUSE` | P→D | why P gives no queue pair (UTF-8, at most 1 KiB) |
//! | 17 `VERBS_RESET` | D→P | D's connection info after a queue-pair reset |
//! | 18 `WRITE_REQ` | P→D | req id u64, region u64, key u64, offset u64, len u64, fence region u64, fence key u64, fence offset u64, expected generation u64, then `len` payload bytes |
//! | 19 `WRITE_ACK` | D→P | req id u64: every byte of the write landed |
//! | 20 `WRITE_ERR` | D→P | req id u64, refusal code u8: no byte of the write landed (code 7: the fence no longer holds the generation) |
//! | 21 `SHM_WRITE_SRC` | P→D | source id u64, len u64; one memfd attached: a region of the writer's that the receiver maps read-only to pull writes from |
//! | 22 `WRITE_PULL` | P→D | req id u64, source id u64, source offset u64, region u64, key u64, offset u64, len u64, fence region u64, fence key u64, fence offset u64, expected generation u64; no payload: the receiver copies `len` bytes from the source |
//! | 23 `SHM_WRITE_CMA_SRC` | P→D | source id u64, len u64, address u64 in the writer's process; no descriptor: a region of the writer's that is not memfd-backed, which the receiver reads with `process_vm_readv` to pull writes from (a refused read answers the write with code 8) |
//!
//! "D→P" is the connecting side to the accepting one: P connects to D as well to send
//! it notifications. The connecting side opens `num_connections` data connections
//! (indices 0..) and one notification connection, whose `HELLO` carries the index
//! [`NOTIF_CONN_INDEX`] and which, after the same handshake, carries only `NOTIF` frames
//! (see `tcp::notif`). A server that does not know the index serves it as a data
//! connection, whose `NOTIF` frames it delivers too; both ends stay compatible.
//!
//! Types 9 to 14 and 21 to 23 travel only on the shared-memory backend's Unix socket, after the same
//! HELLO / CHALLENGE / PROOF / AUTH_RESULT exchange with the roles `shm-client` and
//! `shm-server` in the proofs (see the `shm` module). Types 15 to 17 travel only on the
//! verbs backend's queue-pair side channel, whose exchange binds the infos into the proofs
//! (roles `verbs-client` and `verbs-server`; see `verbs::link`).
//!
//! The bodies of types 1 to 4, the proofs and their role labels are
//! `kvlease_proto::auth`'s, the one exchange every kvlease connection runs: the client
//! proves `"kvlease-tcp-v1 client" ‖ server nonce ‖ client nonce ‖ client name ‖ 0 ‖
//! server name`, the server answers with `"kvlease-tcp-v1 server" ‖ client nonce ‖
//! server nonce ‖ server name ‖ 0 ‖ client name`. Both nonces are fresh per connection,
//! so a recorded proof is worthless on another connection. This module keeps the frame
//! header and the frames of the other types.

use std::io::{self, Read, Write};

use kvlease_proto::auth::{self, AuthError, ClientAuth, Roles};

pub(crate) use kvlease_proto::auth::{Nonce, PROTOCOL_VERSION};

pub(crate) const HELLO: u8 = 1;
pub(crate) const CHALLENGE: u8 = 2;
pub(crate) const PROOF: u8 = 3;
pub(crate) const AUTH_RESULT: u8 = 4;
pub(crate) const READ_REQ: u8 = 5;
pub(crate) const READ_RESP: u8 = 6;
pub(crate) const READ_ERR: u8 = 7;
pub(crate) const NOTIF: u8 = 8;
pub(crate) const SHM_REGION: u8 = 9;
pub(crate) const SHM_END: u8 = 10;
pub(crate) const SHM_RING: u8 = 11;
pub(crate) const SHM_GRANTS: u8 = 12;
/// The `HELLO` connection index that marks the notification connection.
pub(crate) const NOTIF_CONN_INDEX: u16 = u16::MAX;
/// A CUDA device region handed over as a CUDA IPC handle (no descriptor attached).
pub(crate) const SHM_CUDA_REGION: u8 = 13;
/// A host region that is not memfd-backed, handed over as its address in P's process
/// (no descriptor attached): D reads it with cross-memory attach.
pub(crate) const SHM_CMA_REGION: u8 = 14;
/// A queue pair's connection info (the verbs side channel).
#[cfg(feature = "verbs")]
pub(crate) const VERBS_INFO: u8 = 15;
/// P gives no queue pair, and says why (the verbs side channel).
#[cfg(feature = "verbs")]
pub(crate) const VERBS_REFUSE: u8 = 16;
/// D's connection info after a queue-pair reset (the verbs side channel).
#[cfg(feature = "verbs")]
pub(crate) const VERBS_RESET: u8 = 17;
/// Body of a `SHM_REGION`.
pub(crate) const SHM_REGION_LEN: usize = 32;
/// Body of a `SHM_CMA_REGION`: id, key, length, grant slot, address (u64 each).
pub(crate) const SHM_CMA_REGION_LEN: usize = 40;
/// Body of a `SHM_GRANTS`.
pub(crate) const SHM_GRANTS_LEN: usize = 8;
/// Body of a `SHM_RING`.
pub(crate) const SHM_RING_LEN: usize = 16;
/// Body of a `SHM_CUDA_REGION`: id, key, length, grant slot (u64 each), then the
/// `kvlease_gpu_mem::cuda::ipc::IpcHandle` wire form (112 bytes; a test checks it).
pub(crate) const SHM_CUDA_REGION_LEN: usize = 32 + 112;

/// A fenced write with its payload (the writer's data connection).
pub(crate) const WRITE_REQ: u8 = 18;
/// Every byte of a write landed.
pub(crate) const WRITE_ACK: u8 = 19;
/// A write refused, nothing of it landed.
pub(crate) const WRITE_ERR: u8 = 20;
/// Body of a `WRITE_REQ` (before the payload).
pub(crate) const WRITE_REQ_LEN: usize = 72;
/// Body of a `WRITE_ACK`.
pub(crate) const WRITE_ACK_LEN: usize = 8;
/// Body of a `WRITE_ERR`.
pub(crate) const WRITE_ERR_LEN: usize = 9;
/// A writer's memfd-backed region, handed to the receiver to pull writes from (the shm
/// socket, after the hand-over).
pub(crate) const SHM_WRITE_SRC: u8 = 21;
/// A fenced write the receiver pulls from a region handed over with `SHM_WRITE_SRC`.
pub(crate) const WRITE_PULL: u8 = 22;
/// Body of a `SHM_WRITE_SRC`: source id, length.
pub(crate) const SHM_WRITE_SRC_LEN: usize = 16;
/// Body of a `WRITE_PULL`.
pub(crate) const WRITE_PULL_LEN: usize = 88;
/// A writer's region that is not memfd-backed, named by its address, for the receiver
/// to pull writes from with cross-memory attach (the shm socket, after the hand-over).
pub(crate) const SHM_WRITE_CMA_SRC: u8 = 23;
/// Body of a `SHM_WRITE_CMA_SRC`: source id, length, address.
pub(crate) const SHM_WRITE_CMA_SRC_LEN: usize = 24;
/// The largest write payload in one frame: the receiver buffers one write per
/// connection before it lands, so this bounds that buffer. The writer cuts ops into
/// chunks of at most this.
pub(crate) const MAX_WRITE_LEN: u64 = 16 << 20;

/// Header bytes.
pub(crate) const HEADER_LEN: usize = 5;
/// Body of a `READ_REQ`.
pub(crate) const READ_REQ_LEN: usize = 40;
/// Body of a `READ_RESP` (before the payload).
pub(crate) const READ_RESP_LEN: usize = 16;
/// Body of a `READ_ERR`.
pub(crate) const READ_ERR_LEN: usize = 9;
/// Largest control body besides notifications (HELLO with a 64 KiB name is refused).
pub(crate) const MAX_CONTROL_BODY: usize = auth::MAX_BODY;

/// A frame that breaks the format: the connection is closed and the event counted.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    #[error("connection IO failed")]
    Io(#[from] io::Error),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// A malformed handshake body (or a peer of another version) breaks the format.
impl From<AuthError> for FrameError {
    fn from(e: AuthError) -> Self {
        Self::Malformed(e.to_string())
    }
}

/// Reads one header, checking the type against `allowed` and the length against `max`.
pub(crate) fn read_header(
    r: &mut impl Read,
    allowed: &[u8],
    max_body: impl Fn(u8) -> usize,
) -> Result<(u8, usize), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let ty = h[0];
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if !allowed.contains(&ty) {
        return Err(FrameError::Malformed(format!("unexpected frame type {ty}")));
    }
    let max = max_body(ty);
    if len > max {
        return Err(FrameError::Malformed(format!(
            "frame type {ty} body of {len} bytes exceeds {max}"
        )));
    }
    Ok((ty, len))
}

pub(crate) fn header(ty: u8, body_len: usize) -> [u8; HEADER_LEN] {
    // Bodies are bounded by the limits (all far below 4 GiB) before a header is built.
    let l = u32::try_from(body_len).unwrap_or(u32::MAX).to_le_bytes();
    [ty, l[0], l[1], l[2], l[3]]
}

pub(crate) fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + body.len());
    v.extend_from_slice(&header(ty, body.len()));
    v.extend_from_slice(body);
    v
}

/// A cursor over a body that reports truncation as a malformed frame.
pub(crate) struct Body<'a>(pub(crate) &'a [u8]);

impl Body<'_> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&[u8], FrameError> {
        if self.0.len() < n {
            return Err(FrameError::Malformed("truncated frame body".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u64(&mut self) -> Result<u64, FrameError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn finish(&self) -> Result<(), FrameError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Malformed("trailing bytes in frame body".into()))
        }
    }
}

pub(crate) fn read_body(r: &mut impl Read, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut b = vec![0u8; len];
    r.read_exact(&mut b)?;
    Ok(b)
}

pub(crate) fn read_req(
    req: u64,
    region: u64,
    key: u64,
    offset: u64,
    len: u64,
) -> [u8; HEADER_LEN + READ_REQ_LEN] {
    let mut f = [0u8; HEADER_LEN + READ_REQ_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(READ_REQ, READ_REQ_LEN));
    for (i, v) in [req, region, key, offset, len].into_iter().enumerate() {
        f[HEADER_LEN + 8 * i..HEADER_LEN + 8 * (i + 1)].copy_from_slice(&v.to_le_bytes());
    }
    f
}

pub(crate) fn read_resp_header(req: u64, len: u64) -> [u8; HEADER_LEN + READ_RESP_LEN] {
    let mut f = [0u8; HEADER_LEN + READ_RESP_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(READ_RESP, READ_RESP_LEN));
    f[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&req.to_le_bytes());
    f[HEADER_LEN + 8..].copy_from_slice(&len.to_le_bytes());
    f
}

pub(crate) fn read_err(req: u64, code: u8) -> [u8; HEADER_LEN + READ_ERR_LEN] {
    let mut f = [0u8; HEADER_LEN + READ_ERR_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(READ_ERR, READ_ERR_LEN));
    f[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&req.to_le_bytes());
    f[HEADER_LEN + 8] = code;
    f
}

/// A `WRITE_REQ` header and body (the payload follows it): `dest` is (region, key,
/// offset), `fence` is (region, key, offset, expected generation).
pub(crate) fn write_req(
    req: u64,
    dest: (u64, u64, u64),
    len: u64,
    fence: (u64, u64, u64, u64),
) -> [u8; HEADER_LEN + WRITE_REQ_LEN] {
    let mut f = [0u8; HEADER_LEN + WRITE_REQ_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(WRITE_REQ, WRITE_REQ_LEN));
    let words = [
        req, dest.0, dest.1, dest.2, len, fence.0, fence.1, fence.2, fence.3,
    ];
    for (i, v) in words.into_iter().enumerate() {
        f[HEADER_LEN + 8 * i..HEADER_LEN + 8 * (i + 1)].copy_from_slice(&v.to_le_bytes());
    }
    f
}

/// A `WRITE_PULL` frame: `src` is (source id, offset), `dest` (region, key, offset),
/// `fence` (region, key, offset, expected generation).
pub(crate) fn write_pull(
    req: u64,
    src: (u64, u64),
    dest: (u64, u64, u64),
    len: u64,
    fence: (u64, u64, u64, u64),
) -> [u8; HEADER_LEN + WRITE_PULL_LEN] {
    let mut f = [0u8; HEADER_LEN + WRITE_PULL_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(WRITE_PULL, WRITE_PULL_LEN));
    let words = [
        req, src.0, src.1, dest.0, dest.1, dest.2, len, fence.0, fence.1, fence.2, fence.3,
    ];
    for (i, v) in words.into_iter().enumerate() {
        f[HEADER_LEN + 8 * i..HEADER_LEN + 8 * (i + 1)].copy_from_slice(&v.to_le_bytes());
    }
    f
}

pub(crate) fn write_ack(req: u64) -> [u8; HEADER_LEN + WRITE_ACK_LEN] {
    let mut f = [0u8; HEADER_LEN + WRITE_ACK_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(WRITE_ACK, WRITE_ACK_LEN));
    f[HEADER_LEN..].copy_from_slice(&req.to_le_bytes());
    f
}

pub(crate) fn write_err(req: u64, code: u8) -> [u8; HEADER_LEN + WRITE_ERR_LEN] {
    let mut f = [0u8; HEADER_LEN + WRITE_ERR_LEN];
    f[..HEADER_LEN].copy_from_slice(&header(WRITE_ERR, WRITE_ERR_LEN));
    f[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&req.to_le_bytes());
    f[HEADER_LEN + 8] = code;
    f
}

pub(crate) fn random_nonce() -> Result<Nonce, getrandom::Error> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n)?;
    Ok(n)
}

/// The TCP data connection's handshake.
pub(crate) const TCP_ROLES: Roles = auth::TCP_ROLES;

/// The shared-memory socket's handshake.
pub(crate) const SHM_ROLES: Roles = auth::SHM_ROLES;

/// Why the connecting side's half of the handshake ([`client_handshake`]) failed; each
/// backend maps it to its own error type.
#[derive(Debug)]
pub(crate) enum ClientAuthError {
    /// The socket failed, or the peer sent a malformed frame.
    Frame(FrameError),
    /// No randomness for our nonce.
    Random(getrandom::Error),
    /// The peer speaks this other protocol version.
    Version(u16),
    /// The peer is called this, not the name its metadata carries.
    WrongName(String),
    /// The peer refused our proof.
    Rejected,
    /// We hold a token and the peer did not prove it.
    PeerAuthFailed,
}

impl From<FrameError> for ClientAuthError {
    fn from(e: FrameError) -> Self {
        Self::Frame(e)
    }
}

impl From<AuthError> for ClientAuthError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Version(v) => Self::Version(v),
            AuthError::WrongName(name) => Self::WrongName(name),
            AuthError::Rejected => Self::Rejected,
            AuthError::PeerAuthFailed => Self::PeerAuthFailed,
            malformed => Self::Frame(malformed.into()),
        }
    }
}

impl From<io::Error> for ClientAuthError {
    fn from(e: io::Error) -> Self {
        Self::Frame(FrameError::Io(e))
    }
}

/// The connecting side's half of the handshake on `s`, for every backend: `HELLO`
/// (carrying `extra` after the version), `CHALLENGE`, `PROOF`, `AUTH_RESULT`. The peer
/// must be called `expected` (its metadata's name); with a `token`, it must prove it too.
pub(crate) fn client_handshake(
    mut s: impl Read + Write,
    roles: Roles,
    extra: u16,
    name: &str,
    token: Option<&[u8]>,
    expected: &str,
) -> Result<(), ClientAuthError> {
    let client_nonce = random_nonce().map_err(ClientAuthError::Random)?;
    let client = ClientAuth::new(roles, extra, client_nonce, name, token, Some(expected));
    s.write_all(&frame(HELLO, &client.hello()))?;
    let (_, len) = read_header(&mut s, &[CHALLENGE], |_| MAX_CONTROL_BODY)?;
    let body = read_body(&mut s, len)?;
    let (client, proof) = client.on_challenge(&body)?;
    s.write_all(&frame(PROOF, &proof))?;
    let (_, len) = read_header(&mut s, &[AUTH_RESULT], |_| MAX_CONTROL_BODY)?;
    let body = read_body(&mut s, len)?;
    client.on_result(&body)?;
    Ok(())
}

/// Comparison of region keys without an early exit.
pub(crate) fn keys_equal(a: u64, b: u64) -> bool {
    (a ^ b) == 0
}
