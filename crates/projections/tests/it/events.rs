//! The vocabulary of the tests: builders of stored events (`proto::Envelope`), named after what
//! happened. A message starts as `message(receiver, channel, ts)` and is refined with
//! [`MessageExt`]: who wrote it, what it says, which thread it is in, which files it carries.
//!
//! Wake starts and finishes are usually built with the item and plan left open
//! ([`start`], [`finish`]): the test log fills them in from the agent's active wake in state just
//! before folding, the way a runtime hands back the plan its claim returned.

use std::time::Duration;

use anima_projections::proto::{self, envelope::Payload, Envelope};

pub const TEAM: &str = "T1";

/// Log time of the first event, unix ms (2023-11-14 22:13:20 UTC).
pub const LOG_START_MS: i64 = 1_700_000_000_000;

/// `source` of a start or finish whose item (and plan) the test log takes from state.
pub const FROM_STATE: &str = "test:from-state";

/// `agent` mutes (or unmutes) channel `channel` of [`TEAM`], or one of its threads.
pub fn mute(agent: &str, channel: &str, target_thread: Option<&str>, muted: bool) -> Envelope {
    envelope(
        format!("mute:{agent}:{channel}:{target_thread:?}:{muted}"),
        Payload::SubscriptionChange(proto::SubscriptionChangeRequested {
            agent_id: agent.into(),
            target: Some(proto::SlackTarget {
                team_id: TEAM.into(),
                channel_id: channel.into(),
                thread_ts: target_thread.unwrap_or_default().into(),
            }),
            mute: muted,
            chat_target: None,
        }),
    )
}

/// The Slack ts of the message sent `minute` minutes after 2023-11-14 22:13:20 UTC.
pub fn ts(minute: u64) -> String {
    format!("{}.000100", 1_700_000_000 + minute * 60)
}

fn envelope(event_id: String, payload: Payload) -> Envelope {
    Envelope { event_id, occurred_at_ms: 0, min_reader_version: 1, source: "test".to_owned(), payload: Some(payload) }
}

/// An agent and its Slack identities.
pub fn agent(agent_id: &str, bot_user_id: &str, bot_id: &str) -> Envelope {
    envelope(
        format!("agent:{agent_id}"),
        Payload::AgentRegistered(proto::AgentRegistered {
            agent_id: agent_id.to_owned(),
            slack_bot_user_id: bot_user_id.to_owned(),
            slack_bot_id: bot_id.to_owned(),
            display_name: agent_id.to_owned(),
            chat_user_id: String::new(),
        }),
    )
}

/// A Slack `message` delivery to `receiver`'s app, on the top level of `channel` (a DM when it
/// starts with `D`), without author or content yet.
pub fn message(receiver: &str, channel: &str, ts: &str) -> Envelope {
    envelope(
        format!("slack:{TEAM}:{channel}:{ts}:message:{receiver}"),
        Payload::SlackMessage(proto::SlackMessageObserved {
            receiving_agent_id: receiver.to_owned(),
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: TEAM.to_owned(),
            channel_id: channel.to_owned(),
            ts: ts.to_owned(),
            ..Default::default()
        }),
    )
}

/// A DM from a human: the common trigger of a wake.
pub fn dm_from_human(receiver: &str, channel: &str, ts: &str, text: &str) -> Envelope {
    message(receiver, channel, ts).by_user("U1", "Uma").text(text)
}

fn target(channel: &str) -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: TEAM.to_owned(),
            channel_id: channel.to_owned(),
            thread_ts: String::new(),
        })),
    }
}

/// The agent asks before posting a message to the top level of `channel`.
pub fn send(agent_id: &str, channel: &str) -> Envelope {
    envelope(
        format!("send:{agent_id}:{channel}"),
        Payload::Send(proto::SendRequested {
            agent_id: agent_id.to_owned(),
            target: Some(target(channel)),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 5,
            mentioned_user_ids: Vec::new(),
        }),
    )
}

