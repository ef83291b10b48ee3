//! The shared-memory backend: peers on the same host read each other's registered host
//! memory directly.
//!
//! # Identity
//! An agent that offers shared memory writes `{"host": <identity>, "socket": <name>}`
//! under the metadata key `"shm"`. The identity is the kernel's boot id
//! (`/proc/sys/kernel/random/boot_id`) and the network namespace
//! (`/proc/self/ns/net`): equal identities mean the same running kernel and the same
//! network namespace, so the abstract Unix socket named in the entry is reachable and a
//! memfd passed over it maps the same pages. The IP address says nothing about that. (The
//! mount namespace does not matter: abstract sockets and passed descriptors ignore it.)
//!
//! # Handshake
//! After D's TCP link to P is up (authenticated as always), D connects to P's abstract
//! Unix socket and runs the TCP handshake again on it (`HELLO`, `CHALLENGE`, `PROOF`,
//! `AUTH_RESULT`, fresh nonces) with the proof roles `shm-client` / `shm-server`, so a
//! proof made for one channel is useless on the other. Only when the proof checks out
//! does P send, for each registered region whose memory is shareable
//! ([`DmaRegion::shared_fd`]: host regions, memfd-backed), a `SHM_REGION` frame (id, key,
//! length) with the memfd attached (`SCM_RIGHTS`), then `SHM_END`. D maps each one
//! read-only ([`SharedRegionView`], which refuses files whose size is not sealed).
//!
//! # Reads
//! A batch goes over shared memory when every source region (and the fence's) was
//! received in the handshake and every destination is host memory; otherwise (a region
//! registered later, device memory) over the TCP link, as the verbs link does. Each op is
//! checked against P's descriptor as P's TCP server would check it (key, bounds) and
//! refused with the same [`Refusal`]s. The copies run on the link's copier thread,
//! split over up to [`MAX_COPY_THREADS`] scoped threads when a batch holds more than
//! [`SPLIT_BYTES`]. The fence word is loaded (atomically, acquire, after an acquire
//! fence) only once every data copy finished; a mismatch fails the batch with
//! [`TransferError::FenceMismatch`] and the notification is not sent. Notifications (the
//! batch's and [`Agent::send_notif`](crate::Agent::send_notif)) travel over the TCP link.
//!
//! # Limits
//! D's mapping keeps P's pages alive until the link closes, and D's reads do not show up
//! in P's counters (`reads_served`). P's later deregistration of a region does not reach
//! a mapping D already holds (P's lease protocol and fences, not the key, guard the bytes
//! of a region that stays registered for the pool's life).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use kvlease_gpu_mem::{DmaRegion, SharedRegionView, recv_with_fds, send_with_fds};

use crate::agent::{Inner, bump, lock};
use crate::batch::{Batch, Next};
use crate::config::Backend;
use crate::error::{LinkError, Refusal, TransferError};
use crate::metadata::AgentMetadata;
use crate::tcp::wire::{self, Body, FrameError};
use crate::tcp::{Chunk, TcpLink};

/// The metadata key of this backend's entry.
pub(crate) const METADATA_KEY: &str = "shm";

/// Batches with more data bytes than this are copied by several threads.
pub(crate) const SPLIT_BYTES: u64 = 4 << 20;

/// Most threads copying one batch (the copier thread included).
pub(crate) const MAX_COPY_THREADS: usize = 4;

/// Most regions a peer may hand over in one handshake.
const MAX_REGIONS: usize = 1 << 16;

/// This host's identity for shared memory: boot id and network namespace, or `None`
/// where `/proc` does not say.
pub(crate) fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    let boot = boot.trim();
    if boot.is_empty() {
        return None;
    }
    Some(format!("{boot}/{}", net.display()))
}

