//! Hashed maps and sets for the fold's hot tables.
//!
//! The hasher has a fixed seed, so a fold hashes the same on every run and machine and the
//! deterministic simulation stays deterministic. Nothing persisted or compared reads a hashed
//! table in its hash order: the canonical encoding and the checkpoint sort what they take.
//! Keys are ids that authenticated connectors send; a fixed seed does not resist keys chosen to
//! collide, which costs such a sender time, never a wrong verdict.

use std::collections::{HashMap, HashSet};

/// The hasher of every hashed table of the fold.
pub type Hasher = foldhash::fast::FixedState;

pub type HashedMap<K, V> = HashMap<K, V, Hasher>;

pub type HashedSet<K> = HashSet<K, Hasher>;

/// A hashed map whose entries also have an index (insertion order, changed by removals), for a
/// table that walks its entries from where it stopped (the cold tables' clock).
pub type HashedIndexMap<K, V> = indexmap::IndexMap<K, V, Hasher>;

/// How many keys of a set share each fingerprint (a hash of the key with a seed of its own):
/// "may hold" answers a lookup without the set, exactly when it says no. Keys that share a
/// fingerprint only make it say yes for each other. Used where a store's index is too large to
/// keep but most lookups are of keys it does not hold: the cold tables' entries let go of, and
/// the embedded log's msg ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FingerprintCount(HashedMap<u64, u32>);

impl FingerprintCount {
    fn fingerprint<K: std::hash::Hash + ?Sized>(key: &K) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::with_seed(0x6669_6e67_6572_7072).hash_one(key)
    }

    /// Counts `key` in.
    pub fn add<K: std::hash::Hash + ?Sized>(&mut self, key: &K) {
        *self.0.entry(Self::fingerprint(key)).or_default() += 1;
    }

    /// Counts `key` out; it must have been counted in.
    pub fn remove<K: std::hash::Hash + ?Sized>(&mut self, key: &K) {
        let print = Self::fingerprint(key);
        match self.0.get_mut(&print) {
            Some(count) if *count > 1 => *count -= 1,
            Some(_) => {
                self.0.remove(&print);
            }
            None => debug_assert!(false, "a key counted out was never counted in"),
        }
    }

    /// Whether `key` may be counted (false: certainly not).
    pub fn may_hold<K: std::hash::Hash + ?Sized>(&self, key: &K) -> bool {
        self.0.contains_key(&Self::fingerprint(key))
    }

    /// Distinct fingerprints (what the count costs in memory).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
