//! P's side: the abstract Unix socket that hands region descriptors and a notification
//! ring to authenticated peers on the same host, and the ring's drain.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvlease_gpu_mem::{
    CmaError, DmaRegion, HostRegion, HugePagePolicy, PeerProcessRange, Ptracer, RegionBytes,
    RingReader, SharedRegionView, recv_with_fds, send_with_fds, set_ptracer, socket_peer_pid,
};
use kvlease_proto::auth::ServerAuth;

use super::copy::{self, CopyOp};
use super::mapped::{CopyError, Source};
use super::{MAX_REGIONS, METADATA_KEY, cma_peer_pid, host_identity, ring_shape};
use crate::config::CmaPolicy;
use crate::context::Context;
use crate::error::Refusal;
use crate::notify::{Drained, Groups, NotifSource, push_grouped};
use crate::stats::{Counters, bump};
use crate::sync::lock;
use crate::tcp::server::{PullCopy, WriteReq, land_bytes, serve_pulled_writes, serve_write};
use crate::tcp::wire::{self, Body, FrameError};

/// Descriptors received on a write stream and not yet claimed by an `SHM_WRITE_SRC`
/// frame (one reads ahead of the frame that carries it) before the peer counts as broken.
const MAX_STRAY_FDS: usize = 16;

/// Most `WRITE_PULL`s landed together: a writer's window (see `shm::write`).
const MAX_PULL_GROUP: usize = super::write::WINDOW;

/// The Unix-socket connections being served, shut down when the agent stops.
#[derive(Debug, Default)]
struct Conns {
    next: AtomicU64,
    open: Mutex<HashMap<u64, UnixStream>>,
}

/// Which shareable regions are registered, for peers that mapped them: slot `i` of the
/// table holds the id of the region granted slot `i`, and 0 once it was deregistered.
/// P stores the words; peers map the table read-only (a [`HostRegion`]: sealed against
/// every writer but P's own mapping) and check a region's slot before they read it.
#[derive(Debug)]
struct Grants {
    table: HostRegion,
    slots: Mutex<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    by_region: HashMap<u64, u64>,
    free: Vec<u64>,
    /// Slots below this were handed out at least once.
    next: u64,
}

impl Grants {
    fn new() -> Result<Self, kvlease_gpu_mem::HostAllocError> {
        Ok(Self {
            table: HostRegion::with_policy(MAX_REGIONS * 8, HugePagePolicy::Never)?,
            slots: Mutex::default(),
        })
    }

    /// Grants `region` (an id, never 0) a slot; `None` when all are taken.
    fn grant(&self, region: u64) -> Option<u64> {
        let mut s = lock(&self.slots);
        let slot = match s.free.pop() {
            Some(slot) => slot,
            None if s.next < MAX_REGIONS as u64 => {
                s.next += 1;
                s.next - 1
            }
            None => return None,
        };
        // In bounds: `slot < MAX_REGIONS`, 8-aligned.
        if self.table.store_u64(slot * 8, region).is_err() {
            s.free.push(slot);
            return None;
        }
        s.by_region.insert(region, slot);
        Some(slot)
    }

    /// Withdraws `region`'s grant: peers refuse to read it from now on.
    fn revoke(&self, region: u64) {
        let mut s = lock(&self.slots);
        if let Some(slot) = s.by_region.remove(&region) {
            // Cannot fail: the slot was stored to in `grant`.
            let _ = self.table.store_u64(slot * 8, 0);
            s.free.push(slot);
        }
    }

    fn slot_of(&self, region: u64) -> Option<u64> {
        lock(&self.slots).by_region.get(&region).copied()
    }
}

/// P's side: the abstract Unix socket that hands region descriptors to authenticated
/// peers on the same host.
#[derive(Debug)]
pub(crate) struct Server {
    name: String,
    listener: Option<JoinHandle<()>>,
    conns: Arc<Conns>,
    grants: Arc<Grants>,
    cma: CmaPolicy,
}

