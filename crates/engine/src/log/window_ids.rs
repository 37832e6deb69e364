//! The msg ids of the records inside the embedded log's dedupe window, in memory: for each, the
//! seq of the record that holds it.
//!
//! The log keeps no index of msg ids on disk. Each record holds its msg id, so this index is
//! rebuilt from the records of the window when the log opens, and an id it names is confirmed by
//! reading its record. An index in sled (one entry per record, one removal per record when it
//! left the window) was most of the log writer's writes, a read of a random page per expired
//! record, and pages whose bookkeeping sled keeps in memory for as long as the store lives: the
//! engine's memory grew with the window on top of the fold's state.
//!
//! An id is kept as a 38-bit fingerprint: its top 6 bits pick one of [`SHARDS`] tables, which
//! keeps the other 32 with the low 32 bits of the seq, 8 bytes an entry. Ids that share a
//! fingerprint (about 65 pairs among 6M ids, a window of 10 minutes at 10,000 appends a second)
//! keep their further seqs in a small side table, so no id is ever lost to another. A
//! fingerprint only names candidates: the log reads each candidate's record and compares the
//! whole msg id, so a shared fingerprint costs a read, never a wrong answer.
//!
//! The low 32 bits name one seq up to 2^32 − 1 seqs behind the tail ([`SEQS_APART_MAX`]); the
//! log treats a record 2^31 or more seqs behind the tail as outside the window whatever its age
//! ([`SEQS_KEPT_MAX`]), which leaves room for the seqs a group commit adds before its pruning.

use std::collections::HashMap;

use anima_projections::hashed::{HashedMap, Hasher, SHARDS};

/// How far behind the last seq a record may be and still be inside the window: the seqs kept
/// as 32 bits name one seq up to this distance.
const SEQS_APART_MAX: u64 = u32::MAX as u64;

/// A record this many seqs or more behind the last seq is outside the dedupe window, whatever
/// its age: the window's ids are kept well within [`SEQS_APART_MAX`].
pub(super) const SEQS_KEPT_MAX: u64 = 1 << 31;

const _: () = assert!(SEQS_KEPT_MAX < SEQS_APART_MAX);

/// Where an id's fingerprint lives: its shard and what the shard keeps of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct IdPrint {
    shard: u8,
    print: u32,
}

impl IdPrint {
    pub(super) fn of(msg_id: &[u8]) -> IdPrint {
        use std::hash::BuildHasher;
        let print = Hasher::with_seed(0x7769_6e64_6f77_6964).hash_one(msg_id);
        IdPrint { shard: (print >> 58) as u8, print: print as u32 }
    }
}

const _: () = assert!(SHARDS == 1 << (64 - 58));

#[derive(Debug)]
pub(super) struct WindowIds {
    /// Per shard: the fingerprint's low 32 bits → the low 32 bits of the first seq kept with it.
    shards: Box<[HashedMap<u32, u32>]>,
    /// Further seqs of a fingerprint another id (or an earlier record of the same id) holds in
    /// `shards` already.
    shared: HashMap<IdPrint, Vec<u64>>,
    len: usize,
}

impl Default for WindowIds {
    fn default() -> Self {
        WindowIds { shards: (0..SHARDS).map(|_| HashedMap::default()).collect(), shared: HashMap::new(), len: 0 }
    }
}

/// The seq whose low 32 bits are `low`, at most [`SEQS_APART_MAX`] behind `last_seq`.
fn widen(low: u32, last_seq: u64) -> u64 {
    last_seq - u64::from((last_seq as u32).wrapping_sub(low))
}

