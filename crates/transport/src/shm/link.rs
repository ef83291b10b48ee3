//! D's side: the handshake on P's Unix socket, P's regions mapped read-only, the
//! notification ring to P, and posting batches.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvlease_gpu_mem::{
    CmaError, PeerProcessRange, PushError, RingWriter, SharedRegionView, recv_with_fds,
    yama_ptrace_scope,
};

use super::copy::{self, Completion, CopyOp};
use super::error::ShmError;
use super::mapped::{MappedRegion, Source};
use super::write::Writer;
use super::{MAX_REGIONS, METADATA_KEY, cma_peer_pid, host_identity};
use crate::batch::{Batch, Next};
use crate::config::Backend;
use crate::context::Context;
use crate::error::{LinkError, Refusal, TransferError};
use crate::ids::{RemoteRange, WriteFence};
use crate::link::{Chunk, Link, WriteChunk};
use crate::metadata::AgentMetadata;
use crate::notify::NotifSink;
use crate::sync::lock;
use crate::tcp::TcpLink;
use crate::tcp::wire::{self, Body, ClientAuthError, FrameError};

/// About how long a sender waits for the peer to drain a full notification ring before
/// it fails with [`TransferError::NotifRingFull`], in milliseconds (counted in sleeps,
/// not read from a clock).
pub(crate) const RING_FULL_WAIT_MS: u64 = 10;

/// Tries with a yield in between before the sender sleeps on a full ring.
const RING_FULL_SPINS: u32 = 64;
/// The sleep between later tries.
const RING_FULL_SLEEP: Duration = Duration::from_micros(50);
/// Pushes tried on a full ring before giving up: the spins, then sleeps for about
/// [`RING_FULL_WAIT_MS`].
const RING_FULL_TRIES: u64 =
    RING_FULL_SPINS as u64 + RING_FULL_WAIT_MS * 1000 / RING_FULL_SLEEP.as_micros() as u64;

/// The notification ring to the peer: every notification of the link goes through it
/// (routed into the TCP link too, for the batches that link moves), in order.
#[derive(Debug)]
struct RingNotifier {
    peer: String,
    ring: Mutex<RingWriter>,
}

impl NotifSink for RingNotifier {
    fn send(&self, bytes: &[u8]) -> Result<(), TransferError> {
        let mut ring = lock(&self.ring);
        let mut tries = 0u64;
        let err = loop {
            match ring.try_push(bytes) {
                Ok(()) => return Ok(()),
                Err(PushError::Full { .. }) if tries < RING_FULL_TRIES => {
                    // The lock stays held: later notifications queue behind this one.
                    if tries < u64::from(RING_FULL_SPINS) {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(RING_FULL_SLEEP);
                    }
                    tries += 1;
                }
                Err(err) => break err,
            }
        };
        Err(match err {
            PushError::Full { .. } => {
                tracing::warn!(peer = %self.peer, len = bytes.len(), "the peer's notification ring stayed full; notification not sent");
                TransferError::NotifRingFull {
                    peer: self.peer.clone(),
                    len: bytes.len(),
                    capacity: ring.capacity(),
                }
            }
            PushError::TooLarge { len, max } => TransferError::NotifTooLarge {
                peer: self.peer.clone(),
                len,
                max,
            },
            PushError::Closed => TransferError::Disconnected {
                peer: self.peer.clone(),
                reason: "the peer closed its notification ring".into(),
            },
            err => {
                tracing::warn!(peer = %self.peer, %err, "the peer's notification ring is corrupt");
                TransferError::Disconnected {
                    peer: self.peer.clone(),
                    reason: "the peer's notification ring is corrupt".into(),
                }
            }
        })
    }
}

/// What the posting thread and the copy pool share about the link.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) peer: String,
    pub(super) tcp: Arc<TcpLink>,
    regions: HashMap<u64, Arc<MappedRegion>>,
    /// The peer's grant table, mapped read-only: slot → registered region id.
    grants: SharedRegionView,
    /// Whether reads of [`Source::Cma`] regions go through `process_vm_readv` (cleared,
    /// for the link's life, once the kernel refused one: they go over TCP then).
    cma: AtomicBool,
}

