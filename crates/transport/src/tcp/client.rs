//! The reader side: connections to one peer, striping, completion of chunks.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crossbeam_channel::{Receiver, Sender};
use kvlease_gpu_mem::staging::{Stager, StagingConfig};
use kvlease_gpu_mem::{DmaRegion, RegionBytes};

use super::notif::{NotifHub, NotifSender};
use super::wire::{self, Body, ClientAuthError, FrameError};
use crate::batch::{Batch, Next};
use crate::context::Context;
use crate::error::{ConnectError, Refusal, TransferError};
use crate::ids::{FenceRead, WriteFence};
use crate::link::{Chunk, Link, WriteChunk};
use crate::metadata::AgentMetadata;
use crate::notify::NotifSink;
use crate::stats::bump;
use crate::sync::lock;

/// The reader's buffer: room for a response header with its body (21 bytes) and a few
/// small responses (refusals, fence words), but not for payloads, which are received
/// straight into their destination. A buffer as large as a payload would pull most of
/// it in with the header and copy it a second time (measured on 64 × 64 KiB: 3.2 GB/s
/// with a 64 KiB buffer, 4.4 with a small one).
const HEADER_BUF: usize = 256;

#[derive(Debug)]
enum Dest {
    Data {
        region: Arc<dyn DmaRegion>,
        offset: u64,
    },
    Fence {
        expected: u64,
    },
    /// A write: answered by `WRITE_ACK` or `WRITE_ERR`, no payload comes back.
    Write {
        expected: u64,
    },
}

#[derive(Debug)]
struct PendingOp {
    batch: Arc<Batch>,
    dest: Dest,
    region: u64,
    offset: u64,
    len: u64,
}

#[derive(Debug, Default)]
struct Pending {
    /// False once the connection died: nothing more is queued on it.
    alive: bool,
    ops: HashMap<u64, PendingOp>,
}

/// The send side of a data connection (request frames).
///
/// Application threads write on their own thread when nothing is queued and nobody is
/// writing (one thread hand-off less per message); connection threads only queue and ring
/// the writer thread, so that they never block on a socket (a reader blocked on a write
/// could deadlock against a peer blocked on writing to it). Bytes leave in the order they
/// were handed over: a direct write happens only when the queue is empty and no write is
/// in progress.
#[derive(Debug, Default)]
struct OutState {
    queue: Vec<u8>,
    /// Writes waiting for the writer thread, which sends each frame's payload straight
    /// from its source region (no staging copy). Frames are independent requests, so
    /// they need no order with `queue`; each one leaves whole.
    writes: VecDeque<WriteFrame>,
    busy: bool,
    closed: bool,
}

/// A `WRITE_REQ` frame of `batch`: its header and body, then `len` bytes of `src` at
/// `offset`.
#[derive(Debug)]
struct WriteFrame {
    batch: Arc<Batch>,
    header: [u8; wire::HEADER_LEN + wire::WRITE_REQ_LEN],
    src: Arc<dyn DmaRegion>,
    offset: u64,
    len: u64,
}

impl WriteFrame {
    /// Sends the frame, the payload straight from a host source (one `writev`), from
    /// other memory (CUDA device, staged host) through `bounce`
    /// ([`send_to_fd`](kvlease_gpu_mem::staging::send_to_fd)).
    fn send(&self, socket: &TcpStream, bounce: &mut Vec<u8>) -> io::Result<()> {
        kvlease_gpu_mem::staging::send_to_fd(
            self.src.as_ref(),
            &self.header,
            self.offset,
            self.len,
            socket.as_fd(),
            bounce,
        )
        .unwrap_or_else(|e| Err(io::Error::other(e)))
    }
}

#[derive(Debug)]
pub(crate) struct Conn {
    index: usize,
    out: Mutex<OutState>,
    /// Wakes the writer thread (capacity 1: rings coalesce).
    doorbell: Sender<()>,
    /// The socket, for direct writes.
    writer: TcpStream,
    pending: Mutex<Pending>,
    /// The batch whose bytes the reader is receiving right now (0: none).
    receiving: AtomicU64,
    /// The batch whose write payload the writer is sending right now (0: none).
    sending: AtomicU64,
    socket: TcpStream,
}

