//! Per-surface journals: which observations become rows, on which surface,
//! with which ordinal, and which deliveries of one message are the same row.
//!
//! `check` renders what the fold recorded for the `when` observation, then every journal's rows
//! (ordinal, ts, author, owner, the log seq that wrote it).

use std::fmt::Write;

use anima_projections::proto::Envelope;
use anima_projections::verdict::Verdict;
use expect_test::{expect, Expect};

use crate::events::*;
use crate::log::{describe_refusal, TestLog};

#[track_caller]
fn check(given: &[Envelope], when: Envelope, expect: Expect) {
    let mut log = TestLog::with(given);
    let seq = log.fold(when);
    let mut out = match log.verdict(seq) {
        Verdict::Journaled(j) => match &j.surface {
            None => format!("not journaled (delivered to {})\n", j.agent),
            Some(surface) => format!(
                "journaled on {surface} as #{}{} (delivered to {}), wake: {}\n",
                j.ordinal,
                if j.duplicate_message { ", a duplicate of an earlier delivery" } else { "" },
                j.agent,
                j.wake.map_or("none", |w| w.as_str()),
            ),
        },
        Verdict::Refused(refusal) => describe_refusal(refusal) + "\n",
        other => format!("{other:?}\n"),
    };
    out.push_str("--- journals ---\n");
    for (surface, journal) in log.state.journal_entries() {
        writeln!(out, "{surface} (tail {})", journal.tail).unwrap();
        for row in &log.state.recent_rows(&surface) {
            let author =
                if row.user_id.is_empty() { format!("bot {}", row.bot_id) } else { format!("user {}", row.user_id) };
            let owner = row.owner.as_deref().unwrap_or("-");
            writeln!(out, "  #{} ts {} {author} owner {owner} seq {}", row.ordinal, row.ts, row.seq).unwrap();
        }
    }
    expect.assert_eq(&out);
}

fn human(channel: &str, minute: u64, text: &str) -> Envelope {
    message("anna", channel, &ts(minute)).by_user("U1", "Uma").text(text)
}