impl Server {
    /// Binds a fresh abstract socket and starts its accept thread; the metadata entry
    /// names it. `None` (logged) when the host has no identity or binding fails: peers
    /// then use another backend.
    pub(crate) fn start(ctx: &Arc<Context>) -> Option<Self> {
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
        let grants = match Grants::new() {
            Ok(g) => Arc::new(g),
            Err(err) => {
                tracing::warn!(%err, "shm backend off: allocating its grant table failed");
                return None;
            }
        };
        let conns = Arc::new(Conns::default());
        let (ctx2, conns2, grants2) = (ctx.clone(), conns.clone(), grants.clone());
        let handle = std::thread::Builder::new()
            .name("kvl-shm-listen".into())
            .spawn(move || accept_loop(&ctx2, &conns2, &grants2, &listener));
        let handle = match handle {
            Ok(h) => h,
            Err(err) => {
                tracing::warn!(%err, "shm backend off: starting its thread failed");
                return None;
            }
        };
        ctx.set_backend_metadata(
            METADATA_KEY,
            Some(serde_json::json!({
                "host": identity,
                "socket": name,
                "write": true,
                "write_pull": true,
                "write_pull_cma": ctx.cma != CmaPolicy::Off,
            })),
        );
        tracing::debug!(socket = %name, "shm backend listening");
        Some(Self {
            name,
            listener: Some(handle),
            conns,
            grants,
            cma: ctx.cma,
        })
    }

    /// A region was registered: peers that connect from now on get it, if its memory is
    /// shareable (call before the region becomes visible in `Context::regions`).
    pub(crate) fn grant(&self, id: u64, region: &dyn DmaRegion) {
        if shareable(region, self.cma) && self.grants.grant(id).is_none() {
            tracing::warn!(
                id,
                max = MAX_REGIONS,
                "shm grant table full: peers read this region over TCP"
            );
        }
    }

    /// A region was deregistered (call after it left `Context::regions`): peers that
    /// mapped it refuse to read it from now on.
    pub(crate) fn revoke(&self, id: u64) {
        self.grants.revoke(id);
    }

    /// Stops the accept thread (the agent's shutdown flag is already set) and shuts down
    /// the connections it accepted.
    pub(crate) fn stop(&mut self) {
        // Wake `accept` so that it sees the flag.
        let _ = UnixAddr::from_abstract_name(self.name.as_bytes())
            .and_then(|a| UnixStream::connect_addr(&a));
        if let Some(h) = self.listener.take()
            && h.join().is_err()
        {
            tracing::error!("shm listener thread panicked");
        }
        for (_, s) in lock(&self.conns.open).drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Whether peers get `region` over the socket: a memfd-backed host region, other host
/// memory when cross-memory attach is on (handed over as its address), or (feature
/// `cuda`) CUDA device memory, handed over as a CUDA IPC handle.
fn shareable(region: &dyn DmaRegion, cma: CmaPolicy) -> bool {
    let host = region.kind().is_host_accessible()
        && (region.shared_fd().is_some() || cma != CmaPolicy::Off);
    #[cfg(feature = "cuda")]
    let host = host || super::cuda::is_device(region.kind());
    host
}

/// Lets the peer process of `s` (the kernel's word, `SO_PEERCRED`) read this process with
/// cross-memory attach, as `policy` says; logs what it could not do (the peer's reads of
/// such regions then go over TCP where the kernel refuses them, its pulls of this
/// process's writes on the socket).
pub(super) fn name_ptracer(s: &UnixStream, policy: CmaPolicy, peer: &str) {
    let who = match policy {
        CmaPolicy::Off => return,
        CmaPolicy::AnyProcess => Ptracer::Any,
        _ => match socket_peer_pid(s.as_fd()) {
            Ok(Some(pid)) => Ptracer::Process(pid),
            Ok(None) => {
                tracing::debug!(
                    peer,
                    "shm peer's process is not visible here (another pid namespace); not named as ptracer"
                );
                return;
            }
            Err(err) => {
                tracing::warn!(peer, %err, "SO_PEERCRED failed; shm peer not named as ptracer");
                return;
            }
        },
    };
    match set_ptracer(who) {
        Ok(()) => tracing::debug!(peer, ?who, "named the shm peer as ptracer (cma)"),
        // No Yama: the ordinary ptrace rules decide, nothing to name.
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
            tracing::debug!(peer, %err, "PR_SET_PTRACER not available (no Yama)");
        }
        Err(err) => tracing::warn!(peer, %err, "PR_SET_PTRACER failed"),
    }
}

fn accept_loop(
    ctx: &Arc<Context>,
    conns: &Arc<Conns>,
    grants: &Arc<Grants>,
    listener: &UnixListener,
) {
    for stream in crate::tcp::server::accepted(listener.incoming(), &ctx.shutdown, "shm") {
        let id = conns.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut open = lock(&conns.open);
            if open.len() >= ctx.limits.max_inbound_connections {
                tracing::warn!(
                    max = ctx.limits.max_inbound_connections,
                    "too many shm connections; connection dropped"
                );
                continue;
            }
            match stream.try_clone() {
                Ok(s) => open.insert(id, s),
                Err(err) => {
                    tracing::warn!(%err, "shm connection dropped: cloning its socket failed");
                    continue;
                }
            };
        }
        let (ctx2, conns2, grants2) = (ctx.clone(), conns.clone(), grants.clone());
        let spawned = std::thread::Builder::new()
            .name("kvl-shm-serve".into())
            .spawn(move || {
                // Counted before the peer can see the socket closed: `open` holds a
                // clone of it until below, and `serve` counts what it shuts down itself.
                match serve(&ctx2, &grants2, stream) {
                    Err(FrameError::Malformed(why)) => malformed(&ctx2, &why),
                    Err(FrameError::Io(err)) => {
                        tracing::debug!(%err, "shm socket connection ended");
                    }
                    Ok(()) => {}
                }
                lock(&conns2.open).remove(&id);
            });
        if let Err(err) = spawned {
            lock(&conns.open).remove(&id);
            tracing::error!(%err, "could not start an shm connection thread; connection dropped");
        }
    }
}