impl WindowIds {
    /// Keeps the record at `seq` as holding the id of `print`.
    pub(super) fn insert(&mut self, print: IdPrint, seq: u64) {
        let shard = &mut self.shards[usize::from(print.shard)];
        match shard.entry(print.print) {
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(seq as u32);
            }
            std::collections::hash_map::Entry::Occupied(_) => self.shared.entry(print).or_default().push(seq),
        }
        self.len += 1;
    }

    /// Forgets the record at `seq` (it left the window); `last_seq` is the log's last seq.
    pub(super) fn remove(&mut self, print: IdPrint, seq: u64, last_seq: u64) {
        let shard = &mut self.shards[usize::from(print.shard)];
        let Some(&first) = shard.get(&print.print) else {
            debug_assert!(false, "a seq removed from the window ids was never kept");
            return;
        };
        if widen(first, last_seq) == seq {
            // The first seq goes: a further one of the same fingerprint takes its place.
            match self.shared.get_mut(&print) {
                Some(further) => {
                    let next = further.remove(0);
                    if further.is_empty() {
                        self.shared.remove(&print);
                    }
                    shard.insert(print.print, next as u32);
                }
                None => {
                    shard.remove(&print.print);
                }
            }
            self.len -= 1;
            return;
        }
        if let Some(further) = self.shared.get_mut(&print) {
            if let Some(at) = further.iter().position(|&s| s == seq) {
                further.remove(at);
                if further.is_empty() {
                    self.shared.remove(&print);
                }
                self.len -= 1;
                return;
            }
        }
        debug_assert!(false, "a seq removed from the window ids was never kept");
    }

    /// The seqs of the records that may hold the id of `print` (none for most new ids), oldest
    /// first; `last_seq` is the log's last seq.
    pub(super) fn candidates(&self, print: IdPrint, last_seq: u64) -> impl Iterator<Item = u64> + '_ {
        let first = self.shards[usize::from(print.shard)].get(&print.print).map(|&low| widen(low, last_seq));
        let further = first.and_then(|_| self.shared.get(&print)).map(|seqs| seqs.as_slice()).unwrap_or_default();
        first.into_iter().chain(further.iter().copied())
    }

    /// Records kept.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(ids: &WindowIds, print: IdPrint, last_seq: u64) -> Vec<u64> {
        ids.candidates(print, last_seq).collect()
    }

    #[test]
    fn a_kept_id_names_its_seq_and_a_new_one_names_none() {
        let mut ids = WindowIds::default();
        for n in 1..=10_000u64 {
            ids.insert(IdPrint::of(format!("id-{n}").as_bytes()), n);
        }
        assert_eq!(ids.len(), 10_000);
        assert_eq!(seqs(&ids, IdPrint::of(b"id-7"), 10_000), [7]);
        // 10,000 new ids: a 38-bit fingerprint is shared by one of them with odds of 1 in 27,000.
        let named =
            (0..10_000).filter(|n| ids.candidates(IdPrint::of(format!("new-{n}").as_bytes()), 10_000).next().is_some());
        assert!(named.count() <= 2);
        ids.remove(IdPrint::of(b"id-7"), 7, 10_000);
        assert_eq!(seqs(&ids, IdPrint::of(b"id-7"), 10_000), Vec::<u64>::new());
        assert_eq!(ids.len(), 9_999);
    }

    /// Records sharing a fingerprint (the same id stored again after it expired, or two ids
    /// with one fingerprint) are all candidates, and each leaves on its own.
    #[test]
    fn records_sharing_a_fingerprint_are_each_kept_and_removed() {
        let mut ids = WindowIds::default();
        let print = IdPrint::of(b"same");
        ids.insert(print, 5);
        ids.insert(print, 9);
        ids.insert(print, 12);
        assert_eq!(seqs(&ids, print, 20), [5, 9, 12]);
        ids.remove(print, 9, 20);
        assert_eq!(seqs(&ids, print, 20), [5, 12]);
        ids.remove(print, 5, 20);
        assert_eq!(seqs(&ids, print, 20), [12]);
        ids.remove(print, 12, 20);
        assert_eq!(seqs(&ids, print, 20), Vec::<u64>::new());
        assert_eq!(ids.len(), 0);
        assert!(ids.shared.is_empty());
    }

    /// A seq kept as 32 bits comes back whole up to 2^32 − 1 behind the last seq, across the
    /// seqs where its low 32 bits wrap.
    #[test]
    fn a_seq_comes_back_whole_across_a_wrap_of_its_low_bits() {
        let mut ids = WindowIds::default();
        let print = IdPrint::of(b"id");
        let seq = (3u64 << 32) - 2;
        ids.insert(print, seq);
        assert_eq!(seqs(&ids, print, seq), [seq]);
        assert_eq!(seqs(&ids, print, seq + 5), [seq]);
        assert_eq!(seqs(&ids, print, seq + SEQS_APART_MAX), [seq]);
        ids.remove(print, seq, seq + 100);
        assert_eq!(ids.len(), 0);
    }
}
