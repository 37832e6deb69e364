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

/// Shards of a [`ShardedIndexMap`] and of a [`FingerprintCount`].
///
/// A hashed table grows by moving all its entries into one twice its size, at once: measured
/// outside the engine (an `IndexMap` of message identities, foldhash), growing past 1.8M
/// entries took 136 ms and past 3.7M 242 ms on an idle machine, and under load such a growth
/// held the state lock (or the log writer) while every request waited. A table of shards
/// grows one shard at a time: a growth moves 1/64 of the entries, and since each shard reaches
/// its next size at a slightly different count, the growths fall in different batches.
pub const SHARDS: usize = 64;

/// The shard of a key: a hash with a seed of its own, so that the keys of one shard are spread
/// over the shard's own table as evenly as over an unsharded one.
fn shard_of<K: std::hash::Hash + ?Sized>(key: &K) -> usize {
    use std::hash::BuildHasher;
    (foldhash::fast::FixedState::with_seed(0x7368_6172_6473_2121).hash_one(key) >> 58) as usize
}

const _: () = assert!(SHARDS == 1 << (64 - 58));

/// A hashed map in [`SHARDS`] shards, looked up by key only: for an index that only grows, so
/// that a growth moves one shard's entries, not the whole map's.
#[derive(Clone, Debug)]
pub struct ShardedMap<K, V> {
    shards: Box<[HashedMap<K, V>]>,
    len: usize,
}

/// A key always falls in the same shard, so two maps of the same entries have equal shards.
impl<K: std::hash::Hash + Eq, V: PartialEq> PartialEq for ShardedMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.shards == other.shards
    }
}

impl<K: std::hash::Hash + Eq, V: Eq> Eq for ShardedMap<K, V> {}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        ShardedMap { shards: (0..SHARDS).map(|_| HashedMap::default()).collect(), len: 0 }
    }
}

impl<K: std::hash::Hash + Eq, V> ShardedMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Looks `key` up borrowed: a borrowed form hashes as the key does (the `Borrow` contract),
    /// so it finds the same shard.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.shards[shard_of(key)].get(key)
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self.shards[shard_of(&key)].insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Makes room for about `additional` more keys, spread evenly over the shards.
    pub fn reserve(&mut self, additional: usize) {
        let each = additional.div_ceil(SHARDS);
        for shard in self.shards.iter_mut() {
            shard.reserve(each);
        }
    }
}

/// A hashed map whose entries also have a place (shard, index), for a table that walks its
/// entries from where it stopped (the cold tables' clock). Sharded: see [`SHARDS`]. A place
/// changes when an entry of its shard is removed (the shard's last entry takes it).
#[derive(Clone, Debug)]
pub struct ShardedIndexMap<K, V> {
    shards: Box<[indexmap::IndexMap<K, V, Hasher>]>,
    len: usize,
}

impl<K, V> Default for ShardedIndexMap<K, V> {
    fn default() -> Self {
        ShardedIndexMap { shards: (0..SHARDS).map(|_| indexmap::IndexMap::default()).collect(), len: 0 }
    }
}

impl<K: std::hash::Hash + Eq, V> ShardedIndexMap<K, V> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.shards[shard_of(key)].get(key)
    }

    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.shards[shard_of(key)].get_mut(key)
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.shards[shard_of(key)].contains_key(key)
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self.shards[shard_of(&key)].insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Removes `key`; the last entry of its shard takes its place.
    pub fn swap_remove(&mut self, key: &K) -> Option<V> {
        let old = self.shards[shard_of(key)].swap_remove(key);
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    /// Every entry, shard by shard (an order nothing may depend on).
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.shards.iter().flat_map(|shard| shard.iter())
    }

    /// Entries of shard `shard`.
    pub fn shard_len(&self, shard: usize) -> usize {
        self.shards[shard].len()
    }

    pub fn get_index_mut(&mut self, shard: usize, index: usize) -> Option<(&K, &mut V)> {
        self.shards[shard].get_index_mut(index)
    }

    /// Removes the entry at (shard, index); the shard's last entry takes the index.
    pub fn swap_remove_index(&mut self, shard: usize, index: usize) -> Option<(K, V)> {
        let removed = self.shards[shard].swap_remove_index(index);
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    /// Gives back the memory of shard `shard` if it holds far more room than entries: a hashed
    /// table keeps its capacity when entries leave. One shard at a time, like growing.
    pub fn shrink_if_sparse(&mut self, shard: usize) {
        let shard = &mut self.shards[shard];
        if shard.capacity() > 4 * shard.len().max(16) {
            shard.shrink_to(2 * shard.len());
        }
    }
}

/// How many keys of a set share each fingerprint (a hash of the key with a seed of its own):
/// "may hold" answers a lookup without the set, exactly when it says no. Keys that share a
/// fingerprint only make it say yes for each other. Used where a store's index is too large to
/// keep but most lookups are of keys it does not hold: the cold tables' entries let go of, and
/// the embedded log's msg ids. Sharded by the fingerprint's top bits (see [`SHARDS`]); a shard
/// keeps its low 32 bits, so a fingerprint is 38 bits and an entry 8 bytes. Counted by a
/// counting allocator, 6M msg-id keys (the embedded log's 10-minute window at 10,000 appends a
/// second) took 72.0 MiB, 12.6 bytes a key, against 136.0 MiB with the whole 64-bit fingerprint
/// kept (README, stop 48). A key not counted is taken for one of N counted keys with a chance
/// of N in 2^38 (one in 46,000 with 6M counted), and that only costs a read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintCount(Box<[HashedMap<u32, u32>]>);

