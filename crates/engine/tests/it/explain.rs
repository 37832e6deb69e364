//! `Replay.Explain` renders the fold's facts and never decides again: for every
//! request of a generated log, Explain names the verdict the fold recorded at that sequence, and
//! the facts it states are the ones the verdict carries — the cursor a send was judged from, the
//! new (foreign) rows the fold counted, the refusal's reason, the cursors a start moved.
//!
//! The log is generated op by op against the embedded log; a fold of each stored record (with the
//! log's own timestamp) is the live state the ops consult (a start hands back the plan its claim
//! prepared, or a forged one) and the verdicts Explain must agree with.

use std::sync::Arc;

use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::{AppendRecord, EventLog};
use anima_engine::replay::{ReplayConfig, Replayer};
use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::verdict::{SendVerdict, Verdict};
use anima_projections::{LogPosition, State};
use bytes::Bytes;
use proptest::prelude::*;
use prost::Message;

const TEAM: &str = "T1";
const CHANNELS: [&str; 2] = ["D1", "D2"];

#[derive(Clone, Debug)]
enum Op {
    /// A person writes in a DM.
    Human(usize),
    /// Ada's own post there, confirmed.
    OwnPost(usize),
    /// Ada asks to post a message (0), a question (1) or a file (2).
    Send(usize, u8),
    Claim(u8),
    /// Start the active wake with the plan its claim prepared, or with a forged one (another
    /// target, the same expected cursors).
    Start {
        forged: bool,
    },
    Finish,
    /// The do-not-contact list of the workspace: naming the person who writes in the DMs, or
    /// someone else.
    DoNotContact {
        listed: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..CHANNELS.len()).prop_map(Op::Human),
        2 => (0..CHANNELS.len()).prop_map(Op::OwnPost),
        3 => ((0..CHANNELS.len()), 0..3u8).prop_map(|(c, k)| Op::Send(c, k)),
        2 => (0..2u8).prop_map(Op::Claim),
        2 => any::<bool>().prop_map(|forged| Op::Start { forged }),
        1 => Just(Op::Finish),
        1 => any::<bool>().prop_map(|listed| Op::DoNotContact { listed }),
    ]
}

fn slack_target(channel: &str) -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: TEAM.into(),
            channel_id: channel.into(),
            thread_ts: String::new(),
        })),
    }
}

struct Generated {
    log: Arc<dyn EventLog>,
    state: State,
    next: u64,
    _dir: tempfile::TempDir,
}

