//! The verbs backend inside the [`Agent`](crate::Agent): a per-agent [`VerbsDomain`]
//! (device, protection domain, registrations, the queue-pair side channel listener) and a
//! per-peer [`VerbsLink`] (one RC queue pair; notifications stay on the peer's TCP link).
//!
//! Queue pair info travels over a small TCP side channel of this module (P listens on
//! its advertised IP; the address is in P's metadata entry `"verbs"`), not rdma_cm. The
//! same channel carries the reconnect after a queue pair error. It speaks the TCP
//! backend's frames (`[type u8][len u32 LE][body]`, `tcp::wire`) and runs proto's
//! sans-IO exchange (`kvlease_proto::auth`, roles `verbs-client` / `verbs-server`, so a
//! proof of one kind of connection never passes on another), with the queue-pair info
//! bound into the proofs:
//!
//! 1. D → P: `HELLO` (D's agent name, nonce), then `VERBS_INFO` (D's [`ConnectionInfo`]);
//! 2. P → D: `CHALLENGE` (P's agent name, which D checks against P's metadata, and nonce);
//! 3. D → P: `PROOF`, covering both nonces, both names and D's info;
//! 4. P checks it. A wrong or missing proof gets `AUTH_RESULT` = refused and no queue
//!    pair. Otherwise P makes its endpoint, connects it to D's info, and answers
//!    `AUTH_RESULT` with its proof, covering both names, both nonces and **both** infos,
//!    then `VERBS_INFO` (its info); or `VERBS_REFUSE` (a reason) when the endpoint fails.
//!    D checks P's proof against the info it received before it connects its queue pair.
//!
//! So neither side's queue-pair info can be swapped on the way, nor a proof replayed with
//! other info, names or nonces; a D with a token refuses a P that cannot prove it. Resets
//! ride the authenticated stream: D → P `VERBS_RESET` (its new info), P → D `VERBS_INFO`
//! or `VERBS_REFUSE`.

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvlease_gpu_mem::{DmaRegion, HostRegion, RegionBytes};

use super::error::{MirrorError, VerbsLinkError};
use super::memory::WriteAccess;
use super::mirror::Registration;
use super::stall::StallWatch;
use super::{
    ConnectionInfo, Device, DeviceConfig, Endpoint, EndpointBatchStatus, EndpointConfig,
    EndpointState, MemoryRegion, ProtectionDomain, RdmaRead, RdmaWrite, RemoteRegion, VerbsError,
    WorkCompletionStatus,
};
use crate::batch::{Batch, Next};
use crate::error::{LinkError, TransferError};
use crate::ids::{BatchId, FenceRead, WriteFence, WriteGrant};
use crate::link::{Chunk, Link, WriteChunk};
use crate::metadata::AgentMetadata;
use crate::stats::{Counters, bump};
use crate::tcp::{self, TcpLink};

use kvlease_proto::auth::{AuthError, AuthResult, ClientAuth, ServerAuth, VERBS_ROLES};
use tcp::wire::{
    AUTH_RESULT, CHALLENGE, FrameError, HELLO, MAX_CONTROL_BODY, PROOF, VERBS_INFO, VERBS_REFUSE,
    VERBS_RESET, frame, read_body, read_header,
};

const INFO_LEN: usize = 40;
/// Longest refusal reason sent or read.
const MAX_REASON: usize = 1024;
/// Fence words per link (8 bytes each): batches with a fence in flight at once.
const FENCE_SLOTS: u32 = 512;
/// Remote-write grants held at once (each is one registration of the NIC's).
const MAX_GRANTS: usize = 65_536;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections leave the data consistent before anything that can panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The agent's verbs state: the protection domain, the regions registered in it and the
/// queue-pair side channel listener; present when a usable device was found.
#[derive(Debug)]
pub(crate) struct VerbsDomain {
    pd: ProtectionDomain,
    regions: Mutex<HashMap<u64, Registration>>,
    /// Remote-write grants by fence word (region, offset): the generation each was
    /// granted for and its registration (see [`grant_write`](Self::grant_write)).
    grants: Mutex<HashMap<(u64, u64), Vec<Granted>>>,
    listen: SocketAddr,
    endpoint: EndpointConfig,
    timeout: Duration,
    /// `Limits::verbs_stall_timeout`, for each link's [`StallWatch`].
    stall_timeout: Duration,
    token: Option<Vec<u8>>,
    shutdown: Arc<AtomicBool>,
}

/// One remote-write grant.
#[derive(Debug)]
struct Granted {
    /// The generation it was granted for.
    generation: u64,
    /// The agent region the granted range lies in.
    region: u64,
    /// Its registration.
    access: WriteAccess,
}

/// The side channel's frames, as [`read_header`] and [`read_body`] give them, or why not.
fn read_frame(
    s: &mut TcpStream,
    allowed: &[u8],
    op: &'static str,
) -> Result<(u8, Vec<u8>), LinkError> {
    let malformed = |e: FrameError| match e {
        FrameError::Io(source) => LinkError::Verbs(VerbsLinkError::SideChannel { op, source }),
        FrameError::Malformed(what) => {
            LinkError::Verbs(VerbsLinkError::SideChannelMalformed { what })
        }
    };
    let (ty, len) = read_header(s, allowed, |ty| match ty {
        VERBS_INFO | VERBS_RESET => INFO_LEN,
        VERBS_REFUSE => MAX_REASON,
        _ => MAX_CONTROL_BODY,
    })
    .map_err(malformed)?;
    let body = read_body(s, len).map_err(malformed)?;
    Ok((ty, body))
}

