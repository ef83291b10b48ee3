//! A TCP stream whose every read and write ends by one absolute deadline.
//!
//! Socket timeouts alone bound each `read` or `write` call, not an exchange: a peer that
//! sends one byte just inside the timeout, again and again, holds the connection for as
//! long as it likes. The side channels (the agents' and the Python connector's) wrap each
//! handshake's socket in a [`Deadlined`] so that the whole handshake ends by its deadline.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A [`TcpStream`] whose reads and writes fail with [`io::ErrorKind::TimedOut`] once
/// `deadline` has passed, and each of which waits at most until then.
#[derive(Debug)]
pub struct Deadlined {
    stream: TcpStream,
    deadline: Instant,
}

impl Deadlined {
    /// Wraps `stream`; every later read and write ends by `deadline`.
    pub fn new(stream: TcpStream, deadline: Instant) -> Self {
        Self { stream, deadline }
    }

    /// The stream (to set options such as `TCP_NODELAY`).
    pub fn get_ref(&self) -> &TcpStream {
        &self.stream
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for Deadlined {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A peer that sends one byte every 50 ms, each well inside a per-call timeout, is cut
    /// off by the deadline instead.
    #[test]
    fn a_trickling_peer_is_cut_off_at_the_deadline() -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let trickler = std::thread::spawn(move || -> io::Result<()> {
            let mut s = TcpStream::connect(addr)?;
            for _ in 0..100 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        });
        let (stream, _) = listener.accept()?;
        let started = Instant::now();
        let mut s = Deadlined::new(stream, started + Duration::from_millis(300));
        let mut buf = [0u8; 1000];
        let err = s
            .read_exact(&mut buf)
            .expect_err("1000 bytes never arrive in time");
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(3));
        drop(s);
        trickler.join().expect("trickler thread")?;
        Ok(())
    }
}
