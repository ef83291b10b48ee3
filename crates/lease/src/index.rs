//! The lease table's request-id index: an open-addressing hash table of slot numbers.
//!
//! Why not `HashMap<RequestId, u32>`: a heartbeat lookup there hashes the id with SipHash
//! (about 140 instructions for a 39-byte id) and touches the control bytes, the bucket, the
//! key's string (behind its `Arc`) and then the lease's slot: four dependent cache misses
//! per id at 10^6 leases. Here an entry is one `u64` (32 bits of the id's first hash and the
//! slot number) in a linear-probing array, and the lease's slot holds a second 64-bit hash;
//! a lookup is one short probe run plus one slot. On the heartbeat path the two hashes
//! stand in for the string compare; grants, completions and aborts compare the strings too.
//!
//! The hash is a keyed multiply-fold hash (the core of wyhash/foldhash) with keys drawn at
//! random per table, producing two independent 64-bit words in one pass over the id. It is
//! not cryptographic: a peer that cannot see the keys cannot aim collisions at the probe
//! runs, and a false heartbeat match (about 2^-75 per pair of live ids) would only extend
//! the wrong lease, never release one; the reader's fence check turns the worst case into
//! a recompute.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// The two hashes of a request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    /// Places the id in the index; its low 32 bits are kept in the entry.
    pub(crate) h1: u64,
    /// Kept in the lease's slot, checked on every match.
    pub(crate) h2: u64,
}

/// Hashes ids into [`Fingerprint`]s with keys drawn at random per table.
#[derive(Debug, Clone)]
pub(crate) struct Hashers {
    keys: [u64; 4],
}

impl Default for Hashers {
    fn default() -> Self {
        // std's RandomState is the only randomness std offers; hashing a counter with a fresh
        // one gives unpredictable words. `| 1` keeps the multipliers odd.
        let random = RandomState::new();
        Self {
            keys: [
                random.hash_one(0u64),
                random.hash_one(1u64),
                random.hash_one(2u64) | 1,
                random.hash_one(3u64) | 1,
            ],
        }
    }
}

/// The high and low halves of the 128-bit product, folded.
fn folded_multiply(x: u64, y: u64) -> u64 {
    let full = u128::from(x) * u128::from(y);
    (full as u64) ^ ((full >> 64) as u64)
}

impl Hashers {
    pub(crate) fn fingerprint(&self, id: &str) -> Fingerprint {
        let [k0, k1, k2, k3] = self.keys;
        let bytes = id.as_bytes();
        let len = bytes.len() as u64;
        let mut a1 = k0 ^ len;
        let mut a2 = k1 ^ len.rotate_left(32);
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let w = u64::from_le_bytes(word);
            a1 = folded_multiply(a1 ^ w, k2);
            a2 = folded_multiply(a2 ^ w, k3);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            // Zero padding is unambiguous: the length is mixed in first.
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            let w = u64::from_le_bytes(word);
            a1 = folded_multiply(a1 ^ w, k2);
            a2 = folded_multiply(a2 ^ w, k3);
        }
        Fingerprint {
            h1: folded_multiply(a1 ^ k1, k3),
            h2: folded_multiply(a2 ^ k0, k2),
        }
    }

    /// Only the first hash (enough to find an entry whose slot is known).
    pub(crate) fn h1(&self, id: &str) -> u64 {
        self.fingerprint(id).h1
    }
}

/// Entry value of an empty position. A full entry has `slot + 1` in its low 32 bits.
const EMPTY: u64 = 0;

/// An open-addressing (linear probing, backward-shift deletion) map from fingerprints to
/// slot numbers. At most 3/4 full; grows by doubling.
#[derive(Debug, Default)]
pub(crate) struct SlotIndex {
    entries: Vec<u64>,
    len: usize,
}

impl SlotIndex {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    fn entry(h1: u64, slot: u32) -> u64 {
        (h1 << 32) | (u64::from(slot) + 1)
    }

    /// Where an entry's probe run starts. The entry keeps the low 32 bits of `h1`, so this
    /// needs no access to the slot (tables up to 2^32 positions).
    fn home(&self, entry: u64) -> usize {
        ((entry >> 32) as usize) & self.mask()
    }

    fn slot_of(entry: u64) -> u32 {
        // Full entries hold slot + 1 >= 1.
        (entry as u32).wrapping_sub(1)
    }

    /// The first slot whose entry carries `h1`'s tag and for which `matches(slot)` holds.
    pub(crate) fn find(&self, h1: u64, mut matches: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let mask = self.mask();
        let tag = h1 as u32;
        let mut i = (h1 as usize) & mask;
        loop {
            let e = self.entries[i];
            if e == EMPTY {
                return None;
            }
            if (e >> 32) as u32 == tag && matches(Self::slot_of(e)) {
                return Some(Self::slot_of(e));
            }
            i = (i + 1) & mask;
        }
    }

