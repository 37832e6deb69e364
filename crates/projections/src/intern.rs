//! Interned keys: the fold gives every surface and every agent it writes state for a dense `u32`,
//! in log order of first use, and keys its hot tables by those numbers. Comparing and cloning
//! two integers is what an ordered table does on every step of a lookup; comparing surface ids
//! was a string comparison per level (most of the fold's time).
//!
//! Keys are assigned by the fold only, so they are part of the deterministic state: folding the
//! same events gives the same keys. Agents are interned by an [`Interner`], all in memory: its
//! key → value table is persisted like any other table; the value → key index is derived from
//! it and only ever looked up, never iterated, so its hash order cannot leak into anything
//! persisted or compared. Surfaces grow with the history and are interned by the state in two
//! cold tables (see the `impl State` below).

use std::hash::Hash;

use serde::{Deserialize, Serialize};

use crate::cold::{Cold, ColdTable};
use crate::page::PagedTable;
use crate::surface::SurfaceId;
use crate::table::Table;
use std::borrow::Cow;

/// A surface's interned key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SurfaceKey(pub u32);

/// An agent's interned key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AgentKey(pub u32);

/// A key type of an [`Interner`]: a dense index.
pub trait InternKey: Copy + Ord {
    fn from_index(index: u32) -> Self;
    fn index(self) -> u32;
}

impl InternKey for SurfaceKey {
    fn from_index(index: u32) -> Self {
        SurfaceKey(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

impl InternKey for AgentKey {
    fn from_index(index: u32) -> Self {
        AgentKey(index)
    }
    fn index(self) -> u32 {
        self.0
    }
}

/// Values by dense key, and the index back. Values are never forgotten (surfaces and agents are
/// not forgotten by the tables that use them either).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interner<K: InternKey, V: Ord + Clone + Hash> {
    values: Table<K, V>,
    /// Sharded: a table of every surface ever written for grows with the history (a mention in
    /// a channel subscribes its agent to a new thread), and unsharded its growths moved every
    /// entry at once, under the state lock: a fold batch of a few dozen events held it 44–235 ms
    /// under `anima-load`, mostly the kernel faulting in the new table (see README, "This stop:
    /// what the slow calls are").
    keys: crate::hashed::ShardedMap<V, K>,
}

impl<K: InternKey, V: Ord + Clone + Hash> Default for Interner<K, V> {
    fn default() -> Self {
        Interner { values: Table::default(), keys: crate::hashed::ShardedMap::default() }
    }
}

impl<K: InternKey, V: Ord + Clone + Hash> Interner<K, V> {
    /// The key of `value`, if the fold ever wrote state for it.
    pub fn key<Q>(&self, value: &Q) -> Option<K>
    where
        V: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.keys.get(value).copied()
    }

    /// The key of `value`, assigning the next one when it has none.
    pub fn intern<Q>(&mut self, value: &Q) -> K
    where
        V: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = V> + ?Sized,
    {
        if let Some(key) = self.keys.get(value) {
            return *key;
        }
        let index = u32::try_from(self.keys.len()).expect("fewer than 2^32 interned values");
        let key = K::from_index(index);
        let value = value.to_owned();
        self.keys.insert(value.clone(), key);
        self.values.insert(key, value);
        key
    }

    /// The value of a key this interner gave out.
    pub fn value(&self, key: K) -> &V {
        self.values.get(&key).expect("interned keys are never forgotten")
    }

    /// The value of `key`, if this interner gave it out.
    pub fn get(&self, key: K) -> Option<&V> {
        self.values.get(&key)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.values.iter()
    }

    pub fn range<R: std::ops::RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &V)> {
        self.values.range(range)
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Keys assigned since the last call, with their value.
    pub fn drain_changes(&mut self) -> Vec<(K, Option<&V>)> {
        self.values.drain_changes()
    }

    /// Loads checkpoint entries ([`Table::load_batch`]); not marked changed.
    pub fn load_batch(&mut self, entries: Vec<(K, V)>) {
        self.keys.reserve(entries.len());
        for (key, value) in &entries {
            self.keys.insert(value.clone(), *key);
        }
        self.values.load_batch(entries);
    }

    pub fn changed_len(&self) -> usize {
        self.values.changed_len()
    }
}

/// Agent ids by key (agents are a fleet's, not a history's: they stay in memory).
pub type AgentInterner = Interner<AgentKey, String>;

/// An interner is checkpointed in pages of its keys, as its values table is.
impl<K: InternKey + Serialize, V: Ord + Clone + Hash + Serialize> PagedTable for Interner<K, V> {
    type Key = K;
    type Value = V;

