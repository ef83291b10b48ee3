//! Per-source fairness for a listener: [`PerAddress`] hands out at most `max` slots per
//! peer IP address, so that one source cannot take all of a listener's connections (its
//! global cap) while another still gets served. An IPv4-mapped IPv6 address counts as
//! its IPv4 address.

use std::collections::HashMap;
use std::net::IpAddr;
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
}
