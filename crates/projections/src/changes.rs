//! Changed state taken for a checkpoint, encoded later.
//!
//! The runner takes a checkpoint's changes between two fold batches, and every request waiting
//! for its verdict waits while it does. Encoding the changed entries (postcard, one key and one
//! value each) was most of that wait: under load a checkpoint of ~10,000 entries held the fold
//! for 15 ms at the median and 35 ms at p99, four times a second. So taking the changes only
//! copies the changed values out of the state ([`crate::State::take_changes`]), and
//! [`StateChanges::encode`] turns them into checkpoint entries afterwards, on the checkpoint
//! writer's task, beside the fold. The entries are the same bytes either way
//! ([`crate::State::drain_changes`] is the two steps in a row).

use serde::Serialize;

use crate::state::{encode, tagged};

/// Checkpoint entries as (key, value) bytes; `None` removes the key.
pub type EncodedChanges = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// The changed entries of a state at one point of the fold, copied out of it and not yet
/// encoded. Owns everything it holds, so it can move to another task.
#[derive(Default)]
pub struct StateChanges {
    parts: Vec<Box<dyn ChangesPart>>,
    entries: usize,
}

impl StateChanges {
    /// Adds one table's changes (nothing when it has none).
    pub(crate) fn push<P: ChangesPart + 'static>(&mut self, part: P) {
        let entries = part.entries();
        if entries > 0 {
            self.entries += entries;
            self.parts.push(Box::new(part));
        }
    }

    /// How many checkpoint entries [`StateChanges::encode`] returns, at most (keys of a cold
    /// table that share a slot are one entry).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The checkpoint entries, in the order the parts were taken.
    pub fn encode(self) -> EncodedChanges {
        let mut out = Vec::with_capacity(self.entries);
        for part in self.parts {
            part.encode_into(&mut out);
        }
        debug_assert!(out.len() <= self.entries, "every part says how many entries it encodes at most");
        out
    }
}

/// One table's taken changes.
pub(crate) trait ChangesPart: Send {
    /// How many checkpoint entries it encodes into, at most.
    fn entries(&self) -> usize;
    fn encode_into(self: Box<Self>, out: &mut EncodedChanges);
}

/// A table whose every key is its own checkpoint entry: `tag` + key → value (`None`: removed).
pub(crate) struct Keyed<K, V> {
    pub tag: u8,
    pub entries: Vec<(K, Option<V>)>,
}

impl<K: Serialize + Send, V: Serialize + Send> ChangesPart for Keyed<K, V> {
    fn entries(&self) -> usize {
        self.entries.len()
    }

    fn encode_into(self: Box<Self>, out: &mut EncodedChanges) {
        let tag = self.tag;
        out.extend(self.entries.into_iter().map(|(key, value)| (tagged(tag, &key), value.map(|v| encode(&v)))));
    }
}

/// A table checkpointed in pages ([`crate::page`]): `tag` + page → the page's (key, value)
/// pairs in key order; an empty page removes its entry.
pub(crate) struct Paged<P, K, V> {
    pub tag: u8,
    pub pages: Vec<(P, Vec<(K, V)>)>,
}

impl<P: Serialize + Send, K: Serialize + Send, V: Serialize + Send> ChangesPart for Paged<P, K, V> {
    fn entries(&self) -> usize {
        self.pages.len()
    }

    fn encode_into(self: Box<Self>, out: &mut EncodedChanges) {
        let tag = self.tag;
        out.extend(
            self.pages
                .into_iter()
                .map(|(page, entries)| (tagged(tag, &page), (!entries.is_empty()).then(|| encode(&entries)))),
        );
    }
}

/// An entry under a fixed key (the fold meta).
pub(crate) struct Single<V> {
    pub key: Vec<u8>,
    pub value: V,
}

impl<V: Serialize + Send> ChangesPart for Single<V> {
    fn entries(&self) -> usize {
        1
    }

    fn encode_into(self: Box<Self>, out: &mut EncodedChanges) {
        out.push((self.key, Some(encode(&self.value))));
    }
}
