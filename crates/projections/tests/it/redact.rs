//! The redacted view and analytics: derived from the content marking of the
//! stored schema, with no content at all — every event kind, filled with unique markers in every
//! content field, leaves no marker in any redacted output — and the counts and figures analytics
//! computes from redacted events and the fold's verdicts.

use anima_projections::proto::{self, envelope::Payload, Envelope, EVENTS_DESCRIPTOR_SET};
use anima_projections::redact::{
    AnalyticsCounts, RedactedEvent, RedactedOutcome, RedactedValue, Redactor, TimeBucket, EVENT_TYPE_UNDECODABLE,
    EVENT_TYPE_UNKNOWN, FIGURE_FIELDS, PAYLOAD_ONEOF,
};
use expect_test::{expect, Expect};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MessageDescriptor, ReflectMessage, Value};

use crate::events::{self, agent, claim, confirmed, dm_from_human, finish, message, send, start, ts, MessageExt};
use crate::log::TestLog;

fn envelope_descriptor() -> MessageDescriptor {
    DescriptorPool::decode(EVENTS_DESCRIPTOR_SET)
        .expect("the descriptor set decodes")
        .get_message_by_name("anima.v1.Envelope")
        .expect("the schema has an envelope")
}

/// Every string field the schema lets analytics see, each reviewed: ids chosen by platforms or
/// operators, timestamps, fixed vocabularies, configuration. Nothing here can carry words a
/// person wrote (message text, titles, URLs, file or channel names); marking another field
/// non-content means adding it here, with its reason, or the schema test below fails.
const REVIEWED_NON_CONTENT: &[&str] = &[
    // Envelope: the event id is derived or a UUID; the source is the appender's name.
    "anima.v1.Envelope.event_id",
    "anima.v1.Envelope.source",
    // Agents and their platform identities (ids, never display names).
    "anima.v1.AgentRegistered.agent_id",
    "anima.v1.AgentRegistered.slack_bot_user_id",
    "anima.v1.AgentRegistered.slack_bot_id",
    "anima.v1.AgentRegistered.chat_user_id",
    // Slack: ids (C..., U..., B..., T...), ts values and Slack's subtype vocabulary.
    "anima.v1.SlackMessageObserved.receiving_agent_id",
    "anima.v1.SlackMessageObserved.team_id",
    "anima.v1.SlackMessageObserved.channel_id",
    "anima.v1.SlackMessageObserved.ts",
    "anima.v1.SlackMessageObserved.thread_ts",
    "anima.v1.SlackMessageObserved.subtype",
    "anima.v1.SlackMessageObserved.user_id",
    "anima.v1.SlackMessageObserved.bot_id",
    "anima.v1.SlackTarget.team_id",
    "anima.v1.SlackTarget.channel_id",
    "anima.v1.SlackTarget.thread_ts",
    // Chat platform ids (opaque ids such as oc_..., ou_...; names travel in content fields).
    "anima.v1.ChatMessageObserved.receiving_agent_id",
    "anima.v1.ChatMessageObserved.tenant_id",
    "anima.v1.ChatMessageObserved.chat_id",
    "anima.v1.ChatMessageObserved.message_id",
    "anima.v1.ChatMessageObserved.thread_id",
    "anima.v1.ChatMessageObserved.sender_id",
    "anima.v1.ChatMessageObserved.mentioned_user_ids",
    "anima.v1.ChatTarget.tenant_id",
    "anima.v1.ChatTarget.chat_id",
    "anima.v1.ChatTarget.thread_id",
    // Linear: UUIDs and the issue's identifier (team key and number, e.g. ENG-7). Not the URL:
    // it ends in the title.
    "anima.v1.LinearTarget.session_id",
    "anima.v1.LinearSessionEvent.receiving_agent_id",
    "anima.v1.LinearSessionEvent.installation_id",
    "anima.v1.LinearSessionEvent.session_id",
    "anima.v1.LinearSessionEvent.agent_activity_id",
    "anima.v1.LinearSessionEvent.issue_identifier",
    "anima.v1.LinearResponseRequested.agent_id",
    "anima.v1.LinearResponseRequested.session_id",
    "anima.v1.LinearResponseRequested.input_ids",
    "anima.v1.LinearResponseOutcome.agent_id",
    "anima.v1.LinearResponseOutcome.activity_id",
    // Wakes: agent, worker and item ids (item ids are message identities: ids and ts).
    "anima.v1.WakeClaimRequested.agent_id",
    "anima.v1.WakeClaimRequested.worker_id",
    "anima.v1.WakeClaimRequested.item_id",
    "anima.v1.PlanSurface.surface",
    "anima.v1.WakeStartRequested.agent_id",
    "anima.v1.WakeStartRequested.worker_id",
    "anima.v1.WakeStartRequested.item_id",
    "anima.v1.WakeFinishRequested.agent_id",
    "anima.v1.WakeFinishRequested.worker_id",
    "anima.v1.WakeFinishRequested.item_id",
    "anima.v1.WakeHeartbeat.agent_id",
    "anima.v1.WakeHeartbeat.worker_id",
    "anima.v1.WakeHeartbeat.item_id",
    "anima.v1.WakeRecoveryRequested.agent_id",
    "anima.v1.WakeRecoveryRequested.item_id",
    // Sends and subscriptions: the agent and the post's ts or message id.
    "anima.v1.SendRequested.agent_id",
    // The user ids a draft @mentions: platform ids, not the draft's words.
    "anima.v1.SendRequested.mentioned_user_ids",
    "anima.v1.SendConfirmed.agent_id",
    "anima.v1.SendConfirmed.ts",
    // The event id of the send a post answers: a UUID the runtime drew, never words.
    "anima.v1.SendConfirmed.send_event_id",
    "anima.v1.SubscriptionChangeRequested.agent_id",
    // The do-not-contact lists: workspace and user ids.
    "anima.v1.DoNotContactList.workspace_id",
    "anima.v1.DoNotContactList.user_ids",
    // A Slack thread stop: the agent and the thread's ids.
    "anima.v1.SlackThreadStopObserved.receiving_agent_id",
    "anima.v1.SlackThreadStopObserved.team_id",
    "anima.v1.SlackThreadStopObserved.channel_id",
    "anima.v1.SlackThreadStopObserved.thread_ts",
    // The memory pass: configuration and slot days.
    "anima.v1.MemoryCoherenceConfigured.window_start",
    "anima.v1.MemoryCoherenceConfigured.timezone",
    "anima.v1.MemoryCoherenceConfigured.scope_agent_ids",
    "anima.v1.MemoryPassRequested.agent_id",
    "anima.v1.MemoryPassRequested.window_day",
];