/// A `VERBS_INFO` or `VERBS_RESET` body, or the reason of a `VERBS_REFUSE`.
fn info_or_refusal(ty: u8, body: &[u8]) -> Result<ConnectionInfo, LinkError> {
    if ty == VERBS_REFUSE {
        return Err(refusal(body));
    }
    ConnectionInfo::decode(body).map_err(|e| LinkError::Verbs(VerbsLinkError::BadConnectionInfo(e)))
}

/// The peer's refusal, with its reason.
fn refusal(reason: &[u8]) -> LinkError {
    LinkError::Verbs(VerbsLinkError::Refused {
        reason: String::from_utf8_lossy(reason).into_owned(),
    })
}

/// D's side of a failed exchange.
fn auth_failed(e: AuthError) -> LinkError {
    match e {
        AuthError::Rejected => LinkError::Verbs(VerbsLinkError::ProofRejected),
        AuthError::PeerAuthFailed => LinkError::Verbs(VerbsLinkError::WrongProof),
        AuthError::WrongName(got) => LinkError::Verbs(VerbsLinkError::WrongPeer { got }),
        malformed => LinkError::Verbs(VerbsLinkError::SideChannelMalformed {
            what: malformed.to_string(),
        }),
    }
}

impl VerbsDomain {
    /// Opens the device whose RoCE v2 GID carries `ip` (any device if `ip` is
    /// unspecified or loopback) and starts the side-channel listener on `ip`; with a
    /// `token`, the side channel requires and gives the token proof.
    pub(crate) fn start(
        name: &str,
        ip: IpAddr,
        limits: &crate::config::Limits,
        token: Option<Vec<u8>>,
    ) -> Result<Self, LinkError> {
        let timeout = limits.handshake_timeout;
        let mut config = DeviceConfig::any();
        if let IpAddr::V4(v4) = ip
            && !v4.is_unspecified()
            && !v4.is_loopback()
        {
            config = config.with_ipv4(v4);
        }
        let device = Device::open(&config).map_err(verbs("opening the device"))?;
        let pd = device
            .alloc_pd()
            .map_err(verbs("allocating a protection domain"))?;
        let listener = TcpListener::bind((ip, 0)).map_err(side_io("bind"))?;
        let listen = listener.local_addr().map_err(side_io("local address"))?;
        listener
            .set_nonblocking(true)
            .map_err(side_io("set_nonblocking"))?;
        // Notifications stay on the TCP link; the receive ring only has to exist.
        let endpoint = EndpointConfig {
            recv_slots: 4,
            notif_slot_size: 64,
            ack_timeout: limits.verbs_ack_timeout,
            ..EndpointConfig::default()
        };
        let shutdown = Arc::new(AtomicBool::new(false));
        let serve = Server {
            preauth: crate::slots::FairSlots::new(
                limits.max_preauth_connections,
                limits.max_preauth_per_address,
            ),
            name: name.to_owned(),
            pd: pd.clone(),
            endpoint: endpoint.clone(),
            timeout,
            token: token.clone(),
            shutdown: Arc::clone(&shutdown),
        };
        std::thread::Builder::new()
            .name("kvlease-verbs-listen".into())
            .spawn(move || serve.accept_loop(listener))
            .map_err(side_io("starting the listener thread"))?;
        tracing::info!(device = device.name(), gid = %device.gid(), side_channel = %listen, "verbs backend ready");
        Ok(Self {
            pd,
            regions: Mutex::new(HashMap::new()),
            grants: Mutex::new(HashMap::new()),
            listen,
            endpoint,
            timeout,
            stall_timeout: limits.verbs_stall_timeout,
            token,
            shutdown,
        })
    }

    /// Registers a region of the agent (whole, once): directly, through dmabuf, or
    /// through a registered host mirror (see [`super::mirror`]).
    pub(crate) fn register(&self, id: u64, region: Arc<dyn DmaRegion>) -> Result<(), LinkError> {
        let reg = Registration::new(&self.pd, region)?;
        lock(&self.regions).insert(id, reg);
        Ok(())
    }

    /// Copies `offset..offset + len` of region `id` into its mirror, so that peers' READs
    /// see it. Ok without a mirror, and for a region verbs did not register (peers read
    /// that one over TCP, from the region itself).
    pub(crate) fn sync_out(&self, id: u64, offset: u64, len: u64) -> Result<(), LinkError> {
        let reg = lock(&self.regions).get(&id).cloned();
        match reg {
            Some(reg) => reg.sync_out(offset, len),
            None => Ok(()),
        }
    }

    /// Whether region `id` is served through a mirror.
    pub(crate) fn is_mirrored(&self, id: u64) -> bool {
        lock(&self.regions)
            .get(&id)
            .is_some_and(Registration::is_mirror)
    }