impl Generated {
    async fn new() -> Generated {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::Config::new().path(dir.path()).open().expect("sled");
        let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).expect("log"));
        let mut generated = Generated { log, state: State::new(), next: 0, _dir: dir };
        let agent_subject = generated.log.subjects().agent("ada");
        generated
            .append(
                agent_subject,
                Payload::AgentRegistered(proto::AgentRegistered {
                    agent_id: "ada".into(),
                    slack_bot_user_id: "UADA".into(),
                    slack_bot_id: "BADA".into(),
                    ..Default::default()
                }),
            )
            .await;
        generated
    }

    /// Appends one event and folds the stored record with the log's own time.
    async fn append(&mut self, subject: String, payload: Payload) -> u64 {
        self.next += 1;
        let envelope = Envelope {
            event_id: format!("generated-{}", self.next),
            occurred_at_ms: 0,
            min_reader_version: 1,
            source: "test".into(),
            payload: Some(payload),
        };
        let record =
            AppendRecord { subject, msg_id: envelope.event_id.clone(), payload: Bytes::from(envelope.encode_to_vec()) };
        let seq = self.log.append(record).await.expect("append").seq();
        let stored = self.log.get(seq).await.expect("get").expect("stored");
        self.state.apply_bytes(LogPosition { seq, at_ns: stored.timestamp_ns }, &stored.payload);
        seq
    }

    async fn apply(&mut self, op: &Op) {
        let n = self.next + 1;
        let ts = format!("{}.000100", 1_700_000_000 + n);
        let subjects = self.log.subjects().clone();
        let surface_subject = |channel: &str| subjects.slack_surface(TEAM, channel, None);
        match op {
            Op::Human(c) => {
                let message = proto::SlackMessageObserved {
                    receiving_agent_id: "ada".into(),
                    kind: proto::SlackDeliveryKind::Message as i32,
                    team_id: TEAM.into(),
                    channel_id: CHANNELS[*c].into(),
                    ts,
                    user_id: "UPERSON".into(),
                    text: format!("message {n}"),
                    ..Default::default()
                };
                self.append(surface_subject(CHANNELS[*c]), Payload::SlackMessage(message)).await;
            }
            Op::OwnPost(c) => {
                let confirmed = proto::SendConfirmed {
                    agent_id: "ada".into(),
                    target: Some(slack_target(CHANNELS[*c])),
                    kind: proto::SendKind::Message as i32,
                    ts,
                    text: format!("my post {n}"),
                    files: Vec::new(),
                    send_event_id: String::new(),
                };
                self.append(surface_subject(CHANNELS[*c]), Payload::SendConfirmed(confirmed)).await;
            }
            Op::Send(c, kind) => {
                let kind = [proto::SendKind::Message, proto::SendKind::Ask, proto::SendKind::File][*kind as usize];
                let request = proto::SendRequested {
                    agent_id: "ada".into(),
                    target: Some(slack_target(CHANNELS[*c])),
                    kind: kind as i32,
                    draft_bytes: 10,
                    mentioned_user_ids: Vec::new(),
                };
                self.append(surface_subject(CHANNELS[*c]), Payload::Send(request)).await;
            }
            Op::Claim(worker) => {
                let request = proto::WakeClaimRequested {
                    agent_id: "ada".into(),
                    worker_id: format!("w{worker}"),
                    ..Default::default()
                };
                self.append(subjects.agent("ada"), Payload::WakeClaim(request)).await;
            }
            Op::Start { forged } => {
                let Some(active) = self.state.queue("ada").and_then(|q| q.active.clone()) else { return };
                let plan = active
                    .plan
                    .iter()
                    .map(|p| proto::PlanSurface {
                        surface: p.surface.to_string(),
                        expected_present: p.expected.is_some(),
                        expected_ordinal: p.expected.unwrap_or(0),
                        target_ordinal: if *forged { p.target + 1 } else { p.target },
                    })
                    .collect();
                let request = proto::WakeStartRequested {
                    agent_id: "ada".into(),
                    worker_id: active.worker.clone(),
                    item_id: active.item.id.clone(),
                    plan,
                };
                self.append(subjects.agent("ada"), Payload::WakeStart(request)).await;
            }
            Op::DoNotContact { listed } => {
                let person = if *listed { "UPERSON" } else { "USOMEONE" };
                let config = proto::DoNotContactConfigured {
                    lists: vec![proto::DoNotContactList { workspace_id: TEAM.into(), user_ids: vec![person.into()] }],
                };
                self.append(subjects.config(), Payload::DoNotContact(config)).await;
            }
            Op::Finish => {
                let Some(active) = self.state.queue("ada").and_then(|q| q.active.clone()) else { return };
                let request = proto::WakeFinishRequested {
                    agent_id: "ada".into(),
                    worker_id: active.worker.clone(),
                    item_id: active.item.id.clone(),
                    outcome: proto::WakeOutcome::Completed as i32,
                    ..Default::default()
                };
                self.append(subjects.agent("ada"), Payload::WakeFinish(request)).await;
            }
        }
    }
}

