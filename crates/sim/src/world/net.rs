//! The notification network: loss, duplication, delay and partitions between the
//! engines' workers.

use super::*;

impl World {
    /// Sends `bytes` from `from` to `to`: lost (partitioned, or by chance within the
    /// allowed losses in a row), or delivered once or twice after the delay and jitter.
    pub(super) fn send(&mut self, from: Addr, to: Addr, bytes: Vec<u8>) {
        self.note(|| {
            format!(
                "send {from:?} -> {to:?} {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        let net = self.config.net;
        if self.partitioned(from, to) {
            self.stats.messages_lost += 1;
            self.stats.messages_partitioned += 1;
            self.trace(&[15, self.now]);
            return;
        }
        // Consecutive losses count per link and per stream (heartbeats apart from the rest),
        // so that "at most N heartbeats lost in a row" holds whatever else the link carries.
        let link = (from, to, bytes.starts_with(kvlease_notif::HEARTBEAT_PREFIX));
        let in_a_row = self.losses_in_a_row.get(&link).copied().unwrap_or(0);
        let may_lose = net.max_consecutive_losses.is_none_or(|max| in_a_row < max);
        if may_lose && self.rng.chance(net.loss_per_million) {
            self.losses_in_a_row.insert(link, in_a_row + 1);
            self.stats.messages_lost += 1;
            self.trace(&[3, self.now]);
            return;
        }
        if in_a_row > 0 {
            self.losses_in_a_row.insert(link, 0);
        }
        let copies = if self.rng.chance(net.duplicate_per_million) {
            self.stats.messages_duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + nanos(net.delay) + self.rng.range(0, nanos(net.jitter));
            self.schedule(
                at,
                Ev::Deliver {
                    from,
                    to,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    /// Whether a partition now cuts the link between `a` and `b` (only P–D links are cut).
    pub(super) fn partitioned(&self, a: Addr, b: Addr) -> bool {
        let ((Addr::D { engine: d, .. }, Addr::P { engine: p, .. })
        | (Addr::P { engine: p, .. }, Addr::D { engine: d, .. })) = (a, b)
        else {
            return false;
        };
        self.config.partitions.iter().any(|cut| {
            cut.d == d
                && cut.p == p
                && (nanos(cut.at)..nanos(cut.at) + nanos(cut.duration)).contains(&self.now)
        })
    }

    /// Puts a message into the inbox of `to`, when `to` is alive.
    pub(super) fn deliver(&mut self, from: Addr, to: Addr, bytes: Vec<u8>) {
        self.note(|| {
            format!(
                "deliver {from:?} -> {to:?} {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        match to {
            Addr::P { engine, .. } => {
                let p = &mut self.p[engine];
                if p.alive {
                    p.inbox.push_back((from, bytes));
                }
            }
            Addr::D { engine, .. } => {
                let d = &mut self.d[engine];
                if d.alive {
                    d.inbox.push_back((from, bytes));
                }
            }
            Addr::Rogue => {}
        }
    }

    /// The engine id that `from` sends under.
    pub(super) fn sender_engine(&self, from: Addr) -> EngineId {
        match from {
            Addr::P { engine, .. } => self.p[engine].id.clone(),
            Addr::D { engine, .. } => self.d[engine].id.clone(),
            Addr::Rogue => self.rogue.clone(),
        }
    }
}