    fn drain_changed_pages(&mut self) -> std::collections::BTreeSet<u32> {
        self.values.drain_changed_pages()
    }

    fn page_entries(&self, page: u32) -> Vec<(&K, &V)> {
        self.values.page_entries(page)
    }
}

/// Checkpoint tag of `State::surface_keys` (surface → key).
pub(crate) const SURFACE_KEYS_TAG: u8 = 39;
/// Checkpoint tag of `State::surface_ids` (key → surface).
pub(crate) const SURFACE_IDS_TAG: u8 = 40;

/// The surface of `key` as the store holds it, without the state (a surface's key is never
/// given to another, so what the store holds is what the state has); `None` when the store does
/// not hold it yet (interned since the last checkpoint).
pub(crate) fn stored_surface(key: SurfaceKey, cold: &Cold) -> Option<SurfaceId> {
    ColdTable::<SurfaceKey, SurfaceId>::read_store(SURFACE_IDS_TAG, &key, cold)
}

/// Surfaces are interned by the state itself, in two cold tables (surface → key and key →
/// surface) and a count: every mention in a channel starts a thread the fold writes state for,
/// so the surfaces grow with the history, and like every other table that does, they leave
/// memory under the budget and are read back from the checkpoint store when needed. Keys are
/// still dense and given in log order of first use, so folding the same events gives the same
/// keys whatever was in memory.
impl crate::State {
    /// The key of `surface`, if the fold ever wrote state for it (read from the store, without
    /// keeping it, if it left memory).
    pub fn surface_key(&self, surface: &SurfaceId) -> Option<SurfaceKey> {
        self.surface_keys.get_or_read(SURFACE_KEYS_TAG, surface, &self.cold).map(|key| *key)
    }

    /// The key of `surface` if it has one, brought into memory: for a fold path that reads it
    /// and the state keyed by it again.
    pub(crate) fn ensure_surface_key(&mut self, surface: &SurfaceId) -> Option<SurfaceKey> {
        self.surface_keys.ensure(SURFACE_KEYS_TAG, surface, &self.cold);
        self.surface_keys.get(surface).copied()
    }

    /// The key of `surface`, assigning the next one when it has none; brought into memory.
    pub(crate) fn intern_surface(&mut self, surface: &SurfaceId) -> SurfaceKey {
        if let Some(key) = self.ensure_surface_key(surface) {
            return key;
        }
        let index = self.surface_count.get(&()).copied().unwrap_or(0);
        let key = SurfaceKey(index);
        self.surface_count.insert((), index.checked_add(1).expect("fewer than 2^32 surfaces"));
        self.surface_keys.insert(surface.clone(), key);
        self.surface_ids.ensure_for_write(SURFACE_IDS_TAG, &key, &self.cold);
        self.surface_ids.insert(key, surface.clone());
        key
    }

    /// The surface of a key the fold gave out (read from the store if it left memory).
    pub fn surface_of(&self, key: SurfaceKey) -> Option<SurfaceId> {
        self.surface_ids.get_or_read(SURFACE_IDS_TAG, &key, &self.cold).map(Cow::into_owned)
    }

    /// Surfaces the fold ever wrote state for.
    pub fn surfaces_len(&self) -> u32 {
        self.surface_count.get(&()).copied().unwrap_or(0)
    }
}
