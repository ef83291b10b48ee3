//! P's side of the D engines' handshakes. On the side-channel thread, before D is
//! answered, the [`Registrar`] hands D's registration to the [`Registry`] (which decides
//! whether it replaces the one on record) and binds the exchange's session to D's engine
//! on every worker's transport endpoint, so that only D's own connections speak for it.
//! On the engine thread, P connects back to D's workers (for expiry notices) off the
//! engine thread, only at the address the handshake came from unless
//! `--connect-back-any-host`, and closes its connections to an instance that was replaced.

use std::sync::{Mutex, PoisonError};

use kvlease_engine::registry::{Registered, Registry};

use super::*;

/// A registration the registry took, for the engine thread.
pub(crate) struct Registration {
    hello: Hello,
    registered: Registered,
}

/// Registers D engines with P (see the module doc); runs on the side-channel thread.
#[derive(Clone)]
pub struct Registrar {
    registry: Arc<Mutex<Registry>>,
    agents: Vec<Arc<Agent>>,
    taken: crossbeam_channel::Sender<Registration>,
    metrics: Metrics,
}

impl Registrar {
    /// Takes D's hello, or declines it with the reason D is told.
    ///
    /// # Errors
    /// The registry's refusal, as a message for D.
    pub fn register(&self, hello: Hello) -> Result<(), String> {
        let engine = EngineId::new(&hello.engine_id).map_err(|e| e.to_string())?;
        let names: Vec<String> = hello
            .workers
            .iter()
            .filter_map(|md| {
                let bytes = sidechannel::from_hex(md)?;
                kvlease_transport::metadata::decode_metadata(&bytes)
                    .ok()
                    .map(|m| m.name)
            })
            .collect();
        let session = hello.session.as_ref().map(kvlease_transport::Session::id);
        // The registry's answer and the endpoints' sessions change together.
        let mut registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        let outcome = registry.register(instance_now(), &engine, hello.instance, &names, session);
        let out = match outcome {
            Ok(out) => out,
            Err(e) => {
                drop(registry);
                self.metrics.registrations_refused.inc();
                tracing::warn!(%engine, error = %e, "D registration refused");
                return Err(e.to_string());
            }
        };
        if let Registered::New { evicted: Some(old) } = &out.registered {
            for a in &self.agents {
                a.unbind_session(old.as_str());
            }
        }
        if out.registered != Registered::FetchOnly
            && let Some(s) = &hello.session
        {
            for a in &self.agents {
                a.bind_session(engine.as_str(), s.clone());
            }
        }
        self.metrics.d_engines_registered.set(registry.len() as i64);
        drop(registry);
        for worker in &out.ignored {
            tracing::warn!(%engine, %worker, "D registered a worker named for another engine; ignored");
        }
        // The engine thread is gone only at shutdown.
        let _ = self.taken.send(Registration {
            hello,
            registered: out.registered,
        });
        Ok(())
    }
}

impl PrefillEngine {
    /// The registrar the side channel hands D's hellos to.
    pub fn registrar(&mut self) -> Registrar {
        Registrar {
            registry: Arc::clone(&self.registry),
            agents: self.workers.iter().map(|w| Arc::clone(&w.agent)).collect(),
            taken: self.registrations.0.clone(),
            metrics: self.metrics.clone(),
        }
    }

    /// Handles the D engines the registrar took since the last call.
    pub(super) fn take_hellos(&mut self) {
        let taken: Vec<Registration> = self.registrations.1.try_iter().collect();
        for r in &taken {
            self.connect_d(r);
        }
    }

    /// The engine a connection speaks for (see [`Registry::speaker`]).
    pub(super) fn speaker(&self, from: &kvlease_transport::Sender) -> Option<EngineId> {
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .speaker(&from.name, from.session)
            .cloned()
    }

