//! Cold state: entries the fold wrote, checkpointed, and then let go of to keep memory under its
//! budget. They live in the checkpoint store and are read back when a decision needs them.
//!
//! The rule that keeps this safe: **a verdict never depends on whether state was in memory.**
//! Every table that may let entries go is a [`ColdTable`]; the fold reads it only after
//! [`ColdTable::ensure`] brought the key in (from memory, or else from the store), and a key is
//! let go only when it is clean and the store holds its latest value (no checkpoint write in
//! flight). So the store is logically part of the state: what the fold sees through it is
//! exactly what it would have kept in memory. The store is read synchronously and only by the
//! fold's own thread; the fold stays a function of (state, event) and does no IO of its own —
//! the engine provides the store.
//!
//! A store that cannot be read leaves the fold unable to decide: it panics with the cause, which
//! stops the projection runner (the engine reports it and goes unhealthy; a restart rebuilds
//! from the checkpoint and the log). Deciding on a guess is never an option.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::sync::Arc;

use crate::hashed::{FingerprintCount, HashedSet, ShardedIndexMap};

use serde::{Deserialize, Serialize};

/// Entries the clock's hand looks at per entry [`ColdTable::evict`] is asked to let go of, at
/// most. Under `anima-load`, when the state first reached its budget every entry was used, and
/// the longest slice of the first round held the state lock 39 ms without this bound, 1.7 ms
/// with it: without it the hand may clear the used bits of a whole table in one call.
pub const EVICTION_STEPS_PER_ENTRY: usize = 8;

/// Stored entries as (key, value) bytes.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// Read access to the checkpoint store's state entries, keyed as [`crate::State::drain_changes`]
/// writes them (table tag, then the postcard key).
pub trait ColdStore: Send + Sync {
    /// The stored value of `key`, if any.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String>;
    /// Every stored entry whose key starts with `prefix`, in key-byte order.
    fn scan(&self, prefix: &[u8]) -> Result<Entries, String>;
    /// The first `limit` stored entries whose key starts with `prefix` and comes after `after`
    /// (all of them when `after` is `None`), in key-byte order: a page of a scan.
    fn scan_after(&self, prefix: &[u8], after: Option<&[u8]>, limit: usize) -> Result<Entries, String> {
        Ok(page_of(self.scan(prefix)?, after, limit))
    }
    /// The stored entries of the slot page that holds `key` (a key of a table kept in pages,
    /// [`crate::slot_page`]), one by one: what one read of the page gives. A store that keeps
    /// no pages gives `key`'s own entry, if any.
    fn get_page(&self, key: &[u8]) -> Result<Entries, String> {
        Ok(self.get(key)?.map(|value| vec![(key.to_vec(), value)]).unwrap_or_default())
    }
}

/// The first `limit` of `entries` (in key-byte order) whose key comes after `after`.
pub fn page_of(entries: Entries, after: Option<&[u8]>, limit: usize) -> Entries {
    entries.into_iter().filter(|(key, _)| after.is_none_or(|after| key.as_slice() > after)).take(limit).collect()
}

/// The state's handle on its cold store (none: everything is in memory).
#[derive(Clone, Default)]
pub struct Cold {
    store: Option<Arc<dyn ColdStore>>,
    /// Checkpoints taken since the store was attached ([`Cold::taken`]).
    taken: u64,
}

impl Cold {
    pub fn new(store: Arc<dyn ColdStore>) -> Self {
        Cold { store: Some(store), taken: 0 }
    }

    pub fn is_attached(&self) -> bool {
        self.store.is_some()
    }

    /// Notes that the state's changes were taken for a checkpoint ([`crate::State::take_changes`]).
    pub(crate) fn note_taken(&mut self) {
        self.taken += 1;
    }

    /// Checkpoints taken so far. What the store holds for a key that is not in memory changes
    /// only when a checkpoint taken after the key left memory is written: the fold brings a
    /// key back into memory before it changes it, a checkpoint writes only what memory held
    /// when it was taken, and a key leaves memory only once the store holds its latest value.
    /// So a reader that noted which keys memory held and this count under the state's lock,
    /// and read the other keys from the store after letting the lock go, read them as they
    /// were when it held the lock if the count is still the same when it takes the lock again.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// `read` of the store, if there is one. A store that cannot be read leaves the fold unable
    /// to decide: it panics with the cause (see the module's documentation).
    fn read<T>(&self, read: impl FnOnce(&dyn ColdStore) -> Result<T, String>) -> Option<T> {
        let store = self.store.as_ref()?;
        match read(store.as_ref()) {
            Ok(value) => Some(value),
            Err(e) => panic!("the checkpoint store cannot be read ({e}); the fold cannot decide without it"),
        }
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.read(|store| store.get(key)).flatten()
    }

    fn get_page(&self, key: &[u8]) -> Entries {
        self.read(|store| store.get_page(key)).unwrap_or_default()
    }

    pub(crate) fn scan(&self, prefix: &[u8]) -> Entries {
        self.read(|store| store.scan(prefix)).unwrap_or_default()
    }

    fn scan_after(&self, prefix: &[u8], after: Option<&[u8]>, limit: usize) -> Entries {
        self.read(|store| store.scan_after(prefix, after, limit)).unwrap_or_default()
    }
}

