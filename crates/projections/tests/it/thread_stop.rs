//! Slack thread stop and "posted, do not resend": a stop removes the thread's queued input of
//! its agent and nothing else; a confirmation naming the send that allowed it is remembered, so
//! the engine can answer a repeated send with the post instead of allowing a second one.

use anima_projections::proto::{Envelope, WakeOutcome};
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::Verdict;

use crate::events::*;
use crate::log::{describe_refusal, TestLog};

fn ada() -> Envelope {
    agent("ada", "U0ADA", "B0ADA")
}

fn channel_post(ts_: &str, text: &str) -> Envelope {
    message("ada", "C1", ts_).by_user("U1", "Uma").text(text)
}

fn thread_reply(thread: &str, ts_: &str, text: &str) -> Envelope {
    message("ada", "C1", ts_).by_user("U1", "Uma").text(text).in_thread(thread)
}

fn queued_ids(log: &TestLog) -> Vec<String> {
    log.state.queue("ada").map(|q| q.queued().map(|i| i.id.clone()).collect()).unwrap_or_default()
}

fn stopped(log: &TestLog, seq: u64) -> (SurfaceId, Vec<String>) {
    match log.verdict(seq) {
        Verdict::ThreadStopped(stop) => (stop.surface.clone(), stop.removed.clone()),
        other => panic!("not a thread stop: {other:?}"),
    }
}

fn item(ts_: &str) -> String {
    format!("slack:T1:C1:{ts_}")
}

/// Given a mention in thread A (its parent), a reply in A and a mention starting thread B, when
/// the user stops ada in thread A, then A's two queued wakes are removed and B's stays; cursors
/// do not move.
#[test]
fn a_thread_stop_removes_that_threads_queued_input_only() {
    let (a, b) = (ts(1), ts(3));
    let mut log = TestLog::with(&[
        ada(),
        channel_post(&a, "hey <@U0ADA> can you look?"),
        thread_reply(&a, &ts(2), "and this too"),
        channel_post(&b, "<@U0ADA> something else"),
    ]);
    assert_eq!(queued_ids(&log), [item(&a), item(&ts(2)), item(&b)]);
    let cursors_before = log.cursors("ada");
    let seq = log.fold(thread_stop("ada", "C1", &a));
    let (surface, removed) = stopped(&log, seq);
    assert_eq!(surface.to_string(), format!("slack:T1:C1:thread:{a}"));
    assert_eq!(removed, [item(&a), item(&ts(2))]);
    assert_eq!(queued_ids(&log), [item(&b)]);
    assert_eq!(log.cursors("ada"), cursors_before, "a stop moves no cursor");

    // Input arriving in the thread after the stop wakes the agent again.
    log.fold(thread_reply(&a, &ts(4), "<@U0ADA> are you there?"));
    assert_eq!(queued_ids(&log), [item(&b), item(&ts(4))]);
}

/// Given a wake of the thread already running, when the thread is stopped, then the running
/// wake is left to finish (the runtime stops it), and only queued input goes.
#[test]
fn a_thread_stop_leaves_a_running_wake_and_removes_nothing_when_nothing_is_queued() {
    let a = ts(1);
    let mut log = TestLog::with(&[ada(), channel_post(&a, "hey <@U0ADA>"), claim("ada", "w1"), start("ada", "w1")]);
    let seq = log.fold(thread_stop("ada", "C1", &a));
    assert_eq!(stopped(&log, seq).1, Vec::<String>::new());
    let active = log.state.queue("ada").and_then(|q| q.active.as_ref()).map(|a| a.item.id.clone());
    assert_eq!(active, Some(item(&a)), "the running wake stays");
    log.fold(finish("ada", "w1", WakeOutcome::Completed));
}

/// A stop for another agent's thread, or by an unknown agent, touches nothing of ada's.
#[test]
fn a_thread_stop_is_per_agent() {
    let a = ts(1);
    let mut log = TestLog::with(&[ada(), agent("bob", "U0BOB", "B0BOB"), channel_post(&a, "hey <@U0ADA>")]);
    let seq = log.fold(thread_stop("bob", "C1", &a));
    assert_eq!(stopped(&log, seq).1, Vec::<String>::new());
    assert_eq!(queued_ids(&log), [item(&a)]);
    let seq = log.fold(thread_stop("eve", "C1", &a));
    let Verdict::Refused(refusal) = log.verdict(seq) else { panic!("an unknown agent's stop is refused") };
    assert_eq!(describe_refusal(refusal), "refused InvalidArgument: agent \"eve\" is not registered");
    assert_eq!(queued_ids(&log), [item(&a)]);
}

/// Given a send allowed at its place, when its post is confirmed naming it, then the post is
/// remembered under the send's event id (the first confirmation wins); a confirmation naming no
/// send records nothing.
#[test]
fn a_confirmation_naming_its_send_is_remembered_as_that_sends_post() {
    let mut log = TestLog::with(&[ada(), dm_from_human("ada", "D1", &ts(1), "hi")]);
    let send_seq = log.fold(send("ada", "D1"));
    assert!(matches!(log.verdict(send_seq), Verdict::Send(_)));
    let send_id = log.events[send_seq as usize - 1].event_id.clone();
    assert!(log.state.posted_send(&send_id).is_none(), "not posted yet");
    let confirm_seq = log.fold(confirmed_for("ada", "D1", &ts(2), &send_id));
    let posted = log.state.posted_send(&send_id).expect("the post is remembered").clone();
    assert_eq!((posted.agent.as_str(), posted.ts.as_str(), posted.confirmed_seq), ("ada", ts(2).as_str(), confirm_seq));
    assert_eq!(posted.surface.to_string(), "slack:T1:D1");

    log.fold(confirmed_for("ada", "D1", &ts(3), &send_id));
    assert_eq!(log.state.posted_send(&send_id).map(|p| p.ts.clone()), Some(ts(2)), "the first confirmation wins");

    log.fold(confirmed("ada", "D1", &ts(4), "no send named"));
    assert_eq!(log.state.posted_sends.len(), 1);
}