/// A post the agent made, confirmed and journaled as its own row.
pub fn confirmed(agent_id: &str, channel: &str, ts: &str, text: &str) -> Envelope {
    envelope(
        format!("confirmed:{agent_id}:{channel}:{ts}"),
        Payload::SendConfirmed(proto::SendConfirmed {
            agent_id: agent_id.to_owned(),
            target: Some(target(channel)),
            kind: proto::SendKind::Message as i32,
            ts: ts.to_owned(),
            text: text.to_owned(),
            files: Vec::new(),
            send_event_id: String::new(),
        }),
    )
}

/// A post the agent made, confirmed as the post the send `send_event_id` allowed.
pub fn confirmed_for(agent_id: &str, channel: &str, ts: &str, send_event_id: &str) -> Envelope {
    let mut event = confirmed(agent_id, channel, ts, "my post");
    if let Some(Payload::SendConfirmed(c)) = event.payload.as_mut() {
        c.send_event_id = send_event_id.to_owned();
    }
    event
}

/// The do-not-contact lists: (workspace, people) pairs.
pub fn do_not_contact(lists: &[(&str, &[&str])]) -> Envelope {
    let lists = lists
        .iter()
        .map(|(workspace, users)| proto::DoNotContactList {
            workspace_id: (*workspace).to_owned(),
            user_ids: users.iter().map(|u| (*u).to_owned()).collect(),
        })
        .collect::<Vec<_>>();
    envelope(format!("do-not-contact:{}", lists.len()), Payload::DoNotContact(proto::DoNotContactConfigured { lists }))
}

/// A send whose draft @mentions `users`.
pub fn send_mentioning(agent_id: &str, channel: &str, users: &[&str]) -> Envelope {
    let mut event = send(agent_id, channel);
    if let Some(Payload::Send(s)) = event.payload.as_mut() {
        s.mentioned_user_ids = users.iter().map(|u| (*u).to_owned()).collect();
    }
    event.event_id = format!("{}:mentioning:{}", event.event_id, users.join(","));
    event
}

/// The user stopped `agent_id` in the thread of `channel` rooted at `thread_ts`.
pub fn thread_stop(agent_id: &str, channel: &str, thread_ts: &str) -> Envelope {
    envelope(
        format!("slack-thread-stop:{agent_id}:{channel}:{thread_ts}"),
        Payload::SlackThreadStop(proto::SlackThreadStopObserved {
            receiving_agent_id: agent_id.to_owned(),
            team_id: TEAM.to_owned(),
            channel_id: channel.to_owned(),
            thread_ts: thread_ts.to_owned(),
        }),
    )
}

/// A worker asks for the agent's oldest claimable wake.
pub fn claim(agent_id: &str, worker: &str) -> Envelope {
    claim_item(agent_id, worker, "")
}

/// A worker asks for one named wake.
pub fn claim_item(agent_id: &str, worker: &str, item: &str) -> Envelope {
    envelope(
        format!("claim:{agent_id}:{worker}"),
        Payload::WakeClaim(proto::WakeClaimRequested {
            agent_id: agent_id.to_owned(),
            worker_id: worker.to_owned(),
            item_id: item.to_owned(),
            memory_md_bytes: 0,
            claim_lease_seconds: 0,
        }),
    )
}

/// The worker starts the agent's active wake with the plan its claim prepared, unchanged. After
/// a cursor moved in between, that plan is stale.
pub fn start(agent_id: &str, worker: &str) -> Envelope {
    let mut start = start_with_plan(agent_id, worker, "", Vec::new());
    start.source = FROM_STATE.to_owned();
    start
}

/// A start with an explicit item and plan, e.g. a forged one.
pub fn start_with_plan(agent_id: &str, worker: &str, item: &str, plan: Vec<proto::PlanSurface>) -> Envelope {
    envelope(
        format!("start:{agent_id}:{worker}"),
        Payload::WakeStart(proto::WakeStartRequested {
            agent_id: agent_id.to_owned(),
            worker_id: worker.to_owned(),
            item_id: item.to_owned(),
            plan,
        }),
    )
}