/// Checks Explain of `seq` against the fold's verdict there.
async fn check_explanation(replayer: &Replayer, fold: &State, seq: u64) -> Result<(), TestCaseError> {
    let explanation = replayer.explain(seq).await.expect("explain");
    let recorded = fold.verdict(seq).cloned();
    prop_assert_eq!(&explanation.verdict, &recorded, "seq {}: Explain names the recorded verdict", seq);
    let Some(verdict) = recorded else { return Ok(()) };
    let facts = explanation.facts.join("\n");
    prop_assert!(!explanation.facts.is_empty() || matches!(verdict, Verdict::AgentRegistered), "seq {}", seq);
    match &verdict {
        Verdict::Refused(refusal) => {
            prop_assert!(facts.contains(&refusal.message), "seq {}: the refusal's reason: {}", seq, facts);
            prop_assert!(!facts.contains("accepted") && !facts.contains("is allowed"), "seq {}: {}", seq, facts);
        }
        Verdict::Send(send) => {
            let cursor = explanation.cursor.as_ref().expect("a send explains its cursor");
            match send {
                SendVerdict::Allowed { cursor_before, cursor_after, .. } => {
                    prop_assert_eq!(cursor.cursor, *cursor_before, "seq {}", seq);
                    prop_assert_eq!(cursor.foreign_rows_after_cursor, 0, "seq {}", seq);
                    if let Some(after) = cursor_after {
                        prop_assert_eq!(cursor.tail, *after, "seq {}: the cursor passed the tail", seq);
                    }
                    prop_assert!(facts.contains("allowed") && !facts.contains("held"), "seq {}: {}", seq, facts);
                }
                SendVerdict::NotContacted(refused) => {
                    prop_assert_eq!(cursor.foreign_rows_after_cursor, 0, "seq {}", seq);
                    let reason = format!("refused before the hold ({})", refused.reason.as_str());
                    prop_assert!(facts.contains(&reason), "seq {}: {} in {}", seq, reason, facts);
                    if let Some(user) = &refused.user_id {
                        prop_assert!(facts.contains(user.as_str()), "seq {}: {} in {}", seq, user, facts);
                    }
                    prop_assert!(!facts.contains("allowed") && !facts.contains("held"), "seq {}: {}", seq, facts);
                }
                SendVerdict::Held(held) => {
                    prop_assert_eq!(cursor.cursor, Some(held.cursor_before), "seq {}", seq);
                    prop_assert_eq!(cursor.tail, held.tail, "seq {}", seq);
                    prop_assert_eq!(cursor.foreign_rows_after_cursor, held.new_messages, "seq {}", seq);
                    let own_shown = held.shown.iter().filter(|row| row.is_own("ada")).count();
                    prop_assert_eq!(own_shown, 0, "seq {}: a hold shows only foreign rows", seq);
                    for row in &held.shown {
                        let named = format!("#{} (seq {}", row.ordinal, row.seq);
                        prop_assert!(facts.contains(&named), "seq {}: {} in {}", seq, named, facts);
                    }
                    prop_assert!(facts.contains(&format!("{} foreign rows", held.new_messages)), "seq {}", seq);
                    prop_assert!(facts.contains("held") && !facts.contains("allowed"), "seq {}: {}", seq, facts);
                }
            }
        }
        Verdict::Started { moved, .. } => {
            prop_assert!(facts.contains("accepted"), "seq {}: {}", seq, facts);
            for cursor in moved {
                let named = format!("{}: the cursor moved from", cursor.surface);
                prop_assert!(facts.contains(&named), "seq {}: {} in {}", seq, named, facts);
                let to = format!("to {} (tail {})", cursor.after, cursor.tail);
                prop_assert!(facts.contains(&to), "seq {}: {} in {}", seq, to, facts);
            }
        }
        _ => {}
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn explain_states_the_folds_facts_for_every_request(ops in proptest::collection::vec(op(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async {
            let mut generated = Generated::new().await;
            for op in &ops {
                generated.apply(op).await;
            }
            let replayer = Replayer::new(generated.log.clone(), ReplayConfig::default());
            let last = generated.log.last_seq().await.expect("last seq");
            for seq in 1..=last {
                check_explanation(&replayer, &generated.state, seq).await?;
            }
            Ok::<(), TestCaseError>(())
        })?;
    }
}

/// The generated logs reach every verdict the property checks: this scripted one does for sure.
#[tokio::test]
async fn a_scripted_log_reaches_every_verdict_the_property_checks() {
    let script = [
        Op::Human(0),
        Op::Claim(0),
        Op::Start { forged: true },
        Op::Claim(1),
        Op::Start { forged: false },
        Op::Human(0),
        Op::OwnPost(0),
        Op::Send(0, 2),
        Op::Send(0, 0),
        Op::OwnPost(0),
        Op::Send(0, 1),
        Op::Send(1, 0),
        Op::Finish,
        Op::DoNotContact { listed: true },
        Op::Send(0, 0),
        Op::Send(1, 0),
        Op::DoNotContact { listed: false },
        Op::Send(0, 0),
    ];
    let mut generated = Generated::new().await;
    for op in &script {
        generated.apply(op).await;
    }
    let replayer = Replayer::new(generated.log.clone(), ReplayConfig::default());
    let last = generated.log.last_seq().await.expect("last seq");
    let mut kinds = std::collections::BTreeSet::new();
    for seq in 1..=last {
        check_explanation(&replayer, &generated.state, seq).await.expect("Explain agrees with the fold");
        kinds.insert(match generated.state.verdict(seq).expect("a verdict") {
            Verdict::Send(SendVerdict::Held(_)) => "held",
            Verdict::Send(SendVerdict::Allowed { cursor_before: None, .. }) => "allowed without a cursor",
            Verdict::Send(SendVerdict::Allowed { .. }) => "allowed",
            Verdict::Send(SendVerdict::NotContacted(refused)) => refused.reason.as_str(),
            Verdict::Started { .. } => "started",
            Verdict::Refused(_) => "refused",
            _ => "other",
        });
    }
    let expected =
        ["allowed", "allowed without a cursor", "could_not_verify", "held", "listed", "other", "refused", "started"];
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), expected);
}