/// Serves one Unix-socket connection: the handshake; if it succeeded the grant table, the
/// ring and the regions, then waits until the peer closes the connection. A malformed
/// frame after the hand-over is counted here, before the socket is shut down, and
/// answered `Ok`; one before it is the caller's to count.
fn serve(ctx: &Context, grants: &Grants, mut s: UnixStream) -> Result<(), FrameError> {
    s.set_read_timeout(Some(ctx.limits.handshake_timeout))?;
    s.set_write_timeout(Some(ctx.limits.handshake_timeout))?;
    let (_, len) = wire::read_header(&mut s, &[wire::HELLO], |_| wire::MAX_CONTROL_BODY)?;
    let body = wire::read_body(&mut s, len)?;
    let server_nonce = wire::random_nonce().map_err(|e| io::Error::other(e.to_string()))?;
    let challenged = ServerAuth::new(
        wire::SHM_ROLES,
        server_nonce,
        &ctx.name,
        ctx.token.as_deref(),
    )
    .on_hello(&body)?;
    s.write_all(&wire::frame(wire::CHALLENGE, &challenged.reply))?;
    let auth = challenged.into_waiting()?;
    let (_, len) = wire::read_header(&mut s, &[wire::PROOF], |_| wire::MAX_CONTROL_BODY)?;
    let body = wire::read_body(&mut s, len)?;
    let Some((client, ())) =
        crate::tcp::server::answer_client_proof(ctx, auth, &body, &mut s, || Ok(()))?
    else {
        tracing::debug!("shm peer refused; no memory handed over");
        return Ok(());
    };
    let client_name = client.name.clone();
    let Some(table_fd) = grants.table.shared_fd() else {
        return Err(FrameError::Io(io::Error::other(
            "the grant table is not shareable",
        )));
    };
    let f = wire::frame(wire::SHM_GRANTS, &(grants.table.len() as u64).to_le_bytes());
    send_with_fds(s.as_fd(), &f, &[table_fd])?;
    // The ring before the regions: D may notify as soon as it has seen `SHM_END`.
    let (capacity, max_record) = ring_shape(ctx.limits.max_notif_len);
    let closed = Arc::new(AtomicBool::new(false));
    match RingReader::new(capacity, max_record) {
        Ok(ring) => {
            let mut body = [0u8; wire::SHM_RING_LEN];
            body[..8].copy_from_slice(&(capacity as u64).to_le_bytes());
            body[8..].copy_from_slice(&(max_record as u64).to_le_bytes());
            send_with_fds(s.as_fd(), &wire::frame(wire::SHM_RING, &body), &[ring.fd()])?;
            ctx.notif_sources.add(Box::new(RingSource {
                peer: client,
                ring,
                closed: closed.clone(),
                conn: s.try_clone()?,
            }));
        }
        // The peer's notifications then come over its TCP link.
        Err(err) => {
            tracing::warn!(peer = %client_name, %err, "no notification ring for an shm peer")
        }
    }
    // Snapshot the granted regions; the descriptors are sent without the lock held. A
    // region deregistered meanwhile has its slot cleared (or reused for another id): D
    // refuses to read it.
    // Only shareable regions hold a grant slot (`Server::grant`): memfd-backed host
    // memory, other host memory when cma is on, and, with the `cuda` feature, device
    // memory.
    #[allow(unused_mut, reason = "only the cuda build splits off device regions")]
    let mut regions: Vec<(Arc<dyn DmaRegion>, crate::metadata::RegionDesc, u64)> = ctx
        .regions
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .values()
        .filter_map(|r| Some((r.region.clone(), r.desc, grants.slot_of(r.desc.id)?)))
        .take(MAX_REGIONS)
        .collect();
    #[cfg(feature = "cuda")]
    let devices: Vec<_> = regions
        .extract_if(.., |(region, ..)| super::cuda::is_device(region.kind()))
        .collect();
    // Before any address goes out, and only when one will (naming a ptracer lets that
    // process attach to this one, not only read it).
    if regions
        .iter()
        .any(|(r, ..)| r.shared_fd().is_none() && r.kind().is_host_accessible())
    {
        name_ptracer(&s, ctx.cma, &client_name);
    }
    let handed = (|| -> Result<(), FrameError> {
        for (region, desc, slot) in &regions {
            let body = super::region_body(desc, *slot);
            match region.shared_fd() {
                Some(fd) => {
                    send_with_fds(s.as_fd(), &wire::frame(wire::SHM_REGION, &body), &[fd])?;
                }
                // Host memory that is not memfd-backed (granted only with cma on): its
                // address, for `process_vm_readv`.
                None if region.kind().is_host_accessible() && ctx.cma != CmaPolicy::Off => {
                    let mut cma = [0u8; wire::SHM_CMA_REGION_LEN];
                    cma[..body.len()].copy_from_slice(&body);
                    cma[body.len()..].copy_from_slice(&(region.base_ptr() as u64).to_le_bytes());
                    s.write_all(&wire::frame(wire::SHM_CMA_REGION, &cma))?;
                }
                None => {}
            }
        }
        // Held until D closes the socket: D may read the device memory until then.
        #[cfg(feature = "cuda")]
        let _exports = super::cuda::hand_over(&mut s, &client_name, &devices)?;
        s.write_all(&wire::header(wire::SHM_END, 0))?;
        tracing::debug!(peer = %client_name, regions = regions.len(), "shm regions handed over");
        // D keeps the socket open for the link's life; what it sends from now on is
        // fenced writes into this agent's memory.
        s.set_read_timeout(None)?;
        s.set_write_timeout(Some(ctx.limits.serve_write_timeout))?;
        serve_writes(ctx, &mut s, &client_name)
    })();
    // Whatever ended the connection, the ring delivers what it holds, then goes; a
    // connection ended by a malformed frame is counted, then shut down (the ring's drain
    // holds a clone of the socket), so that a peer that sees it closed sees it counted.
    closed.store(true, Ordering::Release);
    match handed {
        Err(FrameError::Malformed(why)) => {
            malformed(ctx, &why);
            let _ = s.shutdown(std::net::Shutdown::Both);
            Ok(())
        }
        Err(err) => {
            let _ = s.shutdown(std::net::Shutdown::Both);
            Err(err)
        }
        Ok(()) => Ok(()),
    }
}