    /// Registers `offset..offset + len` of `region` (agent region `id`) for remote
    /// writes under the fence word `fence` at `generation`, and returns its rkey. The
    /// caller holds the fence word's lock and checked that the word holds `generation`;
    /// [`revoke_writes`](Self::revoke_writes) under the same lock ends the grant.
    pub(crate) fn grant_write(
        &self,
        fence: (u64, u64),
        generation: u64,
        id: u64,
        region: Arc<dyn DmaRegion>,
        offset: u64,
        len: u64,
    ) -> Result<u32, LinkError> {
        let mut grants = lock(&self.grants);
        let held: usize = grants.values().map(Vec::len).sum();
        if held >= MAX_GRANTS {
            return Err(LinkError::Verbs(VerbsLinkError::TooManyGrants {
                max: MAX_GRANTS,
            }));
        }
        let access = self
            .pd
            .register_remote_write(region, offset, len)
            .map_err(verbs("registering a write grant"))?;
        let rkey = access.rkey();
        tracing::debug!(
            region = id,
            offset,
            len,
            generation,
            rkey,
            "remote write granted"
        );
        grants.entry(fence).or_default().push(Granted {
            generation,
            region: id,
            access,
        });
        Ok(rkey)
    }

    /// Deregisters every grant under the fence word `(region, offset)` whose generation
    /// is not `generation`; returns once each is deregistered (its rkey invalid). The
    /// caller holds the fence word's lock.
    pub(crate) fn revoke_writes(&self, region: u64, offset: u64, generation: u64) {
        self.revoke_where(|word, g| word == (region, offset) && g.generation != generation);
    }

    /// Deregisters every grant `gone(fence word, grant)` picks; returns once each is
    /// deregistered.
    fn revoke_where(&self, gone: impl Fn((u64, u64), &Granted) -> bool) {
        let revoked: Vec<Granted> = {
            let mut grants = lock(&self.grants);
            let mut out = Vec::new();
            grants.retain(|word, list| {
                let (drop, keep): (Vec<_>, Vec<_>) = std::mem::take(list)
                    .into_iter()
                    .partition(|g| gone(*word, g));
                out.extend(drop);
                *list = keep;
                !list.is_empty()
            });
            out
        };
        for g in revoked {
            let (offset, len) = g.access.range();
            tracing::debug!(
                region = g.region, generation = g.generation, rkey = g.access.rkey(), offset,
                len, kind = %g.access.region().kind(), "remote write revoked"
            );
            g.access.revoke();
        }
    }

    /// Forgets a region (it is deregistered once no work request references it).
    pub(crate) fn deregister(&self, id: u64) {
        lock(&self.regions).remove(&id);
        // Grants into the region, and grants under a fence word of it (which can no
        // longer be cleared), end with it.
        self.revoke_where(|word, g| word.0 == id || g.region == id);
    }

    /// This agent's metadata entry: side channel, GID, the rkey of every region, and
    /// for mirrored regions the mirror's address (peers read there instead of at the
    /// region's own base).
    pub(crate) fn metadata(&self) -> serde_json::Value {
        let regions = lock(&self.regions);
        let rkeys: serde_json::Map<String, serde_json::Value> = regions
            .iter()
            .map(|(id, reg)| (id.to_string(), serde_json::Value::from(reg.mr().rkey())))
            .collect();
        let mirrors: serde_json::Map<String, serde_json::Value> = regions
            .iter()
            .filter(|(_, reg)| reg.is_mirror())
            .map(|(id, reg)| (id.to_string(), serde_json::Value::from(reg.remote_base())))
            .collect();
        serde_json::json!({
            "addr": self.listen.to_string(),
            "device": self.pd.device().name(),
            "gid": self.pd.device().gid().to_string(),
            "rkeys": rkeys,
            "mirrors": mirrors,
        })
    }

    /// Connects a verbs link to `meta`'s agent, or says why not.
    pub(crate) fn connect(
        &self,
        own_name: &str,
        meta: &AgentMetadata,
        tcp: Arc<TcpLink>,
        counters: Arc<Counters>,
    ) -> Result<VerbsLink, LinkError> {
        let entry = meta
            .backends
            .get("verbs")
            .ok_or(LinkError::Verbs(VerbsLinkError::PeerHasNoVerbs))?;
        let addr: SocketAddr = entry
            .get("addr")
            .and_then(|a| a.as_str())
            .and_then(|a| a.parse().ok())
            .ok_or(LinkError::Verbs(VerbsLinkError::NoSideChannelAddress))?;
        let rkeys: HashMap<u64, u32> = entry
            .get("rkeys")
            .and_then(|r| r.as_object())
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.parse().ok()?, u32::try_from(v.as_u64()?).ok()?)))
                    .collect()
            })
            .unwrap_or_default();
        // Mirrored regions: the address the peer's NIC serves them at.
        let bases: HashMap<u64, u64> = entry
            .get("mirrors")
            .and_then(|r| r.as_object())
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_u64()?)))
                    .collect()
            })
            .unwrap_or_default();
        let mut side =
            TcpStream::connect_timeout(&addr, self.timeout).map_err(side_io("connect"))?;
        side.set_read_timeout(Some(self.timeout))
            .map_err(side_io("set_read_timeout"))?;
        side.set_write_timeout(Some(self.timeout))
            .map_err(side_io("set_write_timeout"))?;
        let mut ep = Endpoint::new(&self.pd, self.endpoint.clone())
            .map_err(verbs("creating an endpoint"))?;
        let remote = self.exchange(&mut side, own_name, &meta.name, &ep.local_info())?;
        ep.connect(&remote)
            .map_err(verbs("connecting the queue pair"))?;
        let fence_words = Arc::new(HostRegion::new(FENCE_SLOTS as usize * 8).map_err(|e| {
            LinkError::Mirror(MirrorError::Alloc {
                memory: "host fence-word",
                len: FENCE_SLOTS as usize * 8,
                source: Box::new(e),
            })
        })?);
        let fence_mr = self
            .pd
            .register(Arc::clone(&fence_words) as Arc<dyn DmaRegion>)
            .map_err(verbs("registering the fence words"))?;
        let regions = lock(&self.regions).clone();
        Ok(VerbsLink {
            peer: meta.name.clone(),
            meta: meta.clone(),
            rkeys,
            bases,
            local: regions,
            tcp,
            counters,
            state: Mutex::new(LinkState {
                ep,
                side,
                tracked: HashMap::new(),
                free_fence: (0..FENCE_SLOTS).collect(),
                watch: StallWatch::new(self.stall_timeout),
            }),
            fence_words,
            fence_mr,
        })
    }
}

