//! The notification connection: one per link, read by the application's own poll.
//!
//! Each link opens, besides its data connections, one connection marked in its `HELLO`
//! ([`wire::NOTIF_CONN_INDEX`]) and authenticated like the others. It carries only
//! `NOTIF` frames, from the connecting side to the accepting one.
//!
//! **Receiving side** ([`NotifHub`]). Once the handshake succeeded, the connection's
//! serving thread hands the socket over and ends: no thread reads it. The socket is
//! non-blocking and read by [`Agent::get_new_notifs`](crate::Agent::get_new_notifs) on
//! the caller's thread, so a notification reaches the application without waking a
//! blocked thread (a wake-up costs 5–13 µs on the 2-core KVM guest this was measured on;
//! the `tcp_bench` round trip went from 14–46 µs to about 9.5 µs, NIXL's being about
//! 17 µs in the same interleaved runs). An empty poll costs one `epoll_wait(0)` over
//! all notification connections however many peers there are (mio, edge-triggered);
//! with a single connection it costs one non-blocking `recv` on it instead, which is as
//! cheap and saves the `epoll_wait` when a message is there (about 1 µs per round
//! trip). Frames are parsed with the wire format's checks and limits: a wrong type or a
//! body over `limits.max_notif_len` closes that connection (a log line and
//! `malformed_frames`), and only that one. A frame split over several reads waits in
//! the connection's buffer, which holds 64 KiB or one whole frame, whichever is larger.
//! (epoll through mio: a safe wrapper, already built for tokio; this module has no
//! `unsafe`.)
//!
//! One poll takes no more than the inbox holds (`limits.max_pending_notifs`,
//! `limits.max_pending_notif_bytes`): the rest stays in the socket for the next poll,
//! so notifications on this connection are never dropped for lack of room; they push
//! back on the sender instead.
//!
//! **Sending side** ([`NotifSender`]). The caller writes on its own thread, without
//! blocking (the socket is non-blocking), whether it is an application thread
//! (`send_notif`) or a connection thread completing a batch. What the socket does not
//! take waits in the link's queue, bounded by `limits.max_queued_notif_bytes`, and is
//! written ahead of later notifications by the next send or by the next
//! `get_new_notifs` of the sending agent. A notification that does not fit the queue is
//! refused with [`TransferError::NotifQueueFull`] and nothing of it is sent: a
//! receiver that stops polling never blocks the sender, nor makes it allocate without
//! bound.
//!
//! Ordering: one connection and one queue per link, so notifications to one peer
//! arrive in the order they were handed over. A batch's notification is handed over
//! only once every response of the batch (and the fence word) was received, so the
//! peer has served every read of the batch before the notification leaves.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use mio::{Events, Interest, Poll, Token};

use super::wire::{self, FrameError};
use crate::context::Context;
use crate::error::TransferError;
use crate::ids::Sender;
use crate::stats::bump;
use crate::sync::lock;

/// Bytes asked of the socket per read, and the usual size of a connection's buffer.
const READ_CHUNK: usize = 64 * 1024;
/// Readiness events taken per `epoll_wait`; more ready connections are reported by the
/// next poll.
const EVENTS: usize = 256;
/// Up to this many notification connections, a poll reads each one directly (one `recv`
/// per connection) instead of asking epoll first (`epoll_wait`, then a `recv` per ready
/// connection).
const DIRECT_READ_MAX: usize = 1;

/// An authenticated notification connection, handed over by its serving thread.
#[derive(Debug)]
pub(crate) struct Handoff {
    /// The socket (still blocking).
    pub(crate) stream: TcpStream,
    /// The peer, as it proved itself in the handshake.
    pub(crate) peer: Sender,
    /// Bytes the serving thread had read past the handshake.
    pub(crate) buffered: Vec<u8>,
    /// The connection's slot of its peer address, held as long as the connection.
    pub(crate) slot: Option<crate::slots::AddressSlot>,
}

/// The receiving side: this agent's inbound notification connections, and the queues
/// of its outbound ones that wait for the socket.
#[derive(Debug)]
pub(crate) struct NotifHub {
    sources: Mutex<Sources>,
    /// Connections in `sources`: a poll with none takes no lock and makes no syscall,
    /// and the accept path counts them against `limits.max_inbound_connections`.
    count: AtomicUsize,
    backlog: Arc<Backlog>,
}