/// Counts and logs a connection closed for a malformed frame.
fn malformed(ctx: &Context, why: &str) {
    bump(&ctx.counters.malformed_frames);
    tracing::warn!(%why, "malformed frame on the shm socket; closed");
}

//= docs/spec.md#the-write-fence
//# A write lands only in blocks D holds for that transfer under that generation
//# (and registered with the writing P engine): D's receiver checks this before any byte
//# lands, and a write that does not pass is refused and reported to P as failed.
/// Serves the fenced writes an authenticated peer sends on its Unix socket after the
/// hand-over, one at a time and in order, until it closes the socket: the TCP write
/// protocol (`WRITE_REQ` and its payload; `WRITE_ACK` or `WRITE_ERR`), landed by
/// [`serve_write`] as the TCP receiver lands them, and writes this process pulls from
/// the peer's memory (`WRITE_PULL`), landed by [`serve_pulled_writes`]: from a memfd the
/// peer handed over with `SHM_WRITE_SRC` and this process mapped read-only, or from a
/// range of the peer's process it named with `SHM_WRITE_CMA_SRC`, read with
/// `process_vm_readv`. The `WRITE_PULL`s that arrived together under one fence word and
/// generation (at most [`MAX_PULL_GROUP`], [`wire::MAX_WRITE_LEN`] bytes in all, as much
/// as one `WRITE_REQ` may carry) land together: the word checked once, the copies made
/// as a shm batch's reads are (consecutive cma ones in one `process_vm_readv`, the copy
/// pool's threads helping when they are large), each answered in order. Either way the
/// bytes reach the destination only under the fence word's stripe of the write-fence
/// lock, after the word was found to hold the write's generation: a `WRITE_REQ`'s from a
/// buffer of this process, a `WRITE_PULL`'s straight from the peer's pages. The peer
/// never maps this agent's memory writable (its memfds are sealed against it) and never
/// holds that lock: a peer that stalls or dies mid-write holds only this connection's
/// thread, and [`Agent::set_write_fence`](crate::Agent::set_write_fence) waits at most
/// for the copies of one write or group already under way (at most
/// [`wire::MAX_WRITE_LEN`] bytes).
fn serve_writes(ctx: &Context, s: &mut UnixStream, peer: &str) -> Result<(), FrameError> {
    let mut r = io::BufReader::with_capacity(
        64 * 1024,
        FdReader {
            sock: s.try_clone()?,
            fds: VecDeque::new(),
        },
    );
    // The answers, sent when no further frame is buffered here (before a read that may
    // wait for the peer): one send for the answers to every frame that arrived together.
    let mut answers = io::BufWriter::with_capacity(4096, s.try_clone()?);
    // One write's payload at a time, grown to the largest write seen (at most
    // `wire::MAX_WRITE_LEN`).
    let mut landing = Vec::new();
    // The peer's regions handed over to pull from, by source id; the refusal for writes
    // from one this process cannot pull from.
    let mut sources: HashMap<u64, Result<Arc<Source>, Refusal>> = HashMap::new();
    // The peer's process, for its cma sources: looked up at the first (`None` until then).
    let mut writer_pid: Option<Option<u32>> = None;
    // Pulled writes into memory their source cannot copy into (device or staged host
    // memory) go through it.
    let bounce = std::cell::RefCell::new(Bounce::default());
    let len_of = |ty| match ty {
        wire::WRITE_REQ => wire::WRITE_REQ_LEN,
        wire::WRITE_PULL => wire::WRITE_PULL_LEN,
        wire::SHM_WRITE_CMA_SRC => wire::SHM_WRITE_CMA_SRC_LEN,
        _ => wire::SHM_WRITE_SRC_LEN,
    };
    loop {
        let allowed = [
            wire::WRITE_REQ,
            wire::WRITE_PULL,
            wire::SHM_WRITE_SRC,
            wire::SHM_WRITE_CMA_SRC,
        ];
        if r.buffer().len() < wire::HEADER_LEN + wire::WRITE_PULL_LEN {
            // The next frame may not have arrived yet: the peer may wait for these.
            answers.flush()?;
        }
        let (ty, len) = match wire::read_header(&mut r, &allowed, len_of) {
            Ok(h) => h,
            // The peer closed the socket between frames: the link's end.
            Err(FrameError::Io(err)) if err.kind() == io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Err(err) => return Err(err),
        };
        if len != len_of(ty) {
            return Err(FrameError::Malformed(format!(
                "a frame of type {ty} with a body of {len} bytes"
            )));
        }
        let body = wire::read_body(&mut r, len)?;
        let mut b = Body(&body);
        match ty {
            wire::WRITE_REQ => {
                let write = WriteReq::parse(&mut b)?;
                // Its payload follows, perhaps not all here yet.
                answers.flush()?;
                serve_write(ctx, &mut r, &mut answers, &mut landing, true, &write)?;
            }
            wire::WRITE_PULL => {
                // With the pulls buffered behind it under the same fence word: copied
                // together (with the copy pool's help when large), answered in order.
                let mut group = vec![WriteReq::parse_pull(&mut b)?];
                let mut group_len = group[0].0.len();
                while group.len() < MAX_PULL_GROUP
                    && let Some(next) = buffered_pull(r.buffer())
                    && group[0].0.pulls_with(&next.0, group_len)
                {
                    r.consume(wire::HEADER_LEN + wire::WRITE_PULL_LEN);
                    group_len += next.0.len();
                    group.push(next);
                }
                let writes = group
                    .into_iter()
                    .map(|(write, (src, src_offset))| {
                        let source = match sources.get(&src) {
                            Some(source) => source.clone(),
                            None => Err(Refusal::UnknownRegion),
                        };
                        (write, source.map(|source| (source, src_offset)))
                    })
                    .collect();
                let copy = |all: Vec<PullCopy<'_, (Arc<Source>, u64)>>| {
                    // Into memory a plain copy cannot reach: each through the bounce
                    // buffer, by `copy_one`.
                    if all.iter().any(|c| !c.src.0.accepts(c.dest.kind())) {
                        return false;
                    }
                    let copies = all
                        .into_iter()
                        .map(|c| CopyOp {
                            src: c.src.0.clone(),
                            src_offset: c.src.1,
                            dest: c.dest,
                            dest_offset: c.offset,
                            len: c.len,
                        })
                        .collect();
                    copy::pull(copies)
                };
                let copy_one =
                    |(src, src_offset): &(Arc<Source>, u64), dest: &dyn DmaRegion, offset, len| {
                        if src.accepts(dest.kind()) {
                            src.copy_to(*src_offset, dest, offset, len)
                                .map_err(pull_refusal)
                        } else {
                            bounce
                                .borrow_mut()
                                .pull(src, *src_offset, dest, offset, len)
                        }
                    };
                serve_pulled_writes(ctx, &mut answers, writes, copy, copy_one)?;
            }
            wire::SHM_WRITE_CMA_SRC => {
                let (id, region_len, addr) = (b.u64()?, b.u64()?, b.u64()?);
                b.finish()?;
                check_new_source(&sources, id)?;
                let pid = *writer_pid.get_or_insert_with(|| {
                    let then = "its writes from non-memfd memory come on the socket";
                    cma_peer_pid(ctx.cma, s, peer, then)
                });
                // Not readable here (cma off, the writer's process not visible in this pid
                // namespace, not a range): its writes are refused, and the writer sends
                // their bytes on the socket.
                let source = match pid.map(|pid| PeerProcessRange::new(pid, addr, region_len)) {
                    Some(Ok(range)) => Ok(Arc::new(Source::Cma(range))),
                    Some(Err(err)) => {
                        tracing::warn!(peer, source = id, %err, "a write source the shm peer named cannot be read; writes from it are refused and come on the socket");
                        Err(Refusal::SourceUnreadable)
                    }
                    None => Err(Refusal::SourceUnreadable),
                };
                sources.insert(id, source);
            }
            _ => {
                let (id, region_len) = (b.u64()?, b.u64()?);
                b.finish()?;
                // The descriptor came with the frame's first byte, read by now (those
                // of later frames read ahead queue behind it).
                let Some(fd) = r.get_mut().fds.pop_front() else {
                    return Err(FrameError::Malformed(
                        "an SHM_WRITE_SRC frame without a descriptor".into(),
                    ));
                };
                check_new_source(&sources, id)?;
                let view = SharedRegionView::map(fd, region_len)
                    .inspect_err(|err| {
                        tracing::warn!(source = id, %err, "a write source the shm peer handed over cannot be mapped; writes from it are refused");
                    })
                    .map(|view| Arc::new(Source::Host(view)))
                    .map_err(|_| Refusal::UnknownRegion);
                sources.insert(id, view);
            }
        }
    }
}