impl VerbsDomain {
    /// D's side of the exchange on `side` (see the module doc): proves the token under
    /// `own_name` with `info` bound in, checks that the peer is `expected` and proves it
    /// back over both infos; returns the peer's info.
    fn exchange(
        &self,
        side: &mut TcpStream,
        own_name: &str,
        expected: &str,
        info: &ConnectionInfo,
    ) -> Result<ConnectionInfo, LinkError> {
        let io = side_io("the queue-pair exchange");
        let ours = info.encode();
        let nonce = tcp::wire::random_nonce().map_err(LinkError::Random)?;
        let client = ClientAuth::new(
            VERBS_ROLES,
            0,
            nonce,
            own_name,
            self.token.as_deref(),
            Some(expected),
        )
        .with_binding(&ours);
        let hello = [frame(HELLO, &client.hello()), frame(VERBS_INFO, &ours)].concat();
        side.write_all(&hello).map_err(io)?;
        let (_, challenge) = read_frame(side, &[CHALLENGE], "reading the challenge")?;
        let (proved, proof) = client.on_challenge(&challenge).map_err(auth_failed)?;
        side.write_all(&frame(PROOF, &proof)).map_err(io)?;
        let (ty, body) = read_frame(side, &[AUTH_RESULT, VERBS_REFUSE], "reading the result")?;
        if ty == VERBS_REFUSE {
            return Err(refusal(&body));
        }
        if !AuthResult::decode(&body).map_err(auth_failed)?.ok {
            return Err(LinkError::Verbs(VerbsLinkError::ProofRejected));
        }
        let (ty, theirs) = read_frame(side, &[VERBS_INFO], "reading the peer's info")?;
        // The peer's proof covers its info: check it before using the info.
        proved
            .on_result_bound(&body, &theirs)
            .map_err(auth_failed)?;
        info_or_refusal(ty, &theirs)
    }
}

impl Drop for VerbsDomain {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }
}

/// A `map_err` adapter: IO on the side channel failed while doing `op`.
fn side_io(op: &'static str) -> impl Fn(std::io::Error) -> LinkError + Copy {
    move |source| LinkError::Verbs(VerbsLinkError::SideChannel { op, source })
}

/// A `map_err` adapter: the verbs call behind `op` failed.
fn verbs(op: &'static str) -> impl Fn(VerbsError) -> LinkError + Copy {
    move |source| LinkError::Verbs(VerbsLinkError::Verbs { op, source })
}

/// P's side of the side channel: one thread per connecting peer, owning its endpoint.
#[derive(Clone)]
struct Server {
    /// Connections not through the exchange yet (`Limits::max_preauth_connections`).
    preauth: crate::slots::FairSlots,
    /// The agent's name (the server name of the exchange).
    name: String,
    pd: ProtectionDomain,
    endpoint: EndpointConfig,
    timeout: Duration,
    token: Option<Vec<u8>>,
    shutdown: Arc<AtomicBool>,
}

