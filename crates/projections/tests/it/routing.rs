//! Routing, subscriptions and mute suggestions, decided by the fold for every
//! observation and receiving agent. `check` folds `given`, then `when` (a message), and shows how
//! it was routed, the wake's note if it got one, and the agent's subscriptions after it.

use std::fmt::Write;
use std::time::Duration;

use anima_projections::proto::{envelope::Payload, Envelope};
use anima_projections::subscription::Route;
use anima_projections::text;
use anima_projections::verdict::Verdict;
use expect_test::{expect, Expect};

use crate::events::*;
use crate::log::TestLog;

fn ada() -> Envelope {
    agent("ada", "U0ADA", "B0ADA")
}

/// A person's top-level post in channel C1.
fn channel_post(ts_: &str, text: &str) -> Envelope {
    message("ada", "C1", ts_).by_user("U1", "Uma").text(text)
}

fn thread_reply(thread: &str, ts_: &str, text: &str) -> Envelope {
    message("ada", "C1", ts_).by_user("U1", "Uma").text(text).in_thread(thread)
}

fn describe(log: &TestLog, seq: u64) -> String {
    let mut out = String::new();
    match log.verdict(seq) {
        Verdict::Journaled(j) => {
            let route = match j.route {
                Some(Route::Wake(reason)) => format!("wake {}", reason.as_str()),
                Some(Route::Ignored(reason)) => format!("ignored {}", reason.as_str()),
                None => "not routed".into(),
            };
            writeln!(out, "#{} {route}{}", j.ordinal, if j.wake.is_some() { ", queued" } else { "" }).unwrap();
        }
        other => writeln!(out, "{other:?}").unwrap(),
    }
    if let Some(queue) = log.state.queue("ada") {
        if let Some(item) = queue.queued().next_back() {
            writeln!(out, "newest queued: {} reply_to {}", item.reason.as_str(), item.reply_to).unwrap();
            if let Some(note) = &item.note {
                let mut text = String::new();
                text::put_attention_note(&mut text, note);
                out.push_str(&text);
            }
        }
    }
    for (surface, s) in log.state.subscriptions_of("ada") {
        writeln!(
            out,
            "{surface}: member {} following {} muted {} wakes_since_post {}",
            s.member, s.following, s.muted, s.attention.wakes_since_post
        )
        .unwrap();
    }
    out
}

#[track_caller]
fn check(given: &[Envelope], when: Envelope, expect: Expect) {
    let mut log = TestLog::with(given);
    let seq = log.fold(when);
    expect.assert_eq(&describe(&log, seq));
}

fn at_minutes(event: Envelope, minutes: u64) -> Envelope {
    event.occurred_after(Duration::from_secs(minutes * 60))
}

