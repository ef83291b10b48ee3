//! The capped acceptor on real sockets: a connection over the cap is refused the way the
//! handler answers; a slot comes back when its connection closes; a newcomer may evict;
//! shutdown joins the accept thread and closes the listener.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use kvlease_transport::acceptor::{Acceptor, Handler, Limits};

const TIMEOUT: Duration = Duration::from_secs(5);

/// Echoes one line per connection's byte ("served"), then holds it until the peer
/// closes; answers a refusal with `b"busy"`.
#[derive(Default)]
struct Echo {
    refused: AtomicU64,
    evicted: AtomicU64,
    finished: AtomicU64,
}

impl Handler for Echo {
    fn serve(&self, mut conn: TcpStream, _peer: SocketAddr, _accepted: Instant) {
        let _ = conn.set_read_timeout(Some(TIMEOUT));
        let mut byte = [0u8; 1];
        // Served until the peer closes, fails or is cut off.
        while matches!(conn.read(&mut byte), Ok(1)) {
            if conn.write_all(b"served").is_err() {
                break;
            }
        }
        self.finished.fetch_add(1, Ordering::Relaxed);
    }

    fn refuse(&self, conn: &TcpStream, _peer: SocketAddr) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let _ = (&mut &*conn).write_all(b"busy");
    }

    fn evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect");
    s.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    s
}

/// What the server answers a probe byte with, until it closes ("" when closed at once).
fn ask(s: &mut TcpStream) -> String {
    let _ = s.write_all(b"?");
    answer(s)
}

/// What the server sends (at most 6 bytes) before it closes.
fn answer(s: &mut TcpStream) -> String {
    let mut got = [0u8; 6];
    let mut n = 0;
    while n < got.len() {
        match s.read(&mut got[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    String::from_utf8_lossy(&got[..n]).into_owned()
}

/// Waits (bounded) until `f` holds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = SystemTime::now() + TIMEOUT;
    while !f() {
        assert!(SystemTime::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn acceptor(limits: Limits) -> (Acceptor, Arc<Echo>) {
    let echo = Arc::new(Echo::default());
    let handler: Arc<dyn Handler> = echo.clone();
    let a = Acceptor::bind(
        "127.0.0.1:0".parse().expect("literal"),
        "test-accept",
        limits,
        handler,
    )
    .expect("bind");
    (a, echo)
}

#[test]
fn a_connection_over_the_cap_is_refused_and_a_closed_one_gives_its_slot_back() {
    let (a, echo) = acceptor(Limits {
        max_connections: 2,
        max_per_address: 2,
        evict: false,
    });
    let mut first = connect(a.local_addr());
    let mut second = connect(a.local_addr());
    assert_eq!(ask(&mut first), "served");
    assert_eq!(ask(&mut second), "served");
    assert_eq!(a.served_now(), 2);

    // Nothing sent: a refused socket closed with unread bytes could reset the answer.
    let mut third = connect(a.local_addr());
    assert_eq!(
        answer(&mut third),
        "busy",
        "refused as the handler answers, then closed"
    );
    assert_eq!(echo.refused.load(Ordering::Relaxed), 1);

    drop(first);
    eventually("the first connection's slot to come back", || {
        a.served_now() == 1
    });
    let mut fourth = connect(a.local_addr());
    assert_eq!(ask(&mut fourth), "served");
    assert_eq!(ask(&mut second), "served", "the others are untouched");
    assert_eq!(echo.evicted.load(Ordering::Relaxed), 0);
}

#[test]
fn with_eviction_a_newcomer_cuts_off_its_own_address_oldest_connection() {
    let (a, echo) = acceptor(Limits {
        max_connections: 4,
        max_per_address: 1,
        evict: true,
    });
    let mut first = connect(a.local_addr());
    assert_eq!(ask(&mut first), "served");
    let mut second = connect(a.local_addr());
    assert_eq!(ask(&mut second), "served");
    // The first was shut down to make room: it reads the end of the stream.
    assert_eq!(ask(&mut first), "");
    assert_eq!(echo.evicted.load(Ordering::Relaxed), 1);
    assert_eq!(a.evicted(), 1);
    eventually("the evicted connection's thread to end", || {
        echo.finished.load(Ordering::Relaxed) == 1
    });
    assert_eq!(a.served_now(), 1);
    assert_eq!(echo.refused.load(Ordering::Relaxed), 0);
}

#[test]
fn shutdown_joins_the_accept_thread_and_closes_the_listener() {
    let (mut a, _echo) = acceptor(Limits {
        max_connections: 1,
        max_per_address: 1,
        evict: false,
    });
    let addr = a.local_addr();
    let mut served = connect(addr);
    assert_eq!(ask(&mut served), "served");
    let started = Instant::now();
    a.shutdown();
    assert!(
        started.elapsed() < TIMEOUT,
        "shutdown does not wait for connections"
    );
    let refused = TcpStream::connect_timeout(&addr, TIMEOUT).map(drop);
    assert_eq!(
        refused.map_err(|e| e.kind()),
        Err(io::ErrorKind::ConnectionRefused),
        "nothing listens once shutdown returned"
    );
    // The connection under way is left to end on its own.
    assert_eq!(ask(&mut served), "served");
    a.shutdown();
}

#[test]
fn limits_of_zero_or_a_per_address_limit_over_the_total_are_refused() {
    let handler: Arc<dyn Handler> = Arc::new(Echo::default());
    for (max_connections, max_per_address) in [(0, 1), (1, 0), (1, 2)] {
        let limits = Limits {
            max_connections,
            max_per_address,
            evict: false,
        };
        let err = Acceptor::bind(
            "127.0.0.1:0".parse().expect("literal"),
            "test-accept",
            limits,
            Arc::clone(&handler),
        )
        .expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