impl Server {
    fn accept_loop(self, listener: TcpListener) {
        while !self.shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((stream, from)) => {
                    // A few pre-auth slots, the busiest address's oldest evicted for a
                    // newcomer (its socket shut down).
                    let preauth = stream.try_clone().ok().and_then(|socket| {
                        self.preauth.admit(from.ip(), move || {
                            let _ = socket.shutdown(std::net::Shutdown::Both);
                            true
                        })
                    });
                    let Some(preauth) = preauth else {
                        tracing::warn!(%from, "verbs side channel: too many exchanges at once, none to evict; connection closed");
                        continue;
                    };
                    let s = self.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kvlease-verbs-peer".into())
                        .spawn(move || {
                            if let Err(e) = s.serve(stream, preauth) {
                                tracing::warn!(%from, "verbs side channel closed: {}", e.chain());
                            }
                        });
                    if let Err(e) = spawned {
                        tracing::error!("verbs side channel thread: {e}");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::warn!("verbs side channel accept: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    fn serve(&self, mut s: TcpStream, preauth: crate::slots::FairSlot) -> Result<(), LinkError> {
        let io = side_io("serving a peer");
        s.set_nonblocking(false).map_err(io)?;
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let (_, hello) = read_frame(&mut s, &[HELLO], "reading the hello")?;
        let ours = tcp::wire::random_nonce().map_err(LinkError::Random)?;
        let challenged = ServerAuth::new(VERBS_ROLES, ours, &self.name, self.token.as_deref())
            .on_hello(&hello)
            .map_err(auth_failed)?;
        s.write_all(&frame(CHALLENGE, &challenged.reply))
            .map_err(io)?;
        let auth = challenged.into_waiting().map_err(auth_failed)?;
        let name = auth.hello().name.clone();
        let (_, theirs) = read_frame(&mut s, &[VERBS_INFO], "reading the peer's info")?;
        let remote = info_or_refusal(VERBS_INFO, &theirs)?;
        let (_, proof) = read_frame(&mut s, &[PROOF], "reading the proof")?;
        // The proof covers the peer's info: a queue pair only for the info it proved.
        let checked = auth.check(&proof, None, &theirs).map_err(auth_failed)?;
        if !checked.ok {
            s.write_all(&frame(AUTH_RESULT, &checked.reply(&[])))
                .map_err(io)?;
            return Err(LinkError::Verbs(VerbsLinkError::RefusedPeer {
                reason: format!(
                    "{name}: cluster token proof failed (or its queue-pair info changed on the way): configure the same auth token on both agents"
                ),
            }));
        }
        let mut ep = match Endpoint::new(&self.pd, self.endpoint.clone()) {
            Ok(ep) => ep,
            Err(e) => return refuse(&mut s, &e.to_string()),
        };
        if let Err(e) = ep.connect(&remote) {
            return refuse(&mut s, &e.to_string());
        }
        let mine = ep.local_info().encode();
        let answer = [
            frame(AUTH_RESULT, &checked.reply(&mine)),
            frame(VERBS_INFO, &mine),
        ]
        .concat();
        s.write_all(&answer).map_err(io)?;
        drop(preauth);
        tracing::info!(peer = %name, qpn = ep.qpn(), authenticated = self.token.is_some(), "verbs queue pair served");
        // Requests from now on: resets. Poll the endpoint meanwhile (it only serves
        // RDMA READs, which need no CPU; polling notices a failed QP early).
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(io)?;
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Ok(());
            }
            let mut first = [0u8; 1];
            match s.peek(&mut first) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if let Err(e) = ep.poll() {
                        tracing::warn!(peer = %name, "verbs poll: {e}");
                    }
                    continue;
                }
                Err(e) => return Err(io(e)),
            }
            // A frame began: read it whole under the ordinary timeout.
            s.set_read_timeout(Some(self.timeout)).map_err(io)?;
            let (ty, body) = read_frame(&mut s, &[VERBS_RESET], "reading a reset")?;
            let remote = info_or_refusal(ty, &body)?;
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .map_err(io)?;
            let reconnected = ep
                .reset()
                .and_then(|info| ep.connect(&remote).map(|()| info));
            match reconnected {
                Ok(_) => s
                    .write_all(&frame(VERBS_INFO, &ep.local_info().encode()))
                    .map_err(side_io("accepting"))?,
                Err(e) => refuse(&mut s, &e.to_string())?,
            }
            tracing::info!(peer = %name, "verbs queue pair reconnected");
        }
    }
}

/// Sends `why` to the peer (`VERBS_REFUSE`) and returns it as this side's error (for the
/// log).
fn refuse(s: &mut TcpStream, why: &str) -> Result<(), LinkError> {
    let mut end = why.len().min(MAX_REASON);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    let why = &why[..end];
    s.write_all(&frame(VERBS_REFUSE, why.as_bytes()))
        .map_err(side_io("refusing"))?;
    Err(LinkError::Verbs(VerbsLinkError::RefusedPeer {
        reason: why.to_owned(),
    }))
}

/// A verbs link to one peer (D's side): RDMA READs on the queue pair, notifications on
/// the TCP link.
#[derive(Debug)]
pub(crate) struct VerbsLink {
    peer: String,
    meta: AgentMetadata,
    rkeys: HashMap<u64, u32>,
    /// The peer's mirrored regions: where its NIC serves them.
    bases: HashMap<u64, u64>,
    /// This agent's registrations at connect time (destinations of reads).
    local: HashMap<u64, Registration>,
    tcp: Arc<TcpLink>,
    counters: Arc<Counters>,
    state: Mutex<LinkState>,
    fence_words: Arc<HostRegion>,
    fence_mr: MemoryRegion,
}

#[derive(Debug)]
struct LinkState {
    ep: Endpoint,
    side: TcpStream,
    tracked: HashMap<BatchId, Tracked>,
    free_fence: Vec<u32>,
    /// Notices a queue pair that completes nothing while work is outstanding.
    watch: StallWatch,
}

#[derive(Debug)]
struct Tracked {
    batch: Arc<Batch>,
    chunk_lens: Vec<u64>,
    fence: Option<(u32, FenceRead)>,
    /// Ranges of mirrored destinations the reads land in, copied mirror → region before
    /// the batch is done (adjacent chunks merged).
    copy_back: Vec<(Registration, u64, u64)>,
    /// For a batch of RDMA WRITEs: its first chunk's destination and the generation it
    /// writes for, named by the `Stale` error a revoked grant gives.
    write: Option<(u64, u64, u64, u64)>,
}

impl VerbsLink {
    fn remote(&self, range: &crate::ids::RemoteRange) -> Result<RemoteRegion, TransferError> {
        let invalid = |reason: String| TransferError::InvalidBatch {
            peer: self.peer.clone(),
            reason,
        };
        let desc = self
            .meta
            .regions
            .iter()
            .find(|r| r.id == range.region)
            .ok_or_else(|| invalid(format!("peer region {} is unknown", range.region)))?;
        if desc.key != range.key {
            return Err(TransferError::Refused {
                peer: self.peer.clone(),
                region: range.region,
                offset: range.offset,
                len: 0,
                reason: crate::error::Refusal::BadKey,
            });
        }
        let rkey = self
            .rkeys
            .get(&range.region)
            .ok_or_else(|| invalid(format!("peer region {} has no rkey", range.region)))?;
        let base = self.bases.get(&range.region).copied().unwrap_or(desc.base);
        Ok(RemoteRegion::new(base, desc.len, *rkey))
    }

