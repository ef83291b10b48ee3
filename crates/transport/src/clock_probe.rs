//! Clock probes over TCP ([`kvlease_proto::clock`]'s frames): [`ClockProbeServer`] answers
//! them with a clock of the caller's choosing, [`probe_clock`] times them and feeds a
//! [`ClockOffsetEstimator`]. Bidirectional mode's holder (the agents' D, the vLLM
//! connector's D) serves one; the next turn's reader probes it to read the hold's deadline
//! on its own clock.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlease_lease::{ClockOffsetEstimator, PeerTimestamp, Timestamp};
use kvlease_proto::clock::{PROBE_ANSWER_LEN, PROBE_REQUEST, probe_answer, read_probe_answer};

use crate::acceptor::{Acceptor, Handler, Limits};

/// Read/write timeout of every clock-probe socket.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most clock-probe connections served at once.
pub const MAX_PROBE_CONNS: usize = 32;
/// Most probes answered on one connection.
pub const MAX_PROBES_PER_CONN: u32 = 64;

/// The clock a probe server reports, in nanoseconds.
pub type ProbeClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Answers clock probes with `clock`'s reading. It reveals only the time, so it needs no
/// token.
pub struct ClockProbeServer {
    clock: ProbeClock,
}

/// A running probe server; stops accepting when dropped.
#[derive(Debug)]
pub struct ProbeHandle {
    /// The bound address.
    pub addr: SocketAddr,
    _acceptor: Acceptor,
}

impl ClockProbeServer {
    /// A server reporting `clock` (nanoseconds on the scale the holder's deadlines use).
    pub fn new(clock: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Self {
            clock: Arc::new(clock),
        }
    }

    /// Binds `addr` and answers probes on a background thread (one short-lived thread per
    /// connection, at most [`MAX_PROBE_CONNS`], more are closed unanswered; each ends
    /// after [`MAX_PROBES_PER_CONN`] probes, a malformed probe or [`PROBE_TIMEOUT`] of
    /// silence).
    ///
    /// # Errors
    /// The bind error.
    pub fn spawn(self, addr: SocketAddr) -> io::Result<ProbeHandle> {
        // Probes are short and cheap: no address gets a share of its own, and none is cut
        // off for another.
        let limits = Limits {
            max_connections: MAX_PROBE_CONNS,
            max_per_address: MAX_PROBE_CONNS,
            evict: false,
        };
        let acceptor = Acceptor::bind(addr, "clock-probe", limits, Arc::new(self))?;
        Ok(ProbeHandle {
            addr: acceptor.local_addr(),
            _acceptor: acceptor,
        })
    }
}

impl Handler for ClockProbeServer {
    fn serve(&self, conn: TcpStream, _peer: SocketAddr, _accepted: Instant) {
        let _ = answer_probes(conn, &*self.clock);
    }
}

fn answer_probes(mut s: TcpStream, clock: &(dyn Fn() -> u64 + Send + Sync)) -> io::Result<()> {
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    s.set_write_timeout(Some(PROBE_TIMEOUT))?;
    s.set_nodelay(true)?;
    for _ in 0..MAX_PROBES_PER_CONN {
        let mut req = [0u8; 8];
        s.read_exact(&mut req)?;
        if req != PROBE_REQUEST {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a probe"));
        }
        s.write_all(&probe_answer(clock()))?;
    }
    Ok(())
}

/// Sends `samples` probes to `addr` on one connection and feeds each `(t0, t_remote, t1)`
/// into `est`; `local` is this host's clock (as [`Timestamp`]s on the same scale as the
/// ones the deadline check uses). Returns how many samples were added.
///
/// # Errors
/// The IO error or timeout ([`PROBE_TIMEOUT`] per socket operation); a reply that is not a
/// probe answer is [`io::ErrorKind::InvalidData`].
pub fn probe_clock(
    addr: SocketAddr,
    samples: u32,
    local: &dyn Fn() -> Timestamp,
    est: &mut ClockOffsetEstimator,
) -> io::Result<u32> {
    let mut s = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)?;
    s.set_read_timeout(Some(PROBE_TIMEOUT))?;
    s.set_write_timeout(Some(PROBE_TIMEOUT))?;
    s.set_nodelay(true)?;
    let mut added = 0;
    for _ in 0..samples.min(MAX_PROBES_PER_CONN) {
        let t0 = local();
        s.write_all(&PROBE_REQUEST)?;
        let mut reply = [0u8; PROBE_ANSWER_LEN];
        s.read_exact(&mut reply)?;
        let t1 = local();
        let Some(ns) = read_probe_answer(&reply) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad probe reply",
            ));
        };
        if est
            .add_sample(t0, PeerTimestamp::from_nanos(ns), t1)
            .is_ok()
        {
            added += 1;
        }
    }
    Ok(added)
}