/// A host buffer for pulled writes into memory their source cannot copy into (device or
/// staged host memory): the write is copied out of the writer's memory into `region`,
/// then into `bytes`, then into place ([`land_bytes`]). Grown to the largest such write
/// (at most [`wire::MAX_WRITE_LEN`]), kept for the connection.
#[derive(Default)]
struct Bounce {
    region: Option<HostRegion>,
    bytes: Vec<u8>,
}

impl Bounce {
    /// Lands `len` bytes at `src_offset` of `src` in `dest` at `offset` (under the fence
    /// lock the caller holds), as a pulled write is answered.
    fn pull(
        &mut self,
        src: &Source,
        src_offset: u64,
        dest: &dyn DmaRegion,
        offset: u64,
        len: u64,
    ) -> Result<(), Refusal> {
        // Checked against `wire::MAX_WRITE_LEN` before.
        let n = len as usize;
        if self.region.as_ref().is_none_or(|r| r.len() < n) {
            self.region = None;
            let region = HostRegion::with_policy(n, HugePagePolicy::Never).map_err(|err| {
                tracing::warn!(len, %err, "no bounce buffer for a pulled write into device memory; refused");
                Refusal::NotHostAccessible
            })?;
            self.region = Some(region);
        }
        let Some(region) = self.region.as_ref() else {
            return Err(Refusal::NotHostAccessible);
        };
        src.copy_to(src_offset, region, 0, len)
            .map_err(pull_refusal)?;
        self.bytes.resize(n, 0);
        region
            .read_into(0, &mut self.bytes[..n])
            .map_err(|_| Refusal::OutOfBounds)?;
        land_bytes(dest, offset, &self.bytes[..n])
    }
}