    /// The registration of each chunk's destination, or why this batch cannot go over the
    /// queue pair (then it goes over TCP): a remote region (or fence region) the peer could
    /// not register with verbs, or a local destination this link has no registration of.
    fn verbs_route(
        &self,
        batch: &Batch,
        chunks: &[Chunk],
    ) -> Result<Vec<Registration>, NoVerbsRoute> {
        let unregistered = |region: u64| {
            !self.rkeys.contains_key(&region) && self.meta.regions.iter().any(|r| r.id == region)
        };
        if let Some(c) = chunks.iter().find(|c| unregistered(c.remote.region)) {
            return Err(NoVerbsRoute::PeerRegion {
                region: c.remote.region,
            });
        }
        if let Some(f) = batch.lock().fence
            && unregistered(f.remote.region)
        {
            return Err(NoVerbsRoute::PeerFenceRegion {
                region: f.remote.region,
            });
        }
        chunks
            .iter()
            .map(|c| {
                self.local
                    .values()
                    .find(|reg| Arc::ptr_eq(reg.region(), &c.dest))
                    .cloned()
                    .ok_or_else(|| NoVerbsRoute::Local {
                        kind: c.dest.kind(),
                    })
            })
            .collect()
    }

    /// A batch's failure: `Stale` for a write the peer refused with a remote access
    /// error (its grant was revoked: the reservation ended), a disconnect otherwise.
    fn failed(&self, t: &Tracked, e: &VerbsError) -> TransferError {
        if let (Some((region, offset, len, expected)), VerbsError::WorkRequest { status, .. }) =
            (t.write, e)
            && status.code() == WorkCompletionStatus::REM_ACCESS_ERR
        {
            return TransferError::Stale {
                peer: self.peer.clone(),
                region,
                offset,
                len,
                expected,
            };
        }
        self.rdma_failed(e)
    }

    /// The RDMA WRITEs of `chunks`, each inside one of `grants` (of the batch's
    /// generation), or why the batch cannot be written: `Ok(None)` when a source has no
    /// direct verbs registration on this link (the batch then goes over TCP).
    fn granted_writes(
        &self,
        chunks: &[WriteChunk],
        fence: WriteFence,
        grants: &[WriteGrant],
    ) -> Result<Option<Vec<RdmaWrite>>, TransferError> {
        let invalid = |reason: String| TransferError::InvalidBatch {
            peer: self.peer.clone(),
            reason,
        };
        if let Some(g) = grants.iter().find(|g| g.generation != fence.expected) {
            return Err(invalid(format!(
                "a write grant for generation {}, the batch writes for {}",
                g.generation, fence.expected
            )));
        }
        let mut ops = Vec::with_capacity(chunks.len());
        for c in chunks {
            let Some(src) = self
                .local
                .values()
                .find(|reg| Arc::ptr_eq(reg.region(), &c.src) && !reg.is_mirror())
            else {
                return Ok(None);
            };
            let grant = grants
                .iter()
                .find(|g| g.covers(c.remote.region, c.remote.offset, c.len))
                .ok_or_else(|| {
                    invalid(format!(
                        "the write of {} bytes at {} of peer region {} lies outside every write grant",
                        c.len, c.remote.offset, c.remote.region
                    ))
                })?;
            if self.bases.contains_key(&c.remote.region) {
                return Err(invalid(format!(
                    "peer region {} is served through a mirror: it takes no RDMA WRITE",
                    c.remote.region
                )));
            }
            let region = self.remote(&c.remote)?;
            let addr = region.addr().checked_add(grant.offset).ok_or_else(|| {
                invalid(format!(
                    "write grant at {} overflows peer region {}",
                    grant.offset, c.remote.region
                ))
            })?;
            ops.push(RdmaWrite {
                local: src.mr().clone(),
                local_offset: c.src_offset,
                remote: RemoteRegion::new(addr, grant.len, grant.rkey),
                // Inside the grant (`covers`).
                remote_offset: c.remote.offset - grant.offset,
                len: c.len,
            });
        }
        Ok(Some(ops))
    }

    /// Reconnects the reset queue pair through the side channel, which posts its
    /// unconfirmed work again. If that fails, every tracked batch fails; returns whether
    /// the queue pair is connected.
    fn reconnect_or_fail(&self, st: &mut LinkState) -> bool {
        st.watch.restart();
        if let Err(e) = reconnect(st) {
            tracing::warn!(peer = %self.peer, "verbs reconnect failed: {}", e.chain());
            for (_, t) in st.tracked.drain() {
                t.batch
                    .lock()
                    .fail(self.rdma_failed(&format_args!("reconnect failed: {}", e.chain())));
            }
            return false;
        }
        tracing::info!(peer = %self.peer, "verbs queue pair reconnected");
        true
    }

    fn rdma_failed(&self, reason: &dyn std::fmt::Display) -> TransferError {
        TransferError::Disconnected {
            peer: self.peer.clone(),
            reason: format!("verbs: {reason}"),
        }
    }
}