/// P's side: the abstract Unix socket that hands region descriptors to authenticated
/// peers on the same host.
#[derive(Debug)]
pub(crate) struct Server {
    name: String,
    listener: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds a fresh abstract socket and starts its accept thread; the metadata entry
    /// names it. `None` (logged) when the host has no identity or binding fails: peers
    /// then use another backend.
    pub(crate) fn start(inner: &Arc<Inner>) -> Option<Self> {
        let identity = host_identity()?;
        let mut suffix = [0u8; 12];
        if let Err(err) = getrandom::fill(&mut suffix) {
            tracing::warn!(%err, "shm backend off: random source failed");
            return None;
        }
        let name = format!(
            "kvlease-shm-{}",
            suffix
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        let listener = match UnixAddr::from_abstract_name(name.as_bytes())
            .and_then(|addr| UnixListener::bind_addr(&addr))
        {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(%err, "shm backend off: binding the abstract socket failed");
                return None;
            }
        };
        let inner2 = inner.clone();
        let handle = std::thread::Builder::new()
            .name("kvl-shm-listen".into())
            .spawn(move || accept_loop(&inner2, &listener));
        let handle = match handle {
            Ok(h) => h,
            Err(err) => {
                tracing::warn!(%err, "shm backend off: starting its thread failed");
                return None;
            }
        };
        inner.set_backend_metadata(
            METADATA_KEY,
            Some(serde_json::json!({ "host": identity, "socket": name })),
        );
        tracing::debug!(socket = %name, "shm backend listening");
        Some(Self {
            name,
            listener: Some(handle),
        })
    }

    /// Stops the accept thread (the agent's shutdown flag is already set).
    pub(crate) fn stop(&mut self) {
        // Wake `accept` so that it sees the flag.
        let _ = UnixAddr::from_abstract_name(self.name.as_bytes())
            .and_then(|a| UnixStream::connect_addr(&a));
        if let Some(h) = self.listener.take()
            && h.join().is_err()
        {
            tracing::error!("shm listener thread panicked");
        }
    }
}

fn accept_loop(inner: &Arc<Inner>, listener: &UnixListener) {
    for stream in listener.incoming() {
        if inner.shutdown.load(Ordering::SeqCst) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "shm accept failed");
                // Out of descriptors and similar: back off instead of spinning.
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let inner2 = inner.clone();
        let spawned = std::thread::Builder::new()
            .name("kvl-shm-serve".into())
            .spawn(move || {
                if let Err(err) = serve(&inner2, stream) {
                    match err {
                        FrameError::Malformed(why) => {
                            bump(&inner2.counters.malformed_frames);
                            tracing::warn!(%why, "malformed frame on the shm socket; closed");
                        }
                        FrameError::Io(err) => {
                            tracing::debug!(%err, "shm socket connection ended");
                        }
                    }
                }
            });
        if let Err(err) = spawned {
            tracing::error!(%err, "could not start an shm connection thread; connection dropped");
        }
    }
}

/// Serves one Unix-socket connection: the handshake, then the regions if it succeeded.
fn serve(inner: &Inner, mut s: UnixStream) -> Result<(), FrameError> {
    s.set_read_timeout(Some(inner.limits.handshake_timeout))?;
    s.set_write_timeout(Some(inner.limits.handshake_timeout))?;
    let (_, len) = wire::read_header(&mut s, &[wire::HELLO], |_| wire::MAX_CONTROL_BODY)?;
    let body = wire::read_body(&mut s, len)?;
    let mut b = Body(&body);
    let version = b.u16()?;
    let _conn_index = b.u16()?;
    let client_nonce = b.nonce()?;
    let client_name = b.name()?;
    b.finish()?;
    let server_nonce = wire::random_nonce().map_err(|e| io::Error::other(e.to_string()))?;
    let extra = [u8::from(inner.token.is_some())];
    s.write_all(&wire::frame(
        wire::CHALLENGE,
        &wire::hello_body(&extra, &server_nonce, &inner.name),
    ))?;
    if version != wire::PROTOCOL_VERSION {
        return Err(FrameError::Malformed(format!("protocol version {version}")));
    }
    let (_, len) = wire::read_header(&mut s, &[wire::PROOF], |_| wire::MAX_CONTROL_BODY)?;
    let body = wire::read_body(&mut s, len)?;
    let mut b = Body(&body);
    let proof = b.proof()?;
    b.finish()?;
    let exchange = wire::Exchange {
        roles: wire::SHM_ROLES,
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        client_name: &client_name,
        server_name: &inner.name,
    };
    let ok = crate::tcp::server::answer_client_proof(inner, &exchange, proof, &mut s)?;
    if !ok {
        tracing::warn!(peer = %client_name, "shm peer failed the token proof; no memory handed over");
        return Ok(());
    }
    // Snapshot the shareable regions; the descriptors are sent without the lock held.
    let regions: Vec<(Arc<dyn DmaRegion>, crate::metadata::RegionDesc)> = inner
        .regions
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .values()
        .filter(|r| r.region.kind().is_host_accessible() && r.region.shared_fd().is_some())
        .map(|r| (r.region.clone(), r.desc))
        .take(MAX_REGIONS)
        .collect();
    for (region, desc) in &regions {
        let Some(fd) = region.shared_fd() else {
            continue;
        };
        let mut f = Vec::with_capacity(wire::HEADER_LEN + wire::SHM_REGION_LEN);
        f.extend_from_slice(&wire::header(wire::SHM_REGION, wire::SHM_REGION_LEN));
        for v in [desc.id, desc.key, desc.len] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        send_with_fds(s.as_fd(), &f, &[fd])?;
    }
    s.write_all(&wire::header(wire::SHM_END, 0))?;
    tracing::debug!(peer = %client_name, regions = regions.len(), "shm regions handed over");
    Ok(())
}

