//! The verdicts of the newest applied events, kept beside the fold's state so that a request
//! whose event the fold has applied reads its verdict without the state lock.
//!
//! Why: the fold holds the state lock for a whole batch, and a batch can take tens of
//! milliseconds when it reads state back from the checkpoint store while the store installs a
//! new version of its tree (fjall's tree holds the lock every read takes while it finishes a
//! merge's last table and syncs the new version). A request whose verdict was already decided
//! then waited for the next batch as well, blocking the tokio worker it ran on: two such
//! requests stopped both workers of a 2-core machine, and every other call with them.
//!
//! What it answers is what the state would: the runner copies each applied event's kept verdict
//! (a shared reference, [`KeptVerdict`]) here under the same hold of the state lock that applied
//! it, and publishes the batch here before it publishes the applied seq. It answers only for
//! seqs it saw applied and that lie well inside the state's own window of kept verdicts
//! ([`VERDICTS_KEPT_MAX`]), so a seq the state would say it no longer keeps is never answered
//! here; anything else is [`Recent::NotKept`], and the caller asks the state.

use std::collections::VecDeque;

use anima_projections::state::{Halt, KeptVerdict, VERDICTS_KEPT_MAX};

/// Verdicts kept here at most: at 10,000 events a second, about the last second and a half of
/// them. A request reads its verdict as soon as its event is applied; one that comes later
/// asks the state.
pub const RECENT_VERDICTS_MAX: usize = 16_384;

/// The seqs answered here lie within this many of the newest applied seq: half the state's
/// window, so that the state keeps every verdict this answers for.
const RECENT_SEQS_SPAN: u64 = VERDICTS_KEPT_MAX as u64 / 2;

/// What the newest applied events decided about one seq.
#[derive(Debug)]
pub enum Recent {
    /// The fold stopped deciding at or before the seq.
    Halted(Halt),
    /// The seq's verdict.
    Verdict(KeptVerdict),
    /// The seq was applied and recorded no verdict.
    NoVerdict,
    /// Not known here (before the runner's first batch, or too old): ask the state.
    NotKept,
}

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct RecentVerdicts {
    /// (seq, verdict), seqs ascending.
    kept: VecDeque<(u64, KeptVerdict)>,
    /// Every applied seq from this one to `newest` is known here: its verdict is in `kept`, or
    /// it recorded none. `None` until the first batch.
    from: Option<u64>,
    /// The newest applied seq published.
    newest: u64,
    halted: Option<Halt>,
}

impl RecentVerdicts {
    /// Publishes a batch the fold applied: it applied every seq from `first` to `last`
    /// (`first` after the seq applied before the batch), `verdicts` are the kept verdicts it
    /// recorded, seqs ascending, and `halted` is the state's halt after it, if any.
    pub fn publish(&mut self, first: u64, last: u64, verdicts: Vec<(u64, KeptVerdict)>, halted: Option<&Halt>) {
        if self.from.is_none() {
            self.from = Some(first);
        }
        self.newest = self.newest.max(last);
        self.kept.extend(verdicts);
        let oldest_answered = self.newest.saturating_sub(RECENT_SEQS_SPAN - 1);
        while self.kept.len() > RECENT_VERDICTS_MAX || self.kept.front().is_some_and(|(seq, _)| *seq < oldest_answered)
        {
            let Some((dropped, _)) = self.kept.pop_front() else { break };
            self.from = Some(dropped + 1);
        }
        if self.halted.is_none() {
            self.halted = halted.cloned();
        }
    }

    /// What the published batches decided about `seq`, which the fold has applied.
    pub fn get(&self, seq: u64) -> Recent {
        if let Some(halt) = self.halted.as_ref().filter(|halt| halt.seq <= seq) {
            return Recent::Halted(halt.clone());
        }
        let answered = self.from.is_some_and(|from| from <= seq)
            && seq <= self.newest
            && seq > self.newest.saturating_sub(RECENT_SEQS_SPAN);
        if !answered {
            return Recent::NotKept;
        }
        match self.kept.binary_search_by_key(&seq, |(kept, _)| *kept) {
            Ok(at) => Recent::Verdict(self.kept[at].1.clone()),
            Err(_) => Recent::NoVerdict,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anima_projections::verdict::{Refusal, RefusalKind, Verdict};

    fn kept(seq: u64) -> KeptVerdict {
        KeptVerdict::new(Verdict::Refused(Refusal::new(RefusalKind::InvalidArgument, format!("event {seq}"))))
    }

    fn reason(recent: Recent) -> String {
        match recent {
            Recent::Verdict(kept) => match kept.get() {
                Some(Verdict::Refused(refusal)) => refusal.message.clone(),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn answers_only_for_seqs_it_saw_applied() {
        let mut recent = RecentVerdicts::default();
        assert!(matches!(recent.get(5), Recent::NotKept), "nothing before the first batch");
        // The state was restored at seq 9; the first batch applies 10..=14, two with verdicts.
        recent.publish(10, 14, vec![(11, kept(11)), (13, kept(13))], None);
        assert!(matches!(recent.get(9), Recent::NotKept), "applied before the runner's first batch");
        assert_eq!(reason(recent.get(11)), "event 11");
        assert_eq!(reason(recent.get(13)), "event 13");
        assert!(matches!(recent.get(10), Recent::NoVerdict));
        assert!(matches!(recent.get(14), Recent::NoVerdict));
        assert!(matches!(recent.get(15), Recent::NotKept), "not applied yet");
    }

    #[test]
    fn lets_the_oldest_go_and_then_sends_those_seqs_to_the_state() {
        let mut recent = RecentVerdicts::default();
        let count = RECENT_VERDICTS_MAX as u64 + 10;
        recent.publish(1, count, (1..=count).map(|seq| (seq, kept(seq))).collect(), None);
        assert_eq!(recent.kept.len(), RECENT_VERDICTS_MAX);
        assert!(matches!(recent.get(10), Recent::NotKept));
        assert_eq!(reason(recent.get(11)), "event 11");
        assert_eq!(reason(recent.get(count)), format!("event {count}"));
        // Seqs far behind the newest are the state's to answer, verdict or not.
        let far = count + RECENT_SEQS_SPAN + 5;
        recent.publish(count + 1, far, vec![(far, kept(far))], None);
        assert_eq!(recent.kept.len(), 1);
        assert!(matches!(recent.get(count), Recent::NotKept));
        assert!(matches!(recent.get(far - RECENT_SEQS_SPAN), Recent::NotKept));
        assert!(matches!(recent.get(far - RECENT_SEQS_SPAN + 1), Recent::NoVerdict));
        assert_eq!(reason(recent.get(far)), format!("event {far}"));
    }

    #[test]
    fn a_halt_answers_for_its_seq_and_after() {
        let mut recent = RecentVerdicts::default();
        recent.publish(1, 4, vec![(2, kept(2))], None);
        let halt = Halt { seq: 3, reason: "event does not decode".into() };
        recent.publish(5, 6, vec![], Some(&halt));
        assert_eq!(reason(recent.get(2)), "event 2");
        assert!(matches!(recent.get(3), Recent::Halted(h) if h.seq == 3));
        assert!(matches!(recent.get(6), Recent::Halted(h) if h.seq == 3));
    }
}
