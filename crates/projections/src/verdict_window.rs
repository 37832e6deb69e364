//! `VerdictWindow`: the verdicts of the newest [`VERDICTS_KEPT_MAX`] log sequences, so a request
//! retried after its answer was lost gets the same answer.
//!
//! A ring of slots indexed by seq modulo the window. Every event records a verdict, so an
//! ordered map paid a map insert, a change-set insert and a removal of the oldest per event
//! (about a fifteenth of the fold bench's instructions); here recording is a slot write, and a
//! checkpoint's changes are the pages of slots written since the last one.
//!
//! Invariant: every occupied slot holds a seq in `(newest - window, newest]`. Recording a seq
//! past `newest` empties the slots of the seqs skipped on the way (events that recorded no
//! verdict): what they held fell out of the window, as the recorded seq's own slot did.

use std::collections::BTreeSet;

use crate::state::{KeptVerdict, VERDICTS_KEPT_MAX};

/// Verdict slots per checkpoint page: every event records a verdict, so one entry per verdict was
/// a quarter of a checkpoint's entries (the fold bench's mix), and 65,536 for a restore to read.
pub const VERDICTS_PER_PAGE: u64 = 64;

const WINDOW: u64 = VERDICTS_KEPT_MAX as u64;

#[derive(Clone, Default)]
pub struct VerdictWindow {
    /// Slot `seq % WINDOW` → (seq, verdict); allocated on the first verdict.
    slots: Vec<Option<(u64, KeptVerdict)>>,
    /// The newest seq recorded or loaded (0: none).
    newest: u64,
    len: usize,
    /// Pages with a slot written since the last [`VerdictWindow::drain_changed_pages`].
    changed_pages: BTreeSet<u64>,
    /// The last page added to `changed_pages`, to skip the set for consecutive seqs.
    last_changed_page: Option<u64>,
}

/// The checkpoint page of the slot of `seq`.
pub fn page_of(seq: u64) -> u64 {
    (seq % WINDOW) / VERDICTS_PER_PAGE
}

impl VerdictWindow {
    /// Keeps `verdict` for `seq`, which must be newer than every seq kept so far (the log's
    /// order), and lets go of every verdict that leaves the window.
    pub fn record(&mut self, seq: u64, verdict: KeptVerdict) {
        debug_assert!(seq > self.newest || self.len == 0, "verdicts are recorded in log order");
        self.ensure_slots();
        // Slots of seqs skipped since the newest, and the slot of `seq` itself, hold seqs that
        // are now `window` or more behind `seq`.
        let skipped_from = self.newest.saturating_add(1).max(seq.saturating_sub(WINDOW - 1));
        for skipped in skipped_from..seq {
            self.clear(skipped);
        }
        let slot = (seq % WINDOW) as usize;
        if self.slots[slot].replace((seq, verdict)).is_none() {
            self.len += 1;
        }
        self.newest = seq;
        self.mark(seq);
    }

    /// Loads a verdict from a checkpoint; not marked changed.
    pub fn load(&mut self, seq: u64, verdict: KeptVerdict) {
        self.ensure_slots();
        let slot = (seq % WINDOW) as usize;
        match &self.slots[slot] {
            Some((kept, _)) if *kept > seq => return,
            Some(_) => {}
            None => self.len += 1,
        }
        self.slots[slot] = Some((seq, verdict));
        self.newest = self.newest.max(seq);
    }

    pub fn get(&self, seq: u64) -> Option<&KeptVerdict> {
        match self.slots.get((seq % WINDOW) as usize)? {
            Some((kept, verdict)) if *kept == seq => Some(verdict),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every kept verdict, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &KeptVerdict)> + '_ {
        let first = self.newest.saturating_sub(WINDOW - 1).max(1);
        (first..=self.newest).filter_map(move |seq| self.get(seq).map(|verdict| (seq, verdict)))
    }

    /// The kept verdicts of a checkpoint page, oldest first.
    pub fn page(&self, page: u64) -> Vec<(u64, KeptVerdict)> {
        let first_slot = (page * VERDICTS_PER_PAGE) as usize;
        let Some(slots) = self.slots.get(first_slot..first_slot + VERDICTS_PER_PAGE as usize) else {
            return Vec::new();
        };
        let mut entries: Vec<(u64, KeptVerdict)> = slots.iter().flatten().cloned().collect();
        entries.sort_unstable_by_key(|(seq, _)| *seq);
        entries
    }

