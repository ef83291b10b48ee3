//! P's registry of D engines ([`Registry`]): which D engine registered on the side
//! channel, as which instance, with which workers and session, and so which engine a
//! transport connection speaks for.
//!
//! A D engine registers in its side-channel handshake (after both sides proved the
//! cluster token): its instance (its start time, µs since the Unix epoch), the transport
//! names of its workers (`{engine}/d{rank}`) and, with a token, the id of the exchange's
//! [`Session`](kvlease_proto::auth::Session). A notification counts only from a
//! connection whose proven name is a worker of the engine's current registration *and*
//! that proved that registration's session ([`Registry::speaker`]): a token holder that
//! reuses another engine's worker name, without that engine's side-channel exchange,
//! speaks for nobody.
//!
//! Which registration wins. A registration of the instance on record replaces its
//! workers and session (the same D handshaking again). A different instance replaces it
//! only when it *ranks* above it; an instance ranks as `min(instance, P's clock at
//! registration)`, so a number claimed ahead of the clock ranks no higher than the
//! moment it was registered, and a real engine that restarts later (its instance is
//! its start time) always outranks it and gets its id back. An instance more than
//! [`MAX_INSTANCE_AHEAD`](crate::instance::MAX_INSTANCE_AHEAD) ahead of the clock is
//! refused outright. A registration without workers (a D that only fetches P's info)
//! changes nothing. At most [`Registry::max_engines`] engines are kept; a new one beyond
//! that evicts the one registered longest ago.
//!
//! The clock is an argument (`now_us`, P's wall clock in µs since the Unix epoch).

use std::collections::BTreeMap;

use kvlease_lease::EngineId;
use kvlease_proto::auth::name_group;

use crate::instance::{InstanceAhead, check_instance};

/// Default for [`Registry::max_engines`].
pub const DEFAULT_MAX_REGISTERED: usize = 4096;

#[derive(Debug, Clone)]
struct Entry {
    instance: u64,
    /// `min(instance, now_us)` at registration: what a different instance must exceed.
    rank: u64,
    workers: Vec<String>,
    session: Option<u64>,
    /// Registration order (eviction takes the lowest).
    seq: u64,
}

/// What a registration did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registered {
    /// The engine was not registered (or was evicted since); `evicted` made room for it.
    New {
        /// The engine dropped to make room, if any: forget its connections.
        evicted: Option<EngineId>,
    },
    /// The instance on record registered again: its workers and session are these now.
    Again,
    /// A newer instance: the old one's workers and session are gone (close its
    /// connections).
    Restarted {
        /// The instance it replaced.
        old_instance: u64,
    },
    /// No workers (a D that only fetches P's info): nothing changed.
    FetchOnly,
}

/// A registration's outcome: what it did, and the worker names it could not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterOutcome {
    /// What it did.
    pub registered: Registered,
    /// Worker names of another engine than the registering one (ignored).
    pub ignored: Vec<String>,
}

/// Why a registration was refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The instance lies too far ahead of P's clock.
    #[error("engine {engine}: {source}")]
    Ahead {
        /// D's engine.
        engine: EngineId,
        /// The instance and the clock.
        #[source]
        source: InstanceAhead,
    },
    /// An instance that does not rank above the one on record (an older D, or a number
    /// claimed ahead of the clock before).
    #[error(
        "engine {engine} is registered as instance {current}, which instance {instance} does \
         not outrank"
    )]
    Older {
        /// D's engine.
        engine: EngineId,
        /// The instance refused.
        instance: u64,
        /// The instance on record.
        current: u64,
    },
}

/// P's registry of D engines (see the module doc).
#[derive(Debug, Clone)]
pub struct Registry {
    engines: BTreeMap<EngineId, Entry>,
    by_worker: BTreeMap<String, EngineId>,
    max_engines: usize,
    next_seq: u64,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_REGISTERED)
    }
}