#[test]
fn a_channel_top_level_post_wakes_channel_follow_and_answers_in_its_thread() {
    check(
        &[ada()],
        channel_post(&ts(1), "anyone around?"),
        expect![[r#"
            #1 wake channel_follow, queued
            newest queued: channel_follow reply_to slack:T1:C1:thread:1700000060.000100
            slack:T1:C1: member true following false muted false wakes_since_post 1
        "#]],
    );
}

#[test]
fn a_bots_top_level_post_is_ignored_but_journaled() {
    check(
        &[ada()],
        message("ada", "C1", &ts(1)).by_bot("B9", "Deploy bot").text("deployed"),
        expect![[r#"
        #1 ignored not_addressed
        slack:T1:C1: member true following false muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn a_thread_reply_without_a_follow_is_not_addressed() {
    check(
        &[ada(), channel_post(&ts(1), "root")],
        thread_reply(&ts(1), &ts(2), "reply"),
        expect![[r#"
        #1 ignored not_addressed
        newest queued: channel_follow reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 1
    "#]],
    );
}

#[test]
fn a_mention_wakes_and_follows_the_thread_so_replies_wake_too() {
    let mention = channel_post(&ts(1), "hey <@U0ADA> can you look?");
    check(
        &[ada(), mention],
        thread_reply(&ts(1), &ts(2), "details here"),
        expect![[r#"
        #1 wake thread_follow, queued
        newest queued: thread_follow reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 1
    "#]],
    );
}

#[test]
fn a_mention_inside_code_is_not_a_mention() {
    check(
        &[ada()],
        thread_reply(&ts(1), &ts(2), "see `<@U0ADA>` and ```\n<@U0ADA>\n```"),
        expect![[r#"
        #1 ignored not_addressed
        slack:T1:C1: member true following false muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn app_mention_delivery_is_a_mention() {
    check(
        &[ada()],
        thread_reply(&ts(1), &ts(2), "please check").app_mention(),
        expect![[r#"
        #1 wake mention, queued
        newest queued: mention reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn a_mention_in_a_muted_thread_wakes_and_unmutes_the_thread() {
    let given = [ada(), channel_post(&ts(1), "hi <@U0ADA>"), mute("ada", "C1", Some(&ts(1)), true)];
    check(
        &given,
        thread_reply(&ts(1), &ts(3), "<@U0ADA> again"),
        expect![[r#"
        #1 wake mention, queued
        newest queued: mention reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn a_mention_in_a_muted_channel_wakes_but_the_channel_stays_muted() {
    let given = [ada(), channel_post(&ts(1), "hello"), mute("ada", "C1", None, true)];
    check(
        &given,
        channel_post(&ts(2), "<@U0ADA> urgent"),
        expect![[r#"
        #2 wake mention, queued
        newest queued: mention reply_to slack:T1:C1:thread:1700000120.000100
        slack:T1:C1: member true following false muted true wakes_since_post 1
        slack:T1:C1:thread:1700000120.000100: member false following true muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn a_muted_channel_ignores_top_level_posts() {
    let given = [ada(), channel_post(&ts(1), "hello"), mute("ada", "C1", None, true)];
    check(
        &given,
        channel_post(&ts(2), "more chatter"),
        expect![[r#"
        #2 ignored muted
        newest queued: channel_follow reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted true wakes_since_post 1
    "#]],
    );
}

#[test]
fn bots_do_not_create_a_follow_but_their_replies_in_followed_threads_wake() {
    let given = [ada(), channel_post(&ts(1), "hi <@U0ADA>")];
    let bot_reply = message("ada", "C1", &ts(2)).by_user("U9", "Bot user").text("build passed").in_thread(&ts(1));
    let mut bot_reply = bot_reply;
    if let Some(Payload::SlackMessage(m)) = bot_reply.payload.as_mut() {
        m.bot_id = "B9".into();
    }
    check(
        &given,
        bot_reply,
        expect![[r#"
        #1 wake thread_follow, queued
        newest queued: thread_follow reply_to slack:T1:C1:thread:1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 1
    "#]],
    );
}

#[test]
fn the_sixth_channel_follow_wake_within_an_hour_carries_the_mute_note() {
    let mut given = vec![ada()];
    for n in 1..=5 {
        given.push(at_minutes(channel_post(&ts(n), &format!("chatter {n}")), n));
    }
    check(
        &given,
        at_minutes(channel_post(&ts(6), "chatter 6"), 6),
        expect![[r#"
        #6 wake channel_follow, queued
        newest queued: channel_follow reply_to slack:T1:C1:thread:1700000360.000100
        [anima] this channel woke you 6 times within the last hour and you have not posted there. If it does not need you, mute it: anima subscription mute --channel C1
        slack:T1:C1: member true following false muted false wakes_since_post 6
    "#]],
    );
}

#[test]
fn after_the_agent_posts_the_next_wake_has_no_note() {
    let mut given = vec![ada()];
    for n in 1..=6 {
        given.push(at_minutes(channel_post(&ts(n), &format!("chatter {n}")), n));
    }
    given.push(at_minutes(confirmed("ada", "C1", &ts(7), "on it"), 7));
    check(
        &given,
        at_minutes(channel_post(&ts(8), "chatter 8"), 8),
        expect![[r#"
        #8 wake channel_follow, queued
        newest queued: channel_follow reply_to slack:T1:C1:thread:1700000480.000100
        slack:T1:C1: member true following false muted false wakes_since_post 1
        slack:T1:C1:thread:1700000420.000100: member false following true muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn twelve_thread_wakes_over_three_days_carry_the_chronic_note_once() {
    let mut given = vec![ada(), at_minutes(channel_post(&ts(1), "<@U0ADA> please watch this"), 0)];
    // Eleven replies, one every seven hours: never six within an hour.
    for n in 0..11u64 {
        given.push(at_minutes(thread_reply(&ts(1), &ts(10 + n), &format!("update {n}")), 60 + n * 420));
    }
    check(
        &given,
        at_minutes(thread_reply(&ts(1), &ts(30), "update 11"), 60 + 11 * 420),
        expect![[r#"
        #12 wake thread_follow, queued
        newest queued: thread_follow reply_to slack:T1:C1:thread:1700000060.000100
        [anima] this thread woke you 12 times over three days or more since you last posted there. If it does not need you, mute it: anima subscription mute --channel C1 --thread-ts 1700000060.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 12
    "#]],
    );
}

#[test]
fn dms_and_mentions_never_count_toward_notes() {
    let mut given = vec![ada()];
    for n in 1..=7 {
        given.push(at_minutes(channel_post(&ts(n), &format!("<@U0ADA> ping {n}")), n));
    }
    check(
        &given,
        at_minutes(channel_post(&ts(8), "<@U0ADA> ping 8"), 8),
        expect![[r#"
        #8 wake mention, queued
        newest queued: mention reply_to slack:T1:C1:thread:1700000480.000100
        slack:T1:C1: member true following false muted false wakes_since_post 0
        slack:T1:C1:thread:1700000060.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000120.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000180.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000240.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000300.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000360.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000420.000100: member false following true muted false wakes_since_post 0
        slack:T1:C1:thread:1700000480.000100: member false following true muted false wakes_since_post 0
    "#]],
    );
}

#[test]
fn unmuting_what_is_not_muted_is_refused_naming_the_target() {
    let mut log = TestLog::with(&[ada()]);
    let seq = log.fold(mute("ada", "C1", Some(&ts(1)), false));
    expect![[r#"
        Refused(Refusal { kind: FailedPrecondition, message: "slack:T1:C1:thread:1700000060.000100 is not muted; nothing to unmute" })
    "#]].assert_eq(&describe(&log, seq));
}