impl Conn {
    fn is_alive(&self) -> bool {
        lock(&self.pending).alive
    }

    fn kill(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
        lock(&self.out).closed = true;
        let _ = self.doorbell.try_send(());
    }

    /// Sends `bytes`, on this thread when possible (application threads only).
    fn send_direct(&self, bytes: &[u8]) -> bool {
        let mut st = lock(&self.out);
        if st.closed {
            return false;
        }
        if st.busy || !st.queue.is_empty() {
            st.queue.extend_from_slice(bytes);
            drop(st);
            let _ = self.doorbell.try_send(());
            return true;
        }
        st.busy = true;
        drop(st);
        let result = (&self.writer).write_all(bytes);
        let mut st = lock(&self.out);
        st.busy = false;
        let more = !st.queue.is_empty();
        drop(st);
        if more {
            let _ = self.doorbell.try_send(());
        }
        if let Err(err) = result {
            tracing::debug!(%err, conn = self.index, "connection write failed");
            self.kill();
            return false;
        }
        true
    }

    /// Queues write frames for the writer thread (the posting thread does not block on
    /// their payload).
    fn send_writes(&self, frames: Vec<WriteFrame>) -> bool {
        let mut st = lock(&self.out);
        if st.closed {
            return false;
        }
        st.writes.extend(frames);
        drop(st);
        let _ = self.doorbell.try_send(());
        true
    }

    /// Queues `bytes` for the writer thread (connection threads: never blocks on IO).
    fn send_queued(&self, bytes: &[u8]) -> bool {
        let mut st = lock(&self.out);
        if st.closed {
            return false;
        }
        st.queue.extend_from_slice(bytes);
        drop(st);
        let _ = self.doorbell.try_send(());
        true
    }
}

/// The TCP link to one peer: `num_connections` data connections, each with a reader and
/// a writer thread, and the notification connection (no thread; see [`super::notif`]).
#[derive(Debug)]
pub(crate) struct TcpLink {
    peer: String,
    conns: Vec<Arc<Conn>>,
    notif: Arc<NotifSender>,
    next_conn: AtomicUsize,
    next_req: AtomicU64,
    /// Carries this link's notifications instead of its notification connection, once set (the
    /// shared-memory link's ring: the notifications of batches it hands to TCP take the
    /// same path as its others, so they stay in order).
    notif_sink: OnceLock<Arc<dyn NotifSink>>,
}

/// Connects to `meta`'s agent, every connection proving `key` (the token, or a session's
/// key in its place).
pub(crate) fn connect(
    ctx: &Arc<Context>,
    hub: &NotifHub,
    meta: &AgentMetadata,
    key: Option<&[u8]>,
) -> Result<Arc<TcpLink>, ConnectError> {
    let io_err = |source: io::Error| ConnectError::Io {
        peer: meta.name.clone(),
        addr: meta.tcp_addr.clone(),
        source,
    };
    let addr: SocketAddr = meta
        .tcp_addr
        .to_socket_addrs()
        .map_err(io_err)?
        .next()
        .ok_or_else(|| {
            io_err(io::Error::new(
                io::ErrorKind::NotFound,
                "address resolves to nothing",
            ))
        })?;
    let open = |index: u16| -> Result<TcpStream, ConnectError> {
        let stream =
            TcpStream::connect_timeout(&addr, ctx.limits.handshake_timeout).map_err(io_err)?;
        handshake(ctx, meta, key, &stream, index).map_err(|e| match e {
            HandshakeError::Io(source) => io_err(source),
            HandshakeError::Connect(e) => e,
        })?;
        Ok(stream)
    };
    let mut streams = Vec::with_capacity(ctx.num_connections);
    // `num_connections` is at most 64, far below `NOTIF_CONN_INDEX`.
    for index in 0..ctx.num_connections as u16 {
        streams.push(open(index)?);
    }
    let notif = NotifSender::new(
        meta.name.clone(),
        open(wire::NOTIF_CONN_INDEX)?,
        ctx.limits.max_queued_notif_bytes,
        hub.backlog(),
    )
    .map_err(io_err)?;
    let mut conns = Vec::with_capacity(streams.len());
    let mut readers = Vec::with_capacity(streams.len());
    for (index, stream) in streams.into_iter().enumerate() {
        let (doorbell, rx) = crossbeam_channel::bounded(1);
        let socket = stream.try_clone().map_err(io_err)?;
        let writer = stream.try_clone().map_err(io_err)?;
        let conn = Arc::new(Conn {
            index,
            out: Mutex::new(OutState::default()),
            doorbell,
            writer,
            pending: Mutex::new(Pending {
                alive: true,
                ops: HashMap::new(),
            }),
            receiving: AtomicU64::new(0),
            sending: AtomicU64::new(0),
            socket,
        });
        let conn2 = conn.clone();
        std::thread::Builder::new()
            .name(format!("kvl-tx-{}-{index}", meta.name))
            .spawn(move || write_loop(&conn2, &rx))
            .map_err(ConnectError::Thread)?;
        readers.push((conn.clone(), stream));
        conns.push(conn);
    }
    let link = Arc::new(TcpLink {
        peer: meta.name.clone(),
        conns,
        notif: Arc::new(notif),
        next_conn: AtomicUsize::new(0),
        next_req: AtomicU64::new(1),
        notif_sink: OnceLock::new(),
    });
    for (conn, stream) in readers {
        let link2 = link.clone();
        let ctx2 = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvl-rx-{}-{}", meta.name, conn.index))
            .spawn(move || read_loop(&ctx2, &link2, &conn, stream));
        if let Err(e) = spawned {
            link.close();
            return Err(ConnectError::Thread(e));
        }
    }
    tracing::debug!(peer = %meta.name, %addr, conns = link.conns.len(), "connected over TCP");
    Ok(link)
}

