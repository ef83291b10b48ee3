//! Per-source fairness for a listener: [`PerAddress`] hands out at most `max` slots per
//! peer IP address, so that one source cannot take all of a listener's connections (its
//! global cap) while another still gets served. [`FairSlots`] bounds a listener's
//! connections in all as well, and makes room for a newcomer by evicting a connection
//! of the address that holds the most, so that no few addresses can keep others out. An
//! IPv4-mapped IPv6 address counts as its IPv4 address.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Connection slots per peer address, shared by a listener's connections.
#[derive(Debug, Clone)]
pub struct PerAddress {
    max: usize,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One held slot of [`PerAddress`]; given back when dropped.
#[derive(Debug)]
pub struct AddressSlot {
    ip: IpAddr,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PerAddress {
    /// At most `max` slots per address.
    #[must_use]
    pub fn new(max: usize) -> Self {
        Self {
            max,
            held: Arc::default(),
        }
    }

    /// A slot for a connection from `ip`, or `None` when that address holds `max`.
    #[must_use]
    pub fn take(&self, ip: IpAddr) -> Option<AddressSlot> {
        let ip = canonical(ip);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(AddressSlot {
            ip,
            held: Arc::clone(&self.held),
        })
    }

    /// Slots `ip` holds now.
    #[must_use]
    pub fn held_by(&self, ip: IpAddr) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(&canonical(ip)).copied().unwrap_or(0)
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// A listener's connection slots, at most `max` in all and `max_per_address` per peer
/// address, that a few addresses cannot exhaust.
///
/// A connection takes a slot with [`admit`](Self::admit), handing over how to evict it
/// (shut its socket down, or tell an idle HTTP connection to close; the callback runs with
/// the slots locked and must not block, and answers whether it evicted: a busy connection
/// may refuse). When its address holds its share already, the newcomer takes the slot of
/// that address's oldest evictable connection; when all slots are taken, of the oldest
/// evictable connection of an address that holds more than the newcomer's does (the one
/// holding the most first). Only when no such connection exists is the newcomer refused.
/// So an address that floods keeps at most its share and churns its own slots, and a
/// few flooding addresses hold no slot another address needs: every new address gets in
/// as long as some address holds more than one slot it can give back.
#[derive(Debug, Clone)]
pub struct FairSlots {
    max: usize,
    max_per_address: usize,
    state: Arc<Mutex<FairState>>,
    evicted: Arc<AtomicU64>,
}

type Evict = Box<dyn Fn() -> bool + Send>;

#[derive(Default)]
struct FairState {
    next: u64,
    /// By admission order (the lowest id is the oldest).
    held: BTreeMap<u64, (IpAddr, Evict)>,
    per_ip: HashMap<IpAddr, usize>,
}

impl std::fmt::Debug for FairState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairState")
            .field("held", &self.held.len())
            .field("per_ip", &self.per_ip)
            .finish()
    }
}

impl FairState {
    fn remove(&mut self, id: u64) -> bool {
        let Some((ip, _)) = self.held.remove(&id) else {
            return false;
        };
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
        true
    }

    /// Evicts the oldest evictable connection of `ip`; whether one was.
    fn evict_from(&mut self, ip: IpAddr) -> bool {
        let victim = self
            .held
            .iter()
            .find(|(_, (holder, evict))| *holder == ip && evict())
            .map(|(&id, _)| id);
        victim.is_some_and(|id| self.remove(id))
    }
}

/// One held slot of [`FairSlots`]; given back when dropped (unless evicted before).
#[derive(Debug)]
pub struct FairSlot {
    id: u64,
    state: Arc<Mutex<FairState>>,
}

impl FairSlots {
    /// At most `max` slots in all and `max_per_address` per address (both at least 1).
    #[must_use]
    pub fn new(max: usize, max_per_address: usize) -> Self {
        Self {
            max: max.max(1),
            max_per_address: max_per_address.clamp(1, max.max(1)),
            state: Arc::default(),
            evicted: Arc::default(),
        }
    }