impl Link for VerbsLink {
    fn post_reads(&self, batch: &Arc<Batch>, chunks: Vec<Chunk>) -> Result<(), TransferError> {
        let regs = match self.verbs_route(batch, &chunks) {
            Ok(regs) => regs,
            Err(why) => {
                // Memory verbs could register neither directly, nor through dmabuf, nor through
                // a mirror (the mirror's allocation failed), or a local region registered after
                // connect: the TCP link reads it instead, staging device memory through pinned
                // buffers on both sides.
                tracing::debug!(peer = %self.peer, batch = batch.id, "batch over TCP: {why}");
                return self.tcp.post_reads(batch, chunks);
            }
        };
        let mut ops = Vec::with_capacity(chunks.len());
        let mut lens = Vec::with_capacity(chunks.len());
        let mut copy_back: Vec<(Registration, u64, u64)> = Vec::new();
        for (c, reg) in chunks.iter().zip(regs) {
            ops.push(RdmaRead {
                local: reg.mr().clone(),
                local_offset: c.dest_offset,
                remote: self.remote(&c.remote)?,
                remote_offset: c.remote.offset,
                len: c.len,
            });
            lens.push(c.len);
            if reg.is_mirror() {
                match copy_back.last_mut() {
                    Some((last, off, len))
                        if Arc::ptr_eq(last.region(), reg.region())
                            && *off + *len == c.dest_offset =>
                    {
                        *len += c.len;
                    }
                    _ => copy_back.push((reg, c.dest_offset, c.len)),
                }
            }
        }
        let mut st = lock(&self.state);
        let fence = match batch.lock().fence {
            Some(f) => {
                let slot = st
                    .free_fence
                    .pop()
                    .ok_or_else(|| TransferError::InvalidBatch {
                        peer: self.peer.clone(),
                        reason: format!("more than {FENCE_SLOTS} fenced batches in flight"),
                    })?;
                Some((slot, f))
            }
            None => None,
        };
        let fence_op = match &fence {
            Some((slot, f)) => Some(RdmaRead {
                local: self.fence_mr.clone(),
                local_offset: u64::from(*slot) * 8,
                remote: self.remote(&f.remote)?,
                remote_offset: f.remote.offset,
                len: 8,
            }),
            None => None,
        };
        // Set before posting, so a timeout racing the post finds it on the queue pair.
        batch.lock().backend = crate::Backend::Verbs;
        match st.ep.post_read_batch(&ops, fence_op.as_ref(), None) {
            Ok(id) => {
                st.tracked.insert(
                    id,
                    Tracked {
                        batch: Arc::clone(batch),
                        chunk_lens: lens,
                        fence,
                        copy_back,
                        write: None,
                    },
                );
                Ok(())
            }
            Err(e) => {
                if let Some((slot, _)) = fence {
                    st.free_fence.push(slot);
                }
                Err(self.rdma_failed(&e))
            }
        }
    }

    /// Reaps completions and advances finished batches; reconnects a failed queue pair.
    /// Called from the agent's `poll_batch` (no thread of our own).
    ///
    /// A batch whose reads landed in mirrors is copied mirror → region (under the batch
    /// lock, outside the queue pair's) before it is marked done and before its
    /// notification goes out: the peer may free the source on that notification.
    fn progress(&self) {
        let mut finished = Vec::new();
        {
            let mut guard = lock(&self.state);
            let st = &mut *guard;
            if let Err(e) = st.ep.poll() {
                tracing::warn!(peer = %self.peer, "verbs poll: {e}");
            }
            if st.ep.state() == EndpointState::NeedsReconnect {
                // The endpoint reset itself after a queue pair error (or a timed-out
                // batch reset it).
                if !self.reconnect_or_fail(st) {
                    return;
                }
            } else if let Some(still) =
                st.watch
                    .observe(st.ep.reported(), st.ep.outstanding() > 0, Instant::now())
            {
                tracing::warn!(
                    peer = %self.peer,
                    qpn = st.ep.qpn(),
                    qp_state = st.ep.query_qp_state().unwrap_or("unknown"),
                    outstanding = st.ep.outstanding(),
                    batches = st.tracked.len(),
                    "verbs queue pair completed nothing for {still:?} with work outstanding: resetting it and posting its unconfirmed work again"
                );
                bump(&self.counters.verbs_stall_resets);
                // `reconnect` resets the queue pair first (QP → ERR, drain, unconfirmed
                // work queued again in order).
                if !self.reconnect_or_fail(st) {
                    return;
                }
            }
            let ids: Vec<BatchId> = st.tracked.keys().copied().collect();
            for id in ids {
                let status = match st.ep.poll_batch(id) {
                    None | Some(EndpointBatchStatus::Pending) => continue,
                    Some(s) => s,
                };
                let Some(t) = st.tracked.remove(&id) else {
                    continue;
                };
                // The word is read before its slot is free for another batch.
                let word = t.fence.and_then(|(slot, _)| {
                    let word = self.fence_words.load_u64(u64::from(slot) * 8).ok();
                    st.free_fence.push(slot);
                    word
                });
                finished.push((t, status, word));
            }
        }
        for (t, status, word) in finished {
            let mut bst = t.batch.lock();
            match status {
                EndpointBatchStatus::Done => {
                    let mut next = Next::Nothing;
                    for len in &t.chunk_lens {
                        next = bst.chunk_done(*len);
                    }
                    if let Next::Fence(f) = next {
                        next = bst.fence_done(&self.peer, f.expected, word.unwrap_or(0));
                    }
                    if matches!(next, Next::Notify(_) | Next::Finish)
                        && let Err(e) = copy_back(&t.copy_back)
                    {
                        bst.fail(TransferError::LocalCopy {
                            peer: self.peer.clone(),
                            reason: e.chain(),
                        });
                        continue;
                    }
                    match next {
                        Next::Notify(n) => match self.tcp.send_notif(n) {
                            Ok(()) => bst.finish(),
                            Err(e) => {
                                bst.fail(e);
                            }
                        },
                        Next::Finish => bst.finish(),
                        Next::Nothing | Next::Fence(_) => {}
                    }
                }
                EndpointBatchStatus::Failed(e) => {
                    bst.fail(self.failed(&t, &e));
                }
                _ => {}
            }
        }
    }

