//! `Table`: an ordered map that remembers which keys changed since the last checkpoint, so the
//! runner writes only changed keys. Ordered maps only: iteration order is part of the canonical
//! state encoding.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table<K: Ord + Clone, V> {
    map: BTreeMap<K, V>,
    dirty: BTreeSet<K>,
}

impl<K: Ord + Clone, V> Default for Table<K, V> {
    fn default() -> Self {
        Self { map: BTreeMap::new(), dirty: BTreeSet::new() }
    }
}

impl<K: Ord + Clone, V> Table<K, V> {
    /// Lookups take the key borrowed (`&str` for a `String` key): no key is built to look.
    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.map.get(key)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.map.contains_key(key)
    }

    /// Mutable access; marks the key changed.
    pub fn get_mut<Q: Ord + ToOwned<Owned = K> + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        let value = self.map.get_mut(key)?;
        if !self.dirty.contains(key) {
            self.dirty.insert(key.to_owned());
        }
        Some(value)
    }

    /// Mutable access, inserting `V::default()` when absent; marks the key changed. The key is
    /// built only when it is not marked yet or not present.
    pub fn entry_or_default_by<Q: Ord + ToOwned<Owned = K> + ?Sized>(&mut self, key: &Q) -> &mut V
    where
        K: Borrow<Q>,
        V: Default,
    {
        if !self.dirty.contains(key) {
            self.dirty.insert(key.to_owned());
        }
        if !self.map.contains_key(key) {
            self.map.insert(key.to_owned(), V::default());
        }
        self.map.get_mut(key).expect("inserted above")
    }

    /// Mutable access, inserting `V::default()` when absent; marks the key changed.
    pub fn entry_or_default(&mut self, key: K) -> &mut V
    where
        V: Default,
    {
        if !self.dirty.contains(&key) {
            self.dirty.insert(key.clone());
        }
        self.map.entry(key).or_default()
    }

    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.dirty.insert(key.clone());
        self.map.insert(key, value)
    }

    pub fn remove(&mut self, key: &K) -> Option<V> {
        let old = self.map.remove(key);
        if old.is_some() {
            self.dirty.insert(key.clone());
        }
        old
    }

    /// Removes and returns the smallest entry; marks it changed.
    pub fn pop_first(&mut self) -> Option<(K, V)> {
        let (key, value) = self.map.pop_first()?;
        self.dirty.insert(key.clone());
        Some((key, value))
    }

    pub fn first_key(&self) -> Option<&K> {
        self.map.keys().next()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter()
    }

    pub fn range<R: std::ops::RangeBounds<K>>(&self, range: R) -> impl Iterator<Item = (&K, &V)> {
        self.map.range(range)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The keys changed since the last call, with their current value (`None`: removed).
    pub fn drain_changes(&mut self) -> Vec<(K, Option<&V>)> {
        let dirty = std::mem::take(&mut self.dirty);
        dirty
            .into_iter()
            .map(|k| {
                let v = self.map.get(&k);
                (k, v)
            })
            .collect()
    }

    /// The keys changed since the last call, each with mutable access to its current value
    /// (`None`: removed), for tables whose values checkpoint their own parts.
    pub fn drain_changes_mut(&mut self, mut each: impl FnMut(&K, Option<&mut V>)) {
        for key in std::mem::take(&mut self.dirty) {
            each(&key, self.map.get_mut(&key));
        }
    }

    /// Mutable access for loading a checkpoint, inserting `V::default()` when absent; not
    /// marked changed.
    pub fn load_mut(&mut self, key: K) -> &mut V
    where
        V: Default,
    {
        self.map.entry(key).or_default()
    }

    /// Mutable access to every entry, for finishing a checkpoint's load; not marked changed.
    pub fn load_each_mut(&mut self, mut each: impl FnMut(&K, &mut V)) {
        for (key, value) in &mut self.map {
            each(key, value);
        }
    }

    /// Loads checkpoint entries; not marked changed. An empty table is built from them in one
    /// pass (sorted, then filled leaf by leaf) instead of one descent per entry.
    pub fn load_batch(&mut self, entries: Vec<(K, V)>) {
        if self.map.is_empty() {
            self.map = entries.into_iter().collect();
        } else {
            self.map.extend(entries);
        }
    }

    pub fn changed_len(&self) -> usize {
        self.dirty.len()
    }
}