#[test]
fn ordinals_are_dense_in_log_order_not_ts_order() {
    check(
        &[agent("anna", "UANNA", "BANNA"), human("C1", 5, "five"), human("C1", 3, "three"), human("C1", 4, "four")],
        human("C1", 1, "one"),
        expect![[r#"
            journaled on slack:T1:C1 as #4 (delivered to anna), wake: channel_follow
            --- journals ---
            slack:T1:C1 (tail 4)
              #1 ts 1700000300.000100 user U1 owner - seq 2
              #2 ts 1700000180.000100 user U1 owner - seq 3
              #3 ts 1700000240.000100 user U1 owner - seq 4
              #4 ts 1700000060.000100 user U1 owner - seq 5
        "#]],
    );
}

#[test]
fn the_top_level_and_each_thread_are_separate_sequences() {
    check(
        &[
            agent("anna", "UANNA", "BANNA"),
            human("C1", 1, "parent one"),
            human("C1", 2, "parent two"),
            human("C1", 3, "reply to one").in_thread(&ts(1)),
            human("C1", 4, "reply to two").in_thread(&ts(2)),
            human("C1", 5, "second reply to one").in_thread(&ts(1)),
        ],
        human("C1", 6, "top level again"),
        expect![[r#"
            journaled on slack:T1:C1 as #3 (delivered to anna), wake: channel_follow
            --- journals ---
            slack:T1:C1 (tail 3)
              #1 ts 1700000060.000100 user U1 owner - seq 2
              #2 ts 1700000120.000100 user U1 owner - seq 3
              #3 ts 1700000360.000100 user U1 owner - seq 7
            slack:T1:C1:thread:1700000060.000100 (tail 2)
              #1 ts 1700000180.000100 user U1 owner - seq 4
              #2 ts 1700000300.000100 user U1 owner - seq 6
            slack:T1:C1:thread:1700000120.000100 (tail 1)
              #1 ts 1700000240.000100 user U1 owner - seq 5
        "#]],
    );
}

#[test]
fn a_thread_parent_lives_on_the_top_level() {
    check(
        &[agent("anna", "UANNA", "BANNA"), human("C1", 1, "blank thread ts").in_thread("  ")],
        human("C1", 2, "I am the parent").in_thread(&ts(2)),
        expect![[r#"
            journaled on slack:T1:C1 as #2 (delivered to anna), wake: channel_follow
            --- journals ---
            slack:T1:C1 (tail 2)
              #1 ts 1700000060.000100 user U1 owner - seq 2
              #2 ts 1700000120.000100 user U1 owner - seq 3
        "#]],
    );
}

#[test]
fn message_and_app_mention_of_one_message_are_one_row() {
    check(
        &[agent("anna", "UANNA", "BANNA"), human("C1", 1, "before"), human("C1", 2, "<@UANNA> look")],
        human("C1", 2, "<@UANNA> look").app_mention(),
        expect![[r#"
            journaled on slack:T1:C1 as #2, a duplicate of an earlier delivery (delivered to anna), wake: none
            --- journals ---
            slack:T1:C1 (tail 2)
              #1 ts 1700000060.000100 user U1 owner - seq 2
              #2 ts 1700000120.000100 user U1 owner - seq 3
        "#]],
    );
}

#[test]
fn one_message_delivered_to_two_agents_is_one_row() {
    check(
        &[agent("anna", "UANNA", "BANNA"), agent("bert", "UBERT", "BBERT"), human("C1", 1, "hello both")],
        human("C1", 1, "hello both").delivered_to("bert"),
        expect![[r#"
            journaled on slack:T1:C1 as #1, a duplicate of an earlier delivery (delivered to bert), wake: channel_follow
            --- journals ---
            slack:T1:C1 (tail 1)
              #1 ts 1700000060.000100 user U1 owner - seq 3
        "#]],
    );
}

#[test]
fn an_own_post_confirmed_then_observed_is_one_row() {
    check(
        &[agent("anna", "UANNA", "BANNA"), confirmed("anna", "C1", &ts(1), "my post")],
        message("anna", "C1", &ts(1)).by_user("UANNA", "anna").text("my post"),
        expect![[r#"
            journaled on slack:T1:C1 as #1, a duplicate of an earlier delivery (delivered to anna), wake: none
            --- journals ---
            slack:T1:C1 (tail 1)
              #1 ts 1700000060.000100 user UANNA owner anna seq 2
        "#]],
    );
}

#[test]
fn edits_are_recorded_but_not_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA"), human("C1", 1, "orignal")],
        human("C1", 1, "original").subtype("message_changed"),
        expect![[r#"
            not journaled (delivered to anna)
            --- journals ---
            slack:T1:C1 (tail 1)
              #1 ts 1700000060.000100 user U1 owner - seq 2
        "#]],
    );
}

#[test]
fn joins_are_not_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        human("C1", 1, "<@U1> has joined the channel").subtype("channel_join"),
        expect![[r#"
            not journaled (delivered to anna)
            --- journals ---
        "#]],
    );
}

#[test]
fn file_shares_are_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        human("C1", 1, "").subtype("file_share").file("report.pdf", 1_024),
        expect![[r#"
            journaled on slack:T1:C1 as #1 (delivered to anna), wake: none
            --- journals ---
            slack:T1:C1 (tail 1)
              #1 ts 1700000060.000100 user U1 owner - seq 2
        "#]],
    );
}

#[test]
fn a_message_without_text_or_files_is_not_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        human("C1", 1, " \n\t "),
        expect![[r#"
            not journaled (delivered to anna)
            --- journals ---
        "#]],
    );
}

#[test]
fn a_message_without_author_is_not_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        message("anna", "C1", &ts(1)).text("who said this?"),
        expect![[r#"
            not journaled (delivered to anna)
            --- journals ---
        "#]],
    );
}

#[test]
fn a_message_with_a_malformed_ts_is_not_journaled() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        message("anna", "C1", "yesterday").by_user("U1", "Uma").text("hi"),
        expect![[r#"
            not journaled (delivered to anna)
            --- journals ---
        "#]],
    );
}

#[test]
fn a_bot_message_is_journaled_but_wakes_nobody() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        message("anna", "D1", &ts(1)).by_bot("BCI", "ci").text("build green"),
        expect![[r#"
            journaled on slack:T1:D1 as #1 (delivered to anna), wake: none
            --- journals ---
            slack:T1:D1 (tail 1)
              #1 ts 1700000060.000100 bot BCI owner - seq 2
        "#]],
    );
}

#[test]
fn a_human_dm_is_journaled_and_wakes() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        human("D1", 1, "hi anna"),
        expect![[r#"
            journaled on slack:T1:D1 as #1 (delivered to anna), wake: dm
            --- journals ---
            slack:T1:D1 (tail 1)
              #1 ts 1700000060.000100 user U1 owner - seq 2
        "#]],
    );
}

#[test]
fn a_dm_with_files_only_is_journaled_but_not_routable() {
    check(
        &[agent("anna", "UANNA", "BANNA")],
        human("D1", 1, "").file("photo.png", 12),
        expect![[r#"
            journaled on slack:T1:D1 as #1 (delivered to anna), wake: none
            --- journals ---
            slack:T1:D1 (tail 1)
              #1 ts 1700000060.000100 user U1 owner - seq 2
        "#]],
    );
}