#[derive(Debug)]
struct Sources {
    poll: Poll,
    events: Events,
    conns: HashMap<Token, Source>,
    /// Connections that may have bytes to read or whole frames to deliver without a new
    /// readiness event (epoll is edge-triggered).
    hot: Vec<Token>,
    next_token: usize,
    /// The agent is being dropped: connections handed over now are closed.
    closed: bool,
}

#[derive(Debug)]
struct Source {
    peer: Sender,
    /// The connection's slot of its peer address (given back when it closes).
    _slot: Option<crate::slots::AddressSlot>,
    stream: mio::net::TcpStream,
    /// `buf[start..end]` holds bytes received and not yet delivered: whole frames the
    /// inbox had no room for, then at most one partial frame.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The socket may hold unread bytes.
    readable: bool,
    /// In `Sources::hot`.
    hot: bool,
}

/// Why a connection's servicing stopped.
enum Serviced {
    /// Everything received was delivered and the socket is drained.
    Idle,
    /// The inbox is full; the rest waits for the next poll.
    Stalled,
}

/// Why a notification connection is closed.
enum End {
    Eof,
    Frame(FrameError),
}

impl NotifHub {
    /// # Errors
    /// The OS refused an epoll instance.
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            sources: Mutex::new(Sources {
                poll: Poll::new()?,
                events: Events::with_capacity(EVENTS),
                conns: HashMap::new(),
                hot: Vec::new(),
                next_token: 0,
                closed: false,
            }),
            count: AtomicUsize::new(0),
            backlog: Arc::default(),
        })
    }

    /// Inbound notification connections held.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Takes over an authenticated notification connection.
    pub(crate) fn add(&self, handoff: Handoff) {
        let Handoff {
            stream,
            peer,
            buffered,
            slot,
        } = handoff;
        let mut s = lock(&self.sources);
        if s.closed {
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        if let Err(err) = stream.set_nonblocking(true) {
            tracing::warn!(%peer, %err, "notification connection unusable; closed");
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        let mut stream = mio::net::TcpStream::from_std(stream);
        let token = Token(s.next_token);
        s.next_token += 1;
        if let Err(err) = s
            .poll
            .registry()
            .register(&mut stream, token, Interest::READABLE)
        {
            tracing::warn!(%peer, %err, "notification connection not registered with epoll; closed");
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        tracing::debug!(%peer, "notification connection authenticated");
        let end = buffered.len();
        let mut buf = buffered;
        buf.resize(READ_CHUNK.max(end), 0);
        s.conns.insert(
            token,
            Source {
                peer,
                _slot: slot,
                stream,
                buf,
                start: 0,
                end,
                // Bytes may have arrived before the registration.
                readable: true,
                hot: true,
            },
        );
        s.hot.push(token);
        self.count.store(s.conns.len(), Ordering::Release);
    }

    /// Writes what waits in the outbound queues, then reads the inbound connections into
    /// the inbox (as far as it has room). Called by `Agent::get_new_notifs`.
    pub(crate) fn poll(&self, ctx: &Context) {
        self.backlog.flush();
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut guard = lock(&self.sources);
        let s = &mut *guard;
        if s.conns.len() <= DIRECT_READ_MAX {
            for (token, c) in &mut s.conns {
                c.wake(*token, &mut s.hot);
            }
        } else {
            match s.poll.poll(&mut s.events, Some(Duration::ZERO)) {
                Ok(()) => {
                    for event in &s.events {
                        let token = event.token();
                        if let Some(c) = s.conns.get_mut(&token) {
                            c.wake(token, &mut s.hot);
                        }
                    }
                }
                // Interrupted by a signal: the next poll looks again.
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => tracing::warn!(%err, "epoll_wait on notification connections failed"),
            }
        }
        let max_body = ctx.limits.max_notif_len;
        let mut stalled = None;
        for token in std::mem::take(&mut s.hot) {
            if stalled.is_some() {
                // Left for the next poll, in the same order.
                s.hot.push(token);
                continue;
            }
            let Some(c) = s.conns.get_mut(&token) else {
                continue;
            };
            match c.service(ctx, max_body) {
                Ok(Serviced::Idle) => c.hot = false,
                Ok(Serviced::Stalled) => stalled = Some(token),
                Err(end) => {
                    if let Some(mut c) = s.conns.remove(&token) {
                        c.close(ctx, end, s.poll.registry());
                    }
                }
            }
        }
        // The connection that filled the inbox goes after those left unread, so that a
        // peer sending more than the inbox holds between two polls cannot starve the
        // others (each connection keeps its own order).
        s.hot.extend(stalled);
        self.count.store(s.conns.len(), Ordering::Release);
    }

    /// Closes every inbound notification connection, and those handed over later (the
    /// agent is being dropped).
    pub(crate) fn close(&self) {
        let mut s = lock(&self.sources);
        s.closed = true;
        for (_, c) in s.conns.drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        s.hot.clear();
        self.count.store(0, Ordering::Release);
    }

    /// The queue of outbound notifications waiting for their sockets (shared with this
    /// agent's senders).
    pub(crate) fn backlog(&self) -> Arc<Backlog> {
        Arc::clone(&self.backlog)
    }
}

impl Source {
    /// Marks the connection readable and, unless it already is, hot (listed in `hot`
    /// under its `token`).
    fn wake(&mut self, token: Token, hot: &mut Vec<Token>) {
        self.readable = true;
        if !self.hot {
            self.hot = true;
            hot.push(token);
        }
    }

    /// Delivers the whole frames received, reading the socket until it is drained or the
    /// inbox is full.
    fn service(&mut self, ctx: &Context, max_body: usize) -> Result<Serviced, End> {
        loop {
            // The frame at `start`, when its header is here: its body length.
            let mut need = wire::HEADER_LEN;
            while self.end - self.start >= wire::HEADER_LEN {
                let mut r = &self.buf[self.start..self.end];
                let (_, len) =
                    wire::read_header(&mut r, &[wire::NOTIF], |_| max_body).map_err(End::Frame)?;
                need = wire::HEADER_LEN + len;
                if r.len() < len {
                    break;
                }
                if !ctx.deliver_notif_if_room(&self.peer, &r[..len]) {
                    return Ok(Serviced::Stalled);
                }
                self.start += need;
                need = wire::HEADER_LEN;
            }
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
                if self.buf.len() > READ_CHUNK {
                    // A large frame passed; do not keep its buffer.
                    self.buf.truncate(READ_CHUNK);
                    self.buf.shrink_to_fit();
                }
            }
            if !self.readable {
                return Ok(Serviced::Idle);
            }
            // What is left is one partial frame: move it to the front, and make room for
            // the whole of it (its length was checked against the limit).
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            let asked = self.buf.len() - self.end;
            match (&self.stream).read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(End::Eof),
                Ok(n) => {
                    self.end += n;
                    // A short read took everything the socket held; the next arrival is
                    // a new edge. (Tokio clears readiness the same way.)
                    if n < asked {
                        self.readable = false;
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => self.readable = false,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(End::Frame(FrameError::Io(err))),
            }
        }
    }

    fn close(&mut self, ctx: &Context, end: End, registry: &mio::Registry) {
        match end {
            End::Eof => {
                tracing::debug!(peer = %self.peer, "notification connection closed by the peer");
            }
            End::Frame(FrameError::Malformed(why)) => {
                bump(&ctx.counters.malformed_frames);
                tracing::warn!(peer = %self.peer, %why, "malformed frame on a notification connection; connection closed");
            }
            End::Frame(FrameError::Io(err)) => {
                tracing::debug!(peer = %self.peer, %err, "notification connection failed; closed");
            }
        }
        let _ = registry.deregister(&mut self.stream);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Outbound notification queues with bytes waiting for their sockets; written by the
/// sending agent's `get_new_notifs`.
#[derive(Debug, Default)]
pub(crate) struct Backlog {
    senders: Mutex<Vec<Weak<NotifSender>>>,
    /// `senders.len()`, read without the lock.
    len: AtomicUsize,
}

impl Backlog {
    fn push(&self, sender: Weak<NotifSender>) {
        let mut v = lock(&self.senders);
        v.push(sender);
        self.len.store(v.len(), Ordering::Release);
    }

    fn flush(&self) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut v = lock(&self.senders);
        v.retain(|s| s.upgrade().is_some_and(|s| s.flush()));
        self.len.store(v.len(), Ordering::Release);
    }
}

/// The sending side of one link's notification connection.
#[derive(Debug)]
pub(crate) struct NotifSender {
    peer: String,
    /// Non-blocking.
    stream: TcpStream,
    queue: Mutex<SendQueue>,
    /// `limits.max_queued_notif_bytes`.
    max_queued: usize,
    backlog: Arc<Backlog>,
}

/// Frame bytes the socket did not take yet, in order.
#[derive(Debug, Default)]
struct SendQueue {
    bytes: Vec<u8>,
    /// Written up to here.
    start: usize,
    closed: bool,
    /// Listed in the backlog.
    listed: bool,
}

impl SendQueue {
    fn pending(&self) -> usize {
        self.bytes.len() - self.start
    }
}

impl NotifSender {
    /// Wraps an authenticated notification connection (made non-blocking here).
    pub(crate) fn new(
        peer: String,
        stream: TcpStream,
        max_queued: usize,
        backlog: Arc<Backlog>,
    ) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            peer,
            stream,
            queue: Mutex::default(),
            max_queued,
            backlog,
        })
    }

    fn disconnected(&self, reason: String) -> TransferError {
        TransferError::Disconnected {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Sends one notification without blocking: written now as far as the socket takes
    /// it, the rest queued behind what already waits.
    ///
    /// # Errors
    /// [`TransferError::NotifQueueFull`] (nothing sent) when it does not fit the queue;
    /// [`TransferError::Disconnected`] once the connection failed or was closed.
    pub(crate) fn send(self: &Arc<Self>, body: &[u8]) -> Result<(), TransferError> {
        let header = wire::header(wire::NOTIF, body.len());
        let frame_len = header.len() + body.len();
        let mut q = lock(&self.queue);
        if q.closed {
            return Err(self.disconnected("notification connection closed".into()));
        }
        if q.pending() > 0 {
            self.write_queued(&mut q)?;
        }
        if q.pending() == 0 {
            let written = self.write_now(&mut q, &header, body)?;
            if written == frame_len {
                return Ok(());
            }
            // The rest of a frame begun must follow, whatever its size.
            let rest = written.saturating_sub(header.len());
            q.bytes
                .extend_from_slice(&header[written.min(header.len())..]);
            q.bytes.extend_from_slice(&body[rest..]);
        } else {
            let queued = q.pending();
            if queued + frame_len > self.max_queued {
                return Err(TransferError::NotifQueueFull {
                    peer: self.peer.clone(),
                    queued,
                    max: self.max_queued,
                });
            }
            q.bytes.extend_from_slice(&header);
            q.bytes.extend_from_slice(body);
        }
        let list = !q.listed;
        q.listed = true;
        drop(q);
        if list {
            // Outside the queue's lock: `Backlog::flush` takes the locks the other way.
            self.backlog.push(Arc::downgrade(self));
        }
        Ok(())
    }

    /// Writes `header` + `body` as far as the socket takes them; returns the bytes
    /// written.
    fn write_now(
        &self,
        q: &mut SendQueue,
        header: &[u8],
        body: &[u8],
    ) -> Result<usize, TransferError> {
        loop {
            match (&self.stream).write_vectored(&[IoSlice::new(header), IoSlice::new(body)]) {
                Ok(n) => return Ok(n),
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(self.fail(q, &err)),
            }
        }
    }

    /// Writes queued bytes until the queue is empty or the socket is full.
    fn write_queued(&self, q: &mut SendQueue) -> Result<(), TransferError> {
        while q.pending() > 0 {
            match (&self.stream).write(&q.bytes[q.start..]) {
                Ok(0) => {
                    let err = io::Error::from(io::ErrorKind::WriteZero);
                    return Err(self.fail(q, &err));
                }
                Ok(n) => q.start += n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(self.fail(q, &err)),
            }
        }
        if q.pending() == 0 {
            q.bytes.clear();
            q.start = 0;
            if q.bytes.capacity() > self.max_queued {
                q.bytes.shrink_to(READ_CHUNK);
            }
        } else if q.start > q.bytes.len() / 2 {
            q.bytes.drain(..q.start);
            q.start = 0;
        }
        Ok(())
    }

    fn fail(&self, q: &mut SendQueue, err: &io::Error) -> TransferError {
        tracing::debug!(peer = %self.peer, %err, "notification connection write failed; closed");
        self.shut(q);
        self.disconnected(format!("notification connection: {err}"))
    }

    /// Writes what waits (the backlog's flush). Returns whether bytes still wait.
    fn flush(&self) -> bool {
        let mut q = lock(&self.queue);
        if !q.closed && q.pending() > 0 {
            // A failure closes the connection; the next send reports it.
            let _ = self.write_queued(&mut q);
        }
        let waiting = !q.closed && q.pending() > 0;
        q.listed = waiting;
        waiting
    }

    /// Closes the connection; queued notifications are dropped.
    pub(crate) fn close(&self) {
        self.shut(&mut lock(&self.queue));
    }

    /// Marks the queue closed, drops what it holds and shuts the socket down.
    fn shut(&self, q: &mut SendQueue) {
        q.closed = true;
        q.bytes = Vec::new();
        q.start = 0;
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