enum HandshakeError {
    Io(io::Error),
    Connect(ConnectError),
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn handshake(
    ctx: &Context,
    meta: &AgentMetadata,
    key: Option<&[u8]>,
    stream: &TcpStream,
    index: u16,
) -> Result<(), HandshakeError> {
    let peer = || meta.name.clone();
    let bad = |reason: String| {
        HandshakeError::Connect(ConnectError::Handshake {
            peer: peer(),
            reason,
        })
    };
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(ctx.limits.handshake_timeout))?;
    stream.set_write_timeout(Some(ctx.limits.handshake_timeout))?;
    wire::client_handshake(stream, wire::TCP_ROLES, index, &ctx.name, key, &meta.name).map_err(
        |e| match e {
            ClientAuthError::Frame(FrameError::Io(e)) => HandshakeError::Io(e),
            ClientAuthError::Frame(FrameError::Malformed(why)) => bad(why),
            ClientAuthError::Random(e) => HandshakeError::Connect(ConnectError::Random(e)),
            ClientAuthError::Version(version) => bad(format!(
                "peer speaks protocol version {version}, we speak {}",
                wire::PROTOCOL_VERSION
            )),
            ClientAuthError::WrongName(server_name) => bad(format!(
                "the agent at {} is called {server_name:?}, its metadata says {:?}",
                meta.tcp_addr, meta.name
            )),
            ClientAuthError::Rejected => {
                HandshakeError::Connect(ConnectError::AuthRejected { peer: peer() })
            }
            ClientAuthError::PeerAuthFailed => {
                HandshakeError::Connect(ConnectError::PeerAuthFailed { peer: peer() })
            }
        },
    )?;
    // From here on the batch timeouts bound reads (a stalled connection is shut down).
    // Writes keep a deadline: a request write to a peer that stopped reading kills the
    // connection. (The notification connection becomes non-blocking instead.)
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(ctx.limits.handshake_timeout))?;
    Ok(())
}

fn write_loop(conn: &Conn, doorbell: &Receiver<()>) {
    // Write payloads from memory a socket cannot read, copied to the host (at most one
    // chunk, `wire::MAX_WRITE_LEN`).
    let mut bounce = Vec::new();
    while doorbell.recv().is_ok() {
        loop {
            let mut st = lock(&conn.out);
            if st.closed {
                return;
            }
            if st.busy || (st.queue.is_empty() && st.writes.is_empty()) {
                // Whoever is writing rings again if more was queued meanwhile.
                break;
            }
            let buf = std::mem::take(&mut st.queue);
            st.busy = true;
            drop(st);
            let mut result = (&conn.writer).write_all(&buf);
            // Write frames one at a time, so that a timeout can withdraw those not sent.
            while result.is_ok() {
                let Some(w) = lock(&conn.out).writes.pop_front() else {
                    break;
                };
                result = send_write(conn, &w, &mut bounce);
            }
            lock(&conn.out).busy = false;
            if let Err(err) = result {
                tracing::debug!(%err, conn = conn.index, "connection write failed");
                conn.kill();
                return;
            }
        }
    }
}

