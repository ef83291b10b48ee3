//! The decode side: which requests to heartbeat, to which prefill engine, and when.

use std::collections::{BTreeSet, HashMap};

use crate::config::LeaseConfig;
use crate::ids::{EngineId, RequestId};
use crate::time::{Timestamp, duration_nanos};

/// Why a request could not be tracked. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackError {
    /// The request is already tracked (for `engine`).
    #[error("request {request} is already tracked for engine {engine}")]
    AlreadyTracked {
        /// The request.
        request: RequestId,
        /// The engine it is tracked for.
        engine: EngineId,
    },
    /// `peers` was zero: a P engine has at least one worker to heartbeat.
    #[error("request {request}: engine {engine} needs at least one P worker")]
    ZeroPeers {
        /// The request.
        request: RequestId,
        /// The engine.
        engine: EngineId,
    },
}

/// One heartbeat round for one prefill engine: send an `HB:` message listing `requests` to
/// each of its `workers` P workers (split into several messages when it exceeds the
/// notification size limit; never truncate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatBatch {
    /// The prefill engine (`remote_engine_id`).
    pub engine: EngineId,
    /// How many P workers that engine has; every one of them gets the same list
    /// (heterogeneous TP: each P worker holds its own leases for the same requests).
    pub workers: u32,
    /// Every request tracked for that engine, in no particular order.
    pub requests: Vec<RequestId>,
}

/// Counters since the tracker was created. All are monotonic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrackerStats {
    /// Requests tracked.
    pub tracked: u64,
    /// Requests untracked.
    pub untracked: u64,
    /// Batches handed out by `poll_heartbeat` (each goes to `workers` P workers).
    pub batches: u64,
    /// Request ids listed in those batches.
    pub batch_ids: u64,
    /// Batches the driver deferred.
    pub deferred: u64,
}

#[derive(Debug, Clone, Copy)]
struct Position {
    engine: u32,
    index: u32,
}

#[derive(Debug)]
struct Engine {
    id: EngineId,
    workers: u32,
    requests: Vec<RequestId>,
    /// When its next batch is due, in nanoseconds; the key of its entry in `due`.
    due: u64,
}

/// The decode side's heartbeat schedule: the requests waiting for (or reading) KV blocks,
/// grouped by the prefill engine that holds them.
///
/// A sans-IO state machine like [`LeaseTable`](crate::LeaseTable): `now` is an argument,
/// batches come out of [`poll_heartbeat`](Self::poll_heartbeat).
///
/// # Call order
/// Every forward-loop step of the decode engine (`start_load_kv`):
/// 1. [`track`](Self::track) each request that arrived with `do_remote_prefill` (on
///    arrival, not when scheduled: the wait in the queue is unbounded);
///    [`untrack`](Self::untrack) each request whose transfer completed, or that finished or
///    was aborted;
/// 2. call [`poll_heartbeat`](Self::poll_heartbeat) until `None`; send each batch to every
///    P worker of its engine, or, when that is not possible yet (no handshake with that
///    engine: start one in the background), [`defer`](Self::defer) it to a later step;
/// 3. optionally sleep until [`poll_timeout`](Self::poll_timeout).
///
/// # Throttle: per engine
/// Each engine has its own due time: at most one batch per engine (so per P worker) per
/// interval. A global throttle (one "send all" every interval) would delay the first
/// heartbeat of a newly seen engine by up to a full interval and couple the phases of all
/// engines, so one slow engine's deferral would shift every other engine's heartbeats.
///
/// # First heartbeat of a new engine: at the first poll after `track`
/// A new engine's batch is due at once. D does not know how long the request spent
/// between P's grant and D's arrival (router, proxy, queueing), so the earliest renewal is
/// the safe one; it also tells the driver at once that it needs a handshake with that
/// engine (SPEC, "Preemptive handshake"), and it costs one message per new engine, not
/// per request. A request for an engine already tracked rides that engine's next batch,
/// at most one interval later, while its fresh lease runs for six intervals.
///
/// An engine whose last request is untracked is dropped at its next due time instead of
/// at once, so that a request arriving in between cannot trigger a second batch within
/// one interval; [`engine_count`](Self::engine_count) counts only engines with requests.
///
/// # Cost
/// `track` and `untrack` are O(1) (a hash map of positions into per-engine vectors, removed
/// by swap-remove). A poll with nothing due is one look at the first entry of an ordered
/// set of per-engine due times: O(1) whatever the number of requests. A batch copies the
/// engine's id list once (cheap reference-counted clones), amortised over the interval.
#[derive(Debug)]
pub struct HeartbeatTracker {
    interval_ns: u64,
    positions: HashMap<RequestId, Position>,
    engines: Vec<Option<Engine>>,
    free_engines: Vec<u32>,
    by_name: HashMap<EngineId, u32>,
    due: BTreeSet<(u64, u32)>,
    nonempty_engines: usize,
    stats: TrackerStats,
}