/// Fills every field of `message`, URLs and ids included: every string and bytes field gets a
/// unique marker. Markers of fields the schema marks non-content are `PLAIN####Z` (remembered
/// in `plain` with their field's full name), all others `MARKER####Z` (in `markers`).
fn fill(message: &mut DynamicMessage, markers: &mut Vec<String>, plain: &mut Vec<(String, String)>, depth: usize) {
    let redactor = Redactor::schema();
    let descriptor = message.descriptor();
    for field in descriptor.fields() {
        if field.containing_oneof().is_some() && depth == 0 {
            continue;
        }
        let one = |markers: &mut Vec<String>, plain: &mut Vec<(String, String)>| -> Option<Value> {
            let serial = markers.len() + plain.len();
            Some(match field.kind() {
                Kind::String if redactor.is_plain(&field) => {
                    let marker = format!("PLAIN{serial:04}Z");
                    plain.push((marker.clone(), field.full_name().to_owned()));
                    Value::String(marker)
                }
                Kind::String => {
                    let marker = format!("MARKER{serial:04}Z");
                    markers.push(marker.clone());
                    Value::String(marker)
                }
                Kind::Bytes => {
                    let marker = format!("MARKER{serial:04}Z");
                    markers.push(marker.clone());
                    Value::Bytes(marker.into_bytes().into())
                }
                Kind::Bool => Value::Bool(true),
                Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(7),
                Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(7),
                Kind::Uint32 | Kind::Fixed32 => Value::U32(7),
                Kind::Uint64 | Kind::Fixed64 => Value::U64(7),
                Kind::Float => Value::F32(0.5),
                Kind::Double => Value::F64(0.5),
                Kind::Enum(e) => Value::EnumNumber(e.values().map(|v| v.number()).max().unwrap_or(0)),
                Kind::Message(_) if field.is_map() => return None,
                Kind::Message(inner) if depth < 4 => {
                    let mut nested = DynamicMessage::new(inner);
                    fill(&mut nested, markers, plain, depth + 1);
                    Value::Message(nested)
                }
                Kind::Message(_) => return None,
            })
        };
        let value = if field.is_list() {
            let items: Vec<Value> = (0..2).filter_map(|_| one(markers, plain)).collect();
            Value::List(items)
        } else {
            match one(markers, plain) {
                Some(value) => value,
                None => continue,
            }
        };
        // A oneof nested in a payload keeps the last member set; fine for leak checks.
        message.set_field(&field, value);
    }
}