impl Registry {
    /// An empty registry keeping at most `max_engines` (at least 1) engines.
    pub fn new(max_engines: usize) -> Self {
        Self {
            engines: BTreeMap::new(),
            by_worker: BTreeMap::new(),
            max_engines: max_engines.max(1),
            next_seq: 0,
        }
    }

    /// Engines kept at most.
    pub fn max_engines(&self) -> usize {
        self.max_engines
    }

    /// Engines registered.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// Whether no engine is registered.
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    /// The instance on record for `engine`.
    pub fn instance(&self, engine: &EngineId) -> Option<u64> {
        self.engines.get(engine).map(|e| e.instance)
    }

    /// The session id on record for `engine`.
    pub fn session(&self, engine: &EngineId) -> Option<u64> {
        self.engines.get(engine).and_then(|e| e.session)
    }

    /// D engine `engine` registered `workers` as `instance` at `now_us`, in an exchange
    /// that gave session `session` (its id; `None` without a token).
    ///
    /// # Errors
    /// [`RegisterError`]; nothing changed.
    pub fn register(
        &mut self,
        now_us: u64,
        engine: &EngineId,
        instance: u64,
        workers: &[String],
        session: Option<u64>,
    ) -> Result<RegisterOutcome, RegisterError> {
        let (mine, ignored): (Vec<String>, Vec<String>) = workers
            .iter()
            .cloned()
            .partition(|w| name_group(w) == engine.as_str());
        if mine.is_empty() {
            return Ok(RegisterOutcome {
                registered: Registered::FetchOnly,
                ignored,
            });
        }
        check_instance(instance, now_us).map_err(|source| RegisterError::Ahead {
            engine: engine.clone(),
            source,
        })?;
        let rank = instance.min(now_us);
        let registered = match self.engines.get(engine) {
            Some(e) if e.instance == instance => Registered::Again,
            Some(e) if rank > e.rank => Registered::Restarted {
                old_instance: e.instance,
            },
            Some(e) => {
                return Err(RegisterError::Older {
                    engine: engine.clone(),
                    instance,
                    current: e.instance,
                });
            }
            None => Registered::New {
                evicted: self.make_room(),
            },
        };
        let rank = match (&registered, self.engines.get(engine)) {
            // The same instance keeps the rank it had.
            (Registered::Again, Some(e)) => e.rank,
            _ => rank,
        };
        self.forget(engine);
        for w in &mine {
            self.by_worker.insert(w.clone(), engine.clone());
        }
        self.next_seq += 1;
        self.engines.insert(
            engine.clone(),
            Entry {
                instance,
                rank,
                workers: mine,
                session,
                seq: self.next_seq,
            },
        );
        Ok(RegisterOutcome {
            registered,
            ignored,
        })
    }

    /// The engine a connection speaks for: the one whose current registration named
    /// `worker`, when the connection proved that registration's session (`session`; both
    /// `None` without a token).
    pub fn speaker(&self, worker: &str, session: Option<u64>) -> Option<&EngineId> {
        let engine = self.by_worker.get(worker)?;
        (self.engines.get(engine)?.session == session).then_some(engine)
    }

    /// Drops `engine`'s registration; whether there was one.
    pub fn forget(&mut self, engine: &EngineId) -> bool {
        let Some(e) = self.engines.remove(engine) else {
            return false;
        };
        for w in &e.workers {
            self.by_worker.remove(w);
        }
        true
    }