/// A peer's region mapped into this process.
#[derive(Debug)]
struct MappedRegion {
    key: u64,
    view: SharedRegionView,
}

/// One data copy of a batch.
#[derive(Debug)]
struct CopyOp {
    src: Arc<MappedRegion>,
    src_offset: u64,
    dest: Arc<dyn DmaRegion>,
    dest_offset: u64,
    len: u64,
}

#[derive(Debug)]
struct Job {
    batch: Arc<Batch>,
    copies: Vec<CopyOp>,
}

/// D's side: the peer's regions mapped read-only, a copier thread, and the TCP link that
/// carries notifications and the batches shared memory cannot serve.
#[derive(Debug)]
pub(crate) struct ShmLink {
    peer: String,
    tcp: Arc<TcpLink>,
    regions: Arc<HashMap<u64, Arc<MappedRegion>>>,
    /// `None` once closed.
    jobs: Mutex<Option<Sender<Job>>>,
}

/// Connects to `meta`'s shared-memory socket, authenticates, maps the regions it hands
/// over and starts the copier thread.
pub(crate) fn connect(
    inner: &Inner,
    meta: &AgentMetadata,
    tcp: Arc<TcpLink>,
) -> Result<ShmLink, LinkError> {
    let entry = meta
        .backends
        .get(METADATA_KEY)
        .ok_or(LinkError::PeerHasNoShm)?;
    let (Some(host), Some(socket)) = (
        entry.get("host").and_then(|v| v.as_str()),
        entry.get("socket").and_then(|v| v.as_str()),
    ) else {
        return Err(LinkError::ShmMalformed {
            what: "the peer's shm metadata entry lacks host or socket",
        });
    };
    let own = host_identity().ok_or(LinkError::NoHostIdentity)?;
    if host != own {
        return Err(LinkError::NotSameHost);
    }
    let sock_err = |op: &'static str| move |source: io::Error| LinkError::ShmSocket { op, source };
    let addr = UnixAddr::from_abstract_name(socket.as_bytes()).map_err(sock_err("socket name"))?;
    let mut s = UnixStream::connect_addr(&addr).map_err(sock_err("connect"))?;
    s.set_read_timeout(Some(inner.limits.handshake_timeout))
        .map_err(sock_err("set timeout"))?;
    s.set_write_timeout(Some(inner.limits.handshake_timeout))
        .map_err(sock_err("set timeout"))?;
    handshake(inner, meta, &mut s)?;
    let regions = receive_regions(&mut s)?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let link = ShmLink {
        peer: meta.name.clone(),
        tcp,
        regions: Arc::new(regions),
        jobs: Mutex::new(Some(tx)),
    };
    let worker = Worker {
        peer: link.peer.clone(),
        tcp: link.tcp.clone(),
        regions: link.regions.clone(),
    };
    std::thread::Builder::new()
        .name(format!("kvl-shm-{}", meta.name))
        .spawn(move || worker.run(&rx))
        .map_err(sock_err("starting the copier thread"))?;
    tracing::debug!(peer = %meta.name, regions = link.regions.len(), "shm link up");
    Ok(link)
}

