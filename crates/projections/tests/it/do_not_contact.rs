//! Do-not-contact, before the hold: a send that would reach a listed person (the DM's other
//! member, or someone the draft @mentions) is refused as `listed`; a DM whose other member the
//! fold has not seen is `could_not_verify` while the workspace has a list; an invalid list in
//! the log refuses every send as `bad_config` until a valid one replaces it. No refusal moves a
//! cursor.

use anima_projections::do_not_contact::NotContactedReason;
use anima_projections::proto::Envelope;
use anima_projections::verdict::{SendVerdict, Verdict};

use crate::events::*;
use crate::log::TestLog;

fn ada() -> Envelope {
    agent("ada", "U0ADA", "B0ADA")
}

/// The send's outcome: "allowed", "held", or "not_contacted <reason> [user]".
fn decided(log: &TestLog, seq: u64) -> String {
    match log.verdict(seq) {
        Verdict::Send(SendVerdict::Allowed { .. }) => "allowed".to_owned(),
        Verdict::Send(SendVerdict::Held(_)) => "held".to_owned(),
        Verdict::Send(SendVerdict::NotContacted(refused)) => {
            format!("not_contacted {} {}", refused.reason.as_str(), refused.user_id.as_deref().unwrap_or("-"))
        }
        other => panic!("not a send verdict: {other:?}"),
    }
}

/// Given a list naming U9 in T1, a DM where U9 writes and one where U1 writes, when ada sends
/// into each, then U9's DM is refused as listed without moving the cursor, and U1's is decided
/// by the hold as usual.
#[test]
fn a_dm_with_a_listed_person_is_refused_and_its_cursor_stays() {
    let mut log = TestLog::with(&[
        ada(),
        do_not_contact(&[("T1", &["U9"])]),
        message("ada", "D9", &ts(1)).by_user("U9", "Nina").text("hi ada"),
        message("ada", "D1", &ts(2)).by_user("U1", "Uma").text("hi ada"),
    ]);
    let cursors = log.cursors("ada");
    let seq = log.fold(send("ada", "D9"));
    assert_eq!(decided(&log, seq), "not_contacted listed U9");
    assert_eq!(log.cursors("ada"), cursors, "a refusal moves no cursor");
    let seq = log.fold(send("ada", "D1"));
    assert_eq!(decided(&log, seq), "allowed");
}

/// A DM nobody has written in yet cannot be checked while the workspace has a list; a workspace
/// without a list is not checked at all.
#[test]
fn a_dm_whose_member_is_unknown_cannot_be_verified() {
    let mut log = TestLog::with(&[ada(), do_not_contact(&[("T1", &["U9"])])]);
    let seq = log.fold(send("ada", "D5"));
    assert_eq!(decided(&log, seq), "not_contacted could_not_verify -");

    let mut log = TestLog::with(&[ada(), do_not_contact(&[("T2", &["U9"])])]);
    let seq = log.fold(send("ada", "D5"));
    assert_eq!(decided(&log, seq), "allowed", "T1 has no list");
}

/// A mention of a listed person is refused anywhere, a channel included; other mentions pass.
#[test]
fn mentioning_a_listed_person_is_refused() {
    let mut log = TestLog::with(&[ada(), do_not_contact(&[("T1", &["U9", "U8"])])]);
    let seq = log.fold(send_mentioning("ada", "C1", &["U1", "U8"]));
    assert_eq!(decided(&log, seq), "not_contacted listed U8");
    let seq = log.fold(send_mentioning("ada", "C1", &["U1"]));
    assert_eq!(decided(&log, seq), "allowed");
}

/// An invalid list in the log refuses every send until a valid one replaces it; a list
/// replaced by an empty one checks nothing.
#[test]
fn an_invalid_list_fails_closed_until_a_valid_one_replaces_it() {
    let mut log = TestLog::with(&[ada()]);
    let seq = log.fold(do_not_contact(&[("T1", &["U9", "bad id"])]));
    let Verdict::Refused(refusal) = log.verdict(seq) else { panic!("an invalid list is refused") };
    assert!(refusal.message.contains("entry 1 contains whitespace"), "{}", refusal.message);
    let seq = log.fold(send("ada", "C1"));
    assert_eq!(decided(&log, seq), "not_contacted bad_config -");
    assert_eq!(
        log.state.do_not_contact_config().and_then(|c| c.bad.as_ref()).map(|_| NotContactedReason::BadConfig),
        Some(NotContactedReason::BadConfig)
    );

    log.fold(do_not_contact(&[("T1", &[])]));
    let seq = log.fold(send("ada", "D5"));
    assert_eq!(decided(&log, seq), "allowed", "an empty list checks nothing");
}

/// The agent's own posts and bots do not make anyone the DM's member: a DM where only a bot
/// wrote is still unverified.
#[test]
fn only_a_person_who_writes_is_the_dms_member() {
    let mut log = TestLog::with(&[
        ada(),
        do_not_contact(&[("T1", &["U9"])]),
        message("ada", "D3", &ts(1)).by_bot("B7", "Reminder bot").text("standup in 5"),
        message("ada", "D3", &ts(2)).by_user("U0ADA", "ada").text("my own post, echoed"),
    ]);
    let seq = log.fold(send("ada", "D3"));
    assert_eq!(decided(&log, seq), "not_contacted could_not_verify -");
}
