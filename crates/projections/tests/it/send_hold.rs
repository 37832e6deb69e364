//! The send hold, rule by rule: before every post the agent asks, and the fold
//! decides at the request's place in the log from the agent's cursor on the outbound surface.
//!
//! `check` renders the verdict as `allowed`/`held` with the cursor move (read back from state)
//! and, for a hold, the notice the agent is shown — rendered from the verdict's rows with bodies
//! read from the given events, as the engine renders it. Lines longer than 130 bytes are
//! abbreviated in the snapshot; the notice's full size is stated and checked against the budget.

use std::fmt::Write;

use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::text::{self, ROWS_SHOWN_MAX, TEXT_BYTES_MAX};
use anima_projections::verdict::{PostKind, SendVerdict, Verdict};
use anima_projections::LogPosition;
use expect_test::{expect, Expect};

use crate::events::*;
use crate::log::{describe_cursor, describe_refusal, TestLog};

/// Words a held notice must never use: nothing failed, the post just did not happen yet.
const WORDS_NEVER_IN_A_NOTICE: [&str; 3] = ["blocked", "rejected", "failed"];
/// Snapshot lines are abbreviated beyond this many bytes.
const SNAPSHOT_LINE_BYTES_MAX: usize = 130;

#[track_caller]
fn check(given: &[Envelope], when: Envelope, expect: Expect) {
    let mut log = TestLog::with(given);
    let seq = log.fold(when);
    expect.assert_eq(&describe(&log, seq));
}

fn describe(log: &TestLog, seq: u64) -> String {
    let Some(verdict) = log.state.verdict(seq) else {
        let halt = log.state.halted_at_or_before(seq).expect("no verdict means the fold halted");
        return format!("no verdict: the fold stopped deciding at seq {}: {}\n", halt.seq, halt.reason);
    };
    let Some(Payload::Send(request)) = log.events[seq as usize - 1].payload.as_ref() else {
        panic!("`when` is not a send request");
    };
    let agent = request.agent_id.as_str();
    match verdict {
        Verdict::Send(SendVerdict::Allowed { surface, cursor_before, cursor_after }) => {
            assert_eq!(log.state.cursor(agent, surface), *cursor_after, "the verdict's cursor is the state's");
            format!(
                "allowed on {surface}: cursor {} -> {}\n",
                describe_cursor(*cursor_before),
                describe_cursor(*cursor_after)
            )
        }
        Verdict::Send(SendVerdict::Held(held)) => {
            let cursor_after = log.state.cursor(agent, &held.surface);
            assert_eq!(cursor_after, Some(held.tail), "a hold moves the cursor to the tail");
            assert!(held.shown.len() <= ROWS_SHOWN_MAX);
            let bodies = log.with_bodies(&held.shown);
            let rows: Vec<_> = bodies.iter().map(|(meta, body)| (*meta, body)).collect();
            let notice = text::render_held_notice(agent, held.kind, held.new_messages, held.omitted, &rows);
            assert!(notice.len() <= TEXT_BYTES_MAX, "notice of {} bytes is over the budget", notice.len());
            let lower = notice.to_lowercase();
            for word in WORDS_NEVER_IN_A_NOTICE {
                assert!(!lower.contains(word), "the notice says {word:?}:\n{notice}");
            }
            let mut out = format!(
                "held on {}: new {}, shown {}, omitted {}, cursor {} -> {}\nnotice: {} bytes\n",
                held.surface,
                held.new_messages,
                held.shown.len(),
                held.omitted,
                held.cursor_before,
                describe_cursor(cursor_after),
                notice.len()
            );
            for line in notice.lines() {
                abbreviated(&mut out, line);
            }
            out
        }
        Verdict::Refused(refusal) => describe_refusal(refusal) + "\n",
        other => format!("{other:?}\n"),
    }
}