    /// Closes P's connections to the workers of `engine` (an instance replaced, or an
    /// engine dropped from the registry).
    fn disconnect_d(&mut self, engine: &str) {
        let Some(w0) = self.workers.first() else {
            return;
        };
        let gone: Vec<String> = self
            .d_peers
            .keys()
            .filter(|name| kvlease_proto::auth::name_group(name) == engine)
            .cloned()
            .collect();
        for name in gone {
            if let Some(peer) = self.d_peers.remove(&name) {
                let _ = w0.agent.disconnect(peer);
            }
        }
    }

    /// A D engine registered: connect back to its workers (for expiry notices) on a
    /// background thread, so that a D whose workers P cannot reach delays nothing here. A
    /// newer instance of a D engine (restarted under the same id) replaces the connections
    /// to the old one.
    fn connect_d(&mut self, r: &Registration) {
        let hello = &r.hello;
        match &r.registered {
            Registered::FetchOnly => return,
            Registered::Restarted { .. } => {
                tracing::info!(engine = %hello.engine_id, "D engine restarted; reconnecting to it");
                self.disconnect_d(&hello.engine_id);
            }
            Registered::New { evicted: Some(old) } => self.disconnect_d(old.as_str()),
            Registered::New { evicted: None } | Registered::Again => {}
        }
        let Some(agent) = self.workers.first().map(|w| Arc::clone(&w.agent)) else {
            return;
        };
        let mut todo = Vec::new();
        for md in &hello.workers {
            let Some(bytes) = sidechannel::from_hex(md) else {
                continue;
            };
            let (name, at) = match kvlease_transport::metadata::decode_metadata(&bytes) {
                Ok(m) => (m.name, m.tcp_addr),
                Err(e) => {
                    tracing::warn!(engine = %hello.engine_id, error = %e, "bad worker metadata from D");
                    continue;
                }
            };
            if kvlease_proto::auth::name_group(&name) != hello.engine_id {
                continue;
            }
            if !self.may_connect_back(hello, &at) {
                self.metrics.connect_back_refused.inc();
                tracing::warn!(
                    engine = %hello.engine_id, worker = %name, %at, from = ?hello.peer_ip,
                    "D worker not on the address its handshake came from: not connecting back (--connect-back-any-host allows it)"
                );
                continue;
            }
            if self.d_peers.contains_key(&name) || !self.connecting.insert(name.clone()) {
                continue;
            }
            todo.push((name, bytes));
        }
        if todo.is_empty() {
            return;
        }
        let tx = self.connected.0.clone();
        let instance = hello.instance;
        let engine = hello.engine_id.clone();
        let spawned = std::thread::Builder::new()
            .name("p-connect-back".into())
            .spawn(move || {
                for (name, bytes) in todo {
                    let peer = agent.connect(&bytes);
                    if let Err(e) = &peer {
                        tracing::warn!(%name, error = %e, "cannot connect back to D worker");
                    }
                    let _ = tx.send(ConnectedBack {
                        engine: engine.clone(),
                        instance,
                        name,
                        peer: peer.ok(),
                    });
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn the connect-back thread");
        }
    }

    /// Whether P may connect back to a D worker at `at` (its metadata's TCP address),
    /// registered by `hello`.
    fn may_connect_back(&self, hello: &Hello, at: &str) -> bool {
        if self.cfg.connect_back_any_host {
            return true;
        }
        let worker = at.parse::<std::net::SocketAddr>().map(|a| a.ip());
        matches!((hello.peer_ip, worker), (Some(peer), Ok(worker)) if same_host(peer, worker))
    }

    /// Takes the connections made off the engine thread: kept only while the instance
    /// they were made for is the one on record.
    pub(super) fn take_connected(&mut self) {
        while let Ok(c) = self.connected.1.try_recv() {
            self.connecting.remove(&c.name);
            let Some(peer) = c.peer else {
                continue;
            };
            let current = EngineId::new(&c.engine).ok().and_then(|e| {
                self.registry
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .instance(&e)
            });
            if current == Some(c.instance) {
                self.d_peers.insert(c.name, peer);
            } else if let Some(w0) = self.workers.first() {
                let _ = w0.agent.disconnect(peer);
            }
        }
    }
}