/// Sends one write frame unless its batch already ended. While the payload leaves, the
/// batch counts it in `in_receive` (the caller gets its source back only once that is
/// zero) and `conn.sending` names the batch (a timeout shuts the connection down).
fn send_write(conn: &Conn, w: &WriteFrame, bounce: &mut Vec<u8>) -> io::Result<()> {
    {
        let mut st = w.batch.lock();
        if !st.is_running() {
            return Ok(());
        }
        st.in_receive += 1;
        // Stored under the lock, so a timeout that sees `in_receive > 0` sees it too.
        conn.sending.store(w.batch.id, Ordering::SeqCst);
    }
    let result = w.send(&conn.writer, bounce);
    conn.sending.store(0, Ordering::SeqCst);
    w.batch.lock().in_receive -= 1;
    result
}

fn read_loop(ctx: &Context, link: &TcpLink, conn: &Conn, stream: TcpStream) {
    let mut r = BufReader::with_capacity(HEADER_BUF, stream);
    let reason = match receive(link, conn, &mut r) {
        Err(FrameError::Malformed(why)) => {
            bump(&ctx.counters.malformed_frames);
            tracing::warn!(peer = %link.peer, %why, "malformed frame from peer; connection closed");
            format!("malformed frame: {why}")
        }
        Err(FrameError::Io(err)) => {
            tracing::debug!(peer = %link.peer, %err, "connection to peer ended");
            format!("connection {} closed: {err}", conn.index)
        }
        Ok(()) => unreachable!("receive only returns on error"),
    };
    conn.kill();
    let ops = {
        let mut p = lock(&conn.pending);
        p.alive = false;
        std::mem::take(&mut p.ops)
    };
    for (_, op) in ops {
        link.fail(
            &op.batch,
            TransferError::Disconnected {
                peer: link.peer.clone(),
                reason: reason.clone(),
            },
        );
    }
}