fn frame_err(e: FrameError) -> LinkError {
    match e {
        FrameError::Io(source) => LinkError::ShmSocket {
            op: "handshake",
            source,
        },
        FrameError::Malformed(_) => LinkError::ShmMalformed {
            what: "malformed frame from the peer's shm socket",
        },
    }
}

fn handshake(inner: &Inner, meta: &AgentMetadata, s: &mut UnixStream) -> Result<(), LinkError> {
    let client_nonce = wire::random_nonce().map_err(LinkError::Random)?;
    let io = |source| LinkError::ShmSocket {
        op: "handshake",
        source,
    };
    let extra = 0u16.to_le_bytes();
    s.write_all(&wire::frame(
        wire::HELLO,
        &wire::hello_body(&extra, &client_nonce, &inner.name),
    ))
    .map_err(io)?;
    let (_, len) =
        wire::read_header(s, &[wire::CHALLENGE], |_| wire::MAX_CONTROL_BODY).map_err(frame_err)?;
    let body = wire::read_body(s, len).map_err(frame_err)?;
    let mut b = Body(&body);
    let version = b.u16().map_err(frame_err)?;
    if version != wire::PROTOCOL_VERSION {
        return Err(LinkError::ShmMalformed {
            what: "the peer speaks another protocol version",
        });
    }
    let auth_required = b.u8().map_err(frame_err)? != 0;
    let server_nonce = b.nonce().map_err(frame_err)?;
    let server_name = b.name().map_err(frame_err)?;
    b.finish().map_err(frame_err)?;
    if server_name != meta.name {
        return Err(LinkError::ShmMalformed {
            what: "the agent on the shm socket is not the one the metadata names",
        });
    }
    let exchange = wire::Exchange {
        roles: wire::SHM_ROLES,
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        client_name: &inner.name,
        server_name: &server_name,
    };
    let proof = exchange.client_proof(inner.token.as_deref());
    s.write_all(&wire::frame(
        wire::PROOF,
        &wire::proof_body(None, proof.as_ref()),
    ))
    .map_err(io)?;
    let (_, len) = wire::read_header(s, &[wire::AUTH_RESULT], |_| wire::MAX_CONTROL_BODY)
        .map_err(frame_err)?;
    let body = wire::read_body(s, len).map_err(frame_err)?;
    let mut b = Body(&body);
    let ok = b.u8().map_err(frame_err)? != 0;
    let answer = b.proof().map_err(frame_err)?;
    b.finish().map_err(frame_err)?;
    if !ok {
        return Err(LinkError::ShmAuthRejected);
    }
    if inner.token.is_some()
        && (!auth_required || !exchange.check_server(inner.token.as_deref(), answer))
    {
        return Err(LinkError::ShmPeerAuthFailed);
    }
    Ok(())
}

/// Receives `SHM_REGION` frames (each with its memfd) until `SHM_END`, mapping each.
fn receive_regions(s: &mut UnixStream) -> Result<HashMap<u64, Arc<MappedRegion>>, LinkError> {
    let io = |source| LinkError::ShmSocket {
        op: "receiving regions",
        source,
    };
    let mut regions = HashMap::new();
    loop {
        // The descriptor rides on the frame's first byte: read the header with recvmsg.
        let mut header = [0u8; wire::HEADER_LEN];
        let mut got = 0;
        let mut fds = Vec::new();
        while got < header.len() {
            let (n, more) = recv_with_fds(s.as_fd(), &mut header[got..]).map_err(io)?;
            if n == 0 {
                return Err(io(io::ErrorKind::UnexpectedEof.into()));
            }
            got += n;
            fds.extend(more);
        }
        let (ty, len) =
            wire::read_header(&mut &header[..], &[wire::SHM_REGION, wire::SHM_END], |ty| {
                if ty == wire::SHM_REGION {
                    wire::SHM_REGION_LEN
                } else {
                    0
                }
            })
            .map_err(frame_err)?;
        if ty == wire::SHM_END {
            return Ok(regions);
        }
        let mut body = [0u8; wire::SHM_REGION_LEN];
        if len != body.len() {
            return Err(LinkError::ShmMalformed {
                what: "short SHM_REGION frame",
            });
        }
        s.read_exact(&mut body).map_err(io)?;
        let mut b = Body(&body);
        let (id, key, region_len) = (
            b.u64().map_err(frame_err)?,
            b.u64().map_err(frame_err)?,
            b.u64().map_err(frame_err)?,
        );
        let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
            return Err(LinkError::ShmMalformed {
                what: "SHM_REGION frame without exactly one descriptor",
            });
        };
        if regions.len() >= MAX_REGIONS {
            return Err(LinkError::ShmMalformed {
                what: "too many shm regions",
            });
        }
        let view = SharedRegionView::map(fd, region_len)
            .map_err(|source| LinkError::ShmMap { region: id, source })?;
        regions.insert(id, Arc::new(MappedRegion { key, view }));
    }
}