/// Handles compare equal: which store backs a state is not part of the state.
impl PartialEq for Cold {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Cold {}

impl std::fmt::Debug for Cold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_attached() { "Cold(store)" } else { "Cold(none)" })
    }
}

/// What memory held of a page of one owner's entries ([`ColdTable::memory_page`]).
pub struct MemoryPage<K, V> {
    prefix: Vec<u8>,
    after: Option<Vec<u8>>,
    limit: usize,
    /// The owner's entries in memory after `after`, by checkpoint key: present or known absent.
    entries: BTreeMap<Vec<u8>, (K, Option<V>)>,
    /// How many of `entries` are known absent.
    absent: usize,
    /// Whether the table had every entry in memory (the store holds nothing more).
    complete: bool,
    decode: fn(&[u8], &[u8]) -> (K, V),
}

impl<K, V> MemoryPage<K, V> {
    /// The page: the entries in memory with those of the store they leave out. The store is
    /// read for `limit` entries plus one per known-absent key in memory, so the page is exact:
    /// a key in memory hides the stored entry (a removal too), and the stored entries beyond
    /// the ones read all come after the `limit` present ones the page holds.
    pub fn read_store(mut self, cold: &Cold) -> Vec<(Vec<u8>, K, V)> {
        if !self.complete {
            let wanted = self.limit.saturating_add(self.absent);
            for (stored, bytes) in cold.scan_after(&self.prefix, self.after.as_deref(), wanted) {
                if let std::collections::btree_map::Entry::Vacant(slot) = self.entries.entry(stored) {
                    let (key, value) = (self.decode)(slot.key(), &bytes);
                    slot.insert((key, Some(value)));
                }
            }
        }
        let limit = self.limit;
        self.entries.into_iter().filter_map(|(stored, (key, value))| Some((stored, key, value?))).take(limit).collect()
    }
}

/// How a table's keys map to checkpoint keys. Most tables store each key as itself; a table
/// that keeps a sliding window of ordinals (the newest rows of a surface, its dedupe window)
/// stores ordinal `n` in slot `n % window`, so the entry that enters the window overwrites the
/// one that leaves it: one write instead of an insert and a removal. The value then carries
/// the ordinal, and a slot read back answers for a key only if its ordinal matches.
pub trait Slots<K, V> {
    /// The checkpoint key of `key` (its slot).
    fn slot(key: &K) -> K;
    /// Whether the stored `value` is the one of `key` (not an older occupant of its slot).
    fn holds(key: &K, value: &V) -> bool;
    /// The key of a value read from `slot`.
    fn key_of(slot: K, value: &V) -> K;
    /// Whether the table counts the keys it let go of (see [`ColdTable`]), so that a key it
    /// never let go of is known absent without a read. Only tables that store each key as itself:
    /// in a table of slots a newer key overwrites an older one's slot in the store, so a count
    /// per key could not be kept exact without reading.
    fn counts_let_go() -> bool {
        false
    }
}

/// Every key stored as itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnKeys;

impl<K: Clone, V> Slots<K, V> for OwnKeys {
    fn slot(key: &K) -> K {
        key.clone()
    }
    fn holds(_: &K, _: &V) -> bool {
        true
    }
    fn key_of(slot: K, _: &V) -> K {
        slot
    }
    fn counts_let_go() -> bool {
        true
    }
}

/// A table whose clean entries may be let go and read back from the checkpoint store.
///
/// Hashed, not ordered: its lookups are most of what the fold does per event, and nothing reads
/// it in order but the canonical encoding ([`ColdTable::all_entries`]) and the checkpoint
/// ([`ColdTable::drain_changes`]), which sort what they return.
///
/// In memory a key is present (`Some`), known absent (`None`: removed, or looked up and not
/// stored), or unknown (not in the map: let go, or never loaded). Only unknown keys are read
/// from the store, and only by [`ColdTable::ensure`]. While every entry is in memory
/// (`complete`, e.g. a state folded from the log without a store) reads need no `ensure`.
///
/// Most lookups of a dedupe table are of keys it never held (a new message's identity, a new
/// wake's id), and once entries were let go each of them would be a store read that finds
/// nothing. So a table that stores keys as themselves counts, by a fingerprint of the key, the
/// entries it let go of (its `let_go` count): an unknown key whose fingerprint counts none
/// was never let go, so it is known absent without a read. A fingerprint shared by other keys
/// only costs a read; nothing is guessed. The count is known only for a table that started
/// empty in this process: a table restored from a checkpoint (whose entries may be anything)
/// reads every unknown key.
///
/// Which clean entries leave memory is chosen by a clock: the table keeps its entries in an
/// indexed map, every entry has a used bit that [`ColdTable::ensure`] and the writes set, and
/// [`ColdTable::evict`] moves a hand over the entries, clearing set bits and letting go of
/// entries whose bit is clear. So an entry in use (the newest rows of a busy surface, the
/// identities a dedupe window still reads) stays, and the hand's work is paid for by the uses
/// that set the bits it clears. Which entries are in memory is never part of a verdict.
#[derive(Clone, Debug)]
pub struct ColdTable<K: Ord + Hash + Clone, V, S = OwnKeys> {
    map: ShardedIndexMap<K, Entry<V>>,
    /// The clock's hand: the place in `map` (shard, index) that [`ColdTable::evict`] looks at
    /// next.
    hand: (usize, usize),
    dirty: HashedSet<K>,
    /// Present entries in memory.
    present: usize,
    /// Whether every entry is in memory (nothing let go, nothing left in the store).
    complete: bool,
    /// Present entries let go of and stored, by key fingerprint; `None` when not known (a
    /// restored table, or one of slots).
    let_go: Option<FingerprintCount>,
    slots: std::marker::PhantomData<S>,
}