fn receive(link: &TcpLink, conn: &Conn, r: &mut BufReader<TcpStream>) -> Result<(), FrameError> {
    let mut scratch = Vec::new();
    // Device (not host-accessible) destinations are filled through pinned bounce buffers.
    let mut stager = Stager::new(StagingConfig::default());
    loop {
        let answers = [
            wire::READ_RESP,
            wire::READ_ERR,
            wire::WRITE_ACK,
            wire::WRITE_ERR,
        ];
        let (ty, len) = wire::read_header(r, &answers, |ty| match ty {
            wire::READ_RESP => wire::READ_RESP_LEN,
            wire::READ_ERR => wire::READ_ERR_LEN,
            wire::WRITE_ACK => wire::WRITE_ACK_LEN,
            _ => wire::WRITE_ERR_LEN,
        })?;
        let body = wire::read_body(r, len)?;
        let mut b = Body(&body);
        let req = b.u64()?;
        let op = lock(&conn.pending).ops.remove(&req);
        if ty == wire::WRITE_ACK || ty == wire::WRITE_ERR {
            let code = if ty == wire::WRITE_ERR {
                Some(b.u8()?)
            } else {
                None
            };
            b.finish()?;
            if let Some(op) = op {
                link.write_answered(&op, code)?;
            }
            continue;
        }
        if ty == wire::READ_ERR {
            let code = b.u8()?;
            b.finish()?;
            if let Some(op) = op {
                link.fail(
                    &op.batch,
                    TransferError::Refused {
                        peer: link.peer.clone(),
                        region: op.region,
                        offset: op.offset,
                        len: op.len,
                        reason: Refusal::from_code(code),
                    },
                );
            }
            continue;
        }
        let n = b.u64()?;
        b.finish()?;
        let Some(op) = op else {
            // A chunk of a batch that already failed (cancelled): skip its bytes.
            discard(r, n, &mut scratch)?;
            continue;
        };
        if n != op.len {
            return Err(FrameError::Malformed(format!(
                "response of {n} bytes to a read of {} bytes",
                op.len
            )));
        }
        // Decide under the batch lock whether the bytes may go into the destination: a
        // failed batch's memory is the caller's again once `in_receive` is zero.
        {
            let mut st = op.batch.lock();
            if !st.is_running() {
                drop(st);
                discard(r, n, &mut scratch)?;
                continue;
            }
            st.in_receive += 1;
            // Stored under the lock, so a timeout that sees `in_receive > 0` sees it too.
            conn.receiving.store(op.batch.id, Ordering::SeqCst);
        }
        let result = match &op.dest {
            Dest::Data { region, offset } if region.kind().is_host_accessible() => {
                receive_into(region.as_ref(), *offset, n, r).map(|()| None)
            }
            Dest::Data { region, offset } => match (usize::try_from(*offset), usize::try_from(n)) {
                // The pipelined stager: the read of chunk i+1 overlaps the copy of chunk i.
                (Ok(off), Ok(len)) => stager
                    .recv(region, off, len, r)
                    .map_err(|e| io::Error::other(e.to_string()))
                    .map(|()| None),
                _ => Err(io::Error::other(
                    "destination range beyond the address space",
                )),
            },
            // A peer answering a write with read bytes breaks the format.
            Dest::Write { .. } => Err(io::Error::other("a read response to a write")),
            Dest::Fence { .. } => {
                let mut w = [0u8; 8];
                r.read_exact(&mut w).map(|()| Some(u64::from_ne_bytes(w)))
            }
        };
        conn.receiving.store(0, Ordering::SeqCst);
        let next = {
            let mut st = op.batch.lock();
            st.in_receive -= 1;
            match (&result, &op.dest) {
                (Err(_), _) => Next::Nothing,
                (Ok(Some(found)), Dest::Fence { expected }) => {
                    st.fence_done(&link.peer, *expected, *found)
                }
                _ => st.chunk_done(n),
            }
        };
        if let Err(err) = result {
            link.fail(
                &op.batch,
                TransferError::Disconnected {
                    peer: link.peer.clone(),
                    reason: format!("connection {} broke mid-read: {err}", conn.index),
                },
            );
            return Err(err.into());
        }
        link.advance(&op.batch, next);
    }
}

/// Receives `n` bytes into `offset..offset + n` of a host-accessible destination: what the
/// reader already buffered is copied, the rest is read from the socket straight into the
/// region (no staging copy, and no `&mut` to region bytes that another connection's
/// reader or the region's owner could alias; see `RegionBytes`).
fn receive_into(
    region: &dyn DmaRegion,
    offset: u64,
    n: u64,
    r: &mut BufReader<TcpStream>,
) -> io::Result<()> {
    region
        .check_host_range(offset, n)
        .map_err(io::Error::other)?;
    let buffered = r.buffer();
    // At most `n`, and at most the buffer's length (a `usize`).
    let from_buffer = n.min(buffered.len() as u64) as usize;
    region
        .write_from(offset, &buffered[..from_buffer])
        .map_err(io::Error::other)?;
    r.consume(from_buffer);
    let done = from_buffer as u64;
    region
        .read_from_fd(offset + done, n - done, r.get_ref().as_fd())
        .map_err(io::Error::other)?
}

fn discard(r: &mut impl Read, mut n: u64, scratch: &mut Vec<u8>) -> io::Result<()> {
    scratch.resize(64 * 1024, 0);
    while n > 0 {
        // `n.min(len)` fits the scratch buffer.
        let take = n.min(scratch.len() as u64) as usize;
        r.read_exact(&mut scratch[..take])?;
        n -= take as u64;
    }
    Ok(())
}

impl TcpLink {
    /// Whether a connection is still alive (the shared-memory link checks it before it
    /// posts: a batch to a peer whose connections died fails as on TCP).
    pub(crate) fn is_connected(&self) -> bool {
        self.conns.iter().any(|c| c.is_alive())
    }

    fn alive_conns(&self) -> Vec<&Arc<Conn>> {
        self.conns.iter().filter(|c| c.is_alive()).collect()
    }

