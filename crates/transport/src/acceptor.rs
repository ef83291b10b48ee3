//! A capped TCP acceptor: one accept loop for kvlease's thread-per-connection listeners
//! (the agents' side channel, the Python side channel, the clock-probe server).
//!
//! [`Acceptor::bind`] listens on an address and accepts on a thread of its own. Every
//! connection takes a slot of a [`FairSlots`] (at most [`Limits::max_connections`] in
//! all, [`Limits::max_per_address`] per peer address) and is served by the
//! [`Handler`] on a thread of its own, holding its slot until [`Handler::serve`]
//! returns. A connection that gets no slot is answered by [`Handler::refuse`] the way its
//! protocol expects (a "busy" frame, or nothing) and closed. With
//! [`Limits::evict`], a newcomer may take the slot of a connection under way (its socket
//! shut down), as [`FairSlots`] decides, so that a few addresses cannot keep others out.
//!
//! [`Acceptor::shutdown`] (or dropping it) stops accepting and joins the accept thread:
//! the listener is closed when it returns. Connections under way end on their own (each
//! protocol bounds them by a deadline). The loop waits for connections or shutdown with
//! `mio`, so it neither spins nor polls.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::slots::FairSlots;

/// How long the loop backs off after a failed accept (out of descriptors, ...) instead
/// of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);

/// What an [`Acceptor`] lets peers hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once, each on its own thread (at least 1).
    pub max_connections: usize,
    /// Connections served at once for one peer address (at least 1, at most
    /// `max_connections`).
    pub max_per_address: usize,
    /// Whether a newcomer may take the slot of a connection under way (its socket is shut
    /// down, and [`Handler::evicted`] told); without it a connection over a cap is
    /// refused.
    pub evict: bool,
}

/// What an [`Acceptor`] does with the connections it accepts.
pub trait Handler: Send + Sync + 'static {
    /// Serves one connection on its own thread (blocking, its slot held until this
    /// returns). `accepted` is when it was accepted, for the protocol's deadline.
    fn serve(&self, conn: TcpStream, peer: SocketAddr, accepted: Instant);

    /// Answers a connection refused for want of a slot, before it is closed. Runs on the
    /// accept thread with `conn` nonblocking: write only what a fresh socket's buffer
    /// takes at once. Log and count it here. The default closes it unanswered.
    fn refuse(&self, conn: &TcpStream, peer: SocketAddr) {
        let _ = (conn, peer);
    }

    /// A connection under way was cut off to make room for `peer`'s (with
    /// [`Limits::evict`]). Runs with the slots locked: count it, do not block.
    fn evicted(&self) {}

    /// No thread could be started for `peer`'s connection, which is closed unserved (the
    /// acceptor logs it too).
    fn spawn_failed(&self, peer: SocketAddr, error: &io::Error) {
        let _ = (peer, error);
    }
}

/// A running acceptor; [`shutdown`](Self::shutdown) or dropping it stops accepting and
/// joins its thread.
#[derive(Debug)]
pub struct Acceptor {
    addr: SocketAddr,
    slots: FairSlots,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Binds `addr` and accepts on a thread named `name` (its connections' threads are
    /// named `name-conn`).
    ///
    /// # Errors
    /// The bind error; `InvalidInput` for a limit of zero or a per-address limit over the
    /// total; the error of starting the thread.
    pub fn bind(
        addr: SocketAddr,
        name: &str,
        limits: Limits,
        handler: Arc<dyn Handler>,
    ) -> io::Result<Self> {
        if limits.max_connections == 0
            || limits.max_per_address == 0
            || limits.max_per_address > limits.max_connections
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "connection limits must be at least 1, per address at most in all: \
                     {limits:?}"
                ),
            ));
        }
        let mut listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let stop = Arc::new(AtomicBool::new(false));
        let slots = FairSlots::new(limits.max_connections, limits.max_per_address);
        let accept = AcceptLoop {
            listener,
            poll,
            stop: Arc::clone(&stop),
            slots: slots.clone(),
            evict: limits.evict,
            handler,
            conn_name: format!("{name}-conn"),
        };
        let thread = thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || accept.run())
            .map_err(|e| io::Error::new(e.kind(), format!("starting the accept thread: {e}")))?;
        Ok(Self {
            addr,
            slots,
            stop,
            waker,
            thread: Some(thread),
        })
    }

    /// The bound address.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections served now.
    #[must_use]
    pub fn served_now(&self) -> usize {
        self.slots.len()
    }

    /// Connections cut off to make room, since the acceptor started.
    #[must_use]
    pub fn evicted(&self) -> u64 {
        self.slots.evicted()
    }

    /// Stops accepting and joins the accept thread (idempotent): the listener is closed
    /// when this returns. Connections under way are left to end by their deadlines.
    pub fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::Release);
        if let Err(e) = self.waker.wake() {
            // The loop cannot be woken: it would wait for the next connection. Leave it.
            tracing::error!(addr = %self.addr, error = %e, "acceptor: cannot wake the accept loop");
            return;
        }
        if thread.join().is_err() {
            tracing::error!(addr = %self.addr, "acceptor: the accept thread panicked");
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct AcceptLoop {
    listener: TcpListener,
    poll: Poll,
    stop: Arc<AtomicBool>,
    slots: FairSlots,
    evict: bool,
    handler: Arc<dyn Handler>,
    conn_name: String,
}

impl AcceptLoop {
    fn run(mut self) {
        let mut events = Events::with_capacity(4);
        while !self.stop.load(Ordering::Acquire) {
            match self.listener.accept() {
                Ok((conn, peer)) => self.admit(conn.into(), peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Every pending connection is taken: wait for the next, or shutdown.
                    if let Err(e) = self.poll.poll(&mut events, None)
                        && e.kind() != io::ErrorKind::Interrupted
                    {
                        tracing::error!(error = %e, "acceptor: poll failed; stopping");
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "acceptor: accept failed");
                    thread::sleep(ACCEPT_BACKOFF);
                }
            }
        }
    }

    /// Serves `conn` on a thread of its own if it gets a slot; else refuses it.
    fn admit(&self, conn: TcpStream, peer: SocketAddr) {
        let accepted = Instant::now();
        let slot = if self.evict {
            conn.try_clone().ok().and_then(|socket| {
                let handler = Arc::clone(&self.handler);
                self.slots.admit(peer.ip(), move || {
                    handler.evicted();
                    let _ = socket.shutdown(Shutdown::Both);
                    true
                })
            })
        } else {
            self.slots.admit(peer.ip(), || false)
        };
        let Some(slot) = slot else {
            // Still nonblocking, as accepted: a refusal never stalls the loop.
            self.handler.refuse(&conn, peer);
            return;
        };
        let handler = Arc::clone(&self.handler);
        let spawned = thread::Builder::new()
            .name(self.conn_name.clone())
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = conn.set_nonblocking(false) {
                    tracing::debug!(%peer, error = %e, "acceptor: connection unusable");
                    return;
                }
                handler.serve(conn, peer, accepted);
            });
        if let Err(e) = spawned {
            tracing::error!(%peer, error = %e, "acceptor: cannot start a connection thread");
            self.handler.spawn_failed(peer, &e);
        }
    }
}
