//! The generic chat platform: chats `chat:{tenant}:{chat}` and their
//! threads get journals, cursors, holds, routing and mute notes like Slack; p2p chats behave like
//! DMs. `check` folds `given`, then `when`, and shows the verdict — a routing, a claim with its plan
//! and wake text, a send with its notice, a mute — then the agent's newest queued wake (with its
//! note), subscriptions and cursors.

use std::fmt::Write;
use std::time::Duration;

use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::render;
use anima_projections::subscription::Route;
use anima_projections::text::{self, TEXT_BYTES_MAX};
use anima_projections::verdict::{ClaimVerdict, SendVerdict, Verdict};
use expect_test::{expect, Expect};

use crate::events::*;
use crate::log::{describe_cursor, describe_plan, describe_refusal, TestLog};

const TENANT: &str = "t1";

/// ada's chat user id: rows by it are ada's own; mentions of it mention ada.
const ADA_CHAT_USER: &str = "ou_ada";

fn ada() -> Envelope {
    chat_agent("ada", ADA_CHAT_USER)
}

fn chat_agent(agent_id: &str, chat_user_id: &str) -> Envelope {
    let mut registration = agent(agent_id, "", "");
    if let Some(Payload::AgentRegistered(r)) = registration.payload.as_mut() {
        r.chat_user_id = chat_user_id.to_owned();
    }
    registration
}

/// A chat message delivered to ada, written by the person Uma (`ou_uma`).
fn chat_message(kind: proto::ChatKind, chat: &str, message_id: &str, text: &str) -> Envelope {
    Envelope {
        event_id: format!("chat:{TENANT}:{chat}:{message_id}:ada"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::ChatMessage(proto::ChatMessageObserved {
            receiving_agent_id: "ada".to_owned(),
            tenant_id: TENANT.to_owned(),
            chat_id: chat.to_owned(),
            chat_kind: kind as i32,
            message_id: message_id.to_owned(),
            sender_id: "ou_uma".to_owned(),
            sender_name: "Uma".to_owned(),
            text: text.to_owned(),
            ..Default::default()
        })),
    }
}

/// A message in ada's p2p chat `p1`.
fn p2p(message_id: &str, text: &str) -> Envelope {
    chat_message(proto::ChatKind::P2p, "p1", message_id, text)
}

/// A message at the top level of group chat `g1`.
fn group(message_id: &str, text: &str) -> Envelope {
    chat_message(proto::ChatKind::Group, "g1", message_id, text)
}

/// Refinements of a chat message.
trait ChatExt {
    fn in_chat_thread(self, thread_id: &str) -> Self;
    fn sent_by(self, sender_id: &str, name: &str) -> Self;
    fn sent_by_bot(self, sender_id: &str, name: &str) -> Self;
    fn mentioning(self, user_id: &str) -> Self;
    fn at_minute(self, minute: u64) -> Self;
}

fn observed(envelope: &mut Envelope) -> &mut proto::ChatMessageObserved {
    match envelope.payload.as_mut() {
        Some(Payload::ChatMessage(m)) => m,
        other => panic!("not a chat message: {other:?}"),
    }
}

impl ChatExt for Envelope {
    fn in_chat_thread(mut self, thread_id: &str) -> Self {
        observed(&mut self).thread_id = thread_id.to_owned();
        self
    }

    fn sent_by(mut self, sender_id: &str, name: &str) -> Self {
        let m = observed(&mut self);
        m.sender_id = sender_id.to_owned();
        m.sender_name = name.to_owned();
        self
    }

    fn sent_by_bot(self, sender_id: &str, name: &str) -> Self {
        let mut message = self.sent_by(sender_id, name);
        observed(&mut message).sender_is_bot = true;
        message
    }

    fn mentioning(mut self, user_id: &str) -> Self {
        observed(&mut self).mentioned_user_ids.push(user_id.to_owned());
        self
    }

    fn at_minute(self, minute: u64) -> Self {
        self.occurred_after(Duration::from_secs(minute * 60))
    }
}

fn chat_target(chat: &str, thread: &str) -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Chat(proto::ChatTarget {
            tenant_id: TENANT.to_owned(),
            chat_id: chat.to_owned(),
            thread_id: thread.to_owned(),
        })),
    }
}

/// ada asks before posting to a chat (thread empty: its top level).
fn send_to_chat(chat: &str, thread: &str) -> Envelope {
    Envelope {
        event_id: format!("send:ada:{chat}:{thread}"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::Send(proto::SendRequested {
            agent_id: "ada".to_owned(),
            target: Some(chat_target(chat, thread)),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 5,
            mentioned_user_ids: Vec::new(),
        })),
    }
}

