//! P's side of the D engines' handshakes: registering the D workers a D engine named, and
//! connecting back to them (for expiry notices) off the engine thread, only at the address
//! the handshake came from unless `--connect-back-any-host`.

use super::*;

impl PrefillEngine {
    /// Registers the D engines that said hello on the side channel since the last call.
    pub(super) fn take_hellos(&mut self) {
        let hellos: Vec<Hello> = self
            .hellos
            .as_ref()
            .map(|h| h.try_iter().collect())
            .unwrap_or_default();
        for hello in &hellos {
            self.connect_d(hello);
        }
    }

    /// Records the D workers a D engine registered (the transport names in its workers'
    /// metadata): only a worker named `{engine}/...` for the engine that proved itself on
    /// the side channel is taken. A newer instance replaces the older one's workers.
    fn register_d(&mut self, hello: &Hello, engine: &EngineId, restarted: bool) {
        if restarted {
            self.d_registered.retain(|_, e| e != engine);
        }
        for md in &hello.workers {
            let Some(name) = sidechannel::from_hex(md)
                .and_then(|b| kvlease_transport::metadata::decode_metadata(&b).ok())
                .map(|m| m.name)
            else {
                continue;
            };
            if engine_of_peer(&name).as_ref() == Some(engine) {
                self.d_registered.insert(name, engine.clone());
            } else {
                tracing::warn!(%engine, worker = %name, "D registered a worker named for another engine; ignored");
            }
        }
    }

    /// A D engine said hello: connect back to its workers (for expiry notices) on a
    /// background thread, so that a D whose workers P cannot reach delays nothing here. A
    /// newer instance of a D engine (restarted under the same id) replaces the connections
    /// to the old one.
    fn connect_d(&mut self, hello: &Hello) {
        let Some(agent) = self.workers.first().map(|w| Arc::clone(&w.agent)) else {
            return;
        };
        let Ok(engine) = EngineId::new(&hello.engine_id) else {
            tracing::warn!(engine = %hello.engine_id, "hello under an invalid engine id ignored");
            return;
        };
        let known = self.d_instances.get(&hello.engine_id).copied().unwrap_or(0);
        if hello.instance >= known {
            self.register_d(hello, &engine, hello.instance > known);
        }
        if hello.instance > known {
            if known != 0 {
                tracing::info!(engine = %hello.engine_id, "D engine restarted; reconnecting to it");
                let prefix = format!("{}/", hello.engine_id);
                self.d_peers.retain(|name, _| !name.starts_with(&prefix));
            }
            self.d_instances
                .insert(hello.engine_id.clone(), hello.instance);
        } else if hello.instance < known {
            tracing::debug!(engine = %hello.engine_id, "hello from an older D instance ignored");
            return;
        }
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

    /// Takes the connections made off the engine thread.
    pub(super) fn take_connected(&mut self) {
        while let Ok(c) = self.connected.1.try_recv() {
            self.connecting.remove(&c.name);
            let current = self.d_instances.get(&c.engine).copied().unwrap_or(0);
            if let Some(peer) = c.peer
                && c.instance == current
            {
                self.d_peers.insert(c.name, peer);
            }
        }
    }
}