impl Core {
    /// The kernel refused a cross-memory read (`err`): this link's reads of such regions
    /// go over TCP from now on; logged once per link.
    pub(super) fn cma_refused(&self, err: &CmaError) {
        if self.cma.swap(false, Ordering::AcqRel) {
            let scope = yama_ptrace_scope().map_or_else(
                || "no Yama".to_owned(),
                |s| format!("Yama ptrace_scope {s}"),
            );
            tracing::warn!(
                peer = %self.peer,
                err = %std::error::Error::source(err).map_or_else(|| err.to_string(), ToString::to_string),
                %scope,
                "cross-memory attach refused by the kernel (ptrace permission: another peer named as the \
                 ptracer, ptrace_scope 2/3, no CAP_SYS_PTRACE, another user, or the process is gone); \
                 this link reads the peer's non-memfd host memory over TCP"
            );
        }
    }

    /// The peer's mapped region `region`, if the peer still has it registered (its
    /// grant-table slot still names it), under `key`.
    fn region(&self, region: u64, key: u64) -> Result<&Arc<MappedRegion>, Refusal> {
        let r = self.regions.get(&region).ok_or(Refusal::UnknownRegion)?;
        // An acquire load: the peer's deregistration (its store of 0, or of another id
        // after the slot was reused) is seen by every batch posted after it.
        if r.slot.checked_mul(8).map(|at| self.grants.load_u64(at)) != Some(Ok(region)) {
            return Err(Refusal::UnknownRegion);
        }
        if !wire::keys_equal(r.key, key) {
            return Err(Refusal::BadKey);
        }
        Ok(r)
    }

    /// The fence word at `remote` (checked like a data read), or why it was refused.
    fn fence_word(&self, remote: RemoteRange) -> Result<u64, Refusal> {
        let r = self.region(remote.region, remote.key)?;
        match &*r.source {
            // Out of bounds, or not 8-aligned (fence words are FenceTable slots).
            Source::Host(view) => view
                .load_u64(remote.offset)
                .map_err(|_| Refusal::OutOfBounds),
            // Out of bounds or misaligned; a refusal by the kernel (the probe in `post`
            // passed moments ago) turns cma off for the link and fails this batch.
            Source::Cma(range) => range.read_u64(remote.offset).map_err(|err| {
                if err.is_refusal() {
                    self.cma_refused(&err);
                }
                Refusal::OutOfBounds
            }),
            // Not posted over shm (fence words are host memory): `post` sends such a
            // batch over TCP.
            #[cfg(feature = "cuda")]
            Source::Device(_) => Err(Refusal::OutOfBounds),
        }
    }

    /// Whether the kernel lets this process read the peer's memory now, when `chunks`
    /// read any of it through cross-memory attach: probes up to 8 bytes of the first such
    /// chunk (into its destination, which the batch writes anyway). The kernel checks
    /// permission on every call, and the peer may have named another process as its
    /// ptracer since the last batch. A refusal turns cma off for the link (logged once)
    /// and returns false: the caller moves the batch over TCP. A chunk the checks refuse
    /// is left to them.
    fn cma_allowed(&self, chunks: &[Chunk], fence: Option<RemoteRange>) -> bool {
        let cma_range = |region: u64| match &*self.regions.get(&region)?.source {
            Source::Cma(range) => Some(range),
            _ => None,
        };
        let Some((c, range)) = chunks
            .iter()
            .find_map(|c| Some((c, cma_range(c.remote.region)?)))
        else {
            // No data through cma; a fence word in such a region: probe with it.
            // (Only one still granted under its key: the read checks the rest.)
            let word = fence.and_then(|f| {
                self.region(f.region, f.key).ok()?;
                Some(cma_range(f.region)?.read_u64(f.offset))
            });
            return match word {
                Some(Err(err)) if err.is_refusal() => {
                    self.cma_refused(&err);
                    false
                }
                _ => true,
            };
        };
        if self
            .check(c.remote.region, c.remote.key, c.remote.offset, c.len)
            .is_err()
        {
            return true;
        }
        match range.copy_to(
            c.remote.offset,
            c.dest.as_ref(),
            c.dest_offset,
            c.len.min(8),
        ) {
            Err(err) if err.is_refusal() => {
                self.cma_refused(&err);
                false
            }
            // Copied, or failed otherwise: the copies report it.
            _ => true,
        }
    }