/// ada's post to a chat, confirmed with the message id the platform gave it.
fn confirmed_in_chat(chat: &str, thread: &str, message_id: &str, text: &str) -> Envelope {
    Envelope {
        event_id: format!("confirmed:ada:{chat}:{message_id}"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::SendConfirmed(proto::SendConfirmed {
            agent_id: "ada".to_owned(),
            target: Some(chat_target(chat, thread)),
            kind: proto::SendKind::Message as i32,
            ts: message_id.to_owned(),
            text: text.to_owned(),
            files: Vec::new(),
            send_event_id: String::new(),
        })),
    }
}

fn mute_chat(chat: &str, thread: &str, muted: bool) -> Envelope {
    Envelope {
        event_id: format!("mute:{chat}:{thread}:{muted}"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::SubscriptionChange(proto::SubscriptionChangeRequested {
            agent_id: "ada".to_owned(),
            target: None,
            mute: muted,
            chat_target: Some(proto::ChatTarget {
                tenant_id: TENANT.to_owned(),
                chat_id: chat.to_owned(),
                thread_id: thread.to_owned(),
            }),
        })),
    }
}

#[track_caller]
fn check(given: &[Envelope], when: Envelope, expect: Expect) {
    let mut log = TestLog::with(given);
    let seq = log.fold(when);
    let mut out = describe_verdict(&log, seq);
    out.push_str("--- after ---\n");
    out.push_str(&describe_ada(&log));
    expect.assert_eq(&out);
}

fn describe_verdict(log: &TestLog, seq: u64) -> String {
    let mut out = String::new();
    match log.verdict(seq) {
        Verdict::Journaled(j) => {
            let route = match j.route {
                Some(Route::Wake(reason)) => format!("wake {}", reason.as_str()),
                Some(Route::Ignored(reason)) => format!("ignored {}", reason.as_str()),
                None => "not routed".into(),
            };
            let surface = j.surface.as_ref().map_or_else(|| "-".to_owned(), ToString::to_string);
            writeln!(
                out,
                "{surface} #{}{} {route}{}",
                j.ordinal,
                if j.duplicate_message { " (duplicate)" } else { "" },
                if j.wake.is_some() { ", queued" } else { "" }
            )
            .unwrap();
        }
        Verdict::Claim(ClaimVerdict::Claimed(claimed)) => {
            let trigger_body = log.body(claimed.item.trigger.seq);
            let bodies = log.with_bodies(&claimed.rows);
            let rows: Vec<_> = bodies.iter().map(|(meta, body)| (*meta, body)).collect();
            let text = render::render_wake_text("ada", claimed, &trigger_body, &rows);
            assert!(text.len() <= TEXT_BYTES_MAX);
            writeln!(out, "claimed {} ({})", claimed.item.id, claimed.item.reason.as_str()).unwrap();
            writeln!(out, "plan: {}", describe_plan(&claimed.plan)).unwrap();
            writeln!(out, "--- wake text ---\n{text}--- end ---").unwrap();
        }
        Verdict::Send(SendVerdict::Allowed { surface, cursor_before, cursor_after }) => {
            writeln!(
                out,
                "allowed on {surface}: cursor {} -> {}",
                describe_cursor(*cursor_before),
                describe_cursor(*cursor_after)
            )
            .unwrap();
        }
        Verdict::Send(SendVerdict::Held(held)) => {
            let bodies = log.with_bodies(&held.shown);
            let rows: Vec<_> = bodies.iter().map(|(meta, body)| (*meta, body)).collect();
            let notice = text::render_held_notice("ada", held.kind, held.new_messages, held.omitted, &rows);
            writeln!(
                out,
                "held on {}: new {}, shown {}, cursor {} -> {}\n{notice}",
                held.surface,
                held.new_messages,
                held.shown.len(),
                held.cursor_before,
                held.tail
            )
            .unwrap();
        }
        Verdict::Refused(refusal) => writeln!(out, "{}", describe_refusal(refusal)).unwrap(),
        other => writeln!(out, "{other:?}").unwrap(),
    }
    out
}

