//! The rogue: a third peer that forges notifications for real request ids.

use super::*;

impl World {
    /// A forged notification for a real request id. To P: only for leases an honest D
    /// engine already owns (a rogue that claims first owns the lease like any reader; see
    /// the crate doc). To D: an expiry notice for a request it holds.
    pub(super) fn forge(&mut self) {
        if self.arrivals_left > 0
            && let Some(gap) = self.config.forged_gap
        {
            let next = self.now + self.rng.range(1, 2 * nanos(gap));
            self.schedule(next, Ev::Forge);
        }
        let kind = self.rng.index(4);
        if kind < 3 {
            let p = self.rng.index(self.p.len());
            let engine = &self.p[p];
            if !engine.alive {
                return;
            }
            // Mostly leases an honest engine owns; sometimes any lease, which the rogue may
            // then claim first (it owns the lease like any reader would; see the crate doc).
            let any = self.rng.chance(200_000);
            let targets: Vec<(RequestId, EngineId)> = engine
                .grant_order
                .iter()
                .filter_map(|r| {
                    let owner = engine.oracle.get(r)?.owner.clone();
                    match owner {
                        Some(o) if o != self.rogue => Some((r.clone(), o)),
                        None if any => Some((r.clone(), self.rogue.clone())),
                        _ => None,
                    }
                })
                .collect();
            if targets.is_empty() {
                return;
            }
            let (request, owner) = targets[self.rng.index(targets.len())].clone();
            let as_owner = self.rng.chance(500_000);
            let consumer_engine = if as_owner { owner } else { self.rogue.clone() };
            let rank = self.rng.range(0, 7) as u32;
            let bytes = match kind {
                0 => encode_heartbeats([&request], MAX_NOTIF_LEN)
                    .ok()
                    .and_then(|m| m.into_iter().next()),
                1 => Some(
                    ReadComplete {
                        request,
                        consumer: ConsumerId::new(consumer_engine, rank),
                        consumers_total: [1, 2, 4, 1_000][self.rng.index(4)],
                    }
                    .encode(),
                ),
                _ => Some(
                    Abort {
                        request,
                        consumer: ConsumerId::new(consumer_engine, rank),
                    }
                    .encode(),
                ),
            };
            let Some(bytes) = bytes else { return };
            let worker = self.rng.index(self.config.p_tp as usize) as u32;
            self.stats.forged += 1;
            self.send(Addr::Rogue, Addr::P { engine: p, worker }, bytes);
        } else {
            let d = self.rng.index(self.d.len());
            if !self.d[d].alive || self.d[d].admitted.is_empty() {
                return;
            }
            let i = self.rng.index(self.d[d].admitted.len());
            let Some(request) = self.d[d].admitted.keys().nth(i).cloned() else {
                return;
            };
            let generation = self.requests.get(&request).map_or(0, |r| r.generation);
            let Some(generation) = NonZeroU64::new(generation).map(Generation) else {
                return;
            };
            let lease = ExpiredLease {
                request,
                generation,
            };
            let Ok(messages) = encode_expired([&lease], MAX_NOTIF_LEN) else {
                return;
            };
            for m in messages {
                self.stats.forged += 1;
                self.send(Addr::Rogue, Addr::D { engine: d, rank: 0 }, m);
            }
        }
    }
}