    /// A slot for a connection from `ip` that `evict` can evict (see the type doc), or
    /// `None` when no slot can be made.
    pub fn admit(&self, ip: IpAddr, evict: impl Fn() -> bool + Send + 'static) -> Option<FairSlot> {
        let ip = canonical(ip);
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = st.per_ip.get(&ip).copied().unwrap_or(0);
        if mine >= self.max_per_address {
            if !st.evict_from(ip) {
                return None;
            }
            self.evicted.fetch_add(1, Ordering::Relaxed);
        } else if st.held.len() >= self.max {
            let mut busiest: Vec<(usize, IpAddr)> = st
                .per_ip
                .iter()
                .filter(|&(_, &n)| n > mine + 1)
                .map(|(&other, &n)| (n, other))
                .collect();
            busiest.sort_by(|a, b| b.cmp(a));
            if !busiest.into_iter().any(|(_, other)| st.evict_from(other)) {
                return None;
            }
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        st.next += 1;
        let id = st.next;
        st.held.insert(id, (ip, Box::new(evict)));
        *st.per_ip.entry(ip).or_insert(0) += 1;
        Some(FairSlot {
            id,
            state: Arc::clone(&self.state),
        })
    }

    /// Slots held now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held
            .len()
    }

    /// Whether no slot is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections evicted to make room, since the slots were made.
    #[must_use]
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }
}

impl Drop for FairSlot {
    fn drop(&mut self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(self.id);
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_canonical(),
        v4 @ IpAddr::V4(_) => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_gets_at_most_max_and_dropping_gives_back() {
        let slots = PerAddress::new(2);
        let a: IpAddr = "127.0.0.1".parse().expect("literal");
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().expect("literal");
        let b: IpAddr = "127.0.0.2".parse().expect("literal");
        let first = slots.take(a).expect("a slot");
        let second = slots.take(mapped).expect("a slot");
        assert!(
            slots.take(a).is_none(),
            "a mapped address counts as its IPv4"
        );
        assert!(slots.take(b).is_some(), "another address is not affected");
        drop(first);
        assert_eq!(slots.held_by(a), 1);
        let third = slots.take(a).expect("a slot given back");
        drop((second, third));
        assert_eq!(slots.held_by(a), 0);
    }

    /// The names [`FairSlots`] evicted.
    type Log = Arc<Mutex<Vec<&'static str>>>;

    /// The eviction log, and a maker of eviction callbacks that log their name.
    fn victims() -> (Log, impl Fn(&'static str, bool) -> Evict) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = Arc::clone(&log);
        let make = move |name: &'static str, evictable: bool| -> Evict {
            let l = Arc::clone(&l);
            Box::new(move || {
                if evictable {
                    l.lock().expect("not poisoned").push(name);
                }
                evictable
            })
        };
        (log, make)
    }

    #[test]
    fn a_few_flooding_addresses_cannot_keep_a_new_one_out() {
        let ip = |s: &str| -> IpAddr { s.parse().expect("literal") };
        let (log, evict) = victims();
        let slots = FairSlots::new(4, 3);
        let mut held = Vec::new();
        // Two flooders take every slot (3 + 1); a third connection of the first evicts its
        // own oldest.
        for name in ["a1", "a2", "a3"] {
            held.push(
                slots
                    .admit(ip("10.0.0.1"), evict(name, true))
                    .expect("room"),
            );
        }
        held.push(
            slots
                .admit(ip("10.0.0.2"), evict("b1", true))
                .expect("room"),
        );
        held.push(
            slots
                .admit(ip("10.0.0.1"), evict("a4", true))
                .expect("its own oldest"),
        );
        assert_eq!(*log.lock().expect("not poisoned"), ["a1"]);
        // A new address gets in: the address holding the most gives its oldest slot.
        let c = slots
            .admit(ip("10.0.0.3"), evict("c1", true))
            .expect("room for a new address");
        assert_eq!(*log.lock().expect("not poisoned"), ["a1", "a2"]);
        assert_eq!(slots.len(), 4);
        assert_eq!(slots.evicted(), 2);
        // Evicted slots are given back once (their holders' drops change nothing more).
        drop(held);
        assert_eq!(slots.len(), 1);
        drop(c);
        assert!(slots.is_empty());
    }

    #[test]
    fn busy_connections_are_not_evicted_and_equal_shares_refuse() {
        let ip = |s: &str| -> IpAddr { s.parse().expect("literal") };
        let (log, evict) = victims();
        let slots = FairSlots::new(2, 2);
        let _a = slots
            .admit(ip("10.0.0.1"), evict("a1", false))
            .expect("room");
        let _b = slots
            .admit(ip("10.0.0.2"), evict("b1", true))
            .expect("room");
        // Full, every address holds one: nobody holds more than the newcomer would.
        assert!(slots.admit(ip("10.0.0.3"), evict("c1", true)).is_none());
        let _a2 = slots.admit(ip("10.0.0.1"), evict("a2", true));
        assert!(_a2.is_none(), "full, and a's only slot is busy");
        assert!(log.lock().expect("not poisoned").is_empty());
    }
}