/// An entry in memory: present (`Some`) or known absent (`None`), and whether it was used since
/// the clock's hand last passed it.
#[derive(Clone, Debug)]
struct Entry<V> {
    value: Option<V>,
    used: bool,
}

impl<V> Entry<V> {
    fn new(value: Option<V>) -> Self {
        Entry { value, used: true }
    }
}

/// Tables compare by what they hold and what is left to write, not by which entries are in
/// memory or where the clock's hand is.
impl<K: Ord + Hash + Clone, V: PartialEq, S> PartialEq for ColdTable<K, V, S> {
    fn eq(&self, other: &Self) -> bool {
        self.complete == other.complete
            && self.present == other.present
            && self.dirty == other.dirty
            && self.let_go == other.let_go
            && self.map.len() == other.map.len()
            && self.map.iter().all(|(key, entry)| other.map.get(key).is_some_and(|e| e.value == entry.value))
    }
}

impl<K: Ord + Hash + Clone, V: Eq, S> Eq for ColdTable<K, V, S> {}

impl<K: Ord + Hash + Clone, V, S: Slots<K, V>> Default for ColdTable<K, V, S> {
    fn default() -> Self {
        ColdTable {
            map: ShardedIndexMap::default(),
            hand: (0, 0),
            dirty: HashedSet::default(),
            present: 0,
            complete: true,
            let_go: S::counts_let_go().then(FingerprintCount::default),
            slots: std::marker::PhantomData,
        }
    }
}