impl HeartbeatTracker {
    /// A tracker that heartbeats every `config.interval()`.
    pub fn new(config: &LeaseConfig) -> Self {
        Self {
            interval_ns: duration_nanos(config.interval()),
            positions: HashMap::new(),
            engines: Vec::new(),
            free_engines: Vec::new(),
            by_name: HashMap::new(),
            due: BTreeSet::new(),
            nonempty_engines: 0,
            stats: TrackerStats::default(),
        }
    }

    /// Requests tracked.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Engines with at least one tracked request.
    pub fn engine_count(&self) -> usize {
        self.nonempty_engines
    }

    /// The counters.
    pub fn stats(&self) -> TrackerStats {
        self.stats
    }

    /// The engine `request` is tracked for, if it is tracked.
    pub fn engine_of(&self, request: &RequestId) -> Option<&EngineId> {
        let pos = self.positions.get(request.as_str())?;
        self.engine(pos.engine).map(|e| &e.id)
    }

    /// The requests tracked for `engine` (empty when none). An encoder can write a batch's
    /// message from this slice instead of the batch's cloned list.
    pub fn requests_of(&self, engine: &EngineId) -> &[RequestId] {
        self.by_name
            .get(engine.as_str())
            .and_then(|&slot| self.engine(slot))
            .map_or(&[], |e| e.requests.as_slice())
    }

    /// Starts heartbeating `request`, whose blocks engine `engine` holds on `peers` P workers.
    ///
    /// When the engine is already tracked with a different worker count, the larger one is
    /// kept (heartbeating a worker too many is harmless, one too few loses leases).
    ///
    /// # Errors
    /// [`TrackError::AlreadyTracked`] and [`TrackError::ZeroPeers`]; nothing changes then.
    pub fn track(
        &mut self,
        now: Timestamp,
        request: RequestId,
        engine: EngineId,
        peers: u32,
    ) -> Result<(), TrackError> {
        //= docs/spec.md#tracking
        //# heartbeating starts when a request with `do_remote_prefill=true` enters
        //# D's scheduler (`on_new_request`), not when it is scheduled
        if peers == 0 {
            return Err(TrackError::ZeroPeers { request, engine });
        }
        if let Some(pos) = self.positions.get(request.as_str()) {
            let engine = self.engine(pos.engine).map_or(engine, |e| e.id.clone());
            return Err(TrackError::AlreadyTracked { request, engine });
        }
        let slot = match self.by_name.get(engine.as_str()) {
            Some(&slot) => slot,
            None => self.add_engine(now, engine),
        };
        let Some(Some(e)) = self.engines.get_mut(slot as usize) else {
            debug_assert!(false, "by_name names a vacant engine slot");
            return Ok(());
        };
        e.workers = e.workers.max(peers);
        if e.requests.is_empty() {
            self.nonempty_engines += 1;
        }
        let index = u32::try_from(e.requests.len()).unwrap_or(u32::MAX);
        e.requests.push(request.clone());
        self.positions.insert(
            request,
            Position {
                engine: slot,
                index,
            },
        );
        self.stats.tracked += 1;
        Ok(())
    }