/// One envelope per payload kind of the schema, every field filled: its type, its stored
/// bytes, its content markers and its non-content markers with their fields.
type FilledEvent = (String, Vec<u8>, Vec<String>, Vec<(String, String)>);

fn every_event_kind() -> Vec<FilledEvent> {
    let descriptor = envelope_descriptor();
    let mut out = Vec::new();
    for field in descriptor.fields() {
        let in_payload = field.containing_oneof().is_some_and(|o| o.name() == PAYLOAD_ONEOF);
        let Kind::Message(payload_type) = field.kind() else { continue };
        if !in_payload {
            continue;
        }
        let (mut markers, mut plain) = (Vec::new(), Vec::new());
        let mut envelope = DynamicMessage::new(descriptor.clone());
        fill(&mut envelope, &mut markers, &mut plain, 0);
        let mut payload = DynamicMessage::new(payload_type);
        fill(&mut payload, &mut markers, &mut plain, 1);
        envelope.set_field(&field, Value::Message(payload));
        out.push((field.name().to_owned(), envelope.encode_to_vec(), markers, plain));
    }
    out
}

fn assert_no_marker(output: &[u8], markers: &[String], what: &str) {
    let text = String::from_utf8_lossy(output);
    for marker in markers {
        assert!(!text.contains(marker.as_str()), "{marker} leaked into {what}");
    }
    assert!(!text.contains("MARKER"), "a marker leaked into {what}");
}

/// Every `PLAIN####Z` in `output` is the marker of a field in [`REVIEWED_NON_CONTENT`]: no byte
/// of any other field reaches analytics.
fn assert_only_reviewed_fields(output: &[u8], plain: &[(String, String)], what: &str) {
    let text = String::from_utf8_lossy(output);
    let mut rest = text.as_ref();
    while let Some(at) = rest.find("PLAIN") {
        let marker: String = rest[at..].chars().take("PLAIN0000Z".len()).collect();
        let field = plain.iter().find(|(m, _)| *m == marker).map(|(_, field)| field.as_str());
        match field {
            Some(field) => assert!(
                REVIEWED_NON_CONTENT.contains(&field),
                "{field} reached {what} but is not reviewed as non-content"
            ),
            None => panic!("{marker:?} in {what} belongs to no field of this event"),
        }
        rest = &rest[at + "PLAIN".len()..];
    }
}