    /// Pages changed since the last call, in page order.
    pub fn drain_changed_pages(&mut self) -> BTreeSet<u64> {
        self.last_changed_page = None;
        std::mem::take(&mut self.changed_pages)
    }

    /// Pages not yet checkpointed.
    pub fn changed_len(&self) -> usize {
        self.changed_pages.len()
    }

    fn ensure_slots(&mut self) {
        if self.slots.is_empty() {
            self.slots = vec![None; VERDICTS_KEPT_MAX];
        }
    }

    fn clear(&mut self, seq: u64) {
        if self.slots[(seq % WINDOW) as usize].take().is_some() {
            self.len -= 1;
            self.mark(seq);
        }
    }

    fn mark(&mut self, seq: u64) {
        let page = page_of(seq);
        if self.last_changed_page != Some(page) {
            self.changed_pages.insert(page);
            self.last_changed_page = Some(page);
        }
    }
}

/// Windows compare by what they keep and what they have yet to checkpoint.
impl PartialEq for VerdictWindow {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.changed_pages == other.changed_pages && self.iter().eq(other.iter())
    }
}

impl Eq for VerdictWindow {}

impl std::fmt::Debug for VerdictWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::{refused, RefusalKind, Verdict};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn verdict(seq: u64) -> KeptVerdict {
        KeptVerdict::new(refused(RefusalKind::InvalidArgument, format!("event {seq}")))
    }

    proptest! {
        /// The ring keeps exactly what an ordered map of the newest window of seqs keeps, for
        /// any gaps between recorded seqs (events that record no verdict), including gaps
        /// longer than the window; and it marks the pages of every slot that changed.
        #[test]
        fn keeps_what_an_ordered_window_keeps(gaps in prop::collection::vec(
            prop_oneof![8 => 1u64..4, 1 => 4u64..2_000, 1 => WINDOW - 2..WINDOW + 3], 1..400)
        ) {
            let mut ring = VerdictWindow::default();
            let mut map: BTreeMap<u64, Verdict> = BTreeMap::new();
            let mut seq = 0;
            for (step, gap) in gaps.iter().enumerate() {
                seq += gap;
                let before: BTreeMap<u64, Verdict> = map.clone();
                ring.record(seq, verdict(seq));
                map.insert(seq, verdict(seq).get().cloned().unwrap());
                while map.first_key_value().is_some_and(|(first, _)| first + WINDOW <= seq) {
                    map.pop_first();
                }
                // Every page whose content changed is marked.
                let changed: BTreeSet<u64> = before.keys().chain(map.keys())
                    .filter(|s| before.get(s) != map.get(s))
                    .map(|s| page_of(*s))
                    .collect();
                let marked = ring.drain_changed_pages();
                prop_assert!(changed.is_subset(&marked), "step {step}: changed {changed:?}, marked {marked:?}");
                prop_assert_eq!(ring.len(), map.len());
            }
            let kept: Vec<(u64, Verdict)> = ring.iter().map(|(s, v)| (s, v.get().cloned().unwrap())).collect();
            prop_assert_eq!(kept, map.into_iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_page_lists_its_slots_oldest_first_across_a_wrap() {
        let mut ring = VerdictWindow::default();
        for seq in 1..=WINDOW + 10 {
            ring.record(seq, verdict(seq));
        }
        let seqs: Vec<u64> = ring.page(0).into_iter().map(|(seq, _)| seq).collect();
        // Slot 0 holds WINDOW, slots 1..=10 the newest, the rest the cycle before.
        let mut expected: Vec<u64> = (WINDOW + 11..WINDOW + 64).map(|s| s - WINDOW).collect();
        expected.extend(WINDOW..=WINDOW + 10);
        assert_eq!(seqs, expected);
        assert!(ring.get(10).is_none(), "seq 10 left the window");
        assert!(ring.get(11).is_some());
    }

    #[test]
    fn a_load_keeps_the_newer_of_two_seqs_of_a_slot() {
        let mut ring = VerdictWindow::default();
        ring.load(WINDOW + 5, verdict(WINDOW + 5));
        ring.load(5, verdict(5));
        assert!(ring.get(5).is_none());
        assert!(ring.get(WINDOW + 5).is_some());
        assert_eq!(ring.len(), 1);
        assert_eq!(ring.changed_len(), 0, "a load is not a change");
    }
}