    /// Stops heartbeating `request`. Returns whether it was tracked. O(1).
    pub fn untrack(&mut self, request: &RequestId) -> bool {
        //= docs/spec.md#tracking
        //# Tracking stops when the KV transfer
        //# completes, or the request finishes or is aborted.
        let Some(pos) = self.positions.remove(request.as_str()) else {
            return false;
        };
        self.stats.untracked += 1;
        let Some(Some(e)) = self.engines.get_mut(pos.engine as usize) else {
            debug_assert!(false, "position names a vacant engine slot");
            return true;
        };
        let index = pos.index as usize;
        e.requests.swap_remove(index);
        if let Some(moved) = e.requests.get(index)
            && let Some(p) = self.positions.get_mut(moved.as_str())
        {
            p.index = pos.index;
        }
        if e.requests.is_empty() {
            self.nonempty_engines -= 1;
        }
        true
    }

    /// The next batch that is due at `now`, or `None` when none is. Call until `None`.
    ///
    /// Each engine's next batch is then due one interval after `now`.
    #[must_use]
    pub fn poll_heartbeat(&mut self, now: Timestamp) -> Option<HeartbeatBatch> {
        let now_ns = now.as_nanos_saturating();
        loop {
            let &(due, slot) = self.due.first()?;
            if due > now_ns {
                return None;
            }
            self.due.pop_first();
            let Some(Some(e)) = self.engines.get_mut(slot as usize) else {
                debug_assert!(false, "due names a vacant engine slot");
                continue;
            };
            if e.requests.is_empty() {
                self.by_name.remove(e.id.as_str());
                self.engines[slot as usize] = None;
                self.free_engines.push(slot);
                continue;
            }
            //= docs/spec.md#tracking
            //# one batched message per P worker per interval renews all of that engine's requests.
            e.due = now_ns.saturating_add(self.interval_ns);
            self.due.insert((e.due, slot));
            self.stats.batches += 1;
            self.stats.batch_ids += e.requests.len() as u64;
            return Some(HeartbeatBatch {
                engine: e.id.clone(),
                workers: e.workers,
                requests: e.requests.clone(),
            });
        }
    }

    /// The driver could not send `engine`'s batch (no handshake yet): make it due again at
    /// `retry_at`, which should be after `now` (e.g. the next step), or the same poll loop
    /// returns it again. Returns whether the engine is tracked.
    pub fn defer(&mut self, engine: &EngineId, retry_at: Timestamp) -> bool {
        let Some(&slot) = self.by_name.get(engine.as_str()) else {
            return false;
        };
        let Some(Some(e)) = self.engines.get_mut(slot as usize) else {
            return false;
        };
        self.due.remove(&(e.due, slot));
        e.due = retry_at.as_nanos_saturating();
        self.due.insert((e.due, slot));
        self.stats.deferred += 1;
        true
    }

    /// When the next batch is due, or `None` when no engine is tracked.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.due.first().map(|&(due, _)| Timestamp::from_nanos(due))
    }

    fn engine(&self, slot: u32) -> Option<&Engine> {
        self.engines.get(slot as usize).and_then(Option::as_ref)
    }

    fn add_engine(&mut self, now: Timestamp, id: EngineId) -> u32 {
        let due = now.as_nanos_saturating();
        let engine = Engine {
            id: id.clone(),
            workers: 0,
            requests: Vec::new(),
            due,
        };
        let slot = match self.free_engines.pop() {
            Some(slot) => {
                self.engines[slot as usize] = Some(engine);
                slot
            }
            None => {
                self.engines.push(Some(engine));
                u32::try_from(self.engines.len() - 1).unwrap_or(u32::MAX)
            }
        };
        self.by_name.insert(id, slot);
        self.due.insert((due, slot));
        slot
    }
}

#[cfg(test)]
mod tests;
