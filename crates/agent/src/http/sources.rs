//! Per-source fairness for the HTTP accept loop: how many connections each client
//! address holds, so that one address cannot take every slot of the global cap.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The connections open per client address, at most `per_source` each.
#[derive(Debug)]
pub(super) struct Sources {
    per_source: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's hold on its address's share; released on drop.
#[derive(Debug)]
pub(super) struct SourceSlot {
    sources: Arc<Sources>,
    ip: IpAddr,
}

impl Sources {
    /// At most `per_source` connections per address.
    pub(super) fn new(per_source: usize) -> Arc<Self> {
        Arc::new(Self {
            per_source,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `ip` (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address), or `None` when that address already holds its share.
    pub(super) fn try_take(self: &Arc<Self>, ip: IpAddr) -> Option<SourceSlot> {
        let ip = ip.to_canonical();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(ip).or_insert(0);
        if *count >= self.per_source {
            return None;
        }
        *count += 1;
        Some(SourceSlot {
            sources: Arc::clone(self),
            ip,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = self
            .sources
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_gets_its_share_and_gets_it_back() {
        let sources = Sources::new(2);
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let first = sources.try_take(a).unwrap();
        let _second = sources.try_take(mapped).unwrap();
        assert!(sources.try_take(a).is_none(), "a's share is 2");
        let _other = sources.try_take(b).unwrap();
        drop(first);
        let _again = sources.try_take(a).unwrap();
        assert!(sources.try_take(a).is_none());
        drop((_again, _second, _other));
        assert!(sources.held.lock().unwrap().is_empty(), "no entry leaks");
    }
}