    /// Without grants the peer's receiver fences the writes: they go over the TCP link.
    fn post_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), TransferError> {
        self.tcp.post_writes(batch, chunks, fence)
    }

    /// RDMA WRITEs into the granted ranges, completed as the peer's NIC acknowledges
    /// them (no CPU of the peer involved); the notification follows on the TCP link once
    /// every write completed. A write whose grant the peer revoked fails at its NIC with
    /// a remote access error and changes nothing there: the batch fails with `Stale`.
    /// A batch whose source has no direct verbs registration goes over TCP.
    fn post_granted_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
        grants: &[WriteGrant],
    ) -> Result<(), TransferError> {
        let Some(ops) = self.granted_writes(&chunks, fence, grants)? else {
            tracing::debug!(peer = %self.peer, batch = batch.id, "write batch over TCP: a source has no direct verbs registration");
            return self.tcp.post_writes(batch, chunks, fence);
        };
        let first = chunks
            .first()
            .map(|c| (c.remote.region, c.remote.offset, c.len, fence.expected));
        let lens: Vec<u64> = chunks.iter().map(|c| c.len).collect();
        let mut st = lock(&self.state);
        batch.lock().backend = crate::Backend::Verbs;
        match st.ep.post_write_batch(&ops, None) {
            Ok(id) => {
                st.tracked.insert(
                    id,
                    Tracked {
                        batch: Arc::clone(batch),
                        chunk_lens: lens,
                        fence: None,
                        copy_back: Vec::new(),
                        write: first,
                    },
                );
                Ok(())
            }
            Err(e) => Err(self.rdma_failed(&e)),
        }
    }

    fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        self.tcp.send_notif(bytes)
    }

    /// The batch timed out: stop every transfer into its memory by resetting the queue
    /// pair (the other batches' reads are re-posted after the reconnect).
    fn on_timeout(&self, batch: &Batch) {
        // A batch that went over TCP (see `verbs_route`) is cancelled there; the queue pair
        // has nothing of it to stop.
        if batch.lock().backend == crate::Backend::Tcp {
            self.tcp.on_timeout(batch);
            return;
        }
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let ids: Vec<BatchId> = st
            .tracked
            .iter()
            .filter(|(_, t)| t.batch.id == batch.id)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            st.ep.abandon_batch(id);
            if let Some(t) = st.tracked.remove(&id)
                && let Some((slot, _)) = t.fence
            {
                st.free_fence.push(slot);
            }
        }
        if let Err(e) = st.ep.reset() {
            tracing::warn!(peer = %self.peer, "verbs reset after timeout: {e}");
        }
        st.watch.restart();
    }

    fn close(&self) {
        let st = lock(&self.state);
        let _ = st.side.shutdown(std::net::Shutdown::Both);
        self.tcp.close();
    }
}

/// Copies each range that a batch read into a mirror over to its region.
fn copy_back(ranges: &[(Registration, u64, u64)]) -> Result<(), LinkError> {
    for (reg, offset, len) in ranges {
        reg.sync_in(*offset, *len)?;
    }
    Ok(())
}

fn reconnect(st: &mut LinkState) -> Result<(), LinkError> {
    let info = st.ep.reset().map_err(verbs("resetting the queue pair"))?;
    st.side
        .write_all(&frame(VERBS_RESET, &info.encode()))
        .map_err(side_io("sending a reset"))?;
    let (ty, body) = read_frame(&mut st.side, &[VERBS_INFO, VERBS_REFUSE], "reading a reply")?;
    let remote = info_or_refusal(ty, &body)?;
    st.ep
        .connect(&remote)
        .map_err(verbs("reconnecting the queue pair"))
}

/// Why a batch goes over the peer's TCP link instead of the queue pair (logged).
#[derive(Debug, thiserror::Error)]
enum NoVerbsRoute {
    #[error("peer region {region} has no verbs registration")]
    PeerRegion { region: u64 },
    #[error("peer fence region {region} has no verbs registration")]
    PeerFenceRegion { region: u64 },
    #[error("local {kind} region has no verbs registration on this link")]
    Local { kind: kvlease_gpu_mem::MemoryKind },
}

/// The agent's verbs backend for `choice`, or why there is none.
pub(crate) fn start_for(
    choice: &crate::config::BackendChoice,
    name: &str,
    token: &Option<Vec<u8>>,
    ip: IpAddr,
    limits: &crate::config::Limits,
) -> Result<VerbsDomain, LinkError> {
    use crate::config::BackendChoice;
    match choice {
        BackendChoice::Tcp => return Err(LinkError::Requested(crate::Backend::Tcp)),
        BackendChoice::Shm => return Err(LinkError::Requested(crate::Backend::Shm)),
        _ => {}
    }
    let backend = VerbsDomain::start(name, ip, limits, token.clone());
    if let Err(e) = &backend {
        tracing::info!(reason = %e.chain(), "verbs backend unavailable");
    }
    backend
}
