//! D's handshakes with P engines: started on background threads when the core asks for
//! one, and their results handed back to the core. A check of a connected engine (a
//! request named a newer instance of it) keeps D's connections while it runs; they are
//! closed only when P's side channel announced a newer instance, or when the core drops
//! the engine.

use super::*;
use reads::Handshaken;

impl DecodeEngine {
    /// Starts every handshake the core asks for, each on its own thread.
    pub(super) fn start_handshakes(&mut self) {
        while let Some(hs) = self.core.poll_handshake() {
            let check = hs.check_instance;
            let spawned = self.spawn_handshake(
                "d-handshake",
                host_port(&hs.host, hs.port),
                hs.engine.clone(),
                check,
            );
            match spawned {
                Ok(rx) => {
                    if check.is_some() {
                        self.metrics.instance_checks.inc();
                    }
                    let remote = match self.remotes.remove(&hs.engine) {
                        Some(Remote::Ready(old)) if check.is_some() => Remote::Checking(old, rx),
                        _ => Remote::Handshaking(rx),
                    };
                    self.remotes.insert(hs.engine, remote);
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot spawn the handshake thread");
                    let now = self.now();
                    let error = handshake_error(HandshakeFailure::Thread);
                    self.core.handle_handshake(now, &hs.engine, Err(error));
                }
            }
        }
    }

    /// Spawns the handshake with P engine `want` at `addr` on a thread named `name`
    /// (`check`: see [`handshake`]); its result arrives on the returned receiver.
    pub(super) fn spawn_handshake(
        &self,
        name: &str,
        addr: String,
        want: EngineId,
        check: Option<u64>,
    ) -> std::io::Result<crossbeam_channel::Receiver<Result<Handshaken, HandshakeFailure>>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let token = self.cfg.link.auth_token.clone();
        let me = self.cfg.engine_id.to_string();
        let tp = self.cfg.tp_size;
        let mds = self.worker_metadata.clone();
        let agents: Vec<Arc<Agent>> = self.workers.iter().map(|w| Arc::clone(&w.agent)).collect();
        let shape = self.cfg.shape;
        let instance = self.instance;
        let allowed = self.cfg.allowed_prefill.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let me = Me {
                    token: token.as_deref(),
                    engine: &me,
                    tp_size: tp,
                    metadata: &mds,
                    shape,
                    instance,
                };
                let _ = tx.send(handshake(&addr, &me, &want, &agents, &allowed, check));
            })?;
        Ok(rx)
    }

    /// Hands every handshake that ended to the core, counting it and recording the
    /// backend of a ready engine.
    pub(super) fn poll_handshakes(&mut self) {
        let mut ended = Vec::new();
        for (engine, remote) in &self.remotes {
            let (Remote::Handshaking(rx) | Remote::Checking(_, rx)) = remote else {
                continue;
            };
            match rx.try_recv() {
                Ok(r) => ended.push((engine.clone(), r)),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    ended.push((engine.clone(), Err(HandshakeFailure::Thread)));
                }
            }
        }
        let now = self.now();
        for (engine, result) in ended {
            // A check keeps the connections it started with, unless P restarted.
            let kept = match self.remotes.remove(&engine) {
                Some(Remote::Checking(old, _)) => Some(old),
                _ => None,
            };
            match result {
                Ok(Handshaken::Connected(ready)) => {
                    self.metrics.handshake(HandshakeOutcome::Ok).inc();
                    let info = RemoteEngine::new(ready.info.tp_size, ready.info.num_blocks)
                        .with_instance(ready.info.instance);
                    if let Some(old) = kept {
                        self.metrics.peer_restarts.inc();
                        tracing::info!(%engine, old = old.info.instance, new = ready.info.instance, "P engine restarted; closing the connections to its old instance");
                        self.disconnect(&old);
                    }
                    let first_peer = ready.peers.first().and_then(|p| p.first()).copied();
                    if let (Some(w0), Some(peer)) = (self.workers.first(), first_peer) {
                        let name = link::peer_backend(&w0.agent, peer);
                        self.metrics.set_peer_backend(engine.as_str(), name);
                        let reason = link::backend_reason(&w0.agent, peer);
                        tracing::info!(%engine, backend = %name, %reason, "handshake complete");
                    } else {
                        tracing::info!(%engine, "handshake complete");
                    }
                    self.remotes.insert(engine.clone(), Remote::Ready(ready));
                    self.core.handle_handshake(now, &engine, Ok(info));
                }
                Ok(Handshaken::Unchanged(info)) => {
                    tracing::info!(%engine, instance = info.instance, "P engine's side channel announced no newer instance; keeping its connections");
                    if let Some(old) = kept {
                        self.remotes.insert(engine.clone(), Remote::Ready(old));
                    }
                    let info = RemoteEngine::new(info.tp_size, info.num_blocks)
                        .with_instance(info.instance);
                    self.core.handle_handshake(now, &engine, Ok(info));
                }
                Err(e) => {
                    let outcome = if e.is_auth() {
                        HandshakeOutcome::AuthFailed
                    } else {
                        HandshakeOutcome::Failed
                    };
                    self.metrics.handshake(outcome).inc();
                    tracing::warn!(%engine, error = %e, "handshake failed");
                    if let Some(old) = kept {
                        self.remotes.insert(engine.clone(), Remote::Ready(old));
                    }
                    self.core
                        .handle_handshake(now, &engine, Err(handshake_error(e)));
                }
            }
        }
        self.drain_events();
    }

    /// The core dropped `engine`: close every connection to it.
    pub(super) fn drop_engine(&mut self, engine: &EngineId) {
        self.metrics.clear_peer_backend(engine.as_str());
        match self.remotes.remove(engine) {
            Some(Remote::Ready(old) | Remote::Checking(old, _)) => {
                self.metrics.remote_engines_evicted.inc();
                tracing::info!(%engine, "idle P engine dropped to make room for another; connections closed");
                self.disconnect(&old);
            }
            Some(Remote::Handshaking(_)) | None => {}
        }
    }

    /// Closes every D worker's connections to the P engine `ready` describes.
    fn disconnect(&self, ready: &Ready) {
        for (w, row) in self.workers.iter().zip(&ready.peers) {
            for &peer in row {
                // Unknown only when closed already.
                let _ = w.agent.disconnect(peer);
            }
        }
    }
}