fn abbreviated(out: &mut String, line: &str) {
    if line.len() <= SNAPSHOT_LINE_BYTES_MAX {
        writeln!(out, "{line}").unwrap();
        return;
    }
    let mut cut = 60;
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    writeln!(out, "{}... [{} more bytes]", &line[..cut], line.len() - cut).unwrap();
}

/// Agents anna and bert are registered; a human DM'd anna on D1 (row 1), anna's wake started and
/// finished, so anna's cursor on D1 is @1. Seqs 1..=6.
fn anna_read_her_dm() -> Vec<Envelope> {
    vec![
        agent("anna", "UANNA", "BANNA"),
        agent("bert", "UBERT", "BBERT"),
        dm_from_human("anna", "D1", &ts(1), "hello anna"),
        claim("anna", "w1"),
        start("anna", "w1"),
        finish("anna", "w1", proto::WakeOutcome::Completed),
    ]
}

fn given(extra: Vec<Envelope>) -> Vec<Envelope> {
    [anna_read_her_dm(), extra].concat()
}

#[test]
fn the_setup_leaves_a_cursor_after_the_first_row() {
    let log = TestLog::with(&anna_read_her_dm());
    assert_eq!(log.cursors("anna"), "slack:T1:D1@1");
}

#[test]
fn no_cursor_on_the_surface_allows() {
    check(
        &[agent("anna", "UANNA", "BANNA"), message("anna", "C1", &ts(1)).by_user("U1", "Uma").text("anyone?")],
        send("anna", "C1"),
        expect![[r#"
            allowed on slack:T1:C1: cursor - -> -
        "#]],
    );
}

#[test]
fn nothing_new_after_the_cursor_allows() {
    check(
        &anna_read_her_dm(),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 1
        "#]],
    );
}

#[test]
fn own_rows_by_bot_user_id_allow_and_the_cursor_passes_them() {
    check(
        &given(vec![
            message("anna", "D1", &ts(2)).by_user("UANNA", "anna").text("first part"),
            message("anna", "D1", &ts(3)).by_user("UANNA", "anna").text("second part"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 3
        "#]],
    );
}

#[test]
fn own_rows_by_bot_id_allow_and_the_cursor_passes_them() {
    check(
        &given(vec![message("anna", "D1", &ts(2)).by_bot("BANNA", "anna").text("a bot_message of mine")]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 2
        "#]],
    );
}

#[test]
fn a_row_whose_bot_id_is_the_bot_user_id_is_own() {
    check(
        &given(vec![message("anna", "D1", &ts(2)).by_bot("UANNA", "anna").text("bot id equals my user id")]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 2
        "#]],
    );
}

#[test]
fn a_confirmed_own_post_is_own() {
    check(
        &given(vec![confirmed("anna", "D1", &ts(2), "posted by me")]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 2
        "#]],
    );
}

#[test]
fn a_foreign_row_holds_and_shows_it() {
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(2), "wait, one more thing")]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 323 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > wait, one more thing
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn another_agents_rows_are_foreign() {
    check(
        &given(vec![
            message("anna", "D1", &ts(2)).by_user("UBERT", "bert").text("bert, as a user"),
            message("anna", "D1", &ts(3)).by_bot("BBERT", "bert").text("bert, as a bot"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 2, shown 2, omitted 0, cursor 1 -> 3
            notice: 382 bytes
            === not posted yet ===
            2 new messages arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:15:20 UTC] bert <UBERT>
            > bert, as a user
            [#3 2023-11-14 22:16:20 UTC] bert <BBERT>
            > bert, as a bot
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn foreign_then_own_counts_and_shows_only_the_foreign_row_and_passes_the_own_tail() {
    check(
        &given(vec![
            dm_from_human("anna", "D1", &ts(2), "are you there?"),
            confirmed("anna", "D1", &ts(3), "yes, one moment").file("plan.txt", 42),
        ]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 3
            notice: 317 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > are you there?
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn own_then_foreign_counts_and_shows_only_the_foreign_row() {
    check(
        &given(vec![
            confirmed("anna", "D1", &ts(2), "here is my first answer"),
            dm_from_human("anna", "D1", &ts(3), "thanks, and one more question"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 3
            notice: 332 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#3 2023-11-14 22:16:20 UTC] Uma <U1>
            > thanks, and one more question
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn own_only_allows_and_passes_the_own_rows_silently() {
    check(
        &given(vec![
            confirmed("anna", "D1", &ts(2), "part one"),
            message("anna", "D1", &ts(3)).by_bot("BANNA", "anna").text("part two"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 3
        "#]],
    );
}

#[test]
fn own_rows_between_foreign_ones_are_not_counted_or_shown() {
    check(
        &given(vec![
            dm_from_human("anna", "D1", &ts(2), "first"),
            confirmed("anna", "D1", &ts(3), "my reply"),
            dm_from_human("anna", "D1", &ts(4), "second"),
            confirmed("anna", "D1", &ts(5), "my other reply"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 2, shown 2, omitted 0, cursor 1 -> 5
            notice: 356 bytes
            === not posted yet ===
            2 new messages arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > first
            [#4 2023-11-14 22:17:20 UTC] Uma <U1>
            > second
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn a_held_file_says_the_file_was_not_sent() {
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(2), "wait")]),
        send("anna", "D1").post_kind(proto::SendKind::File),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 301 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your file was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > wait
            === what to do ===
            Read what arrived. If your file still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn a_held_question_says_the_question_was_not_sent() {
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(2), "wait")]),
        send("anna", "D1").post_kind(proto::SendKind::Ask),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 309 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your question was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > wait
            === what to do ===
            Read what arrived. If your question still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn a_resend_with_nothing_new_is_allowed() {
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(2), "are you there?"), send("anna", "D1")]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 2 -> 2
        "#]],
    );
}

#[test]
fn a_resend_after_something_new_is_held_again() {
    check(
        &given(vec![
            dm_from_human("anna", "D1", &ts(2), "are you there?"),
            send("anna", "D1"),
            dm_from_human("anna", "D1", &ts(3), "never mind"),
        ]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 2 -> 3
            notice: 313 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#3 2023-11-14 22:16:20 UTC] Uma <U1>
            > never mind
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn twenty_five_foreign_rows_show_the_newest_twenty() {
    let flood = (2..=26).map(|minute| dm_from_human("anna", "D1", &ts(minute), &format!("line {minute}"))).collect();
    check(
        &given(flood),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 25, shown 20, omitted 5, cursor 1 -> 26
            notice: 1303 bytes
            === not posted yet ===
            25 new messages arrived in this conversation since you last looked, so your message was not sent.
            The 5 older ones are not shown; the newest follow, oldest first.
            [#7 2023-11-14 22:20:20 UTC] Uma <U1>
            > line 7
            [#8 2023-11-14 22:21:20 UTC] Uma <U1>
            > line 8
            [#9 2023-11-14 22:22:20 UTC] Uma <U1>
            > line 9
            [#10 2023-11-14 22:23:20 UTC] Uma <U1>
            > line 10
            [#11 2023-11-14 22:24:20 UTC] Uma <U1>
            > line 11
            [#12 2023-11-14 22:25:20 UTC] Uma <U1>
            > line 12
            [#13 2023-11-14 22:26:20 UTC] Uma <U1>
            > line 13
            [#14 2023-11-14 22:27:20 UTC] Uma <U1>
            > line 14
            [#15 2023-11-14 22:28:20 UTC] Uma <U1>
            > line 15
            [#16 2023-11-14 22:29:20 UTC] Uma <U1>
            > line 16
            [#17 2023-11-14 22:30:20 UTC] Uma <U1>
            > line 17
            [#18 2023-11-14 22:31:20 UTC] Uma <U1>
            > line 18
            [#19 2023-11-14 22:32:20 UTC] Uma <U1>
            > line 19
            [#20 2023-11-14 22:33:20 UTC] Uma <U1>
            > line 20
            [#21 2023-11-14 22:34:20 UTC] Uma <U1>
            > line 21
            [#22 2023-11-14 22:35:20 UTC] Uma <U1>
            > line 22
            [#23 2023-11-14 22:36:20 UTC] Uma <U1>
            > line 23
            [#24 2023-11-14 22:37:20 UTC] Uma <U1>
            > line 24
            [#25 2023-11-14 22:38:20 UTC] Uma <U1>
            > line 25
            [#26 2023-11-14 22:39:20 UTC] Uma <U1>
            > line 26
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn large_rows_are_limited_by_the_byte_budget() {
    let large =
        (2..=6).map(|minute| dm_from_human("anna", "D1", &ts(minute), &format!("{minute}").repeat(5_000))).collect();
    check(
        &given(large),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 5, shown 3, omitted 2, cursor 1 -> 6
            notice: 15451 bytes
            === not posted yet ===
            5 new messages arrived in this conversation since you last looked, so your message was not sent.
            The 2 older ones are not shown; the newest follow, oldest first.
            [#4 2023-11-14 22:17:20 UTC] Uma <U1>
            > 4444444444444444444444444444444444444444444444444444444444... [4942 more bytes]
            [#5 2023-11-14 22:18:20 UTC] Uma <U1>
            > 5555555555555555555555555555555555555555555555555555555555... [4942 more bytes]
            [#6 2023-11-14 22:19:20 UTC] Uma <U1>
            > 6666666666666666666666666666666666666666666666666666666666... [4942 more bytes]
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn clipped_rows_with_many_files_stay_within_the_budget() {
    let mut heavy = Vec::new();
    for minute in 2..=5 {
        let mut row = dm_from_human("anna", "D1", &ts(minute), &"é".repeat(20_000));
        for n in 0..12 {
            row = row.file(&format!("{n}-{}", "f".repeat(300)), 1);
        }
        heavy.push(row);
    }
    check(
        &given(heavy),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 4, shown 1, omitted 3, cursor 1 -> 5
            notice: 8685 bytes
            === not posted yet ===
            4 new messages arrived in this conversation since you last looked, so your message was not sent.
            The 3 older ones are not shown; the newest follow, oldest first.
            [#5 2023-11-14 22:18:20 UTC] Uma <U1>
            > ééééééééééééééééééééééééééééé... [5940 more bytes]
            > [... clipped: 34002 more bytes of this message not shown]
            > [file: 0-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 1-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 2-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 3-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 4-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 5-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 6-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 7-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 8-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [file: 9-fffffffffffffffffffffffffffffffffffffffffffffffff... [162 more bytes]
            > [2 more files not listed]
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

/// A message of many short lines: each fenced line costs two bytes of `> ` on top of its escaped
/// text. Such rows must neither break the notice's budget nor crowd out every row: a message is
/// clipped at 6,000 bytes, so the newest row always fits a 16,384-byte notice.
#[test]
fn rows_of_many_short_lines_are_clipped_to_fit() {
    let lines =
        (2..=4).map(|minute| dm_from_human("anna", "D1", &ts(minute), &format!("{}x", "\n".repeat(5_999)))).collect();
    let mut log = TestLog::with(&given(lines));
    let seq = log.fold(send("anna", "D1"));
    let described = describe(&log, seq);
    assert!(described.starts_with("held on slack:T1:D1: new 3, shown "), "{described}");
    assert!(!described.contains("shown 0"), "the newest row did not fit although it is clipped:\n{described}");
}

#[test]
fn log_order_decides_not_ts() {
    // Ts 0 is older than the row anna's cursor covers, but it arrived after it in the log.
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(0), "sent earlier, delivered late")]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 331 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:13:20 UTC] Uma <U1>
            > sent earlier, delivered late
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn a_foreign_row_in_a_thread_does_not_hold_the_top_level() {
    check(
        &given(vec![dm_from_human("anna", "D1", &ts(2), "in the thread").in_thread(&ts(1))]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 1
        "#]],
    );
}

#[test]
fn a_thread_without_a_cursor_allows_whatever_the_top_level_holds() {
    check(
        &given(vec![
            dm_from_human("anna", "D1", &ts(2), "in the thread").in_thread(&ts(1)),
            dm_from_human("anna", "D1", &ts(3), "on the top level"),
        ]),
        send("anna", "D1").in_thread(&ts(1)),
        expect![[r#"
            allowed on slack:T1:D1:thread:1700000060.000100: cursor - -> -
        "#]],
    );
}

#[test]
fn a_thread_cursor_holds_for_the_thread_only() {
    let thread_wake = vec![
        agent("anna", "UANNA", "BANNA"),
        dm_from_human("anna", "D1", &ts(1), "parent"),
        dm_from_human("anna", "D1", &ts(2), "first reply").in_thread(&ts(1)),
        // The parent's wake settles first, then the thread reply's wake moves the thread cursor.
        claim("anna", "w1"),
        start("anna", "w1"),
        finish("anna", "w1", proto::WakeOutcome::Completed),
        claim("anna", "w1"),
        start("anna", "w1"),
        finish("anna", "w1", proto::WakeOutcome::Completed),
        dm_from_human("anna", "D1", &ts(3), "second reply").in_thread(&ts(1)),
        dm_from_human("anna", "D1", &ts(4), "on the top level"),
    ];
    let log = TestLog::with(&thread_wake);
    assert_eq!(log.cursors("anna"), "slack:T1:D1@1, slack:T1:D1:thread:1700000060.000100@1");
    check(
        &thread_wake,
        send("anna", "D1").in_thread(&ts(1)),
        expect![[r#"
            held on slack:T1:D1:thread:1700000060.000100: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 315 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:16:20 UTC] Uma <U1>
            > second reply
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn a_message_just_before_the_send_in_the_log_is_seen() {
    // The first send was allowed; the message lands between the two sends in the log: whatever
    // the instance, the second send is judged after it.
    check(
        &given(vec![send("anna", "D1"), dm_from_human("anna", "D1", &ts(2), "stop!")]),
        send("anna", "D1"),
        expect![[r#"
            held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
            notice: 308 bytes
            === not posted yet ===
            1 new message arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:15:20 UTC] Uma <U1>
            > stop!
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
        "#]],
    );
}

#[test]
fn the_notice_shows_nothing_from_other_surfaces() {
    let mut log = TestLog::with(&given(vec![
        message("anna", "C1", &ts(2)).by_user("U2", "Vic").text("MARKER-CHANNEL"),
        dm_from_human("anna", "D1", &ts(3), "MARKER-THREAD").in_thread(&ts(1)),
        dm_from_human("anna", "D2", &ts(4), "MARKER-OTHER-DM"),
        dm_from_human("anna", "D1", &ts(6), "the only new row here"),
    ]));
    let seq = log.fold(send("anna", "D1"));
    let described = describe(&log, seq);
    assert!(!described.contains("MARKER"), "{described}");
    expect![[r#"
        held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
        notice: 324 bytes
        === not posted yet ===
        1 new message arrived in this conversation since you last looked, so your message was not sent.
        [#2 2023-11-14 22:19:20 UTC] Uma <U1>
        > the only new row here
        === what to do ===
        Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
    "#]]
    .assert_eq(&described);
}

#[test]
fn a_forged_plan_cannot_push_a_cursor_beyond_the_tail() {
    // Fail closed: a cursor beyond the tail could only come from a start plan the claim did not
    // prepare. The fold refuses that plan; the next send is judged from an intact cursor.
    let mut log = TestLog::with(&given(vec![dm_from_human("anna", "D1", &ts(2), "next"), claim("anna", "w1")]));
    let item = log.state.queue("anna").and_then(|q| q.active.as_ref()).map(|a| a.item.id.clone()).unwrap();
    let forged = log.fold(start_with_plan("anna", "w1", &item, vec![plan_surface("slack:T1:D1", Some(1), 99)]));
    let Verdict::Refused(refusal) = log.verdict(forged) else { panic!("a forged plan started") };
    assert_eq!(
        describe_refusal(refusal),
        "refused InvalidArgument: plan: differs from the one the claim prepared; hand it back unchanged"
    );
    assert_eq!(log.cursors("anna"), "slack:T1:D1@1");
    let seq = log.fold(send("anna", "D1"));
    expect![[r#"
        held on slack:T1:D1: new 1, shown 1, omitted 0, cursor 1 -> 2
        notice: 307 bytes
        === not posted yet ===
        1 new message arrived in this conversation since you last looked, so your message was not sent.
        [#2 2023-11-14 22:15:20 UTC] Uma <U1>
        > next
        === what to do ===
        Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.
    "#]]
    .assert_eq(&describe(&log, seq));
}

#[test]
fn an_event_this_fold_cannot_read_stops_all_deciding() {
    // An old instance must never allow a send because it skipped an event that moved a cursor.
    let from_the_future = Envelope {
        event_id: "future".to_owned(),
        occurred_at_ms: 0,
        min_reader_version: 2,
        source: "engine".to_owned(),
        payload: None,
    };
    check(
        &given(vec![from_the_future]),
        send("anna", "D1"),
        expect![[r#"
            no verdict: the fold stopped deciding at seq 7: event future needs reader version 2 (this fold reads 1); upgrade this instance
        "#]],
    );
}

#[test]
fn an_event_that_does_not_decode_stops_all_deciding() {
    let mut log = TestLog::with(&anna_read_her_dm());
    log.state.apply_bytes(LogPosition { seq: 7, at_ns: 0 }, &[0xff, 0xff, 0xff]);
    log.state.apply(LogPosition { seq: 8, at_ns: 0 }, &send("anna", "D1"));
    assert_eq!(log.state.verdict(8), None);
    assert_eq!(log.state.halted_at_or_before(8).map(|h| h.seq), Some(7));
}

#[test]
fn an_unknown_payload_this_fold_may_skip_is_skipped() {
    let skippable = Envelope { event_id: "old-news".to_owned(), min_reader_version: 1, ..Default::default() };
    check(
        &given(vec![skippable]),
        send("anna", "D1"),
        expect![[r#"
            allowed on slack:T1:D1: cursor 1 -> 1
        "#]],
    );
}

#[test]
fn a_send_of_an_unknown_agent_or_without_target_is_refused() {
    check(
        &anna_read_her_dm(),
        send("zoe", "D1"),
        expect![[r#"
            refused InvalidArgument: agent "zoe" is not registered
        "#]],
    );
    let mut untargeted = send("anna", "D1");
    if let Some(Payload::Send(s)) = untargeted.payload.as_mut() {
        s.target = None;
    }
    check(
        &anna_read_her_dm(),
        untargeted,
        expect![[r#"
            refused InvalidArgument: target is missing
        "#]],
    );
}

#[test]
fn the_notice_frame_never_says_blocked_rejected_or_failed() {
    for kind in PostKind::ALL {
        for new_messages in [1, 2, 25, u64::MAX] {
            for omitted in [0, 1, 5] {
                let notice = text::render_held_notice("anna", kind, new_messages, omitted, &[]).to_lowercase();
                for word in WORDS_NEVER_IN_A_NOTICE {
                    assert!(!notice.contains(word), "{notice}");
                }
                assert!(notice.contains("send it again unchanged and it will be posted"));
                assert!(notice.contains(&format!("your {} was not sent", kind.noun())), "{notice}");
                assert!(notice.len() <= text::held_frame_bytes_max(), "the frame bound is an upper bound");
            }
        }
    }
}