fn describe_ada(log: &TestLog) -> String {
    let mut out = String::new();
    if let Some(item) = log.state.queue("ada").and_then(|q| q.queued().next_back()) {
        writeln!(out, "newest queued: {} {} reply_to {}", item.id, item.reason.as_str(), item.reply_to).unwrap();
        if let Some(note) = &item.note {
            text::put_attention_note(&mut out, note);
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
    writeln!(out, "cursors: {}", log.cursors("ada")).unwrap();
    out
}

#[test]
fn a_p2p_message_wakes_dm_and_is_answered_in_the_chat() {
    check(
        &[ada(), p2p("om_1", "can you check the deploy?")],
        claim("ada", "w1"),
        expect![[r#"
            claimed chat:t1:p1:om_1 (dm)
            plan: chat:t1:p1 absent -> @1
            --- wake text ---
            === anima wake ===
            === conversation update ===
            (nothing else is new)
            === latest wake ===
            reason: dm
            chat_id: p1
            thread_id: -
            message_id: om_1
            time: 2023-11-14 22:13:21 UTC
            user: Uma <ou_uma>
            > can you check the deploy?
            === reply ===
            reply_to: chat tenant=t1 chat_id=p1 (top level)
            --- end ---
            --- after ---
            cursors: none
        "#]],
    );
}

#[test]
fn a_p2p_thread_reply_wakes_dm_in_its_thread_without_follows() {
    check(
        &[ada()],
        p2p("om_2", "about that").in_chat_thread("om_1"),
        expect![[r#"
        chat:t1:p1:thread:om_1 #1 wake dm, queued
        --- after ---
        newest queued: chat:t1:p1:om_2 dm reply_to chat:t1:p1:thread:om_1
        cursors: none
    "#]],
    );
}

#[test]
fn a_group_top_level_message_wakes_channel_follow_answering_in_its_thread() {
    let given = [ada(), group("om_1", "who can review the release notes?")];
    check(
        &given,
        claim("ada", "w1"),
        expect![[r#"
        claimed chat:t1:g1:om_1 (channel_follow)
        plan: chat:t1:g1 absent -> @1; chat:t1:g1:thread:om_1 absent -> @0
        --- wake text ---
        === anima wake ===
        === conversation update ===
        (nothing else is new)
        === latest wake ===
        reason: channel_follow
        chat_id: g1
        thread_id: -
        message_id: om_1
        time: 2023-11-14 22:13:21 UTC
        user: Uma <ou_uma>
        > who can review the release notes?
        === reply ===
        reply_to: chat tenant=t1 chat_id=g1 thread_id=om_1
        --- end ---
        --- after ---
        chat:t1:g1: member true following false muted false wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn the_same_chat_message_delivered_twice_is_one_row_and_one_wake() {
    check(
        &[ada(), group("om_1", "hello")],
        group("om_1", "hello"),
        expect![[r#"
        chat:t1:g1 #1 (duplicate) wake channel_follow
        --- after ---
        newest queued: chat:t1:g1:om_1 channel_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted false wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn a_bots_top_level_group_message_is_journaled_but_wakes_nobody() {
    check(
        &[ada()],
        group("om_1", "deployed").sent_by_bot("ou_ci", "CI"),
        expect![[r#"
        chat:t1:g1 #1 ignored not_addressed
        --- after ---
        chat:t1:g1: member true following false muted false wakes_since_post 0
        cursors: none
    "#]],
    );
}

#[test]
fn a_muted_group_chat_ignores_top_level_messages() {
    let given = [ada(), group("om_1", "hello"), mute_chat("g1", "", true)];
    check(
        &given,
        group("om_2", "more chatter"),
        expect![[r#"
        chat:t1:g1 #2 ignored muted
        --- after ---
        newest queued: chat:t1:g1:om_1 channel_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted true wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn a_mention_in_a_muted_chat_wakes_but_does_not_unmute_the_chat() {
    let given = [ada(), group("om_1", "hello"), mute_chat("g1", "", true)];
    check(
        &given,
        group("om_2", "@ada urgent").mentioning(ADA_CHAT_USER),
        expect![[r#"
        chat:t1:g1 #2 wake mention, queued
        --- after ---
        newest queued: chat:t1:g1:om_2 mention reply_to chat:t1:g1:thread:om_2
        chat:t1:g1: member true following false muted true wakes_since_post 1
        chat:t1:g1:thread:om_2: member false following true muted false wakes_since_post 0
        cursors: none
    "#]],
    );
}

#[test]
fn mentions_of_someone_else_do_not_address_the_agent() {
    let given = [ada(), group("om_1", "hello"), mute_chat("g1", "", true)];
    check(
        &given,
        group("om_2", "@bob look").mentioning("ou_bob"),
        expect![[r#"
        chat:t1:g1 #2 ignored muted
        --- after ---
        newest queued: chat:t1:g1:om_1 channel_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted true wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn a_thread_reply_without_a_follow_is_not_addressed() {
    check(
        &[ada(), group("om_1", "root")],
        group("om_2", "reply").in_chat_thread("om_1"),
        expect![[r#"
        chat:t1:g1:thread:om_1 #1 ignored not_addressed
        --- after ---
        newest queued: chat:t1:g1:om_1 channel_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted false wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn a_mention_follows_the_thread_so_replies_wake_thread_follow() {
    let given = [ada(), group("om_1", "@ada can you look?").mentioning(ADA_CHAT_USER)];
    check(
        &given,
        group("om_2", "details here").in_chat_thread("om_1"),
        expect![[r#"
        chat:t1:g1:thread:om_1 #1 wake thread_follow, queued
        --- after ---
        newest queued: chat:t1:g1:om_2 thread_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted false wakes_since_post 0
        chat:t1:g1:thread:om_1: member false following true muted false wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn a_confirmed_post_in_a_thread_follows_it() {
    let given = [ada(), group("om_1", "root"), confirmed_in_chat("g1", "om_1", "om_2", "I can help")];
    check(
        &given,
        group("om_3", "thanks").in_chat_thread("om_1"),
        expect![[r#"
        chat:t1:g1:thread:om_1 #2 wake thread_follow, queued
        --- after ---
        newest queued: chat:t1:g1:om_3 thread_follow reply_to chat:t1:g1:thread:om_1
        chat:t1:g1: member true following false muted false wakes_since_post 1
        chat:t1:g1:thread:om_1: member false following true muted false wakes_since_post 1
        cursors: none
    "#]],
    );
}

#[test]
fn own_rows_are_classified_by_chat_user_id_and_never_wake() {
    check(
        &[ada()],
        p2p("om_1", "note to self").sent_by(ADA_CHAT_USER, "Ada"),
        expect![[r#"
        chat:t1:p1 #1 ignored own
        --- after ---
        cursors: none
    "#]],
    );
}

/// ada read her p2p chat (row 1): claimed, started and finished; her cursor on it is @1.
fn ada_read_her_p2p_chat() -> Vec<Envelope> {
    vec![
        ada(),
        p2p("om_1", "hello ada"),
        claim("ada", "w1"),
        start("ada", "w1"),
        finish("ada", "w1", proto::WakeOutcome::Completed),
    ]
}

#[test]
fn own_rows_after_the_cursor_allow_and_the_cursor_passes_them() {
    let given = [
        ada_read_her_p2p_chat(),
        vec![
            p2p("om_2", "first part").sent_by(ADA_CHAT_USER, "Ada"),
            p2p("om_3", "second part").sent_by(ADA_CHAT_USER, "Ada"),
        ],
    ]
    .concat();
    check(
        &given,
        send_to_chat("p1", ""),
        expect![[r#"
        allowed on chat:t1:p1: cursor 1 -> 3
        --- after ---
        cursors: chat:t1:p1@3
    "#]],
    );
}

#[test]
fn foreign_chat_rows_after_the_cursor_hold_the_send_and_the_resend_posts() {
    let given = [ada_read_her_p2p_chat(), vec![p2p("om_2", "one more thing"), p2p("om_3", "and another")]].concat();
    check(
        &given,
        send_to_chat("p1", ""),
        expect![[r#"
            held on chat:t1:p1: new 2, shown 2, cursor 1 -> 3
            === not posted yet ===
            2 new messages arrived in this conversation since you last looked, so your message was not sent.
            [#2 2023-11-14 22:13:25 UTC] Uma <ou_uma>
            > one more thing
            [#3 2023-11-14 22:13:26 UTC] Uma <ou_uma>
            > and another
            === what to do ===
            Read what arrived. If your message still fits, send it again unchanged and it will be posted; otherwise send a revised one.

            --- after ---
            newest queued: chat:t1:p1:om_3 dm reply_to chat:t1:p1
            cursors: chat:t1:p1@3
        "#]],
    );
    let mut log = TestLog::with(&given);
    log.fold(send_to_chat("p1", ""));
    let resend = log.fold(send_to_chat("p1", ""));
    assert_eq!(describe_verdict(&log, resend), "allowed on chat:t1:p1: cursor 3 -> 3\n");
}

#[test]
fn the_sixth_group_wake_within_an_hour_carries_the_mute_note_with_the_chat_id() {
    let given: Vec<Envelope> =
        [ada()].into_iter().chain((1..=5).map(|n| group(&format!("om_{n}"), "chatter").at_minute(n))).collect();
    check(
        &given,
        group("om_6", "chatter").at_minute(6),
        expect![[r#"
        chat:t1:g1 #6 wake channel_follow, queued
        --- after ---
        newest queued: chat:t1:g1:om_6 channel_follow reply_to chat:t1:g1:thread:om_6
        [anima] this chat woke you 6 times within the last hour and you have not posted there. If it does not need you, mute it: anima subscription mute --chat-id g1
        chat:t1:g1: member true following false muted false wakes_since_post 6
        cursors: none
    "#]],
    );
}

#[test]
fn the_thread_note_names_the_thread_id_and_odd_ids_are_quoted() {
    let chat = "it's:odd";
    let mention = chat_message(proto::ChatKind::Group, chat, "$root", "@ada watch this").mentioning(ADA_CHAT_USER);
    let replies = (1..=6).map(|n| {
        chat_message(proto::ChatKind::Group, chat, &format!("$r{n}"), "update").in_chat_thread("$root").at_minute(n)
    });
    let mut log = TestLog::with(&[ada(), mention]);
    let mut last = 0;
    for reply in replies {
        last = log.fold(reply);
    }
    expect![[r#"
        chat:t1:it's%3Aodd:thread:$root #6 wake thread_follow, queued
        --- after ---
        newest queued: chat:t1:it's%3Aodd:$r6 thread_follow reply_to chat:t1:it's%3Aodd:thread:$root
        [anima] this thread woke you 6 times within the last hour and you have not posted there. If it does not need you, mute it: anima subscription mute --chat-id 'it'\''s:odd' --thread-id '$root'
        chat:t1:it's%3Aodd: member true following false muted false wakes_since_post 0
        chat:t1:it's%3Aodd:thread:$root: member false following true muted false wakes_since_post 6
        cursors: none
    "#]]
    .assert_eq(&(describe_verdict(&log, last) + "--- after ---\n" + &describe_ada(&log)));
}

#[test]
fn a_p2p_chat_cannot_be_muted() {
    check(
        &[ada(), p2p("om_1", "hi")],
        mute_chat("p1", "", true),
        expect![[r#"
        refused InvalidArgument: chat_target: chat:t1:p1 is a p2p chat; p2p chats cannot be muted
        --- after ---
        newest queued: chat:t1:p1:om_1 dm reply_to chat:t1:p1
        cursors: none
    "#]],
    );
}

#[test]
fn a_chat_message_without_a_kind_is_recorded_but_not_journaled() {
    check(
        &[ada()],
        chat_message(proto::ChatKind::Unspecified, "g1", "om_1", "hi"),
        expect![[r#"
        - #0 not routed
        --- after ---
        cursors: none
    "#]],
    );
}

/// Do-not-contact in chats: given the tenant lists Uma, a send into ada's p2p chat with her is
/// refused as listed, a send into the group chat is not (nobody is mentioned), and a chat the
/// fold never saw cannot be verified (only observations say whether a chat is p2p).
#[test]
fn a_p2p_chat_with_a_listed_person_is_not_contacted() {
    let lists: &[(&str, &[&str])] = &[(TENANT, &["ou_uma"])];
    let mut log = TestLog::with(&[ada(), do_not_contact(lists), p2p("om_1", "hi ada"), group("om_2", "hello all")]);
    let decided = |log: &TestLog, seq: u64| match log.verdict(seq) {
        Verdict::Send(SendVerdict::NotContacted(refused)) => {
            format!("not_contacted {} {}", refused.reason.as_str(), refused.user_id.as_deref().unwrap_or("-"))
        }
        Verdict::Send(_) => "decided by the hold".to_owned(),
        other => panic!("not a send: {other:?}"),
    };
    let seq = log.fold(send_to_chat("p1", ""));
    assert_eq!(decided(&log, seq), "not_contacted listed ou_uma");
    let seq = log.fold(send_to_chat("g1", ""));
    assert_eq!(decided(&log, seq), "decided by the hold");
    // A chat the fold never saw a message of may be one-to-one: it cannot be checked.
    let seq = log.fold(send_to_chat("p9", ""));
    assert_eq!(decided(&log, seq), "not_contacted could_not_verify -");
}