impl Default for FingerprintCount {
    fn default() -> Self {
        FingerprintCount((0..SHARDS).map(|_| HashedMap::default()).collect())
    }
}

impl FingerprintCount {
    /// The shard of `key`'s fingerprint (its top 6 bits) and what the shard keeps of it (its low
    /// 32 bits).
    fn locate<K: std::hash::Hash + ?Sized>(key: &K) -> (usize, u32) {
        use std::hash::BuildHasher;
        let print = foldhash::fast::FixedState::with_seed(0x6669_6e67_6572_7072).hash_one(key);
        ((print >> 58) as usize, print as u32)
    }

    /// Counts `key` in.
    pub fn add<K: std::hash::Hash + ?Sized>(&mut self, key: &K) {
        let (shard, print) = Self::locate(key);
        *self.0[shard].entry(print).or_default() += 1;
    }

    /// Counts `key` out; it must have been counted in.
    pub fn remove<K: std::hash::Hash + ?Sized>(&mut self, key: &K) {
        let (shard, print) = Self::locate(key);
        let shard = &mut self.0[shard];
        match shard.get_mut(&print) {
            Some(count) if *count > 1 => *count -= 1,
            Some(_) => {
                shard.remove(&print);
            }
            None => debug_assert!(false, "a key counted out was never counted in"),
        }
    }

    /// Whether `key` may be counted (false: certainly not).
    pub fn may_hold<K: std::hash::Hash + ?Sized>(&self, key: &K) -> bool {
        let (shard, print) = Self::locate(key);
        self.0[shard].contains_key(&print)
    }

    /// Distinct fingerprints (what the count costs in memory).
    pub fn len(&self) -> usize {
        self.0.iter().map(HashedMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(HashedMap::is_empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A growth moves the entries of one shard, and the keys of a table are spread evenly over
    /// the shards, so no insert moves more than a small share of a big table (unsharded, the
    /// insert past each power of two moved all of it).
    #[test]
    fn a_growing_table_moves_one_shard_at_a_time() {
        let mut map: ShardedIndexMap<(u32, String), u64> = ShardedIndexMap::default();
        let mut largest_move = 0;
        for i in 0..200_000u64 {
            let key = ((i % 400) as u32, format!("1733150000.{i:06}"));
            let shard = shard_of(&key);
            let (capacity, moved) = (map.shards[shard].capacity(), map.shards[shard].len());
            map.insert(key, i);
            if map.shards[shard].capacity() != capacity && map.len() >= 20_000 {
                largest_move = largest_move.max(moved * SHARDS * 100 / map.len());
            }
        }
        assert_eq!(map.len(), 200_000);
        // In hundredths of an even shard's share (1/64 of the table): an uneven spread, or one
        // shard for every key, makes this far larger.
        assert!(largest_move <= 125, "a growth moved {largest_move}% of an even shard's share");
        assert!(map.shards.iter().all(|shard| !shard.is_empty()));
    }

    /// The interners' index: every key is found by its borrowed form (an agent id as `&str`),
    /// and no growth moves more than about one shard's share (unsharded, the interner of
    /// surfaces moved all of them at each power of two, under the state lock).
    #[test]
    fn a_sharded_map_finds_borrowed_keys_and_grows_one_shard_at_a_time() {
        let mut map: ShardedMap<String, u32> = ShardedMap::default();
        let mut largest_move = 0;
        for i in 0..200_000u32 {
            let key = format!("slack:T1/C{}/1733150000.{i:06}", i % 400);
            let shard = shard_of(&key);
            let (capacity, moved) = (map.shards[shard].capacity(), map.shards[shard].len());
            assert_eq!(map.insert(key, i), None);
            if map.shards[shard].capacity() != capacity && map.len() >= 20_000 {
                largest_move = largest_move.max(moved * SHARDS * 100 / map.len());
            }
        }
        assert_eq!(map.len(), 200_000);
        assert!(largest_move <= 125, "a growth moved {largest_move}% of an even shard's share");
        for i in (0..200_000u32).step_by(997) {
            let key = format!("slack:T1/C{}/1733150000.{i:06}", i % 400);
            assert_eq!(map.get(key.as_str()), Some(&i), "{key}");
        }
        assert_eq!(map.get("slack:T1/C0/never"), None);
        assert_eq!(map.insert("slack:T1/C0/1733150000.000000".to_owned(), 7), Some(0));
        assert_eq!(map.len(), 200_000, "a replaced key is not counted twice");
    }

    #[test]
    fn fingerprints_are_spread_over_the_shards_and_counted_out_exactly() {
        let mut count = FingerprintCount::default();
        for i in 0..64_000u64 {
            count.add(&i);
        }
        assert_eq!(count.len(), 64_000);
        let smallest = count.0.iter().map(HashedMap::len).min().expect("shards");
        assert!(smallest >= 700, "a shard holds {smallest} of 64,000 fingerprints");
        for i in 0..64_000u64 {
            assert!(count.may_hold(&i));
            count.remove(&i);
        }
        assert!(count.is_empty());
        assert!(!count.may_hold(&1u64));
    }
}
