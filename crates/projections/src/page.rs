//! Checkpoint pages: a hot table keyed by an interned key (dense numbers given out in first-use
//! order: the chat kinds and DM members by surface, the agent interner) is checkpointed as
//! pages of [`KEYS_PER_PAGE`] consecutive keys, one entry each, not as one entry per key.
//!
//! Why: a restart reads every entry of the tables that stay in memory, and what that costs is
//! mostly the store's work per entry, not the bytes. On a history of 1,000,000 events over
//! 100,000 surfaces the restore read 505,000 entries in 0.94 s, and a raw scan of the same store
//! took about 1.3 µs per entry; the five tables keyed by a surface or an agent key were 310,000
//! of those entries. Paged, they are 1/64 as many.
//!
//! A page is rewritten whole when any of its keys changes: at most [`KEYS_PER_PAGE`] small
//! entries per changed page, whatever the history's length.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

use serde::Serialize;

use crate::intern::InternKey;
use crate::table::Table;

/// Keys per checkpoint page.
pub const KEYS_PER_PAGE: u32 = 64;

/// A key of a table checkpointed in pages: each key is in one page, and a page's keys are one
/// range of the table's order.
pub trait PageKey: Copy + Ord {
    /// The page this key is checkpointed in.
    fn page(self) -> u32;
    /// Every key `page` can hold.
    fn page_keys(page: u32) -> RangeInclusive<Self>;
}

impl<K: InternKey> PageKey for K {
    fn page(self) -> u32 {
        self.index() / KEYS_PER_PAGE
    }

    fn page_keys(page: u32) -> RangeInclusive<K> {
        let first = page.saturating_mul(KEYS_PER_PAGE);
        K::from_index(first)..=K::from_index(first.saturating_add(KEYS_PER_PAGE - 1))
    }
}

/// A table checkpointed in pages of its keys.
pub trait PagedTable {
    type Key: PageKey + Serialize;
    type Value: Serialize;
    /// The pages of the keys changed since the last call (which forgets them).
    fn drain_changed_pages(&mut self) -> BTreeSet<u32>;
    /// The entries of `page`, in key order.
    fn page_entries(&self, page: u32) -> Vec<(&Self::Key, &Self::Value)>;
}

impl<K: PageKey + Serialize, V: Serialize> PagedTable for Table<K, V> {
    type Key = K;
    type Value = V;

    fn drain_changed_pages(&mut self) -> BTreeSet<u32> {
        self.drain_changes().into_iter().map(|(key, _)| key.page()).collect()
    }

    fn page_entries(&self, page: u32) -> Vec<(&K, &V)> {
        self.range(K::page_keys(page)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intern::SurfaceKey;

    #[test]
    fn pages_cover_every_key_once() {
        for index in [0u32, 1, 63, 64, 65, 127, 128, 4_000_000, u32::MAX - 64, u32::MAX] {
            let key = SurfaceKey(index);
            assert!(SurfaceKey::page_keys(key.page()).contains(&key), "key {index}");
            let page = key.page();
            if page > 0 {
                assert!(!SurfaceKey::page_keys(page - 1).contains(&key), "key {index} only in its own page");
            }
        }
        assert_eq!(SurfaceKey::page_keys(1), SurfaceKey(64)..=SurfaceKey(127));
    }
}