    /// Checks `len` bytes at `offset` of the peer's region `region` under `key`, as P's
    /// TCP server would.
    fn check(
        &self,
        region: u64,
        key: u64,
        offset: u64,
        len: u64,
    ) -> Result<&Arc<MappedRegion>, Refusal> {
        let r = self.region(region, key)?;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > r.source.len())
        {
            return Err(Refusal::OutOfBounds);
        }
        Ok(r)
    }
}

impl Completion for Core {
    /// Ends a batch whose copies all finished (`copied`: none was cut short): counts its
    /// chunks, reads the fence word, then sends the notification (through the ring, when
    /// the link has one: the TCP link routes it there) and marks the batch done.
    fn complete(&self, batch: &Arc<Batch>, copies: &[CopyOp], copied: bool) {
        let next = {
            let mut st = batch.lock();
            st.in_receive -= 1;
            let mut next = Next::Nothing;
            if copied {
                for c in copies {
                    next = st.chunk_done(c.len);
                }
            }
            next
        };
        let next = match next {
            Next::Fence(fence) => {
                // Every data copy finished (the last part's `fetch_sub` synchronised with
                // the others'); no later load may move before the fence word's.
                std::sync::atomic::fence(Ordering::Acquire);
                match self.fence_word(fence.remote) {
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
        self.tcp.advance(batch, next);
    }

    fn cma_refused(&self, err: &CmaError) {
        Self::cma_refused(self, err);
    }
}

/// D's side: the peer's regions mapped read-only, the notification ring to it, and the
/// TCP link that carries the batches shared memory cannot serve.
#[derive(Debug)]
pub(crate) struct ShmLink {
    core: Arc<Core>,
    /// Whether notifications go through a ring (else over the TCP link).
    ring: bool,
    /// P's Unix socket, kept open for the link's life: P drops the ring when it closes.
    sock: UnixStream,
    /// Fenced writes into P's memory, on that socket.
    writer: Writer,
    closed: AtomicBool,
}

/// Connects to `meta`'s shared-memory socket, authenticates, maps the ring and the
/// regions it hands over.
pub(crate) fn connect(
    ctx: &Context,
    meta: &AgentMetadata,
    key: Option<&[u8]>,
    tcp: Arc<TcpLink>,
) -> Result<ShmLink, LinkError> {
    let entry = meta
        .backends
        .get(METADATA_KEY)
        .ok_or(LinkError::Shm(ShmError::PeerHasNoShm))?;
    let (Some(host), Some(socket)) = (
        entry.get("host").and_then(|v| v.as_str()),
        entry.get("socket").and_then(|v| v.as_str()),
    ) else {
        return Err(LinkError::Shm(ShmError::Malformed {
            what: "the peer's shm metadata entry lacks host or socket",
        }));
    };
    let own = host_identity().ok_or(LinkError::Shm(ShmError::NoHostIdentity))?;
    if host != own {
        return Err(LinkError::Shm(ShmError::NotSameHost));
    }
    let sock_err =
        |op: &'static str| move |source: io::Error| LinkError::Shm(ShmError::Socket { op, source });
    let addr = UnixAddr::from_abstract_name(socket.as_bytes()).map_err(sock_err("socket name"))?;
    let mut s = UnixStream::connect_addr(&addr).map_err(sock_err("connect"))?;
    s.set_read_timeout(Some(ctx.limits.handshake_timeout))
        .map_err(sock_err("set timeout"))?;
    s.set_write_timeout(Some(ctx.limits.handshake_timeout))
        .map_err(sock_err("set timeout"))?;
    handshake(ctx, meta, key, &mut s)?;
    // The process of P's socket (the process that listens on it), not P's word.
    let cma_pid = cma_peer_pid(
        ctx.cma,
        &s,
        &meta.name,
        "its non-memfd host memory is read over TCP",
    );
    let Handover {
        grants,
        regions,
        ring,
    } = receive_handover(&mut s, &meta.name, cma_pid)?;
    let has_ring = ring.is_some();
    // The peer serves fenced writes on the socket after the hand-over.
    let flag = |name| entry.get(name).and_then(serde_json::Value::as_bool) == Some(true);
    // And pulls them from memfds of this process handed over there.
    // And from other host memory of this process, with cross-memory attach.
    let cma_pull = flag("write_pull_cma").then_some(ctx.cma);
    let writer = Writer::new(&s, flag("write"), flag("write_pull"), cma_pull);
    if let Some(ring) = ring {
        tcp.route_notifs(Arc::new(RingNotifier {
            peer: meta.name.clone(),
            ring: Mutex::new(ring),
        }));
    }
    let link = ShmLink {
        core: Arc::new(Core {
            peer: meta.name.clone(),
            tcp,
            regions,
            grants,
            cma: AtomicBool::new(true),
        }),
        ring: has_ring,
        sock: s,
        writer,
        closed: AtomicBool::new(false),
    };
    tracing::debug!(peer = %meta.name, regions = link.core.regions.len(), ring = has_ring, "shm link up");
    Ok(link)
}

fn frame_err(e: FrameError) -> LinkError {
    match e {
        FrameError::Io(source) => LinkError::Shm(ShmError::Socket {
            op: "handshake",
            source,
        }),
        FrameError::Malformed(_) => LinkError::Shm(ShmError::Malformed {
            what: "malformed frame from the peer's shm socket",
        }),
    }
}

fn handshake(
    ctx: &Context,
    meta: &AgentMetadata,
    key: Option<&[u8]>,
    s: &mut UnixStream,
) -> Result<(), LinkError> {
    wire::client_handshake(s, wire::SHM_ROLES, 0, &ctx.name, key, &meta.name).map_err(|e| match e {
        ClientAuthError::Frame(e) => frame_err(e),
        ClientAuthError::Random(e) => LinkError::Random(e),
        ClientAuthError::Version(_) => LinkError::Shm(ShmError::Malformed {
            what: "the peer speaks another protocol version",
        }),
        ClientAuthError::WrongName(_) => LinkError::Shm(ShmError::Malformed {
            what: "the agent on the shm socket is not the one the metadata names",
        }),
        ClientAuthError::Rejected => LinkError::Shm(ShmError::AuthRejected),
        ClientAuthError::PeerAuthFailed => LinkError::Shm(ShmError::PeerAuthFailed),
    })
}

/// What P hands over after the proof.
struct Handover {
    grants: SharedRegionView,
    regions: HashMap<u64, Arc<MappedRegion>>,
    ring: Option<RingWriter>,
}

/// Receives `SHM_GRANTS` first, then at most one `SHM_RING` and `SHM_REGION` frames (each
/// with its memfd) until `SHM_END`, mapping each; `SHM_CMA_REGION`s become ranges of the
/// process `cma_pid` (dropped, for TCP, without one).
fn receive_handover(
    s: &mut UnixStream,
    peer: &str,
    cma_pid: Option<u32>,
) -> Result<Handover, LinkError> {
    let io = |source| {
        LinkError::Shm(ShmError::Socket {
            op: "receiving regions",
            source,
        })
    };
    let malformed = |what| LinkError::Shm(ShmError::Malformed { what });
    let mut grants: Option<SharedRegionView> = None;
    let mut regions = HashMap::new();
    // Every region id handed over, also those not mapped (a device region this process
    // cannot open).
    let mut handed = HashSet::new();
    let mut ring = None;
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
        let allowed: &[u8] = match (&grants, &ring) {
            (None, _) => &[wire::SHM_GRANTS],
            (Some(_), None) => &[
                wire::SHM_RING,
                wire::SHM_REGION,
                wire::SHM_CUDA_REGION,
                wire::SHM_CMA_REGION,
                wire::SHM_END,
            ],
            (Some(_), Some(_)) => &[
                wire::SHM_REGION,
                wire::SHM_CUDA_REGION,
                wire::SHM_CMA_REGION,
                wire::SHM_END,
            ],
        };
        let body_len = |ty| match ty {
            wire::SHM_REGION => wire::SHM_REGION_LEN,
            wire::SHM_RING => wire::SHM_RING_LEN,
            wire::SHM_GRANTS => wire::SHM_GRANTS_LEN,
            wire::SHM_CUDA_REGION => wire::SHM_CUDA_REGION_LEN,
            wire::SHM_CMA_REGION => wire::SHM_CMA_REGION_LEN,
            _ => 0,
        };
        let (ty, len) =
            wire::read_header(&mut &header[..], allowed, body_len).map_err(frame_err)?;
        if len != body_len(ty) {
            return Err(malformed("an shm hand-over frame of the wrong length"));
        }
        let mut body = [0u8; wire::SHM_CUDA_REGION_LEN];
        let body = &mut body[..len];
        s.read_exact(body).map_err(io)?;
        if ty == wire::SHM_END {
            let grants = grants.ok_or_else(|| malformed("no grant table"))?;
            return Ok(Handover {
                grants,
                regions,
                ring,
            });
        }
        if ty == wire::SHM_CMA_REGION {
            // An address, not a descriptor.
            if !fds.is_empty() {
                return Err(malformed("an SHM_CMA_REGION frame with a descriptor"));
            }
            let (words, addr) = body.split_at(wire::SHM_REGION_LEN);
            let (id, key, region_len, slot) = region_words(words, grants.as_ref(), &mut handed)?;
            let addr = Body(addr).u64().map_err(frame_err)?;
            let Some(pid) = cma_pid else {
                tracing::debug!(
                    peer,
                    region = id,
                    "a non-memfd host region handed over, but cma is off here; it is read over TCP"
                );
                continue;
            };
            let range = PeerProcessRange::new(pid, addr, region_len)
                .map_err(|_| malformed("an SHM_CMA_REGION of an impossible range"))?;
            regions.insert(
                id,
                Arc::new(MappedRegion {
                    key,
                    slot,
                    source: Arc::new(Source::Cma(range)),
                }),
            );
            continue;
        }
        if ty == wire::SHM_CUDA_REGION {
            // A handle, not a descriptor.
            if !fds.is_empty() {
                return Err(malformed("an SHM_CUDA_REGION frame with a descriptor"));
            }
            let (words, handle) = body.split_at(wire::SHM_REGION_LEN);
            let (id, key, region_len, slot) = region_words(words, grants.as_ref(), &mut handed)?;
            #[cfg(feature = "cuda")]
            if let Some(mapping) = super::cuda::open(peer, id, region_len, handle)? {
                regions.insert(
                    id,
                    Arc::new(MappedRegion {
                        key,
                        slot,
                        source: Arc::new(Source::Device(mapping)),
                    }),
                );
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (key, region_len, slot, handle);
                tracing::debug!(
                    peer,
                    region = id,
                    "a CUDA device region handed over, but this build has no `cuda` feature; it is read over TCP"
                );
            }
            continue;
        }
        let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
            return Err(malformed(
                "an shm hand-over frame without exactly one descriptor",
            ));
        };
        let mut b = Body(body);
        let mut word = || b.u64().map_err(frame_err);
        match ty {
            wire::SHM_GRANTS => {
                let table_len = word()?;
                if table_len == 0
                    || !table_len.is_multiple_of(8)
                    || table_len > (MAX_REGIONS * 8) as u64
                {
                    return Err(malformed("a grant table of an impossible size"));
                }
                grants = Some(
                    SharedRegionView::map(fd, table_len)
                        .map_err(|source| LinkError::Shm(ShmError::Map { region: 0, source }))?,
                );
            }
            wire::SHM_RING => {
                let (capacity, max_record) = (word()?, word()?);
                ring = Some(
                    RingWriter::map(fd, capacity, max_record)
                        .map_err(|source| LinkError::Shm(ShmError::Ring { source }))?,
                );
            }
            _ => {
                let (id, key, region_len, slot) = region_words(body, grants.as_ref(), &mut handed)?;
                let view = SharedRegionView::map(fd, region_len)
                    .map_err(|source| LinkError::Shm(ShmError::Map { region: id, source }))?;
                regions.insert(
                    id,
                    Arc::new(MappedRegion {
                        key,
                        slot,
                        source: Arc::new(Source::Host(view)),
                    }),
                );
            }
        }
    }
}

/// A handed-over region's `(id, key, len, grant slot)` (the first 32 bytes of an
/// `SHM_REGION` or `SHM_CUDA_REGION` body), once its slot lies inside the grant table and
/// its id is new; `handed` records it.
fn region_words(
    words: &[u8],
    grants: Option<&SharedRegionView>,
    handed: &mut HashSet<u64>,
) -> Result<(u64, u64, u64, u64), LinkError> {
    let malformed = |what| LinkError::Shm(ShmError::Malformed { what });
    let mut b = Body(words);
    let mut word = || b.u64().map_err(frame_err);
    let (id, key, region_len, slot) = (word()?, word()?, word()?, word()?);
    let slots = grants.map_or(0, |g| g.len() as u64 / 8);
    if slot >= slots {
        return Err(malformed("a region's grant slot outside the table"));
    }
    if handed.len() >= MAX_REGIONS {
        return Err(malformed("too many shm regions"));
    }
    if !handed.insert(id) {
        return Err(malformed("a region handed over twice"));
    }
    Ok((id, key, region_len, slot))
}

impl ShmLink {
    fn disconnected(&self, reason: &str) -> TransferError {
        TransferError::Disconnected {
            peer: self.core.peer.clone(),
            reason: reason.to_owned(),
        }
    }
}

impl Link for ShmLink {
    fn post_reads(&self, batch: &Arc<Batch>, chunks: Vec<Chunk>) -> Result<(), TransferError> {
        let core = &self.core;
        let fence = batch.lock().fence.map(|f| f.remote);
        let fence_region = fence.map(|f| f.region);
        let cma = core.cma.load(Ordering::Acquire);
        let eligible = chunks.iter().all(|c| {
            core.regions.get(&c.remote.region).is_some_and(|r| {
                r.source.accepts(c.dest.kind()) && (cma || !matches!(*r.source, Source::Cma(_)))
            })
        }) && fence_region.is_none_or(|r| {
            core.regions.get(&r).is_some_and(|r| match *r.source {
                Source::Host(_) => true,
                Source::Cma(_) => cma,
                #[cfg(feature = "cuda")]
                Source::Device(_) => false,
            })
        });
        if !eligible {
            // A region registered after connect, one whose device memory could not be
            // opened here, or a destination the source cannot copy into (device memory
            // from a memfd): TCP moves it.
            return core.tcp.post_reads(batch, chunks);
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(self.disconnected("link closed"));
        }
        if !core.tcp.is_connected() {
            return Err(self.disconnected("no live connection"));
        }
        if !core.cma_allowed(&chunks, fence) {
            return core.tcp.post_reads(batch, chunks);
        }
        let mut copies = Vec::with_capacity(chunks.len());
        for c in chunks {
            match core.check(c.remote.region, c.remote.key, c.remote.offset, c.len) {
                Ok(src) => copies.push(CopyOp {
                    src: src.source.clone(),
                    src_offset: c.remote.offset,
                    dest: c.dest,
                    dest_offset: c.dest_offset,
                    len: c.len,
                }),
                Err(reason) => {
                    batch.lock().fail(TransferError::Refused {
                        peer: core.peer.clone(),
                        region: c.remote.region,
                        offset: c.remote.offset,
                        len: c.len,
                        reason,
                    });
                    return Ok(());
                }
            }
        }
        // A batch that read any byte (or its fence word) through the kernel is `cma`.
        let uses_cma = copies.iter().any(|c| matches!(*c.src, Source::Cma(_)))
            || fence_region.is_some_and(|r| {
                core.regions
                    .get(&r)
                    .is_some_and(|r| matches!(*r.source, Source::Cma(_)))
            });
        {
            let mut st = batch.lock();
            st.backend = if uses_cma { Backend::Cma } else { Backend::Shm };
            if !st.is_running() {
                return Ok(());
            }
            st.in_receive += 1;
        }
        copy::run(core, batch, copies);
        Ok(())
    }

    /// Over the Unix socket, landed by the peer's process under its write-fence lock
    /// (see `shm::write`); over TCP when the peer does not serve writes there or the
    /// link's write stream broke.
    fn post_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), TransferError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.disconnected("link closed"));
        }
        if !self.core.tcp.is_connected() {
            return Err(self.disconnected("no live connection"));
        }
        match self.writer.post(&self.core.tcp, batch, chunks, fence) {
            Ok(()) => Ok(()),
            Err(chunks) => self.core.tcp.post_writes(batch, chunks, fence),
        }
    }

    /// Through the ring (the TCP link routes it there), or over TCP without one.
    fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        if self.ring && !self.core.tcp.is_connected() {
            // P is gone (its TCP connections died): its ring is drained by nobody.
            return Err(self.disconnected("no live connection"));
        }
        self.core.tcp.send_notif(bytes)
    }

    /// The copiers check the batch between chunks and stop; TCP cancels its part.
    fn on_timeout(&self, batch: &Batch) {
        self.core.tcp.on_timeout(batch);
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // P drains what is left in the ring and drops it.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.core.tcp.close();
    }
}