/// One surface of a hand-written plan.
pub fn plan_surface(surface: &str, expected: Option<u64>, target: u64) -> proto::PlanSurface {
    proto::PlanSurface {
        surface: surface.to_owned(),
        expected_present: expected.is_some(),
        expected_ordinal: expected.unwrap_or(0),
        target_ordinal: target,
    }
}

/// The worker finishes the agent's active wake.
pub fn finish(agent_id: &str, worker: &str, outcome: proto::WakeOutcome) -> Envelope {
    let mut finish = finish_item(agent_id, worker, "", outcome);
    finish.source = FROM_STATE.to_owned();
    finish
}

/// The worker finishes a named wake.
pub fn finish_item(agent_id: &str, worker: &str, item: &str, outcome: proto::WakeOutcome) -> Envelope {
    envelope(
        format!("finish:{agent_id}:{worker}"),
        Payload::WakeFinish(proto::WakeFinishRequested {
            agent_id: agent_id.to_owned(),
            worker_id: worker.to_owned(),
            item_id: item.to_owned(),
            outcome: outcome as i32,
            reason: String::new(),
            restart_drain: false,
            memory_digest_before: Vec::new(),
            memory_digest_after: Vec::new(),
        }),
    )
}

/// The worker heart-beats the agent's active (claimed or running) wake.
pub fn heartbeat(agent_id: &str, worker: &str) -> Envelope {
    let mut heartbeat = envelope(
        format!("heartbeat:{agent_id}:{worker}"),
        Payload::WakeHeartbeat(proto::WakeHeartbeat {
            agent_id: agent_id.to_owned(),
            worker_id: worker.to_owned(),
            item_id: String::new(),
        }),
    );
    heartbeat.source = FROM_STATE.to_owned();
    heartbeat
}

/// The recovery loop asks to re-queue the agent's active wake.
pub fn recovery(agent_id: &str) -> Envelope {
    let mut recovery = envelope(
        format!("recovery:{agent_id}"),
        Payload::WakeRecovery(proto::WakeRecoveryRequested { agent_id: agent_id.to_owned(), item_id: String::new() }),
    );
    recovery.source = FROM_STATE.to_owned();
    recovery
}

/// A claim asking for a lease of `seconds`.
pub fn claim_with_lease(agent_id: &str, worker: &str, seconds: u32) -> Envelope {
    let mut claim = claim(agent_id, worker);
    if let Some(Payload::WakeClaim(c)) = claim.payload.as_mut() {
        c.claim_lease_seconds = seconds;
    }
    claim
}

/// The runtime restarts and drains the agent's active wake.
pub fn restart_drain(agent_id: &str, worker: &str) -> Envelope {
    let mut drain = finish(agent_id, worker, proto::WakeOutcome::Aborted);
    if let Some(Payload::WakeFinish(f)) = drain.payload.as_mut() {
        f.restart_drain = true;
        f.reason = "runtime restart".to_owned();
    }
    drain
}

/// Refinements of a built event.
pub trait MessageExt {
    /// Written by a Slack user (a human, or an agent's bot user), shown as `name`.
    fn by_user(self, user_id: &str, name: &str) -> Self;
    /// Written by a Slack bot (`bot_message`), with no user id.
    fn by_bot(self, bot_id: &str, name: &str) -> Self;
    fn text(self, text: &str) -> Self;
    fn file(self, name: &str, size_bytes: u64) -> Self;
    /// A link preview (Slack unfurl) on the message.
    fn preview(self, url: &str, title: &str, text: &str) -> Self;
    /// In the thread rooted at `thread_ts` (a message, a send or a confirmation).
    fn in_thread(self, thread_ts: &str) -> Self;
    fn subtype(self, subtype: &str) -> Self;
    /// Delivered as `app_mention` instead of `message`.
    fn app_mention(self) -> Self;
    /// The same message, as another agent's app received it.
    fn delivered_to(self, receiver: &str) -> Self;
    /// The source clock (and so the log time the test log stamps) `after` the log's start.
    fn occurred_after(self, after: Duration) -> Self;
    /// A send request (or confirmation) of another kind of post than a message.
    fn post_kind(self, kind: proto::SendKind) -> Self;
    /// Any event, stamped `after` the log's start (the test log never goes backwards).
    fn at(self, after: Duration) -> Self;
}

