//! Failure notice owed: a wake a person asked for (a DM or a direct mention) that finished
//! `failed` leaves a notice owed to its reply target; the agent's next confirmed post there
//! settles it. Follows, other outcomes and restart drains owe nothing.

use anima_projections::proto::{Envelope, WakeOutcome};
use anima_projections::verdict::Verdict;

use crate::events::*;
use crate::log::TestLog;

fn ada() -> Envelope {
    agent("ada", "U0ADA", "B0ADA")
}

fn owed(log: &TestLog) -> Vec<String> {
    log.state
        .notices_owed_of("ada")
        .map(|n| format!("{} {} {} -> {}", n.item_id, n.wake_reason.as_str(), n.reason.as_str(), n.reply_to))
        .collect()
}

fn finished_owing(log: &TestLog, seq: u64) -> bool {
    match log.verdict(seq) {
        Verdict::Finished { notice_owed, .. } => *notice_owed,
        other => panic!("not a finish: {other:?}"),
    }
}

fn settled_by(log: &TestLog, seq: u64) -> Vec<String> {
    match log.verdict(seq) {
        Verdict::Journaled(journal) => journal.notices_settled.clone(),
        other => panic!("not journaled: {other:?}"),
    }
}

/// Given a DM wake that ran and failed, then a notice is owed to the DM; a post elsewhere leaves
/// it owed; the agent's post in the DM settles it.
#[test]
fn a_failed_dm_wake_owes_a_notice_until_the_agent_posts_in_the_dm() {
    let mut log = TestLog::with(&[
        ada(),
        dm_from_human("ada", "D1", &ts(1), "please do the thing"),
        claim("ada", "w1"),
        start("ada", "w1"),
    ]);
    let seq = log.fold(finish("ada", "w1", WakeOutcome::Failed));
    assert!(finished_owing(&log, seq));
    assert_eq!(owed(&log), [format!("slack:T1:D1:{} dm wake_failed -> slack:T1:D1", ts(1))]);

    let elsewhere = log.fold(confirmed("ada", "D2", &ts(2), "unrelated"));
    assert!(settled_by(&log, elsewhere).is_empty());
    assert_eq!(owed(&log).len(), 1, "a post elsewhere does not tell the person");

    let told = log.fold(confirmed("ada", "D1", &ts(3), "Sorry, I could not finish that."));
    assert_eq!(settled_by(&log, told), [format!("slack:T1:D1:{}", ts(1))]);
    assert!(owed(&log).is_empty());
}

/// A failed mention owes its thread a notice; a failed follow owes nothing (nobody asked).
#[test]
fn a_failed_mention_owes_a_notice_and_a_failed_follow_does_not() {
    let mention = message("ada", "C1", &ts(1)).by_user("U1", "Uma").text("<@U0ADA> can you check?");
    let mut log = TestLog::with(&[ada(), mention, claim("ada", "w1"), start("ada", "w1")]);
    let seq = log.fold(finish("ada", "w1", WakeOutcome::Failed));
    assert!(finished_owing(&log, seq));
    assert_eq!(owed(&log), [format!("slack:T1:C1:{} mention wake_failed -> slack:T1:C1:thread:{}", ts(1), ts(1))]);

    // A plain top-level post in a channel ada is a member of wakes her as a channel follow.
    let mut log = TestLog::with(&[
        ada(),
        message("ada", "C1", &ts(1)).by_user("U1", "Uma").text("morning all"),
        claim("ada", "w1"),
        start("ada", "w1"),
    ]);
    let seq = log.fold(finish("ada", "w1", WakeOutcome::Failed));
    assert!(!finished_owing(&log, seq));
    assert!(owed(&log).is_empty());
}

/// Completed, aborted and restart-drained wakes owe nothing.
#[test]
fn only_a_failed_finish_owes_a_notice() {
    for outcome in [WakeOutcome::Completed, WakeOutcome::Aborted] {
        let mut log =
            TestLog::with(&[ada(), dm_from_human("ada", "D1", &ts(1), "hi"), claim("ada", "w1"), start("ada", "w1")]);
        let seq = log.fold(finish("ada", "w1", outcome));
        assert!(!finished_owing(&log, seq), "{outcome:?}");
        assert!(owed(&log).is_empty(), "{outcome:?}");
    }
    let mut log =
        TestLog::with(&[ada(), dm_from_human("ada", "D1", &ts(1), "hi"), claim("ada", "w1"), start("ada", "w1")]);
    let seq = log.fold(restart_drain("ada", "w1"));
    assert!(!finished_owing(&log, seq));
    assert!(owed(&log).is_empty());
}