    /// Evicts the engine registered longest ago when the registry is full.
    fn make_room(&mut self) -> Option<EngineId> {
        if self.engines.len() < self.max_engines {
            return None;
        }
        let oldest = self
            .engines
            .iter()
            .min_by_key(|(_, e)| e.seq)
            .map(|(id, _)| id.clone())?;
        self.forget(&oldest);
        Some(oldest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000_000;
    const SECOND: u64 = 1_000_000;

    fn engine(s: &str) -> EngineId {
        EngineId::new(s).unwrap()
    }

    fn workers(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_connection_speaks_for_its_registration_only() {
        let mut r = Registry::default();
        let vic = engine("vic");
        let out = r
            .register(
                NOW,
                &vic,
                NOW - SECOND,
                &workers(&["vic/d0", "mallory/d0"]),
                Some(7),
            )
            .unwrap();
        assert_eq!(out.registered, Registered::New { evicted: None });
        assert_eq!(out.ignored, ["mallory/d0"]);
        assert_eq!(r.speaker("vic/d0", Some(7)), Some(&vic));
        // The right name under another session, or under none, speaks for nobody.
        assert_eq!(r.speaker("vic/d0", Some(8)), None);
        assert_eq!(r.speaker("vic/d0", None), None);
        // Neither does a name no registration of vic named.
        assert_eq!(r.speaker("vic/x9", Some(7)), None);
        assert_eq!(r.speaker("mallory/d0", Some(7)), None);
        // The same instance again: its new session replaces the old.
        let again = r
            .register(NOW, &vic, NOW - SECOND, &workers(&["vic/d0"]), Some(9))
            .unwrap();
        assert_eq!(again.registered, Registered::Again);
        assert_eq!(r.speaker("vic/d0", Some(7)), None);
        assert_eq!(r.speaker("vic/d0", Some(9)), Some(&vic));
        // A D that only fetches changes nothing.
        let fetch = r.register(NOW, &vic, 0, &[], Some(3)).unwrap();
        assert_eq!(fetch.registered, Registered::FetchOnly);
        assert_eq!(r.speaker("vic/d0", Some(9)), Some(&vic));
    }

    #[test]
    fn an_instance_claimed_ahead_of_the_clock_never_pins_an_engine_id() {
        let mut r = Registry::default();
        let vic = engine("vic");
        let w = workers(&["vic/d0"]);
        r.register(NOW, &vic, NOW - 10 * SECOND, &w, Some(1))
            .unwrap();
        // 2^63 is refused outright.
        let e = r.register(NOW, &vic, 1 << 63, &w, Some(2)).unwrap_err();
        assert!(matches!(e, RegisterError::Ahead { .. }), "{e}");
        assert_eq!(r.instance(&vic), Some(NOW - 10 * SECOND));
        // 30 s ahead is taken (clocks differ), but ranks as the moment it came.
        let pin = NOW + 30 * SECOND;
        let out = r.register(NOW, &vic, pin, &w, Some(3)).unwrap();
        assert!(matches!(out.registered, Registered::Restarted { .. }));
        // The real vic, still running, cannot take it back without restarting...
        let e = r
            .register(NOW + SECOND, &vic, NOW - 10 * SECOND, &w, Some(4))
            .unwrap_err();
        assert!(matches!(e, RegisterError::Older { .. }), "{e}");
        // ...and once it restarts (its instance is its start time, after the claim was
        // registered, though still before the claimed number) it gets its id back.
        let restart = NOW + 2 * SECOND;
        let out = r
            .register(NOW + 3 * SECOND, &vic, restart, &w, Some(5))
            .unwrap();
        assert_eq!(out.registered, Registered::Restarted { old_instance: pin });
        assert_eq!(r.speaker("vic/d0", Some(5)), Some(&vic));
        // An older instance of the real vic is refused.
        let e = r
            .register(NOW + 4 * SECOND, &vic, NOW + SECOND, &w, Some(6))
            .unwrap_err();
        assert!(matches!(e, RegisterError::Older { .. }));
    }

    #[test]
    fn a_full_registry_evicts_the_engine_registered_longest_ago() {
        let mut r = Registry::new(2);
        for (i, e) in ["a", "b", "c"].iter().enumerate() {
            let out = r
                .register(NOW, &engine(e), NOW, &workers(&[&format!("{e}/d0")]), None)
                .unwrap();
            let evicted = (i == 2).then(|| engine("a"));
            assert_eq!(out.registered, Registered::New { evicted });
        }
        assert_eq!(r.len(), 2);
        assert_eq!(r.speaker("a/d0", None), None);
        assert_eq!(r.speaker("c/d0", None), Some(&engine("c")));
    }
}