fn slack_message(envelope: &mut Envelope) -> &mut proto::SlackMessageObserved {
    match envelope.payload.as_mut() {
        Some(Payload::SlackMessage(m)) => m,
        other => panic!("not a Slack message: {other:?}"),
    }
}

impl MessageExt for Envelope {
    fn by_user(mut self, user_id: &str, name: &str) -> Self {
        let m = slack_message(&mut self);
        m.user_id = user_id.to_owned();
        m.user_name = name.to_owned();
        self
    }

    fn by_bot(mut self, bot_id: &str, name: &str) -> Self {
        let m = slack_message(&mut self);
        m.bot_id = bot_id.to_owned();
        m.user_name = name.to_owned();
        m.subtype = "bot_message".to_owned();
        self
    }

    fn text(mut self, text: &str) -> Self {
        match self.payload.as_mut() {
            Some(Payload::SendConfirmed(c)) => c.text = text.to_owned(),
            _ => slack_message(&mut self).text = text.to_owned(),
        }
        self
    }

    fn file(mut self, name: &str, size_bytes: u64) -> Self {
        let file = proto::SlackFile { name: name.to_owned(), size_bytes };
        match self.payload.as_mut() {
            Some(Payload::SendConfirmed(c)) => c.files.push(file),
            _ => slack_message(&mut self).files.push(file),
        }
        self
    }

    fn preview(mut self, url: &str, title: &str, text: &str) -> Self {
        let preview = proto::LinkPreview { url: url.to_owned(), title: title.to_owned(), text: text.to_owned() };
        slack_message(&mut self).previews.push(preview);
        self
    }

    fn in_thread(mut self, thread_ts: &str) -> Self {
        let target = match self.payload.as_mut() {
            Some(Payload::SlackMessage(m)) => {
                m.thread_ts = thread_ts.to_owned();
                None
            }
            Some(Payload::Send(s)) => s.target.as_mut(),
            Some(Payload::SendConfirmed(c)) => c.target.as_mut(),
            other => panic!("has no thread: {other:?}"),
        };
        if let Some(proto::ReplyTarget { target: Some(proto::reply_target::Target::Slack(slack)) }) = target {
            slack.thread_ts = thread_ts.to_owned();
        }
        self.event_id = format!("{}:thread:{thread_ts}", self.event_id);
        self
    }

    fn subtype(mut self, subtype: &str) -> Self {
        slack_message(&mut self).subtype = subtype.to_owned();
        self
    }

    fn app_mention(mut self) -> Self {
        slack_message(&mut self).kind = proto::SlackDeliveryKind::AppMention as i32;
        self.event_id = self.event_id.replace(":message:", ":app_mention:");
        self
    }

    fn delivered_to(mut self, receiver: &str) -> Self {
        let m = slack_message(&mut self);
        let old = std::mem::replace(&mut m.receiving_agent_id, receiver.to_owned());
        self.event_id = self.event_id.replace(&format!(":{old}"), &format!(":{receiver}"));
        self
    }

    fn occurred_after(mut self, after: Duration) -> Self {
        self.occurred_at_ms = LOG_START_MS + i64::try_from(after.as_millis()).expect("a test duration");
        self
    }

    fn at(mut self, after: Duration) -> Self {
        self.occurred_at_ms = LOG_START_MS + i64::try_from(after.as_millis()).expect("a test duration");
        self
    }

    fn post_kind(mut self, kind: proto::SendKind) -> Self {
        match self.payload.as_mut() {
            Some(Payload::Send(s)) => s.kind = kind as i32,
            Some(Payload::SendConfirmed(c)) => c.kind = kind as i32,
            other => panic!("not a send: {other:?}"),
        }
        self.event_id = format!("{}:{}", self.event_id, kind.as_str_name());
        self
    }
}