#[test]
fn no_content_of_any_event_kind_reaches_the_redacted_view() {
    let kinds = every_event_kind();
    assert!(kinds.len() >= 10, "found only {} payload kinds", kinds.len());
    let mut state = anima_projections::State::new();
    let mut counts = AnalyticsCounts::new(TimeBucket::Minute);
    let mut all_markers = Vec::new();
    let mut all_plain = Vec::new();
    for (index, (kind, stored, markers, plain)) in kinds.iter().enumerate() {
        let seq = index as u64 + 1;
        let at = anima_projections::LogPosition { seq, at_ns: 1_700_000_000_000_000_000 + seq as i64 };
        state.apply_bytes(at, stored);
        let mut redacted = Redactor::schema().redact(seq, at.at_ns, "anima.v1.agent.id0", stored);
        redacted.outcome = state.verdict(seq).map(RedactedOutcome::of);
        assert_eq!(&redacted.event_type, kind);
        let expected_content: u64 = markers.iter().map(|m| m.len() as u64).sum();
        assert_eq!(redacted.content_bytes, expected_content, "{kind}: every content byte is counted");
        assert_no_marker(format!("{redacted:?}").as_bytes(), markers, &format!("the debug view of {kind}"));
        assert_no_marker(&postcard::to_allocvec(&redacted).unwrap(), markers, &format!("the encoding of {kind}"));
        assert_only_reviewed_fields(format!("{redacted:?}").as_bytes(), plain, &format!("the debug view of {kind}"));
        assert_only_reviewed_fields(
            &postcard::to_allocvec(&redacted).unwrap(),
            plain,
            &format!("the encoding of {kind}"),
        );
        counts.observe(&redacted);
        all_markers.extend(markers.iter().cloned());
        all_plain.extend(plain.iter().cloned());
    }
    assert_only_reviewed_fields(format!("{counts:?}").as_bytes(), &all_plain, "the counts");
    assert_only_reviewed_fields(&postcard::to_allocvec(&counts).unwrap(), &all_plain, "the encoded counts");
    assert!(all_markers.len() >= 5, "the schema has content fields to test with");
    assert_no_marker(format!("{counts:?}").as_bytes(), &all_markers, "the counts");
    assert_no_marker(&postcard::to_allocvec(&counts).unwrap(), &all_markers, "the encoded counts");
}

#[test]
fn realistic_events_with_markers_leave_none_in_outcomes_or_counts() {
    let given = [
        agent("ada", "U0ADA", "B0ADA"),
        message("ada", "D1", &ts(1)).by_user("U1", "MARKER-Grace").text("MARKER-hello"),
        claim("ada", "w1"),
        start("ada", "w1"),
        dm_from_human("ada", "D1", &ts(2), "MARKER-are you there").file("MARKER-plan.pdf", 10),
        send("ada", "D1"),
        confirmed("ada", "D1", &ts(3), "MARKER-reply"),
        finish("ada", "w1", proto::WakeOutcome::Completed),
    ];
    let log = TestLog::with(&given);
    let mut counts = AnalyticsCounts::new(TimeBucket::Hour);
    for index in 0..log.events.len() {
        let redacted = redacted_with_outcome(&log, index);
        assert_no_marker(format!("{redacted:?}").as_bytes(), &[], &format!("event {}", index + 1));
        counts.observe(&redacted);
    }
    assert_no_marker(format!("{counts:?}").as_bytes(), &[], "the counts");
}

/// A confirmed post moved into the thread at `thread_ts`.
fn in_thread(mut event: Envelope, thread_ts: &str) -> Envelope {
    if let Some(Payload::SendConfirmed(confirmed)) = event.payload.as_mut() {
        if let Some(proto::reply_target::Target::Slack(slack)) =
            confirmed.target.as_mut().and_then(|t| t.target.as_mut())
        {
            slack.thread_ts = thread_ts.to_owned();
        }
    }
    event
}