impl<K, V, S> ColdTable<K, V, S>
where
    K: Ord + Hash + Clone + Serialize + for<'de> Deserialize<'de>,
    V: Serialize + for<'de> Deserialize<'de>,
    S: Slots<K, V>,
{
    /// Reads `key` from the store: the value in its slot, if it is the key's.
    fn read_stored(tag: u8, key: &K, cold: &Cold) -> Option<V> {
        let bytes = cold.get(&crate::state::tagged(tag, &S::slot(key)))?;
        let value = postcard::from_bytes::<V>(&bytes)
            .unwrap_or_else(|e| panic!("a checkpoint entry does not decode ({e}); the fold cannot decide"));
        S::holds(key, &value).then_some(value)
    }

    /// A stored entry (checkpoint key with its tag, value bytes) as the key it holds and its value.
    fn decode_stored(stored_key: &[u8], bytes: &[u8]) -> (K, V) {
        let slot = postcard::from_bytes::<K>(&stored_key[1..])
            .unwrap_or_else(|e| panic!("a checkpoint key does not decode ({e}); the fold cannot decide"));
        let value = postcard::from_bytes::<V>(bytes)
            .unwrap_or_else(|e| panic!("a checkpoint entry does not decode ({e}); the fold cannot decide"));
        (S::key_of(slot, &value), value)
    }

    /// Brings `key` into memory from the store if it is unknown, so that [`ColdTable::get`]
    /// answers for it. `tag` is the table's checkpoint tag.
    pub fn ensure(&mut self, tag: u8, key: &K, cold: &Cold) {
        if self.answers_for(key) {
            return;
        }
        let value = if self.never_let_go(key) { None } else { Self::read_stored(tag, key, cold) };
        if value.is_some() {
            self.present += 1;
            self.count_back(key);
        }
        self.map.insert(key.clone(), Entry::new(value));
    }

    /// [`ColdTable::ensure`], bringing in with `key` every other entry that the store keeps in
    /// the same slot page ([`crate::slot_page`]): one read for up to
    /// [`crate::slot_page::SLOTS_PER_PAGE`] entries, for a caller that wants the entries beside
    /// `key` next, such as a window that forgets its oldest entry one at a time. An entry of the
    /// page that memory knows (present, or known absent) stays as memory has it; any other is
    /// what the store holds for it, which is what `ensure` would read for it.
    pub fn ensure_with_page(&mut self, tag: u8, key: &K, cold: &Cold) {
        if self.answers_for(key) {
            return;
        }
        if !self.never_let_go(key) {
            for (stored_key, bytes) in cold.get_page(&crate::state::tagged(tag, &S::slot(key))) {
                let (stored, value) = Self::decode_stored(&stored_key, &bytes);
                if !self.map.contains_key(&stored) {
                    self.present += 1;
                    self.count_back(&stored);
                    self.map.insert(stored, Entry::new(Some(value)));
                }
            }
        }
        if !self.map.contains_key(key) {
            self.map.insert(key.clone(), Entry::new(None));
        }
    }

    /// Whether memory answers for `key` without the store (the table is complete, or holds
    /// `key` present or known absent, which counts as a use of it).
    fn answers_for(&mut self, key: &K) -> bool {
        if self.complete {
            return true;
        }
        match self.map.get_mut(key) {
            Some(entry) => {
                entry.used = true;
                true
            }
            None => false,
        }
    }

    /// Whether `key`, unknown in memory, is known absent from the store without reading it: the
    /// table counts what it let go of, and no entry it let go of has `key`'s fingerprint.
    fn never_let_go(&self, key: &K) -> bool {
        self.let_go.as_ref().is_some_and(|let_go| !let_go.may_hold(key))
    }

    /// Before a write over `key` (insert or forget) that does not read it: brings it in if the
    /// table counts what it let go of and `key` may be one of those (a read only then), so the
    /// count stays exact. A table that does not count needs nothing: its writes read nothing.
    pub fn ensure_for_write(&mut self, tag: u8, key: &K, cold: &Cold) {
        if self.let_go.is_some() {
            self.ensure(tag, key, cold);
        }
    }

    /// `key`, let go of and stored, is back in memory: no longer counted.
    fn count_back(&mut self, key: &K) {
        if let Some(let_go) = self.let_go.as_mut() {
            let_go.remove(key);
        }
    }

    /// Brings every key of `keys` into memory with one scan of the store's entries under
    /// `prefix` (checkpoint-key bytes, the tag included) instead of one read per key: for keys
    /// that share a prefix, such as the rows of one surface. Stored entries outside `keys` are
    /// ignored; keys the scan did not find are known absent.
    pub fn ensure_by_scan(&mut self, prefix: &[u8], keys: impl Iterator<Item = K> + Clone, cold: &Cold) {
        if self.complete {
            return;
        }
        let mut wanted = BTreeSet::new();
        for key in keys {
            match self.map.get_mut(&key) {
                Some(entry) => entry.used = true,
                None => {
                    wanted.insert(key);
                }
            }
        }
        if wanted.is_empty() {
            return;
        }
        let none_let_go = self.let_go.as_ref().is_some_and(|let_go| wanted.iter().all(|key| !let_go.may_hold(key)));
        let stored = if none_let_go { Vec::new() } else { cold.scan(prefix) };
        for (stored_key, bytes) in stored {
            let (key, value) = Self::decode_stored(&stored_key, &bytes);
            if wanted.contains(&key) && !self.map.contains_key(&key) {
                self.present += 1;
                self.count_back(&key);
                self.map.insert(key, Entry::new(Some(value)));
            }
        }
        for key in wanted {
            if !self.map.contains_key(&key) {
                self.map.insert(key, Entry::new(None));
            }
        }
    }

    /// The value of `key`. Unless the table is complete the key must have been ensured.
    pub fn get(&self, key: &K) -> Option<&V> {
        debug_assert!(self.complete || self.map.contains_key(key), "a cold key read without ensure");
        self.map.get(key).and_then(|entry| entry.value.as_ref())
    }

    /// A write over `key` without [`ColdTable::ensure`]: if `key` may be one the table let go
    /// of, the count can no longer be kept exact, so the table stops counting (every unknown
    /// key is read from then on). Writers that keep the count ensure the key first.
    fn write_over_unknown(&mut self, key: &K) {
        if self.complete || self.map.contains_key(key) {
            return;
        }
        if self.let_go.as_ref().is_some_and(|let_go| let_go.may_hold(key)) {
            self.let_go = None;
        }
    }

    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.write_over_unknown(&key);
        self.dirty.insert(key.clone());
        let old = self.map.insert(key, Entry::new(Some(value))).and_then(|entry| entry.value);
        if old.is_none() {
            self.present += 1;
        }
        old
    }

    /// The value of `key` to change in place, brought in from the store first and created with
    /// its default if absent; marked changed whether or not the caller changes it.
    pub fn entry_or_default(&mut self, tag: u8, key: &K, cold: &Cold) -> &mut V
    where
        V: Default,
    {
        self.ensure(tag, key, cold);
        if !self.dirty.contains(key) {
            self.dirty.insert(key.clone());
        }
        let created = match self.map.get_mut(key) {
            Some(entry) => {
                entry.used = true;
                entry.value.is_none()
            }
            None => {
                // A complete table holds no known-absent keys: the key is new.
                self.map.insert(key.clone(), Entry::new(None));
                true
            }
        };
        let entry = self.map.get_mut(key).expect("the key was just put in memory");
        if created {
            self.present += 1;
        }
        entry.value.get_or_insert_with(V::default)
    }

    /// Every entry whose key is in `range`, in memory or in the store, in key order, without
    /// keeping what it reads (for tools and list calls that hold the state shared). `prefix`:
    /// the checkpoint-key bytes (tag included) that every stored key of the range starts with,
    /// so that only those are scanned. The entries in memory are all looked at: the cost
    /// follows the table's memory, which the budget bounds, not the history.
    pub fn range_entries(&self, prefix: &[u8], range: impl std::ops::RangeBounds<K>, cold: &Cold) -> Vec<(K, V)>
    where
        V: Clone,
    {
        let mut out: BTreeMap<K, Option<V>> = BTreeMap::new();
        if !self.complete {
            for (stored_key, bytes) in cold.scan(prefix) {
                let (key, value) = Self::decode_stored(&stored_key, &bytes);
                if range.contains(&key) {
                    out.insert(key, Some(value));
                }
            }
        }
        for (key, entry) in self.map.iter() {
            if range.contains(key) {
                out.insert(key.clone(), entry.value.clone());
            }
        }
        out.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect()
    }

    /// What memory holds of a page of the entries of one owner: every entry of the owner in
    /// memory after `after`, present or known absent. A page is at most `limit` present entries
    /// whose checkpoint key (tag included) starts with `prefix` and comes after `after`, in
    /// checkpoint-key byte order, each with that key (a page token); `owned(key)` says whether a
    /// key in memory is the owner's (its checkpoint key starts with `prefix`), so that only those
    /// are encoded. For a table that stores each key as itself; nothing read is kept. The cost follows the table's memory
    /// (every entry is looked at), which the budget bounds. The store's part is read by
    /// [`MemoryPage::read_store`], which needs no access to the table: a reader holding the
    /// state's lock may take this and read the store after letting the lock go (see
    /// [`Cold::taken`] for when that read is still exact).
    pub fn memory_page(
        &self,
        tag: u8,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
        owned: impl Fn(&K) -> bool,
    ) -> MemoryPage<K, V>
    where
        V: Clone,
    {
        debug_assert!(S::counts_let_go(), "pages are of tables that store each key as itself");
        let mut entries: BTreeMap<Vec<u8>, (K, Option<V>)> = BTreeMap::new();
        let mut absent = 0;
        for (key, entry) in self.map.iter() {
            if !owned(key) {
                continue;
            }
            let stored = crate::state::tagged(tag, key);
            if !stored.starts_with(prefix) || after.is_some_and(|after| stored.as_slice() <= after) {
                continue;
            }
            absent += usize::from(entry.value.is_none());
            entries.insert(stored, (key.clone(), entry.value.clone()));
        }
        MemoryPage {
            prefix: prefix.to_vec(),
            after: after.map(<[u8]>::to_vec),
            limit,
            entries,
            absent,
            complete: self.complete,
            decode: Self::decode_stored,
        }
    }

    /// The stored value of `key`, read from the store alone, whatever memory holds: for a
    /// reader without the state's lock, of a table whose stored values never change (an
    /// interner's key → value). `None` when the store does not hold it (yet).
    pub fn read_store(tag: u8, key: &K, cold: &Cold) -> Option<V> {
        Self::read_stored(tag, key, cold)
    }

    /// Removes `key` whether or not it is in memory (no read of the store): the next checkpoint
    /// removes it there too.
    pub fn forget(&mut self, key: K) {
        self.write_over_unknown(&key);
        if self.complete {
            if self.map.swap_remove(&key).and_then(|entry| entry.value).is_some() {
                self.present -= 1;
                self.dirty.insert(key);
            }
            return;
        }
        self.dirty.insert(key.clone());
        if self.map.insert(key, Entry::new(None)).and_then(|entry| entry.value).is_some() {
            self.present -= 1;
        }
    }

    /// Removes `key`, which the caller knows is present (in memory, or let go of and stored),
    /// without reading the store. A window that forgets its oldest entry knows this from its
    /// order table, which holds one entry for each entry of the window and is removed with it.
    /// A present key that is not in memory was let go of, and a table that counts what it let
    /// go of counted it then, so it is counted out exactly here: [`ColdTable::forget`] of a key
    /// the table may have let go of needs [`ColdTable::ensure_for_write`] first, a read of the
    /// store. Under `anima-load` the surfaces' identity windows did one such read for every new
    /// row once their surfaces were full; with it gone, 300 s runs read back 0.50 times per
    /// event instead of 0.61 (README, stop 56).
    pub fn forget_present(&mut self, key: K) {
        if self.complete || self.map.contains_key(&key) {
            self.forget(key);
            return;
        }
        if let Some(let_go) = self.let_go.as_mut() {
            // A present key out of memory was counted when it was let go. Should a caller be
            // wrong about it, a key never counted is left alone (the count says "certainly
            // not" for it either way).
            debug_assert!(let_go.may_hold(&key), "a key forgotten as present was never let go of");
            if let_go.may_hold(&key) {
                let_go.remove(&key);
            }
        }
        self.dirty.insert(key.clone());
        self.map.insert(key, Entry::new(None));
    }

    /// The value of `key` from memory, or else read from the store without keeping it (for
    /// readers that hold the state shared, e.g. tools on a restored state).
    pub fn read_through(&self, tag: u8, key: &K, cold: &Cold) -> Option<V>
    where
        V: Clone,
    {
        self.get_or_read(tag, key, cold).map(std::borrow::Cow::into_owned)
    }

    /// The value of `key`: borrowed from memory, or else read from the store without keeping it.
    /// For readers that hold the state shared, and for fold paths that only read a key they may
    /// not have ensured: the answer is the same either way, only its cost differs.
    pub fn get_or_read(&self, tag: u8, key: &K, cold: &Cold) -> Option<std::borrow::Cow<'_, V>>
    where
        V: Clone,
    {
        match self.map.get(key) {
            Some(entry) => entry.value.as_ref().map(std::borrow::Cow::Borrowed),
            // A key the table never let go of is not in the store: no read, as in `ensure`. A
            // fold path asks this of every new surface (the surface keys), which under
            // `anima-load` was one read in thirteen once entries left memory (README, stop 51).
            None if self.complete || self.never_let_go(key) => None,
            None => Self::read_stored(tag, key, cold).map(std::borrow::Cow::Owned),
        }
    }

    /// Removes an ensured key and returns its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        debug_assert!(self.complete || self.map.contains_key(key), "a cold key removed without ensure");
        let old = match self.map.get_mut(key) {
            Some(entry) => entry.value.take(),
            None => None,
        };
        if old.is_some() {
            self.present -= 1;
            self.dirty.insert(key.clone());
            if self.complete {
                self.map.swap_remove(key);
            }
        }
        old
    }

    /// Entries in memory or in the store (reads the whole table from the store unless complete:
    /// for tools).
    pub fn total_len(&self, tag: u8, cold: &Cold) -> usize
    where
        V: Clone,
    {
        if self.complete {
            self.present
        } else {
            self.all_entries(tag, cold).len()
        }
    }

    /// Present entries in memory.
    pub fn resident_len(&self) -> usize {
        self.present
    }

    /// Keys in memory (present or known absent).
    pub fn slots_len(&self) -> usize {
        self.map.len()
    }

    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Calls `with` with every entry, in memory or in the store, in key order (the canonical
    /// encoding). A complete table is sorted by reference, with nothing copied; otherwise the
    /// entries are read as [`ColdTable::all_entries`] reads them.
    pub fn with_sorted_entries<R>(&self, tag: u8, cold: &Cold, with: impl FnOnce(&[(&K, &V)]) -> R) -> R
    where
        V: Clone,
    {
        if !self.complete {
            let read = self.all_entries(tag, cold);
            return with(&read.iter().map(|(key, value)| (key, value)).collect::<Vec<_>>());
        }
        let mut present: Vec<(&K, &V)> =
            self.map.iter().filter_map(|(key, entry)| entry.value.as_ref().map(|value| (key, value))).collect();
        present.sort_unstable_by(|a, b| a.0.cmp(b.0));
        with(&present)
    }

    /// Every entry, in memory or in the store, in key order (for the canonical encoding and for
    /// tools; reads the whole table from the store unless complete).
    pub fn all_entries(&self, tag: u8, cold: &Cold) -> Vec<(K, V)>
    where
        V: Clone,
    {
        self.range_entries(&[tag], .., cold)
    }

    /// The checkpoint keys changed since the last call, with their current value (`None`:
    /// removed). A removal whose slot a new entry takes in the same checkpoint is not written.
    pub fn drain_changes(&mut self) -> Vec<(K, Option<&V>)> {
        let dirty = std::mem::take(&mut self.dirty);
        let mut out: BTreeMap<K, Option<&V>> = BTreeMap::new();
        for key in dirty {
            let value = self.map.get(&key).and_then(|entry| entry.value.as_ref());
            let slot = S::slot(&key);
            match out.get(&slot) {
                Some(Some(_)) if value.is_none() => {}
                _ => {
                    out.insert(slot, value);
                }
            }
        }
        out.into_iter().collect()
    }

    /// The keys changed since the last call with a copy of their current value (`None`:
    /// removed), for a checkpoint that encodes them later ([`crate::changes`]). Only the copy
    /// happens here; which keys share a slot and the order are worked out when they are
    /// encoded, off the fold's path.
    pub fn take_changes(&mut self, tag: u8) -> ColdChanges<K, V, S>
    where
        V: Clone,
    {
        let dirty = std::mem::take(&mut self.dirty);
        let entries = dirty
            .into_iter()
            .map(|key| {
                let value = self.map.get(&key).and_then(|entry| entry.value.clone());
                (key, value)
            })
            .collect();
        ColdChanges { tag, entries, slots: std::marker::PhantomData }
    }

    /// Loads an entry from a checkpoint (by its checkpoint key); not marked changed.
    pub fn load(&mut self, slot: K, value: V) {
        let key = S::key_of(slot, &value);
        if self.map.insert(key, Entry::new(Some(value))).and_then(|entry| entry.value).is_none() {
            self.present += 1;
        }
    }

    /// Marks the table as backed by the store: entries not in memory are read from it (all of
    /// them: what the store holds is not counted).
    pub fn set_backed(&mut self) {
        self.complete = false;
        self.let_go = None;
    }

    /// Fingerprints counted as let go (what the count costs in memory); 0 when not counting.
    pub fn let_go_len(&self) -> usize {
        self.let_go.as_ref().map_or(0, FingerprintCount::len)
    }

    pub fn changed_len(&self) -> usize {
        self.dirty.len()
    }

    /// Lets go of up to `max` clean present entries not used since the clock's hand last passed
    /// them (which ones is not part of the state, since a verdict never depends on what is in
    /// memory); clean known-absent entries the hand finds unused leave too. Call only when the
    /// store holds every clean entry's latest value (no checkpoint write in flight). The hand
    /// passes each entry at most twice per call, and looks at no more than
    /// [`EVICTION_STEPS_PER_ENTRY`] entries per entry asked for, so that a call's time follows
    /// `max`, not the table's length (a table whose entries were all used since the hand last
    /// passed lets nothing go in a short call, but the hand has moved on). Returns how many
    /// present entries left memory.
    pub fn evict(&mut self, max: usize) -> usize {
        if self.complete {
            // A complete table drops removed keys from memory; once it is not complete, an
            // absent key would be read from the store, which still holds a removal that is not
            // written yet: keep those known absent.
            for key in &self.dirty {
                if !self.map.contains_key(key) {
                    self.map.insert(key.clone(), Entry::new(None));
                }
            }
            self.complete = false;
        }
        let mut let_go = 0;
        let mut steps = (2 * self.map.len()).min(max.saturating_mul(EVICTION_STEPS_PER_ENTRY));
        while let_go < max && steps > 0 && !self.map.is_empty() {
            // Past the end of a shard: on to the next one with entries, giving back the memory
            // of the one it leaves if letting go left it sparse (one shard at a time, so this
            // is never a rebuild of the whole table).
            while self.hand.1 >= self.map.shard_len(self.hand.0) {
                self.map.shrink_if_sparse(self.hand.0);
                self.hand = ((self.hand.0 + 1) % crate::hashed::SHARDS, 0);
            }
            steps -= 1;
            let (shard, index) = self.hand;
            let Some((key, entry)) = self.map.get_index_mut(shard, index) else { break };
            if self.dirty.contains(key) {
                // Written since the last checkpoint: its bit stays, for a pass once it is clean.
                self.hand.1 += 1;
                continue;
            }
            if entry.used {
                entry.used = false;
                self.hand.1 += 1;
                continue;
            }
            // The shard's last entry takes this index: the hand looks at it next.
            let Some((key, entry)) = self.map.swap_remove_index(shard, index) else { break };
            if entry.value.is_some() {
                let_go += 1;
                if let Some(counted) = self.let_go.as_mut() {
                    counted.add(&key);
                }
            }
        }
        self.present -= let_go;
        let_go
    }
}

