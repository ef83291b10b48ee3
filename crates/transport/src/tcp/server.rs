//! The target side: accepts connections, serves reads from registered regions and lands
//! fenced writes into them.

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvlease_gpu_mem::staging::{Stager, StagingConfig};
use kvlease_gpu_mem::{RegionAccessError, RegionBytes};
use kvlease_proto::auth::{AwaitingProof, ServerAuth};

use super::notif::{Handoff, NotifHub};
use super::wire::{self, Body, FrameError};
use crate::context::Context;
use crate::error::Refusal;
use crate::ids::Sender;
use crate::stats::bump;
use crate::sync::lock;

/// Starts the listener thread: it accepts inbound connections and serves each on a
/// thread of its own; authenticated notification connections move to `hub`.
pub(crate) fn spawn_listener(
    ctx: Arc<Context>,
    hub: Arc<NotifHub>,
    listener: TcpListener,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("kvl-listen-{}", ctx.local_addr.port()))
        .spawn(move || accept_loop(&ctx, &hub, &listener))
}

/// The streams an accept loop serves (TCP here, the shm backend's Unix socket): each one
/// accepted until the agent shuts down (checked after every accept, which the shutdown
/// wakes). A failed accept (out of descriptors and similar) is logged and retried after
/// 10 ms instead of spinning.
pub(crate) fn accepted<S>(
    incoming: impl Iterator<Item = io::Result<S>>,
    shutdown: &AtomicBool,
    socket: &'static str,
) -> impl Iterator<Item = S> {
    incoming
        .take_while(|_| !shutdown.load(Ordering::SeqCst))
        .filter_map(move |stream| {
            stream
                .inspect_err(|err| {
                    tracing::warn!(%err, socket, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                })
                .ok()
        })
}

fn accept_loop(ctx: &Arc<Context>, hub: &Arc<NotifHub>, listener: &TcpListener) {
    for stream in accepted(listener.incoming(), &ctx.shutdown, "tcp") {
        // Until it authenticates, the connection holds one of the few pre-auth slots; a
        // newcomer may evict it (shut down) to make room. The caps on connections in all
        // (`max_inbound_*`) apply once it authenticated (see `authenticated_slot`).
        let Some(preauth) = preauth_slot(ctx, &stream) else {
            bump(&ctx.counters.preauth_refused);
            tracing::warn!(
                peer = ?stream.peer_addr().ok(),
                limit = ctx.limits.max_preauth_connections,
                "too many unauthenticated connections, none to evict; connection closed"
            );
            continue;
        };
        bump(&ctx.counters.connections_accepted);
        // The pre-authentication deadline runs from here, whatever the peer sends later.
        let deadline = Instant::now() + ctx.limits.handshake_timeout;
        let id = ctx.fresh_id();
        if let Ok(clone) = stream.try_clone() {
            lock(&ctx.inbound).insert(id, clone);
        }
        let (ctx2, hub2) = (ctx.clone(), hub.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("kvl-serve-{id}"))
            .spawn(move || {
                let peer_addr = stream.peer_addr().ok();
                let served = serve(&ctx2, &hub2, stream, deadline, preauth);
                if let Ok(handoff) = served {
                    // The socket lives on in the notification hub, read by
                    // `get_new_notifs`; this thread ends. It leaves `inbound` (without a
                    // shutdown) only once the hub counts it, so that the accept limit
                    // never misses it.
                    hub2.add(handoff);
                    lock(&ctx2.inbound).remove(&id);
                    return;
                }
                let _ = served.inspect_err(|err| match err {
                    FrameError::Malformed(why) => {
                        bump(&ctx2.counters.malformed_frames);
                        tracing::warn!(?peer_addr, %why, "malformed frame; connection closed");
                    }
                    FrameError::Io(err) if Instant::now() >= deadline && is_timeout(err) => {
                        // Only an unauthenticated connection has a read timeout, so this
                        // is the pre-authentication deadline.
                        bump(&ctx2.counters.handshake_timeouts);
                        tracing::debug!(
                            ?peer_addr,
                            "inbound connection not authenticated in time; closed"
                        );
                    }
                    FrameError::Io(err) => {
                        tracing::debug!(?peer_addr, %err, "inbound connection ended");
                    }
                });
                if let Some(s) = lock(&ctx2.inbound).remove(&id) {
                    let _ = s.shutdown(Shutdown::Both);
                }
            });
        if let Err(err) = spawned {
            tracing::error!(%err, "could not start a connection thread; connection dropped");
            if let Some(s) = lock(&ctx.inbound).remove(&id) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

/// Why an authenticated connection was closed: the caps on connections held in all.
fn over_cap(what: &str, limit: usize) -> FrameError {
    FrameError::Io(io::Error::other(format!(
        "{what} ({limit}) reached; authenticated connection closed"
    )))
}

/// The slot of an authenticated connection from `stream`'s address
/// (`limits.max_inbound_per_address`), if it may stay: the agent holds fewer than
/// `limits.max_inbound_connections` authenticated connections (checked without a lock
/// across the two counts: a race lets one more in, never unboundedly many).
fn authenticated_slot(
    ctx: &Context,
    hub: &NotifHub,
    stream: &TcpStream,
) -> Result<crate::slots::AddressSlot, FrameError> {
    let held = lock(&ctx.inbound).len().saturating_sub(ctx.preauth.len()) + hub.len();
    if held > ctx.limits.max_inbound_connections {
        return Err(over_cap(
            "the cap on inbound connections",
            ctx.limits.max_inbound_connections,
        ));
    }
    stream
        .peer_addr()
        .ok()
        .and_then(|a| ctx.per_address.take(a.ip()))
        .ok_or_else(|| {
            over_cap(
                "the cap on inbound connections from one address",
                ctx.limits.max_inbound_per_address,
            )
        })
}

/// A pre-auth slot for `stream` (see [`crate::config::Limits::max_preauth_connections`]),
/// evicted by shutting the socket down; `None` when none can be made.
pub(crate) fn preauth_slot(ctx: &Context, stream: &TcpStream) -> Option<crate::slots::FairSlot> {
    let ip = stream.peer_addr().ok()?.ip();
    let socket = stream.try_clone().ok()?;
    let evicted = ctx.counters.clone();
    ctx.preauth.admit(ip, move || {
        bump(&evicted.preauth_evicted);
        let _ = socket.shutdown(Shutdown::Both);
        true
    })
}

fn is_timeout(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// An inbound socket whose reads, until the peer authenticates, all end by one absolute
/// deadline: each read gets only the time left, so neither slow bytes nor a stream of
/// refused requests can hold the connection past it. The answers written meanwhile (the
/// same socket) get no more than that time either.
struct Inbound {
    stream: TcpStream,
    /// `None` once the peer has authenticated.
    deadline: Option<Instant>,
    /// The write timeout of an authenticated connection.
    write_timeout: Duration,
}

impl Inbound {
    /// Lifts the deadline: an authenticated peer may idle as long as it likes.
    fn authenticated(&mut self) -> io::Result<()> {
        self.deadline = None;
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(Some(self.write_timeout))
    }
}

impl Read for Inbound {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left))?;
            self.stream
                .set_write_timeout(Some(left.min(self.write_timeout)))?;
        }
        self.stream.read(buf)
    }
}

enum Phase {
    /// Waiting for HELLO.
    Hello,
    /// CHALLENGE sent, waiting for PROOF.
    Proof {
        auth: AwaitingProof,
        /// The HELLO marked the notification connection.
        notif_conn: bool,
    },
    /// PROOF accepted; the connection holds its address's slot.
    Authenticated {
        client: Sender,
        _slot: crate::slots::AddressSlot,
    },
    /// PROOF refused: reads are refused and notifications dropped.
    Rejected,
}

/// Serves one inbound connection until it fails; a notification connection is handed
/// back instead once its peer authenticated (see `super::notif`). The connection gives
/// its pre-auth slot back once its peer authenticated.
fn serve(
    ctx: &Context,
    hub: &NotifHub,
    stream: TcpStream,
    deadline: Instant,
    preauth: crate::slots::FairSlot,
) -> Result<Handoff, FrameError> {
    let mut preauth = Some(preauth);
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let mut r = BufReader::with_capacity(
        64 * 1024,
        Inbound {
            stream,
            deadline: Some(deadline),
            write_timeout: ctx.limits.serve_write_timeout,
        },
    );
    let mut phase = Phase::Hello;
    // Device (not host-accessible) regions are served through pinned bounce buffers.
    let mut stager = Stager::new(StagingConfig::default());
    let max_notif = ctx.limits.max_notif_len;
    // One write's payload at a time, grown to the largest write seen (at most
    // `wire::MAX_WRITE_LEN`).
    let mut landing = Vec::new();
    loop {
        let allowed: &[u8] = match phase {
            Phase::Hello => &[wire::HELLO, wire::READ_REQ, wire::WRITE_REQ, wire::NOTIF],
            Phase::Proof { .. } => &[wire::PROOF, wire::READ_REQ, wire::WRITE_REQ, wire::NOTIF],
            Phase::Authenticated { .. } | Phase::Rejected => {
                &[wire::READ_REQ, wire::WRITE_REQ, wire::NOTIF]
            }
        };
        let (ty, len) = wire::read_header(&mut r, allowed, |ty| match ty {
            wire::READ_REQ => wire::READ_REQ_LEN,
            wire::WRITE_REQ => wire::WRITE_REQ_LEN,
            wire::NOTIF => max_notif,
            _ => wire::MAX_CONTROL_BODY,
        })?;
        let body = wire::read_body(&mut r, len)?;
        let mut b = Body(&body);
        match ty {
            wire::HELLO => {
                let server_nonce =
                    wire::random_nonce().map_err(|e| io::Error::other(e.to_string()))?;
                let challenged = ServerAuth::new(
                    wire::TCP_ROLES,
                    server_nonce,
                    &ctx.name,
                    ctx.token.as_deref(),
                )
                .on_hello(&body)?;
                out.write_all(&wire::frame(wire::CHALLENGE, &challenged.reply))?;
                let notif_conn = challenged.hello.extra == wire::NOTIF_CONN_INDEX;
                // The client sees our version in the CHALLENGE and gives up.
                let auth = challenged.into_waiting()?;
                phase = Phase::Proof { auth, notif_conn };
            }
            wire::PROOF => {
                let Phase::Proof { auth, notif_conn } =
                    std::mem::replace(&mut phase, Phase::Rejected)
                else {
                    unreachable!("PROOF is only allowed in the Proof phase");
                };
                // Past the proof the connection gives its pre-auth slot back and takes an
                // authenticated one; over those caps it is closed before it is answered.
                let admit = || {
                    drop(preauth.take());
                    authenticated_slot(ctx, hub, &out).inspect_err(|e| {
                        tracing::warn!(error = %e, "too many inbound connections");
                    })
                };
                let Some((client, slot)) =
                    answer_client_proof(ctx, auth, &body, &mut out.try_clone()?, admit)?
                else {
                    continue;
                };
                if notif_conn {
                    // The peer sends nothing between its PROOF and our AUTH_RESULT, but
                    // whatever the buffer holds goes along.
                    return Ok(Handoff {
                        buffered: r.buffer().to_vec(),
                        stream: r.into_inner().stream,
                        peer: client,
                        slot: Some(slot),
                    });
                }
                tracing::debug!(peer = %client, "inbound peer authenticated");
                r.get_mut().authenticated()?;
                phase = Phase::Authenticated {
                    client,
                    _slot: slot,
                };
            }
            wire::READ_REQ => {
                let req = b.u64()?;
                let region = b.u64()?;
                let key = b.u64()?;
                let offset = b.u64()?;
                let len = b.u64()?;
                b.finish()?;
                let authed = matches!(phase, Phase::Authenticated { .. });
                serve_read(
                    ctx,
                    &mut out,
                    &mut stager,
                    authed,
                    req,
                    region,
                    key,
                    offset,
                    len,
                )?;
            }
            wire::WRITE_REQ => {
                let write = WriteReq::parse(&mut b)?;
                let authed = matches!(phase, Phase::Authenticated { .. });
                serve_write(ctx, &mut r, &mut out, &mut landing, authed, &write)?;
            }
            // Notifications on a data connection: a peer that predates the notification
            // connection. They go into the inbox from here (dropped when it is full).
            wire::NOTIF => match &phase {
                Phase::Authenticated { client, .. } => ctx.deliver_notif(client, body),
                _ => {
                    bump(&ctx.counters.notifs_dropped_unauthenticated);
                    tracing::warn!("notification from an unauthenticated connection dropped");
                }
            },
            _ => unreachable!("read_header only returns allowed types"),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn serve_read(
    ctx: &Context,
    out: &mut TcpStream,
    stager: &mut Stager,
    authed: bool,
    req: u64,
    region_id: u64,
    key: u64,
    offset: u64,
    len: u64,
) -> Result<(), FrameError> {
    let refuse = |out: &mut TcpStream, why: Refusal| -> Result<(), FrameError> {
        bump(&ctx.counters.reads_refused);
        if why == Refusal::Unauthenticated {
            bump(&ctx.counters.reads_refused_unauthenticated);
        }
        tracing::debug!(region_id, offset, len, %why, "read refused");
        out.write_all(&wire::read_err(req, why.code()))?;
        Ok(())
    };
    if !authed {
        return refuse(out, Refusal::Unauthenticated);
    }
    if len > ctx.limits.max_read_len {
        return refuse(out, Refusal::TooLong);
    }
    let region = {
        let regions = ctx
            .regions
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match regions.get(&region_id) {
            None => None,
            Some(r) if !wire::keys_equal(r.desc.key, key) => return refuse(out, Refusal::BadKey),
            Some(r) => Some(r.region.clone()),
        }
    };
    let Some(region) = region else {
        return refuse(out, Refusal::UnknownRegion);
    };
    let staged = match region.check_host_range(offset, len) {
        Ok(()) => false,
        Err(RegionAccessError::NotHostAccessible { .. }) => match offset.checked_add(len) {
            Some(end) if end <= region.len() as u64 => true,
            _ => return refuse(out, Refusal::OutOfBounds),
        },
        Err(_) => return refuse(out, Refusal::OutOfBounds),
    };
    let header = wire::read_resp_header(req, len);
    if staged {
        // Device memory: the header, then the bytes through the pipelined stager (the copy
        // of chunk i+1 overlaps the send of chunk i). A failure after the header leaves
        // the stream mid-response, so the connection is closed and the reader fails the
        // read as disconnected.
        out.write_all(&header)?;
        // Bounds were checked above against the region's length, a `usize`.
        let (off, n) = (offset as usize, len as usize);
        stager.send(&region, off, n, out).map_err(|err| {
            tracing::warn!(region_id, offset, len, %err, "staged read failed; connection closed");
            io::Error::other(err.to_string())
        })?;
        bump(&ctx.counters.reads_served);
        ctx.counters.bytes_served.fetch_add(len, Ordering::Relaxed);
        return Ok(());
    }
    // A generation word is read atomically, so that it never tears against P's store.
    let word = if len == 8 {
        region.load_u64(offset).ok()
    } else {
        None
    };
    let sent = match word {
        Some(w) => out.write_all(&[&header[..], &w.to_ne_bytes()].concat()),
        // The header and the bytes in one `writev`, straight from the region (the kernel
        // reads it; no Rust borrow of bytes the owner may be writing).
        None => region
            .write_to_fd(&header, offset, len, out.as_fd())
            .unwrap_or_else(|e| Err(io::Error::other(e))),
    };
    sent?;
    bump(&ctx.counters.reads_served);
    ctx.counters.bytes_served.fetch_add(len, Ordering::Relaxed);
    Ok(())
}

/// A `WRITE_REQ`'s fields (its payload follows on the connection).
pub(crate) struct WriteReq {
    req: u64,
    region: u64,
    key: u64,
    offset: u64,
    len: u64,
    /// The fence word: region, key, offset.
    fence: (u64, u64, u64),
    expected: u64,
}

impl WriteReq {
    /// Parses a `WRITE_REQ` body (the whole of it).
    pub(crate) fn parse(b: &mut Body<'_>) -> Result<Self, FrameError> {
        let mut w = [0u64; 9];
        for v in &mut w {
            *v = b.u64()?;
        }
        b.finish()?;
        let [
            req,
            region,
            key,
            offset,
            len,
            f_region,
            f_key,
            f_offset,
            expected,
        ] = w;
        Ok(Self {
            req,
            region,
            key,
            offset,
            len,
            fence: (f_region, f_key, f_offset),
            expected,
        })
    }

    /// Whether `self` and `other` are checked against the same fence word and generation,
    /// and `other` may join a group of `group_len` bytes pulled together (at most
    /// [`wire::MAX_WRITE_LEN`] in all).
    pub(crate) fn pulls_with(&self, other: &Self, group_len: u64) -> bool {
        self.fence == other.fence
            && self.expected == other.expected
            && group_len.saturating_add(other.len) <= wire::MAX_WRITE_LEN
    }

    /// The write's length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Parses a `WRITE_PULL` body (the whole of it): the write, and the source it names
    /// (source id, offset).
    pub(crate) fn parse_pull(b: &mut Body<'_>) -> Result<(Self, (u64, u64)), FrameError> {
        let mut w = [0u64; 11];
        for v in &mut w {
            *v = b.u64()?;
        }
        b.finish()?;
        let [
            req,
            src,
            src_offset,
            region,
            key,
            offset,
            len,
            f_region,
            f_key,
            f_offset,
            expected,
        ] = w;
        let write = Self {
            req,
            region,
            key,
            offset,
            len,
            fence: (f_region, f_key, f_offset),
            expected,
        };
        Ok((write, (src, src_offset)))
    }
}

/// The regions a write names, once checked: the destination and the fence's.
type WriteTargets = (
    Arc<dyn kvlease_gpu_mem::DmaRegion>,
    Arc<dyn kvlease_gpu_mem::DmaRegion>,
);

/// Checks a write against the registered regions: both regions known under their keys,
/// the destination range inside its region (of any memory kind: [`land_bytes`] copies
/// into device memory), the fence word's 8 bytes inside host memory.
fn write_targets(ctx: &Context, w: &WriteReq) -> Result<WriteTargets, Refusal> {
    if w.len > wire::MAX_WRITE_LEN {
        return Err(Refusal::TooLong);
    }
    let regions = ctx
        .regions
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let find = |id: u64, key: u64| match regions.get(&id) {
        None => Err(Refusal::UnknownRegion),
        Some(r) if !wire::keys_equal(r.desc.key, key) => Err(Refusal::BadKey),
        Some(r) => Ok(r.region.clone()),
    };
    let dest = find(w.region, w.key)?;
    let fence = find(w.fence.0, w.fence.1)?;
    drop(regions);
    let host = |r: &dyn kvlease_gpu_mem::DmaRegion, offset: u64, len: u64| {
        r.check_host_range(offset, len).map_err(|e| match e {
            RegionAccessError::NotHostAccessible { .. } => Refusal::NotHostAccessible,
            _ => Refusal::OutOfBounds,
        })
    };
    kvlease_gpu_mem::staging::check_range(w.offset as usize, w.len as usize, dest.len())
        .map_err(|_| Refusal::OutOfBounds)?;
    host(fence.as_ref(), w.fence.2, 8)?;
    Ok((dest, fence))
}

/// Counts and logs a refused write and answers it with `WRITE_ERR` (nothing of it
/// landed). A write over [`wire::MAX_WRITE_LEN`] closes the connection once answered.
fn refuse_write(
    ctx: &Context,
    out: &mut dyn Write,
    w: &WriteReq,
    why: Refusal,
) -> Result<(), FrameError> {
    bump(&ctx.counters.writes_refused);
    if why == Refusal::Stale {
        bump(&ctx.counters.writes_stale);
    }
    tracing::debug!(region = w.region, offset = w.offset, len = w.len, %why, "write refused");
    out.write_all(&wire::write_err(w.req, why.code()))?;
    if why == Refusal::TooLong {
        return Err(FrameError::Malformed(format!(
            "write of {} bytes exceeds {}",
            w.len,
            wire::MAX_WRITE_LEN
        )));
    }
    Ok(())
}

/// Lands a write whose targets `write_targets` checked: under the fence word's stripe
/// of the write-fence lock, `copy` puts the write's bytes into `dest` (at the write's
/// offset, its length) only if the word holds `w.expected`. The lock is held from that
/// check until the last byte landed, so once
/// [`Agent::set_write_fence`](crate::Agent::set_write_fence) returned, no write checked
/// against the old word lands any more. Counted under the lock too: once a clear
/// returned, the count is final.
fn land(
    ctx: &Context,
    w: &WriteReq,
    (dest, fence): &WriteTargets,
    copy: impl FnOnce(&dyn kvlease_gpu_mem::DmaRegion, u64, u64) -> Result<(), Refusal>,
) -> Result<(), Refusal> {
    under_fence(ctx, w, fence.as_ref(), || {
        copy(dest.as_ref(), w.offset, w.len).map(|()| count_landed(ctx, w))
    })?
}

/// Runs `then` under the stripe of the write-fence lock of `w`'s fence word (in
/// `fence`, the region `write_targets` found), only if the word holds `w.expected`
/// ([`Refusal::Stale`] otherwise; [`Refusal::OutOfBounds`] for a word that cannot be a
/// fence).
fn under_fence<T>(
    ctx: &Context,
    w: &WriteReq,
    fence: &dyn kvlease_gpu_mem::DmaRegion,
    then: impl FnOnce() -> T,
) -> Result<T, Refusal> {
    let _fence = ctx.write_fences.lock(w.fence.0, w.fence.2);
    match fence.load_u64(w.fence.2) {
        Ok(word) if word == w.expected => Ok(then()),
        Ok(_) => Err(Refusal::Stale),
        // Misaligned: the word cannot be a fence.
        Err(_) => Err(Refusal::OutOfBounds),
    }
}

/// Counts a write that landed (under its fence word's stripe).
fn count_landed(ctx: &Context, w: &WriteReq) {
    bump(&ctx.counters.writes_landed);
    ctx.counters
        .bytes_landed
        .fetch_add(w.len, Ordering::Relaxed);
}

//= docs/spec.md#the-write-fence
//# A write lands only in blocks D holds for that transfer under that generation
//# (and registered with the writing P engine): D's receiver checks this before any byte
//# lands, and a write that does not pass is refused and reported to P as failed.
/// Serves one `WRITE_REQ` whose payload of `w.len` bytes follows on `r`: refused
/// (`WRITE_ERR`, the payload read and dropped in bounded pieces) when the peer has not
/// authenticated or the write names regions or ranges it may not write; otherwise the
/// payload is taken into `landing` and lands as [`land`] lands it (else `WRITE_ERR`,
/// with [`Refusal::Stale`] when the fence word no longer holds the generation). A write
/// over [`wire::MAX_WRITE_LEN`] is refused and the connection closed (its payload is not
/// drained).
pub(crate) fn serve_write(
    ctx: &Context,
    r: &mut impl Read,
    out: &mut impl Write,
    landing: &mut Vec<u8>,
    authed: bool,
    w: &WriteReq,
) -> Result<(), FrameError> {
    let targets = if authed {
        write_targets(ctx, w)
    } else if w.len > wire::MAX_WRITE_LEN {
        Err(Refusal::TooLong)
    } else {
        Err(Refusal::Unauthenticated)
    };
    let targets = match targets {
        Ok(t) => t,
        Err(why) => {
            if why != Refusal::TooLong {
                drain(r, w.len)?;
            }
            return refuse_write(ctx, out, w, why);
        }
    };
    // Checked against `MAX_WRITE_LEN` above.
    let n = w.len as usize;
    landing.resize(n, 0);
    r.read_exact(&mut landing[..n])?;
    let landed = land(ctx, w, &targets, |dest, offset, _| {
        land_bytes(dest, offset, &landing[..n])
    });
    match landed {
        Ok(()) => out.write_all(&wire::write_ack(w.req)).map_err(Into::into),
        Err(why) => refuse_write(ctx, out, w, why),
    }
}

/// Copies a write's bytes into `dest` at `offset`, whatever its memory kind: host memory
/// with a plain copy, device memory (and staged host memory) with a synchronous copy
/// ([`write_region`](kvlease_gpu_mem::staging::write_region)) that has finished when this
/// returns, so that a write landing under the fence lock has landed once the lock is
/// released. A device copy that fails is refused as `NotHostAccessible` (logged).
pub(crate) fn land_bytes(
    dest: &dyn kvlease_gpu_mem::DmaRegion,
    offset: u64,
    bytes: &[u8],
) -> Result<(), Refusal> {
    // `offset` was checked inside the region, whose length is a `usize`.
    kvlease_gpu_mem::staging::write_region(dest, offset as usize, bytes).map_err(|err| match err {
        kvlease_gpu_mem::staging::StagingError::Range(_) => Refusal::OutOfBounds,
        err => {
            tracing::warn!(offset, len = bytes.len(), kind = %dest.kind(), %err, "a write could not be copied into its destination; refused");
            Refusal::NotHostAccessible
        }
    })
}

//= docs/spec.md#the-write-fence
//# A write lands only in blocks D holds for that transfer under that generation
//# (and registered with the writing P engine): D's receiver checks this before any byte
//# lands, and a write that does not pass is refused and reported to P as failed.
/// A pulled write that passed the checks, to copy: `len` bytes from `src` (what the
/// caller named it by) into `dest` at `offset`.
pub(crate) struct PullCopy<'a, S> {
    pub(crate) dest: Arc<dyn kvlease_gpu_mem::DmaRegion>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) src: &'a S,
}

/// Serves `WRITE_PULL`s of an authenticated peer, in order: `writes[i]` with what its
/// bytes are copied from in the peer's memory (`S`, handed to the copies), or why the
/// source it names is refused (checked before anything else but the length). Each is
/// checked as a `WRITE_REQ` is and answered the same way. Consecutive writes under one
/// fence word and generation land together, under one hold of the word's stripe (as
/// [`land`] lands one: once the word was found to hold the generation, and counted
/// there): `copy` copies those that passed the checks and says whether every copy
/// succeeded; if one did not, `copy_one` copies each again alone, so that each is
/// answered as it fares. A write over
/// [`wire::MAX_WRITE_LEN`] is refused after those before it were served, and ends the
/// stream (the error closes the connection).
pub(crate) fn serve_pulled_writes<S>(
    ctx: &Context,
    out: &mut impl Write,
    writes: Vec<(WriteReq, Result<S, Refusal>)>,
    mut copy: impl FnMut(Vec<PullCopy<'_, S>>) -> bool,
    copy_one: impl Fn(&S, &dyn kvlease_gpu_mem::DmaRegion, u64, u64) -> Result<(), Refusal>,
) -> Result<(), FrameError> {
    let mut rest = &writes[..];
    while let Some((first, _)) = rest.first() {
        if first.len > wire::MAX_WRITE_LEN {
            return refuse_write(ctx, out, first, Refusal::TooLong);
        }
        // The run: the writes that may be pulled with the first, as the caller grouped
        // them.
        let (mut n, mut run_len) = (1, first.len);
        while let Some((w, _)) = rest.get(n)
            && first.pulls_with(w, run_len)
        {
            run_len += w.len;
            n += 1;
        }
        let (run, later) = rest.split_at(n);
        rest = later;
        let mut outcomes: Vec<Result<(), Refusal>> = Vec::with_capacity(run.len());
        let mut passed = Vec::with_capacity(run.len());
        for (i, (w, pull)) in run.iter().enumerate() {
            let checked = pull
                .as_ref()
                .map_err(|why| *why)
                .and_then(|pull| Ok((write_targets(ctx, w)?, pull)));
            match checked {
                Ok(((dest, fence), pull)) => {
                    passed.push((i, dest, fence, pull));
                    outcomes.push(Ok(()));
                }
                Err(why) => outcomes.push(Err(why)),
            }
        }
        if let Some((_, _, fence, _)) = passed.first() {
            // One fence word for the run, so one region: the first write's.
            let fence = fence.clone();
            let landed = under_fence(ctx, first, fence.as_ref(), || {
                let all = passed
                    .iter()
                    .map(|(i, dest, _, src)| PullCopy {
                        dest: dest.clone(),
                        offset: run[*i].0.offset,
                        len: run[*i].0.len,
                        src: *src,
                    })
                    .collect();
                if !copy(all) {
                    for (i, dest, _, pull) in &passed {
                        let w = &run[*i].0;
                        outcomes[*i] = copy_one(pull, dest.as_ref(), w.offset, w.len);
                    }
                }
                for (i, ..) in &passed {
                    if outcomes[*i].is_ok() {
                        count_landed(ctx, &run[*i].0);
                    }
                }
            });
            if let Err(why) = landed {
                for (i, ..) in &passed {
                    outcomes[*i] = Err(why);
                }
            }
        }
        for ((w, _), outcome) in run.iter().zip(outcomes) {
            match outcome {
                Ok(()) => {
                    bump(&ctx.counters.writes_pulled);
                    out.write_all(&wire::write_ack(w.req))?;
                }
                Err(why) => refuse_write(ctx, out, w, why)?,
            }
        }
    }
    Ok(())
}

/// Reads and drops `n` bytes in pieces of 64 KiB.
fn drain(r: &mut dyn Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// The server's side of a client's token proof (the `PROOF` body `given`): checks it
/// (under the session bound to the client's name, if any, else under the token), counts
/// and logs a failure (before answering, so a peer that sees the refusal sees it counted
/// too), runs `admit` when it held (its error closes the connection unanswered), and
/// writes the `AUTH_RESULT` frame with the server's own proof. Returns the client and
/// what `admit` gave when the proof held.
pub(crate) fn answer_client_proof<T>(
    ctx: &Context,
    auth: AwaitingProof,
    given: &[u8],
    out: &mut impl Write,
    admit: impl FnOnce() -> Result<T, FrameError>,
) -> Result<Option<(Sender, T)>, FrameError> {
    let session = ctx.sessions.of(&auth.hello().name);
    let verdict = auth.on_proof_keyed(given, session.as_ref())?;
    let admitted = if verdict.ok { Some(admit()?) } else { None };
    if !verdict.ok {
        bump(&ctx.counters.auth_failures);
        match &session {
            Some(s) => {
                bump(&ctx.counters.session_refusals);
                tracing::warn!(
                    peer = %verdict.client_name,
                    session = ?s,
                    "inbound connection under a name whose engine registered on the side channel did not prove that registration's session; refused"
                );
            }
            None => {
                tracing::warn!(peer = %verdict.client_name, "inbound peer failed the token proof");
            }
        }
    }
    out.write_all(&wire::frame(wire::AUTH_RESULT, &verdict.reply))?;
    Ok(admitted.map(|admitted| {
        let client = Sender {
            name: verdict.client_name,
            session: session.map(|s| s.id()),
        };
        (client, admitted)
    }))
}