/// The refusal a pulled write gets when its copy out of the writer's memory failed.
fn pull_refusal(err: CopyError) -> Refusal {
    match err {
        CopyError::Host(_) | CopyError::Cma(CmaError::Access(_)) => Refusal::OutOfBounds,
        // Refused (the writer named another ptracer since; its process is gone) or
        // failed part-way (its range unmapped): the writer sends the bytes itself, or its
        // batch fails.
        err => {
            tracing::debug!(%err, "pulling a write from the shm peer's process failed");
            Refusal::SourceUnreadable
        }
    }
}

/// The `WRITE_PULL` frame at the start of `buffered` (bytes read from the stream and
/// not consumed yet), if a whole and well-formed one is there; anything else is left for
/// the stream's own reading, which refuses what is malformed.
fn buffered_pull(buffered: &[u8]) -> Option<(WriteReq, (u64, u64))> {
    let frame = buffered.get(..wire::HEADER_LEN + wire::WRITE_PULL_LEN)?;
    let (header, body) = frame.split_at(wire::HEADER_LEN);
    let want = wire::header(wire::WRITE_PULL, wire::WRITE_PULL_LEN);
    if header != want {
        return None;
    }
    WriteReq::parse_pull(&mut Body(body)).ok()
}

/// A source id not handed over before, within [`MAX_REGIONS`] sources.
fn check_new_source(
    sources: &HashMap<u64, Result<Arc<Source>, Refusal>>,
    id: u64,
) -> Result<(), FrameError> {
    if sources.len() >= MAX_REGIONS || sources.contains_key(&id) {
        return Err(FrameError::Malformed(
            "a write source handed over twice, or too many".into(),
        ));
    }
    Ok(())
}

