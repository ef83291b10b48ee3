//! The proxy's budget for the bodies it holds whole (`--max-buffered-body-bytes`): client
//! request bodies, P's answers, D's non-streamed answers. Every byte is reserved before it
//! is kept; a body that does not fit what is left gets a retryable 503 instead of memory,
//! so many large bodies at once (each under `--max-upstream-body-bytes`) cannot add up.
//! A reservation is given back when the body is dropped: for an answer passed through,
//! once the client's connection took all of it ([`guarded_body`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::{Body, Bytes};
use prometheus_client::metrics::gauge::Gauge;

/// Bytes the proxy may hold in bodies at once.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: usize,
    used: AtomicUsize,
    /// `kvlease_proxy_buffered_body_bytes`.
    gauge: Gauge,
}

/// Bytes reserved in a [`Budget`], given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Budget {
    pub(crate) fn new(limit: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
            gauge,
        })
    }

    /// An empty reservation, to grow as bytes arrive.
    pub(crate) fn start(self: &Arc<Self>) -> Reservation {
        Reservation {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }

    fn take(&self, n: usize) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok();
        if taken {
            self.publish();
        }
        taken
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.publish();
    }

    fn publish(&self) {
        self.gauge
            .set(i64::try_from(self.used.load(Ordering::Acquire)).unwrap_or(i64::MAX));
    }
}

impl Reservation {
    /// Reserves `n` more bytes; false (nothing reserved) when the budget has no room.
    pub(crate) fn grow(&mut self, n: usize) -> bool {
        let taken = self.budget.take(n);
        if taken {
            self.bytes += n;
        }
        taken
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
        }
    }
}

/// A response body of `bytes` that keeps `reservation` until the connection took it all
/// (or dropped it).
pub(crate) fn guarded_body(bytes: Bytes, reservation: Reservation) -> Body {
    let stream = futures_util::stream::unfold(
        (Some(bytes), Some(reservation)),
        |(bytes, reservation)| async move {
            // The reservation goes with the state once the bytes were handed over and the
            // body is polled again (or dropped).
            let chunk = bytes?;
            Some((
                Ok::<_, std::convert::Infallible>(chunk),
                (None, reservation),
            ))
        },
    );
    Body::from_stream(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_limit_and_give_it_back() {
        let budget = Budget::new(10, Gauge::default());
        let mut a = budget.start();
        let mut b = budget.start();
        assert!(a.grow(6));
        assert!(!b.grow(5), "6 + 5 > 10");
        assert!(b.grow(4));
        assert!(!a.grow(1));
        assert_eq!(budget.gauge.get(), 10);
        drop(a);
        assert_eq!(budget.gauge.get(), 4);
        assert!(b.grow(6));
        drop(b);
        assert_eq!(budget.used.load(Ordering::Acquire), 0);
    }
}