    /// Files `slot` under `h1`. The caller checked that the id is not filed yet.
    pub(crate) fn insert(&mut self, h1: u64, slot: u32) {
        if (self.len + 1) * 4 > self.entries.len() * 3 {
            self.grow();
        }
        self.place(Self::entry(h1, slot));
        self.len += 1;
    }

    fn place(&mut self, entry: u64) {
        let mask = self.mask();
        let mut i = self.home(entry);
        while self.entries[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.entries[i] = entry;
    }

    fn grow(&mut self) {
        let cap = (self.entries.len() * 2).max(16);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; cap]);
        for e in old.into_iter().filter(|&e| e != EMPTY) {
            self.place(e);
        }
    }

    /// Removes the entry of `slot` filed under `h1`. Returns whether it was there.
    pub(crate) fn remove(&mut self, h1: u64, slot: u32) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        let mask = self.mask();
        let wanted = Self::entry(h1, slot);
        let mut i = (h1 as usize) & mask;
        loop {
            match self.entries[i] {
                EMPTY => return false,
                e if e == wanted => break,
                _ => i = (i + 1) & mask,
            }
        }
        // Backward shift: pull later entries of the run into the hole unless their home lies
        // cyclically in (hole, j], where they would no longer be found.
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let e = self.entries[j];
            if e == EMPTY {
                break;
            }
            let home = self.home(e);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.entries[hole] = e;
                hole = j;
            }
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Positions in the array.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Random inserts and removes, with h1 drawn from a tiny range so that runs collide,
    /// wrap around the end and share tags, checked against a HashMap.
    #[test]
    fn matches_a_hash_map_under_heavy_collisions() {
        let mut index = SlotIndex::default();
        let mut model: HashMap<u32, u64> = HashMap::new();
        let mut x: u64 = 0x1234_5678;
        let mut next_slot = 0u32;
        for round in 0..4_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // h1 values close to each other and to the table's end (runs wrap around), tags
            // repeat (so slots must be told apart by the caller's check).
            let h1 = if x.is_multiple_of(5) {
                x % 8
            } else {
                (x % 256) | 0xff00
            };
            if !x.is_multiple_of(3) || model.is_empty() {
                index.insert(h1, next_slot);
                model.insert(next_slot, h1);
                next_slot += 1;
            } else {
                let (&slot, &h1) = model.iter().next().unwrap();
                assert!(index.remove(h1, slot));
                assert!(!index.remove(h1, slot));
                model.remove(&slot);
            }
            if round % 101 == 0 {
                for (&slot, &h1) in &model {
                    assert_eq!(index.find(h1, |s| s == slot), Some(slot), "round {round}");
                }
                assert_eq!(index.len(), model.len());
                assert!(index.len() * 4 <= index.capacity() * 3);
            }
        }
        assert_eq!(index.find(0x77, |_| true), None);
    }

    #[test]
    fn find_checks_every_candidate_with_the_same_tag() {
        let mut index = SlotIndex::default();
        index.insert(5, 1);
        index.insert(5, 2);
        index.insert(5, 3);
        assert_eq!(index.find(5, |s| s == 3), Some(3));
        assert_eq!(index.find(5, |s| s == 4), None);
        assert!(index.remove(5, 2));
        assert_eq!(index.find(5, |s| s == 3), Some(3));
        assert_eq!(index.find(5, |s| s == 1), Some(1));
    }

    #[test]
    fn fingerprints_are_keyed_per_table() {
        let a = Hashers::default();
        let b = Hashers::default();
        assert_eq!(a.fingerprint("req-1"), a.fingerprint("req-1"));
        assert_ne!(a.fingerprint("req-1"), a.fingerprint("req-2"));
        assert_ne!(a.fingerprint("req-1"), b.fingerprint("req-1"));
        // Lengths and padding are told apart.
        assert_ne!(a.fingerprint("abcdefgh"), a.fingerprint("abcdefg"));
        assert_ne!(a.fingerprint(""), a.fingerprint("a"));
    }

    #[test]
    fn fingerprints_spread_similar_ids() {
        // 100k ids differing in one counter: no h1 or h2 collisions, and the low bits used
        // for placement are balanced.
        let h = Hashers::default();
        let mut h1s = std::collections::HashSet::new();
        let mut h2s = std::collections::HashSet::new();
        let mut buckets = [0u32; 64];
        for i in 0..100_000 {
            let f = h.fingerprint(&format!("cmpl-{i:032}-0"));
            assert!(h1s.insert(f.h1) && h2s.insert(f.h2), "collision at {i}");
            buckets[(f.h1 & 63) as usize] += 1;
        }
        let (lo, hi) = (buckets.iter().min().unwrap(), buckets.iter().max().unwrap());
        assert!(*lo > 1_300 && *hi < 1_850, "{lo} {hi}");
    }
}