    fn disconnected(&self) -> TransferError {
        TransferError::Disconnected {
            peer: self.peer.clone(),
            reason: "no live connection".into(),
        }
    }

    /// Queues `op` on `conn` and returns the request frame, or `None` if it died.
    fn enqueue(
        &self,
        conn: &Conn,
        op: PendingOp,
        key: u64,
    ) -> Option<[u8; wire::HEADER_LEN + wire::READ_REQ_LEN]> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let frame = wire::read_req(req, op.region, key, op.offset, op.len);
        let mut p = lock(&conn.pending);
        if !p.alive {
            return None;
        }
        p.ops.insert(req, op);
        Some(frame)
    }

    fn post_fence(&self, batch: &Arc<Batch>, fence: FenceRead) {
        let conns = self.alive_conns();
        let Some(conn) = conns.first() else {
            self.fail(batch, self.disconnected());
            return;
        };
        let op = PendingOp {
            batch: batch.clone(),
            dest: Dest::Fence {
                expected: fence.expected,
            },
            region: fence.remote.region,
            offset: fence.remote.offset,
            len: 8,
        };
        match self.enqueue(conn, op, fence.remote.key) {
            Some(f) => {
                conn.send_queued(&f);
            }
            None => self.fail(batch, self.disconnected()),
        }
    }

    /// Completes a write op on its answer: `code` `None` (`WRITE_ACK`: every byte
    /// landed) or the refusal code of a `WRITE_ERR` (nothing of it landed).
    fn write_answered(&self, op: &PendingOp, code: Option<u8>) -> Result<(), FrameError> {
        let Dest::Write { expected } = op.dest else {
            return Err(FrameError::Malformed("a write answer to a read".into()));
        };
        match code.map(Refusal::from_code) {
            None => {
                let next = op.batch.lock().chunk_done(op.len);
                self.advance(&op.batch, next);
            }
            Some(Refusal::Stale) => self.fail(
                &op.batch,
                TransferError::Stale {
                    peer: self.peer.clone(),
                    region: op.region,
                    offset: op.offset,
                    len: op.len,
                    expected,
                },
            ),
            Some(reason) => self.fail(
                &op.batch,
                TransferError::Refused {
                    peer: self.peer.clone(),
                    region: op.region,
                    offset: op.offset,
                    len: op.len,
                    reason,
                },
            ),
        }
        Ok(())
    }

    /// Acts on what the batch state asked for after a completion (also for the
    /// shared-memory link, whose notifications travel here).
    pub(crate) fn advance(&self, batch: &Arc<Batch>, next: Next) {
        match next {
            Next::Nothing => {}
            Next::Fence(fence) => self.post_fence(batch, fence),
            // The notification connection never blocks its writer.
            Next::Notify(bytes) => match self.notif_to(&bytes) {
                Ok(()) => batch.lock().finish(),
                Err(e) => self.fail(batch, e),
            },
            Next::Finish => batch.lock().finish(),
        }
    }

    /// Fails `batch` and cancels its chunks still queued on any connection.
    pub(crate) fn fail(&self, batch: &Batch, err: TransferError) {
        if !batch.lock().fail(err) {
            return;
        }
        for conn in &self.conns {
            lock(&conn.pending)
                .ops
                .retain(|_, op| op.batch.id != batch.id);
        }
    }

    /// Sends this link's notifications through `sink` from now on (the shared-memory
    /// link routes them into its ring). The notification connection then carries nothing
    /// more: it is closed, so that the peer's `get_new_notifs` stops reading it (a system
    /// call per poll) and it frees one of the peer's inbound connection slots.
    pub(crate) fn route_notifs(&self, sink: Arc<dyn NotifSink>) {
        if self.notif_sink.set(sink).is_ok() {
            self.notif.close();
        }
    }

    /// The notification connection carries notifications (one queue per link, so they
    /// stay in order), unless a sink was routed in.
    fn notif_to(&self, bytes: &[u8]) -> Result<(), TransferError> {
        match self.notif_sink.get() {
            Some(sink) => sink.send(bytes),
            None => self.notif.send(bytes),
        }
    }
}