/// The write stream's socket, read with `recvmsg`: the descriptors that come with
/// `SHM_WRITE_SRC` frames are kept, in order, for the frame that carries them.
struct FdReader {
    sock: UnixStream,
    fds: VecDeque<OwnedFd>,
}

impl io::Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let (n, fds) = recv_with_fds(self.sock.as_fd(), buf)?;
        self.fds.extend(fds);
        if self.fds.len() > MAX_STRAY_FDS {
            return Err(io::Error::other(
                "the shm peer sent descriptors no frame names",
            ));
        }
        Ok(n)
    }
}

/// One D's notification ring, drained by P's `get_new_notifs`.
#[derive(Debug)]
struct RingSource {
    peer: crate::Sender,
    ring: RingReader,
    /// Set once D's Unix-socket connection ended: drain what is left, then finish.
    closed: Arc<AtomicBool>,
    /// That connection, shut down when the ring is found corrupt.
    conn: UnixStream,
}

impl NotifSource for RingSource {
    fn drain(&mut self, counters: &Counters, out: &mut Groups) -> Drained {
        // Loaded before the drain: what D pushed before it closed is drained below.
        let closed = self.closed.load(Ordering::Acquire);
        if !self.ring.is_empty() {
            let Self { peer, ring, .. } = self;
            let mut n = 0u64;
            let drained = ring.drain(|m| {
                n += 1;
                push_grouped(out, peer, m);
            });
            counters.notifs_received.fetch_add(n, Ordering::Relaxed);
            match drained {
                Ok(_) => {}
                Err(err) => {
                    bump(&counters.notif_rings_corrupt);
                    tracing::warn!(peer = %self.peer, %err, "shm peer's notification ring corrupt; ring and connection closed");
                    let _ = self.conn.shutdown(std::net::Shutdown::Both);
                    return Drained::Finished;
                }
            }
        }
        if closed {
            Drained::Finished
        } else {
            Drained::Open
        }
    }
}