fn redacted_with_outcome(log: &TestLog, index: usize) -> RedactedEvent {
    let at = log.positions[index];
    let stored = log.events[index].encode_to_vec();
    let mut redacted = Redactor::schema().redact(at.seq, at.at_ns, "anima.v1.test", &stored);
    redacted.outcome = log.state.verdict(at.seq).map(RedactedOutcome::of);
    redacted
}

fn render(event: &RedactedEvent) -> String {
    let mut out = format!(
        "{} seq={} event_id={} source={} bytes={} content_bytes={}\n",
        event.event_type, event.seq, event.event_id, event.source, event.event_bytes, event.content_bytes
    );
    for field in &event.fields {
        out.push_str(&format!("  {} = {:?}\n", field.path, field.value));
    }
    if let Some(outcome) = &event.outcome {
        out.push_str(&format!("  => {outcome:?}\n"));
    }
    out
}

#[track_caller]
fn check(event: Envelope, expect: Expect) {
    let log = TestLog::with(&[agent("ada", "U0ADA", "B0ADA"), event]);
    expect.assert_eq(&render(&redacted_with_outcome(&log, 1)));
}

#[test]
fn ids_are_kept_and_content_becomes_sizes() {
    check(
        message("ada", "D1", &ts(1)).by_user("U1", "Grace").text("hello there").file("notes.txt", 300),
        expect![[r#"
            slack_message seq=2 event_id=slack:T1:D1:1700000060.000100:message:ada source=test bytes=127 content_bytes=25
              receiving_agent_id = Id("ada")
              kind = Enum("SLACK_DELIVERY_KIND_MESSAGE")
              team_id = Id("T1")
              channel_id = Id("D1")
              ts = Id("1700000060.000100")
              user_id = Id("U1")
              text = ContentBytes(11)
              files = Count(1)
              files[0].name = ContentBytes(9)
              files[0].size_bytes = Uint(300)
              user_name = ContentBytes(5)
              => RedactedOutcome { kind: "journaled", wake_reason: Some("dm"), refusal: None, settled_without_turn: 0, new_messages: 0, shown: 0, omitted: 0, duplicate_message: false, ordinal: 1, note_shown: false, memory_outcome: None, memory_delay_seconds: None, not_queued: None, failure_notice_owed: false, failure_notices_settled: 0 }
        "#]],
    );
}

#[test]
fn a_send_request_is_redacted_with_its_target_ids() {
    check(
        send("ada", "D1"),
        expect![[r#"
            send seq=2 event_id=send:ada:D1 source=test bytes=44 content_bytes=0
              agent_id = Id("ada")
              target.slack.team_id = Id("T1")
              target.slack.channel_id = Id("D1")
              kind = Enum("SEND_KIND_MESSAGE")
              draft_bytes = Uint(5)
              => RedactedOutcome { kind: "send_allowed", wake_reason: None, refusal: None, settled_without_turn: 0, new_messages: 0, shown: 0, omitted: 0, duplicate_message: false, ordinal: 0, note_shown: false, memory_outcome: None, memory_delay_seconds: None, not_queued: None, failure_notice_owed: false, failure_notices_settled: 0 }
        "#]],
    );
}

#[test]
fn a_payload_of_a_newer_schema_is_unknown_and_its_bytes_stay_out() {
    let mut stored = Envelope { event_id: "e1".into(), min_reader_version: 1, ..Default::default() }.encode_to_vec();
    // Field 99, length-delimited: a payload this schema does not know.
    prost::encoding::string::encode(99, &"MARKER-future".to_owned(), &mut stored);
    let redacted = Redactor::schema().redact(1, 0, "anima.v1.x", &stored);
    assert_eq!(redacted.event_type, EVENT_TYPE_UNKNOWN);
    assert_no_marker(format!("{redacted:?}").as_bytes(), &[], "an unknown payload");

    let redacted = Redactor::schema().redact(2, 0, "anima.v1.x", b"\xff\xff\xff MARKER");
    assert_eq!(redacted.event_type, EVENT_TYPE_UNDECODABLE);
    assert_eq!(redacted.event_bytes, 10);
    assert_no_marker(format!("{redacted:?}").as_bytes(), &[], "undecodable bytes");
}

/// Without the marking every string is content: losing the options fails safe, it never shows
/// what it cannot classify.
#[test]
fn a_schema_without_marking_redacts_every_string() {
    let unmarked = prost_types::FileDescriptorSet::decode(EVENTS_DESCRIPTOR_SET).unwrap().encode_to_vec();
    let redactor = Redactor::new(&unmarked).expect("the options file still defines the extension");
    let stored = dm_from_human("ada", "D1", &ts(1), "hello").encode_to_vec();
    let redacted = redactor.redact(1, 0, "anima.v1.x", &stored);
    assert!(redacted.event_id.is_empty());
    assert_eq!(redacted.field("receiving_agent_id"), Some(&RedactedValue::ContentBytes(3)));
    assert!(redacted.fields.iter().all(|f| !matches!(f.value, RedactedValue::Id(_))));
}

#[test]
fn counts_by_type_and_bucket_with_the_derived_figures() {
    let given = [
        agent("ada", "U0ADA", "B0ADA"),
        dm_from_human("ada", "D1", &ts(1), "first"),
        claim("ada", "w1"),
        start("ada", "w1"),
        dm_from_human("ada", "D1", &ts(2), "second"),
        send("ada", "D1"),
        send("ada", "D1"),
        confirmed("ada", "D1", &ts(3), "reply on the main timeline"),
        in_thread(confirmed("ada", "D1", &ts(4), "reply in a thread"), &ts(1)),
        finish("ada", "w1", proto::WakeOutcome::Completed),
        claim("ada", "w1"),
    ];
    let mut log = TestLog::new();
    for (minute, event) in given.iter().enumerate() {
        let mut event = event.clone();
        // Two events a minute, from the log start.
        event.occurred_at_ms = events::LOG_START_MS + (minute as i64 / 2) * 60_000;
        log.fold(event);
    }
    let mut counts = AnalyticsCounts::new(TimeBucket::Minute);
    for index in 0..log.events.len() {
        counts.observe(&redacted_with_outcome(&log, index));
    }
    let mut out = String::new();
    for (start, bucket) in &counts.buckets {
        out.push_str(&format!("{}\n", anima_projections::time::format_utc(start / 1_000_000_000)));
        for (event_type, c) in &bucket.types {
            out.push_str(&format!("  {event_type}: {} events, {} content bytes\n", c.events, c.content_bytes));
        }
    }
    let total = &counts.total;
    out.push_str(&format!(
        "sends {} allowed, {} held, hold rate {:.2}\nwakes {:?}\nsettled without a turn {}\nclaims {}, starts {}, notes shown {}\n\
         finishes {:?}\nrefusals {:?}\ndm replies: {} threaded, {} top level\n",
        total.sends_allowed,
        total.sends_held,
        total.send_hold_rate(),
        total.wakes_by_reason,
        total.settled_without_turn,
        total.claims,
        total.starts,
        total.notes_shown,
        total.finishes_by_outcome,
        total.refusals_by_kind,
        total.dm_replies_threaded,
        total.dm_replies_top_level,
    ));
    expect![[r#"
        2023-11-14 22:13:00 UTC
          agent_registered: 1 events, 3 content bytes
          slack_message: 1 events, 8 content bytes
        2023-11-14 22:14:00 UTC
          wake_claim: 1 events, 0 content bytes
          wake_start: 1 events, 0 content bytes
        2023-11-14 22:15:00 UTC
          send: 1 events, 0 content bytes
          slack_message: 1 events, 9 content bytes
        2023-11-14 22:16:00 UTC
          send: 1 events, 0 content bytes
          send_confirmed: 1 events, 26 content bytes
        2023-11-14 22:17:00 UTC
          send_confirmed: 1 events, 17 content bytes
          wake_finish: 1 events, 0 content bytes
        2023-11-14 22:18:00 UTC
          wake_claim: 1 events, 0 content bytes
        sends 1 allowed, 1 held, hold rate 0.50
        wakes {"dm": 2}
        settled without a turn 1
        claims 1, starts 1, notes shown 0
        finishes {"completed": 1}
        refusals {}
        dm replies: 1 threaded, 1 top level
    "#]]
    .assert_eq(&out);
}

/// The schema's non-content strings are exactly the reviewed list: a field newly marked
/// `(anima.v1.content) = false` must be reviewed here, and a reviewed one that became content
/// (like Linear's `issue_url`) leaves the list.
#[test]
fn the_non_content_strings_of_the_schema_are_exactly_the_reviewed_ones() {
    let pool = DescriptorPool::decode(EVENTS_DESCRIPTOR_SET).expect("the descriptor set decodes");
    let redactor = Redactor::schema();
    let marked: std::collections::BTreeSet<String> = pool
        .all_messages()
        .flat_map(|message| message.fields().collect::<Vec<_>>())
        .filter(|field| redactor.is_plain(field))
        .map(|field| field.full_name().to_owned())
        .collect();
    let reviewed: std::collections::BTreeSet<String> = REVIEWED_NON_CONTENT.iter().map(|f| (*f).to_owned()).collect();
    let unreviewed: Vec<&String> = marked.difference(&reviewed).collect();
    let stale: Vec<&String> = reviewed.difference(&marked).collect();
    assert!(unreviewed.is_empty(), "marked non-content without review: {unreviewed:?}");
    assert!(stale.is_empty(), "reviewed but no longer a non-content string of the schema: {stale:?}");
    assert!(!marked.contains("anima.v1.LinearSessionEvent.issue_url"), "Linear URLs end in the issue title");
}

/// The event type read from the field numbers alone (what the JetStream log puts in each
/// message's header) is the type a full decode names, for every payload kind of the schema, an
/// empty envelope, a payload this build does not know, and bytes that are not an envelope.
#[test]
fn the_header_event_type_is_the_decoded_one() {
    let redactor = Redactor::schema();
    for (event_type, bytes, _, _) in every_event_kind() {
        assert_eq!(redactor.stored_event_type(&bytes), event_type);
        assert_eq!(redactor.event_type(&bytes), event_type);
    }
    let empty = Envelope { event_id: "e".into(), ..Default::default() }.encode_to_vec();
    assert_eq!(redactor.stored_event_type(&empty), redactor.event_type(&empty));
    // Field 999 (length-delimited) is no field of this build's envelope.
    let mut unknown = empty.clone();
    unknown.extend_from_slice(&[0xBA, 0x3E, 0x01, 0x00]);
    assert_eq!(redactor.stored_event_type(&unknown), EVENT_TYPE_UNKNOWN);
    assert_eq!(redactor.event_type(&unknown), EVENT_TYPE_UNKNOWN);
    let garbage = [0xFFu8, 0xFF, 0xFF];
    assert_eq!(redactor.stored_event_type(&garbage), EVENT_TYPE_UNDECODABLE);
    assert_eq!(redactor.event_type(&garbage), EVENT_TYPE_UNDECODABLE);
}

/// The view the runner counts, built from the fold's decode and a walk of the wire, has the
/// type, sizes and envelope fields of the full view, carries the full view's fields the figures
/// read (a finish's outcome, a confirmed send's Slack target) and no other, and gives the same
/// counts and figures. An encoding a decode reads differently from a walk of its fields (two
/// encodings of an envelope back to back: a decode merges them and keeps the later value of
/// each field) gets the full view.
#[test]
fn the_counted_view_counts_what_the_full_view_counts() {
    let redactor = Redactor::schema();
    let mut events: Vec<(String, Vec<u8>)> =
        every_event_kind().into_iter().map(|(kind, bytes, _, _)| (kind, bytes)).collect();
    let long =
        dm_from_human("anna", "D1", &ts(1), "a long text that the second encoding replaces").file("notes.txt", 9);
    let short = dm_from_human("anna", "D1", &ts(1), "short");
    events.push(("merged".into(), [long.encode_to_vec(), short.encode_to_vec()].concat()));
    let outcomes = [
        proto::WakeOutcome::Unspecified,
        proto::WakeOutcome::Completed,
        proto::WakeOutcome::Failed,
        proto::WakeOutcome::Aborted,
    ];
    for outcome in outcomes {
        events.push(("wake_finish".into(), finish("ada", "w1", outcome).encode_to_vec()));
    }
    let mut newer_outcome = finish("ada", "w1", proto::WakeOutcome::Completed);
    if let Some(Payload::WakeFinish(f)) = newer_outcome.payload.as_mut() {
        f.outcome = 99;
    }
    events.push(("wake_finish".into(), newer_outcome.encode_to_vec()));
    for (channel, thread) in [("D1", ""), ("D1", "1700000000.000100"), ("C1", ""), ("D2", " ")] {
        let mut post = confirmed("ada", channel, &ts(2), "my post");
        if let Some(Payload::SendConfirmed(c)) = post.payload.as_mut() {
            if let Some(proto::reply_target::Target::Slack(slack)) = c.target.as_mut().and_then(|t| t.target.as_mut()) {
                slack.thread_ts = thread.to_owned();
            }
        }
        events.push(("send_confirmed".into(), post.encode_to_vec()));
    }
    let (mut full_counts, mut counted_counts) =
        (AnalyticsCounts::new(TimeBucket::Day), AnalyticsCounts::new(TimeBucket::Day));
    for (seq, (kind, bytes)) in events.iter().enumerate() {
        let envelope = Envelope::decode(&bytes[..]).expect("a filled event decodes");
        let mut full = redactor.redact(seq as u64 + 1, 1_000, "subject", bytes);
        let mut counted = redactor.redact_counted(seq as u64 + 1, 1_000, "subject", bytes, &envelope);
        let sizes = |e: &RedactedEvent| {
            (e.event_type.clone(), e.event_bytes, e.content_bytes, e.event_id.clone(), e.source.clone())
        };
        assert_eq!(sizes(&counted), sizes(&full), "{kind}");
        assert_eq!(
            (counted.occurred_at_ms, counted.min_reader_version, &counted.subject),
            (full.occurred_at_ms, full.min_reader_version, &full.subject),
            "{kind}"
        );
        let read_by_the_figures: Vec<_> = full
            .fields
            .iter()
            .filter(|f| FIGURE_FIELDS.contains(&(full.event_type.as_str(), f.path.as_str())))
            .cloned()
            .collect();
        if kind == "merged" {
            assert_eq!(counted.fields, full.fields, "{kind}: the full view");
        } else {
            assert_eq!(counted.fields, read_by_the_figures, "{kind}: the fields the figures read, and no other");
        }
        // The figures of a finish and of a confirmed post read fields; give them the outcomes
        // the fold gives them.
        let outcome =
            (kind == "wake_finish").then(|| RedactedOutcome { kind: "finished".into(), ..Default::default() });
        (full.outcome, counted.outcome) = (outcome.clone(), outcome);
        full_counts.observe(&full);
        counted_counts.observe(&counted);
    }
    let figures = &full_counts.total;
    assert_eq!(figures.finishes_by_outcome.values().sum::<u64>(), 6, "{figures:?}");
    assert_eq!((figures.dm_replies_threaded, figures.dm_replies_top_level), (1, 2), "{figures:?}");
    assert_eq!(counted_counts, full_counts);
}