impl Link for TcpLink {
    fn post_reads(&self, batch: &Arc<Batch>, chunks: Vec<Chunk>) -> Result<(), TransferError> {
        let conns = self.alive_conns();
        if conns.is_empty() {
            return Err(self.disconnected());
        }
        let start = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let mut frames: Vec<Vec<u8>> = vec![Vec::new(); conns.len()];
        for (i, chunk) in chunks.into_iter().enumerate() {
            let k = (start + i) % conns.len();
            let op = PendingOp {
                batch: batch.clone(),
                dest: Dest::Data {
                    region: chunk.dest,
                    offset: chunk.dest_offset,
                },
                region: chunk.remote.region,
                offset: chunk.remote.offset,
                len: chunk.len,
            };
            match self.enqueue(conns[k], op, chunk.remote.key) {
                Some(f) => frames[k].extend_from_slice(&f),
                None => {
                    // Raced with the connection dying: fail the batch (ops already
                    // queued elsewhere are cancelled).
                    self.fail(batch, self.disconnected());
                    return Ok(());
                }
            }
        }
        for (k, f) in frames.into_iter().enumerate() {
            // A failed write kills the connection, whose reader then fails the ops.
            if !f.is_empty() {
                conns[k].send_direct(&f);
            }
        }
        Ok(())
    }

    /// Each chunk becomes one `WRITE_REQ`; the frames are striped over the live
    /// connections, whose writer threads send each payload straight from its source (so
    /// the source must stay unchanged until the batch ended, as a read's destination).
    fn post_writes(
        &self,
        batch: &Arc<Batch>,
        chunks: Vec<WriteChunk>,
        fence: WriteFence,
    ) -> Result<(), TransferError> {
        let conns = self.alive_conns();
        if conns.is_empty() {
            return Err(self.disconnected());
        }
        let start = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let mut frames: Vec<Vec<WriteFrame>> = conns.iter().map(|_| Vec::new()).collect();
        let f = (
            fence.remote.region,
            fence.remote.key,
            fence.remote.offset,
            fence.expected,
        );
        for (i, chunk) in chunks.into_iter().enumerate() {
            let k = (start + i) % conns.len();
            let req = self.next_req.fetch_add(1, Ordering::Relaxed);
            let dest = (chunk.remote.region, chunk.remote.key, chunk.remote.offset);
            let op = PendingOp {
                batch: batch.clone(),
                dest: Dest::Write {
                    expected: fence.expected,
                },
                region: chunk.remote.region,
                offset: chunk.remote.offset,
                len: chunk.len,
            };
            let mut p = lock(&conns[k].pending);
            if !p.alive {
                drop(p);
                // Raced with the connection dying: fail the batch (ops already queued
                // elsewhere are cancelled).
                self.fail(batch, self.disconnected());
                return Ok(());
            }
            p.ops.insert(req, op);
            drop(p);
            frames[k].push(WriteFrame {
                batch: batch.clone(),
                header: wire::write_req(req, dest, chunk.len, f),
                src: chunk.src,
                offset: chunk.src_offset,
                len: chunk.len,
            });
        }
        for (k, f) in frames.into_iter().enumerate() {
            // A failed write kills the connection, whose reader then fails the ops.
            if !f.is_empty() {
                conns[k].send_writes(f);
            }
        }
        Ok(())
    }

    /// Sends a notification over the notification connection, without blocking.
    fn send_notif(&self, bytes: Vec<u8>) -> Result<(), TransferError> {
        self.notif_to(&bytes)
    }

    /// Called once a batch timed out (already marked failed): cancels its queued chunks
    /// (and write frames not sent yet) and shuts down connections that are receiving
    /// into its memory, or sending a write from it, right now.
    fn on_timeout(&self, batch: &Batch) {
        for conn in &self.conns {
            lock(&conn.pending)
                .ops
                .retain(|_, op| op.batch.id != batch.id);
            lock(&conn.out).writes.retain(|w| w.batch.id != batch.id);
            if conn.receiving.load(Ordering::SeqCst) == batch.id
                || conn.sending.load(Ordering::SeqCst) == batch.id
            {
                tracing::warn!(peer = %self.peer, conn = conn.index, "batch timed out mid-transfer; closing the connection");
                conn.kill();
            }
        }
    }

    fn close(&self) {
        for conn in &self.conns {
            conn.kill();
        }
        self.notif.close();
    }
}