impl ShmLink {
    /// Checks `len` bytes at `offset` of the peer's region `region` under `key`, as P's
    /// TCP server would.
    fn check(
        &self,
        region: u64,
        key: u64,
        offset: u64,
        len: u64,
    ) -> Result<&Arc<MappedRegion>, Refusal> {
        let r = self.regions.get(&region).ok_or(Refusal::UnknownRegion)?;
        if !wire::keys_equal(r.key, key) {
            return Err(Refusal::BadKey);
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > r.view.len() as u64)
        {
            return Err(Refusal::OutOfBounds);
        }
        Ok(r)
    }

    pub(crate) fn post(&self, batch: &Arc<Batch>, chunks: Vec<Chunk>) -> Result<(), TransferError> {
        let fence_region = batch.lock().fence.map(|f| f.remote.region);
        let eligible = chunks.iter().all(|c| {
            self.regions.contains_key(&c.remote.region) && c.dest.kind().is_host_accessible()
        }) && fence_region.is_none_or(|r| self.regions.contains_key(&r));
        if !eligible {
            // A region registered after connect, or device memory: TCP moves it.
            return self.tcp.post(batch, chunks);
        }
        if !self.tcp.is_connected() {
            return Err(self.disconnected("no live connection"));
        }
        let mut copies = Vec::with_capacity(chunks.len());
        for c in chunks {
            match self.check(c.remote.region, c.remote.key, c.remote.offset, c.len) {
                Ok(src) => copies.push(CopyOp {
                    src: src.clone(),
                    src_offset: c.remote.offset,
                    dest: c.dest,
                    dest_offset: c.dest_offset,
                    len: c.len,
                }),
                Err(reason) => {
                    batch.lock().fail(TransferError::Refused {
                        peer: self.peer.clone(),
                        region: c.remote.region,
                        offset: c.remote.offset,
                        len: c.len,
                        reason,
                    });
                    return Ok(());
                }
            }
        }
        batch.lock().backend = Backend::Shm;
        let sent = lock(&self.jobs).as_ref().map(|tx| {
            tx.send(Job {
                batch: batch.clone(),
                copies,
            })
        });
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(self.disconnected("link closed")),
        }
    }

    fn disconnected(&self, reason: &str) -> TransferError {
        TransferError::Disconnected {
            peer: self.peer.clone(),
            reason: reason.to_owned(),
        }
    }

    pub(crate) fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        self.tcp.send_notif(bytes)
    }

    /// The copier checks the batch between chunks and stops; TCP cancels its part.
    pub(crate) fn on_timeout(&self, batch: &Batch) {
        self.tcp.on_timeout(batch);
    }

    pub(crate) fn close(&self) {
        // The copier thread ends once the queue is drained and the sender gone.
        lock(&self.jobs).take();
        self.tcp.close();
    }

    /// The fence word of `batch` (checked like a data read), or why it was refused.
    fn fence_word(
        regions: &HashMap<u64, Arc<MappedRegion>>,
        remote: crate::agent::RemoteRange,
    ) -> Result<u64, Refusal> {
        let r = regions.get(&remote.region).ok_or(Refusal::UnknownRegion)?;
        if !wire::keys_equal(r.key, remote.key) {
            return Err(Refusal::BadKey);
        }
        // Out of bounds, or not 8-aligned (fence words are FenceTable slots).
        r.view
            .load_u64(remote.offset)
            .map_err(|_| Refusal::OutOfBounds)
    }
}

