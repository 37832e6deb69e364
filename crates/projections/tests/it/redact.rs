//! The redacted view and analytics (DESIGN §3.4, §4.11): derived from the content marking of the
//! stored schema, with no content at all — every event kind, filled with unique markers in every
//! content field, leaves no marker in any redacted output — and the counts and figures analytics
//! computes from redacted events and the fold's verdicts.

use anima_projections::proto::{self, envelope::Payload, Envelope, EVENTS_DESCRIPTOR_SET};
use anima_projections::redact::{
    AnalyticsCounts, RedactedEvent, RedactedOutcome, RedactedValue, Redactor, TimeBucket, EVENT_TYPE_UNDECODABLE,
    EVENT_TYPE_UNKNOWN, PAYLOAD_ONEOF,
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

/// Fills every field of `message`: strings the schema marks non-content get plain ids, every
/// other string (and every bytes field) gets a unique marker, remembered in `markers`.
fn fill(message: &mut DynamicMessage, markers: &mut Vec<String>, depth: usize) {
    let redactor = Redactor::schema();
    let descriptor = message.descriptor();
    for field in descriptor.fields() {
        if field.containing_oneof().is_some() && depth == 0 {
            continue;
        }
        let one = |markers: &mut Vec<String>| -> Option<Value> {
            Some(match field.kind() {
                Kind::String if redactor.is_plain(&field) => Value::String(format!("id{}", markers.len())),
                Kind::String => {
                    let marker = format!("MARKER{:04}Z", markers.len());
                    markers.push(marker.clone());
                    Value::String(marker)
                }
                Kind::Bytes => {
                    let marker = format!("MARKER{:04}Z", markers.len());
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
                    fill(&mut nested, markers, depth + 1);
                    Value::Message(nested)
                }
                Kind::Message(_) => return None,
            })
        };
        let value = if field.is_list() {
            let items: Vec<Value> = (0..2).filter_map(|_| one(markers)).collect();
            Value::List(items)
        } else {
            match one(markers) {
                Some(value) => value,
                None => continue,
            }
        };
        // A oneof nested in a payload keeps the last member set; fine for leak checks.
        message.set_field(&field, value);
    }
}

/// One envelope per payload kind of the schema, every field filled; with its markers.
fn every_event_kind() -> Vec<(String, Vec<u8>, Vec<String>)> {
    let descriptor = envelope_descriptor();
    let mut out = Vec::new();
    for field in descriptor.fields() {
        let in_payload = field.containing_oneof().is_some_and(|o| o.name() == PAYLOAD_ONEOF);
        let Kind::Message(payload_type) = field.kind() else { continue };
        if !in_payload {
            continue;
        }
        let mut markers = Vec::new();
        let mut envelope = DynamicMessage::new(descriptor.clone());
        fill(&mut envelope, &mut markers, 0);
        let mut payload = DynamicMessage::new(payload_type);
        fill(&mut payload, &mut markers, 1);
        envelope.set_field(&field, Value::Message(payload));
        out.push((field.name().to_owned(), envelope.encode_to_vec(), markers));
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

#[test]
fn no_content_of_any_event_kind_reaches_the_redacted_view() {
    let kinds = every_event_kind();
    assert!(kinds.len() >= 10, "found only {} payload kinds", kinds.len());
    let mut state = anima_projections::State::new();
    let mut counts = AnalyticsCounts::new(TimeBucket::Minute);
    let mut all_markers = Vec::new();
    for (index, (kind, stored, markers)) in kinds.iter().enumerate() {
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
        counts.observe(&redacted);
        all_markers.extend(markers.iter().cloned());
    }
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
              => RedactedOutcome { kind: "journaled", wake_reason: Some("dm"), refusal: None, settled_without_turn: 0, new_messages: 0, shown: 0, omitted: 0, duplicate_message: false, ordinal: 1, note_shown: false, memory_outcome: None, memory_delay_seconds: None, not_queued: None }
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
              => RedactedOutcome { kind: "send_allowed", wake_reason: None, refusal: None, settled_without_turn: 0, new_messages: 0, shown: 0, omitted: 0, duplicate_message: false, ordinal: 0, note_shown: false, memory_outcome: None, memory_delay_seconds: None, not_queued: None }
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