/// A cold table's changes taken for a checkpoint ([`ColdTable::take_changes`]): each changed
/// key with its value then. Encoded as [`ColdTable::drain_changes`] returns them: one entry per
/// checkpoint key (slot), in key order, and a removal whose slot a present key takes is not
/// written.
pub struct ColdChanges<K, V, S> {
    tag: u8,
    entries: Vec<(K, Option<V>)>,
    slots: std::marker::PhantomData<fn() -> S>,
}

impl<K, V, S> crate::changes::ChangesPart for ColdChanges<K, V, S>
where
    K: Ord + Serialize + Send,
    V: Serialize + Send,
    S: Slots<K, V>,
{
    fn entries(&self) -> usize {
        self.entries.len()
    }

    fn encode_into(self: Box<Self>, out: &mut crate::changes::EncodedChanges) {
        let mut by_slot: BTreeMap<K, Option<V>> = BTreeMap::new();
        for (key, value) in self.entries {
            let slot = S::slot(&key);
            match by_slot.get(&slot) {
                Some(Some(_)) if value.is_none() => {}
                _ => {
                    by_slot.insert(slot, value);
                }
            }
        }
        let tag = self.tag;
        out.extend(
            by_slot.into_iter().map(|(slot, value)| {
                (crate::state::tagged(tag, &slot), value.map(|value| crate::state::encode(&value)))
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A store of one table's entries that counts the reads it answers.
    #[derive(Default)]
    struct Counted {
        entries: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
        reads: Mutex<u64>,
    }

    impl ColdStore for Counted {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
            *self.reads.lock().unwrap() += 1;
            Ok(self.entries.lock().unwrap().get(key).cloned())
        }
        fn scan(&self, prefix: &[u8]) -> Result<Entries, String> {
            let entries = self.entries.lock().unwrap();
            Ok(entries.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(k, v)| (k.clone(), v.clone())).collect())
        }
    }

    const TAG: u8 = 7;

    /// Writes the table's changes to the store, as a checkpoint would.
    fn checkpoint(table: &mut ColdTable<u64, u64>, store: &Counted) {
        let mut entries = store.entries.lock().unwrap();
        for (key, value) in table.drain_changes() {
            let stored = crate::state::tagged(TAG, &key);
            match value {
                Some(value) => entries.insert(stored, postcard::to_allocvec(value).unwrap()),
                None => entries.remove(&stored),
            };
        }
    }

    /// A table of keys `0..n` (each worth twice itself), checkpointed into a counted store.
    fn checkpointed_table(n: u64) -> (Arc<Counted>, Cold, ColdTable<u64, u64>) {
        let store = Arc::new(Counted::default());
        let cold = Cold::new(store.clone());
        let mut table: ColdTable<u64, u64> = ColdTable::default();
        for key in 0..n {
            table.insert(key, key * 2);
        }
        checkpoint(&mut table, &store);
        (store, cold, table)
    }

    /// Pages of a table read from memory and the store together, token after token, are the
    /// table's entries in checkpoint-key order, whatever left memory: stored entries removed in
    /// memory are not on them, entries not checkpointed yet and newer values are.
    #[test]
    fn pages_walk_memory_and_store_as_one_table() {
        let (_store, cold, mut table) = checkpointed_table(300);
        table.set_backed();
        assert_eq!(table.evict(250), 250);
        let mut expected: BTreeMap<Vec<u8>, u64> =
            (0..300).map(|key| (crate::state::tagged(TAG, &key), key * 2)).collect();
        // Removals of keys in memory and in the store only, new keys, a changed value.
        for key in [0u64, 7, 128, 129, 255, 299] {
            table.ensure(TAG, &key, &cold);
            table.remove(&key);
            expected.remove(&crate::state::tagged(TAG, &key));
        }
        for key in [1_000u64, 100_000, 3] {
            table.ensure(TAG, &key, &cold);
            table.insert(key, key + 1);
            expected.insert(crate::state::tagged(TAG, &key), key + 1);
        }
        for limit in [1, 7, 300, 1_000] {
            let mut after: Option<Vec<u8>> = None;
            let mut walked = Vec::new();
            loop {
                let page = table.memory_page(TAG, &[TAG], after.as_deref(), limit, |_| true).read_store(&cold);
                assert!(page.len() <= limit);
                walked.extend(page.iter().map(|(stored, _, value)| (stored.clone(), *value)));
                if page.len() < limit {
                    break;
                }
                after = page.last().map(|(stored, _, _)| stored.clone());
            }
            assert_eq!(walked, expected.clone().into_iter().collect::<Vec<_>>(), "pages of {limit}");
        }
    }

    #[test]
    fn entries_in_use_stay_in_memory_while_idle_ones_leave() {
        let (store, cold, mut table) = checkpointed_table(10_000);
        // Every entry is used since it was written. A call asked for one entry looks at a few
        // and clears their bits, so it takes many calls to let the first entry go; by then the
        // hand has passed every entry once.
        let mut calls_without = 0;
        while table.evict(1) == 0 {
            calls_without += 1;
        }
        assert!(
            calls_without >= 10_000 / EVICTION_STEPS_PER_ENTRY - 1,
            "{calls_without} calls: a call looked at more entries than it may"
        );
        let busy: Vec<u64> = (0..10_000).step_by(10).collect();
        for key in &busy {
            table.ensure(TAG, key, &cold);
            assert_eq!(table.get(key), Some(&(key * 2)));
        }
        // As many as are idle: the hand lets go of those and passes over the ones in use.
        let idle = table.resident_len() - busy.len();
        assert_eq!(table.evict(idle), idle);
        assert_eq!(table.resident_len(), busy.len(), "only the busy entries are left in memory");
        let reads_before = *store.reads.lock().unwrap();
        for key in &busy {
            table.ensure(TAG, key, &cold);
        }
        assert_eq!(*store.reads.lock().unwrap(), reads_before, "a busy entry was let go and read back");
        // What left is read back exactly when needed, and what was never stored is known absent.
        table.ensure(TAG, &1, &cold);
        table.ensure(TAG, &20_000, &cold);
        assert_eq!((table.get(&1), table.get(&20_000)), (Some(&2), None));
        assert_eq!(*store.reads.lock().unwrap(), reads_before + 1, "the count answers for a key never stored");
    }

    /// A reader holding the state shared reads the store for a key the table let go of, and
    /// not for a key it never held (a new surface's key, looked up before it is interned).
    #[test]
    fn a_shared_read_of_a_key_never_let_go_asks_the_store_nothing() {
        let (store, cold, mut table) = checkpointed_table(1_000);
        table.evict(usize::MAX);
        assert_eq!(table.resident_len(), 0);
        let reads_before = *store.reads.lock().unwrap();
        assert_eq!(table.get_or_read(TAG, &5_000, &cold), None);
        assert_eq!(table.read_through(TAG, &5_001, &cold), None);
        assert_eq!(*store.reads.lock().unwrap(), reads_before, "a key never let go was read from the store");
        assert_eq!(table.get_or_read(TAG, &7, &cold).as_deref(), Some(&14));
        assert_eq!(*store.reads.lock().unwrap(), reads_before + 1, "a key let go of is read back");
    }

    /// A window's oldest entry, known present, is forgotten without a read whether it is in
    /// memory or was let go of, and the table then answers for it and for every other key as a
    /// table that read it first does: the let-go count stays exact.
    #[test]
    fn a_key_known_present_is_forgotten_without_a_read() {
        let (store, cold, mut table) = checkpointed_table(1_000);
        let (_, _, mut read_first) = checkpointed_table(1_000);
        for t in [&mut table, &mut read_first] {
            t.evict(usize::MAX);
            t.ensure(TAG, &10, &cold);
        }
        let reads_before = *store.reads.lock().unwrap();
        for key in [10u64, 11, 500] {
            table.forget_present(key);
        }
        assert_eq!(*store.reads.lock().unwrap(), reads_before, "a present key was read before it was forgotten");
        for key in [10u64, 11, 500] {
            read_first.ensure_for_write(TAG, &key, &cold);
            read_first.forget(key);
        }
        assert_eq!(table.let_go_len(), read_first.let_go_len(), "the let-go count as after reads");
        assert_eq!(table.drain_changes(), read_first.drain_changes(), "the same removals to write");
        checkpoint(&mut table, &store);
        let reads_before = *store.reads.lock().unwrap();
        for key in [10u64, 11, 500, 5_000] {
            table.ensure(TAG, &key, &cold);
            assert_eq!(table.get(&key), None, "key {key}");
        }
        assert_eq!(*store.reads.lock().unwrap(), reads_before, "the forgotten keys are known absent");
        table.ensure(TAG, &12, &cold);
        assert_eq!(table.get(&12), Some(&24), "a key let go of and not forgotten is read back");
    }

    #[test]
    fn an_entry_written_since_the_last_checkpoint_never_leaves() {
        let (_store, cold, mut table) = checkpointed_table(100);
        table.insert(5, 50);
        table.forget(6);
        table.evict(usize::MAX);
        assert_eq!(table.resident_len(), 1, "everything clean left; the unwritten change stayed");
        table.ensure(TAG, &5, &cold);
        table.ensure(TAG, &6, &cold);
        assert_eq!((table.get(&5), table.get(&6)), (Some(&50), None));
    }
}