/// The copier thread's state.
struct Worker {
    peer: String,
    tcp: Arc<TcpLink>,
    regions: Arc<HashMap<u64, Arc<MappedRegion>>>,
}

impl Worker {
    fn run(&self, jobs: &Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            self.run_job(&job);
        }
    }

    fn run_job(&self, job: &Job) {
        let batch = &job.batch;
        {
            let mut st = batch.lock();
            if !st.is_running() {
                return;
            }
            st.in_receive += 1;
        }
        let copied = copy_all(batch, &job.copies);
        let next = {
            let mut st = batch.lock();
            st.in_receive -= 1;
            let mut next = Next::Nothing;
            if copied {
                for c in &job.copies {
                    next = st.chunk_done(c.len);
                }
            }
            next
        };
        let next = match next {
            Next::Fence(fence) => {
                // Every data copy finished above (the scoped threads were joined); no
                // later load may move before the fence word's.
                std::sync::atomic::fence(Ordering::Acquire);
                match ShmLink::fence_word(&self.regions, fence.remote) {
                    Ok(found) => batch.lock().fence_done(&self.peer, fence.expected, found),
                    Err(reason) => {
                        batch.lock().fail(TransferError::Refused {
                            peer: self.peer.clone(),
                            region: fence.remote.region,
                            offset: fence.remote.offset,
                            len: 8,
                            reason,
                        });
                        Next::Nothing
                    }
                }
            }
            other => other,
        };
        // Notify and Finish: the notification goes over TCP, then the batch is done.
        self.tcp.advance(batch, next);
    }
}

/// Copies the batch's data, splitting a large batch over scoped threads. Returns false
/// when the batch stopped running meanwhile (failed or timed out): the caller's memory
/// must not be written any further.
fn copy_all(batch: &Batch, copies: &[CopyOp]) -> bool {
    let total: u64 = copies.iter().map(|c| c.len).sum();
    let threads = if total > SPLIT_BYTES {
        std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_COPY_THREADS)
            .min(copies.len())
    } else {
        1
    };
    if threads <= 1 {
        return copy_some(batch, copies);
    }
    // Contiguous groups of about equal bytes.
    let share = total.div_ceil(threads as u64);
    let mut groups = Vec::with_capacity(threads);
    let mut start = 0;
    let mut acc = 0;
    for (i, c) in copies.iter().enumerate() {
        acc += c.len;
        if acc >= share && groups.len() + 1 < threads {
            groups.push(&copies[start..=i]);
            start = i + 1;
            acc = 0;
        }
    }
    if start < copies.len() {
        groups.push(&copies[start..]);
    }
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(groups.len());
        let mut here = Vec::new();
        for g in groups.iter().skip(1) {
            match std::thread::Builder::new()
                .name("kvl-shm-copy".into())
                .spawn_scoped(scope, || copy_some(batch, g))
            {
                Ok(h) => handles.push(h),
                // No thread: copy that group on this one.
                Err(_) => here.push(*g),
            }
        }
        let mut ok = groups.first().is_none_or(|g| copy_some(batch, g));
        for g in here {
            ok &= copy_some(batch, g);
        }
        for h in handles {
            ok &= h.join().unwrap_or(false);
        }
        ok
    })
}

fn copy_some(batch: &Batch, copies: &[CopyOp]) -> bool {
    for c in copies {
        if !batch.lock().is_running() {
            return false;
        }
        if let Err(err) = c
            .src
            .view
            .copy_to(c.src_offset, c.dest.as_ref(), c.dest_offset, c.len)
        {
            // Both ranges were checked at post time; fail rather than panic.
            batch.lock().fail(TransferError::LocalCopy {
                peer: batch.peer.clone(),
                reason: err.to_string(),
            });
            return false;
        }
    }
    true
}
